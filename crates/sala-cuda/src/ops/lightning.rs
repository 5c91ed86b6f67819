//! Lightning layers (SPEC §4.2): the decode step, batched decode rows, and the prefill kernels
//! the plan picks (`kernels/lightning/`).

use crate::kernels::DecodeRows;
use crate::memory::{DevAct, DevLightningState};
use crate::ops::elementwise::RopeAt;
use crate::plan::{LightningPlan, DECODE_ROWS, LIGHTNING_CHUNK};
use crate::CudaBackend;
use cudarc::driver::CudaSlice;
use sala_model::{AttnShape, BResult};

/// A lightning call's inputs: q `[T, heads·d]`, k and v `[T, kv_heads·d]`, and `out`.
pub(crate) struct LightningIo<'a> {
    pub shape: AttnShape,
    pub slopes: &'a CudaSlice<f32>,
    pub q: &'a DevAct,
    pub k: &'a DevAct,
    pub v: &'a DevAct,
}

impl CudaBackend {
    /// Lightning attention of `io.q.rows` tokens from `state` (advanced in place) into `out`,
    /// with the kernels the plan picks for the shape.
    pub(crate) fn lightning_layer(
        &self,
        io: &LightningIo<'_>,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        let (shape, d) = (io.shape, io.shape.head_dim);
        let plan = self.k.planner().lightning(io.q.rows, d);
        match plan {
            LightningPlan::Decode => {
                let at = self.k.planner().lightning_decode(shape.heads, d, 1);
                self.k.lightning_decode(
                    at,
                    self.ptr(&io.q.buf),
                    self.ptr(&io.k.buf),
                    self.ptr(&io.v.buf),
                    self.ptr(state),
                    self.ptr(&out.buf),
                    self.ptr(io.slopes),
                    shape.heads as i32,
                    shape.kv_heads as i32,
                    d as i32,
                    shape.scale() as f32,
                )
            }
            LightningPlan::TwoPass => self.lightning_two_pass(io, state, out),
            LightningPlan::Fused { buffers } => self.lightning_fused(io, state, out, buffers),
            LightningPlan::Split => self.lightning_split(io, state, out),
            LightningPlan::Chunked => {
                let at = self.k.planner().lightning_chunked(shape.heads, d);
                self.k.lightning_chunked(
                    at,
                    self.ptr(&io.q.buf),
                    self.ptr(&io.k.buf),
                    self.ptr(&io.v.buf),
                    self.ptr(state),
                    self.ptr(&out.buf),
                    self.ptr(io.slopes),
                    io.q.rows as i32,
                    shape.heads as i32,
                    shape.kv_heads as i32,
                    d as i32,
                    shape.scale() as f32,
                )
            }
        }
    }

    /// One decode row per sequence (each its own state and position), q and k normed and
    /// rotated first (the caller checked [`CudaBackend::lightning_rows_fit`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lightning_decode_rows(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &mut DevAct,
        k: &mut DevAct,
        v: &DevAct,
        norms: Option<(&CudaSlice<u16>, &CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        positions: &[usize],
        states: &mut [&mut DevLightningState],
        out: &mut DevAct,
    ) -> BResult<()> {
        let (d, rows) = (shape.head_dim, states.len());
        self.norm_rope(
            q,
            Some(k),
            d,
            norms.map(|(a, b, e)| (a, Some(b), e)),
            inv_freq.map(|f| (f, RopeAt::Rows(positions))),
        )?;
        let ptrs: Vec<u64> = states.iter().map(|st| self.ptr(&**st)).collect();
        let t = DecodeRows::new(&ptrs, &[]);
        let at = self.k.planner().lightning_decode(shape.heads, d, rows);
        self.k.lightning_decode_rows(
            at,
            self.ptr(&q.buf),
            self.ptr(&k.buf),
            self.ptr(&v.buf),
            &t,
            self.ptr(&out.buf),
            self.ptr(slopes),
            shape.heads as i32,
            shape.kv_heads as i32,
            d as i32,
            shape.scale() as f32,
        )
    }

    /// Whether [`CudaBackend::lightning_decode_rows`] takes `rows` rows of head size `d`.
    pub(crate) fn lightning_rows_fit(rows: usize, d: usize) -> bool {
        rows <= DECODE_ROWS && d <= 256
    }

    /// Lightning prefill in one pass a block (`lightning_fused`). A long chunk is cut into
    /// ranges that run in parallel: their state contributions first (state-only passes), the
    /// state before each range from those (`lightning_range_states`), then every range's
    /// outputs from its own starting state.
    fn lightning_fused(
        &self,
        io: &LightningIo<'_>,
        state: &mut DevLightningState,
        out: &mut DevAct,
        buffers: u32,
    ) -> BResult<()> {
        let (t, d, heads) = (io.q.rows, io.shape.head_dim, io.shape.heads);
        let (n_ranges, range_len) = self.k.planner().lightning_ranges(t);
        let slots = if n_ranges > 1 {
            self.scratch_ptr(|s| &mut s.lightning, n_ranges * heads * d * d)?
        } else {
            0
        };
        let pass = |ranges: usize, state_only: bool| {
            let at = self.k.planner().lightning_fused(heads, d, ranges, buffers);
            self.k.lightning_fused(
                at,
                self.ptr(&io.q.buf),
                self.ptr(&io.k.buf),
                self.ptr(&io.v.buf),
                self.ptr(state),
                self.ptr(&out.buf),
                self.ptr(io.slopes),
                t as i32,
                heads as i32,
                io.shape.kv_heads as i32,
                d as i32,
                io.shape.scale() as f32,
                range_len as i32,
                slots,
                state_only as i32,
                buffers as i32,
            )
        };
        if n_ranges > 1 {
            pass(n_ranges - 1, true)?;
            self.k.lightning_range_states(
                crate::plan::Launch::linear(heads * d * d, 256),
                self.ptr(state),
                slots,
                self.ptr(io.slopes),
                heads as i32,
                d as i32,
                n_ranges as i32,
                range_len as i32,
            )?;
        }
        pass(n_ranges, false)
    }

    /// Walks `io`'s tokens in windows of whole chunks whose per-chunk states fit the scratch:
    /// `each(tokens, [q, k, v, out] addresses of the window's first row, chunk-states scratch)`.
    fn lightning_windows(
        &self,
        io: &LightningIo<'_>,
        out: &DevAct,
        mut each: impl FnMut(usize, [u64; 4], u64) -> BResult<()>,
    ) -> BResult<()> {
        let (t, d, heads) = (io.q.rows, io.shape.head_dim, io.shape.heads);
        let window = self.k.planner().lightning_window(heads, d);
        let states = self.scratch_ptr(
            |s| &mut s.lightning,
            heads * d * d * t.min(window).div_ceil(LIGHTNING_CHUNK),
        )?;
        let mut a = 0;
        while a < t {
            let n_tok = window.min(t - a);
            let rows = [
                self.row_ptr(io.q, a),
                self.row_ptr(io.k, a),
                self.row_ptr(io.v, a),
                self.row_ptr(out, a),
            ];
            each(n_tok, rows, states)?;
            a += n_tok;
        }
        Ok(())
    }

    /// Lightning prefill in two passes per window: `lightning_states` walks the window's
    /// chunks in order and keeps the state before each (bf16 hi + lo), then
    /// `lightning_outputs` computes every chunk's outputs at once. The same operations in the
    /// same order as the one-pass kernel: the same bits.
    fn lightning_two_pass(
        &self,
        io: &LightningIo<'_>,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        let (d, h, kvh) = (
            io.shape.head_dim as i32,
            io.shape.heads as i32,
            io.shape.kv_heads as i32,
        );
        let (st, sl, scale) = (
            self.ptr(state),
            self.ptr(io.slopes),
            io.shape.scale() as f32,
        );
        self.lightning_windows(io, out, |n_tok, [qp, kp, vp, op], states| {
            let (at_s, at_o) = {
                let p = self.k.planner();
                let (heads, dim) = (io.shape.heads, io.shape.head_dim);
                (
                    p.lightning_states(heads, dim),
                    p.lightning_outputs(n_tok, heads, dim),
                )
            };
            let nt = n_tok as i32;
            self.k
                .lightning_states(at_s, kp, vp, st, states, sl, nt, h, kvh, d)?;
            self.k
                .lightning_outputs(at_o, qp, kp, vp, states, op, sl, nt, h, kvh, d, scale)
        })
    }

    /// Lightning prefill on tensor cores in three kernels per window: chunk states, their
    /// scan, then the outputs.
    fn lightning_split(
        &self,
        io: &LightningIo<'_>,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        let (heads, dim) = (io.shape.heads, io.shape.head_dim);
        let (d, h, kvh) = (dim as i32, heads as i32, io.shape.kv_heads as i32);
        let (st, sl, scale) = (
            self.ptr(state),
            self.ptr(io.slopes),
            io.shape.scale() as f32,
        );
        self.lightning_windows(io, out, |n_tok, [qp, kp, vp, op], ds| {
            let n = n_tok.div_ceil(LIGHTNING_CHUNK);
            let last_len = n_tok - (n - 1) * LIGHTNING_CHUNK;
            let (at_state, at_out) = {
                let p = self.k.planner();
                (
                    p.lightning_chunk_state(n, heads),
                    p.lightning_chunk_out(n, heads),
                )
            };
            let nt = n_tok as i32;
            let at_scan = crate::plan::Launch::linear(heads * dim * dim, 256);
            self.k
                .lightning_chunk_state(at_state, kp, vp, ds, sl, nt, h, kvh, d)?;
            self.k
                .lightning_chunk_scan(at_scan, st, ds, sl, n as i32, last_len as i32, h, d)?;
            self.k
                .lightning_chunk_out(at_out, qp, kp, vp, ds, op, sl, nt, h, kvh, d, scale)
        })
    }
}
