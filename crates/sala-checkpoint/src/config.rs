//! `config.json` of a MiniCPM-SALA checkpoint (SPEC §1), parsed with the defaults of the
//! HF configuration class and validated so that a bad field is named before any work.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// What a layer's token mixer is (SPEC §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MixerKind {
    /// `"minicpm4"`: InfLLM-v2 sparse / dense softmax attention.
    Sparse,
    /// `"lightning-attn"` (aliases `"lightning"`, `"lightning_attn"`): constant-decay Simple GLA.
    Lightning,
}

impl MixerKind {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "minicpm4" => Some(Self::Sparse),
            "lightning-attn" | "lightning" | "lightning_attn" => Some(Self::Lightning),
            _ => None,
        }
    }

    /// The canonical name written to `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sparse => "minicpm4",
            Self::Lightning => "lightning-attn",
        }
    }
}

/// `sparse_config` (SPEC §1, §5).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseConfig {
    #[serde(default = "d_kernel_size")]
    pub kernel_size: usize,
    #[serde(default = "d_kernel_stride")]
    pub kernel_stride: usize,
    #[serde(default = "d_block_size")]
    pub block_size: usize,
    #[serde(default = "d_init_blocks")]
    pub init_blocks: usize,
    #[serde(default = "d_window_size")]
    pub window_size: usize,
    #[serde(default = "d_topk")]
    pub topk: usize,
    #[serde(default)]
    pub use_nope: bool,
    #[serde(default = "d_dense_len")]
    pub dense_len: usize,
    /// How the sparse layers store K and V: a run-time choice, never in `config.json`.
    #[serde(skip)]
    pub kv_cache: KvCacheDtype,
}

/// The element type of the sparse layers' K/V cache (`--kv-cache-dtype`). Compressed keys
/// and lightning states stay as they are whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// bf16 values, as the projections give them.
    #[default]
    Bf16,
    /// FP8 E4M3 codes with one f32 scale per token and KV head (amax / 448), so each row of
    /// `head_dim` values uses the whole E4M3 range whatever its magnitude.
    Fp8,
}

impl KvCacheDtype {
    /// `bf16` (or `auto`) and `fp8` (or `fp8_e4m3`), as on the command line.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "auto" => Ok(Self::Bf16),
            "fp8" | "fp8_e4m3" | "fp8-e4m3" => Ok(Self::Fp8),
            other => Err(format!(
                "unknown KV cache dtype '{other}': use bf16 or fp8 (E4M3 with a scale per token \
                 and KV head)"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }
}

fn d_kernel_size() -> usize {
    32
}
fn d_kernel_stride() -> usize {
    16
}
fn d_block_size() -> usize {
    64
}
fn d_init_blocks() -> usize {
    1
}
fn d_window_size() -> usize {
    2048
}
fn d_topk() -> usize {
    64
}
fn d_dense_len() -> usize {
    8192
}

impl Default for SparseConfig {
    fn default() -> Self {
        Self {
            kernel_size: d_kernel_size(),
            kernel_stride: d_kernel_stride(),
            block_size: d_block_size(),
            init_blocks: d_init_blocks(),
            window_size: d_window_size(),
            topk: d_topk(),
            use_nope: false,
            dense_len: d_dense_len(),
            kv_cache: KvCacheDtype::Bf16,
        }
    }
}

impl SparseConfig {
    /// Level-1 compression window and stride (tokens).
    pub fn k1_window(&self) -> usize {
        self.kernel_size
    }
    pub fn k1_stride(&self) -> usize {
        self.kernel_stride
    }
    /// Level-2 compression window and stride: four times level 1 (128 / 64 released).
    pub fn k2_window(&self) -> usize {
        4 * self.kernel_size
    }
    pub fn k2_stride(&self) -> usize {
        4 * self.kernel_stride
    }
    /// Blocks of the sliding window kept besides the current block (2048/64 = 32 released).
    pub fn local_blocks(&self) -> usize {
        self.window_size / self.block_size
    }
    /// Blocks selected per query and KV group: `topk + local_blocks` (96 released).
    pub fn selected_blocks(&self) -> usize {
        self.topk + self.local_blocks()
    }
    /// Level-1 windows per block: the max-pool stride (4 released); the pool spans one more.
    pub fn windows_per_block(&self) -> usize {
        self.block_size / self.kernel_stride
    }
}

/// Parsed and validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub scale_emb: f64,
    pub scale_depth: f64,
    pub dim_model_base: f64,
    pub mixer_types: Vec<MixerKind>,
    pub attn_use_output_gate: bool,
    pub lightning_use_rope: bool,
    pub qk_norm: bool,
    pub use_output_norm: bool,
    pub use_output_gate: bool,
    pub lightning_nkv: usize,
    pub sparse: SparseConfig,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// How the linear weights are stored, when quantized.
    pub quantization: Option<crate::quant::Gptq>,
    /// Run the decoder layers' linears in FP8 (`--quantize fp8`, or an FP8 checkpoint): E4M3
    /// weights with an f32 scale per output channel, their inputs made E4M3 per row
    /// (dynamic per-token scales); embeddings, norms and lm_head stay bf16.
    pub fp8_weights: bool,
    /// How an FP8 checkpoint stores its linears.
    pub fp8_checkpoint: Option<crate::fp8::Fp8Checkpoint>,
    /// The JSON as read, so that a written checkpoint keeps unknown keys.
    pub raw: serde_json::Value,
}

/// A configuration error, naming the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON: {source}")]
    Json {
        path: String,
        source: serde_json::Error,
    },
    #[error("config field `{field}`: {msg}")]
    Field { field: String, msg: String },
}

fn field_err(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.to_string(),
        msg: msg.into(),
    }
}

impl ModelConfig {
    /// Whether weight `name` runs in FP8: a decoder layer's linear with FP8 weights on, unless
    /// an FP8 checkpoint keeps it in bf16.
    pub fn fp8_linear(&self, name: &str) -> bool {
        self.fp8_weights
            && name.starts_with("model.layers.")
            && !name.ends_with("norm.weight")
            && self
                .fp8_checkpoint
                .as_ref()
                .is_none_or(|c| c.quantizes(name))
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ConfigError::Json {
                path: path.display().to_string(),
                source,
            })?;
        Self::from_json(value)
    }

    /// Parses a config from its JSON value, with the HF defaults where a field is absent.
    pub fn from_json(value: serde_json::Value) -> Result<Self, ConfigError> {
        let obj = value
            .as_object()
            .ok_or_else(|| field_err("<root>", "config.json must be a JSON object"))?;
        // Quantized checkpoints: FP8 (fp8::Fp8Checkpoint) and 4-bit GPTQ (quant::Gptq) are
        // read; other formats are named.
        let qc = obj.get("quantization_config").filter(|q| !q.is_null());
        let fp8_checkpoint = match qc {
            Some(q) => crate::fp8::Fp8Checkpoint::from_json(q)
                .map_err(|e| field_err("quantization_config", e))?,
            None => None,
        };
        let quantization = match qc {
            Some(q) if fp8_checkpoint.is_none() => Some(
                crate::quant::Gptq::from_json(q)
                    .map_err(|e| field_err("quantization_config", e))?,
            ),
            _ => None,
        };
        let get_usize = |name: &str, default: Option<usize>| -> Result<usize, ConfigError> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => {
                    default.ok_or_else(|| field_err(name, "missing (required)"))
                }
                Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                    field_err(name, format!("expected a non-negative integer, got {v}"))
                }),
            }
        };
        let get_f64 = |name: &str, default: f64| -> Result<f64, ConfigError> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| field_err(name, format!("expected a number, got {v}"))),
            }
        };
        let get_bool = |name: &str, default: bool| -> Result<bool, ConfigError> {
            match obj.get(name) {
                None | Some(serde_json::Value::Null) => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| field_err(name, format!("expected true or false, got {v}"))),
            }
        };
        let get_token = |name: &str, default: Option<u32>| -> Result<Option<u32>, ConfigError> {
            match obj.get(name) {
                None => Ok(default),
                Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| Some(x as u32))
                    .ok_or_else(|| field_err(name, format!("expected a token id, got {v}"))),
            }
        };

        let hidden_size = get_usize("hidden_size", None)?;
        let num_hidden_layers = get_usize("num_hidden_layers", None)?;
        let num_attention_heads = get_usize("num_attention_heads", None)?;
        let num_key_value_heads = get_usize("num_key_value_heads", Some(num_attention_heads))?;
        let head_dim = match obj.get("head_dim") {
            None | Some(serde_json::Value::Null) if num_attention_heads > 0 => {
                hidden_size / num_attention_heads
            }
            _ => get_usize("head_dim", Some(0))?,
        };
        let intermediate_size = get_usize("intermediate_size", None)?;
        let vocab_size = get_usize("vocab_size", None)?;

        if let Some(act) = obj.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(field_err(
                    "hidden_act",
                    format!("only \"silu\" is supported, got {act}"),
                ));
            }
        }
        if get_bool("attn_use_rope", false)? {
            return Err(field_err(
                "attn_use_rope",
                "RoPE on the sparse (minicpm4) layers is not supported; MiniCPM-SALA has false",
            ));
        }
        if let Some(v) = obj.get("rope_scaling") {
            if !v.is_null() {
                return Err(field_err(
                    "rope_scaling",
                    format!("only null is supported, got {v}"),
                ));
            }
        }
        match obj.get("lightning_scale") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(s)) if s == "1/sqrt(d)" => {}
            Some(v) => {
                return Err(field_err(
                    "lightning_scale",
                    format!("only \"1/sqrt(d)\" is supported, got {v}"),
                ))
            }
        }
        if let Some(p) = obj.get("pretraining_tp") {
            if p.as_u64() != Some(1) {
                return Err(field_err(
                    "pretraining_tp",
                    format!("only 1 is supported, got {p}"),
                ));
            }
        }
        if get_bool("attention_bias", false)? {
            return Err(field_err(
                "attention_bias",
                "biases are not supported; MiniCPM-SALA has false",
            ));
        }

        let mixer_types = match obj.get("mixer_types") {
            None | Some(serde_json::Value::Null) => {
                return Err(field_err("mixer_types", "missing (required: one entry per layer)"))
            }
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str().and_then(MixerKind::parse).ok_or_else(|| {
                        field_err(
                            &format!("mixer_types[{i}]"),
                            format!(
                                "unknown mixer type {v}; expected \"minicpm4\" or \"lightning-attn\""
                            ),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => return Err(field_err("mixer_types", format!("expected a list, got {v}"))),
        };

        let sparse = match obj.get("sparse_config") {
            None | Some(serde_json::Value::Null) => SparseConfig::default(),
            Some(v) => serde_json::from_value::<SparseConfig>(v.clone())
                .map_err(|e| field_err("sparse_config", e.to_string()))?,
        };

        let eos_token_ids = match obj.get("eos_token_id") {
            None => vec![2],
            Some(serde_json::Value::Null) => vec![],
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|x| x as u32).ok_or_else(|| {
                        field_err("eos_token_id", format!("expected token ids, got {v}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(v) => vec![v.as_u64().map(|x| x as u32).ok_or_else(|| {
                field_err("eos_token_id", format!("expected a token id, got {v}"))
            })?],
        };

        let config = Self {
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            rms_norm_eps: get_f64("rms_norm_eps", 1e-6)?,
            rope_theta: get_f64("rope_theta", 10000.0)?,
            max_position_embeddings: get_usize("max_position_embeddings", Some(2048))?,
            tie_word_embeddings: get_bool("tie_word_embeddings", false)?,
            scale_emb: get_f64("scale_emb", 1.0)?,
            scale_depth: get_f64("scale_depth", 1.0)?,
            dim_model_base: get_f64("dim_model_base", 1.0)?,
            mixer_types,
            attn_use_output_gate: get_bool("attn_use_output_gate", false)?,
            lightning_use_rope: get_bool("lightning_use_rope", true)?,
            qk_norm: get_bool("qk_norm", false)?,
            use_output_norm: get_bool("use_output_norm", false)?,
            use_output_gate: get_bool("use_output_gate", false)?,
            lightning_nkv: get_usize("lightning_nkv", Some(num_attention_heads))?,
            sparse,
            bos_token_id: get_token("bos_token_id", Some(1))?,
            eos_token_ids,
            pad_token_id: get_token("pad_token_id", None)?,
            quantization,
            fp8_weights: fp8_checkpoint.is_some(),
            fp8_checkpoint,
            raw: value.clone(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks the sizes agree with each other and with what the engine implements.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("lightning_nkv", self.lightning_nkv),
            ("sparse_config.kernel_size", self.sparse.kernel_size),
            ("sparse_config.kernel_stride", self.sparse.kernel_stride),
            ("sparse_config.block_size", self.sparse.block_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(field_err(name, "must be positive"));
            }
        }
        if self.num_attention_heads * self.head_dim != self.hidden_size {
            return Err(field_err(
                "head_dim",
                format!(
                    "num_attention_heads ({}) x head_dim ({}) must equal hidden_size ({})",
                    self.num_attention_heads, self.head_dim, self.hidden_size
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(field_err("head_dim", "must be even (RoPE rotates halves)"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(field_err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads ({})",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.lightning_nkv) {
            return Err(field_err(
                "lightning_nkv",
                format!(
                    "{} does not divide num_attention_heads ({})",
                    self.lightning_nkv, self.num_attention_heads
                ),
            ));
        }
        if self.mixer_types.len() != self.num_hidden_layers {
            return Err(field_err(
                "mixer_types",
                format!(
                    "has {} entries but num_hidden_layers is {}",
                    self.mixer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(field_err("rms_norm_eps", "must be positive"));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(field_err("rope_theta", "must be positive"));
        }
        if self.dim_model_base.is_nan() || self.dim_model_base <= 0.0 {
            return Err(field_err("dim_model_base", "must be positive"));
        }
        if self.max_position_embeddings == 0 {
            return Err(field_err("max_position_embeddings", "must be positive"));
        }
        let s = &self.sparse;
        if s.use_nope {
            return Err(field_err("sparse_config.use_nope", "true is not supported"));
        }
        if !s.block_size.is_multiple_of(s.kernel_stride) {
            return Err(field_err(
                "sparse_config.block_size",
                format!(
                    "{} is not a multiple of kernel_stride ({})",
                    s.block_size, s.kernel_stride
                ),
            ));
        }
        if s.kernel_size < s.kernel_stride {
            return Err(field_err(
                "sparse_config.kernel_size",
                format!(
                    "{} is smaller than kernel_stride ({})",
                    s.kernel_size, s.kernel_stride
                ),
            ));
        }
        if !s.window_size.is_multiple_of(s.block_size) {
            return Err(field_err(
                "sparse_config.window_size",
                format!(
                    "{} is not a multiple of block_size ({})",
                    s.window_size, s.block_size
                ),
            ));
        }
        // The selection rules assume every block outside the local window has all of its
        // level-1 windows complete (SPEC §5.5); these two bounds guarantee it.
        if s.window_size < s.block_size {
            return Err(field_err(
                "sparse_config.window_size",
                format!(
                    "{} is smaller than block_size ({})",
                    s.window_size, s.block_size
                ),
            ));
        }
        if s.kernel_size > s.block_size + s.kernel_stride {
            return Err(field_err(
                "sparse_config.kernel_size",
                format!(
                    "{} exceeds block_size + kernel_stride ({})",
                    s.kernel_size,
                    s.block_size + s.kernel_stride
                ),
            ));
        }
        if s.topk <= s.init_blocks {
            return Err(field_err(
                "sparse_config.topk",
                format!(
                    "{} must exceed init_blocks ({}) so every forced block fits",
                    s.topk, s.init_blocks
                ),
            ));
        }
        for &id in self.eos_token_ids.iter().chain(self.bos_token_id.iter()) {
            if id as usize >= self.vocab_size {
                return Err(field_err(
                    "eos_token_id/bos_token_id",
                    format!(
                        "token id {id} is outside the vocabulary ({})",
                        self.vocab_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Multiplier of every residual branch: `scale_depth / sqrt(num_hidden_layers)`.
    pub fn residual_scale(&self) -> f64 {
        self.scale_depth / (self.num_hidden_layers as f64).sqrt()
    }

    /// Divisor of the final hidden state before `lm_head`: `hidden_size / dim_model_base`.
    pub fn logit_divisor(&self) -> f64 {
        self.hidden_size as f64 / self.dim_model_base
    }

    /// Width of the sparse layers' K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Width of the lightning layers' K and V projections.
    pub fn lightning_kv_dim(&self) -> usize {
        self.lightning_nkv * self.head_dim
    }

    pub fn layer_count(&self, kind: MixerKind) -> usize {
        self.mixer_types.iter().filter(|&&k| k == kind).count()
    }

    /// The lightning decay slopes (SPEC §4.3, ALiBi schedule): `g_h = -slope_h`.
    pub fn lightning_slopes(&self) -> Vec<f32> {
        alibi_slopes(self.num_attention_heads)
    }

    /// The config as `config.json` text (the raw JSON with our fields written over it).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = if self.raw.is_object() {
            self.raw.clone()
        } else {
            serde_json::json!({})
        };
        let o = v.as_object_mut().expect("object");
        let mut set = |k: &str, val: serde_json::Value| {
            o.insert(k.to_string(), val);
        };
        set("hidden_size", self.hidden_size.into());
        set("num_hidden_layers", self.num_hidden_layers.into());
        set("num_attention_heads", self.num_attention_heads.into());
        set("num_key_value_heads", self.num_key_value_heads.into());
        set("head_dim", self.head_dim.into());
        set("intermediate_size", self.intermediate_size.into());
        set("vocab_size", self.vocab_size.into());
        set("rms_norm_eps", self.rms_norm_eps.into());
        set("rope_theta", self.rope_theta.into());
        set(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        set("tie_word_embeddings", self.tie_word_embeddings.into());
        set("scale_emb", self.scale_emb.into());
        set("scale_depth", self.scale_depth.into());
        set("dim_model_base", self.dim_model_base.into());
        set(
            "mixer_types",
            self.mixer_types
                .iter()
                .map(|k| k.name())
                .collect::<Vec<_>>()
                .into(),
        );
        set("attn_use_output_gate", self.attn_use_output_gate.into());
        set("lightning_use_rope", self.lightning_use_rope.into());
        set("qk_norm", self.qk_norm.into());
        set("use_output_norm", self.use_output_norm.into());
        set("use_output_gate", self.use_output_gate.into());
        set("lightning_nkv", self.lightning_nkv.into());
        set("lightning_nh", self.num_attention_heads.into());
        set("lightning_head_dim", self.head_dim.into());
        set(
            "sparse_config",
            serde_json::to_value(&self.sparse).expect("serialisable"),
        );
        set("bos_token_id", self.bos_token_id.into());
        set("eos_token_id", self.eos_token_ids.clone().into());
        set("pad_token_id", self.pad_token_id.into());
        v
    }
}

/// ALiBi slopes for `n` heads, computed in f64 then rounded to f32 as HF does.
pub fn alibi_slopes(n: usize) -> Vec<f32> {
    fn power_of_2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start * start.powi(i as i32)).collect()
    }
    let slopes = if n.is_power_of_two() {
        power_of_2(n)
    } else {
        let closest = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let mut s = power_of_2(closest);
        let extra = power_of_2(2 * closest);
        s.extend(extra.iter().step_by(2).take(n - closest));
        s
    };
    slopes.into_iter().map(|s| s as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released() -> serde_json::Value {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/released_config.json"
        );
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn parses_released_config() {
        let c = ModelConfig::from_json(released()).unwrap();
        assert_eq!(c.hidden_size, 4096);
        assert_eq!(c.head_dim, 128);
        assert_eq!(c.num_key_value_heads, 2);
        assert_eq!(c.layer_count(MixerKind::Sparse), 8);
        let sparse: Vec<usize> = (0..32)
            .filter(|&i| c.mixer_types[i] == MixerKind::Sparse)
            .collect();
        assert_eq!(sparse, vec![0, 9, 16, 17, 22, 29, 30, 31]);
        assert_eq!(c.sparse.selected_blocks(), 96);
        assert_eq!(c.sparse.local_blocks(), 32);
        assert_eq!(c.eos_token_ids, vec![2, 73440]);
        assert!((c.residual_scale() - 0.2474873734152916).abs() < 1e-15);
        assert_eq!(c.logit_divisor(), 16.0);
    }

    #[test]
    fn slopes_match_spec_table() {
        let s = alibi_slopes(32);
        assert_eq!(s[0].to_bits(), 0x3f5744fd);
        assert_eq!(s[1].to_bits(), 0x3f3504f3);
        assert_eq!(s[3], 0.5);
        assert_eq!(s[15], 0.0625);
        assert_eq!(s[31], 0.00390625);
    }

    #[test]
    fn rejects_unknown_mixer_type_naming_it() {
        let mut v = released();
        v["mixer_types"][5] = "mamba".into();
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("mixer_types[5]") && e.contains("mamba"), "{e}");
    }

    #[test]
    fn a_quantized_checkpoint_is_read_or_named_as_such() {
        let mut v = released();
        v["quantization_config"] = serde_json::json!({
            "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false
        });
        let c = ModelConfig::from_json(v.clone()).unwrap();
        assert_eq!(c.quantization.unwrap().group_size, Some(128));
        v["quantization_config"]["bits"] = 8.into();
        let e = ModelConfig::from_json(v.clone()).unwrap_err().to_string();
        assert!(
            e.contains("quantization_config") && e.contains("8 bits"),
            "{e}"
        );
        v["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
        let e = ModelConfig::from_json(v.clone()).unwrap_err().to_string();
        assert!(
            e.contains("quantization_config") && e.contains("fp8"),
            "{e}"
        );
        // A null entry is no quantization.
        v["quantization_config"] = serde_json::Value::Null;
        assert!(ModelConfig::from_json(v).unwrap().quantization.is_none());
    }

    #[test]
    fn rejects_inconsistent_sizes() {
        let cases: Vec<(&str, serde_json::Value, &str)> = vec![
            ("num_key_value_heads", 3.into(), "num_key_value_heads"),
            ("head_dim", 64.into(), "head_dim"),
            ("num_hidden_layers", 31.into(), "mixer_types"),
            ("hidden_size", "big".into(), "hidden_size"),
            ("lightning_nkv", 5.into(), "lightning_nkv"),
            ("hidden_act", "gelu".into(), "hidden_act"),
        ];
        for (field, value, named) in cases {
            let mut v = released();
            v[field] = value;
            let e = ModelConfig::from_json(v).unwrap_err().to_string();
            assert!(e.contains(named), "{field}: {e}");
        }
        let mut v = released();
        v.as_object_mut().unwrap().remove("vocab_size");
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("vocab_size") && e.contains("missing"), "{e}");
        let mut v = released();
        v["sparse_config"]["block_size"] = 50.into();
        let e = ModelConfig::from_json(v).unwrap_err().to_string();
        assert!(e.contains("sparse_config.block_size"), "{e}");
        for (field, value) in [("window_size", 0), ("kernel_size", 100)] {
            let mut v = released();
            v["sparse_config"][field] = value.into();
            let e = ModelConfig::from_json(v).unwrap_err().to_string();
            assert!(e.contains(&format!("sparse_config.{field}")), "{e}");
        }
    }

    #[test]
    fn round_trips_through_json() {
        let c = ModelConfig::from_json(released()).unwrap();
        let again = ModelConfig::from_json(c.to_json()).unwrap();
        assert_eq!(c.mixer_types, again.mixer_types);
        assert_eq!(c.sparse, again.sparse);
        assert_eq!(c.eos_token_ids, again.eos_token_ids);
    }
}
