/* common/vk/vk_tier.h: the Vulkan expert tier (docs/VULKAN.md "Residency",
 * "The MoE step"): which routed experts of a layer range live on the device,
 * and the device's share of each MoE step.
 *
 * Owns: a k3_vk device (common/vk/vk.h); per (layer, expert) of the range the
 * resident device copy, if any; a device thread that runs the steps' device
 * jobs one after another; an upload thread that promotes experts the CPU
 * computed (hotter than the coldest resident one) and evicts that one.
 * Borrows: the expert store (k3_experts: bytes via k3_experts_fetch, heat
 * via k3_experts_usage_count), which must outlive the tier.
 * Threads: every function may be called from any thread (one mutex guards
 * the table, the queues and the counters). A step never waits for an
 * upload: claim takes only what is resident at that moment, and an evicted
 * expert's device memory is freed once no job holds it.
 *
 * The step (common/layers/moe.c):
 *   claim   moves the resident experts out of the step's id list and pins them;
 *   start   hands them to the device thread with the step's latent inputs
 *           z [T][latent] and selections; the device writes the rows
 *           ysel[t][k] of exactly those (position, rank) pairs;
 *   finish  waits for the device; when the device failed it returns the ids
 *           it did not compute, which the caller computes on the CPU;
 *   offer   names the experts the CPU computed as promotion candidates.
 * The caller sums ysel in expert id order as always, so which experts were
 * resident never changes the order of the sum; with the float64 shader
 * (k3_vk_exact) and exact-float CPU experts (idot 0) the rows are the CPU's
 * bits, so the tokens are the CPU-only run's. */
#ifndef K3_VK_TIER_H
#define K3_VK_TIER_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/ckpt/config.h"
#include "common/experts/experts.h"

typedef struct k3_vk_tier k3_vk_tier;
typedef struct k3_vk_job k3_vk_job;

typedef struct k3_vk_tier_stats {
    uint64_t calls;           /* expert applications on the device (one per expert per step) */
    uint64_t pairs;           /* (position, rank) pairs computed there */
    uint64_t steps;           /* MoE steps with a device part */
    uint64_t submits;         /* device submissions (one per step's job) */
    uint64_t resident;        /* experts on the device now */
    uint64_t resident_bytes;  /* their bytes */
    uint64_t budget_bytes;    /* the tier budget */
    uint64_t filled;          /* uploaded at start from the usage history */
    uint64_t promotions;      /* uploaded during the run */
    uint64_t evictions;       /* displaced by a hotter expert */
    uint64_t upload_failures; /* uploads that failed (the expert stays on the CPU) */
    uint64_t fallbacks;       /* experts of a failed device job recomputed on the CPU */
    double device_ms;         /* device thread busy with the steps' jobs */
    double cpu_ms;            /* the same steps' CPU expert loops */
    double wait_ms;           /* steps waiting for the device after their CPU part */
    int off;                  /* the device failed a job: no more claims */
} k3_vk_tier_stats;

/* Opens device `device` with budget gb (10^9 bytes; <= 0: the device's
 * largest heap) for layers [layer_a, layer_b) of the store, fills the budget
 * from the usage history hottest first (count, then layer, then id), and
 * starts its two threads. idot is the CPU's expert kernel (1: int8
 * activations): a warning says that the tokens then may differ from a
 * CPU-only run. Errors: those of k3_vk_open, and of the fill's reads.
 * Test hooks (docs/VULKAN.md "Fallback"): K3_TEST_VK_FAIL_UPLOAD=N fails the
 * N-th upload (1-based, fill included), K3_TEST_VK_FAIL_APPLY=N the N-th
 * device expert call. */
k3_status k3_vk_tier_open(k3_vk_tier **out, k3_experts *s, const k3_config *cfg, int layer_a,
                          int layer_b, int device, double gb, int idot, char *err, size_t errlen);
/* Stops the threads (waits for an upload in flight), frees the device. No
 * job may be in flight. Logs the totals at info level. NULL is fine. */
void k3_vk_tier_close(k3_vk_tier **t);

/* Removes from ids [*n] (order kept) the experts resident now and pins
 * them for the job returned; NULL (ids untouched) when none is resident or
 * the tier is off. */
k3_vk_job *k3_vk_tier_claim(k3_vk_tier *t, int layer, int32_t *ids, int *n);
/* Queues the job to the device thread. z [T][latent], sel [T][K] with n_sel
 * [T] used of each row, ysel [T][K][latent]: borrowed until finish. */
void k3_vk_tier_start(k3_vk_tier *t, k3_vk_job *j, const float *z, const int32_t *sel,
                      const int *n_sel, int T, int K, float *ysel);
/* Waits for the job, unpins its experts, frees it (*j = NULL). cpu_ms is
 * the step's CPU expert time (stats). Returns how many of its experts the
 * device did not compute (their ids in redo [n of the claim]); > 0 only
 * after a device failure, which also turns the tier off (warned once). */
int k3_vk_tier_finish(k3_vk_tier *t, k3_vk_job **j, double cpu_ms, int32_t *redo);
/* Promotion candidates: experts of layer the CPU just computed. Queued
 * for the upload thread when not resident and not queued already; dropped
 * when the queue is full. Never waits. */
void k3_vk_tier_offer(k3_vk_tier *t, int layer, const int32_t *ids, int n);

void k3_vk_tier_stats_get(k3_vk_tier *t, k3_vk_tier_stats *out);
const char *k3_vk_tier_device(const k3_vk_tier *t);

#endif
