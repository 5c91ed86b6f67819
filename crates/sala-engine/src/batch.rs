//! Continuous batching: many requests in flight on one engine. Each [`Engine::step`] reads
//! one prompt chunk of the oldest request still reading its prompt, samples a token for every
//! request whose logits are ready, and feeds all of those tokens through one batched decode
//! step ([`sala_model::Model::decode_batch`]). A request's tokens do not depend on the others
//! in the batch: every op treats rows independently, and each request has its own sampler.

use crate::generate::{request_tokens, Engine, EngineError, FinishReason, Step, TokenStream};
use rayon::prelude::*;
use sala_model::memory::MemoryPlan;
use sala_model::{Backend, BackendError, LogitRows, SeqState};

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
    /// Most requests a batch on this engine may hold: a decode step needs a workspace row
    /// per request.
    pub fn max_batch(&self) -> usize {
        self.prefill_chunk()
    }

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
        let (be, model) = (&self.backend, &self.model);
        let ws = &mut self.workspace;
        // 1. One chunk of the oldest prompt still being read.
        if let Some(m) = batch
            .members
            .iter_mut()
            .find(|m| m.done.is_none() && m.read < m.prompt.len())
        {
            let n = ws.max_rows.min(m.prompt.len() - m.read);
            let last = m.read + n == m.prompt.len();
            let mode = model.sparse_mode(m.prompt.len());
            let rows = if last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let chunk = &m.prompt[m.read..m.read + n];
            match model.forward(be, ws, &mut m.seq, chunk, mode, rows) {
                Ok(logits) => {
                    m.read += n;
                    if last {
                        m.logits = Some(logits);
                        let prompt_tokens = m.prompt.len();
                        on_event(m.id, BatchEvent::Prefilled { prompt_tokens });
                    }
                }
                Err(e) => m.done = Some(Err(e.into())),
            }
        }
        // 2. A token for every request whose logits are ready: sampled for all of them at
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
        // 3. One batched decode step for every token to feed.
        let mut fed: Vec<&mut Member<B>> = batch
            .members
            .iter_mut()
            .filter(|m| m.done.is_none() && m.feed.is_some())
            .collect();
        if !fed.is_empty() {
            let tokens: Vec<u32> = fed.iter_mut().filter_map(|m| m.feed.take()).collect();
            let mut seqs: Vec<&mut SeqState<B>> = fed.iter_mut().map(|m| &mut m.seq).collect();
            match model.decode_batch(be, ws, &mut seqs, &tokens) {
                Ok(logits) => {
                    let vocab = logits.len() / tokens.len();
                    for (m, row) in fed.iter_mut().zip(logits.chunks(vocab)) {
                        m.logits = Some(row.to_vec());
                    }
                }
                Err(e) => {
                    for m in fed.iter_mut() {
                        m.done = Some(Err(BackendError(e.0.clone()).into()));
                    }
                }
            }
        }
        // 4. Ended requests leave the batch.
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
