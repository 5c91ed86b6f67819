// Decode-time products of 17 to 64 activation rows times a bf16 weight matrix (a batched
// decode step of many sequences), each row with the bits it gets alone.

#include "common/types.cuh"
#include "common/fp8.cuh"
#include "common/mma.cuh"
#include "gemv/common.cuh"

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
                const uint4 xa = gm_lds(stage + xoff[p] + nt * 1024);
                const uint4 xb = gm_lds(stage + xoff[p] + (nt + 1) * 1024);
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
