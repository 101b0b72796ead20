/* coordinator/cmd_place.c: `k3-coordinator place` and the layout step that
 * `--local N --stripe` shares (cmd_place.h).
 *
 * Owns: the placement it builds (freed before returning), the drive files it
 * writes (<drive>/k3-stripe/<shard>, their .tmp while written, and
 * <drive>/k3-stripe/.done, one line "HASH SIZE NAME" per complete file: the
 * FNV-1a of the shard size and the byte ranges it holds). Borrows: the
 * request. Threads: main thread only.
 *
 * A drive file has the checkpoint shard's size and offsets (placement.h):
 * where the drive is on the shard's own file system it is a hard link to
 * the shard (no bytes move; the drive then holds every expert of the shard,
 * its own among them), else a sparse file holding the safetensors header and
 * the six tensors of each of the drive's experts. A rerun keeps complete
 * files whose record matches and redoes the rest, so an interrupted layout
 * resumes at file granularity.
 */
#include "coordinator/cmd_place.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/ckpt/config.h"
#include "common/ckpt/safetensors.h"
#include "common/engine/engine_opts.h"
#include "common/engine/model.h"
#include "common/experts/experts.h"
#include "common/experts/placement.h"

#define PLACE_BUF (16u << 20) /* copy buffer: 16 MiB, a few reads per expert */

/* One byte range of a shard that a drive must hold. */
typedef struct prange {
    int drive, shard;
    uint64_t off, len;
} prange;

static int prange_cmp(const void *pa, const void *pb) {
    const prange *a = pa, *b = pb;
    if (a->drive != b->drive) return a->drive - b->drive;
    if (a->shard != b->shard) return a->shard - b->shard;
    return a->off < b->off ? -1 : a->off > b->off;
}

/* Progress on stderr: a redrawn line on a terminal, else a line per 10%. */
typedef struct progress {
    int on, tty, last_decile;
    uint64_t done, total;
    double t0, last;
} progress;

static void prog_show(progress *p, int final) {
    if (!p->on) return;
    double now = k3_now_s();
    int decile = p->total ? (int)(p->done * 10 / p->total) : 10;
    if (!final && (p->tty ? now - p->last < 0.25 : decile == p->last_decile)) return;
    p->last = now, p->last_decile = decile;
    double el = now - p->t0, rate = el > 0 ? (double)p->done / el : 0;
    double eta = rate > 0 ? (double)(p->total - p->done) / rate : 0;
    int w = 30, fill = p->total ? (int)((double)w * (double)p->done / (double)p->total) : w;
    char bar[40];
    for (int i = 0; i < w; i++) bar[i] = i < fill ? '#' : '.';
    bar[w] = 0;
    fprintf(stderr, "%splace: [%s] %.2f / %.2f GB  %.2f GB/s  ETA %.0f s%s", p->tty ? "\r" : "",
            bar, (double)p->done / 1e9, (double)p->total / 1e9, rate / 1e9, eta,
            p->tty && !final ? "" : "\n");
}

/* Copies [off, off + len) from in to out at the same offset. */
static k3_status copy_range(int in, int out, uint64_t off, uint64_t len, unsigned char *buf,
                            progress *pg, const char *src, const char *dst, char *err,
                            size_t errlen) {
    while (len > 0) {
        size_t n = len < PLACE_BUF ? (size_t)len : PLACE_BUF;
        ssize_t r = pread(in, buf, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return k3_errf(K3_ERR_IO, err, errlen, "place: %s: %s at offset %llu", src,
                           r < 0 ? strerror(errno) : "short read", (unsigned long long)off);
        for (ssize_t w = 0; w < r;) {
            ssize_t k = pwrite(out, buf + w, (size_t)(r - w), (off_t)(off + (uint64_t)w));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0)
                return k3_errf(K3_ERR_IO, err, errlen, "place: %s: write at offset %llu: %s", dst,
                               (unsigned long long)(off + (uint64_t)w),
                               k < 0 ? strerror(errno) : "no progress");
            w += k;
        }
        off += (uint64_t)r, len -= (uint64_t)r;
        if (pg) {
            pg->done += (uint64_t)r;
            prog_show(pg, 0);
        }
    }
    return K3_OK;
}

typedef struct place_tally {
    uint64_t copied, linked, kept; /* bytes of experts */
    int files;
} place_tally;

/* Lays out one (drive, shard) group: ranges r[0..n), sorted and merged. */
static k3_status place_file(const k3_place_req *req, st_index *idx, const prange *r, int n,
                            unsigned char *buf, progress *pg, place_tally *ty, char *err,
                            size_t errlen) {
    const char *drive = req->drives[r[0].drive], *name = st_shard_name(idx, r[0].shard);
    uint64_t size = st_shard_size(idx, r[0].shard), bytes = 0;
    uint64_t hash = k3_placement_hash_init(size);
    for (int i = 0; i < n; i++)
        hash = k3_placement_hash_range(hash, r[i].off, r[i].len), bytes += r[i].len;
    char dir[K3_MAX_PATH], dst[K3_MAX_PATH + 512], tmp[K3_MAX_PATH + 520], src[K3_MAX_PATH];
    snprintf(dir, sizeof dir, "%s/%s", drive, K3_PLACEMENT_SUBDIR);
    if ((size_t)snprintf(dst, sizeof dst, "%s/%s", dir, name) >= sizeof dst)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "place: %s/%s: path too long", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp", dst);
    if (!realpath(st_shard_path(idx, r[0].shard), src))
        return k3_errf(K3_ERR_IO, err, errlen, "place: %s: %s", st_shard_path(idx, r[0].shard),
                       strerror(errno));
    struct stat ss, ds, ts;
    if (stat(src, &ss) != 0 || stat(dir, &ds) != 0)
        return k3_errf(K3_ERR_IO, err, errlen, "place: %s or %s: %s", src, dir, strerror(errno));
    ty->files++;
    if (stat(dst, &ts) == 0 && (uint64_t)ts.st_size == size &&
        k3_placement_done_has(dir, hash, size, name)) {
        ty->kept += bytes, pg->done += bytes; /* complete from an earlier run */
        return K3_OK;
    }
    if (stat(dst, &ts) == 0 && ts.st_ino == ss.st_ino && ts.st_dev == ss.st_dev) {
        ty->linked += bytes, pg->done += bytes; /* the drive is the shard's own directory */
        return k3_placement_done_add(dir, hash, size, name, err, errlen);
    }
    if (!req->force_copy && ds.st_dev == ss.st_dev) {
        unlink(dst);
        if (link(src, dst) == 0) {
            ty->linked += bytes, pg->done += bytes;
            return k3_placement_done_add(dir, hash, size, name, err, errlen);
        }
        /* EXDEV (bind mounts), EPERM (protected hard links): copy instead */
    }
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) return k3_errf(K3_ERR_IO, err, errlen, "place: %s: %s", src, strerror(errno));
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
        close(in);
        return k3_errf(K3_ERR_IO, err, errlen, "place: %s: %s", tmp, strerror(errno));
    }
    k3_status st = K3_OK;
    if (ftruncate(out, (off_t)size) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "place: %s: cannot size it to %llu bytes: %s", tmp,
                     (unsigned long long)size, strerror(errno));
    /* the safetensors header, so the file describes itself */
    uint64_t hlen = 0;
    if (st == K3_OK && (pread(in, &hlen, 8, 0) != 8 || hlen > size - 8))
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "place: %s: unreadable header length", src);
    if (st == K3_OK) st = copy_range(in, out, 0, 8 + hlen, buf, NULL, src, tmp, err, errlen);
    for (int i = 0; i < n && st == K3_OK; i++)
        st = copy_range(in, out, r[i].off, r[i].len, buf, pg, src, tmp, err, errlen);
    if (st == K3_OK && fsync(out) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "place: %s: fsync: %s", tmp, strerror(errno));
    close(in);
    if (close(out) != 0 && st == K3_OK)
        st = k3_errf(K3_ERR_IO, err, errlen, "place: %s: close: %s", tmp, strerror(errno));
    if (st == K3_OK && (stat(tmp, &ts) != 0 || (uint64_t)ts.st_size != size))
        st = k3_errf(K3_ERR_IO, err, errlen, "place: %s is %lld bytes after writing, expected %llu",
                     tmp, (long long)ts.st_size, (unsigned long long)size);
    if (st == K3_OK && rename(tmp, dst) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "place: rename %s: %s", tmp, strerror(errno));
    if (st != K3_OK) return st;
    ty->copied += bytes;
    return k3_placement_done_add(dir, hash, size, name, err, errlen);
}

/* The ranges of every placed expert's six tensors. */
static k3_status collect(st_index *idx, const k3_config *cfg, const k3_placement *p, int la, int lb,
                         prange **out, int *n_out, char *err, size_t errlen) {
    const char *prefix = st_prefix(idx);
    static const char *const part[6] = {"w1.weight_packed", "w1.weight_scale",  "w2.weight_packed",
                                        "w2.weight_scale",  "w3.weight_packed", "w3.weight_scale"};
    int cap = 1024, n = 0;
    prange *r = k3_xmalloc((size_t)cap * sizeof *r);
    int nd = k3_placement_drives(p), split = k3_placement_split(p);
    for (int l = 0; l < cfg->n_layers; l++) {
        if (!cfg->is_moe[l] || (lb > 0 && (l < la || l >= lb))) continue;
        for (int e = 0; e < cfg->n_experts; e++) {
            const st_tensor *t[6];
            int contiguous = 1;
            for (int k = 0; k < 6; k++) {
                char name[K3_ST_MAX_NAME];
                snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s",
                         prefix, l, e, part[k]);
                k3_status st = st_find_opt(idx, name, &t[k], err, errlen);
                if (st != K3_OK) {
                    free(r);
                    return st;
                }
                if (!t[k] || (k && (!t[k - 1] || t[k]->shard != t[0]->shard ||
                                    t[k]->offset != t[k - 1]->offset + t[k - 1]->nbytes)))
                    contiguous = 0;
            }
            /* split: the span the store cuts (common/experts/placement.h):
             * the expert when its tensors are back to back, else each */
            for (int k = 0; k < 6; k++) {
                if (!t[k] || (split && contiguous && k)) continue; /* absent: nothing to place */
                uint64_t len =
                    split && contiguous ? t[5]->offset + t[5]->nbytes - t[0]->offset : t[k]->nbytes;
                for (int d = 0; d < (split ? nd : 1); d++) {
                    uint64_t lo = t[k]->offset, hi = lo + len;
                    if (split) k3_placement_piece(p, d, t[k]->offset, len, &lo, &hi);
                    if (hi == lo) continue; /* this drive holds none of it */
                    if (n == cap) cap *= 2, r = k3_xrealloc(r, (size_t)cap * sizeof *r);
                    r[n++] = (prange){split ? d : k3_placement_drive_of(p, l, e), t[k]->shard, lo,
                                      hi - lo};
                }
            }
        }
    }
    qsort(r, (size_t)n, sizeof *r, prange_cmp);
    int m = 0; /* merge touching ranges of one (drive, shard) */
    for (int i = 0; i < n; i++) {
        if (m && r[m - 1].drive == r[i].drive && r[m - 1].shard == r[i].shard &&
            r[m - 1].off + r[m - 1].len >= r[i].off) {
            uint64_t end = r[i].off + r[i].len;
            if (end > r[m - 1].off + r[m - 1].len) r[m - 1].len = end - r[m - 1].off;
        } else {
            r[m++] = r[i];
        }
    }
    *out = r, *n_out = m;
    return K3_OK;
}

k3_status k3_place_layout(const k3_place_req *req, char *err, size_t errlen) {
    double t0 = k3_now_s();
    k3_config cfg;
    k3_status st = k3_config_load(&cfg, req->model, req->max_layers, err, errlen);
    if (st != K3_OK) return st;
    uint64_t fp;
    if ((st = k3_model_fingerprint_dir(req->model, &cfg, req->topp, &fp, err, errlen))) return st;
    for (int d = 0; d < req->n_drives; d++) {
        char dir[K3_MAX_PATH];
        if ((size_t)snprintf(dir, sizeof dir, "%s/%s", req->drives[d], K3_PLACEMENT_SUBDIR) >=
            sizeof dir)
            return k3_errf(K3_ERR_LIMIT, err, errlen, "place: drive %s: path too long",
                           req->drives[d]);
        if ((mkdir(req->drives[d], 0755) != 0 && errno != EEXIST) ||
            (mkdir(dir, 0755) != 0 && errno != EEXIST))
            return k3_errf(K3_ERR_IO, err, errlen, "place: cannot create %s: %s", dir,
                           strerror(errno));
    }
    size_t rows = ((size_t)cfg.n_layers_full + 1) * (size_t)cfg.n_experts;
    uint64_t *usage = k3_xcalloc(rows, sizeof *usage);
    if (req->usage)
        st =
            k3_experts_usage_read(req->usage, cfg.n_layers_full, cfg.n_experts, usage, err, errlen);
    k3_expert_geom g;
    k3_expert_geom_init(&g, &cfg);
    k3_place_input in = {.drives = req->drives,
                         .n_drives = req->n_drives,
                         .weight = req->weight,
                         .fingerprint = fp,
                         .n_layers = cfg.n_layers,
                         .n_experts = cfg.n_experts,
                         .is_moe = cfg.is_moe,
                         .expert_bytes = g.total,
                         .usage = usage,
                         .split = req->split,
                         .align = req->align};
    k3_placement *p = NULL;
    if (st == K3_OK) st = k3_placement_build(&p, &in, err, errlen);
    free(usage);
    st_index *idx = NULL;
    st_open_opts so = {req->model, req->shard_dirs, req->n_shard_dirs};
    if (st == K3_OK) st = st_open(&idx, &so, err, errlen);
    prange *r = NULL;
    int n = 0;
    if (st == K3_OK && req->layer_b > 0 &&
        (req->layer_a < 0 || req->layer_a >= req->layer_b || req->layer_b > cfg.n_layers))
        st = k3_errf(K3_ERR_ARG, err, errlen, "place: --layers %d-%d: want 0 <= A < B <= %d",
                     req->layer_a, req->layer_b, cfg.n_layers);
    if (st == K3_OK) st = collect(idx, &cfg, p, req->layer_a, req->layer_b, &r, &n, err, errlen);
    progress pg = {.on = req->progress, .tty = isatty(2), .last_decile = -1, .t0 = k3_now_s()};
    for (int i = 0; i < n; i++) pg.total += r[i].len;
    unsigned char *buf = k3_xmalloc(PLACE_BUF);
    place_tally ty = {0};
    for (int i = 0; i < n && st == K3_OK;) {
        int j = i;
        while (j < n && r[j].drive == r[i].drive && r[j].shard == r[i].shard) j++;
        st = place_file(req, idx, r + i, j - i, buf, &pg, &ty, err, errlen);
        i = j;
    }
    free(buf);
    if (st == K3_OK) prog_show(&pg, 1);
    if (st == K3_OK) st = k3_placement_save(p, req->out, err, errlen);
    if (st == K3_OK && req->progress) {
        for (int d = 0; d < req->n_drives; d++) {
            int ne = 0;
            uint64_t bytes = 0; /* of the layers laid out here */
            for (int i = 0; i < n; i++) bytes += r[i].drive == d ? r[i].len : 0;
            for (int l = 0; l < cfg.n_layers; l++)
                if (cfg.is_moe[l]) ne += k3_placement_count(p, l, d);
            if (req->split)
                fprintf(stderr,
                        "place: drive %d %s: a piece of every expert (%.2f GB, %.1f%% of the "
                        "expert bytes), weight %g\n",
                        d, req->drives[d], (double)bytes / 1e9,
                        pg.total ? 100.0 * (double)bytes / (double)pg.total : 0.0,
                        k3_placement_drive_weight(p, d));
            else
                fprintf(stderr, "place: drive %d %s: %d experts (%.2f GB), weight %g\n", d,
                        req->drives[d], ne, (double)ne * (double)g.total / 1e9,
                        k3_placement_drive_weight(p, d));
        }
        fprintf(stderr,
                "place: %d files, expert bytes: %.2f GB (%llu B) copied, %.2f GB (%llu B) "
                "hard-linked, %.2f GB (%llu B) kept from an earlier run, in %.1f s; placement "
                "written to %s\n",
                ty.files, (double)ty.copied / 1e9, (unsigned long long)ty.copied,
                (double)ty.linked / 1e9, (unsigned long long)ty.linked, (double)ty.kept / 1e9,
                (unsigned long long)ty.kept, k3_now_s() - t0, req->out);
    }
    free(r);
    st_close(&idx);
    k3_placement_free(&p);
    return st;
}

k3_status k3_place_stripe_dirs(k3_engine_opts *eng, int split, char *err, size_t errlen) {
    if (eng->placement)
        return k3_errf(
            K3_ERR_ARG, err, errlen,
            "--stripe computes a placement for --dirs: give it or --placement, not both");
    if (eng->dirs.n < 1)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--stripe needs --dirs D1,D2,... (the drives to stripe the experts over)");
    char out[K3_MAX_PATH + 64];
    snprintf(out, sizeof out, "%s/%s/placement.json", eng->dirs.items[0], K3_PLACEMENT_SUBDIR);
    k3_place_req req = {.model = eng->model,
                        .drives = (const char *const *)eng->dirs.items,
                        .n_drives = eng->dirs.n,
                        .topp = eng->expert_topp,
                        .max_layers = eng->max_layers,
                        .out = out,
                        .split = split,
                        .progress = 1};
    k3_status st = k3_place_layout(&req, err, errlen);
    if (st == K3_OK) eng->placement = k3_xstrdup(out);
    return st;
}

/* ---- the plan file (k3-coordinator plan's format) ---- */

k3_status k3_place_read_plan(const char *path, uint64_t fp, char ***paths, double *w, int *n,
                             char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "plan %s line %d: %s", path, je.line, je.text);
    k3_status st = K3_OK;
    const char *fmt = json_string_value(json_object_get(root, "format"));
    const char *mfp = json_string_value(json_object_get(root, "model_fingerprint"));
    json_t *drives = json_object_get(root, "drives");
    char want[32];
    snprintf(want, sizeof want, "%016llx", (unsigned long long)fp);
    if (!fmt || strcmp(fmt, "k3shard-plan") != 0)
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "plan %s: \"format\" is not \"k3shard-plan\"",
                     path);
    else if (json_integer_value(json_object_get(root, "version")) != 1)
        st = k3_errf(K3_ERR_MISMATCH, err, errlen, "plan %s: version is not 1", path);
    else if (mfp && strcmp(mfp, want) != 0)
        st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                     "plan %s was made for model %s, this model is %s (run k3-coordinator plan "
                     "again)",
                     path, mfp, want);
    else if (!json_is_array(drives) || json_array_size(drives) < 1 ||
             json_array_size(drives) > K3_MAX_DIRS)
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "plan %s: \"drives\" must list 1 to %d drives",
                     path, K3_MAX_DIRS);
    *n = 0;
    *paths = NULL;
    if (st == K3_OK) {
        *n = (int)json_array_size(drives);
        *paths = k3_xcalloc((size_t)*n, sizeof **paths);
    }
    for (int d = 0; st == K3_OK && d < *n; d++) {
        json_t *dv = json_array_get(drives, (size_t)d);
        const char *dp = json_string_value(json_object_get(dv, "path"));
        json_t *share = json_object_get(dv, "share"), *seq = json_object_get(dv, "seq_gbs");
        double v = json_is_number(share) ? json_number_value(share)
                   : json_is_number(seq) ? json_number_value(seq)
                                         : 1.0;
        if (!dp || !dp[0])
            st =
                k3_errf(K3_ERR_FORMAT, err, errlen, "plan %s: drives[%d] has no \"path\"", path, d);
        else if (!(v > 0.0))
            st = k3_errf(K3_ERR_ARG, err, errlen,
                         "plan %s: drives[%d] (%s) has share %g: it must be > 0 (leave the drive "
                         "out instead)",
                         path, d, dp, v);
        else
            (*paths)[d] = k3_xstrdup(dp), w[d] = v;
    }
    json_decref(root);
    return st;
}

/* ---- the command ---- */

typedef struct place_opts {
    char *model, *plan, *out, *usage, *layers;
    k3_opt_list drives, weights, dirs;
    int copy, help, split, align;
    double topp;
} place_opts;

#define PO(f) offsetof(place_opts, f)
static const k3_opt place_table[] = {
    {.name = "model",
     .flag = "--model",
     .env = "K3_MODEL",
     .type = K3_OPT_STRING,
     .offset = PO(model),
     .metavar = "DIR",
     .help = "checkpoint directory"},
    {.name = "plan",
     .flag = "--plan",
     .type = K3_OPT_STRING,
     .offset = PO(plan),
     .metavar = "PLAN.json",
     .help = "plan file (k3-coordinator plan): the drives and each one's share of expert bytes"},
    {.name = "drives",
     .flag = "--drives",
     .type = K3_OPT_LIST,
     .offset = PO(drives),
     .max = K3_MAX_DIRS,
     .metavar = "D1,D2",
     .help = "drive directories (with --plan: replace its paths, in order)"},
    {.name = "dirs",
     .flag = "--dirs",
     .type = K3_OPT_LIST,
     .offset = PO(dirs),
     .max = K3_MAX_DIRS,
     .metavar = "S1,S2",
     .help = "extra shard directories of --model (as the programs' --dirs)"},
    {.name = "weights",
     .flag = "--weights",
     .type = K3_OPT_LIST,
     .offset = PO(weights),
     .max = K3_MAX_DIRS,
     .metavar = "W1,W2",
     .help = "relative speed of each drive (a faster drive holds more), default equal"},
    {.name = "out",
     .flag = "--out",
     .type = K3_OPT_STRING,
     .offset = PO(out),
     .metavar = "FILE",
     .help = "placement file to write (default <first drive>/k3-stripe/placement.json)"},
    {.name = "usage",
     .flag = "--usage",
     .env = "K3_USAGE",
     .type = K3_OPT_STRING,
     .offset = PO(usage),
     .metavar = "PATH",
     .help = "expert usage history that spreads hot experts (default <model>/.k3_usage; off)"},
    {.name = "topp",
     .env = "K3_TOPP",
     .type = K3_OPT_DOUBLE,
     .offset = PO(topp),
     .def = "0",
     .min = 0,
     .max = 1,
     .metavar = "P",
     .help = "the runs' K3_TOPP (part of the model fingerprint)"},
    {.name = "layers",
     .flag = "--layers",
     .type = K3_OPT_STRING,
     .offset = PO(layers),
     .metavar = "A-B",
     .help = "lay out only the experts of layers [A, B) (a worker's, on its host; the placement "
             "file still places every layer)"},
    {.name = "split",
     .flag = "--split",
     .type = K3_OPT_BOOL,
     .offset = PO(split),
     .help = "byte-split: every expert's bytes cut over all drives by weight (placement version "
             "2), so each pick reads from every drive"},
    {.name = "align",
     .flag = "--align",
     .type = K3_OPT_INT,
     .offset = PO(align),
     .def = "4096",
     .min = 1,
     .max = 1 << 30,
     .metavar = "BYTES",
     .help = "--split: cut points aligned to this power of two (4096: O_DIRECT reads; smaller "
             "cuts are read buffered)"},
    {.name = "copy",
     .flag = "--copy",
     .type = K3_OPT_BOOL,
     .offset = PO(copy),
     .help = "copy the expert bytes even where a hard link would do"},
    {.name = "help",
     .flag = "--help",
     .short_flag = 'h',
     .type = K3_OPT_BOOL,
     .offset = PO(help),
     .help = "this help"},
};
#define N_PLACE_OPTS ((int)(sizeof place_table / sizeof place_table[0]))

static const char PLACE_USAGE[] =
    "usage: k3-coordinator place --model DIR (--plan PLAN.json | --drives D1,D2,...) [options]\n"
    "Stripes the routed experts over drives: writes D/k3-stripe/<shard> on each drive (a hard\n"
    "link where the drive shares the shard's file system, else a sparse copy of that drive's\n"
    "experts) and the placement file the programs take with --placement FILE.";

int cmd_place(int argc, char **argv) {
    k3_log_init("k3-coordinator place");
    place_opts o;
    memset(&o, 0, sizeof o);
    char err[1024] = "";
    char **pos = k3_xcalloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0, rc = 2;
    char **plan_paths = NULL;
    int n_plan = 0;
    double w[K3_MAX_DIRS];
    const char *drives[K3_MAX_DIRS];
    char out[K3_MAX_PATH + 64], usage[K3_MAX_PATH + 16];
    k3_status st = k3_opts_parse(place_table, N_PLACE_OPTS, &o, NULL, argc, argv, pos, &n_pos, err,
                                 sizeof err);
    if (st != K3_OK) {
        fprintf(stderr, "k3-coordinator place: %s\n", err);
        goto done;
    }
    if (o.help) {
        k3_opts_help(stdout, PLACE_USAGE, place_table, N_PLACE_OPTS);
        rc = 0;
        goto done;
    }
    if (n_pos || !o.model || (!o.plan && !o.drives.n)) {
        fprintf(stderr, "k3-coordinator place: %s\n(k3-coordinator place --help)\n",
                n_pos      ? "unexpected argument"
                : !o.model ? "--model DIR is required"
                           : "give --plan PLAN.json or --drives D1,D2");
        goto done;
    }
    rc = 1;
    k3_config cfg;
    uint64_t fp = 0;
    if ((st = k3_config_load(&cfg, o.model, 0, err, sizeof err)) ||
        (st = k3_model_fingerprint_dir(o.model, &cfg, o.topp, &fp, err, sizeof err)))
        goto fail;
    int n = o.drives.n;
    for (int d = 0; d < K3_MAX_DIRS; d++) w[d] = 1.0;
    if (o.plan) {
        if ((st = k3_place_read_plan(o.plan, fp, &plan_paths, w, &n_plan, err, sizeof err)))
            goto fail;
        if (o.drives.n && o.drives.n != n_plan) {
            st =
                k3_errf(K3_ERR_ARG, err, sizeof err, "--drives lists %d drives, the plan %s has %d",
                        o.drives.n, o.plan, n_plan);
            goto fail;
        }
        n = n_plan;
    }
    if (o.weights.n && o.weights.n != n) {
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--weights lists %d values for %d drives",
                     o.weights.n, n);
        goto fail;
    }
    for (int d = 0; d < n; d++) {
        drives[d] = o.drives.n ? o.drives.items[d] : plan_paths[d];
        if (o.weights.n) {
            char *end;
            w[d] = strtod(o.weights.items[d], &end);
            if (*end || !(w[d] > 0.0) || w[d] > 1e12) {
                st = k3_errf(K3_ERR_ARG, err, sizeof err,
                             "--weights: \"%s\" (drive %s) is not a number > 0", o.weights.items[d],
                             drives[d]);
                goto fail;
            }
        }
    }
    int la = 0, lb = 0;
    if (o.layers) {
        char *end = NULL;
        long a = strtol(o.layers, &end, 10),
             b = end && *end == '-' ? strtol(end + 1, &end, 10) : -1;
        if (!end || *end || a < 0 || b <= a || b > K3_MAX_LAYERS) {
            st =
                k3_errf(K3_ERR_ARG, err, sizeof err,
                        "--layers \"%s\": want A-B with 0 <= A < B <= %d", o.layers, K3_MAX_LAYERS);
            goto fail;
        }
        la = (int)a, lb = (int)b;
    }
    if (o.out)
        snprintf(out, sizeof out, "%s", o.out);
    else
        snprintf(out, sizeof out, "%s/%s/placement.json", drives[0], K3_PLACEMENT_SUBDIR);
    if (!o.usage)
        snprintf(usage, sizeof usage, "%s/.k3_usage", o.model);
    else
        snprintf(usage, sizeof usage, "%s", o.usage);
    k3_place_req req = {.model = o.model,
                        .shard_dirs = (const char *const *)o.dirs.items,
                        .n_shard_dirs = o.dirs.n,
                        .drives = drives,
                        .n_drives = n,
                        .weight = w,
                        .usage = strcmp(usage, "off") && usage[0] ? usage : NULL,
                        .topp = o.topp,
                        .out = out,
                        .force_copy = o.copy,
                        .split = o.split,
                        .align = (uint64_t)o.align,
                        .layer_a = la,
                        .layer_b = lb,
                        .progress = 1};
    if ((st = k3_place_layout(&req, err, sizeof err))) goto fail;
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "k3-coordinator place: %s\n", err);
done:
    for (int d = 0; d < n_plan; d++) free(plan_paths ? plan_paths[d] : NULL);
    free(plan_paths);
    k3_opts_free(place_table, N_PLACE_OPTS, &o);
    free(pos);
    return rc;
}
