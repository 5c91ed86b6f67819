// CHECK(call): a CUDA runtime call's error, with where it happened, ends the program (the
// standalone measurement scripts: pdl-gaps.cu, w4-ring.cu).
#pragma once
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                     \
    do {                                                                             \
        cudaError_t e = (x);                                                         \
        if (e != cudaSuccess) {                                                      \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)
