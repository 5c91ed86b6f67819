// What a kernel boundary costs inside a replayed CUDA graph, with and without programmatic
// dependent launch (PDL): the decode steps' ~130 small launches between products (norms,
// quantizing, gates) are worth fusing only if a boundary costs more than their work. Prints
// microseconds a launch for graphs of 200 launches:
//   tiny G:   a kernel of G blocks that adds 1 to 4,096 floats (a norm's size), back to back;
//   stream:   a kernel that reads 64 MB (a product's size; the memory's time alone);
//   stream+tiny: the two in turn, less the stream alone: what a small kernel between two
//             products costs the step.
// Build and run on the GPU machine: nvcc -arch=sm_90a -O2 -o /tmp/pdl-gaps scripts/pdl-gaps.cu
// && /tmp/pdl-gaps
#include <cstdio>
#include <cstdlib>

#include "cuda-check.cuh"

__device__ __forceinline__ void pdl_start() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__global__ void tiny(float* p, int n) {
    pdl_start();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] += 1.0f;
}

// Reads n uint4 (a grid-stride sum), writes one float a block so the reads are not dropped.
__global__ void stream(const uint4* src, size_t n, float* out) {
    pdl_start();
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = (float)acc;
}

struct Setup {
    float* small;
    uint4* big;
    size_t big_n;
    float* sink;
    int sms;
};

static void launch(cudaStream_t s, bool pdl, int which, int blocks, const Setup& su) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    cfg.stream = s;
    cfg.blockDim = dim3(256);
    if (which == 0) {
        cfg.gridDim = dim3(blocks);
        CHECK(cudaLaunchKernelEx(&cfg, tiny, su.small, 4096));
    } else {
        cfg.gridDim = dim3(su.sms * 8);
        CHECK(cudaLaunchKernelEx(&cfg, stream, (const uint4*)su.big, su.big_n, su.sink));
    }
}

// Microseconds a replay of a graph of `count` launches (kinds[i % kinds_n]) takes, best of 20.
static float replay_us(bool pdl, const int* kinds, int kinds_n, int count, int blocks, const Setup& su) {
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < count; i++) launch(s, pdl, kinds[i % kinds_n], blocks, su);
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    float best = 1e30f;
    for (int r = 0; r < 23; r++) {
        CHECK(cudaEventRecord(a, s));
        CHECK(cudaGraphLaunch(ge, s));
        CHECK(cudaEventRecord(b, s));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 3 && ms < best) best = ms;
    }
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    CHECK(cudaStreamDestroy(s));
    return best * 1000.0f;
}

int main() {
    Setup su;
    CHECK(cudaDeviceGetAttribute(&su.sms, cudaDevAttrMultiProcessorCount, 0));
    su.big_n = (64u << 20) / 16;
    CHECK(cudaMalloc(&su.small, 4096 * 4));
    CHECK(cudaMalloc(&su.big, su.big_n * 16));
    CHECK(cudaMalloc(&su.sink, 65536 * 4));
    CHECK(cudaMemset(su.small, 0, 4096 * 4));
    CHECK(cudaMemset(su.big, 1, su.big_n * 16));
    const int n = 200, tiny_k[1] = {0}, stream_k[1] = {1}, both[2] = {1, 0};
    for (int pdl = 0; pdl < 2; pdl++) {
        printf("PDL %s\n", pdl ? "on" : "off");
        for (int blocks : {1, 16, su.sms, 4 * su.sms})
            printf("  tiny %4d blocks: %6.2f us a launch\n", blocks, replay_us(pdl, tiny_k, 1, n, blocks, su) / n);
        const float st = replay_us(pdl, stream_k, 1, n / 2, 16, su) / (n / 2);
        printf("  stream 64 MB: %6.2f us a launch (%.2f TB/s)\n", st, 64.0 * (1 << 20) / (st * 1e-6) / 1e12);
        for (int blocks : {16, su.sms}) {
            const float pair = replay_us(pdl, both, 2, n, blocks, su) / (n / 2);
            printf("  stream + tiny %d blocks: %6.2f us a pair, the tiny one %.2f us\n", blocks, pair, pair - st);
        }
    }
    return 0;
}
