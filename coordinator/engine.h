/* coordinator/engine.h: the one entry point every front end of the
 * coordinator calls (the k3-coordinator command line today; an HTTP server
 * or a chat prompt hold one engine the same way).
 *
 * Owns: the model's global tensors (all layers too when in-process), the
 * tokenizer (when the model directory has one), the trunk (in-process
 * stages, or a cluster of local or remote k3-worker processes,
 * coordinator/cluster.h) and a table of sessions keyed by the caller's
 * session id, each a coordinator/generate.h session whose committed ids are
 * reused as a prefix by the next request on the same id.
 * Borrows: the strings of the open options (model and shard directories,
 * endpoints, key files) for the engine's whole life; a request's prompt
 * and callbacks during its k3_engine_generate call.
 * Threads: k3_engine_open and k3_engine_close run on one thread while no
 * other call is in flight (open may setenv: call it before starting other
 * threads). k3_engine_generate may run from several threads at once on
 * different session ids; a second call on a session id that is running
 * fails with K3_ERR_BUSY. The callbacks run on the calling thread.
 *
 * With workers, a generation that loses a worker waits for the cluster and
 * replays the session's ids (k3_cluster_generate): the tokens equal an
 * uninterrupted run's.
 *
 * Cancellation: k3_engine_req.cancel stops a running generation between
 * steps (K3_ERR_CANCEL); in-process a step is every layer of one chunk, with
 * workers one chunk through every stage.
 *
 * Not handled: sessions that outgrow the
 * capacity they were opened with (a request with another capacity reopens
 * the session and loses its prefix).
 */
#ifndef K3_ENGINE_H
#define K3_ENGINE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/base/err.h"
#include "common/ckpt/config.h"
#include "common/engine/engine_opts.h"
#include "common/text/tokenizer.h"
#include "coordinator/cluster.h"
#include "coordinator/generate.h"
#include "coordinator/sampler.h"

typedef struct k3_engine k3_engine;

typedef struct k3_engine_open_opts {
    const k3_engine_opts *eng; /* model, numerics, threads, expert cache; borrowed */
    int bits_explicit;         /* --bits / K3_BITS was given (local workers get it only then) */
    int usage_flag;            /* the usage history was a flag: exported as K3_USAGE for local
                                  workers, which read the inherited environment */
    /* The trunk: in-process when cluster.n_workers == 0 and cluster.local
     * == 0, else these workers; .model and .exact are filled by the engine. */
    k3_cluster_opts cluster;
    int want_trace;       /* requests will trace: warn before a cluster starts that it traces
                             only each stage's last layer */
    int chunk;            /* prefill chunk, tokens, 1..K3_MAX_CHUNK */
    int progress;         /* one stderr line per prefill chunk */
    int n_sessions;       /* sessions held at once, 1..K3_MAX_SESSIONS; the least recently used
                             idle one is closed to make room */
    int max_resumes;      /* replays after a worker loss, per generate call */
    int resume_wait_ms;   /* how long a replay waits for the cluster to be whole */
    int ckpt;             /* turn checkpoints per session (generate.h), 0 = none; with workers
                             they live on the workers (PROTOCOL.md "Checkpoints") */
    const char *ckpt_dir; /* --ckpt-dir: checkpoints parked on disk too, NULL = none; a
                             restarted engine resumes from them (coordinator/ckpt_dir.h; local
                             workers park theirs in ckpt_dir/w<i>-<a>-<b>) */
} k3_engine_open_opts;

/* Defaults: no engine options (set .eng), k3_cluster_opts_default (2 local
 * workers), chunk 32, progress on, 16 sessions, K3_CLUSTER_RESUMES resumes of at most
 * K3_CLUSTER_RESUME_WAIT_MS. */
void k3_engine_open_opts_default(k3_engine_open_opts *o);
/* The defaults, then what every front end (the CLI, serve, chat) takes from
 * its option table alike: the engine rows eng (borrowed), whether --bits and
 * --usage came from the command line (src of table's rows "bits" and
 * "usage"), the trunk of the cluster rows cl and their replay back-offs.
 * The caller sets the rest (chunk, progress, sessions, ...). */
void k3_engine_open_opts_from_cli(k3_engine_open_opts *o, const k3_engine_opts *eng,
                                  const k3_cluster_cli *cl, const k3_opt *table, int n_table,
                                  const k3_opt_src *src);

/* The rows the front ends share beyond the engine and cluster rows (int
 * fields f of T), one definition each: --chunk (the CLI, serve and chat:
 * k3_engine_open_opts.chunk) and --ctx (serve and chat: the capacity every
 * session is opened with). The CLI's --max-ctx is another setting on the
 * same variable K3_MAXT (0 = prompt + ngen, one generation), and so is
 * k3-worker's (the most a session may grow to): both stay in their tables. */
// clang-format off
#define K3_ENGINE_OPT_CHUNK(T, f)                                                                  \
    {.name = "chunk", .flag = "--chunk", .env = "K3_CHUNK", .type = K3_OPT_INT,                   \
     .offset = offsetof(T, f), .def = "32", .min = 1, .max = K3_MAX_CHUNK, .metavar = "C",        \
     .help = "prefill chunk in tokens (bit-identical results for every value)"}
#define K3_ENGINE_OPT_CTX(T, f)                                                                    \
    {.name = "ctx", .flag = "--ctx", .env = "K3_MAXT", .type = K3_OPT_INT,                        \
     .offset = offsetof(T, f), .def = "8192", .min = 2, .max = K3_MAX_CTX, .metavar = "N",        \
     .help = "context of a session in tokens (prompt + answers)"}
// clang-format on

/* Loads the model (the global tensors; every layer too when in-process),
 * the tokenizer when the directory has tiktoken.model (a broken one is an
 * error, a missing one means ids only), then opens the trunk. Logs the
 * load on stderr. On failure *out stays NULL and the error names the first
 * step that failed. */
k3_status k3_engine_open(k3_engine **out, const k3_engine_open_opts *o, char *err, size_t errlen);
/* Closes every session, the trunk (stopping local workers), the tokenizer,
 * saves the expert usage history (a failure is a warning) and frees the
 * model. Accepts NULL; nulls the pointer. */
void k3_engine_close(k3_engine **e);

const k3_config *k3_engine_config(const k3_engine *e);
/* The tokenizer, or NULL when the model directory has none. */
const k3_tok *k3_engine_tok(const k3_engine *e);

/* BOS (when the config has one) + the tokens of text[0, len) into a new
 * array *ids [*n] owned by the caller. trusted: added tokens typed in the
 * text ("<|open|>") are recognised (the operator's own text), else they
 * are plain text. Fails without a tokenizer, for an empty result and
 * beyond K3_MAX_CTX tokens. */
k3_status k3_engine_encode(const k3_engine *e, const char *text, size_t len, int trusted,
                           int32_t **ids, int *n, char *err, size_t errlen);

/* One generation request. */
typedef struct k3_engine_req {
    uint64_t session_id;        /* the session to run on (opened on first use) */
    const int32_t *prompt;      /* [n_prompt] ids, BOS included when wanted; borrowed */
    int n_prompt;               /* >= 1 */
    int ngen;                   /* tokens to generate, 0..K3_MAX_NGEN */
    int max_ctx;                /* session capacity, 0 = n_prompt + ngen */
    k3_sampler_opts sampling;   /* temp, top_p, seed: a fresh sampler per request */
    k3_feed_hooks prompt_hooks; /* the prompt's prefill: teacher-forced logits, trace, progress
                                   (after a worker loss, progress restarts with the replay) */
    void (*on_token)(void *ctx, int32_t id); /* each generated id as soon as it is sampled */
    void *token_ctx;
    /* Cancellation (NULL = none), set by any thread: once it reads nonzero
     * the generation stops before its next step (every prefill chunk,
     * every decode token) and returns K3_ERR_CANCEL. The session keeps the
     * ids committed so far (prompt chunks and generated tokens), so the
     * next request on it reuses them. Set while a prefill chunk runs, it
     * stops the chunk within one layer step; the session then resets. */
    const atomic_int *cancel;
    int ignore_eos; /* 1: an eos id does not stop the generation (ngen and context still do) */
} k3_engine_req;

typedef struct k3_engine_result {
    k3_gen_result gen;  /* counts (prompt tokens reused as the session's prefix: gen.n_reused;
                           prefilled now: gen.n_prefilled), stop rule, timings, step statistics */
    int max_ctx;        /* capacity of the session, tokens */
    size_t state_bytes; /* session state held in this process after the call */
} k3_engine_result;

/* Runs req on its session: a prompt that extends the session's committed
 * ids prefills only the tail (generate.h's prefix reuse), anything else
 * resets it. Checks the context (K3_MAX_CTX, prompt <= capacity) before any
 * state is allocated. On failure the tokens produced so far have been
 * passed to on_token and *res holds what ran. */
k3_status k3_engine_generate(k3_engine *e, const k3_engine_req *req, k3_engine_result *res,
                             char *err, size_t errlen);

/* How many leading ids of prompt[0, n) a request on session id with
 * capacity max_ctx would reuse: the session's committed ids when they are
 * a prefix of prompt, else its deepest turn checkpoint within the common
 * prefix (generate.h k3_session_reusable), else 0 (also when the session
 * is not held, is
 * running or has another capacity). *last_use (may be NULL) gets its
 * least-recently-used clock, 0 when not held. For a server that picks the
 * session with the longest reusable prefix. */
int k3_engine_session_reuse(k3_engine *e, uint64_t id, const int32_t *prompt, int n, int max_ctx,
                            uint64_t *last_use);
/* Sessions held now (*live, idle or running) and running (*busy). */
void k3_engine_sessions(k3_engine *e, int *live, int *busy);
/* The cluster of the trunk, or NULL in-process (introspection: stages,
 * per-stage statistics). */
k3_cluster *k3_engine_cluster(k3_engine *e);
/* The model (in-process: every layer and its expert store). */
k3_model *k3_engine_model(k3_engine *e);

/* The --stats lines for res (step statistics, the in-process expert store,
 * memory, per-stage cluster lines) on f. */
void k3_engine_print_stats(k3_engine *e, const k3_engine_result *res, FILE *f);

#endif
