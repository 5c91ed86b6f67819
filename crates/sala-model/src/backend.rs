//! The narrow, model-specific interface the forward pass is written against. The CPU backend
//! implements it now; a GPU backend implements the same ops on device buffers.
//!
//! Conventions: activations are row-major `[rows, cols]`, one row per token of the current
//! chunk. Every op stores its result rounded to bf16, as the reference's bf16 tensors are,
//! except where a method says otherwise. Linear weights are `[out, in]`, `y = x Wᵀ`.

use crate::oracle::{AttnShape, SparseMode};
use sala_checkpoint::SparseConfig;

/// An error from a backend (a device failure, a buffer that does not fit).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

pub type BResult<T> = Result<T, BackendError>;

/// Spread of the random keys and values of [`Backend::fill_sparse_cache_random`].
pub const RANDOM_KV_STD: f32 = 1.0;
/// Spread of the random lightning states of [`Backend::fill_lightning_state_random`].
pub const RANDOM_STATE_STD: f32 = 0.05;

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

    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Matrix>;
    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Vector>;
    fn upload_table(&self, data: &[f32]) -> BResult<Self::Table>;
    /// A `[rows, cols]` matrix of seeded normal values `mean + std·z` rounded to bf16, with
    /// `|z|` kept away from 0 so that no weight is zero (benchmarks without a checkpoint).
    fn random_matrix(
        &self,
        rows: usize,
        cols: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Self::Matrix>;
    fn random_vector(&self, len: usize, seed: u64, mean: f32, std: f32) -> BResult<Self::Vector>;

    /// A buffer with room for `max_rows` rows of `cols`; its row count starts at `max_rows`.
    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<Self::Act>;
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
    /// `x = round(x · round(sigmoid(gate)))`.
    fn sigmoid_gate(&self, x: &mut Self::Act, gate: &Self::Act) -> BResult<()>;
    /// Per head of `head_dim` features: optional RMSNorm with the shared weight `norm`, then
    /// optional RoPE (rotate-half, positions `first_pos..`, inverse frequencies `inv_freq`).
    fn head_norm_rope(
        &self,
        x: &mut Self::Act,
        head_dim: usize,
        norm: Option<(&Self::Vector, f32)>,
        rope: Option<(&Self::Table, usize)>,
    ) -> BResult<()>;
    /// [`Backend::head_norm_rope`] on the queries and the keys of one layer (one launch where
    /// the backend fuses them).
    fn head_norm_rope_qk(
        &self,
        q: &mut Self::Act,
        k: &mut Self::Act,
        head_dim: usize,
        norms: Option<(&Self::Vector, &Self::Vector, f32)>,
        rope: Option<(&Self::Table, usize)>,
    ) -> BResult<()> {
        self.head_norm_rope(q, head_dim, norms.map(|(w, _, e)| (w, e)), rope)?;
        self.head_norm_rope(k, head_dim, norms.map(|(_, w, e)| (w, e)), rope)
    }
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
    /// Lightning attention (Simple GLA, SPEC §4.2) of the chunk from `state`, which it
    /// advances past the chunk; `out` gets `o` rounded to bf16.
    #[allow(clippy::too_many_arguments)]
    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        state: &mut Self::LightningState,
        out: &mut Self::Act,
    ) -> BResult<()>;
    /// One decode step of a lightning layer for several sequences: row `r` of `q`, `k`, `v` is
    /// the token at `positions[r]` of the sequence whose state is `states[r]`. Per row, as
    /// [`Backend::head_norm_rope_qk`] (RoPE at the row's position when `inv_freq` is given)
    /// then [`Backend::lightning`] of one token; row by row here, one launch each where the
    /// backend batches them.
    #[allow(clippy::too_many_arguments)]
    fn lightning_rows(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        q: &mut Self::Act,
        k: &mut Self::Act,
        v: &Self::Act,
        norms: Option<(&Self::Vector, &Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        positions: &[usize],
        states: &mut [&mut Self::LightningState],
        out: &mut Self::Act,
    ) -> BResult<()> {
        lightning_row_by_row(
            self, shape, slopes, q, k, v, norms, inv_freq, positions, states, out,
        )
    }
    /// One decode step of a sparse layer for several sequences: row `r` of `q`, `k`, `v` is the
    /// next token of the sequence whose cache is `caches[r]`, attended with `modes[r]`; as
    /// [`Backend::sparse_attention`] of one row each (row by row here; in a few launches for
    /// all rows where the backend batches them, with each row's result unchanged).
    #[allow(clippy::too_many_arguments)]
    fn sparse_rows(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        modes: &[SparseMode],
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        caches: &mut [&mut Self::SparseCache],
        out: &mut Self::Act,
    ) -> BResult<()> {
        sparse_row_by_row(self, shape, cfg, modes, q, k, v, caches, out)
    }
    /// Appends the chunk's K and V to `cache`, then attends the chunk's queries (positions
    /// continue the cache) with `mode` (SPEC §5); `out` gets the result rounded to bf16.
    #[allow(clippy::too_many_arguments)]
    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        cache: &mut Self::SparseCache,
        out: &mut Self::Act,
    ) -> BResult<()>;
    /// Logits of the rows `rows` of `h` (final-normed hidden states): `round(h / divisor)`
    /// times `lm_head`ᵀ, rounded to bf16 as the reference's bf16 output, returned as f32
    /// `[rows.len(), vocab]`.
    fn logits(
        &self,
        h: &Self::Act,
        rows: std::ops::Range<usize>,
        lm_head: &Self::Matrix,
        divisor: f32,
    ) -> BResult<Vec<f32>>;
    /// Copies an activation buffer to the host (tests and debugging).
    fn to_host(&self, a: &Self::Act) -> BResult<Vec<f32>>;
}

/// Runs `attend(r, q, k, v, out)` for each of `rows` rows through one-row copies of row `r`
/// of `q`, `k`, `v`, writing its `out` back to row `r` of `out`.
fn each_row<B: Backend + ?Sized>(
    be: &B,
    shape: AttnShape,
    rows: usize,
    (q, k, v): (&B::Act, &B::Act, &B::Act),
    out: &mut B::Act,
    mut attend: impl FnMut(usize, &mut B::Act, &mut B::Act, &B::Act, &mut B::Act) -> BResult<()>,
) -> BResult<()> {
    let d = shape.head_dim;
    let mut rq = be.alloc(1, shape.heads * d)?;
    let mut rk = be.alloc(1, shape.kv_heads * d)?;
    let mut rv = be.alloc(1, shape.kv_heads * d)?;
    let mut ro = be.alloc(1, shape.heads * d)?;
    for r in 0..rows {
        be.copy_rows(q, r, &mut rq, 0, 1)?;
        be.copy_rows(k, r, &mut rk, 0, 1)?;
        be.copy_rows(v, r, &mut rv, 0, 1)?;
        attend(r, &mut rq, &mut rk, &rv, &mut ro)?;
        be.copy_rows(&ro, 0, out, r, 1)?;
    }
    Ok(())
}

/// [`Backend::lightning_rows`] one row at a time, through one-row buffers.
#[allow(clippy::too_many_arguments)]
pub fn lightning_row_by_row<B: Backend + ?Sized>(
    be: &B,
    shape: AttnShape,
    slopes: &B::Table,
    q: &B::Act,
    k: &B::Act,
    v: &B::Act,
    norms: Option<(&B::Vector, &B::Vector, f32)>,
    inv_freq: Option<&B::Table>,
    positions: &[usize],
    states: &mut [&mut B::LightningState],
    out: &mut B::Act,
) -> BResult<()> {
    if positions.len() != states.len() {
        return Err(BackendError(format!(
            "lightning_rows: {} positions for {} states",
            positions.len(),
            states.len()
        )));
    }
    let d = shape.head_dim;
    each_row(
        be,
        shape,
        states.len(),
        (q, k, v),
        out,
        |r, rq, rk, rv, ro| {
            let rope = inv_freq.map(|f| (f, positions[r]));
            be.head_norm_rope_qk(rq, rk, d, norms, rope)?;
            be.lightning(shape, slopes, rq, rk, rv, states[r], ro)
        },
    )
}

/// [`Backend::sparse_rows`] one row at a time, through one-row buffers.
#[allow(clippy::too_many_arguments)]
pub fn sparse_row_by_row<B: Backend + ?Sized>(
    be: &B,
    shape: AttnShape,
    cfg: &SparseConfig,
    modes: &[SparseMode],
    q: &B::Act,
    k: &B::Act,
    v: &B::Act,
    caches: &mut [&mut B::SparseCache],
    out: &mut B::Act,
) -> BResult<()> {
    if modes.len() != caches.len() {
        return Err(BackendError(format!(
            "sparse_rows: {} modes for {} caches",
            modes.len(),
            caches.len()
        )));
    }
    each_row(
        be,
        shape,
        caches.len(),
        (q, k, v),
        out,
        |r, rq, rk, rv, ro| be.sparse_attention(shape, cfg, modes[r], rq, rk, rv, caches[r], ro),
    )
}
