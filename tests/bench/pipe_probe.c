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

#include "common/kernels.h"
#include "common/log.h"

#define Z_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))

/* 8 chains of INS "S, %0..7" (AT&T order: sources, then the destination);
 * the second instruction of a mix: 8 on 4 more registers, %8..11 (the asm
 * operand limit of 30 counts a "+v" twice) */
#define CH8(INS, S)                                                                                \
    INS " " S ", %0\n\t" INS " " S ", %1\n\t" INS " " S ", %2\n\t" INS " " S ", %3\n\t" INS " " S  \
        ", %4\n\t" INS " " S ", %5\n\t" INS " " S ", %6\n\t" INS " " S ", %7\n\t"
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
#define PERMB2 "vpermb", "%13, %12"

typedef struct {
    const char *name;
    int kind; /* index into run() */
    int n1, n2;
} probe;

#define ARGS                                                                                       \
    : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(b0),    \
      "+v"(b1), "+v"(b2), "+v"(b3)                                                                 \
    : "v"(u), "v"(s)

#define LOOP(BODY)                                                                                 \
    for (long i = 0; i < iters; i++) __asm__ volatile(BODY ARGS)

#define ONE(X)     CH8(X)
#define MIX(X, Y)  CH8(X) CH8B(Y)
#define MIX2(X, Y) CH8(X) CH2B(Y)

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
    switch (kind) {
    case 0: LOOP(ONE(DPBUSD)); break;
    case 1: LOOP(ONE(FMA)); break;
    case 2: LOOP(ONE(MULPS)); break;
    case 3: LOOP(ONE(PERMB)); break;
    case 4: LOOP(ONE(ADDD)); break;
    case 5: LOOP(ONE(CVT)); break;
    case 6: LOOP(ONE(SRLW)); break;
    case 7: LOOP(ONE(UNPACK)); break;
    case 8: LOOP(MIX(DPBUSD, FMA)); break;
    case 9: LOOP(MIX2(DPBUSD, MULPS)); break;
    case 10: LOOP(MIX(DPBUSD, PERMB)); break;
    case 11: LOOP(MIX(DPBUSD, ADDD)); break;
    case 12: LOOP(MIX(DPBUSD, CVT)); break;
    case 13: LOOP(MIX(DPBUSD, SRLW)); break;
    case 14: LOOP(MIX(PERMB, UNPACK)); break;
    case 15: LOOP(MIX(PERMB, ADDD)); break;
    case 16: LOOP(MIX(PERMB, CVT)); break;
    case 17: LOOP(MIX(DPBUSD, MOVR)); break;
    case 18: LOOP(MIX(ADDD, MOVR)); break;
    case 19: LOOP(ONE(PMOVSX)); break;
    case 20: LOOP(MIX(PMOVSX, CVT)); break;
    case 21: LOOP(ONE(PSHUFB)); break;
    case 22: LOOP(MIX(DPBUSD, PSHUFB)); break;
    case 23: LOOP(MIX(PSHUFB, UNPACK)); break;
    case 24: LOOP(MIX(PERMB, PSHUFB)); break;
    }
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
    static const probe P[] = {
        {"vpdpbusd", 0, 8, 0},
        {"vfmadd231ps", 1, 8, 0},
        {"vmulps", 2, 8, 0},
        {"vpermb", 3, 8, 0},
        {"vpaddd", 4, 8, 0},
        {"vcvtdq2ps", 5, 8, 0},
        {"vpsrlw", 6, 8, 0},
        {"vpunpckldq", 7, 8, 0},
        {"vpdpbusd + vfmadd231ps", 8, 8, 8},
        {"vpdpbusd + vmulps (8:2)", 9, 8, 2},
        {"vpdpbusd + vpermb", 10, 8, 8},
        {"vpdpbusd + vpaddd", 11, 8, 8},
        {"vpdpbusd + vcvtdq2ps", 12, 8, 8},
        {"vpdpbusd + vpsrlw", 13, 8, 8},
        {"vpermb + vpunpckldq", 14, 8, 8},
        {"vpermb + vpaddd", 15, 8, 8},
        {"vpermb + vcvtdq2ps", 16, 8, 8},
        /* register copies (a destructive accumulator's start value) */
        {"vpdpbusd + vmovdqa32", 17, 8, 8},
        {"vpaddd + vmovdqa32", 18, 8, 8},
        /* the int8 float decode: widen, then convert */
        {"vpmovsxbd", 19, 8, 0},
        {"vpmovsxbd + vcvtdq2ps", 20, 8, 8},
        /* the decode without VBMI (vpand + vpshufb) */
        {"vpshufb", 21, 8, 0},
        {"vpdpbusd + vpshufb", 22, 8, 8},
        {"vpshufb + vpunpckldq", 23, 8, 8},
        {"vpermb + vpshufb", 24, 8, 8},
    };
    const int np = sizeof P / sizeof *P;
    double rate[32];
    printf("# pipe_probe: zmm instructions, 8 independent chains each, 1 thread, %ld iterations\n",
           iters);
    printf("%-26s %10s %s\n", "probe", "G instr/s", "");
    for (int p = 0; p < np; p++) {
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            const double dt = run(P[p].kind, iters);
            best = dt < best ? dt : best;
        }
        rate[p] = (double)iters * (P[p].n1 + P[p].n2) / best / 1e9;
        if (P[p].n2 == 0) {
            printf("%-26s %10.2f\n", P[p].name, rate[p]);
            continue;
        }
        /* the first instruction's own rate (probes 0-7 come first) */
        double r1 = 0;
        for (int q = 0; q < p; q++)
            if (P[q].n2 == 0 && !strncmp(P[p].name, P[q].name, strlen(P[q].name)) &&
                P[p].name[strlen(P[q].name)] == ' ')
                r1 = rate[q];
        const double ideal_shared = r1, t_sep = (double)P[p].n1 / r1;
        printf("%-26s %10.2f   total / first alone %.2f (shared unit: %.2f, separate: %.2f)\n",
               P[p].name, rate[p], rate[p] / r1, ideal_shared / r1,
               (double)(P[p].n1 + P[p].n2) / t_sep / r1);
    }
    return 0;
}
