/* tests/bench/ab_kernels.c: one kernel of two builds of the library, side
 * by side in one process (bench-ab.sh builds them): each build is a shared
 * object loaded with dlopen, and the rounds alternate their calls (A B, then
 * B A, ...), so a drift of this shared VM's speed hits both alike. Prints
 * each build's best and median call and the median of the per-round ratios
 * A / B with its quartiles: > 1 means B is faster. Not a timed test.
 *
 * Usage: ab_kernels A.so B.so KERNEL N [ROUNDS [THREADS [COPIES]]]
 *   KERNEL: mxi8, mxf32 (MXFP4 3072x3584), int8, int8i (1536x7168), int4,
 *           int4i (12288x7168); i: the --dense-idot kernel
 * COPIES (default 1) copies of the weights serve both builds, a round being
 * one call on each: with one, a matrix under the L3 size (the MXFP4 and
 * int8 ones) runs hot and int4 streams from RAM; with enough copies (their
 * sum far over L3) every kernel streams from RAM.
 *
 * This program links no part of the library itself (headers only): a k3_
 * symbol defined here would take the place of the builds' own ones.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kernels/kernels.h"
#include "common/base/pool.h"
#include "tests/bench/bench_util.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
    void (*act_q8)(const float *, int, int, int8_t *, float *);
    void (*mx_i8)(const k3_mxfp4 *, const int8_t *, const float *, int, float *, k3_pool *);
    void (*mx_f32)(const k3_mxfp4 *, const float *, int, float *, k3_pool *);
    void (*dense)(const k3_qmat *, const float *, int, float *, k3_pool *);
    k3_status (*pool_open)(k3_pool **, int, char *, size_t);
    void (*pool_close)(k3_pool **);
    k3_pool *pool;
} lib;

static int lib_load(lib *l, const char *path) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "ab_kernels: %s\n", dlerror());
        return -1;
    }
    const char *names[6] = {"k3_act_quant_q8", "k3_mxfp4_matmul_i8_mt", "k3_mxfp4_matmul_f32_mt",
                            "k3_qmat_matmul",  "k3_pool_open",          "k3_pool_close"};
    void *f[6];
    for (int i = 0; i < 6; i++)
        if (!(f[i] = dlsym(h, names[i]))) {
            fprintf(stderr, "ab_kernels: %s: no symbol %s\n", path, names[i]);
            return -1;
        }
    memcpy(&l->act_q8, &f[0], sizeof f[0]);
    memcpy(&l->mx_i8, &f[1], sizeof f[1]);
    memcpy(&l->mx_f32, &f[2], sizeof f[2]);
    memcpy(&l->dense, &f[3], sizeof f[3]);
    memcpy(&l->pool_open, &f[4], sizeof f[4]);
    memcpy(&l->pool_close, &f[5], sizeof f[5]);
    l->pool = NULL;
    return 0;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 8) {
        fprintf(stderr, "usage: ab_kernels A.so B.so mxi8|mxf32|int8|int8i|int4|int4i N "
                        "[ROUNDS [THREADS [COPIES]]]\n");
        return 2;
    }
    const char *k = argv[3];
    const int n = atoi(argv[4]), rounds = argc > 5 ? atoi(argv[5]) : 40;
    const int threads = argc > 6 ? atoi(argv[6]) : 1, copies = argc > 7 ? atoi(argv[7]) : 1;
    int kind, rows, cols;
    if (bench_kernel_shape(k, &kind, &rows, &cols)) {
        fprintf(stderr, "ab_kernels: kernel '%s': not " BENCH_KERNELS "\n", k);
        return 2;
    }
    if (n < 1 || n > 256 || rounds < 4 || rounds > 10000 || threads < 1 || threads > 64 ||
        copies < 1 || copies > 256) {
        fprintf(stderr,
                "ab_kernels: n %d rounds %d threads %d copies %d: need n in [1, 256], rounds in "
                "[4, 10000], threads in [1, 64], copies in [1, 256]\n",
                n, rounds, threads, copies);
        return 2;
    }
    lib L[2];
    for (int v = 0; v < 2; v++) {
        if (lib_load(&L[v], argv[1 + v])) return 1;
        char err[256];
        if (threads > 1 && L[v].pool_open(&L[v].pool, threads, err, sizeof err) != K3_OK) {
            fprintf(stderr, "ab_kernels: pool: %s\n", err);
            return 1;
        }
    }
    bench_mat *w = bench_alloc(sizeof *w * (size_t)copies);
    for (int c = 0; c < copies; c++) bench_make_mat(k, rows, cols, &w[c]);
    float *x = bench_make_x(n, cols);
    int8_t *q = bench_alloc((size_t)n * cols);
    float *qs = bench_alloc(sizeof(float) * (size_t)n * cols / 32);
    L[0].act_q8(x, n, cols, q, qs);
    float *y = bench_alloc(sizeof(float) * (size_t)n * rows);
    double *t[2] = {bench_alloc(sizeof(double) * rounds), bench_alloc(sizeof(double) * rounds)};
    double *ratio = bench_alloc(sizeof(double) * rounds);
    for (int r = -2; r < rounds; r++) /* two warm-up rounds */
        for (int o = 0; o < 2; o++) {
            const int v = (r & 1) ? 1 - o : o; /* A B, then B A */
            const lib *l = &L[v];
            const double t0 = now_s();
            for (int c = 0; c < copies; c++)
                if (kind == BENCH_MXI8)
                    l->mx_i8(&w[c].mx, q, qs, n, y, l->pool);
                else if (kind == BENCH_MXF32)
                    l->mx_f32(&w[c].mx, x, n, y, l->pool);
                else
                    l->dense(&w[c].qm, x, n, y, l->pool);
            if (r >= 0) t[v][r] = (now_s() - t0) / copies;
        }
    for (int r = 0; r < rounds; r++) ratio[r] = t[0][r] / t[1][r];
    qsort(ratio, (size_t)rounds, sizeof(double), cmp_d);
    for (int v = 0; v < 2; v++) qsort(t[v], (size_t)rounds, sizeof(double), cmp_d);
    printf("%s n=%d %dx%d %d thread(s), %d copies, %d rounds: "
           "A best %.3f median %.3f ms | B best %.3f median %.3f ms | "
           "A/B per round: median %.3f (quartiles %.3f %.3f)\n",
           k, n, rows, cols, threads, copies, rounds, t[0][0] * 1e3, t[0][rounds / 2] * 1e3,
           t[1][0] * 1e3, t[1][rounds / 2] * 1e3, ratio[rounds / 2], ratio[rounds / 4],
           ratio[3 * rounds / 4]);
    for (int v = 0; v < 2; v++) L[v].pool_close(&L[v].pool);
    return 0;
}
