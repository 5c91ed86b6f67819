//! The request decoder under fire: bodies made by mutating valid ones (every known field given
//! values of every JSON type, fields dropped, junk fields added, bytes cut or flipped) get a
//! 200 or a 4xx with an OpenAI error body, never a 5xx, a hang or a crash.

use crate::common::*;
use sala_model::numerics::TestRng;
use serde_json::{json, Value};

/// A JSON value of a random type (nested up to `depth`).
fn any_value(rng: &mut TestRng, depth: usize) -> Value {
    match rng.below(if depth == 0 { 7 } else { 9 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 1),
        2 => json!(rng.below(100) as i64 - 50),
        3 => json!([-1e300, -1.5, 0.0, 0.5, 2.5, 1e300][rng.below(6)]),
        4 => json!(u64::MAX - rng.below(3) as u64),
        5 => json!(["", "x", "Hello", "<|im_end|>", "\u{0}", "é😀"][rng.below(6)]),
        6 => json!("long ".repeat(rng.below(400))),
        7 => Value::Array(
            (0..rng.below(4))
                .map(|_| any_value(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "role",
                "content",
                "type",
                "text",
                "name",
                "x",
                "function",
                "parameters",
                "arguments",
                "tool_calls",
            ];
            Value::Object(
                (0..rng.below(4))
                    .map(|_| {
                        (
                            keys[rng.below(keys.len())].to_string(),
                            any_value(rng, depth - 1),
                        )
                    })
                    .collect(),
            )
        }
    }
}

const FIELDS: [&str; 28] = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "logit_bias",
    "ignore_eos",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "prompt_logprobs",
    "best_of",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

#[test]
fn mutated_bodies_get_an_answer_never_a_server_error() {
    let mut rng = TestRng::new(2024);
    let mut answered = [0usize; 2];
    let bases = [
        (
            "/v1/completions",
            json!({"prompt": "Hello", "max_tokens": 3}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ),
    ];
    for round in 0..600 {
        let (path, base) = &bases[round % 2];
        let mut body = base.clone();
        for _ in 0..1 + rng.below(3) {
            let field = FIELDS[rng.below(FIELDS.len())];
            match rng.below(4) {
                0 => {
                    body.as_object_mut().unwrap().remove(field);
                }
                _ => body[field] = any_value(&mut rng, 2),
            }
        }
        // Keep the work small: a mutated request may still run.
        if body["max_tokens"].as_u64().is_some_and(|m| m > 8) {
            body["max_tokens"] = json!(8);
        }
        body.as_object_mut()
            .unwrap()
            .remove("max_completion_tokens");
        let mut bytes = body.to_string().into_bytes();
        if round % 7 == 3 {
            // Broken JSON: cut, or a byte flipped.
            let at = rng.below(bytes.len());
            if rng.below(2) == 0 {
                bytes.truncate(at);
            } else {
                bytes[at] ^= 0x5a;
            }
        }
        let (status, text) = request("POST", path, &bytes);
        let what = format!("round {round}: {}", String::from_utf8_lossy(&bytes));
        assert!(status < 500, "{what}: {status} {text}");
        if status != 200 {
            assert_error(status, &text, status, None, &what);
        }
        answered[usize::from(status == 200)] += 1;
    }
    // Both kinds of answer occur (the mutations are neither all fatal nor all harmless).
    assert!(
        answered[0] > 50 && answered[1] > 50,
        "refused, served: {answered:?}"
    );
}
