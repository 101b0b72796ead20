/* tests/test_vk.c: the Vulkan expert tier (common/vk/) against the CPU's
 * exact-float path (k3_mxfp4_matmul_f32, k3_situ): one MXFP4 expert over n
 * (position, rank) pairs, many shapes, group exponents at the float range's
 * edges, the s = 0 / 255 groups, and the errors (bad device index, budget,
 * shapes). Runs on any Vulkan device; lavapipe (mesa-vulkan-drivers) is
 * enough. Skips only where there is no device or the build has no Vulkan. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/kernels/kernels.h"
#include "common/kernels/ops.h"
#include "common/vk/vk.h"
#include "tests/test.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}
static float rnd_normal(void) { /* sum of 4 uniforms, centred: enough spread */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(rnd() & 0xffffff) / 16777216.0f;
    return (s - 2.0f) * 1.7f;
}

typedef struct mat {
    k3_mxfp4 m;
    uint8_t *p, *s;
} mat;

/* rows x cols with exponents uniform in [s_lo, s_hi] */
static void mat_make(mat *w, int rows, int cols, int s_lo, int s_hi) {
    w->p = malloc((size_t)rows * cols / 2);
    w->s = malloc((size_t)rows * cols / 32);
    for (size_t i = 0; i < (size_t)rows * cols / 2; i++) w->p[i] = (uint8_t)rnd();
    for (size_t i = 0; i < (size_t)rows * cols / 32; i++)
        w->s[i] = (uint8_t)(s_lo + (int)(rnd() % (uint32_t)(s_hi - s_lo + 1)));
    w->m = (k3_mxfp4){.packed = w->p, .scale = w->s, .rows = rows, .cols = cols};
}
static void mat_free(mat *w) { free(w->p), free(w->s); }

static void cpu_expert(const mat *w1, const mat *w2, const mat *w3, const float *z, int n, float b1,
                       float b2, float *y) {
    const int I = w1->m.rows, L = w1->m.cols;
    float *g = malloc(sizeof(float) * n * I), *u = malloc(sizeof(float) * n * I);
    k3_mxfp4_matmul_f32(&w1->m, z, n, g, 0, I);
    k3_mxfp4_matmul_f32(&w3->m, z, n, u, 0, I);
    k3_situ(g, g, u, n * I, b1, b2);
    k3_mxfp4_matmul_f32(&w2->m, g, n, y, 0, L);
    free(g), free(u);
}

typedef struct vcase {
    const char *name;
    int I, L, n;
    int s13_lo, s13_hi; /* gate/up exponents */
    int s2_lo, s2_hi;   /* down exponents */
    int x_exp;          /* activations scaled by 2^x_exp */
} vcase;

/* One case: returns rel-L2, counts bit-identical outputs into *same. */
static double run_case(k3_vk *vk, const vcase *c, size_t *same, size_t *total, int *ok) {
    mat w1, w2, w3;
    mat_make(&w1, c->I, c->L, c->s13_lo, c->s13_hi);
    mat_make(&w2, c->L, c->I, c->s2_lo, c->s2_hi);
    mat_make(&w3, c->I, c->L, c->s13_lo, c->s13_hi);
    const size_t nz = (size_t)c->n * c->L;
    float *z = malloc(sizeof(float) * nz), *yc = malloc(sizeof(float) * nz),
          *yv = malloc(sizeof(float) * nz);
    for (size_t i = 0; i < nz; i++) z[i] = ldexpf(rnd_normal(), c->x_exp);
    const float b1 = 4.0f, b2 = 25.0f;
    cpu_expert(&w1, &w2, &w3, z, c->n, b1, b2, yc);
    char err[256] = "";
    k3_vk_expert *e = NULL;
    double rel = INFINITY;
    *ok = 0;
    if (k3_vk_expert_upload(vk, &w1.m, &w2.m, &w3.m, &e, err, sizeof err) == K3_OK &&
        k3_vk_expert_apply(vk, e, z, c->n, b1, b2, yv, err, sizeof err) == K3_OK) {
        *ok = 1;
        rel = t_rel_l2(yv, yc, nz);
        for (size_t i = 0; i < nz; i++) *same += memcmp(&yv[i], &yc[i], sizeof(float)) == 0;
        *total += nz;
    } else {
        printf("# %s: %s\n", c->name, err);
    }
    k3_vk_expert_free(vk, &e);
    free(z), free(yc), free(yv);
    mat_free(&w1), mat_free(&w2), mat_free(&w3);
    return rel;
}

/* float class: 0 finite, 1 +inf, 2 -inf, 3 NaN */
static int fclass(float v) { return isnan(v) ? 3 : isinf(v) ? (v > 0 ? 1 : 2) : 0; }

int main(void) {
    char err[256] = "";
    k3_vk *vk = NULL;
    k3_status st = k3_vk_open(&vk, 0, 0, err, sizeof err);
    if (!k3_vk_built()) {
        CHECK(st == K3_ERR_STATE && strstr(err, "unavailable"),
              "a build without Vulkan refuses --vk clearly: %s", err);
        SKIP("vulkan expert tier", "this build has no Vulkan (glslc or libvulkan-dev missing)");
        TEST_MAIN_END();
    }
    if (st == K3_ERR_MISSING) {
        SKIP("vulkan expert tier", "no Vulkan device (%s)", err);
        TEST_MAIN_END();
    }
    CHECK(st == K3_OK, "open Vulkan device 0: %s", st == K3_OK ? k3_vk_device_name(vk) : err);
    if (st != K3_OK) TEST_MAIN_END();
    printf("# device: %s%s\n", k3_vk_device_name(vk), k3_vk_is_cpu(vk) ? " (CPU)" : "");

    static const vcase cases[] = {
        {"32x32 n=1", 32, 32, 1, 118, 136, 118, 136, 0},
        {"64x96 n=3", 64, 96, 3, 118, 136, 118, 136, 0},
        {"96x64 n=7", 96, 64, 7, 110, 140, 110, 140, 0},
        {"128x256 n=17", 128, 256, 17, 118, 136, 118, 136, 0},
        {"160x224 n=2", 160, 224, 2, 100, 150, 118, 136, 0},
        {"512x1024 n=4 (K3-like aspect)", 512, 1024, 4, 118, 136, 118, 136, 0},
        {"3072x3584 n=2 (a K3 expert)", 3072, 3584, 2, 118, 132, 118, 132, 0},
        {"gate/up exponents 1..6, x 2^110", 64, 128, 5, 1, 6, 118, 136, 110},
        {"gate/up exponents 249..254, x 2^-120", 64, 128, 5, 249, 254, 118, 136, -120},
        {"down exponents 200..230", 64, 128, 3, 118, 136, 200, 230, 0},
        {"down exponents 30..50, x 2^40", 64, 128, 3, 118, 136, 30, 50, 40},
    };
    const int nc = (int)(sizeof cases / sizeof cases[0]);
    double worst = 0;
    size_t same = 0, total = 0;
    for (int i = 0; i < nc; i++) {
        int ok;
        double rel = run_case(vk, &cases[i], &same, &total, &ok);
        CHECK(ok && rel <= 1e-6, "device expert %s: rel-L2 %.3g vs the CPU exact-float path",
              cases[i].name, rel);
        if (rel > worst) worst = rel;
    }
    printf("# worst rel-L2 %.3g; %zu of %zu outputs bit-identical to the CPU\n", worst, same,
           total);
    if (k3_vk_exact(vk)) /* the float64-FMA shader rounds every fused step as the CPU does */
        CHECK(same == total, "float64-FMA shader: %zu of %zu outputs bit-identical to the CPU",
              same, total);

    { /* the device-fma() shader (devices without float64): an unfused fma on lavapipe, so
       * cancellation in the wide-exponent cases magnifies ulp errors (measured up to 1.9e-6):
       * checked against 1e-5, not the 1e-6 of the float64-FMA shader */
        setenv("K3_VK_FMA", "native", 1);
        k3_vk *nat = NULL;
        st = k3_vk_open(&nat, 0, 0, err, sizeof err);
        unsetenv("K3_VK_FMA");
        double wn = 0;
        size_t sn = 0, tn = 0;
        int all = st == K3_OK && !k3_vk_exact(nat);
        for (int i = 0; all && i < nc; i++) {
            int ok;
            double rel = run_case(nat, &cases[i], &sn, &tn, &ok);
            all = ok && rel <= 1e-5;
            if (rel > wn) wn = rel;
        }
        CHECK(all,
              "K3_VK_FMA=native shader: worst rel-L2 %.3g over the %d cases (%zu of %zu "
              "bit-identical)",
              wn, nc, sn, tn);
        k3_vk_close(&nat);
    }

    { /* s = 0 (+0) and s = 255 (+inf) groups: zeros, infs and NaNs where the CPU has them */
        mat w1, w2, w3;
        mat_make(&w1, 32, 64, 120, 130);
        mat_make(&w2, 64, 32, 120, 130);
        mat_make(&w3, 32, 64, 120, 130);
        for (int r = 0; r < 32; r++) { /* gate/up: +0 groups (an inf there reaches every output) */
            if (r % 4 == 1) w1.s[r * 2] = 0;
            if (r % 4 == 2) w3.s[r * 2 + 1] = 0;
        }
        w2.s[5] = 0;    /* down row 5: a zero group */
        w2.s[8] = 255;  /* down row 8: an inf group (inf or NaN there) */
        w2.s[40] = 255; /* down row 40 */
        float z[2 * 64], yc[2 * 64], yv[2 * 64];
        for (int i = 0; i < 2 * 64; i++) z[i] = rnd_normal();
        cpu_expert(&w1, &w2, &w3, z, 2, 4.0f, 25.0f, yc);
        k3_vk_expert *e = NULL;
        int ok = k3_vk_expert_upload(vk, &w1.m, &w2.m, &w3.m, &e, err, sizeof err) == K3_OK &&
                 k3_vk_expert_apply(vk, e, z, 2, 4.0f, 25.0f, yv, err, sizeof err) == K3_OK;
        int cls = 0, nonfinite = 0;
        float fy[2 * 64], fc[2 * 64];
        int nf = 0;
        for (int i = 0; ok && i < 2 * 64; i++) {
            cls += fclass(yv[i]) == fclass(yc[i]);
            nonfinite += fclass(yc[i]) != 0;
            if (fclass(yc[i]) == 0 && fclass(yv[i]) == 0) fy[nf] = yv[i], fc[nf++] = yc[i];
        }
        CHECK(ok && cls == 2 * 64 && nonfinite > 0 && t_rel_l2(fy, fc, (size_t)nf) <= 1e-6,
              "exponent bytes 0 and 255: %d of 128 outputs in the CPU's class (%d non-finite), "
              "finite ones rel-L2 %.3g",
              cls, nonfinite, nf ? t_rel_l2(fy, fc, (size_t)nf) : -1.0);
        k3_vk_expert_free(vk, &e);
        mat_free(&w1), mat_free(&w2), mat_free(&w3);
    }

    { /* several experts in one submission (k3_vk_experts_apply, what a MoE step's device
       * job sends): each expert's rows are the CPU's, n = 0 experts included, odd row
       * counts so the segments need the offset alignment */
        enum { M = 5, EI = 64, EL = 96 };
        static const int nn[M] = {3, 0, 1, 7, 2};
        mat w[M][3];
        k3_vk_expert *ex[M] = {0};
        int ok = 1, tot = 0;
        for (int i = 0; i < M; i++) {
            mat_make(&w[i][0], EI, EL, 118, 136);
            mat_make(&w[i][1], EL, EI, 118, 136);
            mat_make(&w[i][2], EI, EL, 118, 136);
            ok = ok && k3_vk_expert_upload(vk, &w[i][0].m, &w[i][1].m, &w[i][2].m, &ex[i], err,
                                           sizeof err) == K3_OK;
            tot += nn[i];
        }
        float *z = malloc(sizeof(float) * tot * EL), *yv = malloc(sizeof(float) * tot * EL),
              *yc = malloc(sizeof(float) * tot * EL);
        for (int i = 0; i < tot * EL; i++) z[i] = rnd_normal();
        ok = ok && k3_vk_experts_apply(vk, (const k3_vk_expert *const *)ex, nn, M, z, 4.0f, 25.0f,
                                       yv, err, sizeof err) == K3_OK;
        int row = 0;
        for (int i = 0; i < M; i++) {
            if (nn[i])
                cpu_expert(&w[i][0], &w[i][1], &w[i][2], z + (size_t)row * EL, nn[i], 4.0f, 25.0f,
                           yc + (size_t)row * EL);
            row += nn[i];
        }
        size_t bits = 0;
        for (int i = 0; ok && i < tot * EL; i++) bits += memcmp(&yv[i], &yc[i], sizeof(float)) == 0;
        double rel = ok ? t_rel_l2(yv, yc, (size_t)tot * EL) : -1.0;
        CHECK(ok && rel <= 1e-6 && (!k3_vk_exact(vk) || bits == (size_t)tot * EL),
              "%d experts (%d pairs, one with none) in one submission: rel-L2 %.3g, %zu of %d "
              "outputs bit-identical to the CPU%s",
              M, tot, rel, bits, tot * EL, ok ? "" : err);
        const k3_vk_expert *mix[2] = {ex[0], NULL};
        mat s1, s2, s3; /* another shape in the same call is refused */
        mat_make(&s1, 32, 64, 127, 127);
        mat_make(&s2, 64, 32, 127, 127);
        mat_make(&s3, 32, 64, 127, 127);
        k3_vk_expert *other = NULL;
        st = k3_vk_expert_upload(vk, &s1.m, &s2.m, &s3.m, &other, err, sizeof err);
        mix[1] = other;
        int n2[2] = {1, 1};
        if (st == K3_OK)
            st = k3_vk_experts_apply(vk, mix, n2, 2, z, 4.0f, 25.0f, yv, err, sizeof err);
        CHECK(st == K3_ERR_ARG && strstr(err, "32x64"),
              "experts of two shapes in one call refused: %s", err);
        k3_vk_expert_free(vk, &other);
        mat_free(&s1), mat_free(&s2), mat_free(&s3);
        for (int i = 0; i < M; i++) {
            k3_vk_expert_free(vk, &ex[i]);
            for (int k = 0; k < 3; k++) mat_free(&w[i][k]);
        }
        free(z), free(yv), free(yc);
    }

    { /* errors: shapes, budget, device index */
        mat a, b;
        mat_make(&a, 32, 64, 127, 127);
        mat_make(&b, 32, 64, 127, 127); /* down must be [64][32] */
        k3_vk_expert *e = NULL;
        st = k3_vk_expert_upload(vk, &a.m, &b.m, &a.m, &e, err, sizeof err);
        CHECK(st == K3_ERR_ARG && !e && strstr(err, "shapes"), "mismatched shapes refused: %s",
              err);
        mat_free(&a), mat_free(&b);
        k3_vk *small = NULL;
        st = k3_vk_open(&small, 0, 1e-6, err, sizeof err); /* 1000 bytes */
        CHECK(st == K3_OK, "open with a 1000-byte budget: %s", st == K3_OK ? "ok" : err);
        if (st == K3_OK) {
            mat w1, w2, w3;
            mat_make(&w1, 32, 64, 127, 127);
            mat_make(&w2, 64, 32, 127, 127);
            mat_make(&w3, 32, 64, 127, 127);
            st = k3_vk_expert_upload(small, &w1.m, &w2.m, &w3.m, &e, err, sizeof err);
            CHECK(st == K3_ERR_LIMIT && strstr(err, "budget") && k3_vk_used_bytes(small) == 0,
                  "an upload past the budget is refused: %s", err);
            mat_free(&w1), mat_free(&w2), mat_free(&w3);
            k3_vk_close(&small);
        }
        st = k3_vk_open(&small, 999, 0, err, sizeof err);
        CHECK(st == K3_ERR_MISSING && !small && strstr(err, "999"), "device index 999 refused: %s",
              err);
    }
    CHECK(k3_vk_used_bytes(vk) == 0, "every expert buffer freed (%llu bytes in use)",
          (unsigned long long)k3_vk_used_bytes(vk));
    k3_vk_close(&vk);
    TEST_MAIN_END();
}
