/* coordinator/doctor_workers.c: the STATS and HELLO probes of `doctor --workers`
 * (doctor_workers.h). The wire format and socket settings are the
 * protocol's and the link's own (proto/proto.h, proto/link.h). */
#include "coordinator/doctor_workers.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "proto/link.h"

static double mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The engine's defaults (common/engine/engine_opts.h rows), or the
 * variable a coordinator would read. */
static int env_int(const char *name, int def) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) : def;
}

/* One request and its reply on a fresh DEALER to ep, the link's socket
 * settings, bounded by timeout_ms; *rep is the first reply that matches req
 * (stale ones are skipped). what names the request in errors. queue_ok: a
 * send that would block is queued until the connection is up instead of
 * failing (the STATS probe). The reply's tensor frames (none for HELLO_OK,
 * STATS_OK, ERROR) are dropped. */
static k3_status probe_exchange(const char *ep, const char *what, const proto_msg *req,
                                int queue_ok, int timeout_ms, proto_msg *rep, char *err,
                                size_t errlen) {
    k3_status st = k3_link_endpoint_policy(ep, 0, 0, "doctor --workers", err, errlen);
    if (st) return st;
    void *ctx = zmq_ctx_new(), *sock = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    if (!sock) {
        if (ctx) zmq_ctx_term(ctx);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: cannot create a socket: %s", ep,
                       zmq_strerror(zmq_errno()));
    }
    k3_link_sockopts so = {.hb_ms = K3_LINK_HB_MS_DEFAULT,
                           .linger_ms = 0,
                           .handshake_ms = K3_LINK_HANDSHAKE_MS_DEFAULT};
    st = k3_link_sockopts_apply(sock, &so, err, errlen);
    if (!st && zmq_connect(sock, ep) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: connect: %s", ep, zmq_strerror(zmq_errno()));
    if (!st) {
        st = proto_send(sock, NULL, req, NULL, NULL, 0, ZMQ_DONTWAIT, err, errlen);
        if (queue_ok && st == K3_ERR_TIMEOUT) st = K3_OK;
    }
    double t_end = mono_ms() + timeout_ms;
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    while (!st) {
        int left = (int)(t_end - mono_ms());
        if (left <= 0) {
            st = k3_errf(K3_ERR_TIMEOUT, err, errlen, "%s: no answer to %s within %d ms", ep, what,
                         timeout_ms);
            break;
        }
        zmq_pollitem_t pi = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&pi, 1, left) <= 0) continue;
        char rerr[512];
        k3_status rs = proto_recv(sock, ZMQ_DONTWAIT, rep, &fr, rerr, sizeof rerr);
        if (rs == K3_ERR_TIMEOUT || rs == K3_ERR_CANCEL) continue;
        if (rs) {
            st = k3_errf(rs, err, errlen, "%s: bad answer to %s: %s", ep, what, rerr);
            break;
        }
        proto_frames_close(&fr);
        if (proto_check_reply(req, rep, rerr, sizeof rerr) == K3_OK) break; /* else stale */
    }
    proto_frames_close(&fr);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return st;
}

k3_status k3_probe_worker_hello(const char *ep, uint64_t fingerprint, int timeout_ms,
                                k3_worker_probe *out, char *err, size_t errlen) {
    out->answered = out->accepted = 0;
    proto_msg req;
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    /* an epoch of its own life (high 32 bits), as cluster.c makes them */
    proto_msg_init(&req, PROTO_MSG_HELLO, 1,
                   ((uint64_t)rt.tv_sec * 1000003ull ^ (uint64_t)rt.tv_nsec) << 32 | 1);
    req.u.hello.fingerprint = fingerprint;
    k3_link_numerics(env_int("K3_BITS", 4), env_int("K3_MLA_BITS", 8), env_int("K3_HEAD_BITS", 8),
                     env_int("K3_IDOT", 1), env_int("K3_DENSE_IDOT", 0), 0, &req.u.hello.num);
    /* this build's identity: a worker refuses any other (docs/PROTOCOL.md 9) */
    snprintf(req.u.hello.build, sizeof req.u.hello.build, "%s", k3_link_build());
    proto_msg rep;
    k3_status st = probe_exchange(ep, "HELLO", &req, 0, timeout_ms, &rep, err, errlen);
    if (st) return st;
    out->answered = 1;
    out->ver_major = rep.ver_major, out->ver_minor = rep.ver_minor;
    if (rep.type == PROTO_MSG_HELLO_OK) {
        out->accepted = 1;
        out->hello = rep.u.hello_ok;
    } else {
        snprintf(out->refusal, sizeof out->refusal, "%s", rep.u.error.msg);
    }
    return K3_OK;
}

k3_status k3_probe_worker_stats(const char *ep, int timeout_ms, k3_worker_probe *out, char *err,
                                size_t errlen) {
    memset(out, 0, sizeof *out);
    proto_msg req, rep;
    proto_msg_init(&req, PROTO_MSG_STATS, 1, 0); /* epoch 0: a probe, no registration */
    k3_status st = probe_exchange(ep, "STATS", &req, 1, timeout_ms, &rep, err, errlen);
    if (st) return st;
    out->ver_major = rep.ver_major, out->ver_minor = rep.ver_minor;
    if (rep.type == PROTO_MSG_STATS_OK) {
        out->answered = 1;
        out->stats = rep.u.stats_ok;
        out->has_stats = 1;
        return K3_OK;
    }
    if (rep.type == PROTO_MSG_ERROR)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: answered ERROR to STATS: %s", ep,
                       rep.u.error.msg);
    return k3_errf(K3_ERR_PROTO, err, errlen, "%s: answered %s to STATS", ep,
                   proto_type_name(rep.type));
}
