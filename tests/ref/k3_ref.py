#!/usr/bin/python3
"""k3_ref.py: an independent numpy reference of the Kimi K3 forward pass.

Written from the model description alone (docs/MODEL.md, sections 1-5
and 7) as the oracle for the C engine's exact mode
(K3_BITS=32 K3_MLA_BITS=32 K3_HEAD_BITS=32 K3_IDOT=0): every weight is used
as exact float32 (BF16/F16 converted exactly, MXFP4 experts dequantized
exactly), never quantized.

Math precision (docs/MODEL.md 3.1, 3.3): float32 everywhere, except RMSNorm (mean of
squares and 1/sqrt in float64, x*r cast to float32, then times w) and the
AttnRes scores (dot and mean of squares in float64, score cast to float32).
Matrix products are numpy float32 matmuls (BLAS order, not the C order).
Prefill is layer-major over the chunk with the recurrences (conv windows,
KDA state, MLA cache) stepped token by token, so a whole-prompt forward and
a token-by-token forward agree to float rounding.

CLI
  k3_ref.py --model DIR --ids 5,7,9 [--ngen N] [--chunk C] [--print-ids]
            [--margins] [--trace FILE] [--logits FILE] [--layers N]
            [--ignore-eos]
  --ids       raw prompt ids, comma or space separated; no BOS is added.
  --ngen N    greedy tokens to generate (default 16); stops after an eos id
              from config.json (that id is printed) unless --ignore-eos.
  --print-ids prints "ids: a b c" (the generated ids only).
  --margins   prints "min_margin: X": the smallest top1 - top2 logit gap over
              every prompt position and every generation step.
  --chunk C   prefill in chunks of C tokens (default: the whole prompt).
  --layers N  run only the first N layers (no head: --trace only, rows
              [N][T][D]).
  Exit status 2 with "k3_ref: <what is wrong>" on a bad checkpoint or id.

File formats (raw little-endian float32, no header; the C engine writes the
same so the two can be compared with numpy.fromfile):
  --trace FILE   [n_layers][T][D]: for layer i and prompt position t, the
                 hidden h that layer i outputs (= the AttnRes running prefix
                 p after step 8 of docs/MODEL.md 3.3). T = prompt length, D = hidden.
                 Generated tokens are not included.
  --logits FILE  [T][vocab]: teacher-forced logits at every prompt position
                 (row t predicts the token after prompt[t]).

Module use: m = load_model(dir); st = new_state(m); logits, trace =
forward(m, st, ids) (continues from st, so call it again to decode);
prefill(m, st, ids, chunk); gen_ids, info = generate(m, prompt, ngen) with
info["logits"], info["trace"], info["margins"]. tests/ref/k3_ref_loops.py
is a naive float64 re-implementation used to check this file.

Environment: K3_REF_CACHE_GB (default 6) bounds the float32 weights kept
converted in memory; past it weights are converted on every use (slow but
bounded, for the real-dimension slice checkpoint).
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

F32 = np.float32
PREFIX = "language_model."
ST_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is refused

# e2m1 nibble -> value (docs/MODEL.md 4.1): bit 3 sign, bits 0..2 index the magnitudes.
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=F32)


class RefError(Exception):
    """A checkpoint the reference cannot use; the message names the thing."""


# --------------------------------------------------------------------------
# Checkpoint reading
# --------------------------------------------------------------------------

class SafeFile:
    """One safetensors file: parsed header, data read lazily through a memmap."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise RefError("%s: %d bytes, too short for a safetensors header" % (path, size))
            hl = struct.unpack("<Q", head)[0]
            if hl > min(size - 8, MAX_HEADER):
                raise RefError("%s: header length %d exceeds file size %d or limit %d"
                               % (path, hl, size, MAX_HEADER))
            try:
                hdr = json.loads(f.read(hl).decode("utf-8"))
            except ValueError as e:
                raise RefError("%s: header is not valid JSON: %s" % (path, e))
        self.base = 8 + hl
        self.tensors = {}
        if not isinstance(hdr, dict):
            raise RefError("%s: header is not a JSON object" % path)
        for name, v in hdr.items():
            if name == "__metadata__":
                continue
            try:
                dt, shape, (a, b) = v["dtype"], tuple(int(x) for x in v["shape"]), v["data_offsets"]
                a, b = int(a), int(b)
            except (KeyError, TypeError, ValueError):
                raise RefError("%s: tensor %s has a malformed header entry %r" % (path, name, v))
            if dt not in ST_DTYPES:
                raise RefError("%s: tensor %s has dtype %s, supported %s" % (path, name, dt, list(ST_DTYPES)))
            nb = ST_DTYPES[dt] * int(np.prod(shape, dtype=np.int64))
            if b - a != nb or a < 0 or self.base + b > size:
                raise RefError("%s: tensor %s offsets [%d, %d) do not fit shape %s %s in a %d-byte file"
                               % (path, name, a, b, list(shape), dt, size))
            self.tensors[name] = (dt, shape, a, b)
        self._map = None

    def raw(self, name):
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        dt, shape, a, b = self.tensors[name]
        return dt, shape, self._map[self.base + a:self.base + b]


def to_f32(dt, shape, raw):
    """Exact conversion of a stored tensor to float32 (a new array)."""
    if dt == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)
        return u.view(F32).reshape(shape)
    if dt == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(F32).reshape(shape)
    if dt == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(F32).reshape(shape)
    raise RefError("dtype %s cannot be read as float" % dt)


def mxfp4_dequant(packed, scale, rows, cols):
    """U8 [rows, cols/2] nibbles (low = even column) and U8 [rows, cols/32]
    E8M0 exponents -> float32 [rows, cols]. The scale is the float whose bit
    pattern is s << 23 (2^(s-127); s=0 gives 0, s=255 gives inf, as in C)."""
    p = np.asarray(packed, dtype=np.uint8).reshape(rows, cols // 2)
    nib = np.empty((rows, cols), dtype=np.uint8)
    nib[:, 0::2] = p & 0x0F
    nib[:, 1::2] = p >> 4
    s = np.asarray(scale, dtype=np.uint8).reshape(rows, cols // 32)
    sc = (s.astype(np.uint32) << np.uint32(23)).view(F32)
    w = E2M1[nib].reshape(rows, cols // 32, 32) * sc[:, :, None]
    return w.reshape(rows, cols)


class Checkpoint:
    """Tensor name -> file, from model.safetensors.index.json or a single
    model.safetensors. Files are opened on first use, so shards that hold
    nothing the model reads (vision) are never opened."""

    def __init__(self, d):
        self.dir = d
        idx = os.path.join(d, "model.safetensors.index.json")
        single = os.path.join(d, "model.safetensors")
        self.files = {}
        if os.path.exists(idx):
            with open(idx) as f:
                wm = json.load(f).get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise RefError("%s: no weight_map" % idx)
            self.where = dict(wm)
        elif os.path.exists(single):
            self.files["model.safetensors"] = SafeFile(single)
            self.where = {n: "model.safetensors" for n in self.files["model.safetensors"].tensors}
        else:
            raise RefError("%s: neither model.safetensors.index.json nor model.safetensors" % d)

    def has(self, name):
        return name in self.where

    def raw(self, name):
        fn = self.where.get(name)
        if fn is None:
            raise RefError("tensor %s is not in the checkpoint %s" % (name, self.dir))
        if fn not in self.files:
            self.files[fn] = SafeFile(os.path.join(self.dir, fn))
        sf = self.files[fn]
        if name not in sf.tensors:
            raise RefError("index maps %s to %s, but that file does not hold it" % (name, fn))
        return sf.raw(name)


class Config:
    """The model keys of docs/MODEL.md 1.1 (text_config if present, else the root)."""

    REQUIRED = ["hidden_size", "num_hidden_layers", "vocab_size", "first_k_dense_replace",
                "intermediate_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts",
                "num_experts_per_token", "moe_intermediate_size", "routed_expert_hidden_size",
                "num_shared_experts", "attn_res_block_size", "activation_situ_beta",
                "activation_situ_linear_beta"]

    def __init__(self, root):
        tc = root["text_config"] if isinstance(root.get("text_config"), dict) else root
        for k in self.REQUIRED:
            if not isinstance(tc.get(k), (int, float)) or isinstance(tc.get(k), bool):
                raise RefError("config.json: required key %s is missing or not a number (%r)" % (k, tc.get(k)))
        g = lambda k: int(tc[k])
        self.D, self.n_layers, self.vocab = g("hidden_size"), g("num_hidden_layers"), g("vocab_size")
        self.first_dense, self.dense_inter = g("first_k_dense_replace"), g("intermediate_size")
        self.n_heads, self.q_lora, self.kv_lora = g("num_attention_heads"), g("q_lora_rank"), g("kv_lora_rank")
        self.nope, self.rope, self.v_head = g("qk_nope_head_dim"), g("qk_rope_head_dim"), g("v_head_dim")
        self.n_experts, self.topk = g("num_experts"), g("num_experts_per_token")
        self.moe_inter, self.latent = g("moe_intermediate_size"), g("routed_expert_hidden_size")
        self.n_shared, self.res_bs = g("num_shared_experts"), g("attn_res_block_size")
        self.b1, self.b2 = float(tc["activation_situ_beta"]), float(tc["activation_situ_linear_beta"])
        self.eps = float(tc.get("rms_norm_eps", 1e-5))
        lac = tc.get("linear_attn_config")
        if not isinstance(lac, dict):
            raise RefError("config.json: linear_attn_config missing")
        for k in ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers"):
            if k not in lac:
                raise RefError("config.json: linear_attn_config.%s missing" % k)
        self.kda_heads, self.kda_hd = int(lac["num_heads"]), int(lac["head_dim"])
        self.conv_k = int(lac["short_conv_kernel_size"])
        self.gate_lb = float(lac.get("gate_lower_bound", -5.0))
        kl = lac["kda_layers"]
        if not isinstance(kl, list) or any(not isinstance(j, int) or not 1 <= j <= self.n_layers for j in kl):
            raise RefError("config.json: kda_layers must list one-based layers 1..%d, got %r" % (self.n_layers, kl))
        self.kda = [(i + 1) in set(kl) for i in range(self.n_layers)]
        bos = root.get("bos_token_id", tc.get("bos_token_id"))
        eos = root.get("eos_token_id", tc.get("eos_token_id"))
        self.bos = bos
        self.eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)[:8])
        lim = [("hidden_size", self.D, 1, 65536), ("num_hidden_layers", self.n_layers, 1, 128),
               ("num_experts", self.n_experts, 1, 4096), ("num_experts_per_token", self.topk, 1, min(64, self.n_experts)),
               ("vocab_size", self.vocab, 1, 1 << 22), ("short_conv_kernel_size", self.conv_k, 1, 8),
               ("head_dim", self.kda_hd, 1, 512), ("kv_lora_rank", self.kv_lora, 1, 4096)]
        for k, v, lo, hi in lim:
            if not lo <= v <= hi:
                raise RefError("config.json: %s = %d outside [%d, %d]" % (k, v, lo, hi))
        if self.latent < 32 or self.latent % 32 or self.moe_inter % 32:
            raise RefError("config.json: routed_expert_hidden_size %d and moe_intermediate_size %d must be "
                           "multiples of 32 (latent >= 32)" % (self.latent, self.moe_inter))
        if any(self.kda) and self.kda_heads > self.kda_hd:
            raise RefError("config.json: linear_attn_config.num_heads %d > head_dim %d: A_log [head_dim] "
                           "cannot hold one value per head" % (self.kda_heads, self.kda_hd))
        if self.res_bs < 1 or -(-self.n_layers // self.res_bs) + 1 > 16:
            raise RefError("config.json: ceil(%d / %d) + 1 AttnRes entries exceed 16"
                           % (self.n_layers, self.res_bs))


class Model:
    """Config plus lazily converted float32 weights (docs/MODEL.md 2.2 names)."""

    def __init__(self, d):
        with open(os.path.join(d, "config.json")) as f:
            self.cfg = Config(json.load(f))
        self.ckpt = Checkpoint(d)
        probe = "model.layers.0.input_layernorm.weight"
        if self.ckpt.has(probe):
            self.prefix = ""
        elif self.ckpt.has(PREFIX + probe):
            self.prefix = PREFIX
        else:
            raise RefError("%s: %s not found with or without the %s prefix" % (d, probe, PREFIX))
        self.cache = {}
        self.cache_bytes = 0
        self.cache_limit = float(os.environ.get("K3_REF_CACHE_GB", "6")) * (1 << 30)
        self.folded = {}

    def name(self, n):
        return self.prefix + n

    def raw(self, n, shape, dtypes):
        dt, sh, raw = self.ckpt.raw(self.name(n))
        if sh != tuple(shape) or dt not in dtypes:
            raise RefError("tensor %s: %s %s, expected %s %s" % (self.name(n), dt, list(sh), "/".join(dtypes), list(shape)))
        return dt, sh, raw

    def w(self, n, shape, dtypes=("BF16", "F16", "F32")):
        """float32 weight n of the given shape; cached within K3_REF_CACHE_GB."""
        got = self.cache.get(n)
        if got is not None:
            return got
        a = to_f32(*self.raw(n, shape, dtypes))
        if self.cache_bytes + a.nbytes <= self.cache_limit:
            self.cache[n] = a
            self.cache_bytes += a.nbytes
        return a

    def fold(self, key, norm, proj):
        """Folded AttnRes weight norm.weight * proj.weight (float32 product)."""
        got = self.folded.get(key)
        if got is None:
            D = self.cfg.D
            got = self.w(norm, (D,)) * self.w(proj, (1, D))[0]
            self.folded[key] = got
        return got

    def expert(self, i, e):
        """Dequantized (w1 gate [I, L], w3 up [I, L], w2 down [L, I]) of expert e in layer i."""
        key = ("expert", i, e)
        got = self.cache.get(key)
        if got is not None:
            return got
        c = self.cfg
        I, L = c.moe_inter, c.latent
        base = "model.layers.%d.block_sparse_moe.experts.%d." % (i, e)
        out = []
        for wn, (o, inn) in (("w1", (I, L)), ("w3", (I, L)), ("w2", (L, I))):
            _, _, p = self.raw(base + wn + ".weight_packed", (o, inn // 2), ("U8",))
            _, _, s = self.raw(base + wn + ".weight_scale", (o, inn // 32), ("U8",))
            s = np.asarray(s)
            if s.min() == 0 or s.max() == 255:
                sys.stderr.write("k3_ref: warning: %s.weight_scale holds E8M0 byte %d (zero or inf)\n"
                                 % (base + wn, 0 if s.min() == 0 else 255))
            out.append(mxfp4_dequant(p, s, o, inn))
        nb = sum(a.nbytes for a in out)
        if self.cache_bytes + nb <= self.cache_limit:
            self.cache[key] = out
            self.cache_bytes += nb
        return out


def load_model(d):
    return Model(d)


# --------------------------------------------------------------------------
# Building blocks (docs/MODEL.md 3.1, 3.3, 3.8)
# --------------------------------------------------------------------------

def rmsnorm(x, w, eps):
    """x [..., n] f32: mean of squares and 1/sqrt in float64, x*r cast to f32, times w."""
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * r).astype(F32) * w


def sigmoid(z):
    with np.errstate(over="ignore"):
        return (F32(1) / (F32(1) + np.exp(-z))).astype(F32)


def silu(z):
    return z * sigmoid(z)


def situ(g, u, b1, b2):
    """SiTU-GLU: [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)]; sigmoid of the uncapped g."""
    b1, b2 = F32(b1), F32(b2)
    return (b1 * np.tanh(g / b1) * sigmoid(g)) * (b2 * np.tanh(u / b2))


def mm(x, w):
    """x [T, in] f32 times the [out, in] matrix w: y = x w^T, [T, out] f32."""
    return np.matmul(x, w.T).astype(F32, copy=False)


def attnres_mix(entries, w, eps):
    """Mix of docs/MODEL.md 3.3 over entries [n][T][D] (blocks in order, prefix last).

    Scores: (v.w) / sqrt(mean v^2 + eps) in float64, cast to float32; softmax in
    float32 over the entries; the RAW entries are summed in order in float32.
    """
    w64 = w.astype(np.float64)
    scores = []
    for v in entries:
        v64 = v.astype(np.float64)
        s = (v64 @ w64) / np.sqrt(np.mean(v64 * v64, axis=-1) + eps)
        scores.append(s.astype(F32))
    s = np.stack(scores)  # [n, T]
    e = np.exp(s - s.max(axis=0))
    pi = e / e.sum(axis=0)
    out = np.zeros_like(entries[0])
    for k, v in enumerate(entries):
        out += pi[k][:, None] * v
    return out


# --------------------------------------------------------------------------
# State (docs/MODEL.md 5.1)
# --------------------------------------------------------------------------

class State:
    """Per-sequence recurrent state: KDA S [H][d][d] and conv windows
    [P][K] (oldest first) for KDA layers; latent [t][kv_lora] and raw rope
    key [t][rope] caches for MLA layers; pos = tokens consumed."""

    def __init__(self, m):
        c = m.cfg
        self.pos = 0
        self.layers = []
        P = c.kda_heads * c.kda_hd
        for i in range(c.n_layers):
            if c.kda[i]:
                self.layers.append({
                    "S": np.zeros((c.kda_heads, c.kda_hd, c.kda_hd), dtype=F32),
                    "conv": [np.zeros((P, c.conv_k), dtype=F32) for _ in range(3)]})
            else:
                self.layers.append({"lat": np.zeros((0, c.kv_lora), dtype=F32),
                                    "rho": np.zeros((0, c.rope), dtype=F32)})


def new_state(m):
    return State(m)


# --------------------------------------------------------------------------
# Attention (docs/MODEL.md 3.4 KDA, 3.5 gated MLA)
# --------------------------------------------------------------------------

def kda(m, i, st, x):
    """KDA on x [T, D] (already input-normed). Steps conv and state token by token."""
    c = m.cfg
    H, d, K, D = c.kda_heads, c.kda_hd, c.conv_k, c.D
    P = H * d
    A = "model.layers.%d.self_attn." % i
    proj = [mm(x, m.w(A + n + "_proj.weight", (P, D))) for n in ("q", "k", "v")]
    g_out = mm(x, m.w(A + "g_proj.weight", (P, D)))
    z_raw = mm(mm(x, m.w(A + "f_a_proj.weight", (d, D))), m.w(A + "f_b_proj.weight", (P, d)))
    b = mm(x, m.w(A + "b_proj.weight", (H, D)))
    taps = [m.w(A + n + "_conv1d.weight", (P, 1, K), ("F32",)).reshape(P, K) for n in ("q", "k", "v")]
    dt_bias = m.w(A + "dt_bias", (P,), ("F32",))
    a_log = m.w(A + "A_log", (d,), ("F32",))[:H]  # only the first H entries mean anything
    a_head = np.exp(a_log).astype(F32)
    o_norm = m.w(A + "o_norm.weight", (d,), ("F32",))
    L = st.layers[i]
    S = L["S"]
    inv_sqrt_d = F32(1.0 / np.sqrt(d))
    out = np.empty((x.shape[0], P), dtype=F32)
    for t in range(x.shape[0]):
        qkv = []
        for j in range(3):
            win = L["conv"][j]
            win[:, :-1] = win[:, 1:].copy()
            win[:, -1] = proj[j][t]
            acc = np.zeros(P, dtype=F32)
            for k in range(K):  # oldest tap first
                acc += taps[j][:, k] * win[:, k]
            qkv.append(silu(acc).reshape(H, d))
        q, k, v = qkv
        qn = q / np.sqrt(np.sum(q * q, axis=1, keepdims=True) + F32(1e-6)) * inv_sqrt_d
        kn = k / np.sqrt(np.sum(k * k, axis=1, keepdims=True) + F32(1e-6))
        z = (z_raw[t] + dt_bias).reshape(H, d)
        alpha = np.exp(F32(c.gate_lb) * sigmoid(a_head[:, None] * z))  # [H, d]
        beta = sigmoid(b[t])  # [H]
        S *= alpha[:, :, None]  # decay row k of each head's state
        u = np.einsum("hk,hkv->hv", kn, S)  # u = S^T k from the decayed state
        delta = beta[:, None] * (v - u)
        S += kn[:, :, None] * delta[:, None, :]  # rank-1 write
        o = np.einsum("hk,hkv->hv", qn, S)  # read from the updated state
        gate = sigmoid(g_out[t].reshape(H, d))
        out[t] = (rmsnorm(o, o_norm, c.eps) * gate).reshape(P)
    return mm(out, m.w(A + "o_proj.weight", (D, P)))


def mla(m, i, st, x):
    """Gated MLA (NoPE) on x [T, D], expanded form: k_t = K_h l_t, v_t = V_h l_t."""
    c = m.cfg
    H, nope, r, vh, kv, D = c.n_heads, c.nope, c.rope, c.v_head, c.kv_lora, c.D
    A = "model.layers.%d.self_attn." % i
    T = x.shape[0]
    qa = rmsnorm(mm(x, m.w(A + "q_a_proj.weight", (c.q_lora, D))), m.w(A + "q_a_layernorm.weight", (c.q_lora,)), c.eps)
    q = mm(qa, m.w(A + "q_b_proj.weight", (H * (nope + r), c.q_lora))).reshape(T, H, nope + r)
    ckv = mm(x, m.w(A + "kv_a_proj_with_mqa.weight", (kv + r, D)))
    lat = rmsnorm(ckv[:, :kv], m.w(A + "kv_a_layernorm.weight", (kv,)), c.eps)
    rho = ckv[:, kv:]
    L = st.layers[i]
    L["lat"] = np.concatenate([L["lat"], lat])  # the whole chunk is cached first
    L["rho"] = np.concatenate([L["rho"], rho])
    kvb = m.w(A + "kv_b_proj.weight", (H * (nope + vh), kv)).reshape(H, nope + vh, kv)
    keys = np.einsum("hnc,tc->thn", kvb[:, :nope], L["lat"]).astype(F32)  # [t, H, nope]
    vals = np.einsum("hvc,tc->thv", kvb[:, nope:], L["lat"]).astype(F32)  # [t, H, v]
    g = sigmoid(mm(x, m.w(A + "g_proj.weight", (H * vh, D)))).reshape(T, H, vh)
    scale = F32(1.0 / np.sqrt(nope + r))
    pos0 = st.pos
    ctx = np.empty((T, H, vh), dtype=F32)
    for t in range(T):
        n = pos0 + t + 1  # causal: cache rows 0..pos0+t
        s = (np.einsum("hn,thn->ht", q[t, :, :nope], keys[:n])
             + np.einsum("hr,tr->ht", q[t, :, nope:], L["rho"][:n])) * scale
        s = s.astype(F32)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        ctx[t] = np.einsum("ht,thv->hv", p, vals[:n]) * g[t]
    return mm(ctx.reshape(T, H * vh), m.w(A + "o_proj.weight", (D, H * vh)))


# --------------------------------------------------------------------------
# MLPs (docs/MODEL.md 3.6 LatentMoE, 3.7 dense)
# --------------------------------------------------------------------------

def dense_mlp(m, i, x):
    c = m.cfg
    M = "model.layers.%d.mlp." % i
    F, D = c.dense_inter, c.D
    a = situ(mm(x, m.w(M + "gate_proj.weight", (F, D))), mm(x, m.w(M + "up_proj.weight", (F, D))), c.b1, c.b2)
    return mm(a, m.w(M + "down_proj.weight", (D, F)))


def route(m, i, x):
    """Router for x [D]: returns (expert ids in selection order, weights)."""
    c = m.cfg
    M = "model.layers.%d.block_sparse_moe." % i
    s = sigmoid(m.w(M + "gate.weight", (c.n_experts, c.D)) @ x)
    bias = m.w(M + "gate.e_score_correction_bias", (c.n_experts,), ("F32",))
    sel = np.argsort(-(s + bias), kind="stable")[:c.topk]  # ties: lower index first
    raw = s[sel]
    return sel, (raw / (raw.sum() + F32(1e-20))).astype(F32)


def moe(m, i, x, routes=None):
    """LatentMoE on x [T, D]; routes (if a list) receives the selected ids per token."""
    c = m.cfg
    M = "model.layers.%d.block_sparse_moe." % i
    D, Lt = c.D, c.latent
    z = mm(x, m.w(M + "routed_expert_down_proj.weight", (Lt, D)))
    U = np.zeros((x.shape[0], Lt), dtype=F32)
    for t in range(x.shape[0]):
        sel, wts = route(m, i, x[t])
        if routes is not None:
            routes.append(sel.tolist())
        for e, we in zip(sel, wts):  # selection order
            w1, w3, w2 = m.expert(i, int(e))
            a = situ(w1 @ z[t], w3 @ z[t], c.b1, c.b2)
            U[t] += we * (w2 @ a)
    U = rmsnorm(U, m.w(M + "routed_expert_norm.weight", (Lt,)), c.eps)
    y = mm(U, m.w(M + "routed_expert_up_proj.weight", (D, Lt)))
    S = c.n_shared * c.moe_inter
    sh = situ(mm(x, m.w(M + "shared_experts.gate_proj.weight", (S, D))),
              mm(x, m.w(M + "shared_experts.up_proj.weight", (S, D))), c.b1, c.b2)
    return y + mm(sh, m.w(M + "shared_experts.down_proj.weight", (D, S)))


# --------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------

def forward(m, st, ids, n_layers=None, head=True):
    """Runs tokens ids (positions st.pos..) through the model, updating st.

    Returns (logits [T, vocab] f32 or None, trace [n_layers, T, D] f32).
    """
    c = m.cfg
    n_layers = c.n_layers if n_layers is None else n_layers
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise RefError("forward needs a non-empty 1-D list of ids")
    if ids.min() < 0 or ids.max() >= c.vocab:
        raise RefError("token id %d outside the vocabulary [0, %d)" % (ids.max() if ids.max() >= c.vocab else ids.min(), c.vocab))
    dt, _, emb = m.raw("model.embed_tokens.weight", (c.vocab, c.D), ("BF16", "F16", "F32"))
    esz = ST_DTYPES[dt]
    h = np.stack([to_f32(dt, (c.D,), emb[int(t) * c.D * esz:(int(t) + 1) * c.D * esz]) for t in ids])
    T = len(ids)
    trace = np.empty((n_layers, T, c.D), dtype=F32)
    B = []  # AttnRes block list: rebuilt for every token, here for the chunk
    for i in range(n_layers):
        L = "model.layers.%d." % i
        boundary = i % c.res_bs == 0
        p = h.copy()  # 1. the running prefix enters as h
        if B:  # 2. pre-attention mix (none at layer 0)
            h = attnres_mix(B + [p], m.fold(("attn", i), L + "self_attention_res_norm.weight",
                                            L + "self_attention_res_proj.weight"), c.eps)
        if boundary:  # 3. snapshot of the incoming prefix, after the mix
            B.append(p.copy())
        x = rmsnorm(h, m.w(L + "input_layernorm.weight", (c.D,)), c.eps)  # 4.
        a = kda(m, i, st, x) if c.kda[i] else mla(m, i, st, x)
        p = a if boundary else p + a  # 5. the prefix restarts at a boundary
        mix = attnres_mix(B + [p], m.fold(("mlp", i), L + "mlp_res_norm.weight", L + "mlp_res_proj.weight"), c.eps)
        x = rmsnorm(mix, m.w(L + "post_attention_layernorm.weight", (c.D,)), c.eps)  # 7.
        f = dense_mlp(m, i, x) if i < c.first_dense else moe(m, i, x)
        p = p + f  # 8.
        h = p
        trace[i] = h
    st.pos += T
    if not head or n_layers < c.n_layers:
        return None, trace
    out = attnres_mix(B + [h], m.fold("out", "model.output_attn_res_norm.weight",
                                      "model.output_attn_res_proj.weight"), c.eps)
    xn = rmsnorm(out, m.w("model.norm.weight", (c.D,)), c.eps)
    logits = mm(xn, m.w("lm_head.weight", (c.vocab, c.D)))
    return logits, trace


def prefill(m, st, ids, chunk=None, n_layers=None):
    """forward over ids in chunks of `chunk` tokens (None: all at once)."""
    chunk = chunk or len(ids)
    logits, traces = [], []
    for a in range(0, len(ids), chunk):
        lg, tr = forward(m, st, ids[a:a + chunk], n_layers=n_layers)
        logits.append(lg)
        traces.append(tr)
    lg = None if logits[0] is None else np.concatenate(logits)
    return lg, np.concatenate(traces, axis=1)


def margin(row):
    top = np.partition(row, -2)[-2:]
    return float(top[1] - top[0])


def generate(m, prompt, ngen, chunk=None, ignore_eos=False, st=None):
    """Greedy generation (ties to the lowest id). Returns (generated ids, info)
    with info = {"logits": prompt logits [T, V], "trace": [n_layers, T, D],
    "margins": top1-top2 per prompt position then per generation step}."""
    st = st or new_state(m)
    logits, trace = prefill(m, st, list(prompt), chunk)
    margins = [margin(r) for r in logits]
    out = []
    row = logits[-1]
    for step in range(ngen):
        nxt = int(np.argmax(row))
        out.append(nxt)
        if (nxt in m.cfg.eos and not ignore_eos) or step == ngen - 1:
            break
        lg, _ = forward(m, st, [nxt])
        row = lg[-1]
        margins.append(margin(row))
    return out, {"logits": logits, "trace": trace, "margins": margins}


def parse_ids(s):
    try:
        return [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise RefError("--ids %r: expected integers separated by commas or spaces" % s)


def main(argv=None):
    ap = argparse.ArgumentParser(description="numpy reference of the Kimi K3 forward pass "
                                             "(file formats in the module docstring)")
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--ids", required=True, help="prompt ids, e.g. 5,7,9 (no BOS is added)")
    ap.add_argument("--ngen", type=int, default=16, help="greedy tokens to generate (default 16)")
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (default: whole prompt)")
    ap.add_argument("--layers", type=int, default=0, help="run only the first N layers (trace only)")
    ap.add_argument("--trace", help="write f32 [n_layers][T][D] hidden states of the prompt")
    ap.add_argument("--logits", help="write f32 [T][vocab] teacher-forced prompt logits")
    ap.add_argument("--print-ids", action="store_true", help='print "ids: a b c" (generated ids)')
    ap.add_argument("--margins", action="store_true", help='print "min_margin: X"')
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at an eos id")
    a = ap.parse_args(argv)
    try:
        m = load_model(a.model)
        ids = parse_ids(a.ids)
        if not ids:
            raise RefError("--ids is empty")
        if a.ngen < 0 or a.chunk < 0 or a.layers < 0:
            raise RefError("--ngen, --chunk and --layers must be >= 0")
        if a.layers and a.layers < m.cfg.n_layers:
            if a.logits or a.ngen and (a.print_ids or a.margins):
                raise RefError("--layers %d < %d runs no head: only --trace is available"
                               % (a.layers, m.cfg.n_layers))
            _, trace = prefill(m, new_state(m), ids, a.chunk or None, n_layers=a.layers)
            gen, info = [], {"trace": trace}
        else:
            gen, info = generate(m, ids, a.ngen, a.chunk or None, a.ignore_eos)
    except (RefError, OSError, ValueError, KeyError) as e:
        sys.stderr.write("k3_ref: %s\n" % e)
        return 2
    if a.trace:
        info["trace"].astype("<f4").tofile(a.trace)
    if a.logits:
        info["logits"].astype("<f4").tofile(a.logits)
    if a.print_ids:
        print("ids: " + " ".join(str(x) for x in gen))
    if a.margins and "margins" in info:
        print("min_margin: %.6f" % min(info["margins"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
