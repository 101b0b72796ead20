/* common/layers/moe_remote.h: routed experts computed by another process
 * (cross-worker expert striping, docs/CLUSTER.md "Expert striping",
 * docs/PROTOCOL.md "Expert calls").
 *
 * The interface LatentMoE (common/layers/moe.c) calls when some of a
 * layer's experts live on a drive another worker serves. The MoE layer
 * keeps everything that fixes the bits: the router, z = W_down x, the
 * weights and the sum in expert-id order; the remote side only applies
 * experts to rows of z and hands back every (row, expert) output unsummed,
 * exactly what k3_moe_expert_apply gives for the same rows, so the result
 * is bit-identical to the in-process run whatever the split.
 *
 * Owns: nothing (an interface: the implementation is worker/xstripe.c).
 * Threads: one MoE step at a time per k3_moe_remote (start, then finish or
 * abort, from the thread running the layer).
 */
#ifndef K3_MOE_REMOTE_H
#define K3_MOE_REMOTE_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"

typedef struct k3_moe_remote {
    void *ctx;
    /* 1 when expert e of layer is computed by another process */
    int (*is_remote)(void *ctx, int layer, int32_t e);
    /* Sends the calls without waiting: z [T][LT] f32 (borrowed until finish
     * or abort returns), n experts ids[i] (ascending), expert i applied to
     * rows rows[off[i] .. off[i+1]) of z (ascending). */
    k3_status (*start)(void *ctx, int layer, const float *z, int T, int LT, const int32_t *ids,
                       int n, const int *off, const int *rows, char *err, size_t errlen);
    /* Waits for every answer: y [off[n]][LT], pair j's output in row j. */
    k3_status (*finish)(void *ctx, float *y, char *err, size_t errlen);
    /* Forgets the calls in flight (a local failure after start). */
    void (*abort)(void *ctx);
} k3_moe_remote;

#endif
