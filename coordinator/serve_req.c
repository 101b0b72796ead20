/* coordinator/serve_req.c: request bodies of the OpenAI API into serve_req
 * (coordinator/serve_api.h), and the error envelope.
 *
 * Every refusal is a 400 invalid_request_error whose param names the field
 * ("messages[2].content", "temperature") and whose message says the value
 * and what was expected. A JSON null counts as an absent field (the
 * official clients send nulls for unset options). Fields the engine cannot
 * honour are refused rather than ignored, so a client never gets an answer
 * computed differently than it asked for: n != 1, logprobs, top_logprobs,
 * response_format other than text, non-zero penalties, logit_bias.
 * Unknown fields are ignored (user, metadata, store, ...).
 */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/base/err.h"
#include "coordinator/serve_api.h"

int serve_fail(serve_err *e, int http, const char *type, const char *param, const char *code,
               const char *fmt, ...) {
    e->http = http;
    snprintf(e->type, sizeof e->type, "%s", type);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return 0;
}

/* A string field, or JSON null when empty. Messages may hold bytes cut
 * from user input: jansson refuses invalid UTF-8, so such a message is
 * replaced by a generic one rather than lost. */
static json_t *str_or_null(const char *s) {
    if (!s || !*s) return json_null();
    json_t *v = json_string(s);
    return v ? v : json_string("(message not valid UTF-8)");
}

char *serve_err_json(const serve_err *e) {
    json_t *o =
        json_pack("{s:{s:o,s:s,s:o,s:o}}", "error", "message", str_or_null(e->message), "type",
                  e->type, "param", str_or_null(e->param), "code", str_or_null(e->code));
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return s ? s
             : k3_xstrdup("{\"error\":{\"message\":\"internal error\",\"type\":\"server_error\","
                          "\"param\":null,\"code\":null}}");
}

long long serve_now_s(void) { return (long long)time(NULL); }

/* ---- field helpers ------------------------------------------------------- */

static int bad(serve_err *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(serve_err *e, const char *param, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return serve_fail(e, 400, "invalid_request_error", param, "invalid_value", "%s: %s", param,
                      msg);
}

static int unsupported(serve_err *e, const char *param, const char *what) {
    return serve_fail(e, 400, "invalid_request_error", param, "unsupported_parameter",
                      "%s: %s is not supported by this server", param, what);
}

/* The field key of o, NULL when absent or null. */
static json_t *field(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* A string without embedded NUL (the chat renderer's strings are C
 * strings: common/text/chat.h). */
static int get_str(json_t *v, const char *param, const char **out, serve_err *e) {
    if (!json_is_string(v)) return bad(e, param, "must be a string");
    if (strlen(json_string_value(v)) != json_string_length(v))
        return bad(e, param, "contains a NUL character (\\u0000)");
    *out = json_string_value(v);
    return 1;
}

/* An integer in [lo, hi]; a real with an integral value is accepted
 * (JavaScript clients cannot tell 16 from 16.0). */
static int get_int(json_t *v, const char *param, long long lo, long long hi, long long *out,
                   serve_err *e) {
    double d;
    if (json_is_integer(v)) {
        long long x = json_integer_value(v);
        if (x < lo || x > hi) return bad(e, param, "%lld is outside %lld..%lld", x, lo, hi);
        *out = x;
        return 1;
    }
    if (!json_is_real(v)) return bad(e, param, "must be an integer");
    d = json_real_value(v);
    if (d != floor(d)) return bad(e, param, "must be an integer, not %g", d);
    if (d < (double)lo || d > (double)hi)
        return bad(e, param, "%g is outside %lld..%lld", d, lo, hi);
    *out = (long long)d;
    return 1;
}

static int get_num(json_t *v, const char *param, double lo, double hi, double *out, serve_err *e) {
    if (!json_is_number(v)) return bad(e, param, "must be a number");
    double d = json_number_value(v);
    if (!isfinite(d) || d < lo || d > hi) return bad(e, param, "%g is outside %g..%g", d, lo, hi);
    *out = d;
    return 1;
}

static int get_bool(json_t *v, const char *param, int *out, serve_err *e) {
    if (!json_is_boolean(v)) return bad(e, param, "must be true or false");
    *out = json_is_true(v);
    return 1;
}

/* ---- shared fields ------------------------------------------------------- */

/* The refused fields: present with a value that would change the answer. */
static int check_unsupported(json_t *o, serve_err *e) {
    json_t *v;
    long long n;
    if ((v = field(o, "n"))) {
        if (!get_int(v, "n", 1, 128, &n, e)) return 0;
        if (n != 1) return unsupported(e, "n", "more than one choice (n > 1)");
    }
    if ((v = field(o, "logprobs")) && !json_is_false(v) &&
        !(json_is_integer(v) && !json_integer_value(v)))
        return unsupported(e, "logprobs", "logprobs");
    if (field(o, "top_logprobs")) return unsupported(e, "top_logprobs", "top_logprobs");
    if (field(o, "echo") && !json_is_false(field(o, "echo"))) return unsupported(e, "echo", "echo");
    if (field(o, "best_of")) return unsupported(e, "best_of", "best_of");
    if ((v = field(o, "response_format"))) {
        json_t *t = json_object_get(v, "type");
        if (!json_is_object(v) || !json_is_string(t) || strcmp(json_string_value(t), "text"))
            return unsupported(e, "response_format", "a response_format other than text");
    }
    static const char *const penalties[] = {"presence_penalty", "frequency_penalty",
                                            "repetition_penalty"};
    for (size_t i = 0; i < sizeof penalties / sizeof penalties[0]; i++) {
        if (!(v = field(o, penalties[i]))) continue;
        double d;
        if (!get_num(v, penalties[i], -2, 2, &d, e)) return 0;
        if (d != 0) return unsupported(e, penalties[i], "a non-zero penalty");
    }
    if ((v = field(o, "logit_bias")) && !(json_is_object(v) && json_object_size(v) == 0))
        return unsupported(e, "logit_bias", "logit_bias");
    return 1;
}

/* max_tokens / max_completion_tokens, sampling, stop, stream. */
static int parse_common(serve_req *r, json_t *o, serve_err *e) {
    json_t *v;
    long long n;
    if ((v = field(o, "model")) && !json_is_string(v)) return bad(e, "model", "must be a string");
    if (!check_unsupported(o, e)) return 0;
    static const char *const mt[] = {"max_tokens", "max_completion_tokens"};
    for (int i = 0; i < 2; i++) {
        if (!(v = field(o, mt[i]))) continue;
        if (!get_int(v, mt[i], 1, K3_MAX_NGEN, &n, e)) return 0;
        r->max_tokens = (int)n;
    }
    /* temperature defaults to 1 as OpenAI's does; 0 is greedy */
    r->sampling.temp = 1.0;
    r->sampling.top_p = 1.0;
    if ((v = field(o, "temperature")) && !get_num(v, "temperature", 0, 2, &r->sampling.temp, e))
        return 0;
    if ((v = field(o, "top_p"))) {
        if (!get_num(v, "top_p", 0, 1, &r->sampling.top_p, e)) return 0;
        if (r->sampling.top_p == 0) return bad(e, "top_p", "0 is outside (0, 1]");
    }
    if ((v = field(o, "seed"))) {
        if (!get_int(v, "seed", -(1ll << 53), 1ll << 53, &n, e)) return 0;
        r->sampling.seed = (uint64_t)n;
    }
    if ((v = field(o, "stop"))) {
        char p[32];
        if (json_is_string(v)) {
            if (!get_str(v, "stop", &r->stops[0], e)) return 0;
            r->n_stops = 1;
        } else if (json_is_array(v)) {
            if (json_array_size(v) > K3_SERVE_MAX_STOPS)
                return bad(e, "stop", "%zu strings, at most %d (K3_SERVE_MAX_STOPS)",
                           json_array_size(v), K3_SERVE_MAX_STOPS);
            for (size_t i = 0; i < json_array_size(v); i++) {
                snprintf(p, sizeof p, "stop[%zu]", i);
                if (!get_str(json_array_get(v, i), p, &r->stops[r->n_stops], e)) return 0;
                r->n_stops++;
            }
        } else {
            return bad(e, "stop", "must be a string or an array of strings");
        }
        for (int i = 0; i < r->n_stops; i++) {
            size_t len = strlen(r->stops[i]);
            if (len == 0) return bad(e, "stop", "an empty stop string");
            if (len > K3_SERVE_MAX_STOP_BYTES)
                return bad(e, "stop",
                           "a stop string of %zu bytes, at most %d "
                           "(K3_SERVE_MAX_STOP_BYTES)",
                           len, K3_SERVE_MAX_STOP_BYTES);
        }
    }
    if ((v = field(o, "stream")) && !get_bool(v, "stream", &r->stream, e)) return 0;
    if ((v = field(o, "stream_options"))) {
        if (!json_is_object(v)) return bad(e, "stream_options", "must be an object");
        json_t *u = field(v, "include_usage");
        if (u && !get_bool(u, "stream_options.include_usage", &r->include_usage, e)) return 0;
    }
    return 1;
}

/* ---- chat messages --------------------------------------------------------- */

/* content: a string, or an array of text parts ({"type":"text"|"input_text",
 * "text":...}) joined without separator, as the reference gateway does. */
static int parse_content(serve_req *r, json_t *c, const char *param, const char **out,
                         serve_err *e) {
    if (json_is_string(c)) return get_str(c, param, out, e);
    if (!json_is_array(c)) return bad(e, param, "must be a string or an array of text parts");
    size_t n = json_array_size(c);
    if (n > K3_SERVE_MAX_PARTS)
        return bad(e, param, "%zu parts, at most %d (K3_SERVE_MAX_PARTS)", n, K3_SERVE_MAX_PARTS);
    size_t total = 0;
    char p[160]; /* param is at most 95 bytes ("messages[4095].content") */
    for (size_t i = 0; i < n; i++) {
        json_t *part = json_array_get(c, i);
        snprintf(p, sizeof p, "%s[%zu]", param, i);
        const char *type = NULL, *text = NULL;
        if (!json_is_object(part)) return bad(e, p, "must be an object");
        if (!get_str(json_object_get(part, "type"), p, &type, e)) return 0;
        if (strcmp(type, "text") && strcmp(type, "input_text"))
            return serve_fail(e, 400, "invalid_request_error", p, "unsupported_content_type",
                              "%s: content type '%.40s' is not supported (text only)", p, type);
        snprintf(p, sizeof p, "%s[%zu].text", param, i);
        if (!get_str(json_object_get(part, "text"), p, &text, e)) return 0;
        total += strlen(text);
    }
    char *s = k3_xmalloc(total + 1), *w = s;
    for (size_t i = 0; i < n; i++) {
        const char *t = json_string_value(json_object_get(json_array_get(c, i), "text"));
        size_t len = strlen(t);
        memcpy(w, t, len);
        w += len;
    }
    *w = 0;
    r->texts = k3_xrealloc(r->texts, (size_t)(r->n_texts + 1) * sizeof *r->texts);
    r->texts[r->n_texts++] = s;
    *out = s;
    return 1;
}

/* An assistant's tool_calls: [{"id","type":"function","function":{"name",
 * "arguments"}}], appended to r->calls (the message points at its run). */
static int parse_calls(serve_req *r, json_t *tc, int mi, k3_chat_msg *m, serve_err *e) {
    char p[96];
    snprintf(p, sizeof p, "messages[%d].tool_calls", mi);
    if (!json_is_array(tc)) return bad(e, p, "must be an array");
    size_t n = json_array_size(tc);
    if (n > K3_CHAT_MAX_CALLS) return bad(e, p, "%zu calls, at most %d", n, K3_CHAT_MAX_CALLS);
    int first = r->n_calls;
    r->calls = k3_xrealloc(r->calls, (size_t)(r->n_calls + (int)n + 1) * sizeof *r->calls);
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_array_get(tc, i), *f, *v;
        k3_chat_tool_call *k = &r->calls[r->n_calls];
        memset(k, 0, sizeof *k);
        snprintf(p, sizeof p, "messages[%d].tool_calls[%zu]", mi, i);
        if (!json_is_object(c) || !json_is_object(f = json_object_get(c, "function")))
            return bad(e, p, "must be an object with a function object");
        if ((v = field(c, "id")) && !get_str(v, p, &k->id, e)) return 0;
        snprintf(p, sizeof p, "messages[%d].tool_calls[%zu].function.name", mi, i);
        if (!get_str(json_object_get(f, "name"), p, &k->name, e)) return 0;
        snprintf(p, sizeof p, "messages[%d].tool_calls[%zu].function.arguments", mi, i);
        k->arguments = "{}";
        if ((v = field(f, "arguments")) && !get_str(v, p, &k->arguments, e)) return 0;
        r->n_calls++;
    }
    /* r->calls may move on a later realloc: store the index for now */
    m->tool_calls = (const k3_chat_tool_call *)(intptr_t)first;
    m->n_tool_calls = (int)n;
    return 1;
}

static int parse_messages(serve_req *r, json_t *o, serve_err *e) {
    json_t *ms = field(o, "messages");
    if (!ms) return bad(e, "messages", "missing (a non-empty array of messages)");
    if (!json_is_array(ms) || json_array_size(ms) == 0)
        return bad(e, "messages", "must be a non-empty array");
    size_t n = json_array_size(ms);
    if (n > K3_SERVE_MAX_MSGS)
        return bad(e, "messages", "%zu messages, at most %d (K3_SERVE_MAX_MSGS)", n,
                   K3_SERVE_MAX_MSGS);
    r->msgs = k3_xcalloc(n, sizeof *r->msgs);
    r->n_msgs = (int)n;
    char p[96];
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(ms, i), *v;
        k3_chat_msg *cm = &r->msgs[i];
        snprintf(p, sizeof p, "messages[%zu]", i);
        if (!json_is_object(m)) return bad(e, p, "must be an object");
        snprintf(p, sizeof p, "messages[%zu].role", i);
        if (!get_str(json_object_get(m, "role"), p, &cm->role, e)) return 0;
        static const char *const roles[] = {"system", "developer", "user", "assistant", "tool"};
        int known = 0;
        for (size_t k = 0; k < 5; k++) known |= !strcmp(cm->role, roles[k]);
        if (!known)
            return bad(e, p, "'%.40s' is not one of system, developer, user, assistant, tool",
                       cm->role);
        int assistant = !strcmp(cm->role, "assistant");
        snprintf(p, sizeof p, "messages[%zu].content", i);
        if ((v = field(m, "content"))) {
            if (!parse_content(r, v, p, &cm->content, e)) return 0;
        } else if (!assistant) {
            return bad(e, p, "missing");
        }
        snprintf(p, sizeof p, "messages[%zu].reasoning_content", i);
        if ((v = field(m, "reasoning_content")) && !get_str(v, p, &cm->reasoning_content, e))
            return 0;
        snprintf(p, sizeof p, "messages[%zu].tool_calls", i);
        if ((v = field(m, "tool_calls"))) {
            if (!assistant)
                return bad(e, p, "tool_calls on a %s message (assistant only)", cm->role);
            if (!parse_calls(r, v, (int)i, cm, e)) return 0;
        }
        snprintf(p, sizeof p, "messages[%zu].tool_call_id", i);
        if ((v = field(m, "tool_call_id")) && !get_str(v, p, &cm->tool_call_id, e)) return 0;
        snprintf(p, sizeof p, "messages[%zu].name", i);
        if ((v = field(m, "name")) && !get_str(v, p, &cm->name, e)) return 0;
    }
    for (int i = 0; i < r->n_msgs; i++) /* indexes into the final calls array */
        if (r->msgs[i].n_tool_calls)
            r->msgs[i].tool_calls = r->calls + (intptr_t)r->msgs[i].tool_calls;
    return 1;
}

/* tools / tool_choice (docs/INTERFACES.md 2.3), and the thinking switch. */
static int parse_chat_opts(serve_req *r, json_t *o, serve_err *e) {
    json_t *v;
    if ((v = field(o, "tools"))) {
        if (!json_is_array(v)) return bad(e, "tools", "must be an array");
        if (json_array_size(v) > 0) r->tools_json = json_dumps(v, JSON_COMPACT);
    }
    if ((v = field(o, "tool_choice"))) {
        if (json_is_string(v)) {
            const char *s = json_string_value(v);
            if (!strcmp(s, "auto"))
                r->tool_choice = K3_CHAT_TOOLS_AUTO;
            else if (!strcmp(s, "none"))
                r->tool_choice = K3_CHAT_TOOLS_NONE;
            else if (!strcmp(s, "required"))
                r->tool_choice = K3_CHAT_TOOLS_REQUIRED;
            else
                return bad(e, "tool_choice", "'%.40s' is not auto, none or required", s);
        } else {
            json_t *f = json_object_get(v, "function");
            if (!json_is_object(v) || !json_is_object(f))
                return bad(e, "tool_choice",
                           "must be a string or {\"type\":\"function\","
                           "\"function\":{\"name\":...}}");
            if (!get_str(json_object_get(f, "name"), "tool_choice.function.name",
                         &r->tool_choice_name, e))
                return 0;
            r->tool_choice = K3_CHAT_TOOLS_FORCED;
        }
        if (r->tool_choice != K3_CHAT_TOOLS_NONE && !r->tools_json)
            return bad(e, "tool_choice", "given without tools");
    }
    /* thinking: enable_thinking, else on when reasoning_effort is given
     * and not "none" (docs/SERVING.md); its level is not rendered */
    const char *effort = NULL;
    if ((v = field(o, "reasoning_effort")) && !get_str(v, "reasoning_effort", &effort, e)) return 0;
    r->enable_thinking = effort && strcmp(effort, "none") != 0;
    if ((v = field(o, "enable_thinking")) &&
        !get_bool(v, "enable_thinking", &r->enable_thinking, e))
        return 0;
    return 1;
}

int serve_req_parse(serve_req *r, int chat, const char *body, size_t len, serve_err *e) {
    memset(r, 0, sizeof *r);
    r->chat = chat;
    json_error_t je;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!o)
        return serve_fail(e, 400, "invalid_request_error", "", "invalid_json",
                          "request body is not valid JSON: %s (line %d, column %d)", je.text,
                          je.line, je.column);
    r->json = o;
    if (!json_is_object(o))
        return serve_fail(e, 400, "invalid_request_error", "", "invalid_json",
                          "request body must be a JSON object");
    if (!parse_common(r, o, e)) return 0;
    if (chat) return parse_messages(r, o, e) && parse_chat_opts(r, o, e);
    json_t *p = field(o, "prompt");
    if (!p) return bad(e, "prompt", "missing (a string)");
    if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
        p = json_array_get(p, 0); /* ["text"]: one prompt, as clients send it */
    if (json_is_array(p)) return unsupported(e, "prompt", "a batch of prompts or token ids");
    if (!get_str(p, "prompt", &r->prompt, e)) return 0;
    r->prompt_len = strlen(r->prompt);
    if (r->prompt_len == 0) return bad(e, "prompt", "empty");
    return 1;
}

void serve_req_free(serve_req *r) {
    for (int i = 0; i < r->n_texts; i++) free(r->texts[i]);
    free(r->texts);
    free(r->msgs);
    free(r->calls);
    free(r->tools_json);
    json_decref(r->json);
    memset(r, 0, sizeof *r);
}
