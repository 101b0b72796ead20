/* common/kernels/kernels.c: ISA dispatch, the scalar reference kernels, the
 * load-time quantizers (docs/MODEL.md 4.2), per-thread kernel scratch and the
 * threaded wrappers.
 *
 * The scalar kernels define the numbers: the values of docs/MODEL.md 4.1/4.2 (group
 * sums times group scales, int8 row scale last, the integer-dot float part
 * in group order) summed in one fixed order that every vector backend
 * (kernels_avx2.c, kernels_avx512.c) reproduces bit for bit; see "scalar
 * reference kernels" below for the order and why it is not the column order
 * the original engine's scalar path used (docs/MODEL.md 4.3). Dispatch is one
 * table pointer, chosen once (cpuid, then K3_ISA) and changed only by
 * k3_isa_select (a program's --isa, before its threads start) and
 * k3_isa_force (tests, not thread-safe against running kernels).
 */
#include "common/kernels/kernels.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/kernels/kernels_isa.h"
#include "common/base/log.h"

/* ---- tables ---- */

const float k3_e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
const int8_t k3_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
float k3_e8m0_half[256];

float k3_e8m0_to_f32(uint8_t s) {
    uint32_t bits = (uint32_t)s << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- per-thread scratch ---- */

/* One growing buffer per thread (pool workers live as long as the process;
 * the key's destructor frees it when a thread exits). Only kernels use it,
 * for data that lives within one call. */
static pthread_key_t g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

typedef struct {
    void *p[2];
    size_t cap[2];
} scratch_buf;

static void scratch_free(void *v) {
    scratch_buf *b = v;
    free(b->p[0]);
    free(b->p[1]);
    free(b);
}

static void scratch_init(void) { K3_ASSERT(pthread_key_create(&g_scratch_key, scratch_free) == 0); }

static void *scratch_slot(int slot, size_t bytes) {
    pthread_once(&g_scratch_once, scratch_init);
    scratch_buf *b = pthread_getspecific(g_scratch_key);
    if (!b) {
        b = k3_xcalloc(1, sizeof *b);
        K3_ASSERT(pthread_setspecific(g_scratch_key, b) == 0);
    }
    if (b->cap[slot] < bytes) {
        free(b->p[slot]);
        b->cap[slot] = bytes + bytes / 4;
        b->p[slot] = k3_xaligned(64, b->cap[slot]);
    }
    return b->p[slot];
}

void *k3_kern_scratch(size_t bytes) { return scratch_slot(0, bytes); }

/* The wrappers' slot (quantized activations handed to the kernels, which
 * use slot 0 on the same thread when the caller runs a task itself). */
static void *scratch_in(size_t bytes) { return scratch_slot(1, bytes); }

/* ---- ISA dispatch ---- */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static k3_isa g_detected = K3_ISA_SCALAR;
static int g_vbmi_cpu; /* AVX-512 VBMI present */
int k3_kern_vbmi;
static _Atomic(const k3_kern_ops *) g_ops;

const char *k3_isa_name(k3_isa level) {
    switch (level) {
    case K3_ISA_SCALAR: return "scalar";
    case K3_ISA_AVX2: return "avx2";
    case K3_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

static const k3_kern_ops *ops_for(k3_isa level) {
    switch (level) {
    case K3_ISA_AVX512: return &k3_kern_avx512;
    case K3_ISA_AVX2: return &k3_kern_avx2;
    case K3_ISA_SCALAR: break;
    }
    return &k3_kern_scalar;
}

static k3_isa detect_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return K3_ISA_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return K3_ISA_AVX512;
    return K3_ISA_AVX2;
#else
    return K3_ISA_SCALAR;
#endif
}

static int cpu_has_vbmi(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_supports("avx512vbmi");
#else
    return 0;
#endif
}

static int g_warned = K3_ISA_AUTO; /* the too-high wish already warned about */

/* The level to use for a wish (K3_ISA_AUTO or a k3_isa): never above the
 * CPU's, which is said once (the environment's wish is seen twice in a
 * program: at the first kernel call and by its --isa row). */
static k3_isa isa_choose(int want) {
    if (want == K3_ISA_AUTO) return g_detected;
    if (want > (int)g_detected) {
        if (want == g_warned) return g_detected;
        g_warned = want;
        K3_WARN("isa %s: this CPU supports up to %s; using %s", k3_isa_name((k3_isa)want),
                k3_isa_name(g_detected), k3_isa_name(g_detected));
        return g_detected;
    }
    return (k3_isa)want;
}

typedef struct isa_opts {
    int level;
} isa_opts;

static void isa_init(void) {
    for (int s = 0; s < 256; s++) k3_e8m0_half[s] = k3_e8m0_to_f32((uint8_t)s) * 0.5f;
    g_detected = detect_cpu();
    g_vbmi_cpu = g_detected == K3_ISA_AVX512 && cpu_has_vbmi();
    k3_kern_vbmi = g_vbmi_cpu;
    /* the K3_ISA row alone, environment only: a program applies its own
     * parsed value with k3_isa_select, where a bad one is a usage error */
    static const k3_opt isa_table[] = {K3_KERN_OPT_ISA(isa_opts, level)};
    isa_opts o;
    char *argv0 = NULL, err[160];
    int n_pos = 0;
    int want = K3_ISA_AUTO;
    if (k3_opts_parse(isa_table, 1, &o, NULL, 0, &argv0, NULL, &n_pos, err, sizeof err) == K3_OK)
        want = o.level;
    else
        K3_WARN("%s; using %s", err, k3_isa_name(g_detected));
    atomic_store_explicit(&g_ops, ops_for(isa_choose(want)), memory_order_release);
}

static inline const k3_kern_ops *ops(void) {
    const k3_kern_ops *o = atomic_load_explicit(&g_ops, memory_order_acquire);
    if (__builtin_expect(o != NULL, 1)) return o;
    pthread_once(&g_once, isa_init);
    return atomic_load_explicit(&g_ops, memory_order_acquire);
}

k3_isa k3_isa_detect(void) {
    pthread_once(&g_once, isa_init);
    return g_detected;
}

k3_isa k3_isa_active(void) { return ops()->isa; }

k3_status k3_isa_force_vbmi(int on, char *err, size_t errlen) {
    pthread_once(&g_once, isa_init);
    if (on && !g_vbmi_cpu)
        return k3_errf(K3_ERR_ARG, err, errlen, "isa avx512 vbmi: this CPU has no AVX-512 VBMI");
    k3_kern_vbmi = on != 0;
    return K3_OK;
}

void k3_isa_select(int level) {
    pthread_once(&g_once, isa_init);
    atomic_store_explicit(&g_ops, ops_for(isa_choose(level)), memory_order_release);
}

k3_status k3_isa_force(k3_isa level, char *err, size_t errlen) {
    pthread_once(&g_once, isa_init);
    if (level < K3_ISA_SCALAR || level > K3_ISA_AVX512)
        return k3_errf(K3_ERR_ARG, err, errlen, "isa level %d: not in [0, 2]", (int)level);
    if (level > g_detected)
        return k3_errf(K3_ERR_ARG, err, errlen, "isa %s: this CPU supports up to %s",
                       k3_isa_name(level), k3_isa_name(g_detected));
    atomic_store_explicit(&g_ops, ops_for(level), memory_order_release);
    return K3_OK;
}

/* ---- scalar reference kernels ----
 *
 * Exact-float order, reproduced bit for bit by every ISA level: 16 float
 * lanes per (row, token) (AVX-512: one zmm; AVX2: two ymm, lanes 0-7 and
 * 8-15). Each step is one fused multiply-add (C99 fmaf here, vfmadd there:
 * both round once, so they agree bit for bit). At the end the lanes are
 * summed by the tree t[k] = l[k] + l[k+8], ((t0+t4)+(t2+t6)) +
 * ((t1+t5)+(t3+t7)).
 *   f32 / int8: lane k owns columns k, k+16, k+32, ...; the cols % 16 tail
 *     columns are then added in column order (fmaf); int8 multiplies the
 *     row scale last.
 *   MXFP4 (the "nibble order"): a group of 32 columns is 16 packed bytes
 *     and lane k owns byte k: column 2k (low nibble), then 2k+1 (high
 *     nibble). Per group a 16-lane sum (a plain multiply, then fmaf),
 *     folded in as acc = fmaf(group sum, group factor, acc).
 *   int4-g64 (the "fixed-point order"): a block of 128 columns (two
 *     groups) is 64 packed bytes, i.e. 16 little-endian dwords; lane k owns
 *     dword k, whose nibble j (bits 4j..4j+3) is column 8k + j; lanes 0-7
 *     hold the block's first group, 8-15 its second. Per token and lane,
 *     with m = max|x| over the lane's 8 columns = f 2^e (frexpf, 0.5 <= f <
 *     1; m = 0 counts as e = -190), E = max(e - 22, -149) and X = rint(x
 *     2^-E), half to even: |X| <= 2^22, so each x is held to 2^(e-23) <=
 *     2^-22 m, near a float's precision at the lane's largest element (and
 *     exactly when E = -149: every float is a multiple of 2^-149); smaller
 *     elements of the lane keep fewer bits. Per block the lane's
 *     exact integer A_k = sum_j (nibble_j - 8) X_{8k+j} (|A| <= 2^28), folded
 *     in as acc = fmaf((float)A_k * 2^E, the lane's group scale, acc). A
 *     last lone group (cols % 128 = 64) fills lanes 0-7 only. A lane with
 *     inf or NaN gets 2^E = NaN (its rows' results are NaN). A vector level
 *     gets A_k from integer dot products of the nibbles with three signed
 *     8-bit digits of X (k3_i4x_block): one 64-byte load per row and block
 *     and six vpdpbusd, where float FMAs need a decode and a multiply-add
 *     per 16 weights.
 *
 * Why not one column-order sum: over 7168 columns it carries ~1.5e-6
 * relative error by itself, so no vector kernel could be "within 1e-6" of
 * it; a shared lane order makes them equal instead (and more accurate). The
 * cost is a libm fmaf per multiply-add here; the scalar level is a
 * reference and a fallback, not a fast path. */

#define LANES 16

static inline float lane_tree(const float a[LANES]) {
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = a[k] + a[k + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static void sc_f32_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    const int cols = m->cols, cl = cols / LANES * LANES;
    for (int r = r0; r < r1; r++) {
        const float *w = m->w + (size_t)r * cols;
        for (int t = 0; t < n; t++) {
            const float *xt = x + (size_t)t * cols;
            float a[LANES] = {0};
            for (int c = 0; c < cl; c += LANES)
                for (int k = 0; k < LANES; k++) a[k] = fmaf(w[c + k], xt[c + k], a[k]);
            float acc = lane_tree(a);
            for (int c = cl; c < cols; c++) acc = fmaf(w[c], xt[c], acc);
            y[(size_t)t * m->rows + r] = acc;
        }
    }
}

static void sc_i8_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    const int cols = m->cols, cl = cols / LANES * LANES;
    for (int r = r0; r < r1; r++) {
        const int8_t *q = m->q8 + (size_t)r * cols;
        for (int t = 0; t < n; t++) {
            const float *xt = x + (size_t)t * cols;
            float a[LANES] = {0};
            for (int c = 0; c < cl; c += LANES)
                for (int k = 0; k < LANES; k++) a[k] = fmaf((float)q[c + k], xt[c + k], a[k]);
            float acc = lane_tree(a);
            for (int c = cl; c < cols; c++) acc = fmaf((float)q[c], xt[c], acc);
            y[(size_t)t * m->rows + r] = acc * m->scales[r]; /* row scale last */
        }
    }
}

/* One lane's 8 columns x (the fixed-point order above) -> X and 2^E. */
static void i4x_lane(const float *x, int32_t X[8], float *e) {
    float m = 0.0f;
    int finite = 1;
    for (int j = 0; j < 8; j++) {
        const float a = fabsf(x[j]);
        finite &= a <= FLT_MAX; /* false for inf and NaN */
        m = a > m ? a : m;
    }
    int ex = -190; /* m = 0: E = -149 like the smallest subnormal */
    if (m > 0.0f) (void)frexpf(m, &ex);
    const int E = ex - 22 > -149 ? ex - 22 : -149;
    /* x * 2^-E in two exact power-of-two steps (2^-E <= 2^149) */
    const float pre = -E > 126 ? 0x1p64f : 1.0f;
    const float inv = ldexpf(1.0f, -E > 126 ? -E - 64 : -E);
    for (int j = 0; j < 8; j++) {
        const float v = finite ? x[j] * pre * inv : 0.0f; /* |v| <= 2^22 */
        X[j] = (int32_t)((v + 0x1.8p23f) - 0x1.8p23f);    /* rint, half to even: exact here */
    }
    *e = finite ? ldexpf(1.0f, E) : NAN;
}

/* Fixed-point order (above), one group of 64 columns: flat loops. */
static void i4x_group(const float *x, k3_i4x_block *blk, int h) {
    int32_t X[64];
    for (int k = 0; k < 8; k++) i4x_lane(x + 8 * k, X + 8 * k, &blk->e[8 * h + k]);
    int8_t d[3][64];
    for (int i = 0; i < 64; i++) {
        const int32_t d0 = (int32_t)(((uint32_t)X[i] + 128u) & 255u) - 128;
        const int32_t t = (X[i] - d0) / 256; /* exact */
        const int32_t d1 = (int32_t)(((uint32_t)t + 128u) & 255u) - 128;
        d[0][i] = (int8_t)d0, d[1][i] = (int8_t)d1, d[2][i] = (int8_t)((t - d1) / 256);
    }
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < 32; i++) {
            blk->d[p][0][32 * h + i] = d[p][2 * i];
            blk->d[p][1][32 * h + i] = d[p][2 * i + 1];
        }
    int32_t sum[8] = {0};
    for (int i = 0; i < 64; i++) sum[i / 8] += X[i];
    for (int k = 0; k < 8; k++) blk->c[8 * h + k] = -8 * sum[k];
}

/* x [n][cols] -> n x k3_i4_xblocks(cols) blocks at xb (cols % 64 == 0). */
static void i4_xfix(const float *x, int n, int cols, k3_i4x_block *xb, k3_i4x_group_fn group) {
    const size_t nb = k3_i4_xblocks(cols);
    for (int t = 0; t < n; t++)
        for (size_t b = 0; b < nb; b++) {
            k3_i4x_block *blk = xb + (size_t)t * nb + b;
            const float *xt = x + (size_t)t * cols + 128 * b;
            if (128 * b + 64 >= (size_t)cols) { /* a lone last group: lanes 8-15 zero */
                memset(blk->d, 0, sizeof blk->d);
                memset(blk->c + 8, 0, 8 * sizeof(int32_t));
                memset(blk->e + 8, 0, 8 * sizeof(float));
            } else
                group(xt + 64, blk, 1);
            group(xt, blk, 0);
        }
}

void k3_i4_rows_chunked(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1,
                        k3_i4x_group_fn group, k3_i4_chunk_fn run) {
    const int cols = m->cols;
    const size_t nb = k3_i4_xblocks(cols);
    const int tch = k3_kern_chunk(n, nb * sizeof(k3_i4x_block));
    k3_i4x_block *xb = k3_kern_scratch((size_t)tch * nb * sizeof(k3_i4x_block));
    for (int t0 = 0; t0 < n; t0 += tch) {
        const int tn = n - t0 < tch ? n - t0 : tch;
        i4_xfix(x + (size_t)t0 * cols, tn, cols, xb, group);
        run(m, (const float *)xb, tn, y + (size_t)t0 * m->rows, r0, r1);
    }
}

/* Fixed-point order (above), one token chunk of blocks. */
static void sc_i4_chunk(const k3_qmat *m, const float *xp, int n, float *y, int r0, int r1) {
    const int cols = m->cols, ng = cols / 64;
    const size_t nb = k3_i4_xblocks(cols);
    const k3_i4x_block *xb = (const k3_i4x_block *)xp;
    for (int r = r0; r < r1; r++) {
        const uint8_t *q = m->q4 + (size_t)r * (cols / 2);
        const float *sc = m->scales + (size_t)r * ng;
        for (int t = 0; t < n; t++) {
            float a[LANES] = {0};
            for (int g = 0; g < ng; g += 2) {
                const k3_i4x_block *b = xb + (size_t)t * nb + g / 2;
                const int lanes = g + 1 < ng ? LANES : LANES / 2;
                for (int k = 0; k < lanes; k++) {
                    const uint8_t *d = q + g * 32 + 4 * k; /* dword k of the block */
                    int32_t A = b->c[k];
                    for (int j = 0; j < 8; j++) {
                        const int at = 4 * k + j / 2, h = j & 1;
                        const int32_t X =
                            b->d[0][h][at] + 256 * b->d[1][h][at] + 65536 * b->d[2][h][at];
                        A += ((d[j / 2] >> (4 * h)) & 15) * X;
                    }
                    a[k] = fmaf((float)A * b->e[k], sc[g + k / 8], a[k]);
                }
            }
            y[(size_t)t * m->rows + r] = lane_tree(a);
        }
    }
}

static void sc_i4_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    k3_i4_rows_chunked(m, x, n, y, r0, r1, i4x_group, sc_i4_chunk);
}

/* MXFP4 exact-float (docs/MODEL.md 4.1): y = sum_g 2^(s-127) * sum_{i in g} x v(n).
 * Computed as sum_g (2^(s-127)/2) * sum x*(2v): every product and partial
 * sum is exactly twice the one with v (a power-of-two scaling), so the value
 * is docs/MODEL.md's, and the doubled integers are what the vector kernels use. */
static void sc_mx_f32(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1) {
    const int cols = w->cols, ng = cols / 32;
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = w->packed + (size_t)r * (cols / 2);
        const uint8_t *s = w->scale + (size_t)r * ng;
        for (int t = 0; t < n; t++) {
            const float *xt = x + (size_t)t * cols;
            float a[LANES] = {0};
            for (int g = 0; g < ng; g++) {
                const float e = k3_e8m0_half[s[g]];
                for (int k = 0; k < LANES; k++) {
                    const uint8_t b = p[g * 16 + k];
                    float gs = (float)k3_e2m1_x2[b & 15] * xt[g * 32 + 2 * k];
                    gs = fmaf((float)k3_e2m1_x2[b >> 4], xt[g * 32 + 2 * k + 1], gs);
                    a[k] = fmaf(gs, e, a[k]);
                }
            }
            y[(size_t)t * w->rows + r] = lane_tree(a);
        }
    }
}

static float mx_i8_row(const uint8_t *packed, const uint8_t *scale, int cols, const int8_t *xq,
                       const float *xs) {
    float acc = 0.0f;
    for (int g = 0; g < cols / 32; g++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            uint8_t b = packed[g * 16 + j];
            isum += k3_e2m1_x2[b & 15] * xq[g * 32 + 2 * j];
            isum += k3_e2m1_x2[b >> 4] * xq[g * 32 + 2 * j + 1];
        }
        /* 2^(s-127) * 0.5 * sx, then the exact integer sum times it */
        float f = k3_e8m0_half[scale[g]] * xs[g];
        acc += (float)isum * f;
    }
    return acc;
}

void k3_mx_i8_rows_scalar(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                          int r0, int r1) {
    const int cols = w->cols, ng = cols / 32;
    for (int r = r0; r < r1; r++) {
        const uint8_t *p = w->packed + (size_t)r * (cols / 2);
        const uint8_t *s = w->scale + (size_t)r * ng;
        for (int t = 0; t < n; t++)
            y[(size_t)t * w->rows + r] =
                mx_i8_row(p, s, cols, xq + (size_t)t * cols, xs + (size_t)t * ng);
    }
}

/* Dense integer-dot (kernels.h): per group of 32 columns the exact
 * integer sum, then the float part in group order. */
float k3_q8_row_scalar(const k3_qmat *m, int r, const int8_t *xq, const float *xs) {
    const int cols = m->cols, ng = cols / 32;
    float acc = 0.0f;
    if (m->fmt == K3_QF_I8) {
        const int8_t *w = m->q8 + (size_t)r * cols;
        for (int g = 0; g < ng; g++) {
            int32_t isum = 0;
            for (int i = 0; i < 32; i++) isum += w[g * 32 + i] * xq[g * 32 + i];
            acc += (float)isum * xs[g];
        }
        return acc * m->scales[r]; /* row scale last */
    }
    K3_ASSERT(m->fmt == K3_QF_I4G64);
    const uint8_t *p = m->q4 + (size_t)r * (cols / 2);
    const float *s4 = m->scales + (size_t)r * (cols / 64);
    for (int g = 0; g < ng; g++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t b = p[g * 16 + j];
            isum += ((b & 15) - 8) * xq[g * 32 + 2 * j];
            isum += ((b >> 4) - 8) * xq[g * 32 + 2 * j + 1];
        }
        const float f = s4[g / 2] * xs[g];
        acc += (float)isum * f;
    }
    return acc;
}

void k3_q8_rows_scalar(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y, int r0,
                       int r1) {
    const int ng = m->cols / 32;
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < n; t++)
            y[(size_t)t * m->rows + r] =
                k3_q8_row_scalar(m, r, xq + (size_t)t * m->cols, xs + (size_t)t * ng);
}

/* Clamps written as the comparisons minps/maxps perform (a < b ? a : b), so
 * that a NaN lands on the same side in the scalar and vector quantizers. */
static inline float clampf(float v, float lo, float hi) {
    v = v < hi ? v : hi;
    return v > lo ? v : lo;
}

static void sc_act_q8(const float *x, int n, int cols, int8_t *q, float *s) {
    const int ng = cols / 32;
    for (int t = 0; t < n; t++) {
        for (int g = 0; g < ng; g++) {
            const float *xg = x + (size_t)t * cols + g * 32;
            int8_t *qg = q + (size_t)t * cols + g * 32;
            float m = 0.0f;
            for (int i = 0; i < 32; i++) {
                float a = fabsf(xg[i]);
                m = a > m ? a : m;
            }
            float sg = m / 127.0f;
            sg = sg > 1e-20f ? sg : 1e-20f;
            float inv = 1.0f / sg;
            for (int i = 0; i < 32; i++) qg[i] = (int8_t)clampf(rintf(xg[i] * inv), -127.f, 127.f);
            s[(size_t)t * ng + g] = sg;
        }
    }
}

const k3_kern_ops k3_kern_scalar = {
    .isa = K3_ISA_SCALAR,
    .f32_rows = sc_f32_rows,
    .i8_rows = sc_i8_rows,
    .i4_rows = sc_i4_rows,
    .mx_f32 = sc_mx_f32,
    .mx_i8 = k3_mx_i8_rows_scalar,
    .act_q8 = sc_act_q8,
    .q8_rows = k3_q8_rows_scalar,
};

/* ---- load-time quantization (docs/MODEL.md 4.2) ---- */

static float max_abs(const float *v, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(v[i]);
        m = a > m ? a : m;
    }
    return m;
}

void k3_qmat_quantize(k3_qmat *m, const float *w, int rows, int cols, int bits) {
    K3_ASSERT(rows >= 0 && cols > 0);
    memset(m, 0, sizeof *m);
    m->rows = rows;
    m->cols = cols;
    m->owned = 1;
    const size_t nel = (size_t)rows * (size_t)cols;
    if (bits >= 32) {
        m->fmt = K3_QF_F32;
        m->w = k3_xaligned(64, nel * sizeof(float));
        memcpy(m->w, w, nel * sizeof(float));
        return;
    }
    if (bits <= 4 && cols % 64 == 0) {
        const int ng = cols / 64;
        m->fmt = K3_QF_I4G64;
        m->q4 = k3_xaligned(64, nel / 2);
        m->scales = k3_xaligned(64, (size_t)rows * ng * sizeof(float));
        for (int r = 0; r < rows; r++) {
            for (int g = 0; g < ng; g++) {
                const float *wg = w + (size_t)r * cols + g * 64;
                uint8_t *qg = m->q4 + (size_t)r * (cols / 2) + g * 32;
                float s = max_abs(wg, 64) / 7.0f;
                s = s > 1e-20f ? s : 1e-20f;
                float inv = 1.0f / s;
                for (int j = 0; j < 32; j++) {
                    int lo = (int)clampf(rintf(wg[2 * j] * inv), -8.f, 7.f) + 8;
                    int hi = (int)clampf(rintf(wg[2 * j + 1] * inv), -8.f, 7.f) + 8;
                    qg[j] = (uint8_t)(lo | hi << 4); /* even column in the low nibble */
                }
                m->scales[(size_t)r * ng + g] = s;
            }
        }
        return;
    }
    m->fmt = K3_QF_I8;
    m->q8 = k3_xaligned(64, nel);
    m->scales = k3_xaligned(64, (size_t)rows * sizeof(float));
    for (int r = 0; r < rows; r++) {
        const float *wr = w + (size_t)r * cols;
        int8_t *qr = m->q8 + (size_t)r * cols;
        float s = max_abs(wr, cols) / 127.0f;
        s = s > 1e-20f ? s : 1e-20f;
        float inv = 1.0f / s; /* multiply by the reciprocal, do not divide (docs/MODEL.md 4.2) */
        for (int c = 0; c < cols; c++) qr[c] = (int8_t)clampf(rintf(wr[c] * inv), -127.f, 127.f);
        m->scales[r] = s;
    }
}

void k3_qmat_downcast_i4(k3_qmat *dst, const k3_qmat *src) {
    K3_ASSERT(src->fmt == K3_QF_I8 && src->cols % 64 == 0);
    const int rows = src->rows, cols = src->cols, ng = cols / 64;
    memset(dst, 0, sizeof *dst);
    dst->fmt = K3_QF_I4G64;
    dst->rows = rows;
    dst->cols = cols;
    dst->owned = 1;
    dst->q4 = k3_xaligned(64, (size_t)rows * cols / 2);
    dst->scales = k3_xaligned(64, (size_t)rows * ng * sizeof(float));
    for (int r = 0; r < rows; r++) {
        const float s8 = src->scales[r];
        for (int g = 0; g < ng; g++) {
            const int8_t *qg = src->q8 + (size_t)r * cols + g * 64;
            uint8_t *og = dst->q4 + (size_t)r * (cols / 2) + g * 32;
            int a = 0;
            for (int i = 0; i < 64; i++) a = abs(qg[i]) > a ? abs(qg[i]) : a;
            /* s = a * s8_row / 7. An all-zero group (a = 0) would give s = 0
             * and a 0/0 ratio; the original rule does not say, so it takes the
             * 1e-20 floor of the other quantizers (its q4 are 0 either way;
             * docs/MODEL.md 4.2). */
            float s = (float)a * s8 / 7.0f;
            s = s > 1e-20f ? s : 1e-20f;
            float ratio = s8 / s;
            for (int j = 0; j < 32; j++) {
                int lo = (int)clampf(rintf((float)qg[2 * j] * ratio), -8.f, 7.f) + 8;
                int hi = (int)clampf(rintf((float)qg[2 * j + 1] * ratio), -8.f, 7.f) + 8;
                og[j] = (uint8_t)(lo | hi << 4);
            }
            dst->scales[(size_t)r * ng + g] = s;
        }
    }
}

void k3_qmat_free(k3_qmat *m) {
    if (!m) return;
    if (m->owned) {
        free(m->w);
        free(m->q8);
        free(m->q4);
        free(m->scales);
    }
    memset(m, 0, sizeof *m);
}

size_t k3_qmat_bytes(const k3_qmat *m) {
    const size_t nel = (size_t)m->rows * (size_t)m->cols;
    switch (m->fmt) {
    case K3_QF_F32: return nel * sizeof(float);
    case K3_QF_I8: return nel + (size_t)m->rows * sizeof(float);
    case K3_QF_I4G64: return nel / 2 + (size_t)m->rows * (m->cols / 64) * sizeof(float);
    }
    return 0;
}

/* ---- public kernels ---- */

void k3_qmat_matmul_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1) {
    K3_ASSERT(0 <= r0 && r0 <= r1 && r1 <= m->rows && n >= 0);
    if (n == 0 || r0 == r1) return;
    const k3_kern_ops *o = ops();
    switch (m->fmt) {
    case K3_QF_F32: o->f32_rows(m, x, n, y, r0, r1); return;
    case K3_QF_I8: o->i8_rows(m, x, n, y, r0, r1); return;
    case K3_QF_I4G64:
        K3_ASSERT(m->cols % 64 == 0);
        o->i4_rows(m, x, n, y, r0, r1);
        return;
    }
    K3_ASSERT(!"k3_qmat: unknown format");
}

int k3_qmat_uses_idot(const k3_qmat *m) {
    return m->idot && (m->fmt == K3_QF_I8 || m->fmt == K3_QF_I4G64) && m->cols % 32 == 0;
}

void k3_qmat_matmul_q8_rows(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                            int r0, int r1) {
    K3_ASSERT(0 <= r0 && r0 <= r1 && r1 <= m->rows && n >= 0 && m->cols % 32 == 0);
    K3_ASSERT(m->fmt == K3_QF_I8 || (m->fmt == K3_QF_I4G64 && m->cols % 64 == 0));
    if (n == 0 || r0 == r1) return;
    ops()->q8_rows(m, xq, xs, n, y, r0, r1);
}

void k3_mxfp4_matmul_f32(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1) {
    K3_ASSERT(w->cols % 32 == 0 && 0 <= r0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    if (n == 0 || r0 == r1) return;
    ops()->mx_f32(w, x, n, y, r0, r1);
}

void k3_mxfp4_matmul_i8(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                        int r0, int r1) {
    K3_ASSERT(w->cols % 32 == 0 && 0 <= r0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    if (n == 0 || r0 == r1) return;
    ops()->mx_i8(w, xq, xs, n, y, r0, r1);
}

void k3_act_quant_q8(const float *x, int n, int cols, int8_t *q, float *s) {
    K3_ASSERT(cols % 32 == 0 && n >= 0);
    if (n == 0) return;
    ops()->act_q8(x, n, cols, q, s);
}

/* ---- threaded wrappers ---- */

/* Rows are split into tasks of a multiple of 16 rows (the largest vector
 * row block: AVX-512 integer-dot), 2 tasks per thread so a slow thread does
 * not hold up the others. Each task start is a new set of row streams for
 * the prefetchers: against 4 per thread, 2 per thread measured +1-3 % for
 * MXFP4 i8 at n = 1 and +4-9 % for int8 integer-dot at n = 8 and 32 from RAM
 * on 2 threads (make bench-ab), the rest level; 16 per thread lost 8 %.
 * Any split gives the same bits (kernels_isa.h). */
typedef struct mm_job {
    int kind; /* 0 qmat, 1 mxfp4 f32, 2 mxfp4 i8, 3 qmat integer-dot */
    const k3_qmat *m;
    const k3_mxfp4 *w;
    const float *x;
    const int8_t *xq;
    const float *xs;
    int n, rows, rows_per_task;
    float *y;
} mm_job;

static void mm_task(void *ctx, int task) {
    const mm_job *j = ctx;
    int r0 = task * j->rows_per_task;
    int r1 = r0 + j->rows_per_task < j->rows ? r0 + j->rows_per_task : j->rows;
    switch (j->kind) {
    case 0: k3_qmat_matmul_rows(j->m, j->x, j->n, j->y, r0, r1); break;
    case 1: k3_mxfp4_matmul_f32(j->w, j->x, j->n, j->y, r0, r1); break;
    case 3: k3_qmat_matmul_q8_rows(j->m, j->xq, j->xs, j->n, j->y, r0, r1); break;
    default: k3_mxfp4_matmul_i8(j->w, j->xq, j->xs, j->n, j->y, r0, r1); break;
    }
}

static void mm_run(mm_job *j, k3_pool *pool) {
    int threads = k3_pool_threads(pool);
    int blocks = (j->rows + 15) / 16;
    int tasks = threads == 1 ? 1 : threads * 2;
    if (tasks > blocks) tasks = blocks;
    if (tasks < 1) tasks = 1;
    j->rows_per_task = (blocks + tasks - 1) / tasks * 16;
    tasks = (j->rows + j->rows_per_task - 1) / j->rows_per_task;
    if (tasks <= 1) {
        mm_task(j, 0);
        return;
    }
    k3_pool_run(pool, mm_task, j, tasks);
}

void k3_qmat_matmul(const k3_qmat *m, const float *x, int n, float *y, k3_pool *pool) {
    if (n <= 0 || m->rows == 0) return;
    if (!k3_qmat_uses_idot(m)) {
        mm_job j = {.kind = 0, .m = m, .x = x, .n = n, .rows = m->rows, .y = y};
        mm_run(&j, pool);
        return;
    }
    /* quantize on the calling thread into its scratch (the pool's threads
     * use their own for the kernel), in token chunks under the cap */
    const int cols = m->cols, ng = cols / 32;
    const size_t per_tok = (size_t)cols + (size_t)ng * sizeof(float);
    const int tch = k3_kern_chunk(n, per_tok);
    int8_t *xq = scratch_in((size_t)tch * per_tok);
    float *xs = (float *)(xq + (size_t)tch * cols); /* cols % 32 == 0: aligned */
    for (int t0 = 0; t0 < n; t0 += tch) {
        const int tn = n - t0 < tch ? n - t0 : tch;
        k3_act_quant_q8(x + (size_t)t0 * cols, tn, cols, xq, xs);
        mm_job j = {.kind = 3,
                    .m = m,
                    .xq = xq,
                    .xs = xs,
                    .n = tn,
                    .rows = m->rows,
                    .y = y + (size_t)t0 * m->rows};
        mm_run(&j, pool);
    }
}

void k3_mxfp4_matmul_f32_mt(const k3_mxfp4 *w, const float *x, int n, float *y, k3_pool *pool) {
    if (n <= 0 || w->rows == 0) return;
    mm_job j = {.kind = 1, .w = w, .x = x, .n = n, .rows = w->rows, .y = y};
    mm_run(&j, pool);
}

void k3_mxfp4_matmul_i8_mt(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                           k3_pool *pool) {
    if (n <= 0 || w->rows == 0) return;
    mm_job j = {.kind = 2, .w = w, .xq = xq, .xs = xs, .n = n, .rows = w->rows, .y = y};
    mm_run(&j, pool);
}
