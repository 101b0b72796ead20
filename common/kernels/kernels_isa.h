/* common/kernels/kernels_isa.h: the private seam between the kernel dispatcher
 * (kernels.c) and its per-ISA backends (kernels.c scalar, kernels_avx2.c,
 * kernels_avx512.c). Not for use outside common/kernels*.c.
 *
 * Each backend fills one k3_kern_ops table of row-range kernels with the
 * argument conventions of kernels.h (y [n][rows], rows [r0, r1)). A backend
 * guarantees that the bits of every (row, token) result depend only on the
 * inputs of that row and token, never on n, r0/r1 or the tiling it picked.
 * Integer-dot kernels (mx_i8, act_q8) must match the scalar backend bit for
 * bit. Tables here are filled once by the dispatcher before any kernel runs;
 * backends only read them. All functions are reentrant.
 */
#ifndef K3_KERNELS_ISA_H
#define K3_KERNELS_ISA_H

#include "common/kernels/kernels.h"

typedef struct k3_kern_ops {
    k3_isa isa;
    void (*f32_rows)(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1);
    void (*i8_rows)(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1);
    void (*i4_rows)(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1);
    void (*mx_f32)(const k3_mxfp4 *w, const float *x, int n, float *y, int r0, int r1);
    void (*mx_i8)(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y, int r0,
                  int r1);
    void (*act_q8)(const float *x, int n, int cols, int8_t *q, float *s);
    void (*q8_rows)(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y, int r0,
                    int r1); /* dense integer-dot (I8 and I4G64) */
} k3_kern_ops;

extern const k3_kern_ops k3_kern_scalar;
extern const k3_kern_ops k3_kern_avx2;
extern const k3_kern_ops k3_kern_avx512;

/* 2^(s-127) * 0.5 for every ue8m0 byte (s=0 -> +0, 255 -> +inf): the group
 * factor of the doubled-value MXFP4 kernels. Filled by the dispatcher. */
extern float k3_e8m0_half[256];
/* Whether the AVX-512 level may use VBMI (vpermb): cpuid, or
 * k3_isa_force_vbmi. Set by the dispatcher; bits are the same either way. */
extern int k3_kern_vbmi;
/* 2*v(n) for every e2m1 nibble: exact integers {0,1,2,3,4,6,8,12} and negatives. */
extern const int8_t k3_e2m1_x2[16];

/* The scalar MXFP4 integer-dot rows (the scalar level's mx_i8): vector
 * backends run their tail rows through it so that those rows have exactly
 * the scalar bits. */
void k3_mx_i8_rows_scalar(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                          int r0, int r1);

/* The integer-dot kernels' weight kinds (kernels_avx2.c, kernels_avx512.c)
 * and their common view of a matrix: rows of ldp bytes from w. */
enum { K3_IK_MX = 0, K3_IK_I4 = 1, K3_IK_I8 = 2 }; /* MXFP4, int4-g64, int8 */
typedef struct k3_ik_view {
    int rows, cols;
    size_t ldp;       /* bytes per row */
    const uint8_t *w; /* row 0 */
} k3_ik_view;

/* mat: a k3_mxfp4 for K3_IK_MX, else a k3_qmat */
static inline k3_ik_view k3_ik_view_of(int kind, const void *mat) {
    const k3_mxfp4 *mx = mat;
    const k3_qmat *qm = mat;
    k3_ik_view v;
    v.rows = kind == K3_IK_MX ? mx->rows : qm->rows;
    v.cols = kind == K3_IK_MX ? mx->cols : qm->cols;
    v.ldp = kind == K3_IK_I8 ? (size_t)v.cols : (size_t)v.cols / 2;
    v.w = kind == K3_IK_MX ? mx->packed : kind == K3_IK_I4 ? qm->q4 : (const uint8_t *)qm->q8;
    return v;
}

/* Activations for the int4-g64 float-activation kernels (the "fixed-point
 * order" of kernels.c), per token, per block of 128 columns (two groups),
 * one 512-byte block, 64-byte aligned:
 *   d[p][h][4k + b]: digit p (weight 2^(8p), signed) of X[8k + 2b + h],
 *     h = 0 the even columns (low nibbles), h = 1 the odd ones (high);
 *   c[k]: lane k's -8 * sum_{j<8} X[8k + j] (the nibble bias);
 *   e[k]: lane k's 2^E (lanes 0-7 are the block's first group).
 * so that lane k of a vpdpbusd of a row's 64 packed bytes (nibbles as u8)
 * with d[p][h] is a digit-p partial sum of lane k's eight columns. A last
 * lone group leaves lanes 8-15 zero. */
typedef struct k3_i4x_block {
    int8_t d[3][2][64];
    int32_t c[16];
    float e[16];
} k3_i4x_block;
_Static_assert(sizeof(k3_i4x_block) == 512, "k3_i4x_block is 512 bytes");
/* Blocks per token, and the same as floats: the token stride of the
 * float-typed tile interface the blocks travel through. */
static inline size_t k3_i4_xblocks(int cols) { return ((size_t)cols + 127) / 128; }
static inline size_t k3_i4_xld(int cols) { return k3_i4_xblocks(cols) * 128; }
/* One group of 64 columns x into lanes 8h..8h+7 of blk (column c's digit p
 * at d[p][c & 1][32h + c/2]). Every level's version writes the bytes of
 * the scalar one (i4x_group in kernels.c). */
typedef void (*k3_i4x_group_fn)(const float *x, k3_i4x_block *blk, int h);
/* A level's int4 float rows: x into blocks (per-thread scratch, by its
 * group function) in token chunks under K3_KERN_SCRATCH_MAX, then per chunk
 * run(m, xp, tn, y of the chunk, r0, r1), xp the chunk's blocks seen as
 * k3_i4_xld(cols) floats per token. */
typedef void (*k3_i4_chunk_fn)(const k3_qmat *m, const float *xp, int tn, float *y, int r0, int r1);
void k3_i4_rows_chunked(const k3_qmat *m, const float *x, int n, float *y, int r0, int r1,
                        k3_i4x_group_fn group, k3_i4_chunk_fn run);

/* The scalar dense integer-dot row (k3_qmat_matmul_q8_rows): backends use
 * it for tail rows and levels without a vector version. */
float k3_q8_row_scalar(const k3_qmat *m, int r, const int8_t *xq, const float *xs);
void k3_q8_rows_scalar(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y, int r0,
                       int r1);

/* The AVX2 integer-dot kernel with vpdpbusd on ymm (needs AVX-512 VL + VNNI):
 * the AVX-512 level's choice for the rows after the last full block of 16
 * of its n <= 3 nibble kernel (MXFP4, int4). Same bits as every level. */
void k3_mx_i8_rows_vnni256(const k3_mxfp4 *w, const int8_t *xq, const float *xs, int n, float *y,
                           int r0, int r1);
/* The same 8-row ymm kernel for the dense integer-dot formats (I8, I4G64). */
void k3_q8_rows_vnni256(const k3_qmat *m, const int8_t *xq, const float *xs, int n, float *y,
                        int r0, int r1);

/* A per-thread buffer of at least `bytes`, 64-byte aligned, valid until the
 * next call on the same thread. Aborts on OOM (sizes are the kernels' own).
 * It lives as long as its thread, so callers keep requests under
 * K3_KERN_SCRATCH_MAX (16 MiB: 512 tokens of a 7168-wide f32 activation)
 * by splitting large calls into token chunks. */
#define K3_KERN_SCRATCH_MAX (16u << 20)
void *k3_kern_scratch(size_t bytes);

/* Tokens per chunk so that n x bytes_per_token stays under the scratch cap. */
static inline int k3_kern_chunk(int n, size_t bytes_per_token) {
    size_t c = K3_KERN_SCRATCH_MAX / (bytes_per_token ? bytes_per_token : 1);
    return c < 1 ? 1 : c < (size_t)n ? (int)c : n;
}

/* ---- the float-activation tile walk of the vector levels ---- */

/* A tile: rows [r, r + R) of mat times the T tokens at x (token stride: the
 * cols given to k3_tiles_run) into out [R][T]. A level compiles one
 * out-of-line function per (kind, R, T) with R and T constant, so the
 * accumulators stay in registers, and hands k3_tiles_run the table of them
 * by [R - 1][T - 1], NULL for a shape it did not compile. */
typedef void (*k3_tile_fn)(const void *mat, int r, const float *x, float *out);

/* Walks rows [r0, r1) in blocks of rb and tokens in tiles of tb (both <= 4),
 * one indirect call per tile. A shape without a compiled tile runs as single
 * rows, fns[0][T - 1] (same bits: a tile's rows are independent).
 * row_scale: the int8 per-row scale applied last, or NULL. */
static inline void k3_tiles_run(const k3_tile_fn fns[4][4], int rb, int tb, const void *mat,
                                int rows, int cols, const float *x, int n, float *y, int r0, int r1,
                                const float *row_scale) {
    float out[16];
    for (int r = r0; r < r1; r += rb) {
        const int R = r1 - r < rb ? r1 - r : rb;
        for (int t = 0; t < n; t += tb) {
            const int T = n - t < tb ? n - t : tb;
            const float *xt = x + (size_t)t * cols;
            if (fns[R - 1][T - 1])
                fns[R - 1][T - 1](mat, r, xt, out);
            else
                for (int i = 0; i < R; i++) fns[0][T - 1](mat, r + i, xt, out + i * T);
            for (int i = 0; i < R; i++)
                for (int j = 0; j < T; j++) {
                    const float v = out[i * T + j];
                    y[(size_t)(t + j) * rows + r + i] = row_scale ? v * row_scale[r + i] : v;
                }
        }
    }
}

/* A level's permutation of count floats of MXFP4 activations into the
 * order its nibble tiles read them. */
typedef void (*k3_perm_fn)(const float *x, size_t count, float *xp);

/* MXFP4 exact-float rows: activations permuted by perm into per-thread
 * scratch, in token chunks that keep it under K3_KERN_SCRATCH_MAX, then
 * k3_tiles_run per chunk. */
static inline void k3_nibble_rows(const k3_tile_fn fns[4][4], k3_perm_fn perm, int rb, int tb,
                                  const void *mat, int rows, int cols, const float *x, int n,
                                  float *y, int r0, int r1) {
    const int tch = k3_kern_chunk(n, (size_t)cols * sizeof(float));
    float *xp = k3_kern_scratch((size_t)tch * cols * sizeof(float));
    for (int t0 = 0; t0 < n; t0 += tch) {
        const int tn = n - t0 < tch ? n - t0 : tch;
        perm(x + (size_t)t0 * cols, (size_t)tn * cols, xp);
        k3_tiles_run(fns, rb, tb, mat, rows, cols, xp, tn, y + (size_t)t0 * rows, r0, r1, NULL);
    }
}

#endif
