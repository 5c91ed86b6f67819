#!/usr/bin/env bash
# Per-kernel device time of decode steps through Nsight Compute: `sala bench` opens the
# profiler range around its decode steps, so only they are recorded; prints
# scripts/ncu-table.py's table (per kernel and grid, a step). Runs on the GPU machine after
# scripts/gpu-build.sh; writes $OUT/TAG.csv.
# Usage: scripts/gpu-profile.sh TAG STEPS [sala bench args...]
#   e.g. scripts/gpu-profile.sh w4 2 --weights w4 --context 4K
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 TAG STEPS [bench args...]" >&2; exit 2; }
tag=$1 steps=$2
shift 2
export OUT=${OUT:-/tmp/sala-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
"$ncu" --profile-from-start off --clock-control none \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --csv \
  .gpu/sala bench --device cuda --no-cuda-graphs --decode-tokens "$steps" "$@" \
  > "$OUT/$tag.csv" 2> "$OUT/$tag.err" || { echo "ncu failed: $(tail -3 "$OUT/$tag.err")"; exit 1; }
python3 scripts/ncu-table.py "$OUT/$tag.csv" "$steps"
