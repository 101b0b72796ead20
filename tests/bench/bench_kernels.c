/* tests/bench/bench_kernels.c: kernel throughput next to its denominators
 * (issue 7). Not a test: prints a table, asserts nothing.
 *
 *   - STREAM-like read bandwidth (1 and 2 threads) over a buffer far larger
 *     than L3 (best of 4 whole passes), at the start and again right before
 *     and after each kernel's n = 1 rows, whose %strm divides by the better
 *     of those two (plain sequential reads measured as fast as interleaved
 *     rows with software prefetch here);
 *   - int8 dot peak: a register-only loop of the active level's int8 dot
 *     instruction chain (AVX2: vpmaddubsw + vpmaddwd + vpaddd; AVX-512:
 *     vpdpbusd), 1 and 2 threads;
 *   - n = 1 from RAM again as 7 alternations of a STREAM pass and a kernel
 *     pass (paired): the median ratio, robust to this VM's drifting
 *     bandwidth;
 *   - every kernel at the K3 shapes, n = 1, 8, 32, weights streamed from RAM
 *     (passes over copies that together exceed L3 many times, timed as whole
 *     passes like STREAM) and hot (one copy, repeated), 1 and 2 threads. n = 1 is judged in GB/s
 * against STREAM, n = 32 in GOP/s (2 ops per multiply-add) against the int8 peak.
 *
 * Usage: bench_kernels [--quick] [FILTER]: --quick shortens every
 * measurement; FILTER runs only the kernels whose name contains it ("i8",
 * "int4", ...). K3_ISA picks the level as everywhere.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/log.h"
#include "common/kernels/kernels.h"
#include "common/base/pool.h"
#include "tests/bench/bench_util.h"

static void fill_bytes(void *p, size_t n) {
    uint8_t *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = bench_rnd();
        memcpy(b + i, &v, 8);
    }
    for (; i < n; i++) b[i] = (uint8_t)bench_rnd();
}

static double g_min_time = 0.25; /* seconds per measurement */

/* The load average, printed at both ends of the table: on a shared machine
 * the 2-thread rows mean little when other work held the second core. */
static void print_load(const char *when) {
    char buf[128] = "unknown";
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (!fgets(buf, sizeof buf, f)) snprintf(buf, sizeof buf, "unknown");
        fclose(f);
    }
    buf[strcspn(buf, "\n")] = 0;
    printf("# load average %s: %s (%ld cpus online)\n", when, buf, sysconf(_SC_NPROCESSORS_ONLN));
}
static k3_pool *g_pool2;

/* ---- STREAM-like read ---- */

/* Sustained: the best of 4 whole passes over the buffer (far larger than
 * L3). Kernels from RAM are timed the same way (time_kernel). */
static double stream_read(int threads, const uint8_t *buf, size_t bytes) {
    bench_rd_job j = {.buf = buf, .bytes = bytes, .parts = threads};
    k3_pool *pool = threads == 1 ? NULL : g_pool2;
    k3_pool_run(pool, bench_rd_task, &j, threads); /* warm */
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = k3_now_s();
        k3_pool_run(pool, bench_rd_task, &j, threads);
        double gbs = (double)(bytes / (size_t)threads / 128 * 128 * (size_t)threads) /
                     (k3_now_s() - t0) / 1e9;
        best = gbs > best ? gbs : best;
    }
    return best;
}

/* ---- int8 dot peak ---- */

#define PEAK_ITERS 20000000L
#define KEEP(v)    __asm__ volatile("" : "+x"(v))

typedef struct {
    int kind; /* 0 avx2 maddubs chain, 1 avx512 vnni, 2 avx512 float fma */
    int32_t sink[4 * 16];
} pk_job;

__attribute__((target("avx2"))) static void peak_avx2(int32_t *sink) {
    __m256i u = _mm256_set1_epi8(3), s = _mm256_set1_epi8(-5), one = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    for (long i = 0; i < PEAK_ITERS; i++) {
        KEEP(u);
        KEEP(s);
        a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), one));
        a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_maddubs_epi16(s, u), one));
        a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_maddubs_epi16(u, u), one));
        a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_maddubs_epi16(s, s), one));
        a4 = _mm256_add_epi32(a4, _mm256_madd_epi16(_mm256_maddubs_epi16(u, one), one));
        a5 = _mm256_add_epi32(a5, _mm256_madd_epi16(_mm256_maddubs_epi16(one, s), one));
    }
    __m256i t =
        _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                         _mm256_add_epi32(a4, a5));
    sink[0] = _mm256_extract_epi32(t, 0);
}

__attribute__((target("avx512f,avx512vnni"))) static void peak_avx512(int32_t *sink) {
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-5);
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2),
            a3 = _mm512_set1_epi32(3), a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5),
            a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7);
    /* One asm block per iteration: exactly 8 independent vpdpbusd (a
     * dependency chain each, 8 deep enough to cover the latency), nothing
     * else. Written with intrinsics the compiler merged chains that start
     * equal and dropped half of them, which made the "peak" twice the
     * hardware's. */
    for (long i = 0; i < PEAK_ITERS; i++)
        __asm__ volatile(BENCH_CHAINS8("vpdpbusd", "%9, %8")
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                           "+v"(a7)
                         : "v"(u), "v"(s));
    __m512i t =
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                         _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    sink[0] = _mm512_reduce_add_epi32(t);
}

/* The float FMA peak (the ceiling of the float-activation kernels,
 * docs/MODEL.md 4.2): 8 independent vfmadd231ps zmm chains in one asm block. */
__attribute__((target("avx512f"))) static void peak_fma512(int32_t *sink) {
    __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-8f);
    __m512 a0 = _mm512_set1_ps(0), a1 = _mm512_set1_ps(1), a2 = _mm512_set1_ps(2),
           a3 = _mm512_set1_ps(3), a4 = _mm512_set1_ps(4), a5 = _mm512_set1_ps(5),
           a6 = _mm512_set1_ps(6), a7 = _mm512_set1_ps(7);
    for (long i = 0; i < PEAK_ITERS; i++)
        __asm__ volatile(BENCH_CHAINS8("vfmadd231ps", "%9, %8")
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6),
                           "+v"(a7)
                         : "v"(x), "v"(y));
    __m512 t = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    sink[0] = (int32_t)_mm512_reduce_add_ps(t);
}

static void pk_task(void *ctx, int task) {
    pk_job *j = ctx;
    if (j->kind == 2)
        peak_fma512(j->sink + task * 16);
    else if (j->kind == 1)
        peak_avx512(j->sink + task * 16);
    else
        peak_avx2(j->sink + task * 16);
}

/* multiply-adds per iteration: AVX2 6 x 32, AVX-512 8 x 64 */
static double int8_peak(int kind, int threads) {
    double best = 0; /* GOP/s, best of 3 */
    for (int rep = 0; rep < 3; rep++) {
        pk_job j = {.kind = kind};
        double t0 = k3_now_s();
        k3_pool_run(threads == 1 ? NULL : g_pool2, pk_task, &j, threads);
        double dt = k3_now_s() - t0;
        double macs = (double)PEAK_ITERS *
                      (kind == 2   ? 8 * 16
                       : kind == 1 ? 8 * 64
                                   : 6 * 32) *
                      threads;
        best = 2 * macs / dt / 1e9 > best ? 2 * macs / dt / 1e9 : best;
    }
    return best;
}

/* ---- kernel cases ---- */

typedef enum { K_MX_F32, K_MX_I8, K_DENSE } kkind;

typedef struct {
    const char *name;
    kkind kind;
    int bits; /* dense: 8 or 4 */
    int idot; /* dense: 1 = the opt-in integer-dot kernel (K3_DENSE_IDOT) */
    int rows, cols;
} kshape;

typedef struct {
    int copies;
    k3_mxfp4 *mx;    /* [copies] */
    uint8_t **mxbuf; /* [copies] owned */
    k3_qmat *qm;     /* [copies] */
    size_t bytes;    /* one copy: weights + scales */
} kweights;

static void weights_make(kweights *kw, const kshape *s, int copies) {
    memset(kw, 0, sizeof *kw);
    kw->copies = copies;
    const size_t nel = (size_t)s->rows * s->cols;
    if (s->kind != K_DENSE) {
        kw->mx = calloc((size_t)copies, sizeof *kw->mx);
        kw->mxbuf = calloc((size_t)copies, sizeof *kw->mxbuf);
        kw->bytes = nel / 2 + nel / 32;
        for (int c = 0; c < copies; c++) {
            uint8_t *b = k3_xaligned(64, kw->bytes);
            fill_bytes(b, nel / 2);
            for (size_t i = 0; i < nel / 32; i++)
                b[nel / 2 + i] = (uint8_t)(112 + bench_rnd() % 11);
            kw->mxbuf[c] = b;
            kw->mx[c] =
                (k3_mxfp4){.packed = b, .scale = b + nel / 2, .rows = s->rows, .cols = s->cols};
        }
        return;
    }
    kw->qm = calloc((size_t)copies, sizeof *kw->qm);
    for (int c = 0; c < copies; c++) {
        k3_qmat *m = &kw->qm[c];
        m->rows = s->rows;
        m->cols = s->cols;
        m->owned = 1;
        if (s->bits == 4) {
            m->fmt = K3_QF_I4G64;
            m->q4 = k3_xaligned(64, nel / 2);
            fill_bytes(m->q4, nel / 2);
            m->scales = k3_xaligned(64, nel / 64 * sizeof(float));
            for (size_t i = 0; i < nel / 64; i++) m->scales[i] = 0.01f;
        } else {
            m->fmt = K3_QF_I8;
            m->q8 = k3_xaligned(64, nel);
            fill_bytes(m->q8, nel);
            m->scales = k3_xaligned(64, (size_t)s->rows * sizeof(float));
            for (int i = 0; i < s->rows; i++) m->scales[i] = 0.01f;
        }
        m->idot = s->idot;
        kw->bytes = k3_qmat_bytes(m);
    }
}

static void weights_free(kweights *kw) {
    for (int c = 0; c < kw->copies; c++) {
        if (kw->mxbuf) free(kw->mxbuf[c]);
        if (kw->qm) k3_qmat_free(&kw->qm[c]);
    }
    free(kw->mx);
    free(kw->mxbuf);
    free(kw->qm);
}

typedef struct {
    const float *x;
    const int8_t *q;
    const float *s;
    float *y;
} kio;

static void run_once(const kshape *s, kweights *kw, int copy, const kio *io, int n, k3_pool *pool) {
    switch (s->kind) {
    case K_MX_F32: k3_mxfp4_matmul_f32_mt(&kw->mx[copy], io->x, n, io->y, pool); break;
    case K_MX_I8: k3_mxfp4_matmul_i8_mt(&kw->mx[copy], io->q, io->s, n, io->y, pool); break;
    case K_DENSE: k3_qmat_matmul(&kw->qm[copy], io->x, n, io->y, pool); break;
    }
}

/* Seconds per call: the best of the calls made in g_min_time (at least 3),
 * rotating over `use` copies (1 = hot). The best call, not the mean: this
 * machine is shared, and interference only ever adds time. */
/* Seconds per call. From RAM (use > 1 copies): a pass calls every copy
 * once (>= 512 MB of distinct weights, like STREAM's pass over its buffer)
 * and the figure is the best pass / use, so a momentary high of this
 * shared VM's bandwidth during one short call does not count. Hot: the
 * best single call on one copy. At least 3 passes and g_min_time. */
static double time_kernel(const kshape *s, kweights *kw, int use, const kio *io, int n,
                          k3_pool *pool) {
    for (int c = 0; c < use; c++) run_once(s, kw, c, io, n, pool); /* warm / fault in */
    int passes = 0;
    double best = 1e30, t_start = k3_now_s();
    do {
        double t0 = k3_now_s();
        for (int c = 0; c < use; c++) run_once(s, kw, c, io, n, pool);
        double dt = (k3_now_s() - t0) / use;
        best = dt < best ? dt : best;
        passes++;
    } while (k3_now_s() - t_start < g_min_time || passes < 3);
    return best;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* n = 1 from RAM, paired: PAIRS alternations of one STREAM pass and one
 * pass of the kernel over all copies, each ratio against the mean of the
 * STREAM passes just before and just after it. The median ratio is the
 * figure this VM's drifting bandwidth cannot move much: both sides of a
 * pair see the same minute. */
#define PAIRS 7
static void paired(const kshape *s, kweights *kw, int copies, const kio *io, const uint8_t *sbuf,
                   size_t sbytes) {
    for (int thr = 1; thr <= 2; thr++) {
        k3_pool *pool = thr == 1 ? NULL : g_pool2;
        bench_rd_job j = {.buf = sbuf, .bytes = sbytes, .parts = thr};
        double r[PAIRS], prev = 0;
        for (int p = 0; p <= PAIRS; p++) {
            double t0 = k3_now_s();
            k3_pool_run(pool, bench_rd_task, &j, thr);
            const double sgbs = (double)sbytes / (k3_now_s() - t0) / 1e9;
            if (p > 0) r[p - 1] = r[p - 1] / ((sgbs + prev) / 2);
            prev = sgbs;
            if (p == PAIRS) break;
            t0 = k3_now_s();
            for (int c = 0; c < copies; c++) run_once(s, kw, c, io, 1, pool);
            r[p] = (double)kw->bytes * copies / (k3_now_s() - t0) / 1e9; /* GB/s for now */
        }
        double sorted[PAIRS];
        memcpy(sorted, r, sizeof r);
        qsort(sorted, PAIRS, sizeof *sorted, cmp_double);
        printf("# %s n = 1, %d thread%s, %d paired passes: kernel / STREAM median %.2f (min %.2f, "
               "max %.2f)\n",
               s->name, thr, thr == 1 ? "" : "s", PAIRS, sorted[PAIRS / 2], sorted[0],
               sorted[PAIRS - 1]);
    }
}

int main(int argc, char **argv) {
    int quick = 0;
    const char *filter = NULL;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick"))
            quick = 1;
        else
            filter = argv[a];
    }
    if (quick) g_min_time = 0.05;
    char err[256];
    if (k3_pool_open(&g_pool2, 2, err, sizeof err) != K3_OK) {
        fprintf(stderr, "bench_kernels: %s\n", err);
        return 1;
    }
    k3_isa isa = k3_isa_active();
    printf("# k3shard kernel benchmark: isa %s (cpu supports %s)\n", k3_isa_name(isa),
           k3_isa_name(k3_isa_detect()));
    print_load("at start");

    /* denominators */
    const size_t sbytes = bench_ram_bytes(quick ? (256u << 20) : (1024u << 20));
    uint8_t *sbuf = k3_xaligned(64, sbytes);
    memset(sbuf, 1, sbytes);
    double stream[3];
    for (int t = 1; t <= 2; t++) stream[t] = stream_read(t, sbuf, sbytes);
    int pk_kind = isa == K3_ISA_AVX512 ? 1 : 0;
    double peak[3];
    for (int t = 1; t <= 2; t++) peak[t] = isa == K3_ISA_SCALAR ? 0 : int8_peak(pk_kind, t);
    printf("# STREAM-like read: %.1f GB/s (1 thread), %.1f GB/s (2 threads)\n", stream[1],
           stream[2]);
    if (isa != K3_ISA_SCALAR)
        printf("# int8 dot peak (%s): %.0f GOP/s (1 thread), %.0f GOP/s (2 threads)\n",
               pk_kind ? "vpdpbusd zmm" : "vpmaddubsw+vpmaddwd+vpaddd ymm", peak[1], peak[2]);
    if (pk_kind == 0 && k3_isa_detect() == K3_ISA_AVX512)
        printf("# (for reference, vpdpbusd zmm peak: %.0f GOP/s 1 thread)\n", int8_peak(1, 1));
    if (k3_isa_detect() == K3_ISA_AVX512) {
        /* the float-activation kernels (docs/MODEL.md 4.2) can reach at most this */
        const double f1 = int8_peak(2, 1);
        printf("# float FMA peak (vfmadd231ps zmm): %.0f GFLOP/s (1 thread) = %.0f%% of the int8 "
               "dot peak\n",
               f1, peak[1] > 0 ? 100 * f1 / peak[1] : 0);
    }

    /* pool overhead */
    {
        double t0 = k3_now_s();
        int runs = 20000;
        bench_rd_job j = {.buf = NULL, .bytes = 0, .parts = 2};
        for (int i = 0; i < runs; i++) k3_pool_run(g_pool2, bench_rd_task, &j, 2);
        printf("# pool: an empty 2-thread k3_pool_run costs %.2f us\n",
               (k3_now_s() - t0) / runs * 1e6);
    }

    static const kshape shapes[] = {
        {"mxfp4 f32 gate/up", K_MX_F32, 0, 0, 3072, 3584},
        {"mxfp4 i8 gate/up", K_MX_I8, 0, 0, 3072, 3584},
        {"mxfp4 f32 down", K_MX_F32, 0, 0, 3584, 3072},
        {"mxfp4 i8 down", K_MX_I8, 0, 0, 3584, 3072},
        {"int4 kda qkv", K_DENSE, 4, 0, 12288, 7168},
        {"int8 mla", K_DENSE, 8, 0, 1536, 7168},
        {"int8 lm_head", K_DENSE, 8, 0, 16384, 7168},
        {"int4 kda qkv idot", K_DENSE, 4, 1, 12288, 7168},
        {"int8 mla idot", K_DENSE, 8, 1, 1536, 7168},
        {"int8 lm_head idot", K_DENSE, 8, 1, 16384, 7168},
    };
    static const int ns[] = {1, 8, 32};
    const int nmax = 32;
    const size_t ram_target = bench_ram_bytes(512u << 20); /* >= 4x L3 */

    printf("\n%-20s %-11s %2s %3s %-4s %9s %7s %6s %7s %6s\n", "kernel", "shape", "n", "thr", "mem",
           "ms/call", "GB/s", "%strm", "GOP/s", "%peak");
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {
        const kshape *s = &shapes[si];
        if (filter && !strstr(s->name, filter)) continue;
        kweights kw;
        int copies = 1;
        {
            kweights probe;
            weights_make(&probe,
                         &(kshape){.kind = s->kind, .bits = s->bits, .rows = 64, .cols = s->cols},
                         1);
            size_t per_row = probe.bytes / 64;
            weights_free(&probe);
            size_t one = per_row * (size_t)s->rows;
            copies = (int)((ram_target + one - 1) / one);
            if (quick && copies > 4) copies = 4;
        }
        weights_make(&kw, s, copies);
        float *x = malloc(sizeof(float) * nmax * s->cols);
        for (size_t i = 0; i < (size_t)nmax * s->cols; i++)
            x[i] = (float)((int)(bench_rnd() % 2001) - 1000) / 1000.0f;
        int8_t *q = malloc((size_t)nmax * s->cols);
        float *qs = malloc(sizeof(float) * nmax * s->cols / 32);
        k3_act_quant_q8(x, nmax, s->cols, q, qs);
        float *y = malloc(sizeof(float) * nmax * s->rows);
        kio io = {.x = x, .q = q, .s = qs, .y = y};
        char shape[32];
        snprintf(shape, sizeof shape, "%dx%d", s->rows, s->cols);
        /* This VM's bandwidth drifts and dips for seconds at a time (other
         * tenants): STREAM is measured again right before and right after
         * the n = 1 rows of each kernel, and their %strm divides by the
         * better of the two, so a dip during either side cannot inflate the
         * ratio. */
        double sec[3][3][2], before[3] = {0}, after[3] = {0}, strm[3] = {1, 1, 1};
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
            int n = ns[ni];
            if (n == 1)
                for (int t = 1; t <= 2; t++) before[t] = stream_read(t, sbuf, sbytes);
            for (int thr = 1; thr <= 2; thr++)
                for (int hot = 0; hot <= 1; hot++)
                    sec[ni][thr][hot] =
                        time_kernel(s, &kw, hot ? 1 : copies, &io, n, thr == 1 ? NULL : g_pool2);
            if (n == 1)
                for (int t = 1; t <= 2; t++) {
                    after[t] = stream_read(t, sbuf, sbytes);
                    strm[t] = before[t] > after[t] ? before[t] : after[t];
                }
        }
        printf("# STREAM-like read around the n = 1 rows of %s: %.1f / %.1f before, %.1f / %.1f "
               "after (GB/s, 1 / 2 threads)\n",
               s->name, before[1], before[2], after[1], after[2]);
        for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++)
            for (int thr = 1; thr <= 2; thr++)
                for (int hot = 0; hot <= 1; hot++) {
                    const int n = ns[ni];
                    const double dt = sec[ni][thr][hot];
                    const double gbs = (double)kw.bytes / dt / 1e9;
                    const double gops = 2.0 * s->rows * (double)s->cols * n / dt / 1e9;
                    printf("%-20s %-11s %2d %3d %-4s %9.3f %7.1f %5.0f%% %7.1f %5.0f%%\n", s->name,
                           shape, n, thr, hot ? "hot" : "ram", dt * 1e3, gbs, 100 * gbs / strm[thr],
                           gops, peak[thr] > 0 ? 100 * gops / peak[thr] : 0);
                }
        paired(s, &kw, copies, &io, sbuf, sbytes);
        fflush(stdout);
        free(x);
        free(q);
        free(qs);
        free(y);
        weights_free(&kw);
    }

    /* activation quantizer, for scale */
    {
        const int cols = 3584, n = 32;
        float *x = malloc(sizeof(float) * n * cols);
        for (int i = 0; i < n * cols; i++)
            x[i] = (float)((int)(bench_rnd() % 2001) - 1000) / 1000.0f;
        int8_t *q = malloc((size_t)n * cols);
        float *s = malloc(sizeof(float) * n * cols / 32);
        int iters = 0;
        double t0 = k3_now_s();
        while (k3_now_s() - t0 < g_min_time) {
            k3_act_quant_q8(x, n, cols, q, s);
            iters++;
        }
        printf("\n# act quant 32x3584: %.1f us per call\n", (k3_now_s() - t0) / iters * 1e6);
        free(x);
        free(q);
        free(s);
    }
    print_load("at end");
    k3_pool_close(&g_pool2);
    free(sbuf);
    return 0;
}
