/* common/text/tokenizer.h: the Kimi K3 tokenizer (docs/INTERFACES.md 1).
 *
 * Owns: the rank table read from a checkpoint's tiktoken.model (the rank IS
 * the id), the 256 added tokens above it from tokenizer_config.json
 * (added_tokens_decoder; gaps filled with <|reserved_token_<id>|>), the
 * pre-tokenizer (the Kimi split regex of 1.3, or o200k's for tests, through
 * PCRE2 in UTF mode with JIT), rank-BPE exactly as tiktoken does it (1.4) but
 * with a heap so long pieces cost O(n log n), the trusted/untrusted split for
 * added tokens (1.5), decoding and a streaming decoder (1.6).
 * Borrows: nothing after open; the directory is read once.
 * Threads: a k3_tok is immutable after open, so any number of threads may
 * encode and decode with it at once; each k3_tok_stream belongs to one caller.
 *
 * Invalid UTF-8 in the input is never an error: every byte that does not
 * start a complete, shortest-form UTF-8 sequence (no surrogates, <= U+10FFFF)
 * is a piece of its own and encodes as its single-byte token; the valid runs
 * around it are pre-tokenized as if the byte were the end / start of the text.
 * Not handled: code points assigned after Unicode 14 (PCRE2 10.42's tables)
 * may be classed differently than tiktoken's Unicode 15.1 tables, except Han,
 * which uses explicit Unicode 15.1 Script=Han ranges (docs/INTERFACES.md 1.3).
 */
#ifndef K3_TOKENIZER_H
#define K3_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"

typedef struct k3_tok k3_tok;

/* Which split regex the pre-tokenizer runs. */
typedef enum k3_tok_pattern {
    K3_TOK_PATTERN_KIMI = 0, /* docs/INTERFACES.md 1.3 (Han runs, no '/' tail) */
    K3_TOK_PATTERN_O200K     /* tiktoken's o200k_base pat_str */
} k3_tok_pattern;

/* An in-memory tokenizer source (tests, tools). */
typedef struct k3_tok_src {
    const char *model;       /* text of a tiktoken.model file, borrowed */
    size_t model_len;        /* bytes */
    const char *config_json; /* text of tokenizer_config.json, or NULL: no
                                added tokens at all (ids stop at n_ranks) */
    size_t config_len;       /* bytes */
    k3_tok_pattern pattern;
    int64_t vocab_size;      /* > 0: n_ranks + 256 and every added id must
                                fit below it; 0: unchecked */
    const char *name;        /* for messages ("tiny/tiktoken.model") */
    const char *config_name; /* for messages, NULL: "tokenizer_config.json" */
} k3_tok_src;

/* A growable id vector; encode appends to it. Free with k3_tok_ids_free. */
typedef struct k3_tok_ids {
    int32_t *v;    /* [n], owned */
    size_t n, cap; /* ids used / allocated */
} k3_tok_ids;

/* Opens DIR/tiktoken.model + DIR/tokenizer_config.json with the Kimi
 * pattern. Fails (K3_ERR_MISSING / FORMAT / LIMIT) on a missing file, bad
 * base64, a duplicate rank or token, a rank gap, a missing single byte, an
 * added id inside the rank table or beyond the 256 added slots. */
k3_status k3_tok_open(k3_tok **out, const char *dir, char *err, size_t errlen);
/* Same, with vocab_size (config.json's; 0 = unchecked) checked too. */
k3_status k3_tok_open_dir(k3_tok **out, const char *dir, int64_t vocab_size, char *err,
                          size_t errlen);
/* From memory, with an explicit pattern (o200k ranks + o200k regex, ...). */
k3_status k3_tok_open_mem(k3_tok **out, const k3_tok_src *src, char *err, size_t errlen);
void k3_tok_close(k3_tok **tok);

/* Appends the ids of text[0..len) to *ids. trusted = 0 (user content): added
 * tokens are never recognized, "<|open|>" typed by a user is plain text.
 * trusted = 1: every added token's content is matched first (earliest
 * position, then the longest content), the text between is encoded plainly.
 * Errors: K3_ERR_LIMIT when len > K3_TOK_MAX_INPUT, K3_ERR_NOMEM. */
k3_status k3_tok_encode(const k3_tok *tok, const char *text, size_t len, int trusted,
                        k3_tok_ids *ids, char *err, size_t errlen);

/* Appends the bytes of ids[0..n) to a malloc'd NUL-terminated buffer
 * (*out, *out_len, owned by the caller). Added ids decode to their content;
 * unknown ids are skipped and counted in *n_unknown (may be NULL). The bytes
 * may be invalid UTF-8 when the ids are. */
k3_status k3_tok_decode(const k3_tok *tok, const int32_t *ids, size_t n, char **out,
                        size_t *out_len, size_t *n_unknown, char *err, size_t errlen);

/* Bytes of one id (NULL for an unknown id); *len set. Not NUL-terminated. */
const uint8_t *k3_tok_token_bytes(const k3_tok *tok, int32_t id, size_t *len);

int32_t k3_tok_n_ranks(const k3_tok *tok); /* base ids [0, n_ranks) */
int32_t k3_tok_n_vocab(const k3_tok *tok); /* n_ranks + added (0 or 256) */
int k3_tok_is_added(const k3_tok *tok, int32_t id);
/* Id of the added token whose content is exactly s ("<|open|>"), or -1. */
int32_t k3_tok_special_id(const k3_tok *tok, const char *s);
/* bos/eos from tokenizer_config.json's bos_token / eos_token when they name
 * an added token, else "[BOS]" / "[EOS]", else -1. The stop token of a chat
 * turn is <|end_of_msg|> (config.json's eos_token_id), not this eos. */
int32_t k3_tok_bos(const k3_tok *tok);
int32_t k3_tok_eos(const k3_tok *tok);
k3_tok_pattern k3_tok_get_pattern(const k3_tok *tok);

void k3_tok_ids_free(k3_tok_ids *ids);
/* Appends one id (aborts on OOM: ids vectors are sized by our own output). */
void k3_tok_ids_push(k3_tok_ids *ids, int32_t id);

/* Streaming decoder: feed ids (or raw bytes) one at a time; it returns only
 * complete, valid UTF-8, holding back an incomplete trailing sequence. Bytes
 * that can never become valid UTF-8 come out as U+FFFD, one per maximal
 * invalid subpart. Zero-initialise, or call k3_tok_stream_reset. */
typedef struct k3_tok_stream {
    uint8_t pend[4]; /* incomplete sequence held back */
    int n_pend;      /* bytes in pend, 0..3 */
    char *buf;       /* output of the last call, owned */
    size_t cap;      /* bytes allocated in buf */
} k3_tok_stream;

/* Returns a pointer to the newly complete text (valid until the next call on
 * s), length in *len; unknown ids give nothing. */
const char *k3_tok_stream_push(const k3_tok *tok, k3_tok_stream *s, int32_t id, size_t *len);
const char *k3_tok_stream_bytes(k3_tok_stream *s, const uint8_t *b, size_t n, size_t *len);
/* End of stream: a held-back incomplete sequence comes out as U+FFFD. */
const char *k3_tok_stream_flush(k3_tok_stream *s, size_t *len);
void k3_tok_stream_reset(k3_tok_stream *s); /* frees buf, clears state */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if s[0] does not start
 * one (shortest form, no surrogates, <= U+10FFFF). */
int k3_utf8_seq_len(const uint8_t *s, size_t n);

#endif
