// Embedding, norms, RoPE, gates, residuals and the MLP's SiLU: bf16 in and out, fp32 arithmetic,
// rounding to bf16 wherever the reference stores a bf16 tensor (see sala-model's Backend docs).

#include "common/types.cuh"
#include "common/head_norm.cuh"
#include "common/rows.cuh"
#include "common/fp8.cuh"

// launch: grid = rows, block = 256
extern "C" __global__ void embed(const bf16* table, const u32* ids, float scale, bf16* out, int dim) {
    pdl_start();
    const bf16* src = table + (u64)ids[blockIdx.x] * dim;
    bf16* dst = out + (u64)blockIdx.x * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = f2bf(bf2f(src[c]) * scale);
}

// One row per block. Rows whose width is a multiple of 8 and at most 8 * 2 * blockDim.x are
// read once, 16 bytes per load, and kept in registers; others take the plain loop.
// With `codes` non-null (rows read packed only), each output row is also made E4M3 codes at its
// own scale, into `codes` (dim a row) and `scales`, as quant_rows_f8 would (an FP8 product's
// inputs).
// launch: grid = rows, block = 512
#define RMS_PACKS 2
// With `gate` non-null, the result is then multiplied by round(sigmoid(gate)) (the lightning
// output gate after o_norm).
__device__ __forceinline__ float gated_by(float normed, float g) {
    return round_bf(normed) * round_bf(1.0f / (1.0f + expf(-g)));
}
__device__ __forceinline__ float gated(float normed, const bf16* gate, u64 i) {
    if (!gate) return normed;
    return gated_by(normed, bf2f(gate[i]));
}

// With `sums` non-null (tensor parallelism: the row's columns split among ranks), the mean square
// is sums[row] / width, the sum over every rank's columns (row_sums_sq's, added across ranks).
extern "C" __global__ void __launch_bounds__(512) rms_norm(const bf16* x, const bf16* w, float eps, bf16* out, int dim,
                                                           const bf16* gate, unsigned char* codes, float* scales,
                                                           const float* sums, int width) {
    pdl_start();
    __shared__ float scratch[32];
    const bf16* xr = x + (u64)blockIdx.x * dim;
    bf16* yr = out + (u64)blockIdx.x * dim;
    if (dim % 8 == 0 && dim <= 8 * RMS_PACKS * (int)blockDim.x) {
        float v[RMS_PACKS][8];
        // The weights and gates loaded with the row, so the second phase waits on no load.
        uint4 wraw[RMS_PACKS], graw[RMS_PACKS];
        float ss = 0.0f;
#pragma unroll
        for (int p = 0; p < RMS_PACKS; p++) {
            int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                uint4 raw = ((const uint4*)xr)[pk];
                wraw[p] = ((const uint4*)w)[pk];
                if (gate) graw[p] = ((const uint4*)(gate + (u64)blockIdx.x * dim))[pk];
                u32 wd[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[p][2 * i] = __uint_as_float(wd[i] << 16);
                    v[p][2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
                }
#pragma unroll
                for (int e = 0; e < 8; e++) ss += v[p][e] * v[p][e];
            }
        }
        float r = rsqrtf((sums ? sums[blockIdx.x] / width : block_sum(ss, scratch) / dim) + eps);
        u32 o[RMS_PACKS][4] = {};
#pragma unroll
        for (int p = 0; p < RMS_PACKS; p++) {
            int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                u32 ww[4] = {wraw[p].x, wraw[p].y, wraw[p].z, wraw[p].w};
                u32 gg[4] = {graw[p].x, graw[p].y, graw[p].z, graw[p].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float lo = round_bf(v[p][2 * i] * r) * __uint_as_float(ww[i] << 16);
                    float hi = round_bf(v[p][2 * i + 1] * r) * __uint_as_float(ww[i] & 0xffff0000u);
                    if (gate) {
                        lo = gated_by(lo, __uint_as_float(gg[i] << 16));
                        hi = gated_by(hi, __uint_as_float(gg[i] & 0xffff0000u));
                    }
                    o[p][i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                }
                ((uint4*)yr)[pk] = make_uint4(o[p][0], o[p][1], o[p][2], o[p][3]);
            }
        }
        if (codes) row_codes_f8<RMS_PACKS>(o, dim, scratch, codes + (u64)blockIdx.x * dim, scales + blockIdx.x);
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = bf2f(xr[c]);
        ss += v * v;
    }
    float r = rsqrtf((sums ? sums[blockIdx.x] / width : block_sum(ss, scratch) / dim) + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        yr[c] = f2bf(gated(round_bf(bf2f(xr[c]) * r) * bf2f(w[c]), gate, (u64)blockIdx.x * dim + c));
}

// Each row's sum of squares into sums[row], added as rms_norm adds them (the same threads, packs
// and block sum: over one rank, rms_norm with these sums gives its own bits).
// launch: grid = rows, block = 512
extern "C" __global__ void __launch_bounds__(512) row_sums_sq(const bf16* x, int dim, float* sums) {
    pdl_start();
    __shared__ float scratch[32];
    const bf16* xr = x + (u64)blockIdx.x * dim;
    float ss = 0.0f;
    if (dim % 8 == 0 && dim <= 8 * RMS_PACKS * (int)blockDim.x) {
#pragma unroll
        for (int p = 0; p < RMS_PACKS; p++) {
            int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                uint4 raw = ((const uint4*)xr)[pk];
                u32 wd[4] = {raw.x, raw.y, raw.z, raw.w};
                float v[8];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    v[2 * i] = __uint_as_float(wd[i] << 16);
                    v[2 * i + 1] = __uint_as_float(wd[i] & 0xffff0000u);
                }
#pragma unroll
                for (int e = 0; e < 8; e++) ss += v[e] * v[e];
            }
        }
    } else {
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            float v = bf2f(xr[c]);
            ss += v * v;
        }
    }
    float total = block_sum(ss, scratch);
    if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

// h = round(h + round(branch·scale)), then out = RMSNorm(h)·w: the residual add fused with the
// norm that follows it. Rows of width a multiple of 8, at most 8 * 2 * blockDim.x. A block takes
// rows blockIdx.x, + gridDim.x, ... in turn, asking for its next row's h and branch before it
// sums the current one's squares, so the loads of one row hide the block sum and stores of the
// last; each row's arithmetic is the same whatever the grid.
// launch: grid = min(rows, resident blocks), block = 512
// With `codes` non-null, the outputs' E4M3 codes and scales too, as rms_norm makes them.
extern "C" __global__ void __launch_bounds__(512, 2) add_rms_norm(bf16* h, const bf16* branch, float scale, const bf16* w,
                                                                  float eps, bf16* out, int dim, int rows,
                                                                  unsigned char* codes, float* scales) {
    pdl_start();
    __shared__ float scratch[32];
    uint4 hraw[2], braw[2];  // a row's h and branch, asked for a row ahead
    auto load = [&](int row) {
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                hraw[p] = ((const uint4*)(h + (u64)row * dim))[pk];
                braw[p] = ((const uint4*)(branch + (u64)row * dim))[pk];
            }
        }
    };
    if ((int)blockIdx.x < rows) load(blockIdx.x);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        bf16* hr = h + (u64)row * dim;
        // The new h as stored (bf16 pairs): the norm reads its values back from these.
        u32 o[2][4] = {};
        float ss = 0.0f;
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                u32 hw[4] = {hraw[p].x, hraw[p].y, hraw[p].z, hraw[p].w};
                u32 bw[4] = {braw[p].x, braw[p].y, braw[p].z, braw[p].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float lo = round_bf(__uint_as_float(hw[i] << 16) + round_bf(__uint_as_float(bw[i] << 16) * scale));
                    float hi = round_bf(__uint_as_float(hw[i] & 0xffff0000u) +
                                        round_bf(__uint_as_float(bw[i] & 0xffff0000u) * scale));
                    o[p][i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                    ss += lo * lo + hi * hi;
                }
                ((uint4*)hr)[pk] = make_uint4(o[p][0], o[p][1], o[p][2], o[p][3]);
            }
        }
        if (row + (int)gridDim.x < rows) load(row + gridDim.x);
        // The weights asked for before the block sum, so the second phase waits on no load.
        uint4 wraw[2];
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) wraw[p] = ((const uint4*)w)[pk];
        }
        float r = rsqrtf(block_sum(ss, scratch) / dim + eps);
        bf16* yr = out + (u64)row * dim;
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const int pk = threadIdx.x + p * blockDim.x;
            if (pk * 8 < dim) {
                u32 ww[4] = {wraw[p].x, wraw[p].y, wraw[p].z, wraw[p].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float lo = round_bf(__uint_as_float(o[p][i] << 16) * r) * __uint_as_float(ww[i] << 16);
                    float hi = round_bf(__uint_as_float(o[p][i] & 0xffff0000u) * r) * __uint_as_float(ww[i] & 0xffff0000u);
                    o[p][i] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
                }
                ((uint4*)yr)[pk] = make_uint4(o[p][0], o[p][1], o[p][2], o[p][3]);
            }
        }
        if (codes) row_codes_f8<2>(o, dim, scratch, codes + (u64)row * dim, scales + row);
    }
}

// x[i] = round(op(x[i], y[i])) for this thread's 8 elements 8t .. 8t + 7 of n (t its index in
// the grid): one 16-byte load of each and one store where both are 16-byte aligned and the 8 lie
// inside n, else one by one.
// launch: grid = ceil(n / (8 · 256)), block = 256
template <class Op>
__device__ __forceinline__ void elementwise8(bf16* x, const bf16* y, u64 n, Op op) {
    const u64 i0 = 8 * ((u64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i0 >= n) return;
    if (i0 + 8 <= n && (((size_t)x | (size_t)y) & 15) == 0) {
        const uint4 a = *(const uint4*)(x + i0), b = *(const uint4*)(y + i0);
        const u32 aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float lo = op(__uint_as_float(aw[k] << 16), __uint_as_float(bw[k] << 16));
            const float hi = op(__uint_as_float(aw[k] & 0xffff0000u), __uint_as_float(bw[k] & 0xffff0000u));
            o[k] = (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
        }
        *(uint4*)(x + i0) = make_uint4(o[0], o[1], o[2], o[3]);
        return;
    }
    for (u64 i = i0; i < n && i < i0 + 8; i++) x[i] = f2bf(op(bf2f(x[i]), bf2f(y[i])));
}

// launch: as elementwise8
extern "C" __global__ void silu_mul(bf16* gate, const bf16* up, u64 n) {
    pdl_start();
    elementwise8(gate, up, n, [](float g, float u) { return silu_times(g, u); });
}

// out[r, i] = round(round(silu(gu[r, i])) · gu[r, inter + i]) for gu = [rows, 2·inter].
// launch: grid = ceil(rows * inter / 256), block = 256
extern "C" __global__ void silu_mul_halves(const bf16* gu, bf16* out, int rows, int inter) {
    pdl_start();
    u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * inter) return;
    u64 r = idx / inter, i = idx % inter;
    float g = bf2f(gu[r * 2 * inter + i]);
    out[idx] = f2bf(silu_times(g, bf2f(gu[r * 2 * inter + inter + i])));
}

// silu_mul_halves, 8 values a thread with 16-byte loads and stores (inter a multiple of 8).
// launch: grid = (ceil(inter / 8 / 256), rows), block = 256
extern "C" __global__ void silu_mul_halves8(const bf16* gu, bf16* out, int inter) {
    pdl_start();
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

// launch: as elementwise8
extern "C" __global__ void add_scaled(bf16* h, const bf16* branch, float scale, u64 n) {
    pdl_start();
    elementwise8(h, branch, n, [scale](float a, float b) { return a + round_bf(b * scale); });
}

// launch: as elementwise8
extern "C" __global__ void sigmoid_gate(bf16* x, const bf16* gate, u64 n) {
    pdl_start();
    elementwise8(x, gate, n, [](float a, float g) { return a * round_bf(1.0f / (1.0f + expf(-g))); });
}

// The head a warp of head_norm_rope* owns: head hid of `base` (x), or past x's total_heads, of x2
// with its own norm weight and heads per row. False past both.
__device__ __forceinline__ bool hnr_head(int& hid, bf16*& base, const bf16*& norm_w, int& heads_per_row,
                                         int total_heads, bf16* x2, int total_heads2, const bf16* norm_w2,
                                         int heads_per_row2) {
    if (hid < total_heads) return true;
    hid -= total_heads;
    base = x2;
    norm_w = norm_w2;
    heads_per_row = heads_per_row2;
    return hid < total_heads2;
}

// Per head of `head_dim` (≤ 256, even): optional RMSNorm with the shared weight `norm_w`, then
// optional RoPE (rotate-half) at position first_pos + row, frequencies `inv_freq`.
// A second buffer (x2, its heads after the first's; may be empty) is done in the same launch
// with its own norm weight: the queries and keys of a layer.
// launch: grid = ceil((total_heads + total_heads2) / 4), block = 128 (one warp per head)
extern "C" __global__ void head_norm_rope(bf16* x, int total_heads, int head_dim, const bf16* norm_w, float eps,
                                          const float* inv_freq, int first_pos, int heads_per_row, bf16* x2,
                                          int total_heads2, const bf16* norm_w2, int heads_per_row2,
                                          const float* table) {
    pdl_start();
    int hid = blockIdx.x * 4 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    bf16* base = x;
    if (!hnr_head(hid, base, norm_w, heads_per_row, total_heads, x2, total_heads2, norm_w2, heads_per_row2)) return;
    bf16* p = base + (u64)hid * head_dim;
    int row = hid / heads_per_row;
    float v[8];  // lane l rotates elements l, l+32, ... (at most 8)
    int half = head_dim / 2;
    // The head is staged in shared memory: rotation pairs element e with e ± half.
    __shared__ float buf[4][256];
    float* hb = buf[threadIdx.x >> 5];
    for (int e = lane; e < head_dim; e += 32) hb[e] = bf2f(p[e]);
    __syncwarp();
    if (norm_w) {
        float ss = 0.0f;
        for (int e = lane; e < head_dim; e += 32) ss += hb[e] * hb[e];
        float r = rsqrtf(warp_sum(ss) / head_dim + eps);
        __syncwarp();
        for (int e = lane; e < head_dim; e += 32) hb[e] = round_bf(round_bf(hb[e] * r) * bf2f(norm_w[e]));
        __syncwarp();
    }
    if (inv_freq) {
        float pos = (float)(first_pos + row);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = lane + 32 * i;
            if (e >= head_dim) break;
            int fi = e < half ? e : e - half;
            float s, c;
            if (table) {
                c = table[2 * (row * half + fi)];
                s = table[2 * (row * half + fi) + 1];
            } else {
                sincosf(pos * inv_freq[fi], &s, &c);
            }
            float other = e < half ? -hb[e + half] : hb[e - half];
            v[i] = round_bf(hb[e] * c + other * s);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if (lane + 32 * i >= head_dim) break;
            hb[lane + 32 * i] = v[i];
        }
        __syncwarp();
    }
    for (int e = lane; e < head_dim; e += 32) p[e] = f2bf(hb[e]);
}

// Where the heads of head_norm_rope_lanes are, one after another from a first: x's heads, then
// x2's; each head's row for the RoPE table. One division to start, then steps.
struct HnrPlace {
    bool second;
    int hid, row, rem, hpr;
    __device__ __forceinline__ HnrPlace(int first, int total_heads, int heads_per_row, int heads_per_row2) {
        second = first >= total_heads;
        hid = second ? first - total_heads : first;
        hpr = max(second ? heads_per_row2 : heads_per_row, 1);
        row = hid / hpr;
        rem = hid - row * hpr;
    }
    __device__ __forceinline__ void next(int total_heads, int heads_per_row2) {
        hid++;
        if (++rem == hpr) rem = 0, row++;
        if (!second && hid == total_heads) second = true, hid = 0, row = 0, rem = 0, hpr = max(heads_per_row2, 1);
    }
};

// head_norm_rope_lanes for the 16 / E heads from `first` on (warp-uniform), of d = 32·E: every
// head's loads issued before the first is computed (a warp has 1 KB in flight).
template <int E>
__device__ __forceinline__ void hnr_lanes(int first, int lane, bf16* x, int total_heads, const bf16* norm_w,
                                          float eps, int heads_per_row, bf16* x2, int total_heads2,
                                          const bf16* norm_w2, int heads_per_row2, const float* table) {
    constexpr int H = 16 / E;
    auto valid = [&](const HnrPlace& h) { return h.hid < (h.second ? total_heads2 : total_heads); };
    auto at = [&](const HnrPlace& h) { return (h.second ? x2 : x) + (u64)h.hid * (32 * E) + E * lane; };
    Bf16Vec<E> run[H];
    {
        HnrPlace h(first, total_heads, heads_per_row, heads_per_row2);
#pragma unroll
        for (int j = 0; j < H; j++, h.next(total_heads, heads_per_row2))
            if (valid(h)) run[j] = *(const Bf16Vec<E>*)at(h);
    }
    HnrPlace h(first, total_heads, heads_per_row, heads_per_row2);
#pragma unroll
    for (int j = 0; j < H; j++, h.next(total_heads, heads_per_row2)) {
        if (!valid(h)) break;  // the heads past both buffers are the last ones
        float v[E];
#pragma unroll
        for (int i = 0; i < E; i++) v[i] = bf2f(run[j].e[i]);
        head_norm_rope_warp<E>(v, lane, h.second ? norm_w2 : norm_w, eps,
                               table ? table + (u64)h.row * (32 * E) : nullptr);
        Bf16Vec<E> out;  // v holds bf16 values: their top halves
#pragma unroll
        for (int i = 0; i < E; i++) out.e[i] = (bf16)(__float_as_uint(v[i]) >> 16);
        *(Bf16Vec<E>*)at(h) = out;
    }
}

// head_norm_rope for head_dim ∈ {32, 64, 128, 256} with the RoPE table (table != NULL when
// rotating): one warp for 512 / head_dim heads, head_norm_rope_warp (the lightning decode
// kernel's own) on each.
// launch: grid = ceil((total_heads + total_heads2) · head_dim / 4096), block = 256 (4 blocks an
// SM: 32 KB of heads in flight)
extern "C" __global__ void __launch_bounds__(256, 4)
head_norm_rope_lanes(bf16* x, int total_heads, int head_dim, const bf16* norm_w, float eps, int heads_per_row,
                     bf16* x2, int total_heads2, const bf16* norm_w2, int heads_per_row2, const float* table) {
    pdl_start();
    // Through a shuffle, so the compiler knows it warp-uniform (no collective shuffles below).
    const int warp = __shfl_sync(0xffffffffu, (int)(blockIdx.x * 8 + (threadIdx.x >> 5)), 0);
    const int lane = threadIdx.x & 31;
#define HNR_LANES(E) \
    hnr_lanes<E>(warp * (16 / E), lane, x, total_heads, norm_w, eps, heads_per_row, x2, total_heads2, norm_w2, \
                 heads_per_row2, table)
    switch (head_dim) {
        case 32: HNR_LANES(1); break;
        case 64: HNR_LANES(2); break;
        case 128: HNR_LANES(4); break;
        case 256: HNR_LANES(8); break;
    }
#undef HNR_LANES
}

// table[2·(row·half + i)] = cos, [.. + 1] = sin of (first_pos + row)·inv_freq[i], as head_norm_rope
// computes them, for rows < rows and i < half.
// launch: grid = ceil(rows * half / 256), block = 256
extern "C" __global__ void rope_table(const float* inv_freq, int first_pos, int rows, int half, float* table) {
    pdl_start();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * half) return;
    const int row = idx / half, i = idx % half;
    float s, c;
    sincosf((float)(first_pos + row) * inv_freq[i], &s, &c);
    table[2 * idx] = c;
    table[2 * idx + 1] = s;
}

// The RoPE table (cos, sin) of each row's own position: table[2·(r·half + i)] for pos[r].
// launch: grid = ceil(n / 256) for n = rows · half, block = 256
extern "C" __global__ void rope_table_rows(const float* inv_freq, const int* pos, int n_rows, int half,
                                           float* table) {
    pdl_start();
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_rows * half) return;
    const int row = idx / half, i = idx % half;
    float s, c;
    sincosf((float)pos[row] * inv_freq[i], &s, &c);
    table[2 * idx] = c;
    table[2 * idx + 1] = s;
}

// out = round(x / divisor), the lm_head input.
// launch: grid = ceil(n / 256), block = 256
extern "C" __global__ void scale_round(const bf16* x, bf16* out, float divisor, u64 n) {
    pdl_start();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f2bf(bf2f(x[i]) / divisor);
}

// A logit as the host sampler reads it: NaN as -inf, +inf as the largest float.
#define NEG_INF (-__int_as_float(0x7f800000))
__device__ __forceinline__ float sampled_logit(bf16 b) {
    float x = bf2f(b);
    return x != x ? NEG_INF : fminf(x, 3.402823466e38f);
}

// A step run ahead reads its token ids from the greedy picks of the step before (-1, no pick,
// reads token 0; its request fails on the host) and, when `positions` is not NULL, takes each
// row's position one past the step before's (no upload, which from pageable memory would wait
// for the stream).
// launch: grid = ⌈n / 256⌉, block = 256
extern "C" __global__ void __launch_bounds__(256) picked_ids(const int* picks, u32* ids, int* positions, int n) {
    pdl_start();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        ids[i] = (u32)max(picks[i], 0);
        if (positions) positions[i] += 1;
    }
}

// Each row's greedy token: the first index of its maximum, and that token's log-probability
// -log sum exp(x - max); id -1 where no logit is a number. As the host sampler picks it. Two
// launches: greedy_parts, GREEDY_SLICES blocks a row, each a slice's maximum, its first index
// and Σ exp(x - its maximum); then greedy_rows, a warp a row, adds the slices in order.
#define GREEDY_SLICES 32

// part[(row · GREEDY_SLICES + slice) · 3 ..]: the slice's maximum (-inf where it has no
// number), its first index (as an int's bits; INT_MAX where none) and Σ exp(x - maximum).
// launch: grid = (rows, GREEDY_SLICES), block = 256
extern "C" __global__ void __launch_bounds__(256) greedy_parts(const bf16* logits, int vocab, float* part) {
    pdl_start();
    __shared__ float best_of[8];
    __shared__ int at_of[8];
    __shared__ float scratch[32];
    const bf16* row = logits + (u64)blockIdx.x * vocab;
    const int len = (vocab + GREEDY_SLICES - 1) / GREEDY_SLICES;
    const int lo = blockIdx.y * len, hi = min(lo + len, vocab);
    float best = NEG_INF;
    int at = 0x7fffffff;
    // Each thread walks its indices upward, so a strict > keeps its first maximum.
    for (int i = lo + (int)threadIdx.x; i < hi; i += 256) {
        const float x = sampled_logit(row[i]);
        if (x > best) best = x, at = i;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float b = __shfl_xor_sync(0xffffffffu, best, o);
        const int a = __shfl_xor_sync(0xffffffffu, at, o);
        if (b > best || (b == best && a < at)) best = b, at = a;
    }
    if (lane == 0) best_of[warp] = best, at_of[warp] = at;
    __syncthreads();
    best = best_of[0], at = at_of[0];
    for (int w = 1; w < 8; w++)
        if (best_of[w] > best || (best_of[w] == best && at_of[w] < at)) best = best_of[w], at = at_of[w];
    float sum = 0.0f;
    if (best > NEG_INF)
        for (int i = lo + (int)threadIdx.x; i < hi; i += 256) sum += expf(sampled_logit(row[i]) - best);
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        float* out = part + ((u64)blockIdx.x * GREEDY_SLICES + blockIdx.y) * 3;
        out[0] = best;
        out[1] = __int_as_float(at);
        out[2] = sum;
    }
}

// The row's pick from its slices' parts (greedy_parts): the largest maximum, the first index
// among slices that share it, and Σ over slices of sum · exp(maximum − the row's maximum).
// launch: grid = rows, block = 32
extern "C" __global__ void __launch_bounds__(32) greedy_rows(const float* part, int* ids, float* logprobs) {
    pdl_start();
    const int lane = threadIdx.x;
    const float* mine = part + ((u64)blockIdx.x * GREEDY_SLICES + lane) * 3;
    const bool in = lane < GREEDY_SLICES;
    const float b0 = in ? mine[0] : NEG_INF, s0 = in ? mine[2] : 0.0f;
    const int a0 = in ? __float_as_int(mine[1]) : 0x7fffffff;
    float best = b0;
    int at = a0;
    for (int o = 16; o > 0; o >>= 1) {
        const float b = __shfl_xor_sync(0xffffffffu, best, o);
        const int a = __shfl_xor_sync(0xffffffffu, at, o);
        if (b > best || (b == best && a < at)) best = b, at = a;
    }
    float sum = b0 > NEG_INF ? s0 * expf(b0 - best) : 0.0f;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
        const bool any = best > NEG_INF;
        ids[blockIdx.x] = any ? at : -1;
        logprobs[blockIdx.x] = any ? -logf(sum) : 0.0f;
    }
}

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Seeded normal values mean + std·z (Box–Muller on a counter-based hash), |z| kept in
// [0.001, 6] so that no value is zero: out[i] gets value first + i of the seed's sequence.
// launch: grid = ceil(n / 256), block = 256
extern "C" __global__ void fill_random(bf16* out, u64 n, u64 first, u64 seed, float mean, float std) {
    pdl_start();
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 r = splitmix64(seed ^ splitmix64(first + i));
    float u1 = ((r >> 40) + 1.0f) / 16777217.0f;  // (0, 1]
    float u2 = ((r & 0xffffffull) + 0.5f) / 16777216.0f;
    float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    float a = fminf(fmaxf(fabsf(z), 0.001f), 6.0f);
    out[i] = f2bf(mean + std * copysignf(a, z));
}
