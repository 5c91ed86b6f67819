#!/usr/bin/env bash
# The test command (README): installs NVRTC from PyPI (pinned to CUDA 13.0, so the
# kernels are compiled in CI without a GPU), then runs the whole test suite in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$PWD/target/cuda-venv"
if [ ! -x "$venv/bin/pip" ]; then
  python3 -m venv "$venv"
fi
if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 > /dev/null 2>&1; then
  "$venv/bin/pip" install --quiet nvidia-cuda-nvrtc==13.0.88
fi
nvrtc_lib=$(dirname "$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 | head -1)")
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo test --release --workspace
