/* coordinator/cluster.h: the layer stack run by k3-worker processes, behind
 * the trunk interface of coordinator/generate.h (ARCHITECTURE.md "One
 * forward step", "Pipelining", "Sessions and recovery").
 *
 * Owns: one DEALER socket per worker (plus its socket monitor), the link
 * state of each worker (registration by HELLO with a fresh epoch, liveness by
 * ZMTP heartbeats, application HEARTBEAT and a per-step deadline, automatic
 * re-registration), the stage order (workers sorted by layer range, covering
 * [0, n_layers) exactly once), the steps in flight and their buffers, each
 * session's position and the epochs its worker states live in, per-stage
 * statistics, and (with --local N) the worker processes it started.
 * Borrows: the coordinator's model options and config (numeric settings and
 * fingerprint to compare in HELLO); the caller's step buffers during a call.
 * Threads: one I/O thread owns every socket. k3_cluster_* and the trunk's
 * operations may be called from any thread; calls on different sessions run
 * concurrently and their steps interleave on the workers; one session is
 * used by one thread at a time (generate.h's rule).
 *
 * Failure semantics: a worker that dies, stalls or breaks its link fails
 * every step that still needs it within 2 x TTL (TTL = 3 x heartbeat) for a
 * dead process and within the step deadline for a stuck one, with an error
 * naming the worker, its layers and endpoint; nothing hangs. The link
 * re-registers by itself when the worker comes back (new epoch: the worker
 * drops its states and nothing of its old life is delivered); sessions whose
 * states were lost fail their next step with K3_ERR_STATE until they are
 * reset, and k3_cluster_generate resumes a generation by resetting the
 * session and replaying its committed ids, which is exact because every
 * step is deterministic.
 *
 * Not handled: several coordinators sharing one worker (the newest HELLO
 * wins), routing look-ahead. Turn checkpoints live on the workers
 * (cluster_ckpt.c, CHECKPOINT / RESTORE): a diverging prompt restores the
 * deepest one within the common prefix, else it resets.
 */
#ifndef K3_CLUSTER_H
#define K3_CLUSTER_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "common/ckpt/config.h"
#include "common/base/err.h"
#include "common/base/opts.h"
#include "common/engine/model.h"
#include "coordinator/generate.h"
#include "proto/link.h"
#include "proto/proto.h"

typedef struct k3_cluster k3_cluster;

/* Timings and retry counts: each #define is the one default, of
 * k3_cluster_opts_default and of the coordinator's option rows alike. */
#define K3_CLUSTER_STEP_TIMEOUT_MS  30000  /* steps pending, no progress this long: stalled */
#define K3_CLUSTER_READY_TIMEOUT_MS 600000 /* k3_cluster_open waits this long for all */
#define K3_CLUSTER_WAIT_LOG_MS      5000   /* ... saying who it waits for this often */
#define K3_CLUSTER_RETRY_LOST_MS    100    /* a lost link registers again after this */
#define K3_CLUSTER_RETRY_OPEN_MS    1000   /* a socket that could not be set up: retried */
#define K3_CLUSTER_RETRY_REFUSED_MS 5000   /* a refused registration: retried after this */
#define K3_CLUSTER_HELLO_MIN_MS     2000   /* a HELLO waits at least this (else 2 x TTL) */
#define K3_CLUSTER_RESUMES          3      /* k3_cluster_generate's resumes per generation */
#define K3_CLUSTER_RESUME_WAIT_MS   60000  /* ... each waiting this long for the workers */

/* How the links retry, and how a generation resumes (resumes and
 * resume_wait_ms are the caller's arguments to k3_cluster_generate). */
typedef struct k3_cluster_retry {
    int lost_ms;        /* a lost link's next registration attempt, after this */
    int open_ms;        /* a socket that failed to set up or connect: next attempt */
    int refused_ms;     /* a worker that refused our HELLO: next attempt */
    int hello_min_ms;   /* least wait for HELLO_OK before a fresh socket (else 2 x TTL) */
    int handshake_ms;   /* ZMQ_HANDSHAKE_IVL: a stuck CURVE handshake fails after this */
    int resumes;        /* generations resume at most this many times */
    int resume_wait_ms; /* each resume waits this long for every worker */
} k3_cluster_retry;

/* The rows of the coordinator's table for a k3_cluster_retry member f of T
 * (common/base/opts.h): the two a user may want as flags, the back-offs as
 * variables only. */
// clang-format off
#define K3_CLUSTER_OPT_RETRY_ROWS(T, f)                                                            \
    {.name = "resumes", .flag = "--resumes", .env = "K3_RESUMES", .type = K3_OPT_INT,             \
     .offset = offsetof(T, f.resumes), .def = K3_OPT_STR(K3_CLUSTER_RESUMES), .min = 0,           \
     .max = 1000, .metavar = "N",                                                                 \
     .help = "times a generation resumes (reset + replay) after losing a worker"},                \
    {.name = "resume_wait_ms", .flag = "--resume-wait-ms", .env = "K3_RESUME_WAIT_MS",             \
     .type = K3_OPT_INT, .offset = offsetof(T, f.resume_wait_ms),                                 \
     .def = K3_OPT_STR(K3_CLUSTER_RESUME_WAIT_MS), .min = 0, .max = 3600000, .metavar = "MS",     \
     .help = "a resume waits this long for every worker to be back"},                             \
    {.name = "retry_lost_ms", .env = "K3_RETRY_LOST_MS", .type = K3_OPT_INT,                       \
     .offset = offsetof(T, f.lost_ms), .def = K3_OPT_STR(K3_CLUSTER_RETRY_LOST_MS), .min = 0,     \
     .max = 60000, .metavar = "MS", .help = "a lost link registers again after this"},            \
    {.name = "retry_open_ms", .env = "K3_RETRY_OPEN_MS", .type = K3_OPT_INT,                       \
     .offset = offsetof(T, f.open_ms), .def = K3_OPT_STR(K3_CLUSTER_RETRY_OPEN_MS), .min = 0,     \
     .max = 60000, .metavar = "MS",                                                               \
     .help = "a worker socket that could not be set up is tried again after this"},               \
    {.name = "retry_refused_ms", .env = "K3_RETRY_REFUSED_MS", .type = K3_OPT_INT,                 \
     .offset = offsetof(T, f.refused_ms), .def = K3_OPT_STR(K3_CLUSTER_RETRY_REFUSED_MS),         \
     .min = 0, .max = 600000, .metavar = "MS",                                                    \
     .help = "a worker that refused registration is asked again after this"},                     \
    {.name = "hello_min_ms", .env = "K3_HELLO_MIN_MS", .type = K3_OPT_INT,                         \
     .offset = offsetof(T, f.hello_min_ms), .def = K3_OPT_STR(K3_CLUSTER_HELLO_MIN_MS),           \
     .min = 100, .max = 600000, .metavar = "MS",                                                  \
     .help = "least wait for HELLO_OK before a fresh socket (else 2 x TTL)"},                     \
    {.name = "handshake_ms", .env = "K3_HANDSHAKE_MS", .type = K3_OPT_INT,                         \
     .offset = offsetof(T, f.handshake_ms), .def = K3_OPT_STR(K3_LINK_HANDSHAKE_MS_DEFAULT),      \
     .min = 100, .max = 600000, .metavar = "MS",                                                  \
     .help = "a ZMTP/CURVE handshake with a worker fails after this"}
// clang-format on

typedef struct k3_cluster_opts {
    /* Where the workers are: endpoints to connect to, or, when n_workers is
     * 0, `local` worker processes this cluster starts over ipc:// with an
     * even split of the layers (local >= 1). */
    const char *const *workers; /* [n_workers] endpoints, borrowed */
    int n_workers;
    int local;
    /* What the workers must agree with (HELLO): the coordinator's model
     * options (numerics, topp, model_dir, dirs, threads for local workers) */
    const k3_model_opts *model; /* borrowed */
    int exact;                  /* the --exact switch */
    /* Local workers */
    const char *worker_bin;         /* NULL: k3-worker next to this program (k3_worker_bin) */
    const char *const *worker_args; /* extra arguments for every local worker, borrowed */
    int n_worker_args;
    int worker_threads;   /* --threads of each local worker, 0 = the model's threads */
    int max_sessions;     /* --max-sessions of local workers, 0 = worker default */
    int max_ctx;          /* --max-ctx of local workers, 0 = worker default */
    const char *ckpt_dir; /* local workers park turn checkpoints in ckpt_dir/w<i>-<a>-<b>
                             (their --ckpt-dir), NULL = in memory only */
    int ckpt_files;       /* their --ckpt-files when ckpt_dir is set, 0 = worker default */
    int stripe_remote;    /* with a placement: local worker i reads and serves the drives
                             d % local == i for every MoE layer and calls the others for
                             the rest (worker/xstripe.h); 0 = each reads every drive */
    /* Liveness and scheduling */
    int hb_ms;              /* heartbeat interval (TTL = 3 x hb_ms), K3_LINK_HB_MS_MIN..MAX */
    int step_timeout_ms;    /* a worker silent this long with work pending is stalled */
    int ready_timeout_ms;   /* k3_cluster_open waits this long for every worker */
    int request_wait_ms;    /* a step waits this long for a re-registering worker */
    int pipe_chunk;         /* tokens per pipelined micro-chunk; 0 = split each call
                               into one piece per stage (at least 8 tokens each) */
    k3_cluster_retry retry; /* back-offs (K3_CLUSTER_RETRY_*) */
    /* Transport security */
    int insecure;             /* allow plain tcp off loopback */
    const char *curve_secret; /* our key pair file (mode 0600) */
    const char *worker_keys;  /* lines "ENDPOINT|* Z85-public-key" */
} k3_cluster_opts;

/* The trunk as the command lines take it (k3-coordinator and its serve
 * subcommand share these rows, so each has one default and one help text):
 * local workers or remote endpoints, liveness, transport security, the
 * local worker program and the back-offs. */
typedef struct k3_cluster_cli {
    int local;              /* local worker processes, 0 = the layers in-process */
    k3_opt_list workers;    /* remote endpoints; replace --local */
    int hb_ms;              /* heartbeat interval; TTL = 3 x */
    int step_timeout_ms;    /* a worker without progress this long is stalled */
    int insecure;           /* allow plain tcp off loopback */
    char *curve_secret;     /* our CURVE key pair file */
    char *worker_keys;      /* "ENDPOINT|* KEY" lines */
    char *worker_bin;       /* NULL = k3-worker next to this program */
    k3_cluster_retry retry; /* back-offs and resumes */
    int ready_timeout_ms;   /* start-up: every worker registered within this */
} k3_cluster_cli;

// clang-format off
/* --worker-keys (a char * field f of T): also `k3-coordinator status`'s. */
#define K3_CLUSTER_OPT_WORKER_KEYS(T, f)                                                           \
    {.name = "worker_keys", .flag = "--worker-keys", .env = "K3_WORKER_KEYS",                      \
     .type = K3_OPT_STRING, .offset = offsetof(T, f), .metavar = "FILE",                          \
     .help = "worker public keys, lines 'ENDPOINT KEY' or '* KEY'"}
#define K3_CLUSTER_OPT_ROWS(T, f)                                                                  \
    {.name = "local", .flag = "--local", .env = "K3_LOCAL", .type = K3_OPT_INT,                   \
     .offset = offsetof(T, f.local), .def = "2", .min = 0, .max = 64, .metavar = "N",             \
     .help = "local worker processes; 0 = run the layers in this process"},                       \
    {.name = "workers", .flag = "--workers", .env = "K3_WORKERS", .type = K3_OPT_LIST,             \
     .offset = offsetof(T, f.workers), .max = K3_MAX_WORKERS, .metavar = "EP1,EP2",               \
     .help = "k3-worker endpoints (tcp://HOST:PORT, ipc://PATH); replaces --local"},              \
    K3_LINK_OPT_HB_MS(T, f.hb_ms),                                                                \
    {.name = "step_timeout_ms", .flag = "--step-timeout-ms", .env = "K3_STEP_TIMEOUT_MS",          \
     .type = K3_OPT_INT, .offset = offsetof(T, f.step_timeout_ms),                                \
     .def = K3_OPT_STR(K3_CLUSTER_STEP_TIMEOUT_MS), .min = 100, .max = 3600000, .metavar = "MS",  \
     .help = "a worker with steps pending and no progress this long is stalled"},                 \
    K3_LINK_OPT_INSECURE(T, f.insecure),                                                          \
    K3_LINK_OPT_CURVE_SECRET(T, f.curve_secret),                                                  \
    K3_CLUSTER_OPT_WORKER_KEYS(T, f.worker_keys),                                                 \
    {.name = "worker_bin", .flag = "--worker-bin", .env = "K3_WORKER_BIN",                         \
     .type = K3_OPT_STRING, .offset = offsetof(T, f.worker_bin), .metavar = "PATH",               \
     .help = "k3-worker program for --local workers (default: next to this program)"},            \
    K3_CLUSTER_OPT_RETRY_ROWS(T, f.retry),                                                        \
    {.name = "ready_timeout_ms", .flag = "--ready-timeout-ms", .env = "K3_READY_TIMEOUT_MS",       \
     .type = K3_OPT_INT, .offset = offsetof(T, f.ready_timeout_ms),                               \
     .def = K3_OPT_STR(K3_CLUSTER_READY_TIMEOUT_MS), .min = 100, .max = 86400000,                 \
     .metavar = "MS",                                                                             \
     .help = "start-up gives up when a worker has not registered within this (a line every 5 s "  \
             "names whom it waits for)"}
// clang-format on

/* Copies the command line's trunk settings into co (the strings and the
 * endpoint list stay borrowed from c). */
void k3_cluster_opts_from_cli(k3_cluster_opts *co, const k3_cluster_cli *c);

/* Defaults: local 2, hb K3_LINK_HB_MS_DEFAULT, step and ready timeouts and
 * retries K3_CLUSTER_*, request wait TTL, pipe_chunk 0. */
void k3_cluster_opts_default(k3_cluster_opts *o);

/* Starts the I/O thread (and the local workers), registers every worker and
 * checks that their ranges cover [0, cfg->n_layers) exactly once. Fails
 * naming the first worker that could not be reached or was refused. */
k3_status k3_cluster_open(k3_cluster **out, const k3_config *cfg, const k3_cluster_opts *o,
                          char *err, size_t errlen);
/* Stops the I/O thread; local workers get SHUTDOWN, then SIGTERM, then
 * SIGKILL after 2 s. Accepts NULL. */
void k3_cluster_close(k3_cluster **c);

/* A trunk over the cluster (ops name "cluster"); the cluster is borrowed
 * and must outlive the trunk. Free with k3_trunk_close. */
k3_status k3_cluster_trunk(k3_cluster *c, k3_trunk **out, char *err, size_t errlen);

/* Waits until every worker is registered again (after a loss). */
k3_status k3_cluster_wait_ready(k3_cluster *c, int timeout_ms, char *err, size_t errlen);

/* ---- introspection (--stats, tests) ---- */

typedef struct k3_stage_info {
    int layer_a, layer_b; /* the worker's range */
    char name[K3_PROTO_MAX_NAME];
    char endpoint[256];
    int ready;                 /* registered now */
    uint64_t epoch;            /* current link epoch */
    pid_t pid;                 /* local worker's pid, 0 otherwise */
    double read_gbps;          /* from HELLO_OK */
    uint64_t forwards, tokens; /* steps completed on this stage */
    double busy_ms;            /* worker-measured compute time (sum of compute_ms) */
    double read_ms;            /* worker-measured expert read wait */
    uint64_t bytes_read, hits, misses;
    double occupied_ms;          /* coordinator-side: time with >= 1 step outstanding */
    double hop_ms;               /* mean (round trip - worker time) of steps sent to an idle
                                    stage: transport and (de)serialisation of one hop */
    uint64_t stale_dropped;      /* replies dropped: old epoch, unknown id, cancelled */
    uint64_t tx_bytes, rx_bytes; /* tensor bytes sent in FORWARDs / received in FORWARD_DONEs */
    uint64_t failures;           /* times the link was declared lost */
    /* expert striping (docs/CLUSTER.md "Expert striping") */
    int n_drives;                      /* placement drives the worker reads, 0 = not reported */
    uint64_t drive_bytes[K3_MAX_DIRS]; /* bytes each drive gave it (calls it served included) */
    double gather_ms;                  /* its MoE layers' waits on stripe peers */
    uint64_t gather_layers;            /* MoE layer steps that called a peer */
    /* its Vulkan expert tier, from FORWARD_DONE (docs/VULKAN.md "Stats") */
    uint64_t vk_calls, vk_pairs;                /* expert calls / pairs on the device */
    uint64_t vk_promotions;                     /* uploads that finished by the last step */
    uint64_t vk_steps;                          /* steps with device expert calls */
    uint32_t vk_resident;                       /* experts on the device after the last step */
    double vk_device_ms, vk_cpu_ms, vk_wait_ms; /* MoE steps' device / CPU / wait time */
} k3_stage_info;

int k3_cluster_stages(const k3_cluster *c);
/* Stage i in layer order. */
void k3_cluster_stage_info(k3_cluster *c, int i, k3_stage_info *out);
/* Wall time with two or more stages busy at once (pipelining evidence). */
double k3_cluster_overlap_ms(k3_cluster *c);
/* Links declared lost since open. */
uint64_t k3_cluster_losses(k3_cluster *c);
/* Asks stage i for its cumulative STATS_OK. */
k3_status k3_cluster_worker_stats(k3_cluster *c, int i, proto_stats_ok *out, char *err,
                                  size_t errlen);
/* One block of lines per stage: layers, busy time, occupancy, hop latency,
 * bytes per token, drive rate. */
void k3_cluster_print_stats(k3_cluster *c, FILE *f);

/* ---- resume by replay (coordinator/cluster_replay.c) ---- */

/* k3_generate on s, resumed across worker losses: when a step fails because
 * a worker was lost (or a session state was lost), waits up to wait_ms for
 * the cluster to be whole again, resets the session and replays its ids
 * (prompt + tokens produced so far), then continues; at most max_resumes
 * times. The produced tokens equal an uninterrupted run's. res sums all
 * attempts; res->n_prompt is the original prompt length. */
k3_status k3_cluster_generate(k3_cluster *c, k3_session *s, const int32_t *prompt, int n,
                              const k3_gen_opts *opts, int max_resumes, int wait_ms,
                              k3_gen_result *res, char *err, size_t errlen);

/* ---- local worker processes (coordinator/cluster_local.c) ---- */

/* Path of the k3-worker program: next to /proc/self/exe (or one folder
 * up), else "k3-worker" on PATH. The coordinator's --worker-bin /
 * K3_WORKER_BIN row overrides it through k3_cluster_opts.worker_bin. */
void k3_worker_bin(char *out, size_t cap);

/* Starts `bin` with argv (argv[0] included, NULL-terminated) and the
 * environment plus env_add ("K=V", NULL-terminated, may be NULL). The child
 * gets SIGTERM when its parent dies (PR_SET_PDEATHSIG), and Linux means the
 * calling *thread* by parent: call this from a thread that outlives the
 * child (the cluster spawns its local workers from its I/O thread). */
k3_status k3_worker_spawn(pid_t *pid, const char *bin, char *const argv[], char *const env_add[],
                          char *err, size_t errlen);

/* SIGTERM, wait up to grace_ms, then SIGKILL; returns the exit status as
 * waitpid reports it, or -1 if the process was not ours. */
int k3_worker_stop(pid_t pid, int grace_ms);

/* Non-blocking: 1 and *status if pid has exited (reaped), else 0. */
int k3_worker_exited(pid_t pid, int *status);

#endif
