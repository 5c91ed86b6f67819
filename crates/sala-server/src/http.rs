//! The server: routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`,
//! `/v1/models/{id}`, `/health`, `/metrics`), the connections and a graceful shutdown. The
//! completion routes are [`crate::chat`] and [`crate::completion`].

use crate::api::ApiError;
use crate::engine::EngineHandle;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
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
    /// requests, or take to send a request's body once its headers are in; then it is closed
    /// (a late body is answered 408 first).
    pub header_timeout: std::time::Duration,
    /// Most log-probabilities of generated tokens a response answered whole (not streamed) may
    /// list, each token's own and each alternative beside it, in every choice: they are held
    /// until the reply ends, at one to two kilobytes of memory apiece, so a request past this
    /// fails (400) rather than the server running out of memory.
    pub max_whole_logprobs: usize,
    /// Longest a connection may go without taking a byte of an answer being written to it;
    /// then it is closed (which ends its request), so that a client that stops reading holds
    /// no reply in memory for longer.
    pub write_timeout: std::time::Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            shutdown_timeout: std::time::Duration::from_secs(30),
            header_timeout: std::time::Duration::from_secs(30),
            max_whole_logprobs: 500_000,
            write_timeout: std::time::Duration::from_secs(120),
        }
    }
}

/// What every route shares.
pub(crate) struct AppState {
    pub(crate) engine: EngineHandle,
    pub(crate) started: u64,
    next_id: AtomicU64,
    /// [`ServerOptions::max_whole_logprobs`].
    pub(crate) max_whole_logprobs: usize,
}

impl AppState {
    /// A response id: `prefix`, the server's start time and a count.
    pub(crate) fn new_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}{n:06x}", self.started)
    }
}

pub(crate) fn now() -> u64 {
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
        max_whole_logprobs: opts.max_whole_logprobs,
    });
    let routes = Router::new()
        .route("/v1/chat/completions", post(crate::chat::chat_completions))
        .route("/v1/completions", post(crate::completion::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(state);
    // Layers on a router apply to each route before the route adds `Allow` to a 405: the
    // routes are served whole from outside, so that the 405's body can name its methods.
    Router::new()
        .fallback_service(routes)
        .layer(axum::middleware::map_response(method_not_allowed))
        .layer(DefaultBodyLimit::max(opts.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            BodyRead {
                limit: opts.max_body_bytes,
                within: opts.header_timeout,
            },
            read_body,
        ))
}

/// How a request's body must arrive.
#[derive(Clone, Copy)]
struct BodyRead {
    limit: usize,
    within: std::time::Duration,
}

/// Reads a request's whole body before its route runs: a body larger than the limit is 413,
/// one that has not arrived in time 408, and either closes the connection (what is left of
/// the body is not read).
async fn read_body(
    State(read): State<BodyRead>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let refuse = |status: StatusCode, message: String| {
        let mut res = ApiError::new(status, "invalid_request_error", message).into_response();
        res.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        res
    };
    // Bodies are read as they come: a compressed one would only fail as JSON.
    if let Some(coding) = parts.headers.get(header::CONTENT_ENCODING) {
        let coding = String::from_utf8_lossy(coding.as_bytes())
            .trim()
            .to_ascii_lowercase();
        if coding != "identity" {
            return refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("Content-Encoding {coding:?} is not supported: send the body uncompressed"),
            );
        }
    }
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > read.limit as u64) {
        return refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is too large".into(),
        );
    }
    enum Failed {
        TooLarge,
        Read(axum::Error),
    }
    let whole = async {
        use futures_util::StreamExt;
        let mut stream = body.into_data_stream();
        let mut bytes = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(Failed::Read)?;
            if bytes.len() + chunk.len() > read.limit {
                return Err(Failed::TooLarge);
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    match tokio::time::timeout(read.within, whole).await {
        Ok(Ok(bytes)) => {
            next.run(axum::extract::Request::from_parts(parts, bytes.into()))
                .await
        }
        Ok(Err(Failed::TooLarge)) => refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the request body is too large".into(),
        ),
        Ok(Err(Failed::Read(e))) => refuse(
            StatusCode::BAD_REQUEST,
            format!("reading the request body: {e}"),
        ),
        Err(_) => refuse(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                read.within.as_secs_f64()
            ),
        ),
    }
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
    accept_until(listener, app, opts, begin).await;
    Ok(())
}

/// Serves `app` on every connection `listener` accepts (HTTP/1.1, headers within
/// `header_timeout`, idle keep-alive connections closed after it, answers taken within
/// `write_timeout` of each write's wait) until `stop` resolves; then
/// closes the listener, lets each connection finish its response, and returns when all have
/// closed.
async fn accept_until(
    listener: tokio::net::TcpListener,
    app: Router,
    opts: &ServerOptions,
    stop: impl std::future::Future<Output = ()>,
) {
    let (header_timeout, write_timeout) = (opts.header_timeout, opts.write_timeout);
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
            // A connection still silent when the server closes is dropped, as hyper drops an
            // idle one.
            let opening = tokio::select! {
                o = crate::wire::opening(&stream, header_timeout) => o,
                _ = closing.changed() => return,
            };
            match opening {
                crate::wire::Opening::Http1 => {}
                crate::wire::Opening::Http2 => return crate::wire::refuse_http2(stream).await,
                crate::wire::Opening::Silent => return,
            }
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let stream = TokioIo::new(crate::wire::ErrorBodies::new(stream, write_timeout));
            let mut conn = builder.serve_connection(stream, service);
            let mut served = std::future::poll_fn(|cx| conn.poll_without_shutdown(cx));
            let ended = tokio::select! {
                ended = &mut served => ended,
                _ = closing.changed() => {
                    drop(served);
                    std::pin::Pin::new(&mut conn).graceful_shutdown();
                    std::future::poll_fn(|cx| conn.poll_without_shutdown(cx)).await
                }
            };
            // A request head still unfinished at the header timeout hears 408 (hyper would
            // close the connection unanswered); an idle connection closes quietly.
            let parts = conn.into_parts();
            let mut stream = parts.io.into_inner();
            if ended.is_err_and(|e| e.is_timeout()) && !parts.read_buf.is_empty() {
                crate::wire::answer_late_head(&mut stream).await;
            }
            let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
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
    id: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let id = match id {
        Ok(axum::extract::Path(id)) => id,
        Err(e) => {
            return ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!("the model id in the path: {}", e.body_text()),
            )
            .param("model")
            .into_response()
        }
    };
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
