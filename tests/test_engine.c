/* tests/test_engine.c: the coordinator's engine (coordinator/engine.h) on
 * the tiny checkpoint. The same greedy requests run on an in-process engine
 * (--local 0) and on one with 2 local k3-worker processes and must give the
 * same ids bit for bit; requests on different session ids each keep their
 * own session (a prompt extending one session's ids prefills only the tail
 * after another session ran), the least recently used session is evicted
 * when the table is full, a request on a running session is refused
 * (K3_ERR_BUSY), prefill progress reaches the prompt's length, text encodes
 * with BOS, and a prompt longer than the requested context is refused
 * before anything runs. */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "common/base/log.h"
#include "coordinator/cluster.h"
#include "coordinator/engine.h"
#include "tests/engine_fixture.h"
#include "tests/test.h"

#define NGEN    6
#define MAX_CTX 64

typedef struct toks {
    int32_t v[MAX_CTX];
    int n;
} toks;

static void on_tok(void *ctx, int32_t id) {
    toks *t = ctx;
    if (t->n < MAX_CTX) t->v[t->n++] = id;
}

typedef struct progress {
    int calls, last_done, last_n;
} progress;

static void on_progress(void *ctx, int done, int n) {
    progress *p = ctx;
    p->calls++;
    p->last_done = done;
    p->last_n = n;
}

/* A callback that asks for another request on the session it runs on. */
typedef struct reenter {
    k3_engine *e;
    uint64_t session_id;
    int calls;
    k3_status st;
    char err[512];
} reenter;

static void on_tok_reenter(void *ctx, int32_t id) {
    reenter *r = ctx;
    (void)id;
    r->calls++;
    k3_engine_req req = {.session_id = r->session_id,
                         .prompt = &id,
                         .n_prompt = 1,
                         .ngen = 1,
                         .sampling = {.top_p = 1}};
    k3_engine_result res;
    r->st = k3_engine_generate(r->e, &req, &res, r->err, sizeof r->err);
}

/* Default numerics (4/8/8, idot), one thread, no usage history. */
static void engine_opts(k3_engine_opts *eng) { t_engine_opts_tiny(eng); }

static k3_engine *open_engine(const k3_engine_opts *eng, int local, int n_sessions) {
    char err[512] = "";
    k3_engine_open_opts o;
    k3_engine_open_opts_default(&o);
    o.eng = eng;
    o.usage_flag = 1; /* K3_USAGE=off for the local workers too */
    o.cluster.local = local;
    o.chunk = 5;
    o.progress = 0;
    o.n_sessions = n_sessions;
    k3_engine *e = NULL;
    k3_status st = k3_engine_open(&e, &o, err, sizeof err);
    CHECK(st == K3_OK && e, "engine opens with --local %d (%s)", local, err);
    return e;
}

/* One greedy request of NGEN tokens with a fixed context on session sid. */
static k3_status gen(k3_engine *e, uint64_t sid, const int32_t *p, int n, toks *out,
                     k3_engine_result *res, progress *pr) {
    char err[512] = "";
    memset(out, 0, sizeof *out);
    k3_engine_req req = {.session_id = sid,
                         .prompt = p,
                         .n_prompt = n,
                         .ngen = NGEN,
                         .max_ctx = MAX_CTX,
                         .sampling = {.temp = 0, .top_p = 1, .seed = 0},
                         .on_token = on_tok,
                         .token_ctx = out};
    if (pr) {
        req.prompt_hooks.progress = on_progress;
        req.prompt_hooks.progress_ctx = pr;
    }
    k3_status st = k3_engine_generate(e, &req, res, err, sizeof err);
    if (st) printf("# session %llu: %s\n", (unsigned long long)sid, err);
    return st;
}

static int same_toks(const toks *a, const toks *b) {
    return a->n == b->n && !memcmp(a->v, b->v, (size_t)a->n * sizeof a->v[0]);
}

static const int32_t prompt_a[9] = {17, 400, 33, 900, 5, 61, 700, 12, 250};
static const int32_t prompt_b[5] = {3, 1100, 42, 77, 800};

/* In-process: both prompts on sessions 1 and 2, a third session evicts the
 * least recently used (1), session 2 keeps its prefix. Fills a, b. */
static void test_inproc(const k3_engine_opts *eng, toks *a, toks *b) {
    k3_engine *e = open_engine(eng, 0, 2);
    if (!e) return;
    char err[512] = "";
    k3_engine_result r;
    progress pr = {0};
    k3_status st = gen(e, 1, prompt_a, 9, a, &r, &pr);
    CHECK(st == K3_OK && a->n == NGEN && r.gen.n_gen == NGEN && r.gen.stop == K3_STOP_NGEN &&
              r.gen.n_prefilled == 9 && r.max_ctx == MAX_CTX && r.state_bytes > 0,
          "in-process session 1: %d tokens, stop %d, %d prefilled", a->n, (int)r.gen.stop,
          r.gen.n_prefilled);
    CHECK(pr.calls == 2 && pr.last_done == 9 && pr.last_n == 9,
          "prefill progress: %d calls (chunk 5), last %d of %d", pr.calls, pr.last_done, pr.last_n);
    st = gen(e, 2, prompt_b, 5, b, &r, NULL);
    CHECK(st == K3_OK && b->n == NGEN && r.gen.n_prefilled == 5,
          "in-process session 2 on the same engine: %d tokens", b->n);

    /* session 2 again, its prompt extended by what it generated: only the
     * last generated id (never fed back) is prefilled */
    int32_t ext[5 + NGEN];
    memcpy(ext, prompt_b, sizeof prompt_b);
    memcpy(ext + 5, b->v, sizeof(int32_t) * NGEN);
    toks t;
    st = gen(e, 2, ext, 5 + NGEN, &t, &r, NULL);
    CHECK(st == K3_OK && r.gen.n_prefilled == 1,
          "session 2 extended after session 1 ran: %d token(s) prefilled, want 1",
          r.gen.n_prefilled);
    /* a third session takes the slot of session 1 (least recently used) */
    st = gen(e, 3, prompt_b, 5, &t, &r, NULL);
    CHECK(st == K3_OK && same_toks(&t, b), "session 3 with session 2's prompt: the same ids");
    int32_t ext_a[9 + NGEN];
    memcpy(ext_a, prompt_a, sizeof prompt_a);
    memcpy(ext_a + 9, a->v, sizeof(int32_t) * NGEN);
    st = gen(e, 1, ext_a, 9 + NGEN, &t, &r, NULL);
    CHECK(st == K3_OK && r.gen.n_prefilled == 9 + NGEN,
          "session 1 was evicted (2 slots): its extension prefills all %d tokens (%d)", 9 + NGEN,
          r.gen.n_prefilled);

    /* the context is checked before any state is allocated */
    k3_engine_req req = {.session_id = 4, .prompt = prompt_a, .n_prompt = 9, .max_ctx = 5};
    st = k3_engine_generate(e, &req, &r, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "longer than the context"),
          "a 9-token prompt in a context of 5 is refused: '%s'", err);

    /* a request on a session that is running is refused, not queued */
    reenter ren = {.e = e, .session_id = 5};
    req = (k3_engine_req){.session_id = 5,
                          .prompt = prompt_a,
                          .n_prompt = 9,
                          .ngen = 2,
                          .sampling = {.top_p = 1},
                          .on_token = on_tok_reenter,
                          .token_ctx = &ren};
    st = k3_engine_generate(e, &req, &r, err, sizeof err);
    CHECK(st == K3_OK && ren.calls == 2 && ren.st == K3_ERR_BUSY && strstr(ren.err, "running"),
          "a request on session 5 from inside session 5's callback: busy ('%s')", ren.err);

    /* text: BOS, then the tokenizer's ids */
    err[0] = 0;
    int32_t *ids = NULL;
    int n = 0;
    const k3_config *cfg = k3_engine_config(e);
    st = k3_engine_encode(e, "The quick brown fox", 19, 0, &ids, &n, err, sizeof err);
    CHECK(st == K3_OK && k3_engine_tok(e) && n > 1 && (cfg->bos < 0 || ids[0] == cfg->bos),
          "encode: %d ids, BOS %d first (%s)", n, cfg->bos, err);
    free(ids);
    k3_engine_close(&e);
    CHECK(e == NULL, "close nulls the engine");
}

/* 2 local workers: the same ids as in-process, on two sessions. */
static void test_cluster(const k3_engine_opts *eng, const toks *a, const toks *b) {
    k3_engine *e = open_engine(eng, 2, 4);
    if (!e) return;
    k3_engine_result r;
    toks ca, cb;
    k3_status st = gen(e, 7, prompt_a, 9, &ca, &r, NULL);
    CHECK(st == K3_OK && same_toks(&ca, a),
          "2 local workers, session 7: ids identical to in-process (%d tokens)", ca.n);
    st = gen(e, 8, prompt_b, 5, &cb, &r, NULL);
    CHECK(st == K3_OK && same_toks(&cb, b),
          "2 local workers, session 8: ids identical to in-process (%d tokens)", cb.n);
    int32_t ext[9 + NGEN];
    memcpy(ext, prompt_a, sizeof prompt_a);
    memcpy(ext + 9, ca.v, sizeof(int32_t) * NGEN);
    toks t;
    st = gen(e, 7, ext, 9 + NGEN, &t, &r, NULL);
    CHECK(st == K3_OK && r.gen.n_prefilled == 1,
          "2 local workers, session 7 extended after session 8: %d token(s) prefilled",
          r.gen.n_prefilled);
    k3_engine_close(&e);
}

int main(void) {
    k3_log_init("test_engine");
    signal(SIGPIPE, SIG_IGN);
    char bin[4096];
    k3_worker_bin(bin, sizeof bin);
    if (access(bin, X_OK) != 0) {
        printf("not ok - k3-worker not found at %s\n", bin);
        return 1;
    }
    k3_engine_opts eng;
    engine_opts(&eng);
    toks a = {0}, b = {0};
    test_inproc(&eng, &a, &b);
    test_cluster(&eng, &a, &b);
    TEST_MAIN_END();
}
