//! `sala perplexity`: the sliding-window perplexity of a text file
//! ([`sala_engine::perplexity`]), on any backend, through the engine's own steps.

use crate::device::{memory_limit, user_memory_limit, Device, DeviceArgs, DeviceStats};
use crate::progress_bar;
use anyhow::{bail, Context, Result};
use clap::Args;
use sala_engine::cache::CacheBudget;
use sala_engine::generate::Engine;
use sala_engine::perplexity::{windows, WindowError};
use sala_engine::scheduler::step_rows;
use sala_model::memory::MemoryLimit;
use sala_model::Backend;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Window length when `--context` is not given (capped by the model's limit).
const DEFAULT_CONTEXT: usize = 4096;

#[derive(Args)]
pub struct PerplexityArgs {
    /// The text file to score (`-`: standard input). Its tokens begin with the tokenizer's
    /// BOS, as a prompt's do.
    file: PathBuf,
    /// Checkpoint directory; without it, a built-in tiny model with random weights.
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Tokens per window [default: 4096, or less where the model's max_position_embeddings
    /// is smaller].
    #[arg(long)]
    context: Option<usize>,
    /// Tokens from one window's start to the next's; each window scores only the tokens the
    /// one before it did not [default: half the context].
    #[arg(long)]
    stride: Option<usize>,
    /// Print the result as one JSON object on standard output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    device: DeviceArgs,
    /// Prompt tokens per prefill chunk [default: 8192 on a GPU, 256 on the CPU].
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// CPU threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Refuse a window whose memory plan exceeds SIZE (e.g. 30G, 30GiB, 28000M; powers of
    /// 1024). On a GPU its total memory is a limit anyway.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
}

pub fn run(args: PerplexityArgs) -> Result<()> {
    Device::parse(&args.device.device)?;
    if args.device.context_parallel != 1 {
        bail!("--context-parallel does not apply to perplexity: it scores every token of a window");
    }
    args.device.cuda_options()?;
    let user_limit = user_memory_limit(args.max_memory.as_deref())?;
    crate::set_threads(args.threads)?;
    if args.prefill_chunk == Some(0) {
        bail!("--prefill-chunk must be at least 1");
    }
    let dir = crate::model_dir(&args.model, "its perplexity is that of random weights")?;
    let text = if args.file.as_os_str() == "-" {
        crate::read_stdin("the text")?
    } else {
        std::fs::read_to_string(&args.file)
            .with_context(|| format!("reading {}", args.file.display()))?
    };
    let opened = args
        .device
        .open(|| crate::model_config(&dir, args.device.choices()?))?;
    crate::on_backend!(opened, be => run_on(be, &args, &dir, &text, user_limit))
}

fn run_on<B: Backend + DeviceStats>(
    backend: B,
    args: &PerplexityArgs,
    dir: &Path,
    text: &str,
    user_limit: Option<MemoryLimit>,
) -> Result<()> {
    let limit = memory_limit(&backend, user_limit);
    let chunk = args
        .prefill_chunk
        .unwrap_or_else(|| backend.default_prefill_chunk());
    // The text, its windows and their memory are checked before any weight is uploaded.
    let (checkpoint, tokenizer) = crate::open_model_files(dir, args.device.choices()?)?;
    let config = checkpoint.config().clone();
    let ids = tokenizer
        .encode(text, true)
        .with_context(|| format!("tokenizing {}", args.file.display()))?;
    // A window is a prompt, which must leave a token of room in the model's context.
    let max = config.max_position_embeddings.saturating_sub(1);
    let context = match args.context {
        Some(n) if n > max => bail!(
            "--context {n} is more than the {max} tokens a window may hold (the model's \
             max_position_embeddings {}, less one)",
            config.max_position_embeddings
        ),
        Some(n) => n,
        None => DEFAULT_CONTEXT.min(max),
    };
    let stride = args.stride.unwrap_or((context / 2).max(1));
    let windows = windows(ids.len(), context, stride).map_err(|e| match e {
        WindowError::TooShort(n) => anyhow::anyhow!(
            "{} has {n} tokens (its BOS included); at least 2 are needed to score one",
            args.file.display()
        ),
        WindowError::Context(n) => {
            anyhow::anyhow!("--context {n}: a window must hold at least 2 tokens")
        }
        WindowError::Stride { stride, context } => {
            anyhow::anyhow!("--stride {stride}: it must be in 1..={context} (the context)")
        }
    })?;
    let budget = CacheBudget::new(&config, step_rows(chunk, 1), &backend).with_limit(limit.clone());
    if budget.limit().is_some() {
        budget.check(context.min(ids.len()))?;
        if let Some(room) = budget.room_for_caches() {
            backend.limit_cache_memory(room);
        }
    }

    let bar = progress_bar(0, "loading weights");
    let mut engine = Engine::from_parts(
        backend,
        dir,
        checkpoint,
        tokenizer,
        chunk,
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )
    .with_context(|| format!("loading {}", dir.display()))?;
    bar.finish_and_clear();
    engine.set_memory_limit(limit);

    let to_read: usize = windows.iter().map(|w| w.end - w.start).sum();
    let bar = progress_bar(to_read, "perplexity");
    let start = Instant::now();
    let got = engine.perplexity(&ids, context, stride, &mut |n| bar.inc(n as u64))?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let per_sec = got.tokens_read as f64 / seconds.max(1e-9);
    if args.json {
        let out = serde_json::json!({
            "perplexity": got.perplexity(),
            "nll_mean": got.mean_nll(),
            "tokens": ids.len(),
            "tokens_scored": got.tokens_scored,
            "tokens_read": got.tokens_read,
            "windows": got.windows,
            "context": context,
            "stride": stride,
            "seconds": seconds,
            "tokens_per_sec": per_sec,
            "backend": engine.backend_name(),
            "model": dir.display().to_string(),
        });
        println!("{out}");
    } else {
        println!(
            "perplexity {:.4} (mean NLL {:.4} nats) over {} tokens: {} window{} of up to {} \
             tokens, stride {}",
            got.perplexity(),
            got.mean_nll(),
            got.tokens_scored,
            got.windows,
            if got.windows == 1 { "" } else { "s" },
            context,
            stride
        );
        eprintln!(
            "[{}] {} tokens read in {:.2} s: {:.1} tokens/s",
            engine.backend_name(),
            got.tokens_read,
            seconds,
            per_sec
        );
    }
    Ok(())
}
