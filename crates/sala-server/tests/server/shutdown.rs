//! Graceful shutdown: requests in flight finish within the grace, or end with an error after
//! it; new requests get a 503 and `/health` reports draining meanwhile; the server returns.

use crate::common::*;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Serves a fresh engine with `grace` until the returned sender fires; the join handle
/// returns when the server has shut down.
fn serve_with_shutdown(
    grace: Duration,
) -> (
    SocketAddr,
    tokio::sync::oneshot::Sender<()>,
    std::thread::JoinHandle<()>,
) {
    // A long context, so that a request can outlast the grace.
    let dir = model_dir().to_path_buf();
    let engine = sala_server::spawn_engine(MODEL_ID.into(), Some(LONG), 8, move |runner| {
        let engine = engine_from(&dir)?;
        runner.run(engine);
        Ok(())
    })
    .unwrap();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let opts = sala_server::ServerOptions {
                shutdown_timeout: grace,
                ..Default::default()
            };
            let signal = async move {
                let _ = stop_rx.await;
            };
            sala_server::serve_until(listener, engine, &opts, signal)
                .await
                .unwrap();
        });
    });
    (addr_rx.recv().unwrap(), stop_tx, server)
}

/// The context budget of these servers: generating it takes the tiny model many seconds.
const LONG: usize = 60_000;

/// A request that runs for seconds on the tiny model, streamed or not.
fn long_request(addr: SocketAddr, stream: bool) -> std::thread::JoinHandle<(u16, String)> {
    std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": LONG - 100,
                          "ignore_eos": true, "stream": stream});
        request_to(addr, "POST", "/v1/completions", body.to_string().as_bytes())
    })
}

#[test]
fn past_the_grace_requests_end_with_an_error_and_the_server_returns() {
    let (addr, stop, server) = serve_with_shutdown(Duration::from_millis(300));
    let streamed = long_request(addr, true);
    let plain = long_request(addr, false);
    // Both are running before the shutdown begins.
    let t0 = Instant::now();
    while metrics(addr)["sala_requests_running"] < 2.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the requests did not start"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let (status, body) = request_to(addr, "GET", "/health", b"");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("draining"), "{body}");
    let (status, body) = request_to(
        addr,
        "POST",
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 2})
            .to_string()
            .as_bytes(),
    );
    assert_error(status, &body, 503, None, "a request while draining");
    assert!(body.contains("shutting_down"), "{body}");
    let (status, body) = streamed.join().unwrap();
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    assert!(data[data.len() - 2].contains("shutting_down"), "{body}");
    let (status, body) = plain.join().unwrap();
    assert_error(status, &body, 503, None, "a plain request past the grace");
    server.join().unwrap();
}

#[test]
fn within_the_grace_requests_finish_normally() {
    let (addr, stop, server) = serve_with_shutdown(Duration::from_secs(60));
    let short = std::thread::spawn(move || {
        let body = json!({"prompt": "Once", "max_tokens": 200, "ignore_eos": true,
                          "stream": true});
        request_to(addr, "POST", "/v1/completions", body.to_string().as_bytes())
    });
    let t0 = Instant::now();
    while metrics(addr)["sala_requests_running"] < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the request did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    stop.send(()).unwrap();
    let (status, body) = short.join().unwrap();
    assert_eq!(status, 200);
    let chunks = sse_chunks(&body);
    let last = chunks
        .iter()
        .rev()
        .find(|c| c["choices"][0]["finish_reason"].is_string());
    assert_eq!(
        last.map(|c| c["choices"][0]["finish_reason"].clone()),
        Some(json!("length")),
        "{body}"
    );
    server.join().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "the server did not return promptly"
    );
}

/// A connection that has sent nothing yet does not hold the shutdown up (the header timeout is
/// 30 s): the server returns at once, and the connection is closed.
#[test]
fn a_silent_connection_does_not_delay_the_shutdown() {
    use std::io::Read;
    let (addr, stop, server) = serve_with_shutdown(Duration::from_secs(60));
    let mut silent = std::net::TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    stop.send(()).unwrap();
    server.join().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the server took {:?} to return",
        t0.elapsed()
    );
    let mut out = Vec::new();
    assert_eq!(silent.read_to_end(&mut out).unwrap_or(0), 0, "{out:?}");
}
