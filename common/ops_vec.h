/* common/ops_vec.h: the vector layer operators, written ONCE over a 16-lane
 * float type and included by each vector backend (ops_avx2.c, ops_avx512.c)
 * after it has defined the primitives below for its ISA. Private to those
 * two files. The operation sequence per lane is the scalar one of ops.c
 * (see ops_isa.h for the order), which is why one text serves every level.
 *
 * The including file defines:
 *   OPS_FN, OPS_INL          function attributes (target, inline)
 *   OPS_NAME(x)              backend-prefixed name
 *   OPS_TABLE, OPS_LEVEL     the k3_ops_tab to define and its k3_isa
 *   OPS_NB                   16-lane vectors per register block (KDA, wsum)
 *   OPS_RC_TT, OPS_RC_NV     rows_comb tile: tokens x 16-lane vectors
 *   vf (16 floats), vm (16-lane mask), vd (8 doubles) and
 *   vf_zero vf_set1 vf_load vf_loadn vf_store vf_storen vf_add vf_sub
 *   vf_mul vf_div vf_fma(a, b, c) = a*b + c rounded once, vf_max(a, b) =
 *   a > b ? a : b, vf_min(a, b) = a < b ? a : b, vf_rint vf_trunc vf_abs
 *   vf_neg vf_copysign vf_pow2i vf_isnan vf_blend(m, t, f) vf_hsum (the
 *   lane tree), vf_lanes (store 16 lanes), vf_dec_i8 vf_dec_i8n vf_dec_nib
 *   (16 packed bytes -> nibble - 8 of columns 2k, 2k+1), vf_store_ilv
 *   (out[2k] = ev[k], out[2k+1] = od[k]), vd_zero vd_from_f8 vd_add vd_mul
 *   vd_hsum.
 * A partial vector (n < 16 elements) is loaded with zeros in the other lanes
 * and stored under a mask: lanes never mix in elementwise code, so a partial
 * vector gives the scalar bits; reductions add their tails in element order
 * after the lane tree instead, as the scalar does.
 */

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

#define OPS_COLS_LOOP(j0, d) for (int j0 = 0; j0 < (d); j0 += OPS_NB * 16)
/* elements of vector b of a block at j0 in a row of d: 16, a tail, or <= 0 */
#define OPS_CNT(d, j0, b) ((d) - (j0) - 16 * (b))

static OPS_FN void OPS_NAME(kda_decay_read)(float *S, int d, const float *alpha, const float *k,
                                            float *u) {
    OPS_COLS_LOOP(j0, d) {
        vf acc[OPS_NB];
        for (int b = 0; b < OPS_NB; b++) acc[b] = vf_zero();
        for (int i = 0; i < d; i++) {
            float *row = S + (size_t)i * d + j0;
            const vf a = vf_set1(alpha[i]), kk = vf_set1(k[i]);
            for (int b = 0; b < OPS_NB; b++) {
                const int c = OPS_CNT(d, j0, b);
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
        for (int b = 0; b < OPS_NB; b++) {
            const int c = OPS_CNT(d, j0, b);
            if (c >= 16)
                vf_store(u + j0 + 16 * b, acc[b]);
            else if (c > 0)
                vf_storen(u + j0 + 16 * b, acc[b], c);
        }
    }
}

static OPS_FN void OPS_NAME(kda_write_read)(float *S, int d, const float *k, const float *delta,
                                            const float *q, float *o) {
    OPS_COLS_LOOP(j0, d) {
        vf acc[OPS_NB];
        for (int b = 0; b < OPS_NB; b++) acc[b] = vf_zero();
        for (int i = 0; i < d; i++) {
            float *row = S + (size_t)i * d + j0;
            const vf kk = vf_set1(k[i]), qq = vf_set1(q[i]);
            for (int b = 0; b < OPS_NB; b++) {
                const int c = OPS_CNT(d, j0, b);
                if (c >= 16) {
                    const vf s = vf_fma(kk, vf_load(delta + j0 + 16 * b), vf_load(row + 16 * b));
                    vf_store(row + 16 * b, s);
                    acc[b] = vf_fma(qq, s, acc[b]);
                } else if (c > 0) {
                    const vf s = vf_fma(kk, vf_loadn(delta + j0 + 16 * b, c),
                                        vf_loadn(row + 16 * b, c));
                    vf_storen(row + 16 * b, s, c);
                    acc[b] = vf_fma(qq, s, acc[b]);
                }
            }
        }
        for (int b = 0; b < OPS_NB; b++) {
            const int c = OPS_CNT(d, j0, b);
            if (c >= 16)
                vf_store(o + j0 + 16 * b, acc[b]);
            else if (c > 0)
                vf_storen(o + j0 + 16 * b, acc[b], c);
        }
    }
}

/* ---- MLA ---- */

/* Weighted row sums in the load format. Tiles of OPS_RC_TT tokens x
 * OPS_RC_NV vectors of columns: each decoded weight vector serves the
 * tile's tokens. int4 runs in nibble order (vector 2b = even columns of a
 * 32-column block, 2b+1 = odd) and is interleaved back at the store. */
static OPS_FN void OPS_NAME(rows_comb)(const k3_qmat *m, int row0, int nrows, const float *coef,
                                       size_t coef_ld, int T, float *acc) {
    const int cols = m->cols, W = OPS_RC_NV * 16;
    const int i4 = m->fmt == K3_QF_I4G64, ng = cols / 64;
    for (int t0 = 0; t0 < T; t0 += OPS_RC_TT) {
        const int nt = T - t0 < OPS_RC_TT ? T - t0 : OPS_RC_TT;
        for (int c0 = 0; c0 < cols; c0 += W) {
            vf a[OPS_RC_TT][OPS_RC_NV];
            for (int t = 0; t < OPS_RC_TT; t++)
                for (int b = 0; b < OPS_RC_NV; b++) a[t][b] = vf_zero();
            for (int i = 0; i < nrows; i++) {
                const int r = row0 + i;
                vf w[OPS_RC_NV];
                float s = 1.0f;
                if (i4) {
                    const uint8_t *q = m->q4 + (size_t)r * (cols / 2) + c0 / 2;
                    for (int b = 0; b < OPS_RC_NV / 2; b++)
                        vf_dec_nib(q + 16 * b, &w[2 * b], &w[2 * b + 1]);
                    s = m->scales[(size_t)r * ng + c0 / 64];
                } else {
                    for (int b = 0; b < OPS_RC_NV; b++) {
                        const int c = cols - c0 - 16 * b;
                        const size_t off = (size_t)r * cols + c0 + 16 * b;
                        if (m->fmt == K3_QF_F32)
                            w[b] = c >= 16 ? vf_load(m->w + off)
                                           : c > 0 ? vf_loadn(m->w + off, c) : vf_zero();
                        else
                            w[b] = c >= 16 ? vf_dec_i8(m->q8 + off)
                                           : c > 0 ? vf_dec_i8n(m->q8 + off, c) : vf_zero();
                    }
                    if (m->fmt == K3_QF_I8) s = m->scales[r];
                }
                for (int t = 0; t < OPS_RC_TT; t++) {
                    if (t >= nt) break;
                    const vf cs = vf_set1(coef[(size_t)(t0 + t) * coef_ld + i] * s);
                    for (int b = 0; b < OPS_RC_NV; b++) a[t][b] = vf_fma(cs, w[b], a[t][b]);
                }
            }
            for (int t = 0; t < nt; t++) {
                float *out = acc + (size_t)(t0 + t) * cols + c0;
                if (i4) {
                    for (int b = 0; b < OPS_RC_NV / 2; b++)
                        vf_store_ilv(out + 32 * b, a[t][2 * b], a[t][2 * b + 1]);
                    continue;
                }
                for (int b = 0; b < OPS_RC_NV; b++) {
                    const int c = cols - c0 - 16 * b;
                    if (c >= 16)
                        vf_store(out + 16 * b, a[t][b]);
                    else if (c > 0)
                        vf_storen(out + 16 * b, a[t][b], c);
                }
            }
        }
    }
}

static OPS_FN void OPS_NAME(wsum)(const float *rows, int cols, const float *p, int n, float *acc) {
    OPS_COLS_LOOP(j0, cols) {
        vf a[OPS_NB];
        for (int b = 0; b < OPS_NB; b++) a[b] = vf_zero();
        for (int s = 0; s < n; s++) {
            const float *row = rows + (size_t)s * cols + j0;
            const vf ps = vf_set1(p[s]);
            for (int b = 0; b < OPS_NB; b++) {
                const int c = OPS_CNT(cols, j0, b);
                if (c >= 16)
                    a[b] = vf_fma(ps, vf_load(row + 16 * b), a[b]);
                else if (c > 0)
                    a[b] = vf_fma(ps, vf_loadn(row + 16 * b, c), a[b]);
            }
        }
        for (int b = 0; b < OPS_NB; b++) {
            const int c = OPS_CNT(cols, j0, b);
            if (c >= 16)
                vf_store(acc + j0 + 16 * b, a[b]);
            else if (c > 0)
                vf_storen(acc + j0 + 16 * b, a[b], c);
        }
    }
}

/* ---- elementwise maps: full vectors, then one masked tail ---- */

#define OPS_MAP(n, i, c, ...)                                                                  \
    for (int i = 0; i < (n); i += 16) {                                                       \
        const int c = (n) - i < 16 ? (n) - i : 16;                                            \
        __VA_ARGS__                                                                            \
    }
#define OPS_LD(p, i, c)     ((c) == 16 ? vf_load((p) + (i)) : vf_loadn((p) + (i), (c)))
#define OPS_ST(p, i, c, v)  ((c) == 16 ? vf_store((p) + (i), (v)) : vf_storen((p) + (i), (v), (c)))

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

static OPS_FN void OPS_NAME(scale_mul)(float *out, const float *x, float r, const float *w,
                                       int n) {
    const vf vr = vf_set1(r);
    OPS_MAP(n, i, c, OPS_ST(out, i, c, vf_mul(vf_mul(OPS_LD(x, i, c), vr), OPS_LD(w, i, c)));)
}

static OPS_FN void OPS_NAME(mix)(float *out, const float *const *v, const float *pi, int n,
                                 int D) {
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
    .rows_comb = OPS_NAME(rows_comb),
    .wsum = OPS_NAME(wsum),
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
