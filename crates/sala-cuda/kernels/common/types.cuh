// Types and arithmetic shared by every kernel file. Each .cu file is its own NVRTC program
// (src/sources.rs), compiled with no CUDA headers: bf16 values are raw 16-bit patterns.
#pragma once

typedef unsigned short bf16;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// Programmatic dependent launch (sm_90 on): a kernel launched with the programmatic stream
// serialization attribute may be scheduled before the previous kernel of the stream ends. Every
// kernel calls this first: it waits for the previous kernel's results (its completion and
// memory flush), then lets the next kernel be scheduled early in turn. A no-op below sm_90.
// (Loading a GEMV's first weights before the wait was tried: 4K decode 175 -> 169 tok/s.)
__device__ __forceinline__ void pdl_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even by the conversion instruction (sm_80 on); a NaN comes out as the
// canonical quiet NaN.
__device__ __forceinline__ bf16 f2bf(float x) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(0.0f), "f"(x));  // x to the low half
    return (bf16)r;
}

// The value a bf16 tensor would hold, in one conversion (x to the high half).
__device__ __forceinline__ float round_bf(float x) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(x), "f"(0.0f));
    return __uint_as_float(r);
}

// round(silu(g)) · u in fp32, the MLP's gate times its up projection (round the result once more).
__device__ __forceinline__ float silu_times(float g, float u) { return round_bf(g / (1.0f + expf(-g))) * u; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Maximum over a block whose size is a multiple of 32 (at most 1024); `scratch` holds 32 floats.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = warp_max(lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0f);
    __syncthreads();
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int nw = blockDim.x >> 5;
    v = (threadIdx.x < nw) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    float r = scratch[0];
    __syncthreads();
    return r;
}

// The 8 bf16 of a 16-byte pack as fp32.
__device__ __forceinline__ void bf16x8_to_f32(uint4 p, float* f) {
    u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
