// Decode-time products: a few activation rows times a bf16 weight matrix, bound by reading the
// weights once. The default, gemv_mma*, runs 1 to 16 rows on tensor cores with each row's sums
// in an order that does not depend on the other rows (a batched decode step gives each row the
// bits a single-row step gives it). The CUDA-core kernels (gemv, gemv_narrow, gemv_silu) take
// one row: each warp owns GEMV_ROWS output rows (one in gemv_narrow) and streams them with
// 16-byte loads, several in flight; the activation row is read through the L1 cache.

#include "common/types.cuh"
#include "common/fp8.cuh"
#include "common/mma.cuh"
#include "gemv/common.cuh"

#define GEMV_ROWS 4
#define GEMV_WARPS 4

template <int R>
__device__ __forceinline__ void gemv_pack(uint4 xp, const uint4* wp, float* acc) {
    float xf[8];
    bf16x8_to_f32(xp, xf);
#pragma unroll
    for (int r = 0; r < R; r++) {
        float wf[8];
        bf16x8_to_f32(wp[r], wf);
#pragma unroll
        for (int e = 0; e < 8; e++) acc[r] += xf[e] * wf[e];
    }
}

// acc[r] = Σ_i x[i]·w[row_r, i] for R weight rows (one warp; every lane gets its partial sums,
// reduce with warp_sum). k is a multiple of 8. Each lane adds packs lane, lane + 32, ... in order
// (U packs a row in flight).
template <int R = GEMV_ROWS, int U = 4>
__device__ __forceinline__ void gemv_rows(const bf16* x, const uint4* const (&wr)[R], int k, float (&acc)[R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    const int packs = k / 8;
    const uint4* xg = (const uint4*)x;
    int i = lane;
    for (; i + 32 * (U - 1) < packs; i += 32 * U) {
        uint4 p[U][R], xp[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int r = 0; r < R; r++) p[u][r] = __ldg(wr[r] + i + 32 * u);
            xp[u] = __ldg(xg + i + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < U; u++) gemv_pack<R>(xp[u], p[u], acc);
    }
    for (; i < packs; i += 32) {
        uint4 p[R];
#pragma unroll
        for (int r = 0; r < R; r++) p[r] = __ldg(wr[r] + i);
        gemv_pack<R>(__ldg(xg + i), p, acc);
    }
}

// y[o] = round(Σ_i x[i]·w[o, i]) for o < n, written to up to four outputs in turn: o < n0 goes
// to y0[o], then n1 values to y1, n2 to y2, the rest to y3 (one product of stacked weights,
// as separate products would). k is a multiple of 8.
// launch: grid = ceil(n / (GEMV_WARPS * GEMV_ROWS)), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv(const bf16* x, const bf16* w, int n, int k, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    pdl_start();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) wr[r] = (const uint4*)(w + (u64)min(row0 + r, n - 1) * k);
    float acc[GEMV_ROWS];
    gemv_rows(x, wr, k, acc);
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < n) gemv_store(s, row0 + r, 0, y0, n0, y1, n1, y2, n2, y3, n);
    }
}

// gemv with one output row a warp and 8 packs in flight a lane: four times the warps of gemv,
// for products with few output rows (4096), where gemv leaves most SMs with two blocks.
// launch: grid = ceil(n / GEMV_WARPS), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_narrow(const bf16* x, const bf16* w, int n, int k, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2,
            bf16* y3) {
    pdl_start();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    const uint4* wr[1] = {(const uint4*)(w + (u64)min(row, n - 1) * k)};
    float acc[1];
    gemv_rows<1, 8>(x, wr, k, acc);
    const float s = warp_sum(acc[0]);
    if (lane == 0 && row < n) gemv_store(s, row, 0, y0, n0, y1, n1, y2, n2, y3, n);
}

// The MLP's first half for one activation row: with w = [gate; up] ([2·inter, k]),
// y[j] = round(round(silu(g_j)) · u_j), g_j = round(x·w[j]), u_j = round(x·w[inter + j]) (gemv,
// then silu_mul_halves, in one pass). Each warp owns GEMV_ROWS / 2 outputs.
// launch: grid = ceil(inter / (GEMV_WARPS * GEMV_ROWS / 2)), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_silu(const bf16* x, const bf16* w, bf16* y, int inter, int k) {
    pdl_start();
    constexpr int HALF = GEMV_ROWS / 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = (blockIdx.x * GEMV_WARPS + warp) * HALF;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < HALF; r++) {
        const int j = min(j0 + r, inter - 1);
        wr[r] = (const uint4*)(w + (u64)j * k);
        wr[HALF + r] = (const uint4*)(w + (u64)(inter + j) * k);
    }
    float acc[GEMV_ROWS];
    gemv_rows(x, wr, k, acc);
#pragma unroll
    for (int r = 0; r < HALF; r++) {
        const float g = bf2f(f2bf(warp_sum(acc[r])));
        const float u = bf2f(f2bf(warp_sum(acc[HALF + r])));
        if (lane == 0 && j0 + r < inter) y[j0 + r] = f2bf(silu_times(g, u));
    }
}

// ---- Tensor-core GEMV: a decode step of 1 to 16 rows, batch-invariant ----
// y = round(x Wᵀ) on mma.sync m16n8k16: a block owns 16 weight rows (the MMA's M), the nb
// activation rows are its N (8 a tile, NT tiles), and its GM_WARPS warps split K into slabs of
// 32·GM_P elements (warp w takes slabs w, w + GM_WARPS, ... in order), then their partial sums
// are added in warp order. An output depends only on its weight row, its activation row and
// that fixed order, never on the other activation rows, so a row gets the same bits whatever nb
// is: a batched decode step changes no sequence's result. Within a slab, lane (g, t) loads
// GM_P packs of 8 consecutive k (16 bytes each; 4 lanes read 128 contiguous bytes of a row) of
// weight rows g and g + 8 and of activation row g, and uses each pack as its k-fragments of two
// k16 steps: the same permutation of k for both operands, so the products are unchanged.
#define GM_P 2

// The lane's activation rows (rows nt·8 + g, k apart; NULL from nb on).
template <int NT>
__device__ __forceinline__ void gm_rows(const bf16* x, int nb, int k, const bf16* (&xr)[NT]) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = nt * 8 + g < nb ? x + (size_t)(nt * 8 + g) * k : nullptr;
}

// y[b, o] = round(x_b · w[o]) for o < n, b < nb ≤ 8·NT (NT ≤ 2; outputs split over y0..y3 as in
// gemv, row b of part j at y_j + b·n_j). A block runs M-tiles blockIdx.x, + gridDim.x, ... in
// turn (16 weight rows; with SILU, w = [gate; up] ([2·inter, k]) and a tile is 8 outputs, its
// MMA rows 0..7 the gate rows and 8..15 the up rows, so a lane holds g_j and u_j of the same
// output: y0[b·inter + j] = round(round(silu(round(g))) · round(u))). Each warp runs its slabs
// of a tile in order, asking for its next slab's weights (this tile's, else its next tile's
// first) before it multiplies the current one; the first are asked for before the PDL wait.
template <int NT, bool SILU>
__device__ __forceinline__ void gemv_mma_tiles_body(const bf16* x, const bf16* w, int n, int k, int nb, int groups,
                                                    bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // Two buffers of the warps' sums, tiles taking turns: a warp writes a buffer only after the
    // barrier of the tile between, which every thread passes after reading it, so one barrier a
    // tile (gm_block_sum's) suffices.
    __shared__ float red[2][GM_WARPS][NT * 128];
    int turn = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tile_rows = SILU ? 8 : 16, inter = n / 2;
    const int tiles = ((SILU ? inter : n) + tile_rows - 1) / tile_rows;
    constexpr int SLAB = 32 * GM_P;
    const int slabs = (k + SLAB - 1) / SLAB;
    auto rows_of = [&](int tile, const bf16* (&rows)[2]) {
        const int m0 = tile * tile_rows;
        const int r0 = SILU ? min(m0 + g, inter - 1) : min(m0 + g, n - 1);
        const int r1 = SILU ? inter + r0 : min(m0 + g + 8, n - 1);
        rows[0] = w + (u64)r0 * k;
        rows[1] = w + (u64)r1 * k;
    };
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto load = [&](const bf16* const (&rows)[2], int s, uint4 (&a)[GM_P][2]) {
#pragma unroll
        for (int p = 0; p < GM_P; p++) {
            const int kk = s * SLAB + (t * GM_P + p) * 8;
#pragma unroll
            for (int h = 0; h < 2; h++) a[p][h] = kk < k ? __ldg((const uint4*)(rows[h] + kk)) : zero;
        }
    };
    const bf16* xr[NT];
    gm_rows(x, nb, k, xr);
    uint4 a[GM_P][2], an[GM_P][2];
    const bf16* rows[2];
    rows_of(blockIdx.x, rows);
    if ((int)blockIdx.x < tiles) load(rows, warp, a);
    pdl_start();
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[nt][i] = 0.0f;
        for (int s = warp; s < slabs; s += GM_WARPS) {
            uint4 b[GM_P][NT];
#pragma unroll
            for (int p = 0; p < GM_P; p++) {
                const int kk = s * SLAB + (t * GM_P + p) * 8;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) b[p][nt] = kk < k && xr[nt] ? __ldg((const uint4*)(xr[nt] + kk)) : zero;
            }
            const int ns = s + GM_WARPS < slabs ? s + GM_WARPS : warp;
            const int ntile = s + GM_WARPS < slabs ? tile : tile + (int)gridDim.x;
            if (ntile < tiles) {
                const bf16* nrows[2];
                rows_of(ntile, nrows);
                load(nrows, ns, an);
            }
#pragma unroll
            for (int p = 0; p < GM_P; p++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 lo = a[p][0], hi = a[p][1], x8 = b[p][nt];
                    sp_mma(c[nt], lo.x, hi.x, lo.y, hi.y, x8.x, x8.y);
                    sp_mma(c[nt], lo.z, hi.z, lo.w, hi.w, x8.z, x8.w);
                }
#pragma unroll
            for (int p = 0; p < GM_P; p++) a[p][0] = an[p][0], a[p][1] = an[p][1];
        }
        const int v = threadIdx.x, m0 = tile * tile_rows;
        if (SILU) {
            const int nt = v >> 6, i = (v >> 5) & 1, l = v & 31, vg = nt * 128 + i * 32 + l;
            const float gs = gm_block_sum<NT>(red[turn], c, v < NT * 64 ? vg : NT * 128, groups);
            const float us = v < NT * 64 ? gm_grouped_sum(&red[turn][0][vg + 64], NT * 128, groups) : 0.0f;
            const int jo = m0 + (l >> 2), b = nt * 8 + 2 * (l & 3) + i;
            if (v < NT * 64 && jo < inter && b < nb)
                y0[(size_t)b * inter + jo] = f2bf(silu_times(round_bf(gs), round_bf(us)));
        } else {
            const float sum = gm_block_sum<NT>(red[turn], c, v, groups);
            const int nt = v >> 7, i = (v >> 5) & 3, l = v & 31;
            const int o = m0 + (l >> 2) + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * (l & 3) + (i & 1);
            if (v < NT * 128 && o < n && b < nb) gemv_store(sum, o, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
        turn ^= 1;
    }
}

// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0; nb ≤ 8
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_mma8(const bf16* x, const bf16* w, int n, int k, int nb, int groups, bf16* y0, int n0, bf16* y1, int n1,
          bf16* y2, int n2, bf16* y3) {
    gemv_mma_tiles_body<1, false>(x, w, n, k, nb, groups, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_mma8 for nb ≤ 16 (two N tiles; each row's bits as gemv_mma8 gives them).
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_mma16(const bf16* x, const bf16* w, int n, int k, int nb, int groups, bf16* y0, int n0, bf16* y1, int n1,
           bf16* y2, int n2, bf16* y3) {
    gemv_mma_tiles_body<2, false>(x, w, n, k, nb, groups, y0, n0, y1, n1, y2, n2, y3);
}

// launch: grid = min(ceil(inter / 8), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0; nb ≤ 8
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_mma8(const bf16* x, const bf16* w, bf16* y, int inter, int k, int nb, int groups) {
    gemv_mma_tiles_body<1, true>(x, w, 2 * inter, k, nb, groups, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// gemv_silu_mma8 for nb ≤ 16.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_mma16(const bf16* x, const bf16* w, bf16* y, int inter, int k, int nb, int groups) {
    gemv_mma_tiles_body<2, true>(x, w, 2 * inter, k, nb, groups, y, 0, nullptr, 0, nullptr, 0, nullptr);
}
