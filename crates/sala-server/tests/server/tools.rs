//! Tool calling through the real server: the request's tools checked, rendered by the
//! checkpoint's template (the test template has MiniCPM's tools semantics), a tool-call
//! history accepted, and `tool_choice` shaping the prompt. The random model writes no calls
//! of its own (the parsing of calls is tested on scripted replies, the crate's unit tests),
//! except where a required or named `tool_choice` constrains its reply to calls.

use crate::common::*;
use sala_model::numerics::TestRng;
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}})
}

/// A strict function `f` of the parameters `properties`, all required.
fn strict(properties: Value) -> Value {
    let required: Vec<&String> = properties.as_object().unwrap().keys().collect();
    json!({"type": "function", "function": {"name": "f", "strict": true, "parameters": {
        "type": "object", "properties": properties, "required": required,
        "additionalProperties": false}}})
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
    let wide: Vec<String> = (0..1025).map(|j| format!("v{j}")).collect();
    let wide_tool = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"x": {"enum": wide}}, "required": ["x"]}}});
    for (extra, param, words) in [
        (
            json!({"tools": [wide_tool], "tool_choice": "required"}),
            "tools[0].function.parameters",
            "1025 alternatives",
        ),
        // Calls whose next parameter may be any of 1000 would fail mid-generation.
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                crate::structured::optional_properties(1000)}}], "tool_choice": "required"}),
            "tools[0].function.parameters",
            "about 4007 alternatives",
        ),
        // Strict schemas that name no type are checked as JSON schemas, not taken as text.
        (
            json!({"tools": [strict(json!({"x": {"type": 12}}))]}),
            "tools[0].function.parameters",
            "type must be a string",
        ),
        // Not strict either: a type no JSON value has.
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                {"type": "object", "properties": {"x": {"type": "objectx"}}}}}],
                "tool_choice": "required"}),
            "tools[0].function.parameters",
            "objectx\\\" at \\\"/properties/x/type",
        ),
        (
            json!({"tools": [strict(json!({"x": {"$ref": "#/nope"}}))]}),
            "tools[0].function.parameters",
            "nope",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true,
                "parameters": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                "required": ["x"]}}}], "tool_choice": "required"}),
            "tools[0].function.parameters",
            "leads back to itself",
        ),
        (
            json!({"tools": [strict(json!({"x": {"allOf": [{"$ref": "#"}]}}))],
                   "tool_choice": "required"}),
            "tools[0].function.parameters",
            "infinitely nested",
        ),
        (
            json!({"tools": [strict(json!({"x": false}))]}),
            "tools",
            "no value can satisfy",
        ),
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
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}),
            "tools[0].function.strict",
            "true or false",
        ),
        (
            json!({"tools": [strict(json!({"tags": {"type": "array",
                   "items": {"type": "string", "format": "no-such-format"}}}))]}),
            "tools[0].function.parameters",
            "no-such-format",
        ),
        (
            json!({"tools": [strict(json!({"a\"b": {"type": "integer"}}))],
                   "tool_choice": "required"}),
            "tools",
            "cannot be written",
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

/// A random schema a random model can finish: bounded strings, numbers and arrays, nested up
/// to `depth`. `text_ok`: strings may be free text (a strict function's bounds hold there);
/// else they are enums.
fn random_schema(rng: &mut TestRng, depth: usize, text_ok: bool) -> Value {
    let max_len = 1 + rng.below(6);
    match rng.below(if depth == 0 { 7 } else { 9 }) {
        0 if text_ok => json!({"type": "string", "maxLength": max_len}),
        0 | 1 => {
            let words = ["up", "down", "a < b", " pad", "1"];
            json!({"enum": &words[..2 + rng.below(4)]})
        }
        2 => json!({"type": "integer", "minimum": -50, "maximum": 500}),
        3 => json!({"type": "number", "minimum": 0, "maximum": 10}),
        4 => json!({"type": "boolean"}),
        5 => json!({"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
        6 => {
            let values = [json!("x"), json!(3), json!(true)];
            json!({"const": values[rng.below(3)].clone()})
        }
        7 => json!({"type": "array", "maxItems": 2,
                    "items": random_schema(rng, depth - 1, true)}),
        _ => {
            let mut props = serde_json::Map::new();
            let mut required = Vec::new();
            for i in 0..1 + rng.below(2) {
                let key = format!("k{i}");
                if rng.below(2) == 0 {
                    required.push(key.clone());
                }
                props.insert(key, random_schema(rng, depth - 1, true));
            }
            json!({"type": "object", "properties": props, "required": required,
                   "additionalProperties": false})
        }
    }
}

/// Why `v` does not match `schema` (the keywords [`random_schema`] uses), or `None`.
fn mismatch(v: &Value, schema: &Value) -> Option<String> {
    let why = |what: &str| Some(format!("{v} is {what} of {schema}"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        return (!options.contains(v)).then(|| format!("{v} not in {schema}"));
    }
    if let Some(c) = schema.get("const") {
        return (c != v).then(|| format!("{v} is not {c}"));
    }
    let types: Vec<&str> = match &schema["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => return None,
    };
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    let in_range =
        |x: f64| num("minimum").is_none_or(|m| x >= m) && num("maximum").is_none_or(|m| x <= m);
    let fits = |t: &str| match (t, v) {
        ("null", Value::Null) | ("boolean", Value::Bool(_)) => true,
        ("integer", Value::Number(n)) => n.is_i64() && in_range(n.as_f64().unwrap()),
        ("number", Value::Number(n)) => in_range(n.as_f64().unwrap()),
        ("string", Value::String(s)) => {
            num("maxLength").is_none_or(|m| s.chars().count() as f64 <= m)
        }
        ("array", Value::Array(items)) => {
            num("maxItems").is_none_or(|m| items.len() as f64 <= m)
                && items
                    .iter()
                    .all(|x| mismatch(x, &schema["items"]).is_none())
        }
        ("object", Value::Object(map)) => {
            let props = schema["properties"].as_object().unwrap();
            map.iter()
                .all(|(k, x)| props.get(k).is_some_and(|s| mismatch(x, s).is_none()))
                && schema["required"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|k| map.contains_key(k.as_str().unwrap()))
        }
        _ => false,
    };
    if types.iter().any(|t| fits(t)) {
        None
    } else {
        why("not")
    }
}

/// Random tools, the random model and a required or named `tool_choice`: every reply is calls
/// that the parser reads back, each argument matching its parameter's schema, the required
/// ones present, no others. Strict functions' strings keep their `maxLength`; objects and
/// arrays their own schemas.
#[test]
fn forced_calls_of_random_tools_read_back_to_their_schemas() {
    let mut rng = TestRng::new(16);
    for trial in 0..10 {
        let tools: Vec<Value> = (0..1 + rng.below(3))
            .map(|t| {
                let strict = rng.below(2) == 1;
                let params = random_schema_object(&mut rng, strict);
                json!({"type": "function", "function": {"name": format!("tool_{t}"),
                       "strict": strict, "parameters": params}})
            })
            .collect();
        let named = rng.below(2) == 1;
        let choice = if named {
            json!({"type": "function", "function": {"name": "tool_0"}})
        } else {
            json!("required")
        };
        let parallel = rng.below(3) == 0;
        let body = json!({
            "model": MODEL_ID,
            "messages": [{"role": "user", "content": "Go."}],
            "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "max_tokens": 400, "temperature": 1.0, "seed": trial,
        });
        let what = format!("trial {trial}: {body}");
        let v = chat(&body);
        let c = &v["choices"][0];
        let calls = c["message"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !parallel || c["finish_reason"] != "length" {
            assert_eq!(c["finish_reason"], "tool_calls", "{what}: {v}");
            assert!(c["message"]["content"].is_null(), "{what}: {v}");
        }
        assert!(!calls.is_empty(), "{what}: {v}");
        if !parallel {
            assert_eq!(calls.len(), 1, "{what}: {v}");
        }
        for call in &calls {
            let name = call["function"]["name"].as_str().unwrap();
            if named {
                assert_eq!(name, "tool_0", "{what}");
            }
            let tool = tools
                .iter()
                .find(|t| t["function"]["name"] == name)
                .unwrap();
            let args: Value =
                serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            let params = &tool["function"]["parameters"];
            assert_eq!(mismatch(&args, params), None, "{what}: {call}");
        }
    }
}

/// A function's parameters: an object of 0 to 4 random parameters, some required.
fn random_schema_object(rng: &mut TestRng, text_ok: bool) -> Value {
    let mut props = serde_json::Map::new();
    let mut required = Vec::new();
    for i in 0..rng.below(5) {
        let key = format!("p{i}");
        if rng.below(2) == 0 {
            required.push(key.clone());
        }
        props.insert(key, random_schema(rng, 2, text_ok));
    }
    json!({"type": "object", "properties": props, "required": required,
           "additionalProperties": false})
}

/// Text a random "model" writes under `grammar`: the bytes of `script` first, each as long
/// as the grammar allows it, then tokens drawn uniformly from those the grammar allows, until
/// an end of sequence (drawn now and then once allowed) or `max_tokens`.
fn walk(grammar: &str, script: &str, rng: &mut TestRng, max_tokens: usize) -> String {
    use sala_engine::grammar::{Constraint, GrammarSpec, Grammars};
    use std::sync::OnceLock;
    static G: OnceLock<(Grammars, sala_tokenizer::Tokenizer)> = OnceLock::new();
    let (grammars, tok) = G.get_or_init(|| {
        let tok = sala_tokenizer::Tokenizer::from_dir(model_dir()).unwrap();
        (
            Grammars::new(tok.clone(), tok.vocab_size(), tok.eos_ids()),
            tok,
        )
    });
    let spec = GrammarSpec::Lark {
        grammar: grammar.into(),
        param: "tools".into(),
    };
    let mut c = Constraint::from(grammars.compile(&spec).unwrap());
    let vocab = tok.vocab_bytes();
    let eos = tok.eos_ids();
    let mut out = Vec::new();
    let mut script = script.as_bytes();
    for _ in 0..max_tokens {
        let mut logits = vec![0.0f32; vocab.len()];
        c.apply(&mut logits).unwrap();
        let allowed: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&i| logits[i as usize] == 0.0)
            .collect();
        let byte = |b: u8| tok.token_to_id(&format!("<0x{b:02X}>")).unwrap();
        let next = match script.first() {
            Some(&b) if allowed.contains(&byte(b)) => {
                script = &script[1..];
                byte(b)
            }
            _ => {
                script = &[];
                let ends: Vec<u32> = allowed
                    .iter()
                    .copied()
                    .filter(|i| eos.contains(i))
                    .collect();
                if !ends.is_empty() && rng.below(20) == 0 {
                    break;
                }
                let text: Vec<u32> = allowed.into_iter().filter(|i| !eos.contains(i)).collect();
                if text.is_empty() {
                    break;
                }
                text[rng.below(text.len())]
            }
        };
        out.extend_from_slice(&vocab[next as usize].bytes);
        if c.advance(next).unwrap() {
            break;
        }
    }
    String::from_utf8(out).unwrap()
}

/// Under `auto` with strict functions, text a random model writes (made to open calls to
/// strict functions, after text or reasoning) reads back with each strict call's arguments
/// matching its schema; the reply may end as it likes outside a call.
#[test]
fn strict_calls_under_auto_read_back_to_their_schemas() {
    use sala_engine::request::ChatEnding;
    use sala_server::tools::{check_tools, parse::ToolCallParser};
    let mut rng = TestRng::new(61);
    let mut strict_calls = 0;
    for trial in 0..16 {
        let tools: Vec<Value> = (0..1 + rng.below(3))
            .map(|t| {
                let strict = t == 0 || rng.below(2) == 1;
                let params = random_schema_object(&mut rng, strict);
                json!({"type": "function", "function": {"name": format!("tool_{t}"),
                       "strict": strict, "parameters": params}})
            })
            .collect();
        let req = check_tools(
            Some(tools.clone()),
            Some(&json!("auto")),
            None,
            ChatEnding::GenerationPrompt,
        )
        .unwrap();
        let grammar = req.grammar.unwrap();
        let opening = ["<function name=\"tool_0\">", "<function  name='tool_0'>"][rng.below(2)];
        let lead = [
            "",
            "Sure. ",
            "<think>Hmm, <function name=\"tool_0\">?</think>\n",
        ][rng.below(3)];
        let text = walk(&grammar, &format!("{lead}{opening}"), &mut rng, 400);
        let reading = req.reading.unwrap();
        let mut parser = ToolCallParser::new(reading.tools, usize::MAX);
        let mut calls = parser.push(&text).calls;
        calls.extend(parser.finish().calls);
        let what = format!("trial {trial}: {text:?} {tools:?}");
        assert!(calls.iter().any(|c| c.name == "tool_0"), "{what}");
        for call in &calls {
            let tool = tools
                .iter()
                .find(|t| t["function"]["name"] == call.name)
                .unwrap();
            if tool["function"]["strict"] == true {
                strict_calls += 1;
                let args: Value = serde_json::from_str(&call.arguments).unwrap();
                assert_eq!(
                    mismatch(&args, &tool["function"]["parameters"]),
                    None,
                    "{what}"
                );
            }
        }
    }
    assert!(strict_calls >= 16);
}

/// A strict function under `auto` is served (its calls held by the grammar, tested above);
/// with `response_format` the reply is the structured answer and no call is read from it.
#[test]
fn strict_functions_under_auto_and_structured_answers() {
    let tools = json!([strict(json!({"n": {"type": "integer"}})), weather()]);
    let v = chat(&ask(json!({"tools": tools, "max_tokens": 12})));
    let c = &v["choices"][0];
    assert!(c["message"]["content"].is_string(), "{v}");
    let mut body = ask(json!({"tools": tools, "max_tokens": 12, "stream": true}));
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = request_to(
        long_server(),
        "POST",
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{text}");
    let streamed: String = sse_chunks(&text)
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, c["message"]["content"].as_str().unwrap());

    let schema = json!({"type": "object", "properties": {"v": {"enum": [
        "<function name=\"get_weather\"><param name=\"city\">x</param></function>"]}},
        "required": ["v"], "additionalProperties": false});
    let v = chat(&ask(
        json!({"tools": [weather()], "max_tokens": 300, "ignore_eos": false,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}),
    ));
    let m = &v["choices"][0]["message"];
    assert!(m.get("tool_calls").is_none(), "{v}");
    let answer: Value = serde_json::from_str(m["content"].as_str().unwrap()).unwrap();
    assert!(
        answer["v"].as_str().unwrap().starts_with("<function"),
        "{v}"
    );
}

#[test]
fn alternatives_that_refer_back_to_their_schema_are_read_in_linear_time() {
    // 40 alternatives, each the parameter's own schema again: reading the parameter's types
    // path by path (8 deep) took 40^8 steps on a server thread, for the request's grammar.
    let mut alts: Vec<Value> = (0..40).map(|_| json!({"$ref": "#/properties/x"})).collect();
    alts.push(json!({"type": "integer"}));
    let tool = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"x": {"anyOf": alts}}, "required": ["x"]}}});
    let started = std::time::Instant::now();
    let body = ask(json!({"tools": [tool], "tool_choice": "required"}));
    let (status, v) = post_to(long_server(), "/v1/chat/completions", &body);
    // The grammar compiler may refuse the schema; what matters is a prompt answer.
    assert!(status == 200 || status == 400, "{status} {v}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
}

#[test]
fn a_prompt_too_long_for_its_tools_is_refused_before_their_grammar_is_compiled() {
    // 100,000 parameters: the grammar compiler spent about 20 s here on their call grammar,
    // to fail (too many symbols), before the prompt, far past the context, was refused.
    let addr = serve_with(
        spawn_engine(4),
        sala_server::ServerOptions {
            max_body_bytes: 4 << 20,
            ..Default::default()
        },
    );
    let properties: serde_json::Map<String, Value> = (0..100_000)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    let required: Vec<&String> = properties.keys().collect();
    let tool = json!({"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": properties, "required": required}}});
    let started = std::time::Instant::now();
    let body = ask(json!({"tools": [tool], "tool_choice": "required"}));
    let (status, v) = post_to(addr, "/v1/chat/completions", &body);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(15), "{took:?}");
}
