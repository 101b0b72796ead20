/* worker/worker.h: the k3-worker socket loop (docs/PROTOCOL.md).
 *
 * Owns: one ROUTER socket bound to the worker's endpoint (plain, or a CURVE
 * server behind the ZAP allow-list), the link epoch and the registered
 * coordinator, the queue of received requests, the session table
 * (worker/sessions.h), the hidden-state buffers of one step and the
 * cumulative statistics. It answers HELLO, FORWARD, SESSION_RESET /
 * TRUNCATE / DROP, CANCEL, STATS, SHUTDOWN and HEARTBEAT; a malformed message
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
    double read_gbps;             /* measured drive rate, 0 = not measured */
    char name[K3_PROTO_MAX_NAME]; /* for logs and the coordinator's errors */
    int fault_stall_at;           /* tests only: the N-th FORWARD stalls forever (T3), 0 = off */

    /* what a STATS probe reports (k3-coordinator status) */
    char build[K3_PROTO_MAX_NAME]; /* k3_link_build(), or K3_WORKER_FAULT's build=ID (tests) */
    char dirs[K3_PROTO_MAX_NAME];  /* the shard directories (--dirs): the stripe */
    double start_ms;               /* k3_now_ms() at start: the uptime */
} wk_opts;

/* Serves until *stop becomes non-zero (SIGTERM/SIGINT) or a SHUTDOWN
 * arrives; returns K3_OK then. Errors: the socket cannot be created or
 * bound, the ZAP handler cannot start. */
k3_status wk_serve(k3_model *m, const wk_opts *o, volatile sig_atomic_t *stop, char *err,
                   size_t errlen);

#endif
