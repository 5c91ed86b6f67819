//! CUDA backend: bf16 storage, fp32 accumulation, for every NVIDIA GPU from Ampere (8.0) on.
//!
//! - [`device`]: what the GPU allows ([`DeviceLimits`], from the driver or a card's profile).
//! - [`options`]: which kernel variants run and how ([`CudaOptions`]).
//! - [`plan`]: every launch's grid, block, shared memory and variant, from those two.
//! - [`kernels`]: the kernel table and a typed launcher per kernel; [`sources`] and
//!   [`registry`] compile the `kernels/` files with NVRTC (cached on disk) and load them.
//! - [`memory`]: activations, weights, per-sequence caches ([`pool`]: the page pool), scratch.
//! - `ops`: the op families (elementwise, GEMV, lightning, block selection, attention), and
//!   the `Backend` impl over them as thin delegation.
//!
//! Projections and MLPs go through cuBLASLt ([`gemm`]). The CUDA libraries are opened at run
//! time ([`libs`]), so the same binary runs without them.

mod ahead;
mod backend;
pub mod check;
pub mod context;
pub mod device;
pub mod gemm;
mod graphs;
pub mod kernels;
pub mod libs;
pub mod memory;
pub mod nccl;
mod ops;
pub mod options;
pub mod plan;
pub mod pool;
pub mod profile;
pub mod registry;
pub mod sources;
pub mod tensor_parallel;
pub mod w4_records;

pub use backend::CudaBackend;
pub use device::{Card, DeviceLimits, CARDS};
pub use memory::{DevAct, DevLightningState, DevMatrix, DevMem, DevSparseCache, Store};
pub use options::CudaOptions;
