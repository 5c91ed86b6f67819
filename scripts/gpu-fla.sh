#!/usr/bin/env bash
# On the GPU machine (after scripts/gpu-build.sh here and `scripts/gpu-fla.sh --fetch` here):
# the lightning prefill op of sala against flash-linear-attention's chunk_simple_gla, same
# shapes, same GPU. Usage: bash scripts/gpu-fla.sh [contexts, default 8192 65536]
# `--fetch` (on the build machine) downloads the wheels into .gpu/wheels (no internet there).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch" ]; then
  mkdir -p .gpu/wheels
  python3 -m pip download --no-deps -d .gpu/wheels flash-linear-attention==0.6.0 fla-core==0.6.0 einops
  exit $?
fi
export OUT=${OUT:-/tmp/sala-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export XDG_CACHE_HOME=/tmp/sala-cache
contexts=${*:-8192 65536}
python3 -m pip install --quiet --no-deps --target /tmp/fla .gpu/wheels/*.whl > "$OUT/fla-install.log" 2>&1
echo "== flash-linear-attention chunk_simple_gla"
PYTHONPATH=/tmp/fla python3 scripts/fla_bench.py $contexts 2>&1 | tee "$OUT/fla.jsonl" | tail -5
echo "== sala lightning"
.gpu/sala bench --device cuda --kernel lightning --context "$(echo $contexts | tr ' ' ',')" \
  --json "$OUT/sala-lightning.json" 2>&1 | tee "$OUT/sala-lightning.txt" | tail -5
