/* common/kernels/kernels.h: tensor formats and the matmul kernels of the model
 * (docs/MODEL.md section 4).
 *
 * Formats of dense weights (k3_qmat), chosen at load by bits (docs/MODEL.md 4.2):
 *   K3_QF_F32   f32 [rows][cols]
 *   K3_QF_I8    int8 per-row: q8 [rows][cols], scales [rows]
 *   K3_QF_I4G64 int4 group-64: q4 [rows][cols/2] (q+8, even column in the low
 *               nibble), scales [rows][cols/64]
 * Routed experts stay MXFP4 on their packed bytes (k3_mxfp4): e2m1 nibbles
 * [rows][cols/2] (low nibble = even column) and one ue8m0 exponent per 32
 * columns [rows][cols/32]; never converted.
 *
 * Every kernel has a scalar reference and AVX2 (and later AVX-512) versions
 * chosen once per process from cpuid (k3_isa_*); the K3_KERN_OPT_ISA row
 * (--isa / K3_ISA = auto|scalar|avx2|avx512) forces a level. Within one ISA level the result of a
 * (row, token) dot is the same bits whatever n (chunk size), the row range split or the thread
 * count: matmul over n tokens is n matvecs with the same summation order. All levels share one
 * summation order (16 lanes, fused multiply-add, a fixed lane tree; kernels.c), so exact-float
 * results are bit-identical across levels too, and integer-dot paths (k3_mxfp4_*_i8) are bit-exact
 * across levels.
 *
 * Threads: all functions are reentrant; the *_mt variants use the pool.
 */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "common/base/err.h"
#include "common/base/opts.h"
#include "common/base/pool.h"

/* ---- ISA dispatch ---- */
typedef enum k3_isa { K3_ISA_SCALAR = 0, K3_ISA_AVX2 = 1, K3_ISA_AVX512 = 2 } k3_isa;
#define K3_ISA_AUTO (-1) /* the row's "auto": the detected level */

/* The one definition of the ISA setting (an int field of T: K3_ISA_AUTO or
 * a k3_isa). Programs put it in their table (common/engine/engine_opts.h)
 * and apply it with k3_isa_select; without a table (tests, benchmarks) the
 * first kernel call reads the row's variable, and a bad value there warns
 * and keeps the detected level. */
// clang-format off
#define K3_KERN_OPT_ISA(T, f)                                                                      \
    {.name = "isa", .flag = "--isa", .env = "K3_ISA", .type = K3_OPT_ENUM,                        \
     .offset = offsetof(T, f), .def = "auto", .n_choices = 4,                                     \
     .choices = {K3_ISA_AUTO, K3_ISA_SCALAR, K3_ISA_AVX2, K3_ISA_AVX512},                         \
     .names = {"auto", "scalar", "avx2", "avx512"}, .metavar = "ISA",                             \
     .help = "kernel level (auto = the best this CPU has; a higher one warns and is not used)"}
// clang-format on

k3_isa k3_isa_detect(void); /* best level the CPU supports */
k3_isa k3_isa_active(void); /* level in use (--isa / K3_ISA, or detected) */
/* Uses level (K3_ISA_AUTO: the detected one); a level above the CPU's
 * warns and uses the detected one. Call before any thread runs kernels. */
void k3_isa_select(int level);
k3_status k3_isa_force(k3_isa level, char *err, size_t errlen); /* tests; fails if unsupported */
const char *k3_isa_name(k3_isa level);
/* tests: the AVX-512 level's VBMI decode off (0) or on (1, fails where the
 * CPU lacks VBMI); results are the same bits either way */
k3_status k3_isa_force_vbmi(int on, char *err, size_t errlen);

/* ---- dense weights ---- */
typedef enum k3_qfmt { K3_QF_F32 = 0, K3_QF_I8 = 1, K3_QF_I4G64 = 4 } k3_qfmt;

typedef struct k3_qmat {
    k3_qfmt fmt;
    int rows, cols; /* W is [rows][cols], y = W x */
    float *w;       /* F32: [rows][cols] */
    int8_t *q8;     /* I8: [rows][cols] */
    uint8_t *q4;    /* I4G64: [rows][cols/2] */
    float *scales;  /* I8: [rows]; I4G64: [rows][cols/64] */
    int owned;      /* 1: buffers are heap-owned and freed by k3_qmat_free */
    int idot;       /* 1: k3_qmat_matmul runs the integer-dot kernel (I8/I4G64 with
                     * cols % 32 == 0 only; set by the loader under K3_DENSE_IDOT) */
} k3_qmat;

/* Quantizes f32 weights with the docs/MODEL.md 4.2 algorithm: bits >= 32 -> F32 (copy),
 * bits <= 4 and cols % 64 == 0 -> I4G64, otherwise I8. Round half to even
 * (lrintf), multiply by the float reciprocal of the scale, scale >= 1e-20. */
void k3_qmat_quantize(k3_qmat *m, const float *w, int rows, int cols, int bits);
/* int8 per-row -> int4-g64 downcast (docs/MODEL.md 4.2, explicit K3_BITS=4 on an int8
 * container). cols % 64 == 0 required. */
void k3_qmat_downcast_i4(k3_qmat *dst, const k3_qmat *src_i8);
void k3_qmat_free(k3_qmat *m);
size_t k3_qmat_bytes(const k3_qmat *m);

/* y[t][r] = sum_c W[r][c] x[t][c] for t in [0,n), r in [r0,r1).
 * x: [n][cols], y: [n][rows] (row stride = m->rows). Float activations and
 * float accumulation per row in the 16-lane order (docs/MODEL.md 4.3);
 * I8 multiplies the row scale at the end. I4G64 holds x per 8 columns in
 * fixed point at 2^-22 of their max|x| and sums each lane of 8 exactly in
 * integers before its group scale (kernels.c, the fixed-point order). */
void k3_qmat_matmul_rows(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1);
/* Same over all rows, split across the pool. With m->idot set (and an
 * I8/I4G64 matrix of cols % 32 == 0) the activations are quantized here
 * (k3_act_quant_q8) and the integer-dot kernel below runs instead. */
void k3_qmat_matmul(const k3_qmat *m, const float *x, int n, float *y, k3_pool *pool);

/* Integer-dot dense kernel (opt-in, K3_DENSE_IDOT=1; docs/MODEL.md 4.2 prescribes
 * float activations, so this is a numerics change, like K3_IDOT for the
 * experts): activations quantized per group of 32 (k3_act_quant_q8), per
 * group g the exact integer sum isum_g of q_w * q_x, then in group order
 *   I8:    acc += (float)isum_g * sx_g;              y = acc * s_row
 *   I4G64: acc += (float)isum_g * (s_{row,g/2} * sx_g); y = acc
 * (q_w = nibble - 8 for int4). Bit-exact across ISA levels and chunk sizes.
 * xq [n][cols], xs [n][cols/32], y [n][rows]; cols % 32 == 0. */
void k3_qmat_matmul_q8_rows(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                            int r0, int r1);
/* 1 if k3_qmat_matmul takes the integer-dot path for m */
int k3_qmat_uses_idot(const k3_qmat *m);

/* ---- MXFP4 routed experts ---- */
typedef struct k3_mxfp4 {
    const uint8_t *packed; /* [rows][cols/2] */
    const uint8_t *scale;  /* [rows][cols/32] ue8m0 */
    int rows, cols;        /* cols % 32 == 0 */
} k3_mxfp4;

/* e2m1 nibble -> value (docs/MODEL.md 4.1 table). */
extern const float k3_e2m1[16];
/* ue8m0 exponent -> 2^(s-127) built from bits s<<23 (s=0 -> +0, 255 -> +inf). */
float k3_e8m0_to_f32(uint8_t s);

/* Exact-float kernel (K3_IDOT=0): y[t][r] = sum_g 2^(s-127) * sum_{i in g} x v.
 * x [n][cols], y [n][rows]. */
void k3_mxfp4_matmul_f32(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1);

/* Activation quantization per group of 32 (docs/MODEL.md 4.1): m = max|x|,
 * s = max(m/127, 1e-20), q = clamp(rint(x * (1/s)), -127, 127).
 * x [n][cols] -> q [n][cols], s [n][cols/32]. cols % 32 == 0. */
void k3_act_quant_q8(const float *x, int n, int cols, int8_t *q, float *s);

/* Integer-dot kernel (K3_IDOT=1): per group, the integer sum of d(nibble)*q
 * with d = 2*v (exact ints), times 2^(s-127) * 0.5 * sx. Bit-exact across
 * ISA levels. xq [n][cols], xs [n][cols/32], y [n][rows]. */
void k3_mxfp4_matmul_i8(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                        int r0, int r1);

/* Threaded wrappers over all rows. */
void k3_mxfp4_matmul_f32_mt(const k3_mxfp4 *w, const float *x, int n, float *y, k3_pool *pool);
void k3_mxfp4_matmul_i8_mt(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                           k3_pool *pool);

#endif
