//! Several choices per request: `n` up to 8 and lists of prompts in `/v1/completions`. Each
//! choice is what a request of its own with the seed plus its index gives; choices carry
//! their index (prompt `p`'s choice `j` is `p * n + j`), streamed chunks too; usage counts
//! each prompt once.

use crate::common::*;
use serde_json::{json, Value};

fn completion(prompt: Value, n: u64, seed: u64) -> Value {
    let (status, v) = post(
        "/v1/completions",
        &json!({"prompt": prompt, "n": n, "seed": seed, "temperature": 1.0, "max_tokens": 6}),
    );
    assert_eq!(status, 200, "{v}");
    v
}

fn texts(v: &Value) -> Vec<String> {
    let choices = v["choices"].as_array().unwrap();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
    }
    choices
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn n_choices_are_the_seeds_requests_and_usage_counts_the_prompt_once() {
    let many = completion(json!("Once upon a time"), 3, 40);
    let got = texts(&many);
    assert_eq!(got.len(), 3);
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (j, text) in got.iter().enumerate() {
        let one = completion(json!("Once upon a time"), 1, 40 + j as u64);
        assert_eq!(&texts(&one)[0], text, "choice {j}");
        let (p, c) = check_usage(&one);
        (prompt_tokens, completion_tokens) = (p, completion_tokens + c);
    }
    assert!(got.iter().any(|t| t != &got[0]), "{got:?}");
    assert_eq!(check_usage(&many), (prompt_tokens, completion_tokens));
}

#[test]
fn a_list_of_prompts_has_n_choices_each_in_order() {
    let prompts = json!(["The sky", "A river"]);
    let many = completion(prompts.clone(), 2, 7);
    let got = texts(&many);
    assert_eq!(got.len(), 4);
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (p, prompt) in prompts.as_array().unwrap().iter().enumerate() {
        for j in 0..2 {
            let one = completion(prompt.clone(), 1, 7 + j);
            assert_eq!(
                texts(&one)[0],
                got[p * 2 + j as usize],
                "prompt {p} choice {j}"
            );
            let (pt, ct) = check_usage(&one);
            prompt_tokens += pt * (j == 0) as u64;
            completion_tokens += ct;
        }
    }
    assert_eq!(check_usage(&many), (prompt_tokens, completion_tokens));
    // Token-id prompts too.
    let ids = completion(json!([[5, 6, 7], [8, 9]]), 1, 3);
    assert_eq!(texts(&ids).len(), 2);
    assert_eq!(check_usage(&ids).0, 5);
}

#[test]
fn streamed_choices_carry_their_index_and_one_usage() {
    let body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "n": 3, "seed": 1, "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let (status, text) = request("POST", "/v1/chat/completions", body.to_string().as_bytes());
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks(&text);
    let mut finishes = [0; 3];
    let mut roles = [0; 3];
    let mut usage = 0;
    for c in &chunks {
        match c["choices"].as_array().unwrap().as_slice() {
            [] => {
                usage += 1;
                assert!(check_usage(c).1 <= 15, "{c}");
            }
            [choice] => {
                let i = choice["index"].as_u64().unwrap() as usize;
                roles[i] += (choice["delta"]["role"] == "assistant") as usize;
                finishes[i] += choice["finish_reason"].is_string() as usize;
            }
            more => panic!("{more:?}"),
        }
    }
    assert_eq!((roles, finishes, usage), ([1; 3], [1; 3], 1), "{text}");
    // The whole reply has the same choices.
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let (status, v) = post("/v1/chat/completions", &whole);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let streamed: String = chunks
            .iter()
            .filter_map(|ch| ch["choices"].get(0))
            .filter(|ch| ch["index"] == i)
            .filter_map(|ch| ch["delta"]["content"].as_str())
            .collect();
        assert_eq!(
            c["message"]["content"].as_str().unwrap_or(""),
            streamed,
            "{i}"
        );
    }
}
