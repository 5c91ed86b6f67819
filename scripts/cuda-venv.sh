#!/usr/bin/env bash
# Sourced by test.sh and check-kernels.sh: a venv in target/cuda-venv with the CUDA 13.0 PyPI
# wheels the GPU-less checks need, pinned to the driver's line (13.5's PTX is refused by a
# 13.0 driver): NVRTC (kernels compile in CI) and, with CUDA_VENV_PTXAS=1, the nvcc wheel's
# ptxas (registers, shared memory and spills per architecture). Exports LD_LIBRARY_PATH for
# NVRTC and, with ptxas, SALA_PTXAS.
venv="$PWD/target/cuda-venv"
if [ ! -x "$venv/bin/pip" ]; then
  python3 -m venv "$venv"
fi
if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 > /dev/null 2>&1; then
  "$venv/bin/pip" install --quiet nvidia-cuda-nvrtc==13.0.88
fi
if [ "${CUDA_VENV_PTXAS:-0}" = 1 ]; then
  if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/ptxas > /dev/null 2>&1; then
    # The compiler's front end, headers and runtime of the same line too (unpinned, pip takes
    # the newest, whose PTX this ptxas refuses): nvcc works here for kernels built by hand.
    "$venv/bin/pip" install --quiet nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
      nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
  fi
  SALA_PTXAS=$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/ptxas | head -1)
  export SALA_PTXAS
fi
nvrtc_lib=$(dirname "$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 | head -1)")
export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
