//! A request's speculative decoding within the engine's steps: its drafts, the span they are
//! verified in, and the rewind where one falls.

use super::Drafting;
use crate::draft::{Drafter, Speculate};
use crate::generate::EngineError;
use sala_model::draft::DraftState;
use sala_model::{Backend, BackendError, Model, SeqMark, SeqState};

/// Most steps a request drafts nothing for after spans of which no draft stood.
pub const SPECULATE_MAX_PAUSE: usize = 64;

/// A request's speculative decoding: drafts verified in one span a step. After a span whose
/// drafts were not all taken, the sequence is rewound into it, keeping the tokens it took
/// ([`Model::rewind_to`]: exact, the lightning states replayed over the kept rows). Where that
/// cannot be (a span longer than [`sala_model::STEPWISE_SPAN_ROWS`]), it is rewound to before
/// the span and the tokens it took are read again at the front of the next span, which then
/// carries no drafts (else every partly taken span would re-read all the tokens before it).
/// After spans of which no draft stood, drafting pauses for 2, 4, ... up to
/// [`SPECULATE_MAX_PAUSE`] steps.
pub(super) struct Speculation<B: Backend> {
    drafter: Drafts<B>,
    max_draft: usize,
    /// Spans in a row of which no draft stood, and the steps left before drafting again.
    misses: u32,
    pause: usize,
    /// Tokens taken but not in the sequence's state (it was rewound past them).
    pub(super) redo: Vec<u32>,
    /// The drafts of the span under way, and the whole span: `redo`, the token to feed, the
    /// drafts.
    pub(super) drafts: Vec<u32>,
    pub(super) span: Vec<u32>,
    /// The sequence before the span, to rewind to when a draft is rejected, and the last
    /// mark, whose state copies the next one reuses.
    mark: Option<SeqMark<B>>,
    spare: Option<SeqMark<B>>,
}

/// Where a request's drafts come from: a drafter on the host, or the engine's draft model
/// with the request's draft state, its tokens so far and its draft length now.
enum Drafts<B: Backend> {
    Host(Box<dyn Drafter + Send>),
    Model {
        state: DraftState<B>,
        tokens: Vec<u32>,
        length: usize,
    },
}

impl<B: Backend> Speculation<B> {
    /// `state`: the request's draft-model state, when it drafts with the draft model (an
    /// error without it).
    pub(super) fn new(
        spec: &Speculate,
        prompt: &[u32],
        state: Option<DraftState<B>>,
    ) -> Result<Self, EngineError> {
        let drafter = match (spec.drafter(prompt), state) {
            (Some(host), _) => Drafts::Host(host),
            (None, Some(state)) => Drafts::Model {
                state,
                tokens: prompt.to_vec(),
                length: spec.max_draft.min(4),
            },
            (None, None) => return Err(EngineError::NoDraftModel),
        };
        Ok(Self {
            drafter,
            max_draft: spec.max_draft,
            misses: 0,
            pause: 0,
            redo: Vec::new(),
            drafts: Vec::new(),
            span: Vec::new(),
            mark: None,
            spare: None,
        })
    }

    /// Lays out the next span after `feed`, with drafts when `room` allows them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn plan(
        &mut self,
        model: &Model<B>,
        be: &B,
        draft: Option<&mut Drafting<B>>,
        seq: &mut SeqState<B>,
        feed: u32,
        room: usize,
        max_rows: usize,
    ) -> Result<(), EngineError> {
        // A span fits a step's workspace on its own; no drafts behind re-read tokens or while
        // paused.
        let room = if self.redo.is_empty() && self.pause == 0 {
            room.min(max_rows.saturating_sub(1))
        } else {
            0
        };
        self.pause = self.pause.saturating_sub(1);
        // Every row of a span runs in one sparse mode: the mode decoding it token by token
        // would give, so a span never crosses from dense to sparse (SPEC §5.2).
        let dense_len = model.config.sparse.dense_len;
        let read = seq.pos + self.redo.len() + 1;
        let room = if read < dense_len {
            room.min(dense_len - 1 - read)
        } else {
            room
        };
        let max = room.min(self.max_draft);
        self.drafts = match (&mut self.drafter, draft) {
            (Drafts::Host(d), _) => d.draft(max),
            // The draft model reads what the target read since its last call, drafting or not.
            (
                Drafts::Model {
                    state,
                    tokens,
                    length,
                },
                Some(d),
            ) => d.model.propose(
                be,
                model,
                &mut d.workspace,
                state,
                seq,
                tokens,
                max.min(*length),
            )?,
            (Drafts::Model { .. }, None) => {
                return Err(BackendError("no draft model is loaded".into()).into())
            }
        };
        self.span.clear();
        self.span.extend(&self.redo);
        self.span.push(feed);
        self.span.extend(&self.drafts);
        self.mark = if self.drafts.is_empty() {
            None
        } else {
            Some(model.mark_with(be, seq, self.spare.take())?)
        };
        Ok(())
    }

    /// After the span's tokens were chosen: `taken` the tokens committed, `stood` how many
    /// drafts stood. Rewinds `seq` where a draft fell.
    pub(super) fn settle(
        &mut self,
        model: &Model<B>,
        be: &B,
        seq: &mut SeqState<B>,
        taken: &[u32],
        stood: usize,
    ) -> Result<(), EngineError> {
        let drafted = self.drafts.len();
        match &mut self.drafter {
            Drafts::Host(d) => {
                d.extend(taken);
                d.verified(drafted, stood);
            }
            Drafts::Model { tokens, length, .. } => {
                tokens.extend_from_slice(taken);
                *length = crate::draft::adapt_length(*length, self.max_draft, drafted, stood);
            }
        }
        if drafted > 0 {
            if stood == 0 {
                self.misses += 1;
                self.pause = (1usize << self.misses.min(16)).min(SPECULATE_MAX_PAUSE);
            } else {
                self.misses = 0;
            }
        }
        if stood < drafted {
            let mark = self.mark.as_ref().ok_or_else(|| {
                EngineError::from(BackendError("a span with drafts has no mark".into()))
            })?;
            let keep = self.redo.len() + 1 + stood;
            // Into the span where the backend replays (a span short enough, a head size its
            // stepping kernels take); else back to the mark, the taken tokens read again.
            let short = self.span.len() <= sala_model::STEPWISE_SPAN_ROWS;
            if short && model.rewind_to(be, seq, mark, keep).is_ok() {
                self.redo.clear();
            } else {
                model.rewind(be, seq, mark)?;
                self.redo = self.span[..keep].to_vec();
            }
        } else {
            self.redo.clear();
        }
        if let Some(mark) = self.mark.take() {
            self.spare = Some(mark);
        }
        self.drafts.clear();
        self.span.clear();
        Ok(())
    }
}
