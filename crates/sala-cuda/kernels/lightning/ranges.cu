// Lightning prefill over ranges of chunks in parallel (SPEC §4.2), on tensor cores:
//   1. lightning_range_sums: block (h, r) walks range r's chunks from a zero state and leaves
//      the range's ΔS_r (its own contribution to the state after it) in ranges[r];
//   2. lightning_range_states: S_0 = state, S_{r+1} = γ^L S_r + ΔS_r, element-wise;
//   3. lightning_ranges: block (h, r) walks range r's chunks from S_r, writing
//      every output; the last range leaves the final state in `state`.
// Nothing per chunk goes to memory. Per 64-token chunk (len tokens, local index i, γ = exp(g),
// g = −slopes[h]):
//   (a) A = (Q Kᵀ) ⊙ γ^{i−j} for j ≤ i, as bf16 hi + lo in shared memory
//   (b) O = γ^{i+1} · Q S
//   (c) O += A V;  out = bf16(scale · O)
//   (d) S ← γ^len S + Kᵀ Vd,  Vd_j = γ^{len−1−j} v_j
// Warp w owns value columns 16w .. 16w + 15 of the head: their slice of the state stays in its
// (d) accumulators (Sᵀ, values as MMA rows) for the whole walk, and (b) takes its B fragments
// straight from them; (a)'s 16 x 32 tiles of A are shared through shared memory. Products with
// an fp32 operand (S, A, Vd) use its bf16 hi and lo parts (two MMAs, ~16 mantissa bits).

#include "common/types.cuh"
#include "common/mma.cuh"
#include "lightning/common.cuh"

// Shared memory for head size d and nb (1 or 2) buffers: per buffer Q (not for the sums), K
// and V [64][d] bf16, unpadded, 16-byte piece p of row r at p ^ (r & 7) (ldmatrix
// conflict-free); A hi and lo [64][64] bf16 swizzled alike (not for the sums); γ^n for n =
// 0..64. tiles = 3 (outputs) or 2 (sums).
#define LR_TILE(d) (LF_C * (d) * 2)
#define LR_OFF_A(d, nb, tiles) ((nb) * (tiles) * LR_TILE(d))
#define LR_OFF_PW(d, nb, tiles) (LR_OFF_A(d, nb, tiles) + ((tiles) == 3 ? 2 * LF_C * LF_C * 2 : 0))
#define LR_SMEM(d, nb, tiles) (LR_OFF_PW(d, nb, tiles) + 68 * 4)

// Element offset of column `col` (a multiple of 8) of row r in a swizzled tile of `cols` columns.
__device__ __forceinline__ int lr_at(int r, int col, int cols) { return r * cols + 8 * ((col >> 3) ^ (r & 7)); }

// ldmatrix addresses in the swizzled tiles. A lane reads row R0 + lrow (R0 a multiple of 8,
// lrow ≡ r8 mod 8) at piece 2p + c (columns 16p + 8c ..): byte 16·((2p + c) ^ r8) of the row,
// = 32·(p ^ (r8 >> 1)) + 16·(c ^ (r8 & 1)). With p known at compile time, p ^ (r8 >> 1) =
// (p & ~3) + xs[p & 3]: one add an address.
#define LR_PP(p) (32 * ((p) & ~3) + xs[(p) & 3])

// Stages rows [j0, j0 + len) of Q (unless SUMS), K and V of one head into buffer `buf`, rows ≥
// len zero; q, k, v point at the head's first column, qw and kvw are the row strides.
template <int D, bool SUMS>
__device__ __forceinline__ void lr_issue(const bf16* q, const bf16* k, const bf16* v, unsigned char* sm, int buf,
                                         int j0, int len, size_t qw, size_t kvw) {
    constexpr int segs = D / 8, threads = 2 * D, per = LF_C * segs / threads, tiles = SUMS ? 2 : 3;
    bf16* const qs = (bf16*)(sm + buf * tiles * LR_TILE(D));
    bf16* const ks = SUMS ? qs : qs + LF_C * D;
    bf16* const vs = ks + LF_C * D;
#pragma unroll
    for (int n = 0; n < per; n++) {
        const int x = threadIdx.x + threads * n, j = x / segs, p = x % segs;
        const bool in = j < len;
        const int at = lr_at(j, 8 * p, D);
        const size_t row = in ? (size_t)(j0 + j) : 0;
        if (!SUMS) sp_cp_async16(sp_smem_addr(qs + at), q + row * qw + 8 * p, in ? 16 : 0);
        sp_cp_async16(sp_smem_addr(ks + at), k + row * kvw + 8 * p, in ? 16 : 0);
        sp_cp_async16(sp_smem_addr(vs + at), v + row * kvw + 8 * p, in ? 16 : 0);
    }
    sp_cp_commit();
}

template <int D, bool SUMS>
__device__ __forceinline__ void lr_body(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out,
                                        const float* slopes, int T, int heads, int kv_heads, float scale,
                                        int range_len, float* ranges, int nb) {
    constexpr int W = D / 16, threads = 32 * W, KT = D / 8, tiles = SUMS ? 2 : 3;
    extern __shared__ __align__(16) unsigned char lr_sm[];
    const int h = blockIdx.x, r = blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int r8 = lane & 7, m8 = lane >> 3;
    u32 xs[4];
#pragma unroll
    for (int x = 0; x < 4; x++) xs[x] = 32 * (x ^ (r8 >> 1));
    // Lane parts of the two ldmatrix patterns: X (rows + 8·(m8 & 1), piece + (m8 >> 1)) and Y
    // (rows + 8·(m8 >> 1), piece + (m8 & 1)), in [64][D] and [64][64] tiles; value columns
    // 16·warp.. at piece pair `warp`.
    const int x_row = r8 + 8 * (m8 & 1), x_c = 16 * ((m8 >> 1) ^ (r8 & 1));
    const int y_row = r8 + 8 * (m8 >> 1), y_c = 16 * ((m8 & 1) ^ (r8 & 1));
    const u32 lane_xd = x_row * 2 * D + x_c, lane_yd = y_row * 2 * D + y_c, lane_xa = x_row * 2 * LF_C + x_c;
    const u32 vcol = 32 * (warp ^ (r8 >> 1));
    const u32 sm0 = sp_smem_addr(lr_sm);
    const size_t qw = (size_t)heads * D, kvw = (size_t)kv_heads * D;
    const int j_lo = ranges ? r * range_len : 0;
    if (ranges) T = min(T - j_lo, range_len);
    if (!SUMS) {
        q += (size_t)j_lo * qw + (size_t)h * D;
        out += (size_t)j_lo * qw + (size_t)h * D;
    }
    k += (size_t)j_lo * kvw + (size_t)kvh * D;
    v += (size_t)j_lo * kvw + (size_t)kvh * D;
    const size_t slot = (size_t)heads * D * D;
    const float* st_in = SUMS ? (const float*)0 : ranges ? ranges + r * slot : state;
    float* st_out = SUMS ? ranges + r * slot : (!ranges || r + 1 == (int)gridDim.y) ? state : (float*)0;

    bf16* const ah_s = (bf16*)(lr_sm + LR_OFF_A(D, nb, tiles));
    bf16* const al_s = ah_s + LF_C * LF_C;
    float* const pw = (float*)(lr_sm + LR_OFF_PW(D, nb, tiles));
    const float g = -slopes[h];
    for (int x = threadIdx.x; x <= LF_C; x += threads) pw[x] = lc_pow(g, x);

    // Sᵀ slice: value 16·warp + gq (+8 for x ≥ 2), key 8t + 2tq (+1 for odd x).
    const int v0 = 16 * warp;
    float st[KT][4];
#pragma unroll
    for (int t = 0; t < KT; t++)
#pragma unroll
        for (int x = 0; x < 4; x++)
            st[t][x] = st_in ? st_in[(size_t)h * D * D + (size_t)(8 * t + 2 * tq + (x & 1)) * D + v0 + gq + 8 * (x >> 1)]
                             : 0.0f;

    const int n_chunks = (T + LF_C - 1) / LF_C;
    lr_issue<D, SUMS>(q, k, v, lr_sm, 0, 0, min(LF_C, T), qw, kvw);
    for (int c = 0; c < n_chunks; c++) {
        const int j0 = c * LF_C, len = min(LF_C, T - j0), buf = c & (nb - 1);
        sp_cp_wait0();
        __syncthreads();  // chunk c staged, pw written; every warp is done with chunk c − 1
        if (nb == 2 && c + 1 < n_chunks)
            lr_issue<D, SUMS>(q, k, v, lr_sm, buf ^ 1, j0 + LF_C, min(LF_C, T - j0 - LF_C), qw, kvw);
        const u32 qa = sm0 + buf * tiles * LR_TILE(D), ka = SUMS ? qa : qa + LR_TILE(D), va = ka + LR_TILE(D);
        const u32 aha = sm0 + LR_OFF_A(D, nb, tiles), ala = aha + LF_C * LF_C * 2;

        if (!SUMS) {
            // (a) A tiles: rows 16mt.., columns 32nh.. (tiles wholly above the diagonal are
            // never read).
            for (int u = warp; u < 8; u += W) {
                const int mt = u >> 1, nh = u & 1;
                if (32 * nh > 16 * mt + 15) continue;
                float acc[4][4];
#pragma unroll
                for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < D / 16; kk++) {
                    u32 a[4];
                    ldsm_x4(a, qa + lane_xd + 16 * mt * 2 * D + LR_PP(kk));
#pragma unroll
                    for (int np = 0; np < 2; np++) {
                        u32 b[4];
                        ldsm_x4(b, ka + lane_yd + (32 * nh + 16 * np) * 2 * D + LR_PP(kk));
                        sp_mma(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
                        sp_mma(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int rr = 0; rr < 2; rr++) {
                        const int i = 16 * mt + gq + 8 * rr, j = 32 * nh + 8 * nt + 2 * tq;
                        const float x0 = (j <= i && i < len) ? acc[nt][2 * rr] * pw[max(i - j, 0)] : 0.0f;
                        const float x1 = (j + 1 <= i && i < len) ? acc[nt][2 * rr + 1] * pw[max(i - j - 1, 0)] : 0.0f;
                        u32 hi, lo;
                        sp_split2(x0, x1, hi, lo);
                        const int at = lr_at(i, j & ~7, LF_C) + (j & 7);
                        *(u32*)(ah_s + at) = hi;
                        *(u32*)(al_s + at) = lo;
                    }
            }

            // (b) O = Q S for the warp's 16 value columns, S's hi and lo from the accumulators.
            float O[4][2][4];
#pragma unroll
            for (int mt = 0; mt < 4; mt++)
#pragma unroll
                for (int n = 0; n < 2; n++) O[mt][n][0] = O[mt][n][1] = O[mt][n][2] = O[mt][n][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                u32 bh[2][2], bl[2][2];  // [value n-tile][b0, b1]
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    sp_split2(st[2 * kk][2 * n], st[2 * kk][2 * n + 1], bh[n][0], bl[n][0]);
                    sp_split2(st[2 * kk + 1][2 * n], st[2 * kk + 1][2 * n + 1], bh[n][1], bl[n][1]);
                }
#pragma unroll
                for (int mt = 0; mt < 4; mt++) {
                    u32 a[4];
                    ldsm_x4(a, qa + lane_xd + 16 * mt * 2 * D + LR_PP(kk));
#pragma unroll
                    for (int n = 0; n < 2; n++) {
                        sp_mma(O[mt][n], a[0], a[1], a[2], a[3], bh[n][0], bh[n][1]);
                        sp_mma(O[mt][n], a[0], a[1], a[2], a[3], bl[n][0], bl[n][1]);
                    }
                }
            }
#pragma unroll
            for (int mt = 0; mt < 4; mt++) {
                const float d0 = pw[min(16 * mt + gq + 1, LF_C)], d1 = pw[min(16 * mt + gq + 9, LF_C)];
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    O[mt][n][0] *= d0;
                    O[mt][n][1] *= d0;
                    O[mt][n][2] *= d1;
                    O[mt][n][3] *= d1;
                }
            }
            __syncthreads();  // A written

            // (c) O += A V over the key tiles at or below each row tile.
#pragma unroll
            for (int jt = 0; jt < 4; jt++) {
                u32 b[4];
                ldsm_x4_t(b, va + lane_xd + 16 * jt * 2 * D + vcol);
#pragma unroll
                for (int mt = jt; mt < 4; mt++) {
                    u32 ah[4], al[4];
                    const u32 at = lane_xa + 16 * mt * 2 * LF_C + LR_PP(jt);
                    ldsm_x4(ah, aha + at);
                    ldsm_x4(al, ala + at);
                    sp_mma(O[mt][0], ah[0], ah[1], ah[2], ah[3], b[0], b[1]);
                    sp_mma(O[mt][0], al[0], al[1], al[2], al[3], b[0], b[1]);
                    sp_mma(O[mt][1], ah[0], ah[1], ah[2], ah[3], b[2], b[3]);
                    sp_mma(O[mt][1], al[0], al[1], al[2], al[3], b[2], b[3]);
                }
            }
#pragma unroll
            for (int mt = 0; mt < 4; mt++)
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const int i = 16 * mt + gq + 8 * rr;
                    if (i < len) {
                        bf16* op = out + (size_t)(j0 + i) * qw + v0 + 2 * tq;
#pragma unroll
                        for (int n = 0; n < 2; n++)
                            *(u32*)(op + 8 * n) = sp_pack_bf16(scale * O[mt][n][2 * rr], scale * O[mt][n][2 * rr + 1]);
                    }
                }
        }

        // (d) Sᵀ = γ^len Sᵀ + Vdᵀ K (A = Vdᵀ from the [j][value] tile, scaled and split in
        // registers; B = K from the [j][key] tile, both transposed).
        const float dl = pw[len];
#pragma unroll
        for (int t = 0; t < KT; t++)
#pragma unroll
            for (int x = 0; x < 4; x++) st[t][x] *= dl;
#pragma unroll
        for (int kt = 0; kt < 4; kt++) {
            u32 a[4];
            ldsm_x4_t(a, va + lane_yd + 16 * kt * 2 * D + vcol);
            const int j = 16 * kt + 2 * tq;
            float f[4];
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int jj = j + (y & 1) + 8 * (y >> 1);
                f[y] = jj < len ? pw[max(len - 1 - jj, 0)] : 0.0f;
            }
            u32 ah[4], al[4];
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int fy = 2 * (y >> 1);  // a0, a1: tokens j, j + 1; a2, a3: j + 8, j + 9
                sp_split2(lt_lo(a[y]) * f[fy], lt_hi(a[y]) * f[fy + 1], ah[y], al[y]);
            }
#pragma unroll
            for (int p = 0; p < D / 16; p++) {
                u32 b[4];
                ldsm_x4_t(b, ka + lane_xd + 16 * kt * 2 * D + LR_PP(p));
                sp_mma(st[2 * p], ah[0], ah[1], ah[2], ah[3], b[0], b[1]);
                sp_mma(st[2 * p], al[0], al[1], al[2], al[3], b[0], b[1]);
                sp_mma(st[2 * p + 1], ah[0], ah[1], ah[2], ah[3], b[2], b[3]);
                sp_mma(st[2 * p + 1], al[0], al[1], al[2], al[3], b[2], b[3]);
            }
        }
        if (nb == 1 && c + 1 < n_chunks) {
            __syncthreads();  // every warp is done with the buffer: it takes the next chunk
            lr_issue<D, SUMS>(q, k, v, lr_sm, 0, j0 + LF_C, min(LF_C, T - j0 - LF_C), qw, kvw);
        }
    }
    if (!st_out) return;
#pragma unroll
    for (int t = 0; t < KT; t++)
#pragma unroll
        for (int x = 0; x < 4; x++)
            st_out[(size_t)h * D * D + (size_t)(8 * t + 2 * tq + (x & 1)) * D + v0 + gq + 8 * (x >> 1)] = st[t][x];
}

// q [T, heads·d], k/v [T, kv_heads·d] bf16; state [heads, d, d] fp32 (key-major); out
// [T, heads·d] bf16; slopes [heads] fp32. Needs d 64 or 128, heads % kv_heads == 0, 16-byte
// aligned rows. Without ranges (NULL) one block a head walks all T tokens from `state` and
// leaves the final state there. With ranges, block (h, r) walks tokens [r·range_len, min(T,
// (r + 1)·range_len)) (range_len a multiple of 64) from ranges[r] (the state before range r,
// lightning_range_states), the last range writing `state`.
// launch: grid = (heads, ranges or 1), block = 2·d, dynamic smem = LR_SMEM(d, buffers, 3) bytes
//         (114,960 / 65,808 for d = 128 and 2 / 1 buffers)
extern "C" __global__ void __launch_bounds__(256, 1)
lightning_ranges(const bf16* q, const bf16* k, const bf16* v, float* state, bf16* out, const float* slopes, int T,
                 int heads, int kv_heads, int d, float scale, int range_len, float* ranges, int buffers) {
    pdl_start();
    const int nb = buffers == 1 ? 1 : 2;
    if (d == 128) lr_body<128, false>(q, k, v, state, out, slopes, T, heads, kv_heads, scale, range_len, ranges, nb);
    else lr_body<64, false>(q, k, v, state, out, slopes, T, heads, kv_heads, scale, range_len, ranges, nb);
}

// The ranges' sums: block (h, r) walks range r as lightning_ranges does, step (d) only, from a
// zero state, and leaves ΔS_r in ranges[r] (grid y = ranges − 1: the last range's is not
// needed).
// launch: grid = (heads, ranges − 1), block = 2·d, dynamic smem = LR_SMEM(d, buffers, 2) bytes
//         (65,808 / 33,040 for d = 128 and 2 / 1 buffers)
extern "C" __global__ void __launch_bounds__(256, 2)
lightning_range_sums(const bf16* k, const bf16* v, const float* slopes, int T, int heads, int kv_heads, int d,
                     int range_len, float* ranges, int buffers) {
    pdl_start();
    const int nb = buffers == 1 ? 1 : 2;
    if (d == 128) lr_body<128, true>(0, k, v, 0, 0, slopes, T, heads, kv_heads, 0.0f, range_len, ranges, nb);
    else lr_body<64, true>(0, k, v, 0, 0, slopes, T, heads, kv_heads, 0.0f, range_len, ranges, nb);
}

// Between the two lightning_ranges passes over n_ranges ranges of range_len tokens: ranges[r]
// holds ΔS_r (r < n_ranges − 1) and becomes S_r, the state before range r: S_0 = state,
// S_{r+1} = γ^range_len S_r + ΔS_r (γ = exp(−slopes[h]), element-wise in fp32). The ΔS of 16
// ranges load at once (a store to a slot and the next slot's load would otherwise serialize).
// launch: grid = ⌈heads·d·d / 256⌉, block = 256
extern "C" __global__ void lightning_range_states(const float* state, float* ranges, const float* slopes, int heads,
                                                  int d, int n_ranges, int range_len) {
    pdl_start();
    const size_t n = (size_t)heads * d * d, x = (size_t)blockIdx.x * 256 + threadIdx.x;
    if (x >= n) return;
    const float decay = lc_pow(-slopes[x / ((size_t)d * d)], range_len);
    float cur = state[x];
    for (int r0 = 0; r0 < n_ranges; r0 += 16) {
        float ds[16];
#pragma unroll
        for (int i = 0; i < 16; i++) ds[i] = r0 + i + 1 < n_ranges ? ranges[(size_t)(r0 + i) * n + x] : 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++)
            if (r0 + i < n_ranges) {
                ranges[(size_t)(r0 + i) * n + x] = cur;
                cur = decay * cur + ds[i];
            }
    }
}
