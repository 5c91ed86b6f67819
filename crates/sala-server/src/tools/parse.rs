//! Tool calls in the model's reply: MiniCPM's dialect,
//! `<function name="NAME"><param name="ARG">VALUE</param>...</function>`, parsed as the text
//! streams in.
//!
//! The grammar read (whitespace is allowed between the tags and inside them where shown):
//!
//! ```text
//! call  := '<function' WS 'name=' Q NAME Q '>' param* '</function>'
//! param := '<param' WS 'name=' Q KEY Q '>' value '</param>'
//! value := '<![CDATA[' TEXT ']]>'  (kept exactly)
//!        | TEXT up to '</param>'    (trimmed, the five XML entities decoded)
//! ```
//!
//! `Q` is `"` or `'`; `NAME` is letters, digits, `_` and `-` (as tool names are); `KEY` has no
//! `<`, `>`, line break or its quote. A call is taken when it is whole, names one of the request's tools and
//! names no argument twice; its values are typed by that tool's schema ([`super::args`]).
//! Anything else, a call cut off by the end of the reply included, stays content, as
//! written: a reply never fails for its calls. Whitespace next to a taken call (between
//! calls, before the first, after the last) is dropped; content is the rest.
//!
//! Streaming: text that may still turn out to be a call (from a possible `<function` on, and
//! the whitespace before it) is held until it is known; everything else is released at once.
//! Whether a call at a given place is whole, or can no longer be one, depends only on the
//! text from that place, never on what follows it: so any cutting of the reply into pieces
//! gives the same content and calls as the whole.

use super::args::typed_value;
use super::{ToolDef, ToolSet};
use serde_json::{Map, Value};
use std::sync::Arc;

const CALL_OPEN: &str = "<function";
const CALL_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<param";
const PARAM_CLOSE: &str = "</param>";
const CDATA_OPEN: &str = "<![CDATA[";
const CDATA_CLOSE: &str = "]]>";

/// A possible call shorter than this is read again with every piece of text.
const REREAD_BELOW: usize = 256;

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON object's text, in the order the model wrote them.
    pub arguments: String,
}

/// Text of the reply that became final: content, then the calls that followed it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// What the text at a possible call's start is, so far.
#[derive(Debug, PartialEq)]
enum Verdict {
    /// A whole call of `len` bytes: its name and its arguments as written.
    Call {
        len: usize,
        name: String,
        params: Vec<RawParam>,
    },
    /// All of it can still begin a call.
    Incomplete,
    /// It is no call, whatever follows.
    NoCall,
}

/// An argument as the model wrote it.
#[derive(Debug, PartialEq)]
struct RawParam {
    key: String,
    /// The value's text: a CDATA section's exactly, else trimmed with entities decoded.
    text: String,
    /// The same before entities were decoded.
    raw: String,
}

/// Why reading stopped: the text ended, or it can be no call.
#[derive(Debug, PartialEq)]
enum Stop {
    Incomplete,
    NoCall,
}

type Read<T> = Result<T, Stop>;

/// A reader over a possible call's text.
struct Cursor<'a> {
    s: &'a str,
    i: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.i..]
    }

    fn ws(&mut self) {
        let rest = self.rest();
        self.i += rest.len() - rest.trim_start().len();
    }

    /// At least one whitespace character, then any more.
    fn ws1(&mut self) -> Read<()> {
        match self.rest().chars().next() {
            None => Err(Stop::Incomplete),
            Some(c) if c.is_whitespace() => {
                self.ws();
                Ok(())
            }
            Some(_) => Err(Stop::NoCall),
        }
    }

    fn lit(&mut self, lit: &str) -> Read<()> {
        let rest = self.rest();
        if rest.starts_with(lit) {
            self.i += lit.len();
            Ok(())
        } else if lit.starts_with(rest) {
            Err(Stop::Incomplete)
        } else {
            Err(Stop::NoCall)
        }
    }

    /// Whether the text here is `lit` (consumed), another tag, or not known yet.
    fn at(&mut self, lit: &str) -> Read<bool> {
        match self.lit(lit) {
            Ok(()) => Ok(true),
            Err(Stop::NoCall) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `name=` and a quoted, non-empty name of characters `allowed` (never the quote).
    fn name_attr(&mut self, allowed: fn(char) -> bool) -> Read<&'a str> {
        self.lit("name=")?;
        let quote = match self.rest().chars().next() {
            None => return Err(Stop::Incomplete),
            Some(q @ ('"' | '\'')) => q,
            Some(_) => return Err(Stop::NoCall),
        };
        self.i += 1;
        let rest = self.rest();
        let Some(end) = rest.find(|c| c == quote || !allowed(c)) else {
            return Err(Stop::Incomplete);
        };
        if end == 0 || !rest[end..].starts_with(quote) {
            return Err(Stop::NoCall);
        }
        self.i += end + 1;
        Ok(&rest[..end])
    }

    /// A tag's name attribute and its end: `WS name="X" WS? >`.
    fn tag_name(&mut self, allowed: fn(char) -> bool) -> Read<&'a str> {
        self.ws1()?;
        let name = self.name_attr(allowed)?;
        self.ws();
        self.lit(">")?;
        Ok(name)
    }

    /// A parameter's value up to and including `</param>`: its text and its raw text. With
    /// `json` (a parameter whose values are JSON), a `</param>` inside a JSON string of a
    /// value that opens with `{`, `[` or `"` is part of the value.
    fn value(&mut self, json: bool) -> Read<(String, String)> {
        let start = self.i;
        self.ws();
        if self.at(CDATA_OPEN)? {
            let rest = self.rest();
            let end = rest.find(CDATA_CLOSE).ok_or(Stop::Incomplete)?;
            let text = rest[..end].to_string();
            self.i += end + CDATA_CLOSE.len();
            self.ws();
            self.lit(PARAM_CLOSE)?;
            return Ok((text.clone(), text));
        }
        self.i = start;
        let rest = self.rest();
        let end = if json {
            json_value_end(rest)
        } else {
            rest.find(PARAM_CLOSE)
        }
        .ok_or(Stop::Incomplete)?;
        self.i += end + PARAM_CLOSE.len();
        let raw = rest[..end].trim();
        Ok((decode_entities(raw), raw.to_string()))
    }
}

/// Where the `</param>` that ends a JSON value in `s` is: the first one outside the value's
/// strings when it opens with `{`, `[` or `"`, else the first.
fn json_value_end(s: &str) -> Option<usize> {
    let body = s.trim_start();
    if !body.starts_with(['{', '[', '"']) {
        return s.find(PARAM_CLOSE);
    }
    let (mut in_string, mut escaped) = (false, false);
    for (i, b) in s.bytes().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
        } else if s.as_bytes()[i..].starts_with(PARAM_CLOSE.as_bytes()) {
            return Some(i);
        }
    }
    None
}

/// The five predefined XML entities decoded; any other `&` is kept.
fn decode_entities(s: &str) -> String {
    if !s.contains('&') {
        return s.to_string();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let entity = [
            ("&lt;", '<'),
            ("&gt;", '>'),
            ("&amp;", '&'),
            ("&quot;", '"'),
            ("&apos;", '\''),
        ]
        .into_iter()
        .find(|(e, _)| rest.starts_with(e));
        match entity {
            Some((e, c)) => {
                out.push(c);
                rest = &rest[e.len()..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// Reads the call `s` begins with (`s` starts with `<function`), to one of `tools`.
fn read_call(s: &str, tools: &ToolSet) -> Read<Verdict> {
    let mut c = Cursor { s, i: 0 };
    c.lit(CALL_OPEN)?;
    // A function's name is known to be none of the tools' as soon as it holds a character
    // no tool name may (see `valid_name`): such text is released at once.
    let name = c.tag_name(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')?;
    let name = name.to_string();
    let tool = tools.get(&name);
    let mut params: Vec<RawParam> = Vec::new();
    loop {
        c.ws();
        if c.at(CALL_CLOSE)? {
            return Ok(Verdict::Call {
                len: c.i,
                name,
                params,
            });
        }
        c.lit(PARAM_OPEN)?;
        let key = c.tag_name(|c| !matches!(c, '<' | '>' | '\n'))?.to_string();
        if params.iter().any(|p| p.key == key) {
            return Err(Stop::NoCall);
        }
        let json = tool.is_some_and(|t| t.json_valued(&key));
        let (text, raw) = c.value(json)?;
        params.push(RawParam { key, text, raw });
    }
}

fn verdict(s: &str, tools: &ToolSet) -> Verdict {
    match read_call(s, tools) {
        Ok(v) => v,
        Err(Stop::Incomplete) => Verdict::Incomplete,
        Err(Stop::NoCall) => Verdict::NoCall,
    }
}

/// The value the parser reads from `written`, the text of parameter `key` of `tool` as the
/// model would write it between `<param name="KEY">` and `</param>`; `None` when that text
/// would be no value.
pub fn read_back(tool: &ToolDef, key: &str, written: &str) -> Option<Value> {
    read_back_as(tool.json_valued(key), &tool.param_types(key), written)
}

/// [`read_back`] for a parameter whose values are JSON or not (`json`,
/// [`ToolDef::json_valued`]) and of the JSON `types` ([`ToolDef::param_types`]), worked out
/// once for many values.
pub fn read_back_as(json: bool, types: &[String], written: &str) -> Option<Value> {
    let s = format!("{written}{PARAM_CLOSE}");
    let mut c = Cursor { s: &s, i: 0 };
    let (text, raw) = c.value(json).ok()?;
    (c.i == s.len()).then(|| typed_value(&text, &raw, types))
}

/// Bytes at the end of `s` that begin `tag` (and so may be its start).
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// The start of the whitespace that ends `s`.
fn trailing_ws(s: &str) -> usize {
    s.trim_end().len()
}

/// Parses tool calls out of a reply's content as it streams in.
#[derive(Debug)]
pub struct ToolCallParser {
    tools: Arc<ToolSet>,
    /// Calls to keep; later ones are dropped (`parallel_tool_calls: false` keeps one).
    max_calls: usize,
    /// Calls taken so far (kept or dropped).
    taken: usize,
    /// Text not yet known to be content or a call.
    held: String,
    /// The last thing decided was a call: whitespace that follows it is dropped.
    after_call: bool,
    /// `held` is a possible call not yet whole, as far as it was read.
    waiting: bool,
}

impl ToolCallParser {
    pub fn new(tools: Arc<ToolSet>, max_calls: usize) -> Self {
        Self {
            tools,
            max_calls,
            taken: 0,
            held: String::new(),
            after_call: false,
            waiting: false,
        }
    }

    /// Takes the next piece of content; returns what became final.
    pub fn push(&mut self, text: &str) -> Parsed {
        let mut out = Parsed::default();
        self.held.push_str(text);
        // A call becomes whole only with a `>`: a long possible call (a long value) is read
        // again only then. Its verdict is the same when read later, only known later.
        if self.waiting && self.held.len() > REREAD_BELOW && !text.contains('>') {
            return out;
        }
        self.run(&mut out, false);
        out
    }

    /// The end of the reply: what is still held is content.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        self.run(&mut out, true);
        let held = std::mem::take(&mut self.held);
        self.emit(&mut out, &held);
        out
    }

    /// Appends content, dropping the whitespace that follows a call.
    fn emit(&mut self, out: &mut Parsed, text: &str) {
        let text = if self.after_call {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.after_call = false;
            out.content.push_str(text);
        }
    }

    /// Decides what it can of `held`; at the `end`, a possible call that is not whole is none.
    fn run(&mut self, out: &mut Parsed, end: bool) {
        self.waiting = false;
        loop {
            let Some(at) = self.held.find(CALL_OPEN) else {
                if end {
                    return;
                }
                // Hold a possible `<function` at the end and the whitespace before it.
                let keep_from = self.held.len() - partial_suffix(&self.held, CALL_OPEN);
                let cut = trailing_ws(&self.held[..keep_from]);
                let text: String = self.held.drain(..cut).collect();
                self.emit(out, &text);
                return;
            };
            match verdict(&self.held[at..], &self.tools) {
                Verdict::Call { len, name, params } => {
                    if let Some(call) = self.take(&name, params) {
                        let before: String = self.held.drain(..at + len).collect();
                        self.emit(out, before[..at].trim_end());
                        self.taken += 1;
                        if self.taken <= self.max_calls {
                            out.calls.push(call);
                        }
                        self.after_call = true;
                        continue;
                    }
                    self.release(out, at);
                }
                Verdict::NoCall => self.release(out, at),
                Verdict::Incomplete => {
                    if end {
                        return;
                    }
                    let cut = trailing_ws(&self.held[..at]);
                    let text: String = self.held.drain(..cut).collect();
                    self.emit(out, &text);
                    self.waiting = true;
                    return;
                }
            }
        }
    }

    /// The text up to and including the `<` at `at` is content: no call starts there.
    fn release(&mut self, out: &mut Parsed, at: usize) {
        let text: String = self.held.drain(..at + 1).collect();
        self.emit(out, &text);
    }

    /// The call, when it names one of the tools, its values typed by the tool's schema.
    fn take(&self, name: &str, params: Vec<RawParam>) -> Option<ParsedCall> {
        let tool = self.tools.get(name)?;
        let mut args = Map::new();
        for p in params {
            let types = tool.param_types(&p.key);
            args.insert(p.key, typed_value(&p.text, &p.raw, &types));
        }
        Some(ParsedCall {
            name: name.to_string(),
            arguments: Value::Object(args).to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Arc<ToolSet> {
        let list = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "where": {"type": "object"},
                    "hours": {"type": "array"},
                    "note": {}
                }}}},
            {"type": "function", "function": {"name": "now"}}
        ]);
        Arc::new(ToolSet::new(list.as_array().unwrap()).unwrap())
    }

    /// The reply fed in `pieces`: its content and calls (name, arguments as JSON).
    fn run_with(pieces: &[&str], max_calls: usize) -> (String, Vec<(String, Value)>) {
        let mut p = ToolCallParser::new(tools(), max_calls);
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut add = |out: Parsed| {
            content += &out.content;
            for c in out.calls {
                calls.push((c.name, serde_json::from_str(&c.arguments).unwrap()));
            }
        };
        for piece in pieces {
            add(p.push(piece));
        }
        add(p.finish());
        (content, calls)
    }

    fn run(pieces: &[&str]) -> (String, Vec<(String, Value)>) {
        run_with(pieces, usize::MAX)
    }

    /// `reply` whole, cut in two at every place, and one character at a time: all the same.
    fn every_cut(reply: &str) -> (String, Vec<(String, Value)>) {
        let whole = run(&[reply]);
        for at in (0..=reply.len()).filter(|&i| reply.is_char_boundary(i)) {
            assert_eq!(run(&[&reply[..at], &reply[at..]]), whole, "cut at {at}");
        }
        let chars: Vec<String> = reply.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&pieces), whole, "one character at a time");
        whole
    }

    #[test]
    fn a_call_after_text_is_parsed_however_the_text_is_cut() {
        let reply = "Let me look.\n<function name=\"get_weather\"><param name=\"city\">Paris\
                     </param><param name=\"days\">3</param></function>";
        let (content, calls) = every_cut(reply);
        assert_eq!(content, "Let me look.");
        assert_eq!(
            calls,
            [("get_weather".into(), json!({"city": "Paris", "days": 3}))]
        );
        // The arguments keep the order the model wrote them in.
        let mut p = ToolCallParser::new(tools(), 9);
        let out = p.push(
            "<function name='get_weather'><param name='days'>1</param>\
                          <param name='city'>Nice</param></function>",
        );
        assert_eq!(out.calls[0].arguments, r#"{"days":1,"city":"Nice"}"#);
    }

    #[test]
    fn several_calls_cdata_and_typed_values() {
        let reply = "<function name=\"get_weather\">\n  <param name=\"city\"><![CDATA[ Rome\n\
                     & <co> ]]></param>\n  <param name=\"metric\">True</param>\n\
                     <param name=\"where\">{'lat': 41.9, \"lon\": 12.5}</param>\
                     <param name=\"hours\">[1, 2]</param><param name=\"note\">  x &amp; y </param>\
                     </function>\n\n<function name=\"now\"></function>\n";
        let (content, calls) = every_cut(reply);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            [
                (
                    "get_weather".into(),
                    json!({"city": " Rome\n& <co> ", "metric": true,
                           "where": {"lat": 41.9, "lon": 12.5}, "hours": [1, 2],
                           "note": "x & y"})
                ),
                ("now".into(), json!({})),
            ]
        );
    }

    /// A JSON value (a parameter whose schema allows no string) may hold `</param>` inside
    /// its strings; it is read as written, before XML entities are decoded.
    #[test]
    fn json_values_hold_their_strings_whole() {
        let reply = "<function name=\"get_weather\"><param name=\"where\">{\"a\": \"x</param>\\\"\
                     &amp;\"}</param><param name=\"hours\"> [\"</param>\"] </param>\
                     <param name=\"city\">a</param></function>";
        let (content, calls) = every_cut(reply);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            [(
                "get_weather".into(),
                json!({"where": {"a": "x</param>\"&amp;"}, "hours": ["</param>"], "city": "a"})
            )]
        );
        // A string left open waits for its end; the reply's end makes it content.
        let open = "<function name=\"get_weather\"><param name=\"where\">\"x</param></function>";
        let (content, calls) = every_cut(open);
        assert!(calls.is_empty());
        assert_eq!(content, open);
        // A text parameter ends at its first `</param>`, quotes or not.
        let text = "<function name=\"get_weather\"><param name=\"city\">\"x</param></function>";
        assert_eq!(
            every_cut(text).1,
            [("get_weather".into(), json!({"city": "\"x"}))]
        );
    }

    #[test]
    fn values_read_back_as_the_parser_reads_them() {
        let tools = tools();
        let t = tools.get("get_weather").unwrap();
        assert_eq!(read_back(t, "city", " a &lt; b "), Some(json!("a < b")));
        assert_eq!(read_back(t, "city", "<![CDATA[ x ]]>"), Some(json!(" x ")));
        assert_eq!(read_back(t, "days", "3"), Some(json!(3)));
        assert_eq!(
            read_back(t, "where", "{\"k\": \"</param>\"}"),
            Some(json!({"k": "</param>"}))
        );
        assert_eq!(read_back(t, "city", "a</param>b"), None);
        assert_eq!(read_back(t, "city", "<![CDATA[x]]>y"), None);
    }

    #[test]
    fn text_between_and_after_calls_is_content() {
        let reply = "A <function name=\"now\"></function> then B \n<function name=\"now\">\
                     </function>  and C. ";
        let (content, calls) = every_cut(reply);
        assert_eq!(content, "Athen Band C. ");
        assert_eq!(calls.len(), 2);
    }

    #[test]
    fn what_is_no_call_stays_content() {
        for reply in [
            // Not the tag, an unknown tool, a broken parameter, a repeated argument.
            "a <functional> b",
            "<function name=\"nope\"><param name=\"x\">1</param></function>",
            "<function name=\"now\"><par name=\"x\">1</par></function>",
            "<function name=\"get_weather\"><param name=\"city\">a</param>\
             <param name=\"city\">b</param></function>",
            "<function name=\"get_weather\"><param name=\"city\"><![CDATA[x]]>y</param></function>",
            "<function name=\"\"></function>",
            "<function name=get_weather></function>",
            "<function\nname=\"now\"\n>< /function>",
            // Cut off by the end of the reply.
            "Sure. <function name=\"get_weather\"><param name=\"city\">Par",
            "<function name=\"get_weather\"><param name=\"city\"><![CDATA[x</param></function>",
            "<funct",
            "x <",
            "日本 <function name=\"日本\">😀",
        ] {
            let (content, calls) = every_cut(reply);
            assert!(calls.is_empty(), "{reply:?}: {calls:?}");
            assert_eq!(content, reply);
        }
        assert_eq!(run(&[""]), (String::new(), Vec::new()));
    }

    #[test]
    fn a_call_after_text_that_is_no_call() {
        let reply = "<function name=\"x\"<function name=\"now\"></function>";
        let (content, calls) = every_cut(reply);
        assert_eq!(content, "<function name=\"x\"");
        assert_eq!(calls.len(), 1);
    }

    #[test]
    fn only_the_first_call_is_kept_when_asked() {
        let reply = "<function name=\"now\"></function>\n<function name=\"get_weather\">\
                     </function>\nDone.";
        let (content, calls) = run_with(&[reply], 1);
        assert_eq!(content, "Done.");
        assert_eq!(calls, [("now".into(), json!({}))]);
    }

    /// Content is released as soon as it cannot begin a call: only a possible tag and the
    /// whitespace before it are held.
    #[test]
    fn nothing_is_held_longer_than_needed() {
        let mut p = ToolCallParser::new(tools(), 9);
        assert_eq!(p.push("Hello <fun").content, "Hello");
        assert_eq!(p.push("ny").content, " <funny");
        assert_eq!(p.push(" world\n").content, " world");
        assert_eq!(p.push("<function name=\"now\">").content, "");
        let out = p.push("</function>");
        assert_eq!((out.content.as_str(), out.calls.len()), ("", 1));
        assert_eq!(p.push(" \n ok").content, "ok");
        // A name no tool can have is known at once.
        assert_eq!(
            p.push(" <function name=\"天").content,
            " <function name=\"天"
        );
        assert_eq!(p.finish(), Parsed::default());
    }
}
