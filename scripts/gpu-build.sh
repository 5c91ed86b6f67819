#!/usr/bin/env bash
# Builds, on this machine, what the GPU machine runs: the `sala` binary and the GPU parity
# test binary, into .gpu/ (git-ignored). Then, on the GPU machine, `bash scripts/gpu-run.sh`
# (through the device tool, carrying .gpu) runs the parity tests, the CLI check and the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release -p sala
cp target/release/sala .gpu/sala
bin=$(cargo test --release -p sala-cuda --test gpu_parity --no-run 2>&1 | grep -o 'target/release/deps/gpu_parity-[0-9a-f]*' | tail -1)
cp "$bin" .gpu/gpu_parity
ls -la .gpu
