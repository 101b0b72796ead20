/* common/vk/vk.h: the Vulkan expert tier's device side (docs/VULKAN.md): one
 * compute device opened on request, MXFP4 routed experts uploaded to it as
 * the shard's bytes, and the expert computed there (gate, up, SiTU, down;
 * docs/MODEL.md 3.6, 4.1) for a batch of (position, rank) pairs.
 *
 * Owns: the instance, device, queue, the compute pipeline built from the
 * SPIR-V embedded at build time (common/vk/shaders/ .comp files, compiled by
 * glslc), the activation buffers, and every uploaded expert's buffer (a
 * byte budget caps their sum).
 * Borrows: the weight bytes only during k3_vk_expert_upload (copied).
 * Threads: k3_vk_expert_apply is called by one thread at a time (the caller
 * serialises); uploads and frees of other experts may run on another thread
 * beside it (the byte count has its own lock; the Vulkan objects they touch
 * are their own). Different k3_vk handles are independent.
 *
 * Built without Vulkan (no glslc or no vulkan headers at build time: no
 * K3_HAVE_VK), k3_vk_open fails with K3_ERR_STATE saying so and
 * k3_vk_built() is 0. */
#ifndef K3_VK_H
#define K3_VK_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/kernels/kernels.h"

typedef struct k3_vk k3_vk;
typedef struct k3_vk_expert k3_vk_expert;

/* 1 when this build has the Vulkan tier compiled in (K3_HAVE_VK). */
int k3_vk_built(void);

/* Opens physical device `device` (index in vkEnumeratePhysicalDevices
 * order) with a budget of budget_gb GB (10^9 bytes) for expert buffers;
 * budget_gb <= 0 means the device's largest heap. Errors: K3_ERR_STATE for
 * a build without Vulkan, K3_ERR_MISSING when there is no Vulkan device
 * (or no device `device`, naming the count), K3_ERR_MISMATCH when the
 * device lacks a needed feature (a compute queue, host-visible coherent
 * memory), K3_ERR_INTERNAL naming the failing call otherwise. */
k3_status k3_vk_open(k3_vk **out, int device, double budget_gb, char *err, size_t errlen);
void k3_vk_close(k3_vk **vk);

/* "llvmpipe (LLVM 15.0.6, 256 bits)" and the like. */
const char *k3_vk_device_name(const k3_vk *vk);
/* 1 for a CPU implementation (lavapipe/llvmpipe). */
int k3_vk_is_cpu(const k3_vk *vk);
/* 1 when the device runs the float64-FMA shader, whose sums are the CPU
 * exact-float kernel's bits; 0: the device's own fma() (within ~1e-7). */
int k3_vk_exact(const k3_vk *vk);
uint64_t k3_vk_budget_bytes(const k3_vk *vk);
uint64_t k3_vk_used_bytes(const k3_vk *vk);

/* Bytes one expert of this shape occupies on the device (the slot layout:
 * w1p w1s w2p w2s w3p w3s, docs/MODEL.md 4.1). */
uint64_t k3_vk_expert_bytes(int inter, int latent);

/* Copies an expert (w1 gate [I][L], w2 down [L][I], w3 up [I][L]; I, L
 * multiples of 32) to the device. K3_ERR_LIMIT when it would pass the
 * budget or the device's buffer size limit (naming both), K3_ERR_ARG for
 * mismatched shapes, K3_ERR_NOMEM when the device refuses the memory. */
k3_status k3_vk_expert_upload(k3_vk *vk, const k3_mxfp4 *w1, const k3_mxfp4 *w2, const k3_mxfp4 *w3,
                              k3_vk_expert **out, char *err, size_t errlen);
void k3_vk_expert_free(k3_vk *vk, k3_vk_expert **e);

/* y [n][L] = W2 SiTU(W1 z, W3 z) for n pairs z [n][L], computed on the
 * device in the CPU exact-float order (docs/VULKAN.md "Numerics"). Waits
 * for the result. K3_ERR_LIMIT when n * max(I, L) floats pass the device's
 * buffer size limit. */
k3_status k3_vk_expert_apply(k3_vk *vk, const k3_vk_expert *e, const float *z, int n, float b1,
                             float b2, float *y, char *err, size_t errlen);
/* The same for m experts of one shape in one submission (one command
 * buffer: every expert's first stage, a barrier, every expert's second
 * stage; one fence wait): expert i over n[i] pairs, the pairs of all
 * experts concatenated in z [sum n][L] and y [sum n][L] in expert order.
 * n[i] may be 0. Each expert's results are those of a call of its own.
 * K3_ERR_ARG when the shapes differ; limits as above, per expert. */
k3_status k3_vk_experts_apply(k3_vk *vk, const k3_vk_expert *const *e, const int *n, int m,
                              const float *z, float b1, float b2, float *y, char *err,
                              size_t errlen);

#endif
