//! Fast CPU attention: chunked Simple GLA for lightning layers, and dense / InfLLM-v2 sparse
//! attention over an incrementally compressed key cache. Held to `sala_model::oracle`.

use rayon::prelude::*;
use sala_checkpoint::{KvCacheDtype, SparseConfig};
use sala_model::numerics::{bf16_round, fp8_round_kv};
use sala_model::{AttnShape, SparseMode};

/// Chunk length of the lightning prefill (the reference's `chunk_simple_gla` uses 64).
pub const LIGHTNING_CHUNK: usize = 64;

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, ra) = a.as_chunks::<8>();
    let (cb, rb) = b.as_chunks::<8>();
    for (x, y) in ca.iter().zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// Simple GLA over `T` tokens from `state` (`[H, d, d]`, advanced in place), in chunks of 64:
/// `o_i = s·(γ^{i+1} q_i S + Σ_{j≤i} γ^{i-j}(q_i·k_j) v_j)`, `S ← γ^c S + Σ_j γ^{c-1-j} k_jᵀ v_j`.
/// Returns `o` `[T, H*d]` in f32 (not rounded).
pub fn lightning(
    shape: AttnShape,
    slopes: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    state: &mut [f32],
) -> Vec<f32> {
    let d = shape.head_dim;
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let t_n = q.len() / qw;
    let scale = shape.scale() as f32;
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(d * d)
        .enumerate()
        .map(|(h, s)| {
            let kvh = h / shape.group();
            let g = -slopes[h];
            let pow: Vec<f32> = (0..=LIGHTNING_CHUNK)
                .map(|n| (g * n as f32).exp())
                .collect();
            let mut out = vec![0f32; t_n * d];
            let mut scores = vec![0f32; LIGHTNING_CHUNK];
            for c0 in (0..t_n).step_by(LIGHTNING_CHUNK) {
                let c = LIGHTNING_CHUNK.min(t_n - c0);
                for i in 0..c {
                    let qi = &q[(c0 + i) * qw + h * d..][..d];
                    let oi = &mut out[(c0 + i) * d..][..d];
                    // Inter-chunk: γ^{i+1} q_i S.
                    for (a, &qa) in qi.iter().enumerate() {
                        axpy(oi, qa * pow[i + 1], &s[a * d..][..d]);
                    }
                    // Intra-chunk: Σ_{j≤i} γ^{i-j}(q_i·k_j) v_j.
                    for j in 0..=i {
                        scores[j] = dot(qi, &k[(c0 + j) * kw + kvh * d..][..d]) * pow[i - j];
                    }
                    for j in 0..=i {
                        axpy(oi, scores[j], &v[(c0 + j) * kw + kvh * d..][..d]);
                    }
                    for x in oi.iter_mut() {
                        *x *= scale;
                    }
                }
                for x in s.iter_mut() {
                    *x *= pow[c];
                }
                for j in 0..c {
                    let kj = &k[(c0 + j) * kw + kvh * d..][..d];
                    let vj = &v[(c0 + j) * kw + kvh * d..][..d];
                    let w = pow[c - 1 - j];
                    for (a, &ka) in kj.iter().enumerate() {
                        axpy(&mut s[a * d..][..d], ka * w, vj);
                    }
                }
            }
            out
        })
        .collect();
    let mut o = vec![0f32; t_n * qw];
    for (h, oh) in per_head.iter().enumerate() {
        for t in 0..t_n {
            o[t * qw + h * d..][..d].copy_from_slice(&oh[t * d..][..d]);
        }
    }
    o
}

/// One sparse layer's cache for one sequence: every token's K and V, and the two tiers of
/// mean-pooled keys, extended as keys arrive (SPEC §5.3, §5.7).
#[derive(Debug, Clone)]
pub struct SparseCache {
    pub shape: AttnShape,
    pub cfg: SparseConfig,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub k1: Vec<f32>,
    pub k2: Vec<f32>,
}

impl SparseCache {
    pub fn new(shape: AttnShape, cfg: &SparseConfig) -> Self {
        Self {
            shape,
            cfg: cfg.clone(),
            k: Vec::new(),
            v: Vec::new(),
            k1: Vec::new(),
            k2: Vec::new(),
        }
    }

    /// Makes room for `tokens` tokens in all (K, V and both compressed tiers) at once; an
    /// error (nothing lost) when the host cannot give that much memory.
    pub fn reserve(&mut self, cfg: &SparseConfig, tokens: usize) -> Result<(), String> {
        let kw = self.shape.kv_width();
        let more = |v: &mut Vec<f32>, rows: usize| {
            let want = rows.saturating_mul(kw);
            v.try_reserve_exact(want.saturating_sub(v.len()))
                .map_err(|_| {
                    format!(
                        "the CPU cannot hold a cache of {tokens} tokens: {} bytes for one of its \
                         buffers are not available",
                        want.saturating_mul(4)
                    )
                })
        };
        more(&mut self.k, tokens)?;
        more(&mut self.v, tokens)?;
        more(
            &mut self.k1,
            visible_windows(tokens.saturating_sub(1), cfg.k1_window(), cfg.k1_stride()),
        )?;
        more(
            &mut self.k2,
            visible_windows(tokens.saturating_sub(1), cfg.k2_window(), cfg.k2_stride()),
        )
    }

    /// Makes this cache (of the same shape) hold what `src` holds, keeping its reservation
    /// where it is large enough; an error (nothing lost) when the host cannot give the memory.
    pub fn copy_from(&mut self, src: &SparseCache) -> Result<(), String> {
        if self.shape.kv_width() != src.shape.kv_width() {
            return Err("copy_sparse_cache: the caches' shapes differ".into());
        }
        for (dst, src) in [
            (&mut self.k, &src.k),
            (&mut self.v, &src.v),
            (&mut self.k1, &src.k1),
            (&mut self.k2, &src.k2),
        ] {
            dst.clear();
            dst.try_reserve_exact(src.len()).map_err(|_| {
                format!(
                    "the CPU cannot hold a copy of a cache: {} bytes are not available",
                    src.len() * 4
                )
            })?;
            dst.extend_from_slice(src);
        }
        Ok(())
    }

    /// Drops the tokens from `len` on, and the compressed windows they completed.
    pub fn truncate(&mut self, len: usize) -> Result<(), String> {
        if len > self.len() {
            return Err(format!(
                "truncate_sparse_cache: {len} tokens of a cache of {}",
                self.len()
            ));
        }
        let kw = self.shape.kv_width();
        self.k.truncate(len * kw);
        self.v.truncate(len * kw);
        let seen = |window, stride| match len {
            0 => 0,
            n => visible_windows(n - 1, window, stride),
        };
        let n1 = seen(self.cfg.k1_window(), self.cfg.k1_stride());
        let n2 = seen(self.cfg.k2_window(), self.cfg.k2_stride());
        self.k1.truncate(n1 * kw);
        self.k2.truncate(n2 * kw);
        Ok(())
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.k.len() / self.shape.kv_width()
    }

    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }

    /// Appends K/V rows (rounded to FP8 as an FP8 cache holds them) and compresses every
    /// window they complete.
    pub fn append(&mut self, k: &[f32], v: &[f32]) {
        let old = self.k.len();
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        if self.cfg.kv_cache == KvCacheDtype::Fp8 {
            let d = self.shape.head_dim;
            fp8_round_kv(&mut self.k[old..], d);
            fp8_round_kv(&mut self.v[old..], d);
        }
        let kw = self.shape.kv_width();
        let n = self.len();
        for (tier, window, stride) in [
            (&mut self.k1, self.cfg.k1_window(), self.cfg.k1_stride()),
            (&mut self.k2, self.cfg.k2_window(), self.cfg.k2_stride()),
        ] {
            let mut sum = vec![0f32; kw];
            while (tier.len() / kw) * stride + window <= n {
                let start = (tier.len() / kw) * stride;
                sum.fill(0.0);
                for row in self.k[start * kw..(start + window) * kw].chunks_exact(kw) {
                    for (s, &x) in sum.iter_mut().zip(row) {
                        *s += x;
                    }
                }
                tier.extend(sum.iter().map(|&s| bf16_round(s / window as f32)));
            }
        }
    }
}

/// Number of windows of (`window`, `stride`) whose last token is ≤ t.
fn visible_windows(t: usize, window: usize, stride: usize) -> usize {
    if t + 1 >= window {
        (t + 1 - window) / stride + 1
    } else {
        0
    }
}

/// Blocks a KV group of the query at `t` (row `q_row`) attends to, ascending (SPEC §5.4–5.5);
/// `None` means every block up to the query's (then the result equals dense attention).
pub fn select_blocks(
    cache: &SparseCache,
    q_row: &[f32],
    t: usize,
    g: usize,
    p: &mut Vec<f32>,
) -> Option<Vec<usize>> {
    let (shape, cfg) = (cache.shape, &cache.cfg);
    let d = shape.head_dim;
    let kw = shape.kv_width();
    let qb = t / cfg.block_size;
    let k_sel = cfg.selected_blocks();
    if qb < k_sel {
        return None;
    }
    let n1 = visible_windows(t, cfg.k1_window(), cfg.k1_stride()).min(cache.k1.len() / kw);
    let n2 = visible_windows(t, cfg.k2_window(), cfg.k2_stride()).min(cache.k2.len() / kw);
    p.clear();
    p.resize(n1, 0.0);
    if n2 > 0 {
        let s = shape.scale() as f32;
        let mut logits2 = vec![0f32; n2];
        for h in g * shape.group()..(g + 1) * shape.group() {
            let qh = &q_row[h * d..][..d];
            let mut m = f32::NEG_INFINITY;
            for (c, l) in logits2.iter_mut().enumerate() {
                *l = s * dot(qh, &cache.k2[c * kw + g * d..][..d]);
                m = m.max(*l);
            }
            let lse = m + logits2.iter().map(|&x| (x - m).exp()).sum::<f32>().ln();
            for (i, pi) in p.iter_mut().enumerate() {
                *pi += (s * dot(qh, &cache.k1[i * kw + g * d..][..d]) - lse).exp();
            }
        }
        for x in p.iter_mut() {
            let r = bf16_round(*x);
            *x = if r.is_nan() { 0.0 } else { r };
        }
    }
    let w = cfg.windows_per_block();
    let forced = |b: usize| b < cfg.init_blocks || b + cfg.local_blocks() >= qb;
    let mut candidates: Vec<(f32, usize)> = (0..=qb)
        .filter(|&b| !forced(b))
        .map(|b| {
            let lo = (w * b).saturating_sub(1).min(p.len());
            let hi = (w * b + w).min(p.len());
            (
                p[lo..hi].iter().cloned().fold(f32::NEG_INFINITY, f32::max),
                b,
            )
        })
        .collect();
    let n_forced = qb + 1 - candidates.len();
    let take = k_sel.saturating_sub(n_forced).min(candidates.len());
    let better = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if take < candidates.len() && take > 0 {
        candidates.select_nth_unstable_by(take - 1, better);
    }
    let mut blocks: Vec<usize> = (0..=qb).filter(|&b| forced(b)).collect();
    blocks.extend(candidates[..take].iter().map(|&(_, b)| b));
    blocks.sort_unstable();
    Some(blocks)
}

/// Softmax attention of `group` query heads of KV group `g` over the keys `ranges`
/// (half-open token ranges), writing `out` (`[group*d]`).
fn attend_ranges(
    cache: &SparseCache,
    q_row: &[f32],
    g: usize,
    ranges: &[(usize, usize)],
    scratch: &mut Vec<f32>,
    out: &mut [f32],
) {
    let shape = cache.shape;
    let d = shape.head_dim;
    let kw = shape.kv_width();
    let s = shape.scale() as f32;
    let n: usize = ranges.iter().map(|r| r.1 - r.0).sum();
    for (hi, oh) in out.chunks_exact_mut(d).enumerate() {
        let h = g * shape.group() + hi;
        let qh = &q_row[h * d..][..d];
        scratch.clear();
        scratch.reserve(n);
        for &(a, b) in ranges {
            for j in a..b {
                scratch.push(s * dot(qh, &cache.k[j * kw + g * d..][..d]));
            }
        }
        let m = scratch.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for x in scratch.iter_mut() {
            *x = (*x - m).exp();
            z += *x;
        }
        oh.fill(0.0);
        let mut idx = 0;
        for &(a, b) in ranges {
            for j in a..b {
                axpy(oh, scratch[idx], &cache.v[j * kw + g * d..][..d]);
                idx += 1;
            }
        }
        let inv = 1.0 / z;
        for x in oh.iter_mut() {
            *x *= inv;
        }
    }
}

/// Attention of the queries `q` (`[T, H*d]`, positions `cache.len()-T ..`) over the cache,
/// which already holds their keys. Returns `o` `[T, H*d]` in f32 (not rounded).
pub fn sparse_layer_attention(cache: &SparseCache, mode: SparseMode, q: &[f32]) -> Vec<f32> {
    let shape = cache.shape;
    let qw = shape.q_width();
    let t_n = q.len() / qw;
    let first = cache.len() - t_n;
    let gw = shape.group() * shape.head_dim;
    let mut out = vec![0f32; t_n * qw];
    out.par_chunks_mut(gw).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(p, scratch), (idx, o)| {
            let (i, g) = (idx / shape.kv_heads, idx % shape.kv_heads);
            let t = first + i;
            let q_row = &q[i * qw..][..qw];
            let bs = cache.cfg.block_size;
            let ranges: Vec<(usize, usize)> = match mode {
                SparseMode::Dense => vec![(0, t + 1)],
                SparseMode::Sparse => match select_blocks(cache, q_row, t, g, p) {
                    None => vec![(0, t + 1)],
                    Some(blocks) => blocks
                        .iter()
                        .map(|&b| (b * bs, ((b + 1) * bs).min(t + 1)))
                        .collect(),
                },
            };
            attend_ranges(cache, q_row, g, &ranges, scratch, o);
        },
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After `reserve(n)`, appending up to n tokens never moves the buffers (one allocation
    /// up front), and the cache holds the same values as one grown on demand.
    #[test]
    fn reserved_caches_do_not_reallocate() {
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let cfg = SparseConfig::default();
        let n = 1000;
        let kw = shape.kv_width();
        let keys: Vec<f32> = (0..n * kw)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let mut grown = SparseCache::new(shape, &cfg);
        let mut reserved = SparseCache::new(shape, &cfg);
        reserved.reserve(&cfg, n).unwrap();
        let ptrs = |c: &SparseCache| [c.k.as_ptr(), c.v.as_ptr(), c.k1.as_ptr(), c.k2.as_ptr()];
        let before = ptrs(&reserved);
        for chunk in keys.chunks(37 * kw) {
            grown.append(chunk, chunk);
            reserved.append(chunk, chunk);
        }
        assert_eq!(ptrs(&reserved), before, "a buffer was reallocated");
        assert!(!reserved.k1.is_empty() && !reserved.k2.is_empty());
        assert_eq!(
            (&reserved.k, &reserved.k1, &reserved.k2),
            (&grown.k, &grown.k1, &grown.k2)
        );
    }

    /// A cache larger than any host is an error, not an abort, and the cache is untouched.
    #[test]
    fn an_impossible_reservation_is_an_error() {
        let shape = AttnShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        let cfg = SparseConfig::default();
        let mut cache = SparseCache::new(shape, &cfg);
        let e = cache.reserve(&cfg, usize::MAX / 64).unwrap_err();
        assert!(e.contains("cannot hold a cache"), "{e}");
        assert!(cache.is_empty());
        cache.reserve(&cfg, 100).unwrap();
    }
}
