/* common/layers/moe.c: LatentMoE (docs/MODEL.md 3.6, 7.8-7.9) and the dense MLP (3.7).
 *
 * LatentMoE over a chunk: the router, the latent down projection, the shared
 * experts and the latent up projection are batched over the chunk. The
 * routed experts are deduplicated: the union of the chunk's selections is
 * one expert batch (read ahead by the store's loader threads), each expert
 * used once and applied to every position that selected it. The batch runs
 * the experts already cached first, then the misses, each part in disk
 * order (k3_experts_disk_order), so the cached ones compute while the
 * misses are read into the slots they free. Each output row is kept per
 * (position, selection) and a position sums its experts in id order at
 * the end, whatever order they ran in and whatever the chunk: that is what
 * makes chunked prefill bit-identical to token-at-a-time, and the result
 * independent of the cache. Cost: [T][topk][latent] floats of scratch.
 *
 * Cross-worker striping (lc->remote, common/layers/moe_remote.h): the
 * experts on another worker's drive leave the batch; once z is known they
 * go out as calls (rows per expert, ascending), the shared and local
 * experts compute meanwhile, and the answers land in the same
 * (position, selection) rows, so the id-order sum below is unchanged.
 *
 * Overlap: the batch is opened right after the router, so the first
 * window of expert reads runs under the latent down projection and the
 * shared experts. Nothing earlier can be read: the next MoE layer's
 * experts depend on its router's input, which is this layer's output (and
 * the attention after it), so a prefetch across layers would be a guess.
 *
 * Vulkan tier (lc->vk, common/vk/vk_tier.h, docs/VULKAN.md): the experts of
 * the union resident on the device leave the CPU's list after routing and
 * run there as one job, started once z exists, while the CPU computes the
 * shared experts and its own; their rows land in the same per-selection
 * array, so the id-order sum below is unchanged. A device failure returns
 * the job's experts, which the CPU then reads and computes. With both, the
 * other workers' experts are taken out first, so the tier claims only this
 * worker's own and no expert runs on two paths.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"
#include "common/layers/layers.h"
#include "common/vk/vk_tier.h"
#include "common/layers/moe_remote.h"

/* ---- router ---- */

void k3_moe_route(const float *logits, const float *bias, int E, int topk, double topp,
                  int32_t *ids, float *weights, int *n_sel) {
    float s[K3_MAX_TOPK];
    float biased[K3_MAX_EXPERTS]; /* sigmoid(l) + bias, selection only */
    uint8_t taken[K3_MAX_EXPERTS];
    K3_ASSERT(topk >= 1 && topk <= K3_MAX_TOPK && topk <= E && E <= K3_MAX_EXPERTS);
    for (int e = 0; e < E; e++) {
        biased[e] = k3_sigmoid(logits[e]) + bias[e];
        taken[e] = 0;
    }
    /* greedy top-k on the biased score; strict '>' while scanning upward
     * keeps the lower index on ties (docs/MODEL.md 3.6) */
    for (int k = 0; k < topk; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || biased[e] > biased[best])) best = e;
        taken[best] = 1;
        ids[k] = best;
        s[k] = k3_sigmoid(logits[best]);
    }
    int n = topk;
    if (topp > 0.0 && topp < 1.0) {
        /* K3_TOPP: order by raw score (stable), keep the heaviest until the
         * renormalised cumulative weight reaches topp */
        for (int a = 1; a < n; a++)
            for (int b = a; b > 0 && s[b] > s[b - 1]; b--) {
                float ts = s[b];
                s[b] = s[b - 1];
                s[b - 1] = ts;
                int32_t ti = ids[b];
                ids[b] = ids[b - 1];
                ids[b - 1] = ti;
            }
        float tot = 0.0f;
        for (int k = 0; k < n; k++) tot += s[k];
        float cum = 0.0f;
        int keep = n;
        for (int k = 0; k < n; k++) {
            cum += s[k] / (tot + 1e-20f);
            if ((double)cum >= topp) {
                keep = k + 1;
                break;
            }
        }
        n = keep;
    }
    /* weights: the RAW scores renormalised over the kept experts */
    float sum = 0.0f;
    for (int k = 0; k < n; k++) sum += s[k];
    sum += 1e-20f;
    for (int k = 0; k < n; k++) weights[k] = s[k] / sum;
    *n_sel = n;
}

/* ---- one routed expert ---- */

static size_t expert_scratch_bytes(const k3_config *c, int T) {
    size_t t = (size_t)T, I = (size_t)c->moe_inter;
    return 2 * k3_arena_round(sizeof(float) * t * I)     /* g, u */
           + k3_arena_round(t * I)                       /* int8 activations */
           + k3_arena_round(sizeof(float) * t * I / 32); /* their group scales */
}

void k3_moe_expert_apply(const k3_layer_ctx *lc, const k3_expert_view *e, const float *z,
                         const int8_t *zq, const float *zs, int n, float *y, k3_arena *ar) {
    const k3_config *cfg = lc->cfg;
    int I = cfg->moe_inter;
    k3_pool *pool = lc->pool;
    float *g = K3_ARENA_F(ar, (size_t)n * I); /* [n][moe_inter] W1 z (gate) */
    float *u = K3_ARENA_F(ar, (size_t)n * I); /* [n][moe_inter] W3 z (up) */
    if (lc->idot) {
        /* gate and up share the one quantization of z */
        k3_mxfp4_matmul_i8_mt(&e->w1, zq, zs, n, g, pool);
        k3_mxfp4_matmul_i8_mt(&e->w3, zq, zs, n, u, pool);
    } else {
        k3_mxfp4_matmul_f32_mt(&e->w1, z, n, g, pool);
        k3_mxfp4_matmul_f32_mt(&e->w3, z, n, u, pool);
    }
    k3_situ(g, g, u, n * I, cfg->situ_b1, cfg->situ_b2); /* a = SiTU(g, u), in g */
    if (lc->idot) {
        /* the down projection quantizes its own input */
        int8_t *aq = k3_arena_alloc(ar, (size_t)n * I);
        float *as = K3_ARENA_F(ar, (size_t)n * I / 32);
        k3_act_quant_q8(g, n, I, aq, as);
        k3_mxfp4_matmul_i8_mt(&e->w2, aq, as, n, y, pool);
    } else {
        k3_mxfp4_matmul_f32_mt(&e->w2, g, n, y, pool);
    }
}

/* ---- the CPU's routed experts ---- */

/* One step's buffers, shared by the CPU expert loop and its callers. */
typedef struct moe_rows {
    int T, K, LT, G;
    const int32_t *sel; /* [T][topk] */
    const float *sel_w; /* [T][topk] */
    const int *n_sel;   /* [T] */
    const float *z;     /* [T][latent] */
    const int8_t *zq;   /* [T][latent] (idot) */
    const float *zs;    /* [T][latent/32] (idot) */
    int *rows, *rsel;   /* [T] */
    float *rw, *zg;     /* [T], [T][latent] */
    int8_t *zqg;        /* [T][latent] */
    float *zsg, *y;     /* [T][latent/32], [T][latent] */
    float *ysel;        /* [T][topk][latent] */
} moe_rows;

/* Experts run [n] of an open any-order batch, in the order the store hands
 * them out (ready first: every drive of a placement reads at once): each
 * over the rows that chose it, the output row kept per (position,
 * selection) in ysel, so the order does not reach the sums. */
static k3_status cpu_experts(const k3_layer_ctx *lc, k3_expert_batch *batch, const int32_t *run,
                             int n_run, const moe_rows *m, k3_arena *ar, char *err, size_t errlen) {
    const int T = m->T, K = m->K, LT = m->LT, G = m->G;
    k3_status st = K3_OK;
    for (int c = 0; c < n_run; c++) {
        k3_expert_view view;
        int i;
        st = k3_experts_batch_next(batch, &i, &view, err, errlen);
        if (st != K3_OK) break;
        int32_t e = run[i];
        int n = 0;
        for (int t = 0; t < T; t++)
            for (int k = 0; k < m->n_sel[t]; k++)
                if (m->sel[(size_t)t * K + k] == e) {
                    m->rows[n] = t;
                    m->rsel[n] = k;
                    m->rw[n] = m->sel_w[(size_t)t * K + k];
                    n++;
                }
        for (int r = 0; r < n; r++) {
            size_t src = (size_t)m->rows[r];
            if (lc->idot) {
                memcpy(m->zqg + (size_t)r * LT, m->zq + src * LT, (size_t)LT);
                memcpy(m->zsg + (size_t)r * G, m->zs + src * G, sizeof(float) * (size_t)G);
            } else {
                memcpy(m->zg + (size_t)r * LT, m->z + src * LT, sizeof(float) * (size_t)LT);
            }
        }
        size_t mark = ar->used;
        k3_moe_expert_apply(lc, &view, m->zg, m->zqg, m->zsg, n, m->y, ar);
        ar->used = mark;
        k3_experts_batch_put(batch, i);
        for (int r = 0; r < n; r++)
            memcpy(m->ysel + ((size_t)m->rows[r] * K + (size_t)m->rsel[r]) * LT,
                   m->y + (size_t)r * LT, sizeof(float) * (size_t)LT);
    }
    return st;
}

/* ---- LatentMoE ---- */

size_t k3_moe_scratch_bytes(const k3_config *c, int T) {
    size_t t = (size_t)T, E = (size_t)c->n_experts, K = (size_t)c->topk;
    size_t Lt = (size_t)c->latent, S = (size_t)c->shared_inter, D = (size_t)c->hidden;
    return k3_arena_round(sizeof(float) * t * E)                     /* router logits */
           + k3_arena_round(sizeof(int32_t) * t * K)                 /* selected ids */
           + k3_arena_round(sizeof(float) * t * K)                   /* their weights */
           + k3_arena_round(sizeof(int) * t)                         /* selected count */
           + k3_arena_round(E) + k3_arena_round(sizeof(int32_t) * E) /* union */
           + 2 * k3_arena_round(sizeof(float) * t * Lt)              /* z, U */
           + k3_arena_round(t * Lt) + k3_arena_round(sizeof(float) * t * Lt / 32) /* zq zs */
           + k3_arena_round(sizeof(int) * t) + k3_arena_round(sizeof(float) * t)  /* gather */
           + 2 * k3_arena_round(sizeof(float) * t * Lt)                           /* zg, y */
           + k3_arena_round(t * Lt) + k3_arena_round(sizeof(float) * t * Lt / 32) /* zqg zsg */
           + expert_scratch_bytes(c, T) + k3_arena_round(sizeof(int32_t) * E)     /* run order */
           + k3_arena_round(E)                           /* cached snapshot */
           + k3_arena_round(sizeof(int) * t)             /* gathered selection index */
           + k3_arena_round(sizeof(float) * t * K * Lt)  /* expert outputs per selection */
           + 2 * k3_arena_round(sizeof(float) * t * S)   /* shared g, u */
           + k3_arena_round(sizeof(float) * t * D)       /* shared out */
           + k3_arena_round(sizeof(int32_t) * E)         /* Vulkan tier: ids to redo */
           + k3_arena_round(sizeof(int32_t) * E)         /* remote experts */
           + k3_arena_round(sizeof(int) * (E + 1))       /* their row offsets */
           + 2 * k3_arena_round(sizeof(int) * t * K)     /* their rows, selection index */
           + k3_arena_round(sizeof(float) * t * K * Lt); /* their outputs */
}

k3_status k3_moe_forward(const k3_layer_ctx *lc, const k3_moe_w *w, int layer, const float *x,
                         int T, float *out, k3_arena *ar, k3_expert_stats *stats, char *err,
                         size_t errlen) {
    const k3_config *cfg = lc->cfg;
    int E = cfg->n_experts, K = cfg->topk, LT = cfg->latent, D = cfg->hidden;
    int S = cfg->shared_inter, G = LT / 32;
    k3_pool *pool = lc->pool;

    /* router: sigmoid scores, top-k on score + bias      x: [T][D] */
    float *logits = K3_ARENA_F(ar, (size_t)T * E);                      /* [T][E] */
    int32_t *sel = k3_arena_alloc(ar, sizeof(int32_t) * (size_t)T * K); /* [T][topk] */
    float *sel_w = K3_ARENA_F(ar, (size_t)T * K);                       /* [T][topk] */
    int *n_sel = k3_arena_alloc(ar, sizeof(int) * (size_t)T);           /* [T] */
    k3_qmat_matmul(&w->router, x, T, logits, pool);
    uint8_t *in_union = k3_arena_alloc(ar, (size_t)E); /* [E] */
    memset(in_union, 0, (size_t)E);
    for (int t = 0; t < T; t++) {
        k3_moe_route(logits + (size_t)t * E, w->bias, E, K, lc->topp, sel + (size_t)t * K,
                     sel_w + (size_t)t * K, &n_sel[t]);
        for (int k = 0; k < n_sel[t]; k++) in_union[sel[(size_t)t * K + k]] = 1;
    }
    int32_t *order = k3_arena_alloc(ar, sizeof(int32_t) * (size_t)E);
    int n_union = k3_experts_disk_order(lc->experts, layer, in_union, order);
    /* experts on another worker's drive (common/layers/moe_remote.h) leave
     * the local batch: they are called below, once z is known, in id order */
    const k3_moe_remote *rm = lc->remote;
    int32_t *rem = k3_arena_alloc(ar, sizeof(int32_t) * (size_t)E); /* [n_rem] ascending ids */
    int n_rem = 0;
    if (rm) {
        for (int e = 0; e < E; e++)
            if (in_union[e] && rm->is_remote(rm->ctx, layer, e)) rem[n_rem++] = e;
        int kept = 0;
        for (int i = 0; i < n_union; i++)
            if (!rm->is_remote(rm->ctx, layer, order[i])) order[kept++] = order[i];
        n_union = kept;
    }

    /* the Vulkan tier takes the experts resident on its device (docs/VULKAN.md) */
    k3_vk_job *vj = lc->vk ? k3_vk_tier_claim(lc->vk, layer, order, &n_union) : NULL;

    /* Compute order: the experts already cached first, then the rest, each
     * part in disk order. While the cached ones compute, their slots free
     * up and the misses are read into them, instead of the first misses
     * holding up the start. The sums are taken in id order (below),
     * so the order is free to follow the cache. The cache is looked at
     * once per expert: another session on this layer may change it between
     * the two passes, and each expert must land in exactly one of them. */
    int32_t *run = k3_arena_alloc(ar, sizeof(int32_t) * (size_t)E); /* [n_union] */
    uint8_t *hot = k3_arena_alloc(ar, (size_t)E); /* [n_union] cached at the look */
    for (int i = 0; i < n_union; i++) hot[i] = k3_experts_cached(lc->experts, layer, order[i]) != 0;
    int n_run = 0;
    int n_hot = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n_union; i++)
            if (hot[i] == (pass == 0)) run[n_run++] = order[i], n_hot += pass == 0;
    /* striped experts (common/experts/placement.h): the misses alternate
     * between drives, so the window's reads run on every drive at once */
    k3_experts_interleave(lc->experts, layer, run + n_hot, n_run - n_hot);

    /* The routed experts' reads start now (the batch admits its first
     * window and queues the misses to the loader threads), so the latent
     * down projection and the shared experts below compute while the
     * drive works. */
    k3_expert_batch *batch = NULL;
    k3_status st =
        k3_experts_batch_open_any(&batch, lc->experts, layer, run, n_run, stats, err, errlen);
    if (st != K3_OK) {
        if (vj) k3_vk_tier_finish(lc->vk, &vj, 0.0, order); /* never started: unpins */
        return st;
    }

    /* latent input z = W_down x                           [T][latent] */
    float *z = K3_ARENA_F(ar, (size_t)T * LT);
    k3_qmat_matmul(&w->lat_down, x, T, z, pool);
    int8_t *zq = k3_arena_alloc(ar, (size_t)T * LT); /* [T][latent] int8 (idot) */
    float *zs = K3_ARENA_F(ar, (size_t)T * G);       /* [T][latent/32] */
    if (lc->idot) k3_act_quant_q8(z, T, LT, zq, zs);
    float *ysel = K3_ARENA_F(ar, (size_t)T * K * LT); /* [T][topk][latent] */
    if (vj) k3_vk_tier_start(lc->vk, vj, z, sel, n_sel, T, K, ysel);

    /* the remote experts' calls go out now and compute on their workers
     * while the shared and the local experts compute here: per expert the
     * rows that chose it, ascending (the rows the local loop would give) */
    int *roff = k3_arena_alloc(ar, sizeof(int) * (size_t)(E + 1));
    int *rrow = k3_arena_alloc(ar, sizeof(int) * (size_t)T * K); /* [R] row of pair */
    int *rk = k3_arena_alloc(ar, sizeof(int) * (size_t)T * K);   /* [R] selection index */
    float *ry = K3_ARENA_F(ar, (size_t)T * K * LT);              /* [R][latent] outputs */
    if (n_rem > 0) {
        int R = 0;
        for (int i = 0; i < n_rem; i++) {
            roff[i] = R;
            for (int t = 0; t < T; t++)
                for (int k = 0; k < n_sel[t]; k++)
                    if (sel[(size_t)t * K + k] == rem[i]) rrow[R] = t, rk[R] = k, R++;
        }
        roff[n_rem] = R;
        st = rm->start(rm->ctx, layer, z, T, LT, rem, n_rem, roff, rrow, err, errlen);
        if (st != K3_OK) {
            k3_experts_batch_close(&batch);
            if (vj) k3_vk_tier_finish(lc->vk, &vj, 0.0, order); /* waits, unpins */
            return st;
        }
    }

    /* shared experts on the same x, computed now (under the reads) and
     * added unweighted at the very end, so the sum is the same as when
     * they ran last (docs/MODEL.md 3.6: out = W_up U + y_shared) */
    float *sg = K3_ARENA_F(ar, (size_t)T * S); /* [T][shared_inter] */
    float *su = K3_ARENA_F(ar, (size_t)T * S);
    float *ys = K3_ARENA_F(ar, (size_t)T * D); /* [T][D] */
    k3_qmat_matmul(&w->sh_gate, x, T, sg, pool);
    k3_qmat_matmul(&w->sh_up, x, T, su, pool);
    k3_situ(sg, sg, su, T * S, cfg->situ_b1, cfg->situ_b2);
    k3_qmat_matmul(&w->sh_down, sg, T, ys, pool);

    /* routed experts in run order, each over the rows that chose it:
     * expert i computes while the loader threads read i+1.. (K3_PIPE);
     * each output row is kept per (position, selection) */
    float *U = K3_ARENA_F(ar, (size_t)T * LT); /* [T][latent] weighted sum */
    memset(U, 0, sizeof(float) * (size_t)T * LT);
    int *rows = k3_arena_alloc(ar, sizeof(int) * (size_t)T);
    int *rsel = k3_arena_alloc(ar, sizeof(int) * (size_t)T); /* selection index k of each row */
    float *rw = K3_ARENA_F(ar, (size_t)T);
    float *zg = K3_ARENA_F(ar, (size_t)T * LT); /* gathered z rows */
    int8_t *zqg = k3_arena_alloc(ar, (size_t)T * LT);
    float *zsg = K3_ARENA_F(ar, (size_t)T * G);
    float *y = K3_ARENA_F(ar, (size_t)T * LT); /* [n][latent] expert outputs */
    moe_rows mr = {T,  K,    LT,   G,  sel, sel_w, n_sel, z, zq,
                   zs, rows, rsel, rw, zg,  zqg,   zsg,   y, ysel};
    double c0 = k3_now_ms();
    st = cpu_experts(lc, batch, run, n_run, &mr, ar, err, errlen);
    k3_experts_batch_close(&batch);
    if (vj) { /* the device's pairs; any it could not compute, on the CPU now */
        int32_t *redo = k3_arena_alloc(ar, sizeof(int32_t) * (size_t)E);
        int n_redo = k3_vk_tier_finish(lc->vk, &vj, k3_now_ms() - c0, redo);
        if (st == K3_OK && n_redo > 0) {
            st = k3_experts_batch_open_any(&batch, lc->experts, layer, redo, n_redo, stats, err,
                                           errlen);
            if (st == K3_OK) st = cpu_experts(lc, batch, redo, n_redo, &mr, ar, err, errlen);
            k3_experts_batch_close(&batch);
        }
    }
    if (n_rem > 0) {
        if (st != K3_OK) {
            rm->abort(rm->ctx);
            return st;
        }
        st = rm->finish(rm->ctx, ry, err, errlen);
        if (st != K3_OK) return st;
        for (int j = 0; j < roff[n_rem]; j++)
            memcpy(ysel + ((size_t)rrow[j] * K + (size_t)rk[j]) * LT, ry + (size_t)j * LT,
                   sizeof(float) * (size_t)LT);
    }
    if (st != K3_OK) return st;
    k3_vk_tier_offer(lc->vk, layer, run, n_run); /* promotion candidates */

    /* U[t] += w_e y_e over t's experts in expert id order, whatever order
     * they ran in, so the bits depend neither on the cache nor on the chunk,
     * nor on where the bytes lie (a repacked container or a placement over
     * several drives reorders the files, not the sums) */
    for (int t = 0; t < T; t++) {
        int ks[K3_MAX_TOPK];
        int m = n_sel[t];
        for (int k = 0; k < m; k++) { /* insertion sort by expert id (m <= topk) */
            int j = k;
            while (j > 0 && sel[(size_t)t * K + ks[j - 1]] > sel[(size_t)t * K + k]) {
                ks[j] = ks[j - 1];
                j--;
            }
            ks[j] = k;
        }
        float *u = U + (size_t)t * LT;
        for (int q = 0; q < m; q++) {
            const float *yr = ysel + ((size_t)t * K + (size_t)ks[q]) * LT;
            const float we = sel_w[(size_t)t * K + ks[q]];
            for (int j = 0; j < LT; j++) u[j] = u[j] + we * yr[j];
        }
    }

    /* RMSNorm of the aggregate, then back to D: out = W_up U, + y_shared */
    for (int t = 0; t < T; t++)
        k3_rmsnorm(U + (size_t)t * LT, U + (size_t)t * LT, w->lat_norm, LT, cfg->eps);
    k3_qmat_matmul(&w->lat_up, U, T, out, pool);
    for (size_t i = 0; i < (size_t)T * D; i++) out[i] = out[i] + ys[i];
    return K3_OK;
}

/* ---- dense MLP (layers < first_k_dense_replace) ---- */

size_t k3_dense_scratch_bytes(const k3_config *c, int T) {
    return 2 * k3_arena_round(sizeof(float) * (size_t)T * (size_t)c->dense_inter);
}

void k3_dense_forward(const k3_layer_ctx *lc, const k3_dense_w *w, const float *x, int T,
                      float *out, k3_arena *ar) {
    int I = lc->cfg->dense_inter;
    float *g = K3_ARENA_F(ar, (size_t)T * I); /* [T][dense_inter] W_gate x */
    float *u = K3_ARENA_F(ar, (size_t)T * I); /* [T][dense_inter] W_up x */
    k3_qmat_matmul(&w->gate, x, T, g, lc->pool);
    k3_qmat_matmul(&w->up, x, T, u, lc->pool);
    k3_situ(g, g, u, T * I, lc->cfg->situ_b1, lc->cfg->situ_b2);
    k3_qmat_matmul(&w->down, g, T, out, lc->pool); /* out: [T][D] */
}
