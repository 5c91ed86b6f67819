//! OpenAI-style errors and request bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sala_engine::grammar::GrammarSpec;
use sala_engine::request::RequestError;
use serde::Deserialize;
use serde_json::{json, Value};

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// The engine's errors as OpenAI's: a status, `type`, `code` and `param`.
impl From<&RequestError> for ApiError {
    fn from(e: &RequestError) -> Self {
        let message = e.to_string();
        match e {
            RequestError::InvalidRequest { param, .. } => {
                let err = Self::invalid(message);
                match param {
                    Some(p) => err.param(p.clone()),
                    None => err,
                }
            }
            RequestError::ContextLengthExceeded { .. } => {
                Self::invalid(message).code("context_length_exceeded")
            }
            RequestError::MemoryBusy { .. } => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .code("memory_busy")
            }
            RequestError::QueueFull => {
                Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .code("queue_full")
            }
            RequestError::Stopped => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
            }
            RequestError::ShuttingDown => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
                    .code("shutting_down")
            }
            RequestError::Stalled { .. } => {
                Self::new(StatusCode::REQUEST_TIMEOUT, "timeout_error", message).code("stalled")
            }
            RequestError::Internal { .. } => Self::internal(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `seed`: any 64-bit integer; a negative one is taken modulo 2^64.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
pub enum SeedField {
    Unsigned(u64),
    Signed(i64),
}

impl SeedField {
    pub fn value(self) -> u64 {
        match self {
            SeedField::Unsigned(s) => s,
            SeedField::Signed(s) => s as u64,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The parameters shared by `/v1/chat/completions` and `/v1/completions`; unknown fields are
/// ignored, as OpenAI clients send many.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// `0` or `-1` disable it.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<SeedField>,
    pub stop: Option<StopField>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub n: Option<u64>,
    /// Not supported: an error unless absent or empty.
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Keep generating past EOS tokens (vLLM's extension).
    pub ignore_eos: Option<bool>,
    /// `false`: no speculative decoding for this request even when the server speculates
    /// (an extension; the output is distributed the same either way).
    pub speculative: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Structured output: `text` (free), `json_object` or `json_schema`.
    pub response_format: Option<ResponseFormat>,
}

/// `response_format`: what the output must be.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema`. The schema is enforced whether `strict` is true or not.
#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

impl ResponseFormat {
    /// The grammar the output must match (`None` for free text).
    pub fn grammar(self) -> Result<Option<GrammarSpec>, ApiError> {
        Ok(match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(GrammarSpec::JsonObject),
            ResponseFormat::JsonSchema { json_schema } => match json_schema.schema {
                Some(schema) => Some(GrammarSpec::JsonSchema(schema)),
                None => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.schema is required: the JSON schema the \
                         output must match",
                    )
                    .param("response_format"))
                }
            },
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    pub messages: Vec<sala_tokenizer::ChatMessage>,
    /// Extra chat template variables (vLLM's extension), e.g. `enable_thinking`.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Append the assistant's header (default true).
    pub add_generation_prompt: Option<bool>,
    /// Leave the final (assistant) message open, so that the reply continues it.
    pub continue_final_message: Option<bool>,
    /// Return each output token's logprob.
    pub logprobs: Option<bool>,
    /// With `logprobs`: how many most likely tokens to list per position (0..=20).
    pub top_logprobs: Option<u64>,
    /// Functions the model may call (OpenAI's `{"type": "function", "function": {...}}`),
    /// checked by [`crate::tools::check_tools`].
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// False: keep only the first call of a reply.
    pub parallel_tool_calls: Option<bool>,
    /// Not supported here (a completion's `echo`): an error when true.
    pub echo: Option<bool>,
    /// Not supported here (a completion's `prompt_logprobs`): an error when given.
    pub prompt_logprobs: Option<Value>,
}

/// `prompt`: a string, token ids, or a list holding exactly one of those.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Tokens(Vec<u32>),
    Many(Vec<String>),
    ManyTokens(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    pub prompt: PromptField,
    /// Return each output token's logprob with this many most likely tokens (0..=20); with
    /// `echo`, each prompt token's too.
    pub logprobs: Option<u64>,
    /// Return the prompt before the completion (and, with `logprobs`, its tokens' logprobs).
    pub echo: Option<bool>,
    /// vLLM's extension: each prompt token's logprob with this many most likely tokens
    /// (0..=20), as a `prompt_logprobs` list in each choice.
    pub prompt_logprobs: Option<i64>,
    /// Not supported: an error above 1.
    pub best_of: Option<u64>,
    /// Not supported: an error unless absent or empty.
    pub suffix: Option<String>,
}

/// Most alternatives `top_logprobs` (chat) or `logprobs` (completions) may ask for.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// Most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 16;

/// Most messages a chat request may hold.
pub const MAX_MESSAGES: usize = 4096;

/// Most tools a chat request may give (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// What a field that takes several shapes must be, in our words (serde's name the Rust type).
fn expected_shape(path: &str) -> Option<&'static str> {
    Some(match path {
        "prompt" => {
            "a string, a list of token ids (integers from 0), or a list holding one of those"
        }
        "stop" => "a string or a list of strings",
        "seed" => "an integer that fits in 64 bits (-2^63 to 2^64 - 1)",
        "response_format" => {
            "an object whose `type` is `text`, `json_object` or `json_schema` (with \
             `json_schema.schema`)"
        }
        _ if path.starts_with("messages") && path.ends_with("content") => {
            "a string or a list of content parts"
        }
        _ => return None,
    })
}

/// Parses a request body: JSON, an object, then `T` with the failing field named.
pub fn parse_body<T: serde::de::DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." {
            ApiError::invalid(format!("invalid request body: {inner}"))
        } else if let Some(shape) = expected_shape(&path).filter(|_| inner.contains("tagged enum"))
        {
            ApiError::invalid(format!("invalid field `{path}`: it must be {shape}")).param(path)
        } else {
            ApiError::invalid(format!("invalid field `{path}`: {inner}")).param(path)
        }
    })
}

/// Parses the bytes of a body as a JSON object.
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    // A UTF-8 byte order mark before the JSON is allowed (RFC 8259 lets a reader ignore it).
    let bytes = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    Ok(value)
}
