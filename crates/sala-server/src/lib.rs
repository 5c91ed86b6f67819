//! `sala serve`: an OpenAI-compatible HTTP API over the sala engine.
//!
//! The engine thread ([`sala_engine::thread`], started by [`spawn_engine`]) owns the model
//! and the life of every request. This crate only translates: OpenAI request bodies to
//! [`sala_engine::request::Request`]s ([`router`], [`serve`]), the engine's events to JSON
//! responses or SSE streams, and its typed errors to OpenAI errors ([`ApiError`]). The
//! engine's events feed one [`Metrics`], served as Prometheus text at `/metrics`.
//!
//! A chat reply is read for reasoning ([`reasoning`]) and for tool calls in the model's own
//! dialect ([`tools`]), both streaming ([`reply`]).

pub mod api;
mod chat;
mod completion;
pub mod engine;
pub mod http;
pub mod metrics;
mod params;
pub mod reasoning;
pub mod reply;
mod respond;
pub mod tools;
mod wire;

pub use api::ApiError;
pub use engine::{spawn_engine, EngineHandle, EngineRunner, ModelInfo, DEFAULT_MAX_BATCH};
pub use http::{router, serve, serve_until, ServerOptions};
pub use metrics::{Metrics, Outcome};
