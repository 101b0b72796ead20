/* worker/serve.c: the worker's socket loop (worker.h, docs/PROTOCOL.md 7-9).
 *
 * Shape of the loop: poll the ROUTER (never longer than one heartbeat
 * interval), read every message that is there, act at once on the control
 * messages (HELLO, CANCEL, STATS, SHUTDOWN, HEARTBEAT) and queue the work
 * (FORWARD, SESSION_*), then run the oldest queued request. While a FORWARD
 * runs, the per-layer hook does the same reading and sends HEARTBEAT, so a
 * cancel or a new epoch stops the step before its next layer.
 *
 * Epochs: a HELLO that passes the compatibility checks makes its epoch the
 * current one; requests of the old epoch (queued or running) are dropped
 * without a reply and every session state is freed. A request that carries
 * another epoch is answered ERROR(state, "stale epoch") and not run, so a
 * worker that was frozen (SIGSTOP) and re-registered never delivers work of
 * its old life.
 *
 * Every reply echoes the request's id and epoch. Replies are sent with
 * ZMQ_DONTWAIT: a ROUTER never blocks, it drops a message for a peer that is
 * gone, which is what we want for a coordinator that died.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/ckpt_store.h"
#include "common/engine/stage.h"
#include "common/vk/vk_tier.h"
#include "worker/sessions.h"
#include "worker/worker.h"
#include "worker/xstripe.h"

typedef struct wk_req {
    proto_msg msg;   /* decoded envelope */
    proto_frames fr; /* tensor frames and the sender's routing id, owned */
    struct wk_req *next;
} wk_req;

typedef struct wk {
    k3_model *m; /* borrowed */
    const k3_config *cfg;
    const wk_opts *o; /* borrowed */
    int layer_a, layer_b;
    int nb_in;                   /* AttnRes blocks a FORWARD brings: snapshots of [0, a) */
    int k_stage;                 /* AttnRes snapshots our layers take */
    proto_limits lim;            /* PROTOCOL.md 8 step 10 */
    void *ctx, *sock;            /* owned */
    k3_zap *zap;                 /* owned, curve only */
    wk_sessions *sess;           /* owned */
    k3_ckpt_store *ckpt_store;   /* --ckpt-dir, owned, NULL = none */
    volatile sig_atomic_t *stop; /* borrowed: set by SIGTERM / SIGINT */
    int shutdown;                /* SHUTDOWN received */

    uint64_t epoch;    /* current link epoch, 0 = not registered */
    proto_peer coord;  /* routing id of the registered coordinator */
    double last_tx_ms; /* last message sent to it (heartbeat pacing) */

    wk_req *q_head, *q_tail; /* queued work, FIFO */
    int q_len;

    atomic_int cancel;            /* polled by the stage between layers */
    uint64_t busy_req, busy_sess; /* the running FORWARD, 0 when idle */
    int clear_pending;            /* new epoch mid-step: free sessions after it */

    float *blocks; /* [nb_in + k_stage][cap_T][D] */
    float *h;      /* [cap_T][D] */
    int cap_T;

    proto_stats_ok stats;     /* cumulative (STATS_OK) */
    k3_vk_tier_stats vk_sent; /* the Vulkan tier's counters at the last stats reply */
    wk_ratelimit_state bad;   /* malformed-message log lines */
    uint64_t n_started;       /* FORWARDs started (fault hook) */
} wk;

/* ---- sending ---- */

static void wk_send(wk *w, const proto_peer *to, const proto_msg *m, const void *const *frames,
                    const size_t *bytes, int n) {
    char err[256];
    k3_status st = proto_send(w->sock, to, m, frames, bytes, n, ZMQ_DONTWAIT, err, sizeof err);
    if (st) K3_WARN("%s: cannot send %s: %s", w->o->name, proto_type_name(m->type), err);
    w->last_tx_ms = k3_now_ms();
}

/* ERROR strings are ASCII without control characters (PROTOCOL.md 3). */
static void wk_clean_msg(char *dst, size_t cap, const char *src) {
    size_t i = 0;
    for (; src && src[i] && i + 1 < cap; i++) {
        unsigned char c = (unsigned char)src[i];
        dst[i] = (c < 0x20 || c >= 0x7f) ? '?' : (char)c;
    }
    dst[i] = 0;
}

static void wk_send_error(wk *w, const proto_peer *to, const proto_msg *req, k3_status code,
                          const char *msg) {
    proto_msg e;
    proto_msg_init(&e, PROTO_MSG_ERROR, req ? req->id : 0, req ? req->epoch : w->epoch);
    e.u.error.code = (uint32_t)(code ? code : K3_ERR_INTERNAL);
    if (req && req->type == PROTO_MSG_FORWARD) {
        e.u.error.session = req->u.forward.session;
        e.u.error.step = req->u.forward.step;
    }
    wk_clean_msg(e.u.error.msg, sizeof e.u.error.msg, msg);
    wk_send(w, to, &e, NULL, NULL, 0);
}

static void wk_heartbeat(wk *w) {
    if (!w->epoch || !w->o->sock.hb_ms) return;
    if (k3_now_ms() - w->last_tx_ms < w->o->sock.hb_ms) return;
    proto_msg hb;
    proto_msg_init(&hb, PROTO_MSG_HEARTBEAT, 0, w->epoch);
    hb.u.heartbeat.busy_request = w->busy_req;
    wk_send(w, &w->coord, &hb, NULL, NULL, 0);
}

/* ---- the queue ---- */

static void req_free(wk_req *r) {
    if (!r) return;
    proto_frames_close(&r->fr);
    free(r);
}

static void queue_push(wk *w, wk_req *r) {
    r->next = NULL;
    if (w->q_tail)
        w->q_tail->next = r;
    else
        w->q_head = r;
    w->q_tail = r;
    w->q_len++;
}

static wk_req *queue_pop(wk *w) {
    wk_req *r = w->q_head;
    if (!r) return NULL;
    w->q_head = r->next;
    if (!w->q_head) w->q_tail = NULL;
    w->q_len--;
    r->next = NULL;
    return r;
}

static uint64_t req_session(const wk_req *r) {
    switch (r->msg.type) {
    case PROTO_MSG_FORWARD: return r->msg.u.forward.session;
    case PROTO_MSG_SESSION_RESET:
    case PROTO_MSG_SESSION_TRUNCATE:
    case PROTO_MSG_SESSION_DROP: return r->msg.u.session.session;
    case PROTO_MSG_CHECKPOINT:
    case PROTO_MSG_RESTORE: return r->msg.u.ckpt.session;
    default: return 0;
    }
}

/* Removes every queued request that `match` selects; answers each with
 * ERROR(cancel, why) unless why is NULL (a new epoch: no reply). */
static void queue_remove(wk *w, uint64_t req_id, uint64_t sess, int all, const char *why) {
    wk_req **pp = &w->q_head;
    w->q_tail = NULL;
    while (*pp) {
        wk_req *r = *pp;
        int hit = all || (req_id && r->msg.id == req_id) || (sess && req_session(r) == sess);
        if (!hit) {
            w->q_tail = r;
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        w->q_len--;
        if (why) wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_CANCEL, why);
        req_free(r);
    }
}

/* ---- control messages (acted on at once) ---- */

static int wk_peer_eq(const proto_peer *a, const proto_peer *b) {
    return a->len == b->len && !memcmp(a->id, b->id, a->len);
}

/* A HELLO of a new epoch from another peer takes the worker over (a
 * restarted coordinator must not wait for its old life to time out). The
 * coordinator it displaces is told at once, naming the newcomer, instead
 * of finding its steps unanswered (PROTOCOL.md "Displacement"). */
static void wk_displaced(wk *w, const wk_req *r) {
    char who[17] = "", msg[256]; /* 8 id bytes in hex; the text below fits */
    for (size_t i = 0; i < r->fr.from.len && i < 8; i++)
        snprintf(who + 2 * i, sizeof who - 2 * i, "%02x", r->fr.from.id[i]);
    snprintf(msg, sizeof msg,
             "displaced: another coordinator (peer %s, build '%.40s') registered with epoch %llx; "
             "this worker now serves it",
             who, r->msg.u.hello.build, (unsigned long long)r->msg.epoch);
    K3_WARN("%s: %s", w->o->name, msg);
    proto_msg e;
    proto_msg_init(&e, PROTO_MSG_ERROR, 0, w->epoch);
    e.u.error.code = K3_ERR_STATE;
    wk_clean_msg(e.u.error.msg, sizeof e.u.error.msg, msg);
    wk_send(w, &w->coord, &e, NULL, NULL, 0);
}

static void on_hello(wk *w, wk_req *r) {
    const proto_hello *h = &r->msg.u.hello;
    char err[512];
    /* expected = what the coordinator asks for, got = what this worker is */
    k3_status st =
        proto_check_compat(h->fingerprint, &h->num, w->o->fingerprint, &w->o->num, err, sizeof err);
    if (!st)
        st = k3_link_check_build(h->build, "coordinator", w->o->build, "worker", err, sizeof err);
    if (st) {
        K3_WARN("%s: HELLO refused (coordinator build '%s'): %s", w->o->name, h->build, err);
        /* the peer is not registered: it is not told this worker's
         * fingerprint (the log has it), only that it differs */
        if (h->fingerprint != w->o->fingerprint)
            snprintf(err, sizeof err,
                     "model fingerprint mismatch: this worker serves another model or other "
                     "shard settings (its log names both fingerprints)");
        wk_send_error(w, &r->fr.from, &r->msg, st, err);
        return;
    }
    /* the high 32 bits of an epoch are one coordinator's life (cluster.c
     * new_epoch): a change there is another coordinator, not a re-registration */
    if (w->epoch && (r->msg.epoch >> 32) != (w->epoch >> 32) && !wk_peer_eq(&r->fr.from, &w->coord))
        wk_displaced(w, r);
    if (r->msg.epoch != w->epoch) {
        /* a new life of the link: nothing of the old epoch survives */
        queue_remove(w, 0, 0, 1, NULL);
        if (w->busy_req) {
            w->cancel = 1;
            w->clear_pending = 1;
        } else {
            wk_sessions_clear(w->sess);
        }
        K3_INFO("%s: registered (epoch %llx, coordinator build '%s')", w->o->name,
                (unsigned long long)r->msg.epoch, h->build);
        w->epoch = r->msg.epoch;
    }
    w->coord = r->fr.from;
    proto_msg ok;
    proto_msg_init(&ok, PROTO_MSG_HELLO_OK, r->msg.id, r->msg.epoch);
    proto_hello_ok *o = &ok.u.hello_ok;
    o->fingerprint = w->o->fingerprint;
    o->layers[0] = (uint32_t)w->layer_a;
    o->layers[1] = (uint32_t)w->layer_b;
    o->num = w->o->num;
    o->max_sessions = (uint32_t)w->o->max_sessions;
    o->max_ctx = (uint32_t)w->o->max_ctx;
    o->read_gbps = w->o->read_gbps;
    o->stripe = w->o->xs ? w->o->xs_own : 0; /* the coordinator refuses a drive claimed twice */
    snprintf(o->build, sizeof o->build, "%s", w->o->build);
    snprintf(o->name, sizeof o->name, "%s", w->o->name);
    wk_send(w, &r->fr.from, &ok, NULL, NULL, 0);
}

static void reply_ok(wk *w, const wk_req *r) {
    proto_msg ok;
    proto_msg_init(&ok, PROTO_MSG_OK, r->msg.id, r->msg.epoch);
    wk_send(w, &r->fr.from, &ok, NULL, NULL, 0);
}

static void on_cancel(wk *w, wk_req *r) {
    const proto_cancel *c = &r->msg.u.cancel;
    queue_remove(w, c->request, c->session, 0, "cancelled by the coordinator");
    if (w->busy_req &&
        ((c->request && c->request == w->busy_req) || (c->session && c->session == w->busy_sess)))
        w->cancel = 1; /* answered ERROR(cancel) when the step stops */
    reply_ok(w, r);
}

static void on_stats(wk *w, wk_req *r) {
    proto_msg m;
    proto_msg_init(&m, PROTO_MSG_STATS_OK, r->msg.id, r->msg.epoch);
    m.u.stats_ok = w->stats;
    m.u.stats_ok.evictions = wk_sessions_evictions(w->sess);
    /* after a new epoch's HELLO mid-step the old states are freed when the
     * step stops (clear_pending), but they are gone for the coordinator
     * already: a STATS answered from the layer hook in between says 0 */
    m.u.stats_ok.sessions = w->clear_pending ? 0 : (uint32_t)wk_sessions_count(w->sess);
    proto_stats_ok *so = &m.u.stats_ok;
    snprintf(so->name, sizeof so->name, "%s", w->o->name);
    snprintf(so->build, sizeof so->build, "%s", w->o->build);
    snprintf(so->dirs, sizeof so->dirs, "%s", w->o->dirs);
    snprintf(so->stripe, sizeof so->stripe, "%s", w->o->stripe);
    so->layers[0] = (uint32_t)w->layer_a;
    so->layers[1] = (uint32_t)w->layer_b;
    so->read_gbps = w->o->read_gbps;
    so->uptime_s = (k3_now_ms() - w->o->start_ms) / 1000.0;
    so->registered = w->epoch != 0;
    struct k3_vk_tier *vt = k3_model_vk(w->m);
    if (vt) { /* the Vulkan expert tier (docs/VULKAN.md "Stats") */
        k3_vk_tier_stats v;
        k3_vk_tier_stats_get(vt, &v);
        so->vk_calls = v.calls, so->vk_pairs = v.pairs;
        so->vk_promotions = v.promotions, so->vk_evictions = v.evictions;
        so->vk_resident = (uint32_t)v.resident;
        so->vk_device_ms = v.device_ms, so->vk_cpu_ms = v.cpu_ms, so->vk_wait_ms = v.wait_ms;
        so->vk_off = v.off != 0;
    }
    wk_send(w, &r->fr.from, &m, NULL, NULL, 0);
}

/* The Vulkan tier's counters (zero without a tier), and their change since
 * the previous FORWARD_DONE with stats for this one's stats group
 * (docs/PROTOCOL.md "Changes in 1.2"): the step's device work, plus uploads
 * that finished and expert calls served for stripe peers in between, so
 * the coordinator's sums are the tier's totals. */
static void wk_vk_snapshot(wk *w, k3_vk_tier_stats *v) {
    memset(v, 0, sizeof *v);
    struct k3_vk_tier *vt = k3_model_vk(w->m);
    if (vt) k3_vk_tier_stats_get(vt, v);
}

static double wk_ms_delta(double a, double b) { return b - a > 0 ? b - a : 0; }

static void wk_vk_delta(const k3_vk_tier_stats *a, const k3_vk_tier_stats *b,
                        proto_forward_done *o) {
    o->vk_calls = b->calls - a->calls;
    o->vk_pairs = b->pairs - a->pairs;
    o->vk_promotions = b->promotions - a->promotions;
    o->vk_resident = (uint32_t)b->resident;
    o->vk_device_ms = wk_ms_delta(a->device_ms, b->device_ms);
    o->vk_cpu_ms = wk_ms_delta(a->cpu_ms, b->cpu_ms);
    o->vk_wait_ms = wk_ms_delta(a->wait_ms, b->wait_ms);
}

static void on_shutdown(wk *w, wk_req *r) {
    K3_INFO("%s: SHUTDOWN received", w->o->name);
    reply_ok(w, r);
    queue_remove(w, 0, 0, 1, "worker shutting down");
    w->shutdown = 1;
    if (w->busy_req) w->cancel = 1;
}

/* Registered, and the request belongs to the current epoch? Else ERROR. */
static int check_epoch(wk *w, wk_req *r) {
    char msg[128];
    if (!w->epoch) {
        wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_STATE, "not registered: send HELLO first");
        return 0;
    }
    if (!wk_peer_eq(&r->fr.from, &w->coord)) {
        /* another peer: it learns neither the epoch nor who is registered */
        wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_AUTH,
                      "not the registered coordinator: send HELLO first");
        return 0;
    }
    if (r->msg.epoch != w->epoch) {
        snprintf(msg, sizeof msg, "stale epoch %llx (current %llx)",
                 (unsigned long long)r->msg.epoch, (unsigned long long)w->epoch);
        wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_STATE, msg);
        return 0;
    }
    return 1;
}

/* Takes ownership of r. */
static void dispatch(wk *w, wk_req *r) {
    char msg[160];
    switch (r->msg.type) {
    case PROTO_MSG_HEARTBEAT: /* a sign of life; nothing to do */ break;
    case PROTO_MSG_HELLO: on_hello(w, r); break;
    case PROTO_MSG_CANCEL:
    case PROTO_MSG_STATS:
    case PROTO_MSG_SHUTDOWN:
        /* STATS with epoch 0 is a probe (k3-coordinator status): answered
         * whatever the registration, and it changes nothing */
        if (r->msg.type == PROTO_MSG_STATS && r->msg.epoch == 0) {
            on_stats(w, r);
            break;
        }
        if (!check_epoch(w, r)) break;
        if (r->msg.type == PROTO_MSG_CANCEL)
            on_cancel(w, r);
        else if (r->msg.type == PROTO_MSG_STATS)
            on_stats(w, r);
        else
            on_shutdown(w, r);
        break;
    case PROTO_MSG_FORWARD:
    case PROTO_MSG_SESSION_RESET:
    case PROTO_MSG_SESSION_TRUNCATE:
    case PROTO_MSG_SESSION_DROP:
    case PROTO_MSG_CHECKPOINT:
    case PROTO_MSG_RESTORE:
        if (!check_epoch(w, r)) break;
        if (w->shutdown) {
            wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_CANCEL, "worker shutting down");
            break;
        }
        if (w->q_len >= WK_MAX_QUEUE) {
            snprintf(msg, sizeof msg, "request queue full: %d requests (WK_MAX_QUEUE)", w->q_len);
            wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_BUSY, msg);
            break;
        }
        queue_push(w, r);
        return; /* the queue owns it now */
    case PROTO_MSG_ERROR:
        /* never answered (two peers must not bounce errors) */
        w->stats.proto_errors++;
        if (wk_ratelimit(&w->bad, k3_now_ms()))
            K3_WARN("%s: ERROR from a peer ignored: %s", w->o->name, r->msg.u.error.msg);
        break;
    default:
        w->stats.proto_errors++;
        snprintf(msg, sizeof msg, "%s is a reply; a worker accepts only requests",
                 proto_type_name(r->msg.type));
        if (wk_ratelimit(&w->bad, k3_now_ms()))
            K3_WARN("%s: rejected message: %s", w->o->name, msg);
        wk_send_error(w, &r->fr.from, &r->msg, K3_ERR_PROTO, msg);
        break;
    }
    req_free(r);
}

/* Reads every message waiting on the socket. Control messages act now,
 * work is queued, malformed messages are answered (when the sender is
 * known) and counted. */
static void wk_drain(wk *w) {
    for (;;) {
        wk_req *r = k3_xcalloc(1, sizeof *r);
        char err[512];
        k3_status st = proto_recv(w->sock, ZMQ_DONTWAIT, &r->msg, &r->fr, err, sizeof err);
        if (st == K3_OK) {
            dispatch(w, r);
            continue;
        }
        if (st == K3_ERR_TIMEOUT || st == K3_ERR_CANCEL || st == K3_ERR_IO) {
            /* nothing consumed: no message, a signal, or a socket error */
            if (st == K3_ERR_IO) K3_WARN("%s: receive: %s", w->o->name, err);
            req_free(r);
            return;
        }
        /* one whole message was consumed and rejected */
        w->stats.proto_errors++;
        if (wk_ratelimit(&w->bad, k3_now_ms()))
            K3_WARN("%s: rejected a malformed %s message: %s", w->o->name,
                    proto_type_name(r->msg.type), err);
        if (r->fr.from.len && r->msg.type != PROTO_MSG_ERROR)
            wk_send_error(w, &r->fr.from, &r->msg, st, err);
        req_free(r);
    }
}

/* ---- work ---- */

/* Per-layer hook of a running FORWARD: liveness, and control messages. */
static void wk_layer_hook(void *ctx, int layer, int pos0, int T, const float *h) {
    (void)layer, (void)pos0, (void)T, (void)h;
    wk *w = ctx;
    if (w->o->xs) wk_xstripe_set_epoch(w->o->xs, w->epoch); /* stamped on expert calls */
    if (*w->stop) w->cancel = 1;
    wk_heartbeat(w);
    wk_drain(w);
}

/* While a MoE layer waits on its stripe peers (worker/xstripe.h): our
 * HEARTBEAT keeps the coordinator from taking the wait for a stall. */
static void wk_xstripe_tick(void *ctx) {
    wk *w = ctx;
    if (*w->stop) w->cancel = 1;
    wk_heartbeat(w);
}

static k3_status ensure_buffers(wk *w, int T, char *err, size_t errlen) {
    if (T <= w->cap_T) return K3_OK;
    size_t D = (size_t)w->cfg->hidden;
    size_t entries = (size_t)(w->nb_in + w->k_stage > 0 ? w->nb_in + w->k_stage : 1);
    size_t nb = sizeof(float) * entries * (size_t)T * D;
    float *b = NULL, *h = NULL;
    if (posix_memalign((void **)&b, 64, nb) != 0 ||
        posix_memalign((void **)&h, 64, sizeof(float) * (size_t)T * D) != 0) {
        free(b);
        return k3_errf(K3_ERR_NOMEM, err, errlen,
                       "cannot allocate step buffers for T=%d (%zu bytes)", T, nb);
    }
    free(w->blocks);
    free(w->h);
    w->blocks = b;
    w->h = h;
    w->cap_T = T;
    return K3_OK;
}

/* The fault hook of docs/TESTING.md T3: a compute thread stuck for good while
 * the process and its ZMQ I/O thread live on. Ends only with SIGTERM. */
static void wk_fault_stall(wk *w) {
    K3_WARN("%s: fault hook: stalling the compute loop (FORWARD #%llu)", w->o->name,
            (unsigned long long)w->n_started);
    while (!*w->stop) usleep(20000);
    w->cancel = 1;
}

static void do_forward(wk *w, wk_req *r) {
    const proto_forward *f = &r->msg.u.forward;
    char err[1024];
    uint64_t evicted = 0;
    k3_state *state = NULL;
    k3_status st = proto_check_limits(&r->msg, &w->lim, err, sizeof err);
    /* the block list of a step entering layer a holds exactly the snapshots
     * of [0, a); checked before the frame is copied (buffer size) */
    if (!st && (int)f->n_blocks != w->nb_in)
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "FORWARD: field 'nb': %u AttnRes blocks, layer %d expects %d", f->n_blocks,
                     w->layer_a, w->nb_in);
    if (!st) st = ensure_buffers(w, (int)f->n_tokens, err, sizeof err);
    if (!st)
        st = wk_sessions_acquire(w->sess, f->session, (int)f->pos0, &state, &evicted, err,
                                 sizeof err);
    if (st) {
        wk_send_error(w, &r->fr.from, &r->msg, st, err);
        return;
    }
    if (evicted)
        K3_INFO("%s: session %llu evicted for session %llu (%d states held)", w->o->name,
                (unsigned long long)evicted, (unsigned long long)f->session, w->o->max_sessions);

    /* frames were checked against the envelope by proto_recv; they may be
     * unaligned, so they are copied (the stage works in place anyway) */
    size_t TD = (size_t)f->n_tokens * f->hidden;
    size_t bytes;
    const void *src = proto_frames_data(&r->fr, 0, &bytes);
    if (bytes) memcpy(w->blocks, src, bytes);
    src = proto_frames_data(&r->fr, 1, &bytes);
    memcpy(w->h, src, bytes);

    w->busy_req = r->msg.id;
    w->busy_sess = f->session;
    w->cancel = *w->stop ? 1 : 0;
    w->n_started++;
    k3_stage_set_cancel(state, &w->cancel);
    if (w->o->fault_stall_at && w->n_started == (uint64_t)w->o->fault_stall_at) wk_fault_stall(w);
    if (w->o->fault_slow_ms) usleep((useconds_t)w->o->fault_slow_ms * 1000u); /* kill -9 tests */
    int nb = (int)f->n_blocks;
    k3_step_stats ss;
    memset(&ss, 0, sizeof ss);
    wk_drive_snap snap0, snap1; /* per-drive bytes and expert-call waits of this step */
    wk_drive_snapshot(w->m, w->o->xs, &snap0);
    /* The Vulkan tier's counters (zero without a tier), and their change since
     * the previous FORWARD_DONE with stats for this one's stats group
     * (docs/PROTOCOL.md "Changes in 1.2"): the step's device work, plus uploads
     * that finished and expert calls served for stripe peers in between, so
     * the coordinator's sums are the tier's totals. */
    st = k3_stage_forward(w->m, state, (int)f->pos0, (int)f->n_tokens, w->blocks, &nb, w->h, &ss,
                          wk_layer_hook, w, err, sizeof err);
    k3_stage_set_cancel(state, NULL);
    w->busy_req = w->busy_sess = 0;

    if (w->clear_pending) { /* a HELLO of a new epoch arrived mid-step */
        wk_sessions_clear(w->sess);
        w->clear_pending = 0;
        state = NULL;
    }
    if (r->msg.epoch != w->epoch) return; /* old epoch: no reply, no state */
    if (st) {
        if (state) wk_sessions_drop(w->sess, f->session); /* the state is unusable now */
        if (st != K3_ERR_CANCEL) K3_WARN("%s: FORWARD failed: %s", w->o->name, err);
        wk_send_error(w, &r->fr.from, &r->msg, st, err);
        return;
    }
    w->stats.forwards++;
    w->stats.tokens += f->n_tokens;
    w->stats.bytes_read += ss.bytes_read;
    w->stats.expert_hits += ss.expert_hits;
    w->stats.expert_misses += ss.expert_misses;
    w->stats.busy_ms += ss.compute_ms;
    w->stats.read_ms += ss.read_ms;

    proto_msg d;
    proto_msg_init(&d, PROTO_MSG_FORWARD_DONE, r->msg.id, r->msg.epoch);
    proto_forward_done *o = &d.u.forward_done;
    o->session = f->session;
    o->step = f->step;
    o->n_tokens = f->n_tokens;
    o->hidden = f->hidden;
    o->n_snapshots = (uint32_t)(nb - (int)f->n_blocks);
    o->n_evicted = evicted ? 1 : 0;
    o->evicted[0] = evicted;
    if (f->flags & PROTO_FWD_STATS) {
        o->has_stats = true;
        o->compute_ms = ss.compute_ms > 0 ? ss.compute_ms : 0;
        o->read_ms = ss.read_ms > 0 ? ss.read_ms : 0;
        o->bytes_read = ss.bytes_read;
        o->expert_hits = ss.expert_hits;
        o->expert_misses = ss.expert_misses;
        wk_drive_snapshot(w->m, w->o->xs, &snap1);
        wk_drive_delta(&snap0, &snap1, o);
        k3_vk_tier_stats vk; /* the Vulkan tier's share of this step */
        wk_vk_snapshot(w, &vk);
        wk_vk_delta(&w->vk_sent, &vk, o);
        w->vk_sent = vk;
    }
    const void *frames[2] = {w->blocks + (size_t)f->n_blocks * TD, w->h};
    size_t sizes[2] = {sizeof(float) * o->n_snapshots * TD, sizeof(float) * TD};
    wk_send(w, &r->fr.from, &d, frames, sizes, 2);
}

static void do_session(wk *w, wk_req *r) {
    const proto_session_op *s = &r->msg.u.session;
    char err[512];
    k3_status st = proto_check_limits(&r->msg, &w->lim, err, sizeof err);
    const proto_ckpt *c = &r->msg.u.ckpt;
    if (!st) {
        if (r->msg.type == PROTO_MSG_CHECKPOINT)
            st = wk_sessions_checkpoint(w->sess, c->session, (int)c->pos, (int)c->keep, c->key, err,
                                        sizeof err);
        else if (r->msg.type == PROTO_MSG_RESTORE)
            st = wk_sessions_restore(w->sess, c->session, (int)c->pos, c->key, err, sizeof err);
        else if (r->msg.type == PROTO_MSG_SESSION_RESET)
            wk_sessions_reset(w->sess, s->session);
        else if (r->msg.type == PROTO_MSG_SESSION_DROP)
            wk_sessions_drop(w->sess, s->session);
        else
            st = wk_sessions_truncate(w->sess, s->session, (int)s->n_tokens, err, sizeof err);
    }
    if (st)
        wk_send_error(w, &r->fr.from, &r->msg, st, err);
    else
        reply_ok(w, r);
}

static void run_one(wk *w) {
    wk_req *r = queue_pop(w);
    if (!r) return;
    if (r->msg.epoch == w->epoch && !w->shutdown) {
        if (r->msg.type == PROTO_MSG_FORWARD)
            do_forward(w, r);
        else
            do_session(w, r);
    }
    req_free(r);
}

/* ---- setup and the loop ---- */

static k3_status wk_open_socket(wk *w, char *err, size_t errlen) {
    const wk_opts *o = w->o;
    w->ctx = zmq_ctx_new();
    if (!w->ctx)
        return k3_errf(K3_ERR_IO, err, errlen, "zmq_ctx_new: %s", zmq_strerror(zmq_errno()));
    k3_status st = K3_OK;
    if (o->curve && !o->zap_off) st = k3_zap_open(&w->zap, w->ctx, o->allow, err, errlen);
    if (st) return st;
    w->sock = zmq_socket(w->ctx, ZMQ_ROUTER);
    if (!w->sock)
        return k3_errf(K3_ERR_IO, err, errlen, "zmq_socket(ROUTER): %s", zmq_strerror(zmq_errno()));
    st = k3_link_sockopts_apply(w->sock, &o->sock, err, errlen);
    if (!st)
        st = wk_socket_budget(w->sock, wk_max_frame_bytes(w->nb_in, o->max_chunk, w->cfg->hidden),
                              err, errlen);
    if (!st && o->curve) st = k3_link_curve_server(w->sock, &o->kp, err, errlen);
    if (st) return st;
    char ep[K3_MAX_ENDPOINT + 16];
    wk_bind_endpoint(o->listen, ep, sizeof ep);
    if (zmq_bind(w->sock, ep) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "bind %s: %s", o->listen, zmq_strerror(zmq_errno()));
    return K3_OK;
}

static void wk_cleanup(wk *w) {
    while (w->q_head) req_free(queue_pop(w));
    if (w->sock) zmq_close(w->sock); /* LINGER is short: close never waits long */
    k3_zap_close(&w->zap);
    /* A signal (the SIGTERM that follows a SHUTDOWN, a second ^C) makes
     * zmq_ctx_term return EINTR while it waits for LINGER and the reaper;
     * returning then leaves libzmq's threads unjoined (ThreadSanitizer: a
     * thread leak, exit 66). It is restartable (zmq_ctx_term(3)). */
    while (w->ctx && zmq_ctx_term(w->ctx) != 0 && zmq_errno() == EINTR) {
    }
    wk_sessions_close(&w->sess);
    k3_ckpt_store_close(&w->ckpt_store);
    free(w->blocks);
    free(w->h);
}

k3_status wk_serve(k3_model *m, const wk_opts *o, volatile sig_atomic_t *stop, char *err,
                   size_t errlen) {
    wk w;
    memset(&w, 0, sizeof w);
    w.m = m;
    w.cfg = k3_model_config(m);
    w.o = o;
    w.stop = stop;
    k3_model_range(m, &w.layer_a, &w.layer_b);
    w.nb_in = k3_config_snapshots_before(w.cfg, w.layer_a);
    w.k_stage = k3_config_snapshots_before(w.cfg, w.layer_b) - w.nb_in;
    w.lim.hidden = (uint32_t)w.cfg->hidden;
    w.lim.max_ctx = (uint32_t)o->max_ctx;
    w.lim.max_chunk = (uint32_t)o->max_chunk;
    w.lim.max_blocks = K3_MAX_RES_ENTRIES;
    k3_status st = wk_sessions_open(&w.sess, m, o->max_sessions, o->max_ctx,
                                    (uint64_t)o->ckpt_mb << 20, err, errlen);
    if (!st && o->ckpt_dir && o->ckpt_dir[0]) { /* this worker's layers, parked on its disk */
        st = k3_ckpt_store_open(&w.ckpt_store, o->ckpt_dir, "--ckpt-dir", o->fingerprint, w.layer_a,
                                w.layer_b, o->ckpt_files, (uint64_t)o->ckpt_disk_mb << 20, err,
                                errlen);
        if (!st) wk_sessions_set_store(w.sess, w.ckpt_store);
        if (!st)
            K3_INFO("%s: turn checkpoints parked in %s (at most %d files, %d MiB)", o->name,
                    o->ckpt_dir, o->ckpt_files, o->ckpt_disk_mb);
    }
    if (!st) st = wk_open_socket(&w, err, errlen);
    if (st) {
        wk_cleanup(&w);
        return st;
    }
    if (o->xs) wk_xstripe_set_tick(o->xs, wk_xstripe_tick, &w, &w.cancel);
    K3_INFO("%s: serving layers [%d, %d) on %s%s (max %d sessions x %d tokens)", o->name, w.layer_a,
            w.layer_b, o->listen, o->curve ? " with CURVE" : "", o->max_sessions, o->max_ctx);
    while (!*stop && !w.shutdown) {
        if (w.q_head) {
            wk_drain(&w); /* control messages first, then the oldest work */
            run_one(&w);
            wk_heartbeat(&w);
            continue;
        }
        long timeout = 500; /* bounded: the stop flag is checked at least this often */
        if (w.epoch && o->sock.hb_ms) {
            double due = w.last_tx_ms + o->sock.hb_ms - k3_now_ms();
            timeout = due < 0 ? 0 : due < timeout ? (long)due : timeout;
        }
        zmq_pollitem_t it = {w.sock, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, timeout);
        if (rc < 0 && zmq_errno() != EINTR) {
            K3_ERROR("%s: poll: %s", o->name, zmq_strerror(zmq_errno()));
            break;
        }
        if (rc > 0) wk_drain(&w);
        wk_heartbeat(&w);
    }
    K3_INFO("%s: stopping (%s); %llu steps served, %llu malformed messages", o->name,
            w.shutdown ? "SHUTDOWN" : "signal", (unsigned long long)w.stats.forwards,
            (unsigned long long)w.stats.proto_errors);
    wk_cleanup(&w);
    return K3_OK;
}
