// Block selection for few queries (decode), on tensor cores and spread over the whole GPU:
//   1. sd_lse: per slice of SD_LSE_KEYS level-2 windows, each head's max and Σ exp2 (partial LSEs);
//   2. sd_p:   per slice of SD_KEYS level-1 windows, P = Σ_h exp2(x_h − LSE_h), rounded to bf16;
//   3. sd_topk: one 1024-thread block per (query, KV group): max-pooled block keys, radix
//      select over their 16 bits, and the ascending list (forced blocks, then the best others,
//      ties to the lower index), as sparse_select writes it.
// A warp takes 64 windows as 8 MMA n-tiles of 8 keys; its 16 MMA rows are the query's heads of
// the group (rows ≥ G zero), with Q and K dims permuted alike (sp_load_q_perm / sp_qk_perm).
// Needs heads / kv_heads ≤ 16 and d a multiple of 32, at most 128.

#include "common/types.cuh"
#include "common/rows.cuh"
#include "sparse/common.cuh"

#define SD_WARPS 4
#define SD_KEYS (SD_WARPS * 64)  // windows per block of sd_p (64 a warp)
#define SD_LSE_WARPS 16
#define SD_LSE_KEYS (SD_LSE_WARPS * 16)  // windows per block of sd_lse (16 a warp: more warps in flight)
#define SD_TOPK_THREADS 1024

// sd_topk / sd_topk_scores: the candidates' 16-bit keys, then (sd_topk, staged) P.
extern __shared__ __align__(16) u16 sd_smem[];

// The logits (log2 units) of the warp's 8·NT windows [c0, c0 + 8·NT) of group g of a compressed
// tier: x[j][·] of n-tile j as sp_qk_perm leaves S, −inf for windows ≥ n (and padding rows).
template <int NT>
__device__ __forceinline__ void sd_logits(float (&x)[NT][4], const u32 (&qa)[8][4], const bf16* tier, size_t kvw,
                                          int g, int d, int c0, int n, int G, float sl2) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const float NEG = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int key = min(c0 + 8 * j + gq, n - 1);
        sp_qk_perm(x[j], qa, tier + (size_t)key * kvw + (size_t)g * d, d);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const bool ok = c0 + 8 * j + 2 * tq + (e & 1) < n && gq + 8 * (e >> 1) < G;
            x[j][e] = ok ? x[j][e] * sl2 : NEG;
        }
    }
}

// Pair p = blockIdx.x (query i = p / kv_heads at position t, group g = p % kv_heads): for each
// head h < G, the max m and Σ exp2(x − m) of the log2-unit level-2 logits x over the visible
// windows in [SD_LSE_KEYS·blockIdx.y, +SD_LSE_KEYS), into part[((p·gridDim.y + blockIdx.y)·G + h)·2
// + {0, 1}] (m = −inf, sum 0 where none is visible).
__device__ __forceinline__ void sd_lse_pair(const bf16* q, const bf16* k2, int n2, int t, int heads, int kv_heads,
                                            int d, float scale, int k2_window, int k2_stride, float* part) {
    __shared__ float red[SD_LSE_WARPS][16][2];
    const int p = blockIdx.x, i = p / kv_heads, g = p % kv_heads, G = heads / kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2;
    const int n2v = min(sp_visible(t, k2_window, k2_stride), n2);
    const int c0 = blockIdx.y * SD_LSE_KEYS + 16 * warp;
    const float NEG = -__int_as_float(0x7f800000);
    float m[2] = {NEG, NEG}, l[2] = {0.0f, 0.0f};
    if (c0 < n2v) {  // warp-uniform
        u32 qa[8][4];
        sp_load_q_perm(q + ((size_t)i * heads + (size_t)g * G) * d, G, d, qa);
        float x[2][4];
        sd_logits<2>(x, qa, k2, (size_t)kv_heads * d, g, d, c0, n2v, G, scale * 1.4426950408889634f);
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) m[e >> 1] = fmaxf(m[e >> 1], x[j][e]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 1));
            m[r] = fmaxf(m[r], __shfl_xor_sync(0xffffffffu, m[r], 2));
        }
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (m[e >> 1] != NEG) l[e >> 1] += exp2f(x[j][e] - m[e >> 1]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
            l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        }
    }
    if ((lane & 3) == 0)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            red[warp][gq + 8 * r][0] = m[r];
            red[warp][gq + 8 * r][1] = l[r];
        }
    __syncthreads();
    if (threadIdx.x < G) {
        const int h = threadIdx.x;
        float mm = NEG;
        for (int w = 0; w < SD_LSE_WARPS; w++) mm = fmaxf(mm, red[w][h][0]);
        float ll = 0.0f;
        if (mm != NEG)
            for (int w = 0; w < SD_LSE_WARPS; w++)
                if (red[w][h][0] != NEG) ll += red[w][h][1] * exp2f(red[w][h][0] - mm);
        float* o = part + (((size_t)p * gridDim.y + blockIdx.y) * G + h) * 2;
        o[0] = mm;
        o[1] = ll;
    }
}

// Queries at positions first_pos + i of one sequence.
// launch: grid = (T·kv_heads, ⌈n2 / SD_LSE_KEYS⌉), block = 32·SD_LSE_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SD_LSE_WARPS * 32)
sd_lse(const bf16* q, const bf16* k2, int n2, int first_pos, int heads, int kv_heads, int d, float scale,
       int k2_window, int k2_stride, float* part) {
    pdl_start();
    sd_lse_pair(q, k2, n2, first_pos + blockIdx.x / kv_heads, heads, kv_heads, d, scale, k2_window, k2_stride, part);
}

// One query of each sequence of rows (SeqRows); gridDim.y covers the longest level-2 tier (the
// slices past a shorter one write m = −inf, sum 0, which sd_p's merge skips).
// launch: grid = (T·kv_heads, ⌈max n2 / SD_LSE_KEYS⌉), block = 32·SD_LSE_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SD_LSE_WARPS * 32)
sd_lse_rows(const bf16* q, SeqRows rows, int heads, int kv_heads, int d, float scale, int k2_window, int k2_stride,
            float* part) {
    pdl_start();
    const int i = blockIdx.x / kv_heads;
    sd_lse_pair(q, rows.k2[i], rows.n2[i], rows.pos[i], heads, kv_heads, d, scale, k2_window, k2_stride, part);
}

// P of the visible level-1 windows in [SD_KEYS·blockIdx.y, +SD_KEYS) of pair blockIdx.x, as bf16
// bits into p16[pair·p_stride + x]: Σ_h exp2(x_h − LSE_h) rounded to bf16 (NaN → 0), the LSEs
// combined from the n_split partials of sd_lse (+inf where no level-2 window is visible, so that
// every P is 0). p_stride a multiple of 8 (sd_topk stages rows in 16-byte pieces).
// The query of pair blockIdx.x is at position t.
__device__ __forceinline__ void sd_p_pair(const bf16* q, const bf16* k1, int n1, int t, int heads, int kv_heads,
                                          int d, float scale, int k1_window, int k1_stride, const float* part,
                                          int n_split, u16* p16, int p_stride) {
    __shared__ float lse[16];
    const int p = blockIdx.x, i = p / kv_heads, g = p % kv_heads, G = heads / kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int n1v = min(sp_visible(t, k1_window, k1_stride), n1);
    if (blockIdx.y * SD_KEYS >= n1v) return;  // block-uniform
    const float NEG = -__int_as_float(0x7f800000), INF = __int_as_float(0x7f800000);
    {
        // Head h = tid / 8 (h < 16: SD_WARPS·32 = 128 threads): its 8 threads merge every 8th
        // partial (m, Σ) online, four loads in flight, then merge across the 8, so the loads of a
        // 1M context's 64 partials wait out the memory twice, not 64 times.
        const int h = threadIdx.x >> 3, j = threadIdx.x & 7;
        const float2* pp = (const float2*)(part + (size_t)p * n_split * G * 2) + min(h, G - 1);
        float m = NEG, l = 0.0f;
        auto merge = [&](float ms, float ls) {
            if (ms == NEG) return;
            const float mn = fmaxf(m, ms);
            l = l * exp2f(m - mn) + ls * exp2f(ms - mn);
            m = mn;
        };
        for (int s0 = j; s0 < n_split; s0 += 32) {
            float2 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int sx = s0 + 8 * u;
                v[u] = sx < n_split ? pp[(size_t)sx * G] : make_float2(NEG, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) merge(v[u].x, v[u].y);
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) {
            const float mo = __shfl_xor_sync(0xffffffffu, m, o), lo = __shfl_xor_sync(0xffffffffu, l, o);
            merge(mo, lo);
        }
        // Padding rows and no visible level-2 window: every exp2 is 0.
        if (j == 0) lse[h] = h < G && m != NEG ? m + __log2f(l) : INF;
    }
    __syncthreads();
    const int c0 = blockIdx.y * SD_KEYS + 64 * warp;
    if (c0 >= n1v) return;  // warp-uniform
    u32 qa[8][4];
    sp_load_q_perm(q + ((size_t)i * heads + (size_t)g * G) * d, G, d, qa);
    float x[8][4];
    sd_logits<8>(x, qa, k1, (size_t)kv_heads * d, g, d, c0, n1v, G, scale * 1.4426950408889634f);
    const float lg[2] = {lse[gq], lse[gq + 8]};
    u16* out = p16 + (size_t)p * p_stride;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        // Windows 2tq and 2tq + 1 of n-tile j: the two heads of this lane, then all heads.
        float s[2];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            s[c] = exp2f(x[j][c] - lg[0]) + exp2f(x[j][2 + c] - lg[1]);
            s[c] += __shfl_xor_sync(0xffffffffu, s[c], 4);
            s[c] += __shfl_xor_sync(0xffffffffu, s[c], 8);
            s[c] += __shfl_xor_sync(0xffffffffu, s[c], 16);
        }
        const int x0 = c0 + 8 * j + 2 * tq;
        if (gq == 0 && x0 < n1v) {
            const u32 b0 = (s[0] == s[0]) ? f2bf(s[0]) : 0u, b1 = (s[1] == s[1]) ? f2bf(s[1]) : 0u;
            if (x0 + 1 < n1v) *(u32*)(out + x0) = b0 | (b1 << 16);
            else out[x0] = (u16)b0;
        }
    }
}

// Queries at positions first_pos + i of one sequence.
// launch: grid = (T·kv_heads, ⌈n1 / SD_KEYS⌉), block = 32·SD_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SD_WARPS * 32)
sd_p(const bf16* q, const bf16* k1, int n1, int first_pos, int heads, int kv_heads, int d, float scale,
     int k1_window, int k1_stride, const float* part, int n_split, u16* p16, int p_stride) {
    pdl_start();
    sd_p_pair(q, k1, n1, first_pos + blockIdx.x / kv_heads, heads, kv_heads, d, scale, k1_window, k1_stride, part,
              n_split, p16, p_stride);
}

// One query of each sequence of rows; n_split is sd_lse_rows' gridDim.y.
// launch: grid = (T·kv_heads, ⌈max n1 / SD_KEYS⌉), block = 32·SD_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SD_WARPS * 32)
sd_p_rows(const bf16* q, SeqRows rows, int heads, int kv_heads, int d, float scale, int k1_window, int k1_stride,
          const float* part, int n_split, u16* p16, int p_stride) {
    pdl_start();
    const int i = blockIdx.x / kv_heads;
    sd_p_pair(q, rows.k1[i], rows.n1[i], rows.pos[i], heads, kv_heads, d, scale, k1_window, k1_stride, part,
              n_split, p16, p_stride);
}

// The rank-th largest (1-based) of the n 16-bit keys in smem, 8 bits a pass, and how many keys
// equal to it are among the rank largest (*r_eq). Block-wide; every thread calls. hist: 256 ints.
__device__ __forceinline__ u32 sd_radix_select(const u16* keys, int n, int rank, int* hist, int* sel, int* r_eq) {
    const int tid = threadIdx.x, wid = tid >> 5;
    u32 prefix = 0;
    int kk = rank;
#pragma unroll 1
    for (int pass = 0; pass < 2; pass++) {
        const int shift = 8 - 8 * pass;
        for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int x = tid; x < n; x += blockDim.x) {
            const u32 key = keys[x];
            if (pass == 0 || (key >> 8) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (wid == 0) sp_find_bin(hist, kk, sel);
        __syncthreads();
        prefix = (prefix << 8) | (u32)sel[0];
        kk = sel[1];
        __syncthreads();
    }
    *r_eq = kk;
    return prefix;
}

// (gt << 16) | eq over keys[x0, x1): how many are above kstar and how many equal it (counts
// below 2^16: n_cand ≤ 65535).
__device__ __forceinline__ u32 sd_run_counts(const u16* keys, int x0, int x1, u32 kstar) {
    u32 gt = 0, eq = 0;
    for (int x = x0; x < x1; x++) {
        const u32 k = keys[x];
        gt += k > kstar;
        eq += k == kstar;
    }
    return (gt << 16) | eq;
}

// Writes the chosen of keys[x0, x1) (above kstar, or equal to it and among the first r_eq, the
// lowest index first) to their places in outb after the n_init forced ones, given the counts of
// the candidates before the run (sd_run_counts' form); key x is block first + x.
__device__ __forceinline__ void sd_run_emit(const u16* keys, int x0, int x1, u32 kstar, int r_eq, u32 before,
                                            int n_init, int k_sel, int first, int* outb) {
    u32 gt_before = before >> 16, eq_before = before & 0xffffu;
    for (int x = x0; x < x1; x++) {
        const u32 k = keys[x];
        if (k > kstar || (k == kstar && (int)eq_before < r_eq)) {
            const int pos = (int)gt_before + min((int)eq_before, r_eq);
            if (n_init + pos < k_sel) outb[n_init + pos] = first + x;
        }
        gt_before += k > kstar;
        eq_before += k == kstar;
    }
}

// Block selection of pair blockIdx.x (its query at position t, block qb = t / block_size): k_sel
// ascending block ids (−1 padded) into blocks_out[pair·k_sel ..], by the rule of sparse_select.
// fill(keys, cand_lo, n_cand): every thread helps write keys[x], the 16-bit key of candidate
// block cand_lo + x (larger is better), for x < n_cand: the candidates [init_blocks, qb −
// local_blocks). The keys go to `keys` (this pair's part of a global scratch) or, when it is
// null, to dynamic shared memory. Every thread calls.
template <class Fill>
__device__ __forceinline__ void sd_topk_body(int t, int block_size, int init_blocks, int local_blocks, int k_sel,
                                             u16* keys, int* blocks_out, Fill&& fill) {
    u16* sd_keys = keys ? keys : sd_smem;
    __shared__ int hist[256];
    __shared__ int sel[2];
    __shared__ u32 scan[32];
    const int pair = blockIdx.x, tid = threadIdx.x;
    const int qb = t / block_size;
    int* outb = blocks_out + (size_t)pair * k_sel;
    const int cand_lo = init_blocks, cand_hi = max(qb - local_blocks, 0);
    const int n_cand = max(0, cand_hi - cand_lo);
    if (qb < k_sel || n_cand == 0) {  // every block 0..=qb is taken
        for (int s = tid; s < k_sel; s += SD_TOPK_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }
    fill(sd_keys, cand_lo, n_cand);
    __syncthreads();
    const int n_forced = qb + 1 - n_cand;
    const int take = min(max(k_sel - n_forced, 0), n_cand);
    u32 kstar = 0;
    int r_eq = 0x7fffffff;  // take == n_cand: every key is ≥ 0, take all
    if (take > 0 && take < n_cand) kstar = sd_radix_select(sd_keys, n_cand, take, hist, sel, &r_eq);

    // Output, ascending: [0, init_blocks) ++ chosen candidates ++ [cand_hi, qb] ++ −1.
    const int n_init = min(init_blocks, qb + 1);
    for (int s = tid; s < n_init && s < k_sel; s += SD_TOPK_THREADS) outb[s] = s;
    if (take > 0) {
        // Each thread owns a run of consecutive candidates; a candidate is chosen if its key is
        // above kstar, or equal to it and among the first r_eq such (lowest index first).
        const int per = (n_cand + SD_TOPK_THREADS - 1) / SD_TOPK_THREADS;
        const int x0 = min(tid * per, n_cand), x1 = min(x0 + per, n_cand);
        u32 all;
        const u32 before = block_scan<SD_TOPK_THREADS / 32>(sd_run_counts(sd_keys, x0, x1, kstar), scan, &all);
        sd_run_emit(sd_keys, x0, x1, kstar, r_eq, before, n_init, k_sel, cand_lo, outb);
    }
    const int n_hi = qb - cand_hi + 1;
    for (int s = tid; s < n_hi; s += SD_TOPK_THREADS)
        if (n_init + take + s < k_sel) outb[n_init + take + s] = cand_hi + s;
    for (int s = n_init + take + n_hi + tid; s < k_sel; s += SD_TOPK_THREADS) outb[s] = -1;
}

// Block selection from the P of sd_p (sd_topk_body): a candidate block b scores the max of P
// over windows [w·b − 1, w·b + w − 1] ∩ [0, n1v); its key is that bf16's bits + 1 (P ≥ 0, so
// bit order is value order). With stage_p, P is first copied to shared memory after the keys
// (at byte 2·⌈candidates / 8⌉·8, or 0 with the keys in global memory: keys_global, p_stride
// keys a pair) with 16-byte loads; p_stride a multiple of 8.
__device__ __forceinline__ void sd_topk_pair(const u16* p16, int p_stride, int n1, int t, int block_size,
                                             int k1_window, int k1_stride, int init_blocks, int local_blocks,
                                             int k_sel, int stage_p, u16* keys_global, int* blocks_out) {
    const int w = block_size / k1_stride;
    const int n1v = min(sp_visible(t, k1_window, k1_stride), n1);
    const u16* P = p16 + (size_t)blockIdx.x * p_stride;
    u16* keys = keys_global ? keys_global + (size_t)blockIdx.x * p_stride : (u16*)0;
    if (stage_p) {
        const int cand = max(0, max(t / block_size - local_blocks, 0) - init_blocks);
        u16* ps = sd_smem + (keys ? 0 : (cand + 7) / 8 * 8);
        for (int x = 8 * threadIdx.x; x < n1v; x += 8 * SD_TOPK_THREADS) *(uint4*)(ps + x) = *(const uint4*)(P + x);
        __syncthreads();
        P = ps;
    }
    sd_topk_body(t, block_size, init_blocks, local_blocks, k_sel, keys, blocks_out, [&](u16* k, int lo_b, int n) {
        for (int x = threadIdx.x; x < n; x += SD_TOPK_THREADS) {
            const int b = lo_b + x, lo = max(w * b - 1, 0), hi = min(w * b + w - 1, n1v - 1);
            u32 key = 0;
            for (int y = lo; y <= hi; y++) key = max(key, (u32)P[y] + 1u);
            k[x] = (u16)key;
        }
    });
}

// Queries at positions first_pos + i of one sequence. keys: null (the keys in shared memory) or
// a scratch of T·kv_heads·p_stride u16 (candidates ≤ p_stride).
// launch: grid = (T·kv_heads), block = SD_TOPK_THREADS, dynamic smem = 2·⌈candidates / 8⌉·8
//         bytes (candidates ≤ 65535) without keys, plus 2·p_stride with stage_p
extern "C" __global__ void __launch_bounds__(SD_TOPK_THREADS)
sd_topk(const u16* p16, int p_stride, int n1, int first_pos, int kv_heads, int block_size, int k1_window,
        int k1_stride, int init_blocks, int local_blocks, int k_sel, int stage_p, u16* keys, int* blocks_out) {
    pdl_start();
    sd_topk_pair(p16, p_stride, n1, first_pos + blockIdx.x / kv_heads, block_size, k1_window, k1_stride,
                 init_blocks, local_blocks, k_sel, stage_p, keys, blocks_out);
}

// One query of each sequence of rows; shared memory for the longest.
// launch: as sd_topk
extern "C" __global__ void __launch_bounds__(SD_TOPK_THREADS)
sd_topk_rows(const u16* p16, int p_stride, SeqRows rows, int kv_heads, int block_size, int k1_window, int k1_stride,
             int init_blocks, int local_blocks, int k_sel, int stage_p, u16* keys, int* blocks_out) {
    pdl_start();
    const int i = blockIdx.x / kv_heads;
    sd_topk_pair(p16, p_stride, rows.n1[i], rows.pos[i], block_size, k1_window, k1_stride, init_blocks,
                 local_blocks, k_sel, stage_p, keys, blocks_out);
}

// ---- The decode top-k over a cluster of SD_CL CTAs a pair (Hopper; compiled empty elsewhere) ----
// sd_topk_rows' result with the candidates split over the cluster: CTA r stages the P of its
// slice of candidates, makes their keys and counts their high bytes; every CTA adds the
// cluster's histograms (distributed shared memory) and finds the bin, then the low bytes'
// likewise; the ascending list's positions come from the counts of the CTAs before it. One
// pair on 2 SMs took ~22 us at 1M (16,384 candidates), its time the instructions of one block.
#define SD_CL 8
#define SD_CL_THREADS 1024

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ u32 cl_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of the cluster arrives, then waits for all (release / acquire: the shared
// memory written before is visible to the other CTAs after).
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// The word at shared address `addr` of CTA `rank` of the cluster.
__device__ __forceinline__ u32 cl_load(u32 addr, u32 rank) {
    u32 remote, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(remote) : "memory");
    return v;
}

// The cluster's histogram at shared address h (each CTA's 256 counts, added in CTA order) into
// ghist, then the bin where rank kk falls (sp_find_bin) into sel, for every thread to read.
__device__ __forceinline__ void sd_cluster_bin(u32 h, int* ghist, int kk, int* sel) {
    const int tid = threadIdx.x;
    for (int b = tid; b < 256; b += SD_CL_THREADS) {
        int sum = 0;
        for (int r = 0; r < SD_CL; r++) sum += (int)cl_load(h + 4 * b, r);
        ghist[b] = sum;
    }
    __syncthreads();
    if (tid < 32) sp_find_bin(ghist, kk, sel);
    __syncthreads();
}
#endif

// One query of each sequence of rows, pair blockIdx.x / SD_CL; keys and P in shared memory.
// launch: grid = (T·kv_heads·SD_CL), cluster (SD_CL), block = SD_CL_THREADS, dynamic smem =
//         plan::sd_topk_cluster_smem (the slice's keys, then its P windows)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SD_CL_DIMS __cluster_dims__(SD_CL, 1, 1)
#else
#define SD_CL_DIMS
#endif
extern "C" __global__ void SD_CL_DIMS __launch_bounds__(SD_CL_THREADS)
sd_topk_rows_cl(const u16* p16, int p_stride, SeqRows rows, int kv_heads, int block_size, int k1_window,
                int k1_stride, int init_blocks, int local_blocks, int k_sel, int* blocks_out) {
    pdl_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int hist0[256], hist1[256], ghist[256], sel[2];
    __shared__ u32 scan[32], counts;
    const int tid = threadIdx.x, pair = blockIdx.x / SD_CL, i = pair / kv_heads;
    const u32 rank = cl_rank();
    const int t = rows.pos[i], w = block_size / k1_stride;
    const int n1v = min(sp_visible(t, k1_window, k1_stride), rows.n1[i]);
    const int qb = t / block_size, cand_lo = init_blocks, cand_hi = max(qb - local_blocks, 0);
    const int n_cand = max(0, cand_hi - cand_lo);
    int* outb = blocks_out + (size_t)pair * k_sel;
    if (qb < k_sel || n_cand == 0) {  // every block 0..=qb is taken (cluster-uniform)
        if (rank == 0)
            for (int s = tid; s < k_sel; s += SD_CL_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }
    const int n_forced = qb + 1 - n_cand, take = min(max(k_sel - n_forced, 0), n_cand);
    const bool select = take > 0 && take < n_cand;  // cluster-uniform
    // This CTA's candidates [x0, x1) and the P windows their keys pool: [p0, p1).
    const int per = (n_cand + SD_CL - 1) / SD_CL;
    const int x0 = min((int)rank * per, n_cand), x1 = min(x0 + per, n_cand), n = x1 - x0;
    u16* keys = sd_smem;
    u16* ps = sd_smem + (per + 7) / 8 * 8;
    const int p0 = max(w * (cand_lo + x0) - 1, 0) & ~7, p1 = min(w * (cand_lo + x1) + w - 1, n1v);
    const u16* P = p16 + (size_t)pair * p_stride;
    for (int x = p0 + 8 * tid; x < p1; x += 8 * SD_CL_THREADS) *(uint4*)(ps + (x - p0)) = *(const uint4*)(P + x);
    for (int b = tid; b < 256; b += SD_CL_THREADS) hist0[b] = hist1[b] = 0;
    __syncthreads();
    for (int x = tid; x < n; x += SD_CL_THREADS) {
        const int b = cand_lo + x0 + x;
        const int lo = max(w * b - 1, 0), hi = min(w * b + w - 1, n1v - 1);
        u32 key = 0;
        for (int y = lo; y <= hi; y++) key = max(key, (u32)ps[y - p0] + 1u);
        keys[x] = (u16)key;
        if (select) atomicAdd(&hist0[key >> 8], 1);
    }
    u32 kstar = 0;
    int r_eq = 0x7fffffff;  // take == n_cand: every key is ≥ 0, take all
    if (select) {
        // The cluster's histogram of the high bytes, then of the low bytes under the prefix.
        cl_sync();
        const u32 h0 = sp_smem_addr(hist0), h1 = sp_smem_addr(hist1);
        sd_cluster_bin(h0, ghist, take, sel);
        const u32 prefix = (u32)sel[0];
        const int kk = sel[1];
        for (int x = tid; x < n; x += SD_CL_THREADS) {
            const u32 key = keys[x];
            if ((key >> 8) == prefix) atomicAdd(&hist1[key & 255], 1);
        }
        cl_sync();
        sd_cluster_bin(h1, ghist, kk, sel);
        kstar = (prefix << 8) | (u32)sel[0];
        r_eq = sel[1];
    }
    // Output, ascending: [0, init_blocks) ++ chosen candidates ++ [cand_hi, qb] ++ −1. Each
    // thread owns a run of this CTA's candidates; the CTAs before it give the counts before it.
    const int n_init = min(init_blocks, qb + 1);
    const int run = (n + SD_CL_THREADS - 1) / SD_CL_THREADS;
    const int y0 = min(tid * run, n), y1 = min(y0 + run, n);
    u32 all;
    u32 before = block_scan<SD_CL_THREADS / 32>(sd_run_counts(keys, y0, y1, kstar), scan, &all);
    if (tid == 0) counts = all;
    cl_sync();
    const u32 c_addr = sp_smem_addr(&counts);
    for (u32 r = 0; r < rank; r++) before += cl_load(c_addr, r);
    sd_run_emit(keys, y0, take > 0 ? y1 : y0, kstar, r_eq, before, n_init, k_sel, cand_lo + x0, outb);
    if (rank == 0) {
        for (int s = tid; s < n_init && s < k_sel; s += SD_CL_THREADS) outb[s] = s;
        const int n_hi = qb - cand_hi + 1;
        for (int s = tid; s < n_hi; s += SD_CL_THREADS)
            if (n_init + take + s < k_sel) outb[n_init + take + s] = cand_hi + s;
        for (int s = n_init + take + n_hi + tid; s < k_sel; s += SD_CL_THREADS) outb[s] = -1;
    }
    cl_sync();  // no CTA leaves while another reads its shared memory
#endif
}

// Block selection from block scores (the bits of bf16 values ≥ 0, as the prefill block-score
// kernels write them) at bs[pair·bs_stride + b]: the same result as select_topk_scores. keys:
// null (the keys in shared memory) or a scratch of T·kv_heads·bs_stride u16.
// launch: grid = (T·kv_heads), block = SD_TOPK_THREADS,
//         dynamic smem = 2·(candidates) bytes rounded up to 16 (candidates ≤ 65535) without keys
extern "C" __global__ void __launch_bounds__(SD_TOPK_THREADS)
sd_topk_scores(const u16* bs, int bs_stride, int first_pos, int kv_heads, int block_size, int init_blocks,
               int local_blocks, int k_sel, u16* keys, int* blocks_out) {
    pdl_start();
    // The pair's first score in bs (a launch's scores are at most 128 MiB: int indices).
    const int row0 = blockIdx.x * bs_stride;
    u16* pair_keys = keys ? keys + row0 : (u16*)0;
    // A score's key is its bits + 1 (P ≥ 0, so bit order is value order; NaN 0). The scores are
    // read 16 bytes at a time from the 16-byte boundary at or before the first candidate's (bs
    // is 16-byte aligned; a row starts anywhere).
    sd_topk_body(first_pos + blockIdx.x / kv_heads, block_size, init_blocks, local_blocks, k_sel, pair_keys,
                 blocks_out, [&](u16* k, int lo_b, int n) {
        const int first = row0 + lo_b, end = first + n;
        for (int e0 = (first & ~7) + 8 * (int)threadIdx.x; e0 < end; e0 += 8 * SD_TOPK_THREADS) {
            const uint4 raw = *(const uint4*)(bs + e0);
            const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
            u16* ke = k + (e0 - first);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const u32 h = (w[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                if (e0 + j >= first && e0 + j < end) ke[j] = (u16)(__uint_as_float(h << 16) >= 0.0f ? h + 1u : 0u);
            }
        }
    });
}
