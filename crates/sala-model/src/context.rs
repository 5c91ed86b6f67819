//! Context parallelism: one long prompt read by several ranks at once, each taking a
//! contiguous, block-aligned range of its tokens ([`crate::parallel::context_ranges`]) and
//! holding the whole model. Layer by layer every rank projects its own rows; the lightning
//! layers read each range from a zero state, then scan the ranges' end states in order
//! ([`Backend::lightning_state_advance`]: the state before each range) and add to each range's
//! outputs the term of the state it starts from ([`Backend::lightning_state_term`]); the
//! sparse layers give each rank the earlier ranks' keys and values
//! ([`Backend::append_sparse_kv`]) before it attends its own rows, so block selection and
//! attention see the whole prefix. Each rank ends holding the prompt up to its range's end,
//! the last one the whole prompt (every cache and the lightning states after it): decode
//! continues there.

use crate::backend::{AttnIo, BResult, Backend, BackendError, Span, StepInfo};
use crate::model::{state_mismatch, LayerState, LogitRows, Mixer, Model, SeqState, Workspace};
use crate::oracle::SparseMode;
use crate::parallel::context_ranges;
use sala_checkpoint::MixerKind;
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

/// Prefills `tokens` (the whole prompt of new sequences) over `ranks`, each reading its
/// range; see the module's docs. A prompt of fewer blocks than ranks leaves the later ranks
/// idle.
pub fn prefill<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    tokens: &[u32],
) -> BResult<ContextPrefill> {
    let mode = ranks
        .first()
        .map_or(SparseMode::Dense, |r| r.model.sparse_mode(tokens.len()));
    prefill_as(ranks, exchange, tokens, mode)
}

/// [`prefill`] with the sparse layers' attention `mode` given: that of a longer prompt whose
/// first `tokens` these are (the rest read after, as [`crate::Model::sparse_mode`] says for
/// the whole).
pub fn prefill_as<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    tokens: &[u32],
    mode: SparseMode,
) -> BResult<ContextPrefill> {
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
    let ranges = context_ranges(tokens.len(), ranks.len(), c.sparse.block_size);
    let ranks = &mut ranks[..ranges.len()];
    for (r, (rank, range)) in ranks.iter().zip(&ranges).enumerate() {
        let fresh = rank.seq.pos == 0 && rank.seq.aux.is_none() && rank.seq.span_kv.is_none();
        if !fresh || rank.ws.max_rows < range.len() {
            return Err(BackendError(format!(
                "context parallelism: rank {r} needs a new sequence and a workspace of {} rows \
                 (it has {})",
                range.len(),
                rank.ws.max_rows
            )));
        }
    }
    let spans: Vec<Span> = ranges
        .iter()
        .map(|r| Span {
            first_row: 0,
            len: r.len(),
            pos: r.start,
        })
        .collect();
    // Each rank's step: its rows, embedded and normed for the first layer.
    for ((rank, range), span) in ranks.iter_mut().zip(&ranges).zip(&spans) {
        let (be, m) = (rank.be, rank.model);
        let last = range.end == tokens.len();
        be.begin_step(&StepInfo {
            tokens: &tokens[range.clone()],
            spans: std::slice::from_ref(span),
            seq_ids: &[rank.seq.id],
            logits: &[if last {
                LogitRows::Last
            } else {
                LogitRows::None
            }],
            aux_rows: &[],
        })?;
        for buf in rank.ws.buffers_mut() {
            be.set_rows(buf, range.len());
        }
        be.embed(
            &m.embed,
            &tokens[range.clone()],
            m.config.scale_emb as f32,
            &mut rank.ws.h,
        )?;
        if let Some(l) = m.layers.first() {
            be.rms_norm(
                &rank.ws.h,
                &l.input_norm,
                m.config.rms_norm_eps as f32,
                &mut rank.ws.a,
            )?;
        }
    }
    let result = scratch(ranks, &spans)
        .and_then(|mut scratch| run_layers(ranks, exchange, &spans, mode, &mut scratch));
    // Every step begun is ended, whatever happened.
    let mut ended = Ok(());
    for rank in ranks.iter() {
        let e = rank.be.end_step(result.is_ok());
        ended = ended.and(e);
    }
    result?;
    ended?;
    for (rank, range) in ranks.iter_mut().zip(&ranges) {
        rank.seq.pos = range.end;
    }
    let last = ranks.len() - 1;
    let rank = &ranks[last];
    let m = rank.model;
    let head = m.lm_head.as_ref().unwrap_or(&m.embed);
    let n = spans[last].len;
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

/// A rank's buffers for what it receives: the state its range starts from (lightning), the
/// earlier ranks' keys and values (sparse).
struct Received<B: Backend> {
    start: B::LightningState,
    k: B::Act,
    v: B::Act,
}

/// The [`Received`] buffers of every rank but the first (which receives nothing), made once
/// for the whole prefill.
fn scratch<B: Backend>(ranks: &[ContextRank<'_, B>], spans: &[Span]) -> BResult<Vec<Received<B>>> {
    let c = &ranks[0].model.config;
    let widest = spans.iter().map(|s| s.len).max().unwrap_or(0);
    ranks[1..]
        .iter()
        .map(|r| {
            Ok(Received {
                start: r
                    .be
                    .new_lightning_state(c.num_attention_heads, c.head_dim)?,
                k: r.be.alloc(widest, c.kv_dim())?,
                v: r.be.alloc(widest, c.kv_dim())?,
            })
        })
        .collect()
}

/// The layers over every rank (each rank's rows embedded and normed in its `ws.a`).
fn run_layers<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    spans: &[Span],
    mode: SparseMode,
    received: &mut [Received<B>],
) -> BResult<()> {
    let m0 = ranks[0].model;
    let c = &m0.config;
    let eps = c.rms_norm_eps as f32;
    let res = c.residual_scale() as f32;
    for i in 0..m0.layers.len() {
        for rank in ranks.iter_mut() {
            rank.model.layers[i].project(rank.model, rank.be, rank.ws)?;
        }
        match c.mixer_types[i] {
            MixerKind::Lightning => lightning_layer(ranks, exchange, spans, i, received)?,
            MixerKind::Sparse => sparse_layer(ranks, exchange, spans, i, mode, received)?,
        }
        for rank in ranks.iter_mut() {
            let m = rank.model;
            let next_norm = m.layers.get(i + 1).map_or(&m.final_norm, |l| &l.input_norm);
            m.layers[i].finish(m, rank.be, rank.ws, res, eps, next_norm)?;
        }
    }
    Ok(())
}

/// Lightning layer `i`: every range from a zero state (rank 0 from the sequence's, also zero),
/// then the scan of the end states in order, each range's start-state term added on the way.
fn lightning_layer<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    spans: &[Span],
    i: usize,
    received: &mut [Received<B>],
) -> BResult<()> {
    let c = &ranks[0].model.config;
    let d = c.head_dim;
    for (rank, span) in ranks.iter_mut().zip(spans) {
        let m = rank.model;
        let Mixer::Lightning { q_norm, k_norm, .. } = &m.layers[i].mixer else {
            return Err(state_mismatch());
        };
        let LayerState::Lightning(state) = &mut rank.seq.layers[i] else {
            return Err(state_mismatch());
        };
        let ws = &mut *rank.ws;
        let norms = q_norm
            .as_ref()
            .zip(k_norm.as_ref())
            .map(|(q, k)| (q, k, c.rms_norm_eps as f32));
        rank.be.lightning(
            m.lightning_shape(),
            &m.slopes,
            norms,
            c.lightning_use_rope.then_some(&m.inv_freq),
            AttnIo {
                q: &mut ws.q,
                k: &mut ws.kl,
                v: &mut ws.vl,
                out: &mut ws.o,
            },
            std::slice::from_ref(span),
            &mut [state],
        )?;
    }
    // The scan: rank r starts from rank r − 1's end state (now the true one).
    for r in 1..ranks.len() {
        let (before, after) = ranks.split_at_mut(r);
        let (prev, rank) = (&before[r - 1], &mut after[0]);
        let LayerState::Lightning(prev_state) = &prev.seq.layers[i] else {
            return Err(state_mismatch());
        };
        let be = rank.be;
        let start = &mut received[r - 1].start;
        exchange.copy_state(prev.be, prev_state, be, start)?;
        let m = rank.model;
        be.lightning_state_term(
            m.lightning_shape(),
            &m.slopes,
            start,
            &rank.ws.q,
            spans[r].len,
            &mut rank.ws.o,
        )?;
        let LayerState::Lightning(state) = &mut rank.seq.layers[i] else {
            return Err(state_mismatch());
        };
        be.lightning_state_advance(&m.slopes, d, spans[r].len, start, state)?;
    }
    Ok(())
}

/// Sparse layer `i`: each rank's cache takes the earlier ranks' keys and values, then the
/// rank appends and attends its own rows.
fn sparse_layer<B: Backend>(
    ranks: &mut [ContextRank<'_, B>],
    exchange: &dyn Exchange<B>,
    spans: &[Span],
    i: usize,
    mode: SparseMode,
    received: &mut [Received<B>],
) -> BResult<()> {
    let c = &ranks[0].model.config;
    // From the last rank down: an attention entry may change its k in place (a lightning
    // one does), so every earlier rank's keys are sent before that rank attends.
    for r in (0..ranks.len()).rev() {
        let (before, after) = ranks.split_at_mut(r);
        let rank = &mut after[0];
        let be = rank.be;
        let LayerState::Sparse(cache) = &mut rank.seq.layers[i] else {
            return Err(state_mismatch());
        };
        for (q, earlier) in before.iter().enumerate() {
            let Received { k, v, .. } = &mut received[r - 1];
            let n = spans[q].len;
            be.set_rows(k, n);
            be.set_rows(v, n);
            exchange.copy_act(earlier.be, &earlier.ws.ks, be, k, n)?;
            exchange.copy_act(earlier.be, &earlier.ws.vs, be, v, n)?;
            be.append_sparse_kv(cache, &c.sparse, k, v, n)?;
        }
        let m = rank.model;
        let ws = &mut *rank.ws;
        be.sparse_attention(
            m.sparse_shape(),
            &c.sparse,
            AttnIo {
                q: &mut ws.q,
                k: &mut ws.ks,
                v: &mut ws.vs,
                out: &mut ws.o,
            },
            std::slice::from_ref(&spans[r]),
            &[mode],
            &mut [cache],
        )?;
    }
    Ok(())
}
