/* common/engine/ckpt_store.c: turn checkpoints parked on disk (ckpt_store.h). */
#include "common/engine/ckpt_store.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"

#define NAME_LEN 30 /* "KKKKKKKKKKKKKKKK-PPPPPPPP.k3ck" */
static const char MAGIC[8] = {'K', '3', 'C', 'K', 'P', 'T', 0, K3_CKPT_FILE_VERSION};

struct k3_ckpt_store {
    char dir[K3_MAX_PATH];
    char what[32]; /* the option named in errors */
    uint64_t fp;
    uint32_t first, last;
    int max_files;
    uint64_t max_bytes;
    pthread_mutex_t mu; /* directory scans and pruning */
    uint64_t seq;       /* tmp file names */
};

static uint64_t fnv_bytes(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

uint64_t k3_ckpt_key(uint64_t fp, const int32_t *ids, int n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
    uint32_t nn = (uint32_t)n;
    h = fnv_bytes(h, &fp, 8);
    h = fnv_bytes(h, &nn, 4);
    h = fnv_bytes(h, ids, sizeof(int32_t) * (size_t)(n > 0 ? n : 0));
    return h ? h : 1;
}

k3_status k3_ckpt_store_open(k3_ckpt_store **out, const char *dir, const char *what, uint64_t fp,
                             int first, int last, int max_files, uint64_t max_bytes, char *err,
                             size_t errlen) {
    *out = NULL;
    size_t len = strlen(dir);
    if (len == 0 || len + NAME_LEN + 2 >= K3_MAX_PATH)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "%s: path of %zu bytes: expected 1..%d (K3_MAX_PATH less a file name)", what,
                       len, K3_MAX_PATH - NAME_LEN - 3);
    if (max_files < 1 || max_bytes < 1)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "%s: %d files and %" PRIu64 " bytes kept, need >= 1 of each", what,
                       max_files, max_bytes);
    if (first < 0 || last < first || last > K3_MAX_LAYERS)
        return k3_errf(K3_ERR_ARG, err, errlen, "%s: layer range [%d, %d) outside [0, %d]", what,
                       first, last, K3_MAX_LAYERS);
    char part[K3_MAX_PATH]; /* parents first: a local worker's dir sits in the coordinator's */
    snprintf(part, sizeof part, "%s", dir);
    for (char *q = part + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(part, 0700) != 0 && errno != EEXIST)
            return k3_errf(K3_ERR_IO, err, errlen, "%s %s: cannot create %s: %s", what, dir, part,
                           strerror(errno));
        *q = '/';
    }
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return k3_errf(K3_ERR_IO, err, errlen, "%s %s: cannot create: %s", what, dir,
                       strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return k3_errf(K3_ERR_IO, err, errlen, "%s %s: not a directory", what, dir);
    k3_ckpt_store *d = k3_xcalloc(1, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    snprintf(d->what, sizeof d->what, "%s", what);
    d->fp = fp;
    d->first = (uint32_t)first;
    d->last = (uint32_t)last;
    d->max_files = max_files;
    d->max_bytes = max_bytes;
    pthread_mutex_init(&d->mu, NULL);
    *out = d;
    return K3_OK;
}

void k3_ckpt_store_close(k3_ckpt_store **dp) {
    if (!dp || !*dp) return;
    pthread_mutex_destroy(&(*dp)->mu);
    free(*dp);
    *dp = NULL;
}

const char *k3_ckpt_store_dir(const k3_ckpt_store *d) { return d->dir; }
uint64_t k3_ckpt_store_fp(const k3_ckpt_store *d) { return d->fp; }

/* "KKKKKKKKKKKKKKKK-PPPPPPPP.k3ck": 1 and the fields, else 0. */
static int parse_name(const char *name, uint64_t *key, int *pos) {
    if (strlen(name) != NAME_LEN || strcmp(name + 25, ".k3ck") || name[16] != '-') return 0;
    char *end = NULL;
    unsigned long long h = strtoull(name, &end, 16);
    if (end != name + 16) return 0;
    long p = strtol(name + 17, &end, 10);
    if (end != name + 25 || p < 1 || p > K3_MAX_CTX) return 0;
    *key = h;
    *pos = (int)p;
    return 1;
}

void k3_ckpt_store_path(const k3_ckpt_store *d, uint64_t key, int pos, char *path, size_t cap) {
    snprintf(path, cap, "%s/%016" PRIx64 "-%08d.k3ck", d->dir, key, pos);
}

/* d->mu held: removes the oldest files past max_files or max_bytes. */
static void prune(k3_ckpt_store *d) {
    DIR *dh = opendir(d->dir);
    if (!dh) return;
    typedef struct ent {
        char name[NAME_LEN + 1];
        double mtime;
        uint64_t bytes;
    } ent;
    ent *v = NULL;
    int n = 0, cap = 0;
    uint64_t total = 0;
    struct dirent *de;
    while ((de = readdir(dh))) {
        uint64_t k;
        int p;
        if (!parse_name(de->d_name, &k, &p)) continue;
        char path[K3_MAX_PATH + 40];
        snprintf(path, sizeof path, "%s/%.30s", d->dir, de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            v = k3_xrealloc(v, (size_t)cap * sizeof *v);
        }
        memcpy(v[n].name, de->d_name, NAME_LEN + 1); /* parse_name checked the length */
        v[n].mtime = (double)sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9;
        v[n].bytes = (uint64_t)sb.st_size;
        total += v[n++].bytes;
    }
    closedir(dh);
    while (n > 0 && (n > d->max_files || total > d->max_bytes)) { /* drop the oldest one */
        int o = 0;
        for (int i = 1; i < n; i++)
            if (v[i].mtime < v[o].mtime) o = i;
        char path[K3_MAX_PATH + 40];
        snprintf(path, sizeof path, "%s/%.30s", d->dir, v[o].name);
        if (unlink(path) == 0) K3_DEBUG("%s: pruned %s", d->what, path);
        total -= v[o].bytes;
        v[o] = v[--n];
    }
    free(v);
}

k3_status k3_ckpt_store_save(k3_ckpt_store *d, uint64_t key, int pos, const int32_t *ids,
                             uint64_t bytes, k3_ckpt_dump_fn dump, void *ctx, char *err,
                             size_t errlen) {
    if (pos < 1 || pos > K3_MAX_CTX)
        return k3_errf(K3_ERR_ARG, err, errlen, "%s: position %d outside 1..%d", d->what, pos,
                       K3_MAX_CTX);
    uint64_t n_ids = ids ? (uint64_t)pos : 0;
    uint64_t total = K3_CKPT_HDR_BYTES + n_ids * sizeof(int32_t) + bytes;
    if (total > d->max_bytes)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%s: a checkpoint of %" PRIu64 " bytes is larger than the %" PRIu64
                       " bytes kept",
                       d->what, total, d->max_bytes);
    if (bytes > 0 && !dump)
        return k3_errf(K3_ERR_ARG, err, errlen, "%s: %" PRIu64 " payload bytes without a writer",
                       d->what, bytes);
    char path[K3_MAX_PATH + 40], tmp[K3_MAX_PATH + 80];
    k3_ckpt_store_path(d, key, pos, path, sizeof path);
    pthread_mutex_lock(&d->mu);
    uint64_t seq = ++d->seq;
    pthread_mutex_unlock(&d->mu);
    snprintf(tmp, sizeof tmp, "%s/.%016" PRIx64 "-%08d.%ld.%" PRIu64 ".tmp", d->dir, key, pos,
             (long)getpid(), seq);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return k3_errf(K3_ERR_IO, err, errlen, "%s: cannot create %s: %s", d->what, tmp,
                       strerror(errno));
    uint8_t hdr[K3_CKPT_HDR_BYTES] = {0};
    uint32_t p32 = (uint32_t)pos, n32 = (uint32_t)n_ids;
    memcpy(hdr, MAGIC, 8);
    memcpy(hdr + 8, &d->fp, 8);
    memcpy(hdr + 16, &key, 8);
    memcpy(hdr + 24, &p32, 4);
    memcpy(hdr + 28, &n32, 4);
    memcpy(hdr + 32, &d->first, 4);
    memcpy(hdr + 36, &d->last, 4);
    memcpy(hdr + 40, &bytes, 8);
    k3_status st = K3_OK;
    if (fwrite(hdr, 1, sizeof hdr, f) != sizeof hdr ||
        (ids && fwrite(ids, sizeof(int32_t), (size_t)pos, f) != (size_t)pos))
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: write %s: %s", d->what, tmp, strerror(errno));
    if (!st && bytes > 0) st = dump(ctx, f, err, errlen);
    if (!st && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: flush %s: %s", d->what, tmp, strerror(errno));
    if (!st && ftell(f) != (long)total)
        st = k3_errf(K3_ERR_INTERNAL, err, errlen,
                     "%s: %s has %ld bytes, the header promises %" PRIu64, d->what, tmp, ftell(f),
                     total);
    if (fclose(f) != 0 && !st)
        st = k3_errf(K3_ERR_IO, err, errlen, "%s: close %s: %s", d->what, tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st =
            k3_errf(K3_ERR_IO, err, errlen, "%s: rename to %s: %s", d->what, path, strerror(errno));
    if (st) {
        unlink(tmp);
        return st;
    }
    pthread_mutex_lock(&d->mu);
    prune(d);
    pthread_mutex_unlock(&d->mu);
    return K3_OK;
}

int k3_ckpt_store_find(k3_ckpt_store *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                       char *path, size_t cap, int *pos) {
    *pos = 0;
    pthread_mutex_lock(&d->mu);
    DIR *dh = opendir(d->dir);
    if (!dh) {
        pthread_mutex_unlock(&d->mu);
        return 0;
    }
    int best = 0;
    uint64_t best_key = 0;
    struct dirent *de;
    while ((de = readdir(dh))) {
        uint64_t k;
        int p;
        if (!parse_name(de->d_name, &k, &p)) continue;
        if (p <= min_pos || p >= n || p > max_ctx || p <= best) continue;
        if (k3_ckpt_key(d->fp, ids, p) != k) continue;
        best = p;
        best_key = k;
    }
    closedir(dh);
    pthread_mutex_unlock(&d->mu);
    if (!best) return 0;
    k3_ckpt_store_path(d, best_key, best, path, cap);
    *pos = best;
    return 1;
}

k3_status k3_ckpt_store_load(k3_ckpt_store *d, const char *path, uint64_t key, int pos,
                             const int32_t *ids, uint64_t want_bytes, k3_ckpt_load_fn load,
                             void *ctx, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return k3_errf(K3_ERR_STATE, err, errlen, "%s: %s", path, strerror(errno));
    k3_status st = K3_OK;
    struct stat sb;
    uint8_t hdr[K3_CKPT_HDR_BYTES];
    uint64_t fp = 0, fkey = 0, bytes = 0;
    uint32_t fpos = 0, n_ids = 0, first = 0, last = 0;
    int32_t *fids = NULL;
    if (fstat(fileno(f), &sb) != 0 || fread(hdr, 1, sizeof hdr, f) != sizeof hdr) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: shorter than its %d-byte header", path,
                     K3_CKPT_HDR_BYTES);
        goto out;
    }
    memcpy(&fp, hdr + 8, 8);
    memcpy(&fkey, hdr + 16, 8);
    memcpy(&fpos, hdr + 24, 4);
    memcpy(&n_ids, hdr + 28, 4);
    memcpy(&first, hdr + 32, 4);
    memcpy(&last, hdr + 36, 4);
    memcpy(&bytes, hdr + 40, 8);
    if (memcmp(hdr, MAGIC, 7) != 0) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: not a k3 checkpoint (magic)", path);
        goto out;
    }
    if (hdr[7] != K3_CKPT_FILE_VERSION) {
        st = k3_errf(K3_ERR_MISMATCH, err, errlen, "%s: format version %d, this build reads %d",
                     path, hdr[7], K3_CKPT_FILE_VERSION);
        goto out;
    }
    if (fp != d->fp) {
        st = k3_errf(K3_ERR_MISMATCH, err, errlen,
                     "%s: model fingerprint 0x%016" PRIx64 ", this model's is 0x%016" PRIx64, path,
                     fp, d->fp);
        goto out;
    }
    if (first != d->first || last != d->last) {
        st = k3_errf(K3_ERR_MISMATCH, err, errlen, "%s: layers [%u, %u), this store's are [%u, %u)",
                     path, first, last, d->first, d->last);
        goto out;
    }
    if (fkey != key || fpos != (uint32_t)pos) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen,
                     "%s: holds key %016" PRIx64 " at %u, expected %016" PRIx64 " at %d", path,
                     fkey, fpos, key, pos);
        goto out;
    }
    uint64_t want_ids = ids ? (uint64_t)pos : 0;
    uint64_t total = K3_CKPT_HDR_BYTES + (uint64_t)n_ids * sizeof(int32_t) + bytes;
    if (n_ids != want_ids || bytes != want_bytes || (uint64_t)sb.st_size != total) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen,
                     "%s: %u ids and %" PRIu64 " state bytes in %lld file bytes; expected %" PRIu64
                     " ids and %" PRIu64 " state bytes (%" PRIu64 " file bytes)",
                     path, n_ids, bytes, (long long)sb.st_size, want_ids, want_bytes,
                     K3_CKPT_HDR_BYTES + want_ids * sizeof(int32_t) + want_bytes);
        goto out;
    }
    if (ids) {
        fids = malloc(sizeof(int32_t) * (size_t)pos);
        if (!fids) {
            st = k3_errf(K3_ERR_NOMEM, err, errlen, "%s: cannot allocate %d ids", path, pos);
            goto out;
        }
        if (fread(fids, sizeof(int32_t), (size_t)pos, f) != (size_t)pos ||
            memcmp(fids, ids, sizeof(int32_t) * (size_t)pos) != 0) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: its %d ids are not the prompt's", path,
                         pos);
            goto out;
        }
    }
    if (load) { /* called for an empty payload too (a cluster restores by key) */
        st = load(ctx, f, pos, err, errlen);
        if (st && bytes > 0) k3_err_prefix(err, errlen, "%s", path);
    } else if (bytes > 0) {
        st = k3_errf(K3_ERR_ARG, err, errlen, "%s: no reader for its payload", path);
    }
out:
    free(fids);
    fclose(f);
    return st;
}
