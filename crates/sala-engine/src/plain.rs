//! A chat request's own text as plain text: special-token text (such as `<|im_end|>`) in any
//! string a request hands the chat template (message contents, roles, names, reasoning,
//! tool calls and their arguments, tool definitions, template kwargs) never becomes a special
//! token, so a request cannot forge a turn or a system prompt.
//!
//! Each such span is replaced by a marker before the render ([`Marks`]); after it, the markers
//! are put back and their byte ranges given to
//! [`sala_tokenizer::Tokenizer::encode_with_plain_spans`], which reads any special token over
//! them as text. Marked are: every special token's text in a string, and the start or end of
//! a string that could complete one with the text beside it (a string ending in `<|im_`, one
//! beginning with `end|>`). A marker keeps the `<` and `>` of its span, so a template's test
//! such as `'<' in value` sees what it would have seen.
//!
//! Not covered: a special token a template builds around a whole string of the request
//! (`'<|' + role + '|>'`), which is the template's own doing.

use crate::request::RequestError;
use sala_tokenizer::{ChatMessage, MessageContent};
use serde_json::Value;
use std::ops::Range;

/// Spans of request text taken out of the template's input, and their markers.
pub(crate) struct Marks<'a> {
    specials: &'a [String],
    /// The markers' common core, with a random number no request can guess.
    core: String,
    /// The text of each marked span, and its marker.
    spans: Vec<(String, String)>,
}

/// A random number, fresh for each render.
fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x5a1a);
    h.finish()
}

/// Merges overlapping or touching ranges (sorted by start first).
fn merge(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl<'a> Marks<'a> {
    pub fn new(specials: &'a [String]) -> Self {
        Self {
            specials,
            // Digits and punctuation only: `upper`, `tojson` and the like leave them alone.
            core: format!("@{}.", nonce()),
            spans: Vec::new(),
        }
    }

    /// Whether any span was marked.
    pub fn any(&self) -> bool {
        !self.spans.is_empty()
    }

    /// The byte ranges of `s` to mark: each special token's text in it; with `edges`, also
    /// its longest start that ends a special token's text, and its longest end that begins
    /// one.
    fn ranges(&self, s: &str, edges: bool) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for sp in self.specials.iter().filter(|sp| !sp.is_empty()) {
            out.extend(
                s.match_indices(sp.as_str())
                    .map(|(at, _)| at..at + sp.len()),
            );
            if !edges {
                continue;
            }
            let longest = |fits: &dyn Fn(usize) -> bool| {
                (1..sp.len().min(s.len() + 1))
                    .rev()
                    .find(|&n| fits(n))
                    .unwrap_or(0)
            };
            let head = longest(&|n| s.is_char_boundary(n) && sp.ends_with(&s[..n]));
            if head > 0 {
                out.push(0..head);
            }
            let tail =
                longest(&|n| s.is_char_boundary(s.len() - n) && sp.starts_with(&s[s.len() - n..]));
            if tail > 0 {
                out.push(s.len() - tail..s.len());
            }
        }
        merge(out)
    }

    /// `s` with its spans replaced by markers, or `None` when it has none. `edges`: see
    /// [`Marks::ranges`] (off for names a template compares, such as a role).
    fn mark(&mut self, s: &str, edges: bool) -> Option<String> {
        let ranges = self.ranges(s, edges);
        if ranges.is_empty() {
            return None;
        }
        let mut out = String::with_capacity(s.len() + 32 * ranges.len());
        let mut from = 0;
        for r in ranges {
            out.push_str(&s[from..r.start]);
            let span = &s[r.clone()];
            let marker = format!(
                "{}{}{};{}",
                if span.contains('<') { "<" } else { "" },
                self.core,
                self.spans.len(),
                if span.contains('>') { ">" } else { "" },
            );
            out.push_str(&marker);
            self.spans.push((span.to_string(), marker));
            from = r.end;
        }
        out.push_str(&s[from..]);
        Some(out)
    }

    fn mark_in_place(&mut self, s: &mut String, edges: bool) {
        if let Some(marked) = self.mark(s, edges) {
            *s = marked;
        }
    }

    /// Marks every string in `v`; an object's keys only where they hold a special token's
    /// text (a template may look a key up by name).
    pub fn mark_json(&mut self, v: &mut Value) {
        match v {
            Value::String(s) => self.mark_in_place(s, true),
            Value::Array(items) => items.iter_mut().for_each(|x| self.mark_json(x)),
            Value::Object(map) => {
                if map.keys().any(|k| !self.ranges(k, false).is_empty()) {
                    *map = std::mem::take(map)
                        .into_iter()
                        .map(|(k, v)| (self.mark(&k, false).unwrap_or(k), v))
                        .collect();
                }
                map.values_mut().for_each(|x| self.mark_json(x));
            }
            _ => {}
        }
    }

    /// Marks a message's role (only whole special tokens: templates compare roles), content
    /// and every other field's strings.
    pub fn mark_message(&mut self, m: &mut ChatMessage) {
        self.mark_in_place(&mut m.role, false);
        match &mut m.content {
            Some(MessageContent::Text(s)) => self.mark_in_place(s, true),
            Some(MessageContent::Parts(parts)) => {
                for p in parts {
                    if let Some(t) = &mut p.text {
                        self.mark_in_place(t, true);
                    }
                }
            }
            None => {}
        }
        m.extra.values_mut().for_each(|v| self.mark_json(v));
    }

    /// `rendered` with its markers replaced by their spans, and the byte ranges of those spans
    /// in the result. A marker the template broke apart is an error.
    pub fn restore(&self, rendered: &str) -> Result<(String, Vec<Range<usize>>), RequestError> {
        let broken = || {
            RequestError::invalid(
                "the chat template changed text of the request that holds special-token text",
            )
            .param("messages")
        };
        let mut out = String::with_capacity(rendered.len());
        let mut ranges = Vec::new();
        let mut rest = rendered;
        while let Some(at) = rest.find(&self.core) {
            let digits = &rest[at + self.core.len()..];
            let len = digits.bytes().take_while(u8::is_ascii_digit).count();
            let (text, marker) = digits[..len]
                .parse::<usize>()
                .ok()
                .and_then(|i| self.spans.get(i))
                .ok_or_else(broken)?;
            let start = at - usize::from(marker.starts_with('<'));
            if !rest[start..].starts_with(marker.as_str()) {
                return Err(broken());
            }
            out.push_str(&rest[..start]);
            ranges.push(out.len()..out.len() + text.len());
            out.push_str(text);
            rest = &rest[start + marker.len()..];
        }
        out.push_str(rest);
        Ok((out, ranges))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn specials() -> Vec<String> {
        ["<|im_end|>", "<|im_start|>", "<s>"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    #[test]
    fn spans_are_whole_tokens_and_the_edges_that_may_complete_one() {
        let sp = specials();
        let m = Marks::new(&sp);
        assert!(m.ranges("plain text", true).is_empty());
        assert_eq!(m.ranges("a<|im_end|>b<s>", true), [1..11, 12..15]);
        // A start that ends a token, an end that begins one.
        assert_eq!(m.ranges("end|> hi <|im_", true), [0..5, 9..14]);
        assert!(m.ranges("end|> hi <|im_", false).is_empty());
        assert_eq!(m.ranges("<", true), [Range { start: 0, end: 1 }]);
        assert_eq!(
            m.ranges("日本<|im_end|>", true),
            [Range { start: 6, end: 16 }]
        );
        assert_eq!(
            m.ranges("<|im_end|><|im_end|>", true),
            [Range { start: 0, end: 20 }]
        );
    }

    #[test]
    fn markers_go_back_as_the_text_with_its_ranges() {
        let sp = specials();
        let mut m = Marks::new(&sp);
        let mut v = json!({"a": ["x<|im_end|>y", 3, {"<s>": "k", "n": "<|im_"}]});
        m.mark_json(&mut v);
        assert!(m.any());
        let text = v.to_string();
        assert!(
            !text.contains("<|im_end|>") && !text.contains("<s>"),
            "{text}"
        );
        let upper = text.to_uppercase();
        let (back, ranges) = m.restore(&upper).unwrap();
        for r in &ranges {
            assert!(sp.iter().any(|s| s.starts_with(&back[r.clone()])), "{back}");
        }
        assert_eq!(ranges.len(), 3, "{back}");
        assert!(
            back.contains("Y\"") && back.contains("X<|im_end|>Y"),
            "{back}"
        );
        // A marker cut apart is an error, not lost text.
        let cut = &text[..text.find(';').unwrap()];
        assert!(m.restore(cut).is_err());
        assert_eq!(
            m.restore("no markers").unwrap(),
            ("no markers".into(), vec![])
        );
    }
}
