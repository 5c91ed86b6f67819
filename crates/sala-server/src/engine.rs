//! The server's end of the engine thread ([`sala_engine::thread`]): the model's id beside
//! what the engine reports, the [`Metrics`] the engine's events feed, and the engine's
//! refusals as OpenAI errors.

use crate::api::ApiError;
use crate::metrics::Metrics;
use sala_engine::grammar::{Grammar, GrammarSpec};
use sala_engine::request::RequestError;
use sala_engine::thread::{self, Runner};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;

pub use sala_engine::request::{Event, LogprobEntry, Prompt, Request, TokenText};
pub use sala_engine::thread::{Runner as EngineRunner, DEFAULT_MAX_BATCH};

/// What the HTTP side knows of the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The model id of `/v1/models` and the `model` field.
    pub id: String,
    /// Most tokens one sequence may hold (prompt and output together).
    pub max_context: usize,
    pub backend: String,
}

/// The HTTP side's end of the engine's queue.
#[derive(Clone)]
pub struct EngineHandle {
    engine: thread::Handle,
    pub info: ModelInfo,
    /// Fed by the engine thread.
    pub metrics: Arc<Metrics>,
    /// Set when a graceful shutdown begins: new requests are refused, `/health` says so.
    draining: Arc<AtomicBool>,
}

/// Starts the engine thread ([`sala_engine::thread::spawn`]) serving `model_id`, with fresh
/// [`Metrics`] as its observer. `factory` runs there, builds the backend and the engine, and
/// calls [`EngineRunner::run`]. Returns once the model is loaded, or with the factory's error.
/// `queue` is how many requests may wait.
pub fn spawn_engine<F>(
    model_id: String,
    max_context: Option<usize>,
    queue: usize,
    factory: F,
) -> Result<EngineHandle, String>
where
    F: FnOnce(Runner) -> Result<(), String> + Send + 'static,
{
    let metrics = Arc::new(Metrics::new());
    let engine = thread::spawn(max_context, queue, metrics.clone(), factory)?;
    let info = ModelInfo {
        id: model_id,
        max_context: engine.info.max_context,
        backend: engine.info.backend.clone(),
    };
    Ok(EngineHandle {
        engine,
        info,
        metrics,
        draining: Arc::new(AtomicBool::new(false)),
    })
}

impl EngineHandle {
    /// Queues a request; a full queue is 429, a stopped or draining engine 503.
    pub fn submit(&self, request: Request) -> Result<mpsc::Receiver<Event>, ApiError> {
        if self.is_draining() {
            return Err(ApiError::from(&RequestError::ShuttingDown));
        }
        self.engine.submit(request).map_err(|e| ApiError::from(&e))
    }

    /// Queues the choices of one prompt (the prompt read once where the backend can copy
    /// states); errors as [`EngineHandle::submit`].
    pub fn submit_choices(
        &self,
        requests: Vec<Request>,
    ) -> Result<Vec<mpsc::Receiver<Event>>, ApiError> {
        if self.is_draining() {
            return Err(ApiError::from(&RequestError::ShuttingDown));
        }
        self.engine
            .submit_choices(requests)
            .map_err(|e| ApiError::from(&e))
    }

    /// A prompt's token ids (the chat template applied), computed on the calling thread.
    pub fn token_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, RequestError> {
        self.engine.token_ids(prompt)
    }

    /// The model's tokenizer.
    pub fn tokenizer(&self) -> &sala_tokenizer::Tokenizer {
        &self.engine.info.tokenizer
    }

    /// Whether a request's sequences (their prompt lengths, `max_tokens` each) fit the memory
    /// limit at once with nothing else in flight.
    pub fn check_together(&self, prompts: &[usize], max_tokens: usize) -> Result<(), RequestError> {
        self.engine.check_together(prompts, max_tokens)
    }

    /// `spec` compiled for the model, on the calling thread.
    pub fn grammar(&self, spec: &GrammarSpec) -> Result<Grammar, RequestError> {
        self.engine.grammar(spec)
    }

    /// Begins a graceful shutdown: requests from now on are refused; those in flight go on.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Ends every request still in flight or waiting with a "shutting down" error.
    pub fn end_all(&self) {
        self.engine.end_all();
    }

    /// False once the engine thread has ended.
    pub fn is_alive(&self) -> bool {
        self.engine.is_alive()
    }

    /// Requests waiting in the queue.
    pub fn queue_depth(&self) -> usize {
        self.engine.queue_depth()
    }

    /// Most requests that may wait.
    pub fn queue_capacity(&self) -> usize {
        self.engine.queue_capacity()
    }
}
