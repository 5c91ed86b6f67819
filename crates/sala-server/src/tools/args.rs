//! A tool call's argument values, from the text the model wrote to JSON, typed by the tool's
//! JSON schema.
//!
//! The model writes every value as text: strings as they are, other values as Python's
//! `str()` would (`True`, `None`, `{'a': 1}`) or as JSON. A parameter whose schema type is
//! only `string` keeps the text; any other is read as JSON, then as a Python literal, and the
//! result is kept when its type is one the schema allows (or the schema names none). A value
//! that reads as neither, or as a type the schema does not allow while it allows strings,
//! stays the text: the client sees what the model wrote, never an error.

use serde_json::{Map, Number, Value};
use std::collections::HashSet;

/// `schema` with its local `$ref`s (`#/$defs/X`, `#/definitions/X`, any pointer into `root`)
/// followed; a reference that leads nowhere, or round in a loop, is the schema as it is.
pub fn resolve<'a>(schema: &'a Value, root: Option<&'a Value>) -> &'a Value {
    let mut at = schema;
    for _ in 0..16 {
        let next = at
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix('#'))
            .and_then(|pointer| root?.pointer(pointer));
        match next {
            Some(next) => at = next,
            None => return at,
        }
    }
    at
}

/// The JSON type name of `v`.
fn type_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The JSON types (`"string"`, `"integer"`, ...) a parameter's schema allows: its `type` (a
/// name or a list), the types of its `enum`/`const` values, and those of its
/// `anyOf`/`oneOf` alternatives, local `$ref`s into `root` followed. Empty when it names
/// none (any value).
pub fn schema_types(schema: Option<&Value>, root: Option<&Value>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(schema) = schema {
        add_types(&mut out, &mut HashSet::new(), schema, root, 0);
    }
    out
}

/// Adds the types of `schema` to `out`. Each schema object is read once (`seen`): alternatives
/// that refer back to their own schema would otherwise be walked once per path, exponentially
/// many times.
fn add_types(
    out: &mut Vec<String>,
    seen: &mut HashSet<*const Value>,
    schema: &Value,
    root: Option<&Value>,
    depth: usize,
) {
    let schema = resolve(schema, root);
    if !seen.insert(schema) {
        return;
    }
    let mut add = |t: &str| {
        if !out.iter().any(|o| o == t) {
            out.push(t.to_string());
        }
    };
    match schema.get("type") {
        Some(Value::String(s)) => add(s),
        Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).for_each(&mut add),
        _ => {}
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        values.iter().for_each(|v| add(type_of(v)));
    }
    if let Some(v) = schema.get("const") {
        add(type_of(v));
    }
    if depth < 8 {
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(alts)) = schema.get(key) {
                for alt in alts {
                    add_types(out, seen, alt, root, depth + 1);
                }
            }
        }
    }
}

/// Whether `v` is of the JSON schema type `t`.
fn is_of_type(v: &Value, t: &str) -> bool {
    match t {
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        _ => false,
    }
}

/// The value of an argument the model wrote as `text` (`raw`: as written, before XML
/// entities were decoded), for a parameter whose schema allows `types` (see the module docs).
pub fn typed_value(text: &str, raw: &str, types: &[String]) -> Value {
    if !types.is_empty() && types.iter().all(|t| t == "string") {
        return Value::String(text.to_string());
    }
    let read = serde_json::from_str::<Value>(raw.trim())
        .ok()
        .or_else(|| serde_json::from_str::<Value>(text.trim()).ok())
        .or_else(|| python_literal(text));
    match read {
        Some(v) if types.is_empty() || types.iter().any(|t| is_of_type(&v, t)) => v,
        _ if types.iter().any(|t| t == "string") => Value::String(text.to_string()),
        Some(v) => v,
        None => Value::String(text.to_string()),
    }
}

/// Deepest nesting a Python literal may have: far beyond any real argument, and the reader
/// recurses.
const MAX_DEPTH: usize = 64;

/// `text` read as a Python literal (`None`, `True`, numbers, quoted strings, lists, tuples,
/// dicts), as JSON; `None` when it is not one.
pub fn python_literal(text: &str) -> Option<Value> {
    let mut r = PyReader {
        s: text.as_bytes(),
        i: 0,
    };
    let v = r.value(0)?;
    r.skip_ws();
    (r.i == r.s.len()).then_some(v)
}

struct PyReader<'a> {
    s: &'a [u8],
    i: usize,
}

impl PyReader<'_> {
    fn skip_ws(&mut self) {
        while self.s.get(self.i).is_some_and(|b| b.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> bool {
        self.skip_ws();
        if self.s.get(self.i) == Some(&b) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_ws();
        match *self.s.get(self.i)? {
            b'[' => {
                self.i += 1;
                Some(Value::Array(self.items(b']', depth)?))
            }
            b'(' => {
                self.i += 1;
                Some(Value::Array(self.items(b')', depth)?))
            }
            b'{' => {
                self.i += 1;
                self.dict(depth)
            }
            b'\'' | b'"' => self.string().map(Value::String),
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => {
                let rest = &self.s[self.i..];
                let word_end = rest
                    .iter()
                    .position(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
                    .unwrap_or(rest.len());
                let v = match &rest[..word_end] {
                    b"None" => Value::Null,
                    b"True" => Value::Bool(true),
                    b"False" => Value::Bool(false),
                    _ => return None,
                };
                self.i += word_end;
                Some(v)
            }
        }
    }

    /// Values up to `close`, comma-separated, a trailing comma allowed.
    fn items(&mut self, close: u8, depth: usize) -> Option<Vec<Value>> {
        let mut out = Vec::new();
        loop {
            if self.eat(close) {
                return Some(out);
            }
            out.push(self.value(depth + 1)?);
            if !self.eat(b',') {
                return self.eat(close).then_some(out);
            }
        }
    }

    fn dict(&mut self, depth: usize) -> Option<Value> {
        let mut out = Map::new();
        loop {
            if self.eat(b'}') {
                return Some(Value::Object(out));
            }
            let key = match self.value(depth + 1)? {
                Value::String(s) => s,
                Value::Number(n) => n.to_string(),
                Value::Bool(b) => if b { "True" } else { "False" }.to_string(),
                Value::Null => "None".to_string(),
                _ => return None,
            };
            if !self.eat(b':') {
                return None;
            }
            out.insert(key, self.value(depth + 1)?);
            if !self.eat(b',') {
                return self.eat(b'}').then(|| Value::Object(out));
            }
        }
    }

    /// A quoted string (either quote) with Python's common escapes.
    fn string(&mut self) -> Option<String> {
        let quote = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let b = *self.s.get(self.i)?;
            self.i += 1;
            match b {
                _ if b == quote => break,
                b'\\' => {
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    let c = match e {
                        b'n' => '\n',
                        b't' => '\t',
                        b'r' => '\r',
                        b'0' => '\0',
                        b'\\' | b'\'' | b'"' => e as char,
                        b'u' | b'x' => {
                            let n = if e == b'u' { 4 } else { 2 };
                            let hex = std::str::from_utf8(self.s.get(self.i..self.i + n)?).ok()?;
                            self.i += n;
                            char::from_u32(u32::from_str_radix(hex, 16).ok()?)?
                        }
                        _ => return None,
                    };
                    let mut buf = [0; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
                _ => out.push(b),
            }
        }
        String::from_utf8(out).ok()
    }

    fn number(&mut self) -> Option<Value> {
        let start = self.i;
        while self
            .s
            .get(self.i)
            .is_some_and(|b| b.is_ascii_alphanumeric() || b"+-._".contains(b))
        {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i])
            .ok()?
            .replace('_', "");
        let text = text.strip_prefix('+').unwrap_or(&text);
        if let Ok(n) = text.parse::<i64>() {
            return Some(Value::Number(n.into()));
        }
        if let Ok(n) = text.parse::<u64>() {
            return Some(Value::Number(n.into()));
        }
        // Rust reads "inf" and "nan", which are no JSON numbers; Python's str() writes them so.
        let x: f64 = text.parse().ok()?;
        Number::from_f64(x).map(Value::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tv(text: &str, types: &[String]) -> Value {
        typed_value(text, text, types)
    }

    fn types(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn values_follow_the_schema_type() {
        assert_eq!(tv("3", &types(&["integer"])), json!(3));
        assert_eq!(tv(" 3 ", &types(&["number"])), json!(3));
        assert_eq!(tv("2.5", &types(&["number"])), json!(2.5));
        assert_eq!(tv("3", &types(&["string"])), json!("3"));
        assert_eq!(tv("true", &types(&["boolean"])), json!(true));
        assert_eq!(tv("False", &types(&["boolean"])), json!(false));
        assert_eq!(tv("None", &types(&["null"])), json!(null));
        assert_eq!(
            tv("{'a': [1, 'x'], \"b\": None}", &types(&["object"])),
            json!({"a": [1, "x"], "b": null})
        );
        assert_eq!(tv("[1, 2,]", &types(&["array"])), json!([1, 2]));
        assert_eq!(tv("(1, 2)", &types(&["array"])), json!([1, 2]));
        // A union with string: the typed reading when it fits, else the text.
        assert_eq!(tv("7", &types(&["integer", "string"])), json!(7));
        assert_eq!(tv("seven", &types(&["integer", "string"])), json!("seven"));
        assert_eq!(tv("[1]", &types(&["integer", "string"])), json!("[1]"));
        // No type: whatever reads, else the text.
        assert_eq!(tv("{\"x\": 1}", &[]), json!({"x": 1}));
        assert_eq!(tv("Paris", &[]), json!("Paris"));
        // A value that does not read as the type is kept as the model wrote it.
        assert_eq!(tv("three", &types(&["integer"])), json!("three"));
        assert_eq!(tv("2.5", &types(&["integer"])), json!(2.5));
        // JSON is read as written before XML entities are decoded, then after.
        let json_text = r#"{"a": "&lt;b&gt;"}"#;
        assert_eq!(
            typed_value(r#"{"a": "<b>"}"#, json_text, &types(&["object"])),
            json!({"a": "&lt;b&gt;"})
        );
        assert_eq!(
            typed_value("[1, 2]", "[1,&#32;2]", &types(&["array"])),
            json!([1, 2])
        );
    }

    #[test]
    fn schema_types_read_type_lists_and_alternatives() {
        assert_eq!(
            schema_types(Some(&json!({"type": "string"})), None),
            ["string"]
        );
        assert_eq!(
            schema_types(Some(&json!({"type": ["integer", "null"]})), None),
            ["integer", "null"]
        );
        assert_eq!(
            schema_types(
                Some(&json!({"anyOf": [{"type": "number"}, {"type": "boolean"}]})),
                None
            ),
            ["number", "boolean"]
        );
        assert_eq!(
            schema_types(Some(&json!({"enum": ["a", 1]})), None),
            ["string", "integer"]
        );
        assert_eq!(schema_types(Some(&json!({"const": 2.5})), None), ["number"]);
        assert!(schema_types(Some(&json!({"description": "any"})), None).is_empty());
        assert!(schema_types(None, None).is_empty());
        // Local references are followed, in alternatives too; a loop or a dead end is no type.
        let root = json!({"$defs": {"A": {"type": "integer"}, "B": {"$ref": "#/$defs/A"},
                                    "L": {"$ref": "#/$defs/L"}}});
        let refs = json!({"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}]});
        assert_eq!(schema_types(Some(&refs), Some(&root)), ["integer", "null"]);
        for dead in ["#/$defs/L", "#/$defs/Z", "other.json#/A"] {
            assert!(schema_types(Some(&json!({"$ref": dead})), Some(&root)).is_empty());
        }
        // Alternatives that refer back to their own schema are read once, not once a path
        // (40 of them, 8 deep, would take 40^8 walks).
        let alts: Vec<Value> = (0..40).map(|_| json!({"$ref": "#/$defs/X"})).collect();
        let mut alts = Value::Array(alts);
        alts.as_array_mut().unwrap().push(json!({"type": "string"}));
        let root = json!({"$defs": {"X": {"anyOf": alts}}});
        let types = schema_types(Some(&json!({"$ref": "#/$defs/X"})), Some(&root));
        assert_eq!(types, ["string"]);
    }

    #[test]
    fn python_literals_read_or_refuse() {
        assert_eq!(
            python_literal("{'k': 'it\\'s', 1: -2.5e3, 'u': '\\u00e9'}"),
            Some(json!({"k": "it's", "1": -2500.0, "u": "é"}))
        );
        assert_eq!(python_literal("1_000"), Some(json!(1000)));
        assert_eq!(python_literal("'日本'"), Some(json!("日本")));
        for bad in [
            "", "[1, 2", "{'a' 1}", "none", "'open", "nan", "1 2", "[1,,2]", "{[1]: 2}",
        ] {
            assert_eq!(python_literal(bad), None, "{bad:?}");
        }
        // Deep nesting is refused, not a stack overflow.
        let deep = "[".repeat(100_000);
        assert_eq!(python_literal(&deep), None);
    }
}
