#!/usr/bin/env bash
# The waiting patches on the GPU: `bash wip/s44-call.sh parity`, then `bash wip/s44-call.sh
# speed` (two calls: each fits a call's 600 s), carrying .gpuz/b44.tgz and .gpuz/b43.tgz.
# Builds (made here, git-ignored): b44 = .gpu-p (wip/lightning-pending.patch) + .gpu-x
# (lightning-pending and span-walks-after-pending); b43 = .gpu (main at f7101ac's crates, the
# same as 8886e2a's) + .gpu-c (chain-sums-in-product). Rebuild if main's crates moved:
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
case ${1:-} in
  parity)
    # X: the whole suite with the GPU's own plans, then the lightning and stepping tests under
    # the rtx5090 (single-buffered ranges) and a6000 profiles at once; C: its products' tests.
    DIR=.gpu-x PROFILES="" PARITY_TIMEOUT=330 LOGS=$OUT/x bash scripts/gpu-parity.sh
    DIR=.gpu-x PROFILES="rtx5090 a6000" PARALLEL=1 PARALLEL_HEAD_START=0 PARITY_TIMEOUT=120 LOGS=$OUT/x \
      TESTS="lightning short_spans rewound batched mixed_step copied snapshot forks many_rows" \
      bash scripts/gpu-parity.sh
    DIR=.gpu-c PROFILES="" PARITY_TIMEOUT=100 LOGS=$OUT/c \
      TESTS="many_rows batched_decode cuda_graph mixed_step" bash scripts/gpu-parity.sh
    ;;
  speed)
    # A = main, P = lightning-pending, X = P + span-walks, C = chain-sums-in-product: 64 x 1K
    # decode steps, the whole 64 x 1K run, the prefill-heavy short run where span-walks shows,
    # batch-1 4K bf16 and 4-bit (P's shorter lightning calls: ~1% expected), a profile of X.
    L=$OUT/bench
    mkdir -p "$L"
    dir() { case $1 in A) echo .gpu ;; P) echo .gpu-p ;; X) echo .gpu-x ;; C) echo .gpu-c ;; esac; }
    b() { # build, tag, args...
      local s=$1 tag=$2
      shift 2
      timeout 120 "$(dir "$s")/sala" bench --device cuda "$@" > "$L/${tag}_$s.txt" 2>&1
      echo "-- $tag $s: $(grep -E '^decode steps|^ +batched|^ +[0-9]+ ' "$L/${tag}_$s.txt" | head -4 | tr '\n' ' ')"
    }
    for s in A P C X A P C X; do b $s steps --concurrent 64 --context 1K --decode-tokens 256 --batched-only; done
    for s in A X; do b $s run --concurrent 64 --context 1K --decode-tokens 1024 --batched-only; done
    for s in A X A X; do b $s short --concurrent 64 --context 1K --decode-tokens 8 --batched-only; done
    for s in A P; do b $s b1 --context 4K --decode-tokens 256; done
    for s in A P; do b $s w4 --weights w4 --context 4K --decode-tokens 256; done
    SALA_PROFILE=1 timeout 90 .gpu-x/sala bench --device cuda --concurrent 64 --context 1K \
      --decode-tokens 16 --batched-only > "$L/prof_X.txt" 2>&1
    ;;
  *) echo "usage: bash wip/s44-call.sh parity|speed" >&2; exit 2 ;;
esac
