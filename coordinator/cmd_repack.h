/* coordinator/cmd_repack.h: the `k3-coordinator repack` subcommand.
 *
 * Owns: the command line of the container writer (docs/DEPLOY.md
 * "Workstation", docs/MODEL.md 2.3). Borrows: common/ckpt/container.h, which
 * does the work. Called from main() (single thread) with argv[0] = "repack".
 *
 *   k3-coordinator repack SRC DST [--bits 4|8] [--mla-bits N] [--head-bits N]
 *                         [--shards 1,2,94] [--verify-full]
 *
 * Returns the process exit code: 0 done, 1 error (named on stderr), 2 usage.
 */
#ifndef K3_CMD_REPACK_H
#define K3_CMD_REPACK_H

int cmd_repack(int argc, char **argv);

#endif
