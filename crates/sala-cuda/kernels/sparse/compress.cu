// Key compression of the sparse layers (layouts in sparse/common.cuh).

#include "common/types.cuh"

// out[w, f] = bf16( (Σ_{u<window} keys[stride·w + u, f]) / window ), fp32 sum in token order
// (exactly `SparseCache::append`), for w in [first_window, first_window + n_windows).
// launch: grid = ((n_windows * kv_width + 255) / 256), block = 256, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(256)
compress_keys(const bf16* keys, bf16* out, int first_window, int n_windows, int kv_width, int window,
              int stride) {
    pdl_start();
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n_windows * kv_width) return;
    const int w = first_window + (int)(idx / kv_width);
    const int f = (int)(idx % kv_width);
    const bf16* src = keys + (size_t)stride * w * kv_width + f;
    float sum = 0.0f;
    for (int u = 0; u < window; u++) sum = __fadd_rn(sum, bf2f(src[(size_t)u * kv_width]));
    out[(size_t)w * kv_width + f] = f2bf(__fdiv_rn(sum, (float)window));
}
