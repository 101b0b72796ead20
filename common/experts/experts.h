/* common/experts/experts.h: the ONE interface through which the layers reach the
 * routed MXFP4 experts (docs/MODEL.md 4.1, 5.3-5.5): where each expert lives on disk, and a
 * per-layer cache of their bytes streamed from the shards.
 *
 * Owns: per MoE layer of a range, the expert table (for every expert its six
 * tensors w1p, w1s, w2p, w2s, w3p, w3s: shard, absolute offset, validated
 * dtype U8 and exact byte sizes; whether they lie back to back so one read
 * fetches the expert; the disk order (shard name, offset)); a cache of slot
 * buffers (LRU, except that a batch keeps the experts it needs last: see
 * experts.c) with a byte budget (K3_EXPERT_GB split evenly over the range's MoE
 * layers, at least one slot per layer, checked against MemAvailable); the
 * loader threads (K3_LOAD_THREADS per drive: one read queue per drive of a
 * placement, common/experts/placement.h) that read misses; the usage history
 * (K3_USAGE, <model>/.k3_usage); statistics.
 * Borrows: the safetensors index (owned by the model), read through st_pread
 * on each shard's own fds (a shard on another --dirs drive reads there).
 * Threads: every function may be called from any thread; each layer has one
 * mutex and one condition variable (slot state changes, unpins). A batch is
 * used by one thread at a time. Reads run on the loader threads without the
 * layer lock, so expert j computes while j+1.. load (K3_PIPE).
 */
#ifndef K3_EXPERTS_H
#define K3_EXPERTS_H
#include <stddef.h>
#include <stdint.h>

#include "common/ckpt/config.h"
#include "common/base/err.h"
#include "common/kernels/kernels.h"
#include "common/ckpt/safetensors.h"

/* The six tensors of an expert, in the engine's slot layout order. */
enum { K3_EXP_W1P = 0, K3_EXP_W1S, K3_EXP_W2P, K3_EXP_W2S, K3_EXP_W3P, K3_EXP_W3S, K3_EXP_PARTS };

/* Byte sizes of one expert's parts from the config (docs/MODEL.md 4.1):
 * w1/w3 [moe_inter][latent] (gate/up), w2 [latent][moe_inter] (down). */
typedef struct k3_expert_geom {
    uint64_t bytes[K3_EXP_PARTS];      /* packed = rows*cols/2, scale = rows*cols/32 */
    uint64_t layout_off[K3_EXP_PARTS]; /* offset of each part in a slot */
    uint64_t total;                    /* bytes of one expert (17,547,264 for K3) */
} k3_expert_geom;

void k3_expert_geom_init(k3_expert_geom *g, const k3_config *cfg);

/* A view of one acquired expert; valid until k3_experts_release. */
typedef struct k3_expert_view {
    int32_t id;
    k3_mxfp4 w1; /* gate [moe_inter][latent] */
    k3_mxfp4 w2; /* down [latent][moe_inter] */
    k3_mxfp4 w3; /* up   [moe_inter][latent] */
} k3_expert_view;

typedef struct k3_expert_stats {
    uint64_t hits;   /* experts served from a slot */
    uint64_t misses; /* experts read from disk */
    uint64_t bytes;  /* bytes read from disk (whole expert, alignment padding excluded) */
    double read_ms;  /* wall time the consumer waited for reads (stage: "read") */
    double io_ms;    /* wall time with at least one read of a batch in flight */
    double busy_ms;  /* read time summed over loader threads */
} k3_expert_stats;

typedef struct k3_experts k3_experts;

typedef struct k3_experts_opts {
    size_t budget_bytes;    /* total slot budget over all MoE layers of the range */
    int direct;             /* 1: O_DIRECT reads where the shard allows them (K3_DIRECT) */
    int pipe;               /* 1: expert j computes while j+1.. load (K3_PIPE);
                               0: a window's misses are all read before the first is used */
    int load_threads;       /* loader threads, 1..K3_MAX_LOAD_THREADS; 0 = 4 */
    uint64_t mem_available; /* bytes of RAM the slots may use; 0 = MemAvailable */
    const struct k3_placement *placement; /* expert striping (common/experts/placement.h),
                                             borrowed, checked by the caller; NULL = the
                                             experts are read from the checkpoint's shards */
    uint32_t drive_mask; /* with a placement: bit d set = this process reads drive d's
                            experts (opens its files); the others are another worker's
                            (common/layers/moe_remote.h) and never read here; 0 = all */
    int read_depth;      /* with a placement of >= 2 drives: misses of an any-order batch
                            each drive has read or waiting to be used at once, in staging
                            buffers outside the cache (K3_READ_DEPTH); 0 = 2, -1 = off
                            (the cache slots bound the reads in flight, as one drive) */
} k3_experts_opts;

/* Opens an empty store for layers [layer_a, layer_b) of cfg (copied). Tables
 * are filled per layer by k3_experts_load_layer. idx is borrowed. Fails with
 * K3_ERR_LIMIT naming the bytes needed when not even one slot per MoE layer
 * fits the available memory; a budget above what fits is lowered (warned),
 * a budget below the one-slot floor is raised to it (warned). */
k3_status k3_experts_open(k3_experts **out, st_index *idx, const k3_config *cfg, int layer_a,
                          int layer_b, const k3_experts_opts *opts, char *err, size_t errlen);
/* Waits for the loader threads to stop. No batch may be open. */
void k3_experts_close(k3_experts **s);

/* Looks up and validates the experts of MoE layer `layer`: names
 * <prefix>model.layers.<layer>.block_sparse_moe.experts.<e>.w{1,2,3}.weight_
 * {packed,scale}. A wrong dtype, shape or byte size refuses the load naming
 * the expert and both sizes; an expert with all six tensors absent only warns
 * (*n_missing counts them) and fails when selected; a partially present
 * expert is an error. Also computes the disk order. Call once per MoE layer,
 * before any batch on it. */
k3_status k3_experts_load_layer(k3_experts *s, const char *prefix, int layer, int *n_missing,
                                char *err, size_t errlen);

/* Slots of a layer (the most experts one batch holds at once). */
int k3_experts_slots(const k3_experts *s, int layer);
/* Bytes of one slot buffer (an expert plus O_DIRECT alignment room). */
size_t k3_experts_slot_bytes(const k3_experts *s);

/* The ids flagged in selected [n_experts] (nonzero = selected), written to
 * ids in disk order (shard file name, then offset; missing experts last,
 * by id). Returns the count. */
int k3_experts_disk_order(const k3_experts *s, int layer, const uint8_t *selected, int32_t *ids);

/* Placement drive of expert e of layer (0 without a placement). */
int k3_experts_drive_of(const k3_experts *s, int layer, int32_t e);
/* 1 when this store reads expert e of layer itself (no placement, no
 * drive mask, or its drive is in the mask). */
int k3_experts_own(const k3_experts *s, int layer, int32_t e);
/* Drives the store reads from: the placement's, 1 without one. */
int k3_experts_drives(const k3_experts *s);
/* Reorders ids [n] so that consecutive ones are on different drives where
 * it can (round robin over the drives, each drive's ids in their given
 * order): a window of reads then keeps every drive busy. No-op with one
 * drive. */
void k3_experts_interleave(const k3_experts *s, int layer, int32_t *ids, int n);
/* Bytes read from drive d since open (quiet warm-start reads included). */
uint64_t k3_experts_drive_bytes(k3_experts *s, int d);

/* 1 when expert e of layer is in a slot or being read into one (a snapshot:
 * an ordering hint, it may change right after). */
int k3_experts_cached(k3_experts *s, int layer, int32_t e);

/* ---- batches: one MoE step's experts, streamed ----
 *
 * A batch takes the n distinct experts of a step in the order they will be
 * used (disk order), admits them into slots as a window of at most
 * k3_experts_slots() experts (hits pinned, misses queued to the loaders in
 * that order), and hands them out one at a time:
 *
 *   k3_experts_batch_open(&b, s, layer, ids, n, &stats, err, errlen);
 *   for (i = 0; i < n; i++) {
 *       k3_experts_batch_get(b, i, &view, err, errlen);   waits for expert i
 *       ... compute with view ...
 *       k3_experts_batch_put(b, i);                       frees its slot
 *   }
 *   k3_experts_batch_close(&b);                           also after an error
 *
 * Errors name the layer, the expert and the shard: K3_ERR_MISSING for an
 * expert absent from the checkpoint, K3_ERR_IO for a short read or EIO,
 * K3_ERR_ARG for a bad id. A failed read leaves its slot empty; other
 * experts and later batches are unaffected. */
typedef struct k3_expert_batch k3_expert_batch;

/* ids are copied; stats (may be NULL) receives the batch's counters at
 * close. Checks the ids before anything is read. */
k3_status k3_experts_batch_open(k3_expert_batch **out, k3_experts *s, int layer, const int32_t *ids,
                                int n, k3_expert_stats *stats, char *err, size_t errlen);
/* Waits (condition variable) until expert i is in memory and fills *view,
 * valid until k3_experts_batch_put(b, i). i must go 0, 1, .. n-1. */
k3_status k3_experts_batch_get(k3_expert_batch *b, int i, k3_expert_view *view, char *err,
                               size_t errlen);
/* Done with expert i: unpins it and admits the next expert of the window. */
void k3_experts_batch_put(k3_expert_batch *b, int i);
/* Waits for the batch's reads in flight, unpins what is still pinned, adds
 * the counters to the caller's stats and the store's totals. NULL is fine. */
void k3_experts_batch_close(k3_expert_batch **b);

/* ---- any-order batches: every drive busy (expert striping) ----
 *
 * The same contract, except that the consumer takes the experts in the
 * order they become ready:
 *
 *   k3_experts_batch_open_any(&b, s, layer, ids, n, &stats, err, errlen);
 *   for (k = 0; k < n; k++) {
 *       k3_experts_batch_next(b, &i, &view, err, errlen);  some ready expert i
 *       ... compute with view ...
 *       k3_experts_batch_put(b, i);
 *   }
 *
 * With a placement of >= 2 drives (and read_depth not -1, K3_PIPE on) the
 * misses are read into staging buffers, up to read_depth per drive at once,
 * not into cache slots: each drive reads its share of the batch back to
 * back whatever the cache size, and a put moves the expert into the cache
 * (buffers swapped, no copy) when a slot not needed by the batch is free.
 * The hits are pinned at open. Without that the batch is an ordinary one
 * and next returns 0, 1, .. n-1. The caller must not depend on the order
 * (common/layers/moe.c sums the experts in id order). Each batch holds at
 * most drives x read_depth staging buffers; the store keeps up to twice
 * that many for reuse and allocates past it only for a batch holding none.
 * Two batches on one layer may read the same expert twice. */
k3_status k3_experts_batch_open_any(k3_expert_batch **out, k3_experts *s, int layer,
                                    const int32_t *ids, int n, k3_expert_stats *stats, char *err,
                                    size_t errlen);
/* Waits until an expert of the batch not yet handed out is in memory (the
 * lowest index among the ready ones), fills *view and *i. */
k3_status k3_experts_batch_next(k3_expert_batch *b, int *i, k3_expert_view *view, char *err,
                                size_t errlen);
/* Reads in flight per drive an any-order batch of this store gets (0 when
 * its batches are ordinary: no placement of >= 2 drives, or turned off). */
int k3_experts_read_depth(const k3_experts *s);

/* Lends expert e of layer to fn(ctx, view) for the time of the call (read
 * from disk unless cached; expert_fetch.c). Not counted as usage nor in
 * k3_experts_totals. fn's status is returned; store errors as for a batch. */
k3_status k3_experts_fetch(k3_experts *s, int layer, int32_t e,
                           k3_status (*fn)(void *ctx, const k3_expert_view *v, char *err,
                                           size_t errlen),
                           void *ctx, char *err, size_t errlen);

/* Counts ids [n] of layer as used once each, as a batch's admission does:
 * for experts a step computed without the store (the Vulkan tier's). */
void k3_experts_count_use(k3_experts *s, int layer, const int32_t *ids, int n);

/* Totals since open (all layers). */
void k3_experts_totals(k3_experts *s, k3_expert_stats *out);
/* Bytes currently held in slot buffers. */
size_t k3_experts_resident_bytes(k3_experts *s);

/* ---- usage history (docs/MODEL.md 5.5, common/experts/expert_usage.c) ----
 *
 * Every expert a batch uses is counted per layer. The history file is text:
 *   -1 <n_layers> <n_experts>   (the model's, before K3_LAYERS truncation)
 *   -2 1 <engine_id>            (FNV-1a 32 of "kimi_k3")
 *   <layer> <expert> <count>    (non-zero counts only)
 * An all-zero history is a zero-byte file. Dims or engine id that differ
 * are refused (K3_ERR_MISMATCH, naming the file and both values).
 *
 * One file serves every process of a model (in-process coordinator, each
 * worker's range): load adds the rows of the store's layers to its counts;
 * save, under an exclusive flock on <path>.lock, re-reads the file, adds the
 * selections made since this store's last load/save to its own layers' rows,
 * keeps all other rows, and renames <path>.tmp over it. A missing file
 * loads as empty; a file that is malformed or mismatched at save time is
 * left alone and the save fails. */
k3_status k3_experts_usage_load(k3_experts *s, const char *path, char *err, size_t errlen);
k3_status k3_experts_usage_save(k3_experts *s, const char *path, char *err, size_t errlen);
/* Reads the most used experts of every loaded layer into its slots, up to
 * half the slots of the layer, hottest first (disk order inside the layer),
 * unpinned. Not counted as usage nor in k3_experts_totals. *n_read (may be
 * NULL) counts them. */
k3_status k3_experts_warm(k3_experts *s, int *n_read, char *err, size_t errlen);
/* Adds the counts of the history file at path into rows
 * [(n_layers_full + 1) * n_experts] (a missing file adds nothing); the
 * checks of k3_experts_usage_load. For readers without a store
 * (common/experts/placement.h's callers). */
k3_status k3_experts_usage_read(const char *path, int n_layers_full, int n_experts, uint64_t *rows,
                                char *err, size_t errlen);
/* Count recorded for (layer, expert) (tests, reports). */
uint64_t k3_experts_usage_count(k3_experts *s, int layer, int expert);

#endif
