//! `POST /v1/chat/completions`: messages through the chat template.

use crate::api::{parse_body, ApiError, ChatBody, CommonParams, MAX_MESSAGES, MAX_TOP_LOGPROBS};
use crate::engine::Prompt;
use crate::http::AppState;
use crate::params::{check_common, Checked, Kind};
use crate::respond::handle;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use sala_engine::request::ChatEnding;
use serde_json::Value;
use std::sync::Arc;

pub(crate) fn check_chat(st: &AppState, value: &Value) -> Result<Checked, ApiError> {
    let common: CommonParams = parse_body(value)?;
    let body: ChatBody = parse_body(value)?;
    if body.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty").param("messages"));
    }
    if body.messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(format!(
            "messages holds {} messages; at most {MAX_MESSAGES} are allowed",
            body.messages.len()
        ))
        .param("messages"));
    }

    for (i, m) in body.messages.iter().enumerate() {
        m.text().map_err(|e| {
            ApiError::invalid(format!("messages[{i}]: {e}")).param(format!("messages[{i}]"))
        })?;
    }
    let logprobs = match (body.logprobs.unwrap_or(false), body.top_logprobs) {
        (_, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(format!(
                "top_logprobs is {n}; it must be in 0..={MAX_TOP_LOGPROBS}"
            ))
            .param("top_logprobs"))
        }
        (false, Some(n)) if n > 0 => {
            return Err(
                ApiError::invalid("top_logprobs needs logprobs to be true").param("top_logprobs")
            )
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, _) => None,
    };
    // OpenAI's `developer` role is the system prompt of models that have no such role.
    let mut messages = body.messages;
    for m in &mut messages {
        if m.role == "developer" {
            m.role = "system".into();
        }
    }
    let ending = match (body.add_generation_prompt, body.continue_final_message) {
        (Some(true), Some(true)) => {
            return Err(ApiError::invalid(
                "add_generation_prompt and continue_final_message cannot both be true",
            )
            .param("continue_final_message"))
        }
        (_, Some(true)) => ChatEnding::ContinueFinal,
        (Some(false), _) => ChatEnding::AsRendered,
        _ => ChatEnding::GenerationPrompt,
    };
    let prompt = Prompt::Chat {
        ending,
        messages,
        kwargs: body.chat_template_kwargs.unwrap_or_default(),
        tools: None,
        reply_prefix: String::new(),
    };
    check_common(st, common, prompt, logprobs)
}

pub(crate) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
