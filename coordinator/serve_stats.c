/* coordinator/serve_stats.c: /health's workers and /metrics (serve_stats.h).
 *
 * Per-stage numbers come from the cluster's own accounting of every step
 * (k3_cluster_stage_info: worker-measured compute time, expert bytes and
 * hits as FORWARD_DONE reports them), so rendering costs no round trip to
 * the workers. In-process, the one pseudo-worker sums the steps of the
 * generations that ran (serve_metrics).
 */
#include "coordinator/serve_stats.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/base/strbuf.h"
#include "common/engine/model.h"
#include "common/vk/vk_tier.h"
#include "coordinator/cluster.h"

void serve_metrics_add(serve_metrics *m, const serve_job_stats *st) {
    m->generations++;
    m->cancelled += st->cancelled != 0;
    m->failed += st->failed != 0;
    m->prompt_tokens += (uint64_t)st->n_prompt;
    m->cached_tokens += (uint64_t)st->n_reused;
    m->prefill_tokens += (uint64_t)st->n_prefilled;
    m->completion_tokens += (uint64_t)st->n_gen;
    m->decode_steps += (uint64_t)st->n_decode_steps;
    m->prefill_s += st->prefill_ms / 1000.0;
    m->decode_s += st->decode_ms / 1000.0;
    if (st->ttft_ms > 0) {
        m->ttft_s += st->ttft_ms / 1000.0;
        m->ttft_n++;
    }
    m->inproc_busy_s += st->step.compute_ms / 1000.0;
    m->inproc_bytes_read += st->step.bytes_read;
    m->inproc_hits += st->step.expert_hits;
    m->inproc_misses += st->step.expert_misses;
}

static double hit_rate(uint64_t hits, uint64_t misses) {
    return hits + misses ? (double)hits / (double)(hits + misses) : 0.0;
}

/* The model directory and the extra shard directories. */
static json_t *dirs_json(const k3_engine_opts *eng) {
    json_t *a = json_array();
    json_array_append_new(a, json_string(eng->model));
    for (int i = 0; i < eng->dirs.n; i++) json_array_append_new(a, json_string(eng->dirs.items[i]));
    return a;
}

json_t *serve_workers_json(k3_engine *e, const k3_engine_opts *eng, const serve_metrics *m,
                           double *hit_rate_all, double *gb_read) {
    json_t *ws = json_array();
    k3_cluster *c = k3_engine_cluster(e);
    if (!c) {
        *hit_rate_all = hit_rate(m->inproc_hits, m->inproc_misses);
        *gb_read = (double)m->inproc_bytes_read / 1e9;
        int a = 0, b = 0;
        k3_model_range(k3_engine_model(e), &a, &b);
        json_array_append_new(ws, json_pack("{s:i,s:s,s:[i,i],s:o,s:i,s:b,s:f,s:f,s:f}", "index", 0,
                                            "endpoint", "in-process", "layers", a, b - 1, "dirs",
                                            dirs_json(eng), "numa", -1, "alive", 1, "busy_s",
                                            m->inproc_busy_s, "hit_rate",
                                            hit_rate(m->inproc_hits, m->inproc_misses), "gb_read",
                                            (double)m->inproc_bytes_read / 1e9));
        return ws;
    }
    uint64_t hits = 0, misses = 0, bytes = 0;
    for (int i = 0; i < k3_cluster_stages(c); i++) {
        k3_stage_info s;
        k3_cluster_stage_info(c, i, &s);
        hits += s.hits;
        misses += s.misses;
        bytes += s.bytes_read;
        /* local workers open the coordinator's directories; remote ones do
         * not say theirs (HELLO_OK has no such field) */
        json_t *dirs = s.pid ? dirs_json(eng) : json_array();
        json_array_append_new(
            ws, json_pack("{s:i,s:s,s:s,s:[i,i],s:o,s:i,s:b,s:f,s:f,s:f,s:I}", "index", i,
                          "endpoint", s.endpoint, "name", s.name, "layers", s.layer_a,
                          s.layer_b - 1, "dirs", dirs, "numa", -1, "alive", s.ready, "busy_s",
                          s.busy_ms / 1000.0, "hit_rate", hit_rate(s.hits, s.misses), "gb_read",
                          (double)s.bytes_read / 1e9, "failures", (json_int_t)s.failures));
        /* the session states the worker holds now: a STATS round trip (a
         * live worker only; a wedged one costs up to the step timeout) */
        proto_stats_ok so;
        char err[256];
        if (s.ready && k3_cluster_worker_stats(c, i, &so, err, sizeof err) == K3_OK)
            json_object_set_new(json_array_get(ws, json_array_size(ws) - 1), "sessions",
                                json_integer((json_int_t)so.sessions));
    }
    *hit_rate_all = hit_rate(hits, misses);
    *gb_read = (double)bytes / 1e9;
    return ws;
}

/* ---- /metrics: one table of families ---------------------------------------- */

/* What one scrape reads, taken once so that all its families show the same
 * moment. */
typedef struct metrics_now {
    serve_metrics m;                              /* the server's counters, a copy */
    double prefill_tps;                           /* prefill tokens / prefill seconds, 0 = none */
    double decode_tps;                            /* decode steps / decode seconds, 0 = none */
    int waiting, max_queue, running, max_running; /* the queue now (serve.c's counts) */
    int sessions;                                 /* sessions held, idle or running */
    k3_vk_tier_stats vk;                          /* the in-process Vulkan tier's, if any */
} metrics_now;

/* One stage: the cluster's accounting of its worker, or the in-process
 * pseudo-stage (busy time and bytes summed in serve_metrics.inproc_*). */
typedef struct stage_now {
    k3_stage_info s;
    double busy_s;    /* compute time, seconds */
    double hit_ratio; /* expert hits / (hits + misses), 0 before any */
} stage_now;

/* When a family is shown, what its samples are labelled with and where its
 * value is read. */
typedef enum metric_group {
    MG_SERVER,   /* always; one sample, no labels; metrics_now */
    MG_STAGE,    /* always; {stage, layers} per stage (in-process: one); stage_now */
    MG_VK,       /* in-process with a Vulkan tier (docs/VULKAN.md "Stats"); metrics_now */
    MG_DRIVE,    /* with workers; {stage, drive} per placement drive the stage reported
                    (docs/CLUSTER.md "Expert striping"); a uint64_t [K3_MAX_DIRS] of stage_now */
    MG_STRIPE,   /* with workers; {stage}; stage_now */
    MG_VK_STAGE, /* with workers once a stage reported a tier (FORWARD_DONE's vk_* sums);
                    {stage, layers}; stage_now */
    MG_COUNT
} metric_group;

/* The field's C type; MK_MS is a double in milliseconds shown in seconds. */
typedef enum metric_kind { MK_U64, MK_U32, MK_INT, MK_F64, MK_MS } metric_kind;

typedef struct metric_family {
    metric_group group;
    const char *name, *type, *help;
    metric_kind kind;
    size_t off; /* of the value in metrics_now or stage_now (the group says which) */
} metric_family;

/* Every family in output order (docs/SERVING.md "Health and metrics"), one
 * row each: F_<group>(name, type, help, kind, field), the field in
 * metrics_now (F_SERVER, F_VK) or stage_now (the rest). The k3_vk_* names
 * stand twice, in-process (F_VK) and per stage (F_VK_STAGE): a scrape shows
 * one of the two. */
#define F_(g, T, name, type, help, kind, f)                                                        \
    { g, name, type, help, MK_##kind, offsetof(T, f) }
#define F_SERVER(...)   F_(MG_SERVER, metrics_now, __VA_ARGS__)
#define F_VK(...)       F_(MG_VK, metrics_now, __VA_ARGS__)
#define F_STAGE(...)    F_(MG_STAGE, stage_now, __VA_ARGS__)
#define F_DRIVE(...)    F_(MG_DRIVE, stage_now, __VA_ARGS__)
#define F_STRIPE(...)   F_(MG_STRIPE, stage_now, __VA_ARGS__)
#define F_VK_STAGE(...) F_(MG_VK_STAGE, stage_now, __VA_ARGS__)
static const metric_family families[] = {
    F_SERVER("k3_http_requests_total", "counter", "HTTP requests answered", U64, m.http_requests),
    F_SERVER("k3_requests_total", "counter", "generations run (any ending)", U64, m.generations),
    F_SERVER("k3_requests_rejected_total", "counter", "generations refused with 429 (queue full)",
             U64, m.rejected_queue),
    F_SERVER("k3_requests_cancelled_total", "counter",
             "generations cancelled because the client went away", U64, m.cancelled),
    F_SERVER("k3_requests_failed_total", "counter", "generations the engine failed", U64, m.failed),
    F_SERVER("k3_prompt_tokens_total", "counter", "prompt tokens (tokens in)", U64,
             m.prompt_tokens),
    F_SERVER("k3_prompt_tokens_cached_total", "counter",
             "prompt tokens reused from a live session (not prefilled)", U64, m.cached_tokens),
    F_SERVER("k3_prefill_tokens_total", "counter", "prompt tokens prefilled", U64,
             m.prefill_tokens),
    F_SERVER("k3_completion_tokens_total", "counter", "tokens generated (tokens out)", U64,
             m.completion_tokens),
    F_SERVER("k3_prefill_seconds_total", "counter", "wall time of prefills", F64, m.prefill_s),
    F_SERVER("k3_decode_seconds_total", "counter", "wall time of decode steps", F64, m.decode_s),
    F_SERVER("k3_prefill_tokens_per_second", "gauge",
             "prefilled tokens / prefill seconds since start", F64, prefill_tps),
    F_SERVER("k3_decode_tokens_per_second", "gauge",
             "decode steps / decode seconds since start (one request's rate, averaged)", F64,
             decode_tps),
    F_SERVER("k3_time_to_first_token_seconds_sum", "counter",
             "time to first token, summed over k3_time_to_first_token_seconds_count", F64,
             m.ttft_s),
    F_SERVER("k3_time_to_first_token_seconds_count", "counter", "generations with a first token",
             U64, m.ttft_n),
    F_SERVER("k3_queue_depth", "gauge", "requests waiting for a running slot now", INT, waiting),
    F_SERVER("k3_queue_capacity", "gauge",
             "generations admitted at once, running and waiting (--max-queue)", INT, max_queue),
    F_SERVER("k3_running", "gauge", "generations running now (admitted, not ended)", INT, running),
    F_SERVER("k3_running_capacity", "gauge", "generations running at once (--parallel)", INT,
             max_running),
    F_SERVER("k3_requests_queued_total", "counter",
             "generations that waited for a running slot before they ran", U64, m.queued),
    F_SERVER("k3_requests_left_waiting_total", "counter",
             "requests whose client left while they waited for a running slot", U64,
             m.left_waiting),
    F_SERVER("k3_sessions", "gauge", "sessions held (idle or running)", INT, sessions),
    F_STAGE("k3_stage_busy_seconds_total", "counter", "compute time of a stage (worker-measured)",
            F64, busy_s),
    F_STAGE("k3_expert_bytes_read_total", "counter", "expert bytes read from the drives", U64,
            s.bytes_read),
    F_VK("k3_vk_expert_calls_total", "counter", "expert calls on the Vulkan device", U64, vk.calls),
    F_VK("k3_vk_pairs_total", "counter", "(position, rank) pairs computed there", U64, vk.pairs),
    F_VK("k3_vk_resident_experts", "gauge", "experts on the device", U64, vk.resident),
    F_VK("k3_vk_promotions_total", "counter", "experts uploaded during the run", U64,
         vk.promotions),
    F_VK("k3_vk_evictions_total", "counter", "experts displaced by hotter ones", U64, vk.evictions),
    F_VK("k3_vk_device_seconds_total", "counter", "device time of MoE steps", MS, vk.device_ms),
    F_VK("k3_vk_cpu_seconds_total", "counter", "CPU expert time of the same steps", MS, vk.cpu_ms),
    F_VK("k3_vk_wait_seconds_total", "counter",
         "time steps waited for the device after their CPU part", MS, vk.wait_ms),
    F_VK("k3_vk_off", "gauge", "1: the device failed and the CPU computes alone", INT, vk.off),
    F_DRIVE("k3_drive_bytes_read_total", "counter",
            "expert bytes a placement drive gave a stage's worker (calls it served for other "
            "stages included)",
            U64, s.drive_bytes),
    F_STRIPE("k3_gather_wait_seconds_total", "counter",
             "time a stage's MoE layers waited on stripe peers' expert calls", MS, s.gather_ms),
    F_STRIPE("k3_gather_layers_total", "counter", "MoE layer steps that called a stripe peer", U64,
             s.gather_layers),
    F_STRIPE("k3_expert_hit_ratio", "gauge", "experts served from a stage's cache / experts used",
             F64, hit_ratio),
    F_VK_STAGE("k3_vk_expert_calls_total", "counter", "expert calls on a stage's Vulkan device",
               U64, s.vk_calls),
    F_VK_STAGE("k3_vk_pairs_total", "counter", "(position, rank) pairs computed there", U64,
               s.vk_pairs),
    F_VK_STAGE("k3_vk_steps_total", "counter", "steps of the stage with device expert calls", U64,
               s.vk_steps),
    F_VK_STAGE("k3_vk_resident_experts", "gauge",
               "experts on the device after the stage's last step", U32, s.vk_resident),
    F_VK_STAGE("k3_vk_promotions_total", "counter",
               "experts the stage's worker uploaded during the run", U64, s.vk_promotions),
    F_VK_STAGE("k3_vk_device_seconds_total", "counter", "device time of the stage's MoE steps", MS,
               s.vk_device_ms),
    F_VK_STAGE("k3_vk_cpu_seconds_total", "counter", "CPU expert time of the same steps", MS,
               s.vk_cpu_ms),
    F_VK_STAGE("k3_vk_wait_seconds_total", "counter",
               "time the steps waited for the device after their CPU part", MS, s.vk_wait_ms),
};
#define N_FAMILIES (sizeof families / sizeof families[0])

/* One sample line: name, labels (may be ""), the value at p. Integers are
 * exact, doubles have 17 significant digits. */
static void sample(k3_strbuf *b, const metric_family *f, const char *labels, const void *p) {
    char line[512];
    int k = snprintf(line, sizeof line, "%s%s ", f->name, labels);
    size_t cap = sizeof line - (size_t)k;
    switch (f->kind) {
    case MK_U64: snprintf(line + k, cap, "%llu\n", (unsigned long long)*(const uint64_t *)p); break;
    case MK_U32: snprintf(line + k, cap, "%u\n", (unsigned)*(const uint32_t *)p); break;
    case MK_INT: snprintf(line + k, cap, "%d\n", *(const int *)p); break;
    case MK_F64: snprintf(line + k, cap, "%.17g\n", *(const double *)p); break;
    case MK_MS: snprintf(line + k, cap, "%.17g\n", *(const double *)p / 1e3); break;
    }
    k3_strbuf_str(b, line);
}

char *serve_metrics_text(k3_engine *e, const serve_metrics *m, int running, int max_running,
                         int waiting, int max_queue) {
    metrics_now now = {.m = *m,
                       .waiting = waiting,
                       .max_queue = max_queue,
                       .running = running,
                       .max_running = max_running};
    now.prefill_tps = m->prefill_s > 0 ? (double)m->prefill_tokens / m->prefill_s : 0.0;
    now.decode_tps = m->decode_s > 0 ? (double)m->decode_steps / m->decode_s : 0.0;
    int busy = 0;
    k3_engine_sessions(e, &now.sessions, &busy);
    k3_cluster *c = k3_engine_cluster(e);
    struct k3_vk_tier *vt = c ? NULL : k3_model_vk(k3_engine_model(e));
    if (vt) k3_vk_tier_stats_get(vt, &now.vk);

    int n = c ? k3_cluster_stages(c) : 1, any_vk = 0;
    stage_now *st = k3_xcalloc(n > 0 ? (size_t)n : 1, sizeof *st);
    for (int i = 0; i < n; i++) {
        stage_now *sn = &st[i];
        if (c) {
            k3_cluster_stage_info(c, i, &sn->s);
            sn->busy_s = sn->s.busy_ms / 1000.0;
        } else { /* the one in-process pseudo-stage */
            k3_model_range(k3_engine_model(e), &sn->s.layer_a, &sn->s.layer_b);
            sn->s.bytes_read = m->inproc_bytes_read;
            sn->busy_s = m->inproc_busy_s;
        }
        sn->hit_ratio = hit_rate(sn->s.hits, sn->s.misses);
        any_vk |= sn->s.vk_calls || sn->s.vk_resident;
    }
    const int shown[MG_COUNT] = {
        [MG_SERVER] = 1,        [MG_STAGE] = 1,          [MG_VK] = vt != NULL,
        [MG_DRIVE] = c != NULL, [MG_STRIPE] = c != NULL, [MG_VK_STAGE] = c && any_vk};

    k3_strbuf b = {0};
    char line[512];
    for (size_t f = 0; f < N_FAMILIES; f++) {
        const metric_family *mf = &families[f];
        if (!shown[mf->group]) continue;
        snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", mf->name, mf->help, mf->name,
                 mf->type);
        k3_strbuf_str(&b, line);
        if (mf->group == MG_SERVER || mf->group == MG_VK) {
            sample(&b, mf, "", (const char *)&now + mf->off);
            continue;
        }
        for (int i = 0; i < n; i++) {
            const stage_now *sn = &st[i];
            const char *p = (const char *)sn + mf->off;
            if (mf->group == MG_DRIVE) {
                for (int d = 0; d < sn->s.n_drives; d++) {
                    snprintf(line, sizeof line, "{stage=\"%d\",drive=\"%d\"}", i, d);
                    sample(&b, mf, line, p + (size_t)d * sizeof(uint64_t));
                }
                continue;
            }
            if (mf->group == MG_STRIPE)
                snprintf(line, sizeof line, "{stage=\"%d\"}", i);
            else
                snprintf(line, sizeof line, "{stage=\"%d\",layers=\"%d-%d\"}", i, sn->s.layer_a,
                         sn->s.layer_b - 1);
            sample(&b, mf, line, p);
        }
    }
    free(st);
    return b.p; /* NUL-terminated by k3_strbuf */
}
