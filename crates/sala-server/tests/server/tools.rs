//! Tool calling through the real server: the request's tools checked, rendered by the
//! checkpoint's template (the test template has MiniCPM's tools semantics), a tool-call
//! history accepted, and `tool_choice` shaping the prompt. The random model writes no calls
//! of its own: the parsing of calls is tested on scripted replies (the crate's unit tests).

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
