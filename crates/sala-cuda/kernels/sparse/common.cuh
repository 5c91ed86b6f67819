// Sparse (minicpm4) layers: mean-pooled key compression, InfLLM-v2 block selection (SPEC §5.3–5.5)
// and softmax attention over all / the selected keys (SPEC §5.6). GPU twins of
// `sala_cpu::attention::{SparseCache::append, select_blocks, sparse_layer_attention}`.
//
// Layouts (row-major, bf16 unless said): q [T, heads*d]; kcache/vcache [N, kv_heads*d];
// k1 [n1, kv_heads*d], k2 [n2, kv_heads*d]; query head h uses KV head h / (heads/kv_heads).
// The chunk's queries sit at positions first_pos .. first_pos+T−1, their keys already cached.
// All bf16 pointers must be 16-byte aligned (cudaMalloc'd buffers or offsets that are multiples
// of 8 elements); d ≤ 128 and a multiple of 16.
//
// This header: the helpers the sparse-layer files (selection and attention) share.
#pragma once
#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/fp8.cuh"

// Windows of (window, stride) whose last token is ≤ t.
__device__ __forceinline__ int sp_visible(int t, int window, int stride) {
    return (t + 1 >= window) ? (t + 1 - window) / stride + 1 : 0;
}

// Exclusive prefix sum over a block of 32·WARPS threads (WARPS ≤ 32); *total gets the
// block's sum. `sh` holds WARPS words. Contains __syncthreads(): every thread calls.
template <int WARPS>
__device__ __forceinline__ u32 block_scan(u32 v, u32* sh, u32* total) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    u32 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sh[wid] = x;
    __syncthreads();
    if (wid == 0) {
        u32 y = (lane < WARPS) ? sh[lane] : 0u;
#pragma unroll
        for (int o = 1; o < WARPS; o <<= 1) {
            const u32 z = __shfl_up_sync(0xffffffffu, y, o);
            if (lane >= o) y += z;
        }
        if (lane < WARPS) sh[lane] = y;  // inclusive warp totals
    }
    __syncthreads();
    const u32 excl = x - v + (wid > 0 ? sh[wid - 1] : 0u);
    *total = sh[WARPS - 1];
    __syncthreads();
    return excl;
}

// block_scan for 256 threads over ints (`sh` holds 8).
__device__ __forceinline__ int sp_scan256(int v, int* sh, int* total) {
    u32 t;
    const int excl = (int)block_scan<8>((u32)v, (u32*)sh, &t);
    *total = (int)t;
    return excl;
}

// Radix-select step (warp 0 calls): the histogram bin hist[b] (of 256, counted from the top)
// holding the kk-th largest key → sel[0] = b, sel[1] = kk's rank inside that bin.
__device__ __forceinline__ void sp_find_bin(const int* hist, int kk, int* sel) {
    const int lane = threadIdx.x & 31;
    // Lane l covers bins 255 − 8l down to 248 − 8l.
    int cnt[8], sum = 0;
#pragma unroll
    for (int x = 0; x < 8; x++) {
        cnt[x] = hist[255 - 8 * lane - x];
        sum += cnt[x];
    }
    int incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    const int excl = incl - sum;
    if (excl < kk && kk <= incl) {
        int cum = excl;
#pragma unroll
        for (int x = 0; x < 8; x++) {
            if (cum + cnt[x] >= kk) {
                sel[0] = 255 - 8 * lane - x;
                sel[1] = kk - cum;
                break;
            }
            cum += cnt[x];
        }
    }
}

// Q fragments of one query's heads of a KV group (`qg`: the group's first head, G heads of d;
// MMA rows ≥ G are zero), for keys read from global memory (sp_qk_perm). d a multiple of 32, at
// most 128. The k-steps are permuted, for Q and K alike: k-step 2p + h covers dims
// 32p + 8tq + 4h + {0..3}, so one 16-byte load of K[key][32p + 8tq ..] feeds two k-steps.
__device__ __forceinline__ void sp_load_q_perm(const bf16* qg, int G, int d, u32 (&qa)[8][4]) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        uint4 v[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
#pragma unroll
        for (int r = 0; r < 2; r++)
            if (32 * p < d && gq + 8 * r < G) v[r] = *(const uint4*)(qg + (size_t)(gq + 8 * r) * d + 32 * p + 8 * tq);
        qa[2 * p][0] = v[0].x;
        qa[2 * p][1] = v[1].x;
        qa[2 * p][2] = v[0].y;
        qa[2 * p][3] = v[1].y;
        qa[2 * p + 1][0] = v[0].z;
        qa[2 * p + 1][1] = v[1].z;
        qa[2 * p + 1][2] = v[0].w;
        qa[2 * p + 1][3] = v[1].w;
    }
}

// S = (heads × 8 keys) logits of one n-tile: lane (gq, tq) passes the row of key gq (`krow`,
// from global memory) and gets S[0..1] = heads gq, keys 2tq, 2tq + 1 and S[2..3] = head gq + 8.
__device__ __forceinline__ void sp_qk_perm(float (&S)[4], const u32 (&qa)[8][4], const bf16* krow, int d) {
    const int tq = threadIdx.x & 3;
    S[0] = S[1] = S[2] = S[3] = 0.0f;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        if (32 * p < d) {
            const uint4 kv = *(const uint4*)(krow + 32 * p + 8 * tq);
            sp_mma(S, qa[2 * p][0], qa[2 * p][1], qa[2 * p][2], qa[2 * p][3], kv.x, kv.y);
            sp_mma(S, qa[2 * p + 1][0], qa[2 * p + 1][1], qa[2 * p + 1][2], qa[2 * p + 1][3], kv.z, kv.w);
        }
    }
}

// For the tensor-core block-score kernels (select_scores_t, select_scores_wg): 2^x (approximate),
// the merge of online-softmax states, and a bf16x2 max.
__device__ __forceinline__ float st_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// (mx, l) ← the merge of two online-softmax states (max, sum of exp2 relative to the max).
__device__ __forceinline__ void st_merge(float& mx, float& l, float mo, float lo) {
    const float mn = fmaxf(mx, mo);
    const float mu = (mn == -__int_as_float(0x7f800000)) ? 0.0f : mn;
    l = l * st_ex2(mx - mu) + lo * st_ex2(mo - mu);
    mx = mn;
}

// st_merge over the 8 lanes of a warp that share lane % 4 (the rows of an MMA fragment).
__device__ __forceinline__ void st_merge_rows(float& mx, float& l) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
        st_merge(mx, l, __shfl_xor_sync(0xffffffffu, mx, o), __shfl_xor_sync(0xffffffffu, l, o));
}

// Lane-wise max of two bf16x2 pairs (a NaN loses to a number).
__device__ __forceinline__ u32 st_max2(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// FP8 K/V caches (`--kv-cache-dtype fp8`): a token's row holds kv_heads·d E4M3 codes, then
// kv_heads f32 scales (amax / 448 of that head's d values; 1 for zeros), the row padded to a
// multiple of 16 bytes. A value is code · scale. Same numbers as sala_model::numerics.
__device__ __forceinline__ int f8_row_bytes(int kv_heads, int d) { return kv_heads * d + ((4 * kv_heads + 15) & ~15); }

// The bf16 A fragment of keys 16·ks .. 16·ks + 15 of P, held as S (n-tiles 2·ks and 2·ks + 1
// of an m16n8 accumulator), for P·V.
template <int NT>
__device__ __forceinline__ void sp_p_frag(const float (&S)[NT][4], int ks, u32& a0, u32& a1, u32& a2, u32& a3) {
    a0 = sp_pack_bf16(S[2 * ks][0], S[2 * ks][1]);
    a1 = sp_pack_bf16(S[2 * ks][2], S[2 * ks][3]);
    a2 = sp_pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
    a3 = sp_pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
}
