//! `logprobs` / `top_logprobs` on both endpoints, streaming and not, held to the engine's
//! own steps for the same request in this process.

use crate::common::*;
use sala_engine::generate::GenerateOptions;
use sala_engine::sampling::SamplingParams;
use sala_server::engine::TokenText;
use serde_json::{json, Value};

/// What the engine reports for a completion of `prompt`: (token text, logprob, top tokens).
type Expected = Vec<(TokenText, f32, Vec<(TokenText, f32)>)>;

fn engine_steps(prompt: &str, sampling: SamplingParams, max_tokens: usize, n: usize) -> Expected {
    let mut engine = load_engine();
    let ids = engine.tokenizer.encode(prompt, true).unwrap();
    let opts = GenerateOptions {
        sampling,
        max_tokens,
        max_context: MAX_CONTEXT,
        stop: Vec::new(),
        eos_ids: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        speculate: None,
    };
    let tokenizer = engine.tokenizer.clone();
    let mut out = Vec::new();
    engine
        .generate_steps(
            &ids,
            &opts,
            Some(n),
            &mut |s| {
                if let Some(t) = s.token {
                    let lp = t.logprobs.as_ref().unwrap();
                    let top = lp
                        .top
                        .iter()
                        .map(|&(id, l)| (TokenText::of(&tokenizer, id), l))
                        .collect();
                    out.push((TokenText::of(&tokenizer, t.id), lp.logprob, top));
                }
                true
            },
            &mut |_| {},
        )
        .unwrap();
    out
}

fn close(a: &Value, b: f32) -> bool {
    (a.as_f64().unwrap() - b as f64).abs() < 1e-6
}

fn bytes_of(v: &Value) -> Vec<u8> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect()
}

#[test]
fn completion_logprobs_match_the_engine_streaming_or_not() {
    let prompt = "A quiet harbour at dawn";
    // Sampled with penalties: the logprobs are still the raw distribution's.
    let body = json!({
        "prompt": prompt, "max_tokens": 9, "ignore_eos": true, "logprobs": 3,
        "temperature": 0.9, "seed": 5, "presence_penalty": 1.0,
    });
    let sampling = SamplingParams {
        temperature: 0.9,
        seed: Some(5),
        presence_penalty: 1.0,
        ..SamplingParams::default()
    };
    let want = engine_steps(prompt, sampling, 9, 3);
    assert_eq!(want.len(), 9);

    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 9, "{lp}");
    let mut offset = 0;
    for (i, (tok, logprob, top)) in want.iter().enumerate() {
        assert_eq!(tokens[i], tok.text.as_str(), "token {i}");
        assert!(close(&lp["token_logprobs"][i], *logprob), "token {i}: {lp}");
        assert!(*logprob <= 0.0);
        assert_eq!(lp["text_offset"][i], offset, "token {i}");
        offset += tok.text.chars().count();
        // The top tokens and then the sampled one, keyed by text (the first of a text wins).
        let dict = lp["top_logprobs"][i].as_object().unwrap();
        let mut expected: Vec<(&str, f32)> = Vec::new();
        let sampled = (tok.clone(), *logprob);
        for (t, l) in top.iter().chain([&sampled]) {
            if !expected.iter().any(|e| e.0 == t.text) {
                expected.push((&t.text, *l));
            }
        }
        assert_eq!(dict.len(), expected.len(), "token {i}: {dict:?}");
        for (t, l) in expected {
            assert!(close(&dict[t], l), "token {i}: {t:?} in {dict:?}");
        }
    }

    // Streaming: the chunks' logprobs put together are the same.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (status, raw) = request("POST", "/v1/completions", sbody.to_string().as_bytes());
    assert_eq!(status, 200, "{raw}");
    let mut joined =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    let mut text = String::new();
    for c in sse_chunks(&raw) {
        let choice = &c["choices"][0];
        text.push_str(choice["text"].as_str().unwrap());
        if choice["logprobs"].is_null() {
            continue;
        }
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let part = choice["logprobs"][key].as_array().unwrap().clone();
            joined[key].as_array_mut().unwrap().extend(part);
        }
    }
    assert_eq!(joined, *lp);
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());

    // Without `logprobs`, none.
    let (_, v) = post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    );
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
}

#[test]
fn chat_logprobs_have_the_openai_shape_streaming_or_not() {
    let body = json!({
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": true,
        "logprobs": true, "top_logprobs": 5,
    });
    let (status, v) = post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        content.len() as u64,
        check_usage(&v).1,
        "one entry per token"
    );
    for (i, e) in content.iter().enumerate() {
        let token = e["token"].as_str().unwrap();
        let bytes = bytes_of(&e["bytes"]);
        assert_eq!(String::from_utf8_lossy(&bytes), token, "entry {i}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5, "entry {i}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"], "entry {i}");
        assert_eq!(top[0]["logprob"], e["logprob"], "entry {i}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
        assert!(values[0] <= 0.0);
        let p: f64 = values.iter().map(|l| l.exp()).sum();
        assert!(p <= 1.0 + 1e-5, "probabilities sum to {p}");
        for t in top {
            assert_eq!(
                String::from_utf8_lossy(&bytes_of(&t["bytes"])),
                t["token"].as_str().unwrap()
            );
        }
    }

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (status, raw) = request("POST", "/v1/chat/completions", sbody.to_string().as_bytes());
    assert_eq!(status, 200, "{raw}");
    let mut streamed = Vec::new();
    for c in sse_chunks(&raw) {
        let lp = &c["choices"][0]["logprobs"];
        if !lp.is_null() {
            streamed.extend(lp["content"].as_array().unwrap().iter().cloned());
        }
    }
    assert_eq!(&streamed, content);

    // logprobs without top_logprobs: entries with empty top lists; false: none.
    let mut b = body.clone();
    b.as_object_mut().unwrap().remove("top_logprobs");
    let (_, v) = post("/v1/chat/completions", &b);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 8);
    assert!(content.iter().all(|e| e["top_logprobs"] == json!([])));
    b["logprobs"] = json!(false);
    let (_, v) = post("/v1/chat/completions", &b);
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
}

/// A response answered whole holds its log-probabilities until the reply ends: past the
/// server's limit the request fails with a 400 naming them (it used to hold them all, about
/// 40 KB a token with 20 alternatives, until the server ran out of memory); a stream, which
/// holds none, goes on; and the server serves the next request.
#[test]
fn whole_responses_hold_a_bounded_number_of_logprobs() {
    let addr = serve_with(
        spawn_engine(8),
        sala_server::ServerOptions {
            max_whole_logprobs: 2_000,
            ..Default::default()
        },
    );
    let ask = |path: &str, stream: bool| {
        let mut body = json!({"n": 2, "max_tokens": 60, "ignore_eos": true, "stream": stream});
        if path == "/v1/chat/completions" {
            body["messages"] = json!([{"role": "user", "content": "Hi"}]);
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(20);
        } else {
            body["prompt"] = json!("Hi");
            body["logprobs"] = json!(20);
        }
        request_to(addr, "POST", path, body.to_string().as_bytes())
    };
    for (path, param) in [
        ("/v1/chat/completions", "top_logprobs"),
        ("/v1/completions", "logprobs"),
    ] {
        let (status, text) = ask(path, false);
        assert_error(status, &text, 400, Some(param), path);
        assert!(text.contains("response_too_large"), "{text}");
        let (status, text) = ask(path, true);
        assert_eq!(status, 200, "{text}");
        assert!(
            text.ends_with("data: [DONE]\n\n") && !text.contains("\"error\":{"),
            "{text}"
        );
    }
    let (status, v) = post_to(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}
