/* tests/test_concurrency.c: sessions on one model make progress at once
 * (common/engine/model.h "Threads", stage.h), on the tiny checkpoint.
 *
 *   - overlap: thread A runs session 1 and parks in its trace hook after
 *     layer 0 of its first chunk, that is inside k3_stage_forward with the
 *     rest of its layers still to run; thread B then starts session 2 and
 *     must run its whole first forward, every layer, before A goes on. The
 *     hooks' timestamps show B's layers inside A's parked interval. Any
 *     model-wide lock held across a forward makes B wait for A: A's wait
 *     then times out after OVERLAP_WAIT_S and the check fails, nothing
 *     hangs;
 *   - free running: both sessions again with no rendezvous, several chunks
 *     each, forwards and heads racing on the shared pool and the expert
 *     slots (one slot per MoE layer, so the sessions fight over it); how
 *     many sessions were at once between their first and last layer's
 *     hooks is reported (2 unless the scheduler kept them apart);
 *   - bits: in both runs each session's logits and per-layer hidden states
 *     are memcmp-equal to the same session run alone;
 *   - the pool alone: two threads calling k3_pool_run on one pool at once
 *     (common/base/pool.h): every task of every job runs exactly once and
 *     no task of one job runs while a task of the other's does.
 *
 * Clean under ThreadSanitizer (make tsan builds it; run the binary).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "common/base/log.h"
#include "common/base/pool.h"
#include "common/engine/model.h"
#include "common/engine/stage.h"
#include "tests/test.h"

#define N_TOK          24 /* tokens per session */
#define CHUNK          5  /* prefill chunk: 5 forwards per session */
#define OVERLAP_WAIT_S 30 /* how long A waits for B (slow sanitizer builds) */

static char err[1024];

static k3_model *open_model(const char *dir) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.want_global = 1;
    o.threads = 2;       /* a pool with a worker: the callers share it */
    o.expert_gb = 1e-9;  /* one slot per MoE layer: the sessions share it */
    o.usage_path = NULL; /* no history file next to the fixture */
    k3_model *m = NULL;
    if (k3_model_open(&m, &o, err, sizeof err) != K3_OK) {
        printf("# open %s: %s\n", dir, err);
        return NULL;
    }
    return m;
}

static void make_ids(int32_t *ids, int T, uint32_t seed, int vocab) {
    for (int t = 0; t < T; t++) {
        seed = seed * 1664525u + 1013904223u;
        ids[t] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

/* ---- the rendezvous between A's and B's first forward ---- */

typedef struct rendezvous {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int a_parked;     /* A is in its hook after layer 0 of chunk 0 */
    int b_through;    /* B's hook after its last layer of chunk 0 ran */
    int a_timed_out;  /* A gave up waiting for B */
    double t_park;    /* A parked (ms) */
    double t_resume;  /* A went on (ms) */
    double t_b_first; /* B's hook after its first layer (ms) */
    double t_b_last;  /* B's hook after its last layer (ms) */
    int b_saw_parked; /* A was still parked when B's layers ran */
} rendezvous;

static rendezvous g_rv = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* Waits on g_rv.cv until *flag or the deadline; 1 when *flag. g_rv.mu held. */
static int rv_wait(const int *flag, int seconds) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += seconds;
    while (!*flag)
        if (pthread_cond_timedwait(&g_rv.cv, &g_rv.mu, &dl) != 0) break;
    return *flag;
}

/* ---- one session on its own thread ---- */

typedef struct sess_run {
    k3_model *m;
    int role; /* 0: plain, 1: A (parks), 2: B (runs while A is parked) */
    int32_t ids[N_TOK];
    float *logits; /* [N_TOK][vocab] */
    float *trace;  /* [n_layers][N_TOK][D] hidden after each layer */
    int n_layers, D;
    k3_status st;
    char err[512];
} sess_run;

/* Sessions between their first and last layer's hooks (inside a forward,
 * where a forward-wide lock would be held), now and at most at once. */
static atomic_int g_mid_forward, g_peak;

static void trace_hook(void *ctx, int layer, int pos0, int T, const float *h) {
    sess_run *r = ctx;
    if (layer == 0) {
        int now = atomic_fetch_add(&g_mid_forward, 1) + 1;
        for (int peak = atomic_load(&g_peak); now > peak;)
            if (atomic_compare_exchange_weak(&g_peak, &peak, now)) break;
    }
    if (layer == r->n_layers - 1) atomic_fetch_sub(&g_mid_forward, 1);
    for (int t = 0; t < T; t++)
        memcpy(r->trace + ((size_t)layer * N_TOK + pos0 + t) * r->D, h + (size_t)t * r->D,
               sizeof(float) * (size_t)r->D);
    if (pos0 != 0 || r->role == 0) return;
    pthread_mutex_lock(&g_rv.mu);
    if (r->role == 1 && layer == 0) {
        g_rv.a_parked = 1;
        g_rv.t_park = k3_now_ms();
        pthread_cond_broadcast(&g_rv.cv);
        g_rv.a_timed_out = !rv_wait(&g_rv.b_through, OVERLAP_WAIT_S);
        g_rv.t_resume = k3_now_ms();
        g_rv.a_parked = 0;
    } else if (r->role == 2 && (layer == 0 || layer == r->n_layers - 1)) {
        double now = k3_now_ms();
        if (layer == 0) g_rv.t_b_first = now, g_rv.b_saw_parked = g_rv.a_parked;
        if (layer == r->n_layers - 1) {
            g_rv.t_b_last = now;
            g_rv.b_saw_parked &= g_rv.a_parked;
            g_rv.b_through = 1;
            pthread_cond_broadcast(&g_rv.cv);
        }
    }
    pthread_mutex_unlock(&g_rv.mu);
}

static void *sess_thread(void *p) {
    sess_run *r = p;
    const k3_config *c = k3_model_config(r->m);
    int D = c->hidden;
    if (r->role == 2) { /* B starts only once A sits inside its forward */
        pthread_mutex_lock(&g_rv.mu);
        int ok = rv_wait(&g_rv.a_parked, OVERLAP_WAIT_S);
        pthread_mutex_unlock(&g_rv.mu);
        if (!ok) {
            r->st = k3_errf(K3_ERR_STATE, r->err, sizeof r->err, "A never parked");
            return NULL;
        }
    }
    k3_state *s = NULL;
    r->st = k3_state_open(&s, r->m, N_TOK, r->err, sizeof r->err);
    float *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * (size_t)CHUNK * D);
    float *h = malloc(sizeof(float) * (size_t)CHUNK * D);
    for (int p0 = 0; p0 < N_TOK && !r->st; p0 += CHUNK) {
        int n = N_TOK - p0 < CHUNK ? N_TOK - p0 : CHUNK, nb = 0;
        r->st = k3_model_embed(r->m, r->ids + p0, n, h, r->err, sizeof r->err);
        if (r->st) break;
        r->st = k3_stage_forward(r->m, s, p0, n, blocks, &nb, h, NULL, trace_hook, r, r->err,
                                 sizeof r->err);
        if (!r->st)
            r->st = k3_model_head(r->m, blocks, nb, h, n, 0, r->logits + (size_t)p0 * c->vocab,
                                  r->err, sizeof r->err);
    }
    free(blocks);
    free(h);
    k3_state_close(&s);
    return NULL;
}

static void sess_init(sess_run *r, k3_model *m, int role, uint32_t seed) {
    const k3_config *c = k3_model_config(m);
    memset(r, 0, sizeof *r);
    r->m = m;
    r->role = role;
    r->n_layers = c->n_layers;
    r->D = c->hidden;
    make_ids(r->ids, N_TOK, seed, c->vocab);
    r->logits = calloc((size_t)N_TOK * c->vocab, sizeof(float));
    r->trace = calloc((size_t)c->n_layers * N_TOK * c->hidden, sizeof(float));
}

static void sess_free(sess_run *r) {
    free(r->logits);
    free(r->trace);
}

/* Both outputs of a concurrent run equal the run alone, bit for bit. */
static int same_bits(const sess_run *a, const sess_run *b) {
    const k3_config *c = k3_model_config(a->m);
    return a->st == K3_OK && b->st == K3_OK &&
           !memcmp(a->logits, b->logits, sizeof(float) * (size_t)N_TOK * c->vocab) &&
           !memcmp(a->trace, b->trace, sizeof(float) * (size_t)c->n_layers * N_TOK * c->hidden);
}

static void run_pair(sess_run r[2]) {
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, sess_thread, &r[k]);
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
}

static void test_sessions(const char *tiny) {
    k3_model *m = open_model(tiny);
    if (!m) {
        CHECK(0, "open the tiny checkpoint (%s)", err);
        return;
    }
    /* each session alone: the reference bits */
    sess_run alone[2];
    for (int k = 0; k < 2; k++) {
        sess_init(&alone[k], m, 0, 900u + (uint32_t)k);
        sess_thread(&alone[k]);
    }
    CHECK(alone[0].st == K3_OK && alone[1].st == K3_OK, "two sessions run alone (%s)",
          alone[0].st   ? alone[0].err
          : alone[1].st ? alone[1].err
                        : "ok");

    /* A parks inside its first forward, B runs a whole forward meanwhile */
    sess_run pair[2];
    sess_init(&pair[0], m, 1, 900u);
    sess_init(&pair[1], m, 2, 901u);
    run_pair(pair);
    int L = k3_model_config(m)->n_layers;
    CHECK(!g_rv.a_timed_out && g_rv.b_through && g_rv.b_saw_parked &&
              g_rv.t_b_first >= g_rv.t_park && g_rv.t_b_last <= g_rv.t_resume,
          "overlap: session B ran layers 0..%d of its forward (%.2f ms) while session A sat "
          "inside its forward after layer 0 (parked %.2f ms)%s",
          L - 1, g_rv.t_b_last - g_rv.t_b_first, g_rv.t_resume - g_rv.t_park,
          g_rv.a_timed_out ? ": A timed out waiting, B was kept out of its forward" : "");
    CHECK(same_bits(&pair[0], &alone[0]) && same_bits(&pair[1], &alone[1]),
          "overlapped sessions: logits and every layer's hidden state == each alone, bit for "
          "bit (%s)",
          pair[0].st   ? pair[0].err
          : pair[1].st ? pair[1].err
                       : "ok");

    /* free running, several rounds: forwards and heads race */
    int ok = 1, rounds = 8;
    atomic_store(&g_peak, 0);
    for (int round = 0; round < rounds && ok; round++) {
        sess_run fr[2];
        for (int k = 0; k < 2; k++) sess_init(&fr[k], m, 0, 900u + (uint32_t)k);
        run_pair(fr);
        for (int k = 0; k < 2; k++) ok &= same_bits(&fr[k], &alone[k]);
        if (!ok)
            printf("# round %d: %s / %s\n", round, fr[0].st ? fr[0].err : "ok",
                   fr[1].st ? fr[1].err : "ok");
        for (int k = 0; k < 2; k++) sess_free(&fr[k]);
    }
    CHECK(ok,
          "free running: 2 sessions x %d rounds x %d forwards + heads at once == each alone, "
          "bit for bit (at most %d sessions were between their first and last layer at once)",
          rounds, (N_TOK + CHUNK - 1) / CHUNK, atomic_load(&g_peak));
    for (int k = 0; k < 2; k++) sess_free(&alone[k]), sess_free(&pair[k]);
    k3_model_close(&m);
}

/* ---- the pool's concurrent callers ---- */

static atomic_int g_running[2]; /* tasks of caller k's job running now */
static atomic_int g_mixed;      /* a task saw the other caller's task running */

typedef struct pool_caller {
    k3_pool *pool;
    int who; /* 0 or 1 */
    int runs, n_tasks;
    atomic_int *hits; /* [n_tasks] times each task ran in the current run */
    int bad_runs;     /* runs where a task did not run exactly once */
} pool_caller;

/* Two tasks of different jobs that run at the same time: at least one of
 * them sees the other's counter raised (both raise, then look, then lower). */
static void pool_task(void *ctx, int task) {
    pool_caller *c = ctx;
    atomic_fetch_add(&g_running[c->who], 1);
    if (atomic_load(&g_running[1 - c->who]) > 0) atomic_store(&g_mixed, 1);
    volatile double x = 1.0;
    for (int i = 0; i < 200; i++) x = x * 1.0000001; /* a little work */
    atomic_fetch_add(&c->hits[task], 1);
    atomic_fetch_sub(&g_running[c->who], 1);
}

static void *pool_caller_thread(void *p) {
    pool_caller *c = p;
    for (int r = 0; r < c->runs; r++) {
        for (int i = 0; i < c->n_tasks; i++) atomic_store(&c->hits[i], 0);
        k3_pool_run(c->pool, pool_task, c, c->n_tasks);
        int ok = 1;
        for (int i = 0; i < c->n_tasks; i++) ok &= atomic_load(&c->hits[i]) == 1;
        c->bad_runs += !ok;
    }
    return NULL;
}

static void test_pool_callers(void) {
    k3_pool *pool = NULL;
    CHECK(k3_pool_open(&pool, 3, err, sizeof err) == K3_OK, "pool of 3 (%s)", err);
    if (!pool) return;
    pool_caller c[2];
    memset(c, 0, sizeof c);
    for (int k = 0; k < 2; k++) {
        c[k].pool = pool;
        c[k].who = k;
        c[k].runs = 2000;
        c[k].n_tasks = 7 + k * 5;
        c[k].hits = calloc((size_t)c[k].n_tasks, sizeof *c[k].hits);
    }
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, pool_caller_thread, &c[k]);
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    CHECK(c[0].bad_runs == 0 && c[1].bad_runs == 0 && !atomic_load(&g_mixed),
          "two threads x %d runs of 7 and 12 tasks on one pool at once: every task of every "
          "job ran exactly once (%d, %d bad runs), never two jobs at once (%s)",
          c[0].runs, c[0].bad_runs, c[1].bad_runs, atomic_load(&g_mixed) ? "mixed" : "ok");
    for (int k = 0; k < 2; k++) free(c[k].hits);
    k3_pool_close(&pool);
}

int main(void) {
    const char *tiny = t_tiny_dir();
    test_pool_callers();
    char cfg_path[512];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", tiny);
    if (access(cfg_path, R_OK) != 0) {
        CHECK(0, "tiny checkpoint at %s (run make tiny)", tiny);
        TEST_MAIN_END();
    }
    test_sessions(tiny);
    TEST_MAIN_END();
}
