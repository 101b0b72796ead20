/* proto/proto.h: the k3shard wire protocol, version 1.3 (docs/PROTOCOL.md).
 *
 * Owns: the message types (a tagged union of plain data, no pointers), the
 * msgpack envelope codec (only proto/ includes msgpack.h), every syntactic
 * and range check of docs/PROTOCOL.md sections 3-6, the checks a receiver
 * makes with its own limits (section 8 step 10), reply matching, HELLO
 * compatibility, and whole-message send/receive on a ZeroMQ socket with the
 * frame count and frame size limits enforced while receiving.
 * Borrows: the caller's zmq socket (never created, closed or configured
 * here beyond proto_socket_limit) and the tensor data given to proto_send
 * (copied into libzmq before it returns). A proto_frames owns the received
 * tensor frames (zmq_msg_t) until proto_frames_close.
 * Threads: all functions are reentrant. A zmq socket is used by one thread at
 * a time (libzmq's rule), so proto_send/proto_recv on one socket must not run
 * concurrently.
 */
#ifndef K3_PROTO_H
#define K3_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "common/base/err.h"
#include "common/base/limits.h"

#define PROTO_VERSION_MAJOR 1
#define PROTO_VERSION_MINOR 3

/* Bytes an encoded envelope may need: every v1 message at its field limits
 * fits (the largest, ERROR with a 4095-byte msg, is ~4.2 KB; tested). */
#define PROTO_ENCODE_CAP 8192

/* FORWARD flags. Unknown bits are rejected. */
#define PROTO_FWD_STATS     1u /* FORWARD_DONE carries the per-step stats group */
#define PROTO_FWD_FLAGS_ALL PROTO_FWD_STATS

/* A ZeroMQ routing id is at most 255 bytes (ZMTP). */
#define PROTO_MAX_PEER_ID 255

/* Wire type codes ("t"). Stable: never renumbered or reused. */
typedef enum proto_type {
    PROTO_MSG_NONE = 0, /* not a valid wire type: "nothing decoded" */
    PROTO_MSG_HELLO = 1,
    PROTO_MSG_HELLO_OK = 2,
    PROTO_MSG_FORWARD = 3,
    PROTO_MSG_FORWARD_DONE = 4,
    PROTO_MSG_SESSION_RESET = 5,
    PROTO_MSG_SESSION_TRUNCATE = 6,
    PROTO_MSG_SESSION_DROP = 7,
    PROTO_MSG_OK = 8,
    PROTO_MSG_ERROR = 9,
    PROTO_MSG_CANCEL = 10,
    PROTO_MSG_STATS = 11,
    PROTO_MSG_STATS_OK = 12,
    PROTO_MSG_SHUTDOWN = 13,
    PROTO_MSG_HEARTBEAT = 14,
    PROTO_MSG_CHECKPOINT = 15,  /* 1.2 (PROTOCOL.md "Checkpoints") */
    PROTO_MSG_RESTORE = 16,     /* 1.2; key 1.3 */
    PROTO_MSG_EXPERT_CALL = 17, /* 1.2: worker -> stripe peer (PROTOCOL.md "Expert calls") */
    PROTO_MSG_EXPERT_DONE = 18,
    PROTO_MSG_COUNT /* one past the last */
} proto_type;

/* Numeric settings both sides must agree on exactly (PROTOCOL.md 4). */
typedef struct proto_numerics {
    uint32_t bits;      /* K3_BITS: 4, 8 or 32 */
    uint32_t mla_bits;  /* K3_MLA_BITS: 4, 8 or 32 */
    uint32_t head_bits; /* K3_HEAD_BITS: 4, 8 or 32 */
    uint32_t isa;       /* k3_isa in use: 0 scalar, 1 AVX2, 2 AVX-512 */
    bool idot;          /* K3_IDOT: int8-activation expert kernels */
    bool dense_idot;    /* K3_DENSE_IDOT: int8-activation dense kernels */
    bool exact;         /* the engine's exact-numerics switch */
} proto_numerics;

typedef struct proto_hello {       /* C -> W */
    uint64_t fingerprint;          /* model fingerprint the coordinator expects */
    proto_numerics num;            /* settings the coordinator expects */
    char build[K3_PROTO_MAX_NAME]; /* coordinator build identity, NUL-terminated */
} proto_hello;

typedef struct proto_hello_ok {    /* W -> C */
    uint64_t fingerprint;          /* the worker's model fingerprint */
    uint32_t layers[2];            /* half-open layer range [a, b) */
    proto_numerics num;            /* the worker's settings */
    uint32_t max_sessions;         /* session states before eviction */
    uint32_t max_ctx;              /* tokens per session */
    double read_gbps;              /* measured drive read GB/s, 0 = not measured */
    char build[K3_PROTO_MAX_NAME]; /* worker build identity */
    char name[K3_PROTO_MAX_NAME];  /* worker name, non-empty */
    uint32_t stripe;               /* 1.2, optional (absent = 0): placement drives whose
                                      experts it serves to other stages (bit d), PROTOCOL.md
                                      "Expert calls" */
} proto_hello_ok;

typedef struct proto_forward { /* C -> W; frames blocks [nb][T][D], hidden [T][D] */
    uint64_t session;          /* "sess", >= 1 */
    uint64_t step;             /* the session's step counter, echoed */
    uint32_t pos0;             /* first position; pos0 + T <= K3_MAX_CTX */
    uint32_t n_tokens;         /* "T", 1..K3_MAX_CHUNK */
    uint32_t n_blocks;         /* "nb", 0..K3_MAX_RES_ENTRIES */
    uint32_t hidden;           /* "D", 1..K3_MAX_HIDDEN */
    uint32_t flags;            /* PROTO_FWD_* */
} proto_forward;

typedef struct proto_forward_done {         /* W -> C; frames snapshots [k][T][D], hidden [T][D] */
    uint64_t session, step;                 /* echoed from the FORWARD */
    uint32_t n_snapshots;                   /* "k", 0..K3_MAX_RES_ENTRIES */
    uint32_t n_tokens;                      /* "T", echoed */
    uint32_t hidden;                        /* "D", echoed */
    uint32_t n_evicted;                     /* entries of evicted[], 0..K3_PROTO_MAX_EVICTED */
    uint64_t evicted[K3_PROTO_MAX_EVICTED]; /* session ids whose state was evicted */
    bool has_stats;                         /* the stats group below is present */
    double compute_ms;                      /* wall time in layer math */
    double read_ms;                         /* time waiting on expert reads */
    uint64_t bytes_read;                    /* expert bytes read from disk */
    uint64_t expert_hits;                   /* "hits" */
    uint64_t expert_misses;                 /* "misses" */
    /* 1.2, optional members of the stats group (absent = 0): expert striping */
    uint32_t n_drives;                 /* entries of drive_bytes, 0..K3_MAX_DIRS */
    uint64_t drive_bytes[K3_MAX_DIRS]; /* bytes each placement drive gave this worker
                                          during the step (calls it served included) */
    double gather_ms;                  /* waiting on stripe peers' expert calls */
    uint64_t gather_layers;            /* "xlayers": MoE layer steps that called a peer */
    /* 1.2, optional members of the stats group (absent = 0): the worker's
     * Vulkan expert tier during this step (docs/VULKAN.md "Stats") */
    uint64_t vk_calls, vk_pairs;                /* expert calls / pairs computed on the device */
    uint64_t vk_promotions;                     /* experts uploaded during the step */
    uint32_t vk_resident;                       /* experts on the device at the step's end */
    double vk_device_ms, vk_cpu_ms, vk_wait_ms; /* the step's MoE device / CPU / wait time */
} proto_forward_done;

typedef struct proto_session_op { /* SESSION_RESET, SESSION_TRUNCATE, SESSION_DROP */
    uint64_t session;             /* "sess", >= 1 */
    uint32_t n_tokens;            /* "n", TRUNCATE only (0 in the others): tokens to keep */
} proto_session_op;

typedef struct proto_cancel { /* exactly one of the two is nonzero */
    uint64_t request;         /* "req": request id to cancel */
    uint64_t session;         /* "sess": cancel every request of this session */
} proto_cancel;

typedef struct proto_stats_ok { /* cumulative since the worker started */
    uint64_t forwards, tokens, bytes_read;
    uint64_t expert_hits, expert_misses; /* "hits", "misses" */
    uint64_t evictions, proto_errors;
    uint32_t sessions; /* session states held now */
    double busy_ms;    /* total compute time */
    double read_ms;    /* total time waiting on reads */
    /* version next, optional (absent = 0 / ""): the worker's identity, so a
     * STATS probe (epoch 0, PROTOCOL.md 9) answers `k3-coordinator status`
     * without registering */
    char name[K3_PROTO_MAX_NAME];  /* worker name */
    char build[K3_PROTO_MAX_NAME]; /* worker build identity */
    char dirs[K3_PROTO_MAX_NAME];  /* shard directories it reads, comma-separated */
    uint32_t layers[2];            /* half-open layer range [a, b) */
    double read_gbps;              /* measured drive read GB/s, 0 = not measured */
    double uptime_s;               /* seconds since the worker started */
    bool registered;               /* a coordinator's HELLO is current (epoch != 0) */
    /* optional (1.2): the worker's Vulkan expert tier (docs/VULKAN.md "Stats"), 0 = none */
    uint64_t vk_calls, vk_pairs;                /* expert calls / pairs on the device */
    uint64_t vk_promotions, vk_evictions;       /* residency changes during the run */
    uint32_t vk_resident;                       /* experts on the device now */
    double vk_device_ms, vk_cpu_ms, vk_wait_ms; /* per MoE step, summed */
    bool vk_off;                                /* the device failed: CPU alone */

    /* optional too: with --placement, each placement drive and its share of
     * the worker's experts, "DRIVE:PCT%,..."; "" = no placement (see dirs) */
    char stripe[K3_PROTO_MAX_NAME];
} proto_stats_ok;

typedef struct proto_ckpt { /* CHECKPOINT, RESTORE (1.2, PROTOCOL.md "Checkpoints") */
    uint64_t session;       /* "sess", >= 1 */
    uint32_t pos;           /* "n": the checkpoint's position (CHECKPOINT: the session's) */
    uint32_t keep;          /* "keep", CHECKPOINT only (0 in RESTORE): checkpoints the
                               coordinator keeps for the session, 1..K3_MAX_CKPT */
    uint64_t key;           /* "key" (1.3, optional, 0 = none): the checkpoint's key
                               (common/engine/ckpt_store.h k3_ckpt_key): CHECKPOINT parks it
                               on the worker's disk too, RESTORE may load it from there */
} proto_ckpt;

typedef struct proto_heartbeat {
    uint64_t busy_request; /* "req": request being computed, 0 = idle */
} proto_heartbeat;

/* EXPERT_CALL (worker -> the worker serving a drive's stripe, PROTOCOL.md
 * "Expert calls"): the latent MoE input rows of one layer and, per routed
 * expert of that drive, which rows chose it. Frames: z [P][LT] f32, ids [n]
 * i32 (ascending), counts [n] i32 (rows per expert, >= 1, summing to R),
 * rows [R] i32 (indexes into z, ascending within an expert). */
typedef struct proto_expert_call {
    uint32_t layer;     /* MoE layer */
    uint32_t drive;     /* the placement drive the caller expects the peer to serve */
    uint32_t n_rows;    /* "P": rows of z, 1..K3_MAX_CHUNK */
    uint32_t latent;    /* "LT": 1..K3_MAX_HIDDEN */
    uint32_t n_experts; /* "n": 1..K3_MAX_EXPERTS */
    uint32_t n_pairs;   /* "R": (row, expert) pairs, n..K3_MAX_CHUNK * K3_MAX_TOPK */
} proto_expert_call;

/* EXPERT_DONE (peer -> caller): the unweighted output of every (row,
 * expert) pair of the call, in the call's order; frame y [R][LT] f32. The
 * caller weighs and sums them in expert-id order itself. */
typedef struct proto_expert_done {
    uint32_t layer, drive;  /* echoed */
    uint32_t n_pairs;       /* "R", echoed */
    uint32_t latent;        /* "LT", echoed */
    double compute_ms;      /* expert math on the peer */
    double read_ms;         /* waiting on its drive */
    uint64_t bytes_read;    /* expert bytes it read */
    uint64_t expert_hits;   /* "hits" */
    uint64_t expert_misses; /* "misses" */
} proto_expert_done;

typedef struct proto_error {
    uint32_t code;              /* a k3_status, 1..K3_ERR_INTERNAL */
    uint64_t session;           /* "sess" of the failed FORWARD, else 0 */
    uint64_t step;              /* "step" of the failed FORWARD, else 0 */
    char msg[K3_PROTO_MAX_STR]; /* NUL-terminated, no control characters */
} proto_error;

/* One message's envelope. OK, STATS and SHUTDOWN have no body. */
typedef struct proto_msg {
    proto_type type;
    uint16_t ver_major, ver_minor; /* decode: the sender's; encode writes ours */
    uint64_t id;                   /* request id (PROTOCOL.md 7) */
    uint64_t epoch;                /* "ep": link epoch */
    uint32_t n_ignored;            /* decode: unknown keys ignored (newer minor) */
    union {
        proto_hello hello;
        proto_hello_ok hello_ok;
        proto_forward forward;
        proto_forward_done forward_done;
        proto_session_op session; /* the three SESSION_* types */
        proto_cancel cancel;
        proto_stats_ok stats_ok;
        proto_heartbeat heartbeat;
        proto_error error;
        proto_expert_call expert_call; /* 1.2 */
        proto_expert_done expert_done; /* 1.2 */
        proto_ckpt ckpt;               /* CHECKPOINT, RESTORE */
    } u;
} proto_msg;

/* "FORWARD", ...; "?" for a code outside the enum. Never NULL. */
const char *proto_type_name(proto_type t);

/* Zeroes *m and sets type, id, epoch and our version. */
void proto_msg_init(proto_msg *m, proto_type type, uint64_t id, uint64_t epoch);

/* Field-by-field equality of type, id, epoch and the type's wire fields
 * (floats compared bit for bit). Ignores ver_* and n_ignored. */
bool proto_msg_equal(const proto_msg *a, const proto_msg *b);

/* ---- codec ---- */

/* Non-allocating structural scan of msgpack bytes (PROTOCOL.md 3): exactly
 * one complete object, depth <= K3_PROTO_MAX_DEPTH, objects <=
 * K3_PROTO_MAX_OBJECTS, every count and length within the remaining bytes,
 * no 0xc1, no trailing bytes. proto_decode runs it first. */
k3_status proto_prescan(const uint8_t *buf, size_t len, char *err, size_t errlen);

/* Decodes and validates frame 0. On failure out->type and out->id hold the
 * message's type and id if they could be read (else 0), for the ERROR reply;
 * the body is zeroed. */
k3_status proto_decode(const uint8_t *env, size_t len, proto_msg *out, char *err, size_t errlen);

/* Validates m (the same rules as decode) and encodes it into buf[cap],
 * setting *len. PROTO_ENCODE_CAP bytes are always enough. */
k3_status proto_encode(const proto_msg *m, uint8_t *buf, size_t cap, size_t *len, char *err,
                       size_t errlen);

/* The ranges and cross-field rules of PROTOCOL.md 4 (decode and encode run
 * it; exposed for callers that build messages by hand). */
k3_status proto_validate(const proto_msg *m, char *err, size_t errlen);

/* ---- tensor frames (PROTOCOL.md 6) ---- */

/* Expected tensor frames after the envelope: *n_frames and bytes[i], with
 * 64-bit overflow checks and the K3_PROTO_MAX_FRAME_BYTES limit. */
k3_status proto_frame_layout(const proto_msg *m, int *n_frames, uint64_t bytes[K3_PROTO_MAX_FRAMES],
                             char *err, size_t errlen);

/* Fails unless the frame count and every size equal the layout exactly. */
k3_status proto_check_frames(const proto_msg *m, const size_t *frame_bytes, int n_frames, char *err,
                             size_t errlen);

/* ---- receiver checks ---- */

/* The receiver's own limits (all must be > 0). */
typedef struct proto_limits {
    uint32_t hidden;     /* the model's hidden size: D must equal it */
    uint32_t max_ctx;    /* tokens per session: pos0 + T, TRUNCATE n */
    uint32_t max_chunk;  /* T */
    uint32_t max_blocks; /* nb of FORWARD, k of FORWARD_DONE */
} proto_limits;

/* PROTOCOL.md 8 step 10 for FORWARD, FORWARD_DONE and SESSION_TRUNCATE (other
 * types pass): K3_ERR_MISMATCH for D, K3_ERR_LIMIT for the rest. */
k3_status proto_check_limits(const proto_msg *m, const proto_limits *lim, char *err, size_t errlen);

/* Does rep answer req? Type must be req's reply type or ERROR (else
 * K3_ERR_PROTO); id and epoch must match (else K3_ERR_STATE: a stale or
 * foreign reply, to drop and count); FORWARD_DONE must echo sess, step, T
 * and D, and an ERROR must carry the FORWARD's sess and step (0, 0 for
 * other requests) (else K3_ERR_PROTO). K3_ERR_ARG if req is not a request. */
k3_status proto_check_reply(const proto_msg *req, const proto_msg *rep, char *err, size_t errlen);

/* HELLO compatibility: K3_ERR_MISMATCH naming the first differing item and
 * both values ("model fingerprint mismatch: expected 0x..., got 0x..."). */
k3_status proto_check_compat(uint64_t want_fp, const proto_numerics *want, uint64_t got_fp,
                             const proto_numerics *got, char *err, size_t errlen);

/* ---- ZeroMQ (proto/proto_zmq.c) ---- */

/* A ROUTER peer's routing id (len 0 on other socket types). */
typedef struct proto_peer {
    uint8_t id[PROTO_MAX_PEER_ID];
    size_t len;
} proto_peer;

/* Received tensor frames. A zeroed struct is valid and empty; proto_recv
 * releases what it held before receiving; proto_frames_close releases all.
 * A value struct (not opened/closed through T **) so a socket loop can keep
 * one on its stack and reuse it for every message. */
typedef struct proto_frames {
    int n;                                   /* tensor frames held */
    zmq_msg_t part[K3_PROTO_MAX_FRAMES - 1]; /* [0, n) initialized, owned */
    proto_peer from;                         /* sender's routing id on a ROUTER */
} proto_frames;

/* Sets ZMQ_MAXMSGSIZE to K3_PROTO_MAX_FRAME_BYTES: libzmq then drops a peer
 * that sends a bigger frame before allocating it. Call before bind/connect. */
k3_status proto_socket_limit(void *zsock, char *err, size_t errlen);

/* Sends m and its tensor frames as one multipart message. The envelope is
 * validated and the frames checked against the layout before anything is
 * sent. On a ROUTER socket `to` names the peer (required); elsewhere it must
 * be NULL. flags: 0 or ZMQ_DONTWAIT. Errors: K3_ERR_TIMEOUT (EAGAIN: HWM
 * reached or SNDTIMEO passed; nothing sent), K3_ERR_CANCEL (EINTR), K3_ERR_IO
 * (other socket errors; if a frame after the first fails the socket is in an
 * undefined state and should be closed), validation errors (nothing sent). */
k3_status proto_send(void *zsock, const proto_peer *to, const proto_msg *m,
                     const void *const *frames, const size_t *frame_bytes, int n_frames, int flags,
                     char *err, size_t errlen);

/* Receives one whole multipart message. flags: 0 or ZMQ_DONTWAIT.
 * K3_ERR_TIMEOUT: no message (EAGAIN), K3_ERR_CANCEL: interrupted (EINTR),
 * K3_ERR_IO: socket error; nothing was consumed in these three cases. Any
 * other failure means one whole message was consumed and rejected: frames
 * beyond K3_PROTO_MAX_FRAMES are drained one at a time without buffering,
 * fr holds no frames, fr->from names the sender and out->type/out->id hold
 * what could be read, so the caller can answer ERROR. On K3_OK fr holds the
 * tensor frames, already checked against the layout. */
k3_status proto_recv(void *zsock, int flags, proto_msg *out, proto_frames *fr, char *err,
                     size_t errlen);

/* Tensor frame i (0-based, after the envelope) and its size; NULL if out of
 * range. The data may be unaligned (see PROTOCOL.md 1). */
const void *proto_frames_data(const proto_frames *fr, int i, size_t *bytes);

/* Releases every held frame; fr stays usable. Accepts NULL. */
void proto_frames_close(proto_frames *fr);

#endif
