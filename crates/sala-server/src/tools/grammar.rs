//! The grammar a `required` or named `tool_choice` constrains the reply with: one call or
//! more (one with `parallel_tool_calls: false`) in the model's dialect,
//! `<function name="NAME"><param name="KEY">VALUE</param>...</function>`, the names those of
//! the tools (the named one's), the parameters those of each tool's schema in its order, the
//! required ones present. A value's form follows its schema: an integer, a number, a
//! boolean, one of an enum's strings, or any text without `<` (or a CDATA section without
//! `]`).
//!
//! The grammar continues the reply's prefix (the start of a call that ends the prompt, see
//! [`super::check_tools`]), in llguidance's Lark syntax.

use super::{ToolChoice, ToolDef, ToolSet};
use serde_json::Value;
use std::fmt::Write;

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

/// The rule of one value of schema `schema`.
fn value_rule(schema: Option<&Value>) -> String {
    let schema = schema.unwrap_or(&Value::Null);
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        let words: Option<Vec<String>> = options
            .iter()
            .map(|o| match o {
                Value::String(s) if !s.contains(['<', '&']) && !s.trim().is_empty() => Some(lit(s)),
                Value::Number(n) => Some(lit(&n.to_string())),
                Value::Bool(b) => Some(lit(&b.to_string())),
                _ => None,
            })
            .collect();
        if let Some(words) = words.filter(|w| !w.is_empty()) {
            return format!("({})", words.join(" | "));
        }
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("integer") => "v_int".into(),
        Some("number") => "v_num".into(),
        Some("boolean") => "v_bool".into(),
        _ => "v_text".into(),
    }
}

/// Writes the rule `params_{i}` of tool `t`: its parameters in the schema's order, the
/// required ones present (a schema without properties: any parameters, as text).
fn params_rule(out: &mut String, i: usize, t: &ToolDef) {
    let props = t
        .parameters
        .as_ref()
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object);
    let required: Vec<&str> = t
        .parameters
        .as_ref()
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let Some(props) = props else {
        let _ = writeln!(
            out,
            "params_{i}: (\"<param name=\\\"\" /[A-Za-z0-9_\\-]+/ \"\\\">\" v_text \"</param>\")*"
        );
        return;
    };
    let mut parts = Vec::new();
    for (key, schema) in props.iter().filter(|(k, _)| plain_key(k)) {
        let open = lit(&format!("<param name=\"{key}\">"));
        let one = format!("({open} {} \"</param>\")", value_rule(Some(schema)));
        parts.push(if required.contains(&key.as_str()) {
            one
        } else {
            format!("{one}?")
        });
    }
    if parts.is_empty() {
        let _ = writeln!(out, "params_{i}: \"\"");
    } else {
        let _ = writeln!(out, "params_{i}: {}", parts.join(" "));
    }
}

/// The Lark grammar of the reply after the prefix `<function name="` (`required`) or
/// `<function name="NAME">` (named), for `tools`; `max_calls` 1 allows one call only.
pub fn call_grammar(tools: &ToolSet, choice: &ToolChoice, max_calls: usize) -> Option<String> {
    let allowed: Vec<(usize, &ToolDef)> = match choice {
        ToolChoice::Required => tools.tools.iter().enumerate().collect(),
        ToolChoice::Named(name) => tools
            .tools
            .iter()
            .enumerate()
            .filter(|(_, t)| &t.name == name)
            .collect(),
        ToolChoice::None | ToolChoice::Auto => return None,
    };
    let mut g = String::new();
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
    let _ = writeln!(g, "start: ({first}){more}");
    let calls: Vec<String> = allowed
        .iter()
        .map(|(i, t)| {
            format!(
                "{} body_{i}",
                lit(&format!("<function name=\"{}\">", t.name))
            )
        })
        .collect();
    let _ = writeln!(g, "call: {}", calls.join(" | "));
    for (i, t) in &allowed {
        let _ = writeln!(g, "body_{i}: params_{i} \"</function>\"");
        params_rule(&mut g, *i, t);
    }
    g.push_str(
        "v_int: /-?[0-9]{1,18}/\n\
         v_num: /-?[0-9]{1,18}(\\.[0-9]{1,18})?/\n\
         v_bool: \"true\" | \"false\"\n\
         v_text: /[^<]*/ | \"<![CDATA[\" /[^\\]]*/ \"]]>\"\n",
    );
    Some(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_grammar_names_the_tools_and_their_parameters() {
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "unit": {"enum": ["c", "f"]}, "bad\"key": {}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]);
        let set = ToolSet::new(tools.as_array().unwrap()).unwrap();
        let g = call_grammar(&set, &ToolChoice::Required, usize::MAX).unwrap();
        assert!(
            g.contains(r#""get_weather\">" body_0 | "now\">" body_1"#),
            "{g}"
        );
        assert!(
            g.contains(r#"("<param name=\"city\">" v_text "</param>") ("#),
            "{g}"
        );
        assert!(
            g.contains(r#"("<param name=\"days\">" v_int "</param>")?"#),
            "{g}"
        );
        assert!(g.contains(r#"("c" | "f")"#), "{g}");
        assert!(!g.contains("bad"), "{g}");
        let named = call_grammar(&set, &ToolChoice::Named("now".into()), 1).unwrap();
        assert!(named.starts_with("start: (body_1)\n"), "{named}");
        assert!(!named.contains("get_weather"), "{named}");
        assert_eq!(call_grammar(&set, &ToolChoice::Auto, 1), None);
    }
}
