/* common/experts/expert_stripe.c: the expert store's side of expert striping
 * (common/experts/placement.h): the placement drives' copies of the shards,
 * and the run order that keeps every drive busy.
 *
 * Owns: per placement drive and shard, a buffered and an O_DIRECT fd on
 * <drive>/k3-stripe/<shard name> (opened by k3_experts_load_layer for the
 * shards its experts lie in, closed with the store). Borrows: the placement
 * (the model's) and the shard index (sizes, names).
 * Threads: exp_stripe_open runs from k3_experts_load_layer (before any
 * batch of that layer; the fd tables are then only read); the preads run on
 * the loader threads.
 *
 * A drive's file has the checkpoint shard's size and offsets, so an expert
 * is read at the offset the index gives, and the disk order (which fixes
 * the order the expert outputs are summed in) is the unstriped one.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/experts/experts_int.h"
#include "common/experts/placement.h"

k3_status exp_stripe_open(k3_experts *s, int d, int shard, int layer, int32_t e, char *err,
                          size_t errlen) {
    exp_drive *dr = &s->drives[d];
    if (!dr->fd) {
        dr->n = st_shard_count(s->idx);
        dr->fd = k3_xmalloc((size_t)(dr->n ? dr->n : 1) * sizeof *dr->fd);
        dr->dfd = k3_xmalloc((size_t)(dr->n ? dr->n : 1) * sizeof *dr->dfd);
        for (int i = 0; i < dr->n; i++) dr->fd[i] = dr->dfd[i] = -1;
    }
    if (shard < 0 || shard >= dr->n) return K3_OK;
    if (dr->fd[shard] >= 0) return K3_OK;
    char path[K3_MAX_PATH];
    k3_status st = k3_placement_file_path(s->placement, d, st_shard_name(s->idx, shard), path,
                                          sizeof path, err, errlen);
    if (st != K3_OK) return st;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return k3_errf(errno == ENOENT ? K3_ERR_MISSING : K3_ERR_IO, err, errlen,
                       "placement %s: layer %d expert %d %s drive %d, but its file %s cannot "
                       "be opened: %s (run k3-coordinator place for this placement)",
                       k3_placement_path(s->placement), layer, e,
                       k3_placement_split(s->placement) ? "has a piece on" : "is on", d, path,
                       strerror(errno));
    struct stat sb;
    uint64_t want = st_shard_size(s->idx, shard);
    if (fstat(fd, &sb) != 0 || (uint64_t)sb.st_size != want) {
        close(fd);
        return k3_errf(K3_ERR_MISMATCH, err, errlen,
                       "placement %s: %s is %lld bytes, the checkpoint's %s is %llu (an "
                       "interrupted or stale k3-coordinator place)",
                       k3_placement_path(s->placement), path, (long long)sb.st_size,
                       st_shard_name(s->idx, shard), (unsigned long long)want);
    }
    dr->fd[shard] = fd;
    dr->dfd[shard] = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT); /* -1: buffered reads */
    return K3_OK;
}

void exp_stripe_close(k3_experts *s) {
    for (int d = 0; d < K3_MAX_DIRS; d++) {
        exp_drive *dr = &s->drives[d];
        for (int i = 0; i < dr->n; i++) {
            if (dr->fd[i] >= 0) close(dr->fd[i]);
            if (dr->dfd[i] >= 0) close(dr->dfd[i]);
        }
        free(dr->fd);
        free(dr->dfd);
        dr->fd = dr->dfd = NULL;
        dr->n = 0;
    }
}

int exp_stripe_fd(const k3_experts *s, int d, int shard, int direct) {
    const exp_drive *dr = &s->drives[d];
    if (!dr->fd || shard < 0 || shard >= dr->n) return -1;
    return direct ? dr->dfd[shard] : dr->fd[shard];
}

k3_status exp_stripe_pread(k3_experts *s, int d, int shard, uint64_t off, void *buf, size_t len,
                           int direct, char *err, size_t errlen) {
    int fd = exp_stripe_fd(s, d, shard, direct);
    if (fd < 0) fd = exp_stripe_fd(s, d, shard, 0);
    if (fd < 0)
        return k3_errf(K3_ERR_STATE, err, errlen, "drive %d's copy of %s is not open", d,
                       st_shard_name(s->idx, shard));
    size_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return k3_errf(K3_ERR_IO, err, errlen, "%s/%s/%s: %s at offset %llu (%zu of %zu bytes)",
                           k3_placement_drive_path(s->placement, d), K3_PLACEMENT_SUBDIR,
                           st_shard_name(s->idx, shard), r < 0 ? strerror(errno) : "short read",
                           (unsigned long long)(off + done), done, len);
        done += (size_t)r;
    }
    return K3_OK;
}

/* ---- the public helpers (experts.h) ---- */

int k3_experts_drives(const k3_experts *s) {
    return s->placement ? k3_placement_drives(s->placement) : 1;
}

int k3_experts_drive_of(const k3_experts *s, int layer, int32_t e) {
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->loc || e < 0 || e >= s->cfg.n_experts) return 0;
    return L->loc[e].drive < 0 ? 0 : L->loc[e].drive;
}

int k3_experts_own(const k3_experts *s, int layer, int32_t e) {
    if (!s->placement || !s->drive_mask) return 1;
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->loc || e < 0 || e >= s->cfg.n_experts || L->loc[e].drive < 0) return 1;
    return (int)(s->drive_mask >> L->loc[e].drive & 1u);
}

void k3_experts_interleave(const k3_experts *s, int layer, int32_t *ids, int n) {
    int nd = k3_experts_drives(s);
    if (nd < 2 || n < 2 || k3_placement_split(s->placement)) return; /* split: each on all */
    int32_t *tmp = k3_xmalloc((size_t)n * sizeof *tmp);
    int pos[K3_MAX_DIRS] = {0}; /* next index of ids to scan, per drive */
    int out = 0;
    while (out < n)
        for (int d = 0; d < nd && out < n; d++) {
            while (pos[d] < n && k3_experts_drive_of(s, layer, ids[pos[d]]) != d) pos[d]++;
            if (pos[d] < n) tmp[out++] = ids[pos[d]++];
        }
    memcpy(ids, tmp, (size_t)n * sizeof *tmp);
    free(tmp);
}

uint64_t k3_experts_drive_bytes(k3_experts *s, int d) {
    if (d < 0 || d >= K3_MAX_DIRS) return 0;
    pthread_mutex_lock(&s->stats_mu);
    uint64_t b = s->drive_bytes[d];
    pthread_mutex_unlock(&s->stats_mu);
    return b;
}
