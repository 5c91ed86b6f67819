//! A self-consistent, deterministic test tokenizer laid out like the MiniCPM-SALA vocabulary
//! (SPEC §9), scaled down to any `vocab_size`.
//!
//! Layout: id 0 `<unk>`, 1 `<s>`, 2 `</s>`, 3..=258 the byte-fallback pieces `<0x00>`..`<0xFF>`,
//! then ordinary SentencePiece-style pieces up to `vocab_size - 8`, then the 8 added special
//! tokens (`<|im_end|>` = `vocab_size - 8`, ...).
//!
//! Ordinary pieces, in id order:
//! 1. single characters of a small embedded English + Chinese sample (plus printable ASCII),
//!    `▁` first, then by frequency;
//! 2. BPE merges learned on that sample by a plain greedy loop (most frequent adjacent pair,
//!    ties to the lowest piece ids; pieces at most 16 characters; words never span a space);
//!    every merge's parts and result are in the vocabulary;
//! 3. when the sample has no pairs left: more single characters (Latin, Greek, Cyrillic, kana,
//!    CJK ideographs, Hangul), reachable as they need no merge;
//! 4. when those run out (around 33k pieces): `<unused{n}>` filler pieces, valid in the vocab
//!    but never produced by encoding.
//!
//! For small vocabularies (`vocab_size` below roughly 900) only the most frequent characters
//! fit; a quarter of the piece budget is kept for merges. Characters outside the vocabulary
//! encode through byte fallback, so every text round-trips.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::OnceLock;

use serde_json::{json, Map, Value};

use crate::error::{Result, TokenizerError};

/// The 8 added special tokens, in id order at the top of the vocabulary.
pub const ADDED_SPECIAL_TOKENS: [&str; 8] = [
    "<|im_end|>",
    "<|im_start|>",
    "<|tool_call|>",
    "<|execute_start|>",
    "<|execute_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
];

/// Smallest vocabulary `write_test_tokenizer` accepts: 3 control tokens, 256 byte pieces,
/// the `▁` piece and the 8 added tokens.
pub const MIN_TEST_VOCAB_SIZE: usize = FIRST_PIECE_ID + 1 + ADDED_SPECIAL_TOKENS.len();

const FIRST_PIECE_ID: usize = 3 + 256;
const SPACE: char = '▁';
const MAX_PIECE_CHARS: usize = 16;
const CORPUS: &str = include_str!("corpus.txt");

/// The chat template written into the test `tokenizer_config.json`, with the semantics of
/// MiniCPM's tools template (SPEC §9b) in words of its own (the real text is not known, SPEC
/// §13.1): `{{- bos_token }}` first (SPEC §14); ChatML turns; with `tools`, a system turn
/// holding the system message, the tools as JSON (`tojson(ensure_ascii=False)`) inside
/// `<tools></tools>`, and how to call them: `<function name="NAME"><param name="ARG">VALUE
/// </param>...</function>`, a value holding `<`, `&` or a line break as `<![CDATA[...]]>`.
/// An assistant turn's `tool_calls` are written back in that form (object arguments; string
/// values as they are, others as JSON), several joined by newlines; `tool` messages are
/// `<tool_response>` blocks in a user turn, consecutive ones sharing it.
/// `add_generation_prompt` adds the assistant header, and `enable_thinking=false`
/// `<think>\n\n</think>\n\n` after it.
pub const TEST_CHAT_TEMPLATE: &str = r#"{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson(ensure_ascii=False) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, write <function name="NAME"> followed by each argument as <param name="ARGUMENT">VALUE</param>, then </function>. Write a value that holds <, & or a line break as <![CDATA[VALUE]]>. Several calls may follow one another, one per line.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if tools and loop.first and message.role == 'system' %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + (message.content or '') + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\n' + (message.content or '') }}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<function name="' + fn.name + '">' }}
            {%- if fn.arguments is mapping %}
                {%- for key, value in fn.arguments.items() %}
                    {{- '<param name="' + key + '">' }}
                    {%- if value is string %}
                        {%- if '<' in value or '&' in value or '\n' in value %}
                            {{- '<![CDATA[' + value + ']]>' }}
                        {%- else %}
                            {{- value }}
                        {%- endif %}
                    {%- else %}
                        {{- value | tojson(ensure_ascii=False) }}
                    {%- endif %}
                    {{- '</param>' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

/// Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for a test
/// tokenizer with exactly `vocab_size` ids (see the module docs). Creates `dir` if needed.
/// Deterministic: the same `vocab_size` always gives the same files.
pub fn write_test_tokenizer(dir: &Path, vocab_size: usize) -> Result<()> {
    if vocab_size < MIN_TEST_VOCAB_SIZE {
        return Err(TokenizerError::TestTokenizer {
            message: format!("vocab_size {vocab_size} is below the minimum {MIN_TEST_VOCAB_SIZE}"),
        });
    }
    if vocab_size > u32::MAX as usize {
        return Err(TokenizerError::TestTokenizer {
            message: format!("vocab_size {vocab_size} does not fit u32 ids"),
        });
    }
    let budget = vocab_size - FIRST_PIECE_ID - ADDED_SPECIAL_TOKENS.len();
    let (pieces, merges) = ordinary_pieces(budget);

    std::fs::create_dir_all(dir).map_err(|source| TokenizerError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    write_json(
        &dir.join("tokenizer.json"),
        &tokenizer_json(&pieces, &merges),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config(vocab_size),
    )?;
    write_json(&dir.join("special_tokens_map.json"), &special_tokens_map())?;
    Ok(())
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    std::fs::write(path, text).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn added_token(id: usize, content: &str) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        "normalized": false,
        "special": true
    })
}

fn tokenizer_json(pieces: &[String], merges: &[(String, String)]) -> Value {
    let mut vocab = Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), json!(i));
    }
    for b in 0..256usize {
        vocab.insert(format!("<0x{b:02X}>"), json!(3 + b));
    }
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert(p.clone(), json!(FIRST_PIECE_ID + i));
    }
    let first_added = FIRST_PIECE_ID + pieces.len();
    let mut added: Vec<Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(i, t)| added_token(i, t))
        .collect();
    added.extend(
        ADDED_SPECIAL_TOKENS
            .iter()
            .enumerate()
            .map(|(i, t)| added_token(first_added + i, t)),
    );
    let merges: Vec<Value> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    let bos = |type_id: u32| json!({"SpecialToken": {"id": "<s>", "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});

    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        // Legacy Llama/SentencePiece: prepend "▁", spaces become "▁", no pre-tokenizer.
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
            ]
        },
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos(0), seq("A", 0)],
            "pair": [bos(0), seq("A", 0), bos(1), seq("B", 1)],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": "<unk>",
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges
        }
    })
}

fn tokenizer_config(vocab_size: usize) -> Value {
    let mut decoder = Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        decoder.insert(i.to_string(), special_entry(t));
    }
    let first_added = vocab_size - ADDED_SPECIAL_TOKENS.len();
    for (i, t) in ADDED_SPECIAL_TOKENS.iter().enumerate() {
        decoder.insert((first_added + i).to_string(), special_entry(t));
    }
    json!({
        "add_bos_token": true,
        "add_eos_token": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDED_SPECIAL_TOKENS,
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "chat_template": TEST_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "legacy": true,
        "model_max_length": 1_000_000_000_000_000_000u64,
        "spaces_between_special_tokens": false,
        "tokenizer_class": "LlamaTokenizer"
    })
}

fn special_entry(content: &str) -> Value {
    json!({
        "content": content,
        "lstrip": false,
        "normalized": false,
        "rstrip": false,
        "single_word": false,
        "special": true
    })
}

fn special_tokens_map() -> Value {
    let obj = |t: &str| json!({"content": t, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false});
    json!({
        "additional_special_tokens": ADDED_SPECIAL_TOKENS.iter().map(|t| obj(t)).collect::<Vec<_>>(),
        "bos_token": obj("<s>"),
        "eos_token": obj("<|im_end|>"),
        "unk_token": obj("<unk>")
    })
}

/// Training words: `▁` + each space-separated word of the sample, with counts.
fn corpus_words() -> Vec<(Vec<char>, u64)> {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    for line in CORPUS.lines() {
        for word in line.split(' ').filter(|w| !w.is_empty()) {
            *counts.entry(format!("{SPACE}{word}")).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .map(|(w, n)| (w.chars().collect(), n))
        .collect()
}

/// `▁` first, then sample characters and printable ASCII by frequency (ties by code point).
/// Control characters are left to byte fallback.
fn alphabet(words: &[(Vec<char>, u64)]) -> Vec<char> {
    let mut freq: BTreeMap<char, u64> = BTreeMap::new();
    for c in '!'..='~' {
        freq.insert(c, 0);
    }
    for (w, n) in words {
        for &c in w {
            if !c.is_control() && c != SPACE {
                *freq.entry(c).or_default() += n;
            }
        }
    }
    let mut chars: Vec<(char, u64)> = freq.into_iter().collect();
    chars.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    std::iter::once(SPACE)
        .chain(chars.into_iter().map(|(c, _)| c))
        .collect()
}

/// Result of the greedy BPE loop.
struct Trained {
    pieces: Vec<String>,
    /// (left, right, whether this merge added a new piece) as piece indices.
    merges: Vec<(u32, u32, bool)>,
}

/// Greedy BPE over `words` starting from the single characters `alpha`, until `budget`
/// pieces exist or no pair is left.
fn train(words: &[(Vec<char>, u64)], alpha: &[char], budget: usize) -> Trained {
    let mut pieces: Vec<String> = alpha.iter().map(|c| c.to_string()).collect();
    let mut lens: Vec<usize> = vec![1; pieces.len()];
    let mut index: HashMap<String, u32> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), i as u32))
        .collect();
    // None: a character outside the alphabet (byte fallback); it never merges.
    let mut seqs: Vec<(Vec<Option<u32>>, u64)> = words
        .iter()
        .map(|(w, n)| {
            let syms = w
                .iter()
                .map(|c| index.get(&c.to_string()).copied())
                .collect();
            (syms, *n)
        })
        .collect();
    let mut merges = Vec::new();

    while pieces.len() < budget {
        let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
        for (syms, n) in &seqs {
            for w in syms.windows(2) {
                if let [Some(a), Some(b)] = *w {
                    if lens[a as usize] + lens[b as usize] <= MAX_PIECE_CHARS {
                        *counts.entry((a, b)).or_default() += n;
                    }
                }
            }
        }
        // Highest count; among equal counts the lowest (left, right) ids.
        let best = counts
            .into_iter()
            .max_by(|x, y| x.1.cmp(&y.1).then_with(|| y.0.cmp(&x.0)));
        let Some(((a, b), _)) = best else { break };
        let merged = format!("{}{}", pieces[a as usize], pieces[b as usize]);
        let (id, created) = match index.get(&merged) {
            Some(&id) => (id, false),
            None => {
                let id = pieces.len() as u32;
                index.insert(merged.clone(), id);
                lens.push(lens[a as usize] + lens[b as usize]);
                pieces.push(merged);
                (id, true)
            }
        };
        merges.push((a, b, created));
        for (syms, _) in &mut seqs {
            let mut out = Vec::with_capacity(syms.len());
            let mut i = 0;
            while i < syms.len() {
                if i + 1 < syms.len() && syms[i] == Some(a) && syms[i + 1] == Some(b) {
                    out.push(Some(id));
                    i += 2;
                } else {
                    out.push(syms[i]);
                    i += 1;
                }
            }
            *syms = out;
        }
    }
    Trained { pieces, merges }
}

/// Training with the whole alphabet, run to exhaustion once per process; smaller budgets use
/// a prefix of it (the greedy sequence does not depend on the budget).
fn full_training() -> &'static FullTraining {
    static FULL: OnceLock<FullTraining> = OnceLock::new();
    FULL.get_or_init(|| {
        let words = corpus_words();
        let alpha = alphabet(&words);
        let trained = train(&words, &alpha, usize::MAX);
        FullTraining {
            words,
            alpha,
            trained,
        }
    })
}

struct FullTraining {
    words: Vec<(Vec<char>, u64)>,
    alpha: Vec<char>,
    trained: Trained,
}

/// Extra single characters used once the sample's merges are exhausted.
fn extra_chars() -> impl Iterator<Item = char> {
    let ranges: [(u32, u32); 8] = [
        (0x00C0, 0x024F), // Latin-1 letters, Latin Extended-A/B
        (0x0391, 0x03C9), // Greek
        (0x0410, 0x044F), // Cyrillic
        (0x3041, 0x3096), // Hiragana
        (0x30A1, 0x30FA), // Katakana
        (0x4E00, 0x9FFF), // CJK Unified Ideographs
        (0xAC00, 0xD7A3), // Hangul syllables
        (0x2000, 0x206F), // General punctuation
    ];
    ranges
        .into_iter()
        .flat_map(|(lo, hi)| (lo..=hi).filter_map(char::from_u32))
        .filter(|c| !c.is_control() && !c.is_whitespace())
}

/// `budget` ordinary pieces and the merges that build them.
fn ordinary_pieces(budget: usize) -> (Vec<String>, Vec<(String, String)>) {
    let FullTraining {
        words,
        alpha,
        trained: full,
    } = full_training();
    let n_alpha = alpha.len().min(budget - budget / 4);
    let local;
    let trained: &Trained = if n_alpha == alpha.len() {
        full
    } else {
        local = train(words, &alpha[..n_alpha], budget);
        &local
    };

    // Keep merges in order until the budget is full.
    let mut n_pieces = n_alpha;
    let mut merges = Vec::new();
    for &(a, b, created) in &trained.merges {
        if created && n_pieces == budget {
            break;
        }
        n_pieces += usize::from(created);
        merges.push((
            trained.pieces[a as usize].clone(),
            trained.pieces[b as usize].clone(),
        ));
    }
    let mut pieces: Vec<String> = trained.pieces[..n_pieces].to_vec();

    let mut seen: std::collections::HashSet<String> = pieces.iter().cloned().collect();
    for c in extra_chars() {
        if pieces.len() == budget {
            break;
        }
        let s = c.to_string();
        if seen.insert(s.clone()) {
            pieces.push(s);
        }
    }
    let mut n = 0usize;
    while pieces.len() < budget {
        let s = format!("<unused{n}>");
        n += 1;
        if seen.insert(s.clone()) {
            pieces.push(s);
        }
    }
    (pieces, merges)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChatMessage, ChatOptions, Tokenizer};
    use std::collections::HashSet;

    fn load(vocab: usize) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(dir.path(), vocab).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    fn read_json(path: &Path) -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    const SAMPLES: [&str; 10] = [
        "Hello, world! Test prompt.",
        "How are you",
        "  leading and trailing spaces  ",
        "line one\nline two\n\n\tindented\r\nwindows",
        "你好，世界！语言模型把文本切分成词元。",
        "没见过的字：龘靐齉爩",
        "emoji 😀🎉👍🏽 flags 🇫🇷 zwj 👩‍💻",
        "mixed 中文 and English, ünïcödé, Ελληνικά, русский, 한국어",
        "",
        "x",
    ];

    #[test]
    fn layout_matches_spec_scaled_down() {
        for vocab in [300, 1000, 73_448] {
            let (_dir, tok) = load(vocab);
            assert_eq!(tok.vocab_size(), vocab);
            assert_eq!(tok.token_to_id("<unk>"), Some(0));
            assert_eq!(tok.token_to_id("<s>"), Some(1));
            assert_eq!(tok.token_to_id("</s>"), Some(2));
            assert_eq!(tok.token_to_id("<0x00>"), Some(3));
            assert_eq!(tok.token_to_id("<0x0A>"), Some(13));
            assert_eq!(tok.token_to_id("<0xFF>"), Some(258));
            for (i, t) in ADDED_SPECIAL_TOKENS.iter().enumerate() {
                assert_eq!(tok.token_to_id(t), Some((vocab - 8 + i) as u32), "{t}");
            }
            assert_eq!(tok.eos_ids(), vec![(vocab - 8) as u32]);
            // Every id up to vocab_size has a token and distinct ids have distinct tokens.
            let mut seen = HashSet::new();
            for id in 0..vocab as u32 {
                let t = tok
                    .id_to_token(id)
                    .unwrap_or_else(|| panic!("id {id} missing"));
                assert!(seen.insert(t), "duplicate token at {id}");
            }
            assert!(tok.id_to_token(vocab as u32).is_none());
        }
    }

    #[test]
    fn merges_are_consistent() {
        for vocab in [300, 700, 5000] {
            let dir = tempfile::tempdir().unwrap();
            write_test_tokenizer(dir.path(), vocab).unwrap();
            let tj = read_json(&dir.path().join("tokenizer.json"));
            let model = &tj["model"];
            let vocab_map = model["vocab"].as_object().unwrap();
            assert_eq!(vocab_map.len(), vocab - 8);
            let merges = model["merges"].as_array().unwrap();
            assert!(!merges.is_empty(), "vocab {vocab}: no merges");
            let mut produced: HashSet<String> = HashSet::new();
            for m in merges {
                let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
                assert!(
                    vocab_map.contains_key(a) && vocab_map.contains_key(b),
                    "{a} {b}"
                );
                let joined = format!("{a}{b}");
                assert!(
                    vocab_map.contains_key(&joined),
                    "merge result {joined} missing"
                );
                produced.insert(joined);
            }
            // Every multi-character piece (except fillers) is the result of some merge.
            for piece in vocab_map.keys() {
                let is_special = piece.starts_with('<') && piece.ends_with('>');
                if piece.chars().count() > 1 && !is_special {
                    assert!(
                        produced.contains(piece),
                        "vocab {vocab}: {piece} unreachable"
                    );
                }
            }
        }
    }

    #[test]
    fn encode_uses_merges_and_vocab_pieces() {
        let (_dir, tok) = load(3000);
        let ids = tok.encode("Hello, world! Test prompt.", false).unwrap();
        // Learned merges make common text shorter than one piece per character.
        assert!(
            ids.len() < "Hello, world! Test prompt.".chars().count() / 2,
            "{ids:?}"
        );
        assert!(ids.iter().all(|&i| (259..2992).contains(&i)), "{ids:?}");
        // A character absent from the vocab goes through byte fallback.
        let ids = tok.encode("\u{1F9EA}", false).unwrap();
        let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        assert!(
            pieces.ends_with(&["<0xF0>", "<0x9F>", "<0xA7>", "<0xAA>"].map(String::from)),
            "{pieces:?}"
        );
    }

    #[test]
    fn round_trip_for_varied_text() {
        for vocab in [300, 800, 4000, 40_000] {
            let (_dir, tok) = load(vocab);
            for text in SAMPLES {
                let ids = tok.encode(text, false).unwrap();
                assert_eq!(
                    tok.decode(&ids, false).unwrap(),
                    text,
                    "vocab {vocab}: {ids:?}"
                );
                let with_bos = tok.encode(text, true).unwrap();
                assert_eq!(with_bos[0], 1);
                assert_eq!(tok.decode(&with_bos, true).unwrap(), text);
            }
        }
    }

    #[test]
    fn special_tokens_in_text_encode_to_their_ids() {
        let vocab = 1200;
        let (_dir, tok) = load(vocab);
        for (i, t) in ADDED_SPECIAL_TOKENS.iter().enumerate() {
            let id = (vocab - 8 + i) as u32;
            let ids = tok.encode(&format!("abc{t}def"), false).unwrap();
            assert_eq!(ids.iter().filter(|&&x| x == id).count(), 1, "{t}: {ids:?}");
            let pos = ids.iter().position(|&x| x == id).unwrap();
            assert_eq!(tok.decode(&ids[..pos], false).unwrap(), "abc");
            // Legacy SentencePiece: text after a special token gets a "▁" prepended.
            assert_eq!(tok.decode(&ids[pos + 1..], false).unwrap(), "def");
            assert_eq!(tok.decode(&ids, true).unwrap(), "abc def");
        }
        assert_eq!(tok.encode("</s>", false).unwrap(), vec![2]);
        assert_eq!(tok.encode("<unk>", false).unwrap(), vec![0]);
    }

    #[test]
    fn chat_template_renders_and_gives_one_bos() {
        let (_dir, tok) = load(900);
        let tmpl = tok.chat_template().unwrap();
        let msgs = [ChatMessage::new("user", "Hello, world! Test prompt.")];
        let mut opts = ChatOptions {
            add_generation_prompt: true,
            ..Default::default()
        };
        let text = tmpl.render(&msgs, &opts).unwrap();
        assert_eq!(
            text,
            "<s><|im_start|>user\nHello, world! Test prompt.<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tok.encode(&text, true).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1, "{ids:?}");
        assert_eq!(ids[0], 1);
        assert_eq!(ids[1], tok.token_to_id("<|im_start|>").unwrap());

        opts.kwargs.insert("enable_thinking".into(), json!(false));
        let text = tmpl.render(&msgs, &opts).unwrap();
        assert!(
            text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
            "{text:?}"
        );
        opts.kwargs.insert("enable_thinking".into(), json!(true));
        let text = tmpl.render(&msgs, &opts).unwrap();
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text:?}");

        opts.add_generation_prompt = false;
        let text = tmpl.render(&msgs, &opts).unwrap();
        assert!(text.ends_with("Test prompt.<|im_end|>\n"), "{text:?}");
    }

    #[test]
    fn chat_template_tools_turn() {
        let (_dir, tok) = load(500);
        let tmpl = tok.chat_template().unwrap();
        let msgs = [
            ChatMessage::new("system", "You help."),
            ChatMessage::new("user", "天气?"),
        ];
        let opts = ChatOptions {
            add_generation_prompt: true,
            tools: Some(vec![json!({"description": "查询天气", "name": "weather"})]),
            ..Default::default()
        };
        let text = tmpl.render(&msgs, &opts).unwrap();
        let want = "<s><|im_start|>system\nYou help.\n\n# Tools\n\nYou are provided with function \
                    signatures within <tools></tools> XML tags:\n<tools>\n\
                    {\"description\": \"查询天气\", \"name\": \"weather\"}\n</tools>\n\nTo call \
                    a function, write <function name=\"NAME\"> followed by each argument as \
                    <param name=\"ARGUMENT\">VALUE</param>, then </function>. Write a value \
                    that holds <, & or a line break as <![CDATA[VALUE]]>. Several calls may \
                    follow one another, one per line.<|im_end|>\n\
                    <|im_start|>user\n天气?<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(text, want);
    }

    /// An assistant turn's tool calls are written back in the calling dialect (CDATA for a
    /// value with `&` or a line break, JSON for other types), and consecutive tool results
    /// share one user turn.
    #[test]
    fn chat_template_tool_calls_and_results() {
        let (_dir, tok) = load(500);
        let tmpl = tok.chat_template().unwrap();
        let msgs: Vec<ChatMessage> = serde_json::from_value(json!([
            {"role": "user", "content": "Paris and Rome?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                  "arguments": {"city": "Paris", "days": 3}}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                  "arguments": {"city": "Rome & co\n", "units": ["c"], "hot": true}}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            {"role": "assistant", "content": "Sunny, then rain."}
        ]))
        .unwrap();
        let opts = ChatOptions {
            tools: Some(vec![
                json!({"type": "function", "function": {"name": "get_weather"}}),
            ]),
            ..Default::default()
        };
        let text = tmpl.render(&msgs, &opts).unwrap();
        let (_, turns) = text.split_once("one per line.<|im_end|>\n").unwrap();
        let want = "<|im_start|>user\nParis and Rome?<|im_end|>\n<|im_start|>assistant\n\
                    <function name=\"get_weather\"><param name=\"city\">Paris</param>\
                    <param name=\"days\">3</param></function>\n\
                    <function name=\"get_weather\"><param name=\"city\"><![CDATA[Rome & co\n]]>\
                    </param><param name=\"units\">[\"c\"]</param><param name=\"hot\">true\
                    </param></function><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n\
                    </tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n\
                    <|im_start|>assistant\nSunny, then rain.<|im_end|>\n";
        assert_eq!(turns, want);
    }

    #[test]
    fn deterministic_and_min_size() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_test_tokenizer(a.path(), 2500).unwrap();
        write_test_tokenizer(b.path(), 2500).unwrap();
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ] {
            assert_eq!(
                std::fs::read(a.path().join(f)).unwrap(),
                std::fs::read(b.path().join(f)).unwrap(),
                "{f}"
            );
        }
        let err = write_test_tokenizer(a.path(), MIN_TEST_VOCAB_SIZE - 1).unwrap_err();
        assert!(err.to_string().contains("minimum"), "{err}");
        let (_dir, tok) = load(MIN_TEST_VOCAB_SIZE);
        let text = "still round-trips: 中文 😀";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn large_vocab_uses_fillers() {
        let (_dir, tok) = load(100_000);
        assert_eq!(tok.vocab_size(), 100_000);
        assert!(tok.token_to_id("<unused0>").is_some());
        assert!(tok.token_to_id("龘").is_some());
        let text = SAMPLES.join(" | ");
        let ids = tok.encode(&text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}
