// Can the 1M prefill's sparse gather read its random blocks from L2 instead of DRAM? The
// gather of one sparse layer's chunk (8,192 queries x 2 KV groups, each 62 random 64-key blocks
// of K and V besides its forced ones: 33 GB of reads over a 1 GiB cache that L2 cannot hold) as
// bare loads, one warp a (query, group), 4 warps a block, each list ascending:
//   free:    as attention_gather walks today (each warp at its own pace);
//   paced L: the blocks resident together (a wave) walk the cache together: a warp enters the
//            cache's 1/64th k only once every warp of its wave has left k - L (global counters);
//   ranges R: R launches, launch r reading only the blocks in the cache's r-th 1/R (every list's
//            walk in step; what a range-major gather would read, less its partial outputs).
// Prints ms and TB/s of the 33 GB for each. Build and run on the GPU machine:
//   nvcc -arch=sm_90a -O2 -o /tmp/gather-l2 scripts/gather-l2.cu && /tmp/gather-l2
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#include "cuda-check.cuh"
#include "gather-block.cuh"

constexpr int QUERIES = 8192, GROUPS = GB_GROUPS, PICKS = 62, BLOCKS = 16384, KEYS = GB_KEYS, D = GB_D;
constexpr int WARPS = 4, BUCKETS = 64;
constexpr size_t ROW = GB_ROW;

struct Pace {
    unsigned* ticket;  // blocks started
    unsigned* passed;  // [wave][bucket]: warps of the wave past the bucket
    int wave_blocks;   // blocks resident at once
    int lag;           // 0: no pacing
    unsigned total_blocks;
};

__global__ void __launch_bounds__(WARPS * 32) gather(const char* k, const char* v, const int* lists, unsigned* sink,
                                                     int lo, int hi, Pace pace) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ unsigned wave_s;
    if (pace.lag > 0) {
        if (threadIdx.x == 0) wave_s = atomicAdd(pace.ticket, 1) / pace.wave_blocks;
        __syncthreads();
    }
    const unsigned wave = wave_s;
    const unsigned waves = (pace.total_blocks + pace.wave_blocks - 1) / pace.wave_blocks;
    const unsigned in_wave =
        pace.lag > 0 ? min((unsigned)pace.wave_blocks, pace.total_blocks - wave * pace.wave_blocks) * WARPS : 0;
    const int g = blockIdx.x % GROUPS, q = (blockIdx.x / GROUPS) * WARPS + warp;
    const int* my = lists + ((size_t)q * GROUPS + g) * PICKS;
    unsigned acc = 0;
    int bucket = 0;  // the first bucket this warp has not left
    for (int j = 0; j < PICKS; j++) {
        const int b = my[j];
        if (b < lo || b >= hi) continue;
        if (pace.lag > 0) {
            const int kb = (int)((long)b * BUCKETS / BLOCKS);
            if (kb > bucket) {
                __syncwarp();
                if (lane == 0) {
                    for (int x = bucket; x < kb; x++) atomicAdd(&pace.passed[wave * BUCKETS + x], 1);
                    const int need = kb - pace.lag;
                    if (need >= 0 && wave < waves) {
                        volatile unsigned* c = &pace.passed[wave * BUCKETS + need];
                        for (int spin = 0; *c < in_wave && spin < 200000; spin++) __nanosleep(256);
                    }
                }
                __syncwarp();
                bucket = kb;
            }
        }
        acc ^= read_block(k, v, b, g);
    }
    if (pace.lag > 0 && lane == 0)
        for (int x = bucket; x < BUCKETS; x++) atomicAdd(&pace.passed[wave * BUCKETS + x], 1);
    if (acc == 0x12345678u) sink[0] = acc;  // never, in practice: keeps the loads
}

int main() {
    const size_t half = (size_t)BLOCKS * KEYS * ROW;  // K (or V) of both groups: 512 MiB
    char *k, *v;
    CHECK(cudaMalloc(&k, half));
    CHECK(cudaMalloc(&v, half));
    CHECK(cudaMemset(k, 1, half));
    CHECK(cudaMemset(v, 2, half));
    std::vector<int> lists((size_t)QUERIES * GROUPS * PICKS);
    srand(7);
    std::vector<char> used(BLOCKS);
    for (size_t l = 0; l < (size_t)QUERIES * GROUPS; l++) {
        std::fill(used.begin(), used.end(), 0);
        int* my = &lists[l * PICKS];
        for (int j = 0; j < PICKS; j++) {
            int b;
            do b = rand() % (BLOCKS - 34) + 1;
            while (used[b]);
            used[b] = 1;
            my[j] = b;
        }
        std::sort(my, my + PICKS);
    }
    int* dl;
    unsigned *sink, *counters;
    CHECK(cudaMalloc(&dl, lists.size() * 4));
    CHECK(cudaMemcpy(dl, lists.data(), lists.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&sink, 4));
    const int grid = QUERIES / WARPS * GROUPS;
    const size_t counter_words = 1 + (size_t)(grid + 1) * BUCKETS;
    CHECK(cudaMalloc(&counters, counter_words * 4));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaFuncSetAttribute(gather, cudaFuncAttributeMaxDynamicSharedMemorySize, 110 << 10));
    const double bytes = (double)QUERIES * GROUPS * PICKS * KEYS * D * 2 * 2;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    // smem: dynamic shared memory a block holds (unused), to hold residency where the real
    // gather's is (2 blocks an SM with its rings).
    auto run = [&](const char* name, int lag, int ranges, int smem) {
        int resident = 0;
        CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, gather, WARPS * 32, smem));
        float best = 1e30f;
        for (int rep = 0; rep < 5; rep++) {
            CHECK(cudaMemset(counters, 0, counter_words * 4));
            Pace p{counters, counters + 1, resident * sms, lag, (unsigned)grid};
            CHECK(cudaEventRecord(e0));
            for (int r = 0; r < ranges; r++) {
                const int lo = (int)((long)BLOCKS * r / ranges), hi = (int)((long)BLOCKS * (r + 1) / ranges);
                gather<<<grid, WARPS * 32, smem>>>(k, v, dl, sink, lo, hi, p);
            }
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            CHECK(cudaGetLastError());
            float ms;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            best = std::min(best, ms);
        }
        printf("%-14s %2d blocks/SM %8.3f ms  %6.2f TB/s\n", name, resident, best, bytes / best / 1e9);
    };
    char name[64];
    for (int smem : {0, 100 << 10}) {
        run("free", 0, 1, smem);
        for (int lag : {1, 2, 4, 8}) {
            snprintf(name, sizeof name, "paced %d", lag);
            run(name, lag, 1, smem);
        }
        for (int ranges : {4, 8, 16, 32, 64}) {
            snprintf(name, sizeof name, "ranges %d", ranges);
            run(name, 0, ranges, smem);
        }
    }
    return 0;
}
