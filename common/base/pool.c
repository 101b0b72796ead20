/* common/base/pool.c: see pool.h.
 *
 * One job at a time. The caller publishes a job as a 64-bit ticket
 * (generation << 32 | tasks left) and bumps a 32-bit generation word that
 * idle workers watch (spinning, then yielding, then sleeping in futex). Every
 * thread, the caller included, claims tasks by a compare-and-swap on the
 * ticket that also checks the generation, so a worker that wakes late for an
 * old job can never take a task of the next one. Each finished task
 * increments `done`; the caller returns when done == n_tasks. Workers do not
 * have to wake at all for a job the others finish first, so a short job
 * costs no futex round trip.
 *
 * Several threads may call k3_pool_run on one pool (sessions running on one
 * model): they take turns job by job in arrival order through a ticket lock
 * (turn_next / turn_now), spinning, yielding and then sleeping in futex like
 * the workers. A job's publication words are written only by the caller
 * holding the turn. FIFO turns keep two callers' jobs alternating; with a
 * plain mutex the thread that just released it would usually take it back
 * before the sleeper woke, and the other session would stall until the
 * first left the pool for longer than a wake-up.
 *
 * Hot words sit on their own 64-byte lines (no false sharing between the
 * caller's publication and the workers' counters). All hand-offs go through
 * C11 atomics with acquire/release (the futex is only a sleep), which keeps
 * ThreadSanitizer able to see every happens-before edge.
 */
#include "common/base/pool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/base/limits.h"

/* How an idle thread waits (for a job, for the other threads' tasks, for
 * its turn): POOL_SPIN_NS of pause-spinning, then sched_yield until
 * POOL_YIELD_NS, then futex sleep.
 *
 * Why the yield phase (issue 21; docs/PERFORMANCE.md, "Wave 2, seventh
 * session"): in a matmul split over 2 threads, whichever thread finishes
 * its share first waits for the other, and on a shared VM the two shares
 * of a 0.3-2 ms call differ by tens to hundreds of microseconds. With 50 us
 * of spin and then sleep, the early thread often slept, and waking a
 * sleeping vCPU costs 50-100 us: the busiest thread was in a task 86-89 %
 * of the wall time, and 2 threads read 0.84-0.86 of STREAM on int8. Spun
 * or yielded through, 0.96-0.98 and 0.88-0.93. A yielding thread stays
 * runnable (its vCPU never halts, so nothing has to wake it) but gives its
 * CPU to any other runnable thread, which matters where worker processes
 * share cores (local clusters, the tests); pure spinning for milliseconds
 * would take that time from them. Past 2 ms the pool is idle: sleep. */
#define POOL_SPIN_NS  50000
#define POOL_YIELD_NS 2000000

struct k3_pool {
    /* written by the caller holding the turn only (before publishing the ticket) */
    _Alignas(64) _Atomic(k3_pool_fn) fn;
    _Atomic(void *) ctx;
    atomic_int n_tasks;
    uint32_t gen_next;     /* turn holder's: generation of the next job */
    int n_threads;         /* total, caller included */
    atomic_llong yield_ns; /* end of the yield phase (POOL_YIELD_NS; k3_pool_set_yield) */
    int n_started;         /* worker threads actually created */
    pthread_t *threads;    /* [n_threads - 1], owned */

    _Alignas(64) _Atomic uint64_t ticket; /* gen << 32 | tasks not yet claimed */
    _Alignas(64) atomic_uint gen;         /* futex word idle workers wait on */
    _Alignas(64) atomic_int done;         /* tasks finished in the current job */
    _Alignas(64) atomic_int sleepers;     /* workers blocked in futex(gen) */
    atomic_int caller_waiting;            /* caller blocked in futex(done) */
    atomic_int stop;                      /* set by k3_pool_close */

    /* callers' turns: a caller takes ticket turn_next++ and runs its job
     * when turn_now reaches it; turn_now is also the futex word they sleep on */
    _Alignas(64) atomic_uint turn_next;
    _Alignas(64) atomic_uint turn_now;
    atomic_int turn_sleepers; /* callers blocked in futex(turn_now) */
};

/* The pool whose job this thread is running tasks of (a worker: its own pool
 * for life; a caller: while its job runs), NULL otherwise. A task that calls
 * back into that pool would wait for the turn its own job holds. */
static _Thread_local const k3_pool *tl_pool;

static void futex_wait(void *addr, uint32_t expect) {
    /* EAGAIN (value changed) and EINTR both just send us back to re-check. */
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, expect, NULL, NULL, 0);
}

static void futex_wake(void *addr, int n) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* One step of a wait whose event has not come: spin (pause) for the first
 * POOL_SPIN_NS, then yield the CPU until yield_ns (the pool's; POOL_YIELD_NS
 * unless k3_pool_set_yield changed it); returns 0 when the
 * waiter should sleep in futex instead. The clock is read once per 64
 * pauses, and at every yield (a system call costs more than the read). */
typedef struct {
    int64_t t0, yield_ns;
    int i, yielding;
} wait_state;

static wait_state wait_begin(k3_pool *p) {
    return (wait_state){.t0 = mono_ns(),
                        .yield_ns = atomic_load_explicit(&p->yield_ns, memory_order_relaxed)};
}

static int wait_step(wait_state *w) {
    if (!w->yielding) {
        cpu_relax();
        if ((++w->i & 63) != 0) return 1;
        w->yielding = mono_ns() - w->t0 > POOL_SPIN_NS;
        return 1;
    }
    if (mono_ns() - w->t0 > w->yield_ns) return 0;
    sched_yield();
    return 1;
}

/* Claims and runs tasks of job `gen` until none is left. The job's fn/ctx
 * are read only after a successful claim: from then on the job cannot end
 * (and be replaced) before this thread's task is done. */
static void pool_work(k3_pool *p, uint32_t gen) {
    k3_pool_fn fn = NULL;
    void *ctx = NULL;
    int n_tasks = 0;
    for (;;) {
        uint64_t t = atomic_load_explicit(&p->ticket, memory_order_acquire);
        for (;;) {
            if ((uint32_t)(t >> 32) != gen || (uint32_t)t == 0) return;
            if (atomic_compare_exchange_weak_explicit(&p->ticket, &t, t - 1, memory_order_acq_rel,
                                                      memory_order_acquire))
                break;
        }
        int task = (int)(uint32_t)t - 1;
        if (!fn) {
            fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
            ctx = atomic_load_explicit(&p->ctx, memory_order_relaxed);
            n_tasks = atomic_load_explicit(&p->n_tasks, memory_order_relaxed);
        }
        /* Tasks are handed out from the top; order is not part of the contract. */
        fn(ctx, n_tasks - 1 - task);
        int d = atomic_fetch_add_explicit(&p->done, 1, memory_order_seq_cst) + 1;
        if (d == n_tasks && atomic_load_explicit(&p->caller_waiting, memory_order_seq_cst))
            futex_wake(&p->done, 1);
    }
}

static void *pool_worker(void *arg) {
    k3_pool *p = arg;
    uint32_t seen = 0; /* generation of the last job this thread looked at */
    tl_pool = p;
    for (;;) {
        uint32_t g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g == seen) {
            wait_state w = wait_begin(p);
            while (g == seen && wait_step(&w))
                g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        if (g == seen) {
            /* Dekker with k3_pool_run: sleepers++ then re-read gen, versus
             * gen++ then read sleepers (both seq_cst): one side sees the other. */
            atomic_fetch_add_explicit(&p->sleepers, 1, memory_order_seq_cst);
            while ((g = atomic_load_explicit(&p->gen, memory_order_seq_cst)) == seen)
                futex_wait(&p->gen, seen);
            atomic_fetch_sub_explicit(&p->sleepers, 1, memory_order_relaxed);
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        pool_work(p, g);
    }
    return NULL;
}

k3_status k3_pool_open(k3_pool **out, int n_threads, char *err, size_t errlen) {
    *out = NULL;
    if (n_threads < 1 || n_threads > K3_MAX_THREADS)
        return k3_errf(K3_ERR_ARG, err, errlen, "thread pool: n_threads %d not in [1, %d]",
                       n_threads, K3_MAX_THREADS);
    k3_pool *p = k3_xaligned(64, sizeof *p);
    memset(p, 0, sizeof *p);
    p->n_threads = n_threads;
    atomic_init(&p->yield_ns, POOL_YIELD_NS);
    p->gen_next = 1;
    p->threads = k3_xcalloc((size_t)n_threads, sizeof *p->threads);
    for (int i = 0; i < n_threads - 1; i++) {
        int rc = pthread_create(&p->threads[i], NULL, pool_worker, p);
        if (rc != 0) {
            k3_pool_close(&p);
            return k3_errf(K3_ERR_INTERNAL, err, errlen,
                           "thread pool: pthread_create for worker %d of %d: %s", i + 1,
                           n_threads - 1, strerror(rc));
        }
        char name[16];
        snprintf(name, sizeof name, "k3-pool-%u", (unsigned)(i + 1) % 1000u);
        pthread_setname_np(p->threads[i], name);
        p->n_started++;
    }
    *out = p;
    return K3_OK;
}

void k3_pool_close(k3_pool **pool) {
    if (!pool || !*pool) return;
    k3_pool *p = *pool;
    atomic_store_explicit(&p->stop, 1, memory_order_release);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_seq_cst);
    futex_wake(&p->gen, INT_MAX);
    for (int i = 0; i < p->n_started; i++) pthread_join(p->threads[i], NULL);
    free(p->threads);
    free(p);
    *pool = NULL;
}

int k3_pool_threads(const k3_pool *pool) { return pool ? pool->n_threads : 1; }

void k3_pool_set_yield(k3_pool *pool, int yield_us) {
    if (!pool) return;
    const int64_t ns = yield_us < 0 ? 0 : (int64_t)yield_us * 1000;
    atomic_store_explicit(&pool->yield_ns, ns > POOL_SPIN_NS ? ns : POOL_SPIN_NS,
                          memory_order_relaxed);
}

/* Waits for this caller's turn: a ticket, then spin, yield, then sleep until
 * turn_now reaches it. The acquire load pairs with turn_end's release, so
 * the previous holder's writes (gen_next, the job words) are visible. */
static void turn_begin(k3_pool *p) {
    uint32_t mine = atomic_fetch_add_explicit(&p->turn_next, 1, memory_order_relaxed);
    uint32_t now = atomic_load_explicit(&p->turn_now, memory_order_acquire);
    if (now == mine) return;
    wait_state w = wait_begin(p);
    while (now != mine && wait_step(&w))
        now = atomic_load_explicit(&p->turn_now, memory_order_acquire);
    if (now == mine) return;
    /* Dekker with turn_end: sleepers++ then re-read turn_now, versus
     * turn_now++ then read sleepers (all seq_cst): one side sees the other. */
    atomic_fetch_add_explicit(&p->turn_sleepers, 1, memory_order_seq_cst);
    while ((now = atomic_load_explicit(&p->turn_now, memory_order_seq_cst)) != mine)
        futex_wait(&p->turn_now, now);
    atomic_fetch_sub_explicit(&p->turn_sleepers, 1, memory_order_relaxed);
}

/* Passes the turn to the next ticket. Every sleeper wakes and re-checks:
 * sleepers are the callers queued behind this one (a handful at most). */
static void turn_end(k3_pool *p) {
    atomic_fetch_add_explicit(&p->turn_now, 1, memory_order_seq_cst);
    if (atomic_load_explicit(&p->turn_sleepers, memory_order_seq_cst) > 0)
        futex_wake(&p->turn_now, INT_MAX);
}

void k3_pool_run(k3_pool *pool, k3_pool_fn fn, void *ctx, int n_tasks) {
    if (n_tasks <= 0) return;
    if (!pool || pool->n_threads == 1 || n_tasks == 1) {
        for (int i = 0; i < n_tasks; i++) fn(ctx, i);
        return;
    }
    k3_pool *p = pool;
    /* A task calling back into its own pool would wait forever for the turn
     * its job holds: refuse loudly. */
    K3_ASSERT(tl_pool != p);
    turn_begin(p);
    const k3_pool *outer = tl_pool; /* a task of another pool's job may call us */
    tl_pool = p;

    uint32_t gen = p->gen_next++;
    if (gen == 0) gen = p->gen_next++; /* 0 is the workers' initial "seen" */
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&p->n_tasks, n_tasks, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->ticket, (uint64_t)gen << 32 | (uint32_t)n_tasks,
                          memory_order_release);
    atomic_store_explicit(&p->gen, gen, memory_order_seq_cst);
    if (atomic_load_explicit(&p->sleepers, memory_order_seq_cst) > 0) {
        int want = n_tasks - 1 < p->n_threads - 1 ? n_tasks - 1 : p->n_threads - 1;
        futex_wake(&p->gen, want);
    }

    pool_work(p, gen);

    /* Wait for tasks other threads still run: spin, yield, then sleep on `done`. */
    int d = atomic_load_explicit(&p->done, memory_order_acquire);
    if (d != n_tasks) {
        wait_state w = wait_begin(p);
        while (d != n_tasks && wait_step(&w))
            d = atomic_load_explicit(&p->done, memory_order_acquire);
    }
    if (d != n_tasks) {
        atomic_store_explicit(&p->caller_waiting, 1, memory_order_seq_cst);
        while ((d = atomic_load_explicit(&p->done, memory_order_seq_cst)) != n_tasks)
            futex_wait(&p->done, (uint32_t)d);
        atomic_store_explicit(&p->caller_waiting, 0, memory_order_relaxed);
    }
    tl_pool = outer;
    turn_end(p);
}
