/* coordinator/model_info.c: a model directory summed up (model_info.h). */
#include "coordinator/model_info.h"

#include <stdlib.h>
#include <string.h>

#include "common/ckpt/container.h"
#include "common/ckpt/safetensors.h"

k3_status k3_model_info_read(k3_model_info *mi, const char *dir, const char *const *dirs,
                             int n_dirs, char *err, size_t errlen) {
    memset(mi, 0, sizeof *mi);
    k3_status st = k3_config_load(&mi->cfg, dir, 0, err, errlen);
    if (st) return st;
    st_index *idx = NULL;
    st_open_opts so = {dir, dirs, n_dirs};
    st = st_open(&idx, &so, err, errlen);
    if (!st) st = st_open_all(idx, err, errlen);
    if (st) {
        st_close(&idx);
        return st;
    }
    mi->n_shards = st_shard_count(idx);
    const char *L = "model.layers.";
    for (int i = 0; i < st_tensor_count(idx); i++) {
        const st_tensor *t = st_tensor_at(idx, i);
        mi->total_bytes += t->nbytes;
        /* the engine's defaults (docs/MODEL.md 4.2): bits 4, mla 8, head 8 */
        int cls = k3_repack_class(t->name, &mi->cfg, 4, 8, 8);
        if (cls == K3_RP_DROP) continue;
        if (cls == K3_RP_EXPERT) {
            mi->expert_bytes += t->nbytes;
            const char *p = strstr(t->name, L);
            int layer = p ? atoi(p + strlen(L)) : -1;
            if (layer >= 0 && layer < K3_MAX_LAYERS) mi->layer_expert[layer] += t->nbytes;
            continue;
        }
        if (strstr(t->name, "embed_tokens")) continue; /* rows read on demand */
        size_t len = strlen(t->name);
        uint64_t add;
        if (t->dtype == ST_U8 || (len > 3 && !strcmp(t->name + len - 3, ".qs"))) {
            mi->is_container |= t->dtype == ST_U8;
            add = t->nbytes; /* prepared: as stored */
        } else {
            uint64_t el = t->nbytes / st_dtype_size(t->dtype);
            if (cls == 4)
                add = el / 2 + el / 64 * 4;
            else if (cls == 8)
                add = el + (t->rank == 2 ? (uint64_t)t->shape[0] * 4 : 0);
            else
                add = el * 4; /* f32 at load */
        }
        mi->dense_resident += add;
        const char *p = strstr(t->name, L);
        int layer = p ? atoi(p + strlen(L)) : -1;
        if (layer >= 0 && layer < K3_MAX_LAYERS) {
            mi->layer_dense[layer] += add;
            if (strstr(t->name, "routed_expert_down_proj") || strstr(t->name, "shared_experts."))
                mi->layer_overlap[layer] += add;
        }
    }
    int moe = 0;
    for (int l = 0; l < mi->cfg.n_layers; l++) moe += mi->cfg.is_moe[l];
    if (moe && mi->cfg.n_experts)
        mi->slot_bytes = mi->expert_bytes / (uint64_t)moe / (uint64_t)mi->cfg.n_experts;
    st_close(&idx);
    return K3_OK;
}
