// Key compression of the sparse layers, and the FP8 cache's stores (layouts in
// sparse/common.cuh).

#include "common/types.cuh"
#include "sparse/common.cuh"
#include "common/rows.cuh"

// out[w, f] = bf16( (Σ_{u<window} key(stride·w + u, f)) / window ), fp32 sum in token order
// (exactly `SparseCache::append`).
template <class Key>
__device__ __forceinline__ void compress_one(Key key, bf16* out, int w, int f, int kv_width, int window,
                                             int stride) {
    float sum = 0.0f;
    for (int u = 0; u < window; u++) sum = __fadd_rn(sum, key((size_t)stride * w + u, f));
    out[(size_t)w * kv_width + f] = f2bf(__fdiv_rn(sum, (float)window));
}

// compress_one for w in [first_window, first_window + n_windows), a thread an output.
template <class Key>
__device__ __forceinline__ void compress_body(Key key, bf16* out, int first_window, int n_windows, int kv_width,
                                              int window, int stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_windows * kv_width) return;
    compress_one(key, out, first_window + (int)(idx / kv_width), (int)(idx % kv_width), kv_width, window, stride);
}

// The FP8 row layout's key f of token t: its code times its KV head's scale.
__device__ __forceinline__ float f8_key(const unsigned char* keys, size_t t, int f, int kv_width, int d,
                                        size_t row_bytes) {
    const unsigned char* r = keys + t * row_bytes;
    return e4m3_value(r[f]) * *(const float*)(r + kv_width + 4 * (f / d));
}

// One (row, KV head) of k or v (`src`: its d values) stored as FP8 codes at `dst_row`, with its
// scale amax / 448 (1 for zeros); a warp's work (`sala_model::numerics::fp8_round_kv`).
__device__ __forceinline__ void store_f8_head(const bf16* src, unsigned char* dst_row, int g, int kv_heads, int d,
                                              int lane) {
    float amax = 0.0f;
    for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(bf2f(src[i])));
    const float scale = f8_scale(warp_max(amax)), inv = __fdiv_rn(1.0f, scale);
    for (int i = lane; i < d; i += 32) dst_row[(size_t)g * d + i] = (unsigned char)e4m3_code(bf2f(src[i]) * inv);
    if (lane == 0) *(float*)(dst_row + (size_t)kv_heads * d + 4 * g) = scale;
}

// launch: grid = ((n_windows * kv_width + 255) / 256), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
compress_keys(const bf16* keys, bf16* out, int first_window, int n_windows, int kv_width, int window,
              int stride) {
    pdl_start();
    compress_body([&](size_t t, int f) { return bf2f(keys[t * kv_width + f]); }, out, first_window, n_windows,
                  kv_width, window, stride);
}

// The same over an FP8 cache of rows f8_row_bytes(kv_heads, d): each key as code · scale.
// launch: grid = ((n_windows * kv_heads * d + 255) / 256), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
compress_keys_f8(const unsigned char* keys, bf16* out, int first_window, int n_windows, int kv_heads, int d,
                 int window, int stride) {
    pdl_start();
    const int kv_width = kv_heads * d;
    const size_t row = f8_row_bytes(kv_heads, d);
    compress_body([&](size_t t, int f) { return f8_key(keys, t, f, kv_width, d, row); }, out, first_window,
                  n_windows, kv_width, window, stride);
}

// Stores `rows` rows of k and v (bf16, [rows, kv_heads·d]) as FP8 rows first.. of kc and vc:
// one warp a (row, KV head, K or V) scales by amax / 448 (1 for zeros) and writes the codes
// (`sala_model::numerics::fp8_round_kv` bit for bit).
// launch: grid = (⌈rows · kv_heads · 2 / 4⌉), block = 128, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(128)
kv_store_f8(const bf16* k, const bf16* v, unsigned char* kc, unsigned char* vc, int rows, int kv_heads, int d,
            int first) {
    pdl_start();
    const int w = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= rows * kv_heads * 2) return;  // warp-uniform
    const int r = w / (2 * kv_heads), g = (w / 2) % kv_heads, is_v = w & 1;
    const bf16* src = (is_v ? v : k) + (size_t)r * kv_heads * d + (size_t)g * d;
    unsigned char* dst = (is_v ? vc : kc) + (size_t)(first + r) * f8_row_bytes(kv_heads, d);
    store_f8_head(src, dst, g, kv_heads, d, lane);
}

// A decode step's rows appended to their caches, one sequence a block: row r of k and v (bf16,
// [rows, kv_heads·d]) stored at row rows.pos[r] of rows.k[r] and rows.v[r] (FP8 rows when F8),
// then the level-1 and level-2 compressed keys of the windows the row completes (the tiers
// hold rows.n1[r] and rows.n2[r] before), each as compress_one computes it: `append_kv` for
// one row, every sequence in one launch. `rows` carries write addresses here.
template <bool F8>
__device__ __forceinline__ void append_rows_body(const bf16* k, const bf16* v, const SeqRows& rows, int kv_heads,
                                                 int d, int k1_window, int k1_stride, int k2_window,
                                                 int k2_stride) {
    const int r = blockIdx.x, kv_width = kv_heads * d, pos = rows.pos[r];
    unsigned char* kc = (unsigned char*)rows.k[r];
    unsigned char* vc = (unsigned char*)rows.v[r];
    const size_t row_bytes = F8 ? (size_t)f8_row_bytes(kv_heads, d) : (size_t)kv_width * 2;
    if (F8) {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        for (int w = warp; w < 2 * kv_heads; w += blockDim.x >> 5) {  // warp-uniform
            const int g = w >> 1, is_v = w & 1;
            const bf16* src = (is_v ? v : k) + (size_t)r * kv_width + (size_t)g * d;
            store_f8_head(src, (is_v ? vc : kc) + (size_t)pos * row_bytes, g, kv_heads, d, lane);
        }
    } else {
        bf16* kd = (bf16*)(kc + (size_t)pos * row_bytes);
        bf16* vd = (bf16*)(vc + (size_t)pos * row_bytes);
        for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
            kd[i] = k[(size_t)r * kv_width + i];
            vd[i] = v[(size_t)r * kv_width + i];
        }
    }
    __syncthreads();  // the new row, read back by the windows it completes
    for (int level = 1; level <= 2; level++) {
        const int window = level == 1 ? k1_window : k2_window, stride = level == 1 ? k1_stride : k2_stride;
        const int old = level == 1 ? rows.n1[r] : rows.n2[r];
        const int fresh = sp_visible(pos, window, stride) - old;
        bf16* out = (bf16*)(level == 1 ? rows.k1[r] : rows.k2[r]);
        for (int i = threadIdx.x; i < fresh * kv_width; i += blockDim.x) {
            const int w = old + i / kv_width, f = i % kv_width;
            if (F8) {
                compress_one([&](size_t t, int f) { return f8_key(kc, t, f, kv_width, d, row_bytes); }, out, w, f,
                             kv_width, window, stride);
            } else {
                compress_one([&](size_t t, int f) { return bf2f(((const bf16*)kc)[t * kv_width + f]); }, out, w,
                             f, kv_width, window, stride);
            }
        }
    }
}

// launch: grid = (rows), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
append_kv_rows(const bf16* k, const bf16* v, SeqRows rows, int kv_heads, int d, int k1_window, int k1_stride,
               int k2_window, int k2_stride) {
    pdl_start();
    append_rows_body<false>(k, v, rows, kv_heads, d, k1_window, k1_stride, k2_window, k2_stride);
}

// launch: grid = (rows), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
append_kv_rows_f8(const bf16* k, const bf16* v, SeqRows rows, int kv_heads, int d, int k1_window, int k1_stride,
                  int k2_window, int k2_stride) {
    pdl_start();
    append_rows_body<true>(k, v, rows, kv_heads, d, k1_window, k1_stride, k2_window, k2_stride);
}
