//! The MiniCPM-SALA forward pass, written once over the [`Backend`] trait, and the oracle:
//! plain implementations of both attention algorithms that every fast path is held to.

pub mod backend;
pub mod memory;
pub mod model;
pub mod numerics;
pub mod oracle;

pub use backend::{BResult, Backend, BackendError, HostDType, HostTensor};
pub use model::{tensor_count, LogitRows, Model, SeqState, WeightSource, Workspace};
pub use oracle::{AttnShape, SparseMode};
