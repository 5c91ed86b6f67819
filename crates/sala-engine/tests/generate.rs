//! The generation loop on a tiny random checkpoint: stop conditions, budgets, streaming.

mod common;

use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions, Generation};
use sala_engine::sampling::SamplingParams;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    common::tiny_engine(dir, 11, 16, |_| {})
}

fn opts(max_tokens: usize) -> GenerateOptions {
    common::options(max_tokens, SamplingParams::default())
}

fn run(e: &mut Engine<CpuBackend>, prompt: &[u32], o: &GenerateOptions) -> (Generation, String) {
    let mut streamed = String::new();
    let g = e
        .generate(prompt, o, &mut |t| streamed.push_str(t), &mut |_| {})
        .unwrap();
    (g, streamed)
}

#[test]
fn budgets_eos_and_stop_strings() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let prompt = e
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog", true)
        .unwrap();
    assert_eq!(prompt[0], 1, "BOS first");

    // max_tokens: exactly that many tokens, finish "length"; streamed text = final text.
    let (g, streamed) = run(&mut e, &prompt, &opts(40));
    assert_eq!(g.tokens.len(), 40);
    assert_eq!(g.finish, FinishReason::Length);
    assert_eq!(streamed, g.text);
    let ids: Vec<u32> = g.tokens.iter().map(|t| t.id).collect();
    assert_eq!(g.text, e.tokenizer.decode(&ids, true).unwrap());

    // The context budget caps generation.
    let mut o = opts(40);
    o.max_context = prompt.len() + 5;
    let (g5, _) = run(&mut e, &prompt, &o);
    assert_eq!(g5.tokens.len(), 5);
    assert_eq!(g5.finish, FinishReason::Length);
    o.max_context = prompt.len();
    let err = e
        .generate(&prompt, &o, &mut |_| {}, &mut |_| {})
        .unwrap_err();
    assert!(matches!(err, EngineError::PromptTooLong { .. }), "{err}");
    let err = e
        .generate(&[], &opts(4), &mut |_| {}, &mut |_| {})
        .unwrap_err();
    assert!(matches!(err, EngineError::EmptyPrompt), "{err}");

    // An EOS id ends generation at its first occurrence; it is not shown.
    let eos = ids[6];
    let first = ids.iter().position(|&t| t == eos).unwrap();
    let mut o = opts(40);
    o.eos_ids = vec![eos];
    let (ge, _) = run(&mut e, &prompt, &o);
    assert_eq!(ge.finish, FinishReason::Stop);
    assert_eq!(ge.tokens.len(), first + 1);
    assert_eq!(ge.text, e.tokenizer.decode(&ids[..first], true).unwrap());

    // A stop string cuts the text right before its first occurrence.
    let chars: Vec<char> = g.text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = g.text.find(&stop).unwrap();
    let mut o = opts(40);
    o.stop = vec![stop.clone()];
    let (gs, streamed) = run(&mut e, &prompt, &o);
    assert_eq!(gs.finish, FinishReason::Stop, "stop {stop:?}");
    assert_eq!(gs.text, g.text[..cut]);
    assert_eq!(streamed, gs.text);
    assert!(gs.tokens.len() < 40);
}

#[test]
fn seeded_sampling_repeats_and_greedy_is_stable() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let prompt = e.tokenizer.encode("Hello", true).unwrap();
    let mut o = opts(20);
    o.sampling = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        seed: Some(42),
        ..Default::default()
    };
    let a = run(&mut e, &prompt, &o).0.text;
    let b = run(&mut e, &prompt, &o).0.text;
    assert_eq!(a, b);
    o.sampling.seed = Some(43);
    assert_ne!(a, run(&mut e, &prompt, &o).0.text);
    assert_eq!(
        run(&mut e, &prompt, &opts(20)).0.text,
        run(&mut e, &prompt, &opts(20)).0.text
    );
}

/// The raw log-softmax of `logits`, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits.iter().map(|&x| x as f64 - max - z.ln()).collect()
}

#[test]
fn steps_carry_raw_logprobs_and_the_text() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let prompt = e.tokenizer.encode("The sea was calm", true).unwrap();
    let mut o = opts(12);
    // Penalties and temperature change what is sampled, not the reported logprobs.
    o.sampling = SamplingParams {
        temperature: 0.7,
        presence_penalty: 1.5,
        frequency_penalty: 0.5,
        seed: Some(3),
        ..Default::default()
    };
    let mut steps = Vec::new();
    let mut texts = String::new();
    let g = e
        .generate_steps(
            &prompt,
            &o,
            Some(4),
            &mut |s| {
                texts.push_str(s.text);
                if let Some(t) = s.token {
                    steps.push(t.clone());
                }
                true
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(texts, g.text);
    let ids: Vec<u32> = g.tokens.iter().map(|t| t.id).collect();
    assert_eq!(steps.iter().map(|s| s.id).collect::<Vec<_>>(), ids);

    // Replay the same tokens through the model and compare with an f64 log-softmax.
    let (be, model) = (&e.backend, &e.model);
    let mut ws = model.workspace(be, 16).unwrap();
    let mut seq = model.new_sequence(be).unwrap();
    let mut logits = model
        .prefill(be, &mut ws, &mut seq, &prompt, &mut |_| {})
        .unwrap();
    for (i, step) in steps.iter().enumerate() {
        let lp = log_softmax(&logits);
        let got = step.logprobs.as_ref().expect("logprobs were asked for");
        assert_eq!(got.id, step.id);
        assert!(
            (got.logprob as f64 - lp[step.id as usize]).abs() < 1e-4,
            "step {i}"
        );
        assert_eq!(got.top.len(), 4);
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
        for (k, (id, l)) in got.top.iter().enumerate() {
            assert!((*l as f64 - lp[*id as usize]).abs() < 1e-4, "step {i}");
            assert!(
                (lp[*id as usize] - lp[order[k]]).abs() < 1e-6,
                "step {i} rank {k}"
            );
        }
        logits = model.decode(be, &mut ws, &mut seq, step.id).unwrap();
    }

    // Greedy: the chosen token is the most likely one; no logprobs unless asked.
    let mut greedy = Vec::new();
    e.generate_steps(
        &prompt,
        &opts(6),
        Some(1),
        &mut |s| {
            greedy.extend(s.token.cloned());
            true
        },
        &mut |_| {},
    )
    .unwrap();
    for s in &greedy {
        let lp = s.logprobs.as_ref().unwrap();
        assert_eq!(lp.top[0].0, s.id);
        assert_eq!(lp.top[0].1, lp.logprob);
    }
    let mut none = 0;
    e.generate_steps(
        &prompt,
        &opts(3),
        None,
        &mut |s| {
            none += s.token.map_or(0, |t| t.logprobs.is_some() as usize);
            true
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(none, 0);
}

#[test]
fn an_eos_step_is_reported_and_a_false_step_cancels() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let prompt = e.tokenizer.encode("Hello there", true).unwrap();
    let (g, _) = run(&mut e, &prompt, &opts(10));
    let mut o = opts(10);
    o.eos_ids = vec![g.tokens[4].id];
    let first = g.tokens.iter().position(|t| t.id == o.eos_ids[0]).unwrap();
    let mut eos_steps = Vec::new();
    let ge = e
        .generate_steps(
            &prompt,
            &o,
            None,
            &mut |s| {
                if let Some(t) = s.token {
                    eos_steps.push(t.eos);
                }
                true
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(ge.finish, FinishReason::Stop);
    assert_eq!(eos_steps.len(), first + 1);
    assert_eq!(eos_steps.iter().filter(|&&x| x).count(), 1);
    assert!(eos_steps[first]);

    let mut calls = 0;
    let gc = e
        .generate_steps(
            &prompt,
            &opts(10),
            None,
            &mut |s| {
                calls += 1;
                assert!(s.token.is_some(), "no final flush after a cancel");
                calls < 2
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(gc.finish, FinishReason::Cancelled);
    assert_eq!(gc.tokens.len(), 2);
}

#[test]
fn generate_is_the_plain_model_loop() {
    // `generate` runs through the batch step; its tokens are those of the model's own
    // chunked prefill and decode with one sampler, greedy and seeded.
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let prompt: Vec<u32> = (0..50).map(|i| 3 + (i * 37) % (vocab as u32 - 3)).collect();
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            repetition_penalty: 1.2,
            seed: Some(5),
            ..Default::default()
        },
    ] {
        let mut o = opts(24);
        o.sampling = sampling.clone();
        let mut chunks = Vec::new();
        let g = e
            .generate(&prompt, &o, &mut |_| {}, &mut |n| chunks.push(n))
            .unwrap();
        assert_eq!(chunks, [16, 16, 16, 2], "prefill progress by chunk");

        let (be, model) = (&e.backend, &e.model);
        let mut ws = model.workspace(be, 16).unwrap();
        let mut seq = model.new_sequence(be).unwrap();
        model.reserve(be, &mut seq, prompt.len() + 24).unwrap();
        let mut logits = model
            .prefill(be, &mut ws, &mut seq, &prompt, &mut |_| {})
            .unwrap();
        let mut sampler = sala_engine::sampling::Sampler::new(sampling, vocab).unwrap();
        sampler.add_prompt(&prompt).unwrap();
        let mut want = Vec::new();
        for _ in 0..24 {
            let tok = sampler.sample(&logits).unwrap();
            sampler.record_output(tok.id).unwrap();
            want.push(tok);
            logits = model.decode(be, &mut ws, &mut seq, tok.id).unwrap();
        }
        assert_eq!(g.tokens, want);
    }
}
