//! The engine thread: owns the model and runs queued requests one at a time.

use crate::api::ApiError;
use axum::http::StatusCode;
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_model::Backend;
use sala_tokenizer::{ChatMessage, ChatOptions, ChatTemplate};
use std::panic::{catch_unwind, AssertUnwindSafe};
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
}

/// What the engine reports about a request, in order: `Started` or `Error`; then `Text`s;
/// then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    Text(String),
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
}

/// Handed to the factory of [`spawn_engine`] on the engine thread; [`EngineRunner::run`]
/// serves the queue with an engine built there.
pub struct EngineRunner {
    jobs: mpsc::Receiver<Job>,
    ready: std::sync::mpsc::Sender<Result<ModelInfo, String>>,
    model_id: String,
    max_context: Option<usize>,
}

/// The HTTP side's end of the queue.
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    pub info: ModelInfo,
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
    let runner = EngineRunner {
        jobs: jobs_rx,
        ready: ready_tx,
        model_id,
        max_context,
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
}

impl EngineRunner {
    /// Serves queued requests with `engine` until every [`EngineHandle`] is dropped.
    pub fn run<B: Backend>(mut self, mut engine: Engine<B>) {
        let max_context = self
            .max_context
            .unwrap_or(engine.model.config.max_position_embeddings)
            .max(1);
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
                continue; // the client left while the request waited
            }
            run_job(&mut engine, &template, &eos, max_context, job);
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
        EngineError::PromptTooLong { .. } => {
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
    job: Job,
) {
    let Job { request, events } = job;
    let ids = match tokenize(engine, template, &request.prompt) {
        Ok(ids) => ids,
        Err(e) => {
            let _ = events.blocking_send(Event::Error(e));
            return;
        }
    };
    if ids.is_empty() {
        let _ = events.blocking_send(Event::Error(
            ApiError::invalid("the prompt is empty").param("prompt"),
        ));
        return;
    }
    if ids.len() >= max_context {
        let _ = events.blocking_send(Event::Error(
            ApiError::invalid(format!(
                "the prompt has {} tokens, which leaves no room in the context budget of \
                 {max_context} tokens",
                ids.len()
            ))
            .code("context_length_exceeded"),
        ));
        return;
    }
    if events
        .blocking_send(Event::Started {
            prompt_tokens: ids.len(),
        })
        .is_err()
    {
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
    let result = catch_unwind(AssertUnwindSafe(|| {
        engine.generate_cancellable(
            &ids,
            &opts,
            &mut |text| {
                if text.is_empty() {
                    !events.is_closed()
                } else {
                    events.blocking_send(Event::Text(text.to_string())).is_ok()
                }
            },
            &mut |_| {},
        )
    }));
    let last = match result {
        Ok(Ok(g)) => Event::Done {
            finish: g.finish,
            prompt_tokens: g.prompt_tokens,
            completion_tokens: g.tokens.len(),
        },
        Ok(Err(e)) => Event::Error(engine_error(e)),
        Err(_) => Event::Error(ApiError::internal("the engine panicked on this request")),
    };
    let _ = events.blocking_send(last);
}
