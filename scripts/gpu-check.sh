#!/usr/bin/env bash
# Prepares the CUDA device's check on a GPU machine, which has CUDA 13 and Python with numpy
# but no Rust and no network, and receives at most 64 MiB: builds here (release profile) the
# duet-* binaries and the test binaries that exercise the CUDA device, strips them and packs
# them into gpu-check/kit.tar.xz (ignored by git), laid out as cargo's target directory is
# (binaries beside deps/), so the tests find the binaries as they do here. Then, on the GPU machine,
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
cp target/release/duet target/release/duet-gateway target/release/duet-gpu-worker target/release/duet-cpu-worker "$out/"
echo "== test binaries (release profile)"
# The gpu-worker's unit tests (the kernel twins) and the integration tests that use the GPU.
cargo test --release --locked -p duet-gpu-worker --no-run --message-format=json \
  | python3 -c '
import json, sys
want = {"duet_gpu_worker": "lib", "tiny_llama_reference": "test", "cuda_vs_cpu": "test", "cuda_mirror_pressure": "test", "cuda_kernels": "test"}
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and want.get(t.get("name")) in t.get("kind", []):
        print(t["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$out/deps/$name"; done
for t in duet_gpu_worker tiny_llama_reference cuda_vs_cpu cuda_mirror_pressure cuda_kernels; do
  [ -x "$out/deps/$t" ] || { echo "test binary $t was not built" >&2; exit 1; }
done
strip "$out"/duet "$out"/duet-* "$out"/deps/*
# Packed (xz makes the ~59 MB of binaries ~14 MB): what travels, the checkout's files and
# gpu-check/ together, must stay under 64 MiB. gpu-check-run.sh unpacks it there.
tar -C "$out" -cf - duet duet-gateway duet-gpu-worker duet-cpu-worker deps | xz -T0 -6 >"$out/kit.tar.xz"
rm -rf "$out"/duet "$out"/duet-* "$out"/deps
size=$(du -sb "$out" | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
[ $((size + tracked)) -lt $((60 << 20)) ] || { echo "gpu-check/ ($size bytes) and the checkout ($tracked) are over what may travel" >&2; exit 1; }
echo "gpu-check/kit.tar.xz: $size bytes"
echo "ready: on the GPU machine run  bash scripts/gpu-check-run.sh  (with gpu-check/ carried)"
