//! Stop strings over streamed text.
//!
//! Text arrives in pieces. [`StopMatcher::push`] returns what is safe to show
//! now and holds back the longest tail that could still grow into a stop
//! string. Generation stops as soon as a stop string is complete; the text is
//! cut right before it and the stop string itself is never emitted.

use thiserror::Error;

/// Errors from building a [`StopMatcher`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StopError {
    /// Stop string number `index` is empty (it would match everywhere).
    #[error("stop string {index} is empty")]
    EmptyStopString { index: usize },
}

/// Result of one [`StopMatcher::push`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text to emit now.
    pub text: String,
    /// Index, in the list given to [`StopMatcher::new`], of the stop string
    /// that was completed by this push.
    pub hit: Option<usize>,
}

impl StopStep {
    /// True when this push completed a stop string.
    pub fn stopped(&self) -> bool {
        self.hit.is_some()
    }
}

/// Detects stop strings in streamed text.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Received text not yet emitted: a possible start of a stop string.
    held: String,
    /// Longest stop string length minus one, in bytes: the most ever held.
    max_hold: usize,
    stopped: bool,
}

impl StopMatcher {
    /// Builds a matcher; every stop string must be non-empty. An empty list
    /// passes all text straight through.
    pub fn new(stop_strings: Vec<String>) -> Result<Self, StopError> {
        if let Some(index) = stop_strings.iter().position(|s| s.is_empty()) {
            return Err(StopError::EmptyStopString { index });
        }
        let max_hold = stop_strings.iter().map(|s| s.len() - 1).max().unwrap_or(0);
        Ok(Self {
            stops: stop_strings,
            held: String::new(),
            max_hold,
            stopped: false,
        })
    }

    /// Adds streamed text. When several stop strings are complete, the one
    /// starting earliest wins (equal starts: the lowest index). Once stopped,
    /// further pushes return nothing.
    pub fn push(&mut self, new_text: &str) -> StopStep {
        if self.stopped {
            return StopStep::default();
        }
        self.held.push_str(new_text);
        // Any match lies wholly inside `held`: text emitted earlier was never
        // the start of a stop string.
        let mut best: Option<(usize, usize)> = None;
        for (index, stop) in self.stops.iter().enumerate() {
            if let Some(pos) = self.held.find(stop.as_str()) {
                if best.is_none_or(|(best_pos, _)| pos < best_pos) {
                    best = Some((pos, index));
                }
            }
        }
        if let Some((pos, index)) = best {
            self.held.truncate(pos);
            self.stopped = true;
            return StopStep {
                text: std::mem::take(&mut self.held),
                hit: Some(index),
            };
        }
        let keep = self.partial_start();
        let text = self.held[..keep].to_string();
        self.held.drain(..keep);
        StopStep { text, hit: None }
    }

    /// Start of the longest suffix of `held` that is a proper prefix of some
    /// stop string (`held.len()` if none). Only char boundaries are tried.
    fn partial_start(&self) -> usize {
        let held = &self.held;
        let lowest = held.len().saturating_sub(self.max_hold);
        (lowest..held.len())
            .filter(|&start| held.is_char_boundary(start))
            .find(|&start| {
                let tail = &held[start..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(held.len())
    }

    /// Ends the stream: returns the held-back text (nothing if a stop string
    /// was hit). The matcher is empty afterwards.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// True once a stop string has been hit.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text currently held back.
    pub fn pending(&self) -> &str {
        &self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Rng;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    #[test]
    fn stop_string_split_across_pushes() {
        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("Hello <").text, "Hello ");
        assert_eq!(m.pending(), "<");
        let step = m.push("/");
        assert_eq!((step.text.as_str(), step.hit), ("", None));
        let step = m.push("s> ignored");
        assert_eq!(step.text, "");
        assert_eq!(step.hit, Some(0));
        assert!(m.is_stopped());
        assert_eq!(m.push("more").text, "");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn text_before_stop_in_same_push_is_emitted() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("ab").text, "ab");
        let step = m.push("cdSTOPef");
        assert_eq!(step.text, "cd");
        assert!(step.stopped());
    }

    #[test]
    fn held_prefix_that_diverges_is_released() {
        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("a</").text, "a");
        assert_eq!(m.push("x").text, "</x");
        assert_eq!(m.pending(), "");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut m = matcher(&["world", "lo w"]);
        let step = m.push("hello world");
        assert_eq!(step.text, "hel");
        assert_eq!(step.hit, Some(1));

        // Same result when streamed char by char.
        let mut m = matcher(&["world", "lo w"]);
        let mut out = String::new();
        let mut hit = None;
        for c in "hello world".chars() {
            let step = m.push(&c.to_string());
            out.push_str(&step.text);
            if step.hit.is_some() {
                hit = step.hit;
                break;
            }
        }
        assert_eq!((out.as_str(), hit), ("hel", Some(1)));
    }

    #[test]
    fn equal_start_prefers_lowest_index() {
        let mut m = matcher(&["ab", "a"]);
        assert_eq!(m.push("xab").hit, Some(0));
    }

    #[test]
    fn first_completed_stop_ends_the_stream() {
        // "abcd" would start earlier, but "bc" completes first.
        let mut m = matcher(&["abcd", "bc"]);
        assert_eq!(m.push("ab").text, "");
        let step = m.push("c");
        assert_eq!(step.text, "a");
        assert_eq!(step.hit, Some(1));
    }

    #[test]
    fn holds_only_the_longest_partial_match() {
        let mut m = matcher(&["abcd"]);
        assert_eq!(m.push("xxabcab").text, "xxabc");
        assert_eq!(m.pending(), "ab");
        assert_eq!(m.push("x").text, "abx");

        let mut m = matcher(&["aab"]);
        assert_eq!(m.push("aaa").text, "a");
        assert_eq!(m.pending(), "aa");
        let step = m.push("b");
        assert_eq!((step.text.as_str(), step.hit), ("", Some(0)));

        let mut m = matcher(&["xyz", "yq"]);
        assert_eq!(m.push("ay").text, "a");
        assert_eq!(m.pending(), "y");
    }

    #[test]
    fn utf8_partial_matches() {
        let mut m = matcher(&["日本語"]);
        assert_eq!(m.push("これは日本").text, "これは");
        assert_eq!(m.pending(), "日本");
        assert_eq!(m.push("人です").text, "日本人です");
        let mut m = matcher(&["é!"]);
        assert_eq!(m.push("caféé").text, "café");
        let step = m.push("!x");
        assert_eq!((step.text.as_str(), step.hit), ("", Some(0)));
    }

    #[test]
    fn empty_stop_string_is_rejected() {
        let err = StopMatcher::new(vec!["a".into(), String::new()]).unwrap_err();
        assert_eq!(err, StopError::EmptyStopString { index: 1 });
        assert!(err.to_string().contains("empty"));
    }

    #[test]
    fn no_stop_strings_pass_through() {
        let mut m = StopMatcher::new(Vec::new()).unwrap();
        assert_eq!(m.push("abc").text, "abc");
        assert_eq!(m.pending(), "");
    }

    #[test]
    fn without_hit_everything_is_emitted_unchanged() {
        let mut m = matcher(&["<|im_end|>", "\n\n"]);
        let pieces = [
            "Hi", " <|im", "_e", "nd", "\n", "x", "<", "|", "im_end", "|", "\n",
        ];
        let mut out = String::new();
        for p in pieces {
            let step = m.push(p);
            assert!(!step.stopped());
            out.push_str(&step.text);
        }
        out.push_str(&m.finish());
        assert_eq!(out, pieces.concat());
    }

    /// Longest suffix (by chars) of `text` that is a proper prefix of a stop.
    fn reference_pending(text: &str, stops: &[&str]) -> String {
        let starts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        for &start in &starts {
            let tail = &text[start..];
            if stops
                .iter()
                .any(|s| s.len() > tail.len() && s.starts_with(tail))
            {
                return tail.to_string();
            }
        }
        String::new()
    }

    fn pick(n: usize, rng: &mut Rng) -> usize {
        (rng.next_u64() % n as u64) as usize
    }

    #[test]
    fn random_streams_match_reference() {
        let alphabet = ['a', 'b', 'é', '日', '🙂'];
        let mut rng = Rng::seed_from_u64(7);
        let mut hits = 0;
        for _ in 0..2000 {
            let n_stops = 1 + pick(3, &mut rng);
            let stops: Vec<String> = (0..n_stops)
                .map(|_| {
                    let len = 1 + pick(4, &mut rng);
                    (0..len).map(|_| alphabet[pick(5, &mut rng)]).collect()
                })
                .collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let text: Vec<char> = (0..pick(30, &mut rng))
                .map(|_| alphabet[pick(5, &mut rng)])
                .collect();
            let mut m = StopMatcher::new(stops.clone()).unwrap();
            let (mut seen, mut out) = (String::new(), String::new());
            let mut pos = 0;
            let mut stopped = false;
            while pos < text.len() {
                let end = (pos + 1 + pick(4, &mut rng)).min(text.len());
                let piece: String = text[pos..end].iter().collect();
                pos = end;
                seen.push_str(&piece);
                let step = m.push(&piece);
                out.push_str(&step.text);
                // Reference: the earliest-starting stop complete in all text so far.
                let expected_hit = stop_refs
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| seen.find(s).map(|p| (p, i)))
                    .min();
                match expected_hit {
                    Some((p, i)) => {
                        assert_eq!(step.hit, Some(i), "stops {stops:?} text {seen:?}");
                        assert_eq!(out, seen[..p]);
                        stopped = true;
                        hits += 1;
                        break;
                    }
                    None => {
                        assert_eq!(step.hit, None);
                        assert_eq!(m.pending(), reference_pending(&seen, &stop_refs));
                        assert_eq!(format!("{out}{}", m.pending()), seen);
                    }
                }
            }
            if !stopped {
                out.push_str(&m.finish());
                assert_eq!(out, seen);
            }
        }
        // The generator must exercise both outcomes.
        assert!(hits > 200 && hits < 1800, "hits = {hits}");
    }
}
