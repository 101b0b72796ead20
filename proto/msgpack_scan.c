/* proto/msgpack_scan.c: the non-allocating pre-scan of msgpack bytes that
 * runs before msgpack_unpack_next (docs/PROTOCOL.md 3, docs/TESTING.md 6.4).
 *
 * Why: msgpack-c reserves count x 24 bytes (48 per map pair) from its zone as
 * soon as it reads an array or map header, before the elements exist; on
 * 64-bit builds nothing caps that, so a 5-byte frame can ask for ~96 GB. It
 * also answers a truncated object with CONTINUE and ignores trailing bytes.
 * This scan walks the whole byte string once, with a fixed stack of
 * K3_PROTO_MAX_DEPTH counters, and accepts it only if it is exactly one
 * complete object whose every declared count and length is backed by bytes
 * that are really there. After it passes, msgpack-c allocates at most one
 * object per input byte.
 *
 * Reentrant; reads buf only.
 */
#include <inttypes.h>

#include "proto/proto.h"

/* Reads an n-byte big-endian unsigned integer (n <= 8). */
static uint64_t be_read(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* Header layout of one msgpack first byte. */
typedef struct head {
    const char *name; /* format name for messages */
    int len_bytes;    /* bytes of a length/count field after the first byte */
    uint64_t fixed;   /* payload bytes known from the first byte alone */
    int container;    /* 0 scalar, 1 array, 2 map */
    int ext_type;     /* ext formats: 1 type byte follows the length */
    uint64_t count;   /* array/map count of the fix formats */
} head;

/* The formats 0xc0..0xdf (msgpack spec "formats" table). */
static const head heads_c0[32] = {
    {"nil", 0, 0, 0, 0, 0},       {"reserved 0xc1", 0, 0, 0, 0, 0}, {"bool", 0, 0, 0, 0, 0},
    {"bool", 0, 0, 0, 0, 0},      {"bin8", 1, 0, 0, 0, 0},          {"bin16", 2, 0, 0, 0, 0},
    {"bin32", 4, 0, 0, 0, 0},     {"ext8", 1, 0, 0, 1, 0},          {"ext16", 2, 0, 0, 1, 0},
    {"ext32", 4, 0, 0, 1, 0},     {"float32", 0, 4, 0, 0, 0},       {"float64", 0, 8, 0, 0, 0},
    {"uint8", 0, 1, 0, 0, 0},     {"uint16", 0, 2, 0, 0, 0},        {"uint32", 0, 4, 0, 0, 0},
    {"uint64", 0, 8, 0, 0, 0},    {"int8", 0, 1, 0, 0, 0},          {"int16", 0, 2, 0, 0, 0},
    {"int32", 0, 4, 0, 0, 0},     {"int64", 0, 8, 0, 0, 0},         {"fixext1", 0, 2, 0, 0, 0},
    {"fixext2", 0, 3, 0, 0, 0},   {"fixext4", 0, 5, 0, 0, 0},       {"fixext8", 0, 9, 0, 0, 0},
    {"fixext16", 0, 17, 0, 0, 0}, {"str8", 1, 0, 0, 0, 0},          {"str16", 2, 0, 0, 0, 0},
    {"str32", 4, 0, 0, 0, 0},     {"array16", 2, 0, 1, 0, 0},       {"array32", 4, 0, 1, 0, 0},
    {"map16", 2, 0, 2, 0, 0},     {"map32", 4, 0, 2, 0, 0},
};

/* Classifies the first byte c. Returns 0 for the reserved byte 0xc1. */
static int head_of(uint8_t c, head *h) {
    static const head fixint = {"fixint", 0, 0, 0, 0, 0};
    if (c <= 0x7f || c >= 0xe0)
        *h = fixint;
    else if (c <= 0x8f)
        *h = (head){"fixmap", 0, 0, 2, 0, c & 0x0fu};
    else if (c <= 0x9f)
        *h = (head){"fixarray", 0, 0, 1, 0, c & 0x0fu};
    else if (c <= 0xbf)
        *h = (head){"fixstr", 0, c & 0x1fu, 0, 0, 0};
    else
        *h = heads_c0[c - 0xc0];
    return c != 0xc1;
}

k3_status proto_prescan(const uint8_t *buf, size_t len, char *err, size_t errlen) {
    if (len == 0)
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "envelope: empty (0 bytes), expected a msgpack map");
    if (!buf) return k3_errf(K3_ERR_ARG, err, errlen, "envelope: NULL buffer with %zu bytes", len);
    if (len > K3_PROTO_MAX_ENVELOPE)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "envelope: %zu bytes > limit %d (K3_PROTO_MAX_ENVELOPE)", len,
                       K3_PROTO_MAX_ENVELOPE);

    /* pending[d]: objects still expected inside the container open at depth d
     * (d = 0 is the top level, which expects exactly one object). Every
     * pending object needs at least one byte, so their sum may never exceed
     * the bytes that remain: that one rule bounds every header, nested or
     * not, by the input's real size. */
    uint64_t pending[K3_PROTO_MAX_DEPTH + 1];
    int depth = 0;
    pending[0] = 1;
    uint64_t total_pending = 1;
    size_t pos = 0;
    unsigned objects = 0;

    while (depth >= 0) {
        if (pending[depth] == 0) {
            depth--;
            continue;
        }
        pending[depth]--;
        total_pending--;
        if (pos >= len)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "envelope: truncated at byte %zu of %zu (%" PRIu64
                           " more object(s) expected)",
                           pos, len, total_pending + 1);
        if (++objects > K3_PROTO_MAX_OBJECTS)
            return k3_errf(
                K3_ERR_LIMIT, err, errlen,
                "envelope: more than %d msgpack objects (K3_PROTO_MAX_OBJECTS) at byte %zu",
                K3_PROTO_MAX_OBJECTS, pos);
        size_t at = pos;
        head h;
        if (!head_of(buf[pos++], &h))
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "envelope: reserved msgpack byte 0xc1 at byte %zu", at);

        /* the length or count field, if any */
        uint64_t n = h.count;
        if (h.len_bytes) {
            if ((size_t)h.len_bytes > len - pos)
                return k3_errf(K3_ERR_PROTO, err, errlen,
                               "envelope: truncated %s header at byte %zu of %zu", h.name, at, len);
            n = be_read(buf + pos, h.len_bytes);
            pos += (size_t)h.len_bytes;
        }
        size_t rem = len - pos;

        if (h.container) {
            /* a map of n pairs holds 2n objects; n < 2^32, so no overflow */
            uint64_t kids = h.container == 2 ? 2 * n : n;
            if (kids > rem)
                return k3_errf(
                    K3_ERR_PROTO, err, errlen,
                    "envelope: %s at byte %zu declares %" PRIu64 " %s > %zu remaining bytes",
                    h.name, at, n, h.container == 2 ? "pairs (x2 objects)" : "elements", rem);
            if (total_pending + kids > rem)
                return k3_errf(K3_ERR_PROTO, err, errlen,
                               "envelope: %s at byte %zu: %" PRIu64 " + %" PRIu64
                               " pending objects > %zu remaining bytes",
                               h.name, at, kids, total_pending, rem);
            if (depth + 1 > K3_PROTO_MAX_DEPTH)
                return k3_errf(
                    K3_ERR_LIMIT, err, errlen,
                    "envelope: nesting depth %d at byte %zu > limit %d (K3_PROTO_MAX_DEPTH)",
                    depth + 1, at, K3_PROTO_MAX_DEPTH);
            pending[++depth] = kids;
            total_pending += kids;
            continue;
        }

        /* scalars: str/bin length n, ext length n plus its type byte, or a
         * payload fixed by the first byte */
        uint64_t payload = h.len_bytes ? n + (uint64_t)h.ext_type : h.fixed;
        if (payload > rem)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "envelope: %s at byte %zu declares %" PRIu64
                           " payload bytes > %zu remaining",
                           h.name, at, payload, rem);
        if (total_pending > rem - payload)
            return k3_errf(K3_ERR_PROTO, err, errlen,
                           "envelope: truncated after %s at byte %zu (%" PRIu64
                           " more object(s) expected, %zu bytes left)",
                           h.name, at, total_pending, (size_t)(rem - payload));
        pos += (size_t)payload;
    }
    if (pos != len)
        return k3_errf(K3_ERR_PROTO, err, errlen,
                       "envelope: trailing bytes: the object ends at byte %zu of %zu", pos, len);
    return K3_OK;
}
