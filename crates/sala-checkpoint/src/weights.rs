//! Safetensors weights of a checkpoint directory (SPEC §8): one `model.safetensors` or shards
//! listed in `model.safetensors.index.json`, memory-mapped and checked against the tensor set
//! that `config.json` implies before anything reads them.

use crate::config::{ConfigError, ModelConfig};
use crate::safetensors::{map_file, parse_header, safe_relative, Element};
use crate::schema::expected_tensors;
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Problems listed in full in one validation error; the rest are counted.
const MAX_LISTED_PROBLEMS: usize = 8;

/// Element types the engine accepts for weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F16,
    F32,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::Bf16 | Self::F16 => 2,
            Self::F32 => 4,
        }
    }

    /// The safetensors header spelling (`"BF16"`, `"F16"`, `"F32"`).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Self::Bf16 => "BF16",
            Self::F16 => "F16",
            Self::F32 => "F32",
        }
    }

    /// Parses a safetensors dtype string; `None` for every type the engine does not accept.
    pub fn from_safetensors_name(name: &str) -> Option<Self> {
        match name {
            "BF16" => Some(Self::Bf16),
            "F16" => Some(Self::F16),
            "F32" => Some(Self::F32),
            _ => None,
        }
    }

    /// The `torch_dtype` spelling of `config.json` (`"bfloat16"`, `"float16"`, `"float32"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
            Self::F32 => "float32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

/// Tensors that may appear in a checkpoint without being expected (non-persistent buffers
/// some exporters save anyway).
fn is_ignored_extra(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

/// Everything that can go wrong opening or reading a checkpoint; each names the file and,
/// where there is one, the tensor or field.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {what} not found")]
    NotFound { path: PathBuf, what: &'static str },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Config { path: PathBuf, source: ConfigError },
    #[error("no weights in {dir}: looked for {looked_for}")]
    NoWeights { dir: PathBuf, looked_for: String },
    /// A file that is not what it should be (corrupt header, bad index).
    #[error("{file}: {msg}")]
    File { file: PathBuf, msg: String },
    /// A tensor entry that is unusable (dtype, byte range, index disagreement).
    #[error("{file}: tensor `{tensor}`: {msg}")]
    Tensor {
        file: PathBuf,
        tensor: String,
        msg: String,
    },
    /// The weights do not match the tensor set `config.json` implies.
    #[error(
        "checkpoint {dir} does not match its config.json: {}",
        list_problems(problems)
    )]
    Mismatch {
        dir: PathBuf,
        problems: Vec<Problem>,
    },
    #[error("checkpoint {dir} has no tensor `{tensor}`")]
    UnknownTensor { dir: PathBuf, tensor: String },
    #[error("{file}: tensor `{tensor}`: {count} non-finite values, the first {value} at flat index {index}")]
    NonFinite {
        file: PathBuf,
        tensor: String,
        count: usize,
        index: usize,
        value: f32,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One disagreement between the weights and the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// An expected tensor is in no weight file (`looked_in`: the file or the index).
    Missing {
        tensor: String,
        shape: Vec<usize>,
        looked_in: PathBuf,
    },
    /// A tensor the config does not call for.
    Unexpected {
        tensor: String,
        shape: Vec<usize>,
        file: PathBuf,
    },
    /// A tensor of the wrong shape.
    Shape {
        tensor: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor of the wrong element type.
    DType {
        tensor: String,
        file: PathBuf,
        expected: &'static str,
        found: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing {
                tensor,
                shape,
                looked_in,
            } => write!(
                f,
                "tensor `{tensor}` (expected shape {shape:?}) is missing from {}",
                looked_in.display()
            ),
            Self::Unexpected {
                tensor,
                shape,
                file,
            } => write!(
                f,
                "{}: unexpected tensor `{tensor}` (shape {shape:?}) that the config does not call for",
                file.display()
            ),
            Self::Shape {
                tensor,
                file,
                expected,
                found,
            } => write!(
                f,
                "{}: tensor `{tensor}` has shape {found:?}, expected {expected:?}",
                file.display()
            ),
            Self::DType {
                tensor,
                file,
                expected,
                found,
            } => write!(
                f,
                "{}: tensor `{tensor}` holds {found} values, expected {expected}",
                file.display()
            ),
        }
    }
}

fn list_problems(problems: &[Problem]) -> String {
    let mut s = format!("{} problem(s): ", problems.len());
    for (i, p) in problems.iter().take(MAX_LISTED_PROBLEMS).enumerate() {
        if i > 0 {
            s.push_str("; ");
        }
        s.push_str(&p.to_string());
    }
    if problems.len() > MAX_LISTED_PROBLEMS {
        s.push_str(&format!(
            "; and {} more",
            problems.len() - MAX_LISTED_PROBLEMS
        ));
    }
    s
}

pub(crate) fn file_err(file: &Path, msg: impl Into<String>) -> CheckpointError {
    CheckpointError::File {
        file: file.to_path_buf(),
        msg: msg.into(),
    }
}

pub(crate) fn tensor_err(file: &Path, tensor: &str, msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Tensor {
        file: file.to_path_buf(),
        tensor: tensor.to_string(),
        msg: msg.into(),
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Element,
    pub shape: Vec<usize>,
    /// The shard file holding it.
    pub file: PathBuf,
    /// Byte range in that file (header included in the offsets).
    pub byte_range: Range<usize>,
    pub(crate) shard: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn byte_len(&self) -> usize {
        self.byte_range.len()
    }
}

/// A borrowed tensor: its raw little-endian bytes in the memory map.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub file: &'a Path,
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values widened to f32 (exact for all three dtypes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::Bf16 => self.u16s().map(bf16_bits_to_f32).collect(),
            DType::F16 => self
                .u16s()
                .map(|b| half::f16::from_bits(b).to_f32())
                .collect(),
        }
    }

    /// The values as bf16 bit patterns, rounded to nearest even from f32/f16.
    pub fn to_bf16_bits(&self) -> Vec<u16> {
        match self.dtype {
            DType::Bf16 => self.u16s().collect(),
            DType::F16 => self
                .u16s()
                .map(|b| f32_to_bf16_bits(half::f16::from_bits(b).to_f32()))
                .collect(),
            DType::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|b| f32_to_bf16_bits(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect(),
        }
    }

    fn u16s(&self) -> impl Iterator<Item = u16> + '_ {
        self.bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
}

/// bf16 bits → f32 (exact: bf16 is the top half of an f32).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 → bf16 bits, round to nearest, ties to even; NaN stays NaN.
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// One memory-mapped safetensors file.
pub(crate) struct Shard {
    pub(crate) path: PathBuf,
    pub(crate) map: Mmap,
}

/// An opened, validated checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    /// In [`expected_tensors`] order.
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("files", &self.files())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl Checkpoint {
    /// Opens `dir`: reads `config.json`, maps the weight files and checks every tensor's dtype,
    /// byte range and shape against the config. `model.safetensors` is used when present,
    /// else `model.safetensors.index.json` and its shards. Values are not read.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        if !dir.is_dir() {
            return Err(CheckpointError::NotFound {
                path: dir.to_path_buf(),
                what: "checkpoint directory",
            });
        }
        let config_path = dir.join("config.json");
        let config = ModelConfig::from_file(&config_path).map_err(|e| match e {
            ConfigError::Io { source, .. } => CheckpointError::Io {
                path: config_path.clone(),
                source,
            },
            other => CheckpointError::Config {
                path: config_path.clone(),
                source: other,
            },
        })?;

        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let (shards, found, looked_in) = if single.is_file() {
            let shard = map_file(&single)?;
            let entries = parse_header::<Element>(&shard.path, &shard.map)?;
            let found: Vec<TensorInfo> = entries
                .into_iter()
                .map(|e| e.into_info(&shard.path, 0))
                .collect();
            (vec![shard], found, single)
        } else if index.is_file() {
            let (shards, found) = open_sharded(dir, &index)?;
            (shards, found, index)
        } else {
            return Err(CheckpointError::NoWeights {
                dir: dir.to_path_buf(),
                looked_for: format!("{SINGLE_FILE} or {INDEX_FILE}"),
            });
        };

        let tensors =
            validate(&config, found, &looked_in).map_err(|problems| CheckpointError::Mismatch {
                dir: dir.to_path_buf(),
                problems,
            })?;
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
            by_name,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs the model with its sparse layers' K/V cache in `dtype` (a run-time choice).
    pub fn set_kv_cache(&mut self, dtype: crate::KvCacheDtype) {
        self.config.sparse.kv_cache = dtype;
    }

    /// Runs the decoder layers' linears in FP8, quantized as they load (a run-time choice; an
    /// FP8 checkpoint's run in FP8 whatever it says).
    pub fn set_fp8_weights(&mut self, on: bool) {
        self.config.fp8_weights = on || self.config.fp8_checkpoint.is_some();
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The weight files, in the order they were opened.
    pub fn files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Every tensor, in model order (embedding, layers, final norm, `lm_head`).
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = &TensorInfo> + '_ {
        self.tensors.iter()
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// The raw bytes of float tensor `name` as stored.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let info = self.stored(name)?;
        let Element::Float(dtype) = info.dtype else {
            return Err(tensor_err(
                &info.file,
                name,
                format!("holds {} values, not weights", info.dtype),
            ));
        };
        // In range: checked against the file length when the header was parsed.
        Ok(TensorView {
            name: &info.name,
            dtype,
            shape: &info.shape,
            bytes: self.bytes(info),
            file: &info.file,
        })
    }

    fn stored(&self, name: &str) -> Result<&TensorInfo, CheckpointError> {
        self.info(name)
            .ok_or_else(|| CheckpointError::UnknownTensor {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.shards[info.shard].map[info.byte_range.clone()]
    }

    /// Whether weight `name` (its `.weight` name) is stored quantized.
    pub fn is_quantized(&self, name: &str) -> bool {
        !self.contains(name) && self.config.quantization.is_some() && {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            self.contains(&format!("{module}.qweight"))
        }
    }

    /// FP8-stored weight `name` as E4M3 codes `[out, in]` and a scale per output row (a
    /// tensor's one scale repeated); `None` when it is not stored in FP8.
    #[allow(clippy::type_complexity)]
    pub fn fp8_rows(
        &self,
        name: &str,
    ) -> Result<Option<(&[u8], Vec<f32>, (usize, usize))>, CheckpointError> {
        let stored_fp8 = self
            .config
            .fp8_checkpoint
            .as_ref()
            .is_some_and(|f| f.quantizes(name))
            && self.info(name).is_some_and(|t| t.dtype == Element::F8E4M3);
        if !stored_fp8 {
            return Ok(None);
        }
        let codes = self.stored(name)?;
        let (out, inputs) = (codes.shape[0], codes.shape[1]);
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let scale_name = format!("{module}.weight_scale");
        let scales = self.tensor(&scale_name)?.to_f32();
        let scales = match scales.len() {
            1 => vec![scales[0]; out],
            n if n == out => scales,
            n => {
                return Err(tensor_err(
                    &codes.file,
                    &scale_name,
                    format!("{n} scales for {out} output channels"),
                ))
            }
        };
        Ok(Some((self.bytes(codes), scales, (out, inputs))))
    }

    /// Weight `name` as f32 `[out, in]` values: as stored, or dequantized from its GPTQ or FP8
    /// tensors (then its shape is the schema's).
    pub fn weight_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), CheckpointError> {
        if let Some((codes, scales, (out, inputs))) = self.fp8_rows(name)? {
            let values = codes
                .chunks(inputs.max(1))
                .zip(&scales)
                .flat_map(|(row, &s)| row.iter().map(move |&c| crate::fp8::e4m3_value(c) * s))
                .collect();
            return Ok((values, vec![out, inputs]));
        }
        if !self.is_quantized(name) {
            let t = self.tensor(name)?;
            return Ok((t.to_f32(), t.shape.to_vec()));
        }
        self.gptq(name, |q, shape, parts| {
            Ok((
                q.dequantize(name, shape, parts.0, parts.1, &parts.2, parts.3)?,
                vec![shape.0, shape.1],
            ))
        })
    }

    /// Quantized weight `name` by rows ([`crate::quant::Gptq::to_rows`]), with its shape.
    pub fn weight_rows(
        &self,
        name: &str,
    ) -> Result<(crate::quant::Rows, (usize, usize)), CheckpointError> {
        self.gptq(name, |q, shape, parts| {
            Ok((
                q.to_rows(name, shape, parts.0, parts.1, &parts.2, parts.3)?,
                shape,
            ))
        })
    }

    /// `f(gptq, (out, in), (qweight, qzeros, scales, g_idx))` for quantized weight `name`; its
    /// error names the stored tensor.
    fn gptq<T>(
        &self,
        name: &str,
        f: impl FnOnce(
            &crate::quant::Gptq,
            (usize, usize),
            (&[u8], &[u8], Vec<f32>, Option<&[u8]>),
        ) -> Result<T, String>,
    ) -> Result<T, CheckpointError> {
        let q = self.config.quantization.as_ref().ok_or_else(|| {
            file_err(
                &self.dir,
                format!("{name}: the checkpoint is not quantized"),
            )
        })?;
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let part = |suffix: &str| self.stored(&format!("{module}.{suffix}"));
        let (qweight, qzeros) = (part("qweight")?, part("qzeros")?);
        let scales = self.tensor(&format!("{module}.scales"))?.to_f32();
        let g_idx = self.info(&format!("{module}.g_idx"));
        let shape = (qweight.shape[1], qweight.shape[0] * 8);
        let parts = (
            self.bytes(qweight),
            self.bytes(qzeros),
            scales,
            g_idx.map(|t| self.bytes(t)),
        );
        f(q, shape, parts).map_err(|msg| tensor_err(&qweight.file, &qweight.name, msg))
    }

    /// Tensor `name` widened to f32 (exact), a quantized weight dequantized.
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        Ok(self.weight_f32(name)?.0)
    }

    /// Tensor `name` as bf16 bits (f32/f16 rounded to nearest even; a quantized weight
    /// dequantized, then rounded).
    pub fn read_bf16_bits(&self, name: &str) -> Result<Vec<u16>, CheckpointError> {
        if self.is_quantized(name) || self.fp8_rows(name)?.is_some() {
            return Ok(self
                .read_f32(name)?
                .into_iter()
                .map(f32_to_bf16_bits)
                .collect());
        }
        Ok(self.tensor(name)?.to_bf16_bits())
    }

    /// Errors if tensor `name` holds a NaN or an infinity (weights are not scanned on open).
    pub fn check_finite(&self, name: &str) -> Result<(), CheckpointError> {
        let (values, _) = self.weight_f32(name)?;
        let mut bad = values.iter().enumerate().filter(|(_, v)| !v.is_finite());
        if let Some((index, &value)) = bad.next() {
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let file = self
                .info(name)
                .or_else(|| self.info(&format!("{module}.scales")))
                .map_or_else(|| self.dir.clone(), |t| t.file.clone());
            return Err(CheckpointError::NonFinite {
                file,
                tensor: name.to_string(),
                count: 1 + bad.count(),
                index,
                value,
            });
        }
        Ok(())
    }

    /// Bytes of tensor data over all files.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.byte_len() as u64).sum()
    }

    /// Number of weight values over all tensors.
    pub fn parameter_count(&self) -> u64 {
        self.tensors.iter().map(|t| t.numel() as u64).sum()
    }
}

/// Reads `model.safetensors.index.json`, maps every shard it names and checks that the index
/// and the shard headers agree tensor by tensor.
fn open_sharded(
    dir: &Path,
    index: &Path,
) -> Result<(Vec<Shard>, Vec<TensorInfo>), CheckpointError> {
    let text = std::fs::read(index).map_err(|source| CheckpointError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| file_err(index, format!("not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| file_err(index, "has no `weight_map` object"))?;

    // Shard names sorted (model-00001-of-… first); tensor name -> shard name.
    let mut wanted_names: BTreeMap<String, String> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            file_err(
                index,
                format!("weight_map entry for `{tensor}` is not a file name: {file}"),
            )
        })?;
        if !safe_relative(file) {
            return Err(file_err(
                index,
                format!("weight_map entry for `{tensor}` names {file:?}, not a file inside the checkpoint directory"),
            ));
        }
        wanted_names.insert(tensor.clone(), file.to_string());
    }
    let mut shard_names: Vec<String> = wanted_names.values().cloned().collect();
    shard_names.sort();
    shard_names.dedup();
    let wanted: BTreeMap<String, usize> = wanted_names
        .into_iter()
        .map(|(t, f)| {
            let pos = shard_names.binary_search(&f).expect("listed shard");
            (t, pos)
        })
        .collect();
    if shard_names.is_empty() {
        return Err(file_err(index, "weight_map is empty"));
    }

    let mut shards = Vec::with_capacity(shard_names.len());
    for (pos, name) in shard_names.iter().enumerate() {
        let path = dir.join(name);
        if !path.is_file() {
            let tensor = wanted
                .iter()
                .find(|(_, &p)| p == pos)
                .map(|(t, _)| t.as_str())
                .unwrap_or("?");
            return Err(file_err(
                index,
                format!(
                    "lists shard {name} (for tensor `{tensor}` and others) but {} does not exist",
                    path.display()
                ),
            ));
        }
        shards.push(map_file(&path)?);
    }

    let mut found = Vec::with_capacity(wanted.len());
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (pos, shard) in shards.iter().enumerate() {
        for entry in parse_header::<Element>(&shard.path, &shard.map)? {
            match wanted.get(&entry.name) {
                Some(&p) if p == pos => {}
                Some(&p) => {
                    return Err(tensor_err(
                        &shard.path,
                        &entry.name,
                        format!(
                            "is in this shard but {} maps it to {}",
                            index.display(),
                            shard_names[p]
                        ),
                    ))
                }
                None if is_ignored_extra(&entry.name) => continue,
                None => {
                    return Err(tensor_err(
                        &shard.path,
                        &entry.name,
                        format!("is in this shard but not listed in {}", index.display()),
                    ))
                }
            }
            seen.insert(entry.name.clone(), pos);
            found.push(entry.into_info(&shard.path, pos));
        }
    }
    for (tensor, &pos) in &wanted {
        if !seen.contains_key(tensor) {
            return Err(tensor_err(
                &shards[pos].path,
                tensor,
                format!(
                    "is listed in {} for this shard but the shard does not hold it",
                    index.display()
                ),
            ));
        }
    }
    Ok((shards, found))
}

/// What a checkpoint for `config` stores: (name, shape, kind, required) for every tensor of
/// [`expected_tensors`], its GPTQ tensors in place of a quantized linear's weight.
fn stored_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>, Stored, bool)> {
    let mut out = Vec::new();
    for spec in expected_tensors(config) {
        let linear = matches!(spec.place, crate::Place::Layer(..)) && spec.shape.len() == 2;
        if let Some(f) = config
            .fp8_checkpoint
            .as_ref()
            .filter(|f| linear && f.quantizes(&spec.name))
        {
            let (o, i) = (spec.shape[0], spec.shape[1]);
            for (name, shape, codes, required) in f.stored(&spec.name, o, i) {
                let kind = if codes { Stored::Fp8 } else { Stored::Scale };
                out.push((name, shape, kind, required));
            }
            continue;
        }
        match &config.quantization {
            Some(q) if linear && q.quantizes(&spec.name) => {
                let (o, i) = (spec.shape[0], spec.shape[1]);
                for (k, (name, shape, int)) in q.stored(&spec.name, o, i).into_iter().enumerate() {
                    let kind = if int { Stored::Int } else { Stored::Float };
                    out.push((name, shape, kind, k < 3));
                }
            }
            _ => out.push((spec.name, spec.shape, Stored::Float, true)),
        }
    }
    out
}

/// The kind of values a stored tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stored {
    Float,
    Int,
    /// FP8 E4M3 codes.
    Fp8,
    /// Float scales: any shape of the expected count (`[out, 1]` or `[out]`, `[1]` or `[]`).
    Scale,
}

/// A shape without its 1s: scales of the same values in any of their usual shapes compare equal.
fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&d| d != 1).collect()
}

/// Orders the found tensors like [`stored_tensors`], or lists every missing, unexpected,
/// misshapen and mistyped tensor.
fn validate(
    config: &ModelConfig,
    found: Vec<TensorInfo>,
    looked_in: &Path,
) -> Result<Vec<TensorInfo>, Vec<Problem>> {
    let mut by_name: HashMap<String, TensorInfo> =
        found.into_iter().map(|t| (t.name.clone(), t)).collect();
    let mut problems = Vec::new();
    let mut ordered = Vec::with_capacity(by_name.len());
    for (name, shape, kind, required) in stored_tensors(config) {
        match by_name.remove(&name) {
            None if !required => {}
            None => problems.push(Problem::Missing {
                tensor: name,
                shape,
                looked_in: looked_in.to_path_buf(),
            }),
            Some(t)
                if t.shape != shape
                    && !(kind == Stored::Scale && squeezed(&t.shape) == squeezed(&shape)) =>
            {
                problems.push(Problem::Shape {
                    tensor: name,
                    file: t.file,
                    expected: shape,
                    found: t.shape,
                })
            }
            Some(t) => {
                let fits = match kind {
                    Stored::Float | Stored::Scale => matches!(t.dtype, Element::Float(_)),
                    Stored::Int => t.dtype == Element::I32,
                    Stored::Fp8 => t.dtype == Element::F8E4M3,
                };
                if fits {
                    ordered.push(t);
                } else {
                    problems.push(Problem::DType {
                        tensor: name,
                        file: t.file,
                        expected: match kind {
                            Stored::Float | Stored::Scale => "BF16, F16 or F32",
                            Stored::Int => "I32",
                            Stored::Fp8 => "F8_E4M3",
                        },
                        found: t.dtype.to_string(),
                    });
                }
            }
        }
    }
    let mut extras: Vec<TensorInfo> = by_name
        .into_values()
        .filter(|t| !is_ignored_extra(&t.name))
        .collect();
    extras.sort_by(|a, b| a.name.cmp(&b.name));
    problems.extend(extras.into_iter().map(|t| Problem::Unexpected {
        tensor: t.name,
        shape: t.shape,
        file: t.file,
    }));
    if problems.is_empty() {
        Ok(ordered)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests;
