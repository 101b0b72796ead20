/* common/layers/kda.c: Kimi Delta Attention over a chunk (docs/MODEL.md 3.4, 5.2, 7.1-7.4).
 *
 * Batched over the chunk: every projection (q, k, v, gate, the decay
 * bottleneck f_a -> f_b, beta, o). Sequential per token, in order: the conv
 * window shift and the delta-rule recurrence. Everything between the
 * projections is independent per head, so one pool task runs one head over
 * all T tokens: the per-head sums never depend on the thread count. The
 * per-head loops (SiLU, L2 norms, decay, the two fused state sweeps, the
 * RMSNorm, the gate) are ISA-dispatched (ops_isa.h) with the same bits at
 * every level; so is the short conv when it has 4 taps (K3), other sizes
 * run the same operations in scalar code.
 */
#include <math.h>
#include <string.h>

#include "common/layers/layers.h"
#include "common/kernels/ops_isa.h"

size_t k3_kda_scratch_bytes(const k3_config *c, int T) {
    size_t P = (size_t)c->kda_proj, t = (size_t)T;
    return 6 * k3_arena_round(sizeof(float) * t * P)                   /* q k v g z o */
           + k3_arena_round(sizeof(float) * t * (size_t)c->kda_hd)     /* f_a output */
           + k3_arena_round(sizeof(float) * t * (size_t)c->kda_heads); /* beta logits */
}

/* Causal depthwise conv + SiLU for one head's d channels of one token, in
 * place: the window (oldest first) shifts left, takes the new input last,
 * and is dotted with the taps in tap order (docs/MODEL.md 3.4); then SiLU over the
 * d outputs at once (vector backends). */
static void conv_silu(const k3_ops_tab *o, float *u, float *win, const float *taps, int d, int K) {
    if (K == 4) { /* K3's kernel size: vector backends */
        o->conv4(u, win, taps, d);
        o->silu(u, d);
        return;
    }
    for (int c = 0; c < d; c++) {
        float *wc = win + (size_t)c * K;
        const float *tc = taps + (size_t)c * K;
        for (int j = 0; j + 1 < K; j++) wc[j] = wc[j + 1];
        wc[K - 1] = u[c];
        float acc = 0.0f;
        for (int j = 0; j < K; j++) acc += tc[j] * wc[j];
        u[c] = acc;
    }
    o->silu(u, d);
}

void k3_kda_head_step(float *S, int d, const float *q, const float *k, const float *v,
                      const float *alpha, float beta, float *o) {
    float u[K3_MAX_KDA_HD], delta[K3_MAX_KDA_HD];
    K3_ASSERT(d > 0 && d <= K3_MAX_KDA_HD);
    const k3_ops_tab *ops = k3_ops();
    /* 1-2. S <- Diag(alpha) S and u = S^T k from the decayed state, in one
     * sweep over the key rows (u[j] sums over keys in key order, fmaf) */
    ops->kda_decay_read(S, d, alpha, k, u);
    /* 3. delta = beta (v - u) */
    for (int j = 0; j < d; j++) delta[j] = beta * (v[j] - u[j]);
    /* 4-5. S <- S + k delta^T and o = S^T q from the UPDATED state, in one
     * sweep (fmaf for both) */
    ops->kda_write_read(S, d, k, delta, q, o);
}

typedef struct kda_task {
    const k3_config *cfg;
    const k3_kda_w *w;
    k3_kda_state *st;
    int T;
    float *q, *k, *v; /* [T][P] projections, turned into conv+SiLU outputs in place */
    const float *g;   /* [T][P] output gate logits */
    const float *z;   /* [T][P] decay bottleneck output W_fb W_fa x */
    const float *b;   /* [T][H] beta logits */
    float *o;         /* [T][P] gated, normed head outputs */
} kda_task;

/* One head over all T tokens of the chunk, in token order. */
static void kda_head(void *ctx, int h) {
    const kda_task *c = ctx;
    const k3_config *cfg = c->cfg;
    const k3_kda_w *w = c->w;
    int d = cfg->kda_hd, P = cfg->kda_proj, K = cfg->conv_k, H = cfg->kda_heads;
    size_t h0 = (size_t)h * d;
    float *S = c->st->S + h0 * d;                          /* [d][d] of head h */
    float *win_q = c->st->conv + (0 * (size_t)P + h0) * K; /* [d][K] windows */
    float *win_k = c->st->conv + (1 * (size_t)P + h0) * K;
    float *win_v = c->st->conv + (2 * (size_t)P + h0) * K;
    float qn[K3_MAX_KDA_HD], kn[K3_MAX_KDA_HD], alpha[K3_MAX_KDA_HD];
    const float qscale = 1.0f / sqrtf((float)d); /* d^(-1/2) on q only */
    const float A = w->A[h];

    const k3_ops_tab *ops = k3_ops();

    for (int t = 0; t < c->T; t++) {
        size_t row = (size_t)t * P + h0;
        float *q = c->q + row, *k = c->k + row, *v = c->v + row, *o = c->o + row;
        /* short conv + SiLU on each of q, k, v (docs/MODEL.md 7.4) */
        conv_silu(ops, q, win_q, w->conv_q + h0 * K, d, K);
        conv_silu(ops, k, win_k, w->conv_k + h0 * K, d, K);
        conv_silu(ops, v, win_v, w->conv_v + h0 * K, d, K);
        /* L2 norms, eps 1e-6 inside the sqrt of the sum (float sums) */
        const float nq = sqrtf(ops->sumsq(q, d) + 1e-6f), nk = sqrtf(ops->sumsq(k, d) + 1e-6f);
        for (int i = 0; i < d; i++) {
            qn[i] = q[i] / nq * qscale;
            kn[i] = k[i] / nk;
        }
        /* decay alpha_i = exp(gate_lb * sigmoid(A_h * (z_i + dt_bias_i))), beta */
        ops->kda_alpha(alpha, c->z + row, w->dt_bias + h0, A, cfg->gate_lb, d);
        float beta = k3_sigmoid(c->b[(size_t)t * H + h]);
        /* delta rule: decay, read u, write, read o from the updated state */
        k3_kda_head_step(S, d, qn, kn, v, alpha, beta, o);
        /* o_h = RMSNorm(o_h; o_norm, rms_norm_eps) * sigmoid(g_h) */
        k3_rmsnorm(o, o, w->o_norm, d, cfg->eps);
        ops->sigmoid_mul(o, o, c->g + row, d);
    }
}

void k3_kda_forward(const k3_layer_ctx *lc, const k3_kda_w *w, k3_kda_state *st, const float *x,
                    int T, float *out, k3_arena *ar) {
    const k3_config *cfg = lc->cfg;
    int P = cfg->kda_proj, H = cfg->kda_heads, R = w->f_a.rows;
    k3_pool *pool = lc->pool;

    /* projections, batched over the chunk            x: [T][D] */
    float *q = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] W_q x */
    float *k = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] W_k x */
    float *v = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] W_v x */
    float *g = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] W_g x (output gate) */
    float *fa = K3_ARENA_F(ar, (size_t)T * R); /* [T][R] W_fa x */
    float *z = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] W_fb W_fa x */
    float *b = K3_ARENA_F(ar, (size_t)T * H);  /* [T][H] W_b x */
    float *o = K3_ARENA_F(ar, (size_t)T * P);  /* [T][P] head outputs */
    k3_qmat_matmul(&w->q, x, T, q, pool);
    k3_qmat_matmul(&w->k, x, T, k, pool);
    k3_qmat_matmul(&w->v, x, T, v, pool);
    k3_qmat_matmul(&w->g, x, T, g, pool);
    k3_qmat_matmul(&w->f_a, x, T, fa, pool);
    k3_qmat_matmul(&w->f_b, fa, T, z, pool);
    k3_qmat_matmul(&w->b, x, T, b, pool);

    /* per head, token by token: conv, norms, decay, recurrence, norm, gate */
    kda_task task = {cfg, w, st, T, q, k, v, g, z, b, o};
    k3_pool_run(pool, kda_head, &task, H);

    /* out = W_o o                                     out: [T][D] */
    k3_qmat_matmul(&w->o, o, T, out, pool);
}
