//! The fast CPU attention paths held to the oracle on random inputs at ragged lengths,
//! in one pass, in chunks of any size, and token by token.

use sala_checkpoint::{alibi_slopes, SparseConfig};
use sala_cpu::attention::{lightning, select_blocks, sparse_layer_attention, SparseCache};
use sala_model::numerics::{first_mismatch, TestRng};
use sala_model::oracle::{self, AttnShape, SparseMode};

fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    if let Some((i, g, w)) = first_mismatch(got, want, atol, rtol) {
        panic!("{what}: element {i}: got {g}, want {w}");
    }
}

/// Splits `n` into random chunk lengths (1 ..= max).
fn random_chunks(rng: &mut TestRng, n: usize, max: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut left = n;
    while left > 0 {
        let c = (1 + rng.below(max)).min(left);
        out.push(c);
        left -= c;
    }
    out
}

#[test]
fn lightning_matches_oracle_one_pass_and_chunked() {
    let mut rng = TestRng::new(7);
    for (heads, kv_heads, d) in [(4, 4, 16), (4, 2, 8), (2, 1, 32)] {
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let slopes = alibi_slopes(heads);
        for t_n in [1, 2, 17, 63, 64, 65, 128, 131, 200] {
            let q = rng.bf16_vec(t_n * shape.q_width(), -1.0, 1.0);
            let k = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let v = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let init = rng.bf16_vec(heads * d * d, -0.5, 0.5);
            let (want_o, want_s) = oracle::lightning(shape, &slopes, &q, &k, &v, Some(&init));

            let mut s = init.clone();
            let o = lightning(shape, &slopes, &q, &k, &v, &mut s);
            let ctx = format!("H{heads}/{kv_heads} d{d} T{t_n}");
            assert_close(&format!("{ctx} one-pass o"), &o, &want_o, 1e-4, 1e-4);
            assert_close(&format!("{ctx} one-pass state"), &s, &want_s, 1e-4, 1e-4);

            // The same tokens in ragged chunks, decode steps included.
            let mut s = init.clone();
            let mut o = Vec::new();
            let mut at = 0;
            for c in random_chunks(&mut rng, t_n, 70) {
                o.extend(lightning(
                    shape,
                    &slopes,
                    &q[at * shape.q_width()..(at + c) * shape.q_width()],
                    &k[at * shape.kv_width()..(at + c) * shape.kv_width()],
                    &v[at * shape.kv_width()..(at + c) * shape.kv_width()],
                    &mut s,
                ));
                at += c;
            }
            assert_close(&format!("{ctx} chunked o"), &o, &want_o, 1e-4, 1e-4);
            assert_close(&format!("{ctx} chunked state"), &s, &want_s, 1e-4, 1e-4);
        }
    }
}

/// A small sparse config so the sparse path runs on short sequences: blocks of 16 tokens,
/// 6 selected blocks (96 tokens), level-1 windows 8/4, level-2 windows 32/16.
fn small_sparse() -> SparseConfig {
    SparseConfig {
        kernel_size: 8,
        kernel_stride: 4,
        block_size: 16,
        init_blocks: 1,
        window_size: 32,
        topk: 4,
        use_nope: false,
        dense_len: 96,
        ..SparseConfig::default()
    }
}

#[test]
fn compression_is_incremental_and_matches_oracle() {
    let mut rng = TestRng::new(3);
    let shape = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let cfg = small_sparse();
    let n = 301;
    let keys = rng.bf16_vec(n * shape.kv_width(), -2.0, 2.0);
    let mut cache = SparseCache::new(shape, &cfg);
    let mut at = 0;
    for c in random_chunks(&mut rng, n, 40) {
        let rows = &keys[at * shape.kv_width()..(at + c) * shape.kv_width()];
        cache.append(rows, rows);
        at += c;
        let seen = &keys[..at * shape.kv_width()];
        assert_close(
            "k1",
            &cache.k1,
            &oracle::compress_keys(seen, shape.kv_width(), 8, 4),
            0.0,
            0.0,
        );
        assert_close(
            "k2",
            &cache.k2,
            &oracle::compress_keys(seen, shape.kv_width(), 32, 16),
            0.0,
            0.0,
        );
    }
}

fn check_sparse_layer(
    seed: u64,
    shape: AttnShape,
    cfg: &SparseConfig,
    n: usize,
    mode: SparseMode,
    max_chunk: usize,
) {
    let mut rng = TestRng::new(seed);
    let q = rng.bf16_vec(n * shape.q_width(), -1.5, 1.5);
    let k = rng.bf16_vec(n * shape.kv_width(), -1.5, 1.5);
    let v = rng.bf16_vec(n * shape.kv_width(), -1.0, 1.0);
    let want = oracle::sparse_layer_attention(shape, cfg, mode, &q, 0, &k, &v);

    let mut cache = SparseCache::new(shape, cfg);
    let mut got = Vec::new();
    let mut at = 0;
    for c in random_chunks(&mut rng, n, max_chunk) {
        let kv = |x: &[f32]| x[at * shape.kv_width()..(at + c) * shape.kv_width()].to_vec();
        cache.append(&kv(&k), &kv(&v));
        got.extend(sparse_layer_attention(
            &cache,
            mode,
            &q[at * shape.q_width()..(at + c) * shape.q_width()],
        ));
        at += c;
    }
    let ctx = format!("{mode:?} N{n} chunks<= {max_chunk} seed {seed}");
    assert_close(&ctx, &got, &want, 1e-4, 1e-3);

    // The selected blocks themselves, for every query and group.
    if mode == SparseMode::Sparse {
        let mut p = Vec::new();
        for t in 0..n {
            let q_row = &q[t * shape.q_width()..][..shape.q_width()];
            let want_keys = oracle::attended_keys(shape, cfg, mode, q_row, t, &k);
            for (g, want_g) in want_keys.iter().enumerate() {
                let got_keys: Vec<usize> = match select_blocks(&cache, q_row, t, g, &mut p) {
                    None => (0..=t).collect(),
                    Some(b) => b
                        .iter()
                        .flat_map(|&b| b * cfg.block_size..((b + 1) * cfg.block_size).min(t + 1))
                        .collect(),
                };
                assert_eq!(&got_keys, want_g, "{ctx}: keys of t={t} g={g}");
            }
        }
    }
}

#[test]
fn dense_attention_matches_oracle() {
    let shape = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    for (seed, n) in [(1, 1), (2, 37), (3, 150)] {
        check_sparse_layer(seed, shape, &small_sparse(), n, SparseMode::Dense, 50);
    }
}

#[test]
fn sparse_attention_matches_oracle_at_ragged_lengths() {
    let cfg = small_sparse();
    for (seed, shape, n, max_chunk) in [
        (
            11,
            AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
            },
            95,
            200,
        ),
        (
            12,
            AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
            },
            97,
            1,
        ),
        (
            13,
            AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
            },
            250,
            64,
        ),
        (
            14,
            AttnShape {
                heads: 6,
                kv_heads: 2,
                head_dim: 8,
            },
            333,
            300,
        ),
        (
            15,
            AttnShape {
                heads: 2,
                kv_heads: 1,
                head_dim: 32,
            },
            401,
            17,
        ),
    ] {
        check_sparse_layer(seed, shape, &cfg, n, SparseMode::Sparse, max_chunk);
    }
}

#[test]
fn sparse_attention_selects_a_strict_subset_on_long_sequences() {
    // Guards the test above against passing only because everything was selected.
    let cfg = small_sparse();
    let shape = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let mut rng = TestRng::new(5);
    let n = 400;
    let k = rng.bf16_vec(n * shape.kv_width(), -1.0, 1.0);
    let q = rng.bf16_vec(shape.q_width(), -1.0, 1.0);
    let mut cache = SparseCache::new(shape, &cfg);
    cache.append(&k, &k);
    let mut p = Vec::new();
    let blocks = select_blocks(&cache, &q, n - 1, 0, &mut p).expect("beyond the selection size");
    assert_eq!(blocks.len(), cfg.selected_blocks());
    assert!(blocks.contains(&0) && blocks.contains(&((n - 1) / 16)));
    let total = (n - 1) / 16 + 1;
    assert!(blocks.len() < total);
}
