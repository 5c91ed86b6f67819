//! Context parallelism: one long prompt read by several ranks at once, each taking a
//! contiguous, block-aligned range of its tokens ([`prompt_ranges`]) and
//! holding the whole model. Layer by layer every rank projects its own rows, in chunks of its
//! workspace's rows (a step each), keeping of its range only what the layer's second pass
//! needs ([`range_bytes`]); the lightning layers read each range from a zero state, then scan
//! the ranges' end states in order ([`Backend::lightning_state_advance`]: the state before
//! each range) and add to each chunk's outputs the term of the state before it (the range's
//! start state moved along the chunks; [`Backend::lightning_state_term`]); the sparse layers
//! give each rank the earlier ranks' keys and values ([`Backend::append_sparse_kv`]) before it
//! attends its own rows, so block selection and attention see the whole prefix. The first
//! rank, whose start is the prompt's, finishes each chunk in the first pass. Each rank ends
//! holding the prompt up to its range's end,
//! the last one the whole prompt (every cache and the lightning states after it): decode
//! continues there. [`ContextRead`] runs the same a stage (a chunk of each range through one
//! pass) at a time.

use crate::backend::{AttnIo, BResult, Backend, BackendError, Span, StepInfo};
use crate::model::{state_mismatch, LayerState, LogitRows, Model, SeqState, Workspace};
use crate::oracle::SparseMode;
use crate::parallel::balanced_context_ranges;
use sala_checkpoint::{MixerKind, ModelConfig};
use std::ops::Range;

/// What moves between context-parallel ranks: activations (keys and values of earlier
/// ranks) and lightning states (the scan).
pub trait Exchange<B: Backend> {
    /// Copies the first `rows` rows of `src` (on `from`) over the first rows of `dst` (on
    /// `to`, as wide).
    fn copy_act(
        &self,
        from: &B,
        src: &B::Act,
        to: &B,
        dst: &mut B::Act,
        rows: usize,
    ) -> BResult<()>;
    /// Makes `dst` (on `to`) hold what `src` (on `from`) holds.
    fn copy_state(
        &self,
        from: &B,
        src: &B::LightningState,
        to: &B,
        dst: &mut B::LightningState,
    ) -> BResult<()>;
    /// Whether the ranks share one memory (simulated ranks in one process's memory).
    fn one_memory(&self) -> bool {
        false
    }
}

/// One rank of a context-parallel prefill: its backend, its copy of the model, a workspace
/// of at least its range's rows, and a new sequence.
pub struct ContextRank<'a, B: Backend> {
    pub be: &'a B,
    pub model: &'a Model<B>,
    pub ws: &'a mut Workspace<B>,
    pub seq: &'a mut SeqState<B>,
}

impl<'a, B: Backend> ContextRank<'a, B> {
    /// Ranks from lists in rank order: each backend with its model, workspace and sequence.
    pub fn zip(
        bes: impl IntoIterator<Item = &'a B>,
        models: &'a [Model<B>],
        wss: &'a mut [Workspace<B>],
        seqs: &'a mut [SeqState<B>],
    ) -> Vec<Self> {
        bes.into_iter()
            .zip(models)
            .zip(wss.iter_mut().zip(seqs.iter_mut()))
            .map(|((be, model), (ws, seq))| ContextRank { be, model, ws, seq })
            .collect()
    }
}

/// What a context-parallel prefill leaves: which rank holds the whole prompt (the last one
/// with tokens), the ranges read, and the last token's logits.
#[derive(Debug)]
pub struct ContextPrefill {
    pub last: usize,
    pub ranges: Vec<Range<usize>>,
    pub logits: Vec<f32>,
}

/// The share of a 1M-token prefill's time that grows with the position, on the H200 (issue
/// 17's profile, BENCHMARKS.md): block selection scores each query against every compressed
/// key before it, ~13 ms a sparse layer for an 8K chunk at 1M, so ~6.7 s of the 53 s; the
/// products, the attention over the selected blocks and the lightning layers cost the same at
/// every position.
const POSITION_SHARE_AT_1M: f64 = 0.13;

/// The ranges context parallelism reads a prompt of `len` tokens in, over `ranks` ranks:
/// block-aligned, of equal modeled time ([`balanced_context_ranges`]), the position-bound
/// share (block selection, past `dense_len`) growing with the prompt's length.
pub fn prompt_ranges(c: &ModelConfig, len: usize, ranks: usize) -> Vec<Range<usize>> {
    let share = if len > c.sparse.dense_len {
        let r =
            POSITION_SHARE_AT_1M / (1.0 - POSITION_SHARE_AT_1M) * len as f64 / (1u64 << 20) as f64;
        r / (1.0 + r)
    } else {
        0.0
    };
    balanced_context_ranges(len, ranks, c.sparse.block_size, share)
}

/// Bytes a rank holds beside its model, caches and chunk workspace while it reads a range of
/// `rows` tokens ([`prefill`]): its range's residual stream, queries, outputs, gates, keys
/// and values (values of `value_bytes`), what it receives (the widest range's keys and values
/// from earlier ranks, `rows` here) and three lightning states.
pub fn range_bytes(c: &ModelConfig, rows: usize, value_bytes: usize) -> usize {
    let hd = c.num_attention_heads * c.head_dim;
    let cols = c.hidden_size + 3 * hd + 4 * c.kv_dim();
    rows * cols * value_bytes + 3 * c.num_attention_heads * c.head_dim.pow(2) * 4
}

/// Prefills `tokens` (the whole prompt of new sequences) over `ranks`, each reading its
/// range in chunks of its workspace's rows; see the module's docs. A prompt of fewer blocks
/// than ranks leaves the later ranks idle.
pub fn prefill<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    tokens: &[u32],
) -> BResult<ContextPrefill> {
    let mode = ranks
        .first()
        .map_or(SparseMode::Dense, |r| r.model.sparse_mode(tokens.len()));
    let mut read = ContextRead::new(ranks, tokens, mode, true)?;
    while !read.is_done() {
        read.advance(ranks, exchange)?;
    }
    let last = read.finish(ranks)?;
    let ranges = read.ranges().to_vec();
    // The last rank's last chunk was the last one read: its final norm is in `ws.a`.
    let rank = &ranks[last];
    let m = rank.model;
    let head = m.lm_head.as_ref().unwrap_or(&m.embed);
    let n = (ranges[last].len() - 1) % rank.ws.max_rows + 1;
    let out = rank.be.logits(
        &rank.ws.a,
        &[n - 1],
        &[true],
        head,
        m.config.logit_divisor() as f32,
    )?;
    Ok(ContextPrefill {
        last,
        ranges,
        logits: out.rows,
    })
}

/// A context-parallel read of a prompt in progress ([`prefill`] a stage at a time): a stage
/// is one chunk of every rank's range through one pass (the embedding; a layer's first pass;
/// its second, on the ranks after the first), one call of [`ContextRead::advance`], so that
/// other work (another request's step) may run on the ranks between stages. A rank's own ops
/// run in its chunks' order within each pass, as reading its range alone would run them. It
/// holds what each rank keeps of its range;
/// the ranks themselves are lent to each call, the same ones in the same order every time.
pub struct ContextRead<B: Backend> {
    tokens: Vec<u32>,
    mode: SparseMode,
    ranges: Vec<Range<usize>>,
    parts: Vec<Part<B>>,
    received: Vec<Received<B>>,
    /// Each rank's chunk rows (its workspace's).
    rows: Vec<usize>,
    next: Stage,
    layers: usize,
    /// Whether nothing else runs on the ranks' workspaces between stages (a layer may then
    /// go on from the rows the last one left there).
    kept: bool,
}

impl<B: Backend> ContextRead<B> {
    /// A read of `tokens` (the whole prompt of new sequences, or the first tokens of one whose
    /// sparse layers read with `mode`) over `ranks`; `kept`: see [`ContextRead::advance`].
    /// A prompt of fewer blocks than ranks leaves the later ranks idle.
    pub fn new(
        ranks: &[ContextRank<'_, B>],
        tokens: &[u32],
        mode: SparseMode,
        kept: bool,
    ) -> BResult<Self> {
        let model = ranks
            .first()
            .ok_or_else(|| BackendError("context parallelism needs at least one rank".into()))?
            .model;
        let c = &model.config;
        if tokens.is_empty() {
            return Err(BackendError("cannot prefill an empty prompt".into()));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(BackendError(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        let ranges = prompt_ranges(c, tokens.len(), ranks.len());
        let ranks = &ranks[..ranges.len()];
        for (r, rank) in ranks.iter().enumerate() {
            let fresh = rank.seq.pos == 0 && rank.seq.aux.is_none() && rank.seq.span_kv.is_none();
            if !fresh || rank.ws.max_rows == 0 {
                return Err(BackendError(format!(
                    "context parallelism: rank {r} needs a new sequence and a workspace"
                )));
            }
        }
        let parts = ranks
            .iter()
            .zip(&ranges)
            .map(|(rank, range)| Part::new(rank, range.clone()))
            .collect::<BResult<Vec<_>>>()?;
        let widest = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
        let received = ranks[1..]
            .iter()
            .map(|r| Received::new(r.be, c, widest))
            .collect::<BResult<Vec<_>>>()?;
        Ok(Self {
            tokens: tokens.to_vec(),
            mode,
            rows: ranks.iter().map(|r| r.ws.max_rows).collect(),
            ranges,
            parts,
            received,
            next: Stage {
                layer: 0,
                pass: Pass::First,
                chunk: 0,
            },
            layers: model.layers.len(),
            kept,
        })
    }

    /// The ranges the ranks read, in rank order (as many as the ranks with tokens).
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Whether every stage has run.
    pub fn is_done(&self) -> bool {
        self.next.layer > self.layers
    }

    /// The most chunks a rank's range takes, of every rank (`from` 0) or of the ranks after
    /// the first (`from` 1).
    fn chunks(&self, from: usize) -> usize {
        self.ranges
            .iter()
            .zip(&self.rows)
            .skip(from)
            .map(|(range, &rows)| range.len().div_ceil(rows))
            .max()
            .unwrap_or(0)
    }

    /// The stage after `s`.
    fn after(&self, s: Stage) -> Stage {
        let at = |layer, pass, chunk| Stage { layer, pass, chunk };
        match s.pass {
            Pass::First if s.chunk + 1 < self.chunks(0) => at(s.layer, Pass::First, s.chunk + 1),
            Pass::First if s.layer > 0 && self.ranges.len() > 1 => at(s.layer, Pass::Second, 0),
            Pass::Second if s.chunk + 1 < self.chunks(1) => at(s.layer, Pass::Second, s.chunk + 1),
            _ => at(s.layer + 1, Pass::First, 0),
        }
    }

    /// Runs the next stage over `ranks`. Where the read is not `kept`, each stage loads its
    /// rows from what the ranks keep, whatever the workspaces hold.
    pub fn advance(
        &mut self,
        ranks: &mut [ContextRank<'_, B>],
        exchange: &dyn Exchange<B>,
    ) -> BResult<()> {
        if self.is_done() {
            return Err(BackendError(
                "context parallelism: the read is done already".into(),
            ));
        }
        let ranks = self.lent(ranks)?;
        if ranks
            .iter()
            .zip(&self.rows)
            .any(|(r, &rows)| r.ws.max_rows != rows)
        {
            return Err(BackendError(
                "context parallelism: a rank's workspace changed during the read".into(),
            ));
        }
        let run = Run {
            tokens: &self.tokens,
            mode: self.mode,
            last_rank: ranks.len() - 1,
            kept: self.kept,
        };
        let (parts, received) = (&mut self.parts, &mut self.received);
        let Stage { layer, pass, chunk } = self.next;
        let kind = layer
            .checked_sub(1)
            .map(|i| (i, ranks[0].model.config.mixer_types[i]));
        match (kind, pass) {
            (None, _) => embed(&run, ranks, parts, chunk)?,
            (Some((i, MixerKind::Lightning)), Pass::First) => {
                lightning_first(&run, ranks, parts, i, chunk)?
            }
            (Some((i, MixerKind::Lightning)), Pass::Second) => {
                if chunk == 0 {
                    lightning_scan(ranks, parts, exchange, i, received)?;
                }
                lightning_second(&run, ranks, parts, i, chunk, received)?
            }
            (Some((i, MixerKind::Sparse)), Pass::First) => {
                sparse_first(&run, ranks, parts, i, chunk)?
            }
            (Some((i, MixerKind::Sparse)), Pass::Second) => {
                sparse_second(&run, ranks, parts, exchange, i, chunk, received)?
            }
        }
        self.next = self.after(self.next);
        Ok(())
    }

    /// Ends a read that [`ContextRead::is_done`]: each rank's sequence then holds the prompt
    /// up to its range's end. Returns the rank holding the whole (the last with a range).
    pub fn finish(&self, ranks: &mut [ContextRank<'_, B>]) -> BResult<usize> {
        if !self.is_done() {
            return Err(BackendError(format!(
                "context parallelism: the read is at layer {} of {}",
                self.next.layer, self.layers
            )));
        }
        let ranks = self.lent(ranks)?;
        for (rank, range) in ranks.iter_mut().zip(&self.ranges) {
            rank.seq.pos = range.end;
        }
        Ok(self.ranges.len() - 1)
    }

    /// The ranks with tokens among `ranks`, which must be those the read began with.
    fn lent<'r, 'a>(
        &self,
        ranks: &'r mut [ContextRank<'a, B>],
    ) -> BResult<&'r mut [ContextRank<'a, B>]> {
        if ranks.len() < self.ranges.len() {
            return Err(BackendError(format!(
                "context parallelism: {} ranks lent to a read over {}",
                ranks.len(),
                self.ranges.len()
            )));
        }
        Ok(&mut ranks[..self.ranges.len()])
    }
}

/// A pass of [`ContextRead`]: a layer's first (every rank, from a zero state or without the
/// earlier ranks' keys) or second (the ranks after the first, given the earlier ranks' share).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    First,
    Second,
}

/// A stage of [`ContextRead`]: chunk `chunk` of every rank's range through `pass` of layer
/// `layer − 1` (layer 0: the embedding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stage {
    layer: usize,
    pass: Pass,
    chunk: usize,
}

/// What a rank keeps of its whole range between the layers' passes over its chunks: the
/// residual stream, and a layer's queries, gates, raw keys and values (sparse) or outputs from
/// a zero state (lightning) until the earlier ranks' share is known.
struct Part<B: Backend> {
    range: Range<usize>,
    h: B::Act,
    q: B::Act,
    o: B::Act,
    z: B::Act,
    k: B::Act,
    v: B::Act,
}

impl<B: Backend> Part<B> {
    fn new(rank: &ContextRank<'_, B>, range: Range<usize>) -> BResult<Self> {
        let (be, c) = (rank.be, &rank.model.config);
        let (rows, hd) = (range.len(), c.num_attention_heads * c.head_dim);
        // The residual stream whole, the others named as the workspace buffers they keep
        // rows of (a tensor-parallel backend splits them alike).
        Ok(Self {
            h: be.alloc(rows, c.hidden_size)?,
            q: be.alloc_split("q", rows, hd)?,
            o: be.alloc_split("o", rows, hd)?,
            z: be.alloc_split("z", rows, hd)?,
            k: be.alloc_split("ks", rows, c.kv_dim())?,
            v: be.alloc_split("vs", rows, c.kv_dim())?,
            range,
        })
    }

    /// The range's chunks of at most `rows` rows, as rows of the range.
    fn chunks(&self, rows: usize) -> Vec<Range<usize>> {
        let n = self.range.len();
        (0..n)
            .step_by(rows.max(1))
            .map(|a| a..(a + rows).min(n))
            .collect()
    }

    /// A chunk's positions in the prompt.
    fn at(&self, ch: &Range<usize>) -> Range<usize> {
        self.range.start + ch.start..self.range.start + ch.end
    }
}

/// A rank's buffers for what it receives: the state its range starts from (lightning; with a
/// running copy and a zero state for moving it along the chunks), the earlier ranks' keys and
/// values (sparse).
struct Received<B: Backend> {
    start: B::LightningState,
    next: B::LightningState,
    zero: B::LightningState,
    k: B::Act,
    v: B::Act,
}

impl<B: Backend> Received<B> {
    fn new(be: &B, c: &ModelConfig, widest: usize) -> BResult<Self> {
        let state = || be.new_lightning_state(c.num_attention_heads, c.head_dim);
        Ok(Self {
            start: state()?,
            next: state()?,
            zero: state()?,
            k: be.alloc_split("ks", widest, c.kv_dim())?,
            v: be.alloc_split("vs", widest, c.kv_dim())?,
        })
    }
}

/// The prefill's constants.
struct Run<'t> {
    tokens: &'t [u32],
    mode: SparseMode,
    last_rank: usize,
    /// [`ContextRead`]'s `kept`.
    kept: bool,
}

impl Run<'_> {
    /// `f` over chunk `ch` of rank `r`'s range, as a step of the chunk's rows begun and ended
    /// on the rank's backend (every workspace buffer holding that many rows).
    fn in_step<B: Backend, T>(
        &self,
        r: usize,
        rank: &mut ContextRank<'_, B>,
        part: &mut Part<B>,
        ch: &Range<usize>,
        f: impl FnOnce(&B, &Model<B>, &mut Workspace<B>, &mut SeqState<B>, &mut Part<B>) -> BResult<T>,
    ) -> BResult<T> {
        let be = rank.be;
        let at = part.at(ch);
        let span = span_of(part, ch);
        let last = r == self.last_rank && at.end == self.tokens.len();
        be.begin_step(&StepInfo {
            tokens: &self.tokens[at],
            spans: std::slice::from_ref(&span),
            seq_ids: &[rank.seq.id],
            logits: &[if last {
                LogitRows::Last
            } else {
                LogitRows::None
            }],
            aux_rows: &[],
            eager: true,
            tokens_picked: false,
            picks_later: false,
        })?;
        for buf in rank.ws.buffers_mut() {
            be.set_rows(buf, ch.len());
        }
        let out = f(be, rank.model, rank.ws, rank.seq, part);
        let ended = be.end_step(out.is_ok());
        let out = out?;
        ended?;
        Ok(out)
    }
}

/// A chunk's span within its step.
fn span_of<B: Backend>(part: &Part<B>, ch: &Range<usize>) -> Span {
    Span {
        first_row: 0,
        len: ch.len(),
        pos: part.range.start + ch.start,
    }
}

/// Layer `i`'s input for chunk `ch`: its residual rows, normed. A range read in one chunk
/// has them in the workspace already past the first layer where it is `kept` (the last
/// layer's finish left its residual rows and their norm there, as a one-device prefill goes
/// on from them).
fn load_input<B: Backend>(
    be: &B,
    m: &Model<B>,
    i: usize,
    ws: &mut Workspace<B>,
    part: &Part<B>,
    ch: &Range<usize>,
    kept: bool,
) -> BResult<()> {
    if kept && i > 0 && ch.len() == part.range.len() {
        return Ok(());
    }
    take(be, &part.h, &mut ws.h, ch)?;
    be.rms_norm(
        &ws.h,
        &m.layers[i].input_norm,
        m.config.rms_norm_eps as f32,
        &mut ws.a,
    )
}

/// The rest of layer `i` for chunk `ch` (its attention output in `ws.o`), its residual rows
/// written back.
fn finish_chunk<B: Backend>(
    be: &B,
    m: &Model<B>,
    i: usize,
    ws: &mut Workspace<B>,
    part: &mut Part<B>,
    ch: &Range<usize>,
) -> BResult<()> {
    let c = &m.config;
    let next_norm = m.layers.get(i + 1).map_or(&m.final_norm, |l| &l.input_norm);
    let (res, eps) = (c.residual_scale() as f32, c.rms_norm_eps as f32);
    m.layers[i].finish(m, be, ws, res, eps, next_norm)?;
    keep(be, &ws.h, &mut part.h, ch)
}

/// Keeps chunk `ch`'s rows of `src` in the range-wide `dst`.
fn keep<B: Backend>(be: &B, src: &B::Act, dst: &mut B::Act, ch: &Range<usize>) -> BResult<()> {
    be.copy_rows(src, 0, dst, ch.start, ch.len())
}

/// Takes chunk `ch`'s rows of the range-wide `src` into `dst`.
fn take<B: Backend>(be: &B, src: &B::Act, dst: &mut B::Act, ch: &Range<usize>) -> BResult<()> {
    be.copy_rows(src, ch.start, dst, 0, ch.len())
}

/// Chunk `c` of a rank's range (as rows of the range) and the range's chunk count, where it
/// has that many chunks.
fn chunk_of<B: Backend>(
    rank: &ContextRank<'_, B>,
    part: &Part<B>,
    c: usize,
) -> Option<(Range<usize>, usize)> {
    let chunks = part.chunks(rank.ws.max_rows);
    chunks.get(c).cloned().map(|ch| (ch, chunks.len()))
}

/// The embedding of chunk `c` of each rank's range.
fn embed<B: Backend>(
    run: &Run<'_>,
    ranks: &mut [ContextRank<'_, B>],
    parts: &mut [Part<B>],
    c: usize,
) -> BResult<()> {
    for (r, (rank, part)) in ranks.iter_mut().zip(parts.iter_mut()).enumerate() {
        let Some((ch, _)) = chunk_of(rank, part, c) else {
            continue;
        };
        run.in_step(r, rank, part, &ch, |be, m, ws, _, part| {
            be.embed(
                &m.embed,
                &run.tokens[part.at(&ch)],
                m.config.scale_emb as f32,
                &mut ws.h,
            )?;
            keep(be, &ws.h, &mut part.h, &ch)
        })?;
    }
    Ok(())
}

/// Lightning layer `i`, first pass, chunk `c` of each rank: read from a zero state (rank 0's
/// is the true one: it finishes the chunk at once; the others keep its queries, outputs and
/// gates). Then ([`lightning_scan`]) each range's end state is made the true one, in rank
/// order, and ([`lightning_second`]) each later rank adds to its chunks' outputs the term of
/// the state before them (its range's start state moved along the chunks) and finishes them.
fn lightning_first<B: Backend>(
    run: &Run<'_>,
    ranks: &mut [ContextRank<'_, B>],
    parts: &mut [Part<B>],
    i: usize,
    c: usize,
) -> BResult<()> {
    for (r, (rank, part)) in ranks.iter_mut().zip(parts.iter_mut()).enumerate() {
        let Some((ch, _)) = chunk_of(rank, part, c) else {
            continue;
        };
        run.in_step(r, rank, part, &ch, |be, m, ws, seq, part| {
            let LayerState::Lightning(state) = &mut seq.layers[i] else {
                return Err(state_mismatch());
            };
            load_input(be, m, i, ws, part, &ch, run.kept)?;
            m.layers[i].project(m, be, ws)?;
            if r > 0 {
                // The queries as projected (the term norms and rotates them itself).
                keep(be, &ws.q, &mut part.q, &ch)?;
            }
            let norms = m.layers[i].mixer.head_norms(m.config.rms_norm_eps as f32);
            be.lightning(
                m.lightning_shape(),
                &m.slopes,
                norms,
                m.config.lightning_use_rope.then_some(&m.inv_freq),
                AttnIo {
                    q: &mut ws.q,
                    k: &mut ws.kl,
                    v: &mut ws.vl,
                    out: &mut ws.o,
                },
                &[span_of(part, &ch)],
                &mut [state],
            )?;
            if r == 0 {
                return finish_chunk(be, m, i, ws, part, &ch);
            }
            keep(be, &ws.o, &mut part.o, &ch)?;
            keep(be, &ws.z, &mut part.z, &ch)
        })?;
    }
    Ok(())
}

/// Lightning layer `i`'s scan: rank r starts from rank r − 1's end state (now the true one).
fn lightning_scan<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    parts: &[Part<B>],
    exchange: &dyn Exchange<B>,
    i: usize,
    received: &mut [Received<B>],
) -> BResult<()> {
    for r in 1..ranks.len() {
        let (before, after) = ranks.split_at_mut(r);
        let (prev, rank) = (&before[r - 1], &mut after[0]);
        let LayerState::Lightning(prev_state) = &prev.seq.layers[i] else {
            return Err(state_mismatch());
        };
        let be = rank.be;
        let start = &mut received[r - 1].start;
        exchange.copy_state(prev.be, prev_state, be, start)?;
        let LayerState::Lightning(state) = &mut rank.seq.layers[i] else {
            return Err(state_mismatch());
        };
        let d = rank.model.config.head_dim;
        be.lightning_state_advance(&rank.model.slopes, d, parts[r].range.len(), start, state)?;
    }
    Ok(())
}

/// Lightning layer `i`, second pass, chunk `c` of each rank after the first: its outputs
/// given the term of the state before it, then finished.
fn lightning_second<B: Backend>(
    run: &Run<'_>,
    ranks: &mut [ContextRank<'_, B>],
    parts: &mut [Part<B>],
    i: usize,
    c: usize,
    received: &mut [Received<B>],
) -> BResult<()> {
    for (r, (rank, part)) in ranks.iter_mut().zip(parts.iter_mut()).enumerate().skip(1) {
        let Some((ch, count)) = chunk_of(rank, part, c) else {
            continue;
        };
        let Received {
            start, next, zero, ..
        } = &mut received[r - 1];
        run.in_step(r, rank, part, &ch, |be, m, ws, _, part| {
            take(be, &part.q, &mut ws.q, &ch)?;
            take(be, &part.o, &mut ws.o, &ch)?;
            take(be, &part.z, &mut ws.z, &ch)?;
            take(be, &part.h, &mut ws.h, &ch)?;
            let norms = m.layers[i].mixer.head_norms(m.config.rms_norm_eps as f32);
            be.lightning_state_term(
                m.lightning_shape(),
                &m.slopes,
                norms.map(|(q, _, eps)| (q, eps)),
                m.config.lightning_use_rope.then_some(&m.inv_freq),
                start,
                (&mut ws.q, span_of(part, &ch).pos),
                &mut ws.o,
            )?;
            if c + 1 < count {
                // The state before the next chunk, as far as the earlier ranks' share.
                be.copy_lightning_state(zero, next)?;
                let d = m.config.head_dim;
                be.lightning_state_advance(&m.slopes, d, ch.len(), start, next)?;
                std::mem::swap(start, next);
            }
            finish_chunk(be, m, i, ws, part, &ch)
        })?;
    }
    Ok(())
}

/// Sparse layer `i`'s attention of a chunk (the layer's projections in `ws`) over `seq`'s
/// cache, appending the chunk's keys and values.
fn attend<B: Backend>(
    run: &Run<'_>,
    be: &B,
    m: &Model<B>,
    ws: &mut Workspace<B>,
    seq: &mut SeqState<B>,
    i: usize,
    span: Span,
) -> BResult<()> {
    let LayerState::Sparse(cache) = &mut seq.layers[i] else {
        return Err(state_mismatch());
    };
    be.sparse_attention(
        m.sparse_shape(),
        &m.config.sparse,
        AttnIo {
            q: &mut ws.q,
            k: &mut ws.ks,
            v: &mut ws.vs,
            out: &mut ws.o,
        },
        &[span],
        &[run.mode],
        &mut [cache],
    )
}

/// Sparse layer `i`, first pass, chunk `c` of each rank: projected, its queries, gates and raw
/// keys and values kept (rank 0 attends and finishes it at once: no earlier keys). Then
/// ([`sparse_second`]) each later rank's cache takes the earlier ranks' keys and values, and
/// the rank attends its chunks in order (each appending its own) and finishes them.
fn sparse_first<B: Backend>(
    run: &Run<'_>,
    ranks: &mut [ContextRank<'_, B>],
    parts: &mut [Part<B>],
    i: usize,
    c: usize,
) -> BResult<()> {
    for (r, (rank, part)) in ranks.iter_mut().zip(parts.iter_mut()).enumerate() {
        let Some((ch, _)) = chunk_of(rank, part, c) else {
            continue;
        };
        run.in_step(r, rank, part, &ch, |be, m, ws, seq, part| {
            load_input(be, m, i, ws, part, &ch, run.kept)?;
            m.layers[i].project(m, be, ws)?;
            // The raw keys and values (an attention may change its k in place).
            keep(be, &ws.ks, &mut part.k, &ch)?;
            keep(be, &ws.vs, &mut part.v, &ch)?;
            if r == 0 {
                attend(run, be, m, ws, seq, i, span_of(part, &ch))?;
                return finish_chunk(be, m, i, ws, part, &ch);
            }
            keep(be, &ws.q, &mut part.q, &ch)?;
            keep(be, &ws.z, &mut part.z, &ch)
        })?;
    }
    Ok(())
}

/// Sparse layer `i`, second pass, chunk `c` of each rank after the first (before its first
/// chunk, its cache takes the earlier ranks' keys and values): attended and finished.
fn sparse_second<B: Backend>(
    run: &Run<'_>,
    ranks: &mut [ContextRank<'_, B>],
    parts: &mut [Part<B>],
    exchange: &dyn Exchange<B>,
    i: usize,
    c: usize,
    received: &mut [Received<B>],
) -> BResult<()> {
    for r in 1..ranks.len() {
        let (before, after) = ranks.split_at_mut(r);
        let rank = &mut after[0];
        let (done, rest) = parts.split_at_mut(r);
        let part = &mut rest[0];
        let Some((ch, _)) = chunk_of(rank, part, c) else {
            continue;
        };
        let received = &mut received[r - 1];
        run.in_step(r, rank, part, &ch, |be, m, ws, seq, part| {
            if c == 0 {
                let LayerState::Sparse(cache) = &mut seq.layers[i] else {
                    return Err(state_mismatch());
                };
                for (earlier, from) in before.iter().zip(done.iter()) {
                    let (k, v, rows) = (&mut received.k, &mut received.v, from.range.len());
                    be.set_rows(k, rows);
                    be.set_rows(v, rows);
                    exchange.copy_act(earlier.be, &from.k, be, k, rows)?;
                    exchange.copy_act(earlier.be, &from.v, be, v, rows)?;
                    be.append_sparse_kv(cache, &m.config.sparse, k, v, 0..rows)?;
                }
            }
            take(be, &part.q, &mut ws.q, &ch)?;
            take(be, &part.k, &mut ws.ks, &ch)?;
            take(be, &part.v, &mut ws.vs, &ch)?;
            take(be, &part.z, &mut ws.z, &ch)?;
            take(be, &part.h, &mut ws.h, &ch)?;
            attend(run, be, m, ws, seq, i, span_of(part, &ch))?;
            finish_chunk(be, m, i, ws, part, &ch)
        })?;
    }
    Ok(())
}
