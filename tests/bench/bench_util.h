/* tests/bench/bench_util.h: what the benchmark programs share: a seedable
 * xorshift64 generator for their synthetic weights and activations (the
 * clock is common/base/log.h's k3_now_s), and the synthetic matrices of the
 * single-kernel programs. Header-only, and no library symbol used (types
 * only); one program, one thread draws from the generator. */
#ifndef K3_BENCH_UTIL_H
#define K3_BENCH_UTIL_H

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/kernels/kernels.h"

static uint64_t bench_rng = 0x2545F4914F6CDD1Dull; /* the state; a program may reseed it */

static inline uint64_t bench_rnd(void) {
    bench_rng ^= bench_rng << 13;
    bench_rng ^= bench_rng >> 7;
    bench_rng ^= bench_rng << 17;
    return bench_rng;
}

/* The single kernels of kernel_once and ab_kernels, by name, at K3 shapes:
 * mxf32 / mxi8 (MXFP4 exact-float / integer-dot, 3072x3584 expert gate/up),
 * int8 / int8i (1536x7168 MLA), int4 / int4i (12288x7168 KDA q/k/v); i:
 * the --dense-idot kernel. Synthetic weights from bench_rnd, allocated
 * here without the library (ab_kernels links none of it). */
typedef struct bench_mat {
    int kind;     /* BENCH_MXF32, BENCH_MXI8, BENCH_DENSE */
    k3_mxfp4 mx;  /* the MXFP4 kinds */
    k3_qmat qm;   /* BENCH_DENSE (idot set for the i names) */
    size_t bytes; /* weight bytes, scales included */
} bench_mat;
enum { BENCH_MXF32 = 0, BENCH_MXI8 = 1, BENCH_DENSE = 2 };
#define BENCH_KERNELS "mxf32, mxi8, int8, int8i, int4 or int4i"

/* kind and K3 shape of kernel k; -1 if k is none of BENCH_KERNELS */
static inline int bench_kernel_shape(const char *k, int *kind, int *rows, int *cols) {
    if (!strcmp(k, "mxf32") || !strcmp(k, "mxi8"))
        *kind = !strcmp(k, "mxi8") ? BENCH_MXI8 : BENCH_MXF32, *rows = 3072, *cols = 3584;
    else if (!strcmp(k, "int8") || !strcmp(k, "int8i"))
        *kind = BENCH_DENSE, *rows = 1536, *cols = 7168;
    else if (!strcmp(k, "int4") || !strcmp(k, "int4i"))
        *kind = BENCH_DENSE, *rows = 12288, *cols = 7168;
    else
        return -1;
    return 0;
}

/* Set: bench_alloc asks for transparent huge pages (2 MB aligned blocks,
 * madvise(MADV_HUGEPAGE) before the first touch). */
static int bench_thp = 0;

/* The bytes a pass "from RAM" must cover: at least floor, and at least four
 * times the last-level cache the CPU reports (sysconf, else sysfs index3),
 * so that a 32 MB L3 and a 260 MB one (both seen on this project's VMs)
 * leave the same small share of a pass in cache. */
static inline size_t bench_ram_bytes(size_t floor) {
    long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (llc <= 0) {
        FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
        char unit = 0;
        if (f && fscanf(f, "%ld%c", &llc, &unit) >= 1) llc *= unit == 'M' ? (1L << 20) : 1024L;
        if (f) fclose(f);
    }
    const size_t want = llc > 0 ? (size_t)llc * 4 : 0;
    return want > floor ? want : floor;
}

/* 64-byte aligned, size rounded up; exits on OOM */
static inline void *bench_alloc(size_t bytes) {
    const size_t align = bench_thp ? (2u << 20) : 64;
    const size_t sz = (bytes + align - 1) / align * align;
    void *p = aligned_alloc(align, sz);
    if (!p) {
        fprintf(stderr, "bench: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    if (bench_thp) madvise(p, sz, MADV_HUGEPAGE);
    return p;
}

static inline void bench_fill(uint8_t *b, size_t n) {
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)bench_rnd();
}

/* Kernel k's weights at rows x cols (cols % 64 == 0): random bytes, MXFP4
 * scale bytes 112-122, dense scales 0.01. */
static inline void bench_make_mat(const char *k, int rows, int cols, bench_mat *m) {
    const size_t nel = (size_t)rows * cols;
    memset(m, 0, sizeof *m);
    bench_kernel_shape(k, &m->kind, &(int){0}, &(int){0});
    if (m->kind != BENCH_DENSE) {
        uint8_t *b = bench_alloc(nel / 2 + nel / 32);
        bench_fill(b, nel / 2);
        for (size_t i = 0; i < nel / 32; i++) b[nel / 2 + i] = (uint8_t)(112 + bench_rnd() % 11);
        m->mx = (k3_mxfp4){.packed = b, .scale = b + nel / 2, .rows = rows, .cols = cols};
        m->bytes = nel / 2 + nel / 32;
        return;
    }
    k3_qmat *q = &m->qm;
    q->rows = rows, q->cols = cols, q->idot = k[4] == 'i';
    if (!strncmp(k, "int4", 4)) {
        q->fmt = K3_QF_I4G64;
        q->q4 = bench_alloc(nel / 2);
        bench_fill(q->q4, nel / 2);
        q->scales = bench_alloc(nel / 64 * sizeof(float));
        for (size_t i = 0; i < nel / 64; i++) q->scales[i] = 0.01f;
        m->bytes = nel / 2 + nel / 64 * sizeof(float);
    } else {
        q->fmt = K3_QF_I8;
        q->q8 = bench_alloc(nel);
        bench_fill((uint8_t *)q->q8, nel);
        q->scales = bench_alloc((size_t)rows * sizeof(float));
        for (int i = 0; i < rows; i++) q->scales[i] = 0.01f;
        m->bytes = nel + (size_t)rows * sizeof(float);
    }
}

/* One asm string of 8 instructions INS "SRC, %0" .. "SRC, %7" (AT&T order:
 * sources, then the destination): 8 independent chains when INS
 * accumulates into its destination, as in the peak and pipe probes. */
#define BENCH_CHAINS8(INS, SRC)                                                                    \
    INS " " SRC ", %0\n\t" INS " " SRC ", %1\n\t" INS " " SRC ", %2\n\t" INS " " SRC               \
        ", %3\n\t" INS " " SRC ", %4\n\t" INS " " SRC ", %5\n\t" INS " " SRC ", %6\n\t" INS        \
        " " SRC ", %7\n\t"

/* n tokens of activations in [-1, 1], steps of 1e-3 */
static inline float *bench_make_x(int n, int cols) {
    float *x = bench_alloc(sizeof(float) * (size_t)n * cols);
    for (size_t i = 0; i < (size_t)n * cols; i++)
        x[i] = (float)((int)(bench_rnd() % 2001) - 1000) / 1e3f;
    return x;
}

/* A STREAM-like read: pool task `task` of `parts` sums its contiguous share
 * of buf (whole 128-byte steps) with 4 independent 256-bit chains. The
 * denominator of bench_kernels and bench_kernels_threads. */
#define BENCH_RD_MAX_PARTS 64
typedef struct bench_rd_job {
    const uint8_t *buf;
    size_t bytes;
    int parts; /* <= BENCH_RD_MAX_PARTS */
    uint64_t sink[BENCH_RD_MAX_PARTS * 8];
} bench_rd_job;

__attribute__((target("avx2"))) static inline void bench_rd_task(void *ctx, int task) {
    bench_rd_job *j = ctx;
    size_t per = j->bytes / (size_t)j->parts / 128 * 128;
    const uint8_t *p = j->buf + per * (size_t)task;
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i < per; i += 128) {
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + i)));
        b = _mm256_add_epi64(b, _mm256_load_si256((const __m256i *)(p + i + 32)));
        c = _mm256_add_epi64(c, _mm256_load_si256((const __m256i *)(p + i + 64)));
        d = _mm256_add_epi64(d, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a = _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d));
    j->sink[(task % BENCH_RD_MAX_PARTS) * 8] = (uint64_t)_mm256_extract_epi64(a, 0);
}

#endif
