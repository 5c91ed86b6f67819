//! `sala bench --concurrent N`: N requests one after another, then in one continuous batch.

use super::floors::concurrent_floor;
use super::{greedy_options, print_profile, random_engine, speculative, BenchArgs, BenchDrafts};
use crate::device::DeviceStats;
use anyhow::{bail, Result};
use sala_checkpoint::ModelConfig;
use sala_model::numerics::TestRng;
use sala_model::Backend;
use serde_json::{json, Value};
use std::time::Instant;

/// One continuous batch of `prompts` (request `i` with `opts(i)`), run to the end.
struct BatchedRun {
    seconds: f64,
    /// Tokens generated in the steps after every prompt was read, and those steps' time.
    decode_tokens: usize,
    decode_seconds: f64,
    /// Those steps' count, and the time the host waited for the device in them (when known).
    decode_steps: usize,
    decode_waited: Option<f64>,
    /// Each request's generated tokens.
    ids: Vec<Vec<u32>>,
}

impl BatchedRun {
    fn tokens(&self) -> usize {
        self.ids.iter().map(Vec::len).sum()
    }
}

fn batched_run<B: Backend + DeviceStats>(
    engine: &mut sala_engine::generate::Engine<B>,
    prompts: &[Vec<u32>],
    opts: &dyn Fn(usize) -> sala_engine::generate::GenerateOptions,
) -> Result<BatchedRun> {
    use sala_engine::step::StepEvent;
    use std::cell::{Cell, RefCell};
    let ids = RefCell::new(vec![Vec::new(); prompts.len()]);
    let (generated, prefilled) = (Cell::new(0usize), Cell::new(0usize));
    let failure = RefCell::new(None);
    let start = Instant::now();
    let mut batch = engine.batch();
    for (i, p) in prompts.iter().enumerate() {
        let (ids, generated, prefilled, failure) = (&ids, &generated, &prefilled, &failure);
        let client = move |ev: StepEvent<'_>| {
            match ev {
                StepEvent::Token(s) => {
                    if let Some(t) = s.token {
                        ids.borrow_mut()[i].push(t.id);
                        generated.set(generated.get() + 1);
                    }
                }
                StepEvent::Prefilled { .. } => prefilled.set(prefilled.get() + 1),
                StepEvent::Done(Err(e)) => *failure.borrow_mut() = Some(e.to_string()),
                _ => {}
            }
            true
        };
        engine.admit(&mut batch, p.clone(), &opts(i), None, client)?;
    }
    // Steps after every prompt is read (no prompt chunk in them): tokens, time, and the
    // host's wait for the device.
    let (mut decode_tokens, mut decode_seconds, mut decode_steps) = (0usize, 0.0f64, 0usize);
    let mut decode_waited = Some(0.0f64);
    while !batch.is_empty() {
        let decode_only = prefilled.get() == prompts.len();
        let (t0, tokens0) = (Instant::now(), generated.get());
        let waited0 = engine.backend.host_wait();
        engine.step(&mut batch);
        if decode_only {
            decode_tokens += generated.get() - tokens0;
            decode_seconds += t0.elapsed().as_secs_f64();
            decode_steps += 1;
            decode_waited = match (decode_waited, waited0, engine.backend.host_wait()) {
                (Some(w), Some(a), Some(b)) => Some(w + (b - a).as_secs_f64()),
                _ => None,
            };
        }
    }
    drop(batch);
    if let Some(e) = failure.into_inner() {
        bail!("a batched request failed: {e}");
    }
    Ok(BatchedRun {
        seconds: start.elapsed().as_secs_f64(),
        decode_tokens,
        decode_seconds,
        decode_steps,
        decode_waited,
        ids: ids.into_inner(),
    })
}

/// `n` requests of `len` random prompt tokens and `--decode-tokens` greedy tokens each (EOS
/// ignored): first one after another, then admitted together into one continuous batch.
/// Returns the JSON document; prints both throughputs and their ratio.
pub(super) fn concurrent<B: Backend + DeviceStats>(
    be: B,
    config: &ModelConfig,
    len: usize,
    n: usize,
    modes: &[BenchDrafts],
    args: &BenchArgs,
) -> Result<Value> {
    use sala_engine::generate::GenerateOptions;
    use sala_engine::step::StepEvent;
    let name = be.name();
    let (mut engine, _tokenizer_dir) = random_engine(be, config, args)?;
    speculative::set_draft(&mut engine, modes, args.seed)?;
    engine.set_max_batch(n)?;
    let opts = greedy_options(args, len);
    let mut rng = TestRng::new(args.seed ^ 0xc0c0);
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|_| {
            (0..len)
                .map(|_| rng.below(config.vocab_size) as u32)
                .collect()
        })
        .collect();
    // Warm-up: kernels and GEMM plans for a chunk, a decode step and a batched step.
    {
        let warm = &prompts[0][..len.min(args.prefill_chunk)];
        let o = GenerateOptions {
            max_tokens: 2,
            ..opts.clone()
        };
        engine.generate(warm, &o, &mut |_| {}, &mut |_| {})?;
        let mut batch = engine.batch();
        for _ in 0..n {
            engine.admit(&mut batch, warm.to_vec(), &o, None, |_: StepEvent<'_>| true)?;
        }
        while !batch.is_empty() {
            engine.step(&mut batch);
        }
    }
    engine.backend.profile();
    let start = Instant::now();
    let mut generated = 0;
    // Decode steps alone (after each prompt's first token): tokens and time.
    let (mut decode_tokens, mut decode_s) = (0usize, 0.0f64);
    let baseline = !args.batched_only;
    for p in prompts.iter().filter(|_| baseline) {
        let g = engine.generate(p, &opts, &mut |_| {}, &mut |_| {})?;
        generated += g.tokens.len();
        decode_tokens += g.tokens.len().saturating_sub(1);
        decode_s += g.decode_time.as_secs_f64();
    }
    let one_by_one = start.elapsed().as_secs_f64();
    if baseline {
        print_profile(&engine.backend, &format!("{n} requests one by one"));
    }
    let plain = batched_run(&mut engine, &prompts, &|_| opts.clone())?;
    let (batched, batched_tokens) = (plain.seconds, plain.tokens());
    let (batch_decode_tokens, batch_decode_s) = (plain.decode_tokens, plain.decode_seconds);
    print_profile(&engine.backend, &format!("{n} requests batched"));
    let total = |gen: usize| (n * len + gen) as f64;
    println!(
        "{n} requests of {len} prompt + {} generated tokens on {name}",
        args.decode_tokens
    );
    println!(
        "{:>14} {:>9} {:>16} {:>18}",
        "", "time s", "generated tok/s", "prompt+gen tok/s"
    );
    let runs = [
        ("one by one", one_by_one, generated),
        ("batched", batched, batched_tokens),
    ];
    for &(label, t, gen) in runs.iter().skip(usize::from(!baseline)) {
        println!(
            "{label:>14} {t:>9.3} {:>16.1} {:>18.0}",
            gen as f64 / t,
            total(gen) / t
        );
    }
    // The decode phase alone, where batching can pay (prefill work is the same either way).
    let rate = |t: usize, s: f64| t as f64 / s.max(1e-9);
    let batch_rate = rate(batch_decode_tokens, batch_decode_s);
    let (ratio, alone_rate) = if baseline {
        let ratio = (total(batched_tokens) / batched) / (total(generated) / one_by_one);
        let alone_rate = rate(decode_tokens, decode_s);
        println!("batched / one by one, total tokens/s: {ratio:.2}x");
        println!(
            "decode steps: one by one {alone_rate:.1} tok/s, batched {batch_rate:.1} tok/s \
             ({batch_decode_tokens} tokens after every prompt was read): {:.2}x",
            batch_rate / alone_rate.max(1e-9)
        );
        (json!(ratio), json!(alone_rate))
    } else {
        println!(
            "decode steps: batched {batch_rate:.1} tok/s ({batch_decode_tokens} tokens after \
             every prompt was read)"
        );
        if let (Some(w), 1..) = (plain.decode_waited, plain.decode_steps) {
            let steps = plain.decode_steps as f64;
            println!(
                "decode steps: {:.2} ms a step, of which the host waited {:.2} ms for the device",
                1e3 * batch_decode_s / steps,
                1e3 * w / steps
            );
        }
        (Value::Null, Value::Null)
    };
    // The same batch speculating: drafts from each request's own plain continuation.
    let mut speculative = Vec::new();
    for drafts in modes {
        let s = drafts.label();
        let sequences: Vec<std::sync::Arc<[u32]>> = prompts
            .iter()
            .zip(&plain.ids)
            .map(|(p, ids)| p.iter().chain(ids).copied().collect())
            .collect();
        let run = batched_run(&mut engine, &prompts, &|i| GenerateOptions {
            speculate: Some(drafts.speculate(&sequences[i])),
            ..opts.clone()
        })?;
        let rate = run.decode_tokens as f64 / run.decode_seconds.max(1e-9);
        let same = run.ids == plain.ids;
        println!(
            "decode steps speculating ({s}): {rate:.1} tok/s, {:.2}x the plain batch{}",
            rate / batch_rate.max(1e-9),
            if same {
                ""
            } else {
                " (some tokens differ from the plain batch's)"
            }
        );
        speculative.push(json!({
            "drafts": s,
            "decode_tok_s": rate,
            "vs_plain_batch": rate / batch_rate.max(1e-9),
            "same_tokens": same,
        }));
    }
    // The floors (PERF.md's ceilings, --gemm-tflops and --bandwidth-tbs) and where the runs sit.
    let (floor_batched, floor_one_by_one) = concurrent_floor(
        config,
        n,
        len,
        args.decode_tokens,
        args.gemm_tflops,
        args.bandwidth_tbs,
    );
    let floor_rate = (n * args.decode_tokens) as f64 / floor_batched;
    println!(
        "floor: {floor_rate:.0} generated tok/s batched ({floor_batched:.3} s: the prompts at \
         {} TFLOP/s, {n}-row steps at {} TB/s); batched reaches {:.0}% of it",
        args.gemm_tflops,
        args.bandwidth_tbs,
        100.0 * (batched_tokens as f64 / batched) / floor_rate
    );
    if baseline {
        println!(
            "floor of batched / one by one: {:.2}x",
            floor_one_by_one / floor_batched
        );
    }
    let baseline_value = |v: Value| if baseline { v } else { Value::Null };
    Ok(json!({
        "speculative": speculative,
        "device": name,
        "requests": n,
        "prompt_tokens": len,
        "decode_tokens": args.decode_tokens,
        "one_by_one_s": baseline_value(json!(one_by_one)),
        "batched_s": batched,
        "generated_one_by_one": baseline_value(json!(generated)),
        "generated_batched": batched_tokens,
        "ratio_total_tokens_per_s": ratio,
        "decode_tok_s_one_by_one": alone_rate,
        "decode_tok_s_batched": batch_rate,
        "decode_tokens_batched_phase": batch_decode_tokens,
        "floor_batched_s": floor_batched,
        "floor_generated_tok_s": floor_rate,
        "floor_ratio_total_tokens_per_s": floor_one_by_one / floor_batched,
    }))
}
