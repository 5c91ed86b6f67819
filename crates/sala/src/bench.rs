//! `sala bench`: time-to-first-token, prefill and decode speed, and peak device memory at
//! given context lengths, each with its ratio to the hardware floor (PERF.md), next to the
//! memory plan, as a table and as JSON; optionally the same on the all-dense variant of the
//! same size, with the TTFT ratio.

use crate::device::{cap_caches, memory_limit, user_memory_limit, DeviceArgs, DeviceStats};
use anyhow::{bail, Context, Result};
use clap::Args;
use sala_checkpoint::{expected_parameter_count, preset, ModelConfig};
use sala_model::memory::{MemoryLimit, MemoryPlan};
use sala_model::numerics::TestRng;
use sala_model::{Backend, LogitRows, Model, StepInput};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

mod concurrent;
mod context;
mod floors;
mod follow_up;
mod ops;
mod speculative;
use concurrent::concurrent;
pub use floors::{all_dense, decode_bytes, prefill_flops};
use ops::{lightning_op, sparse_op};
use speculative::{speculative, BenchDrafts};

#[derive(Args)]
pub struct BenchArgs {
    /// Named configuration with random weights made on the device.
    #[arg(long, default_value = "minicpm-sala-9b")]
    preset: String,
    /// A config.json to use instead of a preset (random weights).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The weights' format: `bf16`, `fp8` (the decoder linears in FP8, as `--quantize fp8`),
    /// or `w4` / `w4:G` (4-bit, groups of 128 or G inputs, the linear layers); random values.
    #[arg(long, default_value = "bf16")]
    weights: String,
    /// Context lengths (prompt tokens), comma-separated; K and M suffixes allowed.
    #[arg(long, default_value = "4K", value_delimiter = ',')]
    context: Vec<String>,
    /// Tokens decoded after each prefill.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    #[command(flatten)]
    device: DeviceArgs,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// GEMM ceiling for the prefill floor, TFLOP/s (H200, cuBLAS bf16, measured: 805).
    #[arg(long, default_value_t = 805.0)]
    gemm_tflops: f64,
    /// Memory bandwidth for the decode floor, TB/s (H200 device copy, measured: 4.3).
    #[arg(long, default_value_t = 4.3)]
    bandwidth_tbs: f64,
    /// Refuse to run when a context's memory plan exceeds SIZE (e.g. 30G, 30GiB, 28000M;
    /// powers of 1024). On a GPU its total memory is a limit anyway.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    /// Bench the all-dense variant of the config instead: every layer softmax attention.
    #[arg(long)]
    all_dense: bool,
    /// After the run, run the same contexts on the all-dense variant and print the TTFT
    /// ratio dense/SALA (contexts whose dense plan does not fit are reported, not run).
    #[arg(long)]
    compare_dense: bool,
    /// With --compare-dense or --all-dense: stop an all-dense prefill once it has run SECONDS
    /// (checked after each chunk); its TTFT is then a lower bound, shown as ">=", and its
    /// decode is not run.
    #[arg(long, value_name = "SECONDS")]
    dense_time_limit: Option<f64>,
    /// Time one op alone instead of the model: `lightning` (the lightning layer's prefill
    /// over each context, in chunks of --prefill-chunk, the config's heads and head size) or
    /// `sparse` (a sparse layer's attention, block selection included, for the last chunk of
    /// --prefill-chunk queries of each context over random keys; its useful FLOPs and bytes,
    /// and with SALA_PROFILE=1 the TFLOP/s of selection and attention apart).
    #[arg(long, value_name = "OP")]
    kernel: Option<String>,
    /// With --kernel sparse: each query is its own random vector plus F times one random
    /// vector all share, so neighbouring queries select more of the same blocks, as real
    /// attention does (0, the default: independent queries, as random weights give).
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    locality: f32,
    /// Timed repetitions per context with --kernel (the median is reported).
    #[arg(long, default_value_t = 10)]
    repeat: usize,
    /// Decode only: instead of prefilling each context, fill the caches with random keys,
    /// values and lightning states made on the device (decode speed at long contexts in
    /// seconds; TTFT and prefill speed are not measured).
    #[arg(long)]
    random_context: bool,
    /// After each context's decode: the time of verification steps of each of these span
    /// lengths (the token fed and N - 1 drafts, all logits kept, the sequence rewound after
    /// each step as when every draft is rejected), against a decode step: what speculative
    /// decoding pays to verify.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    verify_spans: Vec<usize>,
    /// Throughput of N requests (prompts of the first --context, --decode-tokens each, greedy):
    /// one after another, then all at once through the server's continuous batch.
    #[arg(long, value_name = "N")]
    concurrent: Option<usize>,
    /// With --concurrent: the batched run alone, without the one-after-another baseline.
    #[arg(long, requires = "concurrent")]
    batched_only: bool,
    /// Speculative decoding of one request through the engine (greedy, --decode-tokens after
    /// a random prompt of each --context), against plain decoding, with each of these draft
    /// sources: `ngram` or `ngram:N` (prompt lookup, up to 4 or N tokens), `oracle:R/K`
    /// (drafts of K tokens from the plain run's own continuation, the first R right: the
    /// engine's speed at an accepted length of R). With --concurrent: the batch's decode steps
    /// speculating, against the plain batch's.
    #[arg(long, value_name = "DRAFTS,...", value_delimiter = ',')]
    speculative: Vec<String>,
    /// The prefix cache's case: for each --context, a document with a 64-token question, then
    /// the same document with another: both times to first token and the cache's memory; then
    /// 8 prompts sharing nothing, with the cache off and on.
    #[arg(long)]
    follow_up: bool,
}

fn parse_len(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1024),
        Some('M' | 'm') => (&s[..s.len() - 1], 1024 * 1024),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .with_context(|| format!("--context {s}: expected a number such as 4096, 32K or 1M"))?;
    if n == 0 {
        bail!("--context {s}: must be at least 1");
    }
    Ok(n * mul)
}

#[derive(serde::Serialize)]
struct Row {
    context: usize,
    /// None with --random-context (no prefill).
    ttft_s: Option<f64>,
    prefill_tok_s: Option<f64>,
    prefill_floor_tok_s: f64,
    /// The prefill stopped at --dense-time-limit: `ttft_s` is a lower bound.
    ttft_is_lower_bound: bool,
    /// Prompt tokens prefilled (fewer than `context` when stopped early).
    prefilled_tokens: usize,
    /// None when the prefill was stopped early.
    decode_tok_s: Option<f64>,
    decode_floor_tok_s: f64,
    peak_memory_bytes: Option<usize>,
    plan_total_bytes: usize,
    /// The memory plan of `context + decode_tokens` tokens.
    plan: MemoryPlan,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let config = match &args.config {
        Some(p) => ModelConfig::from_file(p)?,
        None => preset(&args.preset)?,
    };
    let mut config = config;
    args.device.choices()?.apply(&mut config);
    if args.weights == "fp8" {
        config.fp8_weights = true;
    }
    config.quantization = match args.weights.split_once(':') {
        None if args.weights == "bf16" || args.weights == "fp8" => None,
        None if args.weights == "w4" => Some(128),
        Some(("w4", g)) => match g.parse::<usize>() {
            Ok(g) if g > 0 && g % 8 == 0 => Some(g),
            _ => bail!(
                "--weights {}: w4:G takes a group G that is a multiple of 8",
                args.weights
            ),
        },
        _ => bail!("--weights {}: expected bf16, fp8, w4 or w4:G", args.weights),
    }
    .map(|g| sala_checkpoint::quant::Gptq {
        group_size: Some(g),
        sym: true,
        zero_minus_one: true,
        skip: Vec::new(),
    });
    let contexts = args
        .context
        .iter()
        .map(|s| parse_len(s))
        .collect::<Result<Vec<_>>>()?;
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    if args
        .dense_time_limit
        .is_some_and(|t| t.is_nan() || t <= 0.0)
    {
        bail!("--dense-time-limit must be a positive number of seconds");
    }
    if args.random_context && (args.compare_dense || args.dense_time_limit.is_some()) {
        bail!("--random-context measures decode only: it has no TTFT to compare with all-dense");
    }
    if args.all_dense && args.compare_dense {
        bail!("--all-dense with --compare-dense would compare the all-dense model with itself");
    }
    if let Some(&n) = args.verify_spans.iter().find(|&&n| !(1..=64).contains(&n)) {
        bail!("--verify-spans {n}: a verification span holds 1 to 64 rows");
    }
    if let Some(op) = &args.kernel {
        if op != "lightning" && op != "sparse" {
            bail!("--kernel {op}: the ops that can be timed alone are: lightning, sparse");
        }
        if args.repeat == 0 {
            bail!("--repeat must be at least 1");
        }
        let opened = args.device.open(|| Ok(config.clone()))?;
        let rows = crate::on_backend!(opened, be => match op.as_str() {
            "lightning" => lightning_op(&be, &config, &contexts, &args),
            _ => sparse_op(&be, &config, &contexts, &args),
        })?;
        if let Some(path) = &args.json {
            std::fs::write(
                path,
                serde_json::to_string_pretty(&json!({ "op": op, "results": rows }))?,
            )
            .with_context(|| format!("writing {}", path.display()))?;
        }
        return Ok(());
    }
    let modes = args
        .speculative
        .iter()
        .map(|s| BenchDrafts::parse(s))
        .collect::<Result<Vec<_>>>()?;
    if !modes.is_empty() && args.concurrent.is_none() {
        let opened = args.device.open(|| Ok(config.clone()))?;
        let doc =
            crate::on_backend!(opened, be => speculative(be, &config, &contexts, &modes, &args))?;
        return write_json(&args.json, &doc);
    }
    // --context-parallel N: each context read by N ranks at once, against one rank.
    let n = args.device.context_parallel;
    if n == 0 {
        bail!("--context-parallel must be at least 1");
    }
    if n > 1 {
        let doc = context::context_parallel(n, &config, &contexts, &args)?;
        return write_json(&args.json, &doc);
    }
    if args.follow_up {
        let opened = args.device.open(|| Ok(config.clone()))?;
        let doc =
            crate::on_backend!(opened, be => follow_up::follow_up(be, &config, &contexts, &args))?;
        return write_json(&args.json, &doc);
    }
    if let Some(n) = args.concurrent {
        if n == 0 || args.decode_tokens == 0 {
            bail!("--concurrent and --decode-tokens must be at least 1");
        }
        let len = contexts[0];
        let opened = args.device.open(|| Ok(config.clone()))?;
        let doc = crate::on_backend!(opened, be => concurrent(be, &config, len, n, &modes, &args))?;
        return write_json(&args.json, &doc);
    }
    let user_limit = user_memory_limit(args.max_memory.as_deref())?;
    let opened = args.device.open(|| Ok(config.clone()))?;
    crate::on_backend!(opened, be => bench_on(&be, &args, config, &contexts, user_limit))
}

/// Writes `doc` to `path` (`--json`), when given.
fn write_json(path: &Option<PathBuf>, doc: &Value) -> Result<()> {
    if let Some(path) = path {
        std::fs::write(path, serde_json::to_string_pretty(doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn bench_on<B: Backend + DeviceStats>(
    be: &B,
    args: &BenchArgs,
    config: ModelConfig,
    contexts: &[usize],
    user_limit: Option<MemoryLimit>,
) -> Result<()> {
    let name = args
        .config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| args.preset.clone());
    let max_ctx = contexts.iter().copied().max().unwrap_or(1);
    let chunk = args.prefill_chunk.min(max_ctx);
    let longest = max_ctx + args.decode_tokens;
    let limit = memory_limit(be, user_limit);
    let plan = |c: &ModelConfig, len: usize| {
        MemoryPlan::new(
            c,
            len + args.decode_tokens,
            chunk,
            &be.memory_facts(c, chunk),
        )
    };
    let (config, name) = if args.all_dense {
        (
            all_dense(&config, longest)?,
            format!("{name}, all-dense variant"),
        )
    } else {
        (config, name)
    };
    // Every context must fit before any work.
    if let Some(limit) = &limit {
        for &len in contexts {
            plan(&config, len).check(limit)?;
        }
    }
    let params = expected_parameter_count(&config);
    let dense = if args.compare_dense {
        Some(all_dense(&config, longest)?)
    } else {
        None
    };
    eprintln!(
        "bench: {name} ({} parameters{}) with random {} weights and a {} K/V cache on {}",
        crate::human_count(params as f64),
        dense.as_ref().map_or(String::new(), |d| format!(
            "; all-dense variant: {}",
            crate::human_count(expected_parameter_count(d) as f64)
        )),
        args.weights,
        config.sparse.kv_cache.name(),
        be.name()
    );
    let own_limit = args.dense_time_limit.filter(|_| args.all_dense);
    cap_caches(be, limit.as_ref(), &plan(&config, max_ctx));
    let rows = measure(be, args, &config, contexts, chunk, &plan, own_limit)?;
    if dense.is_some() {
        println!("{name}:");
    }
    print_rows(&rows);

    let mut results: Vec<Value> = rows
        .iter()
        .map(serde_json::to_value)
        .collect::<Result<_, _>>()?;
    let mut dense_doc = Value::Null;
    if let Some(dense) = &dense {
        // The SALA model is dropped by now (`measure` owned it), so its memory is free.
        let misfit = |len: usize| limit.as_ref().and_then(|l| plan(dense, len).check(l).err());
        let fitting: Vec<usize> = contexts
            .iter()
            .copied()
            .filter(|&len| misfit(len).is_none())
            .collect();
        let dense_rows = if fitting.is_empty() {
            Vec::new()
        } else {
            eprintln!("bench: the all-dense variant");
            cap_caches(be, limit.as_ref(), &plan(dense, max_ctx));
            measure(
                be,
                args,
                dense,
                &fitting,
                chunk,
                &plan,
                args.dense_time_limit,
            )?
        };
        if !dense_rows.is_empty() {
            println!("all-dense variant:");
            print_rows(&dense_rows);
        }
        println!(
            "{:>9} {:>14} {:>14} {:>11}",
            "context", "TTFT s, dense", "TTFT s, SALA", "dense/SALA"
        );
        let mut dense_results = Vec::new();
        for (r, doc) in rows.iter().zip(results.iter_mut()) {
            match dense_rows.iter().find(|d| d.context == r.context) {
                Some(d) => {
                    let (Some(d_ttft), Some(r_ttft)) = (d.ttft_s, r.ttft_s) else {
                        bail!("context {}: no TTFT to compare", r.context);
                    };
                    let ratio = d_ttft / r_ttft;
                    let at_least = if d.ttft_is_lower_bound { ">=" } else { "" };
                    println!(
                        "{:>9} {:>14} {:>14.3} {:>10}",
                        r.context,
                        format!("{at_least}{d_ttft:.3}"),
                        r_ttft,
                        format!("{at_least}{ratio:.2}x")
                    );
                    doc["dense_ttft_s"] = json!(d_ttft);
                    doc["dense_ttft_is_lower_bound"] = json!(d.ttft_is_lower_bound);
                    doc["ttft_ratio_dense_over_sala"] = json!(ratio);
                    let mut v = serde_json::to_value(d)?;
                    v["fits"] = json!(true);
                    dense_results.push(v);
                }
                None => {
                    let e = misfit(r.context)
                        .context("a dense context neither ran nor failed its plan")?;
                    println!(
                        "{:>9} does not fit: needs {:.2} GiB, {:.2} GiB allowed ({}; {} > {} bytes)",
                        r.context,
                        gib(e.plan.total()),
                        gib(e.limit.bytes),
                        e.limit.source,
                        e.plan.total(),
                        e.limit.bytes
                    );
                    doc["dense_ttft_s"] = Value::Null;
                    doc["ttft_ratio_dense_over_sala"] = Value::Null;
                    dense_results.push(json!({
                        "context": r.context,
                        "fits": false,
                        "plan_total_bytes": e.plan.total(),
                        "plan": e.plan,
                    }));
                }
            }
        }
        dense_doc = json!({
            "parameters": expected_parameter_count(dense),
            "results": dense_results,
        });
    }
    if let Some(path) = &args.json {
        let mut doc = json!({
            "model": name,
            "device": be.name(),
            "parameters": params,
            "total_memory_bytes": be.total_memory(),
            "memory_limit_bytes": limit.as_ref().map(|l| l.bytes),
            "decode_tokens": args.decode_tokens,
            "prefill_chunk": args.prefill_chunk,
            "gemm_tflops_ceiling": args.gemm_tflops,
            "bandwidth_tbs_ceiling": args.bandwidth_tbs,
            "results": results,
        });
        if !dense_doc.is_null() {
            doc["dense"] = dense_doc;
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Makes a model of `config` with random weights, warms it up, and measures each context;
/// the model is dropped on return. A prefill still running after `time_limit` seconds stops
/// there (its row's TTFT is then a lower bound, with no decode).
fn measure<B: Backend + DeviceStats>(
    be: &B,
    args: &BenchArgs,
    config: &ModelConfig,
    contexts: &[usize],
    chunk: usize,
    plan: &dyn Fn(&ModelConfig, usize) -> MemoryPlan,
    time_limit: Option<f64>,
) -> Result<Vec<Row>> {
    let load_start = Instant::now();
    let model = Model::random(be, config.clone(), args.seed, &mut |_, _| {})?;
    let max_ctx = contexts.iter().copied().max().unwrap_or(1);
    let mut ws = model.workspace(be, chunk)?;
    let mut rng = TestRng::new(args.seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..max_ctx + args.decode_tokens)
        .map(|_| rng.below(config.vocab_size) as u32)
        .collect();
    // Warm-up: kernel loading and GEMM plans for the chunk shapes used below.
    {
        let mut seq = model.new_sequence(be)?;
        let warm = chunk.min(max_ctx);
        model.reserve(be, &mut seq, warm + 1)?;
        model.prefill(be, &mut ws, &mut seq, &tokens[..warm], &mut |_| {})?;
        model.decode(be, &mut ws, &mut seq, tokens[warm])?;
    }
    be.profile();
    eprintln!(
        "weights made and warmed up in {:.1} s",
        load_start.elapsed().as_secs_f64()
    );

    let argmax = |l: &[f32]| {
        (0..l.len())
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
            .unwrap_or(0) as u32
    };
    let mut rows = Vec::new();
    for &len in contexts {
        // TTFT includes taking the sequence's caches, once, for all its tokens.
        let start = Instant::now();
        let mut seq = model.new_sequence(be)?;
        model.reserve(be, &mut seq, len + args.decode_tokens)?;
        // Sampled after every prefill chunk and after decode: the peak of the whole run.
        let mut peak = be.memory_in_use();
        let mode = model.sparse_mode(len);
        let mut logits = Vec::new();
        let mut done = 0;
        if args.random_context {
            // Random caches for all but the prompt's last token, which one decode step feeds
            // (its logits stand in for the prefill's; its time is not counted).
            model.fill_random_context(be, &mut seq, len - 1, args.decode_tokens + 1, args.seed)?;
            logits = model.decode(be, &mut ws, &mut seq, tokens[len - 1])?;
            done = len;
            peak = peak.max(be.memory_in_use());
        }
        for piece in tokens[done..len].chunks(chunk) {
            let last = done + piece.len() == len;
            let logit_rows = if last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            logits = model.forward_one(be, &mut ws, &mut seq, piece, mode, logit_rows)?;
            done += piece.len();
            peak = peak.max(be.memory_in_use());
            if let Some(limit) = time_limit.filter(|_| !last) {
                be.synchronize()?;
                if start.elapsed().as_secs_f64() > limit {
                    break;
                }
            }
        }
        let ttft = start.elapsed().as_secs_f64();
        let plan = plan(config, len);
        let prefill_floor_tok_s =
            len as f64 / (prefill_flops(config, len) / (args.gemm_tflops * 1e12));
        if done < len {
            print_profile(be, &format!("first {done} tokens of a prefill of {len}"));
            eprintln!(
                "context {len}: stopped after {done} tokens and {ttft:.1} s (--dense-time-limit)"
            );
            rows.push(Row {
                context: len,
                ttft_s: Some(ttft),
                prefill_tok_s: Some(done as f64 / ttft),
                prefill_floor_tok_s,
                ttft_is_lower_bound: true,
                prefilled_tokens: done,
                decode_tok_s: None,
                decode_floor_tok_s: args.bandwidth_tbs * 1e12 / decode_bytes(config, len),
                peak_memory_bytes: peak,
                plan_total_bytes: plan.total(),
                plan,
            });
            continue;
        }
        let mut next = argmax(&logits);
        print_profile(be, &format!("prefill of {len}"));
        // The decode steps alone are what `ncu --profile-from-start off` records.
        be.profiler_range(true)?;
        let waited_before = be.host_wait();
        let start = Instant::now();
        // Greedy, as the engine decodes a greedy request: the pick made on the device, each
        // step queued before the last one's pick reaches the host where the backend can.
        if be.runs_ahead() {
            for step in 0..args.decode_tokens {
                let input = StepInput {
                    mode: model.sparse_mode(seq.pos + 1),
                    seq: &mut seq,
                    tokens: &[next],
                    logits: LogitRows::Greedy,
                };
                model.forward_ahead(be, &mut ws, &mut [input], step > 0)?;
                if step > 0 {
                    next = model.take_picks(be)?[0].id.unwrap_or(0);
                }
            }
            if args.decode_tokens > 0 {
                next = model.take_picks(be)?[0].id.unwrap_or(0);
            }
        } else {
            for _ in 0..args.decode_tokens {
                next = model
                    .decode_greedy(be, &mut ws, &mut seq, next)?
                    .id
                    .unwrap_or(0);
            }
        }
        let decode = start.elapsed().as_secs_f64();
        be.profiler_range(false)?;
        if let (Some(a), Some(b)) = (waited_before, be.host_wait()) {
            let steps = args.decode_tokens.max(1) as f64;
            eprintln!(
                "context {len}: decode step {:.2} ms, of which the host waited {:.2} ms for the device",
                1e3 * decode / steps,
                1e3 * (b - a).as_secs_f64() / steps
            );
        }
        let step_ms = 1e3 * decode / args.decode_tokens.max(1) as f64;
        for &n in &args.verify_spans {
            let ms = verify_span_ms(
                be,
                &model,
                &mut ws,
                &mut seq,
                n,
                args.decode_tokens,
                &tokens,
            )?;
            println!(
                "context {len}: verifying a span of {n} takes {ms:.3} ms, {:.2}x a decode step",
                ms / step_ms
            );
        }
        peak = peak.max(be.memory_in_use());
        if let Some((in_use, page)) = be.page_pool() {
            eprintln!(
                "context {len}: the page pool maps {in_use} pages of {} MiB ({:.2} GiB)",
                page >> 20,
                (in_use * page) as f64 / (1u64 << 30) as f64
            );
        }
        print_profile(be, &format!("{} decode steps at {len}", args.decode_tokens));
        rows.push(Row {
            context: len,
            ttft_s: (!args.random_context).then_some(ttft),
            prefill_tok_s: (!args.random_context).then_some(len as f64 / ttft),
            prefill_floor_tok_s,
            ttft_is_lower_bound: false,
            prefilled_tokens: len,
            decode_tok_s: Some(args.decode_tokens as f64 / decode),
            decode_floor_tok_s: args.bandwidth_tbs * 1e12 / decode_bytes(config, len),
            peak_memory_bytes: peak,
            plan_total_bytes: plan.total(),
            plan,
        });
    }
    Ok(rows)
}

/// Milliseconds a verification step of `n` rows takes at `seq`'s position (mean of `steps`):
/// `n` tokens fed with every row's logits kept, then the sequence rewound to where it was.
fn verify_span_ms<B: Backend + DeviceStats>(
    be: &B,
    model: &Model<B>,
    ws: &mut sala_model::Workspace<B>,
    seq: &mut sala_model::SeqState<B>,
    n: usize,
    steps: usize,
    tokens: &[u32],
) -> Result<f64> {
    if n == 0 || n > ws.max_rows {
        bail!(
            "--verify-spans {n}: a span holds 1 to {} rows (the step's workspace)",
            ws.max_rows
        );
    }
    let span = &tokens[..n];
    let mode = model.sparse_mode(seq.pos + n);
    be.synchronize()?;
    let start = Instant::now();
    let mut spare = None;
    for _ in 0..steps.max(1) {
        let mark = model.mark_with(be, seq, spare.take())?;
        model.forward_one(be, ws, seq, span, mode, LogitRows::All)?;
        model.rewind(be, seq, &mark)?;
        spare = Some(mark);
    }
    be.synchronize()?;
    Ok(1e3 * start.elapsed().as_secs_f64() / steps.max(1) as f64)
}

/// The speed table, with the plan's total beside the measured peak, then the plan's terms.
fn print_rows(rows: &[Row]) {
    let peak = |r: &Row| {
        r.peak_memory_bytes
            .map_or("n/a".into(), |b| format!("{:.2}", gib(b)))
    };
    println!(
        "{:>9} {:>9} {:>13} {:>8} {:>12} {:>8} {:>10} {:>10}",
        "context",
        "TTFT s",
        "prefill tok/s",
        "of floor",
        "decode tok/s",
        "of floor",
        "peak GiB",
        "plan GiB"
    );
    for r in rows {
        let at_least = if r.ttft_is_lower_bound { ">=" } else { "" };
        let (ttft, prefill, prefill_of_floor) = match (r.ttft_s, r.prefill_tok_s) {
            (Some(t), Some(p)) => (
                format!("{at_least}{t:.3}"),
                format!("{p:.0}"),
                format!("{:.0}%", 100.0 * p / r.prefill_floor_tok_s),
            ),
            _ => ("random".into(), "n/a".into(), "".into()),
        };
        let (decode, of_floor) = match r.decode_tok_s {
            Some(d) => (
                format!("{d:.1}"),
                format!("{:.0}%", 100.0 * d / r.decode_floor_tok_s),
            ),
            None => ("not run".into(), "".into()),
        };
        println!(
            "{:>9} {:>9} {:>13} {:>8} {:>12} {:>8} {:>10} {:>10.2}",
            r.context,
            ttft,
            prefill,
            prefill_of_floor,
            decode,
            of_floor,
            peak(r),
            gib(r.plan.total())
        );
    }
    println!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}   (memory plan, GiB)",
        "context", "weights", "caches", "workspace", "backend", "total", "peak"
    );
    for r in rows {
        let p = &r.plan;
        println!(
            "{:>9} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>10}",
            r.context,
            gib(p.weights),
            gib(p.cache.total()),
            gib(p.workspace),
            gib(p.scratch + p.runtime),
            gib(p.total()),
            peak(r)
        );
    }
}

/// Prints the per-kernel device time since the last call (with `SALA_PROFILE=1`).
fn print_profile<B: DeviceStats>(be: &B, what: &str) {
    let Some(rows) = be.profile() else { return };
    let total: f64 = rows.iter().map(|r| r.1).sum();
    eprintln!("profile, {what}: {total:.1} ms of kernel time");
    for (name, ms, n) in rows.iter().take(24) {
        eprintln!(
            "{ms:>10.2} ms {:>5.1}% {n:>7}x  {name}",
            100.0 * ms / total.max(1e-9)
        );
    }
}

/// An engine over the config with random weights (`args.seed`) and a test tokenizer, which
/// lives in the returned folder.
fn random_engine<B: Backend>(
    be: B,
    config: &ModelConfig,
    args: &BenchArgs,
) -> Result<(sala_engine::generate::Engine<B>, tempfile::TempDir)> {
    let model = Model::random(&be, config.clone(), args.seed, &mut |_, _| {})?;
    let tmp = tempfile::tempdir()?;
    sala_tokenizer::write_test_tokenizer(tmp.path(), config.vocab_size)?;
    let tokenizer = sala_tokenizer::Tokenizer::from_dir(tmp.path())?;
    let engine = sala_engine::generate::Engine::from_model(
        be,
        model,
        tokenizer,
        tmp.path(),
        args.prefill_chunk,
    )?;
    Ok((engine, tmp))
}

/// Greedy generation of `--decode-tokens` tokens (EOS ignored) after prompts of up to `longest`.
fn greedy_options(args: &BenchArgs, longest: usize) -> sala_engine::generate::GenerateOptions {
    sala_engine::generate::GenerateOptions {
        sampling: sala_engine::sampling::SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens: args.decode_tokens,
        max_context: longest + args.decode_tokens + 1,
        stop: Vec::new(),
        eos_ids: Vec::new(),
        grammar: None,
        prompt_logprobs: None,
        speculate: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_lengths_read_with_k_and_m() {
        assert_eq!(parse_len("32K").unwrap(), 32768);
        assert_eq!(parse_len("1M").unwrap(), 1 << 20);
        assert!(parse_len("abc").is_err() && parse_len("0").is_err());
    }
}
