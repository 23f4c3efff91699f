#!/usr/bin/env python3
"""The Duet benchmark table (see README "Benchmarks"): one table of

* the kernel rows of `cargo bench -p duet-cpu-worker --bench kernels` (read bandwidth measured
  in the same run, decode attention, matrix-vector per weight type);
* whole-system rows, measured on a `duet-gateway serve` started here with `duet bench`:
  prefill of a 512-token prompt, decode at depth 0 / 1K / 4K with one stream, aggregate decode
  of 8 / 16 / 32 concurrent sessions (each session's 16-token prompt prefilled untimed) and of
  16 sessions at depth 1024 (1024-token prompts), and decode at depth 0 and 16 sessions
  with every stream constrained to a JSON schema (structured output's cost, as a share of
  the unconstrained rows);
* the same system rows for llama.cpp (scripts/llama_cpp_bench.py) when llama-cpp-python is
  installed, and the ratio Duet / llama.cpp. Each system row is the median of `--repeat`
  passes (3), Duet's and llama.cpp's passes taking turns (llama.cpp kept loaded where both
  fit in memory, so that a pair of passes is seconds apart), each pass logged on stderr; the
  ratio cell adds the range and median of the passes' own ratios (each pair's), which show
  how far the machine's phases move the ratio.
  DUET_BENCH_LOG sets the Duet server's log filter (its log is kept in the temp dir).

`--model` runs the system rows on another GGUF (e.g. a random-weight model of a real shape
from `scripts/gen_random_model.py`); the batch-1 decode row then also says what share of the
read bandwidth measured in the same run (kernel rows; with `--no-kernels`, the read-bandwidth
row alone, before and after the system rows, the better kept) its weight reads are (for a
mixture of experts, the bytes a token reads: the shared weights and its share of the experts').
`--experts-on cpu-workers` serves a mixture's routed experts from the cpu-workers. A depth
row the model's context cannot hold is left out (for both). `--kv-type q8_0` runs both with a
Q8_0 KV cache (llama.cpp with the flash attention it needs for one). `--only ROW,...` runs
only those system rows, among them `aggregate-16-depth-4096` (16 sessions, each with a
4096-token prompt prefilled untimed: long contexts at batch; not in the default set, its
prefill takes minutes).

Run through scripts/bench.sh, which builds the binaries and fetches the model first.
"""

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# DUET_BENCH_BIN: another build's binaries (e.g. a copy of the last commit's, for before/after pairs).
BIN = os.environ.get("DUET_BENCH_BIN") or os.path.join(ROOT, "target", "release")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
DECODE_TOKENS = 64
EXPERTS_ON = "device"
KV_TYPE = "f16"

SYSTEM_ROWS = [
    # (row id, description, shape)
    ("prefill-512", "whole system: prefill", "512-token prompt, 1 stream"),
    ("decode-depth-0", "whole system: decode, batch 1", "depth 0"),
    ("decode-depth-1024", "whole system: decode, batch 1", "depth 1024"),
    ("decode-depth-4096", "whole system: decode, batch 1", "depth 4096"),
    ("aggregate-8", "whole system: aggregate decode", "8 concurrent sessions"),
    ("aggregate-16", "whole system: aggregate decode", "16 concurrent sessions"),
    ("aggregate-32", "whole system: aggregate decode", "32 concurrent sessions"),
    ("aggregate-16-depth-1024", "whole system: aggregate decode", "16 concurrent sessions at depth 1024"),
    ("aggregate-16-depth-4096", "whole system: aggregate decode", "16 concurrent sessions at depth 4096"),
    ("decode-depth-0-json", "whole system: decode, batch 1, JSON schema", "depth 0"),
    ("aggregate-16-json", "whole system: aggregate decode, JSON schema", "16 concurrent sessions"),
]
# Structured output's cost: every stream constrained to a schema it cannot finish within the
# tokens timed (an array of at least 1000 strings), against the same rows unconstrained.
JSON_SCHEMA = json.dumps({"type": "array", "items": {"type": "string"}, "minItems": 1000})
CONSTRAINED_OF = {"decode-depth-0-json": "decode-depth-0", "aggregate-16-json": "aggregate-16"}
# The rows run unless --only names others.
DEFAULT_ROWS = [r for r, _, _ in SYSTEM_ROWS if r != "aggregate-16-depth-4096"]
ROWS = DEFAULT_ROWS


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def kernel_rows(threads, quick, only=None):
    cmd = ["cargo", "bench", "-q", "-p", "duet-cpu-worker", "--bench", "kernels", "--", "--threads", str(threads)]
    if quick:
        cmd.append("--quick")
    if only:
        cmd += ["--only", only]
    log("kernels: " + " ".join(cmd))
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    header = next(l for l in out.splitlines() if l.startswith("Duet kernel benchmark"))
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("what", "---") and not cells[0].startswith("-"):
            rows.append(cells)
    return header, rows


class Server:
    """`duet-gateway serve` in local mode (it starts the gpu-worker and the cpu-workers)."""

    def __init__(self, threads):
        self.dir = tempfile.mkdtemp(prefix="duet-bench-")
        env = dict(os.environ, RUST_LOG=os.environ.get("DUET_BENCH_LOG", "warn"))
        self.out = open(os.path.join(self.dir, "gw.out"), "w+")
        self.err = open(os.path.join(self.dir, "gw.log"), "w")
        kv_bytes = kv_bytes_needed()
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "duet-gateway"), "serve", "--model", MODEL, "--listen", "127.0.0.1:0",
             "--http-listen", "127.0.0.1:0", "--gpu-threads", str(threads), "--kv-type", KV_TYPE,
             # The depth rows' sessions wait idle while the others are prefilled (16 × 4096
             # tokens of the 8B shape: over 40 minutes); the default 10 minutes closed them.
             "--session-idle-secs", str(24 * 3600)]
            # The default arena (1 GiB) or as much as the rows hold at once, if more.
            + (["--kv-bytes", str(kv_bytes)] if kv_bytes > 1 << 30 else [])
            + (["--experts-on", EXPERTS_ON] if EXPERTS_ON != "device" else []),
            stdout=self.out, stderr=self.err, env=env)
        deadline = time.time() + 120
        self.addr = None
        while time.time() < deadline and self.proc.poll() is None:
            self.out.seek(0)
            m = re.search(r"^duet-gateway listening on (\S+)$", self.out.read(), re.M)
            if m:
                self.addr = m.group(1)
                break
            time.sleep(0.2)
        if not self.addr:
            self.stop()
            sys.exit("the gateway did not come up; its log: " + open(os.path.join(self.dir, "gw.log")).read())

    def bench(self, *args):
        cmd = [os.path.join(BIN, "duet"), "bench", "--addr", self.addr, "--json", *args]
        # stderr passes through: a long prefill's progress, and an error's message.
        run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if run.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({run.returncode}); the server's log: {os.path.join(self.dir, 'gw.log')}")
        return json.loads(run.stdout.strip().splitlines()[-1])

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def median_rows(passes):
    """Per row, the median over the passes (dicts of row id -> tok/s)."""
    rows = set().union(*passes)
    return {r: statistics.median(p[r] for p in passes if r in p) for r in rows}


def system_rows(threads, repeat, with_llama):
    """The whole-system rows of Duet (on one server) and of llama.cpp (or None), each the
    median of `repeat` passes. Duet's and llama.cpp's passes take turns so that both see the
    same phases of this machine (its speed changes for minutes at a time, for every process at
    once): where the two fit in memory together, llama.cpp stays loaded
    (`llama_cpp_bench.py --serve`), so the two passes of a pair are seconds apart, and every
    other pair runs llama.cpp first (a drift within a pair then favours neither). Where they
    would not fit, the Duet server is stopped for llama.cpp's passes (each loading the model
    again) and each Duet pass starts a fresh one."""
    apart = with_llama and not both_fit()
    server, resident = None, None
    duet, llama = [], []
    try:
        if with_llama and not apart:
            resident = LlamaServer(threads)
        for i in range(repeat):
            if server is None:
                server = Server(threads)
                log(f"whole system: duet-gateway serve --gpu-threads {threads} on {server.addr}, {repeat} passes")
            log(f"pass {i + 1} of {repeat}")
            if resident is not None and i % 2 == 1:
                took(llama, "llama.cpp", resident.run())
            took(duet, "Duet", duet_pass(server))
            if resident is not None and i % 2 == 0:
                took(llama, "llama.cpp", resident.run())
            elif with_llama and resident is None:
                if apart:
                    server.stop()
                    server = None
                took(llama, "llama.cpp", llama_pass(threads))
    finally:
        if server is not None:
            server.stop()
        if resident is not None:
            resident.stop()
    return median_rows(duet), (median_rows(llama) if with_llama else None), pass_ratios(duet, llama)


def took(passes, who, result):
    """Keeps one pass's rows and logs them."""
    passes.append(result)
    log(f"  {who}: " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()))


def pass_ratios(duet, llama):
    """Per row, Duet / llama.cpp of each pair of passes (the two nearest in time, so nearest in
    this machine's phase), in pass order."""
    rows = set().union(*duet) if duet else set()
    return {r: [d[r] / l[r] for d, l in zip(duet, llama) if r in d and l.get(r)] for r in rows}


def both_fit():
    """Whether the Duet server and a llama.cpp pass fit in this machine's memory at once: each
    holds the model and a KV cache for the rows (Duet's arena locked in RAM). When not (the 8B
    shape's 16 sessions at depth 4096 hold a 9.6 GB arena), says what is done instead."""
    # Each process also holds about 2 GiB beside its weights and cache (llama.cpp's compute
    # buffers; Duet's repacked weights and rings): llama.cpp reached 11.8 GB on the 8B shape's
    # 16 x 4096 rows with a 4.4 GiB q8_0 cache.
    need = 2 * (os.path.getsize(MODEL) + kv_bytes_needed() + (2 << 30))
    with open("/proc/meminfo") as f:
        avail = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    if avail is None or need <= 0.9 * avail:
        return True
    log(f"Duet and llama.cpp would need about {need / 2**30:.1f} GiB together, {avail / 2**30:.1f} GiB are available: "
        "the Duet server is stopped during llama.cpp's passes, and each Duet pass starts a fresh one")
    return False


def duet_pass(server):
    """One pass over the whole-system rows of ROWS."""
    res = {}
    if "prefill-512" in ROWS:
        r = server.bench("--concurrency", "1", "--prompt-tokens", "512", "--max-tokens", "1")[0]
        res["prefill-512"] = 512 / (r["ttft_median_ms"] / 1e3)
    if "decode-depth-0" in ROWS:
        r = server.bench("--concurrency", "1", "--prompt-tokens", "1", "--max-tokens", str(DECODE_TOKENS))[0]
        res["decode-depth-0"] = r["decode_tokens_per_s_per_stream"]
    for depth in (1024, 4096):
        if f"decode-depth-{depth}" not in ROWS:
            continue
        if depth + DECODE_TOKENS >= model_context():
            log(f"  decode at depth {depth}: left out, the model's context is {model_context()}")
            continue
        r = server.bench("--concurrency", "1", "--context", str(depth), "--max-tokens", str(DECODE_TOKENS))[0]
        res[f"decode-depth-{depth}"] = r["decode_tokens_per_s_per_stream"]
    for row, n, depth in aggregate_rows():
        r = server.bench("--concurrency", str(n), "--context", str(depth), "--max-tokens", str(DECODE_TOKENS))[0]
        res[row] = r["aggregate_tokens_per_s"]
    if "decode-depth-0-json" in ROWS:
        r = server.bench("--concurrency", "1", "--prompt-tokens", "1", "--max-tokens", str(DECODE_TOKENS), "--json-schema", JSON_SCHEMA)[0]
        res["decode-depth-0-json"] = r["decode_tokens_per_s_per_stream"]
    if "aggregate-16-json" in ROWS:
        r = server.bench("--concurrency", "16", "--context", "16", "--max-tokens", str(DECODE_TOKENS), "--json-schema", JSON_SCHEMA)[0]
        res["aggregate-16-json"] = r["aggregate_tokens_per_s"]
    return res


def aggregate_rows():
    """The aggregate rows of ROWS: (row, sessions, prompt tokens of each)."""
    rows = []
    for row in ROWS:
        m = re.fullmatch(r"aggregate-(\d+)(?:-depth-(\d+))?", row)
        if m:
            rows.append((row, int(m.group(1)), int(m.group(2) or 16)))
    return rows


def llama_available():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        log("llama-cpp-python is not installed: no llama.cpp column (python3 -m pip install llama-cpp-python)")
        return False
    return True


def llama_command(threads):
    """scripts/llama_cpp_bench.py over the same rows (the JSON-schema rows are Duet's alone)."""
    rows = [r for r in ROWS if r not in CONSTRAINED_OF and not (r.startswith("decode-depth-") and int(r.split("-")[2]) + DECODE_TOKENS >= model_context())]
    return [sys.executable, os.path.join(ROOT, "scripts", "llama_cpp_bench.py"), "--model", MODEL, "--threads", str(threads),
            "--decode-tokens", str(DECODE_TOKENS), "--kv-type", KV_TYPE, "--rows", ",".join(rows)]


def llama_pass(threads):
    """One pass of scripts/llama_cpp_bench.py over the same rows, the model loaded for it."""
    cmd = llama_command(threads)
    log("llama.cpp: " + " ".join(cmd[1:]))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class LlamaServer:
    """scripts/llama_cpp_bench.py --serve: llama.cpp loaded once, a pass of the rows on request."""

    def __init__(self, threads):
        cmd = llama_command(threads) + ["--serve"]
        self.rows = cmd[cmd.index("--rows") + 1]
        log("llama.cpp, loaded once: " + " ".join(cmd[1:]))
        # llama.cpp logs plenty: kept in a file, shown if it ends early.
        self.log = tempfile.NamedTemporaryFile(mode="w+", prefix="llama-cpp-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        if json.loads(self.read()).get("ready") is not True:
            sys.exit("llama_cpp_bench.py --serve did not say it was ready")

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = "".join(self.log.readlines()[-20:])
            sys.exit(f"llama_cpp_bench.py --serve ended ({self.proc.wait()}); its log ({self.log.name}) ends:\n{tail}")
        return line

    def run(self):
        """One pass over the rows."""
        self.proc.stdin.write(self.rows + "\n")
        self.proc.stdin.flush()
        return json.loads(self.read())

    def stop(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        os.unlink(self.log.name)


def gguf_reader():
    """gguf-py's reader of the model (None without gguf-py: the defaults below apply)."""
    return _reader(MODEL)


@functools.lru_cache(maxsize=None)
def _reader(path):
    """Opened once per model (its tensor table is read on opening)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    return GGUFReader(path)


def metadata(reader, suffix):
    """The first scalar metadata value whose key ends in `suffix`, or None."""
    for key, field in reader.fields.items():
        if key.endswith(suffix) and len(field.data) == 1:
            return field.parts[field.data[0]][0].item()
    return None


def model_context():
    """The model's training context (unbounded without gguf-py or the key)."""
    reader = gguf_reader()
    n = metadata(reader, ".context_length") if reader else None
    return int(n) if n else 1 << 30


def bytes_per_token():
    """Weight bytes one batch-1 decode token reads: the file's tensors but an untied token
    embedding (one row is read), of a mixture's routed experts only the share one token uses;
    None without gguf-py (the file's size would overstate an untied or a mixture's bytes)."""
    reader = gguf_reader()
    if reader is None:
        log("gguf-py is not installed: no share of the read bandwidth (python3 -m pip install gguf)")
        return None
    used, count = metadata(reader, ".expert_used_count"), metadata(reader, ".expert_count")
    untied = any(t.name == "output.weight" for t in reader.tensors)
    total = 0.0
    for t in reader.tensors:
        if untied and t.name == "token_embd.weight":
            continue
        share = used / count if used and count and "_exps." in t.name else 1.0
        total += int(t.n_bytes) * share
    return total


def kv_bytes_needed():
    """KV arena bytes for the largest context the rows of ROWS hold at once (sessions ×
    (prompt + decoded tokens), in the KV type: 2 bytes a value in f16, 34 per 32 in q8_0),
    with a tenth to spare (the model's K/V shape from gguf-py; 8 GiB without it)."""
    tokens = max([n * (depth + DECODE_TOKENS + 16) for _, n, depth in aggregate_rows()] + [4096 + DECODE_TOKENS + 16])
    reader = gguf_reader()
    if reader is None:
        return 8 << 30
    n_layer, n_head = metadata(reader, ".block_count"), metadata(reader, ".attention.head_count")
    n_kv = metadata(reader, ".attention.head_count_kv") or n_head
    head_dim = metadata(reader, ".attention.key_length") or metadata(reader, ".embedding_length") // n_head
    value_bytes = 34 / 32 if KV_TYPE == "q8_0" else 2
    return int(tokens * n_layer * 2 * n_kv * head_dim * value_bytes * 1.1)


def set_model(path):
    global MODEL
    if not os.path.exists(path):
        sys.exit(f"{path}: no such model")
    MODEL = os.path.abspath(path)


def read_bandwidth(krows, which="better"):
    """The read bandwidth (GB/s) the kernel rows measured (`which`: "better", its best pass;
    "median pass", its median one), or None."""
    for what, _, gbs, _ in krows:
        if what.startswith("read bandwidth") and which in what:
            return float(gbs)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="shorter kernel runs (contexts 1K and 4K only)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-system", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="passes over the whole-system rows (each row: the median)")
    ap.add_argument("--model", default=MODEL, help="GGUF model of the whole-system rows (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--experts-on", default="device", choices=["device", "cpu-workers"], help="where a mixture's routed experts run")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"], help="the KV cache type of both systems")
    ap.add_argument("--only", help="comma-separated system rows to run (default: all but aggregate-16-depth-4096)")
    args = ap.parse_args()
    set_model(args.model)
    global EXPERTS_ON, KV_TYPE, ROWS
    EXPERTS_ON = args.experts_on
    KV_TYPE = args.kv_type
    known = [r for r, _, _ in SYSTEM_ROWS]
    ROWS = args.only.split(",") if args.only else DEFAULT_ROWS
    if unknown := [r for r in ROWS if r not in known]:
        sys.exit(f"unknown rows {unknown}; the rows are: {', '.join(known)}")
    # Without the kernel rows, the read bandwidth alone (a few seconds), for the batch-1 row's share.
    if args.no_kernels:
        header, krows = ("", []) if args.no_system else kernel_rows(args.threads, True, only="read bandwidth")
    else:
        header, krows = kernel_rows(args.threads, args.quick)
    repeat = max(1, args.repeat)
    duet, llama, ratios = {}, None, {}
    if not args.no_system:
        duet, llama, ratios = system_rows(args.threads, repeat, not args.no_llama and llama_available())
        if args.no_kernels:
            # The bandwidth drifts: measured again after the system rows, the better kept (and
            # the median passes of both averaged, for the batch-1 row's mean over its seconds).
            again = kernel_rows(args.threads, True, only="read bandwidth")
            medians = [m for m in (read_bandwidth(krows, "median pass"), read_bandwidth(again[1], "median pass")) if m]
            if (read_bandwidth(again[1]) or 0) > (read_bandwidth(krows) or 0):
                header, krows = again
            if medians:
                krows = [r for r in krows if "median pass" not in r[0]]
                median, best = sum(medians) / len(medians), read_bandwidth(krows)
                krows.append(("read bandwidth, the median pass before and after the system rows", "", f"{median:.1f}", f"{100 * median / best:.0f}%" if best else ""))
    passes = "" if args.no_system else f"whole-system rows: the median of {repeat} passes"
    model = os.path.basename(MODEL)
    experts = "" if args.experts_on == "device" else "experts on the cpu-workers"
    kv = f"{args.kv_type} KV cache"
    print("Duet benchmark: " + "; ".join(p for p in (model, experts, kv, f"{args.threads} threads", header, passes) if p))
    print()
    print("| what | shape | Duet | unit | llama.cpp | Duet / llama.cpp | of read bandwidth |")
    print("|---|---|---:|---|---:|---:|---:|")
    for what, shape, gbs, frac in krows:
        unit = "G mul-add/s" if "multiply-adds" in what else "GB/s"
        print(f"| {what} | {shape} | {gbs} | {unit} | | | {frac} |")
    bw, bw_median = read_bandwidth(krows), read_bandwidth(krows, "median pass")
    weights = bytes_per_token()
    for row, what, shape in SYSTEM_ROWS:
        if row not in duet:
            continue
        d = duet[row]
        l = llama.get(row) if llama else None
        ratio = f"{d / l:.2f}×" if l else ""
        if len(ratios.get(row, [])) > 1:
            # The spread of the passes' own ratios: how far this machine's phases move it.
            rs = ratios[row]
            ratio += f" (passes {min(rs):.2f}–{max(rs):.2f}, median {statistics.median(rs):.2f})"
        # Batch-1 decode reads every weight once per token: its share of the read bandwidth.
        frac = ""
        if row in CONSTRAINED_OF and CONSTRAINED_OF[row] in duet:
            frac = f"{100 * d / duet[CONSTRAINED_OF[row]]:.0f}% of unconstrained"
        if row == "decode-depth-0" and bw and weights:
            # Of the best pass, and of the median one: a mean over seconds meets both.
            share = lambda tok_s: f"{100 * tok_s * weights / 1e9 / bw:.0f}%" + (f" / {100 * tok_s * weights / 1e9 / bw_median:.0f}%" if bw_median else "")
            frac = share(d) + (f" (llama.cpp {share(l)})" if l else "")
        print(f"| {what} | {shape} | {d:.1f} | tok/s | {f'{l:.1f}' if l else ''} | {ratio} | {frac} |")
    if "decode-depth-0" in duet and bw and bw_median and weights:
        print()
        print("Batch-1 decode's share: its weight bytes × tok/s, of the read bandwidth's best pass / of its median pass.")


if __name__ == "__main__":
    main()
