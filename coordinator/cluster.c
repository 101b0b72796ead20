/* coordinator/cluster.c: the cluster trunk (cluster.h): the I/O thread,
 * the links to the workers, the steps in flight, open/close and the trunk
 * operations. Types: cluster_impl.h; local workers: cluster_local.c;
 * introspection and --stats: cluster_stats.c.
 *
 * One I/O thread owns every socket. Callers (session threads) hand it a job,
 * one trunk forward call, through a mutex-protected list and an eventfd,
 * then sleep on a condition variable until the job is finished or failed.
 * The I/O thread holds the mutex whenever it is not inside zmq_poll, so all
 * state below is read and written under c->mu.
 *
 * A job is split into micro-chunks (pipelining, ARCHITECTURE.md): every
 * chunk is sent to the first stage at once (the worker queues them), and a
 * chunk moves to the next stage as soon as its FORWARD_DONE arrives, so chunk
 * k+1 is computed by stage 1 while chunk k is in stage 2, and the steps of
 * other sessions fill the gaps. Each chunk carries its own contiguous
 * (blocks, h) buffer; the caller's [nb][T][D] layout is gathered at the start
 * and scattered back at the end.
 *
 * Liveness (docs/TESTING.md 6.1, T1-T3): ZMTP heartbeats (IVL = HB, TIMEOUT =
 * TTL = 3 HB) make libzmq drop a dead or frozen peer, which the socket
 * monitor reports as DISCONNECTED; a worker that stays connected but sends
 * nothing (no reply, no HEARTBEAT) for step_timeout_ms is declared stalled.
 * Either way every job that still needs the stage fails at once, the socket
 * is closed (queued messages are discarded with it) and a new socket
 * registers again with a new epoch.
 */
#include "coordinator/cluster_impl.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/kernels/kernels.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "proto/link.h"
/* ---- small helpers (shared with the other cluster_*.c: cluster_impl.h) */

void cl_fmt(char *dst, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}

static double now_ms(void) { return k3_now_ms(); }

void cl_wake(k3_cluster *c) {
    uint64_t one = 1;
    ssize_t r = write(c->efd, &one, sizeof one);
    (void)r; /* a full counter still wakes the poll */
}

static uint64_t new_epoch(k3_cluster *c) {
    uint64_t e = (c->epoch_seed & 0xffffffff00000000ull) | (++c->epoch_ctr & 0xffffffffull);
    return e ? e : 1;
}

const char *cl_stage_label(const cl_stage *s, char *buf, size_t n) {
    if (s->a >= 0)
        cl_fmt(buf, n, "worker %s (layers [%d, %d), %s)", s->name[0] ? s->name : "?", s->a, s->b,
               s->endpoint);
    else if (s->name[0])
        cl_fmt(buf, n, "worker %s at %s", s->name, s->endpoint);
    else
        cl_fmt(buf, n, "worker at %s", s->endpoint);
    return buf;
}

/* Coordinator-side occupancy: a stage is occupied while it has requests
 * outstanding; overlap_ms is the time two or more stages were. */
static void occ_change(k3_cluster *c, cl_stage *s, int delta) {
    double t = now_ms();
    if (c->n_occupied >= 2) c->overlap_ms += t - c->occ_last_ms;
    c->occ_last_ms = t;
    int before = s->n_pending;
    s->n_pending += delta;
    if (before == 0 && s->n_pending > 0) {
        s->occ_since_ms = t;
        c->n_occupied++;
    } else if (before > 0 && s->n_pending == 0) {
        s->occupied_ms += t - s->occ_since_ms;
        c->n_occupied--;
    }
}

static void pending_add(k3_cluster *c, cl_stage *s, cl_req *r) {
    r->next = s->pending;
    s->pending = r;
    if (!r->job) return;
    if (s->n_pending == 0) s->progress_ms = now_ms(); /* the clock starts now */
    r->idle_send = s->n_pending == 0;
    occ_change(c, s, +1);
}

/* Unlinks *pp (a pending request of s) and returns it. */
static cl_req *pending_unlink(k3_cluster *c, cl_stage *s, cl_req **pp) {
    cl_req *r = *pp;
    *pp = r->next;
    if (r->job) occ_change(c, s, -1);
    return r;
}

static cl_req *pending_take(k3_cluster *c, cl_stage *s, uint64_t id) {
    for (cl_req **pp = &s->pending; *pp; pp = &(*pp)->next)
        if ((*pp)->msg.id == id) return pending_unlink(c, s, pp);
    return NULL;
}

/* ---- sending -------------------------------------------------------- */

/* Sends a request on s and records it as pending (takes r). */
static k3_status send_req(k3_cluster *c, cl_stage *s, cl_req *r, const void *const *frames,
                          const size_t *bytes, int n, char *err, size_t errlen) {
    k3_status st = proto_send(s->sock, NULL, &r->msg, frames, bytes, n, ZMQ_DONTWAIT, err, errlen);
    if (st) {
        free(r);
        return st;
    }
    r->sent_ms = s->last_tx_ms = now_ms();
    pending_add(c, s, r);
    return K3_OK;
}

/* A control request nobody waits for (RESET, DROP, CANCEL): best effort. */
static void send_control(k3_cluster *c, cl_stage *s, proto_msg *m) {
    if (s->state != LINK_READY) return;
    cl_req *r = k3_xcalloc(1, sizeof *r);
    r->msg = *m;
    char err[256];
    if (send_req(c, s, r, NULL, NULL, 0, err, sizeof err))
        K3_DEBUG("cluster: %s to %s not sent: %s", proto_type_name(m->type), s->endpoint, err);
}

/* ---- jobs ----------------------------------------------------------- */

static void job_finish(k3_cluster *c, cl_job *j) {
    for (cl_job **pp = &c->active; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    j->finished = 1;
    j->sess->busy = 0;
    pthread_cond_broadcast(&c->cv);
}

/* Fails a job: forgets its requests everywhere (late replies are dropped),
 * asks the workers that still hold some to cancel them, and marks the
 * session broken (its workers advanced by different amounts). */
static void job_fail(k3_cluster *c, cl_job *j, k3_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void job_fail(k3_cluster *c, cl_job *j, k3_status st, const char *fmt, ...) {
    if (j->finished) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->err, sizeof j->err, fmt, ap);
    va_end(ap);
    j->st = st ? st : K3_ERR_INTERNAL;
    for (int i = 0; i < c->n; i++) {
        cl_stage *s = &c->st[i];
        int had = 0;
        for (cl_req **pp = &s->pending; *pp;) {
            if ((*pp)->job == j) {
                free(pending_unlink(c, s, pp));
                had = 1;
            } else {
                pp = &(*pp)->next;
            }
        }
        if (had) {
            proto_msg m;
            proto_msg_init(&m, PROTO_MSG_CANCEL, ++c->next_id, s->epoch);
            m.u.cancel.session = j->sess->id;
            send_control(c, s, &m);
        }
    }
    if (j->started) j->sess->broken = 1;
    job_finish(c, j);
}

static void ctl_finish(k3_cluster *c, cl_ctl *x, k3_status st, const char *msg) {
    x->st = st;
    if (msg) cl_fmt(x->err, sizeof x->err, "%s", msg);
    x->done = 1;
    pthread_cond_broadcast(&c->cv);
}

/* ---- links ---------------------------------------------------------- */

static void link_close(cl_stage *s) {
    if (s->sock) zmq_socket_monitor(s->sock, NULL, 0);
    if (s->mon) zmq_close(s->mon);
    if (s->sock) zmq_close(s->sock);
    s->sock = s->mon = NULL;
}

/* Declares the link lost: fails every job that still needs this stage and
 * every control request on it, then closes the socket; the next iteration
 * registers again. */
static void link_fail(k3_cluster *c, cl_stage *s, const char *why) {
    char lab[512], reason[512];
    cl_fmt(reason, sizeof reason, "%s", why); /* why may be s->last_err */
    why = reason;
    cl_stage_label(s, lab, sizeof lab);
    if (s->state == LINK_READY) {
        K3_ERROR("cluster: %s lost: %s", lab, why);
        s->failures++;
        c->losses++;
    }
    cl_fmt(s->last_err, sizeof s->last_err, "%s", why);
    int pos = -1; /* our place in the layer order */
    for (int i = 0; c->ordered && i < c->n; i++)
        if (c->order[i] == s - c->st) pos = i;
    /* jobs: any chunk that has not passed this stage needs it */
    for (cl_job *j = c->active, *next; j; j = next) {
        next = j->next;
        int needs = 0;
        for (int k = 0; k < j->n_chunks && !needs; k++) needs = j->chunk[k].pos <= pos;
        if (needs && j->started) job_fail(c, j, K3_ERR_IO, "%s lost: %s", lab, why);
    }
    while (s->pending) {
        cl_req *r = pending_unlink(c, s, &s->pending);
        if (r->ctl) ctl_finish(c, r->ctl, K3_ERR_IO, why);
        free(r);
    }
    link_close(s);
    s->state = LINK_DOWN;
    s->next_try_ms = now_ms() + c->o.retry.lost_ms;
    pthread_cond_broadcast(&c->cv);
}

/* New socket, monitor, connect, HELLO with a new epoch. */
static void link_open(k3_cluster *c, cl_stage *s) {
    char err[512], ep[96];
    s->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    k3_status st = s->sock ? K3_OK : K3_ERR_IO;
    if (st) cl_fmt(err, sizeof err, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    if (!st) st = k3_link_sockopts_apply(s->sock, &c->so, err, sizeof err);
    if (!st && s->server_key[0])
        st = k3_link_curve_client(s->sock, &c->kp, s->server_key, err, sizeof err);
    if (!st) {
        cl_fmt(ep, sizeof ep, "inproc://k3mon.%p.%d", (void *)s, ++s->gen);
        if (zmq_socket_monitor(
                s->sock, ep,
                ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED |
                    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                    ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0 ||
            !(s->mon = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(s->mon, ep) != 0) {
            st = K3_ERR_IO;
            cl_fmt(err, sizeof err, "socket monitor: %s", zmq_strerror(zmq_errno()));
        }
    }
    if (!st && zmq_connect(s->sock, s->endpoint) != 0) {
        st = K3_ERR_IO;
        cl_fmt(err, sizeof err, "connect %s: %s", s->endpoint, zmq_strerror(zmq_errno()));
    }
    cl_req *r = NULL;
    if (!st) {
        r = k3_xcalloc(1, sizeof *r);
        s->epoch = new_epoch(c);
        proto_msg_init(&r->msg, PROTO_MSG_HELLO, ++c->next_id, s->epoch);
        r->msg.u.hello.fingerprint = c->fp;
        r->msg.u.hello.num = c->num;
        cl_fmt(r->msg.u.hello.build, sizeof r->msg.u.hello.build, "%s", k3_link_build());
        st = send_req(c, s, r, NULL, NULL, 0, err, sizeof err);
    }
    if (st) {
        cl_fmt(s->last_err, sizeof s->last_err, "%s", err);
        link_close(s);
        s->state = LINK_DOWN;
        s->next_try_ms = now_ms() + c->o.retry.open_ms;
        return;
    }
    s->state = LINK_HELLO;
    s->hello_sent_ms = now_ms();
}

/* How long a HELLO may wait for its answer before the socket is replaced. */
static double hello_timeout_ms(const k3_cluster *c) {
    double t = 2.0 * K3_LINK_LIVENESS * c->so.hb_ms;
    return t < c->o.retry.hello_min_ms ? c->o.retry.hello_min_ms : t;
}

static void on_hello_ok(k3_cluster *c, cl_stage *s, const proto_msg *m) {
    const proto_hello_ok *h = &m->u.hello_ok;
    char err[512], lab[512];
    if (s->a < 0) cl_fmt(s->name, sizeof s->name, "%s", h->name); /* for the messages below */
    s->ver_minor = m->ver_major == PROTO_VERSION_MAJOR ? m->ver_minor : 0;
    k3_status st = proto_check_compat(c->fp, &c->num, h->fingerprint, &h->num, err, sizeof err);
    if (!st)
        st = k3_link_check_build(k3_link_build(), "coordinator", h->build, "worker", err,
                                 sizeof err);
    if (!st && (int)h->layers[1] > c->cfg.n_layers)
        st =
            k3_errf(K3_ERR_MISMATCH, err, sizeof err, "layers [%u, %u) outside the model's [0, %d)",
                    h->layers[0], h->layers[1], c->cfg.n_layers);
    for (int j = 0; j < c->n && !st && h->stripe; j++) { /* cross-worker striping */
        cl_stage *o = &c->st[j];
        uint32_t both = o != s && o->state == LINK_READY ? h->stripe & o->info.stripe : 0;
        if (both)
            st = k3_errf(K3_ERR_MISMATCH, err, sizeof err,
                         "stripe of drive %d claimed twice: by worker %s (%s) and by worker %s "
                         "(%s)",
                         __builtin_ctz(both), o->name, o->endpoint, h->name, s->endpoint);
    }
    if (!st && c->ordered && ((int)h->layers[0] != s->a || (int)h->layers[1] != s->b))
        st = k3_errf(K3_ERR_MISMATCH, err, sizeof err,
                     "came back serving layers [%u, %u), it served [%d, %d)", h->layers[0],
                     h->layers[1], s->a, s->b);
    if (st) {
        cl_fmt(s->last_err, sizeof s->last_err, "refused: %s", err);
        K3_ERROR("cluster: worker %s at %s refused: %s", h->name, s->endpoint, err);
        s->refused = 1;
        link_close(s);
        s->state = LINK_DOWN;
        s->next_try_ms = now_ms() + c->o.retry.refused_ms;
        pthread_cond_broadcast(&c->cv);
        return;
    }
    s->info = *h;
    s->a = (int)h->layers[0];
    s->b = (int)h->layers[1];
    s->k = k3_config_snapshots_before(&c->cfg, s->b) - k3_config_snapshots_before(&c->cfg, s->a);
    cl_fmt(s->name, sizeof s->name, "%s", h->name);
    s->state = LINK_READY;
    s->refused = 0;
    s->registered_since_spawn = 1;
    s->last_err[0] = 0;
    K3_INFO("cluster: %s registered (epoch %llx, %u sessions x %u tokens, drive %.2f GB/s, "
            "build '%s')",
            cl_stage_label(s, lab, sizeof lab), (unsigned long long)s->epoch, h->max_sessions,
            h->max_ctx, h->read_gbps, h->build);
    /* Another ISA level is accepted (proto_check_compat does not compare
     * it: every kernel gives the same bits at every level); a mixed
     * cluster is said once per registration. */
    if (h->num.isa != c->num.isa)
        K3_WARN("cluster: %s runs ISA level %s, this coordinator %s (same bits at every level)",
                cl_stage_label(s, lab, sizeof lab), k3_isa_name((k3_isa)h->num.isa),
                k3_isa_name((k3_isa)c->num.isa));
    pthread_cond_broadcast(&c->cv);
}

/* ---- the forward path ------------------------------------------------- */

static k3_status send_chunk(k3_cluster *c, cl_job *j, int ci) {
    cl_chunk *ch = &j->chunk[ci];
    cl_stage *s = &c->st[c->order[ch->pos]];
    char err[512], lab[512];
    if (s->state != LINK_READY || s->epoch != j->sess->epoch[ch->pos]) {
        j->sess->lost = 1;
        job_fail(c, j, K3_ERR_STATE, "%s: %s", cl_stage_label(s, lab, sizeof lab),
                 s->state != LINK_READY ? "not registered" : "re-registered mid-step");
        return K3_ERR_STATE;
    }
    cl_req *r = k3_xcalloc(1, sizeof *r);
    proto_msg_init(&r->msg, PROTO_MSG_FORWARD, ++c->next_id, s->epoch);
    proto_forward *f = &r->msg.u.forward;
    f->session = j->sess->id;
    f->step = ch->step;
    f->pos0 = (uint32_t)(j->pos0 + ch->t0);
    f->n_tokens = (uint32_t)ch->T;
    f->n_blocks = (uint32_t)ch->nb;
    f->hidden = (uint32_t)c->D;
    f->flags = PROTO_FWD_STATS;
    r->job = j;
    r->chunk = ci;
    size_t TD = (size_t)ch->T * (size_t)c->D;
    const void *frames[2] = {ch->blocks, ch->h};
    size_t bytes[2] = {sizeof(float) * (size_t)ch->nb * TD, sizeof(float) * TD};
    k3_status st = send_req(c, s, r, frames, bytes, 2, err, sizeof err);
    if (!st) s->tx_bytes += bytes[0] + bytes[1];
    if (st) {
        if (st == K3_ERR_IO)
            link_fail(c, s, err);
        else
            job_fail(c, j, st, "%s: %s", cl_stage_label(s, lab, sizeof lab), err);
    }
    return st;
}

/* Scatters the chunks back into the caller's layout. */
static void job_complete(k3_cluster *c, cl_job *j) {
    size_t D = (size_t)c->D;
    for (int k = 0; k < j->n_chunks; k++) {
        cl_chunk *ch = &j->chunk[k];
        size_t TD = (size_t)ch->T * D;
        for (int b = 0; b < ch->nb; b++)
            memcpy(j->blocks + ((size_t)b * j->T + ch->t0) * D, ch->blocks + (size_t)b * TD,
                   sizeof(float) * TD);
        memcpy(j->h + (size_t)ch->t0 * D, ch->h, sizeof(float) * TD);
    }
    j->nb_out = j->chunk[0].nb;
    j->sess->pos += j->T;
    j->st = K3_OK;
    job_finish(c, j);
}

static void on_forward_done(k3_cluster *c, cl_stage *s, cl_req *r, const proto_msg *m,
                            proto_frames *fr) {
    cl_job *j = r->job;
    cl_chunk *ch = &j->chunk[r->chunk];
    const proto_forward_done *d = &m->u.forward_done;
    char lab[512];
    if ((int)d->n_snapshots != s->k || ch->nb + s->k > j->nb_cap) {
        s->bad_replies++;
        job_fail(c, j, K3_ERR_PROTO, "%s: FORWARD_DONE with %u snapshots, layers [%d, %d) take %d",
                 cl_stage_label(s, lab, sizeof lab), d->n_snapshots, s->a, s->b, s->k);
        return;
    }
    size_t TD = (size_t)ch->T * (size_t)c->D, n0, n1;
    const void *snap = proto_frames_data(fr, 0, &n0);
    const void *hid = proto_frames_data(fr, 1, &n1);
    if (n0) memcpy(ch->blocks + (size_t)ch->nb * TD, snap, n0);
    memcpy(ch->h, hid, n1);
    ch->nb += s->k;
    s->rx_bytes += n0 + n1;
    if (j->trace_h)
        memcpy(j->trace_h + ((size_t)ch->pos * j->T + ch->t0) * c->D, ch->h, sizeof(float) * TD);
    /* statistics */
    double rtt = now_ms() - r->sent_ms;
    s->forwards++;
    s->tokens += (uint64_t)ch->T;
    if (d->has_stats) {
        s->busy_ms += d->compute_ms;
        s->read_ms += d->read_ms;
        s->bytes_read += d->bytes_read;
        s->hits += d->expert_hits;
        s->misses += d->expert_misses;
        cl_stage_add_drives(s, d);
        cl_stage_add_vk(s, d);
        /* transport cost of one hop; a step that queued behind others on
         * the worker would count its wait, so only idle sends are measured */
        double hop = rtt - d->compute_ms - d->read_ms;
        if (r->idle_send) {
            s->hop_ms += hop > 0 ? hop : 0;
            s->hop_n++;
        }
        j->stats.compute_ms += d->compute_ms;
        j->stats.read_ms += d->read_ms;
        j->stats.bytes_read += d->bytes_read;
        j->stats.expert_hits += d->expert_hits;
        j->stats.expert_misses += d->expert_misses;
    }
    /* states this step evicted on the worker are gone: those sessions
     * must be replayed before their next step */
    for (uint32_t e = 0; e < d->n_evicted; e++)
        for (cl_sess *x = c->sessions; x; x = x->next)
            if (x->id == d->evicted[e] && x != j->sess) x->lost = 1;
    ch->pos++;
    if (ch->pos < c->n) {
        send_chunk(c, j, r->chunk);
        return;
    }
    if (++j->chunks_done == j->n_chunks) job_complete(c, j);
}

static void on_reply(k3_cluster *c, cl_stage *s, proto_msg *m, proto_frames *fr) {
    char err[512], lab[512];
    cl_req *r = pending_take(c, s, m->id);
    if (!r) { /* a late reply of a failed or cancelled step, or foreign */
        s->dropped++;
        K3_DEBUG("cluster: dropped %s id %llu from %s (not pending)", proto_type_name(m->type),
                 (unsigned long long)m->id, s->endpoint);
        return;
    }
    k3_status st = proto_check_reply(&r->msg, m, err, sizeof err);
    if (st) {
        s->bad_replies++;
        K3_WARN("cluster: bad reply from %s: %s", cl_stage_label(s, lab, sizeof lab), err);
        if (r->job) job_fail(c, r->job, K3_ERR_PROTO, "%s: bad reply: %s", lab, err);
        if (r->ctl) ctl_finish(c, r->ctl, K3_ERR_PROTO, err);
        if (r->msg.type == PROTO_MSG_HELLO) link_fail(c, s, err);
        free(r);
        return;
    }
    switch (m->type) {
    case PROTO_MSG_HELLO_OK: on_hello_ok(c, s, m); break;
    case PROTO_MSG_FORWARD_DONE: on_forward_done(c, s, r, m, fr); break;
    case PROTO_MSG_STATS_OK:
        if (r->ctl) {
            r->ctl->stats = m->u.stats_ok;
            ctl_finish(c, r->ctl, K3_OK, NULL);
        }
        break;
    case PROTO_MSG_OK:
        if (r->ctl) ctl_finish(c, r->ctl, K3_OK, NULL);
        break;
    case PROTO_MSG_ERROR: {
        k3_status code = (k3_status)m->u.error.code;
        cl_stage_label(s, lab, sizeof lab);
        if (r->msg.type == PROTO_MSG_HELLO) {
            cl_fmt(s->last_err, sizeof s->last_err, "refused: %s", m->u.error.msg);
            K3_ERROR("cluster: %s refused registration: %s", lab, m->u.error.msg);
            s->refused = 1;
            link_close(s);
            s->state = LINK_DOWN;
            s->next_try_ms = now_ms() + c->o.retry.refused_ms;
            pthread_cond_broadcast(&c->cv);
        } else if (r->job) {
            if (code == K3_ERR_STATE) r->job->sess->lost = 1;
            job_fail(c, r->job, code, "%s: %s", lab, m->u.error.msg);
        } else if (r->ctl) {
            ctl_finish(c, r->ctl, code, m->u.error.msg);
        } else {
            K3_DEBUG("cluster: %s answered %s with ERROR: %s", lab, proto_type_name(r->msg.type),
                     m->u.error.msg);
        }
        break;
    }
    default: /* proto_check_reply only lets reply types through */ break;
    }
    free(r);
}

/* Reads every message waiting on s. */
static void link_read(k3_cluster *c, cl_stage *s) {
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    while (s->sock) {
        proto_msg m;
        char err[512];
        k3_status st = proto_recv(s->sock, ZMQ_DONTWAIT, &m, &fr, err, sizeof err);
        if (st == K3_ERR_TIMEOUT || st == K3_ERR_CANCEL) break;
        if (st == K3_ERR_IO) {
            link_fail(c, s, err);
            break;
        }
        s->last_rx_ms = now_ms(); /* any message is a sign of life */
        if (st) {                 /* consumed and rejected: logged, counted, never answered */
            s->bad_replies++;
            K3_WARN("cluster: malformed message from %s dropped: %s", s->endpoint, err);
            continue;
        }
        if (m.type == PROTO_MSG_ERROR && m.id == 0 && s->state == LINK_READY &&
            m.epoch == s->epoch) {
            /* unsolicited: another coordinator registered (PROTOCOL.md
             * "Displacement"); taking the worker back would only displace
             * it in turn, so this link stays down */
            char why[640];
            cl_fmt(why, sizeof why, "taken over by another coordinator: %s", m.u.error.msg);
            link_fail(c, s, why);
            s->refused = s->displaced = 1;
            break;
        }
        if (m.type == PROTO_MSG_HEARTBEAT) {
            /* progress: its compute loop is inside one of our steps (it
             * sends this between layers; a stuck thread does not) */
            uint64_t busy = m.u.heartbeat.busy_request;
            for (cl_req *r = s->pending; busy && r; r = r->next)
                if (r->msg.id == busy) s->progress_ms = s->last_rx_ms;
            continue;
        }
        s->progress_ms = s->last_rx_ms;
        on_reply(c, s, &m, &fr);
    }
    proto_frames_close(&fr);
}

static void io_reap_local(k3_cluster *c);

/* Socket monitor events: the fast path for a dead peer. */
static void link_events(k3_cluster *c, cl_stage *s) {
    while (s->mon) {
        const int ev = k3_link_monitor_event(s->mon);
        if (ev < 0) return;
        char why[256];
        switch (ev) {
        case ZMQ_EVENT_DISCONNECTED:
            /* a local worker's process gone: its exit status says more */
            if (c->ordered && c->o.n_workers == 0 && s->pid) {
                pid_t before = s->pid;
                io_reap_local(c);
                if (s->pid != before) break; /* reaped: the link failed with the status */
            }
            cl_fmt(why, sizeof why,
                   "connection closed (process gone, or no heartbeat answer for %d ms)",
                   c->so.hb_ms * K3_LINK_LIVENESS);
            if (s->state == LINK_READY)
                link_fail(c, s, why);
            else if (strncmp(s->last_err, "cannot authenticate", 19)) /* keep the CURVE reason */
                cl_fmt(s->last_err, sizeof s->last_err, "%s", why);
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
            cl_fmt(why, sizeof why,
                   "cannot authenticate: the worker refused our CURVE key (not on its "
                   "allow-list)");
            goto handshake;
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            cl_fmt(why, sizeof why,
                   "cannot authenticate: handshake failed (wrong server key, or CURVE on one "
                   "side only)");
        handshake:
            cl_fmt(s->last_err, sizeof s->last_err, "%s", why);
            K3_WARN("cluster: worker at %s: %s", s->endpoint, why);
            if (s->state == LINK_READY)
                link_fail(c, s, why);
            else
                s->refused = 1;
            pthread_cond_broadcast(&c->cv);
            break;
        default: break;
        }
    }
}

/* ---- the I/O thread --------------------------------------------------- */

static int all_ready(const k3_cluster *c) {
    for (int i = 0; i < c->n; i++)
        if (c->st[i].state != LINK_READY) return 0;
    return 1;
}

/* Starts a job: session checks, gather into chunks, all chunks to stage 0.
 * Returns 0 when it must wait for workers to register. */
static int job_start(k3_cluster *c, cl_job *j) {
    cl_sess *x = j->sess;
    char lab[512];
    if (!all_ready(c)) {
        if (now_ms() < j->wait_until_ms) return 0;
        for (int i = 0; i < c->n; i++)
            if (c->st[i].state != LINK_READY) {
                job_fail(c, j, K3_ERR_IO, "%s is not available: %s",
                         cl_stage_label(&c->st[i], lab, sizeof lab),
                         c->st[i].last_err[0] ? c->st[i].last_err : "not registered");
                return 1;
            }
    }
    if (x->reset_pending) {
        for (int p = 0; p < c->n && x->used; p++) {
            cl_stage *s = &c->st[c->order[p]];
            proto_msg m;
            proto_msg_init(&m, PROTO_MSG_SESSION_RESET, ++c->next_id, s->epoch);
            m.u.session.session = x->id;
            send_control(c, s, &m);
        }
        x->pos = 0;
        x->broken = x->lost = x->reset_pending = 0;
    }
    if (x->broken) {
        job_fail(c, j, K3_ERR_STATE,
                 "cluster: session state unusable after a failed step; reset it");
        return 1;
    }
    if (j->pos0 != x->pos) {
        job_fail(c, j, K3_ERR_STATE, "cluster: step starts at position %d, the session is at %d",
                 j->pos0, x->pos);
        return 1;
    }
    for (int p = 0; p < c->n; p++) {
        cl_stage *s = &c->st[c->order[p]];
        if (x->pos == 0) x->epoch[p] = s->epoch; /* fresh state on every worker */
        if (x->pos > 0 && (x->lost || x->epoch[p] != s->epoch)) {
            x->lost = 1;
            job_fail(c, j, K3_ERR_STATE,
                     "cluster: session state lost on %s (evicted, or the worker re-registered); "
                     "reset and replay",
                     cl_stage_label(s, lab, sizeof lab));
            return 1;
        }
        if ((int64_t)j->pos0 + j->T > (int64_t)s->info.max_ctx) {
            job_fail(c, j, K3_ERR_LIMIT, "%s: positions [%d, %d) exceed its %u-token context",
                     cl_stage_label(s, lab, sizeof lab), j->pos0, j->pos0 + j->T, s->info.max_ctx);
            return 1;
        }
    }
    /* micro-chunks */
    int piece = c->o.pipe_chunk;
    if (piece <= 0) {
        piece = (j->T + c->n - 1) / c->n;
        if (piece < 8) piece = 8;
    }
    j->n_chunks = (j->T + piece - 1) / piece;
    j->chunk = k3_xcalloc((size_t)j->n_chunks, sizeof *j->chunk);
    j->nb_cap = j->nb_in + k3_config_snapshots_before(&c->cfg, c->cfg.n_layers);
    size_t D = (size_t)c->D;
    j->buf = malloc(sizeof(float) * (size_t)(j->nb_cap + 1) * (size_t)j->T * D);
    if (!j->buf) {
        job_fail(c, j, K3_ERR_NOMEM, "cluster: cannot allocate step buffers for T=%d", j->T);
        return 1;
    }
    j->started = 1;
    x->used = 1;
    for (int k = 0; k < j->n_chunks; k++) {
        cl_chunk *ch = &j->chunk[k];
        ch->t0 = k * piece;
        ch->T = j->T - ch->t0 < piece ? j->T - ch->t0 : piece;
        ch->blocks = j->buf + (size_t)(j->nb_cap + 1) * (size_t)ch->t0 * D;
        ch->h = ch->blocks + (size_t)j->nb_cap * (size_t)ch->T * D;
        ch->nb = j->nb_in;
        ch->step = ++x->step;
        size_t TD = (size_t)ch->T * D;
        for (int b = 0; b < j->nb_in; b++)
            memcpy(ch->blocks + (size_t)b * TD, j->blocks + ((size_t)b * j->T + ch->t0) * D,
                   sizeof(float) * TD);
        memcpy(ch->h, j->h + (size_t)ch->t0 * D, sizeof(float) * TD);
    }
    for (int k = 0; k < j->n_chunks && !j->finished; k++) send_chunk(c, j, k);
    return 1;
}

static void handle_ctl(k3_cluster *c, cl_ctl *x) {
    cl_stage *s = &c->st[c->order[x->stage]];
    char err[512];
    if (x->owned) { /* a session's slot to free: pointless after a new epoch */
        if (s->state == LINK_READY && s->epoch == x->epoch) {
            proto_msg m;
            proto_msg_init(&m, x->type, ++c->next_id, s->epoch);
            m.u.session.session = x->session;
            send_control(c, s, &m);
        }
        free(x);
        return;
    }
    if (s->state != LINK_READY) {
        ctl_finish(c, x, K3_ERR_IO, "worker not registered");
        return;
    }
    int ck = x->type == PROTO_MSG_CHECKPOINT || x->type == PROTO_MSG_RESTORE;
    if (ck && s->epoch != x->epoch) {
        ctl_finish(c, x, K3_ERR_STATE, "the worker re-registered: the session's state is gone");
        return;
    }
    cl_req *r = k3_xcalloc(1, sizeof *r);
    proto_msg_init(&r->msg, x->type, ++c->next_id, s->epoch);
    if (ck) /* cluster_ckpt.c */
        r->msg.u.ckpt =
            (proto_ckpt){.session = x->session, .pos = x->n, .keep = x->keep, .key = x->key};
    r->ctl = x;
    if (send_req(c, s, r, NULL, NULL, 0, err, sizeof err)) ctl_finish(c, x, K3_ERR_IO, err);
}

/* Timers: registration attempts, HELLO timeouts, stalls, heartbeats. */
static void link_timers(k3_cluster *c, cl_stage *s, double t) {
    char why[256];
    switch (s->state) {
    case LINK_DOWN:
        if (t >= s->next_try_ms && !s->displaced) link_open(c, s);
        break;
    case LINK_HELLO:
        if (t - s->hello_sent_ms > hello_timeout_ms(c)) {
            if (!s->last_err[0] || !strncmp(s->last_err, "no HELLO_OK", 11))
                cl_fmt(s->last_err, sizeof s->last_err, "no HELLO_OK within %.0f ms",
                       hello_timeout_ms(c));
            link_fail(c, s, s->last_err);
            s->next_try_ms = t; /* at once: a fresh socket */
        }
        break;
    case LINK_READY:
        /* The step deadline. With steps pending, only progress counts: a
         * reply, or a heartbeat from the compute loop naming one of our
         * steps; an idle heartbeat with our steps pending means the worker
         * lost them. Without steps, any message counts. */
        if (s->n_pending > 0 && t - s->progress_ms > c->o.step_timeout_ms) {
            cl_fmt(why, sizeof why,
                   "stalled: %d step(s) pending without progress for %.0f ms (step deadline %d ms)",
                   s->n_pending, t - s->progress_ms, c->o.step_timeout_ms);
            link_fail(c, s, why);
        } else if (t - s->last_rx_ms > c->o.step_timeout_ms) {
            cl_fmt(why, sizeof why, "stalled: no message for %.0f ms (step deadline %d ms)",
                   t - s->last_rx_ms, c->o.step_timeout_ms);
            link_fail(c, s, why);
        } else if (t - s->last_tx_ms >= c->so.hb_ms) {
            proto_msg hb;
            proto_msg_init(&hb, PROTO_MSG_HEARTBEAT, 0, s->epoch);
            char err[256];
            if (proto_send(s->sock, NULL, &hb, NULL, NULL, 0, ZMQ_DONTWAIT, err, sizeof err))
                K3_DEBUG("cluster: heartbeat to %s: %s", s->endpoint, err);
            s->last_tx_ms = t;
        }
        break;
    }
}

/* The I/O thread runs in five steps, each with c->mu held: the local
 * workers are started (once), then each turn fires the timers, takes new
 * work (io_take_work), polls every socket with the mutex released
 * (io_poll_set, io_poll_timeout) and reads what arrived (io_dispatch);
 * when stopping, io_shutdown fails what is left. */

/* --local N: starts the workers from this thread, which outlives them (the
 * parent-death signal follows the thread). A failed start is reported to
 * k3_cluster_open, and the thread parks until the cluster closes. */
static void io_spawn_local(k3_cluster *c) {
    c->spawn_st = cl_local_start(c, c->spawn_err, sizeof c->spawn_err);
    c->spawn_pending = 0;
    pthread_cond_broadcast(&c->cv);
    while (c->spawn_st && !c->stopping) pthread_cond_wait(&c->cv, &c->mu); /* open fails */
}

/* --local, once open: a worker process that ended is seen here within a
 * quarter heartbeat (waitpid), not after the link's timeouts. Its steps
 * fail at once with the exit status named (k3_cluster_generate then
 * resumes by replay), and a worker that had registered is started again
 * with the same layers and endpoint; one that died before registering is
 * not (a crash loop), which fails the resume's wait at once. */
static void io_reap_local(k3_cluster *c) {
    char why[768];
    for (int i = 0; i < c->n; i++) {
        int r = cl_local_reap(c, i, why, sizeof why);
        if (!r) continue;
        cl_stage *s = &c->st[i];
        K3_ERROR("cluster: %s", why);
        link_fail(c, s, why);
        if (r < 0) s->refused = 1;
    }
}

/* Moves new jobs to the active list, starts those that can start, and
 * sends the control requests callers queued. */
static void io_take_work(k3_cluster *c) {
    while (c->incoming) {
        cl_job *j = c->incoming;
        c->incoming = j->next;
        j->next = c->active;
        c->active = j;
    }
    for (cl_job *j = c->active, *next; j; j = next) {
        next = j->next;
        if (j->cancel_req && !j->finished) /* CANCEL to the workers that hold a piece */
            job_fail(c, j, K3_ERR_CANCEL, "cluster: step cancelled by the caller");
        else if (!j->started && !j->finished)
            job_start(c, j);
    }
    while (c->ctl_in) {
        cl_ctl *x = c->ctl_in;
        c->ctl_in = x->next;
        handle_ctl(c, x);
    }
}

/* The poll set: the eventfd, then every open socket and monitor; who[k] is
 * -1 for the eventfd, i for stage i's socket, n + i for its monitor.
 * items and who have room for 2 n + 1. Returns the number of items. */
static int io_poll_set(const k3_cluster *c, zmq_pollitem_t *items, int *who) {
    int n = 0;
    items[n] = (zmq_pollitem_t){NULL, c->efd, ZMQ_POLLIN, 0};
    who[n++] = -1;
    for (int i = 0; i < c->n; i++) {
        if (c->st[i].sock) {
            items[n] = (zmq_pollitem_t){c->st[i].sock, 0, ZMQ_POLLIN, 0};
            who[n++] = i;
        }
        if (c->st[i].mon) {
            items[n] = (zmq_pollitem_t){c->st[i].mon, 0, ZMQ_POLLIN, 0};
            who[n++] = c->n + i;
        }
    }
    return n;
}

/* A quarter heartbeat, so the timers fire on time; 20 ms at most while a
 * job waits for workers to register (job_start retries each turn). */
static long io_poll_timeout(const k3_cluster *c) {
    long timeout = c->so.hb_ms / 4;
    for (cl_job *j = c->active; j; j = j->next)
        if (!j->started) timeout = timeout > 20 ? 20 : timeout;
    return timeout;
}

/* Reads every item the poll marked readable. */
static void io_dispatch(k3_cluster *c, const zmq_pollitem_t *items, const int *who, int n) {
    for (int k = 0; k < n; k++) {
        if (!(items[k].revents & ZMQ_POLLIN)) continue;
        if (who[k] < 0) {
            uint64_t v;
            ssize_t r = read(c->efd, &v, sizeof v);
            (void)r;
        } else if (who[k] < c->n) {
            link_read(c, &c->st[who[k]]);
        } else {
            link_events(c, &c->st[who[k] - c->n]);
        }
    }
}

/* How long io_shutdown waits for the local workers it sent SHUTDOWN to close
 * their end: a worker replies OK and closes at once (measured 0.5-5 ms in
 * test_cluster), and cl_local_stop's SIGTERM follows anyway. */
#define CL_CLOSE_WAIT_MS 3000

/* Stopping: fails what is left, says goodbye to local workers, closes every
 * socket. */
static void io_shutdown(k3_cluster *c) {
    while (c->incoming) {
        cl_job *j = c->incoming;
        c->incoming = j->next;
        j->next = c->active;
        c->active = j;
    }
    while (c->active) job_fail(c, c->active, K3_ERR_CANCEL, "cluster: closing");
    while (c->ctl_in) {
        cl_ctl *x = c->ctl_in;
        c->ctl_in = x->next;
        if (x->owned)
            free(x);
        else
            ctl_finish(c, x, K3_ERR_CANCEL, "cluster: closing");
    }
    /* the sockets told SHUTDOWN, and their monitors; NULL for the others */
    void **socks = k3_xcalloc((size_t)c->n, sizeof *socks);
    void **mons = k3_xcalloc((size_t)c->n, sizeof *mons);
    for (int i = 0; i < c->n; i++) {
        cl_stage *s = &c->st[i];
        if (s->pid && s->state == LINK_READY) {
            proto_msg m;
            proto_msg_init(&m, PROTO_MSG_SHUTDOWN, ++c->next_id, s->epoch);
            send_control(c, s, &m);
            socks[i] = s->sock, mons[i] = s->mon;
        }
        while (s->pending) {
            cl_req *r = s->pending;
            s->pending = r->next;
            if (r->ctl) ctl_finish(c, r->ctl, K3_ERR_CANCEL, "cluster: closing");
            free(r);
        }
        s->n_pending = 0;
    }
    /* Close after the workers (k3_link_await_peer_close, proto/link.h): their
     * OK, or a HEARTBEAT sent before they read the SHUTDOWN, must not reach
     * a socket already closing. c->mu stays held: nothing may start on a
     * closing cluster. */
    k3_link_await_peer_close(socks, mons, c->n, CL_CLOSE_WAIT_MS);
    for (int i = 0; i < c->n; i++) {
        if (socks[i]) {
            int linger = 200; /* a worker that did not close in time still gets it */
            zmq_setsockopt(socks[i], ZMQ_LINGER, &linger, sizeof linger);
        }
        link_close(&c->st[i]);
    }
    free(socks);
    free(mons);
}

static void *io_main(void *arg) {
    k3_cluster *c = arg;
    zmq_pollitem_t *items = k3_xcalloc((size_t)(2 * c->n + 1), sizeof *items);
    int *who = k3_xcalloc((size_t)(2 * c->n + 1), sizeof *who);
    pthread_mutex_lock(&c->mu);
    if (c->spawn_pending) io_spawn_local(c);
    while (!c->stopping) {
        double t = now_ms();
        if (c->ordered && c->o.n_workers == 0) io_reap_local(c);
        for (int i = 0; i < c->n; i++) link_timers(c, &c->st[i], t);
        io_take_work(c);
        int n = io_poll_set(c, items, who);
        long timeout = io_poll_timeout(c);
        pthread_mutex_unlock(&c->mu);
        int rc = zmq_poll(items, n, timeout);
        pthread_mutex_lock(&c->mu);
        if (rc < 0 && zmq_errno() != EINTR) {
            K3_ERROR("cluster: poll: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (rc > 0) io_dispatch(c, items, who, n);
    }
    io_shutdown(c);
    pthread_mutex_unlock(&c->mu);
    free(items);
    free(who);
    return NULL;
}

/* ---- open / close --------------------------------------------------- */

void k3_cluster_opts_from_cli(k3_cluster_opts *co, const k3_cluster_cli *c) {
    co->workers = (const char *const *)c->workers.items;
    co->n_workers = c->workers.n;
    co->local = c->workers.n ? 0 : c->local;
    co->hb_ms = c->hb_ms;
    co->step_timeout_ms = c->step_timeout_ms;
    co->insecure = c->insecure;
    co->curve_secret = c->curve_secret;
    co->worker_keys = c->worker_keys;
    co->worker_bin = c->worker_bin;
    co->retry = c->retry;
    co->ready_timeout_ms = c->ready_timeout_ms;
}

void k3_cluster_opts_default(k3_cluster_opts *o) {
    memset(o, 0, sizeof *o);
    o->local = 2;
    o->hb_ms = K3_LINK_HB_MS_DEFAULT;
    o->step_timeout_ms = K3_CLUSTER_STEP_TIMEOUT_MS;
    o->ready_timeout_ms = K3_CLUSTER_READY_TIMEOUT_MS;
    o->request_wait_ms = -1; /* TTL */
    o->retry = (k3_cluster_retry){.lost_ms = K3_CLUSTER_RETRY_LOST_MS,
                                  .open_ms = K3_CLUSTER_RETRY_OPEN_MS,
                                  .refused_ms = K3_CLUSTER_RETRY_REFUSED_MS,
                                  .hello_min_ms = K3_CLUSTER_HELLO_MIN_MS,
                                  .handshake_ms = K3_LINK_HANDSHAKE_MS_DEFAULT,
                                  .resumes = K3_CLUSTER_RESUMES,
                                  .resume_wait_ms = K3_CLUSTER_RESUME_WAIT_MS};
}

/* Sorts ready stages by layer range and checks [0, n_layers) is covered
 * exactly once. */
static k3_status check_coverage(k3_cluster *c, char *err, size_t errlen) {
    for (int i = 0; i < c->n; i++) c->order[i] = i;
    for (int i = 1; i < c->n; i++) /* insertion sort: n <= K3_MAX_WORKERS */
        for (int k = i; k > 0 && c->st[c->order[k]].a < c->st[c->order[k - 1]].a; k--) {
            int t = c->order[k];
            c->order[k] = c->order[k - 1];
            c->order[k - 1] = t;
        }
    int at = 0;
    char l1[512], l2[512];
    for (int i = 0; i < c->n; i++) {
        cl_stage *s = &c->st[c->order[i]];
        if (s->a > at)
            return k3_errf(K3_ERR_MISMATCH, err, errlen, "layers [%d, %d) are served by no worker",
                           at, s->a);
        if (s->a < at)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "layer %d is served twice: by %s and by %s", s->a,
                           cl_stage_label(&c->st[c->order[i - 1]], l1, sizeof l1),
                           cl_stage_label(s, l2, sizeof l2));
        at = s->b;
    }
    if (at != c->cfg.n_layers)
        return k3_errf(K3_ERR_MISMATCH, err, errlen, "layers [%d, %d) are served by no worker", at,
                       c->cfg.n_layers);
    c->ordered = 1;
    return K3_OK;
}

/* Waits (c->mu held) until every stage is ready, one is refused, a local
 * worker exits, or the deadline passes. */
static k3_status wait_ready_locked(k3_cluster *c, double deadline_ms, int check_children, char *err,
                                   size_t errlen) {
    char lab[512];
    double start = now_ms(), next_log = start + K3_CLUSTER_WAIT_LOG_MS;
    /* the option that set the deadline: start-up's, or a resume's */
    const char *opt = check_children ? "--ready-timeout-ms / K3_READY_TIMEOUT_MS"
                                     : "--resume-wait-ms / K3_RESUME_WAIT_MS";
    for (;;) {
        if (c->spawn_st) return k3_errf(c->spawn_st, err, errlen, "%s", c->spawn_err);
        if (!c->spawn_pending && all_ready(c)) return K3_OK;
        for (int i = 0; i < c->n; i++) {
            cl_stage *s = &c->st[i];
            if (s->refused && s->state != LINK_READY)
                return k3_errf(K3_ERR_AUTH, err, errlen, "%s: %s",
                               cl_stage_label(s, lab, sizeof lab), s->last_err);
            int status;
            if (check_children && s->pid && k3_worker_exited(s->pid, &status)) {
                s->pid = 0;
                return k3_errf(K3_ERR_IO, err, errlen,
                               "local worker %d (%s) exited during start-up with status %d (its "
                               "messages are above)",
                               i, s->endpoint, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
            }
        }
        double t = now_ms();
        if (t >= deadline_ms) {
            for (int i = 0; i < c->n; i++)
                if (c->st[i].state != LINK_READY)
                    return k3_errf(K3_ERR_TIMEOUT, err, errlen,
                                   "%s not registered within %.1f s (%s): %s",
                                   cl_stage_label(&c->st[i], lab, sizeof lab), (t - start) / 1000.0,
                                   opt, c->st[i].last_err[0] ? c->st[i].last_err : "no answer");
        }
        if (t >= next_log) {
            cl_wait_log(c, t - start, deadline_ms - t, opt);
            next_log = t + K3_CLUSTER_WAIT_LOG_MS;
        }
        double until = t + 50 < deadline_ms ? t + 50 : deadline_ms;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double add = until - t;
        ts.tv_sec += (time_t)(add / 1000);
        ts.tv_nsec += (long)(((long long)(add * 1e6)) % 1000000000LL);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
}

k3_status k3_cluster_open(k3_cluster **out, const k3_config *cfg, const k3_cluster_opts *o,
                          char *err, size_t errlen) {
    *out = NULL;
    if (!o->model || !o->model->model_dir)
        return k3_errf(K3_ERR_ARG, err, errlen, "cluster: no model options");
    int n = o->n_workers > 0 ? o->n_workers : o->local;
    if (n < 1 || n > K3_MAX_WORKERS || n > cfg->n_layers)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cluster: %d workers outside [1, min(%d, n_layers %d)]", n, K3_MAX_WORKERS,
                       cfg->n_layers);
    if (o->hb_ms < K3_LINK_HB_MS_MIN || o->hb_ms > K3_LINK_HB_MS_MAX)
        return k3_errf(K3_ERR_ARG, err, errlen, "cluster: heartbeat %d ms outside [%d, %d]",
                       o->hb_ms, K3_LINK_HB_MS_MIN, K3_LINK_HB_MS_MAX);
    if (o->step_timeout_ms < o->hb_ms)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cluster: step timeout %d ms is shorter than the heartbeat %d ms",
                       o->step_timeout_ms, o->hb_ms);
    k3_cluster *c = k3_xcalloc(1, sizeof *c);
    c->o = *o;
    /* TTL: a lost link is seen within TTL, so a step that meets a missing
     * worker fails within 2 x TTL of the loss (docs/TESTING.md T1) */
    if (c->o.request_wait_ms < 0) c->o.request_wait_ms = K3_LINK_LIVENESS * o->hb_ms;
    c->cfg = *cfg;
    c->D = cfg->hidden;
    c->n = n;
    c->efd = -1;
    c->so.hb_ms = o->hb_ms;
    c->so.linger_ms = 0; /* a lost link's queued messages are garbage */
    c->so.handshake_ms = o->retry.handshake_ms;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    c->epoch_seed = ((uint64_t)rt.tv_sec * 1000000007ull ^ (uint64_t)rt.tv_nsec * 2654435761ull ^
                     (uint64_t)getpid() << 40)
                    << 32;
    c->st = k3_xcalloc((size_t)n, sizeof *c->st);
    c->order = k3_xcalloc((size_t)n, sizeof *c->order);
    const k3_model_opts *mo = o->model;
    k3_status st = k3_model_fingerprint_dir(mo->model_dir, cfg, mo->topp, &c->fp, err, errlen);
    k3_link_numerics(mo->bits, mo->mla_bits, mo->head_bits, mo->idot, mo->dense_idot, o->exact,
                     &c->num);
    if (!st && o->curve_secret) {
        st = k3_link_secret_load(o->curve_secret, &c->kp, err, errlen);
        c->curve = !st;
    }
    for (int i = 0; i < n && !st; i++) {
        cl_stage *s = &c->st[i];
        s->a = s->b = -1;
        if (o->n_workers > 0) {
            cl_fmt(s->endpoint, sizeof s->endpoint, "%s", o->workers[i]);
            if (c->curve && o->worker_keys)
                st = k3_link_worker_key(o->worker_keys, s->endpoint, s->server_key, err, errlen);
            if (!st)
                st = k3_link_endpoint_policy(s->endpoint, s->server_key[0] != 0, o->insecure,
                                             "k3-coordinator --workers", err, errlen);
            if (!st && c->curve && !s->server_key[0] &&
                k3_link_endpoint_kind(s->endpoint, NULL, 0) == K3_EP_TCP_NET)
                st = k3_errf(K3_ERR_ARG, err, errlen,
                             "k3-coordinator --workers %s: no server key for it in --worker-keys",
                             s->endpoint);
        }
    }
    if (!st) {
        c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        c->ctx = zmq_ctx_new();
        if (c->efd < 0 || !c->ctx)
            st = k3_errf(K3_ERR_IO, err, errlen, "cluster: eventfd / zmq context: %s",
                         strerror(errno));
    }
    c->spawn_pending = o->n_workers == 0;
    if (!st) {
        if (pthread_create(&c->io, NULL, io_main, c) != 0)
            st = k3_errf(K3_ERR_INTERNAL, err, errlen, "cluster: cannot start the I/O thread");
        else
            c->io_started = 1;
    }
    if (!st) {
        pthread_mutex_lock(&c->mu);
        st = wait_ready_locked(c, now_ms() + o->ready_timeout_ms, 1, err, errlen);
        if (!st) st = check_coverage(c, err, errlen);
        pthread_mutex_unlock(&c->mu);
    }
    if (st) {
        k3_err_prefix(err, errlen, "cluster");
        k3_cluster_close(&c);
        return st;
    }
    char lab[512];
    for (int i = 0; i < n; i++)
        K3_INFO("cluster: stage %d: %s", i, cl_stage_label(&c->st[c->order[i]], lab, sizeof lab));
    *out = c;
    return K3_OK;
}

void k3_cluster_close(k3_cluster **cp) {
    if (!cp || !*cp) return;
    k3_cluster *c = *cp;
    if (c->io_started) {
        pthread_mutex_lock(&c->mu);
        c->stopping = 1;
        cl_wake(c);
        pthread_cond_broadcast(&c->cv); /* an I/O thread parked after a failed spawn */
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->io, NULL);
    }
    cl_local_stop(c);
    /* restartable after a signal (zmq_ctx_term(3)); given up, it would
     * leave libzmq's threads unjoined */
    while (c->ctx && zmq_ctx_term(c->ctx) != 0 && zmq_errno() == EINTR) {
    }
    if (c->efd >= 0) close(c->efd);
    while (c->sessions) { /* sessions not closed by their owners */
        cl_sess *x = c->sessions;
        c->sessions = x->next;
        free(x->epoch);
        free(x);
    }
    memset(&c->kp, 0, sizeof c->kp);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c->st);
    free(c->order);
    free(c);
    *cp = NULL;
}

/* ---- trunk operations ---------------------------------------------- */

static k3_status tr_state_open(k3_trunk *t, int max_ctx, void **state, char *err, size_t errlen) {
    k3_cluster *c = t->impl;
    *state = NULL;
    if (max_ctx < 1 || max_ctx > K3_MAX_CTX)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "cluster: context %d outside [1, %d]", max_ctx,
                       K3_MAX_CTX);
    /* the workers said their capacity in HELLO_OK: a context none of them
     * can hold is refused now, not after a prefill (both numbers named) */
    pthread_mutex_lock(&c->mu);
    for (int p = 0; p < c->n && c->ordered; p++) {
        const cl_stage *s = &c->st[c->order[p]];
        char lab[512];
        if (s->info.max_ctx > 0 && (uint32_t)max_ctx > s->info.max_ctx) {
            pthread_mutex_unlock(&c->mu);
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "cluster: a context of %d tokens was asked, but %s holds at most %u "
                           "tokens per session (its --max-ctx): ask for <= %u (--max-ctx, "
                           "--ngen) or restart the worker with --max-ctx >= %d",
                           max_ctx, cl_stage_label(s, lab, sizeof lab), s->info.max_ctx,
                           s->info.max_ctx, max_ctx);
        }
    }
    pthread_mutex_unlock(&c->mu);
    cl_sess *x = k3_xcalloc(1, sizeof *x);
    x->max_ctx = max_ctx;
    x->epoch = k3_xcalloc((size_t)c->n, sizeof *x->epoch);
    pthread_mutex_lock(&c->mu);
    x->id = ++c->next_sess;
    x->next = c->sessions;
    c->sessions = x;
    pthread_mutex_unlock(&c->mu);
    *state = x;
    return K3_OK;
}

static void tr_state_close(k3_trunk *t, void **state) {
    k3_cluster *c = t->impl;
    cl_sess *x = *state;
    if (!x) return;
    pthread_mutex_lock(&c->mu);
    for (cl_sess **pp = &c->sessions; *pp; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    /* free the workers' slots (and their checkpoints): the sockets are the
     * I/O thread's, so it sends the DROPs at its next turn */
    for (int p = 0; p < c->n && x->used && c->ordered && !c->stopping; p++) {
        cl_ctl *d = k3_xcalloc(1, sizeof *d);
        d->stage = p;
        d->type = PROTO_MSG_SESSION_DROP;
        d->session = x->id;
        d->epoch = x->epoch[p];
        d->owned = 1;
        d->next = c->ctl_in;
        c->ctl_in = d;
    }
    cl_wake(c);
    pthread_mutex_unlock(&c->mu);
    free(x->epoch);
    free(x);
    *state = NULL;
}

static void tr_state_reset(k3_trunk *t, void *state) {
    k3_cluster *c = t->impl;
    cl_sess *x = state;
    pthread_mutex_lock(&c->mu);
    x->reset_pending = 1;
    x->pos = 0;
    pthread_mutex_unlock(&c->mu);
}

static k3_status tr_forward(k3_trunk *t, void *state, int pos0, int T, float *blocks, int *nb,
                            float *h, k3_step_stats *stats, k3_trace_fn trace, void *trace_ctx,
                            char *err, size_t errlen) {
    k3_cluster *c = t->impl;
    cl_sess *x = state;
    if (T < 1 || pos0 < 0 || (int64_t)pos0 + T > x->max_ctx)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cluster: positions [%d, %d) outside the session's [0, %d)", pos0, pos0 + T,
                       x->max_ctx);
    if (*nb != 0)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "cluster: %d AttnRes blocks given, layer 0 expects 0", *nb);
    cl_job *j = k3_xcalloc(1, sizeof *j);
    j->sess = x;
    j->pos0 = pos0;
    j->T = T;
    j->blocks = blocks;
    j->nb_in = *nb;
    j->h = h;
    if (trace) j->trace_h = malloc(sizeof(float) * (size_t)c->n * (size_t)T * (size_t)c->D);
    j->wait_until_ms = now_ms() + c->o.request_wait_ms;
    pthread_mutex_lock(&c->mu);
    if (c->stopping || x->busy) {
        pthread_mutex_unlock(&c->mu);
        free(j->trace_h);
        free(j);
        return k3_errf(K3_ERR_STATE, err, errlen, "cluster: %s",
                       c->stopping ? "closing" : "the session already has a step running");
    }
    x->busy = 1;
    j->next = c->incoming;
    c->incoming = j;
    cl_wake(c);
    while (!j->finished) {
        if (!x->cancel) {
            pthread_cond_wait(&c->cv, &c->mu);
            continue;
        }
        if (!j->cancel_req && atomic_load_explicit(x->cancel, memory_order_acquire)) {
            j->cancel_req = 1; /* the I/O thread sends the CANCELs (it owns the sockets) */
            cl_wake(c);
        }
        struct timespec ts; /* the flag is looked at every 5 ms */
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 5 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);

    k3_status st = j->st;
    if (st) {
        cl_fmt(err, errlen, "%s", j->err);
    } else {
        *nb = j->nb_out;
        if (stats) *stats = j->stats;
        for (int p = 0; trace && j->trace_h && p < c->n; p++) /* stage outputs only */
            trace(trace_ctx, c->st[c->order[p]].b - 1, pos0, T, j->trace_h + (size_t)p * T * c->D);
    }
    free(j->trace_h);
    free(j->chunk);
    free(j->buf);
    free(j);
    return st;
}

static void tr_set_cancel(k3_trunk *t, void *state, const atomic_int *cancel) {
    k3_cluster *c = t->impl;
    cl_sess *x = state;
    pthread_mutex_lock(&c->mu);
    x->cancel = cancel;
    pthread_mutex_unlock(&c->mu);
}

static void tr_close(k3_trunk *t) { t->impl = NULL; /* the cluster is borrowed */ }

static const k3_trunk_ops cluster_ops = {
    .name = "cluster",
    .state_open = tr_state_open,
    .state_close = tr_state_close,
    .state_reset = tr_state_reset,
    .forward = tr_forward,
    .set_cancel = tr_set_cancel,
    .ckpt_save = cl_tr_ckpt_save,
    .ckpt_restore = cl_tr_ckpt_restore,
    .ckpt_free = cl_tr_ckpt_free,
    .state_load = cl_tr_state_load,
    .close = tr_close,
};

k3_status k3_cluster_trunk(k3_cluster *c, k3_trunk **out, char *err, size_t errlen) {
    (void)err, (void)errlen;
    k3_trunk *t = k3_xcalloc(1, sizeof *t);
    t->ops = &cluster_ops;
    t->impl = c;
    *out = t;
    return K3_OK;
}

/* ---- waiting ------------------------------------------------------------ */

k3_status k3_cluster_wait_ready(k3_cluster *c, int timeout_ms, char *err, size_t errlen) {
    pthread_mutex_lock(&c->mu);
    cl_wake(c);
    k3_status st = wait_ready_locked(c, now_ms() + timeout_ms, 0, err, errlen);
    pthread_mutex_unlock(&c->mu);
    return st;
}
