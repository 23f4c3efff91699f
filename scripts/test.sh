#!/usr/bin/env bash
# Runs every test: the Rust workspace (profile.test is opt-level 3: tests run the real model),
# then the Python tests in tests/python that drive the real service with off-the-shelf clients
# (openai, grpcio, prometheus_client; `python3 -m pip install -r tests/python/requirements.txt`),
# then the deployment check (systemd units, install script; needs systemd-analyze).
# Does its own set-up on a fresh machine: installs the Python clients (pip; jinja2 renders the
# reference chat templates), llama.cpp's tokenizer suite and templates (from PyPI), NVRTC (PyPI's
# nvidia-cuda-nvrtc: the CUDA kernels are compiled by it in the tests, no GPU needed) and, as root on
# Debian, nginx-light (the reference multi-node deployment), systemd (for systemd-analyze) and g++ (the CUDA
# kernels' host checks); fetches the default model if it is missing; builds
# the binaries first: the multi-process tests start the real duet-gateway / duet-gpu-worker /
# duet-cpu-worker, which `cargo test` alone does not build for another package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== Python test clients (tests/python/requirements.txt)"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore -r tests/python/requirements.txt
echo "== NVRTC for the CUDA kernel compile checks (nvidia-cuda-nvrtc 13.0)"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore 'nvidia-cuda-nvrtc==13.0.*'
nvrtc_files=$(python3 -m pip show -f nvidia-cuda-nvrtc)
nvrtc_lib="$(awk '/^Location:/ {print $2}' <<<"$nvrtc_files")/$(grep -m1 -o '[^ ]*libnvrtc\.so\.13$' <<<"$nvrtc_files")"
[ -f "$nvrtc_lib" ] || { echo "libnvrtc.so.13 not found after installing nvidia-cuda-nvrtc" >&2; exit 1; }
export LD_LIBRARY_PATH="$(dirname "$nvrtc_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DUET_REQUIRE_NVRTC=1
# The CUDA kernels' host checks compile them as C++: a missing compiler fails them.
export DUET_REQUIRE_CXX=1
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing nginx-light (tests/python/test_nginx.py runs deploy/nginx/duet.conf)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
  else
    echo "nginx is missing: install it (tests/python/test_nginx.py runs the reference nginx deployment)" >&2
    exit 1
  fi
fi
if ! command -v systemd-analyze >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing systemd (systemd-analyze verifies the units in deploy/)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
  else
    echo "systemd-analyze is missing: install systemd (tests/deploy.sh verifies the units with it)" >&2
    exit 1
  fi
fi
if ! command -v c++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing g++ (the CUDA kernels' host checks compile them as C++)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
  else
    echo "c++ is missing: install g++ (the CUDA kernels' host checks compile them as C++)" >&2
    exit 1
  fi
fi
./scripts/fetch-model.sh >/dev/null
echo "== llama.cpp's tokenizer suite and chat templates (models/llama.cpp), rendered by jinja2 for the template test"
./scripts/fetch-llama-cpp-src.sh
python3 scripts/gen_template_golden.py models/llama.cpp/templates
export DUET_REQUIRE_LLAMA_CPP_SRC=1
echo "== module structure: no import cycles (scripts/check_module_cycles.py)"
python3 scripts/check_module_cycles.py
cargo build --workspace --locked --bins
cargo test --workspace --locked "$@"
echo "== the kernel twins again without VNNI (the maddubs + madd kernels of CPUs that lack it)"
DUET_NO_VNNI=1 cargo test --locked -p duet-kernels --test kernel_twins --test isa_kernel_twins "$@"
echo "== the kernel and attention twins again as a CPU without AVX-512 runs them (DUET_ISA=avx2: its dispatch, on any machine)"
DUET_ISA=avx2 cargo test --locked -p duet-kernels --test kernel_twins --test isa_kernel_twins --test attention_twins "$@"
echo "== Python tests (tests/python)"
python3 -m pytest -v tests/python
echo "== deployment (systemd units, install script): tests/deploy.sh"
./tests/deploy.sh
