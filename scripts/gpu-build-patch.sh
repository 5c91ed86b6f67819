#!/usr/bin/env bash
# Builds, here, the GPU binaries of this checkout with patches applied (e.g. wip/*.patch) into
# .gpu-b/, beside scripts/gpu-build.sh's .gpu/ (the checkout as it is): the two sets that
# scripts/gpu-ab.sh compares on the GPU machine (carry both: [".gpu", ".gpu-b"]). The patches
# are applied in a temporary worktree; the build keeps its own target folder (target-b/), so
# the checkout's builds stay warm. DEST=.gpu-c (say) writes a third set beside them.
# Usage: scripts/gpu-build-patch.sh PATCH...
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
[ $# -gt 0 ] || { echo "usage: $0 PATCH..." >&2; exit 2; }
tree=$(mktemp -d)/tree
git worktree add -q --detach "$tree" HEAD
trap 'git worktree remove --force "$tree"; git worktree prune' EXIT
for p in "$@"; do
  (cd "$tree" && git am -3 -q "$root/$p") || { echo "$p does not apply to HEAD" >&2; exit 1; }
done
export CARGO_TARGET_DIR="$root/target-b"
(cd "$tree" && cargo build --release -p sala)
bin=$(cd "$tree" && cargo test --release -p sala-cuda --test gpu_parity --no-run 2>&1 |
  grep -o 'target-b/release/deps/gpu_parity-[0-9a-f]*' | tail -1)
dest=${DEST:-.gpu-b}
mkdir -p "$dest"
cp "$CARGO_TARGET_DIR/release/sala" "$dest/sala"
cp "$root/$bin" "$dest/gpu_parity"
ls -la "$dest"
