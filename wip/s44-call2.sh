#!/usr/bin/env bash
# The waiting patches, second GPU call: speed (carry .gpuz/b44.tgz and .gpuz/b43.tgz). A =
# main, P = lightning-pending, X = P + span-walks, C = chain-sums-in-product. Decode steps of
# 64 x 1K, the whole 64 x 1K run, the prefill-heavy short run where span-walks shows, batch-1
# 4K bf16 and 4-bit (P's shorter lightning calls: ~1% expected), a profile of X's 64-row steps.
set -u
exec > >(tee -a "$OUT/log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
[ -d .gpu-x ] || tar xzf .gpuz/b44.tgz
[ -d .gpu-c ] || tar xzf .gpuz/b43.tgz
L=$OUT/bench; mkdir -p "$L"
dir() { case $1 in A) echo .gpu ;; P) echo .gpu-p ;; X) echo .gpu-x ;; C) echo .gpu-c ;; esac; }
b() { # build, tag, args...
  local s=$1 tag=$2; shift 2
  timeout 120 "$(dir "$s")/sala" bench --device cuda "$@" > "$L/${tag}_$s.txt" 2>&1
  echo "-- $tag $s: $(grep -E '^decode steps|^ +batched|^ +[0-9]+ ' "$L/${tag}_$s.txt" | head -4 | tr '\n' ' ')"
}
for s in A P C X A P C X; do b $s steps --concurrent 64 --context 1K --decode-tokens 256 --batched-only; done
for s in A X; do b $s run --concurrent 64 --context 1K --decode-tokens 1024 --batched-only; done
for s in A X A X; do b $s short --concurrent 64 --context 1K --decode-tokens 8 --batched-only; done
for s in A P; do b $s b1 --context 4K --decode-tokens 256; done
for s in A P; do b $s w4 --weights w4 --context 4K --decode-tokens 256; done
SALA_PROFILE=1 timeout 90 .gpu-x/sala bench --device cuda --concurrent 64 --context 1K --decode-tokens 16 --batched-only > "$L/prof_X.txt" 2>&1
