#!/usr/bin/env python3
# Generates testdata/tiny/: tiny random Llama GGUF models and float64 numpy reference logits.
"""Fixtures for `gpu-worker/tests/tiny_llama_reference.rs`.

The real test model (SmolLM2, Q4_1, tied output, no RoPE scaling) leaves several paths of the
Llama forward pass unexercised. This script writes, deterministically (fixed seed), a few tiny
random Llama models that cover them, each with an independent float64 reference of its logits:

* `f32_untied_freqs`  -- every weight F32, untied `output.weight`, per-pair RoPE divisors in a
  `rope_freqs.weight` tensor (arbitrary values 1..8, not a llama3 curve), GQA 4 heads / 2 KV
  heads, head_dim 16.
* `f16_llama3_meta`   -- F16 weights, untied F16 output, llama3 RoPE scaling computed from the
  metadata keys `llama.rope.scaling.{type,factor,low_freq_factor,high_freq_factor,
  original_context_length}` (no rope_freqs tensor), freq base 500000, GQA 4/2 with an explicit
  `attention.key_length` of 32 (head_dim 32, so the Q width 128 differs from n_embd 64).
* `q8_0_linear_tied`  -- Q8_0 weights (and embedding), linear RoPE scaling factor 2, tied
  output (no `output.weight`), 2 heads / 1 KV head, head_dim 32, 3 layers.
* `mixed_quant`       -- one weight type per matrix kind: BF16 embedding, Q4_0 / Q4_1 / Q5_0 /
  Q5_1 attention, Q8_0 / BF16 / Q5_1 MLP, Q4_1 untied output; no RoPE scaling; MQA (4 heads,
  1 KV head); RMS epsilon 0.2 so that the metadata value matters.
* `f16_head_dim_24`   -- F16, 2 heads / 1 KV head of 24 dimensions: a head size that is not a
  multiple of 16 (ggml's SIMD width for f16 attention dot products).

For each `<name>` the directory gets:

* `<name>.gguf`        -- the model (tokenizer: GPT-2 byte-level characters of the bytes, a few
  merges whose results replace the never-valid UTF-8 bytes 0xF5..0xFA, all token types 1).
* `<name>.logits.bin`  -- the exact reference logits, float32 little-endian,
  `[position][vocab]`, for every position of the fixed 40-token sequence.
* `<name>.rounded.bin` -- the same pass with ggml's activation rounding applied (see below).
* `<name>.json`        -- tokens, shapes, the hyper-parameters and RoPE divisors used, and
  statistics: logit scale, top-2 gaps, `rounding_dev_max/_rms` (rounded - exact over the
  logits' rms) and `ablations` (max change / rms when one thing is done wrong: no RoPE, NeoX
  pairs, RoPE scaling ignored, divisors multiplied, tied instead of untied output, eps 1e-5
  instead of the metadata's, query head h reading KV head h % n_kv).

Both references are float64 numpy on the *dequantised* weights (`gguf.quants.dequantize`) and
implement the Llama forward pass from its definition, not from Duet's code:

  embedding row -> per layer: RMSNorm (eps from metadata), Q/K/V, normal (non-NeoX) RoPE that
  rotates consecutive pairs (x[2i], x[2i+1]) by pos * base^(-2i/n_rot) / divisor_i * (1/linear
  factor), causal GQA attention (query head h reads KV head h // group, scale 1/sqrt(head_dim)),
  output projection + residual, RMSNorm, SwiGLU (silu(gate) * up, then down) + residual ->
  final RMSNorm -> LM head (`output.weight`, else the token embedding).

The exact one differs from Duet (and llama.cpp) only by their activation rounding; the rounded
one applies that rounding and nothing else: before every matrix product the activations become
the weight type's vec-dot type (F32: unchanged; F16 / BF16: rounded to nearest even; 32-element
quantised types: Q8_0 / Q8_1 blocks, q = round-half-even(x * 127 / amax), d = amax / 127 stored
as f16, plus Q8_1's separately f16-rounded block sum for the Q4_1 / Q5_1 minimums); Q, K, V
and the softmax weights are rounded to f16. Everything else stays float64.

The weights are written as stored (no Q/K permutation: llama.cpp's converter permutes HF
weights for the normal RoPE, but these are generated directly in GGUF order).

llama3 divisors follow llama.cpp's converter (`convert_hf_to_gguf.py`, LlamaModel
`generate_extra_tensors`): wavelen = 2*pi/freq; 1 below the high-frequency wavelength, `factor`
above the low-frequency one, else 1 / ((1 - smooth) / factor + smooth) with
smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor).

Usage: `python3 scripts/gen_tiny_llama.py` (needs `pip install gguf numpy`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T

from gen_random_model import byte_chars

SEED = 20250612
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "testdata" / "tiny"
N_VOCAB = 256
N_CTX = 256
N_TOKENS = 40  # crosses the attention's KV padding of 32

VARIANTS = [
    dict(
        name="f32_untied_freqs",
        n_embd=64, n_head=4, n_kv_head=2, key_length=None, n_ff=64, n_layer=2,
        eps=1e-5, base=10000.0,
        rope=dict(kind="freqs_tensor"),
        types=dict(embd=T.F32, q=T.F32, k=T.F32, v=T.F32, o=T.F32, gate=T.F32, up=T.F32, down=T.F32, output=T.F32),
    ),
    dict(
        name="f16_llama3_meta",
        n_embd=64, n_head=4, n_kv_head=2, key_length=32, n_ff=128, n_layer=2,
        eps=1e-6, base=500000.0,
        rope=dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64.0),
        types=dict(embd=T.F16, q=T.F16, k=T.F16, v=T.F16, o=T.F16, gate=T.F16, up=T.F16, down=T.F16, output=T.F16),
    ),
    dict(
        name="q8_0_linear_tied",
        n_embd=64, n_head=2, n_kv_head=1, key_length=None, n_ff=96, n_layer=3,
        eps=1e-5, base=10000.0,
        rope=dict(kind="linear", factor=2.0),
        types=dict(embd=T.Q8_0, q=T.Q8_0, k=T.Q8_0, v=T.Q8_0, o=T.Q8_0, gate=T.Q8_0, up=T.Q8_0, down=T.Q8_0, output=None),
    ),
    dict(
        name="mixed_quant",
        n_embd=64, n_head=4, n_kv_head=1, key_length=None, n_ff=96, n_layer=2,
        eps=0.2, base=10000.0,
        rope=dict(kind="none"),
        types=dict(embd=T.BF16, q=T.Q4_0, k=T.Q4_1, v=T.Q5_0, o=T.Q5_1, gate=T.Q8_0, up=T.BF16, down=T.Q5_1, output=T.Q4_1),
    ),
    dict(
        name="f16_head_dim_24",
        n_embd=48, n_head=2, n_kv_head=1, key_length=None, n_ff=64, n_layer=2,
        eps=1e-5, base=10000.0,
        rope=dict(kind="none"),
        types=dict(embd=T.F16, q=T.F16, k=T.F16, v=T.F16, o=T.F16, gate=T.F16, up=T.F16, down=T.F16, output=T.F16),
    ),
]

# Gains (std * sqrt(fan_in)) chosen so that attention scores have a std of a few units (sharp,
# position-dependent attention: RoPE mistakes show), the residual stream stays O(1) and the
# logits have a std of ~2-3 (clear argmaxes).
GAIN = dict(q=1.6, k=1.6, v=1.0, o=0.8, gate=1.0, up=1.0, down=0.8, output=2.5)
EMBD_STD = 0.5


def vocab() -> tuple[list[str], list[str]]:
    """256 tokens: one per byte, except that the bytes 0xF5..0xFA (never in valid UTF-8) give
    their ids to merged tokens, so the merges list is not empty (GGUF arrays cannot be)."""
    toks = byte_chars()
    merges = ["Ġ t", "h e", "i n", "e r", "Ġt he", "o n"]
    for i, m in enumerate(merges):
        toks[0xF5 + i] = m.replace(" ", "")
    assert len(set(toks)) == 256
    return toks, merges


def rope_divisors(spec: dict, n_rot: int, base: float, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Per-pair frequency divisors and the linear frequency scale."""
    kind = spec["kind"]
    if kind == "none":
        return np.ones(n_rot // 2), 1.0
    if kind == "linear":
        return np.ones(n_rot // 2), 1.0 / spec["factor"]
    if kind == "freqs_tensor":
        # Arbitrary divisors (a sorted random draw in 1..8, first pair 1): any value the file holds.
        d = np.sort(rng.uniform(1.0, 8.0, size=n_rot // 2)).astype(np.float32)
        d[0] = 1.0
        return d.astype(np.float64), 1.0
    if kind == "llama3":
        factor, low, high, old = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"], spec["original_context"]
        low_wavelen, high_wavelen = old / low, old / high
        freqs = 1.0 / (base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))
        out = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_wavelen:
                out.append(1.0)
            elif wavelen > low_wavelen:
                out.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append(1.0 / ((1.0 - smooth) / factor + smooth))
        return np.array(out), 1.0
    raise ValueError(kind)


@dataclass
class Mat:
    """A weight matrix of the reference: its dequantised values `[row][col]` (float64), its
    type, and for Q4_1 / Q5_1 the f16 block minimums `m` (`[row][block]`), which ggml
    multiplies by the activation block's separately rounded sum (see `Mat.apply`)."""
    w: np.ndarray
    ty: T
    mins: np.ndarray | None = None

    def apply(self, x: np.ndarray, rounded: bool) -> np.ndarray:
        """`x @ w.T`; `rounded`: with ggml's activation rounding for this weight type."""
        if not rounded:
            return x @ self.w.T
        xr, s_delta = round_acts(x, self.ty)
        y = xr @ self.w.T
        if self.mins is not None:
            # ggml: sum over blocks of d_w*d_x*sum(q_w*q_x) + m_w*s_x with s_x = f16(d_x*sum(q_x)),
            # where the dequantised product gives m_w*f16(d_x)*sum(q_x) for the second term.
            y += s_delta @ self.mins.T
        return y


def encode(w: np.ndarray, ty: T) -> tuple[np.ndarray, Mat]:
    """(array to write, the reference's matrix)."""
    w = w.astype(np.float32)
    if ty == T.F32:
        return w, Mat(w.astype(np.float64), ty)
    if ty == T.F16:
        h = w.astype(np.float16)
        return h, Mat(h.astype(np.float64), ty)
    q = gguf.quants.quantize(w, ty)
    deq = gguf.quants.dequantize(q, ty).astype(np.float64).reshape(w.shape)
    mins = None
    if ty in (T.Q4_1, T.Q5_1):  # block: f16 d, f16 m, ...
        block_bytes = gguf.constants.GGML_QUANT_SIZES[ty][1]
        mins = q.reshape(w.shape[0], -1, block_bytes)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    return q, Mat(deq, ty, mins)


def to_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float16).astype(np.float64)


def round_acts(x: np.ndarray, wtype: T) -> tuple[np.ndarray, np.ndarray | None]:
    """What ggml does to the activations `x[row][col]` of a product with weights of `wtype`
    (the weight type's vec-dot type): nothing for F32, f16 / bf16 rounding (to nearest even)
    for F16 / BF16, and for the 32-element quantised types Q8_0 / Q8_1 blocks of
    q = round-half-even(x * (127 / amax)) with d = amax / 127 stored as f16: the values
    f16(d) * q. For Q8_1 also the block sums' correction `[row][block]`
    f16(d * sum(q)) - f16(d) * sum(q) (ggml stores the sum separately, as f16)."""
    if wtype == T.F32:
        return x, None
    if wtype == T.F16:
        return to_f16(x), None
    x32 = x.astype(np.float32)
    if wtype == T.BF16:
        bits = x32.view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32).astype(np.float64), None
    assert wtype in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1), wtype
    b = x32.reshape(*x32.shape[:-1], -1, 32)
    amax = np.max(np.abs(b), axis=-1, keepdims=True)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    d16 = d.astype(np.float16).astype(np.float64)
    qsum = q.sum(axis=-1)
    s_delta = (d[..., 0] * qsum.astype(np.float32)).astype(np.float16).astype(np.float64) - d16[..., 0] * qsum
    return (d16 * q).reshape(x.shape), s_delta


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, div: np.ndarray, freq_scale: float, neox: bool = False) -> np.ndarray:
    """Normal RoPE on `x[token][head][head_dim]`: pairs (x[2i], x[2i+1]) of the first n_rot
    (`neox`: pairs (x[i], x[i + n_rot/2]) instead, only for the ablations)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot) / div[None, :] * freq_scale  # [token][pair]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if neox:
        lo, hi = slice(0, n_rot // 2), slice(n_rot // 2, n_rot)
    else:
        lo, hi = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x0, x1 = x[..., lo], x[..., hi]
    out[..., lo] = x0 * c - x1 * s
    out[..., hi] = x0 * s + x1 * c
    return out


def forward(m: dict, tokens: np.ndarray, neox: bool = False, kv_head_of=None, rounded: bool = False) -> np.ndarray:
    """Reference logits `[token][vocab]` of the whole sequence (causal), float64. `neox` and
    `kv_head_of` (query head -> KV head) exist only for the ablations. `rounded` applies ggml's
    activation rounding (`round_acts` before every product, Q / K / V / softmax weights to f16)
    and nothing else, for the second, tighter reference."""
    n = len(tokens)
    h16 = to_f16 if rounded else (lambda x: x)
    hd, H, KV = m["head_dim"], m["n_head"], m["n_kv_head"]
    group = H // KV
    kv_head_of = kv_head_of or (lambda h: h // group)
    pos = np.arange(n, dtype=np.float64)
    x = m["token_embd"].w[tokens]
    mask = np.triu(np.ones((n, n), dtype=bool), k=1)
    for L in m["layers"]:
        xn = rms_norm(x, L["attn_norm"], m["eps"])
        q = L["q"].apply(xn, rounded).reshape(n, H, hd)
        k = L["k"].apply(xn, rounded).reshape(n, KV, hd)
        v = h16(L["v"].apply(xn, rounded).reshape(n, KV, hd))
        q = h16(rope(q, pos, m["n_rot"], m["base"], m["div"], m["freq_scale"], neox))
        k = h16(rope(k, pos, m["n_rot"], m["base"], m["div"], m["freq_scale"], neox))
        att = np.zeros((n, H, hd))
        for h in range(H):
            kh, vh = k[:, kv_head_of(h)], v[:, kv_head_of(h)]
            s = q[:, h] @ kh.T / math.sqrt(hd)
            s[mask] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            att[:, h] = h16(p) @ vh
        x = x + L["o"].apply(att.reshape(n, H * hd), rounded)
        xn = rms_norm(x, L["ffn_norm"], m["eps"])
        g, u = L["gate"].apply(xn, rounded), L["up"].apply(xn, rounded)
        x = x + L["down"].apply(g / (1.0 + np.exp(-g)) * u, rounded)
    xn = rms_norm(x, m["output_norm"], m["eps"])
    return m["output"].apply(xn, rounded)


def ablate(m: dict, spec: dict) -> dict[str, dict]:
    """Plausible wrong implementations of what a variant exercises, as changed models: the
    test checks its tolerance is far below each one's max |change| / rms(logits)."""
    out: dict[str, dict] = {"no_rope": {**m, "base": 1.0, "div": np.ones_like(m["div"]), "freq_scale": 0.0}}
    out["neox_rope"] = m
    if spec["rope"]["kind"] != "none":
        out["no_rope_scaling"] = {**m, "div": np.ones_like(m["div"]), "freq_scale": 1.0}
    if spec["rope"]["kind"] in ("freqs_tensor", "llama3"):
        out["rope_divisors_multiplied"] = {**m, "div": 1.0 / m["div"]}
    if spec["rope"]["kind"] == "linear":
        out["linear_factor_multiplied"] = {**m, "freq_scale": 1.0 / m["freq_scale"]}
    if spec["types"]["output"] is not None:
        out["tied_output"] = {**m, "output": m["token_embd"]}
    if spec["eps"] > 1e-3:
        out["eps_1e-5"] = {**m, "eps": 1e-5}
    if 1 < m["n_kv_head"] < m["n_head"]:
        out["gqa_head_modulo"] = m
    return out


def build(spec: dict, rng: np.random.Generator, tokens: np.ndarray) -> dict:
    name, types = spec["name"], spec["types"]
    d, H, KV, n_ff = spec["n_embd"], spec["n_head"], spec["n_kv_head"], spec["n_ff"]
    hd = spec["key_length"] or d // H
    n_rot = hd
    q_dim, kv_dim = H * hd, KV * hd
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"duet-tiny-{name}")
    w.add_context_length(N_CTX)
    w.add_embedding_length(d)
    w.add_block_count(spec["n_layer"])
    w.add_feed_forward_length(n_ff)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    if spec["key_length"]:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(n_rot)
    w.add_rope_freq_base(spec["base"])
    w.add_layer_norm_rms_eps(spec["eps"])
    w.add_vocab_size(N_VOCAB)
    rs = spec["rope"]
    if rs["kind"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rs["factor"])
    elif rs["kind"] == "llama3":
        w.add_string("llama.rope.scaling.type", "llama3")
        w.add_float32("llama.rope.scaling.factor", rs["factor"])
        w.add_float32("llama.rope.scaling.low_freq_factor", rs["low_freq_factor"])
        w.add_float32("llama.rope.scaling.high_freq_factor", rs["high_freq_factor"])
        w.add_uint32("llama.rope.scaling.original_context_length", int(rs["original_context"]))
    toks, merges = vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(toks)
    w.add_token_types([1] * N_VOCAB)
    w.add_token_merges(merges)
    w.add_bos_token_id(ord("\n"))
    w.add_eos_token_id(ord("\n"))
    w.add_add_bos_token(False)

    def matrix(tname: str, kind: str, rows: int, cols: int, std: float | None = None) -> Mat:
        std = std if std is not None else GAIN[kind] / math.sqrt(cols)
        a = rng.standard_normal((rows, cols)) * std
        stored, deq = encode(a, types[kind])
        if types[kind] in (T.F32, T.F16):
            w.add_tensor(tname, stored)
        else:
            w.add_tensor(tname, stored, raw_dtype=types[kind])
        return deq

    def norm(tname: str, n: int) -> np.ndarray:
        a = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        w.add_tensor(tname, a)
        return a.astype(np.float64)

    m = dict(head_dim=hd, n_head=H, n_kv_head=KV, n_rot=n_rot, eps=spec["eps"], base=spec["base"])
    m["token_embd"] = matrix("token_embd.weight", "embd", N_VOCAB, d, std=EMBD_STD)
    div, freq_scale = rope_divisors(rs, n_rot, spec["base"], rng)
    m["div"], m["freq_scale"] = div, freq_scale
    if rs["kind"] == "freqs_tensor":
        w.add_tensor("rope_freqs.weight", div.astype(np.float32))
    layers = []
    for l in range(spec["n_layer"]):
        p = f"blk.{l}."
        layers.append(dict(
            attn_norm=norm(p + "attn_norm.weight", d),
            q=matrix(p + "attn_q.weight", "q", q_dim, d),
            k=matrix(p + "attn_k.weight", "k", kv_dim, d),
            v=matrix(p + "attn_v.weight", "v", kv_dim, d),
            o=matrix(p + "attn_output.weight", "o", d, q_dim),
            ffn_norm=norm(p + "ffn_norm.weight", d),
            gate=matrix(p + "ffn_gate.weight", "gate", n_ff, d),
            up=matrix(p + "ffn_up.weight", "up", n_ff, d),
            down=matrix(p + "ffn_down.weight", "down", d, n_ff),
        ))
    m["layers"] = layers
    m["output_norm"] = norm("output_norm.weight", d)
    if types["output"] is None:
        m["output"] = m["token_embd"]
    else:
        m["output"] = matrix("output.weight", "output", N_VOCAB, d)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    logits = forward(m, tokens)
    logits.astype("<f4").tofile(OUT / f"{name}.logits.bin")
    rounded = forward(m, tokens, rounded=True)
    rounded.astype("<f4").tofile(OUT / f"{name}.rounded.bin")
    rms = float(np.sqrt(np.mean(logits ** 2)))
    dev = rounded - logits
    ablations = {}
    for what, changed in ablate(m, spec).items():
        other = forward(changed, tokens, neox=what == "neox_rope",
                        kv_head_of=(lambda h: h % KV) if what == "gqa_head_modulo" else None)
        ablations[what] = float(np.max(np.abs(other - logits)) / rms)
    top2 = np.sort(logits, axis=1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    meta = dict(
        name=name,
        gguf=f"{name}.gguf",
        tokens=[int(t) for t in tokens],
        n_positions=int(logits.shape[0]),
        n_vocab=int(logits.shape[1]),
        weight_types={k: (v.name if v is not None else "tied") for k, v in types.items()},
        n_layer=spec["n_layer"], n_embd=d, n_head=H, n_kv_head=KV, head_dim=hd, n_ff=n_ff,
        rms_eps=spec["eps"], rope_freq_base=spec["base"], rope=rs,
        rope_divisors=[float(x) for x in div], freq_scale=freq_scale,
        logits_rms=rms,
        rounding_dev_max=float(np.max(np.abs(dev)) / rms),
        rounding_dev_rms=float(np.sqrt(np.mean(dev ** 2)) / rms),
        ablations=ablations,
        logits_std=float(np.std(logits)),
        logits_max_abs=float(np.max(np.abs(logits))),
        top2_gap_min=float(gaps.min()),
        top2_gap_median=float(np.median(gaps)),
    )
    (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, N_VOCAB, size=N_TOKENS)
    for spec in VARIANTS:
        meta = build(spec, rng, tokens)
        size = (OUT / meta["gguf"]).stat().st_size
        print(f"{meta['name']}: {size / 1024:.0f} KiB, rounding max {meta['rounding_dev_max']:.2e} "
              f"rms {meta['rounding_dev_rms']:.2e}, logits std {meta['logits_std']:.3f}, "
              f"max |logit| {meta['logits_max_abs']:.3f}, top-2 gap min {meta['top2_gap_min']:.4f} "
              f"median {meta['top2_gap_median']:.4f}, divisors {np.round(meta['rope_divisors'], 3).tolist()}")
        print("    ablations (max |change| / rms):", {k: round(v, 3) for k, v in meta["ablations"].items()})


if __name__ == "__main__":
    main()
