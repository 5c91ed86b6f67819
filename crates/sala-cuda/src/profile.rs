//! Per-kernel device time, for finding where a forward pass spends it (`CudaOptions::profile_kernels`, `SALA_PROFILE=1`).
//! Each timed launch is bracketed by two CUDA events; [`Profiler::report`] waits for them and
//! sums the elapsed times by name. Off by default: the events cost a little per launch.

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

pub struct Profiler {
    ctx: Arc<CudaContext>,
    pending: RefCell<Vec<(String, CudaEvent, CudaEvent)>>,
}

impl Profiler {
    pub fn new(ctx: &Arc<CudaContext>) -> Self {
        Self {
            ctx: ctx.clone(),
            pending: RefCell::new(Vec::new()),
        }
    }

    /// Records a start event; pass it to [`Profiler::end`] after the work is queued.
    pub fn start(&self, stream: &CudaStream) -> Option<CudaEvent> {
        let ev = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()?;
        ev.record(stream).ok()?;
        Some(ev)
    }

    pub fn end(&self, name: impl Into<String>, start: Option<CudaEvent>, stream: &CudaStream) {
        let Some(start) = start else { return };
        if let Some(end) = self.start(stream) {
            self.pending.borrow_mut().push((name.into(), start, end));
        }
    }

    /// Device milliseconds and launch counts by name since the last report, largest first.
    pub fn report(&self) -> Vec<(String, f64, usize)> {
        let mut sums: HashMap<String, (f64, usize)> = HashMap::new();
        for (name, a, b) in self.pending.borrow_mut().drain(..) {
            let ms = a.elapsed_ms(&b).unwrap_or(0.0) as f64;
            let e = sums.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        let mut out: Vec<_> = sums.into_iter().map(|(k, (ms, n))| (k, ms, n)).collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }
}
