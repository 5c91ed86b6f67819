// Shared by every kernel file; the registry compiles common.cuh followed by all *.cu files as
// one NVRTC program, with no CUDA headers: bf16 values are raw 16-bit patterns.
typedef unsigned short bf16;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
__device__ __forceinline__ bf16 f2bf(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// The value a bf16 tensor would hold.
__device__ __forceinline__ float round_bf(float x) { return bf2f(f2bf(x)); }

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

// ldmatrix: four 8×8 bf16 matrices from shared memory (`addr` a shared-window address); lane L
// gives the address of row L % 8 of matrix L / 8 and receives element pair (L / 4, 2·(L % 4))
// of each matrix (`_t`: of each matrix transposed).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D += A·B, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void sp_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
