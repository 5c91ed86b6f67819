//! Launch plans: the grid, block, shared memory and variant of every kernel launch, computed
//! from one [`Planner`] (the device's limits, the options, and each kernel's registers and
//! static shared memory as compiled). A kernel that needs more than a device gives has a
//! variant that fits (the top-k's keys in global memory, the one-pass lightning kernel
//! single-buffered), and the plan picks it. `scripts/check-kernels.sh` evaluates these same
//! functions for every card of [`crate::device::CARDS`] ([`Planner::check_launches`]).

use crate::device::DeviceLimits;
use crate::kernels::K;
use crate::options::{Attention, CudaOptions, LightningPrefill, SelectScores};
use sala_checkpoint::{KvCacheDtype, SparseConfig};
use sala_model::{AttnShape, SparseMode};

mod launches;
pub use launches::CheckShape;

/// One launch's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    /// Dynamic shared memory, bytes.
    pub smem: u32,
    /// The product's (rows, cols), a label for per-kernel profiles.
    pub shape: Option<(usize, usize)>,
}

impl Launch {
    pub fn new(grid: (usize, usize, usize), block: u32, smem: usize) -> Self {
        Self {
            grid: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block,
            smem: smem as u32,
            shape: None,
        }
    }

    /// This launch, profiled under `rows x cols`.
    pub fn shaped(self, rows: usize, cols: usize) -> Self {
        Self {
            shape: Some((rows, cols)),
            ..self
        }
    }

    /// `n` threads' work in blocks of `block` (at least one block).
    pub fn linear(n: usize, block: u32) -> Self {
        Self::new((n.div_ceil(block as usize).max(1), 1, 1), block, 0)
    }
}

/// What the compiler made of a kernel: registers per thread, static shared memory, local
/// (spill) bytes per thread and the most threads a block may have with those registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelAttrs {
    pub regs: u32,
    pub static_smem: usize,
    pub local_bytes: usize,
    pub max_threads: u32,
}

impl Default for KernelAttrs {
    fn default() -> Self {
        Self {
            regs: 0,
            static_smem: 0,
            local_bytes: 0,
            max_threads: 1024,
        }
    }
}

// ---- Kernel constants (the `#define`s of the kernels that the plans depend on) ----

/// Tokens per lightning chunk (`LF_C`, `LT_C`, `LC_C`).
pub const LIGHTNING_CHUNK: usize = 64;
/// From this many rows on, lightning layers run on tensor cores (the split kernels).
pub const LIGHTNING_MMA_ROWS: usize = 64;
/// `attention_gather`'s (warps a block, stages a warp) for stages of `keys` keys (16 or 32:
/// `KEYS` in sparse/attention_walk.cu), best first. 32 keys: four warps (four queries sharing
/// their forced blocks) with two stages in flight each while they compute a third where the
/// shared memory allows (192 KiB at d = 128; on the H200 (3, 2), (6, 2) and (4, 2) ran 2-6%
/// slower at 128K before the forced blocks were shared), fewer warps on 99 KiB cards. 16 keys
/// (the default): twice the warps in the same memory, two a scheduler to hide each other's
/// stage (6-8% faster at 128K, 1.5% at 1M on the H100). Warps a block are a power of two: a
/// block's queries share one 64-key block.
pub fn gather_shapes(keys: usize) -> &'static [(usize, usize)] {
    match keys {
        16 => &[(8, 3), (8, 2), (4, 3), (4, 2), (2, 2), (1, 2)],
        _ => &[(4, 3), (2, 3), (2, 2), (1, 2)],
    }
}

/// Bytes of one `attention_gather` stage: K and V of `keys` keys of head size `d`.
pub fn gather_stage_bytes(d: usize, keys: usize) -> usize {
    2 * keys * d * 2
}

/// Bytes of one `attention_gather_f8` stage: K and V codes of `keys` keys of head size `d`,
/// then their K and V scales.
pub fn gather_stage_bytes_fp8(d: usize, keys: usize) -> usize {
    2 * keys * d + 2 * keys * 4
}

/// Tokens a range of `lightning_ranges` aims for (16 chunks: an 8K-token call runs 8 ranges a
/// head; measured on the H100 against 256, 512 and 2048 tokens).
pub const LIGHTNING_RANGE_TOKENS: usize = 1024;
/// Most bytes of lightning states the range and split paths keep at once (the ranges' sums,
/// the split path's per-chunk states)
/// (128 MiB measured 4% faster at 8K tokens, for 0.09 GiB more at peak).
pub const LIGHTNING_SCRATCH_BYTES: usize = 64 << 20;
/// Decode rows from which `lightning_decode_rows` gives each lane two value columns.
pub const LIGHTNING_DECODE_PAIRED_ROWS: usize = 8;

/// Rows of a batched decode step launched at once (`DECODE_ROWS` in rows.cuh).
pub const DECODE_ROWS: usize = 64;
/// Sequences of a batched sparse decode step (`SEQ_ROWS` in rows.cuh).
pub const SEQ_ROWS: usize = 64;

/// Output rows per block of `gemv` (4 warps of 4 rows), and the largest inner size GEMVs take.
pub const GEMV_ROWS_PER_BLOCK: usize = 16;
pub const GEMV_MAX_K: usize = 1 << 20;
/// Products with at most this many output rows run as `gemv_narrow` (a row a warp).
pub const GEMV_NARROW_MAX_ROWS: usize = 12288;
/// Most dynamic shared memory `gemv_f8_bf16_8` takes for its rows' codes (rows · inner bytes):
/// two decode rows of the released shape's down product, eight of its output product.
pub const GEMV_F8_BF16_SMEM: usize = 32 << 10;
/// Up to this many rows (a batched decode step), products run as GEMVs whose result for a
/// row does not depend on the other rows.
pub const GEMV_BATCH_ROWS: usize = 64;
/// Rows per launch of the tensor-core GEMVs (`gemv_mma8`, `gemv_mma16`, `gemv_rows64`), and their block
/// (`32 * GM_WARPS`).
pub const GEMV_MMA_ROWS: usize = 64;
pub const GEMV_MMA_THREADS: u32 = 512;
/// The widest row a product with its norm made in its blocks takes (`gemv_silu_w4_8_norm`:
/// add_rms_norm's two packs of 8 a thread).
pub const NORM_PRODUCT_MAX_K: usize = 2 * 8 * GEMV_MMA_THREADS as usize;

/// M-tiles (16 weight rows; 8 outputs of the SiLU product) a block of `gemv_rows64` owns, a
/// warp each (`R64_W` of gemv/rows64.cu): the products of 17 to 64 rows.
pub const GEMV_ROWS64_TILES: usize = 4;
pub const GEMV_ROWS64_THREADS: u32 = 32 * GEMV_ROWS64_TILES as u32;
/// Most bytes of group sums a split 17-64-row product writes (`gemv_groups`).
pub const GEMV_CHAIN_SUMS_BYTES: usize = 16 << 20;

/// Groups of `d` threads `attention_merge` reads a row's splits with (`AM_GROUPS`).
pub const ATTENTION_MERGE_GROUPS: usize = 4;
/// Most key splits of one staged attention (the merge reads every split's partial state).
pub const MAX_ATTENTION_SPLIT: usize = 32;
/// `attention_decode`: at most this many warps (64-key walks) per (query, group).
pub const DECODE_SPLIT_MAX: usize = 128;
/// Blocks of `greedy_parts` a row of logits is split over (GREEDY_SLICES in elementwise.cu).
pub const GREEDY_SLICES: usize = 32;
/// From this many query rows on, staged attention runs as `attention_prefill`.
pub const PREFILL_ATTENTION_ROWS: usize = 64;
/// Elements a warp of `head_norm_rope_lanes` norms and rotates: 512 / d heads.
pub const HEAD_NORM_ROPE_WARP_ELEMS: usize = 512;
/// Most bytes of block scores (bf16) the tensor-core selection keeps at once (the default of
/// `CudaOptions::select_scores_bytes`).
pub const SELECT_SCORES_BYTES: usize = 128 << 20;
/// From this many (query, KV group) pairs on, block selection runs as prefill.
pub const SELECT_ONE_KERNEL_PAIRS: usize = 264;
/// Queries per block of the prefill block-score kernels (8 warps of 2).
pub const SELECT_QUERIES_PER_BLOCK: usize = 16;
/// Windows per block of `sd_p` (4 warps of 64) and of `sd_lse` (16 warps of 16), their threads,
/// and `sd_topk`'s.
pub const SD_KEYS: usize = 256;
pub const SD_LSE_KEYS: usize = 256;
pub const SD_THREADS: u32 = 128;
pub const SD_LSE_THREADS: u32 = 512;
pub const SD_TOPK_THREADS: u32 = 1024;
/// Most candidate blocks `sd_topk*` take (16-bit counts).
pub const SD_TOPK_MAX_CANDIDATES: usize = 65535;
/// Most dynamic shared memory `sd_topk` stages keys and P in.
pub const SD_TOPK_MAX_SMEM: usize = 200 << 10;
/// `select_scores_wg`'s dynamic shared memory (`SW_SMEM_USED` + 1 KiB to align the base).
pub const SELECT_WG_SMEM: usize = 111_648 + 1024;

/// `lightning_ranges` for head size `d` with Q, K and V in `buffers` (1 or 2) buffers
/// (`LR_SMEM`): the three tiles a buffer, A as bf16 hi + lo, the decay powers.
pub fn lightning_ranges_smem(d: usize, buffers: usize) -> usize {
    buffers * 3 * 64 * d * 2 + 2 * 64 * 64 * 2 + 68 * 4
}

/// `lightning_range_sums` (`LR_SMEM(d, buffers, 2)`): K and V a buffer, the decay powers.
pub fn lightning_range_sums_smem(d: usize, buffers: usize) -> usize {
    buffers * 2 * 64 * d * 2 + 68 * 4
}

/// Candidate blocks of a sequence of `len` tokens: at most one per block.
pub fn candidate_blocks(len: usize, cfg: &SparseConfig) -> usize {
    len.div_ceil(cfg.block_size)
}

/// Blocks of the cluster `sd_topk_rows_cl` splits a pair's candidates over.
pub const SD_TOPK_CLUSTER: usize = 8;

/// `sd_topk_rows_cl`'s dynamic shared memory for `candidates` blocks of `w` level-1 windows
/// each: a block's slice of keys (rounded to 8), then the P windows they pool (from a multiple
/// of 8, one before the first and 8 of rounding past the last).
pub fn sd_topk_cluster_smem(candidates: usize, w: usize) -> usize {
    let per = candidates.max(1).div_ceil(SD_TOPK_CLUSTER);
    (2 * per.next_multiple_of(8) + 2 * (w * per + w + 16)).next_multiple_of(16)
}

/// Bytes of `sd_topk*`'s 16-bit keys for `candidates` blocks (a multiple of 16).
fn topk_keys_bytes(candidates: usize) -> usize {
    (2 * candidates.max(1)).next_multiple_of(16)
}

/// Compressed windows `n` keys complete (window, stride).
pub fn windows(n: usize, window: usize, stride: usize) -> usize {
    if n >= window {
        (n - window) / stride + 1
    } else {
        0
    }
}

/// The lightning prefill kernels a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LightningPlan {
    Decode,
    /// `lightning_ranges` with Q, K, V in this many buffers.
    Ranges {
        buffers: u32,
    },
    Split,
    Chunked,
}

/// How `sd_topk*` keep their keys: in shared memory or a global scratch, and whether P is
/// staged beside them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopkPlan {
    /// `sd_topk`, `sd_topk_rows`, or `sd_topk_rows_cl` (decode rows on Hopper: a cluster of
    /// [`SD_TOPK_CLUSTER`] blocks a pair).
    pub kernel: K,
    pub launch: Launch,
    pub keys_in_global: bool,
    pub stage_p: bool,
}

/// The block selection a sparse call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectPlan {
    /// Prefill: block scores on tensor cores (this kernel), then a top-k from them.
    Scores(K),
    /// Decode: `sd_lse`, `sd_p`, `sd_topk`.
    Decode,
    /// The CUDA-core kernels, bit-exact with the CPU.
    Exact,
}

/// The attention a sparse call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPlan {
    /// Few queries: `attention_decode` + merge.
    Decode,
    /// `attention_gather` (sparse prefill).
    Gather,
    /// `attention_prefill` with this bitmap.
    Prefill,
    /// `attention`, split over this many key ranges when more than 1 (`attention_split` + merge).
    Staged { split: usize },
}

/// The launch plans of one device under one set of options.
#[derive(Debug, Clone)]
pub struct Planner {
    pub limits: DeviceLimits,
    pub options: CudaOptions,
    attrs: Vec<KernelAttrs>,
}

impl Planner {
    /// `attrs` in the order of [`K`] (one per kernel).
    pub fn new(limits: DeviceLimits, options: CudaOptions, attrs: Vec<KernelAttrs>) -> Self {
        assert_eq!(attrs.len(), K::ALL.len(), "one KernelAttrs per kernel");
        Self {
            limits,
            options,
            attrs,
        }
    }

    pub fn attrs(&self, k: K) -> KernelAttrs {
        self.attrs[k as usize]
    }

    /// Blocks of `k` (`threads` a block, `smem` bytes of dynamic shared memory) the whole GPU
    /// holds at once, at least one an SM.
    pub fn resident_blocks(&self, k: K, threads: u32, smem: usize) -> usize {
        let a = self.attrs(k);
        let per_sm = self
            .limits
            .blocks_per_sm(threads, a.regs, a.static_smem + smem);
        per_sm.max(1) as usize * self.limits.sms as usize
    }

    /// A 4-bit SiLU product of one row with the residual add and norm before it made in each of
    /// its `blocks` blocks (`gemv_silu_w4_8_norm`): the normed row, `k` wide, in shared memory.
    pub fn gemv_w4_norm(&self, blocks: usize, k: usize) -> Launch {
        Launch::new((blocks.max(1), 1, 1), GEMV_MMA_THREADS, 2 * k)
    }

    /// `add_rms_norm` over `rows` rows: a block takes rows in turn, as many blocks as the GPU
    /// holds at once.
    pub fn add_rms_norm(&self, rows: usize) -> Launch {
        let blocks = rows.min(self.resident_blocks(K::AddRmsNorm, 512, 0)).max(1);
        Launch::new((blocks, 1, 1), 512, 0)
    }

    /// Dynamic shared memory `k` may use on this device: what is left of the opt-in limit
    /// beside its static shared memory.
    pub fn smem_budget(&self, k: K) -> usize {
        self.limits
            .smem_per_block_optin
            .saturating_sub(self.attrs(k).static_smem)
    }

    fn fits(&self, k: K, smem: usize) -> bool {
        smem <= self.smem_budget(k)
    }

    /// The most dynamic shared memory any plan of `k` asks for on this device: what the
    /// kernel is opted into when it is loaded (never more than the device allows).
    pub fn max_dynamic_smem(&self, k: K) -> usize {
        let need = match k {
            K::LightningRanges => lightning_ranges_smem(128, 2),
            K::LightningRangeSums => lightning_range_sums_smem(128, 2),
            K::LightningStateTerm => LST_ROWS * 256 * 4,
            K::SdTopk | K::SdTopkRows => SD_TOPK_MAX_SMEM,
            // Its plans ask at most what fits (see sd_topk).
            K::SdTopkRowsCl if self.limits.hopper_instructions => usize::MAX,
            K::SdTopkScores => topk_keys_bytes(SD_TOPK_MAX_CANDIDATES),
            K::SelectScoresWg if self.limits.hopper_instructions => SELECT_WG_SMEM,
            K::GemvF8Bf16x8 => GEMV_F8_BF16_SMEM,
            // The exact selection's per-group query rows: 16 heads of d ≤ 256.
            K::SparseSelect | K::SelectScores => 16 * (256 + 3) * 4,
            K::SelectLse => (256 + 3) * 4,
            // The block bitmap of attention_prefill (at most 9 KiB, see prefill_attention_fits).
            K::AttentionPrefill => 9 << 10,
            // Its rings: the first of gather_shapes that fits, up to all the device allows.
            K::AttentionGather | K::AttentionGatherF8 => usize::MAX,
            _ => 0,
        };
        need.min(self.smem_budget(k))
    }

    /// Warps `attention_decode` aims for in all: an eighth of what the device keeps resident.
    pub fn decode_warps(&self) -> usize {
        (self.limits.resident_warps() / 8).max(1)
    }

    // ---- Lightning ----

    /// The lightning kernels for `rows` rows of head size `d`.
    pub fn lightning(&self, rows: usize, d: usize) -> LightningPlan {
        if rows == 1 && d <= 256 {
            return LightningPlan::Decode;
        }
        let pref = self.options.lightning_prefill;
        if pref <= LightningPrefill::Ranges && rows >= 2 && (d == 64 || d == 128) {
            if let Some(buffers) = self.lightning_ranges_buffers(d) {
                return LightningPlan::Ranges { buffers };
            }
        }
        if pref <= LightningPrefill::Split
            && rows >= LIGHTNING_MMA_ROWS
            && d.is_multiple_of(16)
            && d <= 128
        {
            return LightningPlan::Split;
        }
        LightningPlan::Chunked
    }

    /// Q, K and V double-buffered where they fit, else single-buffered (99 KiB cards).
    pub fn lightning_ranges_buffers(&self, d: usize) -> Option<u32> {
        [2, 1]
            .into_iter()
            .find(|&b| self.fits(K::LightningRanges, lightning_ranges_smem(d, b)))
            .map(|b| b as u32)
    }

    /// The kernel and launch of a step's decode rows, each its own sequence: from
    /// `LIGHTNING_DECODE_PAIRED_ROWS` rows (and d ≤ 128) the paired kernel, two value columns a
    /// lane (half the blocks, each staging a row's q and k once for twice the state: at 64 rows
    /// the blocks' lifetimes, not the state's bytes, bounded the kernel).
    pub fn lightning_decode_rows(&self, heads: usize, d: usize, rows: usize) -> (K, Launch) {
        if rows >= LIGHTNING_DECODE_PAIRED_ROWS && d <= 128 {
            let at = Launch::new((heads, d.div_ceil(64), rows), 256, 0);
            (K::LightningDecodeRowsPaired, at)
        } else {
            (
                K::LightningDecodeRows,
                self.lightning_decode(heads, d, rows),
            )
        }
    }

    pub fn lightning_decode(&self, heads: usize, d: usize, rows: usize) -> Launch {
        Launch::new((heads, d.div_ceil(32), rows), 256, 0)
    }

    /// `lightning_state_term` over `rows` rows of `heads` heads of size `d` (at most 256).
    pub fn lightning_state_term(&self, rows: usize, heads: usize, d: usize) -> Launch {
        Launch::new(
            (rows.div_ceil(LST_ROWS), heads, 1),
            d as u32,
            LST_ROWS * d * 4,
        )
    }

    /// `lightning_ranges` over `ranges` ranges (grid y) with `buffers` buffers.
    pub fn lightning_ranges(&self, heads: usize, d: usize, ranges: usize, buffers: u32) -> Launch {
        Launch::new(
            (heads, ranges, 1),
            2 * d as u32,
            lightning_ranges_smem(d, buffers as usize),
        )
    }

    /// `lightning_range_sums` over the first `ranges` ranges (grid y).
    pub fn lightning_range_sums(
        &self,
        heads: usize,
        d: usize,
        ranges: usize,
        buffers: u32,
    ) -> Launch {
        Launch::new(
            (heads, ranges, 1),
            2 * d as u32,
            lightning_range_sums_smem(d, buffers as usize),
        )
    }

    /// Ranges a lightning call over `t` tokens is cut into, and their length: ranges of
    /// `options.lightning_range_tokens` tokens, at most as many as the scratch holds sums of.
    pub fn lightning_range_split(&self, t: usize, heads: usize, d: usize) -> (usize, usize) {
        let most = (LIGHTNING_SCRATCH_BYTES / (4 * heads * d * d)).max(1);
        let want = self.options.lightning_range_tokens.max(LIGHTNING_CHUNK);
        let n = t.div_ceil(want).clamp(1, most);
        let range_len = t.div_ceil(n).next_multiple_of(LIGHTNING_CHUNK);
        (t.div_ceil(range_len), range_len)
    }

    /// Tokens of a split window whose chunk states fit the scratch.
    pub fn lightning_window(&self, heads: usize, d: usize) -> usize {
        (LIGHTNING_SCRATCH_BYTES / (4 * heads * d * d)).max(1) * LIGHTNING_CHUNK
    }

    pub fn lightning_chunk_state(&self, chunks: usize, heads: usize) -> Launch {
        Launch::new((chunks, heads, 1), 256, 0)
    }

    pub fn lightning_chunk_out(&self, chunks: usize, heads: usize) -> Launch {
        Launch::new((chunks, heads, 1), 128, 0)
    }

    pub fn lightning_chunked(&self, heads: usize, d: usize) -> Launch {
        Launch::new((heads, d.div_ceil(32), 1), 256, 0)
    }

    // ---- Sparse layers: block selection ----

    /// The selection for `rows` queries of a sequence that holds `len` tokens.
    pub fn select(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        rows: usize,
        len: usize,
    ) -> SelectPlan {
        let pairs = rows * shape.kv_heads;
        if self.options.exact_select {
            return SelectPlan::Exact;
        }
        if pairs >= SELECT_ONE_KERNEL_PAIRS && fast_select_fits(shape, cfg) {
            return SelectPlan::Scores(self.select_scores_kernel(shape, cfg));
        }
        if pairs < SELECT_ONE_KERNEL_PAIRS && decode_select_fits(shape, cfg, len) {
            return SelectPlan::Decode;
        }
        SelectPlan::Exact
    }

    /// The block-score kernel of the prefill selection.
    pub fn select_scores_kernel(&self, shape: AttnShape, cfg: &SparseConfig) -> K {
        let keys_as_rows = cfg.block_size == 4 * cfg.k1_stride()
            && self.options.select_scores == SelectScores::KeysAsRows;
        let wgmma = self.options.wgmma
            && self.limits.hopper_instructions
            && self.fits(K::SelectScoresWg, SELECT_WG_SMEM);
        if keys_as_rows && shape.head_dim == 128 && wgmma {
            K::SelectScoresWg
        } else if keys_as_rows {
            K::SelectScoresT
        } else {
            K::SelectScoresMma
        }
    }

    /// Queries per launch of `kernel`'s prefill selection of `rows` queries: of the splits
    /// whose block scores fit the scratch, the one with the fewest waves of blocks over the
    /// SMs in all (a launch of one SM's worth of blocks past a full wave takes a second wave),
    /// then the fewest launches.
    pub fn select_group(
        &self,
        kernel: K,
        kv_heads: usize,
        len: usize,
        rows: usize,
        cfg: &SparseConfig,
    ) -> usize {
        let rows = rows.max(1);
        let stride = len.div_ceil(cfg.block_size).max(1);
        let per_query = kv_heads * stride * 2;
        let most = (self.options.select_scores_bytes / per_query).max(SELECT_QUERIES_PER_BLOCK)
            / SELECT_QUERIES_PER_BLOCK
            * SELECT_QUERIES_PER_BLOCK;
        if rows <= most {
            return rows;
        }
        let launch = self.select_scores(kernel, SELECT_QUERIES_PER_BLOCK, 1);
        let slots = self.resident_blocks(kernel, launch.block, launch.smem as usize);
        let waves = |queries: usize| {
            (queries.div_ceil(SELECT_QUERIES_PER_BLOCK) * kv_heads).div_ceil(slots)
        };
        let cost = |per: usize| (rows / per) * waves(per) + waves(rows % per);
        let mut best = most;
        for launches in rows.div_ceil(most)..=rows.div_ceil(SELECT_QUERIES_PER_BLOCK) {
            let per = rows
                .div_ceil(launches)
                .next_multiple_of(SELECT_QUERIES_PER_BLOCK)
                .min(most);
            // Launch counts rise through the loop, so a tie keeps the fewer launches.
            if cost(per) < cost(best) {
                best = per;
            }
        }
        best
    }

    pub fn select_scores(&self, kernel: K, queries: usize, kv_heads: usize) -> Launch {
        let smem = if kernel == K::SelectScoresWg {
            SELECT_WG_SMEM
        } else {
            0
        };
        Launch::new(
            (queries.div_ceil(SELECT_QUERIES_PER_BLOCK), kv_heads, 1),
            256,
            smem,
        )
    }

    /// The top-k over a prefill selection's block scores: `sd_topk_scores` (keys in shared
    /// memory where they fit, else in global memory), or `select_topk_scores` beyond the
    /// 16-bit counts (or `CudaOptions::topk_scores_max_candidates`).
    pub fn topk_scores(&self, pairs: usize, len: usize, cfg: &SparseConfig) -> TopkPlan {
        let candidates = candidate_blocks(len, cfg);
        let most = SD_TOPK_MAX_CANDIDATES.min(self.options.topk_scores_max_candidates);
        if candidates > most {
            return TopkPlan {
                kernel: K::SelectTopkScores,
                launch: Launch::new((pairs, 1, 1), 256, 0),
                keys_in_global: false,
                stage_p: false,
            };
        }
        let keys = topk_keys_bytes(candidates);
        let in_smem = self.fits(K::SdTopkScores, keys) && !self.options.topk_keys_in_global;
        TopkPlan {
            kernel: K::SdTopkScores,
            launch: Launch::new(
                (pairs, 1, 1),
                SD_TOPK_THREADS,
                if in_smem { keys } else { 0 },
            ),
            keys_in_global: !in_smem,
            stage_p: false,
        }
    }

    /// `sd_lse` (or its rows twin) over `n2` level-2 windows.
    pub fn sd_lse(&self, pairs: usize, n2: usize) -> Launch {
        Launch::new(
            (pairs, n2.div_ceil(SD_LSE_KEYS).max(1), 1),
            SD_LSE_THREADS,
            0,
        )
    }

    /// `sd_p` (or its rows twin) over `n1` level-1 windows.
    pub fn sd_p(&self, pairs: usize, n1: usize) -> Launch {
        Launch::new((pairs, n1.div_ceil(SD_KEYS).max(1), 1), SD_THREADS, 0)
    }

    /// Row stride of `sd_p`'s bf16 P, and of `sd_topk`'s keys when they are in global memory,
    /// for sequences of up to `len` tokens with `n1` level-1 windows: a multiple of 8 (two
    /// values a word, 16-byte rows).
    pub fn sd_p_stride(&self, n1: usize, len: usize, cfg: &SparseConfig) -> usize {
        n1.max(candidate_blocks(len, cfg))
            .max(1)
            .next_multiple_of(8)
    }

    /// `sd_topk` (`rows`: its rows twin) for sequences of up to `len` tokens: keys, then P,
    /// in shared memory as far as the device allows; keys in global memory beyond.
    pub fn sd_topk(
        &self,
        rows: bool,
        pairs: usize,
        len: usize,
        p_stride: usize,
        cfg: &SparseConfig,
    ) -> TopkPlan {
        let candidates = candidate_blocks(len, cfg);
        let cluster_smem = sd_topk_cluster_smem(candidates, cfg.block_size / cfg.k1_stride());
        if rows
            && self.limits.hopper_instructions
            && !self.options.topk_keys_in_global
            && self.fits(K::SdTopkRowsCl, cluster_smem)
        {
            return TopkPlan {
                kernel: K::SdTopkRowsCl,
                launch: Launch::new(
                    (pairs * SD_TOPK_CLUSTER, 1, 1),
                    SD_TOPK_THREADS,
                    cluster_smem,
                ),
                keys_in_global: false,
                stage_p: true,
            };
        }
        let k = if rows { K::SdTopkRows } else { K::SdTopk };
        let budget = self.smem_budget(k).min(SD_TOPK_MAX_SMEM);
        let keys = topk_keys_bytes(candidates);
        let keys_in_global = keys > budget || self.options.topk_keys_in_global;
        let stage_p = !keys_in_global && keys + 2 * p_stride <= budget;
        let smem = match (keys_in_global, stage_p) {
            (true, _) => 0,
            (false, false) => keys,
            (false, true) => keys + 2 * p_stride,
        };
        TopkPlan {
            kernel: k,
            launch: Launch::new((pairs, 1, 1), SD_TOPK_THREADS, smem),
            keys_in_global,
            stage_p,
        }
    }

    /// The exact selection: `sparse_select` (prefill) and the three decode kernels.
    pub fn exact_select_smem(&self, shape: AttnShape) -> usize {
        shape.group() * (shape.head_dim + 3) * 4
    }

    // ---- Sparse layers: compression and attention ----

    pub fn compress_keys(&self, n_windows: usize, kv_width: usize) -> Launch {
        Launch::linear(n_windows * kv_width, 256)
    }

    /// `kv_store_f8`: a warp per (row, KV head, K or V), four warps a block.
    pub fn kv_store_fp8(&self, rows: usize, kv_heads: usize) -> Launch {
        Launch::new(((rows * kv_heads * 2).div_ceil(4), 1, 1), 128, 0)
    }

    /// `append_kv_rows`: a block per decode row (its K and V row, then its new windows).
    pub fn append_kv_rows(&self, rows: usize) -> Launch {
        Launch::new((rows, 1, 1), 256, 0)
    }

    /// The attention for `t` queries of a sequence now holding `len` tokens.
    pub fn attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        t: usize,
        len: usize,
    ) -> AttentionPlan {
        let walk = self.warp_walk(shape, cfg, mode);
        let pairs = t * shape.kv_heads;
        // FP8 caches are read by the warp-walk kernels only (`fp8_cache_fits`), dense or not.
        if cfg.kv_cache == KvCacheDtype::Fp8 {
            return match pairs < SELECT_ONE_KERNEL_PAIRS {
                true => AttentionPlan::Decode,
                false => AttentionPlan::Gather,
            };
        }
        if walk && pairs < SELECT_ONE_KERNEL_PAIRS {
            return AttentionPlan::Decode;
        }
        if walk && mode == SparseMode::Sparse {
            return AttentionPlan::Gather;
        }
        if t >= PREFILL_ATTENTION_ROWS
            && prefill_attention_fits(shape, cfg, mode, len)
            && self.fits(K::AttentionPrefill, prefill_bitmap_bytes(mode, len))
        {
            return AttentionPlan::Prefill;
        }
        let launch = self.attention_staged(t, shape);
        let blocks = (launch.grid.0 * launch.grid.1) as usize;
        let chunks = match mode {
            SparseMode::Dense => len.div_ceil(64),
            SparseMode::Sparse => cfg.selected_blocks() * cfg.block_size.div_ceil(64),
        };
        // Enough blocks for two waves of one block an SM.
        let split = (2 * self.limits.sms as usize)
            .div_ceil(blocks)
            .clamp(1, chunks.clamp(1, MAX_ATTENTION_SPLIT));
        AttentionPlan::Staged { split }
    }

    /// Whether attention runs a warp per (query, group) and 64-key block walk.
    pub fn warp_walk(&self, shape: AttnShape, cfg: &SparseConfig, mode: SparseMode) -> bool {
        shape.group() <= 16
            && matches!(shape.head_dim, 64 | 128)
            && (mode == SparseMode::Dense || cfg.block_size == 64)
            && self.options.attention == Attention::WarpWalk
    }

    /// Warps (key splits) of `attention_decode` for a sequence of `len` tokens and `pairs`
    /// (query, group) pairs.
    pub fn decode_split(&self, mode: SparseMode, len: usize, k_sel: usize, pairs: usize) -> usize {
        let walk = match mode {
            SparseMode::Dense => len.div_ceil(64),
            SparseMode::Sparse => k_sel,
        };
        walk.min(DECODE_SPLIT_MAX)
            .min((self.decode_warps() / pairs.max(1)).max(1))
            .max(1)
    }

    pub fn attention_decode(&self, pairs: usize, split: usize) -> Launch {
        Launch::new((pairs, split.div_ceil(4), 1), 128, 0)
    }

    /// Keys of K and V an `attention_gather` stage holds (`CudaOptions::gather_keys`).
    pub fn gather_keys(&self) -> usize {
        self.options.gather_keys
    }

    /// `attention_gather` and its ring depth: `warps` warps a block (neighbouring queries of a
    /// KV group), each streaming the blocks of its own through `stages` shared-memory stages of
    /// [`Planner::gather_keys`] keys of K and V. The first shape of [`gather_shapes`] that fits
    /// this device's shared memory.
    pub fn attention_gather(&self, t: usize, kv_heads: usize, d: usize) -> (Launch, usize) {
        let stage = gather_stage_bytes(d, self.gather_keys());
        self.gather_launch(K::AttentionGather, stage, t, kv_heads)
    }

    /// `attention_gather_f8`: as [`Planner::attention_gather`], with FP8 stages.
    pub fn attention_gather_fp8(&self, t: usize, kv_heads: usize, d: usize) -> (Launch, usize) {
        let stage = gather_stage_bytes_fp8(d, self.gather_keys());
        self.gather_launch(K::AttentionGatherF8, stage, t, kv_heads)
    }

    fn gather_launch(&self, k: K, stage: usize, t: usize, kv_heads: usize) -> (Launch, usize) {
        let (warps, stages) = gather_shapes(self.gather_keys())
            .iter()
            .copied()
            .find(|&(w, s)| self.fits(k, w * s * stage))
            .unwrap_or((1, 2));
        // Tiles of `warps` positions from a multiple of `warps`: one more than whole ones.
        let launch = Launch::new(
            ((t.div_ceil(warps) + 1) * kv_heads, 1, 1),
            32 * warps as u32,
            warps * stages * stage,
        );
        (launch, stages)
    }

    pub fn attention_prefill(
        &self,
        t: usize,
        kv_heads: usize,
        mode: SparseMode,
        len: usize,
    ) -> Launch {
        Launch::new(
            (t.div_ceil(8), kv_heads, 1),
            256,
            prefill_bitmap_bytes(mode, len),
        )
    }

    /// `attention` (z = 1) or `attention_split`: 64 (query, head) rows of a KV group a block.
    pub fn attention_staged(&self, t: usize, shape: AttnShape) -> Launch {
        Launch::new(
            ((t * shape.group()).div_ceil(64).max(1), shape.kv_heads, 1),
            128,
            0,
        )
    }

    pub fn attention_merge(&self, t: usize, heads: usize, d: usize) -> Launch {
        Launch::new((t * heads, 1, 1), (ATTENTION_MERGE_GROUPS * d) as u32, 0)
    }

    // ---- Dense ops ----

    /// Whether a product of `rows` rows with a `[n, k]` weight runs as GEMVs, one per row.
    pub fn gemv_fits(&self, rows: usize, k: usize) -> bool {
        rows <= GEMV_BATCH_ROWS && k.is_multiple_of(8) && k <= GEMV_MAX_K
    }

    /// Groups the 16 chains (warps) of a tensor-core GEMV's sums are added in, for a weight
    /// of `rows` rows (`silu`: [gate; up], rows / 2 outputs): the shape's alone, so every row
    /// count gets the same bits. Its 17-64-row product runs a group a part
    /// (`gemv_rows64_parts` / `gemv_silu_rows64_parts`, then `gemv_chain_sums`): the most
    /// parts (a power of two, at most 16) whose blocks all fit the SMs at once and whose sums
    /// at 64 rows fit [`GEMV_CHAIN_SUMS_BYTES`]; 1 where one launch's blocks fill the SMs.
    pub fn gemv_groups(&self, silu: bool, rows: usize) -> usize {
        let kernel = if silu {
            K::GemvSiluRows64Parts
        } else {
            K::GemvRows64Parts
        };
        let blocks = Self::rows64_blocks(silu, rows);
        let slots = self.resident_blocks(kernel, GEMV_ROWS64_THREADS, 0);
        let mut parts = 1;
        while parts < 16
            && blocks * parts * 2 <= slots
            && Self::chain_sums_len(parts * 2, blocks, GEMV_BATCH_ROWS) * 4 <= GEMV_CHAIN_SUMS_BYTES
        {
            parts *= 2;
        }
        parts
    }

    /// Blocks of a 17-64-row product over a weight of `rows` rows (`silu`: [gate; up], a block
    /// taking 8 outputs' gate and up rows a warp; else 16 rows a warp).
    pub fn rows64_blocks(silu: bool, rows: usize) -> usize {
        if silu {
            (rows / 2).div_ceil(8 * GEMV_ROWS64_TILES)
        } else {
            rows.div_ceil(16 * GEMV_ROWS64_TILES)
        }
    }

    /// Floats of the group sums of a 17-64-row product split into `parts` parts of `blocks`
    /// blocks, `nb` rows: `parts` of (64 M-rows a block) x (nb rounded up to 8).
    pub fn chain_sums_len(parts: usize, blocks: usize, nb: usize) -> usize {
        parts * 64 * blocks * nb.next_multiple_of(8)
    }

    /// Head sizes the one-warp-a-head norm/RoPE code takes (`head_norm_rope_lanes`, and the
    /// lightning decode kernel that norms and rotates its own q and k).
    pub fn head_norm_rope_lanes_fits(d: usize) -> bool {
        matches!(d, 32 | 64 | 128 | 256)
    }

    pub fn head_norm_rope(&self, heads: usize, d: usize) -> (K, Launch) {
        if Self::head_norm_rope_lanes_fits(d) {
            (
                K::HeadNormRopeLanes,
                Launch::new(
                    ((heads * d).div_ceil(8 * HEAD_NORM_ROPE_WARP_ELEMS), 1, 1),
                    256,
                    0,
                ),
            )
        } else {
            (K::HeadNormRope, Launch::linear(heads, 4).with_block(128))
        }
    }
}

/// Rows of q a block of `lightning_state_term` takes (`LST_ROWS` in lightning/context.cu).
const LST_ROWS: usize = 32;

impl Launch {
    fn with_block(self, block: u32) -> Self {
        Self { block, ..self }
    }
}

/// Shapes the tensor-core block selection handles: at most 16 query heads per KV group,
/// head_dim a multiple of 16 up to 128, whole level-1 windows per 64-window tile.
pub fn fast_select_fits(shape: AttnShape, cfg: &SparseConfig) -> bool {
    let w = cfg.windows_per_block();
    shape.group() <= 16
        && shape.head_dim.is_multiple_of(16)
        && shape.head_dim <= 128
        && w >= 1
        && 64 % w == 0
        && cfg.block_size == w * cfg.k1_stride()
}

/// Shapes the `sd_*` selection kernels handle: at most 16 query heads per KV group, head_dim
/// a multiple of 32 up to 128, whole level-1 strides per block, and few enough blocks for the
/// top-k's 16-bit counts.
pub fn decode_select_fits(shape: AttnShape, cfg: &SparseConfig, len: usize) -> bool {
    let w = cfg.windows_per_block();
    shape.group() <= 16
        && shape.head_dim.is_multiple_of(32)
        && shape.head_dim <= 128
        && w >= 1
        && cfg.block_size == w * cfg.k1_stride()
        && candidate_blocks(len, cfg) <= SD_TOPK_MAX_CANDIDATES
}

/// Shapes an FP8 K/V cache serves: the warp-walk kernels read it (`attention_decode_f8`), so
/// at most 16 query heads per KV group, head_dim 64 or 128 and 64-token blocks.
pub fn fp8_cache_fits(shape: AttnShape, cfg: &SparseConfig) -> Result<(), String> {
    if shape.group() <= 16 && matches!(shape.head_dim, 64 | 128) && cfg.block_size == 64 {
        return Ok(());
    }
    Err(format!(
        "an FP8 K/V cache on CUDA needs at most 16 query heads per KV group, head_dim 64 or \
         128 and blocks of 64 tokens; this model has {} heads per group, head_dim {} and \
         blocks of {} (use --kv-cache-dtype bf16, or the CPU)",
        shape.group(),
        shape.head_dim,
        cfg.block_size
    ))
}

/// Shapes `attention_prefill` handles: at most 16 query heads per KV group, head_dim a
/// multiple of 16 up to 128; sparse: 64-token blocks, at most 128 of them per query, and a
/// block bitmap (4 bytes per 32 blocks of the sequence) within 9 KiB.
pub fn prefill_attention_fits(
    shape: AttnShape,
    cfg: &SparseConfig,
    mode: SparseMode,
    len: usize,
) -> bool {
    let heads_ok =
        shape.group() <= 16 && shape.head_dim.is_multiple_of(16) && shape.head_dim <= 128;
    heads_ok
        && match mode {
            SparseMode::Dense => true,
            SparseMode::Sparse => {
                cfg.block_size == 64
                    && cfg.selected_blocks() <= 128
                    && prefill_bitmap_bytes(mode, len) <= 9 * 1024
            }
        }
}

/// `attention_prefill`'s block bitmap for a sequence of `len` tokens (sparse only).
pub fn prefill_bitmap_bytes(mode: SparseMode, len: usize) -> usize {
    match mode {
        SparseMode::Dense => 0,
        SparseMode::Sparse => 4 * len.div_ceil(64).div_ceil(32),
    }
}
