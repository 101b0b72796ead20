/* tests/test_ops.c: the layer operators (common/kernels/ops.c, ops_isa.h, the
 * vector backends ops_avx2.c / ops_avx512.c) and the KDA / MLA / AttnRes
 * layers that run on them.
 *
 * - k3_exp_ref / k3_tanh_ref against libm in double: max ulp error over a
 *   sweep of the range, and the special values (0, -0, +-inf, NaN, the
 *   overflow and underflow edges);
 * - every vector level against the scalar backend, bit for bit (all share
 *   the order of ops_isa.h), per table entry, at K3 shapes (KDA d = 128,
 *   kv_lora 512, rope 64, D 7168, 3072-wide SiTU) and odd sizes, with
 *   special values in the elementwise inputs (NaN: both NaN);
 * - the scalar backend against float64 references (rows_comb in every load
 *   format, RMSNorm docs/MODEL.md 3.1, AttnRes 3.3);
 * - whole layers at K3 head shapes (2 heads): k3_kda_forward and
 *   k3_mla_forward (kv_b f32, int8, int4) give the same bits at every ISA
 *   level, for chunk 1 vs the whole chunk, and for 1 vs 3 threads.
 * Levels the CPU lacks are skipped with a printed reason.
 */
#include <stdint.h>
#include <string.h>
#include <sys/types.h>

#include "common/kernels/kernels.h"
#include "common/layers/layers.h"
#include "common/kernels/ops_isa.h"
#include "common/base/pool.h"
#include "tests/test.h"

static uint64_t g_rng = 0x243F6A8885A308D3ull;

static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float frand(void) { return (float)((double)(rnd() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }
static float nrand(void) { return (frand() + frand() + frand()) * 0.6f; }

static float *fvec(size_t n, float scale) {
    float *v = malloc((n ? n : 1) * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = nrand() * scale;
    return v;
}

static float *fdup(const float *a, size_t n) {
    float *v = malloc((n ? n : 1) * sizeof *v);
    memcpy(v, a, n * sizeof *v);
    return v;
}

static float f_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bit-equal, or both NaN (NaN payloads may legally differ by operand order) */
static int same_f32(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) && !(isnan(a[i]) && isnan(b[i]))) return 0;
    return 1;
}

static size_t first_diff(const float *a, const float *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) && !(isnan(a[i]) && isnan(b[i]))) return i;
    return n;
}

/* the vector levels this CPU runs */
static const k3_ops_tab *g_vec[2];
static int g_nvec;

static void force(k3_isa l) {
    char err[256];
    if (k3_isa_force(l, err, sizeof err) != K3_OK) {
        printf("# k3_isa_force: %s\n", err);
        abort();
    }
}

/* ---- exp / tanh accuracy ---- */

/* |f - ref| in units of the float ulp at ref (subnormal ulp below 2^-126) */
static double ulp_err(float f, double ref) {
    double a = fabs(ref);
    int e;
    frexp(a < 1.1754943508222875e-38 ? 1.1754943508222875e-38 : a, &e);
    double ulp = ldexp(1.0, e - 24);
    return fabs((double)f - ref) / ulp;
}

static void test_exp_tanh_accuracy(void) {
    double worst_e = 0, worst_t = 0;
    float at_e = 0, at_t = 0;
    for (int i = 0; i <= 2000000; i++) {
        /* a uniform sweep of [-103, 88.7] plus random points near 0 */
        float x = i < 1000000 ? -103.0f + 191.7f * (float)i / 1000000.0f
                              : frand() * (i & 1 ? 1e-3f : 3.0f);
        double e = ulp_err(k3_exp_ref(x), exp((double)x));
        if (e > worst_e) worst_e = e, at_e = x;
        float y = x / 10.0f;
        double t = ulp_err(k3_tanh_ref(y), tanh((double)y));
        if (t > worst_t) worst_t = t, at_t = y;
    }
    CHECK(worst_e <= 2.0, "k3_exp_ref within 2 ulp of exp on [-103, 88.7] (worst %.2f at %.9g)",
          worst_e, at_e);
    CHECK(worst_t <= 4.0, "k3_tanh_ref within 4 ulp of tanh on [-10.3, 8.9] (worst %.2f at %.9g)",
          worst_t, at_t);
    const float inf = INFINITY;
    CHECK(k3_exp_ref(0.0f) == 1.0f && k3_exp_ref(-0.0f) == 1.0f && k3_exp_ref(inf) == inf &&
              k3_exp_ref(-inf) == 0.0f && isnan(k3_exp_ref(NAN)) && k3_exp_ref(89.0f) == inf &&
              k3_exp_ref(88.72f) < inf && k3_exp_ref(-104.0f) == 0.0f && k3_exp_ref(-100.0f) > 0.0f,
          "k3_exp_ref specials: exp(+-0) = 1, +inf, 0, NaN, overflow past 88.73, subnormals");
    float t0 = k3_tanh_ref(-0.0f);
    CHECK(k3_tanh_ref(0.0f) == 0.0f && t0 == 0.0f && signbit(t0) && k3_tanh_ref(inf) == 1.0f &&
              k3_tanh_ref(-inf) == -1.0f && isnan(k3_tanh_ref(NAN)) &&
              k3_tanh_ref(1e-30f) == 1e-30f && k3_tanh_ref(20.0f) == 1.0f,
          "k3_tanh_ref specials: +-0 keep the sign, +-1 at +-inf, NaN, tanh(x) = x when tiny");
    CHECK(k3_sigmoid(0.0f) == 0.5f && k3_sigmoid(-200.0f) == 0.0f && k3_sigmoid(200.0f) == 1.0f,
          "sigmoid(0) = 0.5, saturates to 0 and 1");
}

/* ---- vector vs scalar, per table entry ---- */

/* inputs with the special values every elementwise map must carry equally */
static float *special_vec(size_t n, float scale) {
    static const uint32_t sp[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                  0x00000001u, 0x80400000u, 0x3f800000u, 0x42c80000u, 0xc2c80000u,
                                  0x461c4000u, 0xc61c4000u, 0x0d000000u, 0x7f7fffffu, 0xff7fffffu};
    float *v = fvec(n, scale);
    for (size_t i = 0; i < n; i += 7) v[i] = f_of_bits(sp[(i / 7) % (sizeof sp / sizeof sp[0])]);
    return v;
}

static void test_kda_sweeps(const k3_ops_tab *V) {
    static const int ds[] = {128, 1, 5, 16, 17, 33, 64, 100, 127};
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++) {
        const int d = ds[di];
        const size_t dd = (size_t)d * d;
        float *S0 = fvec(dd, 0.5f), *S1 = fdup(S0, dd);
        int ok = 1;
        for (int step = 0; step < 3 && ok; step++) {
            float *alpha = fvec((size_t)d, 0.3f), *k = fvec((size_t)d, 1), *q = fvec((size_t)d, 1);
            float *delta = fvec((size_t)d, 1);
            for (int i = 0; i < d; i++) alpha[i] = 0.7f + alpha[i];
            float u0[512], u1[512], o0[512], o1[512];
            k3_ops_scalar.kda_decay_read(S0, d, alpha, k, u0);
            V->kda_decay_read(S1, d, alpha, k, u1);
            ok &= same_f32(S0, S1, dd) && same_f32(u0, u1, (size_t)d);
            k3_ops_scalar.kda_write_read(S0, d, k, delta, q, o0);
            V->kda_write_read(S1, d, k, delta, q, o1);
            ok &= same_f32(S0, S1, dd) && same_f32(o0, o1, (size_t)d);
            free(alpha), free(k), free(q), free(delta);
        }
        CHECK(ok,
              "%s: KDA decay+read and write+read sweeps, d = %d, 3 steps: state, u, o bit-exact",
              k3_isa_name(V->isa), d);
        free(S0), free(S1);
    }
}

/* the 4-tap conv: the scalar backend against docs/MODEL.md 3.4's loop (shift, then
 * the dot in tap order), and every level against the scalar, over 3 tokens
 * so the windows carry over */
static void test_conv4(void) {
    static const int ds[] = {128, 1, 5, 15, 16, 17, 33, 12288};
    int ok_ref = 1, ok_vec[2] = {1, 1};
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++) {
        const int d = ds[di];
        const size_t n4 = (size_t)d * 4;
        float *taps = fvec(n4, 1), *w0 = fvec(n4, 1);
        float *wr = fdup(w0, n4), *wv[2] = {fdup(w0, n4), fdup(w0, n4)};
        for (int step = 0; step < 3; step++) {
            float *u = fvec((size_t)d, 2), *ur = fdup(u, (size_t)d);
            float *uv[2] = {fdup(u, (size_t)d), fdup(u, (size_t)d)};
            k3_ops_scalar.conv4(u, w0, taps, d);
            for (int c = 0; c < d; c++) { /* docs/MODEL.md 3.4, written out */
                float *w = wr + (size_t)c * 4;
                memmove(w, w + 1, 3 * sizeof(float));
                w[3] = ur[c];
                float acc = 0.0f;
                for (int j = 0; j < 4; j++) acc += taps[(size_t)c * 4 + j] * w[j];
                ur[c] = acc;
            }
            ok_ref &= same_f32(u, ur, (size_t)d) && same_f32(w0, wr, n4);
            for (int v = 0; v < g_nvec; v++) {
                g_vec[v]->conv4(uv[v], wv[v], taps, d);
                ok_vec[v] &= same_f32(u, uv[v], (size_t)d) && same_f32(w0, wv[v], n4);
            }
            free(u), free(ur), free(uv[0]), free(uv[1]);
        }
        free(taps), free(w0), free(wr), free(wv[0]), free(wv[1]);
    }
    CHECK(ok_ref, "scalar 4-tap conv = the spec loop (window shift, taps in order), 3 tokens");
    for (int v = 0; v < g_nvec; v++)
        CHECK(ok_vec[v], "%s: 4-tap conv bit-exact, d = 1..12288, outputs and windows",
              k3_isa_name(g_vec[v]->isa));
}

/* float64 value of W[r][c] * scale in the load format */
static double deq(const k3_qmat *m, int r, int c) {
    switch (m->fmt) {
    case K3_QF_I8: return (double)m->q8[(size_t)r * m->cols + c] * m->scales[r];
    case K3_QF_I4G64: {
        uint8_t b = m->q4[(size_t)r * (m->cols / 2) + c / 2];
        int nib = (c & 1) ? b >> 4 : b & 15;
        return (double)(nib - 8) * m->scales[(size_t)r * (m->cols / 64) + c / 64];
    }
    case K3_QF_F32: break;
    }
    return m->w[(size_t)r * m->cols + c];
}

static void test_rows_comb(void) {
    static const struct {
        int bits, rows, cols;
    } shapes[] = {{32, 300, 512}, {8, 300, 512}, {4, 300, 512}, {32, 40, 37},
                  {8, 40, 37},    {8, 20, 16},   {4, 20, 128},  {4, 9, 64}};
    static const int Ts[] = {1, 2, 3, 4, 5, 8, 9};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int rows = shapes[si].rows, cols = shapes[si].cols;
        float *wf = fvec((size_t)rows * cols, 1);
        k3_qmat m;
        k3_qmat_quantize(&m, wf, rows, cols, shapes[si].bits);
        const int row0 = rows > 200 ? 17 : 1, nrows = rows > 200 ? 128 : rows - 2;
        const size_t ld = 200;
        float *coef = fvec(ld * 9, 1);
        float *ref = calloc(9 * ((size_t)cols + 3), sizeof(float));
        float *got = calloc(9 * ((size_t)cols + 3), sizeof(float));
        /* scalar vs float64 (docs/MODEL.md 3.5: acc += coef * scale * value) */
        k3_ops_scalar.rows_comb(&m, row0, nrows, coef, ld, 9, ref, (size_t)cols);
        double num = 0, den = 0;
        for (int t = 0; t < 9; t++)
            for (int c = 0; c < cols; c++) {
                double s = 0;
                for (int i = 0; i < nrows; i++)
                    s += (double)coef[t * ld + i] * deq(&m, row0 + i, c);
                double dlt = ref[(size_t)t * cols + c] - s;
                num += dlt * dlt, den += s * s;
            }
        CHECK(sqrt(num / den) < 1e-6,
              "scalar rows_comb fmt %d %dx%d (%d rows from %d) = float64 "
              "weighted row sum (rel L2 %.2e)",
              (int)m.fmt, rows, cols, nrows, row0, sqrt(num / den));
        for (int v = 0; v < g_nvec; v++) {
            int ok = 1;
            for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
                const int T = Ts[ti];
                k3_ops_scalar.rows_comb(&m, row0, nrows, coef, ld, T, ref, (size_t)cols + 3);
                g_vec[v]->rows_comb(&m, row0, nrows, coef, ld, T, got, (size_t)cols + 3);
                for (int t = 0; t < T; t++)
                    ok &= same_f32(ref + (size_t)t * (cols + 3), got + (size_t)t * (cols + 3),
                                   (size_t)cols);
            }
            CHECK(ok, "%s: rows_comb fmt %d %dx%d, T = 1..9: bit-exact", k3_isa_name(g_vec[v]->isa),
                  (int)m.fmt, rows, cols);
        }
        k3_qmat_free(&m);
        free(wf), free(coef), free(ref), free(got);
    }
}

static void test_maps(const k3_ops_tab *V) {
    const char *lv = k3_isa_name(V->isa);
    static const int ns[] = {1, 7, 15, 16, 17, 31, 64, 100, 3072, 12293};
    int ok_sm = 1, ok_situ = 1, ok_sig = 1, ok_silu = 1, ok_al = 1, ok_sc = 1, ok_exp = 1;
    int ok_tanh = 1, ok_ss = 1, ok_ssd = 1;
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
        const int n = ns[ni];
        const size_t z = (size_t)n;
        float *g = special_vec(z, 6), *u = special_vec(z, 40), *w = fvec(z, 1);
        float *a0 = malloc(z * sizeof(float)), *a1 = malloc(z * sizeof(float));
        for (int b = 0; b < 2; b++) {
            const float b1 = b ? 1.0f : 4.0f, b2 = b ? 1.0f : 25.0f;
            k3_ops_scalar.situ(a0, g, u, n, b1, b2);
            V->situ(a1, g, u, n, b1, b2);
            ok_situ &= same_f32(a0, a1, z);
        }
        k3_ops_scalar.sigmoid_mul(a0, u, g, n);
        V->sigmoid_mul(a1, u, g, n);
        ok_sig &= same_f32(a0, a1, z);
        memcpy(a0, g, z * sizeof(float)), memcpy(a1, g, z * sizeof(float));
        k3_ops_scalar.silu(a0, n), V->silu(a1, n);
        ok_silu &= same_f32(a0, a1, z);
        k3_ops_scalar.kda_alpha(a0, g, w, 2.5f, -5.0f, n);
        V->kda_alpha(a1, g, w, 2.5f, -5.0f, n);
        ok_al &= same_f32(a0, a1, z);
        k3_ops_scalar.scale_mul(a0, u, 0.37f, w, n);
        V->scale_mul(a1, u, 0.37f, w, n);
        ok_sc &= same_f32(a0, a1, z);
        for (int sc = 0; sc < 2; sc++) { /* exp: ordinary, then the edges +-90..110 */
            for (size_t i = 0; i < z; i++) a0[i] = sc ? g[i] * 18.0f : g[i];
            memcpy(a1, a0, z * sizeof(float));
            k3_ops_scalar.exp_map(a0, n), V->exp_map(a1, n);
            ok_exp &= same_f32(a0, a1, z);
        }
        memcpy(a0, g, z * sizeof(float)), memcpy(a1, g, z * sizeof(float));
        k3_ops_scalar.tanh_map(a0, n), V->tanh_map(a1, n);
        ok_tanh &= same_f32(a0, a1, z);
        /* softmax on finite inputs, then with -inf entries and a huge spread */
        float *x0 = fvec(z, 8), *x1;
        if (n > 3) x0[n / 2] = -INFINITY, x0[n - 1] = 1e30f;
        x1 = fdup(x0, z);
        k3_ops_scalar.softmax(x0, n), V->softmax(x1, n);
        ok_sm &= same_f32(x0, x1, z);
        free(x0), free(x1);
        x0 = fvec(z, 8), x1 = fdup(x0, z);
        k3_ops_scalar.softmax(x0, n), V->softmax(x1, n);
        ok_sm &= same_f32(x0, x1, z);
        free(x0), free(x1);
        /* reductions: exact equality of the sums */
        float *f = fvec(z, 3);
        float s0 = k3_ops_scalar.sumsq(f, n), s1 = V->sumsq(f, n);
        ok_ss &= memcmp(&s0, &s1, sizeof s0) == 0;
        double d0, d1, p0, p1;
        k3_ops_scalar.sumsq_dot_d(f, w, n, &d0, &p0);
        V->sumsq_dot_d(f, w, n, &d1, &p1);
        ok_ssd &= d0 == d1 && p0 == p1;
        k3_ops_scalar.sumsq_dot_d(f, NULL, n, &d0, NULL);
        V->sumsq_dot_d(f, NULL, n, &d1, NULL);
        ok_ssd &= d0 == d1;
        free(f), free(g), free(u), free(w), free(a0), free(a1);
    }
    CHECK(ok_situ, "%s: SiTU (betas 4/25 and 1/1) bit-exact, n = 1..12293 with specials", lv);
    CHECK(ok_sig, "%s: x * sigmoid(g) bit-exact with specials", lv);
    CHECK(ok_silu, "%s: SiLU bit-exact with specials", lv);
    CHECK(ok_al, "%s: KDA decay alpha bit-exact with specials", lv);
    CHECK(ok_sc, "%s: RMSNorm scale (x * r) * w bit-exact", lv);
    CHECK(ok_exp, "%s: exp map bit-exact, including the overflow / underflow edges", lv);
    CHECK(ok_tanh, "%s: tanh map bit-exact with specials", lv);
    CHECK(ok_sm, "%s: softmax bit-exact (n = 1..12293, -inf entries, 1e30 max)", lv);
    CHECK(ok_ss, "%s: float sum of squares (16 lanes + tail) equal", lv);
    CHECK(ok_ssd, "%s: double sum of squares and dot (8 lanes + tail) equal", lv);

    /* a 1M-point sweep of exp and tanh over every float exponent */
    const size_t nb = 1u << 20;
    float *b0 = malloc(nb * sizeof(float)), *b1 = malloc(nb * sizeof(float));
    for (size_t i = 0; i < nb; i++) b0[i] = f_of_bits((uint32_t)rnd());
    memcpy(b1, b0, nb * sizeof(float));
    k3_ops_scalar.exp_map(b0, (int)nb), V->exp_map(b1, (int)nb);
    int ok = same_f32(b0, b1, nb);
    for (size_t i = 0; i < nb; i++) b0[i] = f_of_bits((uint32_t)rnd());
    memcpy(b1, b0, nb * sizeof(float));
    k3_ops_scalar.tanh_map(b0, (int)nb), V->tanh_map(b1, (int)nb);
    ok &= same_f32(b0, b1, nb);
    CHECK(ok, "%s: exp and tanh bit-exact on 2^20 random bit patterns each", lv);
    free(b0), free(b1);

    /* wsum_multi (latent context of a head group) and mix (AttnRes) */
    static const int cs[] = {512, 37, 16, 7168};
    static const int rs[] = {1, 7, 300};
    ok = 1;
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++)
        for (size_t ri = 0; ri < sizeof rs / sizeof rs[0]; ri++)
            for (int nq = 1; nq <= 9; nq += 4) {
                const int cols = cs[ci], n = rs[ri];
                const size_t pld = (size_t)n + 5, ald = (size_t)cols + 3;
                float *rows = fvec((size_t)n * cols, 1), *p = fvec(pld * nq, 1);
                float *y0 = calloc(ald * nq, sizeof(float)), *y1 = calloc(ald * nq, sizeof(float));
                k3_ops_scalar.wsum_multi(rows, cols, p, pld, nq, n, y0, ald);
                V->wsum_multi(rows, cols, p, pld, nq, n, y1, ald);
                ok &= same_f32(y0, y1, ald * nq);
                free(rows), free(p), free(y0), free(y1);
            }
    CHECK(ok,
          "%s: latent weighted sums (1, 5, 9 queries; cols 512, 37, 16, 7168; 1..300 rows) "
          "bit-exact",
          lv);
    ok = 1;
    for (int n = 1; n <= K3_MAX_RES_ENTRIES + 1; n += 4) {
        for (int D = 13; D <= 7168; D = D == 13 ? 7168 : 99999) {
            float *ent[K3_MAX_RES_ENTRIES + 1], pi[K3_MAX_RES_ENTRIES + 1];
            for (int e = 0; e < n; e++) ent[e] = fvec((size_t)D, 2), pi[e] = frand();
            float *y0 = malloc(sizeof(float) * D), *y1 = malloc(sizeof(float) * D);
            k3_ops_scalar.mix(y0, (const float *const *)ent, pi, n, D);
            V->mix(y1, (const float *const *)ent, pi, n, D);
            ok &= same_f32(y0, y1, (size_t)D);
            for (int e = 0; e < n; e++) free(ent[e]);
            free(y0), free(y1);
        }
    }
    CHECK(ok, "%s: AttnRes mix (1..17 entries, D 13 and 7168) bit-exact", lv);
}

/* ---- public operators against float64 ---- */

static void test_public_ops(void) {
    const int n = 7168;
    float *x = fvec(n, 3), *w = fvec(n, 1), *y = malloc(sizeof(float) * n);
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double r = 1.0 / sqrt(ss / n + 1e-5);
    float *ref = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) ref[i] = (float)((double)x[i] * r * w[i]);
    k3_rmsnorm(y, x, w, n, 1e-5f);
    CHECK(t_rel_l2(y, ref, n) < 1e-6, "RMSNorm D = 7168 vs float64 (rel L2 %.2e)",
          t_rel_l2(y, ref, n));
    /* AttnRes: 9 entries of D = 7168 */
    const int ne = 9;
    float *ent[9];
    double s[9], mx = -1e300, sum = 0;
    for (int e = 0; e < ne; e++) {
        ent[e] = fvec(n, 1.0f + e);
        double dot = 0, sq = 0;
        for (int i = 0; i < n; i++)
            dot += (double)ent[e][i] * w[i], sq += (double)ent[e][i] * ent[e][i];
        s[e] = dot / sqrt(sq / n + 1e-5);
        mx = s[e] > mx ? s[e] : mx;
    }
    for (int e = 0; e < ne; e++) sum += exp(s[e] - mx);
    for (int i = 0; i < n; i++) {
        double a = 0;
        for (int e = 0; e < ne; e++) a += exp(s[e] - mx) / sum * ent[e][i];
        ref[i] = (float)a;
    }
    k3_attnres_mix((const float *const *)ent, ne, w, n, 1e-5f, y);
    CHECK(t_rel_l2(y, ref, n) < 1e-5, "AttnRes mix of 9 entries vs float64 (rel L2 %.2e)",
          t_rel_l2(y, ref, n));
    /* every level: the same bits through the public entry points */
    float *y0 = malloc(sizeof(float) * n);
    force(K3_ISA_SCALAR);
    k3_attnres_mix((const float *const *)ent, ne, w, n, 1e-5f, y0);
    k3_rmsnorm(ref, x, w, n, 1e-5f);
    for (int v = 0; v < g_nvec; v++) {
        force(g_vec[v]->isa);
        k3_attnres_mix((const float *const *)ent, ne, w, n, 1e-5f, y);
        int ok = same_f32(y, y0, n);
        k3_rmsnorm(y, x, w, n, 1e-5f);
        ok &= same_f32(y, ref, n);
        CHECK(ok, "%s: k3_attnres_mix and k3_rmsnorm = scalar bits", k3_isa_name(g_vec[v]->isa));
    }
    force(k3_isa_detect());
    float g[4] = {-3, 0, 0.5f, 9}, u[4] = {2, 7, -30, 100}, o[4];
    k3_situ(o, g, u, 4, 4.0f, 25.0f);
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        double left = 4.0 * tanh(g[i] / 4.0) / (1 + exp(-(double)g[i]));
        double want = left * 25.0 * tanh(u[i] / 25.0);
        ok &= fabs(o[i] - want) <= 1e-6 * (fabs(want) + 1e-30) + 1e-30;
    }
    CHECK(ok, "SiTU (4, 25) vs float64 within 1e-6 relative");
    for (int e = 0; e < ne; e++) free(ent[e]);
    free(x), free(w), free(y), free(y0), free(ref);
}

/* ---- whole layers ---- */

/* K3 head shapes, 2 heads each, a small model width */
static k3_config layer_cfg(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    c.hidden = 256, c.eps = 1e-5f;
    c.kda_heads = 2, c.kda_hd = 128, c.kda_proj = 256, c.conv_k = 4, c.gate_lb = -5.0f;
    c.n_heads = 2, c.q_lora = 64, c.kv_lora = 512, c.qk_nope = 128, c.qk_rope = 64;
    c.v_head = 128, c.qk_head = 192;
    return c;
}

static void qrand(k3_qmat *m, int rows, int cols, int bits, float scale) {
    float *w = fvec((size_t)rows * cols, scale);
    k3_qmat_quantize(m, w, rows, cols, bits);
    free(w);
}

typedef struct {
    k3_kda_w w;
    float *S, *conv; /* state */
} kda_fix;

static void kda_make(kda_fix *f, const k3_config *c, int bits) {
    const int D = c->hidden, P = c->kda_proj, H = c->kda_heads, d = c->kda_hd, K = c->conv_k;
    memset(f, 0, sizeof *f);
    const float sd = 1.0f / sqrtf((float)D);
    qrand(&f->w.q, P, D, bits, sd), qrand(&f->w.k, P, D, bits, sd), qrand(&f->w.v, P, D, bits, sd);
    qrand(&f->w.g, P, D, bits, sd), qrand(&f->w.o, D, P, bits, 1.0f / sqrtf((float)P));
    qrand(&f->w.f_a, d, D, 32, sd), qrand(&f->w.f_b, P, d, 32, 1.0f / sqrtf((float)d));
    qrand(&f->w.b, H, D, 32, sd);
    f->w.conv_q = fvec((size_t)P * K, 0.5f), f->w.conv_k = fvec((size_t)P * K, 0.5f);
    f->w.conv_v = fvec((size_t)P * K, 0.5f), f->w.dt_bias = fvec((size_t)P, 0.5f);
    f->w.A = fvec((size_t)H, 0.5f), f->w.o_norm = fvec((size_t)d, 1);
    for (int h = 0; h < H; h++) f->w.A[h] = expf(f->w.A[h]);
    f->S = calloc((size_t)H * d * d, sizeof(float));
    f->conv = calloc((size_t)3 * P * K, sizeof(float));
}

static void kda_free(kda_fix *f) {
    k3_qmat *ms[8] = {&f->w.q, &f->w.k, &f->w.v, &f->w.g, &f->w.o, &f->w.f_a, &f->w.f_b, &f->w.b};
    for (int i = 0; i < 8; i++) k3_qmat_free(ms[i]);
    free(f->w.conv_q), free(f->w.conv_k), free(f->w.conv_v), free(f->w.dt_bias), free(f->w.A);
    free(f->w.o_norm), free(f->S), free(f->conv);
}

/* Runs the layer over x [T][D] in chunks of `chunk` from a zero state;
 * out [T][D]; the final state goes to S_out/conv_out. */
static void kda_run(kda_fix *f, const k3_config *c, k3_pool *pool, const float *x, int T, int chunk,
                    float *out, float *S_out, float *conv_out) {
    const size_t ns = (size_t)c->kda_heads * c->kda_hd * c->kda_hd;
    const size_t nc = (size_t)3 * c->kda_proj * c->conv_k;
    memset(f->S, 0, ns * sizeof(float)), memset(f->conv, 0, nc * sizeof(float));
    k3_kda_state st = {f->S, f->conv};
    k3_layer_ctx lc = {c, pool, NULL, 0, 0, NULL, NULL};
    size_t cap = k3_kda_scratch_bytes(c, chunk);
    k3_arena ar = {malloc(cap), cap, 0};
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        ar.used = 0;
        k3_kda_forward(&lc, &f->w, &st, x + (size_t)t0 * c->hidden, n, out + (size_t)t0 * c->hidden,
                       &ar);
    }
    memcpy(S_out, f->S, ns * sizeof(float)), memcpy(conv_out, f->conv, nc * sizeof(float));
    free(ar.base);
}

static void test_kda_layer(k3_pool *pool3) {
    k3_config c = layer_cfg();
    const int T = 11, D = c.hidden;
    const size_t ns = (size_t)c.kda_heads * c.kda_hd * c.kda_hd, nc = (size_t)3 * c.kda_proj * 4;
    float *x = fvec((size_t)T * D, 1);
    for (int bits = 4; bits <= 32; bits = bits == 4 ? 32 : 99) {
        kda_fix f;
        kda_make(&f, &c, bits);
        float *o0 = malloc(sizeof(float) * T * D), *o1 = malloc(sizeof(float) * T * D);
        float *S0 = malloc(ns * sizeof(float)), *S1 = malloc(ns * sizeof(float));
        float *c0 = malloc(nc * sizeof(float)), *c1 = malloc(nc * sizeof(float));
        force(K3_ISA_SCALAR);
        kda_run(&f, &c, NULL, x, T, T, o0, S0, c0);
        int finite = 1;
        for (int i = 0; i < T * D; i++) finite &= isfinite(o0[i]) && o0[i] != 0.0f;
        CHECK(finite, "KDA layer (bits %d, 2 heads x 128): finite, non-zero outputs", bits);
        for (int v = 0; v < g_nvec; v++) {
            force(g_vec[v]->isa);
            kda_run(&f, &c, NULL, x, T, T, o1, S1, c1);
            size_t at = first_diff(o0, o1, (size_t)T * D);
            CHECK(at == (size_t)T * D && same_f32(S0, S1, ns) && same_f32(c0, c1, nc),
                  "%s: KDA layer (bits %d), %d tokens: output, state and conv windows = scalar "
                  "bits (first output diff: %zd)",
                  k3_isa_name(g_vec[v]->isa), bits, T,
                  at == (size_t)T * D ? (ssize_t)-1 : (ssize_t)at);
        }
        force(k3_isa_detect());
        kda_run(&f, &c, NULL, x, T, T, o0, S0, c0);
        kda_run(&f, &c, NULL, x, T, 1, o1, S1, c1);
        int ok = same_f32(o0, o1, (size_t)T * D) && same_f32(S0, S1, ns);
        kda_run(&f, &c, NULL, x, T, 4, o1, S1, c1);
        ok &= same_f32(o0, o1, (size_t)T * D) && same_f32(S0, S1, ns);
        CHECK(ok, "%s: KDA layer (bits %d): chunks 11, 4 and 1 give the same bits",
              k3_isa_name(k3_isa_active()), bits);
        kda_run(&f, &c, pool3, x, T, T, o1, S1, c1);
        CHECK(same_f32(o0, o1, (size_t)T * D) && same_f32(S0, S1, ns),
              "%s: KDA layer (bits %d): 3 threads = 1 thread, bit for bit",
              k3_isa_name(k3_isa_active()), bits);
        free(o0), free(o1), free(S0), free(S1), free(c0), free(c1);
        kda_free(&f);
    }
    free(x);
}

typedef struct {
    k3_mla_w w;
    float *qa_norm, *kv_norm;
} mla_fix;

static void mla_make(mla_fix *f, const k3_config *c, int bits) {
    const int D = c->hidden, H = c->n_heads;
    memset(f, 0, sizeof *f);
    qrand(&f->w.q_a, c->q_lora, D, bits, 1.0f / sqrtf((float)D));
    qrand(&f->w.q_b, H * c->qk_head, c->q_lora, bits, 1.0f / sqrtf((float)c->q_lora));
    qrand(&f->w.kv_a, c->kv_lora + c->qk_rope, D, bits, 1.0f / sqrtf((float)D));
    qrand(&f->w.kv_b, H * (c->qk_nope + c->v_head), c->kv_lora, bits,
          1.0f / sqrtf((float)c->kv_lora));
    qrand(&f->w.g, H * c->v_head, D, bits, 1.0f / sqrtf((float)D));
    qrand(&f->w.o, D, H * c->v_head, bits, 1.0f / sqrtf((float)(H * c->v_head)));
    f->w.q_a_norm = f->qa_norm = fvec((size_t)c->q_lora, 1);
    f->w.kv_a_norm = f->kv_norm = fvec((size_t)c->kv_lora, 1);
}

static void mla_free(mla_fix *f) {
    k3_qmat *ms[6] = {&f->w.q_a, &f->w.q_b, &f->w.kv_a, &f->w.kv_b, &f->w.g, &f->w.o};
    for (int i = 0; i < 6; i++) k3_qmat_free(ms[i]);
    free(f->qa_norm), free(f->kv_norm);
}

static void mla_run(mla_fix *f, const k3_config *c, k3_pool *pool, const float *x, int T, int chunk,
                    float *out) {
    char err[256];
    k3_mla_cache cache = {0};
    K3_ASSERT(k3_mla_cache_reserve(&cache, c, T, T, err, sizeof err) == K3_OK);
    k3_layer_ctx lc = {c, pool, NULL, 0, 0, NULL, NULL};
    size_t cap = k3_mla_scratch_bytes(c, chunk, T);
    k3_arena ar = {malloc(cap), cap, 0};
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        ar.used = 0;
        k3_mla_forward(&lc, &f->w, &cache, t0, x + (size_t)t0 * c->hidden, n,
                       out + (size_t)t0 * c->hidden, &ar);
    }
    k3_mla_cache_free(&cache);
    free(ar.base);
}

static void test_mla_layer(k3_pool *pool3) {
    k3_config c = layer_cfg();
    const int T = 19, D = c.hidden; /* > 2 tiles of 8 */
    float *x = fvec((size_t)T * D, 1);
    static const int bits_list[] = {8, 4, 32};
    for (int bi = 0; bi < 3; bi++) {
        const int bits = bits_list[bi];
        mla_fix f;
        mla_make(&f, &c, bits);
        float *o0 = malloc(sizeof(float) * T * D), *o1 = malloc(sizeof(float) * T * D);
        force(K3_ISA_SCALAR);
        mla_run(&f, &c, NULL, x, T, T, o0);
        int finite = 1;
        for (int i = 0; i < T * D; i++) finite &= isfinite(o0[i]);
        CHECK(finite && f.w.kv_b.fmt == (bits == 4   ? K3_QF_I4G64
                                         : bits == 8 ? K3_QF_I8
                                                     : K3_QF_F32),
              "MLA layer (kv_b fmt %d, 2 heads, kv_lora 512, rope 64): finite outputs",
              (int)f.w.kv_b.fmt);
        for (int v = 0; v < g_nvec; v++) {
            force(g_vec[v]->isa);
            mla_run(&f, &c, NULL, x, T, T, o1);
            size_t at = first_diff(o0, o1, (size_t)T * D);
            CHECK(at == (size_t)T * D,
                  "%s: MLA layer (kv_b fmt %d), %d tokens: output = scalar bits (first diff: %zd)",
                  k3_isa_name(g_vec[v]->isa), (int)f.w.kv_b.fmt, T,
                  at == (size_t)T * D ? (ssize_t)-1 : (ssize_t)at);
        }
        force(k3_isa_detect());
        mla_run(&f, &c, NULL, x, T, T, o0);
        mla_run(&f, &c, NULL, x, T, 1, o1);
        int ok = same_f32(o0, o1, (size_t)T * D);
        mla_run(&f, &c, NULL, x, T, 5, o1);
        ok &= same_f32(o0, o1, (size_t)T * D);
        CHECK(ok, "%s: MLA layer (kv_b fmt %d): chunks 19, 5 and 1 give the same bits",
              k3_isa_name(k3_isa_active()), (int)f.w.kv_b.fmt);
        mla_run(&f, &c, pool3, x, T, T, o1);
        CHECK(same_f32(o0, o1, (size_t)T * D),
              "%s: MLA layer (kv_b fmt %d): 3 threads = 1 thread, bit for bit",
              k3_isa_name(k3_isa_active()), (int)f.w.kv_b.fmt);
        free(o0), free(o1);
        mla_free(&f);
    }
    free(x);
}

int main(void) {
    k3_isa det = k3_isa_detect();
    if (det >= K3_ISA_AVX2)
        g_vec[g_nvec++] = &k3_ops_avx2;
    else
        SKIP("avx2 ops vs scalar", "this CPU lacks AVX2/FMA (detected %s)", k3_isa_name(det));
    if (det >= K3_ISA_AVX512)
        g_vec[g_nvec++] = &k3_ops_avx512;
    else
        SKIP("avx512 ops vs scalar", "this CPU lacks AVX-512 F/BW/VL/DQ/VNNI (detected %s)",
             k3_isa_name(det));
    printf("# detected %s; K3_ISA level in use at start: %s\n", k3_isa_name(det),
           k3_isa_name(k3_isa_active()));
    CHECK(k3_ops()->isa == k3_isa_active(), "dispatch follows the active ISA level (%s)",
          k3_isa_name(k3_ops()->isa));

    test_exp_tanh_accuracy();
    for (int v = 0; v < g_nvec; v++) {
        test_kda_sweeps(g_vec[v]);
        test_maps(g_vec[v]);
    }
    test_conv4();
    test_rows_comb();
    test_public_ops();

    char err[256];
    k3_pool *pool3 = NULL;
    if (k3_pool_open(&pool3, 3, err, sizeof err) != K3_OK) {
        printf("# pool: %s\n", err);
        return 1;
    }
    test_kda_layer(pool3);
    test_mla_layer(pool3);
    k3_pool_close(&pool3);
    TEST_MAIN_END();
}
