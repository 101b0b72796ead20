/* common/experts/expert_io.c: how expert bytes come off the drives (docs/MODEL.md
 * 5.4): one read per expert through the shard's O_DIRECT fd with the
 * unaligned tail through its buffered fd, and the loader threads that run
 * those reads in the order the batches queued them (disk order).
 *
 * Why threads and not io_uring: an expert is one 17.5 MB read, so the
 * syscall count is tiny (16 per token per layer) and the win of io_uring
 * (batched submission) does not apply; N threads each with one large
 * pread in flight keep the drive's queue at depth N (the block layer
 * splits each read into 4 MiB requests). Measured side by side
 * (tests/bench/bench_expert_io.c, docs/PERFORMANCE.md): 2-8 threads and
 * io_uring at depth 4 or 16 read the same GB/s, equal to a contiguous
 * read of the same bytes; only 1 thread is slower. So no K3_IO switch.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/experts/experts_int.h"
#include "common/experts/placement.h"
#include "common/base/log.h"

/* ---- the read of one expert ---- */

/* Reads [off, off+len) of a shard into buf (EXP_ALIGN-aligned, room for
 * len + 2*EXP_ALIGN) and says where the wanted bytes start (*data_off).
 *
 * O_DIRECT (docs/MODEL.md 5.4): the start is aligned down to 4096 (pad = off - a), and
 * ceil4K(pad + len) bytes are read through the direct fd, clipped to the
 * file's last full 4K block; what lies past that block (at most the file's
 * last partial block) is read through the buffered fd into its place. The
 * fd's own EINVAL fallback (st_pread) covers filesystems without O_DIRECT. */
/* A read of the shard itself (drive -1) or of a placement drive's copy of
 * it (same offsets, same size). */
static k3_status src_pread(k3_experts *s, int drive, int shard, uint64_t off, void *buf, size_t len,
                           int direct, char *err, size_t errlen) {
    if (drive < 0) return st_pread(s->idx, shard, off, buf, len, direct, err, errlen);
    return exp_stripe_pread(s, drive, shard, off, buf, len, direct, err, errlen);
}

static k3_status read_span(k3_experts *s, int drive, int shard, uint64_t off, size_t len,
                           unsigned char *buf, size_t *data_off, char *err, size_t errlen) {
    int dfd = drive < 0 ? st_shard_fd(s->idx, shard, 1) : exp_stripe_fd(s, drive, shard, 1);
    if (!s->direct || dfd < 0) {
        *data_off = 0;
        return src_pread(s, drive, shard, off, buf, len, 0, err, errlen);
    }
    const uint64_t A = EXP_ALIGN;
    uint64_t a = off & ~(A - 1);
    uint64_t want_end = (off + len + A - 1) & ~(A - 1);
    uint64_t full_end = st_shard_size(s->idx, shard) & ~(A - 1); /* last full block's end */
    uint64_t d_end = want_end < full_end ? want_end : full_end;
    *data_off = (size_t)(off - a);
    if (d_end > a) {
        k3_status st = src_pread(s, drive, shard, a, buf, (size_t)(d_end - a), 1, err, errlen);
        if (st != K3_OK) return st;
    } else {
        d_end = a;
    }
    if (d_end < off + len) {
        /* the tail in the file's last partial block (or the whole expert
         * when it starts there): buffered, straight into its place */
        uint64_t from = d_end > off ? d_end : off;
        return src_pread(s, drive, shard, from, buf + (from - a), (size_t)(off + len - from), 0,
                         err, errlen);
    }
    return K3_OK;
}

k3_status exp_read_expert(k3_experts *s, int layer, int32_t e, const exp_loc *loc, exp_slot *slot,
                          char *err, size_t errlen) {
    if (!slot->buf) {
        void *p = NULL;
        if (posix_memalign(&p, EXP_ALIGN, s->slot_bytes) != 0)
            return k3_errf(K3_ERR_NOMEM, err, errlen,
                           "layer %d expert %d: cannot allocate a %zu-byte slot", layer, e,
                           s->slot_bytes);
        slot->buf = p;
    }
    k3_status st;
    if (loc->contiguous) {
        st = read_span(s, loc->drive, loc->shard[0], loc->off[0], (size_t)s->geom.total, slot->buf,
                       &slot->data_off, err, errlen);
        if (st != K3_OK)
            k3_err_prefix(err, errlen, "layer %d expert %d (shard %s%s%s)", layer, e,
                          st_shard_name(s->idx, loc->shard[0]), loc->drive >= 0 ? " on drive " : "",
                          loc->drive >= 0 ? k3_placement_drive_path(s->placement, loc->drive) : "");
        return st;
    }
    /* six tensors scattered: six buffered reads into the slot layout */
    slot->data_off = 0;
    for (int p = 0; p < K3_EXP_PARTS; p++) {
        st = src_pread(s, loc->drive, loc->shard[p], loc->off[p], slot->buf + s->geom.layout_off[p],
                       (size_t)s->geom.bytes[p], 0, err, errlen);
        if (st != K3_OK) {
            k3_err_prefix(err, errlen, "layer %d expert %d %s (shard %s)", layer, e,
                          k3_exp_part_name[p], st_shard_name(s->idx, loc->shard[p]));
            return st;
        }
    }
    return K3_OK;
}

void exp_advise(k3_experts *s, const exp_loc *loc) {
    if (s->direct) return;
    for (int p = 0; p < (loc->contiguous ? 1 : K3_EXP_PARTS); p++) {
        int fd = loc->drive < 0 ? st_shard_fd(s->idx, loc->shard[p], 0)
                                : exp_stripe_fd(s, loc->drive, loc->shard[p], 0);
        uint64_t len = loc->contiguous ? s->geom.total : s->geom.bytes[p];
        if (fd >= 0) posix_fadvise(fd, (off_t)loc->off[p], (off_t)len, POSIX_FADV_WILLNEED);
    }
}

/* ---- loader threads ---- */

/* One queue per drive (one without a placement): a drive's reads wait only
 * behind that drive's reads, so N drives have reads in flight together. */
static void *loader_main(void *arg) {
    exp_queue *q = arg;
    k3_experts *s = q->s;
    for (;;) {
        pthread_mutex_lock(&q->mu);
        while (!q->head && !q->stop) pthread_cond_wait(&q->cv, &q->mu);
        if (!q->head) { /* stopping and nothing left */
            pthread_mutex_unlock(&q->mu);
            return NULL;
        }
        exp_item *it = q->head;
        q->head = it->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->mu);

        /* The slot is pinned by the item and LOADING: its buffer is ours
         * until exp_read_done publishes it. */
        exp_layer *L = it->b->L;
        exp_slot *slot = exp_item_slot(it);
        double t0 = k3_now_ms();
        k3_status st = exp_read_expert(s, it->b->layer, it->id, &L->loc[it->id], slot, it->err,
                                       sizeof it->err);
        if (st == K3_OK) {
            pthread_mutex_lock(&s->stats_mu);
            s->drive_bytes[q - s->queues] += s->geom.total;
            pthread_mutex_unlock(&s->stats_mu);
        }
        exp_read_done(it, st, t0, k3_now_ms());
    }
}

void exp_queue_read(k3_experts *s, exp_item *it) {
    int d = it->b->L->loc[it->id].drive;
    exp_queue *q = &s->queues[d >= 0 && d < s->n_queues ? d : 0];
    pthread_mutex_lock(&q->mu);
    it->next = NULL;
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

k3_status exp_loaders_start(k3_experts *s, int n, char *err, size_t errlen) {
    int nq = s->placement ? k3_placement_drives(s->placement) : 1;
    for (int k = 0; k < nq; k++) {
        exp_queue *q = &s->queues[k];
        pthread_mutex_init(&q->mu, NULL);
        pthread_cond_init(&q->cv, NULL);
        q->init = 1;
        q->s = s;
        s->n_queues = k + 1;
        for (int i = 0; i < n; i++) {
            int rc = pthread_create(&q->loaders[i], NULL, loader_main, q);
            if (rc != 0) {
                exp_loaders_stop(s);
                return k3_errf(K3_ERR_NOMEM, err, errlen,
                               "expert store: cannot start loader thread %d of %d (drive %d): %s",
                               i + 1, n, k, strerror(rc));
            }
            q->n_loaders++;
        }
    }
    return K3_OK;
}

/* No batch is open (k3_experts_close's contract), so the queues are empty;
 * threads finish what they hold and exit. */
void exp_loaders_stop(k3_experts *s) {
    for (int k = 0; k < s->n_queues; k++) {
        exp_queue *q = &s->queues[k];
        if (!q->init) continue;
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        for (int i = 0; i < q->n_loaders; i++) pthread_join(q->loaders[i], NULL);
        q->n_loaders = 0;
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
        q->init = 0;
    }
    s->n_queues = 0;
}
