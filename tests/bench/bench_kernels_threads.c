/* tests/bench/bench_kernels_threads.c: decode mat-vec from RAM per thread
 * count, each figure paired with STREAM of the same thread count in the
 * same process (issue 21). Not a test: prints a table, asserts nothing.
 *
 * For every thread count T (1, 2, then every count up to the CPUs online, or
 * --threads LIST) and every n (1..4, or --n LIST), ROUNDS alternations of
 *   one STREAM pass: T threads, each reading its contiguous 1/T of a buffer
 *     far larger than L3 (STREAM_BYTES);
 *   one kernel pass: every copy of the matrix once (the copies together far
 *     larger than L3, so the weights come from RAM, as in decode),
 * each kernel pass divided by the mean of the STREAM passes just before and
 * just after it. The median of those ratios is the figure to judge by: this
 * VM is shared and its bandwidth drifts by tens of percent within a minute,
 * while both sides of a pair see the same seconds. GB/s columns are the
 * medians of the passes themselves, for scale only.
 *
 * Formats (names as bench_util.h's): mxi8 (MXFP4 integer-dot, the expert
 * default), int8 / int4 (float activations, the dense default), int8i /
 * int4i (--dense-idot). K3_ISA picks the level as everywhere.
 *
 * Usage: bench_kernels_threads [--quick] [--threads 1,2,4] [--n 1,2]
 *        [--rounds R] [--pattern] [--hot] [--sleep] [--thp] [--gap US] [FORMAT...]
 *   --thp     a second set of the copies, madvise(MADV_HUGEPAGE)d (transparent
 *             huge pages are "madvise" on many systems, so a plain malloc
 *             gets 4 KB pages), timed in the same rounds: column "thp" is its
 *             pass against the same STREAM neighbours
 *   --gap US  also a pass whose calls are US microseconds apart (the caller
 *             spins in between; only the calls are timed), as in a decode
 *             step with single-threaded work between matmuls: past the
 *             pool's spin (50 us) the workers sleep, and column "gap" shows
 *             what waking them costs
 *   --pattern also time, paired the same way, a read-only pass over the
 *             copies in the kernel's own row-task split (threads, tasks,
 *             16-row tiles, the next tile prefetched), to separate the
 *             access pattern from the kernel's compute; column "pts" is
 *             the same walk with the next tile prefetched in address
 *             order (one sequential stream from RAM, the loads still in
 *             16-row order), column "seq" the same bytes read as one
 *             sequential stream per task (8 KB software prefetch), the
 *             pattern of a tile-major layout
 *   --sleep   also time the kernel through a second pool whose idle threads
 *             sleep after 50 us of spinning (k3_pool_set_yield 0, the pool
 *             before 2026-12-03) instead of yielding for 2 ms first: column
 *             "sleep", against the same STREAM passes; what waking a
 *             sleeping thread inside back-to-back calls costs
 *   --hot     also time the kernel on ONE copy, called as often as there
 *             are copies (in L3 after the first call: the kernel's compute
 *             rate without RAM), against the same STREAM passes: column
 *             "hot" below about 1.3 says the kernel computes too slowly to
 *             hide the memory time at that thread count
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/base/log.h"
#include "common/base/pool.h"
#include "common/kernels/kernels.h"
#include "tests/bench/bench_util.h"

#define MAX_LIST 64

/* The kernel's pattern, read only: rows [r0, r1) of ldp bytes in tiles of
 * 16 rows, 64 bytes of each row per step, the next tile's same line
 * prefetched (prefetcht1), as the n = 1 integer-dot tiles walk them. */
typedef struct {
    const uint8_t *w;
    size_t ldp;
    int rows, per_task;
    uint64_t sink[MAX_LIST * 8];
} pat_job;

/* The walk; the prefetch of step s (row i of 64-byte column block c, s =
 * c/64 * 16 + i) goes to the next tile's same line (pat_task), or to line s
 * of the next tile, which is contiguous (16 rows of ldp bytes), so that the
 * lines from RAM come as one sequential stream while the loads keep the
 * 16-row order (pts_task). */
__attribute__((target("avx2"), always_inline)) static inline void walk(pat_job *j, int task,
                                                                       int in_order) {
    const int r0 = task * j->per_task;
    const int r1 = r0 + j->per_task < j->rows ? r0 + j->per_task : j->rows;
    __m256i a = _mm256_setzero_si256();
    for (int r = r0; r + 16 <= r1; r += 16) {
        const uint8_t *t = j->w + (size_t)r * j->ldp;
        const uint8_t *nx = t + 16 * j->ldp;
        for (size_t c = 0; c < j->ldp; c += 64)
            for (int i = 0; i < 16; i++) {
                const uint8_t *p = t + (size_t)i * j->ldp + c;
                _mm_prefetch(
                    (const char *)(in_order ? nx + c * 16 + (size_t)i * 64 : p + 16 * j->ldp),
                    _MM_HINT_T1);
                a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)p));
                a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + 32)));
            }
    }
    j->sink[(task % MAX_LIST) * 8] = (uint64_t)_mm256_extract_epi64(a, 0);
}

__attribute__((target("avx2"))) static void pat_task(void *ctx, int task) { walk(ctx, task, 0); }
__attribute__((target("avx2"))) static void pts_task(void *ctx, int task) { walk(ctx, task, 1); }

/* The same bytes as pat_task's, read as one sequential stream per task with
 * the line 8 KB ahead prefetched (prefetcht1): the pattern a tile-major
 * layout (a tile's rows interleaved per 64 bytes) would give the kernels. */
__attribute__((target("avx2"))) static void seq_task(void *ctx, int task) {
    pat_job *j = ctx;
    const int r0 = task * j->per_task;
    const int r1 = r0 + j->per_task < j->rows ? r0 + j->per_task : j->rows;
    const uint8_t *p = j->w + (size_t)r0 * j->ldp;
    const size_t bytes = r1 > r0 ? (size_t)(r1 - r0) / 16 * 16 * j->ldp : 0;
    __m256i a = _mm256_setzero_si256();
    for (size_t c = 0; c < bytes; c += 64) {
        _mm_prefetch((const char *)(p + c + 8192), _MM_HINT_T1);
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + c)));
        a = _mm256_add_epi64(a, _mm256_load_si256((const __m256i *)(p + c + 32)));
    }
    j->sink[(task % MAX_LIST) * 8] = (uint64_t)_mm256_extract_epi64(a, 0);
}

typedef struct {
    const char *name;
    int copies;
    bench_mat *m;  /* [copies] */
    bench_mat *mh; /* [copies] on huge pages (--thp), or NULL */
    int8_t *xq;    /* [4][cols] */
    float *xs, *x, *y;
} fmt_case;

/* bench_make_mat's matrix, on huge pages if thp */
static void make_mat(const char *name, int rows, int cols, bench_mat *m, int thp) {
    bench_thp = thp;
    bench_make_mat(name, rows, cols, m);
    bench_thp = 0;
}

static void mats_free(bench_mat *ms, int copies) {
    for (int c = 0; ms && c < copies; c++) {
        bench_mat *m = &ms[c];
        if (m->kind != BENCH_DENSE)
            free((void *)m->mx.packed);
        else {
            free(m->qm.q8);
            free(m->qm.q4);
            free(m->qm.scales);
        }
    }
    free(ms);
}

/* AnonHugePages of /proc/meminfo in kB (0 if unreadable) */
static long anon_huge_kb(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb;
}

/* GB/s of one read-pattern pass (pat_task or seq_task) over every copy of
 * the case's matrix: the weight bytes of rows x ldp, split per_task rows a
 * task as the library's mm_run splits them. */
static double pattern_gbps(k3_pool *pool, void (*task)(void *, int), const fmt_case *fc, int kind,
                           size_t ldp, int rows, int per) {
    double t0 = k3_now_s();
    for (int c = 0; c < fc->copies; c++) {
        pat_job pj = {.w = kind == BENCH_MXI8               ? fc->m[c].mx.packed
                           : fc->m[c].qm.fmt == K3_QF_I4G64 ? fc->m[c].qm.q4
                                                            : (const uint8_t *)fc->m[c].qm.q8,
                      .ldp = ldp,
                      .rows = rows,
                      .per_task = per};
        k3_pool_run(pool, task, &pj, (rows + per - 1) / per);
    }
    return (double)ldp * rows * fc->copies / (k3_now_s() - t0) / 1e9;
}

static void run_once(const bench_mat *m, const fmt_case *fc, int n, k3_pool *pool) {
    if (m->kind == BENCH_MXI8)
        k3_mxfp4_matmul_i8_mt(&m->mx, fc->xq, fc->xs, n, fc->y, pool);
    else
        k3_qmat_matmul(&m->qm, fc->x, n, fc->y, pool);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int k) {
    qsort(v, (size_t)k, sizeof *v, cmp_double);
    return k % 2 ? v[k / 2] : (v[k / 2 - 1] + v[k / 2]) / 2;
}

static int parse_list(const char *s, int *out, int maxv) {
    int k = 0;
    while (*s && k < MAX_LIST) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > maxv) {
            fprintf(stderr, "bench_kernels_threads: bad list entry in '%s' (1..%d)\n", s, maxv);
            exit(2);
        }
        out[k++] = (int)v;
        s = *end == ',' ? end + 1 : end;
    }
    return k;
}

#define ROUNDS_MAX 64

int main(int argc, char **argv) {
    int quick = 0, rounds = 9, rounds_set = 0, thp = 0, pattern = 0, hot = 0, gap_us = 0,
        sleepy = 0;
    int threads[MAX_LIST], nthreads = 0, ns[MAX_LIST] = {1, 2, 3, 4}, nns = 4;
    const char *names[8];
    int nnames = 0;
    const int cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--quick"))
            quick = 1;
        else if (!strcmp(argv[a], "--thp"))
            thp = 1;
        else if (!strcmp(argv[a], "--pattern"))
            pattern = 1;
        else if (!strcmp(argv[a], "--hot"))
            hot = 1;
        else if (!strcmp(argv[a], "--sleep"))
            sleepy = 1;
        else if (!strcmp(argv[a], "--threads") && a + 1 < argc)
            nthreads = parse_list(argv[++a], threads, BENCH_RD_MAX_PARTS);
        else if (!strcmp(argv[a], "--n") && a + 1 < argc)
            nns = parse_list(argv[++a], ns, 4);
        else if (!strcmp(argv[a], "--gap") && a + 1 < argc)
            parse_list(argv[++a], &gap_us, 1000000);
        else if (!strcmp(argv[a], "--rounds") && a + 1 < argc)
            rounds_set = parse_list(argv[++a], &rounds, ROUNDS_MAX);
        else if (argv[a][0] != '-' && nnames < 8) {
            int kind, r, c;
            if (bench_kernel_shape(argv[a], &kind, &r, &c) || kind == BENCH_MXF32) {
                fprintf(stderr,
                        "bench_kernels_threads: unknown format '%s' (mxi8, int8, int8i, "
                        "int4, int4i)\n",
                        argv[a]);
                return 2;
            }
            names[nnames++] = argv[a];
        } else {
            fprintf(stderr,
                    "usage: bench_kernels_threads [--quick] [--threads 1,2,..] [--n 1,..,4] "
                    "[--rounds R] [--thp] [--pattern] [--hot] [--sleep] [--gap US] "
                    "[mxi8|int8|int8i|int4|int4i ...]\n");
            return 2;
        }
    }
    if (!nthreads) {
        threads[nthreads++] = 1;
        for (int t = 2; t <= cpus && nthreads < MAX_LIST; t++) threads[nthreads++] = t;
    }
    if (!nnames) {
        static const char *all[] = {"mxi8", "int8", "int8i", "int4", "int4i"};
        for (int i = 0; i < 5; i++) names[nnames++] = all[i];
    }
    if (quick && !rounds_set && rounds > 5) rounds = 5;
    const size_t ram_target = bench_ram_bytes(quick ? (192u << 20) : (512u << 20));
    const size_t sbytes = bench_ram_bytes(quick ? (256u << 20) : (512u << 20));

    printf("# k3shard decode threads: isa %s, %d cpus online, %d rounds per figure\n",
           k3_isa_name(k3_isa_active()), cpus, rounds);
    printf("# ratio = kernel pass GB/s / mean of the STREAM passes (same thread count) just "
           "before and after it; median [min, max] over the rounds\n");
    uint8_t *sbuf = bench_alloc(sbytes);
    memset(sbuf, 1, sbytes);

    printf("\n%-6s %-11s %3s %2s %8s %8s %6s %6s %6s", "format", "shape", "thr", "n", "GB/s",
           "STREAM", "ratio", "min", "max");
    printf(pattern ? " %6s %6s %6s" : "", "pat", "pts", "seq");
    printf(hot ? " %6s" : "", "hot");
    printf(sleepy ? " %6s" : "", "sleep");
    printf(thp ? " %6s" : "", "thp");
    printf(gap_us ? " %6s\n" : "\n", "gap");
    for (int fi = 0; fi < nnames; fi++) {
        fmt_case fc = {.name = names[fi]};
        int kind = 0, rows = 0, cols = 0;
        bench_kernel_shape(fc.name, &kind, &rows, &cols);
        bench_mat *probe = calloc(1, sizeof *probe);
        make_mat(fc.name, 16, cols, probe, 0);
        const size_t one = probe->bytes / 16 * (size_t)rows;
        mats_free(probe, 1);
        fc.copies = (int)((ram_target + one - 1) / one);
        fc.m = calloc((size_t)fc.copies, sizeof *fc.m);
        for (int c = 0; c < fc.copies; c++) make_mat(fc.name, rows, cols, &fc.m[c], 0);
        if (thp) {
            const long before = anon_huge_kb();
            fc.mh = calloc((size_t)fc.copies, sizeof *fc.mh);
            for (int c = 0; c < fc.copies; c++) make_mat(fc.name, rows, cols, &fc.mh[c], 1);
            printf("# %s: %d copies of %.1f MB; the huge-page set got %.0f MB of huge pages\n",
                   fc.name, fc.copies, one / 1e6, (anon_huge_kb() - before) / 1e3);
        }
        fc.x = bench_make_x(4, cols);
        fc.xq = bench_alloc((size_t)4 * cols);
        fc.xs = bench_alloc(sizeof(float) * 4 * (size_t)cols / 32);
        k3_act_quant_q8(fc.x, 4, cols, fc.xq, fc.xs);
        fc.y = bench_alloc(sizeof(float) * 4 * (size_t)rows);
        char shape[32];
        snprintf(shape, sizeof shape, "%dx%d", rows, cols);
        for (int ti = 0; ti < nthreads; ti++) {
            const int T = threads[ti];
            k3_pool *pool = NULL, *spool = NULL; /* spool: --sleep's */
            char err[256];
            if (T > 1 && (k3_pool_open(&pool, T, err, sizeof err) != K3_OK ||
                          (sleepy && k3_pool_open(&spool, T, err, sizeof err) != K3_OK))) {
                fprintf(stderr, "bench_kernels_threads: %s\n", err);
                return 1;
            }
            k3_pool_set_yield(spool, 0);
            bench_rd_job rj = {.buf = sbuf, .bytes = sbytes, .parts = T};
            for (int ni = 0; ni < nns; ni++) {
                const int n = ns[ni];
                double r[ROUNDS_MAX], kg[ROUNDS_MAX], sg[ROUNDS_MAX + 1], pr[ROUNDS_MAX],
                    qr[ROUNDS_MAX], tr[ROUNDS_MAX], hg[ROUNDS_MAX], gg[ROUNDS_MAX], og[ROUNDS_MAX],
                    zg[ROUNDS_MAX];
                /* --hot: the first rows of copy 0, 4 MB per thread (in this
                 * VM's L2 + L3: 1 MB + a share of 32 MB, the L3 shared with
                 * other guests), called until the bytes equal a kernel
                 * pass's; each call's own setup (activation layout, int4's
                 * x blocks) counts, at 1/10 of the matrix or less */
                bench_mat hm = fc.m[0];
                const size_t hcap = (size_t)T * (4u << 20);
                const int hrows = one <= hcap ? rows : (int)(hcap / (one / rows)) / 16 * 16;
                hm.mx.rows = hrows;
                hm.qm.rows = hrows;
                const size_t hbytes = one / (size_t)rows * (size_t)hrows;
                const int hcalls = (int)(((size_t)fc.copies * one + hbytes - 1) / hbytes);
                for (int c = 0; c < fc.copies; c++) run_once(&fc.m[c], &fc, n, pool); /* warm */
                k3_pool_run(pool, bench_rd_task, &rj, T);
                for (int p = 0; p <= rounds; p++) {
                    double t0 = k3_now_s();
                    k3_pool_run(pool, bench_rd_task, &rj, T);
                    sg[p] = (double)(sbytes / (size_t)T / 128 * 128 * (size_t)T) /
                            (k3_now_s() - t0) / 1e9;
                    if (p == rounds) break;
                    t0 = k3_now_s();
                    for (int c = 0; c < fc.copies; c++) run_once(&fc.m[c], &fc, n, pool);
                    kg[p] = (double)one * fc.copies / (k3_now_s() - t0) / 1e9;
                    if (sleepy) {
                        t0 = k3_now_s();
                        for (int c = 0; c < fc.copies; c++) run_once(&fc.m[c], &fc, n, spool);
                        zg[p] = (double)one * fc.copies / (k3_now_s() - t0) / 1e9;
                    }
                    if (fc.mh) {
                        t0 = k3_now_s();
                        for (int c = 0; c < fc.copies; c++) run_once(&fc.mh[c], &fc, n, pool);
                        hg[p] = (double)one * fc.copies / (k3_now_s() - t0) / 1e9;
                    }
                    if (gap_us) {
                        double busy = 0;
                        for (int c = 0; c < fc.copies; c++) {
                            const double until = k3_now_s() + gap_us * 1e-6;
                            while (k3_now_s() < until) {
                            }
                            t0 = k3_now_s();
                            run_once(&fc.m[c], &fc, n, pool);
                            busy += k3_now_s() - t0;
                        }
                        gg[p] = (double)one * fc.copies / busy / 1e9;
                    }
                    if (pattern) {
                        /* the read pattern alone, over the same copies, in the
                         * library's split (mm_run: 2 tasks per thread) */
                        const size_t ldp = kind == BENCH_MXI8              ? (size_t)cols / 2
                                           : fc.m[0].qm.fmt == K3_QF_I4G64 ? (size_t)cols / 2
                                                                           : (size_t)cols;
                        const int tasks = T == 1 ? 1 : 2 * T;
                        const int per = ((rows + 15) / 16 + tasks - 1) / tasks * 16;
                        pr[p] = pattern_gbps(pool, pat_task, &fc, kind, ldp, rows, per);
                        tr[p] = pattern_gbps(pool, pts_task, &fc, kind, ldp, rows, per);
                        qr[p] = pattern_gbps(pool, seq_task, &fc, kind, ldp, rows, per);
                    }
                    if (hot) {
                        run_once(&hm, &fc, n, pool);
                        t0 = k3_now_s();
                        for (int c = 0; c < hcalls; c++) run_once(&hm, &fc, n, pool);
                        og[p] = (double)hbytes * hcalls / (k3_now_s() - t0) / 1e9;
                    }
                }
                double sgc[ROUNDS_MAX + 1], prr[ROUNDS_MAX], qrr[ROUNDS_MAX], trr[ROUNDS_MAX],
                    hr[ROUNDS_MAX], gr[ROUNDS_MAX], orr[ROUNDS_MAX], zr[ROUNDS_MAX];
                for (int p = 0; p < rounds; p++) {
                    r[p] = kg[p] / ((sg[p] + sg[p + 1]) / 2);
                    prr[p] = pattern ? pr[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    qrr[p] = pattern ? qr[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    trr[p] = pattern ? tr[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    orr[p] = hot ? og[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    zr[p] = sleepy ? zg[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    hr[p] = fc.mh ? hg[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                    gr[p] = gap_us ? gg[p] / ((sg[p] + sg[p + 1]) / 2) : 0;
                }
                memcpy(sgc, sg, sizeof(double) * (size_t)(rounds + 1));
                const double smed = median(sgc, rounds + 1), kmed = median(kg, rounds);
                const double rmed = median(r, rounds);
                printf("%-6s %-11s %3d %2d %8.1f %8.1f %6.2f %6.2f %6.2f", fc.name, shape, T, n,
                       kmed, smed, rmed, r[0], r[rounds - 1]);
                if (pattern)
                    printf(" %6.2f %6.2f %6.2f", median(prr, rounds), median(trr, rounds),
                           median(qrr, rounds));
                if (hot) printf(" %6.2f", median(orr, rounds));
                if (sleepy) printf(" %6.2f", median(zr, rounds));
                if (fc.mh) printf(" %6.2f", median(hr, rounds));
                if (gap_us) printf(" %6.2f", median(gr, rounds));
                printf("\n");
                fflush(stdout);
            }
            k3_pool_close(&pool);
            k3_pool_close(&spool);
        }
        mats_free(fc.m, fc.copies);
        mats_free(fc.mh, fc.copies);
        free(fc.x);
        free(fc.xq);
        free(fc.xs);
        free(fc.y);
    }
    free(sbuf);
    return 0;
}
