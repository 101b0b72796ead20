/* common/experts.h: the ONE interface through which the layers reach the
 * routed MXFP4 experts (spec 4.1): where each expert lives on disk, and a
 * per-layer cache of their bytes.
 *
 * Owns: per MoE layer of a range, the expert table (for every expert its six
 * tensors w1p, w1s, w2p, w2s, w3p, w3s: shard, absolute offset, validated
 * dtype U8 and exact byte sizes; whether they lie back to back so one read
 * fetches the expert; the disk order (shard name, offset)) and an LRU of slot
 * buffers with a byte budget (K3_EXPERT_GB, split evenly over the range's MoE
 * layers, at least one slot per layer). Slots in use are pinned and never
 * evicted. Statistics: hits, misses, bytes read, read time.
 * Borrows: the safetensors index (owned by the model), read through st_pread.
 * Threads: every function may be called from any thread; each layer has its
 * own mutex (held across a miss's read) and a condition variable for callers
 * waiting on a pinned slot. A caller holds at most one acquisition per layer
 * at a time and asks for at most k3_experts_slots() experts in it; that rule
 * makes waiting deadlock-free (acquisitions are all-or-nothing).
 *
 * The streaming issue replaces the read path (prefetch, O_DIRECT pipeline)
 * behind these same functions; the layers never see how bytes arrive.
 */
#ifndef K3_EXPERTS_H
#define K3_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "err.h"
#include "kernels.h"
#include "safetensors.h"

/* The six tensors of an expert, in the engine's slot layout order. */
enum { K3_EXP_W1P = 0, K3_EXP_W1S, K3_EXP_W2P, K3_EXP_W2S, K3_EXP_W3P, K3_EXP_W3S, K3_EXP_PARTS };

/* Byte sizes of one expert's parts from the config (spec 4.1):
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
    uint64_t hits;   /* acquisitions served from a slot */
    uint64_t misses; /* acquisitions that read from disk */
    uint64_t bytes;  /* bytes read from disk */
    double read_ms;  /* wall time spent reading (including waits on slots) */
} k3_expert_stats;

typedef struct k3_experts k3_experts;

typedef struct k3_experts_opts {
    size_t budget_bytes; /* total slot budget over all MoE layers of the range */
    int direct;          /* 1: O_DIRECT reads where the shard allows them */
} k3_experts_opts;

/* Opens an empty store for layers [layer_a, layer_b) of cfg (copied). Tables
 * are filled per layer by k3_experts_load_layer. idx is borrowed. */
k3_status k3_experts_open(k3_experts **out, st_index *idx, const k3_config *cfg, int layer_a,
                          int layer_b, const k3_experts_opts *opts, char *err, size_t errlen);
void k3_experts_close(k3_experts **s);

/* Looks up and validates the experts of MoE layer `layer`: names
 * <prefix>model.layers.<layer>.block_sparse_moe.experts.<e>.w{1,2,3}.weight_
 * {packed,scale}. A wrong dtype, shape or byte size refuses the load naming
 * the expert and both sizes; an expert with all six tensors absent only warns
 * (*n_missing counts them) and fails when selected; a partially present
 * expert is an error. Also computes the disk order. Call once per MoE layer,
 * before any acquisition on it. */
k3_status k3_experts_load_layer(k3_experts *s, const char *prefix, int layer, int *n_missing,
                                char *err, size_t errlen);

/* Slots of a layer (how many experts one acquisition may pin). */
int k3_experts_slots(const k3_experts *s, int layer);

/* The ids flagged in selected [n_experts] (nonzero = selected), written to
 * ids in disk order (shard file name, then offset; missing experts last,
 * by id). Returns the count. */
int k3_experts_disk_order(const k3_experts *s, int layer, const uint8_t *selected, int32_t *ids);

/* Pins the n experts ids[] (distinct, n <= k3_experts_slots) of `layer`,
 * reading the missing ones (one pread per expert when its six tensors are
 * contiguous), and fills views[n]. Waits while too few slots are unpinned.
 * Errors name the layer, the expert and the shard: K3_ERR_MISSING for an
 * expert absent from the checkpoint, K3_ERR_IO for a short read or EIO,
 * K3_ERR_ARG for an id out of range or n > slots. On error nothing stays
 * pinned. stats (may be NULL) accumulates this call's counters. */
k3_status k3_experts_acquire(k3_experts *s, int layer, const int32_t *ids, int n,
                             k3_expert_view *views, k3_expert_stats *stats, char *err,
                             size_t errlen);
/* Unpins the experts of a successful k3_experts_acquire. */
void k3_experts_release(k3_experts *s, int layer, const int32_t *ids, int n);

/* Totals since open (all layers). */
void k3_experts_totals(k3_experts *s, k3_expert_stats *out);
/* Bytes currently held in slot buffers. */
size_t k3_experts_resident_bytes(k3_experts *s);

#endif
