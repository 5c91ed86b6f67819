// Lightning layers: chunked Simple GLA (SPEC §4.2), the GPU twin of `sala_cpu::attention::lightning`.
//
// Per head h with decay γ = exp(g), g = −slopes[h], over chunks of (at most) 64 tokens, local index
// i ∈ [0, c):
//   o_i    = scale · ( γ^{i+1} q_i S_prev + Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j )
//   S_next = γ^c S_prev + Σ_{j<c} γ^{c−1−j} k_jᵀ v_j
// with the powers γ^n computed as exp(g·n) in fp32 (g·n an fp32 product, as the CPU does; the exp is
// evaluated in double and rounded once, i.e. the correctly rounded expf). All arithmetic is fp32;
// only the output is rounded to bf16. A partial last chunk (c < 64) decays the state by γ^c.
//
// Value-slice parallelism: o[:, e] and S[:, e] depend only on value column e, so block (h, y) owns
// the value columns e0 = 32·y .. e0 + min(32, d − e0) of head h. Its slice of S ([d, 32] fp32)
// lives in shared memory for the whole call: read once at the start, written once at the end.
// Each block recomputes the chunk's q·k scores (the price of the split; d/32 ≤ 4 blocks a head).
//
// Phases per chunk (256 threads = 8 warps), over 64-wide slices of the key dimension:
//   1. stage Q and K (bf16) in shared memory, then
//        A[i][j] += q_i·k_j         (thread owns rows ty+16r, cols tx+16s, r, s < 4)
//        oi[i][e] += q_i·S[:, e]    (thread owns column e = lane, rows i = warp + 8r)
//   2. A ← causal mask ⊙ γ^{i−j} ⊙ A, stored over the dead Q/K tiles;
//      o[i][e] = scale·(γ^{i+1} oi + Σ_{j≤i} A[i][j] v_j[e]) → bf16.
//   3. v_j ← γ^{c−1−j} v_j; restage K, then S[a][e] = γ^c S[a][e] + Σ_j k_j[a] v_j[e]
//      (thread owns e = lane, rows a = 8·warp + r).
// Shared-memory reads are 16 bytes wide wherever a thread walks along a row (row strides 72 bf16 /
// 68 fp32 keep them 16-byte aligned and bank-conflict-free).

#include "common/types.cuh"
#include "lightning/common.cuh"

#define LT_C 64             // tokens per chunk (the reference's chunk_simple_gla)
#define LT_VS 32            // value columns per block
#define LT_DT 64            // key-dimension slice staged at a time
#define LT_LDT 72           // bf16 row stride of the staged Q/K slices
#define LT_LDA 68           // fp32 row stride of the score matrix
#define LT_MAXD 128
#define LT_THREADS 256

// Bytes of the region shared by the Q/K slices (phases 1, 3) and the scores (phase 2).
#define LT_REGION_QK (2 * LT_C * LT_LDT * 2)
#define LT_REGION_A (LT_C * LT_LDA * 4)
#define LT_REGION (LT_REGION_QK > LT_REGION_A ? LT_REGION_QK : LT_REGION_A)

// 8 bf16 (one uint4) · 8 bf16, accumulated into acc.
__device__ __forceinline__ float lt_dot8(float acc, uint4 a, uint4 b) {
    acc += lt_lo(a.x) * lt_lo(b.x) + lt_hi(a.x) * lt_hi(b.x);
    acc += lt_lo(a.y) * lt_lo(b.y) + lt_hi(a.y) * lt_hi(b.y);
    acc += lt_lo(a.z) * lt_lo(b.z) + lt_hi(a.z) * lt_hi(b.z);
    acc += lt_lo(a.w) * lt_lo(b.w) + lt_hi(a.w) * lt_hi(b.w);
    return acc;
}

// Stages rows j < c (zero-filled up to 64) of `wd` columns [col0, col0 + wd) of src (row stride
// `stride` elements) into dst [64][LT_LDT], 8 bf16 per 16-byte load.
__device__ __forceinline__ void lt_stage(bf16* dst, const bf16* src, size_t stride, int col0, int wd, int c) {
    for (int idx = threadIdx.x; idx < LT_C * (LT_DT / 8); idx += LT_THREADS) {
        const int j = idx >> 3, p = idx & 7;
        if (8 * p < wd) {
            uint4 v;
            v.x = v.y = v.z = v.w = 0u;
            if (j < c) v = *(const uint4*)(src + (size_t)j * stride + col0 + 8 * p);
            *(uint4*)(dst + j * LT_LDT + 8 * p) = v;
        }
    }
}

// launch: grid = (heads, (d + 31) / 32), block = 256, dynamic smem = 0 bytes
//   (static shared memory 43,268 bytes; needs d ≤ 128, d a multiple of 16, heads % kv_heads == 0,
//    q/k/v 16-byte aligned.)
// q [T, heads*d], k/v [T, kv_heads*d] bf16; state [heads, d, d] fp32 (read and advanced in place);
// out [T, heads*d] bf16; slopes [heads] fp32.
extern "C" __global__ void __launch_bounds__(LT_THREADS)
lightning_chunked(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                  const float* slopes, int T, int heads, int kv_heads, int d, float scale) {
    pdl_start();
    __shared__ __align__(16) float S[LT_MAXD * LT_VS];   // state slice [a][e]
    __shared__ __align__(16) float Vs[LT_C * LT_VS];     // value slice of the chunk [j][e]
    __shared__ float pw[LT_C + 1];                       // γ^n, n = 0..64
    __shared__ __align__(16) unsigned char region[LT_REGION];
    bf16* Qt = (bf16*)region;                // [64][LT_LDT] (phase 1)
    bf16* Kt = Qt + LT_C * LT_LDT;           // [64][LT_LDT] (phases 1 and 3)
    float* As = (float*)region;              // [64][LT_LDA] (phase 2)

    const int h = blockIdx.x;
    const int e0 = blockIdx.y * LT_VS;
    const int ve = min(LT_VS, d - e0);       // live value columns in this block
    const int group = heads / kv_heads;
    const int kvh = h / group;
    const size_t qw = (size_t)heads * d, kw = (size_t)kv_heads * d;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ty = tid >> 4, tx = tid & 15;

    const float g = -slopes[h];
    for (int n = tid; n <= LT_C; n += LT_THREADS) pw[n] = (float)exp((double)__fmul_rn(g, (float)n));

    float* st = state + (size_t)h * d * d;
    for (int idx = tid; idx < d * LT_VS; idx += LT_THREADS) {
        const int a = idx / LT_VS, e = idx % LT_VS;
        S[idx] = (e < ve) ? st[(size_t)a * d + e0 + e] : 0.0f;
    }

    for (int t0 = 0; t0 < T; t0 += LT_C) {
        const int c = min(LT_C, T - t0);
        const bf16* qc = q + (size_t)t0 * qw + (size_t)h * d;
        const bf16* kc = k + (size_t)t0 * kw + (size_t)kvh * d;
        __syncthreads();  // the previous chunk is done with S, Vs and the region; pw/S loaded

        for (int idx = tid; idx < LT_C * LT_VS; idx += LT_THREADS) {
            const int j = idx / LT_VS, e = idx % LT_VS;
            Vs[idx] = (j < c && e < ve) ? bf2f(v[(size_t)(t0 + j) * kw + (size_t)kvh * d + e0 + e]) : 0.0f;
        }

        // ---- phase 1: A = Q Kᵀ and oi = Q S, over 64-wide slices of the key dimension ----
        float acc[4][4];
        float oi[8];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int s = 0; s < 4; s++) acc[r][s] = 0.0f;
#pragma unroll
        for (int r = 0; r < 8; r++) oi[r] = 0.0f;
        const bool a_rows = ty < c;    // rows ty + 16r; only rows < c matter (the rest are zero)
        const bool o_rows = warp < c;  // rows warp + 8r

        for (int dt = 0; dt < d; dt += LT_DT) {
            const int wd = min(LT_DT, d - dt);
            if (dt > 0) __syncthreads();  // everyone is done with the previous slice
            lt_stage(Qt, qc, qw, dt, wd, c);
            lt_stage(Kt, kc, kw, dt, wd, c);
            __syncthreads();

            if (a_rows) {
                for (int a8 = 0; a8 < wd; a8 += 8) {
                    uint4 qa[4], kb[4];
#pragma unroll
                    for (int r = 0; r < 4; r++) qa[r] = *(const uint4*)(Qt + (ty + 16 * r) * LT_LDT + a8);
#pragma unroll
                    for (int s = 0; s < 4; s++) kb[s] = *(const uint4*)(Kt + (tx + 16 * s) * LT_LDT + a8);
#pragma unroll
                    for (int r = 0; r < 4; r++)
#pragma unroll
                        for (int s = 0; s < 4; s++) acc[r][s] = lt_dot8(acc[r][s], qa[r], kb[s]);
                }
            }
            if (o_rows) {
                for (int a8 = 0; a8 < wd; a8 += 8) {
                    float sv[8];
#pragma unroll
                    for (int x = 0; x < 8; x++) sv[x] = S[(dt + a8 + x) * LT_VS + lane];
#pragma unroll
                    for (int r = 0; r < 8; r++) {
                        const uint4 qv = *(const uint4*)(Qt + (warp + 8 * r) * LT_LDT + a8);
                        float o = oi[r];
                        o += lt_lo(qv.x) * sv[0] + lt_hi(qv.x) * sv[1];
                        o += lt_lo(qv.y) * sv[2] + lt_hi(qv.y) * sv[3];
                        o += lt_lo(qv.z) * sv[4] + lt_hi(qv.z) * sv[5];
                        o += lt_lo(qv.w) * sv[6] + lt_hi(qv.w) * sv[7];
                        oi[r] = o;
                    }
                }
            }
        }
        __syncthreads();  // Q/K slices dead: the region becomes A

        // ---- phase 2: decayed causal scores, then the outputs ----
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const int i = ty + 16 * r, j = tx + 16 * s;
                As[i * LT_LDA + j] = (j <= i && i < c) ? acc[r][s] * pw[i - j] : 0.0f;
            }
        __syncthreads();

        if (o_rows) {
            // Rows i = warp + 8r; A is zero above the diagonal and beyond c, so every row runs to
            // the warp's last row (8 independent accumulators; 4 keys per step).
            float o[8];
#pragma unroll
            for (int r = 0; r < 8; r++) o[r] = pw[min(warp + 8 * r + 1, LT_C)] * oi[r];
            const int jend = min(c, warp + 57);
            for (int j = 0; j < jend; j += 4) {
                const float v0 = Vs[j * LT_VS + lane], v1 = Vs[(j + 1) * LT_VS + lane];
                const float v2 = Vs[(j + 2) * LT_VS + lane], v3 = Vs[(j + 3) * LT_VS + lane];
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    const float4 a = *(const float4*)(As + (warp + 8 * r) * LT_LDA + j);
                    o[r] += a.x * v0 + a.y * v1 + a.z * v2 + a.w * v3;
                }
            }
            if (lane < ve) {
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    const int i = warp + 8 * r;
                    if (i < c) out[(size_t)(t0 + i) * qw + (size_t)h * d + e0 + lane] = f2bf(scale * o[r]);
                }
            }
        }
        __syncthreads();  // A and Vs reads done

        // ---- phase 3: S ← γ^c S + Σ_j γ^{c−1−j} k_jᵀ v_j ----
        for (int idx = tid; idx < c * LT_VS; idx += LT_THREADS) Vs[idx] *= pw[c - 1 - idx / LT_VS];
        const float pc = pw[c];
        for (int dt = 0; dt < d; dt += LT_DT) {
            const int wd = min(LT_DT, d - dt);
            __syncthreads();  // scaled Vs visible; the region (A or the last K slice) is free
            lt_stage(Kt, kc, kw, dt, wd, c);
            __syncthreads();
            if (8 * warp < wd) {
                // Rows a = 8·warp + r of the slice: one 16-byte read of k_j per step.
                float sum[8];
#pragma unroll
                for (int r = 0; r < 8; r++) sum[r] = 0.0f;
                for (int j = 0; j < c; j++) {
                    const float vj = Vs[j * LT_VS + lane];
                    const uint4 kv = *(const uint4*)(Kt + j * LT_LDT + 8 * warp);
                    sum[0] += lt_lo(kv.x) * vj;
                    sum[1] += lt_hi(kv.x) * vj;
                    sum[2] += lt_lo(kv.y) * vj;
                    sum[3] += lt_hi(kv.y) * vj;
                    sum[4] += lt_lo(kv.z) * vj;
                    sum[5] += lt_hi(kv.z) * vj;
                    sum[6] += lt_lo(kv.w) * vj;
                    sum[7] += lt_hi(kv.w) * vj;
                }
#pragma unroll
                for (int r = 0; r < 8; r++) {
                    float* sp = &S[(dt + 8 * warp + r) * LT_VS + lane];
                    *sp = *sp * pc + sum[r];
                }
            }
        }
    }
    __syncthreads();
    for (int idx = tid; idx < d * LT_VS; idx += LT_THREADS) {
        const int a = idx / LT_VS, e = idx % LT_VS;
        if (e < ve) st[(size_t)a * d + e0 + e] = S[idx];
    }
}
