#!/usr/bin/env python3
"""Perplexity of a text file under llama.cpp (llama-cpp-python's bundled build), computed as
llama-perplexity does and as `duet-gpu-worker perplexity` does: floor(n_tokens / ctx) chunks,
each from an empty cache (its first token the BOS where the model adds one), scoring the
second half of each chunk (the logits at ctx/2 .. ctx-2 predict the next token), NLL in f64.

--kv-type q8_0 sets llama.cpp's K and V cache types to Q8_0 (`-ctk q8_0 -ctv q8_0`), which it
supports only with flash attention; f16 runs without (the arithmetic Duet's f16 cache matches)
unless --flash-attn.

    python3 scripts/llama_cpp_perplexity.py --model M.gguf --file ../shared/golden/ppl.txt \
        [--ctx 512] [--kv-type f16|q8_0] [--flash-attn] [--threads 2]
"""

import argparse
import json
import math
import sys

import numpy as np

GGML_TYPE = {"f16": 1, "q8_0": 8}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-type", choices=sorted(GGML_TYPE), default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", action="store_true", help="flash attention also for f16")
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
        return 2
    kv = GGML_TYPE[a.kv_type]
    llm = llama_cpp.Llama(
        model_path=a.model,
        n_ctx=a.ctx,
        n_batch=a.ctx,
        n_ubatch=a.ctx,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        logits_all=True,
        flash_attn=a.kv_type != "f16" or a.flash_attn,
        type_k=kv,
        type_v=kv,
        verbose=False,
    )
    text = open(a.file, encoding="utf-8").read()
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    add_bos = llm._model.add_bos_token() if hasattr(llm._model, "add_bos_token") else False
    chunks = len(tokens) // a.ctx
    if chunks == 0:
        print(f"{len(tokens)} tokens are fewer than one chunk of {a.ctx}", file=sys.stderr)
        return 2
    first = a.ctx // 2
    nll, scored = 0.0, 0
    for c in range(chunks):
        chunk = tokens[c * a.ctx : (c + 1) * a.ctx]
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[: a.ctx], dtype=np.float64)
        for pos in range(first, a.ctx - 1):
            row = logits[pos]
            m = row.max()
            lse = m + math.log(np.exp(row - m).sum())
            nll -= row[chunk[pos + 1]] - lse
            scored += 1
        print(f"[{c + 1}/{chunks}] {math.exp(nll / scored):.4f}", file=sys.stderr)
    print(json.dumps({"ppl": math.exp(nll / scored), "tokens_scored": scored, "kv_type": a.kv_type, "flash_attn": a.kv_type != "f16" or a.flash_attn}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
