//! Tensor parallelism on the GPUs of this machine (`sala_model::ranks::Ranks` over CUDA
//! backends, NCCL's sums): the split norm's kernels against the CPU, and whole models over one
//! GPU (bit for bit one GPU's) and two (where the machine has them: within the rounding of the
//! split sums).

use super::*;
use sala_cuda::tensor_parallel::NcclSum;
use sala_model::ranks::Ranks;
use sala_model::testing::check_mixed_step;

/// `n` ranks on GPUs 0..n, with the bit-exact block selection as [`gpu`] has it, decode
/// steps in CUDA graphs or not.
fn gpu_ranks(n: usize, config: &ModelConfig, graphs: bool) -> Ranks<CudaBackend> {
    let mut o = base_options();
    o.exact_select = true;
    o.cuda_graphs = graphs;
    let gpus = (0..n)
        .map(|k| CudaBackend::new(k, o.clone()).unwrap())
        .collect();
    let ordinals: Vec<usize> = (0..n).collect();
    Ranks::new(gpus, Box::new(NcclSum::new(&ordinals).unwrap()), config).unwrap()
}

/// A row's sums of squares (`row_sums_sq`) and the norm that takes them: against the CPU on
/// ragged shapes, gated and not; given the row's own sums and width, the norm gives
/// `rms_norm_gate`'s bits (so one rank is one device); given two halves' sums added, each
/// half normed as the whole row is.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn split_row_norms_match_the_cpu_and_the_whole_rows_norm() {
    let g = gpu();
    let mut rng = TestRng::new(21);
    for (rows, cols) in [(1, 128), (3, 384), (17, 4096), (130, 200), (5, 8200)] {
        let n = rows * cols;
        let x = rng.bf16_vec(n, -3.0, 3.0);
        let z = rng.bf16_vec(n, -3.0, 3.0);
        let w = rng.bf16_vec(cols, 0.5, 1.5);
        let ctx = format!("{rows}x{cols}");
        let gx = g.act_from_host(&x, cols).unwrap();
        let mut g_sums = g.upload_table(&vec![0.0; rows + 3]).unwrap();
        g.row_sums_of_squares(&gx, &mut g_sums).unwrap();
        let mut c_sums = vec![0.0; rows + 3];
        CpuBackend::default()
            .row_sums_of_squares(&cpu_act(&x, cols), &mut c_sums)
            .unwrap();
        let got = g.f32_to_host(&g_sums).unwrap();
        close(
            &format!("row sums {ctx}"),
            &got[..rows],
            &c_sums[..rows],
            1e-5,
        );
        let gv = gpu_vector(&g, &w);
        for gate in [false, true] {
            let gz = g.act_from_host(&z, cols).unwrap();
            let gate_g = gate.then_some(&gz);
            let mut plain = g.act_from_host(&vec![0.0; n], cols).unwrap();
            g.rms_norm_gate(&gx, &gv, 1e-6, gate_g, &mut plain).unwrap();
            let mut with = g.act_from_host(&vec![0.0; n], cols).unwrap();
            g.rms_norm_gate_with_sums(&gx, &g_sums, cols, &gv, 1e-6, gate_g, &mut with)
                .unwrap();
            let (plain, with) = (g.to_host(&plain).unwrap(), g.to_host(&with).unwrap());
            assert_eq!(with, plain, "{ctx} gate {gate}: own sums");
            let mut c_out = cpu_act(&vec![0.0; n], cols);
            let cz = cpu_act(&z, cols);
            CpuBackend::default()
                .rms_norm_gate_with_sums(
                    &cpu_act(&x, cols),
                    &c_sums,
                    cols,
                    &w,
                    1e-6,
                    gate.then_some(&cz),
                    &mut c_out,
                )
                .unwrap();
            close(
                &format!("split norm {ctx} gate {gate}"),
                &with,
                &c_out.data,
                5e-3,
            );
        }
        // Two halves, their sums added: each half normed with the whole row's mean square.
        if cols % 16 == 0 {
            let half = cols / 2;
            let halves: Vec<Vec<f32>> = (0..2)
                .map(|h| {
                    x.chunks(cols)
                        .flat_map(|r| r[h * half..(h + 1) * half].to_vec())
                        .collect()
                })
                .collect();
            let mut total = vec![0f32; rows];
            let mut tables = Vec::new();
            for part in &halves {
                let mut t = g.upload_table(&vec![0.0; rows]).unwrap();
                g.row_sums_of_squares(&g.act_from_host(part, half).unwrap(), &mut t)
                    .unwrap();
                for (s, v) in total.iter_mut().zip(g.f32_to_host(&t).unwrap()) {
                    *s += v;
                }
                tables.push(t);
            }
            let sums = g.upload_table(&total).unwrap();
            let whole = {
                let mut out = g.act_from_host(&vec![0.0; n], cols).unwrap();
                g.rms_norm(&gx, &gv, 1e-6, &mut out).unwrap();
                g.to_host(&out).unwrap()
            };
            for (h, part) in halves.iter().enumerate() {
                let wh = gpu_vector(&g, &w[h * half..(h + 1) * half]);
                let mut out = g.act_from_host(&vec![0.0; rows * half], half).unwrap();
                let gp = g.act_from_host(part, half).unwrap();
                g.rms_norm_gate_with_sums(&gp, &sums, cols, &wh, 1e-6, None, &mut out)
                    .unwrap();
                let want: Vec<f32> = whole
                    .chunks(cols)
                    .flat_map(|r| r[h * half..(h + 1) * half].to_vec())
                    .collect();
                close(
                    &format!("half {h} of {ctx}"),
                    &g.to_host(&out).unwrap(),
                    &want,
                    5e-3,
                );
            }
        }
    }
}

/// The tiny model over one GPU as a rank gives one GPU's logits bit for bit (prefill in
/// chunks, decode steps, dense and sparse); over two and four GPUs, where the machine has
/// them (four: past the sparse layers' 2 KV heads), the same within the rounding of the
/// split sums. A mixed step over the ranks gives each sequence its logits alone, bit for bit.
/// With CUDA graphs on every rank (the NCCL sums captured inside them, replayed), the same
/// bits as without.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn tensor_parallel_ranks_on_gpus_give_one_gpus_logits() {
    sala_cuda::libs::ensure_loaded().unwrap();
    let gpus = cudarc::driver::CudaContext::device_count().unwrap() as usize;
    let mut config = preset("tiny").unwrap();
    config.sparse.dense_len = 100;
    // One checkpoint's weights for both (random weights made on a GPU and on the host, as
    // the ranks make theirs, may differ in a last bit).
    let (dir, ck) = super::model::random_checkpoint(&config, 12, "tp");
    let g = gpu();
    let one = Model::load(&g, config.clone(), &ck, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(13);
    let toks = random_tokens(&mut rng, 160, config.vocab_size);
    let want = prefill_decode_logits(&g, &one, &toks);
    eprintln!("tensor parallel over 1 GPU, and 2 and 4 where there are: {gpus} here");
    let mut counts = vec![1, gpus.min(2), gpus.min(4)];
    counts.dedup();
    for n in counts {
        let ranks = gpu_ranks(n, &config, false);
        let model = Model::load(&ranks, config.clone(), &ck, &mut |_, _| {}).unwrap();
        let got = prefill_decode_logits(&ranks, &model, &toks);
        let graphed = gpu_ranks(n, &config, true);
        let graphed_model = Model::load(&graphed, config.clone(), &ck, &mut |_, _| {}).unwrap();
        let with_graphs = prefill_decode_logits(&graphed, &graphed_model, &toks);
        for (r, be) in graphed.ranks().iter().enumerate() {
            let (captured, replayed) = be.graph_steps();
            eprintln!("{n} ranks, rank {r}: {captured} steps captured, {replayed} replayed");
            assert!(replayed > 0, "{n} ranks: rank {r} replayed no step");
        }
        assert!(
            with_graphs == got,
            "{n} ranks: logits with CUDA graphs differ"
        );
        check_mixed_step(&graphed, &graphed_model).unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            if n == 1 {
                assert_eq!(a, b, "1 rank, row {i}");
            } else {
                close(&format!("{n} ranks, row {i}"), a, b, 5e-2);
            }
        }
        check_mixed_step(&ranks, &model).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prefill 120 tokens in chunks of 48, then decode the rest: each call's last logits.
fn prefill_decode_logits<B: Backend>(be: &B, model: &Model<B>, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut ws = model.workspace(be, 48).unwrap();
    let mut seq = model.new_sequence(be).unwrap();
    let mut out = vec![model
        .prefill(be, &mut ws, &mut seq, &toks[..120], &mut |_| {})
        .unwrap()];
    for &t in &toks[120..] {
        out.push(model.decode(be, &mut ws, &mut seq, t).unwrap());
    }
    out
}
