// Do Hopper's warpgroup MMA (wgmma) and mma.sync give the same bits for the same chain of k-steps?
// And does the order of k within one step change them? (A 17-64-row decode product on wgmma
// keeps the 1-row product's bits only if both hold.) D = A·Bᵀ for A [64, K] and B [N, K]: one
// chain of k-steps from k = 0, by mma.sync (m16n8k16 bf16, m16n8k32 e4m3), by wgmma with A from
// registers (the same fragments), by wgmma with A from shared memory, and by mma.sync with the k
// of each step permuted (the same sets of k). Prints the count of outputs whose bits differ.
// Build and run on the GPU machine:
//   nvcc -std=c++17 -arch=sm_90a -O2 -o /tmp/mma-bits scripts/mma-bits.cu && /tmp/mma-bits
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cuda_bf16.h>
#include <vector>

typedef uint32_t u32;
typedef uint64_t u64;
#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e = (x);                                                                    \
        if (e != cudaSuccess) {                                                                 \
            printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);                  \
            return 1;                                                                           \
        }                                                                                       \
    } while (0)

constexpr int M = 64, N = 64, K = 1024;

// Element i of a step's k (0..15 bf16, 0..31 e4m3) under permutation `perm` (0: none, 1:
// reversed, 2: halves swapped).
__device__ __forceinline__ int kperm(int i, int step, int perm) {
    if (perm == 1) return step - 1 - i;
    if (perm == 2) return (i + step / 2) % step;
    return i;
}

// Two consecutive-k elements of a row (bf16: 2 a u32; e4m3: 4) as one operand register.
template <bool F8>
__device__ __forceinline__ u32 frag(const void* row, int k0, int step, int perm, int s) {
    if (F8) {
        const uint8_t* r = (const uint8_t*)row;
        u32 v = 0;
        for (int e = 0; e < 4; e++) v |= (u32)r[s * step + kperm(k0 + e, step, perm)] << (8 * e);
        return v;
    }
    const uint16_t* r = (const uint16_t*)row;
    return (u32)r[s * step + kperm(k0, step, perm)] | ((u32)r[s * step + kperm(k0 + 1, step, perm)] << 16);
}

// The A fragment of warp w's 16 rows at step s (the layout mma.sync and wgmma's register A share).
template <bool F8>
__device__ __forceinline__ void a_frag(const void* a, int s, int perm, u32 (&r)[4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int esz = F8 ? 1 : 2, step = F8 ? 32 : 16, per = F8 ? 4 : 2;
    const char* r0 = (const char*)a + (size_t)(16 * w + g) * K * esz;
    const char* r1 = r0 + (size_t)8 * K * esz;
    r[0] = frag<F8>(r0, per * t, step, perm, s);
    r[1] = frag<F8>(r1, per * t, step, perm, s);
    r[2] = frag<F8>(r0, per * t + step / 2, step, perm, s);
    r[3] = frag<F8>(r1, per * t + step / 2, step, perm, s);
}

template <bool F8>
__device__ __forceinline__ void mma_sync(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (F8)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Output (row, col) of accumulator i of n-tile j, for this thread (mma.sync's and wgmma's layout).
__device__ __forceinline__ void store(float* d, int j, int i, float v) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row = 16 * w + g + (i >= 2 ? 8 : 0), col = 8 * j + 2 * t + (i & 1);
    d[row * N + col] = v;
}

template <bool F8>
__global__ void by_mma_sync(const void* a, const void* b, float* d, int perm) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int esz = F8 ? 1 : 2, step = F8 ? 32 : 16, per = F8 ? 4 : 2;
    float c[N / 8][4] = {};
    for (int s = 0; s < K / step; s++) {
        u32 af[4];
        a_frag<F8>(a, s, perm, af);
        for (int j = 0; j < N / 8; j++) {
            const char* br = (const char*)b + (size_t)(8 * j + g) * K * esz;
            mma_sync<F8>(c[j], af, frag<F8>(br, per * t, step, perm, s), frag<F8>(br, per * t + step / 2, step, perm, s));
        }
    }
    for (int j = 0; j < N / 8; j++)
        for (int i = 0; i < 4; i++) store(d, j, i, c[j][i]);
}

// K-major operand descriptor, 128-byte swizzle (8-row groups 1024 bytes apart).
__device__ __forceinline__ u64 desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)64 << 32) | ((u64)1 << 62);
}

#define D32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define D32_ARGS(d)                                                                                                   \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),         \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// scale-d as a predicate that is always true: the sums accumulate onto d.
#define WG(shape, types, operands) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned." shape ".f32." types " " D32 ", " operands ";\n}\n"

template <bool F8>
__device__ __forceinline__ void wg_reg_a(float (&d)[32], const u32 (&a)[4], u64 db) {
    if (F8)
        asm volatile(WG("m64n64k32", "e4m3.e4m3", "{%32,%33,%34,%35}, %36, p, 1, 1")
                     : D32_ARGS(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    else
        asm volatile(WG("m64n64k16", "bf16.bf16", "{%32,%33,%34,%35}, %36, p, 1, 1, 0")
                     : D32_ARGS(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

template <bool F8>
__device__ __forceinline__ void wg_smem_a(float (&d)[32], u64 da, u64 db) {
    if (F8)
        asm volatile(WG("m64n64k32", "e4m3.e4m3", "%32, %33, p, 1, 1") : D32_ARGS(d) : "l"(da), "l"(db));
    else
        asm volatile(WG("m64n64k16", "bf16.bf16", "%32, %33, p, 1, 1, 0, 0") : D32_ARGS(d) : "l"(da), "l"(db));
}

template <bool F8, bool A_REGS>
__global__ void by_wgmma(const void* a, const void* b, float* d) {
    extern __shared__ __align__(1024) char smem[];
    char* sa = smem;          // 8 KB: A's chunk
    char* sb = smem + 8192;   // 8 KB: B's chunk
    const int esz = F8 ? 1 : 2, step = F8 ? 32 : 16;
    const int row_bytes = K * esz, chunks = row_bytes / 128, steps = 128 / (step * esz);
    float acc[32] = {};
    for (int c = 0; c < chunks; c++) {
        for (int u = threadIdx.x; u < 64 * 8; u += blockDim.x) {
            const int r = u >> 3, q = u & 7, at = r * 128 + ((q ^ (r & 7)) << 4);
            *(uint4*)(sb + at) = *(const uint4*)((const char*)b + (size_t)r * row_bytes + c * 128 + q * 16);
            if (!A_REGS) *(uint4*)(sa + at) = *(const uint4*)((const char*)a + (size_t)r * row_bytes + c * 128 + q * 16);
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        u32 af[steps][4];
        if (A_REGS)
            for (int kk = 0; kk < steps; kk++) a_frag<F8>(a, c * steps + kk, 0, af[kk]);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        for (int kk = 0; kk < steps; kk++) {
            const u32 ab = (u32)__cvta_generic_to_shared(sa) + kk * 32, bb = (u32)__cvta_generic_to_shared(sb) + kk * 32;
            if (A_REGS)
                wg_reg_a<F8>(acc, af[kk], desc(bb));
            else
                wg_smem_a<F8>(acc, desc(ab), desc(bb));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        __syncthreads();
    }
    for (int j = 0; j < N / 8; j++)
        for (int i = 0; i < 4; i++) store(d, j, i, acc[4 * j + i]);
}

static u32 rng = 12345;
static u32 next() {
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static int compare(const char* what, const std::vector<float>& x, const std::vector<float>& y) {
    int diff = 0;
    double worst = 0;
    for (size_t i = 0; i < x.size(); i++) {
        u32 bx, by;
        memcpy(&bx, &x[i], 4);
        memcpy(&by, &y[i], 4);
        if (bx != by) {
            diff++;
            const double r = fabs((double)x[i] - y[i]) / (fabs((double)x[i]) + 1e-30);
            if (r > worst) worst = r;
        }
    }
    printf("%-58s %5d of %zu outputs differ (largest relative %.3g)\n", what, diff, x.size(), worst);
    return diff;
}

template <bool F8>
static int run_case(const char* name) {
    const int esz = F8 ? 1 : 2;
    std::vector<uint8_t> ha((size_t)M * K * esz), hb((size_t)N * K * esz);
    for (auto* v : {&ha, &hb}) {
        if (F8) {
            for (auto& x : *v) {
                uint8_t c;
                do c = (uint8_t)next();
                while ((c & 0x7f) == 0x7f);
                x = c;
            }
        } else {
            // bf16 of values spread over 2^-6 .. 2^6, both signs.
            uint16_t* p = (uint16_t*)v->data();
            for (size_t i = 0; i < v->size() / 2; i++) {
                const u32 r = next();
                const u32 sign = (r >> 31) << 15, exp = 127 - 6 + (r >> 20) % 13, man = r & 0x7f;
                p[i] = (uint16_t)(sign | (exp << 7) | man);
            }
        }
    }
    void *da, *db;
    float* dd;
    CK(cudaMalloc(&da, ha.size()));
    CK(cudaMalloc(&db, hb.size()));
    CK(cudaMalloc(&dd, M * N * 4));
    CK(cudaMemcpy(da, ha.data(), ha.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    CK(cudaFuncSetAttribute(by_wgmma<F8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 17 << 10));
    CK(cudaFuncSetAttribute(by_wgmma<F8, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 17 << 10));
    auto get = [&](std::vector<float>& out) {
        out.resize(M * N);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(out.data(), dd, M * N * 4, cudaMemcpyDeviceToHost));
        return 0;
    };
    std::vector<float> base, other;
    by_mma_sync<F8><<<1, 128>>>(da, db, dd, 0);
    if (get(base)) return 1;
    // A plain double-precision check that the fragments are placed right.
    double worst = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                double x, y;
                if (F8) {
                    auto f8 = [](uint8_t c) {
                        const int s = c >> 7, e = (c >> 3) & 15, f = c & 7;
                        const double v = e ? ldexp(1.0 + f / 8.0, e - 7) : ldexp(f / 8.0, -6);
                        return s ? -v : v;
                    };
                    x = f8(ha[(size_t)m * K + k]);
                    y = f8(hb[(size_t)n * K + k]);
                } else {
                    auto bf = [](uint16_t h) {
                        u32 w = (u32)h << 16;
                        float f;
                        memcpy(&f, &w, 4);
                        return (double)f;
                    };
                    x = bf(((uint16_t*)ha.data())[(size_t)m * K + k]);
                    y = bf(((uint16_t*)hb.data())[(size_t)n * K + k]);
                }
                s += x * y;
                mag += fabs(x * y);
            }
            worst = fmax(worst, fabs(s - base[m * N + n]) / mag);
        }
    printf("== %s: mma.sync against double precision: largest error %.3g of the magnitudes\n", name, worst);
    int bad = worst > 1e-5;
    by_wgmma<F8, true><<<1, 128, 17 << 10>>>(da, db, dd);
    if (get(other)) return 1;
    compare("wgmma, A from registers, against mma.sync", base, other);
    by_wgmma<F8, false><<<1, 128, 17 << 10>>>(da, db, dd);
    if (get(other)) return 1;
    compare("wgmma, A from shared memory, against mma.sync", base, other);
    for (int perm = 1; perm <= 2; perm++) {
        by_mma_sync<F8><<<1, 128>>>(da, db, dd, perm);
        if (get(other)) return 1;
        compare(perm == 1 ? "mma.sync, each step's k reversed, against in order"
                          : "mma.sync, each step's k halves swapped, against in order",
                base, other);
    }
    cudaFree(da);
    cudaFree(db);
    cudaFree(dd);
    return bad;
}

int main() {
    int bad = run_case<false>("bf16 (m16n8k16 / m64n64k16)");
    bad |= run_case<true>("e4m3 (m16n8k32 / m64n64k32)");
    return bad;
}
