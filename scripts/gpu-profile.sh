#!/usr/bin/env bash
# Per-kernel device time of one decode step of the released shape (random weights), through
# Nsight Compute. Runs on the GPU machine after scripts/gpu-build.sh; writes $OUT/profile.*.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/sala-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
ctx=${1:-4K}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
  .gpu/sala bench --device cuda --context "$ctx" --prefill-chunk 8192 --decode-tokens 1 \
  > "$OUT/profile.csv" 2> "$OUT/profile.err"
python3 - "$OUT/profile.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]; rows = rows[1:]
ki, vi = head.index("Kernel Name"), head.index("Metric Value")
names = [r[ki] for r in rows]
last = max(i for i, n in enumerate(names) if n.startswith("embed"))
step = rows[last:]
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in step:
    k = r[ki].split("(")[0]
    tot[k] += float(r[vi].replace(",", "")); cnt[k] += 1
all_ns = sum(tot.values())
print(f"decode step: {len(step)} kernels, {all_ns/1e3:.1f} us of kernel time")
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{v/1e3:9.1f} us  {cnt[k]:4d}x  {k[:90]}")
PY
