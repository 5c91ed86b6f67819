//! A panic inside one request's work (its sampling, its grammar, its events) fails that request
//! only; one inside the forward pass fails the requests of that step, and the engine goes on.
//! Panics are injected by test-only hooks: [`PANIC_SEED`] and [`panic_in_next_forward`].

use crate::generate::{Engine, EngineError, FinishReason, GenerateOptions};
use crate::sampling::SamplingParams;
use crate::step::StepEvent;
use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use std::cell::{Cell, RefCell};

/// A request with this sampling seed panics in its sampling (test builds only).
pub(crate) const PANIC_SEED: u64 = 0xdead_beef_0bad_5eed;

thread_local! {
    static PANIC_IN_FORWARD: Cell<bool> = const { Cell::new(false) };
}

/// Called inside the forward pass's isolation: panics once when a test asked for it.
pub(crate) fn forward_hook() {
    if PANIC_IN_FORWARD.with(|p| p.replace(false)) {
        panic!("injected panic in the forward pass");
    }
}

fn panic_in_next_forward() {
    PANIC_IN_FORWARD.with(|p| p.set(true));
}

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    let config = preset("tiny").unwrap();
    write_random_checkpoint(
        dir,
        &config,
        &WriteOptions {
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    sala_tokenizer::write_test_tokenizer(dir, config.vocab_size).unwrap();
    let mut e = Engine::load(CpuBackend::default(), dir, 64, &mut |_, _| {}).unwrap();
    e.set_max_batch(8).unwrap();
    e
}

fn opts(seed: u64) -> GenerateOptions {
    GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.8,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        max_tokens: 10,
        max_context: 4096,
        stop: Vec::new(),
        eos_ids: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        speculate: None,
    }
}

type Outcome = Result<(Vec<u32>, FinishReason), EngineError>;

/// Runs requests `(prompt, options, panics_at_token)` together until the batch drains: a
/// client with `Some(k)` panics when it hears its k-th token. `before_step(step)` runs before
/// each step. Returns each request's tokens and finish, or its error.
fn run(
    e: &mut Engine<CpuBackend>,
    reqs: &[(Vec<u32>, GenerateOptions, Option<usize>)],
    mut before_step: impl FnMut(usize),
) -> Vec<Outcome> {
    let out: RefCell<Vec<(Vec<u32>, Option<Outcome>)>> =
        RefCell::new(reqs.iter().map(|_| (Vec::new(), None)).collect());
    let mut batch = e.batch();
    for (i, (p, o, panic_at)) in reqs.iter().enumerate() {
        let (out, panic_at) = (&out, *panic_at);
        let client = move |ev: StepEvent<'_>| {
            let mut out = out.borrow_mut();
            let out = &mut out[i];
            match ev {
                StepEvent::Token(s) => {
                    if let Some(t) = s.token {
                        out.0.push(t.id);
                        if Some(out.0.len()) == panic_at {
                            panic!("injected panic in a client");
                        }
                    }
                }
                StepEvent::Done(r) => {
                    out.1 = Some(r.map(|f| (f.tokens.iter().map(|t| t.id).collect(), f.finish)))
                }
                _ => {}
            }
            true
        };
        e.admit(&mut batch, p.clone(), o, None, client).unwrap();
    }
    let mut step = 0;
    while !batch.is_empty() {
        before_step(step);
        e.step(&mut batch);
        step += 1;
        assert!(step < 1000, "the batch does not drain");
    }
    drop(batch);
    out.into_inner()
        .into_iter()
        .map(|(_, r)| r.expect("every request ends with Done"))
        .collect()
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 7 + salt) % 200).collect()
}

fn assert_panicked(r: &Outcome, what: &str) {
    match r {
        Err(EngineError::Panicked(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("expected a panic naming {what:?}, got {other:?}"),
    }
}

#[test]
fn a_panic_in_one_requests_sampling_or_events_fails_that_request_only() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let reqs = vec![
        (prompt(5, 1), opts(1), None),
        (prompt(70, 2), opts(PANIC_SEED), None),
        (prompt(9, 3), opts(3), Some(4)),
        (prompt(30, 4), opts(4), None),
    ];
    let alone: Vec<Outcome> = [0, 3]
        .iter()
        .map(|&i| run(&mut e, &reqs[i..i + 1], |_| {}).remove(0))
        .collect();
    let got = run(&mut e, &reqs, |_| {});
    assert_eq!(got[0].as_ref().unwrap(), alone[0].as_ref().unwrap());
    assert_eq!(got[3].as_ref().unwrap(), alone[1].as_ref().unwrap());
    assert_eq!(got[0].as_ref().unwrap().0.len(), 10);
    assert_panicked(&got[1], "sampling");
    assert_panicked(&got[2], "output");
    // The engine goes on: the same requests again give the same results.
    let again = run(&mut e, &reqs[..1], |_| {});
    assert_eq!(again[0].as_ref().unwrap(), alone[0].as_ref().unwrap());
}

#[test]
fn a_panic_in_the_forward_pass_fails_that_step_and_the_engine_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let reqs = vec![
        (prompt(12, 1), opts(1), None),
        (prompt(40, 2), opts(2), None),
    ];
    let ok = |rs: Vec<Outcome>| rs.into_iter().map(Result::unwrap).collect::<Vec<_>>();
    let want = ok(run(&mut e, &reqs, |_| {}));
    let got = run(&mut e, &reqs, |step| {
        if step == 3 {
            panic_in_next_forward();
        }
    });
    for r in &got {
        assert_panicked(r, "forward pass");
    }
    assert_eq!(ok(run(&mut e, &reqs, |_| {})), want);
}

#[test]
fn copies_of_a_prompt_read_it_once_and_sample_as_if_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let p = prompt(150, 9);
    let seeds = [11, 12, 13];
    let alone: Vec<Outcome> = seeds
        .iter()
        .map(|&s| run(&mut e, &[(p.clone(), opts(s), None)], |_| {}).remove(0))
        .collect();
    let out: RefCell<Vec<Option<Outcome>>> = RefCell::new(vec![None, None, None]);
    let mut batch = e.batch();
    let mut first = None;
    for (i, &seed) in seeds.iter().enumerate() {
        let out = &out;
        let client = move |ev: StepEvent<'_>| {
            if let StepEvent::Done(r) = ev {
                out.borrow_mut()[i] =
                    Some(r.map(|f| (f.tokens.iter().map(|t| t.id).collect(), f.finish)));
            }
            true
        };
        let id = match first {
            None => e.admit(&mut batch, p.clone(), &opts(seed), None, client),
            Some(of) => e.admit_copy(&mut batch, of, p.clone(), &opts(seed), None, client),
        };
        first = first.or(Some(id.unwrap()));
    }
    e.step(&mut batch);
    // The first read a chunk; the copies wait.
    let reads: Vec<usize> = batch.members.iter().map(|m| m.read).collect();
    assert_eq!(reads, [64, 0, 0]);
    while !batch.is_empty() {
        e.step(&mut batch);
    }
    drop(batch);
    let got: Vec<Outcome> = out.into_inner().into_iter().map(Option::unwrap).collect();
    for (g, a) in got.iter().zip(&alone) {
        assert_eq!(g.as_ref().unwrap(), a.as_ref().unwrap());
    }
    assert_ne!(got[0].as_ref().unwrap(), got[1].as_ref().unwrap());
}

/// Greedy options: `max_tokens`, and `eos` as the end of sequence.
fn greedy(max_tokens: usize, eos: Option<u32>) -> GenerateOptions {
    GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        max_tokens,
        eos_ids: eos.into_iter().collect(),
        ..opts(0)
    }
}

#[test]
fn steps_run_ahead_give_every_request_the_tokens_of_steps_one_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let mut ahead = engine(tmp.path());
    let mut plain = Engine::load(
        CpuBackend::without_run_ahead(),
        tmp.path(),
        64,
        &mut |_, _| {},
    )
    .unwrap();
    plain.set_max_batch(8).unwrap();
    // An end of sequence the first request reaches at its fourth token, the others perhaps.
    let first = run(
        &mut plain,
        &[(prompt(20, 1), greedy(12, None), None)],
        |_| {},
    );
    let eos = first[0].as_ref().unwrap().0[3];
    let reqs = vec![
        (prompt(20, 1), greedy(12, Some(eos)), None),
        (prompt(33, 2), greedy(9, Some(eos)), None),
        (prompt(7, 3), greedy(1, None), None),
        (prompt(15, 4), greedy(2, None), None),
        (prompt(26, 5), greedy(14, None), None),
    ];
    let want = run(&mut plain, &reqs, |_| {});
    assert_eq!(plain.backend.steps_run_ahead(), 0);
    let got = run(&mut ahead, &reqs, |_| {});
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.as_ref().unwrap(), w.as_ref().unwrap());
    }
    assert_eq!(got[0].as_ref().unwrap().1, FinishReason::Stop);
    assert_eq!(got[0].as_ref().unwrap().0.len(), 4);
    let ran = ahead.backend.steps_run_ahead();
    assert!(ran > 5, "{ran} steps ran ahead");
    // A request that samples holds the batch to steps one at a time while it is in; the
    // greedy ones get their tokens either way.
    let mut mixed = reqs.clone();
    mixed.push((prompt(11, 6), opts(6), None));
    let want = run(&mut plain, &mixed, |_| {});
    let got = run(&mut ahead, &mixed, |_| {});
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.as_ref().unwrap(), w.as_ref().unwrap());
    }
    // A panic in a step run ahead fails its requests; the engine goes on.
    let got = run(&mut ahead, &reqs[4..], |step| {
        if step == 6 {
            panic_in_next_forward();
        }
    });
    assert_panicked(&got[0], "forward pass");
    let again = run(&mut ahead, &reqs, |_| {});
    for (g, w) in again.iter().zip(run(&mut plain, &reqs, |_| {}).iter()) {
        assert_eq!(g.as_ref().unwrap(), w.as_ref().unwrap());
    }
}
