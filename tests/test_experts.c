/* tests/test_experts.c: the expert store (common/experts/experts.h): streaming
 * reads, the pipelined window, multi-directory shards, faults, the usage
 * history, the budget and its memory honesty.
 *
 *   read path   every expert of every layer read through batches equals the
 *               bytes of its six tensors (st_read_raw), for O_DIRECT and
 *               buffered reads, pipelined or not, 1 and 4 loader threads and
 *               1 slot per layer up to all experts (head/tail unaligned)
 *   bit identity logits of a prompt (chunks of 4 and 1) with streaming ==
 *               a fully resident budget, for budgets 1..16 slots/layer, every
 *               K3_PIPE / K3_DIRECT, load threads 1 and 4, --dirs splits
 *   faults      EIO and short reads from the fault hook, a shard truncated
 *               after start: errors name layer, expert and shard, no hang,
 *               and the store keeps working for untouched experts
 *   history     save / load round trip, dims mismatch refused, warm start
 *   staged      any-order batches over a 2-drive placement (drive files
 *               linked to the shards): every expert handed out once with
 *               its bytes, read from its drive (bytes per drive = its
 *               experts), for 1 and 3 slots and read depth 1 and 2; a
 *               second batch hits the experts the puts moved into the
 *               slots; read depth -1 makes it an ordinary batch (in order)
 *   budget      the open fails naming the bytes needed when one slot per
 *               layer does not fit; RSS (VmHWM) stays within the budget on
 *               a sparse checkpoint with real-size experts
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/experts/experts.h"
#include "common/experts/placement.h"
#include "common/layers/layers.h"
#include "common/engine/model.h"
#include "common/ckpt/safetensors.h"
#include "common/engine/stage.h"
#include "tests/test.h"
/* st_edit.h is a toolbox; this test uses only its directory helpers */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "tests/st_edit.h"
#pragma GCC diagnostic pop

static char err[1024];

/* ---- a bare store on a checkpoint directory ---- */

static const k3_placement *g_placement; /* next store_open_range's, NULL = none */
static int g_read_depth;

typedef struct store {
    k3_config cfg;
    st_index *idx;
    k3_experts *s;
} store;

/* A store of layers [a, b) (b <= 0: all) with `slots` slots per MoE layer. */
static int store_open_range(store *x, const char *dir, const char *const *dirs, int n_dirs, int a,
                            int b, int slots, int direct, int pipe, int threads) {
    memset(x, 0, sizeof *x);
    if (k3_config_load(&x->cfg, dir, 0, err, sizeof err)) return -1;
    if (b <= 0) b = x->cfg.n_layers;
    st_open_opts so = {dir, dirs, n_dirs};
    if (st_open(&x->idx, &so, err, sizeof err)) return -1;
    int n_moe = 0;
    for (int l = a; l < b; l++) n_moe += x->cfg.is_moe[l];
    k3_expert_geom g;
    k3_expert_geom_init(&g, &x->cfg);
    size_t slot = ((size_t)g.total + 2 * 4096 + 4095) & ~(size_t)4095;
    k3_experts_opts eo = {(size_t)slots * (size_t)n_moe * slot,
                          direct,
                          pipe,
                          threads,
                          0,
                          g_placement,
                          0,
                          g_read_depth};
    if (k3_experts_open(&x->s, x->idx, &x->cfg, a, b, &eo, err, sizeof err)) return -1;
    for (int l = a; l < b; l++)
        if (x->cfg.is_moe[l] &&
            k3_experts_load_layer(x->s, st_prefix(x->idx), l, NULL, err, sizeof err))
            return -1;
    return 0;
}

static int store_open(store *x, const char *dir, const char *const *dirs, int n_dirs, int slots,
                      int direct, int pipe, int threads) {
    return store_open_range(x, dir, dirs, n_dirs, 0, 0, slots, direct, pipe, threads);
}

static void store_close(store *x) {
    k3_experts_close(&x->s);
    st_close(&x->idx);
}

/* The six tensors of (layer, e) from the shards, in slot layout order. */
static int expert_truth(store *x, int layer, int e, unsigned char *out) {
    static const char *const parts[6] = {"w1.weight_packed", "w1.weight_scale",  "w2.weight_packed",
                                         "w2.weight_scale",  "w3.weight_packed", "w3.weight_scale"};
    size_t o = 0;
    for (int p = 0; p < 6; p++) {
        char name[256];
        snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s",
                 st_prefix(x->idx), layer, e, parts[p]);
        const st_tensor *t;
        if (st_find(x->idx, name, &t, err, sizeof err)) return -1;
        if (st_read_raw(x->idx, t, out + o, t->nbytes, err, sizeof err)) return -1;
        o += t->nbytes;
    }
    return 0;
}

/* The view's bytes in slot layout order (w1p w1s w2p w2s w3p w3s). */
static int view_equals(const k3_expert_view *v, const unsigned char *truth, const k3_config *c) {
    size_t pk = (size_t)c->moe_inter * c->latent / 2, sc = pk / 16;
    const k3_mxfp4 *w[3] = {&v->w1, &v->w2, &v->w3};
    size_t o = 0;
    for (int k = 0; k < 3; k++) {
        if (memcmp(w[k]->packed, truth + o, pk)) return 0;
        o += pk;
        if (memcmp(w[k]->scale, truth + o, sc)) return 0;
        o += sc;
    }
    return 1;
}

/* Runs one batch of `n` experts of `layer` (ids in disk order) and checks
 * every view against the shards. Returns the status; *bad counts wrong views. */
static k3_status run_batch(store *x, int layer, const int32_t *ids, int n, int *bad,
                           k3_expert_stats *stats) {
    k3_expert_geom g;
    k3_expert_geom_init(&g, &x->cfg);
    unsigned char *truth = malloc(g.total);
    k3_expert_batch *b = NULL;
    k3_status st = k3_experts_batch_open(&b, x->s, layer, ids, n, stats, err, sizeof err);
    for (int i = 0; i < n && st == K3_OK; i++) {
        k3_expert_view v;
        st = k3_experts_batch_get(b, i, &v, err, sizeof err);
        if (st) break;
        if (expert_truth(x, layer, ids[i], truth) || !view_equals(&v, truth, &x->cfg)) (*bad)++;
        k3_experts_batch_put(b, i);
    }
    k3_experts_batch_close(&b);
    free(truth);
    return st;
}

static int all_ids(store *x, int layer, int32_t *ids) {
    uint8_t sel[K3_MAX_EXPERTS];
    memset(sel, 1, sizeof sel);
    return k3_experts_disk_order(x->s, layer, sel, ids);
}

static void test_read_path(const char *tiny) {
    static const int slot_list[] = {1, 3, 16};
    int combos = 0, fails = 0, bad = 0;
    for (int si = 0; si < 3; si++)
        for (int direct = 0; direct < 2; direct++)
            for (int pipe = 0; pipe < 2; pipe++)
                for (int th = 1; th <= 4; th += 3) {
                    store x;
                    if (store_open(&x, tiny, NULL, 0, slot_list[si], direct, pipe, th)) {
                        printf("# store open: %s\n", err);
                        fails++;
                        continue;
                    }
                    /* two passes: cold, then what the LRU kept */
                    for (int pass = 0; pass < 2; pass++)
                        for (int l = 0; l < x.cfg.n_layers; l++) {
                            if (!x.cfg.is_moe[l]) continue;
                            int32_t ids[K3_MAX_EXPERTS];
                            int n = all_ids(&x, l, ids);
                            if (run_batch(&x, l, ids, n, &bad, NULL)) {
                                printf("# batch: %s\n", err);
                                fails++;
                            }
                        }
                    combos++;
                    store_close(&x);
                }
    CHECK(combos == 24 && fails == 0 && bad == 0,
          "every expert read through batches equals its shard bytes (%d settings: slots 1/3/16 x "
          "direct x pipe x threads 1/4; %d failures, %d wrong views)",
          combos, fails, bad);

    /* the LRU: with all experts resident a second pass is all hits */
    store x;
    if (store_open(&x, tiny, NULL, 0, 16, 1, 1, 4) == 0) {
        k3_expert_stats a = {0}, b = {0};
        int32_t ids[K3_MAX_EXPERTS];
        int n = all_ids(&x, 1, ids);
        run_batch(&x, 1, ids, n, &bad, &a);
        run_batch(&x, 1, ids, n, &bad, &b);
        CHECK(a.misses == (uint64_t)n && a.hits == 0 && b.hits == (uint64_t)n && b.misses == 0 &&
                  a.bytes == (uint64_t)n * 1632 && b.bytes == 0 && a.io_ms > 0,
              "stats: cold pass %llu misses %llu bytes, warm pass %llu hits",
              (unsigned long long)a.misses, (unsigned long long)a.bytes,
              (unsigned long long)b.hits);
        store_close(&x);
    }
    /* fewer slots than the batch: the same batch twice keeps slots - 2 of
     * the experts it needs last (LRU would keep none: it evicts each one
     * just before its turn; the other 2 slots stream: one computing, one
     * read ahead), in both pipelined and serial admission */
    for (int pipe = 0; pipe <= 1; pipe++)
        for (int slots = 2; slots <= 6; slots += 2) {
            store y;
            if (store_open(&y, tiny, NULL, 0, slots, 1, pipe, 2)) {
                printf("not ok - store open: %s\n", err);
                continue;
            }
            k3_expert_stats a = {0}, b = {0}, c = {0};
            int32_t ids[K3_MAX_EXPERTS];
            int n = all_ids(&y, 1, ids);
            run_batch(&y, 1, ids, n, &bad, &a);
            run_batch(&y, 1, ids, n, &bad, &b);
            run_batch(&y, 1, ids, n, &bad, &c);
            CHECK(n > slots && a.hits == 0 && b.hits == (uint64_t)(slots - 2) &&
                      b.misses == (uint64_t)(n - slots + 2) && c.hits == b.hits && bad == 0,
                  "%d slots, pipe %d, a batch of %d experts three times: hits %llu / %llu / %llu "
                  "(want 0 / %d / %d)",
                  slots, pipe, n, (unsigned long long)a.hits, (unsigned long long)b.hits,
                  (unsigned long long)c.hits, slots - 2, slots - 2);
            store_close(&y);
        }
    if (store_open(&x, tiny, NULL, 0, 16, 1, 1, 4) == 0) {
        int32_t ids[K3_MAX_EXPERTS];
        all_ids(&x, 1, ids);
        /* bad ids are refused before anything is read */
        int32_t dup[2] = {ids[0], ids[0]}, out_of[1] = {99};
        k3_expert_batch *bb = NULL;
        CHECK(k3_experts_batch_open(&bb, x.s, 1, dup, 2, NULL, err, sizeof err) == K3_ERR_ARG &&
                  strstr(err, "twice"),
              "a batch naming an expert twice is refused: %s", err);
        CHECK(k3_experts_batch_open(&bb, x.s, 1, out_of, 1, NULL, err, sizeof err) == K3_ERR_ARG &&
                  strstr(err, "99"),
              "an expert id out of range is refused: %s", err);
        store_close(&x);
    }
}

/* ---- bit identity through the model ---- */

static k3_model *open_model(const char *dir, const char *const *dirs, int n_dirs, double gb,
                            int direct, int pipe, int threads) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.dirs = dirs;
    o.n_dirs = n_dirs;
    o.want_global = 1;
    o.threads = 2;
    o.expert_gb = gb;
    o.direct = direct;
    o.pipe = pipe;
    o.load_threads = threads;
    k3_model *m = NULL;
    if (k3_model_open(&m, &o, err, sizeof err) != K3_OK) {
        printf("# open %s: %s\n", dir, err);
        return NULL;
    }
    return m;
}

/* Logits [T][vocab] of ids run in chunks; *first (may be NULL) gets the
 * first chunk's step statistics. */
static k3_status run_prompt_stats(k3_model *m, const int32_t *ids, int T, int chunk, float *logits,
                                  k3_step_stats *first) {
    const k3_config *c = k3_model_config(m);
    int D = c->hidden;
    k3_state *s = NULL;
    k3_status st = k3_state_open(&s, m, T, err, sizeof err);
    if (st) return st;
    float *blocks = malloc(sizeof(float) * K3_MAX_RES_ENTRIES * (size_t)chunk * D);
    float *h = malloc(sizeof(float) * (size_t)chunk * D);
    for (int p = 0; p < T && !st; p += chunk) {
        int n = T - p < chunk ? T - p : chunk;
        int nb = 0;
        st = k3_model_embed(m, ids + p, n, h, err, sizeof err);
        k3_step_stats ss = {0};
        if (!st)
            st = k3_stage_forward(m, s, p, n, blocks, &nb, h, &ss, NULL, NULL, err, sizeof err);
        if (p == 0 && first) *first = ss;
        if (!st)
            st = k3_model_head(m, blocks, nb, h, n, 0, logits + (size_t)p * c->vocab, err,
                               sizeof err);
    }
    free(blocks), free(h);
    k3_state_close(&s);
    return st;
}

static k3_status run_prompt(k3_model *m, const int32_t *ids, int T, int chunk, float *logits) {
    return run_prompt_stats(m, ids, T, chunk, logits, NULL);
}

#define NT 12
static int32_t g_ids[NT];
static float *g_ref4, *g_ref1; /* resident-budget logits, chunks of 4 and 1 */

/* 1 if the model's logits equal the references bit for bit. */
static int same_as_ref(k3_model *m) {
    if (!m) return 0;
    size_t n = (size_t)NT * k3_model_config(m)->vocab;
    float *l = calloc(n, 4);
    int ok = run_prompt(m, g_ids, NT, 4, l) == K3_OK && !memcmp(l, g_ref4, n * 4);
    ok = ok && run_prompt(m, g_ids, NT, 1, l) == K3_OK && !memcmp(l, g_ref1, n * 4);
    free(l);
    return ok;
}

static void test_bit_identity(const char *tiny) {
    k3_model *ref = open_model(tiny, NULL, 0, 8.0, 1, 1, 4);
    if (!ref) {
        CHECK(0, "open tiny: %s", err);
        return;
    }
    k3_config cfg = *k3_model_config(ref); /* ref is closed below */
    const k3_config *c = &cfg;
    size_t n = (size_t)NT * c->vocab;
    uint32_t seed = 4242;
    for (int t = 0; t < NT; t++) {
        seed = seed * 1664525u + 1013904223u;
        g_ids[t] = (int32_t)((seed >> 8) % (uint32_t)c->vocab);
    }
    g_ref4 = calloc(n, 4), g_ref1 = calloc(n, 4);
    k3_status s4 = run_prompt(ref, g_ids, NT, 4, g_ref4);
    k3_status s1 = run_prompt(ref, g_ids, NT, 1, g_ref1);
    CHECK(s4 == K3_OK && s1 == K3_OK && k3_experts_slots(k3_model_experts(ref), 1) == c->n_experts,
          "reference: all %d experts resident, prompt of %d tokens in chunks of 4 and 1",
          c->n_experts, NT);
    k3_model_close(&ref);

    int n_moe = 0;
    for (int l = 0; l < c->n_layers; l++) n_moe += c->is_moe[l];
    size_t slot = 12288; /* tiny: 1632-byte expert + alignment room */
    static const int slot_list[] = {1, 2, 3, 5, 16};
    int runs = 0, same = 0;
    char bad[1200] = "";
    for (int si = 0; si < 5; si++)
        for (int direct = 0; direct < 2; direct++)
            for (int pipe = 0; pipe < 2; pipe++)
                for (int th = 1; th <= 4; th += 3) {
                    double gb =
                        ((double)slot_list[si] + 0.5) * n_moe * (double)slot / (double)(1u << 30);
                    k3_model *m = open_model(tiny, NULL, 0, gb, direct, pipe, th);
                    int slots = m ? k3_experts_slots(k3_model_experts(m), 1) : -1;
                    int ok = m && slots == slot_list[si] && same_as_ref(m);
                    runs++;
                    same += ok;
                    if (!ok && !bad[0])
                        snprintf(bad, sizeof bad,
                                 "slots %d (got %d) direct %d pipe %d threads %d: %s",
                                 slot_list[si], slots, direct, pipe, th, err);
                    k3_model_close(&m);
                }
    CHECK(same == runs,
          "streamed logits == resident logits bit for bit in %d/%d settings "
          "(slots 1/2/3/5/16 x K3_DIRECT x K3_PIPE x load threads 1/4)%s%s",
          same, runs, bad[0] ? "; first failure: " : "", bad);

    /* --dirs: the shards spread over 2 and 3 directories */
    for (int nd = 2; nd <= 3; nd++) {
        char dir[3][256];
        for (int k = 0; k < nd; k++) {
            snprintf(dir[k], sizeof dir[k], "/tmp/k3_test_experts_dirs_%d_%d", (int)getpid(), k);
            ste_rm_dir(dir[k]);
            mkdir(dir[k], 0755);
        }
        ste_copy_dir(tiny, dir[0]);
        /* shard i moves to dir i % nd */
        for (int i = 1; i <= 10; i++) {
            char a[600], b[600];
            snprintf(a, sizeof a, "%s/model-%05d-of-00010.safetensors", dir[0], i);
            snprintf(b, sizeof b, "%s/model-%05d-of-00010.safetensors", dir[i % nd], i);
            if (i % nd) rename(a, b);
        }
        const char *extra[2] = {dir[1], dir[2]};
        k3_model *m = open_model(dir[0], extra, nd - 1, 1e-9, 1, 1, 4);
        int ok1 = same_as_ref(m);
        k3_model_close(&m);
        m = open_model(dir[0], extra, nd - 1, 8.0, 0, 0, 1);
        int ok2 = same_as_ref(m);
        k3_model_close(&m);
        /* each shard is read from its own directory (its own fds) */
        st_index *idx = NULL;
        st_open_opts so = {dir[0], extra, nd - 1};
        int placed = 0, shards = 0;
        if (st_open(&idx, &so, err, sizeof err) == K3_OK) {
            shards = st_shard_count(idx);
            for (int s = 0; s < shards; s++) {
                int i = atoi(st_shard_name(idx, s) + 6);
                placed += strncmp(st_shard_path(idx, s), dir[i % nd], strlen(dir[i % nd])) == 0;
            }
            st_close(&idx);
        }
        CHECK(ok1 && ok2 && shards == 10 && placed == 10,
              "shards split over %d directories: logits bit-identical (1 slot, direct, pipe and "
              "all resident, buffered, no pipe), %d/%d shards opened in their own directory",
              nd, placed, shards);
        for (int k = 0; k < nd; k++) ste_rm_dir(dir[k]);
    }
}

/* ---- faults ---- */

typedef struct fault {
    int shard;       /* shard to fail, -1 none */
    uint64_t lo, hi; /* fail reads touching [lo, hi) */
    int mode;        /* errno, or -k: k bytes short */
} fault;
static fault g_fault;

static int fault_hook(int shard, uint64_t off, size_t len, void *ctx) {
    (void)ctx;
    if (shard != g_fault.shard || off >= g_fault.hi || off + len <= g_fault.lo) return 0;
    return g_fault.mode;
}

/* The shard and offset of (layer, e)'s first tensor. */
static int expert_place(store *x, int layer, int e, int *shard, uint64_t *off) {
    char name[256];
    snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.w1.weight_packed",
             st_prefix(x->idx), layer, e);
    const st_tensor *t;
    if (st_find(x->idx, name, &t, err, sizeof err)) return -1;
    *shard = t->shard;
    *off = t->offset;
    return 0;
}

static void test_faults(const char *tiny) {
    /* Buffered reads fetch exactly the expert, so a fault on one expert's
     * bytes hits that expert only (O_DIRECT widens reads to 4 KiB blocks,
     * which on the tiny checkpoint hold several experts: tested per shard
     * below). */
    static const int modes[2] = {EIO, -100};
    static const char *const want[2] = {"Input/output error", "short read"};
    for (int k = 0; k < 2; k++)
        for (int pipe = 0; pipe < 2; pipe++) {
            store x;
            if (store_open(&x, tiny, NULL, 0, 4, 0, pipe, 4)) {
                CHECK(0, "store open: %s", err);
                continue;
            }
            int32_t ids[K3_MAX_EXPERTS];
            int n = all_ids(&x, 2, ids), shard, bad = 0;
            uint64_t off;
            /* the 7th expert in disk order fails: 6 are used before it */
            expert_place(&x, 2, ids[6], &shard, &off);
            g_fault = (fault){shard, off, off + 1, modes[k]};
            st_set_fault_hook(fault_hook, NULL);
            k3_status st = run_batch(&x, 2, ids, n, &bad, NULL);
            char name[64];
            snprintf(name, sizeof name, "layer 2 expert %d", ids[6]);
            CHECK(st == K3_ERR_IO && strstr(err, name) &&
                      strstr(err, st_shard_name(x.idx, shard)) && strstr(err, want[k]) && bad == 0,
                  "%s mid-batch (pipe %d) names layer, expert and shard: %s", want[k], pipe, err);
            /* untouched experts still work while the fault is on */
            k3_status st2 = run_batch(&x, 2, ids, 6, &bad, NULL);
            k3_status st3 = run_batch(&x, 2, ids + 7, n - 7, &bad, NULL);
            st_set_fault_hook(NULL, NULL);
            k3_status st4 = run_batch(&x, 2, ids, n, &bad, NULL);
            CHECK(st2 == K3_OK && st3 == K3_OK && st4 == K3_OK && bad == 0,
                  "after the fault: the other experts read fine, and the failed one once the "
                  "fault is gone (%s)",
                  st2 || st3 || st4 ? err : "ok");
            store_close(&x);
        }
    /* O_DIRECT: a whole shard fails */
    for (int pipe = 0; pipe < 2; pipe++) {
        store x;
        if (store_open(&x, tiny, NULL, 0, 2, 1, pipe, 4)) continue;
        int32_t ids[K3_MAX_EXPERTS], other[K3_MAX_EXPERTS];
        int n = all_ids(&x, 2, ids), n6 = all_ids(&x, 6, other), shard, shard6, bad = 0;
        uint64_t off;
        expert_place(&x, 2, ids[0], &shard, &off);
        expert_place(&x, 6, other[0], &shard6, &off);
        g_fault = (fault){shard, 0, UINT64_MAX, EIO};
        st_set_fault_hook(fault_hook, NULL);
        k3_status st = run_batch(&x, 2, ids, n, &bad, NULL);
        CHECK(st == K3_ERR_IO && strstr(err, "layer 2 expert") &&
                  strstr(err, st_shard_name(x.idx, shard)) && strstr(err, "Input/output error"),
              "O_DIRECT read of a failing shard (pipe %d): %s", pipe, err);
        k3_status st2 = shard6 != shard ? run_batch(&x, 6, other, n6, &bad, NULL) : K3_ERR_STATE;
        st_set_fault_hook(NULL, NULL);
        k3_status st3 = run_batch(&x, 2, ids, n, &bad, NULL);
        CHECK(st2 == K3_OK && st3 == K3_OK && bad == 0,
              "another shard reads while it fails, and it reads again afterwards (%s)",
              st2 || st3 ? err : "ok");
        store_close(&x);
    }

    /* a shard truncated after start */
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/k3_test_experts_trunc_%d", (int)getpid());
    ste_rm_dir(dir);
    ste_copy_dir(tiny, dir);
    store x;
    if (store_open(&x, dir, NULL, 0, 2, 1, 1, 4) == 0) {
        int32_t ids[K3_MAX_EXPERTS];
        int n = all_ids(&x, 4, ids), shard, bad = 0;
        uint64_t off;
        expert_place(&x, 4, ids[n - 1], &shard, &off);
        int cut = truncate(st_shard_path(x.idx, shard), (off_t)(off + 100));
        k3_status st = run_batch(&x, 4, ids, n, &bad, NULL);
        CHECK(cut == 0 && st == K3_ERR_IO && strstr(err, "short read") &&
                  strstr(err, st_shard_name(x.idx, shard)) && strstr(err, "layer 4 expert"),
              "a shard truncated after start: %s", err);
        int32_t other[K3_MAX_EXPERTS];
        int n5 = all_ids(&x, 5, other);
        st = run_batch(&x, 5, other, n5, &bad, NULL);
        k3_status st2 = run_batch(&x, 4, ids, n - 1, &bad, NULL);
        CHECK(st == K3_OK && st2 == K3_OK && bad == 0,
              "after the truncation: another layer and the experts before the cut still read (%s)",
              st || st2 ? err : "ok");
        store_close(&x);
    }
    ste_rm_dir(dir);
}

/* ---- usage history ---- */

static void test_history(const char *tiny) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/k3_test_experts_usage_%d", (int)getpid());
    store a, b;
    if (store_open(&a, tiny, NULL, 0, 4, 1, 1, 2) || store_open(&b, tiny, NULL, 0, 4, 1, 1, 2)) {
        CHECK(0, "store open: %s", err);
        return;
    }
    int bad = 0;
    int32_t ids[K3_MAX_EXPERTS];
    int n = all_ids(&a, 1, ids);
    run_batch(&a, 1, ids, 3, &bad, NULL); /* first three twice, the rest once */
    run_batch(&a, 1, ids, 3, &bad, NULL);
    run_batch(&a, 1, ids + 3, n - 3, &bad, NULL);
    k3_status st = k3_experts_usage_save(a.s, path, err, sizeof err);
    FILE *f = fopen(path, "r");
    char l1[64] = "", l2[64] = "";
    if (f) {
        if (!fgets(l1, sizeof l1, f) || !fgets(l2, sizeof l2, f)) l1[0] = 0;
        fclose(f);
    }
    char want1[64];
    snprintf(want1, sizeof want1, "-1 %d %d\n", a.cfg.n_layers, a.cfg.n_experts);
    CHECK(st == K3_OK && !strcmp(l1, want1) && !strncmp(l2, "-2 1 ", 5),
          "history saved: header '%.*s' / '%.*s'", (int)strlen(l1) - 1, l1, (int)strlen(l2) - 1,
          l2);
    st = k3_experts_usage_load(b.s, path, err, sizeof err);
    int same = st == K3_OK;
    for (int l = 0; l < a.cfg.n_layers; l++)
        for (int e = 0; e < a.cfg.n_experts; e++)
            same &= k3_experts_usage_count(a.s, l, e) == k3_experts_usage_count(b.s, l, e);
    CHECK(same && k3_experts_usage_count(b.s, 1, ids[0]) == 2 &&
              k3_experts_usage_count(b.s, 1, ids[5]) == 1,
          "history round trip: every count equal after load (%s)", st ? err : "ok");
    /* warm start: half of the 4 slots get the two hottest experts */
    int n_read = 0;
    st = k3_experts_warm(b.s, &n_read, err, sizeof err);
    k3_expert_stats ws = {0};
    int32_t hot[2] = {ids[0], ids[1]};
    run_batch(&b, 1, hot, 2, &bad, &ws);
    CHECK(st == K3_OK && n_read == 2 && ws.hits == 2 && bad == 0,
          "warm start read %d experts; the two hottest are hits (%llu)", n_read,
          (unsigned long long)ws.hits);
    /* another model's history is refused */
    f = fopen(path, "w");
    if (f) {
        fprintf(f, "-1 %d %d\n-2 1 1\n1 1 5\n", a.cfg.n_layers + 1, a.cfg.n_experts);
        fclose(f);
    }
    st = k3_experts_usage_load(b.s, path, err, sizeof err);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, "dims"), "mismatched history refused: %s", err);
    remove(path);
    CHECK(k3_experts_usage_load(b.s, path, err, sizeof err) == K3_OK,
          "no history file yet: nothing loaded, no error");
    store_close(&a);
    store_close(&b);
}

/* ---- one history file shared by several stores (workers) ---- */

/* Whole file as text ("" when absent). */
static void slurp(const char *path, char *buf, size_t n) {
    buf[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t k = fread(buf, 1, n - 1, f);
    buf[k] = 0;
    fclose(f);
}

/* Every MoE layer of x's range: one batch of the first 2 + l % 3 experts
 * in disk order (so counts differ between layers). */
static void use_some(store *x, int a, int b, int *bad) {
    for (int l = a; l < b; l++) {
        if (!x->cfg.is_moe[l]) continue;
        int32_t ids[K3_MAX_EXPERTS];
        all_ids(x, l, ids);
        run_batch(x, l, ids, 2 + l % 3, bad, NULL);
    }
}

static void test_history_merge(const char *tiny) {
    char path[256], lock[300];
    snprintf(path, sizeof path, "/tmp/k3_test_experts_merge_%d", (int)getpid());
    snprintf(lock, sizeof lock, "%s.lock", path);
    remove(path);
    store lo, hi, lo2, all;
    if (store_open_range(&lo, tiny, NULL, 0, 0, 4, 4, 1, 1, 2) ||
        store_open_range(&hi, tiny, NULL, 0, 4, 0, 4, 1, 1, 2) ||
        store_open_range(&lo2, tiny, NULL, 0, 0, 4, 4, 1, 1, 2)) {
        CHECK(0, "store open: %s", err);
        return;
    }
    int L = lo.cfg.n_layers, E = lo.cfg.n_experts, bad = 0;
    use_some(&lo, 0, 4, &bad);
    use_some(&hi, 4, L, &bad);
    k3_status s1 = k3_experts_usage_save(lo.s, path, err, sizeof err);
    k3_status s2 = k3_experts_usage_save(hi.s, path, err, sizeof err);
    /* a store of every layer sees both ranges' rows */
    int same = s1 == K3_OK && s2 == K3_OK && store_open(&all, tiny, NULL, 0, 4, 1, 1, 2) == 0 &&
               k3_experts_usage_load(all.s, path, err, sizeof err) == K3_OK;
    int nonzero = 0;
    for (int l = 0; same && l < L; l++)
        for (int e = 0; e < E; e++) {
            uint64_t want =
                l < 4 ? k3_experts_usage_count(lo.s, l, e) : k3_experts_usage_count(hi.s, l, e);
            same &= k3_experts_usage_count(all.s, l, e) == want;
            nonzero += want > 0;
        }
    CHECK(same && nonzero > 0 && bad == 0,
          "workers [0, 4) and [4, %d) saving to one file: both ranges' rows kept, %d non-zero "
          "counts equal in a store of every layer (%s)",
          L, nonzero, same ? "ok" : err);
    store_close(&all);

    /* a replica of [0, 4) adds its counts; a second save of lo adds only
     * what lo used since its first save */
    use_some(&lo2, 0, 4, &bad);
    int32_t ids[K3_MAX_EXPERTS];
    all_ids(&lo, 1, ids);
    run_batch(&lo, 1, ids, 1, &bad, NULL); /* expert ids[0] of layer 1 once more */
    s1 = k3_experts_usage_save(lo2.s, path, err, sizeof err);
    s2 = k3_experts_usage_save(lo.s, path, err, sizeof err);
    same = s1 == K3_OK && s2 == K3_OK && store_open(&all, tiny, NULL, 0, 4, 1, 1, 2) == 0 &&
           k3_experts_usage_load(all.s, path, err, sizeof err) == K3_OK;
    for (int l = 0; same && l < L; l++)
        for (int e = 0; e < E; e++) {
            uint64_t want =
                l < 4 ? k3_experts_usage_count(lo.s, l, e) + k3_experts_usage_count(lo2.s, l, e)
                      : k3_experts_usage_count(hi.s, l, e);
            same &= k3_experts_usage_count(all.s, l, e) == want;
        }
    CHECK(same && k3_experts_usage_count(lo.s, 1, ids[0]) == 2,
          "a replica's counts add up, a repeated save adds only the selections since the last "
          "one (%s)",
          same ? "ok" : err);
    store_close(&all);

    /* a file of another model is refused at save and left as it is */
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "-1 %d %d\n-2 1 1\n", L, E + 1);
        fclose(f);
    }
    char before[256], after[256];
    slurp(path, before, sizeof before);
    k3_status st = k3_experts_usage_save(lo.s, path, err, sizeof err);
    slurp(path, after, sizeof after);
    CHECK(st == K3_ERR_MISMATCH && strstr(err, path) && strstr(err, "not saved") &&
              !strcmp(before, after),
          "save over another model's history refused, file untouched: %s", err);
    store_close(&lo);
    store_close(&hi);
    store_close(&lo2);
    remove(path);
    remove(lock);
}

/* ---- the history through the model: saved, warmed from, same bits ---- */

static k3_model *open_model_usage(const char *dir, const char *usage, int save) {
    k3_model_opts o;
    k3_model_opts_default(&o);
    o.model_dir = dir;
    o.want_global = 1;
    o.threads = 2;
    k3_config c;
    if (k3_config_load(&c, dir, 0, err, sizeof err)) return NULL;
    int n_moe = 0;
    for (int l = 0; l < c.n_layers; l++) n_moe += c.is_moe[l];
    o.expert_gb = 4.5 * n_moe * 12288.0 / (double)(1u << 30); /* 4 slots per layer */
    o.usage_path = usage;
    o.usage_save = save;
    k3_model *m = NULL;
    if (k3_model_open(&m, &o, err, sizeof err) != K3_OK) return NULL;
    return m;
}

static void test_history_model(const char *tiny) {
    char path[256], lock[300];
    snprintf(path, sizeof path, "/tmp/k3_test_experts_model_usage_%d", (int)getpid());
    snprintf(lock, sizeof lock, "%s.lock", path);
    remove(path);
    size_t n = (size_t)NT * 1280;
    float *l = calloc(n * 4, 4);
    k3_step_stats first[2];
    memset(first, 0, sizeof first);
    int same[2] = {0, 0};
    k3_status saved = K3_ERR_STATE;
    for (int run = 0; run < 2; run++) {
        k3_model *m = open_model_usage(tiny, path, 1);
        if (!m) {
            CHECK(0, "open with a usage history: %s", err);
            free(l);
            return;
        }
        n = (size_t)NT * k3_model_config(m)->vocab;
        same[run] =
            run_prompt_stats(m, g_ids, NT, 1, l, &first[run]) == K3_OK && !memcmp(l, g_ref1, n * 4);
        saved = k3_model_usage_save(m, err, sizeof err);
        k3_model_close(&m);
    }
    char text[64];
    slurp(path, text, sizeof text);
    CHECK(saved == K3_OK && !strncmp(text, "-1 ", 3), "k3_model_usage_save wrote the history (%s)",
          saved ? err : "ok");
    CHECK(first[0].expert_hits == 0 && first[0].expert_misses > 0 && first[1].expert_hits > 0,
          "warm start: the first token's experts were %llu hits / %llu misses cold, %llu hits / "
          "%llu misses warmed from the saved history",
          (unsigned long long)first[0].expert_hits, (unsigned long long)first[0].expert_misses,
          (unsigned long long)first[1].expert_hits, (unsigned long long)first[1].expert_misses);
    CHECK(same[0] && same[1],
          "logits bit-identical to the resident reference without (first run) and with (second "
          "run) the warm start");

    /* K3_USAGE_SAVE=0: the file stays as it is */
    char before[4096], after[4096];
    slurp(path, before, sizeof before);
    k3_model *m = open_model_usage(tiny, path, 0);
    k3_status st = m ? run_prompt(m, g_ids, 4, 4, l) : K3_ERR_STATE;
    if (m) st = st ? st : k3_model_usage_save(m, err, sizeof err);
    k3_model_close(&m);
    slurp(path, after, sizeof after);
    CHECK(st == K3_OK && !strcmp(before, after), "usage_save 0: the history is read only");

    /* another engine's history: the open is refused, naming the file */
    FILE *f = fopen(path, "w");
    if (f) {
        fprintf(f, "-1 8 16\n-2 1 12345\n1 1 5\n");
        fclose(f);
    }
    m = open_model_usage(tiny, path, 1);
    CHECK(!m && strstr(err, path) && strstr(err, "engine 12345") && strstr(err, "K3_USAGE"),
          "a mismatched history refuses the open: %s", err);
    k3_model_close(&m);
    free(l);
    remove(path);
    remove(lock);
}

/* ---- budget and memory honesty ---- */

static long vm_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t kl = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl)) v = atol(line + kl + 1);
    if (f) fclose(f);
    return v;
}

/* A checkpoint of 2 MoE layers x 4 experts of real K3 size (17.5 MB each),
 * written sparse: 140 MB of holes that cost no disk. */
static int write_sparse(const char *path, const k3_config *c) {
    k3_expert_geom g;
    k3_expert_geom_init(&g, c);
    static const char *const parts[6] = {"w1.weight_packed", "w1.weight_scale",  "w2.weight_packed",
                                         "w2.weight_scale",  "w3.weight_packed", "w3.weight_scale"};
    size_t cap = 1 << 16, n = 0;
    char *h = malloc(cap);
    n += (size_t)snprintf(h + n, cap - n, "{");
    uint64_t off = 0;
    for (int l = 0; l < 2; l++)
        for (int e = 0; e < 4; e++)
            for (int p = 0; p < 6; p++) {
                int w2 = p == 2 || p == 3;
                long r = w2 ? c->latent : c->moe_inter, cols = w2 ? c->moe_inter : c->latent;
                cols = p & 1 ? cols / 32 : cols / 2;
                n += (size_t)snprintf(
                    h + n, cap - n,
                    "%s\"model.layers.%d.block_sparse_moe.experts.%d.%s\":{"
                    "\"dtype\":\"U8\",\"shape\":[%ld,%ld],\"data_offsets\":[%llu,%llu]}",
                    n > 1 ? "," : "", l, e, parts[p], r, cols, (unsigned long long)off,
                    (unsigned long long)(off + g.bytes[p]));
                off += g.bytes[p];
            }
    n += (size_t)snprintf(h + n, cap - n, "}");
    while ((n + 8) % 8) h[n++] = ' ';
    FILE *f = fopen(path, "wb");
    uint64_t hl = n;
    int ok = f && fwrite(&hl, 8, 1, f) == 1 && fwrite(h, 1, n, f) == n;
    if (f) ok &= fclose(f) == 0;
    free(h);
    return ok && truncate(path, (off_t)(8 + n + off)) == 0 ? 0 : -1;
}

/* Peak RSS per byte the store holds. ThreadSanitizer keeps 4 bytes of
 * shadow memory per byte the program touches (the runtime of GCC 12; the
 * newer LLVM one keeps 2), resident as long as the data is, so the slots'
 * B bytes show as up to (1 + 4) B of RSS. That bound still tells a store
 * that keeps its budget from one that holds every expert (4 per layer, 4 x
 * the budget, 5 x that under TSan). ASan's shadow (1/8) fits the slack. */
#if defined(__SANITIZE_THREAD__)
#define RSS_PER_BYTE 5
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define RSS_PER_BYTE 5
#endif
#endif
#ifndef RSS_PER_BYTE
#define RSS_PER_BYTE 1
#endif

static void test_budget(void) {
    k3_config c;
    memset(&c, 0, sizeof c);
    c.n_layers = 2;
    c.n_experts = 4;
    c.moe_inter = 3072;
    c.latent = 3584;
    c.is_moe[0] = c.is_moe[1] = 1;
    char dir[256], path[300];
    snprintf(dir, sizeof dir, "/tmp/k3_test_experts_rss_%d", (int)getpid());
    ste_rm_dir(dir);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_index *idx = NULL;
    st_open_opts so = {dir, NULL, 0};
    if (write_sparse(path, &c) || st_open(&idx, &so, err, sizeof err)) {
        CHECK(0, "sparse checkpoint: %s", err);
        ste_rm_dir(dir);
        return;
    }
    /* not even one slot per layer fits: refused, saying how much is needed */
    k3_experts *s = NULL;
    k3_experts_opts eo = {1, 1, 1, 4, 20000000, NULL, 0, 0}; /* 20 MB of RAM for 2 x 17.5 MB */
    k3_status st = k3_experts_open(&s, idx, &c, 0, 2, &eo, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "need at least 0.04 GB") && strstr(err, "2 MoE layers"),
          "a budget that cannot fit fails at open: %s", err);
    /* a budget above the memory is lowered to what fits */
    eo = (k3_experts_opts){(size_t)4 << 30, 1,    1, 4,
                           100000000,       NULL, 0, 0}; /* 100 MB: 2 slots/layer */
    st = k3_experts_open(&s, idx, &c, 0, 2, &eo, err, sizeof err);
    CHECK(st == K3_OK && k3_experts_slots(s, 0) == 2,
          "a 4 GB budget on 100 MB of RAM gets %d "
          "slots per layer",
          s ? k3_experts_slots(s, 0) : -1);
    k3_experts_close(&s);

    /* RSS: one slot per layer, every expert streamed through it */
    eo = (k3_experts_opts){1, 1, 1, 4, 0, NULL, 0, 0};
    long hwm0 = vm_kb("VmHWM:"), rss0 = vm_kb("VmRSS:");
    st = k3_experts_open(&s, idx, &c, 0, 2, &eo, err, sizeof err);
    for (int l = 0; l < 2 && st == K3_OK; l++)
        st = k3_experts_load_layer(s, "", l, NULL, err, sizeof err);
    for (int rep = 0; rep < 2 && st == K3_OK; rep++)
        for (int l = 0; l < 2 && st == K3_OK; l++) {
            int32_t ids[4] = {0, 1, 2, 3};
            k3_expert_batch *b = NULL;
            st = k3_experts_batch_open(&b, s, l, ids, 4, NULL, err, sizeof err);
            for (int i = 0; i < 4 && st == K3_OK; i++) {
                k3_expert_view v;
                st = k3_experts_batch_get(b, i, &v, err, sizeof err);
                if (st == K3_OK) k3_experts_batch_put(b, i);
            }
            k3_experts_batch_close(&b);
        }
    long hwm1 = vm_kb("VmHWM:"), rss1 = vm_kb("VmRSS:");
    size_t budget_kb = 2 * k3_experts_slot_bytes(s) / 1024;
    k3_expert_stats t = {0};
    if (s) k3_experts_totals(s, &t);
    long grew = (hwm1 > hwm0 ? hwm1 - rss0 : rss1 - rss0);
    CHECK(st == K3_OK && t.misses == 16 &&
              k3_experts_resident_bytes(s) == 2 * k3_experts_slot_bytes(s) &&
              grew <= RSS_PER_BYTE * (long)budget_kb + 8192,
          "1 slot/layer over 16 reads of 17.5 MB experts: peak RSS grew %ld kB, budget %zu kB "
          "(bound %d x budget + 8 MB slack%s), all experts would be %zu kB (%s)",
          grew, budget_kb, RSS_PER_BYTE,
          RSS_PER_BYTE > 1 ? ": ThreadSanitizer's shadow memory counts" : "",
          8 * k3_experts_slot_bytes(s) / 1024, st ? err : "ok");
    k3_experts_close(&s);
    st_close(&idx);
    ste_rm_dir(dir);
}

/* Any-order batches on a placement of 2 drives whose files are links to
 * the tiny shards (2:1 weights); split: a byte-split placement cut on 64
 * bytes, so every tiny expert (1632 bytes) is read in two pieces. */
static void test_staged(const char *tiny, int split) {
    const char *tag = split ? "split, " : "";
    char dir[] = "/tmp/plan-test-staged.XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp: %s", strerror(errno));
        return;
    }
    store x;
    if (store_open_range(&x, tiny, NULL, 0, 0, 0, 1, 1, 1, 2)) {
        CHECK(0, "open tiny: %s", err);
        return;
    }
    char d[2][300], path[700];
    const char *dp[2] = {d[0], d[1]};
    for (int k = 0; k < 2; k++) {
        snprintf(d[k], sizeof d[k], "%s/d%d", dir, k);
        snprintf(path, sizeof path, "%s/%s", d[k], K3_PLACEMENT_SUBDIR);
        if (mkdir(d[k], 0755) || mkdir(path, 0755)) CHECK(0, "mkdir %s", path);
        for (int i = 0; i < st_shard_count(x.idx); i++) {
            char src[700], dst[900], real[4096];
            snprintf(src, sizeof src, "%s/%s", tiny, st_shard_name(x.idx, i));
            snprintf(dst, sizeof dst, "%s/%s", path, st_shard_name(x.idx, i));
            if (!realpath(src, real) || symlink(real, dst)) CHECK(0, "link %s", dst);
        }
    }
    k3_expert_geom g;
    k3_expert_geom_init(&g, &x.cfg);
    double w[2] = {2, 1};
    k3_place_input in = {dp,      2,    w,     0, x.cfg.n_layers, x.cfg.n_experts, x.cfg.is_moe,
                         g.total, NULL, split, 64};
    k3_placement *pl = NULL;
    k3_status st = k3_placement_build(&pl, &in, err, sizeof err);
    CHECK(st == K3_OK, "%splacement over 2 drives: %s", tag, st ? err : "built");
    int layer = 0;
    while (layer < x.cfg.n_layers && !x.cfg.is_moe[layer]) layer++;
    store_close(&x);
    unsigned char *truth = malloc(g.total);
    static const int slots_of[3] = {1, 3, 1}, depth_of[3] = {1, 2, -1};
    for (int c = 0; c < 3 && st == K3_OK; c++) {
        g_placement = pl, g_read_depth = depth_of[c];
        int r = store_open_range(&x, tiny, NULL, 0, 0, 0, slots_of[c], 1, 1, 2);
        g_placement = NULL, g_read_depth = 0;
        if (r) {
            CHECK(0, "open striped: %s", err);
            break;
        }
        int32_t ids[K3_MAX_EXPERTS];
        int n = all_ids(&x, layer, ids);
        int seen[K3_MAX_EXPERTS] = {0}, bad = 0, dup = 0, in_order = 1;
        k3_expert_stats s1 = {0}, s2 = {0};
        for (int pass = 0; pass < 2 && st == K3_OK; pass++) {
            k3_expert_batch *b = NULL;
            st = k3_experts_batch_open_any(&b, x.s, layer, ids, n, pass ? &s2 : &s1, err,
                                           sizeof err);
            for (int k = 0; k < n && st == K3_OK; k++) {
                k3_expert_view v;
                int i = -1;
                st = k3_experts_batch_next(b, &i, &v, err, sizeof err);
                if (st) break;
                if (i != k) in_order = 0;
                if (pass == 0) dup += seen[i]++ != 0;
                if (expert_truth(&x, layer, ids[i], truth) || !view_equals(&v, truth, &x.cfg) ||
                    v.id != ids[i])
                    bad++;
                k3_experts_batch_put(b, i);
            }
            k3_experts_batch_close(&b);
        }
        uint64_t want0 = (uint64_t)k3_placement_count(pl, layer, 0) * g.total;
        uint64_t want1 = (uint64_t)k3_placement_count(pl, layer, 1) * g.total;
        uint64_t got0 = k3_experts_drive_bytes(x.s, 0), got1 = k3_experts_drive_bytes(x.s, 1);
        if (split) { /* every expert from both drives, 2:1 by bytes */
            uint64_t all = (s1.misses + s2.misses) * g.total;
            CHECK(st == K3_OK && !bad && !dup && s1.misses == (uint64_t)n && got0 + got1 == all &&
                      got0 > got1 + got1 / 2 && got1 > all / 4,
                  "split, %d slot(s), depth %d: %d experts each once with their bytes (%d wrong, "
                  "%d twice), drive bytes %llu / %llu of %llu (%s)",
                  slots_of[c], depth_of[c], n, bad, dup, (unsigned long long)got0,
                  (unsigned long long)got1, (unsigned long long)all, st ? err : "ok");
        } else if (depth_of[c] > 0) {
            CHECK(st == K3_OK && k3_experts_read_depth(x.s) == depth_of[c] && !bad && !dup &&
                      s1.misses == (uint64_t)n && got0 >= want0 && got1 >= want1 &&
                      got0 + got1 == (s1.misses + s2.misses) * g.total,
                  "staged, %d slot(s), depth %d: %d experts each once with their bytes (%d wrong, "
                  "%d twice), drive bytes %llu / %llu for %d / %d experts (%s)",
                  slots_of[c], depth_of[c], n, bad, dup, (unsigned long long)got0,
                  (unsigned long long)got1, k3_placement_count(pl, layer, 0),
                  k3_placement_count(pl, layer, 1), st ? err : "ok");
            CHECK(s2.hits == (uint64_t)slots_of[c] && s2.misses == (uint64_t)(n - slots_of[c]),
                  "staged, %d slot(s): the second batch hits the %llu experts the puts kept",
                  slots_of[c], (unsigned long long)s2.hits);
        } else {
            CHECK(st == K3_OK && k3_experts_read_depth(x.s) == 0 && in_order && !bad,
                  "read depth -1: an ordinary batch, handed out in order (%s)", st ? err : "ok");
        }
        store_close(&x);
    }
    free(truth);
    k3_placement_free(&pl);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

int main(void) {
    const char *tiny = t_tiny_dir();
    char cfg_path[512];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", tiny);
    test_budget();
    if (access(cfg_path, R_OK) != 0) {
        CHECK(0, "tiny checkpoint at %s (run make tiny)", tiny);
        TEST_MAIN_END();
    }
    test_read_path(tiny);
    test_staged(tiny, 0);
    test_staged(tiny, 1);
    test_faults(tiny);
    test_history(tiny);
    test_bit_identity(tiny);
    test_history_merge(tiny);
    test_history_model(tiny); /* uses the references of test_bit_identity */
    free(g_ref4), free(g_ref1);
    TEST_MAIN_END();
}
