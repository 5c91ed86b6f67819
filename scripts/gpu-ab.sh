#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu-build.sh (.gpu/: A) and scripts/gpu-build-patch.sh
# (.gpu-b/: B) here: B's parity suite with the GPU's own plans and under each profile of
# $PROFILES (default rtx5090), then each `sala bench` argument string given, run by A and B
# in turn, twice (A B A B: machines drift), their result lines together. Logs in $OUT/ab/.
# PARITY=0 skips the parity suite (~6 minutes with one profile: a device call lasts at most 10,
# so parity and a long A/B may need two calls; PARALLEL=1 runs the plans at once); TESTS="name
# ..." runs only the tests whose names contain one of those strings (scripts/gpu-parity.sh).
# SIDES="A B C" adds .gpu-c/ (built with DEST=.gpu-c) to the benches; PARITY_OF=C tests that
# build instead of B.
# Usage: bash scripts/gpu-ab.sh "--context 4K --decode-tokens 256" ...
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
L=${OUT:-/tmp/sala-out}/ab
mkdir -p "$L"
dir_of() { case $1 in A) echo .gpu ;; *) echo ".gpu-$(echo "$1" | tr 'A-Z' 'a-z')" ;; esac; }
P=${PARITY_OF:-B}
if [ "${PARITY:-1}" != 0 ]; then
  DIR=$(dir_of "$P") LOGS=$L PROFILES=${PROFILES-rtx5090} bash scripts/gpu-parity.sh
fi
i=0
for args in "$@"; do
  i=$((i + 1))
  echo "== bench $i: sala bench --device cuda $args"
  for round in 1 2; do
    for side in ${SIDES:-A B}; do
      dir=$(dir_of "$side")
      # shellcheck disable=SC2086
      timeout 280 $dir/sala bench --device cuda $args > "$L/bench${i}_${side}${round}.txt" 2>&1
      echo "-- $side (round $round):"
      grep -vE '^kernel |^note|^ *$' "$L/bench${i}_${side}${round}.txt" | tail -4
    done
  done
done
