/* common/kernels/ops_avx2.c: AVX2+FMA backend of the layer operators (see
 * ops_isa.h). A 16-lane vector is two ymm (lanes 0-7, 8-15), 8 double lanes
 * two ymm of 4; the algorithms are the shared text of ops_vec.h. Compiled
 * without -mavx2: every function carries target("avx2,fma") and is reached
 * only through k3_ops() after cpuid said yes.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/kernels/lane_tree.h"
#include "common/kernels/ops_isa.h"

#define OPS_FN  __attribute__((target("avx2,fma")))
#define OPS_INL static inline __attribute__((target("avx2,fma"), always_inline))

#define OPS_NAME(x) y_##x
#define OPS_TABLE   k3_ops_avx2
#define OPS_LEVEL   K3_ISA_AVX2
#define OPS_NB      4 /* 64 value columns: 8 ymm accumulators of 16 */
#define OPS_RC_TT   2 /* rows_comb: 2 tokens x 32 columns = 8 ymm accumulators */
#define OPS_WS_Q    4 /* wsum_multi: 4 heads x 16 columns = 8 ymm accumulators */
#define OPS_WS_NV   1
#define OPS_RC_NV   2

typedef struct {
    __m256 lo, hi;
} vf;
typedef struct {
    __m256 lo, hi; /* all-ones lanes where true */
} vm;
typedef struct {
    __m256d lo, hi;
} vd;

#define VF2(op, a, b) ((vf){op((a).lo, (b).lo), op((a).hi, (b).hi)})

/* lane i of the mask vector is -1 where i < n (n clamped to 0..8) */
OPS_INL __m256i mask8(int n) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    n = n < 0 ? 0 : n > 8 ? 8 : n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
}

OPS_INL vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
OPS_INL vf vf_set1(float a) { return (vf){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
OPS_INL vf vf_load(const float *p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
OPS_INL vf vf_loadn(const float *p, int n) {
    return (vf){_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8))};
}
OPS_INL void vf_store(float *p, vf a) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
}
OPS_INL void vf_storen(float *p, vf a, int n) {
    _mm256_maskstore_ps(p, mask8(n), a.lo);
    _mm256_maskstore_ps(p + 8, mask8(n - 8), a.hi);
}
OPS_INL void vf_lanes(float *l, vf a) { vf_store(l, a); }
OPS_INL vf vf_add(vf a, vf b) { return VF2(_mm256_add_ps, a, b); }
OPS_INL vf vf_sub(vf a, vf b) { return VF2(_mm256_sub_ps, a, b); }
OPS_INL vf vf_mul(vf a, vf b) { return VF2(_mm256_mul_ps, a, b); }
OPS_INL vf vf_div(vf a, vf b) { return VF2(_mm256_div_ps, a, b); }
OPS_INL vf vf_fma(vf a, vf b, vf c) {
    return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
/* maxps / minps: a > b ? a : b and a < b ? a : b (the second operand on NaN) */
OPS_INL vf vf_max(vf a, vf b) { return VF2(_mm256_max_ps, a, b); }
OPS_INL vf vf_min(vf a, vf b) { return VF2(_mm256_min_ps, a, b); }
OPS_INL vf vf_rint(vf a) {
    return (vf){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
OPS_INL vf vf_trunc(vf a) {
    return (vf){_mm256_round_ps(a.lo, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                _mm256_round_ps(a.hi, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC)};
}
OPS_INL vf vf_abs(vf a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    return (vf){_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
OPS_INL vf vf_neg(vf a) {
    const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    return (vf){_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
OPS_INL vf vf_copysign(vf mag, vf sgn) {
    const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    return (vf){_mm256_or_ps(_mm256_andnot_ps(s, mag.lo), _mm256_and_ps(s, sgn.lo)),
                _mm256_or_ps(_mm256_andnot_ps(s, mag.hi), _mm256_and_ps(s, sgn.hi))};
}
OPS_INL __m256 pow2i8(__m256 k) {
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
/* 2^k for integral k in [-126, 127]: k + 127 in the exponent field */
OPS_INL vf vf_pow2i(vf k) { return (vf){pow2i8(k.lo), pow2i8(k.hi)}; }
OPS_INL vm vf_isnan(vf a) {
    return (vm){_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
OPS_INL vf vf_blend(vm m, vf t, vf f) {
    return (vf){_mm256_blendv_ps(f.lo, t.lo, m.lo), _mm256_blendv_ps(f.hi, t.hi, m.hi)};
}

/* the scalar lane tree (common/kernels/lane_tree.h) */
OPS_INL float vf_hsum(vf a) { return k3_lane_tree8x2(a.lo, a.hi); }

OPS_INL __m256 dec_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
OPS_INL vf vf_dec_i8(const int8_t *p) { return (vf){dec_i8x8(p), dec_i8x8(p + 8)}; }
/* a tail row end: the n bytes through a zeroed copy (never past the row) */
OPS_INL vf vf_dec_i8n(const int8_t *p, int n) {
    int8_t b[16] = {0};
    memcpy(b, p, (size_t)n);
    return vf_dec_i8(b);
}
/* 16 packed bytes -> nib - 8 of the low nibbles (columns 2k) and the high
 * nibbles (2k+1), lanes 0-7 from bytes 0-7, 8-15 from bytes 8-15; exact */
OPS_INL void nib8(__m128i b8, __m256 *ev, __m256 *od) {
    const __m256i w = _mm256_cvtepu8_epi32(b8), eight = _mm256_set1_epi32(8);
    *ev = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(w, _mm256_set1_epi32(15)), eight));
    *od = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(w, 4), eight));
}
OPS_INL void vf_dec_nib(const uint8_t *p, vf *ev, vf *od) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    nib8(b, &ev->lo, &od->lo);
    nib8(_mm_srli_si128(b, 8), &ev->hi, &od->hi);
}
/* out[2k] = ev[k], out[2k+1] = od[k] for 8 lanes */
OPS_INL void ilv8(float *out, __m256 ev, __m256 od) {
    const __m256 a = _mm256_unpacklo_ps(ev, od), b = _mm256_unpackhi_ps(ev, od);
    _mm256_storeu_ps(out, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(a, b, 0x31));
}
OPS_INL void vf_store_ilv(float *out, vf ev, vf od) {
    ilv8(out, ev.lo, od.lo);
    ilv8(out + 16, ev.hi, od.hi);
}

/* within each 128-bit lane (a group of 4): lane i takes lane (i + r) % 4 */
OPS_INL vf vf_rot4_1(vf v) {
    return (vf){_mm256_permute_ps(v.lo, _MM_SHUFFLE(0, 3, 2, 1)),
                _mm256_permute_ps(v.hi, _MM_SHUFFLE(0, 3, 2, 1))};
}
OPS_INL vf vf_rot4_2(vf v) {
    return (vf){_mm256_permute_ps(v.lo, _MM_SHUFFLE(1, 0, 3, 2)),
                _mm256_permute_ps(v.hi, _MM_SHUFFLE(1, 0, 3, 2))};
}
OPS_INL vf vf_rot4_3(vf v) {
    return (vf){_mm256_permute_ps(v.lo, _MM_SHUFFLE(2, 1, 0, 3)),
                _mm256_permute_ps(v.hi, _MM_SHUFFLE(2, 1, 0, 3))};
}
/* per group k: [v1 v2 v3 u4[k]] */
OPS_INL vf vf_shift4_insert(vf v, const float *u4) {
    const __m256 u = _mm256_castps128_ps256(_mm_loadu_ps(u4));
    const __m256 ulo = _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
    const __m256 uhi = _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3));
    const vf r = vf_rot4_1(v);
    return (vf){_mm256_blend_ps(r.lo, ulo, 0x88), _mm256_blend_ps(r.hi, uhi, 0x88)};
}

OPS_INL vd vd_zero(void) { return (vd){_mm256_setzero_pd(), _mm256_setzero_pd()}; }
OPS_INL vd vd_from_f8(const float *p) {
    return (vd){_mm256_cvtps_pd(_mm_loadu_ps(p)), _mm256_cvtps_pd(_mm_loadu_ps(p + 4))};
}
OPS_INL vd vd_add(vd a, vd b) { return (vd){_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
OPS_INL vd vd_mul(vd a, vd b) { return (vd){_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; }
/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
OPS_INL double vd_hsum(vd a) {
    const __m256d t = _mm256_add_pd(a.lo, a.hi);
    const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

#include "common/kernels/ops_vec.h"
