//! What the engine's test files share: the tiny preset's engine on the CPU over a random
//! checkpoint, generation options, and a batch of requests run together.
#![allow(dead_code)] // each test file uses its part

use sala_checkpoint::{preset, write_random_checkpoint, ModelConfig, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_engine::step::StepEvent;
use std::path::Path;

/// The tiny preset's engine on the CPU, reading prompts in chunks of `chunk` tokens, over a
/// random checkpoint with weights from `seed` and the preset's config changed by `edit`,
/// written to `dir` with a test tokenizer (once: an engine loaded again from `dir` reads it).
pub fn tiny_engine(
    dir: &Path,
    seed: u64,
    chunk: usize,
    edit: impl FnOnce(&mut ModelConfig),
) -> Engine<CpuBackend> {
    if !dir.join("config.json").exists() {
        let mut config = preset("tiny").unwrap();
        edit(&mut config);
        let opts = WriteOptions {
            seed,
            ..Default::default()
        };
        write_random_checkpoint(dir, &config, &opts).unwrap();
        sala_tokenizer::write_test_tokenizer(dir, config.vocab_size).unwrap();
    }
    Engine::load(CpuBackend::default(), dir, chunk, &mut |_, _| {}).unwrap()
}

/// `max_tokens` tokens sampled by `sampling` within 4096 tokens of context: no stop strings,
/// EOS ids, grammar, prompt logprobs or drafts (set them by struct update).
pub fn options(max_tokens: usize, sampling: SamplingParams) -> GenerateOptions {
    GenerateOptions {
        sampling,
        max_tokens,
        max_context: 4096,
        stop: Vec::new(),
        eos_ids: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        speculate: None,
    }
}

/// Greedy sampling.
pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// Sampling at `temperature` with `seed`.
pub fn seeded(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        ..SamplingParams::default()
    }
}

/// Admits every request (a prompt and its options) into one batch, each one's events to
/// `on_event(its index, event)`, and steps until all have ended.
pub fn run_together<'a>(
    e: &mut Engine<CpuBackend>,
    requests: impl IntoIterator<Item = (&'a Vec<u32>, &'a GenerateOptions)>,
    on_event: &dyn Fn(usize, StepEvent<'_>),
) {
    let mut batch = e.batch();
    for (i, (p, o)) in requests.into_iter().enumerate() {
        let client = move |ev: StepEvent<'_>| {
            on_event(i, ev);
            true
        };
        e.admit(&mut batch, p.clone(), o, None, client).unwrap();
    }
    while !batch.is_empty() {
        e.step(&mut batch);
    }
}
