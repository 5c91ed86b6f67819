//! Error type shared by the whole crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading, encoding, decoding or rendering.
///
/// Variants that come from a file carry its path; config problems also name the field.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A required file is missing.
    #[error("{}: file not found", path.display())]
    MissingFile { path: PathBuf },

    /// A JSON file is not valid JSON.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// `tokenizer.json` is valid JSON but the `tokenizers` crate rejected it.
    #[error("{}: not a usable tokenizer: {source}", path.display())]
    Load {
        path: PathBuf,
        #[source]
        source: tokenizers::Error,
    },

    /// A field of a config file has an unusable value.
    #[error("{}: field `{field}`: {message}", path.display())]
    ConfigField {
        path: PathBuf,
        field: String,
        message: String,
    },

    /// The `tokenizers` crate failed to encode text.
    #[error("encoding failed: {source}")]
    Encode {
        #[source]
        source: tokenizers::Error,
    },

    /// The `tokenizers` crate failed to decode ids.
    #[error("decoding failed: {source}")]
    Decode {
        #[source]
        source: tokenizers::Error,
    },

    /// A token id that the tokenizer does not know.
    #[error("token id {id} is outside the tokenizer vocabulary (size {vocab_size})")]
    UnknownId { id: u32, vocab_size: usize },

    /// The chat template does not parse.
    #[error("chat template syntax error: {message}")]
    TemplateSyntax { message: String },

    /// The chat template called `raise_exception(msg)`.
    #[error("chat template raised an exception: {message}")]
    TemplateRaised { message: String },

    /// The chat template failed while rendering.
    #[error("chat template render error: {message}")]
    TemplateRender { message: String },

    /// A chat message or render option cannot be passed to the template.
    #[error("chat input: {message}")]
    ChatInput { message: String },

    /// `write_test_tokenizer` was asked for something it cannot build.
    #[error("test tokenizer: {message}")]
    TestTokenizer { message: String },
}

/// Result alias with [`TokenizerError`] as the default error.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
