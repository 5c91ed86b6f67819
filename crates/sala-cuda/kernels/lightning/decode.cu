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

// One lightning step: S ← γS + kᵀv, o = scale·q·S (the T = 1 case of lightning_chunked).
// Block (h, y) owns value columns 32y .. 32y+31 of head h; its 8 warps split the key rows, each
// loading all of its (at most 32) state rows before updating them. d ≤ 256. With prep.q_norm,
// prep.k_norm or prep.table, q and k come unnormed and unrotated: warps 0 and 1 norm and rotate
// them as head_norm_rope_lanes would (d ∈ {32, 64, 128, 256}; `cs` the row's RoPE table).
__device__ __forceinline__ void lightning_step(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                                               const float* slopes, int heads, int kv_heads, int d, float scale,
                                               const QkPrep& prep, const float* cs) {
    __shared__ float qs[256], ks[256], part[8][32];
    int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    int kvh = h / (heads / kv_heads);
    int e = blockIdx.y * 32 + lane;
    if (prep.q_norm || prep.k_norm || prep.table) {
        if (grp == 0) head_norm_rope_any((bf16*)q + h * d, d, lane, prep.q_norm, prep.eps, cs, qs);
        if (grp == 1) head_norm_rope_any((bf16*)k + kvh * d, d, lane, prep.k_norm, prep.eps, cs, ks);
    } else {
        for (int a = threadIdx.x; a < d; a += blockDim.x) {
            qs[a] = bf2f(q[h * d + a]);
            ks[a] = bf2f(k[kvh * d + a]);
        }
    }
    __syncthreads();
    float gamma = expf(-slopes[h]);
    float acc = 0.0f;
    if (e < d) {
        float ve = bf2f(v[kvh * d + e]);
        float* S = state + (u64)h * d * d + e;
        float sv[32];
#pragma unroll
        for (int x = 0; x < 32; x++)
            if (grp + 8 * x < d) sv[x] = S[(u64)(grp + 8 * x) * d];
#pragma unroll
        for (int x = 0; x < 32; x++) {
            const int a = grp + 8 * x;
            if (a < d) {
                const float s = gamma * sv[x] + ks[a] * ve;
                S[(u64)a * d] = s;
                acc += qs[a] * s;
            }
        }
    }
    part[grp][lane] = acc;
    __syncthreads();
    if (grp == 0 && e < d) {
        float o = 0.0f;
#pragma unroll
        for (int g = 0; g < 8; g++) o += part[g][lane];
        out[h * d + e] = f2bf(scale * o);
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
    pdl_start();
    const u64 z = blockIdx.z, qd = (u64)heads * d, kd = (u64)kv_heads * d;
    const QkPrep prep = {q_norm, k_norm, eps, table};
    lightning_step(q + z * qd, k + z * kd, v + z * kd, rows.state[z], out + z * qd, slopes, heads, kv_heads, d, scale,
                   prep, table ? table + z * d : nullptr);
}
