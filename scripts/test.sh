#!/usr/bin/env bash
# Runs every test: the Rust workspace (profile.test is opt-level 3: tests run the real model),
# then the Python tests in tests/python that drive the real service with off-the-shelf clients
# (openai, grpcio, prometheus_client; `python3 -m pip install -r tests/python/requirements.txt`),
# then the deployment check (systemd units, install script; needs systemd-analyze).
# Fetches the default model first if it is missing, and builds the binaries first: the
# multi-process tests start the real duet-gateway / duet-gpu-worker / duet-cpu-worker, which
# `cargo test` alone does not build for another package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
cargo build --workspace --locked --bins
cargo test --workspace --locked "$@"
echo "== Python tests (tests/python)"
python3 -m pytest -v tests/python
echo "== deployment (systemd units, install script): tests/deploy.sh"
./tests/deploy.sh
