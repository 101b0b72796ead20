#!/usr/bin/python3
"""k3_ref_loops.py: a second, deliberately naive K3 forward, to check k3_ref.py.

k3_ref.py is vectorized numpy (batched matmuls, einsum, chunked prefill);
a slip in an index string or an axis would not show up in its own tests.
This file recomputes the same model from docs/MODEL.md with the most
literal code possible and different choices wherever the math allows them:
- float64 throughout (k3_ref: float32, so expect ~1e-6 relative agreement);
- one token at a time, one head at a time, explicit Python loops;
- the conv taps applied to a growing history instead of a shifting window;
- MLA in the ABSORBED form (q_abs = K_h^T q_nope, V_h after the weighted
  latent sum), where k3_ref expands keys and values per position;
- MXFP4 decoded nibble by nibble with 2.0 ** (s - 127);
- router top-k by sorting (-biased score, id) tuples.
Only the checkpoint reader (k3_ref.Model.raw / to_f32) is shared.

Tiny checkpoints only (the loops are slow). Use: logits(dir, ids) ->
float64 [T][vocab]; `k3_ref_loops.py DIR 5,7,9` prints the largest
difference from k3_ref.py.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_ref  # noqa: E402

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


class Loops:
    def __init__(self, d):
        self.m = k3_ref.load_model(d)
        self.c = self.m.cfg
        self.state = {}  # layer -> KDA {"S", "hist"} or MLA {"lat", "rho"}
        self.experts = {}

    def w(self, name):
        dt, shape, raw = self.m.ckpt.raw(self.m.prefix + name)
        if dt == "U8":
            return np.asarray(raw).reshape(shape)
        return k3_ref.to_f32(dt, shape, raw).astype(np.float64)

    def norm(self, x, w):
        return x / np.sqrt(np.mean(x * x) + self.c.eps) * w

    @staticmethod
    def sig(z):
        return 1.0 / (1.0 + np.exp(-z))

    def situ(self, g, u):
        b1, b2 = self.c.b1, self.c.b2
        return b1 * np.tanh(g / b1) * self.sig(g) * (b2 * np.tanh(u / b2))

    def mix(self, entries, w):
        s = [np.dot(v, w) / np.sqrt(np.mean(v * v) + self.c.eps) for v in entries]
        p = np.exp(np.array(s) - max(s))
        p /= p.sum()
        return sum(pk * v for pk, v in zip(p, entries))

    def kda(self, i, x):
        c = self.c
        H, d, K = c.kda_heads, c.kda_hd, c.conv_k
        A = "model.layers.%d.self_attn." % i
        st = self.state.setdefault(i, {"S": np.zeros((H, d, d)), "hist": {n: [] for n in "qkv"}})
        act = {}
        for n in "qkv":
            st["hist"][n].append(self.w(A + n + "_proj.weight") @ x)
            taps = self.w(A + n + "_conv1d.weight").reshape(-1, K)
            hist = st["hist"][n]
            y = np.zeros(H * d)
            for j in range(K):  # tap K-1 pairs with the current token
                t = len(hist) - K + j
                if t >= 0:
                    y += taps[:, j] * hist[t]
            act[n] = y * self.sig(y)
        g = self.w(A + "g_proj.weight") @ x
        z = self.w(A + "f_b_proj.weight") @ (self.w(A + "f_a_proj.weight") @ x) + self.w(A + "dt_bias")
        b = self.w(A + "b_proj.weight") @ x
        a_log = self.w(A + "A_log")
        o_norm = self.w(A + "o_norm.weight")
        heads = []
        for h in range(H):
            sl = slice(h * d, (h + 1) * d)
            q, k, v = act["q"][sl], act["k"][sl], act["v"][sl]
            q = q / np.sqrt(np.sum(q * q) + 1e-6) / np.sqrt(d)
            k = k / np.sqrt(np.sum(k * k) + 1e-6)
            alpha = np.exp(c.gate_lb * self.sig(np.exp(a_log[h]) * z[sl]))
            S = alpha[:, None] * st["S"][h]
            S = S + self.sig(b[h]) * np.outer(k, v - S.T @ k)
            st["S"][h] = S
            heads.append(self.norm(S.T @ q, o_norm) * self.sig(g[sl]))
        return self.w(A + "o_proj.weight") @ np.concatenate(heads)

    def mla(self, i, x):
        c = self.c
        H, nope, r, vh, kv = c.n_heads, c.nope, c.rope, c.v_head, c.kv_lora
        A = "model.layers.%d.self_attn." % i
        st = self.state.setdefault(i, {"lat": [], "rho": []})
        q = self.w(A + "q_b_proj.weight") @ self.norm(self.w(A + "q_a_proj.weight") @ x,
                                                      self.w(A + "q_a_layernorm.weight"))
        ckv = self.w(A + "kv_a_proj_with_mqa.weight") @ x
        st["lat"].append(self.norm(ckv[:kv], self.w(A + "kv_a_layernorm.weight")))
        st["rho"].append(ckv[kv:])
        kvb = self.w(A + "kv_b_proj.weight")
        g = self.sig(self.w(A + "g_proj.weight") @ x)
        ctx = []
        for h in range(H):
            qh = q[h * (nope + r):(h + 1) * (nope + r)]
            k_rows = kvb[h * (nope + vh):h * (nope + vh) + nope]
            v_rows = kvb[h * (nope + vh) + nope:(h + 1) * (nope + vh)]
            q_abs = k_rows.T @ qh[:nope]
            s = np.array([(q_abs @ lt + qh[nope:] @ rt) / np.sqrt(nope + r)
                          for lt, rt in zip(st["lat"], st["rho"])])
            p = np.exp(s - s.max())
            p /= p.sum()
            cbar = sum(pt * lt for pt, lt in zip(p, st["lat"]))
            ctx.append((v_rows @ cbar) * g[h * vh:(h + 1) * vh])
        return self.w(A + "o_proj.weight") @ np.concatenate(ctx)

    def dequant(self, packed, scale, rows, cols):
        out = np.zeros((rows, cols))
        for o in range(rows):
            for j in range(cols // 2):
                byte = int(packed[o, j])
                for half, nib in ((0, byte & 15), (1, byte >> 4)):
                    col = 2 * j + half
                    val = -E2M1[nib & 7] if nib & 8 else E2M1[nib & 7]
                    out[o, col] = val * 2.0 ** (int(scale[o, col // 32]) - 127)
        return out

    def expert(self, i, e):
        if (i, e) not in self.experts:
            c = self.c
            P = "model.layers.%d.block_sparse_moe.experts.%d." % (i, e)
            dims = {"w1": (c.moe_inter, c.latent), "w2": (c.latent, c.moe_inter), "w3": (c.moe_inter, c.latent)}
            self.experts[(i, e)] = {wn: self.dequant(self.w(P + wn + ".weight_packed"), self.w(P + wn + ".weight_scale"),
                                                     *dims[wn]) for wn in dims}
        return self.experts[(i, e)]

    def mlp(self, i, x):
        c = self.c
        if i < c.first_dense:
            M = "model.layers.%d.mlp." % i
            return self.w(M + "down_proj.weight") @ self.situ(self.w(M + "gate_proj.weight") @ x,
                                                              self.w(M + "up_proj.weight") @ x)
        M = "model.layers.%d.block_sparse_moe." % i
        s = self.sig(self.w(M + "gate.weight") @ x)
        biased = s + self.w(M + "gate.e_score_correction_bias")
        sel = [e for _, e in sorted((-biased[e], e) for e in range(c.n_experts))[:c.topk]]
        total = sum(s[e] for e in sel)
        z = self.w(M + "routed_expert_down_proj.weight") @ x
        acc = np.zeros(c.latent)
        for e in sel:
            ex = self.expert(i, e)
            acc += s[e] / total * (ex["w2"] @ self.situ(ex["w1"] @ z, ex["w3"] @ z))
        y = self.w(M + "routed_expert_up_proj.weight") @ self.norm(acc, self.w(M + "routed_expert_norm.weight"))
        shared = self.w(M + "shared_experts.down_proj.weight") @ self.situ(
            self.w(M + "shared_experts.gate_proj.weight") @ x, self.w(M + "shared_experts.up_proj.weight") @ x)
        return y + shared

    def step(self, tok):
        """One token through every layer and the head; returns logits and per-layer h."""
        c = self.c
        h = self.w("model.embed_tokens.weight")[tok]
        blocks, trace = [], []
        for i in range(c.n_layers):
            L = "model.layers.%d." % i
            p = h.copy()
            if blocks:
                h = self.mix(blocks + [p], self.w(L + "self_attention_res_norm.weight")
                             * self.w(L + "self_attention_res_proj.weight")[0])
            if i % c.res_bs == 0:
                blocks.append(p.copy())
            x = self.norm(h, self.w(L + "input_layernorm.weight"))
            a = self.kda(i, x) if c.kda[i] else self.mla(i, x)
            p = a if i % c.res_bs == 0 else p + a
            mixed = self.mix(blocks + [p], self.w(L + "mlp_res_norm.weight") * self.w(L + "mlp_res_proj.weight")[0])
            p = p + self.mlp(i, self.norm(mixed, self.w(L + "post_attention_layernorm.weight")))
            h = p
            trace.append(h)
        out = self.mix(blocks + [h], self.w("model.output_attn_res_norm.weight")
                       * self.w("model.output_attn_res_proj.weight")[0])
        return self.w("lm_head.weight") @ self.norm(out, self.w("model.norm.weight")), np.array(trace)


def logits(d, ids):
    """float64 logits [T][vocab] and trace [n_layers][T][D] of ids from a fresh state."""
    lp = Loops(d)
    rows, traces = zip(*(lp.step(int(t)) for t in ids))
    return np.array(rows), np.stack(traces, axis=1)


def main():
    if len(sys.argv) != 3:
        sys.stderr.write("usage: k3_ref_loops.py DIR 5,7,9\n")
        return 2
    ids = [int(x) for x in sys.argv[2].split(",")]
    lg, tr = logits(sys.argv[1], ids)
    m = k3_ref.load_model(sys.argv[1])
    rl, rt = k3_ref.prefill(m, k3_ref.new_state(m), ids)
    print("max |logits diff| %.3e (max |logit| %.2f), max |trace diff| %.3e, argmax equal: %s"
          % (np.abs(lg - rl).max(), np.abs(rl).max(), np.abs(tr - rt).max(),
             bool((lg.argmax(1) == rl.argmax(1)).all())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
