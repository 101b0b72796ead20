/* coordinator/chat_prompt.h: the chat prompt of a generation and the filter
 * over its output, shared by the HTTP API (coordinator/serve_job.c) and
 * the chat prompt (coordinator/cmd_chat.c), so both render a conversation
 * to exactly the same ids.
 *
 * Owns: nothing past a call (the rendering and the filter go to the caller).
 * Borrows: the tokenizer and the model config during the call.
 * Threads: reentrant.
 */
#ifndef K3_CHAT_PROMPT_H
#define K3_CHAT_PROMPT_H

#include <stddef.h>

#include "common/base/err.h"
#include "common/ckpt/config.h"
#include "common/text/chat.h"

/* k3_chat_render(tok, cr) into *out, then refuses a rendering longer than
 * K3_MAX_CTX tokens (K3_ERR_LIMIT naming both counts, *too_long = 1; the
 * renderer's own errors leave it 0). On failure *out is freed. */
k3_status k3_chat_prompt_render(const k3_tok *tok, const k3_chat_req *cr, k3_chat_out *out,
                                int *too_long, char *err, size_t errlen);

/* The output filter of a generation that starts in channel start: stops at
 * <|end_of_msg|> and at the config's eos ids. K3_ERR_MISSING when the
 * tokenizer lacks the XTML markers. */
k3_status k3_chat_prompt_filter(const k3_tok *tok, const k3_config *cfg, k3_chat_channel start,
                                k3_chat_filter **out, char *err, size_t errlen);

#endif
