/* worker/sessions.c: session states with LRU eviction (sessions.h).
 *
 * A linear table: max_sessions is at most K3_MAX_SESSIONS (4096) and a
 * lookup is a few thousand compares at worst, nothing next to a forward
 * step. Freed slots keep no memory: a state is closed when dropped or
 * evicted, so a worker's RAM follows the sessions it holds.
 */
#include "worker/sessions.h"

#include <stdlib.h>

#include "common/base/limits.h"

typedef struct wk_slot {
    uint64_t id;       /* session id, 0 = free */
    uint64_t last_use; /* tick of the last acquire (LRU order) */
    k3_state *state;   /* owned */
} wk_slot;

struct wk_sessions {
    const k3_model *m; /* borrowed */
    int max_sessions, max_ctx;
    wk_slot *slot; /* [max_sessions] */
    uint64_t tick;
    uint64_t evictions;
};

k3_status wk_sessions_open(wk_sessions **out, const k3_model *m, int max_sessions, int max_ctx,
                           char *err, size_t errlen) {
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
    t->slot = k3_xcalloc((size_t)max_sessions, sizeof *t->slot);
    *out = t;
    return K3_OK;
}

static void slot_free(wk_slot *s) {
    k3_state_close(&s->state);
    s->id = 0;
    s->last_use = 0;
}

void wk_sessions_close(wk_sessions **tp) {
    if (!tp || !*tp) return;
    wk_sessions *t = *tp;
    for (int i = 0; i < t->max_sessions; i++) slot_free(&t->slot[i]);
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
        slot_free(victim);
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
    k3_state_reset(s->state);
    return 1;
}

int wk_sessions_drop(wk_sessions *t, uint64_t id) {
    wk_slot *s = id ? find(t, id) : NULL;
    if (!s) return 0;
    slot_free(s);
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
    if (n == 0)
        k3_state_reset(s->state);
    else if (n != pos)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "cannot truncate session %llu from %d to %d tokens: no checkpoint "
                       "(reset and replay)",
                       (unsigned long long)id, pos, n);
    return K3_OK;
}

void wk_sessions_clear(wk_sessions *t) {
    for (int i = 0; i < t->max_sessions; i++) slot_free(&t->slot[i]);
}

int wk_sessions_count(const wk_sessions *t) {
    int n = 0;
    for (int i = 0; i < t->max_sessions; i++) n += t->slot[i].id != 0;
    return n;
}

uint64_t wk_sessions_evictions(const wk_sessions *t) { return t->evictions; }
