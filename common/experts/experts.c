/* common/experts/experts.c: expert tables (where each routed expert lives), the
 * per-layer LRU of slots under a byte budget, and batches: the window of a
 * step's experts that are pinned or being read. See experts.h for the
 * contract; the read path and loader threads are in expert_io.c, the usage
 * history in expert_usage.c.
 *
 * The window: a batch admits its experts in order (disk order), each taking
 * one slot: a hit pins the slot holding it, a miss takes a victim slot
 * (pick_victim: empty first, then the least recently used unpinned one not
 * needed by this batch, and only when there is none and the batch holds at
 * most one other, the one this batch needs last) and queues its read. At most
 * n_slots experts of a batch are admitted and not yet put, so the memory in
 * use never exceeds the budget; with one slot per layer there is no overlap
 * (read, compute, read, ...), with s slots up to s-1 reads run while one
 * expert computes.
 *
 * Any-order batches on a striped store (k3_experts_batch_open_any with a
 * placement of >= 2 drives): the hits are pinned at open and each miss is
 * read into a staging entry of the batch, up to read_depth per drive at
 * once (admit_staged), so every drive reads its share back to back
 * whatever the number of slots; the consumer takes the ready ones first
 * (k3_experts_batch_next) and a put swaps the staging buffer into a slot
 * the batch does not need (put_staged). The staging buffers come from a
 * pool of the store (stage_take / stage_give).
 *
 * Not handled: two batches on the same layer at once share its slots and
 * may wait on each other's unpins (always progressing: a batch that holds a
 * slot has its next expert admitted); a read failed by one batch fails the
 * other batches that joined the same slot while it was being read.
 */
#include "common/experts/experts_int.h"
#include "common/experts/placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/log.h"

const char *const k3_exp_part_name[K3_EXP_PARTS] = {"w1.weight_packed", "w1.weight_scale",
                                                    "w2.weight_packed", "w2.weight_scale",
                                                    "w3.weight_packed", "w3.weight_scale"};

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
 * bytes per row, ue8m0 scales one byte per 32 columns (docs/MODEL.md 4.1). */
static void part_shape(const k3_config *cfg, int part, int64_t *rows, int64_t *cols) {
    int is_w2 = part == K3_EXP_W2P || part == K3_EXP_W2S;
    int is_scale = part & 1;
    int64_t r = is_w2 ? cfg->latent : cfg->moe_inter;
    int64_t c = is_w2 ? cfg->moe_inter : cfg->latent;
    *rows = r;
    *cols = is_scale ? c / 32 : c / 2;
}

/* MemAvailable from /proc/meminfo in bytes, 0 when unknown. */
static uint64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024u;
}

/* Only the slot tables are allocated here; slot buffers are allocated on
 * first read, so a budget larger than what a run touches costs nothing.
 *
 * Budget (docs/MODEL.md 5.3): slots per layer =
 * budget / (n_moe * slot_bytes), clamped to [1, n_experts]. The slots may
 * use at most 88% of the available memory: a larger budget is lowered, and
 * when even one slot per layer does not fit the open fails, saying how much
 * is needed. */
k3_status k3_experts_open(k3_experts **out, st_index *idx, const k3_config *cfg, int layer_a,
                          int layer_b, const k3_experts_opts *opts, char *err, size_t errlen) {
    *out = NULL;
    if (layer_a < 0 || layer_b > cfg->n_layers || layer_a >= layer_b)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "expert store: layer range [%d, %d) outside [0, %d)", layer_a, layer_b,
                       cfg->n_layers);
    int threads = opts->load_threads ? opts->load_threads : 4;
    if (threads < 1 || threads > K3_MAX_LOAD_THREADS)
        return k3_errf(K3_ERR_ARG, err, errlen, "expert store: %d load threads outside [1, %d]",
                       threads, K3_MAX_LOAD_THREADS);
    k3_expert_geom geom;
    k3_expert_geom_init(&geom, cfg);
    size_t slot_bytes = (size_t)geom.total + 2 * EXP_ALIGN;
    slot_bytes = (slot_bytes + EXP_ALIGN - 1) & ~(size_t)(EXP_ALIGN - 1);

    int n_moe = 0;
    for (int i = layer_a; i < layer_b; i++) n_moe += cfg->is_moe[i] ? 1 : 0;
    uint64_t avail = opts->mem_available ? opts->mem_available : mem_available();
    uint64_t usable = (uint64_t)((double)avail * 0.88);
    uint64_t floor_bytes = (uint64_t)n_moe * slot_bytes; /* one slot per MoE layer */
    if (n_moe && avail && floor_bytes > usable)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "expert store: layers [%d, %d) need at least %.2f GB for experts (1 slot "
                       "x %d MoE layers x %.2f MB per expert), but only %.2f GB is usable (88%% "
                       "of %.2f GB MemAvailable); give this process fewer layers or free memory",
                       layer_a, layer_b, (double)floor_bytes / 1e9, n_moe, (double)slot_bytes / 1e6,
                       (double)usable / 1e9, (double)avail / 1e9);
    size_t slots = n_moe ? opts->budget_bytes / ((size_t)n_moe * slot_bytes) : 0;
    if (n_moe && slots < 1) {
        K3_INFO("expert store: budget %.3f GB is below one slot per MoE layer; using the floor "
                "of %.3f GB (%d layers x %.2f MB)",
                (double)opts->budget_bytes / 1e9, (double)floor_bytes / 1e9, n_moe,
                (double)slot_bytes / 1e6);
        slots = 1;
    }
    if (slots > (size_t)cfg->n_experts) slots = (size_t)cfg->n_experts;
    if (n_moe && avail && (uint64_t)slots * floor_bytes > usable) {
        size_t fit = (size_t)(usable / floor_bytes);
        K3_WARN("expert store: budget %.2f GB (%zu slots/layer) exceeds 88%% of MemAvailable "
                "(%.2f GB); lowered to %zu slots/layer (%.2f GB)",
                (double)opts->budget_bytes / 1e9, slots, (double)avail / 1e9, fit,
                (double)fit * (double)floor_bytes / 1e9);
        slots = fit;
    }

    k3_experts *s = k3_xcalloc(1, sizeof *s);
    s->idx = idx;
    s->cfg = *cfg;
    s->layer_a = layer_a;
    s->layer_b = layer_b;
    s->geom = geom;
    s->slot_bytes = slot_bytes;
    s->direct = opts->direct;
    s->pipe = opts->pipe;
    if (opts->placement && opts->drive_mask && k3_placement_split(opts->placement))
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "expert store: placement %s is byte-split (every expert on every drive): "
                       "serving some of its drives to other workers needs an expert-grained "
                       "placement (k3-coordinator place without --split)",
                       k3_placement_path(opts->placement));
    s->placement = opts->placement;
    s->drive_mask = opts->drive_mask;
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_mutex_init(&s->stage_mu, NULL);
    int n_drives = opts->placement ? k3_placement_drives(opts->placement) : 1;
    if (n_drives >= 2 && opts->read_depth >= 0 && opts->pipe) {
        s->read_depth = opts->read_depth ? opts->read_depth : 2;
        if (s->read_depth > K3_MAX_LOAD_THREADS) s->read_depth = K3_MAX_LOAD_THREADS;
        s->stage_cap = n_drives * s->read_depth * 2;
        s->stage_free = k3_xcalloc((size_t)s->stage_cap, sizeof *s->stage_free);
        K3_INFO("expert store: %d reads in flight per drive (%d drives), staging buffers of "
                "%.1f MB outside the cache, %.2f GB per batch",
                s->read_depth, n_drives, (double)slot_bytes / 1e6,
                (double)n_drives * s->read_depth * (double)slot_bytes / 1e9);
    }
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
    k3_status st = n_moe ? exp_loaders_start(s, threads, err, errlen) : K3_OK;
    if (st != K3_OK) {
        k3_experts_close(&s);
        return st;
    }
    *out = s;
    return K3_OK;
}

/* The caller guarantees no batch is open (the model closes the store after
 * every session is done with it). */
void k3_experts_close(k3_experts **sp) {
    if (!sp || !*sp) return;
    k3_experts *s = *sp;
    exp_loaders_stop(s);
    exp_stripe_close(s);
    for (int i = s->layer_a; i < s->layer_b; i++) {
        exp_layer *L = &s->layers[i - s->layer_a];
        for (int j = 0; j < L->n_slots; j++) free(L->slots[j].buf);
        free(L->slots);
        free(L->loc);
        free(L->order);
        free(L->rank);
        free(L->slot_of);
        free(L->usage);
        free(L->usage_base);
        pthread_mutex_destroy(&L->mu);
        pthread_cond_destroy(&L->cv);
    }
    free(s->layers);
    for (int i = 0; i < s->n_stage_free; i++) free(s->stage_free[i]);
    free(s->stage_free);
    pthread_mutex_destroy(&s->stage_mu);
    pthread_mutex_destroy(&s->stats_mu);
    free(s);
    *sp = NULL;
}

/* The layer's entry, NULL outside the store's range. */
exp_layer *exp_layer_of(const k3_experts *s, int layer) {
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
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !s->cfg.is_moe[layer])
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "expert store: layer %d is not a MoE layer of [%d, %d)", layer, s->layer_a,
                       s->layer_b);
    if (L->loaded) return K3_OK;
    int E = s->cfg.n_experts;
    L->loc = k3_xcalloc((size_t)E, sizeof *L->loc);
    L->order = k3_xcalloc((size_t)E, sizeof *L->order);
    L->slot_of = k3_xcalloc((size_t)E, sizeof *L->slot_of);
    L->rank = k3_xcalloc((size_t)E, sizeof *L->rank);
    L->usage = k3_xcalloc((size_t)E, sizeof *L->usage);
    L->usage_base = k3_xcalloc((size_t)E, sizeof *L->usage_base);
    order_key *keys = k3_xcalloc((size_t)E, sizeof *keys);
    int missing = 0, n_keys = 0;
    k3_status st = K3_OK;

    /* one pass over the experts: presence, dtype, byte size, shape, place */
    for (int e = 0; e < E && st == K3_OK; e++) {
        L->slot_of[e] = -1;
        L->loc[e].drive = -1;
        const st_tensor *t[K3_EXP_PARTS];
        int present = 0;
        for (int p = 0; p < K3_EXP_PARTS; p++) {
            char name[K3_ST_MAX_NAME];
            snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s", prefix,
                     layer, e, k3_exp_part_name[p]);
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
                             layer, e, k3_exp_part_name[p], present);
                break;
            }
            int64_t rows, cols;
            part_shape(&s->cfg, p, &rows, &cols);
            char shp[96];
            shape_str(t[p], shp, sizeof shp);
            if (t[p]->dtype != ST_U8) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "layer %d expert %d: %s has dtype %s, expected U8", layer, e,
                             k3_exp_part_name[p], st_dtype_name(t[p]->dtype));
                break;
            }
            /* the byte size is what the kernels rely on: check it first so
             * the message states it even when the shape is also off */
            if (t[p]->nbytes != s->geom.bytes[p]) {
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "layer %d expert %d: %s is %llu bytes (shape %s), expected %llu "
                             "([%lld, %lld] from moe_intermediate_size %d, latent %d)",
                             layer, e, k3_exp_part_name[p], (unsigned long long)t[p]->nbytes, shp,
                             (unsigned long long)s->geom.bytes[p], (long long)rows, (long long)cols,
                             s->cfg.moe_inter, s->cfg.latent);
                break;
            }
            if (t[p]->rank != 2 || t[p]->shape[0] != rows || t[p]->shape[1] != cols) {
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "layer %d expert %d: %s has shape %s, expected [%lld, %lld]", layer, e,
                             k3_exp_part_name[p], shp, (long long)rows, (long long)cols);
                break;
            }
            loc->shard[p] = t[p]->shard;
            loc->off[p] = t[p]->offset;
        }
        if (st != K3_OK) break;
        /* striped: read from the placement drive's copies of the same shards */
        loc->drive = s->placement ? (int16_t)k3_placement_drive_of(s->placement, layer, e) : -1;
        int own = loc->drive < 0 || !s->drive_mask || (s->drive_mask >> loc->drive & 1u);
        for (int p = 0; p < K3_EXP_PARTS && loc->drive >= 0 && own && st == K3_OK; p++)
            st = exp_stripe_open(s, loc->drive, loc->shard[p], layer, e, err, errlen);
        if (st != K3_OK) break;
        /* contiguous in slot order within one shard: one read per expert */
        loc->present = 1;
        loc->contiguous = 1;
        for (int p = 1; p < K3_EXP_PARTS; p++)
            if (loc->shard[p] != loc->shard[0] ||
                loc->off[p] != loc->off[p - 1] + s->geom.bytes[p - 1])
                loc->contiguous = 0;
        /* byte-split: a piece on every drive; each drive holding one opens
         * its copy of the shard now (a missing or short file is refused at
         * start) */
        loc->split = s->placement && k3_placement_split(s->placement);
        for (int d = 0; loc->split && d < k3_placement_drives(s->placement) && st == K3_OK; d++)
            for (int p = 0; p < (loc->contiguous ? 1 : K3_EXP_PARTS) && st == K3_OK; p++) {
                uint64_t lo, hi;
                k3_placement_piece(s->placement, d, loc->off[p],
                                   loc->contiguous ? s->geom.total : s->geom.bytes[p], &lo, &hi);
                if (hi > lo) st = exp_stripe_open(s, d, loc->shard[p], layer, e, err, errlen);
            }
        if (st != K3_OK) break;
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
        for (int r = 0; r < E; r++) L->rank[L->order[r]] = r;
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

size_t k3_experts_slot_bytes(const k3_experts *s) { return s->slot_bytes; }

int k3_experts_slots(const k3_experts *s, int layer) {
    exp_layer *L = exp_layer_of(s, layer);
    return L ? L->n_slots : 0;
}

int k3_experts_disk_order(const k3_experts *s, int layer, const uint8_t *selected, int32_t *ids) {
    exp_layer *L = exp_layer_of(s, layer);
    K3_ASSERT(L && L->loaded);
    int n = 0;
    for (int r = 0; r < s->cfg.n_experts; r++)
        if (selected[L->order[r]]) ids[n++] = L->order[r];
    return n;
}

/* ---- views ---- */

/* docs/MODEL.md 8.4: scale bytes 0 and 255 decode to +0 and +inf; real shards are
 * not known to hold them. The first one is found by the loader (outside
 * any lock) and reported once per layer, not refused. Returns 1 and where
 * when one is found. */
static int scan_scales(const k3_experts *s, const exp_slot *slot, int *part, uint64_t *at,
                       int *val) {
    const unsigned char *b = slot->buf + slot->data_off;
    static const int parts[3] = {K3_EXP_W1S, K3_EXP_W2S, K3_EXP_W3S};
    for (int k = 0; k < 3; k++) {
        const unsigned char *p = b + s->geom.layout_off[parts[k]];
        for (uint64_t i = 0; i < s->geom.bytes[parts[k]]; i++)
            if (p[i] == 0 || p[i] == 255) {
                *part = parts[k], *at = i, *val = p[i];
                return 1;
            }
    }
    return 0;
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

int k3_experts_cached(k3_experts *s, int layer, int32_t e) {
    exp_layer *L = s ? exp_layer_of(s, layer) : NULL;
    if (!L || !L->loaded || e < 0 || e >= s->cfg.n_experts) return 0;
    pthread_mutex_lock(&L->mu);
    int j = L->slot_of[e];
    int r = j >= 0 && L->slots[j].state != EXP_SLOT_FAILED;
    pthread_mutex_unlock(&L->mu);
    return r;
}

/* ---- batches ---- */

/* Victim slot for a miss of a batch: an unpinned slot, empty first, then
 * the least recently used one holding an expert the batch does not need
 * (any more), then, of the experts it still needs, the one it needs last
 * (Belady: that hit is the furthest away). *cls_out: 0 empty, 1 not needed,
 * 2 needed later. -1 when every slot is pinned. Unpinned slots are never
 * LOADING (the reading batch pins it) nor FAILED (reset on the last unpin).
 * Caller holds L->mu.
 *
 * Why not plain LRU: a prefill chunk's union of experts often exceeds the
 * slots, and consecutive chunks walk it in the same (disk) order. LRU then
 * evicts each expert just before the next chunk needs it (0 hits); keeping
 * the ones needed last turns slots - 1 of them into hits. */
static int pick_victim(const exp_layer *L, const int32_t *wanted, int *cls_out) {
    int best = -1, best_class = 3;
    uint64_t best_key = 0;
    for (int j = 0; j < L->n_slots; j++) {
        const exp_slot *sl = &L->slots[j];
        if (sl->pins) continue;
        int cls = sl->expert < 0 ? 0 : wanted[sl->expert] ? 2 : 1;
        /* class 1: oldest use first; class 2: latest position first */
        uint64_t key = cls == 2 ? UINT64_MAX - (uint64_t)wanted[sl->expert] : sl->last_use;
        if (cls < best_class || (cls == best_class && key < best_key)) {
            best = j, best_class = cls, best_key = key;
        }
    }
    *cls_out = best_class;
    return best;
}

static void unpin(exp_layer *L, int j) {
    exp_slot *sl = &L->slots[j];
    K3_ASSERT(sl->pins > 0);
    if (--sl->pins == 0 && sl->state == EXP_SLOT_FAILED) {
        sl->expert = -1; /* slot_of was cleared when the read failed */
        sl->state = EXP_SLOT_EMPTY;
    }
}

/* A miss whose destination (slot or staging buffer) is set: counted, the
 * read window's clock started, the read queued on its drive. Caller holds
 * L->mu. */
static void start_read(k3_expert_batch *b, exp_item *it) {
    it->miss = 1;
    it->reading = 1;
    if (b->reads_in_flight++ == 0) b->io_t0 = k3_now_ms();
    exp_advise(b->s, &b->L->loc[it->id]);
    exp_queue_read(b->s, it);
}

/* Admits the batch's next experts while it holds fewer than n_slots: a hit
 * pins its slot, a miss takes a victim and queues its read (disk order is
 * the admission order). With K3_PIPE=0 a new block is admitted only when
 * the previous one is all put, and get waits for the whole block. Caller
 * holds L->mu. */
static void admit_staged(k3_expert_batch *b);

static void admit(k3_expert_batch *b) {
    exp_layer *L = b->L;
    k3_experts *s = b->s;
    if (b->staged) {
        admit_staged(b);
        return;
    }
    if (!s->pipe && b->held > 0) return;
    while (b->next_admit < b->n && b->held < L->n_slots) {
        exp_item *it = &b->items[b->next_admit];
        int j = L->slot_of[it->id];
        if (j >= 0) {
            /* a hit, possibly still being read for another batch: get
             * waits for its state like for our own reads */
            L->slots[j].pins++;
            L->slots[j].last_use = ++L->clock;
            it->slot = j;
            b->st.hits++;
        } else {
            int cls;
            int v = pick_victim(L, b->wanted, &cls);
            if (v < 0) break; /* other batches hold every slot: retried on their unpins */
            /* one read ahead of the expert computing keeps the drive busy;
             * deeper read-ahead would cost this batch's own later hits, so
             * that victim is taken only while at most one is held */
            if (cls == 2 && b->held > 1) break; /* retried on our next put */
            exp_slot *sl = &L->slots[v];
            if (sl->expert >= 0) L->slot_of[sl->expert] = -1;
            sl->expert = it->id;
            sl->state = EXP_SLOT_LOADING;
            sl->pins = 1;
            sl->last_use = ++L->clock;
            L->slot_of[it->id] = v;
            it->slot = v;
            start_read(b, it);
        }
        L->usage[it->id]++;
        it->admitted = 1;
        b->held++;
        b->next_admit++;
    }
}

/* ---- the staging pool (any-order batches on a striped store) ---- */

/* A reservation of one staging buffer: *buf a free one, or NULL for the
 * loader to allocate. Refused (0) past stage_cap unless force (a batch
 * holding none, so that it always progresses). */
static int stage_take(k3_experts *s, unsigned char **buf, int force) {
    pthread_mutex_lock(&s->stage_mu);
    int ok = 1;
    *buf = NULL;
    if (s->n_stage_free > 0)
        *buf = s->stage_free[--s->n_stage_free];
    else if (s->stage_bufs < s->stage_cap || force)
        s->stage_bufs++;
    else
        ok = 0;
    pthread_mutex_unlock(&s->stage_mu);
    return ok;
}

/* Returns a reservation: its buffer kept for reuse while the pool has room. */
static void stage_give(k3_experts *s, unsigned char *buf) {
    pthread_mutex_lock(&s->stage_mu);
    if (buf && s->n_stage_free < s->stage_cap && s->stage_bufs <= s->stage_cap) {
        s->stage_free[s->n_stage_free++] = buf;
        buf = NULL;
    } else {
        s->stage_bufs--;
    }
    pthread_mutex_unlock(&s->stage_mu);
    free(buf);
}

/* Admission of a staged batch: every hit pinned, each miss into a free
 * staging entry of its drive (read_depth per drive), queued in the batch's
 * order. Caller holds L->mu. */
static void admit_staged(k3_expert_batch *b) {
    exp_layer *L = b->L;
    k3_experts *s = b->s;
    const int Q = s->read_depth;
    int held_res = 0;
    for (int k = 0; k < k3_experts_drives(s) * Q; k++) held_res += b->stg_res[k];
    for (int i = b->next_admit; i < b->n; i++) {
        exp_item *it = &b->items[i];
        if (it->admitted) {
            if (i == b->next_admit) b->next_admit++;
            continue;
        }
        int j = L->slot_of[it->id];
        if (j >= 0) { /* a hit (maybe still being read for another batch) */
            L->slots[j].pins++;
            L->slots[j].last_use = ++L->clock;
            it->slot = j;
            b->st.hits++;
        } else {
            int d = L->loc[it->id].drive < 0 ? 0 : L->loc[it->id].drive;
            if (L->loc[it->id].split) /* reads every drive: any drive's free entries */
                for (d = 0; d < k3_experts_drives(s) - 1 && b->stg_used[d] >= Q; d++) {
                }
            if (b->stg_used[d] >= Q) continue; /* this drive has its reads: later */
            int k = d * Q;
            while (b->stg_on[k]) k++;
            if (!b->stg_res[k]) {
                if (!stage_take(s, &b->stg[k].buf, held_res == 0)) continue;
                b->stg_res[k] = 1;
                held_res++;
            }
            exp_slot *sl = &b->stg[k];
            sl->expert = it->id;
            sl->state = EXP_SLOT_LOADING;
            b->stg_on[k] = 1;
            b->stg_used[d]++;
            it->stg = k;
            start_read(b, it);
        }
        L->usage[it->id]++;
        it->admitted = 1;
        b->held++;
        if (i == b->next_admit) b->next_admit++;
    }
}

/* A staged expert is done with: into a slot the batch does not need (its
 * buffer swapped with the slot's, the slot's old one stays in the entry),
 * unless the layer holds it already or every such slot is pinned; the
 * entry is free again. Caller holds L->mu; b->wanted[id] is cleared. */
static void put_staged(k3_expert_batch *b, exp_item *it) {
    exp_layer *L = b->L;
    exp_slot *e = &b->stg[it->stg];
    int d = it->stg / b->s->read_depth;
    if (e->state == EXP_SLOT_READY && L->slot_of[it->id] < 0) {
        int cls;
        int v = pick_victim(L, b->wanted, &cls);
        if (v >= 0 && cls <= 1) {
            exp_slot *sl = &L->slots[v];
            if (sl->expert >= 0) L->slot_of[sl->expert] = -1;
            unsigned char *old = sl->buf;
            sl->buf = e->buf;
            sl->data_off = e->data_off;
            sl->expert = it->id;
            sl->state = EXP_SLOT_READY;
            sl->last_use = ++L->clock;
            L->slot_of[it->id] = v;
            e->buf = old;
            if (!old) { /* the reservation's buffer now belongs to the cache */
                stage_give(b->s, NULL);
                b->stg_res[it->stg] = 0;
            }
        }
    }
    e->expert = -1;
    e->state = EXP_SLOT_EMPTY;
    b->stg_on[it->stg] = 0;
    b->stg_used[d]--;
}

void exp_read_done(exp_item *it, k3_status st, double t0_ms, double t1_ms) {
    k3_expert_batch *b = it->b;
    k3_experts *s = b->s;
    exp_layer *L = b->L;
    exp_slot *sl = exp_item_slot(it);
    int part = 0, val = 0, bad = 0;
    uint64_t at = 0;
    if (st == K3_OK) bad = scan_scales(s, sl, &part, &at, &val);
    pthread_mutex_lock(&L->mu);
    it->st = st;
    it->reading = 0;
    if (st == K3_OK) {
        sl->state = EXP_SLOT_READY;
        b->st.misses++;
        b->st.bytes += s->geom.total;
    } else {
        sl->state = EXP_SLOT_FAILED; /* emptied when its last pin goes */
        if (it->stg < 0) L->slot_of[it->id] = -1;
    }
    if (bad && !L->warned_scale) {
        L->warned_scale = 1;
        K3_WARN("layer %d expert %d: %s byte %llu is %d (decoded as %s; docs/MODEL.md 8.4)",
                b->layer, it->id, k3_exp_part_name[part], (unsigned long long)at, val,
                val ? "+inf" : "+0");
    }
    b->st.busy_ms += t1_ms - t0_ms;
    if (--b->reads_in_flight == 0) b->st.io_ms += t1_ms - b->io_t0;
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

static k3_status batch_open(k3_expert_batch **out, k3_experts *s, int layer, const int32_t *ids,
                            int n, int unordered, k3_expert_stats *stats, char *err,
                            size_t errlen) {
    *out = NULL;
    exp_layer *L = s ? exp_layer_of(s, layer) : NULL;
    if (!L || !L->loaded)
        return k3_errf(K3_ERR_ARG, err, errlen, "expert store: layer %d has no expert table",
                       layer);
    int E = s->cfg.n_experts;
    if (n < 0 || n > E)
        return k3_errf(K3_ERR_ARG, err, errlen, "layer %d: batch of %d experts outside [0, %d]",
                       layer, n, E);
    int32_t *wanted = k3_xcalloc((size_t)E, sizeof *wanted);
    for (int i = 0; i < n; i++) {
        k3_status st = K3_OK;
        if (ids[i] < 0 || ids[i] >= E)
            st = k3_errf(K3_ERR_ARG, err, errlen, "layer %d: expert id %d outside [0, %d)", layer,
                         ids[i], E);
        else if (wanted[ids[i]])
            st = k3_errf(K3_ERR_ARG, err, errlen, "layer %d: expert %d twice in one batch", layer,
                         ids[i]);
        else if (!L->loc[ids[i]].present)
            st =
                k3_errf(K3_ERR_MISSING, err, errlen,
                        "layer %d expert %d: selected by the router but absent from the checkpoint",
                        layer, ids[i]);
        if (st != K3_OK) {
            free(wanted);
            return st;
        }
        wanted[ids[i]] = i + 1;
    }
    k3_expert_batch *b = k3_xcalloc(1, sizeof *b);
    b->s = s;
    b->L = L;
    b->layer = layer;
    b->n = n;
    b->wanted = wanted;
    b->out = stats;
    b->items = k3_xcalloc((size_t)(n ? n : 1), sizeof *b->items);
    for (int i = 0; i < n; i++) {
        b->items[i].id = ids[i];
        b->items[i].slot = -1;
        b->items[i].stg = -1;
        b->items[i].b = b;
    }
    b->unordered = unordered;
    b->staged = unordered && s->read_depth > 0;
    if (b->staged) {
        size_t ne = (size_t)k3_experts_drives(s) * (size_t)s->read_depth;
        b->stg = k3_xcalloc(ne, sizeof *b->stg);
        b->stg_on = k3_xcalloc(ne, 1);
        b->stg_res = k3_xcalloc(ne, 1);
        for (size_t k = 0; k < ne; k++) b->stg[k].expert = -1;
    }
    pthread_mutex_lock(&L->mu);
    admit(b);
    pthread_mutex_unlock(&L->mu);
    *out = b;
    return K3_OK;
}

k3_status k3_experts_batch_open(k3_expert_batch **out, k3_experts *s, int layer, const int32_t *ids,
                                int n, k3_expert_stats *stats, char *err, size_t errlen) {
    return batch_open(out, s, layer, ids, n, 0, stats, err, errlen);
}

k3_status k3_experts_batch_open_any(k3_expert_batch **out, k3_experts *s, int layer,
                                    const int32_t *ids, int n, k3_expert_stats *stats, char *err,
                                    size_t errlen) {
    return batch_open(out, s, layer, ids, n, 1, stats, err, errlen);
}

int k3_experts_read_depth(const k3_experts *s) { return s->read_depth; }

/* What an item that is no longer loading gives the caller: its own read's
 * error, the error of a concurrent request's read of the same slot, or the
 * view of the ready slot. Caller holds L->mu. */
static k3_status item_view(const k3_expert_batch *b, const exp_item *it, const exp_slot *sl,
                           k3_expert_view *view, char *err, size_t errlen) {
    if (it->miss && it->st != K3_OK) return k3_errf(it->st, err, errlen, "%s", it->err);
    if (sl->state != EXP_SLOT_READY)
        return k3_errf(K3_ERR_IO, err, errlen,
                       "layer %d expert %d: the read started by a concurrent request failed",
                       b->layer, it->id);
    fill_view(b->s, sl, it->id, view);
    return K3_OK;
}

k3_status k3_experts_batch_get(k3_expert_batch *b, int i, k3_expert_view *view, char *err,
                               size_t errlen) {
    K3_ASSERT(b && i == b->next_get && i < b->n);
    exp_layer *L = b->L;
    exp_item *it = &b->items[i];
    double t0 = k3_now_ms();
    pthread_mutex_lock(&L->mu);
    for (;;) {
        admit(b);
        if (it->slot >= 0 && L->slots[it->slot].state != EXP_SLOT_LOADING &&
            (b->s->pipe || b->reads_in_flight == 0))
            break;
        pthread_cond_wait(&L->cv, &L->mu);
    }
    b->st.read_ms += k3_now_ms() - t0;
    exp_slot *sl = &L->slots[it->slot];
    k3_status st = item_view(b, it, sl, view, err, errlen);
    if (st == K3_OK) {
        b->next_get++;
        it->got = 1;
        b->n_got++;
    }
    pthread_mutex_unlock(&L->mu);
    return st;
}

k3_status k3_experts_batch_next(k3_expert_batch *b, int *i, k3_expert_view *view, char *err,
                                size_t errlen) {
    if (!b->staged) {
        *i = b->next_get;
        return k3_experts_batch_get(b, *i, view, err, errlen);
    }
    K3_ASSERT(b->n_got < b->n);
    exp_layer *L = b->L;
    double t0 = k3_now_ms();
    int k = -1;
    pthread_mutex_lock(&L->mu);
    for (;;) {
        admit(b);
        for (int j = 0; j < b->n && k < 0; j++) {
            exp_item *it = &b->items[j];
            if (it->admitted && !it->got && exp_item_slot(it)->state != EXP_SLOT_LOADING) k = j;
        }
        if (k >= 0) break;
        pthread_cond_wait(&L->cv, &L->mu);
    }
    b->st.read_ms += k3_now_ms() - t0;
    exp_item *it = &b->items[k];
    exp_slot *sl = exp_item_slot(it);
    it->got = 1; /* handed out, failed or not: put releases it */
    b->n_got++;
    *i = k;
    k3_status st = item_view(b, it, sl, view, err, errlen);
    pthread_mutex_unlock(&L->mu);
    return st;
}

void k3_experts_batch_put(k3_expert_batch *b, int i) {
    exp_layer *L = b->L;
    exp_item *it = &b->items[i];
    pthread_mutex_lock(&L->mu);
    K3_ASSERT(it->got && it->admitted && !it->put);
    b->wanted[it->id] = 0;
    if (it->stg >= 0)
        put_staged(b, it);
    else
        unpin(L, it->slot);
    it->put = 1;
    b->held--;
    admit(b);
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
}

void k3_experts_batch_close(k3_expert_batch **bp) {
    if (!bp || !*bp) return;
    k3_expert_batch *b = *bp;
    exp_layer *L = b->L;
    k3_experts *s = b->s;
    pthread_mutex_lock(&L->mu);
    /* the loaders write into our items and slots until they are done */
    while (b->reads_in_flight) pthread_cond_wait(&L->cv, &L->mu);
    for (int i = 0; i < b->n; i++) {
        exp_item *it = &b->items[i];
        if (!it->admitted || it->put) continue;
        if (it->stg >= 0) {
            b->stg[it->stg].state = EXP_SLOT_FAILED; /* not kept: never used */
            put_staged(b, it);
        } else {
            unpin(L, it->slot);
        }
    }
    pthread_cond_broadcast(&L->cv);
    pthread_mutex_unlock(&L->mu);
    if (b->staged) {
        size_t ne = (size_t)k3_experts_drives(s) * (size_t)s->read_depth;
        for (size_t k = 0; k < ne; k++)
            if (b->stg_res[k]) stage_give(s, b->stg[k].buf);
        free(b->stg);
        free(b->stg_on);
        free(b->stg_res);
    }
    k3_expert_stats *o[2] = {b->out, b->quiet ? NULL : &s->totals};
    pthread_mutex_lock(&s->stats_mu);
    for (int k = 0; k < 2; k++) {
        if (!o[k]) continue;
        o[k]->hits += b->st.hits;
        o[k]->misses += b->st.misses;
        o[k]->bytes += b->st.bytes;
        o[k]->read_ms += b->st.read_ms;
        o[k]->io_ms += b->st.io_ms;
        o[k]->busy_ms += b->st.busy_ms;
    }
    pthread_mutex_unlock(&s->stats_mu);
    free(b->items);
    free(b->wanted);
    free(b);
    *bp = NULL;
}

/* ---- totals ---- */

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
            if (L->slots[j].buf) total += s->slot_bytes;
        pthread_mutex_unlock(&L->mu);
    }
    return total;
}
