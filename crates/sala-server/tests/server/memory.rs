//! A server with a memory limit: a request whose plan (prompt + max_tokens) does not fit is a
//! 400 `context_length_exceeded` at admission, streaming or not; smaller ones are served.

use crate::common::*;
use sala_checkpoint::preset;
use sala_cpu::CpuBackend;
use sala_engine::generate::Engine;
use sala_model::memory::{MemoryLimit, MemoryPlan};
use sala_model::Backend;
use serde_json::json;

/// The CPU plan of a `tokens`-token sequence on the test servers' workspace: a 64-token chunk
/// beside a decode row for each request of a batch.
fn plan(tokens: usize) -> MemoryPlan {
    let rows = 64 + sala_server::DEFAULT_MAX_BATCH;
    let config = preset("tiny").unwrap();
    MemoryPlan::new(
        &config,
        tokens,
        rows,
        &CpuBackend::default().memory_facts(&config, rows),
    )
}

fn spawn_limited(bytes: usize) -> Result<sala_server::EngineHandle, String> {
    let dir = model_dir().to_path_buf();
    sala_server::spawn_engine(MODEL_ID.into(), Some(MAX_CONTEXT), 8, move |runner| {
        let engine = Engine::load(CpuBackend::default(), &dir, 64, &mut |_, _| {})
            .map_err(|e| e.to_string())?;
        let limit = MemoryLimit {
            bytes,
            source: "--max-memory test".into(),
        };
        runner.memory_limit(Some(limit)).run(engine);
        Ok(())
    })
}

#[test]
fn requests_over_the_memory_limit_are_refused_at_admission() {
    let allowed = plan(100).total();
    let addr = serve(spawn_limited(allowed).unwrap());
    let body = |max_tokens: usize, stream: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": stream,
               "temperature": 0})
    };
    for stream in [false, true] {
        let (status, text) = request_to(
            addr,
            "POST",
            "/v1/completions",
            body(200, stream).to_string().as_bytes(),
        );
        assert_error(status, &text, 400, None, "over the memory limit");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{text}");
        let msg = v["error"]["message"].as_str().unwrap();
        let allowed_gib = format!(
            "{:.2} GiB are allowed",
            allowed as f64 / (1u64 << 30) as f64
        );
        assert!(msg.contains(&allowed_gib), "{msg}");
        assert!(
            msg.contains("--max-memory test") && msg.contains("weights"),
            "{msg}"
        );
    }
    // A request that fits is served, streaming or not.
    let (status, v) = post_to(addr, "/v1/completions", &body(20, false));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 20);
    let (status, text) = request_to(
        addr,
        "POST",
        "/v1/completions",
        body(20, true).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    assert!(!sse_chunks(&text).is_empty());
    // Without max_tokens, the request may fill the context budget (256): over the limit.
    let (status, text) = request_to(
        addr,
        "POST",
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .as_bytes(),
    );
    assert_error(status, &text, 400, None, "default max_tokens");
}

/// A request whose choices fit one by one but never all at once (n = 8 under a limit that
/// holds about one sequence beside the model) is a 400 naming its sequences, with nothing in
/// flight (it used to be a 503 "retry later", which no retry could pass); n = 1 is served.
#[test]
fn choices_the_limit_can_never_hold_at_once_are_a_400() {
    let addr = serve(spawn_limited(plan(100).total()).unwrap());
    let body = |n: usize| json!({"prompt": "Once upon a time", "max_tokens": 80, "n": n, "temperature": 0});
    let (status, text) = request_to(
        addr,
        "POST",
        "/v1/completions",
        body(8).to_string().as_bytes(),
    );
    assert_error(status, &text, 400, None, "8 choices over the memory limit");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{text}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("8 sequences"),
        "{text}"
    );
    let (status, v) = post_to(addr, "/v1/completions", &body(1));
    assert_eq!(status, 200, "{v}");
}

/// Memory held by a request whose client stopped reading is given to one that needs it once
/// the stalled client is past the pause limit (before, the newcomer got 503 for as long as the
/// stalled client kept its connection, since nobody waited and so nothing ended it).
#[test]
fn a_stalled_clients_memory_goes_to_a_request_that_needs_it() {
    use sala_server::engine::Event;
    let dir = model_dir().to_path_buf();
    let limit = MemoryLimit {
        bytes: plan(160).total(),
        source: "--max-memory test".into(),
    };
    let engine = sala_server::spawn_engine(MODEL_ID.into(), Some(MAX_CONTEXT), 8, move |r| {
        let engine = Engine::load(CpuBackend::default(), &dir, 64, &mut |_, _| {})
            .map_err(|e| e.to_string())?;
        r.memory_limit(Some(limit))
            .pause_limit(std::time::Duration::from_millis(300))
            .run(engine);
        Ok(())
    })
    .unwrap();
    let mut stalled = engine.submit(busy_request(150)).unwrap();
    assert!(matches!(
        stalled.blocking_recv(),
        Some(Event::Started { .. })
    ));
    // Nobody reads A: it pauses, holding its memory past the limit.
    std::thread::sleep(std::time::Duration::from_millis(800));
    let mut b = engine.submit(busy_request(150)).unwrap();
    let mut done = None;
    while let Some(ev) = b.blocking_recv() {
        match ev {
            Event::Done {
                completion_tokens, ..
            } => done = Some(completion_tokens),
            Event::Error(e) => panic!("B: {e:?}"),
            _ => {}
        }
    }
    assert_eq!(done, Some(150));
}

#[test]
fn a_limit_no_request_fits_stops_the_server_from_starting() {
    let e = spawn_limited(plan(1).total())
        .err()
        .expect("must not start");
    assert!(e.contains("no request can fit") && e.contains("GiB"), "{e}");
}
