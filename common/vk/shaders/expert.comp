// common/vk/shaders/expert.comp: one MXFP4 routed expert (docs/MODEL.md 3.6,
// 4.1) over n (position, rank) pairs, in two stages of one command buffer:
//   stage 0: a[t][r] = SiTU(W1 z_t, W3 z_t)[r]   invocation (r, t), r < I
//   stage 1: y[t][o] = (W2 a_t)[o]               invocation (o, t), o < L
// W1, W3 [I][L] (gate, up), W2 [L][I] (down) are the shard's bytes as
// stored, in the slot layout w1p w1s w2p w2s w3p w3s (docs/MODEL.md 4.1):
// e2m1 nibbles (low nibble = even column) and one ue8m0 exponent per 32
// columns, widened here; never re-encoded. Activations are f32.
//
// The sums follow the CPU exact-float kernel's nibble order (common/kernels/
// kernels.c): 16 lanes, lane k owns byte k of each 16-byte group; per group
// gs = d(lo) x (a multiply), gs = fma(d(hi), x, gs) with d = 2 v, folded in
// as acc + gs 2^(s-128) (what fma(gs, 2^(s-128), acc) computes whenever the
// power-of-two product is a normal float), then the lane tree. SiTU ports
// the CPU's exp/tanh (common/kernels/ops_isa.h) operation by operation.
// Every result is `precise`: no contraction the CPU does not do.
//
// FMA: a device may run GLSL fma() as a multiply and an add (lavapipe does:
// ~17 % of outputs then differ from the CPU by an ulp), so by default each
// fused step is computed in double: the product of two floats is exact
// there and the one rounding to float gives the fused result (built as
// expert.spv.inc; needs shaderFloat64). Built with -DK3_FMA_NATIVE
// (expert_f32.spv.inc) it uses fma() as the device gives it, for devices
// without float64: rel-L2 ~1e-7 from the CPU, not the same bits.
#version 450
#ifdef K3_FMA_NATIVE
#define FMA(a, b, c) fma(a, b, c)
#else
#extension GL_ARB_gpu_shader_fp64 : enable
#define FMA(a, b, c) fma_rn(a, b, c)
#endif

layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) readonly buffer Wb { uint w[]; };
layout(std430, set = 0, binding = 1) readonly buffer Xb { float x[]; };
layout(std430, set = 0, binding = 2) buffer Ab { float a[]; };
layout(std430, set = 0, binding = 3) writeonly buffer Yb { float y[]; };

layout(push_constant) uniform Pc {
    uint stage; // 0: gate, up, SiTU; 1: down
    uint n;     // pairs
    uint I;     // moe_inter
    uint L;     // latent
    float b1;   // situ_b1
    float b2;   // situ_b2
} pc;

#ifndef K3_FMA_NATIVE
// round(a b + c) to float, one rounding: the double product is exact; the
// double sum s plus its exact error e (TwoSum) is rounded to odd (an inexact
// s with an even last bit moves one double ulp towards e), and a 53-bit
// round-to-odd value rounds to float (24 bits) as the exact sum would. A
// plain double sum fails when c is far below a b and a b lies on a float
// halfway point: the tie would then be broken by c's sign, not by "even".
float fma_rn(float a, float b, float c) {
    precise double p = double(a) * double(b), cd = double(c);
    precise double sd = p + cd;
    precise double bb = sd - p;
    precise double e = (p - (sd - bb)) + (cd - bb);
    if (e != 0.0 && !isinf(sd) && !isnan(sd)) {
        uvec2 u = unpackDouble2x32(sd); // x: low word, y: high word
        if ((u.x & 1u) == 0u) {
            bool up = (e > 0.0) == (sd > 0.0); // away from zero when e has s's sign
            if (up) {
                u.x += 1u;
                if (u.x == 0u) u.y += 1u;
            } else {
                if (u.x == 0u) u.y -= 1u;
                u.x -= 1u;
            }
            sd = packDouble2x32(u);
        }
    }
    return float(sd);
}
#endif

const float D2[16] = float[16](0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
                               -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);

uint byte_at(uint off) { return (w[off >> 2] >> ((off & 3u) * 8u)) & 255u; }

// gs * 2^(s-128) (the half group factor): s = 0 -> +0, s = 255 -> +inf
float scaled(float gs, uint s) {
    precise float r;
    if (s == 0u)
        r = gs * 0.0;
    else if (s == 255u)
        r = gs * uintBitsToFloat(0x7f800000u);
    else
        r = ldexp(gs, int(s) - 128);
    return r;
}

float lane_tree(float l[16]) {
    precise float t[8];
    for (int k = 0; k < 8; k++) t[k] = l[k] + l[k + 8];
    precise float r = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    return r;
}

// One row of an MXFP4 matrix [rows][cols] against cols activations: the
// packed row at byte pb, its exponents at byte sb, activations from X (src
// 0) or A (src 1) at index xb.
float mx_row(uint pb, uint sb, uint cols, uint src, uint xb) {
    precise float l[16];
    for (int k = 0; k < 16; k++) l[k] = 0.0;
    uint ng = cols / 32u;
    for (uint g = 0u; g < ng; g++) {
        uint s = byte_at(sb + g);
        for (uint q = 0u; q < 4u; q++) {
            uint word = w[(pb + g * 16u) / 4u + q];
            for (uint j = 0u; j < 4u; j++) {
                uint k = q * 4u + j, b = (word >> (j * 8u)) & 255u;
                uint c = xb + g * 32u + 2u * k;
                float x0 = src == 0u ? x[c] : a[c];
                float x1 = src == 0u ? x[c + 1u] : a[c + 1u];
                precise float gs = D2[b & 15u] * x0;
                gs = FMA(D2[b >> 4], x1, gs);
                l[k] = l[k] + scaled(gs, s);
            }
        }
    }
    return lane_tree(l);
}

const float LOG2E = 1.44269502;
const float LN2_HI = 0.693145751953125;
const float LN2_LO = 1.42860676533018704e-6;
const float C7 = 1.0 / 5040.0, C6 = 1.0 / 720.0, C5 = 1.0 / 120.0, C4 = 1.0 / 24.0,
            C3 = 1.0 / 6.0, C2 = 0.5;

// a / b rounded to nearest: a device's division may be approximate (Vulkan
// allows 2.5 ulp; Mesa lowers it to a reciprocal and a multiply), so the
// quotient takes one residual correction: r = a - q b is exact by fma.
float div_rn(float an, float bd) {
    precise float q = an / bd;
#ifdef K3_FMA_NATIVE
    return q; // an unfused residual would make it worse
#endif
    if (isinf(bd) || isinf(q) || isnan(q) || q == 0.0) return q;
    precise float r = FMA(-q, bd, an);
    precise float q1 = FMA(r, 1.0 / bd, q);
    return q1;
}

float pow2i(float k) { return uintBitsToFloat(uint(int(k) + 127) << 23); }

float exp_k3(float xi) {
    if (isnan(xi)) return xi + xi;
    precise float xc = min(max(xi, -104.0), 89.0);
    precise float nn = roundEven(xc * LOG2E);
    precise float r = FMA(nn, -LN2_HI, xc);
    r = FMA(nn, -LN2_LO, r);
    precise float p = C7;
    p = FMA(p, r, C6);
    p = FMA(p, r, C5);
    p = FMA(p, r, C4);
    p = FMA(p, r, C3);
    p = FMA(p, r, C2);
    p = FMA(p, r, 1.0);
    p = FMA(p, r, 1.0);
    precise float n1 = trunc(nn * 0.5), n2 = nn - n1;
    precise float res = (p * pow2i(n1)) * pow2i(n2);
    return res;
}

float tanh_k3(float xi) {
    if (isnan(xi)) return xi + xi;
    precise float yy = min(2.0 * abs(xi), 19.0);
    precise float nn = roundEven(yy * LOG2E);
    precise float r = FMA(nn, -LN2_HI, yy);
    r = FMA(nn, -LN2_LO, r);
    precise float q = C7;
    q = FMA(q, r, C6);
    q = FMA(q, r, C5);
    q = FMA(q, r, C4);
    q = FMA(q, r, C3);
    q = FMA(q, r, C2);
    precise float pm1 = FMA(r * r, q, r);
    precise float s = pow2i(nn);
    precise float e = FMA(s, pm1, s - 1.0);
    precise float t = div_rn(e, e + 2.0);
    return (floatBitsToUint(xi) & 0x80000000u) != 0u ? -abs(t) : abs(t);
}

void main() {
    uint r = gl_GlobalInvocationID.x, t = gl_GlobalInvocationID.y;
    uint I = pc.I, L = pc.L;
    if (t >= pc.n) return;
    // slot layout offsets (bytes)
    uint w1p = 0u, w1s = w1p + I * L / 2u, w2p = w1s + I * L / 32u;
    uint w2s = w2p + L * I / 2u, w3p = w2s + L * I / 32u, w3s = w3p + I * L / 2u;
    if (pc.stage == 0u) {
        if (r >= I) return;
        float gv = mx_row(w1p + r * (L / 2u), w1s + r * (L / 32u), L, 0u, t * L);
        float uv = mx_row(w3p + r * (L / 2u), w3s + r * (L / 32u), L, 0u, t * L);
        // docs/MODEL.md 3.8: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]
        precise float sig = div_rn(1.0, 1.0 + exp_k3(-gv));
        precise float left = (pc.b1 * tanh_k3(div_rn(gv, pc.b1))) * sig;
        precise float right = pc.b2 * tanh_k3(div_rn(uv, pc.b2));
        a[t * I + r] = left * right;
    } else {
        if (r >= L) return;
        y[t * L + r] = mx_row(w2p + r * (I / 2u), w2s + r * (I / 32u), I, 1u, t * I);
    }
}
