#!/usr/bin/env bash
# Runs every test of the workspace (profile.test is opt-level 3: tests run the real model).
# Fetches the default model first if it is missing, and builds the binaries first: the
# multi-process tests in tests/ start the real duet-gateway / duet-gpu-worker / duet-cpu-worker,
# which `cargo test` alone does not build for another package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
cargo build --workspace --locked --bins
cargo test --workspace --locked "$@"
