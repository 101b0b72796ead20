/* common/lane_tree.h: the fixed 16-lane reduction every kernel and layer op
 * ends with (kernels.c, "scalar reference kernels"), for the vector
 * backends: one definition, so the AVX2 and AVX-512 kernels and ops cannot
 * drift apart from each other or from the scalar tree.
 *
 * Owns nothing; include only from the *_avx2.c / *_avx512.c backends (the
 * functions carry their own target attributes and inline into callers
 * whose targets include them). Any thread.
 */
#ifndef K3_LANE_TREE_H
#define K3_LANE_TREE_H

#include <immintrin.h>

/* lanes 0-7 in lo, 8-15 in hi: t = lo + hi,
 * ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)) */
static inline __attribute__((target("avx2"), always_inline)) float k3_lane_tree8x2(__m256 lo,
                                                                                   __m256 hi) {
    __m256 v = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the same tree over the 16 lanes of one zmm */
static inline __attribute__((target("avx512f,avx2"), always_inline)) float
k3_lane_tree16(__m512 a) {
    return k3_lane_tree8x2(_mm512_castps512_ps256(a),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

#endif
