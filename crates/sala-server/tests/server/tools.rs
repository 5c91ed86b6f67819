//! Tool calling through the real server: the request's tools checked, rendered by the
//! checkpoint's template (the test template has MiniCPM's tools semantics), a tool-call
//! history accepted, and `tool_choice` shaping the prompt. The random model writes no calls
//! of its own (the parsing of calls is tested on scripted replies, the crate's unit tests),
//! except where a required or named `tool_choice` constrains its reply to calls.

use crate::common::*;
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}})
}

/// A greedy chat request about the weather, with `extra` fields.
fn ask(extra: Value) -> Value {
    let mut body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": true,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn chat(body: &Value) -> Value {
    let (status, v) = post_to(long_server(), "/v1/chat/completions", body);
    assert_eq!(status, 200, "{body}: {v}");
    v
}

#[test]
fn tool_requests_are_checked() {
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    for (extra, param, words) in [
        (json!({"tools": many}), "tools", "at most 128"),
        (json!({"tools": "get_weather"}), "tools", "sequence"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "get weather"}}]}),
            "tools[0].function.name",
            "64 letters",
        ),
        (
            json!({"tools": [weather(), weather()]}),
            "tools[1].function.name",
            "differ",
        ),
        (
            json!({"tools": [{"type": "retrieval"}]}),
            "tools[0].type",
            "tools are supported",
        ),
        (
            json!({"tool_choice": "auto"}),
            "tool_choice",
            "tools is not",
        ),
        (
            json!({"tools": [weather()], "tool_choice": named("get_time")}),
            "tool_choice",
            "not among the tools",
        ),
        (
            json!({"tools": [weather()], "tool_choice": "required",
                   "response_format": {"type": "json_object"}}),
            "tool_choice",
            "response_format",
        ),
        (
            json!({"tools": [weather()], "tool_choice": "always"}),
            "tool_choice",
            "required",
        ),
        (
            json!({"tools": [weather()], "tool_choice": "required",
                   "add_generation_prompt": false}),
            "tool_choice",
            "generation prompt",
        ),
        (
            json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant",
                   "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{broken"}}]}]}),
            "messages[1].tool_calls[0]",
            "JSON object",
        ),
    ] {
        let (status, body) = request(
            "POST",
            "/v1/chat/completions",
            ask(extra.clone()).to_string().as_bytes(),
        );
        assert_error(status, &body, 400, Some(param), &extra.to_string());
        assert!(body.contains(words), "{extra}: {body}");
    }
}

/// The tools are in the prompt with `auto` (more prompt tokens), left out with `none`; a
/// history of calls and results renders; a named or required choice appends a call's start
/// to the prompt, which begins the reply: the random model does not finish the call, so the
/// whole reply is content, never an error.
#[test]
fn tool_choice_shapes_the_prompt_and_the_reply() {
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let plain = chat(&ask(json!({})));
    let auto = chat(&ask(json!({"tools": [weather()]})));
    let none = chat(&ask(json!({"tools": [weather()], "tool_choice": "none"})));
    assert!(tokens(&auto) > tokens(&plain) + 20, "{auto}");
    assert_eq!(tokens(&none), tokens(&plain));
    assert_eq!(
        none["choices"][0]["message"],
        plain["choices"][0]["message"]
    );

    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
          "type": "function", "function": {"name": "get_weather",
          "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]);
    let after = chat(&ask(json!({"tools": [weather()], "messages": history})));
    assert!(tokens(&after) > tokens(&auto) + 10, "{after}");
    let message = &after["choices"][0]["message"];
    assert_eq!(message["role"], "assistant");
    assert!(message["content"].is_string(), "{message}");

    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, prefix) in [
        (named, "<function name=\"get_weather\">"),
        (json!("required"), "<function name=\""),
    ] {
        let forced = chat(&ask(json!({"tools": [weather()], "tool_choice": choice})));
        assert!(tokens(&forced) > tokens(&auto), "{forced}");
        let c = &forced["choices"][0];
        assert_eq!(c["finish_reason"], "length", "{forced}");
        assert!(c["message"].get("tool_calls").is_none(), "{forced}");
        let content = c["message"]["content"].as_str().unwrap();
        assert!(content.starts_with(prefix), "{content:?}");

        // Streamed: the same reply, held until it is known to be no call.
        let mut body = ask(json!({"tools": [weather()], "tool_choice": choice,
                                  "stream": true}));
        body["stream_options"] = json!({"include_usage": true});
        let (status, text) = request_to(
            long_server(),
            "POST",
            "/v1/chat/completions",
            body.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{text}");
        let chunks = sse_chunks(&text);
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(streamed, content);
        let finish: Vec<_> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
            .collect();
        assert_eq!(finish, ["length"]);
        assert_eq!(chunks.last().unwrap()["usage"], forced["usage"]);
    }
}

/// Tools whose parameters a random model can finish: numbers, booleans, an enum, none.
fn countable() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "set_count", "parameters": {
            "type": "object", "properties": {
                "count": {"type": "integer"}, "fast": {"type": "boolean"},
                "mode": {"enum": ["up", "down"]}},
            "required": ["count", "mode"]}}}),
        json!({"type": "function", "function": {"name": "ping",
            "parameters": {"type": "object", "properties": {}}}}),
    ]
}

/// Checks one call's name and arguments against [`countable`]; returns its name.
fn check_call(call: &Value, what: &str) -> String {
    let f = &call["function"];
    let name = f["name"].as_str().unwrap().to_string();
    let args: Value = serde_json::from_str(f["arguments"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("{what}: {e}: {call}"));
    match name.as_str() {
        "set_count" => {
            assert!(
                args["count"].is_i64() || args["count"].is_u64(),
                "{what}: {args}"
            );
            assert!(
                ["up", "down"].contains(&args["mode"].as_str().unwrap()),
                "{what}"
            );
            assert!(
                args.get("fast").is_none_or(Value::is_boolean),
                "{what}: {args}"
            );
        }
        "ping" => assert_eq!(args, json!({}), "{what}"),
        other => panic!("{what}: a call to {other}"),
    }
    name
}

/// With `required` or a named function the reply is constrained to calls: even the random
/// model's comes back as parsed `tool_calls` with `finish_reason` "tool_calls", whole and
/// streamed; a named choice calls that function; `parallel_tool_calls: false` makes one.
/// With parallel calls the random model may go on making calls until `max_tokens` cuts it
/// (finish "length", the unfinished call as content), but the finished ones are parsed.
#[test]
fn a_required_or_named_choice_makes_the_reply_tool_calls() {
    let named = json!({"type": "function", "function": {"name": "set_count"}});
    for (choice, parallel, seed) in [
        (named.clone(), false, 1),
        (json!("required"), false, 2),
        (named, true, 3),
        (json!("required"), true, 4),
    ] {
        let what = format!("{choice} parallel {parallel}");
        let body = json!({
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "Count up to three."}],
            "tools": countable(), "tool_choice": choice, "parallel_tool_calls": parallel,
            "max_tokens": 200, "temperature": 1.0, "seed": seed,
        });
        let v = chat(&body);
        let c = &v["choices"][0];
        let finish = if parallel && c["finish_reason"] == "length" {
            "length"
        } else {
            "tool_calls"
        };
        assert_eq!(c["finish_reason"], finish, "{what}: {v}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{what}: {v}");
        if !parallel {
            assert_eq!(calls.len(), 1, "{what}: {v}");
        }
        let names: Vec<String> = calls.iter().map(|x| check_call(x, &what)).collect();
        if choice.is_object() {
            assert!(names.iter().all(|n| n == "set_count"), "{what}: {names:?}");
        }

        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, text) = request_to(
            long_server(),
            "POST",
            "/v1/chat/completions",
            streamed.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{text}");
        let chunks = sse_chunks(&text);
        let heads: Vec<String> = chunks
            .iter()
            .filter_map(|ch| {
                ch["choices"][0]["delta"]["tool_calls"][0]["function"]["name"].as_str()
            })
            .map(String::from)
            .collect();
        assert_eq!(heads, names, "{what}: {text}");
        let finishes: Vec<_> = chunks
            .iter()
            .filter_map(|ch| ch["choices"][0]["finish_reason"].as_str())
            .collect();
        assert_eq!(finishes, [finish], "{what}");
    }
}
