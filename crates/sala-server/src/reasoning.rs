//! A chat reply's reasoning apart from its answer: a reply that opens with `<think>` (after
//! any whitespace) reasons until `</think>`; that text goes to `reasoning_content`, the rest
//! to `content` (its leading whitespace dropped). A reply that does not open with the tag is
//! all content. Text streams in: a tag cut between two pieces is held until it is whole.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace and maybe part of `<think>` so far.
    Start,
    Thinking,
    /// The answer; `trim` while its leading whitespace is still to drop.
    Content {
        trim: bool,
    },
}

/// Splits streamed reply text into reasoning and content.
#[derive(Debug)]
pub struct ReasoningSplit {
    state: State,
    /// Text held back: the start of the reply, or what may be the start of `</think>`.
    held: String,
}

/// Pieces of a reply that became final: reasoning, then content.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl Default for ReasoningSplit {
    fn default() -> Self {
        Self::new()
    }
}

impl ReasoningSplit {
    pub fn new() -> Self {
        Self {
            state: State::Start,
            held: String::new(),
        }
    }

    /// Takes the next piece of the reply; returns what became final.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if OPEN.starts_with(t) {
                        return out;
                    } else {
                        self.state = State::Content { trim: false };
                    }
                }
                State::Thinking => {
                    if let Some(at) = self.held.find(CLOSE) {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + CLOSE.len()..].to_string();
                        self.state = State::Content { trim: true };
                    } else {
                        let keep = partial_suffix(&self.held, CLOSE);
                        let cut = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..cut]);
                        self.held.drain(..cut);
                        return out;
                    }
                }
                State::Content { trim } => {
                    let text = std::mem::take(&mut self.held);
                    let text = if trim { text.trim_start() } else { &text };
                    if !text.is_empty() {
                        self.state = State::Content { trim: false };
                    }
                    out.content.push_str(text);
                    return out;
                }
            }
        }
    }

    /// The end of the reply: what is still held (an unclosed reasoning stays reasoning).
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => Split {
                reasoning: held,
                content: String::new(),
            },
            State::Content { trim: true } => Split {
                reasoning: String::new(),
                content: held.trim_start().to_string(),
            },
            _ => Split {
                reasoning: String::new(),
                content: held,
            },
        }
    }
}

/// Bytes at the end of `s` that begin `tag` (and so may be its start).
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole reply fed in the given pieces: (reasoning, content).
    fn run(pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplit::new();
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let out = s.push(p);
            r += &out.reasoning;
            c += &out.content;
        }
        let out = s.finish();
        (r + &out.reasoning, c + &out.content)
    }

    #[test]
    fn reasoning_is_split_however_the_text_is_cut() {
        let reply = "\n<think>\nLet me see: 2 < 3.</think>\n\nIt is 3.";
        let want = ("\nLet me see: 2 < 3.".to_string(), "It is 3.".to_string());
        assert_eq!(run(&[reply]), want);
        // Every way of cutting it in two, and one character at a time.
        for at in 0..=reply.len() {
            assert_eq!(run(&[&reply[..at], &reply[at..]]), want, "cut at {at}");
        }
        let chars: Vec<String> = reply.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(&pieces), want);
    }

    #[test]
    fn a_reply_without_the_tag_is_all_content() {
        assert_eq!(
            run(&["  Hello", " <think> there"]),
            (String::new(), "  Hello <think> there".into())
        );
        assert_eq!(
            run(&["<thi", "nk it over"]),
            (String::new(), "<think it over".into())
        );
        assert_eq!(run(&[""]), (String::new(), String::new()));
        assert_eq!(run(&["<th"]), (String::new(), "<th".into()));
    }

    #[test]
    fn an_unclosed_reasoning_stays_reasoning() {
        assert_eq!(
            run(&["<think>still going</th"]),
            ("still going</th".into(), String::new())
        );
        assert_eq!(
            run(&["<think>é😀 ok</think>"]),
            ("é😀 ok".into(), String::new())
        );
    }

    /// Text held back is released as soon as it cannot be a tag.
    #[test]
    fn nothing_is_held_longer_than_a_tag() {
        let mut s = ReasoningSplit::new();
        assert_eq!(
            s.push("<think>abc</"),
            Split {
                reasoning: "abc".into(),
                content: String::new()
            }
        );
        assert_eq!(
            s.push("x"),
            Split {
                reasoning: "</x".into(),
                content: String::new()
            }
        );
        assert_eq!(
            s.push("</think> A"),
            Split {
                reasoning: String::new(),
                content: "A".into()
            }
        );
    }
}
