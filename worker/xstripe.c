/* worker/xstripe.c: cross-worker expert striping (worker/xstripe.h). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/arena.h"
#include "common/base/log.h"
#include "common/base/pool.h"
#include "common/experts/placement.h"
#include "common/layers/layers.h"
#include "common/layers/moe_remote.h"
#include "proto/proto.h"
#include "worker/worker.h"
#include "worker/xstripe.h"

/* ---- options ---- */

k3_status wk_xstripe_parse_drives(const char *s, uint32_t *mask, char *err, size_t errlen) {
    *mask = 0;
    if (!strcmp(s, "none")) return K3_OK;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long d = strtol(p, &end, 10);
        if (end == p || errno || d < 0 || d >= K3_MAX_DIRS || (*end && *end != ','))
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "--stripe-drives '%s': expected drive numbers 0..%d separated by "
                           "commas, or none",
                           s, K3_MAX_DIRS - 1);
        if (*mask >> d & 1u)
            return k3_errf(K3_ERR_ARG, err, errlen, "--stripe-drives '%s': drive %ld given twice",
                           s, d);
        *mask |= 1u << d;
        p = *end ? end + 1 : end;
    }
    return K3_OK;
}

k3_status wk_xstripe_parse_peers(const char *s, wk_xstripe_opts *o, char *err, size_t errlen) {
    char *copy = k3_xstrdup(s), *save = NULL;
    k3_status st = K3_OK;
    for (char *tok = strtok_r(copy, ",", &save); tok && !st; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '='), *end;
        long d = eq ? strtol(tok, &end, 10) : -1;
        if (!eq || end != eq || d < 0 || d >= K3_MAX_DIRS || !eq[1]) {
            st = k3_errf(K3_ERR_ARG, err, errlen,
                         "--stripe-peers: '%s': expected DRIVE=ENDPOINT with a drive 0..%d", tok,
                         K3_MAX_DIRS - 1);
        } else if (o->own >> d & 1u) {
            st = k3_errf(K3_ERR_ARG, err, errlen,
                         "stripe of drive %ld claimed twice: by this worker (--stripe-drives) and "
                         "by peer %s (--stripe-peers)",
                         d, eq + 1);
        } else if (o->peer[d]) {
            st = k3_errf(K3_ERR_ARG, err, errlen,
                         "stripe of drive %ld claimed twice: by peer %s and by peer %s "
                         "(--stripe-peers)",
                         d, o->peer[d], eq + 1);
        } else {
            char why[256];
            if (k3_link_endpoint_kind(eq + 1, why, sizeof why) == K3_EP_INVALID)
                st = k3_errf(K3_ERR_ARG, err, errlen, "--stripe-peers: drive %ld: %s", d, why);
            else
                o->peer[d] = k3_xstrdup(eq + 1);
        }
    }
    free(copy);
    return st;
}

k3_status wk_xstripe_check(const wk_xstripe_opts *o, int n_drives, const char *placement, char *err,
                           size_t errlen) {
    for (int d = 0; d < K3_MAX_DIRS; d++) {
        int own = (int)(o->own >> d & 1u), peer = o->peer[d] != NULL;
        if (d < n_drives && !own && !peer)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "placement %s: drive %d has no worker: give it in --stripe-drives "
                           "or --stripe-peers",
                           placement, d);
        if (d >= n_drives && (own || peer))
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "placement %s has %d drives: drive %d (%s) does not exist", placement,
                           n_drives, d, own ? "--stripe-drives" : "--stripe-peers");
    }
    if (o->own && !o->listen)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--stripe-drives serves drives to the other stages: give --expert-listen");
    if (o->curve && o->listen && !o->allow)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "with CURVE the expert endpoint needs --stripe-allow FILE (the public keys "
                       "of the workers that call it)");
    for (int d = 0; d < K3_MAX_DIRS && o->curve; d++) {
        if (!o->peer[d]) continue;
        char key[K3_Z85_KEY_LEN + 1] = "";
        if (!o->keys_path)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "with CURVE the stripe peers need --stripe-keys FILE (their public "
                           "keys: \"ENDPOINT KEY\" lines)");
        k3_status st = k3_link_worker_key(o->keys_path, o->peer[d], key, err, errlen);
        if (st) return st;
        if (!key[0])
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "--stripe-keys %s: no key for the peer of drive %d (%s)", o->keys_path,
                           d, o->peer[d]);
    }
    return K3_OK;
}

void wk_xstripe_opts_free(wk_xstripe_opts *o) {
    for (int d = 0; d < K3_MAX_DIRS; d++) free(o->peer[d]), o->peer[d] = NULL;
}

/* ---- state ---- */

typedef struct xs_peer {
    void *sock;    /* DEALER, NULL until the first call (and after a timeout) */
    int pending;   /* a call is out */
    proto_msg req; /* the call, for reply matching */
    int *pair;     /* [R] index of each answered row in the caller's y */
    int n_pair;
    double sent_ms; /* the call's send, or its last progress HEARTBEAT */
    double call_ms; /* the call's send */
} xs_peer;

struct wk_xstripe {
    k3_model *m;
    const k3_config *cfg;
    wk_xstripe_opts o;
    void *ctx;
    k3_moe_remote remote;
    /* caller side: the stage thread */
    xs_peer peer[K3_MAX_DIRS];
    uint64_t next_id;
    atomic_uint_fast64_t epoch;
    void (*tick)(void *);
    void *tick_ctx;
    atomic_int *cancel;
    int cur_layer;
    /* server side */
    pthread_t th;
    int th_started;
    atomic_int stop;
    void *srv;   /* ROUTER, owned by the server thread after open */
    k3_zap *zap; /* CURVE: the expert endpoint's allow-list (its own context) */
    k3_pool *pool;
    /* counters */
    pthread_mutex_t mu;
    wk_xstripe_stats st;
};

/* ---- caller side (k3_moe_remote, the stage thread) ---- */

static int xs_is_remote(void *ctx, int layer, int32_t e) {
    wk_xstripe *x = ctx;
    int d = k3_experts_drive_of(k3_model_experts(x->m), layer, e);
    return !(x->o.own >> d & 1u);
}

static void xs_drop_socket(xs_peer *p) {
    if (p->sock) zmq_close(p->sock);
    p->sock = NULL;
    p->pending = 0;
    free(p->pair);
    p->pair = NULL;
}

static k3_status xs_connect(wk_xstripe *x, int d, char *err, size_t errlen) {
    xs_peer *p = &x->peer[d];
    if (p->sock) return K3_OK;
    p->sock = zmq_socket(x->ctx, ZMQ_DEALER);
    if (!p->sock)
        return k3_errf(K3_ERR_IO, err, errlen, "zmq_socket(DEALER): %s", zmq_strerror(zmq_errno()));
    k3_status st = k3_link_sockopts_apply(p->sock, &x->o.sock, err, errlen);
    if (!st && x->o.curve) { /* checked at start: the file names a key for it */
        char key[K3_Z85_KEY_LEN + 1] = "";
        st = k3_link_worker_key(x->o.keys_path, x->o.peer[d], key, err, errlen);
        if (!st) st = k3_link_curve_client(p->sock, x->o.kp, key, err, errlen);
    }
    if (!st && zmq_connect(p->sock, x->o.peer[d]) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "stripe peer of drive %d: connect %s: %s", d,
                     x->o.peer[d], zmq_strerror(zmq_errno()));
    if (st) xs_drop_socket(p);
    return st;
}

static k3_status xs_start(void *ctx, int layer, const float *z, int T, int LT, const int32_t *ids,
                          int n, const int *off, const int *rows, char *err, size_t errlen) {
    wk_xstripe *x = ctx;
    k3_experts *es = k3_model_experts(x->m);
    x->cur_layer = layer;
    int *map = k3_xmalloc(sizeof(int) * (size_t)T); /* row of z -> row of the call */
    k3_status st = K3_OK;
    for (int d = 0; d < K3_MAX_DIRS && !st; d++) {
        int ne = 0, R = 0, P = 0;
        for (int i = 0; i < n; i++)
            if (k3_experts_drive_of(es, layer, ids[i]) == d) ne++, R += off[i + 1] - off[i];
        if (!ne) continue;
        if (!x->o.peer[d]) {
            st = k3_errf(K3_ERR_INTERNAL, err, errlen,
                         "layer %d: drive %d's experts are neither read here nor have a peer",
                         layer, d);
            break;
        }
        for (int t = 0; t < T; t++) map[t] = -1;
        for (int i = 0; i < n; i++)
            if (k3_experts_drive_of(es, layer, ids[i]) == d)
                for (int j = off[i]; j < off[i + 1]; j++) map[rows[j]] = 0;
        for (int t = 0; t < T; t++)
            if (map[t] == 0) map[t] = P++;
        float *zc = k3_xmalloc(sizeof(float) * (size_t)P * (size_t)LT); /* [P][LT] */
        int32_t *cid = k3_xmalloc(sizeof(int32_t) * (size_t)ne);
        int32_t *cnt = k3_xmalloc(sizeof(int32_t) * (size_t)ne);
        int32_t *crow = k3_xmalloc(sizeof(int32_t) * (size_t)R);
        xs_peer *p = &x->peer[d];
        free(p->pair);
        p->pair = k3_xmalloc(sizeof(int) * (size_t)R);
        for (int t = 0; t < T; t++)
            if (map[t] >= 0)
                memcpy(zc + (size_t)map[t] * LT, z + (size_t)t * LT, sizeof(float) * (size_t)LT);
        int k = 0, r = 0;
        for (int i = 0; i < n; i++) {
            if (k3_experts_drive_of(es, layer, ids[i]) != d) continue;
            cid[k] = ids[i];
            cnt[k++] = off[i + 1] - off[i];
            for (int j = off[i]; j < off[i + 1]; j++) p->pair[r] = j, crow[r++] = map[rows[j]];
        }
        p->n_pair = R;
        proto_msg_init(&p->req, PROTO_MSG_EXPERT_CALL, ++x->next_id, atomic_load(&x->epoch));
        proto_expert_call *c = &p->req.u.expert_call;
        c->layer = (uint32_t)layer;
        c->drive = (uint32_t)d;
        c->n_rows = (uint32_t)P;
        c->latent = (uint32_t)LT;
        c->n_experts = (uint32_t)ne;
        c->n_pairs = (uint32_t)R;
        const void *fr[4] = {zc, cid, cnt, crow};
        size_t fb[4] = {sizeof(float) * (size_t)P * (size_t)LT, sizeof(int32_t) * (size_t)ne,
                        sizeof(int32_t) * (size_t)ne, sizeof(int32_t) * (size_t)R};
        st = xs_connect(x, d, err, errlen);
        if (!st) st = proto_send(p->sock, NULL, &p->req, fr, fb, 4, ZMQ_DONTWAIT, err, errlen);
        if (st) {
            k3_err_prefix(err, errlen, "expert call to the stripe peer of drive %d (%s)", d,
                          x->o.peer[d]);
            xs_drop_socket(p);
        } else {
            p->pending = 1;
            p->sent_ms = p->call_ms = k3_now_ms();
            pthread_mutex_lock(&x->mu);
            x->st.calls++;
            x->st.pairs_remote += (uint64_t)R;
            pthread_mutex_unlock(&x->mu);
        }
        free(zc), free(cid), free(cnt), free(crow);
    }
    free(map);
    if (st)
        for (int d = 0; d < K3_MAX_DIRS; d++)
            if (x->peer[d].pending) x->peer[d].pending = 0; /* late answers are dropped by id */
    return st;
}

static void xs_abort(void *ctx) {
    wk_xstripe *x = ctx;
    for (int d = 0; d < K3_MAX_DIRS; d++) x->peer[d].pending = 0;
}

/* One message from peer d: the answer (copied into y), a stale one
 * (dropped), or an error. *done = 1 when the call is answered. */
static k3_status xs_take(wk_xstripe *x, int d, float *y, int *done, char *err, size_t errlen) {
    xs_peer *p = &x->peer[d];
    proto_msg rep;
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    *done = 0;
    k3_status st = proto_recv(p->sock, ZMQ_DONTWAIT, &rep, &fr, err, errlen);
    if (st == K3_ERR_TIMEOUT || st == K3_ERR_CANCEL) {
        proto_frames_close(&fr);
        return K3_OK; /* nothing there after all */
    }
    if (!st && rep.type == PROTO_MSG_HEARTBEAT) { /* the peer works on (or queued) a call */
        if (rep.u.heartbeat.busy_request == p->req.id) p->sent_ms = k3_now_ms();
        proto_frames_close(&fr);
        return K3_OK;
    }
    if (!st) {
        char why[512];
        k3_status rs = proto_check_reply(&p->req, &rep, why, sizeof why);
        if (rs == K3_ERR_STATE) { /* an answer to an abandoned call */
            proto_frames_close(&fr);
            return K3_OK;
        }
        if (rs) st = k3_errf(rs, err, errlen, "%s", why);
    }
    if (!st && rep.type == PROTO_MSG_ERROR)
        st = k3_errf(rep.u.error.code ? (k3_status)rep.u.error.code : K3_ERR_PROTO, err, errlen,
                     "%s", rep.u.error.msg);
    if (!st) {
        size_t nb = 0;
        const float *yr = proto_frames_data(&fr, 0, &nb);
        size_t LT = rep.u.expert_done.latent;
        for (int j = 0; j < p->n_pair; j++)
            memcpy(y + (size_t)p->pair[j] * LT, (const char *)yr + sizeof(float) * LT * (size_t)j,
                   sizeof(float) * LT);
        *done = 1;
        p->pending = 0;
        pthread_mutex_lock(&x->mu);
        x->st.call_rtt_ms += k3_now_ms() - p->call_ms;
        x->st.peer_compute_ms += rep.u.expert_done.compute_ms;
        x->st.peer_read_ms += rep.u.expert_done.read_ms;
        pthread_mutex_unlock(&x->mu);
    }
    proto_frames_close(&fr);
    if (st) {
        k3_err_prefix(err, errlen, "stripe peer of drive %d (%s), layer %d", d, x->o.peer[d],
                      p->req.u.expert_call.layer);
        xs_drop_socket(p);
    }
    return st;
}

static k3_status xs_finish(void *ctx, float *y, char *err, size_t errlen) {
    wk_xstripe *x = ctx;
    double t0 = k3_now_ms();
    /* a call unanswered for TTL = 3 x hb_ms fails: the peer is dead,
     * stopped or stuck, and the coordinator's replay takes over */
    int hb = x->o.sock.hb_ms > 0 ? x->o.sock.hb_ms : K3_LINK_HB_MS_DEFAULT;
    double ttl = (double)K3_LINK_LIVENESS * hb;
    k3_status st = K3_OK;
    for (;;) {
        zmq_pollitem_t it[K3_MAX_DIRS];
        int who[K3_MAX_DIRS], n = 0;
        for (int d = 0; d < K3_MAX_DIRS; d++)
            if (x->peer[d].pending)
                it[n] = (zmq_pollitem_t){x->peer[d].sock, 0, ZMQ_POLLIN, 0}, who[n++] = d;
        if (!n) break;
        if (x->cancel && atomic_load(x->cancel)) {
            xs_abort(x);
            st = k3_errf(K3_ERR_CANCEL, err, errlen, "layer %d: expert calls given up (cancel)",
                         x->cur_layer);
            break;
        }
        double now = k3_now_ms();
        for (int i = 0; i < n; i++) {
            xs_peer *p = &x->peer[who[i]];
            if (now - p->sent_ms > ttl) { /* sent_ms: the call, or its last progress */
                st = k3_errf(K3_ERR_TIMEOUT, err, errlen,
                             "stripe peer of drive %d (%s) gave no answer nor progress on layer "
                             "%d's expert call (%u experts) for %.0f ms (3 x heartbeat): dead, "
                             "stopped or stuck",
                             who[i], x->o.peer[who[i]], x->cur_layer,
                             p->req.u.expert_call.n_experts, ttl);
                xs_drop_socket(p);
                break;
            }
        }
        if (st) break;
        if (x->tick) x->tick(x->tick_ctx);
        int rc = zmq_poll(it, n, hb / 4 > 0 ? hb / 4 : 1);
        if (rc < 0 && zmq_errno() != EINTR) {
            st = k3_errf(K3_ERR_IO, err, errlen, "expert calls: poll: %s",
                         zmq_strerror(zmq_errno()));
            break;
        }
        for (int i = 0; rc > 0 && i < n && !st; i++) {
            if (!(it[i].revents & ZMQ_POLLIN)) continue;
            int done = 0;
            do st = xs_take(x, who[i], y, &done, err, errlen);
            while (!st && !done && x->peer[who[i]].pending &&
                   (zmq_poll(&it[i], 1, 0) > 0 && (it[i].revents & ZMQ_POLLIN)));
        }
        if (st) break;
    }
    if (st) xs_abort(x);
    double w = k3_now_ms() - t0;
    pthread_mutex_lock(&x->mu);
    x->st.layers_called++;
    x->st.gather_wait_ms += w;
    pthread_mutex_unlock(&x->mu);
    return st;
}

/* ---- server side (its own thread) ---- */

/* A received call waiting for the compute (the server reads every call
 * that arrives, so each caller hears that its call is queued). */
typedef struct xs_call {
    proto_msg m;
    proto_frames fr; /* its tensor frames and the caller's routing id, owned */
    double recv_ms;  /* when it was read off the endpoint */
    struct xs_call *next;
} xs_call;

/* Calls queued at once before more are answered ERROR(busy): every stage
 * has at most one call out per peer, so this is far above need. */
#define XS_MAX_QUEUE 256

typedef struct xs_srv {
    wk_xstripe *x;
    k3_layer_ctx lc;
    k3_arena ar;
    float *y; /* [cap_R][LT] */
    size_t cap_R;
    xs_call *head, *tail; /* FIFO of calls not yet computed */
    int n_queued;
    const xs_call *running; /* the call being computed */
    double last_hb_ms;      /* progress HEARTBEATs last sent */
} xs_srv;

static void xs_serve_progress(xs_srv *s);

static void xs_reply_error(xs_srv *s, const proto_peer *to, const proto_msg *req, k3_status code,
                           const char *msg) {
    proto_msg e;
    char err[256];
    proto_msg_init(&e, PROTO_MSG_ERROR, req->id, req->epoch);
    e.u.error.code = (uint32_t)(code ? code : K3_ERR_INTERNAL);
    size_t j = 0;
    for (const char *c = msg; *c && j + 1 < sizeof e.u.error.msg; c++)
        e.u.error.msg[j++] = (*c >= 0x20 && *c != 0x7f) ? *c : ' ';
    e.u.error.msg[j] = 0;
    if (proto_send(s->x->srv, to, &e, NULL, NULL, 0, ZMQ_DONTWAIT, err, sizeof err))
        K3_WARN("%s: expert server: cannot send ERROR: %s", s->x->o.name, err);
}

/* Checks a call against this worker's stripe and the model. */
static k3_status xs_check_call(xs_srv *s, const proto_msg *m, const proto_frames *fr, char *err,
                               size_t errlen) {
    wk_xstripe *x = s->x;
    const proto_expert_call *c = &m->u.expert_call;
    const k3_config *cfg = x->cfg;
    if (!(x->o.own >> c->drive & 1u))
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "%s does not serve the stripe of drive %u (a stripe claimed by two "
                       "workers, or a wrong --stripe-peers)",
                       x->o.name, c->drive);
    if ((int)c->layer >= cfg->n_layers || !cfg->is_moe[c->layer])
        return k3_errf(K3_ERR_ARG, err, errlen, "layer %u is not a MoE layer of the model",
                       c->layer);
    if ((int)c->latent != cfg->latent)
        return k3_errf(K3_ERR_MISMATCH, err, errlen, "field 'LT': %u, the model's latent is %d",
                       c->latent, cfg->latent);
    if ((uint64_t)c->n_pairs > (uint64_t)c->n_rows * (uint64_t)cfg->topk)
        return k3_errf(
            K3_ERR_LIMIT, err, errlen,
            "field 'R': %u pairs > P x topk = %u x %d (a row picks at most topk experts)",
            c->n_pairs, c->n_rows, cfg->topk);
    const int32_t *ids = proto_frames_data(fr, 1, NULL);
    const int32_t *cnt = proto_frames_data(fr, 2, NULL);
    const int32_t *rows = proto_frames_data(fr, 3, NULL);
    uint8_t seen[K3_MAX_EXPERTS] = {0}; /* an expert once per call (xs_compute's run order) */
    int64_t sum = 0;
    for (uint32_t i = 0; i < c->n_experts; i++) {
        int32_t e, k;
        memcpy(&e, ids + i, sizeof e); /* frames may be unaligned (PROTOCOL.md 1) */
        memcpy(&k, cnt + i, sizeof k);
        if (e < 0 || e >= cfg->n_experts)
            return k3_errf(K3_ERR_ARG, err, errlen, "layer %u: expert id %d outside [0, %d)",
                           c->layer, e, cfg->n_experts);
        if (seen[e]++)
            return k3_errf(K3_ERR_ARG, err, errlen, "layer %u: expert %d given twice in one call",
                           c->layer, e);
        if (k3_experts_drive_of(k3_model_experts(x->m), (int)c->layer, e) != (int)c->drive)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "layer %u expert %d is on drive %d of the placement, not drive %u",
                           c->layer, e,
                           k3_experts_drive_of(k3_model_experts(x->m), (int)c->layer, e), c->drive);
        if (k < 1 || k > (int32_t)c->n_rows)
            return k3_errf(K3_ERR_ARG, err, errlen, "layer %u expert %d: %d rows, expected 1..%u",
                           c->layer, e, k, c->n_rows);
        sum += k;
    }
    if (sum != (int64_t)c->n_pairs)
        return k3_errf(K3_ERR_PROTO, err, errlen, "row counts sum to %" PRId64 ", 'R' is %u", sum,
                       c->n_pairs);
    for (uint32_t j = 0; j < c->n_pairs; j++) {
        int32_t r;
        memcpy(&r, rows + j, sizeof r);
        if (r < 0 || (uint32_t)r >= c->n_rows)
            return k3_errf(K3_ERR_ARG, err, errlen, "row index %d outside [0, %u)", r, c->n_rows);
    }
    return K3_OK;
}

/* Applies the call's experts: the same k3_moe_expert_apply on the same
 * rows (in the same order) as the calling stage would, so the same bits.
 * Run order as in common/layers/moe.c: the experts cached here first, then
 * the misses in disk order, so the cached ones compute while the first
 * misses are read (the outputs land at each expert's place in the call,
 * whatever order they ran in). */
static k3_status xs_compute(xs_srv *s, const proto_msg *m, const proto_frames *fr,
                            k3_expert_stats *es, char *err, size_t errlen) {
    wk_xstripe *x = s->x;
    const proto_expert_call *c = &m->u.expert_call;
    const k3_config *cfg = x->cfg;
    size_t LT = c->latent, P = c->n_rows, I = (size_t)cfg->moe_inter, G = LT / 32;
    size_t need = 3 * k3_arena_round(sizeof(float) * P * LT) + k3_arena_round(P * LT) +
                  k3_arena_round(sizeof(float) * P * G) +
                  2 * k3_arena_round(sizeof(float) * P * I) + k3_arena_round(P * I) +
                  k3_arena_round(sizeof(float) * P * I / 32) + 4096;
    if (need > s->ar.cap) {
        void *b = NULL;
        if (posix_memalign(&b, 64, need) != 0)
            return k3_errf(K3_ERR_NOMEM, err, errlen, "expert server: %zu bytes of scratch", need);
        free(s->ar.base);
        s->ar.base = b;
        s->ar.cap = need;
    }
    if (c->n_pairs > s->cap_R) {
        float *y = malloc(sizeof(float) * c->n_pairs * LT);
        if (!y)
            return k3_errf(K3_ERR_NOMEM, err, errlen, "expert server: %u x %zu outputs", c->n_pairs,
                           LT);
        free(s->y);
        s->y = y;
        s->cap_R = c->n_pairs;
    }
    s->ar.used = 0;
    const char *z = proto_frames_data(fr, 0, NULL);
    const char *ids = proto_frames_data(fr, 1, NULL);
    const char *cnt = proto_frames_data(fr, 2, NULL);
    const char *rows = proto_frames_data(fr, 3, NULL);
    float *zg = K3_ARENA_F(&s->ar, P * LT);
    int8_t *zq = k3_arena_alloc(&s->ar, P * LT);
    float *zs = K3_ARENA_F(&s->ar, P * G);
    /* the call's experts (checked: distinct, in range): first pair of each
     * (j0 of [n_experts + 1]) and where each id sits in the call */
    uint32_t ne = c->n_experts;
    size_t *j0 = k3_xmalloc(sizeof(size_t) * (ne + 1));
    int32_t *slot_of = k3_xmalloc(sizeof(int32_t) * (size_t)cfg->n_experts); /* [E] */
    uint8_t *in_call = k3_xcalloc((size_t)cfg->n_experts, 1);                /* [E] */
    int32_t *run = k3_xmalloc(sizeof(int32_t) * (size_t)cfg->n_experts);     /* [ne] */
    int32_t *order = k3_xmalloc(sizeof(int32_t) * (size_t)cfg->n_experts);   /* [ne] */
    j0[0] = 0;
    for (uint32_t i = 0; i < ne; i++) {
        int32_t e, k;
        memcpy(&e, ids + sizeof(int32_t) * i, sizeof e);
        memcpy(&k, cnt + sizeof(int32_t) * i, sizeof k);
        slot_of[e] = (int32_t)i;
        in_call[e] = 1;
        j0[i + 1] = j0[i] + (size_t)k;
    }
    k3_experts *store = k3_model_experts(x->m);
    int n_order = k3_experts_disk_order(store, (int)c->layer, in_call, order);
    K3_ASSERT(n_order == (int)ne);
    /* the cache is looked at once per expert (in_call reused as the
     * snapshot): each expert lands in exactly one of the two passes */
    for (int i = 0; i < n_order; i++)
        in_call[order[i]] = k3_experts_cached(store, (int)c->layer, order[i]) != 0;
    int n_run = 0, n_hot = 0;
    for (int pass = 0; pass < 2; pass++) /* cached first, then the misses */
        for (int i = 0; i < n_order; i++)
            if (in_call[order[i]] == (pass == 0)) run[n_run++] = order[i], n_hot += pass == 0;
    /* several drives served here: the misses alternate between them */
    k3_experts_interleave(store, (int)c->layer, run + n_hot, n_run - n_hot);
    k3_expert_batch *b = NULL;
    k3_status st = k3_experts_batch_open(&b, store, (int)c->layer, run, (int)ne, es, err, errlen);
    for (uint32_t q = 0; q < ne && !st; q++) {
        int32_t i = slot_of[run[q]];
        int k = (int)(j0[i + 1] - j0[i]);
        for (int r = 0; r < k; r++) {
            int32_t row;
            memcpy(&row, rows + sizeof(int32_t) * (j0[i] + (size_t)r), sizeof row);
            memcpy(zg + (size_t)r * LT, z + sizeof(float) * (size_t)row * LT, sizeof(float) * LT);
        }
        /* int8 activations: per row and group of 32, so quantizing the
         * gathered rows gives the bytes the caller's whole-chunk pass gives */
        if (s->lc.idot) k3_act_quant_q8(zg, k, (int)LT, zq, zs);
        xs_serve_progress(s); /* queued calls and this one: still alive */
        k3_expert_view v;
        st = k3_experts_batch_get(b, (int)q, &v, err, errlen);
        if (st) break;
        size_t mark = s->ar.used;
        k3_moe_expert_apply(&s->lc, &v, zg, zq, zs, k, s->y + j0[i] * LT, &s->ar);
        s->ar.used = mark;
        k3_experts_batch_put(b, (int)q);
    }
    k3_experts_batch_close(&b);
    free(j0), free(slot_of), free(in_call), free(run), free(order);
    return st;
}

/* Reads every message waiting on the endpoint: calls join the queue, the
 * rest (and calls beyond XS_MAX_QUEUE) are answered ERROR at once. */
static void xs_drain(xs_srv *s) {
    wk_xstripe *x = s->x;
    for (;;) {
        xs_call *c = k3_xcalloc(1, sizeof *c);
        char err[1024];
        k3_status st = proto_recv(x->srv, ZMQ_DONTWAIT, &c->m, &c->fr, err, sizeof err);
        if (st == K3_ERR_TIMEOUT || st == K3_ERR_CANCEL || st == K3_ERR_IO) {
            proto_frames_close(&c->fr);
            free(c);
            return;
        }
        if (!st && c->m.type != PROTO_MSG_EXPERT_CALL)
            st = k3_errf(K3_ERR_PROTO, err, sizeof err,
                         "%s: the expert endpoint takes EXPERT_CALL only",
                         proto_type_name(c->m.type));
        if (!st && s->n_queued >= XS_MAX_QUEUE)
            st = k3_errf(K3_ERR_BUSY, err, sizeof err, "%d expert calls queued (XS_MAX_QUEUE)",
                         s->n_queued);
        if (st) {
            K3_WARN("%s: expert call refused: %s", x->o.name, err);
            if (c->m.id) xs_reply_error(s, &c->fr.from, &c->m, st, err);
            pthread_mutex_lock(&x->mu);
            x->st.served_errors++;
            pthread_mutex_unlock(&x->mu);
            proto_frames_close(&c->fr);
            free(c);
            continue;
        }
        c->recv_ms = k3_now_ms();
        if (s->tail)
            s->tail->next = c;
        else
            s->head = c;
        s->tail = c;
        s->n_queued++;
    }
}

static void xs_heartbeat(xs_srv *s, const xs_call *c) {
    proto_msg h;
    char err[256];
    proto_msg_init(&h, PROTO_MSG_HEARTBEAT, 0, c->m.epoch);
    h.u.heartbeat.busy_request = c->m.id;
    if (proto_send(s->x->srv, &c->fr.from, &h, NULL, NULL, 0, ZMQ_DONTWAIT, err, sizeof err))
        K3_DEBUG("%s: expert server: progress HEARTBEAT not sent: %s", s->x->o.name, err);
}

/* HEARTBEAT (busy_request = the call's id) to the caller of every queued
 * call and of the running one, at most every hb_ms / 2: a caller's
 * deadline (TTL) counts from the last sign of its call, so a peer that is
 * slow because it is busy is not taken for a dead one (PROTOCOL.md
 * "Expert calls"). Also reads the calls that arrived meanwhile. */
static void xs_serve_progress(xs_srv *s) {
    wk_xstripe *x = s->x;
    xs_drain(s);
    int hb = x->o.sock.hb_ms > 0 ? x->o.sock.hb_ms : K3_LINK_HB_MS_DEFAULT;
    double now = k3_now_ms();
    if (now - s->last_hb_ms < hb / 2.0) return;
    s->last_hb_ms = now;
    if (s->running) xs_heartbeat(s, s->running);
    for (const xs_call *c = s->head; c; c = c->next) xs_heartbeat(s, c);
}

static void xs_serve_one(xs_srv *s) {
    wk_xstripe *x = s->x;
    xs_call *c = s->head;
    if (!c) return;
    s->head = c->next;
    if (!s->head) s->tail = NULL;
    s->n_queued--;
    s->running = c;
    proto_msg m = c->m;
    char err[1024];
    k3_status st = xs_check_call(s, &m, &c->fr, err, sizeof err);
    k3_expert_stats es = {0};
    double t0 = k3_now_ms(), queued = t0 - c->recv_ms;
    if (!st) st = xs_compute(s, &m, &c->fr, &es, err, sizeof err);
    double ms = k3_now_ms() - t0;
    if (st) {
        K3_WARN("%s: expert call refused: %s", x->o.name, err);
        if (m.id) xs_reply_error(s, &c->fr.from, &m, st, err);
        pthread_mutex_lock(&x->mu);
        x->st.served_errors++;
        pthread_mutex_unlock(&x->mu);
        s->running = NULL;
        proto_frames_close(&c->fr);
        free(c);
        return;
    }
    proto_msg d;
    proto_msg_init(&d, PROTO_MSG_EXPERT_DONE, m.id, m.epoch);
    proto_expert_done *o = &d.u.expert_done;
    o->layer = m.u.expert_call.layer;
    o->drive = m.u.expert_call.drive;
    o->n_pairs = m.u.expert_call.n_pairs;
    o->latent = m.u.expert_call.latent;
    o->compute_ms = ms;
    o->read_ms = es.read_ms;
    o->bytes_read = es.bytes;
    o->expert_hits = es.hits;
    o->expert_misses = es.misses;
    const void *f[1] = {s->y};
    size_t fb[1] = {sizeof(float) * (size_t)o->n_pairs * o->latent};
    st = proto_send(x->srv, &c->fr.from, &d, f, fb, 1, ZMQ_DONTWAIT, err, sizeof err);
    if (st) K3_WARN("%s: expert server: cannot send EXPERT_DONE: %s", x->o.name, err);
    pthread_mutex_lock(&x->mu);
    x->st.served++;
    x->st.served_bytes += es.bytes;
    x->st.served_hits += es.hits;
    x->st.served_misses += es.misses;
    x->st.served_ms += ms;
    x->st.served_read_ms += es.read_ms;
    x->st.served_queue_ms += queued;
    pthread_mutex_unlock(&x->mu);
    s->running = NULL;
    proto_frames_close(&c->fr);
    free(c);
}

static void *xs_thread(void *arg) {
    wk_xstripe *x = arg;
    xs_srv s;
    memset(&s, 0, sizeof s);
    s.x = x;
    s.lc.cfg = x->cfg;
    s.lc.pool = x->pool;
    s.lc.experts = k3_model_experts(x->m);
    s.lc.idot = k3_model_idot(x->m);
    s.lc.topp = k3_model_topp(x->m);
    while (!atomic_load(&x->stop)) {
        zmq_pollitem_t it = {x->srv, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, 100); /* the stop flag is checked this often */
        if (rc < 0 && zmq_errno() != EINTR) {
            K3_ERROR("%s: expert server: poll: %s", x->o.name, zmq_strerror(zmq_errno()));
            break;
        }
        if (rc > 0) xs_drain(&s);
        while (s.head && !atomic_load(&x->stop)) {
            xs_serve_progress(&s); /* a call about to start is a sign of life too */
            xs_serve_one(&s);
        }
    }
    while (s.head) { /* stopping: the queued calls are dropped (their callers time out) */
        xs_call *c = s.head;
        s.head = c->next;
        proto_frames_close(&c->fr);
        free(c);
    }
    free(s.ar.base);
    free(s.y);
    return NULL;
}

/* ---- open / close ---- */

k3_status wk_xstripe_open(wk_xstripe **out, k3_model *m, const wk_xstripe_opts *o, char *err,
                          size_t errlen) {
    *out = NULL;
    wk_xstripe *x = k3_xcalloc(1, sizeof *x);
    x->m = m;
    x->cfg = k3_model_config(m);
    x->o = *o;
    pthread_mutex_init(&x->mu, NULL);
    x->remote = (k3_moe_remote){x, xs_is_remote, xs_start, xs_finish, xs_abort};
    x->ctx = zmq_ctx_new();
    k3_status st = K3_OK;
    if (!x->ctx) st = k3_errf(K3_ERR_IO, err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    if (!st && o->listen) {
        st = k3_pool_open(&x->pool, o->threads > 0 ? o->threads : 1, err, errlen);
        if (!st) {
            x->srv = zmq_socket(x->ctx, ZMQ_ROUTER);
            if (!x->srv)
                st = k3_errf(K3_ERR_IO, err, errlen, "zmq_socket(ROUTER): %s",
                             zmq_strerror(zmq_errno()));
        }
        if (!st) st = k3_link_sockopts_apply(x->srv, &o->sock, err, errlen);
        if (!st && o->curve) st = k3_zap_open(&x->zap, x->ctx, o->allow, err, errlen);
        if (!st && o->curve) st = k3_link_curve_server(x->srv, o->kp, err, errlen);
        if (!st) {
            char ep[K3_MAX_ENDPOINT + 16];
            wk_bind_endpoint(o->listen, ep, sizeof ep);
            if (zmq_bind(x->srv, ep) != 0)
                st = k3_errf(K3_ERR_IO, err, errlen, "--expert-listen: bind %s: %s", o->listen,
                             zmq_strerror(zmq_errno()));
        }
        if (!st) {
            if (pthread_create(&x->th, NULL, xs_thread, x) != 0)
                st = k3_errf(K3_ERR_IO, err, errlen, "expert server: pthread_create failed");
            else
                x->th_started = 1;
        }
    }
    if (st) {
        wk_xstripe_close(&x, NULL);
        return st;
    }
    k3_model_set_moe_remote(m, &x->remote);
    char own[64] = "";
    for (int d = 0, n = 0; d < K3_MAX_DIRS; d++)
        if (o->own >> d & 1u)
            n += snprintf(own + n, sizeof own - (size_t)n, "%s%d", n ? "," : "", d);
    K3_INFO("%s: cross-worker striping: serves drive(s) %s%s%s%s", o->name, own[0] ? own : "none",
            o->listen ? " on " : "", o->listen ? o->listen : "", o->curve ? " with CURVE" : "");
    *out = x;
    return K3_OK;
}

void wk_xstripe_set_tick(wk_xstripe *x, void (*tick)(void *), void *ctx, atomic_int *cancel) {
    x->tick = tick;
    x->tick_ctx = ctx;
    x->cancel = cancel;
}

void wk_xstripe_set_epoch(wk_xstripe *x, uint64_t epoch) { atomic_store(&x->epoch, epoch); }

void wk_xstripe_close(wk_xstripe **xp, k3_model *m) {
    if (!xp || !*xp) return;
    wk_xstripe *x = *xp;
    if (m) k3_model_set_moe_remote(m, NULL);
    atomic_store(&x->stop, 1);
    if (x->th_started) pthread_join(x->th, NULL);
    /* per call: the round trip, and of it the peer's compute (its read
     * waits included): the rest is the wire, the queue and the wake-ups */
    double nc = x->st.calls ? (double)x->st.calls : 1, ns = x->st.served ? (double)x->st.served : 1;
    K3_INFO("%s: expert calls: %llu sent from %llu MoE layer steps (%llu outputs gathered, "
            "%.1f ms waiting); per call %.1f ms round trip, of it %.1f ms the peer's compute "
            "(%.1f ms its read wait); %llu served (%llu refused, %llu bytes read for them, "
            "%.1f ms queued behind other calls, %.1f ms computing and %.1f ms waiting on reads "
            "per call)",
            x->o.name, (unsigned long long)x->st.calls, (unsigned long long)x->st.layers_called,
            (unsigned long long)x->st.pairs_remote, x->st.gather_wait_ms, x->st.call_rtt_ms / nc,
            x->st.peer_compute_ms / nc, x->st.peer_read_ms / nc, (unsigned long long)x->st.served,
            (unsigned long long)x->st.served_errors, (unsigned long long)x->st.served_bytes,
            x->st.served_queue_ms / ns, x->st.served_ms / ns, x->st.served_read_ms / ns);
    if (x->srv) zmq_close(x->srv);
    for (int d = 0; d < K3_MAX_DIRS; d++) xs_drop_socket(&x->peer[d]);
    k3_zap_close(&x->zap);
    while (x->ctx && zmq_ctx_term(x->ctx) != 0 && zmq_errno() == EINTR) {
    }
    k3_pool_close(&x->pool);
    pthread_mutex_destroy(&x->mu);
    free(x);
    *xp = NULL;
}

void wk_xstripe_get_stats(wk_xstripe *x, wk_xstripe_stats *out) {
    pthread_mutex_lock(&x->mu);
    *out = x->st;
    pthread_mutex_unlock(&x->mu);
}

/* ---- per-step figures (FORWARD_DONE) ---- */

void wk_drive_snapshot(k3_model *m, wk_xstripe *x, wk_drive_snap *out) {
    memset(out, 0, sizeof *out);
    k3_experts *es = k3_model_experts(m);
    if (!es) return;
    out->n_drives = k3_experts_drives(es);
    for (int d = 0; d < out->n_drives && d < K3_MAX_DIRS; d++)
        out->bytes[d] = k3_experts_drive_bytes(es, d);
    if (x) {
        pthread_mutex_lock(&x->mu);
        out->gather_ms = x->st.gather_wait_ms;
        out->gather_layers = x->st.layers_called;
        pthread_mutex_unlock(&x->mu);
    }
}

void wk_drive_delta(const wk_drive_snap *a, const wk_drive_snap *b, struct proto_forward_done *o) {
    o->n_drives = (uint32_t)b->n_drives;
    for (int d = 0; d < b->n_drives && d < K3_MAX_DIRS; d++)
        o->drive_bytes[d] = b->bytes[d] - a->bytes[d];
    o->gather_ms = b->gather_ms - a->gather_ms > 0 ? b->gather_ms - a->gather_ms : 0;
    o->gather_layers = b->gather_layers - a->gather_layers;
}
