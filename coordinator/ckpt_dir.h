/* coordinator/ckpt_dir.h: turn checkpoints parked on disk (--ckpt-dir), so
 * that a coordinator restarted after a crash resumes a conversation from
 * its last turn boundary instead of prefilling it again (docs/SERVING.md
 * "Turn checkpoints").
 *
 * Owns: the directory's file names and format, the atomic write (a
 * uniquely named .tmp file, fsync, rename), the lookup of the deepest
 * checkpoint whose ids are a prefix of a prompt, and the bound on the files
 * kept (the oldest by mtime go first). Borrows: the trunk and its session
 * state during a call (the in-process trunk's state_dump / state_load).
 * Threads: every function may be called from any thread; calls on one
 * store serialize on its mutex only for the directory scan and the pruning.
 *
 * File DIR/HHHHHHHHHHHHHHHH-PPPPPPPP.k3ck (H: FNV-1a 64 of ids[0, P) as
 * little-endian int32, P: the position, both hex / decimal, fixed width):
 *   magic   8 bytes "K3CKPT\0\1" (the last byte is the format version, 1)
 *   fp      u64 the model fingerprint (k3_model_fingerprint): another
 *               model's or numerics' file is refused
 *   n_ids   u32 P, 1..K3_MAX_CTX
 *   pad     u32 0
 *   bytes   u64 the state's bytes (stage.h k3_state_dump_bytes at P)
 *   ids     int32[P]
 *   state   bytes
 * little-endian (the project refuses big-endian hosts). Every size is
 * checked against the file's size, the session's context and the model's
 * expected state size before anything is allocated.
 */
#ifndef K3_CKPT_DIR_H
#define K3_CKPT_DIR_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "coordinator/generate.h"

#define K3_CKPT_FILE_VERSION 1

typedef struct k3_ckpt_dir k3_ckpt_dir;

/* Creates dir if missing (mode 0700). max_files: files kept, >= 1. */
k3_status k3_ckpt_dir_open(k3_ckpt_dir **out, const char *dir, uint64_t fingerprint, int max_files,
                           char *err, size_t errlen);
void k3_ckpt_dir_close(k3_ckpt_dir **d);

/* Parks the session state `state` of trunk t (at position n) with its ids
 * [0, n). K3_ERR_ARG when the trunk cannot dump its state (a cluster). */
k3_status k3_ckpt_dir_save(k3_ckpt_dir *d, k3_trunk *t, void *state, const int32_t *ids, int n,
                           char *err, size_t errlen);

/* The deepest parked checkpoint at a position p with min_pos < p < n and p
 * <= max_ctx whose name matches ids[0, p): 1 and *pos, path (cap bytes),
 * else 0. Reads the directory only. */
int k3_ckpt_dir_find(k3_ckpt_dir *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                     char *path, size_t cap, int *pos);

/* Loads the file at path (position pos, as found) into state, after
 * checking its header and that its ids equal ids[0, pos). On failure the
 * state is reset. */
k3_status k3_ckpt_dir_load(k3_ckpt_dir *d, const char *path, int pos, const int32_t *ids,
                           k3_trunk *t, void *state, char *err, size_t errlen);

#endif
