//! The real server on 127.0.0.1 with the tiny random model on the CPU, driven by a small
//! HTTP/1.1 client over `TcpStream`.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, FinishReason, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

const MODEL_ID: &str = "test-model";
const MAX_CONTEXT: usize = 256;
const BODY_LIMIT: usize = 64 << 10;

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let config = preset("tiny").unwrap();
        write_random_checkpoint(&dir, &config, &WriteOptions::default()).unwrap();
        sala_tokenizer::write_test_tokenizer(&dir, config.vocab_size).unwrap();
        dir
    })
}

fn spawn_engine(queue: usize) -> sala_server::EngineHandle {
    let dir = model_dir().to_path_buf();
    sala_server::spawn_engine(MODEL_ID.into(), Some(MAX_CONTEXT), queue, move |runner| {
        let engine =
            Engine::load(CpuBackend, &dir, 64, &mut |_, _| {}).map_err(|e| e.to_string())?;
        runner.run(engine);
        Ok(())
    })
    .unwrap()
}

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let engine = spawn_engine(64);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                let opts = sala_server::ServerOptions {
                    max_body_bytes: BODY_LIMIT,
                };
                sala_server::serve(listener, engine, &opts).await.unwrap();
            });
        });
        rx.recv().unwrap()
    })
}

/// Undoes `Transfer-Encoding: chunked`.
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = body.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = std::str::from_utf8(&body[..eol]).unwrap();
        let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
        if size == 0 {
            return out;
        }
        let start = eol + 2;
        out.extend_from_slice(&body[start..start + size]);
        body = &body[start + size + 2..];
    }
}

/// Sends one request (`Connection: close`) and returns the status and the decoded body.
fn request(method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body); // the server may answer (413) before reading it all
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let mut body = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, String::from_utf8(body).unwrap())
}

fn post(path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request("POST", path, body.to_string().as_bytes());
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

/// The `data:` payloads of an SSE body.
fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

fn check_usage(v: &Value) -> (u64, u64) {
    let u = &v["usage"];
    let (p, c, t) = (
        u["prompt_tokens"].as_u64().unwrap(),
        u["completion_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap(),
    );
    assert!(p > 0);
    assert_eq!(p + c, t, "{u}");
    (p, c)
}

fn chat_body(stream: bool) -> Value {
    json!({
        "model": MODEL_ID,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say something about the sea."}
        ],
        "max_tokens": 24,
        "temperature": 0,
        "stream": stream,
    })
}

#[test]
fn chat_completion_non_streaming_and_streaming_agree() {
    let (status, v) = post("/v1/chat/completions", &chat_body(false));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL_ID);
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let text = choice["message"]["content"].as_str().unwrap().to_string();
    let finish = choice["finish_reason"].as_str().unwrap().to_string();
    let (_, completion) = check_usage(&v);
    assert!(completion <= 24 && completion > 0);
    match finish.as_str() {
        "length" => assert_eq!(completion, 24),
        "stop" => {}
        other => panic!("finish_reason {other}"),
    }

    let (status, body) = request(
        "POST",
        "/v1/chat/completions",
        chat_body(true).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut streamed = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, text);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        finish
    );
}

#[test]
fn completion_non_streaming_and_streaming_with_usage() {
    let body = json!({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.0});
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let usage = check_usage(&v);

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let (status, raw) = request("POST", "/v1/completions", sbody.to_string().as_bytes());
    assert_eq!(status, 200, "{raw}");
    let data = sse_data(&raw);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = chunks.last().unwrap();
    assert_eq!(check_usage(last), usage);
    // stop strings: the text ends before the first occurrence
    if let Some(ch) = text.chars().nth(3).filter(|c| !c.is_whitespace()) {
        let mut b = body.clone();
        b["stop"] = json!([ch.to_string()]);
        let (status, v) = post("/v1/completions", &b);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(!v["choices"][0]["text"].as_str().unwrap().contains(ch));
    }
}

#[test]
fn models_and_health() {
    let (status, body) = request("GET", "/v1/models", b"");
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL_ID);
    assert_eq!(v["data"][0]["object"], "model");
    let (status, _) = request("GET", "/health", b"");
    assert_eq!(status, 200);
}

fn assert_error(status: u16, body: &str, want: u16, param: Option<&str>, what: &str) {
    assert_eq!(status, want, "{what}: {body}");
    let v: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{what}: {e}: body {body}"));
    let err = &v["error"];
    assert!(
        !err["message"].as_str().unwrap_or("").is_empty(),
        "{what}: {body}"
    );
    assert!(err["type"].is_string(), "{what}: {body}");
    assert!(
        err.get("param").is_some() && err.get("code").is_some(),
        "{what}: {body}"
    );
    if let Some(p) = param {
        assert_eq!(err["param"], p, "{what}: {body}");
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_lives_on() {
    let chat = "/v1/chat/completions";
    let comp = "/v1/completions";
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let long_prompt = "the quick brown fox jumps over the lazy dog ".repeat(100);
    type Case<'a> = (&'a str, &'a str, Vec<u8>, u16, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("invalid JSON", chat, b"{\"messages\": [".to_vec(), 400, None),
        ("not an object", chat, b"[1, 2]".to_vec(), 400, None),
        (
            "messages of the wrong type",
            chat,
            json!({"messages": "hi"}).to_string().into_bytes(),
            400,
            Some("messages"),
        ),
        (
            "temperature of the wrong type",
            chat,
            json!({"messages": msgs, "temperature": "hot"}).to_string().into_bytes(),
            400,
            Some("temperature"),
        ),
        (
            "missing messages",
            chat,
            json!({"model": MODEL_ID}).to_string().into_bytes(),
            400,
            None,
        ),
        (
            "unknown model",
            chat,
            json!({"model": "gpt-17", "messages": msgs}).to_string().into_bytes(),
            404,
            Some("model"),
        ),
        (
            "empty messages",
            chat,
            json!({"messages": []}).to_string().into_bytes(),
            400,
            Some("messages"),
        ),
        (
            "prompt over the context budget",
            comp,
            json!({"prompt": long_prompt, "max_tokens": 4}).to_string().into_bytes(),
            400,
            None,
        ),
        (
            "chat prompt over the context budget",
            chat,
            json!({"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4, "stream": true})
                .to_string()
                .into_bytes(),
            400,
            None,
        ),
        (
            "absurd max_tokens",
            comp,
            json!({"prompt": "hi", "max_tokens": 1_000_000_000u64}).to_string().into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "absurd max_completion_tokens",
            chat,
            json!({"messages": msgs, "max_completion_tokens": MAX_CONTEXT + 1})
                .to_string()
                .into_bytes(),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "negative max_tokens",
            comp,
            json!({"prompt": "hi", "max_tokens": -5}).to_string().into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "top_p 0",
            comp,
            json!({"prompt": "hi", "top_p": 0.0}).to_string().into_bytes(),
            400,
            Some("top_p"),
        ),
        (
            "negative temperature",
            chat,
            json!({"messages": msgs, "temperature": -1}).to_string().into_bytes(),
            400,
            Some("temperature"),
        ),
        (
            "min_p above 1",
            comp,
            json!({"prompt": "hi", "min_p": 2}).to_string().into_bytes(),
            400,
            Some("min_p"),
        ),
        (
            "n = 2",
            comp,
            json!({"prompt": "hi", "n": 2}).to_string().into_bytes(),
            400,
            Some("n"),
        ),
        (
            "empty stop string",
            comp,
            json!({"prompt": "hi", "stop": ""}).to_string().into_bytes(),
            400,
            Some("stop"),
        ),
        (
            "stop of the wrong type",
            comp,
            json!({"prompt": "hi", "stop": 5}).to_string().into_bytes(),
            400,
            Some("stop"),
        ),
        (
            "empty prompt",
            comp,
            json!({"prompt": ""}).to_string().into_bytes(),
            400,
            Some("prompt"),
        ),
        (
            "body over the size limit",
            comp,
            json!({"prompt": "x".repeat(BODY_LIMIT * 2)}).to_string().into_bytes(),
            413,
            None,
        ),
    ];
    for (what, path, body, want, param) in cases {
        let (status, text) = request("POST", path, &body);
        assert_error(status, &text, want, param, what);
        let (status, _) = request("GET", "/health", b"");
        assert_eq!(status, 200, "health after {what}");
    }
    let (status, text) = request("GET", "/v1/nothing", b"");
    assert_error(status, &text, 404, None, "unknown route");

    // Still serving.
    let (status, v) = post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn concurrent_requests_all_complete() {
    let threads: Vec<_> = (0..16)
        .map(|i| {
            std::thread::spawn(move || {
                let body = json!({
                    "prompt": format!("request number {i}"),
                    "max_tokens": 8,
                    "temperature": 0.8,
                    "seed": i,
                    "stream": i % 2 == 0,
                });
                let (status, text) =
                    request("POST", "/v1/completions", body.to_string().as_bytes());
                assert_eq!(status, 200, "request {i}: {text}");
                if i % 2 == 0 {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    check_usage(&v);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn a_client_leaving_mid_stream_leaves_the_server_working() {
    let mut s = TcpStream::connect(server()).unwrap();
    let body = json!({"prompt": "a long story", "max_tokens": 200, "stream": true}).to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    drop(s);
    let (status, v) = post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 3}));
    assert_eq!(status, 200, "{v}");
}

#[test]
fn generation_stops_when_on_text_says_so() {
    let mut engine = Engine::load(CpuBackend, model_dir(), 64, &mut |_, _| {}).unwrap();
    let prompt = engine.tokenizer.encode("hello there", true).unwrap();
    let opts = GenerateOptions {
        sampling: SamplingParams::default(),
        max_tokens: 100,
        max_context: MAX_CONTEXT,
        stop: Vec::new(),
        eos_ids: Vec::new(),
    };
    let mut calls = 0;
    let g = engine
        .generate_cancellable(
            &prompt,
            &opts,
            &mut |_| {
                calls += 1;
                calls < 3
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(g.finish, FinishReason::Cancelled);
    assert_eq!(g.tokens.len(), 3);
    assert_eq!(calls, 3);
}

#[test]
fn a_full_queue_is_429_and_abandoned_requests_are_dropped() {
    use sala_server::engine::{Event, Prompt, Request};
    let engine = spawn_engine(1);
    let req = |max_tokens| Request {
        prompt: Prompt::Text("busy busy".into()),
        sampling: SamplingParams::default(),
        max_tokens,
        stop: Vec::new(),
        ignore_eos: true,
    };
    // A keeps the engine busy: nobody reads its events, so the engine waits once they fill.
    let mut a = engine.submit(req(200)).unwrap();
    assert!(matches!(a.blocking_recv(), Some(Event::Started { .. })));
    // B waits in the queue; C finds it full.
    let b = engine.submit(req(5)).unwrap();
    let err = engine.submit(req(5)).expect_err("the queue is full");
    assert_eq!(err.status.as_u16(), 429);
    assert!(err.body()["error"]["message"].is_string());
    // Dropping A's and B's receivers cancels A and skips B; the engine serves D.
    drop(a);
    drop(b);
    // B may still sit in the queue for a moment.
    let mut d = None;
    for _ in 0..100 {
        match engine.submit(req(4)) {
            Ok(rx) => {
                d = Some(rx);
                break;
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    let mut d = d.expect("the queue frees up");
    let mut texts = 0;
    loop {
        match d.blocking_recv() {
            Some(Event::Done {
                completion_tokens, ..
            }) => {
                assert_eq!(completion_tokens, 4);
                break;
            }
            Some(Event::Error(e)) => panic!("{e:?}"),
            Some(_) => texts += 1,
            None => panic!("the engine stopped"),
        }
    }
    assert!(texts >= 1);
}
