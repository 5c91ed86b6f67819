//! Named model configurations: small random-weight test models and the released 9B config.

use crate::config::{ConfigError, ModelConfig};
use serde_json::json;

/// The released MiniCPM-SALA `config.json` (SPEC §1).
const RELEASED_CONFIG: &str = include_str!("../../../tests/data/released_config.json");

/// Names [`preset`] accepts.
pub fn preset_names() -> &'static [&'static str] {
    &["tiny", "small", "minicpm-sala-9b"]
}

/// A preset that does not exist or (a bug) does not validate.
#[derive(Debug, thiserror::Error)]
pub enum PresetError {
    #[error("unknown preset `{name}`; known presets: {}", preset_names().join(", "))]
    Unknown { name: String },
    #[error("preset `{name}`: {source}")]
    Invalid { name: String, source: ConfigError },
}

/// The configuration named `name` (one of [`preset_names`]).
pub fn preset(name: &str) -> Result<ModelConfig, PresetError> {
    let value = match name {
        "tiny" => tiny_json(),
        "small" => small_json(),
        "minicpm-sala-9b" => {
            serde_json::from_str(RELEASED_CONFIG).map_err(|e| PresetError::Invalid {
                name: name.into(),
                source: ConfigError::Field {
                    field: "<released config.json>".into(),
                    msg: e.to_string(),
                },
            })?
        }
        _ => return Err(PresetError::Unknown { name: name.into() }),
    };
    ModelConfig::from_json(value).map_err(|source| PresetError::Invalid {
        name: name.into(),
        source,
    })
}

/// Fields shared by the small presets; the released values where they are not sizes.
fn common_json(vocab: usize) -> serde_json::Value {
    json!({
        "architectures": ["MiniCPMSALAForCausalLM"],
        "model_type": "minicpm_sala",
        "hidden_act": "silu",
        "vocab_size": vocab,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": null,
        "qk_norm": true,
        "use_output_norm": true,
        "use_output_gate": true,
        "attn_use_output_gate": true,
        "lightning_use_rope": true,
        "attn_use_rope": false,
        "lightning_scale": "1/sqrt(d)",
        "attention_bias": false,
        "pretraining_tp": 1,
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": [2, vocab - 8],
        "pad_token_id": 2,
        // Read by the official modeling code's config class, not by the forward pass: a written
        // checkpoint loads there (with its .py files beside it) as the released one does.
        "auto_map": {
            "AutoConfig": "configuration_minicpm_sala.MiniCPMSALAConfig",
            "AutoModel": "modeling_minicpm_sala.MiniCPMSALAModel",
            "AutoModelForCausalLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM",
            "AutoModelForSeq2SeqLM": "modeling_minicpm_sala.MiniCPMSALAForCausalLM",
            "AutoModelForSequenceClassification":
                "modeling_minicpm_sala.MiniCPMSALAForSequenceClassification"
        },
        "attention_dropout": 0.0,
        "initializer_range": 0.1,
        "mup_denominator": 32,
        "use_cache": true,
        "shift_labels": true,
    })
}

fn merge(mut base: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let b = base.as_object_mut().expect("object");
    for (k, v) in extra.as_object().expect("object") {
        b.insert(k.clone(), v.clone());
    }
    base
}

/// 4 layers (sparse, lightning, lightning, sparse), hidden 128: fast unit tests.
fn tiny_json() -> serde_json::Value {
    merge(
        common_json(1024),
        json!({
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "mixer_types": ["minicpm4", "lightning-attn", "lightning-attn", "minicpm4"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "lightning_nkv": 4,
            "max_position_embeddings": 65536,
            "dim_model_base": 32,
            "sparse_config": {
                "kernel_size": 8, "kernel_stride": 4, "block_size": 16, "init_blocks": 1,
                "window_size": 32, "topk": 4, "use_nope": false, "dense_len": 96
            },
        }),
    )
}

/// ~113M parameters shaped like the release: 12 layers with sparse layers at 0, 5, 9, 10, 11,
/// GQA 3:1 on sparse layers, the released sparse_config, hidden/dim_model_base = 16.
fn small_json() -> serde_json::Value {
    let sparse = [0, 5, 9, 10, 11];
    let mixers: Vec<&str> = (0..12)
        .map(|i| {
            if sparse.contains(&i) {
                "minicpm4"
            } else {
                "lightning-attn"
            }
        })
        .collect();
    merge(
        common_json(16384),
        json!({
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "mixer_types": mixers,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "intermediate_size": 2048,
            "lightning_nkv": 6,
            "max_position_embeddings": 524288,
            "dim_model_base": 48,
            "sparse_config": {
                "kernel_size": 32, "kernel_stride": 16, "block_size": 64, "init_blocks": 1,
                "window_size": 2048, "topk": 64, "use_nope": false, "dense_len": 8192
            },
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MixerKind;
    use crate::schema::{expected_parameter_count, expected_tensors};
    use crate::weights::{Checkpoint, DType};
    use crate::writer::{random_tensor_values, write_random_checkpoint, WriteOptions};

    fn sparse_layers(c: &ModelConfig) -> Vec<usize> {
        (0..c.num_hidden_layers)
            .filter(|&i| c.mixer_types[i] == MixerKind::Sparse)
            .collect()
    }

    #[test]
    fn every_preset_validates() {
        for name in preset_names() {
            let c = preset(name).unwrap();
            c.validate().unwrap();
            assert_eq!(
                c.mixer_types[0],
                MixerKind::Sparse,
                "{name}: HF needs layer 0 sparse"
            );
        }
        let e = preset("huge").unwrap_err().to_string();
        assert!(
            e.contains("huge") && e.contains("tiny, small, minicpm-sala-9b"),
            "{e}"
        );
    }

    #[test]
    fn tiny_is_as_specified() {
        let c = preset("tiny").unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim
            ),
            (128, 4, 2, 32)
        );
        assert_eq!(
            (c.intermediate_size, c.vocab_size, c.lightning_nkv),
            (256, 1024, 4)
        );
        assert_eq!(sparse_layers(&c), vec![0, 3]);
        assert_eq!(c.sparse.selected_blocks(), 4 + 2);
        assert_eq!(c.sparse.dense_len, 96);
        assert_eq!(c.eos_token_ids, vec![2, 1016]);
        assert_eq!(c.logit_divisor(), 4.0);
        assert!(c.qk_norm && c.use_output_norm && c.use_output_gate && c.attn_use_output_gate);
        assert!(c.lightning_use_rope && !c.tie_word_embeddings);
        // 2 x 1024 x 128 + 128 + 4 x (2 x 128 + 3 x 256 x 128)
        // + 2 sparse x (3 x 128² + 2 x 64 x 128) + 2 lightning x (5 x 128² + 2 x 32 + 128)
        assert_eq!(expected_parameter_count(&c), 951_808);
    }

    #[test]
    fn small_is_release_shaped() {
        let c = preset("small").unwrap();
        assert_eq!(sparse_layers(&c), vec![0, 5, 9, 10, 11]);
        assert_eq!(c.logit_divisor(), 16.0);
        assert_eq!(c.sparse, preset("minicpm-sala-9b").unwrap().sparse);
        assert_eq!(c.eos_token_ids, vec![2, 16376]);
        assert_eq!(c.max_position_embeddings, 524_288);
        // Summed by hand: 2 x 16384 x 768 + 768 + 12 x (2 x 768 + 3 x 2048 x 768)
        // + 5 x (3 x 768² + 2 x 256 x 768) + 7 x (5 x 768² + 2 x 128 + 768).
        assert_eq!(expected_parameter_count(&c), 113_272_576);
    }

    #[test]
    fn released_preset_matches_spec() {
        let c = preset("minicpm-sala-9b").unwrap();
        assert_eq!(expected_parameter_count(&c), 9_477_203_968);
        assert_eq!(sparse_layers(&c), vec![0, 9, 16, 17, 22, 29, 30, 31]);
        assert_eq!(expected_tensors(&c).len(), 3 + 32 * 5 + 8 * 5 + 24 * 8);
        assert_eq!(c.raw["mup_denominator"], 32);
    }

    #[test]
    fn small_presets_carry_every_key_of_the_released_config() {
        // But the version, and the dtype: the writer adds the one it writes.
        let released = preset("minicpm-sala-9b").unwrap().raw;
        for name in ["tiny", "small"] {
            let c = preset(name).unwrap().to_json();
            for key in released.as_object().unwrap().keys() {
                if key != "transformers_version" && key != "torch_dtype" {
                    assert!(c.get(key).is_some(), "preset {name} lacks `{key}`");
                }
            }
            assert_eq!(c["auto_map"], released["auto_map"]);
        }
    }

    fn round_trip(max_shard_bytes: usize) -> usize {
        let c = preset("tiny").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let opts = WriteOptions {
            seed: 42,
            dtype: DType::Bf16,
            max_shard_bytes,
            heavy_tails: false,
        };
        write_random_checkpoint(tmp.path(), &c, &opts).unwrap();
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let (mut got, mut want) = (ck.config().clone(), c.clone());
        got.raw = serde_json::Value::Null;
        want.raw = serde_json::Value::Null;
        assert_eq!(got, want);
        for spec in expected_tensors(&c) {
            let rounded: Vec<f32> = random_tensor_values(42, &c, &spec)
                .into_iter()
                .map(|v| half::bf16::from_f32(v).to_f32())
                .collect();
            assert!(ck.read_f32(&spec.name).unwrap() == rounded, "{}", spec.name);
        }
        ck.files().len()
    }

    #[test]
    fn tiny_round_trips_single_file() {
        assert_eq!(round_trip(usize::MAX), 1);
    }

    #[test]
    fn tiny_round_trips_sharded() {
        assert!(round_trip(64 * 1024) > 5);
    }
}
