/* tests/test_cancel_layer.c: a cancel that arrives while a long prefill
 * chunk runs stops it within one layer step (coordinator/generate.h
 * k3_trunk_ops.set_cancel), in-process and on 2 local k3-worker processes
 * (the coordinator sends CANCEL, the worker stops before its next layer),
 * on the tiny checkpoint with one 512-token chunk.
 *
 *  - in-process, the flag set from the trace hook after layer 1: the chunk
 *    stops before layer 2 (the hook sees 2 of 8 layers), K3_ERR_CANCEL;
 *  - in-process and with workers, the flag set by another thread 10 ms
 *    into the chunk: the call returns K3_ERR_CANCEL in less than 3/4 of the
 *    uncancelled chunk's time (paired, same run), in-process with at most
 *    one layer finished after the flag was set;
 *  - the session then resets: the next request on it prefills everything
 *    and gives the uncancelled run's ids.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/log.h"
#include "coordinator/engine.h"
#include "tests/engine_fixture.h"
#include "tests/test.h"

#define NP    512
#define NGEN  2
#define CHUNK 512

static int32_t g_prompt[NP];

typedef struct run {
    int32_t v[8];
    int n;
    atomic_int cancel;
    atomic_int layers;      /* layers the trace hook saw */
    atomic_int after_flag;  /* of which finished after the flag was set */
    int cancel_after_layer; /* the trace hook sets the flag after this layer (-1: never) */
    int delay_ms;           /* another thread sets it this long after the start (0: never) */
} run;

static void on_tok(void *ctx, int32_t id) {
    run *r = ctx;
    if (r->n < 8) r->v[r->n++] = id;
}

static void on_trace(void *ctx, int layer, int pos0, int T, const float *h) {
    (void)pos0, (void)T, (void)h;
    run *r = ctx;
    atomic_fetch_add(&r->layers, 1);
    if (atomic_load(&r->cancel)) atomic_fetch_add(&r->after_flag, 1);
    if (layer == r->cancel_after_layer) atomic_store(&r->cancel, 1);
}

static void *canceller(void *p) {
    run *r = p;
    struct timespec ts = {0, (long)r->delay_ms * 1000000L};
    nanosleep(&ts, NULL);
    atomic_store(&r->cancel, 1);
    return NULL;
}

static k3_engine *open_engine(int local) {
    static k3_engine_opts eng;
    t_engine_opts_tiny(&eng);
    k3_engine_open_opts o;
    k3_engine_open_opts_default(&o);
    o.eng = &eng;
    o.usage_flag = 1;
    o.cluster.local = local;
    o.chunk = CHUNK;
    o.progress = 0;
    o.n_sessions = 4;
    char err[512] = "";
    k3_engine *e = NULL;
    k3_status st = k3_engine_open(&e, &o, err, sizeof err);
    CHECK(st == K3_OK && e, "engine opens with --local %d (%s)", local, err);
    return e;
}

/* One request on session sid; *ms its wall time. */
static k3_status gen(k3_engine *e, uint64_t sid, run *r, int trace, double *ms,
                     k3_engine_result *res, char *err, size_t errlen) {
    r->n = 0;
    atomic_store(&r->cancel, 0);
    atomic_store(&r->layers, 0);
    atomic_store(&r->after_flag, 0);
    k3_engine_req req = {.session_id = sid,
                         .prompt = g_prompt,
                         .n_prompt = NP,
                         .ngen = NGEN,
                         .max_ctx = NP + NGEN,
                         .sampling = {.temp = 0, .top_p = 1},
                         .on_token = on_tok,
                         .token_ctx = r,
                         .cancel = &r->cancel};
    if (trace) {
        req.prompt_hooks.trace = on_trace;
        req.prompt_hooks.trace_ctx = r;
    }
    pthread_t th;
    int threaded = r->delay_ms > 0 && pthread_create(&th, NULL, canceller, r) == 0;
    double t0 = k3_now_ms();
    err[0] = 0;
    k3_status st = k3_engine_generate(e, &req, res, err, errlen);
    *ms = k3_now_ms() - t0;
    if (threaded) pthread_join(th, NULL);
    return st;
}

static void cases(const char *what, int local) {
    k3_engine *e = open_engine(local);
    if (!e) return;
    char err[512];
    k3_engine_result res;
    run ref = {.cancel_after_layer = -1}, r = {.cancel_after_layer = -1};
    double t_full = 0, t_c = 0, t_warm = 0;
    /* warm-up (first-touch of the expert store), then the paired reference */
    k3_status st = gen(e, 90, &ref, 0, &t_warm, &res, err, sizeof err);
    st = st ? st : gen(e, 91, &ref, !local, &t_full, &res, err, sizeof err);
    CHECK(st == K3_OK && ref.n == NGEN && res.gen.n_prefilled == NP,
          "%s: uncancelled: %d prompt tokens in one chunk, %.1f ms (%s)", what, NP, t_full, err);

    if (!local) { /* the flag set right after layer 1 */
        r.cancel_after_layer = 1;
        double t = 0;
        st = gen(e, 1, &r, 1, &t, &res, err, sizeof err);
        int layers = atomic_load(&r.layers);
        CHECK(st == K3_ERR_CANCEL && layers == 2 && strstr(err, "before layer 2") && r.n == 0,
              "%s: flag set after layer 1: the chunk stops before layer 2 (%d layers ran, "
              "'%s')",
              what, layers, err);
        r.cancel_after_layer = -1;
    }
    r.delay_ms = 10;
    st = gen(e, 1, &r, !local, &t_c, &res, err, sizeof err);
    int after = atomic_load(&r.after_flag);
    CHECK(st == K3_ERR_CANCEL && t_c < 0.75 * t_full && r.n == 0 && (local || after <= 1),
          "%s: cancelled 10 ms into the chunk: returns after %.1f ms, the chunk takes %.1f ms "
          "(%d layer(s) finished after the flag; '%s')",
          what, t_c, t_full, after, err);
    r.delay_ms = 0;
    st = gen(e, 1, &r, 0, &t_c, &res, err, sizeof err);
    CHECK(st == K3_OK && res.gen.n_reused == 0 && res.gen.n_prefilled == NP && r.n == ref.n &&
              !memcmp(r.v, ref.v, sizeof(int32_t) * (size_t)ref.n),
          "%s: the cancelled session reset: the next request prefills all %d tokens and gives "
          "the uncancelled ids (%s)",
          what, res.gen.n_prefilled, err);
    k3_engine_close(&e);
}

int main(void) {
    k3_log_init("test_cancel_layer");
    uint32_t x = 5;
    for (int i = 0; i < NP; i++) {
        x = x * 1103515245u + 12345u;
        g_prompt[i] = (int32_t)((x >> 8) % 1280u);
    }
    cases("in-process", 0);
    cases("--local 2", 2);
    TEST_MAIN_END();
}
