//! A step of the forward pass ([`Model::forward`]): the inputs of many sequences (decode
//! rows, prompt chunks, spans) in one pass over the layers, the logits or greedy picks each
//! asks for, and prefill and decode of one sequence on top of it.

use crate::backend::{BResult, Backend, BackendError, Span, StepInfo};
use crate::layer::PackedRows;
use crate::model::{LayerState, Mixer, Model, SeqState, Workspace};
use crate::oracle::SparseMode;

/// One sequence's part of a step ([`Model::forward`]).
pub struct StepInput<'a, B: Backend> {
    pub seq: &'a mut SeqState<B>,
    /// Its next tokens, fed at positions `seq.pos..`.
    pub tokens: &'a [u32],
    /// The attention of its sparse layers ([`Model::sparse_mode`]).
    pub mode: SparseMode,
    pub logits: LogitRows,
}

/// What every layer of a step shares.
pub(crate) struct StepCtx<'a> {
    pub(crate) spans: &'a [Span],
    pub(crate) modes: &'a [SparseMode],
    pub(crate) eps: f32,
    /// The residual branches' scale.
    pub(crate) res: f32,
    /// Rows whose hidden states are kept for a draft: (input, step row, buffer row, rows).
    pub(crate) aux_rows: &'a [[usize; 4]],
    /// The step leaves its picks for later ([`Model::forward_ahead`]).
    pub(crate) picks_later: bool,
}

/// Which rows of a chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
    /// The last row's greedy token only ([`GreedyPick`]): no logits leave the device.
    Greedy,
    /// Every row's greedy token ([`GreedyPick`]; verifying a greedy span): no logits leave
    /// the device.
    GreedyAll,
}

/// How a step runs ahead ([`Model::forward_ahead`]).
#[derive(Debug, Clone, Copy, Default)]
struct Ahead {
    tokens_picked: bool,
    picks_later: bool,
}

/// The greedy token of one row of logits, as the host sampler picks it: the first index of the
/// maximum (NaN read as `-inf`, `+inf` as `f32::MAX`), and its log-probability
/// `-ln Σ exp(x - max)`. `id` is `None` when no logit is a number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GreedyPick {
    pub id: Option<u32>,
    pub logprob: f32,
}

impl GreedyPick {
    /// The pick of one row of logits, on the host.
    pub fn of(row: &[f32]) -> Self {
        let read = |x: f32| {
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x.min(f32::MAX)
            }
        };
        let (mut best, mut at) = (f32::NEG_INFINITY, None);
        for (i, &x) in row.iter().enumerate() {
            let x = read(x);
            if x > best {
                (best, at) = (x, Some(i as u32));
            }
        }
        let sum: f64 = row.iter().map(|&x| ((read(x) - best) as f64).exp()).sum();
        Self {
            id: at,
            logprob: if at.is_some() { -sum.ln() as f32 } else { 0.0 },
        }
    }
}

/// Ends a step as failed if it is dropped still armed: a panic unwinds through the step.
struct EndStepOnUnwind<'a, B: Backend> {
    be: &'a B,
    armed: bool,
}

impl<B: Backend> Drop for EndStepOnUnwind<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.be.end_step(false);
        }
    }
}

/// One input's share of a step's output, as its [`LogitRows`] asked.
#[derive(Debug, Clone, PartialEq)]
pub enum StepLogits {
    /// `[rows, vocab]` (no rows for [`LogitRows::None`]).
    Rows(Vec<f32>),
    /// The last row's greedy token ([`LogitRows::Greedy`]).
    Greedy(GreedyPick),
    /// Every row's greedy token ([`LogitRows::GreedyAll`]).
    GreedyRows(Vec<GreedyPick>),
}

impl StepLogits {
    /// The logits; none for greedy picks.
    pub fn into_rows(self) -> Vec<f32> {
        match self {
            StepLogits::Rows(r) => r,
            StepLogits::Greedy(_) | StepLogits::GreedyRows(_) => Vec::new(),
        }
    }
}

impl<B: Backend> Model<B> {
    /// One step: every input's tokens go through the model in one pass (rows in batch order,
    /// so each weight is read once for the whole step), each advancing its own sequence.
    /// Inputs may mix decode rows, prompt chunks and longer spans; a sequence's result does
    /// not depend on the others in the step. Returns each input's logits as its
    /// [`LogitRows`] asked.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
    ) -> BResult<Vec<StepLogits>> {
        self.forward_as(be, ws, batch, Ahead::default())
    }

    /// [`Model::forward`] of a step whose every input asks for its greedy pick
    /// ([`LogitRows::Greedy`]), left on the device to be read by [`Model::take_picks`] (one per
    /// input, in order) once the next step is queued. With `tokens_picked`, every input is one
    /// row whose token is the pick the step before left for it, input for input (its `tokens`
    /// are placeholders). The backend must [`Backend::runs_ahead`].
    pub fn forward_ahead(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        tokens_picked: bool,
    ) -> BResult<()> {
        let fits = be.runs_ahead()
            && batch
                .iter()
                .all(|x| x.logits == LogitRows::Greedy && (!tokens_picked || x.tokens.len() == 1));
        if !fits {
            return Err(BackendError(
                "a step run ahead needs a backend that runs ahead and a greedy pick an input \
                 (one row each when its tokens are the picks before)"
                    .into(),
            ));
        }
        let ahead = Ahead {
            tokens_picked,
            picks_later: true,
        };
        self.forward_as(be, ws, batch, ahead).map(|_| ())
    }

    /// The picks of the oldest step [`Model::forward_ahead`] queued whose picks are still on
    /// the device, one per input (waits for them).
    pub fn take_picks(&self, be: &B) -> BResult<Vec<GreedyPick>> {
        be.take_picks()
    }

    fn forward_as(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        ahead: Ahead,
    ) -> BResult<Vec<StepLogits>> {
        let c = &self.config;
        let n: usize = batch.iter().map(|x| x.tokens.len()).sum();
        if batch.is_empty() || n > ws.max_rows || batch.iter().any(|x| x.tokens.is_empty()) {
            return Err(BackendError(format!(
                "a step holds 1..={} tokens, each input at least one; got {n} tokens in {} \
                 inputs",
                ws.max_rows,
                batch.len()
            )));
        }
        let mut tokens = Vec::with_capacity(n);
        let mut spans = Vec::with_capacity(batch.len());
        let mut logit_rows = Vec::new();
        for x in batch.iter() {
            let span = Span {
                first_row: tokens.len(),
                len: x.tokens.len(),
                pos: x.seq.pos,
            };
            logit_rows.extend(match x.logits {
                LogitRows::None => 0..0,
                LogitRows::Last | LogitRows::Greedy => {
                    span.first_row + span.len - 1..span.first_row + span.len
                }
                LogitRows::All | LogitRows::GreedyAll => span.rows(),
            });
            tokens.extend_from_slice(x.tokens);
            spans.push(span);
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(BackendError(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        for buf in ws.buffers_mut() {
            be.set_rows(buf, n);
        }
        let modes: Vec<SparseMode> = batch.iter().map(|x| x.mode).collect();
        // Rows whose aux-layer outputs are kept: (input, span row, buffer row, rows).
        let mut aux_rows = Vec::new();
        for (i, (x, span)) in batch.iter_mut().zip(&spans).enumerate() {
            if let Some(aux) = x.seq.aux.as_mut() {
                if let Some((skip, dst, n)) = aux.place(span.pos, span.len) {
                    aux_rows.push([i, span.first_row + skip, dst, n]);
                }
            }
        }
        let step = StepCtx {
            spans: &spans,
            modes: &modes,
            eps: c.rms_norm_eps as f32,
            res: c.residual_scale() as f32,
            aux_rows: &aux_rows,
            picks_later: ahead.picks_later,
        };
        let seq_ids: Vec<u64> = batch.iter().map(|x| x.seq.id).collect();
        let logits: Vec<LogitRows> = batch.iter().map(|x| x.logits).collect();
        be.begin_step(&StepInfo {
            tokens: &tokens,
            spans: &spans,
            seq_ids: &seq_ids,
            logits: &logits,
            aux_rows: &aux_rows,
            eager: false,
            tokens_picked: ahead.tokens_picked,
            picks_later: ahead.picks_later,
        })?;
        // A panic inside the step still ends it (a capture under way is dropped).
        let mut unwinding = EndStepOnUnwind { be, armed: true };
        let logits = self.run_step(be, ws, batch, &tokens, &step, &logit_rows);
        unwinding.armed = false;
        let ended = be.end_step(logits.is_ok());
        let logits = logits?;
        ended?;
        for x in batch.iter_mut() {
            // The span read after a mark is kept (when short enough) until the next mark.
            if let Some(kv) = x.seq.span_kv.as_mut().filter(|kv| kv.armed) {
                let short = x.tokens.len() <= crate::STEPWISE_SPAN_ROWS;
                kv.rows = if short && kv.pos == x.seq.pos {
                    x.tokens.len()
                } else {
                    0
                };
                kv.armed = false;
            }
            x.seq.pos += x.tokens.len();
        }
        Ok(logits)
    }

    /// The last layer's rows a step reads, when not all ([`PackedRows`]): per input, its last
    /// row for its logits or pick, every row for all its logits or a draft's reads of the last
    /// layer, none otherwise. A recorder of the products' inputs reads every row.
    fn last_layer_rows(
        &self,
        batch: &[StepInput<'_, B>],
        step: &StepCtx<'_>,
    ) -> Option<PackedRows> {
        let last = self.layers.len().checked_sub(1)?;
        if self.recorder.borrow().is_some() {
            return None;
        }
        let keep = batch
            .iter()
            .zip(step.spans)
            .enumerate()
            .map(|(i, (x, s))| {
                let drafted = step.aux_rows.iter().any(|r| r[0] == i)
                    && x.seq.aux.as_ref().is_some_and(|a| a.layers.contains(&last));
                match x.logits {
                    _ if drafted => s.len,
                    LogitRows::None => 0,
                    LogitRows::Last | LogitRows::Greedy => 1,
                    LogitRows::All | LogitRows::GreedyAll => s.len,
                }
            })
            .collect();
        PackedRows::new(step.spans, keep)
    }

    /// The layers and the logits of a step [`Model::forward`] laid out.
    fn run_step(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        tokens: &[u32],
        step: &StepCtx<'_>,
        logit_rows: &[usize],
    ) -> BResult<Vec<StepLogits>> {
        let c = &self.config;
        be.embed(&self.embed, tokens, c.scale_emb as f32, &mut ws.h)?;
        if let Some(first) = self.layers.first() {
            be.rms_norm(&ws.h, &first.input_norm, step.eps, &mut ws.a)?;
        }
        let packed = self.last_layer_rows(batch, step);
        let last = self.layers.len().saturating_sub(1);
        let mut lightning_index = 0;
        for (i, layer) in self.layers.iter().enumerate() {
            let lightning = matches!(layer.mixer, Mixer::Lightning { .. });
            let mut states: Vec<&mut LayerState<B>> = Vec::with_capacity(batch.len());
            let mut captures: Vec<Option<&mut (B::Act, B::Act)>> = Vec::with_capacity(batch.len());
            for x in batch.iter_mut() {
                let short = x.tokens.len() <= crate::STEPWISE_SPAN_ROWS;
                let SeqState {
                    layers, span_kv, ..
                } = &mut *x.seq;
                states.push(&mut layers[i]);
                captures.push(match span_kv {
                    Some(kv) if lightning && kv.armed && short => {
                        Some(&mut kv.layers[lightning_index])
                    }
                    _ => None,
                });
            }
            let next_norm = self
                .layers
                .get(i + 1)
                .map_or(&self.final_norm, |l| &l.input_norm);
            let keep = packed.as_ref().filter(|_| i == last);
            layer.forward(
                self,
                be,
                step,
                ws,
                &mut states,
                &mut captures,
                next_norm,
                keep,
            )?;
            lightning_index += usize::from(lightning);
            for &[x, src, dst, n] in step.aux_rows {
                let aux = batch[x].seq.aux.as_mut().expect("placed above");
                let src = match keep {
                    Some(p) if aux.layers.contains(&i) => {
                        p.packed(step.spans, src).ok_or_else(|| {
                            BackendError("a draft reads a last-layer row not kept".into())
                        })?
                    }
                    _ => src,
                };
                for k in (0..3).filter(|&k| aux.layers[k] == i) {
                    be.set_rows(&mut aux.bufs[k], aux.capacity);
                    be.copy_rows(&ws.h, src, &mut aux.bufs[k], dst, n)?;
                }
            }
        }
        if logit_rows.is_empty() {
            return Ok(vec![StepLogits::Rows(Vec::new()); batch.len()]);
        }
        let packed_rows;
        let logit_rows = match &packed {
            Some(p) => {
                packed_rows = logit_rows
                    .iter()
                    .map(|&r| p.packed(step.spans, r))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| BackendError("a logit row of the last layer not kept".into()))?;
                &packed_rows[..]
            }
            None => logit_rows,
        };
        // Rows whose logits the host gets; the others only their greedy pick.
        let keep: Vec<bool> = batch
            .iter()
            .flat_map(|x| match x.logits {
                LogitRows::None => vec![],
                LogitRows::Last => vec![true],
                LogitRows::Greedy => vec![false],
                LogitRows::GreedyAll => vec![false; x.tokens.len()],
                LogitRows::All => vec![true; x.tokens.len()],
            })
            .collect();
        // `ws.a` holds the final norm of the last layer's output.
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let out = be.logits(&ws.a, logit_rows, &keep, head, c.logit_divisor() as f32)?;
        if step.picks_later {
            return Ok(Vec::new());
        }
        let (mut all, mut picks) = (out.rows, out.picks);
        let vocab = c.vocab_size;
        let kept = keep.iter().filter(|&&k| k).count();
        if all.len() != kept * vocab || picks.len() != logit_rows.len() {
            return Err(BackendError(format!(
                "the backend gave {} logits and {} picks for {kept} rows kept of {}",
                all.len(),
                picks.len(),
                logit_rows.len()
            )));
        }
        // Each input's rows, cut from the end so that every value is moved once.
        let mut res = Vec::with_capacity(batch.len());
        for x in batch.iter().rev() {
            res.push(match x.logits {
                LogitRows::None => StepLogits::Rows(Vec::new()),
                LogitRows::Last => {
                    picks.pop();
                    StepLogits::Rows(all.split_off(all.len() - vocab))
                }
                LogitRows::All => {
                    picks.truncate(picks.len() - x.tokens.len());
                    StepLogits::Rows(all.split_off(all.len() - x.tokens.len() * vocab))
                }
                LogitRows::Greedy => StepLogits::Greedy(picks.pop().ok_or_else(|| {
                    BackendError("the backend gave fewer greedy picks than rows".into())
                })?),
                LogitRows::GreedyAll => {
                    let n = x.tokens.len();
                    if picks.len() < n {
                        return Err(BackendError(
                            "the backend gave fewer greedy picks than rows".into(),
                        ));
                    }
                    StepLogits::GreedyRows(picks.split_off(picks.len() - n))
                }
            });
        }
        res.reverse();
        Ok(res)
    }

    /// Prefills `tokens` in chunks of at most `ws.chunk`, with the sparse mode of the whole
    /// prompt; returns the last token's logits.
    pub fn prefill(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize),
    ) -> BResult<Vec<f32>> {
        if tokens.is_empty() {
            return Err(BackendError("cannot prefill an empty prompt".into()));
        }
        let mode = self.sparse_mode(seq.pos + tokens.len());
        let mut logits = Vec::new();
        let chunks = tokens.chunks(ws.chunk);
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.enumerate() {
            let rows = if i == last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            logits = self.forward_one(be, ws, seq, chunk, mode, rows)?;
            progress(chunk.len());
        }
        Ok(logits)
    }

    /// One decode step: feeds `token`, returns the next-token logits.
    pub fn decode(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        token: u32,
    ) -> BResult<Vec<f32>> {
        let mode = self.sparse_mode(seq.pos + 1);
        self.forward_one(be, ws, seq, &[token], mode, LogitRows::Last)
    }

    /// One decode step that returns the greedy pick of the next token, made where the logits
    /// are ([`LogitRows::Greedy`]).
    pub fn decode_greedy(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        token: u32,
    ) -> BResult<GreedyPick> {
        let mode = self.sparse_mode(seq.pos + 1);
        let input = StepInput {
            seq,
            tokens: &[token],
            mode,
            logits: LogitRows::Greedy,
        };
        match self.forward(be, ws, &mut [input])?.remove(0) {
            StepLogits::Greedy(pick) => Ok(pick),
            StepLogits::Rows(_) | StepLogits::GreedyRows(_) => {
                Err(BackendError("logits where a pick was asked".into()))
            }
        }
    }

    /// [`Model::forward`] of one sequence's `tokens`.
    pub fn forward_one(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
        logits: LogitRows,
    ) -> BResult<Vec<f32>> {
        let input = StepInput {
            seq,
            tokens,
            mode,
            logits,
        };
        Ok(self.forward(be, ws, &mut [input])?.remove(0).into_rows())
    }
}
