//! `sala`: run MiniCPM-SALA checkpoints.

mod bench;
mod builtin;
mod compare;
mod device;
mod inspect;
mod perplexity;
mod quantize;

use anyhow::{bail, Context, Result};
use builtin::builtin_model;
use clap::{Args, Parser, Subcommand, ValueEnum};
use device::{
    memory_limit, user_memory_limit, Device, DeviceArgs, DeviceStats, PrefixCacheArgs, RunChoices,
};
use indicatif::{ProgressBar, ProgressStyle};
use sala_checkpoint::{preset, Checkpoint, DType, ModelConfig, WriteOptions};
use sala_engine::cache::CacheBudget;
use sala_engine::generate::{request_tokens, Engine, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_engine::scheduler::step_rows;
use sala_model::memory::MemoryLimit;
use sala_model::Backend;
use sala_tokenizer::Tokenizer;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "sala",
    version,
    about = "Inference engine for MiniCPM-SALA (sparse + linear attention)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (argument or standard input).
    Generate(GenerateArgs),
    /// Chat in the terminal: one message per line (`/reset`, `/exit`).
    Chat(GenerateArgs),
    /// Describe a checkpoint (config, parameters, memory for weights and context) and, with
    /// --device cuda or --device-profile, the GPU: its limits, the kernel plan per family and
    /// the memory plan at 8K / 128K / 1M.
    Inspect(inspect::InspectArgs),
    /// Write a complete HF-format checkpoint with seeded random weights.
    Init(InitArgs),
    /// Measure TTFT, prefill and decode speed and peak memory at given context lengths.
    Bench(bench::BenchArgs),
    /// Serve an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models).
    Serve(ServeArgs),
    /// Perplexity of a text file: windows of --context tokens every --stride tokens, each
    /// scoring the tokens the one before it did not.
    Perplexity(perplexity::PerplexityArgs),
    /// How far one model's logits are from another's (a quantized checkpoint against its
    /// source): logit error, KL and greedy agreement on seeded random prompts.
    Compare(compare::CompareArgs),
    /// Write a quantized checkpoint from a bf16 one: 4-bit GPTQ layout (round to nearest) or
    /// FP8 (compressed-tensors); the linear layers quantized, embeddings, norms and lm_head kept.
    Quantize(quantize::QuantizeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Checkpoint directory; without it, a built-in tiny model with random weights.
    #[arg(long, short)]
    model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[command(flatten)]
    device: DeviceArgs,
    /// Most tokens a sequence may hold, prompt included [default: the model's
    /// max_position_embeddings].
    #[arg(long)]
    max_context: Option<usize>,
    /// Requests that may wait for the engine; more get HTTP 429.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// Prompt tokens per prefill chunk [default: 8192 on a GPU, 256 on the CPU].
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// Most requests generating together (continuous batching): each step holds a prompt
    /// chunk beside a decode row for each.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Refuse (HTTP 400) a request whose memory plan exceeds SIZE (e.g. 30G, 30GiB, 28000M;
    /// powers of 1024). On a GPU its total memory is a limit anyway.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    #[command(flatten)]
    prefix: PrefixCacheArgs,
    /// On SIGTERM or Ctrl-C: seconds the requests in flight may run on before they are ended
    /// with an error; no new request is taken meanwhile.
    #[arg(long, value_name = "SECONDS", default_value_t = 30.0)]
    shutdown_timeout: f64,
    /// Read special-token text in a chat request (e.g. `<|im_end|>` in a message, a tool
    /// definition, tool-call arguments or template kwargs) as the special tokens, as Hugging
    /// Face's tokenizers do; by default it is plain text, so that a request cannot forge a
    /// turn.
    #[arg(long)]
    special_tokens_in_content: bool,
    /// Speculative decoding for every request, while at most 8 decode together: `ngram`
    /// (prompt-lookup drafts of up to 4 tokens), `ngram:N` (up to N, 1 to 16), `draft:DIR`
    /// (an EAGLE-3 draft model in SpecForge's layout, made for this model) or `off`.
    #[arg(long, value_name = "MODE", default_value = "off")]
    speculative: String,
}

#[derive(Clone, Copy, ValueEnum)]
enum WeightDType {
    Bf16,
    F16,
    F32,
}

#[derive(Args)]
struct InitArgs {
    /// Directory to create.
    dir: PathBuf,
    /// Named configuration (tiny, small, minicpm-sala-9b).
    #[arg(long, default_value = "tiny")]
    preset: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: WeightDType,
    /// Largest shard in MiB; bigger checkpoints are split with an index file.
    #[arg(long, default_value_t = 4096)]
    shard_mib: usize,
    /// Draw the linear weights heavy-tailed (Student's t, 3 degrees of freedom, the same
    /// standard deviation): outliers as trained weights have them (quantization tests).
    #[arg(long)]
    heavy_tails: bool,
}

#[derive(Args)]
struct GenerateArgs {
    /// Set by `sala chat`: read one message per line and keep the conversation.
    #[arg(skip)]
    repl: bool,
    /// Checkpoint directory; without it, a built-in tiny model with random weights.
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// The prompt; read from standard input when absent.
    prompt: Option<String>,
    /// Treat the prompt as a user message and apply the chat template.
    #[arg(long)]
    chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    system: Option<String>,
    /// Ask the chat template to skip the thinking block (enable_thinking=false).
    #[arg(long)]
    no_think: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Most tokens the sequence may hold, prompt included [default: the model's
    /// max_position_embeddings].
    #[arg(long)]
    max_context: Option<usize>,
    /// 0 samples greedily.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past EOS tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Speculative decoding: `ngram` drafts up to 4 tokens a step by looking the latest
    /// words up in the prompt and the output (`ngram:N`: up to N, 1 to 16) and verifies them
    /// in one pass (the output is distributed as without it; greedy, the same tokens up to
    /// near-ties); `draft:DIR`: an EAGLE-3 draft model (SpecForge's layout, made for this
    /// model) drafts up to 5; `off`.
    #[arg(long, value_name = "MODE", default_value = "off")]
    speculative: String,
    /// Constrain the output to a JSON object (constrained decoding; generation stops when
    /// the object is complete, or cut short at --max-tokens).
    #[arg(long, conflicts_with = "json_schema")]
    json: bool,
    /// Constrain the output to JSON matching the JSON schema in FILE.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Prompt tokens per prefill chunk [default: 8192 on a GPU, 256 on the CPU].
    #[arg(long)]
    prefill_chunk: Option<usize>,
    /// CPU threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Refuse a request whose memory plan (weights, the caches of prompt + max_tokens, the
    /// workspace, the backend's allowances) exceeds SIZE: e.g. 30G, 30GiB, 28000M (powers of
    /// 1024). On a GPU its total memory is a limit anyway.
    #[arg(long, value_name = "SIZE")]
    max_memory: Option<String>,
    /// (`sala chat`: each turn resumes from the last one's state.)
    #[command(flatten)]
    prefix: PrefixCacheArgs,
    /// Write each generated token to FILE as a JSON line: its id and log-probability and the
    /// two most likely tokens of its step (to compare devices: where greedy choices part, was
    /// it a near-tie?).
    #[arg(long, value_name = "FILE")]
    trace_tokens: Option<PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Chat(mut args) => {
            args.repl = true;
            args.chat = true;
            generate(args)
        }
        Command::Inspect(args) => inspect::run(args),
        Command::Init(args) => init(args),
        Command::Bench(args) => bench::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Serve(args) => serve(args),
        Command::Perplexity(args) => perplexity::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", error_text(&e));
        std::process::exit(1);
    }
}

/// An error and its causes, `: ` between, each cause left out where the text already ends with it
/// (an error whose message quotes its source would otherwise say it twice).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.ends_with(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

fn dtype_of(d: WeightDType) -> DType {
    match d {
        WeightDType::Bf16 => DType::Bf16,
        WeightDType::F16 => DType::F16,
        WeightDType::F32 => DType::F32,
    }
}

/// Writes a checkpoint of `config` with its tokenizer files into `dir`.
fn write_checkpoint(
    dir: &Path,
    config: &ModelConfig,
    seed: u64,
    dtype: DType,
    shard_bytes: usize,
    heavy_tails: bool,
) -> Result<()> {
    let opts = WriteOptions {
        seed,
        dtype,
        max_shard_bytes: shard_bytes,
        heavy_tails,
    };
    sala_checkpoint::write_random_checkpoint(dir, config, &opts)
        .with_context(|| format!("writing weights to {}", dir.display()))?;
    sala_tokenizer::write_test_tokenizer(dir, config.vocab_size)
        .with_context(|| format!("writing tokenizer files to {}", dir.display()))?;
    Ok(())
}

fn init(args: InitArgs) -> Result<()> {
    let config = preset(&args.preset)?;
    if args.dir.join("config.json").exists() {
        bail!(
            "{} already holds a checkpoint (config.json); choose a new directory",
            args.dir.display()
        );
    }
    write_checkpoint(
        &args.dir,
        &config,
        args.seed,
        dtype_of(args.dtype),
        args.shard_mib << 20,
        args.heavy_tails,
    )?;
    eprintln!(
        "wrote preset {:?} ({} parameters, random weights, seed {}) to {}",
        args.preset,
        human_count(sala_checkpoint::expected_parameter_count(&config) as f64),
        args.seed,
        args.dir.display()
    );
    Ok(())
}

fn progress_bar(len: usize, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

fn generate(args: GenerateArgs) -> Result<()> {
    // The device flags are checked before anything is read.
    Device::parse(&args.device.device)?;
    args.device.cuda_options()?;
    let user_limit = user_memory_limit(args.max_memory.as_deref())?;
    set_threads(args.threads)?;
    if args.prefill_chunk == Some(0) {
        bail!("--prefill-chunk must be at least 1");
    }
    let dir = model_dir(&args.model, "its output is random text")?;
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None if args.repl => String::new(),
        None => {
            if std::io::stdin().is_terminal() {
                eprintln!("(reading the prompt from standard input; end it with Ctrl-D)");
            }
            read_stdin("the prompt")?
        }
    };

    let opened = args
        .device
        .open(|| model_config(&dir, args.device.choices()?))?;
    on_backend!(opened, be => generate_on(be, &args, &dir, &prompt, user_limit))
}

/// The config of the checkpoint in `dir`, as `choices` run it.
fn model_config(dir: &Path, choices: RunChoices) -> Result<ModelConfig> {
    let mut checkpoint =
        Checkpoint::open(dir).with_context(|| format!("loading {}", dir.display()))?;
    choices.apply_to(&mut checkpoint);
    Ok(checkpoint.config().clone())
}

/// Runs rayon on `n` threads when given (`--threads`).
fn set_threads(n: Option<usize>) -> Result<()> {
    if let Some(n) = n {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("--threads")?;
    }
    Ok(())
}

/// The checkpoint of `--model`, or the built-in tiny one (saying so, and what random weights
/// make of the command's result).
fn model_dir(model: &Option<PathBuf>, random_result: &str) -> Result<PathBuf> {
    match model {
        Some(dir) => Ok(dir.clone()),
        None => {
            eprintln!(
                "note: no --model given: using the built-in tiny model; its weights are random, \
                 so {random_result}"
            );
            builtin_model()
        }
    }
}

/// A checkpoint's tensors (opened, not loaded) and its tokenizer.
fn open_model_files(dir: &Path, choices: RunChoices) -> Result<(Checkpoint, Tokenizer)> {
    let mut checkpoint =
        Checkpoint::open(dir).with_context(|| format!("loading {}", dir.display()))?;
    choices.apply_to(&mut checkpoint);
    let tokenizer =
        Tokenizer::from_dir(dir).with_context(|| format!("loading {}", dir.display()))?;
    Ok((checkpoint, tokenizer))
}

/// Standard input, whole, as `what`.
fn read_stdin(what: &str) -> Result<String> {
    let mut s = String::new();
    std::io::stdin()
        .read_to_string(&mut s)
        .with_context(|| format!("reading {what} from standard input"))?;
    Ok(s)
}

fn generate_on<B: Backend + DeviceStats>(
    backend: B,
    args: &GenerateArgs,
    dir: &Path,
    prompt: &str,
    user_limit: Option<MemoryLimit>,
) -> Result<()> {
    let limit = memory_limit(&backend, user_limit);
    let chunk = args
        .prefill_chunk
        .unwrap_or_else(|| backend.default_prefill_chunk());
    // The checkpoint and the tokenizer first: the request is sized, and checked against the
    // memory limit, before any weight is uploaded.
    let (checkpoint, tokenizer) = open_model_files(dir, args.device.choices()?)?;
    let config = checkpoint.config().clone();
    let opts = generate_options(args, &config, &tokenizer)?;
    let ids = if args.repl {
        None
    } else if args.chat {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(sala_tokenizer::ChatMessage::new("system", s));
        }
        messages.push(sala_tokenizer::ChatMessage::new("user", prompt));
        Some(chat_ids(&tokenizer, &messages, args)?)
    } else {
        Some(tokenizer.encode(prompt, true)?)
    };
    // The engine's cache budget (its workspace: a chunk beside one decode row), asked before
    // any weight is loaded.
    let budget = CacheBudget::new(&config, step_rows(chunk, 1), &backend).with_limit(limit.clone());
    if budget.limit().is_some() {
        // A chat turn holds at least one prompt token; each turn is checked again.
        let tokens = request_tokens(ids.as_ref().map_or(1, Vec::len), &opts)?;
        budget.check(tokens)?;
        if let Some(room) = budget.room_for_caches() {
            backend.limit_cache_memory(room);
        }
    }
    let mut engine = load_engine(backend, args, chunk, dir, checkpoint, tokenizer)?;
    add_context_ranks(&mut engine, &args.device, dir)?;
    engine.set_memory_limit(limit);
    let Some(ids) = ids else {
        // A chat session: each turn resumes from the state the last one left.
        engine.set_prefix_cache(args.prefix.limit(engine.cache_budget().room_for_caches())?);
        return chat_loop(&mut engine, args, &opts, prompt);
    };
    let gen = stream_generation(
        &mut engine,
        &ids,
        &opts,
        chunk,
        args.trace_tokens.as_deref(),
        None,
    )?;
    println!();
    eprintln!(
        "[{}] prompt {} tokens, prefill {:.1} tok/s; generated {} tokens, decode {:.1} tok/s; finish: {}",
        engine.backend_name(),
        gen.prompt_tokens,
        gen.prefill_tokens_per_sec(),
        gen.tokens.len(),
        gen.decode_tokens_per_sec(),
        gen.finish.as_str()
    );
    if opts.speculate.is_some() {
        let s = engine.speculation_stats();
        eprintln!(
            "speculation: {} draft tokens verified, {} taken",
            s.drafted, s.accepted
        );
    }
    if let Some(s) = engine.context_stats() {
        let ranks = args.device.context_parallel;
        match (s.prompts, s.read_alone) {
            (0, 0) => eprintln!(
                "context parallel: the prompt was read by the steps (too short for {ranks} ranks)"
            ),
            (_, 0) => eprintln!(
                "context parallel: {} prompt tokens read by {ranks} ranks",
                s.tokens
            ),
            _ => eprintln!(
                "context parallel: the prompt was read by the steps (the memory limit leaves \
                 the {ranks} ranks' workspaces no room)"
            ),
        }
    }
    Ok(())
}

/// With `--context-parallel N` above 1: the engine reads long prompts with N − 1 more ranks
/// of its backend's kind, each holding the model loaded again from `dir`.
fn add_context_ranks<B: Backend + DeviceStats>(
    engine: &mut Engine<B>,
    device: &DeviceArgs,
    dir: &Path,
) -> Result<()> {
    let n = device.context_parallel;
    if n <= 1 {
        return Ok(());
    }
    let (backends, exchange) = engine
        .backend
        .context_ranks(n - 1, 1)
        .with_context(|| format!("--context-parallel {n}"))?;
    let (checkpoint, _) = open_model_files(dir, device.choices()?)?;
    let models = backends
        .iter()
        .map(|be| sala_engine::generate::load_model(be, &checkpoint, &mut |_, _| {}))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--context-parallel {n}: loading the ranks' models"))?;
    let ranks = sala_engine::context::ContextRanks::new(backends, models, exchange)?;
    engine.set_context_parallel(Some(ranks));
    Ok(())
}

fn load_engine<B: Backend>(
    backend: B,
    args: &GenerateArgs,
    chunk: usize,
    dir: &Path,
    checkpoint: Checkpoint,
    tokenizer: Tokenizer,
) -> Result<Engine<B>> {
    let bar = progress_bar(0, "loading weights");
    let engine = Engine::from_parts(
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
    let mut engine = engine;
    if let Some(draft) = draft_dir(&args.speculative) {
        load_draft(&mut engine, &draft)?;
    }
    Ok(engine)
}

fn generate_options(
    args: &GenerateArgs,
    config: &ModelConfig,
    tokenizer: &Tokenizer,
) -> Result<GenerateOptions> {
    let opts = GenerateOptions {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed: args.seed,
            logit_bias: Vec::new(),
        },
        max_tokens: args.max_tokens,
        max_context: match args.max_context {
            Some(n) if n > config.max_position_embeddings => bail!(
                "--max-context {n} is above the model's limit of {} tokens \
                 (max_position_embeddings)",
                config.max_position_embeddings
            ),
            n => n.unwrap_or(config.max_position_embeddings),
        },
        stop: args.stop.clone(),
        eos_ids: if args.ignore_eos {
            Vec::new()
        } else {
            sala_engine::generate::eos_ids(config, tokenizer)
        },
        grammar: grammar(args, config, tokenizer)?,
        prompt_logprobs: None,
        speculate: speculative(&args.speculative)?,
    };
    opts.sampling.validate()?;
    Ok(opts)
}

/// The grammar of `--json` or `--json-schema`, compiled (before any weight is loaded).
/// `--speculative MODE`: `ngram` or `ngram:N` (prompt-lookup drafts of up to 4 or N tokens),
/// `draft:DIR` (an EAGLE-3 draft model's drafts of up to [`DRAFT_MODEL_TOKENS`]), `off`.
fn speculative(mode: &str) -> Result<Option<sala_engine::draft::Speculate>> {
    use sala_engine::draft::{DraftSource, Speculate};
    let max_draft = match mode.split_once(':') {
        None if mode == "off" => return Ok(None),
        None if mode == "ngram" => 4,
        Some(("ngram", n)) => match n.parse::<usize>() {
            Ok(n) if (1..=16).contains(&n) => n,
            _ => bail!("--speculative {mode}: ngram:N takes drafts of 1 to 16 tokens"),
        },
        Some(("draft", dir)) if !dir.is_empty() => {
            return Ok(Some(Speculate {
                max_draft: DRAFT_MODEL_TOKENS,
                drafts: DraftSource::Model,
            }))
        }
        _ => bail!("--speculative {mode}: expected ngram, ngram:N (1 to 16), draft:DIR or off"),
    };
    Ok(Some(Speculate::prompt_lookup(max_draft)))
}

/// Most tokens a draft model drafts a step (its draft length adapts below it).
const DRAFT_MODEL_TOKENS: usize = 5;

/// The draft model directory of `--speculative draft:DIR`, if that is the mode.
fn draft_dir(mode: &str) -> Option<PathBuf> {
    match mode.split_once(':') {
        Some(("draft", dir)) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => None,
    }
}

/// Loads the EAGLE-3 draft in `dir` into `engine`, checked against its model first.
fn load_draft<B: Backend>(engine: &mut Engine<B>, dir: &Path) -> Result<()> {
    let ckpt = sala_checkpoint::DraftCheckpoint::open(dir, &engine.model.config)
        .with_context(|| format!("--speculative draft:{}", dir.display()))?;
    let draft = sala_model::draft::DraftModel::load(&engine.backend, &engine.model, &ckpt)
        .with_context(|| format!("loading the draft model {}", dir.display()))?;
    engine
        .set_draft(draft)
        .with_context(|| format!("loading the draft model {}", dir.display()))
}

fn grammar(
    args: &GenerateArgs,
    config: &ModelConfig,
    tokenizer: &Tokenizer,
) -> Result<Option<sala_engine::grammar::Grammar>> {
    use sala_engine::grammar::{GrammarSpec, Grammars};
    let spec = match (&args.json_schema, args.json) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading --json-schema {}", path.display()))?;
            let schema = serde_json::from_str(&text)
                .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
            GrammarSpec::JsonSchema(schema)
        }
        (None, true) => GrammarSpec::JsonObject,
        (None, false) => return Ok(None),
    };
    let eos = sala_engine::generate::eos_ids(config, tokenizer);
    let grammars = Grammars::new(tokenizer.clone(), config.vocab_size, eos);
    let grammar = grammars.compile(&spec).map_err(|e| {
        let flag = match &args.json_schema {
            Some(p) => format!("--json-schema {}", p.display()),
            None => "--json".into(),
        };
        // The engine names the API's parameter; here the flag is at fault.
        let message = e.to_string();
        let message = message
            .strip_prefix("response_format: ")
            .unwrap_or(&message);
        anyhow::anyhow!("{flag}: {message}")
    })?;
    Ok(Some(grammar))
}

/// The token ids of `messages` through the checkpoint's chat template, ready for the reply.
fn chat_ids(
    tokenizer: &Tokenizer,
    messages: &[sala_tokenizer::ChatMessage],
    args: &GenerateArgs,
) -> Result<Vec<u32>> {
    let mut kwargs = serde_json::Map::new();
    if args.no_think {
        kwargs.insert("enable_thinking".into(), false.into());
    }
    let opts = sala_tokenizer::ChatOptions {
        add_generation_prompt: true,
        tools: None,
        kwargs,
    };
    let text = tokenizer
        .chat_template()
        .and_then(|t| t.render(messages, &opts))
        .context("applying the chat template")?;
    Ok(tokenizer.encode(&text, true)?)
}

/// Generates from `ids`, streaming the text to standard output (and, with `trace`, each
/// token with its step's two most likely tokens to that file, a JSON line each).
fn stream_generation<B: Backend>(
    engine: &mut Engine<B>,
    ids: &[u32],
    opts: &GenerateOptions,
    chunk: usize,
    trace: Option<&Path>,
    stop: Option<&AtomicBool>,
) -> Result<sala_engine::generate::Generation> {
    let prefill_bar = progress_bar(ids.len(), "prefill");
    if ids.len() <= chunk {
        prefill_bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut trace_file = match trace {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let mut stdout = std::io::stdout().lock();
    let mut write_err = None;
    let generated = engine.generate_steps(
        ids,
        opts,
        trace_file.as_ref().map(|_| 2),
        &mut |step| {
            if let (Some(f), Some(lp)) = (
                trace_file.as_mut(),
                step.token.and_then(|t| t.logprobs.as_ref()),
            ) {
                let line = serde_json::json!({"id": lp.id, "logprob": lp.logprob, "top": lp.top});
                if let Err(e) = writeln!(f, "{line}") {
                    write_err.get_or_insert(e);
                }
            }
            if write_err.is_none() && !step.text.is_empty() {
                if let Err(e) = stdout
                    .write_all(step.text.as_bytes())
                    .and_then(|_| stdout.flush())
                {
                    write_err = Some(e);
                }
            }
            !stop.is_some_and(|s| s.load(Ordering::Relaxed))
        },
        &mut |n| {
            prefill_bar.inc(n as u64);
            if prefill_bar.position() as usize >= ids.len() {
                prefill_bar.finish_and_clear();
            }
        },
    );
    // Stopped or failed half way, the bar still leaves no line behind.
    prefill_bar.finish_and_clear();
    let gen = generated?;
    if let Some(f) = trace_file.as_mut() {
        if let Err(e) = f.flush() {
            write_err.get_or_insert(e);
        }
    }
    if let Some(e) = write_err {
        return Err(e).context("writing the output");
    }
    Ok(gen)
}

/// The commands of `sala chat`, for `/help`.
const CHAT_HELP: &str = "commands: /reset forgets the conversation, /exit (or /quit, or end of \
                         input) quits, /help shows this; any other line is a message";

/// `sala chat`: one user message per line of standard input; `/reset` forgets the
/// conversation, `/exit` (or end of input) quits, `/help` lists the commands; a line that is
/// one word starting with `/` and not a command is an error. Each turn runs the whole
/// conversation; when it outgrows the context, the oldest turns are dropped (and the user
/// told).
fn chat_loop<B: Backend>(
    engine: &mut Engine<B>,
    args: &GenerateArgs,
    opts: &GenerateOptions,
    first: &str,
) -> Result<()> {
    let interactive = std::io::stdin().is_terminal();
    let start = || {
        let mut m = Vec::new();
        if let Some(s) = &args.system {
            m.push(sala_tokenizer::ChatMessage::new("system", s));
        }
        m
    };
    let mut messages = start();
    let mut pending: Option<String> = (!first.trim().is_empty()).then(|| first.to_string());
    // Ctrl-C stops the reply under way, not the session (/exit or end of input ends it).
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                while tokio::signal::ctrl_c().await.is_ok() {
                    flag.store(true, Ordering::Relaxed);
                }
            });
        });
    }
    let mut lines = std::io::stdin().lines();
    loop {
        let line = match pending.take() {
            Some(l) => l,
            None => {
                if interactive {
                    eprint!("> ");
                }
                match lines.next() {
                    // A line that is not UTF-8 is skipped (its bytes are read), not the session.
                    Some(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                        eprintln!("error: a line of input is not UTF-8 text; it was skipped");
                        continue;
                    }
                    Some(l) => l.context("reading standard input")?,
                    None => break,
                }
            }
        };
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start();
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" => {
                eprintln!("{CHAT_HELP}");
                continue;
            }
            cmd if cmd.starts_with('/') && !cmd.contains(char::is_whitespace) => {
                eprintln!("error: unknown command {cmd}; /help lists the commands");
                continue;
            }
            _ => {}
        }
        messages.push(sala_tokenizer::ChatMessage::new("user", line.trim()));
        let mut ids = chat_ids(&engine.tokenizer, &messages, args)?;
        // Past the context, the oldest turns go (the system prompt and this message stay).
        let first_turn = usize::from(args.system.is_some());
        let mut dropped = 0;
        while ids.len() >= opts.max_context && messages.len() > first_turn + 1 {
            let turn_end = (first_turn + 1..messages.len() - 1)
                .find(|&i| messages[i].role == "user")
                .unwrap_or(messages.len() - 1);
            dropped += messages.drain(first_turn..turn_end).count();
            ids = chat_ids(&engine.tokenizer, &messages, args)?;
        }
        if dropped > 0 {
            eprintln!(
                "(the conversation outgrew the context of {} tokens: its oldest {dropped} \
                 messages were dropped)",
                opts.max_context
            );
        }
        interrupted.store(false, Ordering::Relaxed);
        match stream_generation(
            engine,
            &ids,
            opts,
            engine.prefill_chunk(),
            None,
            Some(&interrupted),
        ) {
            Ok(gen) => {
                println!();
                if gen.finish == sala_engine::generate::FinishReason::Cancelled {
                    eprintln!("(stopped)");
                }
                if gen.cached_tokens > 0 {
                    eprintln!(
                        "({} of the {} prompt tokens resumed from the last turns)",
                        gen.cached_tokens, gen.prompt_tokens
                    );
                }
                messages.push(sala_tokenizer::ChatMessage::new(
                    "assistant",
                    gen.text.trim(),
                ));
            }
            Err(e) => {
                // A turn that cannot run (e.g. the conversation outgrew the context) is reported
                // and dropped; the session goes on.
                messages.pop();
                eprintln!("error: {}", error_text(&e));
            }
        }
    }
    Ok(())
}

pub(crate) fn human_count(n: f64) -> String {
    match n {
        n if n >= 1e9 => format!("{:.2} B", n / 1e9),
        n if n >= 1e6 => format!("{:.1} M", n / 1e6),
        n if n >= 1e3 => format!("{:.1} K", n / 1e3),
        n => format!("{n}"),
    }
}

pub(crate) fn human_bytes(n: usize) -> String {
    let n = n as f64;
    match n {
        n if n >= (1u64 << 30) as f64 => format!("{:.2} GiB", n / (1u64 << 30) as f64),
        n if n >= (1u64 << 20) as f64 => format!("{:.1} MiB", n / (1u64 << 20) as f64),
        n if n >= 1024.0 => format!("{:.1} KiB", n / 1024.0),
        n => format!("{n} B"),
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C), saying so: the start of a graceful shutdown.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("shutting down: finishing the requests in flight, taking no new ones");
}

/// What `sala serve` loads, and how.
struct ServeLoad {
    dir: PathBuf,
    /// `--prefill-chunk`, else the backend's default.
    chunk: Option<usize>,
    max_batch: usize,
    user_limit: Option<MemoryLimit>,
    draft: Option<PathBuf>,
    choices: RunChoices,
    prefix: PrefixCacheArgs,
    /// The device flags (`--context-parallel`'s ranks are made from them).
    device: DeviceArgs,
}

fn serve(args: ServeArgs) -> Result<()> {
    Device::parse(&args.device.device)?;
    args.device.cuda_options()?;
    let device_args = args.device.clone();
    if args.prefill_chunk == Some(0) {
        bail!("--prefill-chunk must be at least 1");
    }
    if args.max_context == Some(0) {
        bail!("--max-context must be at least 1");
    }
    let user_limit = user_memory_limit(args.max_memory.as_deref())?;
    let shutdown_timeout = std::time::Duration::try_from_secs_f64(args.shutdown_timeout)
        .map_err(|_| anyhow::anyhow!("--shutdown-timeout must be a number of seconds ≥ 0"))?;
    let (dir, id) = match &args.model {
        Some(dir) => {
            let id = std::fs::canonicalize(dir)
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| dir.display().to_string());
            (dir.clone(), id)
        }
        None => {
            eprintln!("note: no --model given: serving the built-in tiny model; its weights are random, so its output is random text");
            (builtin_model()?, "sala-builtin-tiny".to_string())
        }
    };
    let chunk = args.prefill_chunk;
    let max_batch = args.max_batch;
    if max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    let load_dir = dir.clone();
    eprintln!("loading {} ...", dir.display());
    let specials_in_content = args.special_tokens_in_content;
    let speculate = speculative(&args.speculative)?;
    let draft = draft_dir(&args.speculative);
    let load = ServeLoad {
        dir: load_dir,
        chunk,
        max_batch,
        user_limit,
        draft,
        choices: args.device.choices()?,
        prefix: args.prefix.clone(),
        device: args.device.clone(),
    };
    let engine = sala_server::spawn_engine(id, args.max_context, args.queue, move |runner| {
        let runner = runner
            .special_tokens_in_content(specials_in_content)
            .speculate(speculate);
        /// Loads the model (unless no request could fit the memory limit) and serves it.
        fn start<B: Backend + DeviceStats + 'static>(
            runner: sala_server::EngineRunner,
            be: B,
            load: ServeLoad,
        ) -> Result<(), String> {
            let ServeLoad {
                dir,
                chunk,
                max_batch,
                user_limit,
                draft,
                choices,
                prefix,
                device,
            } = load;
            let dir = dir.as_path();
            let chunk = chunk.unwrap_or_else(|| be.default_prefill_chunk());
            let limit = memory_limit(&be, user_limit);
            if limit.is_some() {
                let mut config = ModelConfig::from_file(&dir.join("config.json"))
                    .map_err(|e| format!("loading {}: {e}", dir.display()))?;
                choices.apply(&mut config);
                // The engine's cache budget, asked before any weight is loaded: the smallest
                // request (one prompt token and one generated) must fit.
                // A draft model's weights and workspace are held beside the model's.
                let draft_bytes = match &draft {
                    Some(dir) => {
                        let d = sala_checkpoint::DraftCheckpoint::open(dir, &config)
                            .map_err(|e| format!("--speculative draft:{}: {e}", dir.display()))?;
                        sala_model::draft::resident_bytes(d.config(), d.has_embed())
                    }
                    None => 0,
                };
                let budget = CacheBudget::new(&config, step_rows(chunk, max_batch), &be)
                    .with_limit(limit.clone())
                    .with_resident(draft_bytes);
                budget
                    .check(2)
                    .map_err(|e| format!("no request can fit the memory limit: {e}"))?;
                if let Some(room) = budget.room_for_caches() {
                    be.limit_cache_memory(room);
                }
            }
            let (checkpoint, tokenizer) =
                open_model_files(dir, choices).map_err(|e| error_text(&e))?;
            let mut engine =
                Engine::from_parts(be, dir, checkpoint, tokenizer, chunk, &mut |_, _| {})
                    .map_err(|e| format!("loading {}: {e}", dir.display()))?;
            if let Some(draft) = &draft {
                load_draft(&mut engine, draft).map_err(|e| error_text(&e))?;
            }
            add_context_ranks(&mut engine, &device, dir).map_err(|e| error_text(&e))?;
            // The page pool, where there is one, counts what the caches take.
            let probe = |be: &B| be.page_pool().map(|(pages, bytes)| pages * bytes);
            engine.set_cache_probe(Some(Box::new(probe)));
            // What the memory limit leaves for caches, on the engine's workspace.
            let room = engine
                .cache_budget()
                .with_limit(limit.clone())
                .room_for_caches();
            engine.set_prefix_cache(prefix.limit(room).map_err(|e| error_text(&e))?);
            runner.memory_limit(limit).max_batch(max_batch).run(engine);
            Ok(())
        }
        let opened = device_args
            .open(|| model_config(&load.dir, load.choices))
            .map_err(|e| error_text(&e))?;
        on_backend!(opened, be => start(runner, be, load))
    })
    .map_err(anyhow::Error::msg)?;
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        eprintln!(
            "serving `{}` on {} ({}; context budget {} tokens): http://{}/v1",
            engine.info.id,
            engine.info.backend,
            dir.display(),
            engine.info.max_context,
            listener.local_addr()?
        );
        let opts = sala_server::ServerOptions {
            shutdown_timeout,
            ..Default::default()
        };
        sala_server::serve_until(listener, engine, &opts, shutdown_signal())
            .await
            .context("serving")?;
        eprintln!("stopped");
        Ok(())
    })
}
