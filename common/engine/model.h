/* common/engine/model.h: the weights of Kimi K3 held by one process.
 *
 * Owns: the dense weights of a layer range [layer_a, layer_b) (quantized at
 * load per docs/MODEL.md 4.2, or taken prepared from a repacked container) and, when
 * asked (want_global), the coordinator's global tensors: the embedding (rows
 * read on demand, never resident), final norm, output AttnRes weight and
 * lm_head. The routed experts are not loaded here: each MoE layer has an
 * expert table (shard, offset, size per expert, validated at open) used by
 * the expert store (common/experts/experts.h).
 * Borrows: nothing after open; the safetensors index is owned by the model.
 * Threads: the weights are read-only after k3_model_open; the two things a
 * forward or head shares beyond them synchronize themselves: the compute
 * pool (common/base/pool.h: concurrent callers take turns job by job) and
 * the expert store (a mutex per MoE layer; sessions on the same layer share
 * its slots, experts.h). Nothing model-wide is held for a whole call, so any
 * number of threads may run k3_model_embed, k3_stage_forward and
 * k3_model_head at once on different states, at the same or different
 * layers: their matmuls and per-head loops interleave on the pool, and the
 * rest (norms, AttnRes mixes, routing, expert reads and the waits for them)
 * runs in parallel; the bits do not depend on the overlap.
 * k3_model_open, k3_model_close and k3_model_usage_save run alone.
 *
 * A worker opens [a, b) without want_global: it never opens the embedding /
 * head shard (with an index.json present, only the shards holding its layers
 * are opened). The coordinator's in-process path (--local 0) opens
 * [0, n_layers) with want_global.
 */
#ifndef K3_MODEL_H
#define K3_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/ckpt/config.h"
#include "common/base/err.h"
#include "common/base/pool.h"

typedef struct k3_model_opts {
    const char *model_dir;   /* config.json, tokenizer, index */
    const char *const *dirs; /* extra shard dirs (--dirs / K3_DIRS) */
    int n_dirs;
    int layer_a, layer_b;       /* [a, b); b <= 0 means n_layers; a = n_layers with
                                   want_global: global tensors only (no layers) */
    int want_global;            /* embedding, final norm, w_out, lm_head */
    int max_layers;             /* K3_LAYERS truncation, 0 = all */
    int bits;                   /* K3_BITS (default 4; 32 = f32) */
    int mla_bits;               /* K3_MLA_BITS (default 8) */
    int head_bits;              /* K3_HEAD_BITS (default 8) */
    int bits_explicit;          /* K3_BITS given explicitly (int8 container downcast) */
    int idot;                   /* K3_IDOT: 1 = int8-activation expert kernels */
    int dense_idot;             /* K3_DENSE_IDOT: 1 = int8-activation kernels for the int8 /
                                   int4 dense matrices too (not MODEL.md 4.2's float activations) */
    int threads;                /* compute threads (pool size), >= 1 */
    double expert_gb;           /* K3_EXPERT_GB routed-expert cache budget */
    int direct;                 /* K3_DIRECT: O_DIRECT expert reads */
    int pipe;                   /* K3_PIPE: overlap expert loads with compute */
    int load_threads;           /* K3_LOAD_THREADS */
    int read_depth;             /* K3_READ_DEPTH: k3_experts_opts.read_depth */
    double topp;                /* K3_TOPP: 0 = off */
    const char *usage_path;     /* K3_USAGE expert usage history, copied; NULL = none
                                   (the programs default it to <model_dir>/.k3_usage):
                                   loaded at open (a mismatched file fails the open),
                                   then the cache is warmed from it */
    int usage_save;             /* K3_USAGE_SAVE: k3_model_usage_save writes the file */
    int verbose;                /* per-layer load progress on stderr */
    int mmap;                   /* K3_MMAP: map the prepared U8 / F32 matrices of a repacked
                                   container read-only instead of copying them; a matrix that
                                   would need conversion is refused (docs/MODEL.md 2.3) */
    const char *placement;      /* K3_PLACEMENT: expert placement file (expert striping,
                                   common/experts/placement.h), NULL = experts from the shards */
    int expert_all_layers;      /* cross-worker striping: the expert store covers every MoE
                                   layer of the model, not only [layer_a, layer_b), so this
                                   process serves its drives' experts of any layer */
    uint32_t expert_drive_mask; /* with a placement: the drives this process reads (bit d),
                                   0 = all (k3_experts_opts.drive_mask) */
    int vk;                     /* --vk: the Vulkan expert tier (docs/VULKAN.md); a device that
                                   cannot open is warned about and the CPU computes alone */
    int vk_device;              /* --vk-device: physical device index */
    double vk_gb;               /* --vk-gb: tier budget, 10^9 bytes; <= 0 = the device's heap */
} k3_model_opts;

/* Fills opts with the defaults of docs/INTERFACES.md 3 (bits 4/8/8, idot 1,
 * expert_gb 8, direct 1, pipe 1, load_threads 4, threads = online CPUs, no
 * usage history, usage_save 1). */
void k3_model_opts_default(k3_model_opts *o);

typedef struct k3_model k3_model;

k3_status k3_model_open(k3_model **out, const k3_model_opts *opts, char *err, size_t errlen);
void k3_model_close(k3_model **m);

const k3_config *k3_model_config(const k3_model *m);
void k3_model_range(const k3_model *m, int *layer_a, int *layer_b);
/* Experts on other workers' drives (common/layers/moe_remote.h): the
 * stage's MoE layers call r for them. Set before the first step; borrowed.
 * NULL = every expert is read here. */
struct k3_moe_remote;
void k3_model_set_moe_remote(k3_model *m, const struct k3_moe_remote *r);
const struct k3_moe_remote *k3_model_moe_remote(const k3_model *m);
const struct k3_placement *k3_model_placement(const k3_model *m);
/* The compute pool every forward and head of the model runs its jobs on. */
k3_pool *k3_model_pool(k3_model *m);
/* The model fingerprint, the one HELLO compares: FNV-1a over the config
 * fingerprint (geometry and schedules, k3_config_fingerprint), the routing
 * top-p (which no numeric setting carries) and the bytes of
 * <model_dir>/model.safetensors.index.json when present (the tensor index:
 * every name and its shard; a repacked container lists its .qs sidecars).
 * The same on every process of one cluster whatever its layer range; the
 * load-time bits and kernels are compared separately (proto_numerics).
 * Fails only reading the index (named, with the cause). */
k3_status k3_model_fingerprint_dir(const char *model_dir, const k3_config *cfg, double topp,
                                   uint64_t *out, char *err, size_t errlen);
/* k3_model_fingerprint_dir of the model as opened (computed at open). */
uint64_t k3_model_fingerprint(const k3_model *m);
/* Resident bytes of dense weights (for RSS honesty reports). */
size_t k3_model_resident_bytes(const k3_model *m);
/* Saves the expert usage history of the range (merged with the file's
 * other rows, common/experts/experts.h) when the model was opened with usage_path
 * and usage_save and has MoE layers; K3_OK doing nothing otherwise. Called
 * by the programs at a clean exit. */
k3_status k3_model_usage_save(k3_model *m, char *err, size_t errlen);

/* ---- global tensors (want_global only) ---- */

/* h[t] = embedding row ids[t] (BF16/F16/F32 -> f32), h: [T][D].
 * Fails with K3_ERR_ARG naming the position if an id >= vocab. */
k3_status k3_model_embed(k3_model *m, const int32_t *ids, int T, float *h, char *err,
                         size_t errlen);

/* Final head: out = Mix([blocks..., h]; w_out), x = RMSNorm(out; model.norm),
 * logits = lm_head x. blocks: [nb][T][D], h: [T][D]. Computes logits for
 * positions [t0, T) only (t0 = T-1 for generation), logits: [T - t0][vocab]. */
k3_status k3_model_head(k3_model *m, const float *blocks, int nb, const float *h, int T, int t0,
                        float *logits, char *err, size_t errlen);

/* ---- for the layer runner (common/engine/stage.c); not part of the wire API ---- */

struct k3_layer_w;
struct k3_experts;
/* Weights of `layer` (must be inside the range). */
const struct k3_layer_w *k3_model_layer(const k3_model *m, int layer);
/* The routed-expert store of the range (NULL when it has no MoE layer). */
struct k3_experts *k3_model_experts(k3_model *m);
/* The Vulkan expert tier of the model's range, NULL when off. */
struct k3_vk_tier *k3_model_vk(k3_model *m);
int k3_model_idot(const k3_model *m);
double k3_model_topp(const k3_model *m);

#endif
