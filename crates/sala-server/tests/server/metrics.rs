//! `GET /metrics` on servers of their own, so that every count is known.

use crate::common::*;
use sala_server::engine::Event;
use serde_json::json;
use std::time::Duration;

fn outcome(m: &std::collections::BTreeMap<String, f64>, label: &str) -> f64 {
    m[&format!("sala_requests_total{{outcome=\"{label}\"}}")]
}

const OUTCOMES: [&str; 6] = [
    "stop",
    "length",
    "cancelled",
    "rejected",
    "client_error",
    "server_error",
];

#[test]
fn metrics_count_requests_tokens_and_latencies() {
    let addr = serve(spawn_engine(8));
    let m = metrics(addr);
    for o in OUTCOMES {
        assert_eq!(outcome(&m, o), 0.0, "{o}");
    }
    for name in [
        "sala_queue_depth",
        "sala_requests_running",
        "sala_live_sequences",
        "sala_cache_bytes",
        "sala_prompt_tokens_total",
        "sala_generation_tokens_total",
        "sala_generation_tokens_per_second",
    ] {
        assert_eq!(m[name], 0.0, "{name}");
    }
    assert_eq!(m["sala_queue_capacity"], 8.0);
    assert_eq!(histogram_count(&m, "sala_time_to_first_token_seconds"), 0.0);

    // Two requests that run to their budget, one of them streamed.
    let (status, a) = post_to(
        addr,
        "/v1/completions",
        &json!({"prompt": "one two three", "max_tokens": 5, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{a}");
    let body = json!({
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "ignore_eos": true,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let (status, raw) = request_to(
        addr,
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{raw}");
    let b = sse_chunks(&raw).pop().unwrap();
    let (pa, ca) = check_usage(&a);
    let (pb, cb) = check_usage(&b);
    assert_eq!((ca, cb), (5, 4));
    // Three bad requests: two refused by the HTTP side, one by the engine (too long).
    let bad = [
        json!({"prompt": ""}),
        json!({"prompt": "hi", "model": "other"}),
        json!({"prompt": "word ".repeat(400), "max_tokens": 2}),
    ];
    for body in &bad {
        let (status, v) = post_to(addr, "/v1/completions", body);
        assert!((400..500).contains(&status), "{v}");
    }

    let m = metrics(addr);
    assert_eq!(outcome(&m, "length"), 2.0);
    assert_eq!(outcome(&m, "client_error"), 3.0);
    for o in ["stop", "cancelled", "rejected", "server_error"] {
        assert_eq!(outcome(&m, o), 0.0, "{o}");
    }
    assert_eq!(m["sala_prompt_tokens_total"], (pa + pb) as f64);
    assert_eq!(m["sala_generation_tokens_total"], (ca + cb) as f64);
    // One first token per request; every later token has a gap before it.
    assert_eq!(histogram_count(&m, "sala_time_to_first_token_seconds"), 2.0);
    assert_eq!(
        histogram_count(&m, "sala_inter_token_latency_seconds"),
        (ca - 1 + cb - 1) as f64
    );
    let rate = m["sala_generation_tokens_per_second"];
    assert!(rate > 0.0 && rate <= (ca + cb) as f64, "{rate}");
    for name in [
        "sala_queue_depth",
        "sala_requests_running",
        "sala_live_sequences",
        "sala_cache_bytes",
    ] {
        assert_eq!(m[name], 0.0, "{name} after the requests");
    }
}

#[test]
fn a_full_queue_over_http_is_429_and_metrics_show_the_backlog() {
    // A batch of one: A holds it while its client does not read (A is paused, not finished).
    let engine = spawn_engine_batched(1, 1);
    let addr = serve(engine.clone());
    let req = busy_request;
    // A fills the batch: nobody reads its events, so it pauses once they fill.
    let mut a = engine.submit(req(200)).unwrap();
    let prompt_tokens = match a.blocking_recv() {
        Some(Event::Started { prompt_tokens }) => prompt_tokens,
        other => panic!("{other:?}"),
    };
    // B waits in the queue; an HTTP request finds it full.
    let b = engine.submit(req(5)).unwrap();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]});
        let (status, text) = request_to(addr, "POST", path, body.to_string().as_bytes());
        assert_error(status, &text, 429, None, "full queue");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["code"], "queue_full");
    }
    // /health and /metrics answer while the engine is busy.
    assert_eq!(request_to(addr, "GET", "/health", b"").0, 200);
    let m = metrics(addr);
    assert_eq!(m["sala_queue_depth"], 1.0);
    assert_eq!(m["sala_requests_running"], 1.0);
    assert_eq!(m["sala_live_sequences"], 1.0);
    assert_eq!(outcome(&m, "rejected"), 2.0);
    // A's cache grows from its prompt's by the memory formula, up to a full context's (the
    // engine thread may not have run yet on a loaded machine: wait for A's first tokens).
    let config = sala_checkpoint::ModelConfig::from_file(&model_dir().join("config.json")).unwrap();
    let bytes = |len| sala_model::memory::cache_bytes(&config, len).total() as f64;
    let mut cache = m["sala_cache_bytes"];
    for _ in 0..1000 {
        if cache > bytes(prompt_tokens) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        cache = metrics(addr)["sala_cache_bytes"];
    }
    assert!(
        (prompt_tokens + 1..=MAX_CONTEXT).any(|len| bytes(len) == cache),
        "{cache} is no sequence's cache: {} at the prompt, {} at the full context",
        bytes(prompt_tokens),
        bytes(MAX_CONTEXT)
    );

    // Dropping A cancels it and B is skipped; then the server serves again.
    drop(a);
    drop(b);
    let mut served = None;
    for _ in 0..200 {
        let (status, v) = post_to(
            addr,
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 2}),
        );
        if status == 200 {
            served = Some(v);
            break;
        }
        assert_eq!(status, 429, "{v}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let served = served.expect("the queue frees up");
    let m = metrics(addr);
    assert_eq!(outcome(&m, "cancelled"), 2.0, "A and B");
    let finished = served["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(outcome(&m, finished), 1.0);
    assert_eq!(m["sala_queue_depth"], 0.0);
    assert_eq!(m["sala_requests_running"], 0.0);
    assert_eq!(m["sala_cache_bytes"], 0.0);
}

/// A server that speculates counts the drafts it verifies in `/metrics`; a request that opts
/// out (`"speculative": false`) drafts nothing and gets the same greedy text.
#[test]
fn metrics_count_speculation_and_a_request_may_opt_out() {
    let dir = model_dir().to_path_buf();
    let engine = sala_server::spawn_engine(MODEL_ID.into(), Some(MAX_CONTEXT), 8, move |runner| {
        let engine = engine_from(&dir)?;
        runner
            .speculate(Some(sala_engine::draft::Speculate::prompt_lookup(4)))
            .run(engine);
        Ok(())
    })
    .unwrap();
    let addr = serve(engine);
    // A repetitive prompt: prompt lookup finds drafts in it.
    let prompt = "one two three four one two three four one two three four one two three four";
    let body = |speculative: bool| {
        json!({"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": true,
               "speculative": speculative})
    };
    let (status, off) = post_to(addr, "/v1/completions", &body(false));
    assert_eq!(status, 200, "{off}");
    let m = metrics(addr);
    assert_eq!(m["sala_speculative_draft_tokens_total"], 0.0, "{m:?}");
    let (status, on) = post_to(addr, "/v1/completions", &body(true));
    assert_eq!(status, 200, "{on}");
    assert_eq!(on["choices"][0]["text"], off["choices"][0]["text"]);
    let m = metrics(addr);
    assert!(m["sala_speculative_draft_tokens_total"] > 0.0, "{m:?}");
    assert!(m["sala_speculative_steps_total"] > 0.0, "{m:?}");
    let (status, bad) = post_to(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "speculative": "yes"}),
    );
    assert_eq!(status, 400, "{bad}");
}

/// With the prefix cache on, a prompt that begins with an earlier one's tokens takes them
/// from the cache: `usage.prompt_tokens_details.cached_tokens` says how many (as OpenAI
/// does), and `/metrics` counts hit and missed tokens and the bytes held.
#[test]
fn the_prefix_cache_shows_in_usage_and_metrics() {
    let engine = spawn_engine_with(8, 4, MAX_CONTEXT, |e| e.set_prefix_cache(Some(1 << 30)));
    let addr = serve(engine);
    let m = metrics(addr);
    for name in [
        "sala_prefix_cache_hit_tokens_total",
        "sala_prefix_cache_missed_tokens_total",
        "sala_prefix_cache_bytes",
    ] {
        assert_eq!(m[name], 0.0, "{name}");
    }
    // Token ids past `dense_len` (96), so both prompts are read sparsely.
    let first: Vec<u32> = (0..150).map(|i| 10 + (i * 7) % 200).collect();
    let second: Vec<u32> = first[..140].iter().copied().chain([3, 4, 5]).collect();
    let ask = |prompt: &[u32]| {
        let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 3});
        let (status, v) = post_to(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(ask(&first), 0);
    // Two 64-token chunks of the first prompt come from the cache.
    assert_eq!(ask(&second), 128);
    let m = metrics(addr);
    assert_eq!(m["sala_prefix_cache_hit_tokens_total"], 128.0);
    assert_eq!(
        m["sala_prefix_cache_missed_tokens_total"],
        (150 + second.len() - 128) as f64
    );
    assert!(m["sala_prefix_cache_bytes"] > 0.0);
}

/// With context-parallel ranks, a long prompt read by them shows in the metrics, and the
/// request is answered as without them.
#[test]
fn context_parallel_reads_show_in_metrics() {
    let engine = spawn_engine_with(8, 4, MAX_CONTEXT, |e| {
        let checkpoint = sala_checkpoint::Checkpoint::open(model_dir()).unwrap();
        let be = sala_cpu::CpuBackend::default();
        let model = sala_engine::generate::load_model(&be, &checkpoint, &mut |_, _| {}).unwrap();
        let ranks = sala_engine::context::ContextRanks::new(
            vec![be],
            vec![model],
            Box::new(sala_cpu::HostRanks),
        )
        .unwrap();
        e.set_context_parallel(Some(ranks));
    });
    let addr = serve(engine);
    let names = [
        "sala_context_parallel_prompts_total",
        "sala_context_parallel_tokens_total",
        "sala_context_parallel_read_alone_total",
        "sala_context_parallel_busy_total",
    ];
    let m = metrics(addr);
    for name in names {
        assert_eq!(m[name], 0.0, "{name}");
    }
    let ask = |prompt: &[u32]| {
        let body = json!({"model": MODEL_ID, "prompt": prompt, "max_tokens": 3});
        let (status, v) = post_to(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    };
    // 150 tokens: more than two blocks of 16 for each of the 2 ranks; 40: fewer.
    let long: Vec<u32> = (0..150).map(|i| 10 + (i * 7) % 200).collect();
    ask(&long);
    ask(&long[..40]);
    let m = metrics(addr);
    assert_eq!(m[names[0]], 1.0);
    assert_eq!(m[names[1]], 149.0);
    assert_eq!(m[names[2]], 0.0);
    assert_eq!(m[names[3]], 0.0);
}
