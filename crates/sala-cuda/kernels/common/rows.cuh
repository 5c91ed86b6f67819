// The rows of a batched decode step, passed by value to the *_rows kernels (the Rust side
// mirrors these layouts).
#pragma once
#include "common/types.cuh"

// The sequences of a batched decode step: row r's lightning state (one layer's).
#define DECODE_ROWS 64
struct DecodeRows {
    float* state[DECODE_ROWS];
};

// The sequences of a batched decode step in a sparse layer, passed by value to the *_rows
// kernels: query row i's caches (K, V, level-1 and level-2 compressed keys; the new token
// already appended), its position (its cache holds pos + 1 tokens) and tier sizes.
#define SEQ_ROWS 64
struct SeqRows {
    const bf16* k[SEQ_ROWS];
    const bf16* v[SEQ_ROWS];
    const bf16* k1[SEQ_ROWS];
    const bf16* k2[SEQ_ROWS];
    int pos[SEQ_ROWS];
    int n1[SEQ_ROWS];
    int n2[SEQ_ROWS];
    int split[SEQ_ROWS];  // attention_decode_rows: the sequence's own n_split
};
