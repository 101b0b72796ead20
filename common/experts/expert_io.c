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

/* Reads [lo, hi) of a shard (or a drive's copy) into buf, where buf[0]
 * stands for file offset a (a <= lo; EXP_ALIGN-aligned when direct).
 * Direct: [align_down(lo), align_up(hi)) clipped to the file's last full
 * block through the O_DIRECT fd, the rest (at most the file's last
 * partial block) buffered into its place; else [lo, hi) buffered. */
static k3_status read_range(k3_experts *s, int drive, int shard, uint64_t lo, uint64_t hi,
                            uint64_t a, unsigned char *buf, int direct, char *err, size_t errlen) {
    int dfd = drive < 0 ? st_shard_fd(s->idx, shard, 1) : exp_stripe_fd(s, drive, shard, 1);
    if (!direct || dfd < 0)
        return src_pread(s, drive, shard, lo, buf + (lo - a), (size_t)(hi - lo), 0, err, errlen);
    const uint64_t A = EXP_ALIGN;
    uint64_t la = lo & ~(A - 1);
    uint64_t want_end = (hi + A - 1) & ~(A - 1);
    uint64_t full_end = st_shard_size(s->idx, shard) & ~(A - 1); /* last full block's end */
    uint64_t d_end = want_end < full_end ? want_end : full_end;
    if (d_end > la) {
        k3_status st =
            src_pread(s, drive, shard, la, buf + (la - a), (size_t)(d_end - la), 1, err, errlen);
        if (st != K3_OK) return st;
    } else {
        d_end = la;
    }
    if (d_end < hi) {
        /* the tail in the file's last partial block (or the whole range
         * when it starts there): buffered, straight into its place */
        uint64_t from = d_end > lo ? d_end : lo;
        return src_pread(s, drive, shard, from, buf + (from - a), (size_t)(hi - from), 0, err,
                         errlen);
    }
    return K3_OK;
}

/* Reads [off, off+len) of a shard into buf (EXP_ALIGN-aligned, room for
 * len + 2*EXP_ALIGN) and says where the wanted bytes start (*data_off). */
static k3_status read_span(k3_experts *s, int drive, int shard, uint64_t off, size_t len,
                           unsigned char *buf, size_t *data_off, char *err, size_t errlen) {
    int dfd = drive < 0 ? st_shard_fd(s->idx, shard, 1) : exp_stripe_fd(s, drive, shard, 1);
    int direct = s->direct && dfd >= 0;
    uint64_t a = direct ? off & ~(uint64_t)(EXP_ALIGN - 1) : off;
    *data_off = (size_t)(off - a);
    return read_range(s, drive, shard, off, off + len, a, buf, direct, err, errlen);
}

/* A split expert's slot layout: contiguous, its bytes start at data_off =
 * off - align_down(off) (every piece lands at its place relative to that
 * block, whatever the drive); scattered, each part at its layout_off. */
static size_t split_data_off(const exp_loc *loc) {
    return loc->contiguous ? (size_t)(loc->off[0] & (EXP_ALIGN - 1)) : 0;
}

/* Drive d's piece of split expert e into the slot (whose buffer and
 * data_off the queuer set). Direct only where the cut points are block
 * aligned, so that no two pieces' reads touch the same block. */
static k3_status read_piece(k3_experts *s, int layer, int32_t e, const exp_loc *loc, int d,
                            exp_slot *slot, uint64_t *bytes, char *err, size_t errlen) {
    const k3_placement *pl = s->placement;
    int direct = s->direct && k3_placement_align(pl) % EXP_ALIGN == 0;
    *bytes = 0;
    for (int p = 0; p < (loc->contiguous ? 1 : K3_EXP_PARTS); p++) {
        uint64_t len = loc->contiguous ? s->geom.total : s->geom.bytes[p], lo, hi;
        k3_placement_piece(pl, d, loc->off[p], len, &lo, &hi);
        if (lo == hi) continue;
        k3_status st;
        if (loc->contiguous)
            st = read_range(s, d, loc->shard[0], lo, hi, loc->off[0] - slot->data_off, slot->buf,
                            direct, err, errlen);
        else
            st = src_pread(s, d, loc->shard[p], lo,
                           slot->buf + s->geom.layout_off[p] + (lo - loc->off[p]),
                           (size_t)(hi - lo), 0, err, errlen);
        if (st != K3_OK) {
            k3_err_prefix(err, errlen,
                          "layer %d expert %d%s%s (shard %s, drive %d %s, bytes "
                          "%llu-%llu)",
                          layer, e, loc->contiguous ? "" : " ",
                          loc->contiguous ? "" : k3_exp_part_name[p],
                          st_shard_name(s->idx, loc->shard[p]), d, k3_placement_drive_path(pl, d),
                          (unsigned long long)lo, (unsigned long long)hi);
            return st;
        }
        *bytes += hi - lo;
    }
    return K3_OK;
}

/* Allocates the slot's buffer on first use. */
static k3_status slot_alloc(k3_experts *s, int layer, int32_t e, exp_slot *slot, char *err,
                            size_t errlen) {
    if (slot->buf) return K3_OK;
    void *p = NULL;
    if (posix_memalign(&p, EXP_ALIGN, s->slot_bytes) != 0)
        return k3_errf(K3_ERR_NOMEM, err, errlen,
                       "layer %d expert %d: cannot allocate a %zu-byte slot", layer, e,
                       s->slot_bytes);
    slot->buf = p;
    return K3_OK;
}

k3_status exp_read_expert(k3_experts *s, int layer, int32_t e, const exp_loc *loc, exp_slot *slot,
                          char *err, size_t errlen) {
    k3_status st = slot_alloc(s, layer, e, slot, err, errlen);
    if (st != K3_OK) return st;
    if (loc->split) { /* every piece in turn (the warm start's synchronous reads) */
        slot->data_off = split_data_off(loc);
        for (int d = 0; d < k3_placement_drives(s->placement) && st == K3_OK; d++) {
            uint64_t got;
            st = read_piece(s, layer, e, loc, d, slot, &got, err, errlen);
        }
        return st;
    }
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
    if (s->direct || loc->split) return; /* split: each piece's read is its own read-ahead */
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
        exp_job *j = q->head;
        q->head = j->next;
        if (!q->head) q->tail = NULL;
        pthread_mutex_unlock(&q->mu);

        /* The slot is pinned by the item and LOADING: its buffer is ours
         * (a split expert's: the byte range of our piece) until
         * exp_read_done publishes it. */
        exp_item *it = j->it;
        exp_layer *L = it->b->L;
        exp_slot *slot = exp_item_slot(it);
        j->t0_ms = k3_now_ms();
        k3_status st;
        uint64_t bytes = s->geom.total;
        if (!j->piece) {
            st = exp_read_expert(s, it->b->layer, it->id, &L->loc[it->id], slot, it->err,
                                 sizeof it->err);
        } else {
            char perr[320];
            st = read_piece(s, it->b->layer, it->id, &L->loc[it->id], j->drive, slot, &bytes, perr,
                            sizeof perr);
            if (st != K3_OK && atomic_exchange(&it->err_claimed, 1) == 0) {
                it->st = st;
                snprintf(it->err, sizeof it->err, "%s", perr);
            }
        }
        if (st == K3_OK) {
            pthread_mutex_lock(&s->stats_mu);
            s->drive_bytes[q - s->queues] += bytes;
            pthread_mutex_unlock(&s->stats_mu);
        }
        if (j->piece) {
            if (atomic_fetch_sub(&it->jobs_left, 1) != 1) continue; /* pieces still out */
            double t0 = j->t0_ms;
            for (int k = 0; k < it->n_jobs; k++)
                if (it->job[k].t0_ms < t0) t0 = it->job[k].t0_ms;
            st = atomic_load(&it->err_claimed) ? it->st : K3_OK;
            exp_read_done(it, st, t0, k3_now_ms());
        } else {
            exp_read_done(it, st, j->t0_ms, k3_now_ms());
        }
    }
}

static void queue_push(exp_queue *q, exp_job *j) {
    pthread_mutex_lock(&q->mu);
    j->next = NULL;
    if (q->tail)
        q->tail->next = j;
    else
        q->head = j;
    q->tail = j;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

void exp_queue_read(k3_experts *s, exp_item *it) {
    const exp_loc *loc = &it->b->L->loc[it->id];
    it->n_jobs = 0;
    atomic_store(&it->err_claimed, 0);
    if (!loc->split) {
        int d = loc->drive;
        it->job[0] = (exp_job){.it = it, .drive = d, .piece = 0};
        it->n_jobs = 1;
        queue_push(&s->queues[d >= 0 && d < s->n_queues ? d : 0], &it->job[0]);
        return;
    }
    /* the buffer and where the expert starts in it, before any piece runs */
    exp_slot *slot = exp_item_slot(it);
    char aerr[160];
    if (slot_alloc(s, it->b->layer, it->id, slot, aerr, sizeof aerr) != K3_OK) {
        /* no buffer: the expert fails like a failed read, from a loader-free
         * path (the caller holds the layer mutex, so exp_read_done cannot
         * run here); one job of drive 0 reports it */
        it->job[0] = (exp_job){.it = it, .drive = 0, .piece = 0};
        it->n_jobs = 1;
        queue_push(&s->queues[0], &it->job[0]);
        return;
    }
    slot->data_off = split_data_off(loc);
    int nd = k3_placement_drives(s->placement);
    for (int d = 0; d < nd; d++) {
        int any = 0;
        for (int p = 0; p < (loc->contiguous ? 1 : K3_EXP_PARTS) && !any; p++) {
            uint64_t lo, hi;
            k3_placement_piece(s->placement, d, loc->off[p],
                               loc->contiguous ? s->geom.total : s->geom.bytes[p], &lo, &hi);
            any = hi > lo;
        }
        if (any) it->job[it->n_jobs++] = (exp_job){.it = it, .drive = d, .piece = 1};
    }
    atomic_store(&it->jobs_left, it->n_jobs);
    /* all counted before the first is queued: a fast piece cannot finish
     * the expert while others are still to be queued */
    for (int k = 0; k < it->n_jobs; k++) queue_push(&s->queues[it->job[k].drive], &it->job[k]);
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
