/* common/mla.c: gated MLA without RoPE over a chunk (spec 3.5, 5, 7.5-7.6).
 *
 * Batched over the chunk: q_a, q_b, kv_a, g and o projections. The whole
 * chunk's normalized latents and raw 64-dim "rope" keys are appended to the
 * cache first; then each query attends causally to rows 0..pos0+t.
 * Attention runs in absorbed form: q_abs = K_h^T q_nope is built from the
 * kv_b rows in their load format, scores are q_abs . latent + q_rope . rope,
 * and V_h is applied after the weighted latent sum. One pool task per head,
 * a tile of tokens at a time. The inner loops are ISA-dispatched with the
 * same bits at every level: q_abs and the latent sum through ops_isa.h, the
 * scores (the cache viewed as an f32 matrix) and the V_h rows through the
 * dense kernels (kernels.h), whose (row, token) bits do not depend on the
 * tile or the row range.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"
#include "ops_isa.h"

/* A view of rows [r0, r0 + n) of m in its load format (borrows m's buffers). */
static k3_qmat qmat_rows(const k3_qmat *m, int r0, int n) {
    k3_qmat v = *m;
    const size_t cols = (size_t)m->cols, r = (size_t)r0;
    v.rows = n;
    v.owned = 0;
    switch (m->fmt) {
    case K3_QF_F32: v.w = m->w + r * cols; break;
    case K3_QF_I8:
        v.q8 = m->q8 + r * cols;
        v.scales = m->scales + r;
        break;
    case K3_QF_I4G64:
        v.q4 = m->q4 + r * (cols / 2);
        v.scales = m->scales + r * (cols / 64);
        break;
    }
    return v;
}

/* Tokens per attention tile: the tile's queries share every cache row read
 * (scores are a small matmul over the cache). At most MLA_TILE, fewer when
 * the per-head score buffers of all heads would pass MLA_SCORE_BYTES (long
 * contexts fall back to one token at a time). The bits do not depend on it. */
#define MLA_TILE        8
#define MLA_SCORE_BYTES ((size_t)64 << 20)

static int mla_tile(const k3_config *c, int T, int ctx_len) {
    size_t per_tok = (size_t)c->n_heads * 2 * (size_t)(ctx_len > 0 ? ctx_len : 1) * sizeof(float);
    size_t fit = MLA_SCORE_BYTES / per_tok;
    int tile = fit < 1 ? 1 : fit > MLA_TILE ? MLA_TILE : (int)fit;
    return T < tile ? (T > 0 ? T : 1) : tile;
}

/* floats of one head's scratch: q_abs, cbar [tile][kv_lora], q_rope
 * [tile][rope], V output [tile][v_head], scores (latent, rope) [tile][ctx] */
static size_t mla_head_floats(const k3_config *c, int tile, int ctx_len) {
    return (size_t)tile * (2 * (size_t)c->kv_lora + (size_t)c->qk_rope + (size_t)c->v_head +
                           2 * (size_t)ctx_len);
}

size_t k3_mla_scratch_bytes(const k3_config *c, int T, int ctx_len) {
    size_t t = (size_t)T, H = (size_t)c->n_heads;
    return k3_arena_round(sizeof(float) * t * (size_t)c->q_lora)                   /* qa */
           + k3_arena_round(sizeof(float) * t * H * (size_t)c->qk_head)            /* q */
           + k3_arena_round(sizeof(float) * t * (size_t)(c->kv_lora + c->qk_rope)) /* ckv */
           + 2 * k3_arena_round(sizeof(float) * t * H * (size_t)c->v_head)         /* g ctx */
           + k3_arena_round(sizeof(float) * H * mla_head_floats(c, mla_tile(c, T, ctx_len), ctx_len));
}

k3_status k3_mla_cache_reserve(k3_mla_cache *c, const k3_config *cfg, int rows, int max_rows,
                               char *err, size_t errlen) {
    if (rows <= c->cap) return K3_OK;
    if (rows > max_rows)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "MLA cache: %d positions > context capacity %d",
                       rows, max_rows);
    int cap = c->cap ? c->cap : 64;
    while (cap < rows) cap = cap > max_rows / 2 ? max_rows : cap * 2;
    if (cap > max_rows) cap = max_rows;
    float *lat = realloc(c->lat, sizeof(float) * (size_t)cap * (size_t)cfg->kv_lora);
    if (!lat)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "MLA cache: cannot grow to %d positions", cap);
    c->lat = lat;
    float *rope =
        realloc(c->rope, sizeof(float) * (size_t)cap * (size_t)(cfg->qk_rope ? cfg->qk_rope : 1));
    if (!rope)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "MLA cache: cannot grow to %d positions", cap);
    c->rope = rope;
    c->cap = cap;
    return K3_OK;
}

void k3_mla_cache_free(k3_mla_cache *c) {
    free(c->lat);
    free(c->rope);
    c->lat = c->rope = NULL;
    c->cap = 0;
}

typedef struct mla_task {
    const k3_config *cfg;
    const k3_mla_w *w;
    const k3_mla_cache *cache;
    int pos0, T, tile;
    const float *q; /* [T][H * qk_head] */
    const float *g; /* [T][H * v_head] gate logits */
    float *ctx;     /* [T][H * v_head] gated head contexts */
    float *scratch; /* [H][mla_head_floats] */
} mla_task;

/* One head over the chunk, a tile of tokens at a time. */
static void mla_head(void *ctx, int h) {
    const mla_task *c = ctx;
    const k3_config *cfg = c->cfg;
    const k3_ops_tab *ops = k3_ops();
    const int L = cfg->kv_lora, R = cfg->qk_rope, nope = cfg->qk_nope, vh = cfg->v_head;
    const int qh = cfg->qk_head, H = cfg->n_heads, N = c->pos0 + c->T, tile = c->tile;
    const int kvb_row0 = h * (nope + vh); /* rows [0, nope) K-nope, [nope, nope+vh) V */
    float *q_abs = c->scratch + (size_t)h * mla_head_floats(cfg, tile, N);
    float *cbar = q_abs + (size_t)tile * L;
    float *qr = cbar + (size_t)tile * L;
    float *vo = qr + (size_t)tile * R;
    float *sc = vo + (size_t)tile * vh;
    float *sr = sc + (size_t)tile * N;
    const float scale = 1.0f / sqrtf((float)qh);
    /* the cache as f32 matrices [rows][kv_lora] and [rows][rope], and V_h */
    k3_qmat lat = {.fmt = K3_QF_F32, .cols = L, .w = c->cache->lat};
    k3_qmat rope = {.fmt = K3_QF_F32, .cols = R, .w = c->cache->rope};
    const k3_qmat v_h = qmat_rows(&c->w->kv_b, kvb_row0 + nope, vh);

    for (int t0 = 0; t0 < c->T; t0 += tile) {
        const int nt = c->T - t0 < tile ? c->T - t0 : tile;
        const int rows = c->pos0 + t0 + nt; /* cache rows the tile's last query sees */
        const float *qt = c->q + (size_t)t0 * H * qh + (size_t)h * qh; /* [nope | rope] */
        /* q_abs = K_h^T q_nope in kv_b's load format         [nt][kv_lora] */
        ops->rows_comb(&c->w->kv_b, kvb_row0, nope, qt, (size_t)H * qh, nt, q_abs);
        for (int t = 0; t < nt; t++)
            memcpy(qr + (size_t)t * R, qt + (size_t)t * H * qh + nope, sizeof(float) * (size_t)R);
        /* scores q_abs . latent_s + q_rope . rope_s over rows 0..rows-1,
         * row stride `rows`; each query then keeps its causal prefix */
        lat.rows = rope.rows = rows;
        k3_qmat_matmul_rows(&lat, q_abs, nt, sc, 0, rows);
        if (R > 0) k3_qmat_matmul_rows(&rope, qr, nt, sr, 0, rows);
        for (int t = 0; t < nt; t++) {
            const int n_ctx = c->pos0 + t0 + t + 1;
            float *s = sc + (size_t)t * rows;
            const float *s2 = sr + (size_t)t * rows;
            for (int j = 0; j < n_ctx; j++) s[j] = (s[j] + (R > 0 ? s2[j] : 0.0f)) * scale;
            ops->softmax(s, n_ctx);
            /* cbar = sum_s pi_s latent_s, in position order  [kv_lora] */
            ops->wsum(c->cache->lat, L, s, n_ctx, cbar + (size_t)t * L);
        }
        /* ctx_h = (V_h cbar) * sigmoid(g_h)                  [nt][v_head] */
        k3_qmat_matmul_rows(&v_h, cbar, nt, vo, 0, vh);
        for (int t = 0; t < nt; t++) {
            const size_t o = (size_t)(t0 + t) * H * vh + (size_t)h * vh;
            ops->sigmoid_mul(c->ctx + o, vo + (size_t)t * vh, c->g + o, vh);
        }
    }
}

void k3_mla_forward(const k3_layer_ctx *lc, const k3_mla_w *w, k3_mla_cache *cache, int pos0,
                    const float *x, int T, float *out, k3_arena *ar) {
    const k3_config *cfg = lc->cfg;
    int H = cfg->n_heads, L = cfg->kv_lora, R = cfg->qk_rope;
    int QL = cfg->q_lora, QH = cfg->qk_head, VH = cfg->v_head;
    k3_pool *pool = lc->pool;
    K3_ASSERT(cache->cap >= pos0 + T);

    /* query: q = W_qb RMSNorm(W_qa x; q_a_norm)          x: [T][D] */
    float *qa = K3_ARENA_F(ar, (size_t)T * QL);    /* [T][q_lora] */
    float *q = K3_ARENA_F(ar, (size_t)T * H * QH); /* [T][H][nope + rope] */
    k3_qmat_matmul(&w->q_a, x, T, qa, pool);
    for (int t = 0; t < T; t++)
        k3_rmsnorm(qa + (size_t)t * QL, qa + (size_t)t * QL, w->q_a_norm, QL, cfg->eps);
    k3_qmat_matmul(&w->q_b, qa, T, q, pool);

    /* key/value latent: cache the normed latent and the raw rope dims */
    float *ckv = K3_ARENA_F(ar, (size_t)T * (L + R)); /* [T][kv_lora + rope] */
    k3_qmat_matmul(&w->kv_a, x, T, ckv, pool);
    for (int t = 0; t < T; t++) {
        const float *row = ckv + (size_t)t * (L + R);
        k3_rmsnorm(cache->lat + (size_t)(pos0 + t) * L, row, w->kv_a_norm, L, cfg->eps);
        memcpy(cache->rope + (size_t)(pos0 + t) * R, row + L, sizeof(float) * (size_t)R);
    }

    /* output gate logits                                  [T][H * v_head] */
    float *g = K3_ARENA_F(ar, (size_t)T * H * VH);
    k3_qmat_matmul(&w->g, x, T, g, pool);

    /* attention per head over the cache                   ctx: [T][H * v_head] */
    float *ctx = K3_ARENA_F(ar, (size_t)T * H * VH);
    const int tile = mla_tile(cfg, T, pos0 + T);
    float *scratch = K3_ARENA_F(ar, (size_t)H * mla_head_floats(cfg, tile, pos0 + T));
    mla_task task = {cfg, w, cache, pos0, T, tile, q, g, ctx, scratch};
    k3_pool_run(pool, mla_head, &task, H);

    /* out = W_o ctx                                       out: [T][D] */
    k3_qmat_matmul(&w->o, ctx, T, out, pool);
}
