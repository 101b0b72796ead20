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
 *
 * Also the endpoint a worker binds: "tcp://localhost:P" as 127.0.0.1, and a
 * trial bind before the model loads, so "address in use" is said at once.
 */
#include <stdio.h>
#include <string.h>

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

/* libzmq reads the host of a tcp bind as an interface name or an address,
 * so "tcp://localhost:P" fails with "No such device": it binds 127.0.0.1. */
void wk_bind_endpoint(const char *ep, char *out, size_t cap) {
    static const char lh[] = "tcp://localhost:";
    if (!strncmp(ep, lh, sizeof lh - 1))
        snprintf(out, cap, "tcp://127.0.0.1:%s", ep + sizeof lh - 1);
    else
        snprintf(out, cap, "%s", ep);
}

k3_status wk_probe_bind(const char *listen, char *err, size_t errlen) {
    char ep[K3_MAX_ENDPOINT + 16];
    wk_bind_endpoint(listen, ep, sizeof ep);
    void *ctx = zmq_ctx_new();
    void *s = ctx ? zmq_socket(ctx, ZMQ_ROUTER) : NULL;
    int linger = 0;
    k3_status st = K3_OK;
    if (!s)
        st = k3_errf(K3_ERR_IO, err, errlen, "zmq socket: %s", zmq_strerror(zmq_errno()));
    else if (zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger) != 0 || zmq_bind(s, ep) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "bind %s: %s (checked before loading the model)",
                     listen, zmq_strerror(zmq_errno()));
    if (s) zmq_close(s);
    if (ctx) zmq_ctx_term(ctx);
    return st;
}
