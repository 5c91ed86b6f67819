// Lightning prefill in one pass on tensor cores: the math of lightning/chunked.cu's
// lightning_chunked (SPEC §4.2), chunk after chunk with the state held on chip.
//
// Block (h, y) owns value columns e0 = 32·y .. e0 + 32 of head h (o[:, e] and S[:, e] depend
// only on column e) and walks the call's 64-token chunks in order. Per chunk c (len tokens,
// local index i, decay γ = exp(g), g = −slopes[h]):
//   (a) A = (Q Kᵀ) ⊙ γ^{i−j} for j ≤ i             warp w: rows 16w..16w+15, all 64 columns
//   (b) O = γ^{i+1} · Q S                           the same rows, the block's 32 columns
//   (c) O += A V;  out = bf16(scale · O)
//   (d) S ← γ^len S + Kᵀ Vd,  Vd_j = γ^{len−1−j} v_j  warp w: key rows 32w..32w+31
// The state slice stays in the (d) accumulators (fp32) for the whole call; after each update
// it is written to shared memory as bf16 hi + lo for (b) of the next chunk. Products with an
// fp32 operand (S, A, Vd) use its bf16 hi and lo parts (two MMAs, ~16 mantissa bits), as the
// three-kernel path does. With two buffers, Q, K and the V slice of chunk c + 1 load (cp.async)
// during chunk c; with one (for 99 KiB cards: ~69 KiB instead of ~108 at d = 128), after it.
// Either way the same operations in the same order: the same bits.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "lightning/common.cuh"

#define LF_VS 32  // value columns per block
#define LF_LDV (LF_VS + 8)

// Shared-memory layout (bytes) for head size d and nb (1 or 2) buffers: Q and K [nb][64][d + 8]
// bf16 each, V [nb][64][40], Vd hi and lo [64][40], S hi and lo [d][40], γ^n for n = 0..64.
#define LF_OFF_K(d, nb) ((nb) * LF_C * lf_ld(d) * 2)
#define LF_OFF_V(d, nb) (2 * LF_OFF_K(d, nb))
#define LF_OFF_VD(d, nb) (LF_OFF_V(d, nb) + (nb) * LF_C * LF_LDV * 2)
#define LF_OFF_S(d, nb) (LF_OFF_VD(d, nb) + 2 * LF_C * LF_LDV * 2)
#define LF_OFF_PW(d, nb) (LF_OFF_S(d, nb) + 2 * (d) * LF_LDV * 2)
#define LF_SMEM(d, nb) (LF_OFF_PW(d, nb) + 68 * 4)

// Stages chunk rows [j0, j0 + len) of Q, K and the V slice into buffer `buf` of `nb` (rows ≥ len
// zero).
__device__ __forceinline__ void lf_issue(const bf16* q, const bf16* k, const bf16* v, unsigned char* sm, int buf,
                                         int nb, int j0, int len, int h, int kvh, int e0, int heads,
                                         int kv_heads, int d) {
    // d is a power of two: row and piece by shifts (a division costs ~20 instructions).
    const int ld = lf_ld(d), seg_shift = __ffs(d / 8) - 1;
    const size_t qw = (size_t)heads * d, kvw = (size_t)kv_heads * d;
    bf16* qs = (bf16*)sm + buf * LF_C * ld;
    bf16* ks = (bf16*)(sm + LF_OFF_K(d, nb)) + buf * LF_C * ld;
    bf16* vs = (bf16*)(sm + LF_OFF_V(d, nb)) + buf * LF_C * LF_LDV;
    for (int x = threadIdx.x; x < LF_C << seg_shift; x += 128) {
        const int j = x >> seg_shift, p = x & ((1 << seg_shift) - 1);
        const bool in = j < len;
        const bf16* sq = in ? q + (size_t)(j0 + j) * qw + (size_t)h * d + 8 * p : q;
        const bf16* sk = in ? k + (size_t)(j0 + j) * kvw + (size_t)kvh * d + 8 * p : k;
        sp_cp_async16(sp_smem_addr(qs + j * ld + 8 * p), sq, in ? 16 : 0);
        sp_cp_async16(sp_smem_addr(ks + j * ld + 8 * p), sk, in ? 16 : 0);
    }
    for (int x = threadIdx.x; x < LF_C * (LF_VS / 8); x += 128) {
        const int j = x / (LF_VS / 8), p = x % (LF_VS / 8);
        const bool in = j < len;
        const bf16* sv = in ? v + (size_t)(j0 + j) * kvw + (size_t)kvh * d + e0 + 8 * p : v;
        sp_cp_async16(sp_smem_addr(vs + j * LF_LDV + 8 * p), sv, in ? 16 : 0);
    }
    sp_cp_commit();
}

// Writes the (d) accumulators (key rows 32w + 16mt + gq (+8), value columns 8nt + 2tq (+1)) to
// the S hi / lo tiles.
__device__ __forceinline__ void lf_store_state(const float (&sa)[2][4][4], bf16* sh, bf16* sl, int warp, int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const int a = 32 * warp + 16 * mt + gq;
        if (a < d) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    u32 hi, lo;
                    sp_split2(sa[mt][nt][2 * r], sa[mt][nt][2 * r + 1], hi, lo);
                    const int off = (a + 8 * r) * LF_LDV + 8 * nt + 2 * tq;
                    *(u32*)(sh + off) = hi;
                    *(u32*)(sl + off) = lo;
                }
        }
    }
}

// q [T, heads·d], k/v [T, kv_heads·d] bf16; state [heads, d, d] fp32 (key-major, read and
// advanced in place); out [T, heads·d] bf16; slopes [heads] fp32. Needs d 32, 64 or 128,
// heads % kv_heads == 0, 16-byte aligned q/k/v/out.
// Ranges (ranges != NULL): block z walks tokens [z·range_len, min(T, (z + 1)·range_len))
// (range_len a multiple of 64). With state_only, it starts from a zero state, writes no output
// and leaves its final state (the range's ΔS) in ranges[z]; else it starts from ranges[z] (the
// state before its range, lightning_range_states) and only the last range writes `state`.
// buffers: 2 (the next chunk loads during this one) or 1.
// launch: grid = (heads, d / 32, ranges or 1), block = 128,
//         dynamic smem = LF_SMEM(d, buffers) bytes (110,864 / 70,928 for d = 128)
extern "C" __global__ void __launch_bounds__(128)
lightning_fused(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out, const float* slopes, int T,
                int heads, int kv_heads, int d, float scale, int range_len, float* ranges, int state_only,
                int buffers) {
    pdl_start();
    extern __shared__ __align__(16) unsigned char lf_sm[];
    const int h = blockIdx.x, e0 = LF_VS * blockIdx.y;
    if (ranges) {
        const int j_lo = blockIdx.z * range_len;
        q += (size_t)j_lo * heads * d;
        out += (size_t)j_lo * heads * d;
        k += (size_t)j_lo * kv_heads * d;
        v += (size_t)j_lo * kv_heads * d;
        T = min(T - j_lo, range_len);
    }
    // Where the state slice comes from and goes to (the range slots are [heads, d, d] each).
    const float* st_in = ranges && !state_only ? ranges + (size_t)blockIdx.z * heads * d * d : state;
    float* st_out = !ranges ? state
                    : state_only ? ranges + (size_t)blockIdx.z * heads * d * d
                    : blockIdx.z + 1 == gridDim.z ? state
                                                  : (float*)0;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int ld = lf_ld(d), ksteps = d / 16;
    const size_t qw = (size_t)heads * d;
    const int nb = buffers == 1 ? 1 : 2;
    bf16* vdh = (bf16*)(lf_sm + LF_OFF_VD(d, nb));
    bf16* vdl = vdh + LF_C * LF_LDV;
    bf16* sh = (bf16*)(lf_sm + LF_OFF_S(d, nb));
    bf16* sl = sh + d * LF_LDV;
    float* pw = (float*)(lf_sm + LF_OFF_PW(d, nb));
    const float g = -slopes[h];
    for (int x = threadIdx.x; x <= LF_C; x += 128) pw[x] = lc_pow(g, x);

    // The state slice: key rows 32·warp + 16mt + gq (+8), value columns e0 + 8nt + 2tq (+1).
    const size_t slice = (size_t)h * d * d + e0;
    float sa[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int a = 32 * warp + 16 * mt + gq + 8 * (x >> 1);
                sa[mt][nt][x] = (a < d && !state_only) ? st_in[slice + (size_t)a * d + 8 * nt + 2 * tq + (x & 1)] : 0.0f;
            }
    lf_store_state(sa, sh, sl, warp, d);

    const int n_chunks = (T + LF_C - 1) / LF_C;
    lf_issue(q, k, v, lf_sm, 0, nb, 0, min(LF_C, T), h, kvh, e0, heads, kv_heads, d);
    // Lane offsets of the ldmatrix addresses: non-transposed A (rows m, cols k) and B (rows n,
    // cols k) fragments, and transposed ones (rows k).
    const int r8 = lane & 7, m8 = lane >> 3;
    for (int c = 0; c < n_chunks; c++) {
        const int j0 = c * LF_C, len = min(LF_C, T - j0), buf = c & (nb - 1);
        sp_cp_wait0();
        __syncthreads();  // chunk c staged; the previous chunk's readers are done
        if (nb == 2 && c + 1 < n_chunks)
            lf_issue(q, k, v, lf_sm, buf ^ 1, nb, j0 + LF_C, min(LF_C, T - j0 - LF_C), h, kvh, e0, heads, kv_heads,
                     d);
        const bf16* qs = (const bf16*)lf_sm + buf * LF_C * ld;
        const bf16* ks = (const bf16*)(lf_sm + LF_OFF_K(d, nb)) + buf * LF_C * ld;
        const bf16* vs = (const bf16*)(lf_sm + LF_OFF_V(d, nb)) + buf * LF_C * LF_LDV;

        // Vd = γ^{len−1−j} v_j as bf16 hi + lo (rows ≥ len are zero): 16 values a thread.
        {
            const int j = threadIdx.x >> 1, c0 = 16 * (threadIdx.x & 1);
            const float f = (j < len) ? pw[len - 1 - j] : 0.0f;
#pragma unroll
            for (int p = 0; p < 2; p++) {
                const uint4 w = *(const uint4*)(vs + j * LF_LDV + c0 + 8 * p);
                const u32 ws[4] = {w.x, w.y, w.z, w.w};
                u32 hi[4], lo[4];
#pragma unroll
                for (int y = 0; y < 4; y++) sp_split2(lt_lo(ws[y]) * f, lt_hi(ws[y]) * f, hi[y], lo[y]);
                *(uint4*)(vdh + j * LF_LDV + c0 + 8 * p) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
                *(uint4*)(vdl + j * LF_LDV + c0 + 8 * p) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
            }
        }

        if (!state_only) {
            // (a) A = Q Kᵀ for rows 16w.., Q fragments kept for (b).
            const int i0 = 16 * warp;
            u32 qa[8][4];
    #pragma unroll
            for (int kk = 0; kk < 8; kk++)
                if (kk < ksteps) ldsm_x4(qa[kk], sp_smem_addr(qs + (i0 + r8 + 8 * (m8 & 1)) * ld + 16 * kk + 8 * (m8 >> 1)));
            float A[8][4];
    #pragma unroll
            for (int nt = 0; nt < 8; nt++) A[nt][0] = A[nt][1] = A[nt][2] = A[nt][3] = 0.0f;
    #pragma unroll
            for (int np = 0; np < 4; np++)
    #pragma unroll
                for (int kk = 0; kk < 8; kk++)
                    if (kk < ksteps) {
                        u32 b[4];  // n-tiles 2np, 2np + 1 (keys j), k = dims 16kk..
                        ldsm_x4(b, sp_smem_addr(ks + (16 * np + r8 + 8 * (m8 >> 1)) * ld + 16 * kk + 8 * (m8 & 1)));
                        sp_mma(A[2 * np], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                        sp_mma(A[2 * np + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
                    }
            const int ir[2] = {i0 + gq, i0 + gq + 8};
    #pragma unroll
            for (int nt = 0; nt < 8; nt++)
    #pragma unroll
                for (int x = 0; x < 4; x++) {
                    const int i = ir[x >> 1], j = 8 * nt + 2 * tq + (x & 1);
                    A[nt][x] = (j <= i && i < len) ? A[nt][x] * pw[i - j] : 0.0f;
                }

            // (b) O = Q S (S hi and lo: B[k = key][n = value] from [key][value] tiles, transposed).
            float O[4][4];
    #pragma unroll
            for (int nt = 0; nt < 4; nt++) O[nt][0] = O[nt][1] = O[nt][2] = O[nt][3] = 0.0f;
    #pragma unroll
            for (int kk = 0; kk < 8; kk++)
                if (kk < ksteps)
    #pragma unroll
                    for (int part = 0; part < 2; part++) {
                        const bf16* sp = part ? sl : sh;
    #pragma unroll
                        for (int np = 0; np < 2; np++) {
                            u32 b[4];
                            ldsm_x4_t(b, sp_smem_addr(sp + (16 * kk + r8 + 8 * (m8 & 1)) * LF_LDV + 16 * np + 8 * (m8 >> 1)));
                            sp_mma(O[2 * np], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                            sp_mma(O[2 * np + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
                        }
                    }
            const float di[2] = {pw[min(ir[0] + 1, LF_C)], pw[min(ir[1] + 1, LF_C)]};
    #pragma unroll
            for (int nt = 0; nt < 4; nt++)
    #pragma unroll
                for (int x = 0; x < 4; x++) O[nt][x] *= di[x >> 1];

            // (c) O += A V, A's hi and lo parts straight from its accumulators.
    #pragma unroll
            for (int ks4 = 0; ks4 < 4; ks4++) {
                u32 ah[4], al[4];
                sp_split2(A[2 * ks4][0], A[2 * ks4][1], ah[0], al[0]);
                sp_split2(A[2 * ks4][2], A[2 * ks4][3], ah[1], al[1]);
                sp_split2(A[2 * ks4 + 1][0], A[2 * ks4 + 1][1], ah[2], al[2]);
                sp_split2(A[2 * ks4 + 1][2], A[2 * ks4 + 1][3], ah[3], al[3]);
    #pragma unroll
                for (int np = 0; np < 2; np++) {
                    u32 b[4];
                    ldsm_x4_t(b, sp_smem_addr(vs + (16 * ks4 + r8 + 8 * (m8 & 1)) * LF_LDV + 16 * np + 8 * (m8 >> 1)));
                    sp_mma(O[2 * np], ah[0], ah[1], ah[2], ah[3], b[0], b[1]);
                    sp_mma(O[2 * np], al[0], al[1], al[2], al[3], b[0], b[1]);
                    sp_mma(O[2 * np + 1], ah[0], ah[1], ah[2], ah[3], b[2], b[3]);
                    sp_mma(O[2 * np + 1], al[0], al[1], al[2], al[3], b[2], b[3]);
                }
            }
    #pragma unroll
            for (int r = 0; r < 2; r++)
                if (ir[r] < len) {
                    bf16* op = out + (size_t)(j0 + ir[r]) * qw + (size_t)h * d + e0 + 2 * tq;
    #pragma unroll
                    for (int nt = 0; nt < 4; nt++)
                        *(u32*)(op + 8 * nt) = sp_pack_bf16(scale * O[nt][2 * r], scale * O[nt][2 * r + 1]);
                }
        }
        __syncthreads();  // Vd written; every warp's (b) has read S

        // (d) S = γ^len S + Kᵀ Vd for key rows 32w.. (A = Kᵀ from the [j][key] tile, transposed).
        if (32 * warp < d) {
            const float dl = pw[len];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int x = 0; x < 4; x++) sa[mt][nt][x] *= dl;
#pragma unroll
            for (int ks4 = 0; ks4 < 4; ks4++) {
                u32 bh[2][4], bl[2][4];
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    const int off = (16 * ks4 + r8 + 8 * (m8 & 1)) * LF_LDV + 16 * np + 8 * (m8 >> 1);
                    ldsm_x4_t(bh[np], sp_smem_addr(vdh + off));
                    ldsm_x4_t(bl[np], sp_smem_addr(vdl + off));
                }
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    const int a0 = 32 * warp + 16 * mt;
                    if (a0 < d) {
                        u32 a[4];  // A[m = key][k = j] = K[j][key]: matrices (k, m) = (0,0), (0,8), (8,0), (8,8)
                        ldsm_x4_t(a, sp_smem_addr(ks + (16 * ks4 + r8 + 8 * (m8 >> 1)) * ld + a0 + 8 * (m8 & 1)));
#pragma unroll
                        for (int np = 0; np < 2; np++) {
                            sp_mma(sa[mt][2 * np], a[0], a[1], a[2], a[3], bh[np][0], bh[np][1]);
                            sp_mma(sa[mt][2 * np], a[0], a[1], a[2], a[3], bl[np][0], bl[np][1]);
                            sp_mma(sa[mt][2 * np + 1], a[0], a[1], a[2], a[3], bh[np][2], bh[np][3]);
                            sp_mma(sa[mt][2 * np + 1], a[0], a[1], a[2], a[3], bl[np][2], bl[np][3]);
                        }
                    }
                }
            }
            lf_store_state(sa, sh, sl, warp, d);
        }
        if (nb == 1 && c + 1 < n_chunks) {
            __syncthreads();  // every warp's (d) has read K: the buffer takes the next chunk
            lf_issue(q, k, v, lf_sm, 0, nb, j0 + LF_C, min(LF_C, T - j0 - LF_C), h, kvh, e0, heads, kv_heads, d);
        }
    }
    if (!st_out) return;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int a = 32 * warp + 16 * mt + gq + 8 * (x >> 1);
                if (a < d) st_out[slice + (size_t)a * d + 8 * nt + 2 * tq + (x & 1)] = sa[mt][nt][x];
            }
}

// Between the two lightning_fused passes over n_ranges ranges of range_len tokens: ranges[r]
// holds ΔS_r (r < n_ranges − 1) and becomes S_r, the state before range r: S_0 = state,
// S_{r+1} = γ^range_len S_r + ΔS_r (γ = exp(−slopes[h]), element-wise in fp32).
// launch: grid = ⌈heads·d·d / 256⌉, block = 256
extern "C" __global__ void lightning_range_states(const float* state, float* ranges, const float* slopes, int heads,
                                                  int d, int n_ranges, int range_len) {
    pdl_start();
    const size_t n = (size_t)heads * d * d, x = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (x >= n) return;
    const float decay = lc_pow(-slopes[x / ((size_t)d * d)], range_len);
    float cur = state[x];
    for (int r = 0; r < n_ranges; r++) {
        const float ds = r + 1 < n_ranges ? ranges[r * n + x] : 0.0f;
        ranges[r * n + x] = cur;
        cur = decay * cur + ds;
    }
}
