//! Whole-model checks on small random models: the fast CPU backend against the reference
//! backend (the oracle's attention, plain matmuls), and the exactness of chunked prefill and
//! of prefill-then-decode, across `dense_len`.

use sala_checkpoint::{expected_tensors, KvCacheDtype, ModelConfig};
use sala_cpu::reference::ReferenceBackend;
use sala_cpu::{CpuBackend, HostRanks};
use sala_model::numerics::{rel_l2, TestRng};
use sala_model::ranks::Ranks;
use sala_model::testing::{
    check_fork, check_greedy_picks, check_last_layer_rows, check_mixed_step, check_resume,
    check_rewind, check_stepwise_spans, decode_step,
};
use sala_model::{Backend, HostDType, HostTensor, LogitRows, Model, SparseMode, WeightSource};
use std::collections::HashMap;

/// Random bf16 weights for every tensor of a config, held in memory.
struct RandomWeights {
    tensors: HashMap<String, (Vec<usize>, Vec<u8>)>,
}

impl RandomWeights {
    fn new(config: &ModelConfig, seed: u64) -> Self {
        let mut rng = TestRng::new(seed);
        let tensors = expected_tensors(config)
            .into_iter()
            .map(|spec| {
                let n: usize = spec.shape.iter().product();
                let (lo, hi) = if spec.shape.len() == 1 {
                    (0.7, 1.3) // norm weights
                } else if spec.role == sala_checkpoint::Role::Embed {
                    (-0.1, 0.1)
                } else {
                    let a = (3.0 / spec.shape[1] as f32).sqrt();
                    (-a, a)
                };
                let bytes = rng
                    .bf16_vec(n, lo, hi)
                    .into_iter()
                    .flat_map(|x| half::bf16::from_f32(x).to_bits().to_le_bytes())
                    .collect();
                (spec.name, (spec.shape, bytes))
            })
            .collect();
        Self { tensors }
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String> {
        let (shape, bytes) = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("no tensor {name}"))?;
        Ok(HostTensor {
            dtype: HostDType::Bf16,
            shape,
            bytes,
        })
    }
}

/// The tiny test model: 4 layers (sparse, lightning, lightning, sparse), 16-token blocks,
/// 6 selected blocks, sparse attention from `dense_len` tokens.
fn tiny_config(dense_len: usize) -> ModelConfig {
    let json = serde_json::json!({
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 512,
        "mixer_types": ["minicpm4", "lightning-attn", "lightning-attn", "minicpm4"],
        "lightning_nkv": 4, "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 32,
        "qk_norm": true, "use_output_norm": true, "use_output_gate": true,
        "attn_use_output_gate": true, "lightning_use_rope": true, "attn_use_rope": false,
        "eos_token_id": [2], "max_position_embeddings": 65536,
        "sparse_config": {"kernel_size": 8, "kernel_stride": 4, "block_size": 16, "init_blocks": 1,
                          "window_size": 32, "topk": 4, "use_nope": false, "dense_len": dense_len}
    });
    ModelConfig::from_json(json).unwrap()
}

fn load<B: Backend>(be: &B, config: &ModelConfig, seed: u64) -> Model<B> {
    let src = RandomWeights::new(config, seed);
    Model::load(be, config.clone(), &src, &mut |_, _| {}).unwrap()
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = TestRng::new(seed);
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// Runs `toks` in the given chunk lengths with the given modes, returning every row's logits.
fn run<B: Backend>(
    be: &B,
    model: &Model<B>,
    toks: &[u32],
    chunks: &[(usize, SparseMode)],
) -> Vec<f32> {
    let max = chunks.iter().map(|c| c.0).max().unwrap();
    let mut ws = model.workspace(be, max).unwrap();
    let mut seq = model.new_sequence(be).unwrap();
    let mut out = Vec::new();
    let mut at = 0;
    for &(len, mode) in chunks {
        out.extend(
            model
                .forward_one(
                    be,
                    &mut ws,
                    &mut seq,
                    &toks[at..at + len],
                    mode,
                    LogitRows::All,
                )
                .unwrap(),
        );
        at += len;
    }
    assert_eq!(at, toks.len());
    assert_eq!(seq.pos, toks.len());
    out
}

/// Compares logits row by row. Sparse block selection ranks bf16-rounded scores, so a
/// rounding difference far upstream can swap two near-tied blocks and move a row by a few
/// percent, as it would in the reference; the check is therefore: every row within `MAX_ERR`,
/// the median row within `MEDIAN_ERR`, and the same greedy token (or a tie within the error).
fn assert_logits_close(what: &str, got: &[f32], want: &[f32], vocab: usize) {
    assert_logits_within(what, got, want, vocab, 1e-2);
}

/// [`assert_logits_close`] with the median row's bound `MEDIAN_ERR`.
#[allow(non_snake_case)]
fn assert_logits_within(what: &str, got: &[f32], want: &[f32], vocab: usize, MEDIAN_ERR: f64) {
    const MAX_ERR: f64 = 5e-2;
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut errs = Vec::new();
    for (r, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let err = rel_l2(g, w);
        assert!(err < MAX_ERR, "{what}: row {r}: relative L2 error {err}");
        errs.push(err);
        let arg = |x: &[f32]| {
            (0..x.len())
                .max_by(|&a, &b| x[a].total_cmp(&x[b]).then(b.cmp(&a)))
                .unwrap()
        };
        let (ag, aw) = (arg(g), arg(w));
        assert!(
            ag == aw || (g[aw] - g[ag]).abs() <= 0.05 * g[ag].abs().max(1.0),
            "{what}: row {r}: greedy token {ag} vs {aw}"
        );
    }
    errs.sort_by(f64::total_cmp);
    let median = errs[errs.len() / 2];
    assert!(median < MEDIAN_ERR, "{what}: median row error {median}");
}

fn one_pass(n: usize, mode: SparseMode) -> Vec<(usize, SparseMode)> {
    vec![(n, mode)]
}

#[test]
fn fast_backend_matches_reference_dense_and_sparse() {
    let config = tiny_config(96);
    let fast = load(&CpuBackend::default(), &config, 1);
    let reference = load(&ReferenceBackend, &config, 1);
    let v = config.vocab_size;
    for (n, mode) in [(40, SparseMode::Dense), (150, SparseMode::Sparse)] {
        let toks = tokens(n, v, n as u64);
        let want = run(&ReferenceBackend, &reference, &toks, &one_pass(n, mode));
        let got = run(&CpuBackend::default(), &fast, &toks, &one_pass(n, mode));
        assert_logits_close(&format!("{mode:?} N{n}"), &got, &want, v);
    }
}

#[test]
fn fp8_kv_cache_matches_the_reference_and_stays_near_bf16() {
    let bf16 = tiny_config(96);
    let mut fp8 = bf16.clone();
    fp8.sparse.kv_cache = KvCacheDtype::Fp8;
    let v = bf16.vocab_size;
    let plain = load(&CpuBackend::default(), &bf16, 1);
    let fast = load(&CpuBackend::default(), &fp8, 1);
    let reference = load(&ReferenceBackend, &fp8, 1);
    for (n, mode) in [(40, SparseMode::Dense), (150, SparseMode::Sparse)] {
        let toks = tokens(n, v, n as u64);
        // Chunked on the CPU backend, one pass on the reference: both round K/V alike.
        let chunks: Vec<_> = (0..n)
            .step_by(33)
            .map(|s| ((n - s).min(33), mode))
            .collect();
        let want = run(&ReferenceBackend, &reference, &toks, &one_pass(n, mode));
        let got = run(&CpuBackend::default(), &fast, &toks, &chunks);
        assert_logits_close(&format!("fp8 {mode:?} N{n}"), &got, &want, v);
        // FP8 moves the logits, but little: E4M3 keeps 1/16 of each row's largest value.
        let exact = run(&CpuBackend::default(), &plain, &toks, &one_pass(n, mode));
        let err = rel_l2(&got, &exact);
        assert!(err > 0.0, "{mode:?}: the FP8 cache changed nothing");
        assert!(
            err < 0.05,
            "{mode:?}: FP8 vs bf16 logits, relative L2 {err}"
        );
    }
}

#[test]
fn fp8_weights_run_w8a8_and_stay_near_bf16() {
    let bf16 = tiny_config(96);
    let mut fp8 = bf16.clone();
    fp8.fp8_weights = true;
    let v = bf16.vocab_size;
    let plain = load(&CpuBackend::default(), &bf16, 4);
    let quant = load(&CpuBackend::default(), &fp8, 4);
    // Held as code values with a scale a row: a product is (Σ e4m3(x)·code) · x_scale · w_scale.
    let mut rng = TestRng::new(2);
    let (rows, cols) = (37, 200);
    let values = rng.bf16_vec(rows * cols, -0.3, 0.3);
    let (codes, scales) = sala_model::quantize_fp8(&values, rows, cols);
    let fp8_matrix = sala_model::Fp8Matrix {
        rows,
        cols,
        codes: &codes,
        scales: &scales,
    };
    let w = &CpuBackend::default().upload_fp8("w", fp8_matrix).unwrap();
    let x = rng.bf16_vec(3 * w.cols, -2.0, 2.0);
    let mut y = vec![0f32; 3 * w.rows];
    sala_cpu::matmul_f32(&x, 3, w, &mut y);
    // Each input row is quantized on its own: a row alone gets the bits it gets among others.
    let mut alone = vec![0f32; w.rows];
    sala_cpu::matmul_f32(&x[w.cols..2 * w.cols], 1, w, &mut alone);
    assert_eq!(alone, y[w.rows..2 * w.rows]);
    for r in 0..3 {
        let row = &x[r * w.cols..(r + 1) * w.cols];
        let xs = sala_model::numerics::fp8_row_scale(row);
        for o in [0, w.rows / 2, w.rows - 1] {
            let want: f64 = row
                .iter()
                .zip(&w.data[o * w.cols..(o + 1) * w.cols])
                .map(|(&a, &b)| {
                    let qa = sala_model::numerics::e4m3_value(sala_model::numerics::e4m3_code(
                        a * (1.0 / xs),
                    ));
                    qa as f64 * b as f64
                })
                .sum::<f64>()
                * xs as f64
                * scales[o] as f64;
            let got = y[r * w.rows + o] as f64;
            assert!(
                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                "row {r} out {o}: {got} vs {want}"
            );
        }
    }
    for (n, mode) in [(40, SparseMode::Dense), (150, SparseMode::Sparse)] {
        let toks = tokens(n, v, 30 + n as u64);
        let exact = run(&CpuBackend::default(), &plain, &toks, &one_pass(n, mode));
        let got = run(&CpuBackend::default(), &quant, &toks, &one_pass(n, mode));
        let err = rel_l2(&got, &exact);
        assert!(
            err > 0.0 && err < 0.15,
            "{mode:?}: FP8 vs bf16 weights, relative L2 {err}"
        );
    }
    // The reference has no FP8 products: a clear error, not wrong numbers.
    let err = Model::load(
        &ReferenceBackend,
        fp8.clone(),
        &RandomWeights::new(&fp8, 4),
        &mut |_, _| {},
    )
    .err()
    .expect("refused");
    assert!(err.0.contains("FP8"), "{}", err.0);
}

#[test]
fn chunked_prefill_equals_one_pass() {
    let config = tiny_config(96);
    let model = load(&CpuBackend::default(), &config, 2);
    let v = config.vocab_size;
    let n = 230;
    let toks = tokens(n, v, 9);
    for mode in [SparseMode::Dense, SparseMode::Sparse] {
        let want = run(&CpuBackend::default(), &model, &toks, &one_pass(n, mode));
        for chunk in [1, 7, 64, 100] {
            let chunks: Vec<_> = (0..n)
                .step_by(chunk)
                .map(|s| ((n - s).min(chunk), mode))
                .collect();
            let got = run(&CpuBackend::default(), &model, &toks, &chunks);
            assert_logits_close(&format!("{mode:?} chunk {chunk}"), &got, &want, v);
        }
    }
}

#[test]
fn prefill_then_decode_equals_one_longer_prefill_across_dense_len() {
    // With dense_len = 96 = selected blocks × block size, dense and sparse attention agree
    // below dense_len, so a prompt prefilled densely and decoded past dense_len must give the
    // logits of one sparse prefill of the whole sequence.
    let config = tiny_config(96);
    let model = load(&CpuBackend::default(), &config, 3);
    let v = config.vocab_size;
    let n = 180;
    let toks = tokens(n, v, 4);
    let want = run(
        &CpuBackend::default(),
        &model,
        &toks,
        &one_pass(n, model.sparse_mode(n)),
    );

    let mut ws = model.workspace(&CpuBackend::default(), 64).unwrap();
    let mut seq = model.new_sequence(&CpuBackend::default()).unwrap();
    let prompt = 60;
    let last = model
        .prefill(
            &CpuBackend::default(),
            &mut ws,
            &mut seq,
            &toks[..prompt],
            &mut |_| {},
        )
        .unwrap();
    let mut got = vec![0f32; (prompt - 1) * v]; // rows before the last prompt token: not compared
    got.extend(last);
    for &t in &toks[prompt..] {
        got.extend(
            model
                .decode(&CpuBackend::default(), &mut ws, &mut seq, t)
                .unwrap(),
        );
    }
    assert_logits_close(
        "prefill 60 + decode to 180",
        &got[(prompt - 1) * v..],
        &want[(prompt - 1) * v..],
        v,
    );
}

#[test]
fn per_call_mode_follows_the_reference_when_dense_len_exceeds_the_selection() {
    // dense_len 160 > 96: queries at 96..159 differ between dense and sparse attention, so
    // the mode of each call matters. The fast backend must follow the reference exactly.
    let config = tiny_config(160);
    let fast = load(&CpuBackend::default(), &config, 5);
    let reference = load(&ReferenceBackend, &config, 5);
    let v = config.vocab_size;
    let n = 200;
    let toks = tokens(n, v, 6);
    // Prefill 120 (dense, total < 160), then decode: dense until position 158, sparse after.
    let mut schedule = vec![(120, fast.sparse_mode(120))];
    for p in 120..n {
        schedule.push((1, fast.sparse_mode(p + 1)));
    }
    assert_eq!(schedule[1].1, SparseMode::Dense);
    assert_eq!(schedule.last().unwrap().1, SparseMode::Sparse);
    let want = run(&ReferenceBackend, &reference, &toks, &schedule);
    let got = run(&CpuBackend::default(), &fast, &toks, &schedule);
    assert_logits_close("dense prefill, decode across dense_len", &got, &want, v);

    // And the modes are not interchangeable here: one sparse prefill differs from it.
    let sparse_all = run(
        &CpuBackend::default(),
        &fast,
        &toks,
        &one_pass(n, SparseMode::Sparse),
    );
    let row = 150;
    let err = rel_l2(
        &sparse_all[row * v..(row + 1) * v],
        &got[row * v..(row + 1) * v],
    );
    assert!(
        err > 1e-3,
        "dense and sparse attention agree at position {row} ({err})"
    );
}

/// A batched decode step gives every sequence exactly (bit for bit) the logits it gets when
/// decoded alone, with sequences at different lengths, on both sides of `dense_len` and
/// past the sparse threshold, for the fast and the reference backend.
#[test]
fn batched_decode_equals_decoding_alone() {
    fn check<B: Backend>(be: &B, name: &str) {
        let config = tiny_config(150);
        let model = load(be, &config, 21);
        let v = config.vocab_size;
        // Prompt lengths: short, around dense_len, past it, and long enough for block choice.
        let lens = [3usize, 40, 149, 150, 260, 7];
        let prompts: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(n, v, 100 + i as u64))
            .collect();
        let steps = 5;
        let feeds: Vec<Vec<u32>> = (0..lens.len())
            .map(|i| tokens(steps, v, 200 + i as u64))
            .collect();
        let mut ws = model.workspace(be, 64).unwrap();
        let prefill = |ws: &mut _, p: &[u32]| {
            let mut seq = model.new_sequence(be).unwrap();
            model.prefill(be, ws, &mut seq, p, &mut |_| {}).unwrap();
            seq
        };
        // Alone: each sequence decoded by itself.
        let mut alone = Vec::new();
        for (p, f) in prompts.iter().zip(&feeds) {
            let mut seq = prefill(&mut ws, p);
            let mut rows = Vec::new();
            for &t in f {
                rows.push(model.decode(be, &mut ws, &mut seq, t).unwrap());
            }
            alone.push(rows);
        }
        // Together: one batched step per token for all sequences.
        let mut seqs: Vec<_> = prompts.iter().map(|p| prefill(&mut ws, p)).collect();
        for step in 0..steps {
            let toks: Vec<u32> = feeds.iter().map(|f| f[step]).collect();
            let mut refs: Vec<_> = seqs.iter_mut().collect();
            let logits = decode_step(be, &model, &mut ws, &mut refs, &toks).unwrap();
            assert_eq!(logits.len(), lens.len(), "{name}: one row a sequence");
            for (i, row) in logits.iter().enumerate() {
                assert_eq!(row.len(), v, "{name}: logits shape");
                assert!(
                    row == alone[i][step].as_slice(),
                    "{name}: sequence {i} (prompt {}) step {step}: batched logits differ from \
                     decoding alone (max diff {})",
                    lens[i],
                    row.iter()
                        .zip(&alone[i][step])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max)
                );
            }
        }
        for (s, &n) in seqs.iter().zip(&lens) {
            assert_eq!(s.pos, n + steps, "{name}: positions advance by one a step");
        }
        // A step past the workspace, or with an empty input, is an error, not a panic.
        let long = vec![1u32; 65];
        let mut seq = model.new_sequence(be).unwrap();
        assert!(model
            .forward_one(
                be,
                &mut ws,
                &mut seq,
                &long,
                SparseMode::Dense,
                LogitRows::Last
            )
            .is_err());
        assert!(model
            .forward_one(
                be,
                &mut ws,
                &mut seq,
                &[],
                SparseMode::Dense,
                LogitRows::Last
            )
            .is_err());
        assert_eq!(seq.pos, 0, "a refused step leaves the sequence as it was");
    }
    check(&CpuBackend::default(), "cpu");
    check(&ReferenceBackend, "reference");
}

/// The model builder reads the checkpoint schema: it asks for every tensor `expected_tensors`
/// lists, once each, and for no other, for configs with and without the optional tensors.
#[test]
fn the_model_loads_exactly_the_schema_tensors() {
    struct Recording<'a>(&'a RandomWeights, std::cell::RefCell<Vec<String>>);
    impl WeightSource for Recording<'_> {
        fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String> {
            self.1.borrow_mut().push(name.to_string());
            self.0.tensor(name)
        }
    }
    let mut plain = tiny_config(150);
    plain.qk_norm = false;
    plain.use_output_gate = false;
    plain.use_output_norm = false;
    plain.attn_use_output_gate = false;
    plain.tie_word_embeddings = true;
    for config in [tiny_config(150), plain] {
        let weights = RandomWeights::new(&config, 1);
        let src = Recording(&weights, Default::default());
        Model::load(&CpuBackend::default(), config.clone(), &src, &mut |_, _| {}).unwrap();
        let mut asked = src.1.take();
        let mut want: Vec<String> = expected_tensors(&config)
            .into_iter()
            .map(|s| s.name)
            .collect();
        asked.sort();
        want.sort();
        assert_eq!(asked, want);
    }
}

/// A step mixing decode rows with prompt chunks gives every sequence the logits it gets run
/// apart, bit for bit ([`sala_model::testing::check_mixed_step`]).
#[test]
fn mixed_step_equals_running_apart() {
    let config = tiny_config(150);
    check_mixed_step(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 23),
    )
    .unwrap();
    check_mixed_step(&ReferenceBackend, &load(&ReferenceBackend, &config, 23)).unwrap();
}

/// A step that reads only the last row of a prompt chunk (or none) gives it the logits of
/// reading every row and leaves the same caches, bit for bit
/// ([`sala_model::testing::check_last_layer_rows`]): below `dense_len` and past it, in chunks
/// of 16 and (the CPU's rows never depend on each other) of 64.
#[test]
fn reading_only_the_last_row_equals_reading_every_row() {
    let config = tiny_config(150);
    let cpu = load(&CpuBackend::default(), &config, 29);
    let reference = load(&ReferenceBackend, &config, 29);
    for (len, chunk) in [(45, 16), (200, 16), (200, 64)] {
        check_last_layer_rows(&CpuBackend::default(), &cpu, len, chunk).unwrap();
    }
    check_last_layer_rows(&ReferenceBackend, &reference, 170, 64).unwrap();
    // A lightning last layer: its state still reads every row.
    let mut lightning_last = config;
    lightning_last.mixer_types.swap(2, 3);
    let cpu = load(&CpuBackend::default(), &lightning_last, 29);
    for (len, chunk) in [(45, 16), (200, 64)] {
        check_last_layer_rows(&CpuBackend::default(), &cpu, len, chunk).unwrap();
    }
}

/// A sequence rewound to a snapshot reads on as a cold one, bit for bit, at a chunk
/// boundary ([`sala_model::testing::check_resume`]: the prefix cache's resume).
#[test]
fn a_sequence_resumed_from_a_snapshot_reads_on_as_a_cold_one() {
    let config = tiny_config(150);
    check_resume(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 33),
    )
    .unwrap();
    check_resume(&ReferenceBackend, &load(&ReferenceBackend, &config, 33)).unwrap();
}

/// Forks of a sequence read on as cold ones and leave it as it was
/// ([`sala_model::testing::check_fork`]: the prefix cache's hits).
#[test]
fn forks_read_on_as_cold_sequences_and_leave_theirs_alone() {
    let config = tiny_config(150);
    check_fork(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 35),
        300,
        64,
        &[128, 256],
    )
    .unwrap();
}

/// Rewinding a sequence undoes the tokens fed since its mark, bit for bit
/// ([`sala_model::testing::check_rewind`]).
#[test]
fn a_rewound_sequence_goes_on_as_if_never_ahead() {
    let config = tiny_config(150);
    check_rewind(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 31),
    )
    .unwrap();
    check_rewind(&ReferenceBackend, &load(&ReferenceBackend, &config, 31)).unwrap();
}

/// A short span gives each row the logits of decoding its tokens one at a time, bit for bit
/// ([`sala_model::testing::check_stepwise_spans`]).
#[test]
fn short_spans_equal_decoding_token_by_token() {
    let config = tiny_config(100);
    check_stepwise_spans(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 37),
    )
    .unwrap();
    check_stepwise_spans(&ReferenceBackend, &load(&ReferenceBackend, &config, 37)).unwrap();
}

/// Greedy picks of a step equal the host's pick from the same logits
/// ([`sala_model::testing::check_greedy_picks`]).
#[test]
fn greedy_picks_equal_picking_from_the_logits() {
    let config = tiny_config(150);
    check_greedy_picks(
        &CpuBackend::default(),
        &load(&CpuBackend::default(), &config, 29),
    )
    .unwrap();
    check_greedy_picks(&ReferenceBackend, &load(&ReferenceBackend, &config, 29)).unwrap();
}

/// `fill_random_context` (benchmarks): a fresh sequence holds the requested tokens of seeded
/// random caches, so the same seed decodes to the same logits, another seed to others, and a
/// sequence that already holds tokens is refused.
#[test]
fn random_context_is_seeded_and_decodes() {
    let config = tiny_config(96);
    let be = CpuBackend::default();
    let model = load(&be, &config, 3);
    let mut ws = model.workspace(&be, 8).unwrap();
    let decode_after_fill = |seed: u64| {
        let mut seq = model.new_sequence(&be).unwrap();
        model
            .fill_random_context(&be, &mut seq, 300, 2, seed)
            .unwrap();
        assert_eq!(seq.pos, 300);
        let mut ws = model.workspace(&be, 8).unwrap();
        let logits = model.decode(&be, &mut ws, &mut seq, 5).unwrap();
        assert_eq!(seq.pos, 301);
        logits
    };
    let a = decode_after_fill(1);
    assert!(a.iter().all(|x| x.is_finite()));
    assert_eq!(a, decode_after_fill(1), "same seed, same logits");
    assert_ne!(a, decode_after_fill(2), "another seed, other logits");
    let mut seq = model.new_sequence(&be).unwrap();
    model.decode(&be, &mut ws, &mut seq, 5).unwrap();
    let e = model
        .fill_random_context(&be, &mut seq, 10, 0, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already holds 1 tokens"), "{e}");
}

/// Caches for more tokens than any host holds are an error, not an abort, and the sequence
/// still works after it; so is a workspace no host holds.
#[test]
fn an_impossible_reservation_is_an_error_not_an_abort() {
    let config = tiny_config(150);
    let model = load(&CpuBackend::default(), &config, 3);
    let mut seq = model.new_sequence(&CpuBackend::default()).unwrap();
    let e = model
        .reserve(&CpuBackend::default(), &mut seq, usize::MAX / 1024)
        .unwrap_err();
    assert!(e.0.contains("cannot hold"), "{e}");
    let mut ws = model.workspace(&CpuBackend::default(), 16).unwrap();
    let logits = model
        .decode(&CpuBackend::default(), &mut ws, &mut seq, 1)
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let e = model
        .workspace(&CpuBackend::default(), usize::MAX / 1024)
        .err()
        .expect("no host holds it");
    assert!(e.0.contains("cannot hold"), "{e}");
}

/// The tiny model split over `n` simulated CPU ranks ([`sala_model::ranks::Ranks`]).
fn ranks(n: usize, config: &ModelConfig) -> Ranks<CpuBackend> {
    let backends = (0..n).map(|_| CpuBackend::default()).collect();
    Ranks::new(backends, Box::new(HostRanks), config).unwrap()
}

/// How far tensor-parallel logits may be from one device's (the median row): each rank's
/// partial sum of o_proj and down_proj is rounded to bf16 before the ranks add them (as
/// NCCL's bf16 all-reduce adds them), one rounding more per product than one device makes.
const RANKS_MEDIAN_ERR: f64 = 2e-2;

/// A model of 8 heads (2 KV heads in its sparse layers) for tensor parallelism up to 8
/// ranks: the released model's split in small.
fn tp_config() -> ModelConfig {
    let mut json = tiny_config(96).raw.clone();
    let extra = serde_json::json!({
        "hidden_size": 256, "num_attention_heads": 8, "lightning_nkv": 8,
        "intermediate_size": 512,
    });
    for (k, v) in extra.as_object().unwrap() {
        json[k] = v.clone();
    }
    ModelConfig::from_json(json).unwrap()
}

/// Tensor parallelism: the model over 1 rank gives one device's logits bit for bit; over 2,
/// 4 and 8 ranks (heads and the MLP's width split; past the sparse layers' 2 KV heads each
/// rank scores and attends its KV head's whole group and counts its own heads; o_proj's and
/// down_proj's partial sums and the lightning output norm's sums of squares added across
/// the ranks) the same within the rounding of the split sums, in dense and sparse
/// attention, in chunks and decode steps.
#[test]
fn tensor_parallel_ranks_give_one_devices_logits() {
    for (config, counts) in [(tiny_config(96), &[1, 2, 4][..]), (tp_config(), &[8][..])] {
        let one = load(&CpuBackend::default(), &config, 41);
        let v = config.vocab_size;
        for (n, mode) in [(40, SparseMode::Dense), (150, SparseMode::Sparse)] {
            let toks = tokens(n, v, 42 + n as u64);
            let chunks = [(n - 12, mode), (8, mode), (1, mode), (1, mode), (2, mode)];
            let want = run(&CpuBackend::default(), &one, &toks, &chunks);
            for &count in counts {
                let be = ranks(count, &config);
                let got = run(&be, &load(&be, &config, 41), &toks, &chunks);
                let what = format!(
                    "{mode:?}: {count} ranks of {} heads",
                    config.num_attention_heads
                );
                if count == 1 {
                    assert_eq!(got, want, "{what}");
                } else {
                    assert_logits_within(&what, &got, &want, v, RANKS_MEDIAN_ERR);
                }
            }
        }
    }
}

/// Random weights made on the ranks are one device's random weights cut into parts (each
/// value drawn at its index in the whole tensor).
#[test]
fn tensor_parallel_random_weights_are_one_devices_cut() {
    let config = tiny_config(96);
    let one = Model::random(&CpuBackend::default(), config.clone(), 7, &mut |_, _| {}).unwrap();
    let pair = ranks(2, &config);
    let split = Model::random(&pair, config.clone(), 7, &mut |_, _| {}).unwrap();
    let toks = tokens(60, config.vocab_size, 8);
    let chunks = [(60, SparseMode::Dense)];
    let want = run(&CpuBackend::default(), &one, &toks, &chunks);
    let got = run(&pair, &split, &toks, &chunks);
    let v = config.vocab_size;
    assert_logits_within("random weights, 2 ranks", &got, &want, v, RANKS_MEDIAN_ERR);
}

/// The bit-identity properties the engine stands on hold over ranks too: a mixed step equals
/// running apart, a resumed sequence and forks read on as cold ones, a rewind undoes.
#[test]
fn tensor_parallel_ranks_keep_batch_invariance_resume_fork_and_rewind() {
    let config = tiny_config(150);
    for count in [2, 4] {
        let be = ranks(count, &config);
        check_mixed_step(&be, &load(&be, &config, 23)).unwrap();
        check_resume(&be, &load(&be, &config, 33)).unwrap();
        check_fork(&be, &load(&be, &config, 35), 300, 64, &[128, 256]).unwrap();
        check_rewind(&be, &load(&be, &config, 31)).unwrap();
    }
}

/// A model's weights in 4 bits (round to nearest, asymmetric, groups of `group`) over
/// [`RandomWeights`]: every linear of its layers packed as a GPTQ checkpoint's are.
struct QuantWeights {
    plain: RandomWeights,
    packed: HashMap<String, (usize, usize, sala_checkpoint::quant::Rows)>,
}

impl QuantWeights {
    /// The config with its `quantization_config` and the weights.
    fn new(config: &ModelConfig, group: usize, seed: u64) -> (ModelConfig, Self) {
        let gptq = sala_checkpoint::quant::Gptq {
            group_size: Some(group),
            sym: false,
            zero_minus_one: false,
            skip: vec![],
        };
        let plain = RandomWeights::new(config, seed);
        let packed = expected_tensors(config)
            .into_iter()
            .filter(|t| matches!(t.place, sala_checkpoint::Place::Layer(..)) && t.shape.len() == 2)
            .map(|t| {
                let (out, inputs) = (t.shape[0], t.shape[1]);
                let values: Vec<f32> = plain.tensors[&t.name]
                    .1
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect();
                let (qweight, qzeros, scales) =
                    gptq.quantize_rtn(&t.name, &values, (out, inputs)).unwrap();
                let rows = gptq
                    .to_rows(&t.name, (out, inputs), &qweight, &qzeros, &scales, None)
                    .unwrap();
                (t.name, (out, inputs, rows))
            })
            .collect();
        let mut config = config.clone();
        config.quantization = Some(gptq);
        (config, Self { plain, packed })
    }
}

impl WeightSource for QuantWeights {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String> {
        self.plain.tensor(name)
    }
    fn with_quantized(
        &self,
        name: &str,
        f: &mut dyn FnMut(sala_model::QuantMatrix<'_>) -> sala_model::BResult<()>,
    ) -> sala_model::BResult<bool> {
        let Some((rows, cols, q)) = self.packed.get(name) else {
            return Ok(false);
        };
        f(sala_model::QuantMatrix {
            rows: *rows,
            cols: *cols,
            group: q.group,
            words: &q.words,
            scales: &q.scales,
            zeros: &q.zeros,
        })?;
        Ok(true)
    }
}

/// 4-bit weights over ranks: each rank's part of a packed weight in groups that lie within
/// the whole weight's (a group wider than a rank's part, or than the heads it counts, is cut
/// into smaller ones of the same scale and zero; the columns it holds but does not count with
/// a zero scale) gives one device's logits within the rounding of the split sums, from a
/// checkpoint's packed weights and from random ones; one rank bit for bit.
#[test]
fn tensor_parallel_ranks_run_4_bit_weights() {
    for (config, group, counts) in [
        (tiny_config(96), 128, &[1, 2, 4][..]),
        (tiny_config(96), 32, &[4][..]),
        (tp_config(), 256, &[8][..]),
    ] {
        let (config, src) = QuantWeights::new(&config, group, 61);
        let v = config.vocab_size;
        let one =
            Model::load(&CpuBackend::default(), config.clone(), &src, &mut |_, _| {}).unwrap();
        let random =
            Model::random(&CpuBackend::default(), config.clone(), 62, &mut |_, _| {}).unwrap();
        for (n, mode) in [(40, SparseMode::Dense), (150, SparseMode::Sparse)] {
            let toks = tokens(n, v, 63 + n as u64);
            let chunks = [(n - 4, mode), (1, mode), (3, mode)];
            let want = run(&CpuBackend::default(), &one, &toks, &chunks);
            let want_random = run(&CpuBackend::default(), &random, &toks, &chunks);
            for &count in counts {
                let be = ranks(count, &config);
                let split = Model::load(&be, config.clone(), &src, &mut |_, _| {}).unwrap();
                let got = run(&be, &split, &toks, &chunks);
                let what = format!("{mode:?}: group {group} over {count} ranks");
                if count == 1 {
                    assert_eq!(got, want, "{what}");
                } else {
                    assert_logits_within(&what, &got, &want, v, RANKS_MEDIAN_ERR);
                }
                let split = Model::random(&be, config.clone(), 62, &mut |_, _| {}).unwrap();
                let got = run(&be, &split, &toks, &chunks);
                let what = format!("random {what}");
                assert_logits_within(&what, &got, &want_random, v, RANKS_MEDIAN_ERR);
            }
        }
    }
}

/// Rank counts the model does not split into are refused by name.
#[test]
fn tensor_parallel_refuses_what_does_not_split() {
    let config = tiny_config(96);
    let refuse = |n: usize| {
        let backends = (0..n).map(|_| CpuBackend::default()).collect();
        match Ranks::new(backends, Box::new(HostRanks), &config) {
            Ok(_) => panic!("{n} ranks accepted"),
            Err(e) => e.0,
        }
    };
    let three = refuse(3);
    assert!(three.contains("do not split into 3"), "{three}");
    let eight = refuse(8);
    assert!(eight.contains("4 attention heads"), "{eight}");
    assert!(refuse(0).contains("at least 1 rank"));
    // A draft model's weights are not the model's: refused, not split as if they were.
    let be = ranks(2, &config);
    let bytes = vec![0u8; 2 * 8 * 4];
    let t = HostTensor {
        dtype: HostDType::Bf16,
        shape: &[8, 8],
        bytes: &bytes,
    };
    let e = be
        .upload_matrix("midlayer.self_attn.q_proj.weight", t)
        .err()
        .unwrap()
        .0;
    assert!(e.contains("draft model"), "{e}");
}

/// One device's logits: of `prompt`'s last token read in chunks of `chunk`, then of each of
/// `rest` decoded after it.
fn prefill_and_decode(
    one: &Model<CpuBackend>,
    prompt: &[u32],
    rest: &[u32],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let cpu = CpuBackend::default();
    let mut ws = one.workspace(&cpu, chunk).unwrap();
    let mut seq = one.new_sequence(&cpu).unwrap();
    let mut out = vec![one
        .prefill(&cpu, &mut ws, &mut seq, prompt, &mut |_| {})
        .unwrap()];
    for &t in rest {
        out.push(one.decode(&cpu, &mut ws, &mut seq, t).unwrap());
    }
    out
}

/// A context-parallel read a stage at a time ([`sala_model::context::ContextRead`]) with
/// other work on the last rank's workspace between stages (not `kept`) gives the logits of a
/// whole read bit for bit; it refuses, by name, fewer ranks than it began with, a rank whose
/// workspace changed, a stage past its end and an end before its last stage.
#[test]
fn context_read_in_stages_is_the_whole_read() {
    use sala_model::context::{prefill, ContextRank, ContextRead};
    let config = tiny_config(96);
    let v = config.vocab_size;
    let toks = tokens(301, v, 66);
    // Each range in one chunk: a kept read goes on from the rows its workspace holds.
    const ROWS: usize = 301;
    let models: Vec<_> = (0..3)
        .map(|_| load(&CpuBackend::default(), &config, 51))
        .collect();
    let fresh = |rows: usize| {
        let wss: Vec<_> = models
            .iter()
            .map(|m| m.workspace(&CpuBackend::default(), rows).unwrap())
            .collect();
        let seqs: Vec<_> = models
            .iter()
            .map(|m| m.new_sequence(&CpuBackend::default()).unwrap())
            .collect();
        (wss, seqs)
    };
    let cpu = CpuBackend::default();
    let bes = || std::iter::repeat(&cpu);
    let (mut wss, mut seqs) = fresh(ROWS);
    let mut ranks = ContextRank::zip(bes(), &models, &mut wss, &mut seqs);
    let whole = prefill(&mut ranks, &HostRanks, &toks).unwrap();
    drop(ranks);
    let (mut wss, mut seqs) = fresh(ROWS);
    let mode = models[0].sparse_mode(toks.len());
    let mut stages = 0;
    {
        let mut ranks = ContextRank::zip(bes(), &models, &mut wss, &mut seqs);
        let mut read = ContextRead::new(&ranks, &toks, mode, false).unwrap();
        let e = read.advance(&mut ranks[..1], &HostRanks).unwrap_err().0;
        assert!(e.contains("1 ranks lent to a read over 3"), "{e}");
        while !read.is_done() {
            read.advance(&mut ranks, &HostRanks).unwrap();
            stages += 1;
            // Another sequence's step on the last rank's workspace.
            let last = ranks.last_mut().unwrap();
            let mut other = models[2].new_sequence(&CpuBackend::default()).unwrap();
            models[2]
                .prefill(
                    &CpuBackend::default(),
                    last.ws,
                    &mut other,
                    &toks[..5],
                    &mut |_| {},
                )
                .unwrap();
        }
        let e = read.advance(&mut ranks, &HostRanks).unwrap_err().0;
        assert!(e.contains("done already"), "{e}");
        let last = read.finish(&mut ranks).unwrap();
        assert_eq!((read.ranges(), last), (&whole.ranges[..], whole.last));
    }
    assert!(
        stages > models[0].config.num_hidden_layers,
        "{stages} stages"
    );
    // The last rank's logits, from a decode of the prompt's last token on both.
    let last = whole.last;
    let next = toks[0];
    let (mut wss_a, mut seqs_a) = fresh(ROWS);
    let mut ranks = ContextRank::zip(bes(), &models, &mut wss_a, &mut seqs_a);
    prefill(&mut ranks, &HostRanks, &toks).unwrap();
    drop(ranks);
    let a = models[last]
        .decode(
            &CpuBackend::default(),
            &mut wss_a[last],
            &mut seqs_a[last],
            next,
        )
        .unwrap();
    let b = models[last]
        .decode(
            &CpuBackend::default(),
            &mut wss[last],
            &mut seqs[last],
            next,
        )
        .unwrap();
    assert_eq!(a, b, "a read in stages with other work between");
    // An end before the last stage; a workspace changed under the read.
    let (mut wss, mut seqs) = fresh(ROWS);
    let mut ranks = ContextRank::zip(bes(), &models, &mut wss, &mut seqs);
    let mut read = ContextRead::new(&ranks, &toks, mode, false).unwrap();
    read.advance(&mut ranks, &HostRanks).unwrap();
    let mut other = models[0].workspace(&CpuBackend::default(), 20).unwrap();
    ranks[0].ws = &mut other;
    let e = read.advance(&mut ranks, &HostRanks).unwrap_err().0;
    assert!(e.contains("workspace changed"), "{e}");
    let e = read.finish(&mut ranks).unwrap_err().0;
    assert!(e.contains("the read is at layer"), "{e}");
}

/// Context parallelism over tensor-parallel groups: each context rank a group of 2 or 4 CPU
/// ranks (4 shares the sparse layers' 2 KV heads), rank `r` of each group exchanging with rank
/// `r` of the others ([`RankExchange`]); the last group's logits are one device's within the
/// rounding of the split sums and the scan, and decoding goes on there as one device's does.
#[test]
fn context_parallel_over_tensor_parallel_groups_gives_one_devices_logits() {
    use sala_model::context::{prefill, ContextRank, Exchange};
    use sala_model::ranks::RankExchange;
    let config = tp_config();
    let v = config.vocab_size;
    let one = load(&CpuBackend::default(), &config, 63);
    for (n, seed, chunk) in [(150usize, 64u64, 150), (301, 65, 37)] {
        let toks = tokens(n + 3, v, seed);
        let (prompt, rest) = toks.split_at(n);
        let want = prefill_and_decode(&one, prompt, rest, chunk);
        for (size, count) in [(2usize, 2usize), (4, 3)] {
            let groups: Vec<_> = (0..count).map(|_| ranks(size, &config)).collect();
            let models: Vec<_> = groups.iter().map(|g| load(g, &config, 63)).collect();
            let mut wss: Vec<_> = models
                .iter()
                .zip(&groups)
                .map(|(m, g)| m.workspace(g, chunk).unwrap())
                .collect();
            let mut seqs: Vec<_> = models
                .iter()
                .zip(&groups)
                .map(|(m, g)| m.new_sequence(g).unwrap())
                .collect();
            let exchange = RankExchange::new(
                (0..size)
                    .map(|_| Box::new(HostRanks) as Box<dyn Exchange<CpuBackend> + Send>)
                    .collect(),
            );
            let mut parts = ContextRank::zip(&groups, &models, &mut wss, &mut seqs);
            let done = prefill(&mut parts, &exchange, prompt).unwrap();
            drop(parts);
            let what = format!("{n} tokens over {count} groups of {size} in chunks of {chunk}");
            assert_eq!(done.ranges.len(), count, "{what}");
            let last = done.last;
            assert_eq!(last, count - 1, "{what}");
            let mut got = vec![done.logits];
            for &t in rest {
                got.push(
                    models[last]
                        .decode(&groups[last], &mut wss[last], &mut seqs[last], t)
                        .unwrap(),
                );
            }
            assert_logits_within(&what, &got.concat(), &want.concat(), v, RANKS_MEDIAN_ERR);
        }
    }
}

/// Context parallelism ([`sala_model::context::prefill`]): a prompt read by 1 to 5 CPU ranks
/// at once, each a block-aligned range (lightning states scanned across the ranges, each
/// rank's cache given the earlier ranks' keys and values), gives one device's last logits
/// (over 1 rank bit for bit; over more within the rounding of the lightning scan), and
/// decoding on the last rank goes on as one device's decoding does; dense and sparse.
#[test]
fn context_parallel_prefill_gives_one_devices_logits_and_decodes_on() {
    use sala_model::context::{prefill, ContextRank};
    let config = tiny_config(96);
    let v = config.vocab_size;
    let one = load(&CpuBackend::default(), &config, 51);
    // Each rank reads its range in chunks of its workspace's rows: whole ranges, and chunks
    // that end inside blocks.
    let cases = [
        (40usize, 52u64, 40),
        (150, 53, 150),
        (301, 54, 301),
        (150, 55, 24),
        (301, 56, 37),
    ];
    for (n, seed, chunk) in cases {
        let toks = tokens(n + 4, v, seed);
        let (prompt, rest) = toks.split_at(n);
        let want = prefill_and_decode(&one, prompt, rest, chunk);
        for count in [1usize, 2, 3, 5] {
            let models: Vec<_> = (0..count)
                .map(|_| load(&CpuBackend::default(), &config, 51))
                .collect();
            let mut wss: Vec<_> = models
                .iter()
                .map(|m| m.workspace(&CpuBackend::default(), chunk).unwrap())
                .collect();
            let mut seqs: Vec<_> = models
                .iter()
                .map(|m| m.new_sequence(&CpuBackend::default()).unwrap())
                .collect();
            let cpu = CpuBackend::default();
            let bes = std::iter::repeat(&cpu);
            let mut ranks = ContextRank::zip(bes, &models, &mut wss, &mut seqs);
            let done = prefill(&mut ranks, &HostRanks, prompt).unwrap();
            drop(ranks);
            let what = format!("{n} tokens over {count} ranks in chunks of {chunk}");
            assert_eq!(done.ranges.last().unwrap().end, n, "{what}");
            assert_eq!(done.last, done.ranges.len() - 1, "{what}");
            if count > 1 && n > 16 {
                assert!(done.ranges.len() > 1, "{what}: one range");
            }
            let mut got = vec![done.logits];
            let (model, ws, seq) = (
                &models[done.last],
                &mut wss[done.last],
                &mut seqs[done.last],
            );
            assert_eq!(seq.pos, n);
            for &t in rest {
                got.push(model.decode(&CpuBackend::default(), ws, seq, t).unwrap());
            }
            if count == 1 {
                assert_eq!(got, want, "{what}");
            } else {
                assert_logits_close(&what, &got.concat(), &want.concat(), v);
            }
        }
    }
}
