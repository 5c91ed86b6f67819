//! CPU backend: f32 arithmetic on bf16-rounded values (rounded where the reference stores a
//! bf16 tensor), rayon for threads, `gemm` for matrix products. Weights are widened to f32 once
//! at load, which is exact for bf16/f16 checkpoints.

pub mod attention;
pub mod reference;

use attention::SparseCache;
use rayon::prelude::*;
use sala_checkpoint::{ModelConfig, SparseConfig};
use sala_model::backend::{
    check_rope, check_spans, RANDOM_KV_STD, RANDOM_STATE_STD, STEPWISE_SPAN_ROWS,
};
use sala_model::memory::{BackendMemory, F32};
use sala_model::numerics::{bf16_round, e4m3_value, fp8_quantize_row, random_normal};
use sala_model::{
    AttnIo, AttnShape, BResult, Backend, BackendError, Fp8Matrix, GreedyPick, HostTensor,
    LogitsOut, Span, SparseMode, StepInfo,
};
use std::sync::Mutex;

/// Activations `[rows, cols]` with room for `cap_rows` rows.
#[derive(Debug, Clone)]
pub struct CpuAct {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
    cap_rows: usize,
}

impl CpuAct {
    pub fn from_rows(data: Vec<f32>, cols: usize) -> Self {
        let rows = data.len() / cols;
        Self {
            data,
            rows,
            cols,
            cap_rows: rows,
        }
    }
}

/// A weight matrix `[rows = out, cols = in]`.
#[derive(Debug, Clone)]
pub struct CpuMatrix {
    /// The values; for an FP8 matrix, its E4M3 codes' values (unscaled).
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
    /// An FP8 matrix's scale per row ([`sala_model::Fp8Matrix`]): products with it take their
    /// inputs as E4M3 rows too.
    pub fp8_scales: Option<Vec<f32>>,
}

/// The CPU backend: plain Rust over f32, every thread of rayon's pool.
pub struct CpuBackend {
    /// Whether it runs steps ahead ([`Backend::runs_ahead`]).
    run_ahead: bool,
    ahead: Mutex<StepsAhead>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self {
            run_ahead: true,
            ahead: Mutex::default(),
        }
    }
}

/// What steps run ahead leave: the flags of the step under way, the last picks (the next
/// step's tokens when it takes them) and the picks left for later, oldest first.
#[derive(Default)]
struct StepsAhead {
    tokens_picked: bool,
    picks_later: bool,
    last: Vec<u32>,
    later: std::collections::VecDeque<Vec<GreedyPick>>,
    /// Steps that took their tokens from the picks before.
    steps_picked: usize,
}

impl CpuBackend {
    /// A backend that runs no step ahead (every step's tokens come from the host).
    pub fn without_run_ahead() -> Self {
        Self {
            run_ahead: false,
            ..Self::default()
        }
    }

    /// Steps so far that took their tokens from the picks of the step before.
    pub fn steps_run_ahead(&self) -> usize {
        self.steps_ahead().steps_picked
    }

    fn steps_ahead(&self) -> std::sync::MutexGuard<'_, StepsAhead> {
        // Plain data: a panic elsewhere leaves it usable.
        self.ahead.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn check_shape(name: &str, t: &HostTensor<'_>, dims: usize) -> BResult<()> {
    if t.shape.len() != dims {
        return Err(BackendError(format!(
            "weight {name}: expected {dims} dimensions, got shape {:?}",
            t.shape
        )));
    }
    Ok(())
}

/// Weight rows a task of [`matmul_f32`] takes.
const PRODUCT_OUTPUTS_PER_TASK: usize = 16;

/// `y[r, :] = x[r, :] Wᵀ` for every row, f32 accumulation, not rounded. Every output is one
/// dot product ([`attention::dot`]) whatever the row count, so a row's result does not depend
/// on the other rows of a step (a mixed step gives each sequence its bits alone). Each task
/// reads its weight rows once and the rows of `x` from cache.
pub fn matmul_f32(x: &[f32], rows: usize, w: &CpuMatrix, y: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(y.len(), rows * n);
    if rows == 0 {
        return;
    }
    if let Some(w_scales) = &w.fp8_scales {
        // Each input row as E4M3 values at its own scale; sums of code values, then both scales.
        let mut x_scales = vec![0f32; rows];
        let mut qx = vec![0f32; rows * k];
        let mut codes = vec![0u8; k];
        for (r, (row, q)) in x.chunks(k).zip(qx.chunks_mut(k)).enumerate() {
            x_scales[r] = fp8_quantize_row(row, &mut codes);
            for (v, &c) in q.iter_mut().zip(&codes) {
                *v = e4m3_value(c);
            }
        }
        matmul_values(&qx, rows, &w.data, n, k, y);
        y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
            for (v, &ws) in yr.iter_mut().zip(w_scales) {
                *v = *v * x_scales[r] * ws;
            }
        });
        return;
    }
    matmul_values(x, rows, &w.data, n, k, y);
}

/// [`matmul_f32`]'s sums: `y = x wᵀ` for `w` of `n` rows of `k` values.
fn matmul_values(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize, y: &mut [f32]) {
    // Outputs first ([n, rows]), then transposed into y.
    let mut yt = vec![0f32; n * rows];
    yt.par_chunks_mut(PRODUCT_OUTPUTS_PER_TASK * rows)
        .enumerate()
        .for_each(|(task, ys)| {
            for (j, col) in ys.chunks_mut(rows).enumerate() {
                let wr = &w[(task * PRODUCT_OUTPUTS_PER_TASK + j) * k..][..k];
                for (r, v) in col.iter_mut().enumerate() {
                    *v = attention::dot(&x[r * k..][..k], wr);
                }
            }
        });
    y.par_chunks_mut(n).enumerate().for_each(|(r, yr)| {
        for (o, v) in yr.iter_mut().enumerate() {
            *v = yt[o * rows + r];
        }
    });
}

/// The rows `rows` of the final hidden states divided by `divisor` and rounded: what the
/// reference feeds `lm_head`.
pub fn lm_head_input(h: &CpuAct, rows: &[usize], divisor: f32) -> Vec<f32> {
    rows.iter()
        .flat_map(|&r| &h.data[r * h.cols..(r + 1) * h.cols])
        .map(|&v| bf16_round(v / divisor))
        .collect()
}

/// The rows of one span of an attention call, as slices: q and k (to norm and rotate in
/// place), v, and the span's rows of `out`.
pub struct SpanRows<'a> {
    /// Rows in the span.
    pub len: usize,
    pub q: &'a mut [f32],
    pub k: &'a mut [f32],
    pub v: &'a [f32],
    pub out: &'a mut [f32],
}

/// Runs `f(i, rows)` for each span `i` of an attention call, after checking the spans.
pub fn each_span(
    io: AttnIo<'_, CpuAct>,
    spans: &[Span],
    states: usize,
    mut f: impl FnMut(usize, SpanRows<'_>) -> BResult<()>,
) -> BResult<()> {
    check_spans(spans, io.q.rows, states)?;
    let (qc, kc, oc) = (io.q.cols, io.k.cols, io.out.cols);
    for (i, span) in spans.iter().enumerate() {
        let r = span.rows();
        f(
            i,
            SpanRows {
                len: span.len,
                q: &mut io.q.data[r.start * qc..r.end * qc],
                k: &mut io.k.data[r.start * kc..r.end * kc],
                v: &io.v.data[r.start * kc..r.end * kc],
                out: &mut io.out.data[r.start * oc..r.end * oc],
            },
        )?;
    }
    Ok(())
}

/// `n` zeros, or an error naming `what` when the host cannot give the memory (never an abort).
fn zeros(n: usize, what: &str) -> BResult<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        BackendError(format!(
            "the CPU cannot hold {what} of {} bytes",
            n.saturating_mul(4)
        ))
    })?;
    v.resize(n, 0.0);
    Ok(v)
}

/// Checks that a sparse call has one mode per span.
pub fn check_modes(modes: &[SparseMode], spans: &[Span]) -> BResult<()> {
    if modes.len() != spans.len() {
        return Err(BackendError(format!(
            "{} sparse modes for {} spans",
            modes.len(),
            spans.len()
        )));
    }
    Ok(())
}

/// Per head of `head_dim` features of every row of `data` (rows of `cols`): optional
/// RMSNorm with the shared weight `norm`, then optional RoPE (rotate-half, positions
/// `first_pos..` for the rows, inverse frequencies `inv_freq`).
pub fn head_norm_rope(
    data: &mut [f32],
    cols: usize,
    head_dim: usize,
    norm: Option<(&[f32], f32)>,
    rope: Option<(&[f32], usize)>,
) {
    let half = head_dim / 2;
    data.par_chunks_mut(cols).enumerate().for_each(|(r, row)| {
        let mut tmp = vec![0f32; head_dim];
        let trig: Option<(Vec<f32>, Vec<f32>)> = rope.map(|(inv_freq, first)| {
            let pos = (first + r) as f32;
            inv_freq
                .iter()
                .map(|&f| ((pos * f).cos(), (pos * f).sin()))
                .unzip()
        });
        for head in row.chunks_exact_mut(head_dim) {
            if let Some((w, eps)) = norm {
                rms_norm_row(head, w, eps, &mut tmp);
                head.copy_from_slice(&tmp);
            }
            if let Some((cos, sin)) = &trig {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    tmp[i] = bf16_round(a * cos[i] - b * sin[i]);
                    tmp[i + half] = bf16_round(b * cos[i] + a * sin[i]);
                }
                head.copy_from_slice(&tmp);
            }
        }
    });
}

/// The q and k norms and RoPE of a lightning span at position `pos` (as
/// [`Backend::lightning`] describes them).
pub fn lightning_norm_rope(
    rows: &mut SpanRows<'_>,
    head_dim: usize,
    norms: Option<(&Vec<f32>, &Vec<f32>, f32)>,
    inv_freq: Option<&Vec<f32>>,
    pos: usize,
) {
    let rope = inv_freq.map(|f| (f.as_slice(), pos));
    let len = rows.len;
    for (x, norm) in [
        (&mut *rows.q, norms.map(|(w, _, e)| (w.as_slice(), e))),
        (&mut *rows.k, norms.map(|(_, w, e)| (w.as_slice(), e))),
    ] {
        let cols = x.len() / len;
        head_norm_rope(x, cols, head_dim, norm, rope);
    }
}

/// The first `rows` rows of k for a lightning replay, normed and rotated at positions `pos..`
/// as [`lightning_norm_rope`] does them, after checking k and v hold them at the layer's width.
pub(crate) fn replay_keys(
    shape: AttnShape,
    (k, v, rows): (&CpuAct, &CpuAct, usize),
    k_norm: Option<(&Vec<f32>, f32)>,
    inv_freq: Option<&Vec<f32>>,
    pos: usize,
) -> BResult<Vec<f32>> {
    let kw = shape.kv_width();
    if k.cols != kw || v.cols != kw || rows > k.rows || rows > v.rows || rows > STEPWISE_SPAN_ROWS {
        return Err(BackendError(format!(
            "lightning replay: {rows} rows of {kw} wanted, k and v hold {}x{} and {}x{}",
            k.rows, k.cols, v.rows, v.cols
        )));
    }
    let mut kr = k.data[..rows * kw].to_vec();
    head_norm_rope(
        &mut kr,
        kw,
        shape.head_dim,
        k_norm.map(|(w, e)| (w.as_slice(), e)),
        inv_freq.map(|f| (f.as_slice(), pos)),
    );
    Ok(kr)
}

/// The pieces (first row, rows) a lightning span is computed in: a span of at most
/// [`STEPWISE_SPAN_ROWS`] rows token by token (each row as if decoded alone), a longer one whole.
pub(crate) fn lightning_pieces(len: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = if len <= STEPWISE_SPAN_ROWS {
        1
    } else {
        len.max(1)
    };
    (0..len).step_by(step).map(move |r| (r, step.min(len - r)))
}

/// Stacks matrices with the same input width.
pub fn concat_rows(parts: Vec<CpuMatrix>) -> BResult<CpuMatrix> {
    let cols = parts.first().map_or(0, |p| p.cols);
    if parts.iter().any(|p| p.cols != cols) {
        return Err(BackendError(
            "concat_rows: the matrices have different input widths".into(),
        ));
    }
    let fp8 = parts.first().is_some_and(|p| p.fp8_scales.is_some());
    if parts.iter().any(|p| p.fp8_scales.is_some() != fp8) {
        return Err(BackendError(
            "concat_rows: FP8 and other matrices cannot be stacked".into(),
        ));
    }
    let rows = parts.iter().map(|p| p.rows).sum();
    let mut data = Vec::with_capacity(rows * cols);
    let mut scales = Vec::new();
    for p in parts {
        data.extend(p.data);
        scales.extend(p.fp8_scales.unwrap_or_default());
    }
    Ok(CpuMatrix {
        data,
        rows,
        cols,
        fp8_scales: fp8.then_some(scales),
    })
}

/// Copies the columns of `y` (`[rows, total]`) into `outs` in order, rounded to bf16.
pub fn split_columns(y: &[f32], total: usize, outs: &mut [&mut CpuAct]) {
    let mut off = 0;
    for o in outs.iter_mut() {
        let w = o.cols;
        for (dst, src) in o.data.chunks_exact_mut(w).zip(y.chunks_exact(total)) {
            for (d, &s) in dst.iter_mut().zip(&src[off..off + w]) {
                *d = bf16_round(s);
            }
        }
        off += w;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `round(round(x·rsqrt(mean(x²)+eps)) · w)` over one row.
fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ms = x.iter().map(|&v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = bf16_round(bf16_round(xi * r) * wi);
    }
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type LightningState = Vec<f32>;
    type SparseCache = SparseCache;
    type Table = Vec<f32>;

    fn name(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    /// Weights, activations and K/V widened to f32; the temporaries (a few rows per thread)
    /// are not counted.
    fn memory_facts(&self, _config: &ModelConfig, _rows: usize) -> BackendMemory {
        BackendMemory {
            value_bytes: F32,
            cache_page: None,
            scratch: 0,
            runtime: 0,
            packs_quantized: false,
            packs_fp8_kv: false,
            ranks: None,
        }
    }

    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<CpuMatrix> {
        check_shape(name, &t, 2)?;
        Ok(CpuMatrix {
            data: t.to_f32(),
            rows: t.shape[0],
            cols: t.shape[1],
            fp8_scales: None,
        })
    }

    fn upload_fp8(&self, name: &str, m: Fp8Matrix<'_>) -> BResult<CpuMatrix> {
        m.check(name)?;
        Ok(CpuMatrix {
            data: m.codes.iter().map(|&c| e4m3_value(c)).collect(),
            rows: m.rows,
            cols: m.cols,
            fp8_scales: Some(m.scales.to_vec()),
        })
    }

    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<Vec<f32>> {
        check_shape(name, &t, 1)?;
        Ok(t.to_f32())
    }

    fn upload_table(&self, data: &[f32]) -> BResult<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn random_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<CpuMatrix> {
        Ok(CpuMatrix {
            data: self.random_vector(name, rows * cols, seed, mean, std)?,
            rows,
            cols,
            fp8_scales: None,
        })
    }

    fn random_vector(
        &self,
        _name: &str,
        len: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Vec<f32>> {
        Ok((0..len as u64)
            .into_par_iter()
            .map(|i| random_normal(i, seed, mean, std))
            .collect())
    }

    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<CpuAct> {
        Ok(CpuAct {
            data: zeros(max_rows.saturating_mul(cols), "an activation buffer")?,
            rows: max_rows,
            cols,
            cap_rows: max_rows,
        })
    }

    fn set_width(&self, a: &mut CpuAct, cols: usize) -> BResult<()> {
        if cols == a.cols {
            return Ok(());
        }
        if cols == 0 {
            return Err(BackendError("an activation of no columns".into()));
        }
        let capacity = a.cap_rows * a.cols;
        a.cols = cols;
        a.cap_rows = capacity / cols;
        a.rows = a.rows.min(a.cap_rows);
        a.data.resize(a.rows * cols, 0.0);
        Ok(())
    }

    fn set_rows(&self, a: &mut CpuAct, rows: usize) {
        let rows = rows.min(a.cap_rows);
        a.rows = rows;
        a.data.resize(rows * a.cols, 0.0);
    }

    fn copy_rows(
        &self,
        src: &CpuAct,
        src_row: usize,
        dst: &mut CpuAct,
        dst_row: usize,
        n: usize,
    ) -> BResult<()> {
        sala_model::backend::check_copy_rows(
            (src.rows, src.cols),
            src_row,
            (dst.rows, dst.cols),
            dst_row,
            n,
        )?;
        let w = src.cols;
        dst.data[dst_row * w..(dst_row + n) * w]
            .copy_from_slice(&src.data[src_row * w..(src_row + n) * w]);
        Ok(())
    }

    fn move_rows(&self, a: &mut CpuAct, src_row: usize, dst_row: usize, n: usize) -> BResult<()> {
        sala_model::backend::check_move_rows(a.rows, src_row, dst_row, n)?;
        let w = a.cols;
        a.data
            .copy_within(src_row * w..(src_row + n) * w, dst_row * w);
        Ok(())
    }

    fn new_lightning_state(&self, heads: usize, head_dim: usize) -> BResult<Vec<f32>> {
        zeros(heads * head_dim * head_dim, "a lightning state")
    }

    fn new_sparse_cache(&self, shape: AttnShape, cfg: &SparseConfig) -> BResult<SparseCache> {
        Ok(SparseCache::new(shape, cfg))
    }

    fn reserve_sparse_cache(
        &self,
        cache: &mut SparseCache,
        cfg: &SparseConfig,
        tokens: usize,
    ) -> BResult<()> {
        cache.reserve(cfg, tokens).map_err(BackendError)
    }

    fn fill_sparse_cache_random(
        &self,
        cache: &mut SparseCache,
        cfg: &SparseConfig,
        tokens: usize,
        seed: u64,
    ) -> BResult<()> {
        if !cache.is_empty() {
            return Err(BackendError(
                "fill_sparse_cache_random: cache not empty".into(),
            ));
        }
        let n = tokens * cache.shape.kv_width();
        let k = self.random_vector("keys", n, seed, 0.0, RANDOM_KV_STD)?;
        let v = self.random_vector("values", n, seed ^ 1, 0.0, RANDOM_KV_STD)?;
        cache.reserve(cfg, tokens).map_err(BackendError)?;
        cache.append(&k, &v);
        Ok(())
    }

    fn copy_lightning_state(&self, src: &Vec<f32>, dst: &mut Vec<f32>) -> BResult<()> {
        if src.len() != dst.len() {
            return Err(BackendError(format!(
                "copy_lightning_state: {} values into a state of {}",
                src.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn copy_sparse_cache(&self, src: &SparseCache, dst: &mut SparseCache) -> BResult<()> {
        dst.copy_from(src).map_err(BackendError)
    }

    fn truncate_sparse_cache(
        &self,
        cache: &mut SparseCache,
        _cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        cache.truncate(len).map_err(BackendError)
    }

    fn fill_lightning_state_random(&self, state: &mut Vec<f32>, seed: u64) -> BResult<()> {
        *state = self.random_vector("state", state.len(), seed, 0.0, RANDOM_STATE_STD)?;
        Ok(())
    }

    fn begin_step(&self, step: &StepInfo<'_>) -> BResult<()> {
        if (step.tokens_picked || step.picks_later) && !self.run_ahead {
            return Err(BackendError("this backend runs no step ahead".into()));
        }
        let mut ahead = self.steps_ahead();
        ahead.steps_picked += usize::from(step.tokens_picked);
        if step.tokens_picked && ahead.last.len() != step.tokens.len() {
            return Err(BackendError(format!(
                "a step of {} rows takes the {} picks of the step before as its tokens",
                step.tokens.len(),
                ahead.last.len()
            )));
        }
        if step.picks_later && !step.tokens_picked {
            // A new run of steps ahead: picks no one took are stale.
            ahead.later.clear();
        }
        ahead.tokens_picked = step.tokens_picked;
        ahead.picks_later = step.picks_later;
        Ok(())
    }

    fn runs_ahead(&self) -> bool {
        self.run_ahead
    }

    fn take_picks(&self) -> BResult<Vec<GreedyPick>> {
        self.steps_ahead()
            .later
            .pop_front()
            .ok_or_else(|| BackendError("no step left its picks for later".into()))
    }

    fn embed(&self, table: &CpuMatrix, ids: &[u32], scale: f32, out: &mut CpuAct) -> BResult<()> {
        let picked = {
            let ahead = self.steps_ahead();
            ahead.tokens_picked.then(|| ahead.last.clone())
        };
        let ids = picked.as_deref().unwrap_or(ids);
        let d = table.cols;
        for (row, &id) in out.data.chunks_exact_mut(d).zip(ids) {
            let src = table
                .data
                .get(id as usize * d..(id as usize + 1) * d)
                .ok_or_else(|| {
                    BackendError(format!("token id {id} is outside the embedding table"))
                })?;
            for (o, &e) in row.iter_mut().zip(src) {
                *o = bf16_round(e * scale);
            }
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuAct, w: &Vec<f32>, eps: f32, out: &mut CpuAct) -> BResult<()> {
        out.data
            .par_chunks_mut(x.cols)
            .zip(x.data.par_chunks(x.cols))
            .for_each(|(o, xr)| rms_norm_row(xr, w, eps, o));
        Ok(())
    }

    fn matmul(&self, x: &CpuAct, w: &CpuMatrix, out: &mut CpuAct) -> BResult<()> {
        if x.cols != w.cols || out.cols != w.rows || out.rows != x.rows {
            return Err(BackendError(format!(
                "matmul shapes: x [{}, {}], w [{}, {}], out [{}, {}]",
                x.rows, x.cols, w.rows, w.cols, out.rows, out.cols
            )));
        }
        matmul_f32(&x.data, x.rows, w, &mut out.data);
        out.data.par_iter_mut().for_each(|v| *v = bf16_round(*v));
        Ok(())
    }

    fn concat_rows(&self, parts: Vec<CpuMatrix>) -> BResult<CpuMatrix> {
        concat_rows(parts)
    }

    fn matmul_split(&self, x: &CpuAct, w: &CpuMatrix, outs: &mut [&mut CpuAct]) -> BResult<()> {
        let total: usize = outs.iter().map(|o| o.cols).sum();
        if total != w.rows || x.cols != w.cols {
            return Err(BackendError(format!(
                "matmul_split: outputs of {total} columns for a [{}, {}] matrix and {} inputs",
                w.rows, w.cols, x.cols
            )));
        }
        let mut y = vec![0f32; x.rows * total];
        matmul_f32(&x.data, x.rows, w, &mut y);
        split_columns(&y, total, outs);
        Ok(())
    }

    fn silu_mul_halves(&self, gu: &CpuAct, out: &mut CpuAct) -> BResult<()> {
        let inter = out.cols;
        out.data
            .par_chunks_mut(inter)
            .zip(gu.data.par_chunks(2 * inter))
            .for_each(|(o, row)| {
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi = bf16_round(bf16_round(silu(row[i])) * row[inter + i]);
                }
            });
        Ok(())
    }

    fn silu_mul(&self, gate: &mut CpuAct, up: &CpuAct) -> BResult<()> {
        gate.data
            .par_iter_mut()
            .zip(up.data.par_iter())
            .for_each(|(g, &u)| *g = bf16_round(bf16_round(silu(*g)) * u));
        Ok(())
    }

    fn add_scaled(&self, h: &mut CpuAct, branch: &CpuAct, scale: f32) -> BResult<()> {
        h.data
            .par_iter_mut()
            .zip(branch.data.par_iter())
            .for_each(|(x, &b)| *x = bf16_round(*x + bf16_round(b * scale)));
        Ok(())
    }

    fn sigmoid_gate(&self, x: &mut CpuAct, gate: &CpuAct) -> BResult<()> {
        x.data
            .par_iter_mut()
            .zip(gate.data.par_iter())
            .for_each(|(v, &z)| *v = bf16_round(*v * bf16_round(sigmoid(z))));
        Ok(())
    }

    fn row_sums_of_squares(&self, x: &CpuAct, sums: &mut Vec<f32>) -> BResult<()> {
        if sums.len() < x.rows {
            return Err(BackendError(format!(
                "row sums of squares: a table of {} entries for {} rows",
                sums.len(),
                x.rows
            )));
        }
        for (s, row) in sums.iter_mut().zip(x.data.chunks(x.cols).take(x.rows)) {
            *s = row.iter().map(|&v| v * v).sum();
        }
        Ok(())
    }

    fn rms_norm_gate_with_sums(
        &self,
        x: &CpuAct,
        sums: &Vec<f32>,
        width: usize,
        w: &Vec<f32>,
        eps: f32,
        gate: Option<&CpuAct>,
        out: &mut CpuAct,
    ) -> BResult<()> {
        if sums.len() < x.rows || w.len() != x.cols || out.cols != x.cols || width < x.cols {
            return Err(BackendError(format!(
                "norm of split rows: {} rows of {} columns (of {width}), {} sums, a weight of {}, \
                 an output of {} columns",
                x.rows,
                x.cols,
                sums.len(),
                w.len(),
                out.cols
            )));
        }
        let rows = x.data.chunks(x.cols).zip(out.data.chunks_mut(x.cols));
        for ((xr, o), &s) in rows.take(x.rows).zip(sums.iter()) {
            let r = 1.0 / (s / width as f32 + eps).sqrt();
            for ((o, &xi), &wi) in o.iter_mut().zip(xr).zip(w) {
                *o = bf16_round(bf16_round(xi * r) * wi);
            }
        }
        match gate {
            Some(g) => self.sigmoid_gate(out, g),
            None => Ok(()),
        }
    }

    fn rope(
        &self,
        head_dim: usize,
        inv_freq: &Vec<f32>,
        spans: &[Span],
        q: &mut CpuAct,
        k: &mut CpuAct,
    ) -> BResult<()> {
        check_rope(head_dim, spans, (q.rows, q.cols), (k.rows, k.cols))?;
        for span in spans {
            let r = span.rows();
            for x in [&mut *q, &mut *k] {
                let cols = x.cols;
                head_norm_rope(
                    &mut x.data[r.start * cols..r.end * cols],
                    cols,
                    head_dim,
                    None,
                    Some((inv_freq.as_slice(), span.pos)),
                );
            }
        }
        Ok(())
    }

    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &Vec<f32>,
        norms: Option<(&Vec<f32>, &Vec<f32>, f32)>,
        inv_freq: Option<&Vec<f32>>,
        io: AttnIo<'_, CpuAct>,
        spans: &[Span],
        states: &mut [&mut Vec<f32>],
    ) -> BResult<()> {
        each_span(io, spans, states.len(), |i, given| {
            // Normed and rotated in copies: q and k keep what the projections made, as the
            // GPU's stepping kernels leave them, so no caller can count on either.
            let (mut q, mut k) = (given.q.to_vec(), given.k.to_vec());
            let mut rows = SpanRows {
                len: given.len,
                q: &mut q,
                k: &mut k,
                v: given.v,
                out: given.out,
            };
            lightning_norm_rope(&mut rows, shape.head_dim, norms, inv_freq, spans[i].pos);
            let (qw, kw) = (shape.q_width(), shape.kv_width());
            for (r, n) in lightning_pieces(rows.len) {
                let o = attention::lightning(
                    shape,
                    slopes,
                    &rows.q[r * qw..(r + n) * qw],
                    &rows.k[r * kw..(r + n) * kw],
                    &rows.v[r * kw..(r + n) * kw],
                    states[i],
                );
                for (dst, x) in rows.out[r * qw..(r + n) * qw].iter_mut().zip(o) {
                    *dst = bf16_round(x);
                }
            }
            Ok(())
        })
    }

    fn lightning_replay(
        &self,
        shape: AttnShape,
        slopes: &Vec<f32>,
        k_norm: Option<(&Vec<f32>, f32)>,
        inv_freq: Option<&Vec<f32>>,
        (k, v, rows): (&CpuAct, &CpuAct, usize),
        pos: usize,
        state: &mut Vec<f32>,
    ) -> BResult<()> {
        let kw = shape.kv_width();
        let kr = replay_keys(shape, (k, v, rows), k_norm, inv_freq, pos)?;
        let q = vec![0.0; shape.q_width()];
        // Row by row, as a span this short runs (the outputs, from a zero q, are dropped).
        for r in 0..rows {
            let vr = &v.data[r * kw..(r + 1) * kw];
            attention::lightning(shape, slopes, &q, &kr[r * kw..(r + 1) * kw], vr, state);
        }
        Ok(())
    }

    fn sparse_attention(
        &self,
        _shape: AttnShape,
        _cfg: &SparseConfig,
        io: AttnIo<'_, CpuAct>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut SparseCache],
    ) -> BResult<()> {
        check_modes(modes, spans)?;
        each_span(io, spans, caches.len(), |i, rows| {
            let cache = &mut *caches[i];
            cache.append(rows.k, rows.v);
            let o = attention::sparse_layer_attention(cache, modes[i], rows.q);
            for (dst, x) in rows.out.iter_mut().zip(o) {
                *dst = bf16_round(x);
            }
            Ok(())
        })
    }

    fn lightning_state_advance(
        &self,
        slopes: &Vec<f32>,
        head_dim: usize,
        tokens: usize,
        prev: &Vec<f32>,
        state: &mut Vec<f32>,
    ) -> BResult<()> {
        let size = head_dim * head_dim;
        if prev.len() != state.len() || state.len() != slopes.len() * size {
            return Err(BackendError(format!(
                "lightning scan: states of {} and {} values for {} heads of {head_dim}",
                prev.len(),
                state.len(),
                slopes.len()
            )));
        }
        for ((s, p), &slope) in state.chunks_mut(size).zip(prev.chunks(size)).zip(slopes) {
            let decay = (-slope * tokens as f32).exp();
            for (x, &y) in s.iter_mut().zip(p) {
                *x += decay * y;
            }
        }
        Ok(())
    }

    fn lightning_state_term(
        &self,
        shape: AttnShape,
        slopes: &Vec<f32>,
        q_norm: Option<(&Vec<f32>, f32)>,
        inv_freq: Option<&Vec<f32>>,
        state: &Vec<f32>,
        (q, pos): (&mut CpuAct, usize),
        out: &mut CpuAct,
    ) -> BResult<()> {
        let (d, qw, rows) = (shape.head_dim, shape.q_width(), q.rows);
        if q.cols != qw || out.cols != qw || rows > out.rows || state.len() != shape.heads * d * d {
            return Err(BackendError(format!(
                "lightning start states: q [{}, {}] and out [{}, {}] for {} heads of {d}, a \
                 state of {} values",
                q.rows,
                q.cols,
                out.rows,
                out.cols,
                shape.heads,
                state.len()
            )));
        }
        head_norm_rope(
            &mut q.data[..rows * qw],
            qw,
            d,
            q_norm.map(|(w, e)| (w.as_slice(), e)),
            inv_freq.map(|f| (f.as_slice(), pos)),
        );
        let scale = shape.scale() as f32;
        out.data[..rows * qw]
            .par_chunks_mut(qw)
            .zip(q.data[..rows * qw].par_chunks(qw))
            .enumerate()
            .for_each(|(t, (o, qt))| {
                for h in 0..shape.heads {
                    let decay = (-slopes[h] * (t + 1) as f32).exp();
                    let s = &state[h * d * d..][..d * d];
                    let mut term = vec![0f32; d];
                    for (a, &qa) in qt[h * d..][..d].iter().enumerate() {
                        attention::axpy(&mut term, qa, &s[a * d..][..d]);
                    }
                    for (x, y) in o[h * d..][..d].iter_mut().zip(term) {
                        *x = bf16_round(*x + scale * decay * y);
                    }
                }
            });
        Ok(())
    }

    fn append_sparse_kv(
        &self,
        cache: &mut SparseCache,
        _cfg: &SparseConfig,
        k: &CpuAct,
        v: &CpuAct,
        rows: std::ops::Range<usize>,
    ) -> BResult<()> {
        let kw = cache.shape.kv_width();
        sala_model::backend::check_append_kv(kw, (k.rows, k.cols), (v.rows, v.cols), &rows)?;
        let at = rows.start * kw..rows.end * kw;
        cache.append(&k.data[at.clone()], &v.data[at]);
        Ok(())
    }

    fn logits(
        &self,
        h: &CpuAct,
        rows: &[usize],
        keep: &[bool],
        lm_head: &CpuMatrix,
        divisor: f32,
    ) -> BResult<LogitsOut> {
        if keep.len() != rows.len() {
            return Err(BackendError(format!(
                "logits: {} keep flags for {} rows",
                keep.len(),
                rows.len()
            )));
        }
        let x = lm_head_input(h, rows, divisor);
        let vocab = lm_head.rows;
        let mut y = vec![0f32; rows.len() * vocab];
        matmul_f32(&x, rows.len(), lm_head, &mut y);
        y.par_iter_mut().for_each(|v| *v = bf16_round(*v));
        let picks: Vec<GreedyPick> = y.par_chunks(vocab.max(1)).map(GreedyPick::of).collect();
        {
            // The next step's tokens, should it take them (a row without a pick reads token 0,
            // as on a GPU; its request fails on the host).
            let mut ahead = self.steps_ahead();
            ahead.last = picks.iter().map(|p| p.id.unwrap_or(0)).collect();
            if ahead.picks_later {
                ahead.later.push_back(picks);
                return Ok(LogitsOut::default());
            }
        }
        let kept = if keep.iter().all(|&k| k) {
            y
        } else {
            y.chunks(vocab.max(1))
                .zip(keep)
                .filter(|(_, &k)| k)
                .flat_map(|(r, _)| r.iter().copied())
                .collect()
        };
        Ok(LogitsOut { rows: kept, picks })
    }

    fn to_host(&self, a: &CpuAct) -> BResult<Vec<f32>> {
        Ok(a.data.clone())
    }
}

/// Simulated ranks, all in this process: tensor parallelism's sums (in rank order, in f32,
/// an activation's sum rounded to bf16 as every op's output is) and context parallelism's
/// copies.
pub struct HostRanks;

impl sala_model::context::Exchange<CpuBackend> for HostRanks {
    fn copy_act(
        &self,
        _from: &CpuBackend,
        src: &CpuAct,
        _to: &CpuBackend,
        dst: &mut CpuAct,
        rows: usize,
    ) -> BResult<()> {
        let n = rows * src.cols;
        if src.cols != dst.cols || rows > src.rows || rows > dst.rows {
            return Err(BackendError(format!(
                "a copy of {rows} rows from [{}, {}] to [{}, {}]",
                src.rows, src.cols, dst.rows, dst.cols
            )));
        }
        dst.data[..n].copy_from_slice(&src.data[..n]);
        Ok(())
    }

    fn copy_state(
        &self,
        _from: &CpuBackend,
        src: &Vec<f32>,
        _to: &CpuBackend,
        dst: &mut Vec<f32>,
    ) -> BResult<()> {
        if src.len() != dst.len() {
            return Err(BackendError("lightning states of two shapes".into()));
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn one_memory(&self) -> bool {
        true
    }
}

impl sala_model::ranks::Collective<CpuBackend> for HostRanks {
    fn one_memory(&self) -> bool {
        true
    }

    fn sum_acts(&self, _ranks: &[CpuBackend], parts: &mut [&mut CpuAct]) -> BResult<()> {
        let sums = host_sums(parts.iter().map(|p| &p.data[..p.rows * p.cols]))?;
        for p in parts.iter_mut() {
            for (d, &s) in p.data.iter_mut().zip(&sums) {
                *d = bf16_round(s);
            }
        }
        Ok(())
    }

    fn sum_tables(
        &self,
        _ranks: &[CpuBackend],
        parts: &mut [&mut Vec<f32>],
        len: usize,
    ) -> BResult<()> {
        let sums = host_sums(parts.iter().map(|p| p.get(..len).unwrap_or(&[])))?;
        if sums.len() != len {
            return Err(BackendError(format!(
                "a table sum of {len} entries over shorter tables"
            )));
        }
        for p in parts.iter_mut() {
            p[..len].copy_from_slice(&sums);
        }
        Ok(())
    }
}

/// The element-wise f32 sum of equally long slices, in order.
fn host_sums<'a>(mut parts: impl Iterator<Item = &'a [f32]>) -> BResult<Vec<f32>> {
    let mut sums = parts.next().unwrap_or(&[]).to_vec();
    for p in parts {
        if p.len() != sums.len() {
            return Err(BackendError(format!(
                "ranks' sums of {} and {} values",
                sums.len(),
                p.len()
            )));
        }
        for (s, &v) in sums.iter_mut().zip(p) {
            *s += v;
        }
    }
    Ok(sums)
}
