/* proto/proto.c: message schema, envelope encode/decode and validation
 * (docs/PROTOCOL.md sections 2-9). The pre-scan lives in msgpack_scan.c and
 * the socket helpers in proto_zmq.c.
 *
 * One table per message type (field_desc) drives encode, decode, validation
 * and equality, so the four can never disagree about a key, its type or its
 * range. Decode runs: pre-scan (no allocation) -> msgpack_unpack_next (must
 * be SUCCESS with every byte used) -> schema walk over the msgpack_object
 * map -> proto_validate (the same rules encode applies before sending).
 */
#include <inttypes.h>
#include <math.h>
#include <msgpack.h>
#include <stdio.h>
#include <string.h>

#include "proto/proto.h"

/* Error codes travel as k3_status values (PROTOCOL.md 4): reordering the
 * enum must break the build, not the wire. */
_Static_assert(K3_OK == 0 && K3_ERR_ARG == 1 && K3_ERR_IO == 2 && K3_ERR_FORMAT == 3 &&
                   K3_ERR_LIMIT == 4 && K3_ERR_NOMEM == 5 && K3_ERR_MISSING == 6 &&
                   K3_ERR_MISMATCH == 7 && K3_ERR_PROTO == 8 && K3_ERR_STATE == 9 &&
                   K3_ERR_TIMEOUT == 10 && K3_ERR_AUTH == 11 && K3_ERR_CANCEL == 12 &&
                   K3_ERR_BUSY == 13 && K3_ERR_INTERNAL == 14,
               "k3_status values are protocol error codes: see docs/PROTOCOL.md 4");
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tensor frames are little-endian f32 (docs/PROTOCOL.md 1): big-endian hosts unsupported"
#endif

static const char *const type_names[PROTO_MSG_COUNT] = {
    [PROTO_MSG_NONE] = "NONE",
    [PROTO_MSG_HELLO] = "HELLO",
    [PROTO_MSG_HELLO_OK] = "HELLO_OK",
    [PROTO_MSG_FORWARD] = "FORWARD",
    [PROTO_MSG_FORWARD_DONE] = "FORWARD_DONE",
    [PROTO_MSG_SESSION_RESET] = "SESSION_RESET",
    [PROTO_MSG_SESSION_TRUNCATE] = "SESSION_TRUNCATE",
    [PROTO_MSG_SESSION_DROP] = "SESSION_DROP",
    [PROTO_MSG_OK] = "OK",
    [PROTO_MSG_ERROR] = "ERROR",
    [PROTO_MSG_CANCEL] = "CANCEL",
    [PROTO_MSG_STATS] = "STATS",
    [PROTO_MSG_STATS_OK] = "STATS_OK",
    [PROTO_MSG_SHUTDOWN] = "SHUTDOWN",
    [PROTO_MSG_HEARTBEAT] = "HEARTBEAT",
    [PROTO_MSG_EXPERT_CALL] = "EXPERT_CALL",
    [PROTO_MSG_EXPERT_DONE] = "EXPERT_DONE",
    [PROTO_MSG_CHECKPOINT] = "CHECKPOINT",
    [PROTO_MSG_RESTORE] = "RESTORE",
};

const char *proto_type_name(proto_type t) {
    if ((int)t < 0 || t >= PROTO_MSG_COUNT || !type_names[t]) return "?"; /* reserved codes */
    return type_names[t];
}

void proto_msg_init(proto_msg *m, proto_type type, uint64_t id, uint64_t epoch) {
    memset(m, 0, sizeof *m);
    m->type = type;
    m->ver_major = PROTO_VERSION_MAJOR;
    m->ver_minor = PROTO_VERSION_MINOR;
    m->id = id;
    m->epoch = epoch;
}

/* ---- the schema ---- */

typedef enum field_kind {
    FK_U64,  /* uint64_t */
    FK_U32,  /* uint32_t */
    FK_BOOL, /* bool */
    FK_F64,  /* double, float64 on the wire, finite and >= 0 */
    FK_STR,  /* char[aux], NUL-terminated, UTF-8 without control characters */
    FK_PAIR, /* uint32_t[2], a 2-element array on the wire */
    FK_LIST  /* uint64_t[hi], count in the uint32_t at offset aux */
} field_kind;

#define FD_STATS 1u /* member of FORWARD_DONE's all-or-none stats group */
#define FD_BITS  2u /* value must be 4, 8 or 32 */
#define FD_V11   4u /* added in 1.1: a 1.0 sender omits it (decoded as 0 / false) */
#define FD_OPT   8u /* version next: optional, absent decodes as 0 / "" (STATS_OK's identity) */

typedef struct field_desc {
    const char *key; /* wire key */
    field_kind kind;
    unsigned flags;    /* FD_* */
    size_t off;        /* offsetof(proto_msg, ...) of the value */
    size_t aux;        /* FK_STR: buffer bytes; FK_LIST: offset of the count */
    uint64_t lo, hi;   /* integers, pair and list elements: value range;
                          FK_STR: length range; FK_LIST: hi = max count,
                          lo = minimum element */
    const char *limit; /* name of the limit behind hi, for messages */
} field_desc;

#define OFF(member) offsetof(proto_msg, u.member)
#define F_U64(k, m, lo, hi, lim)                                                                   \
    { k, FK_U64, 0, OFF(m), 0, lo, hi, lim }
#define F_U32(k, m, lo, hi, lim)                                                                   \
    { k, FK_U32, 0, OFF(m), 0, lo, hi, lim }
#define F_BOOL(k, m)                                                                               \
    { k, FK_BOOL, 0, OFF(m), 0, 0, 1, NULL }
#define F_F64(k, m)                                                                                \
    { k, FK_F64, 0, OFF(m), 0, 0, 0, NULL }
#define F_STR(k, m, lo)                                                                            \
    {                                                                                              \
        k, FK_STR, 0, OFF(m), sizeof(((proto_msg *)0)->u.m), lo,                                   \
            sizeof(((proto_msg *)0)->u.m) - 1, NULL                                                \
    }
#define ANY UINT64_MAX
#define NUM_FIELDS(s)                                                                              \
    {"bits", FK_U32, FD_BITS, OFF(s.num.bits), 0, 4, 32, NULL},                                    \
        {"mla_bits", FK_U32, FD_BITS, OFF(s.num.mla_bits), 0, 4, 32, NULL},                        \
        {"head_bits", FK_U32, FD_BITS, OFF(s.num.head_bits), 0, 4, 32, NULL},                      \
        F_BOOL("idot", s.num.idot),                                                                \
        {"dense_idot", FK_BOOL, FD_V11, OFF(s.num.dense_idot), 0, 0, 1, NULL},                     \
        F_U32("isa", s.num.isa, 0, 2, NULL), F_BOOL("exact", s.num.exact)

/* Per type, in wire order. Ranges are the global ones of common/base/limits.h;
 * the receiver applies its own with proto_check_limits. */
static const field_desc f_hello[] = {
    F_U64("fp", hello.fingerprint, 0, ANY, NULL),
    F_STR("build", hello.build, 0),
    NUM_FIELDS(hello),
};
static const field_desc f_hello_ok[] = {
    F_U64("fp", hello_ok.fingerprint, 0, ANY, NULL),
    {"layers", FK_PAIR, 0, OFF(hello_ok.layers), 0, 0, K3_MAX_LAYERS, "K3_MAX_LAYERS"},
    NUM_FIELDS(hello_ok),
    F_STR("build", hello_ok.build, 0),
    F_STR("name", hello_ok.name, 1),
    F_U32("max_sess", hello_ok.max_sessions, 1, K3_MAX_SESSIONS, "K3_MAX_SESSIONS"),
    F_U32("max_ctx", hello_ok.max_ctx, 1, K3_MAX_CTX, "K3_MAX_CTX"),
    F_F64("read_gbps", hello_ok.read_gbps),
    {"stripe", FK_U32, FD_OPT, OFF(hello_ok.stripe), 0, 0, (1ull << K3_MAX_DIRS) - 1,
     "K3_MAX_DIRS drives"}, /* 1.2 */
};
static const field_desc f_forward[] = {
    F_U64("sess", forward.session, 1, ANY, NULL),
    F_U64("step", forward.step, 0, ANY, NULL),
    F_U32("pos0", forward.pos0, 0, K3_MAX_CTX - 1, "K3_MAX_CTX - 1"),
    F_U32("T", forward.n_tokens, 1, K3_MAX_CHUNK, "K3_MAX_CHUNK"),
    F_U32("nb", forward.n_blocks, 0, K3_MAX_RES_ENTRIES, "K3_MAX_RES_ENTRIES"),
    F_U32("D", forward.hidden, 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"),
    F_U32("flags", forward.flags, 0, UINT32_MAX, NULL),
};
static const field_desc f_forward_done[] = {
    F_U64("sess", forward_done.session, 1, ANY, NULL),
    F_U64("step", forward_done.step, 0, ANY, NULL),
    F_U32("k", forward_done.n_snapshots, 0, K3_MAX_RES_ENTRIES, "K3_MAX_RES_ENTRIES"),
    F_U32("T", forward_done.n_tokens, 1, K3_MAX_CHUNK, "K3_MAX_CHUNK"),
    F_U32("D", forward_done.hidden, 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"),
    {"evicted", FK_LIST, 0, OFF(forward_done.evicted), OFF(forward_done.n_evicted), 1,
     K3_PROTO_MAX_EVICTED, "K3_PROTO_MAX_EVICTED"},
    {"compute_ms", FK_F64, FD_STATS, OFF(forward_done.compute_ms), 0, 0, 0, NULL},
    {"read_ms", FK_F64, FD_STATS, OFF(forward_done.read_ms), 0, 0, 0, NULL},
    {"bytes_read", FK_U64, FD_STATS, OFF(forward_done.bytes_read), 0, 0, ANY, NULL},
    {"hits", FK_U64, FD_STATS, OFF(forward_done.expert_hits), 0, 0, ANY, NULL},
    {"misses", FK_U64, FD_STATS, OFF(forward_done.expert_misses), 0, 0, ANY, NULL},
    /* 1.2: optional in the group (PROTOCOL.md "Expert calls", stats) */
    {"drive_bytes", FK_LIST, FD_STATS | FD_OPT, OFF(forward_done.drive_bytes),
     OFF(forward_done.n_drives), 0, K3_MAX_DIRS, "K3_MAX_DIRS"},
    {"gather_ms", FK_F64, FD_STATS | FD_OPT, OFF(forward_done.gather_ms), 0, 0, 0, NULL},
    {"xlayers", FK_U64, FD_STATS | FD_OPT, OFF(forward_done.gather_layers), 0, 0, ANY, NULL},
    /* 1.2: optional in the group (PROTOCOL.md "Changes in 1.2"): the Vulkan tier */
    {"vk_calls", FK_U64, FD_STATS | FD_OPT, OFF(forward_done.vk_calls), 0, 0, ANY, NULL},
    {"vk_pairs", FK_U64, FD_STATS | FD_OPT, OFF(forward_done.vk_pairs), 0, 0, ANY, NULL},
    {"vk_promotions", FK_U64, FD_STATS | FD_OPT, OFF(forward_done.vk_promotions), 0, 0, ANY, NULL},
    {"vk_resident", FK_U32, FD_STATS | FD_OPT, OFF(forward_done.vk_resident), 0, 0,
     (uint64_t)K3_MAX_LAYERS *K3_MAX_EXPERTS, "K3_MAX_LAYERS * K3_MAX_EXPERTS"},
    {"vk_device_ms", FK_F64, FD_STATS | FD_OPT, OFF(forward_done.vk_device_ms), 0, 0, 0, NULL},
    {"vk_cpu_ms", FK_F64, FD_STATS | FD_OPT, OFF(forward_done.vk_cpu_ms), 0, 0, 0, NULL},
    {"vk_wait_ms", FK_F64, FD_STATS | FD_OPT, OFF(forward_done.vk_wait_ms), 0, 0, 0, NULL},
};
static const field_desc f_session[] = {
    F_U64("sess", session.session, 1, ANY, NULL),
};
static const field_desc f_truncate[] = {
    F_U64("sess", session.session, 1, ANY, NULL),
    F_U32("n", session.n_tokens, 0, K3_MAX_CTX, "K3_MAX_CTX"),
};
static const field_desc f_cancel[] = {
    F_U64("req", cancel.request, 0, ANY, NULL),
    F_U64("sess", cancel.session, 0, ANY, NULL),
};
static const field_desc f_stats_ok[] = {
    F_U64("forwards", stats_ok.forwards, 0, ANY, NULL),
    F_U64("tokens", stats_ok.tokens, 0, ANY, NULL),
    F_U64("bytes_read", stats_ok.bytes_read, 0, ANY, NULL),
    F_U64("hits", stats_ok.expert_hits, 0, ANY, NULL),
    F_U64("misses", stats_ok.expert_misses, 0, ANY, NULL),
    F_U64("evictions", stats_ok.evictions, 0, ANY, NULL),
    F_U32("sessions", stats_ok.sessions, 0, K3_MAX_SESSIONS, "K3_MAX_SESSIONS"),
    F_U64("proto_errors", stats_ok.proto_errors, 0, ANY, NULL),
    F_F64("busy_ms", stats_ok.busy_ms),
    F_F64("read_ms", stats_ok.read_ms),
    /* version next: who the worker is, for `k3-coordinator status` */
    {"name", FK_STR, FD_OPT, OFF(stats_ok.name), sizeof(((proto_msg *)0)->u.stats_ok.name), 0,
     sizeof(((proto_msg *)0)->u.stats_ok.name) - 1, NULL},
    {"build", FK_STR, FD_OPT, OFF(stats_ok.build), sizeof(((proto_msg *)0)->u.stats_ok.build), 0,
     sizeof(((proto_msg *)0)->u.stats_ok.build) - 1, NULL},
    {"dirs", FK_STR, FD_OPT, OFF(stats_ok.dirs), sizeof(((proto_msg *)0)->u.stats_ok.dirs), 0,
     sizeof(((proto_msg *)0)->u.stats_ok.dirs) - 1, NULL},
    {"layers", FK_PAIR, FD_OPT, OFF(stats_ok.layers), 0, 0, K3_MAX_LAYERS, "K3_MAX_LAYERS"},
    {"read_gbps", FK_F64, FD_OPT, OFF(stats_ok.read_gbps), 0, 0, 0, NULL},
    {"uptime_s", FK_F64, FD_OPT, OFF(stats_ok.uptime_s), 0, 0, 0, NULL},
    {"registered", FK_BOOL, FD_OPT, OFF(stats_ok.registered), 0, 0, 1, NULL},
    /* 1.2: the Vulkan expert tier (docs/VULKAN.md "Stats") */
    {"vk_calls", FK_U64, FD_OPT, OFF(stats_ok.vk_calls), 0, 0, ANY, NULL},
    {"vk_pairs", FK_U64, FD_OPT, OFF(stats_ok.vk_pairs), 0, 0, ANY, NULL},
    {"vk_promotions", FK_U64, FD_OPT, OFF(stats_ok.vk_promotions), 0, 0, ANY, NULL},
    {"vk_evictions", FK_U64, FD_OPT, OFF(stats_ok.vk_evictions), 0, 0, ANY, NULL},
    {"vk_resident", FK_U32, FD_OPT, OFF(stats_ok.vk_resident), 0, 0, UINT32_MAX, NULL},
    {"vk_device_ms", FK_F64, FD_OPT, OFF(stats_ok.vk_device_ms), 0, 0, 0, NULL},
    {"vk_cpu_ms", FK_F64, FD_OPT, OFF(stats_ok.vk_cpu_ms), 0, 0, 0, NULL},
    {"vk_wait_ms", FK_F64, FD_OPT, OFF(stats_ok.vk_wait_ms), 0, 0, 0, NULL},
    {"vk_off", FK_BOOL, FD_OPT, OFF(stats_ok.vk_off), 0, 0, 1, NULL},
    {"stripe", FK_STR, FD_OPT, OFF(stats_ok.stripe), sizeof(((proto_msg *)0)->u.stats_ok.stripe), 0,
     sizeof(((proto_msg *)0)->u.stats_ok.stripe) - 1, NULL},
};
static const field_desc f_heartbeat[] = {
    F_U64("req", heartbeat.busy_request, 0, ANY, NULL),
};
/* 1.2: turn checkpoints (PROTOCOL.md "Checkpoints"); no tensor frames */
static const field_desc f_checkpoint[] = {
    F_U64("sess", ckpt.session, 1, ANY, NULL),
    F_U32("n", ckpt.pos, 1, K3_MAX_CTX, "K3_MAX_CTX"),
    F_U32("keep", ckpt.keep, 1, K3_MAX_CKPT, "K3_MAX_CKPT"),
    {"key", FK_U64, FD_OPT, OFF(ckpt.key), 0, 0, ANY, NULL}, /* 1.3: parked on disk too */
};
static const field_desc f_restore[] = {
    F_U64("sess", ckpt.session, 1, ANY, NULL),
    F_U32("n", ckpt.pos, 1, K3_MAX_CTX, "K3_MAX_CTX"),
    {"key", FK_U64, FD_OPT, OFF(ckpt.key), 0, 0, ANY, NULL}, /* 1.3: may load from disk */
};
static const field_desc f_error[] = {
    F_U32("code", error.code, 1, K3_ERR_INTERNAL, "K3_ERR_INTERNAL"),
    F_STR("msg", error.msg, 0),
    F_U64("sess", error.session, 0, ANY, NULL),
    F_U64("step", error.step, 0, ANY, NULL),
};
/* 1.2 expert calls (PROTOCOL.md "Expert calls"); frame sizes from the
 * envelope: proto_frame_layout */
static const field_desc f_expert_call[] = {
    F_U32("layer", expert_call.layer, 0, K3_MAX_LAYERS - 1, "K3_MAX_LAYERS - 1"),
    F_U32("drive", expert_call.drive, 0, K3_MAX_DIRS - 1, "K3_MAX_DIRS - 1"),
    F_U32("P", expert_call.n_rows, 1, K3_MAX_CHUNK, "K3_MAX_CHUNK"),
    F_U32("LT", expert_call.latent, 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"),
    F_U32("n", expert_call.n_experts, 1, K3_MAX_EXPERTS, "K3_MAX_EXPERTS"),
    F_U32("R", expert_call.n_pairs, 1, K3_MAX_CHUNK *K3_MAX_TOPK, "K3_MAX_CHUNK * K3_MAX_TOPK"),
};
static const field_desc f_expert_done[] = {
    F_U32("layer", expert_done.layer, 0, K3_MAX_LAYERS - 1, "K3_MAX_LAYERS - 1"),
    F_U32("drive", expert_done.drive, 0, K3_MAX_DIRS - 1, "K3_MAX_DIRS - 1"),
    F_U32("R", expert_done.n_pairs, 1, K3_MAX_CHUNK *K3_MAX_TOPK, "K3_MAX_CHUNK * K3_MAX_TOPK"),
    F_U32("LT", expert_done.latent, 1, K3_MAX_HIDDEN, "K3_MAX_HIDDEN"),
    F_F64("compute_ms", expert_done.compute_ms),
    F_F64("read_ms", expert_done.read_ms),
    F_U64("bytes_read", expert_done.bytes_read, 0, ANY, NULL),
    F_U64("hits", expert_done.expert_hits, 0, ANY, NULL),
    F_U64("misses", expert_done.expert_misses, 0, ANY, NULL),
};

typedef struct msg_schema {
    const field_desc *f;
    int n;
} msg_schema;

#define SCHEMA(a)                                                                                  \
    { a, (int)(sizeof(a) / sizeof(a[0])) }
static const msg_schema schemas[PROTO_MSG_COUNT] = {
    [PROTO_MSG_HELLO] = SCHEMA(f_hello),
    [PROTO_MSG_HELLO_OK] = SCHEMA(f_hello_ok),
    [PROTO_MSG_FORWARD] = SCHEMA(f_forward),
    [PROTO_MSG_FORWARD_DONE] = SCHEMA(f_forward_done),
    [PROTO_MSG_SESSION_RESET] = SCHEMA(f_session),
    [PROTO_MSG_SESSION_TRUNCATE] = SCHEMA(f_truncate),
    [PROTO_MSG_SESSION_DROP] = SCHEMA(f_session),
    [PROTO_MSG_CANCEL] = SCHEMA(f_cancel),
    [PROTO_MSG_STATS_OK] = SCHEMA(f_stats_ok),
    [PROTO_MSG_HEARTBEAT] = SCHEMA(f_heartbeat),
    [PROTO_MSG_ERROR] = SCHEMA(f_error),
    [PROTO_MSG_EXPERT_CALL] = SCHEMA(f_expert_call),
    [PROTO_MSG_EXPERT_DONE] = SCHEMA(f_expert_done),
    [PROTO_MSG_CHECKPOINT] = SCHEMA(f_checkpoint), /* no tensor frames */
    [PROTO_MSG_RESTORE] = SCHEMA(f_restore),       /* no tensor frames */
    /* OK, STATS, SHUTDOWN: common keys only */
};
#define N_COMMON 4 /* v, t, id, ep */
_Static_assert(sizeof(f_hello_ok) / sizeof(f_hello_ok[0]) + N_COMMON <= K3_PROTO_MAX_KEYS,
               "largest message must fit K3_PROTO_MAX_KEYS");

/* Reserved codes below PROTO_MSG_COUNT (another branch's types) have no name. */
static bool type_known(proto_type t) {
    return t > PROTO_MSG_NONE && t < PROTO_MSG_COUNT && type_names[t];
}

/* Requests and replies carry a nonzero id; ERROR may carry 0 (unreadable id);
 * HEARTBEAT carries 0 (PROTOCOL.md 3). */
static bool needs_id(proto_type t) { return t != PROTO_MSG_ERROR && t != PROTO_MSG_HEARTBEAT; }

/* ---- typed access by offset ----
 * The schema names fields by offsetof() into proto_msg, so one loop can read
 * or write any type's field; the kind says the C type stored there. */

static uint64_t get_u(const proto_msg *m, const field_desc *d) {
    const char *p = (const char *)m + d->off;
    if (d->kind == FK_U64) return *(const uint64_t *)p;
    return *(const uint32_t *)p;
}
static void set_u(proto_msg *m, const field_desc *d, uint64_t v) {
    char *p = (char *)m + d->off;
    if (d->kind == FK_U64)
        *(uint64_t *)p = v;
    else
        *(uint32_t *)p = (uint32_t)v; /* range checked by the caller */
}
#define AT(m, d, T)    ((T *)((char *)(m) + (d)->off))
#define AT_C(m, d, T)  ((const T *)((const char *)(m) + (d)->off))
#define LIST_N(m, d)   ((uint32_t *)((char *)(m) + (d)->aux))
#define LIST_N_C(m, d) ((const uint32_t *)((const char *)(m) + (d)->aux))

/* ---- text fields ---- */

/* UTF-8 with no control characters (bytes < 0x20, 0x7f): a peer's string
 * goes into logs and error messages, so it may neither forge a line nor hide
 * a NUL. Returns NULL if fine, else why, with the failing byte offset in *at.
 * Overlong forms, surrogates and code points above U+10FFFF are invalid. */
static const char *text_bad(const uint8_t *s, size_t n, size_t *at) {
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000}; /* by length */
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        *at = i;
        if (c < 0x20 || c == 0x7f) return "control character";
        if (c < 0x80) {
            i++;
            continue;
        }
        int len = c >= 0xc2 && c <= 0xdf   ? 2
                  : c >= 0xe0 && c <= 0xef ? 3
                  : c >= 0xf0 && c <= 0xf4 ? 4
                                           : 0;
        if (!len) return "invalid UTF-8 lead byte";
        if ((size_t)len > n - i) return "truncated UTF-8 sequence";
        uint32_t cp = c & (0x7fu >> len); /* payload bits of the lead byte */
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return "invalid UTF-8 continuation";
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return "invalid UTF-8 code point";
        i += (size_t)len;
    }
    return NULL;
}

/* Copies a peer-supplied key for an error message: printable ASCII kept,
 * everything else as \xNN, at most ~40 characters. */
static void key_print(char *out, size_t cap, const char *p, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n && o + 5 < cap; i++) {
        unsigned char c = (unsigned char)p[i];
        if (i == 40) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '\'')
            out[o++] = (char)c;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", c);
    }
    out[o < cap ? o : cap - 1] = 0;
}

/* ---- validation (encode and decode) ---- */

/* A value against its field's range. Above a named limit is K3_ERR_LIMIT
 * (a size the receiver refuses), anything else out of range K3_ERR_PROTO
 * (a value the protocol does not define). */
static k3_status check_uint(const char *tn, const char *key, uint64_t v, const field_desc *d,
                            char *err, size_t errlen) {
    if (v < d->lo)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field '%s': %" PRIu64 " < minimum %" PRIu64,
                       tn, key, v, d->lo);
    if (v > d->hi) {
        if (d->limit)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: field '%s': %" PRIu64 " > limit %" PRIu64 " (%s)", tn, key, v,
                           d->hi, d->limit);
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field '%s': %" PRIu64 " > maximum %" PRIu64,
                       tn, key, v, d->hi);
    }
    if ((d->flags & FD_BITS) && v != 4 && v != 8 && v != 32)
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "%s: field '%s': %" PRIu64 ", expected 4, 8 or 32", tn, key, v);
    return K3_OK;
}

/* One field of a filled-in message against the schema. Decode has already
 * enforced the wire types and storage widths; this is the part encode needs
 * too: ranges, finite floats, terminated clean strings, list counts. */
static k3_status check_field(const proto_msg *m, const field_desc *d, const char *tn, char *err,
                             size_t errlen) {
    switch (d->kind) {
    case FK_U64:
    case FK_U32: return check_uint(tn, d->key, get_u(m, d), d, err, errlen);
    case FK_BOOL: return K3_OK;
    case FK_F64: {
        double v = *AT_C(m, d, double);
        if (!isfinite(v) || v < 0)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field '%s': %g, expected a finite value >= 0", tn, d->key, v);
        return K3_OK;
    }
    case FK_STR: {
        const char *s = AT_C(m, d, char);
        size_t n = strnlen(s, d->aux);
        size_t at;
        const char *why;
        if (n == d->aux)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "%s: field '%s': not NUL-terminated in %zu bytes", tn, d->key, d->aux);
        if (n < d->lo)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field '%s': %zu bytes, expected %" PRIu64 "..%" PRIu64, tn, d->key,
                           n, d->lo, d->hi);
        if ((why = text_bad((const uint8_t *)s, n, &at)))
            return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field '%s': %s at byte %zu", tn, d->key,
                           why, at);
        return K3_OK;
    }
    case FK_PAIR: {
        const uint32_t *p = AT_C(m, d, uint32_t);
        char key[64];
        for (int i = 0; i < 2; i++) {
            snprintf(key, sizeof key, "%s[%d]", d->key, i);
            k3_status st = check_uint(tn, key, p[i], d, err, errlen);
            if (st) return st;
        }
        return K3_OK;
    }
    case FK_LIST: {
        uint32_t n = *LIST_N_C(m, d);
        const uint64_t *v = AT_C(m, d, uint64_t);
        if (n > d->hi)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: field '%s': %u entries > limit %" PRIu64 " (%s)", tn, d->key, n,
                           d->hi, d->limit);
        for (uint32_t i = 0; i < n; i++)
            if (v[i] < d->lo)
                return k3_errf(K3_ERR_PROTO, err, errlen,
                               "%s: field '%s[%u]': %" PRIu64 " < minimum %" PRIu64, tn, d->key, i,
                               v[i], d->lo);
        return K3_OK;
    }
    }
    return k3_errf(K3_ERR_INTERNAL, err, errlen, "%s: field '%s': unknown kind", tn, d->key);
}

k3_status proto_validate(const proto_msg *m, char *err, size_t errlen) {
    if (!type_known(m->type))
        return k3_errf(K3_ERR_PROTO, err, errlen, "unknown message type %d (known 1..%d)",
                       (int)m->type, PROTO_MSG_COUNT - 1);
    const char *tn = proto_type_name(m->type);
    /* Ids and epochs (PROTOCOL.md 7): a request or reply without an id could
     * not be matched, a HEARTBEAT with one would look like a reply, and a
     * HELLO must open a new, nonzero epoch. */
    if (needs_id(m->type) && m->id == 0)
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "%s: field 'id': 0, expected a nonzero request id", tn);
    if (m->type == PROTO_MSG_HEARTBEAT && m->id != 0)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field 'id': %" PRIu64 ", expected 0", tn,
                       m->id);
    if (m->type == PROTO_MSG_HELLO && m->epoch == 0)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field 'ep': 0, expected a nonzero epoch",
                       tn);

    /* every field's own range; an absent stats group has nothing to check */
    const msg_schema *s = &schemas[m->type];
    for (int i = 0; i < s->n; i++) {
        const field_desc *d = &s->f[i];
        if ((d->flags & FD_STATS) && !m->u.forward_done.has_stats) continue;
        k3_status st = check_field(m, d, tn, err, errlen);
        if (st) return st;
    }

    /* Cross-field rules that one field's range cannot say. pos0 + T is
     * checked in 64 bits: both are u32, the sum is not. */
    switch (m->type) {
    case PROTO_MSG_HELLO_OK:
        if (m->u.hello_ok.layers[0] >= m->u.hello_ok.layers[1])
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field 'layers': [%u, %u) is empty, expected a < b", tn,
                           m->u.hello_ok.layers[0], m->u.hello_ok.layers[1]);
        break;
    case PROTO_MSG_STATS_OK: /* [0, 0) = absent (an older worker) */
        if ((m->u.stats_ok.layers[0] || m->u.stats_ok.layers[1]) &&
            m->u.stats_ok.layers[0] >= m->u.stats_ok.layers[1])
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field 'layers': [%u, %u) is empty, expected a < b", tn,
                           m->u.stats_ok.layers[0], m->u.stats_ok.layers[1]);
        break;
    case PROTO_MSG_FORWARD: {
        const proto_forward *f = &m->u.forward;
        if ((uint64_t)f->pos0 + f->n_tokens > K3_MAX_CTX)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: pos0 + T = %" PRIu64 " > limit %d (K3_MAX_CTX)", tn,
                           (uint64_t)f->pos0 + f->n_tokens, K3_MAX_CTX);
        if (f->flags & ~PROTO_FWD_FLAGS_ALL)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field 'flags': unknown bits 0x%x (known 0x%x)", tn,
                           f->flags & ~PROTO_FWD_FLAGS_ALL, PROTO_FWD_FLAGS_ALL);
        break;
    }
    case PROTO_MSG_EXPERT_CALL: {
        const proto_expert_call *x = &m->u.expert_call;
        if (x->n_pairs < x->n_experts || (uint64_t)x->n_pairs > (uint64_t)x->n_rows * x->n_experts)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: field 'R': %u pairs, expected n %u .. P x n = %llu", tn, x->n_pairs,
                           x->n_experts, (unsigned long long)x->n_rows * x->n_experts);
        break;
    }
    case PROTO_MSG_CANCEL:
        if ((m->u.cancel.request != 0) == (m->u.cancel.session != 0))
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: 'req' = %" PRIu64 " and 'sess' = %" PRIu64
                           ": expected exactly one nonzero",
                           tn, m->u.cancel.request, m->u.cancel.session);
        break;
    default: break;
    }
    /* declared tensor sizes within limits (FORWARD, FORWARD_DONE) */
    int n;
    uint64_t bytes[K3_PROTO_MAX_FRAMES];
    return proto_frame_layout(m, &n, bytes, err, errlen);
}

/* ---- encode ----
 * msgpack-c packs into a caller buffer through this write callback: no heap
 * per message, and a message that does not fit is an error, not a realloc.
 * The packer's own return values are not checked one by one; the overflow
 * flag remembers the first failed write. */

typedef struct fixbuf {
    uint8_t *p;
    size_t cap, len;
    bool overflow;
} fixbuf;

static int fixbuf_write(void *data, const char *b, size_t n) {
    fixbuf *fb = data;
    if (fb->overflow || n > fb->cap - fb->len) {
        fb->overflow = true;
        return -1;
    }
    memcpy(fb->p + fb->len, b, n);
    fb->len += n;
    return 0;
}

static void pack_key(msgpack_packer *pk, const char *k) {
    size_t n = strlen(k);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, k, n);
}

/* Keys go out in a fixed order (common keys, then the schema's), integers in
 * their smallest format (msgpack_pack_uint64 chooses it), so one message has
 * one encoding: the fuzz target checks that re-encoding is byte-identical.
 * Validation first, so nothing leaves that the peer would reject. */
k3_status proto_encode(const proto_msg *m, uint8_t *buf, size_t cap, size_t *len, char *err,
                       size_t errlen) {
    *len = 0;
    k3_status st = proto_validate(m, err, errlen);
    if (st) {
        k3_err_prefix(err, errlen, "encode");
        return st;
    }
    const msg_schema *s = &schemas[m->type];
    bool stats = m->type == PROTO_MSG_FORWARD_DONE && m->u.forward_done.has_stats;
    size_t n_keys = N_COMMON;
    for (int i = 0; i < s->n; i++)
        if (!(s->f[i].flags & FD_STATS) || stats) n_keys++;

    fixbuf fb = {buf, cap, 0, false};
    msgpack_packer pk;
    msgpack_packer_init(&pk, &fb, fixbuf_write);
    msgpack_pack_map(&pk, n_keys);
    pack_key(&pk, "v");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint32(&pk, PROTO_VERSION_MAJOR);
    msgpack_pack_uint32(&pk, PROTO_VERSION_MINOR);
    pack_key(&pk, "t");
    msgpack_pack_uint32(&pk, (uint32_t)m->type);
    pack_key(&pk, "id");
    msgpack_pack_uint64(&pk, m->id);
    pack_key(&pk, "ep");
    msgpack_pack_uint64(&pk, m->epoch);
    for (int i = 0; i < s->n; i++) {
        const field_desc *d = &s->f[i];
        if ((d->flags & FD_STATS) && !stats) continue;
        pack_key(&pk, d->key);
        switch (d->kind) {
        case FK_U64:
        case FK_U32: msgpack_pack_uint64(&pk, get_u(m, d)); break;
        case FK_BOOL:
            if (*AT_C(m, d, bool))
                msgpack_pack_true(&pk);
            else
                msgpack_pack_false(&pk);
            break;
        case FK_F64: msgpack_pack_double(&pk, *AT_C(m, d, double)); break;
        case FK_STR: {
            const char *str = AT_C(m, d, char);
            size_t n = strlen(str);
            msgpack_pack_str(&pk, n);
            msgpack_pack_str_body(&pk, str, n);
            break;
        }
        case FK_PAIR:
            msgpack_pack_array(&pk, 2);
            msgpack_pack_uint32(&pk, AT_C(m, d, uint32_t)[0]);
            msgpack_pack_uint32(&pk, AT_C(m, d, uint32_t)[1]);
            break;
        case FK_LIST: {
            uint32_t n = *LIST_N_C(m, d);
            msgpack_pack_array(&pk, n);
            for (uint32_t k = 0; k < n; k++) msgpack_pack_uint64(&pk, AT_C(m, d, uint64_t)[k]);
            break;
        }
        }
    }
    if (fb.overflow)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "encode %s: envelope needs more than %zu bytes",
                       proto_type_name(m->type), cap);
    *len = fb.len;
    return K3_OK;
}

/* ---- decode ----
 * Runs on a msgpack_object tree that msgpack-c built after the pre-scan
 * passed, so every count and length below is backed by real bytes. Strings
 * in the tree point into the envelope (msgpack-c copies nothing): they are
 * copied out, bounded, before the envelope is released. */

/* "negative integer -1", "float32 1.5", "string", "array of 3", ... */
static void obj_describe(const msgpack_object *o, char *out, size_t cap) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: snprintf(out, cap, "nil"); break;
    case MSGPACK_OBJECT_BOOLEAN:
        snprintf(out, cap, "bool %s", o->via.boolean ? "true" : "false");
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        snprintf(out, cap, "unsigned integer %" PRIu64, o->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        snprintf(out, cap, "negative integer %" PRId64, o->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32: snprintf(out, cap, "float32 %g", o->via.f64); break;
    case MSGPACK_OBJECT_FLOAT64: snprintf(out, cap, "float64 %g", o->via.f64); break;
    case MSGPACK_OBJECT_STR: snprintf(out, cap, "string of %u bytes", o->via.str.size); break;
    case MSGPACK_OBJECT_ARRAY: snprintf(out, cap, "array of %u", o->via.array.size); break;
    case MSGPACK_OBJECT_MAP: snprintf(out, cap, "map of %u", o->via.map.size); break;
    case MSGPACK_OBJECT_BIN: snprintf(out, cap, "bin of %u bytes", o->via.bin.size); break;
    case MSGPACK_OBJECT_EXT: snprintf(out, cap, "ext of %u bytes", o->via.ext.size); break;
    default: snprintf(out, cap, "msgpack type %d", (int)o->type); break;
    }
}

/* "FORWARD: field 'T': expected unsigned integer, got negative integer -1" */
static k3_status wrong_type(const char *tn, const char *key, const char *want,
                            const msgpack_object *o, char *err, size_t errlen) {
    char got[96];
    obj_describe(o, got, sizeof got);
    return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field '%s': expected %s, got %s", tn, key, want,
                   got);
}

/* An unsigned integer no wider than max, checked before narrowing so that
 * 2^32 + 5 never becomes 5 in a u32 field. msgpack-c reports any integer
 * format holding a value >= 0 as POSITIVE_INTEGER, so int8 5 is accepted as
 * 5 and only a real negative value is refused. */
static k3_status want_uint(const msgpack_object *o, const char *tn, const char *key, uint64_t max,
                           uint64_t *v, char *err, size_t errlen) {
    if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
        return wrong_type(tn, key, "unsigned integer", o, err, errlen);
    if (o->via.u64 > max)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%s: field '%s': %" PRIu64 " does not fit %s (maximum %" PRIu64 ")", tn, key,
                       o->via.u64,
                       max == UINT16_MAX   ? "u16"
                       : max == UINT32_MAX ? "u32"
                                           : "u64",
                       max);
    *v = o->via.u64;
    return K3_OK;
}

/* Keys are length-delimited, not NUL-terminated: compare length first. */
static bool key_is(const msgpack_object *k, const char *s) {
    size_t n = strlen(s);
    return k->via.str.size == n && memcmp(k->via.str.ptr, s, n) == 0;
}

/* One known key's value: the exact msgpack type of its kind (an integer is
 * never accepted for a float or a bool, a float32 never for a float64, bin
 * never for a string), then the storage width. Ranges come later, in
 * proto_validate, shared with encode. */
static k3_status decode_field(proto_msg *m, const field_desc *d, const msgpack_object *o,
                              const char *tn, char *err, size_t errlen) {
    uint64_t v;
    k3_status st;
    switch (d->kind) {
    case FK_U64:
    case FK_U32:
        st = want_uint(o, tn, d->key, d->kind == FK_U64 ? UINT64_MAX : UINT32_MAX, &v, err, errlen);
        if (st) return st;
        set_u(m, d, v);
        return K3_OK;
    case FK_BOOL:
        if (o->type != MSGPACK_OBJECT_BOOLEAN)
            return wrong_type(tn, d->key, "bool", o, err, errlen);
        *AT(m, d, bool) = o->via.boolean;
        return K3_OK;
    case FK_F64:
        if (o->type != MSGPACK_OBJECT_FLOAT64)
            return wrong_type(tn, d->key, "float64", o, err, errlen);
        *AT(m, d, double) = o->via.f64;
        return K3_OK;
    case FK_STR: {
        const char *why;
        size_t at;
        if (o->type != MSGPACK_OBJECT_STR) return wrong_type(tn, d->key, "string", o, err, errlen);
        if (o->via.str.size >= d->aux)
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: field '%s': %u bytes > limit %zu", tn,
                           d->key, o->via.str.size, d->aux - 1);
        /* checked on the raw bytes: a NUL inside would be cut by the copy */
        if ((why = text_bad((const uint8_t *)o->via.str.ptr, o->via.str.size, &at)))
            return k3_errf(K3_ERR_PROTO, err, errlen, "%s: field '%s': %s at byte %zu", tn, d->key,
                           why, at);
        memcpy(AT(m, d, char), o->via.str.ptr, o->via.str.size);
        AT(m, d, char)[o->via.str.size] = 0;
        return K3_OK;
    }
    case FK_PAIR: {
        if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 2)
            return wrong_type(tn, d->key, "array of 2", o, err, errlen);
        for (int i = 0; i < 2; i++) {
            char key[64];
            snprintf(key, sizeof key, "%s[%d]", d->key, i);
            st = want_uint(&o->via.array.ptr[i], tn, key, UINT32_MAX, &v, err, errlen);
            if (st) return st;
            AT(m, d, uint32_t)[i] = (uint32_t)v;
        }
        return K3_OK;
    }
    case FK_LIST: {
        if (o->type != MSGPACK_OBJECT_ARRAY) return wrong_type(tn, d->key, "array", o, err, errlen);
        if (o->via.array.size > d->hi)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: field '%s': %u entries > limit %" PRIu64 " (%s)", tn, d->key,
                           o->via.array.size, d->hi, d->limit);
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            char key[64];
            snprintf(key, sizeof key, "%s[%u]", d->key, i);
            st = want_uint(&o->via.array.ptr[i], tn, key, UINT64_MAX, &v, err, errlen);
            if (st) return st;
            AT(m, d, uint64_t)[i] = v;
        }
        *LIST_N(m, d) = o->via.array.size;
        return K3_OK;
    }
    }
    return k3_errf(K3_ERR_INTERNAL, err, errlen, "%s: field '%s': unknown kind", tn, d->key);
}

/* The protocol version, before anything else about the message. */
static k3_status decode_version(const msgpack_object *o, proto_msg *out, char *err, size_t errlen) {
    uint64_t v[2];
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 2)
        return wrong_type("envelope", "v", "array [major, minor]", o, err, errlen);
    for (int i = 0; i < 2; i++) {
        k3_status st = want_uint(&o->via.array.ptr[i], "envelope", i ? "v[1]" : "v[0]", UINT16_MAX,
                                 &v[i], err, errlen);
        if (st) return st;
    }
    out->ver_major = (uint16_t)v[0];
    out->ver_minor = (uint16_t)v[1];
    if (out->ver_major != PROTO_VERSION_MAJOR)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "unsupported protocol version %u.%u (supported %d.%d)", out->ver_major,
                       out->ver_minor, PROTO_VERSION_MAJOR, PROTO_VERSION_MINOR);
    return K3_OK;
}

/* Where the envelope's own keys sit in the map: index of v, t and id,
 * -1 when absent. */
typedef struct env_keys {
    int v, t, id;
} env_keys;

/* Step 1: the shape (a map of at most K3_PROTO_MAX_KEYS string keys) and
 * where v, t and id are, whatever their order, so the version is judged
 * before anything else and the id is known for the ERROR reply even if a
 * later field is bad. */
static k3_status decode_keys(const msgpack_object *root, env_keys *ek, char *err, size_t errlen) {
    char got[96];
    if (root->type != MSGPACK_OBJECT_MAP) {
        obj_describe(root, got, sizeof got);
        return k3_errf(K3_ERR_PROTO, err, errlen, "envelope: expected a map, got %s", got);
    }
    const msgpack_object_kv *kv = root->via.map.ptr;
    uint32_t n = root->via.map.size;
    if (n > K3_PROTO_MAX_KEYS)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "envelope: %u keys > limit %d (K3_PROTO_MAX_KEYS)", n, K3_PROTO_MAX_KEYS);
    *ek = (env_keys){-1, -1, -1};
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *k = &kv[i].key;
        if (k->type != MSGPACK_OBJECT_STR) {
            obj_describe(k, got, sizeof got);
            return k3_errf(K3_ERR_PROTO, err, errlen, "envelope: key #%u: expected string, got %s",
                           i, got);
        }
        int *slot = key_is(k, "v")    ? &ek->v
                    : key_is(k, "t")  ? &ek->t
                    : key_is(k, "id") ? &ek->id
                                      : NULL;
        if (!slot) continue;
        if (*slot >= 0)
            return k3_errf(K3_ERR_PROTO, err, errlen, "envelope: duplicate key '%.*s'",
                           (int)k->via.str.size, k->via.str.ptr);
        *slot = (int)i;
    }
    return K3_OK;
}

/* Step 2: the version, the id (best effort, validated in step 3) and the
 * type, which picks the schema. */
static k3_status decode_header(const msgpack_object_kv *kv, const env_keys *ek, proto_msg *out,
                               char *err, size_t errlen) {
    if (ek->v < 0)
        return k3_errf(K3_ERR_MISSING, err, errlen, "envelope: missing key 'v' (protocol version)");
    k3_status st = decode_version(&kv[ek->v].val, out, err, errlen);
    if (st) return st;
    if (ek->id >= 0 && kv[ek->id].val.type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        out->id = kv[ek->id].val.via.u64;
    if (ek->t < 0)
        return k3_errf(K3_ERR_MISSING, err, errlen, "envelope: missing key 't' (message type)");
    uint64_t t;
    st = want_uint(&kv[ek->t].val, "envelope", "t", UINT64_MAX, &t, err, errlen);
    if (st) return st;
    if (t == 0 || t >= PROTO_MSG_COUNT || !type_known((proto_type)t))
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "envelope: unknown message type %" PRIu64 " (known 1..%d)", t,
                       PROTO_MSG_COUNT - 1);
    out->type = (proto_type)t;
    return K3_OK;
}

/* An unknown key: a bug from a peer of our minor or older, an optional
 * addition from a newer one (PROTOCOL.md 3, 10), counted, unless it
 * repeats an earlier key of the map. */
static k3_status decode_unknown(const msgpack_object_kv *kv, uint32_t i, const char *tn,
                                proto_msg *out, char *err, size_t errlen) {
    const msgpack_object *k = &kv[i].key;
    char kp[200];
    key_print(kp, sizeof kp, k->via.str.ptr, k->via.str.size);
    if (out->ver_minor <= PROTO_VERSION_MINOR)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: unknown key '%s' (not in protocol %u.%u)",
                       tn, kp, out->ver_major, out->ver_minor);
    for (uint32_t p = 0; p < i; p++)
        if (kv[p].key.via.str.size == k->via.str.size &&
            memcmp(kv[p].key.via.str.ptr, k->via.str.ptr, k->via.str.size) == 0)
            return k3_errf(K3_ERR_PROTO, err, errlen, "%s: duplicate key '%s'", tn, kp);
    out->n_ignored++;
    return K3_OK;
}

/* Step 3: every key but v and t, through the type's schema. *seen: bit j =
 * schema field j; id and ep have their own flags (v, t, id duplicates were
 * caught in step 1). */
static k3_status decode_fields(const msgpack_object_kv *kv, uint32_t n, const env_keys *ek,
                               const msg_schema *s, proto_msg *out, uint64_t *seen, bool *seen_ep,
                               char *err, size_t errlen) {
    const char *tn = proto_type_name(out->type);
    k3_status st;
    *seen = 0;
    *seen_ep = false;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *k = &kv[i].key, *val = &kv[i].val;
        uint64_t v;
        if ((int)i == ek->v || (int)i == ek->t) continue;
        if ((int)i == ek->id) {
            st = want_uint(val, tn, "id", UINT64_MAX, &v, err, errlen);
            if (st) return st;
            out->id = v;
            continue;
        }
        if (key_is(k, "ep")) {
            if (*seen_ep) return k3_errf(K3_ERR_PROTO, err, errlen, "%s: duplicate key 'ep'", tn);
            *seen_ep = true;
            st = want_uint(val, tn, "ep", UINT64_MAX, &v, err, errlen);
            if (st) return st;
            out->epoch = v;
            continue;
        }
        int j = 0;
        while (j < s->n && !key_is(k, s->f[j].key)) j++;
        if (j == s->n) {
            if ((st = decode_unknown(kv, i, tn, out, err, errlen))) return st;
            continue;
        }
        if (*seen & (1ull << j))
            return k3_errf(K3_ERR_PROTO, err, errlen, "%s: duplicate key '%s'", tn, s->f[j].key);
        *seen |= 1ull << j;
        st = decode_field(out, &s->f[j], val, tn, err, errlen);
        if (st) return st;
    }
    return K3_OK;
}

/* Step 4: what is missing. Every schema field is required except those
 * added in 1.1 (from a 1.0 peer), the optional ones (FD_OPT) and the stats
 * group, which is all present
 * or all absent (FORWARD_DONE's has_stats says which). */
static k3_status decode_missing(const msg_schema *s, uint64_t seen, bool seen_id, bool seen_ep,
                                proto_msg *out, char *err, size_t errlen) {
    const char *tn = proto_type_name(out->type);
    if (!seen_id) return k3_errf(K3_ERR_MISSING, err, errlen, "%s: missing key 'id'", tn);
    if (!seen_ep) return k3_errf(K3_ERR_MISSING, err, errlen, "%s: missing key 'ep'", tn);
    int n_stats = 0, n_stats_seen = 0;
    const char *stats_have = NULL, *stats_miss = NULL;
    for (int j = 0; j < s->n; j++) {
        bool have = (seen >> j) & 1;
        if ((s->f[j].flags & FD_STATS) && (s->f[j].flags & FD_OPT)) {
            continue; /* a 1.2 addition to the group: a 1.1 sender omits it */
        } else if (s->f[j].flags & FD_STATS) {
            n_stats++;
            n_stats_seen += have;
            if (have)
                stats_have = s->f[j].key;
            else
                stats_miss = s->f[j].key;
        } else if (!have && !((s->f[j].flags & FD_V11) && out->ver_minor < 1) &&
                   !(s->f[j].flags & FD_OPT)) {
            return k3_errf(K3_ERR_MISSING, err, errlen, "%s: missing key '%s'", tn, s->f[j].key);
        }
    }
    if (n_stats_seen && n_stats_seen != n_stats)
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "%s: stats keys must be all present or all absent: got '%s', missing '%s'",
                       tn, stats_have, stats_miss);
    if (out->type == PROTO_MSG_FORWARD_DONE) out->u.forward_done.has_stats = n_stats_seen > 0;
    return K3_OK;
}

/* The envelope map into *out (zeroed by the caller), driven by the type's
 * schema (the table encode and proto_validate use). Order of work: shape
 * and key types, version, type, then every field, then what is missing,
 * then the shared validation. The first failure wins; out->type and out->id
 * are filled as early as possible for the ERROR reply. */
static k3_status decode_map(const msgpack_object *root, proto_msg *out, char *err, size_t errlen) {
    env_keys ek;
    k3_status st = decode_keys(root, &ek, err, errlen);
    if (!st) st = decode_header(root->via.map.ptr, &ek, out, err, errlen);
    if (st) return st;
    const msg_schema *s = &schemas[out->type];
    uint64_t seen;
    bool seen_ep;
    st = decode_fields(root->via.map.ptr, root->via.map.size, &ek, s, out, &seen, &seen_ep, err,
                       errlen);
    if (!st) st = decode_missing(s, seen, ek.id >= 0, seen_ep, out, err, errlen);
    if (!st) st = proto_validate(out, err, errlen);
    return st;
}

/* The msgpack-c traps (docs/TESTING.md 6.4) and how each is closed here:
 * truncated input returns CONTINUE, trailing bytes return SUCCESS with
 * off < len, and huge array/map headers reserve memory before the elements
 * exist. The pre-scan rejects all three before msgpack_unpack_next runs;
 * the SUCCESS && off == len check after it is a second line, not the
 * first. */
k3_status proto_decode(const uint8_t *env, size_t len, proto_msg *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    k3_status st = proto_prescan(env, len, err, errlen);
    if (st) return st;

    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    msgpack_unpack_return ret = msgpack_unpack_next(&up, (const char *)env, len, &off);
    if (ret != MSGPACK_UNPACK_SUCCESS || off != len) {
        /* Cannot happen after the pre-scan; if it does, it is the peer's
         * malformed message, never our memory (NOMEM here means "too deep"
         * or a bomb to msgpack-c). */
        msgpack_unpacked_destroy(&up);
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "envelope: msgpack-c rejected %zu bytes that passed the pre-scan "
                       "(return %d, %zu bytes used)",
                       len, (int)ret, off);
    }
    st = decode_map(&up.data, out, err, errlen);
    msgpack_unpacked_destroy(&up);
    if (st) memset(&out->u, 0, sizeof out->u); /* keep type and id for the reply */
    return st;
}

/* ---- equality ----
 * By schema rather than memcmp: union padding and the unused tail of string
 * buffers are not part of a message. */

bool proto_msg_equal(const proto_msg *a, const proto_msg *b) {
    if (a->type != b->type || a->id != b->id || a->epoch != b->epoch) return false;
    if (!type_known(a->type)) return true;
    bool stats = false;
    if (a->type == PROTO_MSG_FORWARD_DONE) {
        if (a->u.forward_done.has_stats != b->u.forward_done.has_stats) return false;
        stats = a->u.forward_done.has_stats;
    }
    const msg_schema *s = &schemas[a->type];
    for (int i = 0; i < s->n; i++) {
        const field_desc *d = &s->f[i];
        if ((d->flags & FD_STATS) && !stats) continue;
        switch (d->kind) {
        case FK_U64:
        case FK_U32:
            if (get_u(a, d) != get_u(b, d)) return false;
            break;
        case FK_BOOL:
            if (*AT_C(a, d, bool) != *AT_C(b, d, bool)) return false;
            break;
        case FK_F64:
            if (memcmp(AT_C(a, d, double), AT_C(b, d, double), sizeof(double))) return false;
            break;
        case FK_STR:
            if (strncmp(AT_C(a, d, char), AT_C(b, d, char), d->aux)) return false;
            break;
        case FK_PAIR:
            if (memcmp(AT_C(a, d, uint32_t), AT_C(b, d, uint32_t), 2 * sizeof(uint32_t)))
                return false;
            break;
        case FK_LIST: {
            uint32_t n = *LIST_N_C(a, d);
            if (n != *LIST_N_C(b, d) || n > d->hi) return false;
            if (memcmp(AT_C(a, d, uint64_t), AT_C(b, d, uint64_t), n * sizeof(uint64_t)))
                return false;
            break;
        }
        }
    }
    return true;
}

/* ---- tensor frames ----
 * The frame count and sizes are a function of the envelope (PROTOCOL.md 6),
 * so the receiver can check every frame before reading a float of it. */

k3_status proto_frame_layout(const proto_msg *m, int *n_frames, uint64_t bytes[K3_PROTO_MAX_FRAMES],
                             char *err, size_t errlen) {
    *n_frames = 0;
    uint64_t count, T, D;
    const char *first;
    if (m->type == PROTO_MSG_EXPERT_CALL || m->type == PROTO_MSG_EXPERT_DONE) {
        /* u32 fields: every product below fits 64 bits */
        int call = m->type == PROTO_MSG_EXPERT_CALL;
        uint64_t LT = call ? m->u.expert_call.latent : m->u.expert_done.latent;
        uint64_t R = call ? m->u.expert_call.n_pairs : m->u.expert_done.n_pairs;
        uint64_t rows = call ? m->u.expert_call.n_rows : R;
        uint64_t big = rows * LT * sizeof(float);
        if (big > K3_PROTO_MAX_FRAME_BYTES)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: frame '%s' [%" PRIu64 "][LT=%" PRIu64
                           "] f32 > limit %llu bytes (K3_PROTO_MAX_FRAME_BYTES)",
                           proto_type_name(m->type), call ? "z" : "y", rows, LT,
                           (unsigned long long)K3_PROTO_MAX_FRAME_BYTES);
        bytes[0] = big;
        *n_frames = 1;
        if (call) {
            bytes[1] = sizeof(int32_t) * (uint64_t)m->u.expert_call.n_experts; /* ids */
            bytes[2] = bytes[1];                                               /* counts */
            bytes[3] = sizeof(int32_t) * R;                                    /* rows */
            *n_frames = 4;
        }
        return K3_OK;
    }
    if (m->type == PROTO_MSG_FORWARD) {
        count = m->u.forward.n_blocks;
        T = m->u.forward.n_tokens;
        D = m->u.forward.hidden;
        first = "blocks";
    } else if (m->type == PROTO_MSG_FORWARD_DONE) {
        count = m->u.forward_done.n_snapshots;
        T = m->u.forward_done.n_tokens;
        D = m->u.forward_done.hidden;
        first = "snapshots";
    } else {
        return K3_OK;
    }
    /* the fields are u32, so T * D * 4 fits 64 bits; the product with count
     * may not, hence the checked multiply */
    uint64_t row = T * D * sizeof(float), big;
    if (__builtin_mul_overflow(count, row, &big) || big > K3_PROTO_MAX_FRAME_BYTES ||
        row > K3_PROTO_MAX_FRAME_BYTES)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%s: frame '%s' [%" PRIu64 "][T=%" PRIu64 "][D=%" PRIu64
                       "] f32 > limit %llu bytes (K3_PROTO_MAX_FRAME_BYTES)",
                       proto_type_name(m->type), first, count, T, D,
                       (unsigned long long)K3_PROTO_MAX_FRAME_BYTES);
    bytes[0] = big;
    bytes[1] = row;
    *n_frames = 2;
    return K3_OK;
}

k3_status proto_check_frames(const proto_msg *m, const size_t *frame_bytes, int n_frames, char *err,
                             size_t errlen) {
    int n;
    uint64_t want[K3_PROTO_MAX_FRAMES];
    k3_status st = proto_frame_layout(m, &n, want, err, errlen);
    if (st) return st;
    const char *tn = proto_type_name(m->type);
    if (n_frames != n)
        return k3_errf(K3_ERR_PROTO, err, errlen, "%s: %d tensor frame(s), expected %d", tn,
                       n_frames, n);
    for (int i = 0; i < n; i++) {
        if ((uint64_t)frame_bytes[i] != want[i]) {
            static const char *const xnames[4] = {"z", "ids", "counts", "rows"};
            const char *name = m->type == PROTO_MSG_EXPERT_CALL   ? xnames[i]
                               : m->type == PROTO_MSG_EXPERT_DONE ? "y"
                               : i == 1                           ? "hidden"
                               : m->type == PROTO_MSG_FORWARD     ? "blocks"
                                                                  : "snapshots";
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "%s: tensor frame %d ('%s') has %zu bytes, expected %" PRIu64, tn, i + 1,
                           name, frame_bytes[i], want[i]);
        }
    }
    return K3_OK;
}

/* ---- receiver checks ----
 * Decode checks against the global limits of common/base/limits.h; a receiver
 * knows tighter ones (its model's D, its max_ctx). A zero limit is refused
 * rather than read as "unchecked", so a forgotten field cannot silently turn
 * a check off. */

k3_status proto_check_limits(const proto_msg *m, const proto_limits *lim, char *err,
                             size_t errlen) {
    if (!lim->hidden || !lim->max_ctx || !lim->max_chunk || !lim->max_blocks)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "proto_limits: every field must be > 0 (hidden %u, max_ctx %u, "
                       "max_chunk %u, max_blocks %u)",
                       lim->hidden, lim->max_ctx, lim->max_chunk, lim->max_blocks);
    const char *tn = proto_type_name(m->type);
    uint32_t T, D, nb;
    const char *nb_key;
    if (m->type == PROTO_MSG_FORWARD) {
        T = m->u.forward.n_tokens;
        D = m->u.forward.hidden;
        nb = m->u.forward.n_blocks;
        nb_key = "nb";
        uint64_t end = (uint64_t)m->u.forward.pos0 + T;
        if (end > lim->max_ctx)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "%s: pos0 + T = %" PRIu64 " + %u > max_ctx %u", tn,
                           (uint64_t)m->u.forward.pos0, T, lim->max_ctx);
    } else if (m->type == PROTO_MSG_FORWARD_DONE) {
        T = m->u.forward_done.n_tokens;
        D = m->u.forward_done.hidden;
        nb = m->u.forward_done.n_snapshots;
        nb_key = "k";
    } else if (m->type == PROTO_MSG_SESSION_TRUNCATE) {
        if (m->u.session.n_tokens > lim->max_ctx)
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: field 'n': %u > max_ctx %u", tn,
                           m->u.session.n_tokens, lim->max_ctx);
        return K3_OK;
    } else if (m->type == PROTO_MSG_CHECKPOINT || m->type == PROTO_MSG_RESTORE) {
        if (m->u.ckpt.pos > lim->max_ctx)
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: field 'n': %u > max_ctx %u", tn,
                           m->u.ckpt.pos, lim->max_ctx);
        return K3_OK;
    } else {
        return K3_OK;
    }
    if (D != lim->hidden)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "%s: field 'D': %u, expected the model's hidden size %u", tn, D,
                       lim->hidden);
    if (T > lim->max_chunk)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: field 'T': %u > chunk limit %u", tn, T,
                       lim->max_chunk);
    if (nb > lim->max_blocks)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: field '%s': %u > block limit %u", tn, nb_key,
                       nb, lim->max_blocks);
    return K3_OK;
}

/* The success reply of a request type, NONE if t is not a request. */
static proto_type reply_type(proto_type t) {
    switch (t) {
    case PROTO_MSG_HELLO: return PROTO_MSG_HELLO_OK;
    case PROTO_MSG_FORWARD: return PROTO_MSG_FORWARD_DONE;
    case PROTO_MSG_SESSION_RESET:
    case PROTO_MSG_SESSION_TRUNCATE:
    case PROTO_MSG_SESSION_DROP:
    case PROTO_MSG_CANCEL:
    case PROTO_MSG_CHECKPOINT:
    case PROTO_MSG_RESTORE:
    case PROTO_MSG_SHUTDOWN: return PROTO_MSG_OK;
    case PROTO_MSG_STATS: return PROTO_MSG_STATS_OK;
    case PROTO_MSG_EXPERT_CALL: return PROTO_MSG_EXPERT_DONE;
    default: return PROTO_MSG_NONE;
    }
}

/* Reply matching (PROTOCOL.md 7). An id or epoch that differs is STATE, not
 * PROTO: it is a late, duplicate or pre-restart reply, which the coordinator
 * drops and counts; a reply with the right id but wrong echoed fields is a
 * worker bug. */
k3_status proto_check_reply(const proto_msg *req, const proto_msg *rep, char *err, size_t errlen) {
    proto_type want = reply_type(req->type);
    if (want == PROTO_MSG_NONE)
        return k3_errf(K3_ERR_ARG, err, errlen, "proto_check_reply: %s is not a request",
                       proto_type_name(req->type));
    const char *rn = proto_type_name(req->type);
    if (rep->type != want && rep->type != PROTO_MSG_ERROR)
        return k3_errf(K3_ERR_PROTO, err, errlen, "reply to %s: got %s, expected %s or ERROR", rn,
                       proto_type_name(rep->type), proto_type_name(want));
    if (rep->id != req->id || rep->epoch != req->epoch)
        return k3_errf(K3_ERR_STATE, err, errlen,
                       "reply %s id %" PRIu64 " epoch %" PRIu64 " does not answer %s id %" PRIu64
                       " epoch %" PRIu64,
                       proto_type_name(rep->type), rep->id, rep->epoch, rn, req->id, req->epoch);
    uint64_t sess = 0, step = 0;
    if (req->type == PROTO_MSG_FORWARD) {
        sess = req->u.forward.session;
        step = req->u.forward.step;
    }
    if (rep->type == PROTO_MSG_ERROR) {
        if (rep->u.error.session != sess || rep->u.error.step != step)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "ERROR answering %s id %" PRIu64 ": sess/step %" PRIu64 "/%" PRIu64
                           ", expected %" PRIu64 "/%" PRIu64,
                           rn, req->id, rep->u.error.session, rep->u.error.step, sess, step);
        return K3_OK;
    }
    if (rep->type == PROTO_MSG_EXPERT_DONE) {
        const proto_expert_done *d = &rep->u.expert_done;
        const proto_expert_call *x = &req->u.expert_call;
        if (d->layer != x->layer || d->drive != x->drive || d->n_pairs != x->n_pairs ||
            d->latent != x->latent)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "EXPERT_DONE id %" PRIu64 ": layer/drive/R/LT %u/%u/%u/%u, expected "
                           "%u/%u/%u/%u",
                           rep->id, d->layer, d->drive, d->n_pairs, d->latent, x->layer, x->drive,
                           x->n_pairs, x->latent);
    }
    if (rep->type == PROTO_MSG_FORWARD_DONE) {
        const proto_forward_done *d = &rep->u.forward_done;
        const proto_forward *f = &req->u.forward;
        if (d->session != f->session || d->step != f->step || d->n_tokens != f->n_tokens ||
            d->hidden != f->hidden)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "FORWARD_DONE id %" PRIu64 ": sess/step/T/D %" PRIu64 "/%" PRIu64
                           "/%u/%u, expected %" PRIu64 "/%" PRIu64 "/%u/%u",
                           rep->id, d->session, d->step, d->n_tokens, d->hidden, f->session,
                           f->step, f->n_tokens, f->hidden);
    }
    return K3_OK;
}

/* HELLO compatibility (PROTOCOL.md 9). The first difference is reported with
 * both values; build identities are deliberately not compared, and neither
 * is the ISA level: every kernel and layer operator gives the same bits at
 * every level (kernels.h, ops_isa.h), so a stage with another level is
 * accepted and the coordinator only warns (coordinator/cluster.c). */
k3_status proto_check_compat(uint64_t want_fp, const proto_numerics *want, uint64_t got_fp,
                             const proto_numerics *got, char *err, size_t errlen) {
    if (want_fp != got_fp)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "model fingerprint mismatch: expected 0x%016" PRIx64 ", got 0x%016" PRIx64,
                       want_fp, got_fp);
    const struct {
        const char *name;
        uint32_t w, g;
    } u[] = {
        {"bits", want->bits, got->bits},
        {"mla_bits", want->mla_bits, got->mla_bits},
        {"head_bits", want->head_bits, got->head_bits},
    };
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        if (u[i].w != u[i].g)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "numeric setting '%s' mismatch: expected %u, got %u", u[i].name, u[i].w,
                           u[i].g);
    if (want->idot != got->idot)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "numeric setting 'idot' mismatch: expected %d, got %d", want->idot,
                       got->idot);
    if (want->dense_idot != got->dense_idot)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "numeric setting 'dense_idot' mismatch: expected %d, got %d",
                       want->dense_idot, got->dense_idot);
    if (want->exact != got->exact)
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "numeric setting 'exact' mismatch: expected %d, got %d", want->exact,
                       got->exact);
    return K3_OK;
}
