#!/usr/bin/env bash
# Runs on a GPU machine what scripts/gpu-check.sh prepared (gpu-check/ beside this checkout):
#
#   tests  the CUDA tests with DUET_REQUIRE_CUDA=1 (a skip is a failure): kernel twins, NVRTC,
#          every tiny model on the CUDA device, the CUDA device against the CPU device on a
#          random-weight model of Llama-3.2-1B's shape (and the tiny models of other
#          architectures), the KV mirror under eviction pressure, the whole system serving a streamed completion with --device cuda,
#          and a tiny OLMoE served with its experts on the cpu-worker;
#   bench  prefill and decode speed of the 1B and 8B shapes on the CUDA device and the CPU
#          device (single process; the 8B also with half its layers on the CPU device,
#          --gpu-layers 16), and the served system at 1, 16 and 64 streams;
#   table  the served system's decode at depths 1K, 8K and 32K and 1, 16 and 64 streams, the
#          1B and 8B shapes under the 16 GB cap (the CUDA issue's table; the depths made up by
#          --synthetic-prefill, so that 64 x 32K opens in seconds): table-1b, table-8b and
#          table-8b-32k, one call each (a step stops at 540 s);
#   prefill  the table's prefill column: real prompts of 1K, 8K and 32K, 1, 16 and 64 sessions
#          (prefill-1b, prefill-1b-32k, prefill-8b, prefill-8b-32k; one call each);
#   session  what one session's 15 minutes of device time fit (tests, then the 1B and 8B
#          measurements that matter most): STEP_TIMEOUT=120 LONG_STEP_TIMEOUT=300.
#
# Steps named alone: ncu-attention (Nsight Compute on the decode attention kernel at depth 8K),
# speed-1b-host, serve-bench-1b-host, serve-1b-8k-host (no KV mirror, for
# comparison), speed-1b-pool-default (activations' memory handed back at every step),
# serve-bench-1b-no-mmq and serve-bench-8b-no-mmq (decode batches of 9-64 rows on cuBLAS, not
# mmq), serve-bench-1b-mv64 (decode batches of up to 64 rows through the
# matrix-vector kernels, in passes of 16, for comparison), serve-1b-8k-host-writes (the host, not the GPU, writing K/V into the arenas)
# and serve-1b-8k-f32-prefill (prefill attention without the tensor cores), each against
# serve-1b-8k, serve-8b-16x8k (over the mirror: GPU-only against hybrid), speed-moe and
# serve-moe-shape (the OLMoE shape, experts on the host), serve-moe-gpu-experts (its
# experts on the GPU, --device-experts 64), speed-moe-host-experts (a prompt's experts on
# the host, not streamed to the GPU), and each step of the groups.
#
#     bash scripts/gpu-check-run.sh [tests] [bench] [table] [STEP...]   (tests and bench when none is named)
#
# Logs go to $OUT (the device tool's folder) or ./gpu-check-out, packed in logs.tar.gz. Every step runs even when
# an earlier one failed; the exit status says whether any did.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kit=$root/gpu-check
out=${OUT:-$root/gpu-check-out}
logs=/tmp/duet-gpu-check-logs   # packed into $out/logs.tar.gz after each step
rm -rf "$logs"
mkdir -p "$out" "$logs"
steps=${*:-tests bench}
failed=()
[ -f "$kit/kit.tar.xz" ] && tar -C "$kit" -xJf "$kit/kit.tar.xz"
[ -x "$kit/duet-gpu-worker" ] || { echo "gpu-check/ is missing: run scripts/gpu-check.sh where Rust is, and carry gpu-check/" >&2; exit 2; }

# CUDA's libraries: NVRTC and cuBLAS (and cuBLASLt, which cuBLAS loads) wherever they are.
libdirs=$(find /usr/local /usr/lib /opt $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
  \( -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DUET_REQUIRE_CUDA=1 DUET_REQUIRE_NVRTC=1 DUET_WORKSPACE=$root DUET_CUDA_CACHE=/tmp/duet-ptx RUST_BACKTRACE=1
models=/tmp/duet-models
mkdir -p "$models"

{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  nproc
} | tee "$out/machine.txt"

# Whatever a step left running (a server of a step stopped at its time limit: on 2026-11-29 one
# still held its 66 GiB of arenas when the next step sized its own from what /dev/shm had
# free) is stopped, SIGKILL after 30 s, and the segments of its instance are removed.
reap() {
  local p i
  for p in duet-gateway duet-cpu-worker duet-gpu-worker; do pkill -TERM -x "$p" 2>/dev/null; done
  for i in $(seq 60); do
    pgrep -x 'duet-gateway|duet-cpu-worker|duet-gpu-worker' >/dev/null || break
    sleep 0.5
  done
  for p in duet-gateway duet-cpu-worker duet-gpu-worker; do pkill -KILL -x "$p" 2>/dev/null; done
  rm -f /dev/shm/duet-gpu*
}

# step NAME COMMAND...: runs and logs one step, remembering a failure.
step() {
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  # Each step has its own time limit (STEP_TIMEOUT seconds), so one that hangs leaves time for the rest.
  if STEP=$name timeout -k 5 "${STEP_TIMEOUT:-150}" bash -c '"$@"' "$name" "$@" >"$logs/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - start)) s)"
  else
    echo "   FAILED ($((SECONDS - start)) s); the log's end:"
    tail -30 "$logs/$name.log" | sed 's/^/   | /'
    failed+=("$name")
  fi
  reap
  # The device tool returns at most 8 files: every log goes back in one archive, made after
  # each step so that a run stopped at its time limit still returns what it did.
  tar -C "$logs" -czf "$out/logs.tar.gz" .
}

model() { # model SHAPE TYPE: makes the random-weight model once, prints its path
  local path=$models/$1-$2.gguf
  [ -f "$path" ] || python3 scripts/gen_random_model.py --shape "$1" --type "$2" -o "$path" >&2
  echo "$path"
}

# Waits (up to 2 minutes) until the gateway on 127.0.0.1:PORT answers /health.
wait_healthy() { # PORT PID: fails at once when the gateway (PID) exits, so as not to spend device time
  python3 - "$1" "$2" <<'PY'
import os, sys, time, urllib.request
for _ in range(240):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)
        break
    except Exception:
        try:
            os.kill(int(sys.argv[2]), 0)
        except ProcessLookupError:
            sys.exit("the gateway exited before it became healthy")
        time.sleep(0.5)
else:
    sys.exit("the gateway did not become healthy")
PY
}

# Streams a completion from a gateway serving with --device cuda; checks tokens arrived.
serve_and_stream() {
  local m=$1 port=18080 log=$logs/serve.log
  "$kit/duet-gateway" serve --device cuda --model "$m" --cpu-workers 1 --kv-bytes 2G \
    --listen 127.0.0.1:18081 --http-listen 127.0.0.1:$port --instance gpucheck >"$log" 2>&1 &
  local gw=$!
  wait_healthy $port $gw || { kill -TERM $gw; wait $gw; return 1; }
  python3 - "$port" <<'PY'
import json, sys, time, urllib.request
port = sys.argv[1]
base = f"http://127.0.0.1:{port}"
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "tok1 tok2 tok3", "max_tokens": 32, "stream": True, "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
t0, chunks, first = time.time(), 0, None
with urllib.request.urlopen(req, timeout=120) as r:
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks += 1
            first = first or time.time() - t0
print(f"streamed {chunks} chunks, first after {first:.3f} s, all in {time.time() - t0:.3f} s")
if chunks < 16:
    sys.exit("too few chunks")
# The prefix cache on the GPU: a prompt sent again starts from the KV of the first (the
# gpu-worker takes it up from the arenas) and generates the same greedy tokens up to a near tie.
prompt = [1000 + (i * 7919) % 20000 for i in range(300)]
def complete():
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 2}).encode()
    r = json.load(urllib.request.urlopen(urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"}), timeout=120))
    c = r["choices"][0]["logprobs"]
    return c["tokens"], c["top_logprobs"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
(a, top, cached_a), (b, _, cached_b) = complete(), complete()
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
margins = [sorted(t.values(), reverse=True) for t in top]
near_tie = same < len(a) and len(margins[same]) > 1 and margins[same][0] - margins[same][1] < 0.5
print(f"prefix cache: {cached_a} then {cached_b} of {len(prompt)} prompt tokens cached; {same} of {len(a)} tokens the same" + (" (then a near tie)" if near_tie else ""))
sys.exit(0 if cached_a == 0 and cached_b >= 256 and (same == len(a) or near_tie) else "the prefix cache's run differs")
PY
  local rc=$?
  grep -i "device" "$log" | head -5
  kill -TERM $gw
  wait $gw
  return $rc
}

# A tiny OLMoE served with --device cuda and its routed experts on the cpu-worker (the
# router on the GPU): the greedy completion must be the single-process CUDA runner's (local
# host experts, host attention), token for token.
serve_moe() {
  local m=$DUET_WORKSPACE/testdata/tiny/arch/olmoe_q8_0.gguf port=18070 log=$logs/serve-moe-server.log want
  want=$("$kit/duet-gpu-worker" --device cuda run --model "$m" --prompt "tok1 tok2 tok3" --max-tokens 16 --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["text"])') || return 1
  "$kit/duet-gateway" serve --device cuda --experts-on cpu-workers --policy cpu --model "$m" --cpu-workers 1 --kv-bytes 256M \
    --listen 127.0.0.1:18071 --http-listen 127.0.0.1:$port --instance gpumoe >"$log" 2>&1 &
  local gw=$!
  wait_healthy $port $gw || { kill -TERM $gw; wait $gw; return 1; }
  WANT="$want" python3 - "$port" <<'PY'
import json, os, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "tok1 tok2 tok3", "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
got = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
print(f"served: {got!r}\nrunner: {os.environ['WANT']!r}")
sys.exit(0 if got == os.environ["WANT"] else "the served completion differs from the runner's")
PY
  local rc=$?
  grep -E "device|experts" "$log" | head -8
  kill -TERM $gw
  wait $gw
  return $rc
}

# A model over the GPU memory budget: --device auto takes the CPU and says why.
over_budget() { # MODEL
  local log
  log=$("$kit/duet-gpu-worker" --device auto --gpu-mem-bytes 64M run --model "$1" --prompt-ids 1,2,3 --max-tokens 2 --json 2>&1 >/dev/null)
  echo "$log" | grep "device auto"
  echo "$log" | grep -q "gpu-mem-bytes" && echo "$log" | grep -q "the CPU device"
}

# Nsight Compute on the decode attention kernel (attn_partial) of the single-process runner at
# depth 8K: its achieved DRAM throughput and what limits it (the H200 measured the kernel at
# 12-16 % of its bandwidth, served).
ncu_attention() { # MODEL
  local ncu ids
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null) || { echo "no ncu on this machine"; return 1; }
  ids=$(python3 -c 'print(",".join(str(1000 + 7 * i) for i in range(8192)))')
  "$ncu" --kernel-name regex:attn_partial --launch-skip 32 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section LaunchStats --section Occupancy "$kit/duet-gpu-worker" --device cuda --gpu-mem-bytes 16G run --model "$1" --prompt-ids "$ids" --max-tokens 8 --json
}

# Single-process speed: a 512-token prompt, then 128 tokens, timed after one untimed run of the
# same (first-use costs left out), on one device (the GPU's memory
# capped at a T4's 16 GB, as the CUDA issue's table asks).
run_speed() { # DEVICE MODEL [GPU_LAYERS]
  local ids
  ids=$(python3 -c 'print(",".join(str(1000 + 7 * i) for i in range(512)))')
  "$kit/duet-gpu-worker" --device "$1" ${3:+--gpu-layers "$3"} --gpu-mem-bytes 16G run --model "$2" --prompt-ids "$ids" --max-tokens 128 --json --warmup \
    | python3 -c 'import json,sys; t=json.load(sys.stdin)["timings"]; print(json.dumps(t))'
}

# The served system: 1, 16 and 64 streams (or CONCURRENCY) at context 1K (or each of the
# comma-separated CONTEXTS, one server for all), policies cpu, gpu and lp (or POLICIES), 64
# tokens each (or BENCH_TOKENS).
serve_bench() { # MODEL KV_BYTES [CONTEXTS] [CONCURRENCY] [GATEWAY FLAGS]
  # The step log (linear layers, attention, waits per step), the device's phases every 64
  # steps and the KV mirror's uploads (each step that made some) show where a step's time goes.
  RUST_LOG=info,duet_gateway::scheduler::step=debug,duet_gpu_worker::worker=debug,duet_gpu_worker::device::cuda=debug DUET_GPU_MEM_BYTES=16G "$kit/duet-gateway" serve --device cuda --model "$1" --cpu-workers 1 --kv-bytes "$2" ${5:-} \
    --listen 127.0.0.1:18091 --http-listen 127.0.0.1:18090 --instance gpubench >"$logs/$STEP-server.log" 2>&1 &
  local gw=$!
  sleep 2
  wait_healthy 18090 $gw || { kill -TERM $gw; wait $gw; return 1; }
  # The most batch x context each side holds: kv_tokens (the arenas, hybrid), gpu_kv_tokens
  # (the mirror, GPU-only).
  # The serving line comes just after /health first says serving.
  local gpu_kv rc=0 ctx fit levels=${4:-1,16,64} i
  for i in $(seq 20); do
    gpu_kv=$(grep -o 'gpu_kv_tokens=[0-9]*' "$logs/$STEP-server.log" | head -1 | cut -d= -f2)
    [ -n "$gpu_kv" ] && break
    sleep 0.5
  done
  grep -o 'kv_tokens=[0-9]* gpu_kv_tokens=[0-9]*' "$logs/$STEP-server.log" | head -1
  [ -n "$gpu_kv" ] || echo "no serving line with gpu_kv_tokens in the server's log: no GPU-only fit runs"
  for ctx in $(echo "${3:-1024}" | tr , ' '); do
    "$kit/duet" bench --addr 127.0.0.1:18091 --concurrency "$levels" --context "$ctx" --max-tokens "${BENCH_TOKENS:-64}" --policies "${POLICIES:-cpu,gpu,lp}" || rc=$?
    # With GPU_FIT=1: the most sessions of this depth the mirror holds (GPU-only), each
    # rounded up to blocks, under gpu and lp: GPU-only at its largest against the hybrid.
    fit=$(( ${gpu_kv:-0} / (ctx + ${BENCH_TOKENS:-64} + 32) ))
    if [ "${GPU_FIT:-0}" = 1 ] && [ "$fit" -ge "${levels##*,}" ]; then
      echo "GPU-only fit at depth $ctx: $fit sessions, every level above fits the mirror"
    elif [ "${GPU_FIT:-0}" = 1 ] && [ "$fit" -ge 1 ]; then
      echo "GPU-only fit at depth $ctx: $fit sessions"
      "$kit/duet" bench --addr 127.0.0.1:18091 --concurrency "$fit" --context "$ctx" --max-tokens "${BENCH_TOKENS:-64}" --policies gpu,lp || rc=$?
    fi
  done
  kill -TERM $gw
  wait $gw
  return $rc
}

# kv_fit GIB: the KV arena to ask for: GIB, or what /dev/shm has free less 2 GiB (it may be half
# the RAM), grown first where this user may remount it.
kv_fit() {
  local avail
  avail=$(( $(df --output=avail -B1G /dev/shm | tail -1) - 2 ))
  if [ "$avail" -lt "$1" ] && mount -o remount,size=$(( $1 + 8 ))G /dev/shm 2>/dev/null; then
    avail=$(( $(df --output=avail -B1G /dev/shm | tail -1) - 2 ))
  fi
  [ "$avail" -lt "$1" ] && echo "/dev/shm has ${avail}G free: the arena shrinks to it (the largest levels may not fit)" >&2
  echo "$(( avail < $1 ? avail : $1 ))G"
}

export kit out logs models
export -f wait_healthy serve_and_stream serve_moe over_budget ncu_attention run_speed serve_bench model kv_fit

# Groups of steps; a step's own name runs it alone.
expand() {
  case $1 in
    tests) echo twins nvrtc tiny-models cuda-vs-cpu mirror-pressure over-budget serve-stream serve-moe ;;
    bench) echo speed-1b speed-8b speed-8b-split serve-bench-1b serve-bench-8b ;;
    # The CUDA issue's table: decode at depth (made-up prompts' K/V); one call each.
    table) echo table-1b table-8b table-8b-32k ;;
    # The table's prefill column: real prompts at each depth, the time to open the sessions.
    prefill) echo prefill-1b prefill-1b-32k prefill-8b prefill-8b-32k ;;
    # What a session lent 15 minutes of device time runs in its first call (~6 minutes on an
    # H200): every test, the 1B shape's speed and serving, 16 x 8K of the 8B shape over the
    # mirror, and the 1B shape's prefill at 1K and 8K (the prefill attention kernel); then
    # `table-1b` or `prefill-1b-32k` in a call of its own.
    session) echo "$(expand tests)" speed-1b serve-bench-1b serve-8b-16x8k prefill-1b ;;
    *) echo "$1" ;;
  esac
}

for s in $(for g in $steps; do expand "$g"; done); do
  case $s in
    twins) step twins "$kit/deps/duet_gpu_worker" --test-threads 1 --nocapture cuda:: ;;
    nvrtc) step nvrtc "$kit/deps/cuda_kernels" --nocapture ;;
    tiny-models) step tiny-models "$kit/deps/tiny_llama_reference" --nocapture ;;
    cuda-vs-cpu) step cuda-vs-cpu env DUET_CUDA_TEST_MODEL="$(model llama-3.2-1b q4_k_m)" "$kit/deps/cuda_vs_cpu" --nocapture --test-threads 1 ;;
    mirror-pressure) step mirror-pressure env DUET_CUDA_TEST_MODEL="$(model llama-3.2-1b q4_k_m)" "$kit/deps/cuda_mirror_pressure" --nocapture ;;
    over-budget) step over-budget over_budget "$(model llama-3.2-1b q4_k_m)" ;;
    serve-stream) step serve-stream serve_and_stream "$(model llama-3.2-1b q4_k_m)" ;;
    serve-moe) step serve-moe serve_moe ;;
    speed-1b)
      step speed-1b-cuda run_speed cuda "$(model llama-3.2-1b q4_k_m)"
      step speed-1b-cpu run_speed cpu "$(model llama-3.2-1b q4_k_m)"
      ;;
    speed-8b) step speed-8b-cuda run_speed cuda "$(model llama-3.1-8b q4_k_m)" ;;
    ncu-attention) step ncu-attention ncu_attention "$(model llama-3.2-1b q4_k_m)" ;;
    # Half of the 8B shape's 32 layers on the GPU, the rest on the CPU device (--gpu-layers).
    speed-8b-split) step speed-8b-split run_speed cuda "$(model llama-3.1-8b q4_k_m)" 16 ;;
    serve-bench-1b) step serve-bench-1b serve_bench "$(model llama-3.2-1b q4_k_m)" 8G ;;
    serve-bench-8b) step serve-bench-8b serve_bench "$(model llama-3.1-8b q4_k_m)" 12G ;;
    serve-1b-8k) step serve-1b-8k serve_bench "$(model llama-3.2-1b q4_k_m)" 8G 8192 1,16 ;;
    serve-1b-32k) step serve-1b-32k serve_bench "$(model llama-3.2-1b q4_k_m)" 8G 32768 1 ;;
    serve-8b-1k) step serve-8b-1k serve_bench "$(model llama-3.1-8b q4_k_m)" 12G 1024 1,16 ;;
    serve-8b-8k) step serve-8b-8k serve_bench "$(model llama-3.1-8b q4_k_m)" 12G 8192 1 ;;
    # Decode at depth under the 16 GB cap with the depths' K/V made up (--synthetic-prefill:
    # only each prompt chunk's last token computed): 1B 64 x 32K is 64 GiB of arenas, 8B
    # 64 x 8K and 16 x 32K are too (8B 64 x 32K, 256 GiB, exceeds the machine). The serving
    # line's gpu_kv_tokens is what GPU-only holds, kv_tokens what the hybrid does; GPU_FIT
    # adds, per depth, the most sessions the mirror holds under gpu and lp.
    table-1b) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step table-1b env BENCH_TOKENS=16 GPU_FIT=1 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" "$(kv_fit 66)" 1024,8192,32768 1,16,64 --synthetic-prefill ;;
    table-8b) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step table-8b env BENCH_TOKENS=16 GPU_FIT=1 bash -c 'serve_bench "$@"' _ "$(model llama-3.1-8b q4_k_m)" "$(kv_fit 66)" 1024,8192 1,16,64 --synthetic-prefill ;;
    table-8b-32k) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step table-8b-32k env BENCH_TOKENS=16 GPU_FIT=1 bash -c 'serve_bench "$@"' _ "$(model llama-3.1-8b q4_k_m)" "$(kv_fit 66)" 32768 1,16 --synthetic-prefill ;;
    # Prefill tok/s at depth (the table's decode is timed over made-up K/V): every prompt
    # computed, 1, 16 and 64 sessions of 1K, 8K and 32K (the 8B shape's 32K: 1 and 16, its
    # 64 x 32K exceeding the arena), 4 tokens each under lp only; the bench's "opened N
    # sessions of C tokens in S s" lines are the prefill rates. One call each.
    prefill-1b) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step prefill-1b env BENCH_TOKENS=4 POLICIES=lp bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" "$(kv_fit 66)" 1024,8192 1,16,64 ;;
    # 64 x 32K is 2M prompt tokens: ~350 s at 2026-11-29's ~6 000 tok/s (prefill attention).
    prefill-1b-32k) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step prefill-1b-32k env BENCH_TOKENS=4 POLICIES=lp bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" "$(kv_fit 66)" 32768 1,16,64 ;;
    prefill-8b) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step prefill-8b env BENCH_TOKENS=4 POLICIES=lp bash -c 'serve_bench "$@"' _ "$(model llama-3.1-8b q4_k_m)" "$(kv_fit 66)" 1024,8192 1,16,64 ;;
    prefill-8b-32k) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-540} step prefill-8b-32k env BENCH_TOKENS=4 POLICIES=lp bash -c 'serve_bench "$@"' _ "$(model llama-3.1-8b q4_k_m)" "$(kv_fit 66)" 32768 1,16 ;;
    # Issue 26 on a GPU: the OLMoE shape under the 16 GB cap, its routed experts on the host
    # (in the runner's process; served, on the cpu-worker), the router and the rest on the GPU.
    speed-moe) step speed-moe run_speed cuda "$(model olmoe-1b-7b q4_k_m)" ;;
    # The same with a prompt's experts computed on the host, as before streamed experts
    # (DUET_CUDA_STREAMED_EXPERT_ROWS=0): against speed-moe's prefill.
    speed-moe-host-experts) step speed-moe-host-experts env DUET_CUDA_STREAMED_EXPERT_ROWS=0 bash -c 'run_speed "$@"' _ cuda "$(model olmoe-1b-7b q4_k_m)" ;;
    serve-moe-shape) step serve-moe-shape serve_bench "$(model olmoe-1b-7b q4_k_m)" 4G 1024 1,16 "--experts-on cpu-workers" ;;
    # The same with every expert a layer's router uses held on the GPU (hot experts, planned
    # every 64 steps from the router's counts): GPU-only experts against the cpu-worker's.
    serve-moe-gpu-experts) step serve-moe-gpu-experts serve_bench "$(model olmoe-1b-7b q4_k_m)" 4G 1024 1,16 "--experts-on cpu-workers --device-experts 64" ;;
    # Stage A for comparison: no KV mirror, the gpu-worker's attention on its host cores.
    serve-bench-1b-host) step serve-bench-1b-host env DUET_GPU_KV_BYTES=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G ;;
    serve-1b-8k-host) step serve-1b-8k-host env DUET_GPU_KV_BYTES=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G 8192 1,16 ;;
    speed-1b-host) step speed-1b-host env DUET_GPU_KV_BYTES=0 bash -c 'run_speed "$@"' _ cuda "$(model llama-3.2-1b q4_k_m)" ;;
    # The memory pool handing every step's activations back to the driver at each
    # synchronisation (CUDA's default release threshold, 0), as before keep_activation_memory:
    # against speed-1b's CUDA run.
    speed-1b-pool-default) step speed-1b-pool-default env DUET_CUDA_POOL_KEEP=0 bash -c 'run_speed "$@"' _ cuda "$(model llama-3.2-1b q4_k_m)" ;;
    # The K/V rows of steps wholly on the GPU written into the arenas by the host (downloaded
    # as f32), as before the GPU wrote them in place: against serve-1b-8k, whose prefill
    # stores 128K positions' rows.
    serve-1b-8k-host-writes) step serve-1b-8k-host-writes env DUET_CUDA_ARENA_WRITES=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G 8192 1,16 ;;
    # Prefill attention in f32 (attn_prefill), as before the tensor-core kernel took it
    # (attn_prefill_mma64/128): against serve-1b-8k, whose 16 x 8K prompts it dominates.
    serve-1b-8k-f32-prefill) step serve-1b-8k-f32-prefill env DUET_CUDA_PREFILL_MMA=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G 8192 1,16 ;;
    # Decode batches of 9-64 rows through cuBLAS on weights dequantised to f16 every step, as
    # before mmq took them (the integer tensor cores on the quantised weights): against
    # serve-bench-1b, and the same for the 8B shape against serve-bench-8b.
    serve-bench-1b-no-mmq) step serve-bench-1b-no-mmq env DUET_CUDA_MMQ=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G ;;
    serve-bench-8b-no-mmq) step serve-bench-8b-no-mmq env DUET_CUDA_MMQ=0 bash -c 'serve_bench "$@"' _ "$(model llama-3.1-8b q4_k_m)" 12G ;;
    # Decode batches of 9-64 rows through the matrix-vector kernels (passes of 16 rows), as
    # before MV_PASS_ROWS went back to 8 (2026-11-28: 2.6x slower at 64 rows on the H200).
    serve-bench-1b-mv64) step serve-bench-1b-mv64 env DUET_CUDA_MV_ROWS=64 bash -c 'serve_bench "$@"' _ "$(model llama-3.2-1b q4_k_m)" 8G ;;
    # 16 sessions of 8K on the 8B shape: 128K positions, over what the mirror holds under the
    # 16 GB cap (~80K): gpu alone against the cpu-workers' and lp's split.
    # ~200 s of prefill before its decode: its own longer limit.
    serve-8b-16x8k) STEP_TIMEOUT=${LONG_STEP_TIMEOUT:-420} step serve-8b-16x8k serve_bench "$(model llama-3.1-8b q4_k_m)" 24G 8192 16 ;;
    *) echo "unknown step $s (groups: tests, bench, table, prefill, session)" >&2; exit 2 ;;
  esac
done

echo "== logs in $out/logs.tar.gz"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all passed"
