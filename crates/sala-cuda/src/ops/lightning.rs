//! Lightning layers (SPEC §4.2): the decode step, batched decode rows, and the prefill kernels
//! the plan picks (`kernels/lightning/`).

use crate::kernels::{DecodeRows, Launcher, K};
use crate::memory::{DevAct, DevLightningState, Windows};
use crate::ops::elementwise::RopeAt;
use crate::plan::{LightningPlan, DECODE_ROWS, LIGHTNING_CHUNK};
use crate::CudaBackend;
use cudarc::driver::CudaSlice;
use sala_model::backend::{check_rope, check_spans, span_runs, SpanRun};
use sala_model::{AttnIo, AttnShape, BResult, BackendError, Span, STEPWISE_SPAN_ROWS};

/// A lightning call's inputs: q `[T, heads·d]`, k and v `[T, kv_heads·d]`, and `out`.
pub(crate) struct LightningIo<'a> {
    pub shape: AttnShape,
    pub slopes: &'a CudaSlice<f32>,
    pub q: &'a DevAct,
    pub k: &'a DevAct,
    pub v: &'a DevAct,
}

/// What the lightning decode kernel does to q and k before its step (`QkPrep` of
/// kernels/lightning/decode.cu): per-head norm weights (device pointers, 0 for none) and the
/// RoPE table of the launch's first row (0: no rotation).
#[derive(Clone, Copy, Default)]
pub(crate) struct QkPrep {
    q_norm: u64,
    k_norm: u64,
    eps: f32,
    table: u64,
}

impl QkPrep {
    /// The same, for a launch starting at row `row` of the step (the table has `d` floats a row).
    fn at_row(self, row: usize, d: usize) -> Self {
        let table = match self.table {
            0 => 0,
            t => t + (row * d * std::mem::size_of::<f32>()) as u64,
        };
        Self { table, ..self }
    }
}

impl CudaBackend {
    /// Each row's position under `spans` (rows outside every span at 0).
    fn row_positions(&self, spans: &[Span], rows: usize) -> Vec<usize> {
        let mut p = vec![0; rows];
        for s in spans {
            for (j, r) in s.rows().enumerate() {
                p[r] = s.pos + j;
            }
        }
        p
    }

    /// [`sala_model::Backend::rope`]: q and k rotated at their rows' positions in one launch.
    pub(crate) fn rope_spans(
        &self,
        head_dim: usize,
        inv_freq: &CudaSlice<f32>,
        spans: &[Span],
        q: &mut DevAct,
        k: &mut DevAct,
    ) -> BResult<()> {
        check_rope(head_dim, spans, (q.rows, q.cols), (k.rows, k.cols))?;
        let positions = self.row_positions(spans, q.rows);
        let at = rope_at(spans, q.rows, self.preloaded.get(), &positions);
        self.norm_rope(q, Some(k), head_dim, None, Some((inv_freq, at)))
    }

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
                let none = QkPrep::default();
                self.lightning_decode_rows(
                    shape,
                    io.slopes,
                    io.q,
                    io.k,
                    io.v,
                    &mut [state],
                    out,
                    none,
                )
            }
            LightningPlan::Ranges { buffers } => self.lightning_ranges(io, state, out, buffers),
            LightningPlan::Split => self.lightning_split(io, state, out),
            LightningPlan::Chunked => {
                let at = self.k.planner().lightning_chunked(shape.heads, d);
                self.k.lightning_chunked(
                    at,
                    self.act_ptr(io.q),
                    self.act_ptr(io.k),
                    self.act_ptr(io.v),
                    self.ptr(state),
                    self.act_ptr(out),
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

    /// The lightning entry ([`sala_model::Backend::lightning`]): decode rows and spans of at
    /// most [`STEPWISE_SPAN_ROWS`] rows step token by token, so a span's rows get the bits of
    /// decoding them one at a time; each longer span runs the prefill kernels its length
    /// picks. When every run steps, q and k are normed and rotated inside the stepping kernels
    /// (one launch fewer a layer); else all rows first, in one launch (the same bits).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lightning_spans(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        norms: Option<(&CudaSlice<u16>, &CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        io: AttnIo<'_, DevAct>,
        spans: &[Span],
        states: &mut [&mut DevLightningState],
    ) -> BResult<()> {
        check_spans(spans, io.q.rows, states.len())?;
        let d = shape.head_dim;
        let positions = self.row_positions(spans, io.q.rows);
        let at = rope_at(spans, io.q.rows, self.preloaded.get(), &positions);
        let runs = span_runs(spans);
        let stepwise =
            crate::plan::Planner::head_norm_rope_lanes_fits(d) && Self::lightning_decode_fits(d);
        let steps = |run: &SpanRun| match run {
            SpanRun::Rows { .. } => stepwise,
            SpanRun::Chunk(i) => stepwise && spans[*i].len <= STEPWISE_SPAN_ROWS,
        };
        let prepped = norms.is_some() || inv_freq.is_some();
        let mut prep = QkPrep::default();
        let in_kernel = stepwise && runs.iter().all(steps);
        if in_kernel {
            prep = QkPrep {
                q_norm: norms.map_or(0, |(w, _, _)| self.ptr(w)),
                k_norm: norms.map_or(0, |(_, w, _)| self.ptr(w)),
                eps: norms.map_or(0.0, |(_, _, e)| e),
                table: match inv_freq {
                    Some(f) => self.rope_table(f, at, io.q.rows, d / 2)?,
                    None => 0,
                },
            };
        }
        if !in_kernel && prepped {
            self.norm_rope(
                io.q,
                Some(io.k),
                d,
                norms.map(|(a, b, e)| (a, Some(b), e)),
                inv_freq.map(|f| (f, at)),
            )?;
        }
        let mut w = Windows::new(io);
        for run in runs {
            let by_steps = steps(&run);
            match run {
                SpanRun::Rows {
                    spans: idx,
                    first_row,
                } if by_steps => {
                    for start in idx.clone().step_by(DECODE_ROWS) {
                        let end = (start + DECODE_ROWS).min(idx.end);
                        let row = first_row + start - idx.start;
                        let (q, k, v, out) = w.rows(row, end - start);
                        self.lightning_decode_rows(
                            shape,
                            slopes,
                            q,
                            k,
                            v,
                            &mut states[start..end],
                            out,
                            prep.at_row(row, d),
                        )?;
                    }
                }
                SpanRun::Rows { spans: idx, .. } => {
                    for i in idx {
                        self.lightning_span(shape, slopes, &mut w, spans[i], states[i])?;
                    }
                }
                SpanRun::Chunk(i) if by_steps => {
                    let span = spans[i];
                    let (q, k, v, out) = w.rows(span.first_row, span.len);
                    self.lightning_step_rows(
                        shape,
                        slopes,
                        [Some(&*q), Some(&*k), Some(v)],
                        span.len,
                        Some(out),
                        states[i],
                        prep.at_row(span.first_row, d),
                    )?;
                }
                SpanRun::Chunk(i) => {
                    self.lightning_span(shape, slopes, &mut w, spans[i], states[i])?
                }
            }
        }
        Ok(())
    }

    /// [`sala_model::Backend::lightning_replay`]: the state advanced over kept rows of k and v
    /// by the stepping kernel, k normed and rotated inside it as the forward pass did.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lightning_replay_rows(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        k_norm: Option<(&CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        (k, v, rows): (&DevAct, &DevAct, usize),
        pos: usize,
        state: &mut DevLightningState,
    ) -> BResult<()> {
        let d = shape.head_dim;
        if !(crate::plan::Planner::head_norm_rope_lanes_fits(d) && Self::lightning_decode_fits(d)) {
            return Err(BackendError(format!(
                "lightning replay: head size {d} does not step token by token here"
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let prep = QkPrep {
            q_norm: 0,
            k_norm: k_norm.map_or(0, |(w, _)| self.ptr(w)),
            eps: k_norm.map_or(0.0, |(_, e)| e),
            table: match inv_freq {
                Some(f) => self.rope_table(f, RopeAt::From(pos), rows, d / 2)?,
                None => 0,
            },
        };
        self.lightning_step_rows(
            shape,
            slopes,
            [None, Some(k), Some(v)],
            rows,
            None,
            state,
            prep,
        )
    }

    /// The first `rows` rows of one span of one sequence stepped token by token in one launch
    /// (`lightning_span_rows`): q, k and v of its rows (q may be `None` with no `out`: the
    /// state alone advances, as a replay does), normed and rotated as `prep` says.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lightning_step_rows(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        [q, k, v]: [Option<&DevAct>; 3],
        rows: usize,
        out: Option<&mut DevAct>,
        state: &mut DevLightningState,
        prep: QkPrep,
    ) -> BResult<()> {
        let (Some(k), Some(v)) = (k, v) else {
            return Err(BackendError(
                "lightning_step_rows: k and v are needed".into(),
            ));
        };
        if rows > k.rows || rows > v.rows || q.is_some_and(|q| rows > q.rows) {
            return Err(BackendError(format!(
                "lightning_step_rows: {rows} rows of buffers holding {}",
                k.rows.min(v.rows)
            )));
        }
        let at = self
            .k
            .planner()
            .lightning_decode(shape.heads, shape.head_dim, 1);
        self.k.lightning_span_rows(
            at,
            q.map_or(0, |q| self.act_ptr(q)),
            self.act_ptr(k),
            self.act_ptr(v),
            self.ptr(state),
            out.map_or(0, |o| self.act_ptr(o)),
            self.ptr(slopes),
            rows as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale() as f32,
            prep.q_norm,
            prep.k_norm,
            prep.eps,
            prep.table,
        )
    }

    /// One span (q and k already normed and rotated) with the kernels its length picks.
    fn lightning_span(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        w: &mut Windows<'_>,
        span: Span,
        state: &mut DevLightningState,
    ) -> BResult<()> {
        let (q, k, v, out) = w.rows(span.first_row, span.len);
        let io = LightningIo {
            shape,
            slopes,
            q,
            k,
            v,
        };
        self.lightning_layer(&io, state, out)
    }

    /// One decode row per sequence (each its own state), in one launch; q and k normed and
    /// rotated already, or by the kernel as `prep` says.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lightning_decode_rows(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        states: &mut [&mut DevLightningState],
        out: &mut DevAct,
        prep: QkPrep,
    ) -> BResult<()> {
        let (d, rows) = (shape.head_dim, states.len());
        let ptrs: Vec<u64> = states.iter().map(|st| self.ptr(&**st)).collect();
        let t = DecodeRows::new(&ptrs);
        let (kernel, at) = self.k.planner().lightning_decode_rows(shape.heads, d, rows);
        let launch = if kernel == K::LightningDecodeRowsPaired {
            Launcher::lightning_decode_rows_paired
        } else {
            Launcher::lightning_decode_rows
        };
        launch(
            &self.k,
            at,
            self.act_ptr(q),
            self.act_ptr(k),
            self.act_ptr(v),
            &t,
            self.act_ptr(out),
            self.ptr(slopes),
            shape.heads as i32,
            shape.kv_heads as i32,
            d as i32,
            shape.scale() as f32,
            prep.q_norm,
            prep.k_norm,
            prep.eps,
            prep.table,
        )
    }

    /// Whether [`CudaBackend::lightning_decode_rows`] takes heads of size `d` (each launch
    /// takes at most `DECODE_ROWS` rows).
    pub(crate) fn lightning_decode_fits(d: usize) -> bool {
        d <= 256
    }

    /// Lightning prefill over ranges of chunks walked in parallel (`lightning_ranges`): each
    /// range's contribution to the state first (the sums pass), the state before each range
    /// from those (`lightning_range_states`), then every range's outputs from its own starting
    /// state. A call of one range walks once.
    fn lightning_ranges(
        &self,
        io: &LightningIo<'_>,
        state: &mut DevLightningState,
        out: &mut DevAct,
        buffers: u32,
    ) -> BResult<()> {
        let (t, d, heads) = (io.q.rows, io.shape.head_dim, io.shape.heads);
        let (n_ranges, range_len) = self.k.planner().lightning_range_split(t, heads, d);
        let slots = if n_ranges > 1 {
            self.scratch_ptr(|s| &mut s.lightning, n_ranges * heads * d * d)?
        } else {
            0
        };
        let (t32, h32, kvh32, d32, len32) = (
            t as i32,
            heads as i32,
            io.shape.kv_heads as i32,
            d as i32,
            range_len as i32,
        );
        if n_ranges > 1 {
            let sums = self
                .k
                .planner()
                .lightning_range_sums(heads, d, n_ranges - 1, buffers);
            self.k.lightning_range_sums(
                sums,
                self.act_ptr(io.k),
                self.act_ptr(io.v),
                self.ptr(io.slopes),
                t32,
                h32,
                kvh32,
                d32,
                len32,
                slots,
                buffers as i32,
            )?;
            self.k.lightning_range_states(
                crate::plan::Launch::linear(heads * d * d, 256),
                self.ptr(state),
                slots,
                self.ptr(io.slopes),
                h32,
                d32,
                n_ranges as i32,
                len32,
            )?;
        }
        let at = self
            .k
            .planner()
            .lightning_ranges(heads, d, n_ranges, buffers);
        self.k.lightning_ranges(
            at,
            self.act_ptr(io.q),
            self.act_ptr(io.k),
            self.act_ptr(io.v),
            self.ptr(state),
            self.act_ptr(out),
            self.ptr(io.slopes),
            t32,
            h32,
            kvh32,
            d32,
            io.shape.scale() as f32,
            len32,
            slots,
            buffers as i32,
        )
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

/// Where a step's RoPE positions come from: one span from row 0 counts up from its position
/// (unless the step's positions are on the device already, as in a graph step, which reads
/// every row's there); else each row's own.
fn rope_at<'a>(spans: &[Span], rows: usize, preloaded: bool, positions: &'a [usize]) -> RopeAt<'a> {
    match spans {
        [one] if one.first_row == 0 && one.len == rows && !preloaded => RopeAt::From(one.pos),
        _ => RopeAt::Rows(positions),
    }
}
