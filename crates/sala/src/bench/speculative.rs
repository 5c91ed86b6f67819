//! `sala bench --speculative`: one request's greedy decoding through the engine, plain and
//! with each draft source, after the same random prompt. Random weights make real drafts
//! rarely right, so besides prompt lookup (`ngram`) the bench takes an oracle: drafts from the
//! target's own greedy continuation (the plain run's), `R` of every `K` right, which gives the
//! engine's speed as a function of the accepted length.

use super::BenchArgs;
use crate::device::DeviceStats;
use anyhow::{bail, Context, Result};
use sala_checkpoint::ModelConfig;
use sala_engine::draft::{DraftSource, Speculate};
use sala_engine::generate::{Engine, GenerateOptions};
use sala_model::draft::DraftModel;
use sala_model::numerics::TestRng;
use sala_model::Backend;
use serde_json::{json, Value};
use std::sync::Arc;

/// A draft source the bench compares with plain decoding.
#[derive(Debug, Clone, PartialEq)]
pub enum BenchDrafts {
    /// Prompt lookup, drafts of up to this many tokens.
    Ngram(usize),
    /// Drafts of `of` tokens from the greedy continuation, the first `right` of them right.
    Oracle { right: usize, of: usize },
    /// An EAGLE-3 draft model: the one in this directory, or (`None`) one of a real draft's
    /// shape with random weights made on the device (its drafts are random: what it costs).
    Draft(Option<std::path::PathBuf>),
}

/// Most tokens the bench's draft model drafts a step.
const DRAFT_TOKENS: usize = 5;

impl BenchDrafts {
    /// `ngram`, `ngram:N`, `oracle:R/K` (drafts of 1 to 16 tokens), `draft:DIR` or
    /// `draft:random`.
    pub fn parse(s: &str) -> Result<Self> {
        let tokens = |n: &str| match n.parse::<usize>() {
            Ok(n) if (1..=16).contains(&n) => Ok(n),
            _ => bail!("--speculative {s}: drafts of 1 to 16 tokens"),
        };
        match s.split_once(':') {
            None if s == "ngram" => Ok(Self::Ngram(4)),
            Some(("ngram", n)) => Ok(Self::Ngram(tokens(n)?)),
            Some(("oracle", rk)) => {
                let Some((r, k)) = rk.split_once('/') else {
                    bail!("--speculative {s}: expected oracle:R/K (R of K drafts right)")
                };
                let of = tokens(k)?;
                match r.parse::<usize>() {
                    Ok(right) if right <= of => Ok(Self::Oracle { right, of }),
                    _ => bail!("--speculative {s}: R must be 0 to K"),
                }
            }
            Some(("draft", "random")) => Ok(Self::Draft(None)),
            Some(("draft", dir)) if !dir.is_empty() => Ok(Self::Draft(Some(dir.into()))),
            _ => bail!(
                "--speculative {s}: expected ngram, ngram:N, oracle:R/K, draft:DIR or draft:random"
            ),
        }
    }

    pub(super) fn label(&self) -> String {
        match self {
            Self::Ngram(n) => format!("ngram:{n}"),
            Self::Oracle { right, of } => format!("oracle:{right}/{of}"),
            Self::Draft(None) => "draft:random".into(),
            Self::Draft(Some(_)) => "draft".into(),
        }
    }

    pub(super) fn speculate(&self, sequence: &Arc<[u32]>) -> Speculate {
        match *self {
            Self::Ngram(n) => Speculate::prompt_lookup(n),
            Self::Oracle { right, of } => Speculate {
                max_draft: of,
                drafts: DraftSource::Known {
                    sequence: sequence.clone(),
                    right,
                },
            },
            Self::Draft(_) => Speculate {
                max_draft: DRAFT_TOKENS,
                drafts: DraftSource::Model,
            },
        }
    }
}

/// Gives `engine` the draft model of the bench's draft modes (at most one): the draft in a
/// directory, or a random one of a real EAGLE-3 draft's shape for the model (its heads, KV
/// heads of at least a quarter of them, its MLP width, a vocabulary of at most 32,000).
pub(super) fn set_draft<B: Backend>(
    engine: &mut Engine<B>,
    modes: &[BenchDrafts],
    seed: u64,
) -> Result<()> {
    let drafts: Vec<&Option<std::path::PathBuf>> = modes
        .iter()
        .filter_map(|m| match m {
            BenchDrafts::Draft(d) => Some(d),
            _ => None,
        })
        .collect();
    let draft = match drafts.as_slice() {
        [] => return Ok(()),
        [Some(dir)] => {
            let ckpt = sala_checkpoint::DraftCheckpoint::open(dir, &engine.model.config)
                .with_context(|| format!("--speculative draft:{}", dir.display()))?;
            DraftModel::load(&engine.backend, &engine.model, &ckpt)?
        }
        [None] => {
            let c = &engine.model.config;
            let heads = c.num_attention_heads;
            let shape = sala_checkpoint::DraftConfig {
                hidden_size: c.hidden_size,
                intermediate_size: c.intermediate_size,
                num_attention_heads: heads,
                num_key_value_heads: c.num_key_value_heads.max(heads / 4),
                head_dim: c.head_dim,
                rms_norm_eps: c.rms_norm_eps,
                rope_theta: c.rope_theta,
                vocab_size: c.vocab_size,
                draft_vocab_size: (c.vocab_size / 2).min(32_000),
                target_hidden_size: c.hidden_size,
                aux_layers: [
                    1.min(c.num_hidden_layers - 1),
                    (c.num_hidden_layers / 2).saturating_sub(1),
                    c.num_hidden_layers.saturating_sub(4),
                ],
            };
            DraftModel::random(&engine.backend, &engine.model, shape, seed)?
        }
        _ => bail!("--speculative: one draft model a run"),
    };
    engine.set_draft(draft)?;
    Ok(())
}

/// For each context: a random prompt, `--decode-tokens` greedy tokens plain and then with each
/// draft source; prints and returns (as JSON) the decode rates, their ratio to plain decoding,
/// the drafts verified and taken, and how many tokens match the plain run's.
pub fn speculative<B: Backend + DeviceStats>(
    be: B,
    config: &ModelConfig,
    contexts: &[usize],
    modes: &[BenchDrafts],
    args: &BenchArgs,
) -> Result<Value> {
    if args.decode_tokens < 2 {
        bail!("--speculative needs --decode-tokens of at least 2");
    }
    let name = be.name();
    let (mut engine, _tokenizer_dir) = super::random_engine(be, config, args)?;
    set_draft(&mut engine, modes, args.seed)?;
    let longest = contexts.iter().copied().max().unwrap_or(0);
    let plain = super::greedy_options(args, longest);
    let mut rng = TestRng::new(args.seed ^ 0x5bec);
    let mut docs = Vec::new();
    for &len in contexts {
        let prompt: Vec<u32> = (0..len)
            .map(|_| rng.below(config.vocab_size) as u32)
            .collect();
        // Warm-up: kernels, GEMM plans and decode graphs, plain and in spans.
        let warm = &prompt[..len.min(args.prefill_chunk)];
        for m in [None].into_iter().chain(modes.iter().map(Some)) {
            let o = GenerateOptions {
                max_tokens: 8,
                speculate: m.map(|m| m.speculate(&Arc::from(warm))),
                ..plain.clone()
            };
            engine.generate(warm, &o, &mut |_| {}, &mut |_| {})?;
        }
        let base = engine.generate(&prompt, &plain, &mut |_| {}, &mut |_| {})?;
        let base_ids: Vec<u32> = base.tokens.iter().map(|t| t.id).collect();
        let base_rate = base.decode_tokens_per_sec();
        println!(
            "context {len} on {name}: plain greedy decoding {base_rate:.1} tok/s ({} tokens)",
            base_ids.len()
        );
        println!(
            "{:>14} {:>9} {:>9} {:>8} {:>8} {:>11} {:>12} {:>11}",
            "drafts",
            "tok/s",
            "vs plain",
            "drafted",
            "taken",
            "taken/step",
            "same tokens",
            "drafting s"
        );
        let sequence: Arc<[u32]> = prompt.iter().copied().chain(base_ids.clone()).collect();
        let mut rows = Vec::new();
        for m in modes {
            let o = GenerateOptions {
                speculate: Some(m.speculate(&sequence)),
                ..plain.clone()
            };
            let before = engine.speculation_stats();
            let g = engine.generate(&prompt, &o, &mut |_| {}, &mut |_| {})?;
            let after = engine.speculation_stats();
            let (drafted, taken, spans) = (
                after.drafted - before.drafted,
                after.accepted - before.accepted,
                after.spans - before.spans,
            );
            let drafting_s = (after.draft_micros - before.draft_micros) as f64 / 1e6;
            let same = g
                .tokens
                .iter()
                .zip(&base_ids)
                .take_while(|(t, &b)| t.id == b)
                .count();
            let rate = g.decode_tokens_per_sec();
            let per_step = taken as f64 / spans.max(1) as f64;
            println!(
                "{:>14} {rate:>9.1} {:>8.2}x {drafted:>8} {taken:>8} {per_step:>11.2} {:>12} {drafting_s:>11.3}",
                m.label(),
                rate / base_rate.max(1e-9),
                format!("{same}/{}", base_ids.len())
            );
            rows.push(json!({
                "drafts": m.label(),
                "decode_tok_s": rate,
                "vs_plain": rate / base_rate.max(1e-9),
                "drafted": drafted,
                "accepted": taken,
                "spans": spans,
                "mean_accepted": per_step,
                "same_tokens": same,
                "drafting_s": drafting_s,
            }));
        }
        docs.push(json!({
            "context": len,
            "plain_decode_tok_s": base_rate,
            "tokens": base_ids.len(),
            "speculative": rows,
        }));
    }
    Ok(json!({ "device": name, "runs": docs }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_sources_parse_or_say_what_is_wrong() {
        assert_eq!(BenchDrafts::parse("ngram").unwrap(), BenchDrafts::Ngram(4));
        assert_eq!(
            BenchDrafts::parse("ngram:7").unwrap(),
            BenchDrafts::Ngram(7)
        );
        assert_eq!(
            BenchDrafts::parse("oracle:3/4").unwrap(),
            BenchDrafts::Oracle { right: 3, of: 4 }
        );
        for (bad, says) in [
            ("oracle:5/4", "0 to K"),
            ("oracle:3", "oracle:R/K"),
            ("oracle:1/0", "1 to 16"),
            ("ngram:17", "1 to 16"),
            ("eagle", "expected"),
        ] {
            let e = BenchDrafts::parse(bad).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(says), "{bad}: {e}");
        }
    }
}
