// Softmax attention of the sparse layers, a warp per (query, KV group): attention_gather /
// attention_gather_f8 (prompt chunks: a block's warps, queries at neighbouring positions, read
// the blocks they share once through one ring of shared-memory stages, then each streams the
// rest of its list through its own) and attention_decode(_rows)(_f8) (few queries: warps split
// a pair's blocks and read K and V from global memory), over bf16 or FP8 caches. Layouts in
// sparse/common.cuh.

#include "common/types.cuh"
#include "common/mma.cuh"
#include "common/rows.cuh"
#include "sparse/common.cuh"

// ============================================================================================
// attention_gather: sparse attention of many queries, one warp per (query, KV group)
// ============================================================================================
//
// Neighbouring queries share their forced blocks (the first and the local window's, a third of a
// list) and, with random weights, few others: in prefill a block's warps read the forced ones
// together and the rest each on its own; in decode a warp reads straight from global memory (L2)
// with 16-byte loads (both through ag_keys). The warp's 16 MMA rows are the query's heads of
// the group.
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
    // Asks L2 for key `key`'s K and V rows (d ≤ 128: at most two 128-byte lines each).
    __device__ __forceinline__ void prefetch(int key, int d) const {
        const bf16 *kr = k + key * stride, *vr = v + key * stride;
        sp_prefetch_l2(kr);
        sp_prefetch_l2(vr);
        if (d > 64) sp_prefetch_l2(kr + 64), sp_prefetch_l2(vr + 64);
    }
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
    // Asks L2 for key `key`'s K and V codes (d ≤ 128 bytes) and scales.
    __device__ __forceinline__ void prefetch(int key, int) const {
        const unsigned char *kr = k + key * stride, *vr = v + key * stride;
        sp_prefetch_l2(kr);
        sp_prefetch_l2(vr);
        sp_prefetch_l2(kr + scale_off);
        sp_prefetch_l2(vr + scale_off);
    }
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
// k0: a block of 64 in global memory, or a shared-memory stage of 16 or 32; rows ≥ n_valid are
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

// The indices and strides of a warp's pair (query i at position first_pos + i, KV group g);
// ag_pair also loads its Q fragments.
struct AgPair {
    int i, g, t, n_keys;
    size_t kvw, qw;
    bool row_ok[2];
};

__device__ __forceinline__ AgPair ag_pair(const bf16* q, int i, int g, int T, int first_pos, int heads, int kv_heads,
                                          int d, u32 (&qa)[8][4]) {
    const int gq = (threadIdx.x & 31) >> 2, G = heads / kv_heads;
    AgPair p;
    p.i = i;
    p.g = g;
    p.t = first_pos + i;
    p.n_keys = first_pos + T;
    p.kvw = (size_t)kv_heads * d;
    p.qw = (size_t)heads * d;
    p.row_ok[0] = gq < G;
    p.row_ok[1] = gq + 8 < G;
    sp_load_q_perm(q + (size_t)p.i * p.qw + (size_t)p.g * G * d, G, d, qa);
    return p;
}

// Prefill: stages of KEYS keys (16 or 32) of K and V in shared memory (cp.async), a ring of them; while
// one stage is computed, the ring's others are in flight. Tiles are unpadded rows of d values,
// their 16-byte pieces swizzled so each 8-lane phase of the 16-byte loads hits distinct banks:
// K rows (two rows a phase) swap 64-byte halves on odd rows, V rows (four rows a phase) XOR the
// piece with the row's low 3 bits.
__device__ __forceinline__ u32 ag_k_off(int r, int c, int d) { return r * 2 * d + ((c ^ ((r & 1) << 2)) << 4); }
__device__ __forceinline__ u32 ag_v_off(int r, int c, int d) { return r * 2 * d + ((c ^ (r & 7)) << 4); }

// Stages keys [k0, k0 + KEYS) of one group (kg, vg: its first dim of key 0; rows ≥ n_keys
// zero) into the K and V tiles at shared addresses kt, vt. Thread `tid` of the `nth` that copy
// the stage (nth a multiple of 32) takes piece tid % (D / 8) of rows tid / (D / 8) + i · nth / (D / 8).
template <int D, int KEYS>
__device__ __forceinline__ void ag_issue(u32 kt, u32 vt, const bf16* kg, const bf16* vg, size_t kvw, int k0,
                                         int n_keys, int tid, int nth) {
    constexpr int PIECES = D / 8;
    const int c = tid % PIECES, step = nth / PIECES;
    const bool full = k0 + KEYS <= n_keys;
#pragma unroll 4
    for (int r = tid / PIECES; r < KEYS; r += step) {
        const bool in = full || k0 + r < n_keys;
        const size_t off = in ? (size_t)(k0 + r) * kvw + 8 * c : 0;
        sp_cp_async16(kt + ag_k_off(r, c, D), kg + off, in ? 16 : 0);
        sp_cp_async16(vt + ag_v_off(r, c, D), vg + off, in ? 16 : 0);
    }
}

// A stage of keys in shared memory as ag_keys reads it: 8 dims of key r's K or V as
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
// low bits, so the 8-byte reads of a warp take the two wavefronts they must), then the stage's
// K scales and V scales.
__device__ __forceinline__ u32 ag8_off(int r, int c, int d) { return r * d + ((c ^ (r & (d / 16 - 1))) << 4); }

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

// Stages keys [k0, k0 + KEYS) of an FP8 cache (kg, vg: the group's first code of key 0;
// `scale_off`: bytes from there to the group's scale; rows `stride` bytes; rows ≥ n_keys
// zero) at shared address `at` in StageF8's layout; threads as ag_issue's, the first 32 also
// copy key tid's two scales.
template <int D, int KEYS>
__device__ __forceinline__ void ag8_issue(u32 at, const unsigned char* kg, const unsigned char* vg, size_t stride,
                                          int scale_off, int k0, int n_keys, int tid, int nth) {
    constexpr int PIECES = D / 16;
    const int c = tid % PIECES, step = nth / PIECES;
    const u32 kt = at, vt = at + KEYS * D, st = at + 2 * KEYS * D;
#pragma unroll 4
    for (int r = tid / PIECES; r < KEYS; r += step) {
        const bool in = k0 + r < n_keys;
        const size_t off = in ? (size_t)(k0 + r) * stride + 16 * c : 0;
        sp_cp_async16(kt + ag8_off(r, c, D), kg + off, in ? 16 : 0);
        sp_cp_async16(vt + ag8_off(r, c, D), vg + off, in ? 16 : 0);
    }
    if (tid < KEYS) {
        const bool in = k0 + tid < n_keys;
        const size_t off = in ? (size_t)(k0 + tid) * stride + scale_off : 0;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 4 * tid), "l"(kg + off),
                     "r"(in ? 4 : 0));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 4 * KEYS + 4 * tid),
                     "l"(vg + off), "r"(in ? 4 : 0));
    }
}

// A walk in stages of KEYS keys over nb 64-key blocks, block(j) the j-th (ascending); the
// stages of the last block past t_last are skipped. SHARED: all the block's
// warps walk one ring together, each stage copied by all of them (a block barrier a stage), and
// the `active` ones attend; else the warp walks its own ring alone (no block barriers). `ring`:
// NS stages of `stage` bytes, as a shared address and a pointer; `issue(at, k0, tid, nth)`
// stages keys from k0 at shared address `at`, `tile(p)` reads the stage at pointer p.
template <int KEYS, int NS, bool SHARED, class Block, class Issue, class Tile>
__device__ __forceinline__ void ag_walk(AgState& st, const u32 (&qa)[8][4], bool active, const AgPair& p, int t_last,
                                        int nb, Block&& block, u32 ring, const unsigned char* ring_p, u32 stage,
                                        float sl2, int d, Issue&& issue_at, Tile&& tile) {
    const int tid = SHARED ? (int)threadIdx.x : (int)(threadIdx.x & 31), nth = SHARED ? (int)blockDim.x : 32;
    constexpr int SPB = 64 / KEYS;  // stages a block
    const int n_st = nb == 0 ? 0 : SPB * (nb - 1) + min(SPB, (t_last - 64 * block(nb - 1)) / KEYS + 1);
    auto key0 = [&](int s) { return 64 * block(s / SPB) + KEYS * (s % SPB); };
    auto issue = [&](int s) {
        if (s < n_st) issue_at(ring + (s % NS) * stage, key0(s), tid, nth);
        sp_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < NS - 1; s++) issue(s);
    for (int s = 0; s < n_st; s++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 2) : "memory");
        // Stage s visible to every thread that reads it; stage s − 1's slot free.
        if (SHARED) __syncthreads();
        else __syncwarp();
        issue(s + NS - 1);
        if (active)
            ag_keys<KEYS / 8>(st, qa, tile(ring_p + (s % NS) * stage), key0(s), p.t, KEYS, p.row_ok, sl2, d);
    }
    sp_cp_wait0();
}

// attention_gather(_f8): a block of W = blockDim.x / 32 warps (W a power of two ≤ 64) takes the
// W queries at positions p0 .. p0 + W − 1 (p0 a multiple of W, so they share their 64-key block
// qb; warps outside the chunk only help copy) of KV group g. The blocks every one of them
// attends to, [0, n_init) ∪ [lo2, qb] (the forced ones of a list: init_blocks and the
// local_blocks + 1 ending at qb; without a list every block up to qb), are read once for all W
// through the whole shared memory as one ring; then each warp walks the rest of its list through
// its own part of it, `stages` deep, in stages of KEYS keys. local_blocks < 0: nothing shared.
// The output of a query depends on its position only, never on the chunk around it.
template <int KEYS, class Issue, class Tile>
__device__ __forceinline__ void ag_gather(const bf16* q, bf16* out, int T, int first_pos, int heads, int kv_heads,
                                          int d, float scale, const int* blocks, int k_sel, int stages,
                                          int init_blocks, int local_blocks, u32 stage, Issue&& issue_at,
                                          Tile&& tile) {
    extern __shared__ __align__(128) unsigned char ag_sm[];
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = blockIdx.x % kv_heads, p0 = (first_pos / W + blockIdx.x / kv_heads) * W;
    if (p0 >= first_pos + T) return;  // block-uniform: the launch has a tile to spare
    const int i = p0 + warp - first_pos;
    const bool active = i >= 0 && i < T;  // warp-uniform
    const int t_max = min(p0 + W, first_pos + T) - 1, qb = p0 >> 6;
    int n_init = 0, lo2 = qb + 1;
    if (local_blocks >= 0) {
        n_init = blocks ? min(init_blocks, qb + 1) : qb + 1;
        lo2 = blocks ? min(max(init_blocks, qb - local_blocks), qb + 1) : qb + 1;
    }
    u32 qa[8][4];
    AgPair p = {};  // an inactive warp's only copies stages: its pair is never read
    if (active) p = ag_pair(q, i, g, T, first_pos, heads, kv_heads, d, qa);
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const u32 base = sp_smem_addr(ag_sm);
    const int n_sh = n_init + qb + 1 - lo2;
    auto shared_block = [&](int j) { return j < n_init ? j : lo2 + j - n_init; };
    const int ring_stages = W * stages;
#define AG_SHARED(N)                                                                                       \
    ag_walk<KEYS, N, true>(st, qa, active, p, t_max, n_sh, shared_block, base, ag_sm, stage, sl2, d, issue_at, tile)
    if (ring_stages >= 12) AG_SHARED(12);
    else if (ring_stages >= 8) AG_SHARED(8);
    else if (ring_stages >= 6) AG_SHARED(6);
    else if (ring_stages >= 4) AG_SHARED(4);
    else AG_SHARED(2);
#undef AG_SHARED
    __syncthreads();  // the ring's slots are the warps' own rings from here
    if (!active) return;
    // The rest of the list: its entries in [n_init, lo2) (a list is ascending, −1 padded).
    const int* my = blocks ? blocks + ((size_t)i * kv_heads + g) * k_sel : 0;
    int a = n_init, nb = lo2 - n_init;
    if (my) {
        a = 0, nb = 0;
        for (int s0 = 0; s0 < k_sel; s0 += 32) {
            const int b = s0 + lane < k_sel ? my[s0 + lane] : -1;
            a += __popc(__ballot_sync(0xffffffffu, b >= 0 && b < n_init));
            nb += __popc(__ballot_sync(0xffffffffu, b >= n_init && b < lo2));
        }
    }
    auto own_block = [&](int j) { return my ? my[a + j] : a + j; };
    const u32 own = (u32)(warp * stages) * stage;
#define AG_OWN(N) \
    ag_walk<KEYS, N, false>(st, qa, true, p, p.t, nb, own_block, base + own, ag_sm + own, stage, sl2, d, issue_at, tile)
    if (stages >= 4) AG_OWN(4);
    else if (stages == 3) AG_OWN(3);
    else AG_OWN(2);
#undef AG_OWN
    bf16* orow0 = out + (size_t)p.i * p.qw + (size_t)(g * (heads / kv_heads) + ((lane >> 2))) * d;
    ag_sum_l(st);
    ag_store_out(st, p.row_ok, d, [&](int r) { return orow0 + 8 * r * d; });
}

// ag_gather's stages for a cache of head size D: bf16 (ag_issue, StageBf16) or FP8 (ag8_issue,
// StageF8). The walks take `d` as it comes, at run time.
template <int D, int KEYS>
__device__ __forceinline__ void ag_gather_bf16(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out,
                                               int T, int first_pos, int heads, int kv_heads, int d, float scale,
                                               const int* blocks, int k_sel, int stages, int init_blocks,
                                               int local_blocks) {
    const int g = blockIdx.x % kv_heads;
    const bf16* kg = kcache + (size_t)g * d;
    const bf16* vg = vcache + (size_t)g * d;
    const size_t kvw = (size_t)kv_heads * d;
    const int n_keys = first_pos + T;
    constexpr u32 tile = KEYS * 2 * D;
    ag_gather<KEYS>(
        q, out, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel, stages, init_blocks, local_blocks, 2 * tile,
        [&](u32 at, int k0, int tid, int nth) { ag_issue<D, KEYS>(at, at + tile, kg, vg, kvw, k0, n_keys, tid, nth); },
        [&](const unsigned char* at) { return StageBf16{at, at + tile, D}; });
}

template <int D, int KEYS>
__device__ __forceinline__ void ag_gather_f8(const bf16* q, const unsigned char* kcache, const unsigned char* vcache,
                                             bf16* out, int T, int first_pos, int heads, int kv_heads, int d,
                                             float scale, const int* blocks, int k_sel, int stages, int init_blocks,
                                             int local_blocks) {
    const KvF8 kv = kv_f8(kcache, vcache, blockIdx.x % kv_heads, kv_heads, d);
    const int n_keys = first_pos + T;
    constexpr u32 tile = KEYS * D;
    ag_gather<KEYS>(
        q, out, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel, stages, init_blocks, local_blocks,
        2 * tile + 8 * KEYS,
        [&](u32 at, int k0, int tid, int nth) {
            ag8_issue<D, KEYS>(at, kv.k, kv.v, kv.stride, kv.scale_off, k0, n_keys, tid, nth);
        },
        [&](const unsigned char* at) {
            return StageF8{at, at + tile, (const float*)(at + 2 * tile), (const float*)(at + 2 * tile) + KEYS, D};
        });
}

// launch: grid = ((⌈T / W⌉ + 1)·kv_heads), block = 32·W (W a power of two), dynamic smem =
// W · stages · 4·keys·d bytes (stages 2, 3 or 4; keys 16 or 32 a stage). Same arguments and
// result as attention_prefill with blocks != NULL (64-key blocks; lists holding their forced
// blocks unless local_blocks < 0); needs heads / kv_heads ≤ 16 and d ∈ {64, 128}.
extern "C" __global__ void __launch_bounds__(256)
attention_gather(const bf16* q, const bf16* kcache, const bf16* vcache, bf16* out, int T, int first_pos,
                 int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel, int stages,
                 int init_blocks, int local_blocks, int keys) {
    pdl_start();
#define AG_ARGS q, kcache, vcache, out, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel, stages, init_blocks, local_blocks
    if (keys == 16) {
        if (d == 128) ag_gather_bf16<128, 16>(AG_ARGS);
        else ag_gather_bf16<64, 16>(AG_ARGS);
    } else {
        if (d == 128) ag_gather_bf16<128, 32>(AG_ARGS);
        else ag_gather_bf16<64, 32>(AG_ARGS);
    }
#undef AG_ARGS
}

// attention_gather over an FP8 cache (sparse/common.cuh), and dense when blocks == NULL.
// launch: grid = ((⌈T / W⌉ + 1)·kv_heads), block = 32·W (W a power of two), dynamic smem =
// W · stages · (2·keys·d + 8·keys) bytes (stages 2, 3 or 4; keys 16 or 32 a stage); needs
// heads / kv_heads ≤ 16 and d ∈ {64, 128}.
extern "C" __global__ void __launch_bounds__(256)
attention_gather_f8(const bf16* q, const unsigned char* kcache, const unsigned char* vcache, bf16* out, int T,
                    int first_pos, int heads, int kv_heads, int d, float scale, const int* blocks, int k_sel,
                    int stages, int init_blocks, int local_blocks, int keys) {
    pdl_start();
#define AG_ARGS q, kcache, vcache, out, T, first_pos, heads, kv_heads, d, scale, blocks, k_sel, stages, init_blocks, local_blocks
    if (keys == 16) {
        if (d == 128) ag_gather_f8<128, 16>(AG_ARGS);
        else ag_gather_f8<64, 16>(AG_ARGS);
    } else {
        if (d == 128) ag_gather_f8<128, 32>(AG_ARGS);
        else ag_gather_f8<64, 32>(AG_ARGS);
    }
#undef AG_ARGS
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
    AgPair p = ag_pair(q, pair / kv_heads, pair % kv_heads, T, 0, heads, kv_heads, d, qa);
    p.t = t;
    p.n_keys = n_keys;
    AgState st;
    ag_init(st);
    const float sl2 = scale * 1.4426950408889634f;
    const int* my = blocks ? blocks + (size_t)pair * k_sel : 0;
    const int n_walk = blocks ? k_sel : p.t / 64 + 1;
    // Each block's K and V are asked of L2 before its walk (lane l: keys l and l + 32), and the
    // next block's with them, so the walk's loads, issued a few at a time, wait on L2, not DRAM.
    const int lane = threadIdx.x & 31;
    auto prefetch = [&](int s) {
        const int b = s < n_walk ? (blocks ? my[s] : s) : -1;
        if (b >= 0) {
            const int n = min(p.n_keys - 64 * b, 64);
            const KV at = kv.at((size_t)64 * b);
            if (lane < n) at.prefetch(lane, d);
            if (lane + 32 < n) at.prefetch(lane + 32, d);
        }
    };
    prefetch(z);
    for (int s = z; s < n_walk; s += n_split) {
        const int b = blocks ? my[s] : s;
        if (__any_sync(0xffffffffu, b < 0)) break;  // −1 padded lists; a vote keeps the walk warp-uniform
        prefetch(s + n_split);
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
