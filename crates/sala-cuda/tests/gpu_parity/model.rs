//! Whole models on the GPU: against the CPU, batched against alone, graphs against eager,
//! mixed steps, the page pool, copied sequences, greedy picks and a panic inside a step.

use super::*;

pub(crate) struct Ckpt(pub(crate) Checkpoint);

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

/// A model whose linear layers are 4-bit (random, groups of 32) on the GPU (packed, 4-bit
/// products) against the CPU (the same values in bf16): logits of a prefill in chunks (the
/// dequantized GEMM path) and of decode steps (`gemv_w4`), past dense_len.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn four_bit_model_matches_cpu() {
    let mut config = preset("tiny").unwrap();
    config.sparse.dense_len = 100;
    config.quantization = Some(sala_checkpoint::quant::Gptq {
        group_size: Some(32),
        sym: true,
        zero_minus_one: true,
        skip: vec![r".*\.o_gate".into()],
    });
    let g = gpu();
    let gm = Model::random(&g, config.clone(), 8, &mut |_, _| {}).unwrap();
    let cm = Model::random(&CpuBackend::default(), config.clone(), 8, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(4);
    let toks = random_tokens(&mut rng, 160, config.vocab_size);
    let want = prefill_decode(&CpuBackend::default(), &cm, &toks, 130, 64);
    let got = prefill_decode(&g, &gm, &toks, 130, 64);
    for (i, (gl, cl)) in got.iter().zip(&want).enumerate() {
        close(&format!("4-bit model, logits of step {i}"), gl, cl, 5e-2);
    }
}

fn check_model(config: ModelConfig, n: usize, prompt: usize, chunk: usize) {
    // FP8 weights round each product's inputs to E4M3 (steps of 1/16): an input the two
    // backends compute a bf16 step apart can land on different codes, so their logits drift
    // apart as far as FP8 moves them from bf16 (about 0.08 relative on the small model). A
    // wrong scale or layout gives errors near 1.
    let (tolerance, min_agree) = match config.fp8_weights {
        true => (0.2, 0.75),
        false => (5e-2, 0.9),
    };
    let tag = format!("{}-{n}-{prompt}", config.hidden_size);
    let (dir, ck) = random_checkpoint(&config, 5, &tag);
    let g = gpu();
    let gm = Model::load(&g, config.clone(), &ck, &mut |_, _| {}).unwrap();
    let cm = Model::load(&CpuBackend::default(), config.clone(), &ck, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(9);
    let toks = random_tokens(&mut rng, n, config.vocab_size);
    let want = prefill_decode(&CpuBackend::default(), &cm, &toks, prompt, chunk);
    let got = prefill_decode(&g, &gm, &toks, prompt, chunk);
    let argmax = |l: &[f32]| {
        (0..l.len())
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
            .unwrap()
    };
    let mut same = 0;
    for (i, (gl, cl)) in got.iter().zip(&want).enumerate() {
        close(&format!("logits of step {i}"), gl, cl, tolerance);
        let (ag, ac) = (argmax(gl), argmax(cl));
        same += (ag == ac) as usize;
        // Where the greedy tokens differ, the CPU's choice must be a near-tie on the GPU
        // (bf16 logits, differently ordered fp32 sums).
        assert!(
            ag == ac || gl[ag] - gl[ac] <= (tolerance * 0.4) as f32 * gl[ag].abs().max(1.0),
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
        same as f64 >= got.len() as f64 * min_agree,
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

/// The small model with an FP8 K/V cache against the CPU's FP8 cache (dense prompt chunks,
/// decoding across dense_len into sparse attention); and its batched decode steps give each
/// sequence the bits it gets alone.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fp8_kv_cache_model_matches_cpu_and_batches_exactly() {
    let mut config = preset("small").unwrap();
    config.sparse.kv_cache = KvCacheDtype::Fp8;
    config.sparse.dense_len = 200;
    config.sparse.topk = 2;
    config.sparse.window_size = 128;
    check_model(config.clone(), 400, 230, 128);
    let g = gpu();
    set(&g, |o| o.exact_select = false);
    let layers = config.layer_count(MixerKind::Sparse);
    let calls = check_batched_decode(&g, config, &[300, 1023, 640, 1025, 777], 4);
    assert_eq!(calls, 2 * 4 * layers, "FP8 decode rows run batched");
}

/// The small model with FP8 weights (and an FP8 cache) against the CPU's; batched decode
/// steps bit-identical to decoding alone.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn fp8_weights_model_matches_cpu_and_batches_exactly() {
    let mut config = preset("small").unwrap();
    config.fp8_weights = true;
    check_model(config.clone(), 300, 270, 128);
    config.sparse.kv_cache = KvCacheDtype::Fp8;
    check_model(config.clone(), 200, 100, 64);
    check_batched_decode(&gpu(), config, &[300, 5, 64, 1025, 77], 3);
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
    for (name, model) in tiny_and_small(&g, 100, 11) {
        let v = model.config.vocab_size;
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

/// Greedy steps run ahead (each queued with the picks of the step before as its tokens,
/// before those picks reach the host) pick what steps one at a time pick, bit for bit: one
/// sequence and four together, graphs on and off, on the tiny and the small model with the
/// sparse layers past `dense_len`.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn greedy_steps_run_ahead_pick_what_steps_one_at_a_time_pick_on_the_gpu() {
    let g = gpu();
    set(&g, |o| o.run_ahead = true);
    for (name, model) in tiny_and_small(&g, 100, 12) {
        let v = model.config.vocab_size;
        let mut rng = TestRng::new(8);
        let prompts: Vec<Vec<u32>> = [130usize, 41, 260, 9]
            .iter()
            .map(|&n| (0..n).map(|_| rng.below(v) as u32).collect())
            .collect();
        let mut ws = model.workspace(&g, 512).unwrap();
        const STEPS: usize = 9;
        for graphs in [false, true] {
            set(&g, |o| o.cuda_graphs = graphs);
            for batch in [&[2usize][..], &[0, 1, 2, 3]] {
                let fresh = |ws: &mut _| -> Vec<_> {
                    batch
                        .iter()
                        .map(|&i| {
                            let mut s = model.new_sequence(&g).unwrap();
                            model
                                .prefill(&g, ws, &mut s, &prompts[i], &mut |_| {})
                                .unwrap();
                            s
                        })
                        .collect()
                };
                let first: Vec<u32> = batch.iter().map(|&i| prompts[i][0]).collect();
                // One step at a time: each pick read, then fed.
                let mut seqs = fresh(&mut ws);
                let mut feed = first.clone();
                let mut want: Vec<Vec<GreedyPick>> = Vec::new();
                for _ in 0..STEPS {
                    let mut inputs = greedy_rows(&model, &mut seqs, &feed);
                    let picks: Vec<GreedyPick> = model
                        .forward(&g, &mut ws, &mut inputs)
                        .unwrap()
                        .into_iter()
                        .map(|l| match l {
                            sala_model::StepLogits::Greedy(p) => p,
                            _ => panic!("a greedy pick was asked"),
                        })
                        .collect();
                    feed = picks.iter().map(|p| p.id.unwrap()).collect();
                    want.push(picks);
                }
                // Ahead: the next step queued before the picks are read.
                let mut seqs = fresh(&mut ws);
                let mut got = Vec::new();
                for step in 0..STEPS {
                    let placeholder = vec![0u32; batch.len()];
                    let tokens = if step == 0 { &first } else { &placeholder };
                    let mut inputs = greedy_rows(&model, &mut seqs, tokens);
                    model
                        .forward_ahead(&g, &mut ws, &mut inputs, step > 0)
                        .unwrap();
                    if step > 0 {
                        got.push(model.take_picks(&g).unwrap());
                    }
                }
                got.push(model.take_picks(&g).unwrap());
                assert!(
                    got == want,
                    "{name}, graphs {graphs}, {} rows: the picks of steps run ahead differ",
                    batch.len()
                );
                assert!(model.take_picks(&g).is_err(), "no picks are left over");
            }
        }
    }
    set(&g, |o| o.cuda_graphs = true);
}

/// A decode row of each sequence, fed its token, asking for its greedy pick.
fn greedy_rows<'a>(
    model: &Model<CudaBackend>,
    seqs: &'a mut [sala_model::SeqState<CudaBackend>],
    tokens: &'a [u32],
) -> Vec<sala_model::StepInput<'a, CudaBackend>> {
    seqs.iter_mut()
        .zip(tokens)
        .map(|(s, t)| sala_model::StepInput {
            mode: model.sparse_mode(s.pos + 1),
            seq: s,
            tokens: std::slice::from_ref(t),
            logits: LogitRows::Greedy,
        })
        .collect()
}

/// A step that repeats an earlier one's rows but asks for other logits (a greedy pick, then
/// every row's logits, as the bench's verification spans do after greedy decoding) is not
/// replayed from the other's graphs: it runs, and gives the logits an eager step gives.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn cuda_graphs_tell_steps_apart_by_the_logits_they_ask_for() {
    let g = gpu();
    let config = preset("tiny").unwrap();
    let v = config.vocab_size;
    let model = Model::random(&g, config, 13, &mut |_, _| {}).unwrap();
    let mut rng = TestRng::new(21);
    let prompt: Vec<u32> = (0..90).map(|_| rng.below(v) as u32).collect();
    let feeds: Vec<u32> = (0..6).map(|_| rng.below(v) as u32).collect();
    let mut ws = model.workspace(&g, 128).unwrap();
    let mut run = |graphs: bool| {
        set(&g, |o| o.cuda_graphs = graphs);
        let mut s = model.new_sequence(&g).unwrap();
        model
            .prefill(&g, &mut ws, &mut s, &prompt, &mut |_| {})
            .unwrap();
        let mut out = Vec::new();
        for (i, &t) in feeds.iter().enumerate() {
            let mark = model.mark(&g, &mut s).unwrap();
            // Greedy picks first (captured, then replayed), then the same rows with logits.
            let pick = model.decode_greedy(&g, &mut ws, &mut s, t).unwrap();
            model.rewind(&g, &mut s, &mark).unwrap();
            let rows = if i % 2 == 0 {
                LogitRows::Last
            } else {
                LogitRows::All
            };
            let mode = model.sparse_mode(s.pos + 1);
            let logits = model
                .forward_one(&g, &mut ws, &mut s, &[t], mode, rows)
                .unwrap();
            out.push((pick.id, logits));
        }
        out
    };
    let eager = run(false);
    let replayed = run(true);
    for (i, (a, b)) in eager.iter().zip(&replayed).enumerate() {
        assert!(
            a == b,
            "step {i}: with CUDA graphs the pick or logits differ"
        );
    }
    assert!(g.graph_steps().1 > 0, "no step was replayed");
    set(&g, |o| o.cuda_graphs = true);
}

/// A step mixing decode rows with prompt chunks gives every sequence the logits it gets run
/// apart, bit for bit, on the GPU ([`sala_model::testing::check_mixed_step`]): the tiny model
/// (head size 32: sparse rows one by one) and the small one (head size 128: batched).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn mixed_step_equals_running_apart_on_the_gpu() {
    let g = gpu();
    for (_, model) in tiny_and_small(&g, 150, 9) {
        sala_model::testing::check_mixed_step(&g, &model).unwrap();
    }
}

/// A step that reads only the last row of a prompt chunk (or none) gives it the logits of
/// reading every row and leaves the same caches, bit for bit, on the GPU
/// ([`sala_model::testing::check_last_layer_rows`]): the tiny and the small model, prompts
/// below and past dense_len in chunks of 16 rows (each row's bits its own).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn reading_only_the_last_row_equals_reading_every_row_on_the_gpu() {
    let g = gpu();
    for (_, model) in tiny_and_small(&g, 150, 9) {
        for len in [45, 200] {
            sala_model::testing::check_last_layer_rows(&g, &model, len, 16).unwrap();
        }
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

    for (_, model) in tiny_and_small(&g, 100, 13) {
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

/// Preset `name` past a `dense_len` of 100 with few blocks selected (2 top-k, a 64-token
/// window), so the compressed tiers and the selection matter within a few hundred tokens.
/// The tiny model (head size 32: sparse rows one by one) and the small one (head size 128:
/// batched), by name, random weights of `seed`, sparse attention from `dense_len` tokens.
fn tiny_and_small(
    g: &CudaBackend,
    dense_len: usize,
    seed: u64,
) -> Vec<(&'static str, Model<CudaBackend>)> {
    ["tiny", "small"]
        .map(|name| {
            let mut config = preset(name).unwrap();
            config.sparse.dense_len = dense_len;
            (
                name,
                Model::random(g, config, seed, &mut |_, _| {}).unwrap(),
            )
        })
        .into()
}

fn few_blocks(name: &str) -> ModelConfig {
    let mut config = preset(name).unwrap();
    config.sparse.dense_len = 100;
    config.sparse.topk = 2;
    config.sparse.window_size = 64;
    config
}

/// A short span on the GPU gives each row the logits of decoding its tokens one at a time,
/// bit for bit ([`sala_model::testing::check_stepwise_spans`]), below dense_len and past it,
/// few blocks selected; and with the sparse rows one launch at a time.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn short_spans_equal_decoding_token_by_token_on_the_gpu() {
    let g = gpu();
    for name in ["tiny", "small"] {
        let config = few_blocks(name);
        let model = Model::random(&g, config, 41, &mut |_, _| {}).unwrap();
        for batched in [true, false] {
            set(&g, |o| o.batched_sparse_rows = batched);
            sala_model::testing::check_stepwise_spans(&g, &model)
                .map_err(|e| format!("{name}, batched sparse rows {batched}: {e}"))
                .unwrap();
        }
        set(&g, |o| {
            o.batched_sparse_rows = base_options().batched_sparse_rows
        });
    }
}

/// A sequence rewound to a snapshot on the GPU reads on as a cold one, bit for bit, at a
/// chunk boundary ([`sala_model::testing::check_resume`]: the prefix cache's resume), dense
/// and sparse (few blocks selected).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn a_sequence_resumed_from_a_snapshot_reads_on_as_a_cold_one_on_the_gpu() {
    let g = gpu();
    for (name, dense_len) in [("tiny", 100), ("small", 100), ("small", 1000)] {
        let mut config = few_blocks(name);
        config.sparse.dense_len = dense_len;
        let model = Model::random(&g, config, 23, &mut |_, _| {}).unwrap();
        sala_model::testing::check_resume(&g, &model).unwrap();
    }
}

/// Forks of a sequence on the GPU (a prefix-cache hit) read on as cold sequences, bit for
/// bit, and leave it as it was ([`sala_model::testing::check_fork`]): 5000 tokens of the small
/// shape's keys (512 bytes a token) fill more than a 2 MiB page, so forks at 4096 share one
/// whole page and at 2048 and 4608 copy the page they fall in; a fork at 270,336 of 272,000
/// tokens shares whole pages of both compressed tiers too (level-1 windows every 16 tokens,
/// level-2 every 64, 512 bytes each: 4 and 1 pages); sparse, few blocks selected.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn forks_read_on_as_cold_sequences_and_leave_theirs_alone_on_the_gpu() {
    let g = gpu();
    let model = Model::random(&g, few_blocks("small"), 29, &mut |_, _| {}).unwrap();
    let in_use = || g.page_pool().map(|p| p.borrow().pages_in_use());
    let before = in_use();
    assert!(before.is_some(), "the page pool is on");
    sala_model::testing::check_fork(&g, &model, 5000, 512, &[2048, 4096, 4608]).unwrap();
    sala_model::testing::check_fork(&g, &model, 272_000, 8192, &[270_336]).unwrap();
    // Every page, shared or not, went back to the pool with the last sequence mapping it.
    assert_eq!(in_use(), before);
}

/// Rewinding a sequence on the GPU undoes the tokens fed since its mark, bit for bit
/// ([`sala_model::testing::check_rewind`]): lightning states copied back, sparse caches and
/// their compressed tiers cut back; few blocks selected, so the tiers matter.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn a_rewound_sequence_goes_on_as_if_never_ahead_on_the_gpu() {
    let g = gpu();
    for name in ["tiny", "small"] {
        let config = few_blocks(name);
        let model = Model::random(&g, config, 19, &mut |_, _| {}).unwrap();
        sala_model::testing::check_rewind(&g, &model).unwrap();
    }
}

/// A random checkpoint of `config` (weights drawn from `seed`) in a fresh folder named by `tag`
/// (and this process), opened: (folder, checkpoint).
pub(crate) fn random_checkpoint(
    config: &ModelConfig,
    seed: u64,
    tag: &str,
) -> (std::path::PathBuf, Ckpt) {
    let dir = std::env::temp_dir().join(format!("sala-gpu-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let options = WriteOptions {
        seed,
        ..Default::default()
    };
    write_random_checkpoint(&dir, config, &options).unwrap();
    (dir.clone(), Ckpt(Checkpoint::open(&dir).unwrap()))
}

/// `name`'s preset with few blocks selected as a random checkpoint (seed 6) in a folder named by
/// `tag`, loaded on the GPU and on the CPU: (folder, config, GPU model, CPU model).
fn few_blocks_on_both(
    g: &CudaBackend,
    name: &str,
    tag: &str,
) -> (
    std::path::PathBuf,
    ModelConfig,
    Model<CudaBackend>,
    Model<CpuBackend>,
) {
    let config = few_blocks(name);
    let (dir, ck) = random_checkpoint(&config, 6, &format!("{tag}-{name}"));
    let gm = Model::load(g, config.clone(), &ck, &mut |_, _| {}).unwrap();
    let cm = Model::load(&CpuBackend::default(), config.clone(), &ck, &mut |_, _| {}).unwrap();
    (dir, config, gm, cm)
}

/// The hidden states a target keeps for a draft (three layers' outputs), and its logits, agree
/// with the CPU's in the prefill and in each decode step after it: the tiny and small targets
/// with few blocks selected, prompts on both sides of `dense_len` (where an EAGLE-3 draft's
/// inputs come from).
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn the_hidden_states_kept_for_a_draft_agree_with_the_cpus() {
    use sala_model::AuxCapture;
    let g = gpu();
    let cpu = CpuBackend::default();
    for name in ["tiny", "small"] {
        let (dir, config, gm, cm) = few_blocks_on_both(&g, name, "aux");
        let n = config.num_hidden_layers;
        let layers = [1, n / 2, n - 1];
        let mut rng = TestRng::new(12);
        for len in [40usize, 150, 333] {
            let prompt = random_tokens(&mut rng, len, config.vocab_size);
            let feeds = random_tokens(&mut rng, 4, config.vocab_size);
            // Each step's kept rows (three layers) and logits: the prefill's, then each decode's.
            fn run<B: Backend>(
                be: &B,
                m: &Model<B>,
                layers: [usize; 3],
                prompt: &[u32],
                feeds: &[u32],
            ) -> Vec<([Vec<f32>; 3], Vec<f32>)> {
                let width = m.config.hidden_size;
                let mut seq = m.new_sequence(be).unwrap();
                seq.aux = Some(AuxCapture::new(be, layers, width, 512, 0).unwrap());
                let mut ws = m.workspace(be, 128).unwrap();
                let logits = m
                    .prefill(be, &mut ws, &mut seq, prompt, &mut |_| {})
                    .unwrap();
                let kept = |seq: &mut sala_model::SeqState<B>| {
                    let end = seq.pos;
                    let aux = seq.aux.as_mut().unwrap();
                    let rows = aux.take(end).len();
                    aux.bufs.each_ref().map(|b| {
                        let mut v = be.to_host(b).unwrap();
                        v.truncate(rows * width);
                        v
                    })
                };
                let mut steps = vec![(kept(&mut seq), logits)];
                for &f in feeds {
                    let l = m.decode(be, &mut ws, &mut seq, f).unwrap();
                    steps.push((kept(&mut seq), l));
                }
                steps
            }
            let on_gpu = run(&g, &gm, layers, &prompt, &feeds);
            let on_cpu = run(&cpu, &cm, layers, &prompt, &feeds);
            for (step, ((gk, gl), (ck, cl))) in on_gpu.iter().zip(&on_cpu).enumerate() {
                for (i, (a, b)) in gk.iter().zip(ck).enumerate() {
                    assert_eq!(a.len(), b.len(), "{name}, prompt {len}, step {step}");
                    let err = rel_l2(a, b);
                    assert!(
                        err < 2e-2,
                        "{name}, prompt {len}, step {step}: layer {}'s kept rows off by {err}",
                        layers[i]
                    );
                }
                let err = rel_l2(gl, cl);
                assert!(
                    err < 2e-2,
                    "{name}, prompt {len}, step {step}: logits off by {err}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// An EAGLE-3 draft on the GPU and on the CPU over the same target and prompts: the tiny and
/// small targets (draft heads of 32 and 128), prompts on both sides of a `dense_len` of 100
/// with few blocks selected (the draft's cache goes sparse too), the draft with the target's
/// embedding table, rounds of drafting (up to `max` tokens; 0: the draft only reads the
/// target's new rows) with the target decoding in between (decode steps and draft steps repeat:
/// captured into CUDA graphs, then replayed). With drafts, the first of each round is the same
/// token; later ones may part at a near-tie of the random weights (in at most a fifth of the
/// rounds), and where the drafts the steps read agree, so do the hidden states, within bf16
/// roundings (always, with no drafts).
fn draft_rounds_agree(max: usize) {
    use sala_checkpoint::{write_random_draft, DraftCheckpoint, DraftConfig};
    use sala_model::draft::DraftModel;
    let g = gpu();
    let cpu = CpuBackend::default();
    let (mut rounds_seen, mut parted) = (0usize, Vec::new());
    for (name, head_dim) in [("tiny", 32usize), ("small", 128)] {
        let (dir, config, gm, cm) = few_blocks_on_both(&g, name, "draft");
        let c = DraftConfig {
            head_dim,
            ..DraftConfig::small(&config)
        };
        let draft_dir = dir.join("draft");
        write_random_draft(&draft_dir, &c, false, None, 9).unwrap();
        let dck = DraftCheckpoint::open(&draft_dir, &config).unwrap();
        let gd = DraftModel::load(&g, &gm, &dck).unwrap();
        let cd = DraftModel::load(&cpu, &cm, &dck).unwrap();
        let mut rng = TestRng::new(12);
        for len in [40usize, 150, 333] {
            let prompt = random_tokens(&mut rng, len, config.vocab_size);
            let feeds = random_tokens(&mut rng, 5, config.vocab_size);
            // Each backend: prefill with the draft's rows kept, then rounds of drafting, the
            // target decoding the next feed between them; the drafts and last hidden states.
            fn rounds<B: Backend>(
                be: &B,
                m: &Model<B>,
                d: &DraftModel<B>,
                (prompt, feeds, max): (&[u32], &[u32], usize),
            ) -> Vec<(Vec<u32>, Vec<f32>)> {
                let mut seq = m.new_sequence(be).unwrap();
                seq.aux = Some(d.capture(be, m, 0).unwrap());
                let mut ws = m.workspace(be, 128).unwrap();
                m.prefill(be, &mut ws, &mut seq, prompt, &mut |_| {})
                    .unwrap();
                let mut state = d.new_state(be, m).unwrap();
                let mut dws = d.workspace(be).unwrap();
                let mut tokens = prompt.to_vec();
                let mut out = Vec::new();
                for &f in feeds {
                    tokens.push(f);
                    let drafts = d
                        .propose(be, m, &mut dws, &mut state, &mut seq, &tokens, max)
                        .unwrap();
                    out.push((drafts, d.last_hidden(be, &dws).unwrap()));
                    m.decode(be, &mut ws, &mut seq, f).unwrap();
                }
                out
            }
            let on_gpu = rounds(&g, &gm, &gd, (&prompt, &feeds, max));
            let on_cpu = rounds(&cpu, &cm, &cd, (&prompt, &feeds, max));
            for (r, ((gdr, gh), (cdr, ch))) in on_gpu.iter().zip(&on_cpu).enumerate() {
                let ctx = format!("{name}, prompt {len}, round {r}, up to {max} drafts");
                assert_eq!(gdr.len(), max, "{ctx}: drafts {gdr:?}");
                assert_eq!(cdr.len(), max, "{ctx}: the CPU's drafts {cdr:?}");
                if max > 0 {
                    assert_eq!(gdr[0], cdr[0], "{ctx}: {gdr:?} vs {cdr:?}");
                }
                // The last hidden states are those of the step over draft max − 2 (after the
                // steps over drafts 0 .. max − 3): drafts past the first may part at a near-tie
                // of random weights, and then the steps read other tokens.
                let fed = max.saturating_sub(1);
                rounds_seen += 1;
                if gdr[..fed] != cdr[..fed] {
                    parted.push(format!("{ctx}: {gdr:?} vs {cdr:?}"));
                    continue;
                }
                let err = rel_l2(gh, ch);
                assert!(err < 2e-2, "{ctx}: hidden states off by {err}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Near-ties are rare: most rounds must draft the same tokens on both (so their hidden
    // states were compared), or a fault that changes every later draft would pass unseen.
    assert!(
        parted.len() * 5 <= rounds_seen,
        "{} of {rounds_seen} rounds drafted other tokens after the first: {parted:#?}",
        parted.len()
    );
    if !parted.is_empty() {
        eprintln!("rounds whose later drafts parted at a near-tie: {parted:#?}");
    }
}

/// [`draft_rounds_agree`] with four drafts a round.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn an_eagle3_draft_drafts_on_the_gpu_as_on_the_cpu() {
    draft_rounds_agree(4);
}

/// [`draft_rounds_agree`] with no drafts: the draft's step over the target's new rows alone
/// (its products of the kept rows, its attention), apart from its steps over its own guesses.
#[test]
#[ignore = "needs a CUDA GPU: scripts/gpu-build.sh, then scripts/gpu-run.sh on the GPU machine"]
fn an_eagle3_draft_reads_the_targets_rows_on_the_gpu_as_on_the_cpu() {
    draft_rounds_agree(0);
}
