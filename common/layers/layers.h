/* common/layers/layers.h: the layer math of Kimi K3 (docs/MODEL.md 3.1-3.8)
 * on a chunk of T consecutive tokens, one function per block:
 *
 *   (the small operators they call, RMSNorm, SiTU, softmax, are
 *   common/kernels/ops.h; scratch comes from common/base/arena.h)
 *   attnres.c  the AttnRes Mix operator (3.3)
 *   kda.c      Kimi Delta Attention (3.4): projections, conv, recurrence
 *   mla.c      gated MLA without RoPE, absorbed form (3.5)
 *   moe.c      LatentMoE (3.6) and the dense MLP (3.7)
 *
 * Owns: nothing. Weights (k3_layer_w) belong to the model (common/engine/model.c),
 * recurrent state (k3_kda_state, k3_mla_cache) to the session state
 * (common/engine/stage.c), scratch memory to the caller's k3_arena.
 * Threads: the functions are reentrant; each call uses the given pool for
 * its matmuls and per-head loops, and per-head work never shares a sum, so
 * results are the same bits for any thread count and any chunk split.
 */
#ifndef K3_LAYERS_H
#define K3_LAYERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/ckpt/config.h"
#include "common/base/err.h"
#include "common/experts/experts.h"
#include "common/kernels/kernels.h"
#include "common/base/arena.h"
#include "common/base/pool.h"
#include "common/kernels/ops.h"

/* ---- weights of one layer (filled by k3_model_open) ---- */

typedef struct k3_kda_w {
    k3_qmat q, k, v; /* [P][D] each, K3_BITS (P = kda_heads * kda_hd) */
    k3_qmat g;       /* [P][D] output gate, K3_BITS */
    k3_qmat o;       /* [D][P], K3_BITS */
    k3_qmat f_a;     /* [R][D] f32 (R = kda_hd, the decay bottleneck) */
    k3_qmat f_b;     /* [P][R] f32 */
    k3_qmat b;       /* [kda_heads][D] f32 (beta logits) */
    float *conv_q;   /* [P][conv_k] taps, oldest first, owned */
    float *conv_k;   /* [P][conv_k], owned */
    float *conv_v;   /* [P][conv_k], owned */
    float *dt_bias;  /* [P], owned */
    float *A;        /* [kda_heads] = exp(A_log[h]), owned */
    float *o_norm;   /* [kda_hd], owned */
} k3_kda_w;

typedef struct k3_mla_w {
    k3_qmat q_a;      /* [q_lora][D], K3_MLA_BITS */
    float *q_a_norm;  /* [q_lora], owned */
    k3_qmat q_b;      /* [H * qk_head][q_lora] */
    k3_qmat kv_a;     /* [kv_lora + qk_rope][D] */
    float *kv_a_norm; /* [kv_lora], owned */
    k3_qmat kv_b;     /* [H * (qk_nope + v_head)][kv_lora] */
    k3_qmat g;        /* [H * v_head][D] */
    k3_qmat o;        /* [D][H * v_head] */
} k3_mla_w;

typedef struct k3_dense_w {
    k3_qmat gate, up; /* [dense_inter][D], K3_BITS */
    k3_qmat down;     /* [D][dense_inter] */
} k3_dense_w;

typedef struct k3_moe_w {
    k3_qmat router;   /* [n_experts][D] f32 */
    float *bias;      /* [n_experts] e_score_correction_bias, owned */
    k3_qmat lat_down; /* [latent][D], K3_BITS */
    k3_qmat lat_up;   /* [D][latent], K3_BITS */
    float *lat_norm;  /* [latent] routed_expert_norm, owned */
    k3_qmat sh_gate;  /* [shared_inter][D], K3_BITS */
    k3_qmat sh_up;    /* [shared_inter][D] */
    k3_qmat sh_down;  /* [D][shared_inter] */
} k3_moe_w;

typedef struct k3_layer_w {
    int layer;         /* 0-based index in the model */
    int is_kda;        /* 1 = KDA, 0 = gated MLA */
    int is_moe;        /* 1 = LatentMoE, 0 = dense MLP */
    int is_boundary;   /* 1 = AttnRes snapshot layer (layer % res_bs == 0) */
    float *in_norm;    /* [D] input_layernorm, owned */
    float *post_norm;  /* [D] post_attention_layernorm, owned */
    float *w_attn_res; /* [D] self_attention_res_norm * _proj (folded), owned */
    float *w_mlp_res;  /* [D] mlp_res_norm * _proj (folded), owned */
    k3_kda_w kda;      /* valid when is_kda */
    k3_mla_w mla;      /* valid when !is_kda */
    k3_dense_w dense;  /* valid when !is_moe */
    k3_moe_w moe;      /* valid when is_moe */
} k3_layer_w;

/* ---- per-session recurrent state of one layer (owned by k3_state) ---- */

typedef struct k3_kda_state {
    float *S;    /* [kda_heads][kda_hd key][kda_hd value] */
    float *conv; /* [3 (q,k,v)][P][conv_k] input windows, oldest first */
} k3_kda_state;

typedef struct k3_mla_cache {
    float *lat;  /* [cap][kv_lora] normalized latent per position */
    float *rope; /* [cap][qk_rope] raw extra key dims per position */
    int cap;     /* rows allocated (grows up to max_ctx) */
} k3_mla_cache;

/* ---- what every layer call needs besides its weights ---- */

typedef struct k3_layer_ctx {
    const k3_config *cfg;
    k3_pool *pool;                      /* matmul and per-head parallelism, may be NULL */
    k3_experts *experts;                /* routed expert store (MoE layers) */
    int idot;                           /* 1 = int8-activation expert kernels (K3_IDOT) */
    double topp;                        /* K3_TOPP routed-expert pruning, 0 = off */
    const struct k3_moe_remote *remote; /* experts on another worker's drive
                                           (common/layers/moe_remote.h), NULL = none */
    struct k3_vk_tier *vk;              /* Vulkan expert tier (common/vk/vk_tier.h), NULL = none */
} k3_layer_ctx;

/* ---- attnres.c (docs/MODEL.md 3.3) ---- */

/* out = Mix(v[0..n-1]; w): s_e = (v_e . w) / sqrt(mean(v_e^2) + eps) with
 * the dots, the mean and the score in double (cast to float), pi =
 * softmax(s) in float, out = sum_e pi_e v_e accumulated in entry order.
 * n <= K3_MAX_RES_ENTRIES + 1. out must not alias any v[e]. */
void k3_attnres_mix(const float *const *v, int n, const float *w, int D, float eps, float *out);

/* ---- kda.c (docs/MODEL.md 3.4) ---- */

size_t k3_kda_scratch_bytes(const k3_config *cfg, int T);
/* x: [T][D] the normed layer input; out: [T][D]. Advances st by T tokens. */
void k3_kda_forward(const k3_layer_ctx *lc, const k3_kda_w *w, k3_kda_state *st, const float *x,
                    int T, float *out, k3_arena *ar);

/* One head, one token of the recurrence (exposed for the unit tests):
 * S [d][d] (key-major) is decayed by alpha [d], then u = S^T k, delta =
 * beta (v - u), S += k delta^T, o = S^T q. */
void k3_kda_head_step(float *S, int d, const float *q, const float *k, const float *v,
                      const float *alpha, float beta, float *o);

/* ---- mla.c (docs/MODEL.md 3.5) ---- */

size_t k3_mla_scratch_bytes(const k3_config *cfg, int T, int ctx_len);
/* x: [T][D] normed input; positions [pos0, pos0 + T); the cache must hold
 * at least pos0 + T rows (k3_mla_cache_reserve). out: [T][D]. */
void k3_mla_forward(const k3_layer_ctx *lc, const k3_mla_w *w, k3_mla_cache *c, int pos0,
                    const float *x, int T, float *out, k3_arena *ar);
/* Grows the cache to hold `rows` positions (doubling, capped at max_rows). */
k3_status k3_mla_cache_reserve(k3_mla_cache *c, const k3_config *cfg, int rows, int max_rows,
                               char *err, size_t errlen);
void k3_mla_cache_free(k3_mla_cache *c);

/* ---- moe.c (docs/MODEL.md 3.6, 3.7) ---- */

/* Router selection for one token: s = sigmoid(logits); pick topk on s + bias
 * greedily (ties: lower index); weights = s / (sum of selected s + 1e-20).
 * topp > 0 keeps the heaviest experts up to cumulative weight topp and
 * renormalises. Writes *n_sel ids (selection order) and weights. */
void k3_moe_route(const float *logits, const float *bias, int n_experts, int topk, double topp,
                  int32_t *ids, float *weights, int *n_sel);

size_t k3_moe_scratch_bytes(const k3_config *cfg, int T);
/* x: [T][D] normed input; out: [T][D]. Routed experts come from lc->experts
 * (a missing expert or a failed read is an error naming layer and expert);
 * stats accumulates the expert store's hits/misses/bytes/read time. */
k3_status k3_moe_forward(const k3_layer_ctx *lc, const k3_moe_w *w, int layer, const float *x,
                         int T, float *out, k3_arena *ar, k3_expert_stats *stats, char *err,
                         size_t errlen);

size_t k3_dense_scratch_bytes(const k3_config *cfg, int T);
void k3_dense_forward(const k3_layer_ctx *lc, const k3_dense_w *w, const float *x, int T,
                      float *out, k3_arena *ar);

/* One routed expert applied to n gathered rows (exposed for unit tests):
 * y [n][latent] = W2 SiTU(W1 z, W3 z). z: [n][latent] (f32 kernel) or zq/zs
 * (int8 activations, idot). Scratch from ar. */
void k3_moe_expert_apply(const k3_layer_ctx *lc, const k3_expert_view *e, const float *z,
                         const int8_t *zq, const float *zs, int n, float *y, k3_arena *ar);

#endif
