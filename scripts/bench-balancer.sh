#!/usr/bin/env bash
# The balancer benchmark (issue: LP planner). On a 2-core machine the gpu-worker is pinned to
# core 0 and one cpu-worker to core 1, so that they are two separate devices; the gateway
# connects to them as to systemd-managed workers. Opens SESSIONS sessions of CONTEXT tokens,
# then times decode of each policy side by side on the same sessions.
# Usage: scripts/bench-balancer.sh [SESSIONS=16] [CONTEXT=2048] [TOKENS=32] [POLICIES=cpu,gpu,ratio:0.5,lp]
set -euo pipefail
cd "$(dirname "$0")/.."
sessions=${1:-16} context=${2:-2048} tokens=${3:-32} policies=${4:-cpu,gpu,ratio:0.5,lp}
./scripts/fetch-model.sh >/dev/null
cargo build --release -q --workspace --bins
bin=target/release
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
dir=$(mktemp -d /tmp/duet-bench-XXXXXX)
instance=bench$$
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
RUST_LOG=warn $bin/duet-cpu-worker --instance "$instance" --worker 0 --cpus 1 --kv-bytes 2G --model "$model" \
  --listen "unix:$dir/cpu0.sock" 2>"$dir/cpu.log" & pids+=($!)
RUST_LOG=warn taskset -c 0 $bin/duet-gpu-worker --threads 1 serve --model "$model" --listen "unix:$dir/gpu.sock" 2>"$dir/gpu.log" & pids+=($!)
RUST_LOG=${GATEWAY_LOG:-warn} $bin/duet-gateway serve --model "$model" --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 \
  --gpu-worker "unix:$dir/gpu.sock" --cpu-worker "unix:$dir/cpu0.sock" >"$dir/gw.out" 2>"${BENCH_GATEWAY_LOG:-$dir/gw.log}" & pids+=($!)
for _ in $(seq 600); do grep -q "^duet-gateway listening on" "$dir/gw.out" 2>/dev/null && break; sleep 0.1; done
addr=$(sed -n 's/^duet-gateway listening on //p' "$dir/gw.out")
[ -n "$addr" ] || { echo "the gateway did not come up:"; cat "$dir/gw.log"; exit 1; }
echo "gpu-worker on core 0 (1 thread), cpu-worker on core 1; $sessions sessions x $context tokens, $tokens decode tokens per policy"
$bin/duet bench --addr "$addr" --concurrency "$sessions" --context "$context" --max-tokens "$tokens" --policies "$policies"
