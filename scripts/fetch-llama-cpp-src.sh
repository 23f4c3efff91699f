#!/usr/bin/env bash
# Fetch llama.cpp's reference files for the tokenizer and chat-template tests into
# models/llama.cpp/: its vocabulary test suite (models/ggml-vocab-*.gguf, vocabulary-only GGUFs,
# with .inp/.out files of inputs and the ids llama.cpp gives) and its real chat templates
# (models/templates/*.jinja), from the PyPI source distribution of llama-cpp-python 0.3.36, which
# vendors llama.cpp. Downloads the sdist file itself (`pip download --no-binary` would build its
# build dependencies, CMake included, from source). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
dest=models/llama.cpp
if [ -f "$dest/.complete-$version" ]; then
  echo "llama.cpp reference files already present: $dest"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
index=${PIP_INDEX_URL:-https://pypi.org/simple}
url=$(curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" "${index%/}/llama-cpp-python/" \
  | python3 -c 'import json,sys; v=sys.argv[1]; print(next(f["url"] for f in json.load(sys.stdin)["files"] if f["filename"] == f"llama_cpp_python-{v}.tar.gz"))' "$version")
curl -fsSL -o "$tmp/src.tar.gz" "$url"
tar -xzf "$tmp/src.tar.gz" -C "$tmp" --wildcards "*/vendor/llama.cpp/models/templates/*" "*/vendor/llama.cpp/models/ggml-vocab-*"
rm -rf "$dest"
mkdir -p "$dest"
mv "$tmp"/llama_cpp_python-$version/vendor/llama.cpp/models/templates "$dest/templates"
mkdir -p "$dest/vocab"
mv "$tmp"/llama_cpp_python-$version/vendor/llama.cpp/models/ggml-vocab-* "$dest/vocab/"
touch "$dest/.complete-$version"
echo "fetched $dest: $(ls "$dest/templates" | wc -l) templates, $(ls "$dest/vocab"/*.gguf | wc -l) vocabularies"
