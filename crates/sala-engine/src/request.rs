//! What a caller asks of the engine and hears back: a [`Request`], its [`Event`]s, and the
//! typed [`RequestError`]s it may end with. Nothing here knows a transport: the HTTP server
//! maps errors to status codes itself.

use crate::generate::EngineError;
use crate::plain::Marks;
use crate::sampling::{PromptTokenLogprobs, SamplingParams, TokenLogprobs};
use sala_tokenizer::{ChatMessage, ChatOptions, ChatTemplate, Tokenizer};

/// A request's number, unique within its batch.
pub type RequestId = u64;

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text, encoded with the tokenizer's BOS.
    Text(String),
    /// Messages through the model's chat template.
    Chat {
        messages: Vec<ChatMessage>,
        /// Extra template variables, e.g. `enable_thinking`.
        kwargs: serde_json::Map<String, serde_json::Value>,
        /// How the prompt ends: ready for the assistant's reply, inside the final (assistant)
        /// message so that the reply continues it, or as the template leaves it.
        ending: ChatEnding,
        /// Tool definitions for the template's `tools` (OpenAI's shape, `{"type": "function",
        /// "function": {...}}`, as Hugging Face passes them); `None` renders as `none`.
        tools: Option<Vec<serde_json::Value>>,
        /// Text the reply must begin with, appended to the rendered prompt (after the
        /// generation prompt): it is part of the prompt, and the generated text continues it.
        /// A server forces a tool call this way (`tool_choice` required or named). Empty for
        /// none.
        reply_prefix: String,
    },
    /// Token ids, as they are.
    Tokens(Vec<u32>),
}

/// `rendered` cut just after the final message's content, so that generation continues it
/// (the final message must be the assistant's, its content found in the render).
fn continue_final(rendered: String, messages: &[ChatMessage]) -> Result<String, RequestError> {
    let refuse = |why: &str| {
        Err(RequestError::invalid(format!("continue_final_message: {why}")).param("messages"))
    };
    let Some(last) = messages.last().filter(|m| m.role == "assistant") else {
        return refuse("the final message must be the assistant's");
    };
    let content = match last.text() {
        Ok(Some(t)) if !t.trim().is_empty() => t,
        _ => return refuse("the final message has no text to continue"),
    };
    // Templates may trim the content: look for it as rendered, then trimmed.
    for needle in [content.as_str(), content.trim_end(), content.trim()] {
        if let Some(at) = rendered.rfind(needle) {
            let mut text = rendered;
            text.truncate(at + needle.len());
            return Ok(text);
        }
    }
    refuse("the chat template does not show the final message's text")
}

impl Prompt {
    /// The prompt's token ids; `template` is the model's chat template (or why it has none).
    /// Special-token text in a chat request's own text is plain text ([`crate::plain`]).
    pub fn token_ids(
        &self,
        tokenizer: &Tokenizer,
        template: &Result<ChatTemplate, String>,
    ) -> Result<Vec<u32>, RequestError> {
        self.token_ids_with(tokenizer, template, false)
    }

    /// [`Prompt::token_ids`]; with `specials_in_text`, special-token text in a chat request
    /// becomes the special token, as Hugging Face's tokenizers read it.
    pub fn token_ids_with(
        &self,
        tokenizer: &Tokenizer,
        template: &Result<ChatTemplate, String>,
        specials_in_text: bool,
    ) -> Result<Vec<u32>, RequestError> {
        let encode_error = |e: sala_tokenizer::TokenizerError| {
            RequestError::invalid(format!("tokenizing the prompt: {e}"))
        };
        let text = match self {
            Prompt::Tokens(ids) => return Ok(ids.clone()),
            Prompt::Text(t) => t.clone(),
            Prompt::Chat {
                messages,
                kwargs,
                ending,
                tools,
                reply_prefix,
            } => {
                let template = template.as_ref().map_err(|e| {
                    RequestError::invalid(format!("this model has no usable chat template: {e}"))
                })?;
                let mut marks = Marks::new(tokenizer.special_texts());
                let mut messages = std::borrow::Cow::Borrowed(&messages[..]);
                let mut opts = ChatOptions {
                    add_generation_prompt: *ending == ChatEnding::GenerationPrompt,
                    tools: tools.clone(),
                    kwargs: kwargs.clone(),
                };
                if !specials_in_text {
                    messages
                        .to_mut()
                        .iter_mut()
                        .for_each(|m| marks.mark_message(m));
                    opts.tools
                        .iter_mut()
                        .flatten()
                        .for_each(|t| marks.mark_json(t));
                    opts.kwargs.values_mut().for_each(|v| marks.mark_json(v));
                }
                let text = template.render(&messages, &opts).map_err(|e| {
                    RequestError::invalid(format!("applying the chat template: {e}"))
                        .param("messages")
                })?;
                let mut text = if *ending == ChatEnding::ContinueFinal {
                    continue_final(text, &messages)?
                } else {
                    text
                };
                text.push_str(reply_prefix);
                if marks.any() {
                    let (text, plain) = marks.restore(&text)?;
                    return tokenizer
                        .encode_with_plain_spans(&text, true, &plain)
                        .map_err(encode_error);
                }
                text
            }
        };
        tokenizer.encode(&text, true).map_err(encode_error)
    }
}

/// How a chat prompt ends ([`Prompt::Chat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnding {
    /// The assistant's header follows the messages (`add_generation_prompt`).
    #[default]
    GenerationPrompt,
    /// The final message, an assistant's, is left open: the reply continues it
    /// (`continue_final_message`).
    ContinueFinal,
    /// The messages as the template renders them, nothing added.
    AsRendered,
}

/// One request: a prompt and how to generate from it.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate (the context budget may stop it sooner).
    pub max_tokens: usize,
    /// Generation stops when one of these appears; it is not shown.
    pub stop: Vec<String>,
    /// Keep generating past EOS tokens.
    pub ignore_eos: bool,
    /// Speculative decoding when the engine thread speculates (`false`: opt out).
    pub speculative: bool,
    /// Report each token's logprob with this many alternatives (`None`: no logprobs).
    pub logprobs: Option<usize>,
    /// Report each prompt token's logprob with this many alternatives ([`Event::Prompt`];
    /// `None`: none).
    pub prompt_logprobs: Option<usize>,
    /// What the output must match, compiled ([`crate::thread::Handle::grammar`]).
    pub grammar: Option<crate::grammar::Grammar>,
}

/// How a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` or the context budget.
    Length,
    /// The caller asked to stop, or its client left.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "cancelled",
        }
    }
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
    pub fn new(tokenizer: &Tokenizer, lp: &TokenLogprobs) -> Self {
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

/// The log-probabilities of a prompt's tokens under the raw log-softmax of the model's
/// logits: entry `i` is token `i + 1` given the tokens before it (the first token has none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PromptLogprobs {
    /// Alternatives listed at each position (fewer where the model rules tokens out).
    pub top: usize,
    pub tokens: Vec<PromptTokenLogprobs>,
}

/// What the engine reports about a request, in order: `Started` or `Error`; then `Prompt`
/// when asked for; then `Text`s; then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    Started {
        prompt_tokens: usize,
    },
    /// The whole prompt is read: its tokens' log-probabilities.
    Prompt {
        logprobs: PromptLogprobs,
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
        /// Prompt tokens taken from the prefix cache.
        cached_tokens: usize,
        completion_tokens: usize,
    },
    Error(RequestError),
}

/// Why a request failed or was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The request cannot be served as asked; `param` names the field at fault.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    /// The prompt, or the prompt with `max_tokens`, does not fit the context budget or the
    /// memory limit even alone: a retry cannot help, a shorter request can.
    #[error("{message}")]
    ContextLengthExceeded { message: String },
    /// The requests in flight hold the memory this one needs: retry later.
    #[error("{message}")]
    MemoryBusy { message: String },
    /// Too many requests are waiting: retry later.
    #[error("the server is busy: too many requests are waiting; retry later")]
    QueueFull,
    /// The engine thread has ended.
    #[error("the engine has stopped")]
    Stopped,
    /// The server is shutting down: the request was not finished in time, or came too late.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The request's client did not read its events for `millis` ms while its place in the
    /// batch or its memory was needed: it was ended.
    #[error(
        "the request was ended: its client read none of its output for {} s while other \
         requests needed its place",
        *millis as f64 / 1000.0
    )]
    Stalled { millis: u64 },
    /// A failure of the engine, not of the request.
    #[error("{message}")]
    Internal { message: String },
}

impl RequestError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: None,
        }
    }

    /// The same error naming `param` (for [`RequestError::InvalidRequest`]; others are kept).
    pub fn param(self, param: impl Into<String>) -> Self {
        match self {
            Self::InvalidRequest { message, .. } => Self::InvalidRequest {
                message,
                param: Some(param.into()),
            },
            e => e,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::Internal {
            message: message.into(),
        }
    }
}

impl From<EngineError> for RequestError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Sampling(e) => {
                let message = e.to_string();
                match e {
                    crate::sampling::SamplingError::InvalidParam { param, .. } => {
                        Self::invalid(message).param(param)
                    }
                    _ => Self::invalid(message),
                }
            }
            EngineError::Stop(e) => Self::invalid(e.to_string()).param("stop"),
            EngineError::Grammar(e) => Self::invalid(e.to_string()).param(e.param.clone()),
            EngineError::EmptyPrompt => Self::invalid(e.to_string()),
            EngineError::PromptTooLong { .. } | EngineError::OverBudget(_) => {
                Self::ContextLengthExceeded {
                    message: e.to_string(),
                }
            }
            EngineError::MemoryBusy(_) => Self::MemoryBusy {
                message: format!("the server is busy: {e}; retry later"),
            },
            e => Self::internal(format!("generation failed: {e}")),
        }
    }
}
