/* coordinator/cmd_repack.c: `k3-coordinator repack` (cmd_repack.h). */
#include "coordinator/cmd_repack.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/opts.h"
#include "common/ckpt/config.h"
#include "common/ckpt/container.h"
#include "common/engine/model.h"
#include "common/experts/experts.h"
#include "common/experts/placement.h"
#include "coordinator/cmd_place.h"

typedef struct repack_cli {
    int bits, mla_bits, head_bits;
    k3_opt_list shards;
    int verify_full;
    char *placement;
    int copy;
    int quiet;
    int help;
} repack_cli;

#define O(f) offsetof(repack_cli, f)
static const k3_opt repack_table[] = {
    {.name = "bits",
     .flag = "--bits",
     .type = K3_OPT_INT,
     .offset = O(bits),
     .def = "8",
     .n_choices = 2,
     .choices = {4, 8},
     .metavar = "N",
     .help = "KDA q/k/v/g/o, latent, shared experts, dense MLP: int8 per-row or int4-g64"},
    {.name = "mla-bits",
     .flag = "--mla-bits",
     .type = K3_OPT_INT,
     .offset = O(mla_bits),
     .def = "0",
     .n_choices = 4,
     .choices = {0, 4, 8, 32},
     .metavar = "N",
     .help = "MLA projections, o and g included (0 = max(bits, 8); 32 = keep BF16)"},
    {.name = "head-bits",
     .flag = "--head-bits",
     .type = K3_OPT_INT,
     .offset = O(head_bits),
     .def = "0",
     .n_choices = 4,
     .choices = {0, 4, 8, 32},
     .metavar = "N",
     .help = "lm_head (0 = max(bits, 8); 32 = keep BF16)"},
    {.name = "shards",
     .flag = "--shards",
     .type = K3_OPT_LIST,
     .offset = O(shards),
     .max = K3_ST_MAX_SHARDS,
     .metavar = "1,2,94",
     .help = "convert only these source shards (by number); the index covers all done"},
    {.name = "verify-full",
     .flag = "--verify-full",
     .type = K3_OPT_BOOL,
     .offset = O(verify_full),
     .def = "0",
     .help = "re-read every expert byte of source and container and compare"},
    {.name = "placement",
     .flag = "--placement",
     .type = K3_OPT_STRING,
     .offset = O(placement),
     .metavar = "PLAN.json",
     .help = "then stripe the experts over a plan's drives (k3-coordinator place): "
             "<drive>/k3-stripe/ and <first drive>/k3-stripe/placement.json"},
    {.name = "copy",
     .flag = "--copy",
     .type = K3_OPT_BOOL,
     .offset = O(copy),
     .def = "0",
     .help = "with --placement: copy the expert bytes even where a hard link would do"},
    {.name = "quiet",
     .flag = "--quiet",
     .type = K3_OPT_BOOL,
     .offset = O(quiet),
     .def = "0",
     .help = "no progress output"},
    {.name = "help", .flag = "--help", .type = K3_OPT_BOOL, .offset = O(help), .help = "this text"},
};
#undef O
#define N_REPACK_OPTS ((int)(sizeof repack_table / sizeof repack_table[0]))

static const char usage_text[] =
    "usage: k3-coordinator repack SRC DST [options]\n"
    "\n"
    "Converts a Hugging Face Kimi K3 snapshot (SRC) into a repacked container (DST):\n"
    "routed experts copied byte-identical in id order (one read per expert), the\n"
    "dense matrices quantized exactly as the engine would at load (U8 + <name>.qs\n"
    "F32 scales), the vision tower dropped. One streaming read of SRC. Each shard\n"
    "is written to <name>.tmp and renamed, so an interrupted run resumes where it\n"
    "stopped; the index is rebuilt from every completed shard on every run.\n"
    "With --placement PLAN.json (a plan from k3-coordinator plan, or a placement file)\n"
    "the stream also writes each expert into its drive's k3-stripe/<shard> (the layout\n"
    "k3-coordinator place makes, no second read; a drive on DST's file system gets a\n"
    "hard link afterwards); run with --placement <first drive>/k3-stripe/placement.json.";

/* The drives and shares of --placement: a plan file (k3-coordinator plan,
 * made for SRC) or a placement file (its drives and weights; the container
 * is another model, so the placement is rebuilt for it). */
typedef struct repack_plan {
    char **paths; /* [n] */
    double w[K3_MAX_DIRS];
    int n;
} repack_plan;

static k3_status plan_drives(const char *src, const char *path, repack_plan *p, char *err,
                             size_t errlen) {
    k3_config cfg;
    uint64_t fp;
    k3_status st = k3_config_load(&cfg, src, 0, err, errlen);
    if (st == K3_OK) st = k3_model_fingerprint_dir(src, &cfg, 0, &fp, err, errlen);
    if (st != K3_OK) return st;
    k3_placement *pl = NULL;
    char perr[512];
    if (k3_placement_load(&pl, path, perr, sizeof perr) == K3_OK) {
        if (k3_placement_split(pl)) {
            k3_placement_free(&pl);
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "--placement %s is byte-split (placement version 2): repack writes "
                           "whole experts per drive; repack without --placement, then run "
                           "k3-coordinator place --split on the result",
                           path);
        }
        p->n = k3_placement_drives(pl);
        p->paths = k3_xcalloc((size_t)p->n, sizeof *p->paths);
        for (int d = 0; d < p->n; d++)
            p->paths[d] = k3_xstrdup(k3_placement_drive_path(pl, d)),
            p->w[d] = k3_placement_drive_weight(pl, d);
        k3_placement_free(&pl);
        return K3_OK;
    }
    return k3_place_read_plan(path, fp, &p->paths, p->w, &p->n, err, errlen);
}

/* The placement the stream writes by: built from SRC's config with the
 * plan's drives and weights (no usage history), as place_container's
 * k3_place_layout builds it again for the container's fingerprint: the
 * same experts on the same drives. */
static k3_status stream_placement(const char *src, const repack_plan *p, k3_placement **out,
                                  char *err, size_t errlen) {
    k3_config cfg;
    k3_status st = k3_config_load(&cfg, src, 0, err, errlen);
    if (st != K3_OK) return st;
    k3_expert_geom g;
    k3_expert_geom_init(&g, &cfg);
    k3_place_input in = {.drives = (const char *const *)p->paths,
                         .n_drives = p->n,
                         .weight = p->w,
                         .fingerprint = 0,
                         .n_layers = cfg.n_layers,
                         .n_experts = cfg.n_experts,
                         .is_moe = cfg.is_moe,
                         .expert_bytes = g.total,
                         .usage = NULL};
    return k3_placement_build(out, &in, err, errlen);
}

/* Completes the stripes over the plan's drives and writes the placement
 * file (cmd_place.c): the drive files the stream wrote are kept (their
 * .done records), a drive on DST's file system gets hard links. */
static k3_status place_container(const char *dst, const repack_plan *p, int copy, int quiet,
                                 char *err, size_t errlen) {
    char out[K3_MAX_PATH + 64];
    snprintf(out, sizeof out, "%s/%s/placement.json", p->paths[0], K3_PLACEMENT_SUBDIR);
    k3_place_req req = {.model = dst,
                        .drives = (const char *const *)p->paths,
                        .n_drives = p->n,
                        .weight = p->w,
                        .out = out,
                        .force_copy = copy,
                        .progress = !quiet};
    return k3_place_layout(&req, err, errlen);
}

int cmd_repack(int argc, char **argv) {
    repack_cli c;
    memset(&c, 0, sizeof c);
    char err[1024];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0, rc = 0;
    int *nums = NULL;
    repack_plan plan = {0};
    k3_placement *spl = NULL; /* --placement: the drives the stream writes by */
    k3_status st = k3_opts_parse(repack_table, N_REPACK_OPTS, &c, NULL, argc, argv, pos, &npos, err,
                                 sizeof err);
    if (!st && c.help) {
        k3_opts_help(stdout, usage_text, repack_table, N_REPACK_OPTS);
        goto out;
    }
    if (st) {
        fprintf(stderr, "repack: %s (k3-coordinator repack --help)\n", err);
        rc = 2;
        goto out;
    }
    if (npos != 2) {
        fprintf(stderr,
                "repack: expected SRC and DST, got %d argument%s (k3-coordinator repack "
                "--help)\n",
                npos, npos == 1 ? "" : "s");
        rc = 2;
        goto out;
    }
    /* the plan is read before the long conversion, so a bad one fails fast */
    if (c.placement && (st = plan_drives(pos[0], c.placement, &plan, err, sizeof err))) {
        fprintf(stderr, "repack: --placement %s: %s\n", c.placement, err);
        rc = 2;
        goto out;
    }
    nums = calloc((size_t)c.shards.n + 1, sizeof *nums);
    for (int i = 0; i < c.shards.n; i++) {
        char *end;
        long v = strtol(c.shards.items[i], &end, 10);
        if (end == c.shards.items[i] || *end || v < 1 || v > K3_ST_MAX_SHARDS) {
            fprintf(stderr, "repack: --shards: \"%s\" is not a shard number in 1..%d\n",
                    c.shards.items[i], K3_ST_MAX_SHARDS);
            rc = 2;
            goto out;
        }
        nums[i] = (int)v;
    }
    if (c.placement && (st = stream_placement(pos[0], &plan, &spl, err, sizeof err))) {
        fprintf(stderr, "repack: --placement %s: %s\n", c.placement, err);
        rc = 2;
        goto out;
    }
    k3_repack_opts ro = {.src = pos[0],
                         .dst = pos[1],
                         .bits = c.bits,
                         .mla_bits = c.mla_bits ? c.mla_bits : (c.bits > 8 ? c.bits : 8),
                         .head_bits = c.head_bits ? c.head_bits : (c.bits > 8 ? c.bits : 8),
                         .shards = c.shards.n ? nums : NULL,
                         .n_shards = c.shards.n,
                         .verify_full = c.verify_full,
                         .placement = spl,
                         .place_copy = c.copy,
                         .progress = c.quiet     ? 0
                                     : isatty(2) ? 2
                                                 : 1};
    fprintf(stderr, "repack: %s -> %s, bits %d, mla-bits %d, head-bits %d%s\n", ro.src, ro.dst,
            ro.bits, ro.mla_bits, ro.head_bits, ro.verify_full ? ", verify-full" : "");
    k3_repack_stats s;
    st = k3_repack(&ro, &s, err, sizeof err);
    if (st) {
        fprintf(stderr, "repack: %s\n", err);
        rc = 1;
        goto out;
    }
    fprintf(stderr,
            "repack: done in %.1f s: %d shard%s written, %d already complete, %d missing; %d "
            "matrices quantized, %d vision tensors dropped; read %.3f GB, wrote %.3f GB; index: "
            "%d shards, %.3f GB\n",
            s.seconds, s.shards_written, s.shards_written == 1 ? "" : "s", s.shards_skipped,
            s.shards_missing, s.tensors_quantized, s.tensors_dropped, (double)s.bytes_read / 1e9,
            (double)s.bytes_written / 1e9, s.index_shards, (double)s.index_total / 1e9);
    if (ro.verify_full)
        fprintf(stderr, "repack: verify-full: %llu expert tensors identical to the source\n",
                (unsigned long long)s.experts_verified);
    if (c.placement && (st = place_container(ro.dst, &plan, c.copy, c.quiet, err, sizeof err))) {
        fprintf(stderr, "repack: --placement %s: %s (re-run: complete files are kept)\n",
                c.placement, err);
        rc = 1;
        goto out;
    }
out:
    k3_placement_free(&spl);
    for (int d = 0; d < plan.n; d++) free(plan.paths[d]);
    free(plan.paths);
    free(nums);
    free(pos);
    k3_opts_free(repack_table, N_REPACK_OPTS, &c);
    return rc;
}
