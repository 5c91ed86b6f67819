// FP8 E4M3 codes: rounding to them and reading them back, shared by the FP8 K/V cache
// (sparse/) and the FP8 weights (gemv/fp8.cu). Same numbers as sala_model::numerics.
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

// The FP8 scale of a row's amax: amax / 448, or 1 where that is not a normal f32.
__device__ __forceinline__ float f8_scale(float amax) {
    const float s = __fdiv_rn(amax, 448.0f);
    return s >= 1.17549435e-38f ? s : 1.0f;
}

// Hardware E4M3 conversions from compute capability 8.9 on; the same numbers by bits before.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define F8_HW 1
#else
#define F8_HW 0
#endif

// Two floats as two E4M3 codes (lo in bits 0..7, hi in 8..15): nearest, ties to even,
// saturating (e4m3_code of each).
__device__ __forceinline__ u32 e4m3x2_code(float lo, float hi) {
#if F8_HW
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return e4m3_code(lo) | (e4m3_code(hi) << 8);
#endif
}

// Two codes (bits 0..15 of c) as an f16x2 of their values times F8_F16_UNIT (exact).
__device__ __forceinline__ u32 e4m3x2_f16(u32 c) {
#if F8_HW
    u32 r;
    const unsigned short h = (unsigned short)c;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(h));
    return r;
#else
    // E4M3's bits shifted into f16's exponent and mantissa: the value times 2^-8 (subnormal
    // codes land on f16 subnormals, exactly).
    const u32 x = (c & 0xffu) | ((c & 0xff00u) << 8);
    return ((x & 0x007f007fu) << 7) | ((x & 0x00800080u) << 8);
#endif
}
#define F8_F16_UNIT (F8_HW ? 1.0f : 0.00390625f)

// The largest magnitude of 8 bf16 values (a 16-byte load).
__device__ __forceinline__ float amax8(uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) m = fmaxf(m, fmaxf(fabsf(bf2f((bf16)(w[j] & 0xffffu))), fabsf(bf2f((bf16)(w[j] >> 16)))));
    return m;
}

// A row of bf16 values held by a block, P packs of 8 a thread (pack threadIdx.x + p·blockDim.x,
// `o[p]` its four bf16x2 words, where its first value is below `dim`), as E4M3 codes at the
// row's own scale, into `codes` (the row's first code) and `*scale`: the codes and scale
// quant_rows_f8 makes of the same values. `scratch` holds 32 floats.
template <int P>
__device__ __forceinline__ void row_codes_f8(const u32 (&o)[P][4], int dim, float* scratch, unsigned char* codes,
                                             float* scale) {
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < P; p++)
        if ((threadIdx.x + p * blockDim.x) * 8 < dim) amax = fmaxf(amax, amax8(make_uint4(o[p][0], o[p][1], o[p][2], o[p][3])));
    amax = block_max(amax, scratch);
    const float s = f8_scale(amax), inv = __fdiv_rn(1.0f, s);
#pragma unroll
    for (int p = 0; p < P; p++) {
        const int pk = threadIdx.x + p * blockDim.x;
        if (pk * 8 < dim) {
            u32 c[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                c[j] = e4m3x2_code(bf2f((bf16)(o[p][j] & 0xffffu)) * inv, bf2f((bf16)(o[p][j] >> 16)) * inv);
            *(uint2*)(codes + pk * 8) = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        }
    }
    if (threadIdx.x == 0) *scale = s;
}
