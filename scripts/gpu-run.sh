#!/usr/bin/env bash
# Runs on the GPU machine (see gpu-build.sh): parity tests (own plans, then under each device
# profile of $PROFILES), CPU-vs-GPU greedy tokens and perplexity through the CLI, and the
# benchmark. Logs go to $OUT. Usage: bash scripts/gpu-run.sh [bench contexts]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/sala-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
contexts=${1:-4K}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
status=0

# The parity suite with the GPU's own plans, then as each profiled card would run it.
PARITY_TIMEOUT=0 bash scripts/gpu-parity.sh || status=1

echo "== CLI: greedy tokens on the CPU and the GPU"
rm -rf /tmp/sala-tiny && .gpu/sala init --preset tiny /tmp/sala-tiny > /dev/null 2>&1
for d in cpu cuda; do
  .gpu/sala generate -m /tmp/sala-tiny --device "$d" --max-tokens 64 --ignore-eos \
    --trace-tokens "$OUT/trace_$d.jsonl" "The quick brown fox" \
    > "$OUT/gen_$d.txt" 2> "$OUT/gen_$d.log" || status=1
  tail -1 "$OUT/gen_$d.log"
done
# Same tokens, or the same up to the first step where the CPU's top two log-probabilities are
# within one bf16 step of each other (0.031 for logits below 8 in magnitude; logits are rounded
# to bf16, so such a near-tie may go either way on either device) and the GPU took the other.
python3 - "$OUT/trace_cpu.jsonl" "$OUT/trace_cuda.jsonl" <<'PY' || status=1
import json, sys
cpu, gpu = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
k = next((i for i, (a, b) in enumerate(zip(cpu, gpu)) if a["id"] != b["id"]), None)
if k is None and len(cpu) == len(gpu):
    print(f"same {len(cpu)} greedy tokens")
    sys.exit(0)
if k is None:
    print(f"TOKEN COUNTS DIFFER: {len(cpu)} vs {len(gpu)}")
    sys.exit(1)
top = cpu[k]["top"]
gap = top[0][1] - top[1][1]
runner_up = gpu[k]["id"] == top[1][0]
verdict = "a near-tie" if gap <= 0.035 and runner_up else "NOT a near-tie"
print(f"same greedy tokens for {k} steps; at step {k} the CPU's top two differ by {gap:.4f} "
      f"and the GPU took the runner-up: {runner_up}: {verdict}")
sys.exit(0 if verdict == "a near-tie" else 1)
PY

echo "== perplexity of a text on the CPU and the GPU (small preset, random weights)"
rm -rf /tmp/sala-small && .gpu/sala init --preset small /tmp/sala-small > /dev/null 2>&1
head -c 30000 README.md > "$OUT/ppl_text.txt"
for d in cpu cuda; do
  .gpu/sala perplexity -m /tmp/sala-small --device "$d" --context 1024 --json "$OUT/ppl_text.txt" \
    > "$OUT/ppl_$d.json" 2> "$OUT/ppl_$d.log" || status=1
done
# The same figure within bf16 rounding of the logits (the GPU's sums run in another order).
python3 - "$OUT/ppl_cpu.json" "$OUT/ppl_cuda.json" <<'PY' || status=1
import json, sys
cpu, gpu = (json.load(open(p)) for p in sys.argv[1:3])
rel = abs(cpu["perplexity"] - gpu["perplexity"]) / cpu["perplexity"]
print(f"perplexity cpu {cpu['perplexity']:.3f}, cuda {gpu['perplexity']:.3f} (relative {rel:.1e}); "
      f"cuda {gpu['tokens_per_sec']:.0f} tok/s")
sys.exit(0 if rel < 1e-3 and cpu["tokens_scored"] == gpu["tokens_scored"] else 1)
PY

echo "== bench ($contexts)"
.gpu/sala bench --device cuda --context "$contexts" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -12
exit $status
