/* worker/worker.h: the k3-worker socket loop (docs/PROTOCOL.md).
 *
 * Owns: one ROUTER socket bound to the worker's endpoint (plain, or a CURVE
 * server behind the ZAP allow-list), the link epoch and the registered
 * coordinator, the queue of received requests, the session table
 * (worker/sessions.h), the hidden-state buffers of one step and the
 * cumulative statistics. It answers HELLO, FORWARD, SESSION_RESET /
 * TRUNCATE / DROP, CHECKPOINT / RESTORE, CANCEL, STATS, SHUTDOWN and HEARTBEAT; a malformed message
 * is answered with ERROR (or dropped when not even its sender is known),
 * counted, logged on one line, and the loop serves the next one.
 * Borrows: the loaded model (its layer range is the worker's range) and the
 * stop flag set by the signal handler.
 * Threads: wk_serve runs on one thread, which also runs the layer math (the
 * model's pool threads help). Between layers the compute loop sends
 * HEARTBEAT and reads the socket, so CANCEL, HELLO and SHUTDOWN act on a
 * running step and a stuck compute thread shows up as silence
 * (docs/TESTING.md 6.1: ZMTP heartbeats alone do not see it).
 */
#ifndef K3_WORKER_H
#define K3_WORKER_H

#include <signal.h>
#include <stdint.h>

#include "common/engine/model.h"
#include "proto/link.h"
#include "proto/proto.h"

/* Requests queued behind the running one; more are refused with ERROR(busy).
 * The coordinator keeps a few steps per session in flight, so 1024 covers
 * hundreds of sessions. */
#define WK_MAX_QUEUE 1024

typedef struct wk_opts {
    const char *listen;           /* endpoint to bind */
    k3_link_sockopts sock;        /* heartbeats, linger, handshake */
    int curve;                    /* serve CURVE with kp behind the allow-list */
    k3_curve_keypair kp;          /* the worker's server key pair (curve) */
    const k3_allow_list *allow;   /* coordinator public keys (curve), borrowed */
    int zap_off;                  /* tests only: do not start the ZAP handler (C4) */
    uint64_t fingerprint;         /* k3_model_fingerprint of the model */
    proto_numerics num;           /* this worker's numeric settings */
    int max_sessions;             /* session states before eviction */
    int max_ctx;                  /* tokens per session */
    int max_chunk;                /* largest T accepted */
    int ckpt_mb;                  /* MiB all turn checkpoints may hold (0: none) */
    const char *ckpt_dir;         /* --ckpt-dir: checkpoints parked on disk too, NULL = none */
    int ckpt_files, ckpt_disk_mb; /* what --ckpt-dir keeps: files, MiB (oldest pruned) */
    double read_gbps;             /* measured drive rate, 0 = not measured */
    char name[K3_PROTO_MAX_NAME]; /* for logs and the coordinator's errors */
    int fault_slow_ms;            /* tests only: every FORWARD sleeps this long first, 0 = off */
    int fault_stall_at;           /* tests only: the N-th FORWARD stalls forever (T3), 0 = off */

    /* what a STATS probe reports (k3-coordinator status) */
    char build[K3_PROTO_MAX_NAME];  /* k3_link_build(), or K3_WORKER_FAULT's build=ID (tests) */
    char dirs[K3_PROTO_MAX_NAME];   /* the shard directories (--dirs) */
    char stripe[K3_PROTO_MAX_NAME]; /* --placement's drives and expert shares, "" = none */
    double start_ms;                /* k3_now_ms() at start: the uptime */
    /* cross-worker striping (worker/xstripe.h), NULL = off */
    struct wk_xstripe *xs; /* borrowed */
    uint32_t xs_own;       /* the drives it serves */
} wk_opts;

/* ---- peer budgets and log rate (worker/budget.c) ---- */

/* Whole messages libzmq queues per peer connection before it stops reading
 * from it (TCP back-pressure): the coordinator keeps a few steps per
 * session in flight and the worker drains the socket between layers. */
#define WK_PEER_RCVHWM 64
/* Malformed-message lines: WK_LOG_BURST per WK_LOG_WINDOW_MS, then one
 * line with the count of those not logged. */
#define WK_LOG_BURST     10
#define WK_LOG_WINDOW_MS 10000.0

/* The largest frame this worker accepts, bytes: [max(nb_in, 1)][max_chunk]
 * [hidden] f32, at least the envelope's PROTO_ENCODE_CAP, at most
 * K3_PROTO_MAX_FRAME_BYTES. */
uint64_t wk_max_frame_bytes(int nb_in, int max_chunk, int hidden);
/* ZMQ_MAXMSGSIZE = max_frame and ZMQ_RCVHWM = WK_PEER_RCVHWM on sock
 * (before bind). */
k3_status wk_socket_budget(void *sock, uint64_t max_frame, char *err, size_t errlen);

/* The endpoint to hand zmq_bind: "tcp://localhost:P" becomes
 * "tcp://127.0.0.1:P", anything else is copied. */
void wk_bind_endpoint(const char *ep, char *out, size_t cap);
/* Binds listen on a throw-away socket and closes it: a worker reports an
 * address in use (or a bad interface) before a load of minutes. The real
 * socket binds after the load (another process could take the address in
 * between; that is then reported as before). */
k3_status wk_probe_bind(const char *listen, char *err, size_t errlen);

typedef struct wk_ratelimit_state {
    double window_ms;    /* start of the current window */
    int in_window;       /* lines logged in it */
    uint64_t suppressed; /* not logged in it */
    uint64_t total;      /* events ever */
} wk_ratelimit_state;
/* Counts one event at now_ms; 1 = log its line, 0 = counted only (a line
 * with the count follows when the window ends). */
int wk_ratelimit(wk_ratelimit_state *r, double now_ms);

/* Serves until *stop becomes non-zero (SIGTERM/SIGINT) or a SHUTDOWN
 * arrives; returns K3_OK then. Errors: the socket cannot be created or
 * bound, the ZAP handler cannot start. */
k3_status wk_serve(k3_model *m, const wk_opts *o, volatile sig_atomic_t *stop, char *err,
                   size_t errlen);

#endif
