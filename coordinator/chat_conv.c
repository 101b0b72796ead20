/* coordinator/chat_conv.c: the chat prompt's conversation (chat_conv.h). */
#include "coordinator/chat_conv.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/limits.h"
#include "common/base/strbuf.h"
#include "coordinator/chat_prompt.h"
#include "coordinator/serve_api.h"

static void msg_free(chat_msg *m) {
    free(m->role);
    free(m->content);
    free(m->reasoning);
}

void chat_conv_drop_ids(chat_conv *c) {
    c->ids.n = 0;
    c->has_ids = 0;
    c->n_covered = 0;
    c->turn_open = 0;
    c->last_prompt.n = 0;
}

void chat_conv_free(chat_conv *c) {
    for (int i = 0; i < c->n; i++) msg_free(&c->m[i]);
    free(c->m);
    k3_tok_ids_free(&c->ids);
    k3_tok_ids_free(&c->last_prompt);
    memset(c, 0, sizeof *c);
}

void chat_conv_add(chat_conv *c, const char *role, const char *content, const char *reasoning) {
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 8;
        c->m = k3_xrealloc(c->m, (size_t)c->cap * sizeof *c->m);
    }
    chat_msg *m = &c->m[c->n++];
    m->role = k3_xstrdup(role);
    m->content = k3_xstrdup(content ? content : "");
    m->reasoning = reasoning && *reasoning ? k3_xstrdup(reasoning) : NULL;
}

void chat_conv_reset(chat_conv *c, int keep_system) {
    int keep = keep_system && c->n > 0 && !strcmp(c->m[0].role, "system") ? 1 : 0;
    for (int i = keep; i < c->n; i++) msg_free(&c->m[i]);
    c->n = keep;
    chat_conv_drop_ids(c);
}

void chat_conv_set_system(chat_conv *c, const char *text) {
    int has = c->n > 0 && !strcmp(c->m[0].role, "system");
    if (text && *text) {
        if (has) {
            free(c->m[0].content);
            c->m[0].content = k3_xstrdup(text);
        } else {
            chat_conv_add(c, "system", text, NULL); /* appended, then moved first */
            chat_msg s = c->m[c->n - 1];
            memmove(c->m + 1, c->m, (size_t)(c->n - 1) * sizeof *c->m);
            c->m[0] = s;
        }
    } else if (has) {
        msg_free(&c->m[0]);
        memmove(c->m, c->m + 1, (size_t)(c->n - 1) * sizeof *c->m);
        c->n--;
    }
    chat_conv_drop_ids(c);
}

/* Renders m[first, n) (BOS only when first == 0) with the generation
 * prompt, appending the ids to out. */
static k3_status render_tail(const chat_conv *c, int first, const k3_tok *tok, int thinking,
                             k3_tok_ids *out, k3_chat_channel *start, char *err, size_t errlen) {
    int n = c->n - first;
    k3_chat_msg *msgs = k3_xcalloc(n > 0 ? (size_t)n : 1, sizeof *msgs);
    for (int i = 0; i < n; i++) {
        const chat_msg *m = &c->m[first + i];
        msgs[i] = (k3_chat_msg){
            .role = m->role, .content = m->content, .reasoning_content = m->reasoning};
    }
    k3_chat_req cr = {.msgs = msgs,
                      .n_msgs = n,
                      .enable_thinking = thinking,
                      .add_generation_prompt = 1,
                      .no_bos = first > 0};
    k3_chat_out o;
    memset(&o, 0, sizeof o);
    int too_long;
    k3_status st = k3_chat_prompt_render(tok, &cr, &o, &too_long, err, errlen);
    free(msgs);
    if (st) return st;
    for (size_t i = 0; i < o.ids.n; i++) k3_tok_ids_push(out, o.ids.v[i]);
    *start = o.channel;
    k3_chat_out_free(&o);
    return K3_OK;
}

k3_status chat_conv_prompt(chat_conv *c, const k3_tok *tok, int thinking, k3_tok_ids *out,
                           k3_chat_channel *start, char *err, size_t errlen) {
    out->n = 0;
    k3_status st;
    if (c->has_ids && c->n_covered == c->n && c->turn_open < 0) {
        /* :retry: the prompt the dropped answer had */
        for (size_t i = 0; i < c->last_prompt.n; i++) k3_tok_ids_push(out, c->last_prompt.v[i]);
        *start = c->open_ch;
        st = K3_OK;
    } else if (c->has_ids && c->n_covered < c->n) {
        for (size_t i = 0; i < c->ids.n; i++) k3_tok_ids_push(out, c->ids.v[i]);
        st = c->turn_open > 0 ? k3_chat_close_turn(tok, c->open_ch, out, err, errlen) : K3_OK;
        if (!st) st = render_tail(c, c->n_covered, tok, thinking, out, start, err, errlen);
    } else {
        st = render_tail(c, 0, tok, thinking, out, start, err, errlen);
    }
    if (!st && out->n > (size_t)K3_MAX_CTX)
        st = k3_errf(K3_ERR_LIMIT, err, errlen,
                     "the conversation has %zu tokens, more than %d (K3_MAX_CTX): :reset", out->n,
                     K3_MAX_CTX);
    return st;
}

void chat_conv_answered(chat_conv *c, const k3_tok_ids *prompt, k3_chat_channel start,
                        const int32_t *gen, int n_gen, int stopped, k3_chat_channel ch,
                        const char *content, const char *reasoning) {
    chat_conv_add(c, "assistant", content, reasoning);
    c->last_prompt.n = 0;
    c->ids.n = 0;
    for (size_t i = 0; i < prompt->n; i++) {
        k3_tok_ids_push(&c->last_prompt, prompt->v[i]);
        k3_tok_ids_push(&c->ids, prompt->v[i]);
    }
    for (int i = 0; i < n_gen; i++) k3_tok_ids_push(&c->ids, gen[i]);
    c->has_ids = 1;
    c->n_covered = c->n;
    c->turn_open = !stopped;
    c->open_ch = ch;
    c->last_start = start;
}

k3_status chat_conv_retry(chat_conv *c, char *err, size_t errlen) {
    if (c->n == 0 || strcmp(c->m[c->n - 1].role, "assistant"))
        return k3_errf(K3_ERR_STATE, err, errlen, "no answer to retry");
    msg_free(&c->m[--c->n]);
    if (c->has_ids && c->n_covered == c->n + 1 && c->last_prompt.n) {
        c->n_covered = c->n;
        c->turn_open = -1; /* the next prompt is last_prompt as it is */
        c->open_ch = c->last_start;
    } else {
        chat_conv_drop_ids(c);
    }
    return K3_OK;
}

/* ---- save / load -------------------------------------------------------- */

k3_status chat_conv_save(const chat_conv *c, int thinking, const char *path, char *err,
                         size_t errlen) {
    json_t *ms = json_array();
    for (int i = 0; i < c->n; i++) {
        const chat_msg *m = &c->m[i];
        json_t *o = json_pack("{s:s,s:s}", "role", m->role, "content", m->content);
        if (!o) {
            json_decref(ms);
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "%s: message %d is not valid UTF-8 and cannot be saved as JSON", path,
                           i);
        }
        if (m->reasoning) json_object_set_new(o, "reasoning_content", json_string(m->reasoning));
        json_array_append_new(ms, o);
    }
    json_t *doc = json_pack("{s:o,s:b}", "messages", ms, "enable_thinking", thinking);
    if (c->has_ids && c->n_covered == c->n && c->turn_open >= 0) {
        /* the session's ids, so a :load continues from exactly the same
         * prompt (the HTTP API ignores these fields) */
        json_t *ids = json_array();
        for (size_t i = 0; i < c->ids.n; i++) json_array_append_new(ids, json_integer(c->ids.v[i]));
        json_object_set_new(doc, "k3shard_ids", ids);
        json_object_set_new(doc, "k3shard_open", json_integer(c->turn_open));
        json_object_set_new(doc, "k3shard_channel", json_integer((int)c->open_ch));
    }
    int rc = json_dump_file(doc, path, JSON_INDENT(2));
    json_decref(doc);
    if (rc) return k3_errf(K3_ERR_IO, err, errlen, "%s: cannot write: %s", path, strerror(errno));
    return K3_OK;
}

/* k3shard_ids of a saved conversation: kept when every id is below vocab
 * and there are at most K3_MAX_CTX; anything else (a file edited by hand,
 * another model) is ignored and the conversation is rendered whole. */
static void load_ids(chat_conv *c, json_t *doc, int vocab) {
    json_t *ids = json_object_get(doc, "k3shard_ids");
    json_t *open = json_object_get(doc, "k3shard_open");
    json_t *ch = json_object_get(doc, "k3shard_channel");
    if (!json_is_array(ids) || json_array_size(ids) == 0 ||
        json_array_size(ids) > (size_t)K3_MAX_CTX || !json_is_integer(open) || !json_is_integer(ch))
        return;
    size_t i;
    json_t *v;
    json_array_foreach(ids, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= vocab) {
            c->ids.n = 0;
            return;
        }
        k3_tok_ids_push(&c->ids, (int32_t)json_integer_value(v));
    }
    c->has_ids = 1;
    c->n_covered = c->n;
    c->turn_open = json_integer_value(open) != 0;
    c->open_ch =
        json_integer_value(ch) == K3_CHAT_CH_THINK ? K3_CHAT_CH_THINK : K3_CHAT_CH_RESPONSE;
}

k3_status chat_conv_load(chat_conv *c, const char *path, int vocab, int *thinking, char *err,
                         size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f) return k3_errf(K3_ERR_IO, err, errlen, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) || sb.st_size > (off_t)K3_SERVE_MAX_BODY) {
        long long sz = (long long)sb.st_size;
        fclose(f);
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "%s: %lld bytes, more than %u (K3_SERVE_MAX_BODY, a request body)", path, sz,
                       K3_SERVE_MAX_BODY);
    }
    k3_strbuf b = {0};
    k3_strbuf_str(&b, "{\"messages\":");
    size_t head = b.n;
    char buf[65536];
    size_t k;
    while ((k = fread(buf, 1, sizeof buf, f)) > 0 && b.n <= K3_SERVE_MAX_BODY + head)
        k3_strbuf_add(&b, buf, k);
    fclose(f);
    /* a bare array is wrapped into {"messages": ...}; an object is used as it is */
    size_t i = head;
    while (i < b.n && (b.p[i] == ' ' || b.p[i] == '\n' || b.p[i] == '\r' || b.p[i] == '\t')) i++;
    const char *body = b.p;
    size_t len = b.n;
    if (i < b.n && b.p[i] == '[')
        k3_strbuf_add(&b, "}", 1), body = b.p, len = b.n;
    else
        body = b.p + head, len = b.n - head;
    serve_req r;
    serve_err e;
    k3_status st = K3_OK;
    if (!serve_req_parse(&r, 1, body, len, &e)) {
        st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s: %s", path, e.message);
    } else {
        for (int m = 0; m < r.n_msgs && !st; m++)
            if (r.msgs[m].n_tool_calls || !strcmp(r.msgs[m].role, "tool"))
                st = k3_errf(K3_ERR_ARG, err, errlen,
                             "%s: messages[%d]: tool calls and tool results are not supported "
                             "by the chat prompt (use the HTTP API)",
                             path, m);
        if (!st) {
            chat_conv_reset(c, 0);
            for (int m = 0; m < r.n_msgs; m++) {
                const k3_chat_msg *cm = &r.msgs[m];
                chat_conv_add(c, !strcmp(cm->role, "developer") ? "system" : cm->role, cm->content,
                              cm->reasoning_content);
            }
            json_t *t = json_object_get((json_t *)r.json, "enable_thinking");
            if (json_is_boolean(t)) *thinking = json_is_true(t);
            load_ids(c, (json_t *)r.json, vocab);
        }
    }
    serve_req_free(&r);
    free(b.p);
    return st;
}
