//! The narrow, model-specific interface the forward pass is written against. The CPU backend
//! implements it now; a GPU backend implements the same ops on device buffers.
//!
//! Conventions: activations are row-major `[rows, cols]`, one row per token of the current
//! chunk. Every op stores its result rounded to bf16, as the reference's bf16 tensors are,
//! except where a method says otherwise. Linear weights are `[out, in]`, `y = x Wᵀ`.

use crate::memory::BackendMemory;
use crate::model::GreedyPick;
use crate::oracle::{AttnShape, SparseMode};
use sala_checkpoint::{ModelConfig, SparseConfig};

/// An error from a backend (a device failure, a buffer that does not fit).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

pub type BResult<T> = Result<T, BackendError>;

/// Spread of the random keys and values of [`Backend::fill_sparse_cache_random`].
pub const RANDOM_KV_STD: f32 = 1.0;

/// Most rows of a span that [`Backend::lightning`] steps token by token: a token fed and up
/// to 16 drafts.
pub const STEPWISE_SPAN_ROWS: usize = 17;
/// Spread of the random lightning states of [`Backend::fill_lightning_state_random`].
pub const RANDOM_STATE_STD: f32 = 0.05;

/// Checks [`Backend::move_rows`]'s arguments for a buffer of `rows` rows.
pub fn check_move_rows(rows: usize, src_row: usize, dst_row: usize, n: usize) -> BResult<()> {
    if dst_row > src_row || src_row + n > rows {
        return Err(BackendError(format!(
            "move_rows: rows {src_row}..+{n} of {rows} to rows {dst_row}.. (moves go forward)"
        )));
    }
    Ok(())
}

/// The check every [`Backend::append_sparse_kv`] makes: k and v (`[rows, cols]`) as wide as
/// the cache's rows (`kv_width`), and the rows appended (in order) inside both.
pub fn check_append_kv(
    kv_width: usize,
    k: (usize, usize),
    v: (usize, usize),
    rows: &std::ops::Range<usize>,
) -> BResult<()> {
    if k.1 != kv_width || v.1 != kv_width || rows.start > rows.end || rows.end > k.0.min(v.0) {
        return Err(BackendError(format!(
            "appending rows {rows:?} of k [{}, {}] and v [{}, {}] to a cache of rows of \
             {kv_width}",
            k.0, k.1, v.0, v.1
        )));
    }
    Ok(())
}

/// The check every [`Backend::copy_rows`] makes: same widths, and both row ranges inside
/// their buffers (`[rows, cols]` of source and destination).
pub fn check_copy_rows(
    src: (usize, usize),
    src_row: usize,
    dst: (usize, usize),
    dst_row: usize,
    n: usize,
) -> BResult<()> {
    if src.1 != dst.1 || src_row + n > src.0 || dst_row + n > dst.0 {
        return Err(BackendError(format!(
            "copy_rows: rows {src_row}..+{n} of [{}, {}] to rows {dst_row}.. of [{}, {}]",
            src.0, src.1, dst.0, dst.1
        )));
    }
    Ok(())
}

/// Storage type of a host tensor handed to the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostDType {
    Bf16,
    F16,
    F32,
}

/// A weight as it lies on the host (e.g. memory-mapped from safetensors), little-endian.
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    pub dtype: HostDType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl HostTensor<'_> {
    /// The values widened to f32 (exact for all three dtypes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            HostDType::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            HostDType::Bf16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            HostDType::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
        }
    }
}

/// A `[rows, cols]` weight in 4 bits: `words[r][j]` holds inputs `8j..8j + 8` of row `r`, the
/// lowest nibble first; row `r`'s inputs in groups of `group`, each with a scale and a zero (a
/// whole number, 0 to 16): value = bf16((q − zero) · bf16(scale)) (the product is exact in f32,
/// so a backend computing it in bf16 pairs gets the same bits).
/// An FP8 weight `[rows = out, cols = in]`: E4M3 codes by rows and an f32 scale per row
/// (amax / 448 of the row). A product with it takes its input rows as E4M3 too, each at its
/// own scale ([`crate::numerics::fp8_quantize_row`]), and gives
/// `(Σ_i e4m3(x_i) · e4m3(w_oi)) · x_scale · w_scale_o` (sums in f32), rounded to bf16.
#[derive(Debug, Clone, Copy)]
pub struct Fp8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u8],
    pub scales: &'a [f32],
}

impl Fp8Matrix<'_> {
    /// Errors unless the sizes agree and no code is NaN.
    pub fn check(&self, name: &str) -> BResult<()> {
        let ok = self.codes.len() == self.rows * self.cols
            && self.scales.len() == self.rows
            && self.scales.iter().all(|s| s.is_finite() && *s > 0.0)
            && !self.codes.iter().any(|&c| c & 0x7f == 0x7f);
        if ok {
            return Ok(());
        }
        Err(BackendError(format!(
            "weight {name}: an FP8 [{}, {}] matrix with {} codes and {} scales (scales must be \
             positive and finite, codes not NaN)",
            self.rows,
            self.cols,
            self.codes.len(),
            self.scales.len()
        )))
    }
}

/// Quantizes `[rows, cols]` values to FP8 rows: the codes and scales of an [`Fp8Matrix`].
pub fn quantize_fp8(values: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; rows * cols];
    let scales = values
        .chunks(cols.max(1))
        .zip(codes.chunks_mut(cols.max(1)))
        .map(|(row, c)| crate::numerics::fp8_quantize_row(row, c))
        .collect();
    (codes, scales)
}

#[derive(Debug, Clone, Copy)]
pub struct QuantMatrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    /// `[rows, cols / 8]`.
    pub words: &'a [u32],
    /// `[rows, cols / group]` each.
    pub scales: &'a [f32],
    pub zeros: &'a [f32],
}

impl QuantMatrix<'_> {
    /// Errors unless the sizes agree.
    pub fn check(&self, name: &str) -> BResult<()> {
        let groups = self.cols.checked_div(self.group).unwrap_or(0);
        let fits = self.group > 0
            && self.cols.is_multiple_of(self.group)
            && self.cols.is_multiple_of(8)
            && self.words.len() == self.rows * self.cols / 8
            && self.scales.len() == self.rows * groups
            && self.zeros.len() == self.rows * groups
            // Zero points are whole 4-bit values (plus GPTQ's one).
            && self.zeros.iter().all(|z| z.fract() == 0.0 && (0.0..=16.0).contains(z));
        if fits {
            Ok(())
        } else {
            Err(BackendError(format!(
                "weight {name}: a 4-bit [{}, {}] matrix in groups of {} with {} words, {} scales, {} zeros",
                self.rows,
                self.cols,
                self.group,
                self.words.len(),
                self.scales.len(),
                self.zeros.len()
            )))
        }
    }

    /// Its values, row-major, each rounded to bf16 (as f32).
    pub fn values(&self) -> Vec<f32> {
        let groups = self.cols / self.group;
        let mut out = Vec::with_capacity(self.rows * self.cols);
        for r in 0..self.rows {
            for i in 0..self.cols {
                let word = self.words[r * self.cols / 8 + i / 8];
                let q = (word >> (4 * (i % 8))) & 15;
                let k = r * groups + i / self.group;
                out.push(crate::numerics::bf16_round(
                    sala_checkpoint::quant::w4_value(q, self.zeros[k], self.scales[k]),
                ));
            }
        }
        out
    }
}

pub trait Backend {
    /// Activations `[rows, cols]`, with capacity for the largest chunk.
    type Act;
    /// A linear weight `[out, in]` (also the embedding table `[vocab, hidden]`).
    type Matrix;
    /// A norm weight.
    type Vector;
    /// A lightning layer's fp32 state `[heads, d, d]` for one sequence.
    type LightningState;
    /// A sparse layer's cache for one sequence: K, V and the compressed key tiers.
    type SparseCache;
    /// A small constant f32 table (decay slopes, RoPE frequencies), uploaded once.
    type Table;

    fn name(&self) -> String;

    /// Prompt tokens a prefill chunk reads when the user asks for no size: what this backend
    /// reads long prompts best in, within a few hundred MiB of workspace.
    fn default_prefill_chunk(&self) -> usize {
        256
    }

    /// What this backend holds for a model of `config` whose step workspace has `rows` rows:
    /// its value width, cache pages, scratch and runtime ([`crate::memory::MemoryPlan`] sums
    /// them with the model's buffers).
    fn memory_facts(&self, config: &ModelConfig, rows: usize) -> BackendMemory;

    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Matrix>;
    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Vector>;
    fn upload_table(&self, data: &[f32]) -> BResult<Self::Table>;
    /// A `[rows, cols]` matrix of seeded normal values `mean + std·z` rounded to bf16, with
    /// `|z|` kept away from 0 so that no weight is zero (benchmarks without a checkpoint).
    /// `name` is the weight's (tensor parallelism takes its part of it by name).
    fn random_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Self::Matrix>;
    fn random_vector(
        &self,
        name: &str,
        len: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Self::Vector>;
    /// A `[rows, cols]` 4-bit matrix in groups of `group` with seeded random values of about
    /// `std` (uniform 4-bit values around a zero of 8; benchmarks of 4-bit weights).
    fn random_quantized(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        group: usize,
        seed: u64,
        std: f32,
    ) -> BResult<Self::Matrix> {
        let mut state = seed ^ 0x5851_f42d_4c95_7f2d;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let words: Vec<u32> = (0..rows * cols / 8).map(|_| next() as u32).collect();
        let groups = rows * cols.checked_div(group).unwrap_or(0);
        // Values q − 8 for q uniform in 0..16 have a standard deviation of about 4.6.
        let scales = vec![std / 4.6; groups];
        let zeros = vec![8.0; groups];
        self.upload_quantized(
            name,
            QuantMatrix {
                rows,
                cols,
                group,
                words: &words,
                scales: &scales,
                zeros: &zeros,
            },
        )
    }
    /// A 4-bit weight ([`QuantMatrix`]): by default its bf16 values ([`QuantMatrix::values`])
    /// uploaded as any matrix; a backend with 4-bit products keeps it packed. Every product
    /// with it gives what one with those values gives, up to the order of the sums.
    fn upload_quantized(&self, name: &str, q: QuantMatrix<'_>) -> BResult<Self::Matrix> {
        q.check(name)?;
        let bytes: Vec<u8> = q
            .values()
            .into_iter()
            .flat_map(|v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        self.upload_matrix(
            name,
            HostTensor {
                dtype: HostDType::Bf16,
                shape: &[q.rows, q.cols],
                bytes: &bytes,
            },
        )
    }

    /// An FP8 weight ([`Fp8Matrix`]), for backends with FP8 products (`--quantize fp8`).
    fn upload_fp8(&self, name: &str, _m: Fp8Matrix<'_>) -> BResult<Self::Matrix> {
        Err(BackendError(format!(
            "weight {name}: the {} backend has no FP8 weights",
            self.name()
        )))
    }
    /// A `[rows, cols]` FP8 matrix of seeded random codes of about `std` (benchmarks).
    fn random_fp8(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        seed: u64,
        std: f32,
    ) -> BResult<Self::Matrix> {
        let mut state = seed ^ 0x2545_f491_4f6c_dd1d;
        let mut codes = Vec::with_capacity(rows * cols + 8);
        while codes.len() < rows * cols {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Sign, exponent 0..7 and mantissa: never NaN, values up to 1.875 (spread ~0.45).
            codes.extend(state.to_le_bytes().map(|b| b & 0xbf));
        }
        codes.truncate(rows * cols);
        let scales = vec![std / 0.45; rows];
        self.upload_fp8(
            name,
            Fp8Matrix {
                rows,
                cols,
                codes: &codes,
                scales: &scales,
            },
        )
    }

    /// A buffer with room for `max_rows` rows of `cols`; its row count starts at `max_rows`.
    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<Self::Act>;
    /// [`Backend::alloc`] for the workspace buffer `buffer` (a name of
    /// [`crate::memory::workspace_columns`]) whose columns tensor parallelism splits among its
    /// ranks (heads, the MLP's width); a backend of one device holds them all.
    fn alloc_split(&self, _buffer: &str, max_rows: usize, cols: usize) -> BResult<Self::Act> {
        self.alloc(max_rows, cols)
    }
    /// Makes `a` hold rows of `cols` values within its allocation (its row capacity follows;
    /// its rows are kept where they fit, their values are not): tensor parallelism, whose
    /// ranks' parts of one buffer are as wide as the layer they serve.
    fn set_width(&self, _a: &mut Self::Act, _cols: usize) -> BResult<()> {
        Err(BackendError(format!(
            "{}: activations cannot change width",
            self.name()
        )))
    }
    /// Sets the row count of `a` (at most its capacity) before an op writes it.
    fn set_rows(&self, a: &mut Self::Act, rows: usize);
    /// Copies rows `src_row..src_row + n` of `src` over rows `dst_row..` of `dst` (same
    /// width; `dst`'s row count is unchanged).
    fn copy_rows(
        &self,
        src: &Self::Act,
        src_row: usize,
        dst: &mut Self::Act,
        dst_row: usize,
        n: usize,
    ) -> BResult<()>;
    /// Moves rows `src_row..src_row + n` of `a` to rows `dst_row..` (`dst_row <= src_row`;
    /// the two ranges may overlap): a step's rows packed to the front.
    fn move_rows(&self, a: &mut Self::Act, src_row: usize, dst_row: usize, n: usize)
        -> BResult<()>;

    fn new_lightning_state(&self, heads: usize, head_dim: usize) -> BResult<Self::LightningState>;
    fn new_sparse_cache(&self, shape: AttnShape, cfg: &SparseConfig) -> BResult<Self::SparseCache>;
    /// Makes room in `cache` for `tokens` tokens in all (K, V and the compressed tiers), so that
    /// a sequence of known length allocates once, up front. Growing past it still works.
    fn reserve_sparse_cache(
        &self,
        _cache: &mut Self::SparseCache,
        _cfg: &SparseConfig,
        _tokens: usize,
    ) -> BResult<()> {
        Ok(())
    }

    /// Benchmarks: makes `cache` (empty) hold `tokens` tokens of seeded random keys and values
    /// (normal, std [`RANDOM_KV_STD`], as `random_vector` draws them) with their compressed
    /// tiers, as if a prompt that long had been prefilled.
    fn fill_sparse_cache_random(
        &self,
        _cache: &mut Self::SparseCache,
        _cfg: &SparseConfig,
        _tokens: usize,
        _seed: u64,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: random caches are not supported",
            self.name()
        )))
    }
    /// Benchmarks: fills a lightning state with seeded random values (std [`RANDOM_STATE_STD`]).
    fn fill_lightning_state_random(
        &self,
        _state: &mut Self::LightningState,
        _seed: u64,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: random states are not supported",
            self.name()
        )))
    }

    /// Makes `dst` (a fresh lightning state of the same shape) hold what `src` holds: the
    /// state of another sequence that read the same tokens (`n` choices of one prompt).
    fn copy_lightning_state(
        &self,
        _src: &Self::LightningState,
        _dst: &mut Self::LightningState,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: copying a sequence's state is not supported",
            self.name()
        )))
    }
    /// Makes `dst` (an empty cache of the same shape, perhaps reserved) hold what `src` holds:
    /// K, V and the compressed tiers. Its reservation is kept.
    fn copy_sparse_cache(
        &self,
        _src: &Self::SparseCache,
        _dst: &mut Self::SparseCache,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: copying a sequence's state is not supported",
            self.name()
        )))
    }

    /// Drops the tokens of `cache` from `len` on: K, V and the compressed windows they
    /// completed, so that it holds what it held after its first `len` tokens (speculative
    /// tokens that were rejected). Its reservation is kept.
    fn truncate_sparse_cache(
        &self,
        _cache: &mut Self::SparseCache,
        _cfg: &SparseConfig,
        _len: usize,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: rewinding a sequence is not supported",
            self.name()
        )))
    }

    /// Whether [`Backend::share_sparse_cache`] shares memory (rather than copying): a fork's
    /// source then takes no memory of its own beside the fork.
    fn shares_cache_prefixes(&self) -> bool {
        false
    }

    /// Makes `dst` (an empty cache of the same shape) hold `src`'s first `len` tokens, as
    /// `src` truncated to `len` would, without changing `src`: a prefix-cache hit. A backend
    /// may share `src`'s memory below `len` instead of copying it; then neither cache writes
    /// there again (both only append past their lengths). By default a copy, truncated.
    fn share_sparse_cache(
        &self,
        src: &Self::SparseCache,
        dst: &mut Self::SparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        self.copy_sparse_cache(src, dst)?;
        self.truncate_sparse_cache(dst, cfg, len)
    }

    /// A forward pass begins: its tokens, its spans (one per sequence, in row order) and the
    /// sequences' ids. A backend may choose how to launch the step's work from them (and, for
    /// a step it has seen before, replay it).
    fn begin_step(&self, _step: &StepInfo<'_>) -> BResult<()> {
        Ok(())
    }

    /// The forward pass begun by [`Backend::begin_step`] has ended, well (`ok`) or with an
    /// error.
    fn end_step(&self, _ok: bool) -> BResult<()> {
        Ok(())
    }

    /// For a backend that replays captured steps (CUDA graphs; no-ops elsewhere): closes the
    /// stretch under way (its graph launched) and keeps the next one from opening until
    /// [`Backend::release_graphs`]. Ranks driving several devices from one thread hold every
    /// device's graphs before any device's eager or host-blocking work: a graph holding one
    /// rank's half of a collective waits on the other ranks' graphs, which must be launched
    /// before the host waits for anything.
    fn hold_graphs(&self) -> BResult<()> {
        Ok(())
    }

    /// Ends [`Backend::hold_graphs`]: the next stretch opens.
    fn release_graphs(&self) -> BResult<()> {
        Ok(())
    }

    /// Whether a step may take its tokens from the picks of the step before and leave its own
    /// picks for later ([`StepInfo::tokens_picked`], [`StepInfo::picks_later`]): the next
    /// decode step queued before this one's tokens reach the host.
    fn runs_ahead(&self) -> bool {
        false
    }

    /// The greedy picks of the oldest step that left them for later (waiting for them).
    fn take_picks(&self) -> BResult<Vec<crate::GreedyPick>> {
        Err(BackendError(format!(
            "{}: no step left its picks for later",
            self.name()
        )))
    }

    /// How the step begun last makes its launches.
    fn step_launches(&self) -> StepLaunches {
        StepLaunches::Eager
    }

    /// Forgets every captured step (devices that disagree on a step start again together).
    fn forget_graphs(&self) {}

    /// `out[i] = round(table[ids[i]] * scale)`.
    fn embed(
        &self,
        table: &Self::Matrix,
        ids: &[u32],
        scale: f32,
        out: &mut Self::Act,
    ) -> BResult<()>;
    /// RMSNorm of every row (SPEC §3): `round(round(x·rsqrt(mean(x²)+eps)) · w)`.
    fn rms_norm(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) -> BResult<()>;
    /// `out = round(x Wᵀ)`, fp32 accumulation.
    fn matmul(&self, x: &Self::Act, w: &Self::Matrix, out: &mut Self::Act) -> BResult<()>;
    /// Stacks the rows of matrices with the same input width into one, so that one product
    /// computes all of them ([`Backend::matmul_split`]).
    fn concat_rows(&self, parts: Vec<Self::Matrix>) -> BResult<Self::Matrix>;
    /// `x Wᵀ` for a stacked matrix, its columns split into `outs` in order (their widths
    /// must add up to the matrix's rows).
    fn matmul_split(
        &self,
        x: &Self::Act,
        w: &Self::Matrix,
        outs: &mut [&mut Self::Act],
    ) -> BResult<()>;
    /// `gate = round(round(silu(gate)) · up)`.
    fn silu_mul(&self, gate: &mut Self::Act, up: &Self::Act) -> BResult<()>;
    /// The same for `gu = [gate | up]` (`[rows, 2·I]`), into `out` (`[rows, I]`).
    fn silu_mul_halves(&self, gu: &Self::Act, out: &mut Self::Act) -> BResult<()>;
    /// The MLP's first half: `gu = x Wᵀ` for the stacked `W = [gate; up]`, then
    /// `out = silu_mul_halves(gu)`; `gu` is scratch (one pass where the backend fuses them).
    fn matmul_silu(
        &self,
        x: &Self::Act,
        w: &Self::Matrix,
        gu: &mut Self::Act,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.matmul(x, w, gu)?;
        self.silu_mul_halves(gu, out)
    }
    /// `h = round(h + round(branch · scale))`.
    fn add_scaled(&self, h: &mut Self::Act, branch: &Self::Act, scale: f32) -> BResult<()>;
    /// `h = round(h + round(branch · scale))`, then `out = rms_norm(h, w)`: the residual add
    /// and the norm after it (one pass where the backend fuses them).
    fn add_scaled_norm(
        &self,
        h: &mut Self::Act,
        branch: &Self::Act,
        scale: f32,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.add_scaled(h, branch, scale)?;
        self.rms_norm(h, w, eps, out)
    }
    /// [`Backend::add_scaled_norm`] into `a`, then [`Backend::matmul_silu`] of `a`: the
    /// residual add and norm before the MLP with its first half (one pass where the backend
    /// fuses them; `a` holds the norm's output either way).
    #[allow(clippy::too_many_arguments)]
    fn add_scaled_norm_matmul_silu(
        &self,
        h: &mut Self::Act,
        branch: &Self::Act,
        scale: f32,
        norm: &Self::Vector,
        eps: f32,
        a: &mut Self::Act,
        w: &Self::Matrix,
        gu: &mut Self::Act,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.add_scaled_norm(h, branch, scale, norm, eps, a)?;
        self.matmul_silu(a, w, gu, out)
    }
    /// `x = round(x · round(sigmoid(gate)))`.
    fn sigmoid_gate(&self, x: &mut Self::Act, gate: &Self::Act) -> BResult<()>;
    /// `out = rms_norm(x, w)`, then, with a gate, `out = round(out · round(sigmoid(gate)))`.
    fn rms_norm_gate(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        gate: Option<&Self::Act>,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.rms_norm(x, w, eps, out)?;
        match gate {
            Some(g) => self.sigmoid_gate(out, g),
            None => Ok(()),
        }
    }
    /// Tensor parallelism: each row's sum of squares of `x` (f32, not rounded) into the first
    /// entries of `sums`, a table of at least `x`'s rows.
    fn row_sums_of_squares(&self, _x: &Self::Act, _sums: &mut Self::Table) -> BResult<()> {
        Err(BackendError(format!(
            "{}: no tensor parallelism (row sums of squares)",
            self.name()
        )))
    }
    /// Tensor parallelism: [`Backend::rms_norm_gate`] of rows whose columns are split among
    /// ranks, each row's mean square given as `sums[r] / width` (the sums over every rank's
    /// columns, `width` the whole row's).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gate_with_sums(
        &self,
        _x: &Self::Act,
        _sums: &Self::Table,
        _width: usize,
        _w: &Self::Vector,
        _eps: f32,
        _gate: Option<&Self::Act>,
        _out: &mut Self::Act,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: no tensor parallelism (a norm of split rows)",
            self.name()
        )))
    }
    /// RoPE (rotate-half, SPEC §7) of every head (of `head_dim` features) of `q` and `k`, in
    /// place: span `i`'s rows at positions `pos..`, each value rounded to bf16 (as the
    /// lightning layers rotate theirs). For layers that rotate outside an attention entry (an
    /// EAGLE-3 draft's).
    fn rope(
        &self,
        head_dim: usize,
        inv_freq: &Self::Table,
        spans: &[Span],
        q: &mut Self::Act,
        k: &mut Self::Act,
    ) -> BResult<()>;
    /// Lightning attention (Simple GLA, SPEC §4.2) of a step's sequences: span `i` is the
    /// rows of sequence `i`, advanced from `states[i]`. Per head of q and k, the optional
    /// RMSNorm (`norms`: q weight, k weight, eps) then the optional RoPE at each row's
    /// position; `out` gets `o` rounded to bf16. Each span's result does not depend on the
    /// others, and a span of at most [`STEPWISE_SPAN_ROWS`] rows gives every row and the
    /// state the bits of decoding its rows one at a time (so a verified draft is the token
    /// plain decoding would give, and a replay of accepted rows the state it would leave).
    #[allow(clippy::too_many_arguments)]
    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        norms: Option<(&Self::Vector, &Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        io: AttnIo<'_, Self::Act>,
        spans: &[Span],
        states: &mut [&mut Self::LightningState],
    ) -> BResult<()>;
    /// Sparse attention (SPEC §5) of a step's sequences: span `i` appends its rows' K and V to
    /// `caches[i]`, then attends its queries (positions continue the cache) with `modes[i]`;
    /// `out` gets the result rounded to bf16. Each span's result does not depend on the
    /// others.
    #[allow(clippy::too_many_arguments)]
    /// Advances `state` over the first `rows` rows of `k` and `v` (`kv`: k, v, rows; as the
    /// lightning layer's projections made them, so normed with `k_norm` and rotated at
    /// positions `pos..` here) as [`Backend::lightning`] stepping those rows would, bit for
    /// bit, without outputs: the replay of kept speculative tokens ([`crate::Model::rewind_to`]).
    #[allow(clippy::too_many_arguments)]
    fn lightning_replay(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        k_norm: Option<(&Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        kv: (&Self::Act, &Self::Act, usize),
        pos: usize,
        state: &mut Self::LightningState,
    ) -> BResult<()>;
    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        io: AttnIo<'_, Self::Act>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut Self::SparseCache],
    ) -> BResult<()>;
    /// Context parallelism, the lightning scan: `state = γ^tokens · prev + state` per head
    /// (γ = exp(−slope); SPEC §4.2): `state`, a range's end state computed from zero, made the
    /// end state of the range read after `prev` (`tokens` tokens long).
    fn lightning_state_advance(
        &self,
        _slopes: &Self::Table,
        _head_dim: usize,
        _tokens: usize,
        _prev: &Self::LightningState,
        _state: &mut Self::LightningState,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: no context parallelism (lightning scan)",
            self.name()
        )))
    }
    /// Context parallelism: adds to `out` (a lightning span's outputs computed from a zero
    /// state, one row per row of `q`) the term of its true start state `S`:
    /// `out_t += scale·γ^{t+1} q̂_t S` per head, rounded to bf16 as the outputs are. `q` is the
    /// span's queries as the layer's projection made them (rows at positions `pos..`); q̂,
    /// them normed with `q_norm` and rotated as [`Backend::lightning`] does, is left in `q`.
    /// (Whether `lightning` leaves its q normed and rotated is the backend's affair.)
    #[allow(clippy::too_many_arguments)]
    fn lightning_state_term(
        &self,
        _shape: AttnShape,
        _slopes: &Self::Table,
        _q_norm: Option<(&Self::Vector, f32)>,
        _inv_freq: Option<&Self::Table>,
        _state: &Self::LightningState,
        (_q, _pos): (&mut Self::Act, usize),
        _out: &mut Self::Act,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: no context parallelism (lightning start states)",
            self.name()
        )))
    }
    /// Appends rows `rows` of `k` and `v` to `cache`, with the compressed windows they
    /// complete, attending nothing: another rank's tokens before this rank's (context
    /// parallelism), or the rows of a step whose last-layer outputs nothing reads.
    fn append_sparse_kv(
        &self,
        _cache: &mut Self::SparseCache,
        _cfg: &SparseConfig,
        _k: &Self::Act,
        _v: &Self::Act,
        _rows: std::ops::Range<usize>,
    ) -> BResult<()> {
        Err(BackendError(format!(
            "{}: no context parallelism (a cache's earlier tokens)",
            self.name()
        )))
    }
    /// Logits of the rows `rows` of `h` (final-normed hidden states), in that order:
    /// `round(h / divisor)` times `lm_head`ᵀ, rounded to bf16 as the reference's bf16
    /// output. Returns as f32 `[k, vocab]` the rows whose `keep` is set (in order), and every
    /// row's greedy pick ([`GreedyPick::of`] of its logits).
    fn logits(
        &self,
        h: &Self::Act,
        rows: &[usize],
        keep: &[bool],
        lm_head: &Self::Matrix,
        divisor: f32,
    ) -> BResult<LogitsOut>;
    /// Copies an activation buffer to the host (tests and debugging).
    fn to_host(&self, a: &Self::Act) -> BResult<Vec<f32>>;
}

/// What [`Backend::logits`] gives back: the kept rows' logits and every row's greedy pick.
#[derive(Debug, Clone, Default)]
pub struct LogitsOut {
    pub rows: Vec<f32>,
    pub picks: Vec<GreedyPick>,
}

/// The activations an attention entry reads and writes: q `[rows, heads·d]`, k and v
/// `[rows, kv_heads·d]` (q and k are normed and rotated in place), and `out`
/// `[rows, heads·d]`.
pub struct AttnIo<'a, A> {
    pub q: &'a mut A,
    pub k: &'a mut A,
    pub v: &'a mut A,
    pub out: &'a mut A,
}

/// How a step's launches are made ([`Backend::step_launches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepLaunches {
    /// As the ops ask.
    Eager,
    /// Captured into graphs, which are then launched.
    Capture,
    /// Skipped: graphs recorded from an earlier step are launched instead.
    Replay,
}

/// What [`Backend::begin_step`] is told of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo<'a> {
    pub tokens: &'a [u32],
    pub spans: &'a [Span],
    /// Each span's sequence ([`crate::SeqState`]'s id).
    pub seq_ids: &'a [u64],
    /// Which of each span's rows get logits, and in what form (a step's launches depend on it).
    pub logits: &'a [crate::LogitRows],
    /// Rows whose hidden states are kept for a draft: (input, step row, buffer row, rows).
    pub aux_rows: &'a [[usize; 4]],
    /// Whether the step's launches are made as they come, never captured into a graph: a
    /// step whose work differs from another's of the same spans (context parallelism's
    /// passes over a chunk, one a layer).
    pub eager: bool,
    /// The step's token ids are the greedy picks of the step before, row for row, left on the
    /// device (`tokens` holds placeholders): a step run ahead ([`Backend::runs_ahead`]).
    pub tokens_picked: bool,
    /// The step's greedy picks are read by [`Backend::take_picks`], not by
    /// [`Backend::logits`] (which then gives none), so that the next step can be queued first.
    pub picks_later: bool,
}

/// One sequence's rows in a step: rows `first_row..first_row + len` of the step's
/// activations are its tokens at positions `pos..pos + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub first_row: usize,
    pub len: usize,
    pub pos: usize,
}

impl Span {
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.first_row..self.first_row + self.len
    }
}

/// Checks a [`Backend::rope`] call on q `[rows, cols]` and k `[rows, cols]`: the spans lie
/// within q's rows, k has as many, and both hold whole heads of `head_dim`.
pub fn check_rope(
    head_dim: usize,
    spans: &[Span],
    q: (usize, usize),
    k: (usize, usize),
) -> BResult<()> {
    check_spans(spans, q.0, spans.len())?;
    let whole = |cols: usize| head_dim > 0 && cols.is_multiple_of(head_dim);
    if k.0 != q.0 || !whole(q.1) || !whole(k.1) {
        return Err(BackendError(format!(
            "rope: q [{}, {}] and k [{}, {}] in heads of {head_dim}",
            q.0, q.1, k.0, k.1
        )));
    }
    Ok(())
}

/// How a backend runs a step's spans: runs of single-row spans on adjacent rows (decode rows,
/// one launch for all where the backend batches them), and longer spans one by one (prompt
/// chunks, verification spans).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpanRun {
    /// Spans `spans` (indices), one row each, on rows `first_row..first_row + spans.len()`.
    Rows {
        spans: std::ops::Range<usize>,
        first_row: usize,
    },
    /// Span `i`, of several rows.
    Chunk(usize),
}

/// Checks a step's spans against its activations (`rows` rows) and the number of states
/// given (`states`): every span non-empty, inside the rows, and no two overlapping.
pub fn check_spans(spans: &[Span], rows: usize, states: usize) -> BResult<()> {
    if spans.len() != states {
        return Err(BackendError(format!(
            "{} spans for {states} sequence states",
            spans.len()
        )));
    }
    let mut sorted: Vec<&Span> = spans.iter().collect();
    sorted.sort_by_key(|s| s.first_row);
    let mut end = 0;
    for s in sorted {
        if s.len == 0 || s.first_row < end || s.first_row + s.len > rows {
            return Err(BackendError(format!(
                "span rows {:?} overlap another or leave the step's {rows} rows",
                s.rows()
            )));
        }
        end = s.first_row + s.len;
    }
    Ok(())
}

/// The runs of `spans` (see [`SpanRun`]), in span order.
pub fn span_runs(spans: &[Span]) -> Vec<SpanRun> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < spans.len() {
        if spans[i].len != 1 {
            runs.push(SpanRun::Chunk(i));
            i += 1;
            continue;
        }
        let start = i;
        while i + 1 < spans.len()
            && spans[i + 1].len == 1
            && spans[i + 1].first_row == spans[i].first_row + 1
        {
            i += 1;
        }
        i += 1;
        runs.push(SpanRun::Rows {
            spans: start..i,
            first_row: spans[start].first_row,
        });
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first_row: usize, len: usize) -> Span {
        Span {
            first_row,
            len,
            pos: 0,
        }
    }

    #[test]
    fn runs_group_adjacent_single_rows() {
        let spans = [span(0, 1), span(1, 1), span(2, 5), span(7, 1), span(9, 1)];
        assert_eq!(
            span_runs(&spans),
            vec![
                SpanRun::Rows {
                    spans: 0..2,
                    first_row: 0
                },
                SpanRun::Chunk(2),
                SpanRun::Rows {
                    spans: 3..4,
                    first_row: 7
                },
                SpanRun::Rows {
                    spans: 4..5,
                    first_row: 9
                },
            ]
        );
        assert!(check_spans(&spans, 10, 5).is_ok());
    }

    #[test]
    fn bad_spans_are_refused() {
        assert!(
            check_spans(&[span(0, 2), span(1, 1)], 4, 2).is_err(),
            "overlap"
        );
        assert!(check_spans(&[span(3, 2)], 4, 1).is_err(), "past the rows");
        assert!(check_spans(&[span(0, 0)], 4, 1).is_err(), "empty");
        assert!(check_spans(&[span(0, 1)], 4, 2).is_err(), "state count");
    }
}
