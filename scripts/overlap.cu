// Can a prefill hide its memory-bound kernels under its products? (issue 17: 128K in 4 s needs
// ~0.5 s of the gather's and the element-wise passes' ~1.3 s to vanish.) If the model ran two
// prompt chunks a layer apart on two streams (chunk c + 1's layer L beside chunk c's layer
// L + 1), a product of one would run beside the other's memory-bound kernels. This times, on
// one GPU, each pair alone and both at once on two streams (the memory one at high priority
// or not), 8,192 rows as the prefill's chunks:
//   gemm:    cuBLASLt's bf16 [gate; up] product, 8192 x 4096 by 32768 x 4096 (its first pick);
//   stream:  a SiLU-and-multiply's traffic: 512 MB read, 256 MB written;
//   gather:  the 1M gather's random 32 KB blocks (gather-l2.cu's free walk: 8.3 GB here, a
//            quarter of a 1M chunk's).
// (The SiLU reads the product's output while it is written: the values do not matter here.)
// Prints ms alone, together, and the share of the shorter one hidden. Build and run on the GPU:
//   nvcc -arch=sm_90a -O2 -o /tmp/overlap scripts/overlap.cu -lcublasLt && /tmp/overlap
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda-check.cuh"
#include "gather-block.cuh"
#include "lt-bf16.cuh"

constexpr int ROWS = 8192, INNER = 4096, OUT = 32768;

// 512 MB read (two halves of a row), 256 MB written: silu(g) * u in bf16.
__global__ void silu_stream(const uint4* gu, uint4* act, size_t rows, size_t half16) {
    const size_t n = rows * half16;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / half16, c = i - r * half16;
        uint4 g = gu[r * 2 * half16 + c], u = gu[r * 2 * half16 + half16 + c];
        const __nv_bfloat162* gp = (const __nv_bfloat162*)&g;
        const __nv_bfloat162* up = (const __nv_bfloat162*)&u;
        uint4 o;
        __nv_bfloat162* op = (__nv_bfloat162*)&o;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float2 a = __bfloat1622float2(gp[k]), b = __bfloat1622float2(up[k]);
            a.x = a.x / (1.0f + __expf(-a.x)) * b.x;
            a.y = a.y / (1.0f + __expf(-a.y)) * b.y;
            op[k] = __float22bfloat162_rn(a);
        }
        act[i] = o;
    }
}

// Random 32 KB blocks (K and V of 64 keys of one group) from a 1 GiB cache, a warp a list of
// `picks` ascending block ids.
__global__ void __launch_bounds__(128) gather(const char* k, const char* v, const int* lists, int picks,
                                              unsigned* sink) {
    const int warp = threadIdx.x >> 5;
    const int g = blockIdx.x & 1, list = (blockIdx.x >> 1) * 4 + warp;
    const int* my = lists + (size_t)list * picks;
    unsigned acc = 0;
    for (int j = 0; j < picks; j++) acc ^= read_block(k, v, my[j], g);
    if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.1f);
    }
}

int main() {
    // The product's operands.
    __nv_bfloat16 *x, *w, *y;
    CHECK(cudaMalloc(&x, (size_t)ROWS * INNER * 2));
    CHECK(cudaMalloc(&w, (size_t)OUT * INNER * 2));
    CHECK(cudaMalloc(&y, (size_t)ROWS * OUT * 2));
    fill<<<1024, 256>>>(x, (size_t)ROWS * INNER, 1);
    fill<<<1024, 256>>>(w, (size_t)OUT * INNER, 2);
    void* ws;
    const size_t ws_bytes = 32 << 20;
    CHECK(cudaMalloc(&ws, ws_bytes));
    cublasLtHandle_t lt;
    CK(cublasLtCreate(&lt));
    const LtBf16 plan = lt_bf16(ROWS, OUT, INNER, ws_bytes);
    const auto desc = plan.desc;
    const auto a = plan.a, b = plan.b, c = plan.c;
    const auto pref = plan.pref;
    cublasLtMatmulHeuristicResult_t res;
    int n = 0;
    CK(cublasLtMatmulAlgoGetHeuristic(lt, desc, a, b, c, c, pref, 1, &res, &n));
    // The memory-bound kernels' buffers: the SiLU's (the product's output is its input) and the
    // gather's cache and lists (2,048 lists of 62 blocks, each read for both groups).
    __nv_bfloat16* act;
    CHECK(cudaMalloc(&act, (size_t)ROWS * 16384 * 2));
    const size_t cache = (size_t)16384 * 64 * 512;
    char *kc, *vc;
    CHECK(cudaMalloc(&kc, cache));
    CHECK(cudaMalloc(&vc, cache));
    CHECK(cudaMemset(kc, 1, cache));
    CHECK(cudaMemset(vc, 2, cache));
    const int lists_n = 2048, picks = 62;
    std::vector<int> lists((size_t)lists_n * picks);
    srand(7);
    for (int l = 0; l < lists_n; l++) {
        int* my = &lists[(size_t)l * picks];
        for (int j = 0; j < picks; j++) my[j] = rand() % 16383 + 1;
        std::sort(my, my + picks);
    }
    int* dl;
    unsigned* sink;
    CHECK(cudaMalloc(&dl, lists.size() * 4));
    CHECK(cudaMemcpy(dl, lists.data(), lists.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&sink, 4));
    int lo, hi;
    CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t s_gemm, s_mem, s_mem_hi;
    CHECK(cudaStreamCreateWithFlags(&s_gemm, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s_mem, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithPriority(&s_mem_hi, cudaStreamNonBlocking, hi));
    auto gemm = [&](cudaStream_t s) {
        const float alpha = 1.0f, beta = 0.0f;
        CK(cublasLtMatmul(lt, desc, &alpha, w, a, x, b, &beta, y, c, y, c, &res.algo, ws, ws_bytes, s));
    };
    auto stream = [&](cudaStream_t s) {
        silu_stream<<<132 * 8, 256, 0, s>>>((const uint4*)y, (uint4*)act, ROWS, 16384 / 8);
    };
    auto gath = [&](cudaStream_t s) { gather<<<lists_n / 4 * 2, 128, 0, s>>>(kc, vc, dl, picks, sink); };
    cudaEvent_t e0, e1, done_gemm, done_mem;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventCreate(&done_gemm));
    CHECK(cudaEventCreate(&done_mem));
    // Median ms of 9 runs of f, timed on s_gemm: f launches on the streams and joins them back.
    auto timed = [&](auto&& f) {
        std::vector<float> ms;
        for (int r = 0; r < 9; r++) {
            CHECK(cudaDeviceSynchronize());
            CHECK(cudaEventRecord(e0, s_gemm));
            f();
            CHECK(cudaEventRecord(e1, s_gemm));
            CHECK(cudaEventSynchronize(e1));
            float m;
            CHECK(cudaEventElapsedTime(&m, e0, e1));
            ms.push_back(m);
        }
        std::sort(ms.begin(), ms.end());
        return ms[ms.size() / 2];
    };
    for (int which = 0; which < 2; which++) {
        const char* name = which == 0 ? "stream" : "gather";
        const int count = which == 0 ? 2 : 1;  // launches of it beside one product
        auto mem = [&](cudaStream_t s) {
            for (int i = 0; i < count; i++) {
                if (which == 0) stream(s);
                else gath(s);
            }
        };
        const float g = timed([&] { gemm(s_gemm); });
        const float m = timed([&] { mem(s_gemm); });
        for (cudaStream_t s : {s_mem, s_mem_hi}) {
            const float both = timed([&] {
                CHECK(cudaEventRecord(done_gemm, s_gemm));
                CHECK(cudaStreamWaitEvent(s, done_gemm));  // both start after e0
                mem(s);
                gemm(s_gemm);
                CHECK(cudaEventRecord(done_mem, s));
                CHECK(cudaStreamWaitEvent(s_gemm, done_mem));
            });
            printf("gemm %.3f ms, %s x%d %.3f ms, together (%s) %.3f ms: %.0f%% of the shorter hidden\n", g, name,
                   count, m, s == s_mem ? "same priority" : "memory first", both,
                   100.0 * (g + m - both) / std::min(g, m));
        }
    }
    CHECK(cudaGetLastError());
    return 0;
}
