/* coordinator/serve_stats.c: /health's workers and /metrics (serve_stats.h).
 *
 * Per-stage numbers come from the cluster's own accounting of every step
 * (k3_cluster_stage_info: worker-measured compute time, expert bytes and
 * hits as FORWARD_DONE reports them), so rendering costs no round trip to
 * the workers. In-process, the one pseudo-worker sums the steps of the
 * generations that ran (serve_metrics).
 */
#include "coordinator/serve_stats.h"

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

/* One metric: HELP and TYPE lines, then the sample. */
static void metric(k3_strbuf *b, const char *name, const char *type, const char *help, double v) {
    char line[512];
    snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type,
             name, v);
    k3_strbuf_str(b, line);
}

/* Expert striping per stage (docs/CLUSTER.md "Expert striping"): bytes
 * per placement drive, the waits on stripe peers, the expert hit ratio. */
static void serve_metrics_striping(k3_strbuf *b, k3_cluster *c) {
    char line[512];
    k3_strbuf g = {0}, h = {0}, r = {0};
    k3_strbuf_str(b, "# HELP k3_drive_bytes_read_total expert bytes a placement drive gave a "
                     "stage's worker (calls it served for other stages included)\n"
                     "# TYPE k3_drive_bytes_read_total counter\n");
    k3_strbuf_str(&g, "# HELP k3_gather_wait_seconds_total time a stage's MoE layers waited on "
                      "stripe peers' expert calls\n"
                      "# TYPE k3_gather_wait_seconds_total counter\n");
    k3_strbuf_str(&h, "# HELP k3_gather_layers_total MoE layer steps that called a stripe peer\n"
                      "# TYPE k3_gather_layers_total counter\n");
    k3_strbuf_str(&r, "# HELP k3_expert_hit_ratio experts served from a stage's cache / experts "
                      "used\n"
                      "# TYPE k3_expert_hit_ratio gauge\n");
    for (int i = 0; i < k3_cluster_stages(c); i++) {
        k3_stage_info s;
        k3_cluster_stage_info(c, i, &s);
        for (int d = 0; d < s.n_drives; d++) {
            snprintf(line, sizeof line,
                     "k3_drive_bytes_read_total{stage=\"%d\",drive=\"%d\"} %llu\n", i, d,
                     (unsigned long long)s.drive_bytes[d]);
            k3_strbuf_str(b, line);
        }
        snprintf(line, sizeof line, "k3_gather_wait_seconds_total{stage=\"%d\"} %.17g\n", i,
                 s.gather_ms / 1000.0);
        k3_strbuf_str(&g, line);
        snprintf(line, sizeof line, "k3_gather_layers_total{stage=\"%d\"} %llu\n", i,
                 (unsigned long long)s.gather_layers);
        k3_strbuf_str(&h, line);
        snprintf(line, sizeof line, "k3_expert_hit_ratio{stage=\"%d\"} %.17g\n", i,
                 hit_rate(s.hits, s.misses));
        k3_strbuf_str(&r, line);
    }
    k3_strbuf_add(b, g.p, g.n);
    k3_strbuf_add(b, h.p, h.n);
    k3_strbuf_add(b, r.p, r.n);
    free(g.p), free(h.p), free(r.p);
}

/* The workers' Vulkan tiers per stage (docs/VULKAN.md "Stats"), from the
 * coordinator's sums of FORWARD_DONE's vk_* keys: the in-process tier's
 * families with a stage label. Absent while no stage reported a tier. */
static void serve_metrics_vk_stages(k3_strbuf *b, k3_cluster *c) {
    static const struct {
        const char *name, *type, *help;
    } fam[] = {
        {"k3_vk_expert_calls_total", "counter", "expert calls on a stage's Vulkan device"},
        {"k3_vk_pairs_total", "counter", "(position, rank) pairs computed there"},
        {"k3_vk_steps_total", "counter", "steps of the stage with device expert calls"},
        {"k3_vk_resident_experts", "gauge", "experts on the device after the stage's last step"},
        {"k3_vk_promotions_total", "counter", "experts the stage's worker uploaded during the run"},
        {"k3_vk_device_seconds_total", "counter", "device time of the stage's MoE steps"},
        {"k3_vk_cpu_seconds_total", "counter", "CPU expert time of the same steps"},
        {"k3_vk_wait_seconds_total", "counter",
         "time the steps waited for the device after their CPU part"},
    };
    int n = k3_cluster_stages(c), any = 0;
    k3_stage_info *st = calloc((size_t)(n > 0 ? n : 1), sizeof *st);
    if (!st) return;
    for (int i = 0; i < n; i++) {
        k3_cluster_stage_info(c, i, &st[i]);
        any |= st[i].vk_calls || st[i].vk_resident;
    }
    char line[512];
    for (size_t f = 0; any && f < sizeof fam / sizeof fam[0]; f++) {
        snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n", fam[f].name, fam[f].help,
                 fam[f].name, fam[f].type);
        k3_strbuf_str(b, line);
        for (int i = 0; i < n; i++) {
            const k3_stage_info *s = &st[i];
            double v[] = {(double)s->vk_calls,    (double)s->vk_pairs,      (double)s->vk_steps,
                          (double)s->vk_resident, (double)s->vk_promotions, s->vk_device_ms / 1e3,
                          s->vk_cpu_ms / 1e3,     s->vk_wait_ms / 1e3};
            snprintf(line, sizeof line, "%s{stage=\"%d\",layers=\"%d-%d\"} %.17g\n", fam[f].name, i,
                     s->layer_a, s->layer_b - 1, v[f]);
            k3_strbuf_str(b, line);
        }
    }
    free(st);
}

char *serve_metrics_text(k3_engine *e, const serve_metrics *m, int running, int max_running,
                         int waiting, int max_queue) {
    k3_strbuf b = {0};
    metric(&b, "k3_http_requests_total", "counter", "HTTP requests answered",
           (double)m->http_requests);
    metric(&b, "k3_requests_total", "counter", "generations run (any ending)",
           (double)m->generations);
    metric(&b, "k3_requests_rejected_total", "counter", "generations refused with 429 (queue full)",
           (double)m->rejected_queue);
    metric(&b, "k3_requests_cancelled_total", "counter",
           "generations cancelled because the client went away", (double)m->cancelled);
    metric(&b, "k3_requests_failed_total", "counter", "generations the engine failed",
           (double)m->failed);
    metric(&b, "k3_prompt_tokens_total", "counter", "prompt tokens (tokens in)",
           (double)m->prompt_tokens);
    metric(&b, "k3_prompt_tokens_cached_total", "counter",
           "prompt tokens reused from a live session (not prefilled)", (double)m->cached_tokens);
    metric(&b, "k3_prefill_tokens_total", "counter", "prompt tokens prefilled",
           (double)m->prefill_tokens);
    metric(&b, "k3_completion_tokens_total", "counter", "tokens generated (tokens out)",
           (double)m->completion_tokens);
    metric(&b, "k3_prefill_seconds_total", "counter", "wall time of prefills", m->prefill_s);
    metric(&b, "k3_decode_seconds_total", "counter", "wall time of decode steps", m->decode_s);
    metric(&b, "k3_prefill_tokens_per_second", "gauge",
           "prefilled tokens / prefill seconds since start",
           m->prefill_s > 0 ? (double)m->prefill_tokens / m->prefill_s : 0.0);
    metric(&b, "k3_decode_tokens_per_second", "gauge",
           "decode steps / decode seconds since start (one request's rate, averaged)",
           m->decode_s > 0 ? (double)m->decode_steps / m->decode_s : 0.0);
    metric(&b, "k3_time_to_first_token_seconds_sum", "counter",
           "time to first token, summed over k3_time_to_first_token_seconds_count", m->ttft_s);
    metric(&b, "k3_time_to_first_token_seconds_count", "counter", "generations with a first token",
           (double)m->ttft_n);
    metric(&b, "k3_queue_depth", "gauge", "requests waiting for a running slot now",
           (double)waiting);
    metric(&b, "k3_queue_capacity", "gauge",
           "generations admitted at once, running and waiting (--max-queue)", (double)max_queue);
    metric(&b, "k3_running", "gauge", "generations running now (admitted, not ended)",
           (double)running);
    metric(&b, "k3_running_capacity", "gauge", "generations running at once (--parallel)",
           (double)max_running);
    metric(&b, "k3_requests_queued_total", "counter",
           "generations that waited for a running slot before they ran", (double)m->queued);
    metric(&b, "k3_requests_left_waiting_total", "counter",
           "requests whose client left while they waited for a running slot",
           (double)m->left_waiting);
    int live = 0, busy = 0;
    k3_engine_sessions(e, &live, &busy);
    metric(&b, "k3_sessions", "gauge", "sessions held (idle or running)", (double)live);

    k3_strbuf_str(&b,
                  "# HELP k3_stage_busy_seconds_total compute time of a stage (worker-measured)\n"
                  "# TYPE k3_stage_busy_seconds_total counter\n");
    k3_strbuf xb = {0}; /* the expert bytes family, appended after */
    k3_strbuf_str(&xb, "# HELP k3_expert_bytes_read_total expert bytes read from the drives\n"
                       "# TYPE k3_expert_bytes_read_total counter\n");
    char line[512];
    k3_cluster *c = k3_engine_cluster(e);
    int n = c ? k3_cluster_stages(c) : 1;
    for (int i = 0; i < n; i++) {
        double busy_s = m->inproc_busy_s;
        uint64_t bytes = m->inproc_bytes_read;
        int a = 0, bl = 0;
        if (c) {
            k3_stage_info s;
            k3_cluster_stage_info(c, i, &s);
            busy_s = s.busy_ms / 1000.0;
            bytes = s.bytes_read;
            a = s.layer_a;
            bl = s.layer_b;
        } else {
            k3_model_range(k3_engine_model(e), &a, &bl);
        }
        snprintf(line, sizeof line,
                 "k3_stage_busy_seconds_total{stage=\"%d\",layers=\"%d-%d\"} %.17g\n", i, a, bl - 1,
                 busy_s);
        k3_strbuf_str(&b, line);
        snprintf(line, sizeof line,
                 "k3_expert_bytes_read_total{stage=\"%d\",layers=\"%d-%d\"} %llu\n", i, a, bl - 1,
                 (unsigned long long)bytes);
        k3_strbuf_str(&xb, line);
    }
    k3_strbuf_add(&b, xb.p, xb.n);
    free(xb.p);
    struct k3_vk_tier *vt = c ? NULL : k3_model_vk(k3_engine_model(e));
    if (vt) { /* the in-process Vulkan expert tier (docs/VULKAN.md "Stats") */
        k3_vk_tier_stats v;
        k3_vk_tier_stats_get(vt, &v);
        metric(&b, "k3_vk_expert_calls_total", "counter", "expert calls on the Vulkan device",
               (double)v.calls);
        metric(&b, "k3_vk_pairs_total", "counter", "(position, rank) pairs computed there",
               (double)v.pairs);
        metric(&b, "k3_vk_resident_experts", "gauge", "experts on the device", (double)v.resident);
        metric(&b, "k3_vk_promotions_total", "counter", "experts uploaded during the run",
               (double)v.promotions);
        metric(&b, "k3_vk_evictions_total", "counter", "experts displaced by hotter ones",
               (double)v.evictions);
        metric(&b, "k3_vk_device_seconds_total", "counter", "device time of MoE steps",
               v.device_ms / 1e3);
        metric(&b, "k3_vk_cpu_seconds_total", "counter", "CPU expert time of the same steps",
               v.cpu_ms / 1e3);
        metric(&b, "k3_vk_wait_seconds_total", "counter",
               "time steps waited for the device after their CPU part", v.wait_ms / 1e3);
        metric(&b, "k3_vk_off", "gauge", "1: the device failed and the CPU computes alone",
               (double)v.off);
    }
    if (c) serve_metrics_striping(&b, c);
    if (c) serve_metrics_vk_stages(&b, c);
    return b.p; /* NUL-terminated by k3_strbuf */
}
