//! MiniCPM-SALA checkpoints on disk: `config.json`, safetensors weights (single file or
//! sharded), and writing small checkpoints with seeded random weights.

pub mod config;

pub use config::{alibi_slopes, ConfigError, MixerKind, ModelConfig, SparseConfig};
