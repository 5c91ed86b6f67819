//! Checks every backend's tests run on a whole model: properties of [`Model::forward`] that
//! must hold bit for bit whatever the backend.

use crate::model::{GreedyPick, LogitRows, Model, SeqState, StepInput, StepLogits, Workspace};
use crate::numerics::TestRng;
use crate::{BResult, Backend};

/// One decode step of `seqs`, `tokens[i]` fed to `seqs[i]`, in one forward pass: each
/// sequence's next-token logits.
pub fn decode_step<B: Backend>(
    be: &B,
    model: &Model<B>,
    ws: &mut Workspace<B>,
    seqs: &mut [&mut SeqState<B>],
    tokens: &[u32],
) -> BResult<Vec<Vec<f32>>> {
    let mut inputs: Vec<StepInput<'_, B>> = seqs
        .iter_mut()
        .zip(tokens)
        .map(|(seq, t)| StepInput {
            mode: model.sparse_mode(seq.pos + 1),
            seq,
            tokens: std::slice::from_ref(t),
            logits: LogitRows::Last,
        })
        .collect();
    Ok(model
        .forward(be, ws, &mut inputs)?
        .into_iter()
        .map(StepLogits::into_rows)
        .collect())
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = TestRng::new(seed);
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// A step mixing decode rows with prompt chunks gives every sequence the logits it gets run
/// apart, bit for bit: two sequences decoding (prompts of 40 and 200 tokens, so past a
/// `dense_len` of 150 the second uses sparse attention) while a third reads its 45-token
/// prompt in two chunks (30, 15) beside them, then all three decoding together; once with the
/// prompt's last logits, once with every prompt row's (prompt log-probabilities). Each step
/// holds at most 32 rows, so on every backend products of one row do not depend on the others.
pub fn check_mixed_step<B: Backend>(be: &B, model: &Model<B>) -> Result<(), String> {
    check_mixed_step_rows(be, model, false)?;
    check_mixed_step_rows(be, model, true)
}

/// [`check_mixed_step`]; with `all_rows`, the new prompt's chunks ask for every row's logits.
fn check_mixed_step_rows<B: Backend>(
    be: &B,
    model: &Model<B>,
    all_rows: bool,
) -> Result<(), String> {
    let name = format!(
        "{}{}",
        be.name(),
        if all_rows { ", every prompt row" } else { "" }
    );
    let prompt_rows = |last: bool| match (all_rows, last) {
        (true, _) => LogitRows::All,
        (false, true) => LogitRows::Last,
        (false, false) => LogitRows::None,
    };
    let v = model.config.vocab_size;
    let (old_lens, new_len, cut) = ([40usize, 200], 45usize, 30usize);
    let olds: Vec<Vec<u32>> = old_lens
        .iter()
        .enumerate()
        .map(|(i, &n)| tokens(n, v, 300 + i as u64))
        .collect();
    let fresh = tokens(new_len, v, 310);
    let steps = 4;
    let feeds: Vec<Vec<u32>> = (0..3).map(|i| tokens(steps, v, 320 + i as u64)).collect();
    let err = |e: crate::BackendError| format!("{name}: {e}");
    let mut ws = model.workspace(be, 64).map_err(err)?;
    let prefilled = |ws: &mut _, p: &[u32]| {
        let mut seq = model.new_sequence(be)?;
        model.prefill(be, ws, &mut seq, p, &mut |_| {})?;
        Ok(seq)
    };
    // Apart: the decoding sequences one by one; the new prompt in the same two chunks.
    let mut apart: Vec<Vec<Vec<f32>>> = Vec::new();
    for (p, f) in olds.iter().zip(&feeds) {
        let mut seq = prefilled(&mut ws, p).map_err(err)?;
        let rows = f
            .iter()
            .map(|&t| model.decode(be, &mut ws, &mut seq, t))
            .collect::<Result<_, _>>()
            .map_err(err)?;
        apart.push(rows);
    }
    let mode = model.sparse_mode(new_len);
    let mut seq = model.new_sequence(be).map_err(err)?;
    let (a, b) = fresh.split_at(cut);
    let first = model
        .forward_one(be, &mut ws, &mut seq, a, mode, prompt_rows(false))
        .map_err(err)?;
    let mut fresh_apart: Vec<Vec<f32>> = all_rows.then_some(first).into_iter().collect();
    fresh_apart.push(
        model
            .forward_one(be, &mut ws, &mut seq, b, mode, prompt_rows(true))
            .map_err(err)?,
    );
    for &t in &feeds[2][..steps - 2] {
        fresh_apart.push(model.decode(be, &mut ws, &mut seq, t).map_err(err)?);
    }
    // Mixed: steps 0 and 1 hold both decode rows and a chunk of the prompt.
    let mut seqs = olds
        .iter()
        .map(|p| prefilled(&mut ws, p))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    let mut fresh_seq = model.new_sequence(be).map_err(err)?;
    let mut fresh_mixed = Vec::new();
    for step in 0..steps {
        let fed = [feeds[0][step], feeds[1][step]];
        let mut inputs: Vec<StepInput<'_, B>> = seqs
            .iter_mut()
            .zip(fed.chunks(1))
            .map(|(seq, t)| StepInput {
                mode: model.sparse_mode(seq.pos + 1),
                seq,
                tokens: t,
                logits: LogitRows::Last,
            })
            .collect();
        let fresh_feed = [feeds[2][step.saturating_sub(2)]];
        inputs.push(match [a, b].get(step) {
            Some(chunk) => StepInput {
                mode,
                seq: &mut fresh_seq,
                tokens: chunk,
                logits: prompt_rows(step == 1),
            },
            None => StepInput {
                mode: model.sparse_mode(fresh_seq.pos + 1),
                seq: &mut fresh_seq,
                tokens: &fresh_feed,
                logits: LogitRows::Last,
            },
        });
        let logits: Vec<Vec<f32>> = model
            .forward(be, &mut ws, &mut inputs)
            .map_err(err)?
            .into_iter()
            .map(StepLogits::into_rows)
            .collect();
        for (i, row) in logits.iter().take(2).enumerate() {
            if *row != apart[i][step] {
                return Err(format!(
                    "{name}: sequence {i} step {step}: logits in a mixed step differ from \
                     running apart"
                ));
            }
        }
        let rows = logits[2].len() / v;
        let want_rows = match (all_rows, step) {
            (true, 0) => cut,
            (true, 1) => new_len - cut,
            (false, 0) => 0,
            _ => 1,
        };
        if rows != want_rows || !logits[2].len().is_multiple_of(v) {
            return Err(format!(
                "{name}: step {step}: {rows} rows of logits for the prompt, not {want_rows}"
            ));
        }
        if step > 0 || all_rows {
            fresh_mixed.push(logits[2].clone());
        }
    }
    for (i, (m, a)) in fresh_mixed.iter().zip(&fresh_apart).enumerate() {
        if m != a {
            return Err(format!(
                "{name}: the prompt read beside decode rows: row {i} differs from running apart"
            ));
        }
    }
    if fresh_mixed.len() != fresh_apart.len() {
        return Err(format!("{name}: the prompt's logits were not all made"));
    }
    if fresh_seq.pos != new_len + steps - 2
        || seqs.iter().zip(old_lens).any(|(s, n)| s.pos != n + steps)
    {
        return Err(format!(
            "{name}: positions did not advance by the tokens fed"
        ));
    }
    Ok(())
}

/// A step that reads only some rows of its last layer (a prompt chunk asking for its last
/// row's logits, or for none) gives those rows the logits a step reading every row gives them
/// and leaves the sequence as that step does, bit for bit: a `len`-token prompt read in chunks
/// of `chunk` rows, once asking for every row's logits and once for the last chunk's last row
/// only, each chunk of the second beside a decode row of another sequence (after the chunk, so
/// its row moves); then three decode steps of each. With chunks of at most
/// [`crate::STEPWISE_SPAN_ROWS`] rows, on every backend a row's products and attention do not
/// depend on the other rows of its step.
pub fn check_last_layer_rows<B: Backend>(
    be: &B,
    model: &Model<B>,
    len: usize,
    chunk: usize,
) -> Result<(), String> {
    let err = |e: crate::BackendError| format!("{}: {}", be.name(), e.0);
    let vocab = model.config.vocab_size;
    let (prompt, other, feed) = (
        tokens(len, vocab, 400),
        tokens(40, vocab, 401),
        tokens(len.div_ceil(chunk) + 3, vocab, 402),
    );
    let mode = model.sparse_mode(len);
    let mut ws = model.workspace(be, chunk + 1).map_err(err)?;
    let same = |a: &[f32], b: &[f32]| {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    };
    // Every row read: the prompt alone, then the other sequence decoding alone.
    let mut whole = model.new_sequence(be).map_err(err)?;
    let mut want_last = Vec::new();
    for part in prompt.chunks(chunk) {
        want_last = model
            .forward_one(be, &mut ws, &mut whole, part, mode, LogitRows::All)
            .map_err(err)?;
    }
    let want_last = want_last.split_off(want_last.len() - vocab);
    let mut alone = prefilled(be, model, &mut ws, &other)?;
    let want_other = feed
        .iter()
        .map(|&t| model.decode(be, &mut ws, &mut alone, t))
        .collect::<Result<Vec<_>, _>>()
        .map_err(err)?;
    // The last row only, beside the other sequence's decode rows.
    let mut seq = model.new_sequence(be).map_err(err)?;
    let mut beside = prefilled(be, model, &mut ws, &other)?;
    let parts: Vec<&[u32]> = prompt.chunks(chunk).collect();
    let mut got_last = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let mut inputs = [
            StepInput {
                seq: &mut seq,
                tokens: part,
                mode,
                logits: if last {
                    LogitRows::Last
                } else {
                    LogitRows::None
                },
            },
            StepInput {
                mode: model.sparse_mode(beside.pos + 1),
                seq: &mut beside,
                tokens: &feed[i..=i],
                logits: LogitRows::Last,
            },
        ];
        let out = model.forward(be, &mut ws, &mut inputs).map_err(err)?;
        let mut out = out.into_iter().map(StepLogits::into_rows);
        let (mine, theirs) = (
            out.next().unwrap_or_default(),
            out.next().unwrap_or_default(),
        );
        if !same(&theirs, &want_other[i]) {
            return Err(format!(
                "{}: step {i}: a decode row beside a chunk whose rows are not read differs \
                 from decoding alone",
                be.name()
            ));
        }
        if last {
            got_last = mine;
        } else if !mine.is_empty() {
            return Err(format!(
                "{}: logits of a chunk that asked for none",
                be.name()
            ));
        }
    }
    if !same(&got_last, &want_last) {
        return Err(format!(
            "{}: a {len}-token prompt in chunks of {chunk}: the last row's logits read alone \
             differ from reading every row",
            be.name()
        ));
    }
    // Both sequences hold the same caches and states: they decode on alike.
    for &t in &feed[parts.len()..] {
        let a = model.decode(be, &mut ws, &mut whole, t).map_err(err)?;
        let b = model.decode(be, &mut ws, &mut seq, t).map_err(err)?;
        if !same(&a, &b) {
            return Err(format!(
                "{}: decoding after a prompt whose rows were not read differs",
                be.name()
            ));
        }
    }
    Ok(())
}

/// Greedy picks made where the logits are ([`LogitRows::Greedy`]) equal the host's pick from
/// the logits themselves: the same token, bit for bit, and its log-probability within float
/// rounding. Three sequences decode side by side twice, once returning logits and once with a
/// changing mix of greedy and logit rows in each step (a prompt chunk among them).
pub fn check_greedy_picks<B: Backend>(be: &B, model: &Model<B>) -> Result<(), String> {
    let err = |e: crate::BackendError| e.0;
    let vocab = model.config.vocab_size;
    let prompts = [
        tokens(7, vocab, 1),
        tokens(130, vocab, 2),
        tokens(40, vocab, 3),
    ];
    let feeds: Vec<Vec<u32>> = (0..6).map(|s| tokens(3, vocab, 10 + s)).collect();
    let mut ws = model.workspace(be, 256).map_err(err)?;
    // Each step's rows for the three sequences: logits when `greedy` says no.
    let mut run = |greedy: &dyn Fn(usize, usize) -> bool| -> Result<Vec<Vec<StepLogits>>, String> {
        let mut seqs = Vec::new();
        for p in &prompts[..2] {
            let mut seq = model.new_sequence(be).map_err(err)?;
            model
                .prefill(be, &mut ws, &mut seq, p, &mut |_| {})
                .map_err(err)?;
            seqs.push(seq);
        }
        seqs.push(model.new_sequence(be).map_err(err)?);
        let mut out = Vec::new();
        for (step, feed) in feeds.iter().enumerate() {
            let mode_of = |i: usize, pos: usize| {
                if i == 2 && step == 0 {
                    model.sparse_mode(prompts[2].len())
                } else {
                    model.sparse_mode(pos + 1)
                }
            };
            let rows = |i| {
                if greedy(step, i) {
                    LogitRows::Greedy
                } else {
                    LogitRows::Last
                }
            };
            let mut inputs: Vec<StepInput<'_, B>> = seqs
                .iter_mut()
                .enumerate()
                .map(|(i, seq)| StepInput {
                    mode: mode_of(i, seq.pos),
                    tokens: if i == 2 && step == 0 {
                        &prompts[2]
                    } else {
                        std::slice::from_ref(&feed[i])
                    },
                    seq,
                    logits: rows(i),
                })
                .collect();
            out.push(model.forward(be, &mut ws, &mut inputs).map_err(err)?);
        }
        Ok(out)
    };
    let plain = run(&|_, _| false)?;
    let mixed = run(&|step, i| (step + i) % 2 == 0 || step == 5)?;
    let mut greedy = 0;
    for (step, (p, m)) in plain.iter().zip(&mixed).enumerate() {
        for (i, (p, m)) in p.iter().zip(m).enumerate() {
            let (StepLogits::Rows(row), m) = (p, m) else {
                return Err("logits asked for, a pick given".into());
            };
            let want = GreedyPick::of(row);
            match m {
                StepLogits::Rows(r) if r == row => {}
                StepLogits::Rows(_) => {
                    return Err(format!("step {step} sequence {i}: the logits differ"))
                }
                StepLogits::GreedyRows(_) => {
                    return Err(format!("step {step} sequence {i}: picks of every row"))
                }
                StepLogits::Greedy(got) => {
                    greedy += 1;
                    let close =
                        (got.logprob - want.logprob).abs() <= 1e-5 * want.logprob.abs().max(1.0);
                    if got.id != want.id || !close {
                        return Err(format!(
                            "step {step} sequence {i}: picked {got:?}, the logits give {want:?}"
                        ));
                    }
                }
            }
        }
    }
    if greedy < 9 {
        return Err(format!("only {greedy} greedy picks were made"));
    }
    Ok(())
}

/// A new sequence of `model` that has read `prompt`.
fn prefilled<B: Backend>(
    be: &B,
    model: &Model<B>,
    ws: &mut Workspace<B>,
    prompt: &[u32],
) -> Result<SeqState<B>, String> {
    let mut seq = model.new_sequence(be).map_err(|e| e.0)?;
    model
        .prefill(be, ws, &mut seq, prompt, &mut |_| {})
        .map_err(|e| e.0)?;
    Ok(seq)
}

/// The logits of decoding `feed` one token at a time after `prompt`.
fn decoded<B: Backend>(
    be: &B,
    model: &Model<B>,
    ws: &mut Workspace<B>,
    prompt: &[u32],
    feed: &[u32],
) -> Result<Vec<Vec<f32>>, String> {
    let mut seq = prefilled(be, model, ws, prompt)?;
    feed.iter()
        .map(|&t| model.decode(be, ws, &mut seq, t).map_err(|e| e.0))
        .collect()
}

/// A span of at most [`crate::STEPWISE_SPAN_ROWS`] tokens gives each row the logits of
/// decoding its tokens one at a time, bit for bit, below `dense_len` and past it (what makes a
/// verified draft the token plain decoding gives): after prompts of 30 and 190 tokens, spans of
/// 1 to 17 tokens against decode steps; every other span asks for every row's greedy pick
/// ([`LogitRows::GreedyAll`]), which must be the pick of the decoded logits. The model's
/// `dense_len` should lie between (100).
pub fn check_stepwise_spans<B: Backend>(be: &B, model: &Model<B>) -> Result<(), String> {
    let err = |e: crate::BackendError| e.0;
    let vocab = model.config.vocab_size;
    let mut ws = model.workspace(be, 64).map_err(err)?;
    for (prompt_len, seed) in [(30usize, 31u64), (190, 32)] {
        let prompt = tokens(prompt_len, vocab, seed);
        let lens = [2usize, 5, 17, 1, 7, 3];
        let feed = tokens(lens.iter().sum(), vocab, seed + 100);
        let want = decoded(be, model, &mut ws, &prompt, &feed)?;
        let mut seq = prefilled(be, model, &mut ws, &prompt)?;
        let mut at = 0;
        for n in lens {
            let span = &feed[at..at + n];
            if seq.pos < model.config.sparse.dense_len
                && seq.pos + n >= model.config.sparse.dense_len
            {
                return Err("a span crosses dense_len: choose other lengths".into());
            }
            let mode = model.sparse_mode(seq.pos + n);
            if at % 2 == 1 {
                let input = StepInput {
                    seq: &mut seq,
                    tokens: span,
                    mode,
                    logits: LogitRows::GreedyAll,
                };
                let out = model.forward(be, &mut ws, &mut [input]).map_err(err)?;
                let Some(StepLogits::GreedyRows(picks)) = out.into_iter().next() else {
                    return Err("every row's pick asked for, something else given".into());
                };
                if picks.len() != n {
                    return Err(format!("{} picks for a span of {n}", picks.len()));
                }
                for (r, got) in picks.iter().enumerate() {
                    let want = GreedyPick::of(&want[at + r]);
                    let close =
                        (got.logprob - want.logprob).abs() <= 1e-5 * want.logprob.abs().max(1.0);
                    if got.id != want.id || !close {
                        return Err(format!(
                            "prompt {prompt_len}, span of {n} at token {at}: row {r} picked \
                             {got:?}, decoding gives {want:?}"
                        ));
                    }
                }
                at += n;
                continue;
            }
            let rows = model
                .forward_one(be, &mut ws, &mut seq, span, mode, LogitRows::All)
                .map_err(err)?;
            let vocab_rows: Vec<&[f32]> = rows.chunks(vocab).collect();
            for (r, got) in vocab_rows.iter().enumerate() {
                let w = &want[at + r];
                let same = got.len() == w.len()
                    && got.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(format!(
                        "prompt {prompt_len}, span of {n} at token {at}: row {r}'s logits differ \
                         from decoding it alone"
                    ));
                }
            }
            at += n;
        }
    }
    Ok(())
}

/// Reads `prompt[seq.pos..]` into `seq` in chunks of `chunk` (the whole prompt's attention
/// mode), snapshotting after each into `snaps`; returns the logits of the rows from position
/// `keep_from` on.
#[allow(clippy::too_many_arguments)]
fn read_in_chunks<B: Backend>(
    be: &B,
    model: &Model<B>,
    ws: &mut Workspace<B>,
    seq: &mut SeqState<B>,
    prompt: &[u32],
    chunk: usize,
    snaps: &mut Vec<crate::SeqMark<B>>,
    keep_from: usize,
) -> Result<Vec<f32>, String> {
    let err = |e: crate::BackendError| e.0;
    let mode = model.sparse_mode(prompt.len());
    let vocab = model.config.vocab_size;
    let mut rows = Vec::new();
    for part in prompt[seq.pos..].chunks(chunk) {
        let (start, end) = (seq.pos, seq.pos + part.len());
        let wanted = if end > keep_from {
            LogitRows::All
        } else {
            LogitRows::None
        };
        let got = model
            .forward_one(be, ws, seq, part, mode, wanted)
            .map_err(err)?;
        if end > keep_from {
            rows.extend_from_slice(&got[keep_from.saturating_sub(start) * vocab..]);
        }
        snaps.push(model.snapshot(be, seq).map_err(err)?);
    }
    Ok(rows)
}

/// Resuming from a snapshot, as the prefix cache does: a sequence reads prompt A (230
/// tokens) in chunks of 64 with a snapshot ([`Model::snapshot`]) after each, decodes on, then
/// is rewound to the snapshot at 128 and reads the rest of prompt B (which shares A's first
/// 150 tokens) in chunks of 64 from there: every row's logits are those of a fresh sequence
/// reading B in chunks of 64, bit for bit (128 is a chunk boundary of that cold run).
pub fn check_resume<B: Backend>(be: &B, model: &Model<B>) -> Result<(), String> {
    let err = |e: crate::BackendError| e.0;
    let vocab = model.config.vocab_size;
    let a = tokens(230, vocab, 41);
    let mut b = a[..150].to_vec();
    b.extend(tokens(70, vocab, 42));
    let mut ws = model.workspace(be, 64).map_err(err)?;
    let read = |ws: &mut Workspace<B>,
                seq: &mut SeqState<B>,
                prompt: &[u32],
                snaps: &mut Vec<crate::SeqMark<B>>| {
        read_in_chunks(be, model, ws, seq, prompt, 64, snaps, 0)
    };
    let mut cold = model.new_sequence(be).map_err(err)?;
    let want = read(&mut ws, &mut cold, &b, &mut Vec::new())?;
    let mut seq = model.new_sequence(be).map_err(err)?;
    let mut snaps = Vec::new();
    read(&mut ws, &mut seq, &a, &mut snaps)?;
    for &t in &tokens(5, vocab, 43) {
        model.decode(be, &mut ws, &mut seq, t).map_err(err)?;
    }
    let at = snaps
        .iter()
        .find(|s| s.pos() == 128)
        .ok_or("no snapshot at 128")?;
    model.rewind(be, &mut seq, at).map_err(err)?;
    let got = read(&mut ws, &mut seq, &b, &mut Vec::new())?;
    if got[..] != want[128 * vocab..] {
        return Err("resumed from the snapshot at 128, the logits differ from a cold read".into());
    }
    Ok(())
}

/// Forking a sequence ([`Model::fork_sequence`], a prefix-cache hit that leaves the parked
/// sequence as it was): a sequence reads a prompt of `len` tokens in chunks of `chunk` with a
/// snapshot after each; forks of it at each of `cuts` (chunk boundaries) read the rest of
/// another prompt sharing those tokens, in chunks of `chunk`, each getting the logits of a
/// fresh sequence reading that prompt, bit for bit; and the parked sequence is untouched by
/// the forks' writes: a fork at its end decodes the same logits before and after them. On a
/// backend that shares cache memory, `len` past a page of keys makes the forks share pages.
pub fn check_fork<B: Backend>(
    be: &B,
    model: &Model<B>,
    len: usize,
    chunk: usize,
    cuts: &[usize],
) -> Result<(), String> {
    let err = |e: crate::BackendError| e.0;
    let vocab = model.config.vocab_size;
    let a = tokens(len, vocab, 51);
    let mut ws = model.workspace(be, chunk).map_err(err)?;
    let read = |ws: &mut Workspace<B>,
                seq: &mut SeqState<B>,
                prompt: &[u32],
                snaps: &mut Vec<crate::SeqMark<B>>,
                keep_from: usize| {
        read_in_chunks(be, model, ws, seq, prompt, chunk, snaps, keep_from)
    };
    let mut parked = model.new_sequence(be).map_err(err)?;
    let mut snaps = Vec::new();
    read(&mut ws, &mut parked, &a, &mut snaps, len)?;
    let probe = tokens(1, vocab, 52)[0];
    let at_end = |ws: &mut Workspace<B>| -> Result<Vec<f32>, String> {
        let mut f = model.fork_sequence(be, &parked, None, len).map_err(err)?;
        model.decode(be, ws, &mut f, probe).map_err(err)
    };
    let before = at_end(&mut ws)?;
    let mut forks = Vec::new();
    for (i, &cut) in cuts.iter().enumerate() {
        let mut b = a[..cut].to_vec();
        b.extend(tokens(len - cut + chunk + 7, vocab, 60 + i as u64));
        let mode = model.sparse_mode(b.len());
        if mode != model.sparse_mode(len) {
            return Err(format!("cut {cut}: the prompts are read differently"));
        }
        let mut cold = model.new_sequence(be).map_err(err)?;
        let want = read(&mut ws, &mut cold, &b, &mut Vec::new(), cut)?;
        let snap = snaps.iter().find(|s| s.pos() == cut).ok_or("no snapshot")?;
        let mut fork = model
            .fork_sequence(be, &parked, Some(snap), cut)
            .map_err(err)?;
        let got = read(&mut ws, &mut fork, &b, &mut Vec::new(), cut)?;
        if got != want {
            return Err(format!("a fork at {cut} reads on unlike a cold sequence"));
        }
        // Kept alive while the next forks are made and written.
        forks.push(fork);
    }
    if at_end(&mut ws)? != before {
        return Err("the forks' writes changed the sequence they forked".into());
    }
    Ok(())
}

/// Rewinding a sequence undoes the tokens fed since its mark exactly: a sequence that reads
/// rejected tokens (a span of them, as a speculative step would), is rewound and goes on gives
/// the logits of one that never read them, bit for bit. Past a 190-token prompt, the rejected
/// spans (1 to 9 tokens) complete compressed windows of a small config (windows every few
/// tokens, few blocks selected), so those must be undone too: 80 tokens on, a window computed
/// from rejected tokens would have left the forced local blocks and move the selection. The
/// spans start with 0 to 3 right tokens (drafts that stood), kept by [`Model::rewind_to`]
/// (their rows must be the decoded logits), or every fifth step decoded again after a rewind
/// to the mark.
pub fn check_rewind<B: Backend>(be: &B, model: &Model<B>) -> Result<(), String> {
    let err = |e: crate::BackendError| e.0;
    let vocab = model.config.vocab_size;
    let prompt = tokens(190, vocab, 21);
    let feed = tokens(80, vocab, 22);
    let junk = tokens(8, vocab, 23);
    let mut ws = model.workspace(be, 64).map_err(err)?;
    let want = decoded(be, model, &mut ws, &prompt, &feed)?;
    let mut seq = prefilled(be, model, &mut ws, &prompt)?;
    let mut got = Vec::new();
    let mut i = 0;
    // Each mark but the first reuses the last one's state copies (Model::mark_with).
    let mut spare = None;
    while i < feed.len() {
        let mark = model.mark_with(be, &mut seq, spare.take()).map_err(err)?;
        // A span whose first 0 to 3 tokens are right, then rejected tokens; every fifth step
        // rewound to the mark and the right tokens decoded again, else rewound into the span
        // (the right tokens kept: their rows are the decoded logits).
        let keep = (i % 4).min(feed.len() - i - 1);
        let mut span = feed[i..i + keep].to_vec();
        span.extend(&junk[..1 + i % 6]);
        let mode = model.sparse_mode(seq.pos + span.len());
        let rows = model
            .forward_one(be, &mut ws, &mut seq, &span, mode, LogitRows::All)
            .map_err(err)?;
        let again = i % 5 == 0;
        if again {
            model.rewind(be, &mut seq, &mark).map_err(err)?;
            for &t in &feed[i..i + keep] {
                got.push(model.decode(be, &mut ws, &mut seq, t).map_err(err)?);
            }
        } else {
            model.rewind_to(be, &mut seq, &mark, keep).map_err(err)?;
            got.extend(rows.chunks(vocab).take(keep).map(<[f32]>::to_vec));
        }
        if seq.pos != 190 + i + keep {
            return Err(format!(
                "step {i}: rewound to {}, not {}",
                seq.pos,
                190 + i + keep
            ));
        }
        got.push(
            model
                .decode(be, &mut ws, &mut seq, feed[i + keep])
                .map_err(err)?,
        );
        i += keep + 1;
        spare = Some(mark);
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if g != w {
            return Err(format!("token {i}: logits after a rewind differ"));
        }
    }
    // A mark of another sequence, or of its future, is refused.
    let mut other = prefilled(be, model, &mut ws, &prompt)?;
    let mark = model.mark(be, &mut other).map_err(err)?;
    if model.rewind(be, &mut seq, &mark).is_ok() {
        return Err("a mark of another sequence was taken".into());
    }
    // Keeping more of a span than it read, or a span after another step, is refused, and the
    // sequence can still be rewound to the mark.
    let mode = |s: &SeqState<B>| model.sparse_mode(s.pos + 2);
    let mark = model.mark(be, &mut other).map_err(err)?;
    let m = mode(&other);
    model
        .forward_one(be, &mut ws, &mut other, &junk[..2], m, LogitRows::Last)
        .map_err(err)?;
    if model.rewind_to(be, &mut other, &mark, 3).is_ok() {
        return Err("a rewind kept 3 tokens of a span of 2".into());
    }
    let m = mode(&other);
    model
        .forward_one(be, &mut ws, &mut other, &junk[2..4], m, LogitRows::Last)
        .map_err(err)?;
    if model.rewind_to(be, &mut other, &mark, 1).is_ok() {
        return Err("a rewind kept tokens of a span read before another".into());
    }
    model.rewind(be, &mut other, &mark).map_err(err)?;
    if other.pos != prompt.len() {
        return Err(format!("rewound to {}, not {}", other.pos, prompt.len()));
    }
    Ok(())
}
