/* common/text/chat.h: XTML chat rendering and the output filter (docs/INTERFACES.md 2).
 *
 * Owns: turning a conversation (OpenAI-shaped messages, tools, tool_choice,
 * thinking on/off, generation prompt or continuation) into token ids exactly
 * as docs/INTERFACES.md 2.1-2.4 lays them out, and the reverse direction: a
 * streaming filter over generated ids that hides structural tokens, splits
 * reasoning from the response, extracts tool calls and reports the finish.
 * Borrows: the k3_tok (must outlive every render call and filter) and the
 * request's strings (only during k3_chat_render).
 * Threads: k3_chat_render is reentrant; a k3_chat_filter belongs to one
 * generation and one thread at a time.
 *
 * Safety: only the template emits the four markers (<|open|> <|close|>
 * <|sep|> <|end_of_msg|>); every text piece, user content included, goes
 * through the untrusted encoder, so "<|open|>" typed by a user is plain text.
 * Each piece is encoded on its own (piece boundaries are token boundaries,
 * 2.1); BOS is prepended once. Strings are NUL-terminated: content with an
 * embedded NUL is cut there (the HTTP layer refuses "\u0000" first).
 */
#ifndef K3_CHAT_H
#define K3_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/text/tokenizer.h"

typedef enum k3_chat_tool_choice {
    K3_CHAT_TOOLS_AUTO = 0, /* declare the tools (if any) */
    K3_CHAT_TOOLS_NONE,     /* no declaration at all */
    K3_CHAT_TOOLS_REQUIRED, /* declaration + "You MUST call tools" message */
    K3_CHAT_TOOLS_FORCED    /* tools filtered to tool_choice_name + message */
} k3_chat_tool_choice;

typedef struct k3_chat_tool_call {
    const char *id;        /* the id tool results refer to, or NULL */
    const char *name;      /* function name, 1..K3_CHAT_MAX_NAME bytes */
    const char *arguments; /* JSON text. An object renders as typed
                              <argument> blocks keeping each non-string
                              value's source text (1e2 stays 1e2); other
                              valid JSON falls back to one <json> block;
                              text that is not JSON is an error */
} k3_chat_tool_call;

typedef struct k3_chat_msg {
    const char *role;                    /* system developer user assistant tool */
    const char *content;                 /* NULL = empty */
    const char *reasoning_content;       /* assistant; NULL = none */
    const k3_chat_tool_call *tool_calls; /* assistant; [n_tool_calls] */
    int n_tool_calls;                    /* 0..K3_CHAT_MAX_CALLS */
    const char *tool_call_id;            /* tool: which call this result answers */
    const char *name;                    /* tool: function name if no id resolves */
} k3_chat_msg;

typedef struct k3_chat_req {
    const k3_chat_msg *msgs;
    int n_msgs;
    const char *tools_json; /* OpenAI "tools" array as JSON text, or NULL */
    k3_chat_tool_choice tool_choice;
    const char *tool_choice_name; /* K3_CHAT_TOOLS_FORCED: the function */
    int enable_thinking;          /* think channel in prompt and history */
    int add_generation_prompt;    /* 0 + trailing assistant = continuation */
    int no_bos;                   /* 1: no BOS (a --wire-test style dump) */
} k3_chat_req;

/* Where the model's output starts. */
typedef enum k3_chat_channel {
    K3_CHAT_CH_RESPONSE = 0, /* visible content */
    K3_CHAT_CH_THINK         /* reasoning */
} k3_chat_channel;

typedef struct k3_chat_out {
    k3_tok_ids ids;          /* [BOS] + the rendering, owned */
    char *text;              /* text form == decode(ids): markers as their
                                content, NUL-terminated, owned */
    size_t text_len;         /* bytes */
    k3_chat_channel channel; /* channel the generation starts in */
    int continuation;        /* 1: the trailing assistant turn was left open */
} k3_chat_out;

/* Renders req. Errors (K3_ERR_ARG / FORMAT / LIMIT / MISSING) name the
 * message and call: unknown role, tool_calls on a non-assistant, more than
 * K3_CHAT_MAX_CALLS calls or K3_CHAT_MAX_ARGS arguments, a name or argument
 * key longer than K3_CHAT_MAX_NAME, arguments that are not JSON, a tool
 * result whose name cannot be resolved, a forced tool that is not declared,
 * tools_json that is not an array, a continuation ending in whitespace, and
 * a tokenizer without the four markers. Tool results that follow an
 * assistant turn are re-sorted into its tool_calls order via tool_call_id,
 * take their names from the calls, and otherwise use `name` or their
 * position. With a continuation, a tool-choice message goes before the open
 * turn. */
k3_status k3_chat_render(const k3_tok *tok, const k3_chat_req *req, k3_chat_out *out, char *err,
                         size_t errlen);
void k3_chat_out_free(k3_chat_out *out);
/* Appends to ids the tokens that close an assistant turn the model left
 * open in channel ch (it stopped at max_tokens or was cancelled): from the
 * think channel <|close|>think<|sep|><|open|>response<|sep|>, then
 * <|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>, pieces as
 * k3_chat_render encodes them. So a caller that keeps the ids a session
 * has seen can append the next message without re-rendering the history.
 * Fails (K3_ERR_MISSING) when tok lacks the four markers. */
k3_status k3_chat_close_turn(const k3_tok *tok, k3_chat_channel ch, k3_tok_ids *ids, char *err,
                             size_t errlen);

/* Python json.dumps(v, separators=(",", ":"), sort_keys=True,
 * ensure_ascii=False) of the JSON text in[0..n), into a malloc'd string
 * (the tool declaration body). jansson parses; the printing is our own
 * because jansson writes reals with 17 digits ("0.10000000000000001") and
 * \u001B in upper case where Python writes "0.1" and "\u001b". */
k3_status k3_chat_json_py(const char *in, size_t n, char **out, size_t *out_len, char *err,
                          size_t errlen);

/* ---- output side ------------------------------------------------------- */

typedef struct k3_chat_arg {
    char *key;   /* unescaped attribute, owned */
    char *type;  /* string number boolean null object array, owned */
    char *value; /* raw text between the tags, owned, NUL-terminated */
    size_t value_len;
} k3_chat_arg;

typedef struct k3_chat_call {
    char *name;        /* unescaped tool attribute, owned */
    int index;         /* index attribute, else 1-based position */
    k3_chat_arg *args; /* [n_args], owned */
    int n_args;
    char *json;      /* raw text of a <json> fallback block, or NULL */
    char *arguments; /* OpenAI arguments: a JSON object text (typed args
                        re-assembled, strings escaped) or the json block */
} k3_chat_call;

typedef struct k3_chat_filter k3_chat_filter;

typedef struct k3_chat_filter_opts {
    k3_chat_channel start;   /* k3_chat_out.channel of the prompt */
    const int32_t *stop_ids; /* config.json eos ids besides <|end_of_msg|> */
    int n_stop_ids;
} k3_chat_filter_opts;

/* What one generated id changed. Pointers stay valid until the next push. */
typedef struct k3_chat_delta {
    const char *reasoning; /* new reasoning text, valid UTF-8 */
    size_t reasoning_len;
    const char *content; /* new visible text, valid UTF-8 */
    size_t content_len;
    int n_new_calls; /* calls completed by this id: the last ones */
    int done;        /* 1: a stop id arrived (it is not shown) */
} k3_chat_delta;

/* Fails (K3_ERR_MISSING) when tok lacks the four markers. */
k3_status k3_chat_filter_open(k3_chat_filter **out, const k3_tok *tok,
                              const k3_chat_filter_opts *opts, char *err, size_t errlen);
void k3_chat_filter_close(k3_chat_filter **f);
/* Feeds one generated id. A <|open|>/<|close|> starts a hidden tag read up
 * to <|sep|>: `think` and `response` switch channels, `tools` / `call` /
 * `argument` / `json` build tool calls (attribute values unescaped &quot;
 * then &amp;), anything else is dropped; other added tokens are hidden.
 * <|end_of_msg|> and stop ids end the stream; later ids are ignored. */
void k3_chat_filter_push(k3_chat_filter *f, int32_t id, k3_chat_delta *d);
/* The generation ended without a stop id (max_tokens): flushes held-back
 * text. An unclosed tools block keeps its complete calls; a partial call
 * is dropped. */
void k3_chat_filter_finish(k3_chat_filter *f, k3_chat_delta *d);
/* The channel the output is in now (where k3_chat_close_turn starts). */
k3_chat_channel k3_chat_filter_channel(const k3_chat_filter *f);
int k3_chat_filter_n_calls(const k3_chat_filter *f);
const k3_chat_call *k3_chat_filter_call(const k3_chat_filter *f, int i);
/* "stop", "tool_calls" (stopped with calls), "length" (finish called), or
 * NULL while the generation runs. */
const char *k3_chat_filter_finish_reason(const k3_chat_filter *f);

#endif
