//! `response_format` over HTTP and through the official `openai` client: the random model's
//! output parses and matches the schema; bad formats and schemas are 400s naming
//! `response_format`, before any engine work.

use crate::common::*;
use crate::openai_client::python;
use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Stdio};

/// A small schema with bounded strings (the test server's context is 256 tokens).
fn pet_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
            "vaccinated": {"type": "boolean"},
            "toys": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2}
        },
        "required": ["name", "age", "kind", "vaccinated", "toys"],
        "additionalProperties": false
    })
}

/// Checks `text` against [`pet_schema`].
fn check_pet(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        ["age", "kind", "name", "toys", "vaccinated"],
        "{text}"
    );
    let name = o["name"].as_str().unwrap();
    assert!((1..=8).contains(&name.chars().count()), "{text}");
    assert!((0..=30).contains(&o["age"].as_i64().unwrap()), "{text}");
    assert!(
        ["cat", "dog", "fish"].contains(&o["kind"].as_str().unwrap()),
        "{text}"
    );
    assert!(o["vaccinated"].is_boolean(), "{text}");
    let toys = o["toys"].as_array().unwrap();
    assert!(toys.len() <= 2, "{text}");
    for t in toys {
        assert!(t.as_str().unwrap().chars().count() <= 5, "{text}");
    }
}

fn chat(response_format: Value, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Describe a pet as JSON."}],
        "temperature": 0,
        "stream": stream,
        "response_format": response_format,
    })
}

fn json_schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "pet", "schema": pet_schema(), "strict": true}})
}

#[test]
fn json_schema_output_parses_and_matches_streaming_and_not() {
    let (status, v) = post("/v1/chat/completions", &chat(json_schema_format(), false));
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    check_pet(content);
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");

    let (status, body) = request(
        "POST",
        "/v1/chat/completions",
        chat(json_schema_format(), true).to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let chunks = sse_chunks(&body);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content);
    let finish: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, [&json!("stop")]);

    // `text` is free text: the same as no response_format.
    let mut free = chat(json!({"type": "text"}), false);
    free["max_tokens"] = json!(16);
    let (status, a) = post("/v1/chat/completions", &free);
    assert_eq!(status, 200, "{a}");
    free.as_object_mut().unwrap().remove("response_format");
    let (_, b) = post("/v1/chat/completions", &free);
    assert_eq!(
        a["choices"][0]["message"]["content"],
        b["choices"][0]["message"]["content"]
    );
}

#[test]
fn json_object_in_chat_and_completions() {
    let (status, v) = post(
        "/v1/chat/completions",
        &chat(json!({"type": "json_object"}), false),
    );
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(parsed.is_object(), "{v}");

    let body = json!({
        "prompt": "A JSON object:",
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": pet_schema()}},
    });
    let (status, v) = post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    check_pet(v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
}

/// An object schema of `n` string properties, none required.
pub fn optional_properties(n: usize) -> Value {
    let properties: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    json!({"type": "object", "properties": properties})
}

#[test]
fn bad_formats_and_schemas_are_400_naming_response_format() {
    // A larger body limit, so that the schema's own limit answers.
    let addr = serve_with(
        spawn_engine(8),
        sala_server::ServerOptions {
            max_body_bytes: 1 << 20,
            ..Default::default()
        },
    );
    let too_big = json!({"type": "object", "description": "x".repeat(70_000)});
    let schema =
        |s: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}});
    for (format, needle) in [
        (json!({"type": "xml"}), "unknown variant `xml`"),
        (
            json!("json"),
            "`type` is `text`, `json_object` or `json_schema`",
        ),
        (json!({"json_schema": {}}), "type"),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "json_schema.schema is required",
        ),
        (
            schema(json!({"type": "strin"})),
            "type at \"/type\" is \"strin\"",
        ),
        (
            schema(json!({"type": "object", "properties": {"a": {"type": ["null", "bool"]}}})),
            "type at \"/properties/a/type\"",
        ),
        (schema(json!([1, 2])), "must be a JSON object"),
        (
            schema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "nsatisfiable",
        ),
        (schema(too_big), "at most 65536"),
        (
            schema(json!({"enum": (0..1025).collect::<Vec<u32>>()})),
            "1025 alternatives",
        ),
        // The parser would fail once the object's keys are read, mid-generation.
        (schema(optional_properties(500)), "about 2007 alternatives"),
        (
            schema(json!({"anyOf": [optional_properties(250), optional_properties(250)]})),
            "about 2014 alternatives",
        ),
    ] {
        let mut body = chat(format.clone(), false);
        body["max_tokens"] = json!(4);
        let (status, text) = request_to(
            addr,
            "POST",
            "/v1/chat/completions",
            body.to_string().as_bytes(),
        );
        assert_error(status, &text, 400, None, &format.to_string());
        let v: Value = serde_json::from_str(&text).unwrap();
        let param = v["error"]["param"].as_str().unwrap_or_default();
        assert!(param.starts_with("response_format"), "{format}: {text}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{format}: {message}");
        assert!(!message.contains("ResponseFormat"), "{message}");
    }
    // Refused before the engine: no request reached it.
    let m = metrics(addr);
    assert_eq!(
        m.get("sala_prompt_tokens_total").copied().unwrap_or(0.0),
        0.0
    );
}

#[test]
fn the_official_openai_client_gets_structured_output() {
    let addr = server();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_structured.py");
    let py = python();
    let mut child = Command::new(&py)
        .arg(script)
        .arg(format!("http://{addr}/v1"))
        .arg(MODEL_ID)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(pet_schema().to_string().as_bytes())
        .unwrap();
    let run = child.wait_with_output().unwrap();
    assert!(
        run.status.success(),
        "{} {script} failed ({}):\n{}",
        py.display(),
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let out: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stdout)));

    let content = out["create"]["content"].as_str().unwrap();
    check_pet(content);
    assert_eq!(out["create"]["finish"], "stop");
    assert_eq!(out["stream"]["content"], content);
    assert_eq!(out["stream"]["finish"], json!(["stop"]));

    // `parse` with a pydantic model: the client validated the reply into the model.
    let p = &out["parse"];
    assert_eq!(p["finish"], "stop", "{p}");
    check_pet(p["content"].as_str().unwrap());
    let parsed: Value = serde_json::from_str(p["content"].as_str().unwrap()).unwrap();
    assert_eq!(p["parsed"], parsed, "{p}");

    let c = &out["completion_json_object"];
    assert_eq!(c["finish"], "stop", "{c}");
    let v: Value = serde_json::from_str(c["text"].as_str().unwrap()).unwrap();
    assert!(v.is_object(), "{c}");

    let e = &out["bad_schema"];
    assert_eq!(e["class"], "BadRequestError", "{e}");
    assert_eq!(e["status"], 400);
    assert_eq!(e["param"], "response_format");
    assert!(e["message"].as_str().unwrap().contains("strin"), "{e}");
}
