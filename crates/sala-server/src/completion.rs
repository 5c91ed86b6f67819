//! `POST /v1/completions`: a prompt (text or token ids), or a list of them, continued; prompt
//! `p`'s choice `j` is `choices[p * n + j]`.

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

/// Most prompts in one completion request (each has `n` choices).
pub(crate) const MAX_PROMPTS: usize = 64;
use std::sync::Arc;

pub(crate) fn check_completion(st: &AppState, value: &Value) -> Result<Checked, ApiError> {
    let common: CommonParams = parse_body(value)?;
    let body: CompletionBody = parse_body(value)?;
    let prompts: Vec<Prompt> = match body.prompt {
        PromptField::One(s) => vec![Prompt::Text(s)],
        PromptField::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptField::Many(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptField::ManyTokens(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt must not be an empty list").param("prompt"));
    }
    if prompts.len() > MAX_PROMPTS {
        return Err(ApiError::invalid(format!(
            "prompt is a list of {} prompts; at most {MAX_PROMPTS} are allowed",
            prompts.len()
        ))
        .param("prompt"));
    }
    for (i, prompt) in prompts.iter().enumerate() {
        let empty = match prompt {
            Prompt::Text(s) => s.is_empty(),
            Prompt::Tokens(ids) => ids.is_empty(),
            Prompt::Chat { .. } => false,
        };
        if empty {
            let message = match prompts.len() {
                1 => "prompt must not be empty".to_string(),
                _ => format!("prompt[{i}] must not be empty"),
            };
            return Err(ApiError::invalid(message).param("prompt"));
        }
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
    let echo = body.echo.unwrap_or(false);
    let prompt_logprobs = match body.prompt_logprobs {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid(format!(
                "prompt_logprobs is {n}; it must be in 0..={MAX_TOP_LOGPROBS}"
            ))
            .param("prompt_logprobs"))
        }
    };
    if prompt_logprobs.is_some() && common.stream == Some(true) {
        return Err(ApiError::invalid(
            "prompt_logprobs cannot be streamed; stream with echo and logprobs instead (the \
             first chunk of each choice holds the prompt's)",
        )
        .param("prompt_logprobs"));
    }
    let mut prompts = prompts.into_iter();
    let first = prompts.next().expect("checked above");
    let scores_prompt = echo || prompt_logprobs.is_some();
    let mut checked = check_common(st, common, first, logprobs, scores_prompt)?;
    checked.more_prompts = prompts.collect();
    checked.echo = echo;
    checked.prompt_logprobs = prompt_logprobs;
    // The engine lists as many alternatives as either shows.
    let shown = [prompt_logprobs, logprobs.filter(|_| echo)];
    checked.request.prompt_logprobs = shown.into_iter().flatten().max();
    Ok(checked)
}

pub(crate) async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
