//! The LM head at the end of a step: the rows asked for, scaled and multiplied by the head,
//! every row's greedy pick made on the device, and the rows the host keeps downloaded (or the
//! picks left for later when the step runs ahead).

use crate::backend::CudaBackend;
use crate::memory::{be_err, grow, DevAct, DevAddr, DevMatrix};
use crate::plan::{Launch, GREEDY_SLICES};
use sala_model::{BResult, BackendError, LogitsOut};

impl CudaBackend {
    /// [`sala_model::Backend::logits`]: rows `rows` of `h` divided by `divisor` times the head
    /// `lm_head`; the logits of the rows `keep` marks, and every row's greedy pick.
    pub(crate) fn head_logits(
        &self,
        h: &DevAct,
        rows: &[usize],
        keep: &[bool],
        lm_head: &DevMatrix,
        divisor: f32,
    ) -> BResult<LogitsOut> {
        let (n, cols, vocab) = (rows.len(), h.cols, lm_head.rows);
        if let Some(&bad) = rows.iter().find(|&&r| r >= h.rows) {
            return Err(BackendError(format!(
                "logits of row {bad} of {} rows",
                h.rows
            )));
        }
        if keep.len() != n || n == 0 {
            return Err(BackendError(format!(
                "logits: {} keep flags for {n} rows",
                keep.len()
            )));
        }
        let (x, y, picks) = {
            let mut s = self.scratch.borrow_mut();
            grow(&self.stream, &mut s.logits_in, n * cols)?;
            grow(&self.stream, &mut s.logits_out, n * vocab)?;
            // n ids, n logprobs, then greedy_parts' slices (3 words each).
            grow(&self.stream, &mut s.picks, (2 + 3 * GREEDY_SLICES) * n)?;
            (
                self.ptr(s.logits_in.as_ref().expect("grown")),
                self.ptr(s.logits_out.as_ref().expect("grown")),
                self.ptr(s.picks.as_ref().expect("grown")),
            )
        };
        // Each run of adjacent rows scaled in one launch, packed in order.
        let mut i = 0;
        while i < n {
            let mut j = i + 1;
            while j < n && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            self.scale_round(
                self.row_ptr(h, rows[i]),
                x + (i * cols * 2) as u64,
                divisor,
                (j - i) * cols,
            )?;
            i = j;
        }
        // The product may take scratch of its own (a split GEMV's chain sums): no borrow held.
        self.product(&DevAddr(x), 0, lm_head, y, n)?;
        let s = self.scratch.borrow();
        let (ys, ps) = (
            s.logits_out.as_ref().expect("grown"),
            s.picks.as_ref().expect("grown"),
        );
        // Every row's pick, whichever rows the host keeps: a step's launches depend on its
        // rows only (a CUDA graph replays them).
        let parts = picks + (4 * 2 * n) as u64;
        self.k.greedy_parts(
            Launch::new((n, GREEDY_SLICES, 1), 256, 0),
            y,
            vocab as i32,
            parts,
        )?;
        self.k.greedy_rows(
            Launch::new((n, 1, 1), 32, 0),
            parts,
            picks,
            picks + 4 * n as u64,
        )?;
        self.picked_rows.set(n);
        self.graph_pause()?;
        if self.picks_later.get() {
            // Copied to the host as the step ends; read by `take_picks`.
            if keep.iter().any(|&k| k) {
                return Err(BackendError(
                    "a step that leaves its picks for later keeps no logits".into(),
                ));
            }
            self.queue_picks(ps, n)?;
            return Ok(LogitsOut::default());
        }
        let start = std::time::Instant::now();
        self.synchronize()?;
        self.waited.set(self.waited.get() + start.elapsed());
        let mut raw = vec![0u32; 2 * n];
        self.stream
            .memcpy_dtoh(&ps.slice(..2 * n), &mut raw)
            .map_err(|e| be_err("download", e))?;
        let picks = crate::ahead::picks_of(&raw, n);
        // The kept rows, a run of adjacent ones per copy.
        let kept = keep.iter().filter(|&&k| k).count();
        let mut out = Vec::with_capacity(kept * vocab);
        let mut i = 0;
        while i < n {
            if !keep[i] {
                i += 1;
                continue;
            }
            let mut j = i + 1;
            while j < n && keep[j] {
                j += 1;
            }
            out.extend(self.download_bf16(ys, i * vocab, (j - i) * vocab)?);
            i = j;
        }
        Ok(LogitsOut { rows: out, picks })
    }
}
