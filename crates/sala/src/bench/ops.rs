//! Single ops timed alone on random inputs (`sala bench --kernel`): the lightning prefill and
//! a sparse layer's attention, with the useful work each does.

use super::BenchArgs;
use crate::device::DeviceStats;
use anyhow::Result;
use sala_checkpoint::ModelConfig;
use sala_model::{Backend, SparseMode};
use serde_json::{json, Value};
use std::time::Instant;

/// FLOPs of chunked Simple GLA over `t` tokens (chunks of 64): per token and head, Q·Kᵀ and
/// P·V within the chunk (2·64·d each) and Q·S and Kᵀ·V against the state (2·d² each). The
/// same count as `scripts/fla_bench.py` uses for flash-linear-attention.
pub fn lightning_flops(t: usize, heads: usize, d: usize) -> f64 {
    (t * heads) as f64 * (4.0 * 64.0 * d as f64 + 4.0 * (d * d) as f64)
}

/// Random activations `[rows, cols]`: rows of a random table, gathered with `embed` (a backend
/// op).
fn random_act<B: Backend>(be: &B, rows: usize, cols: usize, seed: u64) -> Result<B::Act> {
    let table = be.random_matrix("table", rows, cols, seed, 0.0, 1.0)?;
    let mut act = be.alloc(rows, cols)?;
    let ids: Vec<u32> = (0..rows as u32).collect();
    be.embed(&table, &ids, 1.0, &mut act)?;
    Ok(act)
}

/// Times the lightning prefill op alone on random inputs: for each context, the median over
/// `--repeat` runs of the whole context in chunks of `--prefill-chunk` from a fresh state.
pub(super) fn lightning_op<B: Backend + DeviceStats>(
    be: &B,
    config: &ModelConfig,
    contexts: &[usize],
    args: &BenchArgs,
) -> Result<Vec<Value>> {
    let heads = config.num_attention_heads;
    let d = config.head_dim;
    let shape = sala_model::AttnShape {
        heads,
        kv_heads: config.lightning_nkv,
        head_dim: d,
    };
    let rows = args
        .prefill_chunk
        .min(contexts.iter().copied().max().unwrap_or(1));
    let fill = |cols: usize, seed: u64| random_act(be, rows, cols, args.seed ^ seed);
    let mut out = be.alloc(rows, shape.q_width())?;
    let mut probe = be.alloc(1, 1)?;
    let slopes = be.upload_table(&config.lightning_slopes())?;
    let mut results = Vec::new();
    println!(
        "{:>9} {:>11} {:>10} {:>13}",
        "context", "lightning ms", "TFLOP/s", "tokens/s"
    );
    for &len in contexts {
        let mut times = Vec::new();
        for rep in 0..args.repeat + 1 {
            // Every chunk sees the same random contents: the op's cost does not depend on them.
            let (mut q, mut k, mut v) = (
                fill(shape.q_width(), 1)?,
                fill(shape.kv_width(), 2)?,
                fill(shape.kv_width(), 3)?,
            );
            let mut state = be.new_lightning_state(heads, d)?;
            be.to_host(&probe)?; // wait for earlier work
            let start = Instant::now();
            let mut done = 0;
            while done < len {
                let n = rows.min(len - done);
                for a in [&mut q, &mut k, &mut v, &mut out] {
                    be.set_rows(a, n);
                }
                let io = sala_model::AttnIo {
                    q: &mut q,
                    k: &mut k,
                    v: &mut v,
                    out: &mut out,
                };
                let span = sala_model::Span {
                    first_row: 0,
                    len: n,
                    pos: done,
                };
                be.lightning(shape, &slopes, None, None, io, &[span], &mut [&mut state])?;
                done += n;
            }
            be.set_rows(&mut probe, 1);
            be.to_host(&probe)?;
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64()); // the first run is warm-up
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let tflops = lightning_flops(len, heads, d) / median / 1e12;
        println!(
            "{:>9} {:>12.3} {:>10.1} {:>13.0}",
            len,
            1e3 * median,
            tflops,
            len as f64 / median
        );
        results.push(json!({
            "context": len,
            "median_s": median,
            "tflops": tflops,
            "repeat": args.repeat,
            "chunk": rows,
        }));
    }
    Ok(results)
}

/// Useful work of a sparse layer's attention for queries at positions `first..first + rows`
/// (SPEC §5.4–5.6), counted as an exact kernel would do it once: in sparse mode, block scores
/// over the level-1 and level-2 compressed keys each query sees, and attention over the keys
/// of its selected blocks (at most `selected_blocks` blocks of `block_size`, none past the
/// query); in dense mode, attention over every key up to the query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseWork {
    /// FLOPs of the block scores (q·K1 and q·K2, every query head).
    pub select_flops: f64,
    /// FLOPs of the attention (q·K and P·V, every query head).
    pub attention_flops: f64,
    /// Bytes of the selected K/V blocks, read once for each query and KV group.
    pub kv_bytes_per_query: f64,
    /// Bytes of all K/V the queries can see, read once for each KV group (the least any
    /// attention kernel reads).
    pub kv_bytes_once: f64,
}

pub fn sparse_work(
    shape: sala_model::AttnShape,
    cfg: &sala_checkpoint::SparseConfig,
    mode: SparseMode,
    first: usize,
    rows: usize,
) -> SparseWork {
    let sparse = mode == SparseMode::Sparse;
    let d = shape.head_dim as f64;
    let heads = shape.heads as f64;
    // Windows of a tier wholly at or before token t.
    let seen = |t: usize, window: usize, stride: usize| {
        if t + 1 >= window {
            (t + 1 - window) / stride + 1
        } else {
            0
        }
    };
    let most_keys = if sparse {
        cfg.selected_blocks() * cfg.block_size
    } else {
        usize::MAX
    };
    let mut w = SparseWork {
        select_flops: 0.0,
        attention_flops: 0.0,
        kv_bytes_per_query: 0.0,
        kv_bytes_once: 0.0,
    };
    // Keys and values of one token of one KV group, bf16.
    let kv_token_bytes = 2.0 * 2.0 * d;
    for t in first..first + rows {
        if sparse {
            let windows = seen(t, cfg.k1_window(), cfg.k1_stride())
                + seen(t, cfg.k2_window(), cfg.k2_stride());
            w.select_flops += heads * 2.0 * d * windows as f64;
        }
        let keys = (t + 1).min(most_keys) as f64;
        w.attention_flops += heads * 4.0 * d * keys;
        w.kv_bytes_per_query += shape.kv_heads as f64 * keys * kv_token_bytes;
    }
    w.kv_bytes_once = shape.kv_heads as f64 * (first + rows) as f64 * kv_token_bytes;
    w
}

/// Neighbouring queries `attention_gather` takes together on Hopper-class cards.
const GATHER_TILE: usize = 4;

/// Blocks a prefill chunk's block lists name (`lists`: per query of positions `first..`, per
/// KV group, `k_sel` entries, −1 padded), counted per list, and counted once per tile of `tile`
/// neighbouring positions (from a multiple of `tile`) and KV group: what a kernel reading each
/// query's blocks itself reads, and what one reading a tile's union once does.
fn blocks_read(
    lists: &[i32],
    first: usize,
    kv_heads: usize,
    k_sel: usize,
    tile: usize,
) -> (usize, usize) {
    let rows = lists.len() / (kv_heads * k_sel).max(1);
    let list = |i: usize, g: usize| {
        let at = (i * kv_heads + g) * k_sel;
        lists[at..at + k_sel].iter().filter(|&&b| b >= 0)
    };
    let per_list = (0..rows)
        .flat_map(|i| (0..kv_heads).map(move |g| (i, g)))
        .map(|(i, g)| list(i, g).count())
        .sum();
    let mut per_tile = 0;
    let mut i = 0;
    while i < rows {
        let end = ((first + i) / tile + 1) * tile - first;
        let end = end.min(rows);
        for g in 0..kv_heads {
            let mut union: Vec<i32> = (i..end).flat_map(|r| list(r, g).copied()).collect();
            union.sort_unstable();
            union.dedup();
            per_tile += union.len();
        }
        i = end;
    }
    (per_list, per_tile)
}

/// Times a sparse layer's attention alone: for each context, the last `--prefill-chunk`
/// queries over a cache of random keys and values holding the tokens before them (median of
/// `--repeat` runs, a fresh cache each); prints its useful TFLOP/s and, profiled, selection and
/// attention apart.
pub(super) fn sparse_op<B: Backend + DeviceStats>(
    be: &B,
    config: &ModelConfig,
    contexts: &[usize],
    args: &BenchArgs,
) -> Result<Vec<Value>> {
    let shape = sala_model::AttnShape {
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
    };
    let cfg = &config.sparse;
    let rows = args
        .prefill_chunk
        .min(contexts.iter().copied().min().unwrap_or(1))
        .max(1);
    let fill = |cols: usize, seed: u64| random_act(be, rows, cols, args.seed ^ seed);
    let mut out = be.alloc(rows, shape.q_width())?;
    let mut results = Vec::new();
    println!(
        "{:>9} {:>6} {:>9} {:>9} {:>10} {:>10} {:>11} {:>11} {:>9} {:>9}",
        "context",
        "rows",
        "ms",
        "TFLOP/s",
        "select ms",
        "select TF",
        "attend ms",
        "attend TF",
        "lists GB",
        "tiles GB"
    );
    for &len in contexts {
        let mut times = Vec::new();
        let mut split = (0.0, 0.0);
        // The mode a prompt of this length reads in (SPEC §5.2).
        let mode = if len < cfg.dense_len {
            SparseMode::Dense
        } else {
            SparseMode::Sparse
        };
        for rep in 0..args.repeat + 1 {
            let (mut q, mut k, mut v) = (
                fill(shape.q_width(), 1)?,
                fill(shape.kv_width(), 2)?,
                fill(shape.kv_width(), 3)?,
            );
            if args.locality != 0.0 {
                // One random row under every query, `--locality` times over.
                let shared =
                    be.random_matrix("query", 1, shape.q_width(), args.seed ^ 7, 0.0, 1.0)?;
                let mut under = be.alloc(rows, shape.q_width())?;
                be.embed(&shared, &vec![0; rows], 1.0, &mut under)?;
                be.add_scaled(&mut q, &under, args.locality)?;
            }
            let mut cache = be.new_sparse_cache(shape, cfg)?;
            if len > rows {
                be.fill_sparse_cache_random(&mut cache, cfg, len - rows, args.seed ^ rep as u64)?;
            }
            be.reserve_sparse_cache(&mut cache, cfg, len)?;
            be.synchronize()?;
            be.profile(); // what came before is not the op's
            let start = Instant::now();
            let io = sala_model::AttnIo {
                q: &mut q,
                k: &mut k,
                v: &mut v,
                out: &mut out,
            };
            let span = sala_model::Span {
                first_row: 0,
                len: rows,
                pos: len - rows,
            };
            be.sparse_attention(shape, cfg, io, &[span], &[mode], &mut [&mut cache])?;
            be.synchronize()?;
            if rep > 0 {
                times.push(start.elapsed().as_secs_f64()); // the first run is warm-up
                if let Some(kernels) = be.profile() {
                    for (name, ms, _) in kernels {
                        if name.starts_with("attention") {
                            split.1 += ms / 1e3;
                        } else if name.starts_with("select")
                            || name.starts_with("sd_")
                            || name.starts_with("sparse_select")
                        {
                            split.0 += ms / 1e3;
                        }
                    }
                }
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let work = sparse_work(shape, cfg, mode, len - rows, rows);
        // K and V bytes of the last run's lists: read per query, and once per tile.
        let key_bytes = match cfg.kv_cache {
            sala_checkpoint::KvCacheDtype::Bf16 => 2 * 2 * shape.head_dim,
            // Codes and a scale each.
            sala_checkpoint::KvCacheDtype::Fp8 => 2 * (shape.head_dim + 4),
        };
        let block_bytes = (cfg.block_size * key_bytes) as f64;
        let k_sel = cfg.selected_blocks();
        let read = match mode {
            SparseMode::Sparse => be.last_block_lists(rows * shape.kv_heads * k_sel),
            SparseMode::Dense => None,
        }
        .map(|lists| blocks_read(&lists, len - rows, shape.kv_heads, k_sel, GATHER_TILE))
        .map(|(l, t)| (l as f64 * block_bytes, t as f64 * block_bytes));
        let total = work.select_flops + work.attention_flops;
        let reps = args.repeat as f64;
        let (select_s, attend_s) = (split.0 / reps, split.1 / reps);
        let tf = |flops: f64, s: f64| (s > 0.0).then(|| flops / s / 1e12);
        // Profiled parts: ms and TFLOP/s, or "-" where there is no profile.
        let part = |flops: f64, s: f64| match tf(flops, s) {
            Some(t) => (format!("{:.3}", 1e3 * s), format!("{t:.1}")),
            None => ("-".to_string(), "-".to_string()),
        };
        let ((sel_ms, sel_tf), (att_ms, att_tf)) = (
            part(work.select_flops, select_s),
            part(work.attention_flops, attend_s),
        );
        let gb = |b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.2}", b / 1e9));
        let (lists_gb, tiles_gb) = (gb(read.map(|r| r.0)), gb(read.map(|r| r.1)));
        println!(
            "{:>9} {:>6} {:>9.3} {:>9.1} {sel_ms:>10} {sel_tf:>10} {att_ms:>11} {att_tf:>11} \
             {lists_gb:>9} {tiles_gb:>9}",
            len,
            rows,
            1e3 * median,
            tf(total, median).unwrap_or(0.0),
        );
        results.push(json!({
            "context": len,
            "rows": rows,
            "locality": args.locality,
            "mode": if mode == SparseMode::Dense { "dense" } else { "sparse" },
            "median_s": median,
            "tflops": tf(total, median),
            "select_tflops": tf(work.select_flops, select_s),
            "attention_tflops": tf(work.attention_flops, attend_s),
            "select_flops": work.select_flops,
            "attention_flops": work.attention_flops,
            "kv_bytes_per_query": work.kv_bytes_per_query,
            "kv_bytes_once": work.kv_bytes_once,
            "kv_bytes_lists": read.map(|r| r.0),
            "kv_bytes_tile_unions": read.map(|r| r.1),
            "tile_queries": GATHER_TILE,
            "profiled_select_s": (select_s > 0.0).then_some(select_s),
            "profiled_attention_s": (attend_s > 0.0).then_some(attend_s),
            "repeat": args.repeat,
        }));
    }
    eprintln!(
        "useful work: block scores over the compressed keys each query sees, attention over \
         the keys of its selected blocks; lists GB: the K and V of every query's selected blocks, \
         tiles GB: of the union of each tile of {GATHER_TILE} neighbouring queries' lists (what a \
         gather reading each of a tile's blocks once would read)"
    );
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sala_checkpoint::preset;

    #[test]
    fn blocks_read_counts_each_list_and_each_tiles_union() {
        // Two KV groups, 3 entries a list; positions 6.. in tiles of 4: rows 0-1 (positions
        // 6, 7), then rows 2-4 (positions 8-10).
        #[rustfmt::skip]
        let lists = [
            0, 1, -1,   0, 2, 3,  // position 6: group 0, group 1
            0, 1, 2,    0, 3, -1, // 7
            5, -1, -1,  1, -1, -1, // 8
            5, 6, -1,   1, 2, -1, // 9
            7, -1, -1,  2, -1, -1, // 10
        ];
        let (per_list, per_tile) = blocks_read(&lists, 6, 2, 3, 4);
        assert_eq!(per_list, 2 + 3 + 3 + 2 + 1 + 1 + 2 + 2 + 1 + 1);
        // Tile 1: {0,1,2} and {0,2,3}; tile 2: {5,6,7} and {1,2}.
        assert_eq!(per_tile, 3 + 3 + 3 + 2);
        assert_eq!(blocks_read(&lists, 6, 2, 3, 1), (per_list, per_list));
    }

    #[test]
    fn sparse_work_counts_what_each_query_sees() {
        let c = preset("minicpm-sala-9b").unwrap();
        let shape = sala_model::AttnShape {
            heads: 32,
            kv_heads: 2,
            head_dim: 128,
        };
        let one = |mode, t| sparse_work(shape, &c.sparse, mode, t, 1);
        // Dense: every key up to the query, no block scores.
        let w = one(SparseMode::Dense, 999);
        assert_eq!(w.select_flops, 0.0);
        assert_eq!(w.attention_flops, 32.0 * 4.0 * 128.0 * 1000.0);
        // Sparse: position 30 sees no level-1 window (32 tokens, stride 16), 31 sees one;
        // position 127 sees 7 level-1 windows and the first level-2 one (128 tokens).
        assert_eq!(one(SparseMode::Sparse, 30).select_flops, 0.0);
        assert_eq!(one(SparseMode::Sparse, 31).select_flops, 32.0 * 2.0 * 128.0);
        assert_eq!(
            one(SparseMode::Sparse, 127).select_flops,
            32.0 * 2.0 * 128.0 * 8.0
        );
        // Attention reaches at most 96 blocks of 64 keys.
        let far = one(SparseMode::Sparse, 1 << 20);
        assert_eq!(far.attention_flops, 32.0 * 4.0 * 128.0 * 6144.0);
        assert_eq!(far.kv_bytes_per_query, 2.0 * 6144.0 * 2.0 * 2.0 * 128.0);
        assert_eq!(
            far.kv_bytes_once,
            2.0 * ((1 << 20) + 1) as f64 * 2.0 * 2.0 * 128.0
        );
        // A run of queries is the sum of its queries.
        let run = sparse_work(shape, &c.sparse, SparseMode::Sparse, 5000, 3);
        let sum: f64 = (5000..5003)
            .map(|t| one(SparseMode::Sparse, t).select_flops)
            .sum();
        assert_eq!(run.select_flops, sum);
    }
}
