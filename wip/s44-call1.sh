#!/usr/bin/env bash
# The forty-third session's patches, first GPU call: parity. Builds (made here, git-ignored):
# .gpuz/b44.tgz = .gpu-p (wip/lightning-pending.patch) + .gpu-x (lightning-pending and
# span-walks-after-pending); .gpuz/b43.tgz = .gpu (main at f7101ac's crates, the same as
# 8886e2a's) + .gpu-c (chain-sums-in-product); carry both. Rebuild if main's crates moved:
# `bash scripts/gpu-build.sh`, `DEST=.gpu-p bash scripts/gpu-build-patch.sh
# wip/lightning-pending.patch`, `DEST=.gpu-x bash scripts/gpu-build-patch.sh
# wip/lightning-pending.patch wip/span-walks-after-pending.patch`, `DEST=.gpu-c bash
# scripts/gpu-build-patch.sh wip/chain-sums-in-product.patch`, then pack as above.
set -u
exec > >(tee -a "$OUT/log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
[ -d .gpu-x ] || tar xzf .gpuz/b44.tgz
[ -d .gpu-c ] || tar xzf .gpuz/b43.tgz
# X: the whole suite with the GPU's own plans, and the lightning and stepping tests under the
# rtx5090 (single-buffered ranges) and a6000 profiles at once.
DIR=.gpu-x PROFILES="" PARITY_TIMEOUT=330 LOGS=$OUT/x bash scripts/gpu-parity.sh
DIR=.gpu-x PROFILES="rtx5090 a6000" PARALLEL=1 PARALLEL_HEAD_START=0 PARITY_TIMEOUT=120 LOGS=$OUT/x \
  TESTS="lightning short_spans rewound batched mixed_step copied snapshot forks many_rows" bash scripts/gpu-parity.sh
# C: its products' tests on the GPU's plans.
DIR=.gpu-c PROFILES="" PARITY_TIMEOUT=100 LOGS=$OUT/c TESTS="many_rows batched_decode cuda_graph mixed_step" \
  bash scripts/gpu-parity.sh
