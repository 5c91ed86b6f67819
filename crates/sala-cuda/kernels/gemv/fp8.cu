// Decode-time products over FP8 weights (E4M3 with a scale per weight row, inputs as E4M3),
// and the FP8 prefill products' helpers.

#include "common/types.cuh"
#include "common/fp8.cuh"
#include "common/mma.cuh"
#include "gemv/common.cuh"

// ---- FP8 weights (`--quantize fp8`): E4M3 codes with a scale per weight row, inputs as E4M3 ----
// y[b][o] = round((Σ_i e4m3(x[b][i]·inv_b) · code[o][i]) · xs[b] · ws[o]), inv_b = 1 / xs[b],
// xs[b] = f8_scale(amax of row b) (sala_model::Fp8Matrix's product). The decode products run on
// E4M3 tensor cores from 8.9 on, on f16 ones before (E4M3 values are exact in f16, times
// F8_F16_UNIT each).

// Row xr (k values, k a multiple of 8) as FP8 at its own scale, by the whole block (a multiple
// of 32 threads): its codes (`codes`, when not NULL), their bf16 values (`values`, when not
// NULL), its scale (`*scale`, written by thread 0). `scratch` holds 32 floats.
__device__ __forceinline__ void quant_row_f8(const bf16* xr, int k, unsigned char* codes, bf16* values, float* scale,
                                             float* scratch) {
    float amax = 0.0f;
    for (int i = threadIdx.x * 8; i < k; i += blockDim.x * 8) amax = fmaxf(amax, amax8(*(const uint4*)(xr + i)));
    amax = block_max(amax, scratch);
    const float s = f8_scale(amax), inv = __fdiv_rn(1.0f, s);
    for (int i = threadIdx.x * 8; i < k; i += blockDim.x * 8) {
        const uint4 v = *(const uint4*)(xr + i);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
        u32 c[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            c[j] = e4m3x2_code(bf2f((bf16)(w[j] & 0xffffu)) * inv, bf2f((bf16)(w[j] >> 16)) * inv);
        if (codes) *(uint2*)(codes + i) = make_uint2(c[0] | (c[1] << 16), c[2] | (c[3] << 16));
        if (values) {
            u32 o[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                o[j] = (__float_as_uint(e4m3_value(c[j] & 0xffu)) >> 16) |
                       (__float_as_uint(e4m3_value(c[j] >> 8)) & 0xffff0000u);
            *(uint4*)(values + i) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    if (threadIdx.x == 0) *scale = s;
}

// Each of `rows` rows of x (k apart, k a multiple of 8) as FP8 at its own scale: its codes
// (`codes`, when not NULL), their bf16 values (`values`, when not NULL), its scale.
// launch: grid = rows, block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
quant_rows_f8(const bf16* x, int k, unsigned char* codes, bf16* values, float* scales) {
    pdl_start();
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    quant_row_f8(x + row * k, k, codes ? codes + row * k : nullptr, values ? values + row * k : nullptr, scales + row,
                 scratch);
}

// sm_90 and sm_100 have no mma.sync for E4M3 (ptxas makes it F2FP conversions, two f16 MMAs
// from zero and adds): there the codes' f16 values (cvt, exact) go through two f16 MMAs that
// sum into d in f32 directly, as the bf16 products do.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
#define F8_AS_F16 1
#else
#define F8_AS_F16 0
#endif

#if F8_AS_F16
// Four E4M3 codes as two f16 pairs (codes 0-1, codes 2-3), exact: the word's 16-bit halves
// converted as they are (no shifts).
__device__ __forceinline__ void e4m3x4_f16(u32 c, u32 (&h)[2]) {
    asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, u;\n}\n"
        : "=r"(h[0]), "=r"(h[1])
        : "r"(c));
}
#endif

// d += A·B for one k32 step of E4M3 codes: A's rows g and g + 8 (words a_lo, a_hi: bytes
// 0..3 of each are k slots 4t..4t + 3, bytes 4..7 slots 16 + 4t ..), B's column g the same way.
// From 8.9 on one E4M3 MMA, before it two f16 ones over the codes' exact values (times
// F8_F16_UNIT); either way the step's sum starts from zero and is added to d on the CUDA cores,
// so the tensor cores' narrow FP8 accumulation never carries across steps. On sm_90 and sm_100
// (F8_AS_F16) the two f16 MMAs sum into d directly (f32 accumulation). The products are exact.
__device__ __forceinline__ void f8_mma_k32(float (&d)[4], uint2 a_lo, uint2 a_hi, uint2 b) {
#if F8_AS_F16
    u32 al[2][2], ah[2][2], bb[2][2];  // [word][half]: f16 pairs of codes 0-1 and 2-3
    e4m3x4_f16(a_lo.x, al[0]);
    e4m3x4_f16(a_lo.y, al[1]);
    e4m3x4_f16(a_hi.x, ah[0]);
    e4m3x4_f16(a_hi.y, ah[1]);
    e4m3x4_f16(b.x, bb[0]);
    e4m3x4_f16(b.y, bb[1]);
#pragma unroll
    for (int w = 0; w < 2; w++) sp_mma_f16(d, al[w][0], ah[w][0], al[w][1], ah[w][1], bb[w][0], bb[w][1]);
    return;
#endif
    float e[4];
#if F8_HW
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(e[0]), "=f"(e[1]), "=f"(e[2]), "=f"(e[3])
        : "r"(a_lo.x), "r"(a_hi.x), "r"(a_lo.y), "r"(a_hi.y), "r"(b.x), "r"(b.y), "f"(0.0f));
#else
#pragma unroll
    for (int i = 0; i < 4; i++) e[i] = 0.0f;
    sp_mma_f16(e, e4m3x2_f16(a_lo.x), e4m3x2_f16(a_hi.x), e4m3x2_f16(a_lo.x >> 16), e4m3x2_f16(a_hi.x >> 16),
               e4m3x2_f16(b.x), e4m3x2_f16(b.x >> 16));
    sp_mma_f16(e, e4m3x2_f16(a_lo.y), e4m3x2_f16(a_hi.y), e4m3x2_f16(a_lo.y >> 16), e4m3x2_f16(a_hi.y >> 16),
               e4m3x2_f16(b.y), e4m3x2_f16(b.y >> 16));
#endif
#pragma unroll
    for (int i = 0; i < 4; i++) d[i] += e[i];
}

// A warp's weights for one slab (128 k) of M-tile rows row[0], row[1]: lane (g, t) takes 2 packs
// of 16 consecutive codes of each (zeros past k); its activation rows' codes at the same k.
__device__ __forceinline__ void f8_load_w(const unsigned char* const (&row)[2], int k, int s, uint4 (&a)[2][2]) {
    const int t = threadIdx.x & 3;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int kk = s * 128 + (t * 2 + p) * 16;
#pragma unroll
        for (int h = 0; h < 2; h++) a[p][h] = kk < k ? __ldg((const uint4*)(row[h] + kk)) : zero;
    }
}

// y = round(Σ codes · xs[b] · ws[o]) for M-tiles of 16 weight rows, activations as E4M3 codes xc
// (nb ≤ 8·NT rows, k apart) with their scales xs (quant_rows_f8); outputs as gemv. A row's result
// does not depend on nb: warp w takes slabs w, w + 16, ... in order, each slab's four k32 steps on
// E4M3 tensor cores (f8_mma_k32), and the warps' sums are added in warp order. A block runs M-tiles
// blockIdx.x, + gridDim.x, ... in turn, each warp asking for its next slab's weights (this tile's,
// or the next tile's first) before it multiplies the current one, so the weights stream while a
// tile's sums are added and stored; the first ones are asked for before the PDL wait.
// SILU: w is [gate; up] (n = 2·inter, inter a multiple of 8), each M-tile 8 gate rows j..j + 7
// and their up rows, and
// y0 gets round(round(silu(round(g))) · round(u)) (the product, then silu_mul_halves).
// XB: xc is the rows' bf16 values: each block makes their codes and scales itself, as
// quant_rows_f8 does (quant_row_f8), into shared memory (nb · k bytes, dynamic).
template <int NT, bool SILU, bool XB = false>
__device__ __forceinline__ void gemv_f8_body(const unsigned char* xc, const float* xs, const unsigned char* w,
                                             const float* ws, int n, int k, int nb, bf16* y0, int n0, bf16* y1,
                                             int n1, bf16* y2, int n2, bf16* y3) {
    // Two buffers of the warps' sums, tiles taking turns: a warp writes a buffer only after the
    // barrier of the tile between, which every thread passes after reading it, so one barrier a
    // tile (gm_block_sum's) suffices.
    __shared__ float red[2][GM_WARPS][NT * 128];
    int turn = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tile_rows = SILU ? 8 : 16, g = lane >> 2, inter = n / 2;
    const int tiles = ((SILU ? inter : n) + tile_rows - 1) / tile_rows;
    const int slabs = (k + 127) / 128;
    auto rows_of = [&](int tile, const unsigned char* (&rows)[2]) {
        const int m0 = tile * tile_rows;
        const int r0 = SILU ? min(m0 + g, inter - 1) : min(m0 + g, n - 1);
        const int r1 = SILU ? inter + r0 : min(m0 + g + 8, n - 1);
        rows[0] = w + (u64)r0 * k;
        rows[1] = w + (u64)r1 * k;
    };
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int t = lane & 3;
    uint4 a[2][2], an[2][2];
    const unsigned char* rows[2];
    rows_of(blockIdx.x, rows);
    if ((int)blockIdx.x < tiles) f8_load_w(rows, k, warp, a);
    pdl_start();
    // XB: the codes in shared memory (read by shared-window address), the scales too.
    extern __shared__ __align__(16) unsigned char f8_x_codes[];
    if constexpr (XB) {
        __shared__ float x_scales[8], scratch[32];
        for (int b = 0; b < nb; b++)
            quant_row_f8((const bf16*)xc + (u64)b * k, k, f8_x_codes + (u64)b * k, nullptr, &x_scales[b], scratch);
        __syncthreads();
        xs = x_scales;
    }
    // Lane columns past nb read row nb − 1 (their sums are not stored).
    const unsigned char* xr[NT];
    u32 xr_shared[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const u32 row = min(nt * 8 + g, nb - 1) * k;
        xr[nt] = xc + row;
        xr_shared[nt] = XB ? sp_smem_addr(f8_x_codes) + row : 0;
    }
    const float unit = 1.0f / (F8_F16_UNIT * F8_F16_UNIT);  // the MMAs summed values times F8_F16_UNIT²
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[nt][i] = 0.0f;
        // Slab s from cur, after asking for the warp's next slab (this tile's, else the first of
        // the block's next tile) into nxt; two a turn, so the buffers swap roles without copies.
        auto slab = [&](const uint4 (&cur)[2][2], uint4 (&nxt)[2][2], int s) {
            uint4 b[2][NT];
#pragma unroll
            for (int p = 0; p < 2; p++) {
                const int kk = s * 128 + (t * 2 + p) * 16;
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    b[p][nt] = kk >= k ? zero : XB ? gm_lds(xr_shared[nt] + kk) : __ldg((const uint4*)(xr[nt] + kk));
            }
            const int ns = s + GM_WARPS < slabs ? s + GM_WARPS : warp;
            const int ntile = s + GM_WARPS < slabs ? tile : tile + (int)gridDim.x;
            if (ntile < tiles) {
                const unsigned char* nrows[2];
                rows_of(ntile, nrows);
                f8_load_w(nrows, k, ns, nxt);
            }
#pragma unroll
            for (int p = 0; p < 2; p++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 lo = cur[p][0], hi = cur[p][1], x = b[p][nt];
                    f8_mma_k32(c[nt], make_uint2(lo.x, lo.y), make_uint2(hi.x, hi.y), make_uint2(x.x, x.y));
                    f8_mma_k32(c[nt], make_uint2(lo.z, lo.w), make_uint2(hi.z, hi.w), make_uint2(x.z, x.w));
                }
        };
        gm_slab_turns(slabs, a, an, slab, [](uint4(&to)[2][2], const uint4(&from)[2][2]) {
#pragma unroll
            for (int p = 0; p < 2; p++) to[p][0] = from[p][0], to[p][1] = from[p][1];
        });
        const int v = threadIdx.x, m0 = tile * tile_rows;
        if (SILU) {
            // Gate sums are fragments 0, 1 and up sums 2, 3 of the same lane (as gemv_silu_mma).
            const int nt = v >> 6, i = (v >> 5) & 1, l = v & 31, vg = nt * 128 + i * 32 + l;
            const float gs = gm_block_sum<NT>(red[turn], c, v < NT * 64 ? vg : NT * 128, 1);
            const float us = v < NT * 64 ? gm_grouped_sum(&red[turn][0][vg + 64], NT * 128, 1) : 0.0f;
            const int j = m0 + (l >> 2), b = nt * 8 + 2 * (l & 3) + i;
            if (v < NT * 64 && j < inter && b < nb)
                y0[(u64)b * inter + j] = f2bf(
                    silu_times(round_bf(gs * unit * xs[b] * ws[j]), round_bf(us * unit * xs[b] * ws[inter + j])));
        } else {
            const float s = gm_block_sum<NT>(red[turn], c, v, 1);
            const int nt = v >> 7, i = (v >> 5) & 3, l = v & 31;
            const int o = m0 + (l >> 2) + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * (l & 3) + (i & 1);
            if (v < NT * 128 && o < n && b < nb)
                gemv_store(s * unit * xs[b] * ws[o], o, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
        turn ^= 1;
    }
}

// nb ≤ 8 activation rows as E4M3 codes and scales (k a multiple of 16), outputs as gemv.
// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_f8_8(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, int n, int k, int nb,
          bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<1, false>(xc, xs, w, ws, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_f8_8 of nb ≤ 8 rows given as bf16 values (k a multiple of 16): each block makes their
// codes and scales (quant_rows_f8's), so no launch before it does. Two blocks an SM, as
// gemv_f8_8 on Hopper.
// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = nb · k bytes
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_f8_bf16_8(const bf16* x, const unsigned char* w, const float* ws, int n, int k, int nb, bf16* y0, int n0,
               bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<1, false, true>((const unsigned char*)x, nullptr, w, ws, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_f8_8 for nb ≤ 16.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_f8_16(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, int n, int k, int nb,
           bf16* y0, int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<2, false>(xc, xs, w, ws, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
}

// The MLP's first half on an FP8 [gate; up] matrix ([2·inter, k]) for nb ≤ 8 rows (codes and
// scales as gemv_f8_8): y[b·inter + j] = round(round(silu(g)) · u) of the product's rounded
// outputs g, u.
// launch: grid = min(ceil(inter / 8), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_f8_8(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, bf16* y, int inter,
               int k, int nb) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<1, true>(xc, xs, w, ws, 2 * inter, k, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// gemv_silu_f8_8 for nb ≤ 16.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS)
gemv_silu_f8_16(const unsigned char* xc, const float* xs, const unsigned char* w, const float* ws, bf16* y,
                int inter, int k, int nb) {
    // (the PDL wait: in gemv_f8_body, after its first weights are asked for)
    gemv_f8_body<2, true>(xc, xs, w, ws, 2 * inter, k, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// A product's raw sums (bf16 [rows, n], in place) times their row's and column's scales:
// y = round(y · xs[r] · ws[c]) (the FP8 GEMM where cuBLASLt cannot scale by vectors).
// launch: grid = (rows, ceil(n / 2048)), block = 256, dynamic smem = 0 bytes (8 columns a thread)
extern "C" __global__ void __launch_bounds__(256)
scale_rows_cols(bf16* y, const float* xs, const float* ws, int n) {
    pdl_start();
    const int c0 = (blockIdx.y * 256 + threadIdx.x) * 8;
    if (c0 >= n) return;
    const float s = xs[blockIdx.x];
    bf16* yr = y + (u64)blockIdx.x * n;
    if (c0 + 8 <= n && (n & 7) == 0) {
        uint4 v = *(const uint4*)(yr + c0);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float lo = bf2f((bf16)(w[j] & 0xffffu)) * s * ws[c0 + 2 * j];
            const float hi = bf2f((bf16)(w[j] >> 16)) * s * ws[c0 + 2 * j + 1];
            w[j] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
        }
        *(uint4*)(yr + c0) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        for (int c = c0; c < min(n, c0 + 8); c++) yr[c] = f2bf(bf2f(yr[c]) * s * ws[c]);
    }
}

// FP8 codes as bf16 values (unscaled), for cards without FP8 tensor cores.
// launch: grid = ceil(count / 1024), block = 256, dynamic smem = 0 bytes (4 codes a thread)
extern "C" __global__ void __launch_bounds__(256)
dequant_f8(const unsigned char* codes, bf16* out, u64 count) {
    pdl_start();
    const u64 i = ((u64)blockIdx.x * 256 + threadIdx.x) * 4;
    if (i >= count) return;
    if (i + 4 <= count) {
        u32 lo, hi;
        e4m3x4_bf16(*(const u32*)(codes + i), lo, hi);
        *(uint2*)(out + i) = make_uint2(lo, hi);
    } else {
        for (u64 j = i; j < count; j++) out[j] = (bf16)(__float_as_uint(e4m3_value(codes[j])) >> 16);
    }
}
