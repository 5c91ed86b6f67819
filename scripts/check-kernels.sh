#!/usr/bin/env bash
# Compiles every kernel file for every supported GPU architecture (NVRTC, then ptxas, both from
# the pinned CUDA 13.0 PyPI wheels) and, for each card of ../shared/GPUS.md's table, computes
# every kernel's launch plans from that card's limits (crates/sala-cuda/src/plan.rs) and fails
# when shared memory (static + dynamic), threads or registers exceed them, or when a kernel
# spills more than crates/sala-cuda/kernels/spills.txt allows. No GPU needed: scripts/test.sh
# (CI) runs it. Prints one line per (card, kernel), then "N passed, N failed".
# Usage: scripts/check-kernels.sh [--write-baseline]   (the latter rewrites spills.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_VENV_PTXAS=1 source scripts/cuda-venv.sh
cargo run --release --quiet -p sala-cuda --bin check_kernels -- \
  --ptxas "$SALA_PTXAS" --baseline crates/sala-cuda/kernels/spills.txt "$@"
