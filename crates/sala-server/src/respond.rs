//! A checked request queued on the engine, and its events as a response: one JSON body, or
//! an SSE stream of chunks.

use crate::api::{parse_json, ApiError};
use crate::chat::check_chat;
use crate::completion::check_completion;
use crate::engine::{Event, LogprobEntry, Prompt};
use crate::http::{now, AppState};
use crate::metrics::Outcome;
use crate::params::{body_bytes, Kind};
use crate::reasoning::ReasoningSplit;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use sala_engine::generate::FinishReason;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::mpsc;

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// A logprob as JSON; a non-finite one (a token the model rules out) is -9999, OpenAI's
/// value for very unlikely tokens.
fn logprob_value(x: f32) -> Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!(-9999.0)
    }
}

/// The chat shape: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> = e
                .top
                .iter()
                .map(|(t, l)| json!({"token": t.text, "logprob": logprob_value(*l), "bytes": t.bytes}))
                .collect();
            json!({
                "token": e.token.text,
                "logprob": logprob_value(e.logprob),
                "bytes": e.token.bytes,
                "top_logprobs": top,
            })
        })
        .collect();
    json!({ "content": content })
}

/// The legacy completions shape: `tokens`, `token_logprobs`, `top_logprobs` (the most likely
/// tokens plus the sampled one, by text) and `text_offset` (characters from the start of the
/// completion; `offset` carries it across stream chunks).
fn completion_logprobs(entries: &[LogprobEntry], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        tokens.push(json!(e.token.text));
        token_logprobs.push(logprob_value(e.logprob));
        let mut top = serde_json::Map::new();
        let sampled = (&e.token, e.logprob);
        for (t, l) in e.top.iter().map(|(t, l)| (t, *l)).chain([sampled]) {
            top.entry(t.text.clone())
                .or_insert_with(|| logprob_value(l));
        }
        top_logprobs.push(Value::Object(top));
        text_offset.push(json!(*offset));
        *offset += e.token.text.chars().count();
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

/// A request that passed the checks and is queued.
struct Admitted {
    events: mpsc::Receiver<Event>,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

async fn admit(
    st: &AppState,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Admitted, ApiError> {
    let bytes = body_bytes(body)?;
    let value = parse_json(&bytes)?;
    let mut checked = match kind {
        Kind::Chat => check_chat(st, &value)?,
        Kind::Completion => check_completion(st, &value)?,
    };
    drop(value);
    // The template and the tokenizer run on a blocking thread of their own, never on the
    // engine thread: a long prompt delays no other request.
    if !matches!(checked.request.prompt, Prompt::Tokens(_)) {
        let engine = st.engine.clone();
        let prompt = std::mem::replace(&mut checked.request.prompt, Prompt::Tokens(Vec::new()));
        let ids = tokio::task::spawn_blocking(move || engine.token_ids(&prompt))
            .await
            .map_err(|e| ApiError::internal(format!("preparing the prompt: {e}")))?
            .map_err(|e| ApiError::from(&e))?;
        checked.request.prompt = Prompt::Tokens(ids);
    }
    let logprobs = checked.request.logprobs.is_some();
    let events = st.engine.submit(checked.request)?;
    Ok(Admitted {
        events,
        stream: checked.stream,
        include_usage: checked.include_usage,
        logprobs,
    })
}

pub(crate) async fn handle(
    st: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    // Errors from the engine thread are counted there; these are counted here.
    let counted = |e: ApiError| {
        st.engine
            .metrics
            .request_done(Outcome::of_status(e.status.as_u16()));
        e
    };
    let admitted = admit(&st, body, kind).await.map_err(counted)?;
    let mut events = admitted.events;
    match events.recv().await {
        Some(Event::Started { .. }) => {}
        Some(Event::Error(e)) => return Err(ApiError::from(&e)),
        _ => {
            return Err(counted(ApiError::internal(
                "the engine stopped before answering",
            )))
        }
    }
    let id = st.new_id(match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    });
    let meta = Meta {
        id,
        created: now(),
        model: st.engine.info.id.clone(),
        kind,
        logprobs: admitted.logprobs,
    };
    if admitted.stream {
        let stream = stream_response(meta, events, admitted.include_usage);
        return Ok(stream.into_response());
    }
    let mut text = String::new();
    let mut entries = Vec::new();
    loop {
        match events.recv().await {
            Some(Event::Text { text: t, logprobs }) => {
                text.push_str(&t);
                entries.extend(logprobs);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            }) => {
                let logprobs = match (meta.logprobs, kind) {
                    (false, _) => Value::Null,
                    (true, Kind::Chat) => chat_logprobs(&entries),
                    (true, Kind::Completion) => completion_logprobs(&entries, &mut 0),
                };
                let choice = match kind {
                    Kind::Chat => {
                        let mut split = ReasoningSplit::new();
                        let (a, b) = (split.push(&text), split.finish());
                        let mut message = json!({"role": "assistant",
                                                 "content": a.content + &b.content});
                        let reasoning = a.reasoning + &b.reasoning;
                        if !reasoning.is_empty() {
                            message["reasoning_content"] = reasoning.into();
                        }
                        json!({
                            "index": 0,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": finish_str(finish),
                        })
                    }
                    Kind::Completion => json!({
                        "index": 0,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish_str(finish),
                    }),
                };
                return Ok(Json(json!({
                    "id": meta.id,
                    "object": match kind {
                        Kind::Chat => "chat.completion",
                        Kind::Completion => "text_completion",
                    },
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage(prompt_tokens, completion_tokens),
                }))
                .into_response());
            }
            Some(Event::Error(e)) => return Err(ApiError::from(&e)),
            Some(Event::Started { .. }) => {}
            None => {
                return Err(counted(ApiError::internal(
                    "the engine stopped mid-generation",
                )))
            }
        }
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    /// Whether the request asked for logprobs.
    logprobs: bool,
}

impl Meta {
    /// One chunk with `delta` (chat) or `text` (completion), the chunk's logprobs (or null)
    /// and a finish reason.
    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        self.chunk_with(None, text, role, logprobs, finish)
    }

    /// [`Meta::chunk`] with the delta's `reasoning_content` (chat).
    fn chunk_with(
        &self,
        reasoning: Option<&str>,
        text: Option<&str>,
        role: bool,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(r) = reasoning {
                    delta.insert("reasoning_content".into(), r.into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Completion => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }
}

enum Phase {
    Role,
    Body,
    /// The finish chunk, then the usage (when asked for) or the end.
    Finish(Value, Option<Value>),
    Usage(Value),
    DoneMarker,
    End,
}

struct StreamState {
    meta: Meta,
    events: mpsc::Receiver<Event>,
    include_usage: bool,
    phase: Phase,
    /// Characters of completion text so far (`text_offset` of the legacy logprobs).
    offset: usize,
    /// A chat reply's reasoning apart from its content.
    split: ReasoningSplit,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// The SSE stream of one request; dropping it (the client left) closes the event channel,
/// which stops the generation.
fn stream_response(
    meta: Meta,
    events: mpsc::Receiver<Event>,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState {
        phase: if meta.kind == Kind::Chat {
            Phase::Role
        } else {
            Phase::Body
        },
        meta,
        events,
        include_usage,
        offset: 0,
        split: ReasoningSplit::new(),
    };
    Sse::new(stream::unfold(state, |mut st| async move {
        loop {
            let phase = std::mem::replace(&mut st.phase, Phase::End);
            let event = match phase {
                Phase::Role => {
                    st.phase = Phase::Body;
                    data(&st.meta.chunk(Some(""), true, Value::Null, None))
                }
                Phase::Body => match st.events.recv().await {
                    Some(Event::Text { text, logprobs }) => {
                        st.phase = Phase::Body;
                        if text.is_empty() && logprobs.is_empty() {
                            continue;
                        }
                        let lp = match (st.meta.logprobs, st.meta.kind) {
                            (false, _) => Value::Null,
                            (true, Kind::Chat) => chat_logprobs(&logprobs),
                            (true, Kind::Completion) => {
                                completion_logprobs(&logprobs, &mut st.offset)
                            }
                        };
                        if st.meta.kind == Kind::Completion {
                            data(&st.meta.chunk(Some(&text), false, lp, None))
                        } else {
                            let s = st.split.push(&text);
                            if s.reasoning.is_empty() && s.content.is_empty() && lp.is_null() {
                                continue;
                            }
                            let some = |t: &str| (!t.is_empty()).then(|| t.to_string());
                            let (r, c) = (some(&s.reasoning), some(&s.content));
                            data(
                                &st.meta
                                    .chunk_with(r.as_deref(), c.as_deref(), false, lp, None),
                            )
                        }
                    }
                    Some(Event::Started { .. }) => {
                        st.phase = Phase::Body;
                        continue;
                    }
                    Some(Event::Done {
                        finish,
                        prompt_tokens,
                        completion_tokens,
                    }) => {
                        let text = match st.meta.kind {
                            Kind::Chat => None,
                            Kind::Completion => Some(""),
                        };
                        let finish = Some(finish_str(finish));
                        let last = st.meta.chunk(text, false, Value::Null, finish);
                        let usage = st
                            .include_usage
                            .then(|| usage(prompt_tokens, completion_tokens));
                        // A chat reply's held-back text goes out before its finish chunk.
                        let rest = st.split.finish();
                        if st.meta.kind == Kind::Chat
                            && !(rest.reasoning.is_empty() && rest.content.is_empty())
                        {
                            st.phase = Phase::Finish(last, usage);
                            let some = |t: &str| (!t.is_empty()).then(|| t.to_string());
                            let (r, c) = (some(&rest.reasoning), some(&rest.content));
                            data(&st.meta.chunk_with(
                                r.as_deref(),
                                c.as_deref(),
                                false,
                                Value::Null,
                                None,
                            ))
                        } else {
                            st.phase = usage.map_or(Phase::DoneMarker, Phase::Usage);
                            data(&last)
                        }
                    }
                    Some(Event::Error(e)) => {
                        st.phase = Phase::DoneMarker;
                        data(&ApiError::from(&e).body())
                    }
                    None => {
                        st.phase = Phase::DoneMarker;
                        data(&ApiError::internal("the engine stopped mid-generation").body())
                    }
                },
                Phase::Finish(last, usage) => {
                    st.phase = usage.map_or(Phase::DoneMarker, Phase::Usage);
                    data(&last)
                }
                Phase::Usage(u) => {
                    st.phase = Phase::DoneMarker;
                    let mut chunk = st.meta.chunk(None, false, Value::Null, None);
                    chunk["choices"] = json!([]);
                    chunk["usage"] = u;
                    data(&chunk)
                }
                Phase::DoneMarker => SseEvent::default().data("[DONE]"),
                Phase::End => return None,
            };
            return Some((Ok(event), st));
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SSE data lines of a streamed chat reply made of `pieces`.
    async fn streamed(pieces: &[&str]) -> Vec<Value> {
        let (tx, rx) = mpsc::channel(64);
        for p in pieces {
            tx.send(Event::Text {
                text: p.to_string(),
                logprobs: Vec::new(),
            })
            .await
            .unwrap();
        }
        tx.send(Event::Done {
            finish: FinishReason::Stop,
            prompt_tokens: 3,
            completion_tokens: pieces.len(),
        })
        .await
        .unwrap();
        drop(tx);
        let meta = Meta {
            id: "chatcmpl-test".into(),
            created: 0,
            model: "m".into(),
            kind: Kind::Chat,
            logprobs: false,
        };
        let body = stream_response(meta, rx, true).into_response().into_body();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        text.lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// A streamed chat reply's `<think>` text arrives as `reasoning_content` deltas, the rest
    /// as `content`, with the finish and usage chunks after; the same split as unstreamed.
    #[tokio::test]
    async fn streamed_reasoning_goes_to_reasoning_content() {
        let chunks = streamed(&["<thi", "nk>Two and", " two</th", "ink>\n\nFour", "."]).await;
        let field = |f: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"][f].as_str())
                .collect()
        };
        assert_eq!(field("reasoning_content"), "Two and two");
        assert_eq!(field("content"), "Four.");
        let finish: Vec<_> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
            .collect();
        assert_eq!(finish, ["stop"]);
        assert!(chunks.last().unwrap()["usage"].is_object(), "{chunks:?}");
        // Held text released at the end still comes before the finish chunk.
        let chunks = streamed(&["<think>unfinished</thi"]).await;
        let at_finish = chunks
            .iter()
            .position(|c| c["choices"][0]["finish_reason"].is_string())
            .unwrap();
        let reasoning: String = chunks[..at_finish]
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
            .collect();
        assert_eq!(reasoning, "unfinished</thi");
    }
}
