/* common/ckpt/container.c: writing and checking repacked containers
 * (container.h). Layout of one output shard: 8-byte little-endian header
 * length, compact JSON header padded with spaces so that 8 + length is a
 * multiple of 8, then the tensors back to back with no hole: the
 * non-experts in source offset order (a quantized matrix as its U8 data
 * immediately followed by its <name>.qs F32 scales), then the experts sorted
 * by (expert id, w1/w2/w3, packed before scale).
 */
#include "common/ckpt/container.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/ckpt/safetensors.h"
#include "common/experts/placement.h"
#include "common/kernels/kernels.h"

#define PFX "language_model."

/* path buffers: a directory (< 4096, PATH_MAX) plus a shard name */
#define PATHN 4400

/* ---- classification ---- */

static int has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

int k3_repack_class(const char *name, const k3_config *cfg, int bits, int mla_bits, int head_bits) {
    const char *n = !strncmp(name, PFX, strlen(PFX)) ? name + strlen(PFX) : name;
    if (!strncmp(n, "vision_tower", 12) || !strncmp(n, "mm_projector", 12)) return K3_RP_DROP;
    if (strstr(n, ".block_sparse_moe.experts.")) return K3_RP_EXPERT;
    int cls = 0; /* 1 bits, 2 mla, 3 head */
    if (!strcmp(n, "lm_head.weight")) cls = 3;
    const char *L = "model.layers.";
    if (!cls && !strncmp(n, L, strlen(L))) {
        char *end;
        long layer = strtol(n + strlen(L), &end, 10);
        if (*end != '.' || layer < 0 || layer >= K3_MAX_LAYERS) return K3_RP_PASS;
        const char *r = end + 1;
        static const char *const mla[] = {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                                          "self_attn.kv_a_proj_with_mqa.weight",
                                          "self_attn.kv_b_proj.weight"};
        static const char *const main_cls[] = {"self_attn.q_proj.weight",
                                               "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight",
                                               "block_sparse_moe.routed_expert_down_proj.weight",
                                               "block_sparse_moe.routed_expert_up_proj.weight",
                                               "block_sparse_moe.shared_experts.gate_proj.weight",
                                               "block_sparse_moe.shared_experts.up_proj.weight",
                                               "block_sparse_moe.shared_experts.down_proj.weight",
                                               "mlp.gate_proj.weight",
                                               "mlp.up_proj.weight",
                                               "mlp.down_proj.weight"};
        for (size_t k = 0; k < sizeof mla / sizeof *mla; k++)
            if (!strcmp(r, mla[k])) cls = 2;
        for (size_t k = 0; k < sizeof main_cls / sizeof *main_cls; k++)
            if (!strcmp(r, main_cls[k])) cls = 1;
        /* o/g: the main class on KDA layers, the MLA class on MLA layers */
        if (!strcmp(r, "self_attn.o_proj.weight") || !strcmp(r, "self_attn.g_proj.weight"))
            cls = layer < cfg->n_layers && !cfg->is_kda[layer] ? 2 : 1;
    }
    int b = cls == 1 ? bits : cls == 2 ? mla_bits : cls == 3 ? head_bits : 32;
    return b >= 32 ? K3_RP_PASS : b;
}

/* ---- small file helpers ---- */

static k3_status write_all(int fd, const void *buf, size_t n, const char *path, char *err,
                           size_t errlen) {
    const unsigned char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return k3_errf(K3_ERR_IO, err, errlen, "%s: write: %s", path,
                           w < 0 ? strerror(errno) : "no progress");
        p += w;
        n -= (size_t)w;
    }
    return K3_OK;
}

static k3_status pread_all(int fd, void *buf, size_t n, uint64_t off, const char *path, char *err,
                           size_t errlen) {
    unsigned char *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return k3_errf(K3_ERR_IO, err, errlen, "%s: read at %llu: %s", path,
                           (unsigned long long)off, r < 0 ? strerror(errno) : "short file");
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return K3_OK;
}

/* fsync of the directory, so a rename survives a crash */
static void sync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
}

/* Copies src to dst through dst.tmp + rename (small files: config, tokenizer). */
static k3_status copy_file(const char *src, const char *dst, char *err, size_t errlen) {
    char tmp[PATHN + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", dst);
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", src, strerror(errno));
    int out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) {
        close(in);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", tmp, strerror(errno));
    }
    k3_status st = K3_OK;
    char buf[1 << 16];
    for (;;) {
        ssize_t r = read(in, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) st = k3_errf(K3_ERR_IO, err, errlen, "%s: read: %s", src, strerror(errno));
        if (r <= 0) break;
        st = write_all(out, buf, (size_t)r, tmp, err, errlen);
        if (st) break;
    }
    if (!st && fsync(out) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: fsync: %s", tmp, strerror(errno));
    close(in);
    close(out);
    if (!st && rename(tmp, dst) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "rename %s: %s", tmp, strerror(errno));
    if (st) unlink(tmp);
    return st;
}

/* ---- reading a shard header (ours or anyone's) ---- */

/* Reads and validates the header of the safetensors file at path: *hdr the
 * parsed JSON object (owned by the caller), *data_start = 8 + its length. */
static k3_status read_header(const char *path, json_t **hdr, uint64_t *data_start,
                             uint64_t *file_size, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    struct stat sb;
    k3_status st = K3_OK;
    unsigned char *buf = NULL;
    uint64_t hl = 0;
    if (fstat(fd, &sb) != 0) {
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: fstat: %s", path, strerror(errno));
        goto out;
    }
    unsigned char l8[8];
    if (sb.st_size < 8) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: %lld bytes, too short for a header", path,
                     (long long)sb.st_size);
        goto out;
    }
    st = pread_all(fd, l8, 8, 0, path, err, errlen);
    if (st) goto out;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | l8[i];
    if (hl > K3_ST_MAX_HEADER || hl > (uint64_t)sb.st_size - 8) {
        st = k3_errf(K3_ERR_LIMIT, err, errlen,
                     "%s: header length %llu > limit %llu or the file size %lld", path,
                     (unsigned long long)hl, (unsigned long long)K3_ST_MAX_HEADER,
                     (long long)sb.st_size);
        goto out;
    }
    buf = malloc(8 + hl);
    if (!buf) {
        st = k3_errf(K3_ERR_NOMEM, err, errlen, "%s: header of %llu bytes", path,
                     (unsigned long long)hl);
        goto out;
    }
    memcpy(buf, l8, 8);
    st = pread_all(fd, buf + 8, hl, 8, path, err, errlen);
    if (st) goto out;
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    int nt = 0;
    st = st_parse_header_mem(buf, 8 + hl, (uint64_t)sb.st_size, base, &nt, err, errlen);
    if (st) goto out;
    json_error_t je;
    *hdr = json_loadb((const char *)buf + 8, hl, 0, &je);
    if (!*hdr) st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: header: %s", path, je.text);
    *data_start = 8 + hl;
    *file_size = (uint64_t)sb.st_size;
out:
    free(buf);
    close(fd);
    return st;
}

/* ---- the output layout of one shard ---- */

typedef struct out_tensor {
    const st_tensor *src;
    int cls; /* K3_RP_PASS, K3_RP_EXPERT or bits */
    /* quantized: the data entry and its .qs entry share src; qs = 1 on the second */
    int qs;
    int fmt_i4; /* quantized to int4-g64 */
    st_dtype dtype;
    int rank;
    int64_t shape[K3_ST_MAX_RANK];
    uint64_t nbytes, off;  /* off: relative to the data section */
    long expert, w, scale; /* experts: sort key */
    int drive;             /* --placement: the drive of this expert, -1 none */
} out_tensor;

static int cmp_src_off(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int cmp_expert(const void *a, const void *b) {
    const out_tensor *x = a, *y = b;
    if (x->expert != y->expert) return x->expert < y->expert ? -1 : 1;
    if (x->w != y->w) return x->w < y->w ? -1 : 1;
    if (x->scale != y->scale) return x->scale < y->scale ? -1 : 1;
    return strcmp(x->src->name, y->src->name);
}

/* "...experts.E.wK.weight_packed|scale" -> E, K, 0|1 (else keys past any id) */
static void expert_key(const char *name, out_tensor *o) {
    const char *p = strstr(name, ".block_sparse_moe.experts.");
    o->expert = o->w = o->scale = 1L << 30;
    if (!p) return;
    char *end;
    o->expert = strtol(p + strlen(".block_sparse_moe.experts."), &end, 10);
    if (end[0] == '.' && end[1] == 'w') o->w = strtol(end + 2, &end, 10);
    o->scale = has_suffix(name, "weight_scale") ? 1 : has_suffix(name, "weight_packed") ? 0 : 2;
}

/* ---- progress ---- */

typedef struct progress {
    int mode;
    uint64_t total, done;
    double t0, last;
    int shard, n_shards;
} progress;

/* "12.3 GB" / "45.6 MB": the unit that keeps the number readable */
static const char *human(uint64_t b, char *buf, size_t n) {
    if (b >= 1000000000ull)
        snprintf(buf, n, "%.2f GB", (double)b / 1e9);
    else
        snprintf(buf, n, "%.1f MB", (double)b / 1e6);
    return buf;
}

/* event 0: a tick (redrawn at most 4x a second on a tty, never in line
 * mode), 1: a shard completed (a line in line mode), 2: all done. */
static void progress_show(progress *p, int event) {
    if (!p->mode || (p->mode == 1 && event == 0)) return;
    double now = k3_now_s();
    if (p->mode == 2 && event == 0 && now - p->last < 0.25) return;
    if (p->mode == 2 && event == 1) return;
    p->last = now;
    double el = now - p->t0, gbs = el > 0 ? (double)p->done / el / 1e9 : 0;
    double eta = gbs > 0 ? (double)(p->total - p->done) / 1e9 / gbs : 0;
    int pct = p->total ? (int)(100.0 * (double)p->done / (double)p->total) : 100;
    char bar[21], a[32], b[32];
    for (int i = 0; i < 20; i++) bar[i] = i < pct / 5 ? '#' : '.';
    bar[20] = 0;
    fprintf(stderr, "%srepack: [%s] %3d%%  %s / %s  %.2f GB/s  ETA %d:%02d  shard %d/%d%s",
            p->mode == 2 ? "\r" : "", bar, pct, human(p->done, a, sizeof a),
            human(p->total, b, sizeof b), gbs, (int)(eta / 60), (int)eta % 60, p->shard,
            p->n_shards, p->mode == 2 && event == 0 ? "\033[K" : "\n");
    fflush(stderr);
}

/* ---- writing one shard ---- */

typedef struct repack_ctx {
    const k3_repack_opts *o;
    st_index *src;
    k3_config cfg;
    progress pr;
    unsigned char *buf; /* K3_REPACK_BLOCK bytes */
    float *fbuf;        /* K3_REPACK_BLOCK bytes of floats */
    k3_repack_stats *stats;
    uint64_t kill_at;            /* test hook, 0 = off */
    int copy_drive[K3_MAX_DIRS]; /* --placement: 1 = written in the stream */
} repack_ctx;

/* ---- the expert stripe written in the stream (o->placement) ---- */

/* One drive's copy of the shard being written. */
typedef struct stripe_file {
    int fd; /* -1: the drive gets nothing of this shard in the stream */
    char dir[PATHN], path[PATHN + 320], tmp[PATHN + 328];
    uint64_t hash, run_off, run_len; /* the .done record's hash, the open range */
} stripe_file;

static k3_status pwrite_all(int fd, const void *buf, size_t n, uint64_t off, const char *path,
                            char *err, size_t errlen) {
    const unsigned char *p = buf;
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            return k3_errf(K3_ERR_IO, err, errlen, "%s: write at %llu: %s", path,
                           (unsigned long long)off, w < 0 ? strerror(errno) : "no progress");
        p += w, n -= (size_t)w, off += (uint64_t)w;
    }
    return K3_OK;
}

/* The decoder layer of a tensor name ("...layers.N...."), -1 if none. */
static int name_layer(const char *name) {
    const char *p = strstr(name, "layers.");
    if (!p) return -1;
    char *end;
    long l = strtol(p + 7, &end, 10);
    return end != p + 7 && *end == '.' && l >= 0 && l < K3_MAX_LAYERS ? (int)l : -1;
}

/* Opens the drive files of one shard (size `want`, header l8 + hdr) for the
 * drives the stream writes, and sets each expert's drive. */
static k3_status stripe_open(repack_ctx *x, out_tensor *out, int n, const unsigned char *l8,
                             const char *hdr, size_t hl, uint64_t want, const char *name,
                             stripe_file *sf, char *err, size_t errlen) {
    const k3_placement *p = x->o->placement;
    int nd = k3_placement_drives(p);
    for (int d = 0; d < nd; d++) sf[d].fd = -1;
    for (int i = 0; i < n; i++) {
        out[i].drive = -1;
        if (out[i].cls != K3_RP_EXPERT) continue;
        int l = name_layer(out[i].src->name),
            d = l < 0 ? -1 : k3_placement_drive_of(p, l, (int)out[i].expert);
        if (d < 0 || d >= nd)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "--placement: expert tensor %s (layer %d, expert %ld) is not placed",
                           out[i].src->name, l, out[i].expert);
        if (!x->copy_drive[d]) continue;
        out[i].drive = d;
        stripe_file *f = &sf[d];
        uint64_t at = 8 + hl + out[i].off;
        if (f->fd < 0) {
            if ((size_t)snprintf(f->dir, sizeof f->dir, "%s/%s", k3_placement_drive_path(p, d),
                                 K3_PLACEMENT_SUBDIR) >= sizeof f->dir ||
                (size_t)snprintf(f->path, sizeof f->path, "%s/%s", f->dir, name) >=
                    sizeof f->path ||
                (size_t)snprintf(f->tmp, sizeof f->tmp, "%s.tmp", f->path) >= sizeof f->tmp)
                return k3_errf(K3_ERR_LIMIT, err, errlen, "--placement: drive %s: path too long",
                               k3_placement_drive_path(p, d));
            f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            if (f->fd < 0)
                return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", f->tmp, strerror(errno));
            if (ftruncate(f->fd, (off_t)want) != 0)
                return k3_errf(K3_ERR_IO, err, errlen, "%s: cannot size it to %llu bytes: %s",
                               f->tmp, (unsigned long long)want, strerror(errno));
            k3_status st = pwrite_all(f->fd, l8, 8, 0, f->tmp, err, errlen);
            if (!st) st = pwrite_all(f->fd, hdr, hl, 8, f->tmp, err, errlen);
            if (st) return st;
            f->hash = k3_placement_hash_init(want);
            f->run_off = at, f->run_len = 0;
        }
        /* ranges merged where they touch, as place merges them */
        if (f->run_len && f->run_off + f->run_len >= at) {
            if (at + out[i].nbytes > f->run_off + f->run_len)
                f->run_len = at + out[i].nbytes - f->run_off;
        } else {
            if (f->run_len) f->hash = k3_placement_hash_range(f->hash, f->run_off, f->run_len);
            f->run_off = at, f->run_len = out[i].nbytes;
        }
    }
    return K3_OK;
}

/* Completes the drive files (fsync, size check, rename, .done record);
 * with st set, only closes them. */
static k3_status stripe_close(stripe_file *sf, int nd, uint64_t want, const char *name,
                              k3_status st, char *err, size_t errlen) {
    for (int d = 0; d < nd; d++) {
        stripe_file *f = &sf[d];
        if (f->fd < 0) continue;
        struct stat sb;
        if (!st && fsync(f->fd) != 0)
            st = k3_errf(K3_ERR_IO, err, errlen, "%s: fsync: %s", f->tmp, strerror(errno));
        if (!st && (fstat(f->fd, &sb) != 0 || (uint64_t)sb.st_size != want))
            st = k3_errf(K3_ERR_IO, err, errlen, "%s: %lld bytes, expected %llu", f->tmp,
                         (long long)sb.st_size, (unsigned long long)want);
        close(f->fd);
        f->fd = -1;
        if (!st && rename(f->tmp, f->path) != 0)
            st = k3_errf(K3_ERR_IO, err, errlen, "rename %s: %s", f->tmp, strerror(errno));
        if (!st)
            st = k3_placement_done_add(f->dir,
                                       k3_placement_hash_range(f->hash, f->run_off, f->run_len),
                                       want, name, err, errlen);
    }
    return st;
}

/* Quantizes src (a [O, I] float matrix) in row blocks with the engine's
 * load-time quantizer and writes the U8 data, then the F32 scales. Each row
 * (int8) or row group (int4-g64) is quantized independently of the others,
 * so the blocks give exactly the bytes of one call on the whole matrix. */
static k3_status write_quantized(repack_ctx *x, int fd, const char *path, const out_tensor *o,
                                 char *err, size_t errlen) {
    const st_tensor *t = o->src;
    int64_t O = t->shape[0], I = t->shape[1];
    size_t es = st_dtype_size(t->dtype);
    int64_t rb = (int64_t)(K3_REPACK_BLOCK / ((size_t)I * sizeof(float)));
    if (rb < 1) rb = 1;
    size_t n_scales = o->fmt_i4 ? (size_t)O * (size_t)(I / 64) : (size_t)O;
    float *scales = malloc(n_scales * sizeof(float));
    if (!scales)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "tensor %s: %zu scales", t->name, n_scales);
    float *w = I * rb * (int64_t)sizeof(float) <= (int64_t)K3_REPACK_BLOCK
                   ? x->fbuf
                   : malloc((size_t)I * sizeof(float));
    k3_status st = w ? K3_OK
                     : k3_errf(K3_ERR_NOMEM, err, errlen, "tensor %s: a row of %lld floats",
                               t->name, (long long)I);
    for (int64_t r0 = 0; r0 < O && !st; r0 += rb) {
        int64_t nr = O - r0 < rb ? O - r0 : rb;
        st_tensor part = *t; /* the rows [r0, r0 + nr) as a tensor of their own */
        part.shape[0] = nr;
        part.offset = t->offset + (uint64_t)(r0 * I) * es;
        part.nbytes = (uint64_t)(nr * I) * es;
        st = st_read_f32(x->src, &part, w, (size_t)(nr * I), err, errlen);
        if (st) break;
        k3_qmat q;
        k3_qmat_quantize(&q, w, (int)nr, (int)I, o->fmt_i4 ? 4 : 8);
        if ((q.fmt == K3_QF_I4G64) != o->fmt_i4) {
            k3_qmat_free(&q);
            st = k3_errf(K3_ERR_INTERNAL, err, errlen, "tensor %s: quantizer format", t->name);
            break;
        }
        size_t qb = o->fmt_i4 ? (size_t)(nr * I / 2) : (size_t)(nr * I);
        size_t sn = o->fmt_i4 ? (size_t)(nr * (I / 64)) : (size_t)nr;
        st = write_all(fd, o->fmt_i4 ? (void *)q.q4 : (void *)q.q8, qb, path, err, errlen);
        memcpy(scales + (o->fmt_i4 ? (size_t)r0 * (size_t)(I / 64) : (size_t)r0), q.scales,
               sn * sizeof(float));
        k3_qmat_free(&q);
        x->pr.done += part.nbytes;
        x->stats->bytes_read += part.nbytes;
        progress_show(&x->pr, 0);
    }
    if (!st) st = write_all(fd, scales, n_scales * sizeof(float), path, err, errlen);
    if (w != x->fbuf) free(w);
    free(scales);
    return st;
}

/* Copies the source bytes of o->src through the block buffer (and, for an
 * expert of a drive the stream writes, the same bytes to its drive file at
 * data_start + o->off). */
static k3_status write_copy(repack_ctx *x, int fd, const char *path, const out_tensor *o,
                            const stripe_file *sf, uint64_t data_start, char *err, size_t errlen) {
    const st_tensor *t = o->src;
    for (uint64_t d = 0; d < t->nbytes;) {
        size_t n = t->nbytes - d < K3_REPACK_BLOCK ? (size_t)(t->nbytes - d) : K3_REPACK_BLOCK;
        k3_status st = st_pread(x->src, t->shard, t->offset + d, x->buf, n, 0, err, errlen);
        if (st) {
            k3_err_prefix(err, errlen, "tensor %s", t->name);
            return st;
        }
        st = write_all(fd, x->buf, n, path, err, errlen);
        if (!st && o->drive >= 0)
            st = pwrite_all(sf[o->drive].fd, x->buf, n, data_start + o->off + d, sf[o->drive].tmp,
                            err, errlen);
        if (st) return st;
        d += n;
        x->pr.done += n;
        x->stats->bytes_read += n;
        progress_show(&x->pr, 0);
    }
    return K3_OK;
}

/* The output tensors of source shard `shard` into *outp (owned). */
static k3_status plan_shard(repack_ctx *x, int shard, out_tensor **outp, int *n_out, char *err,
                            size_t errlen) {
    int nt = st_tensor_count(x->src), n = 0;
    const st_tensor **ts = k3_xcalloc((size_t)nt + 1, sizeof *ts);
    for (int i = 0; i < nt; i++)
        if (st_tensor_at(x->src, i)->shard == shard) ts[n++] = st_tensor_at(x->src, i);
    qsort(ts, (size_t)n, sizeof *ts, cmp_src_off);
    out_tensor *out = k3_xcalloc(2 * (size_t)n + 1, sizeof *out);
    int m = 0, n_exp = 0;
    k3_status st = K3_OK;
    /* non-experts first (source order), experts after */
    for (int pass = 0; pass < 2 && !st; pass++) {
        for (int i = 0; i < n && !st; i++) {
            const st_tensor *t = ts[i];
            int cls =
                k3_repack_class(t->name, &x->cfg, x->o->bits, x->o->mla_bits, x->o->head_bits);
            if (cls == K3_RP_DROP) continue;
            if ((cls == K3_RP_EXPERT) != (pass == 1)) continue;
            out_tensor *o = &out[m++];
            o->src = t;
            o->cls = cls;
            o->dtype = t->dtype;
            o->rank = t->rank;
            memcpy(o->shape, t->shape, sizeof o->shape);
            o->nbytes = t->nbytes;
            if (cls == K3_RP_EXPERT) {
                expert_key(t->name, o);
                n_exp++;
                continue;
            }
            if (cls < 4) continue;
            if (t->rank != 2 || (t->dtype != ST_BF16 && t->dtype != ST_F16 && t->dtype != ST_F32)) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "tensor %s in %s: dtype %s rank %d, expected a BF16/F16/F32 matrix "
                             "to quantize (is the source already a container?)",
                             t->name, st_shard_name(x->src, shard), st_dtype_name(t->dtype),
                             t->rank);
                break;
            }
            int64_t O = t->shape[0], I = t->shape[1];
            o->fmt_i4 = cls <= 4 && I % 64 == 0;
            o->dtype = ST_U8;
            if (o->fmt_i4) o->shape[1] = I / 2;
            o->nbytes = (uint64_t)(O * o->shape[1]);
            out_tensor *s = &out[m++];
            *s = *o;
            s->qs = 1;
            s->dtype = ST_F32;
            s->rank = o->fmt_i4 ? 2 : 1;
            s->shape[0] = O;
            s->shape[1] = o->fmt_i4 ? I / 64 : 0;
            s->nbytes = (uint64_t)O * (o->fmt_i4 ? (uint64_t)(I / 64) : 1) * 4;
            x->stats->tensors_quantized++;
        }
    }
    qsort(out + m - n_exp, (size_t)n_exp, sizeof *out, cmp_expert);
    uint64_t off = 0;
    for (int i = 0; i < m; i++) {
        out[i].off = off;
        off += out[i].nbytes;
    }
    free(ts);
    if (st) {
        free(out);
        return st;
    }
    *outp = out;
    *n_out = m;
    return K3_OK;
}

static char *build_header(const out_tensor *out, int n, size_t *len) {
    json_t *h = json_object();
    for (int i = 0; i < n; i++) {
        const out_tensor *o = &out[i];
        json_t *e = json_object(), *sh = json_array();
        json_object_set_new(e, "dtype", json_string(st_dtype_name(o->dtype)));
        for (int d = 0; d < o->rank; d++) json_array_append_new(sh, json_integer(o->shape[d]));
        json_object_set_new(e, "shape", sh);
        json_t *of = json_array();
        json_array_append_new(of, json_integer((json_int_t)o->off));
        json_array_append_new(of, json_integer((json_int_t)(o->off + o->nbytes)));
        json_object_set_new(e, "data_offsets", of);
        char name[K3_ST_MAX_NAME + 8];
        snprintf(name, sizeof name, "%s%s", o->src->name, o->qs ? ".qs" : "");
        json_object_set_new(h, name, e);
    }
    char *s = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    size_t l = strlen(s), pad = (8 - (8 + l) % 8) % 8;
    char *r = k3_xmalloc(l + pad + 1);
    memcpy(r, s, l);
    memset(r + l, ' ', pad);
    r[l + pad] = 0;
    free(s);
    *len = l + pad;
    return r;
}

static k3_status write_shard(repack_ctx *x, int shard, const char *path, char *err, size_t errlen) {
    out_tensor *out = NULL;
    int n = 0;
    k3_status st = plan_shard(x, shard, &out, &n, err, errlen);
    if (st) return st;
    size_t hl;
    char *hdr = build_header(out, n, &hl);
    char tmp[PATHN + 8];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    unsigned char l8[8];
    for (int i = 0; i < 8; i++) l8[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    st = write_all(fd, l8, 8, tmp, err, errlen);
    if (!st) st = write_all(fd, hdr, hl, tmp, err, errlen);
    uint64_t want = 8 + hl + (n ? out[n - 1].off + out[n - 1].nbytes : 0);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    stripe_file sf[K3_MAX_DIRS];
    int nd = x->o->placement ? k3_placement_drives(x->o->placement) : 0;
    for (int i = 0; i < n; i++) out[i].drive = -1;
    if (!st && nd) st = stripe_open(x, out, n, l8, hdr, hl, want, base, sf, err, errlen);
    for (int i = 0; i < n && !st; i++) {
        if (out[i].qs) continue; /* written with its matrix */
        st = out[i].cls >= 4 ? write_quantized(x, fd, tmp, &out[i], err, errlen)
                             : write_copy(x, fd, tmp, &out[i], sf, 8 + hl, err, errlen);
        /* the resume test's crash: SIGKILL once this many source bytes are
         * converted (K3_REPACK_TEST_KILL_AT), i.e. in the middle of a shard */
        if (x->kill_at && x->pr.done >= x->kill_at) raise(SIGKILL);
    }
    struct stat sb;
    if (!st && (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size != want))
        st = k3_errf(K3_ERR_INTERNAL, err, errlen, "%s: %lld bytes written, declared %llu", tmp,
                     (long long)sb.st_size, (unsigned long long)want);
    if (!st && fsync(fd) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: fsync: %s", tmp, strerror(errno));
    if (fd >= 0) close(fd);
    /* the drive files complete before the shard: a shard present on a
     * rerun (skipped) has its stream-written stripes */
    if (nd) st = stripe_close(sf, nd, want, base, st, err, errlen);
    if (!st && rename(tmp, path) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "rename %s: %s", tmp, strerror(errno));
    if (!st) {
        sync_dir(x->o->dst);
        x->stats->bytes_written += want;
    }
out:
    free(hdr);
    free(out);
    return st;
}

/* ---- verify ---- */

/* Compares every expert tensor of source shard `shard` with the container. */
static k3_status verify_shard(repack_ctx *x, st_index *dst, int shard, char *err, size_t errlen) {
    int nt = st_tensor_count(x->src);
    unsigned char *b2 = malloc(K3_REPACK_BLOCK);
    if (!b2) return k3_errf(K3_ERR_NOMEM, err, errlen, "verify buffer");
    k3_status st = K3_OK;
    for (int i = 0; i < nt && !st; i++) {
        const st_tensor *t = st_tensor_at(x->src, i), *d;
        if (t->shard != shard || k3_repack_class(t->name, &x->cfg, 8, 8, 8) != K3_RP_EXPERT)
            continue;
        st = st_find(dst, t->name, &d, err, errlen);
        if (st) break;
        if (d->nbytes != t->nbytes || d->dtype != t->dtype) {
            st =
                k3_errf(K3_ERR_MISMATCH, err, errlen, "VERIFY FAILED: %s (size or dtype)", t->name);
            break;
        }
        for (uint64_t o = 0; o < t->nbytes && !st;) {
            size_t n = t->nbytes - o < K3_REPACK_BLOCK ? (size_t)(t->nbytes - o) : K3_REPACK_BLOCK;
            st = st_pread(x->src, t->shard, t->offset + o, x->buf, n, 0, err, errlen);
            if (!st) st = st_pread(dst, d->shard, d->offset + o, b2, n, 0, err, errlen);
            if (!st && memcmp(x->buf, b2, n))
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "VERIFY FAILED: %s (bytes differ in [%llu, %llu) of %s)", t->name,
                             (unsigned long long)o, (unsigned long long)(o + n),
                             st_shard_name(dst, d->shard));
            o += n;
        }
        x->stats->experts_verified += !st;
    }
    free(b2);
    return st;
}

/* ---- the index ---- */

static int is_shard_name(const char *n) { return has_suffix(n, ".safetensors") && n[0] != '.'; }

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Sorted *.safetensors names of dir (owned array of owned strings). */
static k3_status list_shards(const char *dir, char ***names, int *n, char *err, size_t errlen) {
    DIR *d = opendir(dir);
    if (!d) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", dir, strerror(errno));
    int cap = 16, m = 0;
    char **v = k3_xmalloc(sizeof *v * (size_t)cap);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!is_shard_name(e->d_name)) continue;
        if (m == K3_ST_MAX_SHARDS) {
            for (int i = 0; i < m; i++) free(v[i]);
            free(v);
            closedir(d);
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than %d shards", dir,
                           K3_ST_MAX_SHARDS);
        }
        if (m == cap) v = k3_xrealloc(v, sizeof *v * (size_t)(cap *= 2));
        v[m++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(v, (size_t)m, sizeof *v, cmp_cstr);
    *names = v;
    *n = m;
    return K3_OK;
}

/* The index JSON text of every completed shard in dir. */
static k3_status index_text(const char *dir, char **text, uint64_t *total, int *n_shards,
                            int *n_u8_missing_qs, char *err, size_t errlen) {
    char **names = NULL;
    int n = 0;
    k3_status st = list_shards(dir, &names, &n, err, errlen);
    if (st) return st;
    json_t *wm = json_object();
    uint64_t sum = 0;
    int miss = 0;
    for (int i = 0; i < n && !st; i++) {
        char path[PATHN];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        json_t *h = NULL;
        uint64_t ds = 0, fs = 0;
        st = read_header(path, &h, &ds, &fs, err, errlen);
        if (st) break;
        sum += fs - ds;
        const char *k;
        json_t *v;
        json_object_foreach(h, k, v) {
            if (!strcmp(k, "__metadata__")) continue;
            json_t *prev = json_object_get(wm, k);
            if (prev) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "tensor %s is in both %s and %s: refusing to write an ambiguous "
                             "index (remove one of them)",
                             k, json_string_value(prev), names[i]);
                break;
            }
            json_object_set_new(wm, k, json_string(names[i]));
            const char *dt = json_string_value(json_object_get(v, "dtype"));
            if (dt && !strcmp(dt, "U8") && !strstr(k, ".block_sparse_moe.experts.")) {
                char qs[K3_ST_MAX_NAME + 8];
                snprintf(qs, sizeof qs, "%s.qs", k);
                if (!json_object_get(h, qs)) miss++;
            }
        }
        json_decref(h);
    }
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    if (st) {
        json_decref(wm);
        return st;
    }
    json_t *root = json_object(), *meta = json_object();
    json_object_set_new(meta, "total_size", json_integer((json_int_t)sum));
    json_object_set_new(root, "metadata", meta);
    json_object_set_new(root, "weight_map", wm);
    *text = json_dumps(root, JSON_SORT_KEYS | JSON_INDENT(2));
    json_decref(root);
    *total = sum;
    *n_shards = n;
    if (n_u8_missing_qs) *n_u8_missing_qs = miss;
    return K3_OK;
}

k3_status k3_container_rebuild_index(const char *dir, uint64_t *total, int *n_shards, char *err,
                                     size_t errlen) {
    char *text = NULL;
    k3_status st = index_text(dir, &text, total, n_shards, NULL, err, errlen);
    if (st) return st;
    char path[PATHN], tmp[PATHN + 8];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) st = k3_errf(K3_ERR_IO, err, errlen, "%s: %s", tmp, strerror(errno));
    if (!st) st = write_all(fd, text, strlen(text), tmp, err, errlen);
    if (!st) st = write_all(fd, "\n", 1, tmp, err, errlen);
    if (!st && fsync(fd) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: fsync: %s", tmp, strerror(errno));
    if (fd >= 0) close(fd);
    if (!st && rename(tmp, path) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "rename %s: %s", tmp, strerror(errno));
    if (st)
        unlink(tmp);
    else
        sync_dir(dir);
    free(text);
    return st;
}

k3_status k3_container_check(const char *dir, int *is_container, char *err, size_t errlen) {
    char *text = NULL;
    uint64_t total;
    int n, miss = 0;
    *is_container = 0;
    k3_status st = index_text(dir, &text, &total, &n, &miss, err, errlen);
    if (st) return st;
    *is_container = strstr(text, ".qs\"") != NULL;
    char path[PATHN];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (access(path, F_OK) != 0 && n == 1) { /* a single model.safetensors needs no index */
        free(text);
        return K3_OK;
    }
    json_error_t je;
    json_t *have = json_load_file(path, 0, &je), *want = json_loads(text, 0, &je);
    free(text);
    if (!have) {
        json_decref(want);
        return k3_errf(K3_ERR_MISSING, err, errlen, "%s: %s", path, je.text);
    }
    json_t *hw = json_object_get(have, "weight_map"), *ww = json_object_get(want, "weight_map");
    const char *k;
    json_t *v;
    if (!st) json_object_foreach(hw, k, v) {
            json_t *w = json_object_get(ww, k);
            if (!w) {
                st = k3_errf(K3_ERR_MISSING, err, errlen,
                             "tensor %s: the index names %s, which does not hold it (missing or "
                             "incomplete shard)",
                             k, json_string_value(v));
                break;
            }
            if (!json_equal(w, v)) {
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "tensor %s: the index names %s, it is in %s", k, json_string_value(v),
                             json_string_value(w));
                break;
            }
        }
    if (!st) json_object_foreach(ww, k, v) if (!json_object_get(hw, k)) {
            st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                         "tensor %s in %s is not in the index (rebuild it: k3-coordinator repack)",
                         k, json_string_value(v));
            break;
        }
    json_int_t ht =
        json_integer_value(json_object_get(json_object_get(have, "metadata"), "total_size"));
    if (!st && *is_container && (uint64_t)ht != total)
        st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                     "%s: total_size %lld, the shards hold %llu payload bytes", path, (long long)ht,
                     (unsigned long long)total);
    if (!st && miss)
        st = k3_errf(K3_ERR_FORMAT, err, errlen,
                     "%d U8 matrices have no .qs scale sidecar (an incomplete container)", miss);
    json_decref(have);
    json_decref(want);
    return st;
}

/* ---- the whole repack ---- */

/* "model-00003-of-00010.safetensors" -> 3 (0 when the name has no number) */
static int shard_number(const char *name) {
    int k = 0, of = 0;
    if (sscanf(name, "model-%d-of-%d.safetensors", &k, &of) == 2) return k;
    return 0;
}

static int wanted(const k3_repack_opts *o, int num) {
    if (!o->shards) return 1;
    for (int i = 0; i < o->n_shards; i++)
        if (o->shards[i] == num) return 1;
    return 0;
}

/* <dst>/.k3_repack.json records the bits a container was started with: a
 * resumed or --shards run with other bits would mix formats in one
 * container, so it is refused naming both. */
static k3_status settings_check(const k3_repack_opts *o, char *err, size_t errlen) {
    char path[PATHN];
    snprintf(path, sizeof path, "%s/.k3_repack.json", o->dst);
    json_error_t je;
    json_t *have = json_load_file(path, 0, &je);
    if (have) {
        int b = (int)json_integer_value(json_object_get(have, "bits"));
        int mb = (int)json_integer_value(json_object_get(have, "mla_bits"));
        int hb = (int)json_integer_value(json_object_get(have, "head_bits"));
        json_decref(have);
        if (b != o->bits || mb != o->mla_bits || hb != o->head_bits)
            return k3_errf(K3_ERR_MISMATCH, err, errlen,
                           "%s was started with --bits %d --mla-bits %d --head-bits %d, this run "
                           "asks for %d / %d / %d: use the same bits to resume, or another DST",
                           o->dst, b, mb, hb, o->bits, o->mla_bits, o->head_bits);
        return K3_OK;
    }
    json_t *j = json_pack("{s:s, s:i, s:i, s:i}", "format", "k3shard-repack", "bits", o->bits,
                          "mla_bits", o->mla_bits, "head_bits", o->head_bits);
    int rc = j ? json_dump_file(j, path, JSON_SORT_KEYS) : -1;
    json_decref(j);
    if (rc != 0) return k3_errf(K3_ERR_IO, err, errlen, "%s: cannot write", path);
    return K3_OK;
}

k3_status k3_repack(const k3_repack_opts *o, k3_repack_stats *stats, char *err, size_t errlen) {
    memset(stats, 0, sizeof *stats);
    double t0 = k3_now_s();
    repack_ctx x;
    memset(&x, 0, sizeof x);
    x.o = o;
    x.stats = stats;
    const char *ka = getenv("K3_REPACK_TEST_KILL_AT");
    x.kill_at = ka ? strtoull(ka, NULL, 10) : 0;
    k3_status st = k3_config_load(&x.cfg, o->src, 0, err, errlen);
    if (st) return st;
    if (mkdir(o->dst, 0755) != 0 && errno != EEXIST)
        return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", o->dst, strerror(errno));
    {
        char a[4200], b[4200];
        if (realpath(o->src, a) && realpath(o->dst, b) && !strcmp(a, b))
            return k3_errf(K3_ERR_ARG, err, errlen, "repack: SRC and DST are the same directory %s",
                           a);
    }
    st = settings_check(o, err, errlen);
    if (st) return st;
    for (int d = 0; o->placement && d < k3_placement_drives(o->placement); d++) {
        char sd[PATHN];
        const char *dp = k3_placement_drive_path(o->placement, d);
        snprintf(sd, sizeof sd, "%s/%s", dp, K3_PLACEMENT_SUBDIR);
        struct stat a, b;
        if ((mkdir(dp, 0755) != 0 && errno != EEXIST) ||
            (mkdir(sd, 0755) != 0 && errno != EEXIST) || stat(sd, &a) != 0 || stat(o->dst, &b) != 0)
            return k3_errf(K3_ERR_IO, err, errlen, "--placement: cannot create %s: %s", sd,
                           strerror(errno));
        /* a drive on DST's file system gets a hard link afterwards (place) */
        x.copy_drive[d] = o->place_copy || a.st_dev != b.st_dev;
    }
    st_open_opts so = {o->src, NULL, 0};
    st = st_open(&x.src, &so, err, errlen);
    if (!st) st = st_open_all(x.src, err, errlen);
    if (st) {
        st_close(&x.src);
        return st;
    }
    int ns = st_shard_count(x.src);
    /* a source shard holding only vision tensors is not part of the output */
    int *keep = k3_xcalloc((size_t)ns + 1, sizeof *keep), n_keep = 0, max_num = 0;
    for (int i = 0; i < st_tensor_count(x.src); i++) {
        const st_tensor *t = st_tensor_at(x.src, i);
        if (k3_repack_class(t->name, &x.cfg, 8, 8, 8) != K3_RP_DROP)
            keep[t->shard] = 1;
        else
            stats->tensors_dropped++;
    }
    for (int s = 0; s < ns; s++) {
        n_keep += keep[s];
        int num = shard_number(st_shard_name(x.src, s));
        if (keep[s] && num > max_num) max_num = num;
    }
    for (int i = 0; o->shards && i < o->n_shards; i++) {
        int found = 0;
        for (int s = 0; s < ns; s++)
            found |= keep[s] && shard_number(st_shard_name(x.src, s)) == o->shards[i];
        if (!found) {
            fprintf(stderr, "repack: source shard %d: not in %s (or vision only), skipped\n",
                    o->shards[i], o->src);
            stats->shards_missing++;
        }
    }
    x.buf = malloc(K3_REPACK_BLOCK);
    x.fbuf = malloc(K3_REPACK_BLOCK);
    if (!x.buf || !x.fbuf) st = k3_errf(K3_ERR_NOMEM, err, errlen, "repack buffers");
    /* what to write, and the source bytes the bar counts */
    char(*outname)[300] = k3_xcalloc((size_t)ns + 1, sizeof *outname);
    int *todo = k3_xcalloc((size_t)ns + 1, sizeof *todo);
    for (int s = 0; s < ns && !st; s++) {
        const char *sn = st_shard_name(x.src, s);
        int num = shard_number(sn);
        if (!keep[s] || !wanted(o, num)) continue;
        if (num > 0)
            snprintf(outname[s], sizeof outname[s], "model-%05d-of-%05d.safetensors", num,
                     max_num > n_keep ? max_num : n_keep);
        else
            snprintf(outname[s], sizeof outname[s], "%s", sn);
        char path[PATHN];
        snprintf(path, sizeof path, "%s/%s", o->dst, outname[s]);
        if (access(path, F_OK) == 0) {
            stats->shards_skipped++;
            todo[s] = 2; /* present: verify only */
            continue;
        }
        todo[s] = 1;
        x.pr.n_shards++;
        for (int i = 0; i < st_tensor_count(x.src); i++) {
            const st_tensor *t = st_tensor_at(x.src, i);
            if (t->shard == s && k3_repack_class(t->name, &x.cfg, 8, 8, 8) != K3_RP_DROP)
                x.pr.total += t->nbytes;
        }
    }
    x.pr.mode = o->progress;
    x.pr.t0 = k3_now_s();
    for (int s = 0; s < ns && !st; s++) {
        if (todo[s] != 1) continue;
        x.pr.shard++;
        char path[PATHN];
        snprintf(path, sizeof path, "%s/%s", o->dst, outname[s]);
        st = write_shard(&x, s, path, err, errlen);
        if (st) break;
        stats->shards_written++;
        progress_show(&x.pr, x.pr.shard == x.pr.n_shards ? 2 : 1);
    }
    static const char *const aux[] = {"config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", "tiktoken.model"};
    for (size_t i = 0; i < sizeof aux / sizeof *aux && !st; i++) {
        char a[PATHN], b[PATHN];
        snprintf(a, sizeof a, "%s/%s", o->src, aux[i]);
        snprintf(b, sizeof b, "%s/%s", o->dst, aux[i]);
        if (access(a, F_OK) == 0) st = copy_file(a, b, err, errlen);
    }
    if (!st)
        st = k3_container_rebuild_index(o->dst, &stats->index_total, &stats->index_shards, err,
                                        errlen);
    if (!st && o->verify_full) {
        st_index *d = NULL;
        st_open_opts dso = {o->dst, NULL, 0};
        st = st_open(&d, &dso, err, errlen);
        for (int s = 0; s < ns && !st; s++)
            if (todo[s]) st = verify_shard(&x, d, s, err, errlen);
        st_close(&d);
    }
    free(outname);
    free(todo);
    free(keep);
    free(x.buf);
    free(x.fbuf);
    st_close(&x.src);
    stats->seconds = k3_now_s() - t0;
    return st;
}
