// Single-token (decode) lightning steps, where the chunked forms waste a step's few microseconds.

#include "common/types.cuh"
#include "common/rows.cuh"
#include "common/head_norm.cuh"

// The q and k heads a decode row reads, normed and rotated here when `qk` says so.
struct QkPrep {
    const bf16* q_norm;  // per-head RMSNorm weights (null: no norm)
    const bf16* k_norm;
    float eps;
    const float* table;  // RoPE table, d floats a row (null: no rotation)
};

// The q (when q is not null) and k of one row in shared memory (qs, ks), normed and rotated as
// `prep` says (warps 0 and 1, as head_norm_rope_lanes would; `cs` the row's RoPE table) or as
// they come.
__device__ __forceinline__ void lightning_stage_qk(const bf16* q, const bf16* k, int h, int kvh, int d,
                                                   const QkPrep& prep, const float* cs, float* qs, float* ks) {
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    if (prep.q_norm || prep.k_norm || prep.table) {
        if (grp == 0 && q) head_norm_rope_any((bf16*)q + h * d, d, lane, prep.q_norm, prep.eps, cs, qs);
        if (grp == 1) head_norm_rope_any((bf16*)k + kvh * d, d, lane, prep.k_norm, prep.eps, cs, ks);
    } else {
        for (int a = threadIdx.x; a < d; a += blockDim.x) {
            if (q) qs[a] = bf2f(q[h * d + a]);
            ks[a] = bf2f(k[kvh * d + a]);
        }
    }
}

// One row's step of this thread's state values (rows grp + 8x of column e, x < X, in sv):
// s ← γs + k_a v_e with pinned roundings, so every kernel that steps rows one at a time gets
// the same bits; returns Σ_a q_a s_a over them.
template <int X = 32>
__device__ __forceinline__ float lightning_row(const float* qs, const float* ks, float ve, float gamma, float* sv,
                                               int grp, int d) {
    float acc = 0.0f;
#pragma unroll
    for (int x = 0; x < X; x++) {
        const int a = grp + 8 * x;
        if (a < d) {
            const float s = __fmaf_rn(ks[a], ve, __fmul_rn(gamma, sv[x]));
            sv[x] = s;
            acc = __fmaf_rn(qs[a], s, acc);
        }
    }
    return acc;
}

// The output value of column e from the 8 warps' partial sums (part[g][lane + col]), by warp w.
template <int W>
__device__ __forceinline__ void lightning_out(const float (&part)[8][W], int e, int d, float scale, bf16* o, int w = 0,
                                              int col = 0) {
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    if (grp == w && e < d) {
        float sum = 0.0f;
#pragma unroll
        for (int g = 0; g < 8; g++) sum += part[g][lane + col];
        o[e] = f2bf(scale * sum);
    }
}

// One lightning step: S ← γS + kᵀv, o = scale·q·S (the T = 1 case of lightning_chunked).
// Block (h, y) owns value columns 32y .. 32y+31 of head h; its 8 warps split the key rows, each
// loading all of its (at most 32) state rows before updating them. d ≤ 256. With prep.q_norm,
// prep.k_norm or prep.table, q and k come unnormed and unrotated (d ∈ {32, 64, 128, 256}).
// The state is read before the PDL wait (no kernel of the step writes it before this one) and
// while q and k are staged: only q, k and v wait for the kernel that makes them.
__device__ __forceinline__ void lightning_step(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                                               const float* slopes, int heads, int kv_heads, int d, float scale,
                                               const QkPrep& prep, const float* cs) {
    __shared__ float qs[256], ks[256], part[8][32];
    const int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads), e = blockIdx.y * 32 + lane;
    float* S = state + (u64)h * d * d + e;
    float sv[32];
    if (e < d) {
#pragma unroll
        for (int x = 0; x < 32; x++)
            if (grp + 8 * x < d) sv[x] = S[(u64)(grp + 8 * x) * d];
    }
    pdl_start();
    lightning_stage_qk(q, k, h, kvh, d, prep, cs, qs, ks);
    __syncthreads();
    const float gamma = expf(-slopes[h]);
    float acc = 0.0f;
    if (e < d) {
        acc = lightning_row(qs, ks, bf2f(v[kvh * d + e]), gamma, sv, grp, d);
#pragma unroll
        for (int x = 0; x < 32; x++)
            if (grp + 8 * x < d) S[(u64)(grp + 8 * x) * d] = sv[x];
    }
    part[grp][lane] = acc;
    __syncthreads();
    lightning_out(part, e, d, scale, out + h * d);
}

// lightning_step with two value columns a lane (d ≤ 128): block (h, y) owns columns 64y ..
// 64y + 63 of head h (lane l: 64y + l and 64y + l + 32), half the blocks, each staging q and k
// once for twice the state; each column's values and output have lightning_step's bits.
__device__ __forceinline__ void lightning_step_paired(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                                               const float* slopes, int heads, int kv_heads, int d, float scale,
                                               const QkPrep& prep, const float* cs) {
    constexpr int COLS = 2, X = 16;  // columns a lane, rows it holds of each (d ≤ 128)
    __shared__ float qs[256], ks[256], part[8][32 * COLS];
    const int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads), e0 = blockIdx.y * 32 * COLS + lane;
    float* S = state + (u64)h * d * d;
    float sv[32];
#pragma unroll
    for (int c = 0; c < COLS; c++)
        if (e0 + 32 * c < d) {
#pragma unroll
            for (int x = 0; x < X; x++)
                if (grp + 8 * x < d) sv[c * X + x] = S[(u64)(grp + 8 * x) * d + e0 + 32 * c];
        }
    pdl_start();
    lightning_stage_qk(q, k, h, kvh, d, prep, cs, qs, ks);
    __syncthreads();
    const float gamma = expf(-slopes[h]);
#pragma unroll
    for (int c = 0; c < COLS; c++) {
        const int e = e0 + 32 * c;
        float acc = 0.0f;
        if (e < d) {
            acc = lightning_row<X>(qs, ks, bf2f(v[kvh * d + e]), gamma, sv + c * X, grp, d);
#pragma unroll
            for (int x = 0; x < X; x++)
                if (grp + 8 * x < d) S[(u64)(grp + 8 * x) * d + e] = sv[c * X + x];
        }
        part[grp][lane + 32 * c] = acc;
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < COLS; c++) lightning_out(part, e0 + 32 * c, d, scale, out + h * d, c, 32 * c);
}

// The rows of one short span of one sequence, one lightning step each, in order: every row's
// output and the final state have the bits of decoding the rows one at a time (lightning_step).
// Row z of q and out is heads·d from the last, of k and v kv_heads·d; row z's RoPE table at
// table + z·d. With q and out null, only the state advances.
// launch: grid = (heads, ceil(d / 32)), block = 256
extern "C" __global__ void __launch_bounds__(256, 2)
lightning_span_rows(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out, const float* slopes,
                    int rows, int heads, int kv_heads, int d, float scale, const bf16* q_norm, const bf16* k_norm,
                    float eps, const float* table) {
    pdl_start();
    __shared__ float qs[256], ks[256], part[8][32];
    const int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const int kvh = h / (heads / kv_heads), e = blockIdx.y * 32 + lane;
    const u64 qd = (u64)heads * d, kd = (u64)kv_heads * d;
    const QkPrep prep = {q_norm, k_norm, eps, table};
    const float gamma = expf(-slopes[h]);
    float* S = state + (u64)h * d * d + e;
    float sv[32];
    if (e < d) {
#pragma unroll
        for (int x = 0; x < 32; x++)
            if (grp + 8 * x < d) sv[x] = S[(u64)(grp + 8 * x) * d];
    }
    for (int z = 0; z < rows; z++) {
        lightning_stage_qk(q ? q + z * qd : nullptr, k + z * kd, h, kvh, d, prep,
                           table ? table + (u64)z * d : nullptr, qs, ks);
        __syncthreads();
        float acc = 0.0f;
        // Without q, qs holds stale values: the sum is not used.
        if (e < d) acc = lightning_row(qs, ks, bf2f(v[z * kd + kvh * d + e]), gamma, sv, grp, d);
        part[grp][lane] = acc;
        __syncthreads();
        if (out) lightning_out(part, e, d, scale, out + z * qd + h * d);
        __syncthreads();  // qs, ks and part free for the next row
    }
    if (e < d) {
#pragma unroll
        for (int x = 0; x < 32; x++)
            if (grp + 8 * x < d) S[(u64)(grp + 8 * x) * d] = sv[x];
    }
}

// One lightning decode step for each row of a decode step, each with its own sequence's state:
// row z of q and out (heads·d apart) and of k and v (kv_heads·d apart) steps rows.state[z]; q
// and k normed and rotated first when q_norm, k_norm or table is given (row z's RoPE table at
// table + z·d; q and k are left as they came).
// launch: grid = (heads, ceil(d / 32), rows ≤ DECODE_ROWS), block = 256
extern "C" __global__ void __launch_bounds__(256)
lightning_decode_rows(const bf16* q, const bf16* k, const bf16* v, DecodeRows rows, bf16* out, const float* slopes,
                      int heads, int kv_heads, int d, float scale, const bf16* q_norm, const bf16* k_norm, float eps,
                      const float* table) {
    // (the PDL wait: in lightning_step, once the state is asked for)
    const u64 z = blockIdx.z, qd = (u64)heads * d, kd = (u64)kv_heads * d;
    const QkPrep prep = {q_norm, k_norm, eps, table};
    lightning_step(q + z * qd, k + z * kd, v + z * kd, rows.state[z], out + z * qd, slopes, heads, kv_heads, d,
                      scale, prep, table ? table + z * d : nullptr);
}

// lightning_decode_rows with two value columns a lane (d ≤ 128; the same bits): half the
// blocks, each staging its row's q and k once for twice the state, for steps of many rows.
// launch: grid = (heads, ceil(d / 64), rows ≤ DECODE_ROWS), block = 256
extern "C" __global__ void __launch_bounds__(256)
lightning_decode_rows_paired(const bf16* q, const bf16* k, const bf16* v, DecodeRows rows, bf16* out,
                             const float* slopes, int heads, int kv_heads, int d, float scale, const bf16* q_norm,
                             const bf16* k_norm, float eps, const float* table) {
    // (the PDL wait: in lightning_step, once the state is asked for)
    const u64 z = blockIdx.z, qd = (u64)heads * d, kd = (u64)kv_heads * d;
    const QkPrep prep = {q_norm, k_norm, eps, table};
    lightning_step_paired(q + z * qd, k + z * kd, v + z * kd, rows.state[z], out + z * qd, slopes, heads, kv_heads, d,
                      scale, prep, table ? table + z * d : nullptr);
}
