// The 1M gather's memory pattern for the standalone measurements (gather-l2.cu, overlap.cu): a
// cache of K and V rows of 2 KV groups x 128 bf16, read a 64-key block of one group at a time.
#pragma once

constexpr int GB_KEYS = 64, GB_D = 128, GB_GROUPS = 2;
// Bytes between two keys' rows (both groups).
constexpr size_t GB_ROW = (size_t)GB_GROUPS * GB_D * 2;

// Reads the 32 KB (K and V) of block b of group g, 16 bytes a lane a load, 4 loads in flight;
// returns their XOR (to keep the loads).
__device__ __forceinline__ unsigned read_block(const char* k, const char* v, int b, int g) {
    unsigned acc = 0;
    const char* kb = k + (size_t)b * GB_KEYS * GB_ROW + g * GB_D * 2;
    const char* vb = v + (size_t)b * GB_KEYS * GB_ROW + g * GB_D * 2;
    const int lane = threadIdx.x & 31;
    // 64 rows x 256 bytes = 1,024 uint4 for each of K and V: 32 a lane of each.
#pragma unroll 4
    for (int i = 0; i < 32; i++) {
        const int u = i * 32 + lane, row = u >> 4, col = u & 15;
        uint4 a = __ldg((const uint4*)(kb + row * GB_ROW) + col);
        uint4 c = __ldg((const uint4*)(vb + row * GB_ROW) + col);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ c.x ^ c.y ^ c.z ^ c.w;
    }
    return acc;
}
