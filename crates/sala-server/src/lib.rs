//! `sala serve`: an OpenAI-compatible HTTP API over one [`sala_engine::generate::Engine`].
//!
//! One engine thread owns the model and serves requests one at a time from a bounded queue
//! ([`spawn_engine`]); the HTTP side ([`router`], [`serve`]) parses and checks requests,
//! queues them, and turns the engine's events into JSON responses or SSE streams. Both sides
//! count into one [`Metrics`], served as Prometheus text at `/metrics`.

pub mod api;
pub mod engine;
pub mod http;
pub mod metrics;

pub use api::ApiError;
pub use engine::{spawn_engine, EngineHandle, EngineRunner, ModelInfo, DEFAULT_MAX_BATCH};
pub use http::{router, serve, ServerOptions};
pub use metrics::{Metrics, Outcome};
