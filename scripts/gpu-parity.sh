#!/usr/bin/env bash
# On the GPU machine: the parity suite of the build in $DIR (default .gpu) with the GPU's own
# plans, then under each device profile of $PROFILES (default rtx5090 rtx4090 a6000 a100);
# logs in $LOGS (default $OUT): parity.log, parity_<profile>.log; each run's summary on stdout.
# TESTS="name ..." runs only the tests whose names contain one of those strings. PARALLEL=1
# runs the plans at once, a process each, after the own plans' run has compiled its kernels
# (the suite's models are small: the runs share the GPU and take about the longest one's
# time instead of the sum; a machine short of memory should keep the default, one at a time).
# PARITY_TIMEOUT: seconds a run may take (default 300, as before; 0: no limit). Exits 1 when a
# run fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/sala-cache}
dir=${DIR:-.gpu}
logs=${LOGS:-${OUT:-/tmp/sala-out}}
mkdir -p "$logs"
# shellcheck disable=SC2206
profiles=("" ${PROFILES-rtx5090 rtx4090 a6000 a100})
log_of() { echo "$logs/parity${1:+_$1}.log"; }
run() {
  # shellcheck disable=SC2086
  SALA_DEVICE_PROFILE=$1 timeout "${PARITY_TIMEOUT:-300}" "$dir/gpu_parity" --include-ignored \
    --test-threads=1 ${TESTS:-} > "$(log_of "$1")" 2>&1
}
status=0
if [ "${PARALLEL:-0}" = 1 ]; then
  pids=()
  for p in "${profiles[@]}"; do
    run "$p" &
    pids+=($!)
    # The own plans' kernels compiled (and cached) before the others start theirs.
    [ -z "$p" ] && sleep "${PARALLEL_HEAD_START:-45}"
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
else
  for p in "${profiles[@]}"; do run "$p" || status=1; done
fi
for p in "${profiles[@]}"; do
  echo "== parity of $dir${p:+ under the $p profile}"
  grep -E 'test result|panicked|FAILED' "$(log_of "$p")" | head -12
done
exit $status
