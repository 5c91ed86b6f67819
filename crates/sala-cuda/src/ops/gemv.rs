//! Matrix products: GEMVs for decode-sized batches (`kernels/gemv/`, each row's result
//! independent of the others), cuBLASLt for the rest.

use crate::kernels::{Launcher, K};
use crate::memory::{be_err, DevAct, DevMem, Fp8Weights, W4Weights};
use crate::options::DecodeGemv;
use crate::plan::{
    Launch, Planner, GEMV_MMA_ROWS, GEMV_MMA_THREADS, GEMV_NARROW_MAX_ROWS, GEMV_ROWS64_THREADS,
    GEMV_ROWS_PER_BLOCK, NORM_PRODUCT_MAX_K,
};
use crate::w4_records::{w4_records, w4_records_len, w4_unrecord};
use crate::{CudaBackend, DevMatrix};
use cudarc::driver::CudaSlice;
use sala_model::{BResult, BackendError};

/// `gemv` and `gemv_narrow`: x, w, n, k, then up to four (output, count) parts.
type CudaCoreGemv =
    fn(&Launcher, Launch, u64, u64, i32, i32, u64, i32, u64, i32, u64, i32, u64) -> BResult<()>;

/// The (pointer, count) output parts of a product, each at its row `r` (a missing part: null).
fn parts_at_row(outs: &[(u64, usize)], r: usize) -> [(u64, i32); 4] {
    [0, 1, 2, 3].map(|i| {
        let (p, cnt) = outs.get(i).copied().unwrap_or((0, 0));
        (
            if p == 0 { 0 } else { p + (r * cnt * 2) as u64 },
            cnt as i32,
        )
    })
}

impl CudaBackend {
    /// Whether a product of `rows` rows with `w` runs as GEMVs, one per row (decode, batched
    /// decode): each row's result is then the same whatever the batch.
    pub(crate) fn gemv_fits(&self, rows: usize, w: &DevMatrix) -> bool {
        self.k.planner().gemv_fits(rows, w.cols)
    }

    /// `rows` rows (from row `x_off / w.cols` of x) times `w`ᵀ, one GEMV each; each row's
    /// `w.rows` outputs are written in turn to the (pointer, count) parts of `outs` (at most
    /// four; the counts add up to `w.rows`), at that row.
    pub(crate) fn gemv(
        &self,
        x: &impl DevMem<u16>,
        x_off: usize,
        w: &DevMatrix,
        outs: &[(u64, usize)],
        rows: usize,
    ) -> BResult<()> {
        if let Some(q) = &w.w4 {
            return self.gemv_w4(x, x_off, w, q, outs, rows);
        }
        if let Some(f) = &w.fp8 {
            return self.gemv_fp8(self.ptr(x) + (x_off * 2) as u64, w, f, outs, rows);
        }
        let variant = self.k.planner().options.decode_gemv;
        // Tensor cores: groups of up to 16 rows; CUDA cores: a launch per row.
        let tc = variant == DecodeGemv::TensorCore;
        let group = if tc { GEMV_MMA_ROWS } else { 1 };
        let (n, kk) = (w.rows as i32, w.cols as i32);
        let wp = self.ptr(&w.buf);
        let mut r = 0;
        while r < rows {
            let nb = group.min(rows - r);
            let xp = self.ptr(x) + ((x_off + r * w.cols) * 2) as u64;
            let [(y0, n0), (y1, n1), (y2, n2), (y3, _)] = parts_at_row(outs, r);
            // Few output rows: a row a warp (same sums, more warps in flight).
            let narrow = w.rows <= GEMV_NARROW_MAX_ROWS && variant != DecodeGemv::CudaCoreWide;
            let grid = |rows_per_block: usize, threads: u32| {
                Launch::new((w.rows.div_ceil(rows_per_block), 1, 1), threads, 0)
                    .shaped(w.rows, w.cols)
            };
            if tc && nb > 16 {
                self.gemv_rows64(xp, w, nb, [(y0, n0), (y1, n1), (y2, n2), (y3, 0)])?;
            } else if tc {
                // The kernel of the fewest MMA tiles (8 rows each) that hold the rows; its
                // M-tiles run in turn by at most two blocks an SM.
                let launch = if nb <= 8 {
                    Launcher::gemv_mma8
                } else {
                    Launcher::gemv_mma16
                };
                let at = self.tiles_launch(w, w.rows.div_ceil(16));
                let groups = self.k.planner().gemv_groups(false, w.rows) as i32;
                launch(
                    &self.k, at, xp, wp, n, kk, nb as i32, groups, y0, n0, y1, n1, y2, n2, y3,
                )?;
            } else {
                let (launch, at) = if narrow {
                    (Launcher::gemv_narrow as CudaCoreGemv, grid(4, 128))
                } else {
                    (
                        Launcher::gemv as CudaCoreGemv,
                        grid(GEMV_ROWS_PER_BLOCK, 128),
                    )
                };
                launch(&self.k, at, xp, wp, n, kk, y0, n0, y1, n1, y2, n2, y3)?;
            }
            r += nb;
        }
        Ok(())
    }

    /// 17 to 64 rows (`nb`, at `xp`) times `w`ᵀ on tensor cores, into `outs` (as `gemv`): one
    /// `gemv_rows64` launch, or, for a weight whose sums go in several groups, a group a part
    /// (`gemv_rows64_parts`) and the parts then added in order (`gemv_chain_sums`).
    fn gemv_rows64(&self, xp: u64, w: &DevMatrix, nb: usize, outs: [(u64, i32); 4]) -> BResult<()> {
        let [(y0, n0), (y1, n1), (y2, n2), (y3, _)] = outs;
        let (n, k, wp) = (w.rows as i32, w.cols as i32, self.ptr(&w.buf));
        let blocks = Planner::rows64_blocks(false, w.rows);
        let planner = self.k.planner();
        let parts = planner.gemv_groups(false, w.rows);
        let at = |parts: usize| {
            Launch::new((blocks, parts, 1), GEMV_ROWS64_THREADS, 0).shaped(w.rows, w.cols)
        };
        if parts == 1 {
            let nb = nb as i32;
            return self
                .k
                .gemv_rows64(at(1), xp, wp, n, k, nb, y0, n0, y1, n1, y2, n2, y3);
        }
        let sums = self.chain_sums(parts, blocks, nb)?;
        self.k
            .gemv_rows64_parts(at(parts), xp, wp, n, k, nb as i32, sums)?;
        let sum_at = Launch::linear(w.rows * nb.next_multiple_of(8) / 4, 256);
        let (m_rows, p, nb) = ((64 * blocks) as i32, parts as i32, nb as i32);
        self.k.gemv_chain_sums(
            sum_at, sums, m_rows, p, n, nb, 0, y0, n0, y1, n1, y2, n2, y3,
        )
    }

    /// The scratch for the group sums of a split 17-64-row product.
    fn chain_sums(&self, parts: usize, blocks: usize, nb: usize) -> BResult<u64> {
        let len = Planner::chain_sums_len(parts, blocks, nb);
        self.scratch_ptr(|s| &mut s.chain_sums, len)
    }

    /// `y = x wᵀ` into the buffer at `y`: GEMVs for decode-sized batches, cuBLASLt otherwise.
    pub(crate) fn product(
        &self,
        x: &impl DevMem<u16>,
        x_off: usize,
        w: &DevMatrix,
        y: u64,
        rows: usize,
    ) -> BResult<()> {
        if self.gemv_fits(rows, w) {
            return self.gemv(x, x_off, w, &[(y, w.rows)], rows);
        }
        self.gemm_rows(self.ptr(x) + (x_off * 2) as u64, w, 0, w.rows, y, rows)
    }

    /// `gemv` of a 4-bit matrix on tensor cores: `gemv_w4_8` / `gemv_w4_16`, up to 16
    /// activation rows a launch.
    fn gemv_w4(
        &self,
        x: &impl DevMem<u16>,
        x_off: usize,
        w: &DevMatrix,
        q: &W4Weights,
        outs: &[(u64, usize)],
        rows: usize,
    ) -> BResult<()> {
        let (n, k, g) = (w.rows as i32, w.cols as i32, q.group as i32);
        let rp = self.ptr(&q.records);
        let at = self.tiles_launch(w, w.rows.div_ceil(16));
        let mut r = 0;
        while r < rows {
            let nb = 16.min(rows - r);
            let xp = self.ptr(x) + ((x_off + r * w.cols) * 2) as u64;
            let [(y0, n0), (y1, n1), (y2, n2), (y3, _)] = parts_at_row(outs, r);
            let launch = if nb <= 8 {
                Launcher::gemv_w4_8
            } else {
                Launcher::gemv_w4_16
            };
            launch(
                &self.k, at, xp, rp, n, k, g, nb as i32, y0, n0, y1, n1, y2, n2, y3,
            )?;
            r += nb;
        }
        Ok(())
    }

    /// `product_silu` of a 4-bit [gate; up] on tensor cores: `gemv_silu_w4_8` /
    /// `gemv_silu_w4_16`, up to 16 rows a launch.
    fn gemv_silu_w4(&self, x: &DevAct, w: &DevMatrix, q: &W4Weights, out: &DevAct) -> BResult<()> {
        let inter = out.cols;
        let (i, k, g) = (inter as i32, w.cols as i32, q.group as i32);
        let rp = self.ptr(&q.records);
        let at = self.tiles_launch(w, inter.div_ceil(8));
        let mut r = 0;
        while r < x.rows {
            let nb = 16.min(x.rows - r);
            let (xp, yp) = (
                self.row_ptr(x, r),
                self.act_ptr(out) + (r * inter * 2) as u64,
            );
            let launch = if nb <= 8 {
                Launcher::gemv_silu_w4_8
            } else {
                Launcher::gemv_silu_w4_16
            };
            launch(&self.k, at, xp, rp, yp, i, k, g, nb as i32)?;
            r += nb;
        }
        Ok(())
    }

    /// Whether [`CudaBackend::add_norm_silu_w4`] takes this residual add, norm and SiLU
    /// product: one row, a 4-bit [gate; up] that the 1-row kernel runs, a row its blocks can
    /// norm, and no FP8 codes owed to a later product (a model with FP8 products has its norms
    /// make them).
    pub(crate) fn add_norm_silu_fits(
        &self,
        h: &DevAct,
        branch: &DevAct,
        a: &DevAct,
        w: &DevMatrix,
        out: &DevAct,
    ) -> bool {
        let (k, inter) = (h.cols, out.cols);
        [h.rows, branch.rows, a.rows, out.rows] == [1; 4]
            && [branch.cols, a.cols, w.cols] == [k; 3]
            && k.is_multiple_of(8)
            && k <= NORM_PRODUCT_MAX_K
            && w.rows == 2 * inter
            && inter.is_multiple_of(8)
            && w.w4.is_some()
            && !self.fp8_products.get()
            && self.gemv_fits(1, w)
    }

    /// `h = round(h + round(branch · scale))`, `a = rms_norm(h, norm)` and `out` the SiLU
    /// product of `a` with the 4-bit [gate; up] `w`, in one launch (`gemv_silu_w4_8_norm`:
    /// each block makes the norm itself, the same bits as `add_rms_norm`), where
    /// [`CudaBackend::add_norm_silu_fits`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_norm_silu_w4(
        &self,
        h: &mut DevAct,
        branch: &DevAct,
        scale: f32,
        norm: &CudaSlice<u16>,
        eps: f32,
        a: &mut DevAct,
        w: &DevMatrix,
        out: &mut DevAct,
    ) -> BResult<()> {
        let q =
            w.w4.as_ref()
                .ok_or_else(|| BackendError("add_norm_silu_w4: the matrix is not 4-bit".into()))?;
        let (k, inter) = (w.cols, out.cols);
        let blocks = self.tiles_launch(w, inter.div_ceil(8)).grid.0 as usize;
        let at = self
            .k
            .planner()
            .gemv_w4_norm(blocks, k)
            .shaped(w.rows, w.cols);
        let ticket = self.scratch_ptr(|s| &mut s.norm_ticket, 1)?;
        self.norms_in_products.set(self.norms_in_products.get() + 1);
        self.k.gemv_silu_w4_8_norm(
            at,
            self.ptr(&q.records),
            self.act_ptr(out),
            inter as i32,
            k as i32,
            q.group as i32,
            self.act_ptr(h),
            self.act_ptr(branch),
            scale,
            self.ptr(norm),
            eps,
            self.act_ptr(a),
            ticket,
        )
    }

    /// `rows` product inputs (`k` wide, at `xp`) as FP8 rows in scratch: their codes when
    /// `codes`, else their bf16 values; returns (inputs, scales).
    fn quantize_inputs(&self, xp: u64, rows: usize, k: usize, codes: bool) -> BResult<(u64, u64)> {
        // Made by the norm that wrote these rows (`norm_codes`): nothing left to do. Either way
        // the scratch is this product's from here on.
        let fresh = self.fresh_f8.take();
        if codes && fresh == Some((xp, rows, k)) {
            return self.f8_input_scratch(rows, k, true);
        }
        let (inputs, scales) = self.f8_input_scratch(rows, k, codes)?;
        let (c, v) = if codes { (inputs, 0) } else { (0, inputs) };
        self.k.quant_rows_f8(
            Launch::new((rows, 1, 1), 256, 0),
            xp,
            k as i32,
            c,
            v,
            scales,
        )?;
        Ok((inputs, scales))
    }

    /// The shared memory `gemv_f8_bf16_8` needs for `rows` rows of width `k` at `xp`, where it
    /// takes them: rows whose codes no norm made (those are read as they are), at most 8, their
    /// codes within what the kernel is opted into (`GEMV_F8_BF16_SMEM` where the device allows).
    /// Either way the norm's codes are this product's.
    fn f8_bf16_inputs_fit(&self, xp: u64, rows: usize, k: usize) -> Option<u32> {
        let made = self.fresh_f8.get() == Some((xp, rows, k));
        let smem = rows * k;
        let fits = !made
            && rows <= 8
            && k.is_multiple_of(16)
            && smem <= self.k.planner().max_dynamic_smem(K::GemvF8Bf16x8);
        if fits {
            self.fresh_f8.set(None);
        }
        fits.then_some(smem as u32)
    }

    /// The FP8 input scratch for `rows` rows of width `k`: their codes (bytes) or bf16 values,
    /// and their scales.
    pub(crate) fn f8_input_scratch(
        &self,
        rows: usize,
        k: usize,
        codes: bool,
    ) -> BResult<(u64, u64)> {
        let units = if codes {
            (rows * k).div_ceil(2)
        } else {
            rows * k
        };
        let inputs = self.scratch_ptr(|s| &mut s.f8_in, units)?;
        let scales = self.scratch_ptr(|s| &mut s.f8_scales, rows)?;
        Ok((inputs, scales))
    }

    /// The launch of a decode product of `w` in `tiles` M-tiles (up to 16 rows): two blocks an
    /// SM at most, each running its tiles in turn (`gemv_mma_tiles_body`, `gemv_f8_body`,
    /// `gemv_w4_body`).
    fn tiles_launch(&self, w: &DevMatrix, tiles: usize) -> Launch {
        let blocks = tiles.min(2 * self.k.planner().limits.sms as usize).max(1);
        Launch::new((blocks, 1, 1), GEMV_MMA_THREADS, 0).shaped(w.rows, w.cols)
    }

    /// `gemv` of an FP8 matrix: the rows made E4M3 (`quant_rows_f8`), then `gemv_f8_8` /
    /// `gemv_f8_16`, up to 16 rows a launch; or, for a few narrow rows whose codes no norm
    /// made, `gemv_f8_bf16_8`, each block making their codes itself (no launch before it).
    fn gemv_fp8(
        &self,
        xp: u64,
        w: &DevMatrix,
        f: &Fp8Weights,
        outs: &[(u64, usize)],
        rows: usize,
    ) -> BResult<()> {
        let (n, k) = (w.rows as i32, w.cols as i32);
        let (wp, wsp) = (self.ptr(&f.codes), self.ptr(&f.scales));
        let at = self.tiles_launch(w, w.rows.div_ceil(16));
        if let Some(smem) = self.f8_bf16_inputs_fit(xp, rows, w.cols) {
            let [(y0, n0), (y1, n1), (y2, n2), (y3, _)] = parts_at_row(outs, 0);
            let at = Launch { smem, ..at };
            self.codes_in_products.set(self.codes_in_products.get() + 1);
            return self.k.gemv_f8_bf16_8(
                at,
                xp,
                wp,
                wsp,
                n,
                k,
                rows as i32,
                y0,
                n0,
                y1,
                n1,
                y2,
                n2,
                y3,
            );
        }
        let (xc, xs) = self.quantize_inputs(xp, rows, w.cols, true)?;
        let mut r = 0;
        while r < rows {
            let nb = 16.min(rows - r);
            let [(y0, n0), (y1, n1), (y2, n2), (y3, _)] = parts_at_row(outs, r);
            let launch = if nb <= 8 {
                Launcher::gemv_f8_8
            } else {
                Launcher::gemv_f8_16
            };
            let (xcr, xsr) = (xc + (r * w.cols) as u64, xs + (r * 4) as u64);
            launch(
                &self.k, at, xcr, xsr, wp, wsp, n, k, nb as i32, y0, n0, y1, n1, y2, n2, y3,
            )?;
            r += nb;
        }
        Ok(())
    }

    /// `product_silu` of an FP8 `[gate; up]` matrix: the rows made E4M3, then
    /// `gemv_silu_f8_8` / `gemv_silu_f8_16`, up to 16 rows a launch.
    fn gemv_silu_fp8(
        &self,
        x: &DevAct,
        w: &DevMatrix,
        f: &Fp8Weights,
        out: &mut DevAct,
    ) -> BResult<()> {
        let inter = out.cols;
        let (wp, wsp) = (self.ptr(&f.codes), self.ptr(&f.scales));
        let (xc, xs) = self.quantize_inputs(self.act_ptr(x), x.rows, w.cols, true)?;
        let at = self.tiles_launch(w, inter.div_ceil(8));
        let mut r = 0;
        while r < x.rows {
            let nb = 16.min(x.rows - r);
            let launch = if nb <= 8 {
                Launcher::gemv_silu_f8_8
            } else {
                Launcher::gemv_silu_f8_16
            };
            let yp = self.act_ptr(out) + (r * inter * 2) as u64;
            let (xcr, xsr) = (xc + (r * w.cols) as u64, xs + (r * 4) as u64);
            let (i, k) = (inter as i32, w.cols as i32);
            launch(&self.k, at, xcr, xsr, wp, wsp, yp, i, k, nb as i32)?;
            r += nb;
        }
        Ok(())
    }

    /// cuBLASLt with an FP8 matrix: `y = x W[r0 .. r0 + n]ᵀ` as the FP8 product defines it
    /// (`sala_model::Fp8Matrix`): on FP8 tensor cores (8.9 on), scaled by cuBLASLt or after;
    /// elsewhere on bf16 ones over the codes' exact bf16 values.
    #[allow(clippy::too_many_arguments)]
    fn gemm_rows_fp8(
        &self,
        xp: u64,
        w: &DevMatrix,
        f: &Fp8Weights,
        r0: usize,
        n: usize,
        y: u64,
        rows: usize,
    ) -> BResult<()> {
        let k = w.cols;
        let (tensor_cores, vector_scales) = {
            let p = self.k.planner();
            (p.limits.cc >= (8, 9), p.options.fp8_vector_scales)
        };
        let (wc, ws) = (
            self.ptr(&f.codes) + (r0 * k) as u64,
            self.ptr(&f.scales) + (r0 * 4) as u64,
        );
        let (inputs, xs) = self.quantize_inputs(xp, rows, k, tensor_cores)?;
        let profiler = self.k.profiler();
        let t0 = profiler.and_then(|p| p.start(&self.stream));
        let scaled = if tensor_cores {
            self.gemm
                .borrow_mut()
                .run_fp8(inputs, wc, y, (rows, n, k), (ws, xs), vector_scales)
                .map_err(BackendError)?
        } else {
            let tmp = self.scratch_ptr(|s| &mut s.dequant, n * k)?;
            self.k.dequant_f8(
                Launch::new(((n * k).div_ceil(1024), 1, 1), 256, 0),
                wc,
                tmp,
                (n * k) as u64,
            )?;
            self.gemm
                .borrow_mut()
                .run_ptrs(inputs, tmp, y, rows, n, k)
                .map_err(BackendError)?;
            false
        };
        if let Some(p) = profiler {
            p.end(format!("gemm fp8 {}x{}", n, k), t0, &self.stream);
        }
        if !scaled {
            let at = Launch::new((rows, n.div_ceil(2048), 1), 256, 0);
            self.k.scale_rows_cols(at, y, xs, ws, n as i32)?;
        }
        Ok(())
    }

    /// FP8 matrices stacked by rows, as `concat_rows` stacks bf16 ones.
    pub(crate) fn concat_fp8(
        &self,
        parts: Vec<DevMatrix>,
        rows: usize,
        cols: usize,
    ) -> BResult<DevMatrix> {
        let err = |e| be_err("stacking FP8 weights", e);
        let codes = self.stream.alloc_zeros::<u8>(rows * cols).map_err(err)?;
        let scales = self.stream.alloc_zeros::<f32>(rows).map_err(err)?;
        let mut at = 0;
        for p in &parts {
            let f = p.fp8.as_ref().expect("all FP8");
            self.copy(&codes, at * cols, &f.codes, 0, p.rows * cols)?;
            self.copy(&scales, at, &f.scales, 0, p.rows)?;
            at += p.rows;
        }
        Ok(DevMatrix {
            buf: self.alloc_u16(0)?,
            rows,
            cols,
            w4: None,
            fp8: Some(Fp8Weights { codes, scales }),
        })
    }

    /// The bf16 values of rows `r0..r0 + n` of 4-bit `w` into the buffer at `out`.
    pub(crate) fn dequantize_rows(
        &self,
        w: &DevMatrix,
        r0: usize,
        n: usize,
        out: u64,
    ) -> BResult<()> {
        let Some(q) = &w.w4 else {
            return Err(BackendError("dequantize_rows: not a 4-bit matrix".into()));
        };
        let words = n * (w.cols / 8);
        self.k.dequant_w4(
            Launch::linear(words, 256),
            self.ptr(&q.records),
            r0 as i32,
            w.cols as i32,
            q.group as i32,
            words as u64,
            out,
        )
    }

    /// 4-bit matrices stacked by rows, as `concat_rows` stacks bf16 ones: their records one
    /// after another where each part fills whole M-tiles (the released model's parts all do),
    /// else unpacked and packed again on the host.
    pub(crate) fn concat_w4(
        &self,
        parts: Vec<DevMatrix>,
        rows: usize,
        cols: usize,
    ) -> BResult<DevMatrix> {
        let group = parts[0].w4.as_ref().map_or(1, |q| q.group);
        let err = |e| be_err("stacking 4-bit weights", e);
        let whole_tiles = parts[..parts.len() - 1]
            .iter()
            .all(|p| p.rows.is_multiple_of(16));
        let records = if whole_tiles {
            let records = self
                .stream
                .alloc_zeros::<u32>(w4_records_len(rows, cols, group))
                .map_err(err)?;
            let mut at = 0;
            for p in &parts {
                let q = p.w4.as_ref().expect("all 4-bit");
                let len = w4_records_len(p.rows, cols, group);
                self.copy(&records, at, &q.records, 0, len)?;
                at += len;
            }
            records
        } else {
            let (mut words, mut group_words) = (Vec::new(), Vec::new());
            for p in &parts {
                let q = p.w4.as_ref().expect("all 4-bit");
                let host = self.stream.clone_dtoh(&q.records).map_err(err)?;
                let (w, g) = w4_unrecord(&host, p.rows, cols, group);
                words.extend(w);
                group_words.extend(g);
            }
            let packed = w4_records(&words, &group_words, rows, cols, group);
            self.stream.clone_htod(&packed).map_err(err)?
        };
        Ok(DevMatrix {
            buf: self.alloc_u16(0)?,
            rows,
            cols,
            w4: Some(W4Weights { records, group }),
            fp8: None,
        })
    }

    /// cuBLASLt: `y = x W[r0 .. r0 + n]ᵀ` (`rows` rows of x at `xp`, weight rows r0.. of `w`;
    /// a 4-bit `w`'s rows dequantized into scratch first).
    pub(crate) fn gemm_rows(
        &self,
        xp: u64,
        w: &DevMatrix,
        r0: usize,
        n: usize,
        y: u64,
        rows: usize,
    ) -> BResult<()> {
        if let Some(f) = &w.fp8 {
            return self.gemm_rows_fp8(xp, w, f, r0, n, y, rows);
        }
        let wp = if w.w4.is_some() {
            let tmp = self.scratch_ptr(|s| &mut s.dequant, n * w.cols)?;
            self.dequantize_rows(w, r0, n, tmp)?;
            tmp
        } else {
            self.ptr(&w.buf) + (r0 * w.cols * 2) as u64
        };
        let profiler = self.k.profiler();
        let t0 = profiler.and_then(|p| p.start(&self.stream));
        self.gemm
            .borrow_mut()
            .run_ptrs(xp, wp, y, rows, n, w.cols)
            .map_err(BackendError)?;
        if let Some(p) = profiler {
            p.end(format!("gemm {}x{}", n, w.cols), t0, &self.stream);
        }
        Ok(())
    }

    /// `out = round(silu(x Wgᵀ)) · (x Wuᵀ)` for the stacked `[gate; up]` weight `w`: fused
    /// GEMVs for decode-sized batches, else a product into `gu` and the SiLU halves.
    pub(crate) fn product_silu(
        &self,
        x: &DevAct,
        w: &DevMatrix,
        gu: &mut DevAct,
        out: &mut DevAct,
    ) -> BResult<()> {
        let inter = out.cols;
        // The 4-bit kernel takes the gate rows 8 at a time (gemv_w4_body).
        let fused = self.gemv_fits(x.rows, w) && (w.w4.is_none() || inter.is_multiple_of(8));
        if !fused || w.rows != 2 * inter || x.cols != w.cols {
            self.matmul_into(x, w, gu)?;
            return self.silu_halves(gu, out);
        }
        if let Some(q) = &w.w4 {
            return self.gemv_silu_w4(x, w, q, out);
        }
        if let Some(f) = &w.fp8 {
            return self.gemv_silu_fp8(x, w, f, out);
        }
        let tc = self.k.planner().options.decode_gemv == DecodeGemv::TensorCore;
        let group = if tc { GEMV_MMA_ROWS } else { 1 };
        let mut r = 0;
        while r < x.rows {
            let nb = group.min(x.rows - r);
            let (xp, wp) = (self.row_ptr(x, r), self.ptr(&w.buf));
            let yp = self.act_ptr(out) + (r * inter * 2) as u64;
            let (i, k) = (inter as i32, w.cols as i32);
            let at = |outs_per_block: usize, threads: u32| {
                Launch::new((inter.div_ceil(outs_per_block), 1, 1), threads, 0)
                    .shaped(w.rows, w.cols)
            };
            if !tc {
                self.k
                    .gemv_silu(at(GEMV_ROWS_PER_BLOCK / 2, 128), xp, wp, yp, i, k)?;
            } else if nb > 16 {
                self.gemv_silu_rows64(xp, w, yp, inter, nb)?;
            } else {
                let launch = if nb <= 8 {
                    Launcher::gemv_silu_mma8
                } else {
                    Launcher::gemv_silu_mma16
                };
                let at = self.tiles_launch(w, inter.div_ceil(8));
                let groups = self.k.planner().gemv_groups(true, w.rows) as i32;
                launch(&self.k, at, xp, wp, yp, i, k, nb as i32, groups)?;
            }
            r += nb;
        }
        Ok(())
    }

    /// `gemv_rows64` for [gate; up] and its SiLU product: `nb` rows (17 to 64) into `inter`
    /// outputs a row at `yp`, split into parts as `gemv_rows64` is.
    fn gemv_silu_rows64(
        &self,
        xp: u64,
        w: &DevMatrix,
        yp: u64,
        inter: usize,
        nb: usize,
    ) -> BResult<()> {
        let (wp, i, k) = (self.ptr(&w.buf), inter as i32, w.cols as i32);
        let blocks = Planner::rows64_blocks(true, w.rows);
        let parts = self.k.planner().gemv_groups(true, w.rows);
        let at = |parts: usize| {
            Launch::new((blocks, parts, 1), GEMV_ROWS64_THREADS, 0).shaped(w.rows, w.cols)
        };
        if parts == 1 {
            return self.k.gemv_silu_rows64(at(1), xp, wp, yp, i, k, nb as i32);
        }
        let sums = self.chain_sums(parts, blocks, nb)?;
        self.k
            .gemv_silu_rows64_parts(at(parts), xp, wp, i, k, nb as i32, sums)?;
        let sum_at = Launch::linear(inter * nb.next_multiple_of(8) / 4, 256);
        let (m_rows, p, n, nb) = ((64 * blocks) as i32, parts as i32, 2 * i, nb as i32);
        self.k
            .gemv_chain_sums(sum_at, sums, m_rows, p, n, nb, 1, yp, 0, 0, 0, 0, 0, 0)
    }

    /// `out = x wᵀ`, shapes checked.
    pub(crate) fn matmul_into(&self, x: &DevAct, w: &DevMatrix, out: &mut DevAct) -> BResult<()> {
        if x.cols != w.cols || out.cols != w.rows || out.rows != x.rows {
            return Err(BackendError(format!(
                "matmul shapes: x [{}, {}], w [{}, {}], out [{}, {}]",
                x.rows, x.cols, w.rows, w.cols, out.rows, out.cols
            )));
        }
        self.product(x, 0, w, self.act_ptr(out), x.rows)
    }

    /// `x wᵀ` split by columns into `outs` (at most four, widths adding up to `w.rows`).
    pub(crate) fn matmul_parts(
        &self,
        x: &DevAct,
        w: &DevMatrix,
        outs: &mut [&mut DevAct],
    ) -> BResult<()> {
        let total: usize = outs.iter().map(|o| o.cols).sum();
        if total != w.rows || x.cols != w.cols || outs.len() > 4 {
            return Err(BackendError(format!(
                "matmul_split: {} outputs of {total} columns for a [{}, {}] matrix and {} inputs",
                outs.len(),
                w.rows,
                w.cols,
                x.cols
            )));
        }
        let rows = x.rows;
        if self.gemv_fits(rows, w) {
            let parts: Vec<_> = outs.iter().map(|o| (self.act_ptr(o), o.cols)).collect();
            return self.gemv(x, 0, w, &parts, rows);
        }
        // Several rows: one product per output, straight into it (no split copy).
        let mut r0 = 0;
        for o in outs.iter() {
            self.gemm_rows(self.act_ptr(x), w, r0, o.cols, self.act_ptr(o), rows)?;
            r0 += o.cols;
        }
        Ok(())
    }
}
