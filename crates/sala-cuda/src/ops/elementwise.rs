//! Embedding, norms, per-head norm and RoPE, element-wise products, random fills
//! (`kernels/elementwise.cu`).

use crate::memory::{be_err, grow, DevAct, RopeKey};
use crate::plan::Launch;
use crate::CudaBackend;
use cudarc::driver::CudaSlice;
use sala_model::{BResult, BackendError};

/// Per-head norm weights of a first and an optional second buffer, and epsilon.
pub(crate) type HeadNorms<'a> = (&'a CudaSlice<u16>, Option<&'a CudaSlice<u16>>, f32);

/// Where a row's RoPE position comes from: `first + row`, or each row's own.
#[derive(Clone, Copy)]
pub(crate) enum RopeAt<'a> {
    From(usize),
    Rows(&'a [usize]),
}

impl CudaBackend {
    /// Writes `n` seeded normal bf16 values `mean + std·z` (never zero) at device address `at`.
    pub(crate) fn fill_random_mean(
        &self,
        at: u64,
        n: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<()> {
        self.fill_random_from(at, n, 0, seed, mean, std)
    }

    /// Values `first..first + n` of the seed's sequence at `at`.
    pub(crate) fn fill_random_from(
        &self,
        at: u64,
        n: usize,
        first: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<()> {
        self.k.fill_random(
            Launch::linear(n, 256),
            at,
            n as u64,
            first as u64,
            seed,
            mean,
            std,
        )
    }

    pub(crate) fn fill_random(&self, at: u64, n: usize, seed: u64, std: f32) -> BResult<()> {
        self.fill_random_mean(at, n, seed, 0.0, std)
    }

    pub(crate) fn embed_rows(
        &self,
        table: &crate::DevMatrix,
        ids: &[u32],
        scale: f32,
        out: &mut DevAct,
    ) -> BResult<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(BackendError(format!(
                "token id {bad} is outside the embedding table"
            )));
        }
        let ids_ptr = {
            let mut s = self.scratch.borrow_mut();
            if !self.preloaded.get() {
                grow(&self.stream, &mut s.ids, ids.len())?;
                let buf = s.ids.as_mut().expect("grown");
                self.stream
                    .memcpy_htod(ids, buf)
                    .map_err(|e| be_err("token ids", e))?;
            }
            self.ptr(s.ids.as_ref().expect("uploaded"))
        };
        self.k.embed(
            Launch::new((ids.len(), 1, 1), 256, 0),
            self.ptr(&table.buf),
            ids_ptr,
            scale,
            self.act_ptr(out),
            table.cols as i32,
        )
    }

    /// RMS norm of each row of `x` into `out`, times round(sigmoid(gate)) when given.
    pub(crate) fn rms_norm_rows(
        &self,
        x: &DevAct,
        w: &CudaSlice<u16>,
        eps: f32,
        gate: Option<&DevAct>,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.rms_norm_rows_with(x, w, eps, gate, None, out)
    }

    /// Each row's sum of squares of `x` into `sums` (f32, at least `x.rows`), as the norm
    /// adds them.
    pub(crate) fn row_sums_sq(&self, x: &DevAct, sums: &mut CudaSlice<f32>) -> BResult<()> {
        if sums.len() < x.rows {
            return Err(BackendError(format!(
                "row sums of squares: a table of {} entries for {} rows",
                sums.len(),
                x.rows
            )));
        }
        self.k.row_sums_sq(
            Launch::new((x.rows, 1, 1), 512, 0),
            self.act_ptr(x),
            x.cols as i32,
            self.ptr(sums),
        )
    }

    /// [`CudaBackend::rms_norm_rows`], with each row's mean square `sums[r] / width` when
    /// `sums` is given (a row split among tensor-parallel ranks).
    pub(crate) fn rms_norm_rows_with(
        &self,
        x: &DevAct,
        w: &CudaSlice<u16>,
        eps: f32,
        gate: Option<&DevAct>,
        sums: Option<(&CudaSlice<f32>, usize)>,
        out: &mut DevAct,
    ) -> BResult<()> {
        if let Some((s, width)) = sums {
            if s.len() < x.rows || width < x.cols {
                return Err(BackendError(format!(
                    "norm of split rows: {} sums for {} rows, a width of {width} for {} columns",
                    s.len(),
                    x.rows,
                    x.cols
                )));
            }
        }
        let (codes, scales) = self.norm_codes(out)?;
        self.k.rms_norm(
            Launch::new((x.rows, 1, 1), 512, 0),
            self.act_ptr(x),
            self.ptr(w),
            eps,
            self.act_ptr(out),
            x.cols as i32,
            gate.map_or(0, |g| self.act_ptr(g)),
            codes,
            scales,
            sums.map_or(0, |(s, _)| self.ptr(s)),
            sums.map_or(0, |(_, width)| width as i32),
        )
    }

    /// Where a norm writing `out` also writes its rows' E4M3 codes and scales (0, 0: it does
    /// not): with FP8 products, for rows the norm kernels read packed (a width a multiple of
    /// 8, at most 8192) and an FP8 product would read as codes (any rows from 8.9 on, decode
    /// rows elsewhere). The product reading `out` next then takes them as they are.
    fn norm_codes(&self, out: &DevAct) -> BResult<(u64, u64)> {
        let wanted =
            self.fp8_products.get() && out.cols.is_multiple_of(8) && out.cols <= 8 * 2 * 512 && {
                let p = self.k.planner();
                p.limits.cc >= (8, 9) || p.gemv_fits(out.rows, out.cols)
            };
        if !wanted {
            // Codes made before for these rows would no longer be theirs.
            if self
                .fresh_f8
                .get()
                .is_some_and(|(p, ..)| p == self.act_ptr(out))
            {
                self.fresh_f8.set(None);
            }
            return Ok((0, 0));
        }
        let scratch = self.f8_input_scratch(out.rows, out.cols, true)?;
        self.fresh_f8
            .set(Some((self.act_ptr(out), out.rows, out.cols)));
        Ok(scratch)
    }

    /// `h += scale · branch`, then the RMS norm of `h` into `out`, in one pass.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_scaled_norm_rows(
        &self,
        h: &mut DevAct,
        branch: &DevAct,
        scale: f32,
        w: &CudaSlice<u16>,
        eps: f32,
        out: &mut DevAct,
    ) -> BResult<()> {
        if !h.cols.is_multiple_of(8) || h.cols > 8 * 2 * 512 {
            self.elementwise(ElementOp::AddScaled(scale), h, branch)?;
            return self.rms_norm_rows(h, w, eps, None, out);
        }
        let (codes, scales) = self.norm_codes(out)?;
        self.k.add_rms_norm(
            self.k.planner().add_rms_norm(h.rows),
            self.act_ptr(h),
            self.act_ptr(branch),
            scale,
            self.ptr(w),
            eps,
            self.act_ptr(out),
            h.cols as i32,
            h.rows as i32,
            codes,
            scales,
        )
    }

    /// An element-wise op of `a` (in place) with `b`.
    pub(crate) fn elementwise(&self, op: ElementOp, a: &DevAct, b: &DevAct) -> BResult<()> {
        let n = a.rows * a.cols;
        // Eight elements a thread (`elementwise8`).
        let at = Launch::new((n.div_ceil(8 * 256).max(1), 1, 1), 256, 0);
        let (x, y) = (self.act_ptr(a), self.act_ptr(b));
        match op {
            ElementOp::SiluMul => self.k.silu_mul(at, x, y, n as u64),
            ElementOp::AddScaled(s) => self.k.add_scaled(at, x, y, s, n as u64),
            ElementOp::SigmoidGate => self.k.sigmoid_gate(at, x, y, n as u64),
        }
    }

    /// `out = round(silu(gate)) · up` for the two halves `[gate | up]` of each row of `gu`.
    pub(crate) fn silu_halves(&self, gu: &DevAct, out: &mut DevAct) -> BResult<()> {
        let (g, o) = (self.act_ptr(gu), self.act_ptr(out));
        if out.cols.is_multiple_of(8) && out.rows <= 65535 {
            let at = Launch::new(((out.cols / 8).div_ceil(256), out.rows, 1), 256, 0);
            return self.k.silu_mul_halves8(at, g, o, out.cols as i32);
        }
        let at = Launch::linear(out.rows * out.cols, 256);
        self.k
            .silu_mul_halves(at, g, o, out.rows as i32, out.cols as i32)
    }

    /// `n` values from `x` divided by `divisor` and rounded to bf16 into `out`.
    pub(crate) fn scale_round(&self, x: u64, out: u64, divisor: f32, n: usize) -> BResult<()> {
        self.k
            .scale_round(Launch::linear(n, 256), x, out, divisor, n as u64)
    }

    /// Per-head norm and RoPE of `x` and, in the same launch, of `x2` (with the second norm
    /// weight).
    pub(crate) fn norm_rope(
        &self,
        x: &mut DevAct,
        x2: Option<&mut DevAct>,
        head_dim: usize,
        norm: Option<HeadNorms<'_>>,
        rope: Option<(&CudaSlice<f32>, RopeAt<'_>)>,
    ) -> BResult<()> {
        if head_dim > 256 || !head_dim.is_multiple_of(2) {
            return Err(BackendError(format!(
                "head_dim {head_dim}: the CUDA kernels take even sizes up to 256"
            )));
        }
        let hpr = x.cols / head_dim;
        let total = x.rows * hpr;
        let table = match rope {
            Some((f, at)) => self.rope_table(f, at, x.rows, head_dim / 2)?,
            None => 0,
        };
        let (x2_ptr, total2, hpr2) = match &x2 {
            Some(b) => (
                self.act_ptr(b),
                b.rows * (b.cols / head_dim),
                b.cols / head_dim,
            ),
            None => (0, 0, 1),
        };
        let w1 = norm.map_or(0, |(w, _, _)| self.ptr(w));
        let eps = norm.map_or(0.0, |(_, _, e)| e);
        let w2 = norm.and_then(|(_, w2, _)| w2).map_or(0, |w| self.ptr(w));
        let (kernel, at) = self.k.planner().head_norm_rope(total + total2, head_dim);
        if kernel == crate::kernels::K::HeadNormRopeLanes {
            return self.k.head_norm_rope_lanes(
                at,
                self.act_ptr(x),
                total as i32,
                head_dim as i32,
                w1,
                eps,
                hpr as i32,
                x2_ptr,
                total2 as i32,
                w2,
                hpr2.max(1) as i32,
                table,
            );
        }
        self.k.head_norm_rope(
            at,
            self.act_ptr(x),
            total as i32,
            head_dim as i32,
            w1,
            eps,
            rope.map_or(0, |(f, _)| self.ptr(f)),
            0, // first position: unused, the table holds every row's
            hpr as i32,
            x2_ptr,
            total2 as i32,
            w2,
            hpr2.max(1) as i32,
            table,
        )
    }

    /// The RoPE table of `rows` rows (cos, sin of pos·inv_freq[i] for i < half, the row's
    /// position from `at`), made once for all layers that ask for the same one.
    pub(crate) fn rope_table(
        &self,
        inv_freq: &CudaSlice<f32>,
        at: RopeAt<'_>,
        rows: usize,
        half: usize,
    ) -> BResult<u64> {
        let f = self.ptr(inv_freq);
        let key = match at {
            RopeAt::From(pos) => RopeKey::Run(f, half, pos, rows),
            RopeAt::Rows(p) => RopeKey::Rows(f, half, p.to_vec()),
        };
        let fresh = self.scratch.borrow().rope_key.as_ref() != Some(&key);
        let table = self.scratch_ptr(|s| &mut s.rope, 2 * rows * half)?;
        if fresh {
            let launch = Launch::linear(rows * half, 256);
            match at {
                RopeAt::From(pos) => {
                    self.k
                        .rope_table(launch, f, pos as i32, rows as i32, half as i32, table)?
                }
                RopeAt::Rows(p) => {
                    if p.len() != rows {
                        return Err(BackendError(format!(
                            "rope_table: {} positions for {rows} rows",
                            p.len()
                        )));
                    }
                    let pos_ptr = {
                        let mut s = self.scratch.borrow_mut();
                        // A graph step's positions are on the device already.
                        if !self.preloaded.get() {
                            let pos: Vec<i32> = p.iter().map(|&x| x as i32).collect();
                            grow(&self.stream, &mut s.positions, rows)?;
                            let buf = s.positions.as_mut().expect("grown");
                            self.stream
                                .memcpy_htod(&pos, buf)
                                .map_err(|e| be_err("positions", e))?;
                            s.positions_held = pos;
                        }
                        self.ptr(s.positions.as_ref().expect("uploaded"))
                    };
                    self.k
                        .rope_table_rows(launch, f, pos_ptr, rows as i32, half as i32, table)?
                }
            }
            self.scratch.borrow_mut().rope_key = Some(key);
        }
        Ok(table)
    }
}

/// The element-wise ops of two activations.
#[derive(Clone, Copy)]
pub(crate) enum ElementOp {
    /// `a = round(silu(a)) · b`.
    SiluMul,
    /// `a += s · b`.
    AddScaled(f32),
    /// `a *= round(sigmoid(b))`.
    SigmoidGate,
}
