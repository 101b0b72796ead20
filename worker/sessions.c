/* worker/sessions.c: session states with LRU eviction (sessions.h).
 *
 * A linear table: max_sessions is at most K3_MAX_SESSIONS (4096) and a
 * lookup is a few thousand compares at worst, nothing next to a forward
 * step. Freed slots keep no memory: a state is closed when dropped or
 * evicted, so a worker's RAM follows the sessions it holds.
 */
#include "worker/sessions.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/ckpt_store.h"

typedef struct wk_slot {
    uint64_t id;                    /* session id, 0 = free */
    uint64_t last_use;              /* tick of the last acquire (LRU order) */
    k3_state *state;                /* owned */
    k3_state_ckpt *ck[K3_MAX_CKPT]; /* [n_ck] turn checkpoints, oldest first, owned */
    int n_ck;
} wk_slot;

struct wk_sessions {
    const k3_model *m; /* borrowed */
    int max_sessions, max_ctx;
    wk_slot *slot; /* [max_sessions] */
    uint64_t tick;
    uint64_t evictions;
    uint64_t ckpt_budget; /* bytes every checkpoint together may hold */
    uint64_t ckpt_bytes;  /* held now */
    k3_ckpt_store *store; /* --ckpt-dir, borrowed, NULL = none */
};

k3_status wk_sessions_open(wk_sessions **out, const k3_model *m, int max_sessions, int max_ctx,
                           uint64_t ckpt_budget, char *err, size_t errlen) {
    *out = NULL;
    if (max_sessions < 1 || max_sessions > K3_MAX_SESSIONS)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "sessions: %d outside [1, %d] (K3_MAX_SESSIONS)",
                       max_sessions, K3_MAX_SESSIONS);
    if (max_ctx < 1 || max_ctx > K3_MAX_CTX)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "sessions: context %d outside [1, %d] (K3_MAX_CTX)", max_ctx, K3_MAX_CTX);
    wk_sessions *t = k3_xcalloc(1, sizeof *t);
    t->m = m;
    t->max_sessions = max_sessions;
    t->max_ctx = max_ctx;
    t->ckpt_budget = ckpt_budget;
    t->slot = k3_xcalloc((size_t)max_sessions, sizeof *t->slot);
    *out = t;
    return K3_OK;
}

/* Drops the slot's checkpoints past position keep_pos (-1: all of them). */
static void ck_drop_after(wk_sessions *t, wk_slot *s, int keep_pos) {
    while (s->n_ck > 0 && k3_state_ckpt_pos(s->ck[s->n_ck - 1]) > keep_pos) {
        k3_state_ckpt **c = &s->ck[--s->n_ck];
        t->ckpt_bytes -= k3_state_ckpt_bytes(*c);
        k3_state_ckpt_free(c);
    }
}

/* Drops the slot's oldest checkpoint. */
static void ck_drop_oldest(wk_sessions *t, wk_slot *s) {
    t->ckpt_bytes -= k3_state_ckpt_bytes(s->ck[0]);
    k3_state_ckpt_free(&s->ck[0]);
    memmove(s->ck, s->ck + 1, (size_t)(s->n_ck - 1) * sizeof s->ck[0]);
    s->ck[--s->n_ck] = NULL;
}

static void slot_free(wk_sessions *t, wk_slot *s) {
    ck_drop_after(t, s, -1);
    k3_state_close(&s->state);
    s->id = 0;
    s->last_use = 0;
}

void wk_sessions_close(wk_sessions **tp) {
    if (!tp || !*tp) return;
    wk_sessions *t = *tp;
    for (int i = 0; i < t->max_sessions; i++) slot_free(t, &t->slot[i]);
    free(t->slot);
    free(t);
    *tp = NULL;
}

static wk_slot *find(wk_sessions *t, uint64_t id) {
    for (int i = 0; i < t->max_sessions; i++)
        if (t->slot[i].id == id) return &t->slot[i];
    return NULL;
}

k3_status wk_sessions_acquire(wk_sessions *t, uint64_t id, int pos0, k3_state **out,
                              uint64_t *evicted, char *err, size_t errlen) {
    *out = NULL;
    *evicted = 0;
    if (id == 0) return k3_errf(K3_ERR_ARG, err, errlen, "session id 0 is reserved");
    wk_slot *s = find(t, id);
    if (s) {
        int pos = k3_state_pos(s->state);
        if (pos != pos0)
            return k3_errf(K3_ERR_STATE, err, errlen,
                           "session %llu is at position %d, the step starts at %d",
                           (unsigned long long)id, pos, pos0);
        s->last_use = ++t->tick;
        *out = s->state;
        return K3_OK;
    }
    if (pos0 != 0)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "session %llu unknown here (evicted, dropped or from an older epoch) and "
                       "the step starts at %d, not 0: reset and replay",
                       (unsigned long long)id, pos0);
    /* a free slot, else the least recently used one */
    wk_slot *victim = NULL;
    for (int i = 0; i < t->max_sessions; i++) {
        wk_slot *c = &t->slot[i];
        if (c->id == 0) {
            victim = c;
            break;
        }
        if (!victim || c->last_use < victim->last_use) victim = c;
    }
    if (victim->id) {
        *evicted = victim->id;
        t->evictions++;
        slot_free(t, victim);
    }
    k3_status st = k3_state_open(&victim->state, t->m, t->max_ctx, err, errlen);
    if (st) return st;
    victim->id = id;
    victim->last_use = ++t->tick;
    *out = victim->state;
    return K3_OK;
}

int wk_sessions_reset(wk_sessions *t, uint64_t id) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (!s) return 0;
    ck_drop_after(t, s, -1); /* the MLA rows they rely on will be overwritten */
    k3_state_reset(s->state);
    return 1;
}

int wk_sessions_drop(wk_sessions *t, uint64_t id) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (!s) return 0;
    slot_free(t, s);
    return 1;
}

k3_status wk_sessions_truncate(wk_sessions *t, uint64_t id, int n, char *err, size_t errlen) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (!s) {
        if (n == 0) return K3_OK;
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot truncate session %llu to %d tokens: unknown here",
                       (unsigned long long)id, n);
    }
    int pos = k3_state_pos(s->state);
    if (n == 0) {
        ck_drop_after(t, s, -1);
        k3_state_reset(s->state);
    } else if (n != pos)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot truncate session %llu from %d to %d tokens: no checkpoint "
                       "(reset and replay)",
                       (unsigned long long)id, pos, n);
    return K3_OK;
}

void wk_sessions_clear(wk_sessions *t) {
    for (int i = 0; i < t->max_sessions; i++) slot_free(t, &t->slot[i]);
}

int wk_sessions_count(const wk_sessions *t) {
    int n = 0;
    for (int i = 0; i < t->max_sessions; i++) n += t->slot[i].id != 0;
    return n;
}

uint64_t wk_sessions_evictions(const wk_sessions *t) { return t->evictions; }

/* ---- turn checkpoints ---- */

static const char *unknown_why = "unknown here (evicted, dropped or from an older epoch)";

void wk_sessions_set_store(wk_sessions *t, k3_ckpt_store *store) { t->store = store; }

static k3_status dump_cb(void *ctx, FILE *f, char *err, size_t errlen) {
    return k3_state_dump(ctx, f, err, errlen);
}

static k3_status load_cb(void *ctx, FILE *f, int pos, char *err, size_t errlen) {
    return k3_state_load(ctx, f, pos, err, errlen);
}

/* Parks s's state at pos under key; a failure is logged. */
static void park(wk_sessions *t, wk_slot *s, int pos, uint64_t key) {
    char err[512];
    double t0 = k3_now_ms();
    uint64_t bytes = k3_state_dump_bytes(s->state, pos);
    if (k3_ckpt_store_save(t->store, key, pos, NULL, bytes, dump_cb, s->state, err, sizeof err))
        K3_WARN("checkpoint of session %llu at %d not parked on disk: %s",
                (unsigned long long)s->id, pos, err);
    else
        K3_INFO("checkpoint of session %llu at %d parked: %llu bytes in %.1f ms",
                (unsigned long long)s->id, pos, (unsigned long long)bytes, k3_now_ms() - t0);
}

k3_status wk_sessions_checkpoint(wk_sessions *t, uint64_t id, int pos, int keep, uint64_t key,
                                 char *err, size_t errlen) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (!s)
        return k3_errf(K3_ERR_STATE, err, errlen, "no checkpoint of session %llu at %d: %s",
                       (unsigned long long)id, pos, unknown_why);
    int at = k3_state_pos(s->state);
    if (pos != at)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "no checkpoint of session %llu at %d: the session is at position %d",
                       (unsigned long long)id, pos, at);
    if (keep < 1 || keep > K3_MAX_CKPT)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "checkpoint of session %llu: keep %d outside [1, %d] (K3_MAX_CKPT)",
                       (unsigned long long)id, keep, K3_MAX_CKPT);
    if (key && t->store) park(t, s, pos, key);
    if (s->n_ck > 0 && k3_state_ckpt_pos(s->ck[s->n_ck - 1]) == pos) return K3_OK; /* have it */
    k3_state_ckpt *ck = NULL;
    k3_status st = k3_state_save(s->state, &ck, err, errlen);
    if (st) return st;
    size_t bytes = k3_state_ckpt_bytes(ck);
    while (s->n_ck >= keep) ck_drop_oldest(t, s); /* the coordinator dropped them too */
    if (t->ckpt_bytes + bytes > t->ckpt_budget) {
        k3_state_ckpt_free(&ck);
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "no checkpoint of session %llu at %d: %zu bytes more would pass the "
                       "checkpoint budget of %llu bytes (%llu held; --ckpt-mb)",
                       (unsigned long long)id, pos, bytes, (unsigned long long)t->ckpt_budget,
                       (unsigned long long)t->ckpt_bytes);
    }
    s->ck[s->n_ck++] = ck;
    t->ckpt_bytes += bytes;
    return K3_OK;
}

/* RESTORE from the file parked under key: s (NULL = create the session). */
static k3_status restore_parked(wk_sessions *t, wk_slot *s, uint64_t id, int pos, uint64_t key,
                                char *err, size_t errlen) {
    char path[K3_MAX_PATH + 40];
    k3_ckpt_store_path(t->store, key, pos, path, sizeof path);
    if (access(path, R_OK) != 0) /* before any state is touched */
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot restore session %llu to %d: no checkpoint in memory nor on disk "
                       "(%s: %s); reset and replay",
                       (unsigned long long)id, pos, path, strerror(errno));
    k3_state *state = NULL;
    if (s) {
        ck_drop_after(t, s, -1); /* its MLA rows are replaced */
        k3_state_reset(s->state);
        s->last_use = ++t->tick;
        state = s->state;
    } else {
        uint64_t evicted = 0;
        k3_status st = wk_sessions_acquire(t, id, 0, &state, &evicted, err, errlen);
        if (st) return st;
        if (evicted)
            K3_INFO("session %llu evicted to load session %llu from disk",
                    (unsigned long long)evicted, (unsigned long long)id);
    }
    double t0 = k3_now_ms();
    k3_status st = k3_ckpt_store_load(t->store, path, key, pos, NULL,
                                      k3_state_dump_bytes(state, pos), load_cb, state, err, errlen);
    if (st) {
        k3_state_reset(state);
        K3_WARN("session %llu: parked checkpoint at %d refused: %s", (unsigned long long)id, pos,
                err);
        return st;
    }
    K3_INFO("session %llu: checkpoint at %d loaded from %s in %.1f ms", (unsigned long long)id, pos,
            path, k3_now_ms() - t0);
    return K3_OK;
}

k3_status wk_sessions_restore(wk_sessions *t, uint64_t id, int pos, uint64_t key, char *err,
                              size_t errlen) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (key && t->store && id) {
        int c = s ? s->n_ck - 1 : -1;
        while (c >= 0 && k3_state_ckpt_pos(s->ck[c]) != pos) c--;
        if (c < 0) return restore_parked(t, s, id, pos, key, err, errlen);
    }
    if (!s)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot restore session %llu to %d: %s; reset and replay",
                       (unsigned long long)id, pos, unknown_why);
    int c = s->n_ck - 1;
    while (c >= 0 && k3_state_ckpt_pos(s->ck[c]) != pos) c--;
    if (c < 0)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot restore session %llu to %d: no checkpoint there (%d held, the "
                       "deepest at %d); reset and replay",
                       (unsigned long long)id, pos, s->n_ck,
                       s->n_ck ? k3_state_ckpt_pos(s->ck[s->n_ck - 1]) : 0);
    k3_status st = k3_state_restore(s->state, s->ck[c], err, errlen);
    if (st) return st;
    ck_drop_after(t, s, pos); /* rows past pos will be overwritten */
    return K3_OK;
}

uint64_t wk_sessions_ckpt_bytes(const wk_sessions *t, int *count) {
    if (count) {
        *count = 0;
        for (int i = 0; i < t->max_sessions; i++) *count += t->slot[i].n_ck;
    }
    return t->ckpt_bytes;
}
