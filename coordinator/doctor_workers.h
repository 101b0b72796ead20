/* coordinator/doctor_workers.h: `doctor --workers`: one HELLO to each worker
 * endpoint, reporting whether it answers, its protocol version, its build,
 * name and layer range (docs/DEPLOY.md "Workstation").
 *
 * Owns: a zmq context and one DEALER socket per probe (closed before
 * returning). Borrows: the endpoint. Threads: the calling thread only.
 *
 * The HELLO carries the model's fingerprint and the numeric settings a
 * coordinator started with no options would use (bits 4/8/8, idot 1, dense
 * idot 0, not exact; K3_BITS, K3_MLA_BITS, K3_HEAD_BITS, K3_IDOT and
 * K3_DENSE_IDOT override them). A worker that accepts registers the probe
 * as its coordinator: run doctor before the coordinator starts (a running
 * coordinator re-registers, but its sessions on that worker are dropped).
 */
#ifndef K3_DOCTOR_WORKERS_H
#define K3_DOCTOR_WORKERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "proto/proto.h"

typedef struct k3_worker_probe {
    int answered;                   /* 1: a HELLO_OK or ERROR came back */
    int accepted;                   /* 1: HELLO_OK */
    unsigned ver_major, ver_minor;  /* the worker's protocol version (envelope) */
    proto_hello_ok hello;           /* when accepted */
    char refusal[K3_PROTO_MAX_STR]; /* when refused: the worker's message */
} k3_worker_probe;

/* Sends one HELLO to ep and waits up to timeout_ms for the answer.
 * K3_ERR_TIMEOUT: no answer; K3_ERR_AUTH: a network tcp endpoint (CURVE is
 * not supported by the probe); other errors name the endpoint. */
k3_status k3_probe_worker(const char *ep, uint64_t fingerprint, int timeout_ms,
                          k3_worker_probe *out, char *err, size_t errlen);

#endif
