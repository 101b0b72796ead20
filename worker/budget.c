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
 * queues per peer connection; the message being received is not bounded in
 * frames by libzmq (it delivers multipart messages whole), so an
 * unauthenticated peer on a plain endpoint can hold what it sends until
 * the message is whole and rejected: CURVE is the bound (docs/PROTOCOL.md
 * "Peer budgets"). Queued work (registered coordinator only) is bounded by
 * WK_MAX_QUEUE.
 *
 * Also the endpoint a worker binds: "tcp://localhost:P" as 127.0.0.1, and a
 * trial bind before the model loads, so "address in use" is said at once.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

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
    /* a plain socket bound but never listening: nobody can connect to it
     * (a zmq listener here would take a coordinator's connect and then
     * drop it mid-handshake, which reads as a refused key). ipc:// needs no
     * check (libzmq replaces a stale socket file); a tcp host other than
     * '*', localhost or a numeric IPv4 address (an interface name) is left
     * to the real bind. */
    char ep[K3_MAX_ENDPOINT + 16], host[K3_MAX_ENDPOINT];
    wk_bind_endpoint(listen, ep, sizeof ep);
    if (strncmp(ep, "tcp://", 6)) return K3_OK;
    const char *colon = strrchr(ep + 6, ':');
    if (!colon || (size_t)(colon - (ep + 6)) >= sizeof host) return K3_OK;
    snprintf(host, sizeof host, "%.*s", (int)(colon - (ep + 6)), ep + 6);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (!strcmp(host, "*"))
        a.sin_addr.s_addr = htonl(INADDR_ANY);
    else if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
        return K3_OK;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return K3_OK;
    int one = 1; /* as libzmq binds: a port in TIME_WAIT is free */
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    k3_status st = K3_OK;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "bind %s: %s (checked before loading the model)",
                     listen, strerror(errno));
    close(fd);
    return st;
}
