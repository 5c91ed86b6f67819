// How far is cuBLASLt's first heuristic pick from the fastest of its candidates, for the
// prefill products of the released shape? (issue 17, point 4: GEMMs at >= 85% of the ceiling.)
// Each product as sala-cuda's gemm.rs asks for it: row-major Y[rows, out] = X[rows, inner] ·
// W[out, inner]ᵀ, bf16 in and out, fp32 accumulation, 32 MiB of workspace. For each shape it
// times up to 16 heuristic candidates (median of 15 runs after 3) on random data and prints
// their TFLOP/s in the heuristic's order.
// Build and run on the GPU: nvcc -O2 -o /tmp/gemm-algos scripts/gemm-algos.cu -lcublasLt && /tmp/gemm-algos
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lt-bf16.cuh"

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
    }
}

int main(int argc, char** argv) {
    const int rows = argc > 1 ? atoi(argv[1]) : 8192;
    // (out, inner): [gate; up], down, q/k/v/z/o, the four lightning projections in one, q/k/v
    // of a sparse layer in one, k or v of a sparse layer.
    const int shapes[][2] = {{32768, 4096}, {4096, 16384}, {4096, 4096}, {16384, 4096}, {4608, 4096}, {256, 4096}};
    const size_t max_x = (size_t)rows * 16384, max_w = (size_t)32768 * 4096, max_y = (size_t)rows * 32768;
    __nv_bfloat16 *x, *w, *y;
    void* ws;
    const size_t ws_bytes = 32 << 20;
    CK(cudaMalloc(&x, max_x * 2));
    CK(cudaMalloc(&w, max_w * 2));
    CK(cudaMalloc(&y, max_y * 2));
    CK(cudaMalloc(&ws, ws_bytes));
    fill<<<1024, 256>>>(x, max_x, 1);
    fill<<<1024, 256>>>(w, max_w, 2);
    CK(cudaDeviceSynchronize());
    cublasLtHandle_t lt;
    CK(cublasLtCreate(&lt));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (auto& s : shapes) {
        const int out = s[0], inner = s[1];
        LtBf16 p = lt_bf16(rows, out, inner, ws_bytes);
        const auto desc = p.desc;
        const auto a = p.a, b = p.b, c = p.c;
        const auto pref = p.pref;
        cublasLtMatmulHeuristicResult_t res[16];
        int n = 0;
        CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 16, res, &n));
        const double flop = 2.0 * rows * out * inner;
        printf("rows %d, out %d, inner %d: %d candidates, TFLOP/s in heuristic order:", rows, out, inner, n);
        double first = 0, best = 0;
        int best_i = -1;
        for (int i = 0; i < n; i++) {
            const float alpha = 1.0f, beta = 0.0f;
            auto go = [&] {
                return cublasLtMatmul(lt, desc, &alpha, w, a, x, b, &beta, y, c, y, c, &res[i].algo, ws, ws_bytes, 0);
            };
            if (go() != CUBLAS_STATUS_SUCCESS) {
                printf(" [%d] fails", i);
                continue;
            }
            go(), go();
            std::vector<float> ms;
            for (int r = 0; r < 15; r++) {
                cudaEventRecord(e0);
                go();
                cudaEventRecord(e1);
                cudaEventSynchronize(e1);
                float m;
                cudaEventElapsedTime(&m, e0, e1);
                ms.push_back(m);
            }
            std::sort(ms.begin(), ms.end());
            const double tf = flop / (ms[7] * 1e-3) / 1e12;
            int tile = -1, stages = -1, splitk = -1;
            size_t got;
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &got);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages,
                                                 &got);
            cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk,
                                                 &got);
            printf(" [%d] %.0f (tile %d, stages %d, split %d)", i, tf, tile, stages, splitk);
            if (i == 0) first = tf;
            if (tf > best) best = tf, best_i = i;
        }
        printf("\n  first %.0f, best %.0f at [%d]: %+.1f%%\n", first, best, best_i, 100.0 * (best / first - 1.0));
        CK(cudaGetLastError());
        lt_bf16_destroy(p);
    }
    return 0;
}
