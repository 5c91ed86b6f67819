//! A chat reply read as it streams in: its reasoning split off ([`ReasoningSplit`]), then
//! tool calls parsed out of the rest ([`ToolCallParser`]), when the request reads calls.
//!
//! The reply is the prefix the prompt ended with (a forced call's start, see
//! [`crate::tools`]) followed by the generated text: the prefix is read as the reply's
//! first words.

use crate::reasoning::ReasoningSplit;
use crate::tools::parse::{ParsedCall, ToolCallParser};
use crate::tools::CallReading;

/// How to read a chat reply.
#[derive(Debug, Clone, Default)]
pub struct ReplySetup {
    /// Text the reply begins with that the model did not generate (it ended the prompt).
    pub prefix: String,
    /// How to read calls; `None`: the reply holds none.
    pub calls: Option<CallReading>,
}

/// Pieces of a reply that became final.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReplyPiece {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

impl ReplyPiece {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }

    pub fn append(&mut self, other: ReplyPiece) {
        self.reasoning += &other.reasoning;
        self.content += &other.content;
        self.calls.extend(other.calls);
    }
}

/// Reads one chat reply.
#[derive(Debug)]
pub struct ReplyReader {
    /// The prefix, until the first text comes.
    prefix: Option<String>,
    split: ReasoningSplit,
    calls: Option<ToolCallParser>,
}

impl ReplyReader {
    pub fn new(setup: &ReplySetup) -> Self {
        Self {
            prefix: Some(setup.prefix.clone()).filter(|p| !p.is_empty()),
            split: ReasoningSplit::new(),
            calls: setup
                .calls
                .as_ref()
                .map(|r| ToolCallParser::new(r.tools.clone(), r.max_calls)),
        }
    }

    /// Takes the next piece of generated text; returns what became final.
    pub fn push(&mut self, text: &str) -> ReplyPiece {
        match self.prefix.take() {
            Some(prefix) => self.read(&(prefix + text)),
            None => self.read(text),
        }
    }

    fn read(&mut self, text: &str) -> ReplyPiece {
        let s = self.split.push(text);
        let mut piece = ReplyPiece {
            reasoning: s.reasoning,
            ..Default::default()
        };
        self.content(&mut piece, &s.content);
        piece
    }

    fn content(&mut self, piece: &mut ReplyPiece, text: &str) {
        match &mut self.calls {
            Some(parser) => {
                let p = parser.push(text);
                piece.content += &p.content;
                piece.calls.extend(p.calls);
            }
            None => piece.content += text,
        }
    }

    /// The end of the reply: everything still held.
    pub fn finish(&mut self) -> ReplyPiece {
        let mut piece = match self.prefix.take() {
            Some(prefix) => self.read(&prefix),
            None => ReplyPiece::default(),
        };
        let s = self.split.finish();
        piece.reasoning += &s.reasoning;
        let mut rest = ReplyPiece::default();
        self.content(&mut rest, &s.content);
        if let Some(parser) = &mut self.calls {
            let p = parser.finish();
            rest.content += &p.content;
            rest.calls.extend(p.calls);
        }
        piece.append(rest);
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolSet;
    use serde_json::json;
    use std::sync::Arc;

    fn setup(prefix: &str) -> ReplySetup {
        let tools = json!([{"type": "function", "function": {"name": "get_weather"}}]);
        ReplySetup {
            prefix: prefix.into(),
            calls: Some(CallReading {
                tools: Arc::new(ToolSet::new(tools.as_array().unwrap()).unwrap()),
                max_calls: usize::MAX,
            }),
        }
    }

    fn read(setup: &ReplySetup, pieces: &[&str]) -> ReplyPiece {
        let mut r = ReplyReader::new(setup);
        let mut all = ReplyPiece::default();
        for p in pieces {
            all.append(r.push(p));
        }
        all.append(r.finish());
        all
    }

    #[test]
    fn reasoning_then_content_then_calls() {
        let reply = "<think>Weather needs a tool.</think>\n\nChecking.\n<function \
                     name=\"get_weather\"><param name=\"city\">Oslo</param></function>";
        let whole = read(&setup(""), &[reply]);
        assert_eq!(whole.reasoning, "Weather needs a tool.");
        assert_eq!(whole.content, "Checking.");
        assert_eq!(whole.calls[0].arguments, r#"{"city":"Oslo"}"#);
        let chars: Vec<String> = reply.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(read(&setup(""), &pieces), whole);
    }

    /// A forced call's start ended the prompt: the reply is read as if the model wrote it.
    #[test]
    fn the_prefix_begins_the_reply() {
        let s = setup("<function name=\"get_weather\">");
        let got = read(&s, &["<param name=\"city\">Rome</param>", "</function>"]);
        assert_eq!((got.content.as_str(), got.calls.len()), ("", 1));
        // Generated text that makes no call: the prefix and the text are content.
        let got = read(&s, &["zq xv"]);
        assert_eq!(got.content, "<function name=\"get_weather\">zq xv");
        assert!(got.calls.is_empty());
        // Nothing generated at all.
        let got = read(&setup("<function name=\""), &[]);
        assert_eq!(got.content, "<function name=\"");
        // Without call reading, all is content.
        let plain = ReplySetup::default();
        let got = read(&plain, &["<function name=\"get_weather\"></function>"]);
        assert_eq!(got.content, "<function name=\"get_weather\"></function>");
    }
}
