//! Writing checkpoints in the Hugging Face layout: `config.json`, `generation_config.json`, and
//! safetensors weights (one `model.safetensors`, or `model-0000i-of-0000N.safetensors` shards
//! plus `model.safetensors.index.json`). Tensors are produced and written one at a time.
//!
//! Random weights ([`write_random_checkpoint`]) depend only on (seed, tensor name), so a tensor's
//! values are the same whatever the shard layout or dtype (up to rounding). Scales aim to keep
//! activations of order one in a random model of 4–32 layers (argued block by block below, not
//! measured with a forward pass):
//! * linear weights `[out, in]`: N(0, 1/in), so each projection keeps unit-variance inputs at
//!   unit variance (the RMSNorms in front of every block make their inputs unit-RMS);
//! * `model.embed_tokens.weight`: N(0, 1/scale_emb²), so `embed * scale_emb` is N(0, 1);
//! * `lm_head.weight`: N(0, (hidden/dim_model_base)² / hidden), so the logits, taken after the
//!   division by `hidden/dim_model_base`, are N(0, 1) rather than nearly uniform;
//! * norm weights (every 1-D tensor): `1 + 0.1·N(0, 1)`.
//!
//! Normal draws are clamped to `0.001 ≤ |z| ≤ 6` so no weight is zero (even after rounding to
//! f16) and no norm weight is near zero.

use crate::config::ModelConfig;
use crate::rng::{splitmix64, Rng};
use crate::schema::{expected_tensors, Role, TensorSpec};
use crate::weights::{f32_to_bf16_bits, CheckpointError, DType, INDEX_FILE, SINGLE_FILE};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// How [`write_random_checkpoint`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOptions {
    pub seed: u64,
    pub dtype: DType,
    /// Tensor bytes per file; more than this in total gives shards plus an index. A tensor
    /// larger than this gets a shard of its own.
    pub max_shard_bytes: usize,
    /// Linear weights drawn heavy-tailed (Student's t with 3 degrees of freedom, scaled to the
    /// same standard deviation): outliers as trained weights have them, for quantization tests.
    pub heavy_tails: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            dtype: DType::Bf16,
            max_shard_bytes: 5_000_000_000,
            heavy_tails: false,
        }
    }
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a checkpoint for `config` into `dir` with seeded random weights (see the module
/// documentation for the distributions).
pub fn write_random_checkpoint(
    dir: &Path,
    config: &ModelConfig,
    opts: &WriteOptions,
) -> Result<(), CheckpointError> {
    let seed = opts.seed;
    write_checkpoint_with(
        dir,
        config,
        opts.dtype,
        opts.max_shard_bytes,
        |spec, out| {
            fill_random(seed, config, spec, out);
            if opts.heavy_tails && spec.shape.len() == 2 && spec.role != Role::Embed {
                heavy_tails(seed, spec, out);
            }
        },
    )
}

/// Gives `out` (drawn normal around 0) Student's t tails with 3 degrees of freedom at the same
/// standard deviation: each value times sqrt(3 / χ²₃) / sqrt(3).
fn heavy_tails(seed: u64, spec: &TensorSpec, out: &mut [f32]) {
    let mut rng = TensorRng::for_tensor(seed ^ 0x7a11, &spec.name);
    for v in out.iter_mut() {
        let (a, b) = rng.normal_pair();
        let (c, _) = rng.normal_pair();
        let chi2 = a * a + b * b + c * c;
        *v = (*v as f64 / chi2.max(1e-12).sqrt()) as f32;
    }
}

/// The f32 values [`write_random_checkpoint`] draws for `spec` (before rounding to the
/// checkpoint's dtype).
pub fn random_tensor_values(seed: u64, config: &ModelConfig, spec: &TensorSpec) -> Vec<f32> {
    let mut out = vec![0.0; spec.numel()];
    fill_random(seed, config, spec, &mut out);
    out
}

fn fill_random(seed: u64, config: &ModelConfig, spec: &TensorSpec, out: &mut [f32]) {
    let mut rng = TensorRng::for_tensor(seed, &spec.name);
    let (mean, std) = init_scale(config, spec);
    let mut i = 0;
    while i < out.len() {
        let (a, b) = rng.normal_pair();
        out[i] = (mean + std * a) as f32;
        if i + 1 < out.len() {
            out[i + 1] = (mean + std * b) as f32;
        }
        i += 2;
    }
}

/// (mean, standard deviation) of the random init of one tensor.
pub fn init_scale(config: &ModelConfig, spec: &TensorSpec) -> (f64, f64) {
    let hidden = config.hidden_size as f64;
    if spec.shape.len() == 1 {
        (1.0, 0.1)
    } else if spec.role == Role::Embed {
        let scale = if config.scale_emb > 0.0 {
            config.scale_emb
        } else {
            1.0
        };
        (0.0, 1.0 / scale)
    } else if spec.role == Role::LmHead {
        (0.0, config.logit_divisor() / hidden.sqrt())
    } else {
        let fan_in = spec.shape.last().copied().unwrap_or(1).max(1) as f64;
        (0.0, 1.0 / fan_in.sqrt())
    }
}

/// The generator for one tensor, seeded from (seed, FNV-1a hash of the tensor name).
struct TensorRng(Rng);

impl TensorRng {
    fn for_tensor(seed: u64, name: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in name.as_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
        }
        let mut state = seed ^ h.rotate_left(17);
        // Mixing the seed in through one splitmix step keeps (seed, name) pairs apart.
        state = splitmix64(&mut state) ^ h;
        Self(Rng::from_splitmix(state))
    }

    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [-1, 1).
    fn signed_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (2.0 / (1u64 << 53) as f64) - 1.0
    }

    /// Two independent N(0, 1) draws (Box–Muller, polar form), each clamped to
    /// `0.001 ≤ |z| ≤ 6`.
    fn normal_pair(&mut self) -> (f64, f64) {
        loop {
            let u = self.signed_unit();
            let v = self.signed_unit();
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                let m = (-2.0 * s.ln() / s).sqrt();
                return (clamp_normal(u * m), clamp_normal(v * m));
            }
        }
    }
}

fn clamp_normal(z: f64) -> f64 {
    let a = z.abs().clamp(1e-3, 6.0);
    if z < 0.0 {
        -a
    } else {
        a
    }
}

/// Writes a checkpoint for `config` into `dir`, asking `fill` for the values of each tensor
/// (row-major, f32, rounded to `dtype` to nearest even). Only one tensor is in memory at a time.
/// Weight files of an earlier checkpoint in `dir` are removed first.
pub fn write_checkpoint_with<F>(
    dir: &Path,
    config: &ModelConfig,
    dtype: DType,
    max_shard_bytes: usize,
    mut fill: F,
) -> Result<(), CheckpointError>
where
    F: FnMut(&TensorSpec, &mut [f32]),
{
    write_config_only(dir, config, dtype)?;
    remove_old_weights(dir)?;
    let specs = expected_tensors(config);
    let shards = plan_shards(&specs, dtype, max_shard_bytes);
    if shards.len() == 1 {
        let path = dir.join(SINGLE_FILE);
        return write_safetensors_file(&path, &specs, dtype, &mut fill);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, members) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let part: Vec<TensorSpec> = members.iter().map(|&j| specs[j].clone()).collect();
        write_safetensors_file(&dir.join(&name), &part, dtype, &mut fill)?;
        for spec in &part {
            weight_map.insert(spec.name.clone(), name.clone().into());
        }
    }
    let total: u64 = specs
        .iter()
        .map(|s| (s.numel() * dtype.size()) as u64)
        .sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    });
    write_json(&dir.join(INDEX_FILE), &index)
}

/// Groups tensors (in order) into shards of at most `max_bytes` tensor bytes each.
fn plan_shards(specs: &[TensorSpec], dtype: DType, max_bytes: usize) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut used = 0usize;
    for (i, spec) in specs.iter().enumerate() {
        let bytes = spec.numel() * dtype.size();
        let current = shards.last_mut().expect("non-empty");
        if !current.is_empty() && used.saturating_add(bytes) > max_bytes {
            shards.push(vec![i]);
            used = bytes;
        } else {
            current.push(i);
            used += bytes;
        }
    }
    shards
}

/// Writes one safetensors file holding `tensors` (all of `dtype`), in order, asking `fill` for
/// each tensor's values (row-major f32, rounded to `dtype` to nearest even).
pub fn write_safetensors_file(
    path: &Path,
    tensors: &[TensorSpec],
    dtype: DType,
    fill: &mut dyn FnMut(&TensorSpec, &mut [f32]),
) -> Result<(), CheckpointError> {
    let header = safetensors_header(tensors.iter().map(|t| {
        (
            t.name.as_str(),
            dtype.safetensors_name(),
            t.shape.as_slice(),
            t.numel() * dtype.size(),
        )
    }));

    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        // One tensor's values at a time; bytes are encoded in pieces to keep that buffer small.
        let mut values = Vec::new();
        let mut bytes = Vec::new();
        for t in tensors {
            values.clear();
            values.resize(t.numel(), 0.0f32);
            fill(t, &mut values);
            for chunk in values.chunks(1 << 16) {
                bytes.clear();
                encode(chunk, dtype, &mut bytes);
                w.write_all(&bytes)?;
            }
        }
        w.flush()
    })();
    result.map_err(write_err(path))
}

/// A safetensors header (its JSON, padded with spaces so the data starts 8-byte aligned, as
/// the reference writer does) for tensors (name, dtype, shape, bytes) laid out in order.
fn safetensors_header<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a str, &'a [usize], usize)>,
) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0usize;
    for (name, dtype, shape, len) in tensors {
        header.insert(
            name.to_string(),
            serde_json::json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&header).expect("header serialises");
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    header
}

/// A tensor already encoded: name, safetensors dtype name, shape and little-endian bytes.
pub struct RawTensor {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Writes one safetensors file holding `tensors` as they are, in order.
pub fn write_raw_safetensors(path: &Path, tensors: &[RawTensor]) -> Result<(), CheckpointError> {
    let header = safetensors_header(
        tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), t.bytes.len())),
    );
    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(path)?);
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        for t in tensors {
            w.write_all(&t.bytes)?;
        }
        w.flush()
    })();
    result.map_err(write_err(path))
}

/// Appends `values` rounded to `dtype` (little-endian) to `out`.
fn encode(values: &[f32], dtype: DType, out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend(values.iter().flat_map(|v| v.to_le_bytes())),
        DType::Bf16 => out.extend(
            values
                .iter()
                .flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes()),
        ),
        DType::F16 => out.extend(
            values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()),
        ),
    }
}

pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), CheckpointError> {
    let mut text = serde_json::to_string_pretty(value).expect("JSON serialises");
    text.push('\n');
    std::fs::write(path, text).map_err(write_err(path))
}

/// Creates `dir` and writes `config.json` and `generation_config.json` (no weights).
pub fn write_config_only(
    dir: &Path,
    config: &ModelConfig,
    dtype: DType,
) -> Result<(), CheckpointError> {
    std::fs::create_dir_all(dir).map_err(write_err(dir))?;
    let mut json = config.to_json();
    let obj = json.as_object_mut().expect("to_json gives an object");
    obj.insert(
        "architectures".into(),
        serde_json::json!(["MiniCPMSALAForCausalLM"]),
    );
    obj.insert("model_type".into(), "minicpm_sala".into());
    obj.insert("torch_dtype".into(), dtype.torch_name().into());
    if obj.contains_key("dtype") {
        obj.insert("dtype".into(), dtype.torch_name().into());
    }
    write_json(&dir.join("config.json"), &json)?;
    let generation = serde_json::json!({
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids,
        "pad_token_id": config.pad_token_id,
    });
    write_json(&dir.join("generation_config.json"), &generation)
}

/// Whether `name` is a shard name this writer produces (`model-00001-of-00004.safetensors`).
fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let b = rest.as_bytes();
    b.len() == 14 && &rest[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// Removes the weight files of an earlier checkpoint so the new one is not mixed with them.
fn remove_old_weights(dir: &Path) -> Result<(), CheckpointError> {
    let entries = std::fs::read_dir(dir).map_err(write_err(dir))?;
    for entry in entries {
        let entry = entry.map_err(write_err(dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == SINGLE_FILE || name == INDEX_FILE || is_shard_name(name) {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(write_err(&path))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MixerKind;
    use crate::presets::preset;
    use crate::schema::{expected_parameter_count, Place};
    use crate::weights::Checkpoint;

    fn tiny() -> ModelConfig {
        preset("tiny").unwrap()
    }

    fn opts(seed: u64, dtype: DType, max_shard_bytes: usize) -> WriteOptions {
        WriteOptions {
            seed,
            dtype,
            max_shard_bytes,
            heavy_tails: false,
        }
    }

    fn all_values(ck: &Checkpoint) -> Vec<(String, Vec<f32>)> {
        ck.tensors()
            .map(|t| (t.name.clone(), ck.read_f32(&t.name).unwrap()))
            .collect()
    }

    fn mean_std(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    #[test]
    fn values_depend_on_seed_and_name_only() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        write_random_checkpoint(a.path(), &tiny(), &opts(3, DType::F32, usize::MAX)).unwrap();
        write_random_checkpoint(b.path(), &tiny(), &opts(3, DType::F32, 100_000)).unwrap();
        write_random_checkpoint(c.path(), &tiny(), &opts(4, DType::F32, usize::MAX)).unwrap();
        let va = all_values(&Checkpoint::open(a.path()).unwrap());
        let vb = all_values(&Checkpoint::open(b.path()).unwrap());
        let vc = all_values(&Checkpoint::open(c.path()).unwrap());
        assert!(va == vb, "shard layout changed the values");
        for ((name, x), (_, y)) in va.iter().zip(&vc) {
            assert!(x != y, "{name}: same values for seeds 3 and 4");
        }
        // Tensors of one shape differ from each other.
        let q = |l: usize| {
            va.iter()
                .find(|(n, _)| *n == format!("model.layers.{l}.self_attn.q_proj.weight"))
                .unwrap()
        };
        assert!(q(0).1 != q(1).1);
        for (name, values) in [&va[0], &va[5], &va[6]] {
            let spec = expected_tensors(&tiny())
                .into_iter()
                .find(|s| &s.name == name)
                .unwrap();
            assert!(random_tensor_values(3, &tiny(), &spec) == *values, "{name}");
        }
        // Same seed, same bytes.
        let again = tempfile::tempdir().unwrap();
        write_random_checkpoint(again.path(), &tiny(), &opts(3, DType::F32, usize::MAX)).unwrap();
        assert_eq!(
            std::fs::read(a.path().join(SINGLE_FILE)).unwrap(),
            std::fs::read(again.path().join(SINGLE_FILE)).unwrap()
        );
    }

    #[test]
    fn scales_follow_the_documented_init() {
        let c = preset("tiny").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        write_random_checkpoint(tmp.path(), &c, &opts(11, DType::F16, usize::MAX)).unwrap();
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let check = |name: &str, mean: f64, std: f64| {
            let v = ck.read_f32(name).unwrap();
            let (m, s) = mean_std(&v);
            let tol = 4.0 * std / (v.len() as f64).sqrt() + 1e-3 * std;
            assert!((m - mean).abs() < tol.max(0.02 * std), "{name}: mean {m}");
            assert!((s / std - 1.0).abs() < 0.06, "{name}: std {s}, want {std}");
        };
        check("model.embed_tokens.weight", 0.0, 1.0 / 12.0);
        check("lm_head.weight", 0.0, 4.0 / 128f64.sqrt());
        check(
            "model.layers.1.mlp.gate_proj.weight",
            0.0,
            1.0 / 128f64.sqrt(),
        );
        check(
            "model.layers.1.mlp.down_proj.weight",
            0.0,
            1.0 / 256f64.sqrt(),
        );
        check(
            "model.layers.0.self_attn.k_proj.weight",
            0.0,
            1.0 / 128f64.sqrt(),
        );
        check("model.layers.2.self_attn.o_norm.weight", 1.0, 0.1);
        check("model.norm.weight", 1.0, 0.1);
        // No zeros anywhere, even in f16.
        for t in ck.tensors() {
            let v = ck.read_f32(&t.name).unwrap();
            assert!(v.iter().all(|&x| x != 0.0 && x.is_finite()), "{}", t.name);
        }
    }

    #[test]
    fn normal_draws_look_normal() {
        let mut rng = TensorRng::for_tensor(1, "x");
        let n = 200_000;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n / 2 {
            let (a, b) = rng.normal_pair();
            v.push(a);
            v.push(b);
        }
        let within1 = v.iter().filter(|x| x.abs() < 1.0).count() as f64 / n as f64;
        let within2 = v.iter().filter(|x| x.abs() < 2.0).count() as f64 / n as f64;
        assert!((within1 - 0.6827).abs() < 0.005, "{within1}");
        assert!((within2 - 0.9545).abs() < 0.003, "{within2}");
        assert!(v.iter().all(|x| (1e-3..=6.0).contains(&x.abs())));
        assert_eq!(clamp_normal(0.0), 1e-3);
        assert_eq!(clamp_normal(-1e-9), -1e-3);
        assert_eq!(clamp_normal(-7.0), -6.0);
    }

    #[test]
    fn shards_respect_the_size_limit() {
        let tmp = tempfile::tempdir().unwrap();
        let max = 150_000;
        write_random_checkpoint(tmp.path(), &tiny(), &opts(0, DType::Bf16, max)).unwrap();
        assert!(!tmp.path().join(SINGLE_FILE).exists());
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(tmp.path().join(INDEX_FILE)).unwrap()).unwrap();
        let total = 2 * expected_parameter_count(&tiny());
        assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
        let ck = Checkpoint::open(tmp.path()).unwrap();
        let n = ck.files().len();
        assert!(n > 3, "{n} shards");
        for (i, file) in ck.files().iter().enumerate() {
            let name = file.file_name().unwrap().to_str().unwrap();
            assert_eq!(name, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
            let in_file: Vec<_> = ck.tensors().filter(|t| t.file == *file).collect();
            let bytes: usize = in_file.iter().map(|t| t.byte_len()).sum();
            assert!(bytes <= max || in_file.len() == 1, "{name}: {bytes} bytes");
        }
        // Header + data start is 8-byte aligned.
        let raw = std::fs::read(ck.files()[0]).unwrap();
        assert_eq!(u64::from_le_bytes(raw[..8].try_into().unwrap()) % 8, 0);
    }

    #[test]
    fn plan_keeps_order_and_packs_greedily() {
        let spec = |n: usize| TensorSpec {
            name: format!("t{n}"),
            shape: vec![n],
            role: Role::InputNorm,
            place: Place::Layer(n, MixerKind::Sparse),
        };
        let specs = [spec(10), spec(10), spec(30), spec(5), spec(1)];
        assert_eq!(
            plan_shards(&specs, DType::F32, 80),
            vec![vec![0, 1], vec![2], vec![3, 4]]
        );
        assert_eq!(
            plan_shards(&specs, DType::F32, 224),
            vec![vec![0, 1, 2, 3, 4]]
        );
        assert_eq!(
            plan_shards(&specs, DType::Bf16, 2),
            vec![vec![0], vec![1], vec![2], vec![3], vec![4]]
        );
    }

    #[test]
    fn config_files_are_written() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b");
        let c = tiny();
        write_config_only(&dir, &c, DType::F16).unwrap();
        let read = |f: &str| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap()
        };
        let cfg = read("config.json");
        assert_eq!(
            cfg["architectures"],
            serde_json::json!(["MiniCPMSALAForCausalLM"])
        );
        assert_eq!(cfg["model_type"], "minicpm_sala");
        assert_eq!(cfg["torch_dtype"], "float16");
        let mut again = ModelConfig::from_json(cfg).unwrap();
        let mut want = c.clone();
        again.raw = serde_json::Value::Null;
        want.raw = serde_json::Value::Null;
        assert_eq!(again, want);
        let generation = read("generation_config.json");
        assert_eq!(
            generation,
            serde_json::json!({"bos_token_id": 1, "eos_token_id": [2, 1016], "pad_token_id": 2})
        );
        // The released config keeps its own keys and gets the dtype it is written in.
        let released = preset("minicpm-sala-9b").unwrap();
        write_config_only(&dir, &released, DType::F32).unwrap();
        let cfg = read("config.json");
        assert_eq!(cfg["torch_dtype"], "float32");
        assert_eq!(cfg["mup_denominator"], 32);
    }

    #[test]
    fn rewriting_replaces_old_weight_files() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("notes.txt"), "keep").unwrap();
        write_random_checkpoint(tmp.path(), &tiny(), &opts(0, DType::Bf16, 100_000)).unwrap();
        write_random_checkpoint(tmp.path(), &tiny(), &opts(1, DType::F32, usize::MAX)).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "config.json",
                "generation_config.json",
                SINGLE_FILE,
                "notes.txt"
            ]
        );
        let ck = Checkpoint::open(tmp.path()).unwrap();
        assert!(ck
            .tensors()
            .all(|t| t.dtype == crate::Element::Float(DType::F32)));
        assert!(is_shard_name("model-00001-of-00012.safetensors"));
        assert!(!is_shard_name("model-0001-of-00012.safetensors"));
        assert!(!is_shard_name("model-0000a-of-00012.safetensors"));
        assert!(!is_shard_name("model-00001-of-00012.bin"));
    }

    #[test]
    fn writing_into_an_unwritable_place_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let blocker = tmp.path().join("file");
        std::fs::write(&blocker, "x").unwrap();
        let e = write_random_checkpoint(&blocker.join("sub"), &tiny(), &WriteOptions::default())
            .unwrap_err();
        assert!(matches!(e, CheckpointError::Write { .. }), "{e}");
        assert!(e.to_string().contains("file/sub"), "{e}");
    }

    /// Writing the ~113M-parameter `small` preset stays quick (a few seconds in release).
    #[test]
    fn small_preset_writes_and_opens() {
        let c = preset("small").unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let start = std::time::Instant::now();
        write_random_checkpoint(tmp.path(), &c, &WriteOptions::default()).unwrap();
        let took = start.elapsed();
        let ck = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(ck.parameter_count(), expected_parameter_count(&c));
        assert!(took.as_secs_f64() < 30.0, "{took:?}");
        eprintln!("wrote {} parameters in {took:?}", ck.parameter_count());
    }

    /// Heavy tails: the linear weights keep their standard deviation but gain outliers (excess
    /// kurtosis well above a normal's 0); norms and the embedding are as without.
    #[test]
    fn heavy_tailed_weights_keep_their_scale_and_gain_outliers() {
        let config = tiny();
        let spec = crate::expected_tensors(&config)
            .into_iter()
            .find(|t| t.name.ends_with("mlp.down_proj.weight"))
            .unwrap();
        let moments = |v: &[f32]| {
            let n = v.len() as f64;
            let var = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / n;
            let m4 = v.iter().map(|&x| (x as f64).powi(4)).sum::<f64>() / n;
            (var.sqrt(), m4 / (var * var) - 3.0)
        };
        let mut plain = random_tensor_values(3, &config, &spec);
        let (std0, kurt0) = moments(&plain);
        heavy_tails(3, &spec, &mut plain);
        let (std1, kurt1) = moments(&plain);
        assert!(kurt0.abs() < 0.3, "normal: excess kurtosis {kurt0}");
        assert!(kurt1 > 2.0, "heavy: excess kurtosis {kurt1}");
        assert!((std1 / std0 - 1.0).abs() < 0.25, "std {std0} -> {std1}");
    }
}
