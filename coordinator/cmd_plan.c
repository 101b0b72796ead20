/* coordinator/cmd_plan.c: `k3-coordinator plan` (cmd_plan.h).
 *
 * The model of a token (single-session decode, what the plan optimises):
 * each MoE layer reads topk experts that miss the cache, K = topk x slot x
 * (1 - hit), hit ~ cache / expert bytes of the worker's layers (routing
 * spread over the experts). A worker's layers are striped over its drives
 * in proportion to their measured 17.5 MB random read speed, so a layer's
 * K bytes come from all of them at once in the same time: K / sum(rand).
 * Layers run one after the other, so s/token = sum over MoE layers of
 * K / bw(worker of the layer). With one worker per NUMA node (drives read
 * by the node they hang off), that sum is smallest when each worker's
 * expert bytes are proportional to its drives' bandwidth, which is also
 * what keeps a prefill pipeline's stages balanced. Compute and network
 * time are not in the figure: it is the drive bound, a lower bound.
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

typedef struct plan_cli {
    char *model;
    k3_opt_list drives;
    double ram;
    char *hosts;
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
     .help = "RAM for weights and caches, GB (0 = MemAvailable now)"},
    {.name = "hosts",
     .flag = "--hosts",
     .type = K3_OPT_STRING,
     .offset = O(hosts),
     .metavar = "FILE",
     .help = "several hosts (not available yet: one host)"},
    {.name = "out",
     .flag = "--out",
     .type = K3_OPT_STRING,
     .offset = O(out),
     .def = "k3-plan.json",
     .metavar = "FILE",
     .help = "the plan file written"},
    {.name = "help", .flag = "--help", .type = K3_OPT_BOOL, .offset = O(help), .help = "this text"},
};
#undef O
#define N_PLAN_OPTS ((int)(sizeof plan_table / sizeof plan_table[0]))

static const char usage_text[] =
    "usage: k3-coordinator plan --model DIR --drives D1,D2,.. [--ram GB] [--out FILE]\n"
    "\n"
    "Measures each drive (sequential and 17.5 MB random O_DIRECT reads, a few\n"
    "seconds each, cached in the drive's .k3_drive.json) and its NUMA node, then\n"
    "writes a plan: one worker per NUMA node with drives, its layer range, drives\n"
    "and expert cache budget, and each drive's share of the expert bytes (in\n"
    "proportion to its measured speed). It optimises single-session decode and\n"
    "prints the predicted s/token with what bounds it.";

typedef struct pworker {
    int numa;
    int drives[K3_MAX_DIRS], n_drives;
    double bw;             /* sum of its drives' rand GB/s */
    int first, last;       /* layers, inclusive */
    uint64_t expert_bytes; /* of its layers */
    double cache_gb;
} pworker;

int cmd_plan(int argc, char **argv) {
    plan_cli c;
    memset(&c, 0, sizeof c);
    char err[1024];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0, rc = 0;
    k3_status st =
        k3_opts_parse(plan_table, N_PLAN_OPTS, &c, NULL, argc, argv, pos, &npos, err, sizeof err);
    if (!st && c.help) {
        k3_opts_help(stdout, usage_text, plan_table, N_PLAN_OPTS);
        goto out;
    }
    if (st || npos || !c.model || !c.drives.n) {
        fprintf(stderr, "plan: %s (k3-coordinator plan --help)\n",
                st     ? err
                : npos ? "unexpected argument"
                       : "--model DIR and --drives D1,.. are required");
        rc = 2;
        goto out;
    }
    if (c.hosts) {
        fprintf(stderr,
                "plan: --hosts %s: multi-host plans are not available yet; plan each host with its "
                "own drives\n",
                c.hosts);
        rc = 2;
        goto out;
    }
    k3_log_set_level(K3_LOG_WARN);
    k3_model_info mi;
    if (k3_model_info_read(&mi, c.model, NULL, 0, err, sizeof err)) {
        fprintf(stderr, "plan: %s (k3-coordinator doctor --model %s)\n", err, c.model);
        rc = 1;
        goto out;
    }
    int nd = c.drives.n;
    k3_drive *dv = calloc((size_t)nd, sizeof *dv);
    for (int i = 0; i < nd && !rc; i++) {
        fprintf(stderr, "plan: measuring %s ...\n", c.drives.items[i]);
        if (k3_drive_probe(&dv[i], c.drives.items[i], 1, c.remeasure, c.seconds, err, sizeof err)) {
            fprintf(stderr, "plan: %s (mount it, or drop it from --drives)\n", err);
            rc = 1;
        } else if (dv[i].seq_gbs <= 0 || dv[i].rand_gbs <= 0) {
            fprintf(stderr, "plan: drive %s: %s (k3-coordinator doctor --drives %s)\n",
                    c.drives.items[i], dv[i].note[0] ? dv[i].note : "no read measured",
                    c.drives.items[i]);
            rc = 1;
        } else {
            fprintf(stderr, "plan:   %s: NUMA %d, seq %.3f GB/s, random 17.5 MB %.3f GB/s%s\n",
                    dv[i].path, dv[i].numa, dv[i].seq_gbs, dv[i].rand_gbs,
                    dv[i].from_cache ? " (cached)" : "");
        }
    }
    if (rc) {
        free(dv);
        goto out;
    }
    /* one worker per NUMA node with drives (unknown node: node 0) */
    pworker w[K3_MAX_DIRS];
    int nw = 0;
    double bw_all = 0;
    for (int i = 0; i < nd; i++) {
        int node = dv[i].numa < 0 ? 0 : dv[i].numa, k;
        for (k = 0; k < nw && w[k].numa != node; k++) {
        }
        if (k == nw) {
            memset(&w[nw], 0, sizeof w[nw]);
            w[nw++].numa = node;
        }
        w[k].drives[w[k].n_drives++] = i;
        w[k].bw += dv[i].rand_gbs;
        bw_all += dv[i].rand_gbs;
    }
    /* layers in order, cut where each worker's share of expert bytes is
     * reached (its bandwidth share); dense layers go with their neighbours */
    const k3_config *cfg = &mi.cfg;
    int L = cfg->n_layers, l = 0;
    if (nw > L) nw = L; /* more NUMA nodes with drives than layers: a toy model */
    uint64_t cum = 0;
    double target = 0;
    for (int k = 0; k < nw; k++) {
        w[k].first = l;
        target += w[k].bw / bw_all * (double)mi.expert_bytes;
        int keep = nw - 1 - k; /* layers left for the later workers, one each */
        do {
            cum += mi.layer_expert[l];
            w[k].expert_bytes += mi.layer_expert[l];
            l++;
        } while (l < L - keep &&
                 (k == nw - 1 || (double)cum + (double)mi.layer_expert[l] / 2 <= target));
        w[k].last = l - 1;
    }
    /* RAM: dense weights first, a 10% reserve, the rest is expert cache */
    double ram = c.ram > 0 ? c.ram * 1e9 : (double)k3_mem_available();
    double cache = ram * 0.9 - (double)mi.dense_resident;
    if (cache < 0) cache = 0;
    double pred = 0;
    for (int k = 0; k < nw; k++) {
        w[k].cache_gb =
            mi.expert_bytes ? cache * (double)w[k].expert_bytes / (double)mi.expert_bytes / 1e9 : 0;
        double hit = w[k].expert_bytes ? w[k].cache_gb * 1e9 / (double)w[k].expert_bytes : 1;
        if (hit > 1) hit = 1;
        for (int q = w[k].first; q <= w[k].last; q++)
            if (cfg->is_moe[q])
                pred += (double)cfg->topk * (double)mi.slot_bytes * (1 - hit) / (w[k].bw * 1e9);
    }
    uint64_t fp = 0;
    if (k3_model_fingerprint_dir(c.model, cfg, 0, &fp, err, sizeof err)) {
        fprintf(stderr, "plan: %s\n", err);
        free(dv);
        rc = 1;
        goto out;
    }
    char fph[20];
    snprintf(fph, sizeof fph, "%016llx", (unsigned long long)fp);
    json_t *root = json_object(), *jd = json_array(), *jw = json_array();
    json_object_set_new(root, "format", json_string("k3shard-plan"));
    json_object_set_new(root, "version", json_integer(1));
    json_object_set_new(root, "model", json_string(c.model));
    json_object_set_new(root, "model_fingerprint", json_string(fph));
    json_object_set_new(root, "optimises", json_string("single-session decode"));
    /* a drive's share of all expert bytes: its worker's share, split over
     * the worker's drives by speed */
    double *share = calloc((size_t)nd, sizeof *share);
    for (int q = 0; q < nw; q++)
        for (int j = 0; j < w[q].n_drives; j++) {
            int i = w[q].drives[j];
            share[i] = mi.expert_bytes ? (double)w[q].expert_bytes / (double)mi.expert_bytes *
                                             dv[i].rand_gbs / w[q].bw
                                       : 1.0 / nd;
        }
    for (int i = 0; i < nd; i++) {
        json_array_append_new(jd, json_pack("{s:s, s:f, s:f, s:i, s:f}", "path", dv[i].path,
                                            "seq_gbs", dv[i].seq_gbs, "rand_gbs", dv[i].rand_gbs,
                                            "numa", dv[i].numa, "share", share[i]));
    }
    for (int k = 0; k < nw; k++) {
        json_t *dr = json_array();
        for (int j = 0; j < w[k].n_drives; j++)
            json_array_append_new(dr, json_integer(w[k].drives[j]));
        json_array_append_new(jw, json_pack("{s:i, s:[i,i], s:o, s:f}", "numa", w[k].numa, "layers",
                                            w[k].first, w[k].last, "drives", dr, "cache_gb",
                                            w[k].cache_gb));
    }
    json_object_set_new(root, "drives", jd);
    json_object_set_new(root, "workers", jw);
    json_object_set_new(root, "predicted_s_per_token", json_real(pred));
    json_object_set_new(root, "bound",
                        json_string("drive reads (compute and network not included)"));
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", c.out);
    if (json_dump_file(root, tmp, JSON_INDENT(2)) != 0 || rename(tmp, c.out) != 0) {
        fprintf(stderr, "plan: cannot write %s\n", c.out);
        rc = 1;
    }
    json_decref(root);
    if (!rc) {
        printf("plan: optimises single-session decode; %d worker%s, %d drive%s, %.1f GB expert "
               "cache\n",
               nw, nw == 1 ? "" : "s", nd, nd == 1 ? "" : "s", cache / 1e9);
        for (int k = 0; k < nw; k++) {
            printf("plan:   worker %d: NUMA %d, layers %d-%d, %.2f GB of experts, cache %.2f GB, "
                   "drives",
                   k, w[k].numa, w[k].first, w[k].last, (double)w[k].expert_bytes / 1e9,
                   w[k].cache_gb);
            for (int j = 0; j < w[k].n_drives; j++) printf(" %d", w[k].drives[j] + 1);
            printf("\n");
        }
        for (int i = 0; i < nd; i++)
            printf("plan:   drive %d %s: share %.1f%% of the expert bytes (random read %.3f GB/s = "
                   "%.1f%% of the total)\n",
                   i + 1, dv[i].path, 100.0 * share[i], dv[i].rand_gbs,
                   100.0 * dv[i].rand_gbs / bw_all);
        printf("plan: predicted %.6f s/token (bound: drive reads at %.3f GB/s in all; compute and "
               "network add to it); written to %s\n",
               pred, bw_all, c.out);
    }
    free(share);
    free(dv);
out:
    free(pos);
    k3_opts_free(plan_table, N_PLAN_OPTS, &c);
    return rc;
}
