#!/usr/bin/env bash
# On the GPU machine (copied into .gpuz/ with builds2.tgz holding .gpu, .gpu-d, .gpu-e): A against
# D (block-sum-two-barriers) and E (the other three wip patches) at 4K decode, bf16 and FP8, and
# the 128K TTFT, then the element-wise and model tests of D and E.
cd "$(dirname "$0")/.." || exit 1
tar xzf .gpuz/builds2.tgz
export LD_LIBRARY_PATH=/usr/local/cuda/lib64 XDG_CACHE_HOME=/tmp/sala-cache
L=${OUT:-/tmp/out}; mkdir -p "$L"
run() { n=$1; d=$2; shift 2; timeout 170 $d/sala bench --device cuda "$@" > "$L/$n.txt" 2>&1; echo "-- $n: $(grep -E '^ +[0-9]+ +[0-9.]+ ' "$L/$n.txt" | head -1)"; }
for r in 1 2; do for s in A D E; do d=.gpu; [ $s = D ] && d=.gpu-d; [ $s = E ] && d=.gpu-e; run d4k_$s$r $d --context 4K --decode-tokens 256; done; done
for s in A D E; do d=.gpu; [ $s = D ] && d=.gpu-d; [ $s = E ] && d=.gpu-e; run fp8_$s $d --weights fp8 --context 4K --decode-tokens 256; done
for s in A E A E; do d=.gpu; [ $s = E ] && d=.gpu-e; run t128_$s$RANDOM $d --context 128K --decode-tokens 4; done
echo "== parity of D and E (elementwise, model)"
for s in D E; do d=.gpu-$(echo $s | tr A-Z a-z); timeout 150 $d/gpu_parity --include-ignored --test-threads=1 elementwise_ops embed_matmul_head_norm small_model > "$L/par_$s.log" 2>&1; echo "$s rc=$?: $(grep 'test result' "$L/par_$s.log")"; done
