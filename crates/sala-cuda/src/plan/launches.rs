//! The launches of every plan, enumerated: for each model shape `sala` runs, what
//! `scripts/check-kernels.sh` checks against each card's limits ([`Planner::check_launches`]),
//! and the plans in words (`sala inspect`).

use super::*;

impl Planner {
    /// Every launch the plans make for the shapes `sala` runs (the released model, the test
    /// presets, contexts up to 4M tokens, decode to long prefill chunks): what
    /// `scripts/check-kernels.sh` checks against each card's limits.
    pub fn check_launches(&self, shapes: &[CheckShape]) -> Vec<(K, Launch, String)> {
        let mut out = Vec::new();
        let mut add = |k: K, l: Launch, what: &str| out.push((k, l, what.to_string()));
        for s in shapes {
            let (a, cfg, lh, ld) = (s.attn, &s.sparse, s.lightning_heads, s.lightning_d);
            for &rows in &[1usize, 8, 64, 256, 8192] {
                let r = format!("{} rows", rows);
                match self.lightning(rows, ld) {
                    LightningPlan::Decode => {
                        add(K::LightningDecodeRows, self.lightning_decode(lh, ld, 1), &r)
                    }
                    LightningPlan::Ranges { buffers } => {
                        let (n, _) = self.lightning_range_split(rows, lh, ld);
                        add(
                            K::LightningRanges,
                            self.lightning_ranges(lh, ld, n, buffers),
                            &r,
                        );
                        if n > 1 {
                            let l = self.lightning_range_sums(lh, ld, n - 1, buffers);
                            add(K::LightningRangeSums, l, &r);
                        }
                    }
                    LightningPlan::Split => {
                        let c = rows.div_ceil(LIGHTNING_CHUNK);
                        add(
                            K::LightningChunkState,
                            self.lightning_chunk_state(c, lh),
                            &r,
                        );
                        add(K::LightningChunkOut, self.lightning_chunk_out(c, lh), &r);
                    }
                    LightningPlan::Chunked => {
                        add(K::LightningChunked, self.lightning_chunked(lh, ld), &r)
                    }
                }
                if rows > 1 && rows <= DECODE_ROWS {
                    let (kernel, at) = self.lightning_decode_rows(lh, ld, rows);
                    add(kernel, at, &r);
                }
                // A span of this many rows of one sequence, stepped token by token.
                if rows > 1 && rows <= sala_model::STEPWISE_SPAN_ROWS {
                    add(K::LightningSpanRows, self.lightning_decode(lh, ld, 1), &r);
                }
                for &len in &[100usize, 8 << 10, 128 << 10, 1 << 20, 4 << 20] {
                    let len = len.max(rows);
                    let what = format!("{rows} rows at {len} tokens");
                    let pairs = rows * a.kv_heads;
                    match self.select(a, cfg, rows, len) {
                        SelectPlan::Scores(k) => {
                            let n = self.select_group(k, a.kv_heads, len, rows, cfg);
                            add(k, self.select_scores(k, n, a.kv_heads), &what);
                            let p = self.topk_scores(n * a.kv_heads, len, cfg);
                            add(p.kernel, p.launch, &what);
                        }
                        SelectPlan::Decode => {
                            let n1 = windows(len, cfg.k1_window(), cfg.k1_stride());
                            let n2 = windows(len, cfg.k2_window(), cfg.k2_stride());
                            add(K::SdLse, self.sd_lse(pairs, n2), &what);
                            add(K::SdP, self.sd_p(pairs, n1), &what);
                            let ps = self.sd_p_stride(n1, len, cfg);
                            add(
                                K::SdTopk,
                                self.sd_topk(false, pairs, len, ps, cfg).launch,
                                &what,
                            );
                            if rows <= SEQ_ROWS {
                                add(K::SdLseRows, self.sd_lse(pairs, n2), &what);
                                add(K::SdPRows, self.sd_p(pairs, n1), &what);
                                let p = self.sd_topk(true, pairs, len, ps, cfg);
                                add(p.kernel, p.launch, &what);
                            }
                        }
                        SelectPlan::Exact => {}
                    }
                    let smem = self.exact_select_smem(a);
                    add(
                        K::SparseSelect,
                        Launch::new((pairs, 1, 1), 256, smem),
                        &what,
                    );
                    add(
                        K::SelectLse,
                        Launch::new((pairs, a.group(), 1), 256, (a.head_dim + 3) * 4),
                        &what,
                    );
                    add(
                        K::SelectScores,
                        Launch::new((pairs, 1, 1), 256, smem),
                        &what,
                    );
                    for mode in [SparseMode::Sparse, SparseMode::Dense] {
                        match self.attention(a, cfg, mode, rows, len) {
                            AttentionPlan::Decode => {
                                let split =
                                    self.decode_split(mode, len, cfg.selected_blocks(), pairs);
                                add(
                                    K::AttentionDecode,
                                    self.attention_decode(pairs, split),
                                    &what,
                                );
                                add(
                                    K::AttentionDecodeRows,
                                    self.attention_decode(pairs, split),
                                    &what,
                                );
                                add(
                                    K::AttentionDecodeF8,
                                    self.attention_decode(pairs, split),
                                    &what,
                                );
                                add(
                                    K::AttentionDecodeRowsF8,
                                    self.attention_decode(pairs, split),
                                    &what,
                                );
                            }
                            AttentionPlan::Gather => {
                                add(
                                    K::AttentionGather,
                                    self.attention_gather(rows, a.kv_heads, a.head_dim).0,
                                    &what,
                                );
                                add(
                                    K::AttentionGatherF8,
                                    self.attention_gather_fp8(rows, a.kv_heads, a.head_dim).0,
                                    &what,
                                );
                            }
                            AttentionPlan::Prefill => add(
                                K::AttentionPrefill,
                                self.attention_prefill(rows, a.kv_heads, mode, len),
                                &what,
                            ),
                            AttentionPlan::Staged { split } => {
                                let l = self.attention_staged(rows, a);
                                add(K::Attention, l, &what);
                                add(
                                    K::AttentionSplit,
                                    Launch {
                                        grid: (l.grid.0, l.grid.1, split as u32),
                                        ..l
                                    },
                                    &what,
                                );
                            }
                        }
                    }
                }
            }
            for &(heads, d) in &[(a.heads, a.head_dim), (lh, ld)] {
                let (k, l) = self.head_norm_rope(heads, d);
                add(k, l, "per-head norm and RoPE");
                add(
                    K::AttentionMerge,
                    self.attention_merge(1, heads, d),
                    "merge",
                );
            }
        }
        for s in shapes {
            let (lh, ld) = (s.lightning_heads, s.lightning_d);
            let l = self.lightning_state_term(8192, lh, ld);
            add(K::LightningStateTerm, l, "context-parallel start states");
        }
        // The kernels whose geometry does not depend on the shape's limits.
        for (k, block) in FIXED_BLOCKS {
            add(*k, Launch::new((1, 1, 1), *block, 0), "fixed geometry");
        }
        // The fallback kernels that only options select, at the released shape.
        let released = &shapes[0];
        let (lh, ld) = (released.lightning_heads, released.lightning_d);
        add(
            K::LightningChunked,
            self.lightning_chunked(lh, ld),
            "fp32 lightning",
        );
        add(
            K::LightningChunkState,
            self.lightning_chunk_state(128, lh),
            "split lightning",
        );
        add(
            K::LightningChunkOut,
            self.lightning_chunk_out(128, lh),
            "split lightning",
        );
        // The widest row a normed product takes (its normed row in shared memory).
        add(
            K::GemvSiluW4x8Norm,
            self.gemv_w4_norm(2 * self.limits.sms as usize, NORM_PRODUCT_MAX_K),
            "norm + 4-bit SiLU product",
        );
        for k in [K::SelectScoresMma, K::SelectScoresT] {
            add(
                k,
                self.select_scores(k, 8192, released.attn.kv_heads),
                "block scores",
            );
        }
        out
    }
}

impl Planner {
    /// One launch in words: kernel, grid, block, shared memory (static + dynamic) and how many
    /// blocks fit an SM.
    pub fn describe_launch(&self, k: K, l: Launch) -> String {
        let a = self.attrs(k);
        let smem = a.static_smem + l.smem as usize;
        let kib = |b: usize| format!("{:.1} KiB", b as f64 / 1024.0);
        format!(
            "{} grid {}x{}x{}, {} threads, {} shared ({} static), {}/SM",
            k.name(),
            l.grid.0,
            l.grid.1,
            l.grid.2,
            l.block,
            kib(smem),
            kib(a.static_smem),
            self.limits.blocks_per_sm(l.block, a.regs, smem)
        )
    }

    /// The plan of each kernel family for a model shape, in words (`sala inspect`).
    pub fn describe(&self, s: &CheckShape) -> Vec<(String, String)> {
        let (a, cfg, lh, ld) = (s.attn, &s.sparse, s.lightning_heads, s.lightning_d);
        let mut out = Vec::new();
        for rows in [8192usize, 100, 1] {
            let text = match self.lightning(rows, ld) {
                LightningPlan::Decode => {
                    self.describe_launch(K::LightningDecodeRows, self.lightning_decode(lh, ld, 1))
                }
                LightningPlan::Ranges { buffers } => format!(
                    "ranges in parallel, {buffers} buffer(s): {}",
                    self.describe_launch(
                        K::LightningRanges,
                        self.lightning_ranges(
                            lh,
                            ld,
                            self.lightning_range_split(rows, lh, ld).0,
                            buffers
                        )
                    )
                ),
                LightningPlan::Split => {
                    let c = rows.div_ceil(LIGHTNING_CHUNK);
                    format!(
                        "three kernels: {}; ...",
                        self.describe_launch(
                            K::LightningChunkState,
                            self.lightning_chunk_state(c, lh)
                        )
                    )
                }
                LightningPlan::Chunked => format!(
                    "fp32: {}",
                    self.describe_launch(K::LightningChunked, self.lightning_chunked(lh, ld))
                ),
            };
            out.push((format!("lightning, {rows} rows"), text));
        }
        for (rows, len) in [
            (8192usize, 128usize << 10),
            (8192, 1 << 20),
            (1, 128 << 10),
            (1, 1 << 20),
        ] {
            let label = |what: &str| format!("{what}, {rows} rows at {}K", len >> 10);
            let text = match self.select(a, cfg, rows, len) {
                SelectPlan::Scores(k) => {
                    let n = self.select_group(k, a.kv_heads, len, rows, cfg);
                    let p = self.topk_scores(n * a.kv_heads, len, cfg);
                    format!(
                        "{}; {} (keys in {} memory)",
                        self.describe_launch(k, self.select_scores(k, n, a.kv_heads)),
                        self.describe_launch(p.kernel, p.launch),
                        if p.keys_in_global { "global" } else { "shared" }
                    )
                }
                SelectPlan::Decode => {
                    let n1 = windows(len, cfg.k1_window(), cfg.k1_stride());
                    let p = self.sd_topk(
                        false,
                        rows * a.kv_heads,
                        len,
                        self.sd_p_stride(n1, len, cfg),
                        cfg,
                    );
                    format!(
                        "sd_lse, sd_p, {} (keys in {} memory, P {})",
                        self.describe_launch(K::SdTopk, p.launch),
                        if p.keys_in_global { "global" } else { "shared" },
                        if p.stage_p {
                            "staged in shared memory"
                        } else {
                            "read from global memory"
                        }
                    )
                }
                SelectPlan::Exact => "bit-exact CUDA-core kernels".to_string(),
            };
            out.push((label("block selection"), text));
            let text = match self.attention(a, cfg, SparseMode::Sparse, rows, len) {
                AttentionPlan::Decode => {
                    let pairs = rows * a.kv_heads;
                    let split =
                        self.decode_split(SparseMode::Sparse, len, cfg.selected_blocks(), pairs);
                    format!(
                        "{}, {split} splits",
                        self.describe_launch(
                            K::AttentionDecode,
                            self.attention_decode(pairs, split)
                        )
                    )
                }
                AttentionPlan::Gather => {
                    let (launch, stages) = self.attention_gather(rows, a.kv_heads, a.head_dim);
                    format!(
                        "{}, {stages} stages a warp",
                        self.describe_launch(K::AttentionGather, launch)
                    )
                }
                AttentionPlan::Prefill => self.describe_launch(
                    K::AttentionPrefill,
                    self.attention_prefill(rows, a.kv_heads, SparseMode::Sparse, len),
                ),
                AttentionPlan::Staged { split } => format!(
                    "{}, {split} splits",
                    self.describe_launch(K::Attention, self.attention_staged(rows, a))
                ),
            };
            out.push((label("sparse attention"), text));
        }
        out
    }
}

/// Kernels launched with a block size fixed by the kernel (no shared memory beyond static).
const FIXED_BLOCKS: &[(K, u32)] = &[
    (K::Embed, 256),
    (K::RmsNorm, 512),
    (K::RowSumsSq, 512),
    (K::AddRmsNorm, 512),
    (K::SiluMul, 256),
    (K::AddScaled, 256),
    (K::SigmoidGate, 256),
    (K::ScaleRound, 256),
    (K::GreedyParts, 256),
    (K::GreedyRows, 32),
    (K::FillRandom, 256),
    (K::LightningStateAdvance, 256),
    (K::RopeTable, 256),
    (K::RopeTableRows, 256),
    (K::SiluMulHalves, 256),
    (K::SiluMulHalves8, 256),
    (K::Gemv, 128),
    (K::GemvNarrow, 128),
    (K::GemvSilu, 128),
    (K::GemvW4x8, GEMV_MMA_THREADS),
    (K::GemvW4x16, GEMV_MMA_THREADS),
    (K::GemvSiluW4x8, GEMV_MMA_THREADS),
    (K::GemvSiluW4x16, GEMV_MMA_THREADS),
    (K::DequantW4, 256),
    (K::QuantRowsF8, 256),
    (K::GemvF8x8, GEMV_MMA_THREADS),
    (K::GemvF8x16, GEMV_MMA_THREADS),
    (K::GemvF8Bf16x8, GEMV_MMA_THREADS),
    (K::GemvSiluF8x8, GEMV_MMA_THREADS),
    (K::GemvSiluF8x16, GEMV_MMA_THREADS),
    (K::ScaleRowsCols, 256),
    (K::DequantF8, 256),
    (K::GemvMma8, GEMV_MMA_THREADS),
    (K::GemvMma16, GEMV_MMA_THREADS),
    (K::GemvSiluMma8, GEMV_MMA_THREADS),
    (K::GemvSiluMma16, GEMV_MMA_THREADS),
    (K::GemvRows64, GEMV_ROWS64_THREADS),
    (K::GemvSiluRows64, GEMV_ROWS64_THREADS),
    (K::GemvRows64Parts, GEMV_ROWS64_THREADS),
    (K::GemvSiluRows64Parts, GEMV_ROWS64_THREADS),
    (K::GemvChainSums, 256),
    (K::CompressKeys, 256),
    (K::CompressKeysF8, 256),
    (K::KvStoreF8, 128),
    (K::LightningRangeStates, 256),
    (K::LightningChunkScan, 256),
    (K::SelectTopk, 256),
    (K::SelectTopkScores, 256),
];

/// A model shape for [`Planner::check_launches`].
#[derive(Debug, Clone)]
pub struct CheckShape {
    pub attn: AttnShape,
    pub sparse: SparseConfig,
    pub lightning_heads: usize,
    pub lightning_d: usize,
}
