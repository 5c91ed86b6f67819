//! One engine step over the requests in flight, and the [`Batch`] that holds them.
//!
//! [`Engine::step`] samples a token for every request whose logits are ready (all at once:
//! each request has its own sampler, so the threads change no result), then runs one forward
//! pass over the rows the [`Scheduler`] plans: decode rows first, then whole prompt chunks.
//! Meanwhile the grammars of the requests whose logits it makes (structured output) compute
//! their next masks on rayon's threads, so that sampling finds them ready.
//! Each request's [`Client`] hears of its progress. A request's tokens do not depend on the
//! others in the batch: every op treats rows independently, and a prompt is cut where reading
//! it alone cuts it.
//!
//! A panic inside one request's work (its sampling, its grammar's mask, its text, stop strings
//! and events) fails that request only, with [`EngineError::Panicked`]; one inside the shared
//! forward pass fails the requests it served in that step, and the others go on.

use crate::cache::{CacheBudget, Lease, Refusal};
use crate::context::PendingRead;
use crate::draft::DraftSource;
use crate::generate::{
    isolated, request_tokens, Engine, EngineError, GenerateOptions, Step, TokenStream,
};
use crate::prefix::{PrefixCache, Shared};
use crate::request::{FinishReason, PromptLogprobs, RequestId};
use crate::sampling::{prompt_token_logprobs, PromptTokenLogprobs, SampledToken};
use crate::scheduler::{Scheduler, Want, Work};
use rayon::prelude::*;
use sala_model::draft::{DraftModel, DraftWorkspace, DRAFT_CONTEXT_ROWS};
use sala_model::{Backend, BackendError, LogitRows, SeqMark, SeqState, StepInput, StepLogits};

/// The engine's draft model and the scratch buffers of its steps.
pub struct Drafting<B: Backend> {
    pub model: DraftModel<B>,
    pub(crate) workspace: DraftWorkspace<B>,
}

/// How a request ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache (not read again).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// The generated text and tokens.
    pub text: String,
    pub tokens: Vec<SampledToken>,
}

/// What a step reports about a request, in order: `Read` for each prompt chunk, `Prefilled`,
/// then `Token`s (as [`Engine::generate_steps`] reports them, the flushed text last), then
/// `Done`. After `Done` the request has left the batch.
#[derive(Debug)]
pub enum StepEvent<'a> {
    /// A chunk of `tokens` prompt tokens was read.
    Read {
        tokens: usize,
    },
    /// The whole prompt is read; with its tokens' log-probabilities when they were asked for
    /// ([`GenerateOptions::prompt_logprobs`]).
    Prefilled {
        prompt_tokens: usize,
        logprobs: Option<&'a PromptLogprobs>,
    },
    Token(Step<'a>),
    Done(Result<Finished, EngineError>),
}

/// What a client may ask while it hears an event: the memory the batch's caches hold.
pub struct StepContext<'a> {
    cache: &'a CacheBudget,
    probe: &'a dyn Fn() -> Option<usize>,
}

impl StepContext<'_> {
    /// Bytes the caches of the requests in flight hold, by the memory formula.
    pub fn cache_held(&self) -> usize {
        self.cache.held_bytes()
    }

    /// Bytes the caches hold by the backend's count, or by their plans where it cannot tell.
    pub fn cache_in_use(&self) -> usize {
        self.cache.in_use((self.probe)())
    }
}

/// Whoever waits for a request's results.
pub trait Client {
    /// Whether it can take a step's events now; a client that cannot pauses only its own
    /// request (it generates nothing and keeps its place).
    fn ready(&self) -> bool {
        true
    }

    /// Hears of the request's progress. Returning `false` from a `Token` event cancels the
    /// request at once.
    fn event(&mut self, event: StepEvent<'_>, cx: &StepContext<'_>) -> bool;
}

impl<F: FnMut(StepEvent<'_>) -> bool> Client for F {
    fn event(&mut self, event: StepEvent<'_>, _: &StepContext<'_>) -> bool {
        self(event)
    }
}

struct Member<B: Backend, C> {
    id: RequestId,
    seq: SeqState<B>,
    prompt: Vec<u32>,
    /// Prompt tokens read so far.
    read: usize,
    stream: TokenStream,
    /// Its share of the cache budget, held while it is in the batch.
    lease: Option<Lease>,
    logits: Option<StepLogits>,
    /// The prompt's log-probabilities so far, when asked for; dropped once reported.
    prompt_logprobs: Option<PromptLogprobs>,
    feed: Option<u32>,
    /// Set when the request has ended (its `Done` is sent as the step ends).
    done: Option<Result<FinishReason, EngineError>>,
    /// The request whose state this one copies once that one has read the (same) prompt,
    /// instead of reading it again ([`Engine::admit_copy`]).
    copy_of: Option<RequestId>,
    /// Its speculative decoding, when asked for.
    spec: Option<Speculation<B>>,
    /// Whether it goes to the prefix cache when it ends; how many snapshots of its lightning
    /// states it keeps as its prompt is read (their memory counted in its lease; 0: none),
    /// and those snapshots (ascending).
    parks: bool,
    snapshot_cap: usize,
    snapshots: Vec<SeqMark<B>>,
    /// Prompt tokens it took from the prefix cache, and the cache memory its sequence maps
    /// from the parked one it was forked from.
    cached: usize,
    shares: Option<Shared>,
    /// Its prompt's read by the context-parallel ranks, while in progress (some of it each
    /// step; the steps read nothing of its prompt meanwhile).
    context: Option<PendingRead<B>>,
    client: C,
}

mod ahead;
mod beside;
mod speculation;
use beside::beside;
use speculation::Speculation;
pub use speculation::SPECULATE_MAX_PAUSE;

/// Most decode rows a step may hold for its requests to speculate: past them a step is bound
/// by the weights it reads anyway, and verifying drafts would only add rows.
pub const SPECULATE_MAX_REQUESTS: usize = 8;

impl<B: Backend, C> Member<B, C> {
    /// Where it takes snapshots, one of its sequence now (at the end of a prompt chunk),
    /// the oldest thinned past its cap.
    fn snapshot(&mut self, model: &sala_model::Model<B>, be: &B) -> Result<(), EngineError> {
        if self.snapshot_cap > 0 {
            self.snapshots.push(model.snapshot(be, &self.seq)?);
            crate::prefix::thin_snapshots(&mut self.snapshots, self.snapshot_cap);
        }
        Ok(())
    }

    fn want(&self) -> Want {
        match (&self.done, self.feed) {
            (Some(_), _) => Want::Nothing,
            (None, Some(_)) => match &self.spec {
                Some(spec) if spec.span.len() > 1 => Want::Span {
                    rows: spec.span.len(),
                },
                _ => Want::Decode,
            },
            // It waits for the prompt's state to copy, or for the ranks to read it.
            (None, None) if self.copy_of.is_some() || self.context.is_some() => Want::Nothing,
            (None, None) if self.read < self.prompt.len() => Want::Prompt {
                read: self.read,
                len: self.prompt.len(),
                scored: self.prompt_logprobs.is_some(),
                from: self.cached,
            },
            // Its logits wait to be sampled.
            (None, None) => Want::Nothing,
        }
    }
}

/// The requests in flight, oldest first, each with its sequence, its sampler and its client:
/// the one registry of requests. Its cache budget holds a lease for each.
pub struct Batch<B: Backend, C> {
    members: Vec<Member<B, C>>,
    next_id: RequestId,
    max_batch: usize,
    cache: CacheBudget,
    /// A step queued whose greedy picks are still on the device: the requests it gave a row,
    /// in row order ([`sala_model::Model::forward_ahead`]).
    ahead: Option<Vec<RequestId>>,
}

impl<B: Backend, C> Batch<B, C> {
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Most requests it may hold.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Whether another request may be admitted.
    pub fn has_room(&self) -> bool {
        self.members.len() < self.max_batch
    }

    /// The memory budget its requests were admitted under.
    pub fn cache(&self) -> &CacheBudget {
        &self.cache
    }

    /// Ids of the requests in flight, oldest first.
    pub fn ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.members.iter().map(|m| m.id)
    }

    /// Whether any client can take events now.
    pub fn any_ready(&self) -> bool
    where
        C: Client,
    {
        self.members.iter().any(|m| m.client.ready())
    }

    /// Drops at once the requests for which `gone(id, client)` is true (their memory is
    /// freed) and returns them with their clients. No event is sent for them.
    pub fn cancel_where(
        &mut self,
        mut gone: impl FnMut(RequestId, &C) -> bool,
    ) -> Vec<(RequestId, C)> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.members.len() {
            if gone(self.members[i].id, &self.members[i].client) {
                let m = self.take(i);
                out.push((m.id, m.client));
            } else {
                i += 1;
            }
        }
        out
    }

    /// Removes member `i`, its lease released (its sequence is freed when the member drops).
    fn take(&mut self, i: usize) -> Member<B, C> {
        let mut m = self.members.remove(i);
        if let Some(lease) = m.lease.take() {
            self.cache.release(lease);
        }
        if m.context.take().is_some() {
            self.cache.set_reading(0);
        }
        m
    }
}

impl<B: Backend> Engine<B> {
    /// Whether the sparse layers read `prompt` sparsely (by its whole length).
    fn reads_sparsely(&self, prompt: &[u32]) -> bool {
        self.model.sparse_mode(prompt.len()) == sala_model::SparseMode::Sparse
    }

    /// An empty batch for this engine: at most [`Engine::max_batch`] requests, admitted
    /// under the engine's memory limit.
    pub fn batch<C>(&self) -> Batch<B, C> {
        Batch {
            members: Vec::new(),
            next_id: 0,
            max_batch: self.max_batch(),
            cache: self.cache_budget(),
            ahead: None,
        }
    }

    /// Admits a request: checks it (an empty prompt, the context budget, and its memory
    /// beside the batch's in the cache budget) and allocates its caches. Its prompt is read
    /// by the following [`Engine::step`]s, and `client` hears of it.
    pub fn admit<C>(
        &mut self,
        batch: &mut Batch<B, C>,
        prompt: Vec<u32>,
        opts: &GenerateOptions,
        logprobs: Option<usize>,
        client: C,
    ) -> Result<RequestId, EngineError> {
        if !batch.has_room() || batch.len() >= self.max_batch() {
            return Err(EngineError::BatchFull {
                requests: batch.len(),
            });
        }
        let total = request_tokens(prompt.len(), opts)?;
        let prompt_logprobs = opts.prompt_logprobs.map(|top| PromptLogprobs {
            top,
            tokens: Vec::with_capacity(prompt.len() - 1),
        });
        let id = batch.next_id;
        let speculates = opts.speculate.as_ref().filter(|s| s.max_draft > 0);
        let draft_bytes = match (speculates, &self.draft) {
            (Some(s), Some(d)) if s.drafts == DraftSource::Model => {
                d.model.state_bytes(&self.model, prompt.len(), total)
            }
            _ => 0,
        };
        // The prefix cache serves requests that read no prompt logprobs and whose drafts
        // need no hidden states of the prompt (a draft model's).
        let parks = self.prefix.is_some()
            && opts.prompt_logprobs.is_none()
            && !speculates.is_some_and(|s| s.drafts == DraftSource::Model);
        // A snapshot at each prompt chunk's end (and its tail cut), at most MAX_SNAPSHOTS kept.
        let chunk = self.workspace.chunk.max(1);
        let cuts = prompt.len().div_ceil(chunk).max(1)
            + crate::scheduler::tail_cut(prompt.len(), chunk).is_some() as usize;
        let cap = cuts.min(crate::prefix::MAX_SNAPSHOTS);
        let snapshot_bytes = cap * batch.cache.snapshot_bytes();
        // The parked sequence it would resume from, found first so that making room never
        // evicts it: where the backend shares a fork's memory with its source, the source's
        // caches below the resume point are this request's too (counted in its lease, not
        // again as parked).
        let sparse = self.reads_sparsely(&prompt);
        let mut hit = match &self.prefix {
            Some(cache) if parks => cache.find(&prompt, sparse),
            _ => None,
        };
        // The cache pages below the resume point, shared where the backend shares them.
        let backend_shares = self.backend.shares_cache_prefixes();
        let shared = |cache: &CacheBudget, hit: Option<crate::prefix::Hit>| {
            hit.filter(|_| backend_shares).map(|h| Shared {
                source: h.id,
                bytes: cache.shared_bytes(h.pos),
            })
        };
        // Other parked sequences make room for it, least recently used first; then it takes
        // no snapshots; then it gives up its hit (the prefix cache never refuses a request).
        let mut snapshots_on = parks;
        let lease = loop {
            let parked = parked_bytes(&self.prefix, &batch.members, shared(&batch.cache, hit));
            batch.cache.set_parked(parked);
            let state_bytes = draft_bytes + if snapshots_on { snapshot_bytes } else { 0 };
            let source = hit.map(|h| h.id);
            match batch
                .cache
                .admit(id, total, prompt.len(), speculates.is_some(), state_bytes)
            {
                Ok(lease) => break lease,
                Err(Refusal::Busy(_))
                    if self
                        .prefix
                        .as_mut()
                        .is_some_and(|p| p.evict_one_but(source)) => {}
                Err(_) if snapshots_on => snapshots_on = false,
                Err(Refusal::Busy(_)) if hit.is_some() => {
                    if let Some(p) = self.prefix.as_mut() {
                        p.evict_one();
                    }
                    hit = None;
                }
                Err(Refusal::TooLarge(e)) => return Err(EngineError::OverBudget(e)),
                Err(Refusal::Busy(e)) => return Err(EngineError::MemoryBusy(e)),
            }
        };
        // A prefix-cache hit: a fork of the parked sequence where this prompt resumes (where
        // the backend fails to make one, the prompt is read whole).
        let resume = match self.prefix.as_mut().filter(|_| parks) {
            Some(cache) => cache
                .fork(&self.model, &self.backend, &prompt, hit)
                .unwrap_or(None),
            None => None,
        };
        let shares = shared(&batch.cache, hit.filter(|_| resume.is_some()));
        let parked = parked_bytes(&self.prefix, &batch.members, shares);
        batch.cache.set_parked(parked);
        // The ranks read one prompt at a time: while they read one, others are the steps'.
        let ranks_free = !batch.members.iter().any(|m| m.context.is_some());
        let started = (|| {
            let stream = TokenStream::new(
                &self.tokenizer,
                self.model.config.vocab_size,
                &prompt,
                opts,
                total - prompt.len(),
                logprobs,
            )?;
            let (mut seq, cached) = match resume {
                Some(r) => (r.seq, r.pos),
                None => (self.model.new_sequence(&self.backend)?, 0),
            };
            self.model.reserve(&self.backend, &mut seq, total)?;
            // With the draft model, the target keeps the hidden states the draft reads.
            let drafts = opts
                .speculate
                .as_ref()
                .is_some_and(|s| s.max_draft > 0 && s.drafts == DraftSource::Model);
            let draft_state = match (drafts, self.draft.as_ref()) {
                (false, _) => None,
                (true, None) => return Err(EngineError::NoDraftModel),
                (true, Some(d)) => {
                    let from = prompt.len().saturating_sub(DRAFT_CONTEXT_ROWS);
                    seq.aux = Some(d.model.capture(&self.backend, &self.model, from)?);
                    Some(d.model.new_state(&self.backend, &self.model)?)
                }
            };
            // A long prompt read from the start by the context-parallel ranks, over several
            // steps: all of it but its last token (read by the steps, for its logits), or,
            // where it takes snapshots, up to its tail cut (snapshotted there, as the steps
            // would, so a follow-up on the same document resumes there).
            let block = self.model.config.sparse.block_size;
            let ranks_read = match crate::scheduler::tail_cut(prompt.len(), chunk) {
                Some(cut) if snapshots_on => cut,
                _ => prompt.len() - 1,
            };
            let context = match &self.context {
                Some(ranks)
                    if cached == 0
                        && !drafts
                        && opts.prompt_logprobs.is_none()
                        && ranks.takes(ranks_read + 1, block) =>
                {
                    if !ranks_free {
                        ranks.count_busy();
                        return Ok((stream, seq, draft_state, cached, None));
                    }
                    let n = ranks_read;
                    let mode = self.model.sparse_mode(prompt.len());
                    let (be, model, budget) = (&self.backend, &self.model, &batch.cache);
                    let ws = &mut self.workspace;
                    ranks.start(be, model, ws, budget, &mut seq, &prompt[..n], mode)?
                }
                _ => None,
            };
            Ok::<_, EngineError>((stream, seq, draft_state, cached, context))
        })();
        let (stream, seq, draft_state, cached, context) = match started {
            Ok(s) => s,
            Err(e) => {
                batch.cache.release(lease);
                return Err(e);
            }
        };
        let spec = opts
            .speculate
            .as_ref()
            .filter(|s| s.max_draft > 0)
            .map(|s| Speculation::new(s, &prompt, draft_state))
            .transpose();
        let spec = match spec {
            Ok(spec) => spec,
            Err(e) => {
                batch.cache.release(lease);
                return Err(e);
            }
        };
        if let Some(p) = &context {
            batch.cache.set_reading(p.bytes);
        }
        batch.next_id += 1;
        batch.members.push(Member {
            id,
            seq,
            prompt,
            read: cached,
            stream,
            lease: Some(lease),
            logits: None,
            prompt_logprobs,
            feed: None,
            done: None,
            copy_of: None,
            spec,
            parks,
            snapshot_cap: if snapshots_on { cap } else { 0 },
            snapshots: Vec::new(),
            cached,
            shares,
            context,
            client,
        });
        Ok(id)
    }

    /// [`Engine::admit`] for another choice of request `of`'s prompt: when `of` is in the
    /// batch with the same prompt, still unread (and reading the prompt logprobs this request
    /// asks for, if any), this request waits for it to be read and then copies its state,
    /// logits and prompt logprobs (the prompt is read once), or reads it itself where `of`
    /// fails first. Its results are the same either way.
    pub fn admit_copy<C>(
        &mut self,
        batch: &mut Batch<B, C>,
        of: RequestId,
        prompt: Vec<u32>,
        opts: &GenerateOptions,
        logprobs: Option<usize>,
        client: C,
    ) -> Result<RequestId, EngineError> {
        let unread = batch.members.iter().any(|m| {
            m.id == of
                && m.prompt == prompt
                && m.done.is_none()
                && m.read == 0
                && m.feed.is_none()
                && (opts.prompt_logprobs.is_none()
                    || m.prompt_logprobs.as_ref().map(|p| p.top) == opts.prompt_logprobs)
        });
        let id = self.admit(batch, prompt, opts, logprobs, client)?;
        if unread {
            if let Some(m) = batch.members.last_mut() {
                m.copy_of = Some(of);
            }
        }
        Ok(id)
    }

    /// One step (see the module docs). Requests that end leave the batch before it returns,
    /// each with its `Done`.
    pub fn step<C: Client>(&mut self, batch: &mut Batch<B, C>) {
        let probe = || {
            self.cache_probe
                .as_ref()
                .and_then(|p| p.cache_bytes_in_use(&self.backend))
        };
        let Batch {
            members,
            cache,
            ahead,
            ..
        } = batch;
        // 0. The picks of a step queued ahead, once the next step is queued where it can be:
        // every request of the batch decoding greedily, its token the pick before.
        let ran_ahead = match ahead.take() {
            Some(ids) => {
                let (model, backend) = (&self.model, &self.backend);
                ahead::collect(model, backend, &mut self.workspace, members, ids)
            }
            None => None,
        };
        // 0. A copy whose source is gone or failed reads its prompt itself.
        for i in 0..members.len() {
            if let Some(of) = members[i].copy_of {
                if !members.iter().any(|m| m.id == of && m.done.is_none()) {
                    members[i].copy_of = None;
                }
            }
        }
        // 1. A token for every request whose logits are ready and whose client can take it:
        // sampled for all of them at once, then reported in batch order.
        let mut picked: Vec<(&mut Member<B, C>, StepLogits)> = members
            .iter_mut()
            .filter(|m| m.done.is_none() && m.client.ready())
            .filter_map(|m| m.logits.take().map(|l| (m, l)))
            .collect();
        // Each request's tokens: one, or those of a verified span (and how many drafts stood).
        let choose =
            |stream: &mut TokenStream, drafts: &[u32], logits: &mut StepLogits| match logits {
                StepLogits::Rows(rows) if !drafts.is_empty() => stream.choose_span(rows, drafts),
                StepLogits::GreedyRows(picks) => stream.choose_span_greedy(picks, drafts),
                _ => Ok((stream.choose(logits)?.into_iter().collect(), 0)),
            };
        let mut work: Vec<(&mut TokenStream, &[u32], &mut StepLogits)> = picked
            .iter_mut()
            .map(|(m, l)| {
                let drafts = m.spec.as_ref().map_or(&[][..], |s| s.drafts.as_slice());
                (&mut m.stream, drafts, l)
            })
            .collect();
        let choices: Vec<_> = if work.len() == 1 {
            let (stream, drafts, l) = &mut work[0];
            vec![isolated("sampling", || choose(stream, drafts, l))]
        } else {
            work.into_par_iter()
                .map(|(stream, drafts, l)| isolated("sampling", || choose(stream, drafts, l)))
                .collect()
        };
        for ((m, _), choice) in picked.into_iter().zip(choices) {
            let Member {
                stream,
                lease,
                client,
                ..
            } = m;
            let mut report = |s: Step<'_>| {
                // The cache is counted for the prompt and every token sampled.
                if let (Some(_), Some(lease)) = (s.token, lease.as_mut()) {
                    let tokens = lease.tokens() + 1;
                    cache.grow(lease, tokens);
                }
                let cx = StepContext {
                    cache,
                    probe: &probe,
                };
                client.event(StepEvent::Token(s), &cx)
            };
            // A panic in the request's own work (its text, stop strings, events) fails it only.
            let mut taken = Vec::new();
            let outcome = choice.and_then(|(chosen, stood)| {
                let mut next = None;
                for c in chosen {
                    let id = c.id();
                    next = isolated("the request's output", || stream.commit(c, &mut report))?;
                    taken.push(id);
                    if next.is_none() {
                        break;
                    }
                }
                Ok((next, stood))
            });
            match outcome {
                Ok((Some(next), stood)) => {
                    m.feed = Some(next);
                    if let Some(spec) = m.spec.as_mut() {
                        self.speculated.drafted += spec.drafts.len() as u64;
                        self.speculated.accepted += stood as u64;
                        self.speculated.spans += u64::from(!spec.drafts.is_empty());
                        let settled = isolated("the request's speculation", || {
                            spec.settle(&self.model, &self.backend, &mut m.seq, &taken, stood)
                        });
                        if let Err(e) = settled {
                            m.done = Some(Err(e));
                        }
                    }
                }
                Ok((None, _)) => {
                    m.done = Some(isolated("the request's output", || {
                        stream.finish(&mut report)
                    }))
                }
                Err(e) => m.done = Some(Err(e)),
            }
        }

        // The rows queued ahead fed each request the token it just took: nothing to feed.
        if let Some(rows) = &ran_ahead {
            *ahead = Some(rows.iter().map(|&(id, _)| id).collect());
            for &(id, fed) in rows {
                let Some(m) = members.iter_mut().find(|m| m.id == id) else {
                    continue;
                };
                let took = m.feed.take();
                if m.done.is_none() && took != Some(fed) {
                    m.done = Some(Err(EngineError::Panicked(format!(
                        "the step run ahead fed token {fed}, the request took {took:?}"
                    ))));
                }
            }
        }

        // Spans of the requests that speculate: drafts while the batch is small.
        let decoding = members.iter().filter(|m| m.feed.is_some()).count();
        let max_rows = self.workspace.max_rows;
        for m in members.iter_mut() {
            let (Some(feed), None, Some(spec)) = (m.feed, &m.done, m.spec.as_mut()) else {
                continue;
            };
            if !spec.span.is_empty() {
                continue; // laid out already, not yet run
            }
            let room = if decoding <= SPECULATE_MAX_REQUESTS {
                m.stream.draft_room()
            } else {
                0
            };
            let started = std::time::Instant::now();
            let planned = isolated("the request's speculation", || {
                spec.plan(
                    &self.model,
                    &self.backend,
                    self.draft.as_mut(),
                    &mut m.seq,
                    feed,
                    room,
                    max_rows,
                )
            });
            self.speculated.draft_micros += started.elapsed().as_micros() as u64;
            if let Err(e) = planned {
                m.done = Some(Err(e));
            }
        }

        // A long prompt's context-parallel read: its next stages (about a chunk of each range
        // through every layer), between the other requests' steps. Once done, the rest of its
        // prompt is this step's.
        let reading = members
            .iter_mut()
            .find(|m| m.context.is_some() && m.done.is_none());
        if let (Some(ranks), Some(m)) = (&self.context, reading) {
            let tokens = m.context.as_ref().map_or(0, |p| p.tokens());
            let (be, model, ws) = (&self.backend, &self.model, &mut self.workspace);
            let advanced = isolated("the context-parallel read", || {
                Ok(ranks.advance(&mut m.context, be, model, ws, &mut m.seq)?)
            });
            if !matches!(advanced, Ok(false)) {
                m.context = None;
                cache.set_reading(0);
            }
            match advanced {
                Ok(true) => {
                    m.read = tokens;
                    if let Err(e) = m.snapshot(model, be) {
                        m.done = Some(Err(e));
                    }
                    let cx = StepContext {
                        cache,
                        probe: &probe,
                    };
                    let client = &mut m.client;
                    let heard = isolated("the request's events", || {
                        client.event(StepEvent::Read { tokens }, &cx);
                        Ok(())
                    });
                    if let Err(e) = heard {
                        m.done = Some(Err(e));
                    }
                }
                Ok(false) => {}
                Err(e) => m.done = Some(Err(e)),
            }
        }

        // 2. One forward pass over the rows the scheduler plans; the grammars of the requests
        // whose logits it makes compute their masks meanwhile, on another thread.
        let ws = &mut self.workspace;
        let wants: Vec<Want> = members.iter().map(Member::want).collect();
        let plan = Scheduler::new(ws.max_rows, ws.chunk).plan(&wants);
        // Every request decoding greedily: the step leaves its picks on the device, so that
        // the next one can be queued before they reach the host.
        let queue_ahead = ran_ahead.is_none()
            && !plan.is_empty()
            && plan.slots.len() == members.len()
            && self.backend.runs_ahead()
            && plan.slots.iter().all(|slot| {
                let m = &members[slot.index];
                slot.work == Work::Decode && m.runs_ahead()
            });
        if queue_ahead {
            let index: Vec<usize> = plan.slots.iter().map(|s| s.index).collect();
            let ids: Vec<RequestId> = index.iter().map(|&i| members[i].id).collect();
            let (model, backend) = (&self.model, &self.backend);
            if ahead::queue(model, backend, ws, members, &index, false) {
                *ahead = Some(ids);
            }
        } else if ran_ahead.is_none() && !plan.is_empty() {
            let model = &self.model;
            let mut slots: Vec<Option<&mut Member<B, C>>> = members.iter_mut().map(Some).collect();
            let mut inputs = Vec::with_capacity(plan.slots.len());
            let mut masks = Vec::new();
            for slot in &plan.slots {
                let Some(Member {
                    seq,
                    prompt,
                    feed,
                    stream,
                    prompt_logprobs,
                    spec,
                    ..
                }) = slots[slot.index].take()
                else {
                    unreachable!("a request has one slot in a step")
                };
                let (tokens, mode, last) = match (slot.work, feed.as_ref()) {
                    (Work::Decode, Some(t)) => (
                        std::slice::from_ref(t),
                        model.sparse_mode(seq.pos + 1),
                        true,
                    ),
                    (Work::Chunk { start, len }, _) => (
                        &prompt[start..start + len],
                        model.sparse_mode(prompt.len()),
                        start + len == prompt.len(),
                    ),
                    (Work::Span { .. }, _) => {
                        let span = spec.as_ref().map_or(&[][..], |s| s.span.as_slice());
                        (span, model.sparse_mode(seq.pos + span.len()), true)
                    }
                    (Work::Decode, None) => unreachable!("a decode row has a token to feed"),
                };
                let greedy = stream.takes_greedy_pick();
                if last {
                    masks.extend(stream.pending_constraint());
                }
                // Prompt logprobs take every row of a chunk; a greedy pick is made where the
                // logits are.
                let logits = match slot.work {
                    Work::Chunk { .. } if prompt_logprobs.is_some() => LogitRows::All,
                    Work::Span { .. } if greedy => LogitRows::GreedyAll,
                    Work::Span { .. } => LogitRows::All,
                    _ if last && greedy => LogitRows::Greedy,
                    _ if last => LogitRows::Last,
                    _ => LogitRows::None,
                };
                inputs.push(StepInput {
                    seq,
                    tokens,
                    mode,
                    logits,
                });
            }
            let backend = &self.backend;
            // A panic in the shared forward pass fails the requests it served; the rest go on.
            let result = isolated("the forward pass", || {
                #[cfg(test)]
                tests::forward_hook();
                beside(masks, || model.forward(backend, ws, &mut inputs)).map_err(Into::into)
            });
            drop(inputs);
            match result {
                Ok(logits) => {
                    let mut prefilled = Vec::new();
                    for (slot, mut logits) in plan.slots.iter().zip(logits) {
                        let m = &mut members[slot.index];
                        if let Work::Chunk { start, len } = slot.work {
                            if let Some(lp) = &mut m.prompt_logprobs {
                                // Every row at once to its next token's logprob; only the
                                // prompt's last row stays, for sampling.
                                let next =
                                    &m.prompt[start + 1..(start + len + 1).min(m.prompt.len())];
                                let (top, vocab) = (lp.top, model.config.vocab_size);
                                let mut rows = match logits {
                                    StepLogits::Rows(rows) => rows,
                                    StepLogits::Greedy(_) | StepLogits::GreedyRows(_) => Vec::new(),
                                };
                                let scored = isolated("the prompt's logprobs", || {
                                    score_rows(&rows, len, vocab, next, top)
                                });
                                match scored {
                                    Ok(scored) => lp.tokens.extend(scored),
                                    Err(e) => {
                                        m.done = Some(Err(e));
                                        continue;
                                    }
                                }
                                logits = StepLogits::Rows(if start + len == m.prompt.len() {
                                    rows.split_off((len - 1) * vocab)
                                } else {
                                    Vec::new()
                                });
                            }
                            m.read += len;
                            if let Err(e) = m.snapshot(model, backend) {
                                m.done = Some(Err(e));
                                continue;
                            }
                            let cx = StepContext {
                                cache,
                                probe: &probe,
                            };
                            let (read, client) = (m.read, &mut m.client);
                            let logprobs = m.prompt_logprobs.as_ref();
                            let heard = isolated("the request's events", || {
                                client.event(StepEvent::Read { tokens: len }, &cx);
                                if read == m.prompt.len() {
                                    let prompt_tokens = m.prompt.len();
                                    let prefilled = StepEvent::Prefilled {
                                        prompt_tokens,
                                        logprobs,
                                    };
                                    client.event(prefilled, &cx);
                                }
                                Ok(())
                            });
                            if let Err(e) = heard {
                                m.done = Some(Err(e));
                                continue;
                            }
                            if m.read < m.prompt.len() {
                                continue;
                            }
                        }
                        if matches!(slot.work, Work::Chunk { .. }) {
                            prefilled.push(slot.index);
                        }
                        // A span's rows from the token fed on (those read again before it
                        // were sampled already).
                        if let (Work::Span { .. }, Some(spec)) = (slot.work, m.spec.as_ref()) {
                            let vocab = model.config.vocab_size;
                            match &mut logits {
                                StepLogits::Rows(rows) => {
                                    *rows =
                                        rows.split_off((spec.redo.len() * vocab).min(rows.len()))
                                }
                                StepLogits::GreedyRows(picks) => {
                                    *picks = picks.split_off(spec.redo.len().min(picks.len()))
                                }
                                StepLogits::Greedy(_) => {}
                            }
                        }
                        m.feed = None;
                        m.logits = Some(logits);
                    }
                    // Requests waiting for these prompts copy their state, logits and prompt
                    // logprobs.
                    for &p in &prefilled {
                        for c in 0..members.len() {
                            if c == p || members[c].copy_of != Some(members[p].id) {
                                continue;
                            }
                            let (src, dst) = if p < c {
                                let (a, b) = members.split_at_mut(c);
                                (&a[p], &mut b[0])
                            } else {
                                let (a, b) = members.split_at_mut(p);
                                (&b[0], &mut a[c])
                            };
                            dst.copy_of = None;
                            dst.shares = None;
                            if let Err(e) = model.copy_sequence(backend, &src.seq, &mut dst.seq) {
                                // Part of the state may have been copied: no reading it again.
                                dst.done = Some(Err(e.into()));
                                continue;
                            }
                            dst.read = dst.prompt.len();
                            dst.logits = src.logits.clone();
                            if dst.prompt_logprobs.is_some() {
                                dst.prompt_logprobs = src.prompt_logprobs.clone();
                            }
                            let cx = StepContext {
                                cache,
                                probe: &probe,
                            };
                            let (client, len) = (&mut dst.client, dst.prompt.len());
                            let logprobs = dst.prompt_logprobs.take();
                            let heard = isolated("the request's events", || {
                                client.event(StepEvent::Read { tokens: len }, &cx);
                                let prefilled = StepEvent::Prefilled {
                                    prompt_tokens: len,
                                    logprobs: logprobs.as_ref(),
                                };
                                client.event(prefilled, &cx);
                                Ok(())
                            });
                            if let Err(e) = heard {
                                dst.done = Some(Err(e));
                            }
                        }
                    }
                    // Reported: the prompt logprobs are not held any longer.
                    for p in prefilled {
                        members[p].prompt_logprobs = None;
                    }
                }
                Err(e) => {
                    for slot in &plan.slots {
                        members[slot.index].done = Some(Err(e.shared()));
                    }
                }
            }
        }

        // 3. Ended requests leave the batch, each with its `Done`.
        let mut i = 0;
        while i < batch.members.len() {
            if batch.members[i].done.is_none() {
                i += 1;
                continue;
            }
            let mut m = batch.take(i);
            let parked = match (&self.prefix, &m.done) {
                (Some(_), Some(Ok(_))) if m.parks => held_tokens(&m),
                _ => None,
            };
            let sparse = self.reads_sparsely(&m.prompt);
            let done = m
                .done
                .take()
                .expect("checked above")
                .map(|finish| Finished {
                    finish,
                    prompt_tokens: m.prompt.len(),
                    cached_tokens: m.cached,
                    completion_tokens: m.stream.tokens.len(),
                    text: std::mem::take(&mut m.stream.text),
                    tokens: std::mem::take(&mut m.stream.tokens),
                });
            let cx = StepContext {
                cache: &batch.cache,
                probe: &probe,
            };
            // A panic here leaves the client without its end: its channel closes as it drops.
            let client = &mut m.client;
            let _ = isolated("the request's events", || {
                client.event(StepEvent::Done(done), &cx);
                Ok(())
            });
            if let (Some(cache), Some(tokens)) = (self.prefix.as_mut(), parked) {
                let mut seq = m.seq;
                let at_end = seq.pos == tokens.len()
                    || m.snapshots
                        .iter()
                        .find(|s| s.pos() == tokens.len())
                        .is_some_and(|s| self.model.rewind(&self.backend, &mut seq, s).is_ok());
                if at_end {
                    let bytes = batch.cache.sequence_bytes(tokens.len(), m.snapshots.len());
                    cache.park(seq, tokens, sparse, m.snapshots, bytes, m.shares);
                }
            }
            // Its lease is gone, and with it what its fork shared with a parked sequence.
            let parked = parked_bytes(&self.prefix, &batch.members, None);
            batch.cache.set_parked(parked);
        }
    }
}

/// Bytes the prefix cache's parked sequences add to the cache budget: theirs, less what the
/// requests in `members` (and one being admitted, `admitting`) map from them, which their
/// leases count already.
fn parked_bytes<B: Backend, C>(
    prefix: &Option<PrefixCache<B>>,
    members: &[Member<B, C>],
    admitting: Option<Shared>,
) -> usize {
    let Some(cache) = prefix else {
        return 0;
    };
    let forks = members.iter().filter_map(|m| m.shares).chain(admitting);
    cache.bytes().saturating_sub(cache.shared_with(forks))
}

/// The tokens an ended request's sequence holds, for the prefix cache: its prompt and the
/// tokens fed after it (each a token it sampled, in order). A request that speculated may
/// have read drafts past its last sampled token: it parks at its prompt's end (rewound to
/// its snapshot there), or not at all without one.
fn held_tokens<B: Backend, C>(m: &Member<B, C>) -> Option<Vec<u32>> {
    let (pos, prompt) = (m.seq.pos, &m.prompt);
    if m.spec.is_some() {
        return (pos >= prompt.len()).then(|| prompt.clone());
    }
    if pos <= prompt.len() {
        return Some(prompt[..pos].to_vec());
    }
    let fed = m.stream.tokens.get(..pos - prompt.len())?;
    Some(
        prompt
            .iter()
            .copied()
            .chain(fed.iter().map(|t| t.id))
            .collect(),
    )
}

/// The logprob of each row's next prompt token (`next[i]` follows row `i` of the `rows` rows
/// of `logits`; the last row has none when the prompt ends there), rows in parallel.
fn score_rows(
    logits: &[f32],
    rows: usize,
    vocab: usize,
    next: &[u32],
    top: usize,
) -> Result<Vec<PromptTokenLogprobs>, EngineError> {
    if logits.len() != rows * vocab || vocab == 0 {
        return Err(BackendError(format!(
            "the forward pass gave {} logits for {rows} rows of {vocab}",
            logits.len()
        ))
        .into());
    }
    Ok(logits
        .par_chunks(vocab)
        .zip(next.par_iter())
        .map(|(row, &id)| prompt_token_logprobs(row, id, top))
        .collect())
}

#[cfg(test)]
pub(crate) mod tests;
