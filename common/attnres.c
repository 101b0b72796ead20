/* common/attnres.c: the Block AttnRes Mix operator (spec 3.3). The wiring
 * (when to snapshot, when the prefix restarts) is in common/stage.c, where a
 * reader sees it next to the attention and MLP calls. */
#include <math.h>

#include "layers.h"

void k3_attnres_mix(const float *const *v, int n, const float *w, int D, float eps, float *out) {
    K3_ASSERT(n >= 1 && n <= K3_MAX_RES_ENTRIES + 1);
    float pi[K3_MAX_RES_ENTRIES + 1];
    /* score s_e = (v_e . w) / sqrt(mean(v_e^2) + eps): the dot, the sum of
     * squares and the quotient in double, eps the float config value
     * promoted (spec 3.3 / 7.14), the score cast to float. */
    for (int e = 0; e < n; e++) {
        const float *x = v[e];
        double dot = 0.0, ss = 0.0;
        for (int d = 0; d < D; d++) {
            dot += (double)x[d] * (double)w[d];
            ss += (double)x[d] * (double)x[d];
        }
        pi[e] = (float)(dot / sqrt(ss / (double)D + (double)eps));
    }
    k3_softmax(pi, n);
    /* mix the RAW entries, accumulated in entry order (blocks, prefix last) */
    for (int d = 0; d < D; d++) {
        float acc = 0.0f;
        for (int e = 0; e < n; e++) acc += pi[e] * v[e][d];
        out[d] = acc;
    }
}
