//! `sala bench`: time-to-first-token, prefill and decode speed, and peak device memory at
//! given context lengths, each with its ratio to the hardware floor (PERF.md), as a table and
//! as JSON.

use crate::device::{Device, DeviceStats, Opened};
use anyhow::{bail, Context, Result};
use clap::Args;
use sala_checkpoint::{preset, MixerKind, ModelConfig};
use sala_model::memory::cache_bytes;
use sala_model::numerics::TestRng;
use sala_model::{Backend, Model};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct BenchArgs {
    /// Named configuration with random weights made on the device.
    #[arg(long, default_value = "minicpm-sala-9b")]
    preset: String,
    /// A config.json to use instead of a preset (random weights).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Context lengths (prompt tokens), comma-separated; K and M suffixes allowed.
    #[arg(long, default_value = "4K", value_delimiter = ',')]
    context: Vec<String>,
    /// Tokens decoded after each prefill.
    #[arg(long, default_value_t = 32)]
    decode_tokens: usize,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    #[arg(long, default_value = "auto")]
    device: String,
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

/// FLOPs of a prefill of `len` tokens from an empty sequence: matrix products of every layer
/// for every token, the LM head for the last, and attention.
pub fn prefill_flops(c: &ModelConfig, len: usize) -> f64 {
    let per_token_params = (sala_checkpoint::expected_parameter_count(c) as f64)
        - (c.vocab_size * c.hidden_size) as f64 * if c.tie_word_embeddings { 1.0 } else { 2.0 };
    let heads = c.num_attention_heads as f64;
    let d = c.head_dim as f64;
    let s = &c.sparse;
    let sparse = len >= s.dense_len;
    let cap = (s.selected_blocks() * s.block_size) as f64;
    let mut attn = 0.0;
    for t in 0..len {
        let keys = (t + 1) as f64;
        let keys = if sparse { keys.min(cap) } else { keys };
        attn += 4.0 * d * heads * keys;
        if sparse && t / s.block_size >= s.selected_blocks() {
            let w1 = (t + 1).saturating_sub(s.k1_window()) / s.k1_stride() + 1;
            let w2 = (t + 1).saturating_sub(s.k2_window()) / s.k2_stride() + 1;
            attn += 2.0 * d * heads * (w1 + w2) as f64;
        }
    }
    let lightning = 6.0 * d * d * heads * len as f64; // inter-chunk, state update, intra-chunk
    2.0 * per_token_params * len as f64
        + 2.0 * (c.vocab_size * c.hidden_size) as f64
        + c.layer_count(MixerKind::Sparse) as f64 * attn
        + c.layer_count(MixerKind::Lightning) as f64 * lightning
}

/// Bytes one decode step must move at `context` tokens: every weight but the embedding table,
/// the lightning states (read and written), and the sparse layers' attended keys and values
/// plus the compressed keys they score.
pub fn decode_bytes(c: &ModelConfig, context: usize) -> f64 {
    let weights = 2.0
        * (sala_checkpoint::expected_parameter_count(c) as f64
            - (c.vocab_size * c.hidden_size) as f64);
    let m = cache_bytes(c, context);
    let s = &c.sparse;
    let attended = if context >= s.dense_len {
        context.min(s.selected_blocks() * s.block_size)
    } else {
        context
    };
    let kv = cache_bytes(c, attended).kv as f64;
    let scored = if context >= s.dense_len {
        m.compressed as f64
    } else {
        0.0
    };
    weights + 2.0 * m.lightning_state as f64 + kv + scored
}

#[derive(serde::Serialize)]
struct Row {
    context: usize,
    ttft_s: f64,
    prefill_tok_s: f64,
    prefill_floor_tok_s: f64,
    decode_tok_s: f64,
    decode_floor_tok_s: f64,
    peak_memory_bytes: Option<usize>,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let config = match &args.config {
        Some(p) => ModelConfig::from_file(p)?,
        None => preset(&args.preset)?,
    };
    let contexts = args
        .context
        .iter()
        .map(|s| parse_len(s))
        .collect::<Result<Vec<_>>>()?;
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    match Device::parse(&args.device)?.open()? {
        Opened::Cpu(be) => bench_on(&be, &args, config, &contexts),
        Opened::Cuda(be) => bench_on(be.as_ref(), &args, config, &contexts),
    }
}

fn bench_on<B: Backend + DeviceStats>(
    be: &B,
    args: &BenchArgs,
    config: ModelConfig,
    contexts: &[usize],
) -> Result<()> {
    let name = args
        .config
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| args.preset.clone());
    eprintln!("bench: {name} with random weights on {}", be.name());
    let load_start = Instant::now();
    let model = Model::random(be, config.clone(), args.seed, &mut |_, _| {})?;
    let max_ctx = contexts.iter().copied().max().unwrap_or(1);
    let mut ws = model.workspace(be, args.prefill_chunk.min(max_ctx))?;
    let mut rng = TestRng::new(args.seed ^ 0x5eed);
    let tokens: Vec<u32> = (0..max_ctx + args.decode_tokens)
        .map(|_| rng.below(config.vocab_size) as u32)
        .collect();
    // Warm-up: kernel loading and GEMM plans for the chunk shapes used below.
    {
        let mut seq = model.new_sequence(be)?;
        let warm = args.prefill_chunk.min(max_ctx);
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
        let mut seq = model.new_sequence(be)?;
        let mut peak = be.memory_in_use();
        let start = Instant::now();
        let mut logits = model.prefill(be, &mut ws, &mut seq, &tokens[..len], &mut |_| {})?;
        let mut next = argmax(&logits);
        let ttft = start.elapsed().as_secs_f64();
        peak = peak.max(be.memory_in_use());
        print_profile(be, &format!("prefill of {len}"));
        let waited_before = be.host_wait();
        let start = Instant::now();
        for _ in 0..args.decode_tokens {
            logits = model.decode(be, &mut ws, &mut seq, next)?;
            next = argmax(&logits);
        }
        let decode = start.elapsed().as_secs_f64();
        if let (Some(a), Some(b)) = (waited_before, be.host_wait()) {
            let steps = args.decode_tokens.max(1) as f64;
            eprintln!(
                "context {len}: decode step {:.2} ms, of which the host waited {:.2} ms for the device",
                1e3 * decode / steps,
                1e3 * (b - a).as_secs_f64() / steps
            );
        }
        peak = peak.max(be.memory_in_use());
        print_profile(be, &format!("{} decode steps at {len}", args.decode_tokens));
        rows.push(Row {
            context: len,
            ttft_s: ttft,
            prefill_tok_s: len as f64 / ttft,
            prefill_floor_tok_s: len as f64
                / (prefill_flops(&config, len) / (args.gemm_tflops * 1e12)),
            decode_tok_s: args.decode_tokens as f64 / decode,
            decode_floor_tok_s: args.bandwidth_tbs * 1e12 / decode_bytes(&config, len),
            peak_memory_bytes: peak,
        });
    }

    println!(
        "{:>9} {:>9} {:>13} {:>8} {:>12} {:>8} {:>10}",
        "context", "TTFT s", "prefill tok/s", "of floor", "decode tok/s", "of floor", "peak GiB"
    );
    for r in &rows {
        println!(
            "{:>9} {:>9.3} {:>13.0} {:>7.0}% {:>12.1} {:>7.0}% {:>10}",
            r.context,
            r.ttft_s,
            r.prefill_tok_s,
            100.0 * r.prefill_tok_s / r.prefill_floor_tok_s,
            r.decode_tok_s,
            100.0 * r.decode_tok_s / r.decode_floor_tok_s,
            r.peak_memory_bytes.map_or("n/a".into(), |b| format!(
                "{:.2}",
                b as f64 / (1u64 << 30) as f64
            ))
        );
    }
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "model": name,
            "device": be.name(),
            "total_memory_bytes": be.total_memory(),
            "decode_tokens": args.decode_tokens,
            "prefill_chunk": args.prefill_chunk,
            "gemm_tflops_ceiling": args.gemm_tflops,
            "bandwidth_tbs_ceiling": args.bandwidth_tbs,
            "results": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floors_of_the_released_shape_match_perf_md() {
        let c = preset("minicpm-sala-9b").unwrap();
        // PERF.md: ~17.8 GFLOP per token in the projections and MLPs.
        let per_token = prefill_flops(&c, 1024) / 1024.0;
        assert!((17.5e9..19.0e9).contains(&per_token), "{per_token}");
        // PERF.md: a step reads ~18.95 GB of weights (less the embedding table here).
        let bytes = decode_bytes(&c, 4096);
        assert!((18.0e9..19.0e9).contains(&bytes), "{bytes}");
        assert!(decode_bytes(&c, 1 << 20) > bytes);
        assert_eq!(parse_len("32K").unwrap(), 32768);
        assert_eq!(parse_len("1M").unwrap(), 1 << 20);
        assert!(parse_len("abc").is_err() && parse_len("0").is_err());
    }
}
