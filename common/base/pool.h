/* common/base/pool.h: a fixed thread pool for data-parallel loops (rows of a
 * matmul, heads of an attention layer).
 *
 * Owns its threads. k3_pool_run(pool, fn, ctx, n_tasks) calls fn(ctx, task)
 * for every task in [0, n_tasks) across the pool's threads plus the calling
 * thread and returns when all are done. Which thread runs which task is not
 * defined, so fn must make each task's result independent of the others'
 * timing: kernels split rows, never a single sum, and so results are the same
 * bits whatever the thread count. A NULL pool runs the tasks serially on the
 * caller.
 *
 * Threads: any number of threads may call k3_pool_run on one pool at once.
 * The pool runs one job at a time: concurrent callers take turns job by job,
 * first come first served, each waiting (spin, yield, then futex sleep) while
 * another's job runs; an uncontended turn costs two atomic operations. So
 * the callers' jobs interleave and what they do between jobs runs in
 * parallel. A task must not call k3_pool_run on its own pool (asserted: it
 * would wait for the turn its own job holds); calling another pool is fine.
 */
#ifndef K3_POOL_H
#define K3_POOL_H

#include <stddef.h>

#include "common/base/err.h"

typedef struct k3_pool k3_pool;
typedef void (*k3_pool_fn)(void *ctx, int task);

/* n_threads total workers including the caller (>= 1, <= K3_MAX_THREADS). */
k3_status k3_pool_open(k3_pool **out, int n_threads, char *err, size_t errlen);
void k3_pool_close(k3_pool **pool);
int k3_pool_threads(const k3_pool *pool); /* 1 for NULL */
/* How long an idle thread of this pool waits runnable (spinning, then
 * yielding its CPU) before it sleeps in futex: yield_us microseconds, at
 * least the 50 us spin; 2000 from k3_pool_open. 0 gives the pool of before
 * 2026-12-03 (50 us, then sleep): bench_kernels_threads --sleep compares. */
void k3_pool_set_yield(k3_pool *pool, int yield_us);
void k3_pool_run(k3_pool *pool, k3_pool_fn fn, void *ctx, int n_tasks);

#endif
