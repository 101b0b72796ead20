/* coordinator/plan_model.h: the model of a single-session decode token that
 * `k3-coordinator plan` predicts (docs/PERFORMANCE.md "Plan prediction
 * against a measured decode"), and the host's compute term it needs.
 *
 * Owns: nothing (pure functions over plain structs), except the compute
 * measurement's cache file (k3_plan_compute_get).
 * Borrows: common/kernels (the measurement runs the model's kernels).
 * Threads: one caller at a time (a tool's main thread).
 *
 * A token runs the layers one after the other. A MoE layer:
 *   router, attention, latent up projection, the last expert   c_fixed
 *   then max(reads, work under the reads)                       c_under
 * where the reads start after the router (common/layers/moe.c) and the
 * work under them is the latent down projection, the shared experts and
 * every expert but the last (each computes while the next are read). The
 * reads of a layer are its expected misses, spread over the drives by the
 * placement; the layer waits for its busiest drive, or, when the engine
 * keeps fewer reads in flight than there are drives (the window), for
 * the drives' summed busy time shared among the window's reads:
 *   reads = E[ max( max_d n_d B / v_d, sum_d n_d B / v_d / min(window, D) ) ]
 * over the ways the misses fall on the drives (n_d of them on drive d,
 * B bytes each, v_d its measured random-read speed). A dense layer is its
 * weights at the measured dense throughput. Per token the lm_head adds
 * its weights, and each worker its round trip.
 */
#ifndef K3_PLAN_MODEL_H
#define K3_PLAN_MODEL_H

#include <stdint.h>

#include "common/base/err.h"
#include "common/base/limits.h"
#include "common/ckpt/config.h"

/* The host's compute, measured (k3_plan_compute_get). */
typedef struct k3_plan_compute {
    double dense_gbs; /* int8 dense matmul of one row (decode), GB of weights per s */
    double expert_ms; /* one routed expert (gate, up, down, mxfp4) for one row, ms */
    int threads;      /* compute threads it ran with (the engine's default) */
    int from_cache;   /* 1: read from the cache file */
} k3_plan_compute;

/* Expected read time (s) of one MoE layer: `misses` distinct experts (a
 * fractional count mixes floor and ceil) of n_experts, drive d holding
 * count[d] of them, each expert_bytes, read at gbs[d] GB/s, with at most
 * `window` reads in flight over all drives (>= n_drives: every drive
 * busy). The expectation is over uniform picks (a fixed-seed sample of
 * 4000; exact when every expert misses). */
double k3_plan_layer_read_s(const int *count, const double *gbs, int n_drives, int n_experts,
                            double misses, double expert_bytes, int window);

/* Experts per drive of one layer as k3_placement_build deals them with no
 * usage history (each to the drive with the lowest (count + 1) / weight,
 * ties to the lower index): count[n_drives]. */
void k3_plan_deal(const double *weight, int n_drives, int n_experts, int *count);

/* One MoE layer's time (s): c_fixed + max(read_s, c_under). */
double k3_plan_moe_layer_s(double read_s, double fixed_s, double under_s);

/* Compute of one MoE layer that does not overlap its reads (fixed) and
 * that does (under), from its dense bytes, the part of them under the
 * reads (latent down, shared experts), topk and the measured compute. */
void k3_plan_moe_compute(const k3_plan_compute *pc, uint64_t layer_dense, uint64_t layer_overlap,
                         int topk, double *fixed_s, double *under_s);

/* Measures the compute term at cfg's real shapes (latent x hidden int8
 * matrix, one mxfp4 expert of moe_inter x latent) for ~seconds each with
 * the engine's default threads, or reads it from the cache file
 * (plan_compute.json in k3_cache_dir's directory, common/base/cache_dir.h,
 * keyed by the shapes, threads and kernel level; trusted for a week) unless
 * remeasure. Without a usable cache directory it warns why and measures,
 * keeping nothing. */
k3_status k3_plan_compute_get(const k3_config *cfg, double seconds, int remeasure,
                              k3_plan_compute *out, char *err, size_t errlen);

#endif
