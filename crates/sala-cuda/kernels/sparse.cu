// Sparse (minicpm4) layers: mean-pooled key compression, InfLLM-v2 block selection (SPEC §5.3–5.5)
// and softmax attention over all / the selected keys (SPEC §5.6). GPU twins of
// `sala_cpu::attention::{SparseCache::append, select_blocks, sparse_layer_attention}`.
//
// Layouts (row-major, bf16 unless said): q [T, heads*d]; kcache/vcache [N, kv_heads*d];
// k1 [n1, kv_heads*d], k2 [n2, kv_heads*d]; query head h uses KV head h / (heads/kv_heads).
// The chunk's queries sit at positions first_pos .. first_pos+T−1, their keys already cached.
// All bf16 pointers must be 16-byte aligned (cudaMalloc'd buffers or offsets that are multiples
// of 8 elements); d ≤ 128 and a multiple of 16.

// ============================================================================================
// Helpers (prefixed sp_: every kernel file shares one NVRTC program)
// ============================================================================================

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

// Windows of (window, stride) whose last token is ≤ t.
__device__ __forceinline__ int sp_visible(int t, int window, int stride) {
    return (t + 1 >= window) ? (t + 1 - window) / stride + 1 : 0;
}

// The sequences of a batched decode step in a sparse layer, passed by value to the *_rows
// kernels: query row i's caches (K, V, level-1 and level-2 compressed keys; the new token
// already appended), its position (its cache holds pos + 1 tokens) and tier sizes.
#define SEQ_ROWS 64
struct SeqRows {
    const bf16* k[SEQ_ROWS];
    const bf16* v[SEQ_ROWS];
    const bf16* k1[SEQ_ROWS];
    const bf16* k2[SEQ_ROWS];
    int pos[SEQ_ROWS];
    int n1[SEQ_ROWS];
    int n2[SEQ_ROWS];
    int split[SEQ_ROWS];  // attention_decode_rows: the sequence's own n_split
};

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

// ============================================================================================
// 1. compress_keys
// ============================================================================================

// out[w, f] = bf16( (Σ_{u<window} keys[stride·w + u, f]) / window ), fp32 sum in token order
// (exactly `SparseCache::append`), for w in [first_window, first_window + n_windows).
// launch: grid = ((n_windows * kv_width + 255) / 256), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
compress_keys(const bf16* keys, bf16* out, int first_window, int n_windows, int kv_width, int window,
              int stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_windows * kv_width) return;
    const int w = first_window + (int)(idx / kv_width);
    const int f = (int)(idx % kv_width);
    const bf16* src = keys + (size_t)stride * w * kv_width + f;
    float sum = 0.0f;
    for (int u = 0; u < window; u++) sum = __fadd_rn(sum, bf2f(src[(size_t)u * kv_width]));
    out[(size_t)w * kv_width + f] = f2bf(__fdiv_rn(sum, (float)window));
}

// ============================================================================================
// 2. sparse_select: stage-1 scores P and top-k block selection, one block per (query, KV group)
// ============================================================================================

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

// Block selection (block-wide; every thread calls), from P [n1v] (global, already visible to
// the block): writes the k_sel ascending block ids (−1 padded) of a query at block qb ≥ k_sel.
// With `bscores` (block scores indexed by block), keys come from it instead of P.
__device__ __noinline__ void sp_topk_phase(const float* P, int n1v, int qb, int block_size, int k1_stride,
                                              int init_blocks, int local_blocks, int k_sel, int* outb,
                                              float* buf, const float* bscores) {
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
            keys[x] = bscores ? sp_order_key(bscores[cand_lo + x]) : sp_block_key(P, cand_lo + x, w, n1v);
        __syncthreads();
    }
#define SS_KEY(b) \
    (cached ? keys[(b) - cand_lo] : bscores ? sp_order_key(bscores[b]) : sp_block_key(P, (b), w, n1v))

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

// ============================================================================================
// 3. attention: causal softmax attention over all keys ≤ t, or over the selected blocks
// ============================================================================================
//
// Rows: for KV group g, row R = i·G + hh (query i, head g·G + hh), R ∈ [0, T·G). A block owns
// 64 consecutive rows (fewer if the host launches more blocks than ⌈T·G/64⌉; see below), a tile
// that spans ≤ 64 queries, so every K/V chunk staged in shared memory serves all heads of the
// group and several queries. Keys are walked in chunks of
// ≤ 64 (dense: 0..t_max; sparse: the union over the tile's queries of their selected blocks, in
// ascending order, each row masked to its own query's blocks and to j ≤ t). Each warp computes 16
// rows with bf16 tensor-core MMAs (mma.sync m16n8k16, fp32 accumulation): S = Q Kᵀ exactly (bf16
// inputs), online softmax in fp32, O += P V with P split into bf16 hi + lo parts (two MMAs), so P
// keeps ~16 bits and the result is fp32-accurate. When the tile has few rows (decode: T·G ≤ 32),
// the warps split each chunk's keys instead (2 or 4 ways) and merge their partial softmax states
// at the end. K and V chunks are fetched with cp.async: K of the next chunk overlaps this chunk's
// P·V, V of the next chunk overlaps the next Q·Kᵀ.
//
// Split-K (attention_split + attention_merge, for decode and other small T): block z of gridDim.z
// takes every gridDim.z-th chunk of the same walk and writes its unnormalised partial state.

#define AT_THREADS 128
#define AT_ROWS 64
#define AT_KC 64            // keys per chunk
#define AT_MAXLD 136        // bf16 row stride of staged K/V for d = 128 (d + 8: conflict-free)
#define AT_INF 0x7fffffff

__device__ __forceinline__ u32 sp_smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void sp_cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void sp_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void sp_cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void sp_cp_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Two floats → bf16x2 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 sp_pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The bf16 A fragment of keys 16·ks .. 16·ks + 15 of P, held as S (n-tiles 2·ks and 2·ks + 1
// of an m16n8 accumulator), for P·V.
__device__ __forceinline__ void sp_p_frag(const float (&S)[8][4], int ks, u32& a0, u32& a1, u32& a2, u32& a3) {
    a0 = sp_pack_bf16(S[2 * ks][0], S[2 * ks][1]);
    a1 = sp_pack_bf16(S[2 * ks][2], S[2 * ks][3]);
    a2 = sp_pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
    a3 = sp_pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
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

// Per-thread softmax state of one warp's 16 rows: this thread holds rows gq and gq + 8.
struct SpRows {
    float m[2], l[2];  // running max (log2 units) and this thread's share of the row sum
    int t[2];          // positions (−1: not a row of the problem)
    bool sel[2];       // the row's query selected the current chunk's block (always true when dense)
};

// Part 1 of a chunk for one warp: S = Q Kᵀ over the warp's KS keys [kb, kb + KS) of the chunk,
// masked and exponentiated in place (S becomes P), running max / sum updated, O rescaled.
template <int KS>
__device__ __forceinline__ void sp_attn_qk(float (&S)[KS / 8][4], const u32 (&qa)[8][4], float (&O)[16][4],
                                           SpRows& rs, const bf16* Ks, int ld, int d, int kb, int k0,
                                           int klen, float sl2) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) S[nt][x] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        if (kk * 16 < d) {
#pragma unroll
            for (int nt = 0; nt < KS / 8; nt++) {
                // B fragment (Kᵀ, "col"): b0 = K[key gq][2tq, 2tq+1], b1 = K[key gq][2tq+8, +9].
                const bf16* kr = Ks + (kb + nt * 8 + gq) * ld + kk * 16 + 2 * tq;
                const u32 b0 = *(const u32*)kr, b1 = *(const u32*)(kr + 8);
                sp_mma(S[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
    }
    const float NEG = -__int_as_float(0x7f800000);
    float mx[2] = {NEG, NEG};
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x >> 1;
            const int col = kb + nt * 8 + 2 * tq + (x & 1);
            const bool ok = rs.sel[r] && col < klen && k0 + col <= rs.t[r];
            const float s = ok ? S[nt][x] * sl2 : NEG;
            S[nt][x] = s;
            mx[r] = fmaxf(mx[r], s);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float mu[2], alpha[2], rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float mn = fmaxf(rs.m[r], mx[r]);
        mu[r] = (mn == NEG) ? 0.0f : mn;  // a row with nothing yet: exp2(−inf − 0) = 0
        alpha[r] = exp2f(rs.m[r] - mu[r]);
        rs.m[r] = mn;
    }
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float p = exp2f(S[nt][x] - mu[x >> 1]);
            S[nt][x] = p;
            rsum[x >> 1] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) rs.l[r] = rs.l[r] * alpha[r] + rsum[r];
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        O[nt][0] *= alpha[0];
        O[nt][1] *= alpha[0];
        O[nt][2] *= alpha[1];
        O[nt][3] *= alpha[1];
    }
}

// Part 2: O += P V over the warp's keys [kb, kb + KS).
template <int KS>
__device__ __forceinline__ void sp_attn_pv(const float (&S)[KS / 8][4], float (&O)[16][4], const bf16* Vs,
                                           int ld, int d, int kb) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < KS / 16; ks++) {
        // A fragments (P, row-major 16×16) straight from the S accumulators, hi and lo parts.
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        sp_split2(S[2 * ks][0], S[2 * ks][1], h0, l0);          // row gq,     keys 2tq, 2tq+1
        sp_split2(S[2 * ks][2], S[2 * ks][3], h1, l1);          // row gq + 8, keys 2tq, 2tq+1
        sp_split2(S[2 * ks + 1][0], S[2 * ks + 1][1], h2, l2);  // row gq,     keys 2tq+8, +9
        sp_split2(S[2 * ks + 1][2], S[2 * ks + 1][3], h3, l3);  // row gq + 8, keys 2tq+8, +9
        const bf16* v0 = Vs + (kb + ks * 16 + 2 * tq) * ld + 2 * gq;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            if (m * 16 < d) {
                // Keys 2tq, 2tq+1 (+8, +9) at dims 16m + 2gq, +1: one word per key, then
                // byte-permute into the B fragments of tiles 2m (even dims) and 2m+1 (odd dims).
                const bf16* vp = v0 + 16 * m;
                const u32 x0 = *(const u32*)vp, x1 = *(const u32*)(vp + ld);
                const u32 y0 = *(const u32*)(vp + 8 * ld), y1 = *(const u32*)(vp + 9 * ld);
                const u32 be0 = __byte_perm(x0, x1, 0x5410), bo0 = __byte_perm(x0, x1, 0x7632);
                const u32 be1 = __byte_perm(y0, y1, 0x5410), bo1 = __byte_perm(y0, y1, 0x7632);
                sp_mma(O[2 * m], h0, h1, h2, h3, be0, be1);
                sp_mma(O[2 * m], l0, l1, l2, l3, be0, be1);
                sp_mma(O[2 * m + 1], h0, h1, h2, h3, bo0, bo1);
                sp_mma(O[2 * m + 1], l0, l1, l2, l3, bo0, bo1);
            }
        }
    }
}

// The whole attention of one block: tile blockIdx.x of the rows of KV group blockIdx.y, chunks
// z, z + n_split, ... of the walk. n_split == 1: writes `out`; else the partial state to `part`.
__device__ __forceinline__ void sp_attention_body(const bf16* q, const bf16* kcache, const bf16* vcache,
                                                  bf16* out, float* part, int T, int first_pos, int heads,
                                                  int kv_heads, int d, float scale, const int* blocks,
                                                  int k_sel, int block_size, int z, int n_split) {
    __shared__ __align__(16) bf16 at_kv[2 * AT_KC * AT_MAXLD];
    __shared__ float at_red_m[4 * AT_ROWS];
    __shared__ float at_red_l[4 * AT_ROWS];
    __shared__ int at_val[AT_ROWS];    // sparse: head of each query's block list (AT_INF: exhausted)
    __shared__ int at_desc[3];         // next chunk: k0, klen (0: none), block id

    const int G = heads / kv_heads;
    const int g = blockIdx.y;
    // Rows per block: as many as the grid implies (a multiple of 16, at most 64), so the host may
    // launch ⌈T·G/64⌉ (dense, default), ⌈T·G/32⌉ or ⌈T·G/16⌉ blocks (fewer queries per block).
    const int per = (T * G + gridDim.x - 1) / gridDim.x;
    const int rows_pb = min(AT_ROWS, (per + 15) & ~15);
    const int R0 = blockIdx.x * rows_pb;
    if (R0 >= T * G) return;
    const int nrows = min(rows_pb, T * G - R0);
    const int qfirst = R0 / G;
    const int qlast = (R0 + nrows - 1) / G;
    const int nq = qlast - qfirst + 1;  // ≤ 64
    const int t_max = first_pos + qlast;
    const bool sparse = blocks != 0;
    const int ld = d + 8;
    bf16* Ks = at_kv;
    bf16* Vs = at_kv + AT_KC * ld;
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    // Work split: few rows → the warps share rows and split each chunk's keys.
    const int KW = (nrows <= 16) ? 4 : (nrows <= 32) ? 2 : 1;
    const int RW = 4 / KW;
    const int rg = warp % RW, kw = warp / RW;
    const int KS = AT_KC / KW;
    const int kb = kw * KS;

    // This thread's two rows.
    SpRows rs;
    int rq[2], rh[2];
    const float NEG = -__int_as_float(0x7f800000);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;  // row within the tile
        const int R = R0 + rl;
        const bool valid = rl < nrows;
        rq[r] = valid ? R / G : qfirst;
        rh[r] = valid ? R % G : 0;
        rs.t[r] = valid ? first_pos + rq[r] : -1;
        rs.m[r] = NEG;
        rs.l[r] = 0.0f;
        rs.sel[r] = valid;
    }
    // Largest position among the warp's rows (−1: the warp has none).
    const int wl = min(16 * rg + 15, nrows - 1);
    const int warp_tmax = (16 * rg < nrows) ? first_pos + (R0 + wl) / G : -1;

    // Q fragments (A operand): a0 = (row gq, cols 2tq..), a1 = (row gq+8, ..), a2/a3 = cols + 8.
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            u32 v = 0;
            if (kk * 16 < d && rs.t[r] >= 0)
                v = *(const u32*)(q + (size_t)rq[r] * qw + (size_t)(g * G + rh[r]) * d + kk * 16 + c8 + 2 * tq);
            qa[kk][x] = v;
        }
    }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;

    // ---- chunk walk (run by warp 0; its state is in warp-uniform registers) ----
    int cur_b = -1, cur_off = 0, chunk_idx = 0;
    const int* blk = blocks + (size_t)g * k_sel;  // list of query i: blk + i*kv_heads*k_sel
    const size_t bstride = (size_t)kv_heads * k_sel;
    int ptr0 = 0, ptr1 = 0;  // warp 0: list positions of queries lane, lane + 32
    if (sparse && warp == 0) {
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int qq = lane + 32 * x;
            if (qq < nq) {
                const int v = blk[(size_t)(qfirst + qq) * bstride];
                at_val[qq] = (v < 0) ? AT_INF : v;
            }
        }
        __syncwarp();
    }
    // The next chunk of the walk → (k0, klen, b); klen == 0 at the end.
    auto walk = [&](int& k0, int& klen, int& b) {
        if (!sparse) {
            k0 = chunk_idx * AT_KC;
            klen = (k0 <= t_max) ? min(AT_KC, t_max + 1 - k0) : 0;
            b = -1;
            return;
        }
        if (cur_b >= 0) {
            const int bend = min((cur_b + 1) * block_size, t_max + 1);
            k0 = cur_b * block_size + cur_off;
            if (k0 < bend) {  // the next piece of a block longer than 64 keys
                cur_off += AT_KC;
                klen = min(AT_KC, bend - k0);
                b = cur_b;
                return;
            }
            // Pop cur_b from every list it heads.
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int qq = lane + 32 * x;
                if (qq < nq && at_val[qq] == cur_b) {
                    int& p = x ? ptr1 : ptr0;
                    p++;
                    const int v = (p < k_sel) ? blk[(size_t)(qfirst + qq) * bstride + p] : -1;
                    at_val[qq] = (v < 0) ? AT_INF : v;
                }
            }
        }
        int mn = AT_INF;
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int qq = lane + 32 * x;
            if (qq < nq) mn = min(mn, at_val[qq]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        if (mn == AT_INF) {
            cur_b = -1;
            k0 = 0;
            klen = 0;
            b = -1;
            return;
        }
        cur_b = mn;
        k0 = cur_b * block_size;
        klen = max(0, min(AT_KC, min((cur_b + 1) * block_size, t_max + 1) - k0));
        cur_off = AT_KC;
        b = cur_b;
    };
    // Warp 0: the next chunk of this block's share (index ≡ z mod n_split) → at_desc.
    auto advance = [&]() {
        int k0, klen, b;
        for (;;) {
            walk(k0, klen, b);
            const int idx = chunk_idx++;
            if (klen == 0 || idx % n_split == z) break;
        }
        if (lane == 0) {
            at_desc[0] = k0;
            at_desc[1] = klen;
            at_desc[2] = b;
        }
    };

    // Stages keys [k0, k0 + klen) of K or V (rows ≥ klen zero-filled) with cp.async.
    const int segs = d / 8;
    auto issue = [&](const bf16* src, bf16* dst, int k0, int klen) {
        if (klen > 0) {
            for (int x = tid; x < AT_KC * segs; x += AT_THREADS) {
                const int row = x / segs, sg = x % segs;
                const bool in = row < klen;
                const bf16* s = in ? src + (size_t)(k0 + row) * kvw + (size_t)g * d + sg * 8 : src;
                sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
            }
        }
        sp_cp_commit();
    };

    if (warp == 0) advance();
    __syncthreads();
    int c_k0 = at_desc[0], c_klen = at_desc[1], c_b = at_desc[2];
    issue(kcache, Ks, c_k0, c_klen);
    issue(vcache, Vs, c_k0, c_klen);

    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units: exp(x) = exp2(x·log2 e)
    while (c_klen > 0) {
        // Which of this thread's rows attend to the current chunk's block.
        if (sparse) {
#pragma unroll
            for (int r = 0; r < 2; r++) rs.sel[r] = rs.t[r] >= 0 && at_val[rq[r] - qfirst] == c_b;
        }
        const bool work = (warp_tmax >= c_k0) && kb < c_klen &&
                          __any_sync(0xffffffffu, rs.sel[0] || rs.sel[1]);
        __syncthreads();  // at_desc / at_val read by all
        if (warp == 0) advance();
        sp_cp_wait1();    // K of this chunk (this thread's copies) ...
        __syncthreads();  // ... and everyone's; the next chunk's descriptor visible
        const int n_k0 = at_desc[0], n_klen = at_desc[1], n_b = at_desc[2];

        float S64[8][4];
        float S32[4][4];
        float S16[2][4];
        if (work) {
            if (KW == 1) sp_attn_qk<64>(S64, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
            else if (KW == 2) sp_attn_qk<32>(S32, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
            else sp_attn_qk<16>(S16, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
        }
        __syncthreads();  // K buffer free
        issue(kcache, Ks, n_k0, n_klen);
        sp_cp_wait1();    // V of this chunk
        __syncthreads();
        if (work) {
            if (KW == 1) sp_attn_pv<64>(S64, O, Vs, ld, d, kb);
            else if (KW == 2) sp_attn_pv<32>(S32, O, Vs, ld, d, kb);
            else sp_attn_pv<16>(S16, O, Vs, ld, d, kb);
        }
        __syncthreads();  // V buffer free
        issue(vcache, Vs, n_k0, n_klen);
        c_k0 = n_k0;
        c_klen = n_klen;
        c_b = n_b;
    }
    sp_cp_wait0();

    // Row sums: reduce over the 4 threads of a row.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
    }

    if (KW == 1) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (rs.t[r] < 0) continue;
            const size_t row = (size_t)rq[r] * heads + g * G + rh[r];
            if (n_split == 1) {
                sp_store_row(O, r, 1.0f / rs.l[r], out + row * d + 4 * tq, d);
            } else {
                float* pp = part + ((size_t)z * T * heads + row) * (d + 2);
#pragma unroll
                for (int nt = 0; nt < 16; nt++)
                    if (nt * 8 < d) {
                        pp[sp_o_dim(nt, 0, tq)] = O[nt][2 * r];
                        pp[sp_o_dim(nt, 1, tq)] = O[nt][2 * r + 1];
                    }
                if (tq == 0) {
                    pp[d] = rs.m[r];
                    pp[d + 1] = rs.l[r];
                }
            }
        }
        return;
    }

    // Merge the KW partial states of each row (shared memory reused: the K/V stage is idle).
    __syncthreads();
    const int RU = 16 * RW;        // rows in use (every row of the tile is < RU)
    float* red_o = (float*)at_kv;  // [KW][RU][d] fp32 = 64·d floats ≤ 2·64·(d+8) bf16
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;
        if (tq == 0) at_red_m[kw * AT_ROWS + rl] = rs.m[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;
        float M = NEG;
        for (int x = 0; x < KW; x++) M = fmaxf(M, at_red_m[x * AT_ROWS + rl]);
        const float f = (rs.m[r] == NEG) ? 0.0f : exp2f(rs.m[r] - M);
        if (tq == 0) at_red_l[kw * AT_ROWS + rl] = rs.l[r] * f;
        float* dst = red_o + ((size_t)kw * RU + rl) * d;
#pragma unroll
        for (int nt = 0; nt < 16; nt++)
            if (nt * 8 < d) {
                dst[sp_o_dim(nt, 0, tq)] = O[nt][2 * r] * f;
                dst[sp_o_dim(nt, 1, tq)] = O[nt][2 * r + 1] * f;
            }
    }
    __syncthreads();
    const int half = d / 2;
    for (int x = tid; x < nrows * half; x += AT_THREADS) {
        const int rl = x / half, e = 2 * (x % half);
        float L = 0.0f, o0 = 0.0f, o1 = 0.0f, M = NEG;
        for (int y = 0; y < KW; y++) {
            L += at_red_l[y * AT_ROWS + rl];
            M = fmaxf(M, at_red_m[y * AT_ROWS + rl]);
            const float* src = red_o + ((size_t)y * RU + rl) * d + e;
            o0 += src[0];
            o1 += src[1];
        }
        const int R = R0 + rl;
        const size_t row = (size_t)(R / G) * heads + g * G + R % G;
        if (n_split == 1) {
            const float inv = 1.0f / L;
            *(u32*)(out + row * d + e) = (u32)f2bf(o0 * inv) | ((u32)f2bf(o1 * inv) << 16);
        } else {
            float* pp = part + ((size_t)z * T * heads + row) * (d + 2);
            pp[e] = o0;
            pp[e + 1] = o1;
            if (e == 0) {
                pp[d] = M;
                pp[d + 1] = L;
            }
        }
    }
}

// Causal softmax attention of the T queries (positions first_pos + i) of every head over the
// cache: blocks == NULL → all keys j ≤ t (dense); else, for query i and KV group g, the keys of
// the selected blocks b = blocks[(i*kv_heads + g)*k_sel + s] ≥ 0, i.e. [b*block_size,
// min((b+1)*block_size, t+1)). fp32 scores and online softmax; out [T, heads*d] bf16.
// launch: grid = ((T * (heads / kv_heads) + 63) / 64, kv_heads), block = 128, dynamic smem = 0 bytes
//   (static shared memory 37,136 bytes. grid.x = ⌈T·G/32⌉ or ⌈T·G/16⌉ also works: the kernel takes
//    16·⌈T·G/(16·grid.x)⌉ rows per block, which must be ≤ 64; 64 measured fastest, also for sparse.)
extern "C" __global__ void __launch_bounds__(AT_THREADS)
attention(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos, int heads,
          int kv_heads, int d, float scale, const int* blocks, int k_sel, int block_size) {
    sp_attention_body(q, kcache, vcache, out, 0, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel,
                      block_size, 0, 1);
}

// Split-K variant of `attention` (same arguments, same result after attention_merge) for small T
// (decode), where `attention` would run only kv_heads·⌈T·G/64⌉ blocks. Block z of n_split takes
// every n_split-th 64-key chunk and writes, for each row (query i, head h), its unnormalised
// partial state to part[((z*T + i)*heads + h)*(d + 2) ..]: d fp32 values of O, then m (running
// max, log2 units; −inf if the split saw no key of the row) and l (Σ exp2(s − m)).
// part holds n_split*T*heads*(d + 2) floats. Any n_split ≥ 1 is correct; a good choice is about
// 2·132 / (grid.x·grid.y), at most the number of chunks (dense: ⌈(first_pos+T)/64⌉; sparse: about
// k_sel·⌈block_size/64⌉).
// launch: grid = ((T * (heads / kv_heads) + 63) / 64, kv_heads, n_split), block = 128, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AT_THREADS)
attention_split(const bf16* q, const bf16* kcache, const bf16* vcache, float* part, int T, int first_pos,
                int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int block_size,
                int n_split) {
    sp_attention_body(q, kcache, vcache, 0, part, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel,
                      block_size, blockIdx.z, n_split);
}

// Merges the n_split partial states of attention_split into out [T, heads*d] (bf16).
// launch: grid = (T * heads), block = d, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(128)
attention_merge(const float* part, bf16* out, int T, int heads, int d, int n_split) {
    const int row = blockIdx.x, e = threadIdx.x;
    if (e >= d) return;
    const size_t zstride = (size_t)T * heads * (d + 2);
    const float* p = part + (size_t)row * (d + 2);
    float M = -__int_as_float(0x7f800000);
#pragma unroll 8
    for (int z = 0; z < n_split; z++) M = fmaxf(M, p[z * zstride + d]);
    float L = 0.0f, o = 0.0f;
#pragma unroll 8
    for (int z = 0; z < n_split; z++) {
        const float* pz = p + z * zstride;
        const float mz = pz[d];
        if (mz == -__int_as_float(0x7f800000)) continue;
        const float f = exp2f(mz - M);
        L += pz[d + 1] * f;
        o += pz[e] * f;
    }
    out[(size_t)row * d + e] = f2bf(o / L);
}

// ============================================================================================
// 4. Stage 1 on tensor cores (prefill): block scores of every candidate block, then top-k
// ============================================================================================
//
// The same scores as sparse_select up to float rounding (bf16 MMAs with fp32 accumulation, exp2
// instead of correctly rounded exp), so a near-tie may select a different block of (almost) the
// same score; sparse_select stays the bit-exact twin of the CPU. A warp owns one query token: its
// 16 MMA rows are the token's query heads of one KV group (rows ≥ heads/kv_heads are padding).
// The block's SQ_WARPS consecutive tokens share every compressed-key tile staged in shared memory.

#define SQ_WARPS 8
#define SQ_KC 64  // compressed keys per staged tile

// Stages keys [c0, c0 + n) of KV group g of a compressed tier (rows ≥ n zero-filled), cp.async.
__device__ __forceinline__ void sq_issue(const bf16* src, size_t kvw, int g, int d, bf16* dst, int ld, int c0,
                                         int n) {
    const int segs = d / 8;
    for (int x = threadIdx.x; x < SQ_KC * segs; x += SQ_WARPS * 32) {
        const int row = x / segs, sg = x % segs;
        const bool in = row < n;
        const bf16* s = in ? src + (size_t)(c0 + row) * kvw + (size_t)g * d + sg * 8 : src;
        sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
    }
    sp_cp_commit();
}

#define SQ_TW 2  // query tokens per warp (MMA row tiles)

// A block-score kernel's view of its tokens: for token m of the warp (query i = blockIdx.x·16 +
// SQ_TW·warp + m at position tt[m], block qb; past the chunk's end, its last query's position),
// whether it selects at all (act: i < T and qb ≥ k_sel), its candidate blocks [init_blocks,
// cand_hi) (none if inactive) and visible level-2 windows n2v; for the warp, the largest
// cand_hi (cand_max); for the block, how many level-1 / level-2 windows its last token needs
// (the loops grow with t). w: level-1 windows per block.
struct SqTokens {
    int tt[SQ_TW], cand_hi[SQ_TW], n2v[SQ_TW];
    bool act[SQ_TW];
    bool any;
    int cand_max, n1_all, n2_all;
};

__device__ __forceinline__ SqTokens sq_tokens(int T, int first_pos, int n1, int n2, int block_size, int w,
                                              int k2_window, int k2_stride, int local_blocks, int k_sel) {
    const int warp = threadIdx.x >> 5, per_block = SQ_WARPS * SQ_TW;
    SqTokens tk;
    tk.any = false;
    tk.cand_max = 0;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++) {
        const int i = blockIdx.x * per_block + SQ_TW * warp + m;
        tk.tt[m] = first_pos + min(i, T - 1);
        const int qb = tk.tt[m] / block_size;
        tk.act[m] = i < T && qb >= k_sel;
        tk.any |= tk.act[m];
        tk.cand_hi[m] = tk.act[m] ? max(qb - local_blocks, 0) : 0;
        tk.cand_max = max(tk.cand_max, tk.cand_hi[m]);
        tk.n2v[m] = min(sp_visible(tk.tt[m], k2_window, k2_stride), n2);
    }
    const int t_last = first_pos + min((int)(blockIdx.x + 1) * per_block, T) - 1;
    const int qb_last = t_last / block_size;
    tk.n2_all = min(sp_visible(t_last, k2_window, k2_stride), n2);
    tk.n1_all = (qb_last >= k_sel) ? min(w * max(qb_last - local_blocks, 0), n1) : 0;
    return tk;
}

// Walks keys [0, n) of KV group g of a compressed tier in staged tiles of SQ_KC (double-buffered,
// cp.async): body(tile, c0) runs with keys c0 .. c0 + SQ_KC − 1 in shared memory (rows ≥ n zero)
// between two block barriers. Every thread calls.
template <class Body>
__device__ __forceinline__ void sq_walk(const bf16* src, size_t kvw, int g, int d, bf16* smem, int ld, int n,
                                        Body&& body) {
    int buf = 0;
    sq_issue(src, kvw, g, d, smem, ld, 0, min(SQ_KC, n));
    for (int c0 = 0; c0 < n; c0 += SQ_KC) {
        const int nxt = c0 + SQ_KC;
        if (nxt < n) sq_issue(src, kvw, g, d, smem + (buf ^ 1) * SQ_KC * ld, ld, nxt, min(SQ_KC, n - nxt));
        else sp_cp_commit();
        sp_cp_wait1();
        __syncthreads();
        body(smem + buf * SQ_KC * ld, c0);
        __syncthreads();  // buffer `buf` free
        buf ^= 1;
    }
    sp_cp_wait0();
}

// S[m] = Q_m Kᵀ for the warp's SQ_TW row tiles and the 32 staged keys [32·half, 32·half + 32)
// (4 n-tiles); each B fragment is loaded once for both row tiles.
__device__ __forceinline__ void sq_qk(float (&S)[SQ_TW][4][4], const u32 (&qa)[SQ_TW][8][4], const bf16* Ks,
                                      int ld, int d, int half) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) S[m][nt][x] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            if (kk * 16 < d) {
                const bf16* kr = Ks + (32 * half + nt * 8 + gq) * ld + kk * 16 + 2 * tq;
                const u32 b0 = *(const u32*)kr, b1 = *(const u32*)(kr + 8);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++)
                    sp_mma(S[m][nt], qa[m][kk][0], qa[m][kk][1], qa[m][kk][2], qa[m][kk][3], b0, b1);
            }
        }
    }
}

// Sum over the warp's 16 rows of v[j] (j = 2·nt + c: column 8nt + 2tq + c, each thread holding
// rows gq and gq + 8 already added), as a butterfly over the lane bits of gq: 7 shuffles. The
// lane ends with the total of column 8·(gq >> 1) + 2tq + (gq & 1).
__device__ __forceinline__ float sq_row_sum(float (&v)[8]) {
    const int gq = (threadIdx.x & 31) >> 2;
    const bool b2 = gq & 4, b1 = gq & 2, b0 = gq & 1;
    float u[4], w[2];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float send = b2 ? v[j] : v[j + 4];
        u[j] = (b2 ? v[j + 4] : v[j]) + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float send = b1 ? u[j] : u[j + 2];
        w[j] = (b1 ? u[j + 2] : u[j]) + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    const float send = b0 ? w[0] : w[1];
    return (b0 ? w[1] : w[0]) + __shfl_xor_sync(0xffffffffu, send, 4);
}

// For query i = blockIdx.x·SQ_WARPS·SQ_TW + SQ_TW·warp + m (m < SQ_TW; position t = first_pos + i,
// block qb = t / block_size) and KV group g = blockIdx.y, with qb ≥ k_sel: the score of every
// candidate block b ∈ [init_blocks, qb − local_blocks), max of P over its level-1 windows
// [w·b − 1, w·b + w − 1] (w = block_size / k1_stride), into bs[(i·kv_heads + g)·bs_stride + b].
// P is the stage-1 probability (SPEC §5.4): Σ over the group's heads of exp(s·q·K1 − LSE₂),
// rounded to bf16. Needs heads / kv_heads ≤ 16, d a multiple of 16 and ≤ 128, 64 a multiple of w.
// launch: grid = ((T + 15) / 16, kv_heads), block = 32·SQ_WARPS, dynamic smem = 0 bytes
//   (static shared memory 2·64·136·2 + 16·65·4 = 38,976 bytes)
extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32)
select_scores_mma(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos, int heads,
                  int kv_heads, int d, float scale, int block_size, int k1_stride, int k2_window, int k2_stride,
                  int init_blocks, int local_blocks, int k_sel, float* bs, int bs_stride) {
    __shared__ __align__(16) bf16 sq_kv[2 * SQ_KC * AT_MAXLD];
    __shared__ float sq_p[SQ_WARPS * SQ_TW][SQ_KC + 1];
    const int G = heads / kv_heads, g = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int w = block_size / k1_stride;
    const size_t kvw = (size_t)kv_heads * d;
    const int ld = d + 8;
    const float NEG = -__int_as_float(0x7f800000);
    const int per_block = SQ_WARPS * SQ_TW;

    const SqTokens tk = sq_tokens(T, first_pos, n1, n2, block_size, w, k2_window, k2_stride, local_blocks, k_sel);
    const int (&tt)[SQ_TW] = tk.tt, (&cand_hi)[SQ_TW] = tk.cand_hi, (&n2v)[SQ_TW] = tk.n2v;
    const bool(&act)[SQ_TW] = tk.act;
    const bool any = tk.any;
    if (tk.n1_all == 0 || tk.n2_all == 0) return;  // block-uniform

    u32 qa[SQ_TW][8][4];
    bool row_ok[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) row_ok[m][r] = act[m] && gq + 8 * r < G;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int kk = 0; kk < 8; kk++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int r = x & 1, c8 = (x >> 1) * 8;
                u32 v = 0;
                if (kk * 16 < d && row_ok[m][r])
                    v = *(const u32*)(q + (size_t)(tt[m] - first_pos) * heads * d +
                                      (size_t)(g * G + gq + 8 * r) * d + kk * 16 + c8 + 2 * tq);
                qa[m][kk][x] = v;
            }
    const float sl2 = scale * 1.4426950408889634f;
    float S[SQ_TW][4][4];

    // Pass 1: LSE₂ of each row over the visible level-2 keys (online, log2 units).
    float mrow[SQ_TW][2], lrow[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mrow[m][r] = NEG;
            lrow[m][r] = 0.0f;
        }
    sq_walk(k2, kvw, g, d, sq_kv, ld, tk.n2_all, [&](const bf16* tile, int c0) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if (any && c0 + 32 * half < n2v[SQ_TW - 1]) {
                sq_qk(S, qa, tile, ld, d, half);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++) {
                    float mx[2] = {NEG, NEG};
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int x = 0; x < 4; x++) {
                            const int col = c0 + 32 * half + nt * 8 + 2 * tq + (x & 1);
                            const float sv = (col < n2v[m]) ? S[m][nt][x] * sl2 : NEG;
                            S[m][nt][x] = sv;
                            mx[x >> 1] = fmaxf(mx[x >> 1], sv);
                        }
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                        const float mn = fmaxf(mrow[m][r], mx[r]);
                        const float mu = (mn == NEG) ? 0.0f : mn;
                        lrow[m][r] *= exp2f(mrow[m][r] - mu);
                        mrow[m][r] = mn;
                    }
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int x = 0; x < 4; x++) {
                            const float mu = (mrow[m][x >> 1] == NEG) ? 0.0f : mrow[m][x >> 1];
                            lrow[m][x >> 1] += exp2f(S[m][nt][x] - mu);
                        }
                }
            }
        }
    });
    float lse[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = lrow[m][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            // Padding rows and inactive tokens get +inf, so their probabilities are 0.
            lse[m][r] = row_ok[m][r] ? mrow[m][r] + __log2f(l) : __int_as_float(0x7f800000);
        }

    // Pass 2: P of each level-1 window (sum over the rows), max-pooled into block scores.
    // pw[m][0]: the previous tile's last window; pw[m][1 + x]: window c0 + x.
    float* pw0 = sq_p[SQ_TW * warp];
    if (lane < SQ_TW) pw0[lane * (SQ_KC + 1)] = NEG;
    __syncthreads();
    sq_walk(k1, kvw, g, d, sq_kv, ld, tk.n1_all, [&](const bf16* tile, int c0) {
        if (any && c0 < w * tk.cand_max) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                sq_qk(S, qa, tile, ld, d, half);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++) {
                    float v[8];
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int c = 0; c < 2; c++)
                            v[2 * nt + c] = exp2f(S[m][nt][c] * sl2 - lse[m][0]) +
                                            exp2f(S[m][nt][2 + c] * sl2 - lse[m][1]);
                    const float r = round_bf(sq_row_sum(v));
                    const int col = 8 * (gq >> 1) + 2 * tq + (gq & 1);
                    pw0[m * (SQ_KC + 1) + 1 + 32 * half + col] = (r != r) ? 0.0f : r;
                }
            }
            __syncwarp();
            const int b0 = c0 / w, nbt = SQ_KC / w;
            for (int x = lane; x < SQ_TW * nbt; x += 32) {
                const int m = x / nbt, bl = x % nbt;
                const int b = b0 + bl;
                int ch = cand_hi[0];
#pragma unroll
                for (int mm = 1; mm < SQ_TW; mm++)
                    if (mm == m) ch = cand_hi[mm];
                if (b >= init_blocks && b < ch) {
                    const float* pm = pw0 + m * (SQ_KC + 1);
                    float mx = NEG;
                    for (int y = w * bl; y <= w * bl + w; y++) mx = fmaxf(mx, pm[y]);
                    const int i = blockIdx.x * per_block + SQ_TW * warp + m;
                    bs[((size_t)i * kv_heads + g) * bs_stride + b] = mx;
                }
            }
            __syncwarp();
            if (lane < SQ_TW) pw0[lane * (SQ_KC + 1)] = pw0[lane * (SQ_KC + 1) + SQ_KC];
            __syncwarp();
        }
    });
}

// Block selection from the scores of select_scores_mma: for pair (query i, KV group g) =
// (blockIdx.x / kv_heads, blockIdx.x % kv_heads), the k_sel ascending block ids (−1 padded) into
// blocks_out[blockIdx.x·k_sel ..], by the rule of sparse_select (forced blocks, then the best
// others by score, ties to the lower index).
// launch: grid = (T * kv_heads), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(SS_THREADS)
select_topk_scores(const float* bs, int bs_stride, int first_pos, int kv_heads, int block_size, int k1_stride,
                   int init_blocks, int local_blocks, int k_sel, int* blocks_out) {
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

// ============================================================================================
// 5. attention_prefill: causal attention of many queries over 64-key blocks, tensor cores
// ============================================================================================
//
// A block owns AP_WARPS consecutive queries of one KV group; warp w owns query i0 + w, its MMA
// rows being that query's heads of the group (rows ≥ heads / kv_heads are padding). The block
// walks, in ascending order, the union of its queries' selected blocks (dense: every block up to
// the last query's), staging each block's K and V once for all warps; a warp whose query did not
// select the block skips it. S = Q Kᵀ and O += P V on bf16 tensor cores with fp32 accumulation,
// online softmax in fp32 (P rounded to bf16 for the P·V product, as flash attention does). K of
// the next block loads during this block's P·V, V of the next block during the next Q·Kᵀ.

#define AP_WARPS 8
#define AP_UNION (AP_WARPS * 128)  // most blocks in a union (k_sel ≤ 128)

// O += P V for the warp's 16 rows over the 64 staged keys; P (bf16-rounded) from the S
// accumulators of sp_attn_qk. O's dims are laid out as sp_o_dim says.
__device__ __forceinline__ void ap_pv(const float (&S)[8][4], float (&O)[16][4], const bf16* Vs, int ld, int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        u32 a0, a1, a2, a3;
        sp_p_frag(S, ks, a0, a1, a2, a3);
        const bf16* v0 = Vs + (ks * 16 + 2 * tq) * ld + 2 * gq;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            if (m * 16 < d) {
                const bf16* vp = v0 + 16 * m;
                const u32 x0 = *(const u32*)vp, x1 = *(const u32*)(vp + ld);
                const u32 y0 = *(const u32*)(vp + 8 * ld), y1 = *(const u32*)(vp + 9 * ld);
                sp_mma(O[2 * m], a0, a1, a2, a3, __byte_perm(x0, x1, 0x5410), __byte_perm(y0, y1, 0x5410));
                sp_mma(O[2 * m + 1], a0, a1, a2, a3, __byte_perm(x0, x1, 0x7632), __byte_perm(y0, y1, 0x7632));
            }
        }
    }
}

// Causal softmax attention of the T queries (positions first_pos + i, keys already cached):
// blocks == NULL → every key j ≤ t; else query i of KV group g attends to the keys j ≤ t of its
// selected 64-key blocks blocks[(i·kv_heads + g)·k_sel + s] ≥ 0 (ascending). out [T, heads·d] bf16.
// Needs heads / kv_heads ≤ 16, d a multiple of 16 and ≤ 128, k_sel ≤ 128.
// launch: grid = ((T + AP_WARPS − 1) / AP_WARPS, kv_heads), block = 32·AP_WARPS,
//         dynamic smem = 4·⌈nb / 32⌉ bytes, nb = ⌈(first_pos + T) / 64⌉ (a bitmap of blocks)
//   (static shared memory 2·64·136·2 + 4·1024 + 40 = 38,952 bytes)
extern "C" __global__ void __launch_bounds__(AP_WARPS * 32, 1)
attention_prefill(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos,
                  int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel) {
    extern __shared__ u32 ap_bits[];
    __shared__ __align__(16) bf16 ap_k[64 * AT_MAXLD];
    __shared__ __align__(16) bf16 ap_v[64 * AT_MAXLD];
    __shared__ int ap_union[AP_UNION];
    __shared__ int ap_scan[9];
    const int G = heads / kv_heads, g = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int ld = d + 8;
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;
    const int i0 = blockIdx.x * AP_WARPS;
    const int ntok = min(AP_WARPS, T - i0);
    const int t_last = first_pos + i0 + ntok - 1;
    const int n_keys = first_pos + T;  // keys in the cache
    const bool sparse = blocks != 0;

    // The walk: sparse → the sorted union of the block's lists; dense → blocks 0 .. t_last / 64.
    int nu = t_last / 64 + 1;
    if (sparse) {
        const int words = (nu + 31) / 32;
        for (int x = tid; x < words; x += AP_WARPS * 32) ap_bits[x] = 0u;
        __syncthreads();
        for (int x = tid; x < ntok * k_sel; x += AP_WARPS * 32) {
            const int b = blocks[((size_t)(i0 + x / k_sel) * kv_heads + g) * k_sel + x % k_sel];
            if (b >= 0 && b < nu) atomicOr(&ap_bits[b >> 5], 1u << (b & 31));
        }
        __syncthreads();
        const int per = (words + AP_WARPS * 32 - 1) / (AP_WARPS * 32);
        int cnt = 0;
        for (int x = tid * per; x < min(words, tid * per + per); x++) cnt += __popc(ap_bits[x]);
        int total;
        int pos = sp_scan256(cnt, ap_scan, &total);
        for (int x = tid * per; x < min(words, tid * per + per); x++) {
            u32 w = ap_bits[x];
            while (w) {
                const int bit = __ffs(w) - 1;
                w &= w - 1;
                if (pos < AP_UNION) ap_union[pos] = 32 * x + bit;
                pos++;
            }
        }
        nu = min(total, AP_UNION);
        __syncthreads();
    }

    // This warp's query, rows and Q fragments.
    const int i = i0 + warp;
    const bool active = warp < ntok;
    const int t = first_pos + (active ? i : i0);
    SpRows rs;
    const float NEG = -__int_as_float(0x7f800000);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = active && gq + 8 * r < G;
        rs.t[r] = ok ? t : -1;
        rs.m[r] = NEG;
        rs.l[r] = 0.0f;
        rs.sel[r] = ok;
    }
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            u32 v = 0;
            if (kk * 16 < d && rs.t[r] >= 0)
                v = *(const u32*)(q + (size_t)i * qw + (size_t)(g * G + gq + 8 * r) * d + kk * 16 + c8 + 2 * tq);
            qa[kk][x] = v;
        }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;
    // Sparse: the next block of this warp's list (INT_MAX when exhausted).
    const int* my = blocks + ((size_t)i * kv_heads + g) * k_sel;
    int ptr = 0, next_sel = AT_INF;
    if (sparse && active) {
        const int b = my[0];
        next_sel = b < 0 ? AT_INF : b;
    }

    const int segs = d / 8;
    auto issue = [&](const bf16* src, bf16* dst, int j) {
        if (j < nu) {
            const int k0 = 64 * (sparse ? ap_union[j] : j);
            const int klen = min(64, n_keys - k0);
            for (int x = tid; x < 64 * segs; x += AP_WARPS * 32) {
                const int row = x / segs, sg = x % segs;
                const bool in = row < klen;
                const bf16* s = in ? src + (size_t)(k0 + row) * kvw + (size_t)g * d + sg * 8 : src;
                sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
            }
        }
        sp_cp_commit();
    };
    const float sl2 = scale * 1.4426950408889634f;
    float S[8][4];
    issue(kcache, ap_k, 0);
    issue(vcache, ap_v, 0);
    for (int j = 0; j < nu; j++) {
        const int b = sparse ? ap_union[j] : j;
        const int k0 = 64 * b;
        const bool sel = active && (sparse ? next_sel == b : k0 <= t);
        sp_cp_wait1();  // K of block j
        __syncthreads();
        if (sel) sp_attn_qk<64>(S, qa, O, rs, ap_k, ld, d, 0, k0, min(64, n_keys - k0), sl2);
        __syncthreads();  // K buffer free
        issue(kcache, ap_k, j + 1);
        sp_cp_wait1();  // V of block j
        __syncthreads();
        if (sel) ap_pv(S, O, ap_v, ld, d);
        __syncthreads();  // V buffer free
        issue(vcache, ap_v, j + 1);
        if (sparse && sel) {
            ptr++;
            const int nb = ptr < k_sel ? my[ptr] : -1;
            next_sel = nb < 0 ? AT_INF : nb;
        }
    }
    sp_cp_wait0();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
        if (rs.t[r] < 0) continue;
        sp_store_row(O, r, 1.0f / rs.l[r], out + (size_t)i * qw + (size_t)(g * G + gq + 8 * r) * d + 4 * tq, d);
    }
}

// ============================================================================================
// 6. attention_gather: sparse attention of many queries, one warp per (query, KV group)
// ============================================================================================
//
// Neighbouring queries may select different blocks (with random weights, mostly different), so
// staging a block once for several queries saves little; here every warp walks its own list,
// reading K and V straight from global memory (L2) with 16-byte loads and no block-wide
// synchronisation. The warp's 16 MMA rows are the query's heads of the group.
// Fragment layouts (d a multiple of 64): for Q·Kᵀ, k-step 2p + h covers dims 32p + 8tq + 4h + {0..3}
// (a permutation of the 16 dims of a k-step, applied to Q and K alike), so one 16-byte load of
// K[key][32p + 8tq ..] feeds two k-steps. For P·V, output n-tile 8u + e, column n is dim
// 64u + 8n + e, so one 16-byte load of V[key][64u + 8gq ..] feeds eight n-tiles.

#define AG_WARPS 4

// Q fragments of one query's heads of a KV group (`qg`: the group's first head, G heads of d;
// MMA rows ≥ G are zero), k-steps permuted as above. d a multiple of 32, at most 128.
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

// A warp's attention state for one query's heads of a KV group: O (dims as ag_dim says), and per
// MMA row r (heads gq, gq + 8) the running max m (log2 units) and this lane's part of Σ exp2.
struct AgState {
    float O[16][4];
    float m[2], l[2];
};

__device__ __forceinline__ void ag_init(AgState& st) {
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) st.O[nt][x] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        st.m[r] = -__int_as_float(0x7f800000);
        st.l[r] = 0.0f;
    }
}

// The dim of accumulator O[8u + 2c + y][2r + half]: thread (gq, tq) holds, per u, dims
// 64u + 16tq + {0..7} (half 0) and 64u + 16tq + 8 + {0..7} (half 1), element 2c + y.
__device__ __forceinline__ int ag_dim(int u, int c, int y, int half, int tq) {
    return 64 * u + 16 * tq + 8 * half + 2 * c + y;
}

// Attends the warp's query (position t; padding rows masked by row_ok) to the keys
// [k0, k0 + 64) ∩ [0, min(t + 1, k0 + n_valid)) of its KV group: kb, vb point at key k0's row of
// K and V (row stride kvw; rows ≥ n_valid are not read). S = Q·Kᵀ,
// online softmax in log2 units, O += P·V (P rounded to bf16).
__device__ __forceinline__ void ag_block(AgState& st, const u32 (&qa)[8][4], const bf16* kb, const bf16* vb,
                                         size_t kvw, int k0, int t, int n_valid, const bool (&row_ok)[2],
                                         float sl2, int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const float NEG = -__int_as_float(0x7f800000);
    const int last = min(n_valid, 64) - 1;
    float S[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) sp_qk_perm(S[nt], qa, kb + (size_t)min(8 * nt + gq, last) * kvw, d);
    float mx[2] = {NEG, NEG};
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x >> 1;
            const int j = 8 * nt + 2 * tq + (x & 1);
            const bool ok = row_ok[r] && k0 + j <= t && j <= last;
            S[nt][x] = ok ? S[nt][x] * sl2 : NEG;
            mx[r] = fmaxf(mx[r], S[nt][x]);
        }
    float alpha[2], mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = fmaxf(st.m[r], mx[r]);
        mu[r] = (mn == NEG) ? 0.0f : mn;
        alpha[r] = exp2f(st.m[r] - mu[r]);
        st.m[r] = mn;
    }
    float rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float e = exp2f(S[nt][x] - mu[x >> 1]);
            S[nt][x] = e;
            rsum[x >> 1] += e;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) st.l[r] = st.l[r] * alpha[r] + rsum[r];
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        st.O[nt][0] *= alpha[0];
        st.O[nt][1] *= alpha[0];
        st.O[nt][2] *= alpha[1];
        st.O[nt][3] *= alpha[1];
    }
    // O += P V.
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        u32 a0, a1, a2, a3;
        sp_p_frag(S, ks, a0, a1, a2, a3);
        const int j = 16 * ks + 2 * tq;
        const int keys[4] = {min(j, last), min(j + 1, last), min(j + 8, last), min(j + 9, last)};
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (64 * u < d) {
                uint4 v[4];
#pragma unroll
                for (int y = 0; y < 4; y++) v[y] = *(const uint4*)(vb + (size_t)keys[y] * kvw + 64 * u + 8 * gq);
                const u32 w0[4] = {v[0].x, v[0].y, v[0].z, v[0].w}, w1[4] = {v[1].x, v[1].y, v[1].z, v[1].w};
                const u32 w2[4] = {v[2].x, v[2].y, v[2].z, v[2].w}, w3[4] = {v[3].x, v[3].y, v[3].z, v[3].w};
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    sp_mma(st.O[8 * u + 2 * c], a0, a1, a2, a3, __byte_perm(w0[c], w1[c], 0x5410),
                           __byte_perm(w2[c], w3[c], 0x5410));
                    sp_mma(st.O[8 * u + 2 * c + 1], a0, a1, a2, a3, __byte_perm(w0[c], w1[c], 0x7632),
                           __byte_perm(w2[c], w3[c], 0x7632));
                }
            }
        }
    }
}

// Sums l over the quad of lanes that share a row (every lane calls).
__device__ __forceinline__ void ag_sum_l(AgState& st) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    }
}

// After ag_sum_l: each valid row r's O / l as bf16 at orow(r).
template <class ORow>
__device__ __forceinline__ void ag_store_out(const AgState& st, const bool (&row_ok)[2], int d, ORow&& orow) {
    const int tq = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!row_ok[r]) continue;
        const float inv = 1.0f / st.l[r];
        bf16* op = orow(r);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (64 * u < d) {
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    uint4 w;
                    u32* wp = (u32*)&w;
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        wp[c] = (u32)f2bf(st.O[8 * u + 2 * c][2 * r + half] * inv) |
                                ((u32)f2bf(st.O[8 * u + 2 * c + 1][2 * r + half] * inv) << 16);
                    *(uint4*)(op + ag_dim(u, 0, 0, half, tq)) = w;
                }
            }
        }
    }
}

// After ag_sum_l: each valid row r's unnormalised state at prow(r): d fp32 values of O, then
// m and l (attention_split's partial format).
template <class PRow>
__device__ __forceinline__ void ag_store_partial(const AgState& st, const bool (&row_ok)[2], int d, PRow&& prow) {
    const int tq = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!row_ok[r]) continue;
        float* pp = prow(r);
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (64 * u < d)
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        *(float2*)(pp + ag_dim(u, c, 0, half, tq)) =
                            make_float2(st.O[8 * u + 2 * c][2 * r + half], st.O[8 * u + 2 * c + 1][2 * r + half]);
        if (tq == 0) {
            pp[d] = st.m[r];
            pp[d + 1] = st.l[r];
        }
    }
}

// The indices and strides of a warp's pair (query i, KV group g) = (pair / kv_heads,
// pair % kv_heads); ag_pair also loads its Q fragments.
struct AgPair {
    int i, g, t, n_keys;
    size_t kvw, qw;
    bool row_ok[2];
};

__device__ __forceinline__ AgPair ag_pair(const bf16* q, int pair, int T, int first_pos, int heads, int kv_heads,
                                          int d, u32 (&qa)[8][4]) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    AgPair p;
    p.i = pair / kv_heads;
    p.g = pair % kv_heads;
    p.t = first_pos + p.i;
    p.n_keys = first_pos + T;
    p.kvw = (size_t)kv_heads * d;
    p.qw = (size_t)heads * d;
    p.row_ok[0] = gq < G;
    p.row_ok[1] = gq + 8 < G;
    sp_load_q_perm(q + (size_t)p.i * p.qw + (size_t)p.g * G * d, G, d, qa);
    return p;
}

// launch: grid = ((T·kv_heads + AG_WARPS − 1) / AG_WARPS), block = 32·AG_WARPS, dynamic smem = 0 bytes.
// Same arguments and result as attention_prefill with blocks != NULL (64-key blocks); needs
// heads / kv_heads ≤ 16 and d ∈ {64, 128}.
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_gather(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos,
                 int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    const int pair = blockIdx.x * AG_WARPS + (threadIdx.x >> 5);
    if (pair >= T * kv_heads) return;  // warp-uniform
    u32 qa[8][4];
    const AgPair p = ag_pair(q, pair, T, first_pos, heads, kv_heads, d, qa);
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks + (size_t)pair * k_sel;
    for (int s = 0; s < k_sel; s++) {
        const int b = my[s];
        if (__any_sync(0xffffffffu, b < 0)) break;  // −1 padded lists; a vote keeps the walk warp-uniform
        const size_t k0 = (size_t)64 * b;
        ag_block(st, qa, kcache + k0 * p.kvw + (size_t)p.g * d, vcache + k0 * p.kvw + (size_t)p.g * d, p.kvw, 64 * b,
                 p.t, p.n_keys - 64 * b, p.row_ok, sl2, d);
    }
    bf16* orow0 = out + (size_t)p.i * p.qw + (size_t)(p.g * G + gq) * d;
    ag_sum_l(st);
    ag_store_out(st, p.row_ok, d, [&](int r) { return orow0 + 8 * r * d; });
}

// Split-K attention for few queries (decode): warp z of the n_split warps of pair (query i, KV
// group g) = (blockIdx.x / kv_heads, blockIdx.x % kv_heads) attends to the 64-key blocks
// s ≡ z (mod n_split) of the pair's walk (blocks != NULL: its list, −1 padded; else every
// block 0 .. t/64) and writes each of its rows' partial state, as attention_split does, to
// part[((z·T + i)·heads + h)·(d + 2) ..]; attention_merge combines them. The query at position
// t sees keys < n_keys of kcache / vcache. Needs heads / kv_heads ≤ 16 and d ∈ {64, 128}.
__device__ __forceinline__ void attention_decode_pair(const bf16* q, const bf16* kcache, const bf16* vcache,
                                                      float* part, int T, int t, int n_keys, int heads,
                                                      int kv_heads, int d, float scale, const int* blocks, int k_sel,
                                                      int n_split) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    const int z = blockIdx.y * AG_WARPS + (threadIdx.x >> 5);
    if (z >= n_split) return;  // warp-uniform
    const int pair = blockIdx.x;
    u32 qa[8][4];
    AgPair p = ag_pair(q, pair, T, 0, heads, kv_heads, d, qa);
    p.t = t;
    p.n_keys = n_keys;
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks ? blocks + (size_t)pair * k_sel : 0;
    const int n_walk = blocks ? k_sel : p.t / 64 + 1;
    for (int s = z; s < n_walk; s += n_split) {
        const int b = blocks ? my[s] : s;
        if (__any_sync(0xffffffffu, b < 0)) break;  // −1 padded lists; a vote keeps the walk warp-uniform
        const size_t k0 = (size_t)64 * b;
        ag_block(st, qa, kcache + k0 * p.kvw + (size_t)p.g * d, vcache + k0 * p.kvw + (size_t)p.g * d, p.kvw, 64 * b,
                 p.t, p.n_keys - 64 * b, p.row_ok, sl2, d);
    }
    float* prow0 = part + (((size_t)z * T + p.i) * heads + (size_t)p.g * G + gq) * (d + 2);
    ag_sum_l(st);
    ag_store_partial(st, p.row_ok, d, [&](int r) { return prow0 + 8 * r * (d + 2); });
}

// The T queries of one sequence at positions first_pos .. first_pos + T − 1.
// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode(const bf16* q, const bf16* kcache, const bf16* vcache, float* part, int T, int first_pos,
                 int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int n_split) {
    attention_decode_pair(q, kcache, vcache, part, T, first_pos + blockIdx.x / kv_heads, first_pos + T, heads,
                          kv_heads, d, scale, blocks, k_sel, n_split);
}

// One query of each of T ≤ SEQ_ROWS sequences (row i over rows' caches i, split rows.split[i]
// ways), a pair's partials as attention_decode writes them for that sequence alone; the slots
// from its split to n_split (the largest) get an empty partial (m = −inf), which the merge skips.
// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode_rows(const bf16* q, SeqRows rows, float* part, int T, int heads, int kv_heads, int d, float scale,
                      const int* blocks, int k_sel, int n_split) {
    const int i = blockIdx.x / kv_heads, g = blockIdx.x % kv_heads, G = heads / kv_heads;
    const int z = blockIdx.y * AG_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (z >= rows.split[i]) {  // warp-uniform
        if (z < n_split && lane < G)
            part[(((size_t)z * T + i) * heads + (size_t)g * G + lane) * (d + 2) + d] = -__int_as_float(0x7f800000);
        return;
    }
    attention_decode_pair(q, rows.k[i], rows.v[i], part, T, rows.pos[i], rows.pos[i] + 1, heads, kv_heads, d,
                          scale, blocks, k_sel, rows.split[i]);
}

// ============================================================================================
// 7. Lightning chunked prefill on tensor cores (the math of lightning.cu's lightning_chunked)
// ============================================================================================
//
// Three kernels over a range of n whole 64-token chunks (the last may be partial), chunk c
// holding tokens [64c, 64c + len_c) of the call, decay γ = exp(g), g = −slopes[h]:
//   1. lightning_chunk_state: ΔS_c = Σ_j γ^{len_c−1−j} k_jᵀ v_j        (all chunks in parallel)
//   2. lightning_chunk_scan:  S_c = state before chunk c; state ← γ^{len_c} S_c + ΔS_c (in order)
//   3. lightning_chunk_out:   o_i = scale·(γ^{i+1} q_i S_c + Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j)
// Products run on bf16 tensor cores with fp32 accumulation; an fp32 operand (decayed keys, the
// state, decayed scores) is split into bf16 hi + lo parts and multiplied twice, so products keep
// ~16 mantissa bits and the result stays fp32-accurate. Powers γ^n as in lightning.cu.
// The scratch `ds` holds n·heads·d·d fp32: ΔS from kernel 1, overwritten by kernel 2 with the
// states S_c as packed bf16 (hi | lo << 16). Needs d a multiple of 16, at most 128.

#define LC_C 64

__device__ __forceinline__ float lc_pow(float g, int n) { return (float)exp((double)__fmul_rn(g, (float)n)); }

// The hi + lo bf16 pair of (x0, x1) packs, for an A fragment register.
__device__ __forceinline__ void lc_split(float x0, float x1, u32& hi, u32& lo) { sp_split2(x0, x1, hi, lo); }

// acc += A·V for a 16×16 A given as bf16 hi + lo fragments (two products) and the V rows of
// tokens jb + {2tq, 2tq+1, 2tq+8, 2tq+9} of the chunk at j0 (rows ≥ len read as 0); the value
// dims of acc are permuted as sp_o_dim says.
__device__ __forceinline__ void lc_pv_hilo(float (&acc)[16][4], u32 h0, u32 h1, u32 h2, u32 h3, u32 l0, u32 l1,
                                           u32 l2, u32 l3, const bf16* vh, size_t kvw, int j0, int jb, int len,
                                           int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int jr[4] = {jb + 2 * tq, jb + 2 * tq + 1, jb + 2 * tq + 8, jb + 2 * tq + 9};
#pragma unroll
    for (int m = 0; m < 8; m++) {
        if (m * 16 < d) {
            u32 w[4];
#pragma unroll
            for (int y = 0; y < 4; y++)
                w[y] = (jr[y] < len) ? *(const u32*)(vh + (size_t)(j0 + jr[y]) * kvw + 16 * m + 2 * gq) : 0u;
            const u32 be0 = __byte_perm(w[0], w[1], 0x5410), bo0 = __byte_perm(w[0], w[1], 0x7632);
            const u32 be1 = __byte_perm(w[2], w[3], 0x5410), bo1 = __byte_perm(w[2], w[3], 0x7632);
            sp_mma(acc[2 * m], h0, h1, h2, h3, be0, be1);
            sp_mma(acc[2 * m], l0, l1, l2, l3, be0, be1);
            sp_mma(acc[2 * m + 1], h0, h1, h2, h3, bo0, bo1);
            sp_mma(acc[2 * m + 1], l0, l1, l2, l3, bo0, bo1);
        }
    }
}

// launch: grid = (n, heads), block = 256, dynamic smem = 0 bytes (static 17,664 bytes)
extern "C" __global__ void __launch_bounds__(256)
lightning_chunk_state(const bf16* k, const bf16* v, float* ds, const float* slopes, int T, int heads, int kv_heads,
                      int d) {
    __shared__ __align__(16) bf16 ks[LC_C * AT_MAXLD];
    __shared__ float dec[LC_C];
    const int c = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int j0 = c * LC_C, len = min(LC_C, T - j0);
    const size_t kvw = (size_t)kv_heads * d;
    const int segs = d / 8;
    for (int x = threadIdx.x; x < LC_C * segs; x += 256) {
        const int j = x / segs, p = x % segs;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (j < len) val = *(const uint4*)(k + (size_t)(j0 + j) * kvw + (size_t)kvh * d + 8 * p);
        *(uint4*)(ks + j * AT_MAXLD + 8 * p) = val;
    }
    const float g = -slopes[h];
    if (threadIdx.x < LC_C) dec[threadIdx.x] = (threadIdx.x < len) ? lc_pow(g, len - 1 - threadIdx.x) : 0.0f;
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int a0 = 16 * warp;  // this warp's key-dimension rows of ΔS
    if (a0 >= d) return;
    float acc[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) acc[nt][x] = 0.0f;
    const bf16* vh = v + (size_t)kvh * d;
#pragma unroll
    for (int s4 = 0; s4 < 4; s4++) {
        // A = (decayed K)ᵀ: rows a0 + gq (+8), columns (tokens) 16·s4 + 2tq + {0, 1} (+8).
        float av[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int j = 16 * s4 + 2 * tq + (y & 1) + 8 * (y >> 1);
                av[r][y] = bf2f(ks[j * AT_MAXLD + a0 + gq + 8 * r]) * dec[j];
            }
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        lc_split(av[0][0], av[0][1], h0, l0);
        lc_split(av[1][0], av[1][1], h1, l1);
        lc_split(av[0][2], av[0][3], h2, l2);
        lc_split(av[1][2], av[1][3], h3, l3);
        lc_pv_hilo(acc, h0, h1, h2, h3, l0, l1, l2, l3, vh, kvw, j0, 16 * s4, len, d);
    }
    float* out = ds + ((size_t)c * heads + h) * d * d;
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
        if (nt * 8 < d)
#pragma unroll
            for (int x = 0; x < 4; x++) out[(size_t)(a0 + gq + 8 * (x >> 1)) * d + sp_o_dim(nt, x, tq)] = acc[nt][x];
}

// launch: grid = (⌈heads·d·d / 256⌉), block = 256
extern "C" __global__ void __launch_bounds__(256)
lightning_chunk_scan(float* state, float* ds, const float* slopes, int n, int last_len, int heads, int d) {
    const size_t dd = (size_t)d * d, total = (size_t)heads * dd;
    const size_t idx = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (idx >= total) return;
    const float g = -slopes[idx / dd];
    const float full = lc_pow(g, LC_C), last = lc_pow(g, last_len);
    float s = state[idx];
    // Eight chunks at a time: their loads are issued together, then the sequential updates.
    for (int c0 = 0; c0 < n; c0 += 8) {
        float delta[8];
#pragma unroll
        for (int u = 0; u < 8; u++) delta[u] = (c0 + u < n) ? ds[(size_t)(c0 + u) * total + idx] : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int c = c0 + u;
            if (c < n) {
                const u32 hi = f2bf(s);
                const u32 lo = f2bf(s - bf2f((bf16)hi));
                *(u32*)(ds + (size_t)c * total + idx) = hi | (lo << 16);
                s = __fadd_rn(__fmul_rn(c == n - 1 ? last : full, s), delta[u]);
            }
        }
    }
    state[idx] = s;
}

// launch: grid = (n, heads), block = 128 (4 warps × 16 tokens), dynamic smem = 0 bytes
// (ds as kernel 2 left it; out [T, heads·d] bf16 for the range's tokens)
extern "C" __global__ void __launch_bounds__(128)
lightning_chunk_out(const bf16* q, const bf16* k, const bf16* v, const float* ds, bf16* out, const float* slopes,
                    int T, int heads, int kv_heads, int d, float scale) {
    __shared__ float pw[LC_C + 1];  // γ^n, n = 0..64
    const int c = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int j0 = c * LC_C, len = min(LC_C, T - j0);
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;
    for (int x = threadIdx.x; x <= LC_C; x += 128) pw[x] = lc_pow(-slopes[h], x);
    __syncthreads();
    int ir[2];
    bool ok[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ir[r] = 16 * warp + gq + 8 * r;
        ok[r] = ir[r] < len;
    }
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            qa[kk][x] = (kk * 16 < d && ok[r])
                            ? *(const u32*)(q + (size_t)(j0 + ir[r]) * qw + (size_t)h * d + kk * 16 + c8 + 2 * tq)
                            : 0u;
        }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;

    // Inter-chunk: O = Q S_c, S_c from the packed hi | lo state (rows a = key dims).
    const u32* sp = (const u32*)(ds + ((size_t)c * heads + h) * d * d);
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        if (kk * 16 < d) {
            const int ar[4] = {16 * kk + 2 * tq, 16 * kk + 2 * tq + 1, 16 * kk + 2 * tq + 8, 16 * kk + 2 * tq + 9};
#pragma unroll
            for (int m = 0; m < 8; m++) {
                if (m * 16 < d) {
                    uint2 w[4];
#pragma unroll
                    for (int y = 0; y < 4; y++) w[y] = *(const uint2*)(sp + (size_t)ar[y] * d + 16 * m + 2 * gq);
                    // Even dims (tile 2m): elements .x; odd dims (tile 2m+1): .y; hi = low half.
                    sp_mma(O[2 * m], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], __byte_perm(w[0].x, w[1].x, 0x5410),
                           __byte_perm(w[2].x, w[3].x, 0x5410));
                    sp_mma(O[2 * m], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], __byte_perm(w[0].x, w[1].x, 0x7632),
                           __byte_perm(w[2].x, w[3].x, 0x7632));
                    sp_mma(O[2 * m + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                           __byte_perm(w[0].y, w[1].y, 0x5410), __byte_perm(w[2].y, w[3].y, 0x5410));
                    sp_mma(O[2 * m + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                           __byte_perm(w[0].y, w[1].y, 0x7632), __byte_perm(w[2].y, w[3].y, 0x7632));
                }
            }
        }
    }
    const float di[2] = {pw[min(ir[0] + 1, LC_C)], pw[min(ir[1] + 1, LC_C)]};
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] *= di[x >> 1];

    // Intra-chunk: A = (Q Kᵀ) ⊙ γ^{i−j} for j ≤ i, then O += A V.
    float S[8][4];
    const bf16* kh = k + (size_t)kvh * d;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
        const int j = 8 * nt + gq;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            if (kk * 16 < d) {
                u32 b0 = 0u, b1 = 0u;
                if (j < len) {
                    const bf16* kr = kh + (size_t)(j0 + j) * kvw + kk * 16 + 2 * tq;
                    b0 = *(const u32*)kr;
                    b1 = *(const u32*)(kr + 8);
                }
                sp_mma(S[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int i = ir[x >> 1], j = 8 * nt + 2 * tq + (x & 1);
            S[nt][x] = (ok[x >> 1] && j <= i) ? S[nt][x] * pw[i - j] : 0.0f;
        }
    const bf16* vh = v + (size_t)kvh * d;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        lc_split(S[2 * ks][0], S[2 * ks][1], h0, l0);
        lc_split(S[2 * ks][2], S[2 * ks][3], h1, l1);
        lc_split(S[2 * ks + 1][0], S[2 * ks + 1][1], h2, l2);
        lc_split(S[2 * ks + 1][2], S[2 * ks + 1][3], h3, l3);
        lc_pv_hilo(O, h0, h1, h2, h3, l0, l1, l2, l3, vh, kvw, j0, 16 * ks, len, d);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (ok[r]) sp_store_row(O, r, scale, out + (size_t)(j0 + ir[r]) * qw + (size_t)h * d + 4 * tq, d);
    }
}
