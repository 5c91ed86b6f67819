//! What a model needs in memory: weights, and per sequence the sparse layers' K/V with their
//! compressed tiers plus the lightning layers' fixed-size states (SPEC §4.4, §5.7); and a
//! [`MemoryPlan`] adding the chunk workspace and what the backend states of its own memory
//! ([`BackendMemory`]), which a request is checked against before any work.

use sala_checkpoint::{KvCacheDtype, MixerKind, ModelConfig};

/// Bytes of one bf16 value.
pub const BF16: usize = 2;
/// Bytes of one f32 value.
pub const F32: usize = 4;
const GIB: f64 = (1u64 << 30) as f64;

/// What a backend says of its own memory ([`crate::Backend::memory_facts`]), for a workspace
/// of a given number of rows; a [`MemoryPlan`] adds these to the model's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendMemory {
    /// Bytes of one stored value of the weights, caches and workspace.
    pub value_bytes: usize,
    /// With caches in a page pool, its page's bytes: each buffer of a sequence is taken in
    /// whole pages. `None`: caches take exactly their bytes.
    pub cache_page: Option<usize>,
    /// The backend's own scratch for a workspace of those rows.
    pub scratch: usize,
    /// Fixed runtime bytes (e.g. a GPU context).
    pub runtime: usize,
    /// 4-bit and FP8 weights are kept packed ([`crate::Backend::upload_quantized`],
    /// [`crate::Backend::upload_fp8`]), not as values.
    pub packs_quantized: bool,
    /// An FP8 K/V cache is kept as codes and scales ([`fp8_kv_row_bytes`] a token and layer
    /// for K, the same for V), not as values.
    pub packs_fp8_kv: bool,
    /// Tensor parallelism: the plan counts one rank's part of the weights, caches and
    /// workspace (all ranks' together where they share one memory).
    pub ranks: Option<RankShare>,
}

/// How a tensor-parallel backend's ranks hold the model ([`BackendMemory::ranks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankShare {
    pub tp: crate::parallel::TensorParallel,
    /// The ranks share one memory (simulated ranks on the CPU): a plan is all of theirs.
    pub one_memory: bool,
}

/// Bytes of a token's FP8 K (or V) row in a sparse layer: `kv_heads · head_dim` E4M3 codes,
/// then an f32 scale per KV head, padded to a multiple of 16 bytes.
pub fn fp8_kv_row_bytes(kv_heads: usize, head_dim: usize) -> usize {
    kv_heads * head_dim + (4 * kv_heads).next_multiple_of(16)
}

/// Bytes of one sequence's cache at `context` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CacheBytes {
    /// Full K and V of every sparse layer.
    pub kv: usize,
    /// Level-1 and level-2 compressed keys.
    pub compressed: usize,
    /// The lightning layers' fp32 states (independent of the context).
    pub lightning_state: usize,
}

impl CacheBytes {
    pub fn total(&self) -> usize {
        self.kv + self.compressed + self.lightning_state
    }
}

/// Cache bytes with compressed keys in bf16 and K, V in the cache's dtype (as on the GPU).
pub fn cache_bytes(c: &ModelConfig, context: usize) -> CacheBytes {
    cache_bytes_with(c, context, BF16, None, true)
}

/// What one sparse layer of a sequence at `context` tokens holds: level-1 and level-2
/// compressed windows, bytes of a compressed key in `value_bytes` each, and of a token's K
/// (or V) row (an FP8 row for an FP8 cache when `packs_fp8`).
struct SparseRows {
    n1: usize,
    n2: usize,
    row: usize,
    kv_row: usize,
}

fn sparse_rows(c: &ModelConfig, context: usize, value_bytes: usize, packs_fp8: bool) -> SparseRows {
    let s = &c.sparse;
    let windows = |w: usize, st: usize| {
        if context >= w {
            (context - w) / st + 1
        } else {
            0
        }
    };
    let row = c.kv_dim() * value_bytes;
    SparseRows {
        n1: windows(s.k1_window(), s.k1_stride()),
        n2: windows(s.k2_window(), s.k2_stride()),
        row,
        kv_row: match c.sparse.kv_cache {
            KvCacheDtype::Fp8 if packs_fp8 => fp8_kv_row_bytes(c.num_key_value_heads, c.head_dim),
            _ => row,
        },
    }
}

/// Cache bytes with K, V and compressed keys stored in `value_bytes` each (K and V as FP8
/// rows instead for an FP8 cache when `packs_fp8`); with `page`, each buffer (a sparse
/// layer's K and V, its level-1 and level-2 keys with one spare row each as a reserved cache
/// holds them, a lightning layer's state) rounded up to whole pages.
fn cache_bytes_with(
    c: &ModelConfig,
    context: usize,
    value_bytes: usize,
    page: Option<usize>,
    packs_fp8: bool,
) -> CacheBytes {
    let sparse = c.layer_count(MixerKind::Sparse);
    let lightning = c.layer_count(MixerKind::Lightning);
    let SparseRows {
        n1,
        n2,
        row,
        kv_row,
    } = sparse_rows(c, context, value_bytes, packs_fp8);
    let state = c.num_attention_heads * c.head_dim * c.head_dim * F32;
    match page {
        None => CacheBytes {
            kv: sparse * 2 * context * kv_row,
            compressed: sparse * (n1 + n2) * row,
            lightning_state: lightning * state,
        },
        Some(page) => {
            let pages = |bytes: usize| bytes.div_ceil(page.max(1)) * page.max(1);
            CacheBytes {
                kv: sparse * 2 * pages(context * kv_row),
                compressed: sparse * (pages((n1 + 1) * row) + pages((n2 + 1) * row)),
                lightning_state: lightning * pages(state),
            }
        }
    }
}

/// Bytes of the whole pages of `page` bytes that a fork of a sequence at `context` tokens
/// maps from it rather than copying (each sparse layer's K, V and compressed tiers below
/// what `context` tokens fill), values and FP8 rows as [`cache_bytes_with`] counts them.
pub fn shared_prefix_bytes(
    c: &ModelConfig,
    context: usize,
    value_bytes: usize,
    page: usize,
    packs_fp8: bool,
) -> usize {
    let r = sparse_rows(c, context, value_bytes, packs_fp8);
    let whole = |bytes: usize| bytes / page.max(1) * page.max(1);
    c.layer_count(MixerKind::Sparse)
        * (2 * whole(context * r.kv_row) + whole(r.n1 * r.row) + whole(r.n2 * r.row))
}

/// Bytes a sequence that speculates holds beside its caches: a copy of every lightning state
/// (the mark a rejected draft rewinds to) and, per lightning layer, the k and v rows of the
/// span it verifies ([`crate::STEPWISE_SPAN_ROWS`] rows, counted at 4 bytes a value).
pub fn speculation_bytes(c: &ModelConfig) -> usize {
    let lightning = c.layer_count(MixerKind::Lightning);
    let kv_width = c.lightning_nkv * c.head_dim;
    cache_bytes(c, 0).lightning_state + lightning * 2 * crate::STEPWISE_SPAN_ROWS * kv_width * F32
}

/// Whether a backend that packs quantized weights holds a 4-bit matrix of `cols` inputs in
/// groups of `group` packed: its products walk whole slabs of 128 inputs, a group a multiple of
/// 32 (others are held as bf16 values).
pub fn packs_w4(cols: usize, group: usize) -> bool {
    cols.is_multiple_of(128) && group.is_multiple_of(32)
}

/// Group words a row of a packed 4-bit matrix holds in each slab of 128 inputs: one when 128
/// divides the group, else one for each 32-input quarter of the slab.
pub fn w4_group_slots(group: usize) -> usize {
    if group.is_multiple_of(128) {
        1
    } else {
        4
    }
}

/// Words of one record of a packed 4-bit matrix: an M-tile of 16 rows times a slab of 128
/// inputs (256 words of values), with its rows' group words.
pub fn w4_record_words(group: usize) -> usize {
    256 + 16 * w4_group_slots(group)
}

/// Bytes of a packed 4-bit `[rows, cols]` matrix: a record for each tile of 16 rows (the last
/// padded) and slab of 128 inputs.
pub fn w4_packed_bytes(rows: usize, cols: usize, group: usize) -> usize {
    rows.div_ceil(16) * (cols / 128) * w4_record_words(group) * 4
}

/// Bytes of the weights in bf16.
pub fn weight_bytes(c: &ModelConfig) -> usize {
    weights_held(c, BF16, false)
}

/// Bytes of the weights held as values of `value_bytes`, quantized linears packed when
/// `packs_quantized`: 4-bit ones in records ([`w4_packed_bytes`]) where the 4-bit products take
/// their shape ([`packs_w4`]), FP8 ones at a byte a weight
/// and an f32 scale a row.
pub fn weights_held(c: &ModelConfig, value_bytes: usize, packs_quantized: bool) -> usize {
    tensors_held(
        c,
        &sala_checkpoint::expected_tensors(c),
        value_bytes,
        packs_quantized,
        None,
    )
}

/// [`weights_held`] of the tensors `tensors` of a model of `c`: with `tp`, its first rank's
/// parts (4-bit ones in the groups [`crate::parallel::Shard::quant_group`] gives them).
fn tensors_held(
    c: &ModelConfig,
    tensors: &[sala_checkpoint::TensorSpec],
    value_bytes: usize,
    packs_quantized: bool,
    tp: Option<&crate::parallel::TensorParallel>,
) -> usize {
    tensors
        .iter()
        .map(|t| {
            let n = t.numel();
            let linear = matches!(t.place, sala_checkpoint::Place::Layer(..)) && t.shape.len() == 2;
            if linear && c.fp8_linear(&t.name) {
                return match packs_quantized {
                    true => n + t.shape[0] * F32,
                    false => n * value_bytes,
                };
            }
            match &c.quantization {
                Some(q) if packs_quantized && linear && q.quantizes(&t.name) => {
                    let (rows, cols) = (t.shape[0], t.shape[1]);
                    let whole = q.group_size.unwrap_or(cols);
                    let g = tp
                        .and_then(|tp| tp.shard_of(c, &t.name, 0))
                        .map_or(whole, |s| s.quant_group(whole));
                    if packs_w4(cols, g) {
                        w4_packed_bytes(rows, cols, g)
                    } else {
                        n * value_bytes
                    }
                }
                _ => n * value_bytes,
            }
        })
        .sum()
}

/// How many scratch buffers a [`crate::Workspace`] holds.
pub const WORKSPACE_BUFFERS: usize = 12;

/// The buffers of [`crate::Model::workspace`], in its order, as (name, columns); each holds
/// one row per token of a chunk. `Model::workspace` allocates exactly these, so the plan and
/// the model cannot disagree.
pub fn workspace_columns(c: &ModelConfig) -> [(&'static str, usize); WORKSPACE_BUFFERS] {
    let hd = c.num_attention_heads * c.head_dim;
    [
        ("h", c.hidden_size),
        ("a", c.hidden_size),
        ("branch", c.hidden_size),
        ("q", hd),
        ("o", hd),
        ("z", hd),
        ("ks", c.kv_dim()),
        ("vs", c.kv_dim()),
        ("kl", c.lightning_kv_dim()),
        ("vl", c.lightning_kv_dim()),
        ("gate_up", 2 * c.intermediate_size),
        ("act", c.intermediate_size),
    ]
}

/// Memory one sequence of `context` tokens needs on a backend whose steps hold `rows` rows (a
/// prompt chunk and the decode rows beside it): the model's weights, the sequence's caches,
/// the step workspace, and the backend's scratch and runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemoryPlan {
    /// Tokens the sequence holds at most (prompt and generated).
    pub context: usize,
    /// Rows of the step workspace.
    pub rows: usize,
    pub weights: usize,
    pub cache: CacheBytes,
    pub workspace: usize,
    /// The backend's own scratch ([`BackendMemory::scratch`]).
    pub scratch: usize,
    /// The backend's fixed runtime cost ([`BackendMemory::runtime`]).
    pub runtime: usize,
}

impl MemoryPlan {
    /// The plan on a backend whose `facts` are for a workspace of `rows` rows.
    pub fn new(c: &ModelConfig, context: usize, rows: usize, facts: &BackendMemory) -> Self {
        let vb = facts.value_bytes;
        let (page, fp8_kv) = (facts.cache_page, facts.packs_fp8_kv);
        let Some(share) = facts.ranks else {
            let row: usize = workspace_columns(c).iter().map(|(_, cols)| cols).sum();
            return Self {
                context,
                rows,
                weights: weights_held(c, vb, facts.packs_quantized),
                cache: cache_bytes_with(c, context, vb, page, fp8_kv),
                workspace: rows * row * vb,
                scratch: facts.scratch,
                runtime: facts.runtime,
            };
        };
        // One rank's part: its tensors, its heads' caches, its buffers' columns.
        let tp = share.tp;
        let row: usize = workspace_columns(c)
            .iter()
            .map(|&(name, cols)| cols / tp.buffer_ways(c, name))
            .sum();
        let weights = tensors_held(
            c,
            &tp.rank_tensors(c, 0),
            vb,
            facts.packs_quantized,
            Some(&tp),
        );
        let cache = cache_bytes_with(&tp.rank_config(c), context, vb, page, fp8_kv);
        let times = if share.one_memory { tp.ranks } else { 1 };
        Self {
            context,
            rows,
            weights: weights * times,
            cache: CacheBytes {
                kv: cache.kv * times,
                compressed: cache.compressed * times,
                lightning_state: cache.lightning_state * times,
            },
            workspace: rows * row * vb * times,
            scratch: facts.scratch * times,
            runtime: facts.runtime * times,
        }
    }

    pub fn total(&self) -> usize {
        self.weights + self.cache.total() + self.workspace + self.scratch + self.runtime
    }

    /// Bytes `limit` leaves for the caches of every sequence once the rest of this plan
    /// (weights, workspace, scratch, runtime) is held.
    pub fn room_for_caches(&self, limit: &MemoryLimit) -> usize {
        limit
            .bytes
            .saturating_sub(self.total() - self.cache.total())
    }

    /// Checks the plan against `limit`: an error naming both sizes and the main terms.
    pub fn check(&self, limit: &MemoryLimit) -> Result<(), OverBudget> {
        if self.total() <= limit.bytes {
            Ok(())
        } else {
            Err(OverBudget {
                plan: *self,
                limit: limit.clone(),
            })
        }
    }

    /// The terms in GiB, for messages: "weights 17.65 GiB, K/V 8.00 GiB, ...".
    pub fn describe(&self) -> String {
        let g = |b: usize| format!("{:.2} GiB", b as f64 / GIB);
        let mut s = format!(
            "weights {}, K/V cache {}, compressed keys {}, lightning states {}, workspace {} \
             ({} rows)",
            g(self.weights),
            g(self.cache.kv),
            g(self.cache.compressed),
            g(self.cache.lightning_state),
            g(self.workspace),
            self.rows
        );
        if self.scratch + self.runtime > 0 {
            s += &format!(
                ", backend scratch {}, runtime {}",
                g(self.scratch),
                g(self.runtime)
            );
        }
        s
    }
}

/// A cap on the memory one plan may use, and what set it (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    pub bytes: usize,
    /// E.g. "--max-memory 30G" or "the device's total memory".
    pub source: String,
}

impl MemoryLimit {
    /// The tighter of two optional limits.
    pub fn tighter(a: Option<Self>, b: Option<Self>) -> Option<Self> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
            (a, b) => a.or(b),
        }
    }
}

/// A plan that does not fit its limit.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "{} tokens need {:.2} GiB of memory but {:.2} GiB are allowed ({}; {} > {} bytes): {}",
    plan.context,
    plan.total() as f64 / GIB,
    limit.bytes as f64 / GIB,
    limit.source,
    plan.total(),
    limit.bytes,
    plan.describe()
)]
pub struct OverBudget {
    pub plan: MemoryPlan,
    pub limit: MemoryLimit,
}

/// Parses a size such as `30G`, `30GiB`, `28000M`, `1.5T` or `4096` (bytes). Units are powers
/// of 1024 whatever their spelling (K, KB, KiB; M; G; T), case-insensitive.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t
        .find(|ch: char| !(ch.is_ascii_digit() || ch == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?}; expected a size such as 30G, 30GiB or 28000M"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a size such as 30G, 30GiB or 28000M"))?;
    let bytes = value * (1u64 << shift) as f64;
    if bytes.is_nan() || bytes < 1.0 || bytes >= usize::MAX as f64 {
        return Err(format!("{s:?}: must be at least 1 byte and a sane size"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released() -> ModelConfig {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/released_config.json"
        );
        ModelConfig::from_file(std::path::Path::new(path)).unwrap()
    }

    const MIB: usize = 1 << 20;

    #[test]
    fn released_shape_matches_spec_figures() {
        let c = released();
        assert_eq!(weight_bytes(&c), 2 * 9_477_203_968); // SPEC §1
        let m = cache_bytes(&c, 1 << 20);
        assert_eq!(m.kv, 8 << 30); // 8 KiB per token (SPEC §5.7)
        assert_eq!(m.lightning_state, 48 << 20); // SPEC §4.4
        let ratio = m.compressed as f64 / (m.kv as f64 / 2.0);
        assert!((ratio - (1.0 / 16.0 + 1.0 / 64.0)).abs() < 1e-3, "{ratio}");
    }

    /// Facts of a backend storing `value_bytes`-byte values, with `page`, and no allowances.
    fn facts(value_bytes: usize, page: Option<usize>) -> BackendMemory {
        BackendMemory {
            value_bytes,
            cache_page: page,
            scratch: 0,
            runtime: 0,
            packs_quantized: false,
            packs_fp8_kv: false,
            ranks: None,
        }
    }

    #[test]
    fn plan_sums_the_backends_facts() {
        let c = released();
        let bf16 = BackendMemory {
            scratch: 5 * MIB,
            runtime: 7 * MIB,
            ..facts(BF16, None)
        };
        let p = |ctx, chunk| MemoryPlan::new(&c, ctx, chunk, &bf16);
        assert!(p(4096, 8192).total() < p(8192, 8192).total());
        assert_eq!(p(4096, 1024).workspace * 8, p(4096, 8192).workspace);
        // 12 buffers of 8192 bf16 rows: 3 x 4096 + 3 x 4096 + 2 x 256 + 2 x 4096 + 32768 + 16384.
        assert_eq!(p(4096, 8192).workspace, 8192 * 82_432 * 2);
        // f32 values double the weights, K/V and workspace; the states are f32 anyway.
        let wide = MemoryPlan::new(&c, 4096, 8192, &facts(F32, None));
        let narrow = p(4096, 8192);
        assert_eq!(wide.weights, 2 * narrow.weights);
        assert_eq!(wide.cache.kv, 2 * narrow.cache.kv);
        assert_eq!(wide.cache.lightning_state, narrow.cache.lightning_state);
        assert_eq!(wide.workspace, 2 * narrow.workspace);
        // The backend's scratch and runtime are taken as stated.
        assert_eq!((narrow.scratch, narrow.runtime), (5 * MIB, 7 * MIB));
        assert_eq!((wide.scratch, wide.runtime), (0, 0));
        let terms = narrow.weights
            + narrow.cache.kv
            + narrow.cache.compressed
            + narrow.cache.lightning_state
            + narrow.workspace
            + narrow.scratch
            + narrow.runtime;
        assert_eq!(narrow.total(), terms);
    }

    #[test]
    fn pool_plan_rounds_each_buffer_to_pages() {
        let c = released();
        let page = 2 * MIB;
        let plain = |ctx| MemoryPlan::new(&c, ctx, 8192, &facts(BF16, None));
        let pool = |ctx| MemoryPlan::new(&c, ctx, 8192, &facts(BF16, Some(page)));
        // 1M tokens: K and V are whole pages (512 MiB each); the tiers get one more row and
        // round up; the 2 MiB states are one page each.
        let (a, b) = (plain(1 << 20), pool(1 << 20));
        assert_eq!(b.cache.kv, a.cache.kv);
        assert_eq!(b.cache.lightning_state, a.cache.lightning_state);
        assert!(b.cache.compressed > a.cache.compressed);
        assert!(b.cache.compressed <= a.cache.compressed + 8 * 2 * page);
        // 16 tokens more: each of the 16 K and V buffers takes one more page.
        assert_eq!(pool((1 << 20) + 16).cache.kv, (8 << 30) + 16 * page);
        // A short context still takes a page for every buffer.
        let short = pool(100).cache;
        assert_eq!(short.kv, 16 * page);
        assert_eq!(short.compressed, 16 * page);
        assert_eq!(short.lightning_state, 24 * page);
    }

    #[test]
    fn room_for_caches_is_the_limit_less_the_rest_of_the_plan() {
        let c = released();
        let limit = MemoryLimit {
            bytes: 30 << 30,
            source: "--max-memory 30G".into(),
        };
        let p = |ctx| MemoryPlan::new(&c, ctx, 8192, &facts(BF16, Some(2 * MIB)));
        // Whatever the context, the same room: the caches are what it leaves out.
        let room = p(4096).room_for_caches(&limit);
        assert_eq!(room, p(1 << 20).room_for_caches(&limit));
        // The 1M plan fits, so its caches fit the room, with what the plan leaves spare.
        let big = p(1 << 20);
        assert!(big.check(&limit).is_ok());
        assert_eq!(room - big.cache.total(), limit.bytes - big.total());
        // A limit below the weights leaves none.
        let tiny = MemoryLimit {
            bytes: 1 << 30,
            source: "--max-memory 1G".into(),
        };
        assert_eq!(big.room_for_caches(&tiny), 0);
    }

    #[test]
    fn check_names_needed_and_allowed() {
        let c = released();
        let p = MemoryPlan::new(&c, 1 << 20, 8192, &facts(BF16, None));
        let limit = |gib: usize| MemoryLimit {
            bytes: gib << 30,
            source: "--max-memory test".into(),
        };
        assert!(p.check(&limit(30)).is_ok());
        let e = p.check(&limit(20)).unwrap_err().to_string();
        let need = format!("need {:.2} GiB", p.total() as f64 / GIB);
        let bytes = format!("{} > {} bytes", p.total(), 20usize << 30);
        for needle in [
            need.as_str(),
            bytes.as_str(),
            "20.00 GiB are allowed",
            "--max-memory test",
            "1048576 tokens",
            "weights 17.65 GiB",
            "K/V cache 8.00 GiB",
            "workspace",
        ] {
            assert!(e.contains(needle), "{needle:?} not in {e}");
        }
        let t = MemoryLimit::tighter(Some(limit(30)), Some(limit(20))).unwrap();
        assert_eq!(t.bytes, 20 << 30);
        assert_eq!(
            MemoryLimit::tighter(None, Some(limit(5))).unwrap().bytes,
            5 << 30
        );
        assert_eq!(MemoryLimit::tighter(None, None), None);
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("30G").unwrap(), 30 << 30);
        assert_eq!(parse_size("30GiB").unwrap(), 30 << 30);
        assert_eq!(parse_size("30gb").unwrap(), 30 << 30);
        assert_eq!(parse_size("28000M").unwrap(), 28000 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        for bad in ["", "G", "30X", "-1G", "0", "1.2.3G", "30 G B", "abc"] {
            assert!(parse_size(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_fork_shares_the_whole_pages_below_its_point() {
        let c = released();
        let page = 2 * MIB;
        let shared = |tokens| shared_prefix_bytes(&c, tokens, BF16, page, false);
        // 4096 tokens of K (2 KV heads x 128 x 2 bytes) fill one page exactly; the compressed
        // tiers (255 and 63 windows) fill none.
        assert_eq!(shared(4095), 0);
        assert_eq!(shared(4096), 8 * 2 * page);
        // At 1M: K and V are 256 whole pages each, level 1 (65,535 windows of 512 bytes) 15
        // whole pages of its 16, level 2 (16,383) 3 of its 4.
        assert_eq!(shared(1 << 20), 8 * (2 * 256 + 15 + 3) * page);
        // Never more than the pages the sequence holds.
        let held = cache_bytes_with(&c, 1 << 20, BF16, Some(page), false);
        assert!(shared(1 << 20) <= held.kv + held.compressed);
    }
}

#[cfg(test)]
mod rank_tests {
    use super::*;
    use crate::parallel::TensorParallel;

    fn facts(ranks: Option<RankShare>) -> BackendMemory {
        BackendMemory {
            value_bytes: BF16,
            cache_page: None,
            scratch: 3 * 1024,
            runtime: 5 * 1024,
            packs_quantized: true,
            packs_fp8_kv: true,
            ranks,
        }
    }

    /// A tensor-parallel plan counts one rank's part: over 1 rank the plain plan; over 2 the
    /// replicated tensors (embeddings, lm_head, norms) whole and the rest halved, half the
    /// K/V, compressed keys and lightning states, the split buffers halved; past the sparse
    /// layers' KV heads each rank's KV group whole. Ranks sharing one memory count them all.
    #[test]
    fn a_rank_plan_counts_one_ranks_part() {
        let c = sala_checkpoint::preset("minicpm-sala-9b").unwrap();
        let (ctx, rows) = (1 << 20, 8192);
        let plain = MemoryPlan::new(&c, ctx, rows, &facts(None));
        let share = |ranks, one_memory| RankShare {
            tp: TensorParallel::new(&c, ranks).unwrap(),
            one_memory,
        };
        let one = MemoryPlan::new(&c, ctx, rows, &facts(Some(share(1, false))));
        assert_eq!(one, plain);
        let whole: usize = sala_checkpoint::expected_tensors(&c)
            .iter()
            .filter(|t| !t.name.starts_with("model.layers.") || t.shape.len() == 1)
            .filter(|t| !t.name.ends_with("o_norm.weight"))
            .map(|t| t.numel() * BF16)
            .sum();
        let two = MemoryPlan::new(&c, ctx, rows, &facts(Some(share(2, false))));
        assert_eq!(two.weights, whole + (plain.weights - whole) / 2);
        assert_eq!(two.cache.kv * 2, plain.cache.kv);
        assert_eq!(two.cache.compressed * 2, plain.cache.compressed);
        assert_eq!(two.cache.lightning_state * 2, plain.cache.lightning_state);
        let residual = 3 * c.hidden_size * rows * BF16;
        assert_eq!(two.workspace, residual + (plain.workspace - residual) / 2);
        assert_eq!((two.scratch, two.runtime), (plain.scratch, plain.runtime));
        // Past the KV heads: a KV head (its k and v rows, its cache) on each of its ranks,
        // its group's q, o_gate and o_proj whole (o_proj with zeros for the other ranks' heads).
        let eight = MemoryPlan::new(&c, ctx, rows, &facts(Some(share(8, false))));
        assert_eq!(eight.cache.kv * 2, plain.cache.kv);
        assert_eq!(eight.cache.lightning_state * 8, plain.cache.lightning_state);
        let sparse = c.layer_count(MixerKind::Sparse);
        let hd = c.num_attention_heads * c.head_dim;
        let group = hd / c.num_key_value_heads;
        let kv = c.num_key_value_heads * c.head_dim;
        let extra = sparse * 3 * (group - hd / 8) * c.hidden_size * BF16
            + sparse * 2 * (c.head_dim - kv / 8) * c.hidden_size * BF16;
        assert_eq!(eight.weights, whole + (plain.weights - whole) / 8 + extra);
        // Simulated ranks in one memory: every rank's part.
        let shared = MemoryPlan::new(&c, ctx, rows, &facts(Some(share(2, true))));
        assert_eq!(shared.total(), 2 * two.total());
        // 4-bit weights: a rank's part of each packed weight, its scales and zeros too.
        for (group, ranks) in [(128, 2), (1024, 2), (1024, 8)] {
            let mut q = c.clone();
            q.quantization = Some(sala_checkpoint::quant::Gptq {
                group_size: Some(group),
                sym: true,
                zero_minus_one: true,
                skip: vec![],
            });
            let tp = TensorParallel::new(&q, ranks).unwrap();
            let plain = MemoryPlan::new(&q, ctx, rows, &facts(None)).weights;
            let split = MemoryPlan::new(&q, ctx, rows, &facts(Some(share(ranks, false))));
            let linear = |t: &sala_checkpoint::TensorSpec| {
                t.name.starts_with("model.layers.") && t.shape.len() == 2
            };
            let whole: usize = sala_checkpoint::expected_tensors(&q)
                .iter()
                .filter(|t| !linear(t) && !t.name.ends_with("o_norm.weight"))
                .map(|t| t.numel() * BF16)
                .sum();
            // Over 8 ranks each part of a lightning o_proj (512 inputs) is one group of 512.
            let o_proj = tp
                .shard_of(&q, "model.layers.1.self_attn.o_proj.weight", 0)
                .unwrap();
            let g = o_proj.quant_group(group);
            assert_eq!(g, group.min(c.hidden_size / ranks), "{group} over {ranks}");
            if ranks == 2 {
                assert_eq!(split.weights, whole + (plain - whole) / 2, "{group}");
            } else {
                // The sparse layers' extra (their KV groups whole) aside, every part of 4
                // bits a weight and one scale and zero per row and group.
                assert!(split.weights > whole + (plain - whole) / 8, "{group}");
            }
        }
    }
}
