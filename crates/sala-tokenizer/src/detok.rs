//! Streaming detokenization: text that is final as ids arrive one at a time.
//!
//! Technique (prefix offset / read offset): keep the ids already turned into text, decode a
//! small window `ids[prefix..read]` and `ids[prefix..]`, and emit the difference. Decoding a
//! window that starts with an already-emitted token keeps SentencePiece's leading-space
//! stripping (the `Strip` decoder) from eating a real space.
//!
//! Text is held back while it could still change:
//! * after a byte-fallback token (`<0xE4>`): HF's ByteFallback decoder turns a whole run of
//!   byte tokens into U+FFFD per byte if the run is not valid UTF-8, so a later byte can
//!   change text that looked complete; the run is final once an ordinary token follows;
//! * after a special token that is being skipped (it is invisible to the decoder, so byte
//!   runs continue across it);
//! * while the new text ends in U+FFFD.
//!
//! With these rules the concatenation of all pushes plus `finish()` equals
//! `Tokenizer::decode(all_ids, skip_special)`.

use crate::error::Result;
use crate::tokenizer::{TokenKind, Tokenizer};

/// Incremental decoder for one sequence.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    tok: Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the context window (already emitted tokens).
    prefix_offset: usize,
    /// End of the emitted tokens.
    read_offset: usize,
}

impl Detokenizer {
    /// A detokenizer for `tok`; `skip_special` as in [`Tokenizer::decode`].
    pub fn new(tok: &Tokenizer, skip_special: bool) -> Self {
        Self {
            tok: tok.clone(),
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one id; returns the text that became final, if any. An id outside the vocabulary
    /// is an error and is not added.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.tok.check_id(id)?;
        self.ids.push(id);
        match self.tok.kind(id) {
            TokenKind::Byte => return Ok(None),
            TokenKind::Special if self.skip_special => return Ok(None),
            _ => {}
        }
        let (prefix_text, new_text) = self.window_texts()?;
        if new_text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        match new_text.strip_prefix(prefix_text.as_str()) {
            Some(delta) if !delta.is_empty() => {
                let delta = delta.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                Ok(Some(delta))
            }
            _ => Ok(None),
        }
    }

    /// Flushes whatever is held back (end of the sequence). Later pushes continue after it.
    pub fn finish(&mut self) -> Result<String> {
        let (prefix_text, new_text) = self.window_texts()?;
        // The prefix is always a prefix here; fall back to the common prefix rather than panic.
        let delta = match new_text.strip_prefix(prefix_text.as_str()) {
            Some(d) => d.to_string(),
            None => {
                let common = prefix_text
                    .char_indices()
                    .zip(new_text.chars())
                    .take_while(|((_, a), b)| a == b)
                    .last()
                    .map_or(0, |((i, a), _)| i + a.len_utf8());
                new_text[common..].to_string()
            }
        };
        if !delta.is_empty() {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
        }
        Ok(delta)
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn window_texts(&self) -> Result<(String, String)> {
        let prefix = self.tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let new = self
            .tok
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        Ok((prefix, new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testgen::write_test_tokenizer;
    use crate::TokenizerError;

    fn generated(vocab: usize) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(dir.path(), vocab).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    /// Streams `ids`, checking that every piece is emitted once and nothing is lost.
    fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut d = Detokenizer::new(tok, skip);
        let mut pieces = Vec::new();
        for &id in ids {
            if let Some(s) = d.push(id).unwrap() {
                assert!(!s.is_empty());
                pieces.push(s);
            }
        }
        let tail = d.finish().unwrap();
        (pieces, tail)
    }

    /// xorshift64*: deterministic pseudo-random ids without extra dependencies.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> u32 {
            (self.next() % n as u64) as u32
        }
    }

    #[test]
    fn byte_fallback_char_is_not_split() {
        let (_dir, tok) = generated(400);
        let b = |s: &str| tok.token_to_id(s).unwrap();
        // U+4F60 '你' = E4 BD A0 as byte tokens, then an ordinary piece.
        let ids = [b("<0xE4>"), b("<0xBD>"), b("<0xA0>"), b("▁")];
        let mut d = Detokenizer::new(&tok, false);
        assert_eq!(d.push(ids[0]).unwrap(), None);
        assert_eq!(d.push(ids[1]).unwrap(), None);
        assert_eq!(d.push(ids[2]).unwrap(), None);
        let out = d.push(ids[3]).unwrap().unwrap();
        assert_eq!(out, "你 ");
        assert_eq!(d.finish().unwrap(), "");
    }

    #[test]
    fn invalid_byte_run_matches_full_decode() {
        let (_dir, tok) = generated(400);
        let b = |s: &str| tok.token_to_id(s).unwrap();
        // A complete char followed by a lone lead byte: HF's decoder makes the whole run U+FFFD.
        let ids = [b("▁"), b("<0xE4>"), b("<0xBD>"), b("<0xA0>"), b("<0xE5>")];
        let full = tok.decode(&ids, false).unwrap();
        assert_eq!(full, "\u{FFFD}".repeat(4));
        let (pieces, tail) = stream(&tok, &ids, false);
        assert_eq!(pieces.concat() + &tail, full);
    }

    #[test]
    fn leading_space_handling_matches_decode() {
        let (_dir, tok) = generated(1000);
        for text in [
            "Hello world",
            " two  spaces ",
            "a\n\nb",
            "  ",
            "中文 text 😀!",
        ] {
            let ids = tok.encode(text, false).unwrap();
            let (pieces, tail) = stream(&tok, &ids, false);
            assert_eq!(pieces.concat() + &tail, text, "{ids:?}");
        }
    }

    #[test]
    fn encoded_text_streams_back_exactly() {
        let (_dir, tok) = generated(2000);
        let text = "The quick brown fox 跳过了懒狗。 Emoji: 😀🎉 and ñ, ü, 日本語.\nNext line\ttab";
        let ids = tok.encode(text, true).unwrap();
        let (pieces, tail) = stream(&tok, &ids, true);
        assert_eq!(pieces.concat() + &tail, text);
        // More than one piece: text is produced as the stream goes, not only at the end.
        assert!(pieces.len() > 5, "{pieces:?}");
    }

    #[test]
    fn random_ids_stream_equals_full_decode() {
        for vocab in [300, 1500] {
            let (_dir, tok) = generated(vocab);
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ vocab as u64);
            for case in 0..300 {
                let len = 1 + rng.below(40) as usize;
                let ids: Vec<u32> = (0..len)
                    .map(|_| {
                        // Bias towards byte tokens (3..259) so runs of them are common.
                        if rng.below(3) == 0 {
                            3 + rng.below(256)
                        } else {
                            rng.below(vocab)
                        }
                    })
                    .collect();
                for skip in [false, true] {
                    let full = tok.decode(&ids, skip).unwrap();
                    let (pieces, tail) = stream(&tok, &ids, skip);
                    assert_eq!(
                        pieces.concat() + &tail,
                        full,
                        "vocab {vocab} case {case} skip {skip} ids {ids:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn unknown_id_is_rejected_and_stream_continues() {
        let (_dir, tok) = generated(300);
        let mut d = Detokenizer::new(&tok, false);
        let ids = tok.encode("ab", false).unwrap();
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(id).unwrap().unwrap_or_default());
        }
        assert!(matches!(
            d.push(300).unwrap_err(),
            TokenizerError::UnknownId { id: 300, .. }
        ));
        assert_eq!(d.ids(), &ids[..]);
        out.push_str(&d.finish().unwrap());
        assert_eq!(out, "ab");
    }
}
