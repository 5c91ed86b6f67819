//! Structured output: a request's JSON schema (or "any JSON object") enforced by constrained
//! decoding with [`llguidance`].
//!
//! - [`Grammars`]: the model's token environment (a token trie of every token's bytes, the
//!   specials marked, the EOS ids), built on first use and shared by every request.
//! - [`Grammars::compile`] turns a [`GrammarSpec`] into a [`Grammar`] at request time, off the
//!   engine thread: a bad schema is the request's error before any engine work.
//! - [`Constraint`]: a request's grammar while it generates. Each step its mask of allowed
//!   tokens is computed beside the forward pass ([`crate::step`]), applied to the logits before
//!   sampling (disallowed tokens become `-inf`), and the sampled token advances it. When the
//!   grammar is complete and nothing may follow, generation stops.
//!
//! JSON is generated in one fixed layout: `", "` between items, `": "` after keys, no other
//! whitespace (a schema's `x-guidance` may say otherwise). Free whitespace would let a model
//! emit spaces and newlines forever; the fixed layout is also Python's `json.dumps`, which
//! models know.

use crate::request::RequestError;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use sala_tokenizer::Tokenizer;
use std::sync::{Arc, OnceLock};

/// Most bytes a request's JSON schema may take (as compact JSON).
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// Most alternatives one `enum`, `anyOf` or `oneOf` of a schema may list: the parser holds
/// every alternative of a choice in one row, and fails mid-generation past 2000.
pub const MAX_ALTERNATIVES: usize = 1024;

/// A key as a JSON pointer segment (`~` and `/` escaped).
fn pointer_key(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The JSON pointer of every object in `v` (at `ptr`), children first.
fn schema_objects(v: &serde_json::Value, ptr: String, out: &mut Vec<String>) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            for (k, x) in map {
                schema_objects(x, format!("{ptr}/{}", pointer_key(k)), out);
            }
            out.push(ptr);
        }
        Value::Array(list) => {
            for (i, x) in list.iter().enumerate() {
                schema_objects(x, format!("{ptr}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// A place in `schema` (a JSON pointer) that leads back to itself before any value is written:
/// through local `$ref`s and the members of `allOf`, `anyOf` and `oneOf` only (`a` → `b` →
/// `a`, or `a: {allOf: [{$ref: a}]}`). The parser cannot compile such a left recursion, and
/// finds it only when it gets there, mid-generation.
pub fn ref_cycle(schema: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    use std::collections::HashMap;
    // Where a schema at `ptr` leads without writing anything.
    let next = |ptr: &str| -> Vec<String> {
        let Some(Value::Object(map)) = schema.pointer(ptr) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let Some(r) = map.get("$ref").and_then(Value::as_str) {
            if let Some(target) = r.strip_prefix('#') {
                out.push(target.to_string());
            }
        }
        for key in ["allOf", "anyOf", "oneOf"] {
            if let Some(Value::Array(list)) = map.get(key) {
                out.extend((0..list.len()).map(|i| format!("{ptr}/{key}/{i}")));
            }
        }
        out
    };
    let mut starts = Vec::new();
    schema_objects(schema, String::new(), &mut starts);
    // Depth-first, iteratively: 1 on the path, 2 done.
    let mut state: HashMap<String, u8> = HashMap::new();
    for start in starts {
        if state.contains_key(&start) {
            continue;
        }
        let mut stack = vec![(start.clone(), next(&start), 0usize)];
        state.insert(start, 1);
        while let Some((ptr, succ, i)) = stack.last_mut() {
            if let Some(n) = succ.get(*i).cloned() {
                *i += 1;
                match state.get(&n) {
                    Some(1) => {
                        return Some(if n.is_empty() {
                            "#".into()
                        } else {
                            format!("#{n}")
                        })
                    }
                    Some(_) => {}
                    None => {
                        state.insert(n.clone(), 1);
                        let s = next(&n);
                        stack.push((n, s, 0));
                    }
                }
            } else {
                state.insert(ptr.clone(), 2);
                stack.pop();
            }
        }
    }
    None
}

/// Whether `schema` can only be satisfied by an infinitely nested value: every value of it
/// must hold another (`{"properties": {"x": {"$ref": "#"}}, "required": ["x"]}`). The parser
/// finds it only as it generates, never finishing the value. A least fixpoint over the
/// schema's objects: one can be finished if its reference, every `allOf` member, one `anyOf`
/// or `oneOf` member, each required property and (with `minItems` >= 1) its items can be;
/// anything else is taken as finishable. Schemas without references cannot recurse and are
/// not walked.
pub fn never_finite(schema: &serde_json::Value) -> bool {
    use serde_json::Value;
    use std::collections::HashMap;
    if !serde_json::to_string(schema).is_ok_and(|t| t.contains("\"$ref\"")) {
        return false;
    }
    let mut nodes = Vec::new();
    schema_objects(schema, String::new(), &mut nodes);
    // Each pass is linear and there may be as many passes as objects: huge schemas are left
    // to the parser.
    if nodes.len() > 20_000 {
        return false;
    }
    let mut finite: HashMap<String, bool> = nodes.iter().map(|n| (n.clone(), false)).collect();
    // Whether the schema at `ptr` can be finished, by what is known so far.
    let known = |finite: &HashMap<String, bool>, ptr: &str| match schema.pointer(ptr) {
        Some(Value::Bool(b)) => *b,
        Some(Value::Object(_)) => finite.get(ptr).copied().unwrap_or(true),
        _ => true,
    };
    loop {
        let mut changed = false;
        for ptr in &nodes {
            if finite[ptr] {
                continue;
            }
            let Some(Value::Object(map)) = schema.pointer(ptr) else {
                continue;
            };
            let mut ok = true;
            if let Some(target) = map
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix('#'))
            {
                ok &= known(&finite, target);
            }
            if let Some(Value::Array(list)) = map.get("allOf") {
                ok &= (0..list.len()).all(|i| known(&finite, &format!("{ptr}/allOf/{i}")));
            }
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(list)) = map.get(key) {
                    ok &= (0..list.len()).any(|i| known(&finite, &format!("{ptr}/{key}/{i}")));
                }
            }
            if let (Some(Value::Array(required)), Some(Value::Object(props))) =
                (map.get("required"), map.get("properties"))
            {
                for key in required.iter().filter_map(Value::as_str) {
                    if props.contains_key(key) {
                        let k = pointer_key(key);
                        ok &= known(&finite, &format!("{ptr}/properties/{k}"));
                    }
                }
            }
            let min_items = map.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            if min_items > 0 && map.get("items").is_some_and(Value::is_object) {
                ok &= known(&finite, &format!("{ptr}/items"));
            }
            if ok {
                finite.insert(ptr.clone(), true);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    !known(&finite, "")
}

/// The first `type` of `schema` (a JSON pointer to it, and its value) that names no JSON
/// Schema type: `type` must be one of `null`, `boolean`, `object`, `array`, `number`, `string`,
/// `integer`, or a list of them. Only schema positions are read (the keywords that hold
/// subschemas), never data such as `enum`, `const` or `default`, nor property names.
pub fn unknown_type(schema: &serde_json::Value) -> Option<(String, serde_json::Value)> {
    use serde_json::Value;
    const TYPES: [&str; 7] = [
        "null", "boolean", "object", "array", "number", "string", "integer",
    ];
    fn walk(v: &Value, ptr: String) -> Option<(String, Value)> {
        let Value::Object(map) = v else {
            return None;
        };
        if let Some(t) = map.get("type") {
            let known = |x: &Value| x.as_str().is_some_and(|n| TYPES.contains(&n));
            let ok = match t {
                Value::Array(list) => !list.is_empty() && list.iter().all(known),
                one => known(one),
            };
            if !ok {
                return Some((format!("{ptr}/type"), t.clone()));
            }
        }
        for (key, x) in map {
            let at = format!("{ptr}/{}", pointer_key(key));
            let found = match key.as_str() {
                // A subschema.
                "additionalProperties"
                | "items"
                | "contains"
                | "not"
                | "if"
                | "then"
                | "else"
                | "propertyNames"
                | "unevaluatedProperties"
                | "unevaluatedItems"
                | "additionalItems" => match x {
                    Value::Array(list) => list
                        .iter()
                        .enumerate()
                        .find_map(|(i, y)| walk(y, format!("{at}/{i}"))),
                    _ => walk(x, at),
                },
                // A list of subschemas.
                "allOf" | "anyOf" | "oneOf" | "prefixItems" => x.as_array().and_then(|list| {
                    list.iter()
                        .enumerate()
                        .find_map(|(i, y)| walk(y, format!("{at}/{i}")))
                }),
                // Subschemas by name.
                "properties" | "patternProperties" | "$defs" | "definitions"
                | "dependentSchemas" => x.as_object().and_then(|m| {
                    m.iter()
                        .find_map(|(k, y)| walk(y, format!("{at}/{}", pointer_key(k))))
                }),
                _ => None,
            };
            if found.is_some() {
                return found;
            }
        }
        None
    }
    walk(schema, String::new())
}

/// Calls `f` with every object in `v` (at any depth, arrays included).
fn for_each_object<'a>(
    v: &'a serde_json::Value,
    f: &mut impl FnMut(&'a serde_json::Map<String, serde_json::Value>),
) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            f(map);
            map.values().for_each(|x| for_each_object(x, f));
        }
        Value::Array(list) => list.iter().for_each(|x| for_each_object(x, f)),
        _ => {}
    }
}

/// The most alternatives any `enum`, `anyOf` or `oneOf` in `schema` lists (0 without one).
pub fn widest_choice(schema: &serde_json::Value) -> usize {
    let mut widest = 0;
    for_each_object(schema, &mut |map| {
        for key in ["enum", "anyOf", "oneOf"] {
            if let Some(serde_json::Value::Array(list)) = map.get(key) {
                widest = widest.max(list.len());
            }
        }
    });
    widest
}

/// Most items [`widest_row`] may find in one row of the parser, which fails mid-generation past
/// 2000 (a margin left for what the estimate misses).
pub const MAX_ROW: usize = 1800;

/// About how many items the parser's row holds at the widest place of `schema`, where an
/// object's next key or a value's start is read: four for each property an object leaves
/// optional (and seven for the object), one for each `enum` value, the alternatives' own summed
/// for `anyOf`, `oneOf` and `allOf`, local `$ref`s followed (measured: an object of 499
/// optional properties takes 2003 items, an `anyOf` of 300 objects of one optional property
/// each 3300). Each schema object is weighed once.
pub fn widest_row(schema: &serde_json::Value) -> usize {
    use serde_json::Value;
    use std::collections::{HashMap, HashSet};
    struct Rows<'a> {
        root: &'a Value,
        /// Each object's width, by address; 1 while it is being weighed (a loop adds one).
        memo: HashMap<*const serde_json::Map<String, Value>, usize>,
    }
    impl<'a> Rows<'a> {
        fn width(&mut self, v: &'a Value) -> usize {
            match v {
                Value::Object(map) => self.object_width(map),
                _ => 1,
            }
        }

        fn object_width(&mut self, map: &'a serde_json::Map<String, Value>) -> usize {
            if let Some(&w) = self.memo.get(&(map as *const _)) {
                return w;
            }
            self.memo.insert(map, 1);
            let mut w = 0usize;
            let target = map
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| r.strip_prefix('#'))
                .and_then(|p| self.root.pointer(p));
            if let Some(target) = target {
                w = w.saturating_add(self.width(target));
            }
            for key in ["anyOf", "oneOf", "allOf"] {
                if let Some(Value::Array(list)) = map.get(key) {
                    for alt in list {
                        w = w.saturating_add(self.width(alt));
                    }
                }
            }
            if let Some(Value::Array(values)) = map.get("enum") {
                w = w.saturating_add(values.len());
            }
            if let Some(Value::Object(props)) = map.get("properties") {
                let required: HashSet<&str> = match map.get("required") {
                    Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
                    _ => HashSet::new(),
                };
                let optional = props
                    .keys()
                    .filter(|k| !required.contains(k.as_str()))
                    .count();
                if optional > 0 {
                    w = w.saturating_add(optional.saturating_mul(4).saturating_add(7));
                }
            }
            let w = w.max(1);
            self.memo.insert(map, w);
            w
        }
    }
    let mut rows = Rows {
        root: schema,
        memo: HashMap::new(),
    };
    let mut widest = 0;
    for_each_object(schema, &mut |map| {
        widest = widest.max(rows.object_width(map))
    });
    widest
}

/// The request parameter that structured output answers to.
const PARAM: &str = "response_format";

/// What the output must be.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON matching this schema.
    JsonSchema(serde_json::Value),
    /// Text matching a grammar in llguidance's Lark syntax, built by the caller (e.g. the
    /// tool calls a `tool_choice` requires); its errors name `param`.
    Lark { grammar: String, param: String },
}

/// A compiled grammar, ready to constrain one request (cloning it is cheap: the parser's
/// tables are shared).
#[derive(Clone)]
pub struct Grammar {
    matcher: Matcher,
    /// The mask of the first token, computed when it was compiled.
    first_mask: SimpleVob,
    /// The request field it comes from (`response_format`, `tools`), named by its errors.
    param: String,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("first_allowed", &self.first_mask.num_set())
            .finish_non_exhaustive()
    }
}

/// The model's token environment for grammars, built on first use.
pub struct Grammars {
    tokenizer: Tokenizer,
    vocab_size: usize,
    eos_ids: Vec<u32>,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("vocab_size", &self.vocab_size)
            .field("eos_ids", &self.eos_ids)
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

/// The token trie of `tokenizer` over `vocab_size` ids (the model's: ids past the tokenizer's
/// have no bytes and are never allowed), with `eos_ids` as its end tokens.
fn token_trie(
    tokenizer: &Tokenizer,
    vocab_size: usize,
    eos_ids: &[u32],
) -> Result<TokTrie, String> {
    let mut words: Vec<Vec<u8>> = tokenizer
        .vocab_bytes()
        .into_iter()
        .map(|t| {
            if t.special {
                // llguidance's mark for a special token: never text, named in grammars.
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend(t.bytes);
                b
            } else {
                t.bytes
            }
        })
        .collect();
    words.resize(vocab_size.max(words.len()), Vec::new());
    let vocab = u32::try_from(words.len()).map_err(|_| "the vocabulary is too large")?;
    let eos: Vec<TokenId> = eos_ids.iter().copied().filter(|&id| id < vocab).collect();
    let Some(&first) = eos.first() else {
        return Err("the model has no EOS token to end structured output with".into());
    };
    let info = TokRxInfo::new(vocab, first);
    Ok(TokTrie::from(&info, &words).with_eos_tokens(&eos))
}

impl Grammars {
    /// Grammars over `tokenizer` for a model of `vocab_size` logits that ends text with
    /// `eos_ids`. Nothing is built until the first [`Grammars::compile`].
    pub fn new(tokenizer: Tokenizer, vocab_size: usize, eos_ids: Vec<u32>) -> Self {
        Self {
            tokenizer,
            vocab_size,
            eos_ids,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory, RequestError> {
        self.factory
            .get_or_init(|| {
                let trie = token_trie(&self.tokenizer, self.vocab_size, &self.eos_ids)?;
                let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                factory.quiet();
                // Errors name the problem, not the parser's whole state.
                factory.limits_mut().verbose_errors = false;
                Ok(factory)
            })
            .as_ref()
            .map_err(|e| RequestError::internal(format!("structured output is unavailable: {e}")))
    }

    /// Compiles `spec`; a schema that is too large, invalid, unsupported or unsatisfiable is
    /// an [`RequestError::InvalidRequest`] naming `response_format`.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar, RequestError> {
        if let GrammarSpec::Lark { grammar, param } = spec {
            let invalid = |e: &dyn std::fmt::Display| {
                RequestError::invalid(format!("{param}: its grammar failed: {}", brief(e)))
                    .param(param.clone())
            };
            let parser = self
                .factory()?
                .create_parser(TopLevelGrammar::from_lark(grammar.clone()))
                .map_err(|e| invalid(&e))?;
            let mut matcher = Matcher::new(Ok(parser));
            let first_mask = matcher.compute_mask().map_err(|e| invalid(&e))?;
            if first_mask.is_zero() {
                return Err(invalid(&"no token of this model can begin its output"));
            }
            return Ok(Grammar {
                matcher,
                first_mask,
                param: param.clone(),
            });
        }
        let invalid = |m: &str| RequestError::invalid(format!("{PARAM}: {m}")).param(PARAM);
        let mut schema = match spec {
            GrammarSpec::Lark { .. } => unreachable!("compiled above"),
            GrammarSpec::JsonObject => serde_json::json!({"type": "object"}),
            GrammarSpec::JsonSchema(s) => {
                let size = serde_json::to_string(s).map_or(usize::MAX, |t| t.len());
                if size > MAX_SCHEMA_BYTES {
                    return Err(invalid(&format!(
                        "the JSON schema takes {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed"
                    )));
                }
                if let Some(at) = ref_cycle(s) {
                    return Err(invalid(&format!(
                        "the JSON schema at {at:?} leads back to itself through $ref, allOf, \
                         anyOf or oneOf before any value is written: it cannot be compiled"
                    )));
                }
                if never_finite(s) {
                    return Err(invalid(
                        "the JSON schema can only be satisfied by an infinitely nested value \
                         (each value must hold another)",
                    ));
                }
                if let Some((at, t)) = unknown_type(s) {
                    return Err(invalid(&format!(
                        "invalid JSON schema: its type at {at:?} is {t}; a type must be a \
                         string naming one of null, boolean, object, array, number, string, \
                         integer, or a list of them"
                    )));
                }
                if let Some((pattern, size)) = widest_pattern(s) {
                    if size > MAX_PATTERN_REPEATS {
                        return Err(invalid(&format!(
                            "the JSON schema's pattern {pattern:?} nests bounded repeats whose \
                             counts multiply to {size}; at most {MAX_PATTERN_REPEATS} can be \
                             followed while generating"
                        )));
                    }
                }
                let widest = widest_choice(s);
                if widest > MAX_ALTERNATIVES {
                    return Err(invalid(&format!(
                        "the JSON schema has an enum, anyOf or oneOf of {widest} alternatives; at \
                         most {MAX_ALTERNATIVES} are supported"
                    )));
                }
                let row = widest_row(s);
                if row > MAX_ROW {
                    return Err(invalid(&format!(
                        "the JSON schema lets about {row} alternatives follow at one place of \
                         the output (an object's optional properties, about four each, and \
                         the alternatives of anyOf, oneOf and enum); at most {MAX_ROW} are \
                         supported: require more properties or offer fewer alternatives"
                    )));
                }
                match s {
                    // The boolean schemas: `true` takes any JSON value, `false` none.
                    serde_json::Value::Bool(true) => serde_json::json!({}),
                    serde_json::Value::Bool(false) => {
                        return Err(invalid("the JSON schema is false: no output can match it"))
                    }
                    serde_json::Value::Object(_) => s.clone(),
                    _ => {
                        return Err(invalid(
                            "the JSON schema must be a JSON object (or true or false)",
                        ))
                    }
                }
            }
        };
        if schema.get("x-guidance").is_none() {
            JsonCompileOptions {
                item_separator: ", ".into(),
                key_separator: ": ".into(),
                whitespace_flexible: false,
                ..JsonCompileOptions::default()
            }
            .apply_to(&mut schema);
        }
        let bad_schema =
            |e: &dyn std::fmt::Display| invalid(&format!("invalid JSON schema: {}", brief(e)));
        let parser = self
            .factory()?
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| bad_schema(&e))?;
        let mut matcher = Matcher::new(Ok(parser));
        let first_mask = matcher.compute_mask().map_err(|e| bad_schema(&e))?;
        if first_mask.is_zero() {
            return Err(invalid(
                "no token of this model can begin output that matches the JSON schema",
            ));
        }
        Ok(Grammar {
            matcher,
            first_mask,
            param: PARAM.into(),
        })
    }
}

/// Most a regex `pattern` of a JSON schema may multiply its nested bounded repeats' counts:
/// llguidance's lexer runs out of its per-token budget within a few words of such a pattern
/// (measured on the tiny preset: `(\w{1,30}){1,100}` and `([a-z]{1,10}){1,300}` generate,
/// `(\w{1,40}){1,100}`, `(\w{1,200}){1,20}` and `((\w{1,10}){1,10}){1,40}` fail mid-output).
pub const MAX_PATTERN_REPEATS: u64 = 3000;

/// The `pattern` of `schema` (anywhere in it) whose bounded repeats, nested two deep or more,
/// multiply to the most, and that product ([`repeat_product`]); `None` without such patterns.
/// Patterns the regex parser cannot read are left to llguidance's own error.
pub fn widest_pattern(schema: &serde_json::Value) -> Option<(String, u64)> {
    let mut best: Option<(String, u64)> = None;
    for_each_object(schema, &mut |map| {
        let Some(serde_json::Value::String(p)) = map.get("pattern") else {
            return;
        };
        let Ok(hir) = regex_syntax::Parser::new().parse(p) else {
            return;
        };
        let (size, depth) = repeat_product(&hir);
        if depth >= 2 && best.as_ref().is_none_or(|(_, b)| size > *b) {
            best = Some((p.clone(), size));
        }
    });
    best
}

/// The largest product of bounded repeat counts along a nesting of `hir`, and how many bounded
/// repeats nest there: a sequence adds its parts' products (`(\\w{1,100}\\w{1,100}){1,20}` is
/// 4000, 2 deep), an unbounded repeat multiplies by 1.
pub fn repeat_product(hir: &regex_syntax::hir::Hir) -> (u64, u32) {
    use regex_syntax::hir::HirKind;
    match hir.kind() {
        HirKind::Repetition(r) => {
            let (product, depth) = repeat_product(&r.sub);
            match r.max {
                Some(m) => (product.saturating_mul(m.max(1) as u64), depth + 1),
                None => (product, depth),
            }
        }
        HirKind::Capture(c) => repeat_product(&c.sub),
        HirKind::Concat(parts) => {
            let inner: Vec<_> = parts
                .iter()
                .map(repeat_product)
                .filter(|&(_, d)| d > 0)
                .collect();
            let depth = inner.iter().map(|&(_, d)| d).max().unwrap_or(0);
            let product = inner.iter().fold(0u64, |a, &(p, _)| a.saturating_add(p));
            (product.max(1), depth)
        }
        HirKind::Alternation(parts) => parts
            .iter()
            .map(repeat_product)
            .fold((1, 0), |(p, d), (q, e)| (p.max(q), d.max(e))),
        _ => (1, 0),
    }
}

/// An llguidance error's message on one line, cut to a readable length.
fn brief(e: &(impl std::fmt::Display + ?Sized)) -> String {
    const MAX_CHARS: usize = 400;
    let s = e.to_string();
    let mut line = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if let Some((cut, _)) = line.char_indices().nth(MAX_CHARS) {
        line.truncate(cut);
        line.push_str(" …");
    }
    line
}

/// Why a request's constraint failed while it generated, and the request field it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("structured output failed: {message}")]
pub struct GrammarError {
    pub message: String,
    pub param: String,
}

/// One request's grammar as it generates: the matcher and the mask of its next token.
pub struct Constraint {
    matcher: Matcher,
    mask: Option<Result<SimpleVob, GrammarError>>,
    param: String,
    /// The message of a panic while the mask was computed beside the forward pass: raised
    /// again by [`Constraint::apply`], inside the request's own sampling, so that it fails
    /// that request only.
    panicked: Option<String>,
}

impl From<Grammar> for Constraint {
    fn from(g: Grammar) -> Self {
        Self {
            matcher: g.matcher,
            mask: Some(Ok(g.first_mask)),
            param: g.param,
            panicked: None,
        }
    }
}

impl Constraint {
    /// An error of this constraint.
    fn error(&self, message: String) -> GrammarError {
        GrammarError {
            message,
            param: self.param.clone(),
        }
    }

    /// Whether the next token's mask is still to be computed.
    pub fn needs_mask(&self) -> bool {
        self.mask.is_none() && !self.matcher.is_stopped()
    }

    /// [`Constraint::compute_mask`], a panic inside it kept for [`Constraint::apply`] to raise
    /// (so that one on another thread, beside the forward pass, fails this request only).
    pub fn compute_mask_isolated(&mut self) {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.compute_mask()));
        if let Err(p) = run {
            self.mask = None;
            self.panicked =
                Some(crate::generate::EngineError::from_panic("the grammar", p).to_string());
        }
    }

    /// Computes the next token's mask (it may take a millisecond: [`crate::step`] runs it
    /// beside the forward pass).
    pub fn compute_mask(&mut self) {
        let mask = self.matcher.compute_mask().map_err(|e| brief(&e));
        self.mask = Some(match mask {
            Ok(m) if m.is_zero() => {
                Err(self.error("the grammar allows no token of this model here".into()))
            }
            Ok(m) => Ok(m),
            Err(e) => Err(self.error(e)),
        });
    }

    /// Sets every logit the grammar disallows to `-inf` (the mask is computed here if it is
    /// not yet). The mask is used up: the next token needs a new one.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        if let Some(message) = self.panicked.take() {
            panic!("{message}");
        }
        if self.mask.is_none() {
            self.compute_mask();
        }
        let mask = self.mask.take().expect("computed above")?;
        for (word, chunk) in mask.as_slice().iter().zip(logits.chunks_mut(32)) {
            if *word == u32::MAX {
                continue;
            }
            for (bit, x) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        // Logits past the grammar's vocabulary (none, when the model's is the trie's).
        let covered = mask.as_slice().len() * 32;
        if logits.len() > covered {
            logits[covered..].fill(f32::NEG_INFINITY);
        }
        Ok(())
    }

    /// Whether the output so far is whole: the grammar would take an end of sequence here.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Advances the grammar by a sampled token. Returns whether the grammar is complete and
    /// nothing may follow (generation should stop).
    pub fn advance(&mut self, token: u32) -> Result<bool, GrammarError> {
        self.mask = None;
        if let Err(e) = self.matcher.consume_token(token) {
            return Err(self.error(brief(&e)));
        }
        Ok(self.matcher.is_stopped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammars() -> (tempfile::TempDir, Grammars, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        sala_tokenizer::write_test_tokenizer(dir.path(), 1024).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        // Two ids past the tokenizer's, as a model's padded vocabulary has.
        let g = Grammars::new(tok.clone(), 1026, tok.eos_ids());
        (dir, g, tok)
    }

    fn id(tok: &Tokenizer, piece: &str) -> u32 {
        tok.token_to_id(piece)
            .unwrap_or_else(|| panic!("{piece:?}"))
    }

    #[test]
    fn the_mask_allows_what_may_come_next_and_the_grammar_ends_itself() {
        let (_dir, g, tok) = grammars();
        let spec = GrammarSpec::JsonSchema(serde_json::json!({"enum": ["yes", "no"]}));
        let mut c = Constraint::from(g.compile(&spec).unwrap());
        let mut logits = vec![0.0f32; 1026];
        c.apply(&mut logits).unwrap();
        let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
        // Only tokens that begin `"yes"` or `"no"` (no space: the layout is fixed).
        assert!(!allowed.is_empty());
        let bytes = tok.vocab_bytes();
        for &i in &allowed {
            let piece = String::from_utf8_lossy(&bytes[i].bytes);
            assert!(
                ["\"yes\"", "\"no\""].iter().any(|w| w.starts_with(&*piece)),
                "{piece:?} allowed"
            );
        }
        assert!(logits[1024..].iter().all(|&x| x == f32::NEG_INFINITY));
        // `"`, `n`, `o`, `"`: complete after the closing quote, and nothing may follow.
        assert!(c.needs_mask(), "apply uses the mask up");
        for (i, piece) in ["\"", "n", "o"].iter().enumerate() {
            assert!(!c.advance(id(&tok, piece)).unwrap(), "token {i}");
            assert!(c.needs_mask());
        }
        assert!(c.advance(id(&tok, "\"")).unwrap(), "complete");
        assert!(!c.needs_mask());
    }

    #[test]
    fn unknown_types_are_found_at_schema_positions_only() {
        use serde_json::json;
        let found = |s: serde_json::Value| unknown_type(&s).map(|(at, _)| at);
        assert_eq!(found(json!({"type": "objectx"})), Some("/type".into()));
        assert_eq!(found(json!({"type": ["string", 3]})), Some("/type".into()));
        assert_eq!(found(json!({"type": []})), Some("/type".into()));
        assert_eq!(
            found(json!({"type": "object", "properties": {"a/b": {"type": "str"}}})),
            Some("/properties/a~1b/type".into())
        );
        assert_eq!(
            found(json!({"anyOf": [{"type": "null"}, {"items": {"type": "int"}}]})),
            Some("/anyOf/1/items/type".into())
        );
        assert_eq!(
            found(json!({"$defs": {"x": {"type": "float"}}, "$ref": "#/$defs/x"})),
            Some("/$defs/x/type".into())
        );
        // Data and property names are not schemas.
        for ok in [
            json!({"type": ["string", "null"]}),
            json!({"properties": {"type": {"type": "string"}}}),
            json!({"enum": [{"type": "weird"}], "const": {"type": 1}}),
            json!({"default": {"type": "weird"}, "examples": [{"type": "x"}]}),
            json!(true),
        ] {
            assert_eq!(found(ok.clone()), None, "{ok}");
        }
        // The compiler refuses one, naming where.
        let (_dir, g, _) = grammars();
        let spec = GrammarSpec::JsonSchema(json!({"properties": {"a": {"type": "objectx"}}}));
        let Err(e) = g.compile(&spec) else {
            panic!("an unknown type compiled")
        };
        let e = e.to_string();
        assert!(
            e.contains("/properties/a/type") && e.contains("objectx"),
            "{e}"
        );
    }

    #[test]
    fn a_disallowed_token_is_an_error_and_stays_one() {
        let (_dir, g, tok) = grammars();
        let mut c = Constraint::from(g.compile(&GrammarSpec::JsonObject).unwrap());
        let e = c.advance(id(&tok, "a")).unwrap_err();
        assert!(!e.message.is_empty());
        assert_eq!(e.param, "response_format");
        assert!(
            e.to_string().starts_with("structured output failed: "),
            "{e}"
        );
        let mut logits = vec![0.0f32; 1026];
        assert!(c.apply(&mut logits).is_err());
    }

    #[test]
    fn nested_bounded_repeats_multiply_and_sequences_add() {
        let of = |p: &str| repeat_product(&regex_syntax::Parser::new().parse(p).unwrap());
        assert_eq!(of(r"^(\w{1,100}){1,100}$"), (10_000, 2));
        assert_eq!(of(r"^(\w{1,100}\w{1,100}){1,20}$"), (4000, 2));
        assert_eq!(of(r"^((\w{1,10}){1,10}){1,40}$"), (4000, 3));
        assert_eq!(of(r"^\w{1,5000}$"), (5000, 1));
        assert_eq!(of(r"^(\w{1,100})*$"), (100, 1));
        assert_eq!(of(r"^(a|b{1,7}){1,3}$"), (21, 2));
        assert_eq!(of(r"abc"), (1, 0));
        let schema = serde_json::json!({"type": "object", "properties": {
            "a": {"type": "string", "pattern": r"^(\d{1,3}\.){3}\d{1,3}$"},
            "b": {"type": "array", "items": {"type": "string", "pattern": r"^(\w{1,40}){1,100}$"}},
            "c": {"type": "string", "pattern": r"^\w{1,9000}$"}}});
        assert_eq!(
            widest_pattern(&schema),
            Some((r"^(\w{1,40}){1,100}$".to_string(), 4000))
        );
        assert_eq!(widest_pattern(&serde_json::json!({"pattern": "(("})), None);
    }

    #[test]
    fn the_eos_ids_must_exist() {
        let (_dir, _, tok) = grammars();
        let g = Grammars::new(tok, 1024, Vec::new());
        match g.compile(&GrammarSpec::JsonObject) {
            Err(RequestError::Internal { message }) => {
                assert!(message.contains("EOS"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }
}
