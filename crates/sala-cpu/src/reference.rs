//! A backend whose attention ops are the oracle itself (f64, per-query, no caching tricks) and
//! whose matrix products are plain loops; everything else is the CPU backend's. Whole-model
//! runs on it are the reference the fast backends are compared with.

use crate::{check_modes, each_span, lightning_norm_rope, CpuAct, CpuBackend, CpuMatrix};
use sala_checkpoint::{KvCacheDtype, ModelConfig, SparseConfig};
use sala_model::memory::BackendMemory;
use sala_model::numerics::{bf16_round, fp8_round_kv};
use sala_model::oracle::{self, AttnShape, SparseMode};
use sala_model::{AttnIo, BResult, Backend, GreedyPick, HostTensor, LogitsOut, Span};

pub struct ReferenceBackend;

/// All K and V rows seen so far.
#[derive(Debug, Clone, Default)]
pub struct ReferenceKv {
    k: Vec<f32>,
    v: Vec<f32>,
    kv_width: usize,
    head_dim: usize,
}

fn naive_matmul(x: &[f32], rows: usize, w: &CpuMatrix) -> Vec<f32> {
    let mut y = vec![0f32; rows * w.rows];
    for r in 0..rows {
        for o in 0..w.rows {
            let acc: f64 = (0..w.cols)
                .map(|i| x[r * w.cols + i] as f64 * w.data[o * w.cols + i] as f64)
                .sum();
            y[r * w.rows + o] = acc as f32;
        }
    }
    y
}

impl Backend for ReferenceBackend {
    type Act = CpuAct;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type LightningState = Vec<f32>;
    type SparseCache = ReferenceKv;
    type Table = Vec<f32>;

    fn name(&self) -> String {
        "reference (oracle)".into()
    }
    /// The CPU backend's: f32 values, nothing else counted.
    fn memory_facts(&self, config: &ModelConfig, rows: usize) -> BackendMemory {
        CpuBackend::default().memory_facts(config, rows)
    }
    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<CpuMatrix> {
        CpuBackend::default().upload_matrix(name, t)
    }
    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<Vec<f32>> {
        CpuBackend::default().upload_vector(name, t)
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
        CpuBackend::default().random_matrix(name, rows, cols, seed, mean, std)
    }
    fn random_vector(
        &self,
        name: &str,
        len: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Vec<f32>> {
        CpuBackend::default().random_vector(name, len, seed, mean, std)
    }
    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<CpuAct> {
        CpuBackend::default().alloc(max_rows, cols)
    }
    fn set_rows(&self, a: &mut CpuAct, rows: usize) {
        CpuBackend::default().set_rows(a, rows)
    }
    fn set_width(&self, a: &mut CpuAct, cols: usize) -> BResult<()> {
        CpuBackend::default().set_width(a, cols)
    }
    fn copy_rows(
        &self,
        src: &CpuAct,
        src_row: usize,
        dst: &mut CpuAct,
        dst_row: usize,
        n: usize,
    ) -> BResult<()> {
        CpuBackend::default().copy_rows(src, src_row, dst, dst_row, n)
    }
    fn move_rows(&self, a: &mut CpuAct, src_row: usize, dst_row: usize, n: usize) -> BResult<()> {
        CpuBackend::default().move_rows(a, src_row, dst_row, n)
    }
    fn new_lightning_state(&self, heads: usize, head_dim: usize) -> BResult<Vec<f32>> {
        CpuBackend::default().new_lightning_state(heads, head_dim)
    }
    fn new_sparse_cache(&self, shape: AttnShape, _cfg: &SparseConfig) -> BResult<ReferenceKv> {
        Ok(ReferenceKv {
            kv_width: shape.kv_width(),
            head_dim: shape.head_dim,
            ..Default::default()
        })
    }
    fn copy_lightning_state(&self, src: &Vec<f32>, dst: &mut Vec<f32>) -> BResult<()> {
        CpuBackend::default().copy_lightning_state(src, dst)
    }
    fn truncate_sparse_cache(
        &self,
        cache: &mut ReferenceKv,
        _cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        // The oracle compresses keys from the whole cache at every call: K and V are all it
        // keeps.
        let keep = len * cache.kv_width;
        if keep > cache.k.len() {
            return Err(sala_model::BackendError(format!(
                "truncate_sparse_cache: {len} tokens of a cache of {}",
                cache.k.len() / cache.kv_width.max(1)
            )));
        }
        cache.k.truncate(keep);
        cache.v.truncate(keep);
        Ok(())
    }
    fn embed(&self, table: &CpuMatrix, ids: &[u32], scale: f32, out: &mut CpuAct) -> BResult<()> {
        CpuBackend::default().embed(table, ids, scale, out)
    }
    fn rms_norm(&self, x: &CpuAct, w: &Vec<f32>, eps: f32, out: &mut CpuAct) -> BResult<()> {
        CpuBackend::default().rms_norm(x, w, eps, out)
    }
    fn matmul(&self, x: &CpuAct, w: &CpuMatrix, out: &mut CpuAct) -> BResult<()> {
        out.data = naive_matmul(&x.data, x.rows, w)
            .into_iter()
            .map(bf16_round)
            .collect();
        Ok(())
    }
    fn concat_rows(&self, parts: Vec<CpuMatrix>) -> BResult<CpuMatrix> {
        crate::concat_rows(parts)
    }
    fn matmul_split(&self, x: &CpuAct, w: &CpuMatrix, outs: &mut [&mut CpuAct]) -> BResult<()> {
        let total: usize = outs.iter().map(|o| o.cols).sum();
        crate::split_columns(&naive_matmul(&x.data, x.rows, w), total, outs);
        Ok(())
    }
    fn silu_mul_halves(&self, gu: &CpuAct, out: &mut CpuAct) -> BResult<()> {
        CpuBackend::default().silu_mul_halves(gu, out)
    }
    fn silu_mul(&self, gate: &mut CpuAct, up: &CpuAct) -> BResult<()> {
        CpuBackend::default().silu_mul(gate, up)
    }
    fn add_scaled(&self, h: &mut CpuAct, branch: &CpuAct, scale: f32) -> BResult<()> {
        CpuBackend::default().add_scaled(h, branch, scale)
    }
    fn sigmoid_gate(&self, x: &mut CpuAct, gate: &CpuAct) -> BResult<()> {
        CpuBackend::default().sigmoid_gate(x, gate)
    }
    fn rope(
        &self,
        head_dim: usize,
        inv_freq: &Vec<f32>,
        spans: &[Span],
        q: &mut CpuAct,
        k: &mut CpuAct,
    ) -> BResult<()> {
        CpuBackend::default().rope(head_dim, inv_freq, spans, q, k)
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
        each_span(io, spans, states.len(), |i, mut rows| {
            lightning_norm_rope(&mut rows, shape.head_dim, norms, inv_freq, spans[i].pos);
            let (qw, kw) = (shape.q_width(), shape.kv_width());
            for (r, n) in crate::lightning_pieces(rows.len) {
                let (o, s) = oracle::lightning(
                    shape,
                    slopes,
                    &rows.q[r * qw..(r + n) * qw],
                    &rows.k[r * kw..(r + n) * kw],
                    &rows.v[r * kw..(r + n) * kw],
                    Some(states[i]),
                );
                *states[i] = s;
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
        let kr = crate::replay_keys(shape, (k, v, rows), k_norm, inv_freq, pos)?;
        let q = vec![0.0; shape.q_width()];
        for r in 0..rows {
            let vr = &v.data[r * kw..(r + 1) * kw];
            let (_, s) = oracle::lightning(
                shape,
                slopes,
                &q,
                &kr[r * kw..(r + 1) * kw],
                vr,
                Some(state),
            );
            *state = s;
        }
        Ok(())
    }

    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        io: AttnIo<'_, CpuAct>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut ReferenceKv],
    ) -> BResult<()> {
        check_modes(modes, spans)?;
        each_span(io, spans, caches.len(), |i, rows| {
            let cache = &mut *caches[i];
            let first = cache.k.len() / cache.kv_width;
            cache.k.extend_from_slice(rows.k);
            cache.v.extend_from_slice(rows.v);
            if cfg.kv_cache == KvCacheDtype::Fp8 {
                let new = first * cache.kv_width..;
                fp8_round_kv(&mut cache.k[new.clone()], shape.head_dim);
                fp8_round_kv(&mut cache.v[new], shape.head_dim);
            }
            let o = oracle::sparse_layer_attention(
                shape, cfg, modes[i], rows.q, first, &cache.k, &cache.v,
            );
            for (dst, x) in rows.out.iter_mut().zip(o) {
                *dst = bf16_round(x);
            }
            Ok(())
        })
    }
    fn append_sparse_kv(
        &self,
        cache: &mut ReferenceKv,
        cfg: &SparseConfig,
        k: &CpuAct,
        v: &CpuAct,
        rows: std::ops::Range<usize>,
    ) -> BResult<()> {
        let kw = cache.kv_width;
        sala_model::backend::check_append_kv(kw, (k.rows, k.cols), (v.rows, v.cols), &rows)?;
        let first = cache.k.len();
        let at = rows.start * kw..rows.end * kw;
        cache.k.extend_from_slice(&k.data[at.clone()]);
        cache.v.extend_from_slice(&v.data[at]);
        if cfg.kv_cache == KvCacheDtype::Fp8 {
            fp8_round_kv(&mut cache.k[first..], cache.head_dim);
            fp8_round_kv(&mut cache.v[first..], cache.head_dim);
        }
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
        let x = crate::lm_head_input(h, rows, divisor);
        let y: Vec<f32> = naive_matmul(&x, rows.len(), lm_head)
            .into_iter()
            .map(bf16_round)
            .collect();
        let vocab = lm_head.rows.max(1);
        Ok(LogitsOut {
            picks: y.chunks(vocab).map(GreedyPick::of).collect(),
            rows: y
                .chunks(vocab)
                .zip(keep)
                .filter(|(_, &k)| k)
                .flat_map(|(r, _)| r.iter().copied())
                .collect(),
        })
    }
    fn to_host(&self, a: &CpuAct) -> BResult<Vec<f32>> {
        Ok(a.data.clone())
    }
}
