/* worker/main.c: the k3-worker program.
 *
 *   k3-worker --model DIR --layers A-B --listen ENDPOINT [--dirs D1,D2]
 *             [--numa N | --numa-auto] [--expert-gb G] [--max-sessions N] [--threads N]
 *             [--insecure | --curve-secret FILE --allow FILE]
 *
 * Order of start-up: options (one table: flags, K3_* variables, --help),
 * the transport policy (a network tcp endpoint needs CURVE or --insecure,
 * checked before anything is loaded), key files, NUMA pinning (before any
 * thread or big allocation, so both land on the node), the model's layer
 * range [A, B) without the global tensors (so the embedding / head shard is
 * never opened), the drive benchmark, then the socket loop until SIGTERM,
 * SIGINT or SHUTDOWN. Exit status: 0 after a clean stop, 1 on a start-up
 * error (one line on stderr naming the cause), 2 on bad options.
 */
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/kernels/kernels.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "common/base/opts.h"
#include "proto/link.h"
#include "worker/host.h"
#include "worker/worker.h"
#include "worker/xstripe.h"
#include "common/experts/placement.h"

typedef struct wopts {
    k3_engine_opts eng;  /* model, numerics, threads, expert cache (common/engine/engine_opts.h) */
    int bits_explicit;   /* --bits / K3_BITS given (not parsed: set from the table's sources) */
    char *layers;        /* "A-B": the half-open layer range served */
    char *listen;        /* endpoint to bind */
    int numa;            /* NUMA node to pin to, -1 = none */
    int numa_auto;       /* pin to the node of the drive holding our first layer */
    int max_sessions;    /* session states held */
    int max_ctx;         /* tokens per session */
    int max_chunk;       /* tokens per step accepted */
    int ckpt_mb;         /* MiB the turn checkpoints may hold */
    char *ckpt_dir;      /* checkpoints parked on disk too */
    int ckpt_files;      /* files --ckpt-dir keeps */
    int ckpt_disk_mb;    /* MiB --ckpt-dir keeps */
    int insecure;        /* allow plain tcp off loopback */
    char *curve_secret;  /* our CURVE key pair file */
    char *allow;         /* coordinator public keys admitted */
    int hb_ms;           /* heartbeat interval */
    int no_bench;        /* skip the drive benchmark */
    int bench_mb;        /* MB the drive benchmark reads */
    char *name;          /* name in logs */
    char *fault;         /* K3_WORKER_FAULT (tests) */
    int verbose;         /* per-layer load progress */
    char *expert_listen; /* cross-worker striping (worker/xstripe.h): our expert endpoint */
    char *stripe_drives; /* placement drives this worker reads and serves */
    char *stripe_peers;  /* D=ENDPOINT of every other drive's worker */
    char *stripe_allow;  /* CURVE: public keys of the workers that call our expert endpoint */
    char *stripe_keys;   /* CURVE: "ENDPOINT KEY" lines, the peers' public keys */
    int help;
} wopts;

#define O(f) offsetof(wopts, f)
static const k3_opt table[] = {
    K3_ENGINE_OPT_MODEL(wopts, eng),
    {.name = "layers",
     .flag = "--layers",
     .type = K3_OPT_STRING,
     .offset = O(layers),
     .metavar = "A-B",
     .help = "half-open layer range [A, B) this worker serves"},
    {.name = "listen",
     .flag = "--listen",
     .type = K3_OPT_STRING,
     .offset = O(listen),
     .metavar = "ENDPOINT",
     .help = "endpoint to bind: ipc://PATH or tcp://HOST:PORT"},
    {.name = "numa",
     .flag = "--numa",
     .type = K3_OPT_INT,
     .offset = O(numa),
     .def = "-1",
     .min = -1,
     .max = 1023,
     .metavar = "N",
     .help = "pin CPUs and memory to NUMA node N (-1: no pinning)"},
    {.name = "numa-auto",
     .flag = "--numa-auto",
     .env = "K3_NUMA_AUTO",
     .type = K3_OPT_BOOL,
     .offset = O(numa_auto),
     .def = "0",
     .help = "pin to the NUMA node of the drive that holds this worker's first layer (sysfs)"},
    /* --max-sessions and --max-ctx are the worker's limits: what it holds,
     * and the most a session may grow to (the coordinator's --ctx / --max-ctx
     * must fit in it), hence their own defaults */
    {.name = "max-sessions",
     .flag = "--max-sessions",
     .type = K3_OPT_INT,
     .offset = O(max_sessions),
     .def = "16",
     .min = 1,
     .max = K3_MAX_SESSIONS,
     .metavar = "N",
     .help = "session states held before the least recently used is evicted"},
    {.name = "max-ctx",
     .flag = "--max-ctx",
     .env = "K3_MAXT",
     .type = K3_OPT_INT,
     .offset = O(max_ctx),
     .def = "65536",
     .min = 1,
     .max = K3_MAX_CTX,
     .metavar = "N",
     .help = "tokens per session (MLA cache grows on demand up to this)"},
    {.name = "max-chunk",
     .flag = "--max-chunk",
     .type = K3_OPT_INT,
     .offset = O(max_chunk),
     .def = "512",
     .min = 1,
     .max = K3_MAX_CHUNK,
     .metavar = "T",
     .help = "largest chunk (tokens per step) accepted"},
    {.name = "ckpt-mb",
     .flag = "--ckpt-mb",
     .type = K3_OPT_INT,
     .offset = O(ckpt_mb),
     .def = "4096",
     .min = 0,
     .max = 1 << 24,
     .metavar = "MB",
     .help = "MiB the sessions' turn checkpoints (CHECKPOINT) may hold together; past it a "
             "CHECKPOINT is refused (0: none kept)"},
    {.name = "ckpt-dir",
     .flag = "--ckpt-dir",
     .type = K3_OPT_STRING,
     .offset = O(ckpt_dir),
     .metavar = "DIR",
     .help = "also park turn checkpoints on disk in DIR (created), so that a RESTORE finds "
             "them after this worker or the coordinator restarted (docs/SERVING.md)"},
    {.name = "ckpt-files",
     .flag = "--ckpt-files",
     .type = K3_OPT_INT,
     .offset = O(ckpt_files),
     .def = "256",
     .min = 1,
     .max = 1 << 20,
     .metavar = "N",
     .help = "files --ckpt-dir keeps; the oldest are removed first"},
    {.name = "ckpt-disk-mb",
     .flag = "--ckpt-disk-mb",
     .type = K3_OPT_INT,
     .offset = O(ckpt_disk_mb),
     .def = "65536",
     .min = 1,
     .max = 1 << 30,
     .metavar = "MB",
     .help = "MiB --ckpt-dir keeps; the oldest files are removed first"},
    K3_LINK_OPT_INSECURE(wopts, insecure),
    K3_LINK_OPT_CURVE_SECRET(wopts, curve_secret),
    {.name = "allow",
     .flag = "--allow",
     .env = "K3_CURVE_ALLOW",
     .type = K3_OPT_STRING,
     .offset = O(allow),
     .metavar = "FILE",
     .help = "coordinator public keys admitted (one per line); required with CURVE"},
    K3_LINK_OPT_HB_MS(wopts, hb_ms),
    {.name = "no-bench",
     .flag = "--no-bench",
     .type = K3_OPT_BOOL,
     .offset = O(no_bench),
     .help = "skip the drive read benchmark (HELLO_OK then reports 0 GB/s)"},
    {.name = "bench-mb",
     .flag = "--bench-mb",
     .type = K3_OPT_INT,
     .offset = O(bench_mb),
     .def = "64",
     .min = 1,
     .max = 65536,
     .metavar = "MB",
     .help = "bytes of the worker's shards the drive benchmark reads"},
    K3_ENGINE_OPT_ROWS(wopts, eng),
    {.name = "expert-listen",
     .flag = "--expert-listen",
     .type = K3_OPT_STRING,
     .offset = O(expert_listen),
     .metavar = "ENDPOINT",
     .help = "cross-worker striping: endpoint the other stages' expert calls reach"},
    {.name = "stripe-drives",
     .flag = "--stripe-drives",
     .type = K3_OPT_STRING,
     .offset = O(stripe_drives),
     .metavar = "D1,D2|none",
     .help = "cross-worker striping: the --placement drives this worker reads, for every MoE "
             "layer, and serves to the other stages"},
    {.name = "stripe-peers",
     .flag = "--stripe-peers",
     .type = K3_OPT_STRING,
     .offset = O(stripe_peers),
     .metavar = "D=EP,...",
     .help = "cross-worker striping: the --expert-listen endpoint of each other drive's worker"},
    {.name = "stripe-allow",
     .flag = "--stripe-allow",
     .type = K3_OPT_STRING,
     .offset = O(stripe_allow),
     .metavar = "FILE",
     .help = "cross-worker striping with CURVE: public keys of the workers admitted to "
             "--expert-listen (one per line)"},
    {.name = "stripe-keys",
     .flag = "--stripe-keys",
     .type = K3_OPT_STRING,
     .offset = O(stripe_keys),
     .metavar = "FILE",
     .help = "cross-worker striping with CURVE: the peers' public keys, lines \"ENDPOINT KEY\" "
             "(or \"* KEY\")"},
    {.name = "name",
     .flag = "--name",
     .type = K3_OPT_STRING,
     .offset = O(name),
     .metavar = "NAME",
     .help = "name in logs and errors (default HOST:PID)"},
    {.name = "fault",
     .env = "K3_WORKER_FAULT",
     .type = K3_OPT_STRING,
     .offset = O(fault),
     .help = "tests only: 'stall=N' stalls the N-th FORWARD forever, 'slow=MS' makes every "
             "FORWARD take MS longer, 'nozap' skips the ZAP handler"},
    {.name = "verbose",
     .flag = "--verbose",
     .short_flag = 'v',
     .type = K3_OPT_BOOL,
     .offset = O(verbose),
     .help = "per-layer load progress"},
    K3_OPT_HELP(wopts, help),
};
#undef O
#define N_TABLE ((int)(sizeof table / sizeof table[0]))

static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
    (void)sig;
    g_stop = 1;
}

/* "A-B" -> [A, B) */
static int parse_range(const char *s, int *a, int *b) {
    char *end;
    long x = strtol(s, &end, 10);
    if (end == s || *end != '-') return -1;
    const char *t = end + 1;
    long y = strtol(t, &end, 10);
    if (end == t || *end) return -1;
    if (x < 0 || y <= x || y > K3_MAX_LAYERS) return -1;
    *a = (int)x;
    *b = (int)y;
    return 0;
}

/* K3_WORKER_FAULT: "stall=N", "nozap", "build=ID" (another build identity:
 * the refusal test of docs/DEPLOY.md), comma-separated. */
static int parse_fault(const char *s, wk_opts *w) {
    if (!s) return 0;
    char buf[128];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (!strcmp(tok, "nozap"))
            w->zap_off = 1;
        else if (!strncmp(tok, "build=", 6) && tok[6])
            snprintf(w->build, sizeof w->build, "%s", tok + 6);
        else if (!strncmp(tok, "stall=", 6) && atoi(tok + 6) > 0)
            w->fault_stall_at = atoi(tok + 6);
        else if (!strncmp(tok, "slow=", 5) && atoi(tok + 5) > 0 && atoi(tok + 5) <= 60000)
            w->fault_slow_ms = atoi(tok + 5);
        else
            return -1;
    }
    return 0;
}

/* The checks that need more than one option, in start-up order: required
 * options, the layer range, the fault switch, then the transport policy
 * (refused before anything is loaded). Returns 0 or 2 (named on stderr). */
static int check_opts(const wopts *o, int *a, int *b, wk_opts *w) {
    char err[1024];
    if (!o->eng.model || !o->layers || !o->listen) {
        fprintf(stderr, "k3-worker: --model, --layers and --listen are required (see --help)\n");
        return 2;
    }
    if (parse_range(o->layers, a, b)) {
        fprintf(stderr, "k3-worker: --layers '%s': expected A-B with 0 <= A < B <= %d\n", o->layers,
                K3_MAX_LAYERS);
        return 2;
    }
    if (parse_fault(o->fault, w)) {
        fprintf(stderr,
                "k3-worker: K3_WORKER_FAULT='%s': expected stall=N, slow=MS, nozap or build=ID\n",
                o->fault);
        return 2;
    }
    w->curve = o->curve_secret != NULL;
    if (w->curve && !o->allow) {
        fprintf(stderr, "k3-worker: --curve-secret needs --allow FILE (coordinator public keys)\n");
        return 2;
    }
    if (!w->curve && o->allow) {
        fprintf(stderr, "k3-worker: --allow needs --curve-secret FILE\n");
        return 2;
    }
    if (k3_link_endpoint_policy(o->listen, w->curve, o->insecure, "k3-worker --listen", err,
                                sizeof err)) {
        fprintf(stderr, "k3-worker: %s\n", err);
        return 2;
    }
    int xs = o->expert_listen || o->stripe_drives || o->stripe_peers;
    if (xs && (!o->stripe_drives || !o->eng.placement)) {
        fprintf(stderr, "k3-worker: cross-worker striping needs --stripe-drives and --placement "
                        "(with --stripe-peers for the other drives)\n");
        return 2;
    }
    /* expert calls use the worker's own transport security: CURVE with its
     * key pair when it has one (--stripe-allow, --stripe-keys) */
    if (o->expert_listen && k3_link_endpoint_policy(o->expert_listen, w->curve, o->insecure,
                                                    "k3-worker --expert-listen", err, sizeof err)) {
        fprintf(stderr, "k3-worker: %s\n", err);
        return 2;
    }
    if ((o->stripe_allow || o->stripe_keys) && !w->curve) {
        fprintf(stderr, "k3-worker: --stripe-allow and --stripe-keys go with --curve-secret\n");
        return 2;
    }
    return 0;
}

/* --stripe-drives / --stripe-peers into x (before the model opens: the
 * drive mask decides which files it opens). Returns 0 or 2. */
static int xstripe_opts(const wopts *o, wk_xstripe_opts *x) {
    char err[1024];
    memset(x, 0, sizeof *x);
    if (!o->stripe_drives) return 0;
    k3_status st = wk_xstripe_parse_drives(o->stripe_drives, &x->own, err, sizeof err);
    if (!st && o->stripe_peers) st = wk_xstripe_parse_peers(o->stripe_peers, x, err, sizeof err);
    if (!st) {
        for (int d = 0; d < K3_MAX_DIRS && !st; d++)
            if (x->peer[d] &&
                k3_link_endpoint_policy(x->peer[d], o->curve_secret != NULL, o->insecure,
                                        "k3-worker --stripe-peers", err, sizeof err))
                st = K3_ERR_ARG;
    }
    if (st) {
        fprintf(stderr, "k3-worker: %s\n", err);
        wk_xstripe_opts_free(x);
        return 2;
    }
    x->listen = o->expert_listen;
    x->sock.hb_ms = o->hb_ms;
    x->sock.linger_ms = 0;
    x->sock.handshake_ms = K3_LINK_HANDSHAKE_MS_DEFAULT;
    x->threads = o->eng.threads;
    x->keys_path = o->stripe_keys;
    return 0;
}

/* With CURVE: our key pair into w and the admitted coordinator keys into
 * *allow (w borrows it). Returns 0 or 1. */
static int load_keys(const wopts *o, wk_opts *w, k3_allow_list *allow) {
    char err[1024];
    if (!w->curve) return 0;
    if (k3_link_secret_load(o->curve_secret, &w->kp, err, sizeof err) ||
        k3_allow_list_load(o->allow, allow, err, sizeof err)) {
        fprintf(stderr, "k3-worker: %s\n", err);
        return 1;
    }
    w->allow = allow;
    K3_INFO("CURVE server key %s; %d coordinator key(s) admitted", w->kp.public_z85, allow->n);
    return 0;
}

/* NUMA pinning, before any thread or big allocation so both land on the
 * node; --numa-auto asks which node holds the drive of layer a. A failure
 * is a warning: the worker serves unpinned. */
static void pin_numa(const wopts *o, int a) {
    char err[1024];
    int numa = o->numa;
    if (o->numa_auto && numa < 0) {
        /* the drive that holds our first layer's shard decides */
        char shard[4096], why[512];
        int node = -1;
        k3_status st = wk_layer_shard(o->eng.model, (const char *const *)o->eng.dirs.items,
                                      o->eng.dirs.n, a, shard, sizeof shard, err, sizeof err);
        if (!st) st = wk_drive_numa(shard, "/sys", &node, why, sizeof why, err, sizeof err);
        if (st)
            K3_WARN("--numa-auto: %s; continuing unpinned", err);
        else if (node < 0)
            K3_INFO("--numa-auto: %s: %s; not pinned", shard, why);
        else
            K3_INFO("--numa-auto: %s is on NUMA node %d", shard, node);
        numa = node;
    }
    if (numa >= 0) {
        char desc[512];
        if (wk_pin_numa(numa, desc, sizeof desc, err, sizeof err))
            K3_WARN("NUMA pinning failed, continuing unpinned: %s", err);
        else
            K3_INFO("pinned: %s", desc);
    }
}

/* Opens layers [a, b) without the global tensors into *m (options in *mo,
 * which borrows usage_path) and fills w's fingerprint and numerics for
 * HELLO. Returns 0 or 1. */
static int open_layers(const wopts *o, int a, int b, k3_model_opts *mo, char *usage_path,
                       size_t usage_cap, wk_opts *w, k3_model **m) {
    char err[1024];
    k3_model_opts_default(mo);
    /* the usage history: <model>/.k3_usage unless given, "off" = none; one
     * file for every worker of the model: a save merges (common/experts/experts.h) */
    k3_engine_opts_model(&o->eng, mo, usage_path, usage_cap);
    mo->layer_a = a;
    mo->layer_b = b;
    mo->want_global = 0; /* the embedding / head shard is the coordinator's */
    /* --local workers get --bits only when the coordinator's was explicit
     * (coordinator/cluster_local.c), so flag and variable both count */
    mo->bits_explicit = o->bits_explicit;
    mo->verbose = o->verbose;
    if (o->stripe_drives) { /* cross-worker striping: every layer's experts, our drives' files */
        mo->expert_all_layers = 1;
        mo->expert_drive_mask = w->xs_own | WK_XSTRIPE_MARK;
    }
    double t0 = k3_now_s();
    if (k3_model_open(m, mo, err, sizeof err)) {
        fprintf(stderr, "k3-worker: %s\n", err);
        return 1;
    }
    const k3_config *cfg = k3_model_config(*m);
    w->fingerprint = k3_model_fingerprint(*m);
    k3_link_numerics(mo->bits, mo->mla_bits, mo->head_bits, mo->idot, mo->dense_idot, o->eng.exact,
                     &w->num);
    K3_INFO("layers [%d, %d) of %d loaded in %.2f s (%.1f MB resident, %s kernels)", a, b,
            cfg->n_layers, k3_now_s() - t0, (double)k3_model_resident_bytes(*m) / 1e6,
            k3_isa_name(k3_isa_active()));
    return 0;
}

/* The drive benchmark over the shards of [a, b): its rate goes to the
 * coordinator in HELLO_OK (0 when skipped or failed). */
static void bench_drives(const wopts *o, const k3_model_opts *mo, int a, int b, wk_opts *w) {
    char err[1024];
    if (o->no_bench) return;
    size_t got = 0;
    int direct = 0;
    if (wk_bench_read(mo->model_dir, mo->dirs, mo->n_dirs, a, b, (size_t)o->bench_mb << 20,
                      &w->read_gbps, &got, &direct, err, sizeof err))
        K3_WARN("drive benchmark failed, reporting 0 GB/s: %s", err);
    else
        K3_INFO("drive benchmark: %.1f MB read at %.2f GB/s (%s)", (double)got / 1e6, w->read_gbps,
                direct ? "O_DIRECT" : "buffered: O_DIRECT refused");
}

/* The socket loop until SIGTERM, SIGINT or SHUTDOWN; after a clean stop the
 * expert usage history is saved. Returns 0 or 1. */
static int serve(const wopts *o, k3_model *m, wk_opts *w) {
    char err[1024];
    w->listen = o->listen;
    w->sock.hb_ms = o->hb_ms;
    w->sock.linger_ms = 500; /* a SHUTDOWN's OK still leaves; SIGTERM stops within 2 s */
    w->sock.handshake_ms = K3_LINK_HANDSHAKE_MS_DEFAULT;
    w->max_sessions = o->max_sessions;
    w->ckpt_mb = o->ckpt_mb;
    w->ckpt_dir = o->ckpt_dir;
    w->ckpt_files = o->ckpt_files;
    w->ckpt_disk_mb = o->ckpt_disk_mb;
    w->max_ctx = o->max_ctx;
    w->max_chunk = o->max_chunk;
    if (o->name) {
        snprintf(w->name, sizeof w->name, "%s", o->name);
    } else {
        char host[128] = "?";
        gethostname(host, sizeof host - 1);
        snprintf(w->name, sizeof w->name, "%s:%d", host, (int)getpid());
    }
    /* SIGTERM / SIGINT stop the loop from here on; before, while loading,
     * their default action ends the process at once (nothing to flush).
     * No SA_RESTART: a blocking poll returns EINTR and sees the flag. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (wk_serve(m, w, &g_stop, err, sizeof err)) {
        fprintf(stderr, "k3-worker: %s\n", err);
        return 1;
    }
    if (k3_model_usage_save(m, err, sizeof err)) /* a clean stop */
        K3_WARN("expert usage history not saved: %s", err);
    return 0;
}

/* Start-up in order (see the top of this file), then serving. */
static int run(const wopts *o) {
    int a = 0, b = 0;
    wk_opts w;
    memset(&w, 0, sizeof w);
    w.start_ms = k3_now_ms();
    snprintf(w.build, sizeof w.build, "%s", k3_link_build());
    /* the stripe STATS_OK reports: the drives this worker reads ("" = the model dir) */
    for (int i = 0; i < o->eng.dirs.n; i++) {
        size_t used = strlen(w.dirs);
        snprintf(w.dirs + used, sizeof w.dirs - used, "%s%s", i ? "," : "", o->eng.dirs.items[i]);
    }
    int rc = check_opts(o, &a, &b, &w);
    if (rc) return rc;
    wk_xstripe_opts xo;
    rc = xstripe_opts(o, &xo);
    if (rc) return rc;
    w.xs_own = xo.own;
    wk_xstripe *xs = NULL;
    wk_stripe_desc(o->eng.placement, a, b, w.stripe, sizeof w.stripe);
    k3_allow_list allow = {0};
    k3_model_opts mo;
    char usage_path[4200];
    k3_model *m = NULL;
    rc = load_keys(o, &w, &allow);
    char perr[512];
    if (!rc && wk_probe_bind(o->listen, perr, sizeof perr)) {
        fprintf(stderr, "k3-worker: %s\n", perr);
        rc = 1;
    }
    if (!rc) {
        pin_numa(o, a);
        rc = open_layers(o, a, b, &mo, usage_path, sizeof usage_path, &w, &m);
    }
    k3_allow_list xallow = {0}; /* --stripe-allow */
    if (!rc && o->stripe_drives) {
        char err[1024];
        snprintf(xo.name, sizeof xo.name, "%s", o->name ? o->name : "k3-worker");
        xo.curve = w.curve;
        xo.kp = &w.kp;
        if (w.curve && o->stripe_allow) {
            if (k3_allow_list_load(o->stripe_allow, &xallow, err, sizeof err)) {
                fprintf(stderr, "k3-worker: --stripe-allow: %s\n", err);
                rc = 1;
            }
            xo.allow = &xallow;
        }
        const k3_placement *pl = k3_model_placement(m);
        k3_status st = wk_xstripe_check(&xo, pl ? k3_placement_drives(pl) : 0, o->eng.placement,
                                        err, sizeof err);
        if (!st && !rc) st = wk_xstripe_open(&xs, m, &xo, err, sizeof err);
        if (st) {
            fprintf(stderr, "k3-worker: %s\n", err);
            rc = 1;
        }
        w.xs = xs;
    }
    if (!rc) {
        bench_drives(o, &mo, a, b, &w);
        rc = serve(o, m, &w);
    }
    wk_xstripe_close(&xs, m);
    wk_xstripe_opts_free(&xo);
    k3_model_close(&m);
    k3_allow_list_free(&allow);
    k3_allow_list_free(&xallow);
    memset(&w.kp, 0, sizeof w.kp); /* the secret key leaves no copy behind */
    return rc;
}

int main(int argc, char **argv) {
    k3_log_init("k3-worker");
    signal(SIGPIPE, SIG_IGN);

    wopts o;
    char err[512];
    char **pos = calloc((size_t)argc + 1, sizeof *pos);
    int npos = 0;
    if (!pos) return 1;
    k3_opt_src src[N_TABLE];
    k3_status st = k3_opts_parse(table, N_TABLE, &o, src, argc, argv, pos, &npos, err, sizeof err);
    /* --exact: bits 32/32/32 and idot 0; an explicit other --bits is an error */
    if (!st && !o.help) st = k3_engine_opts_resolve(&o.eng, table, N_TABLE, src, err, sizeof err);
    if (!st) o.bits_explicit = src[k3_opts_find(table, N_TABLE, "bits")] != K3_OPT_SRC_DEFAULT;
    if (!st && !o.help && o.numa_auto && o.numa >= 0)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--numa %d conflicts with --numa-auto", o.numa);
    int rc;
    if (st) {
        fprintf(stderr, "k3-worker: %s\n", err);
        rc = 2;
    } else if (o.help) {
        k3_opts_help(stdout,
                     "usage: k3-worker --model DIR --layers A-B --listen ENDPOINT [options]\n"
                     "Serves layers [A, B) of a Kimi K3 checkpoint to a k3-coordinator.",
                     table, N_TABLE);
        rc = 0;
    } else if (npos) {
        fprintf(stderr, "k3-worker: unexpected argument '%s' (see --help)\n", pos[0]);
        rc = 2;
    } else {
        k3_engine_opts_apply(&o.eng); /* --log-level, --isa */
        rc = run(&o);
    }
    k3_opts_free(table, N_TABLE, &o);
    free(pos);
    return rc;
}
