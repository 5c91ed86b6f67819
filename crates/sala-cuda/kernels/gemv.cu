// Decode-time products: a few activation rows times a bf16 weight matrix, bound by reading the
// weights once. Each warp owns GEMV_ROWS output rows and streams them with 16-byte loads,
// several in flight; the activation rows are read through the L1 cache. Every activation row's
// sums run in the same order whatever the number of rows, so a batched decode step gives each
// row the bits a single-row step gives it.

#define GEMV_ROWS 4
#define GEMV_WARPS 4

__device__ __forceinline__ void bf16x8_to_f32(uint4 p, float* f) {
    u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

template <int R>
__device__ __forceinline__ void gemv_pack(uint4 xp, const uint4* wp, float* acc) {
    float xf[8];
    bf16x8_to_f32(xp, xf);
#pragma unroll
    for (int r = 0; r < R; r++) {
        float wf[8];
        bf16x8_to_f32(wp[r], wf);
#pragma unroll
        for (int e = 0; e < 8; e++) acc[r] += xf[e] * wf[e];
    }
}

// acc[b][r] = Σ_i x_b[i]·w[row_r, i] for R weight rows and the NB activation rows
// x_b = x + b·x_stride, b < nb (one warp; every lane gets its partial sums, reduce with
// warp_sum). k is a multiple of 8. Each lane adds packs lane, lane + 32, ... in order, for every
// b, R and U alike (U packs a row in flight per lane): the weights are loaded once for all rows,
// and a row's sums have the same bits whichever kernel runs them.
template <int NB, int R = GEMV_ROWS, int U = 4>
__device__ __forceinline__ void gemv_rows(const bf16* x, int x_stride, int nb, const uint4* const (&wr)[R], int k,
                                          float (&acc)[NB][R]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[b][r] = 0.0f;
    const int packs = k / 8;
    int i = lane;
    for (; i + 32 * (U - 1) < packs; i += 32 * U) {
        uint4 p[U][R];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < R; r++) p[u][r] = __ldg(wr[r] + i + 32 * u);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            if (b < nb) {
                const uint4* xg = (const uint4*)(x + (size_t)b * x_stride);
                uint4 xp[U];
#pragma unroll
                for (int u = 0; u < U; u++) xp[u] = __ldg(xg + i + 32 * u);
#pragma unroll
                for (int u = 0; u < U; u++) gemv_pack<R>(xp[u], p[u], acc[b]);
            }
        }
    }
    for (; i < packs; i += 32) {
        uint4 p[R];
#pragma unroll
        for (int r = 0; r < R; r++) p[r] = __ldg(wr[r] + i);
#pragma unroll
        for (int b = 0; b < NB; b++)
            if (b < nb) gemv_pack<R>(__ldg((const uint4*)(x + (size_t)b * x_stride) + i), p, acc[b]);
    }
}

// Where output o of activation row b goes: o < n0 → y0, then n1 values to y1, n2 to y2, the rest
// to y3, each output's rows `stride_j` (its count) apart.
__device__ __forceinline__ void gemv_store(float s, int o, int b, bf16* y0, int n0, bf16* y1, int n1, bf16* y2,
                                           int n2, bf16* y3, int n) {
    bf16* y = y0;
    int w = n0;
    if (o >= n0) {
        o -= n0;
        y = y1;
        w = n1;
        if (o >= n1) {
            o -= n1;
            y = y2;
            w = n2;
            if (o >= n2) {
                o -= n2;
                y = y3;
                w = n - n0 - n1 - n2;
            }
        }
    }
    y[(size_t)b * w + o] = f2bf(s);
}

// y[o] = round(Σ_i x[i]·w[o, i]) for o < n, written to up to four outputs in turn: o < n0 goes
// to y0[o], then n1 values to y1, n2 to y2, the rest to y3 (one product of stacked weights,
// as separate products would). k is a multiple of 8.
// launch: grid = ceil(n / (GEMV_WARPS * GEMV_ROWS)), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv(const bf16* x, const bf16* w, int n, int k, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) wr[r] = (const uint4*)(w + (u64)min(row0 + r, n - 1) * k);
    float acc[1][GEMV_ROWS];
    gemv_rows<1>(x, k, 1, wr, k, acc);
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const float s = warp_sum(acc[0][r]);
        if (lane == 0 && row0 + r < n) gemv_store(s, row0 + r, 0, y0, n0, y1, n1, y2, n2, y3, n);
    }
}

// gemv with one output row a warp and 8 packs in flight a lane: four times the warps of gemv,
// for products with few output rows (4096), where gemv leaves most SMs with two blocks.
// launch: grid = ceil(n / GEMV_WARPS), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_narrow(const bf16* x, const bf16* w, int n, int k, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2,
            bf16* y3) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    const uint4* wr[1] = {(const uint4*)(w + (u64)min(row, n - 1) * k)};
    float acc[1][1];
    gemv_rows<1, 1, 8>(x, k, 1, wr, k, acc);
    const float s = warp_sum(acc[0][0]);
    if (lane == 0 && row < n) gemv_store(s, row, 0, y0, n0, y1, n1, y2, n2, y3, n);
}

#define GEMV_BATCH 8

// gemv for nb ≤ GEMV_BATCH activation rows at once (x rows k apart; output row b of part j at
// y_j + b·n_j), reading the weights once; each row's result has the bits gemv gives it.
// launch: grid = ceil(n / (GEMV_WARPS * GEMV_ROWS)), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_batch(const bf16* x, const bf16* w, int n, int k, int nb, bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2,
           bf16* y3) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) wr[r] = (const uint4*)(w + (u64)min(row0 + r, n - 1) * k);
    float acc[GEMV_BATCH][GEMV_ROWS];
    gemv_rows<GEMV_BATCH>(x, k, nb, wr, k, acc);
#pragma unroll
    for (int b = 0; b < GEMV_BATCH; b++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            const float s = warp_sum(acc[b][r]);
            if (b < nb && lane == 0 && row0 + r < n) gemv_store(s, row0 + r, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
}

// The MLP's first half: with w = [gate; up] ([2·inter, k]), for activation row b < nb (rows k
// apart), y[b·inter + j] = round(round(silu(g_j)) · u_j), g_j = round(x_b·w[j]),
// u_j = round(x_b·w[inter + j]) (gemv, then silu_mul_halves, in one pass). Each warp owns
// GEMV_ROWS / 2 outputs. NB = 1 for one row (gemv_silu), GEMV_BATCH for several.
template <int NB>
__device__ __forceinline__ void gemv_silu_body(const bf16* x, const bf16* w, bf16* y, int inter, int k, int nb) {
    constexpr int HALF = GEMV_ROWS / 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j0 = (blockIdx.x * GEMV_WARPS + warp) * HALF;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < HALF; r++) {
        const int j = min(j0 + r, inter - 1);
        wr[r] = (const uint4*)(w + (u64)j * k);
        wr[HALF + r] = (const uint4*)(w + (u64)(inter + j) * k);
    }
    float acc[NB][GEMV_ROWS];
    gemv_rows<NB>(x, k, nb, wr, k, acc);
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int r = 0; r < HALF; r++) {
            const float g = bf2f(f2bf(warp_sum(acc[b][r])));
            const float u = bf2f(f2bf(warp_sum(acc[b][HALF + r])));
            if (b < nb && lane == 0 && j0 + r < inter)
                y[(size_t)b * inter + j0 + r] = f2bf(silu_times(g, u));
        }
}

// launch: grid = ceil(inter / (GEMV_WARPS * GEMV_ROWS / 2)), block = 32 * GEMV_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_silu(const bf16* x, const bf16* w, bf16* y, int inter, int k) {
    gemv_silu_body<1>(x, w, y, inter, k, 1);
}

// gemv_silu for nb ≤ GEMV_BATCH rows at once (same launch shape).
extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_silu_batch(const bf16* x, const bf16* w, bf16* y, int inter, int k, int nb) {
    gemv_silu_body<GEMV_BATCH>(x, w, y, inter, k, nb);
}

// silu_mul_halves, 8 values a thread with 16-byte loads and stores (inter a multiple of 8).
// launch: grid = (ceil(inter / 8 / 256), rows), block = 256
extern "C" __global__ void silu_mul_halves8(const bf16* gu, bf16* out, int inter) {
    const int i = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= inter) return;
    const size_t r = blockIdx.y;
    const uint4 gv = *(const uint4*)(gu + r * 2 * inter + i);
    const uint4 uv = *(const uint4*)(gu + r * 2 * inter + inter + i);
    float g[8], u[8];
    bf16x8_to_f32(gv, g);
    bf16x8_to_f32(uv, u);
    u32 o[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
        o[e] = (u32)f2bf(silu_times(g[2 * e], u[2 * e])) | ((u32)f2bf(silu_times(g[2 * e + 1], u[2 * e + 1])) << 16);
    }
    *(uint4*)(out + r * inter + i) = make_uint4(o[0], o[1], o[2], o[3]);
}

// out[r, i] = round(round(silu(gu[r, i])) · gu[r, inter + i]) for gu = [rows, 2·inter].
// launch: grid = ceil(rows * inter / 256), block = 256
extern "C" __global__ void silu_mul_halves(const bf16* gu, bf16* out, int rows, int inter) {
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * inter) return;
    u64 r = idx / inter, i = idx % inter;
    float g = bf2f(gu[r * 2 * inter + i]);
    out[idx] = f2bf(silu_times(g, bf2f(gu[r * 2 * inter + inter + i])));
}
