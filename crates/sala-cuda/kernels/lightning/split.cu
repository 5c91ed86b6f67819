// Lightning chunked prefill on tensor cores (the math of lightning/chunked.cu's lightning_chunked)
//
// Three kernels over a range of n whole 64-token chunks (the last may be partial), chunk c
// holding tokens [64c, 64c + len_c) of the call, decay γ = exp(g), g = −slopes[h]:
//   1. lightning_chunk_state: ΔS_c = Σ_j γ^{len_c−1−j} k_jᵀ v_j        (all chunks in parallel)
//   2. lightning_chunk_scan:  S_c = state before chunk c; state ← γ^{len_c} S_c + ΔS_c (in order)
//   3. lightning_chunk_out:   o_i = scale·(γ^{i+1} q_i S_c + Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j)
// Products run on bf16 tensor cores with fp32 accumulation; an fp32 operand (decayed keys, the
// state, decayed scores) is split into bf16 hi + lo parts and multiplied twice, so products keep
// ~16 mantissa bits and the result stays fp32-accurate. Powers γ^n by lc_pow.
// The scratch `ds` holds n·heads·d·d fp32: ΔS from kernel 1, overwritten by kernel 2 with the
// states S_c as packed bf16 (hi | lo << 16). Needs d a multiple of 16, at most 128.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "lightning/common.cuh"

#define LC_C 64

// The hi + lo bf16 pair of (x0, x1) packs, for an A fragment register.
__device__ __forceinline__ void lc_split(float x0, float x1, u32& hi, u32& lo) { sp_split2(x0, x1, hi, lo); }

// acc += A·V for a 16×16 A given as bf16 hi + lo fragments (two products) and the V rows of
// tokens jb + {2tq, 2tq+1, 2tq+8, 2tq+9} of the chunk at j0 (rows ≥ len read as 0); the value
// dims of acc are permuted as sp_o_dim says.
__device__ __forceinline__ void lc_pv_hilo(float (&acc)[16][4], u32 h0, u32 h1, u32 h2, u32 h3, u32 l0, u32 l1,
                                           u32 l2, u32 l3, const bf16* vh, size_t kvw, int j0, int jb, int len,
                                           int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int jr[4] = {jb + 2 * tq, jb + 2 * tq + 1, jb + 2 * tq + 8, jb + 2 * tq + 9};
#pragma unroll
    for (int m = 0; m < 8; m++) {
        if (m * 16 < d) {
            u32 w[4];
#pragma unroll
            for (int y = 0; y < 4; y++)
                w[y] = (jr[y] < len) ? *(const u32*)(vh + (size_t)(j0 + jr[y]) * kvw + 16 * m + 2 * gq) : 0u;
            const u32 be0 = __byte_perm(w[0], w[1], 0x5410), bo0 = __byte_perm(w[0], w[1], 0x7632);
            const u32 be1 = __byte_perm(w[2], w[3], 0x5410), bo1 = __byte_perm(w[2], w[3], 0x7632);
            sp_mma(acc[2 * m], h0, h1, h2, h3, be0, be1);
            sp_mma(acc[2 * m], l0, l1, l2, l3, be0, be1);
            sp_mma(acc[2 * m + 1], h0, h1, h2, h3, bo0, bo1);
            sp_mma(acc[2 * m + 1], l0, l1, l2, l3, bo0, bo1);
        }
    }
}

// launch: grid = (n, heads), block = 256, dynamic smem = 0 bytes (static 17,664 bytes)
extern "C" __global__ void __launch_bounds__(256)
lightning_chunk_state(const bf16* k, const bf16* v, float* ds, const float* slopes, int T, int heads, int kv_heads,
                      int d) {
    pdl_start();
    __shared__ __align__(16) bf16 ks[LC_C * AT_MAXLD];
    __shared__ float dec[LC_C];
    const int c = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int j0 = c * LC_C, len = min(LC_C, T - j0);
    const size_t kvw = (size_t)kv_heads * d;
    const int segs = d / 8;
    for (int x = threadIdx.x; x < LC_C * segs; x += 256) {
        const int j = x / segs, p = x % segs;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (j < len) val = *(const uint4*)(k + (size_t)(j0 + j) * kvw + (size_t)kvh * d + 8 * p);
        *(uint4*)(ks + j * AT_MAXLD + 8 * p) = val;
    }
    const float g = -slopes[h];
    if (threadIdx.x < LC_C) dec[threadIdx.x] = (threadIdx.x < len) ? lc_pow(g, len - 1 - threadIdx.x) : 0.0f;
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int a0 = 16 * warp;  // this warp's key-dimension rows of ΔS
    if (a0 >= d) return;
    float acc[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) acc[nt][x] = 0.0f;
    const bf16* vh = v + (size_t)kvh * d;
#pragma unroll
    for (int s4 = 0; s4 < 4; s4++) {
        // A = (decayed K)ᵀ: rows a0 + gq (+8), columns (tokens) 16·s4 + 2tq + {0, 1} (+8).
        float av[2][4];
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int j = 16 * s4 + 2 * tq + (y & 1) + 8 * (y >> 1);
                av[r][y] = bf2f(ks[j * AT_MAXLD + a0 + gq + 8 * r]) * dec[j];
            }
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        lc_split(av[0][0], av[0][1], h0, l0);
        lc_split(av[1][0], av[1][1], h1, l1);
        lc_split(av[0][2], av[0][3], h2, l2);
        lc_split(av[1][2], av[1][3], h3, l3);
        lc_pv_hilo(acc, h0, h1, h2, h3, l0, l1, l2, l3, vh, kvw, j0, 16 * s4, len, d);
    }
    float* out = ds + ((size_t)c * heads + h) * d * d;
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
        if (nt * 8 < d)
#pragma unroll
            for (int x = 0; x < 4; x++) out[(size_t)(a0 + gq + 8 * (x >> 1)) * d + sp_o_dim(nt, x, tq)] = acc[nt][x];
}

// launch: grid = (⌈heads·d·d / 256⌉), block = 256
extern "C" __global__ void __launch_bounds__(256)
lightning_chunk_scan(float* state, float* ds, const float* slopes, int n, int last_len, int heads, int d) {
    pdl_start();
    const size_t dd = (size_t)d * d, total = (size_t)heads * dd;
    const size_t idx = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (idx >= total) return;
    const float g = -slopes[idx / dd];
    const float full = lc_pow(g, LC_C), last = lc_pow(g, last_len);
    float s = state[idx];
    // Eight chunks at a time: their loads are issued together, then the sequential updates.
    for (int c0 = 0; c0 < n; c0 += 8) {
        float delta[8];
#pragma unroll
        for (int u = 0; u < 8; u++) delta[u] = (c0 + u < n) ? ds[(size_t)(c0 + u) * total + idx] : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int c = c0 + u;
            if (c < n) {
                const u32 hi = f2bf(s);
                const u32 lo = f2bf(s - bf2f((bf16)hi));
                *(u32*)(ds + (size_t)c * total + idx) = hi | (lo << 16);
                s = __fadd_rn(__fmul_rn(c == n - 1 ? last : full, s), delta[u]);
            }
        }
    }
    state[idx] = s;
}

// launch: grid = (n, heads), block = 128 (4 warps × 16 tokens), dynamic smem = 0 bytes
// (ds as kernel 2 left it; out [T, heads·d] bf16 for the range's tokens)
extern "C" __global__ void __launch_bounds__(128)
lightning_chunk_out(const bf16* q, const bf16* k, const bf16* v, const float* ds, bf16* out, const float* slopes,
                    int T, int heads, int kv_heads, int d, float scale) {
    pdl_start();
    __shared__ float pw[LC_C + 1];  // γ^n, n = 0..64
    const int c = blockIdx.x, h = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int j0 = c * LC_C, len = min(LC_C, T - j0);
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;
    for (int x = threadIdx.x; x <= LC_C; x += 128) pw[x] = lc_pow(-slopes[h], x);
    __syncthreads();
    int ir[2];
    bool ok[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        ir[r] = 16 * warp + gq + 8 * r;
        ok[r] = ir[r] < len;
    }
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            qa[kk][x] = (kk * 16 < d && ok[r])
                            ? *(const u32*)(q + (size_t)(j0 + ir[r]) * qw + (size_t)h * d + kk * 16 + c8 + 2 * tq)
                            : 0u;
        }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;

    // Inter-chunk: O = Q S_c, S_c from the packed hi | lo state (rows a = key dims).
    const u32* sp = (const u32*)(ds + ((size_t)c * heads + h) * d * d);
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        if (kk * 16 < d) {
            const int ar[4] = {16 * kk + 2 * tq, 16 * kk + 2 * tq + 1, 16 * kk + 2 * tq + 8, 16 * kk + 2 * tq + 9};
#pragma unroll
            for (int m = 0; m < 8; m++) {
                if (m * 16 < d) {
                    uint2 w[4];
#pragma unroll
                    for (int y = 0; y < 4; y++) w[y] = *(const uint2*)(sp + (size_t)ar[y] * d + 16 * m + 2 * gq);
                    // Even dims (tile 2m): elements .x; odd dims (tile 2m+1): .y; hi = low half.
                    sp_mma(O[2 * m], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], __byte_perm(w[0].x, w[1].x, 0x5410),
                           __byte_perm(w[2].x, w[3].x, 0x5410));
                    sp_mma(O[2 * m], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], __byte_perm(w[0].x, w[1].x, 0x7632),
                           __byte_perm(w[2].x, w[3].x, 0x7632));
                    sp_mma(O[2 * m + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                           __byte_perm(w[0].y, w[1].y, 0x5410), __byte_perm(w[2].y, w[3].y, 0x5410));
                    sp_mma(O[2 * m + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                           __byte_perm(w[0].y, w[1].y, 0x7632), __byte_perm(w[2].y, w[3].y, 0x7632));
                }
            }
        }
    }
    const float di[2] = {pw[min(ir[0] + 1, LC_C)], pw[min(ir[1] + 1, LC_C)]};
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] *= di[x >> 1];

    // Intra-chunk: A = (Q Kᵀ) ⊙ γ^{i−j} for j ≤ i, then O += A V.
    float S[8][4];
    const bf16* kh = k + (size_t)kvh * d;
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
        const int j = 8 * nt + gq;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            if (kk * 16 < d) {
                u32 b0 = 0u, b1 = 0u;
                if (j < len) {
                    const bf16* kr = kh + (size_t)(j0 + j) * kvw + kk * 16 + 2 * tq;
                    b0 = *(const u32*)kr;
                    b1 = *(const u32*)(kr + 8);
                }
                sp_mma(S[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int i = ir[x >> 1], j = 8 * nt + 2 * tq + (x & 1);
            S[nt][x] = (ok[x >> 1] && j <= i) ? S[nt][x] * pw[i - j] : 0.0f;
        }
    const bf16* vh = v + (size_t)kvh * d;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        lc_split(S[2 * ks][0], S[2 * ks][1], h0, l0);
        lc_split(S[2 * ks][2], S[2 * ks][3], h1, l1);
        lc_split(S[2 * ks + 1][0], S[2 * ks + 1][1], h2, l2);
        lc_split(S[2 * ks + 1][2], S[2 * ks + 1][3], h3, l3);
        lc_pv_hilo(O, h0, h1, h2, h3, l0, l1, l2, l3, vh, kvw, j0, 16 * ks, len, d);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (ok[r]) sp_store_row(O, r, scale, out + (size_t)(j0 + ir[r]) * qw + (size_t)h * d + 4 * tq, d);
    }
}
