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

#include "common/base/log.h"
#include "common/kernels/kernels.h"
#include "tests/bench/bench_util.h"

typedef struct {
    bench_mat w; /* the weights, and which kernel (w.kind) */
    const float *x;
    const int8_t *q;
    const float *qs;
    float *y;
    int n;
} call_args;

/* The only function callgrind collects in (--toggle-collect=kernel_call). */
__attribute__((noinline)) void kernel_call(const call_args *a);
__attribute__((noinline)) void kernel_call(const call_args *a) {
    switch (a->w.kind) {
    case BENCH_MXF32: k3_mxfp4_matmul_f32_mt(&a->w.mx, a->x, a->n, a->y, NULL); break;
    case BENCH_MXI8: k3_mxfp4_matmul_i8_mt(&a->w.mx, a->q, a->qs, a->n, a->y, NULL); break;
    default: k3_qmat_matmul(&a->w.qm, a->x, a->n, a->y, NULL); break;
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
    if (bench_kernel_shape(k, &a.w.kind, &rows, &cols)) {
        fprintf(stderr, "kernel_once: kernel '%s': not " BENCH_KERNELS "\n", k);
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
    bench_make_mat(k, rows, cols, &a.w);
    float *x = bench_make_x(a.n, cols);
    int8_t *q = bench_alloc((size_t)a.n * cols);
    float *qs = bench_alloc(sizeof(float) * (size_t)a.n * cols / 32);
    k3_act_quant_q8(x, a.n, cols, q, qs);
    a.x = x, a.q = q, a.qs = qs;
    a.y = bench_alloc(sizeof(float) * (size_t)a.n * rows);
    kernel_call(&a);
    double s = 0;
    for (size_t i = 0; i < (size_t)a.n * rows; i++) s += a.y[i];
    printf("kernel %s isa %s n %d rows %d cols %d weight_bytes %zu macs %zu checksum %g\n", k,
           k3_isa_name(k3_isa_active()), a.n, rows, cols, a.w.bytes, nel * (size_t)a.n, s);
    return 0;
}
