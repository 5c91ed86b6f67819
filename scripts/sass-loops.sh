#!/usr/bin/env bash
# The SASS of one kernel, no GPU needed: its file's NVRTC PTX (kernel_ptx) assembled by the
# pinned ptxas for ARCH (default sm_90a) and disassembled by cuobjdump; prints the kernel's
# registers and spills, then each loop (a backward branch and its target) with its instruction
# count and commonest opcodes. Instructions a loop issues per iteration, times its trips, over
# the GPU's schedulers (an SM's 4, one warp-instruction a cycle each) bound a kernel from below:
# compare that with its DRAM floor. The disassembler comes from the CUDA 13.2 wheels (13.0 has
# none on PyPI); it reads 13.0's cubins.
# Usage: scripts/sass-loops.sh FILE KERNEL [ARCH]   (e.g. gemv/rows64.cu gemv_rows64)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 FILE KERNEL [ARCH]" >&2; exit 2; }
file=$1 kernel=$2 arch=${3:-sm_90a}
CUDA_VENV_PTXAS=1 source scripts/cuda-venv.sh
bin=$(dirname "$SALA_PTXAS")
if [ ! -x "$bin/cuobjdump" ] || [ ! -x "$bin/nvdisasm" ]; then
  "$PWD/target/cuda-venv/bin/pip" install --quiet nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cargo run --release --quiet -p sala-cuda --bin kernel_ptx -- "$file" "compute_${arch#sm_}" "$tmp/k.ptx"
"$SALA_PTXAS" -arch="$arch" -v -o "$tmp/k.cubin" "$tmp/k.ptx" 2> "$tmp/ptxas.log"
grep -A3 "entry function '$kernel'" "$tmp/ptxas.log" | grep -E "Used|spill" || true
PATH="$bin:$PATH" cuobjdump -sass -fun "$kernel" "$tmp/k.cubin" > "$tmp/k.sass"
python3 - "$tmp/k.sass" <<'PY'
import collections, re, sys
ins = []
for line in open(sys.argv[1]):
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip()))
print(f"{len(ins)} instructions")
for at, text in ins:
    m = re.search(r'BRA (0x[0-9a-f]+)', text)
    if m and int(m.group(1), 16) < at:
        start = int(m.group(1), 16)
        body = [t for a, t in ins if start <= a <= at]
        ops = collections.Counter(re.sub(r'^@!?U?P\w+ ', '', t).split()[0].split('.')[0] for t in body)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        print(f"loop {start:#06x}..{at:#06x}: {len(body)} instructions ({top})")
PY
