//! Grammars (llguidance's Lark syntax) that hold tool calls in the model's dialect,
//! `<function name="NAME"><param name="KEY">VALUE</param>...</function>`, to the tools'
//! schemas:
//!
//! - [`call_grammar`] (`tool_choice` `required` or named): the reply after its prefix (the
//!   start of a call that ends the prompt, see [`super::check_tools`]) is one call or more
//!   (one with `parallel_tool_calls: false`) to the tools (the named one).
//! - [`strict_grammar`] (`auto`, when a function has `strict: true`): the reply is free text,
//!   but a call the model opens to a strict function (`<function name="NAME">` in any form
//!   the parser reads) is held to that function's schema; reasoning (a leading
//!   `<think>…</think>`) is free too.
//!
//! A call's parameters are its schema's `properties`, in their order, the `required` ones
//! present; a function whose schema lists none takes none. Each value is written so that the
//! parser ([`super::parse`]) reads back a value its schema allows:
//!
//! - `enum` or `const`: one of its values, in a form that reads back as that value;
//! - a schema that allows no string (integers, numbers, booleans, null, objects, arrays):
//!   JSON of that schema (`%json`, nested objects and arrays held to their own schemas), laid
//!   out as Python's `json.dumps` writes it;
//! - otherwise text: plain (anything up to `</param>` that does not open a CDATA section;
//!   read back trimmed, XML entities decoded) or a CDATA section (anything without `]]>`;
//!   read back exactly). A strict function's string also keeps its `minLength`, `maxLength`
//!   and `pattern`, in either form (plain text then without `<`, `&` or whitespace at its
//!   ends, so that it reads back as written).
//!
//! Integers and numbers without bounds are kept within ±(10^18 − 1) and ±10^15 (no exponent),
//! so that each reads back as the number written. Not enforced: string `format`s, and a
//! non-strict function's string lengths and patterns.
//! A strict function's schema with keywords llguidance does not support is an error; a
//! non-strict one's are ignored.

use super::parse::read_back_as;
use super::{ToolChoice, ToolDef, ToolSet};
use crate::api::ApiError;
use sala_engine::grammar::{widest_row, MAX_ROW};
use serde_json::{json, Value};

/// Whether `key` may be written as a parameter name (inside `name="…"`, as a Lark string).
fn plain_key(key: &str) -> bool {
    !key.is_empty()
        && !key
            .chars()
            .any(|c| matches!(c, '"' | '\'' | '<' | '>' | '&' | '\\') || c.is_control())
}

/// A Lark string literal of `text`.
fn lit(text: &str) -> String {
    serde_json::to_string(text).expect("a string serializes")
}

/// `text` with `<`, `>` and `&` as XML entities.
fn entities(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// `regex` for a Lark `/…/` literal: its unescaped slashes escaped.
fn slashes(regex: &str) -> String {
    let mut out = String::with_capacity(regex.len());
    let mut escaped = false;
    for c in regex.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

/// A JSON schema `pattern` (a search, anchored or not) as a regex of whole strings.
fn whole_match(pattern: &str) -> String {
    let body = pattern.strip_prefix('^');
    let anchored_start = body.is_some();
    let body = body.unwrap_or(pattern);
    let ends_escaped = body
        .strip_suffix('$')
        .is_some_and(|b| b.chars().rev().take_while(|&c| c == '\\').count() % 2 == 1);
    let (body, anchored_end) = match body.strip_suffix('$') {
        Some(b) if !ends_escaped => (b, true),
        _ => (body, false),
    };
    format!(
        "{}(?:{body}){}",
        if anchored_start { "" } else { "(?s:.*)" },
        if anchored_end { "" } else { "(?s:.*)" },
    )
}

/// The layout of generated JSON: `json.dumps`'s, no free whitespace (see
/// [`sala_engine::grammar`]); `lenient`: keywords llguidance does not support are ignored.
fn json_layout(lenient: bool) -> Value {
    json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false,
        "lenient": lenient,
    })
}

/// Largest integer a JSON value may hold when its schema gives no bound: 18 digits, within
/// what reads back as an integer.
const INT_BOUND: i64 = 999_999_999_999_999_999;
/// Largest number likewise: llguidance writes a bounded number without an exponent.
const NUMBER_BOUND: f64 = 1e15;

/// Gives every integer and number in `schema` (its subschemas too) the bounds it lacks, so
/// that no value is too large to read back as a number (an exponent such as `e400` would).
fn bound_numbers(schema: &mut Value, depth: usize) {
    let Some(map) = schema.as_object_mut() else {
        return;
    };
    if depth > 32 {
        return;
    }
    let types: Vec<String> = match map.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(|t| t.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    };
    let integer = types.iter().any(|t| t == "integer");
    if integer || types.iter().any(|t| t == "number") {
        let (low, high) = if integer {
            (json!(-INT_BOUND), json!(INT_BOUND))
        } else {
            (json!(-NUMBER_BOUND), json!(NUMBER_BOUND))
        };
        if !map.contains_key("minimum") && !map.contains_key("exclusiveMinimum") {
            map.insert("minimum".into(), low);
        }
        if !map.contains_key("maximum") && !map.contains_key("exclusiveMaximum") {
            map.insert("maximum".into(), high);
        }
    }
    for (key, sub) in map.iter_mut() {
        match key.as_str() {
            "items"
            | "additionalProperties"
            | "not"
            | "contains"
            | "if"
            | "then"
            | "else"
            | "propertyNames"
            | "unevaluatedProperties"
            | "unevaluatedItems" => {
                if sub.is_array() {
                    sub.as_array_mut()
                        .into_iter()
                        .flatten()
                        .for_each(|s| bound_numbers(s, depth + 1));
                } else {
                    bound_numbers(sub, depth + 1);
                }
            }
            "prefixItems" | "anyOf" | "oneOf" | "allOf" => {
                sub.as_array_mut()
                    .into_iter()
                    .flatten()
                    .for_each(|s| bound_numbers(s, depth + 1));
            }
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                sub.as_object_mut()
                    .into_iter()
                    .flat_map(|m| m.values_mut())
                    .for_each(|s| bound_numbers(s, depth + 1));
            }
            _ => {}
        }
    }
}

/// Builds a grammar's rules.
struct Lark {
    out: String,
    /// Rules made so far (for unique names).
    made: usize,
}

impl Lark {
    fn new() -> Self {
        Self {
            out: String::new(),
            made: 0,
        }
    }

    fn line(&mut self, line: &str) {
        self.out.push_str(line);
        self.out.push('\n');
    }

    fn fresh(&mut self) -> usize {
        self.made += 1;
        self.made
    }

    /// The rule of parameter `key`'s value and the `</param>` after it.
    fn value(&mut self, tool: &ToolDef, key: &str) -> String {
        let schema = tool.param_schema(key).unwrap_or(&Value::Bool(true));
        if let Some(rule) = self.choices(tool, key, schema) {
            return rule;
        }
        if tool.json_valued(key) {
            let mut sub = schema.clone();
            if let (Value::Object(sub), Some(Value::Object(root))) = (&mut sub, &tool.parameters) {
                // The root's definitions, for the references inside.
                for defs in ["$defs", "definitions"] {
                    if let Some(d) = root.get(defs) {
                        sub.entry(defs).or_insert_with(|| d.clone());
                    }
                }
                sub.insert("x-guidance".into(), json_layout(!tool.strict));
            }
            if !sub.is_object() {
                sub = json!({"x-guidance": json_layout(!tool.strict)});
            }
            bound_numbers(&mut sub, 0);
            return format!("%json {sub} \"</param>\"");
        }
        if tool.strict {
            if let Some(rule) = self.bounded_text(schema) {
                return rule;
            }
        }
        "text_value".into()
    }

    /// The alternatives of an `enum` or `const`: each value in the first form that reads back
    /// as it. `None` when there is none, or no value can be written.
    fn choices(&self, tool: &ToolDef, key: &str, schema: &Value) -> Option<String> {
        let values: Vec<&Value> = match (schema.get("enum"), schema.get("const")) {
            (Some(Value::Array(list)), _) => list.iter().collect(),
            (_, Some(v)) => vec![v],
            _ => return None,
        };
        // The parameter's reading, once: each value's forms are read back as it says.
        let (json, types) = (tool.json_valued(key), tool.param_types(key));
        let mut words = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for v in values {
            let forms = match v {
                Value::String(s) => {
                    let mut f = vec![s.clone(), entities(s)];
                    if !s.contains("]]>") {
                        f.push(format!("<![CDATA[{s}]]>"));
                    }
                    f.push(entities(&v.to_string()));
                    f
                }
                _ => vec![v.to_string(), pretty(v)],
            };
            if let Some(form) = forms
                .into_iter()
                .find(|f| read_back_as(json, &types, f).as_ref() == Some(v))
            {
                let word = lit(&format!("{form}</param>"));
                if seen.insert(word.clone()) {
                    words.push(word);
                }
            }
        }
        (!words.is_empty()).then(|| format!("({})", words.join(" | ")))
    }

    /// The rule of a string with `minLength`, `maxLength` or `pattern`, or `None` when it has
    /// none of them.
    fn bounded_text(&mut self, schema: &Value) -> Option<String> {
        let count = |k: &str| schema.get(k).and_then(Value::as_u64);
        let (min, max) = (count("minLength"), count("maxLength"));
        let pattern = schema.get("pattern").and_then(Value::as_str);
        let mut parts = Vec::new();
        if min.is_some() || max.is_some() {
            let max = max.map_or(String::new(), |m| m.to_string());
            parts.push(format!("/(?s:.{{{},{max}}})/", min.unwrap_or(0)));
        }
        if let Some(p) = pattern {
            parts.push(format!("/{}/", slashes(&whole_match(p))));
        }
        if parts.is_empty() {
            return None;
        }
        let n = self.fresh();
        let r = parts.join(" & ");
        self.line(&format!("s{n}: s{n}_plain | s{n}_cdata"));
        self.line(&format!("s{n}_plain[lazy]: S{n}_PLAIN"));
        self.line(&format!(
            "S{n}_PLAIN: ({r} & /([^<&\\s]([^<&]*[^<&\\s])?)?/) \"</param>\""
        ));
        self.line(&format!("s{n}_cdata[lazy]: S{n}_CDATA"));
        self.line(&format!(
            "S{n}_CDATA: \"<![CDATA[\" ({r} & CDATA_TEXT) \"]]></param>\""
        ));
        Some(format!("s{n}"))
    }

    /// The rule `body_{i}` of tool `t`: its parameters in the schema's order, the required
    /// ones present, then `</function>`.
    fn body(&mut self, i: usize, t: &ToolDef) -> Result<(), ApiError> {
        let params = t.parameters.as_ref();
        let row = params.map_or(0, widest_row);
        if row > MAX_ROW {
            let param = format!("tools[{i}].function.parameters");
            return Err(ApiError::invalid(format!(
                "{param} lets about {row} alternatives follow at one place of a call (an \
                 object's optional properties, about four each, and the alternatives of anyOf, \
                 oneOf and enum); a call the grammar holds to its schema (tool_choice required \
                 or named, or a strict function) can have at most {MAX_ROW}"
            ))
            .param(param));
        }
        let props = params
            .and_then(|p| p.get("properties"))
            .and_then(Value::as_object);
        // A set: a list looked up for each parameter took quadratic time.
        let required: std::collections::HashSet<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut parts = Vec::new();
        for key in props.into_iter().flat_map(|p| p.keys()) {
            if !plain_key(key) {
                if t.strict {
                    return Err(ApiError::invalid(format!(
                        "the strict function {:?} has the parameter {key:?}, whose name cannot \
                         be written in the model's calls (it holds a quote, <, >, & or \\)",
                        t.name
                    ))
                    .param("tools"));
                }
                continue;
            }
            // A strict function's parameter whose schema is `false` takes no value: left out,
            // and a request that requires it can never be answered.
            if t.strict && t.param_schema(key) == Some(&Value::Bool(false)) {
                if required.contains(&key.as_str()) {
                    return Err(ApiError::invalid(format!(
                        "the strict function {:?} requires the parameter {key:?}, whose schema \
                         is false: no value can satisfy it",
                        t.name
                    ))
                    .param("tools"));
                }
                continue;
            }
            let open = lit(&format!("<param name=\"{key}\">"));
            let one = format!("({open} {})", self.value(t, key));
            parts.push(if required.contains(&key.as_str()) {
                one
            } else {
                format!("{one}?")
            });
        }
        parts.push("\"</function>\"".into());
        self.line(&format!("body_{i}: {}", parts.join(" ")));
        Ok(())
    }

    /// The rules every grammar shares.
    fn finish(mut self) -> String {
        self.line("text_value: text_plain | text_cdata");
        self.line("text_plain[lazy]: TEXT_PLAIN");
        self.line(r#"TEXT_PLAIN: (/(?s:.*)/ & ~/\s*<!\[CDATA\[(?s:.*)/) "</param>""#);
        self.line("text_cdata[lazy]: TEXT_CDATA");
        self.line(r#"TEXT_CDATA: "<![CDATA[" CDATA_TEXT "]]></param>""#);
        self.line(r#"CDATA_TEXT: /(?s:.*)/ & ~/(?s:.*)\]\]>(?s:.*)/"#);
        self.out
    }
}

/// `v` as JSON laid out as Python's `json.dumps` writes it.
pub(crate) fn pretty(v: &Value) -> String {
    match v {
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(pretty).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), pretty(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        v => v.to_string(),
    }
}

/// The Lark grammar of the reply after the prefix `<function name="` (`required`) or
/// `<function name="NAME">` (named), for `tools`; `max_calls` 1 allows one call only.
pub fn call_grammar(
    tools: &ToolSet,
    choice: &ToolChoice,
    max_calls: usize,
) -> Result<Option<String>, ApiError> {
    let allowed: Vec<(usize, &ToolDef)> = match choice {
        ToolChoice::Required => tools.tools.iter().enumerate().collect(),
        ToolChoice::Named(name) => tools
            .tools
            .iter()
            .enumerate()
            .filter(|(_, t)| &t.name == name)
            .collect(),
        ToolChoice::None | ToolChoice::Auto => return Ok(None),
    };
    let mut g = Lark::new();
    let more = if max_calls > 1 {
        " (\"\\n\"? call)*"
    } else {
        ""
    };
    let first = match choice {
        ToolChoice::Named(_) => format!("body_{}", allowed[0].0),
        _ => allowed
            .iter()
            .map(|(i, t)| format!("{} body_{i}", lit(&format!("{}\">", t.name))))
            .collect::<Vec<_>>()
            .join(" | "),
    };
    g.line(&format!("start: ({first}){more}"));
    let calls: Vec<String> = allowed
        .iter()
        .map(|(i, t)| {
            format!(
                "{} body_{i}",
                lit(&format!("<function name=\"{}\">", t.name))
            )
        })
        .collect();
    g.line(&format!("call: {}", calls.join(" | ")));
    for (i, t) in &allowed {
        g.body(*i, t)?;
    }
    Ok(Some(g.finish()))
}

/// The opening of a call to `name` in any form the parser reads, as a regex.
fn opening(name: &str) -> String {
    format!(r#"<function\s+name=("{name}"|'{name}')\s*>"#)
}

/// The Lark grammar of a reply under `tool_choice` `auto` when some of `tools` are strict
/// (`None` when none is): free text in which a call opened to a strict function follows its
/// schema.
pub fn strict_grammar(tools: &ToolSet) -> Result<Option<String>, ApiError> {
    let strict: Vec<(usize, &ToolDef)> = tools
        .tools
        .iter()
        .enumerate()
        .filter(|(_, t)| t.strict)
        .collect();
    if strict.is_empty() {
        return Ok(None);
    }
    let mut g = Lark::new();
    // Reasoning first is free (closed or not); the first text may not open reasoning.
    g.line("start: thought rest | rest0 | UNCLOSED_THOUGHT");
    g.line("thought[lazy]: THOUGHT");
    g.line(r"THOUGHT: /\s*<think>(?s:.*)<\/think>/");
    g.line(r"UNCLOSED_THOUGHT: /\s*<think>/ (/(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/)");
    g.line(r"THINK_START: /\s*<think>(?s:.*)/");
    g.line("rest: seg* tail");
    g.line("rest0: seg0 rest | tail0");
    let any_opening = strict
        .iter()
        .map(|(_, t)| opening(&t.name))
        .collect::<Vec<_>>()
        .join("|");
    g.line(&format!(
        "TAIL: /(?s:.*)/ & ~/(?s:.*)({any_opening})(?s:.*)/"
    ));
    g.line("tail: TAIL");
    g.line("tail0: TAIL0");
    g.line("TAIL0: TAIL & ~THINK_START");
    let mut segs = Vec::new();
    let mut segs0 = Vec::new();
    for (i, t) in &strict {
        g.line(&format!("HEAD_{i}: /(?s:.*){}/", opening(&t.name)));
        g.line(&format!("head_{i}[lazy]: HEAD_{i}"));
        g.line(&format!("head0_{i}[lazy]: HEAD_{i} & ~THINK_START"));
        segs.push(format!("head_{i} body_{i}"));
        segs0.push(format!("head0_{i} body_{i}"));
        g.body(*i, t)?;
    }
    g.line(&format!("seg: {}", segs.join(" | ")));
    g.line(&format!("seg0: {}", segs0.join(" | ")));
    Ok(Some(g.finish()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn set(tools: Value) -> ToolSet {
        ToolSet::new(tools.as_array().unwrap()).unwrap()
    }

    #[test]
    fn the_grammar_names_the_tools_and_their_parameters() {
        let set = set(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "unit": {"enum": ["c", "f"]}, "bad\"key": {}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]));
        let g = call_grammar(&set, &ToolChoice::Required, usize::MAX)
            .unwrap()
            .unwrap();
        assert!(
            g.contains(r#""get_weather\">" body_0 | "now\">" body_1"#),
            "{g}"
        );
        assert!(
            g.contains(r#"("<param name=\"city\">" text_value) ("#),
            "{g}"
        );
        assert!(
            g.contains(r#"("<param name=\"days\">" %json {"type":"integer""#),
            "{g}"
        );
        assert!(g.contains(r#"("c</param>" | "f</param>")"#), "{g}");
        assert!(!g.contains("bad"), "{g}");
        assert!(g.contains("body_1: \"</function>\""), "{g}");
        let named = call_grammar(&set, &ToolChoice::Named("now".into()), 1)
            .unwrap()
            .unwrap();
        assert!(named.starts_with("start: (body_1)\n"), "{named}");
        assert!(!named.contains("get_weather"), "{named}");
        assert_eq!(call_grammar(&set, &ToolChoice::Auto, 1).unwrap(), None);
        assert_eq!(strict_grammar(&set).unwrap(), None);
    }

    #[test]
    fn enum_values_are_written_to_read_back() {
        let set = set(
            json!([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {
                "any": {"enum": ["1", 1, " pad", "a<b", "x]]>&amp;", null]},
                "s": {"type": "string", "enum": ["1", "true"]}}}}}]),
        );
        let g = call_grammar(&set, &ToolChoice::Required, 1)
            .unwrap()
            .unwrap();
        for word in [
            // A string that reads as JSON is quoted; spaces at its ends go in CDATA, an
            // entity's text with `]]>` in entities.
            r#""\"1\"</param>""#,
            r#""1</param>""#,
            r#""<![CDATA[ pad]]></param>""#,
            r#""a<b</param>""#,
            r#""x]]&gt;&amp;amp;</param>""#,
            r#""null</param>""#,
            // A string parameter keeps its text as it is.
            r#"("1</param>" | "true</param>")"#,
        ] {
            assert!(g.contains(word), "{word} in {g}");
        }
    }

    #[test]
    fn strict_strings_keep_their_bounds_and_patterns() {
        let set = set(
            json!([{"type": "function", "function": {"name": "f", "strict": true,
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}/[0-9]+$", "maxLength": 8},
                "free": {"type": "string"}}}}}]),
        );
        let g = call_grammar(&set, &ToolChoice::Required, 1)
            .unwrap()
            .unwrap();
        assert!(g.contains(r"/(?s:.{0,8})/ & /(?:[A-Z]{3}\/[0-9]+)/"), "{g}");
        assert!(g.contains(r#"("<param name=\"free\">" text_value)"#), "{g}");
        assert_eq!(whole_match("ab"), "(?s:.*)(?:ab)(?s:.*)");
        assert_eq!(whole_match(r"^a\$"), r"(?:a\$)(?s:.*)");
        assert_eq!(slashes(r"a/b\/c"), r"a\/b\/c");
    }

    /// The test tokenizer's grammars (one per test process).
    fn grammars() -> &'static (sala_engine::grammar::Grammars, sala_tokenizer::Tokenizer) {
        use std::sync::OnceLock;
        static G: OnceLock<(sala_engine::grammar::Grammars, sala_tokenizer::Tokenizer)> =
            OnceLock::new();
        G.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            sala_tokenizer::write_test_tokenizer(dir.path(), 1024).unwrap();
            let tok = sala_tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
            let g = sala_engine::grammar::Grammars::new(tok.clone(), 1024, tok.eos_ids());
            (g, tok)
        })
    }

    /// Feeds `text` to `grammar` a byte at a time: whether the whole text is taken and the
    /// grammar may end there; `Err` with the text taken when a byte is refused.
    pub(crate) fn accepts(grammar: &str, text: &str) -> Result<bool, String> {
        use sala_engine::grammar::{Constraint, GrammarSpec};
        let (g, tok) = grammars();
        let spec = GrammarSpec::Lark {
            grammar: grammar.into(),
            param: "tools".into(),
        };
        let mut c = Constraint::from(
            g.compile(&spec)
                .unwrap_or_else(|e| panic!("{e}\n{grammar}")),
        );
        for (i, b) in text.bytes().enumerate() {
            let id = tok.token_to_id(&format!("<0x{b:02X}>")).unwrap();
            let mut logits = vec![0.0f32; 1024];
            let refused = c.apply(&mut logits).is_err() || logits[id as usize] != 0.0;
            if refused || c.advance(id).is_err() {
                return Err(String::from_utf8_lossy(&text.as_bytes()[..i]).into_owned());
            }
        }
        Ok(c.is_accepting())
    }

    fn weather(strict: bool) -> ToolSet {
        set(json!([
            {"type": "function", "function": {"name": "get_weather", "strict": strict,
             "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "where": {"type": "object", "properties": {"lat": {"type": "number"},
                          "tags": {"type": "array", "items": {"type": "string"}}},
                          "required": ["lat"], "additionalProperties": false},
                "unit": {"$ref": "#/$defs/Unit"},
                "code": {"type": "string", "maxLength": 3}},
             "required": ["city", "days"], "$defs": {"Unit": {"enum": ["c", "f"]}}}}},
            {"type": "function", "function": {"name": "now"}},
        ]))
    }

    /// A forced call's values: text in either form, JSON held to its schema, enums.
    #[test]
    fn forced_calls_hold_to_the_schema() {
        let g = call_grammar(&weather(false), &ToolChoice::Required, usize::MAX)
            .unwrap()
            .unwrap();
        let call = |params: &str| format!("get_weather\">{params}</function>");
        let city = "<param name=\"city\">Paris</param><param name=\"days\">3</param>";
        for ok in [
            call(city),
            call("<param name=\"city\"> a < b &amp; c </param><param name=\"days\">1</param>"),
            call(
                "<param name=\"city\"><![CDATA[x</param>y]]></param><param name=\"days\">9</param>",
            ),
            call(&format!(
                "{city}<param name=\"where\">{{\"lat\": 1.5, \"tags\": [\"</param>\"]}}</param>\
                 <param name=\"unit\">f</param><param name=\"code\">long text</param>"
            )),
            format!("{}\n<function name=\"now\"></function>", call(city)),
        ] {
            assert_eq!(accepts(&g, &ok), Ok(true), "{ok}");
        }
        for bad in [
            // A missing required parameter, an unknown one, out of order.
            call("<param name=\"city\">Paris</param>"),
            call("<param name=\"town\">Paris</param>"),
            call("<param name=\"days\">3</param><param name=\"city\">Paris</param>"),
            // Values not of their schema: a CDATA section with text after it, a number out
            // of range or no number, an object without its required key, an enum's outsider.
            call("<param name=\"city\"><![CDATA[x]]>y</param><param name=\"days\">3</param>"),
            call("<param name=\"city\">P</param><param name=\"days\">10</param>"),
            call("<param name=\"city\">P</param><param name=\"days\">three</param>"),
            call(&format!(
                "{city}<param name=\"where\">{{\"tags\": []}}</param>"
            )),
            call(&format!(
                "{city}<param name=\"where\">{{\"lat\":1}}</param>"
            )),
            call(&format!("{city}<param name=\"unit\">k</param>")),
        ] {
            assert!(accepts(&g, &bad).is_err(), "{bad}");
        }
        // A non-strict function's string bounds are not enforced; a strict one's are.
        let long = call(&format!("{city}<param name=\"code\">abcd</param>"));
        assert_eq!(accepts(&g, &long), Ok(true));
        let strict = call_grammar(&weather(true), &ToolChoice::Required, 1)
            .unwrap()
            .unwrap();
        assert!(accepts(&strict, &long).is_err());
        for code in ["abc", "<![CDATA[a<b]]>", "a&b"] {
            let text = call(&format!("{city}<param name=\"code\">{code}</param>"));
            let want = if code == "a&b" { Err(()) } else { Ok(true) };
            assert_eq!(accepts(&strict, &text).map_err(|_| ()), want, "{code}");
        }
    }

    /// Under `auto`, text and calls to other functions are free; a call opened to a strict
    /// function, in any form the parser reads, follows its schema; reasoning is free.
    #[test]
    fn strict_calls_under_auto_follow_the_schema() {
        let g = strict_grammar(&weather(true)).unwrap().unwrap();
        let good = "<param name=\"city\">Oslo</param><param name=\"days\">2</param></function>";
        for ok in [
            String::new(),
            "Just text, a <b>tag</b> and <function name=\"now\">x</function>.".into(),
            format!("Let me look. <function name=\"get_weather\">{good} Done."),
            format!("<function  name='get_weather' >{good}\n<function name=\"get_weather\">{good}"),
            "<think>maybe <function name=\"get_weather\">?</think>Sure.".into(),
            "  <think>still thinking".into(),
        ] {
            assert_eq!(accepts(&g, &ok), Ok(true), "{ok}");
        }
        for bad in [
            "<function name=\"get_weather\"><param name=\"city\">Oslo</param></function>",
            "ok <function name='get_weather'>free text</function>",
            "<function\nname=\"get_weather\"><param name=\"days\">2</param>",
        ] {
            assert!(accepts(&g, bad).is_err(), "{bad}");
        }
        // An unfinished strict call cannot end the reply.
        let open = "<function name=\"get_weather\"><param name=\"city\">Oslo</param>";
        assert_eq!(accepts(&g, open), Ok(false));
    }

    /// Numbers without bounds stay small enough to read back as numbers, nested ones too.
    #[test]
    fn numbers_without_bounds_read_back() {
        let set = set(
            json!([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"},
                "x": {"type": "object", "properties": {"y": {"type": "number"}},
                      "required": ["y"]}},
            "required": ["n", "x"]}}}]),
        );
        let g = call_grammar(&set, &ToolChoice::Required, 1)
            .unwrap()
            .unwrap();
        let call = |n: &str, y: &str| {
            format!(
                "f\"><param name=\"n\">{n}</param><param name=\"x\">{{\"y\": {y}}}</param>\
                 </function>"
            )
        };
        assert_eq!(accepts(&g, &call("-12", "0.25")), Ok(true));
        assert!(accepts(&g, &call("99999999999999999999", "1")).is_err());
        assert!(accepts(&g, &call("1", "1e400")).is_err());
    }

    /// Many parameters, and many enums of many values, take time in proportion to their
    /// number (the required list was searched for each parameter, and each enum value's forms
    /// read the parameter's whole schema again: seconds each).
    #[test]
    fn large_tools_make_their_grammar_in_linear_time() {
        let values: Vec<u32> = (0..1024).collect();
        for (count, schema) in [
            (60_000, json!({"type": "string"})),
            (200, json!({"enum": values})),
        ] {
            let properties: serde_json::Map<String, Value> = (0..count)
                .map(|i| (format!("p{i}"), schema.clone()))
                .collect();
            let required: Vec<&String> = properties.keys().collect();
            let set = set(
                json!([{"type": "function", "function": {"name": "f", "parameters":
                {"type": "object", "properties": properties, "required": required}}}]),
            );
            let started = std::time::Instant::now();
            call_grammar(&set, &ToolChoice::Required, 1)
                .unwrap()
                .unwrap();
            // About 0.15 s each here; 2.5 s for the 60,000 before the fix.
            let took = started.elapsed();
            assert!(
                took < std::time::Duration::from_millis(1200),
                "{count}: {took:?}"
            );
        }
    }
}
