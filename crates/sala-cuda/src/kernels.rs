//! The kernel table: every kernel, the source file it is in and its parameters as the `.cu`
//! signature declares them, in one list ([`kernel_table!`]); from it the [`K`] enum and a
//! typed launcher per kernel on [`Launcher`] (its arguments named and typed as the kernel's).
//! A test reads the `.cu` files and checks each signature against this table.
//!
//! Each file is compiled by NVRTC ([`crate::sources`]) for the device's target, cached on disk
//! ([`crate::registry`]), and loaded as its own module; each kernel is opted into the dynamic
//! shared memory its plans may ask for on this device, never more than the device allows.

use crate::device::DeviceLimits;
use crate::options::CudaOptions;
use crate::plan::{KernelAttrs, Launch, Planner};
use crate::profile::Profiler;
use cudarc::driver::{CudaFunction, CudaModule, CudaStream};
use sala_model::{BResult, BackendError};
use std::cell::{Cell, Ref, RefCell};
use std::sync::Arc;

/// Rows of a batched decode step (`DecodeRows` of rows.cuh), passed by value: each row's
/// lightning state.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct DecodeRows {
    pub state: [u64; crate::plan::DECODE_ROWS],
}

// SAFETY: plain data with the layout of the kernel's struct (64 pointers).
unsafe impl cudarc::driver::DeviceRepr for DecodeRows {}

/// Sequences of a batched decode step in a sparse layer (`SeqRows` of rows.cuh), passed by
/// value: each row's cache pointers (K, V, level-1 and level-2 keys), position, tier sizes and
/// attention split.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SeqRows {
    pub k: [u64; crate::plan::SEQ_ROWS],
    pub v: [u64; crate::plan::SEQ_ROWS],
    pub k1: [u64; crate::plan::SEQ_ROWS],
    pub k2: [u64; crate::plan::SEQ_ROWS],
    pub pos: [i32; crate::plan::SEQ_ROWS],
    pub n1: [i32; crate::plan::SEQ_ROWS],
    pub n2: [i32; crate::plan::SEQ_ROWS],
    pub split: [i32; crate::plan::SEQ_ROWS],
}

// SAFETY: plain data with the layout of the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for SeqRows {}

impl DecodeRows {
    /// The given state pointers (at most `DECODE_ROWS`).
    pub fn new(states: &[u64]) -> Self {
        let mut t = Self {
            state: [0; crate::plan::DECODE_ROWS],
        };
        t.state[..states.len()].copy_from_slice(states);
        t
    }
}

impl SeqRows {
    pub fn empty() -> Self {
        let z = [0; crate::plan::SEQ_ROWS];
        Self {
            k: [0; crate::plan::SEQ_ROWS],
            v: [0; crate::plan::SEQ_ROWS],
            k1: [0; crate::plan::SEQ_ROWS],
            k2: [0; crate::plan::SEQ_ROWS],
            pos: z,
            n1: z,
            n2: z,
            split: z,
        }
    }
}

/// A kernel parameter's kind, as the `.cu` signature declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// Any pointer (`const bf16*`, `float*`, ...): a device address.
    Ptr,
    /// `int`.
    I32,
    /// `float`.
    F32,
    /// `u64`.
    U64,
    /// `DecodeRows` by value.
    Rows,
    /// `SeqRows` by value.
    Seqs,
}

/// One kernel argument.
#[derive(Clone, Copy)]
enum Arg<'a> {
    Ptr(u64),
    I32(i32),
    F32(f32),
    U64(u64),
    Rows(&'a DecodeRows),
    Seqs(&'a SeqRows),
}

macro_rules! param_type {
    (Ptr) => {
        u64
    };
    (I32) => {
        i32
    };
    (F32) => {
        f32
    };
    (U64) => {
        u64
    };
    (Rows) => {
        &DecodeRows
    };
    (Seqs) => {
        &SeqRows
    };
}

macro_rules! kernel_table {
    ($( $variant:ident = $name:ident in $file:literal ( $($arg:ident : $ty:ident),* $(,)? ); )*) => {
        /// Every kernel; `K::X as usize` indexes per-kernel tables.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum K { $($variant),* }

        impl K {
            pub const ALL: &'static [K] = &[$(K::$variant),*];

            /// The kernel's name in its source.
            pub fn name(self) -> &'static str {
                match self { $(K::$variant => stringify!($name)),* }
            }

            /// The source file (under kernels/) that defines it.
            pub fn file(self) -> &'static str {
                match self { $(K::$variant => $file),* }
            }

            /// Its parameters (name, kind), in the order of the `.cu` signature.
            pub fn params(self) -> &'static [(&'static str, Param)] {
                match self { $(K::$variant => &[$((stringify!($arg), Param::$ty)),*]),* }
            }
        }

        /// Typed launchers: one per kernel, its arguments as the kernel declares them.
        #[allow(clippy::too_many_arguments, dead_code)]
        impl Launcher {
            $(
                pub fn $name(&self, at: Launch, $($arg: param_type!($ty)),*) -> BResult<()> {
                    self.launch(K::$variant, at, &[$(Arg::$ty($arg)),*])
                }
            )*
        }
    };
}

kernel_table! {
    // Elementwise, norms, RoPE, embedding, random fill.
    Embed = embed in "elementwise.cu" (table: Ptr, ids: Ptr, scale: F32, out: Ptr, dim: I32);
    RmsNorm = rms_norm in "elementwise.cu" (x: Ptr, w: Ptr, eps: F32, out: Ptr, dim: I32, gate: Ptr, codes: Ptr, scales: Ptr, sums: Ptr, width: I32);
    RowSumsSq = row_sums_sq in "elementwise.cu" (x: Ptr, dim: I32, sums: Ptr);
    AddRmsNorm = add_rms_norm in "elementwise.cu" (h: Ptr, branch: Ptr, scale: F32, w: Ptr, eps: F32, out: Ptr, dim: I32, rows: I32, codes: Ptr, scales: Ptr);
    SiluMul = silu_mul in "elementwise.cu" (gate: Ptr, up: Ptr, n: U64);
    AddScaled = add_scaled in "elementwise.cu" (h: Ptr, branch: Ptr, scale: F32, n: U64);
    SigmoidGate = sigmoid_gate in "elementwise.cu" (x: Ptr, gate: Ptr, n: U64);
    HeadNormRope = head_norm_rope in "elementwise.cu" (x: Ptr, total_heads: I32, head_dim: I32, norm_w: Ptr, eps: F32, inv_freq: Ptr, first_pos: I32, heads_per_row: I32, x2: Ptr, total_heads2: I32, norm_w2: Ptr, heads_per_row2: I32, table: Ptr);
    HeadNormRopeLanes = head_norm_rope_lanes in "elementwise.cu" (x: Ptr, total_heads: I32, head_dim: I32, norm_w: Ptr, eps: F32, heads_per_row: I32, x2: Ptr, total_heads2: I32, norm_w2: Ptr, heads_per_row2: I32, table: Ptr);
    RopeTable = rope_table in "elementwise.cu" (inv_freq: Ptr, first_pos: I32, rows: I32, half: I32, table: Ptr);
    RopeTableRows = rope_table_rows in "elementwise.cu" (inv_freq: Ptr, pos: Ptr, n_rows: I32, half: I32, table: Ptr);
    ScaleRound = scale_round in "elementwise.cu" (x: Ptr, out: Ptr, divisor: F32, n: U64);
    GreedyParts = greedy_parts in "elementwise.cu" (logits: Ptr, vocab: I32, part: Ptr);
    GreedyRows = greedy_rows in "elementwise.cu" (part: Ptr, ids: Ptr, logprobs: Ptr);
    PickedIds = picked_ids in "elementwise.cu" (picks: Ptr, ids: Ptr, positions: Ptr, n: I32);
    FillRandom = fill_random in "elementwise.cu" (out: Ptr, n: U64, first: U64, seed: U64, mean: F32, std: F32);
    // Decode-sized products and the MLP's SiLU.
    Gemv = gemv in "gemv/bf16.cu" (x: Ptr, w: Ptr, n: I32, k: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvNarrow = gemv_narrow in "gemv/bf16.cu" (x: Ptr, w: Ptr, n: I32, k: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvSilu = gemv_silu in "gemv/bf16.cu" (x: Ptr, w: Ptr, y: Ptr, inter: I32, k: I32);
    GemvMma8 = gemv_mma8 in "gemv/bf16.cu" (x: Ptr, w: Ptr, n: I32, k: I32, nb: I32, groups: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvMma16 = gemv_mma16 in "gemv/bf16.cu" (x: Ptr, w: Ptr, n: I32, k: I32, nb: I32, groups: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvRows64 = gemv_rows64 in "gemv/rows64.cu" (x: Ptr, w: Ptr, n: I32, k: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvRows64Parts = gemv_rows64_parts in "gemv/rows64.cu" (x: Ptr, w: Ptr, n: I32, k: I32, nb: I32, sums: Ptr);
    GemvChainSums = gemv_chain_sums in "gemv/rows64.cu" (sums: Ptr, m_rows: I32, parts: I32, n: I32, nb: I32, silu: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvSiluMma8 = gemv_silu_mma8 in "gemv/bf16.cu" (x: Ptr, w: Ptr, y: Ptr, inter: I32, k: I32, nb: I32, groups: I32);
    GemvSiluMma16 = gemv_silu_mma16 in "gemv/bf16.cu" (x: Ptr, w: Ptr, y: Ptr, inter: I32, k: I32, nb: I32, groups: I32);
    GemvSiluRows64 = gemv_silu_rows64 in "gemv/rows64.cu" (x: Ptr, w: Ptr, y: Ptr, inter: I32, k: I32, nb: I32);
    GemvSiluRows64Parts = gemv_silu_rows64_parts in "gemv/rows64.cu" (x: Ptr, w: Ptr, inter: I32, k: I32, nb: I32, sums: Ptr);
    GemvW4x8 = gemv_w4_8 in "gemv/w4.cu" (x: Ptr, rec: Ptr, n: I32, k: I32, g: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvW4x16 = gemv_w4_16 in "gemv/w4.cu" (x: Ptr, rec: Ptr, n: I32, k: I32, g: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvSiluW4x8 = gemv_silu_w4_8 in "gemv/w4.cu" (x: Ptr, rec: Ptr, y: Ptr, inter: I32, k: I32, g: I32, nb: I32);
    GemvSiluW4x16 = gemv_silu_w4_16 in "gemv/w4.cu" (x: Ptr, rec: Ptr, y: Ptr, inter: I32, k: I32, g: I32, nb: I32);
    GemvSiluW4x8Norm = gemv_silu_w4_8_norm in "gemv/w4.cu" (rec: Ptr, y: Ptr, inter: I32, k: I32, g: I32, h: Ptr, branch: Ptr, scale: F32, w: Ptr, eps: F32, a: Ptr, ticket: Ptr);
    DequantW4 = dequant_w4 in "gemv/w4.cu" (rec: Ptr, r0: I32, k: I32, g: I32, words: U64, out: Ptr);
    QuantRowsF8 = quant_rows_f8 in "gemv/fp8.cu" (x: Ptr, k: I32, codes: Ptr, values: Ptr, scales: Ptr);
    GemvF8x8 = gemv_f8_8 in "gemv/fp8.cu" (xc: Ptr, xs: Ptr, w: Ptr, ws: Ptr, n: I32, k: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvF8x16 = gemv_f8_16 in "gemv/fp8.cu" (xc: Ptr, xs: Ptr, w: Ptr, ws: Ptr, n: I32, k: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvF8Bf16x8 = gemv_f8_bf16_8 in "gemv/fp8.cu" (x: Ptr, w: Ptr, ws: Ptr, n: I32, k: I32, nb: I32, y0: Ptr, n0: I32, y1: Ptr, n1: I32, y2: Ptr, n2: I32, y3: Ptr);
    GemvSiluF8x8 = gemv_silu_f8_8 in "gemv/fp8.cu" (xc: Ptr, xs: Ptr, w: Ptr, ws: Ptr, y: Ptr, inter: I32, k: I32, nb: I32);
    GemvSiluF8x16 = gemv_silu_f8_16 in "gemv/fp8.cu" (xc: Ptr, xs: Ptr, w: Ptr, ws: Ptr, y: Ptr, inter: I32, k: I32, nb: I32);
    ScaleRowsCols = scale_rows_cols in "gemv/fp8.cu" (y: Ptr, xs: Ptr, ws: Ptr, n: I32);
    DequantF8 = dequant_f8 in "gemv/fp8.cu" (codes: Ptr, out: Ptr, count: U64);
    SiluMulHalves8 = silu_mul_halves8 in "elementwise.cu" (gu: Ptr, out: Ptr, inter: I32);
    SiluMulHalves = silu_mul_halves in "elementwise.cu" (gu: Ptr, out: Ptr, rows: I32, inter: I32);
    // Lightning layers.
    LightningStateAdvance = lightning_state_advance in "lightning/context.cu" (state: Ptr, prev: Ptr, slopes: Ptr, tokens: I32, per_head: I32, heads: I32);
    LightningStateTerm = lightning_state_term in "lightning/context.cu" (q: Ptr, state: Ptr, slopes: Ptr, out: Ptr, rows: I32, heads: I32, d: I32, scale: F32);
    LightningDecodeRows = lightning_decode_rows in "lightning/decode.cu" (q: Ptr, k: Ptr, v: Ptr, rows: Rows, out: Ptr, slopes: Ptr, heads: I32, kv_heads: I32, d: I32, scale: F32, q_norm: Ptr, k_norm: Ptr, eps: F32, table: Ptr);
    LightningDecodeRowsPaired = lightning_decode_rows_paired in "lightning/decode.cu" (q: Ptr, k: Ptr, v: Ptr, rows: Rows, out: Ptr, slopes: Ptr, heads: I32, kv_heads: I32, d: I32, scale: F32, q_norm: Ptr, k_norm: Ptr, eps: F32, table: Ptr);
    LightningSpanRows = lightning_span_rows in "lightning/decode.cu" (q: Ptr, k: Ptr, v: Ptr, state: Ptr, out: Ptr, slopes: Ptr, rows: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, q_norm: Ptr, k_norm: Ptr, eps: F32, table: Ptr);
    LightningChunked = lightning_chunked in "lightning/chunked.cu" (q: Ptr, k: Ptr, v: Ptr, state: Ptr, out: Ptr, slopes: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, scale: F32);
    LightningChunkState = lightning_chunk_state in "lightning/split.cu" (k: Ptr, v: Ptr, ds: Ptr, slopes: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32);
    LightningChunkScan = lightning_chunk_scan in "lightning/split.cu" (state: Ptr, ds: Ptr, slopes: Ptr, n: I32, last_len: I32, heads: I32, d: I32);
    LightningChunkOut = lightning_chunk_out in "lightning/split.cu" (q: Ptr, k: Ptr, v: Ptr, ds: Ptr, out: Ptr, slopes: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, scale: F32);
    LightningRanges = lightning_ranges in "lightning/ranges.cu" (q: Ptr, k: Ptr, v: Ptr, state: Ptr, out: Ptr, slopes: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, range_len: I32, ranges: Ptr, buffers: I32);
    LightningRangeSums = lightning_range_sums in "lightning/ranges.cu" (k: Ptr, v: Ptr, slopes: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, range_len: I32, ranges: Ptr, buffers: I32);
    LightningRangeStates = lightning_range_states in "lightning/ranges.cu" (state: Ptr, ranges: Ptr, slopes: Ptr, heads: I32, d: I32, n_ranges: I32, range_len: I32);
    // Sparse layers: key compression.
    CompressKeys = compress_keys in "sparse/compress.cu" (keys: Ptr, out: Ptr, first_window: I32, n_windows: I32, kv_width: I32, window: I32, stride: I32);
    CompressKeysF8 = compress_keys_f8 in "sparse/compress.cu" (keys: Ptr, out: Ptr, first_window: I32, n_windows: I32, kv_heads: I32, d: I32, window: I32, stride: I32);
    KvStoreF8 = kv_store_f8 in "sparse/compress.cu" (k: Ptr, v: Ptr, kc: Ptr, vc: Ptr, rows: I32, kv_heads: I32, d: I32, first: I32);
    AppendKvRows = append_kv_rows in "sparse/compress.cu" (k: Ptr, v: Ptr, rows: Seqs, kv_heads: I32, d: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32);
    AppendKvRowsF8 = append_kv_rows_f8 in "sparse/compress.cu" (k: Ptr, v: Ptr, rows: Seqs, kv_heads: I32, d: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32);
    // Block selection, bit-exact with the CPU (CUDA cores).
    SparseSelect = sparse_select in "sparse/select_exact.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, p_scratch: Ptr, p_stride: I32, blocks_out: Ptr);
    SelectLse = select_lse in "sparse/select_exact.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, p_scratch: Ptr, p_stride: I32, blocks_out: Ptr, lse: Ptr);
    SelectScores = select_scores in "sparse/select_exact.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, p_scratch: Ptr, p_stride: I32, blocks_out: Ptr, lse: Ptr);
    SelectTopk = select_topk in "sparse/select_exact.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_window: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, p_scratch: Ptr, p_stride: I32, blocks_out: Ptr, lse: Ptr);
    // Block selection of a prefill on tensor cores: block scores, then a top-k.
    SelectScoresMma = select_scores_mma in "sparse/select_scores.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, bs: Ptr, bs_stride: I32);
    SelectScoresT = select_scores_t in "sparse/select_scores.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, bs: Ptr, bs_stride: I32);
    SelectScoresWg = select_scores_wg in "sparse/select_wgmma.cu" (q: Ptr, k1: Ptr, k2: Ptr, n1: I32, n2: I32, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, block_size: I32, k1_stride: I32, k2_window: I32, k2_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, bs: Ptr, bs_stride: I32);
    SelectTopkScores = select_topk_scores in "sparse/select_exact.cu" (bs: Ptr, bs_stride: I32, first_pos: I32, kv_heads: I32, block_size: I32, k1_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, blocks_out: Ptr);
    SdTopkScores = sd_topk_scores in "sparse/select_decode.cu" (bs: Ptr, bs_stride: I32, first_pos: I32, kv_heads: I32, block_size: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, keys: Ptr, blocks_out: Ptr);
    // Block selection of few queries (decode) on tensor cores.
    SdLse = sd_lse in "sparse/select_decode.cu" (q: Ptr, k2: Ptr, n2: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, k2_window: I32, k2_stride: I32, part: Ptr);
    SdLseRows = sd_lse_rows in "sparse/select_decode.cu" (q: Ptr, rows: Seqs, heads: I32, kv_heads: I32, d: I32, scale: F32, k2_window: I32, k2_stride: I32, part: Ptr);
    SdP = sd_p in "sparse/select_decode.cu" (q: Ptr, k1: Ptr, n1: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, k1_window: I32, k1_stride: I32, part: Ptr, n_split: I32, p16: Ptr, p_stride: I32);
    SdPRows = sd_p_rows in "sparse/select_decode.cu" (q: Ptr, rows: Seqs, heads: I32, kv_heads: I32, d: I32, scale: F32, k1_window: I32, k1_stride: I32, part: Ptr, n_split: I32, p16: Ptr, p_stride: I32);
    SdTopk = sd_topk in "sparse/select_decode.cu" (p16: Ptr, p_stride: I32, n1: I32, first_pos: I32, kv_heads: I32, block_size: I32, k1_window: I32, k1_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, stage_p: I32, keys: Ptr, blocks_out: Ptr);
    SdTopkRows = sd_topk_rows in "sparse/select_decode.cu" (p16: Ptr, p_stride: I32, rows: Seqs, kv_heads: I32, block_size: I32, k1_window: I32, k1_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, stage_p: I32, keys: Ptr, blocks_out: Ptr);
    SdTopkRowsCl = sd_topk_rows_cl in "sparse/select_decode.cu" (p16: Ptr, p_stride: I32, rows: Seqs, kv_heads: I32, block_size: I32, k1_window: I32, k1_stride: I32, init_blocks: I32, local_blocks: I32, k_sel: I32, blocks_out: Ptr);
    // Attention over all (dense) or the selected (sparse) blocks.
    Attention = attention in "sparse/attention.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, out: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, block_size: I32);
    AttentionSplit = attention_split in "sparse/attention.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, part: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, block_size: I32, n_split: I32);
    AttentionMerge = attention_merge in "sparse/attention.cu" (part: Ptr, out: Ptr, t: I32, heads: I32, d: I32, n_split: I32);
    AttentionPrefill = attention_prefill in "sparse/attention.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, out: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32);
    AttentionGather = attention_gather in "sparse/attention_walk.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, out: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, stages: I32, init_blocks: I32, local_blocks: I32, keys: I32);
    AttentionDecode = attention_decode in "sparse/attention_walk.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, part: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, n_split: I32);
    AttentionDecodeRows = attention_decode_rows in "sparse/attention_walk.cu" (q: Ptr, rows: Seqs, part: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, n_split: I32);
    AttentionGatherF8 = attention_gather_f8 in "sparse/attention_walk.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, out: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, stages: I32, init_blocks: I32, local_blocks: I32, keys: I32);
    AttentionDecodeF8 = attention_decode_f8 in "sparse/attention_walk.cu" (q: Ptr, kcache: Ptr, vcache: Ptr, part: Ptr, out: Ptr, t: I32, first_pos: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, n_split: I32);
    AttentionDecodeRowsF8 = attention_decode_rows_f8 in "sparse/attention_walk.cu" (q: Ptr, rows: Seqs, part: Ptr, t: I32, heads: I32, kv_heads: I32, d: I32, scale: F32, blocks: Ptr, k_sel: I32, n_split: I32);
}

/// Every kernel's function, found in the modules of its file, and the modules they live in.
struct Loaded {
    _modules: Vec<Arc<CudaModule>>,
    functions: Vec<CudaFunction>,
}

impl Loaded {
    /// Every kernel of `modules`, with its registers and shared memory as compiled.
    fn new(
        modules: Vec<(&'static str, Arc<CudaModule>)>,
    ) -> Result<(Self, Vec<KernelAttrs>), String> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let functions = K::ALL
            .iter()
            .map(|&k| {
                let (_, module) = modules
                    .iter()
                    .find(|(file, _)| *file == k.file())
                    .ok_or_else(|| format!("kernel {}: no module for {}", k.name(), k.file()))?;
                module
                    .load_function(k.name())
                    .map_err(|e| format!("kernel {} in {}: {e:?}", k.name(), k.file()))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let attrs = functions
            .iter()
            .map(|f| {
                let get = |a| f.get_attribute(a).unwrap_or(0).max(0);
                KernelAttrs {
                    regs: get(A::CU_FUNC_ATTRIBUTE_NUM_REGS) as u32,
                    static_smem: get(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) as usize,
                    local_bytes: get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES) as usize,
                    max_threads: get(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) as u32,
                }
            })
            .collect();
        let loaded = Self {
            _modules: modules.into_iter().map(|(_, m)| m).collect(),
            functions,
        };
        Ok((loaded, attrs))
    }
}

/// The loaded kernels of one device, launched on one stream, with the plans they run by.
pub struct Launcher {
    /// The kernels as loaded for the current compile target (swapped by [`Launcher::reload`]).
    loaded: RefCell<Loaded>,
    /// Dynamic shared memory each kernel is opted into (under the current plans).
    smem_limit: RefCell<Vec<usize>>,
    planner: RefCell<Planner>,
    stream: Arc<CudaStream>,
    profiler: Option<Profiler>,
    /// Rows of the forward pass under way ([`Launcher::set_step_rows`]).
    step_rows: Cell<usize>,
    /// Launches (and other stream work) asked for so far, skipped or not.
    launched: Cell<usize>,
    /// Launches are counted but not made (a replayed graph does their work).
    skip: Cell<bool>,
    /// Tests: launches still to make before one panics ([`Launcher::panic_after`]).
    panic_after: Cell<Option<usize>>,
}

/// Steps of up to this many rows (decode steps) launch their kernels to overlap each one's
/// start with the previous one's end: measured on the H200, 4K decode 169 → 177 tok/s, while a
/// prefill of 8192-row chunks lost 2% (128K TTFT 5.16 → 5.26 s), so longer steps do not.
pub const PDL_MAX_ROWS: usize = 64;

impl Launcher {
    /// Finds every kernel in the module of its file, reads its registers and shared memory,
    /// builds the planner, and opts each kernel into the dynamic shared memory its plans may
    /// use on this device.
    pub fn load(
        stream: Arc<CudaStream>,
        modules: Vec<(&'static str, Arc<CudaModule>)>,
        make_planner: impl FnOnce(Vec<KernelAttrs>) -> Planner,
        profiler: Option<Profiler>,
    ) -> Result<Self, String> {
        let (loaded, attrs) = Loaded::new(modules)?;
        let launcher = Self {
            loaded: RefCell::new(loaded),
            smem_limit: RefCell::new(Vec::new()),
            planner: RefCell::new(make_planner(attrs)),
            stream,
            profiler,
            step_rows: Cell::new(1),
            launched: Cell::new(0),
            skip: Cell::new(false),
            panic_after: Cell::new(None),
        };
        launcher.opt_in()?;
        Ok(launcher)
    }

    /// The kernels of `modules` (compiled for another target) from now on, planned for
    /// `limits` and `options`.
    pub fn reload(
        &self,
        modules: Vec<(&'static str, Arc<CudaModule>)>,
        limits: DeviceLimits,
        options: CudaOptions,
    ) -> Result<(), String> {
        let (loaded, attrs) = Loaded::new(modules)?;
        *self.loaded.borrow_mut() = loaded;
        *self.planner.borrow_mut() = Planner::new(limits, options, attrs);
        self.opt_in()
    }

    /// Opts each kernel into the most dynamic shared memory its plans may ask for.
    fn opt_in(&self) -> Result<(), String> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        let planner = self.planner.borrow();
        let mut limits = Vec::with_capacity(K::ALL.len());
        let loaded = self.loaded.borrow();
        for (&k, f) in K::ALL.iter().zip(&loaded.functions) {
            let want = planner.max_dynamic_smem(k);
            let default = (48usize << 10).saturating_sub(planner.attrs(k).static_smem);
            let limit = want.max(default).min(planner.smem_budget(k));
            f.set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit as i32,
            )
            .map_err(|e| format!("kernel {}: {limit} B of shared memory: {e:?}", k.name()))?;
            limits.push(limit);
        }
        *self.smem_limit.borrow_mut() = limits;
        Ok(())
    }

    /// Plans from now on for `limits` and `options` (a device profile, other variants).
    pub fn replan(&self, limits: DeviceLimits, options: CudaOptions) -> Result<(), String> {
        {
            let mut p = self.planner.borrow_mut();
            let attrs = K::ALL.iter().map(|&k| p.attrs(k)).collect();
            *p = Planner::new(limits, options, attrs);
        }
        self.opt_in()
    }

    /// The rows of the forward pass under way: its launches overlap (programmatic dependent
    /// launch) when they are at most [`PDL_MAX_ROWS`].
    pub fn set_step_rows(&self, rows: usize) {
        self.step_rows.set(rows);
    }

    /// Rows of the forward pass under way.
    pub fn step_rows(&self) -> usize {
        self.step_rows.get()
    }

    /// Counts one launch or other stream operation; whether to make it (false while a graph
    /// replay does the work).
    pub(crate) fn enqueue(&self) -> bool {
        self.launched.set(self.launched.get() + 1);
        !self.skip.get()
    }

    /// Launches and other stream operations asked for so far.
    pub(crate) fn launched(&self) -> usize {
        self.launched.get()
    }

    /// From now on, count launches without making them (`true`) or make them.
    pub(crate) fn set_skip(&self, skip: bool) {
        self.skip.set(skip);
    }

    pub fn planner(&self) -> Ref<'_, Planner> {
        self.planner.borrow()
    }

    pub fn profiler(&self) -> Option<&Profiler> {
        self.profiler.as_ref()
    }

    /// Per kernel: registers per thread, static shared memory, local (spill) bytes per thread
    /// and the dynamic shared memory it is opted into.
    pub fn describe(&self) -> Vec<String> {
        let planner = self.planner.borrow();
        let limits = self.smem_limit.borrow();
        K::ALL
            .iter()
            .map(|&k| {
                let a = planner.attrs(k);
                format!(
                    "{}: {} registers, {} B static shared, {} B local, up to {} B dynamic shared",
                    k.name(),
                    a.regs,
                    a.static_smem,
                    a.local_bytes,
                    limits[k as usize]
                )
            })
            .collect()
    }

    /// `cuLaunchKernelEx` of kernel `i` with `args`, programmatic stream serialization allowed
    /// with `pdl` (every kernel waits for the previous one's results first: `pdl_start`).
    ///
    /// # Safety
    /// `args` must follow the kernel's signature and `at` fit its limits.
    unsafe fn launch_raw(
        &self,
        i: usize,
        at: Launch,
        args: &[Arg],
        pdl: bool,
    ) -> Result<(), String> {
        use cudarc::driver::sys;
        use std::ffi::c_void;
        let mut params: Vec<*mut c_void> = args
            .iter()
            .map(|a| match a {
                Arg::Ptr(p) | Arg::U64(p) => p as *const u64 as *mut c_void,
                Arg::I32(x) => x as *const i32 as *mut c_void,
                Arg::F32(x) => x as *const f32 as *mut c_void,
                Arg::Rows(t) => *t as *const DecodeRows as *mut c_void,
                Arg::Seqs(t) => *t as *const SeqRows as *mut c_void,
            })
            .collect();
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: at.grid.0,
            gridDimY: at.grid.1,
            gridDimZ: at.grid.2,
            blockDimX: at.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: at.smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: pdl as u32,
        };
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))?;
        // SAFETY: `params` points at values that live through the call, in the kernel's
        // parameter order (the caller's contract); the function belongs to a loaded module.
        let r = unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.loaded.borrow().functions[i].cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        match r {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(format!("{e:?}")),
        }
    }

    /// Launches `k`; a plan beyond what the kernel may use here is an error, never a launch.
    /// Tests: the launch after the next `n` panics (as a bug in a step would), once.
    pub fn panic_after(&self, n: usize) {
        self.panic_after.set(Some(n));
    }

    fn launch(&self, k: K, at: Launch, args: &[Arg]) -> BResult<()> {
        let i = k as usize;
        if let Some(n) = self.panic_after.get() {
            self.panic_after.set(n.checked_sub(1));
            assert!(n > 0, "a panic asked for by a test, launching {}", k.name());
        }
        let planner = self.planner.borrow();
        let attrs = planner.attrs(k);
        let smem_limit = self.smem_limit.borrow()[i];
        if at.smem as usize > smem_limit || at.block > attrs.max_threads.max(1) || at.block == 0 {
            return Err(BackendError(format!(
                "kernel {}: a plan of {} threads and {} B of dynamic shared memory does not fit \
                 {} (at most {} threads, {} B dynamic)",
                k.name(),
                at.block,
                at.smem,
                planner.limits.name,
                attrs.max_threads,
                smem_limit
            )));
        }
        let pdl = planner.options.pdl
            && planner.limits.cc >= (9, 0)
            && self.step_rows.get() <= PDL_MAX_ROWS;
        drop(planner);
        if !self.enqueue() {
            return Ok(());
        }
        let t0 = self.profiler.as_ref().and_then(|p| p.start(&self.stream));
        // SAFETY: the arguments follow the kernel's signature (the table is checked against
        // the sources), and the plan fits the kernel's limits (checked above).
        unsafe { self.launch_raw(i, at, args, pdl) }
            .map_err(|e| BackendError(format!("CUDA launching {}: {e}", k.name())))?;
        if let Some(p) = &self.profiler {
            let name = match at.shape {
                Some((r, c)) => format!("{} {r}x{c}", k.name()),
                None => k.name().to_string(),
            };
            p.end(name, t0, &self.stream);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `extern "C" __global__` kernels of a source text: (name, [(param name, kind)]).
    fn signatures(src: &str) -> Vec<(String, Vec<(String, Param)>)> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(at) = rest.find("extern \"C\" __global__") {
            rest = &rest[at + 1..];
            let open = rest.find('(').unwrap();
            let head = &rest[..open];
            // Skip __launch_bounds__(...): the name is the last word before the params' '('.
            let (head, body_from) = if head.contains("__launch_bounds__") {
                let lb_close = rest.find(')').unwrap();
                let after = &rest[lb_close + 1..];
                let open2 = after.find('(').unwrap();
                (&after[..open2], lb_close + 1 + open2)
            } else {
                (head, open)
            };
            let name = head.split_whitespace().last().unwrap().to_string();
            let close = rest[body_from..].find(')').unwrap() + body_from;
            let params = rest[body_from + 1..close]
                .split(',')
                .map(|p| {
                    let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                    let split = p
                        .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
                        .unwrap();
                    let (ty, pname) = (p[..=split].trim(), &p[split + 1..]);
                    let kind = if ty.contains('*') {
                        Param::Ptr
                    } else {
                        match ty {
                            "int" => Param::I32,
                            "float" => Param::F32,
                            "u64" => Param::U64,
                            "DecodeRows" => Param::Rows,
                            "SeqRows" => Param::Seqs,
                            other => panic!("kernel {name}: parameter type {other:?}"),
                        }
                    };
                    (pname.to_lowercase(), kind)
                })
                .collect();
            out.push((name, params));
        }
        out
    }

    #[test]
    fn the_table_follows_every_kernel_signature_in_the_sources() {
        let mut seen = 0;
        for (file, text) in crate::sources::FILES {
            for (name, params) in signatures(text) {
                let k = K::ALL
                    .iter()
                    .find(|k| k.name() == name)
                    .unwrap_or_else(|| panic!("kernel {name} of {file} is not in the table"));
                assert_eq!(k.file(), *file, "kernel {name}: table says {}", k.file());
                let table: Vec<(String, Param)> = k
                    .params()
                    .iter()
                    .map(|(n, p)| (n.to_string(), *p))
                    .collect();
                assert_eq!(table, params, "kernel {name}: table vs {file}");
                seen += 1;
            }
        }
        assert_eq!(
            seen,
            K::ALL.len(),
            "every kernel of the table is in a source file once"
        );
    }
}
