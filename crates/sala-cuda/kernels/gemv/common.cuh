// What the decode products (gemv/*.cu) share: where an output goes, the tensor-core
// products' warps, slab walk and block sum (their sums added in an order no other row
// changes), and the norms a 1-row product makes in its own blocks.
#pragma once
#include "common/types.cuh"
#include "common/fp8.cuh"

// Where output o of activation row b goes: o < n0 → y0, then n1 values to y1, n2 to y2, the rest
// to y3, each output's rows `stride_j` (its count) apart.
__device__ __forceinline__ void gemv_store(float s, int o, int b, bf16* y0, int n0, bf16* y1, int n1, bf16* y2,
                                           int n2, bf16* y3, int n) {
    bf16* y = y0;
    int w = n0;
    if (o >= n0) {
        o -= n0;
        y = y1;
        w = n1;
        if (o >= n1) {
            o -= n1;
            y = y2;
            w = n2;
            if (o >= n2) {
                o -= n2;
                y = y3;
                w = n - n0 - n1 - n2;
            }
        }
    }
    y[(size_t)b * w + o] = f2bf(s);
}

// 16 bytes of shared memory at byte address `at`.
__device__ __forceinline__ uint4 gm_lds(u32 at) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at));
    return v;
}

// Measured at batch 1 (H200, 4K decode, kernel time of 64 steps): 8 warps, one pack a lane:
// 439 ms; 8 warps, two packs: 401; 16 warps, two packs (this): 391; the CUDA-core GEMVs: 395.
#define GM_WARPS 16

// Runs slab(cur, nxt, s) for this warp's slabs s = w, w + GM_WARPS, ... below `slabs`, two a
// turn with the buffers a and an swapping roles (no copy between slabs); after an odd count,
// take(a, an) copies the next slab's buffer into a.
template <class Buf, class Slab, class Take>
__device__ __forceinline__ void gm_slab_turns(int slabs, Buf& a, Buf& an, Slab& slab, Take&& take) {
    int s = threadIdx.x >> 5;
    for (; s + GM_WARPS < slabs; s += 2 * GM_WARPS) {
        slab(a, an, s);
        slab(an, a, s + GM_WARPS);
    }
    if (s < slabs) {
        slab(a, an, s);
        take(a, an);
    }
}

// Value v of the warps' partials in `red` (stride floats apart) added in `groups` groups (1, 2,
// 4, 8 or 16) of GM_WARPS / groups warps: each group's in warp order from 0, then the groups'
// sums in order from 0. With one group, the warps in order (a sum from +0 is never −0).
__device__ __forceinline__ float gm_grouped_sum(const float* red, int stride, int groups) {
    const int per = GM_WARPS / groups;
    float s = 0.0f, g = 0.0f;
#pragma unroll
    for (int w = 0; w < GM_WARPS; w++) {
        g += red[w * stride];
        if (((w + 1) & (per - 1)) == 0) {
            s += g;
            g = 0.0f;
        }
    }
    return s;
}

// The block's sums: every warp's partials through shared memory, added by gm_grouped_sum; value
// v = nt·128 + i·32 + lane of `red` is c[nt][i] of that lane.
template <int NT>
__device__ __forceinline__ float gm_block_sum(float (*red)[NT * 128], const float (&c)[NT][4], int v, int groups) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) red[warp][nt * 128 + i * 32 + lane] = c[nt][i];
    __syncthreads();
    return v < NT * 128 ? gm_grouped_sum(&red[0][v], NT * 128, groups) : 0.0f;
}

// The residual add and the norm before a 1-row product, made in every block of it (512 threads)
// instead of by add_rms_norm before it: h' = round(h + round(branch·scale)), a = RMSNorm(h')·w,
// with add_rms_norm's packs, arithmetic and block sum for one row, so the same bits. The row
// (k ≤ 8192, a multiple of 8) comes in as it is after the PDL wait; a's 16-byte chunks go to
// shared memory (chunk c at gm_x_slot(c)); block 0 stores a (the norm's output, for whoever
// else reads it); the block that ends last stores h' (every block reads h).
// A norm before a product costs ~3 us of a step as its own launch, 0.1-0.9 us so (H100).
struct GmNorm {
    bf16* h;
    const bf16* branch;
    float scale;
    const bf16* w;
    float eps;
    bf16* a;
    u32* ticket;  // blocks done (0 between launches)
};

// Shared-memory slot of the normed row's 16-byte chunk c: a slab's four lane quarters (chunks
// 4t + p of its 16) fall in distinct banks.
__device__ __forceinline__ int gm_x_slot(int c) { return c ^ (((c >> 3) & 1) << 1); }

// h' of the 16-byte chunk c of the row: its 8 residual values plus their branch values, rounded
// as add_rms_norm rounds them.
__device__ __forceinline__ uint4 gm_residual8(const GmNorm& nm, int c, float& ss) {
    const uint4 hr = ((const uint4*)nm.h)[c], br = ((const uint4*)nm.branch)[c];
    const u32 hw[4] = {hr.x, hr.y, hr.z, hr.w}, bw[4] = {br.x, br.y, br.z, br.w};
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float lo = round_bf(__uint_as_float(hw[i] << 16) + round_bf(__uint_as_float(bw[i] << 16) * nm.scale));
        const float hi = round_bf(__uint_as_float(hw[i] & 0xffff0000u) +
                                  round_bf(__uint_as_float(bw[i] & 0xffff0000u) * nm.scale));
        o[i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
        ss += lo * lo + hi * hi;
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

__device__ __forceinline__ void gm_add_norm_row(const GmNorm& nm, int k, uint4* xs) {
    __shared__ float scratch[32];
    u32 o[2][4] = {};
    uint4 wraw[2];
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int pk = threadIdx.x + p * blockDim.x;
        if (pk * 8 < k) {
            wraw[p] = ((const uint4*)nm.w)[pk];
            const uint4 v = gm_residual8(nm, pk, ss);
            o[p][0] = v.x, o[p][1] = v.y, o[p][2] = v.z, o[p][3] = v.w;
        }
    }
    const float r = rsqrtf(block_sum(ss, scratch) / k + nm.eps);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int pk = threadIdx.x + p * blockDim.x;
        if (pk * 8 < k) {
            const u32 ww[4] = {wraw[p].x, wraw[p].y, wraw[p].z, wraw[p].w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float lo = round_bf(__uint_as_float(o[p][i] << 16) * r) * __uint_as_float(ww[i] << 16);
                const float hi =
                    round_bf(__uint_as_float(o[p][i] & 0xffff0000u) * r) * __uint_as_float(ww[i] & 0xffff0000u);
                o[p][i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
            }
            const uint4 v = make_uint4(o[p][0], o[p][1], o[p][2], o[p][3]);
            xs[gm_x_slot(pk)] = v;
            if (blockIdx.x == 0) ((uint4*)nm.a)[pk] = v;
        }
    }
    __syncthreads();
}

// After a normed product's last tile: the block that ends last (every other has read h) makes
// h' again and stores it, and sets the ticket back to 0.
__device__ __forceinline__ void gm_store_residual(const GmNorm& nm, int k) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(nm.ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < k / 8; c += blockDim.x) {
        const uint4 v = gm_residual8(nm, c, ss);
        ((uint4*)nm.h)[c] = v;
    }
    if (threadIdx.x == 0) *nm.ticket = 0;
}
