//! `POST /v1/completions`: a prompt (text or token ids) continued.

use crate::api::{
    parse_body, ApiError, CommonParams, CompletionBody, PromptField, MAX_TOP_LOGPROBS,
};
use crate::engine::Prompt;
use crate::http::AppState;
use crate::params::{check_common, Checked, Kind};
use crate::respond::handle;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::sync::Arc;

pub(crate) fn check_completion(st: &AppState, value: &Value) -> Result<Checked, ApiError> {
    let common: CommonParams = parse_body(value)?;
    let body: CompletionBody = parse_body(value)?;
    let many = |n: usize| {
        ApiError::invalid(format!(
            "prompt is a list of {n} prompts; only one prompt per request is supported"
        ))
        .param("prompt")
    };
    let prompt = match body.prompt {
        PromptField::One(s) => Prompt::Text(s),
        PromptField::Tokens(ids) => Prompt::Tokens(ids),
        PromptField::Many(mut v) if v.len() == 1 => Prompt::Text(v.pop().unwrap_or_default()),
        PromptField::ManyTokens(mut v) if v.len() == 1 => {
            Prompt::Tokens(v.pop().unwrap_or_default())
        }
        PromptField::Many(v) => return Err(many(v.len())),
        PromptField::ManyTokens(v) => return Err(many(v.len())),
    };
    let empty = match &prompt {
        Prompt::Text(s) => s.is_empty(),
        Prompt::Tokens(ids) => ids.is_empty(),
        Prompt::Chat { .. } => false,
    };
    if empty {
        return Err(ApiError::invalid("prompt must not be empty").param("prompt"));
    }
    if body.echo == Some(true) {
        return Err(ApiError::invalid("echo is not supported").param("echo"));
    }
    if body.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("only best_of = 1 is supported").param("best_of"));
    }
    if body.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix is not supported").param("suffix"));
    }
    let logprobs = match body.logprobs {
        Some(n) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(format!(
                "logprobs is {n}; it must be in 0..={MAX_TOP_LOGPROBS}"
            ))
            .param("logprobs"))
        }
        n => n.map(|n| n as usize),
    };
    check_common(st, common, prompt, logprobs)
}

pub(crate) async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
