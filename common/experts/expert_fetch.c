/* common/experts/expert_fetch.c: the store as seen by the Vulkan tier
 * (common/vk/vk_tier.c): one expert's bytes lent outside a MoE step (its
 * uploads), and the usage of experts a step computed without a batch.
 *
 * Owns nothing: a one-expert batch, marked quiet like the warm start's
 * (expert_usage.c), so the read counts neither as usage nor in the store's
 * totals. Borrows the store. Threads: any thread, like every store call; the
 * batch pins one slot of the layer for the time of the callback. */
#include "common/experts/experts_int.h"

k3_status k3_experts_fetch(k3_experts *s, int layer, int32_t e,
                           k3_status (*fn)(void *ctx, const k3_expert_view *v, char *err,
                                           size_t errlen),
                           void *ctx, char *err, size_t errlen) {
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->loaded)
        return k3_errf(K3_ERR_ARG, err, errlen, "expert fetch: layer %d is not loaded here", layer);
    k3_expert_batch *b = NULL;
    k3_status st = k3_experts_batch_open(&b, s, layer, &e, 1, NULL, err, errlen);
    if (b) b->quiet = 1;
    k3_expert_view v;
    if (st == K3_OK) st = k3_experts_batch_get(b, 0, &v, err, errlen);
    if (st == K3_OK) {
        st = fn(ctx, &v, err, errlen);
        k3_experts_batch_put(b, 0);
    }
    int admitted = b ? b->next_admit : 0;
    k3_experts_batch_close(&b);
    if (admitted) { /* admission counted it: not usage */
        pthread_mutex_lock(&L->mu);
        L->usage[e]--;
        pthread_mutex_unlock(&L->mu);
    }
    return st;
}

void k3_experts_count_use(k3_experts *s, int layer, const int32_t *ids, int n) {
    exp_layer *L = exp_layer_of(s, layer);
    if (!L || !L->usage) return;
    pthread_mutex_lock(&L->mu);
    for (int i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < s->cfg.n_experts) L->usage[ids[i]]++;
    pthread_mutex_unlock(&L->mu);
}
