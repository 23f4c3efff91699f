#!/usr/bin/env bash
# Runs every test of the workspace (profile.test is opt-level 3: tests run the real model).
# Fetches the default model first if it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/fetch-model.sh >/dev/null
cargo test --workspace --locked "$@"
