/* coordinator/cmd_doctor.h: the `k3-coordinator doctor` subcommand.
 *
 * Owns: the checks a run needs, one printed line each with its fix
 * (docs/DEPLOY.md "Workstation"). Borrows: coordinator/model_info.h,
 * coordinator/drives.h, common/ckpt/container.h, the engine's loader (a
 * container is opened with K3_MMAP, which validates every prepared matrix
 * without reading it). Called from main() (single thread).
 *
 *   k3-coordinator doctor --model DIR [--drives D1,D2] [--workers ..] [--deep]
 *
 * Returns the process exit code: 0 every check passed, 1 one failed, 2 usage.
 */
#ifndef K3_CMD_DOCTOR_H
#define K3_CMD_DOCTOR_H

int cmd_doctor(int argc, char **argv);

#endif
