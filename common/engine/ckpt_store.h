/* common/engine/ckpt_store.h: turn checkpoints parked on disk, the file
 * format and the directory both sides use (docs/SERVING.md "Turn
 * checkpoints", docs/PROTOCOL.md "Checkpoints"): the coordinator parks a
 * session's ids (and, in process, the whole state) in its --ckpt-dir; a
 * worker parks its layers' state in its own --ckpt-dir.
 *
 * Owns: the file names and format, the atomic write (a uniquely named .tmp
 * file, fsync, rename), the lookup by key or by a prompt's ids, and the
 * bound on the files kept (count and bytes; the oldest by mtime go first).
 * Borrows: the caller's payload writer / reader during a call. Threads:
 * every function may be called from any thread; calls on one store
 * serialize on its mutex only for the directory scans and the pruning.
 *
 * A checkpoint's key (k3_ckpt_key) is derived from the ids [0, P), the
 * position P and the model fingerprint, so a coordinator and its workers
 * name the same checkpoint without sharing a session: a RESTORE after a
 * restart names it by key (docs/PROTOCOL.md "Checkpoints", 1.3).
 *
 * File DIR/KKKKKKKKKKKKKKKK-PPPPPPPP.k3ck (K: the key in hex, P: the
 * position in decimal, fixed widths), little-endian (the project refuses
 * big-endian hosts):
 *   off  0  magic  8 bytes "K3CKPT\0\2" (the last byte: the format version, 2)
 *   off  8  fp     u64 the model fingerprint (k3_model_fingerprint): another
 *                      model's or numerics' file is refused
 *   off 16  key    u64 the key the name says
 *   off 24  pos    u32 P, 1..K3_MAX_CTX
 *   off 28  n_ids  u32 0 (a worker's file) or P (the ids follow)
 *   off 32  first  u32 the state's layer range [first, last): a worker's
 *   off 36  last   u32   range; [0, 0) for a coordinator's ids-only file
 *   off 40  bytes  u64 the payload's bytes (stage.h k3_state_dump_bytes)
 *   off 48  ids    int32[n_ids]
 *           payload bytes
 * Every size is checked against the file's size and the caller's expected
 * payload size before anything is allocated or read.
 */
#ifndef K3_CKPT_STORE_H
#define K3_CKPT_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/base/err.h"

#define K3_CKPT_FILE_VERSION 2
#define K3_CKPT_HDR_BYTES    48

typedef struct k3_ckpt_store k3_ckpt_store;

/* The checkpoint key of ids [0, n) under model fingerprint fp: FNV-1a 64
 * over fp, n and the ids (int32 little-endian); never 0. */
uint64_t k3_ckpt_key(uint64_t fp, const int32_t *ids, int n);

/* Writes / reads a payload of exactly the bytes given (a state dump). */
typedef k3_status (*k3_ckpt_dump_fn)(void *ctx, FILE *f, char *err, size_t errlen);
typedef k3_status (*k3_ckpt_load_fn)(void *ctx, FILE *f, int pos, char *err, size_t errlen);

/* Creates dir if missing (mode 0700). what: the option named in errors
 * ("--ckpt-dir"). [first, last): the layer range of the payloads (0, 0 for
 * ids-only files). max_files >= 1 and max_bytes >= 1: what is kept. */
k3_status k3_ckpt_store_open(k3_ckpt_store **out, const char *dir, const char *what, uint64_t fp,
                             int first, int last, int max_files, uint64_t max_bytes, char *err,
                             size_t errlen);
void k3_ckpt_store_close(k3_ckpt_store **d);
const char *k3_ckpt_store_dir(const k3_ckpt_store *d);
uint64_t k3_ckpt_store_fp(const k3_ckpt_store *d);

/* Parks a checkpoint at position pos under key: ids [0, pos) when ids is
 * not NULL, then `bytes` payload bytes written by dump (may be NULL when
 * bytes is 0). Prunes afterwards. */
k3_status k3_ckpt_store_save(k3_ckpt_store *d, uint64_t key, int pos, const int32_t *ids,
                             uint64_t bytes, k3_ckpt_dump_fn dump, void *ctx, char *err,
                             size_t errlen);

/* The path of the file of (key, pos), whether or not it exists. */
void k3_ckpt_store_path(const k3_ckpt_store *d, uint64_t key, int pos, char *path, size_t cap);

/* The deepest parked checkpoint at a position p with min_pos < p < n and
 * p <= max_ctx whose name's key is k3_ckpt_key(fp, ids, p): 1, *pos and its
 * path (cap bytes), else 0. Reads the directory only. */
int k3_ckpt_store_find(k3_ckpt_store *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                       char *path, size_t cap, int *pos);

/* Loads the file at path, which must hold (key, pos) of this store's
 * fingerprint and layer range with a payload of want_bytes: checks the
 * header, the sizes, the ids against ids[0, pos) when ids is not NULL (the
 * file must then carry them), then calls load (when not NULL, also for an
 * empty payload). Errors name the file. */
k3_status k3_ckpt_store_load(k3_ckpt_store *d, const char *path, uint64_t key, int pos,
                             const int32_t *ids, uint64_t want_bytes, k3_ckpt_load_fn load,
                             void *ctx, char *err, size_t errlen);

#endif
