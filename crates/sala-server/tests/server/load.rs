//! A bounded load test: 64 concurrent streams against a server of its own.

use crate::common::*;
use serde_json::json;
use std::time::{Duration, Instant};

const STREAMS: usize = 64;
const MAX_TOKENS: u64 = 6;

/// Checks one streamed answer: chunks of the right object, no error, one finish reason (the
/// last choice chunk), a usage chunk, `[DONE]`. Returns (prompt, completion) tokens.
fn check_stream(i: usize, raw: &str, chat: bool) -> (u64, u64) {
    let chunks = sse_chunks(raw);
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let mut finishes = Vec::new();
    let mut usage = None;
    for (k, c) in chunks.iter().enumerate() {
        assert!(c.get("error").is_none(), "stream {i}: {c}");
        assert_eq!(c["object"], object, "stream {i}: {c}");
        if c["usage"].is_object() {
            assert_eq!(k, chunks.len() - 1, "stream {i}: usage comes last");
            usage = Some(check_usage(c));
            continue;
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            assert!(f == "stop" || f == "length", "stream {i}: {f}");
            finishes.push(k);
        }
    }
    assert_eq!(
        finishes,
        [chunks.len() - 2],
        "stream {i}: one finish, last: {raw}"
    );
    let (p, c) = usage.unwrap_or_else(|| panic!("stream {i}: no usage: {raw}"));
    assert!((1..=MAX_TOKENS).contains(&c), "stream {i}: {c} tokens");
    (p, c)
}

#[test]
fn sixty_four_concurrent_streams_all_complete() {
    // The queue holds every stream, so none is refused.
    let addr = serve(spawn_engine(STREAMS));
    let threads: Vec<_> = (0..STREAMS)
        .map(|i| {
            std::thread::spawn(move || {
                let chat = i % 2 == 0;
                let mut body = json!({
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.7,
                    "seed": i,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let path = if chat {
                    body["messages"] = json!([{"role": "user", "content": format!("stream {i}")}]);
                    "/v1/chat/completions"
                } else {
                    body["prompt"] = json!(format!("stream number {i}"));
                    "/v1/completions"
                };
                let (status, raw) = request_to(addr, "POST", path, body.to_string().as_bytes());
                assert_eq!(status, 200, "stream {i}: {raw}");
                check_stream(i, &raw, chat)
            })
        })
        .collect();
    let mut prompt = 0;
    let mut completion = 0;
    let mut failures = Vec::new();
    for (i, t) in threads.into_iter().enumerate() {
        match t.join() {
            Ok((p, c)) => {
                prompt += p;
                completion += c;
            }
            Err(_) => failures.push(i),
        }
    }
    assert!(failures.is_empty(), "streams that failed: {failures:?}");

    let m = metrics(addr);
    let outcome = |o: &str| m[&format!("sala_requests_total{{outcome=\"{o}\"}}")];
    assert_eq!(outcome("stop") + outcome("length"), STREAMS as f64);
    for o in ["cancelled", "rejected", "client_error", "server_error"] {
        assert_eq!(outcome(o), 0.0, "{o}");
    }
    assert_eq!(m["sala_prompt_tokens_total"], prompt as f64);
    assert_eq!(m["sala_generation_tokens_total"], completion as f64);
    assert_eq!(
        histogram_count(&m, "sala_time_to_first_token_seconds"),
        STREAMS as f64
    );
    assert_eq!(
        histogram_count(&m, "sala_inter_token_latency_seconds"),
        (completion - STREAMS as u64) as f64
    );
    assert_eq!(m["sala_queue_depth"], 0.0);
}

/// Batching does not change results: at temperature 0, a request's text is the same alone
/// and among 16 concurrent others (several batch sizes along the way as requests join and
/// finish), and so is every other request's.
#[test]
fn greedy_answers_are_the_same_alone_and_among_sixteen_others() {
    let addr = serve(spawn_engine(64));
    let body = |i: usize| {
        json!({
            "prompt": format!("request {i}: {}", "the quick brown fox ".repeat(1 + i % 5)),
            "max_tokens": 8 + (i % 4) * 4,
            "temperature": 0,
        })
    };
    let text = |v: &serde_json::Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let alone: Vec<String> = (0..17)
        .map(|i| {
            let (status, v) = post_to(addr, "/v1/completions", &body(i));
            assert_eq!(status, 200, "{v}");
            text(&v)
        })
        .collect();
    assert!(
        alone.iter().any(|t| t != &alone[0]),
        "the answers differ between requests"
    );
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..17)
            .map(|i| {
                s.spawn(move || {
                    let (status, v) = post_to(addr, "/v1/completions", &body(i));
                    assert_eq!(status, 200, "{v}");
                    text(&v)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i}: alone and among 16 others");
    }
}

/// Tokenizing a prompt of megabytes runs beside the engine, not on it: a small request sent
/// while it is being tokenized is answered about as fast as alone (it used to wait ~1.8 s).
#[test]
fn a_huge_prompt_does_not_hold_up_a_small_request() {
    // The default body limit (4 MiB), not the tests' small one.
    let addr = serve_with(spawn_engine(8), sala_server::ServerOptions::default());
    let small = || {
        let body = json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0});
        let t = Instant::now();
        let (status, text) =
            request_to(addr, "POST", "/v1/completions", body.to_string().as_bytes());
        assert_eq!(status, 200, "{text}");
        t.elapsed()
    };
    let alone = (0..3).map(|_| small()).min().unwrap();
    let huge = "many words of a very long prompt ".repeat(110_000); // ~3.6 MB
    let big = std::thread::spawn(move || {
        let body = json!({"prompt": huge, "max_tokens": 2});
        request_to(addr, "POST", "/v1/completions", body.to_string().as_bytes())
    });
    std::thread::sleep(Duration::from_millis(300));
    let beside = small();
    let (status, text) = big.join().unwrap();
    // Far longer than the context budget: refused, after tokenizing.
    assert_error(status, &text, 400, None, "a prompt of megabytes");
    assert!(
        beside < alone + Duration::from_millis(500),
        "a small request took {beside:?} beside a huge prompt, {alone:?} alone"
    );
}

/// A connection that does not finish its headers, or idles between requests, or does not
/// finish a request's body, is closed after the header timeout (slow-loris clients hold nothing
/// for long; a late body hears 408 first).
#[test]
fn slow_and_idle_connections_are_closed() {
    use std::io::{Read, Write};
    let opts = sala_server::ServerOptions {
        header_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let addr = serve_with(spawn_engine(8), opts);
    // Reads until the server closes the connection; what it sent, and when it closed.
    let until_closed = |s: &mut std::net::TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        (String::from_utf8_lossy(&got).into_owned(), t.elapsed())
    };
    // A head never finished: 408 with an OpenAI error body, then closed.
    let mut slow = std::net::TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let (answer, waited) = until_closed(&mut slow);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"request_timeout\""), "{answer}");
    assert!(
        waited < Duration::from_secs(5),
        "a half-sent request held on for {waited:?}"
    );
    // The same after a first request answered on the connection (keep-alive).
    let mut second = std::net::TcpStream::connect(addr).unwrap();
    second
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\n")
        .unwrap();
    let (answer, _) = until_closed(&mut second);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("HTTP/1.1 408"), "{answer}");
    let mut idle = std::net::TcpStream::connect(addr).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (answer, waited) = until_closed(&mut idle);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        !answer.contains("408"),
        "an idle connection is closed quietly: {answer}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "an idle connection held on for {waited:?}"
    );
    // Headers in, the body never finished: 408 with an OpenAI error body, then closed.
    let mut partial = std::net::TcpStream::connect(addr).unwrap();
    partial
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 1000\r\n\r\n{\"messages\"",
        )
        .unwrap();
    let (answer, waited) = until_closed(&mut partial);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"error\""), "{answer}");
    assert!(
        waited < Duration::from_secs(5),
        "a half-sent body held on for {waited:?}"
    );
}
