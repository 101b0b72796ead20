/* coordinator/serve_job.c: one API generation (serve_api.h's serve_job).
 *
 * serve_job_start renders the prompt on the caller's thread (so a prompt
 * that does not fit is a clean 400 before any SSE header goes out), then
 * a detached thread runs k3_engine_generate. Each generated id goes
 * through the output side:
 *   chat:        k3_chat_filter (hidden markers, reasoning vs content,
 *                tool calls, the stop token)
 *   completions: the streaming UTF-8 decoder; eos ids are not text
 * then content passes the stop-string matcher (coordinator/serve_stop.h),
 * which holds back any tail that could still become a stop string and cuts
 * the text before the first match (the stop string itself is never sent). What comes out is
 * appended under the job's lock either as SSE events (stream) or to the answer's buffers
 * (non-stream), and the reader is woken.
 *
 * The answer is complete ("finished") once the engine has returned: at a
 * stop string the job sets its own cancellation flag (k3_engine_req.cancel),
 * so the engine stops before its next step, and the last events (final
 * delta, usage with the reused prompt tokens) follow. serve_job_cancel sets
 * the same flag when the client went away: the engine stops within one
 * step, the session keeps what was committed and done() frees the slot.
 */
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/base/log.h"
#include "common/base/strbuf.h"
#include "coordinator/serve_api.h"
#include "coordinator/serve_stop.h"

struct serve_job {
    pthread_mutex_t mu; /* guards everything below marked (mu) */
    pthread_cond_t cv;  /* signalled on new output and at the end */
    int refs;           /* (mu) the generation thread + the caller */

    /* set at start, read only afterwards */
    k3_engine *eng;    /* borrowed */
    const k3_tok *tok; /* borrowed (the engine's) */
    int chat, stream, include_usage;
    char id[48];       /* chatcmpl-<hex> / cmpl-<hex> */
    long long created; /* seconds */
    char *model;       /* model id, owned */
    int32_t *prompt;   /* [n_prompt], owned */
    int n_prompt;
    int max_tokens; /* clamped to the room left */
    int max_ctx;    /* session capacity */
    k3_sampler_opts sampling;
    uint64_t session;
    const int *eos; /* [n_eos] the config's stop ids (completions) */
    int n_eos;
    void (*done)(void *ctx, const serve_job_stats *st);
    void *done_ctx;
    atomic_int cancel; /* set by a stop string or serve_job_cancel: the engine stops */

    /* generation thread only */
    k3_chat_filter *filter; /* chat, owned */
    k3_tok_stream ts;       /* completions decoder */
    serve_stop stop;        /* the request's stop strings over the content */
    int n_seen;             /* ids generated so far */
    int stopped;            /* a stop string or stop token ended the answer */
    int n_reused;           /* prompt tokens kept from the session (usage cached_tokens) */
    int n_prefilled;        /* prompt tokens prefilled by this request */

    /* (mu) output */
    k3_strbuf sse; /* stream: events not yet read from sse_off */
    size_t sse_off;
    k3_strbuf content;          /* non-stream: the answer */
    k3_strbuf reasoning;        /* non-stream: the think channel */
    json_t *calls;              /* tool calls (OpenAI shape), owned array */
    const char *finish;         /* "stop" "length" "tool_calls" once finished */
    int n_completion;           /* completion tokens at the finish */
    int finished;               /* the answer is complete */
    int aborted;                /* serve_job_abort: readers give up */
    k3_status st;               /* the engine's failure, K3_OK otherwise */
    double t_start_ms, ttft_ms; /* start; time to the first token (0 = none yet) */
    char err[512];
};

static void job_free(serve_job *j) {
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->model);
    free(j->prompt);
    k3_chat_filter_close(&j->filter);
    k3_tok_stream_reset(&j->ts);
    serve_stop_free(&j->stop);
    free(j->sse.p);
    free(j->content.p);
    free(j->reasoning.p);
    json_decref(j->calls);
    free(j);
}

const char *serve_job_id(const serve_job *j) { return j->id; }

void serve_job_unref(serve_job **jp) {
    serve_job *j = *jp;
    if (!j) return;
    *jp = NULL;
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

/* ---- output ---------------------------------------------------------------- */

/* The envelope fields every chunk of a stream shares, plus choices. */
static json_t *chunk_head(serve_job *j, json_t *choices) {
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", j->id, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created",
                          (json_int_t)j->created, "model", j->model, "choices", choices);
    if (j->include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

/* Appends "data: <json>\n\n" (takes the reference of o). Under mu. */
static void sse_event(serve_job *j, json_t *o) {
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return; /* only invalid UTF-8 can fail, and our text is valid */
    k3_strbuf_str(&j->sse, "data: ");
    k3_strbuf_str(&j->sse, s);
    k3_strbuf_str(&j->sse, "\n\n");
    free(s);
}

/* A chat chunk with one delta, or a completions chunk with text. Under mu. */
static void sse_delta(serve_job *j, json_t *delta, const char *text, size_t len,
                      const char *finish) {
    json_t *fin = finish ? json_string(finish) : json_null();
    json_t *c;
    if (j->chat)
        c = json_pack("{s:i,s:o,s:n,s:o}", "index", 0, "delta", delta, "logprobs", "finish_reason",
                      fin);
    else {
        json_decref(delta); /* completions chunks have no delta (NULL is fine) */
        c = json_pack("{s:s%,s:i,s:n,s:o}", "text", text ? text : "", len, "index", 0, "logprobs",
                      "finish_reason", fin);
    }
    sse_event(j, chunk_head(j, json_pack("[o]", c)));
}

/* Visible text (already past the stop matcher) or reasoning. */
static void emit_text(serve_job *j, int reasoning, const char *s, size_t n) {
    if (n == 0) return;
    pthread_mutex_lock(&j->mu);
    if (!j->stream) {
        k3_strbuf_add(reasoning ? &j->reasoning : &j->content, s, n);
    } else if (j->chat) {
        sse_delta(j, json_pack("{s:s%}", reasoning ? "reasoning_content" : "content", s, n), NULL,
                  0, NULL);
    } else {
        sse_delta(j, NULL, s, n, NULL);
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* call_<24 hex>, the id shape clients expect. */
static void call_id(char *out, size_t n) {
    unsigned char b[12];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
        uint64_t t = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)out;
        memcpy(b, &t, 8);
        memset(b + 8, 0, 4);
    }
    int w = snprintf(out, n, "call_");
    for (int i = 0; i < 12 && w + 2 < (int)n; i++)
        w += snprintf(out + w, n - (size_t)w, "%02x", b[i]);
}

/* The calls the filter completed with the last id: one delta each. */
static void emit_calls(serve_job *j, int n_new) {
    int n = k3_chat_filter_n_calls(j->filter);
    pthread_mutex_lock(&j->mu);
    if (!j->calls) j->calls = json_array();
    for (int i = n - n_new; i < n; i++) {
        const k3_chat_call *c = k3_chat_filter_call(j->filter, i);
        char id[40];
        call_id(id, sizeof id);
        json_t *f = json_pack("{s:s,s:s}", "name", c->name, "arguments",
                              c->arguments ? c->arguments : "{}");
        if (!f) continue; /* a name that is not UTF-8: dropped */
        json_t *tc = json_pack("{s:s,s:s,s:o}", "id", id, "type", "function", "function", f);
        if (j->stream) {
            json_t *d = json_pack("{s:[O]}", "tool_calls", tc);
            json_object_set_new(json_array_get(json_object_get(d, "tool_calls"), 0), "index",
                                json_integer((json_int_t)json_array_size(j->calls)));
            sse_delta(j, d, NULL, 0, NULL);
        }
        json_array_append_new(j->calls, tc);
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* The usage object: prompt, completion, total, and the prompt tokens reused
 * from the session as prompt_tokens_details.cached_tokens. */
static json_t *usage_json(const serve_job *j) {
    return json_pack("{s:i,s:i,s:i,s:{s:i}}", "prompt_tokens", j->n_prompt, "completion_tokens",
                     j->n_completion, "total_tokens", j->n_prompt + j->n_completion,
                     "prompt_tokens_details", "cached_tokens", j->n_reused);
}

/* The last events of a stream (final delta, usage, [DONE]) or nothing
 * (non-stream); marks the answer finished. */
static void finish(serve_job *j, const char *reason) {
    pthread_mutex_lock(&j->mu);
    if (!j->finished) {
        if (j->calls && !strcmp(reason, "stop")) reason = "tool_calls";
        j->finish = reason;
        j->n_completion = j->n_seen;
        if (j->stream) {
            if (j->st) {
                serve_err e;
                serve_fail(&e, 500, "server_error", "", "engine_error", "%s", j->err);
                char *s = serve_err_json(&e);
                k3_strbuf_str(&j->sse, "data: ");
                k3_strbuf_str(&j->sse, s);
                k3_strbuf_str(&j->sse, "\n\n");
                free(s);
            } else {
                sse_delta(j, json_object(), NULL, 0, reason);
            }
            if (j->include_usage) {
                json_t *o = chunk_head(j, json_array());
                json_object_set_new(o, "usage", usage_json(j));
                sse_event(j, o);
            }
            k3_strbuf_str(&j->sse, "data: [DONE]\n\n");
        }
        j->finished = 1;
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
}

/* ---- stop strings -------------------------------------------------------- */

/* The answer ended here (a stop string or the stop token): the engine is
 * asked to stop before its next step; job_thread finishes the answer once
 * it has returned. */
static void stop_here(serve_job *j) {
    j->stopped = 1;
    atomic_store(&j->cancel, 1);
}

/* Content through the stop matcher (coordinator/serve_stop.h); a match
 * ends the answer. */
static void content_add(serve_job *j, const char *s, size_t n, int flush) {
    if (j->stopped) return;
    const char *out;
    size_t out_len;
    int hit = serve_stop_push(&j->stop, s, n, flush, &out, &out_len);
    emit_text(j, 0, out, out_len);
    if (hit) stop_here(j);
}

/* ---- the generation thread ---------------------------------------------- */

static void on_token(void *ctx, int32_t id) {
    serve_job *j = ctx;
    if (j->stopped) return;
    if (!j->n_seen++) j->ttft_ms = k3_now_ms() - j->t_start_ms;
    if (j->chat) {
        k3_chat_delta d;
        k3_chat_filter_push(j->filter, id, &d);
        emit_text(j, 1, d.reasoning, d.reasoning_len);
        content_add(j, d.content, d.content_len, 0);
        if (d.n_new_calls) emit_calls(j, d.n_new_calls);
        if (d.done && !j->stopped) {
            content_add(j, "", 0, 1);
            stop_here(j);
        }
        return;
    }
    for (int i = 0; i < j->n_eos; i++)
        if (j->eos[i] == id) {
            size_t n = 0;
            const char *t = k3_tok_stream_flush(&j->ts, &n);
            content_add(j, t, n, 1);
            if (!j->stopped) stop_here(j);
            return;
        }
    size_t n = 0;
    const char *t = k3_tok_stream_push(j->tok, &j->ts, id, &n);
    content_add(j, t, n, 0);
}

static void *job_thread(void *arg) {
    serve_job *j = arg;
    k3_engine_req req = {.session_id = j->session,
                         .prompt = j->prompt,
                         .n_prompt = j->n_prompt,
                         .ngen = j->max_tokens,
                         .max_ctx = j->max_ctx,
                         .sampling = j->sampling,
                         .on_token = on_token,
                         .token_ctx = j,
                         .cancel = &j->cancel};
    k3_engine_result res;
    char err[512] = "";
    k3_status st = k3_engine_generate(j->eng, &req, &res, err, sizeof err);
    j->n_reused = res.gen.n_reused;
    j->n_prefilled = res.gen.n_prefilled;
    int gone = st == K3_ERR_CANCEL && !j->stopped; /* serve_job_cancel: the client left */
    if (st == K3_ERR_CANCEL) st = K3_OK;
    if (st) K3_WARN("serve: %s: %s", j->id, err);
    K3_INFO("serve: %s: prompt %d tokens (%d reused, %d prefilled in %.1f ms), %d generated in "
            "%.1f ms%s",
            j->id, j->n_prompt, res.gen.n_reused, res.gen.n_prefilled, res.gen.prefill_ms,
            j->n_seen, res.gen.decode_ms, gone ? ", cancelled: the client went away" : "");
    serve_job_stats js = {.n_prompt = j->n_prompt,
                          .n_reused = res.gen.n_reused,
                          .n_prefilled = res.gen.n_prefilled,
                          .n_gen = j->n_seen,
                          .prefill_ms = res.gen.prefill_ms,
                          .decode_ms = res.gen.decode_ms,
                          .n_decode_steps = res.gen.n_decode_steps,
                          .ttft_ms = j->ttft_ms,
                          .cancelled = gone,
                          .failed = st != K3_OK,
                          .step = res.gen.stats};
    if (j->stopped) {
        finish(j, "stop");
    } else { /* the stop rule ended it: flush what is held back */
        size_t n = 0;
        if (j->chat) {
            k3_chat_delta d;
            k3_chat_filter_finish(j->filter, &d);
            emit_text(j, 1, d.reasoning, d.reasoning_len);
            content_add(j, d.content, d.content_len, 1);
        } else {
            const char *t = k3_tok_stream_flush(&j->ts, &n);
            content_add(j, t, n, 1);
        }
        pthread_mutex_lock(&j->mu);
        j->st = st;
        snprintf(j->err, sizeof j->err, "%s", err);
        pthread_mutex_unlock(&j->mu);
        finish(j, res.gen.stop == K3_STOP_EOS ? "stop" : "length");
    }
    k3_chat_filter_close(&j->filter); /* nothing of the engine is touched after done() */
    j->done(j->done_ctx, &js);
    serve_job_unref(&j);
    return NULL;
}

/* ---- start, read, wait ------------------------------------------------------ */

/* The prompt ids: the chat rendering (BOS + XTML) or BOS + the raw text. */
static int build_prompt(serve_job *j, const serve_req *r, serve_err *e) {
    char err[512] = "";
    const k3_tok *tok = j->tok;
    if (!tok)
        return serve_fail(e, 400, "invalid_request_error", "", "no_tokenizer",
                          "the model has no tokenizer (tiktoken.model): text requests need one");
    if (!r->chat) {
        k3_status st = k3_engine_encode(j->eng, r->prompt, r->prompt_len, 0, &j->prompt,
                                        &j->n_prompt, err, sizeof err);
        if (st == K3_ERR_LIMIT)
            return serve_fail(e, 400, "invalid_request_error", "prompt", "context_length_exceeded",
                              "prompt: %s", err);
        if (st) return serve_fail(e, 400, "invalid_request_error", "prompt", "", "prompt: %s", err);
        return 1;
    }
    k3_chat_req cr = {.msgs = r->msgs,
                      .n_msgs = r->n_msgs,
                      .tools_json = r->tools_json,
                      .tool_choice = r->tool_choice,
                      .tool_choice_name = r->tool_choice_name,
                      .enable_thinking = r->enable_thinking,
                      .add_generation_prompt = 1};
    k3_chat_out out;
    memset(&out, 0, sizeof out);
    k3_status st = k3_chat_render(tok, &cr, &out, err, sizeof err);
    if (st) {
        k3_chat_out_free(&out);
        return serve_fail(e, 400, "invalid_request_error", "messages", "", "messages: %s", err);
    }
    if (out.ids.n > (size_t)K3_MAX_CTX) {
        k3_chat_out_free(&out);
        return serve_fail(e, 400, "invalid_request_error", "messages", "context_length_exceeded",
                          "the rendered chat has %zu tokens, more than %d (K3_MAX_CTX)", out.ids.n,
                          K3_MAX_CTX);
    }
    j->n_prompt = (int)out.ids.n;
    j->prompt = k3_xmalloc(out.ids.n * sizeof *j->prompt);
    memcpy(j->prompt, out.ids.v, out.ids.n * sizeof *j->prompt);
    const k3_config *cfg = k3_engine_config(j->eng);
    k3_chat_filter_opts fo = {.start = out.channel, .stop_ids = cfg->eos, .n_stop_ids = cfg->n_eos};
    k3_chat_out_free(&out);
    if ((st = k3_chat_filter_open(&j->filter, tok, &fo, err, sizeof err)))
        return serve_fail(e, 400, "invalid_request_error", "", "no_chat_tokens", "%s", err);
    return 1;
}

int serve_job_start(serve_job **out, k3_engine *eng, const serve_req *r, const serve_limits *lim,
                    int (*admit)(void *ctx, const int32_t *prompt, int n),
                    void (*done)(void *ctx, const serve_job_stats *st), void *done_ctx,
                    serve_err *e) {
    *out = NULL;
    serve_job *j = k3_xcalloc(1, sizeof *j);
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->eng = eng;
    j->tok = k3_engine_tok(eng);
    j->chat = r->chat;
    j->stream = r->stream;
    j->include_usage = r->stream && r->include_usage;
    j->created = serve_now_s();
    j->model = k3_xstrdup(lim->model_id);
    j->sampling = r->sampling;
    j->max_ctx = lim->ctx;
    j->t_start_ms = k3_now_ms();
    const k3_config *cfg = k3_engine_config(eng);
    j->eos = cfg->eos;
    j->n_eos = cfg->n_eos;
    serve_stop_init(&j->stop, r->stops, r->n_stops);
    unsigned char b[12] = {0};
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) memcpy(b, &j, sizeof j);
    int w = snprintf(j->id, sizeof j->id, "%s", r->chat ? "chatcmpl-" : "cmpl-");
    for (int i = 0; i < 12; i++) w += snprintf(j->id + w, sizeof j->id - (size_t)w, "%02x", b[i]);

    if (!build_prompt(j, r, e)) goto fail;
    /* the prompt must leave room for one token; max_tokens is clamped to
     * the room left (docs/SERVING.md) */
    if (j->n_prompt >= lim->ctx) {
        serve_fail(e, 400, "invalid_request_error", r->chat ? "messages" : "prompt",
                   "context_length_exceeded",
                   "the prompt has %d tokens and the context %d: no room for a completion "
                   "(--ctx)",
                   j->n_prompt, lim->ctx);
        goto fail;
    }
    int want = r->max_tokens > 0 ? r->max_tokens : lim->max_tokens;
    j->max_tokens = want < lim->ctx - j->n_prompt ? want : lim->ctx - j->n_prompt;
    if (j->stream) {
        if (j->chat)
            sse_delta(j, json_pack("{s:s,s:s}", "role", "assistant", "content", ""), NULL, 0, NULL);
    }
    int sid = admit(done_ctx, j->prompt, j->n_prompt);
    if (sid < 0) {
        serve_fail(e, 429, "rate_limit_error", "", "queue_full",
                   "every generation slot is taken (--max-queue): retry later");
        goto fail;
    }
    j->session = (uint64_t)sid;
    j->done = done;
    j->done_ctx = done_ctx;
    j->refs = 2; /* the caller and the thread */
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &attr, job_thread, j);
    pthread_attr_destroy(&attr);
    if (rc) {
        serve_fail(e, 503, "server_error", "", "", "cannot start a generation thread: %s",
                   strerror(rc));
        goto fail;
    }
    *out = j;
    return 1;
fail:
    j->refs = 1;
    serve_job_unref(&j);
    return 0;
}

long serve_job_read(serve_job *j, char *buf, size_t max, int wait_ms) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += wait_ms / 1000;
    dl.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&j->mu);
    while (j->sse.n == j->sse_off && !j->finished && !j->aborted)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &dl)) break;
    long got = -1;
    size_t avail = j->sse.n - j->sse_off;
    if (avail > 0 && !j->aborted) {
        size_t n = avail < max ? avail : max;
        memcpy(buf, j->sse.p + j->sse_off, n);
        j->sse_off += n;
        if (j->sse_off == j->sse.n) j->sse_off = j->sse.n = 0; /* all read: reuse the buffer */
        got = (long)n;
    } else if (!j->finished && !j->aborted) {
        got = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return got;
}

void serve_job_cancel(serve_job *j) {
    if (j) atomic_store(&j->cancel, 1);
}

void serve_job_abort(serve_job *j) {
    atomic_store(&j->cancel, 1);
    pthread_mutex_lock(&j->mu);
    j->aborted = 1;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

char *serve_job_wait(serve_job *j, int (*gone)(void *ctx), void *gone_ctx, serve_err *e) {
    pthread_mutex_lock(&j->mu);
    double next_look = k3_now_ms() + 250; /* how often the client is looked at */
    while (!j->finished && !j->aborted) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_nsec += 250 * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&j->cv, &j->mu, &dl); /* woken by every token, too */
        if (gone && k3_now_ms() >= next_look) {
            next_look = k3_now_ms() + 250;
            if (gone(gone_ctx)) {
                atomic_store(&j->cancel, 1);
                j->aborted = 1;
            }
        }
    }
    char *s = NULL;
    if (!j->finished) {
        serve_fail(e, 503, "server_error", "", "", "the server is shutting down");
    } else if (j->st) {
        serve_fail(e, 500, "server_error", "", "engine_error", "%s", j->err);
    } else {
        json_t *choice;
        const char *content = j->content.p ? j->content.p : "";
        if (j->chat) {
            json_t *msg = json_pack("{s:s,s:s%,s:n}", "role", "assistant", "content", content,
                                    j->content.n, "refusal");
            if (j->reasoning.n)
                json_object_set_new(msg, "reasoning_content",
                                    json_stringn(j->reasoning.p, j->reasoning.n));
            if (j->calls) json_object_set(msg, "tool_calls", j->calls);
            choice = json_pack("{s:i,s:o,s:n,s:s}", "index", 0, "message", msg, "logprobs",
                               "finish_reason", j->finish);
        } else {
            choice = json_pack("{s:s%,s:i,s:n,s:s}", "text", content, j->content.n, "index", 0,
                               "logprobs", "finish_reason", j->finish);
        }
        json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o}", "id", j->id, "object",
                              j->chat ? "chat.completion" : "text_completion", "created",
                              (json_int_t)j->created, "model", j->model, "choices", choice, "usage",
                              usage_json(j));
        s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        if (!s) serve_fail(e, 500, "server_error", "", "", "cannot encode the response");
    }
    pthread_mutex_unlock(&j->mu);
    return s;
}
