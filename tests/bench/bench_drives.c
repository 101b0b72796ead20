/* tests/bench/bench_drives.c: the coordinator side of `make bench-drives`
 * (run by tests/bench/bench-drives.sh, which makes the throttled drives and
 * starts one k3-worker per drive). Not a test: it prints figures.
 *
 *   bench_drives --model DIR --workers EP1,EP2,... [--drives loop0,loop1]
 *                [--pids P1,P2] [--drive-mbps MB/s] [--prompt 256]
 *                [--chunk 256] [--pipe-chunk 32] [--decode 4]
 *                [--sessions N] [--sess-prompt 4] [--sess-tokens 4]
 *                [--threads N] [--seed S]
 *
 * Opens the cluster trunk on the given workers (stages in layer order; the
 * i-th --drives / --pids entry belongs to the i-th stage) and runs three
 * phases, greedy (argmax), every step through the cluster:
 *   prefill  one session feeds a --prompt token prompt (session chunk
 *            --chunk, cut into --pipe-chunk micro-chunks that pipeline
 *            through the stages);
 *   decode1  the same session decodes --decode tokens, one at a time;
 *   decodeN  --sessions sessions (default: one per stage; the first is the
 *            prefilled one, the others first feed --sess-prompt tokens,
 *            untimed) decode --sess-tokens tokens each from one thread per
 *            session at once: their steps interleave on the stages.
 * For each phase: wall time, tokens/s (or ms/token), the bytes each drive
 * delivered (/sys/block/DEV/stat) and its rate against the throttle, each
 * stage's compute / expert-read-wait / occupied time (the cluster's
 * counters), the CPU seconds of each worker (/proc/PID/stat) and of this
 * process, the machine's CPU use (/proc/stat), and what bounds the figure.
 * Each phase ends with one machine-readable line:
 *   result PHASE value=V unit=U wall_s=W drive_gbps=a,b cpu_pct=C host_pct=H bound=B
 * Threads: main thread, plus one per session in decodeN.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "coordinator/cluster.h"
#include "coordinator/generate.h"

#define MAX_STAGES 16 /* drives in one benchmark; the cluster allows more */

typedef struct bench_opts {
    const char *model;
    char *workers[MAX_STAGES];
    int n_workers;
    char *drives[MAX_STAGES]; /* block device names (loop0), stage order */
    int n_drives;
    long pids[MAX_STAGES]; /* worker processes, stage order */
    int n_pids;
    double drive_mbps; /* the throttle, MB/s (1e6 B/s); 0 = unknown */
    int prompt, chunk, pipe_chunk, decode;
    int sessions, sess_prompt, sess_tokens;
    int threads;
    unsigned seed;
} bench_opts;

/* Counters sampled at a phase's start and end. */
typedef struct snap {
    double wall_ms;
    uint64_t drive_bytes[MAX_STAGES]; /* read from the block device */
    double worker_cpu_s[MAX_STAGES];  /* utime + stime */
    double self_cpu_s;                /* this process (coordinator) */
    uint64_t host_busy, host_total;   /* /proc/stat jiffies, all CPUs */
    k3_stage_info st[MAX_STAGES];
} snap;

static k3_cluster *g_cl;
static k3_model *g_model;
static k3_trunk *g_trunk;
static bench_opts g_o;
static int g_n; /* stages */

/* ---- counters ---------------------------------------------------------- */

static uint64_t drive_read_bytes(const char *dev) {
    char path[256];
    snprintf(path, sizeof path, "/sys/block/%s/stat", dev);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long long rd_ios = 0, rd_merges = 0, rd_sectors = 0;
    int n = fscanf(f, "%llu %llu %llu", &rd_ios, &rd_merges, &rd_sectors);
    fclose(f);
    return n == 3 ? (uint64_t)rd_sectors * 512u : 0; /* the stat file counts 512 B sectors */
}

static double pid_cpu_s(long pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    if (!p) return 0;
    unsigned long long ut = 0, stt = 0;
    /* after ") ": state ppid pgrp session tty tpgid flags minflt cminflt
     * majflt cmajflt utime stime */
    if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &stt) != 2)
        return 0;
    return (double)(ut + stt) / (double)sysconf(_SC_CLK_TCK);
}

static void host_cpu(uint64_t *busy, uint64_t *total) {
    *busy = *total = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (!f) return;
    unsigned long long v[8] = {0};
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
               &v[5], &v[6], &v[7]) == 8) {
        for (int i = 0; i < 8; i++) *total += v[i];
        *busy = *total - v[3] - v[4]; /* minus idle and iowait */
    }
    fclose(f);
}

static void take(snap *s) {
    memset(s, 0, sizeof *s);
    s->wall_ms = k3_now_ms();
    for (int i = 0; i < g_o.n_drives; i++) s->drive_bytes[i] = drive_read_bytes(g_o.drives[i]);
    for (int i = 0; i < g_o.n_pids; i++) s->worker_cpu_s[i] = pid_cpu_s(g_o.pids[i]);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    s->self_cpu_s = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 +
                    (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
    host_cpu(&s->host_busy, &s->host_total);
    for (int i = 0; i < g_n; i++) k3_cluster_stage_info(g_cl, i, &s->st[i]);
}

/* Prints the phase's counters and its result line. value is tokens/s, or
 * ms/token when per_token_ms; steady > 0 replaces a tokens/s value (the
 * decodeN steady rate). */
static void report(const char *phase, const snap *a, const snap *b, int tokens, int per_token_ms,
                   double steady) {
    double wall_s = (b->wall_ms - a->wall_ms) / 1000.0;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double value = per_token_ms ? (b->wall_ms - a->wall_ms) / tokens : tokens / wall_s;
    printf("phase %s: %d tokens in %.2f s: %.3f %s", phase, tokens, wall_s, value,
           per_token_ms ? "ms/token" : "tok/s");
    if (steady > 0) {
        printf("; steady rate %.3f tok/s ((tokens - 1) / (last - first step completion))", steady);
        value = steady;
    }
    printf("\n");
    char gbps_list[512] = "";
    double max_util = 0, sum_util = 0, occ_sum = 0, read_sum = 0, occ_max = 0, gather_sum = 0;
    double floor_s = 0; /* the busiest drive's bytes at its throttle: the time reads alone need */
    size_t used = 0;
    for (int i = 0; i < g_o.n_drives; i++) {
        double bytes = (double)(b->drive_bytes[i] - a->drive_bytes[i]);
        double gbps = bytes / 1e9 / wall_s;
        double util = g_o.drive_mbps > 0 ? gbps * 1000.0 / g_o.drive_mbps : 0;
        if (util > max_util) max_util = util;
        sum_util += util;
        if (g_o.drive_mbps > 0 && bytes / (g_o.drive_mbps * 1e6) > floor_s)
            floor_s = bytes / (g_o.drive_mbps * 1e6);
        printf("  drive %d (%s): %.3f GB read, %.3f GB/s", i, g_o.drives[i], bytes / 1e9, gbps);
        if (g_o.drive_mbps > 0)
            printf(" = %.0f %% of its %.0f MB/s throttle", util * 100, g_o.drive_mbps);
        printf("\n");
        used += (size_t)snprintf(gbps_list + used, sizeof gbps_list - used, "%s%.3f", i ? "," : "",
                                 gbps);
        if (used >= sizeof gbps_list) used = sizeof gbps_list - 1;
    }
    /* striping: the busiest drive's share of the bytes read (1/N when the
     * drives are balanced), and the expert-read wait per MoE layer step */
    double drive_sum = 0, drive_max = 0;
    for (int i = 0; i < g_o.n_drives; i++) {
        double bytes = (double)(b->drive_bytes[i] - a->drive_bytes[i]);
        drive_sum += bytes;
        if (bytes > drive_max) drive_max = bytes;
    }
    double busiest_share = drive_sum > 0 ? drive_max / drive_sum : 0;
    double layer_steps = 0;
    const k3_config *cfg = k3_model_config(g_model);
    for (int i = 0; i < g_n; i++) {
        int moe = 0;
        for (int l = b->st[i].layer_a; l < b->st[i].layer_b; l++) moe += cfg->is_moe[l];
        layer_steps += (double)(b->st[i].forwards - a->st[i].forwards) * moe;
    }
    if (g_o.n_drives > 1)
        printf("  busiest drive: %.1f %% of the bytes read\n", busiest_share * 100);
    double cpu_s = b->self_cpu_s - a->self_cpu_s;
    for (int i = 0; i < g_n; i++) {
        const k3_stage_info *x = &a->st[i], *y = &b->st[i];
        double wcpu = i < g_o.n_pids ? b->worker_cpu_s[i] - a->worker_cpu_s[i] : 0;
        cpu_s += wcpu;
        double occ = y->occupied_ms - x->occupied_ms;
        occ_sum += occ;
        read_sum += y->read_ms - x->read_ms;
        gather_sum += y->gather_ms - x->gather_ms; /* waits on stripe peers (STRIPE=2) */
        if (occ > occ_max) occ_max = occ;
        /* the stage's compute time holds its waits on stripe peers (STRIPE=2) */
        printf("  stage %d layers [%d, %d): %llu steps, compute %.2f s (of it %.2f s waiting on "
               "stripe peers), expert-read wait %.2f s, "
               "occupied %.2f s (%.0f %% of wall), %.3f GB experts read, %llu hit / %llu miss",
               i, y->layer_a, y->layer_b, (unsigned long long)(y->forwards - x->forwards),
               (y->busy_ms - x->busy_ms) / 1000.0, (y->gather_ms - x->gather_ms) / 1000.0,
               (y->read_ms - x->read_ms) / 1000.0, (y->occupied_ms - x->occupied_ms) / 1000.0,
               (y->occupied_ms - x->occupied_ms) / 10.0 / wall_s,
               (double)(y->bytes_read - x->bytes_read) / 1e9,
               (unsigned long long)(y->hits - x->hits),
               (unsigned long long)(y->misses - x->misses));
        if (i < g_o.n_pids) printf(", cpu %.2f s", wcpu);
        printf("\n");
    }
    double cpu_pct = 100.0 * cpu_s / (wall_s * (double)ncpu);
    uint64_t hb = b->host_busy - a->host_busy, ht = b->host_total - a->host_total;
    double host_pct = ht ? 100.0 * (double)hb / (double)ht : 0;
    /* What bounds the figure, from the stages' own time: the drives when
     * the stages spent most of their busy time waiting on expert reads;
     * else the CPUs (ours, or ours stretched by another job's); in between
     * both. "+idle" when even the busiest stage sat idle over 30 % of the
     * wall time: a single stream visits the stages in turn, or the
     * pipeline was filling and draining. */
    /* a wait on a stripe peer is that peer's drive reading (STRIPE=2) */
    double io_share = occ_sum > 0 ? (read_sum + gather_sum) / occ_sum : 0;
    const char *what;
    if (io_share >= 0.60)
        what = "drives";
    else if (cpu_pct >= 80.0)
        what = "cpu";
    else if (host_pct >= 85.0)
        what = "cpu(shared)";
    else if (io_share >= 0.40)
        what = "drives+cpu";
    else
        what = "cpu";
    char bound[64];
    snprintf(bound, sizeof bound, "%s%s", what, occ_max < 0.70 * wall_s * 1000.0 ? "+idle" : "");
    printf("  cpu: %.1f s (workers + coordinator) = %.0f %% of %ld cores; whole machine %.0f %% "
           "busy; busiest drive at %.0f %% of its throttle (sum %.0f %%); stages waited on reads "
           "%.0f %% of their busy time; busiest stage busy %.0f %% of wall -> bound by %s\n",
           cpu_s, cpu_pct, ncpu, host_pct, max_util * 100, sum_util * 100, io_share * 100,
           occ_max / 10.0 / wall_s, bound);
    if (floor_s > 0)
        printf("  drive floor: %.2f s (the busiest drive's bytes at %.0f MB/s) = %.0f %% of wall\n",
               floor_s, g_o.drive_mbps, floor_s * 100 / wall_s);
    double wait_layer = layer_steps > 0 ? (read_sum + gather_sum) / layer_steps : 0;
    double gather_layer = layer_steps > 0 ? gather_sum / layer_steps : 0;
    printf("  expert-read (gather) wait: %.1f ms per MoE layer step (%.0f layer steps), of which "
           "%.1f ms waiting on stripe peers' expert calls\n",
           wait_layer, layer_steps, gather_layer);
    printf("result %s value=%.4f unit=%s wall_s=%.3f drive_gbps=%s cpu_pct=%.1f host_pct=%.1f "
           "drive_util_pct=%.0f io_share_pct=%.0f floor_s=%.3f bound=%s busiest_share=%.3f "
           "wait_ms_per_layer=%.1f peer_wait_ms_per_layer=%.1f\n",
           phase, value, per_token_ms ? "ms/token" : "tok/s", wall_s,
           gbps_list[0] ? gbps_list : "-", cpu_pct, host_pct, max_util * 100, io_share * 100,
           floor_s, bound, busiest_share, wait_layer, gather_layer);
    fflush(stdout);
}

/* ---- sessions ----------------------------------------------------------- */

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Completion times of the decodeN steps (all sessions), for the steady
 * rate: in a full pipeline of S sessions over S stages the sessions start
 * staggered (they queue at stage 0) and end staggered, so tokens / wall
 * understates the rate by (S - 1) stage steps; (n - 1) / (last - first
 * completion) does not. */
static pthread_mutex_t g_done_mu = PTHREAD_MUTEX_INITIALIZER;
static double *g_done_ms; /* [S * sess_tokens] */
static int g_n_done;

/* Greedy decode of n tokens on s from *logits (the last step's); *logits
 * is left at the last step's logits (valid until the session's next call).
 * record: note each step's completion time in g_done_ms. */
static k3_status decode_n(k3_session *s, const float **logits, int n, int record, char *err,
                          size_t errlen) {
    int vocab = k3_model_config(g_model)->vocab;
    for (int k = 0; k < n; k++) {
        if (!*logits)
            return k3_errf(K3_ERR_STATE, err, errlen, "decode: no logits after step %d", k);
        int32_t id = argmax(*logits, vocab);
        k3_status st = k3_session_append(s, &id, 1, NULL, logits, err, errlen);
        if (st) return st;
        if (record) {
            pthread_mutex_lock(&g_done_mu);
            g_done_ms[g_n_done++] = k3_now_ms();
            pthread_mutex_unlock(&g_done_mu);
        }
    }
    return K3_OK;
}

typedef struct sess_job {
    k3_session *s;
    const float *logits; /* after the session's last step */
    int32_t *prompt;     /* NULL: already fed (the prefill session) */
    int n_prompt;
    pthread_barrier_t *bar;
    k3_status st;
    char err[512];
} sess_job;

/* decodeN thread: feed the short prompt (untimed), wait for every
 * session, then decode. */
static void *sess_main(void *p) {
    sess_job *j = p;
    if (j->prompt)
        j->st = k3_session_feed(j->s, j->prompt, j->n_prompt, NULL, &j->logits, NULL, j->err,
                                sizeof j->err);
    pthread_barrier_wait(j->bar); /* main takes the start snapshot here */
    pthread_barrier_wait(j->bar);
    if (!j->st) j->st = decode_n(j->s, &j->logits, g_o.sess_tokens, 1, j->err, sizeof j->err);
    return NULL;
}

/* ---- options ------------------------------------------------------------ */

static int split_list(char *s, char **out, int cap, const char *what) {
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == cap) {
            fprintf(stderr, "bench_drives: %s: more than %d entries (MAX_STAGES)\n", what, cap);
            exit(2);
        }
        out[n++] = tok;
    }
    return n;
}

static int int_arg(const char *flag, const char *v, int lo, int hi) {
    char *end = NULL;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "bench_drives: %s '%s': want an integer in %d..%d\n", flag, v, lo, hi);
        exit(2);
    }
    return (int)x;
}

static void parse(int argc, char **argv, bench_opts *o) {
    memset(o, 0, sizeof *o);
    o->prompt = 256, o->chunk = 256, o->pipe_chunk = 32, o->decode = 4;
    o->sess_prompt = 4, o->sess_tokens = 4, o->seed = 3;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (i + 1 >= argc) {
            fprintf(stderr, "bench_drives: %s needs a value (see the header of bench_drives.c)\n",
                    f);
            exit(2);
        }
        char *v = argv[++i];
        if (!strcmp(f, "--model"))
            o->model = v;
        else if (!strcmp(f, "--workers"))
            o->n_workers = split_list(v, o->workers, MAX_STAGES, f);
        else if (!strcmp(f, "--drives"))
            o->n_drives = split_list(v, o->drives, MAX_STAGES, f);
        else if (!strcmp(f, "--pids")) {
            char *items[MAX_STAGES];
            o->n_pids = split_list(v, items, MAX_STAGES, f);
            for (int k = 0; k < o->n_pids; k++) o->pids[k] = int_arg(f, items[k], 1, INT32_MAX);
        } else if (!strcmp(f, "--drive-mbps"))
            o->drive_mbps = int_arg(f, v, 1, 1000000);
        else if (!strcmp(f, "--prompt"))
            o->prompt = int_arg(f, v, 1, 65536);
        else if (!strcmp(f, "--chunk"))
            o->chunk = int_arg(f, v, 1, K3_MAX_CHUNK);
        else if (!strcmp(f, "--pipe-chunk"))
            o->pipe_chunk = int_arg(f, v, 0, K3_MAX_CHUNK);
        else if (!strcmp(f, "--decode"))
            o->decode = int_arg(f, v, 1, 4096);
        else if (!strcmp(f, "--sessions"))
            o->sessions = int_arg(f, v, 1, MAX_STAGES);
        else if (!strcmp(f, "--sess-prompt"))
            o->sess_prompt = int_arg(f, v, 1, 4096);
        else if (!strcmp(f, "--sess-tokens"))
            o->sess_tokens = int_arg(f, v, 1, 4096);
        else if (!strcmp(f, "--threads"))
            o->threads = int_arg(f, v, 0, K3_MAX_THREADS);
        else if (!strcmp(f, "--seed"))
            o->seed = (unsigned)int_arg(f, v, 0, INT32_MAX);
        else {
            fprintf(stderr, "bench_drives: unknown option %s\n", f);
            exit(2);
        }
    }
    if (!o->model || o->n_workers == 0) {
        fprintf(stderr, "bench_drives: --model and --workers are required\n");
        exit(2);
    }
    if ((o->n_drives && o->n_drives != o->n_workers) || (o->n_pids && o->n_pids != o->n_workers)) {
        fprintf(stderr, "bench_drives: %d workers but %d drives and %d pids (one each, or none)\n",
                o->n_workers, o->n_drives, o->n_pids);
        exit(2);
    }
}

/* Random prompt ids away from the special tokens (as bench-cluster). */
static void fill_ids(int32_t *ids, int n, int vocab, unsigned *seed) {
    int lo = vocab > 2048 ? 1024 : 1, hi = vocab > 2048 ? vocab - 256 : vocab;
    for (int i = 0; i < n; i++) ids[i] = lo + (int32_t)(rand_r(seed) % (unsigned)(hi - lo));
}

int main(int argc, char **argv) {
    k3_log_init("bench_drives");
    parse(argc, argv, &g_o);
    char err[1024];
    k3_status st;
    k3_session *sess[MAX_STAGES] = {0};
    int32_t *ids[MAX_STAGES] = {0};
    int rc = 1;

    /* the coordinator's part: global tensors only, default numerics (the
     * workers run theirs; HELLO compares them) */
    k3_config c0;
    if ((st = k3_config_load(&c0, g_o.model, 0, err, sizeof err))) goto fail;
    k3_model_opts mo;
    k3_model_opts_default(&mo);
    mo.model_dir = g_o.model;
    mo.layer_a = c0.n_layers;
    mo.want_global = 1;
    /* the one numeric setting the bench varies: the workers read the same
     * variable from the environment they inherit, and HELLO compares it */
    const char *di = getenv("K3_DENSE_IDOT");
    mo.dense_idot = di && strcmp(di, "0") != 0;
    if (g_o.threads > 0) mo.threads = g_o.threads;
    if ((st = k3_model_open(&g_model, &mo, err, sizeof err))) goto fail;
    const k3_config *cfg = k3_model_config(g_model);

    k3_cluster_opts co;
    k3_cluster_opts_default(&co);
    co.workers = (const char *const *)g_o.workers;
    co.n_workers = g_o.n_workers;
    co.model = &mo;
    co.pipe_chunk = g_o.pipe_chunk;
    co.step_timeout_ms = 300000; /* a throttled prefill piece takes seconds per layer */
    if ((st = k3_cluster_open(&g_cl, cfg, &co, err, sizeof err))) goto fail;
    if ((st = k3_cluster_trunk(g_cl, &g_trunk, err, sizeof err))) goto fail;
    g_n = k3_cluster_stages(g_cl);
    if (g_n > MAX_STAGES) {
        st = k3_errf(K3_ERR_LIMIT, err, sizeof err, "%d stages > %d (MAX_STAGES)", g_n, MAX_STAGES);
        goto fail;
    }
    int S = g_o.sessions ? g_o.sessions : g_n;
    printf("bench_drives: %d stage(s)", g_n);
    for (int i = 0; i < g_n; i++) {
        k3_stage_info si;
        k3_cluster_stage_info(g_cl, i, &si);
        printf("%s [%d, %d) %s", i ? "," : ":", si.layer_a, si.layer_b,
               g_o.n_drives ? g_o.drives[i] : si.endpoint);
    }
    printf("; prompt %d, chunk %d, pipe-chunk %d, decode %d, %d session(s) x %d tokens\n",
           g_o.prompt, g_o.chunk, g_o.pipe_chunk, g_o.decode, S, g_o.sess_tokens);
    fflush(stdout);

    /* sessions: 0 is the prefill / decode1 session; every session is
     * opened before timing so no phase pays for an allocation */
    unsigned seed = g_o.seed;
    for (int k = 0; k < S; k++) {
        int n = k == 0 ? g_o.prompt : g_o.sess_prompt;
        int ctx = n + (k == 0 ? g_o.decode : 0) + g_o.sess_tokens + 1;
        k3_session_opts so = {.max_ctx = ctx, .chunk = g_o.chunk, .progress = 0};
        if ((st = k3_session_open(&sess[k], g_model, g_trunk, &so, err, sizeof err))) goto fail;
        ids[k] = k3_xmalloc((size_t)n * sizeof **ids);
        fill_ids(ids[k], n, cfg->vocab, &seed);
    }

    /* phase 1: prefill */
    snap a, b;
    const float *logits = NULL;
    take(&a);
    if ((st = k3_session_feed(sess[0], ids[0], g_o.prompt, NULL, &logits, NULL, err, sizeof err)))
        goto fail;
    take(&b);
    report("prefill", &a, &b, g_o.prompt, 0, 0);

    /* phase 2: one session decodes; its ms/token */
    take(&a);
    if ((st = decode_n(sess[0], &logits, g_o.decode, 0, err, sizeof err))) goto fail;
    take(&b);
    report("decode1", &a, &b, g_o.decode, 1, 0);

    /* phase 3: S sessions decode at once, one thread each; with one
     * session that is decode1 again, which is reported as such */
    if (S == 1) {
        printf("(decodeN with 1 session is the decode1 phase)\n");
        report("decodeN", &a, &b, g_o.decode, 0, 0);
    } else {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, (unsigned)S + 1);
        sess_job *jobs = k3_xcalloc((size_t)S, sizeof *jobs);
        pthread_t *th = k3_xcalloc((size_t)S, sizeof *th);
        for (int k = 0; k < S; k++) {
            jobs[k].s = sess[k];
            jobs[k].bar = &bar;
            if (k == 0) {
                jobs[k].logits = logits; /* session 0 goes on from decode1 */
            } else {
                jobs[k].prompt = ids[k];
                jobs[k].n_prompt = g_o.sess_prompt;
            }
        }
        g_done_ms = k3_xcalloc((size_t)S * (size_t)g_o.sess_tokens, sizeof *g_done_ms);
        g_n_done = 0;
        for (int k = 0; k < S; k++) pthread_create(&th[k], NULL, sess_main, &jobs[k]);
        pthread_barrier_wait(&bar); /* every short prompt fed */
        take(&a);
        pthread_barrier_wait(&bar);
        for (int k = 0; k < S; k++) pthread_join(th[k], NULL);
        take(&b);
        pthread_barrier_destroy(&bar);
        for (int k = 0; k < S && !st; k++)
            if (jobs[k].st)
                st = k3_errf(jobs[k].st, err, sizeof err, "session %d: %s", k, jobs[k].err);
        free(jobs);
        free(th);
        double steady = 0;
        if (!st && g_n_done > 1) { /* completions are recorded in time order */
            double span = g_done_ms[g_n_done - 1] - g_done_ms[0];
            steady = span > 0 ? (g_n_done - 1) * 1000.0 / span : 0;
        }
        free(g_done_ms);
        g_done_ms = NULL;
        if (st) goto fail;
        report("decodeN", &a, &b, S * g_o.sess_tokens, 0, steady);
    }
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "bench_drives: error: %s\n", err);
done:
    for (int k = 0; k < MAX_STAGES; k++) {
        k3_session_close(&sess[k]);
        free(ids[k]);
    }
    k3_trunk_close(&g_trunk);
    k3_cluster_close(&g_cl);
    k3_model_close(&g_model);
    return rc;
}
