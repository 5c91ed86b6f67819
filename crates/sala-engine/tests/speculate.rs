//! Speculative decoding with prompt-lookup drafts through the engine: greedy output equal to
//! plain greedy decoding, drafts that really are verified and taken, and requests that
//! speculate beside others in one batch.

mod common;

use common::greedy;
use sala_cpu::CpuBackend;
use sala_engine::draft::Speculate;
use sala_engine::generate::{Engine, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_engine::step::StepEvent;
use std::cell::RefCell;
use std::rc::Rc;

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    // Few blocks selected past dense_len, so the sparse layers' caches and tiers matter when
    // a span is undone.
    common::tiny_engine(dir, 5, 64, |c| c.sparse.dense_len = 96)
}

fn opts(max_tokens: usize, speculate: Option<usize>, sampling: SamplingParams) -> GenerateOptions {
    GenerateOptions {
        speculate: speculate.map(Speculate::prompt_lookup),
        ..common::options(max_tokens, sampling)
    }
}

/// A prompt that repeats a passage: lookup drafts from it (and from the output, which a random
/// model tends to loop in).
fn prompt(len: usize, seed: u32) -> Vec<u32> {
    let passage: Vec<u32> = (0..40).map(|i| 5 + (i * 37 + seed * 11) % 400).collect();
    passage.iter().copied().cycle().take(len).collect()
}

/// One generated token and, when asked for, the step's two likeliest tokens.
type Token = (u32, Option<Vec<(u32, f32)>>);

/// The tokens of each request, run together in one batch (with the top two log-probabilities
/// of every step when `top2`).
fn run_batch(
    e: &mut Engine<CpuBackend>,
    jobs: &[(Vec<u32>, GenerateOptions)],
    top2: bool,
) -> Vec<Vec<Token>> {
    let out: Rc<RefCell<Vec<Vec<Token>>>> = Rc::new(RefCell::new(vec![Vec::new(); jobs.len()]));
    e.set_max_batch(jobs.len().max(1)).unwrap();
    let mut batch = e.batch();
    for (i, (p, o)) in jobs.iter().enumerate() {
        let out = out.clone();
        let logprobs = top2.then_some(2);
        e.admit(
            &mut batch,
            p.clone(),
            o,
            logprobs,
            move |ev: StepEvent<'_>| {
                if let StepEvent::Token(s) = ev {
                    if let Some(t) = s.token {
                        let top = t.logprobs.as_ref().map(|l| l.top.clone());
                        out.borrow_mut()[i].push((t.id, top));
                    }
                }
                true
            },
        )
        .unwrap();
    }
    // Every step moves some request on: a batch still busy after this many steps is stalled.
    let mut steps = 0;
    while !batch.is_empty() {
        e.step(&mut batch);
        steps += 1;
        assert!(steps < 10_000, "the batch stalled");
    }
    let v = out.borrow().clone();
    v
}

fn ids(tokens: &[Token]) -> Vec<u32> {
    tokens.iter().map(|t| t.0).collect()
}

#[test]
fn greedy_speculation_gives_the_greedy_tokens_and_takes_drafts() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let start = e.speculation_stats();
    // Prompts on both sides of dense_len. A span's rows are stepped token by token
    // (Backend::lightning), so the tokens are exactly the plain ones.
    for (len, seed) in [(60usize, 1u32), (150, 2), (230, 3)] {
        let p = prompt(len, seed);
        let plain = run_batch(&mut e, &[(p.clone(), opts(200, None, greedy()))], false);
        let spec = run_batch(&mut e, &[(p.clone(), opts(200, Some(6), greedy()))], false);
        assert_eq!(ids(&spec[0]), ids(&plain[0]), "prompt of {len}");
    }
    let end = e.speculation_stats();
    assert!(
        end.drafted > start.drafted && end.accepted > start.accepted,
        "no draft verified or taken ({start:?} -> {end:?})"
    );
}

#[test]
fn requests_that_speculate_beside_others_get_their_own_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let sampled = |seed| SamplingParams {
        temperature: 0.9,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let jobs = vec![
        (prompt(70, 4), opts(30, Some(4), greedy())),
        (prompt(140, 5), opts(30, None, greedy())),
        (prompt(200, 6), opts(30, Some(8), sampled(3))),
        (prompt(20, 7), opts(30, None, sampled(4))),
    ];
    let together = run_batch(&mut e, &jobs, false);
    for (i, job) in jobs.iter().enumerate() {
        let alone = run_batch(&mut e, std::slice::from_ref(job), false);
        assert_eq!(
            ids(&together[i]),
            ids(&alone[0]),
            "request {i}: batched tokens differ from alone"
        );
        assert_eq!(alone[0].len(), 30, "request {i}: not every token came");
    }
}

/// Drafts never outgrow a step: with a workspace of three rows (prompt chunks of 2, one
/// request) a request asking for drafts of 16 still gets every token.
#[test]
fn spans_fit_a_small_workspace() {
    let tmp = tempfile::tempdir().unwrap();
    engine(tmp.path());
    let mut e = Engine::load(CpuBackend::default(), tmp.path(), 2, &mut |_, _| {}).unwrap();
    let p = prompt(120, 8);
    let start = e.speculation_stats();
    let out = run_batch(&mut e, &[(p, opts(60, Some(16), greedy()))], false);
    assert_eq!(out[0].len(), 60);
    assert!(
        e.speculation_stats().drafted > start.drafted,
        "no draft was made"
    );
}

/// Drafts from the greedy continuation itself, `right` of each `of` true (up to 16 drafts, the
/// longest span): the engine takes exactly those (every full span `right`, all when `right` is
/// `of`) and gives the greedy tokens; with no true draft, no draft stands and the tokens are
/// the same.
#[test]
fn known_continuation_drafts_stand_as_far_as_they_are_right() {
    use sala_engine::draft::DraftSource;
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let p = prompt(90, 5);
    let plain = run_batch(&mut e, &[(p.clone(), opts(120, None, greedy()))], true);
    let sequence: Arc<[u32]> = p.iter().copied().chain(ids(&plain[0])).collect();
    for (right, of) in [(0usize, 4usize), (1, 4), (3, 4), (4, 4), (12, 16), (16, 16)] {
        let mut o = opts(120, None, greedy());
        o.speculate = Some(Speculate {
            max_draft: of,
            drafts: DraftSource::Known {
                sequence: sequence.clone(),
                right,
            },
        });
        let before = e.speculation_stats();
        let spec = run_batch(&mut e, &[(p.clone(), o)], false);
        // A span's rows are stepped token by token: exactly the plain tokens.
        assert_eq!(ids(&spec[0]), ids(&plain[0]), "{right} of {of}");
        let s = e.speculation_stats();
        let (drafted, accepted) = (s.drafted - before.drafted, s.accepted - before.accepted);
        assert!(drafted > 0, "{right} of {of}: no drafts");
        // On the known sequence all along: every span of `of` drafts took `right` of them
        // (the few spans cut short before dense_len or the end take what they hold).
        let (right, of) = (right as u64, of as u64);
        assert!(
            accepted <= drafted && of * accepted + 4 * of * right >= right * drafted,
            "{right} of {of}: {accepted} of {drafted} taken"
        );
        if right == 0 {
            assert_eq!(accepted, 0);
        }
        if right == of {
            assert_eq!(accepted, drafted);
        }
    }
}

/// An EAGLE-3 draft model (random weights) drafting for the engine: greedy output exactly the
/// plain tokens, sampled output that of plain sampling with the same seed... is not promised
/// (the draws differ), so sampled requests only finish. Its drafts really are verified, and
/// stand where they are right: a draft whose vocabulary is the plain run's commonest token
/// drafts it every step, and the target takes it where it comes next. Without a draft model
/// loaded, a request that asks for one is refused by name.
#[test]
fn a_draft_model_drafts_and_the_greedy_tokens_stay_the_plain_ones() {
    use sala_checkpoint::{write_random_draft, DraftCheckpoint, DraftConfig};
    use sala_engine::draft::DraftSource;
    use sala_model::draft::DraftModel;
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let draft_opts = |n: usize, sampling| {
        let mut o = opts(n, None, sampling);
        o.speculate = Some(Speculate {
            max_draft: 4,
            drafts: DraftSource::Model,
        });
        o
    };
    let p = prompt(130, 9);
    let refused = e.generate(&p, &draft_opts(4, greedy()), &mut |_| {}, &mut |_| {});
    assert!(
        refused
            .unwrap_err()
            .to_string()
            .contains("draft model, but none is loaded"),
        "a request asked for a draft model none is loaded for"
    );
    let plain = run_batch(&mut e, &[(p.clone(), opts(80, None, greedy()))], false);
    let plain = ids(&plain[0]);
    let mut counts = std::collections::HashMap::new();
    for &t in &plain {
        *counts.entry(t).or_insert(0usize) += 1;
    }
    let (&common, _) = counts.iter().max_by_key(|(&t, &n)| (n, t)).unwrap();
    let config = e.model.config.clone();
    let shape = |draft_vocab_size| DraftConfig {
        intermediate_size: 64,
        num_key_value_heads: 1,
        draft_vocab_size,
        ..DraftConfig::small(&config)
    };
    // A random draft over half the vocabulary (the target's embeddings), then the one-token
    // draft (its own).
    for (i, (vocab, targets, own_embed)) in [
        (config.vocab_size / 2, None, false),
        (1, Some(vec![common]), true),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp.path().join(format!("draft{i}"));
        write_random_draft(&dir, &shape(vocab), own_embed, targets.as_deref(), 4).unwrap();
        let ckpt = DraftCheckpoint::open(&dir, &config).unwrap();
        let draft = DraftModel::load(&e.backend, &e.model, &ckpt).unwrap();
        e.set_draft(draft).unwrap();
        let before = e.speculation_stats();
        if let Err(err) = e.generate(&p, &draft_opts(80, greedy()), &mut |_| {}, &mut |_| {}) {
            panic!("draft {i}: {err}");
        }
        let spec = run_batch(&mut e, &[(p.clone(), draft_opts(80, greedy()))], false);
        assert_eq!(
            ids(&spec[0]),
            plain,
            "draft {i}: greedy tokens differ from plain"
        );
        let s = e.speculation_stats();
        assert!(s.drafted > before.drafted, "draft {i}: no drafts verified");
        if targets.is_some() {
            assert!(
                s.accepted > before.accepted,
                "draft {i}: token {common} comes {} times, yet no draft of it stood",
                counts[&common]
            );
        }
        // Beside a prompt-lookup request and a sampled one, in one batch.
        let sampled = SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..SamplingParams::default()
        };
        let jobs = vec![
            (p.clone(), draft_opts(40, greedy())),
            (prompt(60, 3), opts(40, Some(4), greedy())),
            (prompt(100, 2), draft_opts(40, sampled)),
        ];
        let together = run_batch(&mut e, &jobs, false);
        assert_eq!(
            ids(&together[0]),
            plain[..40].to_vec(),
            "draft {i}: batched"
        );
        assert!(
            together.iter().all(|t| t.len() == 40),
            "draft {i}: a request fell short"
        );
    }
}
