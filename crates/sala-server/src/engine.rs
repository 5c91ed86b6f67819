//! The engine thread: owns the model and serves queued requests as one continuous batch.

use crate::api::ApiError;
use crate::metrics::{Metrics, Outcome};
use axum::http::StatusCode;
use sala_engine::batch::{Batch, BatchEvent, RequestId};
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use sala_engine::sampling::{SamplingParams, TokenLogprobs};
use sala_model::memory::{MemoryLimit, Target};
use sala_model::Backend;
use sala_tokenizer::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// What the HTTP side knows of the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model id of `/v1/models` and the `model` field.
    pub id: String,
    /// Most tokens one sequence may hold (prompt and output together).
    pub max_context: usize,
    pub backend: String,
}

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    Text(String),
    Chat {
        messages: Vec<ChatMessage>,
        kwargs: serde_json::Map<String, serde_json::Value>,
    },
}

/// One checked request.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Report each token's logprob with this many alternatives (`None`: no logprobs).
    pub logprobs: Option<usize>,
}

/// A token as text: its bytes (one byte for a byte-fallback piece such as `<0xE4>`, else the
/// piece with `▁` as a space) and those bytes as a string, lossily.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenText {
    pub text: String,
    pub bytes: Vec<u8>,
}

impl TokenText {
    pub fn of(tokenizer: &Tokenizer, id: u32) -> Self {
        let piece = tokenizer.id_to_token(id).unwrap_or_default();
        let byte = piece
            .strip_prefix("<0x")
            .and_then(|p| p.strip_suffix('>'))
            .filter(|hex| hex.len() == 2)
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        let bytes = match byte {
            Some(b) => vec![b],
            None => piece.replace('\u{2581}', " ").into_bytes(),
        };
        Self {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
        }
    }
}

/// One generated token's logprob and its step's most likely tokens (raw log-softmax).
#[derive(Debug, Clone)]
pub struct LogprobEntry {
    pub token: TokenText,
    pub logprob: f32,
    pub top: Vec<(TokenText, f32)>,
}

impl LogprobEntry {
    fn new(tokenizer: &Tokenizer, lp: &TokenLogprobs) -> Self {
        Self {
            token: TokenText::of(tokenizer, lp.id),
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(id, l)| (TokenText::of(tokenizer, id), l))
                .collect(),
        }
    }
}

/// What the engine reports about a request, in order: `Started` or `Error`; then `Text`s;
/// then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    /// Text that became final, with the logprobs of the tokens generated since the last
    /// `Text` (when asked for; EOS tokens are left out). The text may be empty when only
    /// logprobs are left at the end.
    Text {
        text: String,
        logprobs: Vec<LogprobEntry>,
    },
    Done {
        finish: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Error(ApiError),
}

struct Job {
    request: Request,
    events: mpsc::Sender<Event>,
    /// When the request was queued: the start of its time to first token.
    queued: Instant,
}

/// Handed to the factory of [`spawn_engine`] on the engine thread; [`EngineRunner::run`]
/// serves the queue with an engine built there.
pub struct EngineRunner {
    jobs: mpsc::Receiver<Job>,
    ready: std::sync::mpsc::Sender<Result<ModelInfo, String>>,
    model_id: String,
    max_context: Option<usize>,
    metrics: Arc<Metrics>,
    /// The cap on each request's memory plan, and the backend the plan is for.
    memory: Option<(MemoryLimit, Target)>,
    /// Most requests decoded together (`None`: [`DEFAULT_MAX_BATCH`]).
    max_batch: Option<usize>,
}

/// The HTTP side's end of the queue.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    pub info: ModelInfo,
    /// Shared with the engine thread.
    pub metrics: Arc<Metrics>,
}

/// Requests decoded together unless [`EngineRunner::max_batch`] says otherwise.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Events buffered per request before the engine waits for the client.
const EVENT_BUFFER: usize = 64;

/// Starts the engine thread: `factory` runs there, builds the backend and the
/// [`Engine`] (backends need not be `Send`), and calls [`EngineRunner::run`]. Returns once the
/// model is loaded, or with the factory's error. `queue` is how many requests may wait.
pub fn spawn_engine<F>(
    model_id: String,
    max_context: Option<usize>,
    queue: usize,
    factory: F,
) -> Result<EngineHandle, String>
where
    F: FnOnce(EngineRunner) -> Result<(), String> + Send + 'static,
{
    let (jobs_tx, jobs_rx) = mpsc::channel(queue.max(1));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let failed = ready_tx.clone();
    let metrics = Arc::new(Metrics::new());
    let runner = EngineRunner {
        jobs: jobs_rx,
        ready: ready_tx,
        model_id,
        max_context,
        metrics: metrics.clone(),
        memory: None,
        max_batch: None,
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
        Ok(Ok(info)) => Ok(EngineHandle {
            jobs: jobs_tx,
            info,
            metrics,
        }),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the engine thread ended before loading a model".into()),
    }
}

impl EngineHandle {
    /// Queues a request; a full queue is 429, a stopped engine 503.
    pub fn submit(&self, request: Request) -> Result<mpsc::Receiver<Event>, ApiError> {
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        match self.jobs.try_send(Job {
            request,
            events: tx,
            queued: Instant::now(),
        }) {
            Ok(()) => Ok(rx),
            Err(mpsc::error::TrySendError::Full(_)) => Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "the server is busy: too many requests are waiting; retry later",
            )
            .code("queue_full")),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the engine has stopped",
            )),
        }
    }

    /// False once the engine thread has ended.
    pub fn is_alive(&self) -> bool {
        !self.jobs.is_closed()
    }

    /// Requests waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }

    /// Most requests that may wait.
    pub fn queue_capacity(&self) -> usize {
        self.jobs.max_capacity()
    }
}

impl EngineRunner {
    /// Caps the memory plan of every request (prompt + max_tokens within the context budget,
    /// on the engine's workspace, for `target`); `None` leaves requests uncapped.
    pub fn memory_limit(mut self, limit: Option<MemoryLimit>, target: Target) -> Self {
        self.memory = limit.map(|l| (l, target));
        self
    }

    /// Decodes at most `n` requests together (at least 1; the engine's workspace is made for
    /// them).
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = Some(n.max(1));
        self
    }

    /// Serves queued requests with `engine` until every [`EngineHandle`] is dropped. With a
    /// memory limit that not even a two-token request fits, it reports that instead.
    pub fn run<B: Backend>(mut self, mut engine: Engine<B>) {
        let n = self.max_batch.unwrap_or(DEFAULT_MAX_BATCH);
        if let Err(e) = engine.set_max_batch(n) {
            let _ = self
                .ready
                .send(Err(format!("a workspace for {n} requests: {e}")));
            return;
        }
        let max_context = self
            .max_context
            .unwrap_or(engine.model.config.max_position_embeddings)
            .max(1);
        if let Some((limit, target)) = self.memory.take() {
            if let Err(e) = engine.memory_plan(2, target).check(&limit) {
                let _ = self
                    .ready
                    .send(Err(format!("no request can fit the memory limit: {e}")));
                return;
            }
            engine.set_memory_limit(Some(limit), target);
        }
        let info = ModelInfo {
            id: self.model_id.clone(),
            max_context,
            backend: engine.backend_name(),
        };
        if self.ready.send(Ok(info)).is_err() {
            return;
        }
        let template = engine.tokenizer.chat_template().map_err(|e| e.to_string());
        let eos = engine.eos_ids();
        let mut batch = Batch::new(engine.max_batch());
        let mut live: HashMap<RequestId, Live> = HashMap::new();
        let mut open = true;
        while open || !batch.is_empty() {
            // Admit waiting requests while the batch has room; wait for one when idle.
            while open && batch.has_room() {
                let job = if batch.is_empty() {
                    match self.jobs.blocking_recv() {
                        Some(job) => job,
                        None => {
                            open = false;
                            break;
                        }
                    }
                } else {
                    match self.jobs.try_recv() {
                        Ok(job) => job,
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                };
                if let Some((id, state)) = admit(
                    &mut engine,
                    &mut batch,
                    &template,
                    &eos,
                    max_context,
                    &self.metrics,
                    job,
                ) {
                    live.insert(id, state);
                }
            }
            // A client that has left frees its request at once.
            for id in batch.cancel_where(|id| live.get(&id).is_none_or(|l| l.events.is_closed())) {
                if let Some(state) = live.remove(&id) {
                    self.metrics.sequence_ended(state.held);
                    self.metrics.request_done(Outcome::Cancelled);
                }
            }
            if batch.is_empty() {
                continue;
            }
            let metrics = &self.metrics;
            let tokenizer = engine.tokenizer.clone();
            // A client that is not reading pauses only its own request.
            let ready: HashMap<RequestId, bool> = live
                .iter()
                .map(|(&id, l)| (id, l.can_take_events()))
                .collect();
            if !ready.values().any(|&r| r) {
                // Everyone is paused: wait a little for a client to read, or a new request.
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let stepped = catch_unwind(AssertUnwindSafe(|| {
                let ready = |id| ready.get(&id).copied().unwrap_or(false);
                engine.step(&mut batch, &ready, &mut |id, ev| match live.get_mut(&id) {
                    Some(state) => {
                        let go_on = state.on_event(&tokenizer, metrics, ev);
                        if state.ended {
                            live.remove(&id);
                        }
                        go_on
                    }
                    None => false,
                })
            }));
            if stepped.is_err() {
                // A panic leaves the batch in an unknown state: every request in it fails.
                batch.cancel_where(|_| true);
                for (_, state) in live.drain() {
                    self.metrics.sequence_ended(state.held);
                    state.fail(
                        metrics,
                        ApiError::internal("the engine panicked on this request"),
                    );
                }
            }
        }
    }
}

/// A request in the batch: where its events go, and what its metrics need.
struct Live {
    events: mpsc::Sender<Event>,
    queued: Instant,
    last_token: Option<Instant>,
    /// Tokens the sequence holds, and the cache bytes counted for it.
    len: usize,
    held: usize,
    cache_bytes: Box<dyn Fn(usize) -> usize>,
    pending: Vec<LogprobEntry>,
    ended: bool,
}

impl Live {
    /// Whether the client has room for a step's events (a token's text, then the end).
    fn can_take_events(&self) -> bool {
        self.events.capacity() >= 4
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

    fn fail(&self, metrics: &Metrics, e: ApiError) {
        metrics.request_done(Outcome::of_status(e.status.as_u16()));
        let _ = self.send(Event::Error(e));
    }

    /// Handles one event of the batch; `false` cancels the request (its client left).
    fn on_event(&mut self, tokenizer: &Tokenizer, metrics: &Metrics, ev: BatchEvent<'_>) -> bool {
        match ev {
            BatchEvent::Prefilled { .. } => !self.events.is_closed(),
            BatchEvent::Step(step) => {
                if let Some(t) = step.token {
                    let now = Instant::now();
                    metrics.token(
                        now,
                        self.last_token.unwrap_or(self.queued),
                        self.last_token.is_none(),
                    );
                    self.last_token = Some(now);
                    self.len += 1;
                    let bytes = (self.cache_bytes)(self.len);
                    metrics.cache_changed(bytes as i64 - self.held as i64);
                    self.held = bytes;
                    if let (false, Some(lp)) = (t.eos, &t.logprobs) {
                        self.pending.push(LogprobEntry::new(tokenizer, lp));
                    }
                }
                if step.text.is_empty() {
                    !self.events.is_closed()
                } else {
                    let text = Event::Text {
                        text: step.text.to_string(),
                        logprobs: std::mem::take(&mut self.pending),
                    };
                    self.send(text)
                }
            }
            BatchEvent::Done(result) => {
                self.ended = true;
                metrics.sequence_ended(self.held);
                match result {
                    Ok(done) => {
                        if !self.pending.is_empty() {
                            let logprobs = std::mem::take(&mut self.pending);
                            let _ = self.send(Event::Text {
                                text: String::new(),
                                logprobs,
                            });
                        }
                        metrics.request_done(match done.finish {
                            FinishReason::Stop => Outcome::Stop,
                            FinishReason::Length => Outcome::Length,
                            FinishReason::Cancelled => Outcome::Cancelled,
                        });
                        let _ = self.send(Event::Done {
                            finish: done.finish,
                            prompt_tokens: done.prompt_tokens,
                            completion_tokens: done.completion_tokens,
                        });
                    }
                    Err(e) => self.fail(metrics, engine_error(e)),
                }
                true
            }
        }
    }
}

fn tokenize<B: Backend>(
    engine: &Engine<B>,
    template: &Result<ChatTemplate, String>,
    prompt: &Prompt,
) -> Result<Vec<u32>, ApiError> {
    let text = match prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Chat { messages, kwargs } => {
            let template = template.as_ref().map_err(|e| {
                ApiError::invalid(format!("this model has no usable chat template: {e}"))
            })?;
            let opts = ChatOptions {
                add_generation_prompt: true,
                tools: None,
                kwargs: kwargs.clone(),
            };
            template.render(messages, &opts).map_err(|e| {
                ApiError::invalid(format!("applying the chat template: {e}")).param("messages")
            })?
        }
    };
    engine
        .tokenizer
        .encode(&text, true)
        .map_err(|e| ApiError::invalid(format!("tokenizing the prompt: {e}")))
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Sampling(e) => ApiError::invalid(e.to_string()),
        EngineError::Stop(e) => ApiError::invalid(e.to_string()).param("stop"),
        EngineError::EmptyPrompt => ApiError::invalid(e.to_string()),
        EngineError::PromptTooLong { .. } | EngineError::OverBudget(_) => {
            ApiError::invalid(e.to_string()).code("context_length_exceeded")
        }
        e => ApiError::internal(format!("generation failed: {e}")),
    }
}

/// Checks a job and admits it into the batch; a job that fails its checks gets its error
/// and is not admitted.
fn admit<B: Backend>(
    engine: &mut Engine<B>,
    batch: &mut Batch<B>,
    template: &Result<ChatTemplate, String>,
    eos: &[u32],
    max_context: usize,
    metrics: &Metrics,
    job: Job,
) -> Option<(RequestId, Live)> {
    let Job {
        request,
        events,
        queued,
    } = job;
    if events.is_closed() {
        // The client left while the request waited.
        metrics.request_done(Outcome::Cancelled);
        return None;
    }
    // Outcomes are counted before the client hears of them, so that a client reading
    // `/metrics` after its answer finds its request there.
    let fail = |e: ApiError| {
        metrics.request_done(Outcome::of_status(e.status.as_u16()));
        let _ = events.blocking_send(Event::Error(e));
        None
    };
    let ids = match tokenize(engine, template, &request.prompt) {
        Ok(ids) => ids,
        Err(e) => return fail(e),
    };
    if ids.is_empty() {
        return fail(ApiError::invalid("the prompt is empty").param("prompt"));
    }
    if ids.len() >= max_context {
        return fail(
            ApiError::invalid(format!(
                "the prompt has {} tokens, which leaves no room in the context budget of \
                 {max_context} tokens",
                ids.len()
            ))
            .code("context_length_exceeded"),
        );
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
            eos.to_vec()
        },
    };
    // Admission checks the memory plan of every sequence in the batch with this one (prompt +
    // max_tokens within the context budget) before any work. Over the limit is a 400
    // `context_length_exceeded` when the request alone cannot fit (a retry would not help; a
    // shorter prompt or a smaller max_tokens would), else a 503: the batch is busy.
    let id = match engine.admit(batch, ids, &opts, request.logprobs) {
        Ok(id) => id,
        Err(e @ EngineError::OverBudget(_)) if !batch.is_empty() => {
            let total = prompt_tokens + opts.max_tokens.min(max_context - prompt_tokens);
            return match engine.check_memory(total) {
                Ok(()) => fail(
                    ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        format!("the server is busy: the requests in flight hold the memory this one needs ({e}); retry later"),
                    )
                    .code("memory_busy"),
                ),
                Err(e) => fail(engine_error(e)),
            };
        }
        Err(e) => return fail(engine_error(e)),
    };
    if events
        .blocking_send(Event::Started { prompt_tokens })
        .is_err()
    {
        batch.cancel_where(|x| x == id);
        metrics.request_done(Outcome::Cancelled);
        return None;
    }
    let config = engine.model.config.clone();
    let cache_bytes = move |len: usize| sala_model::memory::cache_bytes(&config, len).total();
    let held = cache_bytes(prompt_tokens);
    metrics.sequence_started(prompt_tokens, held);
    Some((
        id,
        Live {
            events,
            queued,
            last_token: None,
            len: prompt_tokens,
            held,
            cache_bytes: Box::new(cache_bytes),
            pending: Vec::new(),
            ended: false,
        },
    ))
}
