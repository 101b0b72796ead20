/* coordinator/generate.h: sessions and the generation loop of the coordinator.
 *
 * Owns: a session (its committed token ids, the trunk's state for it, chunk
 * buffers for the AttnRes boundary state) and the step loop of
 * ARCHITECTURE.md "One forward step": embed -> trunk (every layer) -> head ->
 * sample, with chunked prefill, prefix reuse (a prompt that extends the
 * committed ids prefills only the tail; any other prompt resets) and the
 * stop rules (eos, ngen, context full).
 * Borrows: the model (embedding, final head) and the trunk, which must
 * outlive every session opened on them; the sampler passed to k3_generate.
 *
 * The trunk is the layer stack [0, n_layers) behind the coordinator. It is
 * an interface so that the in-process path (k3_trunk_open_inproc: the stage
 * API of common/engine/stage.h on this process's model) and the cluster path
 * (coordinator/cluster.c: the same stage code in worker processes) are
 * interchangeable under one session and give the same bits.
 *
 * Threads: a session is used by one thread at a time; different sessions
 * may run concurrently from different threads on one model and trunk. Both
 * trunks allow it: in-process their forwards and heads overlap on the
 * model's pool, taking turns job by job (stage.h, model.h "Threads"); on a
 * cluster their steps interleave on the workers (cluster.h).
 */
#ifndef K3_GENERATE_H
#define K3_GENERATE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/base/err.h"
#include "common/engine/model.h"
#include "coordinator/sampler.h"
#include "common/engine/stage.h"

/* ---- trunk: the layer stack ------------------------------------------- */

typedef struct k3_trunk k3_trunk;

typedef struct k3_trunk_ops {
    const char *name; /* "in-process", "cluster", for logs */
    /* Per-session state with room for max_ctx tokens. */
    k3_status (*state_open)(k3_trunk *t, int max_ctx, void **state, char *err, size_t errlen);
    void (*state_close)(k3_trunk *t, void **state);
    /* Back to position 0 (all recurrent state zero). */
    void (*state_reset)(k3_trunk *t, void *state);
    /* Runs every layer on T tokens at [pos0, pos0 + T): blocks [*nb][T][D]
     * in (capacity K3_MAX_RES_ENTRIES), [*nb + k][T][D] out; h [T][D] in/out.
     * trace (may be NULL) sees each layer's output with the global layer
     * index. On error the state must be reset before reuse. */
    k3_status (*forward)(k3_trunk *t, void *state, int pos0, int T, float *blocks, int *nb,
                         float *h, k3_step_stats *stats, k3_trace_fn trace, void *trace_ctx,
                         char *err, size_t errlen);
    /* Cancellation inside a forward (NULL = none; the op may be NULL): once
     * *cancel is nonzero the running forward stops within one layer step
     * (in-process: before its next layer; a cluster: CANCEL to the workers,
     * which stop before their next layer) and fails with K3_ERR_CANCEL; the
     * state must then be reset. Set before a forward, cleared after. */
    void (*set_cancel)(k3_trunk *t, void *state, const atomic_int *cancel);
    /* Bytes of the state held in this process (0 when it lives elsewhere). */
    size_t (*state_bytes)(k3_trunk *t, void *state);
    /* Turn checkpoints at the state's position (stage.h k3_state_ckpt in
     * process; on a cluster the workers hold them, PROTOCOL.md
     * "Checkpoints"); NULL = not supported. keep: checkpoints the session
     * keeps, the oldest dropped first (a cluster's workers drop theirs in
     * step). key: the checkpoint's key (common/engine/ckpt_store.h) when it
     * is parked on disk too, else 0 (a cluster's workers with --ckpt-dir
     * park their part under it). A failed restore leaves the state to be
     * reset. */
    k3_status (*ckpt_save)(k3_trunk *t, void *state, int keep, uint64_t key, void **ck, char *err,
                           size_t errlen);
    k3_status (*ckpt_restore)(k3_trunk *t, void *state, const void *ck, char *err, size_t errlen);
    void (*ckpt_free)(k3_trunk *t, void **ck);
    /* Bytes a checkpoint holds in this process (NULL: 0, they live elsewhere). */
    size_t (*ckpt_bytes)(k3_trunk *t, const void *ck);
    /* The whole state as bytes (stage.h k3_state_dump / k3_state_load:
     * checkpoints parked on disk, coordinator/ckpt_dir.h); state_dump NULL =
     * the state lives elsewhere (a cluster: on the workers, each parking
     * its part under the key). state_load brings back the state parked at
     * pos under key: in process from f, a cluster by RESTORE with the key
     * on every worker (f unused). NULL = not supported. */
    uint64_t (*state_dump_bytes)(k3_trunk *t, void *state, int pos);
    k3_status (*state_dump)(k3_trunk *t, void *state, FILE *f, char *err, size_t errlen);
    k3_status (*state_load)(k3_trunk *t, void *state, FILE *f, int pos, uint64_t key, char *err,
                            size_t errlen);
    void (*close)(k3_trunk *t); /* frees impl, not t */
} k3_trunk_ops;

struct k3_trunk {
    const k3_trunk_ops *ops;
    void *impl; /* owned, freed by ops->close */
};

/* The in-process trunk: k3_stage_forward over [0, n_layers) of m (which must
 * hold every layer). m is borrowed. */
k3_status k3_trunk_open_inproc(k3_trunk **out, k3_model *m, char *err, size_t errlen);
void k3_trunk_close(k3_trunk **t);

/* ---- session ---------------------------------------------------------- */

typedef struct k3_session k3_session;
struct k3_ckpt_dir;

typedef struct k3_session_opts {
    int max_ctx;  /* capacity in tokens, 1..K3_MAX_CTX */
    int chunk;    /* prefill chunk, 1..K3_MAX_CHUNK */
    int progress; /* one stderr line per prefill chunk */
    int ckpt;     /* turn checkpoints kept, 0..K3_MAX_CKPT (0 = none; ignored when the trunk
                     has no checkpoints) */
    struct k3_ckpt_dir *store; /* checkpoints parked on disk too (--ckpt-dir), borrowed; NULL =
                                  none; used only with ckpt > 0 and a trunk that loads a parked
                                  state */
} k3_session_opts;

/* Per-chunk hooks of a feed; every field may be NULL. */
typedef struct k3_feed_hooks {
    /* Teacher forcing: logits [T][vocab] of positions [pos0, pos0 + T) of
     * every fed chunk (k3_model_head with t0 = 0). Costs T head rows. */
    void (*logits)(void *ctx, int pos0, int T, int vocab, const float *logits);
    void *logits_ctx;
    /* Hidden state after every layer (see k3_trace_fn). */
    k3_trace_fn trace;
    void *trace_ctx;
    /* Prefill progress: after every chunk, done of the n tokens this feed
     * prefills (not called when nothing is prefilled). */
    void (*progress)(void *ctx, int done, int n);
    void *progress_ctx;
    /* Cancellation (NULL = none): read before every chunk; once nonzero the
     * feed stops there with K3_ERR_CANCEL and the session keeps the chunks
     * committed so far (a later feed extending them reuses them). Set
     * while a chunk runs, it stops the chunk within one layer step (the
     * trunk's set_cancel); the session then resets (its state is half a
     * chunk further on some layers) and keeps nothing. */
    const atomic_int *cancel;
} k3_feed_hooks;

k3_status k3_session_open(k3_session **out, k3_model *m, k3_trunk *trunk,
                          const k3_session_opts *opts, char *err, size_t errlen);
void k3_session_close(k3_session **s);
void k3_session_reset(k3_session *s);

int k3_session_len(const k3_session *s);            /* committed ids */
const int32_t *k3_session_ids(const k3_session *s); /* [len] */
int k3_session_max_ctx(const k3_session *s);
/* Bytes held for the session in this process: trunk state + chunk buffers. */
size_t k3_session_state_bytes(const k3_session *s);
/* 0 when the stack is truncated (K3_LAYERS < num_hidden_layers): then no
 * head runs and feeding yields no logits (trace only), docs/MODEL.md 8.5. */
int k3_session_has_head(const k3_session *s);

/* Brings the session to exactly ids[0, n): when ids extends the committed
 * ids only the tail is prefilled; otherwise the deepest turn checkpoint
 * whose position is within the common prefix (and before n) is restored
 * and the rest prefilled, else the session resets and prefills everything.
 * With a store (opts.store), a parked checkpoint deeper than what the
 * session would keep is loaded from disk instead. *logits (if not NULL)
 * receives the logits [vocab] of the last position, valid until the next call on the session;
 * *n_fed the number of tokens actually prefilled (also when cancelled part way). Errors: n < 1, n >
 * max_ctx, an id outside the vocabulary, non-finite logits, a trunk failure (the session is then
 * reset), K3_ERR_CANCEL (hooks->cancel: the session keeps the chunks committed before it). */
k3_status k3_session_feed(k3_session *s, const int32_t *ids, int n, const k3_feed_hooks *hooks,
                          const float **logits, int *n_fed, char *err, size_t errlen);

/* Takes a turn checkpoint at the current position (k3_generate does after
 * every prompt when the session keeps checkpoints); the oldest is dropped
 * beyond opts.ckpt. No-op without checkpoints. */
k3_status k3_session_checkpoint(k3_session *s, char *err, size_t errlen);
/* How many leading ids of ids[0, n) k3_session_feed would keep: every
 * committed id when ids extends them, else the deepest checkpoint within
 * the common prefix (and before n), else 0. Reads the session only. */
int k3_session_reusable(const k3_session *s, const int32_t *ids, int n);
/* Checkpoints held and their bytes (0 without). */
int k3_session_n_ckpt(const k3_session *s, size_t *bytes);

/* Appends ids[0, n) to the committed ids (decode: n = 1). */
k3_status k3_session_append(k3_session *s, const int32_t *ids, int n, const k3_feed_hooks *hooks,
                            const float **logits, char *err, size_t errlen);

/* ---- generation ------------------------------------------------------- */

typedef enum k3_stop {
    K3_STOP_NONE = 0, /* ngen = 0: prefill only */
    K3_STOP_NGEN,     /* produced ngen tokens */
    K3_STOP_EOS,      /* sampled an eos id (reported, not fed) */
    K3_STOP_CTX       /* context full: max_ctx tokens committed */
} k3_stop;

typedef struct k3_gen_opts {
    int ngen;            /* tokens to generate, 0..K3_MAX_NGEN */
    k3_sampler *sampler; /* borrowed */
    const int *eos;      /* [n_eos] stop ids (config eos list) */
    int n_eos;
    k3_feed_hooks prompt_hooks; /* hooks for the prompt's prefill only */
    /* Called with each generated id as soon as it is sampled. */
    void (*on_token)(void *ctx, int32_t id);
    void *token_ctx;
    /* Cancellation (NULL = none): read before every prefill chunk and every
     * decode step; once nonzero k3_generate returns K3_ERR_CANCEL there.
     * The session keeps every id committed so far (the prompt chunks fed
     * and the generated tokens fed back), so the next request extending
     * them reuses them. */
    const atomic_int *cancel;
} k3_gen_opts;

typedef struct k3_gen_result {
    int n_prompt;    /* prompt tokens */
    int n_reused;    /* of which kept from the session's committed ids (the prefix) */
    int n_prefilled; /* of which prefilled now (n_prompt - n_reused when the prefill ran to the
                        end; fewer when cancelled; a replay after a worker loss counts again) */
    int n_gen;       /* tokens generated */
    k3_stop stop;
    double prefill_ms;   /* wall time of the prompt's prefill */
    double decode_ms;    /* wall time of the decode steps (sampling included) */
    int n_decode_steps;  /* forward steps in decode_ms (n_gen - 1 or n_gen) */
    k3_step_stats stats; /* summed over prefill and decode */
} k3_gen_result;

/* Feeds prompt[0, n) (prefix reuse as k3_session_feed), then samples up to
 * ngen tokens, feeding each back except the last one and an eos. With
 * opts->cancel set it stops before the next chunk or step with
 * K3_ERR_CANCEL; *res then counts what ran. */
k3_status k3_generate(k3_session *s, const int32_t *prompt, int n, const k3_gen_opts *opts,
                      k3_gen_result *res, char *err, size_t errlen);

/* Statistics summed over every forward step of the session since open. */
void k3_session_stats(const k3_session *s, k3_step_stats *out);

#endif
