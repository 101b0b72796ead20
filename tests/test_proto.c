/* tests/test_proto.c: the wire protocol (proto/, docs/PROTOCOL.md).
 *
 * Covers docs/TESTING.md rows P1-P7 at the codec and socket level: round
 * trips of every type, every strict prefix and trailing bytes rejected, each
 * field with each wrong type / sign / width, missing, duplicate and unknown
 * keys, versions, unknown types, allocation bombs (RSS growth measured, one
 * run under RLIMIT_AS 512 MB), depth and object limits, frame layouts, the
 * receiver checks, and proto_send/proto_recv over an inproc DEALER/ROUTER
 * pair including too many frames and a frame bigger than declared; and the
 * coordinator's --worker-keys file (proto/link.c, k3_link_worker_key).
 *
 * The key table below is written from docs/PROTOCOL.md, independently of
 * proto.c's schema, so the two are checked against each other.
 * K3_PROTO_CORPUS_DIR=dir also writes the fuzz seed corpus there.
 */
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proto/link.h"
#include "proto/proto.h"
#include "tests/test.h"

static char err[8192];

#include "tests/proto_samples.h"

/* ---- the key table from docs/PROTOCOL.md ---- */

/* K_LIST0: a list whose elements may be 0 (FORWARD_DONE's drive_bytes) */
enum { K_U64, K_U32, K_BOOL, K_F64, K_STR, K_PAIR, K_LIST, K_BITS, K_LIST0 };
typedef struct key_spec {
    proto_type type; /* PROTO_MSG_NONE: every type */
    const char *key;
    int kind;
    size_t str_max; /* K_STR: byte limit */
} key_spec;

static const key_spec keys[] = {
    {PROTO_MSG_NONE, "t", K_U64, 0},
    {PROTO_MSG_NONE, "id", K_U64, 0},
    {PROTO_MSG_NONE, "ep", K_U64, 0},
    {PROTO_MSG_HELLO, "fp", K_U64, 0},
    {PROTO_MSG_HELLO, "build", K_STR, 255},
    {PROTO_MSG_HELLO, "bits", K_BITS, 0},
    {PROTO_MSG_HELLO, "mla_bits", K_BITS, 0},
    {PROTO_MSG_HELLO, "head_bits", K_BITS, 0},
    {PROTO_MSG_HELLO, "idot", K_BOOL, 0},
    {PROTO_MSG_HELLO, "dense_idot", K_BOOL, 0},
    {PROTO_MSG_HELLO, "isa", K_U32, 0},
    {PROTO_MSG_HELLO, "exact", K_BOOL, 0},
    {PROTO_MSG_HELLO_OK, "fp", K_U64, 0},
    {PROTO_MSG_HELLO_OK, "layers", K_PAIR, 0},
    {PROTO_MSG_HELLO_OK, "bits", K_BITS, 0},
    {PROTO_MSG_HELLO_OK, "mla_bits", K_BITS, 0},
    {PROTO_MSG_HELLO_OK, "head_bits", K_BITS, 0},
    {PROTO_MSG_HELLO_OK, "idot", K_BOOL, 0},
    {PROTO_MSG_HELLO_OK, "dense_idot", K_BOOL, 0},
    {PROTO_MSG_HELLO_OK, "isa", K_U32, 0},
    {PROTO_MSG_HELLO_OK, "exact", K_BOOL, 0},
    {PROTO_MSG_HELLO_OK, "build", K_STR, 255},
    {PROTO_MSG_HELLO_OK, "name", K_STR, 255},
    {PROTO_MSG_HELLO_OK, "max_sess", K_U32, 0},
    {PROTO_MSG_HELLO_OK, "max_ctx", K_U32, 0},
    {PROTO_MSG_HELLO_OK, "read_gbps", K_F64, 0},
    {PROTO_MSG_HELLO_OK, "stripe", K_U32, 0}, /* 1.2, optional */
    {PROTO_MSG_FORWARD, "sess", K_U64, 0},
    {PROTO_MSG_FORWARD, "step", K_U64, 0},
    {PROTO_MSG_FORWARD, "pos0", K_U32, 0},
    {PROTO_MSG_FORWARD, "T", K_U32, 0},
    {PROTO_MSG_FORWARD, "nb", K_U32, 0},
    {PROTO_MSG_FORWARD, "D", K_U32, 0},
    {PROTO_MSG_FORWARD, "flags", K_U32, 0},
    {PROTO_MSG_FORWARD_DONE, "sess", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "step", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "k", K_U32, 0},
    {PROTO_MSG_FORWARD_DONE, "T", K_U32, 0},
    {PROTO_MSG_FORWARD_DONE, "D", K_U32, 0},
    {PROTO_MSG_FORWARD_DONE, "evicted", K_LIST, 0},
    {PROTO_MSG_FORWARD_DONE, "compute_ms", K_F64, 0},
    {PROTO_MSG_FORWARD_DONE, "read_ms", K_F64, 0},
    {PROTO_MSG_FORWARD_DONE, "bytes_read", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "hits", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "misses", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "drive_bytes", K_LIST0, 0}, /* 1.2, optional in the group */
    {PROTO_MSG_FORWARD_DONE, "gather_ms", K_F64, 0},
    {PROTO_MSG_FORWARD_DONE, "xlayers", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_calls", K_U64, 0}, /* 1.2, optional: the Vulkan tier */
    {PROTO_MSG_FORWARD_DONE, "vk_pairs", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_promotions", K_U64, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_resident", K_U32, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_device_ms", K_F64, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_cpu_ms", K_F64, 0},
    {PROTO_MSG_FORWARD_DONE, "vk_wait_ms", K_F64, 0},
    {PROTO_MSG_SESSION_RESET, "sess", K_U64, 0},
    {PROTO_MSG_SESSION_TRUNCATE, "sess", K_U64, 0},
    {PROTO_MSG_SESSION_TRUNCATE, "n", K_U32, 0},
    {PROTO_MSG_SESSION_DROP, "sess", K_U64, 0},
    {PROTO_MSG_ERROR, "code", K_U32, 0},
    {PROTO_MSG_ERROR, "msg", K_STR, 4095},
    {PROTO_MSG_ERROR, "sess", K_U64, 0},
    {PROTO_MSG_ERROR, "step", K_U64, 0},
    {PROTO_MSG_CANCEL, "req", K_U64, 0},
    {PROTO_MSG_CANCEL, "sess", K_U64, 0},
    {PROTO_MSG_STATS_OK, "forwards", K_U64, 0},
    {PROTO_MSG_STATS_OK, "tokens", K_U64, 0},
    {PROTO_MSG_STATS_OK, "bytes_read", K_U64, 0},
    {PROTO_MSG_STATS_OK, "hits", K_U64, 0},
    {PROTO_MSG_STATS_OK, "misses", K_U64, 0},
    {PROTO_MSG_STATS_OK, "evictions", K_U64, 0},
    {PROTO_MSG_STATS_OK, "sessions", K_U32, 0},
    {PROTO_MSG_STATS_OK, "proto_errors", K_U64, 0},
    {PROTO_MSG_STATS_OK, "busy_ms", K_F64, 0},
    {PROTO_MSG_STATS_OK, "read_ms", K_F64, 0},
    {PROTO_MSG_STATS_OK, "name", K_STR, 255}, /* version next, optional: the probe's identity */
    {PROTO_MSG_STATS_OK, "build", K_STR, 255},
    {PROTO_MSG_STATS_OK, "dirs", K_STR, 255},
    {PROTO_MSG_STATS_OK, "layers", K_PAIR, 0},
    {PROTO_MSG_STATS_OK, "read_gbps", K_F64, 0},
    {PROTO_MSG_STATS_OK, "uptime_s", K_F64, 0},
    {PROTO_MSG_STATS_OK, "registered", K_BOOL, 0},
    {PROTO_MSG_STATS_OK, "vk_calls", K_U64, 0}, /* 1.2, optional: the Vulkan tier */
    {PROTO_MSG_STATS_OK, "vk_pairs", K_U64, 0},
    {PROTO_MSG_STATS_OK, "vk_promotions", K_U64, 0},
    {PROTO_MSG_STATS_OK, "vk_evictions", K_U64, 0},
    {PROTO_MSG_STATS_OK, "vk_resident", K_U32, 0},
    {PROTO_MSG_STATS_OK, "vk_device_ms", K_F64, 0},
    {PROTO_MSG_STATS_OK, "vk_cpu_ms", K_F64, 0},
    {PROTO_MSG_STATS_OK, "vk_wait_ms", K_F64, 0},
    {PROTO_MSG_STATS_OK, "vk_off", K_BOOL, 0},
    {PROTO_MSG_STATS_OK, "stripe", K_STR, 255},
    {PROTO_MSG_HEARTBEAT, "req", K_U64, 0},
    {PROTO_MSG_EXPERT_CALL, "layer", K_U32, 0}, /* 1.2 */
    {PROTO_MSG_EXPERT_CALL, "drive", K_U32, 0},
    {PROTO_MSG_EXPERT_CALL, "P", K_U32, 0},
    {PROTO_MSG_EXPERT_CALL, "LT", K_U32, 0},
    {PROTO_MSG_EXPERT_CALL, "n", K_U32, 0},
    {PROTO_MSG_EXPERT_CALL, "R", K_U32, 0},
    {PROTO_MSG_EXPERT_DONE, "layer", K_U32, 0},
    {PROTO_MSG_EXPERT_DONE, "drive", K_U32, 0},
    {PROTO_MSG_EXPERT_DONE, "R", K_U32, 0},
    {PROTO_MSG_EXPERT_DONE, "LT", K_U32, 0},
    {PROTO_MSG_EXPERT_DONE, "compute_ms", K_F64, 0},
    {PROTO_MSG_EXPERT_DONE, "read_ms", K_F64, 0},
    {PROTO_MSG_EXPERT_DONE, "bytes_read", K_U64, 0},
    {PROTO_MSG_EXPERT_DONE, "hits", K_U64, 0},
    {PROTO_MSG_EXPERT_DONE, "misses", K_U64, 0},
    {PROTO_MSG_CHECKPOINT, "sess", K_U64, 0},
    {PROTO_MSG_CHECKPOINT, "n", K_U32, 0},
    {PROTO_MSG_CHECKPOINT, "keep", K_U32, 0},
    {PROTO_MSG_CHECKPOINT, "key", K_U64, 0}, /* 1.3, optional */
    {PROTO_MSG_RESTORE, "sess", K_U64, 0},
    {PROTO_MSG_RESTORE, "n", K_U32, 0},
    {PROTO_MSG_RESTORE, "key", K_U64, 0}, /* 1.3, optional */
};
#define N_KEYS (int)(sizeof keys / sizeof keys[0])

static const key_spec *spec_of(proto_type t, const char *k) {
    for (int i = 0; i < N_KEYS; i++)
        if ((keys[i].type == t || keys[i].type == PROTO_MSG_NONE) && !strcmp(keys[i].key, k))
            return &keys[i];
    return NULL;
}

/* ---- tests ---- */

static void test_round_trip(proto_msg *s, int n) {
    int ok_all = 1, seen[PROTO_MSG_COUNT] = {0};
    for (int i = 0; i < n; i++) {
        uint8_t b1[PROTO_ENCODE_CAP], b2[PROTO_ENCODE_CAP];
        size_t l1, l2;
        proto_msg d;
        k3_status st = proto_encode(&s[i], b1, sizeof b1, &l1, err, sizeof err);
        if (st == K3_OK) st = proto_decode(b1, l1, &d, err, sizeof err);
        int ok = st == K3_OK && proto_msg_equal(&s[i], &d) && d.ver_major == 1 &&
                 d.ver_minor == PROTO_VERSION_MINOR && d.n_ignored == 0;
        ok = ok && proto_encode(&d, b2, sizeof b2, &l2, err, sizeof err) == K3_OK && l1 == l2 &&
             !memcmp(b1, b2, l1);
        if (!ok) {
            printf("# round trip %s (#%d) failed: %s\n", proto_type_name(s[i].type), i, err);
            ok_all = 0;
        }
        seen[s[i].type] = 1;
    }
    int all_types = 1;
    int n_types = 0;
    for (int t = 1; t < PROTO_MSG_COUNT; t++)
        if (strcmp(proto_type_name((proto_type)t), "?")) /* reserved codes are "?" */
            all_types &= seen[t], n_types++;
    CHECK(all_types, "samples cover all %d message types", n_types);
    CHECK(ok_all, "round trip encode -> decode -> equal -> re-encode identical bytes (%d messages)",
          n);

    /* a few fields by name, so equal() is not trusted blindly */
    uint8_t b[PROTO_ENCODE_CAP];
    size_t l;
    proto_msg d;
    proto_encode(&s[2], b, sizeof b, &l, err, sizeof err);
    k3_status st = proto_decode(b, l, &d, err, sizeof err);
    CHECK(st == K3_OK && d.type == PROTO_MSG_FORWARD && d.id == 1000 && d.epoch == 77 &&
              d.u.forward.session == 5 && d.u.forward.step == 3 && d.u.forward.pos0 == 96 &&
              d.u.forward.n_tokens == 4 && d.u.forward.n_blocks == 2 && d.u.forward.hidden == 8 &&
              d.u.forward.flags == PROTO_FWD_STATS,
          "FORWARD fields decode to the values sent");
    proto_encode(&s[1], b, sizeof b, &l, err, sizeof err);
    st = proto_decode(b, l, &d, err, sizeof err);
    CHECK(st == K3_OK && d.u.hello_ok.layers[0] == 31 && d.u.hello_ok.layers[1] == 62 &&
              d.u.hello_ok.read_gbps == 6.75 && !strcmp(d.u.hello_ok.name, "w1@nvme1") &&
              d.u.hello_ok.num.exact && d.u.hello_ok.fingerprint == UINT64_MAX,
          "HELLO_OK fields decode to the values sent (UTF-8 build string kept)");
    proto_msg e = s[4];
    e.u.forward_done.read_ms = 0.5;
    CHECK(!proto_msg_equal(&s[4], &e), "proto_msg_equal notices a changed float field");
    e = s[4];
    e.u.forward_done.evicted[1] = 3;
    CHECK(!proto_msg_equal(&s[4], &e), "proto_msg_equal notices a changed list entry");

    /* maximal messages fit PROTO_ENCODE_CAP */
    proto_msg big;
    proto_msg_init(&big, PROTO_MSG_ERROR, UINT64_MAX, UINT64_MAX);
    big.u.error.code = K3_ERR_INTERNAL;
    big.u.error.session = big.u.error.step = UINT64_MAX;
    memset(big.u.error.msg, 'x', sizeof big.u.error.msg - 1);
    st = proto_encode(&big, b, sizeof b, &l, err, sizeof err);
    CHECK(st == K3_OK && proto_decode(b, l, &d, err, sizeof err) == K3_OK &&
              proto_msg_equal(&big, &d),
          "ERROR with a %zu-byte message round-trips in %zu bytes <= PROTO_ENCODE_CAP",
          sizeof big.u.error.msg - 1, l);
    proto_msg_init(&big, PROTO_MSG_FORWARD_DONE, UINT64_MAX, UINT64_MAX);
    big.u.forward_done = s[4].u.forward_done;
    big.u.forward_done.n_evicted = K3_PROTO_MAX_EVICTED;
    for (int i = 0; i < K3_PROTO_MAX_EVICTED; i++) big.u.forward_done.evicted[i] = UINT64_MAX - i;
    st = proto_encode(&big, b, sizeof b, &l, err, sizeof err);
    CHECK(st == K3_OK && proto_decode(b, l, &d, err, sizeof err) == K3_OK &&
              proto_msg_equal(&big, &d),
          "FORWARD_DONE with %d evicted sessions round-trips (%zu bytes)", K3_PROTO_MAX_EVICTED, l);
    proto_msg_init(&big, PROTO_MSG_HELLO_OK, 1, 1);
    big.u.hello_ok = s[1].u.hello_ok;
    memset(big.u.hello_ok.name, 'n', sizeof big.u.hello_ok.name - 1);
    memset(big.u.hello_ok.build, 'b', sizeof big.u.hello_ok.build - 1);
    st = proto_encode(&big, b, sizeof b, &l, err, sizeof err);
    CHECK(st == K3_OK && proto_decode(b, l, &d, err, sizeof err) == K3_OK &&
              proto_msg_equal(&big, &d),
          "HELLO_OK with 255-byte name and build round-trips");
    st = proto_encode(&s[2], b, 10, &l, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && l == 0, "encode into a 10-byte buffer fails with limit: %s", err);
}

static void test_prefixes_trailing(proto_msg *s, int n) {
    int bad = 0, total = 0;
    for (int i = 0; i < n; i++) {
        uint8_t b[PROTO_ENCODE_CAP];
        size_t l;
        proto_msg d;
        proto_encode(&s[i], b, sizeof b, &l, err, sizeof err);
        for (size_t p = 0; p < l; p++) {
            total++;
            if (proto_decode(b, p, &d, err, sizeof err) == K3_OK ||
                proto_prescan(b, p, err, sizeof err) == K3_OK) {
                printf("# prefix %zu/%zu of %s accepted\n", p, l, proto_type_name(s[i].type));
                bad++;
            }
        }
    }
    CHECK(bad == 0, "every strict prefix of every sample is rejected (%d prefixes)", total);

    int trail_ok = 1;
    for (int i = 0; i < n; i++) {
        uint8_t b[2 * PROTO_ENCODE_CAP];
        size_t l;
        proto_msg d;
        proto_encode(&s[i], b, sizeof b, &l, err, sizeof err);
        const uint8_t tails[] = {0x00, 0xc0, 0x90};
        for (size_t t = 0; t < sizeof tails; t++) {
            b[l] = tails[t];
            if (proto_decode(b, l + 1, &d, err, sizeof err) != K3_ERR_PROTO ||
                !strstr(err, "trailing"))
                trail_ok = 0;
        }
        memcpy(b + l, b, l); /* two whole messages in one frame */
        if (proto_decode(b, 2 * l, &d, err, sizeof err) == K3_OK) trail_ok = 0;
    }
    CHECK(trail_ok, "trailing bytes (one byte, or a second whole message) rejected: %s", err);
}

/* Mutant values for one field kind; returns how many. */
static int mutants(int kind, size_t str_max, mp *out) {
    int n = 0;
    /* wrong types common to every kind */
    out[n].n = 0;
    mp_byte(&out[n++], 0xc0); /* nil */
    out[n].n = 0;
    mp_map(&out[n++], 0); /* {} */
    out[n].n = 0;
    mp_byte(&out[n], 0xc4);
    mp_byte(&out[n], 1);
    mp_byte(&out[n++], 7); /* bin */
    out[n].n = 0;
    mp_byte(&out[n], 0xd4);
    mp_byte(&out[n], 1);
    mp_byte(&out[n++], 7); /* fixext1 */
    if (kind != K_STR) {
        out[n].n = 0;
        mp_str(&out[n++], "1");
    }
    if (kind != K_BOOL) {
        out[n].n = 0;
        mp_byte(&out[n++], 0xc3);
    } /* true */
    if (kind != K_F64) {
        out[n].n = 0;
        mp_f64(&out[n++], 1.0);
    }
    out[n].n = 0;
    mp_f32(&out[n++], 1.0f);
    if (kind != K_PAIR && kind != K_LIST && kind != K_LIST0) {
        out[n].n = 0;
        mp_arr(&out[n++], 0);
    }
    switch (kind) {
    case K_U64:
    case K_U32:
    case K_BITS:
        out[n].n = 0;
        mp_neg(&out[n++], -1); /* negative */
        out[n].n = 0;
        mp_byte(&out[n++], 0xff); /* negative fixint -1 */
        if (kind != K_U64) {
            out[n].n = 0;
            mp_u(&out[n++], 1ull << 32);
        } /* above u32 */
        if (kind == K_BITS) {
            out[n].n = 0;
            mp_u(&out[n++], 5);
            out[n].n = 0;
            mp_u(&out[n++], 0);
            out[n].n = 0;
            mp_u(&out[n++], 16);
        }
        break;
    case K_BOOL:
        out[n].n = 0;
        mp_u(&out[n++], 1);
        break;
    case K_F64:
        out[n].n = 0;
        mp_u(&out[n++], 1);
        out[n].n = 0;
        mp_f64(&out[n++], NAN);
        out[n].n = 0;
        mp_f64(&out[n++], INFINITY);
        out[n].n = 0;
        mp_f64(&out[n++], -INFINITY);
        out[n].n = 0;
        mp_f64(&out[n++], -1.0);
        break;
    case K_STR: {
        out[n].n = 0;
        mp_u(&out[n++], 1);
        out[n].n = 0;
        mp_str(&out[n++], "a\nb"); /* control char */
        out[n].n = 0;
        mp_strn(&out[n++], "a\0b", 3); /* NUL */
        out[n].n = 0;
        mp_str(&out[n++], "\xff"); /* bad UTF-8 */
        out[n].n = 0;
        mp_str(&out[n++], "\xc0\x80"); /* overlong */
        out[n].n = 0;
        mp_str(&out[n++], "\xed\xa0\x80"); /* surrogate */
        out[n].n = 0;
        mp_str(&out[n++], "\xe2\x82"); /* truncated */
        static char longs[5000];
        memset(longs, 'a', str_max + 1);
        out[n].n = 0;
        mp_strn(&out[n++], longs, str_max + 1); /* too long */
        break;
    }
    case K_PAIR:
        out[n].n = 0;
        mp_u(&out[n++], 1);
        out[n].n = 0;
        mp_arr(&out[n], 1);
        mp_u(&out[n++], 1);
        out[n].n = 0;
        mp_arr(&out[n], 3);
        mp_u(&out[n], 1);
        mp_u(&out[n], 2);
        mp_u(&out[n++], 3);
        out[n].n = 0;
        mp_arr(&out[n], 2);
        mp_neg(&out[n], -1);
        mp_u(&out[n++], 2);
        out[n].n = 0;
        mp_arr(&out[n], 2);
        mp_str(&out[n], "a");
        mp_u(&out[n++], 2);
        out[n].n = 0;
        mp_arr(&out[n], 2);
        mp_u(&out[n], 0);
        mp_u(&out[n++], 1ull << 32);
        out[n].n = 0;
        mp_arr(&out[n], 2);
        mp_u(&out[n], 0);
        mp_u(&out[n++], K3_MAX_LAYERS + 1);
        out[n].n = 0;
        mp_arr(&out[n], 2);
        mp_u(&out[n], 7);
        mp_u(&out[n++], 7);
        break;
    case K_LIST:
    case K_LIST0:
        out[n].n = 0;
        mp_u(&out[n++], 1);
        out[n].n = 0;
        mp_arr(&out[n], 1);
        mp_neg(&out[n++], -1);
        if (kind == K_LIST) { /* a 0 entry (evicted session 0) */
            out[n].n = 0;
            mp_arr(&out[n], 1);
            mp_u(&out[n++], 0);
        }
        out[n].n = 0;
        mp_arr(&out[n], 1);
        mp_f64(&out[n++], 1.0);
        out[n].n = 0;
        mp_arr(&out[n], K3_PROTO_MAX_EVICTED + 1);
        for (int i = 0; i <= K3_PROTO_MAX_EVICTED; i++) mp_u(&out[n], 1);
        n++;
        break;
    }
    return n;
}

static void test_fields(proto_msg *s, int n) {
    static mp mut[40], rebuilt;
    static pairs p;
    int fields = 0, cases = 0, fails = 0, missing_bad = 0, dup_bad = 0, unknown_keys = 0;
    for (int i = 0; i < n; i++) {
        split(&s[i], &p);
        const char *tn = proto_type_name(s[i].type);
        for (int f = 0; f < p.n; f++) {
            if (!strcmp(p.key[f], "v")) continue; /* own tests */
            const key_spec *ks = spec_of(s[i].type, p.key[f]);
            if (!ks) {
                printf("# %s: key '%s' is not in docs/PROTOCOL.md\n", tn, p.key[f]);
                unknown_keys++;
                continue;
            }
            fields++;
            int nm = mutants(ks->kind, ks->str_max, mut);
            for (int k = 0; k < nm; k++) {
                proto_msg d;
                rebuild(&p, -1, f, &mut[k], NULL, 0, &rebuilt);
                k3_status st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
                char quoted[48];
                snprintf(quoted, sizeof quoted, "'%s", p.key[f]);
                cases++;
                /* 't' is judged as a type code; everything else must name its field */
                int named = !strcmp(p.key[f], "t") ? (strstr(err, "'t'") || strstr(err, "type"))
                                                   : strstr(err, quoted) != NULL;
                if (st == K3_OK || !named) {
                    printf("# %s field '%s' mutant %d: status %s, err '%s'\n", tn, p.key[f], k,
                           k3_status_name(st), err);
                    fails++;
                }
            }
            /* missing: rejected, unless the key is optional (STATS_OK's
             * identity, version next: decoded as 0 / "") */
            proto_msg d;
            rebuild(&p, f, -1, NULL, NULL, 0, &rebuilt);
            k3_status st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
            int optional = (s[i].type == PROTO_MSG_STATS_OK && ks >= spec_of(s[i].type, "name")) ||
                           (s[i].type == PROTO_MSG_HELLO_OK && !strcmp(p.key[f], "stripe")) ||
                           ((s[i].type == PROTO_MSG_CHECKPOINT || /* 1.3 */
                             s[i].type == PROTO_MSG_RESTORE) &&
                            !strcmp(p.key[f], "key")) ||
                           (s[i].type == PROTO_MSG_FORWARD_DONE && /* 1.2 striping keys */
                            ks >= spec_of(s[i].type, "drive_bytes"));
            if (optional ? st != K3_OK : (st == K3_OK || !strstr(err, p.key[f]))) {
                printf("# %s without '%s': %s '%s'\n", tn, p.key[f], k3_status_name(st), err);
                missing_bad++;
            }
            /* duplicate */
            mp extra = {.n = 0};
            mp_raw(&extra, p.env + p.k0[f], p.v1[f] - p.k0[f]);
            rebuild(&p, -1, -1, NULL, &extra, 1, &rebuilt);
            st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
            if (st == K3_OK || !strstr(err, "duplicate")) {
                printf("# %s with '%s' twice: %s '%s'\n", tn, p.key[f], k3_status_name(st), err);
                dup_bad++;
            }
        }
    }
    CHECK(unknown_keys == 0, "every encoded key is in the documented key table");
    CHECK(
        fails == 0,
        "%d wrong-type/sign/width/range/NaN/text mutants over %d fields rejected, naming the field",
        cases, fields);
    CHECK(missing_bad == 0,
          "each required key removed: rejected naming the key; an optional one: accepted");
    CHECK(dup_bad == 0, "each key duplicated: rejected as duplicate");

    /* every documented key of every type is actually sent */
    int absent = 0;
    for (int k = 0; k < N_KEYS; k++) {
        int found = 0;
        for (int i = 0; i < n && !found; i++) {
            if (keys[k].type != PROTO_MSG_NONE && s[i].type != keys[k].type) continue;
            split(&s[i], &p);
            found = find_key(&p, keys[k].key) >= 0;
        }
        if (!found) {
            printf("# documented key '%s' never encoded\n", keys[k].key);
            absent++;
        }
    }
    CHECK(absent == 0, "every documented key appears in an encoded sample");

    /* non-canonical integer encodings of a valid value are accepted */
    split(&s[2], &p);
    int fT = find_key(&p, "T");
    mp v8 = {.n = 0}, v64 = {.n = 0};
    mp_byte(&v8, 0xd0);
    mp_byte(&v8, 4); /* int8 4 */
    mp_byte(&v64, 0xcf);
    mp_be(&v64, 4, 8); /* uint64 4 */
    proto_msg d;
    rebuild(&p, -1, fT, &v8, NULL, 0, &rebuilt);
    k3_status st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
    int ok = st == K3_OK && proto_msg_equal(&d, &s[2]);
    rebuild(&p, -1, fT, &v64, NULL, 0, &rebuilt);
    st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
    CHECK(ok && st == K3_OK && proto_msg_equal(&d, &s[2]),
          "T as int8 4 and as uint64 4 both decode to T = 4");

    /* a float64 error message names expected and actual */
    split(&s[1], &p);
    int fg = find_key(&p, "read_gbps");
    mp f32 = {.n = 0};
    mp_f32(&f32, 1.5f);
    rebuild(&p, -1, fg, &f32, NULL, 0, &rebuilt);
    st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "expected float64, got float32 1.5"),
          "float32 where float64 is required: %s", err);
    split(&s[2], &p);
    int fp0 = find_key(&p, "pos0");
    mp neg = {.n = 0};
    mp_byte(&neg, 0xff);
    rebuild(&p, -1, fp0, &neg, NULL, 0, &rebuilt);
    st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
    CHECK(
        st == K3_ERR_PROTO &&
            !strcmp(err,
                    "FORWARD: field 'pos0': expected unsigned integer, got negative integer -1") &&
            d.id == 1000 && d.type == PROTO_MSG_FORWARD,
        "negative pos0 rejected, id and type kept for the reply: %s", err);
    mp big = {.n = 0};
    mp_u(&big, 1ull << 32);
    rebuild(&p, -1, find_key(&p, "T"), &big, NULL, 0, &rebuilt);
    st = proto_decode(rebuilt.b, rebuilt.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'T'") && strstr(err, "4294967296"),
          "T = 2^32 rejected before narrowing: %s", err);
}

static void test_keys_versions_types(proto_msg *s) {
    static pairs p;
    static mp w, extra;
    proto_msg d;
    k3_status st;
    split(&s[2], &p); /* FORWARD */
    int fv = find_key(&p, "v"), ft = find_key(&p, "t");

    /* dense_idot (added in 1.1): a 1.0 HELLO omits it and reads as false; a
     * 1.1 HELLO without it is missing a key */
    {
        static pairs ph;
        static mp wh;
        split(&s[0], &ph); /* HELLO */
        mp v10 = {.n = 0};
        mp_arr(&v10, 2);
        mp_u(&v10, 1);
        mp_u(&v10, 0);
        rebuild(&ph, find_key(&ph, "dense_idot"), find_key(&ph, "v"), &v10, NULL, 0, &wh);
        st = proto_decode(wh.b, wh.n, &d, err, sizeof err);
        CHECK(st == K3_OK && d.ver_minor == 0 && !d.u.hello.num.dense_idot &&
                  d.u.hello.num.bits == s[0].u.hello.num.bits,
              "a 1.0 HELLO without dense_idot decodes (dense_idot false): %s", st ? err : "ok");
        rebuild(&ph, find_key(&ph, "dense_idot"), -1, NULL, NULL, 0, &wh);
        st = proto_decode(wh.b, wh.n, &d, err, sizeof err);
        CHECK(st == K3_ERR_MISSING && strstr(err, "missing key 'dense_idot'"),
              "a 1.1 HELLO without dense_idot: %s", err);
    }

    /* unknown keys: rejected from our minor, ignored from a newer one */
    extra.n = 0;
    mp_str(&extra, "zz");
    mp_u(&extra, 1);
    rebuild(&p, -1, -1, NULL, &extra, 1, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "unknown key 'zz'"), "unknown key at our minor %d: %s",
          PROTO_VERSION_MINOR, err);
    mp v11 = {.n = 0}; /* a newer minor than ours */
    mp_arr(&v11, 2);
    mp_u(&v11, 1);
    mp_u(&v11, PROTO_VERSION_MINOR + 1);
    rebuild(&p, -1, fv, &v11, &extra, 1, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_OK && d.n_ignored == 1 && d.ver_minor == PROTO_VERSION_MINOR + 1 &&
              proto_msg_equal(&d, &s[2]),
          "unknown key from a newer minor ignored and counted (n_ignored %u)", d.n_ignored);
    mp_str(&extra, "zz");
    mp_u(&extra, 2);
    rebuild(&p, -1, fv, &v11, &extra, 2, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "duplicate key 'zz'"),
          "a duplicated unknown key is rejected even when ignoring: %s", err);
    extra.n = 0;
    mp_str(&extra, "evil\nkey");
    mp_u(&extra, 1);
    rebuild(&p, -1, -1, NULL, &extra, 1, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && !strchr(err, '\n') && strstr(err, "evil\\x0akey"),
          "an unknown key is escaped in the message: %s", err);

    /* versions */
    mp v = {.n = 0};
    mp_arr(&v, 2);
    mp_u(&v, 2);
    mp_u(&v, 0);
    rebuild(&p, -1, fv, &v, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && !strcmp(err, "unsupported protocol version 2.0 (supported 1.3)"),
          "major 2: %s", err);
    v.n = 0;
    mp_arr(&v, 2);
    mp_u(&v, 0);
    mp_u(&v, 9);
    rebuild(&p, -1, fv, &v, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "version 0.9"), "major 0: %s", err);
    /* v last, after an unknown type and an unknown key */
    v.n = 0;
    mp_arr(&v, 2);
    mp_u(&v, 2);
    mp_u(&v, 0);
    w.n = 0;
    mp_map(&w, 3);
    mp_str(&w, "t");
    mp_u(&w, 99);
    mp_str(&w, "zz");
    mp_u(&w, 1);
    mp_str(&w, "v");
    mp_raw(&w, v.b, v.n);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "unsupported protocol version 2.0"),
          "version judged before type and keys, whatever the key order: %s", err);
    const struct {
        const char *what;
        int kind;
    } bad_v[] = {{"v = 1", 0},
                 {"v = [1]", 1},
                 {"v = [1, 70000]", 2},
                 {"v = [1, -1]", 3},
                 {"v = \"1.0\"", 4}};
    for (int i = 0; i < 5; i++) {
        v.n = 0;
        if (bad_v[i].kind == 0) mp_u(&v, 1);
        if (bad_v[i].kind == 1) {
            mp_arr(&v, 1);
            mp_u(&v, 1);
        }
        if (bad_v[i].kind == 2) {
            mp_arr(&v, 2);
            mp_u(&v, 1);
            mp_u(&v, 70000);
        }
        if (bad_v[i].kind == 3) {
            mp_arr(&v, 2);
            mp_u(&v, 1);
            mp_neg(&v, -1);
        }
        if (bad_v[i].kind == 4) mp_str(&v, "1.0");
        rebuild(&p, -1, fv, &v, NULL, 0, &w);
        st = proto_decode(w.b, w.n, &d, err, sizeof err);
        CHECK(st != K3_OK && strstr(err, "'v"), "%s rejected: %s", bad_v[i].what, err);
    }
    v11.n = 0;
    mp_arr(&v11, 2);
    mp_u(&v11, 1);
    mp_u(&v11, 7);
    rebuild(&p, -1, fv, &v11, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_OK && d.ver_minor == 7, "a newer minor (1.7) is accepted");
    rebuild(&p, fv, -1, NULL, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_MISSING && strstr(err, "'v'"), "missing v: %s", err);

    /* unknown types */
    const uint64_t bad_t[] = {0, PROTO_MSG_COUNT, PROTO_MSG_COUNT + 1, 99, 1ull << 40};
    int tok = 1;
    for (int i = 0; i < 5; i++) {
        mp t = {.n = 0};
        mp_u(&t, bad_t[i]);
        rebuild(&p, -1, ft, &t, NULL, 0, &w);
        st = proto_decode(w.b, w.n, &d, err, sizeof err);
        if (st != K3_ERR_PROTO || !strstr(err, "unknown message type")) tok = 0;
    }
    CHECK(tok, "unknown types 0, %d, %d, 99, 2^40 rejected: %s", PROTO_MSG_COUNT,
          PROTO_MSG_COUNT + 1, err);
    mp tneg = {.n = 0};
    mp_neg(&tneg, -3);
    rebuild(&p, -1, ft, &tneg, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "negative"), "negative type: %s", err);

    /* envelope shape */
    w.n = 0;
    mp_arr(&w, 2);
    mp_u(&w, 1);
    mp_u(&w, 0);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "expected a map"), "top-level array: %s", err);
    w.n = 0;
    mp_map(&w, 1);
    mp_u(&w, 1);
    mp_u(&w, 1);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "key #0: expected string"), "integer key: %s", err);
    extra.n = 0;
    for (int i = 0; i < 60; i++) {
        char k[16];
        snprintf(k, sizeof k, "x%d", i);
        mp_str(&extra, k);
        mp_u(&extra, 0);
    }
    rebuild(&p, -1, fv, &v11, &extra, 60, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "K3_PROTO_MAX_KEYS"), "%d keys: %s", p.n + 60, err);

    /* the stats group is all or none */
    split(&s[4], &p);
    rebuild(&p, find_key(&p, "hits"), -1, NULL, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "all present or all absent"), "partial stats: %s", err);

    /* 1.2 Vulkan tier keys of the stats group: values kept, ranges checked */
    proto_msg dv;
    uint8_t bv[PROTO_ENCODE_CAP];
    size_t lv;
    st = proto_encode(&s[4], bv, sizeof bv, &lv, err, sizeof err);
    if (st == K3_OK) st = proto_decode(bv, lv, &dv, err, sizeof err);
    const proto_forward_done *vkd = &dv.u.forward_done;
    CHECK(st == K3_OK && vkd->vk_calls == 11 && vkd->vk_pairs == 29 && vkd->vk_promotions == 1 &&
              vkd->vk_resident == 6 && vkd->vk_device_ms == 1.5 && vkd->vk_cpu_ms == 2.25 &&
              vkd->vk_wait_ms == 0.125 && vkd->gather_layers == 2,
          "FORWARD_DONE's vk_* keys round-trip next to the striping keys");
    mp vbad = {.n = 0};
    mp_u(&vbad, (uint64_t)K3_MAX_LAYERS * K3_MAX_EXPERTS + 1);
    rebuild(&p, -1, find_key(&p, "vk_resident"), &vbad, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'vk_resident'") &&
              strstr(err, "K3_MAX_LAYERS * K3_MAX_EXPERTS"),
          "vk_resident above K3_MAX_LAYERS * K3_MAX_EXPERTS rejected: %s", err);
    vbad.n = 0;
    mp_f64(&vbad, -1.0);
    rebuild(&p, -1, find_key(&p, "vk_wait_ms"), &vbad, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "'vk_wait_ms'") && strstr(err, "finite value >= 0"),
          "negative vk_wait_ms rejected: %s", err);
    vbad.n = 0;
    mp_f64(&vbad, NAN);
    rebuild(&p, -1, find_key(&p, "vk_device_ms"), &vbad, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "'vk_device_ms'"), "NaN vk_device_ms rejected: %s",
          err);
    vbad.n = 0;
    mp_f32(&vbad, 1.0f);
    rebuild(&p, -1, find_key(&p, "vk_cpu_ms"), &vbad, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "'vk_cpu_ms'"), "float32 vk_cpu_ms rejected: %s", err);
    rebuild(&p, find_key(&p, "vk_calls"), -1, NULL, NULL, 0, &w);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_OK && d.u.forward_done.has_stats && d.u.forward_done.vk_calls == 0 &&
              d.u.forward_done.vk_pairs == 29,
          "a FORWARD_DONE without vk_calls (optional in the group) decodes it as 0: %s",
          st ? err : "ok");
}

static void test_validate(proto_msg *s) {
    proto_msg m;
    uint8_t b[PROTO_ENCODE_CAP];
    size_t l;
    k3_status st;
#define BAD(setup, want_st, needle, what)                                                          \
    do {                                                                                           \
        setup;                                                                                     \
        st = proto_encode(&m, b, sizeof b, &l, err, sizeof err);                                   \
        CHECK(st == (want_st) && strstr(err, needle), "%s: %s", what, err);                        \
    } while (0)
    BAD((m = s[2], m.u.forward.n_tokens = 0), K3_ERR_PROTO, "'T': 0 < minimum 1", "T = 0");
    BAD((m = s[2], m.u.forward.n_tokens = K3_MAX_CHUNK + 1), K3_ERR_LIMIT, "K3_MAX_CHUNK",
        "T = 513");
    BAD((m = s[2], m.u.forward.n_blocks = K3_MAX_RES_ENTRIES + 1), K3_ERR_LIMIT,
        "K3_MAX_RES_ENTRIES", "nb = 17");
    BAD((m = s[2], m.u.forward.hidden = K3_MAX_HIDDEN + 1), K3_ERR_LIMIT, "K3_MAX_HIDDEN",
        "D = 65537");
    BAD((m = s[2], m.u.forward.pos0 = K3_MAX_CTX - 2), K3_ERR_LIMIT, "pos0 + T",
        "pos0 + T > K3_MAX_CTX");
    BAD((m = s[2], m.u.forward.flags = 6), K3_ERR_PROTO, "unknown bits 0x6", "unknown flag bits");
    BAD((m = s[2], m.u.forward.session = 0), K3_ERR_PROTO, "'sess'", "session 0");
    BAD((m = s[4], m.u.forward_done.vk_resident = K3_MAX_LAYERS * K3_MAX_EXPERTS + 1), K3_ERR_LIMIT,
        "K3_MAX_LAYERS * K3_MAX_EXPERTS", "vk_resident over the limit");
    BAD((m = s[4], m.u.forward_done.vk_device_ms = -0.5), K3_ERR_PROTO, "'vk_device_ms'",
        "negative vk_device_ms");
    BAD((m = s[4], m.u.forward_done.vk_cpu_ms = INFINITY), K3_ERR_PROTO, "'vk_cpu_ms'",
        "infinite vk_cpu_ms");
    BAD((m = s[2], m.id = 0), K3_ERR_PROTO, "'id'", "request id 0");
    BAD((m = s[2], m.u.forward.n_blocks = 16, m.u.forward.n_tokens = 512,
         m.u.forward.hidden = 65536),
        K3_ERR_LIMIT, "K3_PROTO_MAX_FRAME_BYTES", "blocks frame of 2 GiB");
    m = s[2];
    m.u.forward.n_blocks = 8;
    m.u.forward.n_tokens = 512;
    m.u.forward.hidden = 65536;
    m.u.forward.pos0 = 0;
    CHECK(proto_encode(&m, b, sizeof b, &l, err, sizeof err) == K3_OK,
          "blocks frame of exactly 1 GiB (= limit) accepted");
    BAD((m = s[4], m.u.forward_done.evicted[1] = 0), K3_ERR_PROTO, "'evicted[1]'",
        "evicted session 0");
    BAD((m = s[4], m.u.forward_done.n_evicted = K3_PROTO_MAX_EVICTED + 1), K3_ERR_LIMIT,
        "K3_PROTO_MAX_EVICTED", "65 evicted");
    BAD((m = s[4], m.u.forward_done.compute_ms = NAN), K3_ERR_PROTO, "'compute_ms'",
        "NaN compute_ms");
    BAD((m = s[0], m.epoch = 0), K3_ERR_PROTO, "'ep'", "HELLO epoch 0");
    BAD((m = s[0], m.u.hello.num.bits = 16), K3_ERR_PROTO, "4, 8 or 32", "bits 16");
    BAD((m = s[0], m.u.hello.num.isa = 3), K3_ERR_PROTO, "'isa'", "isa 3");
    BAD((m = s[1], m.u.hello_ok.layers[0] = 5, m.u.hello_ok.layers[1] = 5), K3_ERR_PROTO, "empty",
        "layers [5, 5)");
    BAD((m = s[1], m.u.hello_ok.layers[1] = K3_MAX_LAYERS + 1), K3_ERR_LIMIT, "K3_MAX_LAYERS",
        "layers end 129");
    BAD((m = s[1], m.u.hello_ok.max_sessions = 0), K3_ERR_PROTO, "'max_sess'", "max_sess 0");
    BAD((m = s[1], m.u.hello_ok.name[0] = 0), K3_ERR_PROTO, "'name'", "empty worker name");
    BAD((m = s[1], m.u.hello_ok.read_gbps = -INFINITY), K3_ERR_PROTO, "'read_gbps'", "-Inf GB/s");
    BAD((m = s[12], m.u.cancel.session = 5), K3_ERR_PROTO, "exactly one", "CANCEL by both");
    BAD((m = s[12], m.u.cancel.request = 0), K3_ERR_PROTO, "exactly one", "CANCEL by neither");
    BAD((m = s[10], m.u.error.code = 0), K3_ERR_PROTO, "'code'", "error code 0");
    BAD((m = s[10], m.u.error.code = 15), K3_ERR_LIMIT, "'code'", "error code 15");
    BAD((m = s[10], m.u.error.msg[3] = '\t'), K3_ERR_PROTO, "control character", "tab in msg");
    BAD((m = s[17], m.id = 4), K3_ERR_PROTO, "expected 0", "HEARTBEAT with an id");
    BAD((m = s[7], m.u.session.n_tokens = K3_MAX_CTX + 1), K3_ERR_LIMIT, "K3_MAX_CTX",
        "TRUNCATE n");
    BAD((m = s[0], m.type = (proto_type)PROTO_MSG_COUNT), K3_ERR_PROTO, "unknown message type",
        "type one past the last");
    int ci = 0; /* 1.2: CHECKPOINT, then RESTORE */
    while (s[ci].type != PROTO_MSG_CHECKPOINT) ci++;
    BAD((m = s[ci], m.u.ckpt.keep = 0), K3_ERR_PROTO, "'keep'", "CHECKPOINT keep 0");
    BAD((m = s[ci], m.u.ckpt.keep = K3_MAX_CKPT + 1), K3_ERR_LIMIT, "K3_MAX_CKPT",
        "CHECKPOINT keep 65");
    BAD((m = s[ci], m.u.ckpt.pos = 0), K3_ERR_PROTO, "'n'", "CHECKPOINT at 0");
    BAD((m = s[ci + 1], m.u.ckpt.session = 0), K3_ERR_PROTO, "'sess'", "RESTORE of session 0");
    BAD((m = s[ci + 1], m.u.ckpt.pos = K3_MAX_CTX + 1), K3_ERR_LIMIT, "K3_MAX_CTX",
        "RESTORE past K3_MAX_CTX");
#undef BAD
}

static void test_frames_checks(proto_msg *s) {
    proto_msg m = s[2]; /* FORWARD nb 2, T 4, D 8 */
    int n;
    uint64_t by[K3_PROTO_MAX_FRAMES];
    k3_status st = proto_frame_layout(&m, &n, by, err, sizeof err);
    CHECK(st == K3_OK && n == 2 && by[0] == 2 * 4 * 8 * 4 && by[1] == 4 * 8 * 4,
          "FORWARD layout: blocks %llu, hidden %llu bytes", (unsigned long long)by[0],
          (unsigned long long)by[1]);
    size_t ok[] = {256, 128}, s1[] = {252, 128}, s2[] = {256, 132}, s3[] = {256, 128, 4};
    CHECK(proto_check_frames(&m, ok, 2, err, sizeof err) == K3_OK, "exact frame sizes accepted");
    st = proto_check_frames(&m, s1, 2, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "252 bytes, expected 256"), "blocks 4 bytes short: %s",
          err);
    st = proto_check_frames(&m, s2, 2, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "('hidden') has 132"), "hidden 4 bytes long: %s", err);
    st = proto_check_frames(&m, s3, 3, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "3 tensor frame(s), expected 2"), "extra frame: %s",
          err);
    st = proto_check_frames(&m, ok, 1, err, sizeof err);
    CHECK(st == K3_ERR_PROTO, "missing frame: %s", err);
    m = s[5]; /* FORWARD_DONE k 0 */
    size_t z[] = {0, 512 * 7168 * 4};
    CHECK(proto_check_frames(&m, z, 2, err, sizeof err) == K3_OK,
          "FORWARD_DONE with k = 0 sends an empty snapshots frame");
    CHECK(proto_check_frames(&s[0], NULL, 0, err, sizeof err) == K3_OK &&
              proto_check_frames(&s[0], ok, 1, err, sizeof err) == K3_ERR_PROTO,
          "HELLO takes no tensor frames");

    /* receiver limits */
    proto_limits lim = {.hidden = 8, .max_ctx = 100, .max_chunk = 4, .max_blocks = 2};
    m = s[2];
    CHECK(proto_check_limits(&m, &lim, err, sizeof err) == K3_OK,
          "FORWARD within the worker's limits");
    m.u.forward.hidden = 16;
    st = proto_check_limits(&m, &lim, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "'D': 16, expected the model's hidden size 8"),
          "D: %s", err);
    m = s[2];
    m.u.forward.pos0 = 97;
    st = proto_check_limits(&m, &lim, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "max_ctx 100"), "pos0 + T > max_ctx: %s", err);
    m = s[2];
    lim.max_chunk = 3;
    st = proto_check_limits(&m, &lim, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'T'"), "T > chunk: %s", err);
    lim.max_chunk = 4;
    lim.max_blocks = 1;
    st = proto_check_limits(&m, &lim, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'nb'"), "nb > blocks: %s", err);
    lim.max_blocks = 2;
    st = proto_check_limits(&s[4], &lim, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'k'"), "FORWARD_DONE k 3 > 2: %s", err);
    st = proto_check_limits(&s[7], &lim, err, sizeof err);
    CHECK(st == K3_OK, "TRUNCATE to 90 <= max_ctx 100");
    lim.max_ctx = 50;
    st = proto_check_limits(&s[7], &lim, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "'n'"), "TRUNCATE to 90 > max_ctx 50: %s", err);
    lim.hidden = 0;
    CHECK(proto_check_limits(&s[2], &lim, err, sizeof err) == K3_ERR_ARG, "zero limits refused: %s",
          err);

    /* reply matching */
    proto_msg req = s[2], rep = s[4];
    CHECK(proto_check_reply(&req, &rep, err, sizeof err) == K3_OK,
          "FORWARD_DONE answers its FORWARD");
    rep.id = 999;
    CHECK(proto_check_reply(&req, &rep, err, sizeof err) == K3_ERR_STATE, "other id: stale (%s)",
          err);
    rep = s[4];
    rep.epoch = 76;
    CHECK(proto_check_reply(&req, &rep, err, sizeof err) == K3_ERR_STATE, "old epoch: stale (%s)",
          err);
    rep = s[4];
    rep.u.forward_done.step = 4;
    CHECK(proto_check_reply(&req, &rep, err, sizeof err) == K3_ERR_PROTO, "wrong step echoed: %s",
          err);
    CHECK(proto_check_reply(&req, &s[10], err, sizeof err) == K3_OK,
          "ERROR with the FORWARD's sess/step answers it");
    rep = s[10];
    rep.u.error.step = 0;
    CHECK(proto_check_reply(&req, &rep, err, sizeof err) == K3_ERR_PROTO,
          "ERROR with another step: %s", err);
    CHECK(proto_check_reply(&req, &s[15], err, sizeof err) == K3_ERR_PROTO,
          "STATS_OK to a FORWARD: %s", err);
    CHECK(proto_check_reply(&s[14], &s[15], err, sizeof err) == K3_OK, "STATS_OK answers STATS");
    CHECK(proto_check_reply(&s[17], &s[15], err, sizeof err) == K3_ERR_ARG,
          "HEARTBEAT is not a request");

    /* compatibility */
    proto_numerics a = sample_num(), b = a;
    CHECK(proto_check_compat(1, &a, 1, &b, err, sizeof err) == K3_OK,
          "same fingerprint and numerics");
    k3_status cs = proto_check_compat(0x1f, &a, 0x2a, &b, err, sizeof err);
    CHECK(cs == K3_ERR_MISMATCH &&
              strstr(err,
                     "fingerprint mismatch: expected 0x000000000000001f, got 0x000000000000002a"),
          "fingerprint: %s", err);
    b.bits = 8;
    cs = proto_check_compat(1, &a, 1, &b, err, sizeof err);
    CHECK(cs == K3_ERR_MISMATCH && strstr(err, "'bits' mismatch: expected 4, got 8"), "bits: %s",
          err);
    b = a;
    b.isa = 2; /* same bits at every ISA level: accepted, the coordinator warns */
    CHECK(proto_check_compat(1, &a, 1, &b, err, sizeof err) == K3_OK,
          "isa: another ISA level (avx2 vs avx512) is accepted");
    b = a;
    b.idot = false;
    CHECK(proto_check_compat(1, &a, 1, &b, err, sizeof err) == K3_ERR_MISMATCH &&
              strstr(err, "idot"),
          "idot: %s", err);
    b = a;
    b.dense_idot = true;
    CHECK(proto_check_compat(1, &a, 1, &b, err, sizeof err) == K3_ERR_MISMATCH &&
              strstr(err, "'dense_idot' mismatch: expected 0, got 1"),
          "dense_idot: %s", err);
    b = a;
    b.exact = true;
    CHECK(proto_check_compat(1, &a, 1, &b, err, sizeof err) == K3_ERR_MISMATCH &&
              strstr(err, "exact"),
          "exact: %s", err);
}

/* ---- allocation bombs, depth, object count ---- */

static long vm_hwm_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atol(line + 6);
    if (f) fclose(f);
    return kb;
}

typedef struct bomb {
    const char *name;
    uint8_t b[4096];
    size_t n;
} bomb;

static int make_bombs(bomb *bs) {
    int n = 0;
    const struct {
        const char *name;
        uint8_t b[5];
    } five[] = {
        {"array32 2^32-1", {0xdd, 0xff, 0xff, 0xff, 0xff}},
        {"array32 2^28", {0xdd, 0x10, 0x00, 0x00, 0x00}},
        {"array32 2^16", {0xdd, 0x00, 0x01, 0x00, 0x00}},
        {"map32 2^32-1", {0xdf, 0xff, 0xff, 0xff, 0xff}},
        {"map32 2^28", {0xdf, 0x10, 0x00, 0x00, 0x00}},
        {"map32 2^16", {0xdf, 0x00, 0x01, 0x00, 0x00}},
        {"str32 2^32-1", {0xdb, 0xff, 0xff, 0xff, 0xff}},
        {"bin32 2^32-1", {0xc6, 0xff, 0xff, 0xff, 0xff}},
        {"ext32 2^32-1", {0xc9, 0xff, 0xff, 0xff, 0xff}},
        {"array32 1e9", {0xdd, 0x3b, 0x9a, 0xca, 0x00}},
        {"map16 65535", {0xde, 0xff, 0xff, 0x00, 0x00}},
    };
    for (size_t i = 0; i < sizeof five / sizeof five[0]; i++) {
        bs[n].name = five[i].name;
        memcpy(bs[n].b, five[i].b, 5);
        bs[n++].n = 5;
    }
    /* nested array16 chains: 65535 each, and 200 each (fits alone, not together) */
    bs[n].name = "array16 65535 chain x1000";
    for (int i = 0; i < 1000; i++) memcpy(bs[n].b + 3 * i, "\xdc\xff\xff", 3);
    bs[n++].n = 3000;
    bs[n].name = "array16 200 chain x1000";
    for (int i = 0; i < 1000; i++) memcpy(bs[n].b + 3 * i, "\xdc\x00\xc8", 3);
    bs[n++].n = 3000;
    bs[n].name = "array 300 x map32 2^28 elements";
    memcpy(bs[n].b, "\xdc\x01\x2c", 3);
    for (int i = 0; i < 300; i++) memcpy(bs[n].b + 3 + 5 * i, "\xdf\x10\x00\x00\x00", 5);
    bs[n++].n = 3 + 1500;
    /* inside a plausible envelope: {"v": [1, 0], "t": <bomb>} */
    bs[n].name = "map with array32 2^32-1 value";
    memcpy(bs[n].b, "\x82\xa1v\x92\x01\x00\xa1t\xdd\xff\xff\xff\xff", 13);
    bs[n++].n = 13;
    bs[n].name = "map with str32 beyond remaining";
    memcpy(bs[n].b, "\x82\xa1v\x92\x01\x00\xa1t\xdb\x00\x00\x10\x00xx", 15);
    bs[n++].n = 15;
    bs[n].name = "str8 200 in 3 bytes";
    memcpy(bs[n].b, "\xd9\xc8x", 3);
    bs[n++].n = 3;
    return n;
}

static int run_bombs(const bomb *bs, int n, int reps) {
    int accepted = 0;
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < n; i++) {
            proto_msg d;
            char e[256];
            if (proto_prescan(bs[i].b, bs[i].n, e, sizeof e) == K3_OK) accepted++;
            if (proto_decode(bs[i].b, bs[i].n, &d, e, sizeof e) == K3_OK) accepted++;
        }
    return accepted;
}

static void test_bombs(void) {
    static bomb bs[32];
    int n = make_bombs(bs);
    int named = 1;
    for (int i = 0; i < n; i++) {
        k3_status st = proto_prescan(bs[i].b, bs[i].n, err, sizeof err);
        if (st == K3_OK) named = 0;
        printf("# %-34s -> %s: %s\n", bs[i].name, k3_status_name(st), err);
    }
    CHECK(named, "all %d bombs rejected by the pre-scan", n);
    long before = vm_hwm_kb();
    int accepted = run_bombs(bs, n, 200);
    long after = vm_hwm_kb();
    CHECK(accepted == 0 && before > 0 && after - before < 16 * 1024,
          "bombs x200 through prescan + decode: peak RSS grew %ld kB (< 16 MB)", after - before);

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    SKIP("RLIMIT_AS child decode",
         "under a sanitizer (shadow memory needs terabytes of address space)");
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) ||                         \
    __has_feature(memory_sanitizer)
    SKIP("RLIMIT_AS child decode", "under a sanitizer");
#define SKIP_RLIMIT 1
#endif
#endif
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && !defined(SKIP_RLIMIT)
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit rl = {512ull << 20, 512ull << 20};
        if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(3);
        /* proves the limit is in force (mmap: a malloc the compiler could elide) */
        void *probe =
            mmap(NULL, 1ull << 30, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (probe != MAP_FAILED) _exit(2);
        _exit(run_bombs(bs, n, 10) == 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "bombs under RLIMIT_AS 512 MB (a 1 GiB mmap fails there): child status 0x%x", status);
#endif
}

/* {"v":[1,minor+1],"t":14,"id":0,"ep":0,"req":0,"x":<value>}: HEARTBEAT
 * from a newer minor, so "x" is ignored after passing every structural check. */
static void hb_with(mp *w, const mp *value) {
    w->n = 0;
    mp_map(w, 6);
    mp_str(w, "v");
    mp_arr(w, 2);
    mp_u(w, 1);
    mp_u(w, PROTO_VERSION_MINOR + 1);
    mp_str(w, "t");
    mp_u(w, PROTO_MSG_HEARTBEAT);
    mp_str(w, "id");
    mp_u(w, 0);
    mp_str(w, "ep");
    mp_u(w, 0);
    mp_str(w, "req");
    mp_u(w, 0);
    mp_str(w, "x");
    mp_raw(w, value->b, value->n);
}

static void test_depth_objects(void) {
    static mp val, w;
    proto_msg d;
    k3_status st;
    /* depth: the map is depth 1, so 7 nested arrays reach the limit of 8 */
    val.n = 0;
    for (int i = 0; i < K3_PROTO_MAX_DEPTH - 1; i++) mp_arr(&val, i + 1 < K3_PROTO_MAX_DEPTH - 1);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_OK && d.n_ignored == 1, "depth %d (= limit) accepted through msgpack-c: %s",
          K3_PROTO_MAX_DEPTH, st ? err : "ok");
    val.n = 0;
    for (int i = 0; i < K3_PROTO_MAX_DEPTH; i++) mp_arr(&val, i + 1 < K3_PROTO_MAX_DEPTH);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "depth 9 at byte") && strstr(err, "K3_PROTO_MAX_DEPTH"),
          "depth %d rejected: %s", K3_PROTO_MAX_DEPTH + 1, err);
    val.n = 0;
    for (int i = 0; i < 40; i++) mp_arr(&val, 1);
    mp_u(&val, 0);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "depth"),
          "depth 41 (beyond msgpack-c's 32) is a limit error, not out-of-memory: %s", err);

    /* objects: 15 in the frame around "x"'s elements (map, 6 keys, 6 values,
     * 2 version ints) */
    int base = 15;
    val.n = 0;
    mp_arr(&val, (uint32_t)(K3_PROTO_MAX_OBJECTS - base));
    for (int i = 0; i < K3_PROTO_MAX_OBJECTS - base; i++) mp_u(&val, 1);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_OK, "exactly %d objects accepted: %s", K3_PROTO_MAX_OBJECTS, st ? err : "ok");
    val.n = 0;
    mp_arr(&val, (uint32_t)(K3_PROTO_MAX_OBJECTS - base + 1));
    for (int i = 0; i < K3_PROTO_MAX_OBJECTS - base + 1; i++) mp_u(&val, 1);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "K3_PROTO_MAX_OBJECTS"), "%d objects: %s",
          K3_PROTO_MAX_OBJECTS + 1, err);

    val.n = 0;
    mp_byte(&val, 0xc1);
    hb_with(&w, &val);
    st = proto_decode(w.b, w.n, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "0xc1"), "reserved byte 0xc1: %s", err);
    static uint8_t big[K3_PROTO_MAX_ENVELOPE + 1];
    st = proto_decode(big, sizeof big, &d, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "K3_PROTO_MAX_ENVELOPE"), "envelope of %zu bytes: %s",
          sizeof big, err);
    st = proto_decode((const uint8_t *)"", 0, &d, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "empty"), "empty envelope: %s", err);
}

/* ---- sockets ---- */

static void test_sockets(proto_msg *s) {
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER), *dealer = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0, tmo = 3000;
    zmq_setsockopt(router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(router, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    k3_status st = proto_socket_limit(router, err, sizeof err);
    int64_t maxmsg = 0;
    size_t ml = sizeof maxmsg;
    zmq_getsockopt(router, ZMQ_MAXMSGSIZE, &maxmsg, &ml);
    CHECK(st == K3_OK && maxmsg == (int64_t)K3_PROTO_MAX_FRAME_BYTES, "ZMQ_MAXMSGSIZE set to %lld",
          (long long)maxmsg);
    CHECK(zmq_bind(router, "inproc://test-proto") == 0 &&
              zmq_connect(dealer, "inproc://test-proto") == 0,
          "inproc ROUTER/DEALER pair");

    proto_msg got;
    proto_frames fr = {0};
    st = proto_recv(router, ZMQ_DONTWAIT, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_TIMEOUT, "nothing queued: timeout status (%s)", err);

    /* a FORWARD with its frames, and the reply routed back */
    float blocks[2 * 4 * 8], hidden[4 * 8];
    for (int i = 0; i < 64; i++) blocks[i] = (float)i * 0.5f - 3.0f;
    for (int i = 0; i < 32; i++) hidden[i] = 1.0f / (float)(i + 1);
    const void *fd[2] = {blocks, hidden};
    size_t fb[2] = {sizeof blocks, sizeof hidden};
    st = proto_send(dealer, NULL, &s[2], fd, fb, 2, 0, err, sizeof err);
    CHECK(st == K3_OK, "FORWARD sent with 2 tensor frames: %s", st ? err : "ok");
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    size_t b0 = 0, b1 = 0;
    const void *d0 = proto_frames_data(&fr, 0, &b0), *d1 = proto_frames_data(&fr, 1, &b1);
    CHECK(st == K3_OK && proto_msg_equal(&got, &s[2]) && fr.n == 2 && fr.from.len > 0 &&
              b0 == sizeof blocks && b1 == sizeof hidden && !memcmp(d0, blocks, b0) &&
              !memcmp(d1, hidden, b1) && proto_frames_data(&fr, 2, NULL) == NULL,
          "ROUTER received the FORWARD, its frames bit-identical, and the peer id: %s",
          st ? err : "ok");
    proto_peer peer = fr.from;
    proto_frames_close(&fr);
    float snaps[3 * 4 * 8];
    memset(snaps, 0, sizeof snaps);
    const void *rd[2] = {snaps, hidden};
    size_t rb[2] = {sizeof snaps, sizeof hidden};
    st = proto_send(router, &peer, &s[4], rd, rb, 2, 0, err, sizeof err);
    proto_msg rep;
    k3_status st2 = proto_recv(dealer, 0, &rep, &fr, err, sizeof err);
    CHECK(st == K3_OK && st2 == K3_OK && proto_msg_equal(&rep, &s[4]) && fr.n == 2 &&
              fr.from.len == 0 && proto_check_reply(&s[2], &rep, err, sizeof err) == K3_OK,
          "FORWARD_DONE routed back to the DEALER and matched to its request");
    proto_frames_close(&fr);

    /* send-side refusals leave nothing on the wire */
    size_t badb[2] = {sizeof blocks - 4, sizeof hidden};
    st = proto_send(dealer, NULL, &s[2], fd, badb, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "expected 256"),
          "proto_send refuses a wrong frame size: %s", err);
    st = proto_send(router, NULL, &s[4], rd, rb, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_ARG, "proto_send on a ROUTER without a peer: %s", err);
    proto_msg inval = s[2];
    inval.u.forward.n_tokens = 0;
    st = proto_send(dealer, NULL, &inval, fd, fb, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_PROTO, "proto_send refuses an invalid message: %s", err);
    st = proto_recv(router, ZMQ_DONTWAIT, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_TIMEOUT, "and nothing reached the peer");

    uint8_t env[PROTO_ENCODE_CAP];
    size_t env_len;
    proto_encode(&s[2], env, sizeof env, &env_len, err, sizeof err);
    uint8_t hb[PROTO_ENCODE_CAP];
    size_t hb_len;
    proto_encode(&s[17], hb, sizeof hb, &hb_len, err, sizeof err);

    /* too many frames: envelope + 20 frames */
    zmq_send(dealer, env, env_len, ZMQ_SNDMORE);
    for (int i = 0; i < 20; i++) zmq_send(dealer, blocks, 64, i < 19 ? ZMQ_SNDMORE : 0);
    zmq_send(dealer, hb, hb_len, 0);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "21 frames > limit 8") && fr.n == 0 && got.id == 1000 &&
              fr.from.len == peer.len,
          "21 frames drained and rejected, id and peer kept for the reply: %s", err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_OK && got.type == PROTO_MSG_HEARTBEAT, "the next message is read intact");

    /* a frame bigger than declared */
    zmq_send(dealer, env, env_len, ZMQ_SNDMORE);
    zmq_send(dealer, blocks, sizeof blocks, ZMQ_SNDMORE);
    float bigger[33] = {0};
    zmq_send(dealer, bigger, sizeof bigger, 0);
    zmq_send(dealer, hb, hb_len, 0);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "('hidden') has 132 bytes, expected 128") &&
              fr.n == 0 && got.id == 1000,
          "hidden frame 4 bytes bigger than declared: %s", err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_OK && got.type == PROTO_MSG_HEARTBEAT, "the next message is read intact");

    /* missing frames, a malformed envelope, an oversized envelope, empty */
    zmq_send(dealer, env, env_len, 0);
    zmq_send(dealer, env, env_len - 1, 0);
    static uint8_t huge[K3_PROTO_MAX_ENVELOPE + 100];
    zmq_send(dealer, huge, sizeof huge, 0);
    zmq_send(dealer, "", 0, 0);
    zmq_send(dealer, hb, hb_len, 0);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "0 tensor frame(s), expected 2"),
          "FORWARD without frames: %s", err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "truncated"), "truncated envelope: %s", err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "K3_PROTO_MAX_ENVELOPE"), "envelope over 64 KiB: %s",
          err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_ERR_PROTO && strstr(err, "empty"), "empty frame: %s", err);
    st = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(st == K3_OK && got.type == PROTO_MSG_HEARTBEAT, "and the next valid message is served");

    /* every strict prefix over the socket, then a valid request */
    int prefixes_ok = 1;
    for (size_t p = 0; p < env_len; p++) {
        zmq_send(dealer, env, p, ZMQ_SNDMORE);
        zmq_send(dealer, blocks, sizeof blocks, ZMQ_SNDMORE);
        zmq_send(dealer, hidden, sizeof hidden, 0);
        if (proto_recv(router, 0, &got, &fr, err, sizeof err) == K3_OK || fr.n != 0)
            prefixes_ok = 0;
    }
    st = proto_send(dealer, NULL, &s[2], fd, fb, 2, 0, err, sizeof err);
    st2 = proto_recv(router, 0, &got, &fr, err, sizeof err);
    CHECK(prefixes_ok && st == K3_OK && st2 == K3_OK && proto_msg_equal(&got, &s[2]),
          "all %zu envelope prefixes rejected over the socket, then a FORWARD served", env_len);
    proto_frames_close(&fr);
    proto_frames_close(&fr); /* idempotent */
    proto_frames_close(NULL);

    zmq_close(dealer);
    zmq_close(router);
    zmq_ctx_term(ctx);
}

/* ---- fuzz seeds ---- */

static void write_corpus(const char *dir, proto_msg *s, int n) {
    mkdir(dir, 0755);
    for (int i = 0; i < n; i++) {
        uint8_t b[PROTO_ENCODE_CAP];
        size_t l;
        char path[512];
        proto_encode(&s[i], b, sizeof b, &l, err, sizeof err);
        snprintf(path, sizeof path, "%s/%02d_%s", dir, i, proto_type_name(s[i].type));
        FILE *f = fopen(path, "wb");
        if (f) {
            fwrite(b, 1, l, f);
            fclose(f);
        }
    }
    static bomb bs[32];
    int nb = make_bombs(bs);
    for (int i = 0; i < nb; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/bomb_%02d", dir, i);
        FILE *f = fopen(path, "wb");
        if (f) {
            fwrite(bs[i].b, 1, bs[i].n, f);
            fclose(f);
        }
    }
    /* a newer-minor HEARTBEAT carrying an ignored key nested to the limit */
    static mp val, w;
    val.n = 0;
    for (int i = 0; i < K3_PROTO_MAX_DEPTH - 1; i++) mp_arr(&val, i + 1 < K3_PROTO_MAX_DEPTH - 1);
    hb_with(&w, &val);
    char path[512];
    snprintf(path, sizeof path, "%s/minor1_nested", dir);
    FILE *f = fopen(path, "wb");
    if (f) {
        fwrite(w.b, 1, w.n, f);
        fclose(f);
    }
    printf("# wrote %d seeds to %s\n", n + nb + 1, dir);
}

/* --worker-keys: "ENDPOINT KEY" beats "* KEY", comments and blank lines
 * skipped, a bad key named with its file and line, a missing file named. */
static void test_worker_keys(void) {
    char pub[3][41], sec[41], path[64], err[256], out[41];
    for (int i = 0; i < 3; i++) zmq_curve_keypair(pub[i], sec);
    snprintf(path, sizeof path, "/tmp/k3_test_wkeys_%d", (int)getpid());
    FILE *f = fopen(path, "w");
    if (!f) {
        CHECK(0, "worker keys: cannot write %s", path);
        return;
    }
    fprintf(f, "# worker keys\n\n* %s\ntcp://10.0.0.2:5555 %s\nipc:///tmp/w1   %s\n", pub[0],
            pub[1], pub[2]);
    fclose(f);
    k3_status st = k3_link_worker_key(path, "tcp://10.0.0.2:5555", out, err, sizeof err);
    CHECK(st == K3_OK && !strcmp(out, pub[1]), "worker keys: an endpoint's own line beats '*'");
    st = k3_link_worker_key(path, "ipc:///tmp/w1", out, err, sizeof err);
    CHECK(st == K3_OK && !strcmp(out, pub[2]), "worker keys: spaces between endpoint and key");
    st = k3_link_worker_key(path, "tcp://10.0.0.3:5555", out, err, sizeof err);
    CHECK(st == K3_OK && !strcmp(out, pub[0]), "worker keys: any other endpoint gets '*'");
    f = fopen(path, "w");
    if (f) {
        fprintf(f, "tcp://10.0.0.2:5555 %s\ntcp://10.0.0.3:5555 short\n", pub[1]);
        fclose(f);
    }
    st = k3_link_worker_key(path, "tcp://10.0.0.9:1", out, err, sizeof err);
    CHECK(st != K3_OK && strstr(err, path) && strstr(err, "line 2"),
          "worker keys: a bad key names the file and line: '%s'", err);
    f = fopen(path, "w");
    if (f) {
        fprintf(f, "tcp://10.0.0.2:5555 %s\n", pub[1]);
        fclose(f);
    }
    st = k3_link_worker_key(path, "tcp://10.0.0.9:1", out, err, sizeof err);
    CHECK(st == K3_OK && out[0] == 0, "worker keys: no line and no '*': no key");
    unlink(path);
    st = k3_link_worker_key(path, "tcp://10.0.0.9:1", out, err, sizeof err);
    CHECK(st == K3_ERR_IO && strstr(err, path), "worker keys: a missing file is named: '%s'", err);
}

int main(void) {
    static proto_msg s[MAX_SAMPLES];
    int n = make_samples(s);
    CHECK(!strcmp(proto_type_name(PROTO_MSG_FORWARD_DONE), "FORWARD_DONE") &&
              !strcmp(proto_type_name((proto_type)99), "?"),
          "proto_type_name");
    test_round_trip(s, n);
    test_prefixes_trailing(s, n);
    test_fields(s, n);
    test_keys_versions_types(s);
    test_validate(s);
    test_frames_checks(s);
    test_bombs();
    test_depth_objects();
    test_sockets(s);
    test_worker_keys();
    const char *dir = getenv("K3_PROTO_CORPUS_DIR");
    if (dir && *dir) write_corpus(dir, s, n);
    TEST_MAIN_END();
}
