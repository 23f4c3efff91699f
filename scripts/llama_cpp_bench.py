#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python's C API bindings) on the same model, threads and
workloads as Duet's system benchmark rows, for the side-by-side table of scripts/bench.sh.

Rows (names match scripts/bench.sh):
  prefill-512       tokens/s of one 512-token prompt, one llama_decode call
  decode-depth-D    batch 1: a D-token prompt prefilled untimed, then greedy decode timed
  aggregate-N       N sequences, each with its own 16-token prompt prefilled untimed, then N
                    tokens per llama_decode call (one per sequence), greedy; all tokens / time
  aggregate-N-depth-D  the same with a D-token prompt per sequence

The sequences differ, as `duet bench`'s sessions (distinct random prompts) do: a mixture of
experts routes each row by its own hidden state, and N identical rows would all use the same
experts, reading 8 of OLMoE's 64 per layer where N distinct ones read most of them. Prompts
of up to OWN_PROMPT_MAX tokens are prefilled per sequence. A longer one is prefilled once and
its KV copied into every other sequence (llama_memory_seq_cp: llama.cpp's default cache
keeps one stream per sequence, so the copies are distinct bytes in distinct buffers and the
timed decode reads what N prompts of their own would give it, while llama.cpp's CPU prefill
of 16 × 4096 tokens, over 37 minutes with a Q8_0 cache on the 1B shape, is paid once); each
sequence then starts from its own random token, so the rows differ from the first step.

Prompts are random ordinary token ids (1000..40000) and end-of-generation is ignored, as in
`duet bench`. llama.cpp's own defaults otherwise (flash attention "auto"); `--kv-type q8_0`
sets the K and V cache types to Q8_0 (`-ctk q8_0 -ctv q8_0`) with flash attention on, which
llama.cpp needs for a quantised V cache.
Prints one JSON object {row: tokens_per_s}. With `--serve` it loads the model once and runs
the rows each line of its standard input names, a JSON object a line, so that scripts/bench.py
can time it in turns with Duet seconds apart (this VM's speed changes for minutes at a time).
"""

import argparse
import json
import random
import sys
import time

import numpy as np

try:
    import llama_cpp as L
except ImportError:
    sys.exit("llama-cpp-python is not installed (python3 -m pip install llama-cpp-python)")


class Runner:
    def __init__(self, model_path, threads, n_ctx, n_seq, n_batch, kv_type="f16"):
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(model_path.encode(), mp)
        if not self.model:
            sys.exit(f"llama.cpp could not load {model_path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        # A KV stream per sequence (llama.cpp's default, said here because copy_sequence relies
        # on it: in a unified cache a copy would share the prompt's cells, not duplicate them).
        cp.kv_unified = False
        if kv_type == "q8_0":
            cp.type_k = cp.type_v = L.GGML_TYPE_Q8_0
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            sys.exit("llama.cpp could not create a context")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(max(n_batch, n_seq), 0, n_seq)

    def clear(self):
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def copy_sequence(self, src, dst):
        """Copies all of sequence src's KV into sequence dst (a buffer copy between streams)."""
        L.llama_memory_seq_cp(L.llama_get_memory(self.ctx), src, dst, -1, -1)

    def decode(self, items):
        """items: (token, pos, seq, wants_logits). Returns the argmax of each row asked for."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if out else 0
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            sys.exit(f"llama_decode returned {rc}")
        n_out = sum(1 for it in items if it[3])
        logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out * self.n_vocab,))
        return logits.reshape(n_out, self.n_vocab).argmax(axis=1).tolist()

    def prefill(self, seq, tokens, n_batch):
        last = None
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start : start + n_batch]
            items = [(t, start + i, seq, start + i == len(tokens) - 1) for i, t in enumerate(chunk)]
            out = self.decode(items)
            if out:
                last = out[-1]
        return last


# Aggregate rows' prompts up to this length are each prefilled (longer ones copied).
OWN_PROMPT_MAX = 256


def aggregate_rows(rows):
    """The aggregate rows of `rows` (aggregate-N, or aggregate-N-depth-D): (row, sessions,
    prompt tokens of each, 16 unless D is given)."""
    return [(r, int(r.split("-")[1]), int(r.split("-")[3]) if "-depth-" in r else 16) for r in rows if r.startswith("aggregate-")]


def prompt(rng, n):
    return [rng.randrange(1000, 40000) for _ in range(n)]


class Bench:
    """The rows on one model: a context for the single-sequence rows made at once, one for the
    aggregate rows made when first needed, sized for every aggregate row of `rows`."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(1)
        self.n_batch = 512
        self.all_rows = args.rows.split(",")
        # One context per shape of work, as a user would configure llama.cpp for it.
        self.single = Runner(args.model, args.threads, 4096 + 256, 1, self.n_batch, args.kv_type)
        self.multi = None

    def run(self, rows):
        """{row: tokens_per_s} for each of `rows`."""
        args, rng, n_batch, single = self.args, self.rng, self.n_batch, self.single
        results = {}
        for row in rows:
            if row == "prefill-512":
                best = 0.0
                for _ in range(3):
                    single.clear()
                    toks = prompt(rng, 512)
                    t = time.perf_counter()
                    single.prefill(0, toks, n_batch)
                    best = max(best, 512 / (time.perf_counter() - t))
                results[row] = best
            elif row.startswith("decode-depth-"):
                depth = int(row.split("-")[2])
                single.clear()
                toks = prompt(rng, max(depth, 1))
                nxt = single.prefill(0, toks, n_batch)
                pos = len(toks)
                t = time.perf_counter()
                for _ in range(args.decode_tokens):
                    nxt = single.decode([(nxt, pos, 0, True)])[0]
                    pos += 1
                results[row] = args.decode_tokens / (time.perf_counter() - t)
        agg = aggregate_rows(rows)
        if agg and self.multi is None:
            sized = aggregate_rows(self.all_rows)
            max_seq = max(n for _, n, _ in sized)
            per_seq = max(d for _, _, d in sized) + args.decode_tokens + 16
            self.multi = Runner(args.model, args.threads, max_seq * per_seq, max_seq, n_batch, args.kv_type)
        multi = self.multi
        for row, n, depth in agg:
            multi.clear()
            if depth <= OWN_PROMPT_MAX:
                nxt = [multi.prefill(s, prompt(rng, depth), n_batch) for s in range(n)]
            else:
                multi.prefill(0, prompt(rng, depth), n_batch)
                for s in range(1, n):
                    multi.copy_sequence(0, s)
                # Distinct first tokens, so that the rows differ from the first decode step.
                nxt = prompt(rng, n)
            pos = depth
            t = time.perf_counter()
            for _ in range(args.decode_tokens):
                nxt = multi.decode([(nxt[s], pos, s, True) for s in range(n)])
                pos += 1
            results[row] = n * args.decode_tokens / (time.perf_counter() - t)
        return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="prefill-512,decode-depth-0,decode-depth-1024,decode-depth-4096,aggregate-8,aggregate-16,aggregate-32")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--kv-type", choices=["f16", "q8_0"], default="f16")
    ap.add_argument("--serve", action="store_true",
                    help="load once, print {\"ready\": true}, then run the rows of each line read on stdin (a comma-separated list, "
                    "among --rows), printing a JSON object for each, until end of input")
    args = ap.parse_args()
    bench = Bench(args)
    if not args.serve:
        print(json.dumps(bench.run(bench.all_rows)))
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        rows = [r for r in line.strip().split(",") if r]
        # The aggregate context is sized for --rows: other rows could outgrow it.
        if unknown := [r for r in rows if r not in bench.all_rows]:
            sys.exit(f"rows {unknown} are not among --rows {args.rows}")
        print(json.dumps(bench.run(rows)), flush=True)


if __name__ == "__main__":
    main()
