/* proto/proto_zmq.c: one protocol message <-> one ZeroMQ multipart message
 * (docs/PROTOCOL.md 1). The socket loops (poll, heartbeats, deadlines) are
 * the worker's and coordinator's; this file only moves whole messages and
 * enforces the frame limits on the way in.
 *
 * Receiving never buffers more than K3_PROTO_MAX_FRAMES frames: libzmq
 * delivers a multipart message atomically, so once its first frame is read
 * the rest are already queued; frames past the limit are read one at a time
 * into a scratch zmq_msg_t and released at once, and the message is then
 * rejected. Whatever the outcome, a call that got a first frame consumes the
 * whole message, so the next call starts on a message boundary.
 */
#include <errno.h>
#include <string.h>

#include "proto/proto.h"

/* Maps a zmq errno to our convention; `what` names the operation. */
static k3_status zmq_fail(const char *what, char *err, size_t errlen) {
    int e = zmq_errno();
    if (e == EAGAIN)
        return k3_errf(K3_ERR_TIMEOUT, err, errlen, "%s: would block (no message, HWM or timeout)",
                       what);
    if (e == EINTR) return k3_errf(K3_ERR_CANCEL, err, errlen, "%s: interrupted by a signal", what);
    return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", what, zmq_strerror(e));
}

/* ZMQ_TYPE decides whether a routing id frame leads the message: only a
 * ROUTER adds one on receive and needs one on send. */
static int sock_type(void *s) {
    int t = -1;
    size_t len = sizeof t;
    if (zmq_getsockopt(s, ZMQ_TYPE, &t, &len) != 0) return -1;
    return t;
}

k3_status proto_socket_limit(void *zsock, char *err, size_t errlen) {
    int64_t max = (int64_t)K3_PROTO_MAX_FRAME_BYTES;
    if (zmq_setsockopt(zsock, ZMQ_MAXMSGSIZE, &max, sizeof max) != 0)
        return zmq_fail("setsockopt ZMQ_MAXMSGSIZE", err, errlen);
    return K3_OK;
}

k3_status proto_send(void *zsock, const proto_peer *to, const proto_msg *m,
                     const void *const *frames, const size_t *frame_bytes, int n_frames, int flags,
                     char *err, size_t errlen) {
    if (n_frames < 0 || n_frames > K3_PROTO_MAX_FRAMES - 1 ||
        (n_frames && (!frames || !frame_bytes)))
        return k3_errf(K3_ERR_ARG, err, errlen, "proto_send: %d tensor frames (0..%d with data)",
                       n_frames, K3_PROTO_MAX_FRAMES - 1);
    if (flags & ~ZMQ_DONTWAIT)
        return k3_errf(K3_ERR_ARG, err, errlen, "proto_send: flags 0x%x (only ZMQ_DONTWAIT)",
                       flags);
    for (int i = 0; i < n_frames; i++)
        if (!frames[i] && frame_bytes[i])
            return k3_errf(K3_ERR_ARG, err, errlen, "proto_send: frame %d is NULL with %zu bytes",
                           i + 1, frame_bytes[i]);
    /* arguments, then the peer, then the message: all before any send */
    int type = sock_type(zsock);
    if (type < 0) return zmq_fail("proto_send: getsockopt ZMQ_TYPE", err, errlen);
    bool router = type == ZMQ_ROUTER;
    if (router && (!to || to->len == 0 || to->len > PROTO_MAX_PEER_ID))
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "proto_send: a ROUTER socket needs the peer's routing id (1..%d bytes)",
                       PROTO_MAX_PEER_ID);
    if (!router && to && to->len)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "proto_send: routing id given for a non-ROUTER socket");

    /* Validate everything before the first byte leaves. */
    uint8_t env[PROTO_ENCODE_CAP];
    size_t env_len;
    k3_status st = proto_encode(m, env, sizeof env, &env_len, err, errlen);
    if (st) return st;
    st = proto_check_frames(m, frame_bytes, n_frames, err, errlen);
    if (st) {
        k3_err_prefix(err, errlen, "proto_send");
        return st;
    }

    /* Once the first part is queued libzmq accepts the rest of the message
     * (the HWM counts whole messages), so only the first part may block. */
    int part = 0;
    if (router) {
        if (zmq_send(zsock, to->id, to->len, ZMQ_SNDMORE | flags) < 0)
            return zmq_fail("send routing id", err, errlen);
        part++;
    }
    if (zmq_send(zsock, env, env_len, (n_frames ? ZMQ_SNDMORE : 0) | (part ? 0 : flags)) < 0) {
        if (part) goto broken;
        return zmq_fail("send envelope", err, errlen);
    }
    part++;
    for (int i = 0; i < n_frames; i++, part++)
        if (zmq_send(zsock, frames[i], frame_bytes[i], i + 1 < n_frames ? ZMQ_SNDMORE : 0) < 0)
            goto broken;
    return K3_OK;

broken:
    /* A multipart message cannot be withdrawn half-sent. */
    return k3_errf(K3_ERR_IO, err, errlen,
                   "send %s: part %d failed after the first: %s (socket state undefined: close it)",
                   proto_type_name(m->type), part + 1, zmq_strerror(zmq_errno()));
}

/* Closing a zmq_msg_t releases its buffer (or drops a reference to a shared
 * one); frames [0, n) are the initialized ones. */
void proto_frames_close(proto_frames *fr) {
    if (!fr) return;
    for (int i = 0; i < fr->n; i++) zmq_msg_close(&fr->part[i]);
    fr->n = 0;
}

const void *proto_frames_data(const proto_frames *fr, int i, size_t *bytes) {
    if (!fr || i < 0 || i >= fr->n) {
        if (bytes) *bytes = 0;
        return NULL;
    }
    zmq_msg_t *p = (zmq_msg_t *)&fr->part[i]; /* zmq's accessors take non-const */
    if (bytes) *bytes = zmq_msg_size(p);
    return zmq_msg_data(p);
}

/* Receives the next part of a message already being read: it is queued, so
 * this does not block; EINTR is retried so a signal cannot desynchronise. */
static int recv_part(zmq_msg_t *msg, void *zsock) {
    for (;;) {
        int rc = zmq_msg_recv(msg, zsock, 0);
        if (rc >= 0 || zmq_errno() != EINTR) return rc;
    }
}

/* Reads and releases the rest of the current message; returns how many
 * parts it dropped, or -1 on a socket error. */
static long drain(void *zsock) {
    long n = 0;
    for (bool more = true; more;) {
        zmq_msg_t scratch;
        zmq_msg_init(&scratch);
        if (recv_part(&scratch, zsock) < 0) {
            int e = zmq_errno(); /* for the caller's zmq_fail */
            zmq_msg_close(&scratch);
            errno = e;
            return -1;
        }
        more = zmq_msg_more(&scratch);
        zmq_msg_close(&scratch);
        n++;
    }
    return n;
}

k3_status proto_recv(void *zsock, int flags, proto_msg *out, proto_frames *fr, char *err,
                     size_t errlen) {
    /* a reused fr gives back the previous message's frames first */
    memset(out, 0, sizeof *out);
    proto_frames_close(fr);
    memset(&fr->from, 0, sizeof fr->from);
    if (flags & ~ZMQ_DONTWAIT)
        return k3_errf(K3_ERR_ARG, err, errlen, "proto_recv: flags 0x%x (only ZMQ_DONTWAIT)",
                       flags);
    int type = sock_type(zsock);
    if (type < 0) return zmq_fail("proto_recv: getsockopt ZMQ_TYPE", err, errlen);

    zmq_msg_t env;
    zmq_msg_init(&env);
    if (zmq_msg_recv(&env, zsock, flags) < 0) {
        k3_status st = zmq_fail("receive", err, errlen);
        zmq_msg_close(&env);
        return st;
    }
    /* From here on, every path consumes the rest of the message. */
    k3_status st = K3_OK;
    if (type == ZMQ_ROUTER) { /* frame 0 is the sender's routing id */
        size_t n = zmq_msg_size(&env);
        fr->from.len = n < PROTO_MAX_PEER_ID ? n : PROTO_MAX_PEER_ID;
        memcpy(fr->from.id, zmq_msg_data(&env), fr->from.len);
        bool more = zmq_msg_more(&env);
        zmq_msg_close(&env);
        if (!more)
            return k3_errf(K3_ERR_PROTO, err, errlen, "message holds a routing id and no envelope");
        zmq_msg_init(&env);
        if (recv_part(&env, zsock) < 0) {
            st = zmq_fail("receive envelope", err, errlen);
            zmq_msg_close(&env);
            return st;
        }
    }

    /* Tensor frames, up to the limit; the rest drained unbuffered. */
    bool more = zmq_msg_more(&env);
    long n_parts = 1;
    while (more && n_parts < K3_PROTO_MAX_FRAMES) {
        zmq_msg_t *p = &fr->part[fr->n];
        zmq_msg_init(p);
        if (recv_part(p, zsock) < 0) {
            st = zmq_fail("receive tensor frame", err, errlen);
            zmq_msg_close(p);
            goto fail;
        }
        fr->n++;
        n_parts++;
        more = zmq_msg_more(p);
    }
    if (more) {
        long extra = drain(zsock);
        if (extra < 0) {
            st = zmq_fail("drain frames", err, errlen);
            goto fail;
        }
        /* still read the id, so the ERROR reply can carry it */
        char ignore[8];
        proto_decode(zmq_msg_data(&env), zmq_msg_size(&env), out, ignore, sizeof ignore);
        st = k3_errf(K3_ERR_LIMIT, err, errlen,
                     "message has %ld frames > limit %d (K3_PROTO_MAX_FRAMES)", n_parts + extra,
                     K3_PROTO_MAX_FRAMES);
        goto fail;
    }

    /* whole message in hand: envelope size, decode, then the frame sizes
     * against what the envelope declares */
    size_t env_len = zmq_msg_size(&env);
    if (env_len > K3_PROTO_MAX_ENVELOPE) {
        st = k3_errf(K3_ERR_LIMIT, err, errlen,
                     "envelope: %zu bytes > limit %d (K3_PROTO_MAX_ENVELOPE)", env_len,
                     K3_PROTO_MAX_ENVELOPE);
        goto fail;
    }
    st = proto_decode(zmq_msg_data(&env), env_len, out, err, errlen);
    if (st) goto fail;

    size_t sizes[K3_PROTO_MAX_FRAMES];
    for (int i = 0; i < fr->n; i++) sizes[i] = zmq_msg_size(&fr->part[i]);
    st = proto_check_frames(out, sizes, fr->n, err, errlen);
    if (st) goto fail;
    zmq_msg_close(&env);
    return K3_OK;

fail:
    memset(&out->u, 0, sizeof out->u); /* keep type and id for the reply */
    zmq_msg_close(&env);
    proto_frames_close(fr);
    return st;
}
