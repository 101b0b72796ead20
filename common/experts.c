/* common/experts.c: expert tables (where each routed expert lives) and the
 * per-layer LRU of expert bytes. See experts.h for the contract.
 *
 * The read path is deliberately simple: a miss is read synchronously while
 * the layer's mutex is held (one pread per expert when its six tensors are
 * back to back, six otherwise). Prefetch and a read pipeline belong to the
 * streaming issue and replace only acquire's miss branch.
 */
#include "experts.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#define EXP_ALIGN 4096 /* O_DIRECT alignment of buffer, offset and length */

static const char *const part_name[K3_EXP_PARTS] = {"w1.weight_packed", "w1.weight_scale",
                                                    "w2.weight_packed", "w2.weight_scale",
                                                    "w3.weight_packed", "w3.weight_scale"};

typedef struct exp_loc {
    int shard[K3_EXP_PARTS];    /* shard index of each part */
    uint64_t off[K3_EXP_PARTS]; /* absolute file offset of each part */
    uint8_t present;            /* 0: absent from the checkpoint */
    uint8_t contiguous;         /* 1: parts back to back in slot order, one shard */
} exp_loc;

typedef struct exp_slot {
    int32_t expert;     /* expert held, -1 = empty */
    int pins;           /* acquisitions not yet released */
    uint64_t last_use;  /* layer clock at last acquisition (LRU) */
    unsigned char *buf; /* owned, EXP_ALIGN-aligned, geom.total + 2*EXP_ALIGN */
    size_t data_off;    /* the expert's first byte inside buf */
} exp_slot;

typedef struct exp_layer {
    int loaded;       /* k3_experts_load_layer ran */
    exp_loc *loc;     /* [n_experts] */
    int32_t *order;   /* [n_experts] ids in disk order, missing last */
    int32_t *slot_of; /* [n_experts] slot holding the expert, -1 none */
    exp_slot *slots;  /* [n_slots] */
    int n_slots;
    uint64_t clock;     /* acquisitions so far (LRU time) */
    int warned_scale;   /* a 0/255 scale byte was reported for this layer */
    pthread_mutex_t mu; /* guards everything above except loc/order */
    pthread_cond_t cv;  /* signalled when a slot is unpinned */
} exp_layer;

struct k3_experts {
    st_index *idx; /* borrowed */
    k3_config cfg; /* copy */
    int layer_a, layer_b;
    k3_expert_geom geom;
    int direct;        /* try O_DIRECT reads */
    exp_layer *layers; /* [layer_b - layer_a] */
    pthread_mutex_t stats_mu;
    k3_expert_stats totals;
};

void k3_expert_geom_init(k3_expert_geom *g, const k3_config *cfg) {
    uint64_t inter = (uint64_t)cfg->moe_inter, lat = (uint64_t)cfg->latent;
    g->bytes[K3_EXP_W1P] = inter * lat / 2;
    g->bytes[K3_EXP_W1S] = inter * lat / 32;
    g->bytes[K3_EXP_W2P] = lat * inter / 2;
    g->bytes[K3_EXP_W2S] = lat * inter / 32;
    g->bytes[K3_EXP_W3P] = inter * lat / 2;
    g->bytes[K3_EXP_W3S] = inter * lat / 32;
    g->total = 0;
    for (int i = 0; i < K3_EXP_PARTS; i++) {
        g->layout_off[i] = g->total;
        g->total += g->bytes[i];
    }
}

/* Expected [rows, cols] (in bytes) of part i: packed nibbles are cols/2
 * bytes per row, ue8m0 scales one byte per 32 columns (spec 4.1). */
static void part_shape(const k3_config *cfg, int part, int64_t *rows, int64_t *cols) {
    int is_w2 = part == K3_EXP_W2P || part == K3_EXP_W2S;
    int is_scale = part & 1;
    int64_t r = is_w2 ? cfg->latent : cfg->moe_inter;
    int64_t c = is_w2 ? cfg->moe_inter : cfg->latent;
    *rows = r;
    *cols = is_scale ? c / 32 : c / 2;
}

/* Only the slot tables are allocated here; slot buffers are allocated on
 * first use, so a budget larger than what a run touches costs nothing. */
k3_status k3_experts_open(k3_experts **out, st_index *idx, const k3_config *cfg, int layer_a,
                          int layer_b, const k3_experts_opts *opts, char *err, size_t errlen) {
    *out = NULL;
    if (layer_a < 0 || layer_b > cfg->n_layers || layer_a >= layer_b)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "expert store: layer range [%d, %d) outside [0, %d)", layer_a, layer_b,
                       cfg->n_layers);
    k3_experts *s = k3_xcalloc(1, sizeof *s);
    s->idx = idx;
    s->cfg = *cfg;
    s->layer_a = layer_a;
    s->layer_b = layer_b;
    s->direct = opts->direct;
    k3_expert_geom_init(&s->geom, cfg);
    pthread_mutex_init(&s->stats_mu, NULL);

    int n_moe = 0;
    for (int i = layer_a; i < layer_b; i++) n_moe += cfg->is_moe[i] ? 1 : 0;
    /* The budget is split evenly over the MoE layers; the floor is one slot
     * per layer (experts are consumed one at a time), so any budget works. */
    size_t per_layer = n_moe ? opts->budget_bytes / (size_t)n_moe : 0;
    size_t slots = per_layer / (size_t)s->geom.total;
    if (slots < 1) slots = 1;
    if (slots > (size_t)cfg->n_experts) slots = (size_t)cfg->n_experts;

    s->layers = k3_xcalloc((size_t)(layer_b - layer_a), sizeof *s->layers);
    for (int i = layer_a; i < layer_b; i++) {
        exp_layer *L = &s->layers[i - layer_a];
        pthread_mutex_init(&L->mu, NULL);
        pthread_cond_init(&L->cv, NULL);
        if (!cfg->is_moe[i]) continue;
        L->n_slots = (int)slots;
        L->slots = k3_xcalloc(slots, sizeof *L->slots);
        for (size_t j = 0; j < slots; j++) L->slots[j].expert = -1;
    }
    *out = s;
    return K3_OK;
}

/* The caller guarantees no acquisition is outstanding (the model closes the
 * store after every session is done with it). */
void k3_experts_close(k3_experts **sp) {
    if (!sp || !*sp) return;
    k3_experts *s = *sp;
    for (int i = s->layer_a; i < s->layer_b; i++) {
        exp_layer *L = &s->layers[i - s->layer_a];
        for (int j = 0; j < L->n_slots; j++) free(L->slots[j].buf);
        free(L->slots);
        free(L->loc);
        free(L->order);
        free(L->slot_of);
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->cv);
    }
    free(s->layers);
    pthread_mutex_destroy(&s->stats_mu);
    free(s);
    *sp = NULL;
}

/* The layer's entry, NULL outside the store's range. */
static exp_layer *layer_of(const k3_experts *s, int layer) {
    if (layer < s->layer_a || layer >= s->layer_b) return NULL;
    return &s->layers[layer - s->layer_a];
}

/* ---- table loading ---- */

/* Sort key of the disk order. Shards are compared by file name, not by
 * their index in this process's shard table: the table depends on --dirs
 * and listing order, and two processes running the same layer must apply
 * experts in the same order to give the same bits. */
typedef struct order_key {
    const char *shard_name; /* sorted by file name so every process agrees */
    uint64_t off;
    int32_t id;
} order_key;

static int order_cmp(const void *pa, const void *pb) {
    const order_key *a = pa, *b = pb;
    int c = strcmp(a->shard_name, b->shard_name);
    if (c) return c;
    if (a->off != b->off) return a->off < b->off ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static void shape_str(const st_tensor *t, char *buf, size_t n) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, n - o, "[");
    for (int d = 0; d < t->rank && o < n; d++)
        o += (size_t)snprintf(buf + o, n - o, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

k3_status k3_experts_load_layer(k3_experts *s, const char *prefix, int layer, int *n_missing,
                                char *err, size_t errlen) {
    exp_layer *L = layer_of(s, layer);
    if (!L || !s->cfg.is_moe[layer])
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "expert store: layer %d is not a MoE layer of [%d, %d)", layer, s->layer_a,
                       s->layer_b);
    if (L->loaded) return K3_OK;
    int E = s->cfg.n_experts;
    L->loc = k3_xcalloc((size_t)E, sizeof *L->loc);
    L->order = k3_xcalloc((size_t)E, sizeof *L->order);
    L->slot_of = k3_xcalloc((size_t)E, sizeof *L->slot_of);
    order_key *keys = k3_xcalloc((size_t)E, sizeof *keys);
    int missing = 0, n_keys = 0;
    k3_status st = K3_OK;

    /* one pass over the experts: presence, dtype, byte size, shape, place */
    for (int e = 0; e < E && st == K3_OK; e++) {
        L->slot_of[e] = -1;
        const st_tensor *t[K3_EXP_PARTS];
        int present = 0;
        for (int p = 0; p < K3_EXP_PARTS; p++) {
            char name[K3_ST_MAX_NAME];
            snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s", prefix,
                     layer, e, part_name[p]);
            st = st_find_opt(s->idx, name, &t[p], err, errlen);
            if (st != K3_OK) break;
            present += t[p] != NULL;
        }
        if (st != K3_OK) break;
        if (present == 0) {
            /* absent as a whole: tolerated until the router picks it */
            missing++;
            continue;
        }
        exp_loc *loc = &L->loc[e];
        for (int p = 0; p < K3_EXP_PARTS; p++) {
            if (!t[p]) {
                st = k3_errf(K3_ERR_MISSING, err, errlen,
                             "layer %d expert %d: tensor %s is missing (%d of 6 parts present)",
                             layer, e, part_name[p], present);
                break;
            }
            int64_t rows, cols;
            part_shape(&s->cfg, p, &rows, &cols);
            char shp[96];
            shape_str(t[p], shp, sizeof shp);
            if (t[p]->dtype != ST_U8) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "layer %d expert %d: %s has dtype %s, expected U8", layer, e,
                             part_name[p], st_dtype_name(t[p]->dtype));
                break;
            }
            /* the byte size is what the kernels rely on: check it first so
             * the message states it even when the shape is also off */
            if (t[p]->nbytes != s->geom.bytes[p]) {
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "layer %d expert %d: %s is %llu bytes (shape %s), expected %llu "
                             "([%lld, %lld] from moe_intermediate_size %d, latent %d)",
                             layer, e, part_name[p], (unsigned long long)t[p]->nbytes, shp,
                             (unsigned long long)s->geom.bytes[p], (long long)rows, (long long)cols,
                             s->cfg.moe_inter, s->cfg.latent);
                break;
            }
            if (t[p]->rank != 2 || t[p]->shape[0] != rows || t[p]->shape[1] != cols) {
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "layer %d expert %d: %s has shape %s, expected [%lld, %lld]", layer, e,
                             part_name[p], shp, (long long)rows, (long long)cols);
                break;
            }
            loc->shard[p] = t[p]->shard;
            loc->off[p] = t[p]->offset;
        }
        if (st != K3_OK) break;
        /* contiguous in slot order within one shard: one read per expert */
        loc->present = 1;
        loc->contiguous = 1;
        for (int p = 1; p < K3_EXP_PARTS; p++)
            if (loc->shard[p] != loc->shard[0] ||
                loc->off[p] != loc->off[p - 1] + s->geom.bytes[p - 1])
                loc->contiguous = 0;
        keys[n_keys].shard_name = st_shard_name(s->idx, loc->shard[0]);
        keys[n_keys].off = loc->off[0];
        keys[n_keys].id = e;
        n_keys++;
    }
    /* disk order: present experts by (shard name, offset), absent ones last */
    if (st == K3_OK) {
        qsort(keys, (size_t)n_keys, sizeof *keys, order_cmp);
        int k = 0;
        for (int i = 0; i < n_keys; i++) L->order[k++] = keys[i].id;
        for (int e = 0; e < E; e++)
            if (!L->loc[e].present) L->order[k++] = e;
        if (missing)
            K3_WARN("layer %d: %d of %d experts absent from the checkpoint (a run fails if one is "
                    "selected)",
                    layer, missing, E);
        L->loaded = 1;
    }
    free(keys);
    if (n_missing) *n_missing = missing;
    return st;
}

int k3_experts_slots(const k3_experts *s, int layer) {
    exp_layer *L = layer_of(s, layer);
    return L ? L->n_slots : 0;
}

int k3_experts_disk_order(const k3_experts *s, int layer, const uint8_t *selected, int32_t *ids) {
    exp_layer *L = layer_of(s, layer);
    K3_ASSERT(L && L->loaded);
    int n = 0;
    for (int r = 0; r < s->cfg.n_experts; r++)
        if (selected[L->order[r]]) ids[n++] = L->order[r];
    return n;
}

/* ---- reads ---- */

/* Reads [off, off+len) of a shard into slot memory. With O_DIRECT the read is
 * widened to 4096-byte boundaries (buf has room) and *data_off says where
 * the wanted bytes start; the buffered fd is used when the shard has no
 * O_DIRECT fd or the widened range would pass the end of the file. */
static k3_status read_span(k3_experts *s, int shard, uint64_t off, size_t len, unsigned char *buf,
                           size_t *data_off, char *err, size_t errlen) {
    if (s->direct && st_shard_fd(s->idx, shard, 1) >= 0) {
        uint64_t a = off & ~(uint64_t)(EXP_ALIGN - 1);
        uint64_t end = (off + len + EXP_ALIGN - 1) & ~(uint64_t)(EXP_ALIGN - 1);
        if (end <= st_shard_size(s->idx, shard)) {
            k3_status st = st_pread(s->idx, shard, a, buf, (size_t)(end - a), 1, err, errlen);
            if (st == K3_OK) {
                *data_off = (size_t)(off - a);
                return K3_OK;
            }
            /* Some filesystems refuse O_DIRECT at read time; a real EIO
             * shows again on the buffered retry below. */
        }
    }
    *data_off = 0;
    return st_pread(s->idx, shard, off, buf, len, 0, err, errlen);
}

/* Reads expert e into slot (allocating its buffer on first use). Errors
 * name the layer, the expert, the part and the shard file. */
static k3_status read_expert(k3_experts *s, int layer, int32_t e, const exp_loc *loc,
                             exp_slot *slot, char *err, size_t errlen) {
    if (!slot->buf) {
        size_t n = (size_t)s->geom.total + 2 * EXP_ALIGN;
        void *p = NULL;
        if (posix_memalign(&p, EXP_ALIGN, n) != 0)
            return k3_errf(K3_ERR_NOMEM, err, errlen,
                           "layer %d expert %d: cannot allocate a %zu-byte slot", layer, e, n);
        slot->buf = p;
    }
    k3_status st;
    if (loc->contiguous) {
        st = read_span(s, loc->shard[0], loc->off[0], (size_t)s->geom.total, slot->buf,
                       &slot->data_off, err, errlen);
        if (st != K3_OK)
            k3_err_prefix(err, errlen, "layer %d expert %d (shard %s)", layer, e,
                          st_shard_name(s->idx, loc->shard[0]));
        return st;
    }
    slot->data_off = 0;
    for (int p = 0; p < K3_EXP_PARTS; p++) {
        st = st_pread(s->idx, loc->shard[p], loc->off[p], slot->buf + s->geom.layout_off[p],
                      (size_t)s->geom.bytes[p], 0, err, errlen);
        if (st != K3_OK) {
            k3_err_prefix(err, errlen, "layer %d expert %d %s (shard %s)", layer, e, part_name[p],
                          st_shard_name(s->idx, loc->shard[p]));
            return st;
        }
    }
    return K3_OK;
}

/* Points a view at the six parts inside a slot (slot layout order). */
/* Spec 8.4: scale bytes 0 and 255 decode to +0 and +inf; real shards are
 * not known to hold them. They are flagged once per layer, not refused. */
static void check_scales(k3_experts *s, exp_layer *L, int layer, int32_t e, const exp_slot *slot) {
    if (L->warned_scale) return;
    const unsigned char *b = slot->buf + slot->data_off;
    static const int parts[3] = {K3_EXP_W1S, K3_EXP_W2S, K3_EXP_W3S};
    for (int k = 0; k < 3; k++) {
        const unsigned char *p = b + s->geom.layout_off[parts[k]];
        for (uint64_t i = 0; i < s->geom.bytes[parts[k]]; i++)
            if (p[i] == 0 || p[i] == 255) {
                K3_WARN("layer %d expert %d: %s byte %llu is %d (decoded as %s; spec 8.4)", layer,
                        e, part_name[parts[k]], (unsigned long long)i, p[i], p[i] ? "+inf" : "+0");
                L->warned_scale = 1;
                return;
            }
    }
}

static void fill_view(const k3_experts *s, const exp_slot *slot, int32_t e, k3_expert_view *v) {
    const unsigned char *b = slot->buf + slot->data_off;
    const k3_expert_geom *g = &s->geom;
    v->id = e;
    v->w1 = (k3_mxfp4){b + g->layout_off[K3_EXP_W1P], b + g->layout_off[K3_EXP_W1S],
                       s->cfg.moe_inter, s->cfg.latent};
    v->w2 = (k3_mxfp4){b + g->layout_off[K3_EXP_W2P], b + g->layout_off[K3_EXP_W2S], s->cfg.latent,
                       s->cfg.moe_inter};
    v->w3 = (k3_mxfp4){b + g->layout_off[K3_EXP_W3P], b + g->layout_off[K3_EXP_W3S],
                       s->cfg.moe_inter, s->cfg.latent};
}

static int in_list(const int32_t *ids, int n, int32_t e) {
    for (int i = 0; i < n; i++)
        if (ids[i] == e) return 1;
    return 0;
}

/* Arguments are checked before the lock: an id out of range or an absent
 * expert fails without touching the cache. Under the lock: wait for enough
 * unpinned slots, pin the hits, then read the misses into LRU victims. */
k3_status k3_experts_acquire(k3_experts *s, int layer, const int32_t *ids, int n,
                             k3_expert_view *views, k3_expert_stats *stats, char *err,
                             size_t errlen) {
    exp_layer *L = layer_of(s, layer);
    if (!L || !L->loaded)
        return k3_errf(K3_ERR_ARG, err, errlen, "expert store: layer %d has no expert table",
                       layer);
    if (n < 0 || n > L->n_slots)
        return k3_errf(K3_ERR_ARG, err, errlen, "layer %d: %d experts asked at once, %d slots",
                       layer, n, L->n_slots);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= s->cfg.n_experts)
            return k3_errf(K3_ERR_ARG, err, errlen, "layer %d: expert id %d outside [0, %d)", layer,
                           ids[i], s->cfg.n_experts);
        if (!L->loc[ids[i]].present)
            return k3_errf(
                K3_ERR_MISSING, err, errlen,
                "layer %d expert %d: selected by the router but absent from the checkpoint", layer,
                ids[i]);
    }
    k3_expert_stats local = {0};
    double t0 = k3_now_ms();
    pthread_mutex_lock(&L->mu);
    /* All or nothing: wait until every miss can get an unpinned slot that
     * holds none of the requested experts. */
    for (;;) {
        int need = 0, avail = 0;
        for (int i = 0; i < n; i++) need += L->slot_of[ids[i]] < 0;
        for (int j = 0; j < L->n_slots; j++) {
            exp_slot *sl = &L->slots[j];
            if (sl->pins == 0 && (sl->expert < 0 || !in_list(ids, n, sl->expert))) avail++;
        }
        if (need <= avail) break;
        pthread_cond_wait(&L->cv, &L->mu);
    }
    /* Hits first, so a miss below never evicts an expert of this request. */
    uint8_t *pinned = k3_xcalloc((size_t)(n ? n : 1), 1); /* pinned by this call */
    for (int i = 0; i < n; i++) {
        int j = L->slot_of[ids[i]];
        if (j < 0) continue;
        L->slots[j].pins++;
        L->slots[j].last_use = ++L->clock;
        fill_view(s, &L->slots[j], ids[i], &views[i]);
        pinned[i] = 1;
        local.hits++;
    }
    k3_status st = K3_OK;
    for (int i = 0; i < n && st == K3_OK; i++) {
        if (pinned[i]) continue;
        /* victim: an empty slot, else the least recently used unpinned one */
        int v = -1;
        for (int j = 0; j < L->n_slots; j++) {
            exp_slot *sl = &L->slots[j];
            if (sl->pins) continue;
            if (sl->expert < 0) {
                v = j;
                break;
            }
            if (v < 0 || sl->last_use < L->slots[v].last_use) v = j;
        }
        K3_ASSERT(v >= 0); /* guaranteed by the wait above */
        exp_slot *sl = &L->slots[v];
        if (sl->expert >= 0) L->slot_of[sl->expert] = -1;
        sl->expert = -1;
        st = read_expert(s, layer, ids[i], &L->loc[ids[i]], sl, err, errlen);
        if (st != K3_OK) break; /* the slot stays empty */
        check_scales(s, L, layer, ids[i], sl);
        sl->expert = ids[i];
        sl->pins = 1;
        sl->last_use = ++L->clock;
        L->slot_of[ids[i]] = v;
        fill_view(s, sl, ids[i], &views[i]);
        pinned[i] = 1;
        local.misses++;
        local.bytes += s->geom.total;
    }
    if (st != K3_OK) {
        for (int i = 0; i < n; i++)
            if (pinned[i]) L->slots[L->slot_of[ids[i]]].pins--;
        pthread_cond_broadcast(&L->cv);
    }
    free(pinned);
    pthread_mutex_unlock(&L->mu);
    /* counters: the caller's step stats and the store's totals */
    local.read_ms = k3_now_ms() - t0;
    if (stats) {
        stats->hits += local.hits;
        stats->misses += local.misses;
        stats->bytes += local.bytes;
        stats->read_ms += local.read_ms;
    }
    pthread_mutex_lock(&s->stats_mu);
    s->totals.hits += local.hits;
    s->totals.misses += local.misses;
    s->totals.bytes += local.bytes;
    s->totals.read_ms += local.read_ms;
    pthread_mutex_unlock(&s->stats_mu);
    return st;
}

/* Releasing something not acquired is a bug in the caller: asserted. */
void k3_experts_release(k3_experts *s, int layer, const int32_t *ids, int n) {
    exp_layer *L = layer_of(s, layer);
    K3_ASSERT(L && L->loaded);
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < n; i++) {
        K3_ASSERT(ids[i] >= 0 && ids[i] < s->cfg.n_experts);
        int j = L->slot_of[ids[i]];
        K3_ASSERT(j >= 0 && L->slots[j].pins > 0);
        L->slots[j].pins--;
    }
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

void k3_experts_totals(k3_experts *s, k3_expert_stats *out) {
    pthread_mutex_lock(&s->stats_mu);
    *out = s->totals;
    pthread_mutex_unlock(&s->stats_mu);
}

size_t k3_experts_resident_bytes(k3_experts *s) {
    size_t total = 0;
    for (int i = s->layer_a; i < s->layer_b; i++) {
        exp_layer *L = &s->layers[i - s->layer_a];
        pthread_mutex_lock(&L->mu);
        for (int j = 0; j < L->n_slots; j++)
            if (L->slots[j].buf) total += (size_t)s->geom.total + 2 * EXP_ALIGN;
        pthread_mutex_unlock(&L->mu);
    }
    return total;
}
