/* coordinator/cmd_status.c: `k3-coordinator status --workers EP,...`
 * (cmd_status.h, docs/DEPLOY.md "Small cluster").
 *
 * Owns: one DEALER socket (CURVE client when --curve-secret is given) and its
 * socket monitor per worker, for the duration of the command.
 * Borrows: nothing. Threads: the caller's only.
 *
 * Each worker gets a STATS probe (epoch 0, docs/PROTOCOL.md 9): the worker
 * answers STATS_OK with its identity (name, build, layers, drives, drive
 * rate, uptime) and counters whatever its registration, and the probe
 * changes nothing, so a running coordinator keeps its sessions. A worker
 * that would be refused says why in the STATE column: a build identity other
 * than this program's (the check HELLO makes), a CURVE handshake the worker
 * refused (our key is not on its allow-list) or that failed (wrong worker
 * key), no answer in --timeout-ms (down, or the link drops packets).
 */
#include "coordinator/cmd_status.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "coordinator/cluster.h"
#include "proto/link.h"
#include "proto/proto.h"

typedef struct st_opts {
    k3_opt_list workers; /* endpoints */
    char *curve_secret;  /* our key pair, or NULL = plain */
    char *worker_keys;   /* ENDPOINT KEY lines */
    int insecure;
    int timeout_ms;
    int hb_ms;
    int help;
} st_opts;

// clang-format off
static const k3_opt st_table[] = {
    {.name = "workers", .flag = "--workers", .env = "K3_WORKERS", .type = K3_OPT_LIST,
     .offset = offsetof(st_opts, workers), .max = K3_MAX_WORKERS, .metavar = "EP,...",
     .help = "worker endpoints to ask (tcp://HOST:PORT or ipc://PATH)"},
    K3_LINK_OPT_CURVE_SECRET(st_opts, curve_secret),
    K3_CLUSTER_OPT_WORKER_KEYS(st_opts, worker_keys),
    K3_LINK_OPT_INSECURE(st_opts, insecure),
    {.name = "timeout_ms", .flag = "--timeout-ms", .type = K3_OPT_INT,
     .offset = offsetof(st_opts, timeout_ms), .def = "3000", .min = 100, .max = 600000,
     .metavar = "MS", .help = "how long each worker may take to answer"},
    K3_LINK_OPT_HB_MS(st_opts, hb_ms),
    K3_OPT_HELP(st_opts, help),
};
// clang-format on
#define N_ST ((int)(sizeof st_table / sizeof st_table[0]))

/* One worker's row. */
typedef struct st_row {
    const char *ep;
    int answered;     /* a STATS_OK came back */
    proto_stats_ok s; /* valid when answered */
    char state[1024]; /* "ok", "ok (idle)" or why not */
    int bad;          /* counts against the exit status */
} st_row;

/* "HOST:PORT" of tcp://HOST:PORT, else the endpoint itself. */
static void ep_host(const char *ep, char *out, size_t cap) {
    snprintf(out, cap, "%s", strncmp(ep, "tcp://", 6) ? ep : ep + 6);
}

/* The first monitor event's why, or NULL when none says the handshake failed. */
static const char *handshake_failure(void *mon) {
    const char *why = NULL;
    for (;;) {
        const int ev = k3_link_monitor_event(mon);
        if (ev < 0) return why;
        if (why) continue;
        if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
            why = "refused: cannot authenticate: the worker refused this coordinator's CURVE key "
                  "(not on its allow-list)";
        else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                 ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            why = "refused: cannot authenticate: handshake failed (wrong worker key in "
                  "--worker-keys, or CURVE on one side only)";
    }
}

/* Probes one worker into r. */
static void probe(void *ctx, const st_opts *o, const k3_curve_keypair *kp, st_row *r, int idx) {
    char err[512], key[K3_Z85_KEY_LEN + 1] = "", mon_ep[64];
    void *sock = NULL, *mon = NULL;
    k3_link_sockopts so = {.hb_ms = o->hb_ms, .linger_ms = 0, .handshake_ms = o->timeout_ms};
    k3_status st = k3_link_endpoint_policy(r->ep, kp != NULL, o->insecure,
                                           "k3-coordinator status --workers", err, sizeof err);
    if (!st && kp) {
        if (!o->worker_keys)
            st = k3_errf(K3_ERR_ARG, err, sizeof err, "--curve-secret needs --worker-keys FILE");
        if (!st) st = k3_link_worker_key(o->worker_keys, r->ep, key, err, sizeof err);
        if (!st && !key[0])
            st = k3_errf(K3_ERR_MISSING, err, sizeof err, "%s: no key for %s", o->worker_keys,
                         r->ep);
    }
    if (!st && !(sock = zmq_socket(ctx, ZMQ_DEALER)))
        st = k3_errf(K3_ERR_IO, err, sizeof err, "zmq_socket: %s", zmq_strerror(zmq_errno()));
    if (!st) st = k3_link_sockopts_apply(sock, &so, err, sizeof err);
    if (!st && kp) st = k3_link_curve_client(sock, kp, key, err, sizeof err);
    snprintf(mon_ep, sizeof mon_ep, "inproc://k3status.%d", idx);
    if (!st &&
        (zmq_socket_monitor(sock, mon_ep,
                            ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0 ||
         !(mon = zmq_socket(ctx, ZMQ_PAIR)) || zmq_connect(mon, mon_ep) != 0))
        st = k3_errf(K3_ERR_IO, err, sizeof err, "socket monitor: %s", zmq_strerror(zmq_errno()));
    if (!st && zmq_connect(sock, r->ep) != 0)
        st =
            k3_errf(K3_ERR_IO, err, sizeof err, "connect %s: %s", r->ep, zmq_strerror(zmq_errno()));
    proto_msg req, rep;
    proto_frames fr = {0};
    if (!st) {
        proto_msg_init(&req, PROTO_MSG_STATS, 1, 0); /* epoch 0: a probe */
        st = proto_send(sock, NULL, &req, NULL, NULL, 0, ZMQ_DONTWAIT, err, sizeof err);
        if (st == K3_ERR_TIMEOUT) st = K3_OK; /* queued until the connection is up */
    }
    const char *hs = NULL;
    double t0 = k3_now_ms();
    while (!st && !r->answered && !hs) {
        double left = o->timeout_ms - (k3_now_ms() - t0);
        if (left <= 0) break;
        zmq_pollitem_t it[2] = {{sock, 0, ZMQ_POLLIN, 0}, {mon, 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(it, 2, (long)left) < 0) break;
        if (it[1].revents) hs = handshake_failure(mon);
        if (!(it[0].revents & ZMQ_POLLIN)) continue;
        k3_status rs = proto_recv(sock, ZMQ_DONTWAIT, &rep, &fr, err, sizeof err);
        proto_frames_close(&fr);
        if (rs == K3_ERR_TIMEOUT) continue;
        if (rs) {
            st = rs;
        } else if (rep.type == PROTO_MSG_STATS_OK) {
            r->answered = 1;
            r->s = rep.u.stats_ok;
        } else if (rep.type == PROTO_MSG_ERROR) {
            st = k3_errf(K3_ERR_PROTO, err, sizeof err, "worker answered ERROR: %s",
                         rep.u.error.msg);
        } else {
            st = k3_errf(K3_ERR_PROTO, err, sizeof err, "worker answered %s to STATS",
                         proto_type_name(rep.type));
        }
    }
    if (!hs && !r->answered && mon) hs = handshake_failure(mon);
    r->bad = 1;
    if (st)
        snprintf(r->state, sizeof r->state, "error: %s", err);
    else if (hs)
        snprintf(r->state, sizeof r->state, "%s", hs);
    else if (!r->answered)
        snprintf(r->state, sizeof r->state,
                 "down: no answer in %d ms (not running, unreachable, or the link drops packets)",
                 o->timeout_ms);
    else if (r->s.build[0] && k3_link_check_build(k3_link_build(), "coordinator", r->s.build,
                                                  "worker", err, sizeof err))
        snprintf(r->state, sizeof r->state, "refused: %s", err);
    else {
        r->bad = 0;
        snprintf(r->state, sizeof r->state, "%s", r->s.registered ? "ok" : "ok (idle)");
    }
    if (mon) {
        zmq_socket_monitor(sock, NULL, 0);
        zmq_close(mon);
    }
    if (sock) zmq_close(sock);
}

static void print_table(const st_row *rows, int n) {
    printf("%-21s %-14s %-8s %-24s %-26s %8s %9s %8s %8s  %s\n", "HOST:PORT", "WORKER", "LAYERS",
           "STRIPE", "BUILD", "DRIVE", "UPTIME", "SESSIONS", "HIT", "STATE");
    for (int i = 0; i < n; i++) {
        const st_row *r = &rows[i];
        char host[256], lay[32] = "-", gbs[32] = "-", up[32] = "-", ses[16] = "-", hit[16] = "-";
        ep_host(r->ep, host, sizeof host);
        if (r->answered) {
            const proto_stats_ok *s = &r->s;
            snprintf(lay, sizeof lay, "%u-%u", s->layers[0], s->layers[1]);
            if (s->read_gbps > 0) snprintf(gbs, sizeof gbs, "%.2fGB/s", s->read_gbps);
            snprintf(up, sizeof up, "%.0fs", s->uptime_s);
            snprintf(ses, sizeof ses, "%u", s->sessions);
            uint64_t tot = s->expert_hits + s->expert_misses;
            if (tot) snprintf(hit, sizeof hit, "%.1f%%", 100.0 * (double)s->expert_hits / tot);
        }
        /* the expert stripe when the worker reads a placement, else its --dirs */
        const char *stripe = !r->answered     ? "-"
                             : r->s.stripe[0] ? r->s.stripe
                             : r->s.dirs[0]   ? r->s.dirs
                                              : "-";
        printf("%-21s %-14s %-8s %-24s %-26s %8s %9s %8s %8s  %s\n", host,
               r->answered && r->s.name[0] ? r->s.name : "-", lay, stripe,
               r->answered && r->s.build[0] ? r->s.build : "-", gbs, up, ses, hit, r->state);
    }
}

int cmd_status(int argc, char **argv) {
    st_opts o;
    char err[512];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0, rc = 0;
    if (!pos) return 1;
    k3_opt_src src[N_ST];
    k3_status st = k3_opts_parse(st_table, N_ST, &o, src, argc, argv, pos, &npos, err, sizeof err);
    if (!st && !o.help && npos)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "unexpected argument '%s'", pos[0]);
    if (!st && !o.help && !o.workers.n)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--workers EP,... is required");
    k3_curve_keypair kp;
    memset(&kp, 0, sizeof kp);
    if (!st && !o.help && o.curve_secret)
        st = k3_link_secret_load(o.curve_secret, &kp, err, sizeof err);
    if (st) {
        fprintf(stderr, "k3-coordinator status: %s (see status --help)\n", err);
        rc = 2;
    } else if (o.help) {
        k3_opts_help(stdout,
                     "usage: k3-coordinator status --workers EP,... [--curve-secret FILE "
                     "--worker-keys FILE]\n"
                     "Asks each worker who it is (STATS probe, no registration, no effect on "
                     "a running\ncoordinator) and prints one row per worker: host, layer range, "
                     "stripe (each placement drive:\nits share of the experts, else --dirs), "
                     "build, drive GB/s, uptime, sessions held, expert cache "
                     "hit rate, and its state\n(ok, or why this coordinator would be refused). "
                     "Exit status 1 when any is not ok.",
                     st_table, N_ST);
    } else {
        void *ctx = zmq_ctx_new();
        st_row *rows = k3_xcalloc((size_t)o.workers.n, sizeof *rows);
        for (int i = 0; i < o.workers.n; i++) {
            rows[i].ep = o.workers.items[i];
            probe(ctx, &o, o.curve_secret ? &kp : NULL, &rows[i], i);
            rc |= rows[i].bad;
        }
        print_table(rows, o.workers.n);
        free(rows);
        zmq_ctx_term(ctx);
    }
    memset(&kp, 0, sizeof kp); /* no copy of the secret key left behind */
    k3_opts_free(st_table, N_ST, &o);
    free(pos);
    return rc;
}
