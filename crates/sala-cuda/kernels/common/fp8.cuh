// FP8 E4M3 codes: rounding to them and reading them back, shared by the FP8 K/V cache
// (sparse/) and the FP8 weights (gemv.cu). Same numbers as sala_model::numerics.
#pragma once
#include "common/types.cuh"

// The E4M3 code of x: nearest, ties to even, saturating at ±448; NaN gives 0x7f
// (`sala_model::numerics::e4m3_code` bit for bit).
__device__ __forceinline__ u32 e4m3_code(float x) {
    const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a != a) return 0x7fu;
    if (a < 0.015625f) return sign | (u32)__float2int_rn(a * 512.0f);
    const u32 b = __float_as_uint(a);
    const u32 r = (b + 0x7ffffu + ((b >> 20) & 1u)) >> 20;
    return sign | min(r - (120u << 3), 0x7eu);
}

// The value of an E4M3 code (bits 0..7 of c; never 0x7f): its bits placed as an fp32 whose
// exponent is 120 too small (subnormal codes become fp32 denormals, exactly), then scaled.
__device__ __forceinline__ float e4m3_value(u32 c) {
    return __uint_as_float(((c & 0x80u) << 24) | ((c & 0x7fu) << 20)) * 0x1p120f;
}

// Four codes (bytes of w, low first) as two bf16x2 words (exact: E4M3 values fit bf16).
__device__ __forceinline__ void e4m3x4_bf16(u32 w, u32& lo, u32& hi) {
    auto bf = [](u32 c) { return __float_as_uint(e4m3_value(c)) >> 16; };
    lo = bf(w & 0xffu) | (bf((w >> 8) & 0xffu) << 16);
    hi = bf((w >> 16) & 0xffu) | (bf(w >> 24) << 16);
}

// Eight codes (8 bytes) as the four bf16x2 words a 16-byte load of bf16 values would give.
__device__ __forceinline__ uint4 e4m3x8_bf16(uint2 c) {
    uint4 r;
    e4m3x4_bf16(c.x, r.x, r.y);
    e4m3x4_bf16(c.y, r.z, r.w);
    return r;
}
