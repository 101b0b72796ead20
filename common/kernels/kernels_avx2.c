/* common/kernels/kernels_avx2.c: AVX2+FMA backend (see kernels_isa.h).
 *
 * Compiled without -mavx2: every function carries target("avx2,fma") and is
 * only reached through the dispatch table after cpuid said yes.
 *
 * Exact-float kernels follow the scalar 16-lane order of kernels.c bit for
 * bit: lanes 0-7 live in one ymm accumulator (columns 16j+0..7), lanes 8-15
 * in a second one (16j+8..15); vfmadd where the scalar calls fmaf (both
 * round once); the final k3_lane_tree8x2(lo, hi) is the scalar lane tree.
 * MXFP4 uses doubled e2m1 values and 2^(s-127)/2 like the scalar and runs
 * in the nibble order of kernels.c on permuted activations (the decoder
 * never interleaves nibbles); int4 runs in the fixed-point order, its exact
 * integer lane sums from vpmaddubsw / vpmaddwd.
 * Integer-dot kernels keep the float part (acc += isum * f in group order)
 * in lanes that are ROWS, the scalar's operation sequence per row.
 *
 * Tiles (R rows x T tokens) decide only which (row, token) pairs share a
 * weight decode and an activation load; every pair's operations are the
 * ones above, so the bits do not depend on n, the row range or the threads.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/kernels/kernels_isa.h"
#include "common/kernels/lane_tree.h"

#define AVX2_FN  __attribute__((target("avx2,fma")))
#define AVX2_INL static inline __attribute__((target("avx2,fma"), always_inline))
#define UNROLL   _Pragma("GCC unroll 8")

/* Decode (n = 1) streams a block of R consecutive rows at once (R streams,
 * interleaved); the hardware prefetcher alone reaches under half the read
 * bandwidth there. So while a block runs, the same position of the NEXT
 * block (block_bytes ahead: the rows are contiguous) is prefetched into L2,
 * once per cache line of each row. Always inlined with the tiles' target
 * (as a plain static inline the call was dropped; kernels_avx512.c). */
AVX2_INL void pf_next(const void *p, size_t block_bytes) {
    _mm_prefetch((const char *)p + block_bytes, _MM_HINT_T1);
}

/* acc + a*b rounded once: the scalar's fmaf(a, b, acc) */
AVX2_INL __m256 mul_add(__m256 acc, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, acc); }

/* ---- weight decoders: 8 consecutive columns -> 8 floats ---- */

AVX2_INL __m256 dec_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* 16 packed bytes = one MXFP4 group -> 2v(n) as floats in nibble order:
 * w[0] low nibbles of bytes 0-7, w[1] of bytes 8-15, w[2] high nibbles of
 * bytes 0-7, w[3] of bytes 8-15. */
AVX2_INL void dec_mx(const uint8_t *p, __m256 w[4]) {
    const __m128i tab = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m0f = _mm_set1_epi8(15);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i vl = _mm_shuffle_epi8(tab, _mm_and_si128(b, m0f));
    __m128i vh = _mm_shuffle_epi8(tab, _mm_and_si128(_mm_srli_epi16(b, 4), m0f));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vl));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(vl, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(vh));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(vh, 8)));
}

/* Activations into nibble order, per block of 32: [x0 x2 .. x30 | x1 x3 .. x31]. */
static AVX2_FN void perm_nibble_order(const float *x, size_t count, float *xp) {
    for (size_t i = 0; i < count; i += 32) {
        for (int h = 0; h < 2; h++) {
            const __m256 a = _mm256_loadu_ps(x + i + 16 * h),
                         b = _mm256_loadu_ps(x + i + 16 * h + 8);
            const __m256 e = _mm256_shuffle_ps(a, b, 0x88), o = _mm256_shuffle_ps(a, b, 0xDD);
            _mm256_storeu_ps(xp + i + 8 * h,
                             _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
            _mm256_storeu_ps(xp + i + 16 + 8 * h,
                             _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
        }
    }
}

/* ---- tiles: R rows from row r x T tokens; out[i*T + j] ---- */

/* f32 (kind 0) or int8 (kind 1) rows; int8 results are before the row scale */
AVX2_INL void dense_tile(int kind, const k3_qmat *m, int r, const float *x, float *out, int R,
                         int T) {
    const int cols = m->cols;
    const float *wf = kind == 0 ? m->w + (size_t)r * cols : NULL;
    const int8_t *wq = kind == 1 ? m->q8 + (size_t)r * cols : NULL;
    __m256 a0[4][4], a1[4][4];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) {
        a0[i][j] = _mm256_setzero_ps();
        a1[i][j] = _mm256_setzero_ps();
    }
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m256 w[4];
        /* streaming (decode, n <= 4: one token tile per row block): one
         * prefetch per row per cache line */
        UNROLL for (int i = 0; i < R; i++) {
            if (kind == 0)
                pf_next(wf + (size_t)i * cols + c, (size_t)R * cols * 4);
            else if ((c & 63) == 0)
                pf_next(wq + (size_t)i * cols + c, (size_t)R * cols);
        }
        UNROLL for (int i = 0; i < R; i++) w[i] = kind == 0
                                                      ? _mm256_loadu_ps(wf + (size_t)i * cols + c)
                                                      : dec_i8(wq + (size_t)i * cols + c);
        UNROLL for (int j = 0; j < T; j++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)j * cols + c);
            UNROLL for (int i = 0; i < R; i++) a0[i][j] = mul_add(a0[i][j], w[i], xv);
        }
        UNROLL for (int i = 0; i < R; i++) w[i] =
            kind == 0 ? _mm256_loadu_ps(wf + (size_t)i * cols + c + 8)
                      : dec_i8(wq + (size_t)i * cols + c + 8);
        UNROLL for (int j = 0; j < T; j++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)j * cols + c + 8);
            UNROLL for (int i = 0; i < R; i++) a1[i][j] = mul_add(a1[i][j], w[i], xv);
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) {
        float s = k3_lane_tree8x2(a0[i][j], a1[i][j]);
        for (int cc = c; cc < cols; cc++) {
            const float wv =
                kind == 0 ? wf[(size_t)i * cols + cc] : (float)wq[(size_t)i * cols + cc];
            s = fmaf(wv, x[(size_t)j * cols + cc], s);
        }
        out[i * T + j] = s;
    }
}

/* 32 packed bytes of one row (a pair of MXFP4 groups, or half an int4
 * block): u of the low nibbles (even columns) and of the high nibbles (odd
 * columns); MX through the 2v + 12 table, I4 the nibble itself. */
AVX2_INL void xk_dec2(int kind, const uint8_t *p, __m256i *lo, __m256i *hi) {
    const __m256i tab = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_and_si256(b, m15);
    *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
    if (kind == K3_IK_MX) {
        *lo = _mm256_shuffle_epi8(tab, *lo);
        *hi = _mm256_shuffle_epi8(tab, *hi);
    }
}

/* int4-g64 in the fixed-point order (kernels.c; x as k3_i4x_block): lanes
 * 0-7 (h = 0) and 8-15 (h = 1) are two ymm, each one 32-byte load per block
 * of 128 columns split into low and high nibbles (u8). Digit p's partial
 * sum Pp is vpmaddubsw with the even and with the odd columns' digits
 * (words <= 2 * 15 * 128 each, so no saturation), added, then vpmaddwd by
 * ones into the dword lanes; the lane's exact sum c + P0 + 2^8 P1 + 2^16 P2,
 * then acc = fma(float(sum) * 2^E, the group scale, acc). */
AVX2_INL void i4_tile(const k3_qmat *m, int r, const float *x, float *out, int R, int T) {
    const int cols = m->cols, ng = cols / 64;
    const size_t ldp = (size_t)cols / 2, nb = k3_i4_xblocks(cols);
    const uint8_t *qb = m->q4 + (size_t)r * ldp;
    const float *sb = m->scales + (size_t)r * ng;
    const k3_i4x_block *xb = (const k3_i4x_block *)x;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[2][4][4];
    UNROLL for (int h = 0; h < 2; h++) UNROLL for (int i = 0; i < R; i++)
        UNROLL for (int j = 0; j < T; j++) a[h][i][j] = _mm256_setzero_ps();
    for (int g = 0; g < ng; g += 2) {
        UNROLL for (int i = 0; i < R; i++) {
            pf_next(qb + (size_t)i * ldp + (size_t)g * 32, (size_t)R * ldp);
            /* the next block's group scales, once per cache line of each row */
            if ((g & 15) == 0) pf_next(sb + (size_t)i * ng + g, (size_t)R * ng * sizeof(float));
        }
        UNROLL for (int h = 0; h < 2; h++) {
            if (h == 1 && g + 1 >= ng) break; /* a lone last group: lanes 0-7 only */
            __m256i lo[4], hi[4];
            UNROLL for (int i = 0; i < R; i++) {
                xk_dec2(K3_IK_I4, qb + (size_t)i * ldp + (size_t)g * 32 + 32 * h, &lo[i], &hi[i]);
            }
            UNROLL for (int j = 0; j < T; j++) {
                const k3_i4x_block *b = xb + (size_t)j * nb + g / 2;
                const __m256i c = _mm256_load_si256((const __m256i *)(b->c + 8 * h));
                const __m256 e = _mm256_load_ps(b->e + 8 * h);
                UNROLL for (int i = 0; i < R; i++) {
                    __m256i p[3];
                    UNROLL for (int q = 0; q < 3; q++) p[q] = _mm256_madd_epi16(
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(
                                lo[i], _mm256_load_si256((const __m256i *)(b->d[q][0] + 32 * h))),
                            _mm256_maddubs_epi16(
                                hi[i], _mm256_load_si256((const __m256i *)(b->d[q][1] + 32 * h)))),
                        ones);
                    const __m256i s = _mm256_add_epi32(
                        _mm256_add_epi32(c, p[0]),
                        _mm256_add_epi32(_mm256_slli_epi32(p[1], 8), _mm256_slli_epi32(p[2], 16)));
                    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(s), e);
                    a[h][i][j] =
                        mul_add(a[h][i][j], v, _mm256_broadcast_ss(sb + (size_t)i * ng + g + h));
                }
            }
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) out[i * T + j] =
        k3_lane_tree8x2(a[0][i][j], a[1][i][j]);
}

/* MXFP4 exact-float in nibble order (x permuted): gs = v(2k) x(2k), then
 * fma with the high nibble, then acc = fma(gs, 2^(s-127)/2, acc). */
AVX2_INL void mx_tile(const k3_mxfp4 *m, int r, const float *x, float *out, int R, int T) {
    const int cols = m->cols, ng = cols / 32;
    const uint8_t *pb = m->packed + (size_t)r * (cols / 2);
    const uint8_t *sb = m->scale + (size_t)r * ng;
    __m256 a0[4][4], a1[4][4];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) {
        a0[i][j] = _mm256_setzero_ps();
        a1[i][j] = _mm256_setzero_ps();
    }
    for (int g = 0; g < ng; g++) {
        __m256 w[4][4], f[4];
        if ((g & 3) == 0)
            UNROLL for (int i = 0; i < R; i++)
                pf_next(pb + (size_t)i * (cols / 2) + g * 16, (size_t)R * (cols / 2));
        UNROLL for (int i = 0; i < R; i++) {
            dec_mx(pb + (size_t)i * (cols / 2) + g * 16, w[i]);
            f[i] = _mm256_broadcast_ss(&k3_e8m0_half[sb[(size_t)i * ng + g]]);
        }
        UNROLL for (int j = 0; j < T; j++) {
            const float *xg = x + (size_t)j * cols + g * 32;
            const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            UNROLL for (int i = 0; i < R; i++) {
                const __m256 s0 = mul_add(_mm256_mul_ps(w[i][0], x0), w[i][2], x2);
                const __m256 s1 = mul_add(_mm256_mul_ps(w[i][1], x1), w[i][3], x3);
                a0[i][j] = mul_add(a0[i][j], s0, f[i]);
                a1[i][j] = mul_add(a1[i][j], s1, f[i]);
            }
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) out[i * T + j] =
        k3_lane_tree8x2(a0[i][j], a1[i][j]);
}

/* The tile table k3_tiles_run (kernels_isa.h) walks: one out-of-line
 * function per (kind, R, T), compiled with R and T constant so the
 * accumulators stay in registers; the 10 shapes with R x T <= 6, the
 * others NULL. */
#define TILE_FNS(NAME, CALL)                                                                       \
    TILE_FN(NAME, CALL, 1, 1)                                                                      \
    TILE_FN(NAME, CALL, 1, 2)                                                                      \
    TILE_FN(NAME, CALL, 1, 3)                                                                      \
    TILE_FN(NAME, CALL, 1, 4)                                                                      \
    TILE_FN(NAME, CALL, 2, 1)                                                                      \
    TILE_FN(NAME, CALL, 2, 2)                                                                      \
    TILE_FN(NAME, CALL, 2, 3)                                                                      \
    TILE_FN(NAME, CALL, 3, 1)                                                                      \
    TILE_FN(NAME, CALL, 3, 2)                                                                      \
    TILE_FN(NAME, CALL, 4, 1)                                                                      \
    static const k3_tile_fn NAME##_fns[4][4] = {                                                   \
        {NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4},                                          \
        {NAME##_2_1, NAME##_2_2, NAME##_2_3, NULL},                                                \
        {NAME##_3_1, NAME##_3_2, NULL, NULL},                                                      \
        {NAME##_4_1, NULL, NULL, NULL},                                                            \
    };
#define TILE_FN(NAME, CALL, R, T)                                                                  \
    static AVX2_FN void NAME##_##R##_##T(const void *mat, int r, const float *x, float *out) {     \
        CALL(R, T);                                                                                \
    }
#define CALL_F32(R, T) dense_tile(0, mat, r, x, out, R, T)
#define CALL_I8(R, T)  dense_tile(1, mat, r, x, out, R, T)
#define CALL_I4(R, T)  i4_tile(mat, r, x, out, R, T)
#define CALL_MX(R, T)  mx_tile(mat, r, x, out, R, T)
TILE_FNS(tf32, CALL_F32)
TILE_FNS(ti8, CALL_I8)
TILE_FNS(ti4, CALL_I4)
TILE_FNS(tmx, CALL_MX)
#undef TILE_FN

static void avx2_f32_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_tiles_run(tf32_fns, n == 1 ? 4 : 2, n == 1 ? 1 : 3, m, m->rows, m->cols, x, n, y, r0, r1,
                 NULL);
}

static void avx2_i8_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_tiles_run(ti8_fns, n == 1 ? 4 : 2, n == 1 ? 1 : 3, m, m->rows, m->cols, x, n, y, r0, r1,
                 m->scales);
}

/* The fixed-point lane scaling of kernels.c per dword, from mb = the bits
 * of the lane's max|x| (kernels_avx512.c z_lane_scale, with blends for
 * masks); bad: all ones in inf / NaN lanes. */
AVX2_INL void lane_scale(__m256i mb, __m256 *pre, __m256 *inv, __m256 *e2, __m256i *bad) {
    *bad = _mm256_cmpgt_epi32(mb, _mm256_set1_epi32(0x7F7FFFFF)); /* |x| bits: signed is fine */
    const __m256i biased = _mm256_srli_epi32(mb, 23);
    const __m256 m64 = _mm256_mul_ps(_mm256_castsi256_ps(mb), _mm256_set1_ps(0x1p64f));
    const __m256i ex = _mm256_blendv_epi8(
        _mm256_sub_epi32(biased, _mm256_set1_epi32(126)),
        _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(m64), 23), _mm256_set1_epi32(190)),
        _mm256_cmpeq_epi32(biased, _mm256_setzero_si256()));
    const __m256i E =
        _mm256_max_epi32(_mm256_sub_epi32(ex, _mm256_set1_epi32(22)), _mm256_set1_epi32(-149));
    const __m256i k = _mm256_sub_epi32(_mm256_setzero_si256(), E); /* -E in [-105, 149] */
    const __m256i two = _mm256_cmpgt_epi32(k, _mm256_set1_epi32(126));
    *pre =
        _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(0x1p64f), _mm256_castsi256_ps(two));
    const __m256i kk = _mm256_sub_epi32(k, _mm256_and_si256(two, _mm256_set1_epi32(64)));
    *inv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(kk, _mm256_set1_epi32(127)), 23));
    const __m256i sub =
        _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(E, _mm256_set1_epi32(149)));
    const __m256i nrm = _mm256_slli_epi32(_mm256_add_epi32(E, _mm256_set1_epi32(127)), 23);
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(-126), E);
    *e2 = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_blendv_epi8(nrm, sub, tiny)),
                           _mm256_set1_ps(NAN), _mm256_castsi256_ps(*bad));
}

/* i4x_group's bytes in ymm: even and odd columns by vshufps +
 * vpermq (four ymm each; a 128-bit half of v[q] and v[4 + q] is one lane's
 * 8 columns), the lane max by max of the |x| bits and two in-lane shuffles,
 * the same products and magic-number rounding, digits by arithmetic shifts
 * (exact: X - d is a multiple of 256), narrowed by two packs and a vpermd
 * (no value saturates: |d| <= 128); each lane's sum of 8 by even + odd and
 * two horizontal adds. */
static AVX2_FN void avx2_i4x_group(const float *x, k3_i4x_block *blk, int h) {
    const __m256i fix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* after the packs */
    __m256 v[8]; /* v[q] even columns 16q..16q+14, v[4+q] odd ones */
    UNROLL for (int q = 0; q < 4; q++) {
        const __m256 a = _mm256_loadu_ps(x + 16 * q), b = _mm256_loadu_ps(x + 16 * q + 8);
        v[q] = _mm256_castpd_ps(
            _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
        v[4 + q] = _mm256_castpd_ps(
            _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
    }
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256 magic = _mm256_set1_ps(0x1.8p23f);
    const __m256i b128 = _mm256_set1_epi32(128), b255 = _mm256_set1_epi32(255);
    __m256i X[8], d[3][8];
    UNROLL for (int q = 0; q < 4; q++) {
        __m256i t = _mm256_max_epu32(_mm256_and_si256(_mm256_castps_si256(v[q]), absm),
                                     _mm256_and_si256(_mm256_castps_si256(v[4 + q]), absm));
        t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0xB1));
        t = _mm256_max_epu32(t, _mm256_shuffle_epi32(t, 0x4E));
        __m256 pre, inv, e2;
        __m256i bad;
        lane_scale(t, &pre, &inv, &e2, &bad);
        blk->e[8 * h + 2 * q] = _mm256_cvtss_f32(e2); /* lanes 2q, 2q+1: dwords 0, 4 */
        blk->e[8 * h + 2 * q + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(e2, 1));
        UNROLL for (int eo = 0; eo < 2; eo++) {
            const int i = q + 4 * eo;
            const __m256 r = _mm256_andnot_ps(_mm256_castsi256_ps(bad),
                                              _mm256_mul_ps(_mm256_mul_ps(v[i], pre), inv));
            X[i] = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(r, magic), magic));
            __m256i u = X[i];
            UNROLL for (int p = 0; p < 3; p++) {
                d[p][i] =
                    p < 2
                        ? _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(u, b128), b255), b128)
                        : u;
                u = _mm256_srai_epi32(_mm256_sub_epi32(u, d[p][i]), 8);
            }
        }
    }
    UNROLL for (int p = 0; p < 3; p++) UNROLL for (int eo = 0; eo < 2; eo++) {
        const __m256i *dq = d[p] + 4 * eo;
        const __m256i b =
            _mm256_packs_epi16(_mm256_packs_epi32(dq[0], dq[1]), _mm256_packs_epi32(dq[2], dq[3]));
        _mm256_storeu_si256((__m256i *)(blk->d[p][eo] + 32 * h),
                            _mm256_permutevar8x32_epi32(b, fix));
    }
    __m256i s[4]; /* s[q] dword i: columns 16q + 2i, +1 */
    UNROLL for (int q = 0; q < 4; q++) s[q] = _mm256_add_epi32(X[q], X[4 + q]);
    const __m256i k8 =
        _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(),
                                       _mm256_slli_epi32(_mm256_permutevar8x32_epi32(k8, fix), 3));
    _mm256_storeu_si256((__m256i *)(blk->c + 8 * h), c);
}

/* int4: one token chunk in the fixed-point order (k3_i4_rows_chunked) */
static void avx2_i4_chunk(const k3_qmat *m, const float *xp, int tn, float *y, int r0, int r1) {
    k3_tiles_run(ti4_fns, tn == 1 ? 3 : 1, tn == 1 ? 1 : 3, m, m->rows, (int)k3_i4_xld(m->cols), xp,
                 tn, y, r0, r1, NULL);
}

static void avx2_i4_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_i4_rows_chunked(m, x, n, y, r0, r1, avx2_i4x_group, avx2_i4_chunk);
}

static void avx2_mx_f32(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1) {
    k3_nibble_rows(tmx_fns, perm_nibble_order, n == 1 ? 2 : 1, n == 1 ? 1 : 4, w, w->rows, w->cols,
                   x, n, y, r0, r1);
}

/* ---- integer-dot: MXFP4 experts and the opt-in dense int8 / int4 ----
 *
 * 8 rows at a time, one int32x8 partial sum per row and token, folded to
 * the 8 row sums of a group by hsum8x8. Weight kinds (zk_* of the AVX-512
 * file are the same three):
 *   MX: u = 2v + 12 in [0, 24] (unsigned, for vpmaddubsw), low nibbles (even
 *       columns) in the low 128-bit lane and high nibbles (odd columns) in
 *       the high lane; the activation group is permuted to match. The +12 is
 *       taken back exactly: isum = sum(u*q) - 12*sum(q). Products pair up to
 *       2*24*127 = 6096 in int16: no saturation.
 *   I4: u = the nibble = w + 8 in [0, 15], same layout, bias 8.
 *   I8: w + 128 would saturate vpmaddubsw's int16 pairs (2*255*127), so
 *       u = |w| and the activations take w's sign (vpsignb): 2*127*127 =
 *       32258 fits; no bias. Columns in order. */

#define MXI8_TC 32  /* tokens per pass (the correction table) */
#define MXI8_GC 256 /* groups per pass (the scale table) */

/* one group of one row -> u (and for I8 the raw weights, the sign source) */
AVX2_INL __m256i xk_dec(int kind, const uint8_t *p, __m256i *raw) {
    if (kind == K3_IK_I8) {
        *raw = _mm256_loadu_si256((const __m256i *)p);
        return _mm256_abs_epi8(*raw);
    }
    const __m256i tab = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    b = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                         _mm256_set1_epi8(15));
    return kind == K3_IK_MX ? _mm256_shuffle_epi8(tab, b) : b;
}

/* Activations for the nibble kinds, per token: each pair of groups (64
 * columns) as [even columns of g | of g+1] [odd of g | of g+1] (xk_dec2's
 * order); a last unpaired group as [even | odd] (xk_dec's). q, out [n][cols]. */
static AVX2_FN void xk_prep(const int8_t *q, int n, int cols, int8_t *out) {
    const __m256i idx = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const int ng = cols / 32;
    for (int t = 0; t < n; t++) {
        const int8_t *qt = q + (size_t)t * cols;
        int8_t *ot = out + (size_t)t * cols;
        for (int g = 0; g < ng; g++) { /* per group [even | odd] */
            const __m256i v =
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(qt + g * 32)), idx);
            _mm256_storeu_si256((__m256i *)(ot + g * 32), _mm256_permute4x64_epi64(v, 0xD8));
        }
        for (int g = 0; g + 1 < ng; g += 2) { /* pairs: exchange the middle halves */
            const __m256i a = _mm256_loadu_si256((const __m256i *)(ot + g * 32));
            const __m256i b = _mm256_loadu_si256((const __m256i *)(ot + g * 32 + 32));
            _mm256_storeu_si256((__m256i *)(ot + g * 32), _mm256_permute2x128_si256(a, b, 0x20));
            _mm256_storeu_si256((__m256i *)(ot + g * 32 + 32),
                                _mm256_permute2x128_si256(a, b, 0x31));
        }
    }
}

/* Eight int32x8 partial sums (one per row) -> one vector of the 8 row sums. */
AVX2_INL __m256i hsum8x8(const __m256i p[8]) {
    __m256i a = _mm256_hadd_epi32(p[0], p[1]), b = _mm256_hadd_epi32(p[2], p[3]);
    __m256i c = _mm256_hadd_epi32(p[4], p[5]), d = _mm256_hadd_epi32(p[6], p[7]);
    __m256i e = _mm256_hadd_epi32(a, b), f = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(e, f, 0x20),
                            _mm256_permute2x128_si256(e, f, 0x31));
}

/* The same when the 128-bit lanes of the partial sums belong to two groups:
 * *g0 = the 8 row sums of the low lanes, *g1 of the high lanes. */
AVX2_INL void hsum8x8_pair(const __m256i p[8], __m256i *g0, __m256i *g1) {
    __m256i a = _mm256_hadd_epi32(p[0], p[1]), b = _mm256_hadd_epi32(p[2], p[3]);
    __m256i c = _mm256_hadd_epi32(p[4], p[5]), d = _mm256_hadd_epi32(p[6], p[7]);
    __m256i e = _mm256_hadd_epi32(a, b), f = _mm256_hadd_epi32(c, d);
    *g0 = _mm256_permute2x128_si256(e, f, 0x20);
    *g1 = _mm256_permute2x128_si256(e, f, 0x31);
}

/* eh[g][i] = 2^(s-127)/2 of rows 0..7 (row stride ld) for groups
 * g0..g0+gn-1: chunks of 8 groups through an 8x8 byte transpose, the bits of
 * k3_e8m0_half (s << 23 as a float, times 0.5). */
AVX2_INL void mxi8_scales8(const uint8_t *scale, size_t ld, int g0, int gn, float *eh) {
    int g = 0;
    for (; g + 8 <= gn; g += 8) {
        __m128i a[8];
        for (int i = 0; i < 8; i++)
            a[i] = _mm_loadl_epi64((const __m128i *)(scale + i * ld + g0 + g));
        const __m128i b0 = _mm_unpacklo_epi8(a[0], a[1]), b1 = _mm_unpacklo_epi8(a[2], a[3]);
        const __m128i b2 = _mm_unpacklo_epi8(a[4], a[5]), b3 = _mm_unpacklo_epi8(a[6], a[7]);
        const __m128i c0 = _mm_unpacklo_epi16(b0, b1), c1 = _mm_unpackhi_epi16(b0, b1);
        const __m128i c2 = _mm_unpacklo_epi16(b2, b3), c3 = _mm_unpackhi_epi16(b2, b3);
        const __m128i d[4] = {_mm_unpacklo_epi32(c0, c2), _mm_unpackhi_epi32(c0, c2),
                              _mm_unpacklo_epi32(c1, c3), _mm_unpackhi_epi32(c1, c3)};
        const __m256 half = _mm256_set1_ps(0.5f);
        for (int k = 0; k < 4; k++) { /* d[k]: groups 2k (low 8 bytes) and 2k+1, rows 0..7 */
            const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu8_epi32(d[k]), 23);
            const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(d[k], 8)), 23);
            _mm256_store_ps(eh + (g + 2 * k) * 8, _mm256_mul_ps(_mm256_castsi256_ps(lo), half));
            _mm256_store_ps(eh + (g + 2 * k + 1) * 8, _mm256_mul_ps(_mm256_castsi256_ps(hi), half));
        }
    }
    for (; g < gn; g++)
        for (int i = 0; i < 8; i++) eh[g * 8 + i] = k3_e8m0_half[scale[i * ld + g0 + g]];
}

/* 8 rows x T tokens over groups [g0, g0+gn). acc starts from y when g0 > 0
 * (the float partial sum stored there is exact), so splitting the groups into
 * passes keeps the group-order accumulation of the scalar kernel. DOT(u, qp)
 * gives the 8 int32 partial sums of one row: vpmaddubsw + vpmaddwd (AVX2)
 * or vpdpbusd on ymm (AVX-512 VL + VNNI, used by that level for small n).
 * pb: the 8 rows' bytes (row stride ldp), gbytes per group; I8 has no group
 * factor (f = sx; the caller applies the row scale) and no correction. */
#define MXI8_TILE_BODY(DOT)                                                                        \
    const int ng = cols / 32;                                                                      \
    const size_t gbytes = kind == K3_IK_I8 ? 32 : 16;                                              \
    __m256 acc[4];                                                                                 \
    UNROLL for (int j = 0; j < T; j++) acc[j] =                                                    \
        g0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + j * ldy);                              \
    int g = 0;                                                                                     \
    /* nibble kinds: groups in pairs, 32 bytes per row at once (xk_prep's pair layout) */          \
    for (; kind != K3_IK_I8 && g + 1 < gn; g += 2) {                                               \
        __m256i ul[8], uh[8];                                                                      \
        const uint8_t *pg = pb + (size_t)(g0 + g) * 16;                                            \
        if (((size_t)(g0 + g) * 16 & 63) == 0)                                                     \
            UNROLL for (int i = 0; i < 8; i++) pf_next(pg + i * ldp, 8 * ldp);                     \
        UNROLL for (int i = 0; i < 8; i++) xk_dec2(kind, pg + i * ldp, &ul[i], &uh[i]);            \
        const __m256 e0 = _mm256_load_ps(eh + g * 8), e1 = _mm256_load_ps(eh + (g + 1) * 8);       \
        UNROLL for (int j = 0; j < T; j++) {                                                       \
            const int8_t *qg = xq + (size_t)j * cols + (size_t)(g0 + g) * 32;                      \
            const __m256i qe = _mm256_loadu_si256((const __m256i *)qg);                            \
            const __m256i qo = _mm256_loadu_si256((const __m256i *)(qg + 32));                     \
            __m256i p[8];                                                                          \
            UNROLL for (int i = 0; i < 8; i++) p[i] = DOT##2(ul[i], qe, uh[i], qo);                \
            __m256i i0, i1;                                                                        \
            hsum8x8_pair(p, &i0, &i1);                                                             \
            i0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(corr[j * ldc + g]));                       \
            i1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(corr[j * ldc + g + 1]));                   \
            const float *sxp = xs + (size_t)j * ng + g0 + g;                                       \
            const __m256 f0 = _mm256_mul_ps(e0, _mm256_broadcast_ss(sxp));                         \
            const __m256 f1 = _mm256_mul_ps(e1, _mm256_broadcast_ss(sxp + 1));                     \
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(i0), f0));             \
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(i1), f1));             \
        }                                                                                          \
    }                                                                                              \
    for (; g < gn; g++) {                                                                          \
        __m256i u[8], w[8];                                                                        \
        const uint8_t *pg = pb + (size_t)(g0 + g) * gbytes;                                        \
        if (((size_t)(g0 + g) * gbytes & 63) == 0)                                                 \
            UNROLL for (int i = 0; i < 8; i++) pf_next(pg + i * ldp, 8 * ldp);                     \
        UNROLL for (int i = 0; i < 8; i++) u[i] = xk_dec(kind, pg + i * ldp, &w[i]);               \
        const __m256 e = kind == K3_IK_I8 ? _mm256_setzero_ps() : _mm256_load_ps(eh + g * 8);      \
        UNROLL for (int j = 0; j < T; j++) {                                                       \
            const int8_t *qg = xq + (size_t)j * cols + (size_t)(g0 + g) * 32;                      \
            const __m256i qp = _mm256_loadu_si256((const __m256i *)qg);                            \
            __m256i p[8];                                                                          \
            UNROLL for (int i = 0; i < 8; i++) p[i] =                                              \
                DOT(u[i], kind == K3_IK_I8 ? _mm256_sign_epi8(qp, w[i]) : qp);                     \
            __m256i isum = hsum8x8(p);                                                             \
            if (kind != K3_IK_I8)                                                                  \
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(corr[j * ldc + g]));               \
            const __m256 sx = _mm256_broadcast_ss(xs + (size_t)j * ng + g0 + g);                   \
            const __m256 f = kind == K3_IK_I8 ? sx : _mm256_mul_ps(e, sx);                         \
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(_mm256_cvtepi32_ps(isum), f));            \
        }                                                                                          \
    }                                                                                              \
    UNROLL for (int j = 0; j < T; j++) _mm256_storeu_ps(y + j * ldy, acc[j]);

#define DOT_AVX2(u, q) _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
#define DOT_VNNI(u, q) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q)
/* two dots into one sum: the int16 pair sums of the nibble kinds add without
 * saturating (2 * 2 * 24 * 127 = 12192) */
#define DOT_AVX22(u, q, v, r)                                                                      \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u, q), _mm256_maddubs_epi16(v, r)),    \
                      _mm256_set1_epi16(1))
#define DOT_VNNI2(u, q, v, r) _mm256_dpbusd_epi32(DOT_VNNI(u, q), v, r)
#define VNNI_FN               __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))

#define MXI8_ARGS                                                                                  \
    const uint8_t *pb, size_t ldp, const float *eh, const int32_t *corr, int ldc,                  \
        const int8_t *xq, const float *xs, int cols, int g0, int gn, float *y, size_t ldy
#define MXI8_TILE_FN(NAME, KIND, TT)                                                               \
    static AVX2_FN void NAME##_##TT(MXI8_ARGS) {                                                   \
        const int T = TT, kind = KIND;                                                             \
        MXI8_TILE_BODY(DOT_AVX2)                                                                   \
    }                                                                                              \
    static VNNI_FN void NAME##v_##TT(MXI8_ARGS) {                                                  \
        const int T = TT, kind = KIND;                                                             \
        MXI8_TILE_BODY(DOT_VNNI)                                                                   \
    }
#define MXI8_TILE_FNS(NAME, KIND)                                                                  \
    MXI8_TILE_FN(NAME, KIND, 1)                                                                    \
    MXI8_TILE_FN(NAME, KIND, 2)                                                                    \
    MXI8_TILE_FN(NAME, KIND, 3)                                                                    \
    MXI8_TILE_FN(NAME, KIND, 4)
MXI8_TILE_FNS(mxi8, K3_IK_MX)
MXI8_TILE_FNS(xki4, K3_IK_I4)
MXI8_TILE_FNS(xki8, K3_IK_I8)

typedef void (*mxi8_fn)(MXI8_ARGS);
/* [kind][vnni][T - 1] */
static const mxi8_fn xk_fns[3][2][4] = {
    {{mxi8_1, mxi8_2, mxi8_3, mxi8_4}, {mxi8v_1, mxi8v_2, mxi8v_3, mxi8v_4}},
    {{xki4_1, xki4_2, xki4_3, xki4_4}, {xki4v_1, xki4v_2, xki4v_3, xki4v_4}},
    {{xki8_1, xki8_2, xki8_3, xki8_4}, {xki8v_1, xki8v_2, xki8v_3, xki8v_4}},
};

/* bias * sum(q) over one group of 32 (exact; bias 12 or 8). */
static AVX2_FN int32_t mxi8_corr(const int8_t *q, int bias) {
    return bias * k3_sum32_s8(_mm256_loadu_si256((const __m256i *)q));
}

static AVX2_FN void mxi8_scales8_fn(const uint8_t *scale, size_t ld, int g0, int gn, float *eh) {
    mxi8_scales8(scale, ld, g0, gn, eh);
}

/* Rows [r0, r8) through the 8-row tiles; returns r8 (the caller computes
 * [r8, r1) with its scalar row). mat: a k3_mxfp4 (K3_IK_MX) or k3_qmat. */
static int xk_rows(int kind, int vnni, const void *mat, const int8_t *xq, const float *xs, int n,
                   float *y, int r0, int r1) {
    const k3_mxfp4 *mx = mat;
    const k3_qmat *qm = mat;
    const k3_ik_view v = k3_ik_view_of(kind, mat);
    const int cols = v.cols, ng = cols / 32, rows = v.rows;
    const size_t ldp = v.ldp;
    const uint8_t *wb = v.w;
    const int r8 = r0 + (r1 - r0) / 8 * 8;
    if (r8 == r0) return r8;
    /* nibble kinds: a token chunk's activations in the decoders' order */
    int8_t *qp = kind != K3_IK_I8 ? k3_kern_scratch((size_t)MXI8_TC * cols) : NULL;
    _Alignas(32) float eh[MXI8_GC * 8]; /* [group][8 rows] group factors */
    int32_t corr[MXI8_TC * MXI8_GC];    /* [token][group] bias * sum(q) */
    for (int t0 = 0; t0 < n; t0 += MXI8_TC) {
        const int tn = n - t0 < MXI8_TC ? n - t0 : MXI8_TC;
        const int8_t *xt = xq + (size_t)t0 * cols; /* the tiles' activations */
        if (qp) {
            xk_prep(xt, tn, cols, qp);
            xt = qp;
        }
        for (int g0 = 0; g0 < ng; g0 += MXI8_GC) {
            const int gn = ng - g0 < MXI8_GC ? ng - g0 : MXI8_GC;
            if (kind != K3_IK_I8)
                for (int j = 0; j < tn; j++)
                    for (int g = 0; g < gn; g++)
                        corr[j * MXI8_GC + g] =
                            mxi8_corr(xq + (size_t)(t0 + j) * cols + (size_t)(g0 + g) * 32,
                                      kind == K3_IK_MX ? 12 : 8);
            for (int r = r0; r < r8; r += 8) {
                /* the next tile's group scales (contiguous rows), read below
                 * one tile later: without it they were demand misses */
                if (kind != K3_IK_I8 && r + 8 < r8) {
                    const size_t sb = kind == K3_IK_MX ? (size_t)ng : (size_t)(ng / 2) * 4;
                    const char *sn = kind == K3_IK_MX
                                         ? (const char *)(mx->scale + (size_t)(r + 8) * ng)
                                         : (const char *)(qm->scales + (size_t)(r + 8) * (ng / 2));
                    for (size_t l = 0; l < 8 * sb; l += 64) _mm_prefetch(sn + l, _MM_HINT_T1);
                }
                if (kind == K3_IK_MX)
                    mxi8_scales8_fn(mx->scale + (size_t)r * ng, (size_t)ng, g0, gn, eh);
                else if (kind == K3_IK_I4)
                    for (int g = 0; g < gn; g++)
                        for (int i = 0; i < 8; i++)
                            eh[g * 8 + i] =
                                qm->scales[(size_t)(r + i) * (cols / 64) + (g0 + g) / 2];
                for (int j = 0; j < tn; j += 4) {
                    const int T = tn - j < 4 ? tn - j : 4;
                    xk_fns[kind][vnni][T - 1](wb + (size_t)r * ldp, ldp, eh, corr + j * MXI8_GC,
                                              MXI8_GC, xt + (size_t)j * cols,
                                              xs + (size_t)(t0 + j) * ng, cols, g0, gn,
                                              y + (size_t)(t0 + j) * rows + r, (size_t)rows);
                }
            }
        }
        if (kind == K3_IK_I8) /* the row scale last, as the scalar row does */
            for (int j = 0; j < tn; j++)
                for (int r = r0; r < r8; r++) y[(size_t)(t0 + j) * rows + r] *= qm->scales[r];
    }
    return r8;
}

static void mx_i8_rows(int vnni, const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n,
                       float *y, int r0, int r1) {
    const int r8 = xk_rows(K3_IK_MX, vnni, w, xq, xs, n, y, r0, r1);
    k3_mx_i8_rows_scalar(w, xq, xs, n, y, r8, r1);
}

static void avx2_mx_i8(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                       int r0, int r1) {
    mx_i8_rows(0, w, xq, xs, n, y, r0, r1);
}

void k3_mx_i8_rows_vnni256(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                           int r0, int r1) {
    mx_i8_rows(1, w, xq, xs, n, y, r0, r1);
}

static void q8_rows(int vnni, const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                    int r0, int r1) {
    const int r8 = xk_rows(m->fmt == K3_QF_I8 ? K3_IK_I8 : K3_IK_I4, vnni, m, xq, xs, n, y, r0, r1);
    k3_q8_rows_scalar(m, xq, xs, n, y, r8, r1);
}

static void avx2_q8_rows(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                         int r0, int r1) {
    q8_rows(0, m, xq, xs, n, y, r0, r1);
}

void k3_q8_rows_vnni256(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                        int r0, int r1) {
    q8_rows(1, m, xq, xs, n, y, r0, r1);
}

/* ---- activation quantization (bit-exact with the scalar one) ---- */

static AVX2_FN void avx2_act_q8(const float *x, int n, int cols, int8_t *q, float *s) {
    const int ng = cols / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int t = 0; t < n; t++) {
        for (int g = 0; g < ng; g++) {
            const float *xg = x + (size_t)t * cols + g * 32;
            __m256 v[4];
            __m256 m = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                v[k] = _mm256_loadu_ps(xg + 8 * k);
                /* new value first: maxps returns the second operand on NaN,
                 * so a NaN input is skipped exactly as in the scalar loop */
                m = _mm256_max_ps(_mm256_and_ps(v[k], absmask), m);
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float sg = _mm_cvtss_f32(h) / 127.0f;
            sg = sg > 1e-20f ? sg : 1e-20f;
            const __m256 inv = _mm256_set1_ps(1.0f / sg);
            __m256i iv[4];
            for (int k = 0; k < 4; k++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(v[k], inv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm256_max_ps(_mm256_min_ps(r, _mm256_set1_ps(127.0f)),
                                  _mm256_set1_ps(-127.0f));
                iv[k] = _mm256_cvtps_epi32(r);
            }
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                           _mm256_packs_epi32(iv[2], iv[3]));
            _mm256_storeu_si256((__m256i *)(q + (size_t)t * cols + g * 32),
                                _mm256_permutevar8x32_epi32(p, perm));
            s[(size_t)t * ng + g] = sg;
        }
    }
}

const k3_kern_ops k3_kern_avx2 = {
    .isa = K3_ISA_AVX2,
    .f32_rows = avx2_f32_rows,
    .i8_rows = avx2_i8_rows,
    .i4_rows = avx2_i4_rows,
    .mx_f32 = avx2_mx_f32,
    .mx_i8 = avx2_mx_i8,
    .q8_rows = avx2_q8_rows,
    .act_q8 = avx2_act_q8,
};
