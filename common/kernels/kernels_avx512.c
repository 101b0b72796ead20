/* common/kernels/kernels_avx512.c: AVX-512 backend (F, BW, VL, DQ, VNNI; see
 * kernels_isa.h). Compiled without -mavx512*: every function carries the
 * target attribute and is reached only through the dispatch table after
 * cpuid said yes.
 *
 * Exact-float kernels: one zmm accumulator per (row, token) is exactly the
 * 16 lanes of the scalar order (kernels.c); vfmadd where the scalar calls
 * fmaf (both round once); the final reduction adds the two 256-bit halves
 * and runs the scalar lane tree. MXFP4 weights are decoded to floats by
 * 16-entry vpermps table lookups; int4 runs in the fixed-point order, its
 * exact integer lane sums from vpdpbusd.
 *
 * Integer-dot (MXFP4 experts, and the opt-in dense int8 / int4): 16 rows at
 * a time with ROWS in the 32-bit lanes, so the group's integer sum lands in
 * a row lane directly (no horizontal sums) and the float part is the
 * scalar's operation sequence per row. Per group, the 16 rows' weights are
 * decoded to u8 (w + bias) and transposed into 8 vectors of 4 columns x 16
 * rows; each token's signed activations enter as the {1to16} broadcast
 * memory operand of vpdpbusd (inline asm: GCC does not fold it), and
 * bias * sum(q), precomputed per (token, group), is the sum's start value.
 * Below ZI8_MIN_N tokens the transpose costs more than it saves for the
 * nibble kinds: they run zv_tile (rows through the reduction instead). int8
 * runs this kernel at every n: at n = 1 its 16 row streams read from RAM
 * 1.05-1.13x as fast as the 8-row ymm kernel of kernels_avx2.c on 1 thread
 * and 1.00-1.16x on 2, which it replaced there on 2026-12-03 (Intel Xeon;
 * in L3 it is 0.96x; docs/PERFORMANCE.md, issue 21, seventh session).
 *
 * On the AMD EPYC this was tuned on, 8 independent zmm vpdpbusd chains
 * retire 3.6 G/s per core and 8 vfmadd231ps chains a quarter of that in
 * multiply-adds (bench_kernels prints both), so the integer paths win by
 * needing fewer instructions per weight, not by width alone.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "common/kernels/kernels_isa.h"
#include "common/kernels/lane_tree.h"

#define Z_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"
#define Z_FN     __attribute__((target(Z_TARGET)))
#define Z_INL    static inline __attribute__((target(Z_TARGET), always_inline))
#define UNROLL   _Pragma("GCC unroll 16")

/* Decode (n = 1) streams a block of R consecutive rows at once (R streams,
 * interleaved); the hardware prefetcher alone reaches under half the read
 * bandwidth there. So while a block runs, the same position of the NEXT
 * block (block_bytes ahead: the rows are contiguous) is prefetched into L2,
 * once per cache line of each row. Always inlined with the tiles' target:
 * as a plain static inline, GCC did not inline it into them and then
 * dropped the call as free of side effects, so no prefetch was issued. */
Z_INL void pf_next(const void *p, size_t block_bytes) {
    _mm_prefetch((const char *)p + block_bytes, _MM_HINT_T1);
}

/* acc + a*b rounded once: the scalar's fmaf(a, b, acc) */
Z_INL __m512 mul_add(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }

/* ---- weight decoders: 16 consecutive columns -> 16 floats ---- */

Z_INL __m512 dec_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 16 packed bytes (a block of 32 columns) -> bytes in dword lanes; the low
 * nibbles (columns 2k) and high nibbles (2k+1) are then one 16-entry table
 * lookup each (vpermps reads the low 4 bits of the index). */
Z_INL void dec_nib(const uint8_t *p, __m512 tab, __m512 *ev, __m512 *od) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *ev = _mm512_permutexvar_ps(b, tab);
    *od = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
}

/* vpermb (AVX-512 VBMI): tab's byte idx & 63 for each byte, as inline asm
 * so that this file keeps one target; run only where k3_kern_vbmi says so */
Z_INL __m512i permb(__m512i idx, __m512i tab) {
    __m512i r;
    __asm__("vpermb %2, %1, %0" : "=v"(r) : "v"(idx), "v"(tab));
    return r;
}

/* 64 packed bytes -> u of the low nibbles (even columns) and high nibbles,
 * each byte's u = tab[nibble] for MX (mx_u_tab), the nibble itself for I4
 * (vbmi: tab must be the identity for I4) */
Z_INL void dec_u8(int kind, int vbmi, __m512i b, __m512i tab, __m512i *lo, __m512i *hi) {
    const __m512i s = _mm512_srli_epi16(b, 4); /* each byte's high nibble in bits 0-3 */
    if (vbmi) {
        *lo = permb(b, tab);
        *hi = permb(s, tab);
        return;
    }
    const __m512i m15 = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(b, m15);
    *hi = _mm512_and_si512(s, m15);
    if (kind == K3_IK_MX) {
        *lo = _mm512_shuffle_epi8(tab, *lo);
        *hi = _mm512_shuffle_epi8(tab, *hi);
    }
}

/* MXFP4 u = 2v + 12 for each nibble, in every 128-bit lane */
Z_INL __m512i mx_u_tab(void) {
    return _mm512_broadcast_i32x4(
        _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

/* Activations into nibble order, per block of 32: [x0 x2 .. x30 | x1 x3 .. x31]. */
static Z_FN void perm_nibble_order(const float *x, size_t count, float *xp) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (size_t i = 0; i < count; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_ps(xp + i, _mm512_permutex2var_ps(a, ev, b));
        _mm512_storeu_ps(xp + i + 16, _mm512_permutex2var_ps(a, od, b));
    }
}

/* ---- tiles: R rows from row r x T tokens; out[i*T + j] ---- */

/* f32 (kind 0) or int8 (kind 1) rows; int8 results are before the row scale */
Z_INL void dense_tile(int kind, const k3_qmat *m, int r, const float *x, float *out, int R, int T) {
    const int cols = m->cols;
    const float *wf = kind == 0 ? m->w + (size_t)r * cols : NULL;
    const int8_t *wq = kind == 1 ? m->q8 + (size_t)r * cols : NULL;
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) acc[i][j] =
        _mm512_setzero_ps();
    int c = 0;
    for (; c + 16 <= cols; c += 16) {
        __m512 w[4];
        /* streaming (decode, n <= 4: one token tile per row block): one
         * prefetch per row per cache line, int8 the next block (as the
         * AVX2 level; two blocks ahead measured 3-5 % slower from RAM,
         * issue 21) */
        UNROLL for (int i = 0; i < R; i++) {
            if (kind == 0)
                pf_next(wf + (size_t)i * cols + c, (size_t)R * cols * 4);
            else if ((c & 63) == 0)
                pf_next(wq + (size_t)i * cols + c, (size_t)R * cols);
        }
        UNROLL for (int i = 0; i < R; i++) w[i] = kind == 0
                                                      ? _mm512_loadu_ps(wf + (size_t)i * cols + c)
                                                      : dec_i8(wq + (size_t)i * cols + c);
        UNROLL for (int j = 0; j < T; j++) {
            const __m512 xv = _mm512_loadu_ps(x + (size_t)j * cols + c);
            UNROLL for (int i = 0; i < R; i++) acc[i][j] = mul_add(acc[i][j], w[i], xv);
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) {
        float s = k3_lane_tree16(acc[i][j]);
        for (int cc = c; cc < cols; cc++) {
            const float wv =
                kind == 0 ? wf[(size_t)i * cols + cc] : (float)wq[(size_t)i * cols + cc];
            s = fmaf(wv, x[(size_t)j * cols + cc], s);
        }
        out[i * T + j] = s;
    }
}

/* int4-g64 in the fixed-point order (kernels.c; x as k3_i4x_block blocks,
 * k3_i4_xld(cols) "floats" per token). Per block of 128 columns one 64-byte
 * load per row, split into its low and high nibbles (u8). Lane k's exact
 * integer sum is c + P0 + 2^8 (P1 + 2^8 P2), each Pp two vpdpbusd with
 * digit p of the even and the odd columns (P1 starts from 2^8 P2: one add
 * fewer, ~3 % in L2). Then acc = fma(float(sum) * 2^E, scale, acc) with the
 * scales [group 2h x 8 | group 2h+1 x 8]. The token's six digit vectors
 * stay in registers across the tile's rows (as memory operands they made
 * the loads the bound). */
Z_INL void i4_tile(const k3_qmat *m, int r, const float *x, float *out, int R, int T) {
    const int cols = m->cols, ng = cols / 64;
    const size_t ldp = (size_t)cols / 2, nb = k3_i4_xblocks(cols);
    const uint8_t *qb = m->q4 + (size_t)r * ldp;
    const float *sb = m->scales + (size_t)r * ng;
    const k3_i4x_block *xb = (const k3_i4x_block *)x;
    const __m512i sidx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) acc[i][j] =
        _mm512_setzero_ps();
    for (int g = 0; g < ng; g += 2) {
        const int two = g + 1 < ng; /* else a lone last group: lanes 0-7 */
        __m512i lo[4], hi[4];
        __m512 sv[4];
        UNROLL for (int i = 0; i < R; i++) {
            const uint8_t *p = qb + (size_t)i * ldp + (size_t)g * 32;
            pf_next(p, (size_t)R * ldp);
            const __m512i w = two ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(0x00FF, p);
            dec_u8(K3_IK_I4, 0, w, _mm512_setzero_si512(), &lo[i], &hi[i]); /* no table */
            const float *s = sb + (size_t)i * ng + g;
            /* the next block's group scales, once per cache line of each
             * row: without it they were demand misses (1.11-1.17x, issue 21) */
            if ((g & 15) == 0) pf_next(s, (size_t)R * ng * sizeof(float));
            sv[i] = two ? _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_castsi128_ps(
                                                          _mm_loadl_epi64((const __m128i *)s))))
                        : _mm512_set1_ps(s[0]);
        }
        UNROLL for (int j = 0; j < T; j++) {
            const k3_i4x_block *b = xb + (size_t)j * nb + g / 2;
            __m512i d00 = _mm512_load_si512(b->d[0][0]), d01 = _mm512_load_si512(b->d[0][1]);
            __m512i d10 = _mm512_load_si512(b->d[1][0]), d11 = _mm512_load_si512(b->d[1][1]);
            __m512i d20 = _mm512_load_si512(b->d[2][0]), d21 = _mm512_load_si512(b->d[2][1]);
            __asm__("" : "+v"(d00), "+v"(d01), "+v"(d10), "+v"(d11), "+v"(d20), "+v"(d21));
            const __m512i c = _mm512_load_si512(b->c);
            const __m512 e = _mm512_load_ps(b->e);
            UNROLL for (int i = 0; i < R; i++) {
                const __m512i p0 =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, lo[i], d00), hi[i], d01);
                const __m512i p2 = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], d20), hi[i], d21);
                const __m512i p12 =
                    _mm512_dpbusd_epi32(/* 2^8 P2 + P1 */
                                        _mm512_dpbusd_epi32(_mm512_slli_epi32(p2, 8), lo[i], d10),
                                        hi[i], d11);
                const __m512i a = _mm512_add_epi32(p0, _mm512_slli_epi32(p12, 8));
                const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(a), e);
                acc[i][j] = two ? mul_add(acc[i][j], v, sv[i])
                                : _mm512_mask3_fmadd_ps(v, sv[i], acc[i][j], 0x00FF);
            }
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) out[i * T + j] =
        k3_lane_tree16(acc[i][j]);
}

/* MXFP4 exact-float in nibble order (x permuted): gs = v(2k) x(2k), fma with
 * the high nibble, then acc = fma(gs, 2^(s-127)/2, acc). */
Z_INL void mx_tile(const k3_mxfp4 *m, int r, const float *x, float *out, int R, int T) {
    const int cols = m->cols, ng = cols / 32;
    const uint8_t *pb = m->packed + (size_t)r * (cols / 2);
    const uint8_t *sb = m->scale + (size_t)r * ng;
    const __m512 tab = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    __m512 acc[4][4];
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) acc[i][j] =
        _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512 ev[4], od[4], f[4];
        if ((g & 3) == 0)
            UNROLL for (int i = 0; i < R; i++)
                pf_next(pb + (size_t)i * (cols / 2) + g * 16, (size_t)R * (cols / 2));
        UNROLL for (int i = 0; i < R; i++) {
            dec_nib(pb + (size_t)i * (cols / 2) + g * 16, tab, &ev[i], &od[i]);
            f[i] = _mm512_set1_ps(k3_e8m0_half[sb[(size_t)i * ng + g]]);
        }
        UNROLL for (int j = 0; j < T; j++) {
            const __m512 xe = _mm512_loadu_ps(x + (size_t)j * cols + g * 32);
            const __m512 xo = _mm512_loadu_ps(x + (size_t)j * cols + g * 32 + 16);
            UNROLL for (int i = 0; i < R; i++) {
                const __m512 gs = mul_add(_mm512_mul_ps(ev[i], xe), od[i], xo);
                acc[i][j] = mul_add(acc[i][j], gs, f[i]);
            }
        }
    }
    UNROLL for (int i = 0; i < R; i++) UNROLL for (int j = 0; j < T; j++) out[i * T + j] =
        k3_lane_tree16(acc[i][j]);
}

/* The tile table k3_tiles_run (kernels_isa.h) walks: one out-of-line
 * function per (kind, R, T), compiled with R and T constant so the
 * accumulators stay in registers; every shape up to 4 x 4. */
#define TILE_FNS(NAME, CALL)                                                                       \
    TILE_FN(NAME, CALL, 1, 1)                                                                      \
    TILE_FN(NAME, CALL, 1, 2)                                                                      \
    TILE_FN(NAME, CALL, 1, 3)                                                                      \
    TILE_FN(NAME, CALL, 1, 4)                                                                      \
    TILE_FN(NAME, CALL, 2, 1)                                                                      \
    TILE_FN(NAME, CALL, 2, 2)                                                                      \
    TILE_FN(NAME, CALL, 2, 3)                                                                      \
    TILE_FN(NAME, CALL, 2, 4)                                                                      \
    TILE_FN(NAME, CALL, 3, 1)                                                                      \
    TILE_FN(NAME, CALL, 3, 2)                                                                      \
    TILE_FN(NAME, CALL, 3, 3)                                                                      \
    TILE_FN(NAME, CALL, 3, 4)                                                                      \
    TILE_FN(NAME, CALL, 4, 1)                                                                      \
    TILE_FN(NAME, CALL, 4, 2)                                                                      \
    TILE_FN(NAME, CALL, 4, 3)                                                                      \
    TILE_FN(NAME, CALL, 4, 4)                                                                      \
    static const k3_tile_fn NAME##_fns[4][4] = {                                                   \
        {NAME##_1_1, NAME##_1_2, NAME##_1_3, NAME##_1_4},                                          \
        {NAME##_2_1, NAME##_2_2, NAME##_2_3, NAME##_2_4},                                          \
        {NAME##_3_1, NAME##_3_2, NAME##_3_3, NAME##_3_4},                                          \
        {NAME##_4_1, NAME##_4_2, NAME##_4_3, NAME##_4_4},                                          \
    };
#define TILE_FN(NAME, CALL, R, T)                                                                  \
    static Z_FN void NAME##_##R##_##T(const void *mat, int r, const float *x, float *out) {        \
        CALL(R, T);                                                                                \
    }
#define CALL_F32(R, T) dense_tile(0, mat, r, x, out, R, T)
#define CALL_I8(R, T)  dense_tile(1, mat, r, x, out, R, T)
#define CALL_I4(R, T)  i4_tile(mat, r, x, out, R, T)
#define CALL_MX(R, T)  mx_tile(mat, r, x, out, R, T)
TILE_FNS(zf32, CALL_F32)
TILE_FNS(zq8, CALL_I8)
TILE_FNS(zi4, CALL_I4)
TILE_FNS(zmx, CALL_MX)
#undef TILE_FN

static void z_f32_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_tiles_run(zf32_fns, 4, n == 1 ? 1 : 4, m, m->rows, m->cols, x, n, y, r0, r1, NULL);
}

static void z_i8_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_tiles_run(zq8_fns, 4, n == 1 ? 1 : 4, m, m->rows, m->cols, x, n, y, r0, r1, m->scales);
}

/* The fixed-point lane scaling of kernels.c per dword, from mb = the bits
 * of the lane's max|x|: e (frexpf's exponent) from the float's exponent
 * field, or for subnormals and zero from m * 2^64's (zero gives -190);
 * E = max(e - 22, -149); x * 2^-E as x * pre * inv; 2^E built from bits
 * (subnormal below 2^-126); inf / NaN lanes flagged in bad. */
Z_INL void z_lane_scale(__m512i mb, __m512 *pre, __m512 *inv, __m512 *e2, __mmask16 *bad) {
    *bad = _mm512_cmpge_epu32_mask(mb, _mm512_set1_epi32(0x7F800000));
    const __m512i biased = _mm512_srli_epi32(mb, 23);
    const __m512 m64 = _mm512_mul_ps(_mm512_castsi512_ps(mb), _mm512_set1_ps(0x1p64f));
    const __m512i ex = _mm512_mask_blend_epi32(
        _mm512_cmpeq_epi32_mask(biased, _mm512_setzero_si512()),
        _mm512_sub_epi32(biased, _mm512_set1_epi32(126)),
        _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(m64), 23), _mm512_set1_epi32(190)));
    const __m512i E =
        _mm512_max_epi32(_mm512_sub_epi32(ex, _mm512_set1_epi32(22)), _mm512_set1_epi32(-149));
    const __m512i k = _mm512_sub_epi32(_mm512_setzero_si512(), E); /* -E in [-105, 149] */
    const __mmask16 two = _mm512_cmpgt_epi32_mask(k, _mm512_set1_epi32(126));
    *pre = _mm512_mask_blend_ps(two, _mm512_set1_ps(1.0f), _mm512_set1_ps(0x1p64f));
    const __m512i kk = _mm512_mask_sub_epi32(k, two, k, _mm512_set1_epi32(64));
    *inv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(kk, _mm512_set1_epi32(127)), 23));
    const __m512i sub =
        _mm512_sllv_epi32(_mm512_set1_epi32(1), _mm512_add_epi32(E, _mm512_set1_epi32(149)));
    const __m512i nrm = _mm512_slli_epi32(_mm512_add_epi32(E, _mm512_set1_epi32(127)), 23);
    const __mmask16 normal = _mm512_cmpge_epi32_mask(E, _mm512_set1_epi32(-126));
    *e2 = _mm512_mask_blend_ps(*bad, _mm512_castsi512_ps(_mm512_mask_blend_epi32(normal, sub, nrm)),
                               _mm512_set1_ps(NAN));
}

/* i4x_group's bytes in vectors: the group's even and odd columns
 * (two zmm each; a 128-bit lane of v[i] and v[i + 2] is one lane's 8
 * columns), the lane max by unsigned max of the |x| bits and two in-lane
 * shuffles, the same products and magic-number rounding, digits by
 * arithmetic shifts (exact: X - d is a multiple of 256), narrowed by
 * vpmovdb; each lane's sum of 8 likewise. */
static Z_FN void z_i4x_group(const float *x, k3_i4x_block *blk, int h) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const __m512 x2 = _mm512_loadu_ps(x + 32), x3 = _mm512_loadu_ps(x + 48);
    /* even columns 0-31, 32-63, odd columns 0-31, 32-63 */
    const __m512 v[4] = {_mm512_permutex2var_ps(x0, ev, x1), _mm512_permutex2var_ps(x2, ev, x3),
                         _mm512_permutex2var_ps(x0, od, x1), _mm512_permutex2var_ps(x2, od, x3)};
    const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 pre[2], inv[2], e2[2];
    __mmask16 bad[2];
    UNROLL for (int i = 0; i < 2; i++) {
        __m512i t = _mm512_max_epu32(_mm512_and_si512(_mm512_castps_si512(v[i]), absm),
                                     _mm512_and_si512(_mm512_castps_si512(v[i + 2]), absm));
        t = _mm512_max_epu32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
        t = _mm512_max_epu32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
        z_lane_scale(t, &pre[i], &inv[i], &e2[i], &bad[i]);
    }
    const __m512 magic = _mm512_set1_ps(0x1.8p23f);
    const __m512i b128 = _mm512_set1_epi32(128), b255 = _mm512_set1_epi32(255);
    __m512i X[4];
    UNROLL for (int i = 0; i < 4; i++) {
        const int j = i & 1;
        const __m512 r =
            _mm512_maskz_mul_ps((__mmask16)~bad[j], _mm512_mul_ps(v[i], pre[j]), inv[j]);
        X[i] = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_add_ps(r, magic), magic));
        __m512i t = X[i];
        UNROLL for (int p = 0; p < 3; p++) {
            const __m512i d =
                p < 2 ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(t, b128), b255), b128)
                      : t;
            _mm_storeu_si128((__m128i *)(blk->d[p][i / 2] + 32 * h + 16 * (i & 1)),
                             _mm512_cvtepi32_epi8(d));
            t = _mm512_srai_epi32(_mm512_sub_epi32(t, d), 8);
        }
    }
    __m512i s[2];
    UNROLL for (int i = 0; i < 2; i++) {
        __m512i t = _mm512_add_epi32(X[i], X[i + 2]); /* dword q: columns 2q, 2q+1 */
        t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_CDAB));
        s[i] = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC)); /* x 4 per 128 bits */
    }
    const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i c = _mm512_sub_epi32(
        _mm512_setzero_si512(), _mm512_slli_epi32(_mm512_permutex2var_epi32(s[0], pick, s[1]), 3));
    _mm512_mask_storeu_epi32(blk->c + 8 * h, 0x00FF, c);
    _mm512_mask_storeu_ps(blk->e + 8 * h, 0x00FF, _mm512_permutex2var_ps(e2[0], pick, e2[1]));
}

/* int4: one token chunk in the fixed-point order (k3_i4_rows_chunked) */
static void z_i4_chunk(const k3_qmat *m, const float *xp, int tn, float *y, int r0, int r1) {
    k3_tiles_run(zi4_fns, tn == 1 ? 4 : 2, tn == 1 ? 1 : 4, m, m->rows, (int)k3_i4_xld(m->cols), xp,
                 tn, y, r0, r1, NULL);
}

static void z_i4_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_i4_rows_chunked(m, x, n, y, r0, r1, z_i4x_group, z_i4_chunk);
}

static void z_mx_f32(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1) {
    k3_nibble_rows(zmx_fns, perm_nibble_order, n == 1 ? 4 : 3, n == 1 ? 1 : 4, w, w->rows, w->cols,
                   x, n, y, r0, r1);
}

/* ---- MXFP4 integer-dot, 16 rows per block ---- */

#define ZI8_T     16 /* tokens per tile (accumulators in registers) */
#define ZI8_MIN_N 4  /* below: zv_tile (n = 3 as 2 + 1 tokens) is faster for MXFP4 and int4 */

/* eh[g][i] = 2^(s-127)/2 of rows r..r+15, groups g0..g0+gn-1, written as
 * 16 floats per group. Full chunks of 16 groups go through a 16x16 byte
 * transpose; the bits are those of k3_e8m0_half (s << 23, times 0.5). */
Z_INL void zi8_scales(const uint8_t *scale, size_t ld, int g0, int gn, float *eh) {
    int g = 0;
    for (; g + 16 <= gn; g += 16) {
        __m128i a[16], b[16];
        for (int i = 0; i < 16; i++)
            a[i] = _mm_loadu_si128((const __m128i *)(scale + i * ld + g0 + g));
        for (int i = 0; i < 8; i++) { /* bytes: row pairs */
            b[2 * i] = _mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]);
            b[2 * i + 1] = _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]);
        }
        for (int q = 0; q < 4; q++) /* words: row quads; a[4q + m] holds groups 4m..4m+3 */
            for (int h = 0; h < 2; h++) {
                a[4 * q + 2 * h] = _mm_unpacklo_epi16(b[4 * q + h], b[4 * q + 2 + h]);
                a[4 * q + 2 * h + 1] = _mm_unpackhi_epi16(b[4 * q + h], b[4 * q + 2 + h]);
            }
        for (int o = 0; o < 2; o++) /* dwords: row octets; b[8o + 2m + k] groups 4m+2k, +1 */
            for (int m = 0; m < 4; m++) {
                b[8 * o + 2 * m] = _mm_unpacklo_epi32(a[8 * o + m], a[8 * o + 4 + m]);
                b[8 * o + 2 * m + 1] = _mm_unpackhi_epi32(a[8 * o + m], a[8 * o + 4 + m]);
            }
        for (int j = 0; j < 8; j++) { /* qwords: rows 0-7 | 8-15 of groups 2j, 2j+1 */
            const __m128i lo = _mm_unpacklo_epi64(b[j], b[8 + j]);
            const __m128i hi = _mm_unpackhi_epi64(b[j], b[8 + j]);
            const __m512 half = _mm512_set1_ps(0.5f);
            _mm512_store_ps(
                eh + (g + 2 * j) * 16,
                _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(lo), 23)),
                              half));
            _mm512_store_ps(
                eh + (g + 2 * j + 1) * 16,
                _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(hi), 23)),
                              half));
        }
    }
    for (; g < gn; g++)
        for (int i = 0; i < 16; i++) eh[g * 16 + i] = k3_e8m0_half[scale[i * ld + g0 + g]];
}

/* The three integer-dot weight kinds of the 16-row kernel. Each is fed to
 * vpdpbusd as its unsigned operand u = w + bias (w the integer weight), so
 * the signed activations q can be the {1to16} broadcast memory operand;
 * bias * sum(q) is taken back per (token, group) by the start value.
 *   K3_IK_MX: MXFP4, w = d = 2v (-12..12), bias 12, columns of a group as
 *          [even | odd] (activations permuted the same way)
 *   K3_IK_I4: int4-g64, w = nibble - 8, so u is the nibble, bias 8, [even | odd]
 *   K3_IK_I8: int8 per-row, bias 128, columns in order */
static const int zk_bias[3] = {12, 8, 128};

/* int8: one group (32 columns) of 16 rows -> D[k] = dword k (4 columns) of
 * rows 0..15 as u8 (w + 128). p: the group's first byte of row 0, ldp: row
 * stride, bytes. */
Z_INL void zk_decode_i8(const uint8_t *p, size_t ldp, __m512i D[8]) {
    __m256i d[16];
    UNROLL for (int i = 0; i < 16; i++) /* 32 bytes of the row, + 128 */
        d[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + i * ldp)),
                                _mm256_set1_epi8((char)0x80));
    /* Z[i] = [row i | row i+4], Z[4+i] = [row 8+i | row 12+i]: the 8x8 dword
     * transposes of both halves then give rows 0-3, 4-7, 8-11, 12-15 in the
     * four 128-bit lanes of D[k]. */
    __m512i z[8], t[8], u[8];
    UNROLL for (int i = 0; i < 4; i++) {
        z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(d[i]), d[i + 4], 1);
        z[4 + i] = _mm512_inserti64x4(_mm512_castsi256_si512(d[8 + i]), d[12 + i], 1);
    }
    UNROLL for (int m = 0; m < 4; m++) {
        t[2 * m] = _mm512_unpacklo_epi32(z[2 * m], z[2 * m + 1]);
        t[2 * m + 1] = _mm512_unpackhi_epi32(z[2 * m], z[2 * m + 1]);
    }
    UNROLL for (int h = 0; h < 2; h++) {
        u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    UNROLL for (int e = 0; e < 4; e++) {
        D[e] = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88);
        D[4 + e] = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    }
}

/* The row order of the nibble kinds' decode: dword 4j + q holds row 4q + j
 * (a 4 x 4 transpose of the 16 rows, its own inverse). */
Z_INL __m512i zk_perm(void) {
    return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

/* The nibble kinds' decode (MX, I4) in the zk_perm row order: four rows'
 * 16 packed bytes per zmm (one per 128-bit lane), both nibbles decoded in
 * place (vpand, vpsrlw; MX: vpshufb with the 16-entry table in every lane),
 * then a 4x4 dword transpose inside the lanes of the four zmm, so D[k]
 * holds dword k (4 columns) of the 16 rows in that order; zk_tile permutes
 * its factors and results the same way. 52 vector instructions per group;
 * decoding 16 ymm rows and transposing them as zk_decode_i8 does took
 * about 100 and was 4-10 % slower at n = 32. */
Z_INL void zk_decode_nib(int kind, const uint8_t *p, size_t ldp, __m512i D[8]) {
    const __m512i tab = mx_u_tab();
    __m512i lo[4], hi[4];
    UNROLL for (int q = 0; q < 4; q++) {
        const uint8_t *r = p + (size_t)(4 * q) * ldp;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)r));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + ldp)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 2 * ldp)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(r + 3 * ldp)), 3);
        dec_u8(kind, 0, z, tab, &lo[q], &hi[q]);
    }
    UNROLL for (int h = 0; h < 2; h++) {
        const __m512i *v = h ? hi : lo; /* dwords 0-3 of a row: low nibbles, 4-7 high */
        const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]),
                      t1 = _mm512_unpackhi_epi32(v[0], v[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]),
                      t3 = _mm512_unpackhi_epi32(v[2], v[3]);
        D[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2);
        D[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
        D[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
        D[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
}

/* The 16 x 16 transpose of dwords: a[i] = 16 dwords of row i -> c[k] =
 * dword k of rows 0..15. */
Z_INL void z_t16(const __m512 a_in[16], __m512 c[16]) {
    __m512 a[16], b[16];
    UNROLL for (int i = 0; i < 16; i++) a[i] = a_in[i];
    UNROLL for (int i = 0; i < 8; i++) { /* row pairs */
        b[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
        b[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
    }
    UNROLL for (int q = 0; q < 4; q++) /* row quads */
        UNROLL for (int k = 0; k < 2; k++) {
        const __m512d x = _mm512_castps_pd(b[4 * q + k]), y = _mm512_castps_pd(b[4 * q + 2 + k]);
        a[4 * q + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
        a[4 * q + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
    }
    /* a[4q + m], lane l of each 128-bit block: row 4q + l, dword 4 * block + m */
    UNROLL for (int m = 0; m < 4; m++) {
        /* blocks of quads 0,1 | 2,3 interleaved, then the full 16 rows */
        const __m512 lo01 = _mm512_shuffle_f32x4(a[m], a[4 + m], 0x88);
        const __m512 hi01 = _mm512_shuffle_f32x4(a[m], a[4 + m], 0xDD);
        const __m512 lo23 = _mm512_shuffle_f32x4(a[8 + m], a[12 + m], 0x88);
        const __m512 hi23 = _mm512_shuffle_f32x4(a[8 + m], a[12 + m], 0xDD);
        c[m] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
        c[4 + m] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
        c[8 + m] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
        c[12 + m] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
    }
}

/* eh[g][i] = the int4 scale of row i (row stride ld floats) for 32-column
 * groups g0..g0+gn-1 (g0 even): the group-64 scale h = g / 2 serves groups
 * 2h and 2h+1. Chunks of 16 scales per row through a 16x16 transpose. */
Z_INL void zi4_scales(const float *s4, size_t ld, int g0, int gn, float *eh) {
    const int h0 = g0 / 2;
    int h = 0;
    for (; 2 * (h + 16) <= gn; h += 16) { /* both groups of all 16 scales within gn */
        __m512 a[16], c[16];
        UNROLL for (int i = 0; i < 16; i++) a[i] = _mm512_loadu_ps(s4 + (size_t)i * ld + h0 + h);
        z_t16(a, c);
        UNROLL for (int k = 0; k < 16; k++) { /* c[k]: scale h + k of rows 0..15 */
            _mm512_store_ps(eh + (2 * (h + k)) * 16, c[k]);
            _mm512_store_ps(eh + (2 * (h + k) + 1) * 16, c[k]);
        }
    }
    for (int g = 2 * h; g < gn; g++)
        for (int i = 0; i < 16; i++) eh[g * 16 + i] = s4[(size_t)i * ld + (g0 + g) / 2];
}

/* Group factors of rows r..r+15 for groups g0..g0+gn-1 (16 floats per
 * group): MXFP4 2^(s-127)/2, int4 the group-64 scale of the 32-column half.
 * int8 has none (its row scale comes last). */
Z_INL void zk_factors(int kind, const void *mat, int r, int g0, int gn, float *eh) {
    if (kind == K3_IK_MX) {
        const k3_mxfp4 *w = mat;
        const int ng = w->cols / 32;
        zi8_scales(w->scale + (size_t)r * ng, (size_t)ng, g0, gn, eh);
    } else if (kind == K3_IK_I4) {
        const k3_qmat *m = mat;
        const int ng64 = m->cols / 64;
        zi4_scales(m->scales + (size_t)r * ng64, (size_t)ng64, g0, gn, eh);
    }
}

/* isum + sum over 4-byte lanes of u (u8) * the 4 bytes at p (s8), with p
 * as a {1to16} broadcast memory operand: GCC 12 does not fold the
 * broadcast of _mm512_dpbusd_epi32 into the instruction, and a separate
 * vpbroadcastd per dot would double the loop's instructions. */
Z_INL __m512i dpbusd_bcast(__m512i isum, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(isum) : "v"(u), "m"(*(const int32_t *)p));
    return isum;
}

/* 16 rows x T tokens, all groups. Activations group-major (zk_prep):
 * qp [ng][tn][32] s8, qc [ng][tn] = -bias * sum(q) of the group (the start
 * value of its integer sum), xs [ng][tn]; this tile's tokens start at
 * column t of those [tn] rows. y: [T][rows] from row r. Per row the float
 * part is the scalar's: acc += (float)isum * f, f = factor * sx (int8:
 * f = sx, and y = acc * s_row at the end). */
Z_INL void zk_tile(int kind, const void *mat, int r, const int8_t *qp, const int32_t *qc,
                   const float *xs, int tn, float *eh, float *y, int T) {
    const k3_qmat *qm = mat;
    const k3_ik_view v = k3_ik_view_of(kind, mat);
    const int cols = v.cols, ng = cols / 32, rows = v.rows;
    const size_t ldp = v.ldp;
    const uint8_t *wb = v.w;
    const size_t gbytes = kind == K3_IK_I8 ? 32 : 16; /* one group of one row */
    const __m512i perm = zk_perm();
    __m512 acc[ZI8_T];
    UNROLL for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        if ((g & 63) == 0) zk_factors(kind, mat, r, g, ng - g < 64 ? ng - g : 64, eh);
        __m512i D[8];
        const uint8_t *wg = wb + (size_t)r * ldp + (size_t)g * gbytes;
        /* The same bytes of the next 16 rows, a line per row per 64 bytes:
         * without it the weights from RAM ran 20 % under hot at n = 32. */
        if ((g * gbytes) % 64 == 0)
            UNROLL for (int i = 0; i < 16; i++) pf_next(wg + (size_t)i * ldp, 16 * ldp);
        if (kind == K3_IK_I8)
            zk_decode_i8(wg, ldp, D);
        else
            zk_decode_nib(kind, wg, ldp, D);
        const __m512 e = kind == K3_IK_I8
                             ? _mm512_setzero_ps()
                             : _mm512_permutexvar_ps(perm, _mm512_load_ps(eh + (g & 63) * 16));
        const int8_t *qg = qp + (size_t)g * tn * 32;
        const int32_t *cg = qc + (size_t)g * tn;
        const float *sg = xs + (size_t)g * tn;
        UNROLL for (int j = 0; j < T; j++) {
            /* sum((w + bias) q) - bias sum(q) = sum(w q), exact */
            __m512i isum = _mm512_set1_epi32(cg[j]);
            UNROLL for (int k = 0; k < 8; k++) isum = dpbusd_bcast(isum, D[k], qg + j * 32 + 4 * k);
            const __m512 sx = _mm512_set1_ps(sg[j]);
            const __m512 f = kind == K3_IK_I8 ? sx : _mm512_mul_ps(e, sx);
            acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(_mm512_cvtepi32_ps(isum), f));
        }
    }
    if (kind == K3_IK_I8) {
        const __m512 srow = _mm512_loadu_ps(qm->scales + r);
        UNROLL for (int j = 0; j < T; j++) acc[j] = _mm512_mul_ps(acc[j], srow);
    } else /* rows back from the zk_perm order */
        UNROLL for (int j = 0; j < T; j++) acc[j] = _mm512_permutexvar_ps(perm, acc[j]);
    UNROLL for (int j = 0; j < T; j++) _mm512_storeu_ps(y + (size_t)j * rows, acc[j]);
}

typedef void (*zk_fn)(const void *, int, const int8_t *, const int32_t *, const float *, int,
                      float *, float *);
#define ZK_TILE_FN(NAME, KIND, T)                                                                  \
    static Z_FN void NAME##_##T(const void *mat, int r, const int8_t *qp, const int32_t *qc,       \
                                const float *xs, int tn, float *eh, float *y) {                    \
        zk_tile(KIND, mat, r, qp, qc, xs, tn, eh, y, T);                                           \
    }
#define ZK_TILE_FNS(NAME, KIND)                                                                    \
    ZK_TILE_FN(NAME, KIND, 1)                                                                      \
    ZK_TILE_FN(NAME, KIND, 2)                                                                      \
    ZK_TILE_FN(NAME, KIND, 3)                                                                      \
    ZK_TILE_FN(NAME, KIND, 4)                                                                      \
    ZK_TILE_FN(NAME, KIND, 5)                                                                      \
    ZK_TILE_FN(NAME, KIND, 6)                                                                      \
    ZK_TILE_FN(NAME, KIND, 7)                                                                      \
    ZK_TILE_FN(NAME, KIND, 8)                                                                      \
    ZK_TILE_FN(NAME, KIND, 9)                                                                      \
    ZK_TILE_FN(NAME, KIND, 10)                                                                     \
    ZK_TILE_FN(NAME, KIND, 11)                                                                     \
    ZK_TILE_FN(NAME, KIND, 12)                                                                     \
    ZK_TILE_FN(NAME, KIND, 13)                                                                     \
    ZK_TILE_FN(NAME, KIND, 14)                                                                     \
    ZK_TILE_FN(NAME, KIND, 15)                                                                     \
    ZK_TILE_FN(NAME, KIND, 16)                                                                     \
    static const zk_fn NAME##_fns[ZI8_T] = {                                                       \
        NAME##_1, NAME##_2,  NAME##_3,  NAME##_4,  NAME##_5,  NAME##_6,  NAME##_7,  NAME##_8,      \
        NAME##_9, NAME##_10, NAME##_11, NAME##_12, NAME##_13, NAME##_14, NAME##_15, NAME##_16};
ZK_TILE_FNS(zkmx, K3_IK_MX)
ZK_TILE_FNS(zki4, K3_IK_I4)
ZK_TILE_FNS(zki8, K3_IK_I8)

/* q [n][cols], s [n][cols/32] -> group-major: qp [ng][n][32] (s8; the
 * group's columns as [even | odd] when perm), qc [ng][n] = -bias * sum of
 * the group's q, xt [ng][n] = s */
static Z_FN void zk_prep(const int8_t *q, const float *s, int n, int cols, int perm, int bias,
                         int8_t *qp, int32_t *qc, float *xt) {
    const int ng = cols / 32;
    const __m256i idx = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int t = 0; t < n; t++)
        for (int g = 0; g < ng; g++) {
            const size_t o = (size_t)g * n + t;
            const __m256i raw =
                _mm256_loadu_si256((const __m256i *)(q + (size_t)t * cols + g * 32));
            __m256i v = raw;
            if (perm) v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, idx), 0xD8);
            _mm256_store_si256((__m256i *)(qp + o * 32), v);
            qc[o] = -bias * k3_sum32_s8(raw);
            xt[o] = s[(size_t)t * ng + g];
        }
}

/* Rows [r0, r16) in blocks of 16 through the tiles, in token chunks under
 * the scratch cap and balanced token tiles (20 tokens run as 10 + 10, not
 * 16 + 4). Returns r16; the caller computes rows [r16, r1) with its
 * scalar row. */
static int zk_rows(int kind, const zk_fn fns[ZI8_T], const void *mat, int rows, int cols,
                   const int8_t *xq, const float *xs, int n, float *y, int r0, int r1) {
    const int ng = cols / 32;
    const int r16 = r0 + (r1 - r0) / 16 * 16;
    if (r16 == r0) return r16;
    /* per token: cols activation bytes, ng start values, ng scales */
    const size_t per_tok = (size_t)cols + (size_t)ng * (sizeof(int32_t) + sizeof(float));
    const int tch = k3_kern_chunk(n, per_tok);
    int8_t *qp = k3_kern_scratch((size_t)tch * per_tok);
    _Alignas(64) float eh[64 * 16];
    for (int t0 = 0; t0 < n; t0 += tch) {
        const int tn = n - t0 < tch ? n - t0 : tch;
        int32_t *qc = (int32_t *)(qp + (size_t)tn * cols); /* cols % 32 == 0: aligned */
        float *xt = (float *)(qc + (size_t)tn * ng);
        zk_prep(xq + (size_t)t0 * cols, xs + (size_t)t0 * ng, tn, cols, kind != K3_IK_I8,
                zk_bias[kind], qp, qc, xt);
        for (int r = r0; r < r16; r += 16)
            for (int t = 0, tiles = (tn + ZI8_T - 1) / ZI8_T; t < tn;) {
                const int T = (tn - t + tiles - 1) / tiles;
                tiles--;
                fns[T - 1](mat, r, qp + (size_t)t * 32, qc + t, xt + t, tn, eh,
                           y + (size_t)(t0 + t) * rows + r);
                t += T;
            }
    }
    return r16;
}

/* ---- integer-dot for n = 1..3: 16 rows, rows through the reduction ----
 *
 * MX and I4 only (the nibble kinds; I8 runs the transposed kernel). One zmm
 * load is 64 bytes of a row: 4 groups, one per 128-bit lane. Both nibble
 * halves are decoded to u = w + bias in place: vpermb with the 16-entry
 * table repeated over 64 bytes reads the nibble's 4 bits and 2 don't-care
 * bits, so it needs no mask (without VBMI: and, then vpshufb for MX). Two
 * vpdpbusd against the token's [evens of the 4 groups] [odds of the 4
 * groups], started from -bias * sum(q) in dword 0 of each group's lane,
 * leave each group's exact sum as 4 dword partials in its lane. The 16
 * rows' partials are folded (unpack + add, twice) and the 128-bit lanes
 * transposed, so group g's sums of the 16 rows are one vector; the float
 * part then runs per group in order, as in zk_tile, with the 16 rows'
 * group factors from one transpose of their scale bytes (or int4 floats)
 * per 16 blocks (8 for int4). Per 64 bytes of a row: 3 decode + 2 dot
 * instructions, 4 of reduction and one prefetch (docs/PERFORMANCE.md,
 * "Wave 2, fifth session", for what each of these cost from RAM). */

#define ZV_MAX_N 2 /* tokens per tile call; zv_rows runs n = 3 as 2 + 1 */

/* 16 vectors of 4 groups x 4 dword partials (one vector per row) -> out[g]
 * = the 16 rows' sums of group g */
Z_INL void zv_fold(const __m512i s[16], __m512i out[4]) {
    __m512i t[8], u[4];
    UNROLL for (int m = 0; m < 8; m++) /* rows 2m, 2m+1: [a0+a2 b0+b2 a1+a3 b1+b3] per lane */
        t[m] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * m], s[2 * m + 1]),
                                _mm512_unpackhi_epi32(s[2 * m], s[2 * m + 1]));
    UNROLL for (int k = 0; k < 4; k++) /* rows 4k..4k+3, whole sums, per lane */
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]),
                                _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
    const __m512i v0 = _mm512_shuffle_i32x4(u[0], u[1], 0x44),
                  v1 = _mm512_shuffle_i32x4(u[0], u[1], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[2], u[3], 0x44),
                  v3 = _mm512_shuffle_i32x4(u[2], u[3], 0xEE);
    out[0] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    out[1] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    out[2] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    out[3] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
}

/* The scales of 16 rows (sb: the first row's, ld bytes per row) from dword
 * column c0 on, 16 columns, as ts[k] = column c0 + k of the 16 rows (one
 * transpose per 16 columns, in place of zk_factors' per-group floats). A
 * column is 4 bytes of a row's scales: MXFP4 the ue8m0 bytes of groups
 * 4k..4k+3 (one block), int4 the float scale of group-64 k. Bytes past the
 * row's end read as zero. */
Z_INL void zv_scale_cols(const uint8_t *sb, size_t ld, int c0, int32_t ts[16][16]) {
    const uint8_t *p = sb + (size_t)c0 * 4;
    const size_t left = ld - (size_t)c0 * 4;
    const __mmask64 km = left >= 64 ? ~0ull : (1ull << left) - 1;
    __m512 a[16], c[16];
    UNROLL for (int i = 0; i < 16; i++) a[i] =
        _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(km, p + (size_t)i * ld));
    z_t16(a, c);
    UNROLL for (int k = 0; k < 16; k++) _mm512_store_ps((float *)ts[k], c[k]);
}

/* MXFP4 group k (0..3) of a block's scale column d as floats 2^(s-127)
 * (s = 0 -> +0, 255 -> +inf): byte k moved to bits 23..30. */
Z_INL __m512 zv_e8m0(__m512i d, int k) {
    const __m512i x = k == 0   ? _mm512_slli_epi32(d, 23)
                      : k == 1 ? _mm512_slli_epi32(d, 15)
                      : k == 2 ? _mm512_slli_epi32(d, 7)
                               : _mm512_srli_epi32(d, 1);
    return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0x7F800000)));
}

/* 16 rows from r x T tokens. Activations (zv_prep), per token and block of
 * 4 groups: qa [T][nb][128] s8 (evens of the 4 groups, then odds), cv
 * [T][nb][16] the start values; xs [T][ldxs] the group scales, for MXFP4
 * halved (0.5 sx: the factor 2^(s-127) * 0.5 * sx is then 2^(s-127) times
 * it, the same product rounded once). y: [T][rows] from row r. */
Z_INL void zv_tile(int kind, int vbmi, const void *mat, int r, const int8_t *qa, const int32_t *cv,
                   const float *xs, int ldxs, float *y, int T) {
    const k3_ik_view v = k3_ik_view_of(kind, mat);
    const int ng = v.cols / 32, nb = (ng + 3) / 4, nbf = ng / 4; /* blocks, full ones */
    const size_t ldp = v.ldp;
    const uint8_t *wb = v.w + (size_t)r * ldp;
    const __m512i tab = kind == K3_IK_MX
                            ? mx_u_tab()
                            : _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                   11, 12, 13, 14, 15));
    /* the next tile's scale bytes, a share per block: the transposes
     * below would otherwise wait on memory once per tile */
    const k3_mxfp4 *mx = mat;
    const k3_qmat *qm = mat;
    const size_t sbytes = kind == K3_IK_MX ? (size_t)ng : (size_t)(ng / 2) * sizeof(float);
    const uint8_t *sb = (kind == K3_IK_MX ? mx->scale : (const uint8_t *)qm->scales) +
                        (size_t)r * sbytes; /* this tile's scales */
    const uint8_t *snext = sb + 16 * sbytes;
    const size_t slines = (16 * sbytes + 63) / 64, sper = (slines + nb - 1) / nb;
    _Alignas(64) int32_t ts[16][16]; /* zv_scale_cols: 16 blocks (MX) or 8 (I4) */
    __m512 acc[ZV_MAX_N];
    UNROLL for (int j = 0; j < T; j++) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        for (size_t l = (size_t)b * sper; l < (size_t)(b + 1) * sper && l < slines; l++)
            _mm_prefetch((const char *)snext + l * 64, _MM_HINT_T0);
        const int gn = ng - 4 * b < 4 ? ng - 4 * b : 4;
        if (kind == K3_IK_MX ? (b & 15) == 0 : (b & 7) == 0)
            zv_scale_cols(sb, sbytes, kind == K3_IK_MX ? b : 2 * b, ts);
        const __mmask64 km = gn == 4 ? ~0ull : (1ull << (16 * gn)) - 1;
        __m512i qe[ZV_MAX_N], qo[ZV_MAX_N], c0[ZV_MAX_N], s[ZV_MAX_N][16];
        UNROLL for (int j = 0; j < T; j++) {
            qe[j] = _mm512_load_si512(qa + ((size_t)j * nb + b) * 128);
            qo[j] = _mm512_load_si512(qa + ((size_t)j * nb + b) * 128 + 64);
            c0[j] = _mm512_load_si512(cv + ((size_t)j * nb + b) * 16);
        }
        __m512i w[16];
        if (b < nbf)
            UNROLL for (int i = 0; i < 16; i++) w[i] =
                _mm512_loadu_si512(wb + (size_t)i * ldp + (size_t)b * 64);
        else
            UNROLL for (int i = 0; i < 16; i++) w[i] =
                _mm512_maskz_loadu_epi8(km, wb + (size_t)i * ldp + (size_t)b * 64);
        UNROLL for (int i = 0; i < 16; i++) {
            /* the next tile's same 64 bytes of row i, one prefetch beside
             * each row's decode: 16 in a burst with the loads at the
             * block's start kept fewer lines in flight (from RAM, 2
             * threads: MXFP4 0.73 -> 0.82-0.87 of STREAM, docs/PERFORMANCE.md) */
            if (b < nbf)
                _mm_prefetch((const char *)wb + (size_t)(16 + i) * ldp + (size_t)b * 64,
                             _MM_HINT_T1);
            __m512i lo, hi;
            dec_u8(kind, vbmi, w[i], tab, &lo, &hi);
            UNROLL for (int j = 0; j < T; j++) s[j][i] =
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c0[j], lo, qe[j]), hi, qo[j]);
        }
        UNROLL for (int j = 0; j < T; j++) {
            __m512i out[4];
            zv_fold(s[j], out);
            const __m512i d = _mm512_load_si512(ts[b & 15]); /* MX: the block's 4 groups */
            UNROLL for (int g = 0; g < 4; g++) {
                if (g >= gn) break;
                const __m512 e = kind == K3_IK_MX
                                     ? zv_e8m0(d, g)
                                     : _mm512_load_ps((const float *)ts[(2 * b + g / 2) & 15]);
                const __m512 f = _mm512_mul_ps(e, _mm512_set1_ps(xs[(size_t)j * ldxs + 4 * b + g]));
                acc[j] = _mm512_add_ps(acc[j], _mm512_mul_ps(_mm512_cvtepi32_ps(out[g]), f));
            }
        }
    }
    UNROLL for (int j = 0; j < T; j++) _mm512_storeu_ps(y + (size_t)j * v.rows, acc[j]);
}

typedef void (*zv_fn)(const void *, int, const int8_t *, const int32_t *, const float *, int,
                      float *);
#define ZV_TILE_FN(NAME, KIND, VBMI, T)                                                            \
    static Z_FN void NAME##_##T(const void *mat, int r, const int8_t *qa, const int32_t *cv,       \
                                const float *xs, int ldxs, float *y) {                             \
        zv_tile(KIND, VBMI, mat, r, qa, cv, xs, ldxs, y, T);                                       \
    }
#define ZV_TILE_FNS(NAME, KIND, VBMI)                                                              \
    ZV_TILE_FN(NAME, KIND, VBMI, 1) ZV_TILE_FN(NAME, KIND, VBMI, 2)
ZV_TILE_FNS(zvmx, K3_IK_MX, 0)
ZV_TILE_FNS(zvmxb, K3_IK_MX, 1)
ZV_TILE_FNS(zvi4, K3_IK_I4, 0)
ZV_TILE_FNS(zvi4b, K3_IK_I4, 1)
/* [kind][vbmi][T - 1] */
static const zv_fn zv_fns[2][2][ZV_MAX_N] = {
    {{zvmx_1, zvmx_2}, {zvmxb_1, zvmxb_2}},
    {{zvi4_1, zvi4_2}, {zvi4b_1, zvi4b_2}},
};

/* q [n][cols] -> qa [n][nb][128]: per block of 4 groups the 16 even-column
 * values of each group (group k at bytes 16k), then the odd ones at 64 +
 * 16k; cv [n][nb][16]: -bias * sum(q) of group k at dword 4k, zeros
 * elsewhere. A last partial block is zero-padded. */
static Z_FN void zv_prep(const int8_t *q, int n, int cols, int bias, int8_t *qa, int32_t *cv) {
    const int ng = cols / 32, nb = (ng + 3) / 4;
    const __m256i idx = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    memset(qa, 0, (size_t)n * nb * 128);
    memset(cv, 0, (size_t)n * nb * 16 * sizeof(int32_t));
    for (int t = 0; t < n; t++)
        for (int g = 0; g < ng; g++) {
            const __m256i raw =
                _mm256_loadu_si256((const __m256i *)(q + (size_t)t * cols + g * 32));
            /* [evens | odds] of the group */
            const __m256i v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, idx), 0xD8);
            int8_t *blk = qa + ((size_t)t * nb + g / 4) * 128 + (g % 4) * 16;
            _mm_storeu_si128((__m128i *)blk, _mm256_castsi256_si128(v));
            _mm_storeu_si128((__m128i *)(blk + 64), _mm256_extracti128_si256(v, 1));
            cv[((size_t)t * nb + g / 4) * 16 + (g % 4) * 4] = -bias * k3_sum32_s8(raw);
        }
}

/* Rows [r0, r16) of n < ZI8_MIN_N tokens in blocks of 16, each block's
 * tokens in tile calls of <= ZV_MAX_N (the block's weights, 16 rows, stay
 * in L2 for the second call); returns r16. */
static int zv_rows(int kind, const void *mat, const int8_t *xq, const float *xs, int n, float *y,
                   int r0, int r1) {
    const k3_ik_view v = k3_ik_view_of(kind, mat);
    const int ng = v.cols / 32, nb = (ng + 3) / 4;
    const int r16 = r0 + (r1 - r0) / 16 * 16;
    if (r16 == r0) return r16;
    /* per token: qa, cv, and for MXFP4 the halved group scales the tile reads */
    const size_t per_tok = (size_t)nb * (128 + 16 * sizeof(int32_t)) +
                           (kind == K3_IK_MX ? (size_t)ng * sizeof(float) : 0);
    const int tch = k3_kern_chunk(n, per_tok);
    int8_t *qa = k3_kern_scratch((size_t)tch * per_tok);
    const int vbmi = k3_kern_vbmi;
    for (int t0 = 0; t0 < n; t0 += tch) {
        const int tn = n - t0 < tch ? n - t0 : tch;
        int32_t *cv = (int32_t *)(qa + (size_t)tn * nb * 128);
        const float *xt = xs + (size_t)t0 * ng; /* [tn][ng], as zv_tile reads them */
        zv_prep(xq + (size_t)t0 * v.cols, tn, v.cols, zk_bias[kind], qa, cv);
        if (kind == K3_IK_MX) { /* 0.5 sx, exact (zv_tile) */
            float *xh = (float *)(cv + (size_t)tn * nb * 16);
            for (size_t i = 0; i < (size_t)tn * ng; i++) xh[i] = 0.5f * xt[i];
            xt = xh;
        }
        for (int r = r0; r < r16; r += 16)
            for (int t = 0; t < tn; t += ZV_MAX_N) {
                const int tt = tn - t < ZV_MAX_N ? tn - t : ZV_MAX_N;
                zv_fns[kind][vbmi][tt - 1](mat, r, qa + (size_t)t * nb * 128,
                                           cv + (size_t)t * nb * 16, xt + (size_t)t * ng, ng,
                                           y + (size_t)(t0 + t) * v.rows + r);
            }
    }
    return r16;
}

static void z_mx_i8(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y, int r0,
                    int r1) {
    if (n < ZI8_MIN_N) {
        const int r16 = zv_rows(K3_IK_MX, w, xq, xs, n, y, r0, r1);
        if (r16 < r1) k3_mx_i8_rows_vnni256(w, xq, xs, n, y, r16, r1);
        return;
    }
    const int r16 = zk_rows(K3_IK_MX, zkmx_fns, w, w->rows, w->cols, xq, xs, n, y, r0, r1);
    k3_mx_i8_rows_scalar(w, xq, xs, n, y, r16, r1);
}

static void z_q8_rows(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y, int r0,
                      int r1) {
    if (m->fmt == K3_QF_I4G64 && n < ZI8_MIN_N) {
        const int r16 = zv_rows(K3_IK_I4, m, xq, xs, n, y, r0, r1);
        if (r16 < r1) k3_q8_rows_vnni256(m, xq, xs, n, y, r16, r1);
        return;
    }
    const int kind = m->fmt == K3_QF_I8 ? K3_IK_I8 : K3_IK_I4;
    const int r16 = zk_rows(kind, kind == K3_IK_I8 ? zki8_fns : zki4_fns, m, m->rows, m->cols, xq,
                            xs, n, y, r0, r1);
    k3_q8_rows_scalar(m, xq, xs, n, y, r16, r1);
}

/* ---- activation quantization (bit-exact with the scalar one) ---- */

static Z_FN void z_act_q8(const float *x, int n, int cols, int8_t *q, float *s) {
    const int ng = cols / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int t = 0; t < n; t++) {
        for (int g = 0; g < ng; g++) {
            const float *xg = x + (size_t)t * cols + g * 32;
            const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
            /* new value first: maxps returns the second operand on NaN, so a
             * NaN input is skipped exactly as in the scalar loop */
            __m512 m = _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_setzero_ps());
            m = _mm512_max_ps(_mm512_and_ps(v1, absmask), m);
            float sg = _mm512_reduce_max_ps(m) / 127.0f;
            sg = sg > 1e-20f ? sg : 1e-20f;
            const __m512 inv = _mm512_set1_ps(1.0f / sg);
            const __m512 hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
            __m512 a = _mm512_roundscale_ps(_mm512_mul_ps(v0, inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512 b = _mm512_roundscale_ps(_mm512_mul_ps(v1, inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            a = _mm512_max_ps(_mm512_min_ps(a, hi), lo);
            b = _mm512_max_ps(_mm512_min_ps(b, hi), lo);
            int8_t *qg = q + (size_t)t * cols + g * 32;
            _mm_storeu_si128((__m128i *)qg, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a)));
            _mm_storeu_si128((__m128i *)(qg + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(b)));
            s[(size_t)t * ng + g] = sg;
        }
    }
}

const k3_kern_ops k3_kern_avx512 = {
    .isa = K3_ISA_AVX512,
    .f32_rows = z_f32_rows,
    .i8_rows = z_i8_rows,
    .i4_rows = z_i4_rows,
    .mx_f32 = z_mx_f32,
    .mx_i8 = z_mx_i8,
    .act_q8 = z_act_q8,
    .q8_rows = z_q8_rows,
};
