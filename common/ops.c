/* common/ops.c: the small scalar operators of the forward pass with the
 * precision the spec fixes (../shared/spec/model.md 3.1, 3.4, 3.8), and the
 * scratch arena the layers allocate from. Every function here is a pure
 * function of its inputs: same inputs, same bits, on any thread. */
#include <math.h>
#include <string.h>

#include "layers.h"

/* ---- arena ---- */

size_t k3_arena_round(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

void *k3_arena_alloc(k3_arena *a, size_t bytes) {
    size_t n = k3_arena_round(bytes);
    /* Sizing is computed by the *_scratch_bytes functions from the config
     * and T; running past it is a bug in that arithmetic. */
    K3_ASSERT(a->used + n <= a->cap);
    void *p = a->base + a->used;
    a->used += n;
    return p;
}

/* ---- activations ---- */

float k3_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

float k3_silu(float z) { return z * k3_sigmoid(z); }

void k3_rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    /* spec 3.1: sum of squares in double, mean in double cast to float,
     * reciprocal in float, then (x * r) * w in float. */
    double ss = 0.0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    float mean = (float)(ss / (double)n);
    float r = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
}

void k3_situ(float *out, const float *g, const float *u, int n, float b1, float b2) {
    /* spec 3.8: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], left to right;
     * the sigmoid takes the uncapped g. */
    for (int i = 0; i < n; i++) {
        float gi = g[i], ui = u[i];
        float left = b1 * tanhf(gi / b1) * k3_sigmoid(gi);
        float right = b2 * tanhf(ui / b2);
        out[i] = left * right;
    }
}

void k3_softmax(float *x, int n) {
    if (n <= 0) return;
    float mx = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > mx) mx = x[i];
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    for (int i = 0; i < n; i++) x[i] = x[i] / sum;
}
