#!/usr/bin/env bash
# The first GPU call for gemm-tma and gemm-tma-qk (written in the fortieth session, which had
# no device): our Hopper GEMM against cuBLASLt, standalone, then in the engine (C =
# wip/gemm-tma.patch, D = C + wip/gemm-tma-qk.patch, built by DEST=.gpu-c / .gpu-d
# scripts/gpu-build-patch.sh); then f8-codes-in-product's A/B (B) if time is left. Carry
# .gpuz/b40.tgz (tar czf .gpuz/b40.tgz .gpu .gpu-b .gpu-c .gpu-d: the four builds unpacked
# pass the 64 MiB a call carries).
set -u
G=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader)
echo "GPU: $G"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} XDG_CACHE_HOME=/tmp/sala-cache
L=$OUT/c1; mkdir -p $L
[ -f .gpuz/b40.tgz ] && tar xzf .gpuz/b40.tgz
echo "== hopper-gemm"
# The standalone is a new file of the patch (main does not have it): its added lines.
python3 - <<'PY'
import re
text = open("wip/gemm-tma.patch").read()
part = text.split("diff --git a/scripts/hopper-gemm.cu b/scripts/hopper-gemm.cu", 1)[1]
part = part.split("\ndiff --git ", 1)[0]
body = part.split("\n@@", 1)[1].split("\n", 1)[1]
lines = [l[1:] for l in body.split("\n") if l.startswith("+")]
open("/tmp/hopper-gemm.cu", "w").write("\n".join(lines) + "\n")
PY
nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I scripts -o /tmp/hopper-gemm /tmp/hopper-gemm.cu -lcublasLt 2>&1 | grep -v "^$" | tail -5
timeout 200 /tmp/hopper-gemm
echo "== parity of D (gemm-tma + gemm-tma-qk), own plans"
timeout 150 .gpu-d/gpu_parity --include-ignored --test-threads=1 prefill_products qk_made embed_matmul > $L/parity.log 2>&1
grep -E 'test result|panicked|FAILED|relative|part' $L/parity.log | head -12
echo "== 128K TTFT: A (main), C (gemm-tma), D (+ q/k in the epilogue), C with clusters of 1, then A, D again"
for s in A C D C1 A D; do
  case $s in A) d=.gpu; e= ;; C) d=.gpu-c; e= ;; D) d=.gpu-d; e= ;; C1) d=.gpu-c; e="SALA_GEMM_CLUSTER=1" ;; esac
  env $e timeout 100 $d/sala bench --device cuda --context 128K --decode-tokens 4 > $L/b_$s.txt 2>&1
  echo "-- $s:"; grep -E '^ +[0-9]+ |TTFT|peak|error' $L/b_$s.txt | head -4
done
echo "== f8-codes-in-product"
PARITY=0 timeout 200 bash scripts/gpu-ab.sh "--weights fp8 --context 4K --decode-tokens 256"
