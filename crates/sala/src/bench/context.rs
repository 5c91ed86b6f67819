//! `sala bench --context-parallel N`: each --context read by N ranks at once
//! ([`sala_model::context::prefill`]), then --decode-tokens decoded on the rank holding the
//! whole prompt, against one rank reading it in chunks of --prefill-chunk: both times to first
//! token, the ratio, and the decode speed after each. The ranks are those the device's kind
//! makes ([`DeviceStats::context_ranks`]), each a tensor-parallel group with
//! --tensor-parallel; on the CPU they are simulated (one after another: the ratio shows the
//! exchanges' cost, not a speedup).

use super::BenchArgs;
use crate::device::{memory_limit, user_memory_limit, DeviceStats};
use anyhow::{bail, Context as _, Result};
use sala_checkpoint::ModelConfig;
use sala_model::context::{prefill, prompt_ranges, range_bytes, ContextRank};
use sala_model::memory::MemoryPlan;
use sala_model::numerics::TestRng;
use sala_model::{Backend, Model, SeqState, Workspace};
use serde_json::{json, Value};
use std::time::Instant;

const GIB: f64 = (1u64 << 30) as f64;

/// Decodes `n` random tokens on `seq`: the tokens a second.
fn decode_rate<B: Backend + DeviceStats>(
    be: &B,
    model: &Model<B>,
    ws: &mut Workspace<B>,
    seq: &mut SeqState<B>,
    rng: &mut TestRng,
    n: usize,
) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..n {
        let t = rng.below(model.config.vocab_size) as u32;
        model.decode(be, ws, seq, t)?;
    }
    be.synchronize()?;
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

pub fn context_parallel(
    ranks: usize,
    config: &ModelConfig,
    contexts: &[usize],
    args: &BenchArgs,
) -> Result<Value> {
    let opened = args.device.open(|| Ok(config.clone()))?;
    crate::on_backend!(opened, be => over_ranks(be, ranks, config, contexts, args))
}

/// [`context_parallel`] over `be` (a device, or a tensor-parallel group) and `ranks` − 1 more
/// of its kind ([`DeviceStats::context_ranks`]); `be` is the last rank, as the engine's is.
fn over_ranks<B: Backend + DeviceStats>(
    be: B,
    ranks: usize,
    config: &ModelConfig,
    contexts: &[usize],
    args: &BenchArgs,
) -> Result<Value> {
    let (mut backends, exchange) = be
        .context_ranks(ranks - 1, 1)
        .with_context(|| format!("--context-parallel {ranks}"))?;
    backends.push(be);
    let per_device = if exchange.one_memory() { ranks } else { 1 };
    check_memory(&backends[0], config, contexts, ranks, per_device, args)?;
    let what = format!(
        "{ranks} ranks of {}{}",
        backends[0].name(),
        if exchange.one_memory() {
            " (one memory)"
        } else {
            ""
        }
    );
    let models = backends
        .iter()
        .map(|be| Model::random(be, config.clone(), args.seed, &mut |_, _| {}))
        .collect::<Result<Vec<_>, _>>()
        .context("making the ranks' models")?;
    let mut rng = TestRng::new(args.seed ^ 0xc0de);
    println!(
        "context parallel over {what} against one reading in chunks of {}",
        args.prefill_chunk
    );
    println!(
        "{:>9} {:>11} {:>11} {:>9} {:>14} {:>14}",
        "context", "TTFT s, 1", "TTFT s, N", "1 / N", "decode tok/s 1", "decode tok/s N"
    );
    let mut results = Vec::new();
    for &len in contexts {
        let prompt: Vec<u32> = (0..len)
            .map(|_| rng.below(config.vocab_size) as u32)
            .collect();
        // One rank, in chunks.
        let (one, be0) = (&models[0], &backends[0]);
        let mut ws = one.step_workspace(be0, args.prefill_chunk.min(len), 1)?;
        let mut seq = one.new_sequence(be0)?;
        be0.synchronize()?;
        let start = Instant::now();
        let want = one.prefill(be0, &mut ws, &mut seq, &prompt, &mut |_| {})?;
        let ttft_one = start.elapsed().as_secs_f64();
        let decode_one = decode_rate(be0, one, &mut ws, &mut seq, &mut rng, args.decode_tokens)?;
        drop((ws, seq));
        // N ranks at once, each reading its range in chunks as long as one rank's.
        let rows = rank_rows(config, len, ranks, args);
        let mut wss = models
            .iter()
            .zip(&backends)
            .map(|(m, be)| m.step_workspace(be, rows, 1))
            .collect::<Result<Vec<_>, _>>()?;
        let mut seqs = models
            .iter()
            .zip(&backends)
            .map(|(m, be)| m.new_sequence(be))
            .collect::<Result<Vec<_>, _>>()?;
        for be in &backends {
            be.synchronize()?;
        }
        let mut parts = ContextRank::zip(&backends, &models, &mut wss, &mut seqs);
        let start = Instant::now();
        let done = prefill(&mut parts, &*exchange, &prompt)?;
        let ttft_n = start.elapsed().as_secs_f64();
        drop(parts);
        let err = sala_model::numerics::rel_l2(&done.logits, &want);
        let last = done.last;
        let decode_n = decode_rate(
            &backends[last],
            &models[last],
            &mut wss[last],
            &mut seqs[last],
            &mut rng,
            args.decode_tokens,
        )?;
        println!(
            "{len:>9} {ttft_one:>11.3} {ttft_n:>11.3} {:>8.2}x {decode_one:>14.1} {decode_n:>14.1}",
            ttft_one / ttft_n
        );
        results.push(json!({
            "context": len,
            "ranges": done.ranges.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
            "ttft_one_s": ttft_one,
            "ttft_ranks_s": ttft_n,
            "ttft_ratio_one_over_ranks": ttft_one / ttft_n,
            "decode_tok_s_one": decode_one,
            "decode_tok_s_ranks": decode_n,
            "last_logits_rel_l2_vs_one": err,
        }));
    }
    Ok(json!({
        "mode": "context_parallel",
        "ranks": ranks,
        "device": what,
        "results": results,
    }))
}

/// The widest range of `len` tokens over `ranks` ranks, and the rows of a rank's workspace:
/// a chunk (--prefill-chunk) of it.
fn rank_rows(config: &ModelConfig, len: usize, ranks: usize, args: &BenchArgs) -> usize {
    args.prefill_chunk.min(widest(config, len, ranks)).max(1)
}

/// The longest of the ranges `len` tokens are read in over `ranks` ranks.
fn widest(config: &ModelConfig, len: usize, ranks: usize) -> usize {
    let ranges = prompt_ranges(config, len, ranks);
    ranges.iter().map(|r| r.len()).max().unwrap_or(0)
}

/// Refuses, before any model is made, the contexts whose ranks would not fit: `per_device`
/// ranks share a device (all of them on the CPU), each holding the whole model, a chunk's
/// workspace, what its range keeps between a layer's passes ([`range_bytes`]) and, counted for
/// every rank as for the last, the caches of the whole prompt and the decoded tokens.
fn check_memory<B: Backend + DeviceStats>(
    be: &B,
    config: &ModelConfig,
    contexts: &[usize],
    ranks: usize,
    per_device: usize,
    args: &BenchArgs,
) -> Result<()> {
    let user = user_memory_limit(args.max_memory.as_deref())?;
    let Some(limit) = memory_limit(be, user) else {
        return Ok(());
    };
    for &len in contexts {
        let widest = widest(config, len, ranks);
        let rows = rank_rows(config, len, ranks, args);
        let facts = be.memory_facts(config, rows);
        let plan = MemoryPlan::new(config, len + args.decode_tokens, rows, &facts);
        let kept = range_bytes(config, widest, facts.value_bytes);
        let need = (plan.total() + kept) * per_device;
        if need > limit.bytes {
            bail!(
                "--context-parallel {ranks} at {len} tokens: {per_device} ranks on one device \
                 need {:.2} GiB ({:.2} GiB each: {}, its range's buffers {:.2} GiB), {:.2} GiB \
                 allowed ({})",
                need as f64 / GIB,
                (plan.total() + kept) as f64 / GIB,
                plan.describe(),
                kept as f64 / GIB,
                limit.bytes as f64 / GIB,
                limit.source
            );
        }
    }
    Ok(())
}
