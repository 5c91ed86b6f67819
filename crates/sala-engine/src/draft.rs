//! Draft tokens for speculative decoding: guesses of what a sequence says next, which the
//! model then verifies in one step. [`PromptLookup`] guesses by finding the sequence's latest
//! words earlier in it (prompt or output) and proposing what followed them there: long prompts
//! are copied from a lot.

use std::collections::HashMap;
use std::sync::Arc;

/// A request's speculative decoding: drafts of up to `max_draft` tokens from `drafts`, each
/// verified in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Speculate {
    pub max_draft: usize,
    pub drafts: DraftSource,
}

/// Where a request's drafts come from.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftSource {
    /// [`PromptLookup`] over the prompt and the output so far.
    PromptLookup,
    /// A continuation known beforehand ([`KnownContinuation`], for benchmarks): `sequence`
    /// is the prompt and the tokens expected after it; each draft's first `right` tokens are
    /// the sequence's, the rest wrong.
    Known { sequence: Arc<[u32]>, right: usize },
    /// The engine's EAGLE-3 draft model ([`crate::generate::Engine::set_draft`]).
    Model,
}

impl Speculate {
    /// Prompt-lookup drafts of up to `max_draft` tokens.
    pub fn prompt_lookup(max_draft: usize) -> Self {
        Self {
            max_draft,
            drafts: DraftSource::PromptLookup,
        }
    }

    /// A drafter for a request with this prompt; `None` for the draft model's drafts, which
    /// the engine makes.
    pub fn drafter(&self, prompt: &[u32]) -> Option<Box<dyn Drafter + Send>> {
        let mut d: Box<dyn Drafter + Send> = match &self.drafts {
            DraftSource::PromptLookup => Box::new(PromptLookup::new(2, 5, self.max_draft)),
            DraftSource::Known { sequence, right } => {
                Box::new(KnownContinuation::new(sequence.clone(), *right))
            }
            DraftSource::Model => return None,
        };
        d.extend(prompt);
        Some(d)
    }
}

/// A source of draft tokens for one sequence.
pub trait Drafter {
    /// Tokens the sequence now holds beyond those seen before (the prompt, then each accepted
    /// token).
    fn extend(&mut self, tokens: &[u32]);
    /// Up to `max` tokens to follow the sequence, best guess first; none when it has none.
    fn draft(&mut self, max: usize) -> Vec<u32>;
    /// How the last draft fared: `accepted` of its `drafted` tokens were the model's.
    fn verified(&mut self, drafted: usize, accepted: usize);
}

/// Prompt lookup: the longest of the sequence's last `max_ngram` .. `min_ngram` tokens that
/// occurred before, at its latest earlier place, and the tokens that followed it there. One
/// hash map per n-gram length holds the end of each n-gram's latest occurrence (a hit is
/// checked against the tokens, so a hash collision is no draft), so appending a token costs a
/// few map updates whatever the length. The draft's length adapts to how many of the recent
/// drafts were accepted.
#[derive(Debug, Clone)]
pub struct PromptLookup {
    tokens: Vec<u32>,
    min_ngram: usize,
    /// `ends[n - min_ngram]`: hash of an n-gram → the index of its last token, for every
    /// n-gram that ends before the sequence's last token.
    ends: Vec<HashMap<u64, u32>>,
    /// Tokens whose n-grams are in `ends` (the last one's are added once another follows).
    indexed: usize,
    /// Draft length now, between 1 and `max_draft`.
    length: usize,
    max_draft: usize,
}

impl PromptLookup {
    /// N-grams of `min_ngram..=max_ngram` tokens (at least 1), drafts of up to `max_draft`.
    pub fn new(min_ngram: usize, max_ngram: usize, max_draft: usize) -> Self {
        let min_ngram = min_ngram.max(1);
        let max_ngram = max_ngram.max(min_ngram);
        let max_draft = max_draft.max(1);
        Self {
            tokens: Vec::new(),
            min_ngram,
            ends: vec![HashMap::new(); max_ngram - min_ngram + 1],
            indexed: 0,
            length: max_draft.min(4),
            max_draft,
        }
    }

    /// The draft length the next draft may take.
    pub fn draft_length(&self) -> usize {
        self.length
    }

    fn max_ngram(&self) -> usize {
        self.min_ngram + self.ends.len() - 1
    }

    /// Adds the n-grams ending at every token but the last to the maps.
    fn index(&mut self) {
        let last = self.tokens.len().saturating_sub(1);
        while self.indexed < last {
            let end = self.indexed;
            for (i, map) in self.ends.iter_mut().enumerate() {
                let n = self.min_ngram + i;
                if end + 1 >= n {
                    map.insert(hash(&self.tokens[end + 1 - n..=end]), end as u32);
                }
            }
            self.indexed += 1;
        }
    }
}

impl Drafter for PromptLookup {
    fn extend(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }

    fn draft(&mut self, max: usize) -> Vec<u32> {
        self.index();
        let len = self.tokens.len();
        let want = max.min(self.length);
        if want == 0 {
            return Vec::new();
        }
        // Longest match first: the last n tokens, found ending earlier at `end`.
        for n in (self.min_ngram..=self.max_ngram().min(len)).rev() {
            let suffix = &self.tokens[len - n..];
            let Some(&end) = self.ends[n - self.min_ngram].get(&hash(suffix)) else {
                continue;
            };
            let end = end as usize;
            if self.tokens[end + 1 - n..=end] != *suffix {
                continue; // a hash collision
            }
            let follow = &self.tokens[end + 1..];
            return follow[..want.min(follow.len())].to_vec();
        }
        Vec::new()
    }

    fn verified(&mut self, drafted: usize, accepted: usize) {
        self.length = adapt_length(self.length, self.max_draft, drafted, accepted);
    }
}

/// The next draft length after `accepted` of `drafted` drafts stood: all taken, two longer
/// (up to `max`); under half taken, one shorter (down to 1).
pub fn adapt_length(length: usize, max: usize, drafted: usize, accepted: usize) -> usize {
    if drafted == 0 {
        length
    } else if accepted >= drafted {
        (length + 2).min(max)
    } else if 2 * accepted < drafted {
        length.saturating_sub(1).max(1)
    } else {
        length
    }
}

/// Drafts from a sequence known beforehand (a benchmark's drafter: the target's own greedy
/// continuation, computed in a first pass): while the sequence so far is a prefix of it, each
/// draft's first `right` tokens are what follows there and the rest are wrong (the true
/// token's neighbour), so every step accepts `right` drafts, or as many as remain. Once the
/// sequence leaves it (a near-tie decided the other way), no drafts.
#[derive(Debug, Clone)]
pub struct KnownContinuation {
    sequence: Arc<[u32]>,
    right: usize,
    /// Tokens of the request's sequence so far, and whether they are `sequence`'s.
    seen: usize,
    on_track: bool,
}

impl KnownContinuation {
    pub fn new(sequence: Arc<[u32]>, right: usize) -> Self {
        Self {
            sequence,
            right,
            seen: 0,
            on_track: true,
        }
    }
}

impl Drafter for KnownContinuation {
    fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.on_track &= self.sequence.get(self.seen) == Some(&t);
            self.seen += 1;
        }
    }

    fn draft(&mut self, max: usize) -> Vec<u32> {
        if !self.on_track {
            return Vec::new();
        }
        let next = &self.sequence[self.seen.min(self.sequence.len())..];
        next.iter()
            .take(max)
            .enumerate()
            .map(|(i, &t)| match (i < self.right, t) {
                (true, _) => t,
                (false, 0) => 1,
                (false, _) => t - 1,
            })
            .collect()
    }

    fn verified(&mut self, _drafted: usize, _accepted: usize) {}
}

/// FNV-1a over the tokens' bytes.
fn hash(tokens: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for t in tokens {
        for b in t.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain rule: the longest suffix of `min..=max` tokens found ending earlier (latest
    /// place), and what followed it.
    fn brute(tokens: &[u32], min: usize, max: usize, want: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min..=max.min(len)).rev() {
            let suffix = &tokens[len - n..];
            for end in (n - 1..len - 1).rev() {
                if tokens[end + 1 - n..=end] == *suffix {
                    let follow = &tokens[end + 1..];
                    return follow[..want.min(follow.len())].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn a_known_continuation_drafts_right_tokens_then_wrong_ones_while_on_track() {
        let sequence: Arc<[u32]> = Arc::from(vec![5u32, 6, 7, 0, 9, 10, 11]);
        let spec = Speculate {
            max_draft: 4,
            drafts: DraftSource::Known {
                sequence: sequence.clone(),
                right: 2,
            },
        };
        let mut d = spec.drafter(&[5, 6]).expect("a host drafter");
        assert_eq!(d.draft(4), vec![7, 0, 8, 9]);
        assert_eq!(d.draft(1), vec![7]);
        d.extend(&[7, 0]);
        // The sequence's end bounds the draft; 0's wrong twin is 1.
        assert_eq!(d.draft(4), vec![9, 10, 10]);
        let mut all = KnownContinuation::new(sequence.clone(), 9);
        all.extend(&[5, 6, 7]);
        assert_eq!(all.draft(3), vec![0, 9, 10]);
        // Off the sequence: no drafts, ever after.
        all.extend(&[1]);
        assert!(all.draft(3).is_empty());
        all.extend(&[9]);
        assert!(all.draft(3).is_empty());
        let mut none_right = KnownContinuation::new(sequence, 0);
        none_right.extend(&[5, 6, 7]);
        assert_eq!(none_right.draft(2), vec![1, 8]);
    }

    #[test]
    fn drafts_follow_the_longest_latest_earlier_match() {
        let mut rng = sala_model::numerics::TestRng::new(7);
        for round in 0..40 {
            // Few distinct tokens: many repeats of every length.
            let vocab = 3 + round % 5;
            let mut d = PromptLookup::new(1, 4, 8);
            let (mut seq, mut pending) = (Vec::new(), Vec::new());
            for step in 0..300 {
                let t = rng.below(vocab) as u32;
                seq.push(t);
                pending.push(t);
                // Tokens arrive one to three at a time.
                if rng.below(3) != 0 {
                    continue;
                }
                d.extend(&pending);
                pending.clear();
                let want = 1 + step % 6;
                let got = d.draft(want);
                assert_eq!(
                    got,
                    brute(&seq, 1, 4, want.min(d.draft_length())),
                    "round {round} step {step}"
                );
            }
        }
    }

    #[test]
    fn a_copied_passage_is_drafted_and_the_length_adapts() {
        // A passage, other text, then the passage's start again: its rest is the draft.
        let passage: Vec<u32> = (100..160).collect();
        let mut seq: Vec<u32> = passage.clone();
        seq.extend(200..230);
        seq.extend(&passage[..5]);
        let mut d = PromptLookup::new(2, 5, 8);
        d.extend(&seq);
        assert_eq!(d.draft_length(), 4);
        assert_eq!(d.draft(10), passage[5..9]);
        // Every draft accepted: longer ones, up to the most.
        d.verified(4, 4);
        assert_eq!(d.draft_length(), 6);
        d.verified(6, 6);
        d.verified(8, 8);
        assert_eq!(d.draft_length(), 8);
        assert_eq!(d.draft(10), passage[5..13]);
        assert_eq!(d.draft(3), passage[5..8]);
        // Mostly rejected: shorter, never below one.
        for _ in 0..20 {
            d.verified(4, 0);
        }
        assert_eq!(d.draft_length(), 1);
        // Half taken: unchanged.
        d.verified(4, 2);
        assert_eq!(d.draft_length(), 1);
        // No earlier occurrence of the last tokens: no draft.
        let mut fresh = PromptLookup::new(2, 5, 8);
        fresh.extend(&[1, 2, 3, 4, 5]);
        assert!(fresh.draft(4).is_empty());
        assert!(PromptLookup::new(2, 5, 8).draft(4).is_empty());
    }

    #[test]
    fn a_long_prompt_is_indexed_in_linear_time() {
        // A million tokens of a 64K vocabulary with a repeated tail: indexing and a draft take
        // well under a second in release builds (a quadratic index would take hours).
        let mut rng = sala_model::numerics::TestRng::new(3);
        let mut seq: Vec<u32> = (0..1_000_000).map(|_| rng.below(65536) as u32).collect();
        let tail = seq[500_000..500_010].to_vec();
        seq.extend(&tail);
        let mut d = PromptLookup::new(2, 4, 8);
        let start = std::time::Instant::now();
        d.extend(&seq);
        let got = d.draft(4);
        assert_eq!(got, seq[500_010..500_014]);
        assert!(
            start.elapsed().as_secs_f64() < 10.0,
            "{:?}",
            start.elapsed()
        );
    }
}
