//! Several GPUs (tensor and context parallelism), the parts that need none: how tensor
//! parallelism splits each layer's weights among ranks, and how context parallelism splits a
//! prompt into ranges and carries the lightning states across them (a scan); the sparse
//! layers' attention under context parallelism, with the exchanges it needs (compressed
//! windows gathered, selected blocks fetched). Checked
//! here against one device's results with simulated ranks; the ranks' communication (NCCL)
//! builds on these.

use crate::oracle::{self, AttnShape, SparseMode};
use sala_checkpoint::{expected_tensors, MixerKind, ModelConfig, SparseConfig, TensorSpec};
use std::ops::Range;

/// A weight's part on one rank: rows `rows` (output features) and columns `cols` (input
/// features) of the whole `[out, in]` matrix, or of a vector's entries (`cols` `0..1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub name: &'static str,
    pub rows: Range<usize>,
    pub cols: Range<usize>,
    /// Where the rank holds columns it shares with other ranks but counts only some of them
    /// (the sparse layers' o_proj past their KV heads): those it counts; the others are held
    /// as zeros.
    pub own_cols: Option<Range<usize>>,
}

impl Shard {
    /// Whether the weight is split by its inputs (o_proj, down_proj): each rank's product is
    /// a partial sum of the whole output. The others are split by outputs, or are vectors.
    pub fn splits_inputs(&self) -> bool {
        matches!(self.name, "o_proj" | "down_proj")
    }

    /// The group size of this part of a 4-bit weight stored in groups of `group` inputs:
    /// the largest that divides the group, the part's first column and width, and its own
    /// columns' bounds, so each of the part's groups lies within one of the whole weight's
    /// (its scale and zero repeated) and wholly inside or outside the columns it counts.
    pub fn quant_group(&self, group: usize) -> usize {
        let mut g = group;
        let mut bounds = vec![self.cols.start, self.cols.len()];
        if let Some(own) = &self.own_cols {
            bounds.extend([own.start, own.end]);
        }
        for b in bounds {
            g = gcd(g, b);
        }
        g
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Tensor parallelism over `ranks` ranks. Lightning layers split by heads (their q, k, v, z
/// rows, o_proj's columns, o_norm's entries: o_norm is one RMSNorm over all heads, so the
/// ranks add their rows' sums of squares before it); the MLP by the intermediate dimension
/// (gate and up rows, down's columns); sparse layers by query heads, each rank holding the KV
/// head its query heads read (the released model has 2: past 2 ranks they are replicated,
/// and each rank scores and attends its KV head's whole group: [`TensorParallel::
/// sparse_group`]). Input-split products' outputs (o_proj, down) are summed across ranks.
/// Embeddings, norms and lm_head are held whole by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    pub ranks: usize,
}

impl TensorParallel {
    /// Tensor parallelism over `ranks` ranks for `config`: an error naming what does not
    /// divide.
    pub fn new(config: &ModelConfig, ranks: usize) -> Result<Self, String> {
        let heads = config.num_attention_heads;
        let checks = [
            ("attention heads (num_attention_heads)", heads),
            ("lightning KV heads (lightning_nkv)", config.lightning_nkv),
            ("MLP width (intermediate_size)", config.intermediate_size),
        ];
        if ranks == 0 {
            return Err("tensor parallelism needs at least 1 rank".into());
        }
        for (what, n) in checks {
            if !n.is_multiple_of(ranks) {
                return Err(format!(
                    "tensor parallel {ranks}: {n} {what} do not split into {ranks}"
                ));
            }
        }
        let kv = config.num_key_value_heads;
        if !kv.is_multiple_of(ranks) && !ranks.is_multiple_of(kv) {
            return Err(format!(
                "tensor parallel {ranks}: the sparse layers' {kv} KV heads neither split into {ranks} ranks nor replicate across them"
            ));
        }
        Ok(Self { ranks })
    }

    /// The shape of one rank's part of the model: its heads, KV heads and MLP width (what its
    /// caches, states and workspace hold). Past the sparse layers' KV heads a rank holds one.
    pub fn rank_config(&self, config: &ModelConfig) -> ModelConfig {
        let mut c = config.clone();
        c.num_attention_heads /= self.ranks;
        c.num_key_value_heads /= self.sparse_ways(config);
        c.lightning_nkv /= self.ranks;
        c.intermediate_size /= self.ranks;
        c
    }

    /// Rank `rank`'s query heads and KV heads in a sparse layer: an even share of the query
    /// heads, and the KV heads they read (one KV head on several ranks past `kv_heads`).
    pub fn sparse_heads(&self, config: &ModelConfig, rank: usize) -> (Range<usize>, Range<usize>) {
        let (heads, kv) = (config.num_attention_heads, config.num_key_value_heads);
        let q = part(heads, self.ranks, rank);
        let group = heads / kv;
        (q.clone(), q.start / group..q.end.div_ceil(group))
    }

    /// Rank `rank`'s parts of layer `layer`'s weights.
    pub fn shards(&self, config: &ModelConfig, layer: usize, rank: usize) -> Vec<Shard> {
        let (hidden, d) = (config.hidden_size, config.head_dim);
        let inter = part(config.intermediate_size, self.ranks, rank);
        let all = 0..hidden;
        let feat = |h: Range<usize>| h.start * d..h.end * d;
        let rows = |name, rows| Shard {
            name,
            rows,
            cols: all.clone(),
            own_cols: None,
        };
        let cols = |name, cols| Shard {
            name,
            rows: all.clone(),
            cols,
            own_cols: None,
        };
        let mut out = Vec::new();
        match config.mixer_types[layer] {
            MixerKind::Lightning => {
                let q = feat(part(config.num_attention_heads, self.ranks, rank));
                let kv = feat(part(config.lightning_nkv, self.ranks, rank));
                out.push(rows("q_proj", q.clone()));
                out.push(rows("k_proj", kv.clone()));
                out.push(rows("v_proj", kv));
                out.push(rows("z_proj", q.clone()));
                out.push(cols("o_proj", q.clone()));
                out.push(Shard {
                    name: "o_norm",
                    rows: q,
                    cols: 0..1,
                    own_cols: None,
                });
            }
            MixerKind::Sparse => {
                // The query heads of the rank's KV heads: its own, or past the KV heads
                // the whole group, which it scores and attends whole (see `sparse_group`).
                let (qh, kvh) = self.sparse_heads(config, rank);
                let gh = self.sparse_group(config, rank);
                out.push(rows("q_proj", feat(gh.clone())));
                out.push(rows("k_proj", feat(kvh.clone())));
                out.push(rows("v_proj", feat(kvh)));
                out.push(rows("o_gate", feat(gh.clone())));
                out.push(Shard {
                    own_cols: (gh != qh).then(|| feat(qh)),
                    ..cols("o_proj", feat(gh))
                });
            }
        }
        out.push(rows("gate_proj", inter.clone()));
        out.push(rows("up_proj", inter.clone()));
        out.push(Shard {
            name: "down_proj",
            rows: all,
            cols: inter,
            own_cols: None,
        });
        out
    }

    /// Rank `rank`'s part of tensor `name` of the model, or `None` for a tensor every rank
    /// holds whole (embeddings, lm_head, norms but the lightning output norm, q/k norms).
    pub fn shard_of(&self, config: &ModelConfig, name: &str, rank: usize) -> Option<Shard> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        if layer >= config.num_hidden_layers {
            return None;
        }
        let module = rest.strip_suffix(".weight")?.rsplit('.').next()?;
        self.shards(config, layer, rank)
            .into_iter()
            .find(|s| s.name == module)
    }

    /// The model's tensors as rank `rank` holds them: each split one of its part's shape.
    pub fn rank_tensors(&self, config: &ModelConfig, rank: usize) -> Vec<TensorSpec> {
        let mut specs = expected_tensors(config);
        for spec in &mut specs {
            if let Some(s) = self.shard_of(config, &spec.name, rank) {
                spec.shape = match spec.shape.len() {
                    1 => vec![s.rows.len()],
                    _ => vec![s.rows.len(), s.cols.len()],
                };
            }
        }
        specs
    }

    /// The ways each sparse layer is split: among the ranks, at most its KV heads' count
    /// (past it a KV head's group is whole on each of the ranks sharing it).
    pub fn sparse_ways(&self, config: &ModelConfig) -> usize {
        self.ranks.min(config.num_key_value_heads)
    }

    /// The ways workspace buffer `name` ([`crate::memory::workspace_columns`]) is split: the
    /// residual stream and its norms not at all; the attention buffers as the sparse layers
    /// are (at most their KV heads' count: past it a rank's part also serves a whole KV
    /// group); the others among every rank.
    pub fn buffer_ways(&self, config: &ModelConfig, name: &str) -> usize {
        match name {
            "h" | "a" | "branch" => 1,
            "q" | "o" | "z" | "ks" | "vs" => self.sparse_ways(config),
            _ => self.ranks,
        }
    }

    /// The query heads of rank `rank`'s KV heads in a sparse layer: its own heads while the
    /// ranks are at most the KV heads; past them, the whole group of the KV head it shares
    /// with other ranks. Such a rank projects, scores and attends the whole group (block
    /// selection sums its scores over every head of the group, SPEC §5.4) and counts its own
    /// heads' outputs only (its o_proj part is zero in the others' columns). Adding the
    /// group's stage-1 scores across its ranks instead would move a score a query and
    /// compressed key each layer (gigabytes a prefill chunk at long contexts) to save
    /// attention work that decode barely has.
    pub fn sparse_group(&self, config: &ModelConfig, rank: usize) -> Range<usize> {
        let (_, kv) = self.sparse_heads(config, rank);
        let group = config.num_attention_heads / config.num_key_value_heads;
        kv.start * group..kv.end * group
    }
}

/// Part `rank` of `n` things split evenly among `ranks` (which divides `n`).
fn part(n: usize, ranks: usize, rank: usize) -> Range<usize> {
    let each = n / ranks;
    rank * each..(rank + 1) * each
}

/// Context parallelism's ranges: `len` prompt tokens in `ranks` contiguous ranges, each but
/// the last a multiple of `align` tokens (the sparse block size, so compressed windows and
/// blocks never straddle two ranks' first tokens), as even as that allows. Fewer ranges than
/// `ranks` where the prompt has fewer blocks.
pub fn context_ranges(len: usize, ranks: usize, align: usize) -> Vec<Range<usize>> {
    balanced_context_ranges(len, ranks, align, 0.0)
}

/// [`context_ranges`] of equal modeled work where a share `position_share` of the whole
/// prompt's work grows with the position (a token at position p costs (1 − s) + 2·s·p / len
/// in units of the mean): later ranges are shorter, each range's work the same to within a
/// block's. Every range holds at least one block.
pub fn balanced_context_ranges(
    len: usize,
    ranks: usize,
    align: usize,
    position_share: f64,
) -> Vec<Range<usize>> {
    let align = align.max(1);
    let blocks = len.div_ceil(align);
    let ranks = ranks.clamp(1, blocks.max(1));
    let s = position_share.clamp(0.0, 1.0);
    // Blocks before rank r + 1: where the work done so far, (1 − s)·u + s·u² of the prompt's
    // fraction u, reaches (r + 1) / ranks; an even share, rounded down, without a position share.
    let before = |r: usize| -> usize {
        if s == 0.0 {
            return (r + 1) * blocks / ranks;
        }
        let w = (r + 1) as f64 / ranks as f64;
        let u = (-(1.0 - s) + ((1.0 - s).powi(2) + 4.0 * s * w).sqrt()) / (2.0 * s);
        ((u * blocks as f64).round() as usize).min(blocks)
    };
    let mut out = Vec::with_capacity(ranks);
    let mut start = 0;
    for r in 0..ranks {
        // At least a block each, and a block left for each rank after.
        let end_block = before(r)
            .max(start / align + 1)
            .min(blocks - (ranks - 1 - r));
        let end = if r + 1 == ranks {
            len
        } else {
            (end_block * align).min(len)
        };
        if end > start {
            out.push(start..end);
            start = end;
        }
    }
    out
}

/// Context parallelism's compressed keys of one rank (`range` of the prompt's tokens):
/// the windows (of `window` keys every `stride`) whose last key is in its range, the ones
/// its tokens are the first to see, and the keys it needs from the ranks before it to make
/// them (the halo before `range.start`). Each window is made by exactly one rank.
pub fn rank_windows(
    range: &Range<usize>,
    window: usize,
    stride: usize,
) -> (Range<usize>, Range<usize>) {
    // Window i ends at key stride·i + window − 1: the first ending at or past range.start.
    let first_end = |at: usize| (at + 1).saturating_sub(window).div_ceil(stride);
    let windows = first_end(range.start)..first_end(range.end);
    let halo = (windows.start * stride).min(range.start)..range.start;
    (windows, halo)
}

/// The lightning scan across context-parallel ranks: from the state before the prompt
/// (`init`, zero when `None`) and each rank's `(tokens, local end state)` in order (its
/// range's final state when started from zero, `[heads, d, d]`), the state each rank starts
/// from and the state after the last: `S_0 = init`, `S_{r+1} = γ^{n_r} S_r + L_r` per head
/// (γ = exp(-slope), SPEC §4.2).
pub fn lightning_scan(
    slopes: &[f32],
    d: usize,
    init: Option<&[f32]>,
    parts: &[(usize, &[f32])],
) -> Vec<Vec<f32>> {
    let size = slopes.len() * d * d;
    let mut s = init.map_or_else(|| vec![0.0; size], <[f32]>::to_vec);
    let mut out = Vec::with_capacity(parts.len() + 1);
    for &(n, local) in parts {
        out.push(s.clone());
        for (h, &slope) in slopes.iter().enumerate() {
            let decay = (-(slope as f64) * n as f64).exp();
            for (x, &l) in s[h * d * d..][..d * d].iter_mut().zip(&local[h * d * d..]) {
                *x = (decay * *x as f64 + l as f64) as f32;
            }
        }
    }
    out.push(s);
    out
}

/// A rank's lightning outputs, computed from a zero state, made those of its true start
/// state `s_in`: `o_t += scale·γ^{t+1} q_t S_in` (t counted from the rank's first token;
/// SPEC §4.2's inter-chunk term). `q` and `out` are `[tokens, heads·d]`.
pub fn lightning_correct(
    shape: AttnShape,
    slopes: &[f32],
    q: &[f32],
    s_in: &[f32],
    out: &mut [f32],
) {
    let (heads, d) = (shape.heads, shape.head_dim);
    let width = shape.q_width();
    let scale = shape.scale();
    for (t, (qt, ot)) in q.chunks(width).zip(out.chunks_mut(width)).enumerate() {
        for h in 0..heads {
            let decay = (-(slopes[h] as f64) * (t + 1) as f64).exp();
            let s = &s_in[h * d * d..][..d * d];
            for e in 0..d {
                let dot: f64 = (0..d)
                    .map(|a| qt[h * d + a] as f64 * s[a * d + e] as f64)
                    .sum();
                ot[h * d + e] = (ot[h * d + e] as f64 + scale * decay * dot) as f32;
            }
        }
    }
}

/// What one rank of a context-parallel sparse layer read beyond its own range: the keys of
/// its compressed windows' halo, and the K/V blocks (of `block_size` tokens) its queries
/// selected in the ranks before it, each fetched once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankReads {
    pub halo_keys: usize,
    pub fetched_blocks: Vec<usize>,
}

/// Context-parallel sparse attention (SPEC §5.2–5.6) of one prompt split into `ranges` (from
/// [`context_ranges`]), simulated: each rank holds its range's K/V rows and queries; it makes
/// the compressed windows whose last key is in its range from its keys and halo
/// ([`rank_windows`]), the ranks gather every rank's windows (each made once), and each
/// query selects among them as one device would; a rank fetches, once, each selected block
/// that lies in an earlier rank's range, and attends. `kv` holds every K and V row of the
/// prompt (a rank reads only its own, its halo and its fetched blocks of them). Returns the
/// outputs `[len, H·d]` and each rank's reads.
pub fn context_sparse_attention(
    ranges: &[Range<usize>],
    shape: AttnShape,
    cfg: &SparseConfig,
    mode: SparseMode,
    q: &[f32],
    (keys, values): (&[f32], &[f32]),
) -> (Vec<f32>, Vec<RankReads>) {
    let kw = shape.kv_width();
    let levels = [
        (cfg.k1_window(), cfg.k1_stride()),
        (cfg.k2_window(), cfg.k2_stride()),
    ];
    // Each rank's windows of both levels, made from its halo and its own keys; gathered in
    // rank order.
    let mut reads = vec![RankReads::default(); ranges.len()];
    let mut gathered = [Vec::new(), Vec::new()];
    for (range, rank) in ranges.iter().zip(reads.iter_mut()) {
        for ((window, stride), all) in levels.iter().zip(gathered.iter_mut()) {
            let (windows, halo) = rank_windows(range, *window, *stride);
            rank.halo_keys = rank.halo_keys.max(halo.len());
            if windows.is_empty() {
                continue;
            }
            let from = windows.start * stride;
            let to = (windows.end - 1) * stride + window;
            debug_assert!(
                from >= halo.start && to <= range.end,
                "a window outside its keys"
            );
            all.extend(oracle::compress_keys(
                &keys[from * kw..to * kw],
                kw,
                *window,
                *stride,
            ));
        }
    }
    let [k1, k2] = gathered;
    let len = ranges.last().map_or(0, |r| r.end);
    let mut out = Vec::with_capacity(len * shape.q_width());
    for (range, rank) in ranges.iter().zip(reads.iter_mut()) {
        let mut fetched = std::collections::BTreeSet::new();
        for t in range.clone() {
            let q_row = &q[t * shape.q_width()..][..shape.q_width()];
            let sel: Vec<Vec<usize>> = match mode {
                SparseMode::Dense => vec![(0..=t).collect(); shape.kv_heads],
                SparseMode::Sparse => {
                    // The windows visible at t are a prefix of the gathered ones.
                    let p = oracle::stage1_scores(shape, cfg, q_row, t, &k1, &k2);
                    p.iter()
                        .map(|pg| oracle::selected_keys(cfg, pg, t))
                        .collect()
                }
            };
            for &j in sel.iter().flatten() {
                if j < range.start {
                    fetched.insert(j / cfg.block_size);
                }
            }
            out.extend(oracle::attend_heads(
                shape,
                q_row,
                keys,
                values,
                &sel,
                0..shape.heads,
            ));
        }
        rank.fetched_blocks = fetched.into_iter().collect();
    }
    (out, reads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::TestRng;
    use crate::oracle;

    #[test]
    fn tensor_parallel_splits_every_weight_and_sparse_heads_read_their_kv() {
        let config = sala_checkpoint::preset("minicpm-sala-9b").unwrap();
        for ranks in [1usize, 2, 4, 8] {
            let tp = TensorParallel::new(&config, ranks).unwrap();
            for layer in 0..config.num_hidden_layers {
                let parts: Vec<Vec<Shard>> =
                    (0..ranks).map(|r| tp.shards(&config, layer, r)).collect();
                let sparse = config.mixer_types[layer] == MixerKind::Sparse;
                let shared = sparse && ranks > config.num_key_value_heads;
                for (i, s0) in parts[0].iter().enumerate() {
                    if shared && matches!(s0.name, "q_proj" | "k_proj" | "v_proj" | "o_gate") {
                        // A KV head's group, whole on each of the ranks sharing it.
                        for (r, p) in parts.iter().enumerate() {
                            let d = config.head_dim;
                            let g = tp.sparse_group(&config, r);
                            let (_, kv) = tp.sparse_heads(&config, r);
                            let heads = if matches!(s0.name, "k_proj" | "v_proj") {
                                kv
                            } else {
                                g
                            };
                            assert_eq!(p[i].rows, heads.start * d..heads.end * d, "rank {r}");
                        }
                        continue;
                    }
                    // Split along rows or columns: the ranks' parts tile it, in order, evenly
                    // (o_proj past the KV heads by the columns each rank counts).
                    let split_rows = parts.iter().all(|p| p[i].cols == s0.cols);
                    let ranges: Vec<Range<usize>> = parts
                        .iter()
                        .map(|p| {
                            if split_rows {
                                p[i].rows.clone()
                            } else {
                                p[i].own_cols.clone().unwrap_or(p[i].cols.clone())
                            }
                        })
                        .collect();
                    assert_eq!(ranges[0].start, 0, "{} of layer {layer}", s0.name);
                    for w in ranges.windows(2) {
                        assert_eq!(w[0].end, w[1].start, "{} of layer {layer}", s0.name);
                        assert_eq!(w[0].len(), w[1].len(), "{} of layer {layer}", s0.name);
                    }
                    assert!(parts.iter().all(|p| p[i].name == s0.name));
                }
                if config.mixer_types[layer] == MixerKind::Sparse {
                    let group = config.num_attention_heads / config.num_key_value_heads;
                    for r in 0..ranks {
                        let (q, kv) = tp.sparse_heads(&config, r);
                        assert!(q.clone().all(|h| kv.contains(&(h / group))), "rank {r}");
                        assert_eq!(kv.len(), (config.num_key_value_heads / ranks).max(1));
                    }
                }
            }
        }
        let e = TensorParallel::new(&config, 3).unwrap_err();
        assert!(e.contains("tensor parallel 3") && e.contains("32"), "{e}");
        assert!(TensorParallel::new(&config, 64).is_err());
        assert!(TensorParallel::new(&config, 0).is_err());
    }

    /// `x [t, cols]` times rows `rows` of `w` (`[n, cols]`), transposed, over the columns
    /// `wcols` only, in f64.
    fn product(
        x: &[f64],
        cols: usize,
        w: &[f64],
        rows: Range<usize>,
        wcols: Range<usize>,
    ) -> Vec<f64> {
        let t = x.len() / cols;
        let mut out = Vec::with_capacity(t * rows.len());
        for r in 0..t {
            let xr = &x[r * cols..(r + 1) * cols];
            for o in rows.clone() {
                let wr = &w[o * cols..(o + 1) * cols];
                out.push(wcols.clone().map(|i| xr[i] * wr[i]).sum());
            }
        }
        out
    }

    /// Simulated ranks: a lightning layer (q, k, v, the attention, o_norm over all heads,
    /// the z gate, o_proj) and the MLP computed by each rank on its shards of the weights,
    /// o_norm's sums of squares and the row-split products' outputs added across ranks, equal
    /// the layer on one device (f64, so the sums differ only in their order).
    #[test]
    fn a_layer_split_by_the_shard_plan_equals_it_whole() {
        let config = sala_checkpoint::preset("tiny").unwrap();
        let layer = config
            .mixer_types
            .iter()
            .position(|m| *m == MixerKind::Lightning)
            .unwrap();
        let (hid, heads, d, inter) = (
            config.hidden_size,
            config.num_attention_heads,
            config.head_dim,
            config.intermediate_size,
        );
        let mut rng = TestRng::new(11);
        let mut w = |n: usize| -> Vec<f64> {
            rng.bf16_vec(n, -0.2, 0.2)
                .into_iter()
                .map(f64::from)
                .collect()
        };
        let t = 7;
        let x = w(t * hid);
        let (wq, wk, wv, wz, wo) = (
            w(hid * hid),
            w(hid * hid),
            w(hid * hid),
            w(hid * hid),
            w(hid * hid),
        );
        let norm_w = w(hid);
        let (wg, wu, wd) = (w(inter * hid), w(inter * hid), w(hid * inter));
        let slopes: Vec<f32> = (0..heads)
            .map(|i| 2f32.powf(-(i as f32 + 1.0) / 4.0))
            .collect();
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
        let silu = |x: f64| x * sigmoid(x);
        // A rank's part of the layer, for `heads_r` heads (features `f`) and MLP rows `m`:
        // its attention output before o_norm, its z, its MLP rows' activations.
        let attention = |f: Range<usize>, hs: Range<usize>| -> (Vec<f64>, Vec<f64>) {
            let shape = AttnShape {
                heads: hs.len(),
                kv_heads: hs.len(),
                head_dim: d,
            };
            let all = 0..hid;
            let q = product(&x, hid, &wq, f.clone(), all.clone());
            let k = product(&x, hid, &wk, f.clone(), all.clone());
            let v = product(&x, hid, &wv, f.clone(), all.clone());
            let (o, _) =
                oracle::lightning(shape, &slopes[hs], &f32s(&q), &f32s(&k), &f32s(&v), None);
            let z = product(&x, hid, &wz, f, all);
            (o.into_iter().map(f64::from).collect(), z)
        };
        // One device.
        let (o, z) = attention(0..hid, 0..heads);
        let rms = |ss: f64| 1.0 / (ss / hid as f64 + config.rms_norm_eps).sqrt();
        let gated = |o: &[f64], z: &[f64], f: Range<usize>, ss: &[f64]| -> Vec<f64> {
            let n = f.len();
            (0..o.len())
                .map(|i| o[i] * rms(ss[i / n]) * norm_w[f.start + i % n] * sigmoid(z[i]))
                .collect()
        };
        let sums = |o: &[f64], n: usize| -> Vec<f64> {
            o.chunks(n).map(|r| r.iter().map(|v| v * v).sum()).collect()
        };
        let whole_g = gated(&o, &z, 0..hid, &sums(&o, hid));
        let want_attn = product(&whole_g, hid, &wo, 0..hid, 0..hid);
        let g = product(&x, hid, &wg, 0..inter, 0..hid);
        let u = product(&x, hid, &wu, 0..inter, 0..hid);
        let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        let want_mlp = product(&act, inter, &wd, 0..hid, 0..inter);
        for ranks in [1usize, 2, 4] {
            let tp = TensorParallel::new(&config, ranks).unwrap();
            let shards: Vec<Vec<Shard>> =
                (0..ranks).map(|r| tp.shards(&config, layer, r)).collect();
            let find =
                |r: usize, name: &str| shards[r].iter().find(|s| s.name == name).unwrap().clone();
            // Each rank's heads: its q rows / d.
            let parts: Vec<(Range<usize>, Vec<f64>, Vec<f64>)> = (0..ranks)
                .map(|r| {
                    let f = find(r, "q_proj").rows;
                    assert_eq!(find(r, "k_proj").rows, f);
                    assert_eq!(find(r, "z_proj").rows, f);
                    let (o, z) = attention(f.clone(), f.start / d..f.end / d);
                    (f, o, z)
                })
                .collect();
            // o_norm's sums of squares, added across ranks (an all-reduce of one value a row).
            let mut ss = vec![0.0; t];
            for (f, o, _) in &parts {
                for (s, p) in ss.iter_mut().zip(sums(o, f.len())) {
                    *s += p;
                }
            }
            let mut got_attn = vec![0.0; t * hid];
            let mut got_mlp = vec![0.0; t * hid];
            for (r, (f, o, z)) in parts.iter().enumerate() {
                assert_eq!(find(r, "o_norm").rows, *f);
                let gr = gated(o, z, f.clone(), &ss);
                // o_proj's columns for these features: a partial output, summed across ranks.
                let cols = find(r, "o_proj").cols;
                let mut wo_r = vec![0.0; hid * f.len()];
                for o in 0..hid {
                    wo_r[o * f.len()..(o + 1) * f.len()]
                        .copy_from_slice(&wo[o * hid + cols.start..o * hid + cols.end]);
                }
                for (a, p) in
                    got_attn
                        .iter_mut()
                        .zip(product(&gr, f.len(), &wo_r, 0..hid, 0..f.len()))
                {
                    *a += p;
                }
                let m = find(r, "gate_proj").rows;
                assert_eq!(find(r, "up_proj").rows, m);
                let g = product(&x, hid, &wg, m.clone(), 0..hid);
                let u = product(&x, hid, &wu, m.clone(), 0..hid);
                let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
                let dc = find(r, "down_proj").cols;
                assert_eq!(dc, m);
                let mut wd_r = vec![0.0; hid * m.len()];
                for o in 0..hid {
                    wd_r[o * m.len()..(o + 1) * m.len()]
                        .copy_from_slice(&wd[o * inter + dc.start..o * inter + dc.end]);
                }
                for (a, p) in
                    got_mlp
                        .iter_mut()
                        .zip(product(&act, m.len(), &wd_r, 0..hid, 0..m.len()))
                {
                    *a += p;
                }
            }
            for (what, got, want) in [
                ("attention", &got_attn, &want_attn),
                ("mlp", &got_mlp, &want_mlp),
            ] {
                for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-9 * (1.0 + b.abs()),
                        "{ranks} ranks, {what} {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Simulated ranks make the compressed keys of both levels from their own keys and the
    /// halo before them, and together they are those of the whole prompt, each window once.
    #[test]
    fn ranks_make_every_compressed_window_once_from_their_keys_and_halos() {
        let mut rng = TestRng::new(13);
        let width = 6;
        for (len, ranks, align) in [
            (1000usize, 4usize, 64usize),
            (777, 3, 64),
            (300, 5, 16),
            (40, 2, 16),
        ] {
            let keys = rng.bf16_vec(len * width, -1.0, 1.0);
            for (window, stride) in [(32usize, 16usize), (128, 64), (8, 4)] {
                let want = oracle::compress_keys(&keys, width, window, stride);
                let mut got = Vec::new();
                let mut next = 0;
                for r in context_ranges(len, ranks, align) {
                    let (windows, halo) = rank_windows(&r, window, stride);
                    assert_eq!(windows.start, next, "windows in order, each once");
                    next = windows.end;
                    // The rank's keys and the halo's: windows from the halo's start on.
                    let held = &keys[halo.start * width..r.end * width];
                    let made = oracle::compress_keys(held, width, window, stride);
                    let skip = windows.start - halo.start / stride;
                    got.extend_from_slice(&made[skip * width..(skip + windows.len()) * width]);
                }
                assert_eq!(
                    got, want,
                    "{len} tokens, {ranks} ranks, windows of {window}"
                );
            }
        }
    }

    /// Balanced ranges: the even split without a position share; with one, shorter later
    /// ranges whose modeled work is equal to within a block's, aligned and tiling the prompt.
    #[test]
    fn balanced_ranges_give_each_rank_the_same_modeled_work() {
        for (len, ranks) in [
            (1000usize, 4usize),
            (4096, 7),
            (1 << 20, 8),
            (65, 2),
            (130, 2),
        ] {
            assert_eq!(
                balanced_context_ranges(len, ranks, 64, 0.0),
                context_ranges(len, ranks, 64)
            );
        }
        let work = |r: &Range<usize>, len: usize, s: f64| {
            let u = |x: usize| x as f64 / len as f64;
            let f = |x: usize| (1.0 - s) * u(x) + s * u(x) * u(x);
            f(r.end) - f(r.start)
        };
        for (len, ranks, s) in [
            (1usize << 20, 8usize, 0.13),
            (1 << 17, 4, 0.02),
            (5000, 3, 0.5),
        ] {
            let r = balanced_context_ranges(len, ranks, 64, s);
            assert_eq!(r.len(), ranks);
            assert_eq!(r[0].start, 0);
            assert_eq!(r.last().unwrap().end, len);
            assert!(r
                .windows(2)
                .all(|w| w[0].end == w[1].start && w[0].end % 64 == 0));
            assert!(r.windows(2).all(|w| w[0].len() >= w[1].len()), "{r:?}");
            let block = work(&(len - 64..len), len, s);
            let each: Vec<f64> = r.iter().map(|x| work(x, len, s)).collect();
            for w in &each {
                assert!((w - 1.0 / ranks as f64).abs() <= block, "{each:?}");
            }
        }
        // Short prompts: a block each at least, every token covered.
        let r = balanced_context_ranges(200, 3, 64, 0.9);
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| !x.is_empty()) && r[2].end == 200, "{r:?}");
    }

    #[test]
    fn context_ranges_are_aligned_contiguous_and_even() {
        assert_eq!(
            context_ranges(1000, 4, 64),
            [0..256, 256..512, 512..768, 768..1000]
        );
        assert_eq!(context_ranges(100, 8, 64), [0..64, 64..100]);
        assert_eq!(context_ranges(1 << 20, 8, 64)[7], (7 << 17)..(1 << 20));
        assert_eq!(context_ranges(5, 3, 64), vec![0..5]);
        for (len, ranks) in [(1usize, 1usize), (777, 3), (4096, 7), (65, 2)] {
            let r = context_ranges(len, ranks, 64);
            assert_eq!(r.first().unwrap().start, 0);
            assert_eq!(r.last().unwrap().end, len);
            assert!(r
                .windows(2)
                .all(|w| w[0].end == w[1].start && w[0].end % 64 == 0));
        }
    }

    /// Simulated ranks: each runs the lightning attention of its range from a zero state
    /// (the oracle), the scan carries the states across, and each corrects its outputs by
    /// its start state; outputs and the final state equal one pass over the whole prompt.
    #[test]
    fn the_lightning_scan_across_ranks_equals_one_pass() {
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let slopes: Vec<f32> = (0..4).map(|i| 2f32.powf(-(i as f32 + 1.0) / 4.0)).collect();
        let mut rng = TestRng::new(7);
        let t = 150;
        let q = rng.bf16_vec(t * shape.q_width(), -1.0, 1.0);
        let k = rng.bf16_vec(t * shape.kv_width(), -1.0, 1.0);
        let v = rng.bf16_vec(t * shape.kv_width(), -1.0, 1.0);
        let init = rng.bf16_vec(4 * 8 * 8, -0.5, 0.5);
        let (want, want_state) = oracle::lightning(shape, &slopes, &q, &k, &v, Some(&init));
        for ranks in [1usize, 2, 3, 5] {
            let ranges = context_ranges(t, ranks, 16);
            let (qw, kw) = (shape.q_width(), shape.kv_width());
            let locals: Vec<(Vec<f32>, Vec<f32>)> = ranges
                .iter()
                .map(|r| {
                    let qs = &q[r.start * qw..r.end * qw];
                    let (ks, vs) = (&k[r.start * kw..r.end * kw], &v[r.start * kw..r.end * kw]);
                    oracle::lightning(shape, &slopes, qs, ks, vs, None)
                })
                .collect();
            let parts: Vec<(usize, &[f32])> = ranges
                .iter()
                .zip(&locals)
                .map(|(r, (_, s))| (r.len(), s.as_slice()))
                .collect();
            let starts = lightning_scan(&slopes, 8, Some(&init), &parts);
            let mut got = Vec::new();
            for ((r, (o, _)), s_in) in ranges.iter().zip(&locals).zip(&starts) {
                let mut o = o.clone();
                lightning_correct(shape, &slopes, &q[r.start * qw..r.end * qw], s_in, &mut o);
                got.extend(o);
            }
            let close = |a: &[f32], b: &[f32], what: &str| {
                for (i, (x, y)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "{what} {i}: {x} vs {y}"
                    );
                }
            };
            close(&got, &want, &format!("{ranks} ranks: outputs"));
            close(
                starts.last().unwrap(),
                &want_state,
                &format!("{ranks} ranks: state"),
            );
        }
    }

    /// The tiny preset's sparse layers with few blocks selected: blocks of 16, 1 initial and 3
    /// local ones forced, 4 chosen of the others.
    fn few_selected_blocks() -> SparseConfig {
        let mut cfg = sala_checkpoint::preset("tiny").unwrap().sparse;
        cfg.topk = 6;
        cfg.window_size = 32;
        cfg
    }

    /// Why a rank past the KV heads scores its KV head's whole group ([`TensorParallel::
    /// sparse_group`]): a rank scoring only its own half of a group's heads selects other
    /// blocks than the group does for some queries.
    #[test]
    fn a_rank_scoring_half_a_group_selects_other_blocks() {
        let shape = AttnShape {
            heads: 8,
            kv_heads: 2,
            head_dim: 16,
        };
        let cfg = few_selected_blocks();
        let (len, first) = (420usize, 380usize);
        let mut rng = TestRng::new(23);
        let keys = rng.bf16_vec(len * shape.kv_width(), -2.0, 2.0);
        let q = rng.bf16_vec((len - first) * shape.q_width(), -2.0, 2.0);
        let kw = shape.kv_width();
        let differs = (first..len).any(|t| {
            let q_row = &q[(t - first) * shape.q_width()..][..shape.q_width()];
            let visible = &keys[..(t + 1) * kw];
            let k1 = oracle::compress_keys(visible, kw, cfg.k1_window(), cfg.k1_stride());
            let k2 = oracle::compress_keys(visible, kw, cfg.k2_window(), cfg.k2_stride());
            let all = oracle::stage1_scores(shape, &cfg, q_row, t, &k1, &k2);
            let own =
                oracle::round_stage1(&oracle::stage1_sums(shape, &cfg, q_row, t, &k1, &k2, 0..2));
            oracle::selected_keys(&cfg, &own[0], t) != oracle::selected_keys(&cfg, &all[0], t)
        });
        assert!(
            differs,
            "half a group's heads select as the whole group does for every query"
        );
    }

    /// Simulated context parallelism of a sparse layer: a 700-token prompt split among 1 to 5
    /// ranks (block-aligned ranges), each rank making the compressed windows that end in its
    /// range from its keys and halo, all of them gathered, and each query selecting and
    /// attending as on one device: the same outputs, bit for bit (the same f64 arithmetic on
    /// the same windows). Dense queries fetch every earlier block; sparse ones only blocks
    /// they select (with random keys a rank's queries together still select most of them: on
    /// real text the fetches are what the selection makes them).
    #[test]
    fn context_parallel_sparse_attention_equals_one_pass_and_fetches_its_selected_blocks() {
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
        };
        let cfg = few_selected_blocks();
        let len = 700usize;
        let mut rng = TestRng::new(29);
        let keys = rng.bf16_vec(len * shape.kv_width(), -2.0, 2.0);
        let values = rng.bf16_vec(len * shape.kv_width(), -1.0, 1.0);
        let q = rng.bf16_vec(len * shape.q_width(), -2.0, 2.0);
        for mode in [SparseMode::Sparse, SparseMode::Dense] {
            let whole = oracle::sparse_layer_attention(shape, &cfg, mode, &q, 0, &keys, &values);
            for ranks in [1usize, 2, 3, 5] {
                let ranges = context_ranges(len, ranks, cfg.block_size);
                let (got, reads) =
                    context_sparse_attention(&ranges, shape, &cfg, mode, &q, (&keys, &values));
                assert!(
                    got.iter()
                        .zip(&whole)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{mode:?}, {ranks} ranks: outputs differ"
                );
                for (range, r) in ranges.iter().zip(&reads) {
                    let earlier = range.start / cfg.block_size;
                    assert!(r.fetched_blocks.iter().all(|&b| b < earlier));
                    assert!(r.halo_keys < cfg.k2_window(), "{:?}", r.halo_keys);
                    match mode {
                        SparseMode::Dense => assert_eq!(r.fetched_blocks.len(), earlier),
                        SparseMode::Sparse => {
                            assert!(r.fetched_blocks.len() <= range.len() * cfg.selected_blocks())
                        }
                    }
                }
            }
        }
    }
}
