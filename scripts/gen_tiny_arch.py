#!/usr/bin/env python3
"""Tiny random models of the architectures beyond Llama, with llama.cpp's own logits as the
reference (testdata/tiny/arch/; checked by gpu-worker/tests/tiny_arch_llamacpp.rs).

For each variant the directory gets `<name>.gguf` (written with gguf-py the way llama.cpp's
converter writes that architecture: its metadata keys, tensor names and shapes) and
`<name>.llamacpp.bin`: the logits llama.cpp (the build llama-cpp-python 0.3.36 vendors, 2 threads,
batch = the whole sequence) gives at every position of the fixed 40-token sequence, float32
little-endian `[position][vocab]`, plus `<name>.json` (tokens, shapes, llama.cpp's version).

* `qwen2_q4_1` -- qwen2: Q/K/V biases (large enough to matter), NeoX RoPE (freq base 1e6), GQA
  4/2 heads of 16, tied Q8_0 output (no output.weight, as Qwen 2.5's small models), Q4_1 weights.
  (Not F16: F16 dot products sum in another lane order in llama.cpp, which flips an f16
  activation rounding now and then, as for Llama; the Llama F16 paths are checked against exact
  references in tiny_llama_reference.rs.)
* `qwen3_q8_0` -- qwen3: per-head Q/K RMSNorm weights, NeoX RoPE, GQA 4/2 heads of 32 (so the Q
  width 128 differs from n_embd 64), untied Q8_0 output, Q8_0 weights, no biases.
* `mistral3_q8_0` -- mistral3 (Mistral Small 3.x, Ministral as llama.cpp names them): llama's
  block and normal RoPE under another name, GQA 4/2, Q8_0.
* `phi3_q8_0`  -- phi3: one `attn_qkv` matrix (Q, K, V rows in that order) and one `ffn_up` of
  2 x n_ff rows (gate first, then up; no `ffn_gate`), NeoX RoPE, 4 heads of 16, Q8_0.
* `gemma3_q8_0` -- gemma3: embeddings scaled by sqrt(n_embd), per-head Q/K RMSNorm, NeoX RoPE,
  GeGLU, RMSNorms after attention and after the MLP, 6 layers of which 0-4 attend a sliding
  window of 8 positions (RoPE base 10000 there, 1e6 on layer 5), tied Q8_0 output.
* `gemma2_q8_0` -- gemma2: as gemma3 without Q/K norms, 4 layers of which 0 and 2 attend a
  window of 8 (same RoPE base), attention scores soft-capped at 3 and logits at 5 (Gemma 2's
  own caps are 50 and 30; small ones here so that the caps change the result), tied Q8_0.
* `phi3_longrope_q8_0` -- phi3 with LongRoPE (Phi-3.x 128k): `rope_factors_long`/`_short`
  divisors, original context 32 of 128 (so llama.cpp, like Duet, takes the long ones), and
  `rope.scaling.attn_factor` 1.19 on cos and sin.
* `mistral3_yarn_q8_0` -- mistral3 with YaRN (Ministral 3): factor 4 over an original
  context of 16, beta 32/1, RoPE base 100 and heads of 64 (so that the ramp spans pairs 0-7 of
  32), and Llama 4's attention temperature 0.1 (queries scaled from position 16 on).
* `mixtral_q8_0`, `qwen3moe_q8_0`, `olmoe_q8_0` -- mixture-of-experts MLPs as llama.cpp's
  converter writes them (an F32 router `ffn_gate_inp`, stacked `ffn_{gate,up,down}_exps`):
  Mixtral as `llama` (8 experts of 32, 2 used, weights renormalised), Qwen3-MoE (Qwen 3's
  Q/K norms, `expert_feed_forward_length`), OLMoE (Q/K norms over the whole row, weights not
  renormalised).

Needs numpy, gguf and llama-cpp-python 0.3.36 (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install
llama-cpp-python==0.3.36`).
"""

import json
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_tiny_llama import vocab  # noqa: E402  (the same 256-token byte-level vocabulary)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "testdata" / "tiny" / "arch"
SEED = 23
N_TOKENS = 40
N_CTX = 128
T = gguf.GGMLQuantizationType

VARIANTS = [
    dict(name="qwen2_q4_1", arch="qwen2", n_embd=64, n_head=4, n_kv_head=2, head_dim=16, n_ff=128, n_layer=2,
         eps=1e-6, base=1e6, wtype=T.Q4_1, tied=True, bias=True, qk_norm=False),
    dict(name="qwen3_q8_0", arch="qwen3", n_embd=64, n_head=4, n_kv_head=2, head_dim=32, n_ff=96, n_layer=2,
         eps=1e-6, base=1e6, wtype=T.Q8_0, tied=False, bias=False, qk_norm=True),
    dict(name="phi3_q8_0", arch="phi3", n_embd=64, n_head=4, n_kv_head=4, head_dim=16, n_ff=96, n_layer=2,
         eps=1e-5, base=10000.0, wtype=T.Q8_0, tied=False, bias=False, qk_norm=False, fused=True),
    dict(name="mistral3_q8_0", arch="mistral3", n_embd=64, n_head=4, n_kv_head=2, head_dim=16, n_ff=96, n_layer=2,
         eps=1e-5, base=1e6, wtype=T.Q8_0, tied=False, bias=False, qk_norm=False),
    # Appended last: the random draws of the variants above stay as they were.
    dict(name="gemma3_q8_0", arch="gemma3", n_embd=64, n_head=4, n_kv_head=2, head_dim=16, n_ff=96, n_layer=6,
         eps=1e-6, base=1e6, wtype=T.Q8_0, tied=True, bias=False, qk_norm=True, post_norms=True, window=8),
    dict(name="gemma2_q8_0", arch="gemma2", n_embd=64, n_head=4, n_kv_head=2, head_dim=16, n_ff=96, n_layer=4,
         eps=1e-6, base=10000.0, wtype=T.Q8_0, tied=True, bias=False, qk_norm=False, post_norms=True, window=8,
         attn_softcap=3.0, final_softcap=5.0),
    dict(name="phi3_longrope_q8_0", arch="phi3", n_embd=64, n_head=4, n_kv_head=4, head_dim=16, n_ff=96, n_layer=2,
         eps=1e-5, base=10000.0, wtype=T.Q8_0, tied=False, bias=False, qk_norm=False, fused=True,
         longrope=dict(original=32, attn_factor=1.19)),
    dict(name="mistral3_yarn_q8_0", arch="mistral3", n_embd=64, n_head=4, n_kv_head=2, head_dim=64, n_ff=96, n_layer=2,
         eps=1e-5, base=100.0, wtype=T.Q8_0, tied=False, bias=False, qk_norm=False,
         yarn=dict(factor=4.0, original=16, beta_fast=32.0, beta_slow=1.0), temperature=0.1),
    dict(name="mixtral_q8_0", arch="llama", n_embd=64, n_head=4, n_kv_head=2, head_dim=16, n_ff=32, n_layer=2,
         eps=1e-5, base=1e6, wtype=T.Q8_0, tied=False, bias=False, qk_norm=False, moe=dict(n_expert=8, n_used=2)),
    dict(name="qwen3moe_q8_0", arch="qwen3moe", n_embd=64, n_head=4, n_kv_head=2, head_dim=32, n_ff=32, n_layer=2,
         eps=1e-6, base=1e6, wtype=T.Q8_0, tied=False, bias=False, qk_norm=True, moe=dict(n_expert=8, n_used=3, ff_key=True)),
    dict(name="olmoe_q8_0", arch="olmoe", n_embd=64, n_head=4, n_kv_head=4, head_dim=16, n_ff=32, n_layer=2,
         eps=1e-5, base=10000.0, wtype=T.Q8_0, tied=False, bias=False, qk_norm="row", moe=dict(n_expert=8, n_used=2)),
]


def build(spec: dict, rng: np.random.Generator, tokens: list[int]) -> dict:
    name, arch = spec["name"], spec["arch"]
    d, H, KV, hd, n_ff = spec["n_embd"], spec["n_head"], spec["n_kv_head"], spec["head_dim"], spec["n_ff"]
    toks, merges = vocab()
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    # Not the variant's name: llama.cpp looks up Phi-3's special tokens in any model named "phi3".
    w.add_name("duet-tiny-random")
    w.add_context_length(N_CTX)
    w.add_embedding_length(d)
    w.add_block_count(spec["n_layer"])
    w.add_feed_forward_length(n_ff)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    if hd != d // H:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(spec["base"])
    w.add_layer_norm_rms_eps(spec["eps"])
    if spec.get("window"):
        w.add_uint32(f"{arch}.attention.sliding_window", spec["window"])
    if spec.get("moe"):
        w.add_expert_count(spec["moe"]["n_expert"])
        w.add_expert_used_count(spec["moe"]["n_used"])
        if spec["moe"].get("ff_key"):
            w.add_expert_feed_forward_length(n_ff)
    if spec.get("longrope"):
        w.add_string(f"{arch}.rope.scaling.type", "longrope")
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", spec["longrope"]["original"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", spec["longrope"]["attn_factor"])
    if spec.get("yarn"):
        y = spec["yarn"]
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", y["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", y["original"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", y["beta_fast"])
        w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", y["beta_slow"])
    if spec.get("temperature"):
        w.add_float32(f"{arch}.attention.temperature_scale", spec["temperature"])
    if spec.get("attn_softcap"):
        w.add_float32(f"{arch}.attn_logit_softcapping", spec["attn_softcap"])
    if spec.get("final_softcap"):
        w.add_float32(f"{arch}.final_logit_softcapping", spec["final_softcap"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(toks)
    w.add_token_types([1] * len(toks))
    w.add_token_merges(merges)
    w.add_bos_token_id(ord("\n"))
    w.add_eos_token_id(ord("\n"))
    w.add_add_bos_token(False)

    def matrix(tname: str, rows: int, cols: int, gain: float, ty=None):
        ty = spec["wtype"] if ty is None else ty
        a = (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)
        if ty == T.F32:
            w.add_tensor(tname, a)
        elif ty == T.F16:
            w.add_tensor(tname, a.astype(np.float16))
        else:
            w.add_tensor(tname, gguf.quants.quantize(a, ty), raw_dtype=ty)

    def vector(tname: str, n: int, mean: float, std: float):
        w.add_tensor(tname, (mean + std * rng.standard_normal(n)).astype(np.float32))

    w.add_tensor("token_embd.weight", gguf.quants.quantize((rng.standard_normal((len(toks), d)) * 0.5).astype(np.float32), T.Q8_0), raw_dtype=T.Q8_0)
    fused = spec.get("fused", False)
    for l in range(spec["n_layer"]):
        vector(f"blk.{l}.attn_norm.weight", d, 1.0, 0.1)
        if fused:
            matrix(f"blk.{l}.attn_qkv.weight", (H + 2 * KV) * hd, d, 1.4)
        else:
            matrix(f"blk.{l}.attn_q.weight", H * hd, d, 1.6)
            matrix(f"blk.{l}.attn_k.weight", KV * hd, d, 1.6)
            matrix(f"blk.{l}.attn_v.weight", KV * hd, d, 1.0)
        if spec["bias"]:
            vector(f"blk.{l}.attn_q.bias", H * hd, 0.0, 0.8)
            vector(f"blk.{l}.attn_k.bias", KV * hd, 0.0, 0.8)
            vector(f"blk.{l}.attn_v.bias", KV * hd, 0.0, 0.5)
        if spec["qk_norm"] == "row":
            vector(f"blk.{l}.attn_q_norm.weight", H * hd, 1.0, 0.3)
            vector(f"blk.{l}.attn_k_norm.weight", KV * hd, 1.0, 0.3)
        elif spec["qk_norm"]:
            vector(f"blk.{l}.attn_q_norm.weight", hd, 1.0, 0.3)
            vector(f"blk.{l}.attn_k_norm.weight", hd, 1.0, 0.3)
        matrix(f"blk.{l}.attn_output.weight", d, H * hd, 0.8)
        if spec.get("post_norms"):
            vector(f"blk.{l}.post_attention_norm.weight", d, 1.0, 0.1)
        vector(f"blk.{l}.ffn_norm.weight", d, 1.0, 0.1)
        if spec.get("moe"):
            E = spec["moe"]["n_expert"]
            w.add_tensor(f"blk.{l}.ffn_gate_inp.weight", (rng.standard_normal((E, d)) * 2.0 / np.sqrt(d)).astype(np.float32))
            for tname, rows, cols, gain in (("ffn_gate_exps", n_ff, d, 1.0), ("ffn_up_exps", n_ff, d, 1.0), ("ffn_down_exps", d, n_ff, 0.8)):
                a = (rng.standard_normal((E, rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)
                w.add_tensor(f"blk.{l}.{tname}.weight", gguf.quants.quantize(a, spec["wtype"]), raw_dtype=spec["wtype"])
        elif fused:
            matrix(f"blk.{l}.ffn_up.weight", 2 * n_ff, d, 1.0)
        else:
            matrix(f"blk.{l}.ffn_gate.weight", n_ff, d, 1.0)
            matrix(f"blk.{l}.ffn_up.weight", n_ff, d, 1.0)
        if not spec.get("moe"):
            matrix(f"blk.{l}.ffn_down.weight", d, n_ff, 0.8)
        if spec.get("post_norms"):
            vector(f"blk.{l}.post_ffw_norm.weight", d, 1.0, 0.1)
    if spec.get("longrope"):
        # Divisors of each pair's frequency (n_rot / 2 of them), as Phi-3.5's grow with the pair.
        half = hd // 2
        w.add_tensor("rope_factors_long.weight", (1.0 + 3.0 * np.arange(half) / half + 0.2 * rng.random(half)).astype(np.float32))
        w.add_tensor("rope_factors_short.weight", (1.0 + 0.5 * np.arange(half) / half).astype(np.float32))
    vector("output_norm.weight", d, 1.0, 0.1)
    if not spec["tied"]:
        matrix("output.weight", len(toks), d, 2.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_TOKENS, n_threads=2, logits_all=True, verbose=False)
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    (OUT / f"{name}.llamacpp.bin").write_bytes(logits.astype("<f4").tobytes())
    top2 = np.sort(logits, axis=1)[:, -2:]
    meta = dict(name=name, gguf=path.name, arch=arch, tokens=tokens, n_vocab=len(toks), llama_cpp_python=llama_cpp.__version__,
                logits_std=float(logits.std()), top2_gap_min=float((top2[:, 1] - top2[:, 0]).min()))
    (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    tokens = [int(t) for t in rng.integers(0, 256, size=N_TOKENS)]
    for spec in VARIANTS:
        meta = build(spec, rng, tokens)
        print(f"{meta['name']}: logits std {meta['logits_std']:.3f}, top-2 gap min {meta['top2_gap_min']:.4f}")


if __name__ == "__main__":
    main()
