//! Continuous batching: many requests in flight on one engine. Each [`Engine::step`] reads
//! one prompt chunk of the oldest request still reading its prompt, samples a token for every
//! request whose logits are ready, and feeds all of those tokens through one batched decode
//! step ([`sala_model::Model::decode_batch`]). A request's tokens do not depend on the others
//! in the batch: every op treats rows independently, and each request has its own sampler.

use crate::generate::{request_tokens, Engine, EngineError, FinishReason, Step, TokenStream};
use rayon::prelude::*;
use sala_model::memory::MemoryPlan;
use sala_model::{Backend, BackendError, LogitRows, SeqState, StepInput};

pub type RequestId = u64;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// What a step reports about a request, in order: `Prefilled`, then `Step`s (as
/// [`Engine::generate_steps`] reports them, the flushed text last), then `Done`. After
/// `Done` the request has left the batch.
#[derive(Debug)]
pub enum BatchEvent<'a> {
    Prefilled { prompt_tokens: usize },
    Step(Step<'a>),
    Done(Result<Finished, EngineError>),
}

struct Member<B: Backend> {
    id: RequestId,
    seq: SeqState<B>,
    prompt: Vec<u32>,
    /// Prompt tokens read so far.
    read: usize,
    stream: TokenStream,
    /// Tokens the sequence may reach (prompt + budget): what its memory was planned for.
    total: usize,
    logits: Option<Vec<f32>>,
    feed: Option<u32>,
    /// Set when the request has ended (its `Done` is sent as the step ends).
    done: Option<Result<FinishReason, EngineError>>,
}

/// The requests in flight.
pub struct Batch<B: Backend> {
    members: Vec<Member<B>>,
    next_id: RequestId,
    max_batch: usize,
}

impl<B: Backend> Batch<B> {
    /// A batch of at most `max_batch` requests (at least 1).
    pub fn new(max_batch: usize) -> Self {
        Self {
            members: Vec::new(),
            next_id: 0,
            max_batch: max_batch.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether another request may be admitted.
    pub fn has_room(&self) -> bool {
        self.members.len() < self.max_batch
    }

    /// Drops the requests for which `gone` is true at once (their memory is freed); returns
    /// their ids. No event is sent for them.
    pub fn cancel_where(&mut self, mut gone: impl FnMut(RequestId) -> bool) -> Vec<RequestId> {
        let mut ids = Vec::new();
        self.members.retain(|m| {
            let drop = gone(m.id);
            if drop {
                ids.push(m.id);
            }
            !drop
        });
        ids
    }
}

impl<B: Backend> Engine<B> {
    /// Admits a request: checks it (an empty prompt, the context budget, and the memory plan
    /// of every sequence in the batch together with this one) and allocates its caches. Its
    /// prompt is read by the following [`Engine::step`]s.
    pub fn admit(
        &mut self,
        batch: &mut Batch<B>,
        prompt: Vec<u32>,
        opts: &crate::generate::GenerateOptions,
        logprobs: Option<usize>,
    ) -> Result<RequestId, EngineError> {
        if !batch.has_room() || batch.len() >= self.max_batch() {
            return Err(EngineError::Backend(BackendError(format!(
                "the batch is full ({} requests)",
                batch.len()
            ))));
        }
        let total = request_tokens(prompt.len(), opts)?;
        if let Some((limit, target)) = self.memory_limit() {
            // This request's plan, plus the caches of the sequences already in flight.
            let mut plan = self.memory_plan(total, target);
            for m in &batch.members {
                let other = MemoryPlan::new(&self.model.config, m.total, 1, target).cache;
                plan.cache.kv += other.kv;
                plan.cache.compressed += other.compressed;
                plan.cache.lightning_state += other.lightning_state;
            }
            plan.check(&limit)?;
        }
        let stream = TokenStream::new(
            &self.tokenizer,
            self.model.config.vocab_size,
            &prompt,
            opts,
            total - prompt.len(),
            logprobs,
        )?;
        let mut seq = self.model.new_sequence(&self.backend)?;
        self.model.reserve(&self.backend, &mut seq, total)?;
        let id = batch.next_id;
        batch.next_id += 1;
        batch.members.push(Member {
            id,
            seq,
            prompt,
            read: 0,
            stream,
            total,
            logits: None,
            feed: None,
            done: None,
        });
        Ok(id)
    }

    /// One scheduler step (see the module docs). `on_event(id, event)` hears of every
    /// request's progress; returning `false` from a token step cancels that request.
    /// A request for which `ready(id)` is false (e.g. its client is not reading) generates
    /// nothing this step and keeps its place. Requests that end leave the batch before this
    /// returns.
    pub fn step(
        &mut self,
        batch: &mut Batch<B>,
        ready: &dyn Fn(RequestId) -> bool,
        on_event: &mut dyn FnMut(RequestId, BatchEvent<'_>) -> bool,
    ) {
        // 1. A token for every request whose logits are ready: sampled for all of them at
        // once (each stream has its own sampler, so the threads change no result), then
        // reported in batch order.
        let mut picked: Vec<(&mut Member<B>, Vec<f32>)> = batch
            .members
            .iter_mut()
            .filter(|m| m.done.is_none() && ready(m.id))
            .filter_map(|m| m.logits.take().map(|l| (m, l)))
            .collect();
        let choices: Vec<_> = picked
            .iter_mut()
            .map(|(m, l)| (&mut m.stream, l.as_slice()))
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|(stream, logits)| stream.choose(logits))
            .collect();
        for ((m, _), choice) in picked.into_iter().zip(choices) {
            let id = m.id;
            let mut report = |s: Step<'_>| on_event(id, BatchEvent::Step(s));
            match choice.and_then(|c| match c {
                Some(c) => m.stream.commit(c, &mut report),
                None => Ok(None),
            }) {
                Ok(Some(next)) => m.feed = Some(next),
                Ok(None) => m.done = Some(m.stream.finish(&mut report)),
                Err(e) => m.done = Some(Err(e)),
            }
        }
        // 2. One forward pass over the step's token budget (the workspace's rows): every
        // token to feed first, then prompt chunks, oldest request first, each the next whole
        // chunk of its prompt (cut where reading it alone cuts it, so its results are the
        // same) while they fit. The budget holds a chunk beside a row for each request.
        let (be, model) = (&self.backend, &self.model);
        let (budget, chunk) = (self.workspace.max_rows, self.workspace.chunk);
        let mut used = 0;
        let mut plan: Vec<(usize, usize)> = Vec::new();
        for (i, m) in batch.members.iter().enumerate() {
            if m.done.is_none() && m.feed.is_some() && used < budget {
                plan.push((i, 1));
                used += 1;
            }
        }
        for (i, m) in batch.members.iter().enumerate() {
            let n = chunk.min(m.prompt.len() - m.read);
            if m.done.is_none() && n > 0 && used + n <= budget {
                plan.push((i, n));
                used += n;
            }
        }
        if plan.is_empty() {
            return self.retire(batch, on_event);
        }
        let mut inputs = Vec::with_capacity(plan.len());
        let mut order = plan.iter().map(|&(i, _)| i).peekable();
        for (i, m) in batch.members.iter_mut().enumerate() {
            if order.peek() != Some(&i) {
                continue;
            }
            order.next();
            let n = plan.iter().find(|p| p.0 == i).map_or(0, |p| p.1);
            let (tokens, mode, last) = match &m.feed {
                Some(t) => (
                    std::slice::from_ref(t),
                    model.sparse_mode(m.seq.pos + 1),
                    true,
                ),
                None => (
                    &m.prompt[m.read..m.read + n],
                    model.sparse_mode(m.prompt.len()),
                    m.read + n == m.prompt.len(),
                ),
            };
            inputs.push((
                i,
                StepInput {
                    seq: &mut m.seq,
                    tokens,
                    mode,
                    logits: if last {
                        LogitRows::Last
                    } else {
                        LogitRows::None
                    },
                },
            ));
        }
        // Inputs in row order: the decode rows, then the prompt chunks.
        let rank = |i: usize| plan.iter().position(|p| p.0 == i).unwrap_or(usize::MAX);
        inputs.sort_by_key(|(i, _)| rank(*i));
        let (who, mut step): (Vec<usize>, Vec<StepInput<'_, B>>) = inputs.into_iter().unzip();
        let result = model.forward(be, &mut self.workspace, &mut step);
        drop(step);
        match result {
            Ok(logits) => {
                for (&i, logits) in who.iter().zip(logits) {
                    let m = &mut batch.members[i];
                    if m.feed.take().is_none() {
                        let n = plan.iter().find(|p| p.0 == i).map_or(0, |p| p.1);
                        m.read += n;
                        if m.read < m.prompt.len() {
                            continue;
                        }
                        let prompt_tokens = m.prompt.len();
                        on_event(m.id, BatchEvent::Prefilled { prompt_tokens });
                    }
                    m.logits = Some(logits);
                }
            }
            Err(e) => {
                for &i in &who {
                    batch.members[i].done = Some(Err(BackendError(e.0.clone()).into()));
                }
            }
        }
        self.retire(batch, on_event)
    }

    /// Ended requests leave the batch, each with its `Done`.
    fn retire(
        &mut self,
        batch: &mut Batch<B>,
        on_event: &mut dyn FnMut(RequestId, BatchEvent<'_>) -> bool,
    ) {
        let mut i = 0;
        while i < batch.members.len() {
            if batch.members[i].done.is_some() {
                let m = batch.members.remove(i);
                let done = m.done.expect("checked above").map(|finish| Finished {
                    finish,
                    prompt_tokens: m.prompt.len(),
                    completion_tokens: m.stream.tokens.len(),
                });
                on_event(m.id, BatchEvent::Done(done));
            } else {
                i += 1;
            }
        }
    }
}
