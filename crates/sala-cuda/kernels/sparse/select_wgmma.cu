// Block scores for prefill selection on Hopper's warpgroup MMA (wgmma, sm_90a only; compiled
// empty elsewhere, where select_scores_t, its mma.sync twin, runs). Same arguments and outputs
// as select_scores_t and the same scores up to float rounding; needs d = 128, at most 16 query
// heads per KV group and 4 level-1 windows per block.
//
// A block of 2 warpgroups owns 16 consecutive tokens of one KV group, 8 per warpgroup. The
// MMA computes S^T = K Qᵀ per staged 64-key tile: rows are keys (warp w of a warpgroup holds
// keys 16w + gq (+8)), columns 16·token + head, both operands in shared memory in the 128-byte
// swizzled K-major layout (two 64-dim panels). Pass 1 walks the level-2 keys (m64n64 for each
// half of the tokens, so the online max and sum fit in registers); pass 2 walks the level-1
// keys (m64n128), sums each key's P over the heads in the quad of lanes that holds them, and
// max-pools through shared memory: one (token, block) a thread. Warpgroup 1 stages the key
// tiles two ahead through mbarriers, and the warpgroups take turns at the MMAs, so neither
// waits for the other but at a turn (scripts/select-pipeline-protocol.py checks the protocol).

#include "common/types.cuh"
#include "common/mma.cuh"
#include "sparse/common.cuh"

#define SW_TOK 8                  // tokens per warpgroup
#define SW_PANEL_K 8192           // a 64-dim panel of a key tile: 64 rows of 128 bytes
#define SW_PANEL_Q 16384          // a 64-dim panel of a warpgroup's queries: 128 rows
#define SW_Q_OFF 0                // 2 warpgroups x 2 panels
#define SW_K_OFF 65536            // 2 key tiles (double buffer) x 2 panels
#define SW_ML_OFF 98304           // pass-1 partial (max, sum): [wg][warp][token][head] float2
#define SW_LSE_OFF 106496         // [wg][token][tq][4] float: heads 2tq, 2tq + 1, 8 + 2tq, 9 + 2tq
#define SW_P_OFF 107520           // pass-2 P: [wg][token][128] bf16, a ring of two tiles
#define SW_BAR_OFF 111616         // the key tiles' mbarriers: full[2], empty[2]
#define SW_SMEM_USED 111648
// launch: dynamic smem = SW_SMEM_USED + 1024 (the base is aligned up to 1024 bytes)

// Byte offset of 16-byte chunk c (of 16: dims 8c .. 8c + 7) of row r in a swizzled tile.
__device__ __forceinline__ u32 sw_off(int r, int c, int panel) {
    return (c >> 3) * panel + r * 128 + ((((c & 7) ^ r) & 7) << 4);
}

// Matrix descriptor of a K-major operand with the 128-byte swizzle (8-row groups 1024 bytes apart).
__device__ __forceinline__ u64 sw_desc(u32 addr) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)64 << 32) | ((u64)1 << 62);
}

// Descriptor of k-step kk (dims 16kk .. 16kk + 15) of a tile at `base`: the tile's descriptor
// plus the step's offset in 16-byte units (shared addresses stay below 2^18, so the 14-bit
// address field does not overflow), one add a step.
__device__ __forceinline__ u64 sw_desc_k(u32 base, int kk, int panel) {
    return sw_desc(base) + (u64)((u32)((kk >> 2) * panel + (kk & 3) * 32) >> 4);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void sw_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void sw_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads of accumulators above the wait.
template <int N>
__device__ __forceinline__ void sw_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// Barrier of warpgroup wg's 128 threads (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void sw_wg_sync(int wg) {
    if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
    else asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

__device__ __forceinline__ void sw_mma_n128(float (&d)[64], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void sw_mma_n64(float (&d)[32], u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// Stages keys [c0, c0 + n) of KV group g (d = 128) into the swizzled tile at `tile` (rows ≥ n
// zero): 1024 chunks of 16 bytes, 8 a thread of warpgroup 1 (tw: its thread), each thread
// arriving on the mbarrier `full` when its chunks have landed.
__device__ __forceinline__ void sw_issue(const bf16* src, size_t kvw, int g, u32 tile, int c0, int n, int tw,
                                         u32 full) {
    // Chunk it of this thread: row r0 + 8·it, 16-byte column c (the swizzle depends on the row
    // only through r0 = row % 8, so the chunks lie 1024 bytes apart). A row past n (the last
    // tile's) reads nothing (source size 0) from an address kept inside the keys.
    const int r0 = tw >> 4, c = tw & 15;
    const bf16* p = src + (size_t)(c0 + r0) * kvw + (size_t)g * 128 + c * 8;
    const size_t step = 8 * kvw;
    const u32 dst = tile + sw_off(r0, c, SW_PANEL_K);
    if (n >= 64) {
#pragma unroll
        for (int it = 0; it < 8; it++, p += step) sp_cp_async16(dst + 1024 * it, p, 16);
    } else {
#pragma unroll
        for (int it = 0; it < 8; it++, p += step) {
            const bool in = r0 + 8 * it < n;
            sp_cp_async16(dst + 1024 * it, in ? p : src, in ? 16 : 0);
        }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
}

__device__ __forceinline__ void sw_mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void sw_mbar_arrive(u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Returns once the phase of parity `parity` of the mbarrier at `bar` has completed.
__device__ __forceinline__ void sw_mbar_wait(u32 bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "SW_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra SW_WAIT;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
#endif

// launch: grid = ((T + 15) / 16, kv_heads), block = 256, dynamic smem = SW_SMEM_USED + 1024
extern "C" __global__ void __launch_bounds__(256, 2)
select_scores_wg(const bf16* q, const bf16* k1, const bf16* k2, int n1, int n2, int T, int first_pos, int heads,
                 int kv_heads, int d, float scale, int block_size, int k1_stride, int k2_window, int k2_stride,
                 int init_blocks, int local_blocks, int k_sel, u16* bs, int bs_stride) {
    pdl_start();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char sw_raw[];
    const u32 base = (sp_smem_addr(sw_raw) + 1023u) & ~1023u;
    unsigned char* const gbase = sw_raw + (base - sp_smem_addr(sw_raw));
    const int G = heads / kv_heads, g = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;
    // The warpgroup through a shuffle: the compiler then knows it warp-uniform and keeps the MMA
    // descriptors built from it in uniform registers.
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wq = warp & 3, tw = threadIdx.x & 127;
    const size_t kvw = (size_t)kv_heads * d;
    const float NEG = -__int_as_float(0x7f800000), INF = __int_as_float(0x7f800000);
    const float sl2 = scale * 1.4426950408889634f;

    // The block's last token bounds both walks (block-uniform early exit).
    const int i0 = blockIdx.x * 16;
    const int t_last = first_pos + min(i0 + 16, T) - 1;
    const int qb_last = t_last / block_size;
    const int n2_all = min(sp_visible(t_last, k2_window, k2_stride), n2);
    const int n1_all = (qb_last >= k_sel) ? min(4 * max(qb_last - local_blocks, 0), n1) : 0;
    if (n1_all == 0 || n2_all == 0) return;

    // Token m of this warpgroup: query i = i0 + 8wg + m (past the chunk's end, the last query).
    auto tok_pos = [&](int m) { return first_pos + min(i0 + SW_TOK * wg + m, T - 1); };
    auto tok_act = [&](int m) { return i0 + SW_TOK * wg + m < T && tok_pos(m) / block_size >= k_sel; };
    auto tok_cand = [&](int m) { return tok_act(m) ? max(tok_pos(m) / block_size - local_blocks, 0) : 0; };
    auto tok_n2v = [&](int m) { return min(sp_visible(tok_pos(m), k2_window, k2_stride), n2); };

    // The key tiles, one sequence over both passes: level-2 tiles 0 .. A − 1 (pass 1), then
    // level-1 tiles A .. total − 1 (pass 2), tile t in buffer t & 1. Warpgroup 1 stages tile
    // t + 2 once both warpgroups' MMAs have read tile t: mbarrier full[b] completes a phase
    // when buffer b's keys have landed (warpgroup 1's 128 threads arrive), empty[b] when the 8
    // warps are done with it. No block barrier after the start: the warpgroups run apart.
    const int A = (n2_all + 63) >> 6, total = A + ((n1_all + 63) >> 6);
    const u32 tiles = base + SW_K_OFF, bars = base + SW_BAR_OFF;  // full[0], full[1], empty[0], empty[1]
    const u32 qbase = base + SW_Q_OFF + wg * 2 * SW_PANEL_Q;
    auto stage = [&](int t) {
        const bool l2 = t < A;
        const int c0 = 64 * (l2 ? t : t - A), n = l2 ? n2_all : n1_all;
        sw_issue(l2 ? k2 : k1, kvw, g, tiles + (t & 1) * 2 * SW_PANEL_K, c0, min(64, n - c0), tw, bars + 8 * (t & 1));
    };
    if (threadIdx.x < 2) {
        sw_mbar_init(bars + 8 * threadIdx.x, 128);
        sw_mbar_init(bars + 16 + 8 * threadIdx.x, 8);
    }
    // Each warpgroup stages its queries: row 16m + h of its operand is head h (zero past G) of
    // token m.
    for (int x = tw; x < 128 * 16; x += 128) {
        const int row = x >> 4, c = x & 15, m = row >> 4, h = row & 15;
        const int i = min(i0 + SW_TOK * wg + m, T - 1);
        const bool in = h < G;
        const bf16* s = in ? q + (size_t)i * heads * d + (size_t)(g * G + h) * d + c * 8 : q;
        sp_cp_async16(qbase + sw_off(row, c, SW_PANEL_Q), s, in ? 16 : 0);
    }
    sp_cp_commit();
    __syncthreads();  // the mbarriers initialised
    if (wg == 1) {
        stage(0);
        if (total > 1) stage(1);
    }
    // Once the tensor cores have read tile t: this warp's arrival, and warpgroup 1 stages t + 2.
    auto tile_done = [&](int t) {
        __syncwarp();
        if (lane == 0) sw_mbar_arrive(bars + 16 + 8 * (t & 1));
        if (wg == 1 && t + 2 < total) {
            sw_mbar_wait(bars + 16 + 8 * (t & 1), (t >> 1) & 1);
            stage(t + 2);
        }
    };
    // Tile t's keys, visible to this thread's MMAs.
    auto tile_ready = [&](int t) {
        sw_mbar_wait(bars + 8 * (t & 1), (t >> 1) & 1);
        sw_proxy_fence();
        return tiles + (t & 1) * 2 * SW_PANEL_K;
    };
    // Turns at the tensor cores: the warpgroups issue their MMA groups alternately, so one's
    // exp2 runs under the other's MMAs. Warpgroup w waits at named barrier 3 + w for the other's
    // arrival after its last issue (warpgroup 1 lets warpgroup 0 take the first). Both take the
    // same turns, two a level-2 tile and one a level-1 tile, computing or not, and warpgroup 0
    // takes up warpgroup 1's last arrival after its walk. turn_end's wait is the MMAs'.
    const u32 wg0 = wg == 0;
    auto turn_begin = [&]() {
        asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n@p bar.sync 3, 256;\n@!p bar.sync 4, 256;\n}\n" ::"r"(wg0)
                     : "memory");
    };
    auto turn_end = [&](bool ran) {
        if (ran)
            asm volatile(
                "{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\nwgmma.commit_group.sync.aligned;\n@p bar.arrive 4, 256;\n"
                "@!p bar.arrive 3, 256;\nwgmma.wait_group.sync.aligned 0;\n}\n" ::"r"(wg0)
                : "memory");
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.u32 p, %0, 0;\n@p bar.arrive 4, 256;\n@!p bar.arrive 3, 256;\n}\n" ::"r"(
                             wg0)
                         : "memory");
    };
    if (wg == 1) asm volatile("bar.arrive 3, 256;\n" ::: "memory");

    // The P ring: [token][128] bf16 of this warpgroup, a tile in each half. Until pass 2 it
    // holds each token's visible level-2 keys, then each half's fewest and most.
    u16* const ring = (u16*)(gbase + SW_P_OFF) + wg * SW_TOK * 128;
    int* const n2v_s = (int*)ring;
    if (tw < SW_TOK) n2v_s[tw] = tok_n2v(tw);
    if (tw < 2) {
        int lo = 1 << 30, hi = 0;
#pragma unroll
        for (int m = 0; m < 4; m++) {
            lo = min(lo, tok_n2v(4 * tw + m));
            hi = max(hi, tok_n2v(4 * tw + m));
        }
        n2v_s[SW_TOK + tw] = lo;
        n2v_s[SW_TOK + 2 + tw] = hi;
    }
    sp_cp_wait0();
    sw_proxy_fence();
    sw_wg_sync(wg);  // the queries and n2v_s

    // Pass 1, one walk over the level-2 keys: per tile, the MMAs and epilogue of half 0 (tokens
    // 0-3), then of half 1 (tokens 4-7), into one accumulator; online max and sum of exp2 per
    // (token, head) over this thread's keys, merged over the warp's lanes, then the warps.
    float2* const ml = (float2*)(gbase + SW_ML_OFF);
    {
        // The running max starts at −1e30, not −∞: every exp2 then subtracts it as it is (a
        // term of a masked key, −∞, still gives 0, and no finite score stays below it).
        float acc[32], mrow[32], lrow[32];
#pragma unroll
        for (int j = 0; j < 32; j++) {
            mrow[j] = -1e30f;
            lrow[j] = 0.0f;
            acc[j] = 0.0f;
        }
#pragma unroll 1
        for (int t = 0; t < A; t++) {
            const u32 tile = tile_ready(t);
            const int c0 = 64 * t;
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const bool run = c0 < n2v_s[SW_TOK + 2 + hf];  // warpgroup-uniform
                turn_begin();
                if (run) {
                    sw_fence();
#pragma unroll
                    for (int kk = 0; kk < 8; kk++)
                        sw_mma_n64(acc, sw_desc_k(tile, kk, SW_PANEL_K),
                                   sw_desc_k(qbase + hf * 64 * 128, kk, SW_PANEL_Q), kk > 0);
                }
                turn_end(run);
                if (hf == 1) tile_done(t);
                if (!run) continue;
                sw_hold(acc);
                const bool full = c0 + 64 <= n2v_s[SW_TOK + hf];  // no key masked for any token of the half
                const int key = c0 + 16 * wq + gq;
                // Products left unscaled (masked → −inf; the scale goes into each exp2's FFMA);
                // the running max is in log2 units. The rescale is lazy: the reference max moves
                // only when a score passes it by more than 8 (terms stay ≤ 2^8), for every lane at
                // once when any lane needs it, so most tiles take 2 exp2 per 2 keys.
                bool grow = false;
                // One (token, head) pair of keys; inlined into two copies of the loop, so the tiles
                // that mask nothing (all but the last) take no selects.
                auto score = [&](int m, int h, bool masked) {
                    const int at = (2 * m + (h >> 1)) * 4 + (h & 1), j = 16 * hf + 4 * m + h;
                    if (masked) {
                        const int n2v = n2v_s[4 * hf + m];
                        acc[at] = key < n2v ? acc[at] : NEG;
                        acc[at + 2] = key + 8 < n2v ? acc[at + 2] : NEG;
                    }
                    grow |= fmaf(fmaxf(acc[at], acc[at + 2]), sl2, -8.0f) > mrow[j];
                };
                if (full) {
#pragma unroll
                    for (int m = 0; m < 4; m++)
#pragma unroll
                        for (int h = 0; h < 4; h++) score(m, h, false);
                } else {
#pragma unroll
                    for (int m = 0; m < 4; m++)
#pragma unroll
                        for (int h = 0; h < 4; h++) score(m, h, true);
                }
                if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
                    for (int m = 0; m < 4; m++)
#pragma unroll
                        for (int h = 0; h < 4; h++) {
                            const int at = (2 * m + (h >> 1)) * 4 + (h & 1), j = 16 * hf + 4 * m + h;
                            const float mx = fmaxf(mrow[j], fmaxf(acc[at], acc[at + 2]) * sl2);
                            lrow[j] *= st_ex2(mrow[j] - mx);
                            mrow[j] = mx;
                        }
                }
#pragma unroll
                for (int m = 0; m < 4; m++)
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        const int at = (2 * m + (h >> 1)) * 4 + (h & 1), j = 16 * hf + 4 * m + h;
                        lrow[j] += st_ex2(fmaf(acc[at], sl2, -mrow[j])) + st_ex2(fmaf(acc[at + 2], sl2, -mrow[j]));
                    }
            }
        }
        // Merge over the 8 lanes of each tq (the warp's 16 keys), then write per warp.
#pragma unroll
        for (int j = 0; j < 32; j++) {
            float mx = mrow[j], l = lrow[j];
            st_merge_rows(mx, l);
            const int m = j >> 2, h = j & 3, head = 8 * (h >> 1) + 2 * tq + (h & 1);
            if (gq == 0) ml[((wg * 4 + wq) * SW_TOK + m) * 16 + head] = make_float2(mx, l);
        }
    }
    sw_wg_sync(wg);
    // LSE of (token tw / 16, head tw % 16) of this warpgroup from its 4 warps' partials.
    {
        const int m = tw >> 4, head = tw & 15;
        float mx = NEG, l = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const float2 p = ml[((wg * 4 + w) * SW_TOK + m) * 16 + head];
            st_merge(mx, l, p.x, p.y);
        }
        const int slot = 2 * (head >> 3) + (head & 1), tq_of = (head & 7) >> 1;
        float* lse_s = (float*)(gbase + SW_LSE_OFF);
        lse_s[((wg * SW_TOK + m) * 4 + tq_of) * 4 + slot] = (tok_act(m) && head < G) ? mx + __log2f(l) : INF;
    }
    sw_wg_sync(wg);

    // Pass 2: P of each level-1 key, max-pooled into block scores (block b: keys 4b − 1 .. 4b + 3).
    int cand_max = 0;
#pragma unroll
    for (int m = 0; m < SW_TOK; m++) cand_max = max(cand_max, tok_cand(m));
    const int pm = tw >> 4, pb = tw & 15;  // the (token, block of the tile) this thread pools
    const int pool_cand = tok_cand(pm);
    const size_t pool_row = ((size_t)(i0 + SW_TOK * wg + pm) * kv_heads + g) * bs_stride;
    const float4* lse4 = (const float4*)(gbase + SW_LSE_OFF) + wg * SW_TOK * 4 + tq;
    // Key 63 of the previous tile (held by pb = 15's thread): key 4b − 1 of block b = 0. The
    // key before the first tile is no maximum (P ≥ 0).
    u32 last = 0;
    float acc[64];
#pragma unroll
    for (int j = 0; j < 64; j++) acc[j] = 0.0f;
#pragma unroll 1
    for (int t = A; t < total; t++) {
        const u32 tile = tile_ready(t);
        const int c0 = 64 * (t - A);
        const bool run = c0 < 4 * cand_max;  // warpgroup-uniform
        turn_begin();
        if (run) {
            sw_fence();
#pragma unroll
            for (int kk = 0; kk < 8; kk++)
                sw_mma_n128(acc, sw_desc_k(tile, kk, SW_PANEL_K), sw_desc_k(qbase, kk, SW_PANEL_Q), kk > 0);
        }
        turn_end(run);
        tile_done(t);
        if (!run) continue;
        sw_hold(acc);
        // v[2m + r]: this lane's 4 heads of token m summed, key 16wq + gq + 8r.
        float v[16];
#pragma unroll
        for (int m = 0; m < SW_TOK; m++) {
            const float4 L = lse4[m * 4];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int a = 8 * m + 2 * r;  // (column tile 2m, row half r)
                v[2 * m + r] = st_ex2(acc[a] * sl2 - L.x) + st_ex2(acc[a + 1] * sl2 - L.y) +
                               st_ex2(acc[a + 4] * sl2 - L.z) + st_ex2(acc[a + 5] * sl2 - L.w);
            }
        }
        // Sum over the quad, scattered: lane tq keeps v[4tq .. 4tq + 3] (tokens 2tq, 2tq + 1).
        const bool h2 = tq & 2, h1 = tq & 1;
        float w8[8], w4[4];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float send = h2 ? v[k] : v[k + 8], keep = h2 ? v[k + 8] : v[k];
            w8[k] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float send = h1 ? w8[k] : w8[k + 4], keep = h1 ? w8[k + 4] : w8[k];
            w4[k] = keep + __shfl_xor_sync(0xffffffffu, send, 1);
        }
        // Rounded to bf16 (NaN → 0: P ≥ 0, so the bits order as the values), into the ring. A
        // half is written again two tiles on, after every warp has passed the next tile's
        // barrier, so after every read of it.
        const int slot = ((c0 >> 6) & 1) * 64 + 16 * wq + gq;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const u32 p = st_max2(sp_pack_bf16(w4[2 * k], w4[2 * k + 1]), 0u);
            u16* row = ring + (2 * tq + k) * 128;
            row[slot] = (u16)(p & 0xffffu);
            row[slot + 8] = (u16)(p >> 16);
        }
        sw_wg_sync(wg);
        const u16* row = ring + pm * 128;
        const int at = ((c0 >> 6) & 1) * 64 + 4 * pb;
        const uint2 four = *(const uint2*)(row + at);
        const u32 before = __shfl_sync(0xffffffffu, last, lane | 15);  // pb = 15 of this token
        const u32 prev = pb == 0 ? before : (u32)row[at - 1];
        last = four.y >> 16;
        const u32 a = st_max2(four.x, four.y);
        const u32 mx = max(max(a & 0xffffu, a >> 16), prev);
        const int blk = (c0 >> 2) + pb;
        if (blk >= init_blocks && blk < pool_cand) bs[pool_row + blk] = (u16)mx;
    }
    if (wg == 0) asm volatile("bar.sync 3, 256;\n" ::: "memory");
#endif
}
