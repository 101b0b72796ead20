/* coordinator/doctor_workers.h: `doctor --workers`: one STATS probe to each
 * worker endpoint (epoch 0, docs/PROTOCOL.md 9, as `k3-coordinator status`
 * sends), reporting whether it answers, its protocol version, its build,
 * name, layer range, drive rate and whether a coordinator is registered
 * (docs/DEPLOY.md "Workstation").
 *
 * Owns: a zmq context and one DEALER socket per probe (closed before
 * returning). Borrows: the endpoint. Threads: the calling thread only.
 *
 * The STATS probe does not register: a running coordinator keeps its
 * sessions. A worker does not tell an unregistered peer its model
 * fingerprint, so the model and settings check needs a HELLO: doctor sends
 * one only to a worker STATS found idle (no coordinator registered), where
 * registering displaces no one.
 */
#ifndef K3_DOCTOR_WORKERS_H
#define K3_DOCTOR_WORKERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "proto/proto.h"

typedef struct k3_worker_probe {
    int answered;                   /* 1: an answer came back (the last probe's) */
    unsigned ver_major, ver_minor;  /* the worker's protocol version (envelope) */
    int has_stats;                  /* 1: STATS_OK */
    proto_stats_ok stats;           /* when has_stats: identity and counters */
    int accepted;                   /* 1: HELLO_OK */
    proto_hello_ok hello;           /* when accepted */
    char refusal[K3_PROTO_MAX_STR]; /* when HELLO was refused: the worker's message */
} k3_worker_probe;

/* Sends one STATS (epoch 0) to ep and waits up to timeout_ms for the
 * answer (out zeroed first). K3_ERR_TIMEOUT: no answer; K3_ERR_AUTH: a
 * network tcp endpoint (CURVE is not supported by the probe: `k3-coordinator
 * status` has it); other errors name the endpoint. */
k3_status k3_probe_worker_stats(const char *ep, int timeout_ms, k3_worker_probe *out, char *err,
                                size_t errlen);

/* Sends one HELLO with the model's fingerprint and the default numerics
 * (bits 4/8/8, idot 1, dense idot 0; K3_BITS, K3_MLA_BITS, K3_HEAD_BITS,
 * K3_IDOT, K3_DENSE_IDOT override them): accepted (it registers the probe)
 * or refused with the worker's reason. Only for an idle worker (STATS said
 * no coordinator is registered): the next coordinator's HELLO takes over.
 * Errors as k3_probe_worker_stats. */
k3_status k3_probe_worker_hello(const char *ep, uint64_t fingerprint, int timeout_ms,
                                k3_worker_probe *out, char *err, size_t errlen);

#endif
