/* worker/budget.c: what one peer may make a worker hold (worker.h,
 * docs/PROTOCOL.md "Peer budgets"), and the rate limit of its complaint
 * lines.
 *
 * Owns nothing; called by the worker's socket loop (worker/serve.c) on its
 * one thread. The largest frame a worker can accept follows from its own
 * shape: a FORWARD entering layer a carries the AttnRes snapshots of
 * [0, a) and the hidden state, [nb][T][D] f32 with T <= --max-chunk, so
 * ZMQ_MAXMSGSIZE is set to that, and libzmq drops a peer that announces a
 * bigger frame before it allocates a byte of it (the 1 GiB protocol-wide
 * cap stays the outer bound). ZMQ_RCVHWM bounds the whole messages libzmq
 * queues per peer connection, so a peer holds at most
 * WK_PEER_RCVHWM x K3_PROTO_MAX_FRAMES x that in the worker's memory;
 * queued work (registered coordinator only) is bounded by WK_MAX_QUEUE.
 */
#include <stdio.h>

#include "common/base/log.h"
#include "worker/worker.h"

uint64_t wk_max_frame_bytes(int nb_in, int max_chunk, int hidden) {
    uint64_t rows = (uint64_t)(nb_in > 1 ? nb_in : 1) * (uint64_t)max_chunk;
    uint64_t b = rows * (uint64_t)hidden * sizeof(float);
    if (b < PROTO_ENCODE_CAP) b = PROTO_ENCODE_CAP; /* the envelope */
    return b > K3_PROTO_MAX_FRAME_BYTES ? K3_PROTO_MAX_FRAME_BYTES : b;
}

k3_status wk_socket_budget(void *sock, uint64_t max_frame, char *err, size_t errlen) {
    int64_t max = (int64_t)max_frame;
    int hwm = WK_PEER_RCVHWM;
    if (zmq_setsockopt(sock, ZMQ_MAXMSGSIZE, &max, sizeof max) != 0 ||
        zmq_setsockopt(sock, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "setsockopt MAXMSGSIZE / RCVHWM: %s",
                       zmq_strerror(zmq_errno()));
    return K3_OK;
}

int wk_ratelimit(wk_ratelimit_state *r, double now_ms) {
    r->total++;
    if (now_ms - r->window_ms >= WK_LOG_WINDOW_MS) {
        if (r->suppressed)
            K3_WARN("%llu more malformed messages in the last %.0f s were not logged (%llu in all)",
                    (unsigned long long)r->suppressed, (now_ms - r->window_ms) / 1000.0,
                    (unsigned long long)r->total);
        r->window_ms = now_ms;
        r->in_window = 0;
        r->suppressed = 0;
    }
    if (r->in_window < WK_LOG_BURST) {
        r->in_window++;
        return 1;
    }
    r->suppressed++;
    return 0;
}
