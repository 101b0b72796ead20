/* common/kernels/ops_isa.h: the private seam between the layer operators (ops.c,
 * kda.c, mla.c, attnres.c) and their per-ISA backends (ops.c scalar,
 * ops_avx2.c, ops_avx512.c, both built from the template ops_vec.h). Not for
 * use outside those files (and tests/test_ops.c).
 *
 * Owns the k3_ops_tab table type and the one summation order every backend
 * reproduces bit for bit, so that the layers give the same bits at every
 * K3_ISA level (a cluster of mixed-ISA workers stays bit-exact):
 *   - float reductions: 16 lanes, lane k owns elements k, k+16, ...; the
 *     lanes are summed by the tree of kernels.c (t[k] = l[k] + l[k+8],
 *     ((t0+t4)+(t2+t6)) + ((t1+t5)+(t3+t7))), then the n % 16 tail in
 *     element order. Multiply-adds are fused (fmaf / vfmadd) where the table
 *     says so; plain sums use adds.
 *   - double reductions (docs/MODEL.md 3.1, 3.3, 4.3): 8 lanes of double,
 *     lane k owns elements k, k+8, ...; products of two floats are exact in
 *     double; tree ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the tail.
 *   - exp: k3_exp_ref below (not libm's expf), the same operations in every
 *     lane of every backend; sigmoid, SiLU and tanh are built on it.
 *   - everything else is per element (lanes never mix), so a vector is the
 *     scalar loop done 16 elements at a time.
 * Tables are constant; the dispatcher picks one per call from
 * k3_isa_active() (so k3_isa_force in tests switches them too). All
 * functions are reentrant.
 */
#ifndef K3_OPS_ISA_H
#define K3_OPS_ISA_H

#include <math.h>
#include <stddef.h>

#include "common/kernels/kernels.h"

typedef struct k3_ops_tab {
    k3_isa isa;
    /* KDA, one head, S [d][d] key-major (docs/MODEL.md 3.4):
     * decay_read: S[i][:] *= alpha[i], u[j] = sum_i fmaf(k[i], S[i][j]) in
     *   key order (u starts at 0);
     * write_read: S[i][j] = fmaf(k[i], delta[j], S[i][j]), o[j] = sum_i
     *   fmaf(q[i], S[i][j]) from the updated S, key order. */
    void (*kda_decay_read)(float *S, int d, const float *alpha, const float *k, float *u);
    void (*kda_write_read)(float *S, int d, const float *k, const float *delta, const float *q,
                           float *o);
    /* KDA short conv with 4 taps over d channels (docs/MODEL.md 3.4), in place: per
     * channel the window win[c][0..3] (oldest first) shifts left and takes
     * u[c] last, then u[c] = ((0 + t0 w0) + t1 w1) + t2 w2) + t3 w3 (products
     * rounded, then the adds in tap order); taps [d][4]. */
    void (*conv4)(float *u, float *win, const float *taps, int d);
    /* acc[t][c] = sum_{i < nrows} fmaf(coef[t][i] * s(i, c), W[row0 + i][c], .)
     * in row order from 0, in W's load format (s: 1 for f32, the int8 row
     * scale, the int4 group scale); coef[t] = coef + t * coef_ld, acc[t] =
     * acc + t * acc_ld (m->cols floats). The MLA q_abs = K_h^T q_nope build
     * (docs/MODEL.md 3.5). */
    void (*rows_comb)(const k3_qmat *m, int row0, int nrows, const float *coef, size_t coef_ld,
                      int T, float *acc, size_t acc_ld);
    /* acc[q][c] = sum_{s < n} fmaf(p[q][s], rows[s][c], .) in row order from
     * 0, for q < nq queries sharing the rows; p[q] = p + q * p_ld, acc[q] =
     * acc + q * acc_ld; rows [n][cols] contiguous. The MLA latent context of
     * a group of heads (each cache row read once per group). */
    void (*wsum_multi)(const float *rows, int cols, const float *p, size_t p_ld, int nq, int n,
                       float *acc, size_t acc_ld);
    /* in place: x = exp(x - max) / sum, max ignoring NaN, sum in the lane order */
    void (*softmax)(float *x, int n);
    /* out = [b1 tanh(g/b1) sigma(g)] * [b2 tanh(u/b2)], left to right */
    void (*situ)(float *out, const float *g, const float *u, int n, float b1, float b2);
    /* out = x * sigma(g) (the attention output gates); out may alias x */
    void (*sigmoid_mul)(float *out, const float *x, const float *g, int n);
    /* in place: x = x * sigma(x) */
    void (*silu)(float *x, int n);
    /* alpha = exp(lb * sigma(A * (z + dt))) (KDA decay, docs/MODEL.md 3.4) */
    void (*kda_alpha)(float *alpha, const float *z, const float *dt, float A, float lb, int n);
    /* sum x^2, float lanes with fmaf (the KDA L2 norms) */
    float (*sumsq)(const float *x, int n);
    /* sum x^2 and sum x w in double lanes; w may be NULL (no dot) */
    void (*sumsq_dot_d)(const float *x, const float *w, int n, double *ss, double *dot);
    /* out = (x * r) * w (the RMSNorm output); out may alias x */
    void (*scale_mul)(float *out, const float *x, float r, const float *w, int n);
    /* out[d] = sum_e pi[e] * v[e][d] in entry order, multiply then add */
    void (*mix)(float *out, const float *const *v, const float *pi, int n, int D);
    /* in place: x = k3_exp_ref(x), x = k3_tanh_ref(x) (the shared maps) */
    void (*exp_map)(float *x, int n);
    void (*tanh_map)(float *x, int n);
} k3_ops_tab;

extern const k3_ops_tab k3_ops_scalar;
extern const k3_ops_tab k3_ops_avx2;
extern const k3_ops_tab k3_ops_avx512;

/* The table of the active ISA level. */
const k3_ops_tab *k3_ops(void);

/* ---- the shared exp ----
 *
 * e^x = 2^n p(r): n = rint(x log2 e), r = x - n ln2 (two fmaf, Cody-Waite
 * split of ln2), p the degree-7 Taylor polynomial in Horner form with fmaf
 * (|r| <= 0.35: truncation 6e-9 relative), then two exact power-of-two
 * scalings 2^(n/2) 2^(n - n/2) so that overflow and gradual underflow come
 * out of the last multiply. x is first clamped to [-104, 89] (e^-104 and
 * e^89 are already 0 and inf in float); NaN stays NaN. Max error ~1 ulp.
 * Every backend runs exactly these operations per lane. */
#define K3_EXP_LOG2E  1.44269502f
#define K3_EXP_LN2_HI 0.693145751953125f      /* 0x3f317200: n * hi is exact */
#define K3_EXP_LN2_LO 1.42860676533018704e-6f /* ln2 - hi */
#define K3_EXP_C7     (1.0f / 5040.0f)
#define K3_EXP_C6     (1.0f / 720.0f)
#define K3_EXP_C5     (1.0f / 120.0f)
#define K3_EXP_C4     (1.0f / 24.0f)
#define K3_EXP_C3     (1.0f / 6.0f)
#define K3_EXP_C2     0.5f

/* 2^k for an integral k in [-126, 127], from the exponent bits */
static inline float k3_pow2i_ref(float k) {
    union {
        unsigned u;
        float f;
    } b;
    b.u = (unsigned)((int)k + 127) << 23;
    return b.f;
}

static inline float k3_exp_ref(float x) {
    if (x != x) return x + x;
    x = x > -104.0f ? x : -104.0f; /* the maxps/minps order of the vector code */
    x = x < 89.0f ? x : 89.0f;
    const float n = rintf(x * K3_EXP_LOG2E);
    float r = fmaf(n, -K3_EXP_LN2_HI, x);
    r = fmaf(n, -K3_EXP_LN2_LO, r);
    float p = K3_EXP_C7;
    p = fmaf(p, r, K3_EXP_C6);
    p = fmaf(p, r, K3_EXP_C5);
    p = fmaf(p, r, K3_EXP_C4);
    p = fmaf(p, r, K3_EXP_C3);
    p = fmaf(p, r, K3_EXP_C2);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const float n1 = truncf(n * 0.5f), n2 = n - n1; /* |n1|, |n2| <= 75 */
    return (p * k3_pow2i_ref(n1)) * k3_pow2i_ref(n2);
}

/* tanh(x) = sign(x) e / (e + 2), e = expm1(2|x|) computed as
 * 2^n (p(r) - 1) + (2^n - 1) with p - 1 = fmaf(r^2, q(r), r) (no
 * cancellation near 0); |x| is clamped to 9.5 (tanh = 1 in float from
 * 9.01). Max error ~3 ulp. NaN stays NaN. */
static inline float k3_tanh_ref(float x) {
    if (x != x) return x + x;
    float y = 2.0f * fabsf(x);
    y = y < 19.0f ? y : 19.0f;
    const float n = rintf(y * K3_EXP_LOG2E);
    float r = fmaf(n, -K3_EXP_LN2_HI, y);
    r = fmaf(n, -K3_EXP_LN2_LO, r);
    float q = K3_EXP_C7;
    q = fmaf(q, r, K3_EXP_C6);
    q = fmaf(q, r, K3_EXP_C5);
    q = fmaf(q, r, K3_EXP_C4);
    q = fmaf(q, r, K3_EXP_C3);
    q = fmaf(q, r, K3_EXP_C2);
    const float pm1 = fmaf(r * r, q, r);
    const float s = k3_pow2i_ref(n); /* n <= 28 */
    const float e = fmaf(s, pm1, s - 1.0f);
    return copysignf(e / (e + 2.0f), x);
}

static inline float k3_sigmoid_ref(float z) { return 1.0f / (1.0f + k3_exp_ref(-z)); }

#endif
