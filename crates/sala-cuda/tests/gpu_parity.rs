//! The CUDA backend held to the CPU backend and the oracle, on the GPU, on fresh random inputs
//! at ragged shapes; then whole models. These need a GPU and are ignored by `cargo test`;
//! `scripts/gpu-build.sh` builds them here and `scripts/gpu-run.sh` runs them on the GPU machine,
//! once with the GPU's own plans and once under each device profile it checks
//! (`SALA_DEVICE_PROFILE=rtx5090`, ...: the suite then runs as that card would). Within a run,
//! each test loops over the kernel variants (`CudaOptions`) of the ops it checks.

use sala_checkpoint::{
    preset, write_random_checkpoint, Checkpoint, DType, MixerKind, ModelConfig, SparseConfig,
    WriteOptions,
};
use sala_cpu::attention::{self as cpu_attn, SparseCache};
use sala_cpu::{CpuAct, CpuBackend};
use sala_cuda::options::{Attention, DecodeGemv, LightningPrefill, SelectScores};
use sala_cuda::{CudaBackend, CudaOptions, Store};
use sala_model::numerics::{rel_l2, rope_inv_freq, TestRng};
use sala_model::oracle::{self, AttnShape, SparseMode};
use sala_model::testing::decode_step;
use sala_model::{AttnIo, Backend, GreedyPick, HostDType, HostTensor, Model, Span, WeightSource};

/// The options of this run: the environment's (`SALA_DEVICE_PROFILE` plans as that card).
fn base_options() -> CudaOptions {
    CudaOptions::from_env().expect("the SALA_* variables")
}

/// The backend with the bit-exact block selection, so whole outputs compare with the CPU's.
fn gpu() -> CudaBackend {
    let mut o = base_options();
    o.exact_select = true;
    let g = CudaBackend::new(0, o).expect("these tests need a CUDA GPU");
    eprintln!("plans for {}", g.limits().name);
    g
}

/// Runs `g` from now on with its options changed by `f`.
fn set(g: &CudaBackend, f: impl FnOnce(&mut CudaOptions)) {
    let mut o = g.options();
    f(&mut o);
    g.set_options(o).unwrap();
}

/// Every decode-product variant.
const GEMVS: [DecodeGemv; 3] = [
    DecodeGemv::TensorCore,
    DecodeGemv::CudaCore,
    DecodeGemv::CudaCoreWide,
];

fn cpu_act(data: &[f32], cols: usize) -> CpuAct {
    CpuAct::from_rows(data.to_vec(), cols)
}

/// Relative L2 error within `tol`, and no NaN.
fn close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let e = rel_l2(got, want);
    assert!(e < tol, "{what}: relative L2 error {e} (tolerance {tol})");
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

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
            vec![150, 300, 1, 1, 3],
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

struct Ckpt(Checkpoint);

impl WeightSource for Ckpt {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String> {
        let t = self.0.tensor(name).map_err(|e| e.to_string())?;
        Ok(HostTensor {
            dtype: match t.dtype {
                DType::Bf16 => HostDType::Bf16,
                DType::F16 => HostDType::F16,
                DType::F32 => HostDType::F32,
            },
            shape: t.shape,
            bytes: t.bytes,
        })
    }
}

/// Prefill `prompt` tokens then decode the rest one by one; logits of every decode step.
fn prefill_decode<B: Backend>(
    be: &B,
    model: &Model<B>,
    toks: &[u32],
    prompt: usize,
    chunk: usize,
) -> Vec<Vec<f32>> {
    let mut ws = model.workspace(be, chunk).unwrap();
    let mut seq = model.new_sequence(be).unwrap();
    let mut out = vec![model
        .prefill(be, &mut ws, &mut seq, &toks[..prompt], &mut |_| {})
        .unwrap()];
    for &t in &toks[prompt..] {
        out.push(model.decode(be, &mut ws, &mut seq, t).unwrap());
    }
    out
}

fn check_model(config: ModelConfig, n: usize, prompt: usize, chunk: usize) {
    let dir = std::env::temp_dir().join(format!(
        "sala-gpu-{}-{}-{n}-{prompt}",
        std::process::id(),
        config.hidden_size
    ));
    let _ = std::fs::remove_dir_all(&dir);
    write_random_checkpoint(
        &dir,
        &config,
        &WriteOptions {
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    let ck = Ckpt(Checkpoint::open(&dir).unwrap());
    let g = gpu();
    let gm = Model::load(&g, config.clone(), &ck, &mut |_, _| {}).unwrap();
    let cm = Model::load(&CpuBackend, config.clone(), &ck, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(9);
    let toks: Vec<u32> = (0..n)
        .map(|_| rng.below(config.vocab_size) as u32)
        .collect();
    let want = prefill_decode(&CpuBackend, &cm, &toks, prompt, chunk);
    let got = prefill_decode(&g, &gm, &toks, prompt, chunk);
    let argmax = |l: &[f32]| {
        (0..l.len())
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
            .unwrap()
    };
    let mut same = 0;
    for (i, (gl, cl)) in got.iter().zip(&want).enumerate() {
        close(&format!("logits of step {i}"), gl, cl, 5e-2);
        let (ag, ac) = (argmax(gl), argmax(cl));
        same += (ag == ac) as usize;
        // Where the greedy tokens differ, the CPU's choice must be a near-tie on the GPU
        // (bf16 logits, differently ordered fp32 sums).
        assert!(
            ag == ac || gl[ag] - gl[ac] <= 0.02 * gl[ag].abs().max(1.0),
            "step {i}: greedy token {ag} (logit {}) vs the CPU's {ac} (GPU logit {})",
            gl[ag],
            gl[ac]
        );
    }
    eprintln!(
        "greedy tokens agree at {same} of {} teacher-forced steps",
        got.len()
    );
    assert!(
        same * 10 >= got.len() * 9,
        "greedy tokens agree at only {same} of {} steps",
        got.len()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn tiny_model_matches_cpu_across_dense_len() {
    // dense_len 96: the prompt is dense, decoding crosses into sparse attention.
    check_model(preset("tiny").unwrap(), 200, 60, 32);
    check_model(preset("tiny").unwrap(), 230, 150, 64);
}

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn small_model_matches_cpu() {
    check_model(preset("small").unwrap(), 300, 270, 128);
}

/// Decodes `steps` random tokens after each prompt of the given lengths, alone and then all
/// together in batched steps, on the tensor-core GEMVs and on the CUDA-core ones; every
/// sequence must get the same logits, bit for bit. Returns how many sparse-layer calls of the
/// batched steps ran batched (`sparse_rows_batched`).
fn check_batched_decode(
    g: &CudaBackend,
    config: ModelConfig,
    lens: &[usize],
    steps: usize,
) -> usize {
    let v = config.vocab_size;
    let model = Model::random(g, config, 5, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(77);
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(v) as u32).collect())
        .collect();
    let feeds: Vec<Vec<u32>> = lens
        .iter()
        .map(|_| (0..steps).map(|_| rng.below(v) as u32).collect())
        .collect();
    let mut ws = model.workspace(g, 512).unwrap();
    let prefilled = |ws: &mut _, p: &[u32]| {
        let mut seq = model.new_sequence(g).unwrap();
        model.prefill(g, ws, &mut seq, p, &mut |_| {}).unwrap();
        seq
    };
    let mut batched_calls = 0;
    for gemv in [DecodeGemv::TensorCore, DecodeGemv::CudaCore] {
        set(g, |o| o.decode_gemv = gemv);
        let mut alone = Vec::new();
        for (p, f) in prompts.iter().zip(&feeds) {
            let mut seq = prefilled(&mut ws, p);
            let rows: Vec<Vec<f32>> = f
                .iter()
                .map(|&t| model.decode(g, &mut ws, &mut seq, t).unwrap())
                .collect();
            alone.push(rows);
        }
        let mut seqs: Vec<_> = prompts.iter().map(|p| prefilled(&mut ws, p)).collect();
        for step in 0..steps {
            let toks: Vec<u32> = feeds.iter().map(|f| f[step]).collect();
            let mut refs: Vec<_> = seqs.iter_mut().collect();
            let before = g.sparse_rows_batched_calls();
            let logits = decode_step(g, &model, &mut ws, &mut refs, &toks).unwrap();
            batched_calls += g.sparse_rows_batched_calls() - before;
            for (i, row) in logits.iter().enumerate() {
                assert!(
                    row == alone[i][step].as_slice(),
                    "{gemv:?} GEMVs: sequence {i} (prompt {}) step {step}: batched logits differ",
                    lens[i]
                );
            }
        }
    }
    set(g, |o| o.decode_gemv = DecodeGemv::TensorCore);
    batched_calls
}

/// Decode steps replayed from CUDA graphs give the logits eager steps give, bit for bit: one
/// sequence, then four decoded together (the batch repeats, so its steps are captured the
/// second time and replayed after), on the tiny model (sparse layers row by row) and the small
/// one (batched), with the sparse layers past `dense_len` (their attention runs between the
/// graphs). Graph steps must have been captured and replayed.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn cuda_graph_decode_equals_eager_on_the_gpu() {
    let g = gpu();
    for name in ["tiny", "small"] {
        let mut config = preset(name).unwrap();
        config.sparse.dense_len = 100;
        let v = config.vocab_size;
        let model = Model::random(&g, config, 11, &mut |_, _| {}).unwrap();
        let mut rng = TestRng::new(5);
        let lens = [150usize, 40, 333, 7];
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| rng.below(v) as u32).collect())
            .collect();
        // The token each sequence is fed, step by step.
        let feeds: Vec<Vec<u32>> = (0..6)
            .map(|_| lens.iter().map(|_| rng.below(v) as u32).collect())
            .collect();
        let mut ws = model.workspace(&g, 512).unwrap();
        // Every sequence alone then all together, as `graphs` says; the logits of each.
        let mut run = |graphs: bool| {
            set(&g, |o| o.cuda_graphs = graphs);
            let mut out = Vec::new();
            for batch in [&[0usize][..], &[0, 1, 2, 3]] {
                let mut seqs: Vec<_> = batch
                    .iter()
                    .map(|&i| {
                        let mut s = model.new_sequence(&g).unwrap();
                        model
                            .prefill(&g, &mut ws, &mut s, &prompts[i], &mut |_| {})
                            .unwrap();
                        s
                    })
                    .collect();
                for feed in &feeds {
                    let toks: Vec<u32> = batch.iter().map(|&i| feed[i]).collect();
                    let mut refs: Vec<_> = seqs.iter_mut().collect();
                    out.push(decode_step(&g, &model, &mut ws, &mut refs, &toks).unwrap());
                }
            }
            out
        };
        let eager = run(false);
        let (captured0, replayed0) = g.graph_steps();
        let replayed = run(true);
        let (captured, replays) = g.graph_steps();
        assert!(
            captured > captured0 && replays >= replayed0 + 4,
            "{name}: captured {captured0} -> {captured}, replayed {replayed0} -> {replays}"
        );
        for (i, (a, b)) in eager.iter().zip(&replayed).enumerate() {
            assert!(a == b, "{name}: step {i}: logits with CUDA graphs differ");
        }
    }
    set(&g, |o| o.cuda_graphs = true);
}

/// A step mixing decode rows with prompt chunks gives every sequence the logits it gets run
/// apart, bit for bit, on the GPU ([`sala_model::testing::check_mixed_step`]): the tiny model
/// (head size 32: sparse rows one by one) and the small one (head size 128: batched).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn mixed_step_equals_running_apart_on_the_gpu() {
    let g = gpu();
    for name in ["tiny", "small"] {
        let mut config = preset(name).unwrap();
        config.sparse.dense_len = 150;
        let model = Model::random(&g, config, 9, &mut |_, _| {}).unwrap();
        sala_model::testing::check_mixed_step(&g, &model).unwrap();
    }
}

/// A batched decode step on the GPU gives every sequence the logits it gets decoded alone, bit
/// for bit: the tiny model (sparse layers row by row: head size 32), sequences on both sides of
/// dense_len in one batch; batches of 19 (a 32-row GEMV: 4 MMA tiles) and 45 (the 64-row GEMV,
/// its second group of tiles partly filled) sequences.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn batched_decode_equals_decoding_alone_on_the_gpu() {
    let g = gpu();
    let mut config = preset("tiny").unwrap();
    config.sparse.dense_len = 100;
    let lens = [
        5usize, 99, 100, 180, 33, 7, 64, 1, 120, 2, 50, 17, 130, 3, 98, 101, 64, 9, 77,
    ];
    assert_eq!(check_batched_decode(&g, config.clone(), &lens, 4), 0);
    let many: Vec<usize> = (0..45).map(|i| 1 + (i * 37) % 190).collect();
    assert_eq!(check_batched_decode(&g, config, &many, 2), 0);
}

/// The same on the release-shaped small model, whose sparse layers run batched (one launch per
/// kernel for all rows): all rows sparse (8 blocks selected of up to 24), then all dense.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn batched_sparse_layers_equal_decoding_alone_on_the_gpu() {
    let g = gpu();
    // The tensor-core selection: the batched path is its batched form.
    set(&g, |o| o.exact_select = false);
    let mut config = preset("small").unwrap();
    config.sparse.dense_len = 100;
    config.sparse.topk = 4;
    config.sparse.window_size = 256;
    let sparse = [
        300usize, 1500, 1023, 1024, 1025, 640, 777, 129, 1400, 901, 512, 100,
    ];
    let layers = config
        .mixer_types
        .iter()
        .filter(|m| **m == MixerKind::Sparse)
        .count();
    let calls = check_batched_decode(&g, config.clone(), &sparse, 5);
    assert_eq!(
        calls,
        2 * 5 * layers,
        "every batched step's sparse layers run batched"
    );
    let dense = [5usize, 90, 64, 1, 33, 94, 17];
    let calls = check_batched_decode(&g, config, &dense, 5);
    assert_eq!(calls, 2 * 5 * layers);
}

/// Caches and states in the page pool give the logits their own allocations give, bit for
/// bit (chunked prefill that grows every cache, then decode steps); dropped sequences hand
/// their pages back, the next ones reuse them, and a pool too small for a sequence is a clear
/// error with the backend still working.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn page_pool_caches_match_own_allocations() {
    let mut g = gpu();
    let mut config = preset("small").unwrap();
    config.sparse.dense_len = 100;
    config.sparse.topk = 4;
    config.sparse.window_size = 256;
    let v = config.vocab_size;
    let model = Model::random(&g, config, 9, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(31);
    let prompts: Vec<Vec<u32>> = [700usize, 5000, 64]
        .iter()
        .map(|&n| (0..n).map(|_| rng.below(v) as u32).collect())
        .collect();
    let run = |g: &CudaBackend| -> Vec<Vec<f32>> {
        let mut ws = model.workspace(g, 512).unwrap();
        let mut out = Vec::new();
        for p in &prompts {
            let mut seq = model.new_sequence(g).unwrap();
            out.push(model.prefill(g, &mut ws, &mut seq, p, &mut |_| {}).unwrap());
            for t in 0..4 {
                out.push(model.decode(g, &mut ws, &mut seq, t).unwrap());
            }
        }
        out
    };
    g.use_own_allocations();
    let own = run(&g);
    g.use_page_pool(1 << 30).unwrap();
    let paged = run(&g);
    assert!(own == paged, "logits differ with caches in the page pool");
    let pool = g.page_pool().unwrap().clone();
    assert_eq!(
        pool.borrow().pages_in_use(),
        0,
        "dropped sequences keep pages"
    );
    let created = pool.borrow().pages_created();
    assert!(created > 0);
    assert!(run(&g) == own, "logits differ on reused pages");
    assert_eq!(
        pool.borrow().pages_created(),
        created,
        "pages were not reused"
    );

    // A pool of two pages cannot hold a sequence's lightning states: an error, then the
    // backend (with a larger pool) still serves.
    g.use_page_pool(2 * pool.borrow().page_bytes()).unwrap();
    let err = model.new_sequence(&g).err().expect("the pool is too small");
    assert!(err.0.contains("pool is full"), "{}", err.0);
    g.use_page_pool(1 << 30).unwrap();
    assert!(run(&g) == own);

    // A cap (as a memory limit sets) at the pages made so far stops a longer sequence's
    // growth with the same error; lifted, the pool serves again.
    let pool = g.page_pool().unwrap().clone();
    let made = pool.borrow().pages_created() * pool.borrow().page_bytes();
    g.limit_cache_memory(made);
    let mut ws = model.workspace(&g, 512).unwrap();
    let long: Vec<u32> = (0..20_000).map(|_| rng.below(v) as u32).collect();
    let err = match model.new_sequence(&g) {
        Ok(mut seq) => model
            .prefill(&g, &mut ws, &mut seq, &long, &mut |_| {})
            .expect_err("the cap is too small"),
        Err(e) => e,
    };
    assert!(err.0.contains("pool is full"), "{}", err.0);
    g.limit_cache_memory(1 << 30);
    assert!(run(&g) == own);
}

/// A sequence's state copied on the device (a prompt read once for `n` choices) decodes
/// exactly as the original, bit for bit: with caches in the page pool and in their own
/// allocations, into a sequence reserved for the whole request and into a bare one (which then
/// takes the source's capacity), on both sides of `dense_len`.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn a_copied_sequence_decodes_exactly_as_the_original_on_the_gpu() {
    let mut g = gpu();
    let mut config = preset("small").unwrap();
    config.sparse.dense_len = 100;
    config.sparse.topk = 4;
    config.sparse.window_size = 256;
    let v = config.vocab_size;
    let model = Model::random(&g, config, 21, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(41);
    let check = |g: &CudaBackend, rng: &mut TestRng| {
        let mut ws = model.workspace(g, 512).unwrap();
        for len in [5usize, 90, 700, 1500] {
            let prompt: Vec<u32> = (0..len).map(|_| rng.below(v) as u32).collect();
            let feed: Vec<u32> = (0..6).map(|_| rng.below(v) as u32).collect();
            let mut a = model.new_sequence(g).unwrap();
            model.reserve(g, &mut a, len + feed.len()).unwrap();
            model
                .prefill(g, &mut ws, &mut a, &prompt, &mut |_| {})
                .unwrap();
            let mut reserved = model.new_sequence(g).unwrap();
            model.reserve(g, &mut reserved, len + feed.len()).unwrap();
            model.copy_sequence(g, &a, &mut reserved).unwrap();
            let mut bare = model.new_sequence(g).unwrap();
            model.copy_sequence(g, &a, &mut bare).unwrap();
            assert!(
                model.copy_sequence(g, &a, &mut bare).is_err(),
                "a copy into a sequence holding tokens is refused"
            );
            for (i, &t) in feed.iter().enumerate() {
                let want = model.decode(g, &mut ws, &mut a, t).unwrap();
                for (name, seq) in [("reserved", &mut reserved), ("bare", &mut bare)] {
                    let got = model.decode(g, &mut ws, seq, t).unwrap();
                    assert!(
                        got == want,
                        "prompt {len}, step {i}: the {name} copy differs"
                    );
                }
            }
        }
    };
    g.use_own_allocations();
    check(&g, &mut rng);
    g.use_page_pool(1 << 30).unwrap();
    check(&g, &mut rng);
}

/// Greedy picks made on the GPU equal the host's pick from the same logits: the first index
/// of the maximum where many logits tie (head rows that are multiples of one vector), NaN
/// logits read as -inf, +inf ones as the largest float, and no pick where no logit is a
/// number; kept rows come back whole, the others not at all. Then in whole models' steps
/// ([`sala_model::testing::check_greedy_picks`]).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn greedy_picks_match_the_host() {
    let g = gpu();
    let mut rng = TestRng::new(61);
    let (cols, vocab, rows) = (64usize, 5000usize, 6usize);
    let u = rng.bf16_vec(cols, -1.0, 1.0);
    // Head row j is c_j · u with c_j from a few values: every h row's logits tie in groups.
    let mut w: Vec<f32> = (0..vocab)
        .flat_map(|j| {
            let c = [0.5f32, -0.25, 1.0, 0.125, -1.0][(j * 7 + j / 3) % 5];
            u.iter().map(move |&x| c * x).collect::<Vec<_>>()
        })
        .collect();
    w[17 * cols] = f32::NAN; // logit 17 of every row is NaN
    w[4000 * cols..4001 * cols].fill(3e38); // logit 4000 overflows to ±inf
    let x = rng.bf16_vec(rows * cols, -1.0, 1.0);
    let check = |w: &[f32], keep: &[bool], what: &str| {
        let ht = HostTensor {
            dtype: HostDType::Bf16,
            shape: &[vocab, cols],
            bytes: &bf16_bytes(w),
        };
        let gw = g.upload_matrix("head", ht).unwrap();
        let h = g.act_from_host(&x, cols).unwrap();
        let all: Vec<usize> = (0..rows).collect();
        let full = g.logits(&h, &all, &[true; 6], &gw, 1.0).unwrap();
        let out = g.logits(&h, &all, keep, &gw, 1.0).unwrap();
        let kept: Vec<f32> = full
            .rows
            .chunks(vocab)
            .zip(keep)
            .filter(|(_, &k)| k)
            .flat_map(|(r, _)| r.iter().copied())
            .collect();
        assert!(
            out.rows
                .iter()
                .zip(&kept)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && out.rows.len() == kept.len(),
            "{what}: the kept rows differ"
        );
        for (r, row) in full.rows.chunks(vocab).enumerate() {
            let want = GreedyPick::of(row);
            let got = out.picks[r];
            assert!(
                got.id == want.id
                    && (got.logprob - want.logprob).abs() <= 1e-5 * want.logprob.abs().max(1.0),
                "{what}: row {r}: picked {got:?}, the host picks {want:?}"
            );
        }
        out.picks
    };
    let picks = check(&w, &[false, true, false, false, true, true], "ties");
    assert!(picks.iter().all(|p| p.id.is_some()));
    let nan = vec![f32::NAN; vocab * cols];
    let picks = check(&nan, &[true, false, true, false, false, false], "all NaN");
    assert!(picks.iter().all(|p| p.id.is_none()));

    for name in ["tiny", "small"] {
        let mut config = preset(name).unwrap();
        config.sparse.dense_len = 100;
        let model = Model::random(&g, config, 13, &mut |_, _| {}).unwrap();
        sala_model::testing::check_greedy_picks(&g, &model).unwrap();
    }
}

/// A panic inside a decode step (as a bug would raise) while its CUDA graph is being captured
/// leaves the backend working: the step is ended and its capture dropped, and the next
/// sequence decodes, captures and replays its steps with the logits an eager run gives, bit
/// for bit.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn a_panic_inside_a_captured_step_leaves_the_backend_working() {
    let g = gpu();
    let config = preset("tiny").unwrap();
    let v = config.vocab_size;
    let model = Model::random(&g, config, 17, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(3);
    let prompt: Vec<u32> = (0..40).map(|_| rng.below(v) as u32).collect();
    let feed: Vec<u32> = (0..6).map(|_| rng.below(v) as u32).collect();
    let mut ws = model.workspace(&g, 64).unwrap();
    let decode_all = |ws: &mut _| {
        let mut seq = model.new_sequence(&g).unwrap();
        model
            .prefill(&g, ws, &mut seq, &prompt, &mut |_| {})
            .unwrap();
        feed.iter()
            .map(|&t| model.decode(&g, ws, &mut seq, t).unwrap())
            .collect::<Vec<_>>()
    };
    set(&g, |o| o.cuda_graphs = false);
    let eager = decode_all(&mut ws);
    set(&g, |o| o.cuda_graphs = true);
    let mut seq = model.new_sequence(&g).unwrap();
    model
        .prefill(&g, &mut ws, &mut seq, &prompt, &mut |_| {})
        .unwrap();
    // The first step is seen, the second captured: it panics half way.
    model.decode(&g, &mut ws, &mut seq, feed[0]).unwrap();
    let (captured, _) = g.graph_steps();
    g.panic_after_launches(20);
    let hit = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        model.decode(&g, &mut ws, &mut seq, feed[1])
    }));
    assert!(hit.is_err(), "the step did not panic");
    assert_eq!(g.graph_steps().0, captured, "a broken capture was kept");
    drop(seq);
    let again = decode_all(&mut ws);
    let (captured_after, replayed) = g.graph_steps();
    assert!(
        captured_after > captured && replayed > 0,
        "graphs were not captured and replayed after the panic"
    );
    for (i, (a, b)) in eager.iter().zip(&again).enumerate() {
        assert!(
            a == b,
            "step {i}: logits after the panic differ from an eager run"
        );
    }
}
