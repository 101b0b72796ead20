/* common/text/tokenizer.c: loading, pre-tokenizing, rank-BPE, decoding.
 * See tokenizer.h for the contract; the facts are docs/INTERFACES.md 1.3-1.6. */
#include "common/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/base/limits.h"

/* ---- the split regexes -------------------------------------------------
 *
 * The reference Kimi pattern (docs/INTERFACES.md 1.3) uses fancy-regex's `&&` class
 * intersection, which PCRE2 10.42 lacks. [A&&[^Han]] is rewritten as one
 * negated class over the complement: the general categories partition every
 * code point, so "Lu|Lt|Lm|Lo|M and not Han" is exactly "not Ll, N, P, S,
 * Z, C and not Han". A single class (no group, no lookahead per character)
 * keeps the repeat stack-free under JIT on megabyte pieces; test_tokenizer
 * proves the rewrite equal to (?:(?!Han)[Lu Lt Lm Lo M]) on every code
 * point.
 *
 * \s is spelled out as the Unicode White_Space property, which is what
 * tiktoken's Rust regex means by \s; PCRE2's \s also matches U+180E.
 * \p{Han} in Rust regex is Script=Han (not Script_Extensions, so U+3002 is
 * not Han); PCRE2's \p{Han} is Script_Extensions, so Han is an explicit
 * Unicode 15.1 Script=Han range list instead (docs/INTERFACES.md 1.3). */
#define HAN                                                                                        \
    "\\x{2E80}-\\x{2E99}\\x{2E9B}-\\x{2EF3}\\x{2F00}-\\x{2FD5}\\x{3005}"                           \
    "\\x{3007}\\x{3021}-\\x{3029}\\x{3038}-\\x{303B}\\x{3400}-\\x{4DBF}"                           \
    "\\x{4E00}-\\x{9FFF}\\x{F900}-\\x{FA6D}\\x{FA70}-\\x{FAD9}"                                    \
    "\\x{16FE2}-\\x{16FE3}\\x{16FF0}-\\x{16FF1}\\x{20000}-\\x{2A6DF}"                              \
    "\\x{2A700}-\\x{2B739}\\x{2B740}-\\x{2B81D}\\x{2B820}-\\x{2CEA1}"                              \
    "\\x{2CEB0}-\\x{2EBE0}\\x{2EBF0}-\\x{2EE5D}\\x{2F800}-\\x{2FA1D}"                              \
    "\\x{30000}-\\x{3134A}\\x{31350}-\\x{323AF}"
#define WS                                                                                         \
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}"                         \
    "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define CONTR "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
#define PRE   "[^\\r\\n\\p{L}\\p{N}]?"
/* Kimi S1 = [Lu Lt Lm Lo M && not Han], S2 = [Ll Lm Lo M && not Han]. */
#define KS1 "[^\\p{Ll}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" HAN "]"
#define KS2 "[^\\p{Lu}\\p{Lt}\\p{N}\\p{P}\\p{S}\\p{Z}\\p{C}" HAN "]"
#define OS1 "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define OS2 "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
#define TAIL_WS                                                                                    \
    "|[" WS "]*[\\r\\n]+"                                                                          \
    "|[" WS "]+(?![^" WS "])"                                                                      \
    "|[" WS "]+"

/* The alternatives, in docs/INTERFACES.md 1.3's order (leftmost-first, as in tiktoken):
 * 1 Han run (Kimi only), 2-3 letters (case-aware, optional contraction),
 * 4 one to three numbers, 5 punctuation run with an optional leading space
 * and trailing CR/LF (o200k also swallows '/'), 6 whitespace up to the last
 * CR/LF, 7 whitespace leaving the last char before a non-space, 8 the rest. */
// clang-format off
static const char PAT_KIMI[] =
    "[" HAN "]+"
    "|" PRE KS1 "*" KS2 "+" CONTR
    "|" PRE KS1 "+" KS2 "*" CONTR
    "|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"
    TAIL_WS;

static const char PAT_O200K[] =
    PRE OS1 "*" OS2 "+" CONTR
    "|" PRE OS1 "+" OS2 "*" CONTR
    "|\\p{N}{1,3}"
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n/]*"
    TAIL_WS;
// clang-format on

/* ---- the tokenizer ------------------------------------------------------ */

typedef struct tok_span {
    uint32_t off; /* into bytes */
    uint32_t len; /* 1..K3_TOK_MAX_TOKEN_BYTES */
} tok_span;

/* Trie over added-token contents for the trusted path (first-child /
 * next-sibling, so 256 contents of ~25 bytes cost a few thousand nodes). */
typedef struct trie_node {
    int32_t child, sibling; /* node index or -1 */
    int32_t id;             /* added id ending here, or -1 */
    uint8_t byte;
} trie_node;

struct k3_tok {
    int32_t n_ranks; /* ids [0, n_ranks) are ranks */
    tok_span *span;  /* [n_ranks], owned */
    uint8_t *bytes;  /* token bytes arena, owned */
    int32_t *table;  /* hash slots: rank or -1, [table_mask+1], owned */
    uint32_t table_mask;
    uint32_t max_len;       /* longest rank token, bytes */
    int32_t byte_rank[256]; /* rank of each single byte */

    int32_t n_added;     /* 0 or K3_TOK_ADDED, ids [n_ranks, +n_added) */
    char **added;        /* [n_added] NUL-terminated contents, owned */
    uint32_t *added_len; /* [n_added] bytes */
    trie_node *trie;     /* [n_trie], node 0 is the root, owned */
    int32_t n_trie, cap_trie;
    uint8_t first_byte[256]; /* 1 if some added content starts with it */
    int32_t bos, eos;

    k3_tok_pattern pattern;
    pcre2_code *re; /* compiled (and JIT-compiled when possible) */
};

/* ---- small helpers ------------------------------------------------------ */

int k3_utf8_seq_len(const uint8_t *s, size_t n) {
    if (n == 0) return 0;
    uint8_t c = s[0];
    if (c < 0x80) return 1;
    int len;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF)
        len = 2;
    else if (c == 0xE0)
        len = 3, lo = 0xA0;
    else if (c == 0xED)
        len = 3, hi = 0x9F; /* no surrogates */
    else if (c >= 0xE1 && c <= 0xEF)
        len = 3;
    else if (c == 0xF0)
        len = 4, lo = 0x90;
    else if (c == 0xF4)
        len = 4, hi = 0x8F; /* <= U+10FFFF */
    else if (c >= 0xF1 && c <= 0xF3)
        len = 4;
    else
        return 0;
    if (n < (size_t)len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return len;
}

/* Hash of a token's bytes, 8 bytes per step (tokens reach hundreds of bytes
 * and long pieces look up many long pairs). */
static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xFF51AFD7ED558CCDull);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
        h ^= h >> 31;
    }
    uint64_t w = 0;
    for (size_t k = 0; i + k < n; k++) w |= (uint64_t)p[i + k] << (8 * k);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
}

/* Rank of the byte string p[0..n), or -1. */
/* Open addressing with linear probing; the table is at least twice the
 * entry count, so probes stay short and an empty slot always ends a miss.
 * Strings longer than the longest token cannot be tokens: that check keeps
 * pair lookups on megabyte pieces cheap. */
static int32_t tok_lookup(const k3_tok *t, const uint8_t *p, size_t n) {
    if (n == 0 || n > t->max_len) return -1;
    uint32_t i = (uint32_t)hash_bytes(p, n) & t->table_mask;
    for (;;) {
        int32_t r = t->table[i];
        if (r < 0) return -1;
        if (t->span[r].len == n && memcmp(t->bytes + t->span[r].off, p, n) == 0) return r;
        i = (i + 1) & t->table_mask;
    }
}

void k3_tok_ids_push(k3_tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        ids->cap = ids->cap ? ids->cap * 2 : 64;
        ids->v = k3_xrealloc(ids->v, ids->cap * sizeof *ids->v);
    }
    ids->v[ids->n++] = id;
}

void k3_tok_ids_free(k3_tok_ids *ids) {
    if (!ids) return;
    free(ids->v);
    ids->v = NULL;
    ids->n = ids->cap = 0;
}

/* Reads a whole file (at most K3_TOK_MAX_FILE bytes) into a malloc'd,
 * NUL-terminated buffer. */
static k3_status read_file(const char *path, char **out, size_t *len, char *err, size_t errlen) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return k3_errf(K3_ERR_MISSING, err, errlen, "%s: cannot open (%s)", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: not a regular file", path);
    }
    if ((unsigned long long)st.st_size > K3_TOK_MAX_FILE) {
        fclose(f);
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %lld bytes > limit K3_TOK_MAX_FILE %u", path,
                       (long long)st.st_size, K3_TOK_MAX_FILE);
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        fclose(f);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "%s: no memory for %zu bytes", path, n);
    }
    size_t got = fread(buf, 1, n, f);
    fclose(f);
    if (got != n) {
        free(buf);
        return k3_errf(K3_ERR_IO, err, errlen, "%s: short read %zu of %zu bytes", path, got, n);
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return K3_OK;
}

static int b64_val(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict standard base64 (padded, length a multiple of 4). Returns the
 * decoded length, or -1 with *bad set to the offending offset. */
static long b64_decode(const char *s, size_t n, uint8_t *out, size_t *bad) {
    if (n == 0 || n % 4) {
        *bad = n;
        return -1;
    }
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            uint8_t c = (uint8_t)s[i + k];
            if (c == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
                continue;
            }
            if (pad || (v[k] = b64_val(c)) < 0) { /* data after '=' or bad char */
                *bad = i + k;
                return -1;
            }
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (uint8_t)(w >> 16);
        if (pad < 2) out[o++] = (uint8_t)(w >> 8);
        if (pad < 1) out[o++] = (uint8_t)w;
    }
    return (long)o;
}

/* ---- loading the rank table --------------------------------------------- */

/* Parses tiktoken.model: one "<base64> <rank>" per non-empty line (CRLF
 * tolerated, as Python's splitlines does). Invariants established here and
 * relied on by encode: ranks are exactly 0..n-1, token bytes are unique
 * (the hash table maps bytes -> the one rank), every single byte has a rank
 * (so BPE always ends in ranked symbols) and no token is longer than
 * K3_TOK_MAX_TOKEN_BYTES (max_len bounds every lookup). Any violation is an
 * error naming the line; nothing is half-loaded (the caller frees). */
static k3_status load_ranks(k3_tok *t, const char *name, const char *text, size_t n, char *err,
                            size_t errlen) {
    /* Pass 1: count the entries (non-empty lines). */
    size_t n_lines = 0;
    for (size_t i = 0; i < n;) {
        const char *nl = memchr(text + i, '\n', n - i);
        size_t e = nl ? (size_t)(nl - text) : n;
        size_t le = e;
        if (le > i && text[le - 1] == '\r') le--;
        if (le > i) n_lines++;
        i = e + 1;
    }
    if (n_lines == 0) return k3_errf(K3_ERR_FORMAT, err, errlen, "%s: no entries", name);
    if (n_lines > (size_t)K3_MAX_VOCAB)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %zu entries > limit K3_MAX_VOCAB %d", name,
                       n_lines, K3_MAX_VOCAB);
    t->n_ranks = (int32_t)n_lines;
    t->span = calloc(n_lines, sizeof *t->span);
    uint32_t *line_of = calloc(n_lines, sizeof *line_of); /* 0 = unseen */
    t->bytes = malloc(n + 1);                             /* decoded base64 is always shorter */
    size_t cap = 1;
    while (cap < 2 * n_lines) cap <<= 1;
    t->table = malloc(cap * sizeof *t->table);
    if (!t->span || !line_of || !t->bytes || !t->table) {
        free(line_of);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "%s: no memory for %zu entries", name, n_lines);
    }
    memset(t->table, 0xff, cap * sizeof *t->table);
    t->table_mask = (uint32_t)(cap - 1);

    /* Pass 2: decode "<base64> <rank>" per line, ranks must be 0..n-1 once. */
    k3_status st = K3_OK;
    size_t used = 0, line = 0;
    for (size_t i = 0; i < n && st == K3_OK;) {
        const char *nl = memchr(text + i, '\n', n - i);
        size_t e = nl ? (size_t)(nl - text) : n, le = e;
        line++;
        if (le > i && text[le - 1] == '\r') le--;
        size_t b = i;
        i = e + 1;
        if (le == b) continue;
        const char *sp = memchr(text + b, ' ', le - b);
        if (!sp) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s line %zu: expected \"<base64> <rank>\", found no space", name, line);
            break;
        }
        size_t b64n = (size_t)(sp - (text + b)), r0 = (size_t)(sp - text) + 1;
        uint64_t rank = 0;
        size_t k = r0;
        for (; k < le && text[k] >= '0' && text[k] <= '9'; k++)
            if (rank <= (uint64_t)K3_MAX_VOCAB) rank = rank * 10 + (uint64_t)(text[k] - '0');
        if (k == r0 || k != le) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s line %zu: rank \"%.*s\" is not a decimal number", name, line,
                         (int)(le - r0 > 32 ? 32 : le - r0), text + r0);
            break;
        }
        if (rank >= n_lines) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s line %zu: rank %llu leaves a gap: %zu entries must hold "
                         "ranks 0..%zu exactly once",
                         name, line, (unsigned long long)rank, n_lines, n_lines - 1);
            break;
        }
        if (line_of[rank]) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s line %zu: duplicate rank %llu (also on line %u)", name, line,
                         (unsigned long long)rank, line_of[rank]);
            break;
        }
        line_of[rank] = (uint32_t)line;
        if (b64n > 4 * ((K3_TOK_MAX_TOKEN_BYTES + 2) / 3)) {
            st = k3_errf(K3_ERR_LIMIT, err, errlen,
                         "%s line %zu: token of %zu base64 chars > limit "
                         "K3_TOK_MAX_TOKEN_BYTES %d bytes",
                         name, line, b64n, K3_TOK_MAX_TOKEN_BYTES);
            break;
        }
        size_t bad = 0;
        long dl = b64_decode(text + b, b64n, t->bytes + used, &bad);
        if (dl <= 0) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen, "%s line %zu: bad base64 \"%.*s\" at char %zu",
                         name, line, (int)(b64n > 64 ? 64 : b64n), text + b, bad);
            break;
        }
        t->span[rank].off = (uint32_t)used;
        t->span[rank].len = (uint32_t)dl;
        if ((uint32_t)dl > t->max_len) t->max_len = (uint32_t)dl;
        used += (size_t)dl;
    }
    free(line_of);
    if (st != K3_OK) return st;

    /* Hash every token; equal bytes under two ranks would make the id of a
     * piece ambiguous. */
    for (int32_t r = 0; r < t->n_ranks; r++) {
        const uint8_t *p = t->bytes + t->span[r].off;
        uint32_t len = t->span[r].len;
        int32_t other = tok_lookup(t, p, len);
        if (other >= 0)
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "%s: ranks %d and %d are the same %u-byte token", name, other, r, len);
        uint32_t i = (uint32_t)hash_bytes(p, len) & t->table_mask;
        while (t->table[i] >= 0) i = (i + 1) & t->table_mask;
        t->table[i] = r;
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_rank[b] = tok_lookup(t, &c, 1);
        if (t->byte_rank[b] < 0)
            return k3_errf(K3_ERR_FORMAT, err, errlen,
                           "%s: byte 0x%02x has no rank (rank-BPE needs all 256 single "
                           "bytes)",
                           name, b);
    }
    return K3_OK;
}

/* ---- added tokens --------------------------------------------------------- */

static void trie_add(k3_tok *t, const char *s, size_t n, int32_t id) {
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        int32_t ch = t->trie[node].child;
        while (ch >= 0 && t->trie[ch].byte != c) ch = t->trie[ch].sibling;
        if (ch < 0) {
            if (t->n_trie == t->cap_trie) {
                t->cap_trie *= 2;
                t->trie = k3_xrealloc(t->trie, (size_t)t->cap_trie * sizeof *t->trie);
            }
            ch = t->n_trie++;
            t->trie[ch] = (trie_node){-1, t->trie[node].child, -1, c};
            t->trie[node].child = ch;
        }
        node = ch;
    }
    t->trie[node].id = id;
}

/* Longest added token starting at s[0..n): its id and *len, or -1. */
static int32_t trie_match(const k3_tok *t, const uint8_t *s, size_t n, size_t *len) {
    int32_t node = 0, best = -1;
    for (size_t i = 0; i < n; i++) {
        int32_t ch = t->trie[node].child;
        while (ch >= 0 && t->trie[ch].byte != s[i]) ch = t->trie[ch].sibling;
        if (ch < 0) break;
        node = ch;
        if (t->trie[node].id >= 0) {
            best = t->trie[node].id;
            *len = i + 1;
        }
    }
    return best;
}

/* "bos_token" / "eos_token" in tokenizer_config.json: a string or an object
 * with "content". Returns the content or NULL. */
static const char *config_token(json_t *root, const char *key) {
    json_t *v = json_object_get(root, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* Reads added_tokens_decoder: ids must sit in [n_ranks, n_ranks + 256) and
 * below vocab_size; missing ids get colibri's filler content. Contents must
 * be unique, so a content always names one id (k3_tok_special_id). Only
 * the trusted encode path ever matches them. */
static k3_status load_added(k3_tok *t, const char *name, const char *text, size_t n,
                            int64_t vocab_size, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_loadb(text, n, 0, &je);
    if (!root)
        return k3_errf(K3_ERR_FORMAT, err, errlen, "%s: invalid JSON at line %d: %s", name, je.line,
                       je.text);
    k3_status st = K3_OK;
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (!json_is_object(root) || !json_is_object(dec)) {
        json_decref(root);
        return k3_errf(K3_ERR_MISSING, err, errlen, "%s: no \"added_tokens_decoder\" object", name);
    }
    int64_t base = t->n_ranks;
    t->n_added = K3_TOK_ADDED;
    t->added = calloc(K3_TOK_ADDED, sizeof *t->added);
    t->added_len = calloc(K3_TOK_ADDED, sizeof *t->added_len);
    if (!t->added || !t->added_len) {
        json_decref(root);
        return k3_errf(K3_ERR_NOMEM, err, errlen, "%s: no memory", name);
    }
    const char *key;
    json_t *val;
    json_object_foreach(dec, key, val) {
        char *end = NULL;
        long long id = strtoll(key, &end, 10);
        if (!*key || *end || id < 0) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: added_tokens_decoder key \"%.40s\" is not an id", name, key);
            break;
        }
        if (id < base) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: added token id %lld is inside the rank table (ranks "
                         "0..%lld)",
                         name, id, (long long)base - 1);
            break;
        }
        if (id >= base + K3_TOK_ADDED) {
            st = k3_errf(K3_ERR_LIMIT, err, errlen,
                         "%s: added token id %lld beyond the %d added slots %lld..%lld", name, id,
                         K3_TOK_ADDED, (long long)base, (long long)base + K3_TOK_ADDED - 1);
            break;
        }
        if (vocab_size > 0 && id >= vocab_size) {
            st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: added token id %lld >= vocab_size %lld",
                         name, id, (long long)vocab_size);
            break;
        }
        json_t *c = json_object_get(val, "content");
        size_t cl = json_string_length(c);
        if (!json_is_string(c) || cl == 0 || cl > K3_TOK_MAX_TOKEN_BYTES ||
            memchr(json_string_value(c), 0, cl)) {
            st = k3_errf(K3_ERR_FORMAT, err, errlen,
                         "%s: added token %lld: \"content\" must be a string of 1..%d "
                         "bytes without NUL (got %zu bytes)",
                         name, id, K3_TOK_MAX_TOKEN_BYTES, cl);
            break;
        }
        t->added[id - base] = k3_xstrdup(json_string_value(c));
        t->added_len[id - base] = (uint32_t)cl;
    }
    /* Gaps get colibri's filler so every id in the block decodes to text. */
    for (int i = 0; st == K3_OK && i < K3_TOK_ADDED; i++) {
        if (t->added[i]) continue;
        char fill[64];
        int fl = snprintf(fill, sizeof fill, "<|reserved_token_%lld|>", (long long)base + i);
        t->added[i] = k3_xstrdup(fill);
        t->added_len[i] = (uint32_t)fl;
    }
    if (st == K3_OK) {
        t->cap_trie = 1024;
        t->n_trie = 1;
        t->trie = k3_xmalloc((size_t)t->cap_trie * sizeof *t->trie);
        t->trie[0] = (trie_node){-1, -1, -1, 0};
        for (int i = 0; i < K3_TOK_ADDED; i++) {
            size_t ml = 0;
            int32_t dup = trie_match(t, (const uint8_t *)t->added[i], t->added_len[i], &ml);
            if (dup >= 0 && ml == t->added_len[i]) {
                st = k3_errf(K3_ERR_FORMAT, err, errlen,
                             "%s: added tokens %d and %lld have the same content \"%s\"", name, dup,
                             (long long)base + i, t->added[i]);
                break;
            }
            trie_add(t, t->added[i], t->added_len[i], (int32_t)(base + i));
            t->first_byte[(uint8_t)t->added[i][0]] = 1;
        }
    }
    if (st == K3_OK) {
        const char *b = config_token(root, "bos_token"), *e = config_token(root, "eos_token");
        t->bos = k3_tok_special_id(t, b ? b : "[BOS]");
        if (t->bos < 0 && b) t->bos = k3_tok_special_id(t, "[BOS]");
        t->eos = k3_tok_special_id(t, e ? e : "[EOS]");
        if (t->eos < 0 && e) t->eos = k3_tok_special_id(t, "[EOS]");
    }
    json_decref(root);
    return st;
}

/* Compiles the split regex once per tokenizer; the compiled code is
 * read-only afterwards and shared by all threads (each encode call makes
 * its own match data). */
static k3_status compile_pattern(k3_tok *t, char *err, size_t errlen) {
    const char *pat = t->pattern == K3_TOK_PATTERN_O200K ? PAT_O200K : PAT_KIMI;
    int ec;
    PCRE2_SIZE eo;
    t->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo,
                          NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return k3_errf(K3_ERR_INTERNAL, err, errlen,
                       "tokenizer: split regex does not compile at offset %zu: %s", (size_t)eo,
                       (const char *)msg);
    }
    /* Without JIT the interpreter gives the same answers, only slower. */
    (void)pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);
    return K3_OK;
}

/* Every open path ends here; on any failure the half-built tokenizer is
 * freed and *out stays NULL. */
k3_status k3_tok_open_mem(k3_tok **out, const k3_tok_src *src, char *err, size_t errlen) {
    *out = NULL;
    const char *name = src->name ? src->name : "tiktoken.model";
    if (!src->model) return k3_errf(K3_ERR_ARG, err, errlen, "%s: no rank table given", name);
    if (src->model_len > K3_TOK_MAX_FILE || src->config_len > K3_TOK_MAX_FILE)
        return k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %zu bytes > limit K3_TOK_MAX_FILE %u", name,
                       src->model_len > src->config_len ? src->model_len : src->config_len,
                       K3_TOK_MAX_FILE);
    k3_tok *t = k3_xcalloc(1, sizeof *t);
    t->pattern = src->pattern;
    t->bos = t->eos = -1;
    k3_status st = load_ranks(t, name, src->model, src->model_len, err, errlen);
    if (st == K3_OK && src->vocab_size > 0 &&
        (int64_t)t->n_ranks + (src->config_json ? K3_TOK_ADDED : 0) > src->vocab_size)
        st = k3_errf(K3_ERR_LIMIT, err, errlen, "%s: %d ranks + %d added tokens > vocab_size %lld",
                     name, t->n_ranks, src->config_json ? K3_TOK_ADDED : 0,
                     (long long)src->vocab_size);
    if (st == K3_OK && src->config_json)
        st = load_added(t, src->config_name ? src->config_name : "tokenizer_config.json",
                        src->config_json, src->config_len, src->vocab_size, err, errlen);
    if (st == K3_OK) st = compile_pattern(t, err, errlen);
    if (st != K3_OK) {
        k3_tok_close(&t);
        return st;
    }
    *out = t;
    return K3_OK;
}

k3_status k3_tok_open_dir(k3_tok **out, const char *dir, int64_t vocab_size, char *err,
                          size_t errlen) {
    *out = NULL;
    char mpath[4096], cpath[4096];
    snprintf(mpath, sizeof mpath, "%s/tiktoken.model", dir);
    snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir);
    char *model = NULL, *config = NULL;
    size_t ml = 0, cl = 0;
    k3_status st = read_file(mpath, &model, &ml, err, errlen);
    if (st == K3_OK) st = read_file(cpath, &config, &cl, err, errlen);
    if (st == K3_OK) {
        k3_tok_src src = {.model = model,
                          .model_len = ml,
                          .config_json = config,
                          .config_len = cl,
                          .pattern = K3_TOK_PATTERN_KIMI,
                          .vocab_size = vocab_size,
                          .name = mpath,
                          .config_name = cpath};
        st = k3_tok_open_mem(out, &src, err, errlen);
    }
    free(model);
    free(config);
    return st;
}

k3_status k3_tok_open(k3_tok **out, const char *dir, char *err, size_t errlen) {
    return k3_tok_open_dir(out, dir, 0, err, errlen);
}

void k3_tok_close(k3_tok **tp) {
    if (!tp || !*tp) return;
    k3_tok *t = *tp;
    free(t->span);
    free(t->bytes);
    free(t->table);
    if (t->added)
        for (int i = 0; i < t->n_added; i++) free(t->added[i]);
    free(t->added);
    free(t->added_len);
    free(t->trie);
    pcre2_code_free(t->re);
    free(t);
    *tp = NULL;
}

/* ---- rank-BPE --------------------------------------------------------------
 *
 * tiktoken's byte_pair_merge, with the same answers: the symbols start as
 * single bytes; repeatedly the adjacent pair whose concatenation has the
 * lowest rank is merged, the leftmost one on ties. Instead of rescanning all
 * pairs per merge (quadratic), a min-heap holds (rank << 32 | left start) for
 * every pair; ordering by that key is exactly "lowest rank, then leftmost".
 * Entries go stale when a neighbour merges; a popped entry is used only if
 * its left symbol is alive and still has that pair rank (pair_rank[]), and
 * every live pair always has an entry with its current key, so the first
 * valid pop is the pair tiktoken would pick. */

#define NO_RANK INT32_MAX

typedef struct bpe_ws {
    int32_t *next, *prev, *pair_rank; /* per byte position of the piece */
    uint64_t *heap;
    size_t cap, heap_cap, heap_n;
} bpe_ws;

static void bpe_ws_free(bpe_ws *w) {
    free(w->next);
    free(w->prev);
    free(w->pair_rank);
    free(w->heap);
    memset(w, 0, sizeof *w);
}

static int bpe_ws_reserve(bpe_ws *w, size_t n) {
    if (n <= w->cap) return 0;
    size_t c = w->cap ? w->cap : 256;
    while (c < n) c *= 2;
    int32_t *a = realloc(w->next, c * sizeof *a);
    if (!a) return -1;
    w->next = a;
    if (!(a = realloc(w->prev, c * sizeof *a))) return -1;
    w->prev = a;
    if (!(a = realloc(w->pair_rank, c * sizeof *a))) return -1;
    w->pair_rank = a;
    w->cap = c;
    return 0;
}

static int heap_push(bpe_ws *w, uint64_t key) {
    if (w->heap_n == w->heap_cap) {
        size_t c = w->heap_cap ? w->heap_cap * 2 : 512;
        uint64_t *h = realloc(w->heap, c * sizeof *h);
        if (!h) return -1;
        w->heap = h;
        w->heap_cap = c;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (w->heap[p] <= key) break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = key;
    return 0;
}

static uint64_t heap_pop(bpe_ws *w) {
    uint64_t top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && w->heap[c + 1] < w->heap[c]) c++;
        if (w->heap[c] >= last) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* Rank of the pair starting at symbol i (whose next symbol is j), or NO_RANK. */
static int32_t pair_rank_at(const k3_tok *t, const uint8_t *p, size_t n, const bpe_ws *w,
                            int32_t i) {
    int32_t j = w->next[i];
    if (j < 0 || (size_t)j >= n) return NO_RANK;
    int32_t k = w->next[j]; /* end of the pair */
    size_t end = (k < 0 || (size_t)k >= n) ? n : (size_t)k;
    int32_t r = tok_lookup(t, p + i, end - (size_t)i);
    return r < 0 ? NO_RANK : r;
}

static k3_status bpe_piece(const k3_tok *t, const uint8_t *p, size_t n, bpe_ws *w, k3_tok_ids *ids,
                           char *err, size_t errlen) {
    if (n == 1) {
        k3_tok_ids_push(ids, t->byte_rank[p[0]]);
        return K3_OK;
    }
    int32_t whole = tok_lookup(t, p, n); /* tiktoken's whole-piece fast path */
    if (whole >= 0) {
        k3_tok_ids_push(ids, whole);
        return K3_OK;
    }
    if (bpe_ws_reserve(w, n) != 0)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "tokenizer: no memory for a %zu-byte piece", n);
    w->heap_n = 0;
    for (size_t i = 0; i < n; i++) {
        w->next[i] = (int32_t)(i + 1);
        w->prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = tok_lookup(t, p + i, 2);
        w->pair_rank[i] = r < 0 ? NO_RANK : r;
        if (r >= 0 && heap_push(w, (uint64_t)r << 32 | i) != 0) goto nomem;
    }
    w->pair_rank[n - 1] = NO_RANK;
    while (w->heap_n) {
        uint64_t key = heap_pop(w);
        int32_t r = (int32_t)(key >> 32), i = (int32_t)(key & 0xffffffffu);
        if (w->pair_rank[i] != r) continue; /* stale: pair changed or symbol dead */
        int32_t j = w->next[i], k = w->next[j];
        /* merge symbol j into i */
        w->next[i] = k;
        if ((size_t)k < n) w->prev[k] = i;
        w->pair_rank[j] = NO_RANK;
        w->pair_rank[i] = pair_rank_at(t, p, n, w, i);
        if (w->pair_rank[i] != NO_RANK &&
            heap_push(w, (uint64_t)w->pair_rank[i] << 32 | (uint32_t)i) != 0)
            goto nomem;
        int32_t h = w->prev[i];
        if (h >= 0) {
            w->pair_rank[h] = pair_rank_at(t, p, n, w, h);
            if (w->pair_rank[h] != NO_RANK &&
                heap_push(w, (uint64_t)w->pair_rank[h] << 32 | (uint32_t)h) != 0)
                goto nomem;
        }
    }
    for (size_t i = 0; i < n; i = (size_t)w->next[i]) {
        int32_t r = tok_lookup(t, p + i, (size_t)w->next[i] - i);
        K3_ASSERT(r >= 0); /* single bytes all have ranks; merges are ranked */
        k3_tok_ids_push(ids, r);
    }
    return K3_OK;
nomem:
    return k3_errf(K3_ERR_NOMEM, err, errlen, "tokenizer: no memory for a %zu-byte piece", n);
}

/* ---- encode ------------------------------------------------------------------ */

/* Pre-tokenizes one valid UTF-8 run and BPE-encodes each piece. */
/* The run is valid UTF-8 (checked by the caller), which is what lets
 * pcre2_match skip its own check (PCRE2_NO_UTF_CHECK). A match error other
 * than "no match" (a JIT stack or match limit) is reported, never ignored:
 * silently skipping text would change the ids. */
static k3_status encode_run(const k3_tok *t, const uint8_t *s, size_t n, pcre2_match_data *md,
                            bpe_ws *w, k3_tok_ids *ids, char *err, size_t errlen) {
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(t->re, s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        size_t ms, me;
        if (rc == PCRE2_ERROR_NOMATCH) {
            ms = me = n;
        } else if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return k3_errf(K3_ERR_INTERNAL, err, errlen,
                           "tokenizer: split regex failed at byte %zu of %zu: %s", pos, n,
                           (const char *)msg);
        } else {
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            ms = ov[0];
            me = ov[1];
        }
        /* Safety net: characters no alternative matched are pieces of one
         * character each (every code point matches some alternative, so
         * this should not happen; text is never dropped). */
        while (pos < ms) {
            int cl = k3_utf8_seq_len(s + pos, n - pos);
            k3_status st = bpe_piece(t, s + pos, (size_t)cl, w, ids, err, errlen);
            if (st != K3_OK) return st;
            pos += (size_t)cl;
        }
        if (me > ms) {
            k3_status st = bpe_piece(t, s + ms, me - ms, w, ids, err, errlen);
            if (st != K3_OK) return st;
        }
        pos = me;
    }
    return K3_OK;
}

/* Plain (untrusted) encoding: valid runs through the regex, each invalid
 * byte its own piece. */
static k3_status encode_plain(const k3_tok *t, const uint8_t *s, size_t n, pcre2_match_data *md,
                              bpe_ws *w, k3_tok_ids *ids, char *err, size_t errlen) {
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        int cl;
        while (j < n && (cl = k3_utf8_seq_len(s + j, n - j)) > 0) j += (size_t)cl;
        if (j > i) {
            k3_status st = encode_run(t, s + i, j - i, md, w, ids, err, errlen);
            if (st != K3_OK) return st;
        }
        if (j < n) k3_tok_ids_push(ids, t->byte_rank[s[j++]]); /* invalid byte */
        i = j;
    }
    return K3_OK;
}

/* Trusted: scan for added-token contents with the trie (earliest position,
 * longest content), encode the plain stretches between them. Untrusted:
 * the whole text is plain. The workspace and match data are per call, which
 * keeps a k3_tok shareable across threads. */
k3_status k3_tok_encode(const k3_tok *t, const char *text, size_t len, int trusted, k3_tok_ids *ids,
                        char *err, size_t errlen) {
    if (len > K3_TOK_MAX_INPUT)
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "tokenizer: input of %zu bytes > limit K3_TOK_MAX_INPUT %u", len,
                       K3_TOK_MAX_INPUT);
    if (len == 0) return K3_OK;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(t->re, NULL);
    if (!md) return k3_errf(K3_ERR_NOMEM, err, errlen, "tokenizer: no memory for match data");
    bpe_ws w = {0};
    const uint8_t *s = (const uint8_t *)text;
    k3_status st = K3_OK;
    if (!trusted || t->n_added == 0) {
        st = encode_plain(t, s, len, md, &w, ids, err, errlen);
    } else {
        size_t from = 0;
        for (size_t i = 0; i < len && st == K3_OK;) {
            size_t ml = 0;
            int32_t id = t->first_byte[s[i]] ? trie_match(t, s + i, len - i, &ml) : -1;
            if (id < 0) {
                i++;
                continue;
            }
            if (i > from) st = encode_plain(t, s + from, i - from, md, &w, ids, err, errlen);
            k3_tok_ids_push(ids, id);
            i += ml;
            from = i;
        }
        if (st == K3_OK && from < len)
            st = encode_plain(t, s + from, len - from, md, &w, ids, err, errlen);
    }
    bpe_ws_free(&w);
    pcre2_match_data_free(md);
    return st;
}

/* ---- decode ------------------------------------------------------------------- */

const uint8_t *k3_tok_token_bytes(const k3_tok *t, int32_t id, size_t *len) {
    if (id >= 0 && id < t->n_ranks) {
        *len = t->span[id].len;
        return t->bytes + t->span[id].off;
    }
    if (id >= t->n_ranks && id - t->n_ranks < t->n_added) {
        *len = t->added_len[id - t->n_ranks];
        return (const uint8_t *)t->added[id - t->n_ranks];
    }
    *len = 0;
    return NULL;
}

/* Two passes (size, then copy) so the output is allocated once. */
k3_status k3_tok_decode(const k3_tok *t, const int32_t *ids, size_t n, char **out, size_t *out_len,
                        size_t *n_unknown, char *err, size_t errlen) {
    size_t total = 0, unk = 0, len;
    for (size_t i = 0; i < n; i++) {
        if (k3_tok_token_bytes(t, ids[i], &len))
            total += len;
        else
            unk++;
    }
    char *buf = malloc(total + 1);
    if (!buf)
        return k3_errf(K3_ERR_NOMEM, err, errlen, "tokenizer: no memory to decode %zu bytes",
                       total);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *b = k3_tok_token_bytes(t, ids[i], &len);
        if (b) memcpy(buf + o, b, len), o += len;
    }
    buf[o] = 0;
    *out = buf;
    *out_len = o;
    if (n_unknown) *n_unknown = unk;
    return K3_OK;
}

/* ---- streaming decoder ---------------------------------------------------------- */

static void stream_put(k3_tok_stream *s, size_t *o, const uint8_t *b, size_t n) {
    if (*o + n + 1 > s->cap) {
        size_t c = s->cap ? s->cap : 256;
        while (c < *o + n + 1) c *= 2;
        s->buf = k3_xrealloc(s->buf, c);
        s->cap = c;
    }
    memcpy(s->buf + *o, b, n);
    *o += n;
}

static const uint8_t REPLACEMENT[3] = {0xEF, 0xBF, 0xBD}; /* U+FFFD */

/* Expected length of a sequence led by c (0: never a valid lead). */
static int lead_len(uint8_t c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

/* Can the held-back prefix pend[0..np) followed by c still become valid? */
static int continues(const uint8_t *pend, int np, uint8_t c) {
    if ((c & 0xC0) != 0x80) return 0;
    if (np == 1) {
        uint8_t l = pend[0];
        if (l == 0xE0) return c >= 0xA0;
        if (l == 0xED) return c <= 0x9F;
        if (l == 0xF0) return c >= 0x90;
        if (l == 0xF4) return c <= 0x8F;
    }
    return 1;
}

/* Byte-at-a-time UTF-8 state machine. Invariant: pend[0..n_pend) is a
 * proper prefix of some valid sequence, so it is either completed by later
 * bytes or, at the first byte that cannot continue it, replaced by one
 * U+FFFD (the Unicode "maximal subpart" practice); the breaking byte is
 * then looked at again as a fresh lead. Output is therefore always valid
 * UTF-8, and valid input passes through unchanged. */
const char *k3_tok_stream_bytes(k3_tok_stream *s, const uint8_t *b, size_t n, size_t *len) {
    size_t o = 0;
    stream_put(s, &o, b, 0); /* make sure buf exists */
    for (size_t i = 0; i < n; i++) {
        uint8_t c = b[i];
        if (s->n_pend) {
            if (continues(s->pend, s->n_pend, c)) {
                s->pend[s->n_pend++] = c;
                if (s->n_pend == lead_len(s->pend[0])) {
                    stream_put(s, &o, s->pend, (size_t)s->n_pend);
                    s->n_pend = 0;
                }
                continue;
            }
            /* The held-back prefix is a maximal invalid subpart. */
            stream_put(s, &o, REPLACEMENT, 3);
            s->n_pend = 0;
        }
        int l = lead_len(c);
        if (l == 1)
            stream_put(s, &o, &c, 1);
        else if (l == 0)
            stream_put(s, &o, REPLACEMENT, 3);
        else
            s->pend[s->n_pend++] = c;
    }
    s->buf[o] = 0;
    *len = o;
    return s->buf;
}

const char *k3_tok_stream_push(const k3_tok *t, k3_tok_stream *s, int32_t id, size_t *len) {
    size_t n = 0;
    const uint8_t *b = k3_tok_token_bytes(t, id, &n);
    return k3_tok_stream_bytes(s, b ? b : (const uint8_t *)"", b ? n : 0, len);
}

const char *k3_tok_stream_flush(k3_tok_stream *s, size_t *len) {
    size_t o = 0;
    stream_put(s, &o, REPLACEMENT, 0);
    if (s->n_pend) stream_put(s, &o, REPLACEMENT, 3);
    s->n_pend = 0;
    s->buf[o] = 0;
    *len = o;
    return s->buf;
}

void k3_tok_stream_reset(k3_tok_stream *s) {
    free(s->buf);
    memset(s, 0, sizeof *s);
}

/* ---- lookups -------------------------------------------------------------------- */

int32_t k3_tok_n_ranks(const k3_tok *t) { return t->n_ranks; }
int32_t k3_tok_n_vocab(const k3_tok *t) { return t->n_ranks + t->n_added; }
int k3_tok_is_added(const k3_tok *t, int32_t id) {
    return id >= t->n_ranks && id - t->n_ranks < t->n_added;
}
int32_t k3_tok_bos(const k3_tok *t) { return t->bos; }
int32_t k3_tok_eos(const k3_tok *t) { return t->eos; }
k3_tok_pattern k3_tok_get_pattern(const k3_tok *t) { return t->pattern; }

int32_t k3_tok_special_id(const k3_tok *t, const char *s) {
    if (!s || !t->n_added) return -1;
    size_t n = strlen(s), ml = 0;
    int32_t id = trie_match(t, (const uint8_t *)s, n, &ml);
    return id >= 0 && ml == n ? id : -1;
}
