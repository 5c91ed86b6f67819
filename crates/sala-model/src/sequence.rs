//! A sequence's state beyond its caches: marks to rewind it to and the rewinds themselves
//! (speculative decoding's exact rollback), the span rows a rewind replays, and the hidden
//! states an EAGLE-3 draft reads.

use crate::backend::{BResult, Backend, BackendError};
use crate::model::{state_mismatch, LayerState, Mixer, Model, SeqState};

/// Outputs of three layers (an EAGLE-3 draft's low, mid and high hidden states) for the rows
/// a sequence reads from position `from_pos` on, kept until a draft takes them
/// ([`AuxCapture::take`]): buffer row `r` is position `first_pos + r`. When a step would
/// overflow the buffers, the rows kept before it are dropped.
pub struct AuxCapture<B: Backend> {
    pub layers: [usize; 3],
    pub bufs: [B::Act; 3],
    pub capacity: usize,
    pub first_pos: usize,
    pub rows: usize,
    pub from_pos: usize,
}

impl<B: Backend> AuxCapture<B> {
    /// Buffers of `capacity` rows of `width` for the outputs of `layers`, keeping rows from
    /// position `from_pos` on.
    pub fn new(
        be: &B,
        layers: [usize; 3],
        width: usize,
        capacity: usize,
        from_pos: usize,
    ) -> BResult<Self> {
        let alloc = || be.alloc(capacity, width);
        Ok(Self {
            layers,
            bufs: [alloc()?, alloc()?, alloc()?],
            capacity,
            first_pos: from_pos,
            rows: 0,
            from_pos,
        })
    }

    /// Where a span at `pos` of `len` rows is kept: (first row of the span to keep, buffer
    /// row, rows); rows kept at or past `pos` before (read again after a rewind) are dropped.
    pub(crate) fn place(&mut self, pos: usize, len: usize) -> Option<(usize, usize, usize)> {
        let start = pos.max(self.from_pos);
        let end = pos + len;
        if start >= end {
            return None;
        }
        let (skip, n) = if end - start > self.capacity {
            (end - self.capacity - pos, self.capacity)
        } else {
            (start - pos, end - start)
        };
        let at = pos + skip;
        let keep = at.saturating_sub(self.first_pos).min(self.rows);
        if at < self.first_pos || keep + n > self.capacity || self.first_pos + keep != at {
            self.first_pos = at;
            self.rows = 0;
        } else {
            self.rows = keep;
        }
        let dst = self.rows;
        self.rows += n;
        Some((skip, dst, n))
    }

    /// The rows kept, positions `first_pos..first_pos + rows`, up to position `end`; they are
    /// taken (the next rows are kept from `end`).
    pub fn take(&mut self, end: usize) -> std::ops::Range<usize> {
        let rows = end.saturating_sub(self.first_pos).min(self.rows);
        let taken = self.first_pos..self.first_pos + rows;
        self.first_pos = end;
        self.rows = 0;
        taken
    }
}

/// The lightning layers' k and v rows of the one span a sequence reads after [`Model::mark`]
/// (at most [`crate::STEPWISE_SPAN_ROWS`] rows), as the layers' projections made them: a
/// rewind that keeps the first rows of the span replays them into the states
/// ([`Model::rewind_to`]).
pub(crate) struct SpanKv<B: Backend> {
    /// The mark's position, and the span's rows once it has run (0: none yet or too long).
    pub(crate) pos: usize,
    pub(crate) rows: usize,
    pub(crate) armed: bool,
    /// Per lightning layer, buffers of [`crate::STEPWISE_SPAN_ROWS`] rows for k and v.
    pub(crate) layers: Vec<(B::Act, B::Act)>,
}

/// A sequence's state at one position, to rewind it to ([`Model::mark`]).
pub struct SeqMark<B: Backend> {
    seq: u64,
    pos: usize,
    states: Vec<B::LightningState>,
}

impl<B: Backend> SeqMark<B> {
    /// The position it was taken at.
    pub fn pos(&self) -> usize {
        self.pos
    }
}

impl<B: Backend> Model<B> {
    /// A mark to rewind `seq` to ([`Model::rewind`]): its position and a copy of every
    /// lightning state (the sparse caches are cut back instead).
    pub fn mark(&self, be: &B, seq: &mut SeqState<B>) -> BResult<SeqMark<B>> {
        self.mark_with(be, seq, None)
    }

    /// [`Model::mark`] into the state copies of `spare` (an earlier mark of this model, done
    /// with) where it has them, so a mark a step allocates nothing.
    pub fn mark_with(
        &self,
        be: &B,
        seq: &mut SeqState<B>,
        spare: Option<SeqMark<B>>,
    ) -> BResult<SeqMark<B>> {
        // The next span's k and v rows are kept, for a rewind into it.
        if seq.span_kv.is_none() {
            let width = self.lightning_shape().kv_width();
            let n = self
                .layers
                .iter()
                .filter(|l| matches!(l.mixer, Mixer::Lightning { .. }))
                .count();
            let layers = (0..n)
                .map(|_| {
                    Ok((
                        be.alloc_split("kl", crate::STEPWISE_SPAN_ROWS, width)?,
                        be.alloc_split("vl", crate::STEPWISE_SPAN_ROWS, width)?,
                    ))
                })
                .collect::<BResult<Vec<_>>>()?;
            seq.span_kv = Some(SpanKv {
                pos: 0,
                rows: 0,
                armed: false,
                layers,
            });
        }
        if let Some(kv) = seq.span_kv.as_mut() {
            kv.pos = seq.pos;
            kv.rows = 0;
            kv.armed = true;
        }
        self.snapshot_with(be, seq, spare)
    }

    /// A snapshot of `seq` to rewind it to ([`Model::rewind`]): [`Model::mark`] without
    /// keeping the next span's rows (so no [`Model::rewind_to`] into it), as a prefix cache
    /// keeps the states of a sequence at the points it may resume from.
    pub fn snapshot(&self, be: &B, seq: &SeqState<B>) -> BResult<SeqMark<B>> {
        self.snapshot_with(be, seq, None)
    }

    fn snapshot_with(
        &self,
        be: &B,
        seq: &SeqState<B>,
        spare: Option<SeqMark<B>>,
    ) -> BResult<SeqMark<B>> {
        let mut spare = spare.map(|m| m.states).unwrap_or_default().into_iter();
        let mut states = Vec::new();
        for state in &seq.layers {
            if let LayerState::Lightning(s) = state {
                let c = &self.config;
                let mut copy = match spare.next() {
                    Some(copy) => copy,
                    None => be.new_lightning_state(c.num_attention_heads, c.head_dim)?,
                };
                be.copy_lightning_state(s, &mut copy)?;
                states.push(copy);
            }
        }
        Ok(SeqMark {
            seq: seq.id,
            pos: seq.pos,
            states,
        })
    }

    /// A new sequence holding what `src` held after its first `len` tokens, `src` unchanged:
    /// its sparse caches shared up to `len` where the backend can ([`Backend::share_sparse_cache`]),
    /// its lightning states copied from `at` (a snapshot of `src` taken at `len`) or, where
    /// `len` is `src`'s position, from `src`'s own. A prefix-cache hit that leaves the parked
    /// sequence for the next one.
    pub fn fork_sequence(
        &self,
        be: &B,
        src: &SeqState<B>,
        at: Option<&SeqMark<B>>,
        len: usize,
    ) -> BResult<SeqState<B>> {
        let states: Option<&[B::LightningState]> = match at {
            Some(m) if m.seq == src.id && m.pos == len => Some(&m.states),
            None if len == src.pos => None,
            _ => {
                return Err(BackendError(format!(
                    "fork_sequence: no state of the sequence at {len} (it holds {})",
                    src.pos
                )))
            }
        };
        let mut dst = self.new_sequence(be)?;
        let mut saved = states.map(|s| s.iter());
        for (s, d) in src.layers.iter().zip(&mut dst.layers) {
            match (s, d) {
                (LayerState::Lightning(s), LayerState::Lightning(d)) => {
                    let from = match saved.as_mut() {
                        Some(it) => it.next().ok_or_else(state_mismatch)?,
                        None => s,
                    };
                    be.copy_lightning_state(from, d)?
                }
                (LayerState::Sparse(s), LayerState::Sparse(d)) => {
                    be.share_sparse_cache(s, d, &self.config.sparse, len)?
                }
                _ => return Err(state_mismatch()),
            }
        }
        dst.pos = len;
        Ok(dst)
    }

    /// Makes `seq` hold what it held at `mark` followed by the first `keep` tokens of the one
    /// span it read since (at most [`crate::STEPWISE_SPAN_ROWS`] tokens): the rest is undone
    /// exactly, and the lightning states are the mark's advanced over the kept rows as
    /// decoding them one at a time would (the span's k and v rows replayed), so it goes on as
    /// if only the kept tokens had been read (speculative drafts of which `keep − 1` stood).
    pub fn rewind_to(
        &self,
        be: &B,
        seq: &mut SeqState<B>,
        mark: &SeqMark<B>,
        keep: usize,
    ) -> BResult<()> {
        if keep == 0 {
            return self.rewind(be, seq, mark);
        }
        let kept = seq.span_kv.as_ref().is_some_and(|kv| {
            kv.pos == mark.pos && keep <= kv.rows && mark.pos + kv.rows == seq.pos
        });
        if mark.seq != seq.id || !kept {
            return Err(BackendError(format!(
                "rewind: the sequence did not read one span of at least {keep} tokens (at most {}) since the mark",
                crate::STEPWISE_SPAN_ROWS
            )));
        }
        let c = &self.config;
        let mut saved = mark.states.iter();
        let kv = seq.span_kv.as_ref().expect("checked above");
        let mut kv_layers = kv.layers.iter();
        for (layer, state) in self.layers.iter().zip(&mut seq.layers) {
            match (state, &layer.mixer) {
                (LayerState::Lightning(s), Mixer::Lightning { k_norm, .. }) => {
                    let from = saved.next().ok_or_else(state_mismatch)?;
                    let (k, v) = kv_layers.next().ok_or_else(state_mismatch)?;
                    be.copy_lightning_state(from, s)?;
                    be.lightning_replay(
                        self.lightning_shape(),
                        &self.slopes,
                        k_norm.as_ref().map(|w| (w, c.rms_norm_eps as f32)),
                        c.lightning_use_rope.then_some(&self.inv_freq),
                        (k, v, keep),
                        mark.pos,
                        s,
                    )?;
                }
                (LayerState::Sparse(cache), _) => {
                    be.truncate_sparse_cache(cache, &c.sparse, mark.pos + keep)?
                }
                _ => return Err(state_mismatch()),
            }
        }
        seq.pos = mark.pos + keep;
        if let Some(kv) = seq.span_kv.as_mut() {
            kv.armed = false;
        }
        Ok(())
    }

    /// Makes `seq` hold what it held at `mark` (taken of it, at or before its position now):
    /// the tokens fed since are undone exactly, as if never read (rejected speculative tokens).
    pub fn rewind(&self, be: &B, seq: &mut SeqState<B>, mark: &SeqMark<B>) -> BResult<()> {
        if mark.seq != seq.id || mark.pos > seq.pos {
            return Err(BackendError(
                "rewind: the mark is not of this sequence's past".into(),
            ));
        }
        let mut states = mark.states.iter();
        for state in &mut seq.layers {
            match state {
                LayerState::Lightning(s) => {
                    let saved = states.next().ok_or_else(state_mismatch)?;
                    be.copy_lightning_state(saved, s)?;
                }
                LayerState::Sparse(c) => {
                    be.truncate_sparse_cache(c, &self.config.sparse, mark.pos)?
                }
            }
        }
        seq.pos = mark.pos;
        Ok(())
    }
}
