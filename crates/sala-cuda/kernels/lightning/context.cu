// Context parallelism (sala_model::context): a lightning layer read in ranges on several
// ranks, each from a zero state; the scan of their end states and each range's start-state
// term.

#include "common/types.cuh"
#include "lightning/common.cuh"

// state[h][i] += γ_h^tokens · prev[h][i] (γ_h = exp(−slopes[h])): a range's end state from zero
// made the end state of the range read after `prev`. `per_head` = d·d values a head.
// launch: grid = ceil(heads·per_head / 256), block = 256
extern "C" __global__ void lightning_state_advance(float* state, const float* prev, const float* slopes,
                                                   int tokens, int per_head, int heads) {
    pdl_start();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)heads * per_head) return;
    int h = (int)(i / per_head);
    state[i] += lc_pow(-slopes[h], tokens) * prev[i];
}

#define LST_ROWS 32  // rows of q a block of lightning_state_term takes, with one head's state
// out[t][h·d + e] = bf16(out + scale · γ_h^{t+1} · Σ_a q[t][h·d + a] · S[h][a][e]) for the first
// `rows` rows (t counted from the range's first row): the term of the state S a range starts
// from, added to its outputs read from a zero state. Thread e owns value column e of up to
// LST_ROWS rows; the block's q rows (bf16) are staged in shared memory, S read once a block.
// launch: grid = (ceil(rows / LST_ROWS), heads), block = d (at most 256), smem = LST_ROWS·d·4
extern "C" __global__ void lightning_state_term(const bf16* q, const float* state, const float* slopes, bf16* out,
                                                int rows, int heads, int d, float scale) {
    pdl_start();
    extern __shared__ float qs[];  // [LST_ROWS][d]
    const int h = blockIdx.y, e = threadIdx.x, t0 = blockIdx.x * LST_ROWS;
    const int n = min(LST_ROWS, rows - t0);
    const u64 width = (u64)heads * d;
    for (int i = threadIdx.x; i < n * d; i += blockDim.x) {
        int r = i / d, a = i % d;
        qs[r * d + a] = bf2f(q[(u64)(t0 + r) * width + (u64)h * d + a]);
    }
    __syncthreads();
    if (e >= d) return;
    float acc[LST_ROWS];
#pragma unroll
    for (int r = 0; r < LST_ROWS; r++) acc[r] = 0.0f;
    const float* s = state + (u64)h * d * d;
    for (int a = 0; a < d; a++) {
        float sa = s[(u64)a * d + e];
#pragma unroll
        for (int r = 0; r < LST_ROWS; r++) acc[r] += qs[r * d + a] * sa;
    }
    const float g = -slopes[h];
#pragma unroll
    for (int r = 0; r < LST_ROWS; r++) {
        if (r < n) {
            u64 at = (u64)(t0 + r) * width + (u64)h * d + e;
            out[at] = f2bf(bf2f(out[at]) + scale * lc_pow(g, t0 + r + 1) * acc[r]);
        }
    }
}
