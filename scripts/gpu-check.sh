#!/usr/bin/env bash
# Prepares the CUDA device's check on a GPU machine, which has CUDA 13 and Python with numpy
# but no Rust and no network, and receives at most 64 MiB: builds here (release profile) the
# duet-* binaries and the test binaries that exercise the CUDA device, strips them and puts
# them in gpu-check/ (ignored by git), laid out as cargo's target directory is (binaries
# beside deps/), so the tests find the binaries as they do here. Then, on the GPU machine,
# from the checkout's root with gpu-check/ carried along:
#
#     bash scripts/gpu-check-run.sh        # every CUDA test, the CPU comparison, serving, benchmarks
#
# With the device tool: run(command="bash scripts/gpu-check-run.sh", carry=["gpu-check"]).
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-check
rm -rf "$out"
mkdir -p "$out/deps"
echo "== release binaries"
cargo build --release --locked --bins
cp target/release/duet-gateway target/release/duet-gpu-worker target/release/duet-cpu-worker "$out/"
echo "== test binaries (release profile)"
# The gpu-worker's unit tests (the kernel twins) and the integration tests that use the GPU.
cargo test --release --locked -p duet-gpu-worker --no-run --message-format=json \
  | python3 -c '
import json, sys
want = {"duet_gpu_worker": "lib", "tiny_llama_reference": "test", "cuda_vs_cpu": "test", "cuda_kernels": "test"}
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and want.get(t.get("name")) in t.get("kind", []):
        print(t["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$out/deps/$name"; done
for t in duet_gpu_worker tiny_llama_reference cuda_vs_cpu cuda_kernels; do
  [ -x "$out/deps/$t" ] || { echo "test binary $t was not built" >&2; exit 1; }
done
strip "$out"/duet-* "$out"/deps/*
du -sh "$out"
size=$(du -sb "$out" | cut -f1)
[ "$size" -lt $((56 << 20)) ] || { echo "gpu-check/ is $size bytes: over what may travel beside the checkout" >&2; exit 1; }
echo "ready: on the GPU machine run  bash scripts/gpu-check-run.sh  (with gpu-check/ carried)"
