//! Tensor parallelism over the GPUs of this process: the sums `sala_model::ranks::Ranks`
//! needs, through one NCCL communicator a GPU. One host thread drives every rank (each op
//! queued on each GPU's stream in turn, the all-reduces as one grouped call), so the ranks
//! need no threads or ids exchanged between processes. Decode steps are CUDA graphs on every
//! rank, the sums captured inside them; `Ranks` holds every rank's graphs before any rank's
//! eager or host-blocking work.

use crate::graphs::Mode;
use crate::memory::DevAct;
use crate::nccl::{Elem, Group};
use crate::CudaBackend;
use cudarc::driver::CudaSlice;
use sala_model::ranks::Collective;
use sala_model::{BResult, BackendError};
use std::ffi::c_void;

/// The NCCL sums of ranks on GPUs `ordinals` (rank i on `ordinals[i]`).
pub struct NcclSum {
    group: Group,
}

impl NcclSum {
    pub fn new(ordinals: &[usize]) -> Result<Self, String> {
        let ordinals: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        Ok(Self {
            group: Group::all(&ordinals)?,
        })
    }

    /// Each rank's buffer at `ptr(rank)` summed in place, `count` values of `elem`, queued on
    /// each rank's stream: captured where the ranks capture a graph stretch, nothing where
    /// they replay one (the sums are in its graphs). Ranks in different graph states are an
    /// error, not a hang: each rank's collectives must match the others' one for one.
    fn sum(
        &self,
        ranks: &[CudaBackend],
        elem: Elem,
        count: usize,
        ptr: impl Fn(usize) -> u64,
    ) -> BResult<()> {
        let state = ranks.first().map(CudaBackend::graph_state);
        if ranks.iter().any(|be| Some(be.graph_state()) != state) {
            return Err(BackendError(
                "tensor parallelism: the ranks are in different CUDA graph states at a sum".into(),
            ));
        }
        if state == Some((Mode::Replay, true)) {
            return Ok(());
        }
        let bufs: Vec<(u64, *mut c_void)> = ranks
            .iter()
            .enumerate()
            .map(|(r, be)| (ptr(r), be.stream.cu_stream() as *mut c_void))
            .collect();
        self.group
            .all_reduce_sum(elem, &bufs, count)
            .map_err(BackendError)
    }
}

impl Collective<CudaBackend> for NcclSum {
    fn sum_acts(&self, ranks: &[CudaBackend], parts: &mut [&mut DevAct]) -> BResult<()> {
        let (rows, cols) = parts.first().map_or((0, 0), |a| (a.rows, a.cols));
        if parts.iter().any(|a| (a.rows, a.cols) != (rows, cols)) {
            return Err(BackendError(
                "tensor parallelism: the ranks' partial sums differ in shape".into(),
            ));
        }
        self.sum(ranks, Elem::Bf16, rows * cols, |r| {
            ranks[r].act_ptr(parts[r])
        })
    }

    fn sum_tables(
        &self,
        ranks: &[CudaBackend],
        parts: &mut [&mut CudaSlice<f32>],
        len: usize,
    ) -> BResult<()> {
        if parts.iter().any(|t| t.len() < len) {
            return Err(BackendError(format!(
                "tensor parallelism: a sum of {len} entries over shorter tables"
            )));
        }
        self.sum(ranks, Elem::F32, len, |r| ranks[r].ptr(&*parts[r]))
    }
}
