//! The engine thread: it owns the model and serves [`Request`]s from a bounded queue as one
//! continuous batch.
//!
//! [`spawn`] starts it and returns a [`Handle`] once the model is loaded; [`Handle::submit`]
//! queues a request and returns the receiver of its [`Event`]s. Dropping the receiver cancels
//! the request, in the batch or still waiting. A client that does not read pauses only its
//! own request, and, while others wait for its place or need its memory, for at most
//! [`Runner::pause_limit`]: then the request ends ([`RequestError::Stalled`]). A panic in one
//! request's work (admission, sampling, its grammar, its text and events) fails that request
//! only; one in the forward pass fails the requests of that step; anything else that panics in
//! a step fails the requests in flight. The thread goes on. An [`Observer`] hears of every
//! request's progress (for metrics), before its client does.

use crate::draft::Speculate;
use crate::generate::{Engine, GenerateOptions};
use crate::grammar::{Grammar, GrammarSpec, Grammars};
use crate::request::RequestId;
use crate::request::{Event, FinishReason, LogprobEntry, Prompt, Request, RequestError};
use crate::step::{Batch, Client, StepContext, StepEvent};
use sala_model::memory::MemoryLimit;
use sala_model::Backend;
use sala_tokenizer::Tokenizer;
use std::cell::Cell;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Requests decoded together unless [`Runner::max_batch`] says otherwise.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Events buffered per request before the engine waits for the client.
const EVENT_BUFFER: usize = 64;

/// How long a request may stay paused by a client that does not read while others wait for
/// its place or need its memory, unless [`Runner::pause_limit`] says otherwise.
pub const DEFAULT_PAUSE_LIMIT: Duration = Duration::from_secs(30);

/// A place in the queue, held from [`Handle::submit_choices`] until every request of its job
/// has left the waiting line (admitted, refused, or dropped because its client left).
struct QueueSlot(Arc<AtomicUsize>);

impl Drop for QueueSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the engine thread tells of its model once loaded.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    /// Most tokens one sequence may hold (prompt and output together).
    pub max_context: usize,
    pub backend: String,
    /// The model's tokenizer and chat template (or why it has none), so that callers can turn
    /// prompts into token ids off the engine thread ([`Handle::token_ids`]).
    pub tokenizer: Tokenizer,
    pub template: Arc<Result<sala_tokenizer::ChatTemplate, String>>,
    /// Special-token text in a chat request's own text is read as special tokens
    /// ([`Runner::special_tokens_in_content`]).
    pub specials_in_content: bool,
    /// Structured output's grammars for the model, so that callers compile a request's
    /// grammar off the engine thread ([`Handle::grammar`]).
    pub grammars: Arc<Grammars>,
    /// The memory budget with nothing admitted, so that callers can refuse a request whose
    /// choices could never be held at once ([`Handle::check_together`]).
    pub budget: crate::cache::CacheBudget,
}

/// Hears of every request's progress on the engine thread, before its client does. Every
/// method does nothing by default.
pub trait Observer: Send + Sync {
    /// A request was admitted: it holds a sequence, and its prompt has `prompt_tokens` tokens.
    fn admitted(&self, _prompt_tokens: usize) {}
    /// A token was generated at `now`; `since` is the request's arrival for its first token,
    /// else the previous token's time.
    fn token(&self, _now: Instant, _since: Instant, _first: bool) {}
    /// The caches of the requests in flight hold `held` bytes by the memory formula and
    /// `in_use` by the backend's count (or their plans where it cannot tell).
    fn cache(&self, _held: usize, _in_use: usize) {}
    /// Speculative decoding's totals so far ([`Engine::speculation_stats`]).
    fn speculation(&self, _totals: crate::generate::SpeculationStats) {}
    /// The prefix cache's totals so far and the bytes it holds ([`Engine::prefix_cache`]).
    fn prefix_cache(&self, _totals: crate::prefix::PrefixStats, _bytes: usize) {}
    /// Context parallelism's totals so far ([`Engine::context_stats`]), where the engine has
    /// ranks.
    fn context_parallel(&self, _totals: crate::context::ContextStats) {}
    /// An admitted request's sequence is gone.
    fn released(&self) {}
    /// A request ended, admitted or not: how it finished, or why it failed.
    fn finished(&self, _outcome: Result<FinishReason, &RequestError>) {}
}

/// An [`Observer`] that hears nothing.
pub struct NoObserver;

impl Observer for NoObserver {}

struct Job {
    request: Request,
    events: mpsc::Sender<Event>,
    /// When the request was queued: the start of its time to first token.
    queued: Instant,
    /// Other choices of the same prompt ([`Handle::submit_choices`]).
    also: Vec<(Request, mpsc::Sender<Event>)>,
    slot: QueueSlot,
}

/// Handed to the factory of [`spawn`] on the engine thread; [`Runner::run`] serves the queue
/// with an engine built there.
pub struct Runner {
    /// Set by [`Handle::end_all`]: fail everything in flight and waiting.
    ending: Arc<AtomicBool>,
    jobs: mpsc::Receiver<Job>,
    ready: std::sync::mpsc::Sender<Result<EngineInfo, String>>,
    max_context: Option<usize>,
    observer: Arc<dyn Observer>,
    /// The cap on the requests' memory plans.
    memory: Option<MemoryLimit>,
    /// Most requests decoded together (`None`: [`DEFAULT_MAX_BATCH`]).
    max_batch: Option<usize>,
    specials_in_content: bool,
    /// Speculative decoding's longest draft for every request (`None`: off).
    speculate: Option<Speculate>,
    /// How long a stalled client may hold its place while others wait.
    pause_limit: Duration,
}

/// The callers' end of the queue.
#[derive(Clone)]
pub struct Handle {
    jobs: mpsc::Sender<Job>,
    pub info: EngineInfo,
    /// Set by [`Handle::end_all`].
    ending: Arc<AtomicBool>,
    /// Jobs queued or waiting for room in the batch, and how many may be.
    waiting: Arc<AtomicUsize>,
    capacity: usize,
}

/// Starts the engine thread: `factory` runs there, builds the backend and the [`Engine`]
/// (backends need not be `Send`), and calls [`Runner::run`]. Returns once the model is
/// loaded, or with the factory's error. `max_context` caps each sequence (default: the
/// model's); `queue` is how many requests may wait.
pub fn spawn<F>(
    max_context: Option<usize>,
    queue: usize,
    observer: Arc<dyn Observer>,
    factory: F,
) -> Result<Handle, String>
where
    F: FnOnce(Runner) -> Result<(), String> + Send + 'static,
{
    let capacity = queue.max(1);
    let (jobs_tx, jobs_rx) = mpsc::channel(capacity);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let failed = ready_tx.clone();
    let ending = Arc::new(AtomicBool::new(false));
    let runner = Runner {
        ending: ending.clone(),
        jobs: jobs_rx,
        ready: ready_tx,
        max_context,
        observer,
        memory: None,
        max_batch: None,
        specials_in_content: false,
        speculate: None,
        pause_limit: DEFAULT_PAUSE_LIMIT,
    };
    std::thread::Builder::new()
        .name("sala-engine".into())
        .spawn(move || {
            if let Err(e) = factory(runner) {
                let _ = failed.send(Err(e));
            }
        })
        .map_err(|e| format!("starting the engine thread: {e}"))?;
    match ready_rx.recv() {
        Ok(Ok(info)) => Ok(Handle {
            jobs: jobs_tx,
            info,
            ending,
            waiting: Arc::new(AtomicUsize::new(0)),
            capacity,
        }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread ended before loading a model".into()),
    }
}

impl Handle {
    /// Queues a request; the receiver hears its events. Refused when the queue is full or
    /// the engine has stopped.
    pub fn submit(&self, request: Request) -> Result<mpsc::Receiver<Event>, RequestError> {
        if self.ending.load(Ordering::Relaxed) {
            return Err(RequestError::ShuttingDown);
        }
        self.submit_choices(vec![request])
            .map(|mut rx| rx.remove(0))
    }

    /// Queues requests for several choices of one prompt (they differ in their sampling):
    /// the prompt is read once and its state copied to the others where the backend can copy
    /// states. Each receiver hears its own request's events, in order.
    pub fn submit_choices(
        &self,
        requests: Vec<Request>,
    ) -> Result<Vec<mpsc::Receiver<Event>>, RequestError> {
        if self.ending.load(Ordering::Relaxed) {
            return Err(RequestError::ShuttingDown);
        }
        let mut receivers = Vec::with_capacity(requests.len());
        let mut jobs: Vec<(Request, mpsc::Sender<Event>)> = requests
            .into_iter()
            .map(|r| {
                let (tx, rx) = mpsc::channel(EVENT_BUFFER);
                receivers.push(rx);
                (r, tx)
            })
            .collect();
        if jobs.is_empty() {
            return Ok(receivers);
        }
        // A place in the queue, counted until the job's requests leave the waiting line.
        if self.waiting.fetch_add(1, Ordering::Relaxed) >= self.capacity {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(RequestError::QueueFull);
        }
        let slot = QueueSlot(self.waiting.clone());
        let (request, events) = jobs.remove(0);
        let job = Job {
            request,
            events,
            queued: Instant::now(),
            also: jobs,
            slot,
        };
        match self.jobs.try_send(job) {
            Ok(()) => Ok(receivers),
            Err(mpsc::error::TrySendError::Full(_)) => Err(RequestError::QueueFull),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(RequestError::Stopped),
        }
    }

    /// A prompt's token ids (the chat template applied), computed on the calling thread: a
    /// caller that does this on threads of its own keeps long prompts off the engine thread
    /// and submits [`Prompt::Tokens`].
    pub fn token_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, RequestError> {
        prompt.token_ids_with(
            &self.info.tokenizer,
            &self.info.template,
            self.info.specials_in_content,
        )
    }

    /// Whether sequences of these prompt lengths, each with `max_tokens` more (within the
    /// context budget), fit the memory limit together with nothing else in flight: a request
    /// whose choices fail this can never be served, whatever it waits for.
    pub fn check_together(&self, prompts: &[usize], max_tokens: usize) -> Result<(), RequestError> {
        let max = self.info.max_context;
        let totals: Vec<usize> = prompts
            .iter()
            .filter(|&&p| p < max)
            .map(|&p| p + max_tokens.min(max - p))
            .collect();
        self.info
            .budget
            .check_together(&totals)
            .map_err(|e| RequestError::ContextLengthExceeded {
                message: format!(
                    "the request's {} sequences (its prompts times n) cannot be held at once: {e}; \
                     ask for fewer choices or fewer max_tokens",
                    totals.len()
                ),
            })
    }

    /// `spec` compiled for the model, on the calling thread (it may take milliseconds): a
    /// caller that does this on threads of its own keeps it off the engine thread. An invalid
    /// schema is [`RequestError::InvalidRequest`].
    pub fn grammar(&self, spec: &GrammarSpec) -> Result<Grammar, RequestError> {
        self.info.grammars.compile(spec)
    }

    /// Ends every request in flight or waiting with [`RequestError::ShuttingDown`], now and
    /// from then on (the end of a graceful shutdown's grace).
    pub fn end_all(&self) {
        // An idle engine thread holds nothing to end; a busy one sees the flag between steps.
        self.ending.store(true, Ordering::Relaxed);
    }

    /// False once the engine thread has ended.
    pub fn is_alive(&self) -> bool {
        !self.jobs.is_closed()
    }

    /// Jobs (a prompt's choices) waiting: queued, or taken by the engine and waiting for room
    /// in the batch.
    pub fn queue_depth(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Most jobs that may wait.
    pub fn queue_capacity(&self) -> usize {
        self.capacity
    }
}

impl Runner {
    /// Caps the memory plan of every request (prompt + max_tokens within the context budget,
    /// on the engine's workspace and backend); `None` leaves requests uncapped.
    pub fn memory_limit(mut self, limit: Option<MemoryLimit>) -> Self {
        self.memory = limit;
        self
    }

    /// Reads special-token text in a chat request's own text (messages, tools, template
    /// kwargs) as the special tokens (Hugging Face's behaviour) instead of as plain text,
    /// which lets a request forge a turn.
    pub fn special_tokens_in_content(mut self, on: bool) -> Self {
        self.specials_in_content = on;
        self
    }

    /// Speculative decoding for every request (`None`: off).
    pub fn speculate(mut self, s: Option<Speculate>) -> Self {
        self.speculate = s;
        self
    }

    /// How long a request paused by a client that does not read may keep its place while
    /// others wait for one, or its memory while a request needs it (default
    /// [`DEFAULT_PAUSE_LIMIT`]); then it ends with [`RequestError::Stalled`].
    pub fn pause_limit(mut self, limit: Duration) -> Self {
        self.pause_limit = limit;
        self
    }

    /// Decodes at most `n` requests together (at least 1; the engine's workspace is made for
    /// them).
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = Some(n.max(1));
        self
    }

    /// Serves queued requests with `engine` until every [`Handle`] is dropped. With a memory
    /// limit that not even a two-token request fits, it reports that instead.
    pub fn run<B: Backend>(mut self, mut engine: Engine<B>) {
        let n = self.max_batch.unwrap_or(DEFAULT_MAX_BATCH);
        if let Err(e) = engine.set_max_batch(n) {
            let _ = self
                .ready
                .send(Err(format!("a workspace for {n} requests: {e}")));
            return;
        }
        let model_limit = engine.model.config.max_position_embeddings;
        let max_context = match self.max_context {
            Some(n) if n > model_limit => {
                let _ = self.ready.send(Err(format!(
                    "--max-context {n} is above the model's limit of {model_limit} tokens \
                     (max_position_embeddings)"
                )));
                return;
            }
            n => n.unwrap_or(model_limit).max(1),
        };
        if let Some(limit) = self.memory.take() {
            engine.set_memory_limit(Some(limit));
            if let Err(e) = engine.check_memory(2) {
                let _ = self
                    .ready
                    .send(Err(format!("no request can fit the memory limit: {e}")));
                return;
            }
        }
        let template = Arc::new(engine.tokenizer.chat_template().map_err(|e| e.to_string()));
        let info = EngineInfo {
            tokenizer: engine.tokenizer.clone(),
            template: template.clone(),
            specials_in_content: self.specials_in_content,
            max_context,
            backend: engine.backend_name(),
            grammars: engine.grammars(),
            budget: engine.cache_budget(),
        };
        if self.ready.send(Ok(info)).is_err() {
            return;
        }
        let mut serving = Serving {
            template,
            specials_in_content: self.specials_in_content,
            speculate: self.speculate.clone(),
            eos: engine.eos_ids(),
            batch: engine.batch(),
            max_context,
            observer: self.observer.clone(),
            engine,
            waiting: VecDeque::new(),
            pause_limit: self.pause_limit,
        };
        let mut open = true;
        while open || !serving.batch.is_empty() || !serving.waiting.is_empty() {
            if self.ending.load(Ordering::Relaxed) {
                serving.end_all();
                while let Ok(job) = self.jobs.try_recv() {
                    serving.expand(job);
                }
                for w in std::mem::take(&mut serving.waiting) {
                    serving.observer.finished(Err(&RequestError::ShuttingDown));
                    let _ = w
                        .events
                        .blocking_send(Event::Error(RequestError::ShuttingDown));
                }
            }
            // Every queued job joins the waiting line (waiting for a job when idle), where a
            // request whose client leaves is dropped at once; then waiting requests are
            // admitted in order (a job's choices one by one) while the batch has room.
            if open && serving.batch.is_empty() && serving.waiting.is_empty() {
                match self.jobs.blocking_recv() {
                    Some(job) => serving.expand(job),
                    None => open = false,
                }
            }
            while open {
                match self.jobs.try_recv() {
                    Ok(job) => serving.expand(job),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            serving.drop_left();
            while serving.batch.has_room() {
                match serving.waiting.pop_front() {
                    Some(w) => serving.admit_waiting(w),
                    None => break,
                }
            }
            serving.step();
        }
    }
}

/// The engine thread's state between steps.
struct Serving<B: Backend> {
    /// The requests in flight, each with its client (dropped before the engine).
    batch: Batch<B, Sink>,
    engine: Engine<B>,
    template: Arc<Result<sala_tokenizer::ChatTemplate, String>>,
    specials_in_content: bool,
    speculate: Option<Speculate>,
    eos: Vec<u32>,
    max_context: usize,
    observer: Arc<dyn Observer>,
    /// Requests taken from the queue, waiting for room in the batch.
    waiting: VecDeque<Waiting>,
    pause_limit: Duration,
}

/// A request taken from the queue; the choices of one job share a [`Group`] and its place in
/// the queue.
struct Waiting {
    request: Request,
    events: mpsc::Sender<Event>,
    queued: Instant,
    group: Group,
    lead: bool,
    slot: Rc<QueueSlot>,
}

/// The id of a job's first request once admitted: the others copy its prompt's state.
type Group = Rc<Cell<Option<RequestId>>>;

impl<B: Backend> Serving<B> {
    /// A job's requests, waiting for room in the batch.
    fn expand(&mut self, job: Job) {
        let group = Group::default();
        let Job {
            request,
            events,
            queued,
            also,
            slot,
        } = job;
        let slot = Rc::new(slot);
        self.waiting.push_back(Waiting {
            request,
            events,
            queued,
            group: group.clone(),
            lead: true,
            slot: slot.clone(),
        });
        for (request, events) in also {
            self.waiting.push_back(Waiting {
                request,
                events,
                queued,
                group: group.clone(),
                lead: false,
                slot: slot.clone(),
            });
        }
    }

    /// Drops the waiting requests whose clients left.
    fn drop_left(&mut self) {
        let observer = &self.observer;
        self.waiting.retain(|w| {
            let left = w.events.is_closed();
            if left {
                observer.finished(Ok(FinishReason::Cancelled));
            }
            !left
        });
    }

    /// Admits a waiting request: the first of its job reads the prompt, the others copy it.
    fn admit_waiting(&mut self, w: Waiting) {
        let Waiting {
            request,
            events,
            queued,
            group,
            lead,
            slot,
        } = w;
        // It leaves the waiting line (its job's place in the queue frees with its last
        // request) before its client can hear of its admission.
        drop(slot);
        let copy_of = if lead { None } else { group.get() };
        let id = self.admit_one(request, events, queued, copy_of);
        if lead {
            group.set(id);
        }
    }

    fn report_cache(&self) {
        let (held, in_use) = self.engine.cache_report(&self.batch);
        self.observer.cache(held, in_use);
    }

    /// [`Serving::admit`] under `catch_unwind`; returns the request's id once admitted.
    fn admit_one(
        &mut self,
        request: Request,
        events: mpsc::Sender<Event>,
        queued: Instant,
        copy_of: Option<RequestId>,
    ) -> Option<RequestId> {
        let sender = events.clone();
        match catch_unwind(AssertUnwindSafe(|| {
            self.admit(request, events, queued, copy_of)
        })) {
            Ok(id) => id,
            Err(p) => {
                let e = RequestError::from(crate::generate::EngineError::from_panic(
                    "admitting the request",
                    p,
                ));
                self.observer.finished(Err(&e));
                let _ = sender.blocking_send(Event::Error(e));
                None
            }
        }
    }

    /// Checks a request and admits it into the batch (as a copy of `copy_of`'s prompt state
    /// when given, see [`Engine::admit_copy`]); a request that fails its checks hears why.
    fn admit(
        &mut self,
        request: Request,
        events: mpsc::Sender<Event>,
        queued: Instant,
        copy_of: Option<RequestId>,
    ) -> Option<RequestId> {
        let observer = self.observer.clone();
        if events.is_closed() {
            // The client left while the request waited.
            observer.finished(Ok(FinishReason::Cancelled));
            return None;
        }
        // Outcomes are counted before the client hears of them.
        let fail = |e: RequestError| {
            observer.finished(Err(&e));
            let _ = events.blocking_send(Event::Error(e));
            None
        };
        let ids = match request.prompt.token_ids_with(
            &self.engine.tokenizer,
            &self.template,
            self.specials_in_content,
        ) {
            Ok(ids) => ids,
            Err(e) => return fail(e),
        };
        if ids.is_empty() {
            return fail(RequestError::invalid("the prompt is empty").param("prompt"));
        }
        let vocab = self.engine.model.config.vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return fail(
                RequestError::invalid(format!(
                    "the prompt holds token id {bad}, outside the vocabulary of {vocab} tokens"
                ))
                .param("prompt"),
            );
        }
        let max_context = self.max_context;
        if ids.len() >= max_context {
            return fail(RequestError::ContextLengthExceeded {
                message: format!(
                    "the prompt has {} tokens, which leaves no room in the context budget of \
                     {max_context} tokens",
                    ids.len()
                ),
            });
        }
        let prompt_tokens = ids.len();
        let opts = GenerateOptions {
            sampling: request.sampling,
            max_tokens: request.max_tokens,
            max_context,
            stop: request.stop,
            eos_ids: if request.ignore_eos {
                Vec::new()
            } else {
                self.eos.clone()
            },
            grammar: request.grammar,
            prompt_logprobs: request.prompt_logprobs,
            speculate: self.speculate.clone().filter(|_| request.speculative),
        };
        // The cache budget checks this request's memory beside the batch's: too large even
        // alone is `ContextLengthExceeded`, else busy memory is `MemoryBusy`, unless requests
        // whose clients stopped reading past the pause limit hold it: they end, and it is
        // tried again.
        let mut ended_stalled = false;
        let id = loop {
            let sink = Sink {
                events: events.clone(),
                observer: observer.clone(),
                tokenizer: self.engine.tokenizer.clone(),
                queued,
                last_token: None,
                pending: Vec::new(),
                paused_since: Cell::new(None),
            };
            let (batch, ids) = (&mut self.batch, ids.clone());
            let admitted = match copy_of {
                Some(of) => self
                    .engine
                    .admit_copy(batch, of, ids, &opts, request.logprobs, sink),
                None => self.engine.admit(batch, ids, &opts, request.logprobs, sink),
            };
            match admitted {
                Ok(id) => break id,
                Err(crate::generate::EngineError::MemoryBusy(_))
                    if !ended_stalled && self.end_stalled() > 0 =>
                {
                    ended_stalled = true
                }
                Err(e) => return fail(e.into()),
            }
        };
        observer.admitted(prompt_tokens);
        self.report_cache();
        if events
            .blocking_send(Event::Started { prompt_tokens })
            .is_err()
        {
            self.batch.cancel_where(|x, _| x == id);
            self.report_cache();
            self.observer.released();
            self.observer.finished(Ok(FinishReason::Cancelled));
            return None;
        }
        Some(id)
    }

    /// Ends the requests whose clients have not read for longer than the pause limit (their
    /// places or memory are needed); how many.
    fn end_stalled(&mut self) -> usize {
        let limit = self.pause_limit;
        let ended = self.batch.cancel_where(|_, sink| sink.paused_for() > limit);
        let n = ended.len();
        for (_, sink) in ended {
            self.report_cache();
            self.observer.released();
            sink.end_stalled(limit);
        }
        n
    }

    /// Fails every request in flight: the server is shutting down.
    fn end_all(&mut self) {
        for (_, sink) in self.batch.cancel_where(|_, _| true) {
            self.report_cache();
            self.observer.released();
            sink.fail(RequestError::ShuttingDown);
        }
    }

    /// Drops the requests whose clients left (or, while others wait for a place, stopped
    /// reading longer than the pause limit), then runs a step; a panic that the step does not
    /// isolate to a request fails every request in flight.
    fn step(&mut self) {
        for _ in self.batch.cancel_where(|_, sink| sink.events.is_closed()) {
            self.report_cache();
            self.observer.released();
            self.observer.finished(Ok(FinishReason::Cancelled));
        }
        if !self.waiting.is_empty() {
            self.end_stalled();
        }
        if self.batch.is_empty() {
            return;
        }
        if !self.batch.any_ready() {
            // Everyone is paused: wait a little for a client to read, or a new request.
            std::thread::sleep(Duration::from_millis(1));
        }
        let (engine, batch) = (&mut self.engine, &mut self.batch);
        let stepped = catch_unwind(AssertUnwindSafe(|| engine.step(batch)));
        self.observer.speculation(self.engine.speculation_stats());
        if let Some((totals, bytes)) = self.engine.prefix_cache() {
            self.observer.prefix_cache(totals, bytes);
        }
        if let Some(totals) = self.engine.context_stats() {
            self.observer.context_parallel(totals);
        }
        if stepped.is_err() {
            // A panic leaves the batch in an unknown state: every request in it fails.
            for (_, sink) in self.batch.cancel_where(|_, _| true) {
                self.report_cache();
                self.observer.released();
                sink.fail(RequestError::internal(
                    "the engine panicked on this request",
                ));
            }
        }
    }
}

/// A request's client on the engine thread: where its events go, and what its metrics need.
struct Sink {
    events: mpsc::Sender<Event>,
    observer: Arc<dyn Observer>,
    tokenizer: Tokenizer,
    queued: Instant,
    last_token: Option<Instant>,
    /// Logprobs of the tokens since the last `Text`.
    pending: Vec<LogprobEntry>,
    /// Since when the client has had no room for a step's events.
    paused_since: Cell<Option<Instant>>,
}

impl Sink {
    /// How long the client has had no room for a step's events (zero while it reads).
    fn paused_for(&self) -> Duration {
        self.paused_since
            .get()
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Sends an event; false when the client has left.
    fn send(&self, ev: Event) -> bool {
        match self.events.try_send(ev) {
            Ok(()) => true,
            // Paused requests do not generate, so this is rare: wait for the client.
            Err(mpsc::error::TrySendError::Full(ev)) => self.events.blocking_send(ev).is_ok(),
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }

    fn fail(&self, e: RequestError) {
        self.observer.finished(Err(&e));
        let _ = self.send(Event::Error(e));
    }

    /// Ends a request whose client has not read for `limit` while its place or memory was
    /// needed: the error goes where the channel has room (a paused request's usually has a
    /// little), never waiting for the client.
    fn end_stalled(&self, limit: Duration) {
        let e = RequestError::Stalled {
            millis: limit.as_millis() as u64,
        };
        self.observer.finished(Err(&e));
        let _ = self.events.try_send(Event::Error(e));
    }
}

impl Client for Sink {
    /// Whether the client has room for a step's events (a token's text, then the end).
    fn ready(&self) -> bool {
        let ready = self.events.capacity() >= 4;
        match (ready, self.paused_since.get()) {
            (true, Some(_)) => self.paused_since.set(None),
            (false, None) => self.paused_since.set(Some(Instant::now())),
            _ => {}
        }
        ready
    }

    fn event(&mut self, event: StepEvent<'_>, cx: &StepContext<'_>) -> bool {
        match event {
            StepEvent::Prefilled {
                logprobs: Some(logprobs),
                ..
            } => self.send(Event::Prompt {
                logprobs: logprobs.clone(),
            }),
            StepEvent::Read { .. } | StepEvent::Prefilled { .. } => !self.events.is_closed(),
            StepEvent::Token(step) => {
                if let Some(t) = step.token {
                    let now = Instant::now();
                    let since = self.last_token.unwrap_or(self.queued);
                    self.observer.token(now, since, self.last_token.is_none());
                    self.last_token = Some(now);
                    self.observer.cache(cx.cache_held(), cx.cache_in_use());
                    if let (false, Some(lp)) = (t.eos, &t.logprobs) {
                        self.pending.push(LogprobEntry::new(&self.tokenizer, lp));
                    }
                }
                if step.text.is_empty() {
                    !self.events.is_closed()
                } else {
                    let logprobs = std::mem::take(&mut self.pending);
                    self.send(Event::Text {
                        text: step.text.to_string(),
                        logprobs,
                    })
                }
            }
            StepEvent::Done(result) => {
                self.observer.cache(cx.cache_held(), cx.cache_in_use());
                self.observer.released();
                match result {
                    Ok(done) => {
                        if !self.pending.is_empty() {
                            let logprobs = std::mem::take(&mut self.pending);
                            let _ = self.send(Event::Text {
                                text: String::new(),
                                logprobs,
                            });
                        }
                        self.observer.finished(Ok(done.finish));
                        let _ = self.send(Event::Done {
                            finish: done.finish,
                            prompt_tokens: done.prompt_tokens,
                            cached_tokens: done.cached_tokens,
                            completion_tokens: done.completion_tokens,
                        });
                    }
                    Err(e) => self.fail(e.into()),
                }
                true
            }
        }
    }
}
