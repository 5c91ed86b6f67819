//! `POST /v1/chat/completions`: messages through the chat template, the reply read for
//! reasoning and tool calls ([`crate::reply`], [`crate::tools`]).

use crate::api::{parse_body, ApiError, ChatBody, CommonParams, MAX_MESSAGES, MAX_TOP_LOGPROBS};
use crate::engine::Prompt;
use crate::http::AppState;
use crate::params::{check_common, Checked, Kind};
use crate::reply::{ReplyPiece, ReplySetup};
use crate::respond::handle;
use crate::tools::{self, parse::ParsedCall};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use sala_engine::generate::FinishReason;
use sala_engine::grammar::GrammarSpec;
use sala_engine::request::ChatEnding;
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// The roles a chat message may have (OpenAI's; `developer` is read as `system`).
const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

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

    // The prompt's own logprobs and its echo are the legacy completions' (vLLM's chat echo
    // and prompt_logprobs are not offered).
    if body.echo == Some(true) {
        return Err(ApiError::invalid(
            "echo is not supported by /v1/chat/completions; send the prompt to /v1/completions \
             with echo",
        )
        .param("echo"));
    }
    if body.prompt_logprobs.is_some() {
        return Err(ApiError::invalid(
            "prompt_logprobs is not supported by /v1/chat/completions; send the prompt to \
             /v1/completions with prompt_logprobs (or echo and logprobs)",
        )
        .param("prompt_logprobs"));
    }
    for (i, m) in body.messages.iter().enumerate() {
        if !CHAT_ROLES.contains(&m.role.as_str()) {
            return Err(ApiError::invalid(format!(
                "messages[{i}].role is {:?}; it must be one of {}",
                m.role,
                CHAT_ROLES.join(", ")
            ))
            .param(format!("messages[{i}].role")));
        }
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
    tools::prepare_messages(&mut messages)?;
    let tools = tools::check_tools(
        body.tools,
        body.tool_choice.as_ref(),
        body.parallel_tool_calls,
        ending,
    )?;
    let forced = tools.forced();
    let prompt = Prompt::Chat {
        ending,
        messages,
        kwargs: body.chat_template_kwargs.unwrap_or_default(),
        tools: tools.template_tools,
        reply_prefix: tools.reply_prefix.clone(),
    };
    let mut checked = check_common(st, common, prompt, logprobs, false)?;
    checked.schemas = tools.strict_schemas;
    let mut reading = tools.reading;
    if checked.grammar.is_some() {
        if forced {
            return Err(ApiError::invalid(
                "a required or named tool_choice makes the reply tool calls; it cannot be \
                 combined with response_format",
            )
            .param("tool_choice"));
        }
        if ending == ChatEnding::ContinueFinal {
            // The grammar would hold only the continuation, not the message it ends.
            return Err(ApiError::invalid(
                "response_format constrains a whole reply; it cannot be combined with \
                 continue_final_message, which continues the last assistant message",
            )
            .param("response_format"));
        }
        // The reply is the structured answer: no calls are read out of it.
        reading = None;
    } else if let Some(grammar) = tools.grammar {
        let param = if forced { "tool_choice" } else { "tools" };
        checked.grammar = Some(GrammarSpec::Lark {
            grammar,
            param: param.into(),
        });
    }
    checked.reply = Some(ReplySetup {
        prefix: tools.reply_prefix,
        calls: reading,
    });
    Ok(checked)
}

pub(crate) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A call as OpenAI's `tool_calls` entry, with a new id.
fn call_json(call: &ParsedCall) -> Value {
    json!({
        "id": tools::call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    })
}

/// The finish reason of a reply that made `calls` calls: `tool_calls` when it made any and
/// was not cut off by its length.
pub(crate) fn chat_finish(finish: FinishReason, calls: usize) -> &'static str {
    match finish {
        FinishReason::Stop | FinishReason::Cancelled if calls > 0 => "tool_calls",
        f => crate::respond::finish_str(f),
    }
}

/// The `message` of a whole reply: its content (null when empty and there are calls, as
/// OpenAI writes it), `reasoning_content` when there was reasoning, `tool_calls` when calls
/// were made.
pub(crate) fn chat_message(reply: &ReplyPiece) -> Value {
    let content = if reply.content.is_empty() && !reply.calls.is_empty() {
        Value::Null
    } else {
        reply.content.clone().into()
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !reply.reasoning.is_empty() {
        message["reasoning_content"] = reply.reasoning.clone().into();
    }
    if !reply.calls.is_empty() {
        message["tool_calls"] = reply.calls.iter().map(call_json).collect();
    }
    message
}

/// The stream deltas of a piece of a reply: one with its reasoning and content (when it has
/// any), then two per call, as OpenAI streams them: the call's `index`, `id`, `type` and
/// name with empty `arguments`, then the arguments. `calls` counts the calls streamed so far.
pub(crate) fn chat_deltas(piece: &ReplyPiece, calls: &mut usize) -> Vec<Map<String, Value>> {
    let mut out = Vec::new();
    if !(piece.reasoning.is_empty() && piece.content.is_empty()) {
        let mut delta = Map::new();
        if !piece.reasoning.is_empty() {
            delta.insert("reasoning_content".into(), piece.reasoning.clone().into());
        }
        if !piece.content.is_empty() {
            delta.insert("content".into(), piece.content.clone().into());
        }
        out.push(delta);
    }
    for call in &piece.calls {
        let index = *calls;
        *calls += 1;
        let head = json!([{
            "index": index,
            "id": tools::call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }]);
        let args = json!([{"index": index, "function": {"arguments": call.arguments}}]);
        for part in [head, args] {
            let mut delta = Map::new();
            delta.insert("tool_calls".into(), part);
            out.push(delta);
        }
    }
    out
}
