// Decode-time products: a few activation rows times a bf16 weight matrix, bound by reading the
// weights once. The default, gemv_mma*, runs 1 to 16 rows on tensor cores with each row's sums
// in an order that does not depend on the other rows (a batched decode step gives each row the
// bits a single-row step gives it). The CUDA-core kernels (gemv, gemv_narrow, gemv_silu) take
// one row: each warp owns GEMV_ROWS output rows (one in gemv_narrow) and streams them with
// 16-byte loads, several in flight; the activation row is read through the L1 cache.

#include "common/types.cuh"
#include "common/fp8.cuh"
#include "common/mma.cuh"

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
#define GM_P 2

// The lane's activation rows (rows nt·8 + g, k apart; NULL from nb on).
template <int NT>
__device__ __forceinline__ void gm_rows(const bf16* x, int nb, int k, const bf16* (&xr)[NT]) {
    const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = nt * 8 + g < nb ? x + (size_t)(nt * 8 + g) * k : nullptr;
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

// ---- 17 to 64 rows: a warp per M-tile, the chains in turn, activations staged a block ----
// The same sums as gemv_mma8 (so a row's bits do not depend on the batch): chain w (w = 0..15) runs
// slabs w, w + 16, ... (64 k each, in order) through the MMAs gemv_mma_tiles_body issues, from
// zero, and the chains are added as gm_block_sum adds its warps: in `groups` groups of 16 / groups
// chains, each group's sums in order from 0, then the groups' in order from 0. Here one warp owns
// an M-tile (16 weight rows; or 8 outputs' gate and up rows) for every activation row (up to 8
// N-tiles) and runs the chains one after another: the block's R64_W warps take the same slab at
// once, so each activation slab (64 rows x 64 k, 8 KB) is staged once a block in shared memory
// (cp.async, R64_STAGES in flight; 16-byte chunk c of row r at c ^ (r & 7), so a quarter-warp's
// reads hit distinct banks) instead of read by every warp from L2, and the weights go to registers
// a slab ahead. One launch (one group) adds all 16 chains; a product of more groups runs each group
// as a part (gridDim.y = groups, blocks apart, part p running chains 16p / parts .. 16(p + 1) /
// parts), writes the part's sum to `sums` ([parts][64 · gridDim.x][nbp] floats, row m of a block's
// tiles = tile · 16 + MMA row, nbp = nb rounded up to 8), and gemv_chain_sums adds the parts in
// order.
#define R64_W 4
#define R64_STAGES 4

template <int N>
__device__ __forceinline__ void r64_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The slab after s in the steps' order: chain s mod 16's next, else the next chain's first
// (chain w: slabs w, w + 16, ...).
__device__ __forceinline__ int r64_next(int s, int slabs) { return s + 16 < slabs ? s + 16 : (s & 15) + 1; }

// Where this thread stages its four 16-byte chunks of an activation slab: chunk c = tid % 8 of
// rows r = tid / 8 + 16i (i < 4); row r's chunk c at c ^ (r & 7), the same swizzle for all four.
struct R64Stage {
    const bf16* src;  // x + r·k + 8c for i = 0
    u32 dst;          // its shared-memory offset in a stage, bytes
    int c8;           // 8c: the chunk's first k within a slab
    unsigned rows;    // bit i: row tid / 8 + 16i is below nb
};

__device__ __forceinline__ R64Stage r64_stage_of(const bf16* x, int nb, int k) {
    const int tid = threadIdx.x, r0 = tid >> 3, c = tid & 7;
    R64Stage st;
    st.src = x + (u64)r0 * k + 8 * c;
    st.dst = (u32)(r0 * 8 + (c ^ (r0 & 7))) * 16;
    st.c8 = 8 * c;
    st.rows = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) st.rows |= (r0 + 16 * i < nb ? 1u : 0u) << i;
    return st;
}

// Stages slab s (k = 64s ..) of rows < nb into the stage at shared address `stage` (zeros past
// nb and k).
__device__ __forceinline__ void r64_stage(u32 stage, const R64Stage& st, const bf16* x, int k, int s) {
    const int kk = s * 64 + st.c8;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const bool in = (st.rows >> i & 1u) && kk < k;
        sp_cp_async16(stage + st.dst + i * 16 * 8 * 16, in ? (const void*)(st.src + (u64)16 * i * k + s * 64) : (const void*)x,
                      in ? 16 : 0);
    }
}

// 16 bytes of shared memory at byte address `at`.
__device__ __forceinline__ uint4 r64_lds(u32 at) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at));
    return v;
}

template <bool SILU, bool SPLIT>
__device__ __forceinline__ void gemv_rows64_body(const bf16* x, const bf16* w, int n, int k, int nb, bf16* y0, int n0,
                                                 bf16* y1, int n1, bf16* y2, int n2, bf16* y3, float* sums) {
    __shared__ __align__(16) uint4 xs[R64_STAGES][64 * 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * R64_W + warp, inter = n / 2;
    // This warp's weight rows: M-tile rows g and g + 8, or output j's gate and up rows.
    const bf16 *row0, *row1;
    if (SILU) {
        const int j = min(tile * 8 + g, inter - 1);
        row0 = w + (u64)j * k;
        row1 = w + (u64)(inter + j) * k;
    } else {
        row0 = w + (u64)min(tile * 16 + g, n - 1) * k;
        row1 = w + (u64)min(tile * 16 + g + 8, n - 1) * k;
    }
    const int ntiles = (nb + 7) >> 3, slabs = (k + 63) / 64;
    // This block's chains: first_chain .. end_chain - 1, one after another.
    const int parts = SPLIT ? gridDim.y : 1, first_chain = blockIdx.y * 16 / parts, end_chain = (blockIdx.y + 1) * 16 / parts;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto load_w = [&](int s, uint4 (&a)[2][2]) {
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int kk = s * 64 + (t * 2 + p) * 8;
            const bool in = kk < k;
            a[p][0] = in ? __ldg((const uint4*)(row0 + kk)) : zero;
            a[p][1] = in ? __ldg((const uint4*)(row1 + kk)) : zero;
        }
    };
    const R64Stage sto = r64_stage_of(x, nb, k);
    const u32 xs0 = sp_smem_addr(xs[0]);
    // Where this lane reads pack p of activation row g of N-tile 0 in a stage (tile nt: + 1024·nt).
    const u32 xoff[2] = {(u32)(g * 8 + ((t * 2) ^ g)) * 16, (u32)(g * 8 + ((t * 2 + 1) ^ g)) * 16};
    constexpr u32 STAGE_BYTES = 64 * 8 * 16;
    // Step j runs slab sj (chains in order, each chain's slabs in order); `staged` is the slab
    // the next stage takes, R64_STAGES − 1 steps ahead.
    int steps = SPLIT ? 0 : slabs;
    if (SPLIT)
        for (int ch = first_chain; ch < end_chain; ch++) steps += ch < slabs ? (slabs - ch + 15) / 16 : 0;
    // The first slab's weights are asked for before the PDL wait (they are no earlier kernel's
    // output), so a block that lands in the previous product's tail streams at once.
    uint4 a[2][2], an[2][2];
    if (steps > 0) load_w(first_chain, a);
    pdl_start();
    int staged = first_chain;
#pragma unroll
    for (int j = 0; j < R64_STAGES - 1; j++) {
        if (j < steps) {
            r64_stage(xs0 + j * STAGE_BYTES, sto, x, k, staged);
            staged = r64_next(staged, slabs);
        }
        sp_cp_commit();
    }
    float total[8][4], c[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) total[nt][i] = c[nt][i] = 0.0f;
    // Chain `chain` ends: its sum joins the total (one part) or goes to `sums`.
    int chain = first_chain;
    const int m_rows = 64 * gridDim.x, nbp = ntiles * 8;
    auto chain_ends = [&]() {
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                total[nt][i] += c[nt][i];
                c[nt][i] = 0.0f;
            }
        chain++;
    };
    int sj = first_chain;  // this step's slab
    for (int j = 0; j < steps; j++) {
        // A chain's first slab (s < 16) ends the chain before it.
        if (j > 0 && sj < 16) chain_ends();
        const int snext = r64_next(sj, slabs);
        if (j + 1 < steps) load_w(snext, an);
        r64_cp_wait<R64_STAGES - 2>();
        __syncthreads();
        const u32 stage = xs0 + (j % R64_STAGES) * STAGE_BYTES;
        // Two N-tiles at a time, each tile's two MMAs apart (the same sums in the same order
        // for every tile: pack 0's halves, then pack 1's).
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const uint4 lo = a[p][0], hi = a[p][1];
#pragma unroll
            for (int nt = 0; nt < 8; nt += 2) {
                if (nt >= ntiles) break;
                const uint4 xa = r64_lds(stage + xoff[p] + nt * 1024);
                const uint4 xb = r64_lds(stage + xoff[p] + (nt + 1) * 1024);
                sp_mma(c[nt], lo.x, hi.x, lo.y, hi.y, xa.x, xa.y);
                sp_mma(c[nt + 1], lo.x, hi.x, lo.y, hi.y, xb.x, xb.y);
                sp_mma(c[nt], lo.z, hi.z, lo.w, hi.w, xa.z, xa.w);
                sp_mma(c[nt + 1], lo.z, hi.z, lo.w, hi.w, xb.z, xb.w);
            }
        }
        // The stage read at step j - 1 is free (every warp passed this step's barrier).
        if (j + R64_STAGES - 1 < steps) {
            r64_stage(xs0 + ((j + R64_STAGES - 1) % R64_STAGES) * STAGE_BYTES, sto, x, k, staged);
            staged = r64_next(staged, slabs);
        }
        sp_cp_commit();
#pragma unroll
        for (int p = 0; p < 2; p++) a[p][0] = an[p][0], a[p][1] = an[p][1];
        sj = snext;
    }
    // The last chain with slabs, then the chains after it (none with slabs: zero sums), as
    // gm_block_sum adds every warp's sum.
    while (chain < end_chain) chain_ends();
    r64_cp_wait<0>();
    if (SPLIT) {
        // This part's group sum, at part blockIdx.y of `sums`.
        float* at = sums + ((size_t)blockIdx.y * m_rows + tile * 16 + g) * nbp + 2 * t;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            if (nt >= ntiles) break;
            *(float2*)(at + nt * 8) = make_float2(total[nt][0], total[nt][1]);
            *(float2*)(at + (size_t)8 * nbp + nt * 8) = make_float2(total[nt][2], total[nt][3]);
        }
        return;
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        if (nt >= ntiles) break;
        if (SILU) {
            // Fragments 0, 1: the gate sums of output j, 2, 3: its up sums (as gemv_silu_mma).
            const int jo = tile * 8 + g;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int b = nt * 8 + 2 * t + i;
                if (jo < inter && b < nb)
                    y0[(size_t)b * inter + jo] = f2bf(silu_times(round_bf(total[nt][i]), round_bf(total[nt][i + 2])));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int o = tile * 16 + g + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * t + (i & 1);
                if (o < n && b < nb) gemv_store(total[nt][i], o, b, y0, n0, y1, n1, y2, n2, y3, n);
            }
        }
    }
}

// y[b, o] = round(x_b · w[o]) for nb ≤ 64 (outputs as gemv_mma8), each row's bits those
// gemv_mma8 gives it.
// launch: grid = ceil(n / (16 · R64_W)), block = 32 * R64_W, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * R64_W)
gemv_rows64(const bf16* x, const bf16* w, int n, int k, int nb, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2,
            bf16* y3) {
    gemv_rows64_body<false, false>(x, w, n, k, nb, y0, n0, y1, n1, y2, n2, y3, nullptr);
}

// gemv_rows64's group sums, one group a part (gridDim.y: 2, 4, 8 or 16); then gemv_chain_sums.
// launch: grid = (ceil(n / (16 · R64_W)), parts), block = 32 * R64_W, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * R64_W)
gemv_rows64_parts(const bf16* x, const bf16* w, int n, int k, int nb, float* sums) {
    gemv_rows64_body<false, true>(x, w, n, k, nb, nullptr, 0, nullptr, 0, nullptr, 0, nullptr, sums);
}

// gemv_silu_mma8's product for nb ≤ 64 rows: y[b·inter + j] = round(round(silu(g)) · u).
// launch: grid = ceil(inter / (8 · R64_W)), block = 32 * R64_W, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * R64_W)
gemv_silu_rows64(const bf16* x, const bf16* w, bf16* y, int inter, int k, int nb) {
    gemv_rows64_body<true, false>(x, w, 2 * inter, k, nb, y, 0, nullptr, 0, nullptr, 0, nullptr, nullptr);
}

// gemv_silu_rows64's group sums over gridDim.y parts; then gemv_chain_sums.
// launch: grid = (ceil(inter / (8 · R64_W)), parts), block = 32 * R64_W, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * R64_W)
gemv_silu_rows64_parts(const bf16* x, const bf16* w, int inter, int k, int nb, float* sums) {
    gemv_rows64_body<true, true>(x, w, 2 * inter, k, nb, nullptr, 0, nullptr, 0, nullptr, 0, nullptr, sums);
}

// The outputs of a gemv_rows64 (silu = 0; n outputs) or gemv_silu_rows64 (silu = 1; n = 2 · inter)
// launch split into parts: each output's `parts` group sums (`sums`, rows m_rows apart a part)
// added in order to a total from 0, then stored as the one-block launch stores it. A thread
// takes four neighbouring activation rows of an output (16-byte loads; nbp is a multiple of 8).
// launch: grid = ceil(outputs · nbp / 1024), block = 256, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(256)
gemv_chain_sums(const float* sums, int m_rows, int parts, int n, int nb, int silu, bf16* y0, int n0, bf16* y1,
                int n1, bf16* y2, int n2, bf16* y3) {
    const int nbp = (nb + 7) & ~7, outs = silu ? n / 2 : n;
    const u64 idx = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    const int b0 = (int)(idx % nbp), o = (int)(idx / nbp);
    pdl_start();
    if (o >= outs || b0 >= nb) return;
    // Output o's MMA row: M-tile o / 16 (o / 8 of SiLU outputs, whose up sums are 8 rows on).
    const int m = silu ? (o >> 3) * 16 + (o & 7) : o;
    const size_t chain_stride = (size_t)m_rows * nbp;
    const float* at = sums + (size_t)m * nbp + b0;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f), u = s;
#pragma unroll 4
    for (int ch = 0; ch < parts; ch++) {
        const float4 v = *(const float4*)(at + ch * chain_stride);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
        if (silu) {
            const float4 w = *(const float4*)(at + ch * chain_stride + 8 * nbp);
            u.x += w.x, u.y += w.y, u.z += w.z, u.w += w.w;
        }
    }
    const float sv[4] = {s.x, s.y, s.z, s.w}, uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int b = b0 + i;
        if (b >= nb) break;
        if (silu)
            y0[(size_t)b * outs + o] = f2bf(silu_times(round_bf(sv[i]), round_bf(uv[i])));
        else
            gemv_store(sv[i], o, b, y0, n0, y1, n1, y2, n2, y3, n);
    }
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

// ---- 4-bit weights (W4A16) ----
// A [n, k] matrix of 4-bit values q, eight to a word along k (word j of a row: inputs 8j..8j + 7,
// input 8j + 2p at bits 4p and 8j + 2p + 1 at bits 16 + 4p: memory.rs's interleave_w4), each
// row's k / g groups with a word: the bf16 scale s in its low half and the bf16 value
// −(128 + z) of its zero z (a whole number, 0 to 16) in its high half: the weight is
// bf16((q − z)·s), the value the CPU holds for it. k is a multiple of 128 and g of 32 (the host
// packs no other shape: sala_model::memory::packs_w4).
// Held slab-major (memory.rs's w4_records): M-tile T (rows 16T..16T + 15, past n zero) and slab
// S (inputs 128S..128S + 127) are one record of rec = 256 + 16·slots words at (T·slabs + S)·rec,
// slots = 1 when 128 divides g, else 4. Row r's word j of the slab lies at
// (r >> 3)·128 + ((r & 7)·4 + (j >> 2))·4 + (j & 3) (r within the tile), so lane (g, t) of a
// warp reads rows g and g + 8's inputs 32t..32t + 31 as the uint4s at h·512 + lane·16 bytes, a
// slab's 1 KB in two loads of consecutive 16 bytes; then the group words, row r's at
// 256 + r·slots + (t mod slots) (the group of the slab's inputs 32t.. of that row).

// Where row r's words for lane quarter t (inputs 32t..32t + 31 of a slab) and its group word for
// them lie in its record.
__device__ __forceinline__ u32 w4_rec_words(int r, int t) {
    return ((r & 15) >> 3) * 128 + (((r & 7) << 2) + t) * 4;
}
__device__ __forceinline__ u32 w4_rec_group(int r, int t, int slots) {
    return 256 + (r & 15) * slots + (t & (slots - 1));
}
__device__ __forceinline__ int w4_slots(int g) { return (g & 127) ? 4 : 1; }

// Weights 2p and 2p + 1 of a word as a bf16 pair: a shift and one lop3 ((w >> 4p) & 0x000F000F
// | 0x43004300; written as C, the mask and the OR become two) put 128 + q in each half, one
// packed FMA with −(128 + z) gives q − z exactly, a second the product with s rounded once.
__device__ __forceinline__ u32 w4_pair(u32 w, int p, u32 s2, u32 b2) {
    u32 q, d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(q) : "r"(w >> (4 * p)), "n"(0x000F000F), "n"(0x43004300));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(q), "r"(0x3F803F80u), "r"(b2));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(d), "r"(s2), "r"(0x80008000u));
    return d;
}

// The 8 bf16 weights of one word (a 16-byte pack of gemv_mma_tiles_body).
__device__ __forceinline__ uint4 w4_pack(u32 w, u32 s2, u32 b2) {
    return make_uint4(w4_pair(w, 0, s2, b2), w4_pair(w, 1, s2, b2), w4_pair(w, 2, s2, b2), w4_pair(w, 3, s2, b2));
}

// A warp's 4-bit weights for one slab (128 k) of rows row[0], row[1]: lane t's 32 consecutive k
// of each (one 16-byte load of words), with their group's word of scale and bias. With PAIRED
// they are made bf16x2 pairs as loaded; else the word stays as loaded until its slab makes the
// pairs, so the warp does not wait for the loads of its next slab before it multiplies the
// current one (a third of gemv_w4_8's stall samples; gemv_w4_16 pairs them at once, as it
// spills more the other way).
template <bool PAIRED>
struct W4Slab {
    uint4 raw[2];
    u32 sb[2], bi[2];  // PAIRED: the scale and bias pairs; else sb holds the loaded word
    __device__ __forceinline__ u32 scale2(int h) const { return PAIRED ? sb[h] : __byte_perm(sb[h], 0, 0x1010); }
    __device__ __forceinline__ u32 bias2(int h) const { return PAIRED ? bi[h] : __byte_perm(sb[h], 0, 0x3232); }
};

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

// y = round(x · w[o]) over a 4-bit matrix (k a multiple of 128: a slab's MMAs take the whole
// warp; the host holds other shapes as bf16) for nb ≤ 8·NT rows, outputs as gemv: M-tiles of 16
// weight rows, a block running tiles blockIdx.x, + gridDim.x, ... in turn. Warp w takes slabs w,
// w + 16, ... (128 k each) in order, each word made 8 bf16 weights in registers and multiplied
// with the MMAs of gemv_mma_tiles_body (the same pairing of weights and activations), and asks for its
// next slab's words (this tile's, else the next tile's first) before it multiplies the current;
// the warps' sums are added in warp order, so a row's result does not depend on nb.
// SILU: w is [gate; up] (n = 2·inter, inter a multiple of 8), each M-tile 8 gate rows j..j + 7
// and their up rows, and y0 gets round(round(silu(round(g))) · round(u)), what silu_mul_halves
// makes of the product's rows (a row's sum does not depend on the tile it is in).
// NORM (NT = 1, nb = 1): x is made in the block from nm (gm_add_norm_row), in dynamic shared
// memory (2·k bytes).
template <int NT, bool SILU, bool NORM = false>
__device__ __forceinline__ void gemv_w4_body(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0,
                                             int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3,
                                             const GmNorm& nm = GmNorm{}) {
    static_assert(!NORM || NT == 1, "a normed product takes one row");
    extern __shared__ uint4 gm_norm_rows[];
    // The warps' sums in two buffers, tiles taking turns, as gemv_mma_tiles_body; gemv_w4_16
    // keeps one and a second barrier a tile (the turn's register would make it spill).
    constexpr int BUFS = NT == 1 ? 2 : 1;
    __shared__ float red[BUFS][GM_WARPS][NT * 128];
    int turn = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gl = lane >> 2, t = lane & 3;
    const int inter = n / 2, tiles = SILU ? (inter + 7) / 8 : (n + 15) / 16, slabs = (k + 127) / 128;
    const int slots = w4_slots(g);
    const u32 rec_words = 256 + 16 * slots, tile_words = slabs * rec_words;
    using Slab = W4Slab<(NT > 1)>;
    // In a record (at rec + o), the lane's words of the tile's first 8 rows lie at wl + o and
    // its rows' group word at gw + o; of its second 8 rows, 128 and 8·slots further on. The
    // 1-8-row products keep the slab in hand as running offsets: rows 16·tile.. of one record at
    // wl + ro[0] (the second 8 rows' words 128 on, group words 8·slots on); SILU's gate rows
    // 8·tile.. and up rows inter + 8·tile.. (inter a multiple of 8), each 8 rows of its own
    // record, words at rec + ro[h] and group word at rec + ro[h] + gd[h] (fewer registers than
    // pointers). A warp's next slab of the same tile is GM_WARPS records on: an add or two, not
    // the offsets' derivation from tile and slab (3-5% faster a product, H100). The 9-16-row
    // products, short of registers, derive them for every slab.
    constexpr bool RUNNING = NT == 1;
    const u32* wl = rec + lane * 4;
    const u32* gw = rec + 256 + gl * slots + (t & (slots - 1));
    u32 ro[2];
    int gd[2];
    auto first = [&](int tile, int s) {  // the running offsets at slab s of a tile
        if (!SILU) {
            ro[0] = tile * tile_words + s * rec_words;
            return;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 b = (u32)(h * inter >> 3) + tile, half = b & 1;
            ro[h] = (b >> 1) * tile_words + s * rec_words + half * 128 + lane * 4;
            gd[h] = (int)(256 + gl * slots + (t & (slots - 1)) - lane * 4) + (int)half * (8 * slots - 128);
        }
    };
    auto load_words = [&](Slab& a, int h, const u32* words, const u32* group) {
        a.raw[h] = __ldg((const uint4*)words);
        const u32 w = __ldg(group);
        a.sb[h] = NT > 1 ? __byte_perm(w, 0, 0x1010) : w;
        if (NT > 1) a.bi[h] = __byte_perm(w, 0, 0x3232);
    };
    auto load = [&](Slab& a) {  // the slab at the running offsets
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (SILU)
                load_words(a, h, rec + ro[h], rec + (ro[h] + gd[h]));
            else
                load_words(a, h, wl + ro[0] + 128 * h, gw + ro[0] + 8 * slots * h);
        }
    };
    auto load_at = [&](int tile, int s, Slab& a) {  // slab s of a tile, its offsets derived
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 b = SILU ? (u32)(h * inter >> 3) + tile : 2 * tile + h;
            const u32 base = (b >> 1) * tile_words + s * rec_words, half = b & 1;
            load_words(a, h, rec + (base + half * 128 + lane * 4),
                       rec + (base + 256 + (half * 8 + gl) * slots + (t & (slots - 1))));
        }
    };
    // Lane columns past nb read row nb − 1 (their sums are not stored), so no load is predicated;
    // the lane's inputs of slab s lie at xr[nt] + kk, kk = 128·s (+ 32·t but in gemv_w4_8).
    const bf16* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = x + (size_t)min(nt * 8 + gl, nb - 1) * k + (RUNNING && !SILU ? t * 32 : 0);
    Slab a, an;
    if (RUNNING) first(blockIdx.x, warp);
    if ((int)blockIdx.x < tiles && warp < slabs) {
        if (RUNNING)
            load(a);
        else
            load_at(blockIdx.x, warp, a);
    }
    pdl_start();
    if (NORM) gm_add_norm_row(nm, k, gm_norm_rows);
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[nt][i] = 0.0f;
        // Slab s from cur, after asking for the warp's next slab (this tile's, else the next
        // tile's first) into nxt; the loop takes two a turn, so the two buffers swap roles
        // without copies.
        auto slab = [&](const Slab& cur, Slab& nxt, int s) {
            if (!RUNNING) {
                if (s + GM_WARPS < slabs)
                    load_at(tile, s + GM_WARPS, nxt);
                else if (tile + (int)gridDim.x < tiles)
                    load_at(tile + gridDim.x, warp, nxt);
            } else if (s + GM_WARPS < slabs) {
                ro[0] += GM_WARPS * rec_words;
                if (SILU) ro[1] += GM_WARPS * rec_words;
                load(nxt);
            } else if (tile + (int)gridDim.x < tiles) {
                first(tile + gridDim.x, warp);
                load(nxt);
            }
            const int kk = s * 128 + (RUNNING && !SILU ? 0 : t * 32);
            const u32 lo_w[4] = {cur.raw[0].x, cur.raw[0].y, cur.raw[0].z, cur.raw[0].w};
            const u32 hi_w[4] = {cur.raw[1].x, cur.raw[1].y, cur.raw[1].z, cur.raw[1].w};
#pragma unroll
            for (int p = 0; p < 4; p++) {
                const uint4 lo = w4_pack(lo_w[p], cur.scale2(0), cur.bias2(0));
                const uint4 hi = w4_pack(hi_w[p], cur.scale2(1), cur.bias2(1));
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 x8 = NORM ? gm_norm_rows[gm_x_slot(s * 16 + t * 4 + p)]
                                          : __ldg((const uint4*)(xr[nt] + kk + 8 * p));
                    sp_mma(c[nt], lo.x, hi.x, lo.y, hi.y, x8.x, x8.y);
                    sp_mma(c[nt], lo.z, hi.z, lo.w, hi.w, x8.z, x8.w);
                }
            }
        };
        gm_slab_turns(slabs, a, an, slab, [](Slab& to, const Slab& from) { to = from; });
        const int v = threadIdx.x;
        if (SILU) {
            // Gate sums are fragments 0, 1 and up sums 2, 3 of the same lane (as gemv_silu_mma).
            const int nt = v >> 6, i = (v >> 5) & 1, l = v & 31, vg = nt * 128 + i * 32 + l;
            const float gs = gm_block_sum<NT>(red[turn], c, v < NT * 64 ? vg : NT * 128, 1);
            const float us = v < NT * 64 ? gm_grouped_sum(&red[turn][0][vg + 64], NT * 128, 1) : 0.0f;
            const int j = tile * 8 + (l >> 2), b = nt * 8 + 2 * (l & 3) + i;
            if (v < NT * 64 && j < inter && b < nb)
                y0[(u64)b * inter + j] = f2bf(silu_times(round_bf(gs), round_bf(us)));
        } else {
            const float sum = gm_block_sum<NT>(red[turn], c, v, 1);
            const int nt = v >> 7, i = (v >> 5) & 3, l = v & 31;
            const int o = tile * 16 + (l >> 2) + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * (l & 3) + (i & 1);
            if (v < NT * 128 && o < n && b < nb) gemv_store(sum, o, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
        if (BUFS == 2)
            turn ^= 1;
        else
            __syncthreads();  // red is free for the next tile
    }
    if (NORM) gm_store_residual(nm, k);
}

// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_w4_8(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0, int n0, bf16* y1, int n1,
          bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_w4_body, after its first weights are asked for)
    gemv_w4_body<1, false>(x, rec, n, k, g, nb, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_w4_8 for nb ≤ 16, held to 64 registers for two blocks an SM (free it needs more: one
// block an SM, 10% slower at 16 rows on an H100; held, it spills a word once a tile, outside
// the slab loop).
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_w4_16(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0, int n0, bf16* y1, int n1,
           bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_w4_body, after its first weights are asked for)
    gemv_w4_body<2, false>(x, rec, n, k, g, nb, y0, n0, y1, n1, y2, n2, y3);
}

// The SiLU product of a 4-bit [gate; up] ([2·inter, k]): y[b·inter + j] for nb ≤ 8 rows.
// launch: grid = min(ceil(inter / 8), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_8(const bf16* x, const u32* rec, bf16* y, int inter, int k, int g, int nb) {
    gemv_w4_body<1, true>(x, rec, 2 * inter, k, g, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// gemv_silu_w4_8 of one row made from the residual h and branch as add_rms_norm makes it
// (GmNorm): h += round(branch·scale) (stored by the block that ends last), a = RMSNorm(h)·w, y
// the SiLU product of a. k ≤ 8192, a multiple of 128.
// launch: as gemv_silu_w4_8, dynamic smem = 2·k bytes; ticket 0 (and left 0)
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_8_norm(const u32* rec, bf16* y, int inter, int k, int g, bf16* h, const bf16* branch, float scale,
                    const bf16* w, float eps, bf16* a, u32* ticket) {
    const GmNorm nm{h, branch, scale, w, eps, a, ticket};
    gemv_w4_body<1, true, true>(a, rec, 2 * inter, k, g, 1, y, 0, nullptr, 0, nullptr, 0, nullptr, nm);
}

// gemv_silu_w4_8 for nb ≤ 16 (held as gemv_w4_16).
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_16(const bf16* x, const u32* rec, bf16* y, int inter, int k, int g, int nb) {
    gemv_w4_body<2, true>(x, rec, 2 * inter, k, g, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// The bf16 weights of rows r0.. of a 4-bit matrix: out[r][i] for `words` words (rows · k / 8),
// for a cuBLAS product of a prefill chunk.
// launch: grid = ceil(words / 256), block = 256, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(256)
dequant_w4(const u32* rec, int r0, int k, int g, u64 words, bf16* out) {
    pdl_start();
    const u64 i = (u64)blockIdx.x * 256 + threadIdx.x;
    if (i >= words) return;
    const int per_row = k / 8, slots = w4_slots(g), rec_words = 256 + 16 * slots;
    const int row = r0 + (int)(i / per_row), j = (int)(i % per_row), t = (j >> 2) & 3;
    const u64 base = ((u64)(row >> 4) * (k / 128) + (j >> 4)) * rec_words;
    const u32 gw = rec[base + w4_rec_group(row, t, slots)];
    const u32 s2 = __byte_perm(gw, 0, 0x1010), b2 = __byte_perm(gw, 0, 0x3232);
    const u32 w = rec[base + w4_rec_words(row, t) + (j & 3)];
    u32* o = (u32*)(out + i * 8);
#pragma unroll
    for (int e = 0; e < 4; e++) o[e] = w4_pair(w, e, s2, b2);
}

// ---- FP8 weights (`--quantize fp8`): E4M3 codes with a scale per weight row, inputs as E4M3 ----
// y[b][o] = round((Σ_i e4m3(x[b][i]·inv_b) · code[o][i]) · xs[b] · ws[o]), inv_b = 1 / xs[b],
// xs[b] = f8_scale(amax of row b) (sala_model::Fp8Matrix's product). The decode products run on
// E4M3 tensor cores from 8.9 on, on f16 ones before (E4M3 values are exact in f16, times
// F8_F16_UNIT each).

// Each of `rows` rows of x (k apart, k a multiple of 8) as FP8 at its own scale: its codes
// (`codes`, when not NULL), their bf16 values (`values`, when not NULL), its scale.
// launch: grid = rows, block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
quant_rows_f8(const bf16* x, int k, unsigned char* codes, bf16* values, float* scales) {
    pdl_start();
    __shared__ float red[8];
    const size_t row = blockIdx.x;
    const bf16* xr = x + row * k;
    float amax = 0.0f;
    for (int i = threadIdx.x * 8; i < k; i += 256 * 8) {
        amax = fmaxf(amax, amax8(*(const uint4*)(xr + i)));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
    __syncthreads();
    // Every warp reduces the eight warps' maxima, so each has the row's.
    amax = warp_max((threadIdx.x & 31) < 8 ? red[threadIdx.x & 31] : 0.0f);
    const float scale = f8_scale(amax), inv = __fdiv_rn(1.0f, scale);
    for (int i = threadIdx.x * 8; i < k; i += 256 * 8) {
        const uint4 v = *(const uint4*)(xr + i);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        u32 c[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            c[j] = e4m3x2_code(bf2f((bf16)(w[j] & 0xffffu)) * inv, bf2f((bf16)(w[j] >> 16)) * inv);
        if (codes) *(uint2*)(codes + row * k + i) = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        if (values) {
            u32 o[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                o[j] = (__float_as_uint(e4m3_value(c[j] & 0xffu)) >> 16) |
                       (__float_as_uint(e4m3_value(c[j] >> 8)) & 0xffff0000u);
            *(uint4*)(values + row * k + i) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

// sm_90 and sm_100 have no mma.sync for E4M3 (ptxas makes it F2FP conversions, two f16 MMAs
// from zero and adds): there the codes' f16 values (cvt, exact) go through two f16 MMAs that
// sum into d in f32 directly, as the bf16 products do.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
#define F8_AS_F16 1
#else
#define F8_AS_F16 0
#endif

#if F8_AS_F16
// Four E4M3 codes as two f16 pairs (codes 0-1, codes 2-3), exact: the word's 16-bit halves
// converted as they are (no shifts).
__device__ __forceinline__ void e4m3x4_f16(u32 c, u32 (&h)[2]) {
    asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, u;\n}\n"
        : "=r"(h[0]), "=r"(h[1])
        : "r"(c));
}
#endif

// d += A·B for one k32 step of E4M3 codes: A's rows g and g + 8 (words a_lo, a_hi: bytes
// 0..3 of each are k slots 4t..4t + 3, bytes 4..7 slots 16 + 4t ..), B's column g the same way.
// From 8.9 on one E4M3 MMA, before it two f16 ones over the codes' exact values (times
// F8_F16_UNIT); either way the step's sum starts from zero and is added to d on the CUDA cores,
// so the tensor cores' narrow FP8 accumulation never carries across steps. On sm_90 and sm_100
// (F8_AS_F16) the two f16 MMAs sum into d directly (f32 accumulation). The products are exact.
__device__ __forceinline__ void f8_mma_k32(float (&d)[4], uint2 a_lo, uint2 a_hi, uint2 b) {
#if F8_AS_F16
    u32 al[2][2], ah[2][2], bb[2][2];  // [word][half]: f16 pairs of codes 0-1 and 2-3
    e4m3x4_f16(a_lo.x, al[0]);
    e4m3x4_f16(a_lo.y, al[1]);
    e4m3x4_f16(a_hi.x, ah[0]);
    e4m3x4_f16(a_hi.y, ah[1]);
    e4m3x4_f16(b.x, bb[0]);
    e4m3x4_f16(b.y, bb[1]);
#pragma unroll
    for (int w = 0; w < 2; w++) sp_mma_f16(d, al[w][0], ah[w][0], al[w][1], ah[w][1], bb[w][0], bb[w][1]);
    return;
#endif
    float e[4];
#if F8_HW
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(e[0]), "=f"(e[1]), "=f"(e[2]), "=f"(e[3])
        : "r"(a_lo.x), "r"(a_hi.x), "r"(a_lo.y), "r"(a_hi.y), "r"(b.x), "r"(b.y), "f"(0.0f));
#else
#pragma unroll
    for (int i = 0; i < 4; i++) e[i] = 0.0f;
    sp_mma_f16(e, e4m3x2_f16(a_lo.x), e4m3x2_f16(a_hi.x), e4m3x2_f16(a_lo.x >> 16), e4m3x2_f16(a_hi.x >> 16),
               e4m3x2_f16(b.x), e4m3x2_f16(b.x >> 16));
    sp_mma_f16(e, e4m3x2_f16(a_lo.y), e4m3x2_f16(a_hi.y), e4m3x2_f16(a_lo.y >> 16), e4m3x2_f16(a_hi.y >> 16),
               e4m3x2_f16(b.y), e4m3x2_f16(b.y >> 16));
#endif
#pragma unroll
    for (int i = 0; i < 4; i++) d[i] += e[i];
}

// A warp's weights for one slab (128 k) of M-tile rows row[0], row[1]: lane (g, t) takes 2 packs
// of 16 consecutive codes of each (zeros past k); its activation rows' codes at the same k.
__device__ __forceinline__ void f8_load_w(const unsigned char* const (&row)[2], int k, int s, uint4 (&a)[2][2]) {
    const int t = threadIdx.x & 3;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int kk = s * 128 + (t * 2 + p) * 16;
#pragma unroll
        for (int h = 0; h < 2; h++) a[p][h] = kk < k ? __ldg((const uint4*)(row[h] + kk)) : zero;
    }
}

// y = round(Σ codes · xs[b] · ws[o]) for M-tiles of 16 weight rows, activations as E4M3 codes xc
// (nb ≤ 8·NT rows, k apart) with their scales xs (quant_rows_f8); outputs as gemv. A row's result
// does not depend on nb: warp w takes slabs w, w + 16, ... in order, each slab's four k32 steps on
// E4M3 tensor cores (f8_mma_k32), and the warps' sums are added in warp order. A block runs M-tiles
// blockIdx.x, + gridDim.x, ... in turn, each warp asking for its next slab's weights (this tile's,
// or the next tile's first) before it multiplies the current one, so the weights stream while a
// tile's sums are added and stored; the first ones are asked for before the PDL wait.
// SILU: w is [gate; up] (n = 2·inter, inter a multiple of 8), each M-tile 8 gate rows j..j + 7
// and their up rows, and
// y0 gets round(round(silu(round(g))) · round(u)) (the product, then silu_mul_halves).
template <int NT, bool SILU>
__device__ __forceinline__ void gemv_f8_body(const unsigned char* xc, const float* xs, const unsigned char* w,
                                             const float* ws, int n, int k, int nb, bf16* y0, int n0, bf16* y1,
                                             int n1, bf16* y2, int n2, bf16* y3) {
    // Two buffers of the warps' sums, tiles taking turns: a warp writes a buffer only after the
    // barrier of the tile between, which every thread passes after reading it, so one barrier a
    // tile (gm_block_sum's) suffices.
    __shared__ float red[2][GM_WARPS][NT * 128];
    int turn = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tile_rows = SILU ? 8 : 16, g = lane >> 2, inter = n / 2;
    const int tiles = ((SILU ? inter : n) + tile_rows - 1) / tile_rows;
    const int slabs = (k + 127) / 128;
    auto rows_of = [&](int tile, const unsigned char* (&rows)[2]) {
        const int m0 = tile * tile_rows;
        const int r0 = SILU ? min(m0 + g, inter - 1) : min(m0 + g, n - 1);
        const int r1 = SILU ? inter + r0 : min(m0 + g + 8, n - 1);
        rows[0] = w + (u64)r0 * k;
        rows[1] = w + (u64)r1 * k;
    };
    // Lane columns past nb read row nb − 1 (their sums are not stored).
    const unsigned char* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = xc + (u64)min(nt * 8 + g, nb - 1) * k;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int t = lane & 3;
    uint4 a[2][2], an[2][2];
    const unsigned char* rows[2];
    rows_of(blockIdx.x, rows);
    if ((int)blockIdx.x < tiles) f8_load_w(rows, k, warp, a);
    pdl_start();
    const float unit = 1.0f / (F8_F16_UNIT * F8_F16_UNIT);  // the MMAs summed values times F8_F16_UNIT²
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[nt][i] = 0.0f;
        // Slab s from cur, after asking for the warp's next slab (this tile's, else the first of
        // the block's next tile) into nxt; two a turn, so the buffers swap roles without copies.
        auto slab = [&](const uint4 (&cur)[2][2], uint4 (&nxt)[2][2], int s) {
            uint4 b[2][NT];
#pragma unroll
            for (int p = 0; p < 2; p++) {
                const int kk = s * 128 + (t * 2 + p) * 16;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) b[p][nt] = kk < k ? __ldg((const uint4*)(xr[nt] + kk)) : zero;
            }
            const int ns = s + GM_WARPS < slabs ? s + GM_WARPS : warp;
            const int ntile = s + GM_WARPS < slabs ? tile : tile + (int)gridDim.x;
            if (ntile < tiles) {
                const unsigned char* nrows[2];
                rows_of(ntile, nrows);
                f8_load_w(nrows, k, ns, nxt);
            }
#pragma unroll
            for (int p = 0; p < 2; p++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 lo = cur[p][0], hi = cur[p][1], x = b[p][nt];
                    f8_mma_k32(c[nt], make_uint2(lo.x, lo.y), make_uint2(hi.x, hi.y), make_uint2(x.x, x.y));
                    f8_mma_k32(c[nt], make_uint2(lo.z, lo.w), make_uint2(hi.z, hi.w), make_uint2(x.z, x.w));
                }
        };
        gm_slab_turns(slabs, a, an, slab, [](uint4(&to)[2][2], const uint4(&from)[2][2]) {
#pragma unroll
            for (int p = 0; p < 2; p++) to[p][0] = from[p][0], to[p][1] = from[p][1];
        });
        const int v = threadIdx.x, m0 = tile * tile_rows;
        if (SILU) {
            // Gate sums are fragments 0, 1 and up sums 2, 3 of the same lane (as gemv_silu_mma).
            const int nt = v >> 6, i = (v >> 5) & 1, l = v & 31, vg = nt * 128 + i * 32 + l;
            const float gs = gm_block_sum<NT>(red[turn], c, v < NT * 64 ? vg : NT * 128, 1);
            const float us = v < NT * 64 ? gm_grouped_sum(&red[turn][0][vg + 64], NT * 128, 1) : 0.0f;
            const int j = m0 + (l >> 2), b = nt * 8 + 2 * (l & 3) + i;
            if (v < NT * 64 && j < inter && b < nb)
                y0[(u64)b * inter + j] = f2bf(
                    silu_times(round_bf(gs * unit * xs[b] * ws[j]), round_bf(us * unit * xs[b] * ws[inter + j])));
        } else {
            const float s = gm_block_sum<NT>(red[turn], c, v, 1);
            const int nt = v >> 7, i = (v >> 5) & 3, l = v & 31;
            const int o = m0 + (l >> 2) + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * (l & 3) + (i & 1);
            if (v < NT * 128 && o < n && b < nb)
                gemv_store(s * unit * xs[b] * ws[o], o, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
        turn ^= 1;
    }
}

// nb ≤ 8 activation rows as E4M3 codes and scales (k a multiple of 16), outputs as gemv.
// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_f8_8(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, int n, int k, int nb,
          bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<1, false>(xc, xs, w, ws, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_f8_8 for nb ≤ 16.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_f8_16(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, int n, int k, int nb,
           bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<2, false>(xc, xs, w, ws, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
}

// The MLP's first half on an FP8 [gate; up] matrix ([2·inter, k]) for nb ≤ 8 rows (codes and
// scales as gemv_f8_8): y[b·inter + j] = round(round(silu(g)) · u) of the product's rounded
// outputs g, u.
// launch: grid = min(ceil(inter / 8), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_f8_8(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, bf16* y, int inter,
               int k, int nb) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<1, true>(xc, xs, w, ws, 2 * inter, k, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// gemv_silu_f8_8 for nb ≤ 16.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_f8_16(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, bf16* y,
                int inter, int k, int nb) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<2, true>(xc, xs, w, ws, 2 * inter, k, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// A product's raw sums (bf16 [rows, n], in place) times their row's and column's scales:
// y = round(y · xs[r] · ws[c]) (the FP8 GEMM where cuBLASLt cannot scale by vectors).
// launch: grid = (rows, ceil(n / 2048)), block = 256, dynamic smem = 0 bytes (8 columns a thread)
extern "C" __global__ void __launch_bounds__(256)
scale_rows_cols(bf16* y, const float* xs, const float* ws, int n) {
    pdl_start();
    const int c0 = (blockIdx.y * 256 + threadIdx.x) * 8;
    if (c0 >= n) return;
    const float s = xs[blockIdx.x];
    bf16* yr = y + (u64)blockIdx.x * n;
    if (c0 + 8 <= n && (n & 7) == 0) {
        uint4 v = *(const uint4*)(yr + c0);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float lo = bf2f((bf16)(w[j] & 0xffffu)) * s * ws[c0 + 2 * j];
            const float hi = bf2f((bf16)(w[j] >> 16)) * s * ws[c0 + 2 * j + 1];
            w[j] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
        }
        *(uint4*)(yr + c0) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        for (int c = c0; c < min(n, c0 + 8); c++) yr[c] = f2bf(bf2f(yr[c]) * s * ws[c]);
    }
}

// FP8 codes as bf16 values (unscaled), for cards without FP8 tensor cores.
// launch: grid = ceil(count / 1024), block = 256, dynamic smem = 0 bytes (4 codes a thread)
extern "C" __global__ void __launch_bounds__(256)
dequant_f8(const unsigned char* codes, bf16* out, u64 count) {
    pdl_start();
    const u64 i = ((u64)blockIdx.x * 256 + threadIdx.x) * 4;
    if (i >= count) return;
    if (i + 4 <= count) {
        u32 lo, hi;
        e4m3x4_bf16(*(const u32*)(codes + i), lo, hi);
        *(uint2*)(out + i) = make_uint2(lo, hi);
    } else {
        for (u64 j = i; j < count; j++) out[j] = (bf16)(__float_as_uint(e4m3_value(codes[j])) >> 16);
    }
}
