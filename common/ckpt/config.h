/* common/ckpt/config.h: the model configuration (docs/MODEL.md 1.1-1.2).
 *
 * Owns: parsing config.json (keys under "text_config" when that object
 * exists, else at the root; bos/eos at the root first, then text_config),
 * validating every key against common/base/limits.h, and deriving the per-layer
 * schedules (KDA or MLA, dense or MoE, AttnRes snapshot boundaries).
 * Borrows: nothing; the struct is plain data, safe to copy and to share
 * read-only between threads.
 */
#ifndef K3_CONFIG_H
#define K3_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"

typedef struct k3_config {
    int hidden;          /* D: hidden_size (K3 7168) */
    int n_layers;        /* num_hidden_layers (K3 93), after any truncation */
    int vocab;           /* vocab_size (K3 163840) */
    int first_dense;     /* first_k_dense_replace (K3 1) */
    int dense_inter;     /* intermediate_size (K3 33792) */
    int n_heads;         /* MLA num_attention_heads (K3 96) */
    int q_lora;          /* q_lora_rank (1536) */
    int kv_lora;         /* kv_lora_rank (512) */
    int qk_nope;         /* qk_nope_head_dim (128) */
    int qk_rope;         /* qk_rope_head_dim (64, never rotated) */
    int v_head;          /* v_head_dim (128) */
    int n_experts;       /* num_experts (896) */
    int topk;            /* num_experts_per_token (16) */
    int moe_inter;       /* moe_intermediate_size (3072) */
    int latent;          /* routed_expert_hidden_size (3584) */
    int n_shared;        /* num_shared_experts (2; fused width n_shared*moe_inter) */
    int res_bs;          /* attn_res_block_size (12) */
    float situ_b1;       /* activation_situ_beta (4) */
    float situ_b2;       /* activation_situ_linear_beta (25) */
    float eps;           /* rms_norm_eps (default 1e-5) */
    int kda_heads;       /* linear_attn_config.num_heads (96) */
    int kda_hd;          /* linear_attn_config.head_dim (128) */
    int conv_k;          /* linear_attn_config.short_conv_kernel_size (4) */
    float gate_lb;       /* linear_attn_config.gate_lower_bound (default -5) */
    int bos;             /* bos_token_id, -1 if absent */
    int n_eos;           /* number of eos ids (0..K3_MAX_EOS) */
    int eos[K3_MAX_EOS]; /* eos_token_id list */

    /* per-layer schedules, [n_layers] */
    uint8_t is_kda[K3_MAX_LAYERS];      /* 1 = KDA, 0 = gated MLA */
    uint8_t is_moe[K3_MAX_LAYERS];      /* 1 = LatentMoE, 0 = dense MLP */
    uint8_t is_boundary[K3_MAX_LAYERS]; /* 1 when i % res_bs == 0 (snapshot) */

    /* derived */
    int qk_head;       /* qk_nope + qk_rope (192) */
    int kda_proj;      /* kda_heads * kda_hd (12288) */
    int shared_inter;  /* n_shared * moe_inter (6144) */
    int n_layers_full; /* num_hidden_layers before truncation */
} k3_config;

/* Parses and validates <dir>/config.json. max_layers > 0 truncates the stack
 * (K3_LAYERS) without changing the schedules. */
k3_status k3_config_load(k3_config *cfg, const char *dir, int max_layers, char *err, size_t errlen);

/* Same, from a JSON text in memory (tests, fuzzing). */
k3_status k3_config_parse(k3_config *cfg, const char *json, size_t len, int max_layers, char *err,
                          size_t errlen);

/* Number of AttnRes snapshots taken by layers [0, layer_end). */
int k3_config_snapshots_before(const k3_config *cfg, int layer_end);

/* A 64-bit FNV-1a fingerprint of every field above (not the raw text), so two
 * processes can check they run the same model geometry. */
uint64_t k3_config_fingerprint(const k3_config *cfg);

#endif
