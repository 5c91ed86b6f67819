// Single-token (decode) kernels where the chunked forms waste a step's few microseconds.

// One lightning step: S ← γS + kᵀv, o = scale·q·S (the T = 1 case of lightning_chunked).
// Block (h, y) owns value columns 32y .. 32y+31 of head h; its 8 warps split the key rows, each
// loading all of its (at most 32) state rows before updating them. d ≤ 256.
__device__ __forceinline__ void lightning_step(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                                               const float* slopes, int heads, int kv_heads, int d, float scale) {
    __shared__ float qs[256], ks[256], part[8][32];
    int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    int kvh = h / (heads / kv_heads);
    int e = blockIdx.y * 32 + lane;
    for (int a = threadIdx.x; a < d; a += blockDim.x) {
        qs[a] = bf2f(q[h * d + a]);
        ks[a] = bf2f(k[kvh * d + a]);
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

// launch: grid = (heads, ceil(d / 32)), block = 256
extern "C" __global__ void __launch_bounds__(256) lightning_decode(const bf16* q, const bf16* k, const bf16* v,
                                                                   float* state, bf16* out, const float* slopes,
                                                                   int heads, int kv_heads, int d, float scale) {
    lightning_step(q, k, v, state, out, slopes, heads, kv_heads, d, scale);
}

// The sequences of a batched decode step: row r's lightning state (one layer's) and position.
#define DECODE_ROWS 64
struct DecodeRows {
    float* state[DECODE_ROWS];
    int pos[DECODE_ROWS];
};

// lightning_decode for the rows of a batched decode step, each with its own sequence's state:
// row z of q and out (heads·d apart) and of k and v (kv_heads·d apart) steps rows.state[z].
// launch: grid = (heads, ceil(d / 32), rows ≤ DECODE_ROWS), block = 256
extern "C" __global__ void __launch_bounds__(256)
lightning_decode_rows(const bf16* q, const bf16* k, const bf16* v, DecodeRows rows, bf16* out, const float* slopes,
                      int heads, int kv_heads, int d, float scale) {
    const u64 z = blockIdx.z, qd = (u64)heads * d, kd = (u64)kv_heads * d;
    lightning_step(q + z * qd, k + z * kd, v + z * kd, rows.state[z], out + z * qd, slopes, heads, kv_heads, d, scale);
}

// The RoPE table (cos, sin) of each row's own position: table[2·(r·half + i)] for rows.pos[r].
// launch: grid = ceil(n / 256) for n = rows · half, block = 256
extern "C" __global__ void rope_table_rows(const float* inv_freq, DecodeRows rows, int n_rows, int half,
                                           float* table) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    const int row = idx / half, i = idx % half;
    float s, c;
    sincosf((float)rows.pos[row] * inv_freq[i], &s, &c);
    table[2 * idx] = c;
    table[2 * idx + 1] = s;
}

// h = round(h + round(branch·scale)), then out = RMSNorm(h)·w: the residual add fused with the
// norm that follows it. Rows of width a multiple of 8, at most 8 * 2 * blockDim.x.
// launch: grid = rows, block = 512
extern "C" __global__ void __launch_bounds__(512) add_rms_norm(bf16* h, const bf16* branch, float scale, const bf16* w,
                                                               float eps, bf16* out, int dim) {
    __shared__ float scratch[32];
    bf16* hr = h + (u64)blockIdx.x * dim;
    const bf16* br = branch + (u64)blockIdx.x * dim;
    bf16* yr = out + (u64)blockIdx.x * dim;
    float v[2][8];
    uint4 wraw[2];  // the weights, loaded with the row so the second phase waits on no load
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        int pk = threadIdx.x + p * blockDim.x;
        if (pk * 8 < dim) {
            uint4 hraw = ((const uint4*)hr)[pk], braw = ((const uint4*)br)[pk];
            wraw[p] = ((const uint4*)w)[pk];
            u32 hw[4] = {hraw.x, hraw.y, hraw.z, hraw.w}, bw[4] = {braw.x, braw.y, braw.z, braw.w};
            u32 o[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float lo = round_bf(__uint_as_float(hw[i] << 16) + round_bf(__uint_as_float(bw[i] << 16) * scale));
                float hi = round_bf(__uint_as_float(hw[i] & 0xffff0000u) +
                                    round_bf(__uint_as_float(bw[i] & 0xffff0000u) * scale));
                v[p][2 * i] = lo;
                v[p][2 * i + 1] = hi;
                o[i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                ss += lo * lo + hi * hi;
            }
            ((uint4*)hr)[pk] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    float r = rsqrtf(block_sum(ss, scratch) / dim + eps);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        int pk = threadIdx.x + p * blockDim.x;
        if (pk * 8 < dim) {
            u32 ww[4] = {wraw[p].x, wraw[p].y, wraw[p].z, wraw[p].w};
            u32 o[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float lo = round_bf(v[p][2 * i] * r) * __uint_as_float(ww[i] << 16);
                float hi = round_bf(v[p][2 * i + 1] * r) * __uint_as_float(ww[i] & 0xffff0000u);
                o[i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
            }
            ((uint4*)yr)[pk] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}
