// Per-head query/key RMSNorm and RoPE on one warp, shared by head_norm_rope_lanes and the
// lightning decode kernel (a decode row's q and k normed and rotated where they are read), so
// both give the same bits.
#pragma once
#include "common/types.cuh"

// E consecutive bf16 (2E-byte aligned) as one load or store.
template <int E>
struct alignas(2 * E) Bf16Vec {
    bf16 e[E];
};

// One head of d = 32·E elements, E consecutive ones a lane (lane l holds E·l .. E·l + E − 1):
// v = round(round(v·r)·w) with r = 1/sqrt(mean(v²) + eps) when w is given, then (cs given)
// v = round(v·cos + partner·sin), partner = −v[e + d/2] below d/2 and v[e − d/2] above; cs is
// the row's RoPE table (cos, sin of frequency i at cs[2i], cs[2i + 1], i < d/2). The partner
// of lane l's element is lane (l ^ 16)'s. Every product and sum is rounded on its own (no
// contraction), so the bits do not depend on the kernel this is inlined in.
template <int E>
__device__ __forceinline__ void head_norm_rope_warp(float (&v)[E], int lane, const bf16* w, float eps,
                                                    const float* cs) {
    if (w) {
        float ss = __fmul_rn(v[0], v[0]);
#pragma unroll
        for (int i = 1; i < E; i++) ss = __fmaf_rn(v[i], v[i], ss);
        // 32·E is a power of two: times its inverse is the division, rounded the same.
        static_assert((E & (E - 1)) == 0, "E a power of two");
        const float r = rsqrtf(__fadd_rn(__fmul_rn(warp_sum(ss), 1.0f / (32 * E)), eps));
#pragma unroll
        for (int i = 0; i < E; i++)
            v[i] = round_bf(__fmul_rn(round_bf(__fmul_rn(v[i], r)), bf2f(w[E * lane + i])));
    }
    if (cs) {
        const float* c = cs + 2 * E * (lane & 15);
        float o[E];
#pragma unroll
        for (int i = 0; i < E; i++) {
            const float partner = __shfl_xor_sync(0xffffffffu, v[i], 16);
            const float other = lane < 16 ? -partner : partner;
            o[i] = round_bf(__fmaf_rn(v[i], c[2 * i], __fmul_rn(other, c[2 * i + 1])));
        }
#pragma unroll
        for (int i = 0; i < E; i++) v[i] = o[i];
    }
}

template <int E>
__device__ __forceinline__ void head_norm_rope_head(bf16* p, int lane, const bf16* w, float eps, const float* cs,
                                                    float* out) {
    float v[E];
#pragma unroll
    for (int i = 0; i < E; i++) v[i] = bf2f(p[E * lane + i]);
    head_norm_rope_warp<E>(v, lane, w, eps, cs);
#pragma unroll
    for (int i = 0; i < E; i++) {
        if (out) {
            out[E * lane + i] = v[i];
        } else {
            p[E * lane + i] = f2bf(v[i]);
        }
    }
}

// head_norm_rope_warp for a head of `d` ∈ {32, 64, 128, 256} at p (bf16): the result (bf16
// values) to out[0 .. d) as fp32, or back in place when out is null.
__device__ __forceinline__ void head_norm_rope_any(bf16* p, int d, int lane, const bf16* w, float eps,
                                                   const float* cs, float* out) {
    switch (d) {
        case 32: head_norm_rope_head<1>(p, lane, w, eps, cs, out); break;
        case 64: head_norm_rope_head<2>(p, lane, w, eps, cs, out); break;
        case 128: head_norm_rope_head<4>(p, lane, w, eps, cs, out); break;
        case 256: head_norm_rope_head<8>(p, lane, w, eps, cs, out); break;
    }
}
