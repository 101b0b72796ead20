/* coordinator/cmd_plan.c: `k3-coordinator plan` (cmd_plan.h).
 *
 * The model of a token (single-session decode, what the plan optimises;
 * coordinator/plan_model.h has the formula): each MoE layer reads the
 * topk experts that miss the cache, topk x (1 - hit) with hit = the
 * engine's slots per layer / experts per layer (routing spread over the
 * experts). A worker's experts are striped over its drives in proportion
 * to their measured 17.5 MB random read speed (the placement `place` and
 * `repack --placement` build), so a layer waits for the drive that gets
 * the most of its misses (expected over the ways they fall), the engine
 * keeping every drive busy (read_depth reads in flight per drive,
 * common/experts/experts.h). Compute that does not overlap the reads
 * (router, attention, latent up projection, the last expert) adds to it,
 * and the work under the reads counts where it exceeds them; both come
 * from the host's kernels measured at the model's shapes. Layers run one
 * after the other. With one worker per NUMA node (drives read by the node
 * they hang off), the read part is smallest when each worker's expert
 * bytes are proportional to its drives' bandwidth, which is also what
 * keeps a prefill pipeline's stages balanced.
 *
 * Several hosts (--hosts FILE, plan_hosts.h): the same model over every
 * (host, NUMA node) with drives, in the file's host order; a host's RAM
 * holds the dense weights of its layers and its workers' caches, and each
 * worker adds its host's coordinator round trip (rtt_ms) once per token
 * (the coordinator calls the stages one after the other). Each worker's
 * experts are striped over its own drives by speed (its "stripe": the
 * weights `k3-coordinator place` takes), and it gets the shard files of
 * its layers ("files") and every host the rest ("global").
 */
#include "coordinator/cmd_plan.h"

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/engine/model.h"
#include "coordinator/drives.h"
#include "coordinator/model_info.h"
#include "coordinator/plan_hosts.h"
#include "coordinator/plan_model.h"

typedef struct plan_cli {
    char *model;
    k3_opt_list drives;
    double ram;
    char *hosts;
    char *describe;
    char *out;
    double seconds;
    int remeasure;
    int help;
} plan_cli;

#define O(f) offsetof(plan_cli, f)
static const k3_opt plan_table[] = {
    K3_DRIVE_OPT_ROWS(plan_cli, model, drives, seconds, remeasure,
                      "model directory (snapshot or container): config, index, shard headers"),
    {.name = "ram",
     .flag = "--ram",
     .type = K3_OPT_DOUBLE,
     .offset = O(ram),
     .def = "0",
     .min = 0,
     .max = 1e6,
     .metavar = "GB",
     .help = "RAM for weights and caches, GB (0 = MemAvailable now; with --hosts: each host's "
             "ram_gb, else this)"},
    {.name = "hosts",
     .flag = "--hosts",
     .type = K3_OPT_STRING,
     .offset = O(hosts),
     .metavar = "FILE",
     .help = "plan several hosts: their drives, speeds, RAM (JSON, docs/DEPLOY.md; instead of "
             "--drives)"},
    {.name = "describe",
     .flag = "--describe",
     .type = K3_OPT_STRING,
     .offset = O(describe),
     .metavar = "NAME",
     .help = "measure --drives and write this host's entry of a hosts file (no --model)"},
    {.name = "out",
     .flag = "--out",
     .type = K3_OPT_STRING,
     .offset = O(out),
     .def = "k3-plan.json",
     .metavar = "FILE",
     .help = "the plan file written (- = standard output)"},
    {.name = "help", .flag = "--help", .type = K3_OPT_BOOL, .offset = O(help), .help = "this text"},
};
#undef O
#define N_PLAN_OPTS ((int)(sizeof plan_table / sizeof plan_table[0]))

static const char usage_text[] =
    "usage: k3-coordinator plan --model DIR --drives D1,D2,.. [--ram GB] [--out FILE]\n"
    "       k3-coordinator plan --model DIR --hosts HOSTS.json [--ram GB] [--out FILE]\n"
    "       k3-coordinator plan --describe NAME --drives D1,D2,.. [--out FILE]\n"
    "\n"
    "Measures each drive (sequential and 17.5 MB random O_DIRECT reads, a few\n"
    "seconds each, cached in the drive's .k3_drive.json) and its NUMA node, then\n"
    "writes a plan: one worker per NUMA node with drives, its layer range, drives\n"
    "and expert cache budget, and each drive's share of the expert bytes (in\n"
    "proportion to its measured speed). It optimises single-session decode and\n"
    "prints the predicted s/token with what bounds it. --hosts: the same across\n"
    "hosts (one worker per host and NUMA node, its endpoint, stripe and shard\n"
    "files); --describe: one host's drives and RAM (MemTotal, or --ram), for the\n"
    "hosts file.";

typedef struct pworker {
    int host, numa, index; /* index: among its host's workers (port + index) */
    int drives[K3_MAX_DIRS], n_drives;
    double bw;             /* sum of its drives' rand GB/s */
    int first, last;       /* layers, inclusive */
    uint64_t expert_bytes; /* of its layers */
    double cache_gb;
    int slots;     /* engine slots per MoE layer for cache_gb */
    double misses; /* expected misses per MoE layer */
    double read_s; /* expected read time per MoE layer */
} pworker;

/* Everything a plan is made of. */
typedef struct plan_ctx {
    const plan_cli *c;
    int multi; /* --hosts */
    plan_host *hosts;
    int nh;
    plan_drive *dv;
    int nd;
    pworker w[K3_MAX_WORKERS];
    int nw;
    double bw_all, cache_all, pred, rtt_s;
    double read_s, fixed_s, under_s, beyond_s, dense_s; /* terms of pred per token */
    k3_plan_compute pc;
    double *share; /* [nd] */
} plan_ctx;

/* One worker per (host, NUMA node) with drives, in host then drive order
 * (the drives of unknown node, -1, make one worker: not pinned). */
static k3_status group_workers(plan_ctx *p, char *err, size_t errlen) {
    for (int i = 0; i < p->nd; i++) {
        int node = p->dv[i].numa < 0 ? -1 : p->dv[i].numa, k, h = p->dv[i].host;
        for (k = 0; k < p->nw && (p->w[k].host != h || p->w[k].numa != node); k++) {
        }
        if (k == p->nw) {
            if (p->nw == K3_MAX_WORKERS)
                return k3_errf(K3_ERR_LIMIT, err, errlen,
                               "plan: more than K3_MAX_WORKERS %d "
                               "workers (host, NUMA node pairs)",
                               K3_MAX_WORKERS);
            memset(&p->w[k], 0, sizeof p->w[k]);
            p->w[k].host = h, p->w[k].numa = node;
            for (int q = 0; q < k; q++) p->w[k].index += p->w[q].host == h;
            p->nw++;
        }
        if (p->w[k].n_drives == K3_MAX_DIRS)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "plan: host %s NUMA %d: more than "
                           "K3_MAX_DIRS %d drives",
                           p->hosts[h].name, node, K3_MAX_DIRS);
        p->w[k].drives[p->w[k].n_drives++] = i;
        p->w[k].bw += p->dv[i].rand_gbs;
        p->bw_all += p->dv[i].rand_gbs;
    }
    return K3_OK;
}

/* Layers in order, cut where each worker's share of expert bytes is
 * reached (its bandwidth share); dense layers go with their neighbours.
 * Then the RAM budgets and the predicted s/token. */
static void split_and_budget(plan_ctx *p, const k3_model_info *mi) {
    const k3_config *cfg = &mi->cfg;
    int L = cfg->n_layers, l = 0;
    if (p->nw > L) p->nw = L; /* more workers than layers: a toy model */
    uint64_t cum = 0;
    double target = 0;
    for (int k = 0; k < p->nw; k++) {
        pworker *w = &p->w[k];
        w->first = l;
        target += w->bw / p->bw_all * (double)mi->expert_bytes;
        int keep = p->nw - 1 - k; /* layers left for the later workers, one each */
        do {
            cum += mi->layer_expert[l];
            w->expert_bytes += mi->layer_expert[l];
            l++;
        } while (l < L - keep &&
                 (k == p->nw - 1 || (double)cum + (double)mi->layer_expert[l] / 2 <= target));
        w->last = l - 1;
    }
    /* RAM per host: the dense weights of its layers first (all of them on
     * one host), a 10% reserve, the rest is its workers' expert cache in
     * proportion to their expert bytes */
    for (int h = 0; h < p->nh; h++) {
        int layers = 0;
        uint64_t eb = 0;
        for (int k = 0; k < p->nw; k++)
            if (p->w[k].host == h)
                layers += p->w[k].last - p->w[k].first + 1, eb += p->w[k].expert_bytes;
        double dense =
            p->multi ? (double)mi->dense_resident * layers / L : (double)mi->dense_resident;
        double cache = p->hosts[h].ram_gb * 1e9 * 0.9 - dense;
        if (cache < 0 || !layers) cache = 0;
        p->cache_all += cache;
        for (int k = 0; k < p->nw; k++)
            if (p->w[k].host == h)
                p->w[k].cache_gb = eb ? cache * (double)p->w[k].expert_bytes / (double)eb / 1e9 : 0;
        /* a cache past all of a worker's experts holds nothing more */
        for (int k = 0; k < p->nw; k++)
            if (p->w[k].host == h && p->w[k].cache_gb * 1e9 > (double)p->w[k].expert_bytes)
                p->w[k].cache_gb = (double)p->w[k].expert_bytes / 1e9;
    }
    /* the engine's slot: an expert plus O_DIRECT room, 4 KiB-rounded
     * (common/experts/experts.c) */
    uint64_t slot_alloc = (mi->slot_bytes + 2 * 4096 + 4095) & ~(uint64_t)4095;
    double g = p->pc.dense_gbs > 0 ? p->pc.dense_gbs * 1e9 : 1e30;
    for (int k = 0; k < p->nw; k++) {
        pworker *w = &p->w[k];
        int n_moe = 0;
        for (int q = w->first; q <= w->last; q++) n_moe += cfg->is_moe[q];
        double per_layer = n_moe ? w->cache_gb * 1e9 / n_moe : 0;
        w->slots = slot_alloc ? (int)(per_layer / (double)slot_alloc) : 0;
        if (w->slots < 1) w->slots = 1; /* the engine's floor */
        if (w->slots > cfg->n_experts) w->slots = cfg->n_experts;
        double hit = cfg->n_experts ? (double)w->slots / cfg->n_experts : 1;
        w->misses = cfg->topk * (1 - hit);
        double gbs[K3_MAX_DIRS], wt[K3_MAX_DIRS];
        int count[K3_MAX_DIRS];
        for (int j = 0; j < w->n_drives; j++)
            gbs[j] = p->dv[w->drives[j]].rand_gbs, wt[j] = gbs[j] / w->bw;
        k3_plan_deal(wt, w->n_drives, cfg->n_experts, count);
        /* the engine keeps 2 reads in flight per drive (K3_READ_DEPTH) */
        w->read_s = k3_plan_layer_read_s(count, gbs, w->n_drives, cfg->n_experts, w->misses,
                                         (double)mi->slot_bytes, 2 * w->n_drives);
        for (int q = w->first; q <= w->last; q++) {
            if (!cfg->is_moe[q]) {
                p->dense_s += (double)mi->layer_dense[q] / g;
                continue;
            }
            double fx, un;
            k3_plan_moe_compute(&p->pc, mi->layer_dense[q], mi->layer_overlap[q], cfg->topk, &fx,
                                &un);
            p->read_s += w->read_s;
            p->fixed_s += fx;
            p->under_s += un;
            if (un > w->read_s) p->beyond_s += un - w->read_s;
        }
        p->rtt_s += p->hosts[w->host].rtt_ms / 1e3;
    }
    /* what no layer holds: the lm_head and the final norms, once a token */
    uint64_t in_layers = 0;
    for (int q = 0; q < L; q++) in_layers += mi->layer_dense[q];
    if (mi->dense_resident > in_layers) p->dense_s += (double)(mi->dense_resident - in_layers) / g;
    p->pred = p->read_s + p->fixed_s + p->beyond_s + p->dense_s + p->rtt_s;
    /* a drive's share of all expert bytes: its worker's share, split over
     * the worker's drives by speed */
    for (int q = 0; q < p->nw; q++)
        for (int j = 0; j < p->w[q].n_drives; j++) {
            int i = p->w[q].drives[j];
            p->share[i] = mi->expert_bytes
                              ? (double)p->w[q].expert_bytes / (double)mi->expert_bytes *
                                    p->dv[i].rand_gbs / p->w[q].bw
                              : 1.0 / p->nd;
        }
}

static void worker_name(const plan_ctx *p, int k, char *buf, size_t len) {
    if (p->multi)
        snprintf(buf, len, "%s-w%d", p->hosts[p->w[k].host].name, p->w[k].index);
    else
        snprintf(buf, len, "w%d", k);
}

/* The shard files of worker k's layers, and the files every host gets. */
static json_t *files_json(const plan_files *pf, int first, int last) {
    json_t *a = json_array();
    for (int f = 0; f < pf->n_files; f++) {
        int need = 0;
        if (first < 0)
            need = pf->global[f];
        else
            for (int l = first; l <= last && !need; l++)
                need = pf->layer_has[(size_t)l * (size_t)pf->n_files + (size_t)f];
        if (need)
            json_array_append_new(
                a, json_pack("{s:s, s:I}", "name", pf->names[f], "size", (json_int_t)pf->sizes[f]));
    }
    return a;
}

static json_t *plan_json(const plan_ctx *p, const k3_model_info *mi, const char *fph,
                         const plan_files *pf) {
    json_t *root = json_object(), *jd = json_array(), *jw = json_array();
    json_object_set_new(root, "format", json_string("k3shard-plan"));
    json_object_set_new(root, "version", json_integer(1));
    json_object_set_new(root, "model", json_string(p->c->model));
    json_object_set_new(root, "model_fingerprint", json_string(fph));
    json_object_set_new(root, "optimises", json_string("single-session decode"));
    json_object_set_new(root, "n_layers", json_integer(mi->cfg.n_layers));
    if (p->multi) {
        json_t *jh = json_array();
        for (int h = 0; h < p->nh; h++)
            json_array_append_new(jh, json_pack("{s:s, s:s, s:i, s:f, s:f}", "name",
                                                p->hosts[h].name, "addr", p->hosts[h].addr, "port",
                                                p->hosts[h].port, "ram_gb", p->hosts[h].ram_gb,
                                                "rtt_ms", p->hosts[h].rtt_ms));
        json_object_set_new(root, "hosts", jh);
    }
    for (int i = 0; i < p->nd; i++)
        json_array_append_new(jd, json_pack("{s:s, s:s, s:f, s:f, s:i, s:f}", "path", p->dv[i].path,
                                            "host", p->hosts[p->dv[i].host].name, "seq_gbs",
                                            p->dv[i].seq_gbs, "rand_gbs", p->dv[i].rand_gbs, "numa",
                                            p->dv[i].numa, "share", p->share[i]));
    for (int k = 0; k < p->nw; k++) {
        const pworker *w = &p->w[k];
        json_t *dr = json_array(), *stripe = json_array();
        for (int j = 0; j < w->n_drives; j++) {
            int i = w->drives[j];
            json_array_append_new(dr, json_integer(i));
            json_array_append_new(stripe, json_pack("{s:s, s:f}", "path", p->dv[i].path, "weight",
                                                    p->dv[i].rand_gbs / w->bw));
        }
        char name[160], arg[32];
        worker_name(p, k, name, sizeof name);
        snprintf(arg, sizeof arg, "%d-%d", w->first, w->last + 1);
        json_t *o = json_pack("{s:s, s:s, s:i, s:[i,i], s:s, s:o, s:o, s:f, s:f}", "host",
                              p->hosts[w->host].name, "name", name, "numa", w->numa, "layers",
                              w->first, w->last, "layers_arg", arg, "drives", dr, "stripe", stripe,
                              "cache_gb", w->cache_gb, "expert_gb", (double)w->expert_bytes / 1e9);
        json_object_set_new(o, "slots", json_integer(w->slots));
        json_object_set_new(o, "misses_per_layer", json_real(w->misses));
        json_object_set_new(o, "read_s_per_layer", json_real(w->read_s));
        if (p->multi) {
            char ep[K3_MAX_ENDPOINT + 16];
            snprintf(ep, sizeof ep, "tcp://%s:%d", p->hosts[w->host].addr,
                     p->hosts[w->host].port + w->index);
            json_object_set_new(o, "index", json_integer(w->index));
            json_object_set_new(o, "endpoint", json_string(ep));
            json_object_set_new(o, "files", files_json(pf, w->first, w->last));
        }
        json_array_append_new(jw, o);
    }
    json_object_set_new(root, "drives", jd);
    json_object_set_new(root, "workers", jw);
    if (p->multi) json_object_set_new(root, "global", files_json(pf, -1, -1));
    json_object_set_new(root, "predicted_s_per_token", json_real(p->pred));
    json_object_set_new(root, "prediction",
                        json_pack("{s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:b}", "reads_s",
                                  p->read_s, "compute_not_under_reads_s", p->fixed_s,
                                  "compute_under_reads_s", p->under_s, "compute_beyond_reads_s",
                                  p->beyond_s, "dense_layers_and_head_s", p->dense_s, "dense_gbs",
                                  p->pc.dense_gbs, "expert_ms", p->pc.expert_ms, "threads",
                                  p->pc.threads, "compute_cached", p->pc.from_cache));
    json_object_set_new(root, "bound",
                        json_string(p->multi ? "drive reads, compute measured on the planning "
                                               "host, and the coordinator round trips "
                                               "(bandwidth not included)"
                                             : "drive reads and compute (network not included)"));
    return root;
}

static k3_status write_json(json_t *root, const char *out, char *err, size_t errlen) {
    if (!strcmp(out, "-")) {
        int ok = json_dumpf(root, stdout, JSON_INDENT(2)) == 0;
        printf("\n");
        return ok ? K3_OK : k3_errf(K3_ERR_IO, err, errlen, "plan: cannot write standard output");
    }
    char tmp[K3_MAX_PATH + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    if (json_dump_file(root, tmp, JSON_INDENT(2)) != 0 || rename(tmp, out) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "plan: cannot write %s", out);
    return K3_OK;
}

/* Measures --drives on this machine into p->dv (host 0). */
static int measure_local(const plan_cli *c, plan_ctx *p) {
    char err[1024];
    p->nd = c->drives.n;
    p->dv = calloc((size_t)p->nd, sizeof *p->dv);
    if (!p->dv) return 1;
    for (int i = 0; i < p->nd; i++) {
        k3_drive d;
        fprintf(stderr, "plan: measuring %s ...\n", c->drives.items[i]);
        if (k3_drive_probe(&d, c->drives.items[i], 1, c->remeasure, c->seconds, err, sizeof err)) {
            fprintf(stderr, "plan: %s (mount it, or drop it from --drives)\n", err);
            return 1;
        }
        if (d.seq_gbs <= 0 || d.rand_gbs <= 0) {
            fprintf(stderr, "plan: drive %s: %s (k3-coordinator doctor --drives %s)\n",
                    c->drives.items[i], d.note[0] ? d.note : "no read measured",
                    c->drives.items[i]);
            return 1;
        }
        fprintf(stderr, "plan:   %s: NUMA %d, seq %.3f GB/s, random 17.5 MB %.3f GB/s%s\n", d.path,
                d.numa, d.seq_gbs, d.rand_gbs, d.from_cache ? " (cached)" : "");
        plan_drive *q = &p->dv[i];
        snprintf(q->path, sizeof q->path, "%s", d.path);
        q->numa = d.numa, q->seq_gbs = d.seq_gbs, q->rand_gbs = d.rand_gbs;
        q->from_cache = d.from_cache;
    }
    return 0;
}

/* MemTotal of /proc/meminfo in GB to 0.1 GB, 0 when unreadable: a worker
 * host's RAM for the plan (dedicated to the workers; the plan keeps 10%
 * back), steady from run to run so the plan is too. */
static double mem_total_gb(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    return (double)(kb / 100000) / 10.0; /* kB to GB (1e6 kB), rounded down to 0.1 */
}

/* --describe NAME: this host's entry of a hosts file. */
static int describe(const plan_cli *c) {
    plan_ctx p;
    memset(&p, 0, sizeof p);
    char err[512];
    int rc = measure_local(c, &p);
    if (!rc) {
        json_t *jd = json_array();
        for (int i = 0; i < p.nd; i++)
            json_array_append_new(jd, json_pack("{s:s, s:i, s:f, s:f}", "path", p.dv[i].path,
                                                "numa", p.dv[i].numa, "seq_gbs", p.dv[i].seq_gbs,
                                                "rand_gbs", p.dv[i].rand_gbs));
        json_t *root =
            json_pack("{s:s, s:i, s:s, s:f, s:i, s:o}", "format", K3_PLAN_HOST_FORMAT, "version", 1,
                      "name", c->describe, "ram_gb", c->ram > 0 ? c->ram : mem_total_gb(),
                      "numa_nodes", k3_numa_nodes(), "drives", jd);
        if (write_json(root, c->out, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            rc = 1;
        }
        json_decref(root);
    }
    free(p.dv);
    return rc;
}

static void print_plan(const plan_ctx *p, const char *out) {
    printf("plan: optimises single-session decode; %d worker%s on %d host%s, %d drive%s, %.1f GB "
           "expert cache\n",
           p->nw, p->nw == 1 ? "" : "s", p->nh, p->nh == 1 ? "" : "s", p->nd, p->nd == 1 ? "" : "s",
           p->cache_all / 1e9);
    for (int k = 0; k < p->nw; k++) {
        const pworker *w = &p->w[k];
        char name[160];
        worker_name(p, k, name, sizeof name);
        printf("plan:   worker %d%s%s: NUMA %d, layers %d-%d, %.2f GB of experts, cache %.2f GB "
               "(%d slots per MoE layer: %.1f misses, %.3f s of reads per layer), drives",
               k, p->multi ? " " : "", p->multi ? name : "", w->numa, w->first, w->last,
               (double)w->expert_bytes / 1e9, w->cache_gb, w->slots, w->misses, w->read_s);
        for (int j = 0; j < w->n_drives; j++) printf(" %d", w->drives[j] + 1);
        printf("\n");
    }
    for (int i = 0; i < p->nd; i++)
        printf("plan:   drive %d %s%s%s: share %.1f%% of the expert bytes (random read %.3f GB/s = "
               "%.1f%% of the total)\n",
               i + 1, p->multi ? p->hosts[p->dv[i].host].name : "", p->multi ? ":" : "",
               p->dv[i].path, 100.0 * p->share[i], p->dv[i].rand_gbs,
               100.0 * p->dv[i].rand_gbs / p->bw_all);
    printf("plan: compute: dense %.2f GB/s, one expert %.2f ms (%d threads%s)\n", p->pc.dense_gbs,
           p->pc.expert_ms, p->pc.threads, p->pc.from_cache ? ", cached" : "");
    printf("plan: terms per token: reads %.3f s (busiest drive per layer, drives at %.3f GB/s "
           "in all) + compute not under the reads %.3f s + compute under the reads beyond them "
           "%.3f s (of %.3f s) + dense layers and head %.3f s",
           p->read_s, p->bw_all, p->fixed_s, p->beyond_s, p->under_s, p->dense_s);
    if (p->multi) printf(" + round trips %.3f s", p->rtt_s);
    printf("\n");
    printf("plan: predicted %.6f s/token (bound: %s; network not included); written to %s\n",
           p->pred, p->read_s >= p->fixed_s + p->under_s ? "drive reads" : "compute", out);
}

int cmd_plan(int argc, char **argv) {
    plan_cli c;
    memset(&c, 0, sizeof c);
    char err[1024];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0, rc = 0;
    plan_ctx p;
    memset(&p, 0, sizeof p);
    plan_host local;
    plan_files pf;
    memset(&pf, 0, sizeof pf);
    k3_status st =
        k3_opts_parse(plan_table, N_PLAN_OPTS, &c, NULL, argc, argv, pos, &npos, err, sizeof err);
    if (!st && c.help) {
        k3_opts_help(stdout, usage_text, plan_table, N_PLAN_OPTS);
        goto out;
    }
    const char *why = st                          ? err
                      : npos                      ? "unexpected argument"
                      : c.describe && !c.drives.n ? "--describe NAME needs --drives D1,.."
                      : c.describe && c.hosts     ? "--describe and --hosts exclude each other"
                      : c.describe                ? NULL
                      : !c.model                  ? "--model DIR is required"
                      : c.hosts && c.drives.n   ? "give the drives in --hosts or --drives, not both"
                      : !c.hosts && !c.drives.n ? "--drives D1,.. (or --hosts FILE) is required"
                                                : NULL;
    if (why) {
        fprintf(stderr, "plan: %s (k3-coordinator plan --help)\n", why);
        rc = 2;
        goto out;
    }
    k3_log_set_level(K3_LOG_WARN);
    if (c.describe) {
        rc = describe(&c);
        goto out;
    }
    k3_model_info mi;
    if (k3_model_info_read(&mi, c.model, NULL, 0, err, sizeof err)) {
        fprintf(stderr, "plan: %s (k3-coordinator doctor --model %s)\n", err, c.model);
        rc = 1;
        goto out;
    }
    p.c = &c;
    if (c.hosts) {
        p.multi = 1;
        if (plan_hosts_read(c.hosts, c.seconds, c.remeasure, &p.hosts, &p.nh, &p.dv, &p.nd, err,
                            sizeof err)) {
            fprintf(stderr, "plan: %s\n", err);
            rc = 1;
            goto out;
        }
        for (int h = 0; h < p.nh && !rc; h++) {
            if (p.hosts[h].ram_gb <= 0) p.hosts[h].ram_gb = c.ram;
            if (p.hosts[h].ram_gb <= 0) {
                fprintf(stderr, "plan: %s: host %s has no ram_gb: give it there or --ram GB\n",
                        c.hosts, p.hosts[h].name);
                rc = 1;
            }
        }
        if (!rc && plan_files_read(&pf, c.model, mi.cfg.n_layers, err, sizeof err)) {
            fprintf(stderr, "plan: %s\n", err);
            rc = 1;
        }
    } else {
        memset(&local, 0, sizeof local);
        snprintf(local.name, sizeof local.name, "local");
        local.port = K3_PLAN_DEFAULT_PORT;
        local.ram_gb = c.ram > 0 ? c.ram : (double)k3_mem_available() / 1e9;
        p.hosts = &local, p.nh = 1;
        rc = measure_local(&c, &p);
    }
    if (!rc && group_workers(&p, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        rc = 1;
    }
    if (rc) goto out;
    p.share = calloc((size_t)p.nd, sizeof *p.share);
    if (!p.share) {
        rc = 1;
        goto out;
    }
    if (k3_plan_compute_get(&mi.cfg, c.seconds < 2 ? c.seconds : 2, c.remeasure, &p.pc, err,
                            sizeof err)) {
        fprintf(stderr, "%s\n", err);
        rc = 1;
        goto out;
    }
    split_and_budget(&p, &mi);
    uint64_t fp = 0;
    if (k3_model_fingerprint_dir(c.model, &mi.cfg, 0, &fp, err, sizeof err)) {
        fprintf(stderr, "plan: %s\n", err);
        rc = 1;
        goto out;
    }
    char fph[20];
    snprintf(fph, sizeof fph, "%016llx", (unsigned long long)fp);
    json_t *root = plan_json(&p, &mi, fph, &pf);
    if (write_json(root, c.out, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        rc = 1;
    }
    json_decref(root);
    if (!rc && strcmp(c.out, "-")) print_plan(&p, c.out);
out:
    free(p.share);
    free(p.dv);
    if (p.multi) free(p.hosts);
    plan_files_free(&pf);
    free(pos);
    k3_opts_free(plan_table, N_PLAN_OPTS, &c);
    return rc;
}
