/* tests/test_generate.c: sessions and the generation loop
 * (coordinator/generate.h) on the tiny checkpoint in exact mode: prefix
 * reuse prefills only the tail and gives the same bits as a fresh prefill,
 * diverging and shorter prompts reset, teacher-forced hooks see every
 * position, bad ids and over-long prompts fail without touching the session,
 * and the stop rules (ngen, eos, context) hold. */
#include <stdint.h>
#include <string.h>

#include "common/engine/model.h"
#include "coordinator/sampler.h"
#include "coordinator/generate.h"
#include "tests/test.h"

#define MAXV 4096

/* Collects teacher-forced rows: [n_rows][vocab]. */
typedef struct rows {
    float *v;
    int n, vocab, next_pos, in_order;
} rows;

static void on_rows(void *ctx, int pos0, int T, int vocab, const float *logits) {
    rows *r = ctx;
    r->in_order &= pos0 == r->next_pos;
    r->next_pos = pos0 + T;
    r->vocab = vocab;
    r->v = realloc(r->v, (size_t)(r->n + T) * (size_t)vocab * sizeof(float));
    memcpy(r->v + (size_t)r->n * (size_t)vocab, logits, (size_t)T * (size_t)vocab * sizeof(float));
    r->n += T;
}

static int n_trace_calls;
static void on_trace(void *ctx, int layer, int pos0, int T, const float *h) {
    (void)ctx, (void)layer, (void)pos0, (void)T, (void)h;
    n_trace_calls++;
}

typedef struct toks {
    int32_t v[64];
    int n;
} toks;

static void on_tok(void *ctx, int32_t id) {
    toks *t = ctx;
    if (t->n < 64) t->v[t->n++] = id;
}

int main(void) {
    char err[512] = "";
    k3_model_opts mo;
    k3_model_opts_default(&mo);
    mo.model_dir = t_tiny_dir();
    mo.want_global = 1;
    mo.bits = mo.mla_bits = mo.head_bits = 32;
    mo.idot = 0;
    mo.threads = 2;
    k3_model *m = NULL;
    k3_status st = k3_model_open(&m, &mo, err, sizeof err);
    CHECK(st == K3_OK, "tiny opens in exact mode (%s)", err);
    if (st) TEST_MAIN_END();
    const k3_config *cfg = k3_model_config(m);
    int V = cfg->vocab;
    k3_trunk *trunk = NULL;
    st = k3_trunk_open_inproc(&trunk, m, err, sizeof err);
    CHECK(st == K3_OK && trunk, "in-process trunk opens (%s)", err);

    k3_session_opts so = {.max_ctx = 64, .chunk = 3, .progress = 0};
    k3_session *a = NULL, *b = NULL;
    CHECK(k3_session_open(&a, m, trunk, &so, err, sizeof err) == K3_OK, "session a opens");
    CHECK(k3_session_open(&b, m, trunk, &so, err, sizeof err) == K3_OK, "session b opens");

    int32_t full[9] = {17, 400, 33, 900, 5, 61, 700, 12, 250};
    const float *la = NULL, *lb = NULL;
    int fed = -1;
    float *last = malloc((size_t)V * sizeof(float));

    /* a: 5 tokens, then extended to 9: only the 4 new ones are prefilled */
    st = k3_session_feed(a, full, 5, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 5 && k3_session_len(a) == 5 && la, "feed 5 tokens (%s)", err);
    rows ra = {.in_order = 1, .next_pos = 5};
    k3_feed_hooks hk = {.logits = on_rows, .logits_ctx = &ra};
    st = k3_session_feed(a, full, 9, &hk, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 4 && k3_session_len(a) == 9,
          "a prompt extending the committed ids prefills only the tail (%d fed)", fed);
    CHECK(ra.n == 4 && ra.in_order, "the logits hook saw positions 5..8 in order (%d rows)", ra.n);
    memcpy(last, la, (size_t)V * sizeof(float));

    /* b: all 9 at once (chunks of 3); teacher-forced rows and the last logits */
    rows rb = {.in_order = 1};
    k3_feed_hooks hb = {.logits = on_rows, .logits_ctx = &rb, .trace = on_trace};
    st = k3_session_feed(b, full, 9, &hb, &lb, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 9 && rb.n == 9 && rb.in_order, "fresh feed of 9 tokens");
    CHECK(n_trace_calls == cfg->n_layers * 3, "trace hook: once per layer per chunk (%d)",
          n_trace_calls);
    CHECK(!memcmp(last, lb, (size_t)V * sizeof(float)),
          "reused prefix + tail = fresh prefill, bit for bit (last position)");
    CHECK(!memcmp(ra.v, rb.v + (size_t)5 * V, (size_t)4 * V * sizeof(float)),
          "teacher-forced rows 5..8 identical between the two paths");
    CHECK(!memcmp(rb.v + (size_t)8 * V, lb, (size_t)V * sizeof(float)),
          "the last teacher-forced row is the returned logits");

    /* the same prompt again: nothing to prefill, same logits */
    st = k3_session_feed(a, full, 9, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 0 && !memcmp(la, last, (size_t)V * sizeof(float)),
          "an identical prompt prefills nothing and returns the same logits");

    /* diverging and shorter prompts reset */
    int32_t div[9];
    memcpy(div, full, sizeof div);
    div[6] = 701;
    st = k3_session_feed(a, div, 9, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 9, "a diverging prompt resets and prefills all 9 (%d)", fed);
    st = k3_session_feed(a, full, 9, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 9 && !memcmp(la, last, (size_t)V * sizeof(float)),
          "back to the original prompt: reset again, same bits as before");
    st = k3_session_feed(a, full, 4, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_OK && fed == 4 && k3_session_len(a) == 4,
          "a shorter prompt (a strict prefix) resets: the state cannot rewind");

    /* bad input leaves the session as it was */
    int32_t bad[6] = {17, 400, 33, 900, V, 1};
    int before = k3_session_len(a);
    st = k3_session_feed(a, bad, 6, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "token id") && strstr(err, "position 4"),
          "id = vocab refused: '%s'", err);
    CHECK(k3_session_len(a) == before, "the session keeps its %d committed ids", before);
    int32_t many[65] = {0};
    st = k3_session_feed(a, many, 65, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "longer than the context"),
          "65 tokens into a 64-token context: '%s'", err);
    st = k3_session_feed(a, full, 0, NULL, &la, &fed, err, sizeof err);
    CHECK(st == K3_ERR_ARG, "an empty prompt is refused: '%s'", err);
    CHECK(k3_session_state_bytes(a) > 0, "state bytes reported (%zu)", k3_session_state_bytes(a));

    /* generation: greedy 6 tokens = argmax chain */
    k3_sampler *smp = NULL;
    k3_sampler_opts sopt = {.temp = 0, .top_p = 1, .seed = 0};
    CHECK(k3_sampler_open(&smp, &sopt, V, err, sizeof err) == K3_OK, "greedy sampler");
    toks got = {0};
    k3_gen_opts go = {.ngen = 6,
                      .sampler = smp,
                      .eos = cfg->eos,
                      .n_eos = cfg->n_eos,
                      .on_token = on_tok,
                      .token_ctx = &got};
    k3_gen_result res;
    k3_session_reset(b);
    st = k3_generate(b, full, 9, &go, &res, err, sizeof err);
    CHECK(st == K3_OK && res.n_gen == 6 && got.n == 6 && res.stop == K3_STOP_NGEN &&
              res.n_decode_steps == 5 && k3_session_len(b) == 14,
          "6 greedy tokens: 5 fed back, stop ngen (len %d, %s)", k3_session_len(b), err);
    CHECK(got.v[0] == k3_sampler_argmax(last, V), "first token = argmax of the prompt logits");
    /* continuing: prompt + generated ids extends the session */
    int32_t cont[16];
    memcpy(cont, full, sizeof full);
    memcpy(cont + 9, got.v, 6 * sizeof(int32_t));
    toks got2 = {0};
    go.on_token = on_tok;
    go.token_ctx = &got2;
    go.ngen = 1;
    st = k3_generate(b, cont, 15, &go, &res, err, sizeof err);
    CHECK(st == K3_OK && res.n_prefilled == 1,
          "a follow-up prompt prefills only the unfed "
          "last token (%d)",
          res.n_prefilled);
    /* eos: tiny predicts "id - 1", so the id after eos gives eos */
    if (cfg->n_eos > 0) {
        int32_t e1 = cfg->eos[0] + 1;
        toks g3 = {0};
        go.token_ctx = &g3;
        go.ngen = 8;
        st = k3_generate(b, &e1, 1, &go, &res, err, sizeof err);
        CHECK(st == K3_OK && res.stop == K3_STOP_EOS && g3.n == 1 && g3.v[0] == cfg->eos[0] &&
                  k3_session_len(b) == 1,
              "eos stops after one token and is not fed (%d tokens)", g3.n);
    }
    /* context full: a 62-token prompt in 64 slots yields 3 tokens */
    int32_t long_p[62];
    for (int i = 0; i < 62; i++) long_p[i] = (int32_t)(100 + 7 * i);
    toks g4 = {0};
    go.token_ctx = &g4;
    go.ngen = 10;
    st = k3_generate(b, long_p, 62, &go, &res, err, sizeof err);
    CHECK(st == K3_OK && res.stop == K3_STOP_CTX && g4.n == 3 && k3_session_len(b) == 64,
          "context full: 3 tokens from 62 + 2 fed, stop ctx (%d)", g4.n);

    free(ra.v);
    free(rb.v);
    free(last);
    k3_sampler_close(&smp);
    k3_session_close(&a);
    k3_session_close(&b);
    CHECK(a == NULL && b == NULL, "session close nulls");
    k3_trunk_close(&trunk);
    k3_model_close(&m);
    TEST_MAIN_END();
}
