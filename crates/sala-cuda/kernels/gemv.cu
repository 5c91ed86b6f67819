// Decode-time products: one activation row times a bf16 weight matrix, bound by reading the
// weights once. Each warp owns GEMV_ROWS output rows and streams them with 16-byte loads,
// several in flight; the activation row sits in shared memory.

#define GEMV_ROWS 2
#define GEMV_WARPS 8

__device__ __forceinline__ void bf16x8_to_f32(uint4 p, float* f) {
    u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// y[o] = round(Σ_i x[i]·w[o, i]) for o < n; k is a multiple of 8 and at most 32768.
// launch: grid = ceil(n / (GEMV_WARPS * GEMV_ROWS)), block = 32 * GEMV_WARPS, dynamic smem = k * 2 bytes
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) gemv(const bf16* x, const bf16* w, bf16* y, int n, int k) {
    extern __shared__ uint4 xs[];  // k / 8 packs of 8 bf16
    const uint4* xg = (const uint4*)x;
    for (int i = threadIdx.x; i < k / 8; i += blockDim.x) xs[i] = xg[i];
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    float acc[GEMV_ROWS];
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        acc[r] = 0.0f;
        int row = min(row0 + r, n - 1);
        wr[r] = (const uint4*)(w + (u64)row * k);
    }
    int packs = k / 8;
    int i = lane;
    // Main loop: 4 packs per row per step keeps 4 * GEMV_ROWS 16-byte loads in flight.
    for (; i + 96 < packs; i += 128) {
        uint4 p[GEMV_ROWS][4];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
            for (int u = 0; u < 4; u++) p[r][u] = __ldg(wr[r] + i + 32 * u);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float xf[8];
            bf16x8_to_f32(xs[i + 32 * u], xf);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) {
                float wf[8];
                bf16x8_to_f32(p[r][u], wf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[r] += xf[e] * wf[e];
            }
        }
    }
    for (; i < packs; i += 32) {
        float xf[8];
        bf16x8_to_f32(xs[i], xf);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            float wf[8];
            bf16x8_to_f32(__ldg(wr[r] + i), wf);
#pragma unroll
            for (int e = 0; e < 8; e++) acc[r] += xf[e] * wf[e];
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < n) y[row0 + r] = f2bf(s);
    }
}

// Splits the columns of src [rows, total] into up to four outputs of widths w0..w3 (in
// order; a width of 0 ends the list).
// launch: grid = ceil(rows * total / 256), block = 256
extern "C" __global__ void split_cols(const bf16* src, int rows, int total, bf16* d0, int w0, bf16* d1, int w1,
                                      bf16* d2, int w2, bf16* d3, int w3) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * total) return;
    int r = idx / total, c = idx % total;
    bf16 v = src[idx];
    if (c < w0) { d0[(u64)r * w0 + c] = v; return; }
    c -= w0;
    if (c < w1) { d1[(u64)r * w1 + c] = v; return; }
    c -= w1;
    if (c < w2) { d2[(u64)r * w2 + c] = v; return; }
    c -= w2;
    if (c < w3) d3[(u64)r * w3 + c] = v;
}

// out[r, i] = round(round(silu(gu[r, i])) · gu[r, inter + i]) for gu = [rows, 2·inter].
// launch: grid = ceil(rows * inter / 256), block = 256
extern "C" __global__ void silu_mul_halves(const bf16* gu, bf16* out, int rows, int inter) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * inter) return;
    u64 r = idx / inter, i = idx % inter;
    float g = bf2f(gu[r * 2 * inter + i]);
    out[idx] = f2bf(round_bf(g / (1.0f + expf(-g))) * bf2f(gu[r * 2 * inter + inter + i]));
}
