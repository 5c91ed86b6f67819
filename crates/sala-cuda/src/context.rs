//! Context parallelism between CUDA backends (`sala_model::context`): ranks on distinct GPUs
//! exchange activations and lightning states through NCCL (a send and a receive on the two
//! ranks' streams); ranks sharing one GPU (a test of the ranks' work on one card) copy within
//! it, ordered with both ranks' streams.

use crate::memory::{DevAct, DevLightningState};
use crate::nccl::{Elem, Group};
use crate::CudaBackend;
use sala_model::context::Exchange;
use sala_model::{BResult, BackendError};
use std::ffi::c_void;

fn copy_err(e: impl std::fmt::Debug) -> BackendError {
    BackendError(format!("context parallelism: a copy between ranks: {e:?}"))
}

/// Checks a copy of `rows` rows between two activations.
fn check_rows(src: &DevAct, dst: &DevAct, rows: usize) -> BResult<()> {
    if src.cols != dst.cols || rows > src.rows || rows > dst.rows {
        return Err(BackendError(format!(
            "context parallelism: a copy of {rows} rows from [{}, {}] to [{}, {}]",
            src.rows, src.cols, dst.rows, dst.cols
        )));
    }
    Ok(())
}

fn check_states(src: &DevLightningState, dst: &DevLightningState) -> BResult<()> {
    if src.len() != dst.len() {
        return Err(BackendError(
            "context parallelism: lightning states of two shapes".into(),
        ));
    }
    Ok(())
}

/// The exchanges of ranks on distinct GPUs, through one NCCL communicator a GPU.
pub struct NcclExchange {
    group: Group,
    ordinals: Vec<usize>,
}

impl NcclExchange {
    /// Communicators for ranks on GPUs `ordinals` (each once).
    pub fn new(ordinals: &[usize]) -> Result<Self, String> {
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            return Err(format!(
                "ranks on GPUs {ordinals:?}: NCCL takes each GPU once"
            ));
        }
        let ids: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        Ok(Self {
            group: Group::all(&ids)?,
            ordinals: ordinals.to_vec(),
        })
    }

    fn rank_of(&self, be: &CudaBackend) -> BResult<usize> {
        let ordinal = be.ctx.ordinal();
        self.ordinals
            .iter()
            .position(|&o| o == ordinal)
            .ok_or_else(|| BackendError(format!("GPU {ordinal} is not one of the ranks' GPUs")))
    }

    fn send(
        &self,
        elem: Elem,
        (from, src): (&CudaBackend, u64),
        (to, dst): (&CudaBackend, u64),
        count: usize,
    ) -> BResult<()> {
        let stream = |be: &CudaBackend| be.stream.cu_stream() as *mut c_void;
        self.group
            .send_recv(
                elem,
                (self.rank_of(from)?, src, stream(from)),
                (self.rank_of(to)?, dst, stream(to)),
                count,
            )
            .map_err(BackendError)
    }
}

impl Exchange<CudaBackend> for NcclExchange {
    fn copy_act(
        &self,
        from: &CudaBackend,
        src: &DevAct,
        to: &CudaBackend,
        dst: &mut DevAct,
        rows: usize,
    ) -> BResult<()> {
        check_rows(src, dst, rows)?;
        let (s, d) = (from.act_ptr(src), to.act_ptr(dst));
        self.send(Elem::Bf16, (from, s), (to, d), rows * src.cols)
    }

    fn copy_state(
        &self,
        from: &CudaBackend,
        src: &DevLightningState,
        to: &CudaBackend,
        dst: &mut DevLightningState,
    ) -> BResult<()> {
        check_states(src, dst)?;
        let (s, d) = (from.ptr(src), to.ptr(&*dst));
        self.send(Elem::F32, (from, s), (to, d), src.len())
    }
}

/// The exchanges of ranks sharing one GPU: copies within it, each queued on the receiving
/// rank's stream after the sending rank's work so far, the sending rank's later work after
/// the copy.
pub struct OneDevice;

/// `bytes` from `src` to `dst`, both on the device of `from` and `to`.
fn copy_within(
    from: &CudaBackend,
    src: u64,
    to: &CudaBackend,
    dst: u64,
    bytes: usize,
) -> BResult<()> {
    if from.ctx.ordinal() != to.ctx.ordinal() {
        return Err(BackendError(format!(
            "ranks on GPUs {} and {} exchange through NCCL, not a copy within one GPU",
            from.ctx.ordinal(),
            to.ctx.ordinal()
        )));
    }
    if bytes == 0 {
        return Ok(());
    }
    to.stream.join(&from.stream).map_err(copy_err)?;
    to.ctx.bind_to_thread().map_err(copy_err)?;
    // SAFETY: both ranges lie in live allocations on this device (checked by the callers'
    // shapes), ordered after the writes of `src` and before its next ones.
    unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, to.stream.cu_stream()) }
        .map_err(copy_err)?;
    from.stream.join(&to.stream).map_err(copy_err)
}

impl Exchange<CudaBackend> for OneDevice {
    fn copy_act(
        &self,
        from: &CudaBackend,
        src: &DevAct,
        to: &CudaBackend,
        dst: &mut DevAct,
        rows: usize,
    ) -> BResult<()> {
        check_rows(src, dst, rows)?;
        let bytes = rows * src.cols * 2;
        copy_within(from, from.act_ptr(src), to, to.act_ptr(dst), bytes)
    }

    fn copy_state(
        &self,
        from: &CudaBackend,
        src: &DevLightningState,
        to: &CudaBackend,
        dst: &mut DevLightningState,
    ) -> BResult<()> {
        check_states(src, dst)?;
        copy_within(from, from.ptr(src), to, to.ptr(&*dst), src.len() * 4)
    }

    fn one_memory(&self) -> bool {
        true
    }
}
