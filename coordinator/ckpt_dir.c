/* coordinator/ckpt_dir.c: turn checkpoints parked on disk (ckpt_dir.h). */
#include "coordinator/ckpt_dir.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/base/log.h"

#define HDR_BYTES 32 /* magic 8, fp 8, n_ids 4, pad 4, bytes 8 */
static const char MAGIC[8] = {'K', '3', 'C', 'K', 'P', 'T', 0, K3_CKPT_FILE_VERSION};

struct k3_ckpt_dir {
    char dir[K3_MAX_PATH];
    uint64_t fp;
    int max_files;
    pthread_mutex_t mu; /* directory scans and pruning */
    uint64_t seq;       /* tmp file names */
};

static uint64_t ids_hash(const int32_t *ids, int n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
    for (int i = 0; i < n; i++) {
        uint32_t v = (uint32_t)ids[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 1099511628211ull;
        }
    }
    return h;
}

k3_status k3_ckpt_dir_open(k3_ckpt_dir **out, const char *dir, uint64_t fingerprint, int max_files,
                           char *err, size_t errlen) {
    *out = NULL;
    size_t len = strlen(dir);
    if (len == 0 || len + 32 >= K3_MAX_PATH)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--ckpt-dir: path of %zu bytes: expected 1..%d (K3_MAX_PATH)", len,
                       K3_MAX_PATH - 33);
    if (max_files < 1)
        return k3_errf(K3_ERR_ARG, err, errlen, "--ckpt-dir: %d files kept, need >= 1", max_files);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir %s: cannot create: %s", dir,
                       strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir %s: not a directory", dir);
    k3_ckpt_dir *d = k3_xcalloc(1, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "%s", dir);
    d->fp = fingerprint;
    d->max_files = max_files;
    pthread_mutex_init(&d->mu, NULL);
    *out = d;
    return K3_OK;
}

void k3_ckpt_dir_close(k3_ckpt_dir **dp) {
    if (!dp || !*dp) return;
    pthread_mutex_destroy(&(*dp)->mu);
    free(*dp);
    *dp = NULL;
}

/* "HHHHHHHHHHHHHHHH-PPPPPPPP.k3ck": 1 and the fields, else 0. */
static int parse_name(const char *name, uint64_t *hash, int *pos) {
    if (strlen(name) != 30 || strcmp(name + 25, ".k3ck") || name[16] != '-') return 0;
    char *end = NULL;
    unsigned long long h = strtoull(name, &end, 16);
    if (end != name + 16) return 0;
    long p = strtol(name + 17, &end, 10);
    if (end != name + 25 || p < 1 || p > K3_MAX_CTX) return 0;
    *hash = h;
    *pos = (int)p;
    return 1;
}

/* d->mu held: removes the oldest files past max_files. */
static void prune(k3_ckpt_dir *d) {
    DIR *dh = opendir(d->dir);
    if (!dh) return;
    typedef struct ent {
        char name[32];
        double mtime;
    } ent;
    ent *v = NULL;
    int n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(dh))) {
        uint64_t h;
        int p;
        if (!parse_name(de->d_name, &h, &p)) continue;
        char path[K3_MAX_PATH + 40];
        snprintf(path, sizeof path, "%s/%.30s", d->dir, de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            v = k3_xrealloc(v, (size_t)cap * sizeof *v);
        }
        memcpy(v[n].name, de->d_name, 31); /* 30 characters and the NUL (parse_name) */
        v[n++].mtime = (double)sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec * 1e-9;
    }
    closedir(dh);
    while (n > d->max_files) { /* drop the oldest one */
        int o = 0;
        for (int i = 1; i < n; i++)
            if (v[i].mtime < v[o].mtime) o = i;
        char path[K3_MAX_PATH + 40];
        snprintf(path, sizeof path, "%s/%.30s", d->dir, v[o].name);
        unlink(path);
        v[o] = v[--n];
    }
    free(v);
}

k3_status k3_ckpt_dir_save(k3_ckpt_dir *d, k3_trunk *t, void *state, const int32_t *ids, int n,
                           char *err, size_t errlen) {
    if (!t->ops->state_dump || !t->ops->state_dump_bytes)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--ckpt-dir: the %s trunk cannot write its state to disk", t->ops->name);
    if (n < 1 || n > K3_MAX_CTX)
        return k3_errf(K3_ERR_ARG, err, errlen, "--ckpt-dir: %d ids outside 1..%d", n, K3_MAX_CTX);
    char name[32], path[K3_MAX_PATH + 40], tmp[K3_MAX_PATH + 80];
    snprintf(name, sizeof name, "%016" PRIx64 "-%08d.k3ck", ids_hash(ids, n), n);
    snprintf(path, sizeof path, "%s/%s", d->dir, name);
    pthread_mutex_lock(&d->mu);
    uint64_t seq = ++d->seq;
    pthread_mutex_unlock(&d->mu);
    snprintf(tmp, sizeof tmp, "%s/.%s.%ld.%" PRIu64 ".tmp", d->dir, name, (long)getpid(), seq);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir: cannot create %s: %s", tmp,
                       strerror(errno));
    uint8_t hdr[HDR_BYTES] = {0};
    uint64_t bytes = t->ops->state_dump_bytes(t, state, n);
    uint32_t nn = (uint32_t)n;
    memcpy(hdr, MAGIC, 8);
    memcpy(hdr + 8, &d->fp, 8);
    memcpy(hdr + 16, &nn, 4);
    memcpy(hdr + 24, &bytes, 8);
    k3_status st = K3_OK;
    if (fwrite(hdr, 1, HDR_BYTES, f) != HDR_BYTES ||
        fwrite(ids, sizeof(int32_t), (size_t)n, f) != (size_t)n)
        st = k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir: write %s: %s", tmp, strerror(errno));
    if (!st) st = t->ops->state_dump(t, state, f, err, errlen);
    if (!st && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        st = k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir: flush %s: %s", tmp, strerror(errno));
    if (fclose(f) != 0 && !st)
        st = k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir: close %s: %s", tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = k3_errf(K3_ERR_IO, err, errlen, "--ckpt-dir: rename to %s: %s", path, strerror(errno));
    if (st) {
        unlink(tmp);
        return st;
    }
    pthread_mutex_lock(&d->mu);
    prune(d);
    pthread_mutex_unlock(&d->mu);
    return K3_OK;
}

int k3_ckpt_dir_find(k3_ckpt_dir *d, const int32_t *ids, int n, int min_pos, int max_ctx,
                     char *path, size_t cap, int *pos) {
    *pos = 0;
    pthread_mutex_lock(&d->mu);
    DIR *dh = opendir(d->dir);
    if (!dh) {
        pthread_mutex_unlock(&d->mu);
        return 0;
    }
    int best = 0;
    char best_name[32] = "";
    struct dirent *de;
    while ((de = readdir(dh))) {
        uint64_t h;
        int p;
        if (!parse_name(de->d_name, &h, &p)) continue;
        if (p <= min_pos || p >= n || p > max_ctx || p <= best) continue;
        if (ids_hash(ids, p) != h) continue;
        best = p;
        memcpy(best_name, de->d_name, 31);
    }
    closedir(dh);
    pthread_mutex_unlock(&d->mu);
    if (!best) return 0;
    snprintf(path, cap, "%s/%.30s", d->dir, best_name);
    *pos = best;
    return 1;
}

k3_status k3_ckpt_dir_load(k3_ckpt_dir *d, const char *path, int pos, const int32_t *ids,
                           k3_trunk *t, void *state, char *err, size_t errlen) {
    if (!t->ops->state_load || !t->ops->state_dump_bytes)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "--ckpt-dir: the %s trunk cannot read its state from disk", t->ops->name);
    FILE *f = fopen(path, "rb");
    if (!f) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    k3_status st = K3_OK;
    struct stat sb;
    uint8_t hdr[HDR_BYTES];
    uint64_t fp = 0, bytes = 0;
    uint32_t nn = 0;
    int32_t *fids = NULL;
    if (fstat(fileno(f), &sb) != 0 || fread(hdr, 1, HDR_BYTES, f) != HDR_BYTES) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: shorter than its %d-byte header", path,
                     HDR_BYTES);
        goto out;
    }
    memcpy(&fp, hdr + 8, 8);
    memcpy(&nn, hdr + 16, 4);
    memcpy(&bytes, hdr + 24, 8);
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
    uint64_t want = t->ops->state_dump_bytes(t, state, pos);
    uint64_t total = HDR_BYTES + (uint64_t)nn * sizeof(int32_t) + bytes;
    if (nn != (uint32_t)pos || bytes != want || (uint64_t)sb.st_size != total) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen,
                     "%s: %u ids and %" PRIu64 " state bytes in %lld file bytes; expected %d ids "
                     "and %" PRIu64 " state bytes (%" PRIu64 " file bytes)",
                     path, nn, bytes, (long long)sb.st_size, pos, want,
                     HDR_BYTES + (uint64_t)pos * sizeof(int32_t) + want);
        goto out;
    }
    fids = malloc(sizeof(int32_t) * (size_t)pos);
    if (!fids) {
        st = k3_errf(K3_ERR_NOMEM, err, errlen, "%s: cannot allocate %d ids", path, pos);
        goto out;
    }
    if (fread(fids, sizeof(int32_t), (size_t)pos, f) != (size_t)pos ||
        memcmp(fids, ids, sizeof(int32_t) * (size_t)pos) != 0) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: its %d ids are not the prompt's", path, pos);
        goto out;
    }
    st = t->ops->state_load(t, state, f, pos, err, errlen);
    if (st) k3_err_prefix(err, errlen, "%s", path);
out:
    free(fids);
    fclose(f);
    if (st && t->ops->state_reset) t->ops->state_reset(t, state);
    return st;
}
