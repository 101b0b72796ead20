/* common/text/chat_filter.c: the output side of XTML (chat.h). Generated ids come
 * in one at a time; structural tokens and tags are hidden, text goes to the
 * reasoning or the response channel through streaming UTF-8 decoders, and
 * the tools block is parsed into calls (docs/INTERFACES.md 2.3 and 2.6). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/chat.h"
#include "common/base/limits.h"
#include "common/base/strbuf.h"

/* What the text inside the tools block is being collected for. */
typedef enum capture { CAP_NONE = 0, CAP_ARG, CAP_JSON } capture;

struct k3_chat_filter {
    const k3_tok *tok;
    int32_t open, close, sep, eom;
    int32_t *stop_ids; /* [n_stop], owned */
    int n_stop;

    k3_chat_channel channel;
    int done, finished; /* stop id seen / finish() called */

    int in_tag, tag_close, tag_overflow; /* reading a tag up to <|sep|> */
    k3_strbuf tag;

    int in_tools;
    k3_chat_call cur; /* the call being read (cur.name != NULL) */
    capture cap;
    k3_strbuf capbuf; /* argument value / json text */
    char *arg_key, *arg_type;

    k3_chat_call *calls; /* [n_calls], owned */
    int n_calls;

    k3_tok_stream reason_dec, content_dec;
    k3_strbuf reason_out, content_out; /* this push's deltas */
};

/* ---- calls -------------------------------------------------------------- */

static void call_free(k3_chat_call *c) {
    free(c->name);
    for (int i = 0; i < c->n_args; i++) {
        free(c->args[i].key);
        free(c->args[i].type);
        free(c->args[i].value);
    }
    free(c->args);
    free(c->json);
    free(c->arguments);
    memset(c, 0, sizeof *c);
}

/* &quot; -> " first, then &amp; -> & (the reverse of the renderer). */
static char *unescape_attr(const char *s, size_t n) {
    char *a = k3_xmalloc(n + 1), *b = k3_xmalloc(n + 1);
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (i + 6 <= n && !memcmp(s + i, "&quot;", 6))
            a[o++] = '"', i += 6;
        else
            a[o++] = s[i++];
    }
    size_t m = o;
    o = 0;
    for (size_t i = 0; i < m;) {
        if (i + 5 <= m && !memcmp(a + i, "&amp;", 5))
            b[o++] = '&', i += 5;
        else
            b[o++] = a[i++];
    }
    b[o] = 0;
    free(a);
    return b;
}

/* JSON string literal of s[0..n) (for the OpenAI arguments text). */
static void json_str(k3_strbuf *b, const char *s, size_t n) {
    json_t *v = json_stringn_nocheck(s, n);
    char *t = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    json_decref(v);
    if (t)
        k3_strbuf_add(b, t, strlen(t));
    else
        k3_strbuf_add(b, "\"\"", 2);
    free(t);
}

/* Builds call->arguments: typed arguments re-assembled into an object (a
 * non-string value whose text is not JSON is passed as a string), or the
 * json block's raw text. */
/* The result is always valid JSON: a value the model labelled number /
 * object / ... but wrote as something jansson cannot read becomes a
 * string, so a client's JSON.parse of arguments never fails on our side. */
static void call_arguments(k3_chat_call *c) {
    k3_strbuf b = {0};
    if (c->json && c->n_args == 0) {
        k3_strbuf_add(&b, c->json, strlen(c->json));
    } else {
        k3_strbuf_add(&b, "{", 1);
        for (int i = 0; i < c->n_args; i++) {
            k3_chat_arg *a = &c->args[i];
            if (i) k3_strbuf_add(&b, ",", 1);
            json_str(&b, a->key, strlen(a->key));
            k3_strbuf_add(&b, ":", 1);
            json_t *v = NULL;
            if (strcmp(a->type, "string") != 0)
                v = json_loadb(a->value, a->value_len, JSON_DECODE_ANY, NULL);
            if (v)
                k3_strbuf_add(&b, a->value, a->value_len);
            else
                json_str(&b, a->value, a->value_len);
            json_decref(v);
        }
        k3_strbuf_add(&b, "}", 1);
    }
    c->arguments = b.p;
}

/* ---- tags ---------------------------------------------------------------------- */

/* Value of attribute key in the tag text t (e.g. `call tool="x" index="1"`),
 * unescaped and malloc'd, or NULL. */
static char *tag_attr(const char *t, size_t n, const char *key) {
    size_t kl = strlen(key);
    for (size_t i = 0; i + kl + 3 <= n; i++) {
        if (t[i] != ' ' || memcmp(t + i + 1, key, kl) || t[i + 1 + kl] != '=' ||
            t[i + 2 + kl] != '"')
            continue;
        size_t s = i + 3 + kl, e = s;
        while (e < n && t[e] != '"') e++;
        if (e == n) return NULL; /* unterminated */
        return unescape_attr(t + s, e - s);
    }
    return NULL;
}

static int tag_is(const char *t, size_t n, const char *name) {
    size_t l = strlen(name);
    return n >= l && !memcmp(t, name, l) && (n == l || t[l] == ' ');
}

static void flush_channel(k3_chat_filter *f, k3_chat_channel ch) {
    size_t l;
    const char *p;
    if (ch == K3_CHAT_CH_THINK) {
        p = k3_tok_stream_flush(&f->reason_dec, &l);
        k3_strbuf_add(&f->reason_out, p, l);
    } else {
        p = k3_tok_stream_flush(&f->content_dec, &l);
        k3_strbuf_add(&f->content_out, p, l);
    }
}

/* Acts on one complete tag (the text between <|open|>/<|close|> and
 * <|sep|>). Returns 1 when it completed a tool call. Tool tags only count
 * in their context (a call inside tools, an argument inside a call), so a
 * stray "argument" tag in the response is just hidden. Calls beyond
 * K3_CHAT_MAX_CALLS and arguments beyond K3_CHAT_MAX_ARGS are dropped:
 * the output is model-generated and must never grow without bound. */
static int handle_tag(k3_chat_filter *f) {
    const char *t = f->tag.p ? f->tag.p : "";
    size_t n = f->tag.n;
    int new_calls = 0;
    if (f->tag_overflow) return 0; /* a runaway tag is dropped */
    if (!f->tag_close) {
        if (tag_is(t, n, "think")) {
            flush_channel(f, f->channel);
            f->channel = K3_CHAT_CH_THINK;
        } else if (tag_is(t, n, "response")) {
            flush_channel(f, f->channel);
            f->channel = K3_CHAT_CH_RESPONSE;
        } else if (tag_is(t, n, "tools")) {
            f->in_tools = 1;
        } else if (f->in_tools && tag_is(t, n, "call")) {
            call_free(&f->cur);
            f->cur.name = tag_attr(t, n, "tool");
            char *idx = tag_attr(t, n, "index");
            f->cur.index = idx ? atoi(idx) : 0;
            if (f->cur.index <= 0) f->cur.index = f->n_calls + 1;
            free(idx);
            if (!f->cur.name) f->cur.name = k3_xstrdup("");
        } else if (f->cur.name && (tag_is(t, n, "argument") || tag_is(t, n, "json"))) {
            int is_arg = tag_is(t, n, "argument");
            free(f->arg_key);
            free(f->arg_type);
            f->arg_key = is_arg ? tag_attr(t, n, "key") : NULL;
            f->arg_type = tag_attr(t, n, "type");
            if (is_arg && !f->arg_key) f->arg_key = k3_xstrdup("");
            if (!f->arg_type) f->arg_type = k3_xstrdup(is_arg ? "string" : "object");
            f->cap = is_arg ? CAP_ARG : CAP_JSON;
            f->capbuf.n = 0;
        }
        return 0;
    }
    /* close tags */
    if (f->cap == CAP_ARG && tag_is(t, n, "argument")) {
        if (f->cur.n_args < K3_CHAT_MAX_ARGS) {
            f->cur.args =
                k3_xrealloc(f->cur.args, (size_t)(f->cur.n_args + 1) * sizeof *f->cur.args);
            k3_chat_arg *a = &f->cur.args[f->cur.n_args++];
            a->key = f->arg_key;
            a->type = f->arg_type;
            a->value_len = f->capbuf.n;
            a->value = k3_xmalloc(f->capbuf.n + 1);
            if (f->capbuf.n) memcpy(a->value, f->capbuf.p, f->capbuf.n);
            a->value[f->capbuf.n] = 0;
            f->arg_key = f->arg_type = NULL;
        }
        f->cap = CAP_NONE;
    } else if (f->cap == CAP_JSON && tag_is(t, n, "json")) {
        free(f->cur.json);
        f->cur.json = k3_xmalloc(f->capbuf.n + 1);
        if (f->capbuf.n) memcpy(f->cur.json, f->capbuf.p, f->capbuf.n);
        f->cur.json[f->capbuf.n] = 0;
        f->cap = CAP_NONE;
    } else if (f->cur.name && tag_is(t, n, "call")) {
        f->cap = CAP_NONE;
        if (f->n_calls < K3_CHAT_MAX_CALLS) {
            call_arguments(&f->cur);
            f->calls = k3_xrealloc(f->calls, (size_t)(f->n_calls + 1) * sizeof *f->calls);
            f->calls[f->n_calls++] = f->cur;
            memset(&f->cur, 0, sizeof f->cur);
            new_calls = 1;
        } else {
            call_free(&f->cur);
        }
    } else if (tag_is(t, n, "tools")) {
        f->in_tools = 0;
        f->cap = CAP_NONE;
        call_free(&f->cur); /* a call left open inside is incomplete */
    }
    return new_calls;
}

/* ---- the filter ---------------------------------------------------------------- */

k3_status k3_chat_filter_open(k3_chat_filter **out, const k3_tok *tok,
                              const k3_chat_filter_opts *opts, char *err, size_t errlen) {
    *out = NULL;
    k3_chat_filter *f = k3_xcalloc(1, sizeof *f);
    f->tok = tok;
    f->open = k3_tok_special_id(tok, "<|open|>");
    f->close = k3_tok_special_id(tok, "<|close|>");
    f->sep = k3_tok_special_id(tok, "<|sep|>");
    f->eom = k3_tok_special_id(tok, "<|end_of_msg|>");
    if (f->open < 0 || f->close < 0 || f->sep < 0 || f->eom < 0) {
        free(f);
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "tokenizer has no XTML chat tokens (<|open|> <|close|> <|sep|> "
                       "<|end_of_msg|>)");
    }
    if (opts) {
        f->channel = opts->start;
        if (opts->n_stop_ids < 0 || opts->n_stop_ids > K3_MAX_EOS) {
            free(f);
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "chat filter: %d stop ids (limit K3_MAX_EOS %d)", opts->n_stop_ids,
                           K3_MAX_EOS);
        }
        f->n_stop = opts->n_stop_ids;
        f->stop_ids = k3_xmalloc((size_t)(f->n_stop ? f->n_stop : 1) * sizeof *f->stop_ids);
        if (f->n_stop) memcpy(f->stop_ids, opts->stop_ids, (size_t)f->n_stop * sizeof *f->stop_ids);
    }
    *out = f;
    return K3_OK;
}

void k3_chat_filter_close(k3_chat_filter **fp) {
    if (!fp || !*fp) return;
    k3_chat_filter *f = *fp;
    free(f->stop_ids);
    free(f->tag.p);
    call_free(&f->cur);
    free(f->capbuf.p);
    free(f->arg_key);
    free(f->arg_type);
    for (int i = 0; i < f->n_calls; i++) call_free(&f->calls[i]);
    free(f->calls);
    k3_tok_stream_reset(&f->reason_dec);
    k3_tok_stream_reset(&f->content_dec);
    free(f->reason_out.p);
    free(f->content_out.p);
    free(f);
    *fp = NULL;
}

static void delta_begin(k3_chat_filter *f, k3_chat_delta *d) {
    memset(d, 0, sizeof *d);
    f->reason_out.n = f->content_out.n = 0;
    k3_strbuf_add(&f->reason_out, "", 0);
    k3_strbuf_add(&f->content_out, "", 0);
}

static void delta_end(k3_chat_filter *f, k3_chat_delta *d) {
    d->reasoning = f->reason_out.p;
    d->reasoning_len = f->reason_out.n;
    d->content = f->content_out.p;
    d->content_len = f->content_out.n;
    d->done = f->done;
}

static int is_stop(const k3_chat_filter *f, int32_t id) {
    if (id == f->eom) return 1;
    for (int i = 0; i < f->n_stop; i++)
        if (f->stop_ids[i] == id) return 1;
    return 0;
}

/* Ends the stream: text held back comes out, unfinished tags/calls go. */
static void end_stream(k3_chat_filter *f) {
    flush_channel(f, K3_CHAT_CH_THINK);
    flush_channel(f, K3_CHAT_CH_RESPONSE);
    call_free(&f->cur);
    f->in_tag = f->in_tools = 0;
    f->cap = CAP_NONE;
}

/* State machine over one id. Invariants: text reaches a channel only
 * outside tags and outside the tools block, and always through that
 * channel's streaming decoder, so every delta is valid UTF-8; after a stop
 * id (done) or finish() nothing changes any more. */
void k3_chat_filter_push(k3_chat_filter *f, int32_t id, k3_chat_delta *d) {
    delta_begin(f, d);
    if (f->done || f->finished) {
        delta_end(f, d);
        return;
    }
    if (is_stop(f, id)) {
        f->done = 1;
        end_stream(f);
    } else if (id == f->open || id == f->close) {
        f->in_tag = 1; /* an unfinished earlier tag is dropped */
        f->tag_close = id == f->close;
        f->tag_overflow = 0;
        f->tag.n = 0;
    } else if (id == f->sep) {
        if (f->in_tag) d->n_new_calls = handle_tag(f);
        f->in_tag = 0;
    } else if (k3_tok_is_added(f->tok, id)) {
        /* other control tokens are never shown */
    } else {
        size_t n;
        const uint8_t *b = k3_tok_token_bytes(f->tok, id, &n);
        if (!b) {
            /* unknown id: nothing to show */
        } else if (f->in_tag) {
            if (f->tag.n + n > K3_CHAT_MAX_TAG_BYTES)
                f->tag_overflow = 1;
            else
                k3_strbuf_add(&f->tag, (const char *)b, n);
        } else if (f->in_tools) {
            if (f->cap != CAP_NONE) k3_strbuf_add(&f->capbuf, (const char *)b, n);
        } else {
            size_t l;
            const char *p;
            if (f->channel == K3_CHAT_CH_THINK) {
                p = k3_tok_stream_bytes(&f->reason_dec, b, n, &l);
                k3_strbuf_add(&f->reason_out, p, l);
            } else {
                p = k3_tok_stream_bytes(&f->content_dec, b, n, &l);
                k3_strbuf_add(&f->content_out, p, l);
            }
        }
    }
    delta_end(f, d);
}

void k3_chat_filter_finish(k3_chat_filter *f, k3_chat_delta *d) {
    delta_begin(f, d);
    if (!f->done && !f->finished) {
        f->finished = 1;
        end_stream(f);
    }
    delta_end(f, d);
}

int k3_chat_filter_n_calls(const k3_chat_filter *f) { return f->n_calls; }

const k3_chat_call *k3_chat_filter_call(const k3_chat_filter *f, int i) {
    return i >= 0 && i < f->n_calls ? &f->calls[i] : NULL;
}

const char *k3_chat_filter_finish_reason(const k3_chat_filter *f) {
    if (f->done) return f->n_calls ? "tool_calls" : "stop";
    if (f->finished) return f->n_calls ? "tool_calls" : "length";
    return NULL;
}

k3_chat_channel k3_chat_filter_channel(const k3_chat_filter *f) { return f->channel; }
