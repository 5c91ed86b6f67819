#!/usr/bin/env bash
# The next GPU call for wip/chain-sums-in-product.patch (forty-second session, written with no
# device time left): parity of C's split products, 64 x 1K decode steps against main (A, C,
# A, C), and main's a6000 draft test with its near-tie allowance. Build here first:
# `bash scripts/gpu-build.sh` (.gpu), `DEST=.gpu-c bash scripts/gpu-build-patch.sh
# wip/chain-sums-in-product.patch`, `tar czf .gpuz/b43.tgz .gpu .gpu-c`; carry .gpuz/b43.tgz
# and this script. Progress also in $OUT/log.
set -u
exec > >(tee -a "$OUT/log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
L=$OUT/call; mkdir -p "$L"
[ -f .gpuz/b43.tgz ] && tar xzf .gpuz/b43.tgz
timeout 150 .gpu-c/gpu_parity --include-ignored --test-threads=1 many_rows batched_decode cuda_graph mixed_step > "$L/parity.log" 2>&1
echo "== parity of C: $(grep -E 'test result|panicked|differs' "$L/parity.log" | head -6 | tr '\n' ' ')"
for s in A C A C; do
  d=.gpu; [ $s = C ] && d=.gpu-c
  timeout 60 $d/sala bench --device cuda --concurrent 64 --context 1K --decode-tokens 256 --batched-only > "$L/c64_$s.txt" 2>&1
  echo "-- 64x1K $s: $(grep -E '^decode steps' "$L/c64_$s.txt" | tr '\n' ' ')"
done
echo "== eagle3_draft_drafts under a6000: $(SALA_DEVICE_PROFILE=a6000 timeout 90 .gpu/gpu_parity --include-ignored --test-threads=1 eagle3_draft_drafts 2>&1 | grep -E 'test result|off by|parted|rounds|vs' | head -8 | tr '\n' ' ')"
