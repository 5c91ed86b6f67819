//! The MiniCPM-SALA forward pass, written once over the [`Backend`] trait, and the oracle:
//! plain implementations of both attention algorithms that every fast path is held to.

pub mod backend;
pub mod context;
pub mod draft;
mod layer;
pub mod load;
pub mod memory;
pub mod model;
pub mod numerics;
pub mod oracle;
pub mod parallel;
pub mod ranks;
pub mod sequence;
mod step;
pub mod testing;

pub use backend::{
    quantize_fp8, AttnIo, BResult, Backend, BackendError, Fp8Matrix, HostDType, HostTensor,
    LogitsOut, QuantMatrix, Span, StepInfo, StepLaunches, STEPWISE_SPAN_ROWS,
};
pub use load::WeightSource;
pub use model::{
    AuxCapture, GreedyPick, InputRecorder, LinearInput, LogitRows, Model, SeqMark, SeqState,
    StepInput, StepLogits, Workspace,
};
pub use oracle::{AttnShape, SparseMode};
