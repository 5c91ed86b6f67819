#!/usr/bin/env bash
# The next GPU call for wip/gemm-tma.patch (written in the forty-first session, whose device
# time ran out after the rebuild): parity of its GPU tests, 128K TTFT against main (A, G, A,
# G), then main's a6000 draft failure narrowed by the three draft tests. Build here first:
# `bash scripts/gpu-build.sh` (.gpu: main, with the draft tests), `DEST=.gpu-g bash
# scripts/gpu-build-patch.sh wip/gemm-tma.patch`, `tar czf .gpuz/b42.tgz .gpu .gpu-g`; carry
# .gpuz/b42.tgz. Progress also in $OUT/log (a call cut short still returns it).
set -u
exec > >(tee -a "$OUT/log") 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
L=$OUT/call; mkdir -p "$L"
[ -f .gpuz/b42.tgz ] && tar xzf .gpuz/b42.tgz
timeout 90 .gpu-g/gpu_parity --include-ignored --test-threads=1 prefill_products qk_made > "$L/parity.log" 2>&1
echo "== parity of G: $(grep -E 'test result|panicked|left|right' "$L/parity.log" | head -6 | tr '\n' ' ')"
for s in A G A G; do
  case $s in A) d=.gpu ;; G) d=.gpu-g ;; esac
  timeout 60 $d/sala bench --device cuda --context 128K --decode-tokens 4 > "$L/b_$s.txt" 2>&1
  echo "-- $s: $(grep -E '^ +131072 ' "$L/b_$s.txt" | head -1) $(grep -i error "$L/b_$s.txt" | head -2)"
done
# Main's a6000 draft failure: the target's kept rows, the draft reading them, the draft guessing.
for t in kept_for_a_draft eagle3_draft_reads eagle3_draft_drafts; do
  echo "== $t under a6000: $(SALA_DEVICE_PROFILE=a6000 timeout 60 .gpu/gpu_parity --include-ignored --test-threads=1 $t 2>&1 | grep -E 'test result|off by' | tr '\n' ' ')"
done
