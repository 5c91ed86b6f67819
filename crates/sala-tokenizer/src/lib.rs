//! Tokenizer, chat template and streaming detokenization for MiniCPM-SALA checkpoints.
//!
//! * [`Tokenizer`]: loads `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`),
//!   encodes with Llama-style BOS handling, decodes.
//! * [`Detokenizer`]: incremental decoding that never splits a UTF-8 character and whose output
//!   concatenates to exactly [`Tokenizer::decode`].
//! * [`ChatTemplate`]: HF-compatible Jinja chat templates (minijinja), ChatML fallback.
//! * [`write_test_tokenizer`]: a deterministic small tokenizer laid out like the real vocab,
//!   for tests and random checkpoints.

mod bytes;
mod chat;
mod detok;
mod error;
mod pyjson;
mod testgen;
mod tokenizer;

pub use bytes::TokenBytes;
pub use chat::{
    ChatMessage, ChatOptions, ChatTemplate, ContentPart, MessageContent, CHATML_TEMPLATE,
};
pub use detok::Detokenizer;
pub use error::{Result, TokenizerError};
pub use testgen::{
    write_test_tokenizer, ADDED_SPECIAL_TOKENS, MIN_TEST_VOCAB_SIZE, TEST_CHAT_TEMPLATE,
};
pub use tokenizer::Tokenizer;
