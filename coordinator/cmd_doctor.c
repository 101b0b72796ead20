/* coordinator/cmd_doctor.c: `k3-coordinator doctor` (cmd_doctor.h). */
#include "coordinator/cmd_doctor.h"

#include <dirent.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/ckpt/config.h"
#include "common/ckpt/container.h"
#include "common/engine/model.h"
#include "common/text/tokenizer.h"
#include "coordinator/doctor_workers.h"
#include "coordinator/drives.h"
#include "coordinator/model_info.h"
#include "proto/link.h"

typedef struct doctor_cli {
    char *model;
    k3_opt_list drives;
    k3_opt_list workers;
    double seconds;
    int remeasure;
    int deep;
    int help;
} doctor_cli;

#define O(f) offsetof(doctor_cli, f)
static const k3_opt doctor_table[] = {
    K3_DRIVE_OPT_ROWS(doctor_cli, model, drives, seconds, remeasure,
                      "model directory: a snapshot or a repacked container"),
    {.name = "workers",
     .flag = "--workers",
     .type = K3_OPT_LIST,
     .offset = O(workers),
     .max = 64,
     .metavar = "tcp://H:P,..",
     .help = "worker endpoints: a STATS probe each (protocol version, build, layers; no "
             "registration), then a HELLO (model, settings) only to a worker no coordinator "
             "holds"},
    {.name = "deep",
     .flag = "--deep",
     .type = K3_OPT_BOOL,
     .offset = O(deep),
     .def = "0",
     .help = "load every dense tensor of a snapshot too (minutes on the real model)"},
    {.name = "help", .flag = "--help", .type = K3_OPT_BOOL, .offset = O(help), .help = "this text"},
};
#undef O
#define N_DOCTOR_OPTS ((int)(sizeof doctor_table / sizeof doctor_table[0]))

static const char usage_text[] =
    "usage: k3-coordinator doctor --model DIR [--drives D1,D2,..] [options]\n"
    "\n"
    "Checks what a run needs and prints one line per check, with the fix for\n"
    "each one that fails: the model's files against its index, a container's\n"
    "prepared matrices, the tokenizer, RAM and the budgets it leaves, open-file\n"
    "and memlock limits, NUMA, and each drive (O_DIRECT, free space, read GB/s).\n"
    "Exit status 0 only when every check passes.";

typedef struct report {
    int fails, passes;
} report;

static void line(report *r, int ok, const char *what, const char *fix, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void line(report *r, int ok, const char *what, const char *fix, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%-4s  %-10s ", ok > 0 ? "PASS" : ok == 0 ? "FAIL" : "SKIP", what);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (ok == 0 && fix) printf("      %-10s fix: %s\n", "", fix);
    if (ok == 0) r->fails++;
    if (ok > 0) r->passes++;
}

static double gb(uint64_t b) { return (double)b / 1e9; }

/* "1.56 TB" / "12.3 GB" / "4.5 MB": one of 8 rotating buffers (one thread) */
static const char *hs(uint64_t b) {
    static char buf[8][32];
    static int k;
    char *o = buf[k++ & 7];
    if (b >= 1000000000000ull)
        snprintf(o, 32, "%.2f TB", (double)b / 1e12);
    else if (b >= 1000000000ull)
        snprintf(o, 32, "%.1f GB", (double)b / 1e9);
    else
        snprintf(o, 32, "%.1f MB", (double)b / 1e6);
    return o;
}

/* *.tmp left by an interrupted repack: the first name, and how many */
static int leftover_tmp(const char *dir, char *first, size_t n) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int c = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l > 16 && !strcmp(e->d_name + l - 16, ".safetensors.tmp")) {
            if (!c) snprintf(first, n, "%s", e->d_name);
            c++;
        }
    }
    closedir(d);
    return c;
}

/* Bytes of *.safetensors files directly in dir. */
static uint64_t shard_bytes_in(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    uint64_t s = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t l = strlen(e->d_name);
        if (l > 12 && !strcmp(e->d_name + l - 12, ".safetensors")) {
            char p[4400];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            struct stat sb;
            if (stat(p, &sb) == 0) s += (uint64_t)sb.st_size;
        }
    }
    closedir(d);
    return s;
}

static void check_model(report *r, const doctor_cli *c, k3_model_info *mi, int *have_mi) {
    char err[1024], fix[1400];
    *have_mi = 0;
    k3_config cfg;
    if (k3_config_load(&cfg, c->model, 0, err, sizeof err)) {
        snprintf(fix, sizeof fix,
                 "point --model at the snapshot or container directory (it holds config.json)");
        line(r, 0, "config", fix, "%s", err);
        return;
    }
    int kda = 0, moe = 0;
    for (int l = 0; l < cfg.n_layers; l++) kda += cfg.is_kda[l], moe += cfg.is_moe[l];
    line(r, 1, "config", NULL, "%d layers (%d KDA, %d MLA; %d MoE), %d experts top-%d, vocab %d",
         cfg.n_layers, kda, cfg.n_layers - kda, moe, cfg.n_experts, cfg.topk, cfg.vocab);

    char tmpn[300];
    int ntmp = leftover_tmp(c->model, tmpn, sizeof tmpn);
    snprintf(fix, sizeof fix,
             "an interrupted repack: re-run the same `k3-coordinator repack SRC %s` (it resumes)",
             c->model);
    if (ntmp) {
        line(r, 0, "files", fix, "%d unfinished shard%s (%s)", ntmp, ntmp == 1 ? "" : "s", tmpn);
        return;
    }
    if (k3_model_info_read(mi, c->model, NULL, 0, err, sizeof err)) {
        snprintf(fix, sizeof fix,
                 "re-download the named shard (snapshot) or delete it and re-run "
                 "`k3-coordinator repack SRC %s` (container)",
                 c->model);
        line(r, 0, "files", fix, "%s", err);
        return;
    }
    int is_ct = 0;
    if (k3_container_check(c->model, &is_ct, err, sizeof err)) {
        snprintf(fix, sizeof fix,
                 "a shard is missing, extra or changed since the index was written: restore it, "
                 "or re-run `k3-coordinator repack SRC %s` to finish the container and rebuild "
                 "its index",
                 c->model);
        line(r, 0, "files", fix, "%s", err);
        return;
    }
    *have_mi = 1;
    line(r, 1, "files", NULL,
         "%d shards, %s, every tensor in the shard the index names, headers valid, no shard "
         "truncated",
         mi->n_shards, hs(mi->total_bytes));

    if (!mi->is_container && !c->deep) {
        line(r, 1, "container", NULL,
             "a snapshot: the engine quantizes %s of dense weights at each load "
             "(`k3-coordinator repack` does it once; --deep loads them now)",
             hs(mi->dense_resident));
    } else {
        k3_model_opts mo;
        k3_model_opts_default(&mo);
        mo.model_dir = c->model;
        mo.want_global = 1;
        mo.expert_gb = 0;
        mo.threads = 1;
        mo.load_threads = 2;
        mo.mmap = mi->is_container; /* maps: every shape and sidecar checked, nothing read */
        k3_model *m = NULL;
        double t0 = k3_now_s();
        if (k3_model_open(&m, &mo, err, sizeof err)) {
            snprintf(fix, sizeof fix, "%s",
                     mi->is_container
                         ? "the container is damaged: delete the named tensor's shard and "
                           "re-run `k3-coordinator repack SRC DIR` (it rewrites only that "
                           "shard), then `repack --verify-full`"
                         : "the snapshot is damaged: re-download the named tensor's shard");
            line(r, 0, "container", fix, "%s", err);
        } else {
            line(r, 1, "container", NULL,
                 "%s: every layer and the head open (shapes, dtypes, .qs sidecars, expert "
                 "tables) in %.2f s",
                 mi->is_container ? "repacked container" : "snapshot", k3_now_s() - t0);
        }
        k3_model_close(&m);
    }
}

static void check_tokenizer(report *r, const doctor_cli *c) {
    char err[1024];
    k3_tok *tok = NULL;
    if (k3_tok_open(&tok, c->model, err, sizeof err)) {
        line(r, 0, "tokenizer", "copy tiktoken.model and tokenizer_config.json from the snapshot",
             "%s", err);
        return;
    }
    line(r, 1, "tokenizer", NULL, "tiktoken.model + tokenizer_config.json: %d ids",
         (int)k3_tok_n_vocab(tok));
    k3_tok_close(&tok);
}

static void check_host(report *r, const k3_model_info *mi, int have_mi, int n_shards) {
    uint64_t avail = k3_mem_available();
    if (have_mi) {
        uint64_t dense = mi->dense_resident, reserve = avail / 10;
        char fix[300];
        snprintf(fix, sizeof fix,
                 "free RAM, or split the layers over workers on other hosts (the dense weights "
                 "need %.1f GB)",
                 gb(dense));
        if (avail < dense + reserve)
            line(r, 0, "ram", fix, "%.1f GB available < %.1f GB of dense weights + 10%% reserve",
                 gb(avail), gb(dense));
        else
            line(r, 1, "ram", NULL,
                 "%s available: dense weights %s, 10%% reserve, leaves %s for the "
                 "expert cache (--expert-gb, %.0f experts of %.1f MB)",
                 hs(avail), hs(dense), hs(avail - dense - reserve),
                 mi->slot_bytes ? (double)(avail - dense - reserve) / (double)mi->slot_bytes : 0,
                 (double)mi->slot_bytes / 1e6);
    } else {
        line(r, -1, "ram", NULL, "%.1f GB available; budgets need a readable model", gb(avail));
    }
    struct rlimit nf, ml;
    getrlimit(RLIMIT_NOFILE, &nf);
    getrlimit(RLIMIT_MEMLOCK, &ml);
    /* two fds per shard (buffered + O_DIRECT), sockets, logs */
    rlim_t need = (rlim_t)(2 * n_shards + 256);
    char fix[200], mls[32];
    snprintf(fix, sizeof fix, "raise it: `ulimit -n %llu` (or LimitNOFILE= in the unit)",
             (unsigned long long)need);
    if (ml.rlim_cur == RLIM_INFINITY)
        snprintf(mls, sizeof mls, "unlimited");
    else
        snprintf(mls, sizeof mls, "%.0f MB", (double)ml.rlim_cur / 1e6);
    line(r, nf.rlim_cur >= need, "limits", fix,
         "open files %llu (need >= %llu for %d shards); memlock %s (not needed: nothing is "
         "locked)",
         (unsigned long long)nf.rlim_cur, (unsigned long long)need, n_shards, mls);
    line(r, 1, "numa", NULL, "%d NUMA node%s (hwloc)", k3_numa_nodes(),
         k3_numa_nodes() == 1 ? "" : "s");
}

static void check_drives(report *r, const doctor_cli *c, const k3_model_info *mi, int have_mi) {
    for (int i = 0; i < c->drives.n; i++) {
        const char *p = c->drives.items[i];
        char what[64], err[512], fix[600];
        snprintf(what, sizeof what, "drive %d", i + 1);
        k3_drive d;
        if (k3_drive_probe(&d, p, 1, c->remeasure, c->seconds, err, sizeof err)) {
            snprintf(fix, sizeof fix,
                     "mount the drive and create the directory (mkdir -p %s), or drop it from "
                     "--drives",
                     p);
            line(r, 0, what, fix, "%s", err);
            continue;
        }
        uint64_t have = shard_bytes_in(p);
        uint64_t need = have_mi ? mi->total_bytes / (uint64_t)c->drives.n : 0;
        need = need > have ? need - have : 0;
        if (d.free_bytes < need) {
            snprintf(fix, sizeof fix,
                     "free %.1f GB on %s, or add a drive (each of %d holds ~%.1f GB of the model)",
                     gb(need - d.free_bytes), p, c->drives.n,
                     gb(mi->total_bytes / (uint64_t)c->drives.n));
            line(r, 0, what, fix, "%s: %s free < %s needed", p, hs(d.free_bytes), hs(need));
            continue;
        }
        if (!d.o_direct) {
            snprintf(fix, sizeof fix,
                     "use a file system with O_DIRECT (ext4, xfs; not tmpfs or some FUSE), or run "
                     "with --direct 0 (slower, uses the page cache)");
            line(r, 0, what, fix, "%s: %s", p, d.note);
            continue;
        }
        if (d.seq_gbs <= 0 || d.rand_gbs <= 0) {
            line(r, 0, what, "check the drive's health (dmesg) and that it is writable", "%s: %s",
                 p, d.note[0] ? d.note : "no read measured");
            continue;
        }
        char numa[16];
        if (d.numa >= 0)
            snprintf(numa, sizeof numa, "%d", d.numa);
        else
            snprintf(numa, sizeof numa, "unknown");
        line(r, 1, what, NULL,
             "%s on %s, NUMA node %s, O_DIRECT ok, %s free, seq %.3f GB/s, 17.5 MB random "
             "%.3f GB/s%s",
             p, d.dev[0] ? d.dev : "?", numa, hs(d.free_bytes), d.seq_gbs, d.rand_gbs,
             d.from_cache ? " (cached; --remeasure)" : "");
    }
}

/* One STATS probe per worker, then a HELLO (model and settings) only to an
 * idle one (doctor_workers.h): a running coordinator is never displaced. */
static void check_workers(report *r, const doctor_cli *c) {
    if (!c->workers.n) return;
    k3_config cfg;
    uint64_t fp = 0;
    char err[1024];
    int have_fp = !k3_config_load(&cfg, c->model, 0, err, sizeof err) &&
                  !k3_model_fingerprint_dir(c->model, &cfg, 0, &fp, err, sizeof err);
    for (int i = 0; i < c->workers.n; i++) {
        const char *ep = c->workers.items[i];
        k3_worker_probe pr;
        k3_status st = k3_probe_worker_stats(ep, 3000, &pr, err, sizeof err);
        const proto_stats_ok *s = &pr.stats;
        char id[768] = "";
        if (!st)
            snprintf(id, sizeof id, "%s: %s, build '%s', protocol %u.%u, layers %u-%u, %.2f GB/s",
                     ep, s->name, s->build, pr.ver_major, pr.ver_minor, s->layers[0],
                     s->layers[1] ? s->layers[1] - 1 : 0, s->read_gbps);
        if (st) {
            line(r, 0, "worker",
                 st == K3_ERR_TIMEOUT ? "start the worker (k3-worker --listen EP ...), or check "
                                        "the endpoint and the firewall"
                                      : "use the endpoint the worker listens on",
                 "%s", err);
        } else if (pr.ver_major != PROTO_VERSION_MAJOR) {
            line(r, 0, "worker", "run the same k3shard release on the coordinator and workers",
                 "%s: protocol %u.%u, this coordinator speaks %d.%d", ep, pr.ver_major,
                 pr.ver_minor, PROTO_VERSION_MAJOR, PROTO_VERSION_MINOR);
        } else if (s->build[0] && k3_link_check_build(k3_link_build(), "coordinator", s->build,
                                                      "worker", err, sizeof err)) {
            line(r, 0, "worker", "run the same k3shard build on the coordinator and workers",
                 "%s: %s", ep, err);
        } else if (s->registered) {
            line(r, 1, "worker", NULL,
                 "%s; a coordinator is registered: model and settings not checked (no HELLO, "
                 "so its sessions stay)",
                 id);
        } else if (!have_fp) {
            line(r, 0, "worker", "fix the model first (the lines above)",
                 "%s; cannot check its model: no model fingerprint", id);
        } else if ((st = k3_probe_worker_hello(ep, fp, 3000, &pr, err, sizeof err))) {
            line(r, 0, "worker", "check the worker's log", "%s; its HELLO: %s", id, err);
        } else if (pr.accepted) {
            line(r, 1, "worker", NULL, "%s", id);
        } else if (strstr(pr.refusal, "fingerprint")) {
            line(r, 0, "worker", "start the worker with this --model (and the same K3_TOPP)",
                 "%s: protocol %u.%u, refused this model: %s", ep, pr.ver_major, pr.ver_minor,
                 pr.refusal);
        } else {
            line(r, 1, "worker", NULL,
                 "%s: protocol %u.%u, same model; its settings differ from the defaults (%s): "
                 "start the coordinator with the worker's",
                 ep, pr.ver_major, pr.ver_minor, pr.refusal);
        }
    }
}

int cmd_doctor(int argc, char **argv) {
    doctor_cli c;
    memset(&c, 0, sizeof c);
    char err[1024];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0, rc = 0;
    k3_status st = k3_opts_parse(doctor_table, N_DOCTOR_OPTS, &c, NULL, argc, argv, pos, &npos, err,
                                 sizeof err);
    if (!st && c.help) {
        k3_opts_help(stdout, usage_text, doctor_table, N_DOCTOR_OPTS);
        goto out;
    }
    if (st || npos || !c.model) {
        fprintf(stderr, "doctor: %s (k3-coordinator doctor --help)\n",
                st     ? err
                : npos ? "unexpected argument"
                       : "--model DIR is required");
        rc = 2;
        goto out;
    }
    k3_log_set_level(K3_LOG_WARN);
    printf("doctor: %s\n", c.model);
    report r = {0, 0};
    k3_model_info mi;
    int have_mi = 0;
    check_model(&r, &c, &mi, &have_mi);
    check_tokenizer(&r, &c);
    check_host(&r, &mi, have_mi, have_mi ? mi.n_shards : 128);
    check_drives(&r, &c, &mi, have_mi);
    check_workers(&r, &c);
    printf("doctor: %d passed, %d failed\n", r.passes, r.fails);
    rc = r.fails ? 1 : 0;
out:
    free(pos);
    k3_opts_free(doctor_table, N_DOCTOR_OPTS, &c);
    return rc;
}
