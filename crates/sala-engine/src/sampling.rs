//! Next-token sampling.
//!
//! Processing order for every step:
//! logit bias → penalties → greedy (if `temperature == 0`) → temperature → top-k →
//! top-p → min-p → draw from the renormalised distribution.
//!
//! Logit hygiene: NaN logits are treated as `-inf`, `+inf` logits as `f32::MAX`
//! (so a `+inf` token dominates without producing NaN in the softmax).

use std::cmp::Ordering;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors from parameter validation and sampling.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum SamplingError {
    /// A parameter is out of its valid range; `param` is its field name.
    #[error("invalid sampling parameter `{param}`: {reason}")]
    InvalidParam { param: &'static str, reason: String },
    /// The logits slice does not have one entry per vocabulary token.
    #[error("logits have length {got}, expected the vocabulary size {expected}")]
    LogitsLength { expected: usize, got: usize },
    /// A token id is not below the vocabulary size.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    /// Every logit is `-inf` or NaN, so no token can be chosen.
    #[error("no token can be sampled: every logit is -inf or NaN")]
    NoValidLogits,
}

fn invalid(param: &'static str, reason: &str) -> SamplingError {
    SamplingError::InvalidParam {
        param,
        reason: reason.to_string(),
    }
}

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` disables.
    pub top_k: usize,
    /// Nucleus sampling mass in `(0, 1]`; `1` disables.
    pub top_p: f32,
    /// Drop tokens with probability below `min_p * max_prob`; `0` disables.
    pub min_p: f32,
    /// HF/CTRL repetition penalty over prompt and output tokens (> 0; `1`
    /// disables): positive logits are divided by it, negative ones multiplied.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over generated tokens: subtracted once from the
    /// logit of every token generated at least once.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over generated tokens: subtracted once per
    /// previous occurrence.
    pub frequency_penalty: f32,
    /// RNG seed; `None` seeds from the clock and std's random hasher keys.
    pub seed: Option<u64>,
    /// OpenAI logit bias: `(token, bias)`, the bias added to the token's logit before the
    /// penalties (in [-100, 100]; -100 all but bans a token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    /// Greedy decoding with every filter and penalty off.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks every parameter; the error names the first invalid one.
    pub fn validate(&self) -> Result<(), SamplingError> {
        // Comparisons are written so that NaN fails them.
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(invalid("temperature", "must be a finite number >= 0"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "must be in (0, 1]"));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(invalid("min_p", "must be in [0, 1]"));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(invalid("repetition_penalty", "must be a finite number > 0"));
        }
        if !self.presence_penalty.is_finite() {
            return Err(invalid("presence_penalty", "must be finite"));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(invalid("frequency_penalty", "must be finite"));
        }
        let mut seen = std::collections::HashSet::with_capacity(self.logit_bias.len());
        for &(id, bias) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&bias) {
                return Err(SamplingError::InvalidParam {
                    param: "logit_bias",
                    reason: format!("token {id}'s bias {bias} is not in [-100, 100]"),
                });
            }
            if !seen.insert(id) {
                return Err(SamplingError::InvalidParam {
                    param: "logit_bias",
                    reason: format!("token {id} is biased twice"),
                });
            }
        }
        Ok(())
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    fn uses_repetition_penalty(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    fn uses_count_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampledToken {
    pub id: u32,
    /// Log-probability of `id` under the processed distribution: after
    /// penalties and temperature, before top-k/top-p/min-p truncation (what
    /// vLLM calls processed logprobs). For greedy decoding the temperature is
    /// taken as 1, i.e. this is the log-softmax of the penalised logits.
    pub logprob: f32,
}

/// The generator (xoshiro256**), shared with the rest of the project.
pub use sala_checkpoint::rng::Rng;

/// A generator seeded from the clock, a process-wide counter and the random keys std draws
/// for `RandomState`. Not for cryptography.
pub fn rng_from_entropy() -> Rng {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.write_u64(COUNTER.fetch_add(1, AtomicOrdering::Relaxed));
    Rng::seed_from_u64(h.finish())
}

/// NaN → `-inf`, `+inf` → `f32::MAX`; everything else unchanged.
fn sanitize(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        f32::MAX
    } else {
        x
    }
}

/// Runs `f` inside a function compiled for AVX2 when the CPU has it, so that the loops it
/// inlines run 8 lanes wide instead of 4. The results are the same bits: Rust fuses no
/// multiply-adds, so only the vector width changes.
#[inline(always)]
fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// `exp(x)` for `x <= 0` (including `-inf`), written to auto-vectorise.
/// Relative error is a few 1e-7; results below ~1e-38 (x < -87) flush to 0.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = LN2_HI + LN2_LO; LN2_HI = 355/512 has 9 significant bits, so
    // n * LN2_HI is exact for the |n| <= 126 used here.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let shifted = xc * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // Taylor series of e^r to degree 7 for |r| <= ln(2) / 2.
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n from its exponent bits (n is in -126..=0). The low mantissa bits
    // of `shifted` hold n offset by those of ROUND.
    let biased = shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    if x > -87.0 {
        p * scale
    } else {
        0.0
    }
}

/// Sum in f64 of the entries `>= threshold`, over eight interleaved lanes so
/// that it vectorises.
#[inline(always)]
fn sum_at_least(xs: &[f32], threshold: f32) -> f64 {
    let mut lanes = [0.0f64; 8];
    let keep = |x: f32| if x >= threshold { x as f64 } else { 0.0 };
    let chunks = xs.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&x| keep(x)).sum();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += keep(x);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The first index of `x` in `xs` (0 if absent): a vectorised test of each 256-value block,
/// then a search in the first block that has it.
fn first_index_of(xs: &[f32], x: f32) -> usize {
    wide(|| {
        let mut base = 0;
        for block in xs.chunks(256) {
            if block.iter().fold(false, |any, &y| any | (y == x)) {
                return base + block.iter().position(|&y| y == x).unwrap_or(0);
            }
            base += block.len();
        }
        0
    })
}

/// `sum(exp(x - max))` over `xs` (all `x <= max`), vectorisable.
fn sum_exp_shifted(xs: &[f32], max: f32) -> f64 {
    wide(|| sum_exp_shifted_body(xs, max))
}

#[inline(always)]
fn sum_exp_shifted_body(xs: &[f32], max: f32) -> f64 {
    // Exponentiate a block into a stack buffer, then sum it: two simple
    // loops vectorise where one fused loop does not.
    let mut buf = [0.0f32; 256];
    let mut total = 0.0f64;
    for chunk in xs.chunks(buf.len()) {
        let buf = &mut buf[..chunk.len()];
        for (b, &x) in buf.iter_mut().zip(chunk) {
            *b = exp_nonpositive(x - max);
        }
        total += sum_at_least(buf, 0.0);
    }
    total
}

/// Descending by value, ties broken by the lower token id.
fn by_value_desc(values: &[f32], a: u32, b: u32) -> Ordering {
    values[b as usize]
        .total_cmp(&values[a as usize])
        .then(a.cmp(&b))
}

/// The maximum of the sanitised logits and `ln(sum(exp(x - max)))`, the log-normaliser of the
/// raw log-softmax; `None` when every logit is `-inf` or NaN. The exponentials are the
/// vectorised f32 ones (inputs `<= 0`), summed in f64.
fn log_normalizer(logits: &[f32]) -> Option<(f32, f64)> {
    wide(|| log_normalizer_body(logits))
}

#[inline(always)]
fn log_normalizer_body(logits: &[f32]) -> Option<(f32, f64)> {
    let max = logits
        .iter()
        .map(|&x| sanitize(x))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let mut buf = [0.0f32; 256];
    let mut sum = 0.0f64;
    for chunk in logits.chunks(buf.len()) {
        let buf = &mut buf[..chunk.len()];
        for (b, &x) in buf.iter_mut().zip(chunk) {
            *b = exp_nonpositive(sanitize(x) - max);
        }
        sum += sum_at_least(buf, 0.0);
    }
    Some((max, sum.ln()))
}

/// The `n` largest sanitised logits as `(id, logit)`, largest first, ties to the lower id;
/// `-inf` (and NaN) entries are left out. One pass, no allocation beyond the `n` entries.
fn top_n_logits(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return top;
    }
    for (i, &x) in logits.iter().enumerate() {
        let v = sanitize(x);
        // Ids arrive in increasing order, so an equal value never displaces an earlier id.
        if v == f32::NEG_INFINITY || (top.len() == n && v <= top[n - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= v);
        top.insert(at, (i as u32, v));
        top.truncate(n);
    }
    top
}

/// The `n` most likely tokens under the raw log-softmax of `logits`, most
/// likely first (ties: lower id first). NaN counts as `-inf`; tokens with
/// `-inf` logits are left out, so fewer than `n` may come back.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let Some((max, log_z)) = log_normalizer(logits) else {
        return Vec::new();
    };
    top_n_logits(logits, n)
        .into_iter()
        .map(|(i, v)| (i, (v as f64 - max as f64 - log_z) as f32))
        .collect()
}

/// A generated token's log-probability and the most likely alternatives at its step, under
/// the raw log-softmax of the model's logits (before penalties, temperature and truncation),
/// which is what OpenAI's `logprobs` report.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub id: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// [`TokenLogprobs`] of token `id` with the `n` most likely tokens, from one step's logits.
/// `None` when `id` is outside `logits` or every logit is `-inf` or NaN.
pub fn token_logprobs(logits: &[f32], id: u32, n: usize) -> Option<TokenLogprobs> {
    let x = sanitize(*logits.get(id as usize)?);
    let (max, log_z) = log_normalizer(logits)?;
    let top = top_n_logits(logits, n)
        .into_iter()
        .map(|(i, v)| (i, (v as f64 - max as f64 - log_z) as f32))
        .collect();
    Some(TokenLogprobs {
        id,
        logprob: (x as f64 - max as f64 - log_z) as f32,
        top,
    })
}

/// A prompt token's log-probability given the tokens before it (raw log-softmax, as
/// [`TokenLogprobs`]), its rank (1 + the tokens strictly more likely) and the most likely
/// tokens at its position, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTokenLogprobs {
    pub id: u32,
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<(u32, f32)>,
}

/// [`PromptTokenLogprobs`] of token `id` (below `logits.len()`) with the `n` most likely
/// tokens, from the logits of the position before it. When every logit is `-inf` or NaN the
/// logprob is `-inf` and no alternative is listed.
pub fn prompt_token_logprobs(logits: &[f32], id: u32, n: usize) -> PromptTokenLogprobs {
    let x = logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&x| sanitize(x));
    let rank = 1 + logits.iter().filter(|&&v| sanitize(v) > x).count() as u32;
    let Some((max, log_z)) = log_normalizer(logits) else {
        return PromptTokenLogprobs {
            id,
            logprob: f32::NEG_INFINITY,
            rank,
            top: Vec::new(),
        };
    };
    let top = top_n_logits(logits, n.min(logits.len()))
        .into_iter()
        .map(|(i, v)| (i, (v as f64 - max as f64 - log_z) as f32))
        .collect();
    PromptTokenLogprobs {
        id,
        logprob: (x as f64 - max as f64 - log_z) as f32,
        rank,
        top,
    }
}

/// What verifying a draft token gave ([`Sampler::verify`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// The draft stands.
    Accepted(SampledToken),
    /// The draft is rejected; this token takes its place (and ends the draft).
    Replaced(SampledToken),
}

/// Which tokens survive truncation, and their total weight.
#[derive(Debug, Clone, Copy)]
enum Support {
    /// Every token with weight `> 0` and `>= threshold`, in id order.
    Threshold { threshold: f32, total: f64 },
    /// The first `len` entries of the candidate buffer (in no useful order).
    Prefix { len: usize, total: f64 },
}

/// Weights per chunk when locating a draw over the whole vocabulary.
const DRAW_CHUNK: usize = 1024;

/// Weights per block when bounding the k-th largest weight for top-k.
const TOP_K_BLOCK: usize = 64;

/// Candidate ranges at most this long are sorted instead of partitioned.
const NUCLEUS_SORT_BELOW: usize = 32;

/// Per-sequence sampler: parameters, RNG, penalty records and scratch buffers.
///
/// Penalties read two records kept here: prompt tokens, added once with
/// [`Sampler::add_prompt`], and generated tokens, each added with
/// [`Sampler::record_output`]. [`Sampler::sample`] does not record the token
/// it returns: the caller records every token it accepts into the sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    vocab_size: usize,
    rng: Rng,
    /// Bitset of tokens seen in prompt or output (repetition penalty only).
    seen_bits: Vec<u64>,
    /// Distinct ids set in `seen_bits`.
    seen_ids: Vec<u32>,
    /// Occurrences of each generated token (presence/frequency only).
    out_counts: Vec<u32>,
    /// Distinct ids with a non-zero count.
    out_ids: Vec<u32>,
    /// Processed logits of the current step.
    work: Vec<f32>,
    /// Unnormalised probabilities `exp(work)` (max weight 1).
    weights: Vec<f32>,
    /// Candidate ids for truncation.
    idx: Vec<u32>,
    /// Per-block maximum weights (top-k prefilter).
    block_max: Vec<f32>,
}

impl Sampler {
    /// Validates `params` and prepares buffers for `vocab_size` tokens.
    pub fn new(params: SamplingParams, vocab_size: usize) -> Result<Self, SamplingError> {
        params.validate()?;
        if vocab_size == 0 || vocab_size - 1 > u32::MAX as usize {
            return Err(invalid("vocab_size", "must be in 1..=2^32"));
        }
        if let Some(&(id, _)) = params
            .logit_bias
            .iter()
            .find(|&&(id, _)| id as usize >= vocab_size)
        {
            return Err(SamplingError::InvalidParam {
                param: "logit_bias",
                reason: format!("token {id} is outside the vocabulary of {vocab_size} tokens"),
            });
        }
        let rng = match params.seed {
            Some(seed) => Rng::seed_from_u64(seed),
            None => rng_from_entropy(),
        };
        let seen_bits = if params.uses_repetition_penalty() {
            vec![0; vocab_size.div_ceil(64)]
        } else {
            Vec::new()
        };
        let out_counts = if params.uses_count_penalties() {
            vec![0; vocab_size]
        } else {
            Vec::new()
        };
        let greedy = params.is_greedy();
        let truncates = !greedy && (params.top_k > 0 || params.top_p < 1.0);
        Ok(Self {
            params,
            vocab_size,
            rng,
            seen_bits,
            seen_ids: Vec::new(),
            out_counts,
            out_ids: Vec::new(),
            work: vec![0.0; vocab_size],
            weights: if greedy {
                Vec::new()
            } else {
                vec![0.0; vocab_size]
            },
            idx: Vec::with_capacity(if truncates { vocab_size } else { 0 }),
            block_max: Vec::with_capacity(if truncates {
                vocab_size.div_ceil(TOP_K_BLOCK)
            } else {
                0
            }),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn check_id(&self, id: u32) -> Result<(), SamplingError> {
        if (id as usize) < self.vocab_size {
            Ok(())
        } else {
            Err(SamplingError::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size,
            })
        }
    }

    fn mark_seen(&mut self, id: u32) {
        if self.seen_bits.is_empty() {
            return;
        }
        let (word, bit) = (id as usize / 64, 1u64 << (id % 64));
        if self.seen_bits[word] & bit == 0 {
            self.seen_bits[word] |= bit;
            self.seen_ids.push(id);
        }
    }

    /// Records prompt tokens for the repetition penalty. Nothing is recorded
    /// if any id is out of range.
    pub fn add_prompt(&mut self, tokens: &[u32]) -> Result<(), SamplingError> {
        for &id in tokens {
            self.check_id(id)?;
        }
        for &id in tokens {
            self.mark_seen(id);
        }
        Ok(())
    }

    /// Records a generated token (sampled or forced) for the penalties.
    pub fn record_output(&mut self, id: u32) -> Result<(), SamplingError> {
        self.check_id(id)?;
        self.mark_seen(id);
        if !self.out_counts.is_empty() {
            let c = &mut self.out_counts[id as usize];
            if *c == 0 {
                self.out_ids.push(id);
            }
            *c = c.saturating_add(1);
        }
        Ok(())
    }

    /// Applies the logit bias, then the repetition, presence and frequency penalties, in
    /// place. Entries it changes are sanitised (NaN → `-inf`, `+inf` → `f32::MAX`).
    pub fn apply_penalties(&self, logits: &mut [f32]) -> Result<(), SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        for &(id, bias) in &self.params.logit_bias {
            let x = &mut logits[id as usize];
            *x = sanitize(*x + bias);
        }
        let rp = self.params.repetition_penalty;
        if self.params.uses_repetition_penalty() {
            for &id in &self.seen_ids {
                let x = &mut logits[id as usize];
                *x = sanitize(if *x > 0.0 { *x / rp } else { *x * rp });
            }
        }
        if self.params.uses_count_penalties() {
            let (presence, frequency) =
                (self.params.presence_penalty, self.params.frequency_penalty);
            for &id in &self.out_ids {
                let count = self.out_counts[id as usize] as f32;
                let x = &mut logits[id as usize];
                *x = sanitize(*x - (presence + frequency * count));
            }
        }
        Ok(())
    }

    /// True when the next token is the first argmax of the raw logits (greedy, no penalty,
    /// no bias), so that a backend's greedy pick serves instead of the logits.
    pub fn is_plain_argmax(&self) -> bool {
        self.params.is_greedy()
            && !self.params.uses_repetition_penalty()
            && !self.params.uses_count_penalties()
            && self.params.logit_bias.is_empty()
    }

    /// Samples the next token from `logits` (one per vocabulary entry). The
    /// token is not recorded; call [`Sampler::record_output`] to accept it.
    pub fn sample(&mut self, logits: &[f32]) -> Result<SampledToken, SamplingError> {
        let max = self.load(logits)?;
        if self.params.is_greedy() {
            // First index holding the maximum: ties go to the lowest id.
            let id = first_index_of(&self.work, max);
            let sum = sum_exp_shifted(&self.work, max);
            return Ok(SampledToken {
                id: id as u32,
                logprob: -sum.ln() as f32,
            });
        }
        let total = self.scale_and_exponentiate(max);
        let support = self.truncate(total);
        let id = self.draw(support);
        let logprob = self.work[id as usize] as f64 - total.ln();
        Ok(SampledToken {
            id,
            logprob: logprob as f32,
        })
    }

    /// Verifies a draft token against `logits` (speculative decoding, a draft that proposed
    /// `draft` for certain, as prompt lookup does): greedy, it is accepted iff it is the
    /// token [`Sampler::sample`] picks, else that token replaces it; sampling, it is accepted
    /// with its probability p(draft) under the processed distribution, else a token is drawn
    /// from that distribution without the draft (renormalised). Either way the token that
    /// comes out is distributed as [`Sampler::sample`]'s. Nothing is recorded.
    pub fn verify(&mut self, logits: &[f32], draft: u32) -> Result<Verdict, SamplingError> {
        self.check_id(draft)?;
        if self.params.is_greedy() {
            let tok = self.sample(logits)?;
            return Ok(if tok.id == draft {
                Verdict::Accepted(tok)
            } else {
                Verdict::Replaced(tok)
            });
        }
        let max = self.load(logits)?;
        let total = self.scale_and_exponentiate(max);
        let support = self.truncate(total);
        let d = draft as usize;
        let w = self.weights[d];
        let (kept, mass) = match support {
            Support::Threshold { threshold, total } => (w > 0.0 && w >= threshold, total),
            Support::Prefix { len, total } => (w > 0.0 && self.idx[..len].contains(&draft), total),
        };
        let logprob = |s: &Self, id: u32| (s.work[id as usize] as f64 - total.ln()) as f32;
        if kept && self.rng.next_f64() * mass < w as f64 {
            return Ok(Verdict::Accepted(SampledToken {
                id: draft,
                logprob: logprob(self, draft),
            }));
        }
        // The residual: the distribution without the draft.
        let rest = if kept { mass - w as f64 } else { mass };
        self.weights[d] = 0.0;
        let id = self.draw(match support {
            Support::Threshold { threshold, .. } => Support::Threshold {
                threshold,
                total: rest,
            },
            Support::Prefix { len, .. } => Support::Prefix { len, total: rest },
        });
        Ok(Verdict::Replaced(SampledToken {
            id,
            logprob: logprob(self, id),
        }))
    }

    /// Fills `work` with sanitised, penalised logits; returns their maximum.
    fn load(&mut self, logits: &[f32]) -> Result<f32, SamplingError> {
        wide(|| self.load_body(logits))
    }

    #[inline(always)]
    fn load_body(&mut self, logits: &[f32]) -> Result<f32, SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        let mut work = std::mem::take(&mut self.work);
        for (w, &x) in work.iter_mut().zip(logits) {
            *w = sanitize(x);
        }
        let penalised = self.apply_penalties(&mut work);
        self.work = work;
        penalised?;
        let max = self.work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::NoValidLogits);
        }
        Ok(max)
    }

    /// `work ← (work - max) / temperature`, `weights ← exp(work)`; returns the
    /// sum of weights. The shift first keeps tiny temperatures from
    /// overflowing to `+inf`.
    fn scale_and_exponentiate(&mut self, max: f32) -> f64 {
        let t = self.params.temperature;
        wide(|| {
            for (x, w) in self.work.iter_mut().zip(self.weights.iter_mut()) {
                *x = (*x - max) / t;
                *w = exp_nonpositive(*x);
            }
            sum_at_least(&self.weights, 0.0)
        })
    }

    /// Applies top-k, top-p and min-p to the current weights.
    fn truncate(&mut self, total: f64) -> Support {
        let p = &self.params;
        let (top_k, top_p, min_p) = (p.top_k, p.top_p, p.min_p);
        let weights = &self.weights;
        if top_k == 0 && top_p >= 1.0 {
            // Only min-p (or nothing): a threshold, no sorting needed. The
            // largest weight is exactly 1, so min_p * max_prob is min_p.
            let total = if min_p > 0.0 {
                sum_at_least(weights, min_p)
            } else {
                total
            };
            return Support::Threshold {
                threshold: min_p,
                total,
            };
        }
        // Min-p keeps a prefix of the sorted order, so without top-k it can be
        // applied first to shrink the candidates. With top-k it cannot: top-p
        // renormalises over the whole top-k set.
        let mut floor = if top_k == 0 { min_p } else { 0.0 };
        if top_k > 0 && top_k <= weights.len() / TOP_K_BLOCK {
            // The k-th largest block maximum bounds the k-th largest weight
            // from below (k blocks each hold a weight that large), so tokens
            // under it cannot be in the top k.
            self.block_max.clear();
            self.block_max.extend(
                weights
                    .chunks(TOP_K_BLOCK)
                    .map(|c| c.iter().copied().fold(0.0, f32::max)),
            );
            let (_, kth, _) = self
                .block_max
                .select_nth_unstable_by(top_k - 1, |a, b| b.total_cmp(a));
            floor = *kth;
        }
        self.idx.clear();
        self.idx.extend(
            weights
                .iter()
                .enumerate()
                .filter(|&(_, &w)| w > 0.0 && w >= floor)
                .map(|(i, _)| i as u32),
        );
        let work = &self.work;
        let cmp = |a: &u32, b: &u32| by_value_desc(work, *a, *b);
        let idx = &mut self.idx;
        let n = idx.len();
        // Candidates are only partitioned, never fully sorted: the draw does
        // not depend on their order.
        let mut len = if top_k > 0 {
            let k = top_k.min(n);
            if k < n {
                idx.select_nth_unstable_by(k - 1, cmp);
            }
            if top_p < 1.0 {
                let top_k_total: f64 = idx[..k].iter().map(|&i| weights[i as usize] as f64).sum();
                let target = top_p as f64 * top_k_total;
                nucleus(&mut idx[..k], weights, cmp, target)
            } else {
                k
            }
        } else {
            nucleus(idx, weights, cmp, top_p as f64 * total)
        };
        if min_p > 0.0 && top_k > 0 {
            // Keep entries with weight >= min_p (the top one has weight 1).
            let mut kept = 0;
            for j in 0..len {
                if weights[idx[j] as usize] >= min_p {
                    idx.swap(kept, j);
                    kept += 1;
                }
            }
            len = kept;
        }
        let total = idx[..len].iter().map(|&i| weights[i as usize] as f64).sum();
        Support::Prefix { len, total }
    }

    /// Draws one token of `support` with probability proportional to weight.
    fn draw(&mut self, support: Support) -> u32 {
        let weights = &self.weights;
        match support {
            Support::Threshold { threshold, total } => {
                let u = self.rng.next_f64() * total;
                // Find the chunk holding `u` from chunk sums, then scan it.
                let mut cum = 0.0f64;
                let mut last_chunk = 0;
                for (c, chunk) in weights.chunks(DRAW_CHUNK).enumerate() {
                    let mass = sum_at_least(chunk, threshold);
                    if mass > 0.0 {
                        last_chunk = c;
                        if u < cum + mass {
                            return draw_in(chunk_pairs(c, chunk), threshold, u - cum);
                        }
                    }
                    cum += mass;
                }
                // Rounding put `u` past the end: use the last chunk with mass.
                let start = last_chunk * DRAW_CHUNK;
                let chunk = &weights[start..(start + DRAW_CHUNK).min(weights.len())];
                draw_in(chunk_pairs(last_chunk, chunk), threshold, f64::INFINITY)
            }
            Support::Prefix { len, total } => {
                let u = self.rng.next_f64() * total;
                let pairs = self.idx[..len].iter().map(|&i| (i, weights[i as usize]));
                draw_in(pairs, 0.0, u)
            }
        }
    }
}

/// `(token id, weight)` pairs of chunk number `c` of the weights.
fn chunk_pairs(c: usize, chunk: &[f32]) -> impl Iterator<Item = (u32, f32)> + '_ {
    let start = c * DRAW_CHUNK;
    chunk
        .iter()
        .enumerate()
        .map(move |(j, &w)| ((start + j) as u32, w))
}

/// The first id at which the running sum of eligible weights (`> 0` and
/// `>= threshold`) exceeds `u`, or the last eligible id if none does.
fn draw_in(pairs: impl Iterator<Item = (u32, f32)>, threshold: f32, u: f64) -> u32 {
    let mut cum = 0.0f64;
    let mut last = 0;
    for (id, w) in pairs {
        if w > 0.0 && w >= threshold {
            cum += w as f64;
            last = id;
            if u < cum {
                return id;
            }
        }
    }
    last
}

/// Top-p by weighted quickselect: reorders `ids` so that its first `len`
/// entries are the smallest head of the `cmp` order whose weight reaches
/// `target`, and returns `len` (all of `ids` if the target is never reached).
/// Expected linear time; only the last few candidates get sorted.
fn nucleus(
    ids: &mut [u32],
    weights: &[f32],
    cmp: impl Fn(&u32, &u32) -> Ordering + Copy,
    target: f64,
) -> usize {
    let weight = |i: &u32| weights[*i as usize] as f64;
    // Invariant: ids[..lo] are all in the nucleus with total weight `cum`, the
    // cut lies in lo + 1..=hi, and ids[lo..hi] precede everything after hi.
    let (mut lo, mut hi) = (0, ids.len());
    let mut cum = 0.0f64;
    while hi - lo > NUCLEUS_SORT_BELOW {
        let mid = lo + (hi - lo) / 2;
        ids[lo..hi].select_nth_unstable_by(mid - lo, cmp);
        let upper: f64 = ids[lo..=mid].iter().map(weight).sum();
        if cum + upper >= target {
            hi = mid + 1;
        } else {
            cum += upper;
            lo = mid + 1;
        }
    }
    ids[lo..hi].sort_unstable_by(cmp);
    for (j, i) in ids[lo..hi].iter().enumerate() {
        cum += weight(i);
        if cum >= target {
            return lo + j + 1;
        }
    }
    hi
}

#[cfg(test)]
mod tests;
