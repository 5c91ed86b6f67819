//! The official `openai` Python client against the real server (`tests/openai_client.py`).
//!
//! The Python comes from `SALA_TEST_PYTHON` (scripts/test.sh sets it to its venv, where it
//! installs the client), else `target/cuda-venv/bin/python` of the workspace. Without it the
//! test fails: it is part of the suite, not optional.

use crate::common::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

pub fn python() -> PathBuf {
    let path = std::env::var_os("SALA_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/cuda-venv/bin/python")
        });
    assert!(
        path.exists(),
        "no Python for the openai client test at {}: run scripts/test.sh (it installs the \
         pinned `openai` package into target/cuda-venv), or set SALA_TEST_PYTHON to a Python \
         that has it",
        path.display()
    );
    path
}

#[test]
fn the_official_openai_client_works_streaming_and_not() {
    let addr = server();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let py = python();
    let run = Command::new(&py)
        .arg(script)
        .arg(format!("http://{addr}/v1"))
        .arg(MODEL_ID)
        .arg(format!("http://{}/v1", long_server()))
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "{} {script} failed ({}); if `openai` is missing, run scripts/test.sh or `pip install \
         openai` into that Python:\n{stderr}",
        py.display(),
        run.status
    );
    let out: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stdout)));

    // The same requests over plain HTTP: greedy, so the answers agree.
    let messages = json!([{"role": "user", "content": "Tell me about the sea."}]);
    let fixed = json!({"max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let mut body = fixed.clone();
    body["messages"] = messages;
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(2);
    let (status, chat) = post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{chat}");
    let content = chat["choices"][0]["message"]["content"].as_str().unwrap();

    let c = &out["chat"];
    assert_eq!(c["object"], "chat.completion");
    assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(c["model"], MODEL_ID);
    assert_eq!(c["role"], "assistant");
    assert_eq!(c["content"], content);
    assert_eq!(c["finish"], "length");
    let u = c["usage"].as_array().unwrap();
    assert_eq!(u[1], 12);
    assert_eq!(u[0], chat["usage"]["prompt_tokens"]);
    let lp = c["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 12);
    for (i, (e, raw)) in lp
        .iter()
        .zip(
            chat["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap(),
        )
        .enumerate()
    {
        assert_eq!(e["token"], raw["token"], "entry {i}");
        assert_eq!(e["bytes"], raw["bytes"], "entry {i}");
        assert!((e["logprob"].as_f64().unwrap() - raw["logprob"].as_f64().unwrap()).abs() < 1e-9);
        assert_eq!(e["top"].as_array().unwrap().len(), 2, "entry {i}");
    }

    let s = &out["chat_stream"];
    assert_eq!(s["content"], content);
    assert_eq!(s["roles"], json!(["assistant"]));
    assert_eq!(s["finish"], json!(["length"]));
    assert_eq!(s["usage"], c["usage"]);
    assert_eq!(s["logprobs"], c["logprobs"]);

    let mut body = fixed.clone();
    body["prompt"] = json!("Once upon a time");
    let (status, comp) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{comp}");
    let text = comp["choices"][0]["text"].as_str().unwrap();
    let c = &out["completion"];
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["text"], text);
    assert_eq!(c["finish"], "length");
    assert_eq!(c["usage"][1], 12);
    assert_eq!(c["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(c["token_logprobs"].as_array().unwrap().len(), 12);
    assert_eq!(c["text_offset"][0], 0);
    let s = &out["completion_stream"];
    assert_eq!(s["text"], text);
    assert_eq!(s["finish"], json!(["length"]));

    assert_eq!(out["models"], json!([MODEL_ID]));

    // Errors reach the client as its typed exceptions with the OpenAI fields.
    let e = &out["unknown_model"];
    assert_eq!(e["class"], "NotFoundError", "{e}");
    assert_eq!(e["status"], 404);
    assert_eq!(e["param"], "model");
    assert_eq!(e["code"], "model_not_found");
    for (key, param) in [("n2", "n"), ("empty_messages", "messages")] {
        let e = &out[key];
        assert_eq!(e["class"], "BadRequestError", "{key}: {e}");
        assert_eq!(e["status"], 400, "{key}");
        assert_eq!(e["param"], param, "{key}");
        assert_eq!(e["type"], "invalid_request_error", "{key}");
        assert!(!e["message"].as_str().unwrap().is_empty());
    }

    // Tools through the client: a call history, a named call forced. The random model does
    // not finish the call: the reply is content beginning with the call's start, whole and
    // streamed alike, accumulated by the client's stream state without error.
    let t = &out["tools"];
    assert_eq!(t["role"], "assistant", "{t}");
    let content = t["content"].as_str().unwrap();
    assert!(
        content.starts_with("<function name=\"get_weather\">"),
        "{t}"
    );
    assert_eq!(t["tool_calls"], json!([]), "{t}");
    assert_eq!(t["finish"], "length", "{t}");
    assert_eq!(t["usage"][1], 12, "{t}");
    let s = &out["tools_stream"];
    assert_eq!(s["content"], t["content"], "{s}");
    assert_eq!(s["tool_calls"], json!([]), "{s}");
    assert_eq!(s["finish"], "length", "{s}");
    assert_eq!(s["usage"], t["usage"], "{s}");
    // A strict function from a pydantic model: the client parsed and validated the call.
    let p = &out["strict_parsed"];
    assert_eq!(p["name"], "Lookup", "{p}");
    assert_eq!(p["finish"], "tool_calls", "{p}");
    let days = p["arguments"]["days"].as_i64().unwrap();
    assert!((1..=7).contains(&days), "{p}");
    assert!(
        ["city", "village"].contains(&p["arguments"]["place"]["kind"].as_str().unwrap()),
        "{p}"
    );
    for (key, param) in [
        ("tool_choice_alone", "tool_choice"),
        ("too_many_tools", "tools"),
    ] {
        let e = &out[key];
        assert_eq!(e["class"], "BadRequestError", "{key}: {e}");
        assert_eq!(e["param"], param, "{key}: {e}");
    }
}
