//! FP8 (E4M3) numbers, and FP8 checkpoints: compressed-tensors (`quant_method:
//! compressed-tensors`, float 8-bit weights by channel or by tensor) and NVIDIA ModelOpt
//! (`quant_method: modelopt`, `quant_algo: FP8`): each quantized linear `X.weight` is stored as
//! F8_E4M3 codes `[out, in]` with `X.weight_scale` (one f32/bf16 scale per output channel,
//! `[out, 1]` or `[out]`, or one for the tensor, `[1]` or `[]`), value = code · scale, and an
//! optional static `X.input_scale`, which is not used: inputs are scaled per token, as
//! `--quantize fp8` runs them. Modules listed in `ignore` (compressed-tensors) or
//! `exclude_modules` (ModelOpt) stay bf16, as do the embeddings, norms and lm_head.

use serde_json::{json, Value};

/// The largest finite FP8 E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The FP8 E4M3 code of `x`: round to nearest, ties to even, saturating at ±448 (NaN gives
/// 0x7f). The GPU's `e4m3_code` in `common/fp8.cuh` is the same function bit for bit.
pub fn e4m3_code(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return 0x7f;
    }
    let magnitude = if a < 1.0 / 64.0 {
        // Subnormals: multiples of 2^-9; 8 of them is the least normal (code 0x08).
        (a * 512.0).round_ties_even() as u32
    } else {
        // Keep 3 mantissa bits (ties to even), then rebias the exponent from 127 to 7.
        let bits = a.to_bits();
        let rounded = (bits + 0x7ffff + ((bits >> 20) & 1)) >> 20;
        (rounded - ((127 - 7) << 3)).min(0x7e)
    };
    sign | magnitude as u8
}

/// The value of the FP8 E4M3 code `c` (0x7f and 0xff are NaN).
pub fn e4m3_value(c: u8) -> f32 {
    let (e, m) = ((c >> 3) & 15, (c & 7) as f32);
    let magnitude = match (e, c & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => m / 512.0,
        _ => (8.0 + m) * 2f32.powi(e as i32 - 10),
    };
    if c & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// The FP8 scale of a row (a K or V row of one token and KV head, a weight row, a product's
/// input row): amax / 448, so the row's largest value gets the largest code; 1 for a row of
/// zeros (or one so small that amax / 448 is not a normal f32).
pub fn fp8_row_scale(row: &[f32]) -> f32 {
    let scale = row.iter().fold(0f32, |m, x| m.max(x.abs())) / E4M3_MAX;
    if scale >= f32::MIN_POSITIVE {
        scale
    } else {
        1.0
    }
}

/// A row as FP8: its scale ([`fp8_row_scale`]) and each value's E4M3 code of `x · (1 / scale)`
/// (the reciprocal rounded once, then each product: what the GPU's conversions compute).
pub fn fp8_quantize_row(row: &[f32], codes: &mut [u8]) -> f32 {
    let scale = fp8_row_scale(row);
    let inv = 1.0 / scale;
    for (c, &x) in codes.iter_mut().zip(row) {
        *c = e4m3_code(x * inv);
    }
    scale
}

/// Which layout an FP8 checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    CompressedTensors,
    ModelOpt,
}

/// An FP8 checkpoint's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Checkpoint {
    pub format: Fp8Format,
    /// A scale per output channel (else one per tensor).
    pub per_channel: bool,
    /// Modules left in bf16: names, or regexes (`re:` prefixed).
    pub skip: Vec<String>,
}

impl Fp8Checkpoint {
    /// Reads an FP8 `quantization_config`: `None` for another method; a clear error for an FP8
    /// scheme not supported (block scales, other widths or types).
    pub fn from_json(q: &Value) -> Result<Option<Self>, String> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        let names = |key: &str| -> Vec<String> {
            q.get(key)
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        match method {
            "compressed-tensors" => {
                let groups = q
                    .get("config_groups")
                    .and_then(Value::as_object)
                    .filter(|g| !g.is_empty())
                    .ok_or("compressed-tensors without config_groups")?;
                let mut per_channel = None;
                for (name, group) in groups {
                    let w = group
                        .get("weights")
                        .ok_or_else(|| format!("compressed-tensors group {name}: no weights"))?;
                    let bits = w.get("num_bits").and_then(Value::as_u64);
                    let kind = w.get("type").and_then(Value::as_str);
                    if bits != Some(8) || kind != Some("float") {
                        return Err(format!(
                            "compressed-tensors group {name}: {} bits of type {}: only 8-bit \
                             float (FP8) weights are supported",
                            bits.map_or("?".into(), |b| b.to_string()),
                            kind.unwrap_or("?")
                        ));
                    }
                    let channel = match w.get("strategy").and_then(Value::as_str) {
                        Some("channel") => true,
                        Some("tensor") => false,
                        other => {
                            return Err(format!(
                                "compressed-tensors group {name}: weight strategy {}: only \
                                 channel or tensor scales are supported",
                                other.unwrap_or("?")
                            ))
                        }
                    };
                    if per_channel.is_some_and(|c| c != channel) {
                        return Err("compressed-tensors groups with different strategies".into());
                    }
                    per_channel = Some(channel);
                }
                Ok(Some(Self {
                    format: Fp8Format::CompressedTensors,
                    per_channel: per_channel.unwrap_or(true),
                    skip: names("ignore"),
                }))
            }
            "modelopt" => match q.get("quant_algo").and_then(Value::as_str) {
                Some("FP8") => Ok(Some(Self {
                    format: Fp8Format::ModelOpt,
                    per_channel: false,
                    skip: names("exclude_modules"),
                })),
                other => Err(format!(
                    "modelopt quant_algo {}: only FP8 is supported",
                    other.unwrap_or("?")
                )),
            },
            "fp8" => Err(
                "quant_method fp8 (block-wise scales, `weight_scale_inv`): not \
                          supported; FP8 checkpoints in the compressed-tensors or ModelOpt \
                          layout load, and `--quantize fp8` makes one of a bf16 checkpoint"
                    .into(),
            ),
            _ => Ok(None),
        }
    }

    /// The compressed-tensors `quantization_config` `sala quantize --method fp8` writes.
    pub fn to_json(&self) -> Value {
        json!({
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": true, "dynamic": false,
                            "strategy": if self.per_channel { "channel" } else { "tensor" }},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": true,
                                      "dynamic": true, "strategy": "token"}
            }},
            "ignore": self.skip,
        })
    }

    /// Whether linear `weight` (its `.weight` name) is stored in FP8.
    pub fn quantizes(&self, weight: &str) -> bool {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        !self.skip.iter().any(|p| match p.strip_prefix("re:") {
            Some(re) => regex::Regex::new(&format!("^(?:{re})$")).is_ok_and(|r| r.is_match(module)),
            None => p == module || module.ends_with(&format!(".{p}")) || p == weight,
        })
    }

    /// The stored tensors of FP8 linear `weight` `[out, inputs]`: (name, shape, is the codes,
    /// required); the scales' shapes as this layout writes them (others of the same count are
    /// accepted).
    pub fn stored(
        &self,
        weight: &str,
        out: usize,
        inputs: usize,
    ) -> Vec<(String, Vec<usize>, bool, bool)> {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        let scale = match (self.per_channel, self.format) {
            (true, _) => vec![out, 1],
            (false, Fp8Format::CompressedTensors) => vec![1],
            (false, Fp8Format::ModelOpt) => vec![],
        };
        vec![
            (weight.to_string(), vec![out, inputs], true, true),
            (format!("{module}.weight_scale"), scale, false, true),
            (format!("{module}.input_scale"), vec![], false, false),
        ]
    }
}
