#!/usr/bin/env bash
# On the GPU machine (after scripts/gpu-build.sh here): the parity suite, then every benchmark
# the issues quote, logs in one archive ($OUT/logs.tgz, at most 8 files come back).
# Usage: bash scripts/gpu-bench-all.sh [steps...], steps from: figures (the open issues' ten
# figures, their commands as BENCHMARKS.md quotes them; ~6 minutes) parity (own plans, then each
# profile of $PROFILES: scripts/gpu-parity.sh, PARALLEL=1 for all at once) lightning 4k hopper rtx5090-1m profile sweep 1m
# dense concurrent concurrent55k concurrent-profile pool random random-profile profile1m ncu-select follow-up (default: parity lightning 4k
# profile 1m dense concurrent, in that order). A kernel whose parity test fails is replaced
# by its previous version (SALA_FALLBACK) for the benchmarks, and the log says so.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/sala-out}
L=/tmp/sala-logs
mkdir -p "$OUT" "$L"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
S=.gpu/sala
steps=${*:-parity lightning 4k profile 1m dense concurrent}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > "$L/gpu.txt" 2>&1
fallback=()
for step in $steps; do
  echo "== $step $(date +%T)"
  case $step in
    parity)
      LOGS=$L bash scripts/gpu-parity.sh
      grep -q "fast_block_selection_matches_oracle_scores ... ok" "$L/parity.log" || fallback+=(wgmma)
      grep -q 'lightning_matches_oracle ... ok' "$L/parity.log" || fallback+=(lightning-split)
      grep -q 'batched_sparse_layers_equal_decoding_alone_on_the_gpu ... ok' "$L/parity.log" || fallback+=(sparse-rows)
      if [ ${#fallback[@]} -gt 0 ]; then
        export SALA_FALLBACK=$(IFS=,; echo "${fallback[*]}")
        echo "parity failures: benchmarks run with SALA_FALLBACK=$SALA_FALLBACK"
      fi ;;
    figures)
      # Issues 15, 17 and 19: batch-1 decode (bf16, 4-bit, FP8), 1M decode, 64 x 1K, TTFTs (and
      # issue 17's under the RTX 5090's profile).
      i=0
      while IFS= read -r args; do
        i=$((i + 1))
        echo "-- sala bench --device cuda $args"
        # shellcheck disable=SC2086
        timeout 150 $S bench --device cuda $args < /dev/null > "$L/figure$i.txt" 2>&1
        grep -E '^ +[0-9]+ |^decode steps|batched|error' "$L/figure$i.txt" | head -4
      done <<'FIGURES'
--context 4K --decode-tokens 256
--weights w4 --context 4K --decode-tokens 256
--weights fp8 --context 4K --decode-tokens 256
--context 1M --random-context --decode-tokens 64 --max-memory 70G
--concurrent 64 --context 1K --decode-tokens 1024 --batched-only
--context 128K --decode-tokens 4
--context 1M --decode-tokens 4 --max-memory 30G
--weights fp8 --context 1M --decode-tokens 4 --max-memory 30G
--device-profile rtx5090 --context 128K --decode-tokens 4
--device-profile rtx5090 --context 1M --decode-tokens 4
FIGURES
      ;;
    lightning)
      $S bench --device cuda --kernel lightning --context 8K,64K --json "$L/lightning.json" 2>&1 | tee "$L/lightning.txt" | tail -3 ;;
    4k)
      $S bench --device cuda --context 4K --json "$L/bench4k.json" 2>&1 | tee "$L/bench4k.txt" | tail -6 ;;
    hopper)
      # Issue 14's no-regression figures: 4K and 128K, then 1M under 30 GiB.
      $S bench --device cuda --context 4K,128K --json "$L/hopper.json" 2>&1 | tee "$L/hopper.txt" | tail -5
      $S bench --device cuda --context 1M --decode-tokens 16 --max-memory 30G --json "$L/hopper1m.json" 2>&1 | tee "$L/hopper1m.txt" | tail -4 ;;
    rtx5090-1m)
      # A 1M-token context as an RTX 5090 would run it: its plans, its 32 GB.
      $S inspect --device-profile rtx5090 > "$L/inspect_rtx5090.txt" 2>&1; tail -22 "$L/inspect_rtx5090.txt"
      $S bench --device cuda --device-profile rtx5090 --context 1M --decode-tokens 16 --json "$L/rtx5090_1m.json" 2>&1 | tee "$L/rtx5090_1m.txt" | tail -4 ;;
    profile)
      SALA_PROFILE=1 $S bench --device cuda --context 128K --decode-tokens 16 > "$L/profile128k.txt" 2>&1
      grep -E 'decode step| ms .*%|profile' "$L/profile128k.txt" | head -30 ;;
    sweep)
      # Issue 4's table: every context length in one run, under the 30 GiB cap.
      timeout 500 $S bench --device cuda --context 4K,32K,128K,256K,512K,1M --decode-tokens 32 --max-memory 30G --json "$L/sweep.json" 2>&1 | tee "$L/sweep.txt" | tail -16 ;;
    1m)
      $S bench --device cuda --context 1M --decode-tokens 16 --max-memory 30G --json "$L/bench1m.json" 2>&1 | tee "$L/bench1m.txt" | tail -6 ;;
    follow-up)
      # Issue 20's figures: the second question about a document, 128K and 1M.
      $S bench --device cuda --context 4K,128K,1M --follow-up --json "$L/follow_up.json" 2>&1 | tee "$L/follow_up.txt" | grep -v '^kernel ' | tail -7 ;;
    dense)
      $S bench --device cuda --context 256K --decode-tokens 2 --compare-dense --dense-time-limit 60 --json "$L/dense256k.json" 2>&1 | tee "$L/dense256k.txt" | tail -4 ;;
    concurrent)
      timeout 150 $S bench --device cuda --concurrent 8 --context 32K --decode-tokens 256 --json "$L/concurrent.json" 2>&1 | tee "$L/concurrent.txt" | tail -4 ;;
    concurrent55k)
      # PERF.md's case: 8 requests with ~55K-token prompts (1024 tokens generated each).
      timeout 300 $S bench --device cuda --concurrent 8 --context 55K --decode-tokens 1024 --json "$L/concurrent55k.json" 2>&1 | tee "$L/concurrent55k.txt" | tail -4 ;;
    concurrent-profile)
      SALA_PROFILE=1 timeout 200 $S bench --device cuda --concurrent 8 --context 32K --decode-tokens 256 > "$L/concurrent_profile.txt" 2>&1
      grep -E 'profile|ms .*%|x$' "$L/concurrent_profile.txt" | tail -60 ;;
    pool)
      # 1M with caches in own allocations (SALA_KV_POOL=0), then in the page pool (the default).
      SALA_KV_POOL=0 $S bench --device cuda --context 1M --decode-tokens 16 --max-memory 30G > "$L/pool_off.txt" 2>&1
      grep -E '^ +1048576' "$L/pool_off.txt" | tail -2
      $S bench --device cuda --context 1M --decode-tokens 16 --max-memory 30G > "$L/pool_on.txt" 2>&1
      grep -E 'page pool|^ +1048576' "$L/pool_on.txt" | tail -3 ;;
    random)
      # Decode over random caches (no prefill): decode speed at long contexts in seconds.
      $S bench --device cuda --context 4K,128K,1M --random-context --decode-tokens 64 --max-memory 30G --json "$L/random.json" 2>&1 | tee "$L/random.txt" | tail -8 ;;
    random-profile)
      SALA_PROFILE=1 $S bench --device cuda --context 1M --random-context --decode-tokens 32 --max-memory 30G > "$L/random_profile.txt" 2>&1
      grep -E 'decode step| ms .*%|profile' "$L/random_profile.txt" | tail -30 ;;
    profile1m)
      SALA_PROFILE=1 $S bench --device cuda --context 1M --decode-tokens 16 --max-memory 30G > "$L/profile1m.txt" 2>&1
      grep -E 'decode step| ms .*%|profile' "$L/profile1m.txt" | tail -60 ;;
    ncu-select)
      # Nsight Compute on one prefill launch of the block-score kernel (64K context).
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 200 "$ncu" --clock-control none -k regex:select_scores --launch-skip 40 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section InstructionStats \
        $S bench --device cuda --context 64K --decode-tokens 1 > "$L/ncu_select.txt" 2>&1
      grep -E 'Duration|Issue Slots|Eligible Warps|Stall|L2 Cache Throughput|Achieved Occupancy' "$L/ncu_select.txt" | head -12 ;;
    *) echo "unknown step $step" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$L" .
