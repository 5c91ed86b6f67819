#!/usr/bin/env bash
# Session 41 (device time nearly spent): gemm-tma + TMA store + q/k epilogue (.gpu-g) against
# main (.gpu): parity, 128K TTFT A/G/A/G; then F (no q/k epilogue) and the kept hidden states
# under a6000 if time is left (main's build in .gpu must have those tests: scripts/gpu-build.sh). Carry .gpuz/b41h.tgz (tar czf of .gpu, .gpu-f, .gpu-g). Progress in $OUT/log.
set -u
exec > >(tee -a $OUT/log) 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
L=$OUT/c8; mkdir -p $L
[ -f .gpuz/b41h.tgz ] && tar xzf .gpuz/b41h.tgz
timeout 70 .gpu-g/gpu_parity --include-ignored --test-threads=1 prefill_products qk_made > $L/parity.log 2>&1
echo "== parity of G: $(grep -E 'test result|panicked|left|right' $L/parity.log | head -6 | tr '\n' ' ')"
for s in A G A G F; do
  case $s in A) d=.gpu ;; F) d=.gpu-f ;; G) d=.gpu-g ;; esac
  timeout 45 $d/sala bench --device cuda --context 128K --decode-tokens 4 > $L/b_$s.txt 2>&1
  echo "-- $s: $(grep -E '^ +131072 ' $L/b_$s.txt | head -1) $(grep -i error $L/b_$s.txt | head -2)"
done
# Main's a6000 draft failure: the target's kept rows, the draft reading them, the draft guessing.
for t in kept_for_a_draft eagle3_draft_reads eagle3_draft_drafts; do
  echo "== $t under a6000: $(SALA_DEVICE_PROFILE=a6000 timeout 60 .gpu/gpu_parity --include-ignored --test-threads=1 $t 2>&1 | grep -E 'test result|off by' | tr '\n' ' ')"
done
