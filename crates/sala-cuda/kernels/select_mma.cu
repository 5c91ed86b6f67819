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

__device__ __forceinline__ float st_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// (mx, l) ← the merge of two online-softmax states (max, sum of exp2 relative to the max).
__device__ __forceinline__ void st_merge(float& mx, float& l, float mo, float lo) {
    const float mn = fmaxf(mx, mo);
    const float mu = (mn == -__int_as_float(0x7f800000)) ? 0.0f : mn;
    l = l * st_ex2(mx - mu) + lo * st_ex2(mo - mu);
    mx = mn;
}

// st_merge over the 8 lanes of a warp that share lane % 4 (the rows of an MMA fragment).
__device__ __forceinline__ void st_merge_rows(float& mx, float& l) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1)
        st_merge(mx, l, __shfl_xor_sync(0xffffffffu, mx, o), __shfl_xor_sync(0xffffffffu, l, o));
}

// Lane-wise max of two bf16x2 pairs (a NaN loses to a number).
__device__ __forceinline__ u32 st_max2(u32 a, u32 b) {
    u32 r;
    asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

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
                int init_blocks, int local_blocks, int k_sel, float* bs, int bs_stride) {
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
                        const float sc = __uint_as_float(max(own, prev) << 16);
                        carry[m] = p7 >> 16;
                        const int blk = (c0 + 32 * mp + 16 * j) / 4 + lane;
                        if (lane < 4 && blk >= init_blocks && blk < cand_hi[m]) {
                            const int i = blockIdx.x * per_block + SQ_TW * warp + m;
                            bs[((size_t)i * kv_heads + g) * bs_stride + blk] = sc;
                        }
                    }
            }
        }
    });
}

