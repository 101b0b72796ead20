/* tests/test_pool.c: the thread pool (common/base/pool.h).
 *
 * Every task runs exactly once per k3_pool_run, across many runs, task
 * counts from 0 to far more than threads, pool sizes 1..4 and the NULL pool;
 * k3_pool_run returns only when all tasks are done; runs after an idle pause
 * (workers asleep in futex) still complete; argument errors are reported.
 * The idle wait: for the yield window (2 ms, k3_pool_set_yield) idle
 * workers stay runnable (state R in /proc/self/task), after it they sleep
 * (state S); with a window of 0 they sleep after the 50 us spin.
 */
#include <dirent.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/pool.h"
#include "tests/test.h"

typedef struct {
    atomic_int *hits; /* [n_tasks] times each task ran */
    atomic_int ran;   /* total calls */
    int slow;         /* sleep in some tasks, so others overtake */
} job;

static void task_fn(void *ctx, int task) {
    job *j = ctx;
    if (j->slow && task % 7 == 0) {
        struct timespec ts = {0, 200000}; /* 0.2 ms */
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&j->hits[task], 1);
    atomic_fetch_add(&j->ran, 1);
}

/* Runs `runs` jobs of n_tasks on pool; returns the number of runs in which
 * some task did not run exactly once (checked right after k3_pool_run
 * returned, so late tasks count as failures). */
static int exercise(k3_pool *pool, int runs, int n_tasks, int slow) {
    atomic_int *hits = calloc((size_t)(n_tasks > 0 ? n_tasks : 1), sizeof *hits);
    int bad_runs = 0;
    for (int r = 0; r < runs; r++) {
        job j = {.hits = hits, .slow = slow};
        for (int i = 0; i < n_tasks; i++) atomic_store(&hits[i], 0);
        k3_pool_run(pool, task_fn, &j, n_tasks);
        int ok = atomic_load(&j.ran) == (n_tasks > 0 ? n_tasks : 0);
        for (int i = 0; i < n_tasks; i++) ok &= atomic_load(&hits[i]) == 1;
        bad_runs += !ok;
    }
    free(hits);
    return bad_runs;
}

/* The pool's worker threads (named k3-pool-N) by scheduler state, from
 * /proc/self/task/TID/stat: *run = R (running or runnable: spinning or
 * yielding), returns the number of workers seen. */
static int worker_states(int *run) {
    int n = 0;
    *run = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[320], buf[256];
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        const size_t got = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[got] = 0;
        const char *close = strrchr(buf, ')');
        if (!strstr(buf, "(k3-pool-") || !close || close[1] != ' ') continue;
        n++;
        *run += close[2] == 'R';
    }
    closedir(d);
    return n;
}

/* After a run, pause pause_ms and read the workers' states; tries up to 20
 * times for a reading taken within [lo_ms, hi_ms] of the run's end (a
 * loaded machine may oversleep). Returns runnable workers, or -1. */
static int runnable_after(k3_pool *p, double pause_ms, double lo_ms, double hi_ms) {
    for (int t = 0; t < 20; t++) {
        exercise(p, 1, 8, 0);
        const double t0 = k3_now_s() * 1e3;
        struct timespec ts = {0, (long)(pause_ms * 1e6)};
        nanosleep(&ts, NULL);
        int run = 0;
        const int n = worker_states(&run);
        const double dt = k3_now_s() * 1e3 - t0;
        if (n == k3_pool_threads(p) - 1 && dt >= lo_ms && dt <= hi_ms) return run;
    }
    return -1;
}

/* Per-task results written to distinct slots: the same whatever thread ran
 * which task (the property the kernels rely on). */
typedef struct {
    double *out;
} sum_job;

static void sum_task(void *ctx, int task) {
    sum_job *j = ctx;
    double s = 0;
    for (int i = 0; i < 1000; i++) s += 1.0 / (double)(task * 1000 + i + 1);
    j->out[task] = s;
}

int main(void) {
    char err[256];
    k3_pool *p = NULL;

    CHECK(k3_pool_open(&p, 0, err, sizeof err) == K3_ERR_ARG && p == NULL,
          "n_threads 0 rejected: %s", err);
    CHECK(k3_pool_open(&p, K3_MAX_THREADS + 1, err, sizeof err) == K3_ERR_ARG && p == NULL,
          "n_threads %d rejected: %s", K3_MAX_THREADS + 1, err);
    CHECK(k3_pool_threads(NULL) == 1, "NULL pool has 1 thread");
    CHECK(exercise(NULL, 50, 37, 0) == 0, "NULL pool: 50 runs x 37 tasks, each task once");
    CHECK(exercise(NULL, 5, 0, 0) == 0, "NULL pool: 0 tasks is a no-op");
    k3_pool_close(&p); /* NULL: no-op */
    CHECK(p == NULL, "k3_pool_close(NULL) is a no-op");

    double ref[257];
    sum_job sj0 = {.out = ref};
    k3_pool_run(NULL, sum_task, &sj0, 257);

    for (int nt = 1; nt <= 4; nt++) {
        k3_status st = k3_pool_open(&p, nt, err, sizeof err);
        CHECK(st == K3_OK && p && k3_pool_threads(p) == nt, "open pool of %d threads", nt);
        if (st != K3_OK) continue;
        static const int counts[] = {0, 1, 2, 3, 4, 5, 8, 63, 64, 1000};
        int bad = 0;
        for (size_t c = 0; c < sizeof counts / sizeof *counts; c++)
            bad += exercise(p, 300, counts[c], 0);
        CHECK(bad == 0,
              "%d threads: 300 runs each of 0..1000 tasks, every task exactly once (%d bad)", nt,
              bad);
        CHECK(exercise(p, 20, 50, 1) == 0,
              "%d threads: tasks of uneven length, run returns only when all are done", nt);
        /* let the workers fall asleep in futex, then run again */
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
        CHECK(exercise(p, 3, 16, 0) == 0, "%d threads: runs after an idle pause (workers asleep)",
              nt);
        double out[257];
        sum_job sj = {.out = out};
        int same = 1;
        for (int r = 0; r < 20; r++) {
            memset(out, 0, sizeof out);
            k3_pool_run(p, sum_task, &sj, 257);
            same &= !memcmp(out, ref, sizeof ref);
        }
        CHECK(same, "%d threads: per-task results identical to the serial run (memcmp)", nt);
        /* many quick runs: the spin/sleep handshake under churn */
        CHECK(exercise(p, 20000, 3, 0) == 0, "%d threads: 20000 runs of 3 tasks", nt);
        k3_pool_close(&p);
        CHECK(p == NULL, "%d threads: close joins and nulls the pointer", nt);
    }

    /* the idle wait: runnable through the yield window, then asleep */
    const k3_status st3 = k3_pool_open(&p, 3, err, sizeof err);
    CHECK(st3 == K3_OK, "open a pool of 3 threads for the idle-wait checks");
    if (st3 == K3_OK) {
        int run = runnable_after(p, 0.3, 0.0, 1.5);
        CHECK(run == 2, "idle workers stay runnable 0.3 ms after a run (yielding): %d of 2", run);
        run = runnable_after(p, 20, 20, 500);
        CHECK(run == 0, "idle workers sleep 20 ms after a run: %d of 2 still runnable", run);
        k3_pool_set_yield(p, 0);
        run = runnable_after(p, 3, 3, 500);
        CHECK(run == 0, "yield window 0: workers asleep 3 ms after a run: %d of 2 runnable", run);
        CHECK(exercise(p, 2000, 9, 1) == 0,
              "yield window 0: 2000 runs with slow tasks (threads sleep mid-run), each task once");
        k3_pool_set_yield(p, 50000);
        run = runnable_after(p, 10, 10, 40);
        CHECK(run == 2, "yield window 50 ms: workers runnable 10 ms after a run: %d of 2", run);
        k3_pool_set_yield(NULL, 0); /* no-op */
        k3_pool_close(&p);
    }

    /* open/close churn with no runs, and close right after a run */
    int ok = 1;
    for (int i = 0; i < 50; i++) {
        ok &= k3_pool_open(&p, 1 + i % 4, err, sizeof err) == K3_OK;
        if (i % 2) ok &= exercise(p, 1, 9, 0) == 0;
        k3_pool_close(&p);
    }
    CHECK(ok, "50 open/close cycles, with and without a run");
    TEST_MAIN_END();
}
