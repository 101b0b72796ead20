/* coordinator/cluster_impl.h: the cluster's private types, shared by the
 * files of one module split along its seams: cluster.c (the I/O thread,
 * links, steps, trunk operations), cluster_local.c (local worker processes)
 * and cluster_stats.c (introspection, --stats). Not for other modules: the
 * public boundary is cluster.h.
 *
 * Locking: every field of k3_cluster and of the objects it reaches is
 * guarded by k3_cluster.mu, except the sockets, which only the I/O thread
 * touches, and the fields set once before the I/O thread starts.
 */
#ifndef K3_CLUSTER_IMPL_H
#define K3_CLUSTER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "coordinator/cluster.h"
#include "proto/link.h"

typedef enum { LINK_DOWN = 0, LINK_HELLO, LINK_READY } link_state;

struct cl_job;

typedef struct cl_req { /* one request in flight on one stage */
    proto_msg msg;      /* as sent: replies are checked against it */
    struct cl_job *job; /* FORWARD: the job, else NULL */
    int chunk;          /* FORWARD: chunk index */
    struct cl_ctl *ctl; /* a caller waiting for the reply (STATS), else NULL */
    double sent_ms;
    int idle_send; /* no other step was pending on the stage when sent */
    struct cl_req *next;
} cl_req;

typedef struct cl_stage {
    char endpoint[K3_MAX_ENDPOINT];
    char server_key[K3_Z85_KEY_LEN + 1]; /* CURVE server key, "" = plain */
    int a, b;                            /* layer range (from HELLO_OK), -1 before */
    int k;                               /* AttnRes snapshots of [a, b) */
    char name[K3_PROTO_MAX_NAME];
    link_state state;
    int refused;      /* definitive refusal (mismatch, auth): open fails */
    void *sock, *mon; /* DEALER and its monitor PAIR */
    int gen;          /* sockets created (monitor endpoint names) */
    uint64_t epoch;   /* epoch of the current HELLO / registration */
    double hello_sent_ms, next_try_ms;
    double last_rx_ms, last_tx_ms;
    char last_err[512];
    cl_req *pending;            /* requests without a reply yet */
    int n_pending;              /* of which FORWARDs (occupancy counts steps only) */
    double progress_ms;         /* last sign that pending steps advance (see link_timers) */
    proto_hello_ok info;        /* the last HELLO_OK */
    int ver_minor;              /* its protocol minor (CHECKPOINT needs 1.2) */
    pid_t pid;                  /* local worker, 0 otherwise */
    int registered_since_spawn; /* local: a HELLO_OK came since the last start */
    int restarts;               /* local: times it was restarted after dying */
    int displaced;              /* another coordinator took the worker: never retried */
    /* statistics */
    uint64_t forwards, tokens, bytes_read, hits, misses, dropped, failures, bad_replies;
    /* expert striping (FORWARD_DONE's 1.2 stats keys) */
    int n_drives;                      /* drives the worker reported, 0 = none */
    uint64_t drive_bytes[K3_MAX_DIRS]; /* bytes per placement drive, summed */
    double gather_ms;                  /* waits on stripe peers' expert calls */
    uint64_t gather_layers;            /* MoE layer steps that called a peer */
    /* the worker's Vulkan tier (FORWARD_DONE's 1.2 vk_* keys), summed */
    uint64_t vk_calls, vk_pairs, vk_promotions, vk_steps; /* vk_steps: with device calls */
    uint32_t vk_resident;                                 /* the last step's */
    double vk_device_ms, vk_cpu_ms, vk_wait_ms;
    uint64_t tx_bytes, rx_bytes; /* tensor frame bytes of FORWARD / FORWARD_DONE */
    double busy_ms, read_ms, occupied_ms, occ_since_ms;
    double hop_ms;  /* sum of (round trip - worker time) over idle sends */
    uint64_t hop_n; /* steps in hop_ms */
} cl_stage;

typedef struct cl_sess {
    uint64_t id;
    int max_ctx;
    int pos;                  /* tokens committed on every stage */
    int broken;               /* a step failed midway */
    int lost;                 /* a worker lost its state (eviction, new epoch) */
    int reset_pending;        /* send SESSION_RESET before the next step */
    int used;                 /* a step was ever sent (workers may hold state) */
    int busy;                 /* a job is running */
    const atomic_int *cancel; /* the caller's flag while a step runs (set_cancel), may be NULL */
    uint64_t step;            /* step counter (one per micro-chunk) */
    uint64_t *epoch;          /* [n stages, layer order]: epoch its state lives in */
    struct cl_sess *next;
} cl_sess;

typedef struct cl_chunk {
    int t0, T;     /* rows [t0, t0 + T) of the job */
    float *blocks; /* [nb_cap][T][D], inside job->buf */
    float *h;      /* [T][D] */
    int nb;        /* blocks valid */
    int pos;       /* next stage (layer order) to visit */
    uint64_t step;
} cl_chunk;

typedef struct cl_job {
    cl_sess *sess;
    int pos0, T;
    float *blocks; /* caller's [K3_MAX_RES_ENTRIES][T][D] */
    int nb_in, nb_out;
    float *h;       /* caller's [T][D] */
    float *trace_h; /* [n stages][T][D] when tracing, else NULL */
    int n_chunks, chunks_done, nb_cap;
    cl_chunk *chunk;
    float *buf;
    k3_step_stats stats;
    double wait_until_ms; /* waiting for workers to register until then */
    int started, finished;
    int cancel_req; /* the caller's cancel flag was seen: the I/O thread fails the job */
    k3_status st;
    char err[1024];
    struct cl_job *next;
} cl_job;

typedef struct cl_ctl { /* a control request from a caller thread */
    int stage;          /* layer order */
    proto_type type;    /* STATS, CHECKPOINT, RESTORE (a caller waits), SESSION_DROP (nobody) */
    uint64_t session;   /* SESSION_DROP, CHECKPOINT, RESTORE: the session */
    uint64_t epoch;     /* the same: only while the link is in this epoch */
    uint32_t n, keep;   /* CHECKPOINT, RESTORE: position; CHECKPOINT: count kept */
    uint64_t key;       /* CHECKPOINT, RESTORE: the parked checkpoint's key (1.3), 0 = none */
    int owned;          /* nobody waits: the I/O thread frees it */
    int done;
    k3_status st;
    char err[512];
    proto_stats_ok stats;
    struct cl_ctl *next;
} cl_ctl;

struct k3_cluster {
    k3_cluster_opts o; /* pointers borrowed */
    k3_config cfg;
    int D;
    uint64_t fp;
    proto_numerics num;
    k3_link_sockopts so;
    int curve;
    k3_curve_keypair kp;
    void *ctx;
    int n;
    cl_stage *st; /* [n] in endpoint order */
    int *order;   /* [n] stage index by layer order */
    int ordered;
    pthread_t io;
    int io_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int efd;
    int stopping;
    cl_job *incoming, *active;
    cl_ctl *ctl_in;
    cl_sess *sessions;
    uint64_t next_id, next_sess, epoch_seed, epoch_ctr, losses;
    double overlap_ms, occ_last_ms;
    int n_occupied;
    char tmpdir[64]; /* local workers' ipc directory */
    int xs_drives;   /* --stripe-remote: drives of the placement dealt to the local workers */
    /* --local: the I/O thread starts the workers (PR_SET_PDEATHSIG follows
     * the spawning thread, and the I/O thread lives as long as they do) */
    int spawn_pending;
    k3_status spawn_st;
    char spawn_err[512];
};

/* snprintf that truncates quietly: messages are bounded on purpose */
void cl_fmt(char *dst, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "worker NAME (layers [a, b), ENDPOINT)" into buf; returns buf */
const char *cl_stage_label(const cl_stage *s, char *buf, size_t n);
/* Wakes the I/O thread (c->mu held or not). */
void cl_wake(k3_cluster *c);
/* Adds a FORWARD_DONE's striping figures (1.2 stats keys) to the stage's
 * totals (cluster_stats.c); under the cluster mutex. */
void cl_stage_add_drives(cl_stage *s, const proto_forward_done *d);
void cl_stage_add_vk(cl_stage *s, const proto_forward_done *d);

/* cluster_wait.c: one line per stage not registered yet, naming its
 * endpoint and layers, how long it has been silent and how long is left
 * (c->mu held). */
void cl_wait_log(const k3_cluster *c, double waited_ms, double left_ms, const char *deadline_opt);

/* cluster_local.c: start the --local workers (before the I/O thread) and
 * stop them (after it ended). */
k3_status cl_local_start(k3_cluster *c, char *err, size_t errlen);
void cl_local_stop(k3_cluster *c);
/* I/O thread, c->mu held: has local worker i exited? 0 = no (or not a
 * local worker); 1 = it died after serving and was started again; -1 = it
 * died before registering (or could not be started again): not restarted.
 * why says what happened, with the pid and the exit status or signal. */
int cl_local_reap(k3_cluster *c, int i, char *why, size_t cap);

/* cluster_ckpt.c: the trunk's checkpoint operations (generate.h) on the
 * workers (CHECKPOINT / RESTORE, PROTOCOL.md "Checkpoints"). */
k3_status cl_tr_ckpt_save(k3_trunk *t, void *state, int keep, uint64_t key, void **ck, char *err,
                          size_t errlen);
/* A checkpoint parked under key at pos (RESTORE with the key on every
 * worker, each from memory or its --ckpt-dir); f is unused. */
k3_status cl_tr_state_load(k3_trunk *t, void *state, FILE *f, int pos, uint64_t key, char *err,
                           size_t errlen);
k3_status cl_tr_ckpt_restore(k3_trunk *t, void *state, const void *ck, char *err, size_t errlen);
void cl_tr_ckpt_free(k3_trunk *t, void **ck);

#endif
