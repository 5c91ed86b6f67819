//! EAGLE-3 draft checkpoints in the layout SpecForge writes: `config.json` (a Llama config with
//! `draft_vocab_size` and one hidden layer) and `model.safetensors` holding `fc` (the target's
//! low, mid and high hidden states, concatenated, to the draft's width), one decoder layer
//! (`midlayer.*`, or `layers.0.*`) whose attention reads `[norm(embedding) | norm(hidden)]`,
//! `norm`, `lm_head` over the draft vocabulary and `d2t` (target id = draft id + `d2t[id]`);
//! `t2d` is read past, and `embed_tokens` is optional (the target's table serves without it).
//! Everything is checked against the target model before a value is read.

use crate::config::ModelConfig;
use crate::safetensors::{map_file, parse_header, Element, Stored};
use crate::weights::{file_err, tensor_err, CheckpointError, DType, Problem, Shard, TensorView};
use crate::writer::{write_json, write_raw_safetensors, RawTensor};
use crate::{f32_to_bf16_bits, rng};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A draft's shape, as its `config.json` gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub vocab_size: usize,
    pub draft_vocab_size: usize,
    /// Width of each of the target's hidden states `fc` reads.
    pub target_hidden_size: usize,
    /// The target layers whose outputs the draft reads: low, mid, high.
    pub aux_layers: [usize; 3],
}

impl DraftConfig {
    /// Reads a draft's `config.json` and checks it fits `target`: its hidden states' width,
    /// its vocabulary, the layers it reads. Defaults as SpecForge's: `head_dim` = hidden /
    /// heads, `target_hidden_size` = `hidden_size`, aux layers 1, L/2 − 1 and L − 4 of the
    /// target's L.
    pub fn from_json(v: &Value, target: &ModelConfig) -> Result<Self, String> {
        let num = |key: &str| -> Result<Option<usize>, String> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .map(Some)
                    .ok_or_else(|| format!("`{key}` must be a positive integer, got {x}")),
            }
        };
        let need = |key: &str| num(key)?.ok_or_else(|| format!("`{key}` is missing"));
        let float = |key: &str, default: f64| match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .filter(|f| f.is_finite() && *f > 0.0)
                .ok_or_else(|| format!("`{key}` must be a positive number, got {x}")),
        };
        let eagle = v
            .get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|a| {
                a.iter()
                    .any(|x| x.as_str().is_some_and(|s| s.contains("Eagle3")))
            });
        if !eagle {
            return Err(
                "`architectures` names no EAGLE-3 draft (e.g. LlamaForCausalLMEagle3)".into(),
            );
        }
        let layers = need("num_hidden_layers")?;
        if layers != 1 {
            return Err(format!(
                "`num_hidden_layers` is {layers}: EAGLE-3 drafts of one decoder layer are supported"
            ));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(format!("`hidden_act` {act}: only silu is supported"));
            }
        }
        match v.get("rope_scaling") {
            None | Some(Value::Null) => {}
            Some(x) => return Err(format!("`rope_scaling` {x}: only plain RoPE is supported")),
        }
        let hidden_size = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let kv_heads = num("num_key_value_heads")?.unwrap_or(heads);
        let head_dim = num("head_dim")?.unwrap_or(hidden_size / heads.max(1));
        if !heads.is_multiple_of(kv_heads) || !head_dim.is_multiple_of(2) {
            return Err(format!(
                "{heads} heads over {kv_heads} KV heads of size {head_dim}: heads must be a multiple of KV heads and the size even"
            ));
        }
        let vocab_size = need("vocab_size")?;
        if vocab_size != target.vocab_size {
            return Err(format!(
                "the draft's vocabulary has {vocab_size} tokens, the model's {}: it was trained for another model",
                target.vocab_size
            ));
        }
        let draft_vocab_size = num("draft_vocab_size")?.unwrap_or(vocab_size);
        if draft_vocab_size > vocab_size {
            return Err(format!(
                "`draft_vocab_size` {draft_vocab_size} is larger than the vocabulary ({vocab_size})"
            ));
        }
        let target_hidden_size = num("target_hidden_size")?.unwrap_or(hidden_size);
        if target_hidden_size != target.hidden_size {
            return Err(format!(
                "the draft reads hidden states of size {target_hidden_size}, the model's are {}: it was trained for another model",
                target.hidden_size
            ));
        }
        let n = target.num_hidden_layers;
        let aux = match v
            .get("eagle_config")
            .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids"))
        {
            None | Some(Value::Null) => vec![1, (n / 2).saturating_sub(1), n.saturating_sub(4)],
            Some(ids) => ids
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| {
                    format!(
                        "`eagle_aux_hidden_state_layer_ids` {ids} is not a list of layer indices"
                    )
                })?,
        };
        let aux_layers: [usize; 3] = match aux.as_slice() {
            &[a, b, c] if c < n => [a, b, c],
            _ => {
                return Err(format!(
                    "the draft reads the outputs of layers {aux:?}: three layers of the model's {n} are needed"
                ))
            }
        };
        Ok(Self {
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: float("rms_norm_eps", 1e-6)?,
            rope_theta: float("rope_theta", 10000.0)?,
            vocab_size,
            draft_vocab_size,
            target_hidden_size,
            aux_layers,
        })
    }

    /// A `config.json` for this shape (tests and `sala` writing small drafts).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_config": { "eagle_aux_hidden_state_layer_ids": self.aux_layers },
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
        })
    }

    /// A small draft for `target` (tests and examples): its hidden width, 4 heads of 32 over 2
    /// KV heads, an MLP twice as wide, half its vocabulary, reading layers 0, 1 and the last.
    pub fn small(target: &ModelConfig) -> Self {
        Self {
            hidden_size: target.hidden_size,
            intermediate_size: 2 * target.hidden_size,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            vocab_size: target.vocab_size,
            draft_vocab_size: target.vocab_size / 2,
            target_hidden_size: target.hidden_size,
            aux_layers: [0, 1, target.num_hidden_layers - 1],
        }
    }

    /// Width of the q, k and v projections' outputs together.
    pub fn qkv_width(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }
}

/// What a draft tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Float,
    Int,
    Bool,
}

/// Every tensor a draft of `c` may hold (`layer`: the decoder layer's prefix): name, shape,
/// kind, and whether it must be there.
fn draft_tensors(c: &DraftConfig, layer: &str) -> Vec<(String, Vec<usize>, Kind, bool)> {
    let (h, th, i) = (c.hidden_size, c.target_hidden_size, c.intermediate_size);
    let (q, kv) = (
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
    );
    let float = |name: &str, shape: Vec<usize>| (name.to_string(), shape, Kind::Float, true);
    let in_layer =
        |name: &str, shape: Vec<usize>| (format!("{layer}{name}"), shape, Kind::Float, true);
    vec![
        (
            "embed_tokens.weight".into(),
            vec![c.vocab_size, h],
            Kind::Float,
            false,
        ),
        float("fc.weight", vec![h, 3 * th]),
        in_layer("input_layernorm.weight", vec![h]),
        in_layer("hidden_norm.weight", vec![h]),
        in_layer("self_attn.q_proj.weight", vec![q, 2 * h]),
        in_layer("self_attn.k_proj.weight", vec![kv, 2 * h]),
        in_layer("self_attn.v_proj.weight", vec![kv, 2 * h]),
        in_layer("self_attn.o_proj.weight", vec![h, q]),
        in_layer("post_attention_layernorm.weight", vec![h]),
        in_layer("mlp.gate_proj.weight", vec![i, h]),
        in_layer("mlp.up_proj.weight", vec![i, h]),
        in_layer("mlp.down_proj.weight", vec![h, i]),
        float("norm.weight", vec![h]),
        float("lm_head.weight", vec![c.draft_vocab_size, h]),
        (
            "d2t".into(),
            vec![c.draft_vocab_size],
            Kind::Int,
            c.draft_vocab_size < c.vocab_size,
        ),
        ("t2d".into(), vec![c.vocab_size], Kind::Bool, false),
    ]
}

/// The decoder layer's tensor prefixes SpecForge has written.
const LAYER_PREFIXES: [&str; 2] = ["midlayer.", "layers.0."];

/// An opened, checked EAGLE-3 draft.
pub struct DraftCheckpoint {
    dir: PathBuf,
    config: DraftConfig,
    shard: Shard,
    tensors: HashMap<String, Stored<Element>>,
    layer: &'static str,
}

impl std::fmt::Debug for DraftCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftCheckpoint")
            .field("dir", &self.dir)
            .field("config", &self.config)
            .finish()
    }
}

impl DraftCheckpoint {
    /// Opens the draft in `dir` for `target`: its config, then every tensor's name, dtype and
    /// shape (one `model.safetensors`; values are not read).
    pub fn open(dir: &Path, target: &ModelConfig) -> Result<Self, CheckpointError> {
        if !dir.is_dir() {
            return Err(CheckpointError::NotFound {
                path: dir.to_path_buf(),
                what: "draft model directory",
            });
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|source| CheckpointError::Io {
            path: config_path.clone(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| file_err(&config_path, format!("not valid JSON: {e}")))?;
        let config = DraftConfig::from_json(&json, target)
            .map_err(|e| file_err(&config_path, format!("EAGLE-3 draft: {e}")))?;
        let path = dir.join(crate::SINGLE_FILE);
        if !path.is_file() {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
                looked_for: format!("{} (drafts are read from one file)", crate::SINGLE_FILE),
            });
        }
        let shard = map_file(&path)?;
        let entries = parse_header::<Element>(&path, &shard.map)?;
        let tensors: HashMap<String, Stored<Element>> =
            entries.into_iter().map(|e| (e.name.clone(), e)).collect();
        let layer = LAYER_PREFIXES
            .into_iter()
            .find(|p| tensors.keys().any(|k| k.starts_with(p)))
            .unwrap_or(LAYER_PREFIXES[0]);
        let mut problems = Vec::new();
        let expected = draft_tensors(&config, layer);
        for (name, shape, kind, required) in &expected {
            let Some(t) = tensors.get(name) else {
                if *required {
                    problems.push(Problem::Missing {
                        tensor: name.clone(),
                        shape: shape.clone(),
                        looked_in: path.clone(),
                    });
                }
                continue;
            };
            if t.shape != *shape {
                problems.push(Problem::Shape {
                    tensor: name.clone(),
                    file: path.clone(),
                    expected: shape.clone(),
                    found: t.shape.clone(),
                });
            }
            let fits = matches!(
                (kind, t.dtype),
                (Kind::Float, Element::Float(_))
                    | (Kind::Int, Element::I64)
                    | (Kind::Bool, Element::Bool)
            );
            if !fits {
                return Err(tensor_err(
                    &path,
                    name,
                    format!("dtype {} where the draft needs {kind:?} values", t.dtype),
                ));
            }
        }
        for (name, t) in &tensors {
            let known =
                expected.iter().any(|(n, ..)| n == name) || name.ends_with("rotary_emb.inv_freq");
            if !known {
                problems.push(Problem::Unexpected {
                    tensor: name.clone(),
                    shape: t.shape.clone(),
                    file: path.clone(),
                });
            }
        }
        if !problems.is_empty() {
            problems.sort_by_key(|p| p.to_string());
            return Err(CheckpointError::Mismatch {
                dir: dir.to_path_buf(),
                problems,
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            shard,
            tensors,
            layer,
        })
    }

    pub fn config(&self) -> &DraftConfig {
        &self.config
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the draft has its own embedding table.
    pub fn has_embed(&self) -> bool {
        self.tensors.contains_key("embed_tokens.weight")
    }

    /// A float tensor by name; the decoder layer's by their name inside it
    /// (`self_attn.q_proj.weight`) with `in_layer`.
    pub fn tensor(&self, name: &str, in_layer: bool) -> Result<TensorView<'_>, CheckpointError> {
        let full = if in_layer {
            format!("{}{name}", self.layer)
        } else {
            name.to_string()
        };
        let t = self
            .tensors
            .get(&full)
            .ok_or_else(|| CheckpointError::UnknownTensor {
                dir: self.dir.clone(),
                tensor: full.clone(),
            })?;
        let Element::Float(dtype) = t.dtype else {
            return Err(tensor_err(&self.shard.path, &full, "not a float tensor"));
        };
        Ok(TensorView {
            name: &t.name,
            dtype,
            shape: &t.shape,
            bytes: &self.shard.map[t.range.clone()],
            file: &self.shard.path,
        })
    }

    /// The target token of each draft token: `id + d2t[id]` (the identity without `d2t`),
    /// each checked to lie in the vocabulary.
    pub fn draft_to_target(&self) -> Result<Vec<u32>, CheckpointError> {
        let c = &self.config;
        let Some(t) = self.tensors.get("d2t") else {
            return Ok((0..c.draft_vocab_size as u32).collect());
        };
        let bytes = &self.shard.map[t.range.clone()];
        bytes
            .chunks_exact(8)
            .enumerate()
            .map(|(id, b)| {
                let offset = i64::from_le_bytes(b.try_into().expect("8 bytes"));
                (id as i64)
                    .checked_add(offset)
                    .filter(|&t| (0..c.vocab_size as i64).contains(&t))
                    .map(|t| t as u32)
                    .ok_or_else(|| {
                        tensor_err(
                            &self.shard.path,
                            "d2t",
                            format!(
                                "draft token {id} maps to {id} + {offset}, outside the vocabulary of {}",
                                c.vocab_size
                            ),
                        )
                    })
            })
            .collect()
    }
}

/// Writes a draft of shape `c` with seeded random bf16 weights into `dir` (tests and benches:
/// no real drafts here): the draft vocabulary is `targets` (each draft token's target token)
/// or else every `vocab / draft_vocab`-th token, and the draft has its own embedding table
/// when `own_embed`.
pub fn write_random_draft(
    dir: &Path,
    c: &DraftConfig,
    own_embed: bool,
    targets: Option<&[u32]>,
    seed: u64,
) -> Result<(), CheckpointError> {
    let step = c.vocab_size / c.draft_vocab_size;
    let targets: Vec<u32> = match targets {
        Some(t) if t.len() == c.draft_vocab_size => t.to_vec(),
        Some(t) => {
            return Err(CheckpointError::File {
                file: dir.to_path_buf(),
                msg: format!(
                    "{} target tokens for a draft vocabulary of {}",
                    t.len(),
                    c.draft_vocab_size
                ),
            })
        }
        None => (0..c.draft_vocab_size)
            .map(|id| (id * step) as u32)
            .collect(),
    };
    std::fs::create_dir_all(dir).map_err(|source| CheckpointError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    write_json(&dir.join("config.json"), &c.to_json())?;
    let mut tensors = Vec::new();
    for (i, (name, shape, kind, _)) in draft_tensors(c, LAYER_PREFIXES[0]).into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let bytes = match kind {
            Kind::Float if name == "embed_tokens.weight" && !own_embed => continue,
            Kind::Float => {
                let norm = name.ends_with("norm.weight");
                let fan_in = *shape.last().unwrap_or(&1) as f64;
                let std = if norm { 0.1 } else { 1.0 / fan_in.sqrt() };
                let mut r = rng::Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
                // Uniform with standard deviation `std`.
                let half_width = std * 3f64.sqrt();
                (0..n)
                    .flat_map(|_| {
                        let x =
                            if norm { 1.0 } else { 0.0 } + half_width * (2.0 * r.next_f64() - 1.0);
                        f32_to_bf16_bits(x as f32).to_le_bytes()
                    })
                    .collect()
            }
            Kind::Int => targets
                .iter()
                .enumerate()
                .flat_map(|(id, &t)| (t as i64 - id as i64).to_le_bytes())
                .collect(),
            Kind::Bool => {
                let mut used = vec![0u8; n];
                for &t in &targets {
                    used[t as usize] = 1;
                }
                used
            }
        };
        let dtype = match kind {
            Kind::Float => DType::Bf16.safetensors_name(),
            Kind::Int => "I64",
            Kind::Bool => "BOOL",
        };
        tensors.push(RawTensor {
            name,
            dtype,
            shape,
            bytes,
        });
    }
    write_raw_safetensors(&dir.join(crate::SINGLE_FILE), &tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preset;

    /// A small draft for the tiny preset.
    pub fn tiny_draft(target: &ModelConfig) -> DraftConfig {
        DraftConfig {
            intermediate_size: 96,
            draft_vocab_size: target.vocab_size / 4,
            ..DraftConfig::small(target)
        }
    }

    #[test]
    fn a_written_draft_opens_and_maps_its_vocabulary() {
        let target = preset("tiny").unwrap();
        let c = tiny_draft(&target);
        let dir = tempfile::tempdir().unwrap();
        write_random_draft(dir.path(), &c, false, None, 3).unwrap();
        let d = DraftCheckpoint::open(dir.path(), &target).unwrap();
        assert_eq!(d.config(), &c);
        assert!(!d.has_embed());
        let map = d.draft_to_target().unwrap();
        assert_eq!(map.len(), c.draft_vocab_size);
        assert_eq!(map[5], 20);
        let q = d.tensor("self_attn.q_proj.weight", true).unwrap();
        assert_eq!(q.shape, &[128, 2 * c.hidden_size]);
        assert!(q.to_f32().iter().all(|x| x.is_finite() && x.abs() < 1.0));
        // SpecForge's defaults: aux layers 1, L/2 - 1, L - 4.
        let mut json = c.to_json();
        json.as_object_mut().unwrap().remove("eagle_config");
        let mut big = target.clone();
        big.num_hidden_layers = 32;
        assert_eq!(
            DraftConfig::from_json(&json, &big).unwrap().aux_layers,
            [1, 15, 28]
        );
    }

    #[test]
    fn a_draft_for_another_model_or_a_broken_one_is_refused_by_name() {
        let target = preset("tiny").unwrap();
        let c = tiny_draft(&target);
        let config_says = |edit: &dyn Fn(&mut serde_json::Map<String, Value>), says: &str| {
            let mut json = c.to_json();
            edit(json.as_object_mut().unwrap());
            let e = DraftConfig::from_json(&json, &target).unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
        };
        config_says(
            &|j| {
                j.insert("target_hidden_size".into(), 4096.into());
            },
            "hidden states of size 4096",
        );
        config_says(
            &|j| {
                j.insert("vocab_size".into(), 32000.into());
            },
            "vocabulary has 32000",
        );
        config_says(
            &|j| {
                j.insert(
                    "architectures".into(),
                    serde_json::json!(["LlamaForCausalLM"]),
                );
            },
            "EAGLE-3",
        );
        config_says(
            &|j| {
                j.insert("num_hidden_layers".into(), 2.into());
            },
            "one decoder layer",
        );
        config_says(
            &|j| {
                j.insert("rope_scaling".into(), serde_json::json!({"type": "yarn"}));
            },
            "rope_scaling",
        );
        config_says(
            &|j| {
                j.insert(
                    "eagle_config".into(),
                    serde_json::json!({"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}),
                );
            },
            "layers [0, 1, 9]",
        );

        // Tensors: a wrong shape, a missing one, an unknown one; a d2t leaving the vocabulary.
        let dir = tempfile::tempdir().unwrap();
        let mut other = c.clone();
        other.intermediate_size = 64;
        write_random_draft(dir.path(), &other, true, None, 1).unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            serde_json::to_string(&c.to_json()).unwrap(),
        )
        .unwrap();
        let e = DraftCheckpoint::open(dir.path(), &target)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mlp.gate_proj.weight") && e.contains("[96, 128]"),
            "{e}"
        );

        let dir = tempfile::tempdir().unwrap();
        let mut shifted = c.clone();
        shifted.draft_vocab_size = c.vocab_size / 2;
        write_random_draft(dir.path(), &c, false, None, 1).unwrap();
        let mut json = c.to_json();
        json["draft_vocab_size"] = shifted.draft_vocab_size.into();
        std::fs::write(dir.path().join("config.json"), json.to_string()).unwrap();
        let e = DraftCheckpoint::open(dir.path(), &target)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lm_head.weight") && e.contains("d2t"), "{e}");

        // d2t past the vocabulary: the draft's map is checked when read.
        let dir = tempfile::tempdir().unwrap();
        let mut wide = c.clone();
        wide.draft_vocab_size = c.vocab_size / 3;
        write_random_draft(dir.path(), &wide, false, None, 1).unwrap();
        let d = DraftCheckpoint::open(dir.path(), &target).unwrap();
        assert!(d.draft_to_target().is_ok());
        let dir2 = tempfile::tempdir().unwrap();
        let mut tensors = Vec::new();
        let src = std::fs::read(dir.path().join(crate::SINGLE_FILE)).unwrap();
        let entries = parse_header::<Element>(Path::new("x"), &src).unwrap();
        for e in entries {
            let mut bytes = src[e.range.clone()].to_vec();
            if e.name == "d2t" {
                let last = bytes.len() - 8;
                bytes[last..].copy_from_slice(&(1i64 << 40).to_le_bytes());
            }
            let dtype = match e.dtype {
                Element::Float(_) => "BF16",
                Element::I32 => "I32",
                Element::I64 => "I64",
                Element::Bool => "BOOL",
                Element::F8E4M3 => "F8_E4M3",
            };
            tensors.push(RawTensor {
                name: e.name,
                dtype,
                shape: e.shape,
                bytes,
            });
        }
        write_raw_safetensors(&dir2.path().join(crate::SINGLE_FILE), &tensors).unwrap();
        std::fs::copy(
            dir.path().join("config.json"),
            dir2.path().join("config.json"),
        )
        .unwrap();
        let e = DraftCheckpoint::open(dir2.path(), &target)
            .unwrap()
            .draft_to_target()
            .unwrap_err()
            .to_string();
        assert!(e.contains("outside the vocabulary"), "{e}");

        let e = DraftCheckpoint::open(Path::new("/nonexistent/draft"), &target).unwrap_err();
        assert!(e.to_string().contains("draft model directory"), "{e}");
    }
}
