/* tests/proto_samples.h: shared by tests/test_proto.c only: a tiny msgpack
 * writer (tests may not include msgpack.h, so hand-made envelopes are
 * written byte by byte), an envelope splitter/rebuilder for field mutations,
 * and one sample message of every type in several shapes. Split out of
 * test_proto.c to keep that file under the size limit of docs/ARCHITECTURE.md
 * "Modules".
 * Uses the including file's `err` buffer. */
#ifndef K3_TESTS_PROTO_SAMPLES_H
#define K3_TESTS_PROTO_SAMPLES_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "proto/proto.h"

/* ---- a tiny msgpack writer (tests may not include msgpack.h) ---- */

typedef struct mp {
    uint8_t b[80000];
    size_t n;
} mp;

static void mp_raw(mp *w, const void *p, size_t n) {
    if (w->n + n > sizeof w->b) abort();
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void mp_byte(mp *w, uint8_t c) { mp_raw(w, &c, 1); }
static void mp_be(mp *w, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) mp_byte(w, (uint8_t)(v >> (8 * i)));
}
static void mp_u(mp *w, uint64_t v) {
    if (v < 128)
        mp_byte(w, (uint8_t)v);
    else if (v <= 0xff) {
        mp_byte(w, 0xcc);
        mp_be(w, v, 1);
    } else if (v <= 0xffff) {
        mp_byte(w, 0xcd);
        mp_be(w, v, 2);
    } else if (v <= 0xffffffffu) {
        mp_byte(w, 0xce);
        mp_be(w, v, 4);
    } else {
        mp_byte(w, 0xcf);
        mp_be(w, v, 8);
    }
}
static void mp_neg(mp *w, int64_t v) {
    mp_byte(w, 0xd3);
    mp_be(w, (uint64_t)v, 8);
}
static void mp_f64(mp *w, double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    mp_byte(w, 0xcb);
    mp_be(w, u, 8);
}
static void mp_f32(mp *w, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    mp_byte(w, 0xca);
    mp_be(w, u, 4);
}
static void mp_strn(mp *w, const char *s, size_t n) {
    if (n < 32)
        mp_byte(w, (uint8_t)(0xa0 | n));
    else if (n <= 0xff) {
        mp_byte(w, 0xd9);
        mp_be(w, n, 1);
    } else {
        mp_byte(w, 0xda);
        mp_be(w, n, 2);
    }
    mp_raw(w, s, n);
}
static void mp_str(mp *w, const char *s) { mp_strn(w, s, strlen(s)); }
static void mp_arr(mp *w, uint32_t n) {
    if (n < 16)
        mp_byte(w, (uint8_t)(0x90 | n));
    else if (n <= 0xffff) {
        mp_byte(w, 0xdc);
        mp_be(w, n, 2);
    } else {
        mp_byte(w, 0xdd);
        mp_be(w, n, 4);
    }
}
static void mp_map(mp *w, uint32_t n) {
    if (n < 16)
        mp_byte(w, (uint8_t)(0x80 | n));
    else {
        mp_byte(w, 0xde);
        mp_be(w, n, 2);
    }
}

/* Skips one well-formed object (test input only). */
static size_t mp_skip(const uint8_t *b, size_t pos) {
    uint8_t c = b[pos++];
    uint64_t n = 0;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) return pos;
    if (c >= 0x80 && c <= 0x8f) {
        n = c & 15;
        for (uint64_t i = 0; i < 2 * n; i++) pos = mp_skip(b, pos);
        return pos;
    }
    if (c >= 0x90 && c <= 0x9f) {
        n = c & 15;
        for (uint64_t i = 0; i < n; i++) pos = mp_skip(b, pos);
        return pos;
    }
    if (c >= 0xa0 && c <= 0xbf) return pos + (c & 31);
    switch (c) {
    case 0xca: return pos + 4;
    case 0xcb: return pos + 8;
    case 0xcc:
    case 0xd0: return pos + 1;
    case 0xcd:
    case 0xd1: return pos + 2;
    case 0xce:
    case 0xd2: return pos + 4;
    case 0xcf:
    case 0xd3: return pos + 8;
    case 0xd9:
    case 0xc4: return pos + 1 + b[pos];
    case 0xda:
    case 0xc5: return pos + 2 + ((size_t)b[pos] << 8 | b[pos + 1]);
    case 0xdc:
        n = (uint64_t)b[pos] << 8 | b[pos + 1];
        pos += 2;
        for (uint64_t i = 0; i < n; i++) pos = mp_skip(b, pos);
        return pos;
    case 0xde:
        n = (uint64_t)b[pos] << 8 | b[pos + 1];
        pos += 2;
        for (uint64_t i = 0; i < 2 * n; i++) pos = mp_skip(b, pos);
        return pos;
    }
    abort(); /* not produced by our encoder */
}

/* An encoded envelope split into its pairs (spans into env). */
typedef struct pairs {
    uint8_t env[PROTO_ENCODE_CAP];
    size_t len;
    int n;
    size_t k0[64], k1[64], v1[64]; /* key start, value start, value end */
    char key[64][32];
} pairs;

static void split(const proto_msg *m, pairs *p) {
    memset(p, 0, sizeof *p);
    if (proto_encode(m, p->env, sizeof p->env, &p->len, err, sizeof err)) {
        printf("# encode failed: %s\n", err);
        abort();
    }
    size_t pos = 0;
    uint8_t c = p->env[pos++];
    if ((c & 0xf0) == 0x80)
        p->n = c & 15;
    else {
        p->n = p->env[pos] << 8 | p->env[pos + 1];
        pos += 2;
    }
    for (int i = 0; i < p->n; i++) {
        p->k0[i] = pos;
        size_t klen = p->env[pos] & 31; /* our keys are fixstr */
        memcpy(p->key[i], p->env + pos + 1, klen);
        p->k1[i] = pos = mp_skip(p->env, pos);
        p->v1[i] = pos = mp_skip(p->env, pos);
    }
}

/* Rebuilds the map: pair `skip` omitted (-1: none), pair `repl` given the
 * value val[vlen] (-1: none), extra raw pairs appended. */
static void rebuild(const pairs *p, int skip, int repl, const mp *val, const mp *extra, int n_extra,
                    mp *out) {
    out->n = 0;
    mp_map(out, (uint32_t)(p->n - (skip >= 0) + n_extra));
    for (int i = 0; i < p->n; i++) {
        if (i == skip) continue;
        mp_raw(out, p->env + p->k0[i], p->k1[i] - p->k0[i]);
        if (i == repl)
            mp_raw(out, val->b, val->n);
        else
            mp_raw(out, p->env + p->k1[i], p->v1[i] - p->k1[i]);
    }
    if (extra) mp_raw(out, extra->b, extra->n);
}

static int find_key(const pairs *p, const char *k) {
    for (int i = 0; i < p->n; i++)
        if (!strcmp(p->key[i], k)) return i;
    return -1;
}

/* ---- sample messages: every type, several shapes ---- */

static proto_numerics sample_num(void) {
    proto_numerics n = {
        .bits = 4, .mla_bits = 8, .head_bits = 8, .isa = 1, .idot = true, .exact = false};
    return n;
}

static int make_samples(proto_msg *s) {
    int n = 0;
    proto_msg *m;

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_HELLO, 1, 77);
    m->u.hello.fingerprint = 0x1234567890abcdefull;
    m->u.hello.num = sample_num();
    snprintf(m->u.hello.build, sizeof m->u.hello.build, "k3shard 0.1 gcc-12");

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_HELLO_OK, 1, 77);
    m->u.hello_ok.fingerprint = UINT64_MAX;
    m->u.hello_ok.layers[0] = 31;
    m->u.hello_ok.layers[1] = 62;
    m->u.hello_ok.num = sample_num();
    m->u.hello_ok.num.exact = true;
    m->u.hello_ok.max_sessions = 64;
    m->u.hello_ok.max_ctx = 8192;
    m->u.hello_ok.read_gbps = 6.75;
    snprintf(m->u.hello_ok.build, sizeof m->u.hello_ok.build, "k3shard 0.1 \xc3\xa9t\xc3\xa9");
    snprintf(m->u.hello_ok.name, sizeof m->u.hello_ok.name, "w1@nvme1");

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_FORWARD, 1000, 77);
    m->u.forward = (proto_forward){.session = 5,
                                   .step = 3,
                                   .pos0 = 96,
                                   .n_tokens = 4,
                                   .n_blocks = 2,
                                   .hidden = 8,
                                   .flags = PROTO_FWD_STATS};

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_FORWARD, 1001, 77);
    m->u.forward = (proto_forward){.session = 1ull << 40,
                                   .step = 0,
                                   .pos0 = 0,
                                   .n_tokens = 512,
                                   .n_blocks = 0,
                                   .hidden = 7168,
                                   .flags = 0};

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_FORWARD_DONE, 1000, 77);
    m->u.forward_done.session = 5;
    m->u.forward_done.step = 3;
    m->u.forward_done.n_snapshots = 3;
    m->u.forward_done.n_tokens = 4;
    m->u.forward_done.hidden = 8;
    m->u.forward_done.has_stats = true;
    m->u.forward_done.compute_ms = 12.5;
    m->u.forward_done.read_ms = 0.25;
    m->u.forward_done.bytes_read = 123456789;
    m->u.forward_done.expert_hits = 40;
    m->u.forward_done.expert_misses = 7;
    m->u.forward_done.n_drives = 3; /* 1.2 striping keys */
    m->u.forward_done.drive_bytes[0] = 1 << 20;
    m->u.forward_done.drive_bytes[2] = 3 << 20;
    m->u.forward_done.gather_ms = 0.75;
    m->u.forward_done.gather_layers = 2;
    m->u.forward_done.vk_calls = 11; /* 1.2 Vulkan tier keys */
    m->u.forward_done.vk_pairs = 29;
    m->u.forward_done.vk_promotions = 1;
    m->u.forward_done.vk_resident = 6;
    m->u.forward_done.vk_device_ms = 1.5;
    m->u.forward_done.vk_cpu_ms = 2.25;
    m->u.forward_done.vk_wait_ms = 0.125;
    m->u.forward_done.n_evicted = 2;
    m->u.forward_done.evicted[0] = 9;
    m->u.forward_done.evicted[1] = UINT64_MAX;

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_FORWARD_DONE, 1001, 77);
    m->u.forward_done.session = 1ull << 40;
    m->u.forward_done.n_tokens = 512;
    m->u.forward_done.hidden = 7168;

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_SESSION_RESET, 1002, 77);
    m->u.session.session = 5;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_SESSION_TRUNCATE, 1003, 77);
    m->u.session.session = 5;
    m->u.session.n_tokens = 90;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_SESSION_DROP, 1004, 77);
    m->u.session.session = 6;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_OK, 1004, 77);

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_ERROR, 1000, 77);
    m->u.error.code = K3_ERR_STATE;
    m->u.error.session = 5;
    m->u.error.step = 3;
    snprintf(m->u.error.msg, sizeof m->u.error.msg, "session 5 has 90 tokens, FORWARD pos0 = 96");
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_ERROR, 0, 0);
    m->u.error.code = K3_ERR_PROTO;

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_CANCEL, 1005, 77);
    m->u.cancel.request = 1000;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_CANCEL, 1006, 77);
    m->u.cancel.session = 5;

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_STATS, 1007, 77);
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_STATS_OK, 1007, 77);
    m->u.stats_ok = (proto_stats_ok){.forwards = 10,
                                     .tokens = 1000,
                                     .bytes_read = 1ull << 40,
                                     .expert_hits = 5,
                                     .expert_misses = 6,
                                     .evictions = 1,
                                     .proto_errors = 2,
                                     .sessions = 3,
                                     .busy_ms = 1e6,
                                     .read_ms = 0.0};
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_SHUTDOWN, 1008, 77);
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_HEARTBEAT, 0, 77);
    m->u.heartbeat.busy_request = 1000;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_HEARTBEAT, 0, 0);
    m = &s[n++]; /* 1.2: expert calls */
    proto_msg_init(m, PROTO_MSG_EXPERT_CALL, 1009, 77);
    m->u.expert_call = (proto_expert_call){
        .layer = 3, .drive = 1, .n_rows = 4, .latent = 64, .n_experts = 2, .n_pairs = 5};
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_EXPERT_DONE, 1009, 77);
    m->u.expert_done = (proto_expert_done){.layer = 3,
                                           .drive = 1,
                                           .n_pairs = 5,
                                           .latent = 64,
                                           .compute_ms = 1.5,
                                           .read_ms = 0.25,
                                           .bytes_read = 1 << 20,
                                           .expert_hits = 1,
                                           .expert_misses = 1};

    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_CHECKPOINT, 1009, 77);
    m->u.ckpt.session = 5;
    m->u.ckpt.pos = 90;
    m->u.ckpt.keep = 4;
    m = &s[n++];
    proto_msg_init(m, PROTO_MSG_RESTORE, 1010, 77);
    m->u.ckpt.session = 5;
    m->u.ckpt.pos = K3_MAX_CTX;
    return n;
}
#define MAX_SAMPLES 32

#endif
