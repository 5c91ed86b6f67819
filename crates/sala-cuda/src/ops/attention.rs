//! Sparse layers (SPEC §5): appending K/V, compressing keys, and attention over every block
//! (dense) or the selected ones (sparse), one sequence or a batched decode step of many
//! (`kernels/sparse/attention.cu`, `kernels/sparse/compress.cu`).

use crate::kernels::{Launcher, SeqRows};
use crate::memory::{DevAct, DevSparseCache, Windows};
use crate::ops::select::DecodeQueries;
use crate::plan::{windows, AttentionPlan, SelectPlan, SEQ_ROWS};
use crate::CudaBackend;
use sala_checkpoint::{KvCacheDtype, SparseConfig};
use sala_model::backend::{check_spans, span_runs, SpanRun};
use sala_model::{AttnIo, AttnShape, BResult, BackendError, Span, SparseMode, STEPWISE_SPAN_ROWS};

impl CudaBackend {
    /// The sparse entry ([`sala_model::Backend::sparse_attention`]): each run of decode rows
    /// in one launch per kernel where [`CudaBackend::sparse_rows_fit`] allows it, else row by
    /// row; each longer span alone.
    pub(crate) fn sparse_spans(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        io: AttnIo<'_, DevAct>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut DevSparseCache],
    ) -> BResult<()> {
        check_spans(spans, io.q.rows, caches.len())?;
        if modes.len() != spans.len() {
            return Err(BackendError(format!(
                "{} sparse modes for {} spans",
                modes.len(),
                spans.len()
            )));
        }
        // The caches' lengths move every step: this runs outside any graph.
        self.graph_pause()?;
        self.sparse_runs(shape, cfg, io, spans, modes, caches)?;
        self.graph_resume()
    }

    /// [`CudaBackend::sparse_spans`]'s work, run by run.
    fn sparse_runs(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        io: AttnIo<'_, DevAct>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut DevSparseCache],
    ) -> BResult<()> {
        let mut w = Windows::new(io);
        for run in span_runs(spans) {
            let (idx, first_row) = match run {
                SpanRun::Rows { spans, first_row } => (spans, first_row),
                // A short span: its rows as decode rows of its sequence, each with the bits of
                // decoding it alone (Backend::lightning's rule, kept by the sparse layers too).
                SpanRun::Chunk(i) if spans[i].len <= STEPWISE_SPAN_ROWS.min(SEQ_ROWS) => {
                    let span = spans[i];
                    let fits = self
                        .sparse_rows_fit(shape, cfg, &modes[i..=i], &caches[i..=i])
                        .is_some();
                    if fits {
                        let (q, k, v, out) = w.rows(span.first_row, span.len);
                        self.sparse_span_rows(shape, cfg, modes[i], q, k, v, caches[i], out)?;
                    } else {
                        for r in span.rows() {
                            let (q, k, v, out) = w.rows(r, 1);
                            self.sparse_layer(shape, cfg, modes[i], q, k, v, caches[i], out)?;
                        }
                    }
                    continue;
                }
                SpanRun::Chunk(i) => {
                    let (q, k, v, out) = w.rows(spans[i].first_row, spans[i].len);
                    self.sparse_layer(shape, cfg, modes[i], q, k, v, caches[i], out)?;
                    continue;
                }
            };
            for start in idx.clone().step_by(SEQ_ROWS) {
                let end = (start + SEQ_ROWS).min(idx.end);
                match self.sparse_rows_fit(shape, cfg, &modes[start..end], &caches[start..end]) {
                    Some(mode) => {
                        let (q, k, v, out) = w.rows(first_row + start - idx.start, end - start);
                        self.sparse_rows_batched(
                            shape,
                            cfg,
                            mode,
                            q,
                            k,
                            v,
                            &mut caches[start..end],
                            out,
                        )?;
                    }
                    None => {
                        for i in start..end {
                            let (q, k, v, out) = w.rows(spans[i].first_row, 1);
                            self.sparse_layer(shape, cfg, modes[i], q, k, v, caches[i], out)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Appends rows `row0..row0 + rows` of `k` and `v` to `cache` and compresses the windows
    /// they complete; returns the cache's length before.
    pub(crate) fn append_kv(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        (k, v): (&DevAct, &DevAct),
        row0: usize,
        rows: usize,
    ) -> BResult<usize> {
        if rows == 1 {
            return self.append_kv_rows(&mut [cache], cfg, (k, v), row0);
        }
        let (kw, first) = (cache.kv_width, cache.len);
        self.reserve(cache, first + rows, cfg, false)?;
        if cache.fp8 {
            self.store_fp8_rows(cache, (self.act_ptr(k), self.act_ptr(v)), row0, rows)?;
        } else {
            self.copy(&cache.k, first * kw, k, row0 * kw, rows * kw)?;
            self.copy(&cache.v, first * kw, v, row0 * kw, rows * kw)?;
        }
        cache.len += rows;
        self.compress_new_windows(cache, cfg)?;
        Ok(first)
    }

    /// Appends row `row0 + r` of `k` and `v` to `caches[r]` for every r, each with the windows
    /// it completes compressed, in one launch (what [`CudaBackend::append_kv`] does a row at a
    /// time); returns the first cache's length before.
    pub(crate) fn append_kv_rows(
        &self,
        caches: &mut [&mut DevSparseCache],
        cfg: &SparseConfig,
        (k, v): (&DevAct, &DevAct),
        row0: usize,
    ) -> BResult<usize> {
        let Some(first) = caches.first() else {
            return Ok(0);
        };
        let (kw, d, fp8, first_len) = (first.kv_width, first.head_dim, first.fp8, first.len);
        if caches.len() > SEQ_ROWS
            || row0 + caches.len() > k.rows.min(v.rows)
            || k.cols != kw
            || v.cols != kw
            || caches.iter().any(|c| c.kv_width != kw || c.fp8 != fp8)
        {
            return Err(BackendError(format!(
                "append_kv_rows: {} caches (at most {SEQ_ROWS}, one width and format) for rows \
                 {row0}.. of {}",
                caches.len(),
                k.rows
            )));
        }
        let mut t = SeqRows::empty();
        for (r, cache) in caches.iter_mut().enumerate() {
            self.reserve(cache, cache.len + 1, cfg, false)?;
            t.k[r] = self.ptr(&cache.k);
            t.v[r] = self.ptr(&cache.v);
            t.k1[r] = self.ptr(&cache.k1);
            t.k2[r] = self.ptr(&cache.k2);
            t.pos[r] = cache.len as i32;
            t.n1[r] = cache.n1 as i32;
            t.n2[r] = cache.n2 as i32;
        }
        let at = self.k.planner().append_kv_rows(caches.len());
        let row_bytes = (2 * row0 * kw) as u64;
        let (kp, vp) = (self.act_ptr(k) + row_bytes, self.act_ptr(v) + row_bytes);
        let (kvh, hd) = ((kw / d) as i32, d as i32);
        let (w1, s1) = (cfg.k1_window(), cfg.k1_stride());
        let (w2, s2) = (cfg.k2_window(), cfg.k2_stride());
        let tiers = (w1 as i32, s1 as i32, w2 as i32, s2 as i32);
        if fp8 {
            self.k
                .append_kv_rows_f8(at, kp, vp, &t, kvh, hd, tiers.0, tiers.1, tiers.2, tiers.3)?;
        } else {
            self.k
                .append_kv_rows(at, kp, vp, &t, kvh, hd, tiers.0, tiers.1, tiers.2, tiers.3)?;
        }
        for cache in caches.iter_mut() {
            cache.len += 1;
            cache.n1 = windows(cache.len, w1, s1);
            cache.n2 = windows(cache.len, w2, s2);
        }
        Ok(first_len)
    }

    /// Stores bf16 rows `row0..row0 + rows` of (k, v) (device pointers to `kv_width`-wide
    /// rows) as FP8 rows at the end of `cache` (its length not moved; room reserved).
    fn store_fp8_rows(
        &self,
        cache: &DevSparseCache,
        (k, v): (u64, u64),
        row0: usize,
        rows: usize,
    ) -> BResult<()> {
        let (kw, d) = (cache.kv_width as u64, cache.head_dim);
        let kv_heads = cache.kv_width / d;
        let row_bytes = 2 * (row0 as u64) * kw;
        let at = self.k.planner().kv_store_fp8(rows, kv_heads);
        self.k.kv_store_f8(
            at,
            k + row_bytes,
            v + row_bytes,
            self.ptr(&cache.k),
            self.ptr(&cache.v),
            rows as i32,
            kv_heads as i32,
            d as i32,
            cache.len as i32,
        )
    }

    /// Fills an empty FP8 cache with `tokens` random tokens: the bf16 values the bf16 cache
    /// would get (`fill_sparse_cache_random`), stored as FP8 a slab at a time.
    pub(crate) fn fill_fp8_cache_random(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        tokens: usize,
        seed: u64,
    ) -> BResult<()> {
        const SLAB: usize = 16384;
        let kw = cache.kv_width;
        let slab = self.alloc_u16(2 * SLAB.min(tokens.max(1)) * kw)?;
        let (k, v) = (
            self.ptr(&slab),
            self.ptr(&slab) + (2 * SLAB.min(tokens.max(1)) * kw) as u64,
        );
        let std = sala_model::backend::RANDOM_KV_STD;
        for first in (0..tokens).step_by(SLAB) {
            let rows = SLAB.min(tokens - first);
            self.fill_random_from(k, rows * kw, first * kw, seed, 0.0, std)?;
            self.fill_random_from(v, rows * kw, first * kw, seed ^ 1, 0.0, std)?;
            self.store_fp8_rows(cache, (k, v), 0, rows)?;
            cache.len += rows;
        }
        self.compress_new_windows(cache, cfg)
    }

    /// Appends the `t` rows of `k`, `v` to `cache`, selects blocks (sparse) and attends for the
    /// `t` queries of `q` into `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sparse_layer(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        cache: &mut DevSparseCache,
        out: &mut DevAct,
    ) -> BResult<()> {
        let t = q.rows;
        let first = self.append_kv(cache, cfg, (k, v), 0, t)?;
        let k_sel = cfg.selected_blocks();
        let blocks = match mode {
            SparseMode::Dense => 0,
            SparseMode::Sparse => {
                let blocks = self.scratch_ptr(|s| &mut s.blocks, t * shape.kv_heads * k_sel)?;
                self.select_blocks(shape, cfg, q, cache, first, blocks)?;
                blocks
            }
        };
        let plan = self.k.planner().attention(shape, cfg, mode, t, cache.len);
        let (qp, kc, vc, op) = (
            self.act_ptr(q),
            self.ptr(&cache.k),
            self.ptr(&cache.v),
            self.act_ptr(out),
        );
        let (ti, fp, h, kvh, d, scale, ks) = (
            t as i32,
            first as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale() as f32,
            k_sel as i32,
        );
        match plan {
            AttentionPlan::Decode => {
                let pairs = t * shape.kv_heads;
                let (split, at) = {
                    let p = self.k.planner();
                    let split = p.decode_split(mode, cache.len, k_sel, pairs);
                    (split, p.attention_decode(pairs, split))
                };
                if cache.fp8 {
                    // A prompt chunk's many queries in one split each write their output
                    // directly; a lone decode row merges as the batched rows do (same bits).
                    let direct = split == 1 && t > 1;
                    let part = match direct {
                        true => 0,
                        false => self.attention_partials(shape, t, split)?,
                    };
                    self.k.attention_decode_f8(
                        at,
                        qp,
                        kc,
                        vc,
                        part,
                        op,
                        ti,
                        fp,
                        h,
                        kvh,
                        d,
                        scale,
                        blocks,
                        ks,
                        split as i32,
                    )?;
                    return match direct {
                        true => Ok(()),
                        false => self.attention_merge(shape, t, part, split, out),
                    };
                }
                let part = self.attention_partials(shape, t, split)?;
                self.k.attention_decode(
                    at,
                    qp,
                    kc,
                    vc,
                    part,
                    ti,
                    fp,
                    h,
                    kvh,
                    d,
                    scale,
                    blocks,
                    ks,
                    split as i32,
                )?;
                self.attention_merge(shape, t, part, split, out)
            }
            AttentionPlan::Gather => {
                let p = self.k.planner();
                let (at, stages) = match cache.fp8 {
                    true => p.attention_gather_fp8(t, shape.kv_heads, shape.head_dim),
                    false => p.attention_gather(t, shape.kv_heads, shape.head_dim),
                };
                let keys = p.gather_keys() as i32;
                drop(p);
                let kernel = match cache.fp8 {
                    true => Launcher::attention_gather_f8,
                    false => Launcher::attention_gather,
                };
                kernel(
                    &self.k,
                    at,
                    qp,
                    kc,
                    vc,
                    op,
                    ti,
                    fp,
                    h,
                    kvh,
                    d,
                    scale,
                    blocks,
                    ks,
                    stages as i32,
                    cfg.init_blocks as i32,
                    shared_local_blocks(cfg),
                    keys,
                )
            }
            AttentionPlan::Prefill => {
                let at = self
                    .k
                    .planner()
                    .attention_prefill(t, shape.kv_heads, mode, cache.len);
                self.k
                    .attention_prefill(at, qp, kc, vc, op, ti, fp, h, kvh, d, scale, blocks, ks)
            }
            AttentionPlan::Staged { split } => {
                let at = self.k.planner().attention_staged(t, shape);
                let bsz = cfg.block_size as i32;
                if split == 1 {
                    return self.k.attention(
                        at, qp, kc, vc, op, ti, fp, h, kvh, d, scale, blocks, ks, bsz,
                    );
                }
                let part = self.attention_partials(shape, t, split)?;
                let at = crate::plan::Launch {
                    grid: (at.grid.0, at.grid.1, split as u32),
                    ..at
                };
                self.k.attention_split(
                    at,
                    qp,
                    kc,
                    vc,
                    part,
                    ti,
                    fp,
                    h,
                    kvh,
                    d,
                    scale,
                    blocks,
                    ks,
                    bsz,
                    split as i32,
                )?;
                self.attention_merge(shape, t, part, split, out)
            }
        }
    }

    /// Compresses the windows of both key tiers that `cache.len` keys complete and the tiers
    /// do not hold yet (SPEC §5.3).
    pub(crate) fn compress_new_windows(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
    ) -> BResult<()> {
        let kw = cache.kv_width;
        for (level, window, stride) in [
            (1, cfg.k1_window(), cfg.k1_stride()),
            (2, cfg.k2_window(), cfg.k2_stride()),
        ] {
            let (old, tier) = if level == 1 {
                (cache.n1, &cache.k1)
            } else {
                (cache.n2, &cache.k2)
            };
            let new = windows(cache.len, window, stride);
            if new > old {
                let at = self.k.planner().compress_keys(new - old, kw);
                let (keys, out, n) = (self.ptr(&cache.k), self.ptr(tier), (new - old) as i32);
                let (window, stride) = (window as i32, stride as i32);
                if cache.fp8 {
                    let kv_heads = (kw / cache.head_dim) as i32;
                    let d = cache.head_dim as i32;
                    self.k.compress_keys_f8(
                        at, keys, out, old as i32, n, kv_heads, d, window, stride,
                    )?;
                } else {
                    self.k
                        .compress_keys(at, keys, out, old as i32, n, kw as i32, window, stride)?;
                }
            }
            if level == 1 {
                cache.n1 = new;
            } else {
                cache.n2 = new;
            }
        }
        Ok(())
    }

    /// Whether [`CudaBackend::sparse_rows_batched`] takes these rows: at most `SEQ_ROWS`, one
    /// mode, and each row (its cache one token longer) on the path `sparse_layer` takes for one
    /// decode row (the decode selection when sparse, then `attention_decode`).
    pub(crate) fn sparse_rows_fit(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        modes: &[SparseMode],
        caches: &[&mut DevSparseCache],
    ) -> Option<SparseMode> {
        let mode = *modes.first()?;
        let p = self.k.planner();
        let one_mode = modes.iter().all(|&m| m == mode);
        let select_ok = mode == SparseMode::Dense
            || caches
                .iter()
                .all(|c| p.select(shape, cfg, 1, c.len + 1) == SelectPlan::Decode);
        let attention_ok = caches
            .iter()
            .all(|c| p.attention(shape, cfg, mode, 1, c.len + 1) == AttentionPlan::Decode);
        (caches.len() <= SEQ_ROWS
            && p.options.batched_sparse_rows
            && modes.len() == caches.len()
            && one_mode
            && select_ok
            && attention_ok)
            .then_some(mode)
    }

    /// A decode row per sequence in one launch per kernel for all rows: each row's K and V
    /// appended to its cache, then block selection (sparse) and attention as `sparse_layer`
    /// runs them for one row, each row with its own cache, position and split, so every row's
    /// result has the bits it gets alone. The caller checked [`CudaBackend::sparse_rows_fit`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sparse_rows_batched(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        caches: &mut [&mut DevSparseCache],
        out: &mut DevAct,
    ) -> BResult<()> {
        let rows = caches.len();
        let k_sel = cfg.selected_blocks();
        self.sparse_rows_batched
            .set(self.sparse_rows_batched.get() + 1);
        self.append_kv_rows(caches, cfg, (k, v), 0)?;
        let mut t = SeqRows::empty();
        for (r, cache) in caches.iter_mut().enumerate() {
            t.k[r] = self.ptr(&cache.k);
            t.v[r] = self.ptr(&cache.v);
            t.k1[r] = self.ptr(&cache.k1);
            t.k2[r] = self.ptr(&cache.k2);
            t.pos[r] = (cache.len - 1) as i32;
            t.n1[r] = cache.n1 as i32;
            t.n2[r] = cache.n2 as i32;
            t.split[r] =
                self.k
                    .planner()
                    .decode_split(mode, cache.len, k_sel, shape.kv_heads) as i32;
        }
        let max_of = |f: &dyn Fn(&DevSparseCache) -> usize| caches.iter().map(|c| f(c)).max();
        let longest = (
            max_of(&|c| c.len).unwrap_or(0),
            max_of(&|c| c.n1).unwrap_or(0),
            max_of(&|c| c.n2).unwrap_or(0),
        );
        self.sparse_rows_attend(shape, cfg, mode, q, &t, rows, longest, out)
    }

    /// The rows of one short span of a sequence as its decode rows: the span's K and V
    /// appended, the selection of a run of decode queries (sparse), then attention for each
    /// row with the position and split decoding it alone would give, so each row gets those
    /// bits. The caller checked [`CudaBackend::sparse_rows_fit`] for the cache and that the
    /// span holds at most `SEQ_ROWS` rows.
    #[allow(clippy::too_many_arguments)]
    fn sparse_span_rows(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        cache: &mut DevSparseCache,
        out: &mut DevAct,
    ) -> BResult<()> {
        let rows = q.rows;
        let first = self.append_kv(cache, cfg, (k, v), 0, rows)?;
        let k_sel = cfg.selected_blocks();
        let mut t = SeqRows::empty();
        for r in 0..rows {
            let len = first + r + 1;
            t.k[r] = self.ptr(&cache.k);
            t.v[r] = self.ptr(&cache.v);
            t.k1[r] = self.ptr(&cache.k1);
            t.k2[r] = self.ptr(&cache.k2);
            t.pos[r] = (first + r) as i32;
            t.n1[r] = windows(len, cfg.k1_window(), cfg.k1_stride()).min(cache.n1) as i32;
            t.n2[r] = windows(len, cfg.k2_window(), cfg.k2_stride()).min(cache.n2) as i32;
            t.split[r] = self
                .k
                .planner()
                .decode_split(mode, len, k_sel, shape.kv_heads) as i32;
        }
        // Selection as for a run of decode queries of one sequence (what one row alone gets).
        let blocks = match mode {
            SparseMode::Dense => 0,
            SparseMode::Sparse => {
                let blocks = self.scratch_ptr(|s| &mut s.blocks, rows * shape.kv_heads * k_sel)?;
                self.select_blocks(shape, cfg, q, cache, first, blocks)?;
                blocks
            }
        };
        self.decode_rows_attend(shape, cfg, q, &t, rows, blocks, out)
    }

    /// Selection (sparse) and attention of `rows` decode rows described by `t` (`longest`:
    /// the largest length and compressed-key counts among them).
    #[allow(clippy::too_many_arguments)]
    fn sparse_rows_attend(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        t: &SeqRows,
        rows: usize,
        longest: (usize, usize, usize),
        out: &mut DevAct,
    ) -> BResult<()> {
        let k_sel = cfg.selected_blocks();
        let pairs = rows * shape.kv_heads;
        let blocks = match mode {
            SparseMode::Dense => 0,
            SparseMode::Sparse => {
                let blocks = self.scratch_ptr(|s| &mut s.blocks, pairs * k_sel)?;
                let queries = DecodeQueries::Rows {
                    seqs: t,
                    rows,
                    longest,
                };
                self.select_decode(shape, cfg, q, queries, blocks)?;
                blocks
            }
        };
        self.decode_rows_attend(shape, cfg, q, t, rows, blocks, out)
    }

    /// Attention of `rows` decode rows described by `t` (`blocks`: their selections, 0 when
    /// dense), each row split its own way.
    #[allow(clippy::too_many_arguments)]
    fn decode_rows_attend(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        t: &SeqRows,
        rows: usize,
        blocks: u64,
        out: &mut DevAct,
    ) -> BResult<()> {
        let k_sel = cfg.selected_blocks();
        let pairs = rows * shape.kv_heads;
        let split = t.split[..rows].iter().copied().max().unwrap_or(1).max(1) as usize;
        let part = self.attention_partials(shape, rows, split)?;
        let at = self.k.planner().attention_decode(pairs, split);
        let kernel = match cfg.kv_cache {
            KvCacheDtype::Fp8 => Launcher::attention_decode_rows_f8,
            KvCacheDtype::Bf16 => Launcher::attention_decode_rows,
        };
        kernel(
            &self.k,
            at,
            self.act_ptr(q),
            t,
            part,
            rows as i32,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale() as f32,
            blocks,
            k_sel as i32,
            split as i32,
        )?;
        self.attention_merge(shape, rows, part, split, out)
    }

    /// Scratch for the partial attention states (output and its max and sum) of `t` queries
    /// split `split` ways, which `attention_merge` combines.
    fn attention_partials(&self, shape: AttnShape, t: usize, split: usize) -> BResult<u64> {
        self.scratch_ptr(
            |s| &mut s.attn_part,
            split * t * shape.heads * (shape.head_dim + 2),
        )
    }

    /// Combines the `split` partial attention states at `part` of `t` queries into `out`.
    fn attention_merge(
        &self,
        shape: AttnShape,
        t: usize,
        part: u64,
        split: usize,
        out: &mut DevAct,
    ) -> BResult<()> {
        let at = self
            .k
            .planner()
            .attention_merge(t, shape.heads, shape.head_dim);
        self.k.attention_merge(
            at,
            part,
            self.act_ptr(out),
            t as i32,
            shape.heads as i32,
            shape.head_dim as i32,
            split as i32,
        )
    }
}

/// `attention_gather`'s `local_blocks`: the local window's blocks, whose queries' lists all hold
/// them and the first `init_blocks` (SPEC §5.5) where a list has room for every forced block;
/// else −1, and the kernel shares no block between queries.
fn shared_local_blocks(cfg: &SparseConfig) -> i32 {
    if cfg.selected_blocks() > cfg.init_blocks + cfg.local_blocks() {
        cfg.local_blocks() as i32
    } else {
        -1
    }
}
