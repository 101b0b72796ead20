/* tests/bench/bench_util.h: what the benchmark programs share: a seedable
 * xorshift64 generator for their synthetic weights and activations (the
 * clock is common/log.h's k3_now_s). Header-only; one program, one thread
 * draws from it. */
#ifndef K3_BENCH_UTIL_H
#define K3_BENCH_UTIL_H

#include <stdint.h>

static uint64_t bench_rng = 0x2545F4914F6CDD1Dull; /* the state; a program may reseed it */

static inline uint64_t bench_rnd(void) {
    bench_rng ^= bench_rng << 13;
    bench_rng ^= bench_rng >> 7;
    bench_rng ^= bench_rng << 17;
    return bench_rng;
}

#endif
