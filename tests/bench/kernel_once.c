/* tests/bench/kernel_once.c: one mat-mul call of one kernel at a K3 shape,
 * for instruction-count profiles (issue 7): run under
 * `valgrind --tool=callgrind --toggle-collect=kernel_call` so that only the
 * kernel's instructions are counted (weight setup is excluded). Single
 * thread (no pool). K3_ISA picks the level as everywhere; valgrind has no
 * AVX-512, so under it only scalar and avx2 run.
 *
 * Usage: kernel_once KERNEL N [ROWS COLS]
 *   KERNEL: mxf32 (MXFP4 exact-float), mxi8 (MXFP4 integer-dot),
 *           int8 (int8 per-row dense), int4 (int4-g64 dense)
 * Prints the weight bytes and multiply-adds of the call, to divide the
 * instruction count by.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/kernels.h"
#include "tests/bench/bench_util.h"

static void fill(uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)bench_rnd();
}

typedef struct {
    int kind; /* 0 mxf32, 1 mxi8, 2 dense */
    k3_mxfp4 mx;
    k3_qmat qm;
    const float *x;
    const int8_t *q;
    const float *qs;
    float *y;
    int n;
} call_args;

/* The only function callgrind collects in (--toggle-collect=kernel_call). */
__attribute__((noinline)) void kernel_call(const call_args *a);
__attribute__((noinline)) void kernel_call(const call_args *a) {
    switch (a->kind) {
    case 0: k3_mxfp4_matmul_f32_mt(&a->mx, a->x, a->n, a->y, NULL); break;
    case 1: k3_mxfp4_matmul_i8_mt(&a->mx, a->q, a->qs, a->n, a->y, NULL); break;
    default: k3_qmat_matmul(&a->qm, a->x, a->n, a->y, NULL); break;
    }
}

int main(int argc, char **argv) {
    bench_rng = 0x9E3779B97F4A7C15ull; /* this program's own seed */
    if (argc != 3 && argc != 5) {
        fprintf(stderr, "usage: kernel_once mxf32|mxi8|int8|int4|int8i|int4i N [ROWS COLS]\n");
        return 2;
    }
    const char *k = argv[1];
    call_args a = {.n = atoi(argv[2])};
    int rows, cols;
    if (!strcmp(k, "mxf32") || !strcmp(k, "mxi8")) {
        a.kind = !strcmp(k, "mxi8");
        rows = 3072, cols = 3584;                           /* K3 expert gate/up */
    } else if (!strcmp(k, "int8") || !strcmp(k, "int8i")) { /* i: K3_DENSE_IDOT's kernel */
        a.kind = 2, rows = 1536, cols = 7168;               /* MLA */
    } else if (!strcmp(k, "int4") || !strcmp(k, "int4i")) {
        a.kind = 2, rows = 12288, cols = 7168; /* KDA q/k/v */
    } else {
        fprintf(stderr, "kernel_once: kernel '%s': not mxf32, mxi8, int8, int4, int8i or int4i\n",
                k);
        return 2;
    }
    if (argc == 5) rows = atoi(argv[3]), cols = atoi(argv[4]);
    if (a.n < 1 || a.n > 256 || rows < 1 || rows > 65536 || cols < 64 || cols > 65536 ||
        cols % 64) {
        fprintf(stderr,
                "kernel_once: n %d rows %d cols %d: need n in [1,256], rows in "
                "[1,65536], cols in [64,65536] and a multiple of 64\n",
                a.n, rows, cols);
        return 2;
    }
    const size_t nel = (size_t)rows * cols;
    size_t bytes;
    if (a.kind < 2) {
        uint8_t *b = k3_xaligned(64, nel / 2 + nel / 32);
        fill(b, nel / 2);
        for (size_t i = 0; i < nel / 32; i++) b[nel / 2 + i] = (uint8_t)(112 + bench_rnd() % 11);
        a.mx = (k3_mxfp4){.packed = b, .scale = b + nel / 2, .rows = rows, .cols = cols};
        bytes = nel / 2 + nel / 32;
    } else {
        k3_qmat *m = &a.qm;
        m->rows = rows, m->cols = cols, m->owned = 1;
        m->idot = k[4] == 'i';
        if (!strncmp(k, "int4", 4)) {
            m->fmt = K3_QF_I4G64;
            m->q4 = k3_xaligned(64, nel / 2);
            fill(m->q4, nel / 2);
            m->scales = k3_xaligned(64, nel / 64 * sizeof(float));
            for (size_t i = 0; i < nel / 64; i++) m->scales[i] = 0.01f;
        } else {
            m->fmt = K3_QF_I8;
            m->q8 = k3_xaligned(64, nel);
            fill((uint8_t *)m->q8, nel);
            m->scales = k3_xaligned(64, (size_t)rows * sizeof(float));
            for (int i = 0; i < rows; i++) m->scales[i] = 0.01f;
        }
        bytes = k3_qmat_bytes(m);
    }
    float *x = malloc(sizeof(float) * (size_t)a.n * cols);
    for (size_t i = 0; i < (size_t)a.n * cols; i++)
        x[i] = (float)((int)(bench_rnd() % 2001) - 1000) / 1e3f;
    int8_t *q = malloc((size_t)a.n * cols);
    float *qs = malloc(sizeof(float) * (size_t)a.n * cols / 32);
    k3_act_quant_q8(x, a.n, cols, q, qs);
    a.x = x, a.q = q, a.qs = qs;
    a.y = malloc(sizeof(float) * (size_t)a.n * rows);
    kernel_call(&a);
    double s = 0;
    for (size_t i = 0; i < (size_t)a.n * rows; i++) s += a.y[i];
    printf("kernel %s isa %s n %d rows %d cols %d weight_bytes %zu macs %zu checksum %g\n", k,
           k3_isa_name(k3_isa_active()), a.n, rows, cols, bytes, nel * (size_t)a.n, s);
    return 0;
}
