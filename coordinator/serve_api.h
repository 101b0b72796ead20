/* coordinator/serve_api.h: the OpenAI-compatible API of `k3-coordinator
 * serve` (docs/SERVING.md), below the HTTP layer of coordinator/serve.c.
 *
 * Owns: turning a request body into a checked serve_req (coordinator/
 * serve_req.c: JSON types, ranges, unsupported fields, each refusal naming
 * the field), the OpenAI error envelope, and a serve_job (coordinator/
 * serve_job.c): one generation on the engine in a thread of its own, its
 * output filtered (chat: common/text/chat.h's filter; completions: plain
 * decoding), cut at stop strings and turned into either SSE events or one
 * JSON response.
 * Borrows: the engine and its tokenizer (they outlive every job); the
 * request body only during parsing.
 * Threads: parsing is reentrant. A job is shared by its generation thread
 * and the HTTP connection thread that reads it, under the job's own lock;
 * it is freed when both have let go (reference count). A client that
 * disconnects is seen by the HTTP layer, which calls serve_job_cancel: the
 * engine stops before its next step (k3_engine_req.cancel).
 *
 * Not handled: n > 1, logprobs, response_format, penalties, logit_bias
 * (refused with 400 naming the field); images and audio parts (400).
 */
#ifndef K3_SERVE_API_H
#define K3_SERVE_API_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/limits.h"
#include "common/text/chat.h"
#include "coordinator/engine.h"

/* An API error: HTTP status and the four fields of the OpenAI envelope
 * {"error":{"message","type","param","code"}}; param and code may be "". */
typedef struct serve_err {
    int http; /* 400, 401, 404, ... */
    char message[512];
    char type[48];  /* invalid_request_error, authentication_error, ... */
    char param[64]; /* the field at fault, "" = null */
    char code[48];  /* context_length_exceeded, ..., "" = null */
} serve_err;

/* Fills e and returns 0 (so parsers can `return serve_fail(...)`). */
int serve_fail(serve_err *e, int http, const char *type, const char *param, const char *code,
               const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* The envelope of e as compact JSON, malloc'd (caller frees). */
char *serve_err_json(const serve_err *e);

/* The server settings a request is checked against. */
typedef struct serve_limits {
    int ctx;              /* context of every session, tokens */
    int max_tokens;       /* default max_tokens when the request has none */
    const char *model_id; /* the id /v1/models lists */
} serve_limits;

/* One parsed request. Strings point into json (owned), which the request
 * holds until serve_req_free. */
typedef struct serve_req {
    int chat;          /* 1: /v1/chat/completions, 0: /v1/completions */
    int stream;        /* SSE */
    int include_usage; /* stream_options.include_usage */
    int max_tokens;    /* requested, before clamping to the room left; 0 = default */
    k3_sampler_opts sampling;
    const char *stops[K3_SERVE_MAX_STOPS]; /* [n_stops] non-empty strings */
    int n_stops;
    /* chat */
    k3_chat_msg *msgs; /* [n_msgs], owned array; strings borrowed from json */
    int n_msgs;
    k3_chat_tool_call *calls; /* every message's tool_calls, owned array */
    int n_calls;
    char **texts; /* joined text-part contents, owned */
    int n_texts;
    char *tools_json; /* the tools array as JSON text, owned, or NULL */
    k3_chat_tool_choice tool_choice;
    const char *tool_choice_name;
    int enable_thinking;
    /* completions */
    const char *prompt; /* raw text, BOS prepended, no template */
    size_t prompt_len;
    void *json; /* json_t *, owned */
} serve_req;

/* Parses body[0, len) for the chat (chat = 1) or completions endpoint.
 * Returns 0 with e filled on any refusal (400), 1 on success. */
int serve_req_parse(serve_req *r, int chat, const char *body, size_t len, serve_err *e);
void serve_req_free(serve_req *r);

/* ---- jobs ------------------------------------------------------------- */

typedef struct serve_job serve_job;

/* What one generation did, handed to the done callback (the server's
 * metrics and its running count). */
typedef struct serve_job_stats {
    int n_prompt, n_reused, n_prefilled; /* prompt tokens: all, kept from the session, prefilled */
    int n_gen;                           /* tokens generated */
    double prefill_ms, decode_ms;        /* wall time of the prefill and of the decode steps */
    int n_decode_steps;                  /* forward steps in decode_ms */
    double ttft_ms;                      /* start to the first token, 0 = none */
    int cancelled;                       /* the client went away (serve_job_cancel) */
    int failed;                          /* the engine failed */
    k3_step_stats step;                  /* expert bytes read, hits, compute time */
} serve_job_stats;

/* Renders / encodes r, checks the prompt against lim->ctx (400
 * context_length_exceeded when not even one token fits), clamps
 * max_tokens to the room left, asks admit(done_ctx, prompt, n) for a
 * session id (-1: the queue is full, 429) and starts the generation thread
 * on it. On success *out holds one reference for the caller; the job calls
 * done(done_ctx, stats) from its thread when the engine has returned (the
 * server's running count and metrics). Returns 0 with e filled on failure
 * (no thread started, done not called; when admit had given an id the
 * caller still holds it). */
int serve_job_start(serve_job **out, k3_engine *eng, const serve_req *r, const serve_limits *lim,
                    int (*admit)(void *ctx, const int32_t *prompt, int n),
                    void (*done)(void *ctx, const serve_job_stats *st), void *done_ctx,
                    serve_err *e);
/* The response id ("chatcmpl-<24 hex>", "cmpl-<24 hex>"), also sent as
 * the x-request-id header; valid for the job's life. */
const char *serve_job_id(const serve_job *j);
/* Drops the caller's reference (NULL is fine). */
void serve_job_unref(serve_job **j);

/* Stream mode: copies up to max bytes of pending SSE text into buf,
 * waiting up to wait_ms for some. Returns the bytes copied, 0 when none
 * came in time, -1 when the stream is over (everything was read). */
long serve_job_read(serve_job *j, char *buf, size_t max, int wait_ms);
/* Non-stream mode: waits until the answer is complete, then returns the
 * response JSON (malloc'd), or NULL with e filled when the engine failed.
 * gone (may be NULL) is asked every 250 ms whether the client left; when
 * it says so the job is cancelled and NULL returned. */
char *serve_job_wait(serve_job *j, int (*gone)(void *ctx), void *gone_ctx, serve_err *e);
/* The client went away: the engine stops before its next step (any thread;
 * NULL is fine). */
void serve_job_cancel(serve_job *j);
/* Cancels and makes every waiting read return (shutdown): the stream ends. */
void serve_job_abort(serve_job *j);

/* Seconds since the epoch, the "created" of every object. */
long long serve_now_s(void);

#endif
