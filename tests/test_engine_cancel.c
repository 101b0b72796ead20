/* tests/test_engine_cancel.c: cancelling a generation (coordinator/engine.h,
 * k3_engine_req.cancel) on the tiny checkpoint, in-process and with 2 local
 * k3-worker processes.
 *
 * A request is cancelled from its own callbacks (the prefill progress hook
 * after the first chunk, on_token after the second token), which is the
 * same as another thread setting the flag at that moment: the flag is read
 * before the next step. Each case checks that the call stops there with
 * K3_ERR_CANCEL, that the counts say what ran, that the session keeps the
 * ids committed so far (the next request extending them reports them as
 * reused and prefills only the rest) and that the continued output equals
 * an uncancelled run's, bit for bit. A flag already set stops the request
 * before anything is prefilled.
 */
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "common/base/log.h"
#include "coordinator/cluster.h"
#include "coordinator/engine.h"
#include "tests/test.h"

#define NGEN    6
#define MAX_CTX 64
#define CHUNK   5

static const int32_t prompt[12] = {17, 400, 33, 900, 5, 61, 700, 12, 250, 3, 1100, 42};
#define NP 12

typedef struct run {
    int32_t v[MAX_CTX];
    int n;
    atomic_int cancel;
    int cancel_after_tokens; /* set the flag in on_token after this many (0 = never) */
    int cancel_after_chunks; /* set it in the progress hook after this many chunks */
    int chunks;
} run;

static void on_tok(void *ctx, int32_t id) {
    run *r = ctx;
    if (r->n < MAX_CTX) r->v[r->n++] = id;
    if (r->cancel_after_tokens && r->n == r->cancel_after_tokens) atomic_store(&r->cancel, 1);
}

static void on_progress(void *ctx, int done, int n) {
    run *r = ctx;
    (void)done;
    (void)n;
    if (++r->chunks == r->cancel_after_chunks) atomic_store(&r->cancel, 1);
}

static void engine_opts(k3_engine_opts *eng) {
    memset(eng, 0, sizeof *eng);
    eng->model = (char *)t_tiny_dir();
    eng->bits = 4;
    eng->mla_bits = 8;
    eng->head_bits = 8;
    eng->idot = 1;
    eng->threads = 1;
    eng->expert_gb = 1;
    eng->direct = 1;
    eng->pipe = 1;
    eng->load_threads = 2;
    eng->usage = "off";
}

static k3_engine *open_engine(const k3_engine_opts *eng, int local) {
    char err[512] = "";
    k3_engine_open_opts o;
    k3_engine_open_opts_default(&o);
    o.eng = eng;
    o.usage_flag = 1;
    o.cluster.local = local;
    o.chunk = CHUNK;
    o.progress = 0;
    o.n_sessions = 4;
    k3_engine *e = NULL;
    k3_status st = k3_engine_open(&e, &o, err, sizeof err);
    CHECK(st == K3_OK && e, "engine opens with --local %d (%s)", local, err);
    return e;
}

static k3_status gen(k3_engine *e, uint64_t sid, const int32_t *p, int n, int ngen, run *r,
                     k3_engine_result *res, char *err, size_t errlen) {
    r->n = 0;
    r->chunks = 0;
    k3_engine_req req = {.session_id = sid,
                         .prompt = p,
                         .n_prompt = n,
                         .ngen = ngen,
                         .max_ctx = MAX_CTX,
                         .sampling = {.temp = 0, .top_p = 1, .seed = 0},
                         .on_token = on_tok,
                         .token_ctx = r,
                         .cancel = &r->cancel};
    req.prompt_hooks.progress = on_progress;
    req.prompt_hooks.progress_ctx = r;
    err[0] = 0;
    return k3_engine_generate(e, &req, res, err, errlen);
}

static void cases(const char *what, k3_engine *e, uint64_t sid0) {
    char err[512];
    k3_engine_result res;
    run ref = {0};
    k3_status st = gen(e, sid0, prompt, NP, NGEN, &ref, &res, err, sizeof err);
    CHECK(st == K3_OK && ref.n == NGEN && res.gen.n_reused == 0 && res.gen.n_prefilled == NP,
          "%s: uncancelled reference: %d tokens, %d reused, %d prefilled (%s)", what, ref.n,
          res.gen.n_reused, res.gen.n_prefilled, err);

    /* mid-prefill: the flag is set after chunk 1 of 3 */
    run r = {.cancel_after_chunks = 1};
    st = gen(e, sid0 + 1, prompt, NP, NGEN, &r, &res, err, sizeof err);
    CHECK(st == K3_ERR_CANCEL && r.n == 0 && res.gen.n_prefilled == CHUNK && r.chunks == 1 &&
              strstr(err, "cancel"),
          "%s: cancelled after prefill chunk 1: K3_ERR_CANCEL (%d), %d prefilled, %d tokens: '%s'",
          what, (int)st, res.gen.n_prefilled, r.n, err);
    run r2 = {0};
    st = gen(e, sid0 + 1, prompt, NP, NGEN, &r2, &res, err, sizeof err);
    CHECK(st == K3_OK && res.gen.n_reused == CHUNK && res.gen.n_prefilled == NP - CHUNK &&
              r2.n == ref.n && !memcmp(r2.v, ref.v, sizeof(int32_t) * NGEN),
          "%s: the same prompt again reuses the %d committed ids, prefills %d, same tokens (%s)",
          what, res.gen.n_reused, res.gen.n_prefilled, err);

    /* mid-decode: the flag is set when the second token is sampled */
    run d = {.cancel_after_tokens = 2};
    st = gen(e, sid0 + 2, prompt, NP, NGEN, &d, &res, err, sizeof err);
    CHECK(st == K3_ERR_CANCEL && d.n == 2 && res.gen.n_gen == 2 && d.v[0] == ref.v[0] &&
              d.v[1] == ref.v[1],
          "%s: cancelled at token 2 of %d: K3_ERR_CANCEL (%d), %d tokens, equal to the "
          "reference's: '%s'",
          what, NGEN, (int)st, d.n, err);
    int32_t ext[NP + 2];
    memcpy(ext, prompt, sizeof prompt);
    memcpy(ext + NP, d.v, 2 * sizeof(int32_t));
    run d2 = {0};
    st = gen(e, sid0 + 2, ext, NP + 2, NGEN - 2, &d2, &res, err, sizeof err);
    CHECK(st == K3_OK && res.gen.n_reused == NP + 1 && res.gen.n_prefilled == 1 &&
              d2.n == NGEN - 2 && !memcmp(d2.v, ref.v + 2, sizeof(int32_t) * (NGEN - 2)),
          "%s: prompt + the 2 tokens: %d reused (the first token was fed), %d prefilled, the "
          "reference's last %d tokens (%s)",
          what, res.gen.n_reused, res.gen.n_prefilled, NGEN - 2, err);

    /* already cancelled: nothing runs */
    run c = {0};
    atomic_store(&c.cancel, 1);
    st = gen(e, sid0 + 3, prompt, NP, NGEN, &c, &res, err, sizeof err);
    CHECK(st == K3_ERR_CANCEL && res.gen.n_prefilled == 0 && c.n == 0,
          "%s: a flag set before the call: K3_ERR_CANCEL with nothing prefilled ('%s')", what, err);
}

int main(void) {
    k3_log_init("test_engine_cancel");
    signal(SIGPIPE, SIG_IGN);
    char bin[4096];
    k3_worker_bin(bin, sizeof bin);
    if (access(bin, X_OK) != 0) {
        printf("not ok - k3-worker not found at %s\n", bin);
        return 1;
    }
    k3_engine_opts eng;
    engine_opts(&eng);
    k3_engine *e = open_engine(&eng, 0);
    if (e) cases("in-process", e, 1);
    k3_engine_close(&e);
    e = open_engine(&eng, 2);
    if (e) cases("2 local workers", e, 11);
    k3_engine_close(&e);
    TEST_MAIN_END();
}
