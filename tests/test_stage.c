/* tests/test_stage.c: the forward pass (common/engine/model.c, stage.c and the
 * layer files) on the tiny checkpoint and on hand-made cases.
 *
 *   - ops, AttnRes mix, KDA step, KDA conv taps, MLA, router and one MXFP4
 *     expert on small cases checked by hand;
 *   - per-layer hidden states vs tests/ref/k3_ref.py in exact mode
 *     (rel L2 <= 1e-5) for prompts of 1, 7 and 40 tokens;
 *   - bit identity (memcmp): chunk 1 / 3 / 32, threads 1 / 2, the split
 *     [0,3) + [3,8) vs [0,8), expert budget of one slot vs a large one;
 *   - bad input: missing tensor, wrong shape, expert of the wrong byte size,
 *     missing expert selected at run time, token id >= vocab, positions past
 *     the context, cancellation. The broken checkpoints are copies of tiny
 *     with one shard rewritten (tests/st_edit.h);
 *   - a worker range opens and runs with every foreign shard poisoned;
 *   - repacked containers (U8 + .qs, docs/MODEL.md 2.3) give the bits of load-time
 *     quantization; explicit K3_BITS=4 downcasts an int8 container;
 *   - F16 / F32 / single-file / unprefixed / root-config layouts give the
 *     same bits; two sessions on one model from two threads too.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/experts/experts.h"
#include "common/kernels/kernels.h"
#include "common/layers/layers.h"
#include "common/engine/model.h"
#include "common/ckpt/safetensors.h"
#include "common/engine/stage.h"
#include "tests/st_edit.h"
#include "tests/test.h"

static char err[1024];
static int g_direct = 1; /* K3_DIRECT of the models open_model makes */

/* ---- running prompts through the model ---- */

typedef struct trace_buf {
    float *h; /* [n_layers][T_total][D] */
    int T_total, D;
} trace_buf;

static void trace_cb(void *ctx, int layer, int pos0, int T, const float *h) {
    trace_buf *tb = ctx;
    memcpy(tb->h + ((size_t)layer * tb->T_total + pos0) * tb->D, h,
           sizeof(float) * (size_t)T * tb->D);
}

static k3_model *open_model(const char *dir, int a, int b, int global, int threads, int exact,
                            double expert_gb) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.layer_a = a;
    o.layer_b = b;
    o.want_global = global;
    o.threads = threads;
    o.expert_gb = expert_gb;
    o.direct = g_direct;
    if (exact) {
        o.bits = o.mla_bits = o.head_bits = 32;
        o.idot = 0;
    }
    k3_model *m = NULL;
    if (k3_model_open(&m, &o, err, sizeof err) != K3_OK) {
        printf("# open %s [%d,%d): %s\n", dir, a, b, err);
        return NULL;
    }
    return m;
}

/* Runs ids[0..T) in chunks of `chunk` through the whole model: trace
 * [n_layers][T][D] and logits [T][vocab] (either may be NULL). */
static k3_status run_prompt(k3_model *m, const int32_t *ids, int T, int chunk, float *trace,
                            float *logits) {
    const k3_config *c = k3_model_config(m);
    int D = c->hidden;
    k3_state *s = NULL;
    k3_status st = k3_state_open(&s, m, T, err, sizeof err);
    if (st) return st;
    float *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * (size_t)chunk * D);
    float *h = malloc(sizeof(float) * (size_t)chunk * D);
    trace_buf tb = {trace, T, D};
    for (int p = 0; p < T && !st; p += chunk) {
        int n = T - p < chunk ? T - p : chunk;
        int nb = 0;
        st = k3_model_embed(m, ids + p, n, h, err, sizeof err);
        if (!st)
            st = k3_stage_forward(m, s, p, n, blocks, &nb, h, NULL, trace ? trace_cb : NULL, &tb,
                                  err, sizeof err);
        if (!st && logits)
            st = k3_model_head(m, blocks, nb, h, n, 0, logits + (size_t)p * c->vocab, err,
                               sizeof err);
    }
    free(blocks);
    free(h);
    k3_state_close(&s);
    return st;
}

static void make_ids(int32_t *ids, int T, uint32_t seed, int vocab) {
    for (int t = 0; t < T; t++) {
        seed = seed * 1664525u + 1013904223u;
        ids[t] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

/* Reads a raw f32 file of exactly n floats. */
static int read_f32(const char *path, float *dst, size_t n) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t got = fread(dst, sizeof(float), n, f);
    int extra = fgetc(f) != EOF;
    fclose(f);
    return got == n && !extra ? 0 : -1;
}

/* ---- hand-made cases ---- */

static void test_ops(void) {
    float x[2] = {3, 4}, w[2] = {1, 1}, y[2];
    k3_rmsnorm(y, x, w, 2, 0.0f);
    CHECK(fabsf(y[0] - 3 / sqrtf(12.5f)) < 1e-6f && fabsf(y[1] - 4 / sqrtf(12.5f)) < 1e-6f,
          "rmsnorm [3,4] -> [%.6f, %.6f]", y[0], y[1]);
    float g[2] = {0, 1}, u[2] = {5, 1}, o[2];
    k3_situ(o, g, u, 2, 1.0f, 1.0f);
    float want = tanhf(1) * (1 / (1 + expf(-1))) * tanhf(1);
    CHECK(o[0] == 0.0f && fabsf(o[1] - want) < 1e-6f, "situ(0,5)=%g situ(1,1)=%g (want %g)", o[0],
          o[1], want);
    float g4[1] = {8}, u4[1] = {100}, o4[1];
    k3_situ(o4, g4, u4, 1, 4.0f, 25.0f);
    CHECK(o4[0] > 0 && o4[0] <= 100.0f, "situ bounded by b1*b2: %g", o4[0]);
    float sm[3] = {1, 1, 1};
    k3_softmax(sm, 3);
    CHECK(fabsf(sm[0] - 1 / 3.0f) < 1e-7f, "softmax uniform %g", sm[0]);
}

static void test_attnres(void) {
    float v0[2] = {1, 0}, v1[2] = {0, 2}, out[2];
    const float *ent[2] = {v0, v1};
    float w1[2] = {1, 1};
    k3_attnres_mix(ent, 2, w1, 2, 0.0f, out);
    CHECK(fabsf(out[0] - 0.5f) < 1e-6f && fabsf(out[1] - 1.0f) < 1e-6f,
          "mix equal scores -> mean of raw entries [%g, %g]", out[0], out[1]);
    float w2[2] = {2, 0};
    k3_attnres_mix(ent, 2, w2, 2, 0.0f, out);
    double s0 = 2 / sqrt(0.5), p0 = exp(s0) / (exp(s0) + 1);
    CHECK(fabs(out[0] - p0) < 1e-6 && fabs(out[1] - 2 * (1 - p0)) < 1e-6,
          "mix scores on rms-normed keys, raw values [%g, %g] (want [%g, %g])", out[0], out[1], p0,
          2 * (1 - p0));
    const float *one[1] = {v1};
    k3_attnres_mix(one, 1, w1, 2, 1e-5f, out);
    CHECK(out[0] == 0 && out[1] == 2, "mix of one entry is the entry");
}

static void test_kda_step(void) {
    float S[4] = {0}, o[2];
    float q1[2] = {1, 0}, k1[2] = {1, 0}, v1[2] = {3, 4}, a1[2] = {1, 1};
    k3_kda_head_step(S, 2, q1, k1, v1, a1, 1.0f, o);
    CHECK(o[0] == 3 && o[1] == 4 && S[0] == 3 && S[1] == 4 && S[2] == 0,
          "kda step 1: write v at key 0, read [%g, %g]", o[0], o[1]);
    float q2[2] = {1, 1}, k2[2] = {0, 1}, v2[2] = {1, 1}, a2[2] = {0.5f, 1};
    k3_kda_head_step(S, 2, q2, k2, v2, a2, 0.5f, o);
    CHECK(o[0] == 2.0f && o[1] == 2.5f && S[0] == 1.5f && S[3] == 0.5f,
          "kda step 2: decay first, beta-scaled delta, read updated state [%g, %g]", o[0], o[1]);
    float v3[2] = {1.5f, 2}, a3[2] = {1, 1};
    float before[4];
    memcpy(before, S, sizeof S);
    k3_kda_head_step(S, 2, k1, k1, v3, a3, 1.0f, o);
    CHECK(memcmp(before, S, sizeof S) == 0 && o[0] == 1.5f && o[1] == 2.0f,
          "kda delta rule: writing the value already stored leaves S unchanged");
}

/* A one-head KDA layer with identity projections: checks the conv taps are
 * oldest first and that the window persists across calls. */
static void test_kda_conv(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    c.hidden = 2, c.kda_heads = 1, c.kda_hd = 2, c.kda_proj = 2, c.conv_k = 2;
    c.eps = 1e-5f, c.gate_lb = -5.0f;
    float I2[4] = {1, 0, 0, 1}, zero4[4] = {0}, one2[2] = {1, 1}, zero2[2] = {0};
    k3_kda_w w;
    memset(&w, 0, sizeof w);
    k3_qmat_quantize(&w.q, I2, 2, 2, 32);
    k3_qmat_quantize(&w.k, I2, 2, 2, 32);
    k3_qmat_quantize(&w.v, I2, 2, 2, 32);
    k3_qmat_quantize(&w.g, zero4, 2, 2, 32);
    k3_qmat_quantize(&w.o, I2, 2, 2, 32);
    k3_qmat_quantize(&w.f_a, zero4, 2, 2, 32);
    k3_qmat_quantize(&w.f_b, zero4, 2, 2, 32);
    k3_qmat_quantize(&w.b, zero2, 1, 2, 32);
    float taps_prev[4] = {1, 0, 1, 0}; /* [channel][tap]: tap 0 = previous token */
    w.conv_q = w.conv_k = w.conv_v = taps_prev;
    w.dt_bias = zero2;
    float A[1] = {1};
    w.A = A;
    w.o_norm = one2;
    float S[4] = {0}, conv[12] = {0};
    k3_kda_state st = {S, conv};
    k3_layer_ctx lc = {&c, NULL, NULL, 0, 0, NULL, NULL};
    size_t cap = k3_kda_scratch_bytes(&c, 2);
    k3_arena ar = {malloc(cap), cap, 0};
    float x[4] = {1, 2, 3, 5}, out[4];
    k3_kda_forward(&lc, &w, &st, x, 2, out, &ar);
    /* token 0 sees only zeros (tap 0 = x_{-1} = 0): q = k = v = silu(0) = 0 */
    CHECK(out[0] == 0 && out[1] == 0, "kda conv: first token reads the zero history [%g, %g]",
          out[0], out[1]);
    CHECK(conv[0] == 1 && conv[1] == 3 && conv[2] == 2 && conv[3] == 5,
          "kda conv window holds the last K inputs oldest first [%g %g | %g %g]", conv[0], conv[1],
          conv[2], conv[3]);
    /* token 1: v = silu(x_0) = silu([1,2]); o = RMSNorm(S^T q) * sigmoid(0),
     * which is a positive multiple of silu([1,2]) normalised */
    double v0 = 1 / (1 + exp(-1.0)), v1 = 2 / (1 + exp(-2.0));
    double r = sqrt((v0 * v0 + v1 * v1) / 2);
    CHECK(fabs(out[2] - 0.5 * v0 / r) < 1e-4 && fabs(out[3] - 0.5 * v1 / r) < 1e-4,
          "kda conv: second token reads the first token's input [%g, %g] (want [%g, %g])", out[2],
          out[3], 0.5 * v0 / r, 0.5 * v1 / r);
    ar.used = 0;
    float x2[2] = {0, 0}, out2[2];
    k3_kda_forward(&lc, &w, &st, x2, 1, out2, &ar);
    CHECK(out2[0] > 0 && out2[1] > out2[0], "kda conv window persists across calls [%g, %g]",
          out2[0], out2[1]);
    free(ar.base);
    k3_qmat *ms[8] = {&w.q, &w.k, &w.v, &w.g, &w.o, &w.f_a, &w.f_b, &w.b};
    for (int i = 0; i < 8; i++) k3_qmat_free(ms[i]);
}

/* A one-head MLA layer against the expanded form computed here in double. */
static void test_mla(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    int D = 4;
    c.hidden = D, c.n_heads = 1, c.q_lora = 4, c.kv_lora = 4, c.qk_nope = 2, c.qk_rope = 2;
    c.v_head = 2, c.qk_head = 4, c.eps = 1e-5f;
    float wqa[16], wqb[16], wkva[24], wkvb[16], wg[8], wo[8], ones4[4] = {1, 1, 1, 1};
    uint32_t sd = 7;
    float *all[6] = {wqa, wqb, wkva, wkvb, wg, wo};
    int sz[6] = {16, 16, 24, 16, 8, 8};
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < sz[k]; i++) {
            sd = sd * 1664525u + 1013904223u;
            all[k][i] = (float)((int)(sd >> 24) - 128) / 128.0f;
        }
    k3_mla_w w;
    memset(&w, 0, sizeof w);
    k3_qmat_quantize(&w.q_a, wqa, 4, 4, 32);
    k3_qmat_quantize(&w.q_b, wqb, 4, 4, 32);
    k3_qmat_quantize(&w.kv_a, wkva, 6, 4, 32);
    k3_qmat_quantize(&w.kv_b, wkvb, 4, 4, 32);
    k3_qmat_quantize(&w.g, wg, 2, 4, 32);
    k3_qmat_quantize(&w.o, wo, 4, 2, 32);
    w.q_a_norm = w.kv_a_norm = ones4;
    k3_mla_cache cache = {0};
    k3_mla_cache_reserve(&cache, &c, 3, 8, err, sizeof err);
    k3_layer_ctx lc = {&c, NULL, NULL, 0, 0, NULL, NULL};
    size_t cap = k3_mla_scratch_bytes(&c, 3, 3);
    k3_arena ar = {malloc(cap), cap, 0};
    float x[12] = {0.5f, -1, 2, 0.25f, 1, 1, -1, 0, -0.5f, 0.75f, 0.1f, 2}, out[12];
    k3_mla_forward(&lc, &w, &cache, 0, x, 3, out, &ar);
    /* expanded reference: k_t = K lat_t, v_t = V lat_t, score over [k|rope] */
    double lat[3][4], rope[3][2], worst = 0;
    for (int t = 0; t < 3; t++) {
        double ckv[6];
        for (int r = 0; r < 6; r++) {
            ckv[r] = 0;
            for (int i = 0; i < 4; i++) ckv[r] += wkva[r * 4 + i] * x[t * 4 + i];
        }
        double ss = 0;
        for (int i = 0; i < 4; i++) ss += ckv[i] * ckv[i];
        for (int i = 0; i < 4; i++) lat[t][i] = ckv[i] / sqrt(ss / 4 + 1e-5);
        rope[t][0] = ckv[4], rope[t][1] = ckv[5];
    }
    for (int t = 0; t < 3; t++) {
        double qa[4], q[4], ss = 0;
        for (int r = 0; r < 4; r++) {
            qa[r] = 0;
            for (int i = 0; i < 4; i++) qa[r] += wqa[r * 4 + i] * x[t * 4 + i];
            ss += qa[r] * qa[r];
        }
        for (int r = 0; r < 4; r++) qa[r] /= sqrt(ss / 4 + 1e-5);
        for (int r = 0; r < 4; r++) {
            q[r] = 0;
            for (int i = 0; i < 4; i++) q[r] += wqb[r * 4 + i] * qa[i];
        }
        double sc[3], mx = -1e30, sum = 0, ctx[2] = {0, 0};
        for (int s = 0; s <= t; s++) {
            double kn[2] = {0, 0};
            for (int n = 0; n < 2; n++)
                for (int i = 0; i < 4; i++) kn[n] += wkvb[n * 4 + i] * lat[s][i];
            sc[s] = (q[0] * kn[0] + q[1] * kn[1] + q[2] * rope[s][0] + q[3] * rope[s][1]) / 2.0;
            if (sc[s] > mx) mx = sc[s];
        }
        for (int s = 0; s <= t; s++) sum += exp(sc[s] - mx);
        for (int s = 0; s <= t; s++) {
            double p = exp(sc[s] - mx) / sum;
            for (int j = 0; j < 2; j++) {
                double vj = 0;
                for (int i = 0; i < 4; i++) vj += wkvb[(2 + j) * 4 + i] * lat[s][i];
                ctx[j] += p * vj;
            }
        }
        for (int j = 0; j < 2; j++) {
            double g = 0;
            for (int i = 0; i < 4; i++) g += wg[j * 4 + i] * x[t * 4 + i];
            ctx[j] *= 1 / (1 + exp(-g));
        }
        for (int r = 0; r < 4; r++) {
            double y = wo[r * 2] * ctx[0] + wo[r * 2 + 1] * ctx[1];
            double d = fabs(y - out[t * 4 + r]);
            if (d > worst) worst = d;
        }
    }
    CHECK(worst < 1e-5,
          "mla absorbed form (rope dims cached, scale 1/sqrt(qk_head)) vs expanded: "
          "max |diff| %.2e",
          worst);
    free(ar.base);
    k3_mla_cache_free(&cache);
    k3_qmat *ms[6] = {&w.q_a, &w.q_b, &w.kv_a, &w.kv_b, &w.g, &w.o};
    for (int i = 0; i < 6; i++) k3_qmat_free(ms[i]);
}

static void test_route(void) {
    float lg[4] = {0, 0, 0, 0}, bias[4] = {0, 1, 1, 0}, wt[4];
    int32_t ids[4];
    int n = 0;
    k3_moe_route(lg, bias, 4, 2, 0.0, ids, wt, &n);
    CHECK(n == 2 && ids[0] == 1 && ids[1] == 2 && wt[0] == 0.5f && wt[1] == 0.5f,
          "route: ties go to the lower index, weights renormalised (%d %d %g %g)", ids[0], ids[1],
          wt[0], wt[1]);
    float lg2[4] = {2, 0, 0, -1}, bias2[4] = {0, 0.5f, 0, 0};
    k3_moe_route(lg2, bias2, 4, 2, 0.0, ids, wt, &n);
    double s0 = 1 / (1 + exp(-2.0));
    CHECK(ids[0] == 1 && ids[1] == 0 && fabs(wt[0] - 0.5 / (0.5 + s0)) < 1e-6 &&
              fabs(wt[1] - s0 / (0.5 + s0)) < 1e-6,
          "route: bias selects, raw sigmoid weights (%d %d %g %g)", ids[0], ids[1], wt[0], wt[1]);
    float lg3[4] = {3, -3, 0, -4}, bias3[4] = {0};
    /* scores 0.953, 0.5, 0.047: cumulative shares 0.635, 0.968, 1 */
    k3_moe_route(lg3, bias3, 4, 3, 0.7, ids, wt, &n);
    CHECK(n == 2 && ids[0] == 0 && ids[1] == 2 && fabsf(wt[0] + wt[1] - 1) < 1e-6f,
          "route: topp 0.7 keeps the heaviest two of three (n=%d)", n);
    k3_moe_route(lg3, bias3, 4, 3, 0.6, ids, wt, &n);
    CHECK(n == 1 && ids[0] == 0 && wt[0] == 1.0f, "route: topp 0.6 keeps one (n=%d)", n);
}

/* One expert with latent = inter = 32 whose bytes are written here. */
static void test_expert(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    c.latent = 32, c.moe_inter = 32, c.situ_b1 = 1, c.situ_b2 = 1;
    uint8_t w1p[32 * 16], w1s[32], w2p[32 * 16], w2s[32], w3p[32 * 16], w3s[32];
    memset(w1p, 0x22, sizeof w1p); /* every weight 1.0 */
    memset(w1s, 127, sizeof w1s);
    memset(w3p, 0x11, sizeof w3p); /* 0.5 x 2^(128-127) = 1.0 */
    memset(w3s, 128, sizeof w3s);
    memset(w2p, 0, sizeof w2p); /* row j: column 0 = 1.0 (low nibble), rest 0 */
    for (int j = 0; j < 32; j++) w2p[j * 16] = 0x02;
    memset(w2s, 127, sizeof w2s);
    k3_expert_view v = {3, {w1p, w1s, 32, 32}, {w2p, w2s, 32, 32}, {w3p, w3s, 32, 32}};
    float z[64], y[64];
    for (int i = 0; i < 64; i++) z[i] = i < 32 ? 0.1f : -0.05f;
    size_t cap = 1 << 16;
    k3_arena ar = {malloc(cap), cap, 0};
    k3_layer_ctx lc = {&c, NULL, NULL, 0, 0, NULL, NULL};
    k3_moe_expert_apply(&lc, &v, z, NULL, NULL, 2, y, &ar);
    float s1 = 0, s2 = 0;
    for (int i = 0; i < 32; i++) s1 += 0.1f, s2 += -0.05f;
    double a1 = tanh(s1) / (1 + exp(-s1)) * tanh(s1), a2 = tanh(s2) / (1 + exp(-s2)) * tanh(s2);
    int ok = 1;
    for (int j = 0; j < 32; j++) ok &= fabs(y[j] - a1) < 1e-6 && fabs(y[32 + j] - a2) < 1e-6;
    CHECK(ok, "mxfp4 expert by hand: y = W2 SiTU(W1 z, W3 z) rows %g %g (want %g %g)", y[0], y[32],
          a1, a2);
    /* integer-dot path: within the activation quantization noise */
    int8_t zq[64];
    float zs[2];
    k3_act_quant_q8(z, 2, 32, zq, zs);
    lc.idot = 1;
    ar.used = 0;
    k3_moe_expert_apply(&lc, &v, NULL, zq, zs, 2, y, &ar);
    CHECK(fabs(y[0] - a1) < 0.01 * fabs(a1) && fabs(y[32] - a2) < 0.01 * fabs(a2),
          "mxfp4 expert idot within 1%%: %g %g", y[0], y[32]);
    free(ar.base);
}

/* ---- the tiny checkpoint vs the numpy reference ---- */

static void test_vs_reference(const char *dir) {
    int lens[3] = {1, 7, 40};
    k3_model *m = open_model(dir, 0, 0, 1, 2, 1, 8.0);
    CHECK(m != NULL, "open tiny exact (bits 32/32/32, idot 0)");
    if (!m) return;
    const k3_config *c = k3_model_config(m);
    int L = c->n_layers, D = c->hidden, V = c->vocab;
    for (int k = 0; k < 3; k++) {
        int T = lens[k];
        int32_t ids[64];
        make_ids(ids, T, 1234u + (uint32_t)k, V);
        char cmd[4096], idstr[1024];
        size_t o = 0;
        for (int t = 0; t < T; t++)
            o += (size_t)snprintf(idstr + o, sizeof idstr - o, "%s%d", t ? "," : "", ids[t]);
        char tpath[256], lpath[256];
        snprintf(tpath, sizeof tpath, "/tmp/k3_test_stage_%d_trace.bin", (int)getpid());
        snprintf(lpath, sizeof lpath, "/tmp/k3_test_stage_%d_logits.bin", (int)getpid());
        snprintf(cmd, sizeof cmd,
                 "/usr/bin/python3 tests/ref/k3_ref.py --model %s --ids %s --ngen 0 --trace %s "
                 "--logits %s > /dev/null",
                 dir, idstr, tpath, lpath);
        int rc = system(cmd);
        CHECK(rc == 0, "k3_ref.py ran for a %d-token prompt (rc %d)", T, rc);
        float *ref_tr = malloc(sizeof(float) * (size_t)L * T * D);
        float *ref_lg = malloc(sizeof(float) * (size_t)T * V);
        float *tr = calloc((size_t)L * T * D, sizeof(float));
        float *lg = calloc((size_t)T * V, sizeof(float));
        int ok_files = rc == 0 && read_f32(tpath, ref_tr, (size_t)L * T * D) == 0 &&
                       read_f32(lpath, ref_lg, (size_t)T * V) == 0;
        CHECK(ok_files, "reference trace [%d][%d][%d] and logits [%d][%d] read", L, T, D, T, V);
        k3_status st = run_prompt(m, ids, T, 32, tr, lg);
        CHECK(st == K3_OK, "forward %d tokens: %s", T, st ? err : "ok");
        if (ok_files && st == K3_OK) {
            double worst = 0;
            int worst_l = 0;
            for (int l = 0; l < L; l++) {
                double r =
                    t_rel_l2(tr + (size_t)l * T * D, ref_tr + (size_t)l * T * D, (size_t)T * D);
                if (r > worst) worst = r, worst_l = l;
            }
            CHECK(worst <= 1e-5,
                  "T=%d: per-layer hidden rel L2 vs k3_ref <= 1e-5 (worst %.2e at layer %d)", T,
                  worst, worst_l);
            double rl = t_rel_l2(lg, ref_lg, (size_t)T * V);
            int agree = 0;
            for (int t = 0; t < T; t++) {
                int a = 0, b = 0;
                for (int v = 1; v < V; v++) {
                    if (lg[(size_t)t * V + v] > lg[(size_t)t * V + a]) a = v;
                    if (ref_lg[(size_t)t * V + v] > ref_lg[(size_t)t * V + b]) b = v;
                }
                agree += a == b;
            }
            CHECK(rl <= 1e-5 && agree == T, "T=%d: logits rel L2 %.2e, argmax agrees at %d/%d", T,
                  rl, agree, T);
        }
        unlink(tpath);
        unlink(lpath);
        free(ref_tr), free(ref_lg), free(tr), free(lg);
    }
    k3_model_close(&m);
}

/* ---- bit identity ---- */

static void test_bit_identity(const char *dir) {
    int32_t ids[40];
    k3_model *m1 = open_model(dir, 0, 0, 1, 1, 0, 8.0);
    k3_model *m2 = open_model(dir, 0, 0, 1, 2, 0, 8.0);
    CHECK(m1 && m2, "open tiny in the default formats (bits 4/8/8, idot) with 1 and 2 threads");
    if (!m1 || !m2) goto out;
    const k3_config *c = k3_model_config(m1);
    int L = c->n_layers, D = c->hidden, V = c->vocab, T = 40;
    make_ids(ids, T, 99u, V);
    size_t ntr = (size_t)L * T * D, nlg = (size_t)T * V;
    float *tr[4], *lg[4];
    for (int k = 0; k < 4; k++) tr[k] = calloc(ntr, 4), lg[k] = calloc(nlg, 4);
    int chunks[3] = {1, 3, 32};
    for (int k = 0; k < 3; k++) {
        k3_status st = run_prompt(m2, ids, T, chunks[k], tr[k], lg[k]);
        CHECK(st == K3_OK, "forward 40 tokens in chunks of %d: %s", chunks[k], st ? err : "ok");
    }
    CHECK(!memcmp(tr[0], tr[1], ntr * 4) && !memcmp(tr[0], tr[2], ntr * 4),
          "chunks 1, 3, 32: per-layer hidden states bit-identical");
    CHECK(!memcmp(lg[0], lg[1], nlg * 4) && !memcmp(lg[0], lg[2], nlg * 4),
          "chunks 1, 3, 32: logits bit-identical");
    k3_status st = run_prompt(m1, ids, T, 3, tr[3], lg[3]);
    CHECK(st == K3_OK && !memcmp(tr[3], tr[1], ntr * 4) && !memcmp(lg[3], lg[1], nlg * 4),
          "1 thread vs 2 threads: hidden states and logits bit-identical");
    for (int k = 0; k < 4; k++) free(tr[k]), free(lg[k]);
out:
    k3_model_close(&m1);
    k3_model_close(&m2);
}

/* A layer-range split: [0,3) then [3,8) (no global tensors) equals [0,8),
 * blocks and hidden, bit for bit; and a one-slot expert budget (every use a
 * read) gives the same bits as a budget holding every expert. */
static void test_split_and_budget(const char *dir) {
    k3_model *full = open_model(dir, 0, 0, 1, 2, 0, 8.0);
    k3_model *a = open_model(dir, 0, 3, 0, 2, 0, 8.0);
    k3_model *b = open_model(dir, 3, 8, 0, 2, 0, 8.0);
    g_direct = 0; /* buffered reads here, O_DIRECT (where the fs allows) elsewhere */
    k3_model *lean = open_model(dir, 0, 0, 1, 2, 0, 1e-9);
    g_direct = 1;
    CHECK(full && a && b && lean, "open [0,8), [0,3), [3,8) and a one-slot expert budget");
    if (!full || !a || !b || !lean) goto out;
    const k3_config *c = k3_model_config(full);
    int D = c->hidden, T = 9;
    int32_t ids[9];
    make_ids(ids, T, 4242u, c->vocab);
    size_t TD = (size_t)T * D, BS = K3_MAX_RES_ENTRIES * TD;
    float *h0 = malloc(TD * 4), *h1 = malloc(TD * 4), *h2 = malloc(TD * 4);
    float *b0 = calloc(BS, 4), *b1 = calloc(BS, 4), *b2 = calloc(BS, 4);
    k3_state *sf = NULL, *sa = NULL, *sb = NULL, *sl = NULL;
    k3_state_open(&sf, full, 64, err, sizeof err);
    k3_state_open(&sa, a, 64, err, sizeof err);
    k3_state_open(&sb, b, 64, err, sizeof err);
    k3_state_open(&sl, lean, 64, err, sizeof err);
    int ok = 1, ok_lean = 1;
    k3_step_stats s_full = {0}, s_lean = {0};
    /* two steps, so the recurrent state crosses a call too */
    for (int step = 0; step < 2; step++) {
        int pos0 = step * T, nb0 = 0, nb1 = 0, nb2 = 0;
        k3_model_embed(full, ids, T, h0, err, sizeof err);
        memcpy(h1, h0, TD * 4);
        memcpy(h2, h0, TD * 4);
        k3_status st =
            k3_stage_forward(full, sf, pos0, T, b0, &nb0, h0, &s_full, NULL, NULL, err, sizeof err);
        if (!st)
            st = k3_stage_forward(a, sa, pos0, T, b1, &nb1, h1, NULL, NULL, NULL, err, sizeof err);
        if (!st)
            st = k3_stage_forward(b, sb, pos0, T, b1, &nb1, h1, NULL, NULL, NULL, err, sizeof err);
        if (!st)
            st = k3_stage_forward(lean, sl, pos0, T, b2, &nb2, h2, &s_lean, NULL, NULL, err,
                                  sizeof err);
        CHECK(st == K3_OK, "step %d through the split: %s", step, st ? err : "ok");
        ok &= st == K3_OK && nb0 == nb1 && !memcmp(h0, h1, TD * 4) && !memcmp(b0, b1, nb0 * TD * 4);
        ok_lean &= st == K3_OK && !memcmp(h0, h2, TD * 4) && !memcmp(b0, b2, nb0 * TD * 4);
    }
    CHECK(ok, "split [0,3)+[3,8) == [0,8): AttnRes blocks and hidden bit-identical");
    CHECK(ok_lean,
          "one expert slot per layer, buffered reads == large budget, O_DIRECT, bit for bit");
    CHECK(s_lean.expert_misses > s_full.expert_misses && s_full.expert_hits > 0 &&
              s_lean.bytes_read > s_full.bytes_read,
          "expert stats: big budget %llu hits / %llu misses, one slot %llu hits / %llu misses",
          (unsigned long long)s_full.expert_hits, (unsigned long long)s_full.expert_misses,
          (unsigned long long)s_lean.expert_hits, (unsigned long long)s_lean.expert_misses);
    CHECK(k3_state_pos(sb) == 2 * T, "state position advanced to %d", k3_state_pos(sb));
    k3_state_close(&sf), k3_state_close(&sa), k3_state_close(&sb), k3_state_close(&sl);
    free(h0), free(h1), free(h2), free(b0), free(b1), free(b2);
out:
    k3_model_close(&full);
    k3_model_close(&a);
    k3_model_close(&b);
    k3_model_close(&lean);
}

/* ---- runtime errors ---- */

static void test_runtime_errors(const char *dir) {
    k3_model *m = open_model(dir, 0, 0, 1, 1, 0, 8.0);
    if (!m) return;
    const k3_config *c = k3_model_config(m);
    int D = c->hidden;
    float *h = malloc(sizeof(float) * 8 * D),
          *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * 8 * D);
    int32_t ids[2] = {5, c->vocab};
    k3_status st = k3_model_embed(m, ids, 2, h, err, sizeof err);
    CHECK(st == K3_ERR_ARG && strstr(err, "position 1") && strstr(err, "1536"),
          "token id >= vocab refused: %s", err);
    int32_t neg[1] = {-1};
    st = k3_model_embed(m, neg, 1, h, err, sizeof err);
    CHECK(st == K3_ERR_ARG, "negative token id refused: %s", err);

    k3_state *s = NULL;
    k3_state_open(&s, m, 6, err, sizeof err);
    int32_t five[5] = {1, 2, 3, 4, 5};
    int nb = 0;
    k3_model_embed(m, five, 5, h, err, sizeof err);
    st = k3_stage_forward(m, s, 0, 5, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_OK, "5 tokens into a 6-token context");
    nb = 0;
    st = k3_stage_forward(m, s, 5, 5, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "[5, 10)") && strstr(err, "6"),
          "positions beyond max_ctx refused: %s", err);
    st = k3_stage_forward(m, s, 3, 1, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_ERR_STATE && strstr(err, "position 3"), "out-of-order position refused: %s",
          err);
    nb = 2;
    st = k3_stage_forward(m, s, 5, 1, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_ERR_ARG, "wrong AttnRes block count refused: %s", err);
    k3_state *big = NULL;
    st = k3_state_open(&big, m, K3_MAX_CTX + 1, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT, "context above K3_MAX_CTX refused: %s", err);

    /* cancellation between layers; the state must then be reset */
    atomic_int cancel = 1;
    k3_state *s2 = NULL;
    k3_state_open(&s2, m, 8, err, sizeof err);
    k3_stage_set_cancel(s2, &cancel);
    nb = 0;
    k3_model_embed(m, five, 1, h, err, sizeof err);
    st = k3_stage_forward(m, s2, 0, 1, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_ERR_CANCEL, "cancel flag stops the step: %s", err);
    cancel = 0;
    nb = 0;
    st = k3_stage_forward(m, s2, 0, 1, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_ERR_STATE, "a cancelled state refuses work until reset: %s", err);
    k3_state_reset(s2);
    nb = 0;
    k3_model_embed(m, five, 1, h, err, sizeof err);
    st = k3_stage_forward(m, s2, 0, 1, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_OK && k3_state_pos(s2) == 1, "after reset the state runs again");
    k3_state_close(&s2);
    k3_state_close(&s);
    free(h), free(blocks);
    k3_model_close(&m);
}

/* ---- edited copies of the checkpoint (tests/st_edit.h) ---- */

static const char *P = "language_model.model.layers.";

static k3_status try_open(const char *dir, int a, int b, int global) {
    k3_model *m = open_model(dir, a, b, global, 1, 0, 8.0);
    k3_model_close(&m);
    return m ? K3_OK : (k3_status)-1;
}

static k3_status open_status(const char *dir) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.want_global = 1;
    o.threads = 1;
    k3_model *m = NULL;
    k3_status st = k3_model_open(&m, &o, err, sizeof err);
    k3_model_close(&m);
    return st;
}

/* Removes (shape == NULL) or reshapes tensor `name` in the copy at dir;
 * with `prefix_match` every tensor starting with name. Returns the count. */
static int edit_tensor(const char *dir, const char *probe, const char *name, int prefix_match,
                       const int64_t *shape, int rank) {
    char shard[1200];
    ste_file f;
    if (ste_shard_of(dir, probe, shard, sizeof shard) || ste_load(&f, shard)) return -1;
    int n = 0;
    for (int i = 0; i < f.n; i++) {
        const char *tn = f.t[i].name;
        if (prefix_match ? strncmp(tn, name, strlen(name)) : strcmp(tn, name)) continue;
        n++;
        if (!shape) {
            ste_index_set(dir, tn, NULL);
            ste_remove(&f, i--);
            continue;
        }
        size_t nb = ste_dtype_size(f.t[i].dtype);
        for (int d = 0; d < rank; d++) nb *= (size_t)shape[d];
        unsigned char *data = calloc(nb, 1);
        memcpy(data, f.t[i].data, nb < f.t[i].nbytes ? nb : f.t[i].nbytes);
        char dt[8];
        snprintf(dt, sizeof dt, "%s", f.t[i].dtype);
        ste_set(&f, tn, dt, rank, shape, data, nb);
        free(data);
    }
    int rc = ste_save(&f, shard);
    ste_free(&f);
    return rc ? -1 : n;
}

static void test_bad_checkpoints(const char *tiny) {
    char dir[256], name[256], probe[300];
    snprintf(dir, sizeof dir, "/tmp/k3_test_stage_%d", (int)getpid());

    /* missing tensor */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s5.self_attn.o_norm.weight", P);
    int ed = edit_tensor(dir, name, name, 0, NULL, 0);
    k3_status st = open_status(dir);
    CHECK(ed == 1 && st == K3_ERR_MISSING && strstr(err, name), "missing tensor refused: %s", err);

    /* wrong shape */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s2.self_attn.q_proj.weight", P);
    int64_t shp[2] = {64, 32};
    ed = edit_tensor(dir, name, name, 0, shp, 2);
    st = open_status(dir);
    CHECK(ed == 1 && st == K3_ERR_MISMATCH && strstr(err, name) && strstr(err, "[64, 32]") &&
              strstr(err, "[64, 64]"),
          "wrong shape refused naming both shapes: %s", err);

    /* an MLA matrix of the wrong shape */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s3.self_attn.kv_a_proj_with_mqa.weight", P);
    int64_t kshp[2] = {32, 64}; /* kv_lora without the 8 rope rows */
    ed = edit_tensor(dir, name, name, 0, kshp, 2);
    st = open_status(dir);
    CHECK(ed == 1 && st == K3_ERR_MISMATCH && strstr(err, name) && strstr(err, "[40, 64]"),
          "MLA kv_a without the rope rows refused: %s", err);

    /* an expert tensor of the wrong byte size */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s1.block_sparse_moe.experts.3.w2.weight_scale", P);
    int64_t eshp[2] = {32, 2};
    ed = edit_tensor(dir, name, name, 0, eshp, 2);
    st = open_status(dir);
    CHECK(ed == 1 && st == K3_ERR_MISMATCH && strstr(err, "expert 3") && strstr(err, "64 bytes") &&
              strstr(err, "expected 32"),
          "expert of the wrong byte size refused naming the expert: %s", err);

    /* an expert with one of its six tensors missing */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s4.block_sparse_moe.experts.9.w3.weight_packed", P);
    ed = edit_tensor(dir, name, name, 0, NULL, 0);
    st = open_status(dir);
    CHECK(ed == 1 && st == K3_ERR_MISSING && strstr(err, "expert 9") &&
              strstr(err, "w3.weight_packed"),
          "a partial expert refused naming the part: %s", err);

    /* an expert absent from the checkpoint: loads with a warning, fails
     * when the router selects it */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s2.block_sparse_moe.experts.5.", P);
    snprintf(probe, sizeof probe, "%sw1.weight_packed", name);
    ed = edit_tensor(dir, probe, name, 1, NULL, 0);
    k3_model *m = open_model(dir, 0, 0, 1, 1, 0, 8.0);
    CHECK(ed == 6 && m != NULL, "a missing expert only warns at load (%d tensors removed)", ed);
    if (m) {
        int32_t ids[40];
        make_ids(ids, 40, 7u, k3_model_config(m)->vocab);
        st = run_prompt(m, ids, 40, 40, NULL, NULL);
        CHECK(st == K3_ERR_MISSING && strstr(err, "layer 2 expert 5"),
              "selecting the missing expert fails naming it: %s", err);
        k3_model_close(&m);
    }

    /* MXFP4 scale byte 0 (decodes to +0): flagged on stderr, not refused */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s1.block_sparse_moe.experts.0.w1.weight_scale", P);
    char sh[1200];
    ste_file sf;
    int zeroed = 0;
    if (ste_shard_of(dir, name, sh, sizeof sh) == 0 && ste_load(&sf, sh) == 0) {
        for (int i = 0; i < sf.n; i++)
            if (strstr(sf.t[i].name, "w1.weight_scale")) sf.t[i].data[0] = 0, zeroed++;
        ste_save(&sf, sh);
        ste_free(&sf);
    }
    char logp[300];
    snprintf(logp, sizeof logp, "%s.log", dir);
    fflush(stderr);
    int saved = dup(2);
    FILE *lf = fopen(logp, "w");
    dup2(fileno(lf), 2);
    m = open_model(dir, 0, 2, 1, 1, 0, 8.0);
    int32_t sids[4] = {3, 4, 5, 6};
    st = m ? run_prompt(m, sids, 4, 4, NULL, NULL) : K3_ERR_ARG;
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    fclose(lf);
    char logtxt[4096] = {0};
    FILE *rf = fopen(logp, "r");
    if (rf) {
        size_t nr = fread(logtxt, 1, sizeof logtxt - 1, rf);
        logtxt[nr] = 0;
        fclose(rf);
    }
    unlink(logp);
    CHECK(zeroed == 16 && st == K3_OK && strstr(logtxt, "layer 1 expert") &&
              strstr(logtxt, "is 0 (decoded as +0"),
          "a 0 scale byte is flagged once, not refused: %s", logtxt);
    k3_model_close(&m);

    /* a shard truncated after its header */
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    snprintf(name, sizeof name, "%s3.input_layernorm.weight", P);
    char shard[1200];
    if (ste_shard_of(dir, name, shard, sizeof shard) == 0) {
        struct stat sb;
        stat(shard, &sb);
        CHECK(truncate(shard, sb.st_size - 100) == 0, "truncate %s", shard);
        st = open_status(dir);
        CHECK(st != K3_OK && strstr(err, "model-00004"), "truncated shard refused: %s", err);
    }
    ste_rm_dir(dir);
}

/* Overwrites the header length of the shard holding `name` with garbage:
 * any process that parses that shard fails. */
static int poison_shard_of(const char *dir, const char *name) {
    char shard[1200];
    if (ste_shard_of(dir, name, shard, sizeof shard)) return -1;
    FILE *f = fopen(shard, "r+b");
    if (!f) return -1;
    unsigned char junk[8];
    memset(junk, 0xff, sizeof junk);
    fwrite(junk, 1, 8, f);
    return fclose(f);
}

/* A worker's range touches only its own layers' shards (design note of the
 * cluster issue): with every other shard poisoned it still opens and runs,
 * while the same directory refuses a full open. */
static void test_shard_isolation(const char *tiny) {
    char dir[256], name[256];
    snprintf(dir, sizeof dir, "/tmp/k3_test_stage_iso_%d", (int)getpid());
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    int rc = 0;
    snprintf(name, sizeof name, "language_model.model.embed_tokens.weight");
    rc |= poison_shard_of(dir, name);
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "%s%d.input_layernorm.weight", P, i);
        rc |= poison_shard_of(dir, name);
    }
    CHECK(rc == 0, "poisoned the embedding shard and the shards of layers 0-2");
    k3_model *w = open_model(dir, 3, 8, 0, 1, 0, 8.0);
    CHECK(w != NULL, "worker [3,8) opens without touching foreign shards");
    if (w) {
        const k3_config *c = k3_model_config(w);
        int D = c->hidden, nb = k3_config_snapshots_before(c, 3);
        float *h = calloc((size_t)2 * D, 4),
              *blocks = calloc((size_t)K3_MAX_RES_ENTRIES * 2 * D, 4);
        for (int i = 0; i < 2 * D; i++) h[i] = 0.01f * (float)(i % 7);
        for (int i = 0; i < nb * 2 * D; i++) blocks[i] = 0.02f * (float)(i % 5) - 0.03f;
        k3_state *s = NULL;
        k3_state_open(&s, w, 4, err, sizeof err);
        k3_status st =
            k3_stage_forward(w, s, 0, 2, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
        CHECK(st == K3_OK && nb == k3_config_snapshots_before(c, 8),
              "worker [3,8) runs a step (%d blocks after): %s", nb, st ? err : "ok");
        k3_state_close(&s);
        free(h), free(blocks);
        k3_model_close(&w);
    }
    CHECK(try_open(dir, 0, 0, 1) != K3_OK, "the same directory refuses a full open: %s", err);
    ste_rm_dir(dir);

    /* a global-only model (cluster coordinator) never opens a layer shard,
     * and its head gives the full model's bits */
    ste_copy_dir(tiny, dir);
    rc = 0;
    for (int i = 0; i < 8; i++) {
        snprintf(name, sizeof name, "%s%d.input_layernorm.weight", P, i);
        rc |= poison_shard_of(dir, name);
    }
    k3_model *g = open_model(dir, 8, 0, 1, 1, 0, 8.0);
    k3_model *full = open_model(tiny, 0, 0, 1, 1, 0, 8.0);
    CHECK(rc == 0 && g != NULL && full != NULL,
          "global-only model [8,8) opens with every layer shard poisoned");
    if (g && full) {
        const k3_config *c = k3_model_config(g);
        int D = c->hidden, V = c->vocab, T = 3, nb = 3;
        int32_t ids[3] = {11, 500, 7};
        float *h = malloc(sizeof(float) * T * D), *hf = malloc(sizeof(float) * T * D);
        float *blocks = calloc((size_t)nb * T * D, 4), *l1 = malloc(sizeof(float) * T * V),
              *l2 = malloc(sizeof(float) * T * V);
        k3_status s1 = k3_model_embed(g, ids, T, h, err, sizeof err);
        k3_status s2 = k3_model_embed(full, ids, T, hf, err, sizeof err);
        for (int i = 0; i < nb * T * D; i++) blocks[i] = 0.05f * (float)((i * 37) % 11) - 0.2f;
        if (!s1) s1 = k3_model_head(g, blocks, nb, h, T, 0, l1, err, sizeof err);
        if (!s2) s2 = k3_model_head(full, blocks, nb, hf, T, 0, l2, err, sizeof err);
        CHECK(!s1 && !s2 && !memcmp(h, hf, sizeof(float) * T * D) &&
                  !memcmp(l1, l2, sizeof(float) * T * V),
              "global-only embed + head == full model's, bit for bit");
        free(h), free(hf), free(blocks), free(l1), free(l2);
    }
    k3_model_close(&g);
    k3_model_close(&full);
    CHECK(try_open(tiny, 8, 0, 0) != K3_OK && strstr(err, "empty"),
          "an empty range without global tensors is refused: %s", err);
    ste_rm_dir(dir);
}

/* ---- repacked container (docs/MODEL.md 2.3) ---- */

/* Bits of a matrix in the repack classes, 0 for tensors passed through. */
static int repack_bits(const char *name, const k3_config *c, int bits) {
    int hb = bits > 8 ? bits : 8;
    if (!strcmp(name, "language_model.lm_head.weight")) return hb;
    if (strncmp(name, P, strlen(P))) return 0;
    int layer = atoi(name + strlen(P));
    const char *rest = strchr(name + strlen(P), '.') + 1;
    static const char *const kda[] = {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"};
    static const char *const mla[] = {"q_a_proj",  "q_b_proj", "kv_a_proj_with_mqa",
                                      "kv_b_proj", "o_proj",   "g_proj"};
    static const char *const bits_cls[] = {"block_sparse_moe.routed_expert_down_proj",
                                           "block_sparse_moe.routed_expert_up_proj",
                                           "block_sparse_moe.shared_experts.gate_proj",
                                           "block_sparse_moe.shared_experts.up_proj",
                                           "block_sparse_moe.shared_experts.down_proj",
                                           "mlp.gate_proj",
                                           "mlp.up_proj",
                                           "mlp.down_proj"};
    char want[128];
    for (int k = 0; k < 5 && c->is_kda[layer]; k++) {
        snprintf(want, sizeof want, "self_attn.%s.weight", kda[k]);
        if (!strcmp(rest, want)) return bits;
    }
    for (int k = 0; k < 6 && !c->is_kda[layer]; k++) {
        snprintf(want, sizeof want, "self_attn.%s.weight", mla[k]);
        if (!strcmp(rest, want)) return hb;
    }
    for (int k = 0; k < 8; k++) {
        snprintf(want, sizeof want, "%s.weight", bits_cls[k]);
        if (!strcmp(rest, want)) return bits;
    }
    return 0;
}

/* Rewrites every shard of the copy at dir as a repacked container: each
 * class matrix becomes U8 + an F32 <name>.qs sidecar, quantized with the
 * engine's own load-time algorithm. Returns the matrices converted. */
static int make_container(const char *dir, const k3_config *c, int bits) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    int converted = 0;
    while ((e = readdir(d))) {
        if (!strstr(e->d_name, ".safetensors") || strstr(e->d_name, ".json")) continue;
        char path[1200];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        ste_file f;
        if (ste_load(&f, path)) continue;
        int n0 = f.n;
        for (int i = 0; i < n0; i++) {
            int b = repack_bits(f.t[i].name, c, bits);
            if (!b || f.t[i].rank != 2 || strcmp(f.t[i].dtype, "BF16")) continue;
            int O = (int)f.t[i].shape[0], I = (int)f.t[i].shape[1];
            float *w = malloc(sizeof(float) * (size_t)O * I);
            for (size_t k = 0; k < (size_t)O * I; k++) {
                uint16_t v;
                memcpy(&v, f.t[i].data + 2 * k, 2);
                w[k] = st_bf16_to_f32(v);
            }
            k3_qmat q;
            k3_qmat_quantize(&q, w, O, I, b);
            char qs[320], nm[300];
            snprintf(nm, sizeof nm, "%s", f.t[i].name);
            snprintf(qs, sizeof qs, "%s.qs", nm);
            if (q.fmt == K3_QF_I8) {
                int64_t s1[2] = {O, I}, s2[1] = {O};
                ste_set(&f, nm, "U8", 2, s1, q.q8, (size_t)O * I);
                ste_set(&f, qs, "F32", 1, s2, q.scales, sizeof(float) * (size_t)O);
            } else {
                int64_t s1[2] = {O, I / 2}, s2[2] = {O, I / 64};
                ste_set(&f, nm, "U8", 2, s1, q.q4, (size_t)O * I / 2);
                ste_set(&f, qs, "F32", 2, s2, q.scales, sizeof(float) * (size_t)O * (I / 64));
            }
            ste_index_set(dir, qs, e->d_name);
            k3_qmat_free(&q);
            free(w);
            converted++;
        }
        ste_save(&f, path);
        ste_free(&f);
    }
    closedir(d);
    return converted;
}

static k3_model *open_bits(const char *dir, int bits, int mla, int head, int explicit_bits) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.want_global = 1;
    o.threads = 2;
    o.bits = bits, o.mla_bits = mla, o.head_bits = head, o.bits_explicit = explicit_bits;
    k3_model *m = NULL;
    if (k3_model_open(&m, &o, err, sizeof err)) printf("# open %s: %s\n", dir, err);
    return m;
}

static void test_container(const char *tiny) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/k3_test_stage_ct_%d", (int)getpid());
    k3_config c;
    if (k3_config_load(&c, tiny, 0, err, sizeof err)) return;
    int T = 12, V = c.vocab;
    int32_t ids[12];
    make_ids(ids, T, 31u, V);
    float *ref = calloc((size_t)T * V, 4), *got = calloc((size_t)T * V, 4);
    static const int bitsv[2] = {8, 4};
    for (int k = 0; k < 2; k++) {
        int b = bitsv[k];
        ste_rm_dir(dir);
        ste_copy_dir(tiny, dir);
        int n = make_container(dir, &c, b);
        k3_model *orig = open_bits(tiny, b, 8, 8, 0);
        k3_model *cont = open_bits(dir, 4, 8, 8, 0); /* K3_BITS not given: container bits kept */
        k3_status s1 = orig ? run_prompt(orig, ids, T, 5, NULL, ref) : K3_ERR_ARG;
        k3_status s2 = cont ? run_prompt(cont, ids, T, 5, NULL, got) : K3_ERR_ARG;
        CHECK(n > 0 && s1 == K3_OK && s2 == K3_OK && !memcmp(ref, got, (size_t)T * V * 4),
              "int%d container (%d matrices) == load-time quantization, bit for bit", b, n);
        CHECK(!cont || k3_model_fingerprint(cont) != k3_model_fingerprint(orig),
              "container and source fingerprints differ");
        k3_model_close(&cont);
        if (b == 8) {
            /* explicit K3_BITS=4 downcasts the K3_BITS class of an int8 container */
            k3_model *dc = open_bits(dir, 4, 8, 8, 1);
            k3_status s3 = dc ? run_prompt(dc, ids, T, 5, NULL, got) : K3_ERR_ARG;
            int agree = 0;
            for (int t = 0; t < T; t++) {
                int a = 0, bb = 0;
                for (int v = 1; v < V; v++) {
                    if (got[(size_t)t * V + v] > got[(size_t)t * V + a]) a = v;
                    if (ref[(size_t)t * V + v] > ref[(size_t)t * V + bb]) bb = v;
                }
                agree += a == bb;
            }
            double rl = t_rel_l2(got, ref, (size_t)T * V);
            CHECK(s3 == K3_OK && rl > 0 && rl < 0.2 && agree >= T - 1,
                  "explicit K3_BITS=4 on an int8 container downcasts: logits rel L2 %.3g vs int8, "
                  "argmax agrees %d/%d",
                  rl, agree, T);
            k3_model_close(&dc);
        }
        k3_model_close(&orig);
    }
    free(ref), free(got);
    ste_rm_dir(dir);
}

/* ---- checkpoint layouts (docs/MODEL.md 2.1, issue 3): the generator stores the
 * same values in every variant, so every variant gives the same bits ---- */

static void test_layouts(const char *tiny) {
    static const char *const variants[] = {"--dtype f16", "--dtype f32",
                                           "--single-file --no-prefix --root-config"};
    int T = 10;
    int32_t ids[10];
    k3_model *base = open_model(tiny, 0, 0, 1, 2, 0, 8.0);
    if (!base) return;
    int V = k3_model_config(base)->vocab;
    make_ids(ids, T, 555u, V);
    float *ref = calloc((size_t)T * V, 4), *got = calloc((size_t)T * V, 4);
    k3_status st = run_prompt(base, ids, T, 4, NULL, ref);
    k3_model_close(&base);
    for (int k = 0; k < 3; k++) {
        char dir[256], cmd[1024];
        snprintf(dir, sizeof dir, "/tmp/k3_test_stage_lay_%d", (int)getpid());
        snprintf(cmd, sizeof cmd,
                 "/usr/bin/python3 tests/fixtures/k3_gen.py --profile tiny --out %s %s > /dev/null",
                 dir, variants[k]);
        int rc = system(cmd);
        k3_model *m = rc == 0 ? open_model(dir, 0, 0, 1, 2, 0, 8.0) : NULL;
        k3_status s2 = m ? run_prompt(m, ids, T, 4, NULL, got) : K3_ERR_ARG;
        CHECK(st == K3_OK && s2 == K3_OK && !memcmp(ref, got, (size_t)T * V * 4),
              "layout '%s' loads and gives the same logits bits (%s)", variants[k],
              s2 ? err : "ok");
        k3_model_close(&m);
        ste_rm_dir(dir);
    }
    free(ref), free(got);
}

/* ---- two sessions on one model from two threads ---- */

typedef struct sess_job {
    k3_model *m;
    int32_t ids[24];
    float *logits; /* [24][vocab] */
    k3_status st;
    char err[512];
} sess_job;

static void *sess_thread(void *p) {
    sess_job *j = p;
    const k3_config *c = k3_model_config(j->m);
    int D = c->hidden, T = 24, chunk = 5;
    k3_state *s = NULL;
    j->st = k3_state_open(&s, j->m, T, j->err, sizeof j->err);
    float *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * (size_t)chunk * D);
    float *h = malloc(sizeof(float) * (size_t)chunk * D);
    for (int p0 = 0; p0 < T && !j->st; p0 += chunk) {
        int n = T - p0 < chunk ? T - p0 : chunk, nb = 0;
        j->st = k3_model_embed(j->m, j->ids + p0, n, h, j->err, sizeof j->err);
        if (!j->st)
            j->st = k3_stage_forward(j->m, s, p0, n, blocks, &nb, h, NULL, NULL, NULL, j->err,
                                     sizeof j->err);
        if (!j->st)
            j->st = k3_model_head(j->m, blocks, nb, h, n, 0, j->logits + (size_t)p0 * c->vocab,
                                  j->err, sizeof j->err);
    }
    free(blocks), free(h);
    k3_state_close(&s);
    return NULL;
}

static void test_concurrent_sessions(const char *tiny) {
    k3_model *m = open_model(tiny, 0, 0, 1, 2, 0, 1e-9); /* one slot: sessions share it */
    if (!m) return;
    int V = k3_model_config(m)->vocab;
    sess_job j[2], ser[2];
    for (int k = 0; k < 2; k++) {
        memset(&j[k], 0, sizeof j[k]);
        j[k].m = m;
        make_ids(j[k].ids, 24, 900u + (uint32_t)k, V);
        j[k].logits = calloc((size_t)24 * V, 4);
        ser[k] = j[k];
        ser[k].logits = calloc((size_t)24 * V, 4);
        sess_thread(&ser[k]);
    }
    pthread_t th[2];
    for (int k = 0; k < 2; k++) pthread_create(&th[k], NULL, sess_thread, &j[k]);
    for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
    int ok = 1;
    for (int k = 0; k < 2; k++)
        ok &= j[k].st == K3_OK && ser[k].st == K3_OK &&
              !memcmp(j[k].logits, ser[k].logits, (size_t)24 * V * 4);
    CHECK(ok, "two sessions run concurrently on one model == each run alone, bit for bit (%s)",
          j[0].st   ? j[0].err
          : j[1].st ? j[1].err
                    : "ok");
    for (int k = 0; k < 2; k++) free(j[k].logits), free(ser[k].logits);
    k3_model_close(&m);
}

/* ---- expert read faults (st fault hook): EIO and a short read ---- */

static int fault_mode; /* >0: errno to inject, <0: bytes short */
static int fault_hook(int shard, uint64_t off, size_t len, void *ctx) {
    (void)shard, (void)off, (void)len, (void)ctx;
    return fault_mode;
}

static void test_read_faults(const char *tiny) {
    k3_model *m = open_model(tiny, 0, 0, 1, 1, 0, 8.0);
    if (!m) return;
    const k3_config *c = k3_model_config(m);
    int D = c->hidden;
    float *h = malloc(sizeof(float) * 2 * D),
          *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * 2 * D);
    static const int modes[2] = {EIO, -100};
    static const char *const want[2] = {"Input/output error", "short read"};
    for (int k = 0; k < 2; k++) {
        int32_t ids[2] = {40, 41};
        k3_model_embed(m, ids, 2, h, err, sizeof err); /* before the fault: embed reads work */
        k3_state *s = NULL;
        k3_state_open(&s, m, 4, err, sizeof err);
        int nb = 0;
        fault_mode = modes[k];
        st_set_fault_hook(fault_hook, NULL);
        k3_status st =
            k3_stage_forward(m, s, 0, 2, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
        st_set_fault_hook(NULL, NULL);
        CHECK(st == K3_ERR_IO && strstr(err, "layer 1 expert") &&
                  strstr(err, "model-00002-of-00010") && strstr(err, want[k]),
              "expert read fault (%s) names layer, expert and shard: %s", want[k], err);
        k3_state_close(&s);
    }
    /* after the faults the store still works: the failed slots were freed */
    int32_t ids[2] = {40, 41};
    k3_model_embed(m, ids, 2, h, err, sizeof err);
    k3_state *s = NULL;
    k3_state_open(&s, m, 4, err, sizeof err);
    int nb = 0;
    k3_status st = k3_stage_forward(m, s, 0, 2, blocks, &nb, h, NULL, NULL, NULL, err, sizeof err);
    CHECK(st == K3_OK, "the expert store recovers after failed reads: %s", st ? err : "ok");
    k3_state_close(&s);
    free(h), free(blocks);
    k3_model_close(&m);
}

/* ---- experts whose six tensors are not back to back (six reads each) ---- */

static void test_noncontiguous(const char *tiny) {
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/k3_test_stage_nc_%d", (int)getpid());
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    int moved = 0;
    for (int i = 1; i < 8; i++) {
        char name[256], shard[1200];
        snprintf(name, sizeof name, "%s%d.block_sparse_moe.experts.0.w2.weight_packed", P, i);
        ste_file f;
        if (ste_shard_of(dir, name, shard, sizeof shard) || ste_load(&f, shard)) continue;
        /* stable partition: every w2.weight_packed goes to the end */
        ste_tensor *tmp = malloc(sizeof *tmp * (size_t)f.n);
        int k = 0;
        for (int pass = 0; pass < 2; pass++)
            for (int j = 0; j < f.n; j++)
                if ((strstr(f.t[j].name, "w2.weight_packed") != NULL) == pass) tmp[k++] = f.t[j];
        memcpy(f.t, tmp, sizeof *tmp * (size_t)f.n);
        free(tmp);
        moved += ste_save(&f, shard) == 0;
        ste_free(&f);
    }
    int T = 10;
    int32_t ids[10];
    k3_model *a = open_model(tiny, 0, 0, 1, 2, 0, 8.0);
    k3_model *b = open_model(dir, 0, 0, 1, 2, 0, 1e-9);
    if (a && b) {
        int V = k3_model_config(a)->vocab;
        make_ids(ids, T, 77u, V);
        float *l1 = calloc((size_t)T * V, 4), *l2 = calloc((size_t)T * V, 4);
        k3_status s1 = run_prompt(a, ids, T, 4, NULL, l1);
        k3_status s2 = run_prompt(b, ids, T, 4, NULL, l2);
        CHECK(moved == 7 && !s1 && !s2 && !memcmp(l1, l2, (size_t)T * V * 4),
              "non-contiguous experts (six reads each) give the same bits (%d shards rewritten)",
              moved);
        free(l1), free(l2);
    }
    k3_model_close(&a);
    k3_model_close(&b);
    ste_rm_dir(dir);
}

int main(void) {
    const char *tiny = t_tiny_dir();
    test_ops();
    test_attnres();
    test_kda_step();
    test_kda_conv();
    test_mla();
    test_route();
    test_expert();
    char cfg_path[512];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", tiny);
    if (access(cfg_path, R_OK) != 0) {
        CHECK(0, "tiny checkpoint at %s (run make tiny)", tiny);
        TEST_MAIN_END();
    }
    test_vs_reference(tiny);
    test_bit_identity(tiny);
    test_split_and_budget(tiny);
    test_runtime_errors(tiny);
    test_bad_checkpoints(tiny);
    test_shard_isolation(tiny);
    test_container(tiny);
    test_layouts(tiny);
    test_concurrent_sessions(tiny);
    test_read_faults(tiny);
    test_noncontiguous(tiny);
    TEST_MAIN_END();
}
