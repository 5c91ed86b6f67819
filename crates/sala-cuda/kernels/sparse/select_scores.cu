// Stage 1 of block selection on tensor cores (prefill): the score of every candidate block, for
// select_topk_scores or sd_topk_scores to take the top k from.
//
// The same scores as sparse_select up to float rounding (bf16 MMAs with fp32 accumulation, exp2
// instead of correctly rounded exp), so a near-tie may select a different block of (almost) the
// same score; sparse_select stays the bit-exact twin of the CPU. A warp owns one query token: its
// 16 MMA rows are the token's query heads of one KV group (rows ≥ heads/kv_heads are padding).
// The block's SQ_WARPS consecutive tokens share every compressed-key tile staged in shared memory.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "sparse/common.cuh"

#define SQ_WARPS 8
#define SQ_KC 64  // compressed keys per staged tile

// Stages keys [c0, c0 + n) of KV group g of a compressed tier (rows ≥ n zero-filled), cp.async.
__device__ __forceinline__ void sq_issue(const bf16* src, size_t kvw, int g, int d, bf16* dst, int ld, int c0,
                                         int n) {
    const int segs = d / 8;
    for (int x = threadIdx.x; x < SQ_KC * segs; x += SQ_WARPS * 32) {
        const int row = x / segs, sg = x % segs;
        const bool in = row < n;
        const bf16* s = in ? src + (size_t)(c0 + row) * kvw + (size_t)g * d + sg * 8 : src;
        sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
    }
    sp_cp_commit();
}

#define SQ_TW 2  // query tokens per warp (MMA row tiles)

// A block-score kernel's view of its tokens: for token m of the warp (query i = blockIdx.x·16 +
// SQ_TW·warp + m at position tt[m], block qb; past the chunk's end, its last query's position),
// whether it selects at all (act: i < T and qb ≥ k_sel), its candidate blocks [init_blocks,
// cand_hi) (none if inactive) and visible level-2 windows n2v; for the warp, the largest
// cand_hi (cand_max); for the block, how many level-1 / level-2 windows its last token needs
// (the loops grow with t). w: level-1 windows per block.
struct SqTokens {
    int tt[SQ_TW], cand_hi[SQ_TW], n2v[SQ_TW];
    bool act[SQ_TW];
    bool any;
    int cand_max, n1_all, n2_all;
};

__device__ __forceinline__ SqTokens sq_tokens(int T, int first_pos, int n1, int n2, int block_size, int w,
                                              int k2_window, int k2_stride, int local_blocks, int k_sel) {
    const int warp = threadIdx.x >> 5, per_block = SQ_WARPS * SQ_TW;
    SqTokens tk;
    tk.any = false;
    tk.cand_max = 0;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++) {
        const int i = blockIdx.x * per_block + SQ_TW * warp + m;
        tk.tt[m] = first_pos + min(i, T - 1);
        const int qb = tk.tt[m] / block_size;
        tk.act[m] = i < T && qb >= k_sel;
        tk.any |= tk.act[m];
        tk.cand_hi[m] = tk.act[m] ? max(qb - local_blocks, 0) : 0;
        tk.cand_max = max(tk.cand_max, tk.cand_hi[m]);
        tk.n2v[m] = min(sp_visible(tk.tt[m], k2_window, k2_stride), n2);
    }
    const int t_last = first_pos + min((int)(blockIdx.x + 1) * per_block, T) - 1;
    const int qb_last = t_last / block_size;
    tk.n2_all = min(sp_visible(t_last, k2_window, k2_stride), n2);
    tk.n1_all = (qb_last >= k_sel) ? min(w * max(qb_last - local_blocks, 0), n1) : 0;
    return tk;
}

// Walks keys [0, n) of KV group g of a compressed tier in staged tiles of SQ_KC (double-buffered,
// cp.async): body(tile, c0) runs with keys c0 .. c0 + SQ_KC − 1 in shared memory (rows ≥ n zero)
// between two block barriers. Every thread calls.
template <class Body>
__device__ __forceinline__ void sq_walk(const bf16* src, size_t kvw, int g, int d, bf16* smem, int ld, int n,
                                        Body&& body) {
    int buf = 0;
    sq_issue(src, kvw, g, d, smem, ld, 0, min(SQ_KC, n));
    for (int c0 = 0; c0 < n; c0 += SQ_KC) {
        const int nxt = c0 + SQ_KC;
        if (nxt < n) sq_issue(src, kvw, g, d, smem + (buf ^ 1) * SQ_KC * ld, ld, nxt, min(SQ_KC, n - nxt));
        else sp_cp_commit();
        sp_cp_wait1();
        __syncthreads();
        body(smem + buf * SQ_KC * ld, c0);
        __syncthreads();  // buffer `buf` free
        buf ^= 1;
    }
    sp_cp_wait0();
}

// S[m] = Q_m Kᵀ for the warp's SQ_TW row tiles and the 32 staged keys [32·half, 32·half + 32)
// (4 n-tiles); each B fragment is loaded once for both row tiles.
__device__ __forceinline__ void sq_qk(float (&S)[SQ_TW][4][4], const u32 (&qa)[SQ_TW][8][4], const bf16* Ks,
                                      int ld, int d, int half) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) S[m][nt][x] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            if (kk * 16 < d) {
                const bf16* kr = Ks + (32 * half + nt * 8 + gq) * ld + kk * 16 + 2 * tq;
                const u32 b0 = *(const u32*)kr, b1 = *(const u32*)(kr + 8);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++)
                    sp_mma(S[m][nt], qa[m][kk][0], qa[m][kk][1], qa[m][kk][2], qa[m][kk][3], b0, b1);
            }
        }
    }
}

// Sum over the warp's 16 rows of v[j] (j = 2·nt + c: column 8nt + 2tq + c, each thread holding
// rows gq and gq + 8 already added), as a butterfly over the lane bits of gq: 7 shuffles. The
// lane ends with the total of column 8·(gq >> 1) + 2tq + (gq & 1).
__device__ __forceinline__ float sq_row_sum(float (&v)[8]) {
    const int gq = (threadIdx.x & 31) >> 2;
    const bool b2 = gq & 4, b1 = gq & 2, b0 = gq & 1;
    float u[4], w[2];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float send = b2 ? v[j] : v[j + 4];
        u[j] = (b2 ? v[j + 4] : v[j]) + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const float send = b1 ? u[j] : u[j + 2];
        w[j] = (b1 ? u[j + 2] : u[j]) + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    const float send = b0 ? w[0] : w[1];
    return (b0 ? w[1] : w[0]) + __shfl_xor_sync(0xffffffffu, send, 4);
}

// For query i = blockIdx.x·SQ_WARPS·SQ_TW + SQ_TW·warp + m (m < SQ_TW; position t = first_pos + i,
// block qb = t / block_size) and KV group g = blockIdx.y, with qb ≥ k_sel: the score of every
// candidate block b ∈ [init_blocks, qb − local_blocks), max of P over its level-1 windows
// [w·b − 1, w·b + w − 1] (w = block_size / k1_stride), into bs[(i·kv_heads + g)·bs_stride + b]
// as bf16 bits. P is the stage-1 probability (SPEC §5.4): Σ over the group's heads of
// exp(s·q·K1 − LSE₂), rounded to bf16. Needs heads / kv_heads ≤ 16, d a multiple of 16 and
// ≤ 128, 64 a multiple of w.
// launch: grid = ((T + 15) / 16, kv_heads), block = 32·SQ_WARPS, dynamic smem = 0 bytes
//   (static shared memory 2·64·136·2 + 16·65·4 = 38,976 bytes)
extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32)
select_scores_mma(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos, int heads,
                  int kv_heads, int d, float scale, int block_size, int k1_stride, int k2_window, int k2_stride,
                  int init_blocks, int local_blocks, int k_sel, u16* bs, int bs_stride) {
    pdl_start();
    __shared__ __align__(16) bf16 sq_kv[2 * SQ_KC * AT_MAXLD];
    __shared__ float sq_p[SQ_WARPS * SQ_TW][SQ_KC + 1];
    const int G = heads / kv_heads, g = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int w = block_size / k1_stride;
    const size_t kvw = (size_t)kv_heads * d;
    const int ld = d + 8;
    const float NEG = -__int_as_float(0x7f800000);
    const int per_block = SQ_WARPS * SQ_TW;

    const SqTokens tk = sq_tokens(T, first_pos, n1, n2, block_size, w, k2_window, k2_stride, local_blocks, k_sel);
    const int (&tt)[SQ_TW] = tk.tt, (&cand_hi)[SQ_TW] = tk.cand_hi, (&n2v)[SQ_TW] = tk.n2v;
    const bool(&act)[SQ_TW] = tk.act;
    const bool any = tk.any;
    if (tk.n1_all == 0 || tk.n2_all == 0) return;  // block-uniform

    u32 qa[SQ_TW][8][4];
    bool row_ok[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) row_ok[m][r] = act[m] && gq + 8 * r < G;
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int kk = 0; kk < 8; kk++)
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int r = x & 1, c8 = (x >> 1) * 8;
                u32 v = 0;
                if (kk * 16 < d && row_ok[m][r])
                    v = *(const u32*)(q + (size_t)(tt[m] - first_pos) * heads * d +
                                      (size_t)(g * G + gq + 8 * r) * d + kk * 16 + c8 + 2 * tq);
                qa[m][kk][x] = v;
            }
    const float sl2 = scale * 1.4426950408889634f;
    float S[SQ_TW][4][4];

    // Pass 1: LSE₂ of each row over the visible level-2 keys (online, log2 units).
    float mrow[SQ_TW][2], lrow[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mrow[m][r] = NEG;
            lrow[m][r] = 0.0f;
        }
    sq_walk(k2, kvw, g, d, sq_kv, ld, tk.n2_all, [&](const bf16* tile, int c0) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            if (any && c0 + 32 * half < n2v[SQ_TW - 1]) {
                sq_qk(S, qa, tile, ld, d, half);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++) {
                    float mx[2] = {NEG, NEG};
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int x = 0; x < 4; x++) {
                            const int col = c0 + 32 * half + nt * 8 + 2 * tq + (x & 1);
                            const float sv = (col < n2v[m]) ? S[m][nt][x] * sl2 : NEG;
                            S[m][nt][x] = sv;
                            mx[x >> 1] = fmaxf(mx[x >> 1], sv);
                        }
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                        const float mn = fmaxf(mrow[m][r], mx[r]);
                        const float mu = (mn == NEG) ? 0.0f : mn;
                        lrow[m][r] *= exp2f(mrow[m][r] - mu);
                        mrow[m][r] = mn;
                    }
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int x = 0; x < 4; x++) {
                            const float mu = (mrow[m][x >> 1] == NEG) ? 0.0f : mrow[m][x >> 1];
                            lrow[m][x >> 1] += exp2f(S[m][nt][x] - mu);
                        }
                }
            }
        }
    });
    float lse[SQ_TW][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float l = lrow[m][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            // Padding rows and inactive tokens get +inf, so their probabilities are 0.
            lse[m][r] = row_ok[m][r] ? mrow[m][r] + __log2f(l) : __int_as_float(0x7f800000);
        }

    // Pass 2: P of each level-1 window (sum over the rows), max-pooled into block scores.
    // pw[m][0]: the previous tile's last window; pw[m][1 + x]: window c0 + x.
    float* pw0 = sq_p[SQ_TW * warp];
    if (lane < SQ_TW) pw0[lane * (SQ_KC + 1)] = NEG;
    __syncthreads();
    sq_walk(k1, kvw, g, d, sq_kv, ld, tk.n1_all, [&](const bf16* tile, int c0) {
        if (any && c0 < w * tk.cand_max) {
#pragma unroll
            for (int half = 0; half < 2; half++) {
                sq_qk(S, qa, tile, ld, d, half);
#pragma unroll
                for (int m = 0; m < SQ_TW; m++) {
                    float v[8];
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int c = 0; c < 2; c++)
                            v[2 * nt + c] = exp2f(S[m][nt][c] * sl2 - lse[m][0]) +
                                            exp2f(S[m][nt][2 + c] * sl2 - lse[m][1]);
                    const float r = round_bf(sq_row_sum(v));
                    const int col = 8 * (gq >> 1) + 2 * tq + (gq & 1);
                    pw0[m * (SQ_KC + 1) + 1 + 32 * half + col] = (r != r) ? 0.0f : r;
                }
            }
            __syncwarp();
            const int b0 = c0 / w, nbt = SQ_KC / w;
            for (int x = lane; x < SQ_TW * nbt; x += 32) {
                const int m = x / nbt, bl = x % nbt;
                const int b = b0 + bl;
                int ch = cand_hi[0];
#pragma unroll
                for (int mm = 1; mm < SQ_TW; mm++)
                    if (mm == m) ch = cand_hi[mm];
                if (b >= init_blocks && b < ch) {
                    const float* pm = pw0 + m * (SQ_KC + 1);
                    float mx = NEG;
                    for (int y = w * bl; y <= w * bl + w; y++) mx = fmaxf(mx, pm[y]);
                    const int i = blockIdx.x * per_block + SQ_TW * warp + m;
                    bs[((size_t)i * kv_heads + g) * bs_stride + b] = (u16)(__float_as_uint(mx) >> 16);
                }
            }
            __syncwarp();
            if (lane < SQ_TW) pw0[lane * (SQ_KC + 1)] = pw0[lane * (SQ_KC + 1) + SQ_KC];
            __syncwarp();
        }
    });
}

// Block scores for prefill selection with the compressed keys as the MMA rows: S^T = K Qᵀ, so
// each thread holds a few heads of a window and the group's head sum is a few adds and two
// shuffles (select_scores_mma puts the heads in the rows and needs a 7-shuffle butterfly per 8
// windows). Same arguments, outputs and scores (up to float rounding) as select_scores_mma;
// needs 4 level-1 windows per block (block_size = 4·k1_stride), at most 16 query heads per KV
// group and d a multiple of 16, at most 128.
//
// A block owns 16 consecutive tokens (8 warps of 2) of one KV group; every staged 64-key tile
// of a compressed tier serves all of them. Per warp and 16-key m-tile, the accumulators of
// token m hold S^T[key gq (+8)][head 8nt + 2tq (+1)], nt = 0, 1.

// acc[j][m] = S^T of m-tiles 2·mp + j (keys 32·mp + 16j ..) of the staged tile for token m.
__device__ __forceinline__ void st_qk(float (&acc)[2][SQ_TW][2][4], const u32 (&qb)[SQ_TW][2][8][2], const bf16* tile,
                                      int ld, int d, int mp) {
    const int lane = threadIdx.x & 31, r8 = lane & 7, m8 = lane >> 3;
    // This lane's ldmatrix row address (bytes, shared window) for m-tile 2·mp, k-step 0.
    const u32 base = sp_smem_addr(tile + (32 * mp + r8 + 8 * (m8 & 1)) * ld + 8 * (m8 >> 1));
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int m = 0; m < SQ_TW; m++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int x = 0; x < 4; x++) acc[j][m][nt][x] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        if (kk * 16 < d) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                u32 a[4];
                ldsm_x4(a, base + 2 * (16 * j * ld + 16 * kk));
#pragma unroll
                for (int m = 0; m < SQ_TW; m++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++)
                        sp_mma(acc[j][m][nt], a[0], a[1], a[2], a[3], qb[m][nt][kk][0], qb[m][nt][kk][1]);
            }
        }
    }
}

// launch: grid = ((T + 15) / 16, kv_heads), block = 256, dynamic smem = 0 bytes
//   (static shared memory 2·64·136·2 = 34,816 bytes). At most 128 registers, so that two blocks
//   share an SM: 259 ms against 340 ms with one block (160 registers) at 128K on the H200.
extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32, 2)
select_scores_t(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos, int heads,
                int kv_heads, int d, float scale, int block_size, int k1_stride, int k2_window, int k2_stride,
                int init_blocks, int local_blocks, int k_sel, u16* bs, int bs_stride) {
    pdl_start();
    __shared__ __align__(16) bf16 st_kv[2 * SQ_KC * AT_MAXLD];
    const int G = heads / kv_heads, g = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const size_t kvw = (size_t)kv_heads * d;
    const int ld = d + 8;
    const float NEG = -__int_as_float(0x7f800000), INF = __int_as_float(0x7f800000);
    const int per_block = SQ_WARPS * SQ_TW;

    const SqTokens tk = sq_tokens(T, first_pos, n1, n2, block_size, 4, k2_window, k2_stride, local_blocks, k_sel);
    const int (&tt)[SQ_TW] = tk.tt, (&cand_hi)[SQ_TW] = tk.cand_hi, (&n2v)[SQ_TW] = tk.n2v;
    const bool(&act)[SQ_TW] = tk.act;
    const bool any = tk.any;
    if (tk.n1_all == 0 || tk.n2_all == 0) return;  // block-uniform

    // Qᵀ as B fragments: head 8nt + gq, dims 16kk + 2tq (+1) and 16kk + 8 + 2tq (+1).
    u32 qb[SQ_TW][2][8][2];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const int hd = 8 * nt + gq;
            const bool ok = act[m] && hd < G;
            const bf16* qr = q + (size_t)(tt[m] - first_pos) * heads * d + (size_t)(g * G + min(hd, G - 1)) * d;
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
#pragma unroll
                for (int y = 0; y < 2; y++)
                    qb[m][nt][kk][y] = (ok && kk * 16 < d) ? *(const u32*)(qr + 16 * kk + 8 * y + 2 * tq) : 0u;
        }
    const float sl2 = scale * 1.4426950408889634f;
    float acc[2][SQ_TW][2][4];

    // Pass 1: per head (column 2·nt + c of this thread: head 8nt + 2tq + c), the online max and
    // sum of exp2 over this lane's visible level-2 keys, merged across lanes at the end.
    float mrow[SQ_TW][4], lrow[SQ_TW][4];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            mrow[m][h] = NEG;
            lrow[m][h] = 0.0f;
        }
    sq_walk(k2, kvw, g, d, st_kv, ld, tk.n2_all, [&](const bf16* tile, int c0) {
#pragma unroll
        for (int mp = 0; mp < 2; mp++) {
            if (__any_sync(0xffffffffu, any && c0 + 32 * mp < n2v[SQ_TW - 1])) {
                st_qk(acc, qb, tile, ld, d, mp);
                // Keys ≥ n2v[m] are masked, unless the 32 keys are all visible to token m.
                auto update = [&](int m, bool masked) {
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        const int nt = h >> 1, c = h & 1;
                        float x[4];
                        float mx = mrow[m][h];
#pragma unroll
                        for (int y = 0; y < 4; y++) {
                            const int key = c0 + 32 * mp + 16 * (y >> 1) + gq + 8 * (y & 1);
                            const float s = acc[y >> 1][m][nt][2 * (y & 1) + c] * sl2;
                            x[y] = (!masked || key < n2v[m]) ? s : NEG;
                            mx = fmaxf(mx, x[y]);
                        }
                        const float mu = (mx == NEG) ? 0.0f : mx;
                        float l = lrow[m][h] * st_ex2(mrow[m][h] - mu);
#pragma unroll
                        for (int y = 0; y < 4; y++) l += st_ex2(x[y] - mu);
                        lrow[m][h] = l;
                        mrow[m][h] = mx;
                    }
                };
#pragma unroll
                for (int m = 0; m < SQ_TW; m++) {
                    if (c0 + 32 * mp + 32 <= n2v[m]) update(m, false);  // inlined: no masking code
                    else update(m, true);
                }
            }
        }
    });
    float lse[SQ_TW][4];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            float mx = mrow[m][h], l = lrow[m][h];
            st_merge_rows(mx, l);
            const int hd = 8 * (h >> 1) + 2 * tq + (h & 1);
            // Padding heads and inactive tokens get +inf, so their probabilities are 0.
            lse[m][h] = (act[m] && hd < G) ? mx + __log2f(l) : INF;
        }

    // Pass 2: P of each level-1 key (sum over the heads), max-pooled into block scores: block b
    // takes keys 4b − 1 .. 4b + 3. carry[m]: the bf16 bits of P of the previous m-tile's last
    // key (0 before the first: P ≥ 0, so it changes no maximum).
    u32 carry[SQ_TW];
#pragma unroll
    for (int m = 0; m < SQ_TW; m++) carry[m] = 0u;
    sq_walk(k1, kvw, g, d, st_kv, ld, tk.n1_all, [&](const bf16* tile, int c0) {
        if (__any_sync(0xffffffffu, any && c0 < 4 * tk.cand_max)) {  // a vote: uniform, so shuffles need no reconvergence
#pragma unroll
            for (int mp = 0; mp < 2; mp++) {
                st_qk(acc, qb, tile, ld, d, mp);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int m = 0; m < SQ_TW; m++) {
                        // P of keys gq (low half) and gq + 8 (high half) of the m-tile, rounded
                        // to bf16 (NaN → 0): P ≥ 0, so the bits order as the values.
                        float sum[2];
#pragma unroll
                        for (int r = 0; r < 2; r++) {
                            float x = 0.0f;
#pragma unroll
                            for (int h = 0; h < 4; h++)
                                x += st_ex2(acc[j][m][h >> 1][2 * r + (h & 1)] * sl2 - lse[m][h]);
                            x += __shfl_xor_sync(0xffffffffu, x, 1);
                            sum[r] = x + __shfl_xor_sync(0xffffffffu, x, 2);
                        }
                        const u32 pv = st_max2(sp_pack_bf16(sum[0], sum[1]), 0u);
                        // Maxima of keys 4c .. 4c + 3 (low) and 8 + 4c .. (high), c = gq / 4.
                        u32 a = st_max2(pv, __shfl_xor_sync(0xffffffffu, pv, 4));
                        a = st_max2(a, __shfl_xor_sync(0xffffffffu, a, 8));
                        const u32 g0 = __shfl_sync(0xffffffffu, a, 0);    // keys 0-3 | 8-11
                        const u32 g1 = __shfl_sync(0xffffffffu, a, 16);   // keys 4-7 | 12-15
                        const u32 p3 = __shfl_sync(0xffffffffu, pv, 12);  // keys 3 | 11
                        const u32 p7 = __shfl_sync(0xffffffffu, pv, 28);  // keys 7 | 15
                        // Lane L < 4: the block of keys 4L .. 4L + 3 and the key before it.
                        const u32 own = (((lane & 1) ? g1 : g0) >> ((lane & 2) ? 16 : 0)) & 0xffffu;
                        const u32 prev = (lane == 0 ? carry[m] : lane == 1 ? p3 : lane == 2 ? p7 : p3 >> 16) & 0xffffu;
                        const u32 sc = max(own, prev);
                        carry[m] = p7 >> 16;
                        const int blk = (c0 + 32 * mp + 16 * j) / 4 + lane;
                        if (lane < 4 && blk >= init_blocks && blk < cand_hi[m]) {
                            const int i = blockIdx.x * per_block + SQ_TW * warp + m;
                            bs[((size_t)i * kv_heads + g) * bs_stride + blk] = (u16)sc;
                        }
                    }
            }
        }
    });
}
