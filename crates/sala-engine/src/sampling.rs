//! Next-token sampling.
//!
//! Processing order for every step:
//! penalties → greedy (if `temperature == 0`) → temperature → top-k → top-p →
//! min-p → draw from the renormalised distribution.
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

    /// Applies repetition, presence and frequency penalties in place. Entries
    /// it changes are sanitised (NaN → `-inf`, `+inf` → `f32::MAX`).
    pub fn apply_penalties(&self, logits: &mut [f32]) -> Result<(), SamplingError> {
        if logits.len() != self.vocab_size {
            return Err(SamplingError::LogitsLength {
                expected: self.vocab_size,
                got: logits.len(),
            });
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

    /// True when the next token is the first argmax of the raw logits (greedy, no penalty),
    /// so that a backend's greedy pick serves instead of the logits.
    pub fn is_plain_argmax(&self) -> bool {
        self.params.is_greedy()
            && !self.params.uses_repetition_penalty()
            && !self.params.uses_count_penalties()
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
mod tests {
    use super::*;

    fn params(edit: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            temperature: 1.0,
            seed: Some(1),
            ..SamplingParams::default()
        };
        edit(&mut p);
        p
    }

    fn ln_probs(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    fn log_softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        logits.iter().map(|&x| x as f64 - lse).collect()
    }

    /// Ids that survive truncation, ascending.
    fn support(sampler: &mut Sampler, logits: &[f32]) -> Vec<u32> {
        let max = sampler.load(logits).unwrap();
        let total = sampler.scale_and_exponentiate(max);
        let mut ids: Vec<u32> = match sampler.truncate(total) {
            Support::Prefix { len, .. } => sampler.idx[..len].to_vec(),
            Support::Threshold { threshold, .. } => (0..logits.len() as u32)
                .filter(|&i| {
                    let w = sampler.weights[i as usize];
                    w > 0.0 && w >= threshold
                })
                .collect(),
        };
        ids.sort_unstable();
        ids
    }

    /// Straightforward full-sort version of the truncation rules.
    fn reference_support(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let clean: Vec<f32> = logits.iter().map(|&x| sanitize(x)).collect();
        let max = clean.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let work: Vec<f32> = clean.iter().map(|&x| (x - max) / p.temperature).collect();
        let w: Vec<f32> = work.iter().map(|&x| exp_nonpositive(x)).collect();
        let total = sum_at_least(&w, 0.0);
        let mut order: Vec<u32> = (0..w.len() as u32)
            .filter(|&i| w[i as usize] > 0.0)
            .collect();
        order.sort_by(|&a, &b| by_value_desc(&work, a, b));
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let mass = if p.top_k > 0 {
                order.iter().map(|&i| w[i as usize] as f64).sum()
            } else {
                total
            };
            let mut cum = 0.0;
            let mut cut = order.len();
            for (j, &i) in order.iter().enumerate() {
                cum += w[i as usize] as f64;
                if cum >= p.top_p as f64 * mass {
                    cut = j + 1;
                    break;
                }
            }
            order.truncate(cut);
        }
        order.retain(|&i| w[i as usize] >= p.min_p);
        order.sort_unstable();
        order
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        for k in 0..870_000 {
            let x = -(k as f32) * 1e-4;
            let exact = (x as f64).exp();
            let rel = (exp_nonpositive(x) as f64 - exact).abs() / exact;
            worst = worst.max(rel);
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn wide_loops_give_the_narrow_bits_and_first_index_is_position() {
        let mut rng = Rng::seed_from_u64(21);
        for n in [1usize, 7, 255, 256, 257, 1000, 73_448] {
            let xs: Vec<f32> = (0..n)
                .map(|_| (rng.next_f64() * 40.0 - 30.0) as f32)
                .collect();
            let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // On a CPU with AVX2 the first runs 8 lanes wide, the second as compiled.
            assert_eq!(
                sum_exp_shifted(&xs, max).to_bits(),
                sum_exp_shifted_body(&xs, max).to_bits(),
                "n {n}"
            );
            let (a, b) = (log_normalizer(&xs), log_normalizer_body(&xs));
            assert_eq!(
                a.map(|(m, l)| (m, l.to_bits())),
                b.map(|(m, l)| (m, l.to_bits()))
            );
            // The maximum, a value placed at block edges (first occurrence wins), and absence.
            assert_eq!(
                first_index_of(&xs, max),
                xs.iter().position(|&x| x == max).unwrap()
            );
            for at in [0, 255, 256, n / 2, n - 1] {
                let mut ys = xs.clone();
                if at < n {
                    ys[at] = 99.0;
                    let twin = (at + 300).min(n - 1);
                    ys[twin] = 99.0;
                    assert_eq!(first_index_of(&ys, 99.0), at.min(twin), "n {n} at {at}");
                }
            }
            assert_eq!(first_index_of(&xs, 1e9), 0);
        }
    }

    #[test]
    fn uniform_f64_is_in_range_and_centred() {
        let mut rng = Rng::seed_from_u64(3);
        let n = 100_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let u = rng.next_f64();
            assert!((0.0..1.0).contains(&u));
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
    }

    #[test]
    fn default_is_valid_greedy() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn validation_names_the_parameter() {
        let cases: Vec<(&str, SamplingParams)> = vec![
            ("temperature", params(|p| p.temperature = -0.1)),
            ("temperature", params(|p| p.temperature = f32::NAN)),
            ("temperature", params(|p| p.temperature = f32::INFINITY)),
            ("top_p", params(|p| p.top_p = 0.0)),
            ("top_p", params(|p| p.top_p = 1.01)),
            ("top_p", params(|p| p.top_p = f32::NAN)),
            ("min_p", params(|p| p.min_p = -0.01)),
            ("min_p", params(|p| p.min_p = 1.5)),
            ("min_p", params(|p| p.min_p = f32::NAN)),
            ("repetition_penalty", params(|p| p.repetition_penalty = 0.0)),
            (
                "repetition_penalty",
                params(|p| p.repetition_penalty = -1.0),
            ),
            (
                "repetition_penalty",
                params(|p| p.repetition_penalty = f32::NAN),
            ),
            (
                "repetition_penalty",
                params(|p| p.repetition_penalty = f32::INFINITY),
            ),
            (
                "presence_penalty",
                params(|p| p.presence_penalty = f32::INFINITY),
            ),
            (
                "presence_penalty",
                params(|p| p.presence_penalty = f32::NAN),
            ),
            (
                "frequency_penalty",
                params(|p| p.frequency_penalty = f32::NEG_INFINITY),
            ),
            (
                "frequency_penalty",
                params(|p| p.frequency_penalty = f32::NAN),
            ),
        ];
        for (name, p) in cases {
            let err = p.validate().unwrap_err();
            assert!(
                matches!(&err, SamplingError::InvalidParam { param, .. } if *param == name),
                "{name}: {err:?}"
            );
            assert!(err.to_string().contains(name));
            assert_eq!(Sampler::new(p, 4).unwrap_err(), err);
        }
        let err = Sampler::new(SamplingParams::default(), 0).unwrap_err();
        assert!(matches!(
            err,
            SamplingError::InvalidParam {
                param: "vocab_size",
                ..
            }
        ));
        // Boundary values are accepted.
        let ok = params(|p| {
            p.top_p = 1.0;
            p.min_p = 1.0;
            p.temperature = 0.0;
            p.presence_penalty = -2.0;
            p.frequency_penalty = 2.0;
        });
        assert_eq!(ok.validate(), Ok(()));
    }

    #[test]
    fn bad_lengths_and_ids_are_errors() {
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 1.5), 4).unwrap();
        assert_eq!(
            s.sample(&[0.0; 3]).unwrap_err(),
            SamplingError::LogitsLength {
                expected: 4,
                got: 3
            }
        );
        assert_eq!(
            s.add_prompt(&[1, 4]).unwrap_err(),
            SamplingError::TokenOutOfRange {
                id: 4,
                vocab_size: 4
            }
        );
        // Nothing was recorded by the failed call.
        let mut logits = [1.0f32; 4];
        s.apply_penalties(&mut logits).unwrap();
        assert_eq!(logits, [1.0; 4]);
        assert!(s.record_output(9).is_err());
        assert!(s.apply_penalties(&mut [0.0; 5]).is_err());
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default(), 5).unwrap();
        let logits = [0.5, 3.0, -1.0, 3.0, 2.9];
        let t = s.sample(&logits).unwrap();
        assert_eq!(t.id, 1);
        let expected = log_softmax(&logits)[1];
        assert!((t.logprob as f64 - expected).abs() < 1e-6);

        let mut rng = Rng::seed_from_u64(11);
        let mut s = Sampler::new(SamplingParams::default(), 1000).unwrap();
        for _ in 0..20 {
            let logits: Vec<f32> = (0..1000).map(|_| rng.next_f64() as f32 * 10.0).collect();
            let argmax = (0..1000)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap();
            assert_eq!(s.sample(&logits).unwrap().id as usize, argmax);
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut rng = Rng::seed_from_u64(5);
        let mut s = Sampler::new(params(|p| p.top_k = 1), 500).unwrap();
        for _ in 0..50 {
            let logits: Vec<f32> = (0..500).map(|_| rng.next_f64() as f32).collect();
            let argmax = (0..500)
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap();
            let t = s.sample(&logits).unwrap();
            assert_eq!(t.id as usize, argmax);
            // Processed logprob is taken before truncation, so it is not 0.
            let expected = log_softmax(&logits)[argmax];
            assert!((t.logprob as f64 - expected).abs() < 1e-5);
        }
    }

    #[test]
    fn seeded_sampling_is_deterministic_and_seed_dependent() {
        let logits = vec![0.0f32; 100];
        let run = |seed: Option<u64>| {
            let mut s = Sampler::new(params(|p| p.seed = seed), 100).unwrap();
            (0..50)
                .map(|_| s.sample(&logits).unwrap().id)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(Some(42)), run(Some(42)));
        assert_ne!(run(Some(42)), run(Some(43)));
        assert_ne!(run(None), run(None));
    }

    /// Pearson chi-square statistic of `counts` against `probs`.
    fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn draw_counts(p: SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut s = Sampler::new(p, logits.len()).unwrap();
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[s.sample(logits).unwrap().id as usize] += 1;
        }
        counts
    }

    #[test]
    fn temperature_one_matches_distribution() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let counts = draw_counts(params(|_| {}), &ln_probs(&probs), 40_000);
        // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
        let chi2 = chi_square(&counts, &probs);
        assert!(chi2 < 16.27, "chi2 = {chi2}, counts = {counts:?}");
    }

    #[test]
    fn temperature_two_flattens_distribution() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let root: Vec<f64> = probs.iter().map(|p: &f64| p.sqrt()).collect();
        let z: f64 = root.iter().sum();
        let expected: Vec<f64> = root.iter().map(|r| r / z).collect();
        let counts = draw_counts(params(|p| p.temperature = 2.0), &ln_probs(&probs), 40_000);
        let chi2 = chi_square(&counts, &expected);
        assert!(chi2 < 16.27, "chi2 = {chi2}, counts = {counts:?}");
        // The untempered distribution is rejected by the same bound.
        assert!(chi_square(&counts, &probs) > 100.0);
    }

    #[test]
    fn draws_across_chunks_match_distribution() {
        // Mass spread over several draw chunks; everything else is masked.
        let hot = [5u32, 1000, 1100, 2047, 2048, 2999];
        let probs = [0.05, 0.1, 0.15, 0.2, 0.25, 0.25];
        let mut logits = vec![f32::NEG_INFINITY; 3000];
        for (&id, &p) in hot.iter().zip(&probs) {
            logits[id as usize] = (p as f32).ln();
        }
        for edit in [
            (|_: &mut SamplingParams| {}) as fn(&mut SamplingParams),
            |p| p.min_p = 0.01,
            |p| p.top_p = 0.9999,
            |p| p.top_k = 10,
        ] {
            let p = params(edit);
            let counts = draw_counts(p.clone(), &logits, 40_000);
            let hot_counts: Vec<usize> = hot.iter().map(|&i| counts[i as usize]).collect();
            assert_eq!(hot_counts.iter().sum::<usize>(), 40_000, "{p:?}");
            // 5 degrees of freedom: P(chi2 > 20.52) = 0.001.
            let chi2 = chi_square(&hot_counts, &probs);
            assert!(
                chi2 < 20.52,
                "{p:?}: chi2 = {chi2}, counts = {hot_counts:?}"
            );
        }
    }

    #[test]
    fn top_k_draws_follow_renormalised_distribution() {
        let probs = [0.1, 0.2, 0.3, 0.4];
        let counts = draw_counts(params(|p| p.top_k = 2), &ln_probs(&probs), 20_000);
        assert_eq!(&counts[..2], &[0, 0]);
        // 1 degree of freedom: P(chi2 > 10.83) = 0.001.
        let chi2 = chi_square(&counts[2..], &[3.0 / 7.0, 4.0 / 7.0]);
        assert!(chi2 < 10.83, "chi2 = {chi2}, counts = {counts:?}");
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let logits = ln_probs(&[0.5, 0.2, 0.15, 0.1, 0.05]);
        let cases: [(f32, &[u32]); 4] = [
            (0.3, &[0]),
            (0.6, &[0, 1]),
            (0.8, &[0, 1, 2]),
            (0.9, &[0, 1, 2, 3]),
        ];
        for (top_p, expected) in cases {
            let mut s = Sampler::new(params(|p| p.top_p = top_p), 5).unwrap();
            assert_eq!(support(&mut s, &logits), expected, "top_p = {top_p}");
            for _ in 0..200 {
                assert!(expected.contains(&s.sample(&logits).unwrap().id));
            }
        }
        // At least one token survives even for a tiny top_p.
        let mut s = Sampler::new(params(|p| p.top_p = 1e-9), 5).unwrap();
        assert_eq!(support(&mut s, &logits), [0]);
    }

    #[test]
    fn top_k_ties_keep_lowest_ids() {
        let logits = [1.0f32, 2.0, 1.0, 1.0, 1.0];
        let mut s = Sampler::new(params(|p| p.top_k = 3), 5).unwrap();
        assert_eq!(support(&mut s, &logits), [0, 1, 2]);
    }

    #[test]
    fn top_p_renormalises_over_top_k() {
        let logits = ln_probs(&[0.4, 0.3, 0.2, 0.1]);
        let mut s = Sampler::new(params(|p| p.top_p = 0.55), 4).unwrap();
        assert_eq!(support(&mut s, &logits), [0, 1]);
        // Within the top 2, token 0 has 0.4 / 0.7 > 0.55 on its own.
        let mut s = Sampler::new(
            params(|p| {
                p.top_p = 0.55;
                p.top_k = 2;
            }),
            4,
        )
        .unwrap();
        assert_eq!(support(&mut s, &logits), [0]);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = ln_probs(&[0.5, 0.3, 0.15, 0.05]);
        let cases: [(f32, usize, &[u32]); 5] = [
            (0.25, 0, &[0, 1, 2]),
            (0.5, 0, &[0, 1]),
            (1.0, 0, &[0]),
            (0.5, 3, &[0, 1]),
            (0.05, 0, &[0, 1, 2, 3]),
        ];
        for (min_p, top_k, expected) in cases {
            let mut s = Sampler::new(
                params(|p| {
                    p.min_p = min_p;
                    p.top_k = top_k;
                }),
                4,
            )
            .unwrap();
            assert_eq!(support(&mut s, &logits), expected, "min_p = {min_p}");
            for _ in 0..200 {
                assert!(expected.contains(&s.sample(&logits).unwrap().id));
            }
        }
    }

    #[test]
    fn truncation_matches_full_sort_reference() {
        let mut rng = Rng::seed_from_u64(99);
        let vocab = 3000;
        let temps = [0.3, 0.7, 1.0, 1.5];
        let top_ks = [0, 0, 1, 5, 20, 46, 50, 2999, 5000];
        let top_ps = [1.0, 0.5, 0.9, 0.99, 0.999];
        let min_ps = [0.0, 0.0, 0.001, 0.1];
        let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
        for case in 0..300 {
            let p = params(|p| {
                p.temperature = temps[pick(4)];
                p.top_k = top_ks[pick(9)];
                p.top_p = top_ps[pick(5)];
                p.min_p = min_ps[pick(4)];
            });
            // Half the cases have quantised logits (many ties); some logits
            // are masked or NaN.
            let scale = [0.5, 3.0, 10.0][pick(3)] as f32;
            let quantised = case % 2 == 0;
            let logits: Vec<f32> = (0..vocab)
                .map(|_| match pick(50) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    _ if quantised => (pick(64) as f32 / 16.0 * scale).round() / 4.0,
                    _ => pick(1 << 20) as f32 / (1 << 20) as f32 * scale,
                })
                .collect();
            let mut s = Sampler::new(p.clone(), vocab).unwrap();
            assert_eq!(
                support(&mut s, &logits),
                reference_support(&logits, &p),
                "case {case}: {p:?}"
            );
        }
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 2.0), 6).unwrap();
        s.add_prompt(&[0, 1, 0]).unwrap();
        s.record_output(4).unwrap();
        s.record_output(0).unwrap();
        let mut logits = [2.0, -2.0, 1.0, 3.0, 0.0, -1.0];
        s.apply_penalties(&mut logits).unwrap();
        // Token 0 is penalised once despite three occurrences.
        assert_eq!(logits, [1.0, -4.0, 1.0, 3.0, 0.0, -1.0]);
    }

    #[test]
    fn repetition_penalty_touches_exactly_the_seen_tokens() {
        let vocab = 300;
        let mut s = Sampler::new(params(|p| p.repetition_penalty = 4.0), vocab).unwrap();
        let prompt: Vec<u32> = (0..vocab as u32).filter(|i| i % 3 == 0).collect();
        s.add_prompt(&prompt).unwrap();
        for id in [1, 65, 299] {
            s.record_output(id).unwrap();
        }
        let mut logits = vec![2.0f32; vocab];
        s.apply_penalties(&mut logits).unwrap();
        for (i, &x) in logits.iter().enumerate() {
            let seen = i % 3 == 0 || [1, 65, 299].contains(&i);
            assert_eq!(x, if seen { 0.5 } else { 2.0 }, "token {i}");
        }
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_only() {
        let mut s = Sampler::new(
            params(|p| {
                p.presence_penalty = 0.5;
                p.frequency_penalty = 0.25;
            }),
            4,
        )
        .unwrap();
        s.add_prompt(&[0, 0]).unwrap();
        for id in [2, 2, 3] {
            s.record_output(id).unwrap();
        }
        let mut logits = [1.0f32; 4];
        s.apply_penalties(&mut logits).unwrap();
        assert_eq!(logits, [1.0, 1.0, 0.0, 0.25]);
    }

    #[test]
    fn penalties_never_produce_nan_or_inf() {
        let mut s = Sampler::new(params(|p| p.frequency_penalty = -f32::MAX), 3).unwrap();
        s.record_output(0).unwrap();
        s.record_output(0).unwrap();
        s.record_output(1).unwrap();
        let mut logits = [1.0, f32::NEG_INFINITY, 0.0];
        s.apply_penalties(&mut logits).unwrap();
        assert_eq!(logits, [f32::MAX, f32::NEG_INFINITY, 0.0]);
    }

    #[test]
    fn only_recorded_outputs_are_penalised() {
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 10.0,
                ..SamplingParams::default()
            },
            2,
        )
        .unwrap();
        let logits = [1.0, 0.9];
        // Sampling alone records nothing.
        assert_eq!(s.sample(&logits).unwrap().id, 0);
        assert_eq!(s.sample(&logits).unwrap().id, 0);
        let mut ids = Vec::new();
        for _ in 0..3 {
            let id = s.sample(&logits).unwrap().id;
            s.record_output(id).unwrap();
            ids.push(id);
        }
        // 0, then 1 (0 is penalised), then 0 again (both penalised once).
        assert_eq!(ids, [0, 1, 0]);
    }

    #[test]
    fn logprob_is_after_temperature_before_truncation() {
        let logits = [0.1f32, 1.0, -0.5, 2.0];
        let scaled: Vec<f32> = logits.iter().map(|x| x / 2.0).collect();
        let expected = log_softmax(&scaled);
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 2.0;
                p.top_k = 3;
            }),
            4,
        )
        .unwrap();
        for _ in 0..50 {
            let t = s.sample(&logits).unwrap();
            assert_ne!(t.id, 2);
            assert!((t.logprob as f64 - expected[t.id as usize]).abs() < 1e-6);
        }
    }

    #[test]
    fn nan_and_infinite_logits() {
        for temperature in [0.0, 1.0] {
            let mut s = Sampler::new(params(|p| p.temperature = temperature), 3).unwrap();
            let t = s.sample(&[f32::NAN, 1.0, f32::NAN]).unwrap();
            assert_eq!((t.id, t.logprob), (1, 0.0));
            let t = s.sample(&[0.0, f32::INFINITY, 5.0]).unwrap();
            assert_eq!((t.id, t.logprob), (1, 0.0));
            for bad in [[f32::NAN; 3], [f32::NEG_INFINITY; 3]] {
                assert_eq!(s.sample(&bad).unwrap_err(), SamplingError::NoValidLogits);
            }
        }
        let mut s = Sampler::new(params(|_| {}), 3).unwrap();
        for _ in 0..20 {
            let t = s.sample(&[f32::INFINITY, 0.0, f32::INFINITY]).unwrap();
            assert!(t.id == 0 || t.id == 2);
            assert!((t.logprob - 0.5f32.ln()).abs() < 1e-6);
        }
    }

    #[test]
    fn tiny_temperature_approaches_greedy() {
        let mut s = Sampler::new(params(|p| p.temperature = 1e-30), 3).unwrap();
        for _ in 0..50 {
            assert_eq!(s.sample(&[1.0, 2.0, 1.5]).unwrap().id, 1);
        }
    }

    #[test]
    fn buffers_are_reused_between_steps() {
        let vocab = 5000;
        let mut rng = Rng::seed_from_u64(8);
        let mut logits = vec![0.0f32; vocab];
        let mut s = Sampler::new(
            params(|p| {
                p.top_k = 40;
                p.top_p = 0.95;
            }),
            vocab,
        )
        .unwrap();
        let mut fill = |l: &mut Vec<f32>| l.iter_mut().for_each(|x| *x = rng.next_f64() as f32);
        fill(&mut logits);
        s.sample(&logits).unwrap();
        let ptrs = |s: &Sampler| (s.work.as_ptr(), s.weights.as_ptr(), s.idx.as_ptr());
        let before = ptrs(&s);
        for _ in 0..20 {
            fill(&mut logits);
            s.sample(&logits).unwrap();
        }
        assert_eq!(ptrs(&s), before);
    }

    #[test]
    fn top_logprobs_from_raw_log_softmax() {
        let logits = [1.0, 3.0, 2.0, f32::NAN, 3.0];
        let lp = log_softmax(&[1.0, 3.0, 2.0, f32::NEG_INFINITY, 3.0]);
        let top = top_logprobs(&logits, 3);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 4, 2]);
        for (id, l) in &top {
            assert!((*l as f64 - lp[*id as usize]).abs() < 1e-6);
        }
        // NaN is left out even when more entries are asked for.
        let all: Vec<u32> = top_logprobs(&logits, 10).iter().map(|t| t.0).collect();
        assert_eq!(all, [1, 4, 2, 0]);
        assert!(top_logprobs(&logits, 0).is_empty());
        assert!(top_logprobs(&[f32::NAN; 4], 2).is_empty());
    }

    #[test]
    fn token_logprobs_match_an_f64_log_softmax() {
        let mut rng = Rng::seed_from_u64(5);
        for vocab in [1usize, 7, 255, 256, 257, 1000, 4099] {
            let mut logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.next_f64() as f32 - 0.5) * 40.0)
                .collect();
            if vocab > 10 {
                logits[3] = f32::NEG_INFINITY;
                logits[5] = f32::NAN;
                logits[8] = logits[9]; // a tie: the lower id comes first
            }
            let nan_free: Vec<f32> = logits.iter().map(|&x| sanitize(x)).collect();
            let lp = log_softmax(&nan_free);
            for n in [0usize, 1, 5, 20] {
                let id = (vocab / 2) as u32;
                let t = token_logprobs(&logits, id, n).unwrap();
                assert_eq!(t.id, id);
                assert!(
                    (t.logprob as f64 - lp[id as usize]).abs() < 1e-5,
                    "{vocab} {n}"
                );
                // The reference order: finite entries by value, then id.
                let mut order: Vec<u32> = (0..vocab as u32)
                    .filter(|&i| lp[i as usize] > f64::NEG_INFINITY)
                    .collect();
                order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
                let ids: Vec<u32> = t.top.iter().map(|e| e.0).collect();
                assert_eq!(ids, order[..n.min(order.len())], "{vocab} {n}");
                for (i, l) in &t.top {
                    assert!((*l as f64 - lp[*i as usize]).abs() < 1e-5);
                }
                assert_eq!(top_logprobs(&logits, n), t.top);
            }
        }
        // Huge and +inf logits give finite values (+inf counts as f32::MAX).
        let t = token_logprobs(&[3.0e38, 3.0e38 - 1.0e32, f32::INFINITY], 0, 2).unwrap();
        assert_eq!(t.top[0].0, 2);
        assert!(t.logprob.is_finite());
        assert!(token_logprobs(&[1.0, 2.0], 2, 1).is_none());
        assert!(token_logprobs(&[f32::NAN, f32::NEG_INFINITY], 0, 1).is_none());
    }

    #[test]
    fn prompt_token_logprobs_rank_and_top_follow_the_raw_log_softmax() {
        let mut rng = Rng::seed_from_u64(9);
        let mut logits: Vec<f32> = (0..1000)
            .map(|_| (rng.next_f64() as f32 - 0.5) * 30.0)
            .collect();
        logits[7] = f32::NAN;
        logits[11] = logits[12];
        let lp = log_softmax(&logits.iter().map(|&x| sanitize(x)).collect::<Vec<_>>());
        for id in [0u32, 7, 11, 12, 500, 999] {
            let t = prompt_token_logprobs(&logits, id, 4);
            assert_eq!(t.id, id);
            if id == 7 {
                assert_eq!(t.logprob, f32::NEG_INFINITY);
            } else {
                assert!((t.logprob as f64 - lp[id as usize]).abs() < 1e-5, "{id}");
            }
            let above = lp.iter().filter(|&&l| l > lp[id as usize]).count();
            assert_eq!(t.rank as usize, above + 1, "{id}");
            // The same alternatives as a generated token's.
            assert_eq!(t.top, token_logprobs(&logits, id, 4).unwrap().top);
        }
        // Ties share a rank; the most likely token is rank 1.
        assert_eq!(
            prompt_token_logprobs(&logits, 11, 0).rank,
            prompt_token_logprobs(&logits, 12, 0).rank
        );
        let best = top_logprobs(&logits, 1)[0].0;
        assert_eq!(prompt_token_logprobs(&logits, best, 0).rank, 1);
        // No usable logit: -inf, no alternatives; more alternatives than tokens: all of them.
        let none = prompt_token_logprobs(&[f32::NAN, f32::NEG_INFINITY], 1, 3);
        assert_eq!(none.logprob, f32::NEG_INFINITY);
        assert!(none.top.is_empty());
        assert_eq!(
            prompt_token_logprobs(&[1.0, 2.0], 0, usize::MAX).top.len(),
            2
        );
    }
}
