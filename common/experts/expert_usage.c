/* common/experts/expert_usage.c: the expert usage history (docs/MODEL.md 5.5) and
 * the warm start it drives. See experts.h for the file format.
 *
 * The counts live in the store (exp_layer.usage, under the layer mutex);
 * every expert a batch admits adds one. A store knows only its own layers.
 *
 * Several processes share one history file: the in-process coordinator
 * (all layers) and the workers of a cluster, each with its own range, all
 * pointing at <model>/.k3_usage. A save therefore never rewrites the file
 * from the store alone; under an exclusive flock on <path>.lock it reads
 * the file as it is now, adds to the rows of this store's layers the
 * selections made since this store last loaded or saved (usage - base),
 * keeps every other row, and renames a fresh <path>.tmp over it. Two
 * workers with disjoint ranges thus fill one file, two with the same range
 * (replicas) both add their counts, and a run that loads, runs and saves
 * accumulates without counting anything twice. The lock file stays (it is
 * empty; removing it would race with a waiting saver). One file rather than
 * one per range (.k3_usage.L<a>-<b>) so that a new layer split, or the
 * in-process path, still finds the history of every layer.
 *
 * Not handled: a save from a process whose counts were loaded from another
 * file (the deltas are added to whatever the target holds); count overflow
 * saturates at UINT64_MAX; the seed's confidence scaling of the warm start
 * (>= 5,000 selections), COLI_USAGE_DECAY and AUTOPIN=0 (K3_USAGE=off
 * disables the history instead).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/experts/experts_int.h"
#include "common/base/log.h"

#define USAGE_VERSION 1

/* FNV-1a 32 of the engine name (docs/MODEL.md 5.5: engine_id of "kimi_k3"). */
static uint32_t engine_id(void) {
    uint32_t h = 2166136261u;
    for (const char *p = "kimi_k3"; *p; p++) {
        h ^= (unsigned char)*p;
        h *= 16777619u;
    }
    return h;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

uint64_t k3_experts_usage_count(k3_experts *s, int layer, int expert) {
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->usage || expert < 0 || expert >= s->cfg.n_experts) return 0;
    pthread_mutex_lock(&L->mu);
    uint64_t c = L->usage[expert];
    pthread_mutex_unlock(&L->mu);
    return c;
}

/* Rows of a whole history: [(n_layers_full + 1) * n_experts], the model's
 * layers before any K3_LAYERS truncation (so a truncated run keeps the
 * file of the full model), rows 0..n_layers inclusive per docs/MODEL.md 5.5. Sized by
 * the config, whose dims are checked against limits.h at load. */
static size_t rows_len(const k3_experts *s) {
    return ((size_t)s->cfg.n_layers_full + 1) * (size_t)s->cfg.n_experts;
}

/* Adds the counts of the file at path into rows. A missing file adds
 * nothing (first run); a zero-byte file is the all-zero history. Dims or
 * engine id that differ are K3_ERR_MISMATCH, a malformed line
 * K3_ERR_FORMAT, both naming the path and the line. */
k3_status k3_experts_usage_read(const char *path, int NL, int E, uint64_t *rows, char *err,
                                size_t errlen) {
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
        if (!strchr(line, '\n') && !feof(f)) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: longer than %zu bytes", path, lineno,
                         sizeof line - 1);
            break;
        }
        if (sscanf(line, "%lld %lld %lld %c", &a, &b, &c, &extra) != 3) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: expected three integers", path, lineno);
            break;
        }
        if (a == -1) {
            if (b != NL || c != E)
                st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                             "usage history %s: dims %lld layers x %lld experts, the model has "
                             "%d x %d (a history of another model; delete it or set K3_USAGE)",
                             path, b, c, NL, E);
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
        } else if (a < 0 || a > NL || b < 0 || b >= E || c < 0) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "usage history %s line %d: layer %lld expert %lld count %lld outside "
                         "[0, %d] x [0, %d) x [0, inf)",
                         path, lineno, a, b, c, NL, E);
        } else {
            uint64_t *r = &rows[(size_t)a * (size_t)E + (size_t)b];
            *r = sat_add(*r, (uint64_t)c);
        }
    }
    if (st == K3_OK && ferror(f))
        st = k3_errf(K3_ERR_IO, err, errlen, "usage history %s: read error", path);
    fclose(f);
    return st;
}

static k3_status usage_parse(const k3_experts *s, const char *path, uint64_t *rows, char *err,
                             size_t errlen) {
    return k3_experts_usage_read(path, s->cfg.n_layers_full, s->cfg.n_experts, rows, err, errlen);
}

/* Rows of layers outside the range and of dense layers are ignored here
 * (they are kept in the file by the next save). */
k3_status k3_experts_usage_load(k3_experts *s, const char *path, char *err, size_t errlen) {
    const int E = s->cfg.n_experts;
    uint64_t *rows = k3_xcalloc(rows_len(s), sizeof *rows);
    k3_status st = usage_parse(s, path, rows, err, errlen);
    for (int l = s->layer_a; l < s->layer_b && st == K3_OK; l++) {
        exp_layer *L = exp_layer_of(s, l);
        if (!L->usage) continue;
        const uint64_t *r = &rows[(size_t)l * (size_t)E];
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < E; e++) {
            L->usage[e] = sat_add(L->usage[e], r[e]);
            L->usage_base[e] = sat_add(L->usage_base[e], r[e]);
        }
        pthread_mutex_unlock(&L->mu);
    }
    free(rows);
    return st;
}

/* Writes rows to <path>.tmp (fsynced) and renames it over path. An
 * all-zero history is a zero-byte file (docs/MODEL.md 5.5). */
static k3_status usage_write(const k3_experts *s, const char *path, const uint64_t *rows, char *err,
                             size_t errlen) {
    char tmp[4200];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", path) >= sizeof tmp)
        return k3_errf(K3_ERR_ARG, err, errlen, "usage history: path of %zu bytes is too long",
                       strlen(path));
    FILE *f = fopen(tmp, "w");
    if (!f)
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot create: %s", tmp,
                       strerror(errno));
    const int NL = s->cfg.n_layers_full, E = s->cfg.n_experts;
    int any = 0;
    for (int l = 0; l <= NL; l++)
        for (int e = 0; e < E; e++) {
            uint64_t c = rows[(size_t)l * (size_t)E + (size_t)e];
            if (!c) continue;
            if (!any) fprintf(f, "-1 %d %d\n-2 %d %u\n", NL, E, USAGE_VERSION, engine_id());
            any = 1;
            fprintf(f, "%d %d %llu\n", l, e, (unsigned long long)c);
        }
    int bad = fflush(f) != 0 || ferror(f) || fsync(fileno(f)) != 0;
    int e = errno;
    bad |= fclose(f) != 0;
    if (!bad && rename(tmp, path) != 0) bad = 1, e = errno;
    if (bad) {
        remove(tmp);
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot write: %s", path,
                       strerror(e ? e : EIO));
    }
    return K3_OK;
}

k3_status k3_experts_usage_save(k3_experts *s, const char *path, char *err, size_t errlen) {
    char lock[4200];
    if ((size_t)snprintf(lock, sizeof lock, "%s.lock", path) >= sizeof lock)
        return k3_errf(K3_ERR_ARG, err, errlen, "usage history: path of %zu bytes is too long",
                       strlen(path));
    int lfd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lfd < 0 && errno == EACCES) lfd = open(lock, O_RDONLY | O_CLOEXEC); /* another user's */
    if (lfd < 0)
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot create the lock file: %s",
                       lock, strerror(errno));
    int rc;
    while ((rc = flock(lfd, LOCK_EX)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
        int e = errno;
        close(lfd);
        return k3_errf(K3_ERR_IO, err, errlen, "usage history %s: cannot lock: %s", lock,
                       strerror(e));
    }
    /* under the lock: the file as other processes left it, plus our
     * selections since the last sync */
    const int E = s->cfg.n_experts;
    uint64_t *rows = k3_xcalloc(rows_len(s), sizeof *rows);
    uint64_t *snap = k3_xcalloc((size_t)(s->layer_b - s->layer_a) * (size_t)E, sizeof *snap);
    k3_status st = usage_parse(s, path, rows, err, errlen);
    if (st != K3_OK) k3_err_prefix(err, errlen, "not saved (the file is left as it is)");
    for (int l = s->layer_a; l < s->layer_b && st == K3_OK; l++) {
        exp_layer *L = exp_layer_of(s, l);
        if (!L->usage) continue;
        uint64_t *r = &rows[(size_t)l * (size_t)E], *sn = &snap[(size_t)(l - s->layer_a) * E];
        pthread_mutex_lock(&L->mu);
        for (int e = 0; e < E; e++) {
            sn[e] = L->usage[e];
            r[e] = sat_add(r[e], L->usage[e] - L->usage_base[e]); /* usage >= base always */
        }
        pthread_mutex_unlock(&L->mu);
    }
    if (st == K3_OK) st = usage_write(s, path, rows, err, errlen);
    /* only a written file moves the base: a failed save loses nothing */
    for (int l = s->layer_a; l < s->layer_b && st == K3_OK; l++) {
        exp_layer *L = exp_layer_of(s, l);
        if (!L->usage) continue;
        pthread_mutex_lock(&L->mu);
        memcpy(L->usage_base, &snap[(size_t)(l - s->layer_a) * E], sizeof(uint64_t) * (size_t)E);
        pthread_mutex_unlock(&L->mu);
    }
    free(rows);
    free(snap);
    close(lfd); /* releases the lock */
    return st;
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

/* Per layer: the used experts by count, at most half the slots (none with
 * one slot), read as one batch in disk order and released at once, so they
 * sit at the LRU's young end; they are not pinned (the original engine
 * pinned them, docs/MODEL.md 5.5; here the other half of the slots would then
 * be all that is left for the read-ahead window of K3_PIPE). The warm reads
 * count neither as usage nor in the store's totals (they are not lookups of a
 * step). */
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
            if (L->usage[e] && L->loc[e].present && k3_experts_own(s, l, e))
                h[n++] = (hot){L->usage[e], e};
        pthread_mutex_unlock(&L->mu);
        qsort(h, (size_t)n, sizeof *h, hot_cmp);
        int take = n < L->n_slots / 2 ? n : L->n_slots / 2;
        memset(sel, 0, (size_t)s->cfg.n_experts);
        for (int k = 0; k < take; k++) sel[h[k].id] = 1;
        int m = k3_experts_disk_order(s, l, sel, ids);
        k3_expert_batch *b = NULL;
        st = k3_experts_batch_open(&b, s, l, ids, m, NULL, err, errlen);
        if (b) b->quiet = 1; /* no reads completed yet: close adds nothing to the totals */
        for (int i = 0; i < m && st == K3_OK; i++) {
            k3_expert_view v;
            st = k3_experts_batch_get(b, i, &v, err, errlen);
            if (st == K3_OK) k3_experts_batch_put(b, i);
        }
        int admitted = b ? b->next_admit : 0;
        k3_experts_batch_close(&b);
        /* the warm reads are not usage (admission counted them) */
        pthread_mutex_lock(&L->mu);
        for (int i = 0; i < admitted; i++) L->usage[ids[i]]--;
        pthread_mutex_unlock(&L->mu);
        if (st == K3_OK) total += m;
    }
    free(h), free(ids), free(sel);
    if (n_read) *n_read = total;
    if (st != K3_OK) k3_err_prefix(err, errlen, "warm start");
    return st;
}
