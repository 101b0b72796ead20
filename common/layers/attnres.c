/* common/layers/attnres.c: the Block AttnRes Mix operator (docs/MODEL.md 3.3). The wiring
 * (when to snapshot, when the prefix restarts) is in common/engine/stage.c, where a
 * reader sees it next to the attention and MLP calls. The loops run through
 * the ISA-dispatched operators of ops_isa.h: the same bits at every level. */
#include <math.h>

#include "common/layers/layers.h"
#include "common/kernels/ops_isa.h"

void k3_attnres_mix(const float *const *v, int n, const float *w, int D, float eps, float *out) {
    K3_ASSERT(n >= 1 && n <= K3_MAX_RES_ENTRIES + 1);
    const k3_ops_tab *o = k3_ops();
    float pi[K3_MAX_RES_ENTRIES + 1];
    /* score s_e = (v_e . w) / sqrt(mean(v_e^2) + eps): the dot, the sum of
     * squares and the quotient in double (8 double lanes, ops_isa.h), eps
     * the float config value promoted (docs/MODEL.md 3.3, 7.14), the score cast to
     * float. */
    for (int e = 0; e < n; e++) {
        double dot, ss;
        o->sumsq_dot_d(v[e], w, D, &ss, &dot);
        pi[e] = (float)(dot / sqrt(ss / (double)D + (double)eps));
    }
    o->softmax(pi, n);
    /* mix the RAW entries, accumulated in entry order (blocks, prefix last) */
    o->mix(out, v, pi, n, D);
}
