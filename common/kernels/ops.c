/* common/kernels/ops.c: the small operators of the forward pass with the precision
 * docs/MODEL.md fixes (3.1, 3.4, 3.8, 4.3), the scalar backend
 * of the layer operators (ops_isa.h) with its dispatcher.
 *
 * The scalar backend defines the numbers: every vector backend
 * (ops_avx2.c, ops_avx512.c, one text in ops_vec.h) runs the same
 * operations in the same order, so each function gives the same bits at
 * every K3_ISA level, on any thread. The precision of docs/MODEL.md is kept where it
 * is semantic: the RMSNorm sum of squares and the AttnRes dots in double,
 * softmax in float with the max subtracted. Where the math fixes no order,
 * ops_isa.h does. Transcendentals use k3_exp_ref / k3_tanh_ref (~1-3 ulp),
 * not libm, since a vector backend cannot reproduce libm's bits.
 */
#include <math.h>
#include <string.h>

#include "common/kernels/ops.h"
#include "common/kernels/ops_isa.h"

/* ---- dispatch ---- */

const k3_ops_tab *k3_ops(void) {
    switch (k3_isa_active()) {
    case K3_ISA_AVX512: return &k3_ops_avx512;
    case K3_ISA_AVX2: return &k3_ops_avx2;
    case K3_ISA_SCALAR: break;
    }
    return &k3_ops_scalar;
}

/* ---- scalar backend: the reference order of ops_isa.h ---- */

#define LANES 16

/* the lane tree of kernels.c: t[k] = a[k] + a[k+8], then pairs */
static float lane_tree(const float a[LANES]) {
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = a[k] + a[k + 8];
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

static double lane_tree_d(const double a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static void sc_kda_decay_read(float *S, int d, const float *alpha, const float *k, float *u) {
    for (int j = 0; j < d; j++) u[j] = 0.0f;
    for (int i = 0; i < d; i++) {
        float *row = S + (size_t)i * d;
        const float a = alpha[i], kk = k[i];
        for (int j = 0; j < d; j++) {
            row[j] = row[j] * a;
            u[j] = fmaf(kk, row[j], u[j]);
        }
    }
}

static void sc_kda_write_read(float *S, int d, const float *k, const float *delta, const float *q,
                              float *o) {
    for (int j = 0; j < d; j++) o[j] = 0.0f;
    for (int i = 0; i < d; i++) {
        float *row = S + (size_t)i * d;
        const float kk = k[i], qq = q[i];
        for (int j = 0; j < d; j++) {
            row[j] = fmaf(kk, delta[j], row[j]);
            o[j] = fmaf(qq, row[j], o[j]);
        }
    }
}

static void sc_conv4(float *u, float *win, const float *taps, int d) {
    for (int c = 0; c < d; c++) {
        float *w = win + (size_t)c * 4;
        const float *t = taps + (size_t)c * 4;
        w[0] = w[1], w[1] = w[2], w[2] = w[3], w[3] = u[c];
        float acc = 0.0f;
        for (int j = 0; j < 4; j++) acc += t[j] * w[j];
        u[c] = acc;
    }
}

/* W[r][c] as a float and its scale in the load format (1 for f32) */
static inline float qmat_at(const k3_qmat *m, int r, int c, float *scale) {
    const size_t cols = (size_t)m->cols;
    switch (m->fmt) {
    case K3_QF_I8: *scale = m->scales[r]; return (float)m->q8[(size_t)r * cols + (size_t)c];
    case K3_QF_I4G64: {
        const uint8_t b = m->q4[(size_t)r * (cols / 2) + (size_t)c / 2];
        *scale = m->scales[(size_t)r * (cols / 64) + (size_t)c / 64];
        return (float)(((c & 1) ? b >> 4 : b & 15) - 8);
    }
    case K3_QF_F32: break;
    }
    *scale = 1.0f;
    return m->w[(size_t)r * cols + (size_t)c];
}

static void sc_rows_comb(const k3_qmat *m, int row0, int nrows, const float *coef, size_t coef_ld,
                         int T, float *acc, size_t acc_ld) {
    const int cols = m->cols;
    for (int t = 0; t < T; t++) {
        float *a = acc + (size_t)t * acc_ld;
        for (int c = 0; c < cols; c++) a[c] = 0.0f;
        for (int i = 0; i < nrows; i++) {
            const float cf = coef[(size_t)t * coef_ld + (size_t)i];
            for (int c = 0; c < cols; c++) {
                float s;
                const float w = qmat_at(m, row0 + i, c, &s);
                a[c] = fmaf(cf * s, w, a[c]);
            }
        }
    }
}

static void sc_wsum_multi(const float *rows, int cols, const float *p, size_t p_ld, int nq, int n,
                          float *acc, size_t acc_ld) {
    for (int q = 0; q < nq; q++) {
        const float *pq = p + (size_t)q * p_ld;
        float *a = acc + (size_t)q * acc_ld;
        for (int c = 0; c < cols; c++) a[c] = 0.0f;
        for (int s = 0; s < n; s++) {
            const float *row = rows + (size_t)s * cols;
            for (int c = 0; c < cols; c++) a[c] = fmaf(pq[s], row[c], a[c]);
        }
    }
}

static void sc_softmax(float *x, int n) {
    if (n <= 0) return;
    float mx = -INFINITY; /* NaN never wins: same value in any order */
    for (int i = 0; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    const int nl = n / LANES * LANES;
    float a[LANES] = {0};
    for (int i = 0; i < nl; i++) {
        x[i] = k3_exp_ref(x[i] - mx);
        a[i % LANES] += x[i];
    }
    float sum = lane_tree(a);
    for (int i = nl; i < n; i++) {
        x[i] = k3_exp_ref(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] = x[i] / sum;
}

static void sc_situ(float *out, const float *g, const float *u, int n, float b1, float b2) {
    for (int i = 0; i < n; i++) {
        const float gi = g[i], ui = u[i];
        const float left = b1 * k3_tanh_ref(gi / b1) * k3_sigmoid_ref(gi);
        const float right = b2 * k3_tanh_ref(ui / b2);
        out[i] = left * right;
    }
}

static void sc_sigmoid_mul(float *out, const float *x, const float *g, int n) {
    for (int i = 0; i < n; i++) out[i] = x[i] * k3_sigmoid_ref(g[i]);
}

static void sc_silu(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = x[i] * k3_sigmoid_ref(x[i]);
}

static void sc_kda_alpha(float *alpha, const float *z, const float *dt, float A, float lb, int n) {
    for (int i = 0; i < n; i++) alpha[i] = k3_exp_ref(lb * k3_sigmoid_ref(A * (z[i] + dt[i])));
}

static float sc_sumsq(const float *x, int n) {
    const int nl = n / LANES * LANES;
    float a[LANES] = {0};
    for (int i = 0; i < nl; i++) a[i % LANES] = fmaf(x[i], x[i], a[i % LANES]);
    float s = lane_tree(a);
    for (int i = nl; i < n; i++) s = fmaf(x[i], x[i], s);
    return s;
}

/* Products of two floats are exact in double, so a multiply then an add
 * here is the vector fma's value too; only the order of the adds matters. */
static void sc_sumsq_dot_d(const float *x, const float *w, int n, double *ss, double *dot) {
    const int nl = n / 8 * 8;
    double a[8] = {0}, b[8] = {0};
    for (int i = 0; i < nl; i++) {
        a[i % 8] += (double)x[i] * (double)x[i];
        if (w) b[i % 8] += (double)x[i] * (double)w[i];
    }
    double s = lane_tree_d(a), d = lane_tree_d(b);
    for (int i = nl; i < n; i++) {
        s += (double)x[i] * (double)x[i];
        if (w) d += (double)x[i] * (double)w[i];
    }
    *ss = s;
    if (dot) *dot = d;
}

static void sc_scale_mul(float *out, const float *x, float r, const float *w, int n) {
    for (int i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
}

static void sc_mix(float *out, const float *const *v, const float *pi, int n, int D) {
    for (int d = 0; d < D; d++) {
        float acc = 0.0f;
        for (int e = 0; e < n; e++) acc += pi[e] * v[e][d];
        out[d] = acc;
    }
}

static void sc_exp(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = k3_exp_ref(x[i]);
}

static void sc_tanh(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = k3_tanh_ref(x[i]);
}

const k3_ops_tab k3_ops_scalar = {
    .isa = K3_ISA_SCALAR,
    .kda_decay_read = sc_kda_decay_read,
    .kda_write_read = sc_kda_write_read,
    .conv4 = sc_conv4,
    .rows_comb = sc_rows_comb,
    .wsum_multi = sc_wsum_multi,
    .softmax = sc_softmax,
    .situ = sc_situ,
    .sigmoid_mul = sc_sigmoid_mul,
    .silu = sc_silu,
    .kda_alpha = sc_kda_alpha,
    .sumsq = sc_sumsq,
    .sumsq_dot_d = sc_sumsq_dot_d,
    .scale_mul = sc_scale_mul,
    .mix = sc_mix,
    .exp_map = sc_exp,
    .tanh_map = sc_tanh,
};

/* ---- public operators ---- */

float k3_sigmoid(float z) { return k3_sigmoid_ref(z); }

float k3_silu(float z) { return z * k3_sigmoid_ref(z); }

void k3_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    /* docs/MODEL.md 3.1: sum of squares in double (lane order of ops_isa.h), mean in
     * double cast to float, reciprocal in float, then (x * r) * w in float. */
    const k3_ops_tab *o = k3_ops();
    double ss;
    o->sumsq_dot_d(x, NULL, n, &ss, NULL);
    const float mean = (float)(ss / (double)n);
    const float r = 1.0f / sqrtf(mean + eps);
    o->scale_mul(out, x, r, w, n);
}

void k3_situ(float *out, const float *g, const float *u, int n, float b1, float b2) {
    /* docs/MODEL.md 3.8: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], left to right;
     * the sigmoid takes the uncapped g. */
    k3_ops()->situ(out, g, u, n, b1, b2);
}

void k3_softmax(float *x, int n) { k3_ops()->softmax(x, n); }
