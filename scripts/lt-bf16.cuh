// sala-cuda's bf16 product (gemm.rs) for the standalone measurements (gemm-algos.cu,
// overlap.cu): row-major Y[rows, out] = X[rows, inner] · W[out, inner]ᵀ, in cuBLAS's
// column-major terms Yᵀ = op(W) · Xᵀ with W transposed, bf16 in and out, fp32 accumulation.
#pragma once
#include <cublasLt.h>
#include <cstdio>
#include <cstdlib>

// CK(call): a cuBLAS or CUDA status other than success ends the program, naming the call.
#define CK(x)                                                                  \
    do {                                                                       \
        auto r_ = (x);                                                         \
        if ((int)r_ != 0) {                                                    \
            printf("%s failed: %d (line %d)\n", #x, (int)r_, __LINE__);        \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

struct LtBf16 {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulPreference_t pref;
};

// The descriptors of one shape, its preference allowing `ws_bytes` of workspace.
inline LtBf16 lt_bf16(int rows, int out, int inner, const size_t& ws_bytes) {
    LtBf16 p;
    CK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t t = CUBLAS_OP_T;
    CK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    CK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, inner, out, inner));
    CK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, inner, rows, inner));
    CK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, out, rows, out));
    CK(cublasLtMatmulPreferenceCreate(&p.pref));
    CK(cublasLtMatmulPreferenceSetAttribute(p.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                            sizeof ws_bytes));
    return p;
}

inline void lt_bf16_destroy(LtBf16& p) {
    cublasLtMatmulPreferenceDestroy(p.pref);
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.desc);
}
