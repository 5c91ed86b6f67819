//! `echo`, `max_tokens: 0` and `prompt_logprobs` on `/v1/completions`: the prompt's text and
//! its tokens' logprobs (OpenAI's legacy shape, vLLM's list), held to the engine's own prompt
//! logprobs in this process; streamed and not, several prompts and choices, and clear errors.

use crate::common::*;
use sala_engine::request::PromptLogprobs;
use sala_server::engine::TokenText;
use serde_json::{json, Value};

/// The prompt's ids (as the server reads a text prompt: with BOS) and the engine's logprobs
/// of them with `top` alternatives.
fn engine_scores(
    prompt: &Value,
    top: usize,
) -> (Vec<u32>, PromptLogprobs, sala_tokenizer::Tokenizer) {
    let mut engine = load_engine();
    let ids = match prompt {
        Value::String(s) => engine.tokenizer.encode(s, true).unwrap(),
        ids => serde_json::from_value(ids.clone()).unwrap(),
    };
    let lp = engine.prompt_logprobs(&ids, top, &mut |_| {}).unwrap();
    (ids, lp, engine.tokenizer.clone())
}

fn close(v: &Value, want: f32) -> bool {
    (v.as_f64().unwrap() - want as f64).abs() < 1e-6
}

/// Checks a choice's legacy `logprobs` over its first `ids.len()` entries: the prompt's tokens,
/// the first with `null`s, the rest with the engine's logprob and `top` alternatives plus the
/// token itself, offsets counting the tokens' text. Returns the offset after the prompt.
fn check_prompt_part(
    lp: &Value,
    ids: &[u32],
    want: &PromptLogprobs,
    top: usize,
    tok: &sala_tokenizer::Tokenizer,
) -> usize {
    let text = |id: u32| TokenText::of(tok, id).text;
    let mut offset = 0;
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(lp["tokens"][i], text(id), "token {i}: {lp}");
        assert_eq!(lp["text_offset"][i], offset, "token {i}");
        offset += text(id).chars().count();
        if i == 0 {
            assert!(lp["token_logprobs"][0].is_null(), "{lp}");
            assert!(lp["top_logprobs"][0].is_null(), "{lp}");
            continue;
        }
        let w = &want.tokens[i - 1];
        assert_eq!(w.id, id);
        assert!(
            close(&lp["token_logprobs"][i], w.logprob),
            "token {i}: {lp}"
        );
        let dict = lp["top_logprobs"][i].as_object().unwrap();
        let mut expected: Vec<(String, f32)> = Vec::new();
        for (t, l) in w.top.iter().take(top).copied().chain([(id, w.logprob)]) {
            if !expected.iter().any(|e| e.0 == text(t)) {
                expected.push((text(t), l));
            }
        }
        assert_eq!(dict.len(), expected.len(), "token {i}: {dict:?}");
        for (t, l) in expected {
            assert!(close(&dict[&t], l), "token {i}: {t:?} in {dict:?}");
        }
    }
    offset
}

#[test]
fn echo_with_logprobs_and_no_tokens_scores_the_prompt() {
    let prompt = json!("The harbour lights flickered on, one by one");
    let (ids, want, tok) = engine_scores(&prompt, 3);
    let body = json!({"prompt": prompt, "echo": true, "logprobs": 3, "max_tokens": 0});
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], prompt, "{v}");
    assert_eq!(choice["finish_reason"], "length");
    assert!(
        choice.get("prompt_logprobs").is_none(),
        "only when asked: {v}"
    );
    assert_eq!(check_usage(&v), (ids.len() as u64, 0));
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), ids.len(), "{lp}");
    check_prompt_part(lp, &ids, &want, 3, &tok);
    // Every logprob is a log-probability, and logprobs 0 lists the token alone.
    for l in lp["token_logprobs"].as_array().unwrap().iter().skip(1) {
        assert!(l.as_f64().unwrap() <= 0.0);
    }
    let mut zero = body.clone();
    zero["logprobs"] = json!(0);
    let (_, v0) = post("/v1/completions", &zero);
    let tops = v0["choices"][0]["logprobs"]["top_logprobs"]
        .as_array()
        .unwrap();
    assert!(
        tops[1..].iter().all(|t| t.as_object().unwrap().len() == 1),
        "{v0}"
    );
    assert_eq!(
        v0["choices"][0]["logprobs"]["token_logprobs"],
        lp["token_logprobs"]
    );
}

#[test]
fn echo_puts_the_prompt_before_the_completion() {
    let prompt = json!("A quiet harbour at dawn");
    let (ids, want, tok) = engine_scores(&prompt, 2);
    let gen = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                     "logprobs": 2});
    let (status, plain) = post("/v1/completions", &gen);
    assert_eq!(status, 200, "{plain}");
    let mut body = gen.clone();
    body["echo"] = json!(true);
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let (text, plain_text) = (&v["choices"][0]["text"], &plain["choices"][0]["text"]);
    assert_eq!(
        text.as_str().unwrap(),
        format!(
            "{}{}",
            prompt.as_str().unwrap(),
            plain_text.as_str().unwrap()
        )
    );
    assert_eq!(check_usage(&v), check_usage(&plain));
    // The prompt's tokens, then the generated ones as without echo (their offsets after
    // the prompt's).
    let (lp, plp) = (
        &v["choices"][0]["logprobs"],
        &plain["choices"][0]["logprobs"],
    );
    let after = check_prompt_part(lp, &ids, &want, 2, &tok);
    let n = ids.len();
    for key in ["tokens", "token_logprobs", "top_logprobs"] {
        assert_eq!(
            lp[key].as_array().unwrap()[n..],
            plp[key].as_array().unwrap()[..],
            "{key}"
        );
    }
    let offsets = |v: &Value| -> Vec<u64> {
        v["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect()
    };
    let shifted: Vec<u64> = offsets(plp).iter().map(|o| o + after as u64).collect();
    assert_eq!(offsets(lp)[n..], shifted[..]);

    // Without logprobs: the text alone.
    body.as_object_mut().unwrap().remove("logprobs");
    let (_, v) = post("/v1/completions", &body);
    assert_eq!(&v["choices"][0]["text"], text);
    assert!(v["choices"][0]["logprobs"].is_null(), "{v}");
}

#[test]
fn prompt_logprobs_have_vllms_shape() {
    let prompt = json!("Seven swans a-swimming");
    let (ids, want, tok) = engine_scores(&prompt, 4);
    let body = json!({"prompt": prompt, "prompt_logprobs": 4, "max_tokens": 0});
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], "", "no echo: {v}");
    assert!(choice["logprobs"].is_null());
    let list = choice["prompt_logprobs"].as_array().unwrap();
    assert_eq!(list.len(), ids.len(), "{v}");
    assert!(list[0].is_null());
    for (i, (entry, w)) in list[1..].iter().zip(&want.tokens).enumerate() {
        let entry = entry.as_object().unwrap();
        // The token itself with its rank, and the 4 most likely, ranked 1..=4.
        let own = &entry[&ids[i + 1].to_string()];
        assert!(
            close(&own["logprob"], w.logprob),
            "position {}: {own}",
            i + 1
        );
        assert_eq!(own["rank"], w.rank, "position {}", i + 1);
        assert_eq!(own["decoded_token"], TokenText::of(&tok, w.id).text);
        for (r, &(id, l)) in w.top.iter().enumerate() {
            let e = &entry[&id.to_string()];
            assert!(close(&e["logprob"], l), "position {}: {e}", i + 1);
            if id != w.id {
                assert_eq!(e["rank"], r + 1);
            }
        }
        let own_in_top = w.top.iter().any(|t| t.0 == w.id);
        assert_eq!(entry.len(), 4 + usize::from(!own_in_top), "{entry:?}");
    }

    // Beside echo and a completion: each shape with its own count of alternatives.
    let body = json!({"prompt": prompt, "prompt_logprobs": 4, "echo": true, "logprobs": 1,
                      "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let (status, v2) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v2}");
    let c = &v2["choices"][0];
    assert_eq!(c["prompt_logprobs"], choice["prompt_logprobs"]);
    check_prompt_part(&c["logprobs"], &ids, &want, 1, &tok);
    assert_eq!(
        c["logprobs"]["tokens"].as_array().unwrap().len(),
        ids.len() + 3
    );
}

#[test]
fn echo_streams_the_prompt_first_and_serves_lists_and_choices() {
    let prompts = json!(["One fish, two fish", "Red fish"]);
    let body = json!({"prompt": prompts, "echo": true, "logprobs": 2, "max_tokens": 4,
                      "n": 2, "temperature": 0, "ignore_eos": true});
    let (status, whole) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let choices = whole["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let p = prompts[i / 2].as_str().unwrap();
        assert!(c["text"].as_str().unwrap().starts_with(p), "{c}");
        let (ids, want, tok) = engine_scores(&prompts[i / 2], 2);
        check_prompt_part(&c["logprobs"], &ids, &want, 2, &tok);
    }
    // Greedy: a prompt's two choices are the same.
    assert_eq!(choices[0]["text"], choices[1]["text"]);

    // Streamed: each choice's first chunk is its prompt (with its tokens' logprobs); the
    // chunks put together are the whole answer.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (status, raw) = request("POST", "/v1/completions", sbody.to_string().as_bytes());
    assert_eq!(status, 200, "{raw}");
    let mut text = vec![String::new(); 4];
    let keys = ["tokens", "token_logprobs", "top_logprobs", "text_offset"];
    let mut joined =
        vec![json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}); 4];
    for c in sse_chunks(&raw) {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        let piece = choice["text"].as_str().unwrap();
        if text[i].is_empty() {
            assert_eq!(piece, prompts[i / 2], "the first chunk of choice {i}");
        }
        text[i].push_str(piece);
        if choice["logprobs"].is_null() {
            continue;
        }
        for key in keys {
            let part = choice["logprobs"][key].as_array().unwrap().clone();
            joined[i][key].as_array_mut().unwrap().extend(part);
        }
    }
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["text"], text[i], "choice {i}");
        assert_eq!(c["logprobs"], joined[i], "choice {i}");
    }

    // Streamed without logprobs: the prompt comes first all the same.
    sbody.as_object_mut().unwrap().remove("logprobs");
    sbody["n"] = json!(1);
    let (_, raw) = request("POST", "/v1/completions", sbody.to_string().as_bytes());
    let mut firsts = [None, None];
    for c in sse_chunks(&raw) {
        let choice = &c["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        assert!(choice["logprobs"].is_null());
        firsts[i].get_or_insert_with(|| choice["text"].clone());
    }
    assert_eq!(firsts, [Some(prompts[0].clone()), Some(prompts[1].clone())]);
}

#[test]
fn token_prompts_echo_as_sent_as_evaluation_harnesses_read_them() {
    // lm-evaluation-harness's loglikelihood request: token ids (no BOS added), echo,
    // logprobs 1, one greedy token; the context's logprobs are token_logprobs[1..len].
    let engine = load_engine();
    let tok = engine.tokenizer.clone();
    let ids = tok
        .encode("Question: what colour is the sea? Answer: blue", false)
        .unwrap();
    let prompt = json!(ids);
    let (_, want, _) = engine_scores(&prompt, 1);
    let body = json!({"prompt": [prompt.clone()], "echo": true, "logprobs": 1, "max_tokens": 1,
                      "temperature": 0});
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    let generated = c["logprobs"]["tokens"].as_array().unwrap().len() - ids.len();
    assert!(generated <= 1, "{v}");
    assert!(c["text"]
        .as_str()
        .unwrap()
        .starts_with(&tok.decode(&ids, true).unwrap()));
    check_prompt_part(&c["logprobs"], &ids, &want, 1, &tok);
    let sum: f64 = c["logprobs"]["token_logprobs"].as_array().unwrap()[1..ids.len()]
        .iter()
        .map(|l| l.as_f64().unwrap())
        .sum();
    let want_sum: f64 = want.tokens.iter().map(|t| t.logprob as f64).sum();
    assert!((sum - want_sum).abs() < 1e-4, "{sum} vs {want_sum}");
}

#[test]
fn bad_echo_and_prompt_logprobs_requests_get_clear_errors() {
    let comp = "/v1/completions";
    let chat = "/v1/chat/completions";
    let messages = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "max_tokens 0 without echo",
            comp,
            json!({"prompt": "hi", "max_tokens": 0}),
            "max_tokens",
        ),
        (
            "max_completion_tokens 0 on chat",
            chat,
            json!({"messages": messages, "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
        (
            "prompt_logprobs above 20",
            comp,
            json!({"prompt": "hi", "prompt_logprobs": 21}),
            "prompt_logprobs",
        ),
        (
            "prompt_logprobs -1",
            comp,
            json!({"prompt": "hi", "prompt_logprobs": -1}),
            "prompt_logprobs",
        ),
        (
            "prompt_logprobs a string",
            comp,
            json!({"prompt": "hi", "prompt_logprobs": "2"}),
            "prompt_logprobs",
        ),
        (
            "prompt_logprobs streamed",
            comp,
            json!({"prompt": "hi", "prompt_logprobs": 1, "stream": true}),
            "prompt_logprobs",
        ),
        (
            "echo with logprobs above 20",
            comp,
            json!({"prompt": "hi", "echo": true, "logprobs": 21, "max_tokens": 0}),
            "logprobs",
        ),
        (
            "echo not a boolean",
            comp,
            json!({"prompt": "hi", "echo": "yes"}),
            "echo",
        ),
        (
            "echo on chat",
            chat,
            json!({"messages": messages, "echo": true}),
            "echo",
        ),
        (
            "prompt_logprobs on chat",
            chat,
            json!({"messages": messages, "prompt_logprobs": 1}),
            "prompt_logprobs",
        ),
        (
            "echo of a prompt past the context",
            comp,
            json!({"prompt": "word ".repeat(MAX_CONTEXT), "echo": true, "max_tokens": 0}),
            "",
        ),
    ];
    for (what, path, body, param) in cases {
        let (status, text) = request("POST", path, body.to_string().as_bytes());
        let param = (!param.is_empty()).then_some(param);
        assert_error(status, &text, 400, param, what);
    }
    // Chat takes `echo: false` as it is.
    let (status, v) = post(
        chat,
        &json!({"messages": messages, "echo": false, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{v}");
}

/// The official `openai` client: echo with logprobs and `max_tokens` 0 on text and token
/// prompts, streamed, and `prompt_logprobs` through `extra_body`, the same as over plain
/// HTTP; errors as the client's typed exceptions.
#[test]
fn the_official_openai_client_scores_prompts_with_echo() {
    let addr = server();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_echo.py");
    let py = crate::openai_client::python();
    let ids: Vec<u32> = load_engine()
        .tokenizer
        .encode("Question: is the sea blue? Answer: yes", false)
        .unwrap();
    let run = std::process::Command::new(&py)
        .arg(script)
        .arg(format!("http://{addr}/v1"))
        .arg(MODEL_ID)
        .arg(json!(ids).to_string())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    assert!(
        run.status.success(),
        "{} {script} failed ({}):\n{}",
        py.display(),
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let out: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stdout)));

    let prompt = json!("The harbour lights flickered on");
    let (ids_text, want, tok) = engine_scores(&prompt, 3);
    let t = &out["text"];
    assert_eq!(t["text"], prompt, "{t}");
    assert_eq!(t["finish"], "length");
    assert_eq!(t["usage"], json!([ids_text.len(), 0, ids_text.len()]));
    check_prompt_part(&t["logprobs"], &ids_text, &want, 3, &tok);
    // The same as over plain HTTP.
    let (_, v) = post(
        "/v1/completions",
        &json!({"prompt": prompt, "echo": true, "logprobs": 3, "max_tokens": 0}),
    );
    assert_eq!(t["logprobs"], v["choices"][0]["logprobs"]);

    let halves = [ids.clone(), ids[..ids.len() / 2].to_vec()];
    let choices = out["tokens"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{out}");
    for (c, p) in choices.iter().zip(&halves) {
        let (_, want, _) = engine_scores(&json!(p), 1);
        check_prompt_part(&c["logprobs"], p, &want, 1, &tok);
        assert!(c["logprobs"]["tokens"].as_array().unwrap().len() <= p.len() + 1);
        let decoded = tok.decode(p, true).unwrap();
        assert!(c["text"].as_str().unwrap().starts_with(&decoded), "{c}");
    }

    let s = &out["stream"];
    assert_eq!(s["first"], "A quiet harbour at dawn", "{s}");
    let (_, v) = post(
        "/v1/completions",
        &json!({"prompt": "A quiet harbour at dawn", "echo": true, "logprobs": 2,
                "max_tokens": 4, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(s["text"], v["choices"][0]["text"]);
    assert_eq!(s["logprobs"], v["choices"][0]["logprobs"]);

    let (_, v) = post(
        "/v1/completions",
        &json!({"prompt": "Seven swans", "max_tokens": 0, "prompt_logprobs": 2}),
    );
    assert_eq!(
        out["prompt_logprobs"], v["choices"][0]["prompt_logprobs"],
        "{out}"
    );
    assert!(out["prompt_logprobs"][0].is_null());
    assert!(out["prompt_logprobs"][1].is_object(), "{out}");

    for (key, param) in [
        ("too_many_logprobs", "logprobs"),
        ("no_tokens_without_echo", "max_tokens"),
        ("prompt_logprobs_on_chat", "prompt_logprobs"),
    ] {
        let e = &out[key];
        assert_eq!(e["class"], "BadRequestError", "{key}: {e}");
        assert_eq!(e["status"], 400, "{key}");
        assert_eq!(e["param"], param, "{key}");
    }
}

/// Prompt scores past what one response may list (prompt tokens x choices x entries a token)
/// are a 400 naming the field, before any work: here 64 prompts of 250 tokens, 8 choices each,
/// echo with 20 alternatives and prompt_logprobs 20 (42 entries a token, 5.4M in all).
#[test]
fn prompt_scores_too_many_for_one_response_are_refused() {
    let prompts: Vec<Vec<u32>> = (0..64)
        .map(|p| (0..250).map(|i| (p * 7 + i * 13) % 200 + 3).collect())
        .collect();
    let (status, body) = post(
        "/v1/completions",
        &json!({"prompt": prompts, "n": 8, "max_tokens": 1, "echo": true, "logprobs": 20,
                "prompt_logprobs": 20}),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "response_too_large", "{body}");
    assert_eq!(body["error"]["param"], "prompt_logprobs", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("5376000"), "{message}");
    // Two of those prompts, one choice, echo with 20 alternatives: 10,500 entries, served.
    let (status, body) = post(
        "/v1/completions",
        &json!({"prompt": prompts[..2], "max_tokens": 1, "echo": true, "logprobs": 20}),
    );
    assert_eq!(status, 200, "{body}");
}
