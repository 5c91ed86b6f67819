//! Continuous batching on a tiny random checkpoint: a request's tokens are the same alone and
//! among others (greedy and seeded sampling), requests join and leave at any step, a cancelled
//! request leaves at once, admission checks the memory of the whole batch, and the cache
//! budget counts what the batch holds until each request ends.

mod common;

use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use sala_engine::request::RequestId;
use sala_engine::step::StepEvent;
use sala_model::memory::{cache_bytes, MemoryLimit};
use sala_model::numerics::TestRng;
use std::cell::RefCell;
use std::collections::HashMap;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    // 64-token prefill chunks: prompts longer than that take several steps to read.
    let mut e = common::tiny_engine(dir, 3, 64, |_| {});
    e.set_max_batch(32).unwrap();
    e
}

fn opts(max_tokens: usize, temperature: f32, seed: u64) -> GenerateOptions {
    common::options(max_tokens, common::seeded(temperature, seed))
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
    let out: RefCell<Vec<(Vec<u32>, Option<FinishReason>)>> =
        RefCell::new(vec![(Vec::new(), None); ps.len()]);
    let mut batch = e.batch();
    let mut step = 0;
    loop {
        for (i, (p, o)) in ps.iter().zip(os).enumerate() {
            if join[i] == step {
                let (out, len) = (&out, p.len());
                let client = move |ev: StepEvent<'_>| {
                    let out = &mut out.borrow_mut()[i];
                    match ev {
                        StepEvent::Token(s) => {
                            if let Some(t) = s.token {
                                out.0.push(t.id);
                            }
                        }
                        StepEvent::Done(r) => out.1 = Some(r.unwrap().finish),
                        StepEvent::Prefilled {
                            prompt_tokens,
                            logprobs,
                        } => {
                            assert_eq!(prompt_tokens, len);
                            assert!(logprobs.is_none());
                        }
                        StepEvent::Read { .. } => {}
                    }
                    true
                };
                e.admit(&mut batch, p.clone(), o, None, client).unwrap();
            }
        }
        if batch.is_empty() && join.iter().all(|&j| j < step) {
            break;
        }
        e.step(&mut batch);
        step += 1;
        assert!(step < 10_000, "the batch does not drain");
    }
    drop(batch);
    out.into_inner()
        .into_iter()
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
    let tokens: RefCell<HashMap<RequestId, Vec<u32>>> = RefCell::default();
    let done: RefCell<HashMap<RequestId, FinishReason>> = RefCell::default();
    let mut batch = e.batch();
    // Request 1 stops after its third token (its client "disconnects"); request 2 is dropped
    // from outside the step after the fifth step.
    let ids: Vec<RequestId> = ps
        .iter()
        .zip(&os)
        .enumerate()
        .map(|(i, (p, o))| {
            let (tokens, done) = (&tokens, &done);
            let id = i as RequestId;
            let client = move |ev: StepEvent<'_>| match ev {
                StepEvent::Token(s) => {
                    let mut tokens = tokens.borrow_mut();
                    let mine = tokens.entry(id).or_default();
                    if let Some(t) = s.token {
                        mine.push(t.id);
                    }
                    !(i == 1 && mine.len() >= 3)
                }
                StepEvent::Done(r) => {
                    done.borrow_mut().insert(id, r.unwrap().finish);
                    true
                }
                StepEvent::Prefilled { .. } | StepEvent::Read { .. } => true,
            };
            let got = e.admit(&mut batch, p.clone(), o, None, client).unwrap();
            assert_eq!(got, id, "ids count from 0 in admission order");
            got
        })
        .collect();
    let mut steps = 0;
    while !batch.is_empty() {
        e.step(&mut batch);
        steps += 1;
        if steps == 5 {
            let gone: Vec<RequestId> = batch
                .cancel_where(|id, _| id == ids[2])
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            assert_eq!(gone, vec![ids[2]]);
        }
        assert!(steps < 1000);
    }
    assert_eq!(batch.cache().sequences(), 0);
    assert_eq!(batch.cache().held_bytes(), 0);
    drop(batch);
    let (tokens, done) = (tokens.into_inner(), done.into_inner());
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
    let one = e.memory_plan(total).total();
    let cache = e.memory_plan(total).cache.total();
    e.set_memory_limit(Some(MemoryLimit {
        bytes: one + cache / 2,
        source: "test".into(),
    }));
    let p: Vec<u32> = (0..300).map(|i| 3 + i % 200).collect();
    let quiet = |_: StepEvent<'_>| true;
    let mut batch = e.batch();
    e.admit(&mut batch, p.clone(), &o, None, quiet).unwrap();
    // It would fit alone: the memory is busy.
    match e.admit(&mut batch, p.clone(), &o, None, quiet) {
        Err(EngineError::MemoryBusy(err)) => assert!(err.plan.total() > err.limit.bytes),
        other => panic!("expected MemoryBusy, got {other:?}"),
    }
    assert_eq!(batch.len(), 1, "a refused request is not admitted");
    assert_eq!(batch.cache().sequences(), 1);
    // Too large even alone: over budget, whatever is in flight.
    let long = opts(1000, 0.0, 0);
    assert!(matches!(
        e.admit(&mut batch, p.clone(), &long, None, quiet),
        Err(EngineError::OverBudget(_))
    ));
    // Empty prompts and over-long prompts are refused too.
    assert!(matches!(
        e.admit(&mut batch, Vec::new(), &o, None, quiet),
        Err(EngineError::EmptyPrompt)
    ));
    // Once the first request leaves, the second fits.
    batch.cancel_where(|_, _| true);
    e.admit(&mut batch, p.clone(), &o, None, quiet).unwrap();
}

#[test]
fn the_cache_budget_counts_what_each_request_holds_until_it_ends() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let config = e.model.config.clone();
    let bytes = |n: usize| cache_bytes(&config, n).total();
    let ps = prompts(3, config.vocab_size);
    let generated: RefCell<Vec<usize>> = RefCell::new(vec![0; 3]);
    let mut batch = e.batch();
    for (i, p) in ps.iter().enumerate() {
        let generated = &generated;
        let client = move |ev: StepEvent<'_>| {
            if matches!(ev, StepEvent::Token(s) if s.token.is_some()) {
                generated.borrow_mut()[i] += 1;
            }
            true
        };
        e.admit(
            &mut batch,
            p.clone(),
            &opts(8 + 4 * i, 0.0, 0),
            None,
            client,
        )
        .unwrap();
    }
    // Each sequence counts its prompt and every token sampled, by the memory formula.
    let held = |live: &[usize], gen: &[usize]| -> usize {
        live.iter().map(|&i| bytes(ps[i].len() + gen[i])).sum()
    };
    assert_eq!(batch.cache().held_bytes(), held(&[0, 1, 2], &[0, 0, 0]));
    let mut steps = 0;
    while batch.len() == 3 {
        e.step(&mut batch);
        steps += 1;
        assert!(steps < 1000);
        if batch.len() == 3 {
            let gen = generated.borrow().clone();
            assert_eq!(batch.cache().held_bytes(), held(&[0, 1, 2], &gen));
        }
    }
    // Request 0 (8 tokens) finished first: its bytes are gone. Cancel request 2.
    assert_eq!(batch.ids().collect::<Vec<_>>(), [1, 2]);
    let gen = generated.borrow().clone();
    assert_eq!(gen[0], 8);
    assert_eq!(batch.cache().held_bytes(), held(&[1, 2], &gen));
    assert_eq!(batch.cache().sequences(), 2);
    batch.cancel_where(|id, _| id == 2);
    assert_eq!(batch.cache().held_bytes(), held(&[1], &gen));
    while !batch.is_empty() {
        e.step(&mut batch);
    }
    assert_eq!(batch.cache().sequences(), 0);
    assert_eq!(batch.cache().held_bytes(), 0);
    assert_eq!(batch.cache().planned_bytes(), 0);
    assert_eq!(generated.borrow()[1], 12);
}
