//! Prompt log-probabilities (what `echo` and `prompt_logprobs` report) on a tiny random
//! checkpoint: the same as feeding the prompt one token at a time, the same alone and in a
//! batch, copied to the choices of one prompt, consistent with a generated token's logprobs;
//! and the perplexity made from them.

mod common;

use sala_cpu::CpuBackend;
use sala_engine::generate::{Engine, EngineError, GenerateOptions};
use sala_engine::perplexity::windows;
use sala_engine::request::PromptLogprobs;
use sala_engine::step::StepEvent;
use sala_model::numerics::TestRng;
use sala_model::LogitRows;
use std::cell::RefCell;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    engine_with(dir, usize::MAX)
}

/// The tiny model; its sparse layers attend densely below `dense_len` tokens (`usize::MAX`:
/// the preset's).
fn engine_with(dir: &std::path::Path, dense_len: usize) -> Engine<CpuBackend> {
    let mut e = common::tiny_engine(dir, 11, 64, |c| {
        if dense_len != usize::MAX {
            c.sparse.dense_len = dense_len;
        }
    });
    e.set_max_batch(8).unwrap();
    e
}

fn prompt(len: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut rng = TestRng::new(seed);
    (0..len).map(|_| 3 + rng.below(vocab - 3) as u32).collect()
}

fn opts(max_tokens: usize, prompt_logprobs: Option<usize>) -> GenerateOptions {
    GenerateOptions {
        prompt_logprobs,
        ..common::options(max_tokens, common::seeded(0.8, 4))
    }
}

/// log_softmax in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// The prompt's tokens fed to the model one at a time (each a decode step of a fresh
/// sequence): for each position after the first, the log_softmax of the step before it.
fn teacher_forced(e: &Engine<CpuBackend>, prompt: &[u32]) -> Vec<Vec<f64>> {
    let (m, be) = (&e.model, &e.backend);
    let mut ws = m.workspace(be, 64).unwrap();
    let mut seq = m.new_sequence(be).unwrap();
    prompt[..prompt.len() - 1]
        .iter()
        .map(|&t| log_softmax(&m.decode(be, &mut ws, &mut seq, t).unwrap()))
        .collect()
}

/// The model's logits of every prompt row, read in the engine's chunks with the prompt's
/// sparse mode, as log_softmax rows (the last row's left out).
fn every_row(e: &Engine<CpuBackend>, prompt: &[u32]) -> Vec<Vec<f64>> {
    let (m, be) = (&e.model, &e.backend);
    let mut ws = m.workspace(be, 64).unwrap();
    let mut seq = m.new_sequence(be).unwrap();
    let mode = m.sparse_mode(prompt.len());
    let v = m.config.vocab_size;
    let mut rows = Vec::new();
    for chunk in prompt.chunks(64) {
        let logits = m
            .forward_one(be, &mut ws, &mut seq, chunk, mode, LogitRows::All)
            .unwrap();
        rows.extend(logits.chunks(v).map(log_softmax));
    }
    rows.pop();
    rows
}

/// Compares `got` with log_softmax rows `want` (row i predicts position i + 1): returns each
/// position's logprob error, having checked the token, and where the error is below `tol`
/// its rank and alternatives too.
fn compare(what: &str, p: &[u32], got: &PromptLogprobs, want: &[Vec<f64>], tol: f64) -> Vec<f64> {
    assert_eq!(got.tokens.len(), p.len() - 1, "{what}");
    assert_eq!(want.len(), p.len() - 1, "{what}");
    let mut errs = Vec::new();
    for (i, (t, lp)) in got.tokens.iter().zip(want).enumerate() {
        let at = format!("{what}, position {}", i + 1);
        let next = p[i + 1];
        assert_eq!(t.id, next, "{at}");
        let err = (t.logprob as f64 - lp[next as usize]).abs();
        errs.push(err);
        if err >= tol {
            continue;
        }
        // Rank: 1 + the tokens more likely (a near-tie may fall either way).
        let more = |d: f64| lp.iter().filter(|&&l| l > lp[next as usize] + d).count();
        let rank = t.rank as usize;
        assert!(
            rank > more(tol) && rank <= 1 + more(-tol),
            "{at}: rank {rank}"
        );
        // The alternatives: most likely first, with the row's values.
        assert_eq!(t.top.len(), got.top, "{at}");
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1), "{at}");
        for &(id, l) in &t.top {
            assert!((l as f64 - lp[id as usize]).abs() < tol, "{at}");
        }
        let best = lp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert!((t.top[0].1 as f64 - best).abs() < tol, "{at}");
    }
    errs
}

/// Tight: well within f32 rounding of a log-softmax.
const TIGHT: f64 = 1e-5;
/// One bf16 step of a logit of magnitude up to 16 (the model rounds its logits to bf16).
const BF16_STEP: f64 = 0.0625;

#[test]
fn prompt_logprobs_equal_feeding_the_prompt_one_token_at_a_time() {
    // Sparse layers attending densely (prompts below dense_len): feeding the tokens one at a
    // time computes what reading them in chunks does, in another order. The model rounds to
    // bf16 between ops (and in its caches), so once a sum lands on the other side of a bf16
    // rounding the positions after it move by a fraction of a bf16 step; before that, and
    // within the first chunk, they agree to f32 rounding.
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine_with(tmp.path(), 1000);
    let vocab = e.model.config.vocab_size;
    // One chunk, a chunk and a row, several chunks.
    for (len, seed) in [(2, 1), (9, 2), (65, 3), (230, 4)] {
        let p = prompt(len, seed, vocab);
        let mut read = 0;
        let got = e.prompt_logprobs(&p, 5, &mut |n| read += n).unwrap();
        assert_eq!((read, got.top), (len, 5));
        // The prefill's own rows: exactly.
        let rows = compare(
            &format!("len {len}, rows"),
            &p,
            &got,
            &every_row(&e, &p),
            TIGHT,
        );
        assert!(rows.iter().all(|&x| x < TIGHT), "len {len}: {rows:?}");
        let mut errs = compare(
            &format!("len {len}"),
            &p,
            &got,
            &teacher_forced(&e, &p),
            TIGHT,
        );
        let first_chunk = errs.len().min(64);
        assert!(
            errs[..first_chunk].iter().all(|&x| x < TIGHT),
            "len {len}: {errs:?}"
        );
        errs.sort_by(f64::total_cmp);
        assert!(errs[errs.len() / 2] < 1e-2, "len {len}: {errs:?}");
        assert!(errs[errs.len() - 1] < BF16_STEP, "len {len}: {errs:?}");
    }
}

#[test]
fn past_dense_len_prompt_logprobs_are_the_prefills_rows() {
    // Past dense_len a prompt is read with sparse attention: its logprobs are those of its
    // prefill's rows. A decode step's sparse attention ranks its blocks on scores rounded
    // otherwise, so feeding the tokens one at a time agrees only as closely as the model's
    // own prefill-then-decode does (crates/sala-cpu/tests/model_parity.rs).
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let dense_len = e.model.config.sparse.dense_len;
    let p = prompt(dense_len + 54, 4, vocab);
    let got = e.prompt_logprobs(&p, 5, &mut |_| {}).unwrap();
    let rows = compare("rows", &p, &got, &every_row(&e, &p), TIGHT);
    assert!(rows.iter().all(|&x| x < TIGHT), "{rows:?}");
    let mut errs = compare("one at a time", &p, &got, &teacher_forced(&e, &p), TIGHT);
    let dense = &errs[..dense_len - 1];
    assert!(dense.iter().filter(|&&x| x < TIGHT).count() * 10 >= dense.len() * 9);
    errs.sort_by(f64::total_cmp);
    assert!(
        errs[errs.len() / 2] < 1e-2 && errs[errs.len() - 1] < 2.0 * BF16_STEP,
        "{errs:?}"
    );
}

/// A request's results and its prompt logprobs, as its client hears them.
#[derive(Debug, Default, Clone, PartialEq)]
struct Heard {
    prompt: Option<PromptLogprobs>,
    tokens: Vec<u32>,
    done: bool,
}

/// Runs `reqs` (prompt, options) in one batch, each admitted at step `join`; with `copy_of`
/// a request copies that earlier request's prompt ([`Engine::admit_copy`]).
fn run(
    e: &mut Engine<CpuBackend>,
    reqs: &[(Vec<u32>, GenerateOptions, usize, Option<usize>)],
) -> Vec<Heard> {
    let heard: RefCell<Vec<Heard>> = RefCell::new(vec![Heard::default(); reqs.len()]);
    let mut batch = e.batch();
    let mut ids = Vec::new();
    let mut step = 0;
    loop {
        for (i, (p, o, join, copy_of)) in reqs.iter().enumerate() {
            if *join != step {
                continue;
            }
            let heard = &heard;
            let client = move |ev: StepEvent<'_>| {
                let h = &mut heard.borrow_mut()[i];
                match ev {
                    StepEvent::Prefilled { logprobs, .. } => {
                        assert!(h.prompt.is_none(), "reported once");
                        h.prompt = logprobs.cloned();
                    }
                    StepEvent::Token(s) => h.tokens.extend(s.token.map(|t| t.id)),
                    StepEvent::Done(r) => {
                        r.unwrap();
                        h.done = true;
                    }
                    StepEvent::Read { .. } => {}
                }
                true
            };
            let id = match copy_of {
                Some(of) => e.admit_copy(&mut batch, ids[*of], p.clone(), o, None, client),
                None => e.admit(&mut batch, p.clone(), o, None, client),
            };
            ids.push(id.unwrap());
        }
        if batch.is_empty() && step > reqs.iter().map(|r| r.2).max().unwrap() {
            break;
        }
        e.step(&mut batch);
        step += 1;
        assert!(step < 1000);
    }
    drop(batch);
    let heard = heard.into_inner();
    assert!(heard.iter().all(|h| h.done));
    heard
}

#[test]
fn prompt_logprobs_are_the_same_alone_and_batched_and_change_no_other_request() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    // Prompt logprobs beside plain requests that generate (decode rows in the same steps),
    // joining at different steps; some with nothing to generate.
    let reqs = vec![
        (prompt(150, 1, vocab), opts(6, Some(3)), 0, None),
        (prompt(30, 2, vocab), opts(12, None), 0, None),
        (prompt(70, 3, vocab), opts(0, Some(0)), 1, None),
        (prompt(5, 4, vocab), opts(4, Some(20)), 2, None),
        (prompt(100, 5, vocab), opts(9, None), 3, None),
    ];
    let alone: Vec<Heard> = reqs
        .iter()
        .map(|r| run(&mut e, &[(r.0.clone(), r.1.clone(), 0, None)]).remove(0))
        .collect();
    let batched = run(&mut e, &reqs);
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a, b, "request {i}");
        let want = reqs[i].1.prompt_logprobs;
        assert_eq!(a.prompt.as_ref().map(|p| p.top), want, "request {i}");
        if let Some(p) = &a.prompt {
            assert_eq!(p.tokens.len(), reqs[i].0.len() - 1);
            assert!(p.tokens.iter().all(|t| t.top.len() <= p.top));
        }
        assert_eq!(a.tokens.len(), reqs[i].1.max_tokens, "request {i}");
    }
    // The same as the engine's own helper.
    let direct = e.prompt_logprobs(&reqs[0].0, 3, &mut |_| {}).unwrap();
    assert_eq!(alone[0].prompt.as_ref(), Some(&direct));
}

#[test]
fn the_choices_of_one_prompt_get_its_logprobs_read_once() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let p = prompt(140, 7, vocab);
    let lp = Some(2);
    let alone = run(&mut e, &[(p.clone(), opts(3, lp), 0, None)]).remove(0);
    // Copies of a request that reads logprobs; and of one that does not (the copy reads the
    // prompt itself).
    let got = run(
        &mut e,
        &[
            (p.clone(), opts(3, lp), 0, None),
            (p.clone(), opts(3, lp), 0, Some(0)),
            (p.clone(), opts(3, None), 0, None),
            (p.clone(), opts(3, lp), 0, Some(2)),
            (p.clone(), opts(3, None), 0, Some(0)),
        ],
    );
    for (i, h) in got.iter().enumerate() {
        match i {
            2 | 4 => assert_eq!(h.prompt, None, "choice {i}"),
            _ => assert_eq!(h.prompt, alone.prompt, "choice {i}"),
        }
        // Same seed and prompt: the same tokens.
        assert_eq!(h.tokens, alone.tokens, "choice {i}");
    }
}

#[test]
fn a_generated_tokens_logprob_is_its_prompt_logprob_once_appended() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    for (len, seed) in [(10, 1), (64, 2), (120, 3)] {
        let p = prompt(len, seed, vocab);
        let mut generated = Vec::new();
        e.generate_steps(
            &p,
            &opts(1, None),
            Some(4),
            &mut |s| {
                generated.extend(s.token.map(|t| t.logprobs.clone().unwrap()));
                true
            },
            &mut |_| {},
        )
        .unwrap();
        let g = &generated[0];
        let mut longer = p.clone();
        longer.push(g.id);
        let lp = e.prompt_logprobs(&longer, 4, &mut |_| {}).unwrap();
        let last = lp.tokens.last().unwrap();
        assert_eq!(last.id, g.id);
        assert!((last.logprob - g.logprob).abs() < 2e-4, "{last:?} vs {g:?}");
        let ids = |t: &[(u32, f32)]| t.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(ids(&last.top), ids(&g.top), "len {len}");
    }
}

#[test]
fn perplexity_is_the_exponent_of_the_mean_nll_of_each_windows_new_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let vocab = e.model.config.vocab_size;
    let text = prompt(230, 9, vocab);
    // One window over the whole text: every token after the first.
    let lp = e.prompt_logprobs(&text, 0, &mut |_| {}).unwrap();
    let nll: Vec<f64> = lp.tokens.iter().map(|t| -(t.logprob as f64)).collect();
    let mut read = 0;
    let one = e.perplexity(&text, 300, 150, &mut |n| read += n).unwrap();
    assert_eq!(
        (one.windows, one.tokens_scored, one.tokens_read),
        (1, 229, 230)
    );
    assert_eq!(read, 230);
    let mean = nll.iter().sum::<f64>() / nll.len() as f64;
    assert!((one.mean_nll() - mean).abs() < 1e-9);
    assert!((one.perplexity() - mean.exp()).abs() < 1e-9 * mean.exp());
    assert!(one.perplexity() > 1.0);
    // Sliding windows: each window's own logprobs for its new tokens.
    let (context, stride) = (100, 40);
    let got = e.perplexity(&text, context, stride, &mut |_| {}).unwrap();
    let mut sum = 0.0;
    let ws = windows(text.len(), context, stride).unwrap();
    for w in &ws {
        let lp = e
            .prompt_logprobs(&text[w.start..w.end], 0, &mut |_| {})
            .unwrap();
        for t in &lp.tokens[w.scored - w.start - 1..] {
            sum -= t.logprob as f64;
        }
    }
    assert_eq!(got.windows, ws.len());
    assert_eq!(got.tokens_scored, 229);
    assert_eq!(
        got.tokens_read,
        ws.iter().map(|w| w.end - w.start).sum::<usize>()
    );
    assert!((got.nll_sum - sum).abs() < 1e-9, "{} vs {sum}", got.nll_sum);
    // Windows side by side: each one's first token has nothing before it, and is not scored.
    let flat = e.perplexity(&text, 100, 100, &mut |_| {}).unwrap();
    assert_eq!(
        (flat.windows, flat.tokens_scored, flat.tokens_read),
        (3, 227, 230)
    );
    // Shorter windows see less context: a different figure.
    assert!((got.perplexity() - one.perplexity()).abs() > 1e-6);
}

#[test]
fn bad_prompts_and_windows_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let max = e.model.config.max_position_embeddings;
    assert!(matches!(
        e.prompt_logprobs(&[], 1, &mut |_| {}),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        e.prompt_logprobs(&vec![5; max], 1, &mut |_| {}),
        Err(EngineError::PromptTooLong { .. })
    ));
    let vocab = e.model.config.vocab_size as u32;
    assert!(e.prompt_logprobs(&[5, vocab], 1, &mut |_| {}).is_err());
    for (len, context, stride, what) in [
        (1, 64, 32, "at least 2"),
        (50, 1, 1, "context"),
        (50, 64, 0, "stride"),
        (50, 64, 65, "stride"),
    ] {
        let e = e
            .perplexity(&vec![5; len], context, stride, &mut |_| {})
            .unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
    }
}
