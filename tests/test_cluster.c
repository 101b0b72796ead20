/* tests/test_cluster.c: the cluster against the single process, on tiny.
 *
 *  1. bit identity: logits (every prompt position, teacher forced, and every
 *     decode step) of 3 sessions of different lengths running concurrently
 *     equal (memcmp) the in-process trunk's, for 1, 2, 3 and 8 stages, chunk
 *     1 and 32, over ipc (--local N) and tcp on 127.0.0.1 (--workers, given
 *     out of layer order); pipelining and per-stage statistics;
 *  2. malformed messages to a live worker over a raw socket: every strict
 *     prefix of every request, trailing bytes, wrong types, oversized counts,
 *     unknown type, wrong version, bad frames: each answered with ERROR, the
 *     worker stays up and its next answer is still bit-exact; a new epoch
 *     mid-step (STATS counts the old states gone) and a stop under a storm
 *     of SIGTERMs (exit 0); and a fake worker sending bad replies to a
 *     coordinator: each step fails cleanly;
 *  3. liveness: kill -9, SIGSTOP / SIGCONT and a stuck compute thread are
 *     detected within their bounds with an error naming worker and layers;
 *     a restarted worker re-registers and a resumed session replays to the
 *     same tokens; session eviction is reported and replayed; SIGTERM stops
 *     a worker within 2 s.
 * Workers are the real build/k3-worker processes.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "common/engine/stage.h"
#include "coordinator/cluster.h"
#include "coordinator/generate.h"
#include "proto/link.h"
#include "proto/proto.h"
#include "tests/test.h"

static char err[4096];
static const char *g_dir;
static char g_bin[4096];
static char g_tmp[64];
static k3_model *g_full;   /* every layer + globals, default numerics, 1 thread */
static k3_model_opts g_mo; /* its options: what the workers must match */
static const k3_config *g_cfg;
static int g_V, g_D, g_L;

static double ms_now(void) { return k3_now_ms(); }

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- workers -------------------------------------------------------- */

/* Starts k3-worker for layers a-b on ep; extra args and env may be NULL. */
static pid_t worker_start(int a, int b, const char *ep, const char *name, int hb_ms,
                          const char *const *extra, char *const *env) {
    char layers[32], hb[16];
    snprintf(layers, sizeof layers, "%d-%d", a, b);
    snprintf(hb, sizeof hb, "%d", hb_ms);
    const char *argv[40] = {g_bin, "--model", g_dir, "--layers",  layers, "--listen",  ep, "--name",
                            name,  "--hb-ms", hb,    "--threads", "1",    "--no-bench"};
    int n = 14;
    for (int i = 0; extra && extra[i] && n < 38; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    pid_t pid = 0;
    if (k3_worker_spawn(&pid, g_bin, (char *const *)argv, env, err, sizeof err)) {
        printf("# spawn: %s\n", err);
        return 0;
    }
    return pid;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

static void cluster_opts(k3_cluster_opts *o) {
    k3_cluster_opts_default(o);
    o->model = &g_mo;
    o->hb_ms = 500;
    o->step_timeout_ms = 10000;
    o->ready_timeout_ms = 20000;
    o->worker_threads = 1;
    static const char *const args[] = {"--no-bench"};
    o->worker_args = args;
    o->n_worker_args = 1;
    /* tests/integration/test_xstripe.sh: local workers serve each other's
     * drives (K3_PLACEMENT names the placement) */
    o->stripe_remote = getenv("K3_TEST_STRIPE_REMOTE") != NULL;
}

/* ---- scripts: a session's prompt and decode, logits recorded --------- */

typedef struct script {
    int32_t prompt[64];
    int n, ndec;
} script;

typedef struct run_out {
    float *plog; /* [n][V] teacher-forced logits of the prompt */
    float *dlog; /* [ndec][V] logits of each decode step */
    int32_t toks[64];
    k3_status st;
    char err[1024];
} run_out;

static void rec_logits(void *ctx, int pos0, int T, int vocab, const float *logits) {
    run_out *o = ctx;
    memcpy(o->plog + (size_t)pos0 * vocab, logits, sizeof(float) * (size_t)T * vocab);
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

typedef struct run_arg {
    k3_trunk *trunk;
    int chunk;
    const script *sc;
    run_out *out;
} run_arg;

static void *run_script(void *p) {
    run_arg *a = p;
    run_out *o = a->out;
    const script *sc = a->sc;
    k3_session *s = NULL;
    k3_session_opts so = {.max_ctx = sc->n + sc->ndec + 1, .chunk = a->chunk};
    o->st = k3_session_open(&s, g_full, a->trunk, &so, o->err, sizeof o->err);
    k3_feed_hooks hk = {.logits = rec_logits, .logits_ctx = o};
    const float *lg = NULL;
    if (!o->st)
        o->st = k3_session_feed(s, sc->prompt, sc->n, &hk, &lg, NULL, o->err, sizeof o->err);
    for (int d = 0; d < sc->ndec && !o->st; d++) {
        int32_t id = argmax(lg, g_V);
        o->toks[d] = id;
        memcpy(o->dlog + (size_t)d * g_V, lg, sizeof(float) * g_V);
        o->st = k3_session_append(s, &id, 1, NULL, &lg, o->err, sizeof o->err);
    }
    k3_session_close(&s);
    return NULL;
}

#define N_SCRIPTS 3
static script g_sc[N_SCRIPTS];

static void make_scripts(void) {
    const int n[N_SCRIPTS] = {37, 20, 53}, nd[N_SCRIPTS] = {6, 10, 4};
    uint32_t seed = 12345;
    for (int k = 0; k < N_SCRIPTS; k++) {
        g_sc[k].n = n[k];
        g_sc[k].ndec = nd[k];
        for (int t = 0; t < n[k]; t++) {
            seed = seed * 1664525u + 1013904223u;
            g_sc[k].prompt[t] = (int32_t)((seed >> 8) % (uint32_t)g_V);
        }
    }
}

static void outs_alloc(run_out *o) {
    for (int k = 0; k < N_SCRIPTS; k++) {
        memset(&o[k], 0, sizeof o[k]);
        o[k].plog = calloc((size_t)g_sc[k].n * g_V, sizeof(float));
        o[k].dlog = calloc((size_t)g_sc[k].ndec * g_V, sizeof(float));
    }
}

static void outs_free(run_out *o) {
    for (int k = 0; k < N_SCRIPTS; k++) {
        free(o[k].plog);
        free(o[k].dlog);
    }
}

/* Runs the 3 scripts; concurrently (one thread each) when threads != 0. */
static int run_all(k3_trunk *t, int chunk, int threads, run_out *o) {
    pthread_t th[N_SCRIPTS];
    run_arg a[N_SCRIPTS];
    for (int k = 0; k < N_SCRIPTS; k++) {
        a[k] = (run_arg){t, chunk, &g_sc[k], &o[k]};
        if (threads)
            pthread_create(&th[k], NULL, run_script, &a[k]);
        else
            run_script(&a[k]);
    }
    int ok = 1;
    for (int k = 0; k < N_SCRIPTS; k++) {
        if (threads) pthread_join(th[k], NULL);
        if (o[k].st) {
            printf("# session %d: %s\n", k, o[k].err);
            ok = 0;
        }
    }
    return ok;
}

static int outs_equal(const run_out *a, const run_out *b) {
    for (int k = 0; k < N_SCRIPTS; k++) {
        if (memcmp(a[k].plog, b[k].plog, sizeof(float) * (size_t)g_sc[k].n * g_V) ||
            memcmp(a[k].dlog, b[k].dlog, sizeof(float) * (size_t)g_sc[k].ndec * g_V) ||
            memcmp(a[k].toks, b[k].toks, sizeof(int32_t) * (size_t)g_sc[k].ndec)) {
            printf("# session %d differs\n", k);
            return 0;
        }
    }
    return 1;
}

/* ---- 1. bit identity ------------------------------------------------- */

static run_out g_ref[2][N_SCRIPTS]; /* in-process, chunk 1 and 32 */
static const int g_chunks[2] = {1, 32};

static void test_identity(void) {
    k3_trunk *in = NULL;
    if (k3_trunk_open_inproc(&in, g_full, err, sizeof err)) {
        CHECK(0, "in-process trunk: %s", err);
        return;
    }
    for (int c = 0; c < 2; c++) {
        outs_alloc(g_ref[c]);
        CHECK(run_all(in, g_chunks[c], 0, g_ref[c]), "in-process reference, chunk %d", g_chunks[c]);
    }
    k3_trunk_close(&in);

    static const int splits[4] = {1, 2, 3, 8};
    for (int tr = 0; tr < 2; tr++)
        for (int si = 0; si < 4; si++) {
            int S = splits[si];
            k3_cluster_opts o;
            cluster_opts(&o);
            const char *eps[8];
            char epbuf[8][64];
            pid_t pids[8] = {0};
            if (tr == 1) { /* tcp: our own workers, listed in reverse layer order */
                for (int i = 0; i < S; i++) {
                    int a = i * g_L / S, b = (i + 1) * g_L / S;
                    snprintf(epbuf[i], sizeof epbuf[i], "tcp://127.0.0.1:%d", free_port());
                    char name[32];
                    snprintf(name, sizeof name, "tcp%d", i);
                    pids[i] = worker_start(a, b, epbuf[i], name, 500, NULL, NULL);
                    eps[S - 1 - i] = epbuf[i];
                }
                o.workers = eps;
                o.n_workers = S;
            } else {
                o.local = S;
            }
            const char *tn = tr ? "tcp" : "ipc";
            k3_cluster *cl = NULL;
            double t0 = ms_now();
            k3_status st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
            CHECK(!st, "%s, %d stages: cluster up in %.0f ms%s%s", tn, S, ms_now() - t0,
                  st ? ": " : "", st ? err : "");
            if (!st) {
                k3_trunk *t = NULL;
                k3_cluster_trunk(cl, &t, err, sizeof err);
                int ordered = 1;
                for (int i = 0; i < S; i++) {
                    k3_stage_info inf;
                    k3_cluster_stage_info(cl, i, &inf);
                    ordered &= inf.layer_a == i * g_L / S && inf.layer_b == (i + 1) * g_L / S;
                }
                CHECK(ordered, "%s, %d stages: stages sorted by layer range", tn, S);
                for (int c = 0; c < 2; c++) {
                    run_out out[N_SCRIPTS];
                    outs_alloc(out);
                    int ok = run_all(t, g_chunks[c], 1, out);
                    CHECK(ok && outs_equal(out, g_ref[c]),
                          "%s, %d stages, chunk %d, 3 concurrent sessions: logits bit-identical "
                          "to in-process",
                          tn, S, g_chunks[c]);
                    outs_free(out);
                }
                if (S >= 2) {
                    k3_stage_info inf;
                    k3_cluster_stage_info(cl, 1, &inf);
                    double ov = k3_cluster_overlap_ms(cl);
                    CHECK(inf.forwards > 0 && inf.busy_ms > 0 && ov > 0,
                          "%s, %d stages: stage 1 ran %llu steps, busy %.2f ms; %.1f ms with 2+ "
                          "stages busy (pipelined chunks, interleaved sessions)",
                          tn, S, (unsigned long long)inf.forwards, inf.busy_ms, ov);
                }
                if (S == 3 && tr == 0) k3_cluster_print_stats(cl, stdout);
                k3_trunk_close(&t);
            }
            k3_cluster_close(&cl);
            for (int i = 0; i < S; i++)
                if (pids[i]) k3_worker_stop(pids[i], 2000);
        }
}

/* ---- 2a. malformed messages to a live worker ------------------------ */

static void *g_zctx;

/* Sends raw frames on a DEALER; waits up to 2 s for one reply. Returns 1
 * and the decoded reply, 0 on timeout. */
static int raw_send(void *s, const void *env, size_t env_len, const void *const *fr,
                    const size_t *frb, int nfr) {
    int rc = zmq_send(s, env, env_len, nfr ? ZMQ_SNDMORE : 0);
    for (int i = 0; i < nfr && rc >= 0; i++)
        rc = zmq_send(s, fr[i], frb[i], i + 1 < nfr ? ZMQ_SNDMORE : 0);
    return rc >= 0;
}

static int recv_reply(void *s, proto_msg *m, proto_frames *fr, int timeout_ms) {
    double until = ms_now() + timeout_ms;
    for (;;) {
        zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
        double left = until - ms_now();
        if (left <= 0 || zmq_poll(&it, 1, (long)left) <= 0) return 0;
        char e[512];
        k3_status st = proto_recv(s, ZMQ_DONTWAIT, m, fr, e, sizeof e);
        if (st) {
            printf("# undecodable reply: %s\n", e);
            return 0;
        }
        if (m->type != PROTO_MSG_HEARTBEAT) return 1;
    }
}

/* mini msgpack writer for hand-made envelopes (only proto/ has msgpack.h) */
typedef struct mp {
    uint8_t b[512];
    size_t n;
} mp;
static void mp_byte(mp *p, uint8_t x) { p->b[p->n++] = x; }
static void mp_map(mp *p, int n) { mp_byte(p, (uint8_t)(0x80 | n)); }
static void mp_str(mp *p, const char *s) {
    size_t l = strlen(s);
    mp_byte(p, (uint8_t)(0xa0 | l));
    memcpy(p->b + p->n, s, l);
    p->n += l;
}
static void mp_uint(mp *p, uint64_t v) {
    if (v < 128) {
        mp_byte(p, (uint8_t)v);
    } else {
        mp_byte(p, 0xcf);
        for (int i = 7; i >= 0; i--) mp_byte(p, (uint8_t)(v >> (8 * i)));
    }
}
static void mp_neg1(mp *p) { mp_byte(p, 0xff); }
static void mp_ver(mp *p, int major, int minor) {
    mp_byte(p, 0x92);
    mp_uint(p, (uint64_t)major);
    mp_uint(p, (uint64_t)minor);
}

/* A FORWARD envelope with one field replaced (field = NULL: valid). */
enum {
    FW_OK,
    FW_T_STR,
    FW_POS_NEG,
    FW_T_BIG,
    FW_NB_BIG,
    FW_D_BAD,
    FW_FLAGS,
    FW_VER,
    FW_TYPE,
    FW_DUP,
    FW_MISSING,
    FW_UNKNOWN,
    FW_N
};
static const char *const f_names[FW_N] = {
    "valid",           "'t' as a string", "negative 'pos0'",  "'T' 600 > 512",
    "'nb' 17 > 16",    "'D' 65 != 64",    "unknown flag bit", "version 2.0",
    "unknown type 99", "duplicate key",   "missing 'T'",      "unknown key"};

static void mp_forward(mp *p, int f, uint64_t id, uint64_t ep, uint64_t sess) {
    p->n = 0;
    int keys = 11 + (f == FW_DUP || f == FW_UNKNOWN) - (f == FW_MISSING);
    mp_map(p, keys);
    mp_str(p, "v");
    mp_ver(p, f == FW_VER ? 2 : 1, 0);
    mp_str(p, "t");
    if (f == FW_T_STR)
        mp_str(p, "3");
    else
        mp_uint(p, f == FW_TYPE ? 99 : 3);
    mp_str(p, "id");
    mp_uint(p, id);
    mp_str(p, "ep");
    mp_uint(p, ep);
    mp_str(p, "sess");
    mp_uint(p, sess);
    mp_str(p, "step");
    mp_uint(p, 1);
    mp_str(p, "pos0");
    if (f == FW_POS_NEG)
        mp_neg1(p);
    else
        mp_uint(p, 0);
    if (f != FW_MISSING) {
        mp_str(p, "T");
        mp_uint(p, f == FW_T_BIG ? 600 : 1);
    }
    mp_str(p, "nb");
    mp_uint(p, f == FW_NB_BIG ? 17 : 0);
    mp_str(p, "D");
    mp_uint(p, f == FW_D_BAD ? 65 : 64);
    mp_str(p, "flags");
    mp_uint(p, f == FW_FLAGS ? 2 : 0);
    if (f == FW_DUP) {
        mp_str(p, "step");
        mp_uint(p, 2);
    }
    if (f == FW_UNKNOWN) {
        mp_str(p, "zz");
        mp_uint(p, 0);
    }
}

/* The in-process output of the whole stack for one token (the reference
 * for the raw FORWARD, [0, n_layers) on one worker). */
static void ref_one_token(int32_t id, float *h_in, float *h_out, float *blocks, int *nb) {
    k3_state *s = NULL;
    k3_state_open(&s, g_full, 16, err, sizeof err);
    k3_model_embed(g_full, &id, 1, h_in, err, sizeof err);
    memcpy(h_out, h_in, sizeof(float) * g_D);
    *nb = 0;
    k3_stage_forward(g_full, s, 0, 1, blocks, nb, h_out, NULL, NULL, NULL, err, sizeof err);
    k3_state_close(&s);
}

static void test_malformed_worker(void) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/raw", g_tmp);
    pid_t pid = worker_start(0, g_L, ep, "raw", 1000, NULL, NULL);
    void *s = zmq_socket(g_zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(s, ep);
    proto_msg m, r;
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    uint8_t env[PROTO_ENCODE_CAP];
    size_t env_len;
    uint64_t fp;
    k3_model_fingerprint_dir(g_dir, g_cfg, g_mo.topp, &fp, err, sizeof err);
    int sent_bad = 0; /* messages the worker must count as malformed */

    /* before HELLO: a valid STATS gets "not registered" */
    proto_msg_init(&m, PROTO_MSG_STATS, 1, 7);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    int got = recv_reply(s, &r, &fr, 10000); /* the worker may still be loading */
    CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_STATE &&
              strstr(r.u.error.msg, "not registered"),
          "raw: a request before HELLO is refused: '%s'", got ? r.u.error.msg : "(no reply)");

    /* HELLO with a wrong fingerprint, then the right one */
    proto_msg_init(&m, PROTO_MSG_HELLO, 2, 7);
    k3_link_numerics(g_mo.bits, g_mo.mla_bits, g_mo.head_bits, g_mo.idot, g_mo.dense_idot, 0,
                     &m.u.hello.num);
    snprintf(m.u.hello.build, sizeof m.u.hello.build, "%s", k3_link_build());
    m.u.hello.fingerprint = fp ^ 1;
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = recv_reply(s, &r, &fr, 2000);
    CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_MISMATCH &&
              strstr(r.u.error.msg, "fingerprint"),
          "raw: HELLO with another fingerprint refused: '%s'", got ? r.u.error.msg : "(none)");
    m.u.hello.num.bits = 8;
    m.u.hello.fingerprint = fp;
    m.id = 3;
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = recv_reply(s, &r, &fr, 2000);
    CHECK(got && r.type == PROTO_MSG_ERROR && strstr(r.u.error.msg, "bits"),
          "raw: HELLO with other numerics refused: '%s'", got ? r.u.error.msg : "(none)");
    m.u.hello.num.bits = (uint32_t)g_mo.bits;
    m.id = 4;
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = recv_reply(s, &r, &fr, 2000);
    CHECK(got && r.type == PROTO_MSG_HELLO_OK && r.u.hello_ok.layers[0] == 0 &&
              r.u.hello_ok.layers[1] == (uint32_t)g_L,
          "raw: HELLO accepted, layers [%u, %u)", r.u.hello_ok.layers[0], r.u.hello_ok.layers[1]);
    const uint64_t EP = 7;

    /* every strict prefix of every request type, then trailing bytes */
    static const proto_type types[] = {PROTO_MSG_HELLO,         PROTO_MSG_FORWARD,
                                       PROTO_MSG_SESSION_RESET, PROTO_MSG_SESSION_TRUNCATE,
                                       PROTO_MSG_SESSION_DROP,  PROTO_MSG_CANCEL,
                                       PROTO_MSG_STATS,         PROTO_MSG_SHUTDOWN,
                                       PROTO_MSG_HEARTBEAT,     PROTO_MSG_CHECKPOINT,
                                       PROTO_MSG_RESTORE};
    float *hbuf = calloc((size_t)g_D + 1, sizeof(float));
    int all_answered = 1, n_prefix = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        proto_msg_init(&m, types[ti], 100 + ti, EP);
        if (types[ti] == PROTO_MSG_HELLO) {
            m.u.hello.fingerprint = fp;
            k3_link_numerics(g_mo.bits, g_mo.mla_bits, g_mo.head_bits, g_mo.idot, g_mo.dense_idot,
                             0, &m.u.hello.num);
            snprintf(m.u.hello.build, sizeof m.u.hello.build, "%s", k3_link_build());
        } else if (types[ti] == PROTO_MSG_FORWARD) {
            m.u.forward =
                (proto_forward){.session = 9, .step = 1, .n_tokens = 1, .hidden = (uint32_t)g_D};
        } else if (types[ti] >= PROTO_MSG_SESSION_RESET && types[ti] <= PROTO_MSG_SESSION_DROP) {
            m.u.session.session = 9;
        } else if (types[ti] == PROTO_MSG_CANCEL) {
            m.u.cancel.session = 9;
        } else if (types[ti] == PROTO_MSG_HEARTBEAT) {
            m.id = 0;
        } else if (types[ti] == PROTO_MSG_CHECKPOINT || types[ti] == PROTO_MSG_RESTORE) {
            m.u.ckpt = (proto_ckpt){
                .session = 9, .pos = 1, .keep = types[ti] == PROTO_MSG_RESTORE ? 0 : 1};
        }
        if (proto_encode(&m, env, sizeof env, &env_len, err, sizeof err)) {
            CHECK(0, "encode %s: %s", proto_type_name(types[ti]), err);
            continue;
        }
        const void *frs[2] = {hbuf, hbuf};
        size_t frb[2] = {0, sizeof(float) * (size_t)g_D};
        int nfr = types[ti] == PROTO_MSG_FORWARD ? 2 : 0;
        for (size_t len = 0; len <= env_len; len++) {
            uint8_t buf[PROTO_ENCODE_CAP + 1];
            memcpy(buf, env, env_len);
            size_t n = len;
            if (len == env_len) buf[n++] = 0xc0; /* trailing byte */
            raw_send(s, buf, n, frs, frb, nfr);
            sent_bad++;
            n_prefix++;
            got = recv_reply(s, &r, &fr, 2000);
            if (!got || r.type != PROTO_MSG_ERROR || r.u.error.code == 0) {
                printf("# %s prefix %zu/%zu: %s\n", proto_type_name(types[ti]), len, env_len,
                       got ? proto_type_name(r.type) : "no reply");
                all_answered = 0;
            }
        }
    }
    CHECK(all_answered,
          "raw: %d strict prefixes and trailing-byte variants of %zu request types "
          "each answered with ERROR",
          n_prefix, sizeof types / sizeof types[0]);

    /* wrong types and values, field by field */
    for (int f = FW_T_STR; f < FW_N; f++) {
        mp p;
        mp_forward(&p, f, 200 + (uint64_t)f, EP, 9);
        const void *frs[2] = {hbuf, hbuf};
        /* D 65 with a 65-float frame: a valid message failing the
         * receiver's own limit (not counted as malformed) */
        size_t frb[2] = {0, sizeof(float) * (size_t)(g_D + (f == FW_D_BAD))};
        raw_send(s, p.b, p.n, frs, frb, 2);
        got = recv_reply(s, &r, &fr, 2000);
        sent_bad += f != FW_D_BAD;
        CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code != 0 && r.u.error.msg[0] &&
                  (f != FW_D_BAD || r.u.error.code == K3_ERR_MISMATCH),
              "raw: FORWARD with %s -> ERROR %u '%s'", f_names[f], got ? r.u.error.code : 0,
              got ? r.u.error.msg : "(none)");
    }
    /* the hand-made valid one is accepted: the writer above is right */
    {
        mp p;
        mp_forward(&p, FW_OK, 300, EP, 9);
        const void *frs[2] = {hbuf, hbuf};
        size_t frb[2] = {0, sizeof(float) * (size_t)g_D};
        raw_send(s, p.b, p.n, frs, frb, 2);
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_FORWARD_DONE, "raw: the hand-made valid FORWARD runs (%s)",
              got ? proto_type_name(r.type) : "none");
        proto_msg_init(&m, PROTO_MSG_SESSION_DROP, 301, EP);
        m.u.session.session = 9;
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        raw_send(s, env, env_len, NULL, NULL, 0);
        recv_reply(s, &r, &fr, 2000);
    }
    /* allocation bombs, junk, bad frames */
    {
        static const uint8_t bombs[][6] = {
            {0xdf, 0xff, 0xff, 0xff, 0xff}, {0xdd, 0x10, 0, 0, 0}, {0xdc, 0xff, 0xff}, {0xc1},
            {0xdb, 0xff, 0xff, 0xff, 0xff}, {0x81, 0xa1, 'v'}};
        static const size_t blen[] = {5, 5, 3, 1, 5, 3};
        for (size_t i = 0; i < sizeof blen / sizeof blen[0]; i++) {
            raw_send(s, bombs[i], blen[i], NULL, NULL, 0);
            sent_bad++;
            got = recv_reply(s, &r, &fr, 2000);
            CHECK(got && r.type == PROTO_MSG_ERROR,
                  "raw: bomb/junk %zu (%zu bytes, first 0x%02x) -> "
                  "ERROR '%s'",
                  i, blen[i], bombs[i][0], got ? r.u.error.msg : "(none)");
        }
        proto_msg_init(&m, PROTO_MSG_FORWARD, 400, EP);
        m.u.forward =
            (proto_forward){.session = 9, .step = 1, .n_tokens = 1, .hidden = (uint32_t)g_D};
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        const void *frs[9] = {hbuf, hbuf, hbuf, hbuf, hbuf, hbuf, hbuf, hbuf, hbuf};
        size_t frb[9] = {0, sizeof(float) * (size_t)g_D - 4, 4, 4, 4, 4, 4, 4, 4};
        raw_send(s, env, env_len, frs, frb, 1); /* hidden frame missing */
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_ERROR, "raw: FORWARD without its hidden frame -> '%s'",
              got ? r.u.error.msg : "(none)");
        raw_send(s, env, env_len, frs, frb, 2); /* hidden frame 4 bytes short */
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_ERROR, "raw: FORWARD with a short hidden frame -> '%s'",
              got ? r.u.error.msg : "(none)");
        raw_send(s, env, env_len, frs, frb, 9); /* 10 frames > 8 */
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_LIMIT,
              "raw: 10 frames -> '%s'", got ? r.u.error.msg : "(none)");
        sent_bad += 3;
        proto_msg_init(&m, PROTO_MSG_OK, 401, EP); /* a reply type sent to a worker */
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        raw_send(s, env, env_len, NULL, NULL, 0);
        got = recv_reply(s, &r, &fr, 2000);
        sent_bad++;
        CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_PROTO,
              "raw: an OK sent to a worker -> '%s'", got ? r.u.error.msg : "(none)");
    }
    /* state errors: stale epoch, a session that does not start at 0 */
    {
        proto_msg_init(&m, PROTO_MSG_STATS, 500, EP + 1);
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        raw_send(s, env, env_len, NULL, NULL, 0);
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_ERROR && strstr(r.u.error.msg, "stale epoch"),
              "raw: another epoch -> '%s'", got ? r.u.error.msg : "(none)");
        proto_msg_init(&m, PROTO_MSG_FORWARD, 501, EP);
        m.u.forward = (proto_forward){
            .session = 77, .step = 1, .pos0 = 5, .n_tokens = 1, .hidden = (uint32_t)g_D};
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        const void *frs[2] = {hbuf, hbuf};
        size_t frb[2] = {0, sizeof(float) * (size_t)g_D};
        raw_send(s, env, env_len, frs, frb, 2);
        got = recv_reply(s, &r, &fr, 2000);
        CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_STATE &&
                  r.u.error.session == 77,
              "raw: unknown session at pos0 5 -> '%s'", got ? r.u.error.msg : "(none)");
        /* a block count the layer range does not take (buffer sizing) */
        proto_msg_init(&m, PROTO_MSG_FORWARD, 502, EP);
        m.u.forward = (proto_forward){
            .session = 78, .step = 1, .n_tokens = 1, .n_blocks = 2, .hidden = (uint32_t)g_D};
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        float *b2 = calloc(3 * (size_t)g_D, sizeof(float));
        const void *frs2[2] = {b2, b2};
        size_t frb2[2] = {2 * sizeof(float) * (size_t)g_D, sizeof(float) * (size_t)g_D};
        raw_send(s, env, env_len, frs2, frb2, 2);
        got = recv_reply(s, &r, &fr, 2000);
        free(b2);
        CHECK(got && r.type == PROTO_MSG_ERROR && r.u.error.code == K3_ERR_ARG &&
                  strstr(r.u.error.msg, "'nb'"),
              "raw: 2 AttnRes blocks into layer 0 -> '%s'", got ? r.u.error.msg : "(none)");
    }
    /* still up: STATS counts the malformed ones, a valid step is exact */
    proto_msg_init(&m, PROTO_MSG_STATS, 600, EP);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = recv_reply(s, &r, &fr, 2000);
    CHECK(got && r.type == PROTO_MSG_STATS_OK && r.u.stats_ok.proto_errors == (uint64_t)sent_bad,
          "raw: worker up, STATS_OK counts %llu malformed messages (sent %d)",
          got ? (unsigned long long)r.u.stats_ok.proto_errors : 0ull, sent_bad);
    {
        float *h_in = calloc((size_t)g_D, sizeof(float)),
              *h_ref = calloc((size_t)g_D, sizeof(float));
        float *blocks = calloc((size_t)K3_MAX_RES_ENTRIES * g_D, sizeof(float));
        int nb = 0;
        ref_one_token(42, h_in, h_ref, blocks, &nb);
        proto_msg_init(&m, PROTO_MSG_FORWARD, 601, EP);
        m.u.forward =
            (proto_forward){.session = 10, .step = 1, .n_tokens = 1, .hidden = (uint32_t)g_D};
        proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
        const void *frs[2] = {h_in, h_in};
        size_t frb[2] = {0, sizeof(float) * (size_t)g_D};
        raw_send(s, env, env_len, frs, frb, 2);
        got = recv_reply(s, &r, &fr, 2000);
        size_t n0 = 0, n1 = 0;
        const void *snap = got ? proto_frames_data(&fr, 0, &n0) : NULL;
        const void *hid = got ? proto_frames_data(&fr, 1, &n1) : NULL;
        CHECK(got && r.type == PROTO_MSG_FORWARD_DONE && (int)r.u.forward_done.n_snapshots == nb &&
                  n1 == sizeof(float) * (size_t)g_D && !memcmp(hid, h_ref, n1) &&
                  n0 == sizeof(float) * (size_t)nb * g_D && !memcmp(snap, blocks, n0),
              "raw: the next valid FORWARD is answered bit-exactly (%d snapshots)", nb);
        free(h_in);
        free(h_ref);
        free(blocks);
    }
    /* SHUTDOWN: OK, then the process exits 0 */
    proto_msg_init(&m, PROTO_MSG_SHUTDOWN, 700, EP);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = recv_reply(s, &r, &fr, 2000);
    int status = -1;
    double t0 = ms_now();
    while (ms_now() - t0 < 3000 && !k3_worker_exited(pid, &status)) sleep_ms(10);
    CHECK(got && r.type == PROTO_MSG_OK && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "raw: SHUTDOWN answered OK, worker exited with status 0 after %.0f ms", ms_now() - t0);
    if (!(WIFEXITED(status))) k3_worker_stop(pid, 1000);
    proto_frames_close(&fr);
    free(hbuf);
    zmq_close(s);
}

/* One worker, two endings of a life.
 * A new epoch mid-step: FORWARD, then at once HELLO with a new epoch and
 * STATS. The worker reads both at the step's next layer, frees the old
 * states only when the step stops, and must already count them gone in
 * STATS_OK (T2 read 1 held under TSan, where the step is slow enough).
 * Stopping while signals keep coming: SHUTDOWN, then SIGTERM every
 * millisecond until it is gone. zmq_ctx_term, called on the way out,
 * returns EINTR when a signal lands while it waits for libzmq's reaper; a
 * worker that gave up there left that thread unjoined (under make tsan: a
 * thread leak, exit 66, seen when cl_local_stop's SIGTERM followed the
 * SHUTDOWN). It must retry and exit 0. */
static void test_epoch_and_stop(void) {
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/sig", g_tmp);
    pid_t pid = worker_start(0, g_L, ep, "sig", 1000, NULL, NULL);
    void *s = zmq_socket(g_zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_connect(s, ep);
    proto_msg m, r;
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    uint8_t env[PROTO_ENCODE_CAP];
    size_t env_len;
    proto_msg_init(&m, PROTO_MSG_HELLO, 1, 9);
    k3_link_numerics(g_mo.bits, g_mo.mla_bits, g_mo.head_bits, g_mo.idot, g_mo.dense_idot, 0,
                     &m.u.hello.num);
    snprintf(m.u.hello.build, sizeof m.u.hello.build, "%s", k3_link_build());
    k3_model_fingerprint_dir(g_dir, g_cfg, g_mo.topp, &m.u.hello.fingerprint, err, sizeof err);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    int got = recv_reply(s, &r, &fr, 10000) && r.type == PROTO_MSG_HELLO_OK;
    enum { T = 64 };
    float *h = malloc(sizeof(float) * T * (size_t)g_D);
    for (int i = 0; i < T * g_D; i++) h[i] = 0.01f * (float)(i % 7);
    proto_msg_init(&m, PROTO_MSG_FORWARD, 2, 9);
    m.u.forward = (proto_forward){.session = 5, .step = 1, .n_tokens = T, .hidden = (uint32_t)g_D};
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    const void *frs[2] = {h, h};
    size_t frb[2] = {0, sizeof(float) * T * (size_t)g_D};
    raw_send(s, env, env_len, frs, frb, 2);
    proto_msg_init(&m, PROTO_MSG_HELLO, 3, 10); /* epoch 10 while the step of epoch 9 runs */
    k3_link_numerics(g_mo.bits, g_mo.mla_bits, g_mo.head_bits, g_mo.idot, g_mo.dense_idot, 0,
                     &m.u.hello.num);
    snprintf(m.u.hello.build, sizeof m.u.hello.build, "%s", k3_link_build());
    k3_model_fingerprint_dir(g_dir, g_cfg, g_mo.topp, &m.u.hello.fingerprint, err, sizeof err);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    proto_msg_init(&m, PROTO_MSG_STATS, 4, 10);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    /* the FORWARD of epoch 9 gets no reply: the next two are HELLO_OK, STATS_OK */
    int hello = got && recv_reply(s, &r, &fr, 10000) && r.type == PROTO_MSG_HELLO_OK;
    int stats = hello && recv_reply(s, &r, &fr, 10000) && r.type == PROTO_MSG_STATS_OK;
    CHECK(stats && r.epoch == 10 && r.u.stats_ok.sessions == 0,
          "new epoch mid-step: HELLO_OK, then STATS_OK counting %d sessions held (0: the old "
          "epoch's are gone)",
          stats ? (int)r.u.stats_ok.sessions : -1);
    free(h);
    got = stats;
    proto_msg_init(&m, PROTO_MSG_SHUTDOWN, 5, 10);
    proto_encode(&m, env, sizeof env, &env_len, err, sizeof err);
    raw_send(s, env, env_len, NULL, NULL, 0);
    got = got && recv_reply(s, &r, &fr, 2000) && r.type == PROTO_MSG_OK;
    int status = -1, n_sig = 0;
    double t0 = ms_now();
    while (got && ms_now() - t0 < 3000 && !k3_worker_exited(pid, &status)) {
        kill(pid, SIGTERM);
        n_sig++;
        sleep_ms(1);
    }
    CHECK(got && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "stop under signals: SHUTDOWN answered, then %d SIGTERMs: worker exited with status %d "
          "after %.0f ms",
          n_sig, WIFEXITED(status) ? WEXITSTATUS(status) : -1, ms_now() - t0);
    if (!WIFEXITED(status)) k3_worker_stop(pid, 1000);
    proto_frames_close(&fr);
    zmq_close(s);
}

/* ---- 2b. a fake worker sending bad replies to a coordinator --------- */

enum { FAKE_GARBAGE, FAKE_WRONG_SESS, FAKE_WRONG_K, FAKE_TRUNC, FAKE_GOOD, FAKE_BADFP, FAKE_DUP };

typedef struct fake {
    char ep[128];
    atomic_int mode; /* what the next FORWARD gets: set by the test thread between steps */
    atomic_int stop;
    atomic_int hellos; /* HELLOs answered */
    int quiet;         /* no heartbeats (after a garbage reply, until a new HELLO) */
} fake;

static void *fake_main(void *p) {
    fake *f = p;
    void *s = zmq_socket(g_zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_bind(s, f->ep);
    uint64_t fp;
    k3_model_fingerprint_dir(g_dir, g_cfg, g_mo.topp, &fp, err, sizeof err);
    proto_frames fr;
    memset(&fr, 0, sizeof fr);
    proto_peer peer = {{0}, 0};
    uint64_t epoch = 0;
    k3_state *st = NULL;
    k3_state_open(&st, g_full, 64, err, sizeof err);
    float *blocks = calloc((size_t)K3_MAX_RES_ENTRIES * 64 * g_D, sizeof(float));
    float *h = calloc((size_t)64 * g_D, sizeof(float));
    double last_hb = 0;
    while (!atomic_load(&f->stop)) {
        zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
        zmq_poll(&it, 1, 50);
        if (epoch && !f->quiet && ms_now() - last_hb > 100) {
            proto_msg hb;
            proto_msg_init(&hb, PROTO_MSG_HEARTBEAT, 0, epoch);
            proto_send(s, &peer, &hb, NULL, NULL, 0, ZMQ_DONTWAIT, err, sizeof err);
            last_hb = ms_now();
        }
        proto_msg m;
        char e[256];
        if (proto_recv(s, ZMQ_DONTWAIT, &m, &fr, e, sizeof e)) continue;
        proto_msg out;
        int mode = atomic_load(&f->mode); /* one value per message */
        if (m.type == PROTO_MSG_HELLO) {
            peer = fr.from;
            epoch = m.epoch;
            f->quiet = 0;
            atomic_fetch_add(&f->hellos, 1);
            proto_msg_init(&out, PROTO_MSG_HELLO_OK, m.id, m.epoch);
            out.u.hello_ok = (proto_hello_ok){.fingerprint = mode == FAKE_BADFP ? fp + 1 : fp,
                                              .layers = {0, (uint32_t)g_L},
                                              .num = m.u.hello.num,
                                              .max_sessions = 4,
                                              .max_ctx = 64};
            snprintf(out.u.hello_ok.name, sizeof out.u.hello_ok.name, "fake");
            snprintf(out.u.hello_ok.build, sizeof out.u.hello_ok.build, "%s", k3_link_build());
            proto_send(s, &fr.from, &out, NULL, NULL, 0, 0, err, sizeof err);
        } else if (m.type == PROTO_MSG_FORWARD) {
            const proto_forward *fw = &m.u.forward;
            size_t TD = (size_t)fw->n_tokens * g_D, nbytes;
            memcpy(h, proto_frames_data(&fr, 1, &nbytes), sizeof(float) * TD);
            int nb = 0;
            if (fw->pos0 == 0) k3_state_reset(st);
            k3_stage_forward(g_full, st, (int)fw->pos0, (int)fw->n_tokens, blocks, &nb, h, NULL,
                             NULL, NULL, err, sizeof err);
            proto_msg_init(&out, PROTO_MSG_FORWARD_DONE, m.id, m.epoch);
            proto_forward_done *d = &out.u.forward_done;
            d->session = fw->session + (mode == FAKE_WRONG_SESS);
            d->step = fw->step;
            d->n_tokens = fw->n_tokens;
            d->hidden = fw->hidden;
            d->n_snapshots = (uint32_t)nb - (mode == FAKE_WRONG_K);
            const void *frs[2] = {blocks, h};
            size_t frb[2] = {sizeof(float) * d->n_snapshots * TD, sizeof(float) * TD};
            if (mode == FAKE_GARBAGE || mode == FAKE_TRUNC) {
                uint8_t env[PROTO_ENCODE_CAP];
                size_t len;
                proto_encode(&out, env, sizeof env, &len, err, sizeof err);
                zmq_send(s, fr.from.id, fr.from.len, ZMQ_SNDMORE);
                if (mode == FAKE_GARBAGE)
                    zmq_send(s, "\xc1\x00junk", 6, 0);
                else
                    zmq_send(s, env, len - 1, 0); /* truncated envelope, no frames */
                f->quiet = 1;
            } else {
                proto_send(s, &fr.from, &out, frs, frb, 2, 0, err, sizeof err);
                if (mode == FAKE_DUP) /* a duplicate, as from a retrying network */
                    proto_send(s, &fr.from, &out, frs, frb, 2, 0, err, sizeof err);
            }
        } else if (m.type != PROTO_MSG_HEARTBEAT) {
            proto_msg_init(&out, PROTO_MSG_OK, m.id, m.epoch);
            proto_send(s, &fr.from, &out, NULL, NULL, 0, 0, err, sizeof err);
        }
    }
    proto_frames_close(&fr);
    k3_state_close(&st);
    free(blocks);
    free(h);
    zmq_close(s);
    return NULL;
}

static void test_bad_replies(void) {
    /* a fingerprint mismatch in HELLO_OK refuses the worker */
    fake f1 = {.mode = FAKE_BADFP};
    snprintf(f1.ep, sizeof f1.ep, "ipc://%s/fake1", g_tmp);
    pthread_t th;
    pthread_create(&th, NULL, fake_main, &f1);
    k3_cluster_opts o;
    cluster_opts(&o);
    const char *eps[1] = {f1.ep};
    o.workers = eps;
    o.n_workers = 1;
    o.hb_ms = 250;
    o.step_timeout_ms = 1500;
    k3_cluster *cl = NULL;
    k3_status st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
    CHECK(st && strstr(err, "fingerprint") && strstr(err, "fake"),
          "coordinator refuses a worker whose HELLO_OK has another fingerprint: '%s'", err);
    k3_cluster_close(&cl);
    atomic_store(&f1.stop, 1);
    pthread_join(th, NULL);

    fake f = {.mode = FAKE_GOOD};
    snprintf(f.ep, sizeof f.ep, "ipc://%s/fake2", g_tmp);
    eps[0] = f.ep;
    pthread_create(&th, NULL, fake_main, &f);
    st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
    CHECK(!st, "coordinator registers the fake worker%s%s", st ? ": " : "", st ? err : "");
    if (!st) {
        k3_trunk *t = NULL;
        k3_cluster_trunk(cl, &t, err, sizeof err);
        static const struct {
            int mode;
            const char *what, *expect;
            int max_ms;
        } cases[] = {
            {FAKE_WRONG_SESS, "FORWARD_DONE echoing another session", "bad reply", 1000},
            {FAKE_WRONG_K, "FORWARD_DONE with a wrong snapshot count", "snapshots", 1000},
            {FAKE_GARBAGE, "an undecodable reply", "stalled", 1500 + 250 + 1000},
            {FAKE_TRUNC, "a truncated envelope", "stalled", 1500 + 250 + 1000},
            {FAKE_GOOD, "a correct reply", NULL, 5000},
            {FAKE_DUP, "every reply twice", NULL, 5000},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            atomic_store(&f.mode, cases[i].mode);
            k3_cluster_wait_ready(cl, 5000, err, sizeof err);
            k3_session *s = NULL;
            k3_session_opts so = {.max_ctx = 8, .chunk = 4};
            k3_session_open(&s, g_full, t, &so, err, sizeof err);
            const float *lg = NULL;
            double t0 = ms_now();
            st = k3_session_feed(s, g_sc[0].prompt, 3, NULL, &lg, NULL, err, sizeof err);
            double dt = ms_now() - t0;
            if (cases[i].expect) {
                CHECK(st && strstr(err, cases[i].expect) && dt < cases[i].max_ms,
                      "coordinator rejects %s in %.0f ms: '%s'", cases[i].what, dt, err);
            } else {
                /* the same step in process */
                k3_trunk *in = NULL;
                k3_trunk_open_inproc(&in, g_full, err, sizeof err);
                k3_session *r = NULL;
                k3_session_open(&r, g_full, in, &so, err, sizeof err);
                const float *lr = NULL;
                k3_session_feed(r, g_sc[0].prompt, 3, NULL, &lr, NULL, err, sizeof err);
                k3_stage_info inf;
                k3_cluster_stage_info(cl, 0, &inf);
                for (int w = 0; cases[i].mode == FAKE_DUP && !inf.stale_dropped && w < 100; w++) {
                    sleep_ms(10); /* the duplicate arrives just after the step ended */
                    k3_cluster_stage_info(cl, 0, &inf);
                }
                CHECK(!st && lg && lr && !memcmp(lg, lr, sizeof(float) * g_V) &&
                          (cases[i].mode != FAKE_DUP || inf.stale_dropped >= 1),
                      "%s: logits exact (%llu duplicate/late replies dropped)",
                      cases[i].mode == FAKE_DUP ? "T9 duplicated replies are dropped"
                                                : "after the bad replies the coordinator serves",
                      (unsigned long long)inf.stale_dropped);
                k3_session_close(&r);
                k3_trunk_close(&in);
            }
            k3_session_close(&s);
        }
        k3_trunk_close(&t);
    }
    k3_cluster_close(&cl);
    atomic_store(&f.stop, 1);
    pthread_join(th, NULL);
}

/* ---- 3. liveness and recovery ----------------------------------------- */

#define HB  250
#define TTL (3 * HB)

typedef struct live {
    char ep[2][128];
    pid_t pid[2];
    int a[2], b[2];
    k3_cluster *cl;
    k3_trunk *trunk;
    /* fault injection from the token callback */
    int at_token, sig, victim;
    atomic_int n_tok;
    double t_fault;
    atomic_int faulted;      /* the token callback has sent the signal */
    atomic_int helpers_exit; /* helper threads may end (PR_SET_PDEATHSIG: a worker
                                dies with the thread that started it) */
    int32_t toks[64];
} live;

static live g_lv;
static int32_t g_ref_toks[64];
#define NGEN 24

static void live_start(live *lv, int i, char *const *env) {
    char name[16];
    snprintf(name, sizeof name, "w%d", i);
    lv->pid[i] = worker_start(lv->a[i], lv->b[i], lv->ep[i], name, HB, NULL, env);
}

static void on_tok(void *ctx, int32_t id) {
    live *lv = ctx;
    int n = atomic_fetch_add(&lv->n_tok, 1);
    if (n < 64) lv->toks[n] = id;
    if (n + 1 == lv->at_token && lv->sig) {
        lv->t_fault = ms_now();
        kill(lv->pid[lv->victim], lv->sig);
        atomic_store(&lv->faulted, 1);
    }
}

static k3_status gen(live *lv, const int32_t *prompt, int n, int ngen, int resume, char *e,
                     size_t el) {
    k3_session *s = NULL;
    k3_session_opts so = {.max_ctx = 64, .chunk = 8};
    k3_status st = k3_session_open(&s, g_full, lv->trunk, &so, e, el);
    k3_gen_opts go = {.ngen = ngen, .eos = NULL, .n_eos = 0, .on_token = on_tok, .token_ctx = lv};
    k3_sampler_opts smo = {.temp = 0, .top_p = 1, .seed = 1};
    k3_sampler_open(&go.sampler, &smo, g_V, e, el);
    k3_gen_result res;
    if (!st && resume)
        st = k3_cluster_generate(lv->cl, s, prompt, n, &go, 3, 10000, &res, e, el);
    else if (!st)
        st = k3_generate(s, prompt, n, &go, &res, e, el);
    k3_sampler_close(&go.sampler);
    k3_session_close(&s);
    return st;
}

typedef struct later {
    int delay_ms;
    live *lv;
    int what;        /* 0: restart worker victim, 1: SIGCONT it */
    atomic_int done; /* set once it did it: lv->pid and lv->victim are the test's again */
} later;

/* Waits for the fault (set by the token callback), then delay_ms more. */
static void *do_later(void *p) {
    later *l = p;
    for (int w = 0; w < 6000 && !atomic_load(&l->lv->faulted); w++) sleep_ms(5);
    sleep_ms(l->delay_ms);
    if (l->what == 0) {
        k3_worker_exited(l->lv->pid[l->lv->victim], NULL);
        live_start(l->lv, l->lv->victim, NULL);
    } else {
        kill(l->lv->pid[l->lv->victim], SIGCONT);
    }
    atomic_store(&l->done, 1);
    while (!atomic_load(&l->lv->helpers_exit)) sleep_ms(10); /* outlive the worker */
    return NULL;
}

static void test_liveness(void) {
    live *lv = &g_lv;
    lv->a[0] = 0, lv->b[0] = g_L / 2, lv->a[1] = g_L / 2, lv->b[1] = g_L;
    for (int i = 0; i < 2; i++) {
        snprintf(lv->ep[i], sizeof lv->ep[i], "ipc://%s/live%d", g_tmp, i);
        live_start(lv, i, NULL);
    }
    /* reference tokens: greedy, in process */
    {
        k3_trunk *in = NULL;
        k3_trunk_open_inproc(&in, g_full, err, sizeof err);
        live ref = {0};
        ref.trunk = in;
        k3_status st = gen(&ref, g_sc[1].prompt, g_sc[1].n, NGEN, 0, err, sizeof err);
        memcpy(g_ref_toks, ref.toks, sizeof g_ref_toks);
        CHECK(!st && atomic_load(&ref.n_tok) == NGEN, "liveness: reference %d tokens", NGEN);
        k3_trunk_close(&in);
    }
    k3_cluster_opts o;
    cluster_opts(&o);
    const char *eps[2] = {lv->ep[0], lv->ep[1]};
    o.workers = eps;
    o.n_workers = 2;
    o.hb_ms = HB;
    o.step_timeout_ms = 1500;
    k3_status st = k3_cluster_open(&lv->cl, g_cfg, &o, err, sizeof err);
    CHECK(!st, "liveness: cluster of 2 with HB %d ms%s%s", HB, st ? ": " : "", st ? err : "");
    if (st) return;
    k3_cluster_trunk(lv->cl, &lv->trunk, err, sizeof err);

    /* T1: kill -9 mid-decode */
    lv->at_token = 6, lv->sig = SIGKILL, lv->victim = 1;
    atomic_store(&lv->n_tok, 0);
    st = gen(lv, g_sc[1].prompt, g_sc[1].n, NGEN, 0, err, sizeof err);
    double dt = ms_now() - lv->t_fault;
    char want[64];
    snprintf(want, sizeof want, "layers [%d, %d)", lv->a[1], lv->b[1]);
    CHECK(st && dt <= 2 * TTL && strstr(err, "w1") && strstr(err, want),
          "T1 kill -9: error after %.0f ms (<= 2 x TTL = %d): '%s'", dt, 2 * TTL, err);
    int produced = atomic_load(&lv->n_tok);
    int32_t hist[64 + 64];
    memcpy(hist, g_sc[1].prompt, sizeof(int32_t) * g_sc[1].n);
    memcpy(hist + g_sc[1].n, lv->toks, sizeof(int32_t) * produced);
    CHECK(produced == 6 && !memcmp(lv->toks, g_ref_toks, sizeof(int32_t) * 6),
          "T1: the %d tokens before the kill match the reference", produced);
    k3_worker_exited(lv->pid[1], NULL);
    double t0 = ms_now();
    live_start(lv, 1, NULL);
    st = k3_cluster_wait_ready(lv->cl, 10000, err, sizeof err);
    CHECK(!st, "T1: restarted worker re-registered in %.0f ms%s%s", ms_now() - t0, st ? ": " : "",
          st ? err : "");
    lv->sig = 0;
    atomic_store(&lv->n_tok, 0);
    st = gen(lv, hist, g_sc[1].n + produced, NGEN - produced, 0, err, sizeof err);
    CHECK(!st && atomic_load(&lv->n_tok) == NGEN - produced &&
              !memcmp(lv->toks, g_ref_toks + produced, sizeof(int32_t) * (NGEN - produced)),
          "T1: the next request (replaying %d committed tokens) continues token-identically%s%s",
          g_sc[1].n + produced, st ? ": " : "", st ? err : "");

    /* T1 with automatic resume: kill at token 10, restart 300 ms later */
    lv->at_token = 10, lv->sig = SIGKILL, lv->victim = 1;
    atomic_store(&lv->n_tok, 0);
    uint64_t losses0 = k3_cluster_losses(lv->cl);
    later l = {300, lv, 0, 0};
    atomic_store(&lv->faulted, 0);
    pthread_t th;
    pthread_create(&th, NULL, do_later, &l);
    st = gen(lv, g_sc[1].prompt, g_sc[1].n, NGEN, 1, err, sizeof err);
    CHECK(!st && atomic_load(&lv->n_tok) == NGEN &&
              !memcmp(lv->toks, g_ref_toks, sizeof(int32_t) * NGEN) &&
              k3_cluster_losses(lv->cl) > losses0,
          "T1 resume: killed at token 10, restarted; the resumed generation equals the "
          "uninterrupted one (%d tokens)%s%s",
          atomic_load(&lv->n_tok), st ? ": " : "", st ? err : "");
    /* the helper wrote lv->pid[1] and read lv->victim: wait until it is
     * done with them (the worker's registration says nothing of that) */
    while (!atomic_load(&l.done)) sleep_ms(5);

    /* T2: SIGSTOP mid-decode, SIGCONT after 3 x TTL */
    k3_cluster_wait_ready(lv->cl, 10000, err, sizeof err);
    k3_stage_info before;
    k3_cluster_stage_info(lv->cl, 0, &before);
    lv->at_token = 5, lv->sig = SIGSTOP, lv->victim = 0;
    atomic_store(&lv->n_tok, 0);
    st = gen(lv, g_sc[1].prompt, g_sc[1].n, NGEN, 0, err, sizeof err);
    dt = ms_now() - lv->t_fault;
    snprintf(want, sizeof want, "layers [%d, %d)", lv->a[0], lv->b[0]);
    CHECK(st && dt <= 2 * TTL && strstr(err, "w0") && strstr(err, want),
          "T2 SIGSTOP: detected after %.0f ms (<= %d): '%s'", dt, 2 * TTL, err);
    produced = atomic_load(&lv->n_tok);
    memcpy(hist + g_sc[1].n, lv->toks, sizeof(int32_t) * produced);
    sleep_ms(3 * TTL - (int)dt > 0 ? 3 * TTL - (int)dt : 0);
    kill(lv->pid[0], SIGCONT);
    t0 = ms_now();
    st = k3_cluster_wait_ready(lv->cl, 10000, err, sizeof err);
    k3_stage_info after;
    k3_cluster_stage_info(lv->cl, 0, &after);
    proto_stats_ok ws;
    memset(&ws, 0, sizeof ws);
    k3_status st2 = st ? st : k3_cluster_worker_stats(lv->cl, 0, &ws, err, sizeof err);
    CHECK(!st && !st2 && after.epoch != before.epoch && ws.sessions == 0,
          "T2 SIGCONT: re-registered in %.0f ms with a new epoch, its old session states "
          "dropped (%u held)",
          ms_now() - t0, ws.sessions);
    lv->sig = 0;
    atomic_store(&lv->n_tok, 0);
    st = gen(lv, hist, g_sc[1].n + produced, NGEN - produced, 0, err, sizeof err);
    CHECK(!st && !memcmp(lv->toks, g_ref_toks + produced, sizeof(int32_t) * (NGEN - produced)),
          "T2: replay after SIGCONT continues token-identically, nothing stale delivered%s%s",
          st ? ": " : "", st ? err : "");

    /* T3: a stuck compute thread (fault hook), process and ZMTP alive */
    k3_worker_stop(lv->pid[1], 2000);
    char *env[] = {"K3_WORKER_FAULT=stall=4", NULL};
    live_start(lv, 1, env);
    st = k3_cluster_wait_ready(lv->cl, 10000, err, sizeof err);
    lv->sig = 0;
    atomic_store(&lv->n_tok, 0);
    t0 = ms_now();
    st = gen(lv, g_sc[1].prompt, 4, NGEN, 0, err, sizeof err);
    dt = ms_now() - t0;
    CHECK(st && strstr(err, "stalled") && strstr(err, "w1") && dt < 1500 + HB + 1000,
          "T3 stuck compute: step failed after %.0f ms (deadline 1500 + HB): '%s'", dt, err);
    t0 = ms_now();
    int status = k3_worker_stop(lv->pid[1], 2000);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && ms_now() - t0 < 2000,
          "T8: SIGTERM stops the stalled worker in %.0f ms, status 0", ms_now() - t0);
    live_start(lv, 1, NULL);
    st = k3_cluster_wait_ready(lv->cl, 10000, err, sizeof err);
    CHECK(!st, "T3: a fresh worker re-registers%s%s", st ? ": " : "", st ? err : "");

    k3_trunk_close(&lv->trunk);
    k3_cluster_close(&lv->cl);
    for (int i = 0; i < 2; i++) {
        t0 = ms_now();
        status = k3_worker_stop(lv->pid[i], 2000);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && ms_now() - t0 < 2000,
              "T8: SIGTERM stops worker %d (coordinator gone) in %.0f ms, status 0", i,
              ms_now() - t0);
    }
    atomic_store(&lv->helpers_exit, 1);
    pthread_join(th, NULL);
}

/* Eviction: workers hold 2 sessions; a third evicts the least recent, which
 * is reported, and resuming the evicted session replays it exactly. */
static void test_eviction(void) {
    k3_cluster_opts o;
    cluster_opts(&o);
    o.local = 2;
    o.max_sessions = 2;
    live lv = {0};
    k3_status st = k3_cluster_open(&lv.cl, g_cfg, &o, err, sizeof err);
    CHECK(!st, "eviction: 2 local workers holding 2 sessions%s%s", st ? ": " : "", st ? err : "");
    if (st) return;
    k3_cluster_trunk(lv.cl, &lv.trunk, err, sizeof err);
    k3_trunk *in = NULL;
    k3_trunk_open_inproc(&in, g_full, err, sizeof err);
    /* sessions A, B, C, then A again extending its history */
    k3_session *s[2][3] = {{0}};
    k3_session_opts so = {.max_ctx = 64, .chunk = 8};
    const float *lg[2] = {0};
    int ok = 1;
    for (int w = 0; w < 2; w++)
        for (int k = 0; k < 3; k++)
            k3_session_open(&s[w][k], g_full, w ? lv.trunk : in, &so, err, sizeof err);
    for (int k = 0; k < 3; k++)
        for (int w = 0; w < 2; w++)
            ok &=
                !k3_session_feed(s[w][k], g_sc[k].prompt, 10, NULL, &lg[w], NULL, err, sizeof err);
    int32_t ext[20];
    memcpy(ext, g_sc[0].prompt, sizeof ext);
    ext[10] = 5, ext[11] = 6;
    st = k3_session_feed(s[1][0], ext, 12, NULL, &lg[1], NULL, err, sizeof err);
    CHECK(ok && st == K3_ERR_STATE && strstr(err, "lost"),
          "eviction: the evicted session's next step reports its lost state: '%s'", err);
    st = k3_session_feed(s[0][0], ext, 12, NULL, &lg[0], NULL, err, sizeof err);
    k3_status st1 = k3_session_feed(s[1][0], ext, 12, NULL, &lg[1], NULL, err, sizeof err);
    CHECK(!st && !st1 && !memcmp(lg[0], lg[1], sizeof(float) * g_V),
          "eviction: replaying its 12 ids gives the in-process logits%s%s", st1 ? ": " : "",
          st1 ? err : "");
    proto_stats_ok ws;
    st = k3_cluster_worker_stats(lv.cl, 1, &ws, err, sizeof err);
    CHECK(!st && ws.evictions >= 2 && ws.sessions <= 2,
          "eviction: worker reports %llu evictions, %u sessions held",
          (unsigned long long)ws.evictions, ws.sessions);
    for (int w = 0; w < 2; w++)
        for (int k = 0; k < 3; k++) k3_session_close(&s[w][k]);
    k3_trunk_close(&in);
    k3_trunk_close(&lv.trunk);
    k3_stage_info inf;
    k3_cluster_stage_info(lv.cl, 0, &inf);
    pid_t p0 = inf.pid;
    double t0 = ms_now();
    k3_cluster_close(&lv.cl);
    CHECK(p0 > 0 && kill(p0, 0) != 0 && ms_now() - t0 < 3000,
          "closing the cluster stops its local workers (%.0f ms)", ms_now() - t0);
}

/* --local workers with a request far over the argv the launcher once had
 * room for (96 entries): 300 extra worker arguments, the last two naming
 * the worker, so the name it registers with shows the tail arrived. */
static void test_local_wide(void) {
    k3_cluster_opts o;
    cluster_opts(&o);
    enum { N_EXTRA = 302 };
    const char *args[N_EXTRA];
    for (int i = 0; i < N_EXTRA - 2; i++) args[i] = "--no-bench";
    args[N_EXTRA - 2] = "--name";
    args[N_EXTRA - 1] = "wide";
    o.worker_args = args;
    o.n_worker_args = N_EXTRA;
    o.local = 2;
    k3_cluster *cl = NULL;
    k3_status st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
    int named = 0;
    for (int i = 0; !st && i < k3_cluster_stages(cl); i++) {
        k3_stage_info inf;
        k3_cluster_stage_info(cl, i, &inf);
        named += !strcmp(inf.name, "wide");
    }
    CHECK(!st && named == 2, "--local 2 with %d extra worker arguments: both up as 'wide'%s%s",
          N_EXTRA, st ? ": " : "", st ? err : "");
    k3_cluster_close(&cl);
}

/* A worker that never answers: open fails in time, nothing hangs. */
static void test_unreachable(void) {
    k3_cluster_opts o;
    cluster_opts(&o);
    char ep[128];
    snprintf(ep, sizeof ep, "ipc://%s/nobody", g_tmp);
    const char *eps[1] = {ep};
    o.workers = eps;
    o.n_workers = 1;
    o.ready_timeout_ms = 700;
    k3_cluster *cl = NULL;
    double t0 = ms_now();
    k3_status st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
    double dt = ms_now() - t0;
    CHECK(st == K3_ERR_TIMEOUT && strstr(err, "nobody") && dt < 2500,
          "an unreachable worker fails open after %.0f ms: '%s'", dt, err);
    k3_cluster_close(&cl);
    /* transport policy: plain tcp off loopback is refused before connecting */
    const char *net[1] = {"tcp://10.255.255.1:5555"};
    o.workers = net;
    st = k3_cluster_open(&cl, g_cfg, &o, err, sizeof err);
    CHECK(st == K3_ERR_AUTH && strstr(err, "CURVE"), "plain tcp off loopback refused: '%s'", err);
    k3_cluster_close(&cl);
}

int main(int argc, char **argv) {
    (void)argc, (void)argv;
    k3_log_init("test_cluster");
    signal(SIGPIPE, SIG_IGN);
    g_dir = t_tiny_dir();
    k3_worker_bin(g_bin, sizeof g_bin);
    if (access(g_bin, X_OK) != 0) {
        printf("not ok - k3-worker not found at %s\n", g_bin);
        return 1;
    }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/k3tc.XXXXXX");
    if (!mkdtemp(g_tmp)) {
        printf("not ok - mkdtemp\n");
        return 1;
    }
    k3_model_opts_default(&g_mo);
    g_mo.model_dir = g_dir;
    g_mo.threads = 1;
    g_mo.want_global = 1;
    if (getenv("K3_TEST_STRIPE_REMOTE")) g_mo.placement = getenv("K3_PLACEMENT");
    if (k3_model_open(&g_full, &g_mo, err, sizeof err)) {
        printf("not ok - open %s: %s\n", g_dir, err);
        return 1;
    }
    g_cfg = k3_model_config(g_full);
    g_V = g_cfg->vocab, g_D = g_cfg->hidden, g_L = g_cfg->n_layers;
    g_zctx = zmq_ctx_new();
    make_scripts();

    const char *only = getenv("K3_TEST_CLUSTER_ONLY"); /* while iterating */
    if (!only || strstr(only, "identity")) test_identity();
    if (!only || strstr(only, "malformed")) test_malformed_worker();
    if (!only || strstr(only, "epoch")) test_epoch_and_stop();
    if (!only || strstr(only, "replies")) test_bad_replies();
    if (!only || strstr(only, "liveness")) test_liveness();
    if (!only || strstr(only, "eviction")) test_eviction();
    if (!only || strstr(only, "unreachable")) test_unreachable();
    if (!only || strstr(only, "wide")) test_local_wide();

    zmq_ctx_term(g_zctx);
    k3_model_close(&g_full);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    if (system(cmd) != 0) printf("# could not remove %s\n", g_tmp);
    TEST_MAIN_END();
}
