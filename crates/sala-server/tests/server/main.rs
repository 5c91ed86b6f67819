//! The real server on 127.0.0.1 with the tiny random model on the CPU, driven by a small
//! HTTP/1.1 client over `TcpStream` (and, in `openai_client`, by the official Python client).

mod api_edges;
mod choices;
mod common;
mod crowding;
mod echo;
mod fuzz;
mod load;
mod logprobs;
mod memory;
mod metrics;
mod openai_client;
mod shutdown;
mod structured;
mod tools;

use common::*;
use sala_engine::generate::{FinishReason, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

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
            "n = 9",
            comp,
            json!({"prompt": "hi", "n": 9}).to_string().into_bytes(),
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
            "unknown model on completions",
            comp,
            json!({"model": "gpt-17", "prompt": "hi"}).to_string().into_bytes(),
            404,
            Some("model"),
        ),
        (
            "max_tokens 0",
            comp,
            json!({"prompt": "hi", "max_tokens": 0}).to_string().into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "max_tokens of the wrong type",
            comp,
            json!({"prompt": "hi", "max_tokens": "10"}).to_string().into_bytes(),
            400,
            Some("max_tokens"),
        ),
        (
            "top_p above 1",
            chat,
            json!({"messages": msgs, "top_p": 1.5}).to_string().into_bytes(),
            400,
            Some("top_p"),
        ),
        (
            "top_k below -1",
            comp,
            json!({"prompt": "hi", "top_k": -2}).to_string().into_bytes(),
            400,
            Some("top_k"),
        ),
        (
            "top_k of the wrong type",
            comp,
            json!({"prompt": "hi", "top_k": "x"}).to_string().into_bytes(),
            400,
            Some("top_k"),
        ),
        (
            "seed of the wrong type",
            comp,
            json!({"prompt": "hi", "seed": "x"}).to_string().into_bytes(),
            400,
            Some("seed"),
        ),
        (
            "fractional seed",
            chat,
            json!({"messages": msgs, "seed": 1.5}).to_string().into_bytes(),
            400,
            Some("seed"),
        ),
        (
            "presence_penalty above 2",
            chat,
            json!({"messages": msgs, "presence_penalty": 3}).to_string().into_bytes(),
            400,
            Some("presence_penalty"),
        ),
        (
            "frequency_penalty below -2",
            comp,
            json!({"prompt": "hi", "frequency_penalty": -2.5}).to_string().into_bytes(),
            400,
            Some("frequency_penalty"),
        ),
        (
            "presence_penalty of the wrong type",
            comp,
            json!({"prompt": "hi", "presence_penalty": [1]}).to_string().into_bytes(),
            400,
            Some("presence_penalty"),
        ),
        (
            "repetition_penalty 0",
            comp,
            json!({"prompt": "hi", "repetition_penalty": 0}).to_string().into_bytes(),
            400,
            Some("repetition_penalty"),
        ),
        (
            "n = 0",
            chat,
            json!({"messages": msgs, "n": 0}).to_string().into_bytes(),
            400,
            Some("n"),
        ),
        (
            "n = 9 on chat",
            chat,
            json!({"messages": msgs, "n": 9}).to_string().into_bytes(),
            400,
            Some("n"),
        ),
        (
            "stream of the wrong type",
            chat,
            json!({"messages": msgs, "stream": "yes"}).to_string().into_bytes(),
            400,
            Some("stream"),
        ),
        (
            "a message without a role",
            chat,
            json!({"messages": [{"content": "hi"}]}).to_string().into_bytes(),
            400,
            None,
        ),
        (
            "an image content part",
            chat,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string()
                .into_bytes(),
            400,
            Some("messages[0]"),
        ),
        (
            "chat logprobs of the wrong type",
            chat,
            json!({"messages": msgs, "logprobs": "yes"}).to_string().into_bytes(),
            400,
            Some("logprobs"),
        ),
        (
            "top_logprobs above 20",
            chat,
            json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}).to_string().into_bytes(),
            400,
            Some("top_logprobs"),
        ),
        (
            "top_logprobs without logprobs",
            chat,
            json!({"messages": msgs, "top_logprobs": 2}).to_string().into_bytes(),
            400,
            Some("top_logprobs"),
        ),
        (
            "negative top_logprobs",
            chat,
            json!({"messages": msgs, "logprobs": true, "top_logprobs": -1}).to_string().into_bytes(),
            400,
            Some("top_logprobs"),
        ),
        (
            "completion logprobs above 20",
            comp,
            json!({"prompt": "hi", "logprobs": 21}).to_string().into_bytes(),
            400,
            Some("logprobs"),
        ),
        (
            "completion logprobs of the wrong type",
            comp,
            json!({"prompt": "hi", "logprobs": true}).to_string().into_bytes(),
            400,
            Some("logprobs"),
        ),
        (
            "echo on chat",
            chat,
            json!({"messages": [{"role": "user", "content": "hi"}], "echo": true})
                .to_string()
                .into_bytes(),
            400,
            Some("echo"),
        ),
        (
            "best_of 3",
            comp,
            json!({"prompt": "hi", "best_of": 3}).to_string().into_bytes(),
            400,
            Some("best_of"),
        ),
        (
            "logit_bias above 100",
            chat,
            json!({"messages": msgs, "logit_bias": {"5": 150}}).to_string().into_bytes(),
            400,
            Some("logit_bias"),
        ),
        (
            "logit_bias of 1e308",
            chat,
            br#"{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1e308}}"#.to_vec(),
            400,
            Some("logit_bias"),
        ),
        (
            "logit_bias key not a token id",
            chat,
            json!({"messages": msgs, "logit_bias": {"five": 1}}).to_string().into_bytes(),
            400,
            Some("logit_bias"),
        ),
        (
            "logit_bias value not a number",
            comp,
            json!({"prompt": "hi", "logit_bias": {"5": "1"}}).to_string().into_bytes(),
            400,
            Some("logit_bias"),
        ),
        (
            "logit_bias of a token outside the vocabulary",
            comp,
            json!({"prompt": "hi", "logit_bias": {"99999999": 1}}).to_string().into_bytes(),
            400,
            Some("logit_bias"),
        ),
        (
            "65 prompts",
            comp,
            json!({"prompt": vec!["a"; 65]}).to_string().into_bytes(),
            400,
            Some("prompt"),
        ),
        (
            "prompt of the wrong type",
            comp,
            json!({"prompt": 17}).to_string().into_bytes(),
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
        // A message names what is wrong; it does not spell out huge numbers.
        assert!(
            text.len() < 300,
            "{what}: a {}-byte error: {text}",
            text.len()
        );
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
    let mut engine = load_engine();
    let prompt = engine.tokenizer.encode("hello there", true).unwrap();
    let opts = GenerateOptions {
        sampling: SamplingParams::default(),
        max_tokens: 100,
        max_context: MAX_CONTEXT,
        stop: Vec::new(),
        eos_ids: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        speculate: None,
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
    use sala_server::engine::Event;
    let engine = spawn_engine(1);
    let req = busy_request;
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

#[test]
fn every_parameter_is_accepted_and_applied() {
    let text_of = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let base = json!({"prompt": "The lighthouse keeper", "max_tokens": 10, "ignore_eos": true});
    let with = |extra: Value| {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let (status, v) = post("/v1/completions", &b);
        assert_eq!(status, 200, "{b}: {v}");
        v
    };
    let greedy = with(json!({"temperature": 0}));
    assert_eq!(check_usage(&greedy).1, 10, "max_tokens with ignore_eos");
    assert_eq!(greedy["choices"][0]["finish_reason"], "length");
    // Truncation to one token makes any temperature greedy.
    for extra in [
        json!({"temperature": 1.5, "top_k": 1, "seed": 1}),
        json!({"temperature": 1.5, "min_p": 1.0, "seed": 2}),
        json!({"temperature": 1.5, "top_p": 1e-6, "seed": 3}),
    ] {
        assert_eq!(text_of(&with(extra.clone())), text_of(&greedy), "{extra}");
    }
    // logit_bias: +100 on a token makes it every pick, greedy or sampled (the greedy text
    // repeats no token ten times).
    let tokens_of = |v: &Value| v["choices"][0]["logprobs"]["tokens"].clone();
    for temperature in [0.0, 1.0] {
        let forced =
            with(json!({"temperature": temperature, "logit_bias": {"77": 100}, "logprobs": 0}));
        let toks = tokens_of(&forced);
        let toks = toks.as_array().unwrap();
        assert_eq!(toks.len(), 10, "{forced}");
        assert!(toks.windows(2).all(|w| w[0] == w[1]), "{forced}");
    }
    let plain = tokens_of(&with(json!({"temperature": 0, "logprobs": 0})));
    let plain = plain.as_array().unwrap();
    assert!(plain.windows(2).any(|w| w[0] != w[1]), "{plain:?}");
    // Biases that change nothing (0, or on tokens greedy does not pick) leave greedy alone.
    let zero = with(json!({"temperature": 0, "logit_bias": {"77": 0, "5": 0.0}}));
    assert_eq!(text_of(&zero), text_of(&greedy));
    // A seed repeats a sampled answer, a negative one included.
    for seed in [json!(7), json!(-7), json!(u64::MAX)] {
        let params = json!({"temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": seed});
        assert_eq!(text_of(&with(params.clone())), text_of(&with(params)));
    }
    // Everything at once, on both endpoints.
    let all = json!({
        "model": MODEL_ID, "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
        "min_p": 0.01, "seed": 11, "stop": ["\n\n", "zzz"], "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "n": 1, "user": "someone",
        "logit_bias": {}, "stream": false,
    });
    let mut comp = all.clone();
    comp["prompt"] = json!("hello");
    comp["logprobs"] = json!(2);
    comp["echo"] = json!(false);
    comp["best_of"] = json!(1);
    let (status, v) = post("/v1/completions", &comp);
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["logprobs"]["tokens"].is_array(), "{v}");
    let mut chat = all;
    chat["messages"] = json!([{"role": "user", "content": [{"type": "text", "text": "hello"}]}]);
    chat["logprobs"] = json!(true);
    chat["top_logprobs"] = json!(3);
    chat["max_completion_tokens"] = json!(5);
    let (status, v) = post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{v}");
    assert!(
        check_usage(&v).1 <= 5,
        "max_completion_tokens wins over max_tokens"
    );
    assert!(v["choices"][0]["logprobs"]["content"].is_array(), "{v}");
}

#[test]
fn an_oversized_chunked_body_is_413() {
    // No Content-Length: the limit applies while the body streams in.
    let mut s = TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n\
                Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
                Connection: close\r\n\r\n";
    s.write_all(head.as_bytes()).unwrap();
    let body = json!({"prompt": "y".repeat(BODY_LIMIT * 2)}).to_string();
    for part in body.as_bytes().chunks(8192) {
        if write!(s, "{:x}\r\n", part.len())
            .and_then(|_| s.write_all(part))
            .and_then(|_| s.write_all(b"\r\n"))
            .is_err()
        {
            break; // the server answered and closed early
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.starts_with("HTTP/1.1 413"), "{raw}");
    let body = &raw[raw.find("\r\n\r\n").unwrap() + 4..];
    let json_start = body.find('{').unwrap();
    let json_end = body.rfind('}').unwrap();
    assert_error(413, &body[json_start..=json_end], 413, None, "chunked body");
    let (status, _) = request("GET", "/health", b"");
    assert_eq!(status, 200);
}
