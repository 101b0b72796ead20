/* common/kernels/ops_avx512.c: AVX-512 backend of the layer operators (see
 * ops_isa.h). One zmm is the 16 lanes of the scalar order; the algorithms
 * are the shared text of ops_vec.h. Compiled without -mavx512*: every
 * function carries the target attribute and is reached only through
 * k3_ops() after cpuid said yes (the same feature set as kernels_avx512.c).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/kernels/lane_tree.h"
#include "common/kernels/ops_isa.h"

#define Z_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
#define OPS_FN   __attribute__((target(Z_TARGET)))
#define OPS_INL  static inline __attribute__((target(Z_TARGET), always_inline))

#define OPS_NAME(x) z_##x
#define OPS_TABLE   k3_ops_avx512
#define OPS_LEVEL   K3_ISA_AVX512
#define OPS_NB      8 /* 128 value columns of u / o in 8 zmm */
#define OPS_RC_TT   4 /* rows_comb: 4 tokens x 64 columns = 16 zmm accumulators */
#define OPS_WS_Q    4 /* wsum_multi: 4 heads x 64 columns = 16 zmm accumulators */
#define OPS_WS_NV   4
#define OPS_RC_NV   4

typedef __m512 vf;
typedef __mmask16 vm;
typedef __m512d vd;

OPS_INL __mmask16 lanes_mask(int n) { return (__mmask16)((1u << n) - 1u); }

OPS_INL vf vf_zero(void) { return _mm512_setzero_ps(); }
OPS_INL vf vf_set1(float a) { return _mm512_set1_ps(a); }
OPS_INL vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
OPS_INL vf vf_loadn(const float *p, int n) { return _mm512_maskz_loadu_ps(lanes_mask(n), p); }
OPS_INL void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
OPS_INL void vf_storen(float *p, vf a, int n) { _mm512_mask_storeu_ps(p, lanes_mask(n), a); }
OPS_INL void vf_lanes(float *l, vf a) { _mm512_storeu_ps(l, a); }
OPS_INL vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
OPS_INL vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
OPS_INL vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
OPS_INL vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
OPS_INL vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
/* maxps / minps: a > b ? a : b and a < b ? a : b (the second operand on NaN) */
OPS_INL vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
OPS_INL vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
OPS_INL vf vf_rint(vf a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
OPS_INL vf vf_trunc(vf a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}
OPS_INL vf vf_abs(vf a) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
}
OPS_INL vf vf_neg(vf a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)));
}
/* |mag| with the sign of sgn (copysignf) */
OPS_INL vf vf_copysign(vf mag, vf sgn) {
    const __m512i s = _mm512_set1_epi32((int)0x80000000u);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(s, _mm512_castps_si512(mag)),
                                               _mm512_and_si512(s, _mm512_castps_si512(sgn))));
}
/* 2^k for integral k in [-126, 127]: k + 127 in the exponent field */
OPS_INL vf vf_pow2i(vf k) {
    const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
OPS_INL vm vf_isnan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
OPS_INL vf vf_blend(vm m, vf t, vf f) { return _mm512_mask_blend_ps(m, f, t); }

/* the scalar lane tree (common/kernels/lane_tree.h) */
OPS_INL float vf_hsum(vf a) { return k3_lane_tree16(a); }

OPS_INL vf vf_dec_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
OPS_INL vf vf_dec_i8n(const int8_t *p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(lanes_mask(n), p)));
}
/* 16 packed bytes -> nib - 8 of the low nibbles (columns 2k) and the high
 * nibbles (2k+1): one 16-entry vpermps table lookup each, exact */
OPS_INL void vf_dec_nib(const uint8_t *p, vf *ev, vf *od) {
    const __m512 tab = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *ev = _mm512_permutexvar_ps(b, tab);
    *od = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
}
OPS_INL void vf_store_ilv(float *out, vf ev, vf od) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(ev, lo, od));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(ev, hi, od));
}

/* within each 128-bit lane (a group of 4): lane i takes lane (i + r) % 4 */
OPS_INL vf vf_rot4_1(vf v) { return _mm512_permute_ps(v, _MM_SHUFFLE(0, 3, 2, 1)); }
OPS_INL vf vf_rot4_2(vf v) { return _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)); }
OPS_INL vf vf_rot4_3(vf v) { return _mm512_permute_ps(v, _MM_SHUFFLE(2, 1, 0, 3)); }
/* per group k: [v1 v2 v3 u4[k]] */
OPS_INL vf vf_shift4_insert(vf v, const float *u4) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512 u = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(u4)));
    return _mm512_mask_blend_ps((__mmask16)0x8888, vf_rot4_1(v), u);
}

OPS_INL vd vd_zero(void) { return _mm512_setzero_pd(); }
OPS_INL vd vd_from_f8(const float *p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
OPS_INL vd vd_add(vd a, vd b) { return _mm512_add_pd(a, b); }
OPS_INL vd vd_mul(vd a, vd b) { return _mm512_mul_pd(a, b); }
/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
OPS_INL double vd_hsum(vd a) {
    const __m256d t = _mm256_add_pd(_mm512_castpd512_pd256(a), _mm512_extractf64x4_pd(a, 1));
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

#include "common/kernels/ops_vec.h"
