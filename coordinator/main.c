/* coordinator/main.c: the k3-coordinator program.
 *
 *   k3-coordinator --model DIR [--local N] [--ids 5,7,9 | "prompt" | - | --file F |
 *                  --chat "text" [--system S] [--think=0]] [--ngen N] [--stop STR]...
 *                  [--exact] [--chunk C] [--temp T --top-p P --top-k K --min-p M
 *                  --repeat-penalty R --seed S] [--ignore-eos]
 *                  [--print-ids] [--all-logits FILE] [--trace FILE]
 *                  [--threads N] [--dirs a,b] [--stats]
 *   k3-coordinator tokenize ...            (coordinator/cmd_tokenize.c)
 *   k3-coordinator place ...               (coordinator/cmd_place.c)
 *   k3-coordinator serve ...               (coordinator/serve.c, docs/SERVING.md)
 *   k3-coordinator chat ...                (coordinator/cmd_chat.c, docs/CHAT.md)
 *   k3-coordinator web ...                 (coordinator/cmd_web.c, docs/WEB.md)
 *
 * Every setting comes from the one table below (flags, K3_* variables,
 * defaults, ranges, --help). main() validates the options, opens the
 * engine (coordinator/engine.h: the model, the tokenizer when the model
 * directory has one, and a trunk), runs one generation on it and reports.
 * Generated text streams to stdout token by token; progress and timings go
 * to stderr.
 * Exit status: 0 done, 1 runtime error (named on stderr), 2 bad usage.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/cli_prompt.h"
#include "coordinator/cli_stop.h"
#include "coordinator/cluster.h"
#include "coordinator/cmd_chat.h"
#include "coordinator/cmd_doctor.h"
#include "coordinator/cmd_plan.h"
#include "coordinator/cmd_repack.h"
#include "coordinator/cmd_place.h"
#include "coordinator/cmd_status.h"
#include "coordinator/cmd_tokenize.h"
#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/text/tokenizer.h"
#include "coordinator/engine.h"
#include "coordinator/generate.h"
#include "coordinator/keygen.h"
#include "coordinator/serve.h"
#include "coordinator/serve_stop.h"
#include "common/text/chat.h"
#include "coordinator/cmd_web.h"
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
    char *file;         /* prompt text from this file ("-" = stdin) */
    char *chat;         /* one chat turn ("-" = stdin) */
    char *system;       /* its system message */
    int ignore_eos;     /* eos does not stop */
    int top_k;          /* 0 = off */
    double min_p;       /* 0 = off */
    double repeat_penalty; /* 1 = off */
    k3_opt_list stops;     /* --stop strings (repeatable) */
    /* cluster (coordinator/cluster.h) */
    k3_cluster_cli cl; /* K3_CLUSTER_OPT_ROWS: --local, --workers, liveness, keys */
    int pipe_chunk;    /* tokens per pipelined micro-chunk, 0 = auto */
    int max_sessions;  /* session states each local worker holds */
    int stripe;        /* stripe the experts over --dirs (coordinator/cmd_place.h) */
    int stripe_remote; /* --stripe with each local worker serving its drives to the others */
    int split;         /* --stripe: byte-split (every expert over every drive) */
    int help;
} coord_opts;

/* The one table of the program. Order is --help order: what a user needs
 * first (model, prompt, generation), then the engine's numerics and tuning
 * (the rows shared with k3-worker, common/engine/engine_opts.h), then the cluster.
 * Variables keep the seed engine's names (K3_BITS, K3_CHUNK, COLI_TEMP, ...)
 * so existing scripts keep working; flags beat variables, variables beat
 * the defaults, and the defaults are docs/MODEL.md 4.2 / docs/INTERFACES.md 3's. */
#define O(f) offsetof(coord_opts, f)
static const k3_opt coord_table[] = {
    K3_ENGINE_OPT_MODEL(coord_opts, eng),
    K3_CLUSTER_OPT_ROWS(coord_opts, cl),
    {.name = "ids",
     .flag = "--ids",
     .type = K3_OPT_STRING,
     .offset = O(ids),
     .metavar = "5,7,9",
     .help = "raw prompt ids (commas or spaces), no BOS added"},
    /* Own rows, unlike chat's and serve's of the same flag or variable:
     * --ngen may be 0 (prompt only, for --all-logits / --trace) and defaults to
     * a short run; --max-ctx sizes one generation (0 = prompt + ngen) where
     * K3_ENGINE_OPT_CTX is a session's fixed capacity; --think is a switch
     * for one turn (chat's takes on|off, as its :think does); --system only
     * goes with --chat and has no variable (chat's reads K3_SYSTEM). */
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
    K3_ENGINE_OPT_CHUNK(coord_opts, chunk),
    K3_SAMPLER_OPT_ROWS(coord_opts, temp, top_p, seed, "0"),
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
     .flag = "--think",
     .env = "K3_THINK",
     .type = K3_OPT_BOOL,
     .offset = O(think),
     .def = "1",
     .help = "--chat: open the think channel, reasoning on stderr (0 = response only)"},
    {.name = "file",
     .flag = "--file",
     .short_flag = 'f',
     .type = K3_OPT_STRING,
     .offset = O(file),
     .metavar = "FILE",
     .help = "prompt text from FILE ('-' = standard input; so is a lone '-' argument)"},
    {.name = "chat",
     .flag = "--chat",
     .type = K3_OPT_STRING,
     .offset = O(chat),
     .metavar = "TEXT",
     .help = "one user turn through the chat template ('-' = standard input); the answer on "
             "stdout"},
    {.name = "system",
     .flag = "--system",
     .type = K3_OPT_STRING,
     .offset = O(system),
     .metavar = "TEXT",
     .help = "--chat: the system message before the turn"},
    {.name = "ignore_eos",
     .flag = "--ignore-eos",
     .env = "K3_IGNORE_EOS",
     .type = K3_OPT_BOOL,
     .offset = O(ignore_eos),
     .help = "generate --ngen tokens whatever is sampled (eos does not stop)"},
    {.name = "top_k",
     .flag = "--top-k",
     .env = "K3_TOP_K",
     .type = K3_OPT_INT,
     .offset = O(top_k),
     .def = "0",
     .min = 0,
     .max = K3_MAX_VOCAB,
     .metavar = "K",
     .help = "sample among the K most probable tokens, 0 = off"},
    {.name = "min_p",
     .flag = "--min-p",
     .env = "K3_MIN_P",
     .type = K3_OPT_DOUBLE,
     .offset = O(min_p),
     .def = "0",
     .min = 0,
     .max = 1,
     .metavar = "M",
     .help = "drop tokens less probable than M x the most probable one, 0 = off"},
    {.name = "repeat_penalty",
     .flag = "--repeat-penalty",
     .env = "K3_REPEAT_PENALTY",
     .type = K3_OPT_DOUBLE,
     .offset = O(repeat_penalty),
     .def = "1",
     .min = 0,
     .max = 10,
     .min_open = 1,
     .metavar = "R",
     .help = "divide positive logits (multiply negative ones) of the last 64 generated tokens "
             "by R, 1 = off"},
    {.name = "stop",
     .flag = "--stop",
     .type = K3_OPT_MULTI,
     .offset = O(stops),
     .max = K3_SERVE_MAX_STOPS,
     .metavar = "STR",
     .help = "stop when the generated text contains STR (not printed)"},
    K3_ENGINE_OPT_ROWS(coord_opts, eng),
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
    /* passed to each local worker (its --max-sessions), 0 = the worker's
     * default; serve's --max-sessions is the server's own pool */
    {.name = "max_sessions",
     .flag = "--max-sessions",
     .type = K3_OPT_INT,
     .offset = O(max_sessions),
     .def = "0",
     .min = 0,
     .max = K3_MAX_SESSIONS,
     .metavar = "N",
     .help = "session states each local worker holds, 0 = the worker's default"},
    {.name = "stripe",
     .flag = "--stripe",
     .type = K3_OPT_BOOL,
     .offset = O(stripe),
     .help = "stripe the experts over --dirs (D/k3-stripe/) so every process reads all drives"},
    {.name = "stripe_remote",
     .flag = "--stripe-remote",
     .type = K3_OPT_BOOL,
     .offset = O(stripe_remote),
     .help = "--stripe, and --local worker i reads only the drives d % N == i (for every MoE "
             "layer) and serves them to the other workers (expert calls)"},
    {.name = "split",
     .flag = "--split",
     .type = K3_OPT_BOOL,
     .offset = O(split),
     .help = "--stripe: cut every expert's bytes over all --dirs (k3-coordinator place --split) "
             "instead of dealing whole experts"},
    K3_OPT_HELP(coord_opts, help),
};
#undef O
#define N_COORD_OPTS ((int)(sizeof coord_table / sizeof coord_table[0]))

static const char *usage_text =
    "usage: k3-coordinator --model DIR [options] [\"prompt\" | - | --file F | --ids 5,7,9 |\n"
    "                      --chat \"text\" [--system S]]\n"
    "       k3-coordinator tokenize [options]    (k3-coordinator tokenize --help)\n"
    "       k3-coordinator keygen FILE    (CURVE key pair: FILE.key 0600, FILE.pub)\n"
    "       k3-coordinator place --model DIR --drives D1,D2    (stripe experts over drives)\n"
    "       k3-coordinator serve --model DIR [options]    (OpenAI-compatible HTTP API, "
    "docs/SERVING.md)\n"
    "       k3-coordinator chat --model DIR [options]    (chat prompt in the terminal, "
    "docs/CHAT.md)\n"
    "       k3-coordinator web --model DIR [serve options]    (serve + the chat page at /, "
    "docs/WEB.md)\n"
    "       k3-coordinator repack SRC DST [options]    (repacked container, docs/DEPLOY.md)\n"
    "       k3-coordinator doctor --model DIR [--drives D1,..]    (checks a run's needs)\n"
    "       k3-coordinator plan --model DIR --drives D1,..    (workers, drives, budgets)\n"
    "       k3-coordinator status --workers EP,...    (one row per worker, docs/DEPLOY.md)\n"
    "\n"
    "Generates text with Kimi K3. A text prompt is tokenized with the model\n"
    "directory's tokenizer (tiktoken.model) and gets BOS; --ids are used as given.\n"
    "The first SIGINT/SIGTERM stops after the current step and reports; a second\n"
    "one exits at once. Exit status: 0 done, 1 error, 2 bad usage, 128+N signal N.";

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
    serve_stop stop;      /* --stop strings over the printed text */
    int n_stops;          /* 0: text passes through */
    k3_chat_filter *chat; /* --chat: hides the template, reasoning to stderr; owned */
    int in_reasoning;     /* reasoning text was printed last (a newline ends it) */
    const char *stopped;  /* the sink asked the engine to stop: why; NULL = it did not */
} token_sink;

/* Text for stdout, through the --stop matcher: what precedes a stop string
 * is printed, the rest is not, and the generation stops after this step. */
static void sink_text(token_sink *s, const char *txt, size_t len, int flush) {
    if (!s->n_stops) {
        if (len) fwrite(txt, 1, len, stdout);
        return;
    }
    const char *o = NULL;
    size_t olen = 0;
    int hit = serve_stop_push(&s->stop, txt, len, flush, &o, &olen);
    if (olen) fwrite(o, 1, olen, stdout);
    if (hit && !s->stopped) {
        s->stopped = "stop string";
        k3_cli_stop_request();
    }
}

/* --chat: one id through the chat filter; reasoning goes to stderr. */
static void sink_chat(token_sink *s, int32_t id) {
    k3_chat_delta d;
    k3_chat_filter_push(s->chat, id, &d);
    if (d.reasoning_len) {
        fwrite(d.reasoning, 1, d.reasoning_len, stderr);
        s->in_reasoning = 1;
    }
    if (d.content_len && s->in_reasoning) {
        fputc('\n', stderr);
        s->in_reasoning = 0;
    }
    if (d.content_len) sink_text(s, d.content, d.content_len, 0);
    if (d.done && !s->stopped) {
        s->stopped = "end of turn";
        k3_cli_stop_request();
    }
}

/* The request's on_token, for every sampled id before it is fed back: the
 * text is on stdout (flushed) as soon as the token exists. */
static void sink_token(void *ctx, int32_t id) {
    token_sink *s = ctx;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->ids = k3_xrealloc(s->ids, (size_t)s->cap * sizeof *s->ids);
    }
    s->ids[s->n++] = id;
    if (s->chat) {
        sink_chat(s, id);
        fflush(stdout);
        return;
    }
    for (int i = 0; i < s->n_eos; i++)
        if (s->eos[i] == id) return; /* the stop token is reported by --print-ids, not printed */
    if (s->tok) {
        size_t len = 0;
        const char *txt = k3_tok_stream_push(s->tok, &s->stream, id, &len);
        sink_text(s, txt, len, 0);
    } else {
        char num[16];
        int len = snprintf(num, sizeof num, "%d ", (int)id);
        sink_text(s, num, (size_t)len, 0);
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
 * step); sinks_close checks it after the run and fails with the file's name. */
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

/* The output of one run: the token stream and the --all-logits / --trace
 * files. */
typedef struct cli_sinks {
    token_sink tok;
    logits_sink logits;
    trace_sink trace;
} cli_sinks;

/* Opens the output files (before the run, so a bad path fails in
 * milliseconds, not after a long prefill) and points req's callbacks at
 * the sinks. chat_channel: -1 = plain text, else the k3_chat_channel the
 * --chat generation starts in. */
static k3_status sinks_open(const coord_opts *o, k3_engine *e, int n_prompt, int chat_channel,
                            cli_sinks *s, k3_engine_req *req, char *err, size_t errlen) {
    const k3_config *cfg = k3_engine_config(e);
    if (o->all_logits) {
        s->logits.path = o->all_logits;
        if (!(s->logits.f = fopen(o->all_logits, "wb")))
            return k3_errf(K3_ERR_IO, err, errlen, "--all-logits %s: %s", o->all_logits,
                           strerror(errno));
        req->prompt_hooks.logits = sink_logits;
        req->prompt_hooks.logits_ctx = &s->logits;
    }
    if (o->trace) {
        s->trace.path = o->trace;
        s->trace.n_layers = cfg->n_layers;
        s->trace.T = n_prompt;
        s->trace.D = cfg->hidden;
        s->trace.fd = open(o->trace, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (s->trace.fd < 0)
            return k3_errf(K3_ERR_IO, err, errlen, "--trace %s: %s", o->trace, strerror(errno));
        req->prompt_hooks.trace = sink_trace;
        req->prompt_hooks.trace_ctx = &s->trace;
    }
    s->tok.tok = k3_engine_tok(e);
    s->tok.eos = cfg->eos;
    s->tok.n_eos = o->ignore_eos ? 0 : cfg->n_eos;
    if (o->stops.n) {
        serve_stop_init(&s->tok.stop, (const char *const *)o->stops.items, o->stops.n);
        s->tok.n_stops = o->stops.n;
    }
    if (chat_channel >= 0) {
        k3_chat_filter_opts fo = {.start = (k3_chat_channel)chat_channel,
                                  .stop_ids = cfg->eos,
                                  .n_stop_ids = o->ignore_eos ? 0 : cfg->n_eos};
        k3_status st = k3_chat_filter_open(&s->tok.chat, s->tok.tok, &fo, err, errlen);
        if (st) return st;
    }
    req->on_token = sink_token;
    req->token_ctx = &s->tok;
    return K3_OK;
}

/* Ends the stdout output, whatever happened: the text produced so far
 * (with any held back partial UTF-8 as U+FFFD) and the ids line, so a
 * failure mid-generation still shows what was generated. */
static void sinks_print(const coord_opts *o, cli_sinks *s) {
    if (s->tok.chat) {
        k3_chat_delta d;
        k3_chat_filter_finish(s->tok.chat, &d);
        if (d.reasoning_len) fwrite(d.reasoning, 1, d.reasoning_len, stderr);
        sink_text(&s->tok, d.content, d.content_len, 1);
    } else if (s->tok.tok) {
        size_t len = 0;
        const char *tail = k3_tok_stream_flush(&s->tok.stream, &len);
        sink_text(&s->tok, tail, len, 1);
    } else {
        sink_text(&s->tok, "", 0, 1);
    }
    if (s->tok.n > 0 || o->print_ids) printf("\n");
    if (o->print_ids) {
        printf("ids:");
        for (int i = 0; i < s->tok.n; i++) printf(" %d", (int)s->tok.ids[i]);
        printf("\n");
    }
    fflush(stdout);
}

/* Closes the output files after a run; a write that failed during the run
 * (remembered by the sink) or at close is the error, naming the file. */
static k3_status sinks_close(cli_sinks *s, char *err, size_t errlen) {
    if (s->logits.f) {
        if (fclose(s->logits.f) != 0 && !s->logits.failed) s->logits.failed = errno ? errno : EIO;
        s->logits.f = NULL;
        if (s->logits.failed)
            return k3_errf(K3_ERR_IO, err, errlen, "--all-logits %s: write failed: %s",
                           s->logits.path, strerror(s->logits.failed));
    }
    if (s->trace.fd >= 0) {
        if (close(s->trace.fd) != 0 && !s->trace.failed) s->trace.failed = errno;
        s->trace.fd = -1;
        if (s->trace.failed)
            return k3_errf(K3_ERR_IO, err, errlen, "--trace %s: write failed: %s", s->trace.path,
                           strerror(s->trace.failed));
    }
    return K3_OK;
}

/* Frees what the sinks hold; files still open (a failed run) are closed. */
static void sinks_free(cli_sinks *s) {
    if (s->logits.f) fclose(s->logits.f);
    if (s->trace.fd >= 0) close(s->trace.fd);
    k3_tok_stream_reset(&s->tok.stream);
    if (s->tok.n_stops) serve_stop_free(&s->tok.stop);
    k3_chat_filter_close(&s->tok.chat);
    free(s->tok.ids);
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

/* The stop rule as the report names it. */
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

/* Parses and checks the options, and --ids into *ids [*n_ids]. Returns -1
 * to go on, 0 after --help, 2 on bad usage (named on stderr). */
static int parse_cli(int argc, char **argv, coord_opts *o, k3_opt_src *src, char **pos, int *n_pos,
                     int32_t **ids, int *n_ids) {
    char err[1024] = "";
    memset(o, 0, sizeof *o);
    k3_status st =
        k3_opts_parse(coord_table, N_COORD_OPTS, o, src, argc, argv, pos, n_pos, err, sizeof err);
    if (!st && o->help) {
        k3_opts_help(stdout, usage_text, coord_table, N_COORD_OPTS);
        return 0;
    }
    /* usage checks that need more than one option */
    if (!st && !o->eng.model)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--model: missing (the checkpoint directory)");
    if (!st && *n_pos > 1)
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "unexpected argument '%s': give one prompt (quote it)", pos[1]);
    int sources = (*n_pos == 1) + (o->ids != NULL) + (o->file != NULL) + (o->chat != NULL);
    if (!st && sources > 1)
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "give one prompt: a text (or '-'), --file, --ids or --chat");
    if (!st && sources == 0)
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "no prompt: give a prompt text, '-' (stdin), --file, --ids or --chat");
    if (!st && o->system && !o->chat)
        st = k3_errf(K3_ERR_ARG, err, sizeof err, "--system goes with --chat");
    /* --exact means all-f32; an explicit conflicting flag is a mistake */
    if (!st) st = k3_engine_opts_resolve(&o->eng, coord_table, N_COORD_OPTS, src, err, sizeof err);
    if (!st && o->ids) st = parse_ids(o->ids, ids, n_ids, err, sizeof err);
    /* --stripe-remote deals the drives of --placement, or of the one
     * --dirs gets here */
    if (!st && o->split && (!o->stripe || o->stripe_remote))
        st = k3_errf(K3_ERR_ARG, err, sizeof err,
                     "--split goes with --stripe (not --stripe-remote: a worker serving some "
                     "drives needs whole experts on them)");
    if (!st && (o->stripe || (o->stripe_remote && !o->eng.placement)))
        st = k3_place_stripe_dirs(&o->eng, o->split, err, sizeof err);
    if (st) {
        fprintf(stderr, "k3-coordinator: %s\n", err);
        return 2;
    }
    k3_engine_opts_apply(&o->eng); /* --log-level, --isa */
    return -1;
}

/* The engine's settings (coordinator/engine.h) from the options: the trunk
 * is in-process for --local 0, else the cluster of --workers or of --local
 * N worker processes. */
static void engine_settings(const coord_opts *o, const k3_opt_src *src, k3_engine_open_opts *eo) {
    k3_engine_open_opts_from_cli(eo, &o->eng, &o->cl, coord_table, N_COORD_OPTS, src);
    eo->cluster.max_sessions = o->max_sessions;
    eo->cluster.stripe_remote = o->stripe_remote;
    eo->cluster.pipe_chunk = o->pipe_chunk;
    eo->want_trace = o->trace != NULL;
    eo->chunk = o->chunk;
    eo->progress = 1;
    eo->n_sessions = 1; /* one generation */
}

/* A model without its head (K3_LAYERS truncation) can only trace: a usage
 * error (exit 2) for anything else. */
static int check_head(const coord_opts *o, k3_engine *e) {
    const k3_config *cfg = k3_engine_config(e);
    if (cfg->n_layers == cfg->n_layers_full || (o->ngen == 0 && !o->all_logits)) return 0;
    fprintf(stderr,
            "k3-coordinator: K3_LAYERS=%d truncates the stack of %d layers: no head runs, so "
            "only --trace with --ngen 0 works\n",
            cfg->n_layers, cfg->n_layers_full);
    return 2;
}

/* Prefill speed counts the tokens actually prefilled; decode speed the
 * forward steps after the first sampled token (the first token's cost is
 * the prefill's). --stats is printed whatever the log level. */
static void report(const coord_opts *o, k3_engine *e, const k3_engine_result *er, const char *why) {
    const k3_gen_result *res = &er->gen;
    if (res->n_prefilled > 0)
        K3_INFO("prefill: %d tokens in %.1f ms (%.1f tok/s)", res->n_prefilled, res->prefill_ms,
                res->prefill_ms > 0 ? res->n_prefilled * 1000.0 / res->prefill_ms : 0.0);
    if (res->n_decode_steps > 0)
        K3_INFO("decode: %d tokens in %.1f ms (%.2f ms/token, %.2f tok/s)", res->n_decode_steps,
                res->decode_ms, res->decode_ms / res->n_decode_steps,
                res->decode_ms > 0 ? res->n_decode_steps * 1000.0 / res->decode_ms : 0.0);
    K3_INFO("generated %d tokens, stop: %s", res->n_gen, why ? why : stop_name(res->stop));
    if (o->stats) k3_engine_print_stats(e, er, stderr);
}

int main(int argc, char **argv) {
    /* subcommands first: they have their own options */
    if (argc > 1 && !strcmp(argv[1], "tokenize")) return cmd_tokenize(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "keygen")) return cmd_keygen(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "serve")) return cmd_serve(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "chat")) return cmd_chat(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "web")) return cmd_web(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "repack")) return cmd_repack(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "doctor")) return cmd_doctor(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "plan")) return cmd_plan(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "place")) return cmd_place(argc - 1, argv + 1);
    if (argc > 1 && !strcmp(argv[1], "status")) return cmd_status(argc - 1, argv + 1);
    k3_log_init("k3-coordinator");

    char err[1024] = "";
    coord_opts o;
    k3_opt_src src[N_COORD_OPTS];
    char **pos = k3_xcalloc((size_t)argc + 1, sizeof *pos);
    int n_pos = 0;
    int32_t *prompt = NULL;
    int n_prompt = 0;
    k3_engine *eng = NULL;
    cli_sinks sinks = {.trace.fd = -1};
    k3_engine_open_opts eo;
    k3_engine_result res;
    k3_status st;
    char *text = NULL; /* --file / stdin / --chat - text, owned */
    size_t text_len = 0;
    int chat_channel = -1; /* --chat: the channel the answer starts in */

    int rc = parse_cli(argc, argv, &o, src, pos, &n_pos, &prompt, &n_prompt);
    if (rc >= 0) goto done;
    const atomic_int *cancel = k3_cli_stop_install();
    engine_settings(&o, src, &eo);
    if ((st = k3_engine_open(&eng, &eo, err, sizeof err))) goto fail;
    if ((rc = check_head(&o, eng))) goto done;
    /* a text prompt: the command line is the operator's own text, so added
     * tokens typed there ("<|open|>") are recognised (trusted encode) */
    if (!prompt && !k3_engine_tok(eng)) {
        st = k3_errf(K3_ERR_MISSING, err, sizeof err,
                     "text prompt given but %s has no tokenizer (tiktoken.model): use --ids",
                     o.eng.model);
        goto fail;
    }
    /* the text: an argument, '-' or --file (stdin or a file), or --chat */
    const char *src_path = o.file ? o.file : n_pos == 1 && !strcmp(pos[0], "-") ? "-" : NULL;
    if (o.chat && !strcmp(o.chat, "-")) src_path = "-";
    if (!prompt && src_path && (st = k3_cli_read_text(src_path, &text, &text_len, err, sizeof err)))
        goto fail;
    if (!prompt && o.chat) {
        int think_first = 0;
        st = k3_cli_chat_ids(k3_engine_tok(eng), o.system, text ? text : o.chat, o.think, &prompt,
                             &n_prompt, &think_first, err, sizeof err);
        if (st) goto fail;
        chat_channel = think_first ? K3_CHAT_CH_THINK : K3_CHAT_CH_RESPONSE;
    }
    if (!prompt &&
        (st = k3_engine_encode(eng, text ? text : pos[0], text ? text_len : strlen(pos[0]), 1,
                               &prompt, &n_prompt, err, sizeof err)))
        goto fail;
    k3_engine_req req = {.session_id = 0,
                         .prompt = prompt,
                         .n_prompt = n_prompt,
                         .ngen = o.ngen,
                         .max_ctx = o.max_ctx,
                         .sampling = {.temp = o.temp,
                                      .top_p = o.top_p,
                                      .seed = (uint64_t)o.seed,
                                      .top_k = o.top_k,
                                      .min_p = o.min_p,
                                      .repeat_penalty = o.repeat_penalty},
                         .ignore_eos = o.ignore_eos};
    if ((st = sinks_open(&o, eng, n_prompt, chat_channel, &sinks, &req, err, sizeof err)))
        goto fail;
    req.cancel = cancel;
    st = k3_engine_generate(eng, &req, &res, err, sizeof err);
    sinks_print(&o, &sinks);
    if (st == K3_ERR_CANCEL && k3_cli_stop_signal()) {
        /* a graceful stop: what ran is reported, the engine closes below
         * (usage history saved, workers stopped, ipc directory removed) */
        int sig = k3_cli_stop_signal();
        sinks_close(&sinks, err, sizeof err);
        report(&o, eng, &res, "interrupted");
        K3_WARN("stopped by signal %d (%s) after %d generated tokens", sig, strsignal(sig),
                res.gen.n_gen);
        rc = 128 + sig;
        goto done;
    }
    if (st == K3_ERR_CANCEL && sinks.tok.stopped) st = K3_OK; /* --stop, end of the turn */
    if (st || (st = sinks_close(&sinks, err, sizeof err))) goto fail;
    report(&o, eng, &res, sinks.tok.stopped);
    rc = 0;
    goto done;

fail:
    fprintf(stderr, "k3-coordinator: error: %s\n", err);
    rc = 1;
done:
    sinks_free(&sinks);
    k3_engine_close(&eng);
    free(prompt);
    free(text);
    free(pos);
    k3_opts_free(coord_table, N_COORD_OPTS, &o);
    return rc;
}
