// Which MMA groupings give a product the same bits? A design check for the decode products
// (BENCHMARKS.md, twenty-fourth session): a row's bits must not depend on the batch, so every
// row count must use one instruction and one grouping of k. Prints, for random bf16 inputs of
// wide range (64 weight rows x 64 activation rows x K), how many of the 4,096 outputs differ:
//   slots: mma.sync with each MMA's 16 k-values in other slots (the same sets);
//   today: mma.sync with today's GEMV sets (4 k from each of 4 16-byte chunks) against
//          16 consecutive k (shows the check can see a grouping);
//   wgmma: warpgroup MMA (A in registers, B from 128-byte-swizzled shared memory) against
//          mma.sync with the same sets;
//   n8:    wgmma at N = 8 against the first 8 columns of N = 64.
// Build and run on an sm_90 GPU: nvcc -arch=sm_90a -O2 -o /tmp/wgmma-bits scripts/wgmma-bits.cu
// && /tmp/wgmma-bits
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define K 256        // 4 panels of 64
#define KSTEPS (K / 16)
#define PANEL 8192   // a 64-k panel of 64 rows: 64 x 128 bytes

__device__ __forceinline__ u32 pair(const u16* p) { return (u32)p[0] | ((u32)p[1] << 16); }

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// d[64][64] = w[64][K] · x[64][K]ᵀ by mma.sync, warp w rows 16w.., N-tiles of 8 activation rows.
// mode 0: k-step kk takes k 16kk .. 16kk + 15 in the usual slots; mode 1: the same 16 k with
// slots 2t and 2t + 8 swapped; mode 2: today's GEMV sets (slab s = kk / 4, j = kk % 4:
// p = j / 2, h = j % 2, lane t's k = 64s + (2t + p)·8 + 4h + {0, 1 | 2, 3}).
__global__ void by_mma_sync(const u16* w, const u16* x, float* d, int mode) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const u16* r0 = w + (16 * warp + g) * K;
    const u16* r1 = r0 + 8 * K;
    for (int nt = 0; nt < 8; nt++) {
        const u16* xr = x + (8 * nt + g) * K;
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int kk = 0; kk < KSTEPS; kk++) {
            if (mode == 2) {
                const int j = kk & 3, k = 64 * (kk >> 2) + (2 * t + (j >> 1)) * 8 + 4 * (j & 1);
                mma(c, pair(r0 + k), pair(r1 + k), pair(r0 + k + 2), pair(r1 + k + 2), pair(xr + k), pair(xr + k + 2));
            } else {
                const int k = 16 * kk + 2 * t;
                const u32 a0 = pair(r0 + k), a1 = pair(r1 + k), a2 = pair(r0 + k + 8), a3 = pair(r1 + k + 8);
                const u32 b0 = pair(xr + k), b1 = pair(xr + k + 8);
                if (mode == 0)
                    mma(c, a0, a1, a2, a3, b0, b1);
                else
                    mma(c, a2, a3, a0, a1, b1, b0);
            }
        }
        float* o = d + (16 * warp + g) * 64 + 8 * nt + 2 * t;
        o[0] = c[0], o[1] = c[1], o[8 * 64] = c[2], o[8 * 64 + 1] = c[3];
    }
}

__device__ __forceinline__ u64 desc_of(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)64 << 32) | ((u64)1 << 62);
}

// The same product by wgmma m64n64k16 (n8 = 0) or m64n8k16 (n8 = 1, columns 0..7): A as
// mma.sync's mode-0 fragments in registers, x in shared memory (K-major, 128-byte swizzle).
__global__ void by_wgmma(const u16* w, const u16* x, float* d, int n8) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ __align__(1024) unsigned char xs[(K / 64) * PANEL];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    for (int i = tid; i < 64 * (K / 8); i += 128) {
        const int r = i / (K / 8), c = i % (K / 8);
        *(uint4*)(xs + (c >> 3) * PANEL + r * 128 + ((((c & 7) ^ r) & 7) << 4)) = *(const uint4*)(x + r * K + 8 * c);
    }
    __syncthreads();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    const u16* r0 = w + (16 * warp + g) * K;
    const u16* r1 = r0 + 8 * K;
    // Every A fragment in registers before the fence (wgmma reads its registers asynchronously).
    u32 a[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        const int k = 16 * kk + 2 * t;
        a[kk][0] = pair(r0 + k), a[kk][1] = pair(r1 + k), a[kk][2] = pair(r0 + k + 8), a[kk][3] = pair(r1 + k + 8);
    }
    float c[32];
    for (int i = 0; i < 32; i++) c[i] = 0.0f;
    const u32 base = (u32)__cvta_generic_to_shared(xs);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++) {
        const u64 desc = desc_of(base) + (u64)((u32)((kk >> 2) * PANEL + (kk & 3) * 32) >> 4);
        if (n8) {
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                         : "r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3]), "l"(desc), "r"(1));
        } else {
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
                "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7]),
                  "+f"(c[8]), "+f"(c[9]), "+f"(c[10]), "+f"(c[11]), "+f"(c[12]), "+f"(c[13]), "+f"(c[14]),
                  "+f"(c[15]), "+f"(c[16]), "+f"(c[17]), "+f"(c[18]), "+f"(c[19]), "+f"(c[20]), "+f"(c[21]),
                  "+f"(c[22]), "+f"(c[23]), "+f"(c[24]), "+f"(c[25]), "+f"(c[26]), "+f"(c[27]), "+f"(c[28]),
                  "+f"(c[29]), "+f"(c[30]), "+f"(c[31])
                : "r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3]), "l"(desc), "r"(1));
        }
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int j = 0; j < (n8 ? 1 : 8); j++) {
        float* o = d + (16 * warp + g) * 64 + 8 * j + 2 * t;
        o[0] = c[4 * j], o[1] = c[4 * j + 1], o[8 * 64] = c[4 * j + 2], o[8 * 64 + 1] = c[4 * j + 3];
    }
#endif
}

static u32 rng_state = 12345u;
static u32 next_u32() {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state;
}
// A bf16 of random sign, mantissa and exponent 2^-6 .. 2^6.
static u16 random_bf16() {
    const u32 r = next_u32();
    const u32 exp = 127 - 6 + (r >> 8) % 13, mant = (r >> 20) & 0x7f, sign = r & 1;
    return (u16)((sign << 15) | (exp << 7) | mant);
}

static int differing(const float* a, const float* b, int cols) {
    int n = 0;
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < cols; c++) n += memcmp(&a[r * 64 + c], &b[r * 64 + c], 4) != 0;
    return n;
}

int main() {
    std::vector<u16> w(64 * K), x(64 * K);
    for (auto& v : w) v = random_bf16();
    for (auto& v : x) v = random_bf16();
    u16 *dw, *dx;
    float* dd;
    cudaMalloc(&dw, w.size() * 2);
    cudaMalloc(&dx, x.size() * 2);
    cudaMalloc(&dd, 64 * 64 * 4);
    cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice);
    std::vector<float> out[5];
    auto take = [&](int i) {
        out[i].resize(64 * 64);
        cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
            printf("kernel %d: %s\n", i, cudaGetErrorString(e));
            exit(1);
        }
        cudaMemcpy(out[i].data(), dd, 64 * 64 * 4, cudaMemcpyDeviceToHost);
        cudaMemset(dd, 0, 64 * 64 * 4);
    };
    for (int mode = 0; mode < 3; mode++) {
        by_mma_sync<<<1, 128>>>(dw, dx, dd, mode);
        take(mode);
    }
    by_wgmma<<<1, 128>>>(dw, dx, dd, 0);
    take(3);
    by_wgmma<<<1, 128>>>(dw, dx, dd, 1);
    take(4);
    // The CPU's sum in double, to see that each result is the product at all: the worst error
    // over the sum of the terms' magnitudes.
    double worst = 0.0;
    for (int r = 0; r < 64; r++)
        for (int c = 0; c < 64; c++) {
            double s = 0.0, size = 0.0;
            for (int k = 0; k < K; k++) {
                float a, b;
                u32 ua = (u32)w[r * K + k] << 16, ub = (u32)x[c * K + k] << 16;
                memcpy(&a, &ua, 4), memcpy(&b, &ub, 4);
                s += (double)a * b, size += fabs((double)a * b);
            }
            for (int i = 0; i < 4; i++) worst = fmax(worst, fabs(out[i][r * 64 + c] - s) / size);
        }
    printf("worst error against the double sum, over the terms' magnitudes: %.3g\n", worst);
    printf("slots (mma.sync, same sets, other slots): %d of 4096 differ\n", differing(out[0].data(), out[1].data(), 64));
    printf("today (mma.sync, today's sets against consecutive k): %d of 4096 differ\n",
           differing(out[0].data(), out[2].data(), 64));
    printf("wgmma (m64n64k16 against mma.sync, same sets): %d of 4096 differ\n",
           differing(out[0].data(), out[3].data(), 64));
    printf("n8 (wgmma m64n8k16 against m64n64k16, columns 0-7): %d of 512 differ\n",
           differing(out[3].data(), out[4].data(), 8));
    return 0;
}
