//! Each op of the CUDA backend against the CPU backend and the oracle, at ragged shapes.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn elementwise_ops_match_cpu() {
    let g = gpu();
    let mut rng = TestRng::new(1);
    for (rows, cols) in [(1, 128), (3, 384), (17, 4096), (130, 200)] {
        let n = rows * cols;
        let x = rng.bf16_vec(n, -3.0, 3.0);
        let y = rng.bf16_vec(n, -3.0, 3.0);
        let w = rng.bf16_vec(cols, 0.5, 1.5);
        let ctx = format!("{rows}x{cols}");

        // rms_norm
        let mut c_out = cpu_act(&vec![0.0; n], cols);
        CpuBackend
            .rms_norm(&cpu_act(&x, cols), &w, 1e-6, &mut c_out)
            .unwrap();
        let gv = g
            .upload_vector(
                "w",
                HostTensor {
                    dtype: HostDType::Bf16,
                    shape: &[cols],
                    bytes: &bf16_bytes(&w),
                },
            )
            .unwrap();
        let mut g_out = g.act_from_host(&vec![0.0; n], cols).unwrap();
        g.rms_norm(&g.act_from_host(&x, cols).unwrap(), &gv, 1e-6, &mut g_out)
            .unwrap();
        close(
            &format!("rms_norm {ctx}"),
            &g.to_host(&g_out).unwrap(),
            &c_out.data,
            5e-3,
        );

        // the residual add fused with the next norm
        let mut ch = cpu_act(&x, cols);
        let mut cn = cpu_act(&vec![0.0; n], cols);
        CpuBackend
            .add_scaled_norm(&mut ch, &cpu_act(&y, cols), 0.247, &w, 1e-6, &mut cn)
            .unwrap();
        let mut gh = g.act_from_host(&x, cols).unwrap();
        let mut gn = g.act_from_host(&vec![0.0; n], cols).unwrap();
        g.add_scaled_norm(
            &mut gh,
            &g.act_from_host(&y, cols).unwrap(),
            0.247,
            &gv,
            1e-6,
            &mut gn,
        )
        .unwrap();
        close(
            &format!("add_scaled_norm h {ctx}"),
            &g.to_host(&gh).unwrap(),
            &ch.data,
            5e-3,
        );
        close(
            &format!("add_scaled_norm out {ctx}"),
            &g.to_host(&gn).unwrap(),
            &cn.data,
            5e-3,
        );

        // silu_mul, add_scaled, sigmoid_gate
        type CpuOp = fn(&mut CpuAct, &CpuAct);
        type GpuOp = fn(&CudaBackend, &mut sala_cuda::DevAct, &sala_cuda::DevAct);
        let cases: [(&str, CpuOp, GpuOp); 3] = [
            (
                "silu_mul",
                |a, b| CpuBackend.silu_mul(a, b).unwrap(),
                |g, a, b| g.silu_mul(a, b).unwrap(),
            ),
            (
                "add_scaled",
                |a, b| CpuBackend.add_scaled(a, b, 0.247).unwrap(),
                |g, a, b| g.add_scaled(a, b, 0.247).unwrap(),
            ),
            (
                "sigmoid_gate",
                |a, b| CpuBackend.sigmoid_gate(a, b).unwrap(),
                |g, a, b| g.sigmoid_gate(a, b).unwrap(),
            ),
        ];
        for (name, c_op, g_op) in cases {
            let mut ca = cpu_act(&x, cols);
            c_op(&mut ca, &cpu_act(&y, cols));
            let mut ga = g.act_from_host(&x, cols).unwrap();
            g_op(&g, &mut ga, &g.act_from_host(&y, cols).unwrap());
            close(
                &format!("{name} {ctx}"),
                &g.to_host(&ga).unwrap(),
                &ca.data,
                5e-3,
            );
        }

        // silu_mul_halves: gate and up as the two halves of one row ([rows, 2·cols] in).
        let gu = rng.bf16_vec(2 * n, -3.0, 3.0);
        let mut c_out = cpu_act(&vec![0.0; n], cols);
        CpuBackend
            .silu_mul_halves(&cpu_act(&gu, 2 * cols), &mut c_out)
            .unwrap();
        let mut g_out = g.act_from_host(&vec![0.0; n], cols).unwrap();
        g.silu_mul_halves(&g.act_from_host(&gu, 2 * cols).unwrap(), &mut g_out)
            .unwrap();
        close(
            &format!("silu_mul_halves {ctx}"),
            &g.to_host(&g_out).unwrap(),
            &c_out.data,
            5e-3,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn embed_matmul_head_norm_rope_match_cpu() {
    let g = gpu();
    let mut rng = TestRng::new(2);
    // matmul at ragged shapes, decode (1 row) included, on both GEMVs (tensor and CUDA cores).
    for (tensor_cores, rows, inner, out) in [
        (true, 1, 256, 384),
        (true, 1, 4096, 1000),
        (true, 1, 16392, 515),
        (true, 5, 4096, 256),
        (true, 12, 4104, 770),
        (true, 40, 1032, 514),
        (false, 1, 4096, 1000),
        (false, 1, 16392, 515),
        (false, 5, 4096, 256),
        (true, 64, 512, 1000),
        (true, 131, 768, 2048),
    ] {
        let variants: &[DecodeGemv] = if tensor_cores {
            &GEMVS[..1]
        } else {
            &GEMVS[1..]
        };
        let x = rng.bf16_vec(rows * inner, -1.0, 1.0);
        let w = rng.bf16_vec(out * inner, -0.1, 0.1);
        let ht = HostTensor {
            dtype: HostDType::Bf16,
            shape: &[out, inner],
            bytes: &bf16_bytes(&w),
        };
        let cw = CpuBackend.upload_matrix("w", ht).unwrap();
        let gw = g.upload_matrix("w", ht).unwrap();
        let mut co = cpu_act(&vec![0.0; rows * out], out);
        CpuBackend
            .matmul(&cpu_act(&x, inner), &cw, &mut co)
            .unwrap();
        for &variant in variants {
            set(&g, |o| o.decode_gemv = variant);
            let mut go = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
            g.matmul(&g.act_from_host(&x, inner).unwrap(), &gw, &mut go)
                .unwrap();
            close(
                &format!("matmul {rows}x{inner} by {out} ({variant:?})"),
                &g.to_host(&go).unwrap(),
                &co.data,
                5e-3,
            );
        }

        // The same weight as stacked [gate; up] (the MLP's first half) and as three stacked
        // projections split into their own outputs.
        if out % 2 == 0 {
            let half = out / 2;
            let mut cgu = cpu_act(&vec![0.0; rows * out], out);
            let mut cm = cpu_act(&vec![0.0; rows * half], half);
            CpuBackend
                .matmul_silu(&cpu_act(&x, inner), &cw, &mut cgu, &mut cm)
                .unwrap();
            let mut ggu = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
            let mut gm = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
            g.matmul_silu(&g.act_from_host(&x, inner).unwrap(), &gw, &mut ggu, &mut gm)
                .unwrap();
            close(
                &format!("matmul_silu {rows}x{inner} by {out}"),
                &g.to_host(&gm).unwrap(),
                &cm.data,
                5e-3,
            );
        }
        let widths = [out / 3, out / 3, out - 2 * (out / 3)];
        let mut cparts: Vec<_> = widths
            .iter()
            .map(|&w| cpu_act(&vec![0.0; rows * w], w))
            .collect();
        let [c0, c1, c2] = &mut cparts[..] else {
            unreachable!()
        };
        CpuBackend
            .matmul_split(&cpu_act(&x, inner), &cw, &mut [c0, c1, c2])
            .unwrap();
        let mut gparts: Vec<_> = widths
            .iter()
            .map(|&w| g.act_from_host(&vec![0.0; rows * w], w).unwrap())
            .collect();
        let [g0, g1, g2] = &mut gparts[..] else {
            unreachable!()
        };
        g.matmul_split(&g.act_from_host(&x, inner).unwrap(), &gw, &mut [g0, g1, g2])
            .unwrap();
        for (i, (gp, cp)) in gparts.iter().zip(&cparts).enumerate() {
            close(
                &format!("matmul_split {rows}x{inner} by {out}, part {i}"),
                &g.to_host(gp).unwrap(),
                &cp.data,
                5e-3,
            );
        }

        // embed from the same table
        let ids: Vec<u32> = (0..rows).map(|_| rng.below(out) as u32).collect();
        let mut ce = cpu_act(&vec![0.0; rows * inner], inner);
        CpuBackend.embed(&cw, &ids, 12.0, &mut ce).unwrap();
        let mut ge = g.act_from_host(&vec![0.0; rows * inner], inner).unwrap();
        g.embed(&gw, &ids, 12.0, &mut ge).unwrap();
        assert_eq!(g.to_host(&ge).unwrap(), ce.data, "embed is exact");
    }
    // head norm + rope, at large positions too.
    for (rows, heads, d, first) in [(1, 4, 32, 0), (7, 8, 128, 1000), (65, 2, 64, 524_287)] {
        let cols = heads * d;
        let x = rng.bf16_vec(rows * cols, -2.0, 2.0);
        let w = rng.bf16_vec(d, 0.5, 1.5);
        let inv = rope_inv_freq(d, 10000.0);
        let cw = w.clone();
        let gw = g
            .upload_vector(
                "n",
                HostTensor {
                    dtype: HostDType::Bf16,
                    shape: &[d],
                    bytes: &bf16_bytes(&w),
                },
            )
            .unwrap();
        let ginv = g.upload_table(&inv).unwrap();
        for (norm, rope) in [(true, true), (false, true), (true, false)] {
            let mut c = cpu_act(&x, cols);
            sala_cpu::head_norm_rope(
                &mut c.data,
                cols,
                d,
                norm.then_some((cw.as_slice(), 1e-6)),
                rope.then_some((inv.as_slice(), first)),
            );
            let mut ga = g.act_from_host(&x, cols).unwrap();
            g.head_norm_rope(
                &mut ga,
                d,
                norm.then_some((&gw, 1e-6)),
                rope.then_some((&ginv, first)),
            )
            .unwrap();
            close(
                &format!("head_norm_rope rows {rows} d {d} pos {first} norm {norm} rope {rope}"),
                &g.to_host(&ga).unwrap(),
                &c.data,
                5e-3,
            );
        }
    }
}

/// The span of a call's `rows` rows, all of one sequence from position 0 (the positions matter
/// only for RoPE, which these calls leave out).
fn whole(rows: usize) -> Span {
    Span {
        first_row: 0,
        len: rows,
        pos: 0,
    }
}

/// Lightning over `q`, `k`, `v` (host rows) from the state `init` on the GPU: the outputs and
/// the final state.
fn gpu_lightning(
    g: &CudaBackend,
    shape: AttnShape,
    slopes: &<CudaBackend as Backend>::Table,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    init: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let rows = q.len() / shape.q_width();
    let mut st = Store::Own(g.f32_from_host(init).unwrap());
    let mut out = g
        .act_from_host(&vec![0.0; rows * shape.q_width()], shape.q_width())
        .unwrap();
    let io = AttnIo {
        q: &mut g.act_from_host(q, shape.q_width()).unwrap(),
        k: &mut g.act_from_host(k, shape.kv_width()).unwrap(),
        v: &mut g.act_from_host(v, shape.kv_width()).unwrap(),
        out: &mut out,
    };
    g.lightning(
        shape,
        slopes,
        None,
        None,
        io,
        &[whole(rows)],
        &mut [&mut st],
    )
    .unwrap();
    let Store::Own(st) = &st else { unreachable!() };
    (g.to_host(&out).unwrap(), g.f32_to_host(st).unwrap())
}

/// Every lightning prefill variant (each shape takes the first at or after it that handles it).
const LIGHTNING: [LightningPrefill; 4] = [
    LightningPrefill::TwoPass,
    LightningPrefill::Fused,
    LightningPrefill::Split,
    LightningPrefill::Chunked,
];

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn lightning_matches_oracle() {
    let g = gpu();
    let mut rng = TestRng::new(3);
    for (heads, kv_heads, d) in [(4, 4, 32), (4, 2, 64), (32, 32, 128)] {
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let slopes = sala_checkpoint::alibi_slopes(heads);
        let gs = g.upload_table(&slopes).unwrap();
        // 2100 tokens cross a range of chunks of the tensor-core path (2048 tokens at 32x128²);
        // 4500 and 9001 run as 2 and 4 ranges in parallel (a short last one).
        let lens: &[usize] = if heads == 32 {
            &[1, 7, 64, 65, 200, 2100, 4500, 9001]
        } else {
            &[1, 7, 64, 65, 200, 4500]
        };
        for &t_n in lens {
            let q = rng.bf16_vec(t_n * shape.q_width(), -1.0, 1.0);
            let k = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let v = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let init = rng.bf16_vec(heads * d * d, -0.3, 0.3);
            // The oracle is quadratic in T; past a few hundred tokens the CPU backend's chunked
            // form (held to the oracle by sala-cpu's tests) is the reference.
            let (want_o, want_s) = if t_n <= 256 {
                oracle::lightning(shape, &slopes, &q, &k, &v, Some(&init))
            } else {
                let mut s = init.clone();
                let o = cpu_attn::lightning(shape, &slopes, &q, &k, &v, &mut s);
                (o, s)
            };
            for variant in LIGHTNING {
                set(&g, |o| o.lightning_prefill = variant);
                let (o, st) = gpu_lightning(&g, shape, &gs, &q, &k, &v, &init);
                let ctx = format!("H{heads}/{kv_heads} d{d} T{t_n} {variant:?}");
                close(&format!("{ctx} o"), &o, &want_o, 5e-3);
                close(&format!("{ctx} state"), &st, &want_s, 1e-4);
            }
        }
    }
}

/// Lightning prefill in two passes (chunk states in order, then all outputs in parallel) gives
/// the one-pass kernel's bits, across windows of the states' scratch and partial chunks.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn lightning_two_pass_equals_one_pass() {
    let g = gpu();
    let mut rng = TestRng::new(5);
    for (heads, kv_heads, d) in [(4, 2, 64), (32, 32, 128)] {
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let slopes = sala_checkpoint::alibi_slopes(heads);
        let gs = g.upload_table(&slopes).unwrap();
        // Under 4096 tokens the one-pass kernel runs as one range (a range changes the state's
        // summation); 2100 and 4000 at 32x128² cross windows of the two-pass scratch.
        for t_n in [256, 300, 2100, 4000] {
            let q = rng.bf16_vec(t_n * shape.q_width(), -1.0, 1.0);
            let k = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let v = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let init = rng.bf16_vec(heads * d * d, -0.3, 0.3);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let run = |variant: LightningPrefill| {
                set(&g, |o| o.lightning_prefill = variant);
                let (o, st) = gpu_lightning(&g, shape, &gs, &q, &k, &v, &init);
                (bits(&o), bits(&st))
            };
            let two_pass = run(LightningPrefill::TwoPass);
            // The one-pass kernel as planned here, and single-buffered as on 99 KiB cards.
            for profile in one_pass_plans(&g) {
                set(&g, |o| o.device_profile = profile);
                let ctx = format!(
                    "H{heads}/{kv_heads} d{d} T{t_n}, one pass on {}",
                    g.limits().name
                );
                let one_pass = run(LightningPrefill::Fused);
                assert!(one_pass.0 == two_pass.0, "{ctx}: outputs differ");
                assert!(one_pass.1 == two_pass.1, "{ctx}: states differ");
            }
            set(&g, |o| o.device_profile = base_options().device_profile);
        }
    }
}

/// The device profiles to run the one-pass lightning kernel under: this run's, and the RTX
/// 5090's (Q, K and V single-buffered) where this GPU can emulate it.
fn one_pass_plans(g: &CudaBackend) -> Vec<Option<&'static sala_cuda::Card>> {
    let rtx = sala_cuda::device::card_named("rtx5090").unwrap();
    let mut out = vec![base_options().device_profile];
    if g.driver_limits().emulating(rtx).is_ok() && out[0] != Some(rtx) {
        out.push(Some(rtx));
    }
    out
}

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
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn sparse_and_dense_attention_match_cpu_in_chunks() {
    let g = gpu();
    let released = SparseConfig::default();
    let cases = [
        (
            AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
            },
            small_sparse(),
            301,
            vec![100, 1, 1, 64, 135],
        ),
        (
            AttnShape {
                heads: 8,
                kv_heads: 1,
                head_dim: 64,
            },
            small_sparse(),
            97,
            vec![97],
        ),
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
            1500,
            // 37 queries: few enough for the decode kernels (selection and attention).
            vec![700, 1, 37, 762],
        ),
        (
            AttnShape {
                heads: 32,
                kv_heads: 2,
                head_dim: 128,
            },
            released.clone(),
            7000,
            vec![4000, 2999, 1],
        ),
    ];
    for (seed, (shape, cfg, n, chunks)) in cases.into_iter().enumerate() {
        let mut rng = TestRng::new(10 + seed as u64);
        let q = rng.bf16_vec(n * shape.q_width(), -1.5, 1.5);
        let k = rng.bf16_vec(n * shape.kv_width(), -1.5, 1.5);
        let v = rng.bf16_vec(n * shape.kv_width(), -1.0, 1.0);
        for (mode, attention) in [
            (SparseMode::Dense, Attention::WarpWalk),
            (SparseMode::Sparse, Attention::WarpWalk),
            (SparseMode::Dense, Attention::Staged),
            (SparseMode::Sparse, Attention::Staged),
        ] {
            set(&g, |o| o.attention = attention);
            let mut cc = SparseCache::new(shape, &cfg);
            let mut gc = g.new_sparse_cache(shape, &cfg).unwrap();
            let mut at = 0;
            for &c in &chunks {
                let (qa, qb) = (at * shape.q_width(), (at + c) * shape.q_width());
                let (ka, kb) = (at * shape.kv_width(), (at + c) * shape.kv_width());
                cc.append(&k[ka..kb], &v[ka..kb]);
                let want: Vec<f32> = cpu_attn::sparse_layer_attention(&cc, mode, &q[qa..qb])
                    .into_iter()
                    .map(sala_model::numerics::bf16_round)
                    .collect();
                let mut out = g
                    .act_from_host(&vec![0.0; c * shape.q_width()], shape.q_width())
                    .unwrap();
                let io = AttnIo {
                    q: &mut g.act_from_host(&q[qa..qb], shape.q_width()).unwrap(),
                    k: &mut g.act_from_host(&k[ka..kb], shape.kv_width()).unwrap(),
                    v: &mut g.act_from_host(&v[ka..kb], shape.kv_width()).unwrap(),
                    out: &mut out,
                };
                g.sparse_attention(shape, &cfg, io, &[whole(c)], &[mode], &mut [&mut gc])
                    .unwrap();
                close(
                    &format!("{mode:?} {attention:?} {shape:?} chunk at {at} len {c}"),
                    &g.to_host(&out).unwrap(),
                    &want,
                    1e-2,
                );
                at += c;
            }
        }
    }
}

/// The tensor-core block selections (one kernel per chunk of queries for prefill, spread over
/// the compressed keys for decode) against the oracle's block scores: every list
/// holds the forced blocks, and no block left out scores above a chosen one by more than the
/// rounding of the two computations (so a differing pick is a near-tie, never a wrong block).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fast_block_selection_matches_oracle_scores() {
    let g = CudaBackend::new(0, base_options()).expect("these tests need a CUDA GPU");
    let released = SparseConfig::default();
    let cases = [
        (
            AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
            },
            small_sparse(),
            // A short span here runs as decode rows one launch each (d = 32 has no batched
            // decode rows), which leaves only its last row's list to read: 20 is a chunk.
            vec![150, 300, 1, 1, 20],
        ),
        (
            AttnShape {
                heads: 32,
                kv_heads: 2,
                head_dim: 128,
            },
            released.clone(),
            // Prefill chunks (tensor-core selection), then decode steps (spread selection).
            vec![5000, 4100, 1, 1, 2],
        ),
        (
            AttnShape {
                heads: 32,
                kv_heads: 2,
                head_dim: 128,
            },
            released.clone(),
            // Past 16K tokens: several slices of level-2 windows in the decode normaliser.
            vec![12000, 8191, 1, 3, 1],
        ),
    ];
    // The default plans (wgmma block scores on Hopper), the mma.sync twins, heads as MMA rows,
    // and the top-k's keys in global memory (as small-memory cards past ~3M tokens).
    let variants: Vec<(&str, CudaOptions)> = {
        let base = base_options();
        let with = |f: &dyn Fn(&mut CudaOptions)| {
            let mut o = base.clone();
            f(&mut o);
            o
        };
        vec![
            ("default", base.clone()),
            ("mma.sync block scores", with(&|o| o.wgmma = false)),
            (
                "heads as MMA rows",
                with(&|o| o.select_scores = SelectScores::HeadsAsRows),
            ),
            (
                "top-k keys in global memory",
                with(&|o| o.topk_keys_in_global = true),
            ),
        ]
    };
    for (name, options) in variants {
        g.set_options(options).unwrap();
        eprintln!("block selection: {name}");
        for (seed, (shape, cfg, chunks)) in cases.iter().cloned().enumerate() {
            let n: usize = chunks.iter().sum();
            let mut rng = TestRng::new(40 + seed as u64);
            let q = rng.bf16_vec(n * shape.q_width(), -1.5, 1.5);
            let k = rng.bf16_vec(n * shape.kv_width(), -1.5, 1.5);
            let v = rng.bf16_vec(n * shape.kv_width(), -1.0, 1.0);
            let mut cc = SparseCache::new(shape, &cfg);
            let mut gc = g.new_sparse_cache(shape, &cfg).unwrap();
            let k_sel = cfg.selected_blocks();
            let kvh = shape.kv_heads;
            let mut at = 0;
            let (mut checked, mut differing) = (0, 0);
            for &c in &chunks {
                let (qa, qb) = (at * shape.q_width(), (at + c) * shape.q_width());
                let (ka, kb) = (at * shape.kv_width(), (at + c) * shape.kv_width());
                cc.append(&k[ka..kb], &v[ka..kb]);
                let mut out = g
                    .act_from_host(&vec![0.0; c * shape.q_width()], shape.q_width())
                    .unwrap();
                let io = AttnIo {
                    q: &mut g.act_from_host(&q[qa..qb], shape.q_width()).unwrap(),
                    k: &mut g.act_from_host(&k[ka..kb], shape.kv_width()).unwrap(),
                    v: &mut g.act_from_host(&v[ka..kb], shape.kv_width()).unwrap(),
                    out: &mut out,
                };
                g.sparse_attention(
                    shape,
                    &cfg,
                    io,
                    &[whole(c)],
                    &[SparseMode::Sparse],
                    &mut [&mut gc],
                )
                .unwrap();
                let sel = g.last_selection(c * kvh * k_sel).unwrap();
                // Every 7th query and the chunk's last.
                for i in (0..c).step_by(7).chain([c - 1]) {
                    let t = at + i;
                    let qb = t / cfg.block_size;
                    let q_row = &q[(at + i) * shape.q_width()..][..shape.q_width()];
                    let p = if qb >= k_sel {
                        oracle::stage1_scores(shape, &cfg, q_row, t, &cc.k1, &cc.k2)
                    } else {
                        vec![Vec::new(); kvh]
                    };
                    for (gi, pg) in p.iter().enumerate() {
                        let ctx = format!("{shape:?} query {t} group {gi}");
                        let list = &sel[(i * kvh + gi) * k_sel..][..k_sel];
                        let got: Vec<usize> = list
                            .iter()
                            .filter(|&&b| b >= 0)
                            .map(|&b| b as usize)
                            .collect();
                        assert!(
                            list[got.len()..].iter().all(|&b| b == -1),
                            "{ctx}: -1 padding {list:?}"
                        );
                        assert!(
                            got.windows(2).all(|w| w[0] < w[1]),
                            "{ctx}: not ascending {got:?}"
                        );
                        assert!(
                            got.iter().all(|&b| b <= qb),
                            "{ctx}: a future block {got:?}"
                        );
                        assert_eq!(got.len(), k_sel.min(qb + 1), "{ctx}: list length");
                        if qb < k_sel {
                            continue;
                        }
                        let scores = oracle::block_scores(&cfg, pg, qb);
                        let want = oracle::select_blocks(&scores, k_sel);
                        checked += 1;
                        differing += (got != want) as usize;
                        let chosen = |b: usize| got.binary_search(&b).is_ok();
                        let min_in = got.iter().map(|&b| scores[b]).fold(f32::INFINITY, f32::min);
                        let max_out = (0..=qb)
                            .filter(|&b| !chosen(b))
                            .map(|b| scores[b])
                            .fold(f32::NEG_INFINITY, f32::max);
                        assert!(max_out < f32::INFINITY, "{ctx}: a forced block left out");
                        let tol = 0.03 * min_in.abs() + 1e-6;
                        assert!(
                            max_out <= min_in + tol,
                            "{ctx}: left out a block scoring {max_out}, chose one scoring {min_in}"
                        );
                    }
                }
                at += c;
            }
            eprintln!(
                "{shape:?}: {checked} lists checked, {differing} differ from the oracle's (near-ties)"
            );
            assert!(checked > 0, "{shape:?}: no sparse query was checked");
            assert!(
                differing * 4 <= checked,
                "{shape:?}: {differing} of {checked} lists differ from the oracle's"
            );
        }
    }
}

/// 4-bit weights on the GPU: products of 1 to 16 rows (`gemv_w4`), 17 and 40 (two launches),
/// 100 (dequantized into scratch, then cuBLAS), the stacked MLP half and a split product, and
/// 4-bit matrices stacked (4-bit beside 4-bit, and beside bf16), against the CPU on the same
/// values (the CPU holds the bf16 values the 4-bit weights stand for); groups of 32, 128 and a
/// whole row; a group of 8 (no 4-bit kernel takes it) goes up as bf16. A step of rows gives
/// each row the bits it gets alone (batch-invariant).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn four_bit_products_match_cpu() {
    use sala_model::QuantMatrix;
    let g = gpu();
    let mut rng = TestRng::new(41);
    let random_w4 = |rng: &mut TestRng, out: usize, inner: usize, group: usize| {
        let words: Vec<u32> = (0..out * inner / 8)
            .map(|_| (rng.next_u64() & 0xffff_ffff) as u32)
            .collect();
        let groups = inner / group;
        let scales: Vec<f32> = (0..out * groups)
            .map(|_| 0.002 + 0.02 * rng.uniform() as f32)
            .collect();
        let zeros: Vec<f32> = (0..out * groups).map(|_| rng.below(16) as f32).collect();
        (words, scales, zeros)
    };
    for (rows, inner, out, group) in [
        (1usize, 256usize, 384usize, 32usize),
        (1, 4096, 1000, 128),
        (3, 1024, 512, 1024),
        (16, 512, 776, 128),
        (17, 512, 256, 64),
        (40, 2048, 512, 128),
        (100, 768, 1024, 128),
        (2, 256, 96, 8),
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
        let cw = CpuBackend.upload_quantized("w", q).unwrap();
        let gw = g.upload_quantized("w", q).unwrap();
        let x = rng.bf16_vec(rows * inner, -1.0, 1.0);
        let what = format!("w4 matmul {rows}x{inner} by {out}, groups of {group}");
        check_products(&g, (&cw, &gw), &x, rows, &what, 5e-3);
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
                CpuBackend.upload_quantized("a", q).unwrap(),
                CpuBackend.upload_quantized("b", q2).unwrap(),
            ];
            let mut gparts = vec![
                g.upload_quantized("a", q).unwrap(),
                g.upload_quantized("b", q2).unwrap(),
            ];
            if with_bf16 {
                cparts.push(CpuBackend.upload_matrix("c", ht).unwrap());
                gparts.push(g.upload_matrix("c", ht).unwrap());
            }
            let total = out + 64 + if with_bf16 { 32 } else { 0 };
            let cs = CpuBackend.concat_rows(cparts).unwrap();
            let gs = g.concat_rows(gparts).unwrap();
            let mut co = cpu_act(&vec![0.0; rows * total], total);
            CpuBackend
                .matmul(&cpu_act(&x, inner), &cs, &mut co)
                .unwrap();
            let mut go = g.act_from_host(&vec![0.0; rows * total], total).unwrap();
            g.matmul(&g.act_from_host(&x, inner).unwrap(), &gs, &mut go)
                .unwrap();
            close(
                &format!("w4 stacked (bf16 beside: {with_bf16}) {rows}x{inner}"),
                &g.to_host(&go).unwrap(),
                &co.data,
                5e-3,
            );
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
        for mode in [SparseMode::Dense, SparseMode::Sparse] {
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
                let what = format!("fp8 {mode:?} {shape:?} at {at} len {c}");
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

/// FP8 weights (`--quantize fp8`) against the CPU's FP8 products: decode-sized GEMVs (each row
/// alone giving the same bits), cuBLASLt GEMMs with vector scales, scaled after, and as the
/// cards without FP8 tensor cores run them (bf16 products of the codes' values, under the
/// A100's profile); split and SiLU products; stacking.
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
    let mut a100 = base.clone();
    a100.set_device_profile("a100").unwrap();
    variants.push(("as an A100", a100));
    for (name, options) in variants {
        g.set_options(options).unwrap();
        for &(rows, inner, out) in &shapes {
            let values = rng.bf16_vec(out * inner, -0.1, 0.1);
            let (codes, scales) = sala_model::quantize_fp8(&values, out, inner);
            let m = sala_model::Fp8Matrix {
                rows: out,
                cols: inner,
                codes: &codes,
                scales: &scales,
            };
            let cw = CpuBackend.upload_fp8("w", m).unwrap();
            let gw = g.upload_fp8("w", m).unwrap();
            // Rows of very different sizes: each gets its own scale.
            let mut x = rng.bf16_vec(rows * inner, -1.0, 1.0);
            for (r, row) in x.chunks_mut(inner).enumerate() {
                let f = 2f32.powi(r as i32 % 7 - 3);
                row.iter_mut()
                    .for_each(|v| *v = sala_model::numerics::bf16_round(*v * f));
            }
            let what = format!("fp8 {name}: matmul {rows}x{inner} by {out}");
            let co = check_products(&g, (&cw, &gw), &x, rows, &what, 1e-2);
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
/// output (making the codes itself, `quant_rows_f8`) gives the same bits: plain, gated and
/// residual norms, decode rows and prefill rows, with the H200's plans and as an A100 (whose
/// prefill products read bf16 values, so only its decode rows take the norm's codes).
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
    let gv = g
        .upload_vector(
            "norm",
            HostTensor {
                dtype: HostDType::Bf16,
                shape: &[inner],
                bytes: &bf16_bytes(&w),
            },
        )
        .unwrap();
    let mut a100 = base.clone();
    a100.set_device_profile("a100").unwrap();
    for (name, options) in [("own plans", base.clone()), ("as an A100", a100)] {
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
                g.matmul(&normed, &gw, &mut first).unwrap();
                g.matmul(&normed, &gw, &mut again).unwrap();
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
/// product.
fn check_products(
    g: &CudaBackend,
    (cw, gw): (&sala_cpu::CpuMatrix, &sala_cuda::DevMatrix),
    x: &[f32],
    rows: usize,
    what: &str,
    tol: f64,
) -> Vec<f32> {
    let (out, inner) = (gw.rows, gw.cols);
    let mut co = cpu_act(&vec![0.0; rows * out], out);
    CpuBackend.matmul(&cpu_act(x, inner), cw, &mut co).unwrap();
    let mut go = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
    g.matmul(&g.act_from_host(x, inner).unwrap(), gw, &mut go)
        .unwrap();
    let got = g.to_host(&go).unwrap();
    close(what, &got, &co.data, tol);
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
        CpuBackend
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
    co.data
}
