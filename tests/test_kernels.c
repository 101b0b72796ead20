/* tests/test_kernels.c: tensor formats and matmul kernels (common/kernels/kernels.h).
 *
 * - tables and scale bytes (e2m1, ue8m0 0 -> +0, 255 -> +inf);
 * - quantizers against hand-computed values (ties to even, the float
 *   reciprocal, scale floor, nibble order, int4 -> int8 fallback, downcast);
 * - the scalar kernels against a float64 dequantize-then-dot reference;
 * - every vector ISA level against scalar, bit for bit (memcmp): all kernels
 *   share the scalar summation order, which is stricter than the 1e-6
 *   relative L2 the engine issue asks of exact-float paths;
 * - within each ISA: matmul over n tokens == n matvecs, any row split and
 *   1/2/3 threads give the same bits (memcmp).
 * Shapes: the K3 ones (MXFP4 3072x3584 and 3584x3072, int4 1024x7168, int8
 * 1536x7168) and odd ones (rows 1, 3, 17, 33; cols 32 .. 160).
 */
#include <stdint.h>
#include <string.h>

#include "common/kernels/kernels.h"
#include "tests/test.h"

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float frand(void) { return (float)((double)(rnd() >> 11) / 9007199254740992.0 * 2.0 - 1.0); }

/* roughly normal, like weights and activations */
static float nrand(void) { return (frand() + frand() + frand()) * 0.6f; }

static float *fvec(size_t n) {
    float *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) v[i] = nrand();
    return v;
}

static k3_isa g_levels[3];
static int g_nlevels; /* supported levels, scalar first */
static int g_vbmi;    /* the AVX-512 level has a VBMI decode to switch off */

static void force(k3_isa l) {
    char err[256];
    if (k3_isa_force(l, err, sizeof err) != K3_OK) {
        printf("# k3_isa_force: %s\n", err);
        abort();
    }
}

/* ---- random MXFP4 matrices ---- */

typedef struct {
    k3_mxfp4 w;
    uint8_t *packed, *scale;
} mx_buf;

static void mx_make(mx_buf *b, int rows, int cols, int s_lo, int s_hi) {
    b->packed = malloc((size_t)rows * cols / 2);
    b->scale = malloc((size_t)rows * cols / 32);
    for (size_t i = 0; i < (size_t)rows * cols / 2; i++) b->packed[i] = (uint8_t)rnd();
    for (size_t i = 0; i < (size_t)rows * cols / 32; i++)
        b->scale[i] = (uint8_t)(s_lo + (int)(rnd() % (uint64_t)(s_hi - s_lo + 1)));
    b->w = (k3_mxfp4){.packed = b->packed, .scale = b->scale, .rows = rows, .cols = cols};
}

static void mx_free(mx_buf *b) {
    free(b->packed);
    free(b->scale);
}

/* ---- tables ---- */

static void test_tables(void) {
    static const float want[16] = {0,    .5f,  1,  1.5f,  2,  3,  4,  6,
                                   -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    int ok = 1;
    for (int i = 0; i < 16; i++)
        ok &= k3_e2m1[i] == want[i] && signbit(k3_e2m1[i]) == signbit(want[i]);
    CHECK(ok, "e2m1 table matches docs/MODEL.md 4.1 (incl. -0 at nibble 8)");
    CHECK(k3_e8m0_to_f32(127) == 1.0f && k3_e8m0_to_f32(128) == 2.0f &&
              k3_e8m0_to_f32(120) == 1.0f / 128,
          "e8m0 127 -> 1, 128 -> 2, 120 -> 2^-7");
    CHECK(k3_e8m0_to_f32(1) == ldexpf(1.0f, -126) && k3_e8m0_to_f32(254) == ldexpf(1.0f, 127),
          "e8m0 1 -> 2^-126, 254 -> 2^127");
    float z = k3_e8m0_to_f32(0), inf = k3_e8m0_to_f32(255);
    CHECK(z == 0.0f && !signbit(z), "e8m0 0 -> +0 (not 2^-127)");
    CHECK(isinf(inf) && inf > 0, "e8m0 255 -> +inf");
}

/* ---- quantizers ---- */

static void test_quant_i8(void) {
    /* m = 127 -> s = 1, 1/s = 1: q = rint(w), ties to even */
    float w[8] = {127.f, 0.5f, 1.5f, 2.5f, -2.5f, -0.5f, -127.f, 3.49f};
    int8_t want[8] = {127, 0, 2, 2, -2, 0, -127, 3};
    k3_qmat m;
    k3_qmat_quantize(&m, w, 1, 8, 8);
    CHECK(m.fmt == K3_QF_I8 && m.rows == 1 && m.cols == 8 && m.owned, "bits 8 -> int8 per-row");
    CHECK(m.scales[0] == 1.0f, "int8 scale = max|w|/127 = 1 (got %g)", m.scales[0]);
    CHECK(!memcmp(m.q8, want, 8), "int8 q = rint(w/s) half to even: %d %d %d %d %d %d %d %d",
          m.q8[0], m.q8[1], m.q8[2], m.q8[3], m.q8[4], m.q8[5], m.q8[6], m.q8[7]);
    CHECK(k3_qmat_bytes(&m) == 8 + 4, "int8 bytes = rows*cols + 4*rows");
    k3_qmat_free(&m);
    CHECK(m.q8 == NULL && m.scales == NULL, "k3_qmat_free clears the struct");

    /* scale floor: an all-zero row and a row of 1e-30 */
    float z[4] = {0, 0, 0, 0}, tiny[4] = {1e-30f, -1e-30f, 0, 5e-31f};
    k3_qmat_quantize(&m, z, 1, 4, 8);
    CHECK(m.scales[0] == 1e-20f && m.q8[0] == 0 && m.q8[3] == 0, "int8 zero row: s = 1e-20, q = 0");
    k3_qmat_free(&m);
    k3_qmat_quantize(&m, tiny, 1, 4, 8);
    CHECK(m.scales[0] == 1e-20f && m.q8[0] == 0 && m.q8[1] == 0,
          "int8 row of 1e-30: s floored at 1e-20 (got %g), q = 0", m.scales[0]);
    k3_qmat_free(&m);

    /* multiply by the float reciprocal, do not divide: find w with
     * rint(w * (1/s)) != rint(w / s) and check the quantizer took the first */
    int found = 0, agree = 0;
    for (int it = 0; it < 2000000 && !found; it++) {
        float mx = 0.5f + 0.5f * (float)(rnd() % 1000000) / 1e6f;
        float s = mx / 127.0f, inv = 1.0f / s;
        float k = (float)(rnd() % 126) + 0.5f;
        float v = k * s;
        for (int d = -3; d <= 3 && !found; d++) {
            float u = nextafterf(v, d < 0 ? 0.f : 1e9f);
            for (int e = 0; e < abs(d); e++) u = nextafterf(u, d < 0 ? 0.f : 1e9f);
            if (rintf(u * inv) == rintf(u / s)) continue;
            float row[2] = {mx, u};
            k3_qmat_quantize(&m, row, 1, 2, 8);
            found = 1;
            agree = m.scales[0] == s && m.q8[1] == (int8_t)rintf(u * inv);
            k3_qmat_free(&m);
        }
    }
    CHECK(found && agree, "int8 uses w * (1/s), not w / s (case found: %d)", found);

    /* bits mapping */
    float *r = fvec(3 * 128);
    k3_qmat_quantize(&m, r, 3, 128, 32);
    CHECK(m.fmt == K3_QF_F32 && !memcmp(m.w, r, 3 * 128 * sizeof(float)) &&
              k3_qmat_bytes(&m) == 3 * 128 * 4,
          "bits 32 -> f32 copy");
    k3_qmat_free(&m);
    k3_qmat_quantize(&m, r, 3, 128, 5);
    CHECK(m.fmt == K3_QF_I8, "bits 5 -> int8");
    k3_qmat_free(&m);
    k3_qmat_quantize(&m, r, 3, 128, 4);
    CHECK(m.fmt == K3_QF_I4G64 && k3_qmat_bytes(&m) == 3 * 64 + 3 * 2 * 4,
          "bits 4, cols 128 -> int4-g64");
    k3_qmat_free(&m);
    k3_qmat_quantize(&m, r, 3, 96, 4);
    CHECK(m.fmt == K3_QF_I8, "bits 4, cols 96 (not a multiple of 64) -> int8 fallback");
    k3_qmat_free(&m);
    free(r);
}

static void test_quant_i4(void) {
    /* one group of 64 with max|w| = 7 -> s = 1 */
    float w[128];
    for (int i = 0; i < 128; i++) w[i] = 0;
    float head[10] = {0.5f, 1.5f, 2.5f, 3.5f, -3.5f, -0.5f, 7.f, -7.f, -6.5f, 6.5f};
    int want[10] = {0, 2, 2, 4, -4, 0, 7, -7, -6, 6};
    memcpy(w, head, sizeof head);
    /* second group: all zero -> floor */
    k3_qmat m;
    k3_qmat_quantize(&m, w, 1, 128, 4);
    CHECK(m.fmt == K3_QF_I4G64 && m.scales[0] == 1.0f, "int4 group scale = max|w|/7 = 1 (got %g)",
          m.scales[0]);
    int ok = 1;
    for (int c = 0; c < 10; c++) {
        int nib = (c & 1) ? m.q4[c / 2] >> 4 : m.q4[c / 2] & 15;
        ok &= nib - 8 == want[c];
    }
    CHECK(ok, "int4 q = rint(w/s) half to even, stored q+8");
    CHECK(m.q4[0] == (uint8_t)((0 + 8) | (2 + 8) << 4) &&
              m.q4[3] == (uint8_t)((7 + 8) | (-7 + 8) << 4),
          "int4 nibble order: even column LOW (byte0 = 0x%02x, byte3 = 0x%02x)", m.q4[0], m.q4[3]);
    CHECK(m.scales[1] == 1e-20f && m.q4[32] == 0x88 && m.q4[63] == 0x88,
          "int4 zero group: s = 1e-20, nibbles 8");
    k3_qmat_free(&m);
}

static void test_downcast(void) {
    /* s8 = 0.5, group max |q8| = 14 -> s = 14*0.5/7 = 1, ratio 0.5 */
    float w[128];
    int8_t q8[8] = {14, -14, 3, 5, -1, 1, 7, -7};
    int want[8] = {7, -7, 2, 2, 0, 0, 4, -4};
    for (int i = 0; i < 128; i++) w[i] = 0;
    k3_qmat src = {.fmt = K3_QF_I8, .rows = 1, .cols = 128};
    src.q8 = calloc(128, 1);
    src.scales = malloc(sizeof(float));
    memcpy(src.q8, q8, 8);
    src.scales[0] = 0.5f;
    k3_qmat d;
    k3_qmat_downcast_i4(&d, &src);
    int ok = d.fmt == K3_QF_I4G64 && d.scales[0] == 1.0f;
    for (int c = 0; c < 8; c++) {
        int nib = (c & 1) ? d.q4[c / 2] >> 4 : d.q4[c / 2] & 15;
        ok &= nib - 8 == want[c];
    }
    CHECK(ok, "downcast: s = a*s8/7, q4 = rint(q8*(s8/s)) half to even (scale %g)", d.scales[0]);
    CHECK(d.scales[1] == 1e-20f && d.q4[40] == 0x88, "downcast zero group: s = 1e-20, q4 = 0");
    k3_qmat_free(&d);
    free(src.q8);
    free(src.scales);
    (void)w;

    /* random: downcast of int8 equals an independent float re-quantization */
    float *r = fvec(5 * 256);
    k3_qmat m8;
    k3_qmat_quantize(&m8, r, 5, 256, 8);
    k3_qmat_downcast_i4(&d, &m8);
    int bad = 0;
    for (int row = 0; row < 5; row++)
        for (int g = 0; g < 4; g++) {
            int a = 0;
            for (int i = 0; i < 64; i++)
                a = abs(m8.q8[row * 256 + g * 64 + i]) > a ? abs(m8.q8[row * 256 + g * 64 + i]) : a;
            float s = (float)a * m8.scales[row] / 7.0f;
            bad += d.scales[row * 4 + g] != s;
            for (int i = 0; i < 64; i++) {
                int c = g * 64 + i;
                int nib = (c & 1) ? d.q4[row * 128 + c / 2] >> 4 : d.q4[row * 128 + c / 2] & 15;
                float v = rintf((float)m8.q8[row * 256 + c] * (m8.scales[row] / s));
                bad += nib - 8 != (int)fmaxf(-8.f, fminf(7.f, v));
            }
        }
    CHECK(bad == 0, "downcast on random int8 rows matches the spec formula (%d mismatches)", bad);
    k3_qmat_free(&m8);
    k3_qmat_free(&d);
    free(r);
}

/* ---- scalar kernels vs float64 ---- */

static double dq_weight(const k3_qmat *m, int r, int c) {
    switch (m->fmt) {
    case K3_QF_F32: return m->w[(size_t)r * m->cols + c];
    case K3_QF_I8: return (double)m->q8[(size_t)r * m->cols + c] * m->scales[r];
    case K3_QF_I4G64: {
        uint8_t b = m->q4[(size_t)r * (m->cols / 2) + c / 2];
        int nib = (c & 1) ? b >> 4 : b & 15;
        return (double)(nib - 8) * m->scales[(size_t)r * (m->cols / 64) + c / 64];
    }
    }
    return 0;
}

static void test_scalar_vs_f64(void) {
    force(K3_ISA_SCALAR);
    const int rows = 37, cols = 512, n = 3;
    float *w = fvec((size_t)rows * cols), *x = fvec((size_t)n * cols);
    float *y = malloc(sizeof(float) * n * rows);
    double *ref = malloc(sizeof(double) * n * rows);
    int bits[3] = {32, 8, 4};
    for (int b = 0; b < 3; b++) {
        k3_qmat m;
        k3_qmat_quantize(&m, w, rows, cols, bits[b]);
        k3_qmat_matmul_rows(&m, x, n, y, 0, rows);
        double num = 0, den = 0;
        for (int t = 0; t < n; t++)
            for (int r = 0; r < rows; r++) {
                double s = 0;
                for (int c = 0; c < cols; c++) s += dq_weight(&m, r, c) * x[t * cols + c];
                num += (y[t * rows + r] - s) * (y[t * rows + r] - s);
                den += s * s;
            }
        double rel = sqrt(num / den);
        CHECK(rel < 2e-6, "scalar fmt %d (bits %d) vs float64 dequantize-then-dot: rel %.2e", m.fmt,
              bits[b], rel);
        k3_qmat_free(&m);
    }
    /* quantization error itself is bounded: int8 ~0.5%, int4 ~10% on normal weights */
    k3_qmat m8, m4;
    k3_qmat_quantize(&m8, w, rows, cols, 8);
    k3_qmat_quantize(&m4, w, rows, cols, 4);
    double e8 = 0, e4 = 0, d = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            double v = w[r * cols + c];
            e8 += (dq_weight(&m8, r, c) - v) * (dq_weight(&m8, r, c) - v);
            e4 += (dq_weight(&m4, r, c) - v) * (dq_weight(&m4, r, c) - v);
            d += v * v;
        }
    CHECK(sqrt(e8 / d) < 0.01 && sqrt(e4 / d) < 0.15,
          "weight quantization error int8 %.4f, int4 %.4f", sqrt(e8 / d), sqrt(e4 / d));
    k3_qmat_free(&m8);
    k3_qmat_free(&m4);
    free(w);
    free(x);
    free(y);
    free(ref);
}

static void test_mxfp4_reference(void) {
    force(K3_ISA_SCALAR);
    /* one row covering every nibble in both positions, probed with unit x */
    uint8_t packed[16], scale[1] = {127};
    for (int j = 0; j < 16; j++) packed[j] = (uint8_t)(j | (15 - j) << 4);
    k3_mxfp4 w = {.packed = packed, .scale = scale, .rows = 1, .cols = 32};
    int ok = 1;
    for (int c = 0; c < 32; c++) {
        float x[32] = {0}, y = -99;
        x[c] = 1.0f;
        k3_mxfp4_matmul_f32(&w, x, 1, &y, 0, 1);
        int nib = (c & 1) ? 15 - c / 2 : c / 2;
        ok &= y == k3_e2m1[nib];
    }
    CHECK(ok, "mxfp4 decode: low nibble = even column, e2m1 table, scale 127 = 1");
    float x1[32];
    for (int c = 0; c < 32; c++) x1[c] = 1.0f;
    for (int j = 0; j < 16; j++) packed[j] = 0x22; /* all +1.0 */
    float y;
    scale[0] = 0;
    k3_mxfp4_matmul_f32(&w, x1, 1, &y, 0, 1);
    CHECK(y == 0.0f && !signbit(y), "mxfp4 scale byte 0 -> group weight +0 (y = %g)", y);
    scale[0] = 255;
    k3_mxfp4_matmul_f32(&w, x1, 1, &y, 0, 1);
    CHECK(isinf(y) && y > 0, "mxfp4 scale byte 255 -> +inf (y = %g)", y);
    scale[0] = 130;
    k3_mxfp4_matmul_f32(&w, x1, 1, &y, 0, 1);
    CHECK(y == 32.0f * 8.0f, "mxfp4 scale byte 130 -> 2^3 (y = %g)", y);

    /* random matrix vs float64 dequantize-then-dot (ldexp: s in [110, 135]) */
    const int rows = 29, cols = 3584, n = 2;
    mx_buf b;
    mx_make(&b, rows, cols, 110, 135);
    float *x = fvec((size_t)n * cols), *yy = malloc(sizeof(float) * n * rows);
    k3_mxfp4_matmul_f32(&b.w, x, n, yy, 0, rows);
    double num = 0, den = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < rows; r++) {
            double s = 0;
            for (int c = 0; c < cols; c++) {
                uint8_t byte = b.packed[(size_t)r * cols / 2 + c / 2];
                int nib = (c & 1) ? byte >> 4 : byte & 15;
                s += (double)x[t * cols + c] * k3_e2m1[nib] *
                     ldexp(1.0, b.scale[(size_t)r * cols / 32 + c / 32] - 127);
            }
            num += (yy[t * rows + r] - s) * (yy[t * rows + r] - s);
            den += s * s;
        }
    CHECK(sqrt(num / den) < 1e-6, "mxfp4 f32 scalar vs float64 brute force: rel %.2e",
          sqrt(num / den));

    /* integer-dot: vs float64 of the same quantized activations */
    int8_t *q = malloc((size_t)n * cols);
    float *s = malloc(sizeof(float) * n * cols / 32);
    k3_act_quant_q8(x, n, cols, q, s);
    k3_mxfp4_matmul_i8(&b.w, q, s, n, yy, 0, rows);
    num = den = 0;
    double qerr = 0;
    for (int t = 0; t < n; t++)
        for (int r = 0; r < rows; r++) {
            double sq = 0, sx = 0;
            for (int c = 0; c < cols; c++) {
                uint8_t byte = b.packed[(size_t)r * cols / 2 + c / 2];
                int nib = (c & 1) ? byte >> 4 : byte & 15;
                double wv =
                    k3_e2m1[nib] * ldexp(1.0, b.scale[(size_t)r * cols / 32 + c / 32] - 127);
                sq += wv * q[t * cols + c] * s[t * cols / 32 + c / 32];
                sx += wv * x[t * cols + c];
            }
            num += (yy[t * rows + r] - sq) * (yy[t * rows + r] - sq);
            den += sq * sq;
            qerr += (sq - sx) * (sq - sx);
        }
    CHECK(sqrt(num / den) < 1e-6, "mxfp4 i8 scalar vs float64 of the same q: rel %.2e",
          sqrt(num / den));
    CHECK(sqrt(qerr / den) < 0.01, "mxfp4 i8 activation-quantization noise %.4f (spec ~0.4%%)",
          sqrt(qerr / den));
    mx_free(&b);
    free(x);
    free(yy);
    free(q);
    free(s);
}

static void test_act_quant(void) {
    force(K3_ISA_SCALAR);
    float x[64];
    for (int i = 0; i < 64; i++) x[i] = 0;
    /* group 0: max 127 -> s = 1: ties to even; group 1: all zero */
    float v[8] = {127.f, 0.5f, 1.5f, 2.5f, -2.5f, -126.5f, 3.5f, -0.5f};
    int8_t want[8] = {127, 0, 2, 2, -2, -126, 4, 0};
    memcpy(x, v, sizeof v);
    int8_t q[64];
    float s[2];
    k3_act_quant_q8(x, 1, 64, q, s);
    CHECK(s[0] == 1.0f && !memcmp(q, want, 8), "act quant: s = m/127, rint half to even");
    CHECK(s[1] == 1e-20f && q[40] == 0, "act quant zero group: s = 1e-20, q = 0");
    /* the max element maps to exactly +-127 and nothing exceeds it */
    int bad = 0;
    for (int it = 0; it < 2000; it++) {
        float xx[32];
        for (int i = 0; i < 32; i++) xx[i] = nrand() * (float)(1 + rnd() % 1000);
        int8_t qq[32];
        float ss;
        k3_act_quant_q8(xx, 1, 32, qq, &ss);
        int mx = 0;
        for (int i = 0; i < 32; i++) mx = abs(qq[i]) > mx ? abs(qq[i]) : mx;
        bad += mx != 127;
    }
    CHECK(bad == 0, "act quant: group max -> |q| = 127 exactly (clamped), %d bad of 2000", bad);
}

/* ---- vector ISAs vs scalar, and bit-identity within an ISA ---- */

/* worst relative L2 over the n output vectors [n][rows] */
static double worst_rel(const float *a, const float *b, int n, int rows) {
    double w = 0;
    for (int t = 0; t < n; t++) {
        double r = t_rel_l2(a + (size_t)t * rows, b + (size_t)t * rows, (size_t)rows);
        w = r > w ? r : w;
    }
    return w;
}

typedef struct {
    int kind; /* 0 qmat, 1 mxfp4 f32, 2 mxfp4 i8, 3 qmat integer-dot (m->idot set) */
    const k3_qmat *m;
    const k3_mxfp4 *w;
    const float *x;
    const int8_t *q;
    const float *s;
    int rows, cols;
} kcase;

static void run_rows(const kcase *k, int t0, int n, float *y, int r0, int r1) {
    const float *x = k->x + (size_t)t0 * k->cols;
    switch (k->kind) {
    case 0: k3_qmat_matmul_rows(k->m, x, n, y, r0, r1); break;
    case 1: k3_mxfp4_matmul_f32(k->w, x, n, y, r0, r1); break;
    case 3:
        k3_qmat_matmul_q8_rows(k->m, k->q + (size_t)t0 * k->cols,
                               k->s + (size_t)t0 * (k->cols / 32), n, y, r0, r1);
        break;
    default:
        k3_mxfp4_matmul_i8(k->w, k->q + (size_t)t0 * k->cols, k->s + (size_t)t0 * (k->cols / 32), n,
                           y, r0, r1);
    }
}

static void run_mt(const kcase *k, int n, float *y, k3_pool *pool) {
    switch (k->kind) {
    case 0:
    case 3: k3_qmat_matmul(k->m, k->x, n, y, pool); break; /* 3: quantizes x itself */
    case 1: k3_mxfp4_matmul_f32_mt(k->w, k->x, n, y, pool); break;
    default: k3_mxfp4_matmul_i8_mt(k->w, k->q, k->s, n, y, pool);
    }
}

static k3_pool *g_pools[4];

/* Checks one kernel case at n tokens: every vector level vs scalar, and for
 * every level: n separate matvecs, a ragged row split and 1/2/3 threads all
 * give the bits of the n-token call. */
static void check_case(const char *name, const kcase *k, int n) {
    const size_t ny = (size_t)n * k->rows;
    float *ys = malloc(ny * sizeof(float)), *yv = malloc(ny * sizeof(float));
    float *yb = malloc(ny * sizeof(float));
    for (int li = 0; li < g_nlevels; li++) {
        k3_isa l = g_levels[li];
        force(l);
        float *y = li == 0 ? ys : yv;
        run_rows(k, 0, n, y, 0, k->rows);
        if (li > 0) {
            /* all kernels share the scalar summation order (kernels.h) */
            double rel = worst_rel(yv, ys, n, k->rows);
            CHECK(!memcmp(ys, yv, ny * sizeof(float)),
                  "%s n=%d: %s == scalar bit for bit (rel %.1e)", name, n, k3_isa_name(l), rel);
        }
        if (l == K3_ISA_AVX512 && g_vbmi) { /* the decode without vpermb */
            char err[256];
            k3_isa_force_vbmi(0, err, sizeof err);
            run_rows(k, 0, n, yb, 0, k->rows);
            k3_isa_force_vbmi(1, err, sizeof err);
            CHECK(!memcmp(ys, yb, ny * sizeof(float)),
                  "%s n=%d: avx512 without VBMI == scalar bit for bit", name, n);
        }
        /* The scalar kernels are plain loops over (row, token): their
         * identity checks run on the small shapes only (fmaf is a libm call). */
        if (li == 0 && (size_t)k->rows * k->cols > 100000) continue;
        /* n matvecs */
        int same = 1;
        float *y1 = malloc((size_t)k->rows * sizeof(float));
        for (int t = 0; t < n; t++) {
            run_rows(k, t, 1, y1, 0, k->rows);
            same &= !memcmp(y1, y + (size_t)t * k->rows, (size_t)k->rows * sizeof(float));
        }
        free(y1);
        /* ragged row split: [0, a) [a, b) [b, rows) with odd boundaries */
        memset(yb, 0xff, ny * sizeof(float));
        int a = k->rows / 3 | 1, b = a + (k->rows - a) / 2 + 1;
        if (a > k->rows) a = k->rows;
        if (b > k->rows) b = k->rows;
        run_rows(k, 0, n, yb, 0, a);
        run_rows(k, 0, n, yb, a, b);
        run_rows(k, 0, n, yb, b, k->rows);
        int split = !memcmp(yb, y, ny * sizeof(float));
        int threads = 1;
        for (int p = 1; p <= 3; p++) {
            memset(yb, 0xff, ny * sizeof(float));
            run_mt(k, n, yb, p == 1 ? NULL : g_pools[p]);
            threads &= !memcmp(yb, y, ny * sizeof(float));
        }
        CHECK(same && split && threads,
              "%s n=%d %s: n matvecs %s, rows split %s, threads 1/2/3 %s (memcmp)", name, n,
              k3_isa_name(l), same ? "same" : "DIFFER", split ? "same" : "DIFFER",
              threads ? "same" : "DIFFER");
    }
    free(ys);
    free(yv);
    free(yb);
}

static void dense_case(const char *tag, int rows, int cols, int bits, const int *ns, int nn) {
    int nmax = 0;
    for (int i = 0; i < nn; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    float *w = fvec((size_t)rows * cols), *x = fvec((size_t)nmax * cols);
    k3_qmat m;
    k3_qmat_quantize(&m, w, rows, cols, bits);
    kcase k = {.kind = 0, .m = &m, .x = x, .rows = rows, .cols = cols};
    const char *fmt = m.fmt == K3_QF_F32 ? "f32" : m.fmt == K3_QF_I8 ? "int8" : "int4";
    char name[96];
    snprintf(name, sizeof name, "%s %s %dx%d%s", tag, fmt, rows, cols,
             bits == 4 && m.fmt == K3_QF_I8 ? " (int4 fell back)" : "");
    for (int i = 0; i < nn; i++) check_case(name, &k, ns[i]);
    if ((m.fmt == K3_QF_I8 || m.fmt == K3_QF_I4G64) && cols % 32 == 0) {
        /* the opt-in integer-dot kernel on the same matrix: levels, splits,
         * threads (its wrapper quantizes x itself) and its distance from
         * the float-activation result (activation quantization only) */
        int8_t *q = malloc((size_t)nmax * cols);
        float *s = malloc(sizeof(float) * nmax * cols / 32);
        force(K3_ISA_SCALAR);
        k3_act_quant_q8(x, nmax, cols, q, s);
        m.idot = 1;
        CHECK(k3_qmat_uses_idot(&m), "%s: idot flag selects the integer-dot path", name);
        kcase kq = {.kind = 3, .m = &m, .x = x, .q = q, .s = s, .rows = rows, .cols = cols};
        char qname[112];
        snprintf(qname, sizeof qname, "%s idot", name);
        for (int i = 0; i < nn; i++) check_case(qname, &kq, ns[i]);
        float *yf = malloc(sizeof(float) * nmax * rows), *yq = malloc(sizeof(float) * nmax * rows);
        m.idot = 0;
        k3_qmat_matmul_rows(&m, x, nmax, yf, 0, rows);
        k3_qmat_matmul_q8_rows(&m, q, s, nmax, yq, 0, rows);
        /* over all outputs: with a few rows one output vector is a few
         * dots, and one cancelling dot says nothing about the kernel */
        if (rows >= 16) {
            double rel = t_rel_l2(yq, yf, (size_t)nmax * rows);
            CHECK(rel < 0.03, "%s idot vs float activations: rel L2 %.2e < 3e-2", name, rel);
        }
        free(yf);
        free(yq);
        free(q);
        free(s);
    }
    k3_qmat_free(&m);
    free(w);
    free(x);
}

/* MXFP4 rows x cols with scale bytes in [s_lo, s_hi] and activations
 * times xmul, at ns tokens: every level, split and thread count (both
 * kernels) and the activation quantizer against scalar. */
static void mx_case_range(const char *tag, int rows, int cols, const int *ns, int nn, int s_lo,
                          int s_hi, float xmul) {
    int nmax = 0;
    for (int i = 0; i < nn; i++) nmax = ns[i] > nmax ? ns[i] : nmax;
    mx_buf b;
    mx_make(&b, rows, cols, s_lo, s_hi);
    float *x = fvec((size_t)nmax * cols);
    for (size_t i = 0; i < (size_t)nmax * cols; i++) x[i] *= xmul;
    int8_t *q = malloc((size_t)nmax * cols);
    float *s = malloc(sizeof(float) * nmax * cols / 32);
    force(K3_ISA_SCALAR);
    k3_act_quant_q8(x, nmax, cols, q, s);
    /* the activation quantizer of every level is bit-exact with scalar */
    int8_t *q2 = malloc((size_t)nmax * cols);
    float *s2 = malloc(sizeof(float) * nmax * cols / 32);
    for (int li = 1; li < g_nlevels; li++) {
        force(g_levels[li]);
        k3_act_quant_q8(x, nmax, cols, q2, s2);
        CHECK(!memcmp(q, q2, (size_t)nmax * cols) &&
                  !memcmp(s, s2, sizeof(float) * nmax * cols / 32),
              "%s act quant %dx%d: %s == scalar bit for bit", tag, nmax, cols,
              k3_isa_name(g_levels[li]));
    }
    kcase kf = {.kind = 1, .w = &b.w, .x = x, .rows = rows, .cols = cols};
    kcase ki = {.kind = 2, .w = &b.w, .q = q, .s = s, .rows = rows, .cols = cols};
    char name[96];
    for (int i = 0; i < nn; i++) {
        snprintf(name, sizeof name, "%s mxfp4 f32 %dx%d", tag, rows, cols);
        check_case(name, &kf, ns[i]);
        snprintf(name, sizeof name, "%s mxfp4 i8 %dx%d", tag, rows, cols);
        check_case(name, &ki, ns[i]);
    }
    mx_free(&b);
    free(x);
    free(q);
    free(s);
    free(q2);
    free(s2);
}

static void mx_case(const char *tag, int rows, int cols, const int *ns, int nn) {
    mx_case_range(tag, rows, cols, ns, nn, 112, 130, 1.0f);
}

/* MXFP4 group factors 2^(s-128) * sx at the edges of the float range:
 * zero and subnormal scale bytes, products that underflow, the largest
 * scale bytes with tiny activations and the smallest with huge ones; every
 * level against scalar (the random cases use bytes 112-130 only). */
static void test_mx_factor_edges(void) {
    const int ns[2] = {5, 32};
    mx_case_range("scales 0-20 (zero, subnormal)", 35, 2048, ns, 2, 0, 20, 1.0f);
    mx_case_range("scales 2-40, x 1e-20 (underflow)", 35, 2048, ns, 2, 2, 40, 1e-20f);
    mx_case_range("scales 230-254, x 1e-30", 35, 2048, ns, 2, 230, 254, 1e-30f);
    mx_case_range("scales 2-30, x 1e30", 35, 2048, ns, 2, 2, 30, 1e30f);
}

/* int4 with float activations runs on x held per lane of 8 columns to
 * 2^-22 of the lane's max|x| (kernels.c, the fixed-point order). Per token
 * one kind of input: normal, zero, one outlier per group, subnormal (exact
 * at E = -149), each lane another power of two from 2^-152 to 2^121
 * (subnormal, the two-step scaling, normal), huge, exact rounding
 * ties next to a large element, a different magnitude per group, then a
 * NaN and an inf. Every level gives the same bits (check_case); each
 * result is within that representation error (sum over columns of |w| *
 * 2^-22 * the lane max) plus 2^-21 of the sum of |terms| (float rounding)
 * of the float64 dot of the dequantized weights; a non-finite lane makes
 * the row NaN. 9 groups: a lone last one. */
static void test_i4_fixed_point(void) {
    enum { ROWS = 19, COLS = 64 * 9, NT = 10, NAN_T = 8, INF_T = 9 };
    float *w = fvec((size_t)ROWS * COLS), *x = fvec((size_t)NT * COLS);
    for (int t = 0; t < NT; t++)
        for (int c = 0; c < COLS; c++) {
            float *v = x + (size_t)t * COLS + c;
            const int g = c / 64;
            switch (t) {
            case 1: *v = 0.0f; break;
            case 2: *v = c % 64 == 5 ? 1000.0f : *v * 1e-3f; break;
            case 3: *v *= 1e-41f; break;                             /* subnormal */
            case 4: *v = ldexpf(*v, -152 + (c / 8) % 40 * 7); break; /* 2^-152 .. 2^121 */
            case 5: *v *= 1e30f; break;
            case 6: *v = c % 64 == 0 ? 3000000.0f : (float)(c % 7) - 3.5f; break; /* E = 0: ties */
            case 7: *v *= powf(10.0f, (float)(g - 4)); break;
            case NAN_T: *v = g == 3 && c % 64 == 9 ? NAN : *v; break;
            case INF_T: *v = g == 0 && c % 64 == 63 ? -INFINITY : *v; break;
            default: break;
            }
        }
    k3_qmat m;
    k3_qmat_quantize(&m, w, ROWS, COLS, 4);
    CHECK(m.fmt == K3_QF_I4G64, "fixed point: the matrix is int4-g64");
    kcase k = {.kind = 0, .m = &m, .x = x, .rows = ROWS, .cols = COLS};
    check_case("int4 fixed-point activations", &k, NT);
    float *y = malloc(sizeof(float) * NT * ROWS);
    force(K3_ISA_SCALAR);
    k3_qmat_matmul_rows(&m, x, NT, y, 0, ROWS);
    for (int t = 0; t < NT; t++) {
        double worst = 0;
        int nan_rows = 0;
        for (int r = 0; r < ROWS; r++) {
            const float yv = y[(size_t)t * ROWS + r];
            nan_rows += isnan(yv);
            if (t >= NAN_T) continue;
            double ref = 0, mag = 0, rep = 0;
            for (int c = 0; c < COLS; c++) {
                const float *xt = x + (size_t)t * COLS;
                double lane_max = 0;
                for (int j = c / 8 * 8; j < c / 8 * 8 + 8; j++)
                    lane_max = fmax(lane_max, fabs(xt[j]));
                const double wv = dq_weight(&m, r, c), term = wv * xt[c];
                ref += term;
                mag += fabs(term);
                rep += fabs(wv) * lane_max * 0x1p-22;
            }
            const double err = fabs(yv - ref) / (rep + mag * 0x1p-21 + COLS * 0x1p-149);
            worst = err > worst ? err : worst;
        }
        if (t >= NAN_T)
            CHECK(nan_rows == ROWS, "fixed point token %d (%s group): %d of %d rows NaN", t,
                  t == NAN_T ? "NaN" : "inf", nan_rows, ROWS);
        else
            CHECK(worst <= 1.0 && nan_rows == 0,
                  "fixed point token %d: |y - f64| within the bound (worst %.3f of it)", t, worst);
    }
    k3_qmat_free(&m);
    free(w);
    free(x);
    free(y);
}

static void test_act_quant_edge_isa(void) {
    /* ties, zeros, tiny and huge values, NaN: every level equals scalar */
    const int cols = 256;
    float x[2 * 256];
    for (int i = 0; i < 2 * cols; i++) {
        switch (rnd() % 6) {
        case 0: x[i] = (float)(rnd() % 255) - 127.0f + 0.5f; break;
        case 1: x[i] = 0.0f; break;
        case 2: x[i] = nrand() * 1e-25f; break;
        case 3: x[i] = nrand() * 1e30f; break;
        default: x[i] = nrand();
        }
    }
    for (int i = 64; i < 96; i++) x[i] = 0.0f; /* a zero group */
    x[200] = NAN;
    int8_t q0[512], q1[512];
    float s0[16], s1[16];
    force(K3_ISA_SCALAR);
    k3_act_quant_q8(x, 2, cols, q0, s0);
    for (int li = 1; li < g_nlevels; li++) {
        force(g_levels[li]);
        k3_act_quant_q8(x, 2, cols, q1, s1);
        CHECK(!memcmp(q0, q1, sizeof q0) && !memcmp(s0, s1, sizeof s0),
              "act quant edge values (ties, zeros, 1e-25, 1e30, NaN): %s == scalar",
              k3_isa_name(g_levels[li]));
    }
}

/* K3_ISA is read once, at the first kernel call: checked in a child process
 * (this program with --print-isa) for a forced level and a bad value. */
static void test_isa_env(const char *self) {
    const k3_isa det = k3_isa_detect();
    const char *envs[3] = {"scalar", "avx2", "bogus"};
    /* a level above the CPU's, or a bad value, falls back to the detected one */
    const char *want[3] = {"scalar", k3_isa_name(det >= K3_ISA_AVX2 ? K3_ISA_AVX2 : det),
                           k3_isa_name(det)};
    for (int i = 0; i < 3; i++) {
        char cmd[1200], got[64] = "";
        snprintf(cmd, sizeof cmd, "K3_ISA=%s '%s' --print-isa 2>/dev/null", envs[i], self);
        FILE *f = popen(cmd, "r");
        if (f) {
            if (!fgets(got, sizeof got, f)) got[0] = 0;
            pclose(f);
        }
        got[strcspn(got, "\n")] = 0;
        CHECK(!strcmp(got, want[i]), "K3_ISA=%s -> active level %s (want %s)", envs[i], got,
              want[i]);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--print-isa")) {
        printf("%s\n", k3_isa_name(k3_isa_active()));
        return 0;
    }
    char err[256];
    g_levels[g_nlevels++] = K3_ISA_SCALAR;
    for (k3_isa l = K3_ISA_AVX2; l <= k3_isa_detect(); l++) g_levels[g_nlevels++] = l;
    {
        char err[256];
        g_vbmi = k3_isa_force_vbmi(1, err, sizeof err) == K3_OK;
        if (g_vbmi)
            printf("# AVX-512 VBMI decode: yes (also checked off)\n");
        else
            SKIP("AVX-512 VBMI decode checks", "%s", err);
    }
    printf("# cpu supports up to %s; active %s\n", k3_isa_name(k3_isa_detect()),
           k3_isa_name(k3_isa_active()));
    if (g_nlevels == 1) SKIP("vector-vs-scalar checks", "no vector ISA on this CPU");
    CHECK(k3_isa_force((k3_isa)7, err, sizeof err) != K3_OK, "k3_isa_force rejects level 7: %s",
          err);
    for (int p = 2; p <= 3; p++)
        if (k3_pool_open(&g_pools[p], p, err, sizeof err) != K3_OK) {
            printf("not ok - pool: %s\n", err);
            return 1;
        }

    test_isa_env(argv[0]);
    test_tables();
    test_quant_i8();
    test_quant_i4();
    test_downcast();
    test_scalar_vs_f64();
    test_mxfp4_reference();
    test_act_quant();
    test_act_quant_edge_isa();
    test_i4_fixed_point();
    test_mx_factor_edges();

    /* odd sizes */
    const int odd_rows[4] = {1, 3, 17, 33};
    const int ns[4] = {1, 3, 8, 32};
    const int dense_cols[] = {32, 64, 96, 160, 37, 8, 5};
    for (int ri = 0; ri < 4; ri++)
        for (size_t ci = 0; ci < sizeof dense_cols / sizeof *dense_cols; ci++) {
            dense_case("odd", odd_rows[ri], dense_cols[ci], 32, ns, 4);
            dense_case("odd", odd_rows[ri], dense_cols[ci], 8, ns, 4);
            if (dense_cols[ci] % 32 == 0) dense_case("odd", odd_rows[ri], dense_cols[ci], 4, ns, 4);
        }
    for (int ri = 0; ri < 4; ri++) {
        dense_case("odd", odd_rows[ri], 128, 4, ns, 4);
        dense_case("odd", odd_rows[ri], 192, 4, ns, 4);
        for (int cols = 32; cols <= 160; cols += 32) mx_case("odd", odd_rows[ri], cols, ns, 4);
    }
    mx_case("odd", 40, 32 * 300, ns + 1, 1);      /* > 256 groups: the i8 kernel's group passes */
    mx_case("odd", 13, 64, (const int[]){40}, 1); /* > 32 tokens: the i8 token passes */
    /* every token-tile width of the integer kernels (n <= 16 is one tile) */
    for (int n = 2; n <= 16; n++) {
        dense_case("tile width", 33, 128, 8, &n, 1);
        dense_case("tile width", 33, 128, 4, &n, 1);
        mx_case("tile width", 33, 128, &n, 1);
    }

    /* activations beyond the 16 MiB per-thread scratch: token chunks */
    dense_case("chunked", 16, 65536, 4, (const int[]){70}, 1);
    mx_case("chunked", 16, 65536, (const int[]){260}, 1);

    /* K3 shapes */
    mx_case("K3 gate/up", 3072, 3584, ns, 4);
    mx_case("K3 down", 3584, 3072, ns, 4);
    dense_case("K3 kda", 1024, 7168, 4, ns, 4);
    dense_case("K3 mla", 1536, 7168, 8, ns, 4);
    dense_case("K3 lm_head slice", 256, 7168, 8, ns, 4);
    dense_case("K3 router", 896, 7168, 32, ns, 2);

    for (int p = 2; p <= 3; p++) k3_pool_close(&g_pools[p]);
    TEST_MAIN_END();
}
