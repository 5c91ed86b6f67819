//! The engine thread: owns the model and runs queued requests one at a time.

use crate::api::ApiError;
use crate::metrics::{Metrics, Outcome};
use axum::http::StatusCode;
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use sala_engine::sampling::{SamplingParams, TokenLogprobs};
use sala_model::memory::{MemoryLimit, Target};
use sala_model::Backend;
use sala_tokenizer::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};
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
}

/// The HTTP side's end of the queue.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    pub info: ModelInfo,
    /// Shared with the engine thread.
    pub metrics: Arc<Metrics>,
}

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

    /// Serves queued requests with `engine` until every [`EngineHandle`] is dropped. With a
    /// memory limit that not even a two-token request fits, it reports that instead.
    pub fn run<B: Backend>(mut self, mut engine: Engine<B>) {
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
        while let Some(job) = self.jobs.blocking_recv() {
            if job.events.is_closed() {
                // The client left while the request waited.
                self.metrics.request_done(Outcome::Cancelled);
                continue;
            }
            run_job(
                &mut engine,
                &template,
                &eos,
                max_context,
                &self.metrics,
                job,
            );
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

fn run_job<B: Backend>(
    engine: &mut Engine<B>,
    template: &Result<ChatTemplate, String>,
    eos: &[u32],
    max_context: usize,
    metrics: &Metrics,
    job: Job,
) {
    let Job {
        request,
        events,
        queued,
    } = job;
    // Outcomes are counted before the client hears of them, so that a client reading
    // `/metrics` after its answer finds its request there.
    let fail = |e: ApiError| {
        metrics.request_done(Outcome::of_status(e.status.as_u16()));
        let _ = events.blocking_send(Event::Error(e));
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
    // Admission: the whole sequence this request may reach (prompt + max_tokens within the
    // context budget) must fit the memory limit before any work. Requests run one at a time,
    // so this plan is the total over live sequences. A 400 `context_length_exceeded`, not a
    // 503: nothing else holds memory while it would run, so the same request can never fit
    // and a retry would not help; a shorter prompt or a smaller max_tokens would.
    let total = ids.len() + request.max_tokens.min(max_context - ids.len());
    if let Err(e) = engine.check_memory(total) {
        return fail(engine_error(e));
    }
    if events
        .blocking_send(Event::Started {
            prompt_tokens: ids.len(),
        })
        .is_err()
    {
        metrics.request_done(Outcome::Cancelled);
        return;
    }
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
    let config = engine.model.config.clone();
    let tokenizer = engine.tokenizer.clone();
    let cache_bytes = |len: usize| sala_model::memory::cache_bytes(&config, len).total();
    let mut held = cache_bytes(ids.len());
    metrics.sequence_started(ids.len(), held);
    let mut last_token: Option<Instant> = None;
    let mut len = ids.len();
    let mut pending: Vec<LogprobEntry> = Vec::new();
    let result = catch_unwind(AssertUnwindSafe(|| {
        engine.generate_steps(
            &ids,
            &opts,
            request.logprobs,
            &mut |step| {
                if let Some(t) = step.token {
                    let now = Instant::now();
                    metrics.token(now, last_token.unwrap_or(queued), last_token.is_none());
                    last_token = Some(now);
                    len += 1;
                    let bytes = cache_bytes(len);
                    metrics.cache_changed(bytes as i64 - held as i64);
                    held = bytes;
                    if let (false, Some(lp)) = (t.eos, &t.logprobs) {
                        pending.push(LogprobEntry::new(&tokenizer, lp));
                    }
                }
                if step.text.is_empty() {
                    !events.is_closed()
                } else {
                    let text = Event::Text {
                        text: step.text.to_string(),
                        logprobs: std::mem::take(&mut pending),
                    };
                    events.blocking_send(text).is_ok()
                }
            },
            &mut |_| {},
        )
    }));
    metrics.sequence_ended(held);
    let last = match result {
        Ok(Ok(g)) => {
            if !pending.is_empty() {
                let _ = events.blocking_send(Event::Text {
                    text: String::new(),
                    logprobs: pending,
                });
            }
            metrics.request_done(match g.finish {
                FinishReason::Stop => Outcome::Stop,
                FinishReason::Length => Outcome::Length,
                FinishReason::Cancelled => Outcome::Cancelled,
            });
            Event::Done {
                finish: g.finish,
                prompt_tokens: g.prompt_tokens,
                completion_tokens: g.tokens.len(),
            }
        }
        Ok(Err(e)) => return fail(engine_error(e)),
        Err(_) => return fail(ApiError::internal("the engine panicked on this request")),
    };
    let _ = events.blocking_send(last);
}
