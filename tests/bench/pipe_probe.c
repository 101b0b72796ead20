/* tests/bench/pipe_probe.c: which AVX-512 instructions compete for the same
 * execution resources on this CPU (issue 7's profile; `perf` has no PMU in
 * this VM, so ports are probed by throughput instead). Each probe runs 8
 * independent dependency chains of one instruction (enough to cover its
 * latency) in one asm block per iteration, alone and mixed 8 + 8 (or 8 + 2)
 * with a second one. Two instructions that share a unit keep the mix's
 * total rate at the single rate; two that do not add up. Prints each
 * probe's rate in G instructions/s and the mix's total against the first
 * instruction alone. Single thread; a table, not a timed test.
 *
 * Usage: pipe_probe [ITERS]   (default 20000000 iterations per probe)
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kernels/kernels.h"
#include "common/base/log.h"
#include "tests/bench/bench_util.h"

#define Z_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))

/* The first instruction: 8 chains on %0..7 (BENCH_CHAINS8); the second of
 * a mix: 8 on 4 more registers, %8..11 (the asm operand limit of 30 counts
 * a "+v" twice) */
#define CH8B(INS, S)                                                                               \
    INS " " S ", %8\n\t" INS " " S ", %9\n\t" INS " " S ", %10\n\t" INS " " S ", %11\n\t" INS      \
        " " S ", %8\n\t" INS " " S ", %9\n\t" INS " " S ", %10\n\t" INS " " S ", %11\n\t"
#define CH2B(INS, S) INS " " S ", %8\n\t" INS " " S ", %9\n\t"

/* The instructions, as mnemonic and sources (%12, %13: constant zmm
 * inputs). The destination is the chain register: an accumulator for
 * vpdpbusd and vfmadd231ps (8 chains cover their latency); the others do
 * not read it, so their 8 are independent, which measures throughput the
 * same way. */
#define DPBUSD "vpdpbusd", "%13, %12"
#define FMA    "vfmadd231ps", "%13, %12"
#define MULPS  "vmulps", "%12, %12"
#define PERMB  "vpermb", "%12, %12"
#define ADDD   "vpaddd", "%12, %12"
#define CVT    "vcvtdq2ps", "%12"
#define SRLW   "vpsrlw", "$4, %12"
#define UNPACK "vpunpckldq", "%12, %12"
#define MOVR   "vmovdqa32", "%12"
#define PMOVSX "vpmovsxbd", "%x12"
#define PSHUFB "vpshufb", "%12, %12"

/* Every probe, in print order: ONE(X) runs 8 of X alone, MIX(X, Y) 8 of X
 * and 8 of Y, MIX2(X, Y) 8 of X and 2 of Y. Each single instruction comes
 * before the mixes that name it first or second (their references). run()
 * and the label table are both generated from this one list. */
/* clang-format off: one group of probes per line */
// clang-format off
#define PROBES(ONE, MIX, MIX2)                                                                     \
    ONE(DPBUSD) ONE(FMA) ONE(MULPS) ONE(PERMB) ONE(ADDD) ONE(CVT) ONE(SRLW) ONE(UNPACK)            \
    MIX(DPBUSD, FMA) MIX2(DPBUSD, MULPS) MIX(DPBUSD, PERMB) MIX(DPBUSD, ADDD) MIX(DPBUSD, CVT)     \
    MIX(DPBUSD, SRLW) MIX(PERMB, UNPACK) MIX(PERMB, ADDD) MIX(PERMB, CVT)                          \
    /* register copies (a destructive accumulator's start value) */                               \
    MIX(DPBUSD, MOVR) MIX(ADDD, MOVR)                                                              \
    /* the int8 float decode: widen, then convert */                                              \
    ONE(PMOVSX) MIX(PMOVSX, CVT)                                                                   \
    /* the decode without VBMI (vpand + vpshufb) */                                               \
    ONE(PSHUFB) MIX(DPBUSD, PSHUFB) MIX(PSHUFB, UNPACK) MIX(PERMB, PSHUFB)
// clang-format on

/* A probe's label: both instructions' mnemonics and how many of each run
 * per iteration (the second: NULL, 0 when alone). */
typedef struct {
    const char *first, *second;
    int n1, n2;
} probe;

#define MNEMONIC(INS, SRC) INS
#define LABEL1(X)          {MNEMONIC(X), NULL, 8, 0},
#define LABEL8(X, Y)       {MNEMONIC(X), MNEMONIC(Y), 8, 8},
#define LABEL2(X, Y)       {MNEMONIC(X), MNEMONIC(Y), 8, 2},
static const probe P[] = {PROBES(LABEL1, LABEL8, LABEL2)};
enum { NP = sizeof P / sizeof *P };

#define ARGS                                                                                       \
    : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(b0),    \
      "+v"(b1), "+v"(b2), "+v"(b3)                                                                 \
    : "v"(u), "v"(s)

/* probe number `kind` is the k-th entry of PROBES: each entry tests its
 * own position */
#define LOOP(BODY)                                                                                 \
    if (kind == k++)                                                                               \
        for (long i = 0; i < iters; i++) __asm__ volatile(BODY ARGS);
#define RUN1(X)    LOOP(BENCH_CHAINS8(X))
#define RUN8(X, Y) LOOP(BENCH_CHAINS8(X) CH8B(Y))
#define RUN2(X, Y) LOOP(BENCH_CHAINS8(X) CH2B(Y))

Z_TARGET static double run(int kind, long iters) {
    /* scalars, not arrays: an array's elements went through memory around
     * every asm block, and the store-to-load forwarding became the bound */
    __m512i a0 = _mm512_set1_epi32(1), a1 = _mm512_set1_epi32(2), a2 = _mm512_set1_epi32(3),
            a3 = _mm512_set1_epi32(4), a4 = _mm512_set1_epi32(5), a5 = _mm512_set1_epi32(6),
            a6 = _mm512_set1_epi32(7), a7 = _mm512_set1_epi32(8), b0 = _mm512_set1_epi32(9),
            b1 = _mm512_set1_epi32(10), b2 = _mm512_set1_epi32(11), b3 = _mm512_set1_epi32(12);
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(1);
    /* the byte patterns read as floats are tiny: flush denormal inputs and
     * results to zero, so no CPU takes a microcode assist on them */
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    const double t0 = k3_now_s();
    int k = 0;
    PROBES(RUN1, RUN8, RUN2)
    const double dt = k3_now_s() - t0;
    _mm_setcsr(csr);
    /* keep the chains' results (vector adds wrap; a scalar reduction's int
     * sum would overflow) */
    const __m512i t =
        _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                         _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    volatile __m512i sink =
        _mm512_add_epi32(t, _mm512_add_epi32(_mm512_add_epi32(b0, b1), _mm512_add_epi32(b2, b3)));
    (void)sink;
    return dt;
}

int main(int argc, char **argv) {
    const long iters = argc > 1 ? atol(argv[1]) : 20000000L;
    if (iters < 1000 || iters > 4000000000L) {
        fprintf(stderr, "pipe_probe: ITERS %ld: need 1000 to 4000000000\n", iters);
        return 2;
    }
    if (k3_isa_detect() != K3_ISA_AVX512 || !__builtin_cpu_supports("avx512vbmi")) {
        printf("# pipe_probe: needs AVX-512 with VBMI; this CPU has %s\n",
               k3_isa_name(k3_isa_detect()));
        return 0;
    }
    double rate[NP];
    printf("# pipe_probe: zmm instructions, 8 independent chains each, 1 thread, %ld iterations\n",
           iters);
    printf("# a mix's total against its first instruction alone, and what that would be if the\n"
           "# two took turns on one unit or ran on separate ones (from their rates alone)\n");
    printf("%-26s %10s\n", "probe", "G instr/s");
    for (int p = 0; p < NP; p++) {
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            const double dt = run(p, iters);
            best = dt < best ? dt : best;
        }
        const probe *pr = &P[p];
        rate[p] = (double)iters * (pr->n1 + pr->n2) / best / 1e9;
        if (!pr->second) {
            printf("%-26s %10.2f\n", pr->first, rate[p]);
            continue;
        }
        char name[64];
        snprintf(name, sizeof name, pr->n2 == pr->n1 ? "%s + %s" : "%s + %s (%d:%d)", pr->first,
                 pr->second, pr->n1, pr->n2);
        double r1 = 0, r2 = 0; /* each instruction alone, from the probes before */
        for (int q = 0; q < p; q++)
            if (!P[q].second) {
                if (!strcmp(P[q].first, pr->first)) r1 = rate[q];
                if (!strcmp(P[q].first, pr->second)) r2 = rate[q];
            }
        printf("%-26s %10.2f   total / first alone %.2f", name, rate[p], rate[p] / r1);
        if (r2 >
            0) { /* seconds per iteration per 1e9: the two one after the other, or overlapped */
            const double t1 = pr->n1 / r1, t2 = pr->n2 / r2, n = pr->n1 + pr->n2;
            printf(" (one unit: %.2f, separate: %.2f)", n / (t1 + t2) / r1,
                   n / (t1 > t2 ? t1 : t2) / r1);
        }
        printf("\n");
    }
    return 0;
}
