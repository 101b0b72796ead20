/* common/kernels/ops.h: the small operators of the forward pass (RMSNorm,
 * SiTU, softmax, SiLU, sigmoid) at the precision docs/MODEL.md fixes. The
 * vector backends behind them (ops_isa.h) give the same bits at every ISA
 * level.
 *
 * Owns: nothing. Threads: reentrant, any thread.
 */
#ifndef K3_OPS_H
#define K3_OPS_H

float k3_sigmoid(float z); /* 1 / (1 + exp(-z)), exp = k3_exp_ref (ops_isa.h) */
float k3_silu(float z);    /* z * sigmoid(z) */
/* out[i] = (x[i] * r) * w[i], r = 1/sqrtf((float)(sum_d x^2 / n) + eps),
 * the sum and the division by n in double. out may alias x. */
void k3_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
/* out[i] = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], left to right in
 * float. out may alias g or u. */
void k3_situ(float *out, const float *g, const float *u, int n, float b1, float b2);
/* In place: x = exp(x - max) / sum, all float (sum in the lane order of ops_isa.h). */
void k3_softmax(float *x, int n);

#endif
