// Key compression of the sparse layers, and the FP8 cache's stores (layouts in
// sparse/common.cuh).

#include "common/types.cuh"
#include "sparse/common.cuh"

// out[w, f] = bf16( (Σ_{u<window} key(stride·w + u, f)) / window ), fp32 sum in token order
// (exactly `SparseCache::append`), for w in [first_window, first_window + n_windows).
template <class Key>
__device__ __forceinline__ void compress_body(Key key, bf16* out, int first_window, int n_windows, int kv_width,
                                              int window, int stride) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_windows * kv_width) return;
    const int w = first_window + (int)(idx / kv_width);
    const int f = (int)(idx % kv_width);
    float sum = 0.0f;
    for (int u = 0; u < window; u++) sum = __fadd_rn(sum, key((size_t)stride * w + u, f));
    out[(size_t)w * kv_width + f] = f2bf(__fdiv_rn(sum, (float)window));
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
    compress_body(
        [&](size_t t, int f) {
            const unsigned char* r = keys + t * row;
            return e4m3_value(r[f]) * *(const float*)(r + kv_width + 4 * (f / d));
        },
        out, first_window, n_windows, kv_width, window, stride);
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
    float amax = 0.0f;
    for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(bf2f(src[i])));
    const float scale = f8_scale(warp_max(amax)), inv = __fdiv_rn(1.0f, scale);
    for (int i = lane; i < d; i += 32) dst[(size_t)g * d + i] = (unsigned char)e4m3_code(bf2f(src[i]) * inv);
    if (lane == 0) *(float*)(dst + (size_t)kv_heads * d + 4 * g) = scale;
}
