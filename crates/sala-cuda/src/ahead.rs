//! Steps run ahead ([`sala_model::Backend::runs_ahead`]): a step's greedy picks are copied to
//! page-locked memory as it ends and read by [`sala_model::Backend::take_picks`] once the next
//! step, its tokens those picks, is queued.

use crate::memory::be_err;
use crate::CudaBackend;
use cudarc::driver::{sys, CudaEvent, CudaSlice, PinnedHostSlice};
use sala_model::{BResult, BackendError, GreedyPick};
use std::cell::RefCell;
use std::collections::VecDeque;

/// A page-locked buffer for a step's picks and the event recorded once they are copied (the
/// context tracks no events, so the buffer's own is never recorded).
type PicksCopy = (PinnedHostSlice<u32>, CudaEvent);

/// Picks left for later, oldest first, each copy with its rows; and spare copies.
#[derive(Default)]
pub(crate) struct PicksAhead {
    later: RefCell<VecDeque<(PicksCopy, usize)>>,
    spare: RefCell<Vec<PicksCopy>>,
}

impl PicksAhead {
    /// Drops the picks no one took (their buffers kept for reuse).
    pub(crate) fn forget(&self) {
        let stale: Vec<_> = self.later.borrow_mut().drain(..).collect();
        self.spare
            .borrow_mut()
            .extend(stale.into_iter().map(|(copy, _)| copy));
    }
}

impl CudaBackend {
    /// Queues the copy of a step's `n` picks (`picks`: n ids, then n logprobs' bits) to the
    /// host, to be read by [`CudaBackend::take_queued_picks`].
    pub(crate) fn queue_picks(&self, picks: &CudaSlice<u32>, n: usize) -> BResult<()> {
        let q = &self.picks_ahead;
        // The copy fills its whole target: a buffer of exactly 2n words.
        let spare = q.spare.borrow_mut().pop();
        let (mut buf, done) = match spare.filter(|(b, _)| b.len() == 2 * n) {
            Some(b) => b,
            None => (
                // SAFETY: the copy below writes all 2n words before any is read.
                unsafe { self.ctx.alloc_pinned_with_flags::<u32>(2 * n, 0) }
                    .map_err(|e| be_err("page-locked picks", e))?,
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .map_err(|e| be_err("an event", e))?,
            ),
        };
        self.stream
            .memcpy_dtoh(&picks.slice(..2 * n), &mut buf)
            .map_err(|e| be_err("download", e))?;
        done.record(&self.stream)
            .map_err(|e| be_err("an event", e))?;
        q.later.borrow_mut().push_back(((buf, done), n));
        Ok(())
    }

    /// The oldest queued picks, once copied (the wait counted in the host's).
    pub(crate) fn take_queued_picks(&self) -> BResult<Vec<GreedyPick>> {
        let q = &self.picks_ahead;
        let Some(((buf, done), n)) = q.later.borrow_mut().pop_front() else {
            return Err(BackendError("no step left its picks for later".into()));
        };
        let start = std::time::Instant::now();
        let copied = done.synchronize().map_err(|e| be_err("picks", e));
        self.waited.set(self.waited.get() + start.elapsed());
        copied?;
        let picks = picks_of(buf.as_slice().map_err(|e| be_err("picks", e))?, n);
        q.spare.borrow_mut().push((buf, done));
        Ok(picks)
    }
}

/// Greedy picks from their download: `n` ids (-1: none), then `n` logprobs' bits.
pub(crate) fn picks_of(raw: &[u32], n: usize) -> Vec<GreedyPick> {
    (0..n)
        .map(|r| GreedyPick {
            id: u32::try_from(raw[r] as i32).ok(),
            logprob: f32::from_bits(raw[n + r]),
        })
        .collect()
}
