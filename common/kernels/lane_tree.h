/* common/kernels/lane_tree.h: the reductions the vector backends share: the fixed
 * 16-lane float tree every kernel and layer op ends with (kernels.c,
 * "scalar reference kernels"), and the exact sum of a group of 32 int8
 * activations the integer-dot kernels take back. One definition, so the
 * AVX2 and AVX-512 kernels and ops cannot drift apart from each other or
 * from the scalar ones.
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

/* sum of 32 s8 (exact): sign-extend to 16 bits, pairwise to 32, then fold */
static inline __attribute__((target("avx2"), always_inline)) int32_t k3_sum32_s8(__m256i v) {
    const __m256i s16 = _mm256_add_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
    return _mm_cvtsi128_si32(h);
}

#endif
