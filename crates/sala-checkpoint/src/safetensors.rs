//! The safetensors file format: mapping a file, and reading and checking its header (names,
//! dtypes, shapes and byte ranges of its tensors).

use crate::weights::{file_err, tensor_err, CheckpointError, DType, Shard, TensorInfo};
use memmap2::Mmap;
use std::fs::File;
use std::ops::Range;
use std::path::{Component, Path};

pub(crate) fn map_file(path: &Path) -> Result<Shard, CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 8 {
        return Err(file_err(
            path,
            format!("{len} bytes is too short for a safetensors file (8-byte header length first)"),
        ));
    }
    // SAFETY: the map is read-only; like every memory-mapped loader we rely on nobody
    // truncating or rewriting the file while it is open.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    Ok(Shard {
        path: path.to_path_buf(),
        map,
    })
}

/// A tensor entry of a safetensors header with its element type as `T` says it.
pub(crate) struct Stored<T> {
    pub name: String,
    pub dtype: T,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
}

/// Element types a file may hold beside the float weights: integer and boolean tensors (an
/// EAGLE-3 draft's vocabulary maps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    Float(DType),
    I32,
    I64,
    Bool,
    /// FP8 E4M3 codes (an FP8 checkpoint's weights).
    F8E4M3,
}

impl Element {
    pub fn from_safetensors_name(name: &str) -> Option<Self> {
        match name {
            "I32" => Some(Self::I32),
            "I64" => Some(Self::I64),
            "BOOL" => Some(Self::Bool),
            "F8_E4M3" => Some(Self::F8E4M3),
            _ => DType::from_safetensors_name(name).map(Self::Float),
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::Float(d) => d.size(),
            Self::I32 => 4,
            Self::I64 => 8,
            Self::Bool | Self::F8E4M3 => 1,
        }
    }
}

impl std::fmt::Display for Element {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Float(d) => write!(f, "{d}"),
            Self::I32 => f.write_str("I32"),
            Self::I64 => f.write_str("I64"),
            Self::Bool => f.write_str("BOOL"),
            Self::F8E4M3 => f.write_str("F8_E4M3"),
        }
    }
}

/// An element type a header entry may have: its value and size in bytes.
pub(crate) trait HeaderType: Copy + std::fmt::Display {
    fn parse(name: &str) -> Option<Self>;
    fn bytes(self) -> usize;
    /// The types accepted, for the error naming one that is not.
    const ACCEPTED: &'static str;
}

impl HeaderType for DType {
    fn parse(name: &str) -> Option<Self> {
        DType::from_safetensors_name(name)
    }
    fn bytes(self) -> usize {
        self.size()
    }
    const ACCEPTED: &'static str = "BF16, F16 or F32";
}

impl HeaderType for Element {
    fn parse(name: &str) -> Option<Self> {
        Element::from_safetensors_name(name)
    }
    fn bytes(self) -> usize {
        self.size()
    }
    const ACCEPTED: &'static str = "BF16, F16, F32, F8_E4M3, I32, I64 or BOOL";
}

impl Stored<Element> {
    pub fn into_info(self, file: &Path, shard: usize) -> TensorInfo {
        TensorInfo {
            name: self.name,
            dtype: self.dtype,
            shape: self.shape,
            file: file.to_path_buf(),
            byte_range: self.range,
            shard,
        }
    }
}

/// Parses and checks a safetensors header: every tensor of an accepted dtype, its byte range
/// inside the file, its length equal to dtype size × shape, no two ranges overlapping.
pub(crate) fn parse_header<T: HeaderType>(
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<Stored<T>>, CheckpointError> {
    let file_len = bytes.len();
    if file_len < 8 {
        return Err(file_err(
            path,
            format!("{file_len} bytes is too short for a safetensors file"),
        ));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&bytes[..8]);
    let header_len = u64::from_le_bytes(len8);
    let data_start = usize::try_from(header_len)
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&end| end <= file_len)
        .ok_or_else(|| {
            file_err(
                path,
                format!(
                    "header length {header_len} runs past the end of the file ({file_len} bytes): truncated or not a safetensors file"
                ),
            )
        })?;
    let data_len = file_len - data_start;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..data_start])
        .map_err(|e| file_err(path, format!("header is not valid JSON: {e}")))?;
    let obj = header
        .as_object()
        .ok_or_else(|| file_err(path, "header is not a JSON object"))?;

    let mut entries = Vec::with_capacity(obj.len());
    for (name, v) in obj {
        if name == "__metadata__" {
            continue;
        }
        let t = v
            .as_object()
            .ok_or_else(|| tensor_err(path, name, format!("header entry is not an object: {v}")))?;
        let dtype_str = t
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| tensor_err(path, name, "header entry has no string `dtype`"))?;
        let dtype = T::parse(dtype_str).ok_or_else(|| {
            tensor_err(
                path,
                name,
                format!(
                    "dtype {dtype_str} is not supported (expected {})",
                    T::ACCEPTED
                ),
            )
        })?;
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| {
                tensor_err(
                    path,
                    name,
                    "header entry has no `shape` list of non-negative integers",
                )
            })?;
        let offsets = t
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| {
                let b = usize::try_from(a[0].as_u64()?).ok()?;
                let e = usize::try_from(a[1].as_u64()?).ok()?;
                Some((b, e))
            })
            .ok_or_else(|| {
                tensor_err(
                    path,
                    name,
                    "header entry has no `data_offsets` [begin, end] pair",
                )
            })?;
        let (begin, end) = offsets;
        if begin > end {
            return Err(tensor_err(
                path,
                name,
                format!("data_offsets [{begin}, {end}] end before they begin"),
            ));
        }
        if end > data_len {
            return Err(tensor_err(
                path,
                name,
                format!(
                    "data_offsets [{begin}, {end}] reach past the end of the data ({data_len} bytes after the header): file truncated or corrupt"
                ),
            ));
        }
        let want = shape
            .iter()
            .try_fold(dtype.bytes(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| tensor_err(path, name, format!("shape {shape:?} overflows")))?;
        if end - begin != want {
            return Err(tensor_err(
                path,
                name,
                format!(
                    "holds {} bytes but dtype {dtype} x shape {shape:?} needs {want}",
                    end - begin
                ),
            ));
        }
        entries.push(Stored {
            name: name.clone(),
            dtype,
            shape,
            range: data_start + begin..data_start + end,
        });
    }

    let mut by_start: Vec<&Stored<T>> = entries.iter().filter(|e| !e.range.is_empty()).collect();
    by_start.sort_by_key(|e| e.range.start);
    for w in by_start.windows(2) {
        if w[1].range.start < w[0].range.end {
            return Err(tensor_err(
                path,
                &w[1].name,
                format!("bytes overlap those of tensor `{}`", w[0].name),
            ));
        }
    }
    Ok(entries)
}

/// A shard name of the index must be a plain relative path inside the checkpoint directory.
pub(crate) fn safe_relative(name: &str) -> bool {
    let p = Path::new(name);
    !name.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)))
}
