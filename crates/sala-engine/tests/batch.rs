//! Continuous batching on a tiny random checkpoint: a request's tokens are the same alone and
//! among others (greedy and seeded sampling), requests join and leave at any step, a cancelled
//! request leaves at once, and admission checks the memory of the whole batch.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::batch::{Batch, BatchEvent, RequestId};
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_model::memory::{MemoryLimit, Target};
use sala_model::numerics::TestRng;
use std::collections::HashMap;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let config = preset("tiny").unwrap();
    write_random_checkpoint(
        dir,
        &config,
        &WriteOptions {
            seed: 3,
            ..Default::default()
        },
    )
    .unwrap();
    sala_tokenizer::write_test_tokenizer(dir, config.vocab_size).unwrap();
    // 64-token prefill chunks: prompts longer than that take several steps to read.
    let mut e = Engine::load(CpuBackend, dir, 64, &mut |_, _| {}).unwrap();
    e.set_max_batch(32).unwrap();
    e
}

fn opts(max_tokens: usize, temperature: f32, seed: u64) -> GenerateOptions {
    GenerateOptions {
        sampling: SamplingParams {
            temperature,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        max_tokens,
        max_context: 4096,
        stop: Vec::new(),
        eos_ids: Vec::new(),
    }
}

/// Prompts of many lengths: shorter than a chunk, several chunks, past `dense_len` (96).
fn prompts(n: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = TestRng::new(9);
    (0..n)
        .map(|i| {
            let len = [3, 20, 64, 65, 97, 150, 200, 11][i % 8] + i;
            (0..len).map(|_| 3 + rng.below(vocab - 3) as u32).collect()
        })
        .collect()
}

/// Every request's generated token ids and finish reason, alone.
fn alone(
    e: &mut Engine<CpuBackend>,
    ps: &[Vec<u32>],
    os: &[GenerateOptions],
) -> Vec<(Vec<u32>, FinishReason)> {
    ps.iter()
        .zip(os)
        .map(|(p, o)| {
            let g = e.generate(p, o, &mut |_| {}, &mut |_| {}).unwrap();
            (g.tokens.iter().map(|t| t.id).collect(), g.finish)
        })
        .collect()
}

/// Runs the batch until empty, admitting request i at step `join[i]`; returns each request's
/// tokens and finish reason, in request order.
fn batched(
    e: &mut Engine<CpuBackend>,
    ps: &[Vec<u32>],
    os: &[GenerateOptions],
    join: &[usize],
) -> Vec<(Vec<u32>, FinishReason)> {
    let mut batch = Batch::new(e.max_batch());
    let mut ids: HashMap<RequestId, usize> = HashMap::new();
    let mut out: Vec<(Vec<u32>, Option<FinishReason>)> = vec![(Vec::new(), None); ps.len()];
    let mut step = 0;
    loop {
        for (i, (p, o)) in ps.iter().zip(os).enumerate() {
            if join[i] == step {
                let id = e.admit(&mut batch, p.clone(), o, None).unwrap();
                ids.insert(id, i);
            }
        }
        if batch.is_empty() && join.iter().all(|&j| j < step) {
            break;
        }
        e.step(&mut batch, &|_| true, &mut |id, ev| {
            let i = ids[&id];
            match ev {
                BatchEvent::Step(s) => {
                    if let Some(t) = s.token {
                        out[i].0.push(t.id);
                    }
                }
                BatchEvent::Done(r) => out[i].1 = Some(r.unwrap().finish),
                BatchEvent::Prefilled { prompt_tokens } => assert_eq!(prompt_tokens, ps[i].len()),
            }
            true
        });
        step += 1;
        assert!(step < 10_000, "the batch does not drain");
    }
    out.into_iter()
        .map(|(t, f)| (t, f.expect("every request ends with Done")))
        .collect()
}

#[test]
fn tokens_are_the_same_alone_and_among_sixteen_others() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let ps = prompts(17, vocab);
    for temperature in [0.0, 0.9] {
        let os: Vec<_> = (0..ps.len())
            .map(|i| opts(12 + i % 5, temperature, 1000 + i as u64))
            .collect();
        let want = alone(&mut e, &ps, &os);
        // All at once, then joining at different steps (some while others decode).
        let join_all = vec![0; ps.len()];
        let join_staggered: Vec<usize> = (0..ps.len()).map(|i| (i * 3) % 11).collect();
        for join in [join_all, join_staggered] {
            let got = batched(&mut e, &ps, &os, &join);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g,
                    w,
                    "temperature {temperature}, request {i} (prompt {} tokens), joins {join:?}",
                    ps[i].len()
                );
            }
        }
        // Greedy runs differ between requests (the check is not vacuous).
        if temperature == 0.0 {
            assert!(want.iter().any(|w| w.0 != want[0].0));
        }
    }
}

#[test]
fn a_cancelled_request_leaves_and_the_rest_go_on() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let ps = prompts(4, vocab);
    let os: Vec<_> = (0..4).map(|i| opts(10, 0.0, i)).collect();
    let want = alone(&mut e, &ps, &os);
    let mut batch = Batch::new(e.max_batch());
    let ids: Vec<RequestId> = ps
        .iter()
        .zip(&os)
        .map(|(p, o)| e.admit(&mut batch, p.clone(), o, None).unwrap())
        .collect();
    let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
    let mut done: HashMap<RequestId, FinishReason> = HashMap::new();
    let mut steps = 0;
    while !batch.is_empty() {
        // Request 1 stops after its third token (its client "disconnects"); request 2 is
        // dropped from outside the step after the fifth step.
        e.step(&mut batch, &|_| true, &mut |id, ev| match ev {
            BatchEvent::Step(s) => {
                if let Some(t) = s.token {
                    tokens.entry(id).or_default().push(t.id);
                }
                !(id == ids[1] && tokens[&id].len() >= 3)
            }
            BatchEvent::Done(r) => {
                done.insert(id, r.unwrap().finish);
                true
            }
            BatchEvent::Prefilled { .. } => true,
        });
        steps += 1;
        if steps == 5 {
            assert_eq!(batch.cancel_where(|id| id == ids[2]), vec![ids[2]]);
        }
        assert!(steps < 1000);
    }
    assert_eq!(done[&ids[1]], FinishReason::Cancelled);
    assert_eq!(tokens[&ids[1]].len(), 3);
    assert!(
        !done.contains_key(&ids[2]),
        "a request dropped from outside gets no Done"
    );
    for i in [0, 3] {
        assert_eq!(done[&ids[i]], FinishReason::Length);
        assert_eq!(
            tokens[&ids[i]], want[i].0,
            "request {i} is unaffected by the others"
        );
    }
}

#[test]
fn admission_checks_the_memory_of_the_whole_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let o = opts(100, 0.0, 0);
    let total = 300 + 100;
    // Room for one request of 400 tokens but not two.
    let one = e.memory_plan(total, Target::Cpu).total();
    let cache = e.memory_plan(total, Target::Cpu).cache.total();
    e.set_memory_limit(
        Some(MemoryLimit {
            bytes: one + cache / 2,
            source: "test".into(),
        }),
        Target::Cpu,
    );
    let p: Vec<u32> = (0..300).map(|i| 3 + i % 200).collect();
    let mut batch = Batch::new(e.max_batch());
    e.admit(&mut batch, p.clone(), &o, None).unwrap();
    match e.admit(&mut batch, p.clone(), &o, None) {
        Err(EngineError::OverBudget(err)) => assert!(err.plan.total() > err.limit.bytes),
        other => panic!("expected OverBudget, got {other:?}"),
    }
    assert_eq!(batch.len(), 1, "a refused request is not admitted");
    // Empty prompts and over-long prompts are refused too.
    assert!(matches!(
        e.admit(&mut batch, Vec::new(), &o, None),
        Err(EngineError::EmptyPrompt)
    ));
}
