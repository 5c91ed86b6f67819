#!/usr/bin/env bash
# The test command (README): installs NVRTC from PyPI (pinned to CUDA 13.0, so the kernels are
# compiled in CI without a GPU) and the `openai` Python client (for the server test), runs the
# whole test suite in release mode, then checks every kernel's plans against every card's
# limits (scripts/check-kernels.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/cuda-venv.sh
# The official OpenAI client, for sala-server's test against the real server.
openai_version=3.57.0
if ! "$venv/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$openai_version')" 2> /dev/null; then
  "$venv/bin/pip" install --quiet "openai==$openai_version"
fi
export SALA_TEST_PYTHON="$venv/bin/python"
cargo test --release --workspace
bash scripts/check-kernels.sh
