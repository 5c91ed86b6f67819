//! Tool calling in the model's own dialect.
//!
//! The request side ([`check_tools`]): OpenAI's `tools`, `tool_choice` and
//! `parallel_tool_calls` checked; the tools go to the chat template as its `tools` variable
//! (the OpenAI objects as given, as Hugging Face passes them), and the assistant messages'
//! `tool_calls` reach it with their `arguments` as objects ([`prepare_messages`]), as
//! Hugging Face templates expect.
//!
//! `tool_choice`:
//! - `none`: the tools are left out of the prompt and the reply is not read for calls: the
//!   model is not told of any tool, and all it writes is content.
//! - `auto` (the default with tools): the tools are in the prompt; calls in the reply are
//!   parsed ([`parse`]). When a function is `strict`, the reply is constrained
//!   ([`grammar::strict_grammar`]) so that a call opened to a strict function follows its
//!   schema; the rest stays free.
//! - `required` and a named function: the reply begins a call: its start ends the prompt,
//!   `<function name="` or `<function name="NAME">` after the assistant's header (a prefix
//!   the generated text continues; the parser reads the reply as that prefix plus the
//!   generated text), and the generated text is constrained ([`grammar`], llguidance) to
//!   finish that call and make only calls after it, to the tools (the named one), each value
//!   of its parameter's schema. A reply cut by `max_tokens` may still end inside a call.
//!
//! `parallel_tool_calls: false` keeps the first call of a reply and drops the rest.

pub mod args;
pub mod grammar;
pub mod parse;

use crate::api::{ApiError, MAX_TOOLS};
use sala_engine::grammar::{unknown_type, widest_choice, MAX_ALTERNATIVES};
use sala_engine::request::ChatEnding;
use sala_tokenizer::ChatMessage;
use serde_json::Value;
use std::sync::Arc;

/// One tool of a request, as the parser and the grammars need it.
#[derive(Debug)]
pub struct ToolDef {
    pub name: String,
    /// The `parameters` JSON schema, when given.
    parameters: Option<Value>,
    /// `strict: true`: its calls must match its schema exactly.
    pub strict: bool,
}

impl ToolDef {
    /// The schema of the parameter `key` (`parameters.properties[key]`), local `$ref`s
    /// followed.
    pub fn param_schema(&self, key: &str) -> Option<&Value> {
        let root = self.parameters.as_ref()?;
        let schema = root.get("properties")?.get(key)?;
        Some(args::resolve(schema, Some(root)))
    }

    /// The JSON types the parameter `key` allows ([`args::schema_types`]); empty: any.
    pub fn param_types(&self, key: &str) -> Vec<String> {
        args::schema_types(self.param_schema(key), self.parameters.as_ref())
    }

    /// Whether the parameter `key`'s values are JSON: its schema allows types and no string;
    /// or, for a strict function, names no type it allows (a reference, `anyOf`, a bad
    /// `type`), so that the JSON schema compiler checks it and writes its values.
    pub fn json_valued(&self, key: &str) -> bool {
        let types = self.param_types(key);
        if types.is_empty() {
            return self.strict;
        }
        !types.iter().any(|t| t == "string")
    }
}

/// The tools of a request, checked.
#[derive(Debug)]
pub struct ToolSet {
    tools: Vec<ToolDef>,
}

/// Whether `name` is a valid function name: OpenAI's rule, 1 to 64 of `a-z A-Z 0-9 _ -`.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ToolSet {
    /// Checks OpenAI `tools` entries: `{"type": "function", "function": {"name",
    /// "description"?, "parameters"?, "strict"?}}`, names valid and distinct, `strict` a
    /// boolean.
    pub fn new(list: &[Value]) -> Result<Self, ApiError> {
        if list.len() > MAX_TOOLS {
            return Err(ApiError::invalid(format!(
                "tools holds {} tools; at most {MAX_TOOLS} are allowed",
                list.len()
            ))
            .param("tools"));
        }
        let mut tools: Vec<ToolDef> = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let bad = |field: &str, what: &str| {
                let param = format!("tools[{i}]{field}");
                ApiError::invalid(format!("{param} {what}")).param(param)
            };
            if !tool.is_object() {
                return Err(bad("", "must be an object"));
            }
            match tool.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(bad(
                        ".type",
                        &format!("is {other:?}; only \"function\" tools are supported"),
                    ))
                }
                None => return Err(bad(".type", "must be \"function\"")),
            }
            let Some(f) = tool.get("function").filter(|f| f.is_object()) else {
                return Err(bad(".function", "must be an object"));
            };
            let name = match f.get("name").and_then(Value::as_str) {
                Some(n) if valid_name(n) => n,
                Some(n) => {
                    return Err(bad(
                        ".function.name",
                        &format!(
                            "is {n:?}; a function name is 1 to 64 letters, digits, \
                             underscores and dashes"
                        ),
                    ))
                }
                None => return Err(bad(".function.name", "must be a string")),
            };
            if tools.iter().any(|t| t.name == name) {
                return Err(bad(
                    ".function.name",
                    &format!("is {name:?}, the name of an earlier tool; names must differ"),
                ));
            }
            if f.get("description")
                .is_some_and(|d| !d.is_string() && !d.is_null())
            {
                return Err(bad(".function.description", "must be a string"));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => None,
                Some(p @ Value::Object(_)) => Some(p.clone()),
                Some(_) => return Err(bad(".function.parameters", "must be a JSON schema object")),
            };
            if let Some((at, t)) = parameters.as_ref().and_then(unknown_type) {
                return Err(bad(
                    ".function.parameters",
                    &format!(
                        "has the type {t} at {at:?}; a type must be a string naming one of \
                         null, boolean, object, array, number, string, integer, or a list of them"
                    ),
                ));
            }
            let widest = parameters.as_ref().map_or(0, widest_choice);
            if widest > MAX_ALTERNATIVES {
                return Err(bad(
                    ".function.parameters",
                    &format!(
                        "has an enum, anyOf or oneOf of {widest} alternatives; at most \
                         {MAX_ALTERNATIVES} are supported"
                    ),
                ));
            }
            let strict = match f.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(bad(".function.strict", "must be true or false")),
            };
            tools.push(ToolDef {
                name: name.to_string(),
                parameters,
                strict,
            });
        }
        Ok(Self { tools })
    }

    pub fn get(&self, name: &str) -> Option<&ToolDef> {
        self.tools.iter().find(|t| t.name == name)
    }
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

impl ToolChoice {
    fn parse(v: &Value) -> Result<Self, ApiError> {
        let bad = || {
            ApiError::invalid(
                "tool_choice must be \"none\", \"auto\", \"required\" or \
                 {\"type\": \"function\", \"function\": {\"name\": ...}}",
            )
            .param("tool_choice")
        };
        match v {
            Value::String(s) => match s.as_str() {
                "none" => Ok(Self::None),
                "auto" => Ok(Self::Auto),
                "required" => Ok(Self::Required),
                _ => Err(bad()),
            },
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(bad());
                }
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(bad)?;
                Ok(Self::Named(name.to_string()))
            }
            _ => Err(bad()),
        }
    }
}

/// How to read a chat reply for calls.
#[derive(Debug, Clone)]
pub struct CallReading {
    pub tools: Arc<ToolSet>,
    /// Calls to keep: all, or one with `parallel_tool_calls: false`.
    pub max_calls: usize,
}

/// What a chat request's tool fields ask for.
#[derive(Debug, Default)]
pub struct ToolRequest {
    /// The template's `tools`.
    pub template_tools: Option<Vec<Value>>,
    /// The start of a call the reply must begin with (`required`, named); empty otherwise.
    pub reply_prefix: String,
    /// How to read the reply for calls; `None`: it is all content.
    pub reading: Option<CallReading>,
    /// The grammar of the reply ([`grammar`]): calls (`required`, named), or text whose calls
    /// to strict functions follow their schemas (`auto`).
    pub grammar: Option<String>,
    /// The strict functions' parameter schemas, each with the field that holds it: the JSON
    /// schema compiler checks them whole before the request is queued (the call grammar
    /// compiles only the parts it writes, and some faults show only as it generates).
    pub strict_schemas: Vec<(String, Value)>,
}

impl ToolRequest {
    /// Whether the reply must be calls (`required`, named).
    pub fn forced(&self) -> bool {
        !self.reply_prefix.is_empty()
    }
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls` (see the module docs). An empty
/// `tools` list is no tools. `ending` is how the prompt ends: a forced call needs the
/// assistant's turn to begin.
pub fn check_tools(
    tools: Option<Vec<Value>>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<bool>,
    ending: ChatEnding,
) -> Result<ToolRequest, ApiError> {
    let tools = tools.filter(|t| !t.is_empty());
    let set = tools.as_deref().map(ToolSet::new).transpose()?;
    let choice = tool_choice.map(ToolChoice::parse).transpose()?;
    let (Some(tools), Some(set)) = (tools, set) else {
        return match choice {
            None => Ok(ToolRequest::default()),
            Some(_) => Err(ApiError::invalid(
                "tool_choice is given but tools is not: give the tools to choose from",
            )
            .param("tool_choice")),
        };
    };
    let choice = choice.unwrap_or(ToolChoice::Auto);
    let reply_prefix = match &choice {
        ToolChoice::None => return Ok(ToolRequest::default()),
        ToolChoice::Auto => String::new(),
        ToolChoice::Required => "<function name=\"".to_string(),
        ToolChoice::Named(name) => {
            if set.get(name).is_none() {
                return Err(ApiError::invalid(format!(
                    "tool_choice names the function {name:?}, which is not among the tools"
                ))
                .param("tool_choice"));
            }
            format!("<function name=\"{name}\">")
        }
    };
    if !reply_prefix.is_empty() && ending != ChatEnding::GenerationPrompt {
        return Err(ApiError::invalid(
            "a required or named tool_choice makes the assistant's reply begin with a call, so \
             it needs the generation prompt: it cannot be combined with \
             continue_final_message or add_generation_prompt false",
        )
        .param("tool_choice"));
    }
    let max_calls = if parallel_tool_calls == Some(false) {
        1
    } else {
        usize::MAX
    };
    let grammar = match choice {
        ToolChoice::Auto => grammar::strict_grammar(&set)?,
        _ => grammar::call_grammar(&set, &choice, max_calls)?,
    };
    let strict_schemas = set
        .tools
        .iter()
        .enumerate()
        .filter(|(_, t)| t.strict)
        .filter_map(|(i, t)| {
            let schema = t.parameters.clone()?;
            Some((format!("tools[{i}].function.parameters"), schema))
        })
        .collect();
    Ok(ToolRequest {
        template_tools: Some(tools),
        reply_prefix,
        grammar,
        strict_schemas,
        reading: Some(CallReading {
            tools: Arc::new(set),
            max_calls,
        }),
    })
}

/// Readies the messages' tool fields for the template: each assistant `tool_calls` entry must
/// hold a `function` with a `name` and `arguments` (a JSON object, or its text, which becomes
/// the object); a `tool` message's `tool_call_id`, when given, must be a string.
pub fn prepare_messages(messages: &mut [ChatMessage]) -> Result<(), ApiError> {
    for (i, m) in messages.iter_mut().enumerate() {
        if let Some(id) = m.extra.get("tool_call_id") {
            if !id.is_string() {
                let param = format!("messages[{i}].tool_call_id");
                return Err(ApiError::invalid(format!("{param} must be a string")).param(param));
            }
        }
        let Some(calls) = m.extra.get_mut("tool_calls") else {
            continue;
        };
        let calls = match calls {
            Value::Null => continue,
            Value::Array(calls) => calls,
            _ => {
                let param = format!("messages[{i}].tool_calls");
                return Err(ApiError::invalid(format!("{param} must be a list")).param(param));
            }
        };
        for (j, call) in calls.iter_mut().enumerate() {
            let at = format!("messages[{i}].tool_calls[{j}]");
            let bad = |what: &str| ApiError::invalid(format!("{at}{what}")).param(at.clone());
            let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) else {
                return Err(bad(".function must be an object"));
            };
            if !f.get("name").is_some_and(Value::is_string) {
                return Err(bad(".function.name must be a string"));
            }
            let args = match f.get("arguments") {
                None | Some(Value::Null) => Value::Object(Default::default()),
                Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                    Ok(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(bad(
                            ".function.arguments must be a JSON object, as text or as is",
                        ))
                    }
                },
                Some(v @ Value::Object(_)) => v.clone(),
                Some(_) => {
                    return Err(bad(
                        ".function.arguments must be a JSON object, as text or as is",
                    ))
                }
            };
            f.insert("arguments".into(), args);
        }
    }
    Ok(())
}

/// A new tool call id: `call_` and 24 random hex digits.
pub fn call_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    // Each `RandomState` has fresh random keys; the count makes two hashes of one differ.
    let state = std::collections::hash_map::RandomState::new();
    let mut a = state.build_hasher();
    a.write_u64(COUNT.fetch_add(1, Ordering::Relaxed));
    let mut b = state.build_hasher();
    b.write_u64(a.finish());
    format!("call_{:016x}{:08x}", a.finish(), b.finish() as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}}}}})
    }

    fn check(tools: Value, choice: Option<Value>) -> Result<ToolRequest, ApiError> {
        let tools: Option<Vec<Value>> = serde_json::from_value(tools).unwrap();
        check_tools(tools, choice.as_ref(), None, ChatEnding::GenerationPrompt)
    }

    #[test]
    fn tool_choice_sets_the_prompt_and_the_reading() {
        let auto = check(json!([weather()]), None).unwrap();
        assert_eq!(auto.template_tools.as_ref().unwrap().len(), 1);
        assert_eq!(auto.reply_prefix, "");
        assert!(auto.reading.is_some());
        let none = check(json!([weather()]), Some(json!("none"))).unwrap();
        assert!(none.template_tools.is_none() && none.reading.is_none());
        let required = check(json!([weather()]), Some(json!("required"))).unwrap();
        assert_eq!(required.reply_prefix, "<function name=\"");
        let named = check(
            json!([weather()]),
            Some(json!({"type": "function", "function": {"name": "get_weather"}})),
        )
        .unwrap();
        assert_eq!(named.reply_prefix, "<function name=\"get_weather\">");
        // No tools: no tool_choice; an empty list is no tools.
        assert!(check(json!(null), None).unwrap().reading.is_none());
        assert!(check(json!([]), None).unwrap().template_tools.is_none());
        let forced = check_tools(
            Some(vec![weather()]),
            Some(&json!("required")),
            None,
            ChatEnding::ContinueFinal,
        );
        assert_eq!(forced.unwrap_err().param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn bad_tools_are_named() {
        let many: Vec<Value> = (0..=MAX_TOOLS)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        let cases = [
            (json!([weather()]), Some(json!("sometimes")), "tool_choice"),
            (json!(null), Some(json!("auto")), "tool_choice"),
            (
                json!([weather()]),
                Some(json!({"type": "function", "function": {"name": "other"}})),
                "tool_choice",
            ),
            (json!([{"type": "code"}]), None, "tools[0].type"),
            (json!([1]), None, "tools[0]"),
            (json!([{"type": "function"}]), None, "tools[0].function"),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                None,
                "tools[0].function.name",
            ),
            (
                json!([weather(), weather()]),
                None,
                "tools[1].function.name",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                None,
                "tools[0].function.parameters",
            ),
            (Value::Array(many), None, "tools"),
        ];
        for (tools, choice, param) in cases {
            let e = check(tools.clone(), choice).unwrap_err();
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param), "{tools}: {}", e.message);
        }
        assert!(valid_name("get-weather_2") && !valid_name("") && !valid_name(&"a".repeat(65)));
    }

    #[test]
    fn assistant_tool_calls_reach_the_template_with_object_arguments() {
        let mut messages: Vec<ChatMessage> = serde_json::from_value(json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
              "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
        ]))
        .unwrap();
        prepare_messages(&mut messages).unwrap();
        assert_eq!(
            messages[0].extra["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        for bad in [
            json!({"role": "assistant", "tool_calls": {"a": 1}}),
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f",
                   "arguments": "[1]"}}]}),
            json!({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": 5, "content": "x"}),
        ] {
            let mut m: Vec<ChatMessage> = vec![serde_json::from_value(bad.clone()).unwrap()];
            let e = prepare_messages(&mut m).unwrap_err();
            assert!(e.param.unwrap().starts_with("messages[0]"), "{bad}");
        }
    }

    #[test]
    fn call_ids_differ() {
        let (a, b) = (call_id(), call_id());
        assert_ne!(a, b);
        assert!(a.starts_with("call_") && a.len() == 29, "{a}");
    }
}
