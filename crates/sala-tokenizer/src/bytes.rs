//! Every token as the bytes it adds to the text: what byte-level work on the output, such as
//! constrained decoding, needs to know of the vocabulary.
//!
//! Two piece spellings exist among Hugging Face tokenizers:
//! * SentencePiece style (Llama, MiniCPM): `▁` stands for a space and `<0xAB>` pieces are
//!   single bytes (byte fallback); every other piece is its own UTF-8 text.
//! * byte-level BPE (GPT-2, Qwen, Llama 3): each byte is written as one printable character
//!   (GPT-2's table: printable Latin-1 bytes as themselves, the other 68 bytes as U+0100 on).
//!
//! Added tokens are their content, as written. The leading space that a SentencePiece decoder
//! strips from the first token of a text is kept: the bytes are what the token adds in the
//! middle of a text.

use crate::tokenizer::Tokenizer;
use std::collections::HashMap;

/// A token's bytes ([`Tokenizer::vocab_bytes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBytes {
    pub bytes: Vec<u8>,
    /// An added token marked special (`<|im_end|>`, `<s>`): it is not text.
    pub special: bool,
}

/// The byte each character of GPT-2's byte-level alphabet stands for.
fn byte_level_alphabet() -> HashMap<char, u8> {
    // Bytes that print (and are not a space) stand for themselves; the rest, in byte order,
    // take the characters from U+0100 on.
    let prints = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            let c = if prints(b) {
                char::from(b)
            } else {
                next += 1;
                char::from_u32(next - 1).expect("below U+0200")
            };
            (c, b)
        })
        .collect()
}

/// `<0xAB>` as the byte 0xAB.
fn byte_piece(piece: &str) -> Option<u8> {
    piece
        .strip_prefix("<0x")?
        .strip_suffix('>')
        .filter(|hex| hex.len() == 2)
        .and_then(|hex| u8::from_str_radix(hex, 16).ok())
}

/// Whether the tokenizer's decoder is (or holds) GPT-2's byte-level decoder.
fn decodes_byte_level(tok: &tokenizers::Tokenizer) -> bool {
    fn holds(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(m) => {
                m.get("type").and_then(|t| t.as_str()) == Some("ByteLevel") || m.values().any(holds)
            }
            serde_json::Value::Array(a) => a.iter().any(holds),
            _ => false,
        }
    }
    tok.get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .is_some_and(|v| holds(&v))
}

impl Tokenizer {
    /// The bytes of every id below [`Tokenizer::vocab_size`], in id order; an id with no
    /// token has no bytes.
    pub fn vocab_bytes(&self) -> Vec<TokenBytes> {
        let tok = self.inner();
        let added = tok.get_added_tokens_decoder();
        let alphabet = decodes_byte_level(tok).then(byte_level_alphabet);
        (0..self.vocab_size() as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return TokenBytes {
                        bytes: t.content.clone().into_bytes(),
                        special: t.special,
                    };
                }
                let Some(piece) = tok.id_to_token(id) else {
                    return TokenBytes::default();
                };
                let bytes = match &alphabet {
                    // A piece outside the alphabet is left as its text.
                    Some(map) => match piece.chars().map(|c| map.get(&c).copied()).collect() {
                        Some(bytes) => bytes,
                        None => piece.into_bytes(),
                    },
                    None => match byte_piece(&piece) {
                        Some(b) => vec![b],
                        None => piece.replace('\u{2581}', " ").into_bytes(),
                    },
                };
                TokenBytes {
                    bytes,
                    special: false,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testgen::write_test_tokenizer;

    #[test]
    fn sentencepiece_pieces_are_their_text_bytes_and_specials_are_marked() {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(dir.path(), 2048).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let bytes = tok.vocab_bytes();
        assert_eq!(bytes.len(), tok.vocab_size());
        let im_end = tok.token_to_id("<|im_end|>").unwrap() as usize;
        assert_eq!(
            bytes[im_end],
            TokenBytes {
                bytes: b"<|im_end|>".to_vec(),
                special: true
            }
        );
        assert!(bytes[1].special, "<s>");
        assert_eq!(bytes[3 + 0xE4].bytes, [0xE4], "<0xE4>");
        // Every ordinary token's bytes are what decoding it in a text adds.
        let a = tok.encode("a", false).unwrap();
        assert_eq!(a.len(), 1);
        let a = a[0];
        for id in (259..im_end as u32).step_by(7) {
            let want = tok.decode(&[a, id], false).unwrap();
            let got = [&bytes[a as usize].bytes[..], &bytes[id as usize].bytes[..]].concat();
            // The decoder strips the text's leading space.
            assert_eq!(&got[1..], want.as_bytes(), "id {id}");
        }
    }

    #[test]
    fn a_byte_level_tokenizer_reads_through_gpt2_alphabet() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [{"id": 4, "content": "<|end|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false,
                "vocab": {"a": 0, "\u{120}": 1, "\u{120}a": 2, "\u{10A}": 3},
                "merges": ["\u{120} a"]}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = Tokenizer::from_files(&path, None, None).unwrap();
        let got: Vec<_> = tok
            .vocab_bytes()
            .into_iter()
            .map(|t| (t.bytes, t.special))
            .collect();
        assert_eq!(
            got,
            [
                (b"a".to_vec(), false),
                (b" ".to_vec(), false),
                (b" a".to_vec(), false),
                (b"\n".to_vec(), false),
                (b"<|end|>".to_vec(), true)
            ]
        );
    }

    #[test]
    fn byte_level_pieces_map_back_to_bytes() {
        let map = byte_level_alphabet();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'\u{120}'], b' ', "Ġ");
        assert_eq!(map[&'\u{10A}'], b'\n', "Ċ");
        assert_eq!(map[&'a'], b'a');
        assert_eq!(map[&'\u{100}'], 0);
        let mut seen: Vec<u8> = map.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
    }
}
