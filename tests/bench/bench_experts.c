/* tests/bench/bench_experts.c: the expert store against the drive
 * (`make bench-experts`, run by bench-experts.sh after fio). Not a test.
 *
 *   bench_experts MODEL_DIR [--tokens 32] [--slots 4] [--threads 4]
 *
 * Opens the model with a budget of --slots experts per MoE layer (O_DIRECT,
 * K3_PIPE=1), then
 *   1. pure reads: for every MoE layer one batch of 16 experts that all
 *      miss, with no compute: the store's read time of 16 experts (again
 *      after the decode, when the drive is in the state the decode saw);
 *   2. a decode of --tokens tokens (one token per step): the store's read
 *      GB/s over the decode (bytes / wall time with reads in flight) and
 *      the wall time per MoE layer (from the per-layer trace hook: time
 *      from the previous layer's end, so attention is included);
 *   3. a profile of one MoE layer's compute at T = 1 (best of 5 per piece,
 *      each MoE layer): attention, router, latent down, shared experts,
 *      one routed expert, latent up. What cannot run under the reads of
 *      the layer's experts is attention + router + latent up + the last
 *      expert (its read is the last one); latent down and the shared
 *      experts run under the first reads (common/layers/moe.c).
 * Prints one "key value" line per figure for the script to combine.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/experts/experts.h"
#include "common/layers/layers.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "common/engine/stage.h"

static char err[1024];

typedef struct layer_clock {
    double last;    /* ms at the previous layer's end */
    double *moe_ms; /* [n_layers] summed per layer */
    const k3_config *c;
} layer_clock;

static void on_layer(void *ctx, int layer, int pos0, int T, const float *h) {
    (void)pos0, (void)T, (void)h;
    layer_clock *lc = ctx;
    double now = k3_now_ms();
    lc->moe_ms[layer] += now - lc->last;
    lc->last = now;
}

/* One batch of the topk highest ids per MoE layer, no compute; the ids
 * are evicted first (a batch of the lowest ids) so they are all misses.
 * Returns the mean ms per layer and the GB/s. */
static int pure_reads(k3_experts *s, const k3_config *cfg, double *ms_per_layer, double *gbps) {
    double read_ms = 0;
    uint64_t read_bytes = 0;
    int n_layers = 0;
    for (int l = 0; l < cfg->n_layers; l++) {
        if (!cfg->is_moe[l]) continue;
        for (int pass = 0; pass < 2; pass++) {
            uint8_t sel[K3_MAX_EXPERTS] = {0};
            int32_t ids[K3_MAX_EXPERTS];
            int lo = pass ? cfg->n_experts - cfg->topk : 0;
            int hi = pass ? cfg->n_experts : k3_experts_slots(s, l);
            for (int e = lo; e < hi; e++) sel[e] = 1;
            int n = k3_experts_disk_order(s, l, sel, ids);
            k3_expert_stats st = {0};
            k3_expert_batch *b = NULL;
            double t = k3_now_ms();
            k3_status rc = k3_experts_batch_open(&b, s, l, ids, n, &st, err, sizeof err);
            for (int i = 0; i < n && !rc; i++) {
                k3_expert_view v;
                rc = k3_experts_batch_get(b, i, &v, err, sizeof err);
                if (!rc) k3_experts_batch_put(b, i);
            }
            k3_experts_batch_close(&b);
            if (rc) {
                fprintf(stderr, "bench_experts: %s\n", err);
                return 1;
            }
            if (!pass) continue;
            read_ms += k3_now_ms() - t;
            read_bytes += st.bytes;
            n_layers++;
        }
    }
    *ms_per_layer = read_ms / n_layers;
    *gbps = read_bytes / 1e6 / read_ms;
    return 0;
}

/* Best of 5 wall times of `stmt`, ms, added to out. */
#define BEST5(out, stmt)                                                                           \
    do {                                                                                           \
        double best_ = 1e30;                                                                       \
        for (int r_ = 0; r_ < 5; r_++) {                                                           \
            double t_ = k3_now_ms();                                                               \
            stmt;                                                                                  \
            t_ = k3_now_ms() - t_;                                                                 \
            if (t_ < best_) best_ = t_;                                                            \
        }                                                                                          \
        (out) += best_;                                                                            \
    } while (0)

/* Per MoE layer, summed: [0] attention [1] router [2] latent down [3]
 * shared experts [4] one routed expert [5] latent up. Runs on a scratch
 * state (its KDA recurrence / MLA cache advance with the repeats; the
 * time does not depend on their values). */
static int profile(k3_model *m, const k3_config *c, double *ms, int *n_layers) {
    int D = c->hidden, LT = c->latent, S = c->shared_inter;
    k3_layer_ctx lc = {c, k3_model_pool(m), k3_model_experts(m), k3_model_idot(m), 0.0, NULL, NULL};
    size_t cap = k3_kda_scratch_bytes(c, 1) + k3_mla_scratch_bytes(c, 1, 64) +
                 k3_moe_scratch_bytes(c, 1) + (1u << 20);
    k3_arena ar = {malloc(cap), cap, 0};
    float *x = malloc(sizeof(float) * D), *out = malloc(sizeof(float) * D);
    float *lg = malloc(sizeof(float) * c->n_experts), *z = malloc(sizeof(float) * LT);
    float *sg = malloc(sizeof(float) * S), *su = malloc(sizeof(float) * S);
    float *y = malloc(sizeof(float) * LT);
    int8_t *zq = malloc((size_t)LT);
    float *zs = malloc(sizeof(float) * (LT / 32));
    for (int d = 0; d < D; d++) x[d] = (float)((d * 7919) % 17 - 8) / 8.0f;
    size_t S_n = (size_t)c->kda_heads * c->kda_hd * c->kda_hd;
    k3_kda_state ks = {calloc(S_n, sizeof(float)),
                       calloc(3 * (size_t)c->kda_proj * c->conv_k, sizeof(float))};
    k3_mla_cache mc = {0};
    if (k3_mla_cache_reserve(&mc, c, 64, 64, err, sizeof err)) return 1;
    *n_layers = 0;
    for (int l = 0; l < c->n_layers; l++) {
        if (!c->is_moe[l]) continue;
        const k3_layer_w *w = k3_model_layer(m, l);
        (*n_layers)++;
        int pos = 0;
        if (w->is_kda)
            BEST5(ms[0], (ar.used = 0, k3_kda_forward(&lc, &w->kda, &ks, x, 1, out, &ar)));
        else
            BEST5(ms[0],
                  (ar.used = 0, k3_mla_forward(&lc, &w->mla, &mc, pos, x, 1, out, &ar), pos++));
        BEST5(ms[1], k3_qmat_matmul(&w->moe.router, x, 1, lg, lc.pool));
        BEST5(ms[2], k3_qmat_matmul(&w->moe.lat_down, x, 1, z, lc.pool));
        if (lc.idot) k3_act_quant_q8(z, 1, LT, zq, zs);
        BEST5(ms[3], (k3_qmat_matmul(&w->moe.sh_gate, x, 1, sg, lc.pool),
                      k3_qmat_matmul(&w->moe.sh_up, x, 1, su, lc.pool),
                      k3_situ(sg, sg, su, S, c->situ_b1, c->situ_b2),
                      k3_qmat_matmul(&w->moe.sh_down, sg, 1, out, lc.pool)));
        int32_t id = 0;
        k3_expert_batch *b = NULL;
        k3_expert_view v;
        k3_status rc = k3_experts_batch_open(&b, lc.experts, l, &id, 1, NULL, err, sizeof err);
        if (!rc) rc = k3_experts_batch_get(b, 0, &v, err, sizeof err);
        if (!rc) {
            BEST5(ms[4], (ar.used = 0, k3_moe_expert_apply(&lc, &v, z, zq, zs, 1, y, &ar)));
            k3_experts_batch_put(b, 0);
        }
        k3_experts_batch_close(&b);
        if (rc) return 1;
        BEST5(ms[5], k3_qmat_matmul(&w->moe.lat_up, y, 1, out, lc.pool));
    }
    free(ar.base), free(x), free(out), free(lg), free(z), free(sg), free(su), free(y), free(zq);
    free(zs), free(ks.S), free(ks.conv);
    k3_mla_cache_free(&mc);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_experts MODEL_DIR [--tokens N] [--slots N] [--threads N]\n");
        return 2;
    }
    int tokens = 32, slots = 4, threads = 4;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--tokens")) tokens = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--slots")) slots = atoi(argv[i + 1]);
        if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    }
    k3_config cfg;
    if (k3_config_load(&cfg, argv[1], 0, err, sizeof err)) {
        fprintf(stderr, "bench_experts: %s\n", err);
        return 1;
    }
    int n_moe = 0;
    for (int l = 0; l < cfg.n_layers; l++) n_moe += cfg.is_moe[l];
    k3_expert_geom g;
    k3_expert_geom_init(&g, &cfg);
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = argv[1];
    o.want_global = 1;
    o.load_threads = threads;
    o.expert_gb = ((double)slots + 0.5) * n_moe * (double)(g.total + 8192) / (double)(1u << 30);
    k3_model *m = NULL;
    double t0 = k3_now_ms();
    if (k3_model_open(&m, &o, err, sizeof err)) {
        fprintf(stderr, "bench_experts: %s\n", err);
        return 1;
    }
    printf("open_s %.1f\n", (k3_now_ms() - t0) / 1e3);
    k3_experts *s = k3_model_experts(m);
    printf("slots_per_layer %d\nexpert_mb %.2f\nmoe_layers %d\ntopk %d\n",
           k3_experts_slots(s, cfg.n_layers - 1), g.total / 1e6, n_moe, cfg.topk);

    /* 1. pure reads before the decode (drive cold) */
    double pure_cold = 0, gbps_cold = 0;
    if (pure_reads(s, &cfg, &pure_cold, &gbps_cold)) return 1;
    printf("pure_read_cold_ms_per_layer %.2f\npure_read_cold_gbps %.3f\n", pure_cold, gbps_cold);

    /* 2. decode */
    k3_expert_stats before;
    k3_experts_totals(s, &before);
    k3_state *st = NULL;
    if (k3_state_open(&st, m, tokens + 1, err, sizeof err)) {
        fprintf(stderr, "bench_experts: %s\n", err);
        return 1;
    }
    int D = cfg.hidden;
    float *h = malloc(sizeof(float) * D), *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * D);
    float *logits = malloc(sizeof(float) * cfg.vocab);
    double *per = calloc((size_t)cfg.n_layers, sizeof *per);
    layer_clock lc = {0, per, &cfg};
    int32_t id = 1000 % cfg.vocab;
    double compute = 0, wait = 0, t_dec = k3_now_ms();
    for (int t = 0; t < tokens; t++) {
        int nb = 0;
        k3_step_stats ss = {0};
        k3_status rc = k3_model_embed(m, &id, 1, h, err, sizeof err);
        lc.last = k3_now_ms();
        if (!rc)
            rc = k3_stage_forward(m, st, t, 1, blocks, &nb, h, &ss, on_layer, &lc, err, sizeof err);
        if (!rc) rc = k3_model_head(m, blocks, nb, h, 1, 0, logits, err, sizeof err);
        if (rc) {
            fprintf(stderr, "bench_experts: token %d: %s\n", t, err);
            return 1;
        }
        int best = 0;
        for (int v = 1; v < cfg.vocab; v++)
            if (logits[v] > logits[best]) best = v;
        id = best;
        compute += ss.compute_ms;
        wait += ss.read_ms;
    }
    double dec_ms = k3_now_ms() - t_dec;
    k3_expert_stats after;
    k3_experts_totals(s, &after);
    double moe_ms = 0;
    for (int l = 0; l < cfg.n_layers; l++)
        if (cfg.is_moe[l]) moe_ms += per[l];
    uint64_t bytes = after.bytes - before.bytes;
    double io = after.io_ms - before.io_ms;
    printf("decode_tokens %d\ndecode_ms_per_token %.1f\n", tokens, dec_ms / tokens);
    printf("decode_hits %llu\ndecode_misses %llu\ndecode_gb_read %.3f\n",
           (unsigned long long)(after.hits - before.hits),
           (unsigned long long)(after.misses - before.misses), bytes / 1e9);
    printf("store_read_gbps %.3f\n", io > 0 ? bytes / 1e6 / io : 0.0);
    printf("decode_wait_ms_per_token %.1f\ndecode_compute_ms_per_token %.1f\n", wait / tokens,
           compute / tokens);
    printf("moe_layer_ms %.2f\n", moe_ms / tokens / n_moe);
    /* the drive's busy time per MoE layer in the same decode: (c)'s read
     * time measured at the same moment (the drive's rate drifts) */
    printf("decode_io_ms_per_layer %.2f\n", io / tokens / n_moe);
    printf("misses_per_moe_layer %.2f\n", (double)(after.misses - before.misses) / tokens / n_moe);
    /* 3. compute profile of a MoE layer */
    double prof[6] = {0};
    int n_prof = 0;
    if (profile(m, &cfg, prof, &n_prof)) {
        fprintf(stderr, "bench_experts: profile: %s\n", err);
        return 1;
    }
    static const char *const pn[6] = {"attention", "router", "latent_down",
                                      "shared",    "expert", "latent_up"};
    for (int k = 0; k < 6; k++) printf("prof_%s_ms %.2f\n", pn[k], prof[k] / n_prof);
    printf("prof_serial_ms %.2f\n", (prof[0] + prof[1] + prof[4] + prof[5]) / n_prof);
    /* 4. the same pure reads after the decode (same drive state as (b)) */
    double pure_warm = 0, gbps_warm = 0;
    if (pure_reads(s, &cfg, &pure_warm, &gbps_warm)) return 1;
    printf("pure_read_ms_per_layer %.2f\npure_read_gbps %.3f\n", pure_warm, gbps_warm);
    free(h), free(blocks), free(logits), free(per);
    k3_state_close(&st);
    k3_model_close(&m);
    return 0;
}
