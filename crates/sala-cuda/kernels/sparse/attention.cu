// Softmax attention of the sparse layers over all keys (dense) or the selected blocks (sparse):
// attention (attention_split + attention_merge for few rows) on tiles of 64 rows,
// attention_prefill (a block walks the union of its queries' selected blocks), and
// attention_gather / attention_decode (warps walk one (query, KV group)'s blocks, reading K and V
// from global memory). Layouts in sparse/common.cuh.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/rows.cuh"
#include "sparse/common.cuh"

// ============================================================================================
// attention: causal softmax attention over all keys ≤ t, or over the selected blocks
// ============================================================================================
//
// Rows: for KV group g, row R = i·G + hh (query i, head g·G + hh), R ∈ [0, T·G). A block owns
// 64 consecutive rows (fewer if the host launches more blocks than ⌈T·G/64⌉; see below), a tile
// that spans ≤ 64 queries, so every K/V chunk staged in shared memory serves all heads of the
// group and several queries. Keys are walked in chunks of
// ≤ 64 (dense: 0..t_max; sparse: the union over the tile's queries of their selected blocks, in
// ascending order, each row masked to its own query's blocks and to j ≤ t). Each warp computes 16
// rows with bf16 tensor-core MMAs (mma.sync m16n8k16, fp32 accumulation): S = Q Kᵀ exactly (bf16
// inputs), online softmax in fp32, O += P V with P split into bf16 hi + lo parts (two MMAs), so P
// keeps ~16 bits and the result is fp32-accurate. When the tile has few rows (decode: T·G ≤ 32),
// the warps split each chunk's keys instead (2 or 4 ways) and merge their partial softmax states
// at the end. K and V chunks are fetched with cp.async: K of the next chunk overlaps this chunk's
// P·V, V of the next chunk overlaps the next Q·Kᵀ.
//
// Split-K (attention_split + attention_merge, for decode and other small T): block z of gridDim.z
// takes every gridDim.z-th chunk of the same walk and writes its unnormalised partial state.

#define AT_THREADS 128
#define AT_ROWS 64
#define AT_KC 64            // keys per chunk
#define AT_INF 0x7fffffff

// The bf16 A fragment of keys 16·ks .. 16·ks + 15 of P, held as S (n-tiles 2·ks and 2·ks + 1
// of an m16n8 accumulator), for P·V.
template <int NT>
__device__ __forceinline__ void sp_p_frag(const float (&S)[NT][4], int ks, u32& a0, u32& a1, u32& a2, u32& a3) {
    a0 = sp_pack_bf16(S[2 * ks][0], S[2 * ks][1]);
    a1 = sp_pack_bf16(S[2 * ks][2], S[2 * ks][3]);
    a2 = sp_pack_bf16(S[2 * ks + 1][0], S[2 * ks + 1][1]);
    a3 = sp_pack_bf16(S[2 * ks + 1][2], S[2 * ks + 1][3]);
}

// Per-thread softmax state of one warp's 16 rows: this thread holds rows gq and gq + 8.
struct SpRows {
    float m[2], l[2];  // running max (log2 units) and this thread's share of the row sum
    int t[2];          // positions (−1: not a row of the problem)
    bool sel[2];       // the row's query selected the current chunk's block (always true when dense)
};

// Part 1 of a chunk for one warp: S = Q Kᵀ over the warp's KS keys [kb, kb + KS) of the chunk,
// masked and exponentiated in place (S becomes P), running max / sum updated, O rescaled.
template <int KS>
__device__ __forceinline__ void sp_attn_qk(float (&S)[KS / 8][4], const u32 (&qa)[8][4], float (&O)[16][4],
                                           SpRows& rs, const bf16* Ks, int ld, int d, int kb, int k0,
                                           int klen, float sl2) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) S[nt][x] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        if (kk * 16 < d) {
#pragma unroll
            for (int nt = 0; nt < KS / 8; nt++) {
                // B fragment (Kᵀ, "col"): b0 = K[key gq][2tq, 2tq+1], b1 = K[key gq][2tq+8, +9].
                const bf16* kr = Ks + (kb + nt * 8 + gq) * ld + kk * 16 + 2 * tq;
                const u32 b0 = *(const u32*)kr, b1 = *(const u32*)(kr + 8);
                sp_mma(S[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
    }
    const float NEG = -__int_as_float(0x7f800000);
    float mx[2] = {NEG, NEG};
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x >> 1;
            const int col = kb + nt * 8 + 2 * tq + (x & 1);
            const bool ok = rs.sel[r] && col < klen && k0 + col <= rs.t[r];
            const float s = ok ? S[nt][x] * sl2 : NEG;
            S[nt][x] = s;
            mx[r] = fmaxf(mx[r], s);
        }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    float mu[2], alpha[2], rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const float mn = fmaxf(rs.m[r], mx[r]);
        mu[r] = (mn == NEG) ? 0.0f : mn;  // a row with nothing yet: exp2(−inf − 0) = 0
        alpha[r] = exp2f(rs.m[r] - mu[r]);
        rs.m[r] = mn;
    }
#pragma unroll
    for (int nt = 0; nt < KS / 8; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float p = exp2f(S[nt][x] - mu[x >> 1]);
            S[nt][x] = p;
            rsum[x >> 1] += p;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) rs.l[r] = rs.l[r] * alpha[r] + rsum[r];
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        O[nt][0] *= alpha[0];
        O[nt][1] *= alpha[0];
        O[nt][2] *= alpha[1];
        O[nt][3] *= alpha[1];
    }
}

// Part 2: O += P V over the warp's keys [kb, kb + KS).
template <int KS>
__device__ __forceinline__ void sp_attn_pv(const float (&S)[KS / 8][4], float (&O)[16][4], const bf16* Vs,
                                           int ld, int d, int kb) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < KS / 16; ks++) {
        // A fragments (P, row-major 16×16) straight from the S accumulators, hi and lo parts.
        u32 h0, h1, h2, h3, l0, l1, l2, l3;
        sp_split2(S[2 * ks][0], S[2 * ks][1], h0, l0);          // row gq,     keys 2tq, 2tq+1
        sp_split2(S[2 * ks][2], S[2 * ks][3], h1, l1);          // row gq + 8, keys 2tq, 2tq+1
        sp_split2(S[2 * ks + 1][0], S[2 * ks + 1][1], h2, l2);  // row gq,     keys 2tq+8, +9
        sp_split2(S[2 * ks + 1][2], S[2 * ks + 1][3], h3, l3);  // row gq + 8, keys 2tq+8, +9
        const bf16* v0 = Vs + (kb + ks * 16 + 2 * tq) * ld + 2 * gq;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            if (m * 16 < d) {
                // Keys 2tq, 2tq+1 (+8, +9) at dims 16m + 2gq, +1: one word per key, then
                // byte-permute into the B fragments of tiles 2m (even dims) and 2m+1 (odd dims).
                const bf16* vp = v0 + 16 * m;
                const u32 x0 = *(const u32*)vp, x1 = *(const u32*)(vp + ld);
                const u32 y0 = *(const u32*)(vp + 8 * ld), y1 = *(const u32*)(vp + 9 * ld);
                const u32 be0 = __byte_perm(x0, x1, 0x5410), bo0 = __byte_perm(x0, x1, 0x7632);
                const u32 be1 = __byte_perm(y0, y1, 0x5410), bo1 = __byte_perm(y0, y1, 0x7632);
                sp_mma(O[2 * m], h0, h1, h2, h3, be0, be1);
                sp_mma(O[2 * m], l0, l1, l2, l3, be0, be1);
                sp_mma(O[2 * m + 1], h0, h1, h2, h3, bo0, bo1);
                sp_mma(O[2 * m + 1], l0, l1, l2, l3, bo0, bo1);
            }
        }
    }
}

// The whole attention of one block: tile blockIdx.x of the rows of KV group blockIdx.y, chunks
// z, z + n_split, ... of the walk. n_split == 1: writes `out`; else the partial state to `part`.
__device__ __forceinline__ void sp_attention_body(const bf16* q, const bf16* kcache, const bf16* vcache,
                                                  bf16* out, float* part, int T, int first_pos, int heads,
                                                  int kv_heads, int d, float scale, const int* blocks,
                                                  int k_sel, int block_size, int z, int n_split) {
    __shared__ __align__(16) bf16 at_kv[2 * AT_KC * AT_MAXLD];
    __shared__ float at_red_m[4 * AT_ROWS];
    __shared__ float at_red_l[4 * AT_ROWS];
    __shared__ int at_val[AT_ROWS];    // sparse: head of each query's block list (AT_INF: exhausted)
    __shared__ int at_desc[3];         // next chunk: k0, klen (0: none), block id

    const int G = heads / kv_heads;
    const int g = blockIdx.y;
    // Rows per block: as many as the grid implies (a multiple of 16, at most 64), so the host may
    // launch ⌈T·G/64⌉ (dense, default), ⌈T·G/32⌉ or ⌈T·G/16⌉ blocks (fewer queries per block).
    const int per = (T * G + gridDim.x - 1) / gridDim.x;
    const int rows_pb = min(AT_ROWS, (per + 15) & ~15);
    const int R0 = blockIdx.x * rows_pb;
    if (R0 >= T * G) return;
    const int nrows = min(rows_pb, T * G - R0);
    const int qfirst = R0 / G;
    const int qlast = (R0 + nrows - 1) / G;
    const int nq = qlast - qfirst + 1;  // ≤ 64
    const int t_max = first_pos + qlast;
    const bool sparse = blocks != 0;
    const int ld = d + 8;
    bf16* Ks = at_kv;
    bf16* Vs = at_kv + AT_KC * ld;
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gq = lane >> 2, tq = lane & 3;
    // Work split: few rows → the warps share rows and split each chunk's keys.
    const int KW = (nrows <= 16) ? 4 : (nrows <= 32) ? 2 : 1;
    const int RW = 4 / KW;
    const int rg = warp % RW, kw = warp / RW;
    const int KS = AT_KC / KW;
    const int kb = kw * KS;

    // This thread's two rows.
    SpRows rs;
    int rq[2], rh[2];
    const float NEG = -__int_as_float(0x7f800000);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;  // row within the tile
        const int R = R0 + rl;
        const bool valid = rl < nrows;
        rq[r] = valid ? R / G : qfirst;
        rh[r] = valid ? R % G : 0;
        rs.t[r] = valid ? first_pos + rq[r] : -1;
        rs.m[r] = NEG;
        rs.l[r] = 0.0f;
        rs.sel[r] = valid;
    }
    // Largest position among the warp's rows (−1: the warp has none).
    const int wl = min(16 * rg + 15, nrows - 1);
    const int warp_tmax = (16 * rg < nrows) ? first_pos + (R0 + wl) / G : -1;

    // Q fragments (A operand): a0 = (row gq, cols 2tq..), a1 = (row gq+8, ..), a2/a3 = cols + 8.
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            u32 v = 0;
            if (kk * 16 < d && rs.t[r] >= 0)
                v = *(const u32*)(q + (size_t)rq[r] * qw + (size_t)(g * G + rh[r]) * d + kk * 16 + c8 + 2 * tq);
            qa[kk][x] = v;
        }
    }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;

    // ---- chunk walk (run by warp 0; its state is in warp-uniform registers) ----
    int cur_b = -1, cur_off = 0, chunk_idx = 0;
    const int* blk = blocks + (size_t)g * k_sel;  // list of query i: blk + i*kv_heads*k_sel
    const size_t bstride = (size_t)kv_heads * k_sel;
    int ptr0 = 0, ptr1 = 0;  // warp 0: list positions of queries lane, lane + 32
    if (sparse && warp == 0) {
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int qq = lane + 32 * x;
            if (qq < nq) {
                const int v = blk[(size_t)(qfirst + qq) * bstride];
                at_val[qq] = (v < 0) ? AT_INF : v;
            }
        }
        __syncwarp();
    }
    // The next chunk of the walk → (k0, klen, b); klen == 0 at the end.
    auto walk = [&](int& k0, int& klen, int& b) {
        if (!sparse) {
            k0 = chunk_idx * AT_KC;
            klen = (k0 <= t_max) ? min(AT_KC, t_max + 1 - k0) : 0;
            b = -1;
            return;
        }
        if (cur_b >= 0) {
            const int bend = min((cur_b + 1) * block_size, t_max + 1);
            k0 = cur_b * block_size + cur_off;
            if (k0 < bend) {  // the next piece of a block longer than 64 keys
                cur_off += AT_KC;
                klen = min(AT_KC, bend - k0);
                b = cur_b;
                return;
            }
            // Pop cur_b from every list it heads.
#pragma unroll
            for (int x = 0; x < 2; x++) {
                const int qq = lane + 32 * x;
                if (qq < nq && at_val[qq] == cur_b) {
                    int& p = x ? ptr1 : ptr0;
                    p++;
                    const int v = (p < k_sel) ? blk[(size_t)(qfirst + qq) * bstride + p] : -1;
                    at_val[qq] = (v < 0) ? AT_INF : v;
                }
            }
        }
        int mn = AT_INF;
#pragma unroll
        for (int x = 0; x < 2; x++) {
            const int qq = lane + 32 * x;
            if (qq < nq) mn = min(mn, at_val[qq]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mn = min(mn, __shfl_xor_sync(0xffffffffu, mn, o));
        if (mn == AT_INF) {
            cur_b = -1;
            k0 = 0;
            klen = 0;
            b = -1;
            return;
        }
        cur_b = mn;
        k0 = cur_b * block_size;
        klen = max(0, min(AT_KC, min((cur_b + 1) * block_size, t_max + 1) - k0));
        cur_off = AT_KC;
        b = cur_b;
    };
    // Warp 0: the next chunk of this block's share (index ≡ z mod n_split) → at_desc.
    auto advance = [&]() {
        int k0, klen, b;
        for (;;) {
            walk(k0, klen, b);
            const int idx = chunk_idx++;
            if (klen == 0 || idx % n_split == z) break;
        }
        if (lane == 0) {
            at_desc[0] = k0;
            at_desc[1] = klen;
            at_desc[2] = b;
        }
    };

    // Stages keys [k0, k0 + klen) of K or V (rows ≥ klen zero-filled) with cp.async.
    const int segs = d / 8;
    auto issue = [&](const bf16* src, bf16* dst, int k0, int klen) {
        if (klen > 0) {
            for (int x = tid; x < AT_KC * segs; x += AT_THREADS) {
                const int row = x / segs, sg = x % segs;
                const bool in = row < klen;
                const bf16* s = in ? src + (size_t)(k0 + row) * kvw + (size_t)g * d + sg * 8 : src;
                sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
            }
        }
        sp_cp_commit();
    };

    if (warp == 0) advance();
    __syncthreads();
    int c_k0 = at_desc[0], c_klen = at_desc[1], c_b = at_desc[2];
    issue(kcache, Ks, c_k0, c_klen);
    issue(vcache, Vs, c_k0, c_klen);

    const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units: exp(x) = exp2(x·log2 e)
    while (c_klen > 0) {
        // Which of this thread's rows attend to the current chunk's block.
        if (sparse) {
#pragma unroll
            for (int r = 0; r < 2; r++) rs.sel[r] = rs.t[r] >= 0 && at_val[rq[r] - qfirst] == c_b;
        }
        const bool work = (warp_tmax >= c_k0) && kb < c_klen &&
                          __any_sync(0xffffffffu, rs.sel[0] || rs.sel[1]);
        __syncthreads();  // at_desc / at_val read by all
        if (warp == 0) advance();
        sp_cp_wait1();    // K of this chunk (this thread's copies) ...
        __syncthreads();  // ... and everyone's; the next chunk's descriptor visible
        const int n_k0 = at_desc[0], n_klen = at_desc[1], n_b = at_desc[2];

        float S64[8][4];
        float S32[4][4];
        float S16[2][4];
        if (work) {
            if (KW == 1) sp_attn_qk<64>(S64, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
            else if (KW == 2) sp_attn_qk<32>(S32, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
            else sp_attn_qk<16>(S16, qa, O, rs, Ks, ld, d, kb, c_k0, c_klen, sl2);
        }
        __syncthreads();  // K buffer free
        issue(kcache, Ks, n_k0, n_klen);
        sp_cp_wait1();    // V of this chunk
        __syncthreads();
        if (work) {
            if (KW == 1) sp_attn_pv<64>(S64, O, Vs, ld, d, kb);
            else if (KW == 2) sp_attn_pv<32>(S32, O, Vs, ld, d, kb);
            else sp_attn_pv<16>(S16, O, Vs, ld, d, kb);
        }
        __syncthreads();  // V buffer free
        issue(vcache, Vs, n_k0, n_klen);
        c_k0 = n_k0;
        c_klen = n_klen;
        c_b = n_b;
    }
    sp_cp_wait0();

    // Row sums: reduce over the 4 threads of a row.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
    }

    if (KW == 1) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (rs.t[r] < 0) continue;
            const size_t row = (size_t)rq[r] * heads + g * G + rh[r];
            if (n_split == 1) {
                sp_store_row(O, r, 1.0f / rs.l[r], out + row * d + 4 * tq, d);
            } else {
                float* pp = part + ((size_t)z * T * heads + row) * (d + 2);
#pragma unroll
                for (int nt = 0; nt < 16; nt++)
                    if (nt * 8 < d) {
                        pp[sp_o_dim(nt, 0, tq)] = O[nt][2 * r];
                        pp[sp_o_dim(nt, 1, tq)] = O[nt][2 * r + 1];
                    }
                if (tq == 0) {
                    pp[d] = rs.m[r];
                    pp[d + 1] = rs.l[r];
                }
            }
        }
        return;
    }

    // Merge the KW partial states of each row (shared memory reused: the K/V stage is idle).
    __syncthreads();
    const int RU = 16 * RW;        // rows in use (every row of the tile is < RU)
    float* red_o = (float*)at_kv;  // [KW][RU][d] fp32 = 64·d floats ≤ 2·64·(d+8) bf16
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;
        if (tq == 0) at_red_m[kw * AT_ROWS + rl] = rs.m[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int rl = 16 * rg + gq + 8 * r;
        float M = NEG;
        for (int x = 0; x < KW; x++) M = fmaxf(M, at_red_m[x * AT_ROWS + rl]);
        const float f = (rs.m[r] == NEG) ? 0.0f : exp2f(rs.m[r] - M);
        if (tq == 0) at_red_l[kw * AT_ROWS + rl] = rs.l[r] * f;
        float* dst = red_o + ((size_t)kw * RU + rl) * d;
#pragma unroll
        for (int nt = 0; nt < 16; nt++)
            if (nt * 8 < d) {
                dst[sp_o_dim(nt, 0, tq)] = O[nt][2 * r] * f;
                dst[sp_o_dim(nt, 1, tq)] = O[nt][2 * r + 1] * f;
            }
    }
    __syncthreads();
    const int half = d / 2;
    for (int x = tid; x < nrows * half; x += AT_THREADS) {
        const int rl = x / half, e = 2 * (x % half);
        float L = 0.0f, o0 = 0.0f, o1 = 0.0f, M = NEG;
        for (int y = 0; y < KW; y++) {
            L += at_red_l[y * AT_ROWS + rl];
            M = fmaxf(M, at_red_m[y * AT_ROWS + rl]);
            const float* src = red_o + ((size_t)y * RU + rl) * d + e;
            o0 += src[0];
            o1 += src[1];
        }
        const int R = R0 + rl;
        const size_t row = (size_t)(R / G) * heads + g * G + R % G;
        if (n_split == 1) {
            const float inv = 1.0f / L;
            *(u32*)(out + row * d + e) = (u32)f2bf(o0 * inv) | ((u32)f2bf(o1 * inv) << 16);
        } else {
            float* pp = part + ((size_t)z * T * heads + row) * (d + 2);
            pp[e] = o0;
            pp[e + 1] = o1;
            if (e == 0) {
                pp[d] = M;
                pp[d + 1] = L;
            }
        }
    }
}

// Causal softmax attention of the T queries (positions first_pos + i) of every head over the
// cache: blocks == NULL → all keys j ≤ t (dense); else, for query i and KV group g, the keys of
// the selected blocks b = blocks[(i*kv_heads + g)*k_sel + s] ≥ 0, i.e. [b*block_size,
// min((b+1)*block_size, t+1)). fp32 scores and online softmax; out [T, heads*d] bf16.
// launch: grid = ((T * (heads / kv_heads) + 63) / 64, kv_heads), block = 128, dynamic smem = 0 bytes
//   (static shared memory 37,136 bytes. grid.x = ⌈T·G/32⌉ or ⌈T·G/16⌉ also works: the kernel takes
//    16·⌈T·G/(16·grid.x)⌉ rows per block, which must be ≤ 64; 64 measured fastest, also for sparse.)
extern "C" __global__ void __launch_bounds__(AT_THREADS)
attention(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos, int heads,
          int kv_heads, int d, float scale, const int* blocks, int k_sel, int block_size) {
    pdl_start();
    sp_attention_body(q, kcache, vcache, out, 0, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel,
                      block_size, 0, 1);
}

// Split-K variant of `attention` (same arguments, same result after attention_merge) for small T
// (decode), where `attention` would run only kv_heads·⌈T·G/64⌉ blocks. Block z of n_split takes
// every n_split-th 64-key chunk and writes, for each row (query i, head h), its unnormalised
// partial state to part[((z*T + i)*heads + h)*(d + 2) ..]: d fp32 values of O, then m (running
// max, log2 units; −inf if the split saw no key of the row) and l (Σ exp2(s − m)).
// part holds n_split*T*heads*(d + 2) floats. Any n_split ≥ 1 is correct; a good choice is about
// 2·132 / (grid.x·grid.y), at most the number of chunks (dense: ⌈(first_pos+T)/64⌉; sparse: about
// k_sel·⌈block_size/64⌉).
// launch: grid = ((T * (heads / kv_heads) + 63) / 64, kv_heads, n_split), block = 128, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AT_THREADS)
attention_split(const bf16* q, const bf16* kcache, const bf16* vcache, float* part, int T, int first_pos,
                int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int block_size,
                int n_split) {
    pdl_start();
    sp_attention_body(q, kcache, vcache, 0, part, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel,
                      block_size, blockIdx.z, n_split);
}

// Merges the n_split partial states of attention_split into out [T, heads*d] (bf16).
// launch: grid = (T * heads), block = d, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(128)
attention_merge(const float* part, bf16* out, int T, int heads, int d, int n_split) {
    pdl_start();
    const int row = blockIdx.x, e = threadIdx.x;
    if (e >= d) return;
    const size_t zstride = (size_t)T * heads * (d + 2);
    const float* p = part + (size_t)row * (d + 2);
    float M = -__int_as_float(0x7f800000);
#pragma unroll 8
    for (int z = 0; z < n_split; z++) M = fmaxf(M, p[z * zstride + d]);
    float L = 0.0f, o = 0.0f;
#pragma unroll 8
    for (int z = 0; z < n_split; z++) {
        const float* pz = p + z * zstride;
        const float mz = pz[d];
        if (mz == -__int_as_float(0x7f800000)) continue;
        const float f = exp2f(mz - M);
        L += pz[d + 1] * f;
        o += pz[e] * f;
    }
    out[(size_t)row * d + e] = f2bf(o / L);
}

// ============================================================================================
// attention_prefill: causal attention of many queries over 64-key blocks, tensor cores
// ============================================================================================
//
// A block owns AP_WARPS consecutive queries of one KV group; warp w owns query i0 + w, its MMA
// rows being that query's heads of the group (rows ≥ heads / kv_heads are padding). The block
// walks, in ascending order, the union of its queries' selected blocks (dense: every block up to
// the last query's), staging each block's K and V once for all warps; a warp whose query did not
// select the block skips it. S = Q Kᵀ and O += P V on bf16 tensor cores with fp32 accumulation,
// online softmax in fp32 (P rounded to bf16 for the P·V product, as flash attention does). K of
// the next block loads during this block's P·V, V of the next block during the next Q·Kᵀ.

#define AP_WARPS 8
#define AP_UNION (AP_WARPS * 128)  // most blocks in a union (k_sel ≤ 128)

// O += P V for the warp's 16 rows over the 64 staged keys; P (bf16-rounded) from the S
// accumulators of sp_attn_qk. O's dims are laid out as sp_o_dim says.
__device__ __forceinline__ void ap_pv(const float (&S)[8][4], float (&O)[16][4], const bf16* Vs, int ld, int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        u32 a0, a1, a2, a3;
        sp_p_frag(S, ks, a0, a1, a2, a3);
        const bf16* v0 = Vs + (ks * 16 + 2 * tq) * ld + 2 * gq;
#pragma unroll
        for (int m = 0; m < 8; m++) {
            if (m * 16 < d) {
                const bf16* vp = v0 + 16 * m;
                const u32 x0 = *(const u32*)vp, x1 = *(const u32*)(vp + ld);
                const u32 y0 = *(const u32*)(vp + 8 * ld), y1 = *(const u32*)(vp + 9 * ld);
                sp_mma(O[2 * m], a0, a1, a2, a3, __byte_perm(x0, x1, 0x5410), __byte_perm(y0, y1, 0x5410));
                sp_mma(O[2 * m + 1], a0, a1, a2, a3, __byte_perm(x0, x1, 0x7632), __byte_perm(y0, y1, 0x7632));
            }
        }
    }
}

// Causal softmax attention of the T queries (positions first_pos + i, keys already cached):
// blocks == NULL → every key j ≤ t; else query i of KV group g attends to the keys j ≤ t of its
// selected 64-key blocks blocks[(i·kv_heads + g)·k_sel + s] ≥ 0 (ascending). out [T, heads·d] bf16.
// Needs heads / kv_heads ≤ 16, d a multiple of 16 and ≤ 128, k_sel ≤ 128.
// launch: grid = ((T + AP_WARPS − 1) / AP_WARPS, kv_heads), block = 32·AP_WARPS,
//         dynamic smem = 4·⌈nb / 32⌉ bytes, nb = ⌈(first_pos + T) / 64⌉ (a bitmap of blocks)
//   (static shared memory 2·64·136·2 + 4·1024 + 40 = 38,952 bytes)
extern "C" __global__ void __launch_bounds__(AP_WARPS * 32, 1)
attention_prefill(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos,
                  int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel) {
    pdl_start();
    extern __shared__ u32 ap_bits[];
    __shared__ __align__(16) bf16 ap_k[64 * AT_MAXLD];
    __shared__ __align__(16) bf16 ap_v[64 * AT_MAXLD];
    __shared__ int ap_union[AP_UNION];
    __shared__ int ap_scan[9];
    const int G = heads / kv_heads, g = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gq = lane >> 2, tq = lane & 3;
    const int ld = d + 8;
    const size_t kvw = (size_t)kv_heads * d, qw = (size_t)heads * d;
    const int i0 = blockIdx.x * AP_WARPS;
    const int ntok = min(AP_WARPS, T - i0);
    const int t_last = first_pos + i0 + ntok - 1;
    const int n_keys = first_pos + T;  // keys in the cache
    const bool sparse = blocks != 0;

    // The walk: sparse → the sorted union of the block's lists; dense → blocks 0 .. t_last / 64.
    int nu = t_last / 64 + 1;
    if (sparse) {
        const int words = (nu + 31) / 32;
        for (int x = tid; x < words; x += AP_WARPS * 32) ap_bits[x] = 0u;
        __syncthreads();
        for (int x = tid; x < ntok * k_sel; x += AP_WARPS * 32) {
            const int b = blocks[((size_t)(i0 + x / k_sel) * kv_heads + g) * k_sel + x % k_sel];
            if (b >= 0 && b < nu) atomicOr(&ap_bits[b >> 5], 1u << (b & 31));
        }
        __syncthreads();
        const int per = (words + AP_WARPS * 32 - 1) / (AP_WARPS * 32);
        int cnt = 0;
        for (int x = tid * per; x < min(words, tid * per + per); x++) cnt += __popc(ap_bits[x]);
        int total;
        int pos = sp_scan256(cnt, ap_scan, &total);
        for (int x = tid * per; x < min(words, tid * per + per); x++) {
            u32 w = ap_bits[x];
            while (w) {
                const int bit = __ffs(w) - 1;
                w &= w - 1;
                if (pos < AP_UNION) ap_union[pos] = 32 * x + bit;
                pos++;
            }
        }
        nu = min(total, AP_UNION);
        __syncthreads();
    }

    // This warp's query, rows and Q fragments.
    const int i = i0 + warp;
    const bool active = warp < ntok;
    const int t = first_pos + (active ? i : i0);
    SpRows rs;
    const float NEG = -__int_as_float(0x7f800000);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool ok = active && gq + 8 * r < G;
        rs.t[r] = ok ? t : -1;
        rs.m[r] = NEG;
        rs.l[r] = 0.0f;
        rs.sel[r] = ok;
    }
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x & 1, c8 = (x >> 1) * 8;
            u32 v = 0;
            if (kk * 16 < d && rs.t[r] >= 0)
                v = *(const u32*)(q + (size_t)i * qw + (size_t)(g * G + gq + 8 * r) * d + kk * 16 + c8 + 2 * tq);
            qa[kk][x] = v;
        }
    float O[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) O[nt][x] = 0.0f;
    // Sparse: the next block of this warp's list (INT_MAX when exhausted).
    const int* my = blocks + ((size_t)i * kv_heads + g) * k_sel;
    int ptr = 0, next_sel = AT_INF;
    if (sparse && active) {
        const int b = my[0];
        next_sel = b < 0 ? AT_INF : b;
    }

    const int segs = d / 8;
    auto issue = [&](const bf16* src, bf16* dst, int j) {
        if (j < nu) {
            const int k0 = 64 * (sparse ? ap_union[j] : j);
            const int klen = min(64, n_keys - k0);
            for (int x = tid; x < 64 * segs; x += AP_WARPS * 32) {
                const int row = x / segs, sg = x % segs;
                const bool in = row < klen;
                const bf16* s = in ? src + (size_t)(k0 + row) * kvw + (size_t)g * d + sg * 8 : src;
                sp_cp_async16(sp_smem_addr(dst + row * ld + sg * 8), s, in ? 16 : 0);
            }
        }
        sp_cp_commit();
    };
    const float sl2 = scale * 1.4426950408889634f;
    float S[8][4];
    issue(kcache, ap_k, 0);
    issue(vcache, ap_v, 0);
    for (int j = 0; j < nu; j++) {
        const int b = sparse ? ap_union[j] : j;
        const int k0 = 64 * b;
        const bool sel = active && (sparse ? next_sel == b : k0 <= t);
        sp_cp_wait1();  // K of block j
        __syncthreads();
        if (sel) sp_attn_qk<64>(S, qa, O, rs, ap_k, ld, d, 0, k0, min(64, n_keys - k0), sl2);
        __syncthreads();  // K buffer free
        issue(kcache, ap_k, j + 1);
        sp_cp_wait1();  // V of block j
        __syncthreads();
        if (sel) ap_pv(S, O, ap_v, ld, d);
        __syncthreads();  // V buffer free
        issue(vcache, ap_v, j + 1);
        if (sparse && sel) {
            ptr++;
            const int nb = ptr < k_sel ? my[ptr] : -1;
            next_sel = nb < 0 ? AT_INF : nb;
        }
    }
    sp_cp_wait0();

#pragma unroll
    for (int r = 0; r < 2; r++) {
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 1);
        rs.l[r] += __shfl_xor_sync(0xffffffffu, rs.l[r], 2);
        if (rs.t[r] < 0) continue;
        sp_store_row(O, r, 1.0f / rs.l[r], out + (size_t)i * qw + (size_t)(g * G + gq + 8 * r) * d + 4 * tq, d);
    }
}

// ============================================================================================
// attention_gather: sparse attention of many queries, one warp per (query, KV group)
// ============================================================================================
//
// Neighbouring queries may select different blocks (with random weights, mostly different), so
// staging a block once for several queries saves little; here every warp walks its own list with
// no block-wide synchronisation: in prefill through its own ring of shared-memory stages, in
// decode straight from global memory (L2) with 16-byte loads (both through ag_keys). The warp's 16 MMA rows
// are the query's heads of the group.
// Fragment layouts (d a multiple of 64): Q·Kᵀ as sp_load_q_perm and sp_qk_perm do it. For P·V,
// output n-tile 8u + e, column n is dim 64u + 8n + e, so one 16-byte load of
// V[key][64u + 8gq ..] feeds eight n-tiles.

#define AG_WARPS 4  // warps a block of the decode kernels

// A warp's attention state for one query's heads of a KV group: O (dims as ag_dim says), and per
// MMA row r (heads gq, gq + 8) the running max m (log2 units) and this lane's part of Σ exp2.
struct AgState {
    float O[16][4];
    float m[2], l[2];
};

__device__ __forceinline__ void ag_init(AgState& st) {
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) st.O[nt][x] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        st.m[r] = -__int_as_float(0x7f800000);
        st.l[r] = 0.0f;
    }
}

// The dim of accumulator O[8u + 2c + y][2r + half]: thread (gq, tq) holds, per u, dims
// 64u + 16tq + {0..7} (half 0) and 64u + 16tq + 8 + {0..7} (half 1), element 2c + y.
__device__ __forceinline__ int ag_dim(int u, int c, int y, int half, int tq) {
    return 64 * u + 16 * tq + 8 * half + 2 * c + y;
}

// One KV group's keys and values as ag_keys reads them, from its key 0 (`at`: from a later key): 8 dims of a
// key as the four bf16x2 words a 16-byte load of bf16 values gives, and each key's K and V
// scale (the values are code · scale in an FP8 cache, the scales 1 in a bf16 one).
struct KvBf16 {
    const bf16 *k, *v;
    size_t stride;  // elements between keys
    __device__ __forceinline__ KvBf16 at(size_t key) const { return {k + key * stride, v + key * stride, stride}; }
    __device__ __forceinline__ uint4 k8(int key, int dim) const { return *(const uint4*)(k + key * stride + dim); }
    __device__ __forceinline__ uint4 v8(int key, int dim) const { return *(const uint4*)(v + key * stride + dim); }
    __device__ __forceinline__ float k_scale(int) const { return 1.0f; }
    __device__ __forceinline__ float v_scale(int) const { return 1.0f; }
};

struct KvF8 {
    const unsigned char *k, *v;  // the group's first code of key 0
    size_t stride;               // bytes between keys (f8_row_bytes)
    int scale_off;               // bytes from a key's first code of the group to its scale
    __device__ __forceinline__ KvF8 at(size_t key) const {
        return {k + key * stride, v + key * stride, stride, scale_off};
    }
    __device__ __forceinline__ uint4 k8(int key, int dim) const {
        return e4m3x8_bf16(*(const uint2*)(k + key * stride + dim));
    }
    __device__ __forceinline__ uint4 v8(int key, int dim) const {
        return e4m3x8_bf16(*(const uint2*)(v + key * stride + dim));
    }
    __device__ __forceinline__ float k_scale(int key) const { return *(const float*)(k + key * stride + scale_off); }
    __device__ __forceinline__ float v_scale(int key) const { return *(const float*)(v + key * stride + scale_off); }
};

// A pair's K/V reader: bf16 rows of kv_heads·d, or FP8 rows (sparse/common.cuh).
__device__ __forceinline__ KvBf16 kv_bf16(const void* k, const void* v, int g, int kv_heads, int d) {
    const size_t off = (size_t)g * d;
    return {(const bf16*)k + off, (const bf16*)v + off, (size_t)kv_heads * d};
}
__device__ __forceinline__ KvF8 kv_f8(const void* k, const void* v, int g, int kv_heads, int d) {
    const size_t off = (size_t)g * d;
    return {(const unsigned char*)k + off, (const unsigned char*)v + off, (size_t)f8_row_bytes(kv_heads, d),
            kv_heads * d + 4 * g - g * d};
}

// Attends the warp's query (position t; padding rows masked by row_ok) to the 8·NT keys
// [k0, k0 + 8·NT) ∩ [0, min(t + 1, k0 + n_valid)) of its KV group, read through kv (key 0 at
// k0: a block of 64 in global memory, or a shared-memory stage of AG_KEYS; rows ≥ n_valid are
// not read). S = Q·Kᵀ (times each key's K scale), online softmax in log2 units, O += P·V (P
// times each key's V scale, rounded to bf16).
template <int NT, class KV>
__device__ __forceinline__ void ag_keys(AgState& st, const u32 (&qa)[8][4], const KV& kv, int k0, int t,
                                        int n_valid, const bool (&row_ok)[2], float sl2, int d) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const float NEG = -__int_as_float(0x7f800000);
    const int last = min(n_valid, 8 * NT) - 1;
    float S[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        // Lane (gq, tq) reads key 8nt + gq (the permuted k-steps of sp_load_q_perm).
        const int key = min(8 * nt + gq, last);
        S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            if (32 * p < d) {
                const uint4 kw = kv.k8(key, 32 * p + 8 * tq);
                sp_mma(S[nt], qa[2 * p][0], qa[2 * p][1], qa[2 * p][2], qa[2 * p][3], kw.x, kw.y);
                sp_mma(S[nt], qa[2 * p + 1][0], qa[2 * p + 1][1], qa[2 * p + 1][2], qa[2 * p + 1][3], kw.z, kw.w);
            }
        }
    }
    float mx[2] = {NEG, NEG};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int r = x >> 1;
            const int j = 8 * nt + 2 * tq + (x & 1);
            const bool ok = row_ok[r] && k0 + j <= t && j <= last;
            S[nt][x] = ok ? S[nt][x] * (kv.k_scale(min(j, last)) * sl2) : NEG;
            mx[r] = fmaxf(mx[r], S[nt][x]);
        }
    float alpha[2], mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mn = fmaxf(st.m[r], mx[r]);
        mu[r] = (mn == NEG) ? 0.0f : mn;
        alpha[r] = exp2f(st.m[r] - mu[r]);
        st.m[r] = mn;
    }
    float rsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const float e = exp2f(S[nt][x] - mu[x >> 1]);
            S[nt][x] = e;
            rsum[x >> 1] += e;
        }
#pragma unroll
    for (int r = 0; r < 2; r++) st.l[r] = st.l[r] * alpha[r] + rsum[r];
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        st.O[nt][0] *= alpha[0];
        st.O[nt][1] *= alpha[0];
        st.O[nt][2] *= alpha[1];
        st.O[nt][3] *= alpha[1];
    }
    // O += P V, P's column of key j times j's V scale.
#pragma unroll
    for (int ks = 0; ks < NT / 2; ks++) {
        const int j = 16 * ks + 2 * tq;
        const int keys[4] = {min(j, last), min(j + 1, last), min(j + 8, last), min(j + 9, last)};
#pragma unroll
        for (int y = 0; y < 4; y++) {
            const float vs = kv.v_scale(keys[y]);
            S[2 * ks + (y >> 1)][y & 1] *= vs;
            S[2 * ks + (y >> 1)][2 + (y & 1)] *= vs;
        }
        u32 a0, a1, a2, a3;
        sp_p_frag(S, ks, a0, a1, a2, a3);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (64 * u < d) {
                uint4 v[4];
#pragma unroll
                for (int y = 0; y < 4; y++) v[y] = kv.v8(keys[y], 64 * u + 8 * gq);
                const u32 w0[4] = {v[0].x, v[0].y, v[0].z, v[0].w}, w1[4] = {v[1].x, v[1].y, v[1].z, v[1].w};
                const u32 w2[4] = {v[2].x, v[2].y, v[2].z, v[2].w}, w3[4] = {v[3].x, v[3].y, v[3].z, v[3].w};
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    sp_mma(st.O[8 * u + 2 * c], a0, a1, a2, a3, __byte_perm(w0[c], w1[c], 0x5410),
                           __byte_perm(w2[c], w3[c], 0x5410));
                    sp_mma(st.O[8 * u + 2 * c + 1], a0, a1, a2, a3, __byte_perm(w0[c], w1[c], 0x7632),
                           __byte_perm(w2[c], w3[c], 0x7632));
                }
            }
        }
    }
}

// Sums l over the quad of lanes that share a row (every lane calls).
__device__ __forceinline__ void ag_sum_l(AgState& st) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
        st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
    }
}

// After ag_sum_l: each valid row r's O / l as bf16 at orow(r).
template <class ORow>
__device__ __forceinline__ void ag_store_out(const AgState& st, const bool (&row_ok)[2], int d, ORow&& orow) {
    const int tq = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!row_ok[r]) continue;
        const float inv = 1.0f / st.l[r];
        bf16* op = orow(r);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (64 * u < d) {
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    uint4 w;
                    u32* wp = (u32*)&w;
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        wp[c] = (u32)f2bf(st.O[8 * u + 2 * c][2 * r + half] * inv) |
                                ((u32)f2bf(st.O[8 * u + 2 * c + 1][2 * r + half] * inv) << 16);
                    *(uint4*)(op + ag_dim(u, 0, 0, half, tq)) = w;
                }
            }
        }
    }
}

// After ag_sum_l: each valid row r's unnormalised state at prow(r): d fp32 values of O, then
// m and l (attention_split's partial format).
template <class PRow>
__device__ __forceinline__ void ag_store_partial(const AgState& st, const bool (&row_ok)[2], int d, PRow&& prow) {
    const int tq = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (!row_ok[r]) continue;
        float* pp = prow(r);
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (64 * u < d)
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        *(float2*)(pp + ag_dim(u, c, 0, half, tq)) =
                            make_float2(st.O[8 * u + 2 * c][2 * r + half], st.O[8 * u + 2 * c + 1][2 * r + half]);
        if (tq == 0) {
            pp[d] = st.m[r];
            pp[d + 1] = st.l[r];
        }
    }
}

// The indices and strides of a warp's pair (query i, KV group g) = (pair / kv_heads,
// pair % kv_heads); ag_pair also loads its Q fragments.
struct AgPair {
    int i, g, t, n_keys;
    size_t kvw, qw;
    bool row_ok[2];
};

__device__ __forceinline__ AgPair ag_pair(const bf16* q, int pair, int T, int first_pos, int heads, int kv_heads,
                                          int d, u32 (&qa)[8][4]) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    AgPair p;
    p.i = pair / kv_heads;
    p.g = pair % kv_heads;
    p.t = first_pos + p.i;
    p.n_keys = first_pos + T;
    p.kvw = (size_t)kv_heads * d;
    p.qw = (size_t)heads * d;
    p.row_ok[0] = gq < G;
    p.row_ok[1] = gq + 8 < G;
    sp_load_q_perm(q + (size_t)p.i * p.qw + (size_t)p.g * G * d, G, d, qa);
    return p;
}

// Prefill: each warp streams its (query, group)'s selected blocks through its own ring of
// shared-memory stages, AG_KEYS keys of K and V a stage, `stages` deep (cp.async), so a warp
// keeps up to stages − 1 stages of loads in flight while it computes one; no block-wide
// synchronisation. Tiles are unpadded rows of d values, their 16-byte pieces swizzled so each
// 8-lane phase of the 16-byte loads hits distinct banks: K rows (two rows a phase) swap 64-byte
// halves on odd rows, V rows (four rows a phase) XOR the piece with the row's low 3 bits.
#define AG_KEYS 32

__device__ __forceinline__ u32 ag_k_off(int r, int c, int d) { return r * 2 * d + ((c ^ ((r & 1) << 2)) << 4); }
__device__ __forceinline__ u32 ag_v_off(int r, int c, int d) { return r * 2 * d + ((c ^ (r & 7)) << 4); }

// Stages keys [k0, k0 + AG_KEYS) of one group (kg, vg: its first dim of key 0; rows ≥ n_keys
// zero) into the K and V tiles at shared addresses kt, vt. The warp's 32 lanes call; lane L
// copies piece L % (D / 8) of rows L / (D / 8) + i · 256 / D.
template <int D>
__device__ __forceinline__ void ag_issue(u32 kt, u32 vt, const bf16* kg, const bf16* vg, size_t kvw, int k0,
                                         int n_keys) {
    constexpr int PIECES = D / 8, STEP = 32 / PIECES;
    const int lane = threadIdx.x & 31, c = lane % PIECES, r0 = lane / PIECES;
    const size_t src0 = (size_t)(k0 + r0) * kvw + 8 * c;
    const bool full = k0 + AG_KEYS <= n_keys;
#pragma unroll
    for (int i = 0; i < AG_KEYS / STEP; i++) {
        const int r = r0 + STEP * i;
        const bool in = full || k0 + r < n_keys;
        const size_t off = in ? src0 + (size_t)(STEP * i) * kvw : 0;
        sp_cp_async16(kt + ag_k_off(r, c, D), kg + off, in ? 16 : 0);
        sp_cp_async16(vt + ag_v_off(r, c, D), vg + off, in ? 16 : 0);
    }
}

// A stage of AG_KEYS keys in shared memory as ag_keys reads it: 8 dims of key r's K or V as
// the four bf16x2 words of 16 bytes of bf16 values, and r's K and V scales.
struct StageBf16 {
    const unsigned char *kt, *vt;
    int d;
    __device__ __forceinline__ uint4 k8(int r, int dim) const { return *(const uint4*)(kt + ag_k_off(r, dim / 8, d)); }
    __device__ __forceinline__ uint4 v8(int r, int dim) const { return *(const uint4*)(vt + ag_v_off(r, dim / 8, d)); }
    __device__ __forceinline__ float k_scale(int) const { return 1.0f; }
    __device__ __forceinline__ float v_scale(int) const { return 1.0f; }
};

// An FP8 stage: K codes, V codes (rows of d bytes, 16-byte pieces XOR-swizzled by the row's
// low bits, so the 8-byte reads of a warp take the two wavefronts they must), then the AG_KEYS
// K scales and V scales.
__device__ __forceinline__ u32 ag8_off(int r, int c, int d) { return r * d + ((c ^ (r & (d / 16 - 1))) << 4); }
__device__ __forceinline__ u32 ag8_tile(int d) { return AG_KEYS * d; }

struct StageF8 {
    const unsigned char *kt, *vt;
    const float *ks, *vs;
    int d;
    __device__ __forceinline__ uint4 k8(int r, int dim) const {
        return e4m3x8_bf16(*(const uint2*)(kt + ag8_off(r, dim / 16, d) + (dim & 8)));
    }
    __device__ __forceinline__ uint4 v8(int r, int dim) const {
        return e4m3x8_bf16(*(const uint2*)(vt + ag8_off(r, dim / 16, d) + (dim & 8)));
    }
    __device__ __forceinline__ float k_scale(int r) const { return ks[r]; }
    __device__ __forceinline__ float v_scale(int r) const { return vs[r]; }
};

// Stages keys [k0, k0 + AG_KEYS) of an FP8 cache (kg, vg: the group's first code of key 0;
// `scale_off`: bytes from there to the group's scale; rows `stride` bytes; rows ≥ n_keys
// zero) at shared address `at` in StageF8's layout.
template <int D>
__device__ __forceinline__ void ag8_issue(u32 at, const unsigned char* kg, const unsigned char* vg, size_t stride,
                                          int scale_off, int k0, int n_keys) {
    constexpr int PIECES = D / 16, STEP = 32 / PIECES;
    const int lane = threadIdx.x & 31, c = lane % PIECES, r0 = lane / PIECES;
    const u32 kt = at, vt = at + ag8_tile(D), st = at + 2 * ag8_tile(D);
#pragma unroll
    for (int i = 0; i < AG_KEYS / STEP; i++) {
        const int r = r0 + STEP * i;
        const bool in = k0 + r < n_keys;
        const size_t off = in ? (size_t)(k0 + r) * stride + 16 * c : 0;
        sp_cp_async16(kt + ag8_off(r, c, D), kg + off, in ? 16 : 0);
        sp_cp_async16(vt + ag8_off(r, c, D), vg + off, in ? 16 : 0);
    }
    // Lane r: key r's two scales (4 bytes each).
    const bool in = k0 + lane < n_keys;
    const size_t off = in ? (size_t)(k0 + lane) * stride + scale_off : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 4 * lane), "l"(kg + off),
                 "r"(in ? 4 : 0));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 4 * AG_KEYS + 4 * lane),
                 "l"(vg + off), "r"(in ? 4 : 0));
}

// The warp's walk in stages of AG_KEYS keys over its pair's list (sorted, −1 padded; NULL:
// every block up to the query's, dense): the second half of the query's own block is skipped
// when it lies past t. `ring`: the warp's NS stages (`stage` bytes each), as a shared address
// and a pointer; `issue(at, k0)` stages keys from k0 at shared address `at`, `tile(p)` reads
// the stage at pointer p.
template <int NS, class Issue, class Tile>
__device__ __forceinline__ void ag_walk(AgState& st, const u32 (&qa)[8][4], const AgPair& p, const int* my, int k_sel,
                                        u32 ring, const unsigned char* ring_p, u32 stage, float sl2, int d,
                                        Issue&& issue_at, Tile&& tile) {
    const int lane = threadIdx.x & 31;
    int nb = 0;
    if (my) {
        for (int s0 = 0; s0 < k_sel; s0 += 32)
            nb += __popc(__ballot_sync(0xffffffffu, s0 + lane < k_sel && my[s0 + lane] >= 0));
    } else {
        nb = p.t / 64 + 1;
    }
    auto block = [&](int i) { return my ? my[i] : i; };
    const int n_st = nb == 0 ? 0 : 2 * nb - (64 * block(nb - 1) + AG_KEYS > p.t ? 1 : 0);
    auto key0 = [&](int s) { return 64 * block(s >> 1) + AG_KEYS * (s & 1); };
    auto issue = [&](int s) {
        if (s < n_st) issue_at(ring + (s % NS) * stage, key0(s));
        sp_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < NS - 1; s++) issue(s);
    for (int s = 0; s < n_st; s++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 2) : "memory");
        __syncwarp();  // stage s visible to every lane; stage s − 1's slot free
        issue(s + NS - 1);
        ag_keys<AG_KEYS / 8>(st, qa, tile(ring_p + (s % NS) * stage), key0(s), p.t, AG_KEYS, p.row_ok, sl2, d);
    }
    sp_cp_wait0();
}

// bf16 stages: K then V tiles of 2·AG_KEYS·D bytes each.
template <int NS, int D>
__device__ __forceinline__ void ag_walk_bf16(AgState& st, const u32 (&qa)[8][4], const AgPair& p, const bf16* kg,
                                             const bf16* vg, const int* my, int k_sel, u32 ring,
                                             const unsigned char* ring_p, float sl2) {
    constexpr u32 tile = AG_KEYS * 2 * D;
    ag_walk<NS>(
        st, qa, p, my, k_sel, ring, ring_p, 2 * tile, sl2, D,
        [&](u32 at, int k0) { ag_issue<D>(at, at + tile, kg, vg, p.kvw, k0, p.n_keys); },
        [&](const unsigned char* at) { return StageBf16{at, at + tile, D}; });
}

// FP8 stages (StageF8's layout).
template <int NS, int D>
__device__ __forceinline__ void ag_walk_f8(AgState& st, const u32 (&qa)[8][4], const AgPair& p, const KvF8& kv,
                                           const int* my, int k_sel, u32 ring, const unsigned char* ring_p,
                                           float sl2) {
    constexpr u32 tile = AG_KEYS * D, stage = 2 * tile + 8 * AG_KEYS;
    ag_walk<NS>(
        st, qa, p, my, k_sel, ring, ring_p, stage, sl2, D,
        [&](u32 at, int k0) { ag8_issue<D>(at, kv.k, kv.v, kv.stride, kv.scale_off, k0, p.n_keys); },
        [&](const unsigned char* at) {
            return StageF8{at, at + tile, (const float*)(at + 2 * tile), (const float*)(at + 2 * tile) + AG_KEYS, D};
        });
}

// launch: grid = (⌈T·kv_heads / W⌉), block = 32·W, dynamic smem = W · stages · 4·AG_KEYS·d bytes
// (stages 2, 3 or 4). Same arguments and result as attention_prefill with blocks != NULL
// (64-key blocks); needs heads / kv_heads ≤ 16 and d ∈ {64, 128}.
extern "C" __global__ void __launch_bounds__(256)
attention_gather(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos,
                 int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int stages) {
    pdl_start();
    extern __shared__ __align__(128) unsigned char ag_sm[];
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads, warp = threadIdx.x >> 5;
    const int pair = blockIdx.x * (blockDim.x >> 5) + warp;
    if (pair >= T * kv_heads) return;  // warp-uniform; no block barriers below
    u32 qa[8][4];
    const AgPair p = ag_pair(q, pair, T, first_pos, heads, kv_heads, d, qa);
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks + (size_t)pair * k_sel;
    const unsigned char* ring_p = ag_sm + (size_t)warp * stages * 4 * AG_KEYS * d;
    const u32 ring = sp_smem_addr(ring_p);
    const bf16* kg = kcache + (size_t)p.g * d;
    const bf16* vg = vcache + (size_t)p.g * d;
    if (d == 128) {
        if (stages >= 4) ag_walk_bf16<4, 128>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
        else if (stages == 3) ag_walk_bf16<3, 128>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
        else ag_walk_bf16<2, 128>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
    } else {
        if (stages >= 4) ag_walk_bf16<4, 64>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
        else if (stages == 3) ag_walk_bf16<3, 64>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
        else ag_walk_bf16<2, 64>(st, qa, p, kg, vg, my, k_sel, ring, ring_p, sl2);
    }
    bf16* orow0 = out + (size_t)p.i * p.qw + (size_t)(p.g * G + gq) * d;
    ag_sum_l(st);
    ag_store_out(st, p.row_ok, d, [&](int r) { return orow0 + 8 * r * d; });
}

// attention_gather over an FP8 cache (sparse/common.cuh), and dense when blocks == NULL.
// launch: grid = (⌈T·kv_heads / W⌉), block = 32·W, dynamic smem = W · stages · (2·AG_KEYS·d +
// 8·AG_KEYS) bytes (stages 2, 3 or 4); needs heads / kv_heads ≤ 16 and d ∈ {64, 128}.
extern "C" __global__ void __launch_bounds__(256)
attention_gather_f8(const bf16* q, const unsigned char* kcache, const unsigned char* vcache, bf16* out, int T,
                    int first_pos, int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel,
                    int stages) {
    pdl_start();
    extern __shared__ __align__(128) unsigned char ag_sm[];
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads, warp = threadIdx.x >> 5;
    const int pair = blockIdx.x * (blockDim.x >> 5) + warp;
    if (pair >= T * kv_heads) return;  // warp-uniform; no block barriers below
    u32 qa[8][4];
    const AgPair p = ag_pair(q, pair, T, first_pos, heads, kv_heads, d, qa);
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks ? blocks + (size_t)pair * k_sel : 0;
    const unsigned char* ring_p = ag_sm + (size_t)warp * stages * (2 * AG_KEYS * d + 8 * AG_KEYS);
    const u32 ring = sp_smem_addr(ring_p);
    const KvF8 kv = kv_f8(kcache, vcache, p.g, kv_heads, d);
    if (d == 128) {
        if (stages >= 4) ag_walk_f8<4, 128>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
        else if (stages == 3) ag_walk_f8<3, 128>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
        else ag_walk_f8<2, 128>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
    } else {
        if (stages >= 4) ag_walk_f8<4, 64>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
        else if (stages == 3) ag_walk_f8<3, 64>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
        else ag_walk_f8<2, 64>(st, qa, p, kv, my, k_sel, ring, ring_p, sl2);
    }
    bf16* orow0 = out + (size_t)p.i * p.qw + (size_t)(p.g * G + gq) * d;
    ag_sum_l(st);
    ag_store_out(st, p.row_ok, d, [&](int r) { return orow0 + 8 * r * d; });
}

// Split-K attention for few queries (decode): warp z of the n_split warps of pair (query i, KV
// group g) = (blockIdx.x / kv_heads, blockIdx.x % kv_heads) attends to the 64-key blocks
// s ≡ z (mod n_split) of the pair's walk (blocks != NULL: its list, −1 padded; else every
// block 0 .. t/64) and writes each of its rows' partial state, as attention_split does, to
// part[((z·T + i)·heads + h)·(d + 2) ..]; attention_merge combines them. With part == NULL
// (n_split 1) it writes the rows' outputs to `out` instead. The query at position t sees keys
// < n_keys of the cache (`kv`: the pair's group at key 0). Needs heads / kv_heads ≤ 16 and
// d ∈ {64, 128}.
template <class KV>
__device__ __forceinline__ void attention_decode_pair(const bf16* q, const KV& kv, float* part, bf16* out, int T,
                                                      int t, int n_keys, int heads, int kv_heads, int d,
                                                      float scale, const int* blocks, int k_sel, int n_split) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    const int z = blockIdx.y * AG_WARPS + (threadIdx.x >> 5);
    if (z >= n_split) return;  // warp-uniform
    const int pair = blockIdx.x;
    u32 qa[8][4];
    AgPair p = ag_pair(q, pair, T, 0, heads, kv_heads, d, qa);
    p.t = t;
    p.n_keys = n_keys;
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks ? blocks + (size_t)pair * k_sel : 0;
    const int n_walk = blocks ? k_sel : p.t / 64 + 1;
    for (int s = z; s < n_walk; s += n_split) {
        const int b = blocks ? my[s] : s;
        if (__any_sync(0xffffffffu, b < 0)) break;  // −1 padded lists; a vote keeps the walk warp-uniform
        ag_keys<8>(st, qa, kv.at((size_t)64 * b), 64 * b, p.t, p.n_keys - 64 * b, p.row_ok, sl2, d);
    }
    ag_sum_l(st);
    if (!part) {
        bf16* orow0 = out + (size_t)p.i * p.qw + (size_t)(p.g * G + gq) * d;
        ag_store_out(st, p.row_ok, d, [&](int r) { return orow0 + 8 * r * d; });
        return;
    }
    float* prow0 = part + (((size_t)z * T + p.i) * heads + (size_t)p.g * G + gq) * (d + 2);
    ag_store_partial(st, p.row_ok, d, [&](int r) { return prow0 + 8 * r * (d + 2); });
}

// The T queries of one sequence at positions first_pos .. first_pos + T − 1.
// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode(const bf16* q, const bf16* kcache, const bf16* vcache, float* part, int T, int first_pos,
                 int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int n_split) {
    pdl_start();
    const int g = blockIdx.x % kv_heads;
    attention_decode_pair(q, kv_bf16(kcache, vcache, g, kv_heads, d), part, (bf16*)0, T,
                          first_pos + blockIdx.x / kv_heads, first_pos + T, heads, kv_heads, d, scale, blocks,
                          k_sel, n_split);
}

// attention_decode over an FP8 cache; with part == NULL (n_split 1) the outputs go to `out`.
// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode_f8(const bf16* q, const unsigned char* kcache, const unsigned char* vcache, float* part, bf16* out,
                    int T, int first_pos, int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel,
                    int n_split) {
    pdl_start();
    const int g = blockIdx.x % kv_heads;
    attention_decode_pair(q, kv_f8(kcache, vcache, g, kv_heads, d), part, out, T, first_pos + blockIdx.x / kv_heads,
                          first_pos + T, heads, kv_heads, d, scale, blocks, k_sel, n_split);
}

// One query of each of T ≤ SEQ_ROWS sequences (row i over rows' caches i, split rows.split[i]
// ways), a pair's partials as attention_decode writes them for that sequence alone; the slots
// from its split to n_split (the largest) get an empty partial (m = −inf), which the merge skips.
template <class MakeKv>
__device__ __forceinline__ void attention_decode_rows_body(const bf16* q, const SeqRows& rows, float* part, int T,
                                                           int heads, int kv_heads, int d, float scale,
                                                           const int* blocks, int k_sel, int n_split, MakeKv make) {
    const int i = blockIdx.x / kv_heads, g = blockIdx.x % kv_heads, G = heads / kv_heads;
    const int z = blockIdx.y * AG_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (z >= rows.split[i]) {  // warp-uniform
        if (z < n_split && lane < G)
            part[(((size_t)z * T + i) * heads + (size_t)g * G + lane) * (d + 2) + d] = -__int_as_float(0x7f800000);
        return;
    }
    attention_decode_pair(q, make(rows.k[i], rows.v[i], g, kv_heads, d), part, (bf16*)0, T, rows.pos[i],
                          rows.pos[i] + 1, heads, kv_heads, d, scale, blocks, k_sel, rows.split[i]);
}

// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode_rows(const bf16* q, SeqRows rows, float* part, int T, int heads, int kv_heads, int d, float scale,
                      const int* blocks, int k_sel, int n_split) {
    pdl_start();
    attention_decode_rows_body(q, rows, part, T, heads, kv_heads, d, scale, blocks, k_sel, n_split,
                               [](const void* k, const void* v, int g, int kvh, int dd) { return kv_bf16(k, v, g, kvh, dd); });
}

// attention_decode_rows over FP8 caches (rows.k, rows.v point at FP8 rows).
// launch: grid = (T·kv_heads, ⌈n_split / AG_WARPS⌉), block = 32·AG_WARPS, dynamic smem = 0 bytes
extern "C" __global__ void __launch_bounds__(AG_WARPS * 32)
attention_decode_rows_f8(const bf16* q, SeqRows rows, float* part, int T, int heads, int kv_heads, int d,
                         float scale, const int* blocks, int k_sel, int n_split) {
    pdl_start();
    attention_decode_rows_body(q, rows, part, T, heads, kv_heads, d, scale, blocks, k_sel, n_split,
                               [](const void* k, const void* v, int g, int kvh, int dd) { return kv_f8(k, v, g, kvh, dd); });
}
