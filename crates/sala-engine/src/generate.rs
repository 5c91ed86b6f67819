//! The [`Engine`]: a checkpoint loaded onto a backend with its tokenizer and step workspace.
//! [`Engine::generate`] runs one prompt to its end (EOS, a stop string, or the token budget)
//! as a batch of one, through the same [`Engine::step`] as every batch; [`TokenStream`] is
//! the per-token half of a request (sampling, stop strings, detokenization).

use crate::cache::{CacheBudget, CacheProbe};
use crate::draft::Speculate;
use crate::grammar::{Constraint, Grammar, GrammarError, Grammars};
pub use crate::request::FinishReason;
use crate::request::PromptLogprobs;
use crate::sampling::{
    token_logprobs, SampledToken, Sampler, SamplingError, SamplingParams, TokenLogprobs, Verdict,
};
use crate::step::StepEvent;
use crate::stop::{StopError, StopMatcher};
use sala_checkpoint::ModelConfig;
use sala_checkpoint::{Checkpoint, CheckpointError, DType};
use sala_model::memory::{MemoryLimit, MemoryPlan, OverBudget};
use sala_model::{
    Backend, BackendError, GreedyPick, HostDType, HostTensor, Model, StepLogits, WeightSource,
    Workspace,
};
use sala_tokenizer::{Detokenizer, Tokenizer, TokenizerError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error(transparent)]
    Stop(#[from] StopError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error("{dir}: the tokenizer has {tokenizer} tokens but the model's vocab_size is {model}")]
    VocabMismatch {
        dir: PathBuf,
        tokenizer: usize,
        model: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(transparent)]
    Window(#[from] crate::perplexity::WindowError),
    #[error(
        "the prompt has {prompt} tokens, which leaves no room in the context budget of {budget} \
         tokens (raise --max-context, or shorten the prompt)"
    )]
    PromptTooLong { prompt: usize, budget: usize },
    /// The request's memory plan exceeds the memory limit.
    #[error(transparent)]
    OverBudget(#[from] OverBudget),
    /// The request's plan fits the limit alone, but not beside the requests in flight.
    #[error("the requests in flight hold the memory this one needs ({0})")]
    MemoryBusy(OverBudget),
    #[error("the batch is full ({requests} requests)")]
    BatchFull { requests: usize },
    #[error("the request drafts with a draft model, but none is loaded (--speculative draft:DIR)")]
    NoDraftModel,
    /// A panic inside this request's work (or the forward pass it was part of): the request
    /// fails, the engine goes on.
    #[error("the engine failed on this request ({0})")]
    Panicked(String),
}

impl EngineError {
    /// The same failure for another request of a shared step (the error is not `Clone`).
    pub(crate) fn shared(&self) -> EngineError {
        match self {
            EngineError::Backend(b) => BackendError(b.0.clone()).into(),
            EngineError::Panicked(p) => EngineError::Panicked(p.clone()),
            other => EngineError::Panicked(other.to_string()),
        }
    }
}

impl EngineError {
    /// A panic's payload as an [`EngineError::Panicked`] naming `what` was running.
    pub fn from_panic(what: &str, payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Self::Panicked(format!("a panic in {what}: {message}"))
    }
}

/// Runs `f`, turning a panic inside it into an [`EngineError::Panicked`] naming `what` (a
/// request's own work fails that request only).
pub(crate) fn isolated<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, EngineError>,
) -> Result<T, EngineError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(EngineError::from_panic(what, p)))
}

/// The model of `checkpoint` on `be` (a GPTQ checkpoint's linears in 4 bits).
pub fn load_model<B: Backend>(
    be: &B,
    checkpoint: &Checkpoint,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model<B>, EngineError> {
    let config = checkpoint.config().clone();
    Ok(Model::load(
        be,
        config,
        &CheckpointSource(checkpoint),
        progress,
    )?)
}

/// Serves a [`Checkpoint`]'s tensors to [`Model::load`].
struct CheckpointSource<'a>(&'a Checkpoint);

impl WeightSource for CheckpointSource<'_> {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String> {
        let view = self.0.tensor(name).map_err(|e| e.to_string())?;
        Ok(HostTensor {
            dtype: match view.dtype {
                DType::Bf16 => HostDType::Bf16,
                DType::F16 => HostDType::F16,
                DType::F32 => HostDType::F32,
            },
            shape: view.shape,
            bytes: view.bytes,
        })
    }

    /// An FP8 checkpoint's weight: its codes and row scales.
    fn with_fp8(
        &self,
        name: &str,
        f: &mut dyn FnMut(sala_model::Fp8Matrix<'_>) -> Result<(), BackendError>,
    ) -> Result<bool, BackendError> {
        let stored = self
            .0
            .fp8_rows(name)
            .map_err(|e| BackendError(format!("weight {name}: {e}")))?;
        let Some((codes, scales, (rows, cols))) = stored else {
            return Ok(false);
        };
        f(sala_model::Fp8Matrix {
            rows,
            cols,
            codes,
            scales: &scales,
        })?;
        Ok(true)
    }

    /// A GPTQ weight in 4 bits, by rows.
    fn with_quantized(
        &self,
        name: &str,
        f: &mut dyn FnMut(sala_model::QuantMatrix<'_>) -> Result<(), BackendError>,
    ) -> Result<bool, BackendError> {
        if !self.0.is_quantized(name) {
            return Ok(false);
        }
        let (rows, (out, inputs)) = self
            .0
            .weight_rows(name)
            .map_err(|e| BackendError(format!("weight {name}: {e}")))?;
        f(sala_model::QuantMatrix {
            rows: out,
            cols: inputs,
            group: rows.group,
            words: &rows.words,
            scales: &rows.scales,
            zeros: &rows.zeros,
        })?;
        Ok(true)
    }
}

/// A model loaded on a backend, with its tokenizer and the workspace of a step.
pub struct Engine<B: Backend> {
    pub backend: B,
    pub model: Model<B>,
    pub tokenizer: Tokenizer,
    pub dir: PathBuf,
    pub(crate) workspace: Workspace<B>,
    /// Most requests in a batch: the decode rows a step's workspace holds beside a chunk.
    max_batch: usize,
    /// The limit every request's memory plan is checked against.
    memory_limit: Option<MemoryLimit>,
    /// How the backend counts the bytes its caches hold, where it can.
    pub(crate) cache_probe: Option<Box<dyn CacheProbe<B>>>,
    /// Structured output's token environment, built on first use.
    grammars: std::sync::Arc<Grammars>,
    /// Draft tokens verified and accepted so far (speculative decoding).
    pub(crate) speculated: SpeculationStats,
    /// The draft model requests may draft with ([`Engine::set_draft`]).
    pub(crate) draft: Option<crate::step::Drafting<B>>,
    /// Ended sequences kept for prompts that begin with their tokens ([`Engine::set_prefix_cache`]).
    pub(crate) prefix: Option<crate::prefix::PrefixCache<B>>,
    /// Other ranks that read long prompts with this engine's model
    /// ([`Engine::set_context_parallel`]).
    pub(crate) context: Option<crate::context::ContextRanks<B>>,
}

/// How speculative decoding fared: draft tokens verified, how many stood, and the steps that
/// verified drafts (so `accepted / spans` is the mean accepted length).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    pub drafted: u64,
    pub accepted: u64,
    pub spans: u64,
    /// Time spent making drafts (a draft model's steps; lookups), in microseconds.
    pub draft_micros: u64,
}

/// Everything about one generation except the prompt.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Most tokens a sequence may hold (prompt and output together).
    pub max_context: usize,
    pub stop: Vec<String>,
    /// Token ids that end generation (not shown in the text).
    pub eos_ids: Vec<u32>,
    /// What the output must match ([`Engine::grammars`] compiles it); generation stops when
    /// it is complete.
    pub grammar: Option<Grammar>,
    /// Report each prompt token's log-probability with this many alternatives
    /// ([`PromptLogprobs`]); `None`: none.
    pub prompt_logprobs: Option<usize>,
    /// Speculative decoding: drafts verified in one step; the output is distributed as
    /// without it. `None`: off.
    pub speculate: Option<Speculate>,
}

/// One generated token, as [`Engine::generate_steps`] reports it.
#[derive(Debug, Clone)]
pub struct TokenStep {
    pub id: u32,
    /// An EOS token: it ends generation and adds no text.
    pub eos: bool,
    /// The token's raw log-probability and the most likely alternatives, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// What [`Engine::generate_steps`] reports: a generated token with the text that became
/// final with it (often empty: text is held back while it could still change), or, with
/// `token: None`, the text flushed at the end.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub token: Option<&'a TokenStep>,
    pub text: &'a str,
}

/// The outcome of [`Engine::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<SampledToken>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache (not read again).
    pub cached_tokens: usize,
    pub prefill_time: Duration,
    /// Time of the decode steps (every generated token after the first).
    pub decode_time: Duration,
}

impl Generation {
    pub fn prefill_tokens_per_sec(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// EOS ids of the config and the tokenizer, deduplicated.
pub fn eos_ids(config: &ModelConfig, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids = config.eos_token_ids.clone();
    ids.extend(tokenizer.eos_ids());
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// How many tokens a request's sequence may reach: the prompt plus `max_tokens`, capped by
/// the context budget; an error when the prompt is empty or leaves no room.
pub fn request_tokens(prompt: usize, opts: &GenerateOptions) -> Result<usize, EngineError> {
    if prompt == 0 {
        return Err(EngineError::EmptyPrompt);
    }
    if prompt >= opts.max_context {
        return Err(EngineError::PromptTooLong {
            prompt,
            budget: opts.max_context,
        });
    }
    Ok(prompt + opts.max_tokens.min(opts.max_context - prompt))
}

impl<B: Backend> Engine<B> {
    /// Opens and checks the checkpoint in `dir`, loads its tokenizer, and uploads the weights;
    /// `progress(done, total)` counts tensors. `chunk` is the prefill chunk length.
    pub fn load(
        backend: B,
        dir: &Path,
        chunk: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let checkpoint = Checkpoint::open(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        Self::from_parts(backend, dir, checkpoint, tokenizer, chunk, progress)
    }

    /// [`Engine::load`] from an opened checkpoint and its tokenizer (e.g. to size a request
    /// before uploading any weight).
    pub fn from_parts(
        backend: B,
        dir: &Path,
        checkpoint: Checkpoint,
        tokenizer: Tokenizer,
        chunk: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let config = checkpoint.config().clone();
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(EngineError::VocabMismatch {
                dir: dir.to_path_buf(),
                tokenizer: tokenizer.vocab_size(),
                model: config.vocab_size,
            });
        }
        let model = load_model(&backend, &checkpoint, progress)?;
        Self::from_model(backend, model, tokenizer, dir, chunk)
    }

    /// An engine over a model already on `backend` (e.g. random weights for benchmarks) and a
    /// tokenizer; `dir` is only reported.
    pub fn from_model(
        backend: B,
        model: Model<B>,
        tokenizer: Tokenizer,
        dir: &Path,
        chunk: usize,
    ) -> Result<Self, EngineError> {
        // One request (`generate`); batches ask for more rows with `set_max_batch`.
        let workspace = model.step_workspace(&backend, chunk.max(1), 1)?;
        let grammars = Grammars::new(
            tokenizer.clone(),
            model.config.vocab_size,
            eos_ids(&model.config, &tokenizer),
        );
        Ok(Self {
            grammars: std::sync::Arc::new(grammars),
            speculated: SpeculationStats::default(),
            draft: None,
            prefix: None,
            context: None,
            backend,
            model,
            tokenizer,
            dir: dir.to_path_buf(),
            workspace,
            max_batch: 1,
            memory_limit: None,
            cache_probe: None,
        })
    }

    /// Has long prompts read by `ranks` and this engine's model at once (context
    /// parallelism: the engine's model takes the last range), or, with `None`, in chunks as
    /// usual. Requests that ask for their prompt's logprobs, resume from the prefix cache or
    /// draft with a draft model read their prompts as usual.
    pub fn set_context_parallel(&mut self, ranks: Option<crate::context::ContextRanks<B>>) {
        self.context = ranks;
    }

    /// Prompt tokens a prefill chunk reads.
    pub fn prefill_chunk(&self) -> usize {
        self.workspace.chunk
    }

    /// Most requests a batch on this engine may hold (each step holds a prompt chunk beside
    /// a decode row for each).
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Lets batches hold `n` requests (at least 1): the workspace is made again for a
    /// chunk beside `n` decode rows.
    pub fn set_max_batch(&mut self, n: usize) -> Result<(), EngineError> {
        let n = n.max(1);
        if n != self.max_batch {
            let chunk = self.workspace.chunk;
            // The old workspace goes first, so the two are never held together.
            self.workspace = self.model.step_workspace(&self.backend, chunk, 0)?;
            self.workspace = self.model.step_workspace(&self.backend, chunk, n)?;
            self.max_batch = n;
        }
        Ok(())
    }

    /// From now on, every request's [`MemoryPlan`] must fit `limit` (`None` lifts it).
    pub fn set_memory_limit(&mut self, limit: Option<MemoryLimit>) {
        self.memory_limit = limit;
    }

    /// The memory limit requests are checked against, if any.
    pub fn memory_limit(&self) -> Option<MemoryLimit> {
        self.memory_limit.clone()
    }

    /// An empty cache budget under this engine's memory limit, for its step workspace on its
    /// backend.
    pub fn cache_budget(&self) -> CacheBudget {
        CacheBudget::new(&self.model.config, self.workspace.max_rows, &self.backend)
            .with_limit(self.memory_limit.clone())
            .with_resident(self.draft.as_ref().map_or(0, |d| d.model.resident_bytes()))
    }

    /// Keeps ended sequences for prompts that begin with their tokens, in at most
    /// `limit_bytes` (by the memory formula; parked sequences also go when a request needs
    /// their memory); `None` turns the prefix cache off and frees what it holds.
    pub fn set_prefix_cache(&mut self, limit_bytes: Option<usize>) {
        self.prefix = limit_bytes.map(crate::prefix::PrefixCache::new);
    }

    /// What the prefix cache has served, and the bytes it holds (by the memory formula, each
    /// parked sequence whole, though forks share pages); `None` when it is off.
    pub fn prefix_cache(&self) -> Option<(crate::prefix::PrefixStats, usize)> {
        self.prefix.as_ref().map(|p| (p.stats(), p.bytes()))
    }

    /// Sequences parked in the prefix cache, and the snapshots they hold.
    pub fn prefix_cache_entries(&self) -> (usize, usize) {
        self.prefix
            .as_ref()
            .map_or((0, 0), |p| (p.len(), p.snapshots()))
    }

    /// Lets the cache budget ask the backend what its caches hold (see [`CacheProbe`]).
    pub fn set_cache_probe(&mut self, probe: Option<Box<dyn CacheProbe<B>>>) {
        self.cache_probe = probe;
    }

    /// What the caches of `batch` hold: by the memory formula, and by the backend's count
    /// (or their plans where it cannot tell).
    pub fn cache_report<C>(&self, batch: &crate::step::Batch<B, C>) -> (usize, usize) {
        let probe = self
            .cache_probe
            .as_ref()
            .and_then(|p| p.cache_bytes_in_use(&self.backend));
        (batch.cache().held_bytes(), batch.cache().in_use(probe))
    }

    /// The plan of a sequence of `total_tokens` tokens on this engine's workspace and backend.
    pub fn memory_plan(&self, total_tokens: usize) -> MemoryPlan {
        self.cache_budget().plan(total_tokens)
    }

    /// Whether a sequence of `total_tokens` tokens fits the memory limit alone (always,
    /// without one).
    pub fn check_memory(&self, total_tokens: usize) -> Result<(), EngineError> {
        Ok(self.cache_budget().check(total_tokens)?)
    }

    pub fn backend_name(&self) -> String {
        self.backend.name()
    }

    /// EOS ids of the config and the tokenizer, deduplicated.
    pub fn eos_ids(&self) -> Vec<u32> {
        eos_ids(&self.model.config, &self.tokenizer)
    }

    /// Structured output's grammars for this model ([`GenerateOptions::grammar`]).
    /// Draft tokens verified so far, and how many stood.
    /// Makes `draft` the draft model of the requests that speculate with
    /// [`crate::draft::DraftSource::Model`].
    pub fn set_draft(
        &mut self,
        draft: sala_model::draft::DraftModel<B>,
    ) -> Result<(), EngineError> {
        let workspace = draft.workspace(&self.backend)?;
        self.draft = Some(crate::step::Drafting {
            model: draft,
            workspace,
        });
        Ok(())
    }

    /// The draft model, when one is set.
    pub fn draft_model(&self) -> Option<&sala_model::draft::DraftModel<B>> {
        self.draft.as_ref().map(|d| &d.model)
    }

    pub fn speculation_stats(&self) -> SpeculationStats {
        self.speculated
    }

    /// What the context-parallel ranks have read, when the engine has them.
    pub fn context_stats(&self) -> Option<crate::context::ContextStats> {
        self.context.as_ref().map(|c| c.stats())
    }

    pub fn grammars(&self) -> std::sync::Arc<Grammars> {
        self.grammars.clone()
    }

    /// Generates from `prompt` (token ids), calling `on_text` with each piece of text as it
    /// becomes final and `on_prefill(done)` as prompt chunks complete.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
        on_prefill: &mut dyn FnMut(usize),
    ) -> Result<Generation, EngineError> {
        self.generate_cancellable(
            prompt,
            opts,
            &mut |text| {
                on_text(text);
                true
            },
            on_prefill,
        )
    }

    /// Like [`Engine::generate`], but `on_text` returns whether to go on: when it returns
    /// `false`, generation ends at once with [`FinishReason::Cancelled`].
    pub fn generate_cancellable(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str) -> bool,
        on_prefill: &mut dyn FnMut(usize),
    ) -> Result<Generation, EngineError> {
        self.generate_steps(
            prompt,
            opts,
            None,
            &mut |step| match step.token {
                Some(t) if t.eos => true,
                _ => on_text(step.text),
            },
            on_prefill,
        )
    }

    /// Generates from `prompt` as a batch of one. `on_step` is called once per generated
    /// token (EOS included), then once with the final text (`token: None`); a token step
    /// that returns `false` ends generation at once with [`FinishReason::Cancelled`]. With
    /// `logprobs: Some(n)`, each token carries its raw log-probability and the `n` most
    /// likely tokens of its step.
    pub fn generate_steps(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        logprobs: Option<usize>,
        on_step: &mut dyn FnMut(Step<'_>) -> bool,
        on_prefill: &mut dyn FnMut(usize),
    ) -> Result<Generation, EngineError> {
        let start = Instant::now();
        let mut batch = self.batch();
        let mut prefilled = None;
        let mut done = None;
        self.admit(
            &mut batch,
            prompt.to_vec(),
            opts,
            logprobs,
            |ev: StepEvent<'_>| match ev {
                StepEvent::Read { tokens } => {
                    on_prefill(tokens);
                    true
                }
                StepEvent::Prefilled { .. } => {
                    prefilled = Some(Instant::now());
                    true
                }
                StepEvent::Token(step) => on_step(step),
                StepEvent::Done(result) => {
                    done = Some(result);
                    true
                }
            },
        )?;
        while !batch.is_empty() {
            self.step(&mut batch);
        }
        drop(batch);
        let end = Instant::now();
        let finished = done.expect("a request ends with Done")?;
        let prefilled = prefilled.unwrap_or(end);
        Ok(Generation {
            text: finished.text,
            tokens: finished.tokens,
            finish: finished.finish,
            prompt_tokens: prompt.len(),
            cached_tokens: finished.cached_tokens,
            prefill_time: prefilled - start,
            decode_time: end - prefilled,
        })
    }
}

impl<B: Backend> Engine<B> {
    /// The log-probability of each token of `prompt` given the tokens before it, with the
    /// `top` most likely tokens at each position: the prompt read as a batch of one through
    /// the same [`Engine::step`] as every batch, nothing generated. `on_read(tokens)` is
    /// called as prompt chunks are read. The prompt must be shorter than the model's
    /// `max_position_embeddings`.
    pub fn prompt_logprobs(
        &mut self,
        prompt: &[u32],
        top: usize,
        on_read: &mut dyn FnMut(usize),
    ) -> Result<PromptLogprobs, EngineError> {
        let opts = GenerateOptions {
            sampling: SamplingParams::default(),
            max_tokens: 0,
            max_context: self.model.config.max_position_embeddings,
            stop: Vec::new(),
            eos_ids: Vec::new(),
            grammar: None,
            prompt_logprobs: Some(top),
            speculate: None,
        };
        let mut batch = self.batch();
        let (mut scores, mut done) = (None, None);
        let client = |ev: StepEvent<'_>| {
            match ev {
                StepEvent::Read { tokens } => on_read(tokens),
                StepEvent::Prefilled { logprobs, .. } => scores = logprobs.cloned(),
                StepEvent::Done(result) => done = Some(result),
                StepEvent::Token(_) => {}
            }
            true
        };
        self.admit(&mut batch, prompt.to_vec(), &opts, None, client)?;
        while !batch.is_empty() {
            self.step(&mut batch);
        }
        drop(batch);
        done.expect("a request ends with Done")?;
        scores.ok_or_else(|| EngineError::Panicked("the prompt's logprobs were not made".into()))
    }
}

/// A token [`TokenStream::choose`] sampled, not yet reported.
pub struct Choice {
    tok: SampledToken,
    logprobs: Option<TokenLogprobs>,
}

impl Choice {
    /// The token's id.
    pub fn id(&self) -> u32 {
        self.tok.id
    }
}

/// The per-token half of one generation: sampling from each step's logits (under its grammar,
/// if any), EOS ids, stop strings, detokenization and the token budget. [`Engine::step`] drives one per request
/// of its batch: [`TokenStream::choose`] (for many streams at once), then
/// [`TokenStream::commit`].
pub struct TokenStream {
    sampler: Sampler,
    constraint: Option<Constraint>,
    stop: StopMatcher,
    detok: Detokenizer,
    eos_ids: Vec<u32>,
    logprobs: Option<usize>,
    budget: usize,
    pub tokens: Vec<SampledToken>,
    pub text: String,
    finish: Option<FinishReason>,
}

impl TokenStream {
    /// A stream for `prompt` that may generate `budget` tokens.
    pub fn new(
        tokenizer: &Tokenizer,
        vocab: usize,
        prompt: &[u32],
        opts: &GenerateOptions,
        budget: usize,
        logprobs: Option<usize>,
    ) -> Result<Self, EngineError> {
        let mut sampler = Sampler::new(opts.sampling.clone(), vocab)?;
        sampler.add_prompt(prompt)?;
        Ok(Self {
            sampler,
            constraint: opts.grammar.clone().map(Constraint::from),
            stop: StopMatcher::new(opts.stop.clone())?,
            detok: Detokenizer::new(tokenizer, true),
            eos_ids: opts.eos_ids.clone(),
            logprobs,
            budget,
            tokens: Vec::new(),
            text: String::new(),
            finish: (budget == 0).then_some(FinishReason::Length),
        })
    }

    /// The next token from `logits` (recorded for the sampler's penalties) and its logprobs
    /// when asked for; `None` once the stream has ended. A grammar first sets the logits it
    /// disallows to `-inf` (so logprobs are those of the allowed tokens). It reports nothing,
    /// so a batch runs it for many streams at once.
    pub fn choose(&mut self, logits: &mut StepLogits) -> Result<Option<Choice>, EngineError> {
        if self.finish.is_some() {
            return Ok(None);
        }
        #[cfg(test)]
        if self.sampler.params().seed == Some(crate::step::tests::PANIC_SEED) {
            panic!("injected panic in sampling");
        }
        let logits = match logits {
            StepLogits::Rows(rows) => rows.as_mut_slice(),
            StepLogits::Greedy(pick) if self.takes_greedy_pick() => {
                let tok = SampledToken {
                    id: pick.id.ok_or(SamplingError::NoValidLogits)?,
                    logprob: pick.logprob,
                };
                self.sampler.record_output(tok.id)?;
                return Ok(Some(Choice {
                    tok,
                    logprobs: None,
                }));
            }
            StepLogits::Greedy(_) => {
                return Err(BackendError("a greedy pick for a request that samples".into()).into())
            }
            StepLogits::GreedyRows(_) => {
                return Err(BackendError("every row's greedy pick for one token".into()).into())
            }
        };
        if let Some(c) = &mut self.constraint {
            c.apply(logits)?;
        }
        let tok = self.sampler.sample(logits)?;
        self.sampler.record_output(tok.id)?;
        Ok(Some(Choice {
            tok,
            // The raw logits, before the sampler's penalties and temperature.
            logprobs: self
                .logprobs
                .and_then(|n| token_logprobs(logits, tok.id, n)),
        }))
    }

    /// The tokens of a verified span ([`crate::sampling::Sampler::verify`]): `rows` holds the
    /// logits after the token fed and after each of the `drafts` (`[drafts.len() + 1, vocab]`);
    /// each draft in turn is accepted or replaced (which ends the span), and when all stand a
    /// token is drawn from the last row. Returns the choices and how many drafts stood.
    pub fn choose_span(
        &mut self,
        rows: &mut [f32],
        drafts: &[u32],
    ) -> Result<(Vec<Choice>, usize), EngineError> {
        let vocab = rows.len() / (drafts.len() + 1).max(1);
        if self.finish.is_some() || vocab == 0 || rows.len() != vocab * (drafts.len() + 1) {
            return match self.finish {
                Some(_) => Ok((Vec::new(), 0)),
                None => Err(BackendError(format!(
                    "{} logits for a span of {} drafts",
                    rows.len(),
                    drafts.len()
                ))
                .into()),
            };
        }
        let mut out = Vec::new();
        for (row, &draft) in rows.chunks_mut(vocab).zip(drafts) {
            let verdict = self.sampler.verify(row, draft)?;
            let (tok, stood) = match verdict {
                Verdict::Accepted(t) => (t, true),
                Verdict::Replaced(t) => (t, false),
            };
            self.sampler.record_output(tok.id)?;
            out.push(Choice {
                tok,
                logprobs: self.logprobs.and_then(|n| token_logprobs(row, tok.id, n)),
            });
            if !stood {
                let stood = out.len() - 1;
                return Ok((out, stood));
            }
        }
        let last = &mut rows[drafts.len() * vocab..];
        let tok = self.sampler.sample(last)?;
        self.sampler.record_output(tok.id)?;
        out.push(Choice {
            tok,
            logprobs: self.logprobs.and_then(|n| token_logprobs(last, tok.id, n)),
        });
        Ok((out, drafts.len()))
    }

    /// [`TokenStream::choose_span`] from every row's greedy pick
    /// ([`LogitRows::GreedyAll`](sala_model::LogitRows::GreedyAll)), for a stream that
    /// [`TokenStream::takes_greedy_pick`]: each draft stands iff it is its row's pick, and the
    /// first that does not is replaced by the pick, as greedy verification of the logits does.
    pub fn choose_span_greedy(
        &mut self,
        picks: &[GreedyPick],
        drafts: &[u32],
    ) -> Result<(Vec<Choice>, usize), EngineError> {
        if self.finish.is_some() {
            return Ok((Vec::new(), 0));
        }
        if picks.len() != drafts.len() + 1 || !self.takes_greedy_pick() {
            return Err(BackendError(format!(
                "{} greedy picks for a span of {} drafts{}",
                picks.len(),
                drafts.len(),
                if self.takes_greedy_pick() {
                    ""
                } else {
                    " of a request that samples"
                }
            ))
            .into());
        }
        let mut out = Vec::new();
        for (i, pick) in picks.iter().enumerate() {
            let tok = SampledToken {
                id: pick.id.ok_or(SamplingError::NoValidLogits)?,
                logprob: pick.logprob,
            };
            self.sampler.record_output(tok.id)?;
            out.push(Choice {
                tok,
                logprobs: None,
            });
            if drafts.get(i) != Some(&tok.id) {
                return Ok((out, i));
            }
        }
        Ok((out, drafts.len()))
    }

    /// Drafts this stream may verify next: none under a grammar (its masks follow one token at
    /// a time), and never past its token budget (the span's last token is one more).
    pub fn draft_room(&self) -> usize {
        if self.constraint.is_some() || self.finish.is_some() {
            return 0;
        }
        self.budget.saturating_sub(self.tokens.len() + 1)
    }

    /// True when this stream's next token is the argmax of the raw logits (greedy, no penalty,
    /// grammar or logprobs): the step then asks the backend for that pick
    /// ([`LogitRows::Greedy`](sala_model::LogitRows::Greedy)) instead of the logits.
    pub fn takes_greedy_pick(&self) -> bool {
        self.constraint.is_none() && self.logprobs.is_none() && self.sampler.is_plain_argmax()
    }

    /// The grammar whose next mask is still to be computed, if any ([`crate::step`] computes
    /// it beside the forward pass).
    pub fn pending_constraint(&mut self) -> Option<&mut Constraint> {
        self.constraint
            .as_mut()
            .filter(|c| self.finish.is_none() && c.needs_mask())
    }

    /// The rest of a token [`TokenStream::choose`] made: EOS, the grammar, text, stop strings,
    /// the budget, and the report through `on_step` (see [`Engine::generate_steps`]). Returns
    /// the token to feed the model next, or `None` once generation has ended (EOS, a complete
    /// grammar, a stop string, the budget, or `on_step` returning false).
    pub fn commit(
        &mut self,
        choice: Choice,
        on_step: &mut dyn FnMut(Step<'_>) -> bool,
    ) -> Result<Option<u32>, EngineError> {
        let tok = choice.tok;
        self.tokens.push(tok);
        let step = TokenStep {
            id: tok.id,
            eos: self.eos_ids.contains(&tok.id),
            logprobs: choice.logprobs,
        };
        if step.eos {
            on_step(Step {
                token: Some(&step),
                text: "",
            });
            self.finish = Some(FinishReason::Stop);
            return Ok(None);
        }
        let complete = match &mut self.constraint {
            Some(c) => c.advance(tok.id)?,
            None => false,
        };
        let piece = self.detok.push(tok.id)?.unwrap_or_default();
        let stopped = self.stop.push(&piece);
        let go_on = on_step(Step {
            token: Some(&step),
            text: &stopped.text,
        });
        self.text.push_str(&stopped.text);
        self.finish = if !go_on {
            Some(FinishReason::Cancelled)
        } else if stopped.stopped() || complete {
            Some(FinishReason::Stop)
        } else if self.tokens.len() >= self.budget {
            Some(FinishReason::Length)
        } else {
            None
        };
        Ok(self.finish.is_none().then_some(tok.id))
    }

    /// Ends the stream: unless cancelled, the text held back is flushed through `on_step`
    /// (`token: None`). Returns why generation ended.
    pub fn finish(
        &mut self,
        on_step: &mut dyn FnMut(Step<'_>) -> bool,
    ) -> Result<FinishReason, EngineError> {
        let mut finish = self.finish.unwrap_or(FinishReason::Cancelled);
        if finish != FinishReason::Cancelled && !self.stop.is_stopped() {
            let step = self.stop.push(&self.detok.finish()?);
            let stopped = step.stopped();
            let mut rest = step.text;
            if stopped {
                finish = FinishReason::Stop;
            } else {
                rest.push_str(&self.stop.finish());
            }
            on_step(Step {
                token: None,
                text: &rest,
            });
            self.text.push_str(&rest);
        }
        self.finish = Some(finish);
        Ok(finish)
    }
}
