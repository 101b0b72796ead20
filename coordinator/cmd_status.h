/* coordinator/cmd_status.h: the `k3-coordinator status` subcommand.
 *
 * Owns: its command line and one probe socket per worker while it runs.
 * Called from main() (single thread) with argv[0] = "status".
 *
 *   k3-coordinator status --workers EP,... [--curve-secret FILE
 *                         --worker-keys FILE] [--insecure] [--timeout-ms MS]
 *
 * Prints one table row per worker: host, worker name, layer range, stripe
 * (its --dirs), build identity, drive GB/s, uptime, sessions held, expert
 * cache hit rate and state ("ok", "ok (idle)" when no coordinator is
 * registered, or why a coordinator with this build and key would be
 * refused). Returns 0 when every worker is ok, 1 when any is not, 2 on a
 * usage error.
 */
#ifndef K3_CMD_STATUS_H
#define K3_CMD_STATUS_H

int cmd_status(int argc, char **argv);

#endif
