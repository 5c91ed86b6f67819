//! Quantized weights and caches on the GPU against the CPU: 4-bit and FP8 products, the FP8
//! K/V cache's attention, and the FP8 codes the norms make for the products.

use super::ops::{small_sparse, whole};
use super::*;

/// A random `[out, inner]` 4-bit matrix in groups of `group`: its words, scales and zeros.
fn random_w4(
    rng: &mut TestRng,
    out: usize,
    inner: usize,
    group: usize,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let words: Vec<u32> = (0..out * inner / 8)
        .map(|_| (rng.next_u64() & 0xffff_ffff) as u32)
        .collect();
    let groups = inner / group;
    let scales: Vec<f32> = (0..out * groups)
        .map(|_| 0.002 + 0.02 * rng.uniform() as f32)
        .collect();
    let zeros: Vec<f32> = (0..out * groups).map(|_| rng.below(16) as f32).collect();
    (words, scales, zeros)
}

/// 4-bit weights on the GPU: products of 1 to 16 rows (`gemv_w4`), 17 and 40 (two launches),
/// 100 (dequantized into scratch, then cuBLAS), the stacked MLP half and a split product, and
/// 4-bit matrices stacked (4-bit beside 4-bit, and beside bf16), against the CPU on the same
/// values (the CPU holds the bf16 values the 4-bit weights stand for); groups of 32 to 1024,
/// 96 and a whole row of 768 (a record's group words: one a row when 128 divides the group,
/// else one a 32-input quarter), row counts that leave a tile part-filled (stacked on the host
/// then); a group of 8 (no 4-bit kernel takes it) goes up as bf16. A step of rows gives
/// each row the bits it gets alone (batch-invariant), and the fused SiLU product of decode rows
/// (`gemv_silu_w4`) the bits of the product's rows through the SiLU halves.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn four_bit_products_match_cpu() {
    use sala_model::QuantMatrix;
    let g = gpu();
    let mut rng = TestRng::new(41);
    for (rows, inner, out, group) in [
        (1usize, 256usize, 384usize, 32usize),
        (1, 4096, 1000, 128),
        (3, 1024, 512, 1024),
        (16, 512, 776, 128),
        (17, 512, 256, 64),
        (40, 2048, 512, 128),
        (100, 768, 1024, 128),
        (5, 768, 200, 96),
        (9, 768, 64, 768),
        (2, 256, 96, 8),
        // k not a multiple of 128: held as bf16 (memory::packs_w4).
        (1, 160, 96, 32),
        (6, 96, 40, 32),
        (20, 352, 72, 32),
    ] {
        let (words, scales, zeros) = random_w4(&mut rng, out, inner, group);
        let q = QuantMatrix {
            rows: out,
            cols: inner,
            group,
            words: &words,
            scales: &scales,
            zeros: &zeros,
        };
        let cw = CpuBackend::default().upload_quantized("w", q).unwrap();
        let gw = g.upload_quantized("w", q).unwrap();
        let x = rng.bf16_vec(rows * inner, -1.0, 1.0);
        let what = format!("w4 matmul {rows}x{inner} by {out}, groups of {group}");
        let (_, got) = check_products(&g, (&cw, &gw), &x, rows, &what, 5e-3);
        if rows <= 64 && out % 2 == 0 && gw.w4.is_some() {
            check_silu_bits(&g, &gw, &x, rows, &got, &what);
        }
        // Stacked: two 4-bit halves, then 4-bit beside bf16.
        let (w2, s2, z2) = random_w4(&mut rng, 64, inner, group);
        let q2 = QuantMatrix {
            rows: 64,
            cols: inner,
            group,
            words: &w2,
            scales: &s2,
            zeros: &z2,
        };
        let plain = rng.bf16_vec(32 * inner, -0.1, 0.1);
        let ht = HostTensor {
            dtype: HostDType::Bf16,
            shape: &[32, inner],
            bytes: &bf16_bytes(&plain),
        };
        for with_bf16 in [false, true] {
            let mut cparts = vec![
                CpuBackend::default().upload_quantized("a", q).unwrap(),
                CpuBackend::default().upload_quantized("b", q2).unwrap(),
            ];
            let mut gparts = vec![
                g.upload_quantized("a", q).unwrap(),
                g.upload_quantized("b", q2).unwrap(),
            ];
            if with_bf16 {
                cparts.push(CpuBackend::default().upload_matrix("c", ht).unwrap());
                gparts.push(g.upload_matrix("c", ht).unwrap());
            }
            let total = out + 64 + if with_bf16 { 32 } else { 0 };
            let cs = CpuBackend::default().concat_rows(cparts).unwrap();
            let gs = g.concat_rows(gparts).unwrap();
            assert_eq!(cs.rows, total);
            close(
                &format!("w4 stacked (bf16 beside: {with_bf16}) {rows}x{inner}"),
                &gpu_matmul(&g, &x, &gs, rows),
                &cpu_matmul(&x, &cs),
                5e-3,
            );
        }
    }
}

/// The residual add and norm made inside the 4-bit SiLU product after them
/// (`add_scaled_norm_matmul_silu` of one row: `gemv_silu_w4_8_norm`) give the bits of the two
/// ops run apart (`add_scaled_norm`, then `matmul_silu`): the new residual, the norm's output
/// and the product, for widths of 512 to 8,192 and groups of 64 to a whole row, twice in a row
/// (the blocks' ticket starts at 0 again); two rows take the ops apart. Under every plan and
/// profile the suite runs with (the rows' blocks count with the card's SMs).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn four_bit_norm_in_product_is_the_ops_apart() {
    use sala_model::QuantMatrix;
    let g = gpu();
    let mut rng = TestRng::new(53);
    for (inner, inter, group) in [
        (4096usize, 1024usize, 128usize),
        (1024, 264, 1024),
        (512, 40, 64),
        (8192, 64, 128),
        (1280, 96, 1280),
    ] {
        let out = 2 * inter;
        let (words, scales, zeros) = random_w4(&mut rng, out, inner, group);
        let q = QuantMatrix {
            rows: out,
            cols: inner,
            group,
            words: &words,
            scales: &scales,
            zeros: &zeros,
        };
        let gw = g.upload_quantized("gate_up", q).unwrap();
        assert!(gw.w4.is_some(), "{inner}: held as 4-bit");
        let nv = gpu_vector(&g, &rng.bf16_vec(inner, 0.5, 1.5));
        for rows in [1usize, 1, 2] {
            let what = format!("{rows} row(s) of {inner} by [gate; up] {out}, groups of {group}");
            let h0 = rng.bf16_vec(rows * inner, -3.0, 3.0);
            let branch = g
                .act_from_host(&rng.bf16_vec(rows * inner, -3.0, 3.0), inner)
                .unwrap();
            let run = |fused: bool| {
                let mut h = g.act_from_host(&h0, inner).unwrap();
                let mut a = g.act_from_host(&vec![0.0; rows * inner], inner).unwrap();
                let mut gu = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
                let mut y = g.act_from_host(&vec![0.0; rows * inter], inter).unwrap();
                if fused {
                    g.add_scaled_norm_matmul_silu(
                        &mut h, &branch, 0.25, &nv, 1e-6, &mut a, &gw, &mut gu, &mut y,
                    )
                    .unwrap();
                } else {
                    g.add_scaled_norm(&mut h, &branch, 0.25, &nv, 1e-6, &mut a)
                        .unwrap();
                    g.matmul_silu(&a, &gw, &mut gu, &mut y).unwrap();
                }
                [h, a, y].map(|t| g.to_host(&t).unwrap())
            };
            let before = g.norms_in_products();
            let fused = run(true);
            let made = g.norms_in_products() - before;
            assert_eq!(made, usize::from(rows == 1), "{what}: fused launches");
            let apart = run(false);
            for (name, (f, p)) in ["h", "norm", "product"]
                .iter()
                .zip(fused.iter().zip(&apart))
            {
                let differ = f
                    .iter()
                    .zip(p)
                    .filter(|(u, v)| u.to_bits() != v.to_bits())
                    .count();
                assert_eq!(
                    differ,
                    0,
                    "{what}: {name} differs in {differ} of {}",
                    f.len()
                );
            }
        }
    }
}

/// An FP8 K/V cache (`--kv-cache-dtype fp8`) against the CPU's FP8 cache: prompt chunks (one
/// split, written directly), lone decode rows (split and merged), a step of decode rows of
/// several sequences (the batched kernel), a short span as decode rows, a copied and a
/// truncated cache; keys and values of magnitudes far apart from token to token, so each
/// token's scale matters. Then a random fill (slabs) against the bf16 cache's, and the
/// refusal of a shape the FP8 kernels do not take.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fp8_kv_cache_attention_matches_cpu() {
    let g = gpu();
    let released = SparseConfig {
        kv_cache: KvCacheDtype::Fp8,
        ..SparseConfig::default()
    };
    let cases = [
        (
            AttnShape {
                heads: 8,
                kv_heads: 1,
                head_dim: 64,
            },
            SparseConfig {
                window_size: 128,
                topk: 4,
                dense_len: 0,
                ..released.clone()
            },
            vec![700, 1, 37, 3, 762, 1],
        ),
        (
            AttnShape {
                heads: 32,
                kv_heads: 2,
                head_dim: 128,
            },
            released.clone(),
            vec![4000, 2999, 1, 5, 1],
        ),
    ];
    for (seed, (shape, cfg, chunks)) in cases.into_iter().enumerate() {
        let n: usize = chunks.iter().sum();
        let mut rng = TestRng::new(90 + seed as u64);
        let q = rng.bf16_vec(n * shape.q_width(), -1.5, 1.5);
        let scaled = |rng: &mut TestRng, spread: f32| -> Vec<f32> {
            let mut x = rng.bf16_vec(n * shape.kv_width(), -spread, spread);
            for row in x.chunks_mut(shape.head_dim) {
                let f = 2f32.powi(rng.below(9) as i32 - 4);
                row.iter_mut()
                    .for_each(|v| *v = sala_model::numerics::bf16_round(*v * f));
            }
            x
        };
        let (k, v) = (scaled(&mut rng, 0.4), scaled(&mut rng, 1.0));
        // The prompt chunks' gather in stages of 32 keys and of 16.
        for (mode, keys) in [
            (SparseMode::Dense, 32),
            (SparseMode::Sparse, 32),
            (SparseMode::Sparse, 16),
        ] {
            set(&g, |o| o.gather_keys = keys);
            // Sequence 0 is the one under test; 1 and 2 copy it and ride along in the
            // decode steps, as a batch of three.
            let mut cc = SparseCache::new(shape, &cfg);
            let mut gc = [0, 1, 2].map(|_| g.new_sparse_cache(shape, &cfg).unwrap());
            let mut at = 0;
            for &c in &chunks {
                let (qa, qb) = (at * shape.q_width(), (at + c) * shape.q_width());
                let (ka, kb) = (at * shape.kv_width(), (at + c) * shape.kv_width());
                cc.append(&k[ka..kb], &v[ka..kb]);
                let want: Vec<f32> = cpu_attn::sparse_layer_attention(&cc, mode, &q[qa..qb])
                    .into_iter()
                    .map(sala_model::numerics::bf16_round)
                    .collect();
                let what = format!("fp8 {mode:?} {keys} keys {shape:?} at {at} len {c}");
                let batched = c == 1 && at > 0;
                let (rows, spans, caches): (usize, Vec<Span>, Vec<usize>) = if batched {
                    // The row for every sequence: 0 and copies of 0 made just before.
                    for i in 1..3 {
                        let (src, dst) = gc.split_at_mut(i);
                        let fresh = g.new_sparse_cache(shape, &cfg).unwrap();
                        dst[0] = fresh;
                        g.copy_sparse_cache(&src[0], &mut dst[0]).unwrap();
                    }
                    let spans = (0..3)
                        .map(|i| Span {
                            first_row: i,
                            len: 1,
                            pos: at,
                        })
                        .collect();
                    (3, spans, vec![0, 1, 2])
                } else {
                    (c, vec![whole(c)], vec![0])
                };
                let rep = |x: &[f32]| x.repeat(rows / c);
                let mut out = g
                    .act_from_host(&vec![0.0; rows * shape.q_width()], shape.q_width())
                    .unwrap();
                let io = AttnIo {
                    q: &mut g.act_from_host(&rep(&q[qa..qb]), shape.q_width()).unwrap(),
                    k: &mut g.act_from_host(&rep(&k[ka..kb]), shape.kv_width()).unwrap(),
                    v: &mut g.act_from_host(&rep(&v[ka..kb]), shape.kv_width()).unwrap(),
                    out: &mut out,
                };
                let modes = vec![mode; spans.len()];
                let (a, rest) = gc.split_at_mut(1);
                let (b, c2) = rest.split_at_mut(1);
                let mut all: Vec<&mut DevSparseCache> = vec![&mut a[0], &mut b[0], &mut c2[0]];
                all.truncate(caches.len());
                g.sparse_attention(shape, &cfg, io, &spans, &modes, &mut all)
                    .unwrap();
                let got = g.to_host(&out).unwrap();
                for (r, row) in got.chunks(c * shape.q_width()).enumerate() {
                    close(&format!("{what} sequence {r}"), row, &want, 1e-2);
                }
                at += c;
            }
            // Cut back past the last chunk and go on: the cache reads as the CPU's.
            let keep = n - chunks[chunks.len() - 2] - 1;
            g.truncate_sparse_cache(&mut gc[0], &cfg, keep).unwrap();
            cc.truncate(keep).unwrap();
            let (qa, ka) = (keep * shape.q_width(), keep * shape.kv_width());
            cc.append(&k[ka..ka + shape.kv_width()], &v[ka..ka + shape.kv_width()]);
            let want: Vec<f32> =
                cpu_attn::sparse_layer_attention(&cc, mode, &q[qa..qa + shape.q_width()])
                    .into_iter()
                    .map(sala_model::numerics::bf16_round)
                    .collect();
            let mut out = g
                .act_from_host(&vec![0.0; shape.q_width()], shape.q_width())
                .unwrap();
            let io = AttnIo {
                q: &mut g
                    .act_from_host(&q[qa..qa + shape.q_width()], shape.q_width())
                    .unwrap(),
                k: &mut g
                    .act_from_host(&k[ka..ka + shape.kv_width()], shape.kv_width())
                    .unwrap(),
                v: &mut g
                    .act_from_host(&v[ka..ka + shape.kv_width()], shape.kv_width())
                    .unwrap(),
                out: &mut out,
            };
            g.sparse_attention(shape, &cfg, io, &[whole(1)], &[mode], &mut [&mut gc[0]])
                .unwrap();
            close(
                &format!("fp8 {mode:?} {shape:?} after truncating to {keep}"),
                &g.to_host(&out).unwrap(),
                &want,
                1e-2,
            );
        }
    }

    // A random fill of 20000 tokens (two slabs) reads as the bf16 cache's random fill, to FP8.
    let shape = AttnShape {
        heads: 8,
        kv_heads: 1,
        head_dim: 64,
    };
    let bf16_cfg = SparseConfig {
        window_size: 128,
        topk: 4,
        dense_len: 0,
        ..SparseConfig::default()
    };
    let fp8_cfg = SparseConfig {
        kv_cache: KvCacheDtype::Fp8,
        ..bf16_cfg.clone()
    };
    let mut rng = TestRng::new(7);
    let q = rng.bf16_vec(3 * shape.q_width(), -1.5, 1.5);
    let kv = rng.bf16_vec(3 * shape.kv_width(), -1.0, 1.0);
    let mut outs = Vec::new();
    for cfg in [&bf16_cfg, &fp8_cfg] {
        let mut c = g.new_sparse_cache(shape, cfg).unwrap();
        g.fill_sparse_cache_random(&mut c, cfg, 20000, 5).unwrap();
        let mut out = g
            .act_from_host(&vec![0.0; 3 * shape.q_width()], shape.q_width())
            .unwrap();
        let io = AttnIo {
            q: &mut g.act_from_host(&q, shape.q_width()).unwrap(),
            k: &mut g.act_from_host(&kv, shape.kv_width()).unwrap(),
            v: &mut g.act_from_host(&kv, shape.kv_width()).unwrap(),
            out: &mut out,
        };
        g.sparse_attention(
            shape,
            cfg,
            io,
            &[whole(3)],
            &[SparseMode::Sparse],
            &mut [&mut c],
        )
        .unwrap();
        outs.push(g.to_host(&out).unwrap());
    }
    let err = sala_model::numerics::rel_l2(&outs[1], &outs[0]);
    assert!(
        err > 0.0 && err < 0.06,
        "FP8 random fill vs bf16: relative L2 {err}"
    );

    // head_dim 32 and 16-token blocks: refused by name, not run wrong.
    let tiny = AttnShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
    };
    let cfg = SparseConfig {
        kv_cache: KvCacheDtype::Fp8,
        ..small_sparse()
    };
    let err = g.new_sparse_cache(tiny, &cfg).err().expect("refused");
    assert!(
        err.0.contains("FP8") && err.0.contains("head_dim 32"),
        "{}",
        err.0
    );
    // A model of that shape is refused when it loads, not at its first request.
    let mut config = preset("tiny").unwrap();
    config.sparse.kv_cache = KvCacheDtype::Fp8;
    let err = Model::random(&g, config, 1, &mut |_, _| {})
        .err()
        .expect("refused at load");
    assert!(err.0.contains("FP8"), "{}", err.0);
}

/// `base` as a card without FP8 tensor cores, running its own code: the A100 where this GPU
/// can emulate it, else the RTX A6000 (an H100 has less memory than the A100 80GB).
fn without_fp8_tensor_cores(g: &CudaBackend, base: &CudaOptions) -> (&'static str, CudaOptions) {
    let mut o = base.clone();
    for (key, name) in [("a100", "as an A100"), ("a6000", "as an RTX A6000")] {
        let card = sala_cuda::device::card_named(key).unwrap();
        if g.driver_limits().emulating(card).is_ok() {
            o.device_profile = Some(card);
            return (name, o);
        }
    }
    panic!("{} emulates neither the A100 nor the RTX A6000", g.name());
}

/// FP8 weights (`--quantize fp8`) against the CPU's FP8 products: decode-sized GEMVs (each row
/// alone giving the same bits), cuBLASLt GEMMs with vector scales, scaled after, and as the
/// cards without FP8 tensor cores run them (bf16 GEMMs over the codes' values and the f16
/// decode products, under an A100's or A6000's profile and code); split and SiLU products;
/// stacking.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fp8_products_match_cpu() {
    let g = gpu();
    let base = g.options();
    let mut rng = TestRng::new(43);
    let shapes = [
        (1usize, 256usize, 384usize),
        (1, 4096, 1000),
        (3, 1024, 512),
        (16, 512, 776),
        (17, 512, 256),
        (40, 2048, 512),
        (100, 768, 1024),
        (300, 4096, 2048),
        (2, 16384, 48),
    ];
    let mut variants = vec![("vector scales", base.clone())];
    let mut after = base.clone();
    after.fp8_vector_scales = false;
    variants.push(("scaled after", after));
    variants.push(without_fp8_tensor_cores(&g, &base));
    for (name, options) in variants {
        g.set_options(options).unwrap();
        for &(rows, inner, out) in &shapes {
            let values = rng.bf16_vec(out * inner, -0.1, 0.1);
            let (mut codes, scales) = sala_model::quantize_fp8(&values, out, inner);
            // The first row of subnormal codes only (±1..7 · 2^-9), which the products must
            // not flush to zero.
            for (i, c) in codes[..inner].iter_mut().enumerate() {
                *c = (1 + i % 7) as u8 | if i % 3 == 0 { 0x80 } else { 0 };
            }
            let m = sala_model::Fp8Matrix {
                rows: out,
                cols: inner,
                codes: &codes,
                scales: &scales,
            };
            let cw = CpuBackend::default().upload_fp8("w", m).unwrap();
            let gw = g.upload_fp8("w", m).unwrap();
            // Rows of very different sizes: each gets its own scale.
            let mut x = rng.bf16_vec(rows * inner, -1.0, 1.0);
            for (r, row) in x.chunks_mut(inner).enumerate() {
                let f = 2f32.powi(r as i32 % 7 - 3);
                row.iter_mut()
                    .for_each(|v| *v = sala_model::numerics::bf16_round(*v * f));
            }
            let what = format!("fp8 {name}: matmul {rows}x{inner} by {out}");
            let (co, got) = check_products(&g, (&cw, &gw), &x, rows, &what, 1e-2);
            // The subnormal row's outputs alone (the whole product's error would hide them).
            let first = |v: &[f32]| v.iter().step_by(out).copied().collect::<Vec<_>>();
            close(
                &format!("{what}: subnormal codes"),
                &first(&got),
                &first(&co),
                1e-2,
            );
            if out % 2 == 0 {
                // Split into two outputs over the stacked weight.
                let stacked = g
                    .concat_rows(vec![
                        g.upload_fp8("a", m).unwrap(),
                        g.upload_fp8("b", m).unwrap(),
                    ])
                    .unwrap();
                let mut o1 = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
                let mut o2 = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
                g.matmul_split(
                    &g.act_from_host(&x, inner).unwrap(),
                    &stacked,
                    &mut [&mut o1, &mut o2],
                )
                .unwrap();
                for o in [&o1, &o2] {
                    close(
                        &format!("{what}: stacked"),
                        &g.to_host(o).unwrap(),
                        &co,
                        1e-2,
                    );
                }
            }
        }
    }
    g.set_options(base).unwrap();
    // A shape the FP8 products do not take, and a bf16 matrix stacked with an FP8 one.
    let (codes, scales) = sala_model::quantize_fp8(&[0.5; 24], 2, 12);
    let bad = sala_model::Fp8Matrix {
        rows: 2,
        cols: 12,
        codes: &codes,
        scales: &scales,
    };
    let e = g.upload_fp8("odd", bad).err().expect("refused");
    assert!(e.0.contains("odd") && e.0.contains("16"), "{}", e.0);
}

/// A norm feeding an FP8 product makes the product's E4M3 codes as it writes its output; the
/// product takes them instead of making them again. The same product run again on the same
/// output (making the codes itself: by `quant_rows_f8`, or, for up to 8 narrow decode rows, in
/// each block of `gemv_f8_bf16_8`) gives the same bits: plain, gated and residual norms, decode
/// rows and prefill rows, with this GPU's plans and as an A100 or A6000 (whose prefill products
/// read bf16 values, so only its decode rows take the norm's codes).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fp8_codes_made_by_norms_are_those_the_products_make() {
    let g = gpu();
    let base = g.options();
    let mut rng = TestRng::new(47);
    let (inner, out) = (1024usize, 768usize);
    let values = rng.bf16_vec(out * inner, -0.1, 0.1);
    let (codes, scales) = sala_model::quantize_fp8(&values, out, inner);
    let m = sala_model::Fp8Matrix {
        rows: out,
        cols: inner,
        codes: &codes,
        scales: &scales,
    };
    let gw = g.upload_fp8("w", m).unwrap();
    let w = rng.bf16_vec(inner, 0.5, 1.5);
    let gv = gpu_vector(&g, &w);
    for (name, options) in [
        ("own plans", base.clone()),
        without_fp8_tensor_cores(&g, &base),
    ] {
        g.set_options(options).unwrap();
        for rows in [1usize, 5, 16, 40, 300] {
            let x = rng.bf16_vec(rows * inner, -3.0, 3.0);
            let y = rng.bf16_vec(rows * inner, -3.0, 3.0);
            let gx = g.act_from_host(&x, inner).unwrap();
            let gy = g.act_from_host(&y, inner).unwrap();
            let mut normed = g.act_from_host(&vec![0.0; rows * inner], inner).unwrap();
            let mut first = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
            let mut again = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
            for norm in ["rms_norm", "rms_norm_gate", "add_scaled_norm"] {
                match norm {
                    "rms_norm" => g.rms_norm(&gx, &gv, 1e-6, &mut normed).unwrap(),
                    "rms_norm_gate" => g
                        .rms_norm_gate(&gx, &gv, 1e-6, Some(&gy), &mut normed)
                        .unwrap(),
                    _ => {
                        let mut h = g.act_from_host(&x, inner).unwrap();
                        g.add_scaled_norm(&mut h, &gy, 0.25, &gv, 1e-6, &mut normed)
                            .unwrap()
                    }
                }
                let before = g.codes_in_products();
                g.matmul(&normed, &gw, &mut first).unwrap();
                assert_eq!(
                    g.codes_in_products(),
                    before,
                    "{name}, {norm}, {rows} rows: the norm's codes were not taken"
                );
                g.matmul(&normed, &gw, &mut again).unwrap();
                // 1,024 inputs: up to 8 rows make their codes in the product's blocks.
                assert_eq!(
                    g.codes_in_products() - before,
                    usize::from(rows <= 8),
                    "{name}, {norm}, {rows} rows: where the codes were made"
                );
                let (a, b) = (g.to_host(&first).unwrap(), g.to_host(&again).unwrap());
                let differ = a
                    .iter()
                    .zip(&b)
                    .filter(|(p, q)| p.to_bits() != q.to_bits())
                    .count();
                assert_eq!(differ, 0, "{name}, {norm}, {rows} rows: products differ");
            }
        }
    }
    g.set_options(base).unwrap();
}

/// A matrix's products on the GPU against the CPU's (`what` names them): the product of `x`'s
/// `rows` rows within `tol`, each row alone with the same bits (decode-sized steps only: a
/// GEMM's may differ), and, for an even output count, the MLP's SiLU half. Returns the CPU's
/// product and the GPU's.
fn check_products(
    g: &CudaBackend,
    (cw, gw): (&sala_cpu::CpuMatrix, &sala_cuda::DevMatrix),
    x: &[f32],
    rows: usize,
    what: &str,
    tol: f64,
) -> (Vec<f32>, Vec<f32>) {
    let (out, inner) = (gw.rows, gw.cols);
    let co = cpu_matmul(x, cw);
    let got = gpu_matmul(g, x, gw, rows);
    close(what, &got, &co, tol);
    if rows <= 64 {
        for r in [0, rows - 1] {
            let mut one = g.act_from_host(&vec![0.0; out], out).unwrap();
            let xr = g
                .act_from_host(&x[r * inner..(r + 1) * inner], inner)
                .unwrap();
            g.matmul(&xr, gw, &mut one).unwrap();
            assert!(
                g.to_host(&one).unwrap() == got[r * out..(r + 1) * out],
                "{what}: row {r} alone differs"
            );
        }
    }
    if out % 2 == 0 {
        let half = out / 2;
        let mut cgu = cpu_act(&vec![0.0; rows * out], out);
        let mut cm = cpu_act(&vec![0.0; rows * half], half);
        CpuBackend::default()
            .matmul_silu(&cpu_act(x, inner), cw, &mut cgu, &mut cm)
            .unwrap();
        let mut ggu = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
        let mut gm = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
        g.matmul_silu(&g.act_from_host(x, inner).unwrap(), gw, &mut ggu, &mut gm)
            .unwrap();
        close(
            &format!("{what}: matmul_silu"),
            &g.to_host(&gm).unwrap(),
            &cm.data,
            tol,
        );
    }
    (co, got)
}

/// The fused decode SiLU product of `gw` ([gate; up]) on `rows` rows of `x` (at most 64) gives
/// the bits of the product's rows `got` through the SiLU halves, and each row those it gets
/// alone.
fn check_silu_bits(
    g: &CudaBackend,
    gw: &sala_cuda::DevMatrix,
    x: &[f32],
    rows: usize,
    got: &[f32],
    what: &str,
) {
    let (out, inner) = (gw.rows, gw.cols);
    let half = out / 2;
    let xa = g.act_from_host(x, inner).unwrap();
    let mut gu = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
    let mut fused = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
    g.matmul_silu(&xa, gw, &mut gu, &mut fused).unwrap();
    let fused = g.to_host(&fused).unwrap();
    let products = g.act_from_host(got, out).unwrap();
    let mut halves = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
    g.silu_mul_halves(&products, &mut halves).unwrap();
    assert!(
        g.to_host(&halves).unwrap() == fused,
        "{what}: matmul_silu differs from the product's SiLU halves"
    );
    for r in [0, rows - 1] {
        let xr = g
            .act_from_host(&x[r * inner..(r + 1) * inner], inner)
            .unwrap();
        let mut gu = g.act_from_host(&vec![0.0; out], out).unwrap();
        let mut one = g.act_from_host(&vec![0.0; half], half).unwrap();
        g.matmul_silu(&xr, gw, &mut gu, &mut one).unwrap();
        assert!(
            g.to_host(&one).unwrap() == fused[r * half..(r + 1) * half],
            "{what}: matmul_silu of row {r} alone differs"
        );
    }
}
