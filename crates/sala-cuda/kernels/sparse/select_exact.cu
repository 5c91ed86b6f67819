// Block selection of the sparse layers on CUDA cores, the bit-exact twin of the CPU's
// select_blocks: sparse_select (stage-1 scores P and top-k block selection, one block per
// (query, KV group)), its multi-block twin select_lse + select_scores + select_topk, and
// select_topk_scores (the same top-k rule over the block scores of the tensor-core kernels).

#include "common/types.cuh"
#include "sparse/common.cuh"

// Correctly rounded expf / logf (the double results round once to fp32). The CPU path's
// `f32::exp` / `f32::ln` (libm) are within ~0.5 ulp of these, so block selection, which is a
// function of bf16-rounded probabilities, agrees with the CPU bit for bit except in rare ties.
__device__ __forceinline__ float sp_exp(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float sp_log(float x) { return (float)log((double)x); }

// `sala_cpu::attention::dot` to the bit: 8 lane accumulators over chunks of 8 (no fused
// multiply-add), combined as ((a0+a4) + (a1+a5)) + (a2+a6)) + (a3+a7). d is a multiple of 16 (≤ 128).
// `qv` is fp32 in shared memory (16-byte aligned); `kr` is a bf16 row held in registers (2 a word).
__device__ __forceinline__ float sp_dot_cpu(const float* qv, const u32 (&kr)[64], int d) {
    float a[8];
#pragma unroll
    for (int l = 0; l < 8; l++) a[l] = 0.0f;
#pragma unroll
    for (int c8 = 0; c8 < 16; c8++) {
        if (c8 * 8 < d) {
            const float4 q0 = *(const float4*)(qv + 8 * c8), q1 = *(const float4*)(qv + 8 * c8 + 4);
            const float qf[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
#pragma unroll
            for (int l = 0; l < 8; l++) {
                const u32 w = kr[4 * c8 + (l >> 1)];
                const float kf = (l & 1) ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
                a[l] = __fadd_rn(a[l], __fmul_rn(qf[l], kf));
            }
        }
    }
    float s = __fadd_rn(a[0], a[4]);
    s = __fadd_rn(s, __fadd_rn(a[1], a[5]));
    s = __fadd_rn(s, __fadd_rn(a[2], a[6]));
    s = __fadd_rn(s, __fadd_rn(a[3], a[7]));
    return s;
}

// Loads a bf16 row of d (≤ 128, multiple of 16) values from global memory (16-byte aligned).
__device__ __forceinline__ void sp_load_row(const bf16* src, u32 (&kr)[64], int d) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        if (j * 8 < d) {
            const uint4 v = *(const uint4*)(src + 8 * j);
            kr[4 * j] = v.x;
            kr[4 * j + 1] = v.y;
            kr[4 * j + 2] = v.z;
            kr[4 * j + 3] = v.w;
        } else {
            kr[4 * j] = kr[4 * j + 1] = kr[4 * j + 2] = kr[4 * j + 3] = 0u;
        }
    }
}

// Float → u32 whose unsigned order is f32::total_cmp's order.
__device__ __forceinline__ u32 sp_order_key(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float sp_key_float(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

#define SS_THREADS 256
#define SS_BUF 4096  // floats: exp tiles of the LSE pass, then cached block keys

// Score key of block b: max of P over windows [w·b − 1, w·b + w − 1] ∩ [0, n1v), −inf if empty.
__device__ __forceinline__ u32 sp_block_key(const float* P, int b, int w, int n1v) {
    int lo = w * b - 1;
    if (lo < 0) lo = 0;
    if (lo > n1v) lo = n1v;
    int hi = min(w * b + w, n1v);
    float m = -__int_as_float(0x7f800000);
    for (int x = lo; x < hi; x++) m = fmaxf(m, P[x]);
    return sp_order_key(m);
}

// Stage 1, part 1 (block-wide; every thread calls): for the G heads whose fp32 queries are in
// shared memory at qs ([G][d]), LSE_h = m_h + log Σ_{c<n2v} exp(s·(q_h·K2[c]) − m_h), each f32
// operation as the CPU does it (the sum runs in window order). n2v > 0. k2g: K2 of the group
// (row stride kvw). sm_m, sm_sum: [G] shared scratch; buf: SS_BUF floats of shared scratch.
// The LSEs land in lse[0..G) (shared or global).
__device__ __noinline__ void sp_lse_phase(const float* qs, int G, const bf16* k2g, size_t kvw, int n2v,
                                             int d, float scale, float* sm_m, float* sm_sum, float* buf,
                                             float* lse) {
    const int tid = threadIdx.x, lane = tid & 31;
    u32 kr[64];  // one compressed key row, in registers, shared by the G heads
    u32* mkey = (u32*)sm_m;  // running max as order keys, converted to floats in place
    for (int x = tid; x < G; x += SS_THREADS) {
        mkey[x] = 0u;  // below every float's key
        sm_sum[x] = 0.0f;
    }
    __syncthreads();
    // Pass A: per head, the max over the visible level-2 logits s·(q_h·K2[c]).
    const int n2pad = (n2v + SS_THREADS - 1) / SS_THREADS * SS_THREADS;
    for (int c = tid; c < n2pad; c += SS_THREADS) {
        const bool in = c < n2v;
        if (in) sp_load_row(k2g + (size_t)c * kvw, kr, d);
        for (int hh = 0; hh < G; hh++) {
            float l = in ? __fmul_rn(scale, sp_dot_cpu(qs + hh * d, kr, d)) : -__int_as_float(0x7f800000);
            l = warp_max(l);
            if (lane == 0 && in) atomicMax(&mkey[hh], sp_order_key(l));  // lane 0 has the warp's lowest c
        }
    }
    __syncthreads();
    for (int hh = tid; hh < G; hh += SS_THREADS) sm_m[hh] = sp_key_float(mkey[hh]);  // same thread
    __syncthreads();
    // Pass B: Σ_c exp(logit − max) in window order (as the CPU's sequential sum), tile by tile:
    // the exps of a tile in parallel, then one thread per head adds them in order.
    const int tw = max(1, min(SS_THREADS, SS_BUF / G));
    for (int c0 = 0; c0 < n2v; c0 += tw) {
        const int n = min(tw, n2v - c0);
        if (tid < n) {
            sp_load_row(k2g + (size_t)(c0 + tid) * kvw, kr, d);
            for (int hh = 0; hh < G; hh++) {
                const float l = __fmul_rn(scale, sp_dot_cpu(qs + hh * d, kr, d));
                buf[hh * tw + tid] = sp_exp(__fsub_rn(l, sm_m[hh]));
            }
        }
        __syncthreads();
        for (int hh = tid; hh < G; hh += SS_THREADS) {
            float sum = sm_sum[hh];
            const float* e = buf + hh * tw;
            for (int cc = 0; cc < n; cc++) sum = __fadd_rn(sum, e[cc]);
            sm_sum[hh] = sum;
        }
        __syncthreads();
    }
    for (int hh = tid; hh < G; hh += SS_THREADS) lse[hh] = __fadd_rn(sm_m[hh], sp_log(sm_sum[hh]));
    __syncthreads();
}

// Stage 1, part 2: P[x] = bf16(Σ_h exp(s·(q_h·K1[x]) − LSE_h)) (heads in order, NaN → 0) for
// x ∈ [x0, x1), one window per thread. lse: [G] (shared memory or global).
__device__ __noinline__ void sp_scores_phase(const float* qs, int G, const bf16* k1g, size_t kvw, int x0,
                                                int x1, int d, float scale, const float* lse, float* P) {
    u32 kr[64];
    for (int x = x0 + (int)threadIdx.x; x < x1; x += SS_THREADS) {
        sp_load_row(k1g + (size_t)x * kvw, kr, d);
        float acc = 0.0f;
        for (int hh = 0; hh < G; hh++) {
            const float l = __fmul_rn(scale, sp_dot_cpu(qs + hh * d, kr, d));
            acc = __fadd_rn(acc, sp_exp(__fsub_rn(l, lse[hh])));
        }
        const float r = round_bf(acc);
        P[x] = (r != r) ? 0.0f : r;
    }
}

// The order key of block score b (bf16 bits).
__device__ __forceinline__ u32 sp_bs_key(const u16* bs, int b) {
    return sp_order_key(__uint_as_float((u32)bs[b] << 16));
}

// Block selection (block-wide; every thread calls), from P [n1v] (global, already visible to
// the block): writes the k_sel ascending block ids (−1 padded) of a query at block qb ≥ k_sel.
// With `bscores` (block scores indexed by block, bf16 bits), keys come from it instead of P.
__device__ __noinline__ void sp_topk_phase(const float* P, int n1v, int qb, int block_size, int k1_stride,
                                              int init_blocks, int local_blocks, int k_sel, int* outb,
                                              float* buf, const u16* bscores) {
    __shared__ int ss_hist[256];
    __shared__ int ss_scan[9];
    __shared__ int ss_sel[2];
    const int tid = threadIdx.x, wid = tid >> 5;
    const int w = block_size / k1_stride;
    // Non-forced candidates: init_blocks ≤ b < qb − local_blocks.
    const int cand_lo = init_blocks;
    const int cand_hi = (qb > local_blocks) ? qb - local_blocks : 0;
    const int n_cand = max(0, cand_hi - cand_lo);
    const int n_forced = qb + 1 - n_cand;
    const int take = min(max(k_sel - n_forced, 0), n_cand);

    if (n_cand == 0) {  // every block 0..=qb is forced (only with unusual configurations)
        for (int s = tid; s < k_sel; s += SS_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }

    const bool cached = n_cand <= SS_BUF;
    u32* keys = (u32*)buf;
    if (cached) {
        for (int x = tid; x < n_cand; x += SS_THREADS)
            keys[x] = bscores ? sp_bs_key(bscores, cand_lo + x) : sp_block_key(P, cand_lo + x, w, n1v);
        __syncthreads();
    }
#define SS_KEY(b) \
    (cached ? keys[(b) - cand_lo] : bscores ? sp_bs_key(bscores, b) : sp_block_key(P, (b), w, n1v))

    // The take-th largest key (radix select, 8 bits a pass) and how many of the candidates equal
    // to it are taken (r_eq, lowest block index first); all candidates with a larger key are taken.
    u32 kstar = 0;
    int r_eq = 0;
    if (take == n_cand) {
        kstar = 0;
        r_eq = 0x7fffffff;  // every key is ≥ 0: take all
    } else if (take > 0) {
        u32 prefix = 0, pmask = 0;
        int kk = take;
        for (int shift = 24; shift >= 0; shift -= 8) {
            ss_hist[tid] = 0;
            __syncthreads();
            for (int b = cand_lo + tid; b < cand_hi; b += SS_THREADS) {
                const u32 key = SS_KEY(b);
                if ((key & pmask) == prefix) atomicAdd(&ss_hist[(key >> shift) & 255], 1);
            }
            __syncthreads();
            if (wid == 0) sp_find_bin(ss_hist, kk, ss_sel);
            __syncthreads();
            prefix |= (u32)ss_sel[0] << shift;
            pmask |= 255u << shift;
            kk = ss_sel[1];
            __syncthreads();
        }
        kstar = prefix;
        r_eq = kk;
    }

    // Output, ascending: [0, init_blocks) ++ chosen candidates ++ [cand_hi, qb].
    const int n_init = min(init_blocks, qb + 1);
    for (int s = tid; s < n_init && s < k_sel; s += SS_THREADS) outb[s] = s;
    if (take > 0) {
        int eq_base = 0, sel_base = 0;
        for (int b0 = cand_lo; b0 < cand_hi; b0 += SS_THREADS) {
            const int b = b0 + tid;
            const bool in = b < cand_hi;
            const u32 key = in ? SS_KEY(b) : 0u;
            const bool gt = in && key > kstar, eq = in && key == kstar;
            int tot;
            const int eq_rank = eq_base + sp_scan256(eq ? 1 : 0, ss_scan, &tot);
            eq_base += tot;
            const bool sel = gt || (eq && eq_rank < r_eq);
            const int pos = sel_base + sp_scan256(sel ? 1 : 0, ss_scan, &tot);
            sel_base += tot;
            if (sel && n_init + pos < k_sel) outb[n_init + pos] = b;
        }
    }
#undef SS_KEY
    const int n_hi = qb - cand_hi + 1;
    for (int s = tid; s < n_hi; s += SS_THREADS)
        if (n_init + take + s < k_sel) outb[n_init + take + s] = cand_hi + s;
    for (int s = n_init + take + n_hi + tid; s < k_sel; s += SS_THREADS) outb[s] = -1;
}

// Loads the fp32 queries of heads g*G + h0 .. g*G + h0 + nh − 1 of query i into qs [nh][d].
__device__ __forceinline__ void sp_load_q(const bf16* q, int i, int heads, int d, int h, int nh, float* qs) {
    for (int x = threadIdx.x; x < nh * d; x += SS_THREADS)
        qs[x] = bf2f(q[(size_t)i * heads * d + (size_t)h * d + x]);
}

// For the pair (query i, KV group g) = (blockIdx.x / kv_heads, blockIdx.x % kv_heads), position
// t = first_pos + i, query block qb = t / block_size: writes k_sel block ids (ascending, −1
// padded) to blocks_out[blockIdx.x*k_sel ..] exactly as `sala_cpu::attention::select_blocks`:
// if qb < k_sel, blocks 0..=qb (dense); else the forced blocks (b < init_blocks or
// b + local_blocks ≥ qb) plus the best k_sel − n_forced others by (score desc, index asc).
// P (fp32, n1v values) is left in p_scratch[blockIdx.x*p_stride ..] (p_stride ≥ n1).
// One block does all of a pair's work: right for prefill (T·kv_heads blocks); for decode use
// select_lse + select_scores + select_topk (same result, many blocks per pair).
// launch: grid = (T * kv_heads), block = 256,
//         dynamic smem = (heads / kv_heads) * (d + 3) * 4 bytes  (8,384 for 16 heads of d = 128)
//   (static shared memory 17,456 bytes; the total stays under 48 KB while (heads/kv_heads)*(d+3) ≤ 7900.)
extern "C" __global__ void __launch_bounds__(SS_THREADS, 2)
sparse_select(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos,
              int heads, int kv_heads, int d, float scale, int block_size, int k1_window,
              int k1_stride, int k2_window, int k2_stride, int init_blocks, int local_blocks,
              int k_sel, float* p_scratch, int p_stride, int* blocks_out) {
    pdl_start();
    extern __shared__ __align__(16) float ss_dyn[];
    __shared__ __align__(16) float ss_buf[SS_BUF];
    const int pair = blockIdx.x;
    const int i = pair / kv_heads, g = pair % kv_heads;
    const int t = first_pos + i;
    const int qb = t / block_size;
    int* outb = blocks_out + (size_t)pair * k_sel;
    if (qb < k_sel) {  // every earlier block: the result equals dense attention
        for (int s = threadIdx.x; s < k_sel; s += SS_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }
    const int G = heads / kv_heads;
    const size_t kvw = (size_t)kv_heads * d;
    float* qs = ss_dyn;          // [G][d] fp32 queries of the group
    float* sm_m = qs + G * d;    // [G]
    float* sm_sum = sm_m + G;    // [G]
    float* sm_lse = sm_sum + G;  // [G]
    float* P = p_scratch + (size_t)pair * p_stride;
    const int n1v = min(sp_visible(t, k1_window, k1_stride), n1);
    const int n2v = min(sp_visible(t, k2_window, k2_stride), n2);

    sp_load_q(q, i, heads, d, g * G, G, qs);
    __syncthreads();
    if (n2v == 0) {
        for (int x = threadIdx.x; x < n1v; x += SS_THREADS) P[x] = 0.0f;
    } else {
        sp_lse_phase(qs, G, k2 + (size_t)g * d, kvw, n2v, d, scale, sm_m, sm_sum, ss_buf, sm_lse);
        sp_scores_phase(qs, G, k1 + (size_t)g * d, kvw, 0, n1v, d, scale, sm_lse, P);
    }
    __syncthreads();  // P (global, written by this block) visible to the whole block
    sp_topk_phase(P, n1v, qb, block_size, k1_stride, init_blocks, local_blocks, k_sel, outb, ss_buf, 0);
}

// Multi-block twin of sparse_select, step 1 of 3: LSE of every (query i, head h) that needs one,
// into lse[i*heads + h] (fp32 scratch of T*heads floats). Same arguments as sparse_select + lse.
// launch: grid = (T * kv_heads, heads / kv_heads), block = 256, dynamic smem = (d + 3) * 4 bytes
extern "C" __global__ void __launch_bounds__(SS_THREADS, 2)
select_lse(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos,
           int heads, int kv_heads, int d, float scale, int block_size, int k1_window,
           int k1_stride, int k2_window, int k2_stride, int init_blocks, int local_blocks,
           int k_sel, float* p_scratch, int p_stride, int* blocks_out, float* lse) {
    pdl_start();
    extern __shared__ __align__(16) float ss_dyn[];
    __shared__ __align__(16) float ss_buf[SS_BUF];
    const int pair = blockIdx.x;
    const int i = pair / kv_heads, g = pair % kv_heads;
    const int t = first_pos + i;
    const int G = heads / kv_heads, h = g * G + blockIdx.y;
    const int n2v = min(sp_visible(t, k2_window, k2_stride), n2);
    if (t / block_size < k_sel || n2v == 0) return;
    float* qs = ss_dyn;  // [d]
    sp_load_q(q, i, heads, d, h, 1, qs);
    __syncthreads();
    sp_lse_phase(qs, 1, k2 + (size_t)g * d, (size_t)kv_heads * d, n2v, d, scale, qs + d, qs + d + 1, ss_buf,
                 lse + (size_t)i * heads + h);
}

// Step 2 of 3: P windows [256·blockIdx.y, 256·blockIdx.y + 256) of pair blockIdx.x into
// p_scratch (as sparse_select leaves it), from the LSEs of step 1.
// launch: grid = (T * kv_heads, (n1 + 255) / 256), block = 256,
//         dynamic smem = (heads / kv_heads) * (d + 3) * 4 bytes
extern "C" __global__ void __launch_bounds__(SS_THREADS, 2)
select_scores(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos,
              int heads, int kv_heads, int d, float scale, int block_size, int k1_window,
              int k1_stride, int k2_window, int k2_stride, int init_blocks, int local_blocks,
              int k_sel, float* p_scratch, int p_stride, int* blocks_out, const float* lse) {
    pdl_start();
    extern __shared__ __align__(16) float ss_dyn[];
    const int pair = blockIdx.x;
    const int i = pair / kv_heads, g = pair % kv_heads;
    const int t = first_pos + i;
    if (t / block_size < k_sel) return;
    const int n1v = min(sp_visible(t, k1_window, k1_stride), n1);
    const int n2v = min(sp_visible(t, k2_window, k2_stride), n2);
    const int x0 = blockIdx.y * SS_THREADS, x1 = min(n1v, x0 + SS_THREADS);
    if (x0 >= x1) return;
    float* P = p_scratch + (size_t)pair * p_stride;
    if (n2v == 0) {
        for (int x = x0 + (int)threadIdx.x; x < x1; x += SS_THREADS) P[x] = 0.0f;
        return;
    }
    const int G = heads / kv_heads;
    float* qs = ss_dyn;  // [G][d]
    sp_load_q(q, i, heads, d, g * G, G, qs);
    __syncthreads();
    sp_scores_phase(qs, G, k1 + (size_t)g * d, (size_t)kv_heads * d, x0, x1, d, scale,
                    lse + (size_t)i * heads + g * G, P);
}

// Step 3 of 3: block selection from p_scratch into blocks_out (as sparse_select).
// launch: grid = (T * kv_heads), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SS_THREADS)
select_topk(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos,
            int heads, int kv_heads, int d, float scale, int block_size, int k1_window,
            int k1_stride, int k2_window, int k2_stride, int init_blocks, int local_blocks,
            int k_sel, float* p_scratch, int p_stride, int* blocks_out, const float* lse) {
    pdl_start();
    __shared__ __align__(16) float ss_buf[SS_BUF];
    const int pair = blockIdx.x;
    const int i = pair / kv_heads;
    const int t = first_pos + i;
    const int qb = t / block_size;
    int* outb = blocks_out + (size_t)pair * k_sel;
    if (qb < k_sel) {
        for (int s = threadIdx.x; s < k_sel; s += SS_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }
    const int n1v = min(sp_visible(t, k1_window, k1_stride), n1);
    sp_topk_phase(p_scratch + (size_t)pair * p_stride, n1v, qb, block_size, k1_stride, init_blocks,
                  local_blocks, k_sel, outb, ss_buf, 0);
}

// Block selection from the scores of select_scores_mma: for pair (query i, KV group g) =
// (blockIdx.x / kv_heads, blockIdx.x % kv_heads), the k_sel ascending block ids (−1 padded) into
// blocks_out[blockIdx.x·k_sel ..], by the rule of sparse_select (forced blocks, then the best
// others by score, ties to the lower index).
// launch: grid = (T * kv_heads), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SS_THREADS)
select_topk_scores(const u16* bs, int bs_stride, int first_pos, int kv_heads, int block_size, int k1_stride,
                   int init_blocks, int local_blocks, int k_sel, int* blocks_out) {
    pdl_start();
    __shared__ __align__(16) float ss_buf[SS_BUF];
    const int pair = blockIdx.x;
    const int t = first_pos + pair / kv_heads;
    const int qb = t / block_size;
    int* outb = blocks_out + (size_t)pair * k_sel;
    if (qb < k_sel) {
        for (int s = threadIdx.x; s < k_sel; s += SS_THREADS) outb[s] = (s <= qb) ? s : -1;
        return;
    }
    sp_topk_phase(0, 0, qb, block_size, k1_stride, init_blocks, local_blocks, k_sel, outb, ss_buf,
                  bs + (size_t)pair * bs_stride);
}
