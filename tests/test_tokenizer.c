/* tests/test_tokenizer.c: the tokenizer's own contract (common/text/tokenizer.h).
 *
 * Run without arguments it checks: file-format errors (missing files, bad
 * base64, duplicate rank, rank gaps, duplicate tokens, ids beyond the added
 * block or vocab_size), hand-derived rank-BPE results (lowest rank first,
 * leftmost on ties, whole-piece fast path), the heap BPE against a naive
 * quadratic replay of tiktoken's loop, trusted vs untrusted added tokens,
 * invalid UTF-8, the streaming decoder, the Han-free class rewrite on every
 * code point, and the speed of 1 MB whitespace-free inputs. With the tiny
 * checkpoint present it also checks its added-token ids.
 *
 * Driver mode for tests/integration/test_tiktoken.sh:
 *   test_tokenizer --ctest MODEL kimi|o200k CASES OUT
 * encodes every case of CASES (u32 count, then u32 length + bytes each),
 * writes one line of ids per case to OUT, and prints the round-trip, stream
 * and timing results as ok / not ok lines.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/base/limits.h"
#include "common/text/tokenizer.h"
#include "coordinator/cmd_tokenize.h"
#include "tests/test.h"

static char g_tmp[256];

/* Time limits hold for the release build; sanitized builds (make asan /
 * ubsan / tsan) run several times slower, so their limit is 10x. Compilers
 * announce ASan and TSan; UBSan only through K3_SANITIZE_UNDEFINED, which
 * make ubsan defines (under UBSan, 1 MiB of 'a' took 1.2-1.6 s on the shared
 * 2-core VM, 0.57 s without). */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(K3_SANITIZE_UNDEFINED)
#define T_SLOWDOWN 10.0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define T_SLOWDOWN 10.0
#endif
#endif
#ifndef T_SLOWDOWN
#define T_SLOWDOWN 1.0
#endif

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- helpers to write small tokenizers -------------------------------------- */

static void b64(const uint8_t *p, size_t n, char *out) {
    static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16;
        if (i + 1 < n) w |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n) w |= p[i + 2];
        out[o++] = A[w >> 18 & 63];
        out[o++] = A[w >> 12 & 63];
        out[o++] = i + 1 < n ? A[w >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? A[w & 63] : '=';
    }
    out[o] = 0;
}

/* A growable string. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* tiktoken.model text: the 256 bytes (rank = byte value), then extra tokens
 * (NULL-terminated list) at ranks 256.. */
static char *model_text(const char *const *extra) {
    sbuf b = {0};
    char line[4200], enc[4100];
    for (int i = 0; i < 256; i++) {
        uint8_t c = (uint8_t)i;
        b64(&c, 1, enc);
        snprintf(line, sizeof line, "%s %d\n", enc, i);
        sb_str(&b, line);
    }
    for (int i = 0; extra && extra[i]; i++) {
        b64((const uint8_t *)extra[i], strlen(extra[i]), enc);
        snprintf(line, sizeof line, "%s %d\n", enc, 256 + i);
        sb_str(&b, line);
    }
    return b.p;
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[1100];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(2);
    }
    fwrite(text, 1, strlen(text), f);
    fclose(f);
}

static const char *CONFIG_OK = "{\"bos_token\": \"[BOS]\", \"eos_token\": {\"content\": \"[EOS]\"},"
                               " \"added_tokens_decoder\": {"
                               " \"%d\": {\"content\": \"[BOS]\", \"special\": true},"
                               " \"%d\": {\"content\": \"[EOS]\", \"special\": true},"
                               " \"%d\": {\"content\": \"<|end_of_msg|>\", \"special\": true},"
                               " \"%d\": {\"content\": \"<|open|>\", \"special\": true},"
                               " \"%d\": {\"content\": \"<|close|>\", \"special\": true},"
                               " \"%d\": {\"content\": \"<|sep|>\", \"special\": true},"
                               " \"%d\": {\"content\": \"<|op\", \"special\": false},"
                               " \"%d\": {\"content\": \"<|open|>x\", \"special\": true}}}";

static char *config_text(int base) {
    char *s = malloc(2048);
    snprintf(s, 2048, CONFIG_OK, base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6,
             base + 7);
    return s;
}

/* Writes a checkpoint-like dir with the given model/config (NULL = omit). */
static const char *make_dir(const char *name, const char *model, const char *config) {
    static char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_tmp, name);
    mkdir(dir, 0755);
    if (model) write_file(dir, "tiktoken.model", model);
    if (config) write_file(dir, "tokenizer_config.json", config);
    return dir;
}

/* Opens DIR and checks it fails with status want and a message containing
 * every needle. */
static void expect_open_fail(const char *what, const char *dir, int64_t vocab, k3_status want,
                             const char *needle1, const char *needle2) {
    k3_tok *t = NULL;
    char err[512] = "";
    k3_status st = k3_tok_open_dir(&t, dir, vocab, err, sizeof err);
    int ok = st == want && !t && strstr(err, needle1) && (!needle2 || strstr(err, needle2));
    CHECK(ok, "open fails on %s: [%s] %s", what, k3_status_name(st), err);
    k3_tok_close(&t);
}

/* ---- file-format errors ------------------------------------------------------- */

static void test_file_errors(void) {
    const char *extra[] = {"ab", "cd", NULL};
    char *model = model_text(extra);
    char *config = config_text(258);

    expect_open_fail("missing tiktoken.model", make_dir("nomodel", NULL, config), 0, K3_ERR_MISSING,
                     "tiktoken.model", "cannot open");
    expect_open_fail("missing tokenizer_config.json", make_dir("noconfig", model, NULL), 0,
                     K3_ERR_MISSING, "tokenizer_config.json", "cannot open");

    /* bad base64: a '*' inside the token */
    sbuf b = {0};
    sb_str(&b, model);
    sb_str(&b, "Y*Jj 258\n");
    expect_open_fail("bad base64", make_dir("badb64", b.p, config), 0, K3_ERR_FORMAT, "bad base64",
                     "line 259");
    free(b.p);
    /* bad base64: length not a multiple of 4 */
    b = (sbuf){0};
    sb_str(&b, model);
    sb_str(&b, "YWJ 258\n");
    expect_open_fail("unpadded base64", make_dir("badb64b", b.p, config), 0, K3_ERR_FORMAT,
                     "bad base64", NULL);
    free(b.p);
    /* duplicate rank */
    b = (sbuf){0};
    sb_str(&b, model);
    sb_str(&b, "eHl6 257\n");
    expect_open_fail("duplicate rank", make_dir("duprank", b.p, config), 0, K3_ERR_FORMAT,
                     "duplicate rank 257", "line 259");
    free(b.p);
    /* rank gap: 259 entries, one with rank 300 */
    b = (sbuf){0};
    sb_str(&b, model);
    sb_str(&b, "eHl6 300\n");
    expect_open_fail("rank gap", make_dir("gap", b.p, config), 0, K3_ERR_FORMAT, "gap", "rank 300");
    free(b.p);
    /* duplicate token bytes under two ranks */
    b = (sbuf){0};
    sb_str(&b, model);
    sb_str(&b, "YWI= 258\n");
    expect_open_fail("duplicate token bytes", make_dir("duptok", b.p, config), 0, K3_ERR_FORMAT,
                     "same", "256");
    free(b.p);
    /* rank that is not a number */
    b = (sbuf){0};
    sb_str(&b, model);
    sb_str(&b, "eHl6 25x\n");
    expect_open_fail("non-numeric rank", make_dir("badrank", b.p, config), 0, K3_ERR_FORMAT,
                     "not a decimal", NULL);
    free(b.p);
    /* a single byte missing: drop the line of byte 0x41 */
    b = (sbuf){0};
    char *line = strstr(model, "QQ== 65\n");
    sb_add(&b, model, (size_t)(line - model));
    sb_str(&b, "YWJj 65\n"); /* "abc" takes rank 65 */
    sb_str(&b, line + strlen("QQ== 65\n"));
    expect_open_fail("missing single byte", make_dir("nobyte", b.p, config), 0, K3_ERR_FORMAT,
                     "0x41", "no rank");
    free(b.p);

    /* added ids inside the ranks, beyond the 256 slots, beyond vocab_size */
    expect_open_fail("added id inside the rank table",
                     make_dir("addlow", model,
                              "{\"added_tokens_decoder\": {\"100\": "
                              "{\"content\": \"<|x|>\"}}}"),
                     0, K3_ERR_FORMAT, "100", "inside the rank table");
    expect_open_fail("added id beyond the 256 slots",
                     make_dir("addhigh", model,
                              "{\"added_tokens_decoder\": {\"514\": "
                              "{\"content\": \"<|x|>\"}}}"),
                     0, K3_ERR_LIMIT, "514", "beyond the 256 added slots");
    expect_open_fail("vocab_size below ranks + 256", make_dir("vocab", model, config), 400,
                     K3_ERR_LIMIT, "vocab_size 400", "258 ranks");
    expect_open_fail("invalid JSON config", make_dir("badjson", model, "{\"added\": "), 0,
                     K3_ERR_FORMAT, "invalid JSON", NULL);
    expect_open_fail("no added_tokens_decoder", make_dir("nodec", model, "{}"), 0, K3_ERR_MISSING,
                     "added_tokens_decoder", NULL);
    expect_open_fail("duplicate added content",
                     make_dir("dupadd", model,
                              "{\"added_tokens_decoder\": {\"258\": {\"content\": \"<|a|>\"},"
                              " \"259\": {\"content\": \"<|a|>\"}}}"),
                     0, K3_ERR_FORMAT, "same content", NULL);
    expect_open_fail("empty file", make_dir("empty", "", config), 0, K3_ERR_FORMAT, "no entries",
                     NULL);

    /* A good dir opens, fills gaps, and knows its specials. */
    k3_tok *t = NULL;
    char err[512] = "";
    k3_status st = k3_tok_open_dir(&t, make_dir("good", model, config), 514, err, sizeof err);
    CHECK(st == K3_OK, "good tokenizer dir opens with vocab_size 514: %s", err);
    if (t) {
        CHECK(k3_tok_n_ranks(t) == 258 && k3_tok_n_vocab(t) == 514,
              "258 ranks + 256 added = 514 ids (%d, %d)", k3_tok_n_ranks(t), k3_tok_n_vocab(t));
        CHECK(k3_tok_bos(t) == 258 && k3_tok_eos(t) == 259, "bos 258 eos 259 (%d %d)",
              k3_tok_bos(t), k3_tok_eos(t));
        CHECK(k3_tok_special_id(t, "<|open|>") == 261 && k3_tok_special_id(t, "<|sep|>") == 263 &&
                  k3_tok_special_id(t, "<|end_of_msg|>") == 260 &&
                  k3_tok_special_id(t, "<|nope|>") == -1,
              "special ids by content");
        size_t len;
        const uint8_t *p = k3_tok_token_bytes(t, 300, &len);
        CHECK(p && len == strlen("<|reserved_token_300|>") &&
                  !memcmp(p, "<|reserved_token_300|>", len),
              "gap id 300 decodes to <|reserved_token_300|>");
        CHECK(k3_tok_special_id(t, "<|reserved_token_513|>") == 513, "last filler is id 513");
    }
    k3_tok_close(&t);
    CHECK(t == NULL, "k3_tok_close nulls the pointer");
    k3_tok_close(&t); /* NULL is fine */
    free(model);
    free(config);
}

/* ---- hand-derived BPE ------------------------------------------------------------ */

static k3_tok *open_small(const char *const *extra, k3_tok_pattern pat, int with_config) {
    char *model = model_text(extra);
    int n = 256;
    while (extra && extra[n - 256]) n++;
    char *config = with_config ? config_text(n) : NULL;
    k3_tok_src src = {.model = model,
                      .model_len = strlen(model),
                      .config_json = config,
                      .config_len = config ? strlen(config) : 0,
                      .pattern = pat};
    k3_tok *t = NULL;
    char err[512] = "";
    if (k3_tok_open_mem(&t, &src, err, sizeof err) != K3_OK)
        printf("# open_small failed: %s\n", err);
    free(model);
    free(config);
    return t;
}

static int ids_eq(const k3_tok_ids *ids, const int32_t *want, size_t n) {
    return ids->n == n && (n == 0 || !memcmp(ids->v, want, n * sizeof *want));
}

static void show_ids(const char *label, const k3_tok_ids *ids) {
    printf("# %s:", label);
    for (size_t i = 0; i < ids->n && i < 40; i++) printf(" %d", ids->v[i]);
    printf("\n");
}

/* Encodes s (untrusted unless trusted) and compares with want. */
static void expect_enc(k3_tok *t, const char *s, int trusted, const int32_t *want, size_t n,
                       const char *what) {
    k3_tok_ids ids = {0};
    char err[256] = "";
    k3_status st = k3_tok_encode(t, s, strlen(s), trusted, &ids, err, sizeof err);
    int ok = st == K3_OK && ids_eq(&ids, want, n);
    CHECK(ok, "%s", what);
    if (!ok) show_ids("got", &ids);
    k3_tok_ids_free(&ids);
}

static void test_bpe_hand(void) {
    /* ranks: 256 "he", 257 "ll", 258 "hell", 259 "aa", 260 "xyz",
     * 261 " w", 262 "or", 263 " wor", 264 "ld", 265 "ab", 266 "bc" */
    const char *extra[] = {"he", "ll",   "hell", "aa", "xyz", " w",
                           "or", " wor", "ld",   "ab", "bc",  NULL};
    k3_tok *t = open_small(extra, K3_TOK_PATTERN_KIMI, 0);
    if (!t) {
        CHECK(0, "small tokenizer opens");
        return;
    }
    /* "hello": he(256) < ll(257): he|l|l|o -> he|ll|o -> hell|o (258) */
    expect_enc(t, "hello", 0, (const int32_t[]){258, 'o'}, 2,
               "hello -> [hell][o]: lowest rank merges first");
    /* "aaa": both pairs are aa(259); the leftmost wins -> [aa][a] */
    expect_enc(t, "aaa", 0, (const int32_t[]){259, 'a'}, 2, "aaa -> [aa][a]: leftmost on ties");
    expect_enc(t, "aaaa", 0, (const int32_t[]){259, 259}, 2, "aaaa -> [aa][aa]");
    /* "xyz" has no ranked pair, but the whole piece is rank 260 */
    expect_enc(t, "xyz", 0, (const int32_t[]){260}, 1, "xyz -> 260 by the whole-piece path");
    /* "abc": ab(265) < bc(266) -> [ab][c] */
    expect_enc(t, "abc", 0, (const int32_t[]){265, 'c'}, 2, "abc -> [ab][c]");
    /* pre-tokenizer: "hello world" -> "hello" " world"; " world": " w"(261)
     * or(262) ld(264) -> " w|or|ld" -> " wor"(263)|ld */
    expect_enc(t, "hello world", 0, (const int32_t[]){258, 'o', 263, 264}, 4,
               "hello world -> hell o | wor ld");
    /* numbers split in threes, CRLF kept with the punctuation run */
    expect_enc(t, "12345", 0, (const int32_t[]){'1', '2', '3', '4', '5'}, 5,
               "12345 -> single bytes (no merges ranked)");
    expect_enc(t, "", 0, NULL, 0, "empty text -> no ids");
    k3_tok_close(&t);
}

/* ---- heap BPE vs a naive replay of tiktoken's loop ----------------------------- */

/* Naive rank lookup over the extra-token table of the random vocab. */
typedef struct vocab {
    char **tok; /* [n] */
    int n;
} vocab;

static int naive_rank(const vocab *v, const uint8_t *p, size_t n) {
    if (n == 1) return p[0];
    for (int i = 0; i < v->n; i++)
        if (strlen(v->tok[i]) == n && !memcmp(v->tok[i], p, n)) return 256 + i;
    return -1;
}

/* tiktoken's _byte_pair_merge, quadratic, written from docs/INTERFACES.md 1.4. */
static void naive_bpe(const vocab *v, const uint8_t *p, size_t n, k3_tok_ids *out) {
    int whole = naive_rank(v, p, n);
    if (whole >= 0) {
        k3_tok_ids_push(out, whole);
        return;
    }
    size_t *start = malloc((n + 1) * sizeof *start), m = n + 1;
    for (size_t i = 0; i <= n; i++) start[i] = i;
    for (;;) {
        int best = -1;
        size_t bi = 0;
        for (size_t i = 0; i + 2 < m; i++) {
            int r = naive_rank(v, p + start[i], start[i + 2] - start[i]);
            if (r >= 0 && (best < 0 || r < best)) best = r, bi = i;
        }
        if (best < 0) break;
        memmove(start + bi + 1, start + bi + 2, (m - bi - 2) * sizeof *start);
        m--;
    }
    for (size_t i = 0; i + 1 < m; i++)
        k3_tok_ids_push(out, naive_rank(v, p + start[i], start[i + 1] - start[i]));
    free(start);
}

static void test_bpe_random(void) {
    /* A random vocab over a 4-letter alphabet (every merge path is dense),
     * then random whitespace-free strings: one piece each, so the C encode
     * must equal the naive BPE of the whole string. */
    srand(12345);
    vocab v = {0};
    v.tok = calloc(600, sizeof *v.tok);
    while (v.n < 600) {
        int len = 2 + rand() % 6;
        char *s = calloc((size_t)len + 1, 1);
        for (int i = 0; i < len; i++) s[i] = "abcd"[rand() % 4];
        int dup = 0;
        for (int i = 0; i < v.n; i++) dup |= !strcmp(v.tok[i], s);
        if (dup) {
            free(s);
            continue;
        }
        v.tok[v.n++] = s;
    }
    const char **extra = calloc((size_t)v.n + 1, sizeof *extra);
    for (int i = 0; i < v.n; i++) extra[i] = v.tok[i];
    k3_tok *t = open_small(extra, K3_TOK_PATTERN_KIMI, 0);
    int bad = 0, cases = 0;
    for (int c = 0; t && c < 400; c++) {
        size_t n = 1 + (size_t)(rand() % (c < 300 ? 40 : 400));
        char *s = malloc(n + 1);
        for (size_t i = 0; i < n; i++) s[i] = "abcd"[rand() % 4];
        s[n] = 0;
        k3_tok_ids a = {0}, b = {0};
        char err[256];
        k3_tok_encode(t, s, n, 0, &a, err, sizeof err);
        naive_bpe(&v, (const uint8_t *)s, n, &b);
        if (!(a.n == b.n && !memcmp(a.v, b.v, a.n * sizeof *a.v))) {
            if (!bad) {
                printf("# mismatch on \"%s\"\n", s);
                show_ids("heap", &a);
                show_ids("naive", &b);
            }
            bad++;
        }
        cases++;
        k3_tok_ids_free(&a);
        k3_tok_ids_free(&b);
        free(s);
    }
    CHECK(t && bad == 0, "heap BPE == naive tiktoken loop on %d random pieces (%d differ)", cases,
          bad);
    k3_tok_close(&t);
    for (int i = 0; i < v.n; i++) free(v.tok[i]);
    free(v.tok);
    free(extra);
}

/* ---- trusted vs untrusted, invalid UTF-8, decode ----------------------------------- */

static void test_specials(void) {
    k3_tok *t = open_small(NULL, K3_TOK_PATTERN_KIMI, 1);
    if (!t) {
        CHECK(0, "tokenizer with added tokens opens");
        return;
    }
    const char *s = "hi<|open|>message role=\"system\"<|sep|>x";
    k3_tok_ids u = {0}, tr = {0};
    char err[256];
    k3_tok_encode(t, s, strlen(s), 0, &u, err, sizeof err);
    k3_tok_encode(t, s, strlen(s), 1, &tr, err, sizeof err);
    int n_added = 0;
    for (size_t i = 0; i < u.n; i++) n_added += k3_tok_is_added(t, u.v[i]);
    CHECK(n_added == 0, "untrusted: <|open|> and <|sep|> typed by a user are plain text");
    int open_id = k3_tok_special_id(t, "<|open|>"), sep_id = k3_tok_special_id(t, "<|sep|>");
    int has_open = 0, has_sep = 0;
    for (size_t i = 0; i < tr.n; i++) has_open += tr.v[i] == open_id, has_sep += tr.v[i] == sep_id;
    CHECK(has_open == 1 && has_sep == 1, "trusted: <|open|> and <|sep|> become their ids");
    /* the text between markers is encoded as if alone */
    k3_tok_ids mid = {0};
    const char *m = "message role=\"system\"";
    k3_tok_encode(t, m, strlen(m), 0, &mid, err, sizeof err);
    size_t at = 0;
    while (at < tr.n && tr.v[at] != open_id) at++;
    CHECK(at + 1 + mid.n < tr.n && !memcmp(tr.v + at + 1, mid.v, mid.n * sizeof *mid.v) &&
              tr.v[at + 1 + mid.n] == sep_id,
          "trusted: text between markers encodes like a separate piece");
    /* decode of either gives the text back */
    char *out;
    size_t ol, unk;
    k3_tok_decode(t, u.v, u.n, &out, &ol, &unk, err, sizeof err);
    CHECK(ol == strlen(s) && !memcmp(out, s, ol) && unk == 0, "untrusted ids decode back");
    free(out);
    k3_tok_decode(t, tr.v, tr.n, &out, &ol, &unk, err, sizeof err);
    CHECK(ol == strlen(s) && !memcmp(out, s, ol), "trusted ids decode back");
    free(out);
    k3_tok_ids_free(&u);
    k3_tok_ids_free(&tr);
    k3_tok_ids_free(&mid);

    /* longest content at the earliest position: "<|open|>x" beats "<|open|>"
     * and "<|op" */
    k3_tok_ids a = {0};
    k3_tok_encode(t, "<|open|>x<|op", 13, 1, &a, err, sizeof err);
    int want_a[] = {k3_tok_special_id(t, "<|open|>x"), k3_tok_special_id(t, "<|op")};
    CHECK(a.n == 2 && a.v[0] == want_a[0] && a.v[1] == want_a[1],
          "trusted: longest added content wins at one position");
    k3_tok_ids_free(&a);

    /* unknown ids are skipped and counted */
    int32_t ids[] = {'a', 999999, -5, 'b'};
    k3_tok_decode(t, ids, 4, &out, &ol, &unk, err, sizeof err);
    CHECK(ol == 2 && !memcmp(out, "ab", 2) && unk == 2, "decode skips 2 unknown ids");
    free(out);
    k3_tok_close(&t);
}

static void test_invalid_utf8(void) {
    const char *extra[] = {"ab", "\xe4\xb8", "\xff\xfe", "a\xff", NULL};
    k3_tok *t = open_small(extra, K3_TOK_PATTERN_KIMI, 1);
    if (!t) {
        CHECK(0, "tokenizer opens");
        return;
    }
    char err[256];
    /* every invalid byte is its own piece: "\xff\xfe" never merges (rank 258),
     * nor "a\xff" (259), nor the truncated "\xe4\xb8" (257) */
    const char s[] = "ab\xff\xfe"
                     "a\xff\xe4\xb8"
                     "ab";
    k3_tok_ids ids = {0};
    k3_status st = k3_tok_encode(t, s, sizeof s - 1, 0, &ids, err, sizeof err);
    const int32_t want[] = {256, 0xff, 0xfe, 'a', 0xff, 0xe4, 0xb8, 256};
    CHECK(st == K3_OK && ids_eq(&ids, want, 8), "invalid bytes are single units");
    if (!ids_eq(&ids, want, 8)) show_ids("got", &ids);
    char *out;
    size_t ol;
    k3_tok_decode(t, ids.v, ids.n, &out, &ol, NULL, err, sizeof err);
    CHECK(ol == sizeof s - 1 && !memcmp(out, s, ol), "invalid bytes round-trip");
    free(out);
    k3_tok_ids_free(&ids);

    /* every byte string of length 1..3 encodes and round-trips */
    int bad = 0;
    for (uint32_t v = 0; v < (1u << 24); v += 4099) {
        uint8_t b[3] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16)};
        for (size_t n = 1; n <= 3; n++) {
            k3_tok_ids x = {0};
            if (k3_tok_encode(t, (const char *)b, n, 0, &x, err, sizeof err) != K3_OK) bad++;
            k3_tok_decode(t, x.v, x.n, &out, &ol, NULL, err, sizeof err);
            if (ol != n || memcmp(out, b, n)) bad++;
            free(out);
            k3_tok_ids_free(&x);
        }
    }
    CHECK(bad == 0, "short byte strings (valid or not) round-trip (%d bad)", bad);
    k3_tok_close(&t);
}

/* ---- streaming decoder ------------------------------------------------------------------ */

static int valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        int l = k3_utf8_seq_len((const uint8_t *)s + i, n - i);
        if (!l) return 0;
        i += (size_t)l;
    }
    return 1;
}

/* Feeds bytes one at a time through a fresh stream; returns the output. */
static char *stream_all(const char *in, size_t n, size_t *out_n) {
    k3_tok_stream s = {0};
    sbuf o = {0};
    sb_add(&o, "", 0);
    size_t l;
    for (size_t i = 0; i < n; i++) {
        const char *p = k3_tok_stream_bytes(&s, (const uint8_t *)in + i, 1, &l);
        sb_add(&o, p, l);
    }
    const char *p = k3_tok_stream_flush(&s, &l);
    sb_add(&o, p, l);
    k3_tok_stream_reset(&s);
    *out_n = o.n;
    return o.p;
}

static void test_stream(void) {
    k3_tok *t = open_small(NULL, K3_TOK_PATTERN_KIMI, 1);
    if (!t) return;
    k3_tok_stream s = {0};
    size_t l;
    /* "€" = E2 82 AC as three byte tokens: nothing, nothing, then all three */
    const char *p = k3_tok_stream_push(t, &s, 0xE2, &l);
    int ok = l == 0;
    p = k3_tok_stream_push(t, &s, 0x82, &l);
    ok &= l == 0;
    p = k3_tok_stream_push(t, &s, 0xAC, &l);
    ok &= l == 3 && !memcmp(p, "\xe2\x82\xac", 3);
    CHECK(ok, "stream holds back a split UTF-8 sequence until complete");
    p = k3_tok_stream_push(t, &s, k3_tok_special_id(t, "<|sep|>"), &l);
    CHECK(l == 7 && !memcmp(p, "<|sep|>", 7), "stream passes added tokens as their content");
    p = k3_tok_stream_push(t, &s, 0xE4, &l);
    p = k3_tok_stream_push(t, &s, 'A', &l);
    CHECK(l == 4 && !memcmp(p,
                            "\xef\xbf\xbd"
                            "A",
                            4),
          "a broken sequence becomes U+FFFD, the next byte survives");
    p = k3_tok_stream_push(t, &s, 0xF0, &l);
    p = k3_tok_stream_push(t, &s, 0x9F, &l);
    p = k3_tok_stream_flush(&s, &l);
    CHECK(l == 3 && !memcmp(p, "\xef\xbf\xbd", 3), "flush turns a held-back tail into U+FFFD");
    k3_tok_stream_reset(&s);

    /* Random byte soup: output always valid; valid input passes unchanged. */
    srand(777);
    int bad_valid = 0, bad_same = 0;
    for (int c = 0; c < 2000; c++) {
        char in[64];
        size_t n = (size_t)(rand() % 64);
        for (size_t i = 0; i < n; i++) {
            int r = rand() % 10;
            in[i] = r < 4 ? (char)(0x20 + rand() % 90) : (char)(0x80 + rand() % 128);
        }
        size_t on;
        char *o = stream_all(in, n, &on);
        bad_valid += !valid_utf8(o, on);
        if (valid_utf8(in, n)) bad_same += on != n || memcmp(o, in, n);
        free(o);
    }
    CHECK(bad_valid == 0 && bad_same == 0,
          "stream output valid on 2000 random byte strings (%d invalid, %d changed)", bad_valid,
          bad_same);
    /* surrogates and overlongs are replaced, U+10FFFF passes */
    size_t on;
    char *o = stream_all("\xed\xa0\x80|\xc0\xaf|\xf4\x8f\xbf\xbf", 11, &on);
    CHECK(on == 3 * 3 + 1 + 3 * 2 + 1 + 4 && valid_utf8(o, on) &&
              !memcmp(o + on - 4, "\xf4\x8f\xbf\xbf", 4),
          "surrogate and overlong bytes replaced, U+10FFFF kept (%zu bytes)", on);
    free(o);
    k3_tok_close(&t);
}

/* ---- the Han-free class rewrite -------------------------------------------------------- */

#define T_HAN                                                                                      \
    "\\x{2E80}-\\x{2E99}\\x{2E9B}-\\x{2EF3}\\x{2F00}-\\x{2FD5}\\x{3005}"                           \
    "\\x{3007}\\x{3021}-\\x{3029}\\x{3038}-\\x{303B}\\x{3400}-\\x{4DBF}"                           \
    "\\x{4E00}-\\x{9FFF}\\x{F900}-\\x{FA6D}\\x{FA70}-\\x{FAD9}"                                    \
    "\\x{16FE2}-\\x{16FE3}\\x{16FF0}-\\x{16FF1}\\x{20000}-\\x{2A6DF}"                              \
    "\\x{2A700}-\\x{2B739}\\x{2B740}-\\x{2B81D}\\x{2B820}-\\x{2CEA1}"                              \
    "\\x{2CEB0}-\\x{2EBE0}\\x{2EBF0}-\\x{2EE5D}\\x{2F800}-\\x{2FA1D}"                              \
    "\\x{30000}-\\x{3134A}\\x{31350}-\\x{323AF}"

static pcre2_code *compile(const char *p) {
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)p, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &ec, &eo, NULL);
    if (re) pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    return re;
}

static int enc_cp(uint32_t c, uint8_t *o) {
    if (c < 0x80) return o[0] = (uint8_t)c, 1;
    if (c < 0x800) return o[0] = (uint8_t)(0xC0 | c >> 6), o[1] = (uint8_t)(0x80 | (c & 63)), 2;
    if (c < 0x10000)
        return o[0] = (uint8_t)(0xE0 | c >> 12), o[1] = (uint8_t)(0x80 | (c >> 6 & 63)),
               o[2] = (uint8_t)(0x80 | (c & 63)), 3;
    return o[0] = (uint8_t)(0xF0 | c >> 18), o[1] = (uint8_t)(0x80 | (c >> 12 & 63)),
           o[2] = (uint8_t)(0x80 | (c >> 6 & 63)), o[3] = (uint8_t)(0x80 | (c & 63)), 4;
}

static void test_class_rewrite(void) {
    /* tokenizer.c writes [A&&[^Han]] as a negated complement class; here the
     * same rewrite is compared with the literal meaning on every code point. */
    pcre2_code *lit1 = compile("(?:(?![" T_HAN "])[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])");
    pcre2_code *rw1 = compile("[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" T_HAN "]");
    pcre2_code *lit2 = compile("(?:(?![" T_HAN "])[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])");
    pcre2_code *rw2 = compile("[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" T_HAN "]");
    pcre2_match_data *md = pcre2_match_data_create(2, NULL);
    long diff = 0, n1 = 0;
    for (uint32_t c = 0; c < 0x110000; c++) {
        if (c >= 0xD800 && c < 0xE000) continue;
        uint8_t b[4];
        int n = enc_cp(c, b);
        int a1 = pcre2_match(lit1, b, (size_t)n, 0, 0, md, NULL) > 0;
        int r1 = pcre2_match(rw1, b, (size_t)n, 0, 0, md, NULL) > 0;
        int a2 = pcre2_match(lit2, b, (size_t)n, 0, 0, md, NULL) > 0;
        int r2 = pcre2_match(rw2, b, (size_t)n, 0, 0, md, NULL) > 0;
        diff += (a1 != r1) + (a2 != r2);
        n1 += a1;
    }
    CHECK(diff == 0 && n1 > 30000,
          "[Lu Lt Lm Lo M && not Han] rewrite equals the literal class on all code points "
          "(%ld differ, %ld members)",
          diff, n1);
    pcre2_match_data_free(md);
    pcre2_code_free(lit1);
    pcre2_code_free(rw1);
    pcre2_code_free(lit2);
    pcre2_code_free(rw2);
}

/* ---- long inputs ------------------------------------------------------------------------- */

static void test_long_inputs(void) {
    /* a vocab with a doubling chain "aa", "aaaa", ... and all letter pairs */
    const char *extra[300];
    static char store[300][520];
    int n = 0;
    for (int k = 2; k <= 512; k *= 2) {
        memset(store[n], 'a', (size_t)k);
        store[n][k] = 0;
        extra[n] = store[n];
        n++;
    }
    for (int i = 0; i < 26 && n < 290; i++)
        for (int j = 0; j < 10; j++) {
            if (i == 0 && j == 0) continue;
            store[n][0] = (char)('a' + i);
            store[n][1] = (char)('a' + (i * 7 + j * 3) % 26);
            store[n][2] = 0;
            int dup = 0;
            for (int q = 0; q < n; q++) dup |= !strcmp(store[q], store[n]);
            if (!dup) extra[n] = store[n], n++;
        }
    extra[n] = NULL;
    k3_tok *t = open_small(extra, K3_TOK_PATTERN_KIMI, 0);
    if (!t) return;
    size_t len = 1 << 20;
    char *s = malloc(len);
    const char *kinds[] = {"one repeated letter", "random lowercase letters",
                           "random digits and punctuation"};
    srand(99);
    for (int kind = 0; kind < 3; kind++) {
        for (size_t i = 0; i < len; i++)
            s[i] = kind == 0   ? 'a'
                   : kind == 1 ? (char)('a' + rand() % 26)
                               : "0123456789.,;:!?-+*"[rand() % 19];
        k3_tok_ids ids = {0};
        char err[256] = "";
        double t0 = now_s();
        k3_status st = k3_tok_encode(t, s, len, 0, &ids, err, sizeof err);
        double dt = now_s() - t0;
        char *out;
        size_t ol;
        k3_tok_decode(t, ids.v, ids.n, &out, &ol, NULL, err, sizeof err);
        CHECK(st == K3_OK && dt < 1.0 * T_SLOWDOWN && ol == len && !memcmp(out, s, len),
              "1 MiB whitespace-free (%s): %zu ids in %.3f s (< %.0f s), round-trips", kinds[kind],
              ids.n, dt, 1.0 * T_SLOWDOWN);
        if (kind == 0)
            CHECK(ids.n == len / 512 && ids.v[0] == 256 + 8,
                  "1 MiB of 'a' is 2048 tokens of 512 'a' (%zu)", ids.n);
        free(out);
        k3_tok_ids_free(&ids);
    }
    free(s);
    k3_tok_ids ids = {0};
    char err[256] = "";
    k3_status st = k3_tok_encode(t, "x", (size_t)K3_TOK_MAX_INPUT + 1, 0, &ids, err, sizeof err);
    CHECK(st == K3_ERR_LIMIT && strstr(err, "K3_TOK_MAX_INPUT"),
          "input beyond K3_TOK_MAX_INPUT refused: %s", err);
    k3_tok_close(&t);
}

/* ---- the tiny checkpoint ---------------------------------------------------------------- */

static void test_tiny(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/tiktoken.model", t_tiny_dir());
    if (access(path, R_OK) != 0) {
        SKIP("tiny checkpoint tokenizer checks", "%s does not exist (make tiny)", path);
        return;
    }
    k3_tok *t = NULL;
    char err[512] = "";
    k3_status st = k3_tok_open(&t, t_tiny_dir(), err, sizeof err);
    CHECK(st == K3_OK, "tiny checkpoint tokenizer opens: %s", err);
    if (!t) return;
    int32_t b = k3_tok_n_ranks(t);
    CHECK(k3_tok_special_id(t, "[BOS]") == b && k3_tok_special_id(t, "[EOS]") == b + 1 &&
              k3_tok_special_id(t, "<|end_of_msg|>") == b + 2 &&
              k3_tok_special_id(t, "<|open|>") == b + 3 &&
              k3_tok_special_id(t, "<|close|>") == b + 4 &&
              k3_tok_special_id(t, "<|sep|>") == b + 5,
          "tiny: added tokens at the real K3 offsets above %d ranks", b);
    const char *s = "Hello 世界! <|open|>";
    k3_tok_ids ids = {0};
    k3_tok_encode(t, s, strlen(s), 0, &ids, err, sizeof err);
    char *out;
    size_t ol;
    k3_tok_decode(t, ids.v, ids.n, &out, &ol, NULL, err, sizeof err);
    CHECK(ol == strlen(s) && !memcmp(out, s, ol), "tiny: round trip");
    free(out);
    k3_tok_ids_free(&ids);
    k3_tok_close(&t);
}

/* ---- the tokenize subcommand ------------------------------------------------------- */

/* Runs cmd_tokenize with stdout captured into *out (malloc'd). */
static int run_cli(char **argv, int argc, char **out) {
    char path[300];
    snprintf(path, sizeof path, "%s/cli_out", g_tmp);
    fflush(stdout);
    int saved = dup(1);
    FILE *f = fopen(path, "w");
    dup2(fileno(f), 1);
    int rc = cmd_tokenize(argc, argv);
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fclose(f);
    size_t n = 0;
    FILE *r = fopen(path, "rb");
    *out = calloc(1, 1 << 16);
    n = fread(*out, 1, (1 << 16) - 1, r);
    (*out)[n] = 0;
    fclose(r);
    return rc;
}

static void test_cli(void) {
    const char *extra[] = {"he", "ll", "hell", NULL};
    char *model = model_text(extra);
    char *config = config_text(259);
    const char *dir = make_dir("cli", model, config);
    char d[600];
    snprintf(d, sizeof d, "%s", dir);
    char *out = NULL;
    char *enc[] = {"tokenize", "--tokenizer", d, "hello <|open|>", NULL};
    int rc = run_cli(enc, 4, &out);
    /* "hello" -> hell(258) o(111); " <|open|>" plain: " <|" is one piece,
     * then "open", then "|>" */
    CHECK(rc == 0 && !strcmp(out, "258 111 32 60 124 111 112 101 110 124 62\n"),
          "tokenize prints ids: %s", out);
    free(out);
    char *tr[] = {"tokenize", "--tokenizer", d, "--trusted", "hello <|open|>", NULL};
    rc = run_cli(tr, 5, &out);
    CHECK(rc == 0 && !strcmp(out, "258 111 32 262\n"), "tokenize --trusted: %s", out);
    free(out);
    char *dec[] = {"tokenize", "--tokenizer", d, "--decode", "258,111", "32", "262", NULL};
    rc = run_cli(dec, 7, &out);
    CHECK(rc == 0 && !strcmp(out, "hello <|open|>\n"), "tokenize --decode: %s", out);
    free(out);
    char *bad[] = {"tokenize", "--tokenizer", d, "--decode", "99999", NULL};
    rc = run_cli(bad, 5, &out);
    CHECK(rc == 1 && !out[0], "tokenize --decode of an unknown id fails (rc %d)", rc);
    free(out);
    char *nodir[] = {"tokenize", "hello", NULL};
    rc = run_cli(nodir, 2, &out);
    CHECK(rc == 2, "tokenize without --tokenizer is a usage error (rc %d)", rc);
    free(out);
    free(model);
    free(config);
}

/* ---- driver mode for the tiktoken comparison ------------------------------------------- */

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

static int ctest(const char *model_path, const char *pat, const char *cases_path,
                 const char *out_path) {
    size_t ml, cl;
    uint8_t *model = slurp(model_path, &ml), *cases = slurp(cases_path, &cl);
    if (!model || !cases || cl < 4) {
        printf("not ok - ctest: cannot read %s or %s\n", model_path, cases_path);
        return 1;
    }
    k3_tok_src src = {.model = (const char *)model,
                      .model_len = ml,
                      .pattern = strcmp(pat, "o200k") ? K3_TOK_PATTERN_KIMI : K3_TOK_PATTERN_O200K,
                      .name = model_path};
    k3_tok *t = NULL;
    char err[512] = "";
    if (k3_tok_open_mem(&t, &src, err, sizeof err) != K3_OK) {
        printf("not ok - ctest: %s\n", err);
        return 1;
    }
    FILE *out = fopen(out_path, "w");
    uint32_t n_cases;
    memcpy(&n_cases, cases, 4);
    size_t off = 4;
    int rt_bad = 0, st_bad = 0, enc_bad = 0;
    double max_dt = 0;
    size_t max_len = 0;
    for (uint32_t c = 0; c < n_cases && off + 4 <= cl; c++) {
        uint32_t len;
        memcpy(&len, cases + off, 4);
        const char *s = (const char *)cases + off + 4;
        off += 4 + len;
        k3_tok_ids ids = {0};
        double t0 = now_s();
        k3_status st = k3_tok_encode(t, s, len, 0, &ids, err, sizeof err);
        double dt = now_s() - t0;
        if (len > max_len) max_len = len, max_dt = dt;
        if (st != K3_OK) {
            enc_bad++;
            printf("# case %u: %s\n", c, err);
        }
        for (size_t i = 0; i < ids.n; i++) fprintf(out, i ? " %d" : "%d", ids.v[i]);
        fputc('\n', out);
        /* round trip */
        char *dec;
        size_t dl;
        k3_tok_decode(t, ids.v, ids.n, &dec, &dl, NULL, err, sizeof err);
        if (dl != len || memcmp(dec, s, len)) {
            if (!rt_bad) printf("# case %u does not round-trip\n", c);
            rt_bad++;
        }
        free(dec);
        /* streaming: valid UTF-8 at every step; equal to the input when the
         * input is valid */
        k3_tok_stream ks = {0};
        sbuf acc = {0};
        sb_add(&acc, "", 0);
        int step_bad = 0;
        for (size_t i = 0; i < ids.n; i++) {
            size_t l;
            const char *p = k3_tok_stream_push(t, &ks, ids.v[i], &l);
            step_bad |= !valid_utf8(p, l);
            sb_add(&acc, p, l);
        }
        size_t l;
        const char *p = k3_tok_stream_flush(&ks, &l);
        step_bad |= !valid_utf8(p, l);
        sb_add(&acc, p, l);
        if (step_bad || (valid_utf8(s, len) && (acc.n != len || memcmp(acc.p, s, len)))) {
            if (!st_bad) printf("# case %u: streaming decode differs\n", c);
            st_bad++;
        }
        free(acc.p);
        k3_tok_stream_reset(&ks);
        k3_tok_ids_free(&ids);
    }
    fclose(out);
    CHECK(enc_bad == 0, "%s/%s: %u cases encoded without error", model_path, pat, n_cases);
    CHECK(rt_bad == 0, "%s/%s: decode(encode(x)) == x on all %u cases (%d differ)", model_path, pat,
          n_cases, rt_bad);
    CHECK(st_bad == 0, "%s/%s: streaming decoder emits valid UTF-8 only, equal to x (%d bad)",
          model_path, pat, st_bad);
    printf("# %s/%s: longest case %zu bytes encoded in %.3f s\n", model_path, pat, max_len, max_dt);
    CHECK(max_len < 1000000 || max_dt < 1.0 * T_SLOWDOWN,
          "%s/%s: 1 MB text encodes in %.3f s (< %.0f s)", model_path, pat, max_dt,
          1.0 * T_SLOWDOWN);
    k3_tok_close(&t);
    free(model);
    free(cases);
    TEST_MAIN_END();
}

int main(int argc, char **argv) {
    if (argc == 6 && !strcmp(argv[1], "--ctest")) return ctest(argv[2], argv[3], argv[4], argv[5]);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/k3_test_tok_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        perror("mkdtemp");
        return 2;
    }
    test_file_errors();
    test_bpe_hand();
    test_bpe_random();
    test_specials();
    test_invalid_utf8();
    test_stream();
    test_class_rewrite();
    test_long_inputs();
    test_tiny();
    test_cli();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) printf("# could not remove %s\n", g_tmp);
    TEST_MAIN_END();
}
