/* common/experts/experts_int.h: the expert store's private state, shared by its
 * three files and nobody else:
 *
 *   experts.c       tables, budget, LRU slots, batches (the window)
 *   expert_io.c     the read path (O_DIRECT head/tail) and the loader threads
 *   expert_usage.c  the usage history and the warm start
 *   expert_stripe.c the drive files of a placement (expert striping)
 *
 * Locking: a layer's mutex guards its slots, slot_of, clock and usage
 * counts, and the batch items admitted on that layer. The loader queue has
 * its own mutex; it is taken either alone or inside a layer mutex (order:
 * layer, then queue), never the other way round. A slot buffer being read
 * belongs to the loader that reads it (state EXP_SLOT_LOADING, pinned by the
 * batch that queued it); nobody else touches its bytes until it is READY.
 */
#ifndef K3_EXPERTS_INT_H
#define K3_EXPERTS_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "common/base/limits.h"
#include "common/experts/experts.h"

#define EXP_ALIGN 4096 /* O_DIRECT alignment of buffer, offset and length */

extern const char *const k3_exp_part_name[K3_EXP_PARTS];

typedef struct exp_loc {
    int shard[K3_EXP_PARTS];    /* shard index of each part */
    uint64_t off[K3_EXP_PARTS]; /* absolute file offset of each part */
    uint8_t present;            /* 0: absent from the checkpoint */
    uint8_t contiguous;         /* 1: parts back to back in slot order, one shard */
    int16_t drive;              /* placement drive holding it (read from that drive's copy of
                                   the shard, same offsets); -1 = the checkpoint's shard (or
                                   split) */
    uint8_t split;              /* byte-split placement: a piece on every drive (k3_placement_piece
                                   of the span: the expert when contiguous, else each part) */
} exp_loc;

enum { EXP_SLOT_EMPTY = 0, EXP_SLOT_LOADING, EXP_SLOT_READY, EXP_SLOT_FAILED };

typedef struct exp_slot {
    int32_t expert;     /* expert held or being read, -1 = empty */
    int state;          /* EXP_SLOT_* */
    int pins;           /* batch items holding it */
    uint64_t last_use;  /* layer clock at last admission (LRU) */
    unsigned char *buf; /* owned, EXP_ALIGN-aligned, slot_bytes; allocated on first read */
    size_t data_off;    /* the expert's first byte inside buf */
} exp_slot;

typedef struct exp_layer {
    int loaded;           /* k3_experts_load_layer ran */
    exp_loc *loc;         /* [n_experts] */
    int32_t *order;       /* [n_experts] ids in disk order, missing last */
    int32_t *rank;        /* [n_experts] position of each id in order */
    int32_t *slot_of;     /* [n_experts] slot holding (or reading) the expert, -1 none */
    uint64_t *usage;      /* [n_experts] times used (history included) */
    uint64_t *usage_base; /* [n_experts] of usage, the part already in the history file
                             (loaded or saved); a save adds usage - usage_base */
    exp_slot *slots;      /* [n_slots] */
    int n_slots;
    uint64_t clock;     /* admissions so far (LRU time) */
    int warned_scale;   /* a 0/255 scale byte was reported for this layer */
    pthread_mutex_t mu; /* guards everything above except loc/order/rank */
    pthread_cond_t cv;  /* broadcast on every slot state change and unpin */
} exp_layer;

/* One read of a drive's queue: a whole expert (piece -1), or drive
 * `drive`'s piece of a split expert. Written by the queuer before it is
 * queued; t0_ms by the loader that runs it. */
typedef struct exp_job {
    struct exp_item *it;
    int drive;            /* queue; for a piece, the drive whose file is read */
    int piece;            /* 1: a piece of a split expert, 0: the whole expert */
    double t0_ms;         /* read start */
    struct exp_job *next; /* loader queue link */
} exp_job;

/* One expert of a batch; its jobs are the loader's work. */
typedef struct exp_item {
    int32_t id;
    int slot;                 /* -1 until admitted */
    int miss;                 /* this batch queued the read */
    int reading;              /* queued or being read (guarded by the layer mutex) */
    int put;                  /* released by the consumer */
    int admitted;             /* has its slot or staging entry */
    int got;                  /* handed out (batch_get / batch_next) */
    int stg;                  /* staging entry of an any-order batch, -1 = a cache slot */
    k3_status st;             /* read result (loader) */
    char err[320];            /* read error message (loader; of a split expert, the first failed
                                 piece's: err_claimed) */
    exp_job job[K3_MAX_DIRS]; /* [1] whole, or one per non-empty piece of a split expert */
    int n_jobs;
    _Atomic int jobs_left;   /* pieces not yet read; the loader taking it to 0 completes */
    _Atomic int err_claimed; /* a failed piece wrote st/err */
    struct k3_expert_batch *b;
} exp_item;

struct k3_expert_batch {
    k3_experts *s;
    exp_layer *L;
    int layer;
    int n;           /* items */
    exp_item *items; /* [n] owned */
    int32_t *wanted; /* [n_experts] position + 1 in this batch while still to be
                      * used, 0 = not (any more) */
    int next_admit;  /* items [0, next_admit) admitted */
    int next_get;    /* the consumer's position */
    int held;        /* admitted and not put */
    int reads_in_flight;
    double io_t0;         /* first read start of the current busy period, ms */
    k3_expert_stats st;   /* this batch's counters */
    k3_expert_stats *out; /* caller's stats, may be NULL */
    int quiet;            /* 1: not added to the store's totals (warm start reads) */
    /* any-order batches (k3_experts_batch_open_any) */
    int unordered;    /* opened with _any: batch_next hands out ready experts */
    int staged;       /* unordered and striped: misses go to staging entries */
    exp_slot *stg;    /* [drives * read_depth] staging entries, drive d's at [d * depth ..) */
    uint8_t *stg_on;  /* [same] entry holds an item */
    uint8_t *stg_res; /* [same] entry holds a reservation of the store's staging pool */
    int stg_used[K3_MAX_DIRS]; /* entries in use per drive */
    int n_got;
};

/* A read queue and its loader threads. */
typedef struct exp_queue {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    exp_job *head, *tail; /* FIFO of reads, in the order queued */
    int stop;
    int init; /* mutex/cv initialised */
    int n_loaders;
    pthread_t loaders[K3_MAX_LOAD_THREADS];
    struct k3_experts *s;
} exp_queue;

/* One placement drive's copies of the shards, opened as layers load:
 * fd[shard] buffered, dfd[shard] O_DIRECT (-1 where refused), -1 = not
 * opened yet. Written only by k3_experts_load_layer (one thread, before
 * any batch), read by the loaders. */
typedef struct exp_drive {
    int *fd, *dfd; /* [st_shard_count] */
    int n;
} exp_drive;

struct k3_experts {
    st_index *idx; /* borrowed */
    k3_config cfg; /* copy */
    int layer_a, layer_b;
    k3_expert_geom geom;
    size_t slot_bytes; /* buffer size of one slot */
    int direct;        /* try O_DIRECT reads */
    int pipe;          /* K3_PIPE */
    exp_layer *layers; /* [layer_b - layer_a] */
    pthread_mutex_t stats_mu;
    k3_expert_stats totals;
    /* loader threads (expert_io.c): one read queue per drive (one without a
     * placement), each with its own threads, so every drive has reads in
     * flight at once */
    exp_queue queues[K3_MAX_DIRS];
    int n_queues;
    /* expert striping (expert_stripe.c): borrowed placement, NULL = none */
    const struct k3_placement *placement;
    uint32_t drive_mask;               /* k3_experts_opts.drive_mask: drives read here, 0 = all */
    exp_drive drives[K3_MAX_DIRS];     /* [placement drives] */
    uint64_t drive_bytes[K3_MAX_DIRS]; /* bytes read per queue (stats_mu) */
    /* staging pool of any-order batches (experts.c): buffers reserved by
     * batches or free for reuse; stage_mu is taken alone or inside a layer
     * mutex (order: layer, then stage_mu) */
    int read_depth; /* per drive, 0 = no staging */
    pthread_mutex_t stage_mu;
    unsigned char **stage_free; /* [stage_cap] buffers free for reuse */
    int n_stage_free;
    int stage_bufs; /* reservations held by batches + free buffers */
    int stage_cap;  /* drives x read_depth x 2 */
};

/* The buffer an item's read goes to: its staging entry or its cache slot. */
static inline exp_slot *exp_item_slot(exp_item *it) {
    return it->stg >= 0 ? &it->b->stg[it->stg] : &it->b->L->slots[it->slot];
}

/* expert_io.c */
k3_status exp_loaders_start(k3_experts *s, int n, char *err, size_t errlen);
void exp_loaders_stop(k3_experts *s);
/* Queues the item's read: one job, or one per non-empty piece of a split
 * expert on each drive's queue (caller holds it->b->L->mu; the item is
 * admitted). */
void exp_queue_read(k3_experts *s, exp_item *it);
/* Reads expert e of `layer` into slot (allocating its buffer). Errors name
 * the layer, the expert, the part (six-read layout) and the shard. */
k3_status exp_read_expert(k3_experts *s, int layer, int32_t e, const exp_loc *loc, exp_slot *slot,
                          char *err, size_t errlen);
/* Buffered reads only: asks the kernel to start reading expert e. */
void exp_advise(k3_experts *s, const exp_loc *loc);
/* The loader's completion (expert_io.c calls it, experts.c defines it):
 * records the result under the layer mutex and wakes the consumer. */
void exp_read_done(exp_item *it, k3_status st, double t0_ms, double t1_ms);

/* expert_stripe.c */
/* Opens (once) drive d's copy of the shard and checks its size against the
 * checkpoint's: a missing or short file is refused naming it, the layer and
 * the expert. */
k3_status exp_stripe_open(k3_experts *s, int d, int shard, int layer, int32_t e, char *err,
                          size_t errlen);
void exp_stripe_close(k3_experts *s);
/* pread loop on drive d's copy of shard (direct: its O_DIRECT fd, buffer,
 * offset and length aligned); errors name the file. */
k3_status exp_stripe_pread(k3_experts *s, int d, int shard, uint64_t off, void *buf, size_t len,
                           int direct, char *err, size_t errlen);
int exp_stripe_fd(const k3_experts *s, int d, int shard, int direct);

/* experts.c */
exp_layer *exp_layer_of(const k3_experts *s, int layer);

#endif
