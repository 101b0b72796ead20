/* common/layers/mla.c: gated MLA without RoPE over a chunk (docs/MODEL.md 3.5, 5.2, 7.5-7.6).
 *
 * Batched over the chunk: q_a, q_b, kv_a, g and o projections. The whole
 * chunk's normalized latents and raw 64-dim "rope" keys are appended to the
 * cache first; then each query attends causally to rows 0..pos0+t.
 * Attention runs in absorbed form: q_abs = K_h^T q_nope is built from the
 * kv_b rows in their load format, scores are q_abs . latent + q_rope . rope,
 * and V_h is applied after the weighted latent sum. The chunk runs in tiles
 * of tokens, each in four pool phases whose tasks never share a sum: q_abs
 * per head; the scores of all (token, head) queries as one f32 matmul over
 * the cache (each cache row read once); softmax and the latent sum per
 * (token, group of heads); V_h rows and the gate per head. The inner loops
 * are ISA-dispatched with the same bits at every level: q_abs and the
 * latent sum through ops_isa.h, the scores and the V_h rows through the
 * dense kernels (kernels.h), whose (row, token) bits do not depend on the
 * tile, the row range or the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/layers/layers.h"
#include "common/kernels/ops_isa.h"

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

/* Tokens per attention tile. A tile's queries (tokens x heads) share every
 * cache row read. At most MLA_TILE tokens, fewer when the score buffers of
 * all heads would pass MLA_SCORE_BYTES (long contexts fall back to one token
 * at a time). The bits do not depend on the tile. */
#define MLA_TILE        8
#define MLA_SCORE_BYTES ((size_t)64 << 20)
/* heads per latent-sum task: each cache row is loaded once per group */
#define MLA_HEAD_GROUP 4
/* queries per score matmul: their q_abs rows (192 KiB) stay in L2 while
 * the cache rows stream past them */
#define MLA_QBLOCK 96

static int mla_tile(const k3_config *c, int T, int ctx_len) {
    size_t per_tok = (size_t)c->n_heads * 2 * (size_t)(ctx_len > 0 ? ctx_len : 1) * sizeof(float);
    size_t fit = MLA_SCORE_BYTES / per_tok;
    int tile = fit < 1 ? 1 : fit > MLA_TILE ? MLA_TILE : (int)fit;
    return T < tile ? (T > 0 ? T : 1) : tile;
}

/* floats of the attention scratch for a tile over ctx_len cache rows:
 * q_abs, cbar [tile][H][kv_lora], q_rope [tile][H][rope], V outputs
 * [H][tile][v_head], scores (latent, rope) [tile][H][ctx_len] */
static size_t mla_attn_floats(const k3_config *c, int tile, int ctx_len) {
    return (size_t)tile * (size_t)c->n_heads *
           (2 * (size_t)c->kv_lora + (size_t)c->qk_rope + (size_t)c->v_head + 2 * (size_t)ctx_len);
}

size_t k3_mla_scratch_bytes(const k3_config *c, int T, int ctx_len) {
    size_t t = (size_t)T, H = (size_t)c->n_heads;
    return k3_arena_round(sizeof(float) * t * (size_t)c->q_lora)                   /* qa */
           + k3_arena_round(sizeof(float) * t * H * (size_t)c->qk_head)            /* q */
           + k3_arena_round(sizeof(float) * t * (size_t)(c->kv_lora + c->qk_rope)) /* ckv */
           + 2 * k3_arena_round(sizeof(float) * t * H * (size_t)c->v_head)         /* g ctx */
           + k3_arena_round(sizeof(float) * mla_attn_floats(c, mla_tile(c, T, ctx_len), ctx_len));
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

/* One attention tile: tokens [t0, t0 + nt) of the chunk over cache rows
 * [0, rows), rows = pos0 + t0 + nt (what its last query sees). */
typedef struct mla_task {
    const k3_config *cfg;
    const k3_mla_w *w;
    const k3_mla_cache *cache;
    int pos0, t0, nt, rows;
    const float *q; /* [T][H * qk_head] */
    const float *g; /* [T][H * v_head] gate logits */
    float *ctx;     /* [T][H * v_head] gated head contexts (the output) */
    float *q_abs;   /* [nt][H][kv_lora] K_h^T q_nope */
    float *q_rope;  /* [nt][H][rope] */
    float *sc;      /* [nt][H][rows] latent scores, then probabilities */
    float *sr;      /* [nt][H][rows] rope scores */
    float *cbar;    /* [H][nt][kv_lora] latent contexts */
    float *vo;      /* [H][nt][v_head] V_h cbar */
} mla_task;

/* Phase 1, one task per head: q_abs = K_h^T q_nope built from the kv_b rows
 * in their load format, and the head's rope query gathered. */
static void mla_qabs(void *ctx, int h) {
    const mla_task *c = ctx;
    const k3_config *cfg = c->cfg;
    const int L = cfg->kv_lora, R = cfg->qk_rope, nope = cfg->qk_nope, H = cfg->n_heads;
    const int qh = cfg->qk_head;
    const float *qt = c->q + (size_t)c->t0 * H * qh + (size_t)h * qh; /* [nope | rope] */
    k3_ops()->rows_comb(&c->w->kv_b, h * (nope + cfg->v_head), nope, qt, (size_t)H * qh, c->nt,
                        c->q_abs + (size_t)h * L, (size_t)H * L);
    for (int t = 0; t < c->nt; t++)
        memcpy(c->q_rope + ((size_t)t * H + h) * R, qt + (size_t)t * H * qh + nope,
               sizeof(float) * (size_t)R);
}

/* Phase 3, one task per (token, group of MLA_HEAD_GROUP heads): the
 * causal scores scaled and softmaxed, then cbar = sum_s pi_s latent_s in
 * position order for the whole group in one pass over the cache. */
static void mla_attend(void *ctx, int task) {
    const mla_task *c = ctx;
    const k3_config *cfg = c->cfg;
    const k3_ops_tab *ops = k3_ops();
    const int H = cfg->n_heads, L = cfg->kv_lora, R = cfg->qk_rope;
    const int groups = (H + MLA_HEAD_GROUP - 1) / MLA_HEAD_GROUP;
    const int t = task / groups, h0 = task % groups * MLA_HEAD_GROUP;
    const int nh = H - h0 < MLA_HEAD_GROUP ? H - h0 : MLA_HEAD_GROUP;
    const int n_ctx = c->pos0 + c->t0 + t + 1;
    const float scale = 1.0f / sqrtf((float)cfg->qk_head);
    for (int h = h0; h < h0 + nh; h++) {
        float *s = c->sc + ((size_t)t * H + h) * c->rows;
        const float *s2 = c->sr + ((size_t)t * H + h) * c->rows;
        for (int j = 0; j < n_ctx; j++) s[j] = (s[j] + (R > 0 ? s2[j] : 0.0f)) * scale;
        ops->softmax(s, n_ctx);
    }
    ops->wsum_multi(c->cache->lat, L, c->sc + ((size_t)t * H + h0) * c->rows, (size_t)c->rows, nh,
                    n_ctx, c->cbar + ((size_t)h0 * c->nt + t) * L, (size_t)c->nt * L);
}

/* Phase 4, one task per head: ctx_h = (V_h cbar) * sigmoid(g_h), V_h the
 * head's kv_b rows through the dense kernels (all tile tokens at once). */
static void mla_out(void *ctx, int h) {
    const mla_task *c = ctx;
    const k3_config *cfg = c->cfg;
    const int L = cfg->kv_lora, nope = cfg->qk_nope, vh = cfg->v_head, H = cfg->n_heads;
    const k3_qmat v_h = qmat_rows(&c->w->kv_b, h * (nope + vh) + nope, vh);
    float *vo = c->vo + (size_t)h * c->nt * vh;
    k3_qmat_matmul_rows(&v_h, c->cbar + (size_t)h * c->nt * L, c->nt, vo, 0, vh);
    for (int t = 0; t < c->nt; t++) {
        const size_t o = (size_t)(c->t0 + t) * H * vh + (size_t)h * vh;
        k3_ops()->sigmoid_mul(c->ctx + o, vo + (size_t)t * vh, c->g + o, vh);
    }
}

/* Attention of the chunk, a tile of tokens at a time; every phase splits
 * work so that no sum is shared between tasks (same bits for any thread
 * count, and for any tile: per (query, row) the operations are fixed). */
static void mla_attention(k3_pool *pool, mla_task *c, int T, int tile, float *scratch) {
    const k3_config *cfg = c->cfg;
    const int H = cfg->n_heads, L = cfg->kv_lora, R = cfg->qk_rope, vh = cfg->v_head;
    const int groups = (H + MLA_HEAD_GROUP - 1) / MLA_HEAD_GROUP;
    /* the cache as f32 matrices [rows][kv_lora] and [rows][rope] */
    k3_qmat lat = {.fmt = K3_QF_F32, .cols = L, .w = c->cache->lat};
    k3_qmat rope = {.fmt = K3_QF_F32, .cols = R, .w = c->cache->rope};
    for (int t0 = 0; t0 < T; t0 += tile) {
        c->t0 = t0;
        c->nt = T - t0 < tile ? T - t0 : tile;
        c->rows = c->pos0 + t0 + c->nt;
        const size_t q = (size_t)c->nt * H; /* queries of the tile */
        c->q_abs = scratch;
        c->cbar = c->q_abs + q * L;
        c->q_rope = c->cbar + q * L;
        c->vo = c->q_rope + q * R;
        c->sc = c->vo + q * vh;
        c->sr = c->sc + q * c->rows;
        k3_pool_run(pool, mla_qabs, c, H);
        /* scores of every query against cache rows 0..rows-1 (each query
         * later keeps its causal prefix): the dense f32 kernel, split over
         * cache rows, so each row is read once per block of queries */
        lat.rows = rope.rows = c->rows;
        for (size_t q0 = 0; q0 < q; q0 += MLA_QBLOCK) {
            const int nq = q - q0 < MLA_QBLOCK ? (int)(q - q0) : MLA_QBLOCK;
            k3_qmat_matmul(&lat, c->q_abs + q0 * L, nq, c->sc + q0 * c->rows, pool);
            if (R > 0) k3_qmat_matmul(&rope, c->q_rope + q0 * R, nq, c->sr + q0 * c->rows, pool);
        }
        k3_pool_run(pool, mla_attend, c, c->nt * groups);
        k3_pool_run(pool, mla_out, c, H);
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

    /* attention over the cache, all heads              ctx: [T][H * v_head] */
    float *ctx = K3_ARENA_F(ar, (size_t)T * H * VH);
    const int tile = mla_tile(cfg, T, pos0 + T);
    float *scratch = K3_ARENA_F(ar, mla_attn_floats(cfg, tile, pos0 + T));
    mla_task task = {.cfg = cfg, .w = w, .cache = cache, .pos0 = pos0, .q = q, .g = g, .ctx = ctx};
    mla_attention(pool, &task, T, tile, scratch);

    /* out = W_o ctx                                       out: [T][D] */
    k3_qmat_matmul(&w->o, ctx, T, out, pool);
}
