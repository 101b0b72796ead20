/* coordinator/chat_conv.h: the conversation of `k3-coordinator chat`
 * (docs/CHAT.md): its messages as text, and the ids its engine session has
 * seen, so the next turn extends them and the engine reuses the state.
 *
 * Owns: the messages (role, content, reasoning; owned strings), the
 * transcript (the prompt and generated ids of the last turn, the stop id
 * included) and the prompt of the last turn (for :retry).
 * Borrows: the tokenizer during calls.
 * Threads: one thread (the chat's main thread).
 *
 * The next prompt is the transcript, the closing tags of an answer that
 * stopped without a stop id (max tokens, Ctrl-C: k3_chat_close_turn), and
 * the messages added since, rendered without BOS by the same code as the
 * HTTP API (coordinator/chat_prompt.h). A conversation without transcript
 * (the first turn, after :load, :system, :think on/off) is rendered whole,
 * exactly as `serve` renders the same messages. Both agree whenever the
 * generated ids are the tokenizer's own encoding of the answer's text; the
 * transcript is what the model really saw, and what the session holds.
 */
#ifndef K3_CHAT_CONV_H
#define K3_CHAT_CONV_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/text/chat.h"

typedef struct chat_msg {
    char *role;      /* system user assistant (owned) */
    char *content;   /* owned, "" when empty */
    char *reasoning; /* assistant: owned or NULL */
} chat_msg;

typedef struct chat_conv {
    chat_msg *m; /* [n] */
    int n, cap;
    k3_tok_ids ids;             /* the transcript, valid when has_ids */
    int has_ids;                /* ids covers m[0, n_covered) */
    int n_covered;              /* messages the transcript holds */
    int turn_open;              /* 1: the last answer stopped without a stop id ...;
                                   -1: :retry, the next prompt is last_prompt */
    k3_chat_channel open_ch;    /* ... in this channel */
    k3_tok_ids last_prompt;     /* prompt of the last answer (:retry) ... */
    k3_chat_channel last_start; /* ... and the channel it started in */
} chat_conv;

void chat_conv_free(chat_conv *c);
/* Appends a message (copies the strings; reasoning may be NULL). */
void chat_conv_add(chat_conv *c, const char *role, const char *content, const char *reasoning);
/* Drops every message but a leading system one (kept when keep_system)
 * and the transcript. */
void chat_conv_reset(chat_conv *c, int keep_system);
/* Sets (text non-NULL and non-empty) or removes the leading system
 * message; the transcript is dropped (the next turn renders everything). */
void chat_conv_set_system(chat_conv *c, const char *text);
/* Forgets the transcript: the next prompt is rendered whole. */
void chat_conv_drop_ids(chat_conv *c);

/* The prompt of the next answer into *out (BOS + XTML ids) and the channel
 * it starts in. A rendering past K3_MAX_CTX is K3_ERR_LIMIT. */
k3_status chat_conv_prompt(chat_conv *c, const k3_tok *tok, int thinking, k3_tok_ids *out,
                           k3_chat_channel *start, char *err, size_t errlen);
/* After an answer to prompt (which started in channel start): appends the assistant message
 * (content, reasoning may be NULL) and makes the transcript prompt + gen[0, n_gen); stopped: gen
 * ends with a stop id; else the turn is open in channel ch. */
void chat_conv_answered(chat_conv *c, const k3_tok_ids *prompt, k3_chat_channel start,
                        const int32_t *gen, int n_gen, int stopped, k3_chat_channel ch,
                        const char *content, const char *reasoning);
/* :retry: drops the last assistant message; the next prompt is the one it
 * answered. K3_ERR_STATE when the conversation does not end in an answer. */
k3_status chat_conv_retry(chat_conv *c, char *err, size_t errlen);

/* :save: {"messages":[{"role","content"[,"reasoning_content"]}...],
 * "enable_thinking":B}, a valid body for POST /v1/chat/completions, plus
 * the transcript ("k3shard_ids", "k3shard_open", "k3shard_channel"; the
 * API ignores them) so a :load continues from exactly the same ids. */
k3_status chat_conv_save(const chat_conv *c, int thinking, const char *path, char *err,
                         size_t errlen);
/* :load: a file as written by :save, or a bare messages array. Messages
 * are checked by the HTTP API's parser (coordinator/serve_api.h); tool
 * calls and tool results are refused (the chat prompt has no tools).
 * *thinking is set when the file says enable_thinking. A transcript with
 * ids outside [0, vocab) is ignored (the messages are rendered whole). On
 * failure the conversation is unchanged. */
k3_status chat_conv_load(chat_conv *c, const char *path, int vocab, int *thinking, char *err,
                         size_t errlen);

#endif
