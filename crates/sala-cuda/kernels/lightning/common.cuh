// Helpers shared by the lightning kernel files.
#pragma once
#include "common/types.cuh"

// The low / high bf16 of a bf16x2 word as fp32.
__device__ __forceinline__ float lt_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float lt_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// γ^n = exp(g·n) as lightning_chunked computes it: g·n an fp32 product, its exp in double,
// rounded once.
__device__ __forceinline__ float lc_pow(float g, int n) { return (float)exp((double)__fmul_rn(g, (float)n)); }

#define LF_C 64  // tokens per chunk of the range kernels (ranges.cu)
