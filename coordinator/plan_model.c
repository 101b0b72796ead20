/* coordinator/plan_model.c: the decode model of `plan` and its compute
 * measurement (plan_model.h). */
#include "coordinator/plan_model.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/base/cache_dir.h"
#include "common/base/log.h"
#include "common/base/pool.h"
#include "common/kernels/kernels.h"

#define READ_TRIALS 4000
#define PROBE_BYTES                                                                                \
    (256u << 20)            /* weights the probe cycles through: past the CPU's caches, as         \
                               the model's weights stream from RAM */
#define CACHE_S (7 * 86400) /* a compute measurement is trusted for a week */

/* Time of one way the misses fall: n[d] on drive d. */
static double way_s(const int *n, const double *gbs, int nd, double bytes, int window) {
    double busiest = 0, sum = 0;
    for (int d = 0; d < nd; d++) {
        double t = n[d] * bytes / (gbs[d] * 1e9);
        sum += t;
        if (t > busiest) busiest = t;
    }
    int conc = window < nd ? window : nd;
    if (conc < 1) conc = 1;
    return sum / conc > busiest ? sum / conc : busiest;
}

double k3_plan_layer_read_s(const int *count, const double *gbs, int n_drives, int n_experts,
                            double misses, double expert_bytes, int window) {
    if (misses <= 0 || n_drives < 1 || n_experts < 1) return 0;
    if (misses > n_experts) misses = n_experts;
    int lo = (int)misses;
    double frac = misses - lo;
    int *label = malloc(sizeof *label * (size_t)n_experts);
    if (!label) return 0;
    int k = 0;
    for (int d = 0; d < n_drives; d++)
        for (int j = 0; j < count[d] && k < n_experts; j++) label[k++] = d;
    while (k < n_experts) label[k++] = 0; /* counts short of n_experts: drive 0 */
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    double total = 0;
    for (int t = 0; t < READ_TRIALS; t++) {
        /* floor or ceil of the expected misses, in proportion (stratified) */
        int m = lo + ((double)(t % 1000) + 0.5 < frac * 1000 ? 1 : 0);
        if (m > n_experts) m = n_experts;
        int n[K3_MAX_DIRS] = {0};
        /* m distinct experts: a partial Fisher-Yates shuffle of the labels */
        for (int i = 0; i < m; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            int j = i + (int)(rng % (uint64_t)(n_experts - i));
            int tmp = label[i];
            label[i] = label[j], label[j] = tmp;
            n[label[i]]++;
        }
        total += way_s(n, gbs, n_drives, expert_bytes, window);
    }
    free(label);
    return total / READ_TRIALS;
}

void k3_plan_deal(const double *w, int nd, int n_experts, int *count) {
    for (int d = 0; d < nd; d++) count[d] = 0;
    for (int e = 0; e < n_experts; e++) {
        int best = 0;
        for (int d = 1; d < nd; d++)
            if ((count[d] + 1) / w[d] < (count[best] + 1) / w[best]) best = d;
        count[best]++;
    }
}

double k3_plan_moe_layer_s(double read_s, double fixed_s, double under_s) {
    return fixed_s + (read_s > under_s ? read_s : under_s);
}

void k3_plan_moe_compute(const k3_plan_compute *pc, uint64_t layer_dense, uint64_t layer_overlap,
                         int topk, double *fixed_s, double *under_s) {
    double g = pc->dense_gbs > 0 ? pc->dense_gbs * 1e9 : 1e30;
    double e = pc->expert_ms / 1e3;
    uint64_t ov = layer_overlap < layer_dense ? layer_overlap : layer_dense;
    *fixed_s = (double)(layer_dense - ov) / g + (topk > 0 ? e : 0);
    *under_s = (double)ov / g + (topk > 1 ? (topk - 1) * e : 0);
}

/* ---- the measurement ---- */

static uint64_t rnd(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* Mean seconds per call of the int8 dense matmul and the expert over
 * ~seconds each (after one warm-up call), each call on the next of
 * copies that together exceed the caches. */
static k3_status measure(const k3_config *cfg, double seconds, k3_plan_compute *out, char *err,
                         size_t errlen) {
    int rows = cfg->latent, cols = cfg->hidden, I = cfg->moe_inter, LT = cfg->latent;
    if (rows < 32 || cols < 32 || I < 32 || LT < 32 || cols % 32 || I % 32 || LT % 32)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "plan: compute probe: shapes latent %d, hidden %d, moe_inter %d not "
                       "multiples of 32",
                       LT, cols, I);
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = nc < 1 ? 1 : nc > K3_MAX_THREADS ? K3_MAX_THREADS : (int)nc;
    k3_pool *pool = NULL;
    k3_status st = k3_pool_open(&pool, threads, err, errlen);
    if (st) return st;
    uint64_t s = 0x243f6a8885a308d3ull;
    /* dense: [latent][hidden] int8, the latent projections' shape */
    float *w = k3_xmalloc(sizeof *w * (size_t)rows * (size_t)cols);
    for (size_t i = 0; i < (size_t)rows * (size_t)cols; i++)
        w[i] = (float)((double)(rnd(&s) % 2001) / 1000.0 - 1.0);
    k3_qmat q;
    memset(&q, 0, sizeof q);
    k3_qmat_quantize(&q, w, rows, cols, 8);
    free(w);
    size_t qb = k3_qmat_bytes(&q);
    int nq = (int)(PROBE_BYTES / qb) + 1;
    if (nq > 64) nq = 64;
    k3_qmat *qs = k3_xcalloc((size_t)nq, sizeof *qs);
    for (int k = 0; k < nq; k++) { /* copies of the int8 rows and scales */
        qs[k] = q;
        qs[k].owned = 0;
        qs[k].q8 = k3_xmalloc((size_t)rows * (size_t)cols);
        qs[k].scales = k3_xmalloc(sizeof(float) * (size_t)rows);
        memcpy(qs[k].q8, q.q8, (size_t)rows * (size_t)cols);
        memcpy(qs[k].scales, q.scales, sizeof(float) * (size_t)rows);
    }
    float *x = k3_xmalloc(sizeof *x * (size_t)(cols > I ? cols : I));
    float *y = k3_xmalloc(sizeof *y * (size_t)(rows > I ? rows : I));
    for (int i = 0; i < cols; i++) x[i] = (float)((double)(rnd(&s) % 2001) / 1000.0 - 1.0);
    k3_qmat_matmul(&qs[0], x, 1, y, pool);
    int n = 0;
    double t0 = k3_now_ms(), t = 0;
    do {
        k3_qmat_matmul(&qs[n % nq], x, 1, y, pool);
        n++;
        t = (k3_now_ms() - t0) / 1e3;
    } while (t < seconds);
    out->dense_gbs = (double)qb * n / t / 1e9;
    for (int k = 0; k < nq; k++) free(qs[k].q8), free(qs[k].scales);
    free(qs);
    k3_qmat_free(&q);
    /* one expert: w1, w3 [moe_inter][latent], w2 [latent][moe_inter], the
     * int8-activation kernels (the engine's default, K3_IDOT) */
    size_t pk = (size_t)I * (size_t)LT / 2, sc = (size_t)I * (size_t)LT / 32;
    size_t eb = 3 * (pk + sc);
    int ne = (int)(PROBE_BYTES / 2 / eb) + 1;
    if (ne > 64) ne = 64;
    uint8_t *buf = k3_xmalloc(eb);
    for (size_t i = 0; i < eb; i++) buf[i] = (uint8_t)rnd(&s);
    for (int k = 0; k < 3; k++) /* scales near 2^0: no overflow */
        for (size_t i = 0; i < sc; i++) buf[k * (pk + sc) + pk + i] = (uint8_t)(120 + rnd(&s) % 8);
    uint8_t **ex = k3_xcalloc((size_t)ne, sizeof *ex);
    for (int k = 0; k < ne; k++) ex[k] = k3_xmalloc(eb), memcpy(ex[k], buf, eb);
    int8_t *zq = k3_xmalloc((size_t)(LT > I ? LT : I));
    float *zs = k3_xmalloc(sizeof *zs * (size_t)(LT > I ? LT : I) / 32);
    float *g = k3_xmalloc(sizeof *g * (size_t)I), *u = k3_xmalloc(sizeof *u * (size_t)I);
    n = 0;
    t0 = k3_now_ms();
    do {
        uint8_t *b = ex[n % ne];
        k3_mxfp4 w1 = {b, b + pk, I, LT}, w3 = {b + pk + sc, b + 2 * pk + sc, I, LT};
        k3_mxfp4 w2 = {b + 2 * (pk + sc), b + 3 * pk + 2 * sc, LT, I};
        k3_act_quant_q8(x, 1, LT, zq, zs);
        k3_mxfp4_matmul_i8_mt(&w1, zq, zs, 1, g, pool);
        k3_mxfp4_matmul_i8_mt(&w3, zq, zs, 1, u, pool);
        for (int i = 0; i < I; i++) g[i] = g[i] * u[i] * 1e-3f; /* stands for SiTU: cheap */
        k3_act_quant_q8(g, 1, I, zq, zs);
        k3_mxfp4_matmul_i8_mt(&w2, zq, zs, 1, y, pool);
        n++;
        t = (k3_now_ms() - t0) / 1e3;
    } while (t < seconds);
    out->expert_ms = t * 1e3 / n;
    out->threads = threads;
    for (int k = 0; k < ne; k++) free(ex[k]);
    free(ex);
    free(buf), free(zq), free(zs), free(g), free(u), free(x), free(y);
    k3_pool_close(&pool);
    return K3_OK;
}

/* The measurement's cache file into out [cap]; -1 (with a warning naming why)
 * when there is none, and the measurement is not kept. */
static int cache_path(char *out, size_t cap) {
    char dir[3072], err[512];
    if (k3_cache_dir(dir, sizeof dir, err, sizeof err) != K3_OK) {
        K3_WARN("plan: the compute measurement is not cached: %s", err);
        return -1;
    }
    return (size_t)snprintf(out, cap, "%s/plan_compute.json", dir) < cap ? 0 : -1;
}

k3_status k3_plan_compute_get(const k3_config *cfg, double seconds, int remeasure,
                              k3_plan_compute *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    long nc = sysconf(_SC_NPROCESSORS_ONLN);
    char key[256], path[3200];
    snprintf(key, sizeof key, "hidden %d latent %d moe_inter %d threads %ld isa %s", cfg->hidden,
             cfg->latent, cfg->moe_inter, nc, k3_isa_name(k3_isa_active()));
    int have_path = cache_path(path, sizeof path) == 0;
    json_t *root = have_path ? json_load_file(path, 0, NULL) : NULL;
    if (!json_is_object(root)) {
        json_decref(root);
        root = json_object();
    }
    json_t *e = json_object_get(root, key);
    double when = json_number_value(json_object_get(e, "time"));
    if (!remeasure && json_is_object(e) && (double)time(NULL) - when < CACHE_S &&
        json_number_value(json_object_get(e, "dense_gbs")) > 0 &&
        json_number_value(json_object_get(e, "expert_ms")) > 0) {
        out->dense_gbs = json_number_value(json_object_get(e, "dense_gbs"));
        out->expert_ms = json_number_value(json_object_get(e, "expert_ms"));
        out->threads = (int)nc;
        out->from_cache = 1;
        json_decref(root);
        return K3_OK;
    }
    k3_status st = measure(cfg, seconds, out, err, errlen);
    if (st == K3_OK && have_path) {
        json_object_set_new(root, key,
                            json_pack("{s:f, s:f, s:f}", "dense_gbs", out->dense_gbs, "expert_ms",
                                      out->expert_ms, "time", (double)time(NULL)));
        char tmp[3300];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        if (json_dump_file(root, tmp, JSON_INDENT(2)) != 0 || rename(tmp, path) != 0)
            K3_WARN("plan: cannot write the compute measurement to %s: %s", path, strerror(errno));
    }
    json_decref(root);
    return st;
}
