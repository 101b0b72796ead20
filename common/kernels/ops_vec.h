/* common/kernels/ops_vec.h: the vector layer operators, written ONCE over a 16-lane
 * float type and included by each vector backend (ops_avx2.c, ops_avx512.c)
 * after it has defined the primitives below for its ISA. Private to those
 * two files. The operation sequence per lane is the scalar one of ops.c
 * (see ops_isa.h for the order), which is why one text serves every level.
 *
 * The including file defines:
 *   OPS_FN, OPS_INL          function attributes (target, inline)
 *   OPS_NAME(x)              backend-prefixed name
 *   OPS_TABLE, OPS_LEVEL     the k3_ops_tab to define and its k3_isa
 *   OPS_NB                   16-lane vectors per register block (KDA sweeps)
 *   OPS_RC_TT, OPS_RC_NV     rows_comb tile: tokens x 16-lane vectors
 *   OPS_WS_Q, OPS_WS_NV      wsum_multi tile: queries x 16-lane vectors
 *   vf (16 floats), vm (16-lane mask), vd (8 doubles) and
 *   vf_zero vf_set1 vf_load vf_loadn vf_store vf_storen vf_add vf_sub
 *   vf_mul vf_div vf_fma(a, b, c) = a*b + c rounded once, vf_max(a, b) =
 *   a > b ? a : b, vf_min(a, b) = a < b ? a : b, vf_rint vf_trunc vf_abs
 *   vf_neg vf_copysign vf_pow2i vf_isnan vf_blend(m, t, f) vf_hsum (the
 *   lane tree), vf_lanes (store 16 lanes), vf_dec_i8 vf_dec_i8n vf_dec_nib
 *   (16 packed bytes -> nibble - 8 of columns 2k, 2k+1), vf_store_ilv
 *   (out[2k] = ev[k], out[2k+1] = od[k]), vf_rot4_1/2/3 (rotate each group
 *   of 4 lanes: lane 4k+i takes 4k+(i+r)%4), vf_shift4_insert(v, u4) (lane
 *   4k+i takes 4k+i+1, lane 4k+3 takes u4[k]), vd_zero vd_from_f8 vd_add
 *   vd_mul vd_hsum.
 * A partial vector (n < 16 elements) is loaded with zeros in the other lanes
 * and stored under a mask: lanes never mix in elementwise code, so a partial
 * vector gives the scalar bits; reductions add their tails in element order
 * after the lane tree instead, as the scalar does.
 */

/* constant-bound loops over register blocks must unroll fully, or the
 * accumulator arrays live on the stack */
#define OPS_UNROLL _Pragma("GCC unroll 16")

/* ---- exp, tanh, sigmoid: the operations of k3_exp_ref / k3_tanh_ref ---- */

OPS_INL vf v_exp(vf x) {
    const vm nan = vf_isnan(x);
    const vf xc = vf_min(vf_max(x, vf_set1(-104.0f)), vf_set1(89.0f));
    const vf n = vf_rint(vf_mul(xc, vf_set1(K3_EXP_LOG2E)));
    vf r = vf_fma(n, vf_set1(-K3_EXP_LN2_HI), xc);
    r = vf_fma(n, vf_set1(-K3_EXP_LN2_LO), r);
    vf p = vf_set1(K3_EXP_C7);
    p = vf_fma(p, r, vf_set1(K3_EXP_C6));
    p = vf_fma(p, r, vf_set1(K3_EXP_C5));
    p = vf_fma(p, r, vf_set1(K3_EXP_C4));
    p = vf_fma(p, r, vf_set1(K3_EXP_C3));
    p = vf_fma(p, r, vf_set1(K3_EXP_C2));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    const vf n1 = vf_trunc(vf_mul(n, vf_set1(0.5f))), n2 = vf_sub(n, n1);
    const vf res = vf_mul(vf_mul(p, vf_pow2i(n1)), vf_pow2i(n2));
    return vf_blend(nan, vf_add(x, x), res);
}

OPS_INL vf v_tanh(vf x) {
    const vm nan = vf_isnan(x);
    const vf y = vf_min(vf_mul(vf_set1(2.0f), vf_abs(x)), vf_set1(19.0f));
    const vf n = vf_rint(vf_mul(y, vf_set1(K3_EXP_LOG2E)));
    vf r = vf_fma(n, vf_set1(-K3_EXP_LN2_HI), y);
    r = vf_fma(n, vf_set1(-K3_EXP_LN2_LO), r);
    vf q = vf_set1(K3_EXP_C7);
    q = vf_fma(q, r, vf_set1(K3_EXP_C6));
    q = vf_fma(q, r, vf_set1(K3_EXP_C5));
    q = vf_fma(q, r, vf_set1(K3_EXP_C4));
    q = vf_fma(q, r, vf_set1(K3_EXP_C3));
    q = vf_fma(q, r, vf_set1(K3_EXP_C2));
    const vf pm1 = vf_fma(vf_mul(r, r), q, r);
    const vf s = vf_pow2i(n);
    const vf e = vf_fma(s, pm1, vf_sub(s, vf_set1(1.0f)));
    const vf t = vf_copysign(vf_div(e, vf_add(e, vf_set1(2.0f))), x);
    return vf_blend(nan, vf_add(x, x), t);
}

OPS_INL vf v_sigmoid(vf z) {
    return vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), v_exp(vf_neg(z))));
}

/* ---- KDA sweeps (one head) ----
 * Blocks of OPS_NB vectors of value columns keep u / o in registers while
 * the key rows stream; each column's sum runs over keys in key order. */

/* Tile functions take their shape (vectors, tokens, queries, the column
 * count of the block) as constants where the caller passes literals: the
 * full-block calls then compile to straight-line code with the
 * accumulators in registers, and only tail blocks carry the count tests. */

/* columns [j0, j0 + cnt) of u: S[i][:] *= alpha[i], u += k[i] S[i][:] */
OPS_INL void kda_dr_block(float *S, int d, int j0, const int cnt, const float *alpha,
                          const float *k, float *u) {
    vf acc[OPS_NB];
    OPS_UNROLL
    for (int b = 0; b < OPS_NB; b++) acc[b] = vf_zero();
    for (int i = 0; i < d; i++) {
        float *row = S + (size_t)i * d + j0;
        const vf a = vf_set1(alpha[i]), kk = vf_set1(k[i]);
        OPS_UNROLL
        for (int b = 0; b < OPS_NB; b++) {
            const int c = cnt - 16 * b;
            if (c >= 16) {
                const vf s = vf_mul(vf_load(row + 16 * b), a);
                vf_store(row + 16 * b, s);
                acc[b] = vf_fma(kk, s, acc[b]);
            } else if (c > 0) {
                const vf s = vf_mul(vf_loadn(row + 16 * b, c), a);
                vf_storen(row + 16 * b, s, c);
                acc[b] = vf_fma(kk, s, acc[b]);
            }
        }
    }
    OPS_UNROLL
    for (int b = 0; b < OPS_NB; b++) {
        const int c = cnt - 16 * b;
        if (c >= 16)
            vf_store(u + j0 + 16 * b, acc[b]);
        else if (c > 0)
            vf_storen(u + j0 + 16 * b, acc[b], c);
    }
}

/* columns [j0, j0 + cnt): S[i][:] += k[i] delta, o += q[i] S[i][:] */
OPS_INL void kda_wr_block(float *S, int d, int j0, const int cnt, const float *k,
                          const float *delta, const float *q, float *o) {
    vf acc[OPS_NB];
    OPS_UNROLL
    for (int b = 0; b < OPS_NB; b++) acc[b] = vf_zero();
    for (int i = 0; i < d; i++) {
        float *row = S + (size_t)i * d + j0;
        const vf kk = vf_set1(k[i]), qq = vf_set1(q[i]);
        OPS_UNROLL
        for (int b = 0; b < OPS_NB; b++) {
            const int c = cnt - 16 * b;
            if (c >= 16) {
                const vf s = vf_fma(kk, vf_load(delta + j0 + 16 * b), vf_load(row + 16 * b));
                vf_store(row + 16 * b, s);
                acc[b] = vf_fma(qq, s, acc[b]);
            } else if (c > 0) {
                const vf s =
                    vf_fma(kk, vf_loadn(delta + j0 + 16 * b, c), vf_loadn(row + 16 * b, c));
                vf_storen(row + 16 * b, s, c);
                acc[b] = vf_fma(qq, s, acc[b]);
            }
        }
    }
    OPS_UNROLL
    for (int b = 0; b < OPS_NB; b++) {
        const int c = cnt - 16 * b;
        if (c >= 16)
            vf_store(o + j0 + 16 * b, acc[b]);
        else if (c > 0)
            vf_storen(o + j0 + 16 * b, acc[b], c);
    }
}

static OPS_FN void OPS_NAME(kda_decay_read)(float *S, int d, const float *alpha, const float *k,
                                            float *u) {
    for (int j0 = 0; j0 < d; j0 += OPS_NB * 16) {
        if (d - j0 >= OPS_NB * 16)
            kda_dr_block(S, d, j0, OPS_NB * 16, alpha, k, u);
        else
            kda_dr_block(S, d, j0, d - j0, alpha, k, u);
    }
}

static OPS_FN void OPS_NAME(kda_write_read)(float *S, int d, const float *k, const float *delta,
                                            const float *q, float *o) {
    for (int j0 = 0; j0 < d; j0 += OPS_NB * 16) {
        if (d - j0 >= OPS_NB * 16)
            kda_wr_block(S, d, j0, OPS_NB * 16, k, delta, q, o);
        else
            kda_wr_block(S, d, j0, d - j0, k, delta, q, o);
    }
}

/* 4-tap conv, 16 channels per step as 4 vectors of 4 channels x 4 taps
 * (the [d][4] layout as it is in memory): shift each group left and insert
 * u, multiply by the taps, then the per-group sum in tap order by rotating
 * the group (lane 4k ends with ((0 + p0) + p1) + p2) + p3). */
static OPS_FN void OPS_NAME(conv4)(float *u, float *win, const float *taps, int d) {
    const int dl = d / 16 * 16;
    for (int c = 0; c < dl; c += 16) {
        float s[16], l[16];
        OPS_UNROLL
        for (int g = 0; g < 4; g++) {
            float *w = win + (size_t)(c + 4 * g) * 4;
            const vf nw = vf_shift4_insert(vf_load(w), u + c + 4 * g);
            vf_store(w, nw);
            const vf p = vf_mul(vf_load(taps + (size_t)(c + 4 * g) * 4), nw);
            vf a = vf_add(vf_zero(), p);
            a = vf_add(a, vf_rot4_1(p));
            a = vf_add(a, vf_rot4_2(p));
            a = vf_add(a, vf_rot4_3(p));
            vf_lanes(l, a);
            s[4 * g] = l[0], s[4 * g + 1] = l[4], s[4 * g + 2] = l[8], s[4 * g + 3] = l[12];
        }
        memcpy(u + c, s, sizeof s);
    }
    /* the d % 16 tail: the scalar op itself (columns are independent) */
    if (dl < d) k3_ops_scalar.conv4(u + dl, win + (size_t)dl * 4, taps + (size_t)dl * 4, d - dl);
}

/* ---- MLA ---- */

/* rows_comb tile: NT tokens x the cnt columns from c0 (at most OPS_RC_NV
 * vectors) in format fmt. int4 runs in nibble order (vector 2b = even
 * columns of a 32-column block, 2b+1 = odd), interleaved back at the store. */
OPS_INL void rc_tile(const k3_qmat *m, int row0, int nrows, const float *coef, size_t coef_ld,
                     float *acc, size_t acc_ld, int c0, const int fmt, const int NT,
                     const int cnt) {
    const int cols = m->cols, ng = cols / 64;
    vf a[4][OPS_RC_NV];
    OPS_UNROLL
    for (int t = 0; t < NT; t++) {
        OPS_UNROLL
        for (int b = 0; b < OPS_RC_NV; b++) a[t][b] = vf_zero();
    }
    for (int i = 0; i < nrows; i++) {
        const int r = row0 + i;
        vf w[OPS_RC_NV];
        float s = 1.0f;
        if (fmt == K3_QF_I4G64) {
            const uint8_t *q = m->q4 + (size_t)r * (cols / 2) + c0 / 2;
            OPS_UNROLL
            for (int b = 0; b < OPS_RC_NV / 2; b++)
                vf_dec_nib(q + 16 * b, &w[2 * b], &w[2 * b + 1]);
            s = m->scales[(size_t)r * ng + c0 / 64];
        } else {
            const size_t off = (size_t)r * cols + c0;
            OPS_UNROLL
            for (int b = 0; b < OPS_RC_NV; b++) {
                const int c = cnt - 16 * b;
                if (fmt == K3_QF_F32)
                    w[b] = c >= 16 ? vf_load(m->w + off + 16 * b)
                           : c > 0 ? vf_loadn(m->w + off + 16 * b, c)
                                   : vf_zero();
                else
                    w[b] = c >= 16 ? vf_dec_i8(m->q8 + off + 16 * b)
                           : c > 0 ? vf_dec_i8n(m->q8 + off + 16 * b, c)
                                   : vf_zero();
            }
            if (fmt == K3_QF_I8) s = m->scales[r];
        }
        OPS_UNROLL
        for (int t = 0; t < NT; t++) {
            const vf cs = vf_set1(coef[(size_t)t * coef_ld + i] * s);
            OPS_UNROLL
            for (int b = 0; b < OPS_RC_NV; b++) a[t][b] = vf_fma(cs, w[b], a[t][b]);
        }
    }
    OPS_UNROLL
    for (int t = 0; t < NT; t++) {
        float *out = acc + (size_t)t * acc_ld + c0;
        OPS_UNROLL
        for (int b = 0; b < OPS_RC_NV; b++) {
            const int c = cnt - 16 * b;
            if (fmt == K3_QF_I4G64) {
                if (b % 2 == 0) vf_store_ilv(out + 16 * b, a[t][b], a[t][b + 1]);
            } else if (c >= 16) {
                vf_store(out + 16 * b, a[t][b]);
            } else if (c > 0) {
                vf_storen(out + 16 * b, a[t][b], c);
            }
        }
    }
}

/* one rows_comb tile with the token count and a full column count as literals */
#define RC_NT(fmt, cnt)                                                                            \
    switch (nt) {                                                                                  \
    case 1: rc_tile(m, row0, nrows, ct, coef_ld, at, acc_ld, c0, fmt, 1, cnt); break;              \
    case 2: rc_tile(m, row0, nrows, ct, coef_ld, at, acc_ld, c0, fmt, 2, cnt); break;              \
    case 3: rc_tile(m, row0, nrows, ct, coef_ld, at, acc_ld, c0, fmt, 3, cnt); break;              \
    default: rc_tile(m, row0, nrows, ct, coef_ld, at, acc_ld, c0, fmt, 4, cnt); break;             \
    }

static OPS_FN void OPS_NAME(rows_comb)(const k3_qmat *m, int row0, int nrows, const float *coef,
                                       size_t coef_ld, int T, float *acc, size_t acc_ld) {
    const int cols = m->cols, W = OPS_RC_NV * 16;
    for (int t0 = 0; t0 < T; t0 += OPS_RC_TT) {
        const int nt = T - t0 < OPS_RC_TT ? T - t0 : OPS_RC_TT;
        const float *ct = coef + (size_t)t0 * coef_ld;
        float *at = acc + (size_t)t0 * acc_ld;
        for (int c0 = 0; c0 < cols; c0 += W) {
            const int cnt = cols - c0 < W ? cols - c0 : W;
            if (m->fmt == K3_QF_I4G64) { /* cols % 64 == 0: blocks are full */
                RC_NT(K3_QF_I4G64, OPS_RC_NV * 16)
            } else if (m->fmt == K3_QF_I8) {
                if (cnt == W) {
                    RC_NT(K3_QF_I8, OPS_RC_NV * 16)
                } else {
                    RC_NT(K3_QF_I8, cnt)
                }
            } else if (cnt == W) {
                RC_NT(K3_QF_F32, OPS_RC_NV * 16)
            } else {
                RC_NT(K3_QF_F32, cnt)
            }
        }
    }
}
#undef RC_NT

/* wsum tile: Q queries x the cnt columns from c0 (at most OPS_WS_NV
 * vectors); each row vector loaded serves the Q queries. */
OPS_INL void ws_tile(const float *rows, int cols, const float *p, size_t p_ld, int n, float *acc,
                     size_t acc_ld, int c0, const int Q, const int cnt) {
    vf a[4][OPS_WS_NV];
    OPS_UNROLL
    for (int j = 0; j < Q; j++) {
        OPS_UNROLL
        for (int b = 0; b < OPS_WS_NV; b++) a[j][b] = vf_zero();
    }
    for (int s = 0; s < n; s++) {
        const float *row = rows + (size_t)s * cols + c0;
        vf w[OPS_WS_NV];
        OPS_UNROLL
        for (int b = 0; b < OPS_WS_NV; b++) {
            const int c = cnt - 16 * b;
            w[b] = c >= 16 ? vf_load(row + 16 * b) : c > 0 ? vf_loadn(row + 16 * b, c) : vf_zero();
        }
        OPS_UNROLL
        for (int j = 0; j < Q; j++) {
            const vf ps = vf_set1(p[(size_t)j * p_ld + s]);
            OPS_UNROLL
            for (int b = 0; b < OPS_WS_NV; b++) a[j][b] = vf_fma(ps, w[b], a[j][b]);
        }
    }
    OPS_UNROLL
    for (int j = 0; j < Q; j++) {
        OPS_UNROLL
        for (int b = 0; b < OPS_WS_NV; b++) {
            float *out = acc + (size_t)j * acc_ld + c0 + 16 * b;
            const int c = cnt - 16 * b;
            if (c >= 16)
                vf_store(out, a[j][b]);
            else if (c > 0)
                vf_storen(out, a[j][b], c);
        }
    }
}

#define WS_Q(cnt)                                                                                  \
    switch (mq) {                                                                                  \
    case 1: ws_tile(rows, cols, pq, p_ld, n, aq, acc_ld, c0, 1, cnt); break;                       \
    case 2: ws_tile(rows, cols, pq, p_ld, n, aq, acc_ld, c0, 2, cnt); break;                       \
    case 3: ws_tile(rows, cols, pq, p_ld, n, aq, acc_ld, c0, 3, cnt); break;                       \
    default: ws_tile(rows, cols, pq, p_ld, n, aq, acc_ld, c0, 4, cnt); break;                      \
    }

static OPS_FN void OPS_NAME(wsum_multi)(const float *rows, int cols, const float *p, size_t p_ld,
                                        int nq, int n, float *acc, size_t acc_ld) {
    const int W = OPS_WS_NV * 16;
    for (int q0 = 0; q0 < nq; q0 += OPS_WS_Q) {
        const int mq = nq - q0 < OPS_WS_Q ? nq - q0 : OPS_WS_Q;
        const float *pq = p + (size_t)q0 * p_ld;
        float *aq = acc + (size_t)q0 * acc_ld;
        for (int c0 = 0; c0 < cols; c0 += W) {
            if (cols - c0 >= W) {
                WS_Q(OPS_WS_NV * 16)
            } else {
                WS_Q(cols - c0)
            }
        }
    }
}
#undef WS_Q

/* ---- elementwise maps: full vectors, then one masked tail ---- */

#define OPS_MAP(n, i, c, ...)                                                                      \
    for (int i = 0; i < (n); i += 16) {                                                            \
        const int c = (n)-i < 16 ? (n)-i : 16;                                                     \
        __VA_ARGS__                                                                                \
    }
#define OPS_LD(p, i, c)    ((c) == 16 ? vf_load((p) + (i)) : vf_loadn((p) + (i), (c)))
#define OPS_ST(p, i, c, v) ((c) == 16 ? vf_store((p) + (i), (v)) : vf_storen((p) + (i), (v), (c)))

static OPS_FN void OPS_NAME(softmax)(float *x, int n) {
    if (n <= 0) return;
    const int nl = n / 16 * 16;
    /* max ignoring NaN: m = x > m ? x : m, from -inf (any order: same value) */
    vf vmx = vf_set1(-INFINITY);
    for (int i = 0; i < nl; i += 16) vmx = vf_max(vf_load(x + i), vmx);
    float l[16], mx = -INFINITY;
    vf_lanes(l, vmx);
    for (int k = 0; k < 16; k++) mx = l[k] > mx ? l[k] : mx;
    for (int i = nl; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    /* e = exp(x - max); the sum in lanes, then the tail in order */
    const vf vm_ = vf_set1(mx);
    vf acc = vf_zero();
    for (int i = 0; i < nl; i += 16) {
        const vf e = v_exp(vf_sub(vf_load(x + i), vm_));
        vf_store(x + i, e);
        acc = vf_add(acc, e);
    }
    float sum = vf_hsum(acc);
    if (nl < n) {
        const int c = n - nl;
        vf_storen(x + nl, v_exp(vf_sub(vf_loadn(x + nl, c), vm_)), c);
        for (int i = nl; i < n; i++) sum += x[i];
    }
    const vf vs = vf_set1(sum);
    OPS_MAP(n, i, c, OPS_ST(x, i, c, vf_div(OPS_LD(x, i, c), vs));)
}

static OPS_FN void OPS_NAME(situ)(float *out, const float *g, const float *u, int n, float b1,
                                  float b2) {
    const vf vb1 = vf_set1(b1), vb2 = vf_set1(b2);
    OPS_MAP(n, i, c, {
        const vf gi = OPS_LD(g, i, c), ui = OPS_LD(u, i, c);
        const vf left = vf_mul(vf_mul(vb1, v_tanh(vf_div(gi, vb1))), v_sigmoid(gi));
        const vf right = vf_mul(vb2, v_tanh(vf_div(ui, vb2)));
        OPS_ST(out, i, c, vf_mul(left, right));
    })
}

static OPS_FN void OPS_NAME(sigmoid_mul)(float *out, const float *x, const float *g, int n) {
    OPS_MAP(n, i, c, OPS_ST(out, i, c, vf_mul(OPS_LD(x, i, c), v_sigmoid(OPS_LD(g, i, c))));)
}

static OPS_FN void OPS_NAME(silu)(float *x, int n) {
    OPS_MAP(n, i, c, {
        const vf z = OPS_LD(x, i, c);
        OPS_ST(x, i, c, vf_mul(z, v_sigmoid(z)));
    })
}

static OPS_FN void OPS_NAME(kda_alpha)(float *alpha, const float *z, const float *dt, float A,
                                       float lb, int n) {
    const vf va = vf_set1(A), vlb = vf_set1(lb);
    OPS_MAP(n, i, c, {
        const vf s = v_sigmoid(vf_mul(va, vf_add(OPS_LD(z, i, c), OPS_LD(dt, i, c))));
        OPS_ST(alpha, i, c, v_exp(vf_mul(vlb, s)));
    })
}

static OPS_FN void OPS_NAME(scale_mul)(float *out, const float *x, float r, const float *w, int n) {
    const vf vr = vf_set1(r);
    OPS_MAP(n, i, c, OPS_ST(out, i, c, vf_mul(vf_mul(OPS_LD(x, i, c), vr), OPS_LD(w, i, c)));)
}

static OPS_FN void OPS_NAME(mix)(float *out, const float *const *v, const float *pi, int n, int D) {
    OPS_MAP(D, i, c, {
        vf acc = vf_zero();
        for (int e = 0; e < n; e++) acc = vf_add(acc, vf_mul(vf_set1(pi[e]), OPS_LD(v[e], i, c)));
        OPS_ST(out, i, c, acc);
    })
}

static OPS_FN void OPS_NAME(exp_map)(float *x, int n) {
    OPS_MAP(n, i, c, OPS_ST(x, i, c, v_exp(OPS_LD(x, i, c)));)
}

static OPS_FN void OPS_NAME(tanh_map)(float *x, int n) {
    OPS_MAP(n, i, c, OPS_ST(x, i, c, v_tanh(OPS_LD(x, i, c)));)
}

/* ---- reductions ---- */

static OPS_FN float OPS_NAME(sumsq)(const float *x, int n) {
    const int nl = n / 16 * 16;
    vf acc = vf_zero();
    for (int i = 0; i < nl; i += 16) {
        const vf v = vf_load(x + i);
        acc = vf_fma(v, v, acc);
    }
    float s = vf_hsum(acc);
    for (int i = nl; i < n; i++) s = fmaf(x[i], x[i], s);
    return s;
}

static OPS_FN void OPS_NAME(sumsq_dot_d)(const float *x, const float *w, int n, double *ss,
                                         double *dot) {
    const int nl = n / 8 * 8;
    vd s = vd_zero(), d = vd_zero();
    for (int i = 0; i < nl; i += 8) {
        const vd v = vd_from_f8(x + i);
        s = vd_add(s, vd_mul(v, v));
        if (w) d = vd_add(d, vd_mul(v, vd_from_f8(w + i)));
    }
    double a = vd_hsum(s), b = vd_hsum(d);
    for (int i = nl; i < n; i++) {
        a += (double)x[i] * (double)x[i];
        if (w) b += (double)x[i] * (double)w[i];
    }
    *ss = a;
    if (dot) *dot = b;
}

const k3_ops_tab OPS_TABLE = {
    .isa = OPS_LEVEL,
    .kda_decay_read = OPS_NAME(kda_decay_read),
    .kda_write_read = OPS_NAME(kda_write_read),
    .conv4 = OPS_NAME(conv4),
    .rows_comb = OPS_NAME(rows_comb),
    .wsum_multi = OPS_NAME(wsum_multi),
    .softmax = OPS_NAME(softmax),
    .situ = OPS_NAME(situ),
    .sigmoid_mul = OPS_NAME(sigmoid_mul),
    .silu = OPS_NAME(silu),
    .kda_alpha = OPS_NAME(kda_alpha),
    .sumsq = OPS_NAME(sumsq),
    .sumsq_dot_d = OPS_NAME(sumsq_dot_d),
    .scale_mul = OPS_NAME(scale_mul),
    .mix = OPS_NAME(mix),
    .exp_map = OPS_NAME(exp_map),
    .tanh_map = OPS_NAME(tanh_map),
};
