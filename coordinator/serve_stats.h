/* coordinator/serve_stats.h: the numbers `k3-coordinator serve` reports:
 * the per-worker part of GET /health (JSON) and GET /metrics (Prometheus
 * text format 0.0.4), docs/SERVING.md "Health and metrics".
 *
 * Owns: the server's counters (serve_metrics), summed from every finished
 * generation's serve_job_stats.
 * Borrows: the engine (its cluster's per-stage statistics, or the
 * in-process expert store) and the engine options (model and shard
 * directories) while rendering.
 * Threads: the counters are guarded by the caller's lock (the server's);
 * rendering reads a copy and may run on any connection thread.
 */
#ifndef K3_SERVE_STATS_H
#define K3_SERVE_STATS_H

#include <jansson.h>
#include <stdint.h>

#include "common/engine/engine_opts.h"
#include "coordinator/engine.h"
#include "coordinator/serve_api.h"

typedef struct serve_metrics {
    uint64_t http_requests;     /* every HTTP request answered */
    uint64_t generations;       /* generations that ran (ended, for any reason) */
    uint64_t rejected_queue;    /* 429: --max-queue full */
    uint64_t queued;            /* admitted after waiting for a running slot */
    uint64_t left_waiting;      /* clients that left while waiting for a slot */
    uint64_t cancelled, failed; /* the client went away; the engine failed */
    uint64_t prompt_tokens;     /* prompt tokens of every generation */
    uint64_t cached_tokens;     /* of which reused from a session (no prefill) */
    uint64_t prefill_tokens;    /* tokens prefilled */
    uint64_t completion_tokens; /* tokens generated */
    uint64_t decode_steps;      /* decode forward steps */
    double prefill_s, decode_s; /* wall time of prefills, of decode steps */
    double ttft_s;              /* time to first token, summed over ttft_n */
    uint64_t ttft_n;
    double inproc_busy_s;       /* in-process trunk: compute time of every step */
    uint64_t inproc_bytes_read; /* in-process: expert bytes read */
    uint64_t inproc_hits, inproc_misses;
} serve_metrics;

/* Adds one finished generation (caller holds the lock). */
void serve_metrics_add(serve_metrics *m, const serve_job_stats *st);

/* The "workers" array of /health: one object per stage in layer order
 * {"index","endpoint","layers":[first,last],"dirs":[..],"numa","alive",
 * "busy_s","hit_rate","gb_read"} plus "name", "failures" and, for a live
 * worker, "sessions" (the states it holds, asked with STATS), or one
 * pseudo-worker "in-process". numa
 * is -1 when the worker is not pinned to a node (or does not say).
 * *hit_rate and *gb_read get the totals over every worker. */
json_t *serve_workers_json(k3_engine *e, const k3_engine_opts *eng, const serve_metrics *m,
                           double *hit_rate, double *gb_read);

/* The /metrics text (malloc'd): every family of serve_stats.c's one table
 * that applies (counters of m, the queue: running of max_running, waiting of
 * max_queue, sessions; per stage busy seconds and expert bytes; the Vulkan
 * tier; with workers, expert striping and their tiers), in its order. */
char *serve_metrics_text(k3_engine *e, const serve_metrics *m, int running, int max_running,
                         int waiting, int max_queue);

#endif
