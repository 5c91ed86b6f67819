// Decode-time products over 4-bit weights (W4A16): 1 to 16 activation rows, the weights
// dequantised in registers; and the bf16 values of a 4-bit matrix for a prefill product.

#include "common/types.cuh"
#include "common/fp8.cuh"
#include "common/mma.cuh"
#include "gemv/common.cuh"

// ---- 4-bit weights (W4A16) ----
// A [n, k] matrix of 4-bit values q, eight to a word along k (word j of a row: inputs 8j..8j + 7,
// input 8j + 2p at bits 4p and 8j + 2p + 1 at bits 16 + 4p: memory.rs's interleave_w4), each
// row's k / g groups with a word: the bf16 scale s in its low half and the bf16 value
// −(128 + z) of its zero z (a whole number, 0 to 16) in its high half: the weight is
// bf16((q − z)·s), the value the CPU holds for it. k is a multiple of 128 and g of 32 (the host
// packs no other shape: sala_model::memory::packs_w4).
// Held slab-major (memory.rs's w4_records): M-tile T (rows 16T..16T + 15, past n zero) and slab
// S (inputs 128S..128S + 127) are one record of rec = 256 + 16·slots words at (T·slabs + S)·rec,
// slots = 1 when 128 divides g, else 4. Row r's word j of the slab lies at
// (r >> 3)·128 + ((r & 7)·4 + (j >> 2))·4 + (j & 3) (r within the tile), so lane (g, t) of a
// warp reads rows g and g + 8's inputs 32t..32t + 31 as the uint4s at h·512 + lane·16 bytes, a
// slab's 1 KB in two loads of consecutive 16 bytes; then the group words, row r's at
// 256 + r·slots + (t mod slots) (the group of the slab's inputs 32t.. of that row).

// Where row r's words for lane quarter t (inputs 32t..32t + 31 of a slab) and its group word for
// them lie in its record.
__device__ __forceinline__ u32 w4_rec_words(int r, int t) {
    return ((r & 15) >> 3) * 128 + (((r & 7) << 2) + t) * 4;
}
__device__ __forceinline__ u32 w4_rec_group(int r, int t, int slots) {
    return 256 + (r & 15) * slots + (t & (slots - 1));
}
__device__ __forceinline__ int w4_slots(int g) { return (g & 127) ? 4 : 1; }

// Weights 2p and 2p + 1 of a word as a bf16 pair: a shift and one lop3 ((w >> 4p) & 0x000F000F
// | 0x43004300; written as C, the mask and the OR become two) put 128 + q in each half, one
// packed FMA with −(128 + z) gives q − z exactly, a second the product with s rounded once.
__device__ __forceinline__ u32 w4_pair(u32 w, int p, u32 s2, u32 b2) {
    u32 q, d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(q) : "r"(w >> (4 * p)), "n"(0x000F000F), "n"(0x43004300));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(q), "r"(0x3F803F80u), "r"(b2));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(d), "r"(s2), "r"(0x80008000u));
    return d;
}

// The 8 bf16 weights of one word (a 16-byte pack of gemv_mma_tiles_body).
__device__ __forceinline__ uint4 w4_pack(u32 w, u32 s2, u32 b2) {
    return make_uint4(w4_pair(w, 0, s2, b2), w4_pair(w, 1, s2, b2), w4_pair(w, 2, s2, b2), w4_pair(w, 3, s2, b2));
}

// A warp's 4-bit weights for one slab (128 k) of rows row[0], row[1]: lane t's 32 consecutive k
// of each (one 16-byte load of words), with their group's word of scale and bias. With PAIRED
// they are made bf16x2 pairs as loaded; else the word stays as loaded until its slab makes the
// pairs, so the warp does not wait for the loads of its next slab before it multiplies the
// current one (a third of gemv_w4_8's stall samples; gemv_w4_16 pairs them at once, as it
// spills more the other way).
template <bool PAIRED>
struct W4Slab {
    uint4 raw[2];
    u32 sb[2], bi[2];  // PAIRED: the scale and bias pairs; else sb holds the loaded word
    __device__ __forceinline__ u32 scale2(int h) const { return PAIRED ? sb[h] : __byte_perm(sb[h], 0, 0x1010); }
    __device__ __forceinline__ u32 bias2(int h) const { return PAIRED ? bi[h] : __byte_perm(sb[h], 0, 0x3232); }
};

// y = round(x · w[o]) over a 4-bit matrix (k a multiple of 128: a slab's MMAs take the whole
// warp; the host holds other shapes as bf16) for nb ≤ 8·NT rows, outputs as gemv: M-tiles of 16
// weight rows, a block running tiles blockIdx.x, + gridDim.x, ... in turn. Warp w takes slabs w,
// w + 16, ... (128 k each) in order, each word made 8 bf16 weights in registers and multiplied
// with the MMAs of gemv_mma_tiles_body (the same pairing of weights and activations), and asks for its
// next slab's words (this tile's, else the next tile's first) before it multiplies the current;
// the warps' sums are added in warp order, so a row's result does not depend on nb.
// SILU: w is [gate; up] (n = 2·inter, inter a multiple of 8), each M-tile 8 gate rows j..j + 7
// and their up rows, and y0 gets round(round(silu(round(g))) · round(u)), what silu_mul_halves
// makes of the product's rows (a row's sum does not depend on the tile it is in).
// NORM (NT = 1, nb = 1): x is made in the block from nm (gm_add_norm_row), in dynamic shared
// memory (2·k bytes).
template <int NT, bool SILU, bool NORM = false>
__device__ __forceinline__ void gemv_w4_body(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0,
                                             int n0, bf16* y1, int n1, bf16* y2, int n2, bf16* y3,
                                             const GmNorm& nm = GmNorm{}) {
    static_assert(!NORM || NT == 1, "a normed product takes one row");
    extern __shared__ uint4 gm_norm_rows[];
    // The warps' sums in two buffers, tiles taking turns, as gemv_mma_tiles_body; gemv_w4_16
    // keeps one and a second barrier a tile (the turn's register would make it spill).
    constexpr int BUFS = NT == 1 ? 2 : 1;
    __shared__ float red[BUFS][GM_WARPS][NT * 128];
    int turn = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gl = lane >> 2, t = lane & 3;
    const int inter = n / 2, tiles = SILU ? (inter + 7) / 8 : (n + 15) / 16, slabs = (k + 127) / 128;
    const int slots = w4_slots(g);
    const u32 rec_words = 256 + 16 * slots, tile_words = slabs * rec_words;
    using Slab = W4Slab<(NT > 1)>;
    // In a record (at rec + o), the lane's words of the tile's first 8 rows lie at wl + o and
    // its rows' group word at gw + o; of its second 8 rows, 128 and 8·slots further on. The
    // 1-8-row products keep the slab in hand as running offsets: rows 16·tile.. of one record at
    // wl + ro[0] (the second 8 rows' words 128 on, group words 8·slots on); SILU's gate rows
    // 8·tile.. and up rows inter + 8·tile.. (inter a multiple of 8), each 8 rows of its own
    // record, words at rec + ro[h] and group word at rec + ro[h] + gd[h] (fewer registers than
    // pointers). A warp's next slab of the same tile is GM_WARPS records on: an add or two, not
    // the offsets' derivation from tile and slab (3-5% faster a product, H100). The 9-16-row
    // products, short of registers, derive them for every slab.
    constexpr bool RUNNING = NT == 1;
    const u32* wl = rec + lane * 4;
    const u32* gw = rec + 256 + gl * slots + (t & (slots - 1));
    u32 ro[2];
    int gd[2];
    auto first = [&](int tile, int s) {  // the running offsets at slab s of a tile
        if (!SILU) {
            ro[0] = tile * tile_words + s * rec_words;
            return;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 b = (u32)(h * inter >> 3) + tile, half = b & 1;
            ro[h] = (b >> 1) * tile_words + s * rec_words + half * 128 + lane * 4;
            gd[h] = (int)(256 + gl * slots + (t & (slots - 1)) - lane * 4) + (int)half * (8 * slots - 128);
        }
    };
    auto load_words = [&](Slab& a, int h, const u32* words, const u32* group) {
        a.raw[h] = __ldg((const uint4*)words);
        const u32 w = __ldg(group);
        a.sb[h] = NT > 1 ? __byte_perm(w, 0, 0x1010) : w;
        if (NT > 1) a.bi[h] = __byte_perm(w, 0, 0x3232);
    };
    auto load = [&](Slab& a) {  // the slab at the running offsets
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (SILU)
                load_words(a, h, rec + ro[h], rec + (ro[h] + gd[h]));
            else
                load_words(a, h, wl + ro[0] + 128 * h, gw + ro[0] + 8 * slots * h);
        }
    };
    auto load_at = [&](int tile, int s, Slab& a) {  // slab s of a tile, its offsets derived
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 b = SILU ? (u32)(h * inter >> 3) + tile : 2 * tile + h;
            const u32 base = (b >> 1) * tile_words + s * rec_words, half = b & 1;
            load_words(a, h, rec + (base + half * 128 + lane * 4),
                       rec + (base + 256 + (half * 8 + gl) * slots + (t & (slots - 1))));
        }
    };
    // Lane columns past nb read row nb − 1 (their sums are not stored), so no load is predicated;
    // the lane's inputs of slab s lie at xr[nt] + kk, kk = 128·s (+ 32·t but in gemv_w4_8).
    const bf16* xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) xr[nt] = x + (size_t)min(nt * 8 + gl, nb - 1) * k + (RUNNING && !SILU ? t * 32 : 0);
    Slab a, an;
    if (RUNNING) first(blockIdx.x, warp);
    if ((int)blockIdx.x < tiles && warp < slabs) {
        if (RUNNING)
            load(a);
        else
            load_at(blockIdx.x, warp, a);
    }
    pdl_start();
    if (NORM) gm_add_norm_row(nm, k, gm_norm_rows);
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        float c[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[nt][i] = 0.0f;
        // Slab s from cur, after asking for the warp's next slab (this tile's, else the next
        // tile's first) into nxt; the loop takes two a turn, so the two buffers swap roles
        // without copies.
        auto slab = [&](const Slab& cur, Slab& nxt, int s) {
            if (!RUNNING) {
                if (s + GM_WARPS < slabs)
                    load_at(tile, s + GM_WARPS, nxt);
                else if (tile + (int)gridDim.x < tiles)
                    load_at(tile + gridDim.x, warp, nxt);
            } else if (s + GM_WARPS < slabs) {
                ro[0] += GM_WARPS * rec_words;
                if (SILU) ro[1] += GM_WARPS * rec_words;
                load(nxt);
            } else if (tile + (int)gridDim.x < tiles) {
                first(tile + gridDim.x, warp);
                load(nxt);
            }
            const int kk = s * 128 + (RUNNING && !SILU ? 0 : t * 32);
            const u32 lo_w[4] = {cur.raw[0].x, cur.raw[0].y, cur.raw[0].z, cur.raw[0].w};
            const u32 hi_w[4] = {cur.raw[1].x, cur.raw[1].y, cur.raw[1].z, cur.raw[1].w};
#pragma unroll
            for (int p = 0; p < 4; p++) {
                const uint4 lo = w4_pack(lo_w[p], cur.scale2(0), cur.bias2(0));
                const uint4 hi = w4_pack(hi_w[p], cur.scale2(1), cur.bias2(1));
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 x8 = NORM ? gm_norm_rows[gm_x_slot(s * 16 + t * 4 + p)]
                                          : __ldg((const uint4*)(xr[nt] + kk + 8 * p));
                    sp_mma(c[nt], lo.x, hi.x, lo.y, hi.y, x8.x, x8.y);
                    sp_mma(c[nt], lo.z, hi.z, lo.w, hi.w, x8.z, x8.w);
                }
            }
        };
        gm_slab_turns(slabs, a, an, slab, [](Slab& to, const Slab& from) { to = from; });
        const int v = threadIdx.x;
        if (SILU) {
            // Gate sums are fragments 0, 1 and up sums 2, 3 of the same lane (as gemv_silu_mma).
            const int nt = v >> 6, i = (v >> 5) & 1, l = v & 31, vg = nt * 128 + i * 32 + l;
            const float gs = gm_block_sum<NT>(red[turn], c, v < NT * 64 ? vg : NT * 128, 1);
            const float us = v < NT * 64 ? gm_grouped_sum(&red[turn][0][vg + 64], NT * 128, 1) : 0.0f;
            const int j = tile * 8 + (l >> 2), b = nt * 8 + 2 * (l & 3) + i;
            if (v < NT * 64 && j < inter && b < nb)
                y0[(u64)b * inter + j] = f2bf(silu_times(round_bf(gs), round_bf(us)));
        } else {
            const float sum = gm_block_sum<NT>(red[turn], c, v, 1);
            const int nt = v >> 7, i = (v >> 5) & 3, l = v & 31;
            const int o = tile * 16 + (l >> 2) + (i >= 2 ? 8 : 0), b = nt * 8 + 2 * (l & 3) + (i & 1);
            if (v < NT * 128 && o < n && b < nb) gemv_store(sum, o, b, y0, n0, y1, n1, y2, n2, y3, n);
        }
        if (BUFS == 2)
            turn ^= 1;
        else
            __syncthreads();  // red is free for the next tile
    }
    if (NORM) gm_store_residual(nm, k);
}

// launch: grid = min(ceil(n / 16), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_w4_8(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0, int n0, bf16* y1, int n1,
          bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_w4_body, after its first weights are asked for)
    gemv_w4_body<1, false>(x, rec, n, k, g, nb, y0, n0, y1, n1, y2, n2, y3);
}

// gemv_w4_8 for nb ≤ 16, held to 64 registers for two blocks an SM (free it needs more: one
// block an SM, 10% slower at 16 rows on an H100; held, it spills a word once a tile, outside
// the slab loop).
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_w4_16(const bf16* x, const u32* rec, int n, int k, int g, int nb, bf16* y0, int n0, bf16* y1, int n1,
           bf16* y2, int n2, bf16* y3) {
    // (the PDL wait: in gemv_w4_body, after its first weights are asked for)
    gemv_w4_body<2, false>(x, rec, n, k, g, nb, y0, n0, y1, n1, y2, n2, y3);
}

// The SiLU product of a 4-bit [gate; up] ([2·inter, k]): y[b·inter + j] for nb ≤ 8 rows.
// launch: grid = min(ceil(inter / 8), 2 · SMs), block = 32 * GM_WARPS, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_8(const bf16* x, const u32* rec, bf16* y, int inter, int k, int g, int nb) {
    gemv_w4_body<1, true>(x, rec, 2 * inter, k, g, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// gemv_silu_w4_8 of one row made from the residual h and branch as add_rms_norm makes it
// (GmNorm): h += round(branch·scale) (stored by the block that ends last), a = RMSNorm(h)·w, y
// the SiLU product of a. k ≤ 8192, a multiple of 128.
// launch: as gemv_silu_w4_8, dynamic smem = 2·k bytes; ticket 0 (and left 0)
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_8_norm(const u32* rec, bf16* y, int inter, int k, int g, bf16* h, const bf16* branch, float scale,
                    const bf16* w, float eps, bf16* a, u32* ticket) {
    const GmNorm nm{h, branch, scale, w, eps, a, ticket};
    gemv_w4_body<1, true, true>(a, rec, 2 * inter, k, g, 1, y, 0, nullptr, 0, nullptr, 0, nullptr, nm);
}

// gemv_silu_w4_8 for nb ≤ 16 (held as gemv_w4_16).
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, 2)
gemv_silu_w4_16(const bf16* x, const u32* rec, bf16* y, int inter, int k, int g, int nb) {
    gemv_w4_body<2, true>(x, rec, 2 * inter, k, g, nb, y, 0, nullptr, 0, nullptr, 0, nullptr);
}

// The bf16 weights of rows r0.. of a 4-bit matrix: out[r][i] for `words` words (rows · k / 8),
// for a cuBLAS product of a prefill chunk.
// launch: grid = ceil(words / 256), block = 256, dynamic smem = 0
extern "C" __global__ void __launch_bounds__(256)
dequant_w4(const u32* rec, int r0, int k, int g, u64 words, bf16* out) {
    pdl_start();
    const u64 i = (u64)blockIdx.x * 256 + threadIdx.x;
    if (i >= words) return;
    const int per_row = k / 8, slots = w4_slots(g), rec_words = 256 + 16 * slots;
    const int row = r0 + (int)(i / per_row), j = (int)(i % per_row), t = (j >> 2) & 3;
    const u64 base = ((u64)(row >> 4) * (k / 128) + (j >> 4)) * rec_words;
    const u32 gw = rec[base + w4_rec_group(row, t, slots)];
    const u32 s2 = __byte_perm(gw, 0, 0x1010), b2 = __byte_perm(gw, 0, 0x3232);
    const u32 w = rec[base + w4_rec_words(row, t) + (j & 3)];
    u32* o = (u32*)(out + i * 8);
#pragma unroll
    for (int e = 0; e < 4; e++) o[e] = w4_pair(w, e, s2, b2);
}
