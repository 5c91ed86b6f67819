//! `sala compare A B`: how far model B's logits are from model A's (a quantized checkpoint
//! against its bf16 source, one backend against another), teacher-forced on A's own greedy
//! continuations of seeded random prompts: per position the relative L2 error of the logits,
//! KL(A ‖ B) of the next-token distributions and whether the greedy tokens agree; and how many
//! greedy continuations come out the same.

use crate::device::{DeviceArgs, RunChoices};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use sala_checkpoint::{Checkpoint, KvCacheDtype};
use sala_engine::generate::load_model;
use sala_model::numerics::TestRng;
use sala_model::{Backend, LogitRows, Model};
use serde_json::json;
use std::path::PathBuf;

#[derive(Args)]
pub struct CompareArgs {
    /// The reference checkpoint.
    a: PathBuf,
    /// The checkpoint compared with it (same vocabulary).
    b: PathBuf,
    /// Random prompts.
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    /// Tokens in each prompt.
    #[arg(long, default_value_t = 64)]
    len: usize,
    /// Greedy tokens of A's continuation each prompt is followed by (teacher-forced to B).
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object on standard output.
    #[arg(long)]
    json: bool,
    /// B's K/V cache dtype when it differs from A's (`--kv-cache-dtype`): the same checkpoint
    /// twice with `--b-kv-cache-dtype fp8` measures what an FP8 cache costs.
    #[arg(long, value_name = "DTYPE")]
    b_kv_cache_dtype: Option<String>,
    /// B's `--quantize` when it differs from A's: `--b-quantize fp8` on the same checkpoint
    /// twice measures what FP8 weights cost.
    #[arg(long, value_name = "FORMAT")]
    b_quantize: Option<String>,
    #[command(flatten)]
    device: DeviceArgs,
}

pub fn run(args: CompareArgs) -> Result<()> {
    if args.prompts == 0 || args.len == 0 || args.tokens == 0 {
        bail!("--prompts, --len and --tokens must be at least 1");
    }
    let open = |dir: &PathBuf, choices: RunChoices| -> Result<Checkpoint> {
        let mut c = Checkpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        choices.apply_to(&mut c);
        Ok(c)
    };
    if args.device.context_parallel != 1 {
        bail!("--context-parallel does not apply to compare: it scores every token of each text");
    }
    let on_a = args.device.choices()?;
    let mut on_b = on_a;
    if let Some(s) = &args.b_kv_cache_dtype {
        on_b.kv_cache = KvCacheDtype::parse(s).map_err(|e| anyhow!("--b-kv-cache-dtype: {e}"))?;
    }
    if let Some(s) = &args.b_quantize {
        on_b.fp8_weights = crate::device::parse_quantize(s)?;
    }
    let (a, b) = (open(&args.a, on_a)?, open(&args.b, on_b)?);
    if a.config().vocab_size != b.config().vocab_size {
        bail!(
            "{} has {} tokens, {} has {}: the models must share a vocabulary",
            args.a.display(),
            a.config().vocab_size,
            args.b.display(),
            b.config().vocab_size
        );
    }
    let opened = args.device.open(|| Ok(a.config().clone()))?;
    crate::on_backend!(opened, be => compare_on(&be, &a, &b, &args))
}

/// Softmax of `x` in f64.
fn probs(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|v| v / z).collect()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

fn compare_on<B: Backend>(
    be: &B,
    a: &Checkpoint,
    b: &Checkpoint,
    args: &CompareArgs,
) -> Result<()> {
    let ma = load_model(be, a, &mut |_, _| {})?;
    let mb = load_model(be, b, &mut |_, _| {})?;
    let vocab = ma.config.vocab_size;
    let total = args.len + args.tokens;
    let mut rng = TestRng::new(args.seed);
    let (mut err_sum, mut err_max, mut kl_sum, mut agree, mut positions, mut same_runs) =
        (0.0f64, 0.0f64, 0.0f64, 0usize, 0usize, 0usize);
    // Logits of every row of `toks` read in one pass.
    let all_logits = |m: &Model<B>, toks: &[u32]| -> Result<Vec<f32>> {
        let mut ws = m.workspace(be, toks.len())?;
        let mut seq = m.new_sequence(be)?;
        let mode = m.sparse_mode(toks.len());
        Ok(m.forward_one(be, &mut ws, &mut seq, toks, mode, LogitRows::All)?)
    };
    // A model's greedy continuation of `prompt`.
    let greedy = |m: &Model<B>, prompt: &[u32]| -> Result<Vec<u32>> {
        let mut ws = m.workspace(be, prompt.len())?;
        let mut seq = m.new_sequence(be)?;
        let logits = m.prefill(be, &mut ws, &mut seq, prompt, &mut |_| {})?;
        let mut next = argmax(&logits) as u32;
        let mut out = vec![next];
        while out.len() < args.tokens {
            next = m
                .decode_greedy(be, &mut ws, &mut seq, next)?
                .id
                .unwrap_or(0);
            out.push(next);
        }
        Ok(out)
    };
    for _ in 0..args.prompts {
        let prompt: Vec<u32> = (0..args.len).map(|_| rng.below(vocab) as u32).collect();
        let cont = greedy(&ma, &prompt)?;
        same_runs += usize::from(greedy(&mb, &prompt)? == cont);
        let toks: Vec<u32> = prompt
            .iter()
            .chain(&cont[..args.tokens - 1])
            .copied()
            .collect();
        let (la, lb) = (all_logits(&ma, &toks)?, all_logits(&mb, &toks)?);
        for row in args.len - 1..total - 1 {
            let (ra, rb) = (
                &la[row * vocab..(row + 1) * vocab],
                &lb[row * vocab..(row + 1) * vocab],
            );
            let num: f64 = ra
                .iter()
                .zip(rb)
                .map(|(x, y)| ((x - y) as f64).powi(2))
                .sum();
            let den: f64 = ra.iter().map(|&x| (x as f64).powi(2)).sum();
            let err = (num / den.max(1e-30)).sqrt();
            let (pa, pb) = (probs(ra), probs(rb));
            let kl: f64 = pa
                .iter()
                .zip(&pb)
                .filter(|(p, _)| **p > 0.0)
                .map(|(p, q)| p * (p / q.max(1e-300)).ln())
                .sum();
            err_sum += err;
            err_max = err_max.max(err);
            kl_sum += kl;
            agree += usize::from(argmax(ra) == argmax(rb));
            positions += 1;
        }
    }
    let n = positions as f64;
    let doc = json!({
        "a": args.a, "b": args.b, "prompts": args.prompts, "prompt_tokens": args.len,
        "tokens": args.tokens, "positions": positions,
        "logit_rel_l2_mean": err_sum / n, "logit_rel_l2_max": err_max,
        "kl_mean": kl_sum / n, "top1_agreement": agree as f64 / n,
        "same_greedy_continuations": same_runs,
    });
    if args.json {
        println!("{doc}");
    } else {
        println!(
            "{} vs {}: {positions} positions ({} prompts of {} tokens, {} teacher-forced tokens each)",
            args.a.display(),
            args.b.display(),
            args.prompts,
            args.len,
            args.tokens
        );
        println!(
            "logits: relative L2 error {:.4} mean, {:.4} max; KL(A||B) {:.5} mean; greedy token agrees at {:.1}%",
            err_sum / n,
            err_max,
            kl_sum / n,
            100.0 * agree as f64 / n
        );
        println!(
            "greedy continuations of {} tokens identical: {same_runs} of {}",
            args.tokens, args.prompts
        );
    }
    Ok(())
}
