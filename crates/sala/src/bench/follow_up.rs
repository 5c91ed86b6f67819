//! `sala bench --follow-up`: the prefix cache's case. A document of each `--context` tokens
//! less 101 (a document is seldom a whole number of chunks) with a first 64-token question,
//! then the same document with another question: the second request's time to first token
//! with the prefix cache on (it reads its question and the little of the document past the
//! first prompt's tail cut) against the first's (the whole document), and the memory the cache holds (the page pool's count,
//! where there is one: the two parked sequences share the document's keys and values). Then a workload with no
//! shared prefixes (8 prompts of the first context, one after another) with the cache off and
//! on: what it costs when nothing is shared.

use super::{gib, greedy_options, print_profile, random_engine, BenchArgs};
use crate::device::DeviceStats;
use anyhow::Result;
use sala_checkpoint::ModelConfig;
use sala_engine::generate::Engine;
use sala_model::numerics::TestRng;
use sala_model::Backend;
use serde_json::{json, Value};
use std::time::Instant;

/// Tokens of each question.
const QUESTION: usize = 64;
/// Tokens a document falls short of its context.
const SHORT: usize = 101;
/// Prompts of the no-sharing workload.
const UNSHARED: usize = 8;

fn random_tokens(rng: &mut TestRng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// Time to first token of `prompt` (seconds), and the prompt tokens taken from the cache.
fn ttft<B: Backend>(
    engine: &mut Engine<B>,
    prompt: &[u32],
    opts: &sala_engine::generate::GenerateOptions,
) -> Result<(f64, usize)> {
    let g = engine.generate(prompt, opts, &mut |_| {}, &mut |_| {})?;
    Ok((g.prefill_time.as_secs_f64(), g.cached_tokens))
}

pub fn follow_up<B: Backend + DeviceStats>(
    be: B,
    config: &ModelConfig,
    contexts: &[usize],
    args: &BenchArgs,
) -> Result<Value> {
    let name = be.name();
    let longest = contexts.iter().max().copied().unwrap_or(1) + 2 * QUESTION;
    let (mut engine, _tokenizer_dir) = random_engine(be, config, args)?;
    let opts = greedy_options(args, longest);
    let vocab = config.vocab_size;
    let mut rng = TestRng::new(args.seed ^ 0xf011);
    // Warm-up: kernels and GEMM plans for a chunk and a decode step.
    let warm = random_tokens(&mut rng, vocab, args.prefill_chunk.min(contexts[0]));
    ttft(&mut engine, &warm, &opts)?;
    let snapshot = engine.cache_budget().snapshot_bytes();
    println!(
        "follow-up questions on {name}: a document, a {QUESTION}-token question, then another"
    );
    println!(
        "{:>9} {:>12} {:>14} {:>8} {:>7} {:>10} {:>14}",
        "context", "first TTFT s", "follow-up s", "cached", "parked", "pool GiB", "snapshots GiB"
    );
    let mut rows = Vec::new();
    for &len in contexts {
        engine.set_prefix_cache(Some(usize::MAX));
        let doc = random_tokens(&mut rng, vocab, len.saturating_sub(SHORT).max(1));
        let ask = |rng: &mut TestRng| {
            let q = random_tokens(rng, vocab, QUESTION);
            doc.iter().copied().chain(q).collect::<Vec<u32>>()
        };
        let (first, second) = (ask(&mut rng), ask(&mut rng));
        engine.backend.profile();
        let (t1, _) = ttft(&mut engine, &first, &opts)?;
        print_profile(&engine.backend, &format!("first question at {len}"));
        let (t2, cached) = ttft(&mut engine, &second, &opts)?;
        print_profile(&engine.backend, &format!("follow-up at {len}"));
        // Two parked sequences (the first question's and the follow-up's, a fork sharing
        // its keys and values where the backend can) and their snapshots; the page pool's
        // count says what they take together.
        let (parked, snaps) = engine.prefix_cache_entries();
        let snapshots = snaps * snapshot;
        let pool = engine.backend.page_pool().map(|(pages, page)| pages * page);
        println!(
            "{len:>9} {t1:>12.3} {t2:>14.3} {cached:>8} {parked:>7} {:>10} {:>14.2}",
            pool.map_or("-".into(), |b| format!("{:.2}", gib(b))),
            gib(snapshots)
        );
        rows.push(json!({
            "context": len, "first_ttft_s": t1, "follow_up_ttft_s": t2,
            "cached_tokens": cached, "parked": parked, "pool_bytes": pool,
            "snapshots": snaps, "snapshot_bytes": snapshots,
        }));
        engine.set_prefix_cache(None);
    }
    // No shared prefixes: the same prompts with the cache off, then on.
    let len = contexts[0];
    let prompts: Vec<Vec<u32>> = (0..UNSHARED)
        .map(|_| random_tokens(&mut rng, vocab, len))
        .collect();
    let mut times = Vec::new();
    for on in [false, true] {
        engine.set_prefix_cache(on.then_some(usize::MAX));
        let start = Instant::now();
        for p in &prompts {
            engine.generate(p, &opts, &mut |_| {}, &mut |_| {})?;
        }
        times.push(start.elapsed().as_secs_f64());
    }
    engine.set_prefix_cache(None);
    println!(
        "no shared prefixes, {UNSHARED} prompts of {len} + {} tokens: cache off {:.3} s, on {:.3} s ({:.3}x)",
        args.decode_tokens,
        times[0],
        times[1],
        times[1] / times[0]
    );
    Ok(json!({
        "backend": name, "question_tokens": QUESTION, "results": rows,
        "unshared": {"prompts": UNSHARED, "context": len, "off_s": times[0], "on_s": times[1]},
    }))
}
