#!/usr/bin/env bash
# The benchmark table of README "Benchmarks": kernels (read bandwidth, attention, matrix-vector),
# the whole system (prefill, decode at depth, aggregate decode of concurrent sessions) and, with
# llama-cpp-python installed, llama.cpp on the same model, threads and workloads side by side.
# Usage: scripts/bench.sh [--model M.gguf] [--threads N] [--quick] [--no-kernels] [--no-system] [--no-llama] [--repeat N]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
# gguf-py reads the model's tensor table: the bytes a token reads, the KV cache's size.
python3 -c 'import gguf' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore gguf
cargo build --release -q --workspace --bins
exec python3 scripts/bench.py "$@"
