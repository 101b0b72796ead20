/* coordinator/cmd_plan.h: the `k3-coordinator plan` subcommand.
 *
 * Owns: choosing workers, layer ranges, drives, cache budgets and each
 * drive's share of the expert bytes from measured drives, and writing the
 * plan file (docs/DEPLOY.md "Workstation": format k3shard-plan version 1).
 * Borrows: coordinator/drives.h (measurements), coordinator/model_info.h.
 * Called from main() (single thread).
 *
 *   k3-coordinator plan --model DIR --drives D1,D2,.. [--ram GB] [--out FILE]
 *
 * Returns the process exit code: 0 written, 1 error, 2 usage.
 */
#ifndef K3_CMD_PLAN_H
#define K3_CMD_PLAN_H

int cmd_plan(int argc, char **argv);

#endif
