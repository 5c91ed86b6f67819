//! Routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/v1/models/{id}`,
//! `/health`, `/metrics`.

use crate::api::{
    parse_body, parse_json, ApiError, ChatBody, CommonParams, CompletionBody, PromptField,
    StopField, MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
};
use crate::engine::{EngineHandle, Event, LogprobEntry, Prompt, Request};
use crate::metrics::Outcome;
use crate::reasoning::ReasoningSplit;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use sala_engine::generate::FinishReason;
use sala_engine::grammar::GrammarSpec;
use sala_engine::request::ChatEnding;
use sala_engine::sampling::SamplingParams;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// HTTP settings.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest request body in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long a graceful shutdown lets the requests in flight run before ending them.
    pub shutdown_timeout: std::time::Duration,
    /// How long a connection may take to send a request's headers, or stay idle between
    /// requests; then it is closed.
    pub header_timeout: std::time::Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            shutdown_timeout: std::time::Duration::from_secs(30),
            header_timeout: std::time::Duration::from_secs(30),
        }
    }
}

struct AppState {
    engine: EngineHandle,
    started: u64,
    next_id: AtomicU64,
}

impl AppState {
    fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.started)
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The application's routes over a running engine.
pub fn router(engine: EngineHandle, opts: &ServerOptions) -> Router {
    let state = Arc::new(AppState {
        engine,
        started: now(),
        next_id: AtomicU64::new(0),
    });
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::middleware::map_response(method_not_allowed))
        .layer(DefaultBodyLimit::max(opts.max_body_bytes))
        .with_state(state)
}

/// Serves `router(engine, opts)` on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    opts: &ServerOptions,
) -> std::io::Result<()> {
    serve_until(listener, engine, opts, std::future::pending()).await
}

/// Serves until `shutdown` resolves, then shuts down gracefully: new requests get a 503 and
/// `/health` reports draining, while the requests in flight run on, for at most
/// `opts.shutdown_timeout`; then the rest end with an error (an error event on a stream, a 503
/// otherwise), the listener closes, and this returns once every connection has closed.
pub async fn serve_until(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    opts: &ServerOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(engine.clone(), opts);
    let grace = opts.shutdown_timeout;
    let begin = async move {
        shutdown.await;
        engine.drain();
        let idle = |e: &EngineHandle| e.metrics.running() == 0 && e.queue_depth() == 0;
        let deadline = tokio::time::Instant::now() + grace;
        while !idle(&engine) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        if !idle(&engine) {
            engine.end_all();
            // The engine ends them between steps; their clients hear it.
            let settle = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
            while !idle(&engine) && tokio::time::Instant::now() < settle {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    accept_until(listener, app, opts.header_timeout, begin).await;
    Ok(())
}

/// Serves `app` on every connection `listener` accepts (HTTP/1.1, headers within
/// `header_timeout`, idle keep-alive connections closed after it) until `stop` resolves; then
/// closes the listener, lets each connection finish its response, and returns when all have
/// closed.
async fn accept_until(
    listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: std::time::Duration,
    stop: impl std::future::Future<Output = ()>,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    // Each connection holds a sender; all dropped means all closed.
    let (open_tx, mut open_rx) = mpsc::channel::<()>(1);
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: wait a little, keep serving.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(open);
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    drop(open_tx);
    let _ = open_rx.recv().await;
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route; this server has POST /v1/chat/completions, POST /v1/completions, \
         GET /v1/models, GET /v1/models/{id}, GET /health and GET /metrics",
    )
}

/// A route asked with a method it does not take: the OpenAI error body, beside the `Allow`
/// header axum sets.
async fn method_not_allowed(res: Response) -> Response {
    if res.status() != StatusCode::METHOD_NOT_ALLOWED {
        return res;
    }
    let allow = res.headers().get(header::ALLOW).cloned();
    let methods = allow
        .as_ref()
        .and_then(|a| a.to_str().ok())
        .unwrap_or("another method")
        .to_string();
    let mut out = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!("this route does not take that method; it takes {methods}"),
    )
    .into_response();
    if let Some(a) = allow {
        out.headers_mut().insert(header::ALLOW, a);
    }
    out
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.engine.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response()
    } else if st.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the engine has stopped",
        )
        .into_response()
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let e = &st.engine;
    let text = e.metrics.render(e.queue_depth(), e.queue_capacity());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// The model as `/v1/models` lists it.
fn model_card(st: &AppState) -> Value {
    let info = &st.engine.info;
    json!({
        "id": info.id,
        "object": "model",
        "created": st.started,
        "owned_by": "sala",
        "max_model_len": info.max_context,
    })
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&st)]}))
}

async fn model(
    State(st): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id == st.engine.info.id {
        Json(model_card(&st)).into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model `{id}` does not exist; this server serves `{}`",
                st.engine.info.id
            ),
        )
        .param("model")
        .code("model_not_found")
        .into_response()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// A request checked and ready to queue.
struct Checked {
    request: Request,
    /// `response_format`, compiled into `request` by [`admit`].
    grammar: Option<GrammarSpec>,
    stream: bool,
    include_usage: bool,
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is too large".to_string()
        } else {
            format!("reading the request body: {}", r.body_text())
        };
        ApiError::new(status, "invalid_request_error", message)
    })
}

/// Checks the shared parameters against the model and maps them to a [`Request`];
/// `logprobs` comes checked from the endpoint's own fields.
fn check_common(
    st: &AppState,
    p: CommonParams,
    prompt: Prompt,
    logprobs: Option<usize>,
) -> Result<Checked, ApiError> {
    let info = &st.engine.info;
    if let Some(model) = &p.model {
        if *model != info.id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{model}` does not exist; this server serves `{}`",
                    info.id
                ),
            )
            .param("model")
            .code("model_not_found"));
        }
    }
    if let Some(n) = p.n {
        if n != 1 {
            return Err(
                ApiError::invalid(format!("n is {n}, but only n = 1 is supported")).param("n"),
            );
        }
    }
    let (max_name, max) = match (p.max_completion_tokens, p.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        None => info.max_context,
        Some(0) => {
            return Err(ApiError::invalid(format!("{max_name} must be at least 1")).param(max_name))
        }
        Some(m) if m > info.max_context as u64 => {
            return Err(ApiError::invalid(format!(
                "{max_name} is {m}, more than the context budget of {} tokens",
                info.max_context
            ))
            .param(max_name))
        }
        Some(m) => m as usize,
    };
    let top_k = match p.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(format!(
                "top_k is {k}; it must be positive, or 0 or -1 to disable it"
            ))
            .param("top_k"))
        }
    };
    for (name, value) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if let Some(v) = value.filter(|v| !(-2.0..=2.0).contains(v)) {
            return Err(
                ApiError::invalid(format!("{name} is {v}; it must be in [-2, 2]")).param(name),
            );
        }
    }
    if p.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::invalid("logit_bias is not supported").param("logit_bias"));
    }
    if let Some(t) = p.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        return Err(
            ApiError::invalid(format!("temperature is {t}; it must be in [0, 2]"))
                .param("temperature"),
        );
    }
    let sampling = SamplingParams {
        temperature: p.temperature.unwrap_or(1.0),
        top_k,
        top_p: p.top_p.unwrap_or(1.0),
        min_p: p.min_p.unwrap_or(0.0),
        repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
        presence_penalty: p.presence_penalty.unwrap_or(0.0),
        frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
        seed: p.seed.map(|s| s.value()),
    };
    sampling.validate().map_err(|e| {
        let err = ApiError::invalid(e.to_string());
        match e {
            sala_engine::sampling::SamplingError::InvalidParam { param, .. } => err.param(param),
            _ => err,
        }
    })?;
    let stop = match p.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop strings must not be empty").param("stop"));
    }
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(format!(
            "stop has {} strings; at most {MAX_STOP_STRINGS} are allowed",
            stop.len()
        ))
        .param("stop"));
    }
    let grammar = match p.response_format {
        Some(f) => f.grammar()?,
        None => None,
    };
    Ok(Checked {
        grammar,
        request: Request {
            prompt,
            sampling,
            max_tokens,
            stop,
            ignore_eos: p.ignore_eos.unwrap_or(false),
            logprobs,
            grammar: None,
        },
        stream: p.stream.unwrap_or(false),
        include_usage: p.stream_options.is_some_and(|o| o.include_usage),
    })
}

fn check_chat(st: &AppState, value: &Value) -> Result<Checked, ApiError> {
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
    };
    check_common(st, common, prompt, logprobs)
}

fn check_completion(st: &AppState, value: &Value) -> Result<Checked, ApiError> {
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

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

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
    // So is a grammar's compilation: an invalid schema is a 400 before any engine work.
    if let Some(spec) = checked.grammar.take() {
        let engine = st.engine.clone();
        let grammar = tokio::task::spawn_blocking(move || engine.grammar(&spec))
            .await
            .map_err(|e| ApiError::internal(format!("compiling response_format: {e}")))?
            .map_err(|e| ApiError::from(&e))?;
        checked.request.grammar = Some(grammar);
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

async fn handle(
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
