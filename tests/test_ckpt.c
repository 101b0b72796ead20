/* tests/test_ckpt.c: turn checkpoints (common/engine/stage.h k3_state_ckpt,
 * coordinator/generate.h k3_session_opts.ckpt) on the tiny checkpoint,
 * in-process, through the engine (coordinator/engine.h).
 *
 * A conversation: turn 1 = prompt A, turn 2 extends it (prefix reuse, a
 * checkpoint at each prompt's end), then turn 2 is edited: A + Y, which
 * leaves the committed ids right after A. With --ckpt the session restores
 * the checkpoint at |A| and prefills only Y; its teacher-forced logits of
 * every position of Y and its generated ids are compared bit for bit with a
 * fresh session fed A + Y from 0 (the full replay). Without checkpoints the
 * same edit prefills everything. A checkpoint is dropped when the session
 * resets, and at most N are kept.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"
#include "coordinator/engine.h"
#include "tests/engine_fixture.h"
#include "tests/test.h"

#define MAX_CTX 64
#define NGEN    4

typedef struct rows {
    float *v; /* [MAX_CTX][vocab] teacher-forced logits by position */
    int vocab;
    int lo, hi; /* positions seen */
} rows;

static void on_logits(void *ctx, int pos0, int T, int vocab, const float *lg) {
    rows *r = ctx;
    if (!r->v) {
        r->vocab = vocab;
        r->v = calloc((size_t)MAX_CTX * (size_t)vocab, sizeof(float));
        r->lo = pos0;
    }
    memcpy(r->v + (size_t)pos0 * (size_t)vocab, lg, sizeof(float) * (size_t)T * (size_t)vocab);
    if (pos0 < r->lo) r->lo = pos0;
    r->hi = pos0 + T;
}

typedef struct toks {
    int32_t v[MAX_CTX];
    int n;
} toks;

static void on_tok(void *ctx, int32_t id) {
    toks *t = ctx;
    if (t->n < MAX_CTX) t->v[t->n++] = id;
}

static k3_engine *open_engine(int ckpt) {
    static k3_engine_opts eng;
    t_engine_opts_tiny(&eng);
    k3_engine_open_opts o;
    k3_engine_open_opts_default(&o);
    o.eng = &eng;
    o.cluster.local = 0;
    o.chunk = 5;
    o.progress = 0;
    o.n_sessions = 4;
    o.ckpt = ckpt;
    char err[512] = "";
    k3_engine *e = NULL;
    k3_status st = k3_engine_open(&e, &o, err, sizeof err);
    CHECK(st == K3_OK && e, "in-process engine opens with --ckpt %d (%s)", ckpt, err);
    return e;
}

/* One greedy request; logits (may be NULL) gets the teacher-forced rows. */
static k3_status gen(k3_engine *e, uint64_t sid, const int32_t *p, int n, rows *lg, toks *out,
                     k3_engine_result *res) {
    char err[512] = "";
    memset(out, 0, sizeof *out);
    k3_engine_req req = {.session_id = sid,
                         .prompt = p,
                         .n_prompt = n,
                         .ngen = NGEN,
                         .max_ctx = MAX_CTX,
                         .sampling = {.temp = 0, .top_p = 1},
                         .on_token = on_tok,
                         .token_ctx = out};
    if (lg) {
        req.prompt_hooks.logits = on_logits;
        req.prompt_hooks.logits_ctx = lg;
    }
    k3_status st = k3_engine_generate(e, &req, res, err, sizeof err);
    if (st) printf("# session %llu: %s\n", (unsigned long long)sid, err);
    return st;
}

static const int32_t A[12] = {17, 400, 33, 900, 5, 61, 700, 12, 250, 3, 1100, 42};
static const int32_t X[5] = {77, 800, 9, 1000, 64};
static const int32_t Y[7] = {501, 502, 8, 1200, 13, 99, 640};

int main(void) {
    k3_log_init("test_ckpt");
    /* the full replay: a fresh session fed A + Y from position 0 */
    int32_t ay[12 + 7];
    memcpy(ay, A, sizeof A);
    memcpy(ay + 12, Y, sizeof Y);
    k3_engine *e = open_engine(2);
    if (!e) return 1;
    k3_engine_result r;
    toks t1, t2, t3, ref;
    rows lg_ref = {0}, lg3 = {0};
    k3_status st = gen(e, 9, ay, 19, &lg_ref, &ref, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 19,
          "full replay of A + Y: 19 prefilled");

    /* turn 1: A; turn 2: A + the 3 fed tokens + X (extends: prefix reuse) */
    st = gen(e, 1, A, 12, NULL, &t1, &r);
    CHECK(st == K3_OK && t1.n == NGEN, "turn 1: %d tokens", t1.n);
    int32_t turn2[12 + 3 + 5];
    memcpy(turn2, A, sizeof A);
    memcpy(turn2 + 12, t1.v, 3 * sizeof(int32_t));
    memcpy(turn2 + 15, X, sizeof X);
    st = gen(e, 1, turn2, 20, NULL, &t2, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 15 && r.gen.n_prefilled == 5,
          "turn 2 extends turn 1: %d reused, %d prefilled", r.gen.n_reused, r.gen.n_prefilled);

    /* turn 2 edited: A + Y restores the checkpoint at |A| = 12 */
    st = gen(e, 1, ay, 19, &lg3, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 12 && r.gen.n_prefilled == 7,
          "edited turn 2: the checkpoint at 12 restored, %d reused, %d prefilled", r.gen.n_reused,
          r.gen.n_prefilled);
    int same = lg3.v && lg_ref.v && lg3.lo == 12 && lg3.hi == 19 &&
               !memcmp(lg3.v + (size_t)12 * (size_t)lg3.vocab,
                       lg_ref.v + (size_t)12 * (size_t)lg_ref.vocab,
                       sizeof(float) * 7 * (size_t)lg3.vocab);
    CHECK(same,
          "restored: the logits of positions 12..18 equal the full replay's bit for bit "
          "(%d x %d floats)",
          7, lg3.vocab);
    CHECK(t3.n == ref.n && !memcmp(t3.v, ref.v, sizeof(int32_t) * (size_t)ref.n),
          "restored: the generated ids equal the full replay's (%d)", t3.n);

    /* an edit before the first checkpoint replays everything */
    int32_t early[12];
    memcpy(early, A, sizeof A);
    early[4] = 6;
    st = gen(e, 1, early, 12, NULL, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 12,
          "an edit at position 4, before every checkpoint: %d reused, %d prefilled", r.gen.n_reused,
          r.gen.n_prefilled);
    free(lg3.v);
    k3_engine_close(&e);

    /* without checkpoints the same edit prefills the whole conversation */
    e = open_engine(0);
    if (!e) return 1;
    st = gen(e, 1, A, 12, NULL, &t1, &r);
    st = st ? st : gen(e, 1, turn2, 20, NULL, &t2, &r);
    rows lg0 = {0};
    st = st ? st : gen(e, 1, ay, 19, &lg0, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 19 && lg0.v &&
              !memcmp(lg0.v, lg_ref.v, sizeof(float) * 19 * (size_t)lg0.vocab),
          "--ckpt 0: the edited turn prefills all 19 tokens (%d reused), same logits",
          r.gen.n_reused);
    free(lg0.v);
    free(lg_ref.v);
    k3_engine_close(&e);
    TEST_MAIN_END();
}
