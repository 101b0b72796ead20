/* coordinator/ckpt_dir.h: the coordinator's turn checkpoints parked on disk
 * (--ckpt-dir), so that a coordinator restarted after a crash resumes a
 * conversation from its last turn boundary instead of prefilling it again
 * (docs/SERVING.md "Turn checkpoints").
 *
 * Owns: the coordinator's use of a checkpoint store (the file format, the
 * atomic write and the pruning are common/engine/ckpt_store.h's): in
 * process a file holds the ids and the whole state (layers [0, L)); with
 * workers it holds the ids only (layers [0, 0)) and each worker parks its
 * own layers' state in its own --ckpt-dir under the same key
 * (docs/PROTOCOL.md "Checkpoints", 1.3), which a load then names in a
 * RESTORE (the cluster trunk's state_load). Borrows: the trunk and its
 * session state during a call. Threads: any (the store serializes its
 * directory scans).
 */
#ifndef K3_CKPT_DIR_H
#define K3_CKPT_DIR_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/engine/ckpt_store.h"
#include "coordinator/generate.h"

typedef struct k3_ckpt_dir k3_ckpt_dir;

/* Creates dir if missing (mode 0700). [first, last): the layers whose state
 * the files hold ([0, L) in process, [0, 0) with workers). max_files >= 1. */
k3_status k3_ckpt_dir_open(k3_ckpt_dir **out, const char *dir, uint64_t fingerprint, int first,
                           int last, int max_files, char *err, size_t errlen);
void k3_ckpt_dir_close(k3_ckpt_dir **d);

/* The key of ids [0, n) (k3_ckpt_key with this store's fingerprint). */
uint64_t k3_ckpt_dir_key(const k3_ckpt_dir *d, const int32_t *ids, int n);

/* Parks the session state `state` of trunk t (at position n) with its ids
 * [0, n): the trunk's state dump when it has one, else the ids only. */
k3_status k3_ckpt_dir_save(k3_ckpt_dir *d, k3_trunk *t, void *state, const int32_t *ids, int n,
                           char *err, size_t errlen);

/* The deepest parked checkpoint at a position p with min_pos < p < n and p
 * <= max_ctx whose key is that of ids[0, p): 1 and *pos, path (cap bytes),
 * else 0. Reads the directory only. */
int k3_ckpt_dir_find(k3_ckpt_dir *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                     char *path, size_t cap, int *pos);

/* Loads the file at path (position pos, as found) into state, after
 * checking its header and that its ids equal ids[0, pos), through the
 * trunk's state_load (a cluster: RESTORE by key on every worker). On
 * failure the state is reset. */
k3_status k3_ckpt_dir_load(k3_ckpt_dir *d, const char *path, int pos, const int32_t *ids,
                           k3_trunk *t, void *state, char *err, size_t errlen);

#endif
