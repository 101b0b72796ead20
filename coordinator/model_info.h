/* coordinator/model_info.h: a model directory summed up for doctor and plan:
 * shards, bytes, routed-expert bytes per layer, the dense weights' resident
 * size at load, container or snapshot.
 *
 * Owns: nothing after k3_model_info_read returns (a plain struct).
 * Borrows: common/ckpt (config, safetensors index: every shard header is
 * parsed, no tensor data read). Threads: any, one call at a time per struct.
 */
#ifndef K3_MODEL_INFO_H
#define K3_MODEL_INFO_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/ckpt/config.h"

typedef struct k3_model_info {
    k3_config cfg;
    int n_shards;
    uint64_t total_bytes;                 /* tensor payload of every shard (vision included) */
    uint64_t expert_bytes;                /* routed experts, all layers */
    uint64_t layer_expert[K3_MAX_LAYERS]; /* routed expert bytes of each layer */
    uint64_t slot_bytes;                  /* one expert (its six tensors) */
    uint64_t dense_resident; /* dense weights in RAM at load (bits 4/8/8, or as prepared) */
    uint64_t layer_dense[K3_MAX_LAYERS];   /* of dense_resident: each layer's */
    uint64_t layer_overlap[K3_MAX_LAYERS]; /* of layer_dense: what a MoE step computes while
                                              its experts are read (latent down projection,
                                              shared experts: common/layers/moe.c) */
    int is_container;                      /* prepared U8 + .qs matrices present */
} k3_model_info;

/* Parses config.json and every shard header of dir (with extra shard
 * directories dirs[0..n_dirs)). */
k3_status k3_model_info_read(k3_model_info *mi, const char *dir, const char *const *dirs,
                             int n_dirs, char *err, size_t errlen);

#endif
