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

#define ST_TW 2  // tokens per warp

__device__ __forceinline__ float st_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// acc[j][m] = S^T of m-tiles 2·mp + j (keys 32·mp + 16j ..) of the staged tile for token m.
__device__ __forceinline__ void st_qk(float (&acc)[2][ST_TW][2][4], const u32 (&qb)[ST_TW][2][8][2], const bf16* tile,
                                      int ld, int d, int mp) {
    const int lane = threadIdx.x & 31, r8 = lane & 7, m8 = lane >> 3;
    // This lane's ldmatrix row address (bytes, shared window) for m-tile 2·mp, k-step 0.
    const u32 base = sp_smem_addr(tile + (32 * mp + r8 + 8 * (m8 & 1)) * ld + 8 * (m8 >> 1));
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int m = 0; m < ST_TW; m++)
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
                for (int m = 0; m < ST_TW; m++)
#pragma unroll
                    for (int nt = 0; nt < 2; nt++)
                        sp_mma(acc[j][m][nt], a[0], a[1], a[2], a[3], qb[m][nt][kk][0], qb[m][nt][kk][1]);
            }
        }
    }
}

// The body of select_scores_t (st_kv: 2·64·136 bf16 of shared memory).
__device__ __forceinline__ void st_body(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T,
                                        int first_pos, int heads, int kv_heads, int d, float scale, int block_size,
                                        int k2_window, int k2_stride, int init_blocks, int local_blocks, int k_sel,
                                        float* bs, int bs_stride, bf16* st_kv) {
    const int G = heads / kv_heads, g = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const size_t kvw = (size_t)kv_heads * d;
    const int ld = d + 8;
    const float NEG = -__int_as_float(0x7f800000), INF = __int_as_float(0x7f800000);
    const int per_block = SQ_WARPS * ST_TW;

    int tt[ST_TW], cand_hi[ST_TW], n2v[ST_TW];
    bool act[ST_TW];
    bool any = false;
#pragma unroll
    for (int m = 0; m < ST_TW; m++) {
        const int i = blockIdx.x * per_block + ST_TW * warp + m;
        tt[m] = first_pos + min(i, T - 1);
        const int qb = tt[m] / block_size;
        act[m] = i < T && qb >= k_sel;
        any |= act[m];
        cand_hi[m] = act[m] ? max(qb - local_blocks, 0) : 0;
        n2v[m] = min(sp_visible(tt[m], k2_window, k2_stride), n2);
    }
    const int t_last = first_pos + min((int)(blockIdx.x + 1) * per_block, T) - 1;
    const int qb_last = t_last / block_size;
    const int n2_all = min(sp_visible(t_last, k2_window, k2_stride), n2);
    const int n1_all = (qb_last >= k_sel) ? min(4 * max(qb_last - local_blocks, 0), n1) : 0;
    if (n1_all == 0 || n2_all == 0) return;  // block-uniform

    // Qᵀ as B fragments: head 8nt + gq, dims 16kk + 2tq (+1) and 16kk + 8 + 2tq (+1).
    u32 qb[ST_TW][2][8][2];
#pragma unroll
    for (int m = 0; m < ST_TW; m++)
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
    float acc[2][ST_TW][2][4];

    // Pass 1: per head (column 2·nt + c of this thread: head 8nt + 2tq + c), the online max and
    // sum of exp2 over this lane's visible level-2 keys, merged across lanes at the end.
    float mrow[ST_TW][4], lrow[ST_TW][4];
#pragma unroll
    for (int m = 0; m < ST_TW; m++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            mrow[m][h] = NEG;
            lrow[m][h] = 0.0f;
        }
    int buf = 0;
    sq_issue(k2, kvw, g, d, st_kv, ld, 0, min(SQ_KC, n2_all));
    for (int c0 = 0; c0 < n2_all; c0 += SQ_KC) {
        const int nxt = c0 + SQ_KC;
        if (nxt < n2_all) sq_issue(k2, kvw, g, d, st_kv + (buf ^ 1) * SQ_KC * ld, ld, nxt, min(SQ_KC, n2_all - nxt));
        else sp_cp_commit();
        sp_cp_wait1();
        __syncthreads();
#pragma unroll
        for (int mp = 0; mp < 2; mp++) {
            if (any && c0 + 32 * mp < n2v[ST_TW - 1]) {
                st_qk(acc, qb, st_kv + buf * SQ_KC * ld, ld, d, mp);
#pragma unroll
                for (int m = 0; m < ST_TW; m++)
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        const int nt = h >> 1, c = h & 1;
                        float x[4];
                        float mx = mrow[m][h];
#pragma unroll
                        for (int y = 0; y < 4; y++) {
                            const int key = c0 + 32 * mp + 16 * (y >> 1) + gq + 8 * (y & 1);
                            const float s = acc[y >> 1][m][nt][2 * (y & 1) + c] * sl2;
                            x[y] = (key < n2v[m]) ? s : NEG;
                            mx = fmaxf(mx, x[y]);
                        }
                        const float mu = (mx == NEG) ? 0.0f : mx;
                        float l = lrow[m][h] * st_ex2(mrow[m][h] - mu);
#pragma unroll
                        for (int y = 0; y < 4; y++) l += st_ex2(x[y] - mu);
                        lrow[m][h] = l;
                        mrow[m][h] = mx;
                    }
            }
        }
        __syncthreads();  // buffer `buf` free
        buf ^= 1;
    }
    sp_cp_wait0();
    float lse[ST_TW][4];
#pragma unroll
    for (int m = 0; m < ST_TW; m++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
            float mx = mrow[m][h], l = lrow[m][h];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                const float mo = __shfl_xor_sync(0xffffffffu, mx, o), lo = __shfl_xor_sync(0xffffffffu, l, o);
                const float mn = fmaxf(mx, mo);
                const float mu = (mn == NEG) ? 0.0f : mn;
                l = l * st_ex2(mx - mu) + lo * st_ex2(mo - mu);
                mx = mn;
            }
            const int hd = 8 * (h >> 1) + 2 * tq + (h & 1);
            // Padding heads and inactive tokens get +inf, so their probabilities are 0.
            lse[m][h] = (act[m] && hd < G) ? mx + __log2f(l) : INF;
        }

    // Pass 2: P of each level-1 key (sum over the heads), max-pooled into block scores: block b
    // takes keys 4b − 1 .. 4b + 3. carry[m]: P of the previous m-tile's last key.
    float carry[ST_TW];
#pragma unroll
    for (int m = 0; m < ST_TW; m++) carry[m] = NEG;
    buf = 0;
    __syncthreads();
    sq_issue(k1, kvw, g, d, st_kv, ld, 0, min(SQ_KC, n1_all));
    for (int c0 = 0; c0 < n1_all; c0 += SQ_KC) {
        const int nxt = c0 + SQ_KC;
        if (nxt < n1_all) sq_issue(k1, kvw, g, d, st_kv + (buf ^ 1) * SQ_KC * ld, ld, nxt, min(SQ_KC, n1_all - nxt));
        else sp_cp_commit();
        sp_cp_wait1();
        __syncthreads();
        if (any && c0 < 4 * cand_hi[ST_TW - 1]) {
#pragma unroll
            for (int mp = 0; mp < 2; mp++) {
                st_qk(acc, qb, st_kv + buf * SQ_KC * ld, ld, d, mp);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int m = 0; m < ST_TW; m++) {
                        float v[2];  // keys gq and gq + 8 of the m-tile
#pragma unroll
                        for (int r = 0; r < 2; r++) {
                            float s = 0.0f;
#pragma unroll
                            for (int h = 0; h < 4; h++)
                                s += st_ex2(acc[j][m][h >> 1][2 * r + (h & 1)] * sl2 - lse[m][h]);
                            s += __shfl_xor_sync(0xffffffffu, s, 1);
                            s += __shfl_xor_sync(0xffffffffu, s, 2);
                            s = round_bf(s);
                            v[r] = (s != s) ? 0.0f : s;
                        }
                        // Maxima of keys 0-3, 4-7 (v[0]) and 8-11, 12-15 (v[1]) of the m-tile.
                        float a = fmaxf(v[0], __shfl_xor_sync(0xffffffffu, v[0], 4));
                        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 8));
                        float b = fmaxf(v[1], __shfl_xor_sync(0xffffffffu, v[1], 4));
                        b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, 8));
                        const float g0a = __shfl_sync(0xffffffffu, a, 0), g1a = __shfl_sync(0xffffffffu, a, 16);
                        const float g0b = __shfl_sync(0xffffffffu, b, 0), g1b = __shfl_sync(0xffffffffu, b, 16);
                        const float k3 = __shfl_sync(0xffffffffu, v[0], 12), k7 = __shfl_sync(0xffffffffu, v[0], 28);
                        const float k11 = __shfl_sync(0xffffffffu, v[1], 12), k15 = __shfl_sync(0xffffffffu, v[1], 28);
                        const float sc = lane == 0 ? fmaxf(g0a, carry[m])
                                         : lane == 1 ? fmaxf(g1a, k3)
                                         : lane == 2 ? fmaxf(g0b, k7)
                                                     : fmaxf(g1b, k11);
                        carry[m] = k15;
                        const int blk = (c0 + 32 * mp + 16 * j) / 4 + lane;
                        if (lane < 4 && blk >= init_blocks && blk < cand_hi[m]) {
                            const int i = blockIdx.x * per_block + ST_TW * warp + m;
                            bs[((size_t)i * kv_heads + g) * bs_stride + blk] = sc;
                        }
                    }
            }
        }
        __syncthreads();
        buf ^= 1;
    }
    sp_cp_wait0();
}

// launch: grid = ((T + 15) / 16, kv_heads), block = 256, dynamic smem = 0 bytes
//   (static shared memory 2·64·136·2 = 34,816 bytes). At most 128 registers, so that two blocks
//   share an SM: 259 ms against 340 ms with one block (160 registers) at 128K on the H200.
extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32, 2)
select_scores_t(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos, int heads,
                int kv_heads, int d, float scale, int block_size, int k1_stride, int k2_window, int k2_stride,
                int init_blocks, int local_blocks, int k_sel, float* bs, int bs_stride) {
    __shared__ __align__(16) bf16 st_kv[2 * SQ_KC * AT_MAXLD];
    st_body(q, k1, k2, n1, n2, T, first_pos, heads, kv_heads, d, scale, block_size, k2_window, k2_stride,
            init_blocks, local_blocks, k_sel, bs, bs_stride, st_kv);
}
