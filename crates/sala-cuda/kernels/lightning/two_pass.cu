// Lightning prefill in two passes on tensor cores: lightning_states walks the chunks in order for
// the state before each, then lightning_outputs computes every chunk's outputs in parallel, each
// output with the bits lightning_fused gives it.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "lightning/common.cuh"

// Chunk states for lightning_outputs: block (h, y) walks the call's chunks in order for value
// columns e0 = 32·y .. e0 + 32 of head h, doing step (d) of lightning_fused with the same
// operations in the same order (so the same bits), warp w on key rows 16w .. 16w + 15. Before
// each chunk c it writes the state as bf16 hi and lo (what (b) reads) to chunk_states
// [c][heads][2][d][d]; at the end the fp32 state to `state`. Each step makes the next chunk's
// Vd after issuing this chunk's MMAs (Vd in two buffers), so a step has one block barrier and
// the Vd work runs under the MMA chain. Needs d 64 or 128.
#define LS_VS 32
#define LS_LDV (LS_VS + 8)
#define LS_STAGES 3  // chunks of K and the V slice staged: this one, the next (its Vd), one loading
#define LS_OFF_V(d) (LS_STAGES * LF_C * lf_ld(d) * 2)
#define LS_OFF_VD(d) (LS_OFF_V(d) + LS_STAGES * LF_C * LS_LDV * 2)
#define LS_OFF_PW(d) (LS_OFF_VD(d) + 2 * 2 * LF_C * LS_LDV * 2)
#define LS_SMEM(d) (LS_OFF_PW(d) + 68 * 4)

// Stages chunk c (rows [64c, 64c + len)) of K and the V slice into buffer `buf` (rows ≥ len
// zero); the block has 2·D threads: thread t copies 16-byte piece t % (D / 8) of K rows
// t / (D / 8) + 16i and piece t % 4 of V rows t / 4 + (D / 2)i. kb and vb are this thread's
// first K and V pieces of chunk 0; kvw the row stride.
template <int D>
__device__ __forceinline__ void ls_issue(const bf16* kb, const bf16* vb, unsigned char* sm, int buf, int c, int len,
                                         size_t kvw) {
    constexpr int threads = 2 * D, segs = D / 8, k_rows = threads / segs, v_rows = threads / 4;
    const int ld = lf_ld(D);
    const int jk = threadIdx.x / segs, pk = threadIdx.x % segs, jv = threadIdx.x / 4, pv = threadIdx.x % 4;
    const size_t at = (size_t)c * LF_C * kvw;
    const bf16* sk = kb + at;
    const bf16* sv = vb + at;
    const u32 dk = sp_smem_addr((bf16*)sm + buf * LF_C * ld + jk * ld + 8 * pk);
    const u32 dv = sp_smem_addr((bf16*)(sm + LS_OFF_V(D)) + buf * LF_C * LS_LDV + jv * LS_LDV + 8 * pv);
    if (len == LF_C) {
#pragma unroll
        for (int i = 0; i < LF_C / k_rows; i++) sp_cp_async16(dk + 2 * k_rows * i * ld, sk + k_rows * i * kvw, 16);
#pragma unroll
        for (int i = 0; i < LF_C / v_rows; i++)
            sp_cp_async16(dv + 2 * v_rows * i * LS_LDV, sv + v_rows * i * kvw, 16);
    } else {
        // A row past len reads nothing (source size 0) from the chunk's first rows.
#pragma unroll
        for (int i = 0; i < LF_C / k_rows; i++) {
            const bool in = jk + k_rows * i < len;
            sp_cp_async16(dk + 2 * k_rows * i * ld, in ? sk + k_rows * i * kvw : sk, in ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < LF_C / v_rows; i++) {
            const bool in = jv + v_rows * i < len;
            sp_cp_async16(dv + 2 * v_rows * i * LS_LDV, in ? sv + v_rows * i * kvw : sv, in ? 16 : 0);
        }
    }
    sp_cp_commit();
}

// launch: grid = (heads, d / 32), block = 2·d (d / 16 warps), dynamic smem = LS_SMEM(d) bytes
//         (88,336 for d = 128)
template <int D>
__device__ __forceinline__ void ls_body(const bf16* k, const bf16* v, float* state, bf16* chunk_states,
                                        const float* slopes, int T, int heads, int kv_heads) {
    constexpr int d = D, threads = 2 * D;
    extern __shared__ __align__(16) unsigned char ls_sm[];
    const int h = blockIdx.x, e0 = LS_VS * blockIdx.y;
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int ld = lf_ld(d), a0 = 16 * warp;
    bf16* const vd0 = (bf16*)(ls_sm + LS_OFF_VD(d));  // [2 buffers][hi, lo][LF_C][LS_LDV]
    float* pw = (float*)(ls_sm + LS_OFF_PW(d));
    const float g = -slopes[h];
    for (int x = threadIdx.x; x <= LF_C; x += threads) pw[x] = lc_pow(g, x);

    // The state slice: key rows a0 + gq (+8), value columns e0 + 8nt + 2tq (+1).
    const size_t slice = (size_t)h * d * d + e0;
    float sa[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) sa[nt][x] = state[slice + (size_t)(a0 + gq + 8 * (x >> 1)) * d + 8 * nt + 2 * tq + (x & 1)];

    const int n_chunks = (T + LF_C - 1) / LF_C;
    const size_t kvw = (size_t)kv_heads * d;
    const bf16* const kb = k + (size_t)(threadIdx.x / (d / 8)) * kvw + (size_t)kvh * d + 8 * (threadIdx.x % (d / 8));
    const bf16* const vb = v + (size_t)(threadIdx.x / 4) * kvw + (size_t)kvh * d + e0 + 8 * (threadIdx.x % 4);
    // Chunk c loads into buffer c % LS_STAGES, two chunks ahead (a group a chunk, empty past
    // the end).
    auto issue = [&](int c) {
        if (c < n_chunks) ls_issue<D>(kb, vb, ls_sm, c % LS_STAGES, c, min(LF_C, T - c * LF_C), kvw);
        else sp_cp_commit();
    };
    // Vd of chunk c = γ^{len−1−j} v_j as bf16 hi + lo (rows ≥ len are zero), 8 values at a
    // time, into Vd buffer c & 1.
    auto vd_make = [&](int c) {
        const int len = min(LF_C, T - c * LF_C);
        const bf16* vs = (const bf16*)(ls_sm + LS_OFF_V(d)) + (c % LS_STAGES) * LF_C * LS_LDV;
        bf16* vdh = vd0 + (c & 1) * 2 * LF_C * LS_LDV;
        bf16* vdl = vdh + LF_C * LS_LDV;
#pragma unroll
        for (int i = 0; i < LF_C * 4 / threads; i++) {
            const int x = threadIdx.x + threads * i, j = x >> 2, c0 = 8 * (x & 3);
            const float f = (j < len) ? pw[len - 1 - j] : 0.0f;
            const uint4 w = *(const uint4*)(vs + j * LS_LDV + c0);
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
            u32 hi[4], lo[4];
#pragma unroll
            for (int y = 0; y < 4; y++) sp_split2(lt_lo(ws[y]) * f, lt_hi(ws[y]) * f, hi[y], lo[y]);
            *(uint4*)(vdh + j * LS_LDV + c0) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *(uint4*)(vdl + j * LS_LDV + c0) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
    };
    issue(0);
    issue(1);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    __syncthreads();  // chunk 0 staged, pw written
    vd_make(0);
    const int r8 = lane & 7, m8 = lane >> 3;
    for (int c = 0; c < n_chunks; c++) {
        const int len = min(LF_C, T - c * LF_C);
        // The state before chunk c.
        bf16* dst = chunk_states + ((size_t)c * heads + h) * 2 * d * d + e0;
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                u32 hi, lo;
                sp_split2(sa[nt][2 * r], sa[nt][2 * r + 1], hi, lo);
                const size_t off = (size_t)(a0 + gq + 8 * r) * d + 8 * nt + 2 * tq;
                *(u32*)(dst + off) = hi;
                *(u32*)(dst + (size_t)d * d + off) = lo;
            }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        // Vd of chunk c written and chunk c + 1 staged; every warp is done with chunk c − 1
        // (its K buffer, which takes chunk c + 2, and its Vd buffer, which takes chunk c + 1's).
        __syncthreads();
        issue(c + 2);
        const bf16* ks = (const bf16*)ls_sm + (c % LS_STAGES) * LF_C * ld;
        const bf16* vdh = vd0 + (c & 1) * 2 * LF_C * LS_LDV;
        const bf16* vdl = vdh + LF_C * LS_LDV;

        // S = γ^len S + Kᵀ Vd (A = Kᵀ from the [j][key] tile, transposed).
        const float dl = pw[len];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int x = 0; x < 4; x++) sa[nt][x] *= dl;
        // Every fragment of the chunk first (80 registers), then the MMAs in their order.
        u32 bh[4][2][4], bl[4][2][4], a[4][4];
#pragma unroll
        for (int ks4 = 0; ks4 < 4; ks4++) {
#pragma unroll
            for (int np = 0; np < 2; np++) {
                const int off = (16 * ks4 + r8 + 8 * (m8 & 1)) * LS_LDV + 16 * np + 8 * (m8 >> 1);
                ldsm_x4_t(bh[ks4][np], sp_smem_addr(vdh + off));
                ldsm_x4_t(bl[ks4][np], sp_smem_addr(vdl + off));
            }
            ldsm_x4_t(a[ks4], sp_smem_addr(ks + (16 * ks4 + r8 + 8 * (m8 >> 1)) * ld + a0 + 8 * (m8 & 1)));
        }
#pragma unroll
        for (int ks4 = 0; ks4 < 4; ks4++)
#pragma unroll
            for (int np = 0; np < 2; np++) {
                const u32* f = a[ks4];
                sp_mma(sa[2 * np], f[0], f[1], f[2], f[3], bh[ks4][np][0], bh[ks4][np][1]);
                sp_mma(sa[2 * np], f[0], f[1], f[2], f[3], bl[ks4][np][0], bl[ks4][np][1]);
                sp_mma(sa[2 * np + 1], f[0], f[1], f[2], f[3], bh[ks4][np][2], bh[ks4][np][3]);
                sp_mma(sa[2 * np + 1], f[0], f[1], f[2], f[3], bl[ks4][np][2], bl[ks4][np][3]);
            }
        if (c + 1 < n_chunks) vd_make(c + 1);
    }
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int x = 0; x < 4; x++) state[slice + (size_t)(a0 + gq + 8 * (x >> 1)) * d + 8 * nt + 2 * tq + (x & 1)] = sa[nt][x];
}

extern "C" __global__ void __launch_bounds__(256, 1)
lightning_states(const bf16* k, const bf16* v, float* state, bf16* chunk_states, const float* slopes, int T,
                 int heads, int kv_heads, int d) {
    pdl_start();
    if (d == 128) ls_body<128>(k, v, state, chunk_states, slopes, T, heads, kv_heads);
    else ls_body<64>(k, v, state, chunk_states, slopes, T, heads, kv_heads);
}

// Outputs of 64-token chunks in parallel, from the states lightning_states left in chunk_states:
// block (c, h, z) computes out rows of chunk c, head h, value columns e0 = 64·z .. e0 + 64, as
// (a)–(c) of lightning_fused with the same operands and summation order, so each output has the
// bits the one-pass kernel gives it. Tiles are unpadded, their 16-byte pieces swizzled (piece p
// of row r at p ^ (r & 7)) so ldmatrix stays conflict-free; at 74,000 bytes three blocks fit an
// SM. Needs d 64 or 128.
#define LO_VS 64
#define LO_OFF_K(d) (LF_C * (d) * 2)
#define LO_OFF_V(d) (2 * LO_OFF_K(d))
#define LO_OFF_S(d) (LO_OFF_V(d) + LF_C * LO_VS * 2)
#define LO_OFF_PW(d) (LO_OFF_S(d) + 2 * (d) * LO_VS * 2)
#define LO_SMEM(d) (LO_OFF_PW(d) + 68 * 4)

// Element offset of 16-byte piece p within row r of a swizzled tile.
__device__ __forceinline__ int lo_sw(int r, int p) { return 8 * (p ^ (r & 7)); }

// launch: grid = (chunks, heads, d / 64), block = 128, dynamic smem = LO_SMEM(d) bytes
//         (74,000 for d = 128)
extern "C" __global__ void __launch_bounds__(128)
lightning_outputs(const bf16* q, const bf16* k, const bf16* v, const bf16* chunk_states, bf16* out,
                  const float* slopes, int T, int heads, int kv_heads, int d, float scale) {
    pdl_start();
    extern __shared__ __align__(16) unsigned char lo_sm[];
    const int c = blockIdx.x, h = blockIdx.y, e0 = LO_VS * blockIdx.z;
    const int j0 = c * LF_C, len = min(LF_C, T - j0);
    const int kvh = h / (heads / kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    const int ksteps = d / 16, seg_shift = __ffs(d / 8) - 1, d_shift = __ffs(d) - 1;
    const size_t qw = (size_t)heads * d, kvw = (size_t)kv_heads * d;
    bf16* qs = (bf16*)lo_sm;
    bf16* ks = (bf16*)(lo_sm + LO_OFF_K(d));
    bf16* vs = (bf16*)(lo_sm + LO_OFF_V(d));
    bf16* sh = (bf16*)(lo_sm + LO_OFF_S(d));
    bf16* sl = sh + d * LO_VS;
    float* pw = (float*)(lo_sm + LO_OFF_PW(d));
    for (int x = threadIdx.x; x < LF_C << seg_shift; x += 128) {
        const int j = x >> seg_shift, p = x & ((1 << seg_shift) - 1);
        const bool in = j < len;
        const bf16* sq = in ? q + (size_t)(j0 + j) * qw + (size_t)h * d + 8 * p : q;
        const bf16* sk = in ? k + (size_t)(j0 + j) * kvw + (size_t)kvh * d + 8 * p : k;
        sp_cp_async16(sp_smem_addr(qs + j * d + lo_sw(j, p)), sq, in ? 16 : 0);
        sp_cp_async16(sp_smem_addr(ks + j * d + lo_sw(j, p)), sk, in ? 16 : 0);
    }
    for (int x = threadIdx.x; x < LF_C * (LO_VS / 8); x += 128) {
        const int j = x >> 3, p = x & 7;
        const bool in = j < len;
        const bf16* sv = in ? v + (size_t)(j0 + j) * kvw + (size_t)kvh * d + e0 + 8 * p : v;
        sp_cp_async16(sp_smem_addr(vs + j * LO_VS + lo_sw(j, p)), sv, in ? 16 : 0);
    }
    sp_cp_commit();  // Q, K, V: (a) starts while the state still loads
    const bf16* src = chunk_states + ((size_t)c * heads + h) * 2 * d * d + e0;
    for (int x = threadIdx.x; x < 2 * d * (LO_VS / 8); x += 128) {
        const int part = x >> (d_shift + 3), a = (x >> 3) & (d - 1), p = x & 7;
        sp_cp_async16(sp_smem_addr((part ? sl : sh) + a * LO_VS + lo_sw(a, p)), src + ((size_t)part * d + a) * d + 8 * p,
                      16);
    }
    sp_cp_commit();
    const float g = -slopes[h];
    for (int x = threadIdx.x; x <= LF_C; x += 128) pw[x] = lc_pow(g, x);
    sp_cp_wait1();
    __syncthreads();

    const int r8 = lane & 7, m8 = lane >> 3;
    // (a) A = Q Kᵀ for rows 16w.., Q fragments kept for (b).
    const int i0 = 16 * warp;
    u32 qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
        if (kk < ksteps) {
            const int r = i0 + r8 + 8 * (m8 & 1);
            ldsm_x4(qa[kk], sp_smem_addr(qs + r * d + lo_sw(r, 2 * kk + (m8 >> 1))));
        }
    float A[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) A[nt][0] = A[nt][1] = A[nt][2] = A[nt][3] = 0.0f;
#pragma unroll
    for (int np = 0; np < 4; np++)
#pragma unroll
        for (int kk = 0; kk < 8; kk++)
            if (kk < ksteps) {
                u32 b[4];
                const int r = 16 * np + r8 + 8 * (m8 >> 1);
                ldsm_x4(b, sp_smem_addr(ks + r * d + lo_sw(r, 2 * kk + (m8 & 1))));
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
    sp_cp_wait0();
    __syncthreads();  // S staged

    // (b) O = Q S over the block's 64 value columns.
    float O[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) O[nt][0] = O[nt][1] = O[nt][2] = O[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
        if (kk < ksteps)
#pragma unroll
            for (int part = 0; part < 2; part++) {
                const bf16* sp = part ? sl : sh;
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    u32 b[4];
                    const int r = 16 * kk + r8 + 8 * (m8 & 1);
                    ldsm_x4_t(b, sp_smem_addr(sp + r * LO_VS + lo_sw(r, 2 * np + (m8 >> 1))));
                    sp_mma(O[2 * np], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                    sp_mma(O[2 * np + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
                }
            }
    const float di[2] = {pw[min(ir[0] + 1, LF_C)], pw[min(ir[1] + 1, LF_C)]};
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
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
        for (int np = 0; np < 4; np++) {
            u32 b[4];
            const int r = 16 * ks4 + r8 + 8 * (m8 & 1);
            ldsm_x4_t(b, sp_smem_addr(vs + r * LO_VS + lo_sw(r, 2 * np + (m8 >> 1))));
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
            for (int nt = 0; nt < 8; nt++)
                *(u32*)(op + 8 * nt) = sp_pack_bf16(scale * O[nt][2 * r], scale * O[nt][2 * r + 1]);
        }
}
