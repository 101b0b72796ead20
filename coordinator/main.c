/* coordinator/main.c: the k3-coordinator program.
 *
 *   k3-coordinator --model DIR [--local N] [--ids 5,7,9 | "prompt"] [--ngen N]
 *                  [--exact] [--chunk C] [--temp T --top-p P --seed S]
 *                  [--print-ids] [--all-logits FILE] [--trace FILE]
 *                  [--threads N] [--dirs a,b] [--stats]
 *   k3-coordinator tokenize ...            (coordinator/cmd_tokenize.c)
 *
 * Every setting comes from the one table below (flags, K3_* variables,
 * defaults, ranges, --help). main() validates the options, opens the model,
 * the tokenizer (when the model directory has one) and a trunk, runs one
 * generation through coordinator/generate.h and reports. Generated text
 * streams to stdout token by token; progress and timings go to stderr.
 * Exit status: 0 done, 1 runtime error (named on stderr), 2 bad usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "coordinator/cluster.h"
#include "coordinator/cmd_tokenize.h"
#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/base/err.h"
#include "common/experts/experts.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/engine/model.h"
#include "common/base/opts.h"
#include "coordinator/sampler.h"
#include "common/text/tokenizer.h"
#include "coordinator/generate.h"
#include "coordinator/keygen.h"
#include "proto/link.h"

/* ---- the option table -------------------------------------------------- */

typedef struct coord_opts {
    k3_engine_opts eng; /* model, numerics, threads, expert cache (common/engine/engine_opts.h) */
    int local;          /* 0 = in-process, N > 0 = N local worker processes */
    char *ids;          /* raw ids "5,7,9" (no BOS) */
    int ngen;           /* tokens to generate */
    int chunk;          /* prefill chunk, tokens */
    double temp;        /* 0 = greedy */
    double top_p;       /* nucleus mass */
    int seed;           /* sampler seed */
    int print_ids;      /* "ids: ..." line */
    char *all_logits;   /* file: f32 [T][vocab] */
    char *trace;        /* file: f32 [n_layers][T][D] */
    int stats;          /* expert / memory statistics at the end */
    int max_ctx;        /* 0 = prompt + ngen */
    int think;          /* chat mode: open the think channel */
    /* cluster (coordinator/cluster.h) */
    k3_opt_list workers; /* remote worker endpoints; none = --local workers */
    int hb_ms;           /* heartbeat interval; TTL = 3 x */
    int step_timeout_ms; /* a worker without progress this long is stalled */
    int pipe_chunk;      /* tokens per pipelined micro-chunk, 0 = auto */
    int max_sessions;    /* session states each local worker holds */
    int insecure;        /* allow plain tcp off loopback */
    char *curve_secret;  /* our CURVE key pair file */
    char *worker_keys;   /* "ENDPOINT|* KEY" lines */
    /* local worker program, link back-offs, resumes (coordinator/cluster.h) */
    char *worker_bin;       /* NULL = k3-worker next to this program */
    k3_cluster_retry retry; /* K3_CLUSTER_OPT_RETRY_ROWS */
    int help;
} coord_opts;

/* The one table of the program. Order is --help order: what a user needs
 * first (model, prompt, generation), then the engine's numerics and tuning
 * (the rows shared with k3-worker, common/engine/engine_opts.h), then the cluster.
 * Variables keep the seed engine's names (K3_BITS, K3_CHUNK, COLI_TEMP, ...)
 * so existing scripts keep working; flags beat variables, variables beat
 * the defaults, and the defaults are spec 4.2 / interfaces 6.2's. */
#define O(f) offsetof(coord_opts, f)
static const k3_opt coord_table[] = {
    K3_ENGINE_OPT_MODEL(coord_opts, eng),
    {.name = "local",
     .flag = "--local",
     .env = "K3_LOCAL",
     .type = K3_OPT_INT,
     .offset = O(local),
     .def = "2",
     .min = 0,
     .max = 64,
     .metavar = "N",
     .help = "local worker processes; 0 = run the layers in this process"},
    {.name = "ids",
     .flag = "--ids",
     .type = K3_OPT_STRING,
     .offset = O(ids),
     .metavar = "5,7,9",
     .help = "raw prompt ids (commas or spaces), no BOS added"},
    {.name = "ngen",
     .flag = "--ngen",
     .env = "K3_NGEN",
     .type = K3_OPT_INT,
     .offset = O(ngen),
     .def = "32",
     .min = 0,
     .max = K3_MAX_NGEN,
     .metavar = "N",
     .help = "tokens to generate"},
    {.name = "chunk",
     .flag = "--chunk",
     .env = "K3_CHUNK",
     .type = K3_OPT_INT,
     .offset = O(chunk),
     .def = "32",
     .min = 1,
     .max = K3_MAX_CHUNK,
     .metavar = "C",
     .help = "prefill chunk in tokens (bit-identical results for every value)"},
    {.name = "temp",
     .flag = "--temp",
     .env = "K3_TEMP",
     .env_alias = "COLI_TEMP",
     .type = K3_OPT_DOUBLE,
     .offset = O(temp),
     .def = "0",
     .min = 0,
     .max = 1e6,
     .metavar = "T",
     .help = "sampling temperature, 0 = greedy"},
    {.name = "top_p",
     .flag = "--top-p",
     .env = "K3_TOP_P",
     .type = K3_OPT_DOUBLE,
     .offset = O(top_p),
     .def = "1",
     .min = 0,
     .max = 1,
     .min_open = 1,
     .metavar = "P",
     .help = "nucleus sampling mass"},
    {.name = "seed",
     .flag = "--seed",
     .env = "K3_SEED",
     .type = K3_OPT_INT,
     .offset = O(seed),
     .def = "0",
     .min = 0,
     .max = INT_MAX,
     .metavar = "S",
     .help = "sampler seed"},
    {.name = "print_ids",
     .flag = "--print-ids",
     .type = K3_OPT_BOOL,
     .offset = O(print_ids),
     .help = "print the generated ids on one line 'ids: ...'"},
    {.name = "all_logits",
     .flag = "--all-logits",
     .env = "K3_LOGITS",
     .type = K3_OPT_STRING,
     .offset = O(all_logits),
     .metavar = "FILE",
     .help = "write f32 [T][vocab] logits of every prompt position"},
    {.name = "trace",
     .flag = "--trace",
     .env = "K3_TRACE",
     .type = K3_OPT_STRING,
     .offset = O(trace),
     .metavar = "FILE",
     .help = "write f32 [n_layers][T][D] hidden after every layer, prompt positions"},
    {.name = "stats",
     .flag = "--stats",
     .env = "K3_STATS",
     .type = K3_OPT_BOOL,
     .offset = O(stats),
     .help = "expert cache, read and memory statistics at the end"},
    {.name = "max_ctx",
     .flag = "--max-ctx",
     .env = "K3_MAXT",
     .type = K3_OPT_INT,
     .offset = O(max_ctx),
     .def = "0",
     .min = 0,
     .max = K3_MAX_CTX,
     .metavar = "N",
     .help = "context capacity in tokens, 0 = prompt + ngen"},
    {.name = "think",
     .env = "K3_THINK",
     .type = K3_OPT_BOOL,
     .offset = O(think),
     .def = "1",
     .help = "chat mode: open the think channel (0 = response only)"},
    K3_ENGINE_OPT_ROWS(coord_opts, eng),
    {.name = "workers",
     .flag = "--workers",
     .env = "K3_WORKERS",
     .type = K3_OPT_LIST,
     .offset = O(workers),
     .max = K3_MAX_WORKERS,
     .metavar = "EP1,EP2",
     .help = "k3-worker endpoints (tcp://HOST:PORT, ipc://PATH); replaces --local"},
    K3_LINK_OPT_HB_MS(coord_opts, hb_ms),
    {.name = "step_timeout_ms",
     .flag = "--step-timeout-ms",
     .env = "K3_STEP_TIMEOUT_MS",
     .type = K3_OPT_INT,
     .offset = O(step_timeout_ms),
     .def = K3_OPT_STR(K3_CLUSTER_STEP_TIMEOUT_MS),
     .min = 100,
     .max = 3600000,
     .metavar = "MS",
     .help = "a worker with steps pending and no progress this long is stalled"},
    {.name = "pipe_chunk",
     .flag = "--pipe-chunk",
     .env = "K3_PIPE_CHUNK",
     .type = K3_OPT_INT,
     .offset = O(pipe_chunk),
     .def = "0",
     .min = 0,
     .max = K3_MAX_CHUNK,
     .metavar = "T",
     .help = "tokens per pipelined micro-chunk, 0 = one piece per stage (>= 8 tokens)"},
    {.name = "max_sessions",
     .flag = "--max-sessions",
     .type = K3_OPT_INT,
     .offset = O(max_sessions),
     .def = "0",
     .min = 0,
     .max = K3_MAX_SESSIONS,
     .metavar = "N",
     .help = "session states each local worker holds, 0 = the worker's default"},
    K3_LINK_OPT_INSECURE(coord_opts, insecure),
    K3_LINK_OPT_CURVE_SECRET(coord_opts, curve_secret),
    {.name = "worker_keys",
     .flag = "--worker-keys",
     .env = "K3_WORKER_KEYS",
     .type = K3_OPT_STRING,
     .offset = O(worker_keys),
     .metavar = "FILE",
     .help = "worker public keys, lines 'ENDPOINT KEY' or '* KEY'"},
    {.name = "worker_bin",
     .flag = "--worker-bin",
     .env = "K3_WORKER_BIN",
     .type = K3_OPT_STRING,
     .offset = O(worker_bin),
     .metavar = "PATH",
     .help = "k3-worker program for --local workers (default: next to this program)"},
    K3_CLUSTER_OPT_RETRY_ROWS(coord_opts, retry),
    {.name = "help",
     .flag = "--help",
     .short_flag = 'h',
     .type = K3_OPT_BOOL,
     .offset = O(help),
     .help = "this text"},
};
#undef O
#define N_COORD_OPTS ((int)(sizeof coord_table / sizeof coord_table[0]))

static const char *usage_text =
    "usage: k3-coordinator --model DIR [options] [\"prompt\" | --ids 5,7,9]\n"
    "       k3-coordinator tokenize [options]    (k3-coordinator tokenize --help)\n"
    "\n"
    "Generates text with Kimi K3. A text prompt is tokenized with the model\n"
    "directory's tokenizer (tiktoken.model) and gets BOS; --ids are used as given.";

/* ---- output sinks ------------------------------------------------------- */

/* Streams generated tokens to stdout: text through the UTF-8-safe decoder
 * when a tokenizer exists, else "id " per token. Keeps every id for
 * --print-ids. */
typedef struct token_sink {
    const k3_tok *tok;    /* borrowed, NULL = print ids */
    k3_tok_stream stream; /* holds back incomplete UTF-8 */
    const int *eos;       /* [n_eos] not printed as text */
    int n_eos;
    int32_t *ids; /* [cap] generated ids, owned */
    int n, cap;
} token_sink;

/* Called by k3_generate for every sampled id, before it is fed back: the
 * text is on stdout (flushed) as soon as the token exists. */
static void sink_token(void *ctx, int32_t id) {
    token_sink *s = ctx;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->ids = k3_xrealloc(s->ids, (size_t)s->cap * sizeof *s->ids);
    }
    s->ids[s->n++] = id;
    for (int i = 0; i < s->n_eos; i++)
        if (s->eos[i] == id) return; /* the stop token is reported by --print-ids, not printed */
    if (s->tok) {
        size_t len = 0;
        const char *txt = k3_tok_stream_push(s->tok, &s->stream, id, &len);
        if (len) fwrite(txt, 1, len, stdout);
    } else {
        printf("%d ", (int)id);
    }
    fflush(stdout);
}

/* --all-logits: rows arrive chunk by chunk in position order. */
typedef struct logits_sink {
    FILE *f;
    const char *path;
    int failed; /* errno of the first failed write, 0 = fine */
} logits_sink;

/* A write error is remembered, not reported here (the hook cannot fail a
 * step); main() checks it after the run and fails with the file's name. */
static void sink_logits(void *ctx, int pos0, int T, int vocab, const float *logits) {
    logits_sink *s = ctx;
    (void)pos0;
    size_t n = (size_t)T * (size_t)vocab;
    if (!s->failed && fwrite(logits, sizeof(float), n, s->f) != n) s->failed = errno ? errno : EIO;
}

/* --trace: the file is [n_layers][T][D] (layer-major) but layers arrive
 * chunk by chunk, so each row is written at its own offset (pwrite). Rows of
 * positions >= T (generated tokens) are not traced. */
typedef struct trace_sink {
    int fd;
    const char *path;
    int n_layers, T, D;
    int failed; /* errno of the first failed write */
} trace_sink;

static void sink_trace(void *ctx, int layer, int pos0, int T, const float *h) {
    trace_sink *s = ctx;
    if (s->failed || layer < 0 || layer >= s->n_layers) return;
    size_t row = (size_t)s->D * sizeof(float);
    for (int t = 0; t < T && pos0 + t < s->T; t++) {
        /* row (layer, pos) of the [n_layers][T][D] file; the file grows to
         * its full size as the last layer's rows land */
        off_t off = ((off_t)layer * s->T + pos0 + t) * (off_t)row;
        const char *p = (const char *)(h + (size_t)t * (size_t)s->D);
        size_t left = row;
        while (left > 0) {
            ssize_t w = pwrite(s->fd, p, left, off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                s->failed = w < 0 ? errno : EIO;
                return;
            }
            p += w;
            off += w;
            left -= (size_t)w;
        }
    }
}

/* ---- helpers ------------------------------------------------------------ */

/* Parses "5,7,9" or "5 7 9" into a new array (owned by the caller). Only
 * the syntax and 0..INT32_MAX are checked here; the vocabulary bound is the
 * session's (it knows the model), so "id >= vocab" names the position. */
static k3_status parse_ids(const char *text, int32_t **out, int *n_out, char *err, size_t errlen) {
    *out = NULL;
    *n_out = 0;
    size_t cap = strlen(text) / 2 + 1; /* each id takes >= 2 chars but the last */
    int32_t *ids = k3_xmalloc(cap * sizeof *ids);
    int n = 0;
    const char *p = text;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end = NULL;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || (*end && *end != ',' && *end != ' ' && *end != '\t' && *end != '\n')) {
            free(ids);
            return k3_errf(K3_ERR_ARG, err, errlen, "--ids: item %d ('%.20s') is not an integer",
                           n + 1, p);
        }
        if (errno == ERANGE || v < 0 || v > INT32_MAX) {
            free(ids);
            return k3_errf(K3_ERR_ARG, err, errlen, "--ids: item %d (%.20s) is outside 0..%d",
                           n + 1, p, INT32_MAX);
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    if (n == 0) {
        free(ids);
        return k3_errf(K3_ERR_ARG, err, errlen, "--ids: no ids in '%s'", text);
    }
    *out = ids;
    *n_out = n;
    return K3_OK;
}

static int file_exists(const char *dir, const char *name) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0;
}

/* Peak resident set in MiB from /proc/self/status (VmHWM), or -1. */
static double peak_rss_mib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    double kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = atof(line + 6);
    fclose(f);
    return kb < 0 ? -1 : kb / 1024.0;
}

/* The trunk: in-process for --local 0, else the cluster of --workers or of
 * --local N worker processes (coordinator/cluster.h), which must agree
 * with this process's numeric settings (mo). */
static k3_status open_trunk(const coord_opts *o, k3_model *m, const k3_model_opts *mo,
                            k3_cluster **cl, k3_trunk **out, char *err, size_t errlen) {
    if (o->workers.n == 0 && o->local == 0) return k3_trunk_open_inproc(out, m, err, errlen);
    k3_cluster_opts co;
    k3_cluster_opts_default(&co);
    co.workers = (const char *const *)o->workers.items;
    co.n_workers = o->workers.n;
    co.local = o->local;
    co.model = mo;
    co.exact = o->eng.exact;
    co.max_sessions = o->max_sessions;
    co.hb_ms = o->hb_ms;
    co.step_timeout_ms = o->step_timeout_ms;
    co.pipe_chunk = o->pipe_chunk;
    co.insecure = o->insecure;
    co.curve_secret = o->curve_secret;
    co.worker_keys = o->worker_keys;
    co.worker_bin = o->worker_bin;
    co.retry = o->retry;
    if (o->trace)
        K3_WARN("--trace with workers: only each stage's last layer is traced (use --local 0 "
                "for every layer)");
    k3_status st = k3_cluster_open(cl, k3_model_config(m), &co, err, errlen);
    if (!st) st = k3_cluster_trunk(*cl, out, err, errlen);
    return st;
}

static const char *stop_name(k3_stop s) {
    switch (s) {
    case K3_STOP_NONE: return "prefill only";
    case K3_STOP_NGEN: return "ngen reached";
    case K3_STOP_EOS: return "eos";
    case K3_STOP_CTX: return "context full";
    }
    return "?";
}

/* ---- main --------------------------------------------------------------- */

int main(int argc, char **argv) {
    /* subcommands first: they have their own options */
    if (argc > 1 && !strcmp(argv[1], "tokenize")) return cmd_tokenize(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "keygen")) return cmd_keygen(argc - 1, argv + 1);
    k3_log_init("k3-coordinator");

    char err[1024] = "";
    coord_opts o;
    k3_opt_src src[N_COORD_OPTS];
    char **pos = k3_xcalloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0, rc = 1;
    k3_model *model = NULL;
    k3_tok *tok = NULL;
    k3_trunk *trunk = NULL;
    k3_cluster *cluster = NULL;
    k3_session *sess = NULL;
    k3_sampler *sampler = NULL;
    int32_t *prompt = NULL;
    int n_prompt = 0;
    token_sink tsink = {0};
    logits_sink lsink = {0};
    trace_sink trsink = {.fd = -1};
    k3_status st;

    memset(&o, 0, sizeof o);
    st =
        k3_opts_parse(coord_table, N_COORD_OPTS, &o, src, argc, argv, pos, &n_pos, err, sizeof err);
    if (!st && o.help) {
        k3_opts_help(stdout, usage_text, coord_table, N_COORD_OPTS);
        rc = 0;
        goto done;
    }
    /* usage checks that need more than one option */
    if (!st && !o.eng.model)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--model: missing (the checkpoint directory)");
    if (!st && n_pos > 1)
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "unexpected argument '%s': give one prompt (quote it)", pos[1]);
    if (!st && n_pos == 1 && o.ids)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "give a prompt or --ids, not both");
    if (!st && n_pos == 0 && !o.ids)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "no prompt: give a prompt text or --ids");
    /* --exact means all-f32; an explicit conflicting flag is a mistake */
    if (!st) st = k3_engine_opts_resolve(&o.eng, coord_table, N_COORD_OPTS, src, err, sizeof err);
    if (!st && o.ids) st = parse_ids(o.ids, &prompt, &n_prompt, err, sizeof err);
    if (st) {
        fprintf(stderr, "k3-coordinator: %s\n", err);
        rc = 2;
        goto done;
    }
    k3_engine_opts_apply(&o.eng); /* --log-level, --isa */

    /* ---- model ----
     * The in-process path needs every layer plus the global tensors. The
     * cluster path will open the globals only (layer_a = n_layers). */
    k3_model_opts mo;
    k3_model_opts_default(&mo);
    /* the usage history: <model>/.k3_usage unless given, "off" = none */
    char usage_path[4200];
    k3_engine_opts_model(&o.eng, &mo, usage_path, sizeof usage_path);
    mo.layer_a = 0;
    mo.layer_b = 0; /* all */
    if (o.workers.n > 0 || o.local > 0) {
        /* the layers run in the workers: only the global tensors here */
        k3_config c0;
        if ((st = k3_config_load(&c0, o.eng.model, o.eng.max_layers, err, sizeof err))) goto fail;
        mo.layer_a = c0.n_layers;
    }
    mo.want_global = 1;
    mo.bits_explicit = src[k3_opts_find(coord_table, N_COORD_OPTS, "bits")] != K3_OPT_SRC_DEFAULT;
    /* Local workers read K3_USAGE / K3_USAGE_SAVE from the inherited
     * environment, so a --usage flag is exported for them (no thread runs
     * yet, setenv is safe). */
    if (src[k3_opts_find(coord_table, N_COORD_OPTS, "usage")] == K3_OPT_SRC_FLAG)
        setenv("K3_USAGE", mo.usage_path ? mo.usage_path : "off", 1);
    mo.verbose = k3_log_enabled(K3_LOG_INFO); /* per-layer load lines */
    K3_INFO("loading %s (bits %d/%d/%d, idot %d, %d threads)", o.eng.model, mo.bits, mo.mla_bits,
            mo.head_bits, mo.idot, mo.threads);
    double t_load = k3_now_ms();
    if ((st = k3_model_open(&model, &mo, err, sizeof err))) goto fail;
    const k3_config *cfg = k3_model_config(model);
    K3_INFO("loaded %d layers in %.2f s (%.1f MiB dense weights)", cfg->n_layers,
            (k3_now_ms() - t_load) / 1000.0,
            (double)k3_model_resident_bytes(model) / (1024.0 * 1024.0));
    int has_head = cfg->n_layers == cfg->n_layers_full;
    if (!has_head && (o.ngen > 0 || o.all_logits)) {
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "K3_LAYERS=%d truncates the stack of %d layers: no head runs, so only "
                     "--trace with --ngen 0 works",
                     cfg->n_layers, cfg->n_layers_full);
        fprintf(stderr, "k3-coordinator: %s\n", err);
        rc = 2;
        goto done;
    }

    /* ---- tokenizer and prompt ----
     * A broken tokenizer is an error; a missing one only means ids out. */
    if (file_exists(o.eng.model, "tiktoken.model")) {
        if ((st = k3_tok_open_dir(&tok, o.eng.model, cfg->vocab, err, sizeof err))) goto fail;
    } else {
        K3_INFO("no tokenizer in %s (tiktoken.model): output is ids", o.eng.model);
    }
    if (!prompt) {
        if (!tok) {
            st = k3_errf(K3_ERR_MISSING, err, sizeof err,
                         "text prompt given but %s has no tokenizer (tiktoken.model): use --ids",
                         o.eng.model);
            goto fail;
        }
        k3_tok_ids v = {0};
        if (cfg->bos >= 0) k3_tok_ids_push(&v, cfg->bos);
        /* the command line is the operator's own text: added tokens typed
         * there ("<|open|>") are recognised (trusted encode) */
        if ((st = k3_tok_encode(tok, pos[0], strlen(pos[0]), 1, &v, err, sizeof err))) {
            k3_tok_ids_free(&v);
            goto fail;
        }
        if (v.n > (size_t)K3_MAX_CTX) {
            st = k3_errf(K3_ERR_LIMIT, err, sizeof err, "prompt of %zu tokens > %d (K3_MAX_CTX)",
                         v.n, K3_MAX_CTX);
            k3_tok_ids_free(&v);
            goto fail;
        }
        n_prompt = (int)v.n;
        prompt = k3_xmalloc((size_t)n_prompt * sizeof *prompt + 1);
        memcpy(prompt, v.v, (size_t)n_prompt * sizeof *prompt);
        k3_tok_ids_free(&v);
        if (n_prompt == 0) {
            st = k3_errf(K3_ERR_ARG, err, sizeof err,
                         "the prompt is empty and no BOS is configured");
            goto fail;
        }
    }

    /* ---- session ----
     * Context: K3_MAXT when given, else exactly prompt + ngen (the CLI's
     * rule, interfaces 6.1); checked here so the message names the option
     * before any state is allocated. */
    long long want_ctx = o.max_ctx > 0 ? o.max_ctx : (long long)n_prompt + o.ngen;
    if (want_ctx > K3_MAX_CTX) {
        st = k3_errf(K3_ERR_LIMIT, err, sizeof err,
                     "context of %lld tokens (prompt %d + ngen %d) > %d (K3_MAX_CTX)", want_ctx,
                     n_prompt, o.ngen, K3_MAX_CTX);
        goto fail;
    }
    if (n_prompt > want_ctx) {
        st = k3_errf(K3_ERR_LIMIT, err, sizeof err,
                     "prompt of %d tokens is longer than the context of %lld tokens "
                     "(--max-ctx / K3_MAXT)",
                     n_prompt, want_ctx);
        goto fail;
    }
    if ((st = open_trunk(&o, model, &mo, &cluster, &trunk, err, sizeof err))) goto fail;
    k3_session_opts so = {.max_ctx = (int)want_ctx, .chunk = o.chunk, .progress = 1};
    if ((st = k3_session_open(&sess, model, trunk, &so, err, sizeof err))) goto fail;
    k3_sampler_opts smo = {.temp = o.temp, .top_p = o.top_p, .seed = (uint64_t)o.seed};
    if (o.ngen > 0 && (st = k3_sampler_open(&sampler, &smo, cfg->vocab, err, sizeof err)))
        goto fail;

    /* ---- output files ----
     * Opened before the run so a bad path fails in milliseconds, not after
     * a long prefill. */
    k3_gen_opts go = {.ngen = o.ngen,
                      .sampler = sampler,
                      .eos = cfg->eos,
                      .n_eos = cfg->n_eos,
                      .on_token = sink_token,
                      .token_ctx = &tsink};
    if (o.all_logits) {
        lsink.path = o.all_logits;
        if (!(lsink.f = fopen(o.all_logits, "wb"))) {
            st = k3_errf(K3_ERR_IO, err, sizeof err, "--all-logits %s: %s", o.all_logits,
                         strerror(errno));
            goto fail;
        }
        go.prompt_hooks.logits = sink_logits;
        go.prompt_hooks.logits_ctx = &lsink;
    }
    if (o.trace) {
        trsink.path = o.trace;
        trsink.n_layers = cfg->n_layers;
        trsink.T = n_prompt;
        trsink.D = cfg->hidden;
        trsink.fd = open(o.trace, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (trsink.fd < 0) {
            st = k3_errf(K3_ERR_IO, err, sizeof err, "--trace %s: %s", o.trace, strerror(errno));
            goto fail;
        }
        go.prompt_hooks.trace = sink_trace;
        go.prompt_hooks.trace_ctx = &trsink;
    }
    tsink.tok = tok;
    tsink.eos = cfg->eos;
    tsink.n_eos = cfg->n_eos;

    /* ---- run ----
     * Whatever happened, the text produced so far is flushed (with any held
     * back partial UTF-8 as U+FFFD) and the ids line printed, so a failure
     * mid-generation still shows what was generated. */
    K3_INFO("prompt %d tokens, context %lld, chunk %d, %s trunk", n_prompt, want_ctx, o.chunk,
            trunk->ops->name);
    k3_gen_result res;
    /* with workers, a lost worker is waited for and the session replayed */
    st = cluster ? k3_cluster_generate(cluster, sess, prompt, n_prompt, &go, o.retry.resumes,
                                       o.retry.resume_wait_ms, &res, err, sizeof err)
                 : k3_generate(sess, prompt, n_prompt, &go, &res, err, sizeof err);
    if (tok) {
        size_t len = 0;
        const char *tail = k3_tok_stream_flush(&tsink.stream, &len);
        if (len) fwrite(tail, 1, len, stdout);
    }
    if (tsink.n > 0 || o.print_ids) printf("\n");
    if (o.print_ids) {
        printf("ids:");
        for (int i = 0; i < tsink.n; i++) printf(" %d", (int)tsink.ids[i]);
        printf("\n");
    }
    fflush(stdout);
    if (st) goto fail;
    if (lsink.f) {
        if (fclose(lsink.f) != 0 && !lsink.failed) lsink.failed = errno ? errno : EIO;
        lsink.f = NULL;
        if (lsink.failed) {
            st = k3_errf(K3_ERR_IO, err, sizeof err, "--all-logits %s: write failed: %s",
                         lsink.path, strerror(lsink.failed));
            goto fail;
        }
    }
    if (trsink.fd >= 0) {
        if (close(trsink.fd) != 0 && !trsink.failed) trsink.failed = errno;
        trsink.fd = -1;
        if (trsink.failed) {
            st = k3_errf(K3_ERR_IO, err, sizeof err, "--trace %s: write failed: %s", trsink.path,
                         strerror(trsink.failed));
            goto fail;
        }
    }

    /* ---- report ----
     * Prefill speed counts the tokens actually prefilled; decode speed the
     * forward steps after the first sampled token (the first token's cost is
     * the prefill's). */
    if (res.n_prefilled > 0)
        K3_INFO("prefill: %d tokens in %.1f ms (%.1f tok/s)", res.n_prefilled, res.prefill_ms,
                res.prefill_ms > 0 ? res.n_prefilled * 1000.0 / res.prefill_ms : 0.0);
    if (res.n_decode_steps > 0)
        K3_INFO("decode: %d tokens in %.1f ms (%.2f ms/token, %.2f tok/s)", res.n_decode_steps,
                res.decode_ms, res.decode_ms / res.n_decode_steps,
                res.decode_ms > 0 ? res.n_decode_steps * 1000.0 / res.decode_ms : 0.0);
    K3_INFO("generated %d tokens, stop: %s", res.n_gen, stop_name(res.stop));
    if (o.stats) {
        /* asked for explicitly: printed whatever the log level */
        fprintf(stderr,
                "stats: compute %.1f ms, expert reads %.1f ms, %.1f MiB read, expert hits %llu, "
                "misses %llu\n",
                res.stats.compute_ms, res.stats.read_ms,
                (double)res.stats.bytes_read / (1024.0 * 1024.0),
                (unsigned long long)res.stats.expert_hits,
                (unsigned long long)res.stats.expert_misses);
        struct k3_experts *xs = k3_model_experts(model);
        if (xs) { /* the in-process expert store: its read rate over the run */
            k3_expert_stats et;
            k3_experts_totals(xs, &et);
            fprintf(stderr,
                    "stats: expert store %.3f GB read at %.2f GB/s (%.1f ms with reads in "
                    "flight, %.1f ms waited by compute), %llu hits, %llu misses\n",
                    (double)et.bytes / 1e9, et.io_ms > 0 ? (double)et.bytes / 1e6 / et.io_ms : 0.0,
                    et.io_ms, et.read_ms, (unsigned long long)et.hits,
                    (unsigned long long)et.misses);
        }
        fprintf(stderr,
                "stats: dense weights %.1f MiB, session state %.1f MiB, peak RSS %.1f MiB\n",
                (double)k3_model_resident_bytes(model) / (1024.0 * 1024.0),
                (double)k3_session_state_bytes(sess) / (1024.0 * 1024.0), peak_rss_mib());
        if (cluster) k3_cluster_print_stats(cluster, stderr);
    }
    rc = 0;
    goto done;

fail:
    fprintf(stderr, "k3-coordinator: error: %s\n", err);
    rc = 1;
done:
    if (lsink.f) fclose(lsink.f);
    if (trsink.fd >= 0) close(trsink.fd);
    k3_tok_stream_reset(&tsink.stream);
    free(tsink.ids);
    k3_sampler_close(&sampler);
    k3_session_close(&sess);
    k3_trunk_close(&trunk);
    k3_cluster_close(&cluster);
    k3_tok_close(&tok);
    if (model && k3_model_usage_save(model, err, sizeof err) != K3_OK)
        K3_WARN("expert usage history not saved: %s", err);
    k3_model_close(&model);
    free(prompt);
    free(pos);
    k3_opts_free(coord_table, N_COORD_OPTS, &o);
    return rc;
}
