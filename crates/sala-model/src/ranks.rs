//! Tensor parallelism as a backend. [`Ranks`] holds one backend a rank and runs every op of
//! the model on each, with that rank's part of the weights (the split of
//! [`TensorParallel::shards`], taken by weight name as they are uploaded). Products whose
//! inputs are split among the ranks (o_proj, down_proj) leave each rank a partial sum, which
//! a [`Collective`] adds across the ranks, as it adds the lightning output norm's sums of
//! squares. The model, the engine and the server run on it as on any backend.

use crate::backend::{
    AttnIo, BResult, Backend, BackendError, Fp8Matrix, HostDType, HostTensor, LogitsOut,
    QuantMatrix, Span, StepInfo,
};
use crate::memory::{BackendMemory, RankShare};
use crate::oracle::{AttnShape, SparseMode};
use crate::parallel::{Shard, TensorParallel};
use sala_checkpoint::{expected_tensors, ModelConfig, SparseConfig};
use std::cell::RefCell;
use std::collections::HashSet;

mod exchange;
mod weights;
pub use exchange::RankExchange;
use weights::cut_bytes;

/// The sums across ranks that tensor parallelism needs (NCCL's all-reduce on GPUs).
pub trait Collective<B: Backend> {
    /// Each `parts[r]` (rank r's activation; the same shape on every rank) becomes the sum
    /// over the ranks, rounded as an activation: every rank gets the same values.
    fn sum_acts(&self, ranks: &[B], parts: &mut [&mut B::Act]) -> BResult<()>;
    /// The first `len` entries of each rank's table become their f32 sum over the ranks.
    fn sum_tables(&self, ranks: &[B], parts: &mut [&mut B::Table], len: usize) -> BResult<()>;
    /// Whether the ranks share one memory (simulated ranks in one process's memory).
    fn one_memory(&self) -> bool {
        false
    }
}

/// Which columns of an activation each rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds every column (the same values).
    Whole,
    /// Each rank holds its part of the columns (its heads, its part of the MLP's width).
    Columns,
}

/// Rank `r`'s part of each of an attention call's buffers.
fn rank_io<'b, A>(io: &'b mut AttnIo<'_, RankAct<A>>, r: usize) -> AttnIo<'b, A> {
    AttnIo {
        q: &mut io.q.parts[r],
        k: &mut io.k.parts[r],
        v: &mut io.v.parts[r],
        out: &mut io.out.parts[r],
    }
}

/// An activation on every rank.
pub struct RankAct<A> {
    parts: Vec<A>,
    split: Split,
    /// Columns of the whole activation.
    cols: usize,
    /// Columns of each rank's part now (the width of the layer it last served).
    width: usize,
    rows: usize,
}

/// How a weight is split among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixSplit {
    Whole,
    /// By output features: a product gives each rank its columns of the output.
    Rows,
    /// By input features: a product gives each rank a partial sum of the whole output.
    Columns,
}

/// A weight on every rank.
pub struct RankMatrix<M> {
    parts: Vec<M>,
    split: MatrixSplit,
    /// Each rank's output rows of each matrix stacked here ([`Backend::concat_rows`]), the
    /// same on every rank: the widths of a product's outputs.
    pieces: Vec<usize>,
}

/// A table on every rank: whole, and, where it has an entry per attention head (the
/// lightning decay slopes), each rank's heads' entries.
pub struct RankTable<T> {
    whole: Vec<T>,
    by_heads: Option<Vec<T>>,
}

impl<T> RankTable<T> {
    /// Each rank's heads' entries (the lightning decay slopes).
    fn heads(&self) -> BResult<&[T]> {
        self.by_heads
            .as_deref()
            .ok_or_else(|| err("the lightning slopes are not a table of the heads"))
    }
}

/// Tensor parallelism over the backends of its ranks, one per device.
pub struct Ranks<B: Backend> {
    ranks: Vec<B>,
    collective: Box<dyn Collective<B> + Send>,
    tp: TensorParallel,
    /// The whole model's config (the shards are cut from it).
    config: ModelConfig,
    /// The model's weights' names: no other weight is taken.
    weights: HashSet<String>,
    /// Each rank's f32 scratch for a split norm's row sums, and its length.
    sums: RefCell<Vec<(usize, B::Table)>>,
}

fn err(msg: impl Into<String>) -> BackendError {
    BackendError(format!("tensor parallelism: {}", msg.into()))
}

impl<B: Backend> Ranks<B> {
    /// Tensor parallelism over `ranks` (one backend a rank, in rank order) for a model of
    /// `config`, summing through `collective`. An error names what does not split.
    pub fn new(
        ranks: Vec<B>,
        collective: Box<dyn Collective<B> + Send>,
        config: &ModelConfig,
    ) -> BResult<Self> {
        let tp = TensorParallel::new(config, ranks.len()).map_err(BackendError)?;
        let sums = ranks
            .iter()
            .map(|be| Ok((1, be.upload_table(&[0.0])?)))
            .collect::<BResult<_>>()?;
        Ok(Self {
            ranks,
            collective,
            tp,
            config: config.clone(),
            weights: expected_tensors(config)
                .into_iter()
                .map(|t| t.name)
                .collect(),
            sums: RefCell::new(sums),
        })
    }

    /// The ranks' backends, in rank order.
    pub fn ranks(&self) -> &[B] {
        &self.ranks
    }

    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// An error unless `name` is one of the model's weights (a draft model's are not).
    fn check_weight(&self, name: &str) -> BResult<()> {
        if !self.weights.contains(name) {
            return Err(err(format!(
                "weight {name} is not one of the model's; a draft model (and a single op's \
                 benchmark) runs on one device only"
            )));
        }
        Ok(())
    }

    /// Rank `rank`'s part of weight `name`, or `None` for a weight every rank holds whole.
    fn shard(&self, name: &str, rank: usize) -> Option<Shard> {
        self.tp.shard_of(&self.config, name, rank)
    }

    /// How weight `name` is split (over one rank too, so that its products' outputs are
    /// what the activations they go to expect).
    fn matrix_split(&self, name: &str) -> MatrixSplit {
        match self.shard(name, 0) {
            Some(s) if s.splits_inputs() => MatrixSplit::Columns,
            Some(_) => MatrixSplit::Rows,
            None => MatrixSplit::Whole,
        }
    }

    /// Each rank's output rows of weight `name` (of `rows` rows).
    fn rank_rows(&self, name: &str, rows: usize) -> usize {
        self.shard(name, 0).map_or(rows, |p| p.rows.len())
    }

    /// One rank's shape of an attention of the model's shape `shape`: the lightning layers'
    /// heads split among the ranks, the sparse layers' [`TensorParallel::sparse_ways`] ways.
    fn rank_shape(&self, shape: AttnShape) -> BResult<AttnShape> {
        let c = &self.config;
        let ways = if shape.kv_heads == c.lightning_nkv {
            self.ranks.len()
        } else {
            self.tp.sparse_ways(c)
        };
        let ours = shape.heads == c.num_attention_heads
            && shape.head_dim == c.head_dim
            && (shape.kv_heads == c.num_key_value_heads || shape.kv_heads == c.lightning_nkv);
        if !ours || !shape.kv_heads.is_multiple_of(ways) {
            return Err(err(format!(
                "an attention of {} heads ({} KV) is not one of the model's layers (a draft \
                 model runs on one device only)",
                shape.heads, shape.kv_heads
            )));
        }
        Ok(AttnShape {
            heads: shape.heads / ways,
            kv_heads: shape.kv_heads / ways,
            head_dim: shape.head_dim,
        })
    }

    /// Sets every rank's part of `a` to `width` columns.
    fn set_width(&self, a: &mut RankAct<B::Act>, width: usize) -> BResult<()> {
        if a.width != width {
            for (be, p) in self.ranks.iter().zip(&mut a.parts) {
                be.set_width(p, width)?;
            }
            a.width = width;
        }
        Ok(())
    }

    /// Every rank's `f(rank, backend)`, in rank order.
    fn each<T>(&self, mut f: impl FnMut(usize, &B) -> BResult<T>) -> BResult<Vec<T>> {
        self.ranks
            .iter()
            .enumerate()
            .map(|(r, be)| f(r, be))
            .collect()
    }

    /// `f` with every rank's graphs held (closed and launched, none opening) before it and
    /// released after: for work that runs eagerly or blocks the host on any rank.
    fn graphs_held<T>(&self, f: impl FnOnce() -> BResult<T>) -> BResult<T> {
        let held = self.each(|_, be| be.hold_graphs()).and_then(|_| f());
        let released = self.each(|_, be| be.release_graphs());
        let out = held?;
        released?;
        Ok(out)
    }

    /// Makes each rank's row-sums table hold at least `rows` entries: when split activations
    /// are allocated (outside any step), and, as a fallback, before a split norm.
    fn grow_sums(&self, rows: usize) -> BResult<()> {
        let mut sums = self.sums.borrow_mut();
        for (be, (len, table)) in self.ranks.iter().zip(sums.iter_mut()) {
            if *len < rows {
                *table = be.upload_table(&vec![0.0; rows])?;
                *len = rows;
            }
        }
        Ok(())
    }

    fn check_whole(&self, what: &str, a: &RankAct<B::Act>) -> BResult<()> {
        if a.split != Split::Whole {
            return Err(err(format!(
                "{what} takes whole rows, not a rank's columns"
            )));
        }
        Ok(())
    }
}

/// Rank `r`'s parts of a slice of rank activations.
fn parts_mut<'a, A>(acts: &'a mut [&mut RankAct<A>], r: usize) -> Vec<&'a mut A> {
    acts.iter_mut().map(|a| &mut a.parts[r]).collect()
}

impl<B: Backend> Backend for Ranks<B> {
    type Act = RankAct<B::Act>;
    type Matrix = RankMatrix<B::Matrix>;
    type Vector = Vec<B::Vector>;
    type LightningState = Vec<B::LightningState>;
    type SparseCache = Vec<B::SparseCache>;
    type Table = RankTable<B::Table>;

    fn name(&self) -> String {
        format!(
            "{} x {} (tensor parallel)",
            self.ranks.len(),
            self.ranks[0].name()
        )
    }

    fn default_prefill_chunk(&self) -> usize {
        self.ranks[0].default_prefill_chunk()
    }

    /// One rank's facts, for its part of the model: a plan counts one rank's part (all of
    /// them where the ranks share one memory, as simulated CPU ranks do).
    fn memory_facts(&self, config: &ModelConfig, rows: usize) -> BackendMemory {
        BackendMemory {
            ranks: Some(RankShare {
                tp: self.tp,
                one_memory: self.collective.one_memory(),
            }),
            ..self.ranks[0].memory_facts(&self.tp.rank_config(config), rows)
        }
    }

    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Matrix> {
        self.check_weight(name)?;
        if t.shape.len() != 2 {
            return Err(err(format!(
                "weight {name}: shape {:?} is not a matrix",
                t.shape
            )));
        }
        let split = self.matrix_split(name);
        let parts = self.each(|r, be| match self.shard(name, r) {
            Some(part) => self.upload_part(name, t, &part, |p| be.upload_matrix(name, p)),
            _ => be.upload_matrix(name, t),
        })?;
        let pieces = vec![self.rank_rows(name, t.shape[0])];
        Ok(RankMatrix {
            parts,
            split,
            pieces,
        })
    }

    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<Self::Vector> {
        self.check_weight(name)?;
        self.each(|r, be| match self.shard(name, r) {
            Some(part) => self.upload_part(name, t, &part, |p| be.upload_vector(name, p)),
            _ => be.upload_vector(name, t),
        })
    }

    fn upload_table(&self, data: &[f32]) -> BResult<Self::Table> {
        let whole = self.each(|_, be| be.upload_table(data))?;
        let heads = self.config.num_attention_heads;
        let by_heads = (data.len() == heads)
            .then(|| {
                self.each(|r, be| {
                    let each = heads / self.ranks.len();
                    be.upload_table(&data[r * each..(r + 1) * each])
                })
            })
            .transpose()?;
        Ok(RankTable { whole, by_heads })
    }

    fn random_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Self::Matrix> {
        self.check_weight(name)?;
        let split = self.matrix_split(name);
        let parts = self.each(|r, be| match self.shard(name, r) {
            Some(part) => {
                let bytes = Self::random_part(cols, &part, seed, mean, std);
                let shape = [part.rows.len(), part.cols.len()];
                be.upload_matrix(
                    name,
                    HostTensor {
                        dtype: HostDType::F32,
                        shape: &shape,
                        bytes: &bytes,
                    },
                )
            }
            _ => be.random_matrix(name, rows, cols, seed, mean, std),
        })?;
        let pieces = vec![self.rank_rows(name, rows)];
        Ok(RankMatrix {
            parts,
            split,
            pieces,
        })
    }

    fn random_vector(
        &self,
        name: &str,
        len: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<Self::Vector> {
        self.check_weight(name)?;
        self.each(|r, be| match self.shard(name, r) {
            Some(part) => {
                let bytes = Self::random_part(1, &part, seed, mean, std);
                let shape = [part.rows.len()];
                be.upload_vector(
                    name,
                    HostTensor {
                        dtype: HostDType::F32,
                        shape: &shape,
                        bytes: &bytes,
                    },
                )
            }
            _ => be.random_vector(name, len, seed, mean, std),
        })
    }

    /// Each rank's rows and columns of the packed weight, in groups that each lie within one
    /// of the whole weight's ([`Shard::quant_group`]); the columns a rank holds but does not
    /// count get a zero scale.
    fn upload_quantized(&self, name: &str, q: QuantMatrix<'_>) -> BResult<Self::Matrix> {
        self.check_weight(name)?;
        q.check(name)?;
        let split = self.matrix_split(name);
        let parts = self.each(|r, be| match self.shard(name, r) {
            Some(part) => {
                let g = part.quant_group(q.group);
                let (cols, width) = (&part.cols, q.cols / 8);
                if part.rows.end > q.rows || cols.end > q.cols {
                    return Err(err(format!("weight {name}: not of the model's shape")));
                }
                if !cols.start.is_multiple_of(8) || !cols.len().is_multiple_of(8) {
                    return Err(err(format!(
                        "4-bit weight {name}: columns {cols:?} are not whole words of 8"
                    )));
                }
                let words: Vec<u32> = part
                    .rows
                    .clone()
                    .flat_map(|o| &q.words[o * width + cols.start / 8..o * width + cols.end / 8])
                    .copied()
                    .collect();
                let groups = q.cols / q.group;
                let (mut scales, mut zeros) = (Vec::new(), Vec::new());
                for o in part.rows.clone() {
                    for c in cols.clone().step_by(g) {
                        let at = o * groups + c / q.group;
                        let counted = part.own_cols.as_ref().is_none_or(|own| own.contains(&c));
                        scales.push(if counted { q.scales[at] } else { 0.0 });
                        zeros.push(q.zeros[at]);
                    }
                }
                be.upload_quantized(
                    name,
                    QuantMatrix {
                        rows: part.rows.len(),
                        cols: cols.len(),
                        group: g,
                        words: &words,
                        scales: &scales,
                        zeros: &zeros,
                    },
                )
            }
            _ => be.upload_quantized(name, q),
        })?;
        let pieces = vec![self.rank_rows(name, q.rows)];
        Ok(RankMatrix {
            parts,
            split,
            pieces,
        })
    }

    fn upload_fp8(&self, name: &str, m: Fp8Matrix<'_>) -> BResult<Self::Matrix> {
        self.check_weight(name)?;
        let split = self.matrix_split(name);
        let parts = self.each(|r, be| match self.shard(name, r) {
            Some(part) => {
                if part.rows.end > m.rows || part.cols.end > m.cols {
                    return Err(err(format!("weight {name}: not of the model's shape")));
                }
                let codes = cut_bytes(
                    m.codes,
                    1,
                    m.cols,
                    &part.rows,
                    &part.cols,
                    part.own_cols.as_ref(),
                );
                // Each output row keeps its scale: a part of its inputs is scaled alike.
                be.upload_fp8(
                    name,
                    Fp8Matrix {
                        rows: part.rows.len(),
                        cols: part.cols.len(),
                        codes: &codes,
                        scales: &m.scales[part.rows.clone()],
                    },
                )
            }
            _ => be.upload_fp8(name, m),
        })?;
        let pieces = vec![self.rank_rows(name, m.rows)];
        Ok(RankMatrix {
            parts,
            split,
            pieces,
        })
    }

    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<Self::Act> {
        Ok(RankAct {
            parts: self.each(|_, be| be.alloc(max_rows, cols))?,
            split: Split::Whole,
            cols,
            width: cols,
            rows: max_rows,
        })
    }

    /// Each rank's part as wide as the widest layer it serves: the attention buffers of a
    /// sparse layer past its KV heads hold a whole KV group on each rank.
    fn alloc_split(&self, buffer: &str, max_rows: usize, cols: usize) -> BResult<Self::Act> {
        let ways = self.tp.buffer_ways(&self.config, buffer);
        if !cols.is_multiple_of(ways) {
            return Err(err(format!("{cols} columns do not split {ways} ways")));
        }
        self.grow_sums(max_rows)?;
        let width = cols / ways;
        Ok(RankAct {
            parts: self.each(|_, be| be.alloc_split(buffer, max_rows, width))?,
            split: Split::Columns,
            cols,
            width,
            rows: max_rows,
        })
    }

    fn set_rows(&self, a: &mut Self::Act, rows: usize) {
        for (be, p) in self.ranks.iter().zip(&mut a.parts) {
            be.set_rows(p, rows);
        }
        a.rows = rows;
    }

    fn copy_rows(
        &self,
        src: &Self::Act,
        src_row: usize,
        dst: &mut Self::Act,
        dst_row: usize,
        n: usize,
    ) -> BResult<()> {
        if src.split != dst.split {
            return Err(err("a copy between whole rows and a rank's columns"));
        }
        // A rank's columns are as wide as the layer that last wrote them: the copy's too.
        self.set_width(dst, src.width)?;
        self.each(|r, be| be.copy_rows(&src.parts[r], src_row, &mut dst.parts[r], dst_row, n))?;
        Ok(())
    }

    fn move_rows(
        &self,
        a: &mut Self::Act,
        src_row: usize,
        dst_row: usize,
        n: usize,
    ) -> BResult<()> {
        self.each(|r, be| be.move_rows(&mut a.parts[r], src_row, dst_row, n))?;
        Ok(())
    }

    fn new_lightning_state(&self, heads: usize, head_dim: usize) -> BResult<Self::LightningState> {
        let n = self.ranks.len();
        if !heads.is_multiple_of(n) {
            return Err(err(format!(
                "{heads} lightning heads do not split into {n} ranks"
            )));
        }
        self.each(|_, be| be.new_lightning_state(heads / n, head_dim))
    }

    fn new_sparse_cache(&self, shape: AttnShape, cfg: &SparseConfig) -> BResult<Self::SparseCache> {
        let shape = self.rank_shape(shape)?;
        self.each(|_, be| be.new_sparse_cache(shape, cfg))
    }

    fn reserve_sparse_cache(
        &self,
        cache: &mut Self::SparseCache,
        cfg: &SparseConfig,
        tokens: usize,
    ) -> BResult<()> {
        self.each(|r, be| be.reserve_sparse_cache(&mut cache[r], cfg, tokens))?;
        Ok(())
    }

    fn fill_sparse_cache_random(
        &self,
        cache: &mut Self::SparseCache,
        cfg: &SparseConfig,
        tokens: usize,
        seed: u64,
    ) -> BResult<()> {
        let seed = |r: usize| seed ^ ((r as u64) << 40);
        self.each(|r, be| be.fill_sparse_cache_random(&mut cache[r], cfg, tokens, seed(r)))?;
        Ok(())
    }

    fn fill_lightning_state_random(
        &self,
        state: &mut Self::LightningState,
        seed: u64,
    ) -> BResult<()> {
        let seed = |r: usize| seed ^ ((r as u64) << 40);
        self.each(|r, be| be.fill_lightning_state_random(&mut state[r], seed(r)))?;
        Ok(())
    }

    fn copy_lightning_state(
        &self,
        src: &Self::LightningState,
        dst: &mut Self::LightningState,
    ) -> BResult<()> {
        self.each(|r, be| be.copy_lightning_state(&src[r], &mut dst[r]))?;
        Ok(())
    }

    fn copy_sparse_cache(
        &self,
        src: &Self::SparseCache,
        dst: &mut Self::SparseCache,
    ) -> BResult<()> {
        self.each(|r, be| be.copy_sparse_cache(&src[r], &mut dst[r]))?;
        Ok(())
    }

    fn truncate_sparse_cache(
        &self,
        cache: &mut Self::SparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        self.each(|r, be| be.truncate_sparse_cache(&mut cache[r], cfg, len))?;
        Ok(())
    }

    fn shares_cache_prefixes(&self) -> bool {
        self.ranks.iter().all(|be| be.shares_cache_prefixes())
    }

    fn share_sparse_cache(
        &self,
        src: &Self::SparseCache,
        dst: &mut Self::SparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        self.each(|r, be| be.share_sparse_cache(&src[r], &mut dst[r], cfg, len))?;
        Ok(())
    }

    /// Every rank begins the step with its graphs held (no capture opens while another rank
    /// still prepares its step), then, where the ranks would launch it differently (one
    /// replays what another has to capture), every rank forgets its graphs and runs it
    /// eagerly: a rank's collectives must be in graphs exactly when every rank's are.
    fn begin_step(&self, step: &StepInfo<'_>) -> BResult<()> {
        self.graphs_held(|| {
            self.each(|_, be| be.begin_step(step))?;
            let first = self.ranks[0].step_launches();
            if self.ranks.iter().any(|be| be.step_launches() != first) {
                for be in &self.ranks {
                    be.end_step(false)?;
                    be.forget_graphs();
                }
                let eager = StepInfo {
                    eager: true,
                    ..*step
                };
                self.each(|_, be| be.begin_step(&eager))?;
            }
            Ok(())
        })
    }

    /// Ends the step on every rank, whatever one of them says.
    fn end_step(&self, ok: bool) -> BResult<()> {
        let ends: Vec<BResult<()>> = self.ranks.iter().map(|be| be.end_step(ok)).collect();
        ends.into_iter().collect()
    }

    fn embed(
        &self,
        table: &Self::Matrix,
        ids: &[u32],
        scale: f32,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.each(|r, be| be.embed(&table.parts[r], ids, scale, &mut out.parts[r]))?;
        out.split = Split::Whole;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.check_whole("a norm", x)?;
        self.each(|r, be| be.rms_norm(&x.parts[r], &w[r], eps, &mut out.parts[r]))?;
        Ok(())
    }

    fn matmul(&self, x: &Self::Act, w: &Self::Matrix, out: &mut Self::Act) -> BResult<()> {
        let (input, output) = match w.split {
            MatrixSplit::Whole => (Split::Whole, Split::Whole),
            MatrixSplit::Rows => (Split::Whole, Split::Columns),
            MatrixSplit::Columns => (Split::Columns, Split::Whole),
        };
        if x.split != input {
            return Err(err(format!(
                "a product of a weight split as {:?} takes {input:?} inputs, got {:?}",
                w.split, x.split
            )));
        }
        self.set_width(out, w.pieces.iter().sum())?;
        self.each(|r, be| be.matmul(&x.parts[r], &w.parts[r], &mut out.parts[r]))?;
        if w.split == MatrixSplit::Columns {
            let mut parts: Vec<&mut B::Act> = out.parts.iter_mut().collect();
            self.collective.sum_acts(&self.ranks, &mut parts)?;
        }
        out.split = output;
        Ok(())
    }

    fn concat_rows(&self, parts: Vec<Self::Matrix>) -> BResult<Self::Matrix> {
        let split = parts.first().map_or(MatrixSplit::Whole, |p| p.split);
        if parts.iter().any(|p| p.split != split) {
            return Err(err("stacked weights split in different ways"));
        }
        let mut per_rank: Vec<Vec<B::Matrix>> = self.ranks.iter().map(|_| Vec::new()).collect();
        let mut pieces = Vec::new();
        for p in parts {
            pieces.extend(p.pieces);
            for (r, m) in p.parts.into_iter().enumerate() {
                per_rank[r].push(m);
            }
        }
        let parts = self
            .ranks
            .iter()
            .zip(per_rank)
            .map(|(be, ms)| be.concat_rows(ms))
            .collect::<BResult<_>>()?;
        Ok(RankMatrix {
            parts,
            split,
            pieces,
        })
    }

    fn matmul_split(
        &self,
        x: &Self::Act,
        w: &Self::Matrix,
        outs: &mut [&mut Self::Act],
    ) -> BResult<()> {
        let output = match w.split {
            MatrixSplit::Whole => Split::Whole,
            MatrixSplit::Rows => Split::Columns,
            MatrixSplit::Columns => return Err(err("a stacked product of input-split weights")),
        };
        self.check_whole("a stacked product", x)?;
        if outs.len() != w.pieces.len() {
            return Err(err(format!(
                "a product of {} stacked weights into {} outputs",
                w.pieces.len(),
                outs.len()
            )));
        }
        for (o, &width) in outs.iter_mut().zip(&w.pieces) {
            self.set_width(o, width)?;
        }
        for r in 0..self.ranks.len() {
            self.ranks[r].matmul_split(&x.parts[r], &w.parts[r], &mut parts_mut(outs, r))?;
        }
        for o in outs.iter_mut() {
            o.split = output;
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &mut Self::Act, up: &Self::Act) -> BResult<()> {
        self.each(|r, be| be.silu_mul(&mut gate.parts[r], &up.parts[r]))?;
        Ok(())
    }

    fn silu_mul_halves(&self, gu: &Self::Act, out: &mut Self::Act) -> BResult<()> {
        self.each(|r, be| be.silu_mul_halves(&gu.parts[r], &mut out.parts[r]))?;
        out.split = gu.split;
        Ok(())
    }

    fn matmul_silu(
        &self,
        x: &Self::Act,
        w: &Self::Matrix,
        gu: &mut Self::Act,
        out: &mut Self::Act,
    ) -> BResult<()> {
        let output = match w.split {
            MatrixSplit::Whole => Split::Whole,
            MatrixSplit::Rows => Split::Columns,
            MatrixSplit::Columns => return Err(err("an MLP product of input-split weights")),
        };
        self.check_whole("the MLP's first product", x)?;
        let width: usize = w.pieces.iter().sum();
        self.set_width(gu, width)?;
        self.set_width(out, width / 2)?;
        self.each(|r, be| {
            be.matmul_silu(
                &x.parts[r],
                &w.parts[r],
                &mut gu.parts[r],
                &mut out.parts[r],
            )
        })?;
        gu.split = output;
        out.split = output;
        Ok(())
    }

    fn add_scaled(&self, h: &mut Self::Act, branch: &Self::Act, scale: f32) -> BResult<()> {
        self.each(|r, be| be.add_scaled(&mut h.parts[r], &branch.parts[r], scale))?;
        Ok(())
    }

    fn add_scaled_norm(
        &self,
        h: &mut Self::Act,
        branch: &Self::Act,
        scale: f32,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) -> BResult<()> {
        self.check_whole("a residual add and norm", branch)?;
        self.each(|r, be| {
            be.add_scaled_norm(
                &mut h.parts[r],
                &branch.parts[r],
                scale,
                &w[r],
                eps,
                &mut out.parts[r],
            )
        })?;
        out.split = Split::Whole;
        Ok(())
    }

    fn sigmoid_gate(&self, x: &mut Self::Act, gate: &Self::Act) -> BResult<()> {
        self.each(|r, be| be.sigmoid_gate(&mut x.parts[r], &gate.parts[r]))?;
        Ok(())
    }

    /// Whole rows: each rank's norm. A rank's columns (the lightning output norm, one norm
    /// over every head): each rank's sums of squares, added across the ranks, then each
    /// rank's columns normed with the whole row's mean square.
    fn rms_norm_gate(
        &self,
        x: &Self::Act,
        w: &Self::Vector,
        eps: f32,
        gate: Option<&Self::Act>,
        out: &mut Self::Act,
    ) -> BResult<()> {
        if x.split == Split::Whole {
            self.each(|r, be| {
                be.rms_norm_gate(
                    &x.parts[r],
                    &w[r],
                    eps,
                    gate.map(|g| &g.parts[r]),
                    &mut out.parts[r],
                )
            })?;
            out.split = Split::Whole;
            return Ok(());
        }
        self.grow_sums(x.rows)?;
        let mut sums = self.sums.borrow_mut();
        for (r, be) in self.ranks.iter().enumerate() {
            be.row_sums_of_squares(&x.parts[r], &mut sums[r].1)?;
        }
        let mut tables: Vec<&mut B::Table> = sums.iter_mut().map(|(_, t)| t).collect();
        self.collective
            .sum_tables(&self.ranks, &mut tables, x.rows)?;
        for (r, be) in self.ranks.iter().enumerate() {
            be.rms_norm_gate_with_sums(
                &x.parts[r],
                &sums[r].1,
                x.cols,
                &w[r],
                eps,
                gate.map(|g| &g.parts[r]),
                &mut out.parts[r],
            )?;
        }
        out.split = Split::Columns;
        Ok(())
    }

    fn rope(
        &self,
        head_dim: usize,
        inv_freq: &Self::Table,
        spans: &[Span],
        q: &mut Self::Act,
        k: &mut Self::Act,
    ) -> BResult<()> {
        self.each(|r, be| {
            be.rope(
                head_dim,
                &inv_freq.whole[r],
                spans,
                &mut q.parts[r],
                &mut k.parts[r],
            )
        })?;
        Ok(())
    }

    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        norms: Option<(&Self::Vector, &Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        mut io: AttnIo<'_, Self::Act>,
        spans: &[Span],
        states: &mut [&mut Self::LightningState],
    ) -> BResult<()> {
        let shape = self.rank_shape(shape)?;
        let slopes = slopes.heads()?;
        self.set_width(io.out, shape.q_width())?;
        for (r, be) in self.ranks.iter().enumerate() {
            let io = rank_io(&mut io, r);
            let mut st: Vec<&mut B::LightningState> =
                states.iter_mut().map(|s| &mut s[r]).collect();
            be.lightning(
                shape,
                &slopes[r],
                norms.map(|(q, k, eps)| (&q[r], &k[r], eps)),
                inv_freq.map(|t| &t.whole[r]),
                io,
                spans,
                &mut st,
            )?;
        }
        io.out.split = Split::Columns;
        Ok(())
    }

    fn lightning_replay(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        k_norm: Option<(&Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        (k, v, rows): (&Self::Act, &Self::Act, usize),
        pos: usize,
        state: &mut Self::LightningState,
    ) -> BResult<()> {
        let shape = self.rank_shape(shape)?;
        let slopes = slopes.heads()?;
        self.each(|r, be| {
            be.lightning_replay(
                shape,
                &slopes[r],
                k_norm.map(|(w, eps)| (&w[r], eps)),
                inv_freq.map(|t| &t.whole[r]),
                (&k.parts[r], &v.parts[r], rows),
                pos,
                &mut state[r],
            )
        })?;
        Ok(())
    }

    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mut io: AttnIo<'_, Self::Act>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut Self::SparseCache],
    ) -> BResult<()> {
        let shape = self.rank_shape(shape)?;
        self.set_width(io.out, shape.q_width())?;
        // Outside graphs on every rank (a backend runs it eagerly: the caches' lengths move).
        self.graphs_held(|| {
            for (r, be) in self.ranks.iter().enumerate() {
                let io = rank_io(&mut io, r);
                let mut cs: Vec<&mut B::SparseCache> =
                    caches.iter_mut().map(|c| &mut c[r]).collect();
                be.sparse_attention(shape, cfg, io, spans, modes, &mut cs)?;
            }
            Ok(())
        })?;
        io.out.split = Split::Columns;
        Ok(())
    }

    fn lightning_state_advance(
        &self,
        slopes: &Self::Table,
        head_dim: usize,
        tokens: usize,
        prev: &Self::LightningState,
        state: &mut Self::LightningState,
    ) -> BResult<()> {
        let slopes = slopes.heads()?;
        self.each(|r, be| {
            be.lightning_state_advance(&slopes[r], head_dim, tokens, &prev[r], &mut state[r])
        })?;
        Ok(())
    }

    fn lightning_state_term(
        &self,
        shape: AttnShape,
        slopes: &Self::Table,
        q_norm: Option<(&Self::Vector, f32)>,
        inv_freq: Option<&Self::Table>,
        state: &Self::LightningState,
        (q, pos): (&mut Self::Act, usize),
        out: &mut Self::Act,
    ) -> BResult<()> {
        let shape = self.rank_shape(shape)?;
        let slopes = slopes.heads()?;
        if q.split != Split::Columns || out.split != Split::Columns {
            return Err(err(
                "the lightning start-state term takes each rank's heads",
            ));
        }
        self.each(|r, be| {
            be.lightning_state_term(
                shape,
                &slopes[r],
                q_norm.map(|(w, eps)| (&w[r], eps)),
                inv_freq.map(|t| &t.whole[r]),
                &state[r],
                (&mut q.parts[r], pos),
                &mut out.parts[r],
            )
        })?;
        Ok(())
    }

    /// Each rank's cache takes its KV heads' columns (the keys and values its projections
    /// made).
    fn append_sparse_kv(
        &self,
        cache: &mut Self::SparseCache,
        cfg: &SparseConfig,
        k: &Self::Act,
        v: &Self::Act,
        rows: std::ops::Range<usize>,
    ) -> BResult<()> {
        if k.split != Split::Columns || v.split != Split::Columns {
            return Err(err(
                "keys and values appended to a cache come as each rank's KV heads",
            ));
        }
        self.each(|r, be| {
            be.append_sparse_kv(&mut cache[r], cfg, &k.parts[r], &v.parts[r], rows.clone())
        })?;
        Ok(())
    }

    /// Rank 0's: every rank holds the final hidden states and lm_head whole.
    fn logits(
        &self,
        h: &Self::Act,
        rows: &[usize],
        keep: &[bool],
        lm_head: &Self::Matrix,
        divisor: f32,
    ) -> BResult<LogitsOut> {
        self.check_whole("the logits", h)?;
        if lm_head.split != MatrixSplit::Whole {
            return Err(err("lm_head is held whole by every rank"));
        }
        // Rank 0 waits for its logits: every rank's graphs are launched first.
        self.graphs_held(|| {
            self.ranks[0].logits(&h.parts[0], rows, keep, &lm_head.parts[0], divisor)
        })
    }

    /// Whole rows: rank 0's. A rank's columns: every rank's, put side by side (an error for
    /// the parts of a sparse layer past its KV heads, which ranks share).
    fn to_host(&self, a: &Self::Act) -> BResult<Vec<f32>> {
        self.graphs_held(|| self.to_host_held(a))
    }
}

impl<B: Backend> Ranks<B> {
    /// [`Backend::to_host`] with every rank's graphs held.
    fn to_host_held(&self, a: &RankAct<B::Act>) -> BResult<Vec<f32>> {
        if a.split == Split::Whole {
            return self.ranks[0].to_host(&a.parts[0]);
        }
        let each = a.width;
        if each * self.ranks.len() != a.cols {
            return Err(err(
                "this activation's columns are held by groups of ranks, not split among them",
            ));
        }
        let parts = self.each(|r, be| be.to_host(&a.parts[r]))?;
        let mut out = Vec::with_capacity(a.rows * a.cols);
        for row in 0..a.rows {
            for p in &parts {
                out.extend_from_slice(
                    p.get(row * each..(row + 1) * each).ok_or_else(|| {
                        err("a rank's activation holds fewer rows than the whole")
                    })?,
                );
            }
        }
        Ok(out)
    }
}
