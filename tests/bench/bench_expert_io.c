/* tests/bench/bench_expert_io.c: loader threads vs io_uring for the expert
 * read path (`make bench-experts` runs it after bench_experts). Not a test.
 *
 *   bench_expert_io MODEL_DIR [--passes 2]
 *
 * One trial = the reads of one MoE step: 16 experts of one layer (one half
 * of its experts), each one O_DIRECT read of the whole 17.5 MB expert
 * (aligned down / rounded up to 4 KiB like common/experts/expert_io.c), issued in
 * disk order, into 16 aligned buffers. Engines:
 *   threads N  N threads, each taking the next expert and issuing one pread
 *              (the store's loaders, K3_LOAD_THREADS = N)
 *   uring Q    one thread, io_uring with up to Q reads in flight, a new one
 *              submitted as each completes (short reads resubmitted)
 *   seq Q      the fio-like reference: the same bytes count read as one
 *              contiguous run of expert-sized blocks from the trial's
 *              first expert on, io_uring depth Q (what fio --rw=read
 *              measures, but in the same drive state as the engines)
 * The engines take turns trial by trial over every (layer, half), so each
 * sees the same drift of the (virtual) drive and its host cache. Prints
 * one line per engine: GB/s mean, min, max over its trials.
 */
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/experts/experts.h"
#include "common/base/log.h"
#include "common/ckpt/safetensors.h"

#define ALIGN  4096u
#define N_READ 16

static char err[1024];

typedef struct span {
    int fd;       /* O_DIRECT fd of the shard */
    int shard;    /* its index */
    uint64_t off; /* aligned start */
    size_t len;   /* aligned length */
} span;

typedef struct trial {
    span sp[N_READ];
    unsigned char *buf[N_READ];
    atomic_int next;
    int failed;
} trial;

static int read_full(int fd, unsigned char *buf, size_t len, uint64_t off) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, buf + done, len - done, (off_t)(off + done));
        if (r <= 0) return -1;
        done += (size_t)r;
    }
    return 0;
}

static void *reader(void *arg) {
    trial *t = arg;
    for (;;) {
        int i = atomic_fetch_add(&t->next, 1);
        if (i >= N_READ) return NULL;
        if (read_full(t->sp[i].fd, t->buf[i], t->sp[i].len, t->sp[i].off)) t->failed = 1;
    }
}

static double run_threads(trial *t, int n) {
    pthread_t th[16];
    atomic_store(&t->next, 0);
    double t0 = k3_now_ms();
    for (int k = 0; k < n; k++) pthread_create(&th[k], NULL, reader, t);
    for (int k = 0; k < n; k++) pthread_join(th[k], NULL);
    return k3_now_ms() - t0;
}

static double run_uring(trial *t, int qd) {
    struct io_uring ring;
    int rc = io_uring_queue_init((unsigned)qd, &ring, 0);
    if (rc < 0) {
        fprintf(stderr, "bench_expert_io: io_uring_queue_init(%d): %s\n", qd, strerror(-rc));
        t->failed = 1;
        return 0;
    }
    size_t done[N_READ] = {0};
    int next = 0, in_flight = 0, finished = 0;
    double t0 = k3_now_ms();
    while (finished < N_READ && !t->failed) {
        while (next < N_READ && in_flight < qd) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            io_uring_prep_read(sqe, t->sp[next].fd, t->buf[next], (unsigned)t->sp[next].len,
                               t->sp[next].off);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            next++, in_flight++;
        }
        io_uring_submit(&ring);
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe(&ring, &cqe) < 0) {
            t->failed = 1;
            break;
        }
        int i = (int)io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        in_flight--;
        if (res <= 0) {
            t->failed = 1;
            break;
        }
        done[i] += (size_t)res;
        if (done[i] < t->sp[i].len) { /* short read: the rest */
            struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
            io_uring_prep_read(sqe, t->sp[i].fd, t->buf[i] + done[i],
                               (unsigned)(t->sp[i].len - done[i]), t->sp[i].off + done[i]);
            io_uring_sqe_set_data64(sqe, (uint64_t)i);
            in_flight++;
        } else {
            finished++;
        }
    }
    double ms = k3_now_ms() - t0;
    io_uring_queue_exit(&ring);
    return ms;
}

typedef struct place {
    int shard;
    uint64_t off;
} place;

static int place_cmp(const void *pa, const void *pb) {
    const place *a = pa, *b = pb;
    if (a->shard != b->shard) return a->shard < b->shard ? -1 : 1;
    return a->off < b->off ? -1 : a->off > b->off;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_expert_io MODEL_DIR [--passes N]\n");
        return 2;
    }
    int passes = 2;
    for (int i = 2; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--passes")) passes = atoi(argv[i + 1]);
    k3_config cfg;
    st_index *idx = NULL;
    st_open_opts so = {argv[1], NULL, 0};
    if (k3_config_load(&cfg, argv[1], 0, err, sizeof err) || st_open(&idx, &so, err, sizeof err)) {
        fprintf(stderr, "bench_expert_io: %s\n", err);
        return 1;
    }
    k3_expert_geom g;
    k3_expert_geom_init(&g, &cfg);
    if (cfg.n_experts < 2 * N_READ) {
        fprintf(stderr, "bench_expert_io: needs >= %d experts per layer, %s has %d\n", 2 * N_READ,
                argv[1], cfg.n_experts);
        return 1;
    }
    /* the trials: (layer, half) -> 16 experts in disk order; shards sorted
     * by index here (one process, so any fixed order is disk order) */
    int n_trials = 0;
    span(*sets)[N_READ] = calloc((size_t)cfg.n_layers * 2, sizeof *sets);
    for (int l = 0; l < cfg.n_layers; l++) {
        if (!cfg.is_moe[l]) continue;
        for (int half = 0; half < 2; half++) {
            place p[N_READ];
            for (int k = 0; k < N_READ; k++) {
                char name[256];
                snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.%d.%s",
                         st_prefix(idx), l, half * N_READ + k, "w1.weight_packed");
                const st_tensor *t;
                if (st_find(idx, name, &t, err, sizeof err)) {
                    fprintf(stderr, "bench_expert_io: %s\n", err);
                    return 1;
                }
                p[k] = (place){t->shard, t->offset};
            }
            qsort(p, N_READ, sizeof *p, place_cmp);
            for (int k = 0; k < N_READ; k++) {
                uint64_t a = p[k].off & ~(uint64_t)(ALIGN - 1);
                uint64_t end = (p[k].off + g.total + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
                uint64_t full = st_shard_size(idx, p[k].shard) & ~(uint64_t)(ALIGN - 1);
                if (end > full) end = full; /* the partial last block is not read here */
                int fd = st_shard_fd(idx, p[k].shard, 1);
                if (fd < 0) {
                    fprintf(stderr, "bench_expert_io: shard %s has no O_DIRECT fd\n",
                            st_shard_name(idx, p[k].shard));
                    return 1;
                }
                sets[n_trials][k] = (span){fd, p[k].shard, a, (size_t)(end - a)};
            }
            n_trials++;
        }
    }
    trial t;
    memset(&t, 0, sizeof t);
    for (int k = 0; k < N_READ; k++)
        if (posix_memalign((void **)&t.buf[k], ALIGN, g.total + 2 * ALIGN)) return 1;

    enum { N_ENG = 8 };
    static const char *names[N_ENG] = {"threads 1",  "threads 2",   "threads 4", "threads 8",
                                       "uring qd 4", "uring qd 16", "seq qd 4",  "seq qd 16"};
    static const int arg[N_ENG] = {1, 2, 4, 8, 4, 16, 4, 16};
    double sum[N_ENG] = {0}, lo[N_ENG], hi[N_ENG] = {0};
    int cnt[N_ENG] = {0};
    for (int e = 0; e < N_ENG; e++) lo[e] = 1e30;
    for (int pass = 0; pass < passes; pass++)
        for (int tr = 0; tr < n_trials; tr++)
            for (int k = 0; k < N_ENG; k++) {
                /* rotate who goes first so no engine always follows another */
                int e = (k + tr + pass) % N_ENG;
                memcpy(t.sp, sets[tr], sizeof t.sp);
                if (e >= 6) { /* contiguous expert-sized blocks from the first expert on */
                    uint64_t total = 0;
                    for (int i = 0; i < N_READ; i++) total += t.sp[i].len;
                    uint64_t full = st_shard_size(idx, t.sp[0].shard) & ~(uint64_t)(ALIGN - 1);
                    uint64_t at = t.sp[0].off, blk = total / N_READ & ~(uint64_t)(ALIGN - 1);
                    if (at + total > full) at = (full - total) & ~(uint64_t)(ALIGN - 1);
                    for (int i = 0; i < N_READ; i++)
                        t.sp[i] =
                            (span){t.sp[0].fd, t.sp[0].shard, at + (uint64_t)i * blk, (size_t)blk};
                }
                t.failed = 0;
                double ms = e < 4 ? run_threads(&t, arg[e]) : run_uring(&t, arg[e]);
                if (t.failed) {
                    fprintf(stderr, "bench_expert_io: %s: a read failed\n", names[e]);
                    return 1;
                }
                uint64_t bytes = 0;
                for (int i = 0; i < N_READ; i++) bytes += t.sp[i].len;
                double gbps = (double)bytes / 1e6 / ms;
                sum[e] += gbps, cnt[e]++;
                if (gbps < lo[e]) lo[e] = gbps;
                if (gbps > hi[e]) hi[e] = gbps;
            }
    printf("io_trials %d x %d reads of %.2f MB, %d passes\n", n_trials, N_READ, g.total / 1e6,
           passes);
    for (int e = 0; e < N_ENG; e++)
        printf("io %-12s mean %.3f GB/s  min %.3f  max %.3f  (%.1f ms per 16 experts)\n", names[e],
               sum[e] / cnt[e], lo[e], hi[e], N_READ * g.total / 1e6 / (sum[e] / cnt[e]));
    for (int k = 0; k < N_READ; k++) free(t.buf[k]);
    free(sets);
    st_close(&idx);
    return 0;
}
