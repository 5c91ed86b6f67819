//! 4-bit GPTQ checkpoints (`quantization_config.quant_method: gptq`): each quantized linear
//! `X.weight [out, in]` is stored as `X.qweight` (I32 `[in / 8, out]`, eight 4-bit values a
//! word along the input, lowest nibble first), `X.qzeros` (I32 `[in / g, out / 8]`, packed
//! along the output), `X.scales` (F16 `[in / g, out]`) and optionally `X.g_idx` (I32 `[in]`,
//! which must be `i / g`: `desc_act` false). Value `w[o][i] = (q − z) · s` of its group, where
//! the stored zero is `z − 1` in the original GPTQ format (`checkpoint_format` "gptq", the
//! default) and `z` in GPTQModel's "gptq_v2". Modules matched by a negative `dynamic` entry
//! (`"-:<regex>"`) stay bf16, as do the embeddings, norms and `lm_head`.

use serde_json::{json, Value};

/// Values packed in one 32-bit word.
const PACK: usize = 8;

/// A 4-bit weight's value before its bf16 rounding: `(q − zero) · bf16(scale)`, exact in f32
/// (a whole number of at most 5 bits times an 8-bit mantissa). The one definition every
/// backend and the checkpoint reader share.
pub fn w4_value(q: u32, zero: f32, scale: f32) -> f32 {
    (q as f32 - zero) * half::bf16::from_f32(scale).to_f32()
}

/// The least bf16 value at or above `x` (a positive scale).
fn bf16_at_least(x: f32) -> f32 {
    let b = half::bf16::from_f32(x);
    if b.to_f32() >= x {
        b.to_f32()
    } else {
        half::bf16::from_bits(b.to_bits() + 1).to_f32()
    }
}

/// A quantized linear as stored: qweight and qzeros (little-endian words) and its scales.
pub type Quantized = (Vec<u8>, Vec<u8>, Vec<f32>);

/// A quantized linear by rows ([`Gptq::to_rows`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Rows {
    pub words: Vec<u32>,
    pub scales: Vec<f32>,
    pub zeros: Vec<f32>,
    pub group: usize,
}

/// A checkpoint's GPTQ parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Gptq {
    /// Inputs sharing a scale and zero; `None`: one group over the whole input.
    pub group_size: Option<usize>,
    pub sym: bool,
    /// Stored zeros are the real ones minus one (the original format).
    pub zero_minus_one: bool,
    /// Regexes of the modules left unquantized.
    pub skip: Vec<String>,
}

impl Gptq {
    /// Reads `quantization_config`; a clear error for what is not supported.
    pub fn from_json(q: &Value) -> Result<Self, String> {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method != "gptq" {
            return Err(format!(
                "quant_method `{method}`: only gptq (4 bits) is supported"
            ));
        }
        match q.get("bits").and_then(Value::as_u64) {
            Some(4) => {}
            other => {
                return Err(format!(
                    "gptq with {} bits: only 4-bit GPTQ is supported",
                    other.map_or("unknown".into(), |b| b.to_string())
                ))
            }
        }
        if q.get("desc_act").and_then(Value::as_bool) == Some(true) {
            return Err(
                "gptq with desc_act true (activation order): not supported; \
                        quantize with desc_act false"
                    .into(),
            );
        }
        if q.get("lm_head").and_then(Value::as_bool) == Some(true) {
            return Err("gptq with a quantized lm_head: not supported".into());
        }
        let group_size = match q.get("group_size").and_then(Value::as_i64) {
            Some(-1) => None,
            Some(g) if g > 0 && (g as usize).is_multiple_of(PACK) => Some(g as usize),
            other => {
                return Err(format!(
                    "gptq group_size {other:?}: expected -1 or a positive multiple of 8"
                ))
            }
        };
        let zero_minus_one = match q.get("checkpoint_format").and_then(Value::as_str) {
            None | Some("gptq") => true,
            Some("gptq_v2") => false,
            Some(f) => {
                return Err(format!(
                    "gptq checkpoint_format `{f}`: expected gptq or gptq_v2"
                ))
            }
        };
        let mut skip = Vec::new();
        if let Some(dynamic) = q.get("dynamic").filter(|d| !d.is_null()) {
            let map = dynamic
                .as_object()
                .ok_or_else(|| format!("gptq dynamic {dynamic}: expected an object"))?;
            for (key, overrides) in map {
                match key.strip_prefix("-:") {
                    Some(pattern) => {
                        regex::Regex::new(pattern)
                            .map_err(|e| format!("gptq dynamic `{key}`: {e}"))?;
                        skip.push(pattern.to_string());
                    }
                    None => {
                        let empty = overrides.as_object().is_some_and(|o| o.is_empty());
                        if !empty {
                            return Err(format!(
                                "gptq dynamic `{key}`: per-module bits or group sizes are not supported (only `-:` skips)"
                            ));
                        }
                    }
                }
            }
        }
        Ok(Self {
            group_size,
            sym: q.get("sym").and_then(Value::as_bool).unwrap_or(true),
            zero_minus_one,
            skip,
        })
    }

    /// The `quantization_config` this writes.
    pub fn to_json(&self) -> Value {
        let dynamic: serde_json::Map<String, Value> = self
            .skip
            .iter()
            .map(|p| (format!("-:{p}"), json!({})))
            .collect();
        json!({
            "quant_method": "gptq",
            "bits": 4,
            "group_size": self.group_size.map_or(-1, |g| g as i64),
            "sym": self.sym,
            "desc_act": false,
            "checkpoint_format": if self.zero_minus_one { "gptq" } else { "gptq_v2" },
            "lm_head": false,
            "dynamic": dynamic,
        })
    }

    /// Whether linear `weight` (its `.weight` name) is stored quantized.
    pub fn quantizes(&self, weight: &str) -> bool {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        !self.skip.iter().any(|p| {
            regex::Regex::new(&format!("^(?:{p})$"))
                .is_ok_and(|r| r.is_match(module) || r.is_match(weight))
        })
    }

    /// The group size for `inputs` inputs, checked: inputs and outputs in whole words and
    /// groups.
    pub fn group(&self, name: &str, out: usize, inputs: usize) -> Result<usize, String> {
        let g = self.group_size.unwrap_or(inputs);
        if !inputs.is_multiple_of(g) || !inputs.is_multiple_of(PACK) || !out.is_multiple_of(PACK) {
            return Err(format!(
                "{name}: [{out}, {inputs}] does not split into 4-bit words and groups of {g}"
            ));
        }
        Ok(g)
    }

    /// The stored tensors of quantized linear `weight` `[out, inputs]`: (name, shape, I32 or
    /// not), `g_idx` last (optional in a checkpoint).
    pub fn stored(
        &self,
        weight: &str,
        out: usize,
        inputs: usize,
    ) -> Vec<(String, Vec<usize>, bool)> {
        let module = weight.strip_suffix(".weight").unwrap_or(weight);
        let g = self.group_size.unwrap_or(inputs).max(1);
        vec![
            (format!("{module}.qweight"), vec![inputs / PACK, out], true),
            (
                format!("{module}.qzeros"),
                vec![inputs / g, out / PACK],
                true,
            ),
            (format!("{module}.scales"), vec![inputs / g, out], false),
            (format!("{module}.g_idx"), vec![inputs], true),
        ]
    }

    /// A quantized linear as rows, from its stored words (little-endian bytes), scales (as
    /// f32) and optional `g_idx`: `[out, inputs / 8]` words (row `o`'s inputs, eight a word,
    /// the lowest nibble first), and each row's `[out, inputs / g]` scales and zeros (the real
    /// zero points), with `g`.
    pub fn to_rows(
        &self,
        name: &str,
        (out, inputs): (usize, usize),
        qweight: &[u8],
        qzeros: &[u8],
        scales: &[f32],
        g_idx: Option<&[u8]>,
    ) -> Result<Rows, String> {
        let g = self.group(name, out, inputs)?;
        let groups = inputs / g;
        let word = |b: &[u8], i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap());
        if qweight.len() != inputs * out / 2
            || qzeros.len() != groups * out / 2
            || scales.len() != groups * out
        {
            return Err(format!("{name}: stored tensors of the wrong sizes"));
        }
        if let Some(idx) = g_idx {
            let wrong = (0..inputs).find(|&i| word(idx, i) as usize != i / g);
            if let Some(i) = wrong {
                return Err(format!(
                    "{name}: g_idx[{i}] is {}, not {} (activation order, desc_act true, is not supported)",
                    word(idx, i) as i32,
                    i / g
                ));
            }
        }
        let offset = u32::from(self.zero_minus_one);
        let mut words = vec![0u32; out * inputs / PACK];
        for r in 0..inputs / PACK {
            for o in 0..out {
                words[o * (inputs / PACK) + r] = word(qweight, r * out + o);
            }
        }
        let mut row_scales = vec![0f32; out * groups];
        let mut zeros = vec![0f32; out * groups];
        for grp in 0..groups {
            for o in 0..out {
                let z = ((word(qzeros, grp * (out / PACK) + o / PACK) >> (4 * (o % PACK))) & 15)
                    + offset;
                zeros[o * groups + grp] = z as f32;
                row_scales[o * groups + grp] = scales[grp * out + o];
            }
        }
        Ok(Rows {
            words,
            scales: row_scales,
            zeros,
            group: g,
        })
    }

    /// `[out, inputs]` values of a quantized linear ([`Gptq::to_rows`]'s): `(q − z) · s`, the
    /// scale rounded to bf16 as the model holds it (the product is then exact in f32).
    pub fn dequantize(
        &self,
        name: &str,
        (out, inputs): (usize, usize),
        qweight: &[u8],
        qzeros: &[u8],
        scales: &[f32],
        g_idx: Option<&[u8]>,
    ) -> Result<Vec<f32>, String> {
        let r = self.to_rows(name, (out, inputs), qweight, qzeros, scales, g_idx)?;
        let groups = inputs / r.group;
        let mut w = vec![0f32; out * inputs];
        for o in 0..out {
            for i in 0..inputs {
                let q = (r.words[o * (inputs / PACK) + i / PACK] >> (4 * (i % PACK))) & 15;
                let k = o * groups + i / r.group;
                w[o * inputs + i] = w4_value(q, r.zeros[k], r.scales[k]);
            }
        }
        Ok(w)
    }

    /// A group's scale and zero point, round to nearest's rule: symmetric about 8, or spanning
    /// the group's range; the scale as the model reads it (bf16, rounded up so the grid still
    /// spans the group; stored as f16, which holds it exactly at a weight's magnitudes).
    fn group_params(&self, vals: &[f32]) -> (f32, u32) {
        let (lo, hi) = vals
            .iter()
            .fold((0f32, 0f32), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let (scale, zero) = if self.sym {
            (hi.abs().max(lo.abs()) / 7.0, 8)
        } else {
            let s = (hi - lo) / 15.0;
            let z = if s > 0.0 {
                (-lo / s).round().clamp(0.0, 15.0) as u32
            } else {
                8
            };
            (s, z)
        };
        (half::f16::from_f32(bf16_at_least(scale)).to_f32(), zero)
    }

    /// A weight's 4-bit value at (scale, zero).
    fn code(x: f32, scale: f32, zero: u32) -> u32 {
        if scale > 0.0 {
            (x / scale + zero as f32).round().clamp(0.0, 15.0) as u32
        } else {
            zero
        }
    }

    /// The stored tensors of codes `q` (`[out, inputs]`) with each group's (scale, zero)
    /// (`[groups, out]`).
    fn pack(
        &self,
        q: &[u32],
        scales: Vec<f32>,
        zeros: &[u32],
        out: usize,
        inputs: usize,
    ) -> Quantized {
        let groups = zeros.len() / out.max(1);
        let mut qweight = vec![0u32; inputs / PACK * out];
        for o in 0..out {
            for i in 0..inputs {
                qweight[(i / PACK) * out + o] |= q[o * inputs + i] << (4 * (i % PACK));
            }
        }
        let offset = u32::from(self.zero_minus_one);
        let mut qzeros = vec![0u32; groups * out / PACK];
        for grp in 0..groups {
            for o in 0..out {
                let z = zeros[grp * out + o].saturating_sub(offset) & 15;
                qzeros[grp * (out / PACK) + o / PACK] |= z << (4 * (o % PACK));
            }
        }
        let bytes = |v: Vec<u32>| v.into_iter().flat_map(u32::to_le_bytes).collect();
        (bytes(qweight), bytes(qzeros), scales)
    }

    /// Round to nearest: each group's scale and zero from its weights, each weight to the
    /// nearest code.
    pub fn quantize_rtn(
        &self,
        name: &str,
        w: &[f32],
        (out, inputs): (usize, usize),
    ) -> Result<Quantized, String> {
        let g = self.group(name, out, inputs)?;
        let groups = inputs / g;
        let mut scales = vec![0f32; groups * out];
        let mut zeros = vec![0u32; groups * out];
        for grp in 0..groups {
            for o in 0..out {
                let (s, z) =
                    self.group_params(&w[o * inputs + grp * g..o * inputs + (grp + 1) * g]);
                scales[grp * out + o] = s;
                zeros[grp * out + o] = z;
            }
        }
        let q: Vec<u32> = (0..out * inputs)
            .map(|k| {
                let (o, i) = (k / inputs, k % inputs);
                let at = (i / g) * out + o;
                Self::code(w[k], scales[at], zeros[at])
            })
            .collect();
        Ok(self.pack(&q, scales, &zeros, out, inputs))
    }

    /// GPTQ (Frantar et al., 2022): the inputs quantized one after another, each one's
    /// rounding error spread over the inputs not yet quantized through the inverse of `h`
    /// (`[inputs, inputs]`, Σ xᵀx over the calibration rows of the layer's input), so the
    /// layer's outputs on those rows move least; a group's scale and zero are taken (by
    /// round to nearest's rule) from its weights as updated when the group starts. `damp`:
    /// the fraction of the mean diagonal added to it (0.01 usual).
    pub fn quantize_gptq(
        &self,
        name: &str,
        w: &[f32],
        (out, inputs): (usize, usize),
        h: &[f64],
        damp: f64,
    ) -> Result<Quantized, String> {
        let g = self.group(name, out, inputs)?;
        if h.len() != inputs * inputs {
            return Err(format!(
                "{name}: a Hessian of {} values for {inputs} inputs",
                h.len()
            ));
        }
        let n = inputs;
        let mut w: Vec<f64> = w.iter().map(|&x| x as f64).collect();
        let mut h = h.to_vec();
        // Inputs never seen: weight zeroed, a unit diagonal (as GPTQ does).
        for i in 0..n {
            if h[i * n + i] == 0.0 {
                h[i * n + i] = 1.0;
                for o in 0..out {
                    w[o * n + i] = 0.0;
                }
            }
        }
        let mean_diag = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n.max(1) as f64;
        for i in 0..n {
            h[i * n + i] += damp * mean_diag;
        }
        let u = inverse_cholesky_upper(&h, n).map_err(|e| format!("{name}: {e}"))?;
        let groups = inputs / g;
        let mut scales = vec![0f32; groups * out];
        let mut zeros = vec![0u32; groups * out];
        let mut q = vec![0u32; out * inputs];
        for i in 0..n {
            if i % g == 0 {
                for o in 0..out {
                    let vals: Vec<f32> = w[o * n + i..o * n + i + g]
                        .iter()
                        .map(|&x| x as f32)
                        .collect();
                    let (s, z) = self.group_params(&vals);
                    scales[(i / g) * out + o] = s;
                    zeros[(i / g) * out + o] = z;
                }
            }
            let d = u[i * n + i];
            for o in 0..out {
                let at = (i / g) * out + o;
                let (s, z) = (scales[at], zeros[at]);
                let code = Self::code(w[o * n + i] as f32, s, z);
                q[o * n + i] = code;
                let err = (w[o * n + i] - w4_value(code, z as f32, s) as f64) / d;
                let row = &mut w[o * n..(o + 1) * n];
                for j in i + 1..n {
                    row[j] -= err * u[i * n + j];
                }
            }
        }
        Ok(self.pack(&q, scales, &zeros, out, inputs))
    }
}

/// The upper Cholesky factor `U` of `h⁻¹` (`h⁻¹ = Uᵀ U`), `h` symmetric positive definite
/// `[n, n]`: what GPTQ's column updates read.
fn inverse_cholesky_upper(h: &[f64], n: usize) -> Result<Vec<f64>, String> {
    // h = L Lᵀ.
    let mut l = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let dot: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            if i == j {
                let d = h[i * n + i] - dot;
                if d <= 0.0 || !d.is_finite() {
                    return Err(
                        "the inputs' Hessian is not positive definite (raise the damping)".into(),
                    );
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (h[i * n + j] - dot) / l[j * n + j];
            }
        }
    }
    // L⁻¹ (lower), then h⁻¹ = L⁻ᵀ L⁻¹.
    let mut li = vec![0f64; n * n];
    for i in 0..n {
        li[i * n + i] = 1.0 / l[i * n + i];
        for j in 0..i {
            let s: f64 = (j..i).map(|k| l[i * n + k] * li[k * n + j]).sum();
            li[i * n + j] = -s / l[i * n + i];
        }
    }
    let mut inv = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (i..n).map(|k| li[k * n + i] * li[k * n + j]).sum();
            inv[i * n + j] = s;
            inv[j * n + i] = s;
        }
    }
    // inv = Uᵀ U with U = (chol(inv))ᵀ.
    let mut c = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let dot: f64 = (0..j).map(|k| c[i * n + k] * c[j * n + k]).sum();
            if i == j {
                let d = inv[i * n + i] - dot;
                if d <= 0.0 || !d.is_finite() {
                    return Err("the inverse Hessian is not positive definite".into());
                }
                c[i * n + i] = d.sqrt();
            } else {
                c[i * n + j] = (inv[i * n + j] - dot) / c[j * n + j];
            }
        }
    }
    // U[i][j] = C[j][i].
    let mut u = vec![0f64; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = c[j * n + i];
        }
    }
    Ok(u)
}

/// Writes `src` into `dir` with its linear weights quantized by `q` (round to nearest), as a
/// GPTQ checkpoint: `config.json` with `quantization_config`, one `model.safetensors`, and
/// every other file of `src` (tokenizer, generation config) copied.
pub fn write_quantized(
    src: &crate::Checkpoint,
    dir: &std::path::Path,
    q: &Gptq,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), crate::CheckpointError> {
    write_quantized_calibrated(src, dir, q, &|_| None, progress)
}

/// [`write_quantized`] with GPTQ instead of round to nearest for each linear `hessian` gives
/// the Σ xᵀx of (`[in, in]`, its calibration inputs; 1% damping).
pub fn write_quantized_calibrated<'h>(
    src: &crate::Checkpoint,
    dir: &std::path::Path,
    q: &Gptq,
    hessian: &dyn Fn(&str) -> Option<&'h [f64]>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), crate::CheckpointError> {
    use crate::weights::file_err;
    let f16 = |v: &[f32]| -> Vec<u8> {
        v.iter()
            .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    };
    let mut config = src.config().clone();
    config.quantization = Some(q.clone());
    let mut encode = |name: &str, w: &[f32], (out, inputs): (usize, usize)| {
        if !q.quantizes(name) {
            return Ok(None);
        }
        let (qweight, qzeros, scales) = match hessian(name) {
            Some(h) => q.quantize_gptq(name, w, (out, inputs), h, 0.01),
            None => q.quantize_rtn(name, w, (out, inputs)),
        }
        .map_err(|msg| file_err(src.dir(), msg))?;
        let g = q
            .group(name, out, inputs)
            .map_err(|m| file_err(src.dir(), m))?;
        let g_idx: Vec<u8> = (0..inputs as u32)
            .flat_map(|i| (i / g as u32).to_le_bytes())
            .collect();
        let stored = q.stored(name, out, inputs);
        Ok(Some(
            stored
                .into_iter()
                .zip([
                    ("I32", qweight),
                    ("I32", qzeros),
                    ("F16", f16(&scales)),
                    ("I32", g_idx),
                ])
                .map(|((name, shape, _), (dtype, bytes))| crate::RawTensor {
                    name,
                    dtype,
                    shape,
                    bytes,
                })
                .collect(),
        ))
    };
    write_linears_encoded(src, dir, &config, q.to_json(), &mut encode, progress)
}

/// Writes `src` into `dir` with its decoder linears in FP8 (`f`'s layout, compressed-tensors:
/// E4M3 codes and an f32 scale per output channel, or one per tensor), as `--quantize fp8`
/// makes them when it loads a bf16 checkpoint: the same codes and scales.
pub fn write_fp8(
    src: &crate::Checkpoint,
    dir: &std::path::Path,
    f: &crate::fp8::Fp8Checkpoint,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), crate::CheckpointError> {
    let mut config = src.config().clone();
    config.fp8_checkpoint = Some(f.clone());
    config.fp8_weights = true;
    let mut encode = |name: &str, w: &[f32], (out, inputs): (usize, usize)| {
        if !f.quantizes(name) {
            return Ok(None);
        }
        let mut codes = vec![0u8; out * inputs];
        let scales: Vec<f32> = if f.per_channel {
            w.chunks(inputs.max(1))
                .zip(codes.chunks_mut(inputs.max(1)))
                .map(|(row, c)| crate::fp8::fp8_quantize_row(row, c))
                .collect()
        } else {
            vec![crate::fp8::fp8_quantize_row(w, &mut codes)]
        };
        let stored = f.stored(name, out, inputs);
        Ok(Some(vec![
            crate::RawTensor {
                name: stored[0].0.clone(),
                dtype: "F8_E4M3",
                shape: stored[0].1.clone(),
                bytes: codes,
            },
            crate::RawTensor {
                name: stored[1].0.clone(),
                dtype: "F32",
                shape: stored[1].1.clone(),
                bytes: scales.iter().flat_map(|x| x.to_le_bytes()).collect(),
            },
        ]))
    };
    write_linears_encoded(src, dir, &config, f.to_json(), &mut encode, progress)
}

/// A linear's stored tensors for a quantized checkpoint, from its name, f32 values and
/// shape; `None` keeps it in bf16.
type Encode<'a> = dyn FnMut(
        &str,
        &[f32],
        (usize, usize),
    ) -> Result<Option<Vec<crate::RawTensor>>, crate::CheckpointError>
    + 'a;

/// The quantized checkpoint writers' common part: `config` (with `quantization_config`
/// `qc`) and every tensor of `src`, the decoder linears through `encode`, into one
/// `model.safetensors` in `dir`, and every other file of `src` copied.
fn write_linears_encoded(
    src: &crate::Checkpoint,
    dir: &std::path::Path,
    config: &crate::ModelConfig,
    qc: Value,
    encode: &mut Encode<'_>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), crate::CheckpointError> {
    use crate::weights::{file_err, CheckpointError};
    let write_err = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Write { path, source }
    };
    let source = src.config();
    if source.quantization.is_some() || source.fp8_checkpoint.is_some() {
        return Err(file_err(src.dir(), "the checkpoint is quantized already"));
    }
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let mut json = config.to_json();
    json["quantization_config"] = qc;
    let specs = crate::expected_tensors(config);
    let mut tensors = Vec::with_capacity(specs.len() * 4);
    for (n, spec) in specs.iter().enumerate() {
        progress(n, specs.len());
        let linear = matches!(spec.place, crate::Place::Layer(..)) && spec.shape.len() == 2;
        if linear {
            let w = src.read_f32(&spec.name)?;
            if let Some(stored) = encode(&spec.name, &w, (spec.shape[0], spec.shape[1]))? {
                tensors.extend(stored);
                continue;
            }
        }
        let bits = src.read_bf16_bits(&spec.name)?;
        tensors.push(crate::RawTensor {
            name: spec.name.clone(),
            dtype: "BF16",
            shape: spec.shape.clone(),
            bytes: bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
        });
    }
    progress(specs.len(), specs.len());
    crate::write_raw_safetensors(&dir.join(crate::SINGLE_FILE), &tensors)?;
    crate::writer::write_json(&dir.join("config.json"), &json)?;
    // The tokenizer and the rest, as they are.
    let entries = std::fs::read_dir(src.dir()).map_err(|source| CheckpointError::Io {
        path: src.dir().to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let weights = name.ends_with(".safetensors") || name == crate::INDEX_FILE;
        if weights || name == "config.json" || !entry.path().is_file() {
            continue;
        }
        std::fs::copy(entry.path(), dir.join(&*name)).map_err(write_err(&dir.join(&*name)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gptq(sym: bool, group: Option<usize>, v1: bool) -> Gptq {
        Gptq {
            group_size: group,
            sym,
            zero_minus_one: v1,
            skip: vec![".*o_gate.*".into()],
        }
    }

    /// GPTQ moves a layer's outputs on its calibration inputs less than round to nearest, for
    /// inputs with correlated features (what makes spreading the error pay).
    #[test]
    fn gptq_beats_round_to_nearest_on_its_calibration_inputs() {
        let (out, inputs, rows) = (24, 64, 400);
        let mut x = 99u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as f64 / (1u64 << 31) as f64 - 0.5
        };
        let w: Vec<f32> = (0..out * inputs).map(|_| (next() * 0.2) as f32).collect();
        // Features mixed by a random matrix, some much larger than others.
        let mix: Vec<f64> = (0..inputs * inputs).map(|_| next()).collect();
        let xs: Vec<f64> = (0..rows)
            .flat_map(|_| {
                let z: Vec<f64> = (0..inputs)
                    .map(|i| next() * (1.0 + (i % 7) as f64))
                    .collect();
                let mix = &mix;
                (0..inputs)
                    .map(move |j| (0..inputs).map(|k| z[k] * mix[k * inputs + j]).sum::<f64>())
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut h = vec![0f64; inputs * inputs];
        for r in 0..rows {
            let row = &xs[r * inputs..(r + 1) * inputs];
            for a in 0..inputs {
                for b in 0..inputs {
                    h[a * inputs + b] += row[a] * row[b];
                }
            }
        }
        let err = |values: &[f32]| -> f64 {
            let mut e = 0.0;
            for r in 0..rows {
                let row = &xs[r * inputs..(r + 1) * inputs];
                for o in 0..out {
                    let d: f64 = (0..inputs)
                        .map(|i| row[i] * (values[o * inputs + i] - w[o * inputs + i]) as f64)
                        .sum();
                    e += d * d;
                }
            }
            e
        };
        for q in [gptq(true, Some(32), true), gptq(false, Some(16), false)] {
            let (qw, qz, s) = q.quantize_rtn("t", &w, (out, inputs)).unwrap();
            let rtn = err(&q
                .dequantize("t", (out, inputs), &qw, &qz, &s, None)
                .unwrap());
            let (qw, qz, s) = q.quantize_gptq("t", &w, (out, inputs), &h, 0.01).unwrap();
            let opt = err(&q
                .dequantize("t", (out, inputs), &qw, &qz, &s, None)
                .unwrap());
            assert!(opt < 0.8 * rtn, "GPTQ {opt} vs round to nearest {rtn}");
        }
        // A Hessian of the wrong size is refused by name.
        let q = gptq(true, Some(32), true);
        let e = q
            .quantize_gptq("t", &w, (out, inputs), &h[1..], 0.01)
            .unwrap_err();
        assert!(e.contains("t:") && e.contains("Hessian"), "{e}");
    }

    #[test]
    fn rtn_round_trips_within_half_a_step_of_its_group() {
        let (out, inputs) = (16, 64);
        let mut x = 12345u64;
        let w: Vec<f32> = (0..out * inputs)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.2
            })
            .collect();
        for q in [
            gptq(true, Some(32), true),
            gptq(false, Some(16), false),
            gptq(true, None, false),
        ] {
            let (qw, qz, s) = q.quantize_rtn("t", &w, (out, inputs)).unwrap();
            let back = q
                .dequantize("t", (out, inputs), &qw, &qz, &s, None)
                .unwrap();
            let g = q.group_size.unwrap_or(inputs);
            for o in 0..out {
                for i in 0..inputs {
                    let step = s[(i / g) * out + o];
                    let err = (back[o * inputs + i] - w[o * inputs + i]).abs();
                    assert!(
                        err <= 0.5 * step + 1e-6,
                        "{q:?} [{o}, {i}]: {err} > {step}/2"
                    );
                }
            }
            // The JSON form reads back the same.
            assert_eq!(Gptq::from_json(&q.to_json()).unwrap(), q);
        }
    }

    #[test]
    fn unsupported_settings_are_refused_by_name() {
        let base = gptq(true, Some(128), true).to_json();
        let says = |edit: &dyn Fn(&mut Value), want: &str| {
            let mut v = base.clone();
            edit(&mut v);
            let e = Gptq::from_json(&v).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        };
        says(&|v| v["bits"] = 8.into(), "8 bits");
        says(&|v| v["desc_act"] = true.into(), "desc_act");
        says(&|v| v["quant_method"] = "awq".into(), "awq");
        says(&|v| v["group_size"] = 100.into(), "group_size");
        says(&|v| v["checkpoint_format"] = "marlin".into(), "marlin");
        says(
            &|v| v["dynamic"] = json!({"+:.*down.*": {"bits": 8}}),
            "per-module",
        );
        says(&|v| v["lm_head"] = true.into(), "lm_head");
        let q = Gptq::from_json(&base).unwrap();
        assert!(!q.quantizes("model.layers.3.self_attn.o_gate.weight"));
        assert!(q.quantizes("model.layers.3.self_attn.q_proj.weight"));
        // g_idx other than i / g is activation order.
        let (qw, qz, s) = q.quantize_rtn("t", &vec![0.1; 8 * 256], (8, 256)).unwrap();
        let mut idx: Vec<u8> = (0..256u32).flat_map(|i| (i / 128).to_le_bytes()).collect();
        assert!(q
            .dequantize("t", (8, 256), &qw, &qz, &s, Some(&idx))
            .is_ok());
        idx[0] = 1;
        let e = q
            .dequantize("t", (8, 256), &qw, &qz, &s, Some(&idx))
            .unwrap_err();
        assert!(e.contains("g_idx[0]"), "{e}");
    }
}
