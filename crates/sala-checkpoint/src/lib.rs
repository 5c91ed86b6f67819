//! MiniCPM-SALA checkpoints on disk: `config.json`, safetensors weights (single file or
//! sharded), and writing small checkpoints with seeded random weights.

pub mod config;
pub mod eagle;
pub mod fp8;
pub mod presets;
pub mod quant;
pub mod rng;
mod safetensors;
pub mod schema;
pub mod weights;
pub mod writer;

pub use config::{alibi_slopes, ConfigError, KvCacheDtype, MixerKind, ModelConfig, SparseConfig};
pub use eagle::{write_random_draft, DraftCheckpoint, DraftConfig};
pub use presets::{preset, preset_names, PresetError};
pub use safetensors::Element;
pub use schema::{
    expected_parameter_count, expected_tensors, tensor_name, Place, Role, TensorSpec,
};
pub use weights::{
    bf16_bits_to_f32, f32_to_bf16_bits, Checkpoint, CheckpointError, DType, Problem, TensorInfo,
    TensorView, INDEX_FILE, SINGLE_FILE,
};
pub use writer::{
    init_scale, random_tensor_values, write_checkpoint_with, write_config_only,
    write_random_checkpoint, write_raw_safetensors, write_safetensors_file, RawTensor,
    WriteOptions,
};
