/* coordinator/cli_prompt.h: where the command line's prompt comes from
 * besides an argument (docs/CLUSTER.md "Prompts"): a file, standard input,
 * or one chat turn rendered through the chat template.
 *
 * Owns what it returns (the caller frees it). Borrows the tokenizer.
 * Threads: the main thread, before the generation.
 */
#ifndef K3_CLI_PROMPT_H
#define K3_CLI_PROMPT_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/text/tokenizer.h"

/* The whole of path ("-" = standard input) into a NUL-terminated malloc'd
 * string; at most K3_MAX_PROMPT_FILE_BYTES. Errors name the file. */
k3_status k3_cli_read_text(const char *path, char **out, size_t *len, char *err, size_t errlen);

/* One user turn (after an optional system message) rendered with the chat
 * template, the think channel open when think is 1: [BOS] + the rendering
 * into *ids [*n] (malloc'd); *think_first = 1 when the generation starts in
 * the think channel. */
k3_status k3_cli_chat_ids(const k3_tok *tok, const char *system, const char *user, int think,
                          int32_t **ids, int *n, int *think_first, char *err, size_t errlen);

#endif
