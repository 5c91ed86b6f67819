#!/usr/bin/env bash
# Runs on the GPU machine (see gpu-build.sh): parity tests, CPU-vs-GPU greedy tokens through
# the CLI, and the benchmark. Logs go to $OUT. Usage: bash scripts/gpu-run.sh [bench contexts]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/sala-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
contexts=${1:-4K}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
status=0

echo "== parity tests"
if ! .gpu/gpu_parity --include-ignored --test-threads=1 > "$OUT/parity.log" 2>&1; then status=1; fi
grep -E '^test |test result|panicked|error' "$OUT/parity.log" | head -40

echo "== CLI: greedy tokens on the CPU and the GPU"
rm -rf /tmp/sala-tiny && .gpu/sala init --preset tiny /tmp/sala-tiny > /dev/null 2>&1
for d in cpu cuda; do
  .gpu/sala generate -m /tmp/sala-tiny --device "$d" --max-tokens 64 --ignore-eos "The quick brown fox" \
    > "$OUT/gen_$d.txt" 2> "$OUT/gen_$d.log" || status=1
  tail -1 "$OUT/gen_$d.log"
done
if cmp -s "$OUT/gen_cpu.txt" "$OUT/gen_cuda.txt"; then
  echo "same text"
else
  python3 -c "import sys,os; a,b=[open(os.environ['OUT']+'/gen_'+d+'.txt').read() for d in ('cpu','cuda')]; n=next((i for i,(x,y) in enumerate(zip(a,b)) if x!=y),min(len(a),len(b))); print(f'TEXT DIFFERS after {n} of {len(a)} characters')"
  status=1
fi

echo "== bench ($contexts)"
.gpu/sala bench --device cuda --context "$contexts" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -12
exit $status
