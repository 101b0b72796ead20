/* tests/test_ckpt.c: turn checkpoints (common/engine/stage.h k3_state_ckpt,
 * coordinator/generate.h k3_session_opts.ckpt) on the tiny checkpoint,
 * through the engine (coordinator/engine.h): in-process, on 2 local workers
 * over ipc (--local 2) and on 2 workers over tcp (--workers), where the
 * checkpoints live on the workers (CHECKPOINT / RESTORE, PROTOCOL.md
 * "Checkpoints").
 *
 * A conversation: turn 1 = prompt A, turn 2 extends it (prefix reuse, a
 * checkpoint at each prompt's end), then turn 2 is edited: A + Y, which
 * leaves the committed ids right after A. With --ckpt the session restores
 * the checkpoint at |A| and prefills only Y; its teacher-forced logits of
 * every position of Y and its generated ids are compared bit for bit with a
 * fresh in-process session fed A + Y from 0 (the full replay). Without
 * checkpoints the same edit prefills everything. A checkpoint is dropped
 * when the session resets, and at most N are kept.
 *
 * The worker's side (worker/sessions.h) directly: a checkpoint or restore
 * of an evicted or unknown session, at the wrong position, of a position
 * without a checkpoint, or past the --ckpt-mb budget is refused with an
 * error naming the session and the reason; and through a cluster whose
 * workers hold one session, an evicted session's edited turn replays to
 * the same ids.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/log.h"
#include "common/engine/ckpt_store.h"
#include "common/engine/stage.h"
#include "coordinator/cluster.h"
#include "coordinator/engine.h"
#include "tests/engine_fixture.h"
#include "tests/test.h"
#include "worker/sessions.h"

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

/* local: local workers (0 = in-process); eps/n_eps: worker endpoints
 * instead; max_sess: the local workers' --max-sessions (0 = default). */
static const char *g_ckpt_dir; /* --ckpt-dir of the next engine, NULL = none */

static k3_engine *open_engine(int ckpt, int local, const char *const *eps, int n_eps,
                              int max_sess) {
    static k3_engine_opts eng;
    t_engine_opts_tiny(&eng);
    k3_engine_open_opts o;
    k3_engine_open_opts_default(&o);
    o.eng = &eng;
    o.usage_flag = 1; /* K3_USAGE=off for the local workers too */
    o.cluster.local = local;
    o.cluster.workers = eps;
    o.cluster.n_workers = n_eps;
    o.cluster.max_sessions = max_sess;
    o.chunk = 5;
    o.progress = 0;
    o.n_sessions = 4;
    o.ckpt = ckpt;
    o.ckpt_dir = g_ckpt_dir;
    char err[512] = "";
    k3_engine *e = NULL;
    k3_status st = k3_engine_open(&e, &o, err, sizeof err);
    CHECK(st == K3_OK && e, "engine (--local %d, %d workers) opens with --ckpt %d (%s)", local,
          n_eps, ckpt, err);
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

/* The reference: a fresh session fed A + Y from 0 on the in-process engine. */
static rows g_ref_lg;
static toks g_ref;

/* Turn 1, turn 2 extending it, turn 2 edited (restores the checkpoint at
 * 12), on engine e; then an edit before every checkpoint. */
static void conversation(k3_engine *e, const char *label, uint64_t sid) {
    int32_t ay[12 + 7];
    memcpy(ay, A, sizeof A);
    memcpy(ay + 12, Y, sizeof Y);
    k3_engine_result r;
    toks t1, t2, t3;
    rows lg3 = {0};
    k3_status st = gen(e, sid, A, 12, NULL, &t1, &r);
    CHECK(st == K3_OK && t1.n == NGEN, "%s: turn 1: %d tokens", label, t1.n);
    int32_t turn2[12 + 3 + 5];
    memcpy(turn2, A, sizeof A);
    memcpy(turn2 + 12, t1.v, 3 * sizeof(int32_t));
    memcpy(turn2 + 15, X, sizeof X);
    st = gen(e, sid, turn2, 20, NULL, &t2, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 15 && r.gen.n_prefilled == 5,
          "%s: turn 2 extends turn 1: %d reused, %d prefilled", label, r.gen.n_reused,
          r.gen.n_prefilled);

    /* turn 2 edited: A + Y restores the checkpoint at |A| = 12 */
    st = gen(e, sid, ay, 19, &lg3, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 12 && r.gen.n_prefilled == 7,
          "%s: edited turn 2: the checkpoint at 12 restored, %d reused, %d prefilled", label,
          r.gen.n_reused, r.gen.n_prefilled);
    int same = lg3.v && g_ref_lg.v && lg3.lo == 12 && lg3.hi == 19 &&
               !memcmp(lg3.v + (size_t)12 * (size_t)lg3.vocab,
                       g_ref_lg.v + (size_t)12 * (size_t)g_ref_lg.vocab,
                       sizeof(float) * 7 * (size_t)lg3.vocab);
    CHECK(same,
          "%s: restored: the logits of positions 12..18 equal the full replay's bit for bit "
          "(%d x %d floats)",
          label, 7, lg3.vocab);
    CHECK(t3.n == g_ref.n && !memcmp(t3.v, g_ref.v, sizeof(int32_t) * (size_t)g_ref.n),
          "%s: restored: the generated ids equal the full replay's (%d)", label, t3.n);

    /* an edit before the first checkpoint replays everything */
    int32_t early[12];
    memcpy(early, A, sizeof A);
    early[4] = 6;
    st = gen(e, sid, early, 12, NULL, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 12,
          "%s: an edit at position 4, before every checkpoint: %d reused, %d prefilled", label,
          r.gen.n_reused, r.gen.n_prefilled);
    free(lg3.v);
}

/* Feeds n ids to a worker state at its position (layers [0, L) of m). */
static k3_status feed_state(k3_model *m, k3_state *s, const int32_t *ids, int n) {
    const k3_config *cfg = k3_model_config(m);
    float *h = calloc((size_t)n * (size_t)cfg->hidden, sizeof(float));
    float *b = calloc((size_t)K3_MAX_RES_ENTRIES * (size_t)n * (size_t)cfg->hidden, sizeof(float));
    char err[512];
    int nb = 0;
    k3_status st = k3_model_embed(m, ids, n, h, err, sizeof err);
    if (!st)
        st = k3_stage_forward(m, s, k3_state_pos(s), n, b, &nb, h, NULL, NULL, NULL, err,
                              sizeof err);
    if (st) printf("# feed: %s\n", err);
    free(h);
    free(b);
    return st;
}

/* worker/sessions.h: CHECKPOINT and RESTORE refusals, on the in-process
 * model (every layer: a one-stage worker). */
static void worker_table(k3_model *m) {
    char err[512] = "";
    wk_sessions *t = NULL;
    k3_status st = wk_sessions_open(&t, m, 1, MAX_CTX, 64u << 20, err, sizeof err);
    CHECK(st == K3_OK, "worker table: 1 session, 64 MiB of checkpoints (%s)", err);
    if (st) return;
    k3_state *s = NULL;
    uint64_t ev = 0;
    st = wk_sessions_checkpoint(t, 1, 3, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "session 1") && strstr(err, "unknown here"),
          "worker: CHECKPOINT of an unknown session refused: '%s'", err);
    st = wk_sessions_acquire(t, 1, 0, &s, &ev, err, sizeof err);
    if (!st) st = feed_state(m, s, A, 3);
    CHECK(st == K3_OK && k3_state_pos(s) == 3, "worker: session 1 fed 3 tokens");
    st = wk_sessions_checkpoint(t, 1, 2, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "at position 3"),
          "worker: CHECKPOINT at 2 of a session at 3 refused: '%s'", err);
    st = wk_sessions_checkpoint(t, 1, 3, 2, 0, err, sizeof err);
    int nck = 0;
    uint64_t bytes = wk_sessions_ckpt_bytes(t, &nck);
    CHECK(st == K3_OK && nck == 1 && bytes > 0, "worker: CHECKPOINT at 3: %d held, %llu bytes", nck,
          (unsigned long long)bytes);
    st = feed_state(m, s, A + 3, 2);
    st = st ? st : wk_sessions_checkpoint(t, 1, 5, 2, 0, err, sizeof err);
    st = st ? st : feed_state(m, s, A + 5, 2);
    st = st ? st : wk_sessions_checkpoint(t, 1, 7, 2, 0, err, sizeof err);
    wk_sessions_ckpt_bytes(t, &nck);
    CHECK(st == K3_OK && nck == 2,
          "worker: checkpoints at 5 and 7 with keep 2: %d held (the "
          "one at 3 dropped)",
          nck);
    st = wk_sessions_restore(t, 1, 3, 0, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "no checkpoint there"),
          "worker: RESTORE to a dropped checkpoint refused: '%s'", err);
    st = wk_sessions_restore(t, 1, 5, 0, err, sizeof err);
    wk_sessions_ckpt_bytes(t, &nck);
    CHECK(st == K3_OK && k3_state_pos(s) == 5 && nck == 1,
          "worker: RESTORE to 5: position %d, %d checkpoint left (the one at 7 dropped)",
          k3_state_pos(s), nck);
    /* session 2 takes the only slot: session 1 and its checkpoints go */
    st = wk_sessions_acquire(t, 2, 0, &s, &ev, err, sizeof err);
    bytes = wk_sessions_ckpt_bytes(t, &nck);
    CHECK(st == K3_OK && ev == 1 && nck == 0 && bytes == 0,
          "worker: session 2 evicts session 1 with its checkpoints (%d held, %llu bytes)", nck,
          (unsigned long long)bytes);
    st = wk_sessions_restore(t, 1, 5, 0, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "session 1") && strstr(err, "evicted"),
          "worker: RESTORE of the evicted session refused: '%s'", err);
    st = wk_sessions_checkpoint(t, 1, 5, 2, 0, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "unknown here"),
          "worker: CHECKPOINT of the evicted session refused: '%s'", err);
    wk_sessions_close(&t);

    /* a budget smaller than one checkpoint: refused, nothing held */
    st = wk_sessions_open(&t, m, 2, MAX_CTX, 1, err, sizeof err);
    if (!st) st = wk_sessions_acquire(t, 1, 0, &s, &ev, err, sizeof err);
    if (!st) st = feed_state(m, s, A, 2);
    if (!st) st = wk_sessions_checkpoint(t, 1, 2, 1, 0, err, sizeof err);
    bytes = wk_sessions_ckpt_bytes(t, &nck);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "--ckpt-mb") && nck == 0 && bytes == 0,
          "worker: a CHECKPOINT past the budget refused: '%s'", err);
    wk_sessions_close(&t);
}

/* Starts a k3-worker for layers [a, b) on ep with the engine's numerics. */
static pid_t tcp_worker(int a, int b, const char *ep) {
    char bin[4096], layers[32];
    k3_worker_bin(bin, sizeof bin);
    snprintf(layers, sizeof layers, "%d-%d", a, b);
    const char *argv[] = {bin,        "--model",  t_tiny_dir(),     "--layers",   layers,
                          "--listen", ep,         "--threads",      "1",          "--no-bench",
                          "--bits",   "4",        "--mla-bits",     "8",          "--head-bits",
                          "8",        "--idot=1", "--dense-idot=0", "--direct=1", NULL};
    char *env[] = {"K3_USAGE=off", NULL};
    pid_t pid = 0;
    char err[512];
    if (k3_worker_spawn(&pid, bin, (char *const *)argv, env, err, sizeof err)) {
        printf("# spawn: %s\n", err);
        return 0;
    }
    return pid;
}

static int count_files(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls %s | grep -c '\\.k3ck$'", dir);
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (p && fscanf(p, "%d", &n) != 1) n = -1;
    if (p) pclose(p);
    return n;
}

/* --ckpt-dir: an engine parks its turn checkpoints; a new engine on the same
 * directory (a restarted coordinator) resumes the conversation from the
 * deepest one: fewer tokens prefilled, the same logits and ids as a full
 * replay. A damaged file is refused and the prompt replayed. */
static void parked(int local) {
    char dir[] = "/tmp/k3_test_ckpt_dir_XXXXXX";
    const char *lab = local ? "--local 2" : "in-process";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    int32_t turn2[12 + 3 + 5], turn3[20 + 2 + 7];
    k3_engine_result r;
    int rc = 0;
    toks t1, t2, t3, ref;
    rows lg_ref = {0}, lg3 = {0};
    g_ckpt_dir = dir;
    k3_engine *e = open_engine(2, local, NULL, 0, 0);
    if (!e) {
        rmdir(dir);
        return;
    }
    k3_status st = gen(e, 1, A, 12, NULL, &t1, &r);
    memcpy(turn2, A, sizeof A);
    memcpy(turn2 + 12, t1.v, 3 * sizeof(int32_t));
    memcpy(turn2 + 15, X, sizeof X);
    st = st ? st : gen(e, 1, turn2, 20, NULL, &t2, &r);
    k3_engine_close(&e);
    int nf = count_files(dir);
    CHECK(st == K3_OK && nf == 2, "--ckpt-dir, %s: two turns park %d checkpoint files (12, 20)",
          lab, nf);
    if (local) { /* each worker parks its layers in its own directory */
        char wd[600];
        snprintf(wd, sizeof wd, "%s/w0-0-4", dir);
        int n0 = count_files(wd);
        snprintf(wd, sizeof wd, "%s/w1-4-8", dir);
        int n1 = count_files(wd);
        CHECK(n0 == 2 && n1 == 2,
              "--ckpt-dir, --local 2: the workers park %d and %d files in "
              "w0-0-4 and w1-4-8",
              n0, n1);
    }

    /* turn 3 extends turn 2; the reference replays it from 0 */
    memcpy(turn3, turn2, sizeof turn2);
    memcpy(turn3 + 20, t2.v, 2 * sizeof(int32_t));
    memcpy(turn3 + 22, Y, sizeof Y);
    g_ckpt_dir = NULL;
    e = open_engine(2, 0, NULL, 0, 0);
    st = e ? gen(e, 3, turn3, 29, &lg_ref, &ref, &r) : K3_ERR_STATE;
    k3_engine_close(&e);

    g_ckpt_dir = dir; /* the restarted coordinator */
    e = open_engine(2, local, NULL, 0, 0);
    st = st ? st : e ? gen(e, 7, turn3, 29, &lg3, &t3, &r) : K3_ERR_STATE;
    int same = st == K3_OK && lg3.v && lg_ref.v && lg3.lo == 20 && lg3.hi == 29 &&
               !memcmp(lg3.v + (size_t)20 * (size_t)lg3.vocab,
                       lg_ref.v + (size_t)20 * (size_t)lg_ref.vocab,
                       sizeof(float) * 9 * (size_t)lg3.vocab);
    CHECK(st == K3_OK && r.gen.n_reused == 20 && r.gen.n_prefilled == 9,
          "--ckpt-dir, %s: after a restart turn 3 loads the parked checkpoint at 20: %d reused, "
          "%d prefilled",
          lab, r.gen.n_reused, r.gen.n_prefilled);
    CHECK(same && t3.n == ref.n && !memcmp(t3.v, ref.v, sizeof(int32_t) * (size_t)ref.n),
          "--ckpt-dir, %s: the loaded state's logits (positions 20..28) and ids equal a full "
          "replay's bit for bit",
          lab);
    k3_engine_close(&e);

    /* damage the file at 20 (one byte short; with workers: worker 1's):
     * refused, replayed, same ids */
    char cmd[700];
    snprintf(cmd, sizeof cmd,
             "for f in %s%s/*-00000020.k3ck; do truncate -s -1 \"$f\"; done; rm -f "
             "%s/*-00000012.k3ck",
             dir, local ? "/w1-4-8" : "", dir);
    rc = system(cmd);
    e = open_engine(2, local, NULL, 0, 0);
    st = rc == 0 && e ? gen(e, 8, turn3, 29, NULL, &t3, &r) : K3_ERR_STATE;
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 29 && t3.n == ref.n &&
              !memcmp(t3.v, ref.v, sizeof(int32_t) * (size_t)ref.n),
          "--ckpt-dir, %s: a file one byte short is refused (sizes checked), the prompt "
          "replayed: %d reused, same ids",
          lab, r.gen.n_reused);
    k3_engine_close(&e);
    if (local) { /* worker 0's file of another model (its fingerprint changed): refused */
        snprintf(cmd, sizeof cmd,
                 "for f in %s/w1-4-8/*-00000020.k3ck; do truncate -s +1 \"$f\"; done; for f in "
                 "%s/w0-0-4/*-00000020.k3ck; do printf '\\377' | dd of=\"$f\" bs=1 seek=8 "
                 "conv=notrunc status=none; done",
                 dir, dir);
        rc = system(cmd);
        e = open_engine(2, local, NULL, 0, 0);
        st = rc == 0 && e ? gen(e, 9, turn3, 29, NULL, &t3, &r) : K3_ERR_STATE;
        CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 29 && t3.n == ref.n &&
                  !memcmp(t3.v, ref.v, sizeof(int32_t) * (size_t)ref.n),
              "--ckpt-dir, --local 2: a worker file of another model is refused, the prompt "
              "replayed: %d reused, same ids",
              r.gen.n_reused);
        k3_engine_close(&e);
    }
    g_ckpt_dir = NULL;
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    rc = system(cmd);
    (void)rc;
    free(lg_ref.v);
    free(lg3.v);
}

/* --ckpt-dir with --local 2, a worker killed with -9 between turns: it
 * comes back in a new epoch without the session, and the edited turn's
 * RESTORE by key loads the checkpoint at 12 from its disk (the other worker
 * from memory): 12 reused, the logits and ids of the full replay. */
/* Turns 1 and 2 of the edit scenario on session 1 (t1, t2), then kill -9 of
 * stage 1's local worker and the wait for its restart in a new epoch and a
 * ready cluster. *killed / *epoch_changed say what happened; returns the
 * first error of the turns or the wait (werr names the wait's). */
static k3_status turns_then_kill(k3_engine *e, toks *t1, toks *t2, k3_engine_result *r, int *killed,
                                 int *epoch_changed, char *werr, size_t werrlen) {
    int32_t tw[12 + 3 + 5];
    k3_status st = gen(e, 1, A, 12, NULL, t1, r);
    memcpy(tw, A, sizeof A);
    memcpy(tw + 12, t1->v, 3 * sizeof(int32_t));
    memcpy(tw + 15, X, sizeof X);
    st = st ? st : gen(e, 1, tw, 20, NULL, t2, r);
    k3_cluster *cl = k3_engine_cluster(e);
    k3_stage_info si;
    k3_cluster_stage_info(cl, 1, &si);
    uint64_t ep0 = si.epoch;
    *killed = si.pid > 0 && kill(si.pid, SIGKILL) == 0;
    for (int i = 0; *killed && i < 400; i++) { /* the restart and its new epoch */
        k3_cluster_stage_info(cl, 1, &si);
        if (si.ready && si.epoch != ep0) break;
        usleep(25000);
    }
    *epoch_changed = si.epoch != ep0;
    k3_status ws = k3_cluster_wait_ready(cl, 10000, werr, werrlen);
    return st ? st : ws;
}

static void worker_restart_parked(void) {
    char dir[] = "/tmp/k3_test_ckpt_wdir_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    int32_t ay[12 + 7];
    memcpy(ay, A, sizeof A);
    memcpy(ay + 12, Y, sizeof Y);
    g_ckpt_dir = dir;
    k3_engine *e = open_engine(2, 2, NULL, 0, 0);
    g_ckpt_dir = NULL;
    if (!e) {
        rmdir(dir);
        return;
    }
    k3_engine_result r;
    toks t1, t2, t3;
    rows lg = {0};
    int killed = 0, moved = 0;
    char werr[512] = "";
    k3_status ws = turns_then_kill(e, &t1, &t2, &r, &killed, &moved, werr, sizeof werr);
    k3_status st = ws ? ws : gen(e, 1, ay, 19, &lg, &t3, &r);
    int same = st == K3_OK && lg.v && lg.lo == 12 && lg.hi == 19 &&
               !memcmp(lg.v + (size_t)12 * (size_t)lg.vocab,
                       g_ref_lg.v + (size_t)12 * (size_t)g_ref_lg.vocab,
                       sizeof(float) * 7 * (size_t)lg.vocab);
    CHECK(killed && ws == K3_OK && moved && st == K3_OK && r.gen.n_reused == 12 &&
              r.gen.n_prefilled == 7,
          "--ckpt-dir, --local 2, a worker killed with -9 between turns and restarted: the "
          "edited turn restores the checkpoint at 12 from its disk (%d reused, %d prefilled) (%s)",
          r.gen.n_reused, r.gen.n_prefilled, werr);
    CHECK(same && t3.n == g_ref.n && !memcmp(t3.v, g_ref.v, sizeof(int32_t) * (size_t)g_ref.n),
          "--ckpt-dir, --local 2, restarted worker: the logits of positions 12..18 and the ids "
          "equal the full replay's bit for bit");
    k3_engine_close(&e);
    free(lg.v);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    int rc = system(cmd);
    (void)rc;
}

static k3_status dump_zeros(void *ctx, FILE *f, char *err, size_t errlen) {
    size_t n = *(size_t *)ctx;
    for (size_t i = 0; i < n; i++)
        if (fputc(0, f) == EOF) return k3_errf(K3_ERR_IO, err, errlen, "write");
    return K3_OK;
}

static k3_status load_count(void *ctx, FILE *f, int pos, char *err, size_t errlen) {
    (void)pos, (void)err, (void)errlen;
    int n = 0;
    while (fgetc(f) != EOF) n++;
    *(int *)ctx = n;
    return K3_OK;
}

/* The store itself (common/engine/ckpt_store.h): bounds on files and bytes
 * (the oldest pruned), no .tmp left, a file refused for another key,
 * position, layer range or model, each naming the file. */
static void store_unit(void) {
    char dir[] = "/tmp/k3_test_ckpt_store_XXXXXX", err[768];
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    k3_ckpt_store *d = NULL;
    k3_status st =
        k3_ckpt_store_open(&d, dir, "--ckpt-dir", 0x1234, 0, 4, 3, 1 << 20, err, sizeof err);
    CHECK(st == K3_OK, "store: opens %s (%s)", dir, err);
    if (st) return;
    size_t pay = 100;
    int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int p = 1; p <= 5 && !st; p++) {
        st = k3_ckpt_store_save(d, k3_ckpt_key(0x1234, ids, p), p, NULL, pay, dump_zeros, &pay, err,
                                sizeof err);
        usleep(10000); /* distinct mtimes */
    }
    int nf = count_files(dir);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "ls -a %s | grep -c tmp", dir);
    FILE *pp = popen(cmd, "r");
    int ntmp = -1;
    if (pp && fscanf(pp, "%d", &ntmp) != 1) ntmp = -1;
    if (pp) pclose(pp);
    char path[K3_MAX_PATH + 40];
    int pos = 0;
    int found = k3_ckpt_store_find(d, ids, 8, 0, 64, path, sizeof path, &pos);
    int oldest = k3_ckpt_store_find(d, ids, 3, 0, 64, path, sizeof path, &pos); /* p < 3: gone */
    CHECK(st == K3_OK && nf == 3 && ntmp == 0 && found && !oldest,
          "store: 5 saves with 3 files kept leave the newest 3, no .tmp (%d files, %d tmp; %s)", nf,
          ntmp, err);
    k3_ckpt_store_find(d, ids, 8, 0, 64, path, sizeof path, &pos);
    int got = -1;
    st = k3_ckpt_store_load(d, path, k3_ckpt_key(0x1234, ids, 5), 5, NULL, pay, load_count, &got,
                            err, sizeof err);
    CHECK(st == K3_OK && pos == 5 && got == (int)pay,
          "store: the deepest (5) loads its %d payload bytes", got);
    st = k3_ckpt_store_load(d, path, k3_ckpt_key(0x1234, ids, 4), 5, NULL, pay, load_count, &got,
                            err, sizeof err);
    CHECK(st == K3_ERR_FORMAT && strstr(err, path) && strstr(err, "expected"),
          "store: another key refused naming the file: '%s'", err);
    st = k3_ckpt_store_load(d, path, k3_ckpt_key(0x1234, ids, 5), 5, NULL, pay + 4, load_count,
                            &got, err, sizeof err);
    CHECK(st == K3_ERR_FORMAT && strstr(err, "file bytes"),
          "store: another payload size refused before reading: '%s'", err);
    k3_ckpt_store *o = NULL;
    st = k3_ckpt_store_open(&o, dir, "--ckpt-dir", 0x1234, 4, 8, 3, 1 << 20, err, sizeof err);
    st = st ? st
            : k3_ckpt_store_load(o, path, k3_ckpt_key(0x1234, ids, 5), 5, NULL, pay, load_count,
                                 &got, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "layers [0, 4)"),
          "store: a file of layers [0, 4) refused by a store of [4, 8): '%s'", err);
    k3_ckpt_store_close(&o);
    st = k3_ckpt_store_open(&o, dir, "--ckpt-dir", 0x9999, 0, 4, 3, 1 << 20, err, sizeof err);
    st = st ? st
            : k3_ckpt_store_load(o, path, k3_ckpt_key(0x1234, ids, 5), 5, NULL, pay, load_count,
                                 &got, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "model fingerprint"),
          "store: a file of another model refused: '%s'", err);
    k3_ckpt_store_close(&o);
    /* a byte bound: 2 files of 148 bytes fit in 300, a third prunes one;
     * a payload larger than the bound is refused */
    st = k3_ckpt_store_open(&o, dir, "--ckpt-dir", 0x1234, 0, 4, 100, 300, err, sizeof err);
    if (!st)
        st = k3_ckpt_store_save(o, k3_ckpt_key(0x1234, ids, 6), 6, NULL, pay, dump_zeros, &pay, err,
                                sizeof err);
    nf = count_files(dir);
    size_t big = 400;
    k3_status sb = o ? k3_ckpt_store_save(o, k3_ckpt_key(0x1234, ids, 7), 7, NULL, big, dump_zeros,
                                          &big, err, sizeof err)
                     : K3_ERR_STATE;
    CHECK(st == K3_OK && nf == 2 && sb == K3_ERR_LIMIT && strstr(err, "larger than"),
          "store: 300 bytes kept hold 2 files of 148 (%d), a 448-byte one refused: '%s'", nf, err);
    k3_ckpt_store_close(&o);
    k3_ckpt_store_close(&d);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    int rc = system(cmd);
    (void)rc;
}

int main(void) {
    k3_log_init("test_ckpt");
    /* the full replay: a fresh session fed A + Y from position 0 */
    int32_t ay[12 + 7];
    memcpy(ay, A, sizeof A);
    memcpy(ay + 12, Y, sizeof Y);
    k3_engine *e = open_engine(2, 0, NULL, 0, 0);
    if (!e) return 1;
    k3_engine_result r;
    toks t1, t2, t3;
    k3_status st = gen(e, 9, ay, 19, &g_ref_lg, &g_ref, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 19,
          "full replay of A + Y: 19 prefilled");
    conversation(e, "in-process", 1);
    worker_table(k3_engine_model(e));
    k3_engine_close(&e);

    /* on 2 local workers over ipc: the checkpoints live on the workers */
    e = open_engine(2, 2, NULL, 0, 0);
    if (e) conversation(e, "--local 2 (ipc)", 1);
    k3_engine_close(&e);

    /* on 2 workers over tcp (this test's ports: 27100-27199) */
    char ep[2][64];
    const char *eps[2] = {ep[0], ep[1]};
    int port = 27100 + (int)(getpid() % 48) * 2;
    snprintf(ep[0], sizeof ep[0], "tcp://127.0.0.1:%d", port);
    snprintf(ep[1], sizeof ep[1], "tcp://127.0.0.1:%d", port + 1);
    pid_t pw[2] = {tcp_worker(0, 3, ep[0]), tcp_worker(3, 8, ep[1])};
    e = pw[0] && pw[1] ? open_engine(2, 0, eps, 2, 0) : NULL;
    if (e) conversation(e, "2 workers (tcp)", 1);
    k3_engine_close(&e);
    for (int i = 0; i < 2; i++)
        if (pw[i]) k3_worker_stop(pw[i], 2000);

    /* workers that hold one session: another session evicts the first, whose
     * edited turn then cannot restore (its state and checkpoints are gone on
     * the workers) and replays everything, to the same ids */
    e = open_engine(2, 2, NULL, 0, 1);
    if (e) {
        int32_t turn2[12 + 3 + 5];
        st = gen(e, 1, A, 12, NULL, &t1, &r);
        memcpy(turn2, A, sizeof A);
        memcpy(turn2 + 12, t1.v, 3 * sizeof(int32_t));
        memcpy(turn2 + 15, X, sizeof X);
        st = st ? st : gen(e, 1, turn2, 20, NULL, &t2, &r);
        st = st ? st : gen(e, 2, X, 5, NULL, &t2, &r);
        st = st ? st : gen(e, 1, ay, 19, NULL, &t3, &r);
        CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 19 && t3.n == g_ref.n &&
                  !memcmp(t3.v, g_ref.v, sizeof(int32_t) * (size_t)g_ref.n),
              "--local 2, workers holding 1 session: the evicted session's edited turn replays "
              "(%d reused, %d prefilled), same ids",
              r.gen.n_reused, r.gen.n_prefilled);
    }
    k3_engine_close(&e);

    store_unit();
    parked(0);
    parked(2);
    worker_restart_parked();

    /* a worker killed with -9 between turns: the local worker comes back in
     * a new epoch without the session's state or checkpoints, so the
     * edited turn's RESTORE is not even sent (the epoch says so) and the
     * conversation replays, to the same ids */
    e = open_engine(2, 2, NULL, 0, 0);
    if (e) {
        int killed = 0, moved = 0;
        char werr[512] = "";
        k3_status ws = turns_then_kill(e, &t1, &t2, &r, &killed, &moved, werr, sizeof werr);
        st = ws ? ws : gen(e, 1, ay, 19, NULL, &t3, &r);
        CHECK(killed && ws == K3_OK && moved && st == K3_OK && r.gen.n_reused == 0 &&
                  r.gen.n_prefilled == 19 && t3.n == g_ref.n &&
                  !memcmp(t3.v, g_ref.v, sizeof(int32_t) * (size_t)g_ref.n),
              "--local 2, a worker killed with -9 between turns and restarted (new epoch): the "
              "edited turn replays (%d reused, %d prefilled), same ids (%s)",
              r.gen.n_reused, r.gen.n_prefilled, werr);
    }
    k3_engine_close(&e);

    /* without checkpoints the same edit prefills the whole conversation */
    e = open_engine(0, 0, NULL, 0, 0);
    if (!e) return 1;
    st = gen(e, 1, A, 12, NULL, &t1, &r);
    int32_t turn2[12 + 3 + 5];
    memcpy(turn2, A, sizeof A);
    memcpy(turn2 + 12, t1.v, 3 * sizeof(int32_t));
    memcpy(turn2 + 15, X, sizeof X);
    st = st ? st : gen(e, 1, turn2, 20, NULL, &t2, &r);
    rows lg0 = {0};
    st = st ? st : gen(e, 1, ay, 19, &lg0, &t3, &r);
    CHECK(st == K3_OK && r.gen.n_reused == 0 && r.gen.n_prefilled == 19 && lg0.v &&
              !memcmp(lg0.v, g_ref_lg.v, sizeof(float) * 19 * (size_t)lg0.vocab),
          "--ckpt 0: the edited turn prefills all 19 tokens (%d reused), same logits",
          r.gen.n_reused);
    free(lg0.v);
    free(g_ref_lg.v);
    k3_engine_close(&e);
    TEST_MAIN_END();
}
