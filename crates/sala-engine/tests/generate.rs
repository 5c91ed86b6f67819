//! The generation loop on a tiny random checkpoint: stop conditions, budgets, streaming.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions, Generation};
use sala_engine::sampling::SamplingParams;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let config = preset("tiny").unwrap();
    write_random_checkpoint(
        dir,
        &config,
        &WriteOptions {
            seed: 11,
            ..Default::default()
        },
    )
    .unwrap();
    sala_tokenizer::write_test_tokenizer(dir, config.vocab_size).unwrap();
    Engine::load(CpuBackend, dir, 16, &mut |_, _| {}).unwrap()
}

fn opts(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        sampling: SamplingParams::default(),
        max_tokens,
        max_context: 4096,
        stop: Vec::new(),
        eos_ids: Vec::new(),
    }
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
