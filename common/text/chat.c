/* common/text/chat.c: XTML rendering (docs/INTERFACES.md 2.1-2.4) and the Python-style
 * JSON printer for tool declarations. The output filter is chat_filter.c. */
#include "common/text/chat.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/base/strbuf.h"

/* ---- Python json.dumps(sort_keys=True, separators=(",",":"),
 *      ensure_ascii=False) ------------------------------------------------- */

static void py_string(k3_strbuf *b, const char *s, size_t n) {
    k3_strbuf_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *e = NULL;
        char u[8];
        switch (c) {
        case '"': e = "\\\""; break;
        case '\\': e = "\\\\"; break;
        case '\n': e = "\\n"; break;
        case '\r': e = "\\r"; break;
        case '\t': e = "\\t"; break;
        case '\b': e = "\\b"; break;
        case '\f': e = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c); /* Python: lower-case hex */
                e = u;
            }
        }
        if (e)
            k3_strbuf_str(b, e);
        else
            k3_strbuf_add(b, s + i, 1);
    }
    k3_strbuf_add(b, "\"", 1);
}

/* repr(float): the shortest digits that read back to x, in fixed notation
 * when -4 < decimal point position <= 16, else d.ddde+XX. */
static void py_float(k3_strbuf *b, double x) {
    if (x == 0) {
        k3_strbuf_str(b, signbit(x) ? "-0.0" : "0.0");
        return;
    }
    char buf[48];
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    const char *s = buf;
    if (*s == '-') k3_strbuf_add(b, s++, 1);
    char dig[24];
    int nd = 0;
    for (; *s && *s != 'e'; s++)
        if (*s != '.') dig[nd++] = *s;
    int e = atoi(s + 1), decpt = e + 1;
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            k3_strbuf_str(b, "0.");
            for (int i = 0; i < -decpt; i++) k3_strbuf_add(b, "0", 1);
            k3_strbuf_add(b, dig, (size_t)nd);
        } else if (decpt >= nd) {
            k3_strbuf_add(b, dig, (size_t)nd);
            for (int i = nd; i < decpt; i++) k3_strbuf_add(b, "0", 1);
            k3_strbuf_str(b, ".0");
        } else {
            k3_strbuf_add(b, dig, (size_t)decpt);
            k3_strbuf_add(b, ".", 1);
            k3_strbuf_add(b, dig + decpt, (size_t)(nd - decpt));
        }
    } else {
        k3_strbuf_add(b, dig, 1);
        if (nd > 1) {
            k3_strbuf_add(b, ".", 1);
            k3_strbuf_add(b, dig + 1, (size_t)(nd - 1));
        }
        snprintf(buf, sizeof buf, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
        k3_strbuf_str(b, buf);
    }
}

static int key_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Recursion depth is bounded by jansson's parser (it refuses nesting deeper
 * than its JSON_PARSER_MAX_DEPTH), so this cannot run out of stack. */
static void py_dump(k3_strbuf *b, json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        /* Python sorts str keys by code point; UTF-8 byte order is the same. */
        size_t n = json_object_size(v), i = 0;
        const char **keys = k3_xmalloc((n ? n : 1) * sizeof *keys);
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) keys[i++] = k;
        qsort(keys, n, sizeof *keys, key_cmp);
        k3_strbuf_add(b, "{", 1);
        for (i = 0; i < n; i++) {
            if (i) k3_strbuf_add(b, ",", 1);
            py_string(b, keys[i], strlen(keys[i]));
            k3_strbuf_add(b, ":", 1);
            py_dump(b, json_object_get(v, keys[i]));
        }
        k3_strbuf_add(b, "}", 1);
        free(keys);
        break;
    }
    case JSON_ARRAY:
        k3_strbuf_add(b, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) k3_strbuf_add(b, ",", 1);
            py_dump(b, json_array_get(v, i));
        }
        k3_strbuf_add(b, "]", 1);
        break;
    case JSON_STRING: py_string(b, json_string_value(v), json_string_length(v)); break;
    case JSON_INTEGER: {
        char t[32];
        snprintf(t, sizeof t, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        k3_strbuf_str(b, t);
        break;
    }
    case JSON_REAL: py_float(b, json_real_value(v)); break;
    case JSON_TRUE: k3_strbuf_str(b, "true"); break;
    case JSON_FALSE: k3_strbuf_str(b, "false"); break;
    case JSON_NULL: k3_strbuf_str(b, "null"); break;
    }
}

k3_status k3_chat_json_py(const char *in, size_t n, char **out, size_t *out_len, char *err,
                          size_t errlen) {
    json_error_t je;
    json_t *v = json_loadb(in, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!v)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "invalid JSON at line %d column %d: %s", je.line,
                       je.column, je.text);
    k3_strbuf b = {0};
    k3_strbuf_add(&b, "", 0);
    py_dump(&b, v);
    json_decref(v);
    *out = b.p;
    *out_len = b.n;
    return K3_OK;
}

/* ---- one-level scan of a tool call's arguments ----------------------------
 *
 * The typed rendering needs each value's exact source text (1e2 stays 1e2,
 * {"a": 1} keeps its spaces), which no JSON library keeps, and the keys in
 * source order. The text was validated by jansson first, so the scanner
 * only finds extents. */

typedef struct src_arg {
    char *key; /* decoded, owned */
    size_t key_len;
    const char *type; /* static */
    const char *raw;  /* value source text (into the arguments string) */
    size_t raw_len;
    char *str; /* decoded string value, owned (type string) */
    size_t str_len;
} src_arg;

static size_t skip_ws(const char *s, size_t i, size_t n) {
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) i++;
    return i;
}

/* End (exclusive) of the string token starting at s[i] == '"'. */
static size_t string_end(const char *s, size_t i, size_t n) {
    for (i++; i < n; i++) {
        if (s[i] == '\\')
            i++;
        else if (s[i] == '"')
            return i + 1;
    }
    return n;
}

/* End of the value starting at s[i]. */
static size_t value_end(const char *s, size_t i, size_t n) {
    if (s[i] == '"') return string_end(s, i, n);
    if (s[i] == '{' || s[i] == '[') {
        int depth = 0;
        for (; i < n; i++) {
            if (s[i] == '"') {
                i = string_end(s, i, n) - 1;
            } else if (s[i] == '{' || s[i] == '[') {
                depth++;
            } else if (s[i] == '}' || s[i] == ']') {
                if (--depth == 0) return i + 1;
            }
        }
        return n;
    }
    while (i < n && s[i] != ',' && s[i] != '}' && s[i] != ']' && s[i] != ' ' && s[i] != '\t' &&
           s[i] != '\n' && s[i] != '\r')
        i++;
    return i;
}

/* Decodes the JSON string token s[0..n) into a malloc'd buffer. */
static char *decode_string(const char *s, size_t n, size_t *len) {
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    K3_ASSERT(v && json_is_string(v)); /* validated before */
    *len = json_string_length(v);
    char *o = k3_xmalloc(*len + 1);
    memcpy(o, json_string_value(v), *len);
    o[*len] = 0;
    json_decref(v);
    return o;
}

static void free_args(src_arg *a, int n) {
    for (int i = 0; i < n; i++) {
        free(a[i].key);
        free(a[i].str);
    }
    free(a);
}

/* Parses a call's arguments: *is_object = 0 means the json fallback. */
/* Errors: not JSON at all -> K3_ERR_FORMAT ("malformed tool arguments");
 * more than K3_CHAT_MAX_ARGS members or a key outside 1..K3_CHAT_MAX_NAME
 * bytes -> K3_ERR_LIMIT. Valid JSON that is not an object (an array, a
 * number) is not an error: the caller renders the json fallback block.
 * Duplicate keys are all kept, in source order, like the source text. */
static k3_status scan_args(const char *s, int *is_object, src_arg **args, int *n_args,
                           const char *what, char *err, size_t errlen) {
    size_t n = strlen(s);
    json_error_t je;
    json_t *v = json_loadb(s, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!v)
        return k3_errf(K3_ERR_FORMAT, err, errlen,
                       "%s: arguments are not valid JSON (line %d column %d: %s)", what, je.line,
                       je.column, je.text);
    *is_object = json_is_object(v);
    size_t count = json_is_object(v) ? json_object_size(v) : 0;
    json_decref(v);
    *args = NULL;
    *n_args = 0;
    if (!*is_object) return K3_OK;
    /* count is after duplicate keys collapse; the scan below counts again */
    (void)count;
    src_arg *a = k3_xcalloc(K3_CHAT_MAX_ARGS + 1, sizeof *a);
    int na = 0;
    size_t i = skip_ws(s, 0, n) + 1; /* past '{' */
    for (;;) {
        i = skip_ws(s, i, n);
        if (i >= n || s[i] == '}') break;
        if (s[i] == ',') {
            i++;
            continue;
        }
        if (na == K3_CHAT_MAX_ARGS) {
            free_args(a, na);
            return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: more than K3_CHAT_MAX_ARGS %d arguments",
                           what, K3_CHAT_MAX_ARGS);
        }
        size_t ke = string_end(s, i, n);
        src_arg *x = &a[na++];
        x->key = decode_string(s + i, ke - i, &x->key_len);
        if (x->key_len == 0 || x->key_len > K3_CHAT_MAX_NAME || memchr(x->key, 0, x->key_len)) {
            k3_status st = k3_errf(K3_ERR_LIMIT, err, errlen,
                                   "%s: argument key of %zu bytes (must be 1..%d, no NUL)", what,
                                   x->key_len, K3_CHAT_MAX_NAME);
            free_args(a, na);
            return st;
        }
        i = skip_ws(s, ke, n) + 1; /* past ':' */
        i = skip_ws(s, i, n);
        size_t ve = value_end(s, i, n);
        x->raw = s + i;
        x->raw_len = ve - i;
        switch (s[i]) {
        case '"':
            x->type = "string";
            x->str = decode_string(s + i, ve - i, &x->str_len);
            break;
        case '{': x->type = "object"; break;
        case '[': x->type = "array"; break;
        case 't':
        case 'f': x->type = "boolean"; break;
        case 'n': x->type = "null"; break;
        default: x->type = "number";
        }
        i = ve;
    }
    *args = a;
    *n_args = na;
    return K3_OK;
}

/* ---- rendering ------------------------------------------------------------ */

typedef struct rctx {
    const k3_tok *tok;
    int32_t open, close, sep, eom; /* the four markers */
    k3_chat_out *out;
    k3_strbuf text;
    char *err;
    size_t errlen;
} rctx;

/* The four markers of tok; K3_ERR_MISSING without them. */
static k3_status r_init(rctx *r, const k3_tok *tok, k3_chat_out *out, char *err, size_t errlen) {
    *r = (rctx){.tok = tok, .out = out, .err = err, .errlen = errlen};
    r->open = k3_tok_special_id(tok, "<|open|>");
    r->close = k3_tok_special_id(tok, "<|close|>");
    r->sep = k3_tok_special_id(tok, "<|sep|>");
    r->eom = k3_tok_special_id(tok, "<|end_of_msg|>");
    if (r->open < 0 || r->close < 0 || r->sep < 0 || r->eom < 0)
        return k3_errf(K3_ERR_MISSING, err, errlen,
                       "tokenizer has no XTML chat tokens (<|open|> <|close|> <|sep|> "
                       "<|end_of_msg|>)");
    return K3_OK;
}

static void r_marker(rctx *r, int32_t id) {
    size_t n;
    const uint8_t *b = k3_tok_token_bytes(r->tok, id, &n);
    k3_tok_ids_push(&r->out->ids, id);
    k3_strbuf_add(&r->text, (const char *)b, n);
}

/* One text piece, encoded on its own through the untrusted path. */
/* Untrusted on purpose: content, names, argument values and even the tag
 * words never produce added tokens. Only r_marker emits markers. */
static k3_status r_text(rctx *r, const char *s, size_t n) {
    if (n == 0) return K3_OK;
    k3_status st = k3_tok_encode(r->tok, s, n, 0, &r->out->ids, r->err, r->errlen);
    if (st == K3_OK) k3_strbuf_add(&r->text, s, n);
    return st;
}
static k3_status r_str(rctx *r, const char *s) { return r_text(r, s, s ? strlen(s) : 0); }

typedef struct attr {
    const char *key, *value;
    int escape; /* role values are not escaped (2.1) */
} attr;

/* & -> &amp; first, then " -> &quot; (the reference's _escape_attr_value). */
static char *escape_attr(const char *v) {
    k3_strbuf b = {0};
    k3_strbuf_add(&b, "", 0);
    for (; *v; v++) {
        if (*v == '&')
            k3_strbuf_str(&b, "&amp;");
        else if (*v == '"')
            k3_strbuf_str(&b, "&quot;");
        else
            k3_strbuf_add(&b, v, 1);
    }
    return b.p;
}

/* <|open|> tag { " key" "=\"" value "\"" } <|sep|>, each a separate piece. */
static k3_status r_open(rctx *r, const char *tag, const attr *a, int n) {
    r_marker(r, r->open);
    k3_status st = r_str(r, tag);
    for (int i = 0; i < n && st == K3_OK; i++) {
        char key[64];
        snprintf(key, sizeof key, " %s", a[i].key);
        st = r_str(r, key);
        if (st == K3_OK) st = r_str(r, "=\"");
        if (st == K3_OK) {
            char *v = a[i].escape ? escape_attr(a[i].value) : NULL;
            st = r_str(r, v ? v : a[i].value);
            free(v);
        }
        if (st == K3_OK) st = r_str(r, "\"");
    }
    if (st == K3_OK) r_marker(r, r->sep);
    return st;
}

static k3_status r_close(rctx *r, const char *tag) {
    r_marker(r, r->close);
    k3_status st = r_str(r, tag);
    if (st == K3_OK) r_marker(r, r->sep);
    return st;
}

/* <|open|>tag<|sep|>TEXT<|close|>tag<|sep|> */
static k3_status r_block(rctx *r, const char *tag, const char *text) {
    k3_status st = r_open(r, tag, NULL, 0);
    if (st == K3_OK) st = r_str(r, text);
    if (st == K3_OK) st = r_close(r, tag);
    return st;
}

/* A whole message: open message (role + extra attrs), body, close, eom. */
static k3_status r_message(rctx *r, const char *role, const attr *extra, int n_extra,
                           const char *body) {
    attr a[4] = {{"role", role, 0}};
    for (int i = 0; i < n_extra && i < 3; i++) a[1 + i] = extra[i];
    k3_status st = r_open(r, "message", a, 1 + n_extra);
    if (st == K3_OK) st = r_str(r, body);
    if (st == K3_OK) st = r_close(r, "message");
    if (st == K3_OK) r_marker(r, r->eom);
    return st;
}

static k3_status check_name(const char *name, const char *what, char *err, size_t errlen) {
    size_t n = name ? strlen(name) : 0;
    if (n == 0) return k3_errf(K3_ERR_ARG, err, errlen, "%s: empty function name", what);
    if (n > K3_CHAT_MAX_NAME)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%s: function name of %zu bytes > limit K3_CHAT_MAX_NAME %d", what, n,
                       K3_CHAT_MAX_NAME);
    return K3_OK;
}

/* The tools block of an assistant turn (2.3). */
static k3_status r_tool_calls(rctx *r, const k3_chat_msg *m, int mi) {
    k3_status st = r_open(r, "tools", NULL, 0);
    for (int c = 0; c < m->n_tool_calls && st == K3_OK; c++) {
        const k3_chat_tool_call *tc = &m->tool_calls[c];
        char what[96], idx[16];
        snprintf(what, sizeof what, "message %d tool call %d", mi, c + 1);
        snprintf(idx, sizeof idx, "%d", c + 1);
        if (!tc->arguments) return k3_errf(K3_ERR_ARG, r->err, r->errlen, "%s: no arguments", what);
        int is_obj = 0, na = 0;
        src_arg *args = NULL;
        st = scan_args(tc->arguments, &is_obj, &args, &na, what, r->err, r->errlen);
        if (st != K3_OK) return st;
        attr ca[2] = {{"tool", tc->name, 1}, {"index", idx, 1}};
        st = r_open(r, "call", ca, 2);
        if (!is_obj && st == K3_OK) {
            attr ja = {"type", "object", 1};
            st = r_open(r, "json", &ja, 1);
            if (st == K3_OK) st = r_str(r, tc->arguments);
            if (st == K3_OK) st = r_close(r, "json");
        }
        for (int i = 0; i < na && st == K3_OK; i++) {
            attr aa[2] = {{"key", args[i].key, 1}, {"type", args[i].type, 1}};
            st = r_open(r, "argument", aa, 2);
            if (st == K3_OK)
                st = args[i].str ? r_text(r, args[i].str, args[i].str_len)
                                 : r_text(r, args[i].raw, args[i].raw_len);
            if (st == K3_OK) st = r_close(r, "argument");
        }
        free_args(args, na);
        if (st == K3_OK) st = r_close(r, "call");
    }
    if (st == K3_OK) st = r_close(r, "tools");
    return st;
}

/* A closed assistant turn from the history. */
static k3_status r_assistant(rctx *r, const k3_chat_msg *m, int mi, int thinking) {
    attr a = {"role", "assistant", 0};
    k3_status st = r_open(r, "message", &a, 1);
    /* thinking mode: the think block is always there (empty if no
     * reasoning); otherwise prior reasoning is dropped (2.2) */
    if (st == K3_OK && thinking) st = r_block(r, "think", m->reasoning_content);
    if (st == K3_OK) st = r_block(r, "response", m->content);
    if (st == K3_OK && m->n_tool_calls) st = r_tool_calls(r, m, mi);
    if (st == K3_OK) st = r_close(r, "message");
    if (st == K3_OK) r_marker(r, r->eom);
    return st;
}

/* ---- tool results ----------------------------------------------------------- */

typedef struct result {
    const k3_chat_msg *m;
    const char *name;
    int index; /* 1-based */
    int pos;   /* order in the run, for a stable sort */
} result;

static int result_cmp(const void *a, const void *b) {
    const result *x = a, *y = b;
    if (x->index != y->index) return x->index < y->index ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Renders the run of tool messages msgs[i..j), after msgs[i-1]. */
/* Resolution per result, in order of preference: the previous assistant
 * turn's call with the same id (name and 1-based index from the call); else
 * the result's own `name` with its position in the run as index; else the
 * call at that position. The run is then stably sorted by index, which puts
 * results back in tool_calls order whatever order the client sent them. */
static k3_status r_results(rctx *r, const k3_chat_req *q, int i, int j) {
    const k3_chat_msg *prev = i > 0 ? &q->msgs[i - 1] : NULL;
    if (prev && (strcmp(prev->role, "assistant") || prev->n_tool_calls == 0)) prev = NULL;
    result *res = k3_xcalloc((size_t)(j - i), sizeof *res);
    k3_status st = K3_OK;
    for (int k = i; k < j && st == K3_OK; k++) {
        result *x = &res[k - i];
        x->m = &q->msgs[k];
        x->pos = k - i;
        if (prev && x->m->tool_call_id)
            for (int c = 0; c < prev->n_tool_calls; c++)
                if (prev->tool_calls[c].id && !strcmp(prev->tool_calls[c].id, x->m->tool_call_id)) {
                    x->name = prev->tool_calls[c].name; /* the call's name wins */
                    x->index = c + 1;
                    break;
                }
        if (!x->index) {
            x->index = k - i + 1; /* matched by order */
            if (x->m->name && *x->m->name)
                x->name = x->m->name;
            else if (prev && k - i < prev->n_tool_calls)
                x->name = prev->tool_calls[k - i].name;
        }
        char what[64];
        snprintf(what, sizeof what, "message %d (tool result)", k);
        if (!x->name)
            st = k3_errf(K3_ERR_ARG, r->err, r->errlen,
                         "%s: cannot resolve the tool name: no name, and tool_call_id "
                         "\"%.64s\" matches no call of the previous assistant turn",
                         what, x->m->tool_call_id ? x->m->tool_call_id : "");
        else
            st = check_name(x->name, what, r->err, r->errlen);
    }
    if (st == K3_OK) qsort(res, (size_t)(j - i), sizeof *res, result_cmp);
    for (int k = 0; k < j - i && st == K3_OK; k++) {
        char idx[16];
        snprintf(idx, sizeof idx, "%d", res[k].index);
        attr a[2] = {{"tool", res[k].name, 1}, {"index", idx, 1}};
        st = r_message(r, "tool", a, 2, res[k].m->content);
    }
    free(res);
    return st;
}

/* ---- tool declaration --------------------------------------------------------- */

static const char *tool_fn_name(json_t *t) {
    json_t *f = json_object_get(t, "function");
    json_t *n = json_object_get(json_is_object(f) ? f : t, "name");
    return json_is_string(n) ? json_string_value(n) : NULL;
}

/* BODY of the tool-declare message, or NULL when nothing is declared. */
/* tool_choice none declares nothing; forced keeps only the named function
 * (an error when it is not declared); an empty array declares nothing.
 * Every declared tool must have a function name within limits, since the
 * model will echo it back in a call. */
static k3_status tools_body(const k3_chat_req *q, char **body, char *err, size_t errlen) {
    *body = NULL;
    if (!q->tools_json || q->tool_choice == K3_CHAT_TOOLS_NONE) return K3_OK;
    json_error_t je;
    json_t *tools = json_loads(q->tools_json, JSON_ALLOW_NUL, &je);
    if (!tools)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "tools: invalid JSON at line %d column %d: %s",
                       je.line, je.column, je.text);
    if (!json_is_array(tools)) {
        json_decref(tools);
        return k3_errf(K3_ERR_FORMAT, err, errlen, "tools: must be a JSON array");
    }
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const char *name = tool_fn_name(json_array_get(tools, i));
        char what[48];
        snprintf(what, sizeof what, "tools[%zu]", i);
        k3_status st = check_name(name, what, err, errlen);
        if (st != K3_OK) {
            json_decref(tools);
            return st;
        }
    }
    if (q->tool_choice == K3_CHAT_TOOLS_FORCED) {
        json_t *kept = json_array();
        for (size_t i = 0; i < json_array_size(tools); i++) {
            json_t *t = json_array_get(tools, i);
            if (q->tool_choice_name && !strcmp(tool_fn_name(t), q->tool_choice_name))
                json_array_append(kept, t);
        }
        json_decref(tools);
        tools = kept;
        if (json_array_size(tools) == 0) {
            json_decref(tools);
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "tool_choice: function \"%.256s\" is not among the declared tools",
                           q->tool_choice_name ? q->tool_choice_name : "");
        }
    }
    if (json_array_size(tools) == 0) { /* nothing to declare */
        json_decref(tools);
        return K3_OK;
    }
    k3_strbuf b = {0};
    k3_strbuf_str(&b,
                  "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n");
    py_dump(&b, tools);
    k3_strbuf_str(&b, "\n```");
    json_decref(tools);
    *body = b.p;
    return K3_OK;
}

/* ---- the whole conversation ------------------------------------------------------ */

static int is_role(const char *r, const char *s) { return r && !strcmp(r, s); }

static k3_status validate(const k3_chat_req *q, char *err, size_t errlen) {
    if (q->n_msgs < 0 || (q->n_msgs > 0 && !q->msgs))
        return k3_errf(K3_ERR_ARG, err, errlen, "messages: %d given", q->n_msgs);
    for (int i = 0; i < q->n_msgs; i++) {
        const k3_chat_msg *m = &q->msgs[i];
        if (!is_role(m->role, "system") && !is_role(m->role, "developer") &&
            !is_role(m->role, "user") && !is_role(m->role, "assistant") &&
            !is_role(m->role, "tool"))
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "message %d: unknown role \"%.32s\" (expected system, developer, "
                           "user, assistant or tool)",
                           i, m->role ? m->role : "(null)");
        if (m->n_tool_calls < 0 || m->n_tool_calls > K3_CHAT_MAX_CALLS)
            return k3_errf(K3_ERR_LIMIT, err, errlen,
                           "message %d: %d tool calls (limit K3_CHAT_MAX_CALLS %d)", i,
                           m->n_tool_calls, K3_CHAT_MAX_CALLS);
        if (m->n_tool_calls && !is_role(m->role, "assistant"))
            return k3_errf(K3_ERR_ARG, err, errlen,
                           "message %d: tool_calls on a \"%s\" message (assistant only)", i,
                           m->role);
        for (int c = 0; c < m->n_tool_calls; c++) {
            char what[64];
            snprintf(what, sizeof what, "message %d tool call %d", i, c + 1);
            k3_status st = check_name(m->tool_calls[c].name, what, err, errlen);
            if (st != K3_OK) return st;
        }
    }
    if ((q->tool_choice == K3_CHAT_TOOLS_REQUIRED || q->tool_choice == K3_CHAT_TOOLS_FORCED) &&
        !q->tools_json)
        return k3_errf(K3_ERR_ARG, err, errlen, "tool_choice: %s without tools",
                       q->tool_choice == K3_CHAT_TOOLS_REQUIRED ? "required" : "a function");
    if (q->tool_choice == K3_CHAT_TOOLS_FORCED) {
        k3_status st = check_name(q->tool_choice_name, "tool_choice", err, errlen);
        if (st != K3_OK) return st;
    }
    return K3_OK;
}

/* The tool-choice system message (2.3), when asked for. */
static k3_status r_choice(rctx *r, const k3_chat_req *q) {
    if (q->tool_choice != K3_CHAT_TOOLS_REQUIRED && q->tool_choice != K3_CHAT_TOOLS_FORCED)
        return K3_OK;
    k3_strbuf b = {0};
    if (q->tool_choice == K3_CHAT_TOOLS_REQUIRED) {
        k3_strbuf_str(&b, "The system is invoked with `tool_choice=required`.\n"
                          "You MUST call tools in the next message.");
    } else {
        k3_strbuf_str(&b, "The system is invoked with a forced tool choice.\n"
                          "You MUST call the tool `");
        k3_strbuf_str(&b, q->tool_choice_name);
        k3_strbuf_str(&b, "` in the next message.");
    }
    attr a = {"type", "tool-choice", 1};
    k3_status st = r_message(r, "system", &a, 1, b.p);
    free(b.p);
    return st;
}

static int ends_in_space(const char *s) {
    size_t n = s ? strlen(s) : 0;
    return n && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\n' || s[n - 1] == '\r');
}

/* Order (2.2-2.4): BOS, the tool declaration, the messages (consecutive tool
 * results as one re-sorted run), the tool-choice message, then either the
 * open continuation turn or the generation prompt. Validation runs before
 * anything is emitted; on error out is freed and the message names the
 * offending message / call. */
k3_status k3_chat_render(const k3_tok *tok, const k3_chat_req *q, k3_chat_out *out, char *err,
                         size_t errlen) {
    memset(out, 0, sizeof *out);
    rctx r;
    k3_status st = r_init(&r, tok, out, err, errlen);
    if (st != K3_OK) return st;
    st = validate(q, err, errlen);
    if (st != K3_OK) return st;
    const k3_chat_msg *last = q->n_msgs ? &q->msgs[q->n_msgs - 1] : NULL;
    int cont = !q->add_generation_prompt && last && is_role(last->role, "assistant");
    if (cont && last->n_tool_calls)
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "message %d: cannot continue an assistant turn that has tool_calls",
                       q->n_msgs - 1);
    if (cont && ends_in_space(last->content))
        return k3_errf(K3_ERR_ARG, err, errlen,
                       "message %d: a continued assistant turn must not end in whitespace",
                       q->n_msgs - 1);
    char *body = NULL;
    st = tools_body(q, &body, err, errlen);
    if (st != K3_OK) return st;

    k3_strbuf_add(&r.text, "", 0);
    int32_t bos = k3_tok_bos(tok);
    if (!q->no_bos && bos >= 0) r_marker(&r, bos);
    if (body) {
        attr a = {"type", "tool-declare", 1};
        st = r_message(&r, "system", &a, 1, body);
    }
    int n_closed = cont ? q->n_msgs - 1 : q->n_msgs;
    for (int i = 0; i < n_closed && st == K3_OK;) {
        const k3_chat_msg *m = &q->msgs[i];
        if (is_role(m->role, "tool")) {
            int j = i;
            while (j < n_closed && is_role(q->msgs[j].role, "tool")) j++;
            st = r_results(&r, q, i, j);
            i = j;
            continue;
        }
        if (is_role(m->role, "assistant"))
            st = r_assistant(&r, m, i, q->enable_thinking);
        else
            st = r_message(&r, is_role(m->role, "user") ? "user" : "system", NULL, 0,
                           m->content); /* developer renders as system */
        i++;
    }
    if (st == K3_OK) st = r_choice(&r, q);
    attr asst = {"role", "assistant", 0};
    if (st == K3_OK && cont) {
        /* 2.4: open turn, think only if there is reasoning, no close tags */
        st = r_open(&r, "message", &asst, 1);
        if (st == K3_OK && last->reasoning_content && *last->reasoning_content)
            st = r_block(&r, "think", last->reasoning_content);
        if (st == K3_OK) st = r_open(&r, "response", NULL, 0);
        if (st == K3_OK) st = r_str(&r, last->content);
        out->continuation = 1;
        out->channel = K3_CHAT_CH_RESPONSE;
    } else if (st == K3_OK && q->add_generation_prompt) {
        st = r_open(&r, "message", &asst, 1);
        if (st == K3_OK) st = r_open(&r, q->enable_thinking ? "think" : "response", NULL, 0);
        out->channel = q->enable_thinking ? K3_CHAT_CH_THINK : K3_CHAT_CH_RESPONSE;
    }
    free(body);
    out->text = r.text.p;
    out->text_len = r.text.n;
    if (st != K3_OK) k3_chat_out_free(out);
    return st;
}

void k3_chat_out_free(k3_chat_out *out) {
    if (!out) return;
    k3_tok_ids_free(&out->ids);
    free(out->text);
    out->text = NULL;
    out->text_len = 0;
}

k3_status k3_chat_close_turn(const k3_tok *tok, k3_chat_channel ch, k3_tok_ids *ids, char *err,
                             size_t errlen) {
    k3_chat_out out;
    memset(&out, 0, sizeof out);
    rctx r;
    k3_status st = r_init(&r, tok, &out, err, errlen);
    if (st != K3_OK) return st;
    if (ch == K3_CHAT_CH_THINK) {
        st = r_close(&r, "think");
        if (st == K3_OK) st = r_open(&r, "response", NULL, 0);
    }
    if (st == K3_OK) st = r_close(&r, "response");
    if (st == K3_OK) st = r_close(&r, "message");
    if (st == K3_OK) r_marker(&r, r.eom);
    for (size_t i = 0; st == K3_OK && i < out.ids.n; i++) k3_tok_ids_push(ids, out.ids.v[i]);
    k3_tok_ids_free(&out.ids);
    free(r.text.p);
    return st;
}
