#!/usr/bin/env python3
"""Random-weight GGUF models in the shape of real ones, for benchmarks and device checks.

Timings on these files are real (same shapes, same tensor types, same bytes to read); the
text they generate is noise. Needs only numpy (the GGUF is written by hand, so the script
runs on the GPU machine too, which has no gguf-py and no network).

    python3 scripts/gen_random_model.py --shape llama-3.2-1b --type q4_k_m -o models/llama-1b-q4_k_m.gguf

Shapes: llama-3.2-1b (16 layers, width 2048, FFN 8192, 32/8 heads, vocabulary 128256, tied
embedding) and llama-3.1-8b (32 layers, 4096, 14336, 32/8 heads, 128256, untied), and tiny
(3 layers, 256, 256, 4/2 heads, 528; for tests: `testdata/tiny/random_q4_k_m.gguf`), all with
Llama 3's RoPE scaling (a `rope_freqs` tensor, as llama.cpp's converter writes it); and
olmoe-1b-7b (architecture `olmoe`: 16 layers, width 2048, 16/16 heads of 128, Q/K RMSNorm over
the whole row, 64 experts of FFN 1024 with 8 used (weights not renormalised), an F32 router
`ffn_gate_inp`, stacked `ffn_{gate,up,down}_exps`, vocabulary 50304, RoPE base 10000 (NeoX),
context 4096, untied; about 6.9B weights, 1.3B used per token). Types:

* q4_k_m: llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the LM head (the embedding when tied)
  and for attn_v / ffn_down in the layers llama.cpp gives more bits (the first and last
  eighth, and every third between);
* q4_0, q8_0: every matrix of that type, the LM head Q6_K for q4_0 as llama.cpp does;
* f16;
* q5_k_m (with `--llama-cpp` only): llama.cpp's Q5_K_M mix (Q5_K, Q6_K where Q4_K_M has it).

Quantised blocks are random bytes with their f16 scale fields set to values that give
weights of a typical spread (about 0.02), so activations stay finite through the layers.
With `--llama-cpp` the weights are instead drawn as F16 (normal, sd 0.02) and quantised by
llama.cpp's own quantiser through llama-cpp-python's binding (`llama_model_quantize`), so the
file is what users download from a hub, mixes and all (needs llama-cpp-python; the F16 file
is written next to the output first, then removed).
The tokenizer is a byte-level BPE vocabulary (the 256 byte characters, filler tokens and
Llama 3's special tokens, or for olmoe GPT-NeoX's `<|endoftext|>` at 50279 as BOS and EOS, not
added to prompts, and the converter's `[PAD{id}]` up to 50304; no merges).
Tensors are drawn and written one at a time, in chunks, so memory stays small whatever the
shape (the F16 olmoe-1b-7b file is about 14 GB, its Q4_K_M about 4 GB).
"""

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

SHAPES = {
    "llama-3.2-1b": dict(n_layer=16, d=2048, ff=8192, heads=32, kv_heads=8, vocab=128256, tied=True, rope_factor=32.0, ctx=131072),
    "llama-3.1-8b": dict(n_layer=32, d=4096, ff=14336, heads=32, kv_heads=8, vocab=128256, tied=False, rope_factor=8.0, ctx=131072),
    # For tests: every matrix whole groups of 16 rows and blocks of 256 (the CPU device's
    # interleaved kernels), and with q4_k_m a Q6_K layer (the third: llama.cpp's use_more_bits).
    "tiny": dict(n_layer=3, d=256, ff=256, heads=4, kv_heads=2, vocab=528, tied=False, rope_factor=8.0, ctx=4096),
    # OLMoE-1B-7B (0924) as llama.cpp's converter writes it: no RoPE scaling, `ff` per expert.
    "olmoe-1b-7b": dict(arch="olmoe", n_layer=16, d=2048, ff=1024, heads=16, kv_heads=16, vocab=50304, tied=False, ctx=4096,
                        rope_base=10000.0, experts=64, experts_used=8),
}

# ggml type id, bytes per block, elements per block, f16 scale fields (byte offset, value).
F32, F16, Q4_0, Q8_0, Q4_K, Q6_K = 0, 1, 2, 8, 12, 14
# Q4_K: every sub-block's 6-bit scale and min 32 (the 12 packed scale bytes 160 x 8, 0 x 4),
# so w = 32 d q - 32 dmin over random 4-bit q (mean 7.5, sd 4.6); dmin = 7.5 d makes the
# weights zero-mean. Random scale bytes would give each sub-block a mean of about twice its
# spread, and such a model's attention is so sharp (|q| ~ 100) that a rounding difference
# flips a near tie and a whole row (as the CUDA device's first run against the CPU showed).
Q4_K_D = 0.02 / (32 * 4.6)
Q4_K_SCALES = bytes([160] * 8 + [0] * 4)
BLOCKS = {
    Q4_0: (18, 32, [(0, 0.02 / 4.6)]),
    Q8_0: (34, 32, [(0, 0.02 / 74)]),
    Q4_K: (144, 256, [(0, Q4_K_D), (2, 7.5 * Q4_K_D)]),
    Q6_K: (210, 256, [(208, 0.02 / (74 * 18.5))]),
}


def quantised(rng: np.random.Generator, ty: int, rows: int, cols: int) -> bytes:
    size, elems, fields = BLOCKS[ty]
    n = rows * cols // elems
    blocks = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    jitter = rng.uniform(0.5, 1.5, n)  # one per block, shared by its scale fields
    for off, scale in fields:
        d = (scale * jitter).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(n, 2)
    if ty == Q4_K:
        blocks[:, 4:16] = np.frombuffer(Q4_K_SCALES, dtype=np.uint8)
    return blocks.tobytes()


def tensor_size(ty: int, n: int) -> int:
    """Bytes of `n` elements of type `ty`."""
    if ty in (F16, F32):
        return n * (2 if ty == F16 else 4)
    size, elems, _ = BLOCKS[ty]
    return n // elems * size


def tensor_bytes(rng: np.random.Generator, ty: int, rows: int, cols: int):
    """A matrix's bytes, in chunks (F16 / F32: whole rows, about 16M elements at a time), drawn
    when the writer gets to it (the draws are the same as one call for the whole matrix)."""
    if ty in (F16, F32):
        step = max(1, (1 << 24) // cols)
        for r in range(0, rows, step):
            yield rng.normal(0, 0.02, min(step, rows - r) * cols).astype(np.float16 if ty == F16 else np.float32).tobytes()
    else:
        yield quantised(rng, ty, rows, cols)


def norm_bytes(rng: np.random.Generator, n: int):
    """An RMSNorm weight (F32, about 1), drawn when the writer gets to it."""
    yield (1.0 + rng.normal(0, 0.05, n)).astype(np.float32).tobytes()


def llama3_rope_factors(dim: int, factor: float, base: float = 500000.0, low: float = 1.0, high: float = 4.0, old_ctx: int = 8192) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter writes it: a `rope_freqs` divisor per pair."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * base ** (i / dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(shape: dict, kind: str) -> dict:
    base = {"q4_k_m": Q4_K, "q4_0": Q4_0, "q8_0": Q8_0, "f16": F16}[kind]
    head = {"q4_k_m": Q6_K, "q4_0": Q6_K, "q8_0": Q8_0, "f16": F16}[kind]
    types = {"token_embd.weight": head if shape["tied"] else base}
    if not shape["tied"]:
        types["output.weight"] = head
    # Stacked experts get the mix of the dense matrices they replace (ffn_down_exps is "ffn_down" to llama.cpp).
    ffn = "_exps" if shape.get("experts") else ""
    for i in range(shape["n_layer"]):
        bump = kind == "q4_k_m" and more_bits(i, shape["n_layer"])
        for name in ["attn_q", "attn_k", "attn_output", f"ffn_gate{ffn}", f"ffn_up{ffn}"]:
            types[f"blk.{i}.{name}.weight"] = base
        for name in ["attn_v", f"ffn_down{ffn}"]:
            types[f"blk.{i}.{name}.weight"] = Q6_K if bump else base
    return types


def byte_chars() -> list:
    """GPT-2's printable stand-ins for the 256 bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


class Writer:
    """A GGUF v3 file: metadata, tensor infos, 32-byte aligned data. A tensor's data is bytes or
    an iterable of byte chunks (a generator, run when the file is written: one tensor's chunk in
    memory at a time)."""

    def __init__(self):
        self.kv = []
        self.tensors = []

    def add(self, key: str, kind: str, value):
        self.kv.append((key, kind, value))

    def tensor(self, name: str, dims: list, ty: int, data):
        self.tensors.append((name, dims, ty, tensor_size(ty, int(np.prod(dims))), data))

    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    def _value(self, kind: str, v) -> bytes:
        if kind == "u32":
            return struct.pack("<II", 4, v)
        if kind == "f32":
            return struct.pack("<If", 6, v)
        if kind == "bool":
            return struct.pack("<IB", 7, int(v))
        if kind == "str":
            return struct.pack("<I", 8) + self._str(v)
        if kind == "strs":
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(self._str(s) for s in v)
        if kind == "i32s":
            return struct.pack("<IIQ", 9, 5, len(v)) + np.asarray(v, dtype="<i4").tobytes()
        raise ValueError(kind)

    def write(self, path: Path):
        with open(path, "wb") as f:
            f.write(struct.pack("<4sIQQ", b"GGUF", 3, len(self.tensors), len(self.kv)))
            for key, kind, v in self.kv:
                f.write(self._str(key) + self._value(kind, v))
            offset = 0
            for name, dims, ty, size, _ in self.tensors:
                f.write(self._str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ty, offset))
                offset += (size + 31) // 32 * 32
            f.write(b"\0" * (-f.tell() % 32))
            for i, (name, _, _, size, data) in enumerate(self.tensors):
                written = 0
                for chunk in [data] if isinstance(data, bytes) else data:
                    f.write(chunk)
                    written += len(chunk)
                if written != size:
                    raise ValueError(f"{name}: {written} bytes written, {size} expected")
                f.write(b"\0" * (-size % 32))
                if (i + 1) % 20 == 0:
                    print(f"  {i + 1}/{len(self.tensors)} tensors written", file=sys.stderr)


def vocabulary(s: dict):
    """Tokens, token types, pre-tokenizer, BOS, EOS and whether prompts start with BOS."""
    if s.get("arch") == "olmoe":
        # GPT-NeoX's BPE as OLMoE's converter writes it: 50280 tokens, <|endoftext|> (50279) the
        # EOS (and BOS, not added), then [PAD{id}] (unused) up to the embedding's 50304 rows.
        eos, n_real = 50279, 50280
        tokens = byte_chars() + [f"tok{i}" for i in range(eos - 256)] + ["<|endoftext|>"]
        tokens += [f"[PAD{i}]" for i in range(n_real, s["vocab"])]
        types = [1] * eos + [3] + [5] * (s["vocab"] - n_real)
        return tokens, types, "olmo", eos, eos, False
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(256)]
    specials[9] = "<|eot_id|>"
    n_special = len(specials)
    filler = [f"tok{i}" for i in range(s["vocab"] - 256 - n_special)]
    tokens = byte_chars() + filler + specials
    types = [1] * (s["vocab"] - n_special) + [3] * n_special
    return tokens, types, "llama-bpe", s["vocab"] - n_special, s["vocab"] - n_special + 9, True


def build(shape_name: str, kind: str, seed: int) -> Writer:
    s = SHAPES[shape_name]
    rng = np.random.default_rng(seed)
    d, ff, hd = s["d"], s["ff"], s["d"] // s["heads"]
    arch, n_expert = s.get("arch", "llama"), s.get("experts", 0)
    w = Writer()
    w.add("general.architecture", "str", arch)
    w.add("general.name", "str", f"random {shape_name} {kind}")
    w.add(f"{arch}.context_length", "u32", s["ctx"])
    w.add(f"{arch}.embedding_length", "u32", d)
    w.add(f"{arch}.block_count", "u32", s["n_layer"])
    # OLMoE's is the experts' (llama.cpp reads feed_forward_length for olmoe's expert matrices).
    w.add(f"{arch}.feed_forward_length", "u32", ff)
    w.add(f"{arch}.attention.head_count", "u32", s["heads"])
    w.add(f"{arch}.attention.head_count_kv", "u32", s["kv_heads"])
    w.add(f"{arch}.rope.dimension_count", "u32", hd)
    w.add(f"{arch}.rope.freq_base", "f32", s.get("rope_base", 500000.0))
    w.add(f"{arch}.attention.layer_norm_rms_epsilon", "f32", 1e-5)
    if n_expert:
        w.add(f"{arch}.expert_count", "u32", n_expert)
        w.add(f"{arch}.expert_used_count", "u32", s["experts_used"])
    else:
        w.add(f"{arch}.vocab_size", "u32", s["vocab"])
    tokens, types, pre, bos, eos, add_bos = vocabulary(s)
    w.add("tokenizer.ggml.model", "str", "gpt2")
    w.add("tokenizer.ggml.pre", "str", pre)
    w.add("tokenizer.ggml.tokens", "strs", tokens)
    w.add("tokenizer.ggml.token_type", "i32s", types)
    w.add("tokenizer.ggml.merges", "strs", [])
    w.add("tokenizer.ggml.bos_token_id", "u32", bos)
    w.add("tokenizer.ggml.eos_token_id", "u32", eos)
    w.add("tokenizer.ggml.add_bos_token", "bool", add_bos)

    ttypes = tensor_types(s, kind)
    q_dim, kv_dim = s["heads"] * hd, s["kv_heads"] * hd
    dims = {"attn_q": (d, q_dim), "attn_k": (d, kv_dim), "attn_v": (d, kv_dim), "attn_output": (q_dim, d)}
    if n_expert:
        # [cols, rows, experts]: each expert's matrix in turn.
        experts = {"ffn_gate_exps": (d, ff), "ffn_up_exps": (d, ff), "ffn_down_exps": (ff, d)}
    else:
        dims.update({"ffn_gate": (d, ff), "ffn_up": (d, ff), "ffn_down": (ff, d)})
    w.tensor("token_embd.weight", [d, s["vocab"]], ttypes["token_embd.weight"], tensor_bytes(rng, ttypes["token_embd.weight"], s["vocab"], d))
    for i in range(s["n_layer"]):
        w.tensor(f"blk.{i}.attn_norm.weight", [d], F32, norm_bytes(rng, d))
        for name, (cols, rows) in dims.items():
            full = f"blk.{i}.{name}.weight"
            w.tensor(full, [cols, rows], ttypes[full], tensor_bytes(rng, ttypes[full], rows, cols))
            if name == "attn_v" and arch == "olmoe":
                # OLMoE normalises the whole Q and K rows (not each head).
                w.tensor(f"blk.{i}.attn_q_norm.weight", [q_dim], F32, norm_bytes(rng, q_dim))
                w.tensor(f"blk.{i}.attn_k_norm.weight", [kv_dim], F32, norm_bytes(rng, kv_dim))
            if name == "attn_output":
                w.tensor(f"blk.{i}.ffn_norm.weight", [d], F32, norm_bytes(rng, d))
        if n_expert:
            w.tensor(f"blk.{i}.ffn_gate_inp.weight", [d, n_expert], F32, tensor_bytes(rng, F32, n_expert, d))
            for name, (cols, rows) in experts.items():
                full = f"blk.{i}.{name}.weight"
                w.tensor(full, [cols, rows, n_expert], ttypes[full], tensor_bytes(rng, ttypes[full], n_expert * rows, cols))
    w.tensor("output_norm.weight", [d], F32, norm_bytes(rng, d))
    if "rope_factor" in s:
        w.tensor("rope_freqs.weight", [hd // 2], F32, llama3_rope_factors(hd, s["rope_factor"]).tobytes())
    if not s["tied"]:
        w.tensor("output.weight", [d, s["vocab"]], ttypes["output.weight"], tensor_bytes(rng, ttypes["output.weight"], s["vocab"], d))
    return w


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--type", choices=["q4_k_m", "q5_k_m", "q4_0", "q8_0", "f16"], default="q4_k_m")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--llama-cpp", action="store_true", help="quantise F16 weights with llama.cpp's quantiser")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    if a.type == "q5_k_m" and not a.llama_cpp:
        p.error("--type q5_k_m is made by llama.cpp's quantiser: add --llama-cpp")
    a.output.parent.mkdir(parents=True, exist_ok=True)
    if a.llama_cpp and a.type != "f16":
        f16 = a.output.with_suffix(".f16.tmp.gguf")
        print(f"generating a random {a.shape} model (f16), then llama.cpp's {a.type} ...", file=sys.stderr)
        build(a.shape, "f16", a.seed).write(f16)
        try:
            quantize_with_llama_cpp(f16, a.output, a.type)
        finally:
            f16.unlink()
    else:
        print(f"generating a random {a.shape} model ({a.type}) ...", file=sys.stderr)
        build(a.shape, a.type, a.seed).write(a.output)
    print(f"{a.output}: {a.output.stat().st_size / 2**20:.0f} MiB", file=sys.stderr)


def quantize_with_llama_cpp(src: Path, dst: Path, kind: str):
    import ctypes
    import os

    try:
        import llama_cpp as L
    except ImportError:
        sys.exit("--llama-cpp needs llama-cpp-python (python3 -m pip install llama-cpp-python)")
    params = L.llama_model_quantize_default_params()
    params.ftype = {
        "q4_k_m": L.LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "q5_k_m": L.LLAMA_FTYPE_MOSTLY_Q5_K_M,
        "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0,
        "q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
    }[kind]
    params.nthread = os.cpu_count() or 1
    if L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        sys.exit(f"llama.cpp could not quantise {src}")


if __name__ == "__main__":
    main()
