/* common/engine/stage.c: one session's sequential state and the forward pass of a
 * layer range over a chunk (stage.h; docs/MODEL.md 3.3 for the AttnRes wiring, 5.2 for
 * chunked prefill). layer_forward() below is the whole decoder layer, top to
 * bottom; the math of each block lives in kda.c, mla.c, moe.c, attnres.c.
 */
#include "common/engine/stage.h"

#include <stdlib.h>
#include <string.h>

#include "common/layers/layers.h"
#include "common/base/log.h"

struct k3_state {
    const k3_model *m;        /* borrowed: the model this state belongs to */
    int layer_a, layer_b;     /* the model's range */
    int max_ctx;              /* capacity in tokens */
    int pos;                  /* tokens consumed */
    int broken;               /* a forward failed midway: reset before use */
    const atomic_int *cancel; /* polled between layers, may be NULL */
    k3_kda_state *kda;        /* [b - a]; S [H][hd][hd] and conv [3][P][K] for KDA layers */
    k3_mla_cache *mla;        /* [b - a]; latent + rope cache for MLA layers, grown on demand */
    size_t kda_bytes;         /* bytes of all KDA states */
    k3_arena ar;              /* scratch for one forward, grown as T / context grow */
};

k3_status k3_state_open(k3_state **out, const k3_model *m, int max_ctx, char *err, size_t errlen) {
    *out = NULL;
    if (max_ctx < 1 || max_ctx > K3_MAX_CTX)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "state: context %d outside [1, %d] (K3_MAX_CTX)",
                       max_ctx, K3_MAX_CTX);
    const k3_config *c = k3_model_config(m);
    k3_state *s = k3_xcalloc(1, sizeof *s);
    s->m = m;
    k3_model_range(m, &s->layer_a, &s->layer_b);
    s->max_ctx = max_ctx;
    int n = s->layer_b - s->layer_a;
    s->kda = k3_xcalloc((size_t)n, sizeof *s->kda);
    s->mla = k3_xcalloc((size_t)n, sizeof *s->mla);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    for (int i = s->layer_a; i < s->layer_b; i++) {
        if (!c->is_kda[i]) continue;
        k3_kda_state *k = &s->kda[i - s->layer_a];
        k->S = calloc(S_n, sizeof(float));
        k->conv = calloc(conv_n, sizeof(float));
        if (!k->S || !k->conv) {
            k3_state_close(&s);
            return k3_errf(K3_ERR_NOMEM, err, errlen,
                           "state: cannot allocate the KDA state of layer %d (%zu bytes)", i,
                           sizeof(float) * (S_n + conv_n));
        }
        s->kda_bytes += sizeof(float) * (S_n + conv_n);
    }
    *out = s;
    return K3_OK;
}

void k3_state_close(k3_state **sp) {
    if (!sp || !*sp) return;
    k3_state *s = *sp;
    for (int i = 0; i < s->layer_b - s->layer_a; i++) {
        free(s->kda[i].S);
        free(s->kda[i].conv);
        k3_mla_cache_free(&s->mla[i]);
    }
    free(s->kda);
    free(s->mla);
    free(s->ar.base);
    free(s);
    *sp = NULL;
}

void k3_state_reset(k3_state *s) {
    const k3_config *c = k3_model_config(s->m);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    for (int i = 0; i < s->layer_b - s->layer_a; i++) {
        if (s->kda[i].S) memset(s->kda[i].S, 0, sizeof(float) * S_n);
        if (s->kda[i].conv) memset(s->kda[i].conv, 0, sizeof(float) * conv_n);
        /* MLA rows past pos are never read, so the cache keeps its memory */
    }
    s->pos = 0;
    s->broken = 0;
}

int k3_state_pos(const k3_state *s) { return s->pos; }
int k3_state_max_ctx(const k3_state *s) { return s->max_ctx; }

size_t k3_state_bytes(const k3_state *s) {
    const k3_config *c = k3_model_config(s->m);
    size_t b = s->kda_bytes + s->ar.cap;
    for (int i = 0; i < s->layer_b - s->layer_a; i++)
        b += sizeof(float) * (size_t)s->mla[i].cap * (size_t)(c->kv_lora + c->qk_rope);
    return b;
}

void k3_stage_set_cancel(k3_state *s, const atomic_int *cancel) { s->cancel = cancel; }

/* ---- turn checkpoints (stage.h) ---- */

struct k3_state_ckpt {
    int pos;     /* the state's position when saved */
    int n;       /* layers of the range */
    float *data; /* every KDA layer's S then conv, in layer order, owned */
    size_t bytes;
};

k3_status k3_state_save(const k3_state *s, k3_state_ckpt **out, char *err, size_t errlen) {
    *out = NULL;
    if (s->broken)
        return k3_errf(K3_ERR_STATE, err, errlen, "checkpoint: the state is broken (reset first)");
    const k3_config *c = k3_model_config(s->m);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    k3_state_ckpt *ck = k3_xcalloc(1, sizeof *ck);
    ck->pos = s->pos;
    ck->n = s->layer_b - s->layer_a;
    ck->bytes = s->kda_bytes;
    ck->data = malloc(ck->bytes ? ck->bytes : 1);
    if (!ck->data) {
        free(ck);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "checkpoint: cannot allocate %zu bytes",
                       s->kda_bytes);
    }
    float *p = ck->data;
    for (int i = 0; i < ck->n; i++) {
        if (!s->kda[i].S) continue;
        memcpy(p, s->kda[i].S, sizeof(float) * S_n);
        memcpy(p + S_n, s->kda[i].conv, sizeof(float) * conv_n);
        p += S_n + conv_n;
    }
    *out = ck;
    return K3_OK;
}

k3_status k3_state_restore(k3_state *s, const k3_state_ckpt *ck, char *err, size_t errlen) {
    if (ck->n != s->layer_b - s->layer_a || ck->bytes != s->kda_bytes)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "restore: checkpoint of %d layers / %zu bytes, state %d / %zu", ck->n,
                       ck->bytes, s->layer_b - s->layer_a, s->kda_bytes);
    if (ck->pos > s->pos)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "restore: checkpoint at position %d is past the state's %d", ck->pos,
                       s->pos);
    const k3_config *c = k3_model_config(s->m);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    const float *p = ck->data;
    for (int i = 0; i < ck->n; i++) {
        if (!s->kda[i].S) continue;
        memcpy(s->kda[i].S, p, sizeof(float) * S_n);
        memcpy(s->kda[i].conv, p + S_n, sizeof(float) * conv_n);
        p += S_n + conv_n;
    }
    s->pos = ck->pos;
    s->broken = 0;
    return K3_OK;
}

void k3_state_ckpt_free(k3_state_ckpt **ck) {
    if (!ck || !*ck) return;
    free((*ck)->data);
    free(*ck);
    *ck = NULL;
}

int k3_state_ckpt_pos(const k3_state_ckpt *ck) { return ck->pos; }
size_t k3_state_ckpt_bytes(const k3_state_ckpt *ck) { return ck->bytes; }

/* ---- the state as bytes (stage.h, checkpoints on disk) ---- */

uint64_t k3_state_dump_bytes(const k3_state *s, int pos) {
    const k3_config *c = k3_model_config(s->m);
    uint64_t row = sizeof(float) * (uint64_t)(c->kv_lora + c->qk_rope);
    uint64_t n = s->kda_bytes;
    for (int i = s->layer_a; i < s->layer_b; i++)
        if (!c->is_kda[i]) n += row * (uint64_t)pos;
    return n;
}

k3_status k3_state_dump(const k3_state *s, FILE *f, char *err, size_t errlen) {
    if (s->broken)
        return k3_errf(K3_ERR_STATE, err, errlen, "state dump: the state is broken (reset first)");
    const k3_config *c = k3_model_config(s->m);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    size_t P = (size_t)s->pos;
    int ok = 1;
    for (int i = 0; i < s->layer_b - s->layer_a && ok; i++) {
        if (s->kda[i].S) {
            ok = fwrite(s->kda[i].S, sizeof(float), S_n, f) == S_n &&
                 fwrite(s->kda[i].conv, sizeof(float), conv_n, f) == conv_n;
        } else if (P > 0) {
            const k3_mla_cache *m = &s->mla[i];
            size_t nl = P * (size_t)c->kv_lora, nr = P * (size_t)c->qk_rope;
            ok = m->cap >= s->pos && fwrite(m->lat, sizeof(float), nl, f) == nl &&
                 (nr == 0 || fwrite(m->rope, sizeof(float), nr, f) == nr);
        }
    }
    if (!ok)
        return k3_errf(K3_ERR_IO, err, errlen, "state dump at position %d: write failed", s->pos);
    return K3_OK;
}

k3_status k3_state_load(k3_state *s, FILE *f, int pos, char *err, size_t errlen) {
    const k3_config *c = k3_model_config(s->m);
    if (pos < 0 || pos > s->max_ctx)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "state load: position %d outside [0, %d] (the session's context)", pos,
                       s->max_ctx);
    k3_state_reset(s);
    size_t S_n = (size_t)c->kda_heads * (size_t)c->kda_hd * (size_t)c->kda_hd;
    size_t conv_n = 3 * (size_t)c->kda_proj * (size_t)c->conv_k;
    size_t P = (size_t)pos;
    for (int i = 0; i < s->layer_b - s->layer_a; i++) {
        int ok = 1;
        if (s->kda[i].S) {
            ok = fread(s->kda[i].S, sizeof(float), S_n, f) == S_n &&
                 fread(s->kda[i].conv, sizeof(float), conv_n, f) == conv_n;
        } else if (P > 0) {
            k3_mla_cache *m = &s->mla[i];
            k3_status st = k3_mla_cache_reserve(m, c, pos, s->max_ctx, err, errlen);
            if (st) {
                k3_state_reset(s);
                return st;
            }
            size_t nl = P * (size_t)c->kv_lora, nr = P * (size_t)c->qk_rope;
            ok = fread(m->lat, sizeof(float), nl, f) == nl &&
                 (nr == 0 || fread(m->rope, sizeof(float), nr, f) == nr);
        }
        if (!ok) {
            k3_state_reset(s);
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "state load: short read at layer %d (position %d)", s->layer_a + i, pos);
        }
    }
    s->pos = pos;
    return K3_OK;
}

/* ---- the decoder layer ---- */

typedef struct stage_run {
    k3_layer_ctx lc;
    k3_state *s;
    int pos0, T;
    float *blocks;      /* [K3_MAX_RES_ENTRIES][T][D] AttnRes snapshots B */
    int *nb;            /* snapshots in B */
    float *p;           /* [T][D] the running prefix = the hidden h in/out */
    float *x;           /* [T][D] mixed + normed block input */
    float *a;           /* [T][D] attention output */
    float *f;           /* [T][D] MLP output */
    k3_expert_stats es; /* expert counters of this step */
} stage_run;

/* x[t] = Mix([B..., p]; w) for every position of the chunk. */
static void mix_chunk(const stage_run *r, const float *w, float *x) {
    const k3_config *c = r->lc.cfg;
    int D = c->hidden, T = r->T, nb = *r->nb;
    for (int t = 0; t < T; t++) {
        const float *ent[K3_MAX_RES_ENTRIES + 1];
        for (int e = 0; e < nb; e++) ent[e] = r->blocks + ((size_t)e * T + t) * D;
        ent[nb] = r->p + (size_t)t * D;
        k3_attnres_mix(ent, nb + 1, w, D, c->eps, x + (size_t)t * D);
    }
}

static void norm_chunk(const stage_run *r, const float *w, float *x) {
    int D = r->lc.cfg->hidden;
    for (int t = 0; t < r->T; t++)
        k3_rmsnorm(x + (size_t)t * D, x + (size_t)t * D, w, D, r->lc.cfg->eps);
}

static k3_status layer_forward(stage_run *r, const k3_layer_w *lw, char *err, size_t errlen) {
    const k3_config *c = r->lc.cfg;
    int D = c->hidden, T = r->T, i = lw->layer;
    size_t TD = (size_t)T * D;
    k3_state *s = r->s;
    k3_arena *ar = &s->ar;
    size_t mark = ar->used; /* layer scratch is released at the end */
    float *p = r->p, *x = r->x, *a = r->a, *f = r->f;

    /* 1-2. attention input: x = Mix([B..., p]; w_attn), or p itself when B
     *      is still empty (layer 0)                              [T][D] */
    if (*r->nb > 0)
        mix_chunk(r, lw->w_attn_res, x);
    else
        memcpy(x, p, sizeof(float) * TD);

    /* 3. at a block boundary the incoming prefix becomes snapshot b_nb,
     *    after the pre-attention mix used it as its last entry */
    if (lw->is_boundary) {
        K3_ASSERT(*r->nb < K3_MAX_RES_ENTRIES);
        memcpy(r->blocks + (size_t)*r->nb * TD, p, sizeof(float) * TD);
        (*r->nb)++;
    }

    /* 4. a = Attn(RMSNorm(x; input_layernorm))                   [T][D] */
    norm_chunk(r, lw->in_norm, x);
    if (lw->is_kda)
        k3_kda_forward(&r->lc, &lw->kda, &s->kda[i - s->layer_a], x, T, a, ar);
    else
        k3_mla_forward(&r->lc, &lw->mla, &s->mla[i - s->layer_a], r->pos0, x, T, a, ar);
    ar->used = mark;

    /* 5. the prefix restarts at the attention output on a boundary,
     *    else accumulates it */
    if (lw->is_boundary)
        memcpy(p, a, sizeof(float) * TD);
    else
        for (size_t j = 0; j < TD; j++) p[j] = p[j] + a[j];

    /* 6. MLP input: m = Mix([B..., p]; w_mlp), B with this layer's
     *    snapshot                                                [T][D] */
    mix_chunk(r, lw->w_mlp_res, x);

    /* 7. f = MLP(RMSNorm(m; post_attention_layernorm))           [T][D] */
    norm_chunk(r, lw->post_norm, x);
    if (lw->is_moe) {
        k3_status st = k3_moe_forward(&r->lc, &lw->moe, i, x, T, f, ar, &r->es, err, errlen);
        ar->used = mark;
        if (st != K3_OK) return st;
    } else {
        k3_dense_forward(&r->lc, &lw->dense, x, T, f, ar);
        ar->used = mark;
    }

    /* 8. p += f: the layer's output h                           [T][D] */
    for (size_t j = 0; j < TD; j++) p[j] = p[j] + f[j];
    return K3_OK;
}

/* Scratch of one forward: the stage buffers plus the largest layer need. */
static size_t scratch_bytes(const k3_state *s, int pos0, int T) {
    const k3_config *c = k3_model_config(s->m);
    size_t layer = 0;
    for (int i = s->layer_a; i < s->layer_b; i++) {
        size_t attn =
            c->is_kda[i] ? k3_kda_scratch_bytes(c, T) : k3_mla_scratch_bytes(c, T, pos0 + T);
        size_t mlp = c->is_moe[i] ? k3_moe_scratch_bytes(c, T) : k3_dense_scratch_bytes(c, T);
        if (attn > layer) layer = attn;
        if (mlp > layer) layer = mlp;
    }
    return 3 * k3_arena_round(sizeof(float) * (size_t)T * (size_t)c->hidden) + layer;
}

k3_status k3_stage_forward(k3_model *m, k3_state *s, int pos0, int T, float *blocks, int *nb,
                           float *h, k3_step_stats *stats, k3_trace_fn trace, void *trace_ctx,
                           char *err, size_t errlen) {
    const k3_config *c = k3_model_config(m);
    double t_start = k3_now_ms();
    /* ---- arguments (from a peer on a worker: checked, never asserted) ---- */
    if (s->m != m)
        return k3_errf(K3_ERR_ARG, err, errlen, "stage: the state belongs to another model");
    if (s->broken)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "stage: the state is unusable after a failed step; reset the session");
    if (T < 1 || T > K3_MAX_CHUNK)
        return k3_errf(K3_ERR_ARG, err, errlen, "stage: chunk of %d tokens outside [1, %d]", T,
                       K3_MAX_CHUNK);
    if (pos0 != s->pos)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "stage: chunk starts at position %d but the session is at %d", pos0, s->pos);
    if ((int64_t)pos0 + T > s->max_ctx)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "stage: positions [%d, %d) exceed the context capacity of %d tokens", pos0,
                       pos0 + T, s->max_ctx);
    int want_nb = k3_config_snapshots_before(c, s->layer_a);
    if (*nb != want_nb)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "stage: %d AttnRes blocks given, layer %d expects %d", *nb, s->layer_a,
                       want_nb);
    if (k3_config_snapshots_before(c, s->layer_b) > K3_MAX_RES_ENTRIES)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "stage: %d AttnRes blocks > limit %d",
                       k3_config_snapshots_before(c, s->layer_b), K3_MAX_RES_ENTRIES);

    /* ---- memory: MLA caches for the chunk, scratch ---- */
    for (int i = s->layer_a; i < s->layer_b; i++) {
        if (c->is_kda[i]) continue;
        k3_status st =
            k3_mla_cache_reserve(&s->mla[i - s->layer_a], c, pos0 + T, s->max_ctx, err, errlen);
        if (st != K3_OK) {
            k3_err_prefix(err, errlen, "layer %d", i);
            return st;
        }
    }
    size_t need = scratch_bytes(s, pos0, T);
    if (need > s->ar.cap) {
        void *p = NULL;
        if (posix_memalign(&p, 64, need) != 0)
            return k3_errf(K3_ERR_NOMEM, err, errlen, "stage: cannot allocate %zu bytes of scratch",
                           need);
        free(s->ar.base);
        s->ar.base = p;
        s->ar.cap = need;
    }
    s->ar.used = 0;

    stage_run r;
    memset(&r, 0, sizeof r);
    r.lc.cfg = c;
    r.lc.pool = k3_model_pool(m);
    r.lc.experts = k3_model_experts(m);
    r.lc.idot = k3_model_idot(m);
    r.lc.topp = k3_model_topp(m);
    r.lc.vk = k3_model_vk(m);
    r.lc.remote = k3_model_moe_remote(m);
    r.s = s;
    r.pos0 = pos0;
    r.T = T;
    r.blocks = blocks;
    r.nb = nb;
    r.p = h;
    size_t TD = (size_t)T * (size_t)c->hidden;
    r.x = K3_ARENA_F(&s->ar, TD);
    r.a = K3_ARENA_F(&s->ar, TD);
    r.f = K3_ARENA_F(&s->ar, TD);

    /* ---- the layers, in order ---- */
    k3_status st = K3_OK;
    for (int i = s->layer_a; i < s->layer_b; i++) {
        if (s->cancel && atomic_load_explicit(s->cancel, memory_order_acquire)) {
            st = k3_errf(K3_ERR_CANCEL, err, errlen, "stage: cancelled before layer %d", i);
            break;
        }
        st = layer_forward(&r, k3_model_layer(m, i), err, errlen);
        if (st != K3_OK) {
            if (err && strncmp(err, "layer ", 6) != 0) k3_err_prefix(err, errlen, "layer %d", i);
            break;
        }
        if (trace) trace(trace_ctx, i, pos0, T, h);
    }
    if (st != K3_OK) {
        s->broken = 1; /* earlier layers already advanced their state */
        return st;
    }
    s->pos += T;
    if (stats) {
        double total = k3_now_ms() - t_start;
        stats->read_ms = r.es.read_ms;
        stats->compute_ms = total - r.es.read_ms;
        stats->bytes_read = r.es.bytes;
        stats->expert_hits = r.es.hits;
        stats->expert_misses = r.es.misses;
    }
    return K3_OK;
}
