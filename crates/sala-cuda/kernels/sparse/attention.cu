// Softmax attention of the sparse layers over all keys (dense) or the selected blocks (sparse),
// on tiles of queries: attention (attention_split + attention_merge for few rows) on tiles of 64
// rows, and attention_prefill (a block walks the union of its queries' selected blocks). The
// warp-per-(query, group) kernels are in sparse/attention_walk.cu. Layouts in sparse/common.cuh.

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

// Merges the n_split partial states of attention_split into out [T, heads*d] (bf16). Four groups
// of d threads each take every fourth split: first the maximum of their splits' m, then the
// sums scaled to it, each pass's loads issued eight splits at a time (none waits on another);
// then group 0 adds the four.
// launch: grid = (T * heads), block = 4·d (d ≤ 128), dynamic smem = 0 bytes
#define AM_GROUPS 4
#define AM_UNROLL 8
extern "C" __global__ void __launch_bounds__(AM_GROUPS * 128)
attention_merge(const float* part, bf16* out, int T, int heads, int d, int n_split) {
    __shared__ float sm_m[AM_GROUPS], sm_l[AM_GROUPS], sm_o[AM_GROUPS][128];
    pdl_start();
    const int row = blockIdx.x, e = threadIdx.x % d, grp = threadIdx.x / d;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const size_t zstride = (size_t)T * heads * (d + 2);
    const float* p = part + (size_t)row * (d + 2);
    if (grp < AM_GROUPS) {
        float M = NEG_INF;
        for (int z0 = grp; z0 < n_split; z0 += AM_GROUPS * AM_UNROLL) {
#pragma unroll
            for (int u = 0; u < AM_UNROLL; u++) {
                const int z = z0 + u * AM_GROUPS;
                if (z < n_split) M = fmaxf(M, p[z * zstride + d]);
            }
        }
        // Splits that saw no key (m = −inf) add nothing; with none at all, L = 0.
        float L = 0.0f, o = 0.0f;
        for (int z0 = grp; z0 < n_split; z0 += AM_GROUPS * AM_UNROLL) {
            float mz[AM_UNROLL], lz[AM_UNROLL], oz[AM_UNROLL];
#pragma unroll
            for (int u = 0; u < AM_UNROLL; u++) {
                const int z = z0 + u * AM_GROUPS;
                const float* pz = p + (size_t)min(z, n_split - 1) * zstride;
                mz[u] = z < n_split ? pz[d] : NEG_INF;
                lz[u] = pz[d + 1];
                oz[u] = pz[e];
            }
#pragma unroll
            for (int u = 0; u < AM_UNROLL; u++) {
                if (mz[u] == NEG_INF) continue;
                const float f = exp2f(mz[u] - M);
                L += lz[u] * f;
                o += oz[u] * f;
            }
        }
        sm_o[grp][e] = o;
        if (e == 0) sm_m[grp] = M, sm_l[grp] = L;
    }
    __syncthreads();
    if (grp != 0) return;
    float Mt = NEG_INF;
#pragma unroll
    for (int j = 0; j < AM_GROUPS; j++) Mt = fmaxf(Mt, sm_m[j]);
    float Lt = 0.0f, ot = 0.0f;
#pragma unroll
    for (int j = 0; j < AM_GROUPS; j++) {
        if (sm_m[j] == NEG_INF) continue;
        const float f = exp2f(sm_m[j] - Mt);
        Lt += sm_l[j] * f;
        ot += sm_o[j][e] * f;
    }
    out[(size_t)row * d + e] = f2bf(ot / Lt);
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
