/* tests/fuzz/fuzz_tokenizer.c: libFuzzer target for common/tokenizer and the
 * chat output filter (`make fuzz`).
 *
 * The first input byte picks what the rest is:
 *   0: text, encoded untrusted; decode must give it back byte for byte
 *   1: text, encoded trusted (added tokens matched); same round trip
 *   2: little-endian int32 ids: decode, the streaming decoder (valid UTF-8
 *      at every step), and the chat filter (valid UTF-8 deltas)
 *   3: a tiktoken.model file for k3_tok_open_mem (errors are fine)
 *   4: a tokenizer_config.json for k3_tok_open_mem (errors are fine)
 *   5: split at the first NUL into a tool call's arguments and a tools
 *      array, rendered with k3_chat_render (errors are fine; an accepted
 *      render must have text == decode(ids))
 * A violated invariant aborts (a crash for libFuzzer). The tokenizer is
 * built once in memory: 256 single bytes, merges of common letter pairs and
 * words, and K3's added-token layout, so no file is needed.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/text/chat.h"
#include "common/text/tokenizer.h"

static k3_tok *g_tok;
static char *g_model, *g_config;
static size_t g_model_len, g_config_len;

static void b64(const uint8_t *p, size_t n, char *out) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        out[o++] = A[w >> 18 & 63];
        out[o++] = A[w >> 12 & 63];
        out[o++] = i + 1 < n ? A[w >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? A[w & 63] : '=';
    }
    out[o] = 0;
}

static void build(void) {
    static const char *words[] = {" the", " and", "ing",  "tion", "<|",  "|>", "open", "你好",
                                  "世界", "\r\n", "    ", "123",  "...", "'s", NULL};
    const char *letters = "etaoinshr ";
    size_t cap = 1 << 16;
    g_model = malloc(cap);
    size_t n = 0;
    int rank = 0;
    char enc[64];
    for (int b = 0; b < 256; b++, rank++) {
        uint8_t c = (uint8_t)b;
        b64(&c, 1, enc);
        n += (size_t)snprintf(g_model + n, cap - n, "%s %d\n", enc, rank);
    }
    for (int i = 0; letters[i]; i++)
        for (int j = 0; letters[j]; j++, rank++) {
            uint8_t p[2] = {(uint8_t)letters[i], (uint8_t)letters[j]};
            b64(p, 2, enc);
            n += (size_t)snprintf(g_model + n, cap - n, "%s %d\n", enc, rank);
        }
    for (int i = 0; words[i]; i++, rank++) {
        b64((const uint8_t *)words[i], strlen(words[i]), enc);
        n += (size_t)snprintf(g_model + n, cap - n, "%s %d\n", enc, rank);
    }
    g_model_len = n;
    g_config = malloc(4096);
    g_config_len = (size_t)snprintf(
        g_config, 4096,
        "{\"bos_token\": \"[BOS]\", \"added_tokens_decoder\": {\"%d\": {\"content\": \"[BOS]\"},"
        " \"%d\": {\"content\": \"[EOS]\"}, \"%d\": {\"content\": \"<|end_of_msg|>\"},"
        " \"%d\": {\"content\": \"<|open|>\"}, \"%d\": {\"content\": \"<|close|>\"},"
        " \"%d\": {\"content\": \"<|sep|>\"}, \"%d\": {\"content\": \"<|op\"}}}",
        rank, rank + 1, rank + 2, rank + 3, rank + 4, rank + 5, rank + 6);
    k3_tok_src src = {.model = g_model,
                      .model_len = g_model_len,
                      .config_json = g_config,
                      .config_len = g_config_len};
    char err[256];
    if (k3_tok_open_mem(&g_tok, &src, err, sizeof err) != K3_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", err);
        abort();
    }
}

static void check_utf8(const char *p, size_t n) {
    for (size_t i = 0; i < n;) {
        int l = k3_utf8_seq_len((const uint8_t *)p + i, n - i);
        if (!l) abort();
        i += (size_t)l;
    }
}

static void round_trip(const uint8_t *d, size_t n, int trusted) {
    k3_tok_ids ids = {0};
    char err[256];
    if (k3_tok_encode(g_tok, (const char *)d, n, trusted, &ids, err, sizeof err) != K3_OK) abort();
    if (!trusted)
        for (size_t i = 0; i < ids.n; i++)
            if (k3_tok_is_added(g_tok, ids.v[i])) abort(); /* injection */
    char *out;
    size_t ol, unk;
    if (k3_tok_decode(g_tok, ids.v, ids.n, &out, &ol, &unk, err, sizeof err) != K3_OK) abort();
    if (ol != n || unk || memcmp(out, d, n)) abort();
    free(out);
    k3_tok_ids_free(&ids);
}

static void ids_path(const uint8_t *d, size_t n) {
    size_t k = n / 4;
    int32_t *ids = malloc((k ? k : 1) * sizeof *ids);
    int32_t nv = k3_tok_n_vocab(g_tok);
    for (size_t i = 0; i < k; i++) {
        uint32_t v;
        memcpy(&v, d + 4 * i, 4);
        /* mostly valid ids, sometimes anything */
        ids[i] = (v >> 31) ? (int32_t)v : (int32_t)(v % (uint32_t)(nv + 8));
    }
    char *out, err[256];
    size_t ol;
    if (k3_tok_decode(g_tok, ids, k, &out, &ol, NULL, err, sizeof err) != K3_OK) abort();
    free(out);
    k3_tok_stream s = {0};
    size_t l;
    for (size_t i = 0; i < k; i++) check_utf8(k3_tok_stream_push(g_tok, &s, ids[i], &l), l);
    check_utf8(k3_tok_stream_flush(&s, &l), l);
    k3_tok_stream_reset(&s);
    k3_chat_filter *f = NULL;
    k3_chat_filter_opts o = {.start = (k3_chat_channel)(n & 1)};
    if (k3_chat_filter_open(&f, g_tok, &o, err, sizeof err) != K3_OK) abort();
    k3_chat_delta dl;
    for (size_t i = 0; i < k; i++) {
        k3_chat_filter_push(f, ids[i], &dl);
        check_utf8(dl.reasoning, dl.reasoning_len);
        check_utf8(dl.content, dl.content_len);
    }
    k3_chat_filter_finish(f, &dl);
    check_utf8(dl.content, dl.content_len);
    for (int i = 0; i < k3_chat_filter_n_calls(f); i++)
        if (!k3_chat_filter_call(f, i)->arguments) abort();
    k3_chat_filter_close(&f);
    free(ids);
}

static void open_path(const uint8_t *d, size_t n, int as_config) {
    k3_tok_src src = {.model = as_config ? g_model : (const char *)d,
                      .model_len = as_config ? g_model_len : n,
                      .config_json = as_config ? (const char *)d : g_config,
                      .config_len = as_config ? n : g_config_len,
                      .vocab_size = (n & 2) ? 600 : 0};
    k3_tok *t = NULL;
    char err[256];
    if (k3_tok_open_mem(&t, &src, err, sizeof err) == K3_OK) {
        k3_tok_ids ids = {0};
        if (k3_tok_encode(t, "<|open|>hi there", 16, 1, &ids, err, sizeof err) != K3_OK) abort();
        k3_tok_ids_free(&ids);
    } else if (!err[0]) {
        abort(); /* a failure must say why */
    }
    k3_tok_close(&t);
}

static void chat_path(const uint8_t *d, size_t n) {
    char *buf = malloc(n + 1);
    memcpy(buf, d, n);
    buf[n] = 0;
    size_t a = strlen(buf);
    const char *tools = a < n ? buf + a + 1 : NULL;
    k3_chat_tool_call call = {.id = "c1", .name = "f", .arguments = buf};
    k3_chat_msg m[] = {{.role = "user", .content = buf},
                       {.role = "assistant", .tool_calls = &call, .n_tool_calls = 1},
                       {.role = "tool", .tool_call_id = "c1", .content = "ok"}};
    k3_chat_req q = {.msgs = m,
                     .n_msgs = 3,
                     .tools_json = tools,
                     .enable_thinking = (int)(n & 1),
                     .add_generation_prompt = 1};
    k3_chat_out out;
    char err[256];
    if (k3_chat_render(g_tok, &q, &out, err, sizeof err) == K3_OK) {
        char *dec;
        size_t dl;
        if (k3_tok_decode(g_tok, out.ids.v, out.ids.n, &dec, &dl, NULL, err, sizeof err) != K3_OK)
            abort();
        if (dl != out.text_len || memcmp(dec, out.text, dl)) abort();
        free(dec);
        k3_chat_out_free(&out);
    } else if (!err[0]) {
        abort();
    }
    free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok) build();
    if (size == 0) return 0;
    const uint8_t *d = data + 1;
    size_t n = size - 1;
    switch (data[0] % 6) {
    case 0: round_trip(d, n, 0); break;
    case 1: round_trip(d, n, 1); break;
    case 2: ids_path(d, n); break;
    case 3: open_path(d, n, 0); break;
    case 4: open_path(d, n, 1); break;
    case 5: chat_path(d, n); break;
    }
    return 0;
}
