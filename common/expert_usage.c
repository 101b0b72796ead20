/* common/expert_usage.c: the expert usage history (spec 5 "AUTOPIN") and
 * the warm start it drives. See experts.h for the file format.
 *
 * The counts live in the store (exp_layer.usage, under the layer mutex);
 * every expert a batch admits adds one. A history file's counts are added
 * at load, so a run that loads, runs and saves accumulates. A store knows
 * only its own layers: a worker saves the rows of its range only, under the
 * whole model's dims line, so files from different ranges of one model are
 * compatible (a load takes the rows of its range and ignores the others).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "experts_int.h"
#include "log.h"

#define USAGE_VERSION 1

/* FNV-1a 32 of the engine name (spec 5: engine_id of "kimi_k3"). */
static uint32_t engine_id(void) {
    uint32_t h = 2166136261u;
    for (const char *p = "kimi_k3"; *p; p++) {
        h ^= (unsigned char)*p;
        h *= 16777619u;
    }
    return h;
}

uint64_t k3_experts_usage_count(k3_experts *s, int layer, int expert) {
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->usage || expert < 0 || expert >= s->cfg.n_experts) return 0;
    pthread_mutex_lock(&L->mu);
    uint64_t c = L->usage[expert];
    pthread_mutex_unlock(&L->mu);
    return c;
}

/* A missing file is not an error (first run): nothing is added. */
k3_status k3_experts_usage_load(k3_experts *s, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return K3_OK;
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot open: %s", path,
                       strerror(errno));
    }
    k3_status st = K3_OK;
    char line[256];
    int lineno = 0, have_dims = 0, have_id = 0;
    long long a, b, c;
    while (st == K3_OK && fgets(line, sizeof line, f)) {
        lineno++;
        char extra;
        if (sscanf(line, "%lld %lld %lld %c", &a, &b, &c, &extra) != 3) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: expected three integers", path, lineno);
            break;
        }
        if (a == -1) {
            /* rows 0..n_layers inclusive per spec 5: the dims are n_layers
             * and n_experts of the model */
            if (b != s->cfg.n_layers || c != s->cfg.n_experts)
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "usage history %s: dims %lld layers x %lld experts, the model has "
                             "%d x %d (a history of another model; delete it or set K3_USAGE)",
                             path, b, c, s->cfg.n_layers, s->cfg.n_experts);
            have_dims = 1;
        } else if (a == -2) {
            if (b != USAGE_VERSION || c != (long long)engine_id())
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "usage history %s: format %lld engine %lld, expected format %d "
                             "engine %u (kimi_k3)",
                             path, b, c, USAGE_VERSION, engine_id());
            have_id = 1;
        } else if (!have_dims || !have_id) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: counts before the -1 / -2 header lines", path,
                         lineno);
        } else if (a < 0 || a > s->cfg.n_layers || b < 0 || b >= s->cfg.n_experts || c < 0) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: layer %lld expert %lld count %lld outside "
                         "[0, %d] x [0, %d) x [0, inf)",
                         path, lineno, a, b, c, s->cfg.n_layers, s->cfg.n_experts);
        } else {
            exp_layer *L = exp_layer_of(s, (int)a);
            if (L && L->usage) { /* rows of other ranges / dense layers: ignored */
                pthread_mutex_lock(&L->mu);
                L->usage[b] += (uint64_t)c;
                pthread_mutex_unlock(&L->mu);
            }
        }
    }
    fclose(f);
    return st;
}

/* An all-zero history is a zero-byte file (spec 5). */
k3_status k3_experts_usage_save(k3_experts *s, const char *path, char *err, size_t errlen) {
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return k3_errf(K3_ERR_ARG, err, errlen, "usage history: path of %zu bytes is too long",
                       strlen(path));
    FILE *f = fopen(tmp, "w");
    if (!f)
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot create: %s", tmp,
                       strerror(errno));
    int any = 0;
    for (int l = s->layer_a; l < s->layer_b; l++) {
        exp_layer *L = exp_layer_of(s, l);
        if (!L->usage) continue;
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < s->cfg.n_experts; e++) {
            if (!L->usage[e]) continue;
            if (!any)
                fprintf(f, "-1 %d %d\n-2 %d %u\n", s->cfg.n_layers, s->cfg.n_experts,
                        USAGE_VERSION, engine_id());
            any = 1;
            fprintf(f, "%d %d %llu\n", l, e, (unsigned long long)L->usage[e]);
        }
        pthread_mutex_unlock(&L->mu);
    }
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        int e = errno;
        remove(tmp);
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot write: %s", path,
                       strerror(e));
    }
    return K3_OK;
}

typedef struct hot {
    uint64_t count;
    int32_t id;
} hot;

static int hot_cmp(const void *pa, const void *pb) {
    const hot *a = pa, *b = pb;
    if (a->count != b->count) return a->count > b->count ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Per layer: the used experts by count, at most half the slots (at least
 * one when the layer has 2+ slots), read as one batch in disk order and
 * released at once, so they sit at the LRU's young end. The warm reads do
 * not count as usage. */
k3_status k3_experts_warm(k3_experts *s, int *n_read, char *err, size_t errlen) {
    int total = 0;
    k3_status st = K3_OK;
    hot *h = k3_xcalloc((size_t)s->cfg.n_experts, sizeof *h);
    int32_t *ids = k3_xcalloc((size_t)s->cfg.n_experts, sizeof *ids);
    uint8_t *sel = k3_xcalloc((size_t)s->cfg.n_experts, 1);
    for (int l = s->layer_a; l < s->layer_b && st == K3_OK; l++) {
        exp_layer *L = exp_layer_of(s, l);
        if (!L->loaded || L->n_slots < 2) continue;
        int n = 0;
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < s->cfg.n_experts; e++)
            if (L->usage[e] && L->loc[e].present) h[n++] = (hot){L->usage[e], e};
        pthread_mutex_unlock(&L->mu);
        qsort(h, (size_t)n, sizeof *h, hot_cmp);
        int take = n < L->n_slots / 2 ? n : L->n_slots / 2;
        memset(sel, 0, (size_t)s->cfg.n_experts);
        for (int k = 0; k < take; k++) sel[h[k].id] = 1;
        int m = k3_experts_disk_order(s, l, sel, ids);
        k3_expert_batch *b = NULL;
        st = k3_experts_batch_open(&b, s, l, ids, m, NULL, err, errlen);
        for (int i = 0; i < m && st == K3_OK; i++) {
            k3_expert_view v;
            st = k3_experts_batch_get(b, i, &v, err, errlen);
            if (st == K3_OK) k3_experts_batch_put(b, i);
        }
        k3_experts_batch_close(&b);
        /* the warm reads are not usage */
        pthread_mutex_lock(&L->mu);
        for (int i = 0; i < m; i++) L->usage[ids[i]]--;
        pthread_mutex_unlock(&L->mu);
        total += m;
    }
    free(h), free(ids), free(sel);
    if (n_read) *n_read = total;
    if (st != K3_OK) k3_err_prefix(err, errlen, "warm start");
    return st;
}
