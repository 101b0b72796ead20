/* tests/bench/bench_layers.c: one KDA and one MLA layer at the real K3
 * dimensions (random weights in the default load formats: KDA int4-g64, MLA
 * int8, f32 where docs/MODEL.md says so), timed per call. Not a test: prints a
 * table, asserts nothing.
 *
 * For each layer: decode (T = 1) and a prefill chunk (T = 32); MLA decode
 * at context 64 and 1024. "total" is k3_*_forward; "proj" is the same
 * layer's projection matmuls alone (the dense kernels, not this layer
 * code); "core" = total - proj is the per-head part (conv, recurrence,
 * norms, gates; MLA q_abs, scores, softmax, latent sum, V rows).
 *
 * Each number is the fastest of several calls (the machine may be shared).
 * --hidden 64 shrinks the model width (D), and with it every projection
 * but MLA's q_b, so "total" is then nearly all per-head work: the stable
 * way to time the core on a noisy machine.
 * Usage: bench_layers [--threads N] [--quick] [--only kda|mla] [--hidden D].
 * K3_ISA picks the level.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"
#include "common/kernels/kernels.h"
#include "common/layers/layers.h"
#include "common/base/pool.h"
#include "tests/bench/bench_util.h"

static float frand(void) {
    return (float)((double)(bench_rnd() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *fvec(size_t n, float scale) {
    float *v = k3_xaligned(64, n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = frand() * scale;
    return v;
}

/* A random matrix built directly in its load format (no f32 staging):
 * values uniform, scales chosen so that W x has unit-ish magnitude. */
static void qmat_rand(k3_qmat *m, int rows, int cols, int bits) {
    memset(m, 0, sizeof *m);
    m->rows = rows, m->cols = cols, m->owned = 1;
    const size_t nel = (size_t)rows * cols;
    const float s = 1.0f / sqrtf((float)cols);
    if (bits >= 32) {
        m->fmt = K3_QF_F32;
        m->w = fvec(nel, s * 1.7f);
    } else if (bits <= 4 && cols % 64 == 0) {
        m->fmt = K3_QF_I4G64;
        m->q4 = k3_xaligned(64, nel / 2);
        for (size_t i = 0; i < nel / 2; i++) m->q4[i] = (uint8_t)bench_rnd();
        m->scales = k3_xaligned(64, (size_t)rows * (cols / 64) * sizeof(float));
        for (size_t i = 0; i < (size_t)rows * (cols / 64); i++) m->scales[i] = s / 4.6f;
    } else {
        m->fmt = K3_QF_I8;
        m->q8 = k3_xaligned(64, nel);
        for (size_t i = 0; i < nel; i++) m->q8[i] = (int8_t)((int)(bench_rnd() % 255) - 127);
        m->scales = k3_xaligned(64, (size_t)rows * sizeof(float));
        for (int r = 0; r < rows; r++) m->scales[r] = s / 73.0f;
    }
}

static k3_config k3_cfg(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    c.hidden = 7168, c.eps = 1e-5f;
    c.kda_heads = 96, c.kda_hd = 128, c.kda_proj = 12288, c.conv_k = 4, c.gate_lb = -5.0f;
    c.n_heads = 96, c.q_lora = 1536, c.kv_lora = 512, c.qk_nope = 128, c.qk_rope = 64;
    c.v_head = 128, c.qk_head = 192;
    return c;
}

/* ms of the fastest of `reps` calls after one warm-up (the minimum: this
 * machine is shared, and interference only ever adds time) */
#define TIME_MS(reps, stmt)                                                                        \
    ({                                                                                             \
        stmt;                                                                                      \
        double best_ = 1e30;                                                                       \
        for (int r_ = 0; r_ < (reps); r_++) {                                                      \
            double t0_ = k3_now_s();                                                               \
            stmt;                                                                                  \
            double dt_ = (k3_now_s() - t0_) * 1e3;                                                 \
            best_ = dt_ < best_ ? dt_ : best_;                                                     \
        }                                                                                          \
        best_;                                                                                     \
    })

int main(int argc, char **argv) {
    int threads = 1, quick = 0;
    const char *only = "";
    int hidden = 7168;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--hidden") && i + 1 < argc)
            hidden = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
    }
    char err[256];
    k3_pool *pool = NULL;
    if (threads > 1 && k3_pool_open(&pool, threads, err, sizeof err) != K3_OK) {
        fprintf(stderr, "pool: %s\n", err);
        return 1;
    }
    if (hidden < 64 || hidden % 64) {
        fprintf(stderr, "--hidden %d: must be a positive multiple of 64\n", hidden);
        return 1;
    }
    k3_config c = k3_cfg();
    c.hidden = hidden;
    const int D = c.hidden, P = c.kda_proj, H = c.kda_heads, d = c.kda_hd, Tp = 32;
    const int reps_d = quick ? 5 : 20, reps_p = quick ? 2 : 5;
    k3_layer_ctx lc = {&c, pool, NULL, 0, 0, NULL, NULL};
    float *x = fvec((size_t)Tp * D, 1.0f), *out = fvec((size_t)Tp * D, 1.0f);
    float *tmp = fvec((size_t)Tp * 24576, 1.0f), *tmp2 = fvec((size_t)Tp * 24576, 1.0f);
    printf("# bench_layers: isa %s, %d thread(s), K3 heads (KDA 96x128 int4, MLA 96 heads "
           "int8), D = %d\n",
           k3_isa_name(k3_isa_active()), threads, hidden);
    printf("%-24s %10s %10s %10s\n", "layer / shape", "total ms", "proj ms", "core ms");

    /* ---- KDA ---- */
    if (strcmp(only, "mla")) {
        k3_kda_w kw;
        memset(&kw, 0, sizeof kw);
        qmat_rand(&kw.q, P, D, 4), qmat_rand(&kw.k, P, D, 4), qmat_rand(&kw.v, P, D, 4);
        qmat_rand(&kw.g, P, D, 4), qmat_rand(&kw.o, D, P, 4);
        qmat_rand(&kw.f_a, d, D, 32), qmat_rand(&kw.f_b, P, d, 32), qmat_rand(&kw.b, H, D, 32);
        kw.conv_q = fvec((size_t)P * 4, 0.5f), kw.conv_k = fvec((size_t)P * 4, 0.5f);
        kw.conv_v = fvec((size_t)P * 4, 0.5f), kw.dt_bias = fvec((size_t)P, 0.5f);
        kw.A = fvec((size_t)H, 0.5f), kw.o_norm = fvec((size_t)d, 1.0f);
        float *S = calloc((size_t)H * d * d, sizeof(float)), *conv = calloc((size_t)3 * P * 4, 4);
        k3_kda_state st = {S, conv};
        size_t cap = k3_kda_scratch_bytes(&c, Tp);
        k3_arena ar = {k3_xaligned(64, cap), cap, 0};
        for (int pass = 0; pass < 2; pass++) {
            const int T = pass ? Tp : 1, reps = pass ? reps_p : reps_d;
            double tot =
                TIME_MS(reps, (ar.used = 0, k3_kda_forward(&lc, &kw, &st, x, T, out, &ar)));
            double proj = TIME_MS(reps, ({
                                      k3_qmat_matmul(&kw.q, x, T, tmp, pool);
                                      k3_qmat_matmul(&kw.k, x, T, tmp, pool);
                                      k3_qmat_matmul(&kw.v, x, T, tmp, pool);
                                      k3_qmat_matmul(&kw.g, x, T, tmp, pool);
                                      k3_qmat_matmul(&kw.f_a, x, T, tmp2, pool);
                                      k3_qmat_matmul(&kw.f_b, tmp2, T, tmp, pool);
                                      k3_qmat_matmul(&kw.b, x, T, tmp, pool);
                                      k3_qmat_matmul(&kw.o, tmp, T, out, pool);
                                  }));
            char name[64];
            snprintf(name, sizeof name, "KDA T=%d", T);
            printf("%-24s %10.2f %10.2f %10.2f   (core %.3f ms/token)\n", name, tot, proj,
                   tot - proj, (tot - proj) / T);
            fflush(stdout);
        }
        free(ar.base);
        k3_qmat *km[8] = {&kw.q, &kw.k, &kw.v, &kw.g, &kw.o, &kw.f_a, &kw.f_b, &kw.b};
        for (int i = 0; i < 8; i++) k3_qmat_free(km[i]);
    }
    if (!strcmp(only, "kda")) return 0;

    /* ---- MLA ---- */
    k3_mla_w mw;
    memset(&mw, 0, sizeof mw);
    qmat_rand(&mw.q_a, c.q_lora, D, 8), qmat_rand(&mw.q_b, H * c.qk_head, c.q_lora, 8);
    qmat_rand(&mw.kv_a, c.kv_lora + c.qk_rope, D, 8);
    qmat_rand(&mw.kv_b, H * (c.qk_nope + c.v_head), c.kv_lora, 8);
    qmat_rand(&mw.g, H * c.v_head, D, 8), qmat_rand(&mw.o, D, H * c.v_head, 8);
    mw.q_a_norm = fvec((size_t)c.q_lora, 1.0f), mw.kv_a_norm = fvec((size_t)c.kv_lora, 1.0f);
    k3_mla_cache cache = {0};
    const int max_ctx = 1100;
    if (k3_mla_cache_reserve(&cache, &c, max_ctx, max_ctx, err, sizeof err) != K3_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    /* fill the cache with plausible rows (a prefill would) */
    for (size_t i = 0; i < (size_t)max_ctx * c.kv_lora; i++) cache.lat[i] = frand();
    for (size_t i = 0; i < (size_t)max_ctx * c.qk_rope; i++) cache.rope[i] = frand();
    static const struct { int T, pos0; } cases[] = {{1, 64}, {1, 1024}, {32, 0}, {32, 1024 - 32}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int T = cases[ci].T, pos0 = cases[ci].pos0, reps = T > 1 ? reps_p : reps_d;
        size_t cap = k3_mla_scratch_bytes(&c, T, pos0 + T);
        k3_arena ma = {k3_xaligned(64, cap), cap, 0};
        double tot =
            TIME_MS(reps, (ma.used = 0, k3_mla_forward(&lc, &mw, &cache, pos0, x, T, out, &ma)));
        double proj = TIME_MS(reps, ({
                                  k3_qmat_matmul(&mw.q_a, x, T, tmp2, pool);
                                  k3_qmat_matmul(&mw.q_b, tmp2, T, tmp, pool);
                                  k3_qmat_matmul(&mw.kv_a, x, T, tmp2, pool);
                                  k3_qmat_matmul(&mw.g, x, T, tmp, pool);
                                  k3_qmat_matmul(&mw.o, tmp, T, out, pool);
                              }));
        char name[64];
        snprintf(name, sizeof name, "MLA T=%d ctx=%d", T, pos0 + T);
        printf("%-24s %10.2f %10.2f %10.2f   (core %.3f ms/token)\n", name, tot, proj, tot - proj,
               (tot - proj) / T);
        fflush(stdout);
        free(ma.base);
    }
    k3_mla_cache_free(&cache);
    k3_qmat *mm[6] = {&mw.q_a, &mw.q_b, &mw.kv_a, &mw.kv_b, &mw.g, &mw.o};
    for (int i = 0; i < 6; i++) k3_qmat_free(mm[i]);
    k3_pool_close(&pool);
    return 0;
}
