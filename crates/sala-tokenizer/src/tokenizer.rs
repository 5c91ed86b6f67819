//! Loading a Hugging Face tokenizer directory and encoding/decoding with it.

use std::io::ErrorKind as IoErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::chat::ChatTemplate;
use crate::error::{Result, TokenizerError};

/// Per-id facts the streaming detokenizer needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenKind {
    /// No token has this id.
    Unknown,
    /// An ordinary piece.
    Normal,
    /// A byte-fallback piece such as `<0xE4>`.
    Byte,
    /// An added token marked `special` (skipped by `decode(.., true)`).
    Special,
}

/// A loaded tokenizer plus the parts of `tokenizer_config.json` inference needs.
///
/// Cloning is cheap (shared, immutable state).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tok: tokenizers::Tokenizer,
    /// The same, with special-token text encoded as plain text ([`Tokenizer::encode_plain`]).
    plain: tokenizers::Tokenizer,
    /// The text of every special added token.
    special_texts: Vec<String>,
    /// One more than the largest id.
    vocab_size: usize,
    kinds: Vec<TokenKind>,
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
    add_bos_token: bool,
    chat_template: Option<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos", &self.inner.bos)
            .field("eos", &self.inner.eos)
            .field("add_bos_token", &self.inner.add_bos_token)
            .field("has_chat_template", &self.inner.chat_template.is_some())
            .finish()
    }
}

/// Token strings read from the config files (before they are checked against the vocab).
#[derive(Default)]
struct ConfigValues {
    bos: Option<(String, PathBuf)>,
    eos: Option<(String, PathBuf)>,
    add_bos_token: Option<bool>,
    chat_template: Option<String>,
}

impl Tokenizer {
    /// Loads a checkpoint's tokenizer directory.
    ///
    /// * `tokenizer.json` is required.
    /// * `tokenizer_config.json` is optional: `bos_token`, `eos_token` (string or
    ///   `{"content": ..}`), `add_bos_token` (default true, Llama-style) and `chat_template`
    ///   (string, or the list form `[{"name": "default", "template": ..}, ..]`).
    /// * `special_tokens_map.json` is optional and only consulted for `bos_token`/`eos_token`
    ///   missing from `tokenizer_config.json`.
    /// * `chat_template.jinja`, when present, takes precedence over the config's `chat_template`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tokenizer_json = dir.join("tokenizer.json");
        let config = existing(dir.join("tokenizer_config.json"));
        let special_map = existing(dir.join("special_tokens_map.json"));
        let template = existing(dir.join("chat_template.jinja"));
        Self::load(
            &tokenizer_json,
            config.as_deref(),
            special_map.as_deref(),
            template.as_deref(),
        )
    }

    /// Loads from explicit files: `tokenizer.json`, an optional `tokenizer_config.json` and an
    /// optional Jinja chat-template file (which takes precedence over the config's template).
    pub fn from_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Path>,
        chat_template: Option<&Path>,
    ) -> Result<Self> {
        Self::load(tokenizer_json, tokenizer_config, None, chat_template)
    }

    fn load(
        tokenizer_json: &Path,
        config: Option<&Path>,
        special_map: Option<&Path>,
        template_file: Option<&Path>,
    ) -> Result<Self> {
        let mut tok = load_tokenizers_json(tokenizer_json)?;
        // Encoding must never truncate or pad behind the caller's back.
        tok.with_truncation(None)
            .map_err(|source| TokenizerError::Load {
                path: tokenizer_json.to_path_buf(),
                source,
            })?;
        tok.with_padding(None);

        let mut values = ConfigValues::default();
        if let Some(path) = config {
            read_tokenizer_config(path, &mut values)?;
        }
        if let Some(path) = special_map {
            read_special_tokens_map(path, &mut values)?;
        }
        if let Some(path) = template_file {
            values.chat_template = Some(read_text(path)?);
        }

        let resolve = |tok_field: Option<(String, PathBuf)>, field: &str| {
            tok_field
                .map(|(content, path)| match tok.token_to_id(&content) {
                    Some(id) => Ok((content, id)),
                    None => Err(TokenizerError::ConfigField {
                        path,
                        field: field.to_string(),
                        message: format!("token {content:?} is not in tokenizer.json"),
                    }),
                })
                .transpose()
        };
        let bos = resolve(values.bos.take(), "bos_token")?;
        let eos = resolve(values.eos.take(), "eos_token")?;

        let added = tok.get_added_tokens_decoder();
        let max_added = added.keys().map(|&id| id as usize + 1).max().unwrap_or(0);
        let vocab_size = tok.get_vocab_size(true).max(max_added);
        let kinds = (0..vocab_size)
            .map(|id| {
                let id = id as u32;
                match added.get(&id) {
                    Some(t) if t.special => TokenKind::Special,
                    Some(_) => TokenKind::Normal,
                    None => match tok.id_to_token(id) {
                        None => TokenKind::Unknown,
                        Some(piece) if is_byte_piece(&piece) => TokenKind::Byte,
                        Some(_) => TokenKind::Normal,
                    },
                }
            })
            .collect();

        let special_texts = added
            .values()
            .filter(|t| t.special)
            .map(|t| t.content.clone())
            .collect();
        let mut plain = tok.clone();
        plain.set_encode_special_tokens(true);
        Ok(Self {
            inner: Arc::new(Inner {
                plain,
                special_texts,
                tok,
                vocab_size,
                kinds,
                bos,
                eos,
                add_bos_token: values.add_bos_token.unwrap_or(true),
                chat_template: values.chat_template,
            }),
        })
    }

    /// Encodes `text` without the post-processor's special tokens; with `add_bos`, prepends the
    /// BOS id when the config enables `add_bos_token`, a BOS token is known, and the ids do not
    /// already start with it (a template that renders the BOS text must not yield two BOS).
    ///
    /// Special tokens written in `text` (such as `<|im_start|>`) become their ids.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .tok
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        Ok(self.with_bos(enc.get_ids().to_vec(), add_bos))
    }

    /// `ids` with the BOS id first, when `add_bos` asks and [`Tokenizer::encode`] would add it.
    fn with_bos(&self, mut ids: Vec<u32>, add_bos: bool) -> Vec<u32> {
        if let Some(bos) = self.bos_id() {
            if add_bos && self.inner.add_bos_token && ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        ids
    }

    /// [`Tokenizer::encode`], except that a special token whose text overlaps one of the
    /// byte ranges `plain` is plain text. The rest is split at the other special tokens and
    /// each piece between them encoded as one, as [`Tokenizer::encode`] does, so text with
    /// no such overlap encodes exactly as there.
    pub fn encode_with_plain_spans(
        &self,
        text: &str,
        add_bos: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>> {
        if plain.is_empty() {
            return self.encode(text, add_bos);
        }
        // Byte offsets, to see where each special token came from.
        let enc = self
            .inner
            .tok
            .encode(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        let in_plain = |&(s, e): &(usize, usize)| plain.iter().any(|r| s < r.end && r.start < e);
        let tokens = || enc.get_ids().iter().zip(enc.get_offsets());
        let special = |id: u32| self.kind(id) == TokenKind::Special;
        if !tokens().any(|(&id, o)| special(id) && in_plain(o)) {
            return Ok(self.with_bos(enc.get_ids().to_vec(), add_bos));
        }
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 8);
        let mut from = 0;
        for (&id, o) in tokens() {
            if special(id) && !in_plain(o) {
                if o.0 > from {
                    ids.extend(self.encode_plain(&text[from..o.0])?);
                }
                ids.push(id);
                from = o.1;
            }
        }
        if from < text.len() {
            ids.extend(self.encode_plain(&text[from..])?);
        }
        Ok(self.with_bos(ids, add_bos))
    }

    /// Encodes `text` as plain text: special-token text in it (such as `<|im_end|>` typed by a
    /// user) becomes ordinary pieces, never the special token. No BOS.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .plain
            .encode_fast(text, false)
            .map_err(|source| TokenizerError::Encode { source })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of every special added token (such as `<|im_end|>`).
    pub fn special_texts(&self) -> &[String] {
        &self.inner.special_texts
    }

    /// Decodes ids to text (with the tokenizer's decoder: for SentencePiece-style tokenizers the
    /// leading space is stripped). With `skip_special`, special added tokens are left out.
    /// Ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner
            .tok
            .decode(ids, skip_special)
            .map_err(|source| TokenizerError::Decode { source })
    }

    /// The id of a token string (ordinary piece or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tok.id_to_token(id)
    }

    /// One more than the largest token id (model pieces plus added tokens). A model whose
    /// embedding has fewer rows than this cannot embed every token.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The BOS id (`bos_token` of the config), if any.
    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos.as_ref().map(|b| b.1)
    }

    /// The BOS token string, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos.as_ref().map(|b| b.0.as_str())
    }

    /// The ids of the config's `eos_token` (zero or one id; `generation_config.json` may list
    /// more stop ids, which is the caller's business).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.inner.eos.iter().map(|e| e.1).collect()
    }

    /// The EOS token string, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos.as_ref().map(|e| e.0.as_str())
    }

    /// Whether plain encodes prepend BOS (`add_bos_token`, default true).
    pub fn add_bos_token(&self) -> bool {
        self.inner.add_bos_token
    }

    /// The checkpoint's chat-template source, if it has one.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.inner.chat_template.as_deref()
    }

    /// Compiles the checkpoint's chat template, or the ChatML fallback when it has none.
    /// `bos_token`/`eos_token` are made available to the template.
    pub fn chat_template(&self) -> Result<ChatTemplate> {
        match self.chat_template_source() {
            Some(src) => ChatTemplate::new(src, self.bos_token(), self.eos_token()),
            None => ChatTemplate::chatml(self.bos_token(), self.eos_token()),
        }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner.tok
    }

    pub(crate) fn kind(&self, id: u32) -> TokenKind {
        self.inner
            .kinds
            .get(id as usize)
            .copied()
            .unwrap_or(TokenKind::Unknown)
    }

    pub(crate) fn check_id(&self, id: u32) -> Result<()> {
        if self.kind(id) == TokenKind::Unknown {
            return Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.inner.vocab_size,
            });
        }
        Ok(())
    }
}

/// `<0xAB>`: the form the ByteFallback decoder turns into a raw byte.
fn is_byte_piece(piece: &str) -> bool {
    let b = piece.as_bytes();
    b.len() == 6
        && piece.starts_with("<0x")
        && b[5] == b'>'
        && b[3].is_ascii_hexdigit()
        && b[4].is_ascii_hexdigit()
}

fn existing(path: PathBuf) -> Option<PathBuf> {
    path.is_file().then_some(path)
}

fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| {
        if source.kind() == IoErrorKind::NotFound {
            TokenizerError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = read_bytes(path)?;
    String::from_utf8(bytes).map_err(|e| TokenizerError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(IoErrorKind::InvalidData, e),
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = read_bytes(path)?;
    serde_json::from_slice(&bytes).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn load_tokenizers_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = read_bytes(path)?;
    serde_json::from_slice::<tokenizers::Tokenizer>(&bytes).map_err(|source| {
        if source.is_data() {
            // Valid JSON that the tokenizers crate does not accept.
            TokenizerError::Load {
                path: path.to_path_buf(),
                source: Box::new(source),
            }
        } else {
            TokenizerError::Json {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

fn field_error(path: &Path, field: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError::ConfigField {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: message.into(),
    }
}

fn as_object<'a>(path: &Path, v: &'a Value) -> Result<&'a serde_json::Map<String, Value>> {
    v.as_object()
        .ok_or_else(|| field_error(path, "(top level)", "expected a JSON object"))
}

/// A special-token field: `"<s>"`, `{"content": "<s>", ..}` or null.
fn token_field(
    path: &Path,
    obj: &serde_json::Map<String, Value>,
    field: &str,
) -> Result<Option<String>> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(
                path,
                field,
                "object form needs a string `content`",
            )),
        },
        Some(_) => Err(field_error(
            path,
            field,
            "expected a string or an object with `content`",
        )),
    }
}

fn read_tokenizer_config(path: &Path, values: &mut ConfigValues) -> Result<()> {
    let root = read_json(path)?;
    let obj = as_object(path, &root)?;
    values.bos = token_field(path, obj, "bos_token")?.map(|t| (t, path.to_path_buf()));
    values.eos = token_field(path, obj, "eos_token")?.map(|t| (t, path.to_path_buf()));
    values.add_bos_token = match obj.get("add_bos_token") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => return Err(field_error(path, "add_bos_token", "expected true or false")),
    };
    values.chat_template = match obj.get("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => Some(pick_default_template(path, list)?),
        Some(_) => {
            return Err(field_error(
                path,
                "chat_template",
                "expected a string or a list of {name, template}",
            ))
        }
    };
    Ok(())
}

/// The HF list form: `[{"name": "default", "template": ".."}, {"name": "tool_use", ..}]`.
fn pick_default_template(path: &Path, list: &[Value]) -> Result<String> {
    let mut names = Vec::new();
    for (i, entry) in list.iter().enumerate() {
        let name = entry.get("name").and_then(Value::as_str);
        let template = entry.get("template").and_then(Value::as_str);
        match (name, template) {
            (Some("default"), Some(t)) => return Ok(t.to_string()),
            (Some(n), Some(_)) => names.push(n.to_string()),
            _ => {
                return Err(field_error(
                    path,
                    &format!("chat_template[{i}]"),
                    "expected {\"name\": string, \"template\": string}",
                ))
            }
        }
    }
    Err(field_error(
        path,
        "chat_template",
        format!("no template named \"default\" (found {names:?})"),
    ))
}

fn read_special_tokens_map(path: &Path, values: &mut ConfigValues) -> Result<()> {
    let root = read_json(path)?;
    let obj = as_object(path, &root)?;
    if values.bos.is_none() {
        values.bos = token_field(path, obj, "bos_token")?.map(|t| (t, path.to_path_buf()));
    }
    if values.eos.is_none() {
        values.eos = token_field(path, obj, "eos_token")?.map(|t| (t, path.to_path_buf()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testgen::write_test_tokenizer;

    fn generated(vocab: usize) -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        write_test_tokenizer(dir.path(), vocab).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    fn rewrite_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
        let path = dir.join("tokenizer_config.json");
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(v.as_object_mut().unwrap());
        std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
    }

    #[test]
    fn byte_piece_pattern() {
        assert!(is_byte_piece("<0x00>"));
        assert!(is_byte_piece("<0xfF>"));
        assert!(!is_byte_piece("<0xG0>"));
        assert!(!is_byte_piece("<0x100>"));
        assert!(!is_byte_piece("<s>"));
        assert!(!is_byte_piece("<0x0A "));
    }

    #[test]
    fn missing_tokenizer_json_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::MissingFile { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn corrupt_tokenizer_json_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{ not json").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );

        // Valid JSON but not a tokenizer.
        std::fs::write(&path, r#"{"model": {"type": "NoSuchModel"}}"#).unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Load { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    #[test]
    fn corrupt_config_names_file_and_field() {
        let (dir, _) = generated(400);
        rewrite_config(dir.path(), |c| {
            c.insert("add_bos_token".into(), Value::from("yes"));
        });
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("tokenizer_config.json") && msg.contains("add_bos_token"),
            "{msg}"
        );

        rewrite_config(dir.path(), |c| {
            c.insert("add_bos_token".into(), Value::from(true));
            c.insert("bos_token".into(), Value::from("<no-such-token>"));
        });
        let msg = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains("bos_token") && msg.contains("<no-such-token>"),
            "{msg}"
        );

        std::fs::write(dir.path().join("tokenizer_config.json"), "[1, 2").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TokenizerError::Json { .. }), "{err:?}");
    }

    #[test]
    fn config_fields_are_read() {
        let (_dir, tok) = generated(500);
        assert_eq!(tok.vocab_size(), 500);
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_ids(), vec![492]);
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert!(tok.add_bos_token());
        assert!(tok
            .chat_template_source()
            .unwrap()
            .starts_with("{{- bos_token }}"));
    }

    #[test]
    fn eos_object_form_and_special_tokens_map_fallback() {
        let (dir, _) = generated(400);
        rewrite_config(dir.path(), |c| {
            c.insert(
                "eos_token".into(),
                serde_json::json!({"content": "</s>", "lstrip": false}),
            );
            c.remove("bos_token");
        });
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_ids(), vec![2]);
        // bos_token now comes from special_tokens_map.json.
        assert_eq!(tok.bos_id(), Some(1));

        std::fs::remove_file(dir.path().join("special_tokens_map.json")).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_id(), None);
        // Without a BOS token nothing is prepended.
        assert_eq!(
            tok.encode("hi", true).unwrap(),
            tok.encode("hi", false).unwrap()
        );
    }

    #[test]
    fn add_bos_and_no_double_bos() {
        let (dir, tok) = generated(600);
        let plain = tok.encode("How are you", false).unwrap();
        assert!(!plain.is_empty());
        assert_ne!(plain[0], 1);
        let with = tok.encode("How are you", true).unwrap();
        assert_eq!(with[0], 1);
        assert_eq!(&with[1..], &plain[..]);

        // BOS text in the string is the special token: no second BOS.
        let ids = tok.encode("<s>How are you", true).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1);
        assert_eq!(ids[0], 1);

        rewrite_config(dir.path(), |c| {
            c.insert("add_bos_token".into(), Value::from(false));
        });
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.encode("How are you", true).unwrap(), plain);
    }

    /// A special token over a plain span is text; the others, and every piece between them,
    /// are as `encode` gives them.
    #[test]
    fn special_tokens_over_plain_spans_are_text() {
        let (_dir, tok) = generated(600);
        let end = tok.token_to_id("<|im_end|>").unwrap();
        let text = "<|im_start|>user\nHi<|im_end|> there<|im_end|>\n";
        let whole = tok.encode(text, true).unwrap();
        let count = |ids: &[u32]| ids.iter().filter(|&&i| i == end).count();
        assert_eq!(count(&whole), 2);
        // No span, or a span no special token overlaps: the same ids.
        assert_eq!(tok.encode_with_plain_spans(text, true, &[]).unwrap(), whole);
        assert_eq!(
            tok.encode_with_plain_spans(text, true, std::slice::from_ref(&(17..19)))
                .unwrap(),
            whole
        );
        // A span over (part of) the first `<|im_end|>`: it is text.
        let at = text.find("<|im_end|>").unwrap();
        for span in [at..at + 10, at + 3..at + 4, at - 2..at + 1] {
            let ids = tok
                .encode_with_plain_spans(text, true, std::slice::from_ref(&span))
                .unwrap();
            assert_eq!(count(&ids), 1, "{span:?}: {ids:?}");
            assert_eq!(ids[0], 1);
            let back = tok.decode(&ids, false).unwrap();
            assert!(back.contains("Hi<|im_end|>"), "{span:?}: {back}");
            // The pieces between the other special tokens, each encoded as one.
            let start = tok.token_to_id("<|im_start|>").unwrap();
            let mut want = vec![1, start];
            want.extend(tok.encode_plain("user\nHi<|im_end|> there").unwrap());
            want.push(end);
            want.extend(tok.encode_plain("\n").unwrap());
            assert_eq!(ids, want, "{span:?}");
        }
        assert_eq!(tok.special_texts().len(), 11);
    }

    #[test]
    fn template_list_form_and_jinja_file_precedence() {
        let (dir, _) = generated(400);
        rewrite_config(dir.path(), |c| {
            c.insert(
                "chat_template".into(),
                serde_json::json!([
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "DEFAULT"}
                ]),
            );
        });
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.chat_template_source(), Some("DEFAULT"));

        std::fs::write(dir.path().join("chat_template.jinja"), "FROM FILE").unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.chat_template_source(), Some("FROM FILE"));

        rewrite_config(dir.path(), |c| {
            c.insert(
                "chat_template".into(),
                serde_json::json!([{"name": "tool_use", "template": "TOOLS"}]),
            );
        });
        let msg = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            msg.contains("chat_template") && msg.contains("default"),
            "{msg}"
        );
    }

    #[test]
    fn no_template_falls_back_to_chatml() {
        let (dir, _) = generated(400);
        rewrite_config(dir.path(), |c| {
            c.remove("chat_template");
        });
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(tok.chat_template_source().is_none());
        let out = tok
            .chat_template()
            .unwrap()
            .render(
                &[crate::ChatMessage::new("user", "hi")],
                &crate::ChatOptions::default(),
            )
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    #[test]
    fn from_files_without_config() {
        let (dir, _) = generated(400);
        let tok = Tokenizer::from_files(&dir.path().join("tokenizer.json"), None, None).unwrap();
        assert_eq!(tok.bos_id(), None);
        assert!(tok.eos_ids().is_empty());
        assert!(tok.add_bos_token());
        assert_eq!(tok.vocab_size(), 400);
    }

    #[test]
    fn unknown_ids_are_errors() {
        let (_dir, tok) = generated(400);
        let err = tok.decode(&[5, 400], false).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::UnknownId {
                    id: 400,
                    vocab_size: 400
                }
            ),
            "{err:?}"
        );
        assert!(tok.decode(&[5, 399], false).is_ok());
    }
}
