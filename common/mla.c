/* common/mla.c: gated MLA without RoPE over a chunk (spec 3.5, 5, 7.5-7.6).
 *
 * Batched over the chunk: q_a, q_b, kv_a, g and o projections. The whole
 * chunk's normalized latents and raw 64-dim "rope" keys are appended to the
 * cache first; then each query attends causally to rows 0..pos0+t.
 * Attention runs in absorbed form: q_abs = K_h^T q_nope is built from the
 * kv_b rows in their load format, scores are q_abs . latent + q_rope . rope,
 * and V_h is applied after the weighted latent sum. One pool task per head.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "layers.h"

size_t k3_mla_scratch_bytes(const k3_config *c, int T, int ctx_len) {
    size_t t = (size_t)T, H = (size_t)c->n_heads;
    return k3_arena_round(sizeof(float) * t * (size_t)c->q_lora)                   /* qa */
           + k3_arena_round(sizeof(float) * t * H * (size_t)c->qk_head)            /* q */
           + k3_arena_round(sizeof(float) * t * (size_t)(c->kv_lora + c->qk_rope)) /* ckv */
           + 2 * k3_arena_round(sizeof(float) * t * H * (size_t)c->v_head)         /* g ctx */
           + k3_arena_round(sizeof(float) * H * (2 * (size_t)c->kv_lora + (size_t)ctx_len));
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

/* acc[c] += coef * W[r][c] for every column, in W's load format: the row
 * scale (int8) or group scale (int4) is folded into the coefficient. */
static void row_axpy(const k3_qmat *m, int r, float coef, float *acc) {
    int n = m->cols;
    if (m->fmt == K3_QF_F32) {
        const float *w = m->w + (size_t)r * n;
        for (int c = 0; c < n; c++) acc[c] += coef * w[c];
    } else if (m->fmt == K3_QF_I8) {
        const int8_t *q = m->q8 + (size_t)r * n;
        float cs = coef * m->scales[r];
        for (int c = 0; c < n; c++) acc[c] += cs * (float)q[c];
    } else {
        const uint8_t *q = m->q4 + (size_t)r * (n / 2);
        const float *s = m->scales + (size_t)r * (n / 64);
        for (int g = 0; g < n / 64; g++) {
            float cs = coef * s[g];
            for (int c = g * 64; c < g * 64 + 64; c++) {
                int nib = (c & 1) ? q[c / 2] >> 4 : q[c / 2] & 15;
                acc[c] += cs * (float)(nib - 8);
            }
        }
    }
}

/* W[r] . x in W's load format (spec 4.2 matvec order). */
static float row_dot(const k3_qmat *m, int r, const float *x) {
    int n = m->cols;
    float acc = 0.0f;
    if (m->fmt == K3_QF_F32) {
        const float *w = m->w + (size_t)r * n;
        for (int c = 0; c < n; c++) acc += w[c] * x[c];
        return acc;
    }
    if (m->fmt == K3_QF_I8) {
        const int8_t *q = m->q8 + (size_t)r * n;
        for (int c = 0; c < n; c++) acc += x[c] * (float)q[c];
        return m->scales[r] * acc;
    }
    const uint8_t *q = m->q4 + (size_t)r * (n / 2);
    const float *s = m->scales + (size_t)r * (n / 64);
    for (int g = 0; g < n / 64; g++) {
        float gs = 0.0f;
        for (int c = g * 64; c < g * 64 + 64; c++) {
            int nib = (c & 1) ? q[c / 2] >> 4 : q[c / 2] & 15;
            gs += x[c] * (float)(nib - 8);
        }
        acc += s[g] * gs;
    }
    return acc;
}

typedef struct mla_task {
    const k3_config *cfg;
    const k3_mla_w *w;
    const k3_mla_cache *cache;
    int pos0, T;
    const float *q; /* [T][H * qk_head] */
    const float *g; /* [T][H * v_head] gate logits */
    float *ctx;     /* [T][H * v_head] gated head contexts */
    float *scratch; /* [H][2 * kv_lora + pos0 + T] */
} mla_task;

static void mla_head(void *ctx, int h) {
    const mla_task *c = ctx;
    const k3_config *cfg = c->cfg;
    int L = cfg->kv_lora, R = cfg->qk_rope, nope = cfg->qk_nope, vh = cfg->v_head;
    int qh = cfg->qk_head, H = cfg->n_heads;
    int kvb_row0 = h * (nope + vh); /* rows [0, nope) K-nope, [nope, nope+vh) V */
    float *q_abs = c->scratch + (size_t)h * (2 * (size_t)L + (size_t)(c->pos0 + c->T));
    float *cbar = q_abs + L;
    float *sc = cbar + L;
    const float scale = 1.0f / sqrtf((float)qh);

    for (int t = 0; t < c->T; t++) {
        const float *qn = c->q + (size_t)t * H * qh + (size_t)h * qh; /* [nope | rope] */
        const float *qr = qn + nope;
        /* q_abs = K_h^T q_nope                              [kv_lora] */
        for (int i = 0; i < L; i++) q_abs[i] = 0.0f;
        for (int n = 0; n < nope; n++) row_axpy(&c->w->kv_b, kvb_row0 + n, qn[n], q_abs);
        /* scores over cache rows 0..pos0+t (causal)       [n_ctx] */
        int n_ctx = c->pos0 + t + 1;
        for (int s = 0; s < n_ctx; s++) {
            const float *lat = c->cache->lat + (size_t)s * L;
            const float *rope = c->cache->rope + (size_t)s * R;
            float d1 = 0.0f, d2 = 0.0f;
            for (int i = 0; i < L; i++) d1 += q_abs[i] * lat[i];
            for (int i = 0; i < R; i++) d2 += qr[i] * rope[i];
            sc[s] = (d1 + d2) * scale;
        }
        k3_softmax(sc, n_ctx);
        /* cbar = sum_s pi_s latent_s, in position order      [kv_lora] */
        for (int i = 0; i < L; i++) cbar[i] = 0.0f;
        for (int s = 0; s < n_ctx; s++) {
            const float *lat = c->cache->lat + (size_t)s * L;
            float p = sc[s];
            for (int i = 0; i < L; i++) cbar[i] += p * lat[i];
        }
        /* ctx_h = (V_h cbar) * sigmoid(g_h)                  [v_head] */
        float *out = c->ctx + (size_t)t * H * vh + (size_t)h * vh;
        const float *g = c->g + (size_t)t * H * vh + (size_t)h * vh;
        for (int j = 0; j < vh; j++)
            out[j] = row_dot(&c->w->kv_b, kvb_row0 + nope + j, cbar) * k3_sigmoid(g[j]);
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
    float *scratch = K3_ARENA_F(ar, (size_t)H * (2 * (size_t)L + (size_t)(pos0 + T)));
    mla_task task = {cfg, w, cache, pos0, T, q, g, ctx, scratch};
    k3_pool_run(pool, mla_head, &task, H);

    /* out = W_o ctx                                       out: [T][D] */
    k3_qmat_matmul(&w->o, ctx, T, out, pool);
}
