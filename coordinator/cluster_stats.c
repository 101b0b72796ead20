/* coordinator/cluster_stats.c: what the cluster tells about itself
 * (cluster.h "introspection"): per-stage counters, the pipelining overlap,
 * links lost, a worker's own STATS, and the --stats report. Every reader
 * takes the cluster's mutex; STATS travels through the I/O thread like any
 * request and is bounded by the step deadline.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/base/log.h"
#include "coordinator/cluster_impl.h"

static double now_ms(void) { return k3_now_ms(); }

int k3_cluster_stages(const k3_cluster *c) { return c->n; }

void cl_stage_add_drives(cl_stage *s, const proto_forward_done *d) {
    if (d->n_drives > (uint32_t)s->n_drives) s->n_drives = (int)d->n_drives;
    for (uint32_t k = 0; k < d->n_drives && k < K3_MAX_DIRS; k++)
        s->drive_bytes[k] += d->drive_bytes[k];
    s->gather_ms += d->gather_ms;
    s->gather_layers += d->gather_layers;
}

void cl_stage_add_vk(cl_stage *s, const proto_forward_done *d) {
    s->vk_calls += d->vk_calls;
    s->vk_pairs += d->vk_pairs;
    s->vk_promotions += d->vk_promotions;
    s->vk_steps += d->vk_calls > 0;
    s->vk_resident = d->vk_resident;
    s->vk_device_ms += d->vk_device_ms;
    s->vk_cpu_ms += d->vk_cpu_ms;
    s->vk_wait_ms += d->vk_wait_ms;
}

void k3_cluster_stage_info(k3_cluster *c, int i, k3_stage_info *o) {
    memset(o, 0, sizeof *o);
    if (i < 0 || i >= c->n) return;
    pthread_mutex_lock(&c->mu);
    cl_stage *s = &c->st[c->order[i]];
    o->layer_a = s->a;
    o->layer_b = s->b;
    cl_fmt(o->name, sizeof o->name, "%s", s->name);
    cl_fmt(o->endpoint, sizeof o->endpoint, "%s", s->endpoint);
    o->ready = s->state == LINK_READY;
    o->epoch = s->epoch;
    o->pid = s->pid;
    o->read_gbps = s->info.read_gbps;
    o->forwards = s->forwards;
    o->tokens = s->tokens;
    o->busy_ms = s->busy_ms;
    o->read_ms = s->read_ms;
    o->bytes_read = s->bytes_read;
    o->hits = s->hits;
    o->misses = s->misses;
    o->occupied_ms = s->occupied_ms + (s->n_pending ? now_ms() - s->occ_since_ms : 0);
    o->hop_ms = s->hop_n ? s->hop_ms / (double)s->hop_n : 0;
    o->stale_dropped = s->dropped;
    o->tx_bytes = s->tx_bytes;
    o->rx_bytes = s->rx_bytes;
    o->failures = s->failures;
    o->n_drives = s->n_drives;
    memcpy(o->drive_bytes, s->drive_bytes, sizeof o->drive_bytes);
    o->gather_ms = s->gather_ms;
    o->gather_layers = s->gather_layers;
    o->vk_calls = s->vk_calls;
    o->vk_pairs = s->vk_pairs;
    o->vk_promotions = s->vk_promotions;
    o->vk_steps = s->vk_steps;
    o->vk_resident = s->vk_resident;
    o->vk_device_ms = s->vk_device_ms;
    o->vk_cpu_ms = s->vk_cpu_ms;
    o->vk_wait_ms = s->vk_wait_ms;
    pthread_mutex_unlock(&c->mu);
}

double k3_cluster_overlap_ms(k3_cluster *c) {
    pthread_mutex_lock(&c->mu);
    double v = c->overlap_ms;
    pthread_mutex_unlock(&c->mu);
    return v;
}

uint64_t k3_cluster_losses(k3_cluster *c) {
    pthread_mutex_lock(&c->mu);
    uint64_t v = c->losses;
    pthread_mutex_unlock(&c->mu);
    return v;
}

k3_status k3_cluster_worker_stats(k3_cluster *c, int i, proto_stats_ok *out, char *err,
                                  size_t errlen) {
    if (i < 0 || i >= c->n) return k3_errf(K3_ERR_ARG, err, errlen, "cluster: no stage %d", i);
    cl_ctl x;
    memset(&x, 0, sizeof x);
    x.stage = i;
    x.type = PROTO_MSG_STATS;
    pthread_mutex_lock(&c->mu);
    x.next = c->ctl_in;
    c->ctl_in = &x;
    cl_wake(c);
    double deadline = now_ms() + c->o.step_timeout_ms + 1000;
    while (!x.done) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        if (!x.done && now_ms() > deadline) {
            /* unlink it wherever it is: the queue or a pending request */
            for (cl_ctl **pp = &c->ctl_in; *pp; pp = &(*pp)->next)
                if (*pp == &x) {
                    *pp = x.next;
                    break;
                }
            for (int k = 0; k < c->n; k++)
                for (cl_req *r = c->st[k].pending; r; r = r->next)
                    if (r->ctl == &x) r->ctl = NULL;
            x.done = 1;
            x.st = K3_ERR_TIMEOUT;
            cl_fmt(x.err, sizeof x.err, "no STATS_OK within %d ms", c->o.step_timeout_ms + 1000);
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (x.st) return k3_errf(x.st, err, errlen, "cluster: stage %d: %s", i, x.err);
    *out = x.stats;
    return K3_OK;
}

void k3_cluster_print_stats(k3_cluster *c, FILE *f) {
    fprintf(f, "cluster: %d stages, %llu links lost, %.1f ms with >= 2 stages busy\n", c->n,
            (unsigned long long)k3_cluster_losses(c), k3_cluster_overlap_ms(c));
    for (int i = 0; i < c->n; i++) {
        k3_stage_info s;
        k3_cluster_stage_info(c, i, &s);
        fprintf(f,
                "  stage %d %s layers [%d, %d): %llu steps, %llu tokens; busy %.1f ms (worker "
                "compute), reads %.1f ms, occupied %.1f ms; hop %.3f ms/step; wire %.0f B/token "
                "(in + out); %.1f MB read (%.0f B/token), experts %llu hit / %llu miss; drive "
                "%.2f GB/s; %llu dropped, %llu lost\n",
                i, s.name, s.layer_a, s.layer_b, (unsigned long long)s.forwards,
                (unsigned long long)s.tokens, s.busy_ms, s.read_ms, s.occupied_ms, s.hop_ms,
                s.tokens ? (double)(s.tx_bytes + s.rx_bytes) / (double)s.tokens : 0.0,
                (double)s.bytes_read / 1e6,
                s.tokens ? (double)s.bytes_read / (double)s.tokens : 0.0,
                (unsigned long long)s.hits, (unsigned long long)s.misses, s.read_gbps,
                (unsigned long long)s.stale_dropped, (unsigned long long)s.failures);
        /* the worker's Vulkan tier, from STATS_OK (docs/VULKAN.md), when the
         * coordinator was given --vk (a STATS round trip per stage) */
        proto_stats_ok w;
        char err[256];
        if (c->o.model && c->o.model->vk &&
            k3_cluster_worker_stats(c, i, &w, err, sizeof err) == K3_OK &&
            (w.vk_calls || w.vk_resident || w.vk_off))
            fprintf(f,
                    "  stage %d vulkan: %llu device expert calls (%llu pairs), %u resident, %llu "
                    "promotions, %llu evictions%s; device %.1f ms, CPU %.1f ms, waited %.1f ms\n",
                    i, (unsigned long long)w.vk_calls, (unsigned long long)w.vk_pairs,
                    (unsigned)w.vk_resident, (unsigned long long)w.vk_promotions,
                    (unsigned long long)w.vk_evictions, w.vk_off ? " (device failed: off)" : "",
                    w.vk_device_ms, w.vk_cpu_ms, w.vk_wait_ms);
        /* the same tier step by step, from FORWARD_DONE (no round trip) */
        if (s.vk_calls || s.vk_resident)
            fprintf(f,
                    "    vulkan steps: %llu device expert calls (%llu pairs) in %llu of %llu "
                    "steps, %u resident, %llu promotions; device %.1f ms, CPU %.1f ms, waited "
                    "%.1f ms (per step %.3f / %.3f / %.3f ms)\n",
                    (unsigned long long)s.vk_calls, (unsigned long long)s.vk_pairs,
                    (unsigned long long)s.vk_steps, (unsigned long long)s.forwards,
                    (unsigned)s.vk_resident, (unsigned long long)s.vk_promotions, s.vk_device_ms,
                    s.vk_cpu_ms, s.vk_wait_ms,
                    s.forwards ? s.vk_device_ms / (double)s.forwards : 0.0,
                    s.forwards ? s.vk_cpu_ms / (double)s.forwards : 0.0,
                    s.forwards ? s.vk_wait_ms / (double)s.forwards : 0.0);
        if (s.hits + s.misses)
            fprintf(f, "    experts: hit rate %.1f %%\n",
                    100.0 * (double)s.hits / (double)(s.hits + s.misses));
        if (s.n_drives > 1 || s.gather_layers) {
            /* a drive's rate over the stage's busy time: how fast it fed
             * this worker while it computed (docs/PERFORMANCE.md) */
            fprintf(f, "    drives:");
            for (int d = 0; d < s.n_drives; d++)
                fprintf(f, " d%d %.1f MB (%.3f GB/s)", d, (double)s.drive_bytes[d] / 1e6,
                        s.busy_ms > 0 ? (double)s.drive_bytes[d] / 1e6 / s.busy_ms : 0.0);
            fprintf(f, "; gather wait %.3f ms per layer over %llu MoE layer steps\n",
                    s.gather_layers ? s.gather_ms / (double)s.gather_layers : 0.0,
                    (unsigned long long)s.gather_layers);
        }
    }
}
