/* common/engine/model.c: loading Kimi K3 weights for a layer range (docs/MODEL.md 2, 4.2).
 *
 * Per layer the loader first looks up every tensor it needs and validates
 * dtype and shape against the config (serially: st_find parses shard
 * headers lazily, and a worker must only touch its own layers' shards),
 * then reads and converts them in parallel (a job list drained by
 * load_threads pool tasks), then folds what the forward pass wants folded
 * (AttnRes w = norm * proj, A = exp(A_log[h])). MoE layers also get their
 * expert table (common/experts/experts.c).
 *
 * Formats (docs/MODEL.md 4.2): K3_BITS for KDA q/k/v/g/o, latent down/up, shared
 * experts and the dense MLP; K3_MLA_BITS for the MLA projections including
 * its o/g; K3_HEAD_BITS for lm_head; everything else f32. A repacked
 * container's U8 tensor with a .qs sidecar is taken as prepared int8 or
 * int4-g64 (the shape tells which); K3_BITS is then ignored except that an
 * explicit K3_BITS=4 downcasts int8 matrices of the K3_BITS class.
 */
#include "common/engine/model.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/experts/experts.h"
#include "common/experts/placement.h"
#include "common/vk/vk_tier.h"
#include "common/kernels/kernels.h"
#include "common/layers/layers.h"
#include "common/base/log.h"
#include "common/ckpt/safetensors.h"

struct k3_model {
    k3_config cfg;
    k3_model_opts opts;                 /* copy; model_dir / dirs pointers not used after open */
    st_index *idx;                      /* owned */
    char prefix[32];                    /* "" or "language_model." */
    int layer_a, layer_b;               /* [a, b) */
    k3_layer_w *layers;                 /* [b - a], owned */
    k3_experts *experts;                /* owned; NULL when the range has no MoE layer */
    k3_vk_tier *vk;                     /* owned; NULL = no Vulkan tier (not asked, or it failed) */
    k3_placement *placement;            /* owned; NULL = experts read from the shards */
    const struct k3_moe_remote *remote; /* borrowed, NULL = none */
    char *usage_path;                   /* owned copy of opts.usage_path, NULL = no history */
    k3_pool *pool;                      /* owned; shared by every forward and head (pool.h turns) */
    /* global tensors (want_global) */
    int has_global;
    const st_tensor *embed; /* [vocab][D] BF16/F16/F32, rows read on demand */
    float *final_norm;      /* [D] model.norm, owned */
    float *w_out;           /* [D] output_attn_res_norm * _proj, owned */
    k3_qmat lm_head;        /* [vocab][D], K3_HEAD_BITS */
    uint64_t fingerprint;
    size_t resident; /* bytes of dense weights */
    /* K3_MMAP: one read-only mapping per shard holding a mapped matrix,
     * [st_shard_count], made serially in phase 1 (add_mat), unmapped at close */
    void **map_base;
    size_t *map_len;
    int n_maps;
};

void k3_model_opts_default(k3_model_opts *o) {
    memset(o, 0, sizeof *o);
    o->bits = 4;
    o->mla_bits = 8;
    o->head_bits = 8;
    o->idot = 1;
    o->expert_gb = 8.0;
    o->direct = 1;
    o->pipe = 1;
    o->load_threads = 4;
    o->usage_save = 1; /* only with a usage_path */
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    o->threads = n < 1 ? 1 : n > K3_MAX_THREADS ? K3_MAX_THREADS : (int)n;
}

/* ---- fingerprint (FNV-1a 64) ---- */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* FNV-1a is enough here: the fingerprint guards against mistakes (another
 * checkpoint, another config), not against an attacker, whom CURVE keeps
 * out. The index is hashed as it is read, so its size (K3's is ~50 MB)
 * costs no allocation. */
k3_status k3_model_fingerprint_dir(const char *model_dir, const k3_config *cfg, double topp,
                                   uint64_t *out, char *err, size_t errlen) {
    uint64_t h = 1469598103934665603ull;
    uint64_t cfp = k3_config_fingerprint(cfg);
    h = fnv(h, &cfp, sizeof cfp);
    h = fnv(h, &topp, sizeof topp);
    char path[4200];
    if (snprintf(path, sizeof path, "%s/model.safetensors.index.json", model_dir) >=
        (int)sizeof path)
        return k3_errf(K3_ERR_ARG, err, errlen, "model directory path too long");
    if (access(path, F_OK) == 0) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
        struct stat sb;
        k3_status st = K3_OK;
        if (fstat(fd, &sb) != 0)
            st = k3_errf(K3_ERR_IO, err, errlen, "%s: fstat: %s", path, strerror(errno));
        else if (!S_ISREG(sb.st_mode))
            st = k3_errf(K3_ERR_ARG, err, errlen, "%s: not a regular file", path);
        else if ((uint64_t)sb.st_size > K3_MAX_INDEX_BYTES)
            st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %lld bytes > limit %zu", path,
                         (long long)sb.st_size, (size_t)K3_MAX_INDEX_BYTES);
        unsigned char buf[65536];
        for (;;) {
            if (st) break;
            ssize_t r = read(fd, buf, sizeof buf);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) st = k3_errf(K3_ERR_IO, err, errlen, "%s: read: %s", path, strerror(errno));
            if (r <= 0) break;
            h = fnv(h, buf, (size_t)r);
        }
        close(fd);
        if (st) return st;
    }
    *out = h;
    return K3_OK;
}

/* ---- load jobs ---- */

enum { JOB_VEC = 0, JOB_MAT };

typedef struct load_job {
    int kind;            /* JOB_VEC or JOB_MAT */
    const st_tensor *t;  /* the tensor */
    const st_tensor *qs; /* container sidecar <name>.qs, or NULL */
    int rows, cols;      /* JOB_MAT: logical [rows][cols] */
    int bits;            /* JOB_MAT from floats: target bits (>= 32: f32) */
    int downcast;        /* JOB_MAT from an int8 container: to int4-g64 */
    float **vec;         /* JOB_VEC destination ([numel] floats) */
    size_t numel;        /* JOB_VEC element count */
    k3_qmat *mat;        /* JOB_MAT destination */
    k3_status st;
    char err[320];
} load_job;

#define MAX_JOBS 48

typedef struct loader {
    k3_model *m;
    char lp[96]; /* "<prefix>model.layers.<i>." for the layer being loaded */
    load_job jobs[MAX_JOBS];
    int n_jobs;
    atomic_int next; /* next job to run */
    char *err;
    size_t errlen;
} loader;

static void shape_str(const int64_t *s, int rank, char *buf, size_t n) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < rank && o < n; d++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", d ? ", " : "", (long long)s[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static int is_float_dtype(st_dtype d) { return d == ST_BF16 || d == ST_F16 || d == ST_F32; }

/* Looks up `name`, checks a float dtype and the exact shape. The message
 * names the tensor and both shapes, so a checkpoint whose config disagrees
 * with its tensors is diagnosed at load, never by a wrong answer or an
 * out-of-bounds read later. */
static k3_status find_checked(loader *ld, const char *name, int rank, const int64_t *shape,
                              const st_tensor **out) {
    k3_status st = st_find(ld->m->idx, name, out, ld->err, ld->errlen);
    if (st != K3_OK) return st;
    const st_tensor *t = *out;
    int ok = t->rank == rank;
    for (int d = 0; ok && d < rank; d++) ok = t->shape[d] == shape[d];
    if (!ok) {
        char got[96], want[96];
        shape_str(t->shape, t->rank, got, sizeof got);
        shape_str(shape, rank, want, sizeof want);
        return k3_errf(K3_ERR_MISMATCH, ld->err, ld->errlen,
                       "tensor %s: shape %s does not match the config's %s", name, got, want);
    }
    if (!is_float_dtype(t->dtype))
        return k3_errf(K3_ERR_FORMAT, ld->err, ld->errlen,
                       "tensor %s: dtype %s, expected BF16, F16 or F32", name,
                       st_dtype_name(t->dtype));
    return K3_OK;
}

/* Jobs are a fixed array: a layer needs at most ~30 tensors (KDA + MoE). */
static load_job *new_job(loader *ld) {
    K3_ASSERT(ld->n_jobs < MAX_JOBS);
    load_job *j = &ld->jobs[ld->n_jobs++];
    memset(j, 0, sizeof *j);
    return j;
}

/* A float vector of the given shape (rank 1 or [1, n]) into *dst. */
static k3_status add_vec(loader *ld, const char *full, int rank, const int64_t *shape,
                         float **dst) {
    const st_tensor *t;
    k3_status st = find_checked(ld, full, rank, shape, &t);
    if (st != K3_OK) return st;
    load_job *j = new_job(ld);
    j->kind = JOB_VEC;
    j->t = t;
    j->vec = dst;
    j->numel = 1;
    for (int d = 0; d < rank; d++) j->numel *= (size_t)shape[d];
    return K3_OK;
}

/* "<layer prefix><suffix>" */
static const char *lname(loader *ld, const char *suffix, char *buf, size_t n) {
    snprintf(buf, n, "%s%s", ld->lp, suffix);
    return buf;
}

static k3_status layer_vec(loader *ld, const char *suffix, int64_t n, float **dst) {
    char name[K3_ST_MAX_NAME];
    int64_t shape[1] = {n};
    return add_vec(ld, lname(ld, suffix, name, sizeof name), 1, shape, dst);
}

/* K3_MMAP: maps shard `shard` whole, read-only, once. The pages stay
 * file-backed (clean, reclaimable): RSS shows them, the private heap does not. */
#define TRY_MAP(x)                                                                                 \
    do {                                                                                           \
        k3_status stm_ = (x);                                                                      \
        if (stm_ != K3_OK) return stm_;                                                            \
    } while (0)

static k3_status map_shard(loader *ld, int shard) {
    k3_model *m = ld->m;
    if (!m->map_base) {
        m->n_maps = st_shard_count(m->idx);
        m->map_base = k3_xcalloc((size_t)m->n_maps, sizeof *m->map_base);
        m->map_len = k3_xcalloc((size_t)m->n_maps, sizeof *m->map_len);
    }
    if (shard < 0 || shard >= m->n_maps) return K3_ERR_INTERNAL;
    if (m->map_base[shard]) return K3_OK;
    int fd = st_shard_fd(m->idx, shard, 0);
    size_t len = (size_t)st_shard_size(m->idx, shard);
    void *p = fd >= 0 && len ? mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED)
        return k3_errf(K3_ERR_IO, ld->err, ld->errlen, "K3_MMAP: cannot map %s: %s",
                       st_shard_path(m->idx, shard), fd < 0 ? "not open" : strerror(errno));
    m->map_base[shard] = p;
    m->map_len[shard] = len;
    return K3_OK;
}

/* K3_MMAP refuses, naming the tensor, any matrix it cannot use in place. */
static k3_status mmap_refuse(loader *ld, const char *name, const char *why) {
    return k3_errf(K3_ERR_FORMAT, ld->err, ld->errlen,
                   "K3_MMAP=1: tensor %s %s; mapping needs a fully repacked container "
                   "(k3-coordinator repack) at its own bits: unset K3_MMAP or repack",
                   name, why);
}

/* A [rows][cols] matrix in `bits` (>= 32: f32). A U8 tensor with a .qs
 * sidecar is a prepared container matrix (docs/MODEL.md 2.3). `class_bits` says
 * whether the matrix belongs to the K3_BITS class (explicit 4 downcasts). */
static k3_status add_mat(loader *ld, const char *name, int rows, int cols, int bits, int class_bits,
                         k3_qmat *dst) {
    k3_model *m = ld->m;
    const st_tensor *t;
    k3_status st = st_find(m->idx, name, &t, ld->err, ld->errlen);
    if (st != K3_OK) return st;
    load_job *j;
    if (t->dtype == ST_U8) {
        char qs_name[K3_ST_MAX_NAME + 4];
        snprintf(qs_name, sizeof qs_name, "%s.qs", name);
        const st_tensor *qs;
        st = st_find_opt(m->idx, qs_name, &qs, ld->err, ld->errlen);
        if (st != K3_OK) return st;
        if (!qs)
            return k3_errf(K3_ERR_FORMAT, ld->err, ld->errlen,
                           "tensor %s: dtype U8 without a %s scale sidecar (not a repacked "
                           "container matrix)",
                           name, qs_name);
        int is_i8 = t->rank == 2 && t->shape[0] == rows && t->shape[1] == cols && qs->rank == 1 &&
                    qs->shape[0] == rows;
        int is_i4 = cols % 64 == 0 && t->rank == 2 && t->shape[0] == rows &&
                    t->shape[1] == cols / 2 && qs->rank == 2 && qs->shape[0] == rows &&
                    qs->shape[1] == cols / 64;
        if (!is_i8 && !is_i4) {
            char got[96], gq[96];
            shape_str(t->shape, t->rank, got, sizeof got);
            shape_str(qs->shape, qs->rank, gq, sizeof gq);
            return k3_errf(K3_ERR_MISMATCH, ld->err, ld->errlen,
                           "tensor %s: container shape %s with scales %s matches neither int8 "
                           "[%d, %d] + [%d] nor int4-g64 [%d, %d] + [%d, %d]",
                           name, got, gq, rows, cols, rows, rows, cols / 2, rows, cols / 64);
        }
        if (!is_float_dtype(qs->dtype))
            return k3_errf(K3_ERR_FORMAT, ld->err, ld->errlen, "tensor %s: dtype %s, expected F32",
                           qs_name, st_dtype_name(qs->dtype));
        int downcast =
            is_i8 && class_bits && m->opts.bits_explicit && m->opts.bits == 4 && cols % 64 == 0;
        if (m->opts.mmap) {
            if (downcast) return mmap_refuse(ld, name, "is int8 and K3_BITS=4 asks for a downcast");
            if (qs->dtype != ST_F32 || qs->offset % sizeof(float))
                return mmap_refuse(ld, qs_name, "is not an aligned F32 sidecar");
            TRY_MAP(map_shard(ld, t->shard));
            TRY_MAP(map_shard(ld, qs->shard));
        }
        j = new_job(ld);
        j->qs = qs;
        j->downcast = downcast;
    } else {
        int64_t shape[2] = {rows, cols};
        st = find_checked(ld, name, 2, shape, &t);
        if (st != K3_OK) return st;
        if (m->opts.mmap && bits < 32)
            return mmap_refuse(ld, name, "is not prepared (it needs load-time quantization)");
        j = new_job(ld);
    }
    j->kind = JOB_MAT;
    j->t = t;
    j->rows = rows;
    j->cols = cols;
    j->bits = bits;
    j->mat = dst;
    return K3_OK;
}

static k3_status layer_mat(loader *ld, const char *suffix, int rows, int cols, int bits,
                           int class_bits, k3_qmat *dst) {
    char name[K3_ST_MAX_NAME];
    return add_mat(ld, lname(ld, suffix, name, sizeof name), rows, cols, bits, class_bits, dst);
}

static void *alloc_or_null(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}

/* Runs one job: read, convert, quantize. Errors go to the job's own buffer
 * (jobs run concurrently); run_jobs reports them in list order. Large
 * allocations here are sized by the config, so a failure is K3_ERR_NOMEM,
 * not an abort. */
static void run_job(k3_model *m, load_job *j) {
    const st_tensor *t = j->t;
    if (j->kind == JOB_VEC) {
        float *v = alloc_or_null(sizeof(float) * j->numel);
        if (!v) {
            j->st = k3_errf(K3_ERR_NOMEM, j->err, sizeof j->err,
                            "tensor %s: cannot allocate %zu floats", t->name, j->numel);
            return;
        }
        j->st = st_read_f32(m->idx, t, v, j->numel, j->err, sizeof j->err);
        if (j->st != K3_OK) {
            free(v);
            return;
        }
        *j->vec = v;
        return;
    }
    size_t rows = (size_t)j->rows, cols = (size_t)j->cols;
    k3_qmat q;
    memset(&q, 0, sizeof q);
    if (j->qs) {
        /* prepared container matrix: int8 [rows][cols] or int4 [rows][cols/2];
         * the U8 bytes are the engine's own storage (int8 two's complement,
         * or q+8 nibbles with the even column low), so they are used as read */
        int is_i8 = t->shape[1] == j->cols;
        size_t nq = is_i8 ? rows * cols : rows * cols / 2;
        size_t ns = is_i8 ? rows : rows * cols / 64;
        if (m->opts.mmap) {
            /* mapped in place: the bytes are the engine's storage as they are */
            unsigned char *tb = m->map_base[t->shard], *sbm = m->map_base[j->qs->shard];
            q.fmt = is_i8 ? K3_QF_I8 : K3_QF_I4G64;
            q.rows = j->rows;
            q.cols = j->cols;
            if (is_i8)
                q.q8 = (int8_t *)(tb + t->offset);
            else
                q.q4 = tb + t->offset;
            q.scales = (float *)(void *)(sbm + j->qs->offset);
            q.owned = 0;
            q.idot = m->opts.dense_idot;
            *j->mat = q;
            return;
        }
        void *qb = alloc_or_null(nq);
        float *sb = alloc_or_null(sizeof(float) * ns);
        if (!qb || !sb) {
            free(qb);
            free(sb);
            j->st = k3_errf(K3_ERR_NOMEM, j->err, sizeof j->err,
                            "tensor %s: cannot allocate %zu bytes", t->name, nq);
            return;
        }
        j->st = st_read_raw(m->idx, t, qb, nq, j->err, sizeof j->err);
        if (j->st == K3_OK) j->st = st_read_f32(m->idx, j->qs, sb, ns, j->err, sizeof j->err);
        if (j->st != K3_OK) {
            free(qb);
            free(sb);
            return;
        }
        q.fmt = is_i8 ? K3_QF_I8 : K3_QF_I4G64;
        q.rows = j->rows;
        q.cols = j->cols;
        if (is_i8)
            q.q8 = qb;
        else
            q.q4 = qb;
        q.scales = sb;
        q.owned = 1;
        if (j->downcast) {
            k3_qmat q4;
            memset(&q4, 0, sizeof q4);
            k3_qmat_downcast_i4(&q4, &q);
            k3_qmat_free(&q);
            q = q4;
        }
        q.idot = m->opts.dense_idot; /* used by int8 / int4 matrices only */
        *j->mat = q;
        return;
    }
    float *w = alloc_or_null(sizeof(float) * rows * cols);
    if (!w) {
        j->st =
            k3_errf(K3_ERR_NOMEM, j->err, sizeof j->err,
                    "tensor %s: cannot allocate %zu floats to convert it", t->name, rows * cols);
        return;
    }
    j->st = st_read_f32(m->idx, t, w, rows * cols, j->err, sizeof j->err);
    if (j->st != K3_OK) {
        free(w);
        return;
    }
    if (j->bits >= 32) {
        /* f32: keep the converted buffer itself */
        q.fmt = K3_QF_F32;
        q.rows = j->rows;
        q.cols = j->cols;
        q.w = w;
        q.owned = 1;
    } else {
        k3_qmat_quantize(&q, w, j->rows, j->cols, j->bits);
        free(w);
    }
    q.idot = m->opts.dense_idot;
    *j->mat = q;
}

/* A pool task: takes jobs off the shared counter until none are left. The
 * number of tasks bounds how many conversion buffers exist at once. */
static void job_task(void *ctx, int task) {
    (void)task;
    loader *ld = ctx;
    for (;;) {
        int i = atomic_fetch_add(&ld->next, 1);
        if (i >= ld->n_jobs) return;
        run_job(ld->m, &ld->jobs[i]);
    }
}

/* Drains the job list with up to load_threads pool tasks; reports the first
 * failed job (in list order, so the message does not depend on timing). */
static k3_status run_jobs(loader *ld) {
    atomic_store(&ld->next, 0);
    int tasks = ld->m->opts.load_threads;
    if (tasks < 1) tasks = 1;
    if (tasks > ld->n_jobs) tasks = ld->n_jobs;
    if (tasks > 0) k3_pool_run(ld->m->pool, job_task, ld, tasks);
    for (int i = 0; i < ld->n_jobs; i++)
        if (ld->jobs[i].st != K3_OK)
            return k3_errf(ld->jobs[i].st, ld->err, ld->errlen, "%s", ld->jobs[i].err);
    return K3_OK;
}

/* Bytes of a matrix, 0 for one never loaded (a zeroed struct). */
static size_t qmat_bytes(const k3_qmat *q) { return q->rows ? k3_qmat_bytes(q) : 0; }

/* ---- one layer ---- */

#define TRY(x)                                                                                     \
    do {                                                                                           \
        k3_status st_ = (x);                                                                       \
        if (st_ != K3_OK) return st_;                                                              \
    } while (0)

/* The loaded-then-folded vectors of a layer: read by the jobs, combined into
 * the layer's weights by fold_layer, then freed (on failure too). */
typedef struct layer_tmp {
    float *an, *ap; /* self_attention_res_norm [D], _proj [1, D] */
    float *mn, *mp; /* mlp_res_norm [D], _proj [1, D] */
    float *a_log;   /* KDA A_log [kda_hd] */
} layer_tmp;

/* Every layer: the two norms and the AttnRes (norm, [1, D] proj) pairs. */
static k3_status add_common_jobs(loader *ld, k3_layer_w *lw, layer_tmp *tmp) {
    int D = ld->m->cfg.hidden;
    int64_t row_d[2] = {1, D};
    char name[K3_ST_MAX_NAME];
    TRY(layer_vec(ld, "input_layernorm.weight", D, &lw->in_norm));
    TRY(layer_vec(ld, "post_attention_layernorm.weight", D, &lw->post_norm));
    TRY(layer_vec(ld, "self_attention_res_norm.weight", D, &tmp->an));
    TRY(add_vec(ld, lname(ld, "self_attention_res_proj.weight", name, sizeof name), 2, row_d,
                &tmp->ap));
    TRY(layer_vec(ld, "mlp_res_norm.weight", D, &tmp->mn));
    return add_vec(ld, lname(ld, "mlp_res_proj.weight", name, sizeof name), 2, row_d, &tmp->mp);
}

/* KDA: q/k/v/g/o in K3_BITS; the decay bottleneck, beta and all vectors stay
 * f32 (docs/MODEL.md 4.2); conv taps [P, 1, K], oldest first. */
static k3_status add_kda_jobs(loader *ld, k3_kda_w *w, layer_tmp *tmp) {
    const k3_config *c = &ld->m->cfg;
    int D = c->hidden, P = c->kda_proj, H = c->kda_heads, hd = c->kda_hd, bits = ld->m->opts.bits;
    int64_t conv_shape[3] = {P, 1, c->conv_k};
    char name[K3_ST_MAX_NAME];
    TRY(layer_mat(ld, "self_attn.q_proj.weight", P, D, bits, 1, &w->q));
    TRY(layer_mat(ld, "self_attn.k_proj.weight", P, D, bits, 1, &w->k));
    TRY(layer_mat(ld, "self_attn.v_proj.weight", P, D, bits, 1, &w->v));
    TRY(layer_mat(ld, "self_attn.g_proj.weight", P, D, bits, 1, &w->g));
    TRY(layer_mat(ld, "self_attn.o_proj.weight", D, P, bits, 1, &w->o));
    TRY(layer_mat(ld, "self_attn.f_a_proj.weight", hd, D, 32, 0, &w->f_a));
    TRY(layer_mat(ld, "self_attn.f_b_proj.weight", P, hd, 32, 0, &w->f_b));
    TRY(layer_mat(ld, "self_attn.b_proj.weight", H, D, 32, 0, &w->b));
    TRY(add_vec(ld, lname(ld, "self_attn.q_conv1d.weight", name, sizeof name), 3, conv_shape,
                &w->conv_q));
    TRY(add_vec(ld, lname(ld, "self_attn.k_conv1d.weight", name, sizeof name), 3, conv_shape,
                &w->conv_k));
    TRY(add_vec(ld, lname(ld, "self_attn.v_conv1d.weight", name, sizeof name), 3, conv_shape,
                &w->conv_v));
    TRY(layer_vec(ld, "self_attn.dt_bias", P, &w->dt_bias));
    /* A_log is stored [kda_hd] but means one value per head (docs/MODEL.md 7.1) */
    TRY(layer_vec(ld, "self_attn.A_log", hd, &tmp->a_log));
    return layer_vec(ld, "self_attn.o_norm.weight", hd, &w->o_norm);
}

/* Gated MLA: every matrix in K3_MLA_BITS, o/g included. */
static k3_status add_mla_jobs(loader *ld, k3_mla_w *w) {
    const k3_config *c = &ld->m->cfg;
    int D = c->hidden, HM = c->n_heads, mb = ld->m->opts.mla_bits;
    TRY(layer_mat(ld, "self_attn.q_a_proj.weight", c->q_lora, D, mb, 0, &w->q_a));
    TRY(layer_vec(ld, "self_attn.q_a_layernorm.weight", c->q_lora, &w->q_a_norm));
    TRY(layer_mat(ld, "self_attn.q_b_proj.weight", HM * c->qk_head, c->q_lora, mb, 0, &w->q_b));
    TRY(layer_mat(ld, "self_attn.kv_a_proj_with_mqa.weight", c->kv_lora + c->qk_rope, D, mb, 0,
                  &w->kv_a));
    TRY(layer_vec(ld, "self_attn.kv_a_layernorm.weight", c->kv_lora, &w->kv_a_norm));
    TRY(layer_mat(ld, "self_attn.kv_b_proj.weight", HM * (c->qk_nope + c->v_head), c->kv_lora, mb,
                  0, &w->kv_b));
    TRY(layer_mat(ld, "self_attn.g_proj.weight", HM * c->v_head, D, mb, 0, &w->g));
    return layer_mat(ld, "self_attn.o_proj.weight", D, HM * c->v_head, mb, 0, &w->o);
}

/* LatentMoE: f32 router + bias; latent and shared in K3_BITS; the routed
 * experts are not loaded here (load_layer reads their table after). */
static k3_status add_moe_jobs(loader *ld, k3_moe_w *w) {
    const k3_config *c = &ld->m->cfg;
    int D = c->hidden, LT = c->latent, S = c->shared_inter, bits = ld->m->opts.bits;
    TRY(layer_mat(ld, "block_sparse_moe.gate.weight", c->n_experts, D, 32, 0, &w->router));
    TRY(layer_vec(ld, "block_sparse_moe.gate.e_score_correction_bias", c->n_experts, &w->bias));
    TRY(layer_mat(ld, "block_sparse_moe.routed_expert_down_proj.weight", LT, D, bits, 1,
                  &w->lat_down));
    TRY(layer_mat(ld, "block_sparse_moe.routed_expert_up_proj.weight", D, LT, bits, 1, &w->lat_up));
    TRY(layer_vec(ld, "block_sparse_moe.routed_expert_norm.weight", LT, &w->lat_norm));
    TRY(layer_mat(ld, "block_sparse_moe.shared_experts.gate_proj.weight", S, D, bits, 1,
                  &w->sh_gate));
    TRY(layer_mat(ld, "block_sparse_moe.shared_experts.up_proj.weight", S, D, bits, 1, &w->sh_up));
    return layer_mat(ld, "block_sparse_moe.shared_experts.down_proj.weight", D, S, bits, 1,
                     &w->sh_down);
}

/* The dense SiTU MLP (layers < first_k_dense_replace), K3_BITS. */
static k3_status add_dense_jobs(loader *ld, k3_dense_w *w) {
    int D = ld->m->cfg.hidden, I = ld->m->cfg.dense_inter, bits = ld->m->opts.bits;
    TRY(layer_mat(ld, "mlp.gate_proj.weight", I, D, bits, 1, &w->gate));
    TRY(layer_mat(ld, "mlp.up_proj.weight", I, D, bits, 1, &w->up));
    return layer_mat(ld, "mlp.down_proj.weight", D, I, bits, 1, &w->down);
}

/* Folds once what the forward pass wants folded: the AttnRes weights
 * w = norm * proj (float product) and, for KDA, A[h] = exp(A_log[h]) for
 * the first kda_heads entries only. */
static void fold_layer(const k3_config *c, k3_layer_w *lw, const layer_tmp *tmp) {
    int D = c->hidden, H = c->kda_heads;
    lw->w_attn_res = k3_xmalloc(sizeof(float) * (size_t)D);
    lw->w_mlp_res = k3_xmalloc(sizeof(float) * (size_t)D);
    for (int d = 0; d < D; d++) {
        lw->w_attn_res[d] = tmp->an[d] * tmp->ap[d];
        lw->w_mlp_res[d] = tmp->mn[d] * tmp->mp[d];
    }
    if (lw->is_kda) {
        lw->kda.A = k3_xmalloc(sizeof(float) * (size_t)H);
        for (int h = 0; h < H; h++) lw->kda.A[h] = expf(tmp->a_log[h]);
    }
}

/* Loads layer i: phase 1 finds and validates every tensor (serial, so the
 * error for the first bad tensor is deterministic: the add_*_jobs in
 * checkpoint order, stopping at the first failure), phase 2 reads and
 * converts them in parallel, phase 3 folds, then the expert table. On
 * failure whatever was loaded stays in the layer struct and is freed by
 * k3_model_close. */
static k3_status load_layer(loader *ld, int i) {
    k3_model *m = ld->m;
    const k3_config *c = &m->cfg;
    k3_layer_w *lw = &m->layers[i - m->layer_a];
    lw->layer = i;
    lw->is_kda = c->is_kda[i];
    lw->is_moe = c->is_moe[i];
    lw->is_boundary = c->is_boundary[i];
    snprintf(ld->lp, sizeof ld->lp, "%smodel.layers.%d.", m->prefix, i);
    ld->n_jobs = 0;

    layer_tmp tmp = {0};
    k3_status st = add_common_jobs(ld, lw, &tmp);
    if (st == K3_OK)
        st = lw->is_kda ? add_kda_jobs(ld, &lw->kda, &tmp) : add_mla_jobs(ld, &lw->mla);
    if (st == K3_OK) st = lw->is_moe ? add_moe_jobs(ld, &lw->moe) : add_dense_jobs(ld, &lw->dense);
    if (st == K3_OK) st = run_jobs(ld);
    if (st == K3_OK) fold_layer(c, lw, &tmp);
    free(tmp.an);
    free(tmp.ap);
    free(tmp.mn);
    free(tmp.mp);
    free(tmp.a_log);
    if (st != K3_OK) return st;

    /* the expert table: sizes validated now, bytes read on first use */
    if (lw->is_moe) {
        int missing = 0;
        TRY(k3_experts_load_layer(m->experts, m->prefix, i, &missing, ld->err, ld->errlen));
    }
    return K3_OK;
}

/* Resident bytes of one layer's dense weights (RSS reports, progress). */
static size_t layer_bytes(const k3_config *c, const k3_layer_w *lw) {
    size_t D = (size_t)c->hidden, b = 4 * D * sizeof(float);
    if (lw->is_kda) {
        const k3_kda_w *w = &lw->kda;
        b += qmat_bytes(&w->q) + qmat_bytes(&w->k) + qmat_bytes(&w->v) + qmat_bytes(&w->g) +
             qmat_bytes(&w->o) + qmat_bytes(&w->f_a) + qmat_bytes(&w->f_b) + qmat_bytes(&w->b);
        b += sizeof(float) * ((size_t)c->kda_proj * (3 * (size_t)c->conv_k + 1) +
                              (size_t)c->kda_heads + (size_t)c->kda_hd);
    } else {
        const k3_mla_w *w = &lw->mla;
        b += qmat_bytes(&w->q_a) + qmat_bytes(&w->q_b) + qmat_bytes(&w->kv_a) +
             qmat_bytes(&w->kv_b) + qmat_bytes(&w->g) + qmat_bytes(&w->o);
        b += sizeof(float) * (size_t)(c->q_lora + c->kv_lora);
    }
    if (lw->is_moe) {
        const k3_moe_w *w = &lw->moe;
        b += qmat_bytes(&w->router) + qmat_bytes(&w->lat_down) + qmat_bytes(&w->lat_up) +
             qmat_bytes(&w->sh_gate) + qmat_bytes(&w->sh_up) + qmat_bytes(&w->sh_down);
        b += sizeof(float) * (size_t)(c->n_experts + c->latent);
    } else {
        b += qmat_bytes(&lw->dense.gate) + qmat_bytes(&lw->dense.up) + qmat_bytes(&lw->dense.down);
    }
    return b;
}

/* Frees a matrix that may never have been loaded. */
static void qfree(k3_qmat *q) {
    if (q->rows) k3_qmat_free(q);
    memset(q, 0, sizeof *q);
}

/* Frees every buffer of a layer, loaded or not (all start NULL / zero). */
static void free_layer(k3_layer_w *lw) {
    free(lw->in_norm);
    free(lw->post_norm);
    free(lw->w_attn_res);
    free(lw->w_mlp_res);
    k3_kda_w *k = &lw->kda;
    qfree(&k->q), qfree(&k->k), qfree(&k->v), qfree(&k->g), qfree(&k->o);
    qfree(&k->f_a), qfree(&k->f_b), qfree(&k->b);
    free(k->conv_q), free(k->conv_k), free(k->conv_v), free(k->dt_bias), free(k->A);
    free(k->o_norm);
    k3_mla_w *a = &lw->mla;
    qfree(&a->q_a), qfree(&a->q_b), qfree(&a->kv_a), qfree(&a->kv_b), qfree(&a->g);
    qfree(&a->o);
    free(a->q_a_norm), free(a->kv_a_norm);
    qfree(&lw->dense.gate), qfree(&lw->dense.up), qfree(&lw->dense.down);
    k3_moe_w *e = &lw->moe;
    qfree(&e->router), qfree(&e->lat_down), qfree(&e->lat_up);
    qfree(&e->sh_gate), qfree(&e->sh_up), qfree(&e->sh_down);
    free(e->bias), free(e->lat_norm);
    memset(lw, 0, sizeof *lw);
}

/* ---- global tensors ---- */

/* The coordinator's tensors. The embedding stays on disk: one row is read
 * per token (k3_model_embed), so only its shape and dtype are checked here. */
static k3_status load_global(loader *ld) {
    k3_model *m = ld->m;
    const k3_config *c = &m->cfg;
    int D = c->hidden;
    char name[K3_ST_MAX_NAME];
    int64_t emb_shape[2] = {c->vocab, D}, vec_d[1] = {D}, row_d[2] = {1, D};
    float *on = NULL, *op = NULL;
    ld->n_jobs = 0;
    snprintf(name, sizeof name, "%smodel.embed_tokens.weight", m->prefix);
    TRY(find_checked(ld, name, 2, emb_shape, &m->embed));
    k3_status st = K3_OK;
#define STEP(x)                                                                                    \
    do {                                                                                           \
        if (st == K3_OK) st = (x);                                                                 \
    } while (0)
    snprintf(name, sizeof name, "%smodel.norm.weight", m->prefix);
    STEP(add_vec(ld, name, 1, vec_d, &m->final_norm));
    snprintf(name, sizeof name, "%smodel.output_attn_res_norm.weight", m->prefix);
    STEP(add_vec(ld, name, 1, vec_d, &on));
    snprintf(name, sizeof name, "%smodel.output_attn_res_proj.weight", m->prefix);
    STEP(add_vec(ld, name, 2, row_d, &op));
    snprintf(name, sizeof name, "%slm_head.weight", m->prefix);
    STEP(add_mat(ld, name, c->vocab, D, m->opts.head_bits, 0, &m->lm_head));
    STEP(run_jobs(ld));
#undef STEP
    if (st == K3_OK) {
        m->w_out = k3_xmalloc(sizeof(float) * (size_t)D);
        for (int d = 0; d < D; d++) m->w_out[d] = on[d] * op[d];
        m->has_global = 1;
        m->resident += qmat_bytes(&m->lm_head) + 2 * sizeof(float) * (size_t)D;
    }
    free(on);
    free(op);
    return st;
}

/* Probes the tensor-name prefix (docs/MODEL.md 2.1) on this range's first layer, not
 * on layer 0 as st_prefix() does: with an index.json, looking up another
 * worker's layer would open that worker's shard. */
static k3_status probe_prefix(k3_model *m, char *err, size_t errlen) {
    static const char *const cands[] = {"", "language_model."};
    char name[K3_ST_MAX_NAME + 32], bare[K3_ST_MAX_NAME];
    /* a global-only model probes on the embedding instead */
    if (m->layer_a < m->layer_b)
        snprintf(bare, sizeof bare, "model.layers.%d.input_layernorm.weight", m->layer_a);
    else
        snprintf(bare, sizeof bare, "model.embed_tokens.weight");
    for (int k = 0; k < 2; k++) {
        const st_tensor *t;
        snprintf(name, sizeof name, "%s%s", cands[k], bare);
        k3_status st = st_find_opt(m->idx, name, &t, err, errlen);
        if (st != K3_OK) return st;
        if (t) {
            snprintf(m->prefix, sizeof m->prefix, "%s", cands[k]);
            return K3_OK;
        }
    }
    return k3_errf(K3_ERR_MISSING, err, errlen,
                   "tensor %s not found in %s (also tried the prefix language_model.)", bare,
                   m->opts.model_dir);
}

/* ---- expert usage history ---- */

/* Loads the history (refusing another model's, docs/MODEL.md 5.5) and warms the
 * cache with each layer's hottest experts; once the tables are loaded. */
static k3_status usage_start(k3_model *m, char *err, size_t errlen) {
    m->usage_path = k3_xstrdup(m->opts.usage_path);
    double t0 = k3_now_ms();
    k3_status st = k3_experts_usage_load(m->experts, m->usage_path, err, errlen);
    if (st != K3_OK) {
        k3_err_prefix(err, errlen, "expert usage history (K3_USAGE / --usage; 'off' for none)");
        return st;
    }
    int n = 0;
    st = k3_experts_warm(m->experts, &n, err, errlen);
    if (st != K3_OK) return st;
    if (n > 0)
        K3_INFO("expert usage history %s: warm start read %d experts (%.2f GB) in %.2f s",
                m->usage_path, n, (double)n * (double)k3_experts_slot_bytes(m->experts) / 1e9,
                (k3_now_ms() - t0) / 1e3);
    return K3_OK;
}

k3_status k3_model_usage_save(k3_model *m, char *err, size_t errlen) {
    if (!m->usage_path || !m->opts.usage_save || !m->experts) return K3_OK;
    return k3_experts_usage_save(m->experts, m->usage_path, err, errlen);
}

/* ---- open / close ---- */

/* Order: options, config, shard index, prefix, pool, expert store, then the
 * layers one by one (progress per layer with opts->verbose) and the global
 * tensors. Any failure closes what was opened and returns the first error;
 * *out stays NULL. */
k3_status k3_model_open(k3_model **out, const k3_model_opts *opts, char *err, size_t errlen) {
    *out = NULL;
    if (!opts->model_dir)
        return k3_errf(K3_ERR_ARG, err, errlen, "model: no model directory given");
    if (opts->threads < 1 || opts->threads > K3_MAX_THREADS)
        return k3_errf(K3_ERR_ARG, err, errlen, "model: threads %d outside [1, %d]", opts->threads,
                       K3_MAX_THREADS);
    if (opts->load_threads < 1 || opts->load_threads > K3_MAX_LOAD_THREADS)
        return k3_errf(K3_ERR_ARG, err, errlen, "model: load threads %d outside [1, %d]",
                       opts->load_threads, K3_MAX_LOAD_THREADS);
    if (!(opts->expert_gb >= 0.0) || opts->expert_gb > 1e6)
        return k3_errf(K3_ERR_ARG, err, errlen, "model: expert cache %g GB outside [0, 1e6]",
                       opts->expert_gb);
    /* only the formats of docs/MODEL.md 4.2 exist: int4-g64, int8 per-row, f32 */
    static const int ok_bits[] = {4, 8, 32};
    const int *bv[3] = {&opts->bits, &opts->mla_bits, &opts->head_bits};
    static const char *const bn[3] = {"K3_BITS", "K3_MLA_BITS", "K3_HEAD_BITS"};
    for (int k = 0; k < 3; k++)
        if (*bv[k] != ok_bits[0] && *bv[k] != ok_bits[1] && *bv[k] != ok_bits[2])
            return k3_errf(K3_ERR_ARG, err, errlen, "model: %s=%d, expected 4, 8 or 32", bn[k],
                           *bv[k]);

    k3_model *m = k3_xcalloc(1, sizeof *m);
    m->opts = *opts;
    double t0 = k3_now_s();
    k3_status st = k3_config_load(&m->cfg, opts->model_dir, opts->max_layers, err, errlen);
    if (st != K3_OK) goto fail;
    const k3_config *c = &m->cfg;
    m->layer_a = opts->layer_a;
    m->layer_b = opts->layer_b <= 0 ? c->n_layers : opts->layer_b;
    /* An empty range is allowed only for a global-only model (a cluster
     * coordinator: embedding and head, no layers): layer_a = n_layers. */
    if (m->layer_a < 0 || m->layer_a > m->layer_b || m->layer_b > c->n_layers ||
        (m->layer_a == m->layer_b && !opts->want_global)) {
        st = k3_errf(K3_ERR_ARG, err, errlen,
                     "model: layer range [%d, %d) outside [0, %d) or empty without global tensors",
                     opts->layer_a, m->layer_b, c->n_layers);
        goto fail;
    }
    st_open_opts so = {opts->model_dir, opts->dirs, opts->n_dirs};
    st = st_open(&m->idx, &so, err, errlen);
    if (st != K3_OK) goto fail;
    st = probe_prefix(m, err, errlen);
    if (st != K3_OK) goto fail;
    st = k3_pool_open(&m->pool, opts->threads, err, errlen);
    if (st != K3_OK) goto fail;
    /* the fingerprint HELLO compares: the same for every layer range */
    st = k3_model_fingerprint_dir(opts->model_dir, c, opts->topp, &m->fingerprint, err, errlen);
    if (st != K3_OK) goto fail;

    k3_experts_opts eo = {(size_t)(opts->expert_gb * (double)(1ull << 30)),
                          opts->direct,
                          opts->pipe,
                          opts->load_threads,
                          0,
                          NULL,
                          0,
                          opts->read_depth};
    /* cross-worker striping: the store spans every layer (its drives'
     * experts of all MoE layers are served to the other stages) */
    int ea = opts->expert_all_layers ? 0 : m->layer_a;
    int eb = opts->expert_all_layers ? c->n_layers : m->layer_b;
    if (opts->placement && m->layer_a < m->layer_b) {
        st = k3_placement_load(&m->placement, opts->placement, err, errlen);
        if (st == K3_OK)
            st = k3_placement_check(m->placement, m->fingerprint, c->n_layers, c->n_experts,
                                    c->is_moe, ea, eb, err, errlen);
        if (st != K3_OK) goto fail;
        eo.placement = m->placement;
        eo.drive_mask = opts->expert_drive_mask;
        K3_INFO("experts: striped over %d drives by placement %s",
                k3_placement_drives(m->placement), opts->placement);
    }
    if (m->layer_a < m->layer_b) {
        st = k3_experts_open(&m->experts, m->idx, c, ea, eb, &eo, err, errlen);
        if (st != K3_OK) goto fail;
    }

    loader *ld = k3_xcalloc(1, sizeof *ld);
    ld->m = m;
    ld->err = err;
    ld->errlen = errlen;
    m->layers = k3_xcalloc((size_t)(m->layer_b - m->layer_a), sizeof *m->layers);
    for (int i = m->layer_a; i < m->layer_b && st == K3_OK; i++) {
        double tl = k3_now_s();
        st = load_layer(ld, i);
        if (st != K3_OK) break;
        size_t lb = layer_bytes(c, &m->layers[i - m->layer_a]);
        m->resident += lb;
        if (opts->verbose)
            fprintf(stderr, "k3: layer %d/%d loaded (%s + %s%s): %.1f MB, %.2f s\n", i + 1,
                    c->n_layers, c->is_kda[i] ? "KDA" : "MLA", c->is_moe[i] ? "MoE" : "dense",
                    c->is_boundary[i] ? ", AttnRes snapshot" : "", (double)lb / 1e6,
                    k3_now_s() - tl);
    }
    for (int i = ea; i < eb && st == K3_OK; i++) /* tables of the other layers' experts */
        if (c->is_moe[i] && (i < m->layer_a || i >= m->layer_b)) {
            int missing = 0;
            st = k3_experts_load_layer(m->experts, m->prefix, i, &missing, err, errlen);
        }
    if (st == K3_OK && opts->want_global) st = load_global(ld);
    free(ld);
    if (st == K3_OK && m->experts && opts->usage_path) st = usage_start(m, err, errlen);
    if (st != K3_OK) goto fail;
    if (opts->vk && m->experts) { /* after the history: the tier fills from it */
        char verr[512];
        if (k3_vk_tier_open(&m->vk, m->experts, c, m->layer_a, m->layer_b, opts->vk_device,
                            opts->vk_gb, opts->idot, verr, sizeof verr) != K3_OK)
            K3_WARN("--vk: the Vulkan expert tier is off, the CPU computes every expert: %s", verr);
    }
    if (opts->verbose)
        fprintf(stderr, "k3: layers [%d, %d) of %d loaded in %.2f s, %.1f MB resident\n",
                m->layer_a, m->layer_b, c->n_layers, k3_now_s() - t0, (double)m->resident / 1e6);
    *out = m;
    return K3_OK;
fail:
    k3_model_close(&m);
    return st;
}

void k3_model_close(k3_model **mp) {
    if (!mp || !*mp) return;
    k3_model *m = *mp;
    if (m->layers)
        for (int i = 0; i < m->layer_b - m->layer_a; i++) free_layer(&m->layers[i]);
    free(m->layers);
    free(m->final_norm);
    free(m->w_out);
    qfree(&m->lm_head);
    k3_vk_tier_close(&m->vk); /* before the store it borrows */
    k3_experts_close(&m->experts);
    k3_placement_free(&m->placement);
    free(m->usage_path);
    k3_pool_close(&m->pool);
    for (int i = 0; i < m->n_maps; i++)
        if (m->map_base[i]) munmap(m->map_base[i], m->map_len[i]);
    free(m->map_base);
    free(m->map_len);
    st_close(&m->idx);
    free(m);
    *mp = NULL;
}

/* ---- accessors ---- */

const k3_config *k3_model_config(const k3_model *m) { return &m->cfg; }

void k3_model_range(const k3_model *m, int *a, int *b) {
    if (a) *a = m->layer_a;
    if (b) *b = m->layer_b;
}

k3_pool *k3_model_pool(k3_model *m) { return m->pool; }
void k3_model_set_moe_remote(k3_model *m, const struct k3_moe_remote *r) { m->remote = r; }
const struct k3_moe_remote *k3_model_moe_remote(const k3_model *m) { return m->remote; }
const struct k3_placement *k3_model_placement(const k3_model *m) { return m->placement; }
uint64_t k3_model_fingerprint(const k3_model *m) { return m->fingerprint; }
size_t k3_model_resident_bytes(const k3_model *m) { return m->resident; }

const struct k3_layer_w *k3_model_layer(const k3_model *m, int layer) {
    K3_ASSERT(layer >= m->layer_a && layer < m->layer_b);
    return &m->layers[layer - m->layer_a];
}

struct k3_experts *k3_model_experts(k3_model *m) {
    return m->experts;
}
int k3_model_idot(const k3_model *m) { return m->opts.idot; }
struct k3_vk_tier *k3_model_vk(k3_model *m) {
    return m->vk;
}
double k3_model_topp(const k3_model *m) { return m->opts.topp; }

/* ---- embedding and head ---- */

/* Ids come from users and peers: every one is range-checked before any read,
 * so a bad id never turns into a read at a wild offset. */
k3_status k3_model_embed(k3_model *m, const int32_t *ids, int T, float *h, char *err,
                         size_t errlen) {
    if (!m->has_global)
        return k3_errf(K3_ERR_STATE, err, errlen, "embed: model opened without global tensors");
    if (T < 1 || T > K3_MAX_CTX)
        return k3_errf(K3_ERR_ARG, err, errlen, "embed: %d tokens outside [1, %d]", T, K3_MAX_CTX);
    int D = m->cfg.hidden;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= m->cfg.vocab)
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "embed: token id %d at position %d outside the vocabulary [0, %d)",
                           ids[t], t, m->cfg.vocab);
    /* one pread per row: the embedding is never resident (docs/MODEL.md 2.2) */
    size_t es = st_dtype_size(m->embed->dtype), rb = es * (size_t)D;
    unsigned char *row = k3_xmalloc(rb);
    k3_status st = K3_OK;
    for (int t = 0; t < T && st == K3_OK; t++) {
        uint64_t off = m->embed->offset + (uint64_t)ids[t] * rb;
        st = st_pread(m->idx, m->embed->shard, off, row, rb, 0, err, errlen);
        if (st != K3_OK) {
            k3_err_prefix(err, errlen, "embed: row %d", ids[t]);
            break;
        }
        float *dst = h + (size_t)t * D;
        for (int d = 0; d < D; d++) {
            if (m->embed->dtype == ST_F32) {
                memcpy(&dst[d], row + 4 * (size_t)d, 4);
            } else {
                uint16_t v;
                memcpy(&v, row + 2 * (size_t)d, 2);
                dst[d] = m->embed->dtype == ST_BF16 ? st_bf16_to_f32(v) : st_f16_to_f32(v);
            }
        }
    }
    free(row);
    return st;
}

k3_status k3_model_head(k3_model *m, const float *blocks, int nb, const float *h, int T, int t0,
                        float *logits, char *err, size_t errlen) {
    if (!m->has_global)
        return k3_errf(K3_ERR_STATE, err, errlen, "head: model opened without global tensors");
    if (T < 1 || T > K3_MAX_CTX || t0 < 0 || t0 >= T)
        return k3_errf(K3_ERR_ARG, err, errlen, "head: positions [%d, %d) invalid (T limit %d)", t0,
                       T, K3_MAX_CTX);
    if (nb < 0 || nb > K3_MAX_RES_ENTRIES)
        return k3_errf(K3_ERR_ARG, err, errlen, "head: %d AttnRes blocks > limit %d", nb,
                       K3_MAX_RES_ENTRIES);
    int D = m->cfg.hidden, n = T - t0;
    float *x = k3_xmalloc(sizeof(float) * (size_t)n * D); /* [n][D] normed final mix */
    for (int t = t0; t < T; t++) {
        const float *ent[K3_MAX_RES_ENTRIES + 1];
        for (int e = 0; e < nb; e++) ent[e] = blocks + ((size_t)e * T + t) * D;
        ent[nb] = h + (size_t)t * D;
        float *xt = x + (size_t)(t - t0) * D;
        /* out = Mix([B..., p]; w_out); x = RMSNorm(out; model.norm) */
        k3_attnres_mix(ent, nb + 1, m->w_out, D, m->cfg.eps, xt);
        k3_rmsnorm(xt, xt, m->final_norm, D, m->cfg.eps);
    }
    /* concurrent heads and forwards take turns on the pool job by job */
    k3_qmat_matmul(&m->lm_head, x, n, logits, m->pool); /* [n][vocab] */
    free(x);
    return K3_OK;
}
