/* coordinator/generate.c: sessions, chunked prefill and the generation loop
 * (see generate.h), plus the in-process trunk.
 *
 * One forward step on a chunk of T tokens at positions [pos0, pos0 + T):
 *   h      = embed(ids)                       [T][D]
 *   nb     = 0                                 (block list empty)
 *   (B, h) = trunk(pos0, T, B, h)              B [nb][T][D], every layer
 *   logits = head(B, h, t0)                    [T - t0][vocab]
 * t0 = T - 1 in normal operation (only the last position is needed to
 * sample), t0 = 0 when the caller asked for teacher-forced logits.
 * A prompt is cut into chunks of at most `chunk` tokens; the stage code
 * makes the result bit-identical for every cut (stage.h), so the chunk size
 * is purely a speed setting.
 */
#include "coordinator/generate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "coordinator/ckpt_dir.h"

/* ---- in-process trunk --------------------------------------------------- */

typedef struct inproc_trunk {
    k3_model *model; /* borrowed; holds layers [0, n_layers) */
} inproc_trunk;

static k3_status inproc_state_open(k3_trunk *t, int max_ctx, void **state, char *err,
                                   size_t errlen) {
    inproc_trunk *it = t->impl;
    k3_state *s = NULL;
    k3_status st = k3_state_open(&s, it->model, max_ctx, err, errlen);
    *state = s;
    return st;
}

static void inproc_state_close(k3_trunk *t, void **state) {
    (void)t;
    k3_state *s = *state;
    k3_state_close(&s);
    *state = NULL;
}

static void inproc_state_reset(k3_trunk *t, void *state) {
    (void)t;
    k3_state_reset(state);
}

static k3_status inproc_forward(k3_trunk *t, void *state, int pos0, int T, float *blocks, int *nb,
                                float *h, k3_step_stats *stats, k3_trace_fn trace, void *trace_ctx,
                                char *err, size_t errlen) {
    inproc_trunk *it = t->impl;
    return k3_stage_forward(it->model, state, pos0, T, blocks, nb, h, stats, trace, trace_ctx, err,
                            errlen);
}

static void inproc_set_cancel(k3_trunk *t, void *state, const atomic_int *cancel) {
    (void)t;
    k3_stage_set_cancel(state, cancel);
}

static size_t inproc_state_bytes(k3_trunk *t, void *state) {
    (void)t;
    return k3_state_bytes(state);
}

static k3_status inproc_ckpt_save(k3_trunk *t, void *state, int keep, uint64_t key, void **ck,
                                  char *err, size_t errlen) {
    (void)t, (void)keep, (void)key;
    k3_state_ckpt *c = NULL;
    k3_status st = k3_state_save(state, &c, err, errlen);
    *ck = c;
    return st;
}

static k3_status inproc_ckpt_restore(k3_trunk *t, void *state, const void *ck, char *err,
                                     size_t errlen) {
    (void)t;
    return k3_state_restore(state, ck, err, errlen);
}

static void inproc_ckpt_free(k3_trunk *t, void **ck) {
    (void)t;
    k3_state_ckpt *c = *ck;
    k3_state_ckpt_free(&c);
    *ck = NULL;
}

static size_t inproc_ckpt_bytes(k3_trunk *t, const void *ck) {
    (void)t;
    return k3_state_ckpt_bytes(ck);
}

static uint64_t inproc_dump_bytes(k3_trunk *t, void *state, int pos) {
    (void)t;
    return k3_state_dump_bytes(state, pos);
}

static k3_status inproc_dump(k3_trunk *t, void *state, FILE *f, char *err, size_t errlen) {
    (void)t;
    return k3_state_dump(state, f, err, errlen);
}

static k3_status inproc_load(k3_trunk *t, void *state, FILE *f, int pos, uint64_t key, char *err,
                             size_t errlen) {
    (void)t, (void)key;
    return k3_state_load(state, f, pos, err, errlen);
}

static void inproc_close(k3_trunk *t) {
    free(t->impl);
    t->impl = NULL;
}

static const k3_trunk_ops inproc_ops = {
    .name = "in-process",
    .state_open = inproc_state_open,
    .state_close = inproc_state_close,
    .state_reset = inproc_state_reset,
    .forward = inproc_forward,
    .set_cancel = inproc_set_cancel,
    .state_bytes = inproc_state_bytes,
    .ckpt_save = inproc_ckpt_save,
    .ckpt_restore = inproc_ckpt_restore,
    .ckpt_free = inproc_ckpt_free,
    .ckpt_bytes = inproc_ckpt_bytes,
    .state_dump_bytes = inproc_dump_bytes,
    .state_dump = inproc_dump,
    .state_load = inproc_load,
    .close = inproc_close,
};

k3_status k3_trunk_open_inproc(k3_trunk **out, k3_model *m, char *err, size_t errlen) {
    *out = NULL;
    const k3_config *cfg = k3_model_config(m);
    int a = 0, b = 0;
    k3_model_range(m, &a, &b);
    if (a != 0 || b != cfg->n_layers)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "in-process trunk: model holds layers [%d, %d), needs [0, %d)", a, b,
                       cfg->n_layers);
    inproc_trunk *it = k3_xcalloc(1, sizeof *it);
    it->model = m;
    k3_trunk *t = k3_xcalloc(1, sizeof *t);
    t->ops = &inproc_ops;
    t->impl = it;
    *out = t;
    return K3_OK;
}

void k3_trunk_close(k3_trunk **t) {
    if (!t || !*t) return;
    if ((*t)->ops && (*t)->ops->close) (*t)->ops->close(*t);
    free(*t);
    *t = NULL;
}

/* ---- session ------------------------------------------------------------ */

struct k3_session {
    k3_model *model;     /* borrowed */
    k3_trunk *trunk;     /* borrowed */
    void *state;         /* trunk state, owned (closed through the trunk) */
    int D, vocab;        /* hidden size, vocabulary */
    int chunk;           /* prefill chunk, tokens */
    int max_ctx;         /* capacity, tokens */
    int progress;        /* per-chunk stderr lines */
    int has_head;        /* 0 under K3_LAYERS truncation */
    int32_t *ids;        /* [max_ctx] committed ids, owned */
    int n_ids;           /* committed so far == trunk state position */
    float *blocks;       /* [K3_MAX_RES_ENTRIES][chunk][D], owned */
    float *h;            /* [chunk][D], owned */
    float *logits;       /* [vocab] logits of position n_ids - 1, owned */
    int logits_valid;    /* logits belong to the current n_ids */
    float *tf_logits;    /* [chunk][vocab] teacher-forced rows, owned, lazy */
    k3_step_stats stats; /* summed since open */
    int n_reused;        /* ids kept by the last feed (prefix or checkpoint) */
    int max_ckpt;        /* turn checkpoints kept, 0 = none */
    k3_ckpt_dir *store;  /* parked checkpoints (--ckpt-dir), borrowed, may be NULL */
    int n_ckpt;          /* held, oldest first; positions ascending */
    void *ckpt[K3_MAX_CKPT];
    int ckpt_pos[K3_MAX_CKPT];
};

/* Drops the checkpoints at positions > pos (all: pos < 0). */
static void ckpt_drop_after(k3_session *s, int pos) {
    while (s->n_ckpt > 0 && (pos < 0 || s->ckpt_pos[s->n_ckpt - 1] > pos)) {
        s->n_ckpt--;
        s->trunk->ops->ckpt_free(s->trunk, &s->ckpt[s->n_ckpt]);
    }
}

/* malloc for buffers whose size derives from the config (a file): failure
 * is an error return, not an abort. */
static k3_status sess_alloc(void **p, size_t n, const char *what, char *err, size_t errlen) {
    *p = malloc(n ? n : 1);
    if (!*p)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "session: cannot allocate %zu bytes for %s", n,
                       what);
    return K3_OK;
}

k3_status k3_session_open(k3_session **out, k3_model *m, k3_trunk *trunk, const k3_session_opts *o,
                          char *err, size_t errlen) {
    *out = NULL;
    if (o->max_ctx < 1 || o->max_ctx > K3_MAX_CTX)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "context %d tokens: outside 1..%d (K3_MAX_CTX)",
                       o->max_ctx, K3_MAX_CTX);
    if (o->chunk < 1 || o->chunk > K3_MAX_CHUNK)
        return k3_errf(K3_ERR_ARG, err, errlen, "chunk %d: outside 1..%d (K3_MAX_CHUNK)", o->chunk,
                       K3_MAX_CHUNK);
    const k3_config *cfg = k3_model_config(m);
    k3_session *s = k3_xcalloc(1, sizeof *s);
    s->model = m;
    s->trunk = trunk;
    s->D = cfg->hidden;
    s->vocab = cfg->vocab;
    s->max_ctx = o->max_ctx;
    /* a chunk larger than the context would only waste buffer space */
    s->chunk = o->chunk < o->max_ctx ? o->chunk : o->max_ctx;
    s->progress = o->progress;
    s->has_head = cfg->n_layers == cfg->n_layers_full;
    s->max_ckpt =
        trunk->ops->ckpt_save && o->ckpt > 0 ? (o->ckpt < K3_MAX_CKPT ? o->ckpt : K3_MAX_CKPT) : 0;
    s->store = s->max_ckpt > 0 && trunk->ops->state_load ? o->store : NULL;

    size_t D = (size_t)s->D, C = (size_t)s->chunk;
    k3_status st;
    if ((st = sess_alloc((void **)&s->ids, (size_t)s->max_ctx * sizeof(int32_t), "ids", err,
                         errlen)) ||
        (st = sess_alloc((void **)&s->blocks, (size_t)K3_MAX_RES_ENTRIES * C * D * sizeof(float),
                         "AttnRes blocks", err, errlen)) ||
        (st = sess_alloc((void **)&s->h, C * D * sizeof(float), "hidden", err, errlen)) ||
        (st = sess_alloc((void **)&s->logits, (size_t)s->vocab * sizeof(float), "logits", err,
                         errlen)) ||
        (st = trunk->ops->state_open(trunk, s->max_ctx, &s->state, err, errlen))) {
        k3_session_close(&s);
        return st;
    }
    *out = s;
    return K3_OK;
}

void k3_session_close(k3_session **sp) {
    if (!sp || !*sp) return;
    k3_session *s = *sp;
    ckpt_drop_after(s, -1);
    if (s->state) s->trunk->ops->state_close(s->trunk, &s->state);
    free(s->ids);
    free(s->blocks);
    free(s->h);
    free(s->logits);
    free(s->tf_logits);
    free(s);
    *sp = NULL;
}

void k3_session_reset(k3_session *s) {
    ckpt_drop_after(s, -1); /* the MLA rows they rely on will be overwritten */
    s->trunk->ops->state_reset(s->trunk, s->state);
    s->n_ids = 0;
    s->logits_valid = 0;
}

int k3_session_len(const k3_session *s) { return s->n_ids; }
const int32_t *k3_session_ids(const k3_session *s) { return s->ids; }
int k3_session_max_ctx(const k3_session *s) { return s->max_ctx; }
int k3_session_has_head(const k3_session *s) { return s->has_head; }

size_t k3_session_state_bytes(const k3_session *s) {
    size_t C = (size_t)s->chunk, D = (size_t)s->D, V = (size_t)s->vocab;
    size_t n = (size_t)s->max_ctx * sizeof(int32_t) +
               ((size_t)K3_MAX_RES_ENTRIES + 1) * C * D * sizeof(float) + V * sizeof(float);
    if (s->tf_logits) n += C * V * sizeof(float);
    if (s->trunk->ops->state_bytes) n += s->trunk->ops->state_bytes(s->trunk, s->state);
    return n;
}

void k3_session_stats(const k3_session *s, k3_step_stats *out) { *out = s->stats; }

static void stats_add(k3_step_stats *acc, const k3_step_stats *x) {
    acc->compute_ms += x->compute_ms;
    acc->read_ms += x->read_ms;
    acc->bytes_read += x->bytes_read;
    acc->expert_hits += x->expert_hits;
    acc->expert_misses += x->expert_misses;
}

/* Index of the first non-finite value of row, or -1. */
static int first_non_finite(const float *row, int n) {
    for (int i = 0; i < n; i++)
        if (!isfinite(row[i])) return i;
    return -1;
}

/* One forward step: ids[0, T) at position s->n_ids, T <= chunk. Commits the
 * ids on success; resets the session on failure (the trunk state is then
 * unusable, stage.h). */
static k3_status sess_step(k3_session *s, const int32_t *ids, int T, const k3_feed_hooks *hk,
                           char *err, size_t errlen) {
    const int pos0 = s->n_ids;
    const size_t V = (size_t)s->vocab;
    k3_step_stats stats = {0};
    int nb = 0;
    k3_status st = k3_model_embed(s->model, ids, T, s->h, err, errlen);
    if (st) {
        /* nothing ran: the state is intact, keep the committed ids */
        k3_err_prefix(err, errlen, "positions %d..%d", pos0, pos0 + T - 1);
        return st;
    }
    const atomic_int *cancel = hk ? hk->cancel : NULL;
    if (cancel && s->trunk->ops->set_cancel) s->trunk->ops->set_cancel(s->trunk, s->state, cancel);
    st = s->trunk->ops->forward(s->trunk, s->state, pos0, T, s->blocks, &nb, s->h, &stats,
                                hk ? hk->trace : NULL, hk ? hk->trace_ctx : NULL, err, errlen);
    if (cancel && s->trunk->ops->set_cancel) s->trunk->ops->set_cancel(s->trunk, s->state, NULL);
    stats_add(&s->stats, &stats);
    if (st) goto fail;
    s->logits_valid = 0;
    if (s->has_head) {
        int want_all = hk && hk->logits;
        if (want_all && !s->tf_logits &&
            (st = sess_alloc((void **)&s->tf_logits, (size_t)s->chunk * V * sizeof(float),
                             "teacher-forced logits", err, errlen)))
            goto fail;
        int t0 = want_all ? 0 : T - 1;
        float *out = want_all ? s->tf_logits : s->logits;
        if ((st = k3_model_head(s->model, s->blocks, nb, s->h, T, t0, out, err, errlen))) goto fail;
        /* a NaN is a bug or a broken checkpoint: never sample from it */
        for (int t = t0; t < T; t++) {
            int bad = first_non_finite(out + (size_t)(t - t0) * V, s->vocab);
            if (bad >= 0) {
                st = k3_errf(K3_ERR_INTERNAL, err, errlen,
                             "non-finite logits at position %d (token %d: %g)", pos0 + t, bad,
                             (double)out[(size_t)(t - t0) * V + (size_t)bad]);
                goto fail;
            }
        }
        if (want_all) {
            hk->logits(hk->logits_ctx, pos0, T, s->vocab, s->tf_logits);
            memcpy(s->logits, s->tf_logits + (size_t)(T - 1) * V, V * sizeof(float));
        }
        s->logits_valid = 1;
    }
    memcpy(s->ids + pos0, ids, (size_t)T * sizeof(int32_t));
    s->n_ids += T;
    return K3_OK;
fail:
    k3_session_reset(s);
    return st;
}

/* 1 when the caller asked to stop (generate.h, k3_feed_hooks.cancel). */
static int cancelled(const atomic_int *cancel) {
    return cancel && atomic_load_explicit(cancel, memory_order_acquire) != 0;
}

static k3_status cancel_err(const k3_session *s, char *err, size_t errlen) {
    return k3_errf(K3_ERR_CANCEL, err, errlen, "cancelled at position %d (%d ids kept)", s->n_ids,
                   s->n_ids);
}

/* Feeds ids[0, n) after the committed ids, in chunks; *done (may be NULL)
 * counts the tokens committed, also when it stops early. */
static k3_status sess_prefill(k3_session *s, const int32_t *ids, int n, const k3_feed_hooks *hk,
                              int *n_done, char *err, size_t errlen) {
    if (n_done) *n_done = 0;
    if (n > s->max_ctx - s->n_ids)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%d tokens after %d committed exceed the context of %d tokens (K3_MAXT)", n,
                       s->n_ids, s->max_ctx);
    /* ids are checked before anything runs so that a bad id leaves the
     * session as it was (the model's embed checks again per chunk) */
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->vocab)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "token id %d at position %d: outside 0..%d (vocab %d)", (int)ids[i],
                           s->n_ids + i, s->vocab - 1, s->vocab);
    int n_chunks = (n + s->chunk - 1) / s->chunk;
    double t_start = k3_now_ms();
    for (int c = 0, done = 0; done < n; c++) {
        int T = n - done < s->chunk ? n - done : s->chunk;
        if (cancelled(hk ? hk->cancel : NULL)) return cancel_err(s, err, errlen);
        double t0 = k3_now_ms();
        k3_status st = sess_step(s, ids + done, T, hk, err, errlen);
        if (st) return st;
        done += T;
        if (n_done) *n_done = done;
        if (hk && hk->progress) hk->progress(hk->progress_ctx, done, n);
        if (s->progress && n > 1) {
            double dt = k3_now_ms() - t0, all = k3_now_ms() - t_start;
            K3_INFO("prefill: chunk %d/%d, %d/%d tokens, %.1f ms (%.1f tok/s)", c + 1, n_chunks,
                    done, n, dt, all > 0 ? done * 1000.0 / all : 0.0);
        }
    }
    return K3_OK;
}

k3_status k3_session_append(k3_session *s, const int32_t *ids, int n, const k3_feed_hooks *hooks,
                            const float **logits, char *err, size_t errlen) {
    if (logits) *logits = NULL;
    if (n < 1) return k3_errf(K3_ERR_ARG, err, errlen, "append: %d tokens, need at least 1", n);
    k3_status st = sess_prefill(s, ids, n, hooks, NULL, err, errlen);
    if (!st && logits) *logits = s->logits_valid ? s->logits : NULL;
    return st;
}

k3_status k3_session_feed(k3_session *s, const int32_t *ids, int n, const k3_feed_hooks *hooks,
                          const float **logits, int *n_fed, char *err, size_t errlen) {
    if (logits) *logits = NULL;
    if (n_fed) *n_fed = 0;
    if (n < 1) return k3_errf(K3_ERR_ARG, err, errlen, "prompt: %d tokens, need at least 1", n);
    if (n > s->max_ctx)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "prompt of %d tokens is longer than the context of %d tokens (K3_MAXT)", n,
                       s->max_ctx);
    /* every id is checked before the reset decision: a bad prompt leaves the
     * session as it was */
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= s->vocab)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "token id %d at position %d: outside 0..%d (vocab %d)", (int)ids[i], i,
                           s->vocab - 1, s->vocab);
    /* prefix reuse: keep the state when ids starts with every committed id.
     * The state cannot rewind, so a shorter or diverging prompt resets. */
    int keep = s->n_ids <= n && !memcmp(s->ids, ids, (size_t)s->n_ids * sizeof(int32_t));
    if (!keep && s->n_ckpt > 0) { /* the deepest checkpoint within the common prefix */
        int lcp = 0, lim = s->n_ids < n ? s->n_ids : n;
        while (lcp < lim && s->ids[lcp] == ids[lcp]) lcp++;
        int c = s->n_ckpt - 1;
        while (c >= 0 && (s->ckpt_pos[c] > lcp || s->ckpt_pos[c] >= n)) c--;
        if (c >= 0) {
            char rerr[256];
            if (s->trunk->ops->ckpt_restore(s->trunk, s->state, s->ckpt[c], rerr, sizeof rerr) ==
                K3_OK) {
                s->n_ids = s->ckpt_pos[c];
                s->logits_valid = 0;
                ckpt_drop_after(s, s->n_ids); /* rows past it will be overwritten */
                keep = 1;
            } else {
                K3_WARN("session: checkpoint at %d not restored (%s): replaying", s->ckpt_pos[c],
                        rerr);
            }
        }
    }
    if (s->store) { /* a parked checkpoint deeper than what is kept (a restart) */
        char path[K3_MAX_PATH + 40], rerr[512];
        int base = keep ? s->n_ids : 0, p = 0;
        if (k3_ckpt_dir_find(s->store, ids, n, base, s->max_ctx, path, sizeof path, &p)) {
            k3_session_reset(s);
            keep = 0;
            if (k3_ckpt_dir_load(s->store, path, p, ids, s->trunk, s->state, rerr, sizeof rerr)) {
                K3_WARN("session: parked checkpoint not loaded (%s): replaying", rerr);
            } else {
                memcpy(s->ids, ids, sizeof(int32_t) * (size_t)p);
                s->n_ids = p;
                keep = 1;
                K3_INFO("session: checkpoint at %d loaded from %s", p, path);
            }
        }
    }
    if (!keep) k3_session_reset(s);
    s->n_reused = s->n_ids;
    int tail = n - s->n_ids;
    if (tail == 0 && s->has_head && !s->logits_valid) {
        /* committed but no logits kept (cannot happen today): recompute */
        k3_session_reset(s);
        tail = n;
    }
    if (tail > 0) {
        int done = 0;
        k3_status st = sess_prefill(s, ids + s->n_ids, tail, hooks, &done, err, errlen);
        if (n_fed) *n_fed = done;
        if (st) return st;
    }
    if (n_fed) *n_fed = tail;
    if (logits) *logits = s->logits_valid ? s->logits : NULL;
    return K3_OK;
}

k3_status k3_session_checkpoint(k3_session *s, char *err, size_t errlen) {
    if (s->max_ckpt == 0 || s->n_ids == 0) return K3_OK;
    if (s->n_ckpt > 0 && s->ckpt_pos[s->n_ckpt - 1] == s->n_ids) return K3_OK; /* have it */
    void *ck = NULL;
    uint64_t key = s->store ? k3_ckpt_dir_key(s->store, s->ids, s->n_ids) : 0;
    k3_status st = s->trunk->ops->ckpt_save(s->trunk, s->state, s->max_ckpt, key, &ck, err, errlen);
    if (st) return st;
    if (s->n_ckpt == s->max_ckpt) { /* drop the oldest */
        s->trunk->ops->ckpt_free(s->trunk, &s->ckpt[0]);
        memmove(s->ckpt, s->ckpt + 1, (size_t)(s->n_ckpt - 1) * sizeof s->ckpt[0]);
        memmove(s->ckpt_pos, s->ckpt_pos + 1, (size_t)(s->n_ckpt - 1) * sizeof s->ckpt_pos[0]);
        s->n_ckpt--;
    }
    s->ckpt[s->n_ckpt] = ck;
    s->ckpt_pos[s->n_ckpt++] = s->n_ids;
    if (s->store) { /* parked too: a failure costs only the restart's saving */
        char derr[512];
        if (k3_ckpt_dir_save(s->store, s->trunk, s->state, s->ids, s->n_ids, derr, sizeof derr))
            K3_WARN("session: checkpoint at %d not parked on disk: %s", s->n_ids, derr);
    }
    return K3_OK;
}

int k3_session_reusable(const k3_session *s, const int32_t *ids, int n) {
    if (s->n_ids <= n && !memcmp(s->ids, ids, (size_t)s->n_ids * sizeof(int32_t))) return s->n_ids;
    int lcp = 0, lim = s->n_ids < n ? s->n_ids : n;
    while (lcp < lim && s->ids[lcp] == ids[lcp]) lcp++;
    for (int c = s->n_ckpt - 1; c >= 0; c--)
        if (s->ckpt_pos[c] <= lcp && s->ckpt_pos[c] < n) return s->ckpt_pos[c];
    return 0;
}

int k3_session_n_ckpt(const k3_session *s, size_t *bytes) {
    if (bytes) {
        *bytes = 0;
        for (int i = 0; i < s->n_ckpt && s->trunk->ops->ckpt_bytes; i++)
            *bytes += s->trunk->ops->ckpt_bytes(s->trunk, s->ckpt[i]);
    }
    return s->n_ckpt;
}

/* ---- generation ---------------------------------------------------------- */

static int is_eos(const k3_gen_opts *o, int32_t id) {
    for (int i = 0; i < o->n_eos; i++)
        if (o->eos[i] == id) return 1;
    return 0;
}

k3_status k3_generate(k3_session *s, const int32_t *prompt, int n, const k3_gen_opts *o,
                      k3_gen_result *r, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    r->n_prompt = n;
    if (o->ngen < 0 || o->ngen > K3_MAX_NGEN)
        return k3_errf(K3_ERR_ARG, err, errlen, "ngen %d: outside 0..%d (K3_MAX_NGEN)", o->ngen,
                       K3_MAX_NGEN);
    if (o->ngen > 0 && !s->has_head)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "the layer stack is truncated (K3_LAYERS): no head, cannot generate "
                       "(use --ngen 0 with --trace)");
    if (o->ngen > 0 && !o->sampler) return k3_errf(K3_ERR_ARG, err, errlen, "generate: no sampler");
    k3_step_stats before = s->stats;
    k3_feed_hooks hooks = o->prompt_hooks;
    if (!hooks.cancel) hooks.cancel = o->cancel;

    const float *logits = NULL;
    double t0 = k3_now_ms();
    s->n_reused = 0;
    k3_status st = k3_session_feed(s, prompt, n, &hooks, &logits, &r->n_prefilled, err, errlen);
    r->prefill_ms = k3_now_ms() - t0;
    r->n_reused = s->n_reused; /* the prefix or checkpoint the feed kept */
    if (!st && s->max_ckpt > 0) {
        char cerr[256];
        if (k3_session_checkpoint(s, cerr, sizeof cerr))
            K3_WARN("session: no checkpoint at the turn boundary %d: %s", s->n_ids, cerr);
    }
    if (st) return st;

    double t1 = k3_now_ms();
    while (r->n_gen < o->ngen) {
        int32_t id = 0;
        if (cancelled(o->cancel)) {
            st = cancel_err(s, err, errlen);
            break;
        }
        if ((st = k3_sampler_sample(o->sampler, logits, &id, err, errlen))) {
            k3_err_prefix(err, errlen, "position %d", s->n_ids - 1);
            break;
        }
        r->n_gen++;
        if (o->on_token) o->on_token(o->token_ctx, id);
        if (is_eos(o, id)) {
            r->stop = K3_STOP_EOS;
            break;
        }
        if (r->n_gen == o->ngen) {
            r->stop = K3_STOP_NGEN;
            break;
        }
        if (s->n_ids >= s->max_ctx) {
            r->stop = K3_STOP_CTX;
            break;
        }
        if (cancelled(o->cancel)) {
            st = cancel_err(s, err, errlen);
            break;
        }
        if ((st = k3_session_append(s, &id, 1, NULL, &logits, err, errlen))) break;
        r->n_decode_steps++;
    }
    r->decode_ms = k3_now_ms() - t1;
    r->stats = s->stats;
    r->stats.compute_ms -= before.compute_ms;
    r->stats.read_ms -= before.read_ms;
    r->stats.bytes_read -= before.bytes_read;
    r->stats.expert_hits -= before.expert_hits;
    r->stats.expert_misses -= before.expert_misses;
    return st;
}
