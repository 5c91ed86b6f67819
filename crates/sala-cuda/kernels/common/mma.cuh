// Tensor-core and shared-memory helpers: ldmatrix, mma.sync m16n8k16 on bf16, cp.async,
// bf16x2 packing and hi + lo splitting, and the value layout of P·V accumulators.
#pragma once
#include "common/types.cuh"

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

// sp_mma on f16 inputs.
__device__ __forceinline__ void sp_mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The shared-window address of a pointer to shared memory (for ldmatrix and cp.async).
__device__ __forceinline__ u32 sp_smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// cp.async: copies 16 bytes, of which the first src_bytes come from src and the rest are zero;
// commit a group; wait until at most 1 (0) groups are pending.
__device__ __forceinline__ void sp_cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// Asks L2 for the 128-byte line holding `p` (no registers, nothing waits on it).
__device__ __forceinline__ void sp_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void sp_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void sp_cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void sp_cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Two floats → bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 sp_pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Splits (x0, x1) into bf16x2 hi = bf16(x) and lo = bf16(x − hi).
__device__ __forceinline__ void sp_split2(float x0, float x1, u32& hi, u32& lo) {
    hi = sp_pack_bf16(x0, x1);
    lo = sp_pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

// Value-dimension layout of the O accumulators. P·V runs over pairs of n-tiles (2m, 2m+1) whose
// columns are permuted so that each lane's B fragment comes from two 32-bit loads: column n of
// tile 2m is dim 16m + 2n, of tile 2m+1 dim 16m + 2n + 1. Hence for row gq (gq + 8), lane tq
// holds dims 16m + 4tq + {0, 1, 2, 3} = O[2m][0], O[2m+1][0], O[2m][1], O[2m+1][1] (+2 for row gq+8).
__device__ __forceinline__ int sp_o_dim(int nt, int x, int tq) {  // dim of accumulator O[nt][x]
    return 16 * (nt >> 1) + 4 * tq + (nt & 1) + 2 * (x & 1);
}

// Writes row r (0: gq, 1: gq + 8) of the O accumulators (dims as sp_o_dim says) times f as
// bf16 to op (the row's first dim + 4tq): 4 consecutive dims per 16-dim group.
__device__ __forceinline__ void sp_store_row(const float (&O)[16][4], int r, float f, bf16* op, int d) {
#pragma unroll
    for (int m = 0; m < 8; m++)
        if (m * 16 < d) {
            uint2 w;
            w.x = (u32)f2bf(O[2 * m][2 * r] * f) | ((u32)f2bf(O[2 * m + 1][2 * r] * f) << 16);
            w.y = (u32)f2bf(O[2 * m][2 * r + 1] * f) | ((u32)f2bf(O[2 * m + 1][2 * r + 1] * f) << 16);
            *(uint2*)(op + 16 * m) = w;
        }
}

#define AT_MAXLD 136  // bf16 row stride of a staged tile of keys or values for d ≤ 128 (128 + 8: conflict-free)
