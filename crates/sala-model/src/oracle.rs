//! The oracle: both attention algorithms written straight from SPEC's formulas, with explicit
//! loops in f64 and no cleverness. Every fast path (CPU now, GPU later) is tested against it.
//!
//! Layouts: a row of queries is `[heads * head_dim]` (head h = features `h*d .. h*d+d`);
//! key/value rows are `[kv_heads * head_dim]`; a lightning state is `[heads, d_key, d_value]`.

use crate::numerics::bf16_round;
use sala_checkpoint::SparseConfig;

/// Head counts and size of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    pub fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

/// Simple-GLA (SPEC §4.2), closed form: for each token t and head h,
/// `o_t = s·Σ_{j≤t} γ^{t-j} (q_t·k_j) v_j + s·γ^{t+1} q_t S_init`, and the final state
/// `S = γ^T S_init + Σ_j γ^{T-1-j} k_jᵀ v_j`. Returns `(o [T, H*d], state [H, d, d])`.
pub fn lightning(
    shape: AttnShape,
    slopes: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    init_state: Option<&[f32]>,
) -> (Vec<f32>, Vec<f32>) {
    let (h_n, d) = (shape.heads, shape.head_dim);
    let t_n = q.len() / shape.q_width();
    let scale = shape.scale();
    let mut out = vec![0f32; t_n * h_n * d];
    let mut state = vec![0f32; h_n * d * d];
    for h in 0..h_n {
        let kvh = h / shape.group();
        let gamma = (-(slopes[h] as f64)).exp();
        let qh = |t: usize| &q[t * shape.q_width() + h * d..][..d];
        let kh = |t: usize| &k[t * shape.kv_width() + kvh * d..][..d];
        let vh = |t: usize| &v[t * shape.kv_width() + kvh * d..][..d];
        let s0 = |a: usize, b: usize| init_state.map_or(0.0, |s| s[(h * d + a) * d + b] as f64);
        for t in 0..t_n {
            for e in 0..d {
                let mut acc = 0.0;
                for j in 0..=t {
                    acc += gamma.powi((t - j) as i32) * dot(qh(t), kh(j)) * vh(j)[e] as f64;
                }
                let mut from_init = 0.0;
                for a in 0..d {
                    from_init += qh(t)[a] as f64 * s0(a, e);
                }
                acc += gamma.powi(t as i32 + 1) * from_init;
                out[t * shape.q_width() + h * d + e] = (scale * acc) as f32;
            }
        }
        for a in 0..d {
            for b in 0..d {
                let mut acc = gamma.powi(t_n as i32) * s0(a, b);
                for j in 0..t_n {
                    acc += gamma.powi((t_n - 1 - j) as i32) * kh(j)[a] as f64 * vh(j)[b] as f64;
                }
                state[(h * d + a) * d + b] = acc as f32;
            }
        }
    }
    (out, state)
}

/// Mean-pooled keys (SPEC §5.3): window `i` is the bf16-rounded mean of keys
/// `stride*i .. stride*i + window`; only complete windows. Returns `[n, kv_heads*d]`.
pub fn compress_keys(keys: &[f32], kv_width: usize, window: usize, stride: usize) -> Vec<f32> {
    let n_keys = keys.len() / kv_width;
    let n = if n_keys >= window {
        (n_keys - window) / stride + 1
    } else {
        0
    };
    let mut out = vec![0f32; n * kv_width];
    for i in 0..n {
        for f in 0..kv_width {
            let sum: f64 = (0..window)
                .map(|u| keys[(stride * i + u) * kv_width + f] as f64)
                .sum();
            out[i * kv_width + f] = bf16_round((sum / window as f64) as f32);
        }
    }
    out
}

/// Which attention runs for a query (SPEC §5.2; the engine decides it per forward call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SparseMode {
    /// Causal softmax attention over every earlier key.
    Dense,
    /// InfLLM-v2: block selection over compressed keys, attention over the selected blocks.
    Sparse,
}

/// Stage 1 (SPEC §5.4) for the query at position `t`: for each KV group g and level-1 window
/// i, `P[g][i] = Σ_{h∈g} exp(s·q_h·K1_i − LSE_h)` with `LSE_h` over the visible level-2 windows,
/// rounded to bf16. A window is visible iff its last token is ≤ t; invisible windows and all
/// windows of a query with no visible level-2 window score 0.
pub fn stage1_scores(
    shape: AttnShape,
    cfg: &SparseConfig,
    q_row: &[f32],
    t: usize,
    k1: &[f32],
    k2: &[f32],
) -> Vec<Vec<f32>> {
    let sums = stage1_sums(shape, cfg, q_row, t, k1, k2, 0..shape.heads);
    round_stage1(&sums)
}

/// [`stage1_scores`]' rounding: each group's sums to bf16 (NaN as 0).
pub fn round_stage1(sums: &[Vec<f64>]) -> Vec<Vec<f32>> {
    sums.iter()
        .map(|g| {
            g.iter()
                .map(|&x| {
                    let v = bf16_round(x as f32);
                    if v.is_nan() {
                        0.0
                    } else {
                        v
                    }
                })
                .collect()
        })
        .collect()
}

/// [`stage1_scores`]' sums before their rounding, over the query heads `heads` only (each
/// group's sum over those of its heads; 0 for a group without one): what a rank holding
/// those heads adds to the other ranks' sums of the same groups (tensor parallelism).
pub fn stage1_sums(
    shape: AttnShape,
    cfg: &SparseConfig,
    q_row: &[f32],
    t: usize,
    k1: &[f32],
    k2: &[f32],
    heads: std::ops::Range<usize>,
) -> Vec<Vec<f64>> {
    let d = shape.head_dim;
    let kw = shape.kv_width();
    let n1 = k1.len() / kw;
    let n2 = k2.len() / kw;
    let visible = |i: usize, window: usize, stride: usize| stride * i + window - 1 <= t;
    let s = shape.scale();
    let mut p = vec![vec![0f64; n1]; shape.kv_heads];
    for (g, sums) in p.iter_mut().enumerate() {
        let vis2: Vec<usize> = (0..n2)
            .filter(|&c| visible(c, cfg.k2_window(), cfg.k2_stride()))
            .collect();
        if vis2.is_empty() {
            continue;
        }
        let group = g * shape.group()..(g + 1) * shape.group();
        for h in group.start.max(heads.start)..group.end.min(heads.end) {
            let qh = &q_row[h * d..][..d];
            let logits2: Vec<f64> = vis2
                .iter()
                .map(|&c| s * dot(qh, &k2[c * kw + g * d..][..d]))
                .collect();
            let m = logits2.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + logits2.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            for (i, sum) in sums.iter_mut().enumerate() {
                if visible(i, cfg.k1_window(), cfg.k1_stride()) {
                    *sum += (s * dot(qh, &k1[i * kw + g * d..][..d]) - lse).exp();
                }
            }
        }
    }
    p
}

/// Block scores for blocks `0 ..= qb` of one KV group (SPEC §5.5): forced blocks (the first
/// `init_blocks` and the `local_blocks + 1` ending at the query's block) get +inf; any other
/// block b gets the max of `P` over level-1 windows `[w·b − 1, w·b + w − 1]` (w windows per
/// block), −inf where none exists.
pub fn block_scores(cfg: &SparseConfig, p: &[f32], qb: usize) -> Vec<f32> {
    let w = cfg.windows_per_block();
    (0..=qb)
        .map(|b| {
            if b < cfg.init_blocks || b + cfg.local_blocks() >= qb {
                return f32::INFINITY;
            }
            let lo = (w * b).saturating_sub(1);
            let hi = (w * b + w).min(p.len());
            (lo..hi).map(|i| p[i]).fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// Top-`k` blocks by score (ties: lower block index first), returned in ascending order.
pub fn select_blocks(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(k);
    order.sort_unstable();
    order
}

/// Softmax attention of one query row over `keys` (indices into the K/V rows), per head.
fn attend(
    shape: AttnShape,
    q_row: &[f32],
    keys: &[f32],
    values: &[f32],
    sel: &[Vec<usize>],
) -> Vec<f32> {
    attend_heads(shape, q_row, keys, values, sel, 0..shape.heads)
}

/// [`attend`] for the query heads `heads` only: their `heads.len()·d` outputs (a rank's).
pub fn attend_heads(
    shape: AttnShape,
    q_row: &[f32],
    keys: &[f32],
    values: &[f32],
    sel: &[Vec<usize>],
    heads: std::ops::Range<usize>,
) -> Vec<f32> {
    let d = shape.head_dim;
    let kw = shape.kv_width();
    let first = heads.start;
    let mut out = vec![0f32; heads.len() * d];
    for h in heads {
        let g = h / shape.group();
        let qh = &q_row[h * d..][..d];
        let logits: Vec<f64> = sel[g]
            .iter()
            .map(|&j| shape.scale() * dot(qh, &keys[j * kw + g * d..][..d]))
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for e in 0..d {
            let acc: f64 = sel[g]
                .iter()
                .zip(&w)
                .map(|(&j, wj)| wj * values[j * kw + g * d + e] as f64)
                .sum();
            out[(h - first) * d + e] = (acc / z) as f32;
        }
    }
    out
}

/// The keys (token indices) each KV group of the query at position `t` attends to.
pub fn attended_keys(
    shape: AttnShape,
    cfg: &SparseConfig,
    mode: SparseMode,
    q_row: &[f32],
    t: usize,
    keys: &[f32],
) -> Vec<Vec<usize>> {
    let dense = vec![(0..=t).collect::<Vec<_>>(); shape.kv_heads];
    if mode == SparseMode::Dense {
        return dense;
    }
    let visible_keys = &keys[..(t + 1) * shape.kv_width()];
    let k1 = compress_keys(
        visible_keys,
        shape.kv_width(),
        cfg.k1_window(),
        cfg.k1_stride(),
    );
    let k2 = compress_keys(
        visible_keys,
        shape.kv_width(),
        cfg.k2_window(),
        cfg.k2_stride(),
    );
    let p = stage1_scores(shape, cfg, q_row, t, &k1, &k2);
    p.iter().map(|pg| selected_keys(cfg, pg, t)).collect()
}

/// The keys (token indices) the query at position `t` attends to in a KV group whose stage-1
/// scores are `p`: the tokens of its selected blocks (SPEC §5.5).
pub fn selected_keys(cfg: &SparseConfig, p: &[f32], t: usize) -> Vec<usize> {
    let blocks = select_blocks(
        &block_scores(cfg, p, t / cfg.block_size),
        cfg.selected_blocks(),
    );
    blocks
        .iter()
        .flat_map(|&b| b * cfg.block_size..((b + 1) * cfg.block_size).min(t + 1))
        .collect()
}

/// Sparse-layer attention (SPEC §5.2–5.6) for queries at positions `first_pos ..`; `keys` and
/// `values` hold at least every token up to the last query. Returns `[T, H*d]`.
pub fn sparse_layer_attention(
    shape: AttnShape,
    cfg: &SparseConfig,
    mode: SparseMode,
    q: &[f32],
    first_pos: usize,
    keys: &[f32],
    values: &[f32],
) -> Vec<f32> {
    let t_n = q.len() / shape.q_width();
    let mut out = Vec::with_capacity(q.len());
    for i in 0..t_n {
        let t = first_pos + i;
        let q_row = &q[i * shape.q_width()..][..shape.q_width()];
        let sel = attended_keys(shape, cfg, mode, q_row, t, keys);
        out.extend(attend(shape, q_row, keys, values, &sel));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lightning_matches_the_recurrence() {
        // The closed form against the recurrent definition S_t = γS + kᵀv, o_t = s q S_t.
        let shape = AttnShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 3,
        };
        let slopes = [0.5f32, 0.25];
        let t_n = 5;
        let val = |i: usize| ((i * 7919 % 13) as f32 - 6.0) / 7.0;
        let q: Vec<f32> = (0..t_n * 6).map(val).collect();
        let k: Vec<f32> = (0..t_n * 3).map(|i| val(i + 3)).collect();
        let v: Vec<f32> = (0..t_n * 3).map(|i| val(i + 5)).collect();
        let init: Vec<f32> = (0..2 * 9).map(|i| val(i + 1) * 0.3).collect();
        let (o, st) = lightning(shape, &slopes, &q, &k, &v, Some(&init));
        for h in 0..2 {
            let gamma = (-(slopes[h] as f64)).exp();
            let mut s: Vec<f64> = init[h * 9..h * 9 + 9].iter().map(|&x| x as f64).collect();
            for t in 0..t_n {
                for a in 0..3 {
                    for b in 0..3 {
                        s[a * 3 + b] =
                            gamma * s[a * 3 + b] + k[t * 3 + a] as f64 * v[t * 3 + b] as f64;
                    }
                }
                for b in 0..3 {
                    let want: f64 = (0..3)
                        .map(|a| q[t * 6 + h * 3 + a] as f64 * s[a * 3 + b])
                        .sum::<f64>()
                        / 3f64.sqrt();
                    let got = o[t * 6 + h * 3 + b] as f64;
                    assert!((want - got).abs() < 1e-5, "h{h} t{t}: {want} vs {got}");
                }
            }
            for (a, &x) in s.iter().enumerate() {
                assert!((x - st[h * 9 + a] as f64).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn compression_windows_and_selection_rules() {
        let keys: Vec<f32> = (0..40).map(|i| i as f32).collect(); // 40 tokens, width 1
        let k1 = compress_keys(&keys, 1, 32, 16);
        assert_eq!(k1, vec![15.5]); // only the window 0..32 is complete
        let cfg = SparseConfig::default();
        // qb = 40: blocks 0 and 8..=40 are forced; block 2 pools windows 7..=11.
        let mut p = vec![0f32; 200];
        p[11] = 3.0;
        p[12] = 9.0; // belongs to block 3 (windows 11..=15)
        let s = block_scores(&cfg, &p, 40);
        assert_eq!(s.len(), 41);
        assert!(s[0].is_infinite() && s[8].is_infinite() && s[40].is_infinite());
        assert_eq!(s[2], 3.0);
        assert_eq!(s[3], 9.0);
        assert_eq!(s[1], 0.0);
        assert_eq!(select_blocks(&[1.0, 5.0, 5.0, 2.0], 2), vec![1, 2]);
        assert_eq!(select_blocks(&[1.0, 5.0, 7.0, 5.0], 2), vec![1, 2]);
    }
}
