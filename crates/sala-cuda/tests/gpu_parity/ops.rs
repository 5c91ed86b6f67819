//! Each op of the CUDA backend against the CPU backend and the oracle, at ragged shapes.

use super::*;
use sala_cuda::plan::LIGHTNING_RANGE_TOKENS;

#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn elementwise_ops_match_cpu() {
    let g = gpu();
    let mut rng = TestRng::new(1);
    // 1,500 rows: more than the blocks that fit the SMs, so the fused add and norm takes
    // several rows a block.
    for (rows, cols) in [
        (1, 128),
        (3, 384),
        (17, 4096),
        (130, 200),
        (5, 37),
        (1500, 1024),
    ] {
        let n = rows * cols;
        let x = rng.bf16_vec(n, -3.0, 3.0);
        let y = rng.bf16_vec(n, -3.0, 3.0);
        let w = rng.bf16_vec(cols, 0.5, 1.5);
        let ctx = format!("{rows}x{cols}");

        // rms_norm
        let mut c_out = cpu_act(&vec![0.0; n], cols);
        CpuBackend::default()
            .rms_norm(&cpu_act(&x, cols), &w, 1e-6, &mut c_out)
            .unwrap();
        let gv = gpu_vector(&g, &w);
        let mut g_out = g.act_from_host(&vec![0.0; n], cols).unwrap();
        g.rms_norm(&g.act_from_host(&x, cols).unwrap(), &gv, 1e-6, &mut g_out)
            .unwrap();
        close(
            &format!("rms_norm {ctx}"),
            &g.to_host(&g_out).unwrap(),
            &c_out.data,
            5e-3,
        );

        // rms_norm then the sigmoid gate (the lightning output), in one kernel on the GPU
        let mut c_gated = cpu_act(&vec![0.0; n], cols);
        CpuBackend::default()
            .rms_norm_gate(
                &cpu_act(&x, cols),
                &w,
                1e-6,
                Some(&cpu_act(&y, cols)),
                &mut c_gated,
            )
            .unwrap();
        let mut g_gated = g.act_from_host(&vec![0.0; n], cols).unwrap();
        g.rms_norm_gate(
            &g.act_from_host(&x, cols).unwrap(),
            &gv,
            1e-6,
            Some(&g.act_from_host(&y, cols).unwrap()),
            &mut g_gated,
        )
        .unwrap();
        close(
            &format!("rms_norm_gate {ctx}"),
            &g.to_host(&g_gated).unwrap(),
            &c_gated.data,
            5e-3,
        );

        // the residual add fused with the next norm
        let mut ch = cpu_act(&x, cols);
        let mut cn = cpu_act(&vec![0.0; n], cols);
        CpuBackend::default()
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
                |a, b| CpuBackend::default().silu_mul(a, b).unwrap(),
                |g, a, b| g.silu_mul(a, b).unwrap(),
            ),
            (
                "add_scaled",
                |a, b| CpuBackend::default().add_scaled(a, b, 0.247).unwrap(),
                |g, a, b| g.add_scaled(a, b, 0.247).unwrap(),
            ),
            (
                "sigmoid_gate",
                |a, b| CpuBackend::default().sigmoid_gate(a, b).unwrap(),
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
        CpuBackend::default()
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
        let (cw, gw) = random_matrix(&g, &mut rng, out, inner);
        let co = cpu_matmul(&x, &cw);
        for &variant in variants {
            set(&g, |o| o.decode_gemv = variant);
            close(
                &format!("matmul {rows}x{inner} by {out} ({variant:?})"),
                &gpu_matmul(&g, &x, &gw, rows),
                &co,
                5e-3,
            );
        }

        // The same weight as stacked [gate; up] (the MLP's first half) and as three stacked
        // projections split into their own outputs.
        if out % 2 == 0 {
            let half = out / 2;
            let mut cgu = cpu_act(&vec![0.0; rows * out], out);
            let mut cm = cpu_act(&vec![0.0; rows * half], half);
            CpuBackend::default()
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
        CpuBackend::default()
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
        CpuBackend::default()
            .embed(&cw, &ids, 12.0, &mut ce)
            .unwrap();
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
        let gw = gpu_vector(&g, &w);
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

/// A profile of an older card this GPU can emulate runs that card's code (its kernels compiled
/// for its own capability, reloaded as profiles change), and its products still match the
/// CPU's; switching back runs this GPU's code again.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn older_cards_profiles_run_their_own_code() {
    let g = gpu();
    let own = sala_cuda::device::target_for(g.driver_limits().cc);
    let mut rng = TestRng::new(19);
    let (rows, inner, out) = (3usize, 512usize, 384usize);
    let x = rng.bf16_vec(rows * inner, -1.0, 1.0);
    let (cw, gw) = random_matrix(&g, &mut rng, out, inner);
    let co = cpu_matmul(&x, &cw);
    let mut ran = 0;
    for key in ["a100", "a6000", "rtx4090", "rtx5090"] {
        let card = sala_cuda::device::card_named(key).unwrap();
        if g.driver_limits().emulating(card).is_err() {
            continue;
        }
        set(&g, |o| o.device_profile = Some(card));
        let want = if card.cc < g.driver_limits().cc {
            sala_cuda::device::target_for(card.cc)
        } else {
            own.clone()
        };
        assert!(
            g.name().contains(&format!(", {want})")),
            "{key}: {} (kernels for {want} expected)",
            g.name()
        );
        close(
            &format!("{key}: matmul"),
            &gpu_matmul(&g, &x, &gw, rows),
            &co,
            5e-3,
        );
        ran += 1;
    }
    set(&g, |o| o.device_profile = None);
    assert!(g.name().contains(&format!(", {own})")), "{}", g.name());
    assert!(ran > 0, "this GPU emulates none of the older cards");
    set(&g, |o| o.device_profile = base_options().device_profile);
}

/// 17-64-row products on tensor cores give each row the bits the 1-row product gives it,
/// whether they run as one `gemv_rows64` launch or a group of chains a part
/// (`gemv_rows64_parts`, then `gemv_chain_sums`): plain products into three output parts, and
/// [gate; up] with its SiLU. Shapes both split (few blocks; k short enough that some parts run
/// no slab, and ragged) and whole (blocks enough).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn decode_products_of_many_rows_equal_rows_alone() {
    let g = gpu();
    set(&g, |o| o.decode_gemv = DecodeGemv::TensorCore);
    let mut rng = TestRng::new(12);
    let planner = g.planner();
    let (mut split, mut whole) = (0, 0);
    for (out, inner) in [
        (4096, 1024),
        (1000, 4104),
        (72, 200),
        (16384, 512),
        (40000, 256),
    ] {
        let (_, gw) = random_matrix(&g, &mut rng, out, inner);
        for rows in [17, 40, 64] {
            let parts = planner.gemv_groups(false, out);
            let silu_parts = planner.gemv_groups(true, out);
            for p in [parts, silu_parts] {
                if p > 1 {
                    split += 1
                } else {
                    whole += 1
                }
            }
            let ctx = format!("{rows} rows x {inner} by {out} ({parts} parts, SiLU {silu_parts})");
            let x = rng.bf16_vec(rows * inner, -1.0, 1.0);
            let gx = g.act_from_host(&x, inner).unwrap();
            let widths = [out / 3, out / 3, out - 2 * (out / 3)];
            let mut parts_out: Vec<_> = widths
                .iter()
                .map(|&w| g.act_from_host(&vec![0.0; rows * w], w).unwrap())
                .collect();
            let [p0, p1, p2] = &mut parts_out[..] else {
                unreachable!()
            };
            g.matmul_split(&gx, &gw, &mut [p0, p1, p2]).unwrap();
            let together: Vec<Vec<f32>> = parts_out.iter().map(|p| g.to_host(p).unwrap()).collect();
            let half = out / 2;
            let mut gu = g.act_from_host(&vec![0.0; rows * out], out).unwrap();
            let mut m = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
            g.matmul_silu(&gx, &gw, &mut gu, &mut m).unwrap();
            let silu_together = g.to_host(&m).unwrap();
            for r in 0..rows {
                let xr = g
                    .act_from_host(&x[r * inner..(r + 1) * inner], inner)
                    .unwrap();
                let mut alone = g.act_from_host(&vec![0.0; out], out).unwrap();
                g.matmul(&xr, &gw, &mut alone).unwrap();
                let alone = g.to_host(&alone).unwrap();
                let mut at = 0;
                for (i, (t, &wd)) in together.iter().zip(&widths).enumerate() {
                    assert!(
                        t[r * wd..(r + 1) * wd] == alone[at..at + wd],
                        "{ctx}: row {r}, output part {i} differs from the row alone"
                    );
                    at += wd;
                }
                let mut gu1 = g.act_from_host(&vec![0.0; out], out).unwrap();
                let mut m1 = g.act_from_host(&vec![0.0; half], half).unwrap();
                g.matmul_silu(&xr, &gw, &mut gu1, &mut m1).unwrap();
                assert!(
                    silu_together[r * half..(r + 1) * half] == g.to_host(&m1).unwrap()[..],
                    "{ctx}: row {r}'s SiLU product differs from the row alone"
                );
            }
        }
    }
    assert!(split > 0 && whole > 0, "split {split}, whole {whole}");
}

/// The span of a call's `rows` rows, all of one sequence from position 0 (the positions matter
/// only for RoPE, which these calls leave out).
pub(super) fn whole(rows: usize) -> Span {
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
const LIGHTNING: [LightningPrefill; 3] = [
    LightningPrefill::Ranges,
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
        // Past 1,024 tokens the range kernel walks ranges in parallel (2100: 3, 9001: 9); with
        // ranges of one chunk 9001 runs 29, near the most the scratch holds, a short last one.
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
            // The range kernel also with ranges of one chunk (the most range sums).
            let runs = LIGHTNING
                .iter()
                .map(|&v| (v, LIGHTNING_RANGE_TOKENS))
                .chain([(LightningPrefill::Ranges, 64)]);
            for (variant, range_tokens) in runs {
                set(&g, |o| {
                    o.lightning_prefill = variant;
                    o.lightning_range_tokens = range_tokens;
                });
                let (o, st) = gpu_lightning(&g, shape, &gs, &q, &k, &v, &init);
                let ctx = format!("H{heads}/{kv_heads} d{d} T{t_n} {variant:?} ({range_tokens})");
                close(&format!("{ctx} o"), &o, &want_o, 5e-3);
                close(&format!("{ctx} state"), &st, &want_s, 1e-4);
            }
            set(&g, |o| o.lightning_range_tokens = LIGHTNING_RANGE_TOKENS);
        }
    }
}

/// Decode rows of several sequences in one launch (each its own state; from 8 rows a lane
/// takes two value columns) give each sequence the bits it gets decoded alone, and the CPU's
/// values within rounding: 1, 9 and 64 rows, head sizes 32, 64 and 128.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn lightning_decode_rows_equal_rows_alone() {
    let g = gpu();
    let mut rng = TestRng::new(7);
    for (heads, kv_heads, d) in [(4, 4, 32), (4, 2, 64), (32, 32, 128)] {
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let slopes = sala_checkpoint::alibi_slopes(heads);
        let gs = g.upload_table(&slopes).unwrap();
        for rows in [1usize, 9, 64] {
            let q = rng.bf16_vec(rows * shape.q_width(), -1.0, 1.0);
            let k = rng.bf16_vec(rows * shape.kv_width(), -1.0, 1.0);
            let v = rng.bf16_vec(rows * shape.kv_width(), -1.0, 1.0);
            let inits: Vec<Vec<f32>> = (0..rows)
                .map(|_| rng.bf16_vec(heads * d * d, -0.3, 0.3))
                .collect();
            let ctx = format!("H{heads}/{kv_heads} d{d}, {rows} rows");
            // All rows in one step, a span (and a state) each.
            let spans: Vec<Span> = (0..rows)
                .map(|i| Span {
                    first_row: i,
                    len: 1,
                    pos: 10 + 3 * i,
                })
                .collect();
            let mut states: Vec<Store<f32>> = inits
                .iter()
                .map(|s| Store::Own(g.f32_from_host(s).unwrap()))
                .collect();
            let mut out = g
                .act_from_host(&vec![0.0; rows * shape.q_width()], shape.q_width())
                .unwrap();
            let io = AttnIo {
                q: &mut g.act_from_host(&q, shape.q_width()).unwrap(),
                k: &mut g.act_from_host(&k, shape.kv_width()).unwrap(),
                v: &mut g.act_from_host(&v, shape.kv_width()).unwrap(),
                out: &mut out,
            };
            let mut refs: Vec<&mut Store<f32>> = states.iter_mut().collect();
            g.lightning(shape, &gs, None, None, io, &spans, &mut refs)
                .unwrap();
            let together = g.to_host(&out).unwrap();
            for i in 0..rows {
                let (qw, kw) = (shape.q_width(), shape.kv_width());
                let row = |x: &[f32], w: usize| x[i * w..(i + 1) * w].to_vec();
                let (alone_out, alone_state) = gpu_lightning(
                    &g,
                    shape,
                    &gs,
                    &row(&q, qw),
                    &row(&k, kw),
                    &row(&v, kw),
                    &inits[i],
                );
                let Store::Own(st) = &states[i] else {
                    unreachable!()
                };
                let state = g.f32_to_host(st).unwrap();
                assert!(
                    together[i * qw..(i + 1) * qw] == alone_out[..],
                    "{ctx}: row {i}'s output differs from its own step's"
                );
                assert!(state == alone_state, "{ctx}: row {i}'s state differs");
                let mut cs = inits[i].clone();
                let co = cpu_attn::lightning(
                    shape,
                    &slopes,
                    &row(&q, qw),
                    &row(&k, kw),
                    &row(&v, kw),
                    &mut cs,
                );
                close(&format!("{ctx}, row {i} output"), &alone_out, &co, 5e-3);
                close(&format!("{ctx}, row {i} state"), &state, &cs, 1e-5);
            }
        }
    }
}

/// The range kernel single-buffered (as on 99 KiB cards) gives the double-buffered kernel's
/// bits: the same operations in the same order, across ranges and partial chunks.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn lightning_ranges_single_buffered_same_bits() {
    let g = gpu();
    let mut rng = TestRng::new(5);
    let profiles = range_plans(&g);
    assert!(
        profiles.len() == 2,
        "this GPU cannot emulate the rtx5090's shared memory: the single-buffered plan is untested"
    );
    // Head size 128: at 64 both plans double-buffer.
    for (heads, kv_heads) in [(8, 4), (32, 32)] {
        let d = 128;
        let shape = AttnShape {
            heads,
            kv_heads,
            head_dim: d,
        };
        let slopes = sala_checkpoint::alibi_slopes(heads);
        let gs = g.upload_table(&slopes).unwrap();
        for t_n in [100, 300, 2100] {
            let q = rng.bf16_vec(t_n * shape.q_width(), -1.0, 1.0);
            let k = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let v = rng.bf16_vec(t_n * shape.kv_width(), -1.0, 1.0);
            let init = rng.bf16_vec(heads * d * d, -0.3, 0.3);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut runs = Vec::new();
            for &profile in &profiles {
                set(&g, |o| o.device_profile = profile);
                let buffers = g.planner().lightning_ranges_buffers(d);
                let (o, st) = gpu_lightning(&g, shape, &gs, &q, &k, &v, &init);
                runs.push((buffers, bits(&o), bits(&st)));
            }
            set(&g, |o| o.device_profile = base_options().device_profile);
            let ctx = format!("H{heads}/{kv_heads} d{d} T{t_n}");
            assert_eq!(runs[0].0, Some(2), "{ctx}: this GPU's plan");
            assert_eq!(runs[1].0, Some(1), "{ctx}: the rtx5090's plan");
            assert!(runs[0].1 == runs[1].1, "{ctx}: outputs differ");
            assert!(runs[0].2 == runs[1].2, "{ctx}: states differ");
        }
    }
}

/// The device profiles to run the range lightning kernel under: none (this GPU's own plans,
/// whatever profile the run has) and the RTX 5090's (Q, K and V single-buffered) where this GPU
/// can emulate it.
fn range_plans(g: &CudaBackend) -> Vec<Option<&'static sala_cuda::Card>> {
    let rtx = sala_cuda::device::card_named("rtx5090").unwrap();
    let mut out = vec![None];
    if g.driver_limits().emulating(rtx).is_ok() {
        out.push(Some(rtx));
    }
    out
}

pub(super) fn small_sparse() -> SparseConfig {
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
        // The GPU's attention for the `len` queries from row `a` on, their keys and values
        // appended to `gc`.
        let attend = |gc: &mut _, a: usize, len: usize, mode: SparseMode| {
            let (qw, kw) = (shape.q_width(), shape.kv_width());
            let mut out = g.act_from_host(&vec![0.0; len * qw], qw).unwrap();
            let io = AttnIo {
                q: &mut g.act_from_host(&q[a * qw..(a + len) * qw], qw).unwrap(),
                k: &mut g.act_from_host(&k[a * kw..(a + len) * kw], kw).unwrap(),
                v: &mut g.act_from_host(&v[a * kw..(a + len) * kw], kw).unwrap(),
                out: &mut out,
            };
            g.sparse_attention(shape, &cfg, io, &[whole(len)], &[mode], &mut [gc])
                .unwrap();
            g.to_host(&out).unwrap()
        };
        // The gather in stages of 32 keys and of 16 (twice the warps).
        for (mode, attention, keys) in [
            (SparseMode::Dense, Attention::WarpWalk, 32),
            (SparseMode::Sparse, Attention::WarpWalk, 32),
            (SparseMode::Dense, Attention::WarpWalk, 16),
            (SparseMode::Sparse, Attention::WarpWalk, 16),
            (SparseMode::Dense, Attention::Staged, 32),
            (SparseMode::Sparse, Attention::Staged, 32),
        ] {
            set(&g, |o| {
                o.attention = attention;
                o.gather_keys = keys;
            });
            let mut cc = SparseCache::new(shape, &cfg);
            let mut gc = g.new_sparse_cache(shape, &cfg).unwrap();
            let mut at = 0;
            let mut by_chunks = Vec::new();
            for &c in &chunks {
                let (qa, qb) = (at * shape.q_width(), (at + c) * shape.q_width());
                let (ka, kb) = (at * shape.kv_width(), (at + c) * shape.kv_width());
                cc.append(&k[ka..kb], &v[ka..kb]);
                let want: Vec<f32> = cpu_attn::sparse_layer_attention(&cc, mode, &q[qa..qb])
                    .into_iter()
                    .map(sala_model::numerics::bf16_round)
                    .collect();
                let got = attend(&mut gc, at, c, mode);
                close(
                    &format!("{mode:?} {attention:?} {keys} keys {shape:?} chunk at {at} len {c}"),
                    &got,
                    &want,
                    1e-2,
                );
                by_chunks.extend(got);
                at += c;
            }
            // A prompt chunk's sparse attention (`attention_gather`) and selection are those of
            // each query's position alone: the same bits in one pass as in chunks (a prompt cut
            // anywhere, a prefix read from the cache). Small chunks run the decode kernels.
            let gathered: Vec<usize> = chunks
                .iter()
                .scan(0, |at, &c| {
                    *at += c;
                    Some((*at - c, c))
                })
                .filter(|&(_, c)| c * shape.kv_heads >= sala_cuda::plan::SELECT_ONE_KERNEL_PAIRS)
                .flat_map(|(a, c)| a..a + c)
                .collect();
            if mode == SparseMode::Sparse && attention == Attention::WarpWalk && chunks.len() > 1 {
                let mut gc = g.new_sparse_cache(shape, &cfg).unwrap();
                let one_pass = attend(&mut gc, 0, n, mode);
                let w = shape.q_width();
                let differs = gathered.iter().copied().find(|&i| {
                    (i * w..(i + 1) * w).any(|x| one_pass[x].to_bits() != by_chunks[x].to_bits())
                });
                assert_eq!(
                    differs,
                    None,
                    "{mode:?} {shape:?} {keys} keys: the query at this position differs in one pass and in chunks {chunks:?}"
                );
            }
        }
        set(&g, |o| o.gather_keys = base_options().gather_keys);
    }
}

/// The tensor-core block selections (one kernel per chunk of queries for prefill, spread over
/// the compressed keys for decode) against the oracle's block scores: every list
/// holds the forced blocks, and no block left out scores above a chosen one by more than the
/// rounding of the two computations (so a differing pick is a near-tie, never a wrong block).
/// A decode step of two sequences with the same keys (the batched rows' top-k) picks for each
/// what one sequence's step picks alone.
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
    // the top-k's keys in global memory (as small-memory cards past ~3M tokens), chunks whose
    // selection takes several launches (as past 256K tokens), and `select_topk_scores`.
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
            // 64 KiB of block scores a launch: a released-shape chunk's selection in 27 to 171
            // launches.
            (
                "block scores in several launches",
                with(&|o| o.select_scores_bytes = 64 << 10),
            ),
            // The top-k past the 16-bit counts (over ~4M tokens), here past 32 blocks.
            (
                "top-k past the 16-bit counts",
                with(&|o| o.topk_scores_max_candidates = 32),
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
            if shape.head_dim == 128 {
                // One decode step of two sequences holding the same keys (the batched rows'
                // selection: on Hopper, a cluster of blocks a pair): both lists equal, and the
                // same as one sequence's step alone picks.
                let mut twin = g.new_sparse_cache(shape, &cfg).unwrap();
                g.copy_sparse_cache(&gc, &mut twin).unwrap();
                let mut lone = g.new_sparse_cache(shape, &cfg).unwrap();
                g.copy_sparse_cache(&gc, &mut lone).unwrap();
                let (qr, kr) = (
                    rng.bf16_vec(shape.q_width(), -1.5, 1.5),
                    rng.bf16_vec(shape.kv_width(), -1.5, 1.5),
                );
                let step = |caches: &mut [&mut sala_cuda::DevSparseCache], rows: usize| {
                    let rep = |x: &[f32]| x.repeat(rows);
                    let (qw, kw) = (shape.q_width(), shape.kv_width());
                    let mut out = g.act_from_host(&vec![0.0; rows * qw], qw).unwrap();
                    let io = AttnIo {
                        q: &mut g.act_from_host(&rep(&qr), qw).unwrap(),
                        k: &mut g.act_from_host(&rep(&kr), kw).unwrap(),
                        v: &mut g.act_from_host(&rep(&kr), kw).unwrap(),
                        out: &mut out,
                    };
                    let spans: Vec<Span> = (0..rows)
                        .map(|r| Span {
                            first_row: r,
                            len: 1,
                            pos: n,
                        })
                        .collect();
                    let modes = vec![SparseMode::Sparse; rows];
                    g.sparse_attention(shape, &cfg, io, &spans, &modes, caches)
                        .unwrap();
                    g.last_selection(rows * kvh * k_sel).unwrap()
                };
                let pair = step(&mut [&mut gc, &mut twin], 2);
                let alone = step(&mut [&mut lone], 1);
                assert_eq!(
                    pair[..kvh * k_sel],
                    pair[kvh * k_sel..],
                    "{shape:?}: two rows' lists differ"
                );
                assert_eq!(
                    pair[..kvh * k_sel],
                    alone[..],
                    "{shape:?}: a row batched and alone differ"
                );
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
