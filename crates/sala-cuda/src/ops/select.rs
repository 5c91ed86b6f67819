//! Block selection of the sparse layers (SPEC §5.4): block scores on tensor cores and a top-k
//! for prefill, the spread `sd_*` kernels for decode, and the CUDA-core kernels that match
//! the CPU bit for bit (`kernels/sparse/select_*.cu`).

use crate::kernels::{SeqRows, K};
use crate::memory::{DevAct, DevSparseCache};
use crate::plan::{Launch, SelectPlan, TopkPlan};
use crate::CudaBackend;
use sala_checkpoint::SparseConfig;
use sala_model::{AttnShape, BResult};

/// The queries of a decode selection.
#[derive(Clone, Copy)]
pub(crate) enum DecodeQueries<'a> {
    /// `q`'s rows, at positions `first..` of one sequence.
    Run {
        cache: &'a DevSparseCache,
        first: usize,
    },
    /// One query of each of `rows` sequences (`seqs`), the longest holding `longest` =
    /// (tokens, level-1 windows, level-2 windows).
    Rows {
        seqs: &'a SeqRows,
        rows: usize,
        longest: (usize, usize, usize),
    },
}

impl CudaBackend {
    /// Block lists (`q.rows · kv_heads · k_sel` ids) for the queries at positions `first..`
    /// into `blocks`, by the selection the plan picks.
    pub(crate) fn select_blocks(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        let plan = self.k.planner().select(shape, cfg, q.rows, cache.len);
        match plan {
            SelectPlan::Scores(kernel) => {
                self.select_scores(kernel, shape, cfg, q, cache, first, blocks)
            }
            SelectPlan::Decode => {
                self.select_decode(shape, cfg, q, DecodeQueries::Run { cache, first }, blocks)
            }
            SelectPlan::Exact => self.select_exact(shape, cfg, q, cache, first, blocks),
        }
    }

    /// The scratch the top-k keys go to when the plan keeps them out of shared memory:
    /// `pairs` rows of `row` keys (null otherwise).
    fn topk_keys(&self, plan: &TopkPlan, pairs: usize, row: usize) -> BResult<u64> {
        if plan.keys_in_global {
            self.scratch_ptr(|s| &mut s.topk_keys, pairs * row.max(1))
        } else {
            Ok(0)
        }
    }

    /// Tensor-core block selection for the `q.rows` queries at positions `first..`: block
    /// scores, then the top-k from them, in groups of queries whose scores fit the scratch.
    #[allow(clippy::too_many_arguments)]
    fn select_scores(
        &self,
        kernel: K,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        let t = q.rows;
        let kvh = shape.kv_heads;
        let k_sel = cfg.selected_blocks();
        let stride = cache.len.div_ceil(cfg.block_size).max(1);
        let group = self
            .k
            .planner()
            .select_group(kernel, kvh, cache.len, t, cfg);
        // Block scores as bf16 bits, two to an f32 of the scratch, in whole 16-byte pieces
        // (`sd_topk_scores` reads the pieces that hold a row's scores).
        let scores = (group.min(t) * kvh * stride).next_multiple_of(8);
        let bs = self.scratch_ptr(|s| &mut s.p, scores / 2)?;
        let launch_scores = match kernel {
            K::SelectScoresWg => crate::kernels::Launcher::select_scores_wg,
            K::SelectScoresT => crate::kernels::Launcher::select_scores_t,
            _ => crate::kernels::Launcher::select_scores_mma,
        };
        let mut a = 0;
        while a < t {
            let n = group.min(t - a);
            let pos = first + a;
            let (at, topk) = {
                let p = self.k.planner();
                (
                    p.select_scores(kernel, n, kvh),
                    p.topk_scores(n * kvh, cache.len, cfg),
                )
            };
            launch_scores(
                &self.k,
                at,
                self.row_ptr(q, a),
                self.ptr(&cache.k1),
                self.ptr(&cache.k2),
                cache.n1 as i32,
                cache.n2 as i32,
                n as i32,
                pos as i32,
                shape.heads as i32,
                kvh as i32,
                shape.head_dim as i32,
                shape.scale() as f32,
                cfg.block_size as i32,
                cfg.k1_stride() as i32,
                cfg.k2_window() as i32,
                cfg.k2_stride() as i32,
                cfg.init_blocks as i32,
                cfg.local_blocks() as i32,
                k_sel as i32,
                bs,
                stride as i32,
            )?;
            let out = blocks + (a * kvh * k_sel * 4) as u64;
            if topk.kernel == K::SdTopkScores {
                let keys = self.topk_keys(&topk, n * kvh, stride)?;
                self.k.sd_topk_scores(
                    topk.launch,
                    bs,
                    stride as i32,
                    pos as i32,
                    kvh as i32,
                    cfg.block_size as i32,
                    cfg.init_blocks as i32,
                    cfg.local_blocks() as i32,
                    k_sel as i32,
                    keys,
                    out,
                )?;
            } else {
                self.k.select_topk_scores(
                    topk.launch,
                    bs,
                    stride as i32,
                    pos as i32,
                    kvh as i32,
                    cfg.block_size as i32,
                    cfg.k1_stride() as i32,
                    cfg.init_blocks as i32,
                    cfg.local_blocks() as i32,
                    k_sel as i32,
                    out,
                )?;
            }
            a += n;
        }
        Ok(())
    }

    /// Block selection for few queries (decode) on tensor cores, spread over the GPU: partial
    /// level-2 normalisers per slice of K2, P per slice of K1, then one block per (query,
    /// group) pools and picks the blocks; for a run of one sequence's queries or for one query
    /// of each sequence of a batched step (the `_rows` kernels).
    pub(crate) fn select_decode(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        queries: DecodeQueries<'_>,
        blocks: u64,
    ) -> BResult<()> {
        let (pairs, (len, n1, n2)) = match queries {
            DecodeQueries::Run { cache, .. } => {
                (q.rows * shape.kv_heads, (cache.len, cache.n1, cache.n2))
            }
            DecodeQueries::Rows { rows, longest, .. } => (rows * shape.kv_heads, longest),
        };
        let (at_lse, at_p, p_stride) = {
            let p = self.k.planner();
            (
                p.sd_lse(pairs, n2),
                p.sd_p(pairs, n1),
                p.sd_p_stride(n1, len, cfg),
            )
        };
        let n_split = at_lse.grid.1 as usize;
        let part = self.scratch_ptr(|s| &mut s.lse, pairs * n_split * shape.group() * 2)?;
        let p16 = self.scratch_ptr(|s| &mut s.p16, pairs * p_stride)?;
        let (qp, h, kvh, d, scale) = (
            self.act_ptr(q),
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale() as f32,
        );
        let (k1w, k1s, k2w, k2s) = (
            cfg.k1_window() as i32,
            cfg.k1_stride() as i32,
            cfg.k2_window() as i32,
            cfg.k2_stride() as i32,
        );
        let (ns, ps) = (n_split as i32, p_stride as i32);
        match queries {
            DecodeQueries::Run { cache, first } => {
                let (k1, k2, fp) = (self.ptr(&cache.k1), self.ptr(&cache.k2), first as i32);
                let (n1, n2) = (n1 as i32, n2 as i32);
                self.k
                    .sd_lse(at_lse, qp, k2, n2, fp, h, kvh, d, scale, k2w, k2s, part)?;
                self.k.sd_p(
                    at_p, qp, k1, n1, fp, h, kvh, d, scale, k1w, k1s, part, ns, p16, ps,
                )?;
            }
            DecodeQueries::Rows { seqs, .. } => {
                self.k
                    .sd_lse_rows(at_lse, qp, seqs, h, kvh, d, scale, k2w, k2s, part)?;
                self.k.sd_p_rows(
                    at_p, qp, seqs, h, kvh, d, scale, k1w, k1s, part, ns, p16, ps,
                )?;
            }
        }
        let rows = matches!(queries, DecodeQueries::Rows { .. });
        let topk = self.k.planner().sd_topk(rows, pairs, len, p_stride, cfg);
        let keys = self.topk_keys(&topk, pairs, p_stride)?;
        let (at, sp) = (topk.launch, topk.stage_p as i32);
        let (bsz, ib, lb, ks) = (
            cfg.block_size as i32,
            cfg.init_blocks as i32,
            cfg.local_blocks() as i32,
            cfg.selected_blocks() as i32,
        );
        match queries {
            DecodeQueries::Run { first, .. } => self.k.sd_topk(
                at,
                p16,
                ps,
                n1 as i32,
                first as i32,
                kvh,
                bsz,
                k1w,
                k1s,
                ib,
                lb,
                ks,
                sp,
                keys,
                blocks,
            ),
            DecodeQueries::Rows { seqs, .. } if topk.kernel == K::SdTopkRowsCl => self
                .k
                .sd_topk_rows_cl(at, p16, ps, seqs, kvh, bsz, k1w, k1s, ib, lb, ks, blocks),
            DecodeQueries::Rows { seqs, .. } => self.k.sd_topk_rows(
                at, p16, ps, seqs, kvh, bsz, k1w, k1s, ib, lb, ks, sp, keys, blocks,
            ),
        }
    }

    /// The CPU's bit-exact block selection: one block per (query, group) for many queries,
    /// else the normaliser, scores and top-k spread over many blocks.
    fn select_exact(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        let t = q.rows;
        let pairs = t * shape.kv_heads;
        let p_stride = cache.n1.max(1);
        let p = self.scratch_ptr(|s| &mut s.p, pairs * p_stride)?;
        let smem = self.k.planner().exact_select_smem(shape);
        let (qp, k1, k2) = (self.act_ptr(q), self.ptr(&cache.k1), self.ptr(&cache.k2));
        let (n1, n2, ti, fp) = (cache.n1 as i32, cache.n2 as i32, t as i32, first as i32);
        let (h, kvh, d, scale) = (
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale() as f32,
        );
        let (bsz, k1w, k1s, k2w, k2s) = (
            cfg.block_size as i32,
            cfg.k1_window() as i32,
            cfg.k1_stride() as i32,
            cfg.k2_window() as i32,
            cfg.k2_stride() as i32,
        );
        let (ib, lb, ks, ps) = (
            cfg.init_blocks as i32,
            cfg.local_blocks() as i32,
            cfg.selected_blocks() as i32,
            p_stride as i32,
        );
        if pairs >= crate::plan::SELECT_ONE_KERNEL_PAIRS {
            // Many queries (prefill): one block per (query, group) fills the GPU.
            let at = Launch::new((pairs, 1, 1), 256, smem);
            return self.k.sparse_select(
                at, qp, k1, k2, n1, n2, ti, fp, h, kvh, d, scale, bsz, k1w, k1s, k2w, k2s, ib, lb,
                ks, p, ps, blocks,
            );
        }
        // Few queries (decode): spread normaliser, scores and top-k over many blocks.
        let lse = self.scratch_ptr(|s| &mut s.lse, t * shape.heads)?;
        let one_head = (shape.head_dim + 3) * 4;
        type Exact = fn(
            &crate::kernels::Launcher,
            Launch,
            u64,
            u64,
            u64,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            f32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            i32,
            u64,
            i32,
            u64,
            u64,
        ) -> BResult<()>;
        let steps: [(Exact, Launch); 3] = [
            (
                crate::kernels::Launcher::select_lse,
                Launch::new((pairs, shape.group(), 1), 256, one_head),
            ),
            (
                crate::kernels::Launcher::select_scores,
                Launch::new((pairs, cache.n1.div_ceil(256).max(1), 1), 256, smem),
            ),
            (
                crate::kernels::Launcher::select_topk,
                Launch::new((pairs, 1, 1), 256, 0),
            ),
        ];
        for (launch, at) in steps {
            launch(
                &self.k, at, qp, k1, k2, n1, n2, ti, fp, h, kvh, d, scale, bsz, k1w, k1s, k2w, k2s,
                ib, lb, ks, p, ps, blocks, lse,
            )?;
        }
        Ok(())
    }
}
