/* coordinator/cli_prompt.c: prompts from files, stdin and one chat turn
 * (cli_prompt.h). A prompt too long for the argument list ("Argument list
 * too long" at ~128 KiB per argument) comes through --file or "-". */
#include "coordinator/cli_prompt.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/limits.h"
#include "common/text/chat.h"

k3_status k3_cli_read_text(const char *path, char **out, size_t *len, char *err, size_t errlen) {
    *out = NULL;
    *len = 0;
    int is_stdin = !strcmp(path, "-");
    const char *name = is_stdin ? "standard input" : path;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) return k3_errf(K3_ERR_IO, err, errlen, "--file %s: %s", path, strerror(errno));
    size_t cap = 65536, n = 0;
    char *buf = k3_xmalloc(cap + 1);
    k3_status st = K3_OK;
    for (;;) {
        if (n == cap) {
            if (cap >= K3_MAX_PROMPT_FILE_BYTES) {
                st = k3_errf(K3_ERR_LIMIT, err, errlen, "prompt from %s: more than %u bytes", name,
                             K3_MAX_PROMPT_FILE_BYTES);
                break;
            }
            cap = cap * 2 > K3_MAX_PROMPT_FILE_BYTES ? K3_MAX_PROMPT_FILE_BYTES : cap * 2;
            buf = k3_xrealloc(buf, cap + 1);
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f))
                st = k3_errf(K3_ERR_IO, err, errlen, "prompt from %s: read: %s", name,
                             strerror(errno));
            break;
        }
    }
    if (!is_stdin) fclose(f);
    if (!st && n == 0) st = k3_errf(K3_ERR_ARG, err, errlen, "prompt from %s: empty", name);
    if (st) {
        free(buf);
        return st;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return K3_OK;
}

k3_status k3_cli_chat_ids(const k3_tok *tok, const char *system, const char *user, int think,
                          int32_t **ids, int *n, int *think_first, char *err, size_t errlen) {
    k3_chat_msg msgs[2];
    int nm = 0;
    if (system) msgs[nm++] = (k3_chat_msg){.role = "system", .content = system};
    msgs[nm++] = (k3_chat_msg){.role = "user", .content = user};
    k3_chat_req req = {
        .msgs = msgs, .n_msgs = nm, .enable_thinking = think, .add_generation_prompt = 1};
    k3_chat_out out;
    memset(&out, 0, sizeof out);
    k3_status st = k3_chat_render(tok, &req, &out, err, errlen);
    if (st) {
        k3_chat_out_free(&out);
        return st;
    }
    *n = (int)out.ids.n;
    *ids = k3_xmalloc(out.ids.n * sizeof **ids);
    memcpy(*ids, out.ids.v, out.ids.n * sizeof **ids);
    *think_first = out.channel == K3_CHAT_CH_THINK;
    k3_chat_out_free(&out);
    return K3_OK;
}
