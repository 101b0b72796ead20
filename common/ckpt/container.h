/* common/ckpt/container.h: the repacked container (docs/MODEL.md 2.3,
 * docs/DEPLOY.md "Workstation"): writing one from a Hugging Face snapshot,
 * rebuilding and checking its index.
 *
 * Owns: the classification of every source tensor (dropped, passed through,
 * quantized in which class), the output shard layout (non-experts in source
 * offset order, then the experts sorted by id, w1/w2/w3, packed before
 * scale, so one read fetches an expert), the per-shard <name>.tmp + rename
 * that makes an interrupted run resumable, the index rebuilt from every
 * completed shard on every run, and --verify-full.
 * Borrows: the source through common/ckpt/safetensors.h (read-only) and the
 * engine's load-time quantizer k3_qmat_quantize (common/kernels/kernels.h):
 * the container holds exactly the bytes the engine would compute at load.
 * Threads: one caller at a time (the repack command's main thread).
 */
#ifndef K3_CONTAINER_H
#define K3_CONTAINER_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/ckpt/config.h"

/* What the repack does with one tensor (k3_repack_class). */
enum {
    K3_RP_DROP = -1, /* vision tower / projector: not written */
    K3_RP_PASS = 0,  /* bytes copied in the source dtype */
    K3_RP_EXPERT = 1 /* routed expert: copied byte-identical, id-ordered */
    /* >= 4: quantized to that many bits (4 or 8) as U8 + <name>.qs F32 */
};

/* The class of `name` (full source name, any "language_model." prefix
 * included): K3_RP_DROP, K3_RP_PASS, K3_RP_EXPERT or the bits (4 / 8) of
 * the load-time class it belongs to (docs/MODEL.md 4.2: bits, mla, head); a
 * class given 32 bits is passed through. */
int k3_repack_class(const char *name, const k3_config *cfg, int bits, int mla_bits, int head_bits);

struct k3_placement; /* common/experts/placement.h */

typedef struct k3_repack_opts {
    const char *src, *dst;
    int bits, mla_bits, head_bits; /* 4 or 8 (mla/head 32 = pass through) */
    const int *shards;             /* source shard numbers (1-based), NULL = all */
    int n_shards;
    int verify_full; /* re-read every expert byte of source and container */
    int progress;    /* progress on stderr: 2 = redrawn bar (a tty), 1 = a line per shard */
    /* repack --placement: as the stream writes a shard's experts it also
     * writes each drive's copy <drive>/k3-stripe/<shard> (the layout of
     * `k3-coordinator place`: the shard's size and header, that drive's
     * experts at their offsets, holes elsewhere; <shard>.tmp + rename and a
     * .done record), for drives off DST's file system or all with
     * place_copy. Drives on DST's file system are left to place's hard link
     * afterwards. NULL = none. Borrowed. */
    const struct k3_placement *placement;
    int place_copy;
} k3_repack_opts;

typedef struct k3_repack_stats {
    int shards_written, shards_skipped, shards_missing;
    int tensors_quantized, tensors_dropped;
    uint64_t bytes_read, bytes_written;
    uint64_t index_total; /* total_size of the rebuilt index */
    int index_shards;     /* completed shards the index covers */
    uint64_t experts_verified;
    double seconds;
} k3_repack_stats;

/* Converts src into dst (created if absent). Existing output shards are
 * skipped (resume); the index is rebuilt from every completed shard. */
k3_status k3_repack(const k3_repack_opts *o, k3_repack_stats *stats, char *err, size_t errlen);

/* Rebuilds <dir>/model.safetensors.index.json from every completed
 * *.safetensors in dir (not *.tmp): sorted weight_map, total_size = the sum
 * of their payload bytes, written to .tmp, fsynced, renamed. A tensor in two
 * shards is refused naming both, leaving the old index as it was. */
k3_status k3_container_rebuild_index(const char *dir, uint64_t *total, int *n_shards, char *err,
                                     size_t errlen);

/* Checks that <dir>/model.safetensors.index.json equals what
 * k3_container_rebuild_index would write now (every shard present, valid and
 * of the indexed size, no tensor missing or extra) and that every U8 tensor
 * has its F32 .qs sidecar. K3_OK, or the first problem named. *is_container
 * says whether dir holds any prepared (U8 + .qs) matrix. */
k3_status k3_container_check(const char *dir, int *is_container, char *err, size_t errlen);

#endif
