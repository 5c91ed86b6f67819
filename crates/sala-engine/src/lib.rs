//! The engine: a model loaded onto a backend, and the life of every request on it.
//!
//! - [`request`]: what a caller asks ([`request::Request`]) and hears back
//!   ([`request::Event`]), and the typed errors a request may end with.
//! - [`scheduler`]: the per-step token budget: decode rows first, then whole prompt chunks.
//! - [`cache`]: the cache budget, the one place that admits memory and counts what is held.
//! - [`prefix`]: the prefix cache: ended sequences parked, resumed by prompts that begin
//!   with their tokens (`block_tree`: their index, a radix tree of 64-token blocks).
//! - [`step`]: one engine step over the [`step::Batch`] of requests in flight.
//! - [`thread`]: the engine thread that owns the model and serves a bounded queue.
//! - [`generate`]: the [`generate::Engine`] itself, and one request run to its end.
//! - [`context`]: long prompts read by several ranks at once (context parallelism).
//! - [`sampling`], [`stop`]: choosing tokens, and stop strings.
//! - [`grammar`]: structured output, a JSON schema enforced by constrained decoding.
//! - [`perplexity`]: sliding-window perplexity of a text, from its prompt log-probabilities.
//! - [`draft`]: draft tokens for speculative decoding (prompt lookup).
//! - `plain`: special-token text in a chat request's own text kept as plain text.

mod block_tree;
pub mod cache;
pub mod context;
pub mod draft;
pub mod generate;
pub mod grammar;
pub mod perplexity;
mod plain;
pub mod prefix;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod step;
pub mod stop;
pub mod thread;
