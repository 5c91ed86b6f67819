#!/usr/bin/env bash
# The test command (README): installs NVRTC from PyPI (pinned to CUDA 13.0, so the
# kernels are compiled in CI without a GPU) and the `openai` Python client (for the server
# test), then runs the whole test suite in release mode.
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
# The official OpenAI client, for sala-server's test against the real server.
openai_version=3.57.0
if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$openai_version')" 2> /dev/null; then
  "$venv/bin/pip" install --quiet "openai==$openai_version"
fi
export SALA_TEST_PYTHON="$venv/bin/python"
cargo test --release --workspace
