/* coordinator/chat_prompt.c: see chat_prompt.h. */
#include "coordinator/chat_prompt.h"

#include "common/base/limits.h"

k3_status k3_chat_prompt_render(const k3_tok *tok, const k3_chat_req *cr, k3_chat_out *out,
                                int *too_long, char *err, size_t errlen) {
    *too_long = 0;
    k3_status st = k3_chat_render(tok, cr, out, err, errlen);
    if (st) {
        k3_chat_out_free(out);
        return st;
    }
    if (out->ids.n > (size_t)K3_MAX_CTX) {
        size_t n = out->ids.n;
        k3_chat_out_free(out);
        *too_long = 1;
        return k3_errf(K3_ERR_LIMIT, err, errlen,
                       "the rendered chat has %zu tokens, more than %d (K3_MAX_CTX)", n,
                       K3_MAX_CTX);
    }
    return K3_OK;
}

k3_status k3_chat_prompt_filter(const k3_tok *tok, const k3_config *cfg, k3_chat_channel start,
                                k3_chat_filter **out, char *err, size_t errlen) {
    k3_chat_filter_opts fo = {.start = start, .stop_ids = cfg->eos, .n_stop_ids = cfg->n_eos};
    return k3_chat_filter_open(out, tok, &fo, err, errlen);
}
