//! Perplexity of a token sequence by a sliding window (Hugging Face's "perplexity of
//! fixed-length models"): windows of `context` tokens, each read as a fresh sequence, start
//! every `stride` tokens; a window scores the tokens the previous one did not, each given the
//! window's tokens before it. A window's first token has none before it: the text's first
//! token is never scored, nor (with `stride == context`) the first of each window.

use crate::generate::{Engine, EngineError};
use sala_model::Backend;

/// One window: the tokens `start..end` read, of which `scored..end` are scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start: usize,
    pub end: usize,
    pub scored: usize,
}

/// Why a perplexity cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("the text has {0} tokens; at least 2 are needed to score one")]
    TooShort(usize),
    #[error("the context is {0} tokens; it must be at least 2")]
    Context(usize),
    #[error("the stride is {stride} tokens; it must be in 1..={context} (the context)")]
    Stride { stride: usize, context: usize },
}

/// The windows over `len` tokens (see the module docs): with `stride < context` every token
/// after the first is scored once.
pub fn windows(len: usize, context: usize, stride: usize) -> Result<Vec<Window>, WindowError> {
    if context < 2 {
        return Err(WindowError::Context(context));
    }
    if stride == 0 || stride > context {
        return Err(WindowError::Stride { stride, context });
    }
    if len < 2 {
        return Err(WindowError::TooShort(len));
    }
    let mut out = Vec::new();
    let mut scored_to = 0;
    let mut start = 0;
    loop {
        let end = (start + context).min(len);
        out.push(Window {
            start,
            end,
            scored: scored_to.max(start + 1),
        });
        scored_to = end;
        if end == len {
            return Ok(out);
        }
        start += stride;
    }
}

/// What [`Engine::perplexity`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    /// The sum of the scored tokens' negative log-likelihoods (nats).
    pub nll_sum: f64,
    pub tokens_scored: usize,
    /// Tokens read, every window's together.
    pub tokens_read: usize,
    pub windows: usize,
}

impl Perplexity {
    /// The mean negative log-likelihood of a scored token (nats).
    pub fn mean_nll(&self) -> f64 {
        self.nll_sum / self.tokens_scored.max(1) as f64
    }

    /// `exp(mean NLL)`.
    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }
}

impl<B: Backend> Engine<B> {
    /// The sliding-window perplexity of `tokens` (see the module docs), each window's
    /// logprobs from [`Engine::prompt_logprobs`]; `on_read(tokens)` as prompt chunks are read.
    pub fn perplexity(
        &mut self,
        tokens: &[u32],
        context: usize,
        stride: usize,
        on_read: &mut dyn FnMut(usize),
    ) -> Result<Perplexity, EngineError> {
        let windows = windows(tokens.len(), context, stride)?;
        let mut out = Perplexity {
            nll_sum: 0.0,
            tokens_scored: 0,
            tokens_read: 0,
            windows: windows.len(),
        };
        for w in windows {
            let lp = self.prompt_logprobs(&tokens[w.start..w.end], 0, on_read)?;
            // Entry i is token start + 1 + i.
            for t in &lp.tokens[w.scored - w.start - 1..] {
                out.nll_sum -= t.logprob as f64;
            }
            out.tokens_scored += w.end - w.scored;
            out.tokens_read += w.end - w.start;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every token after the first is scored exactly once (with `stride == context`, but the
    /// first of each window), by a window that holds it, with at least `context - stride`
    /// tokens before it once the first window is past.
    #[test]
    fn windows_score_every_token_once() {
        for len in [2usize, 3, 10, 64, 100, 257] {
            for context in [2usize, 3, 7, 64, 300] {
                for stride in [1, 2, context / 2, context - 1, context] {
                    if stride == 0 {
                        continue;
                    }
                    let ws = windows(len, context, stride).unwrap();
                    let mut count = vec![0; len];
                    for (i, w) in ws.iter().enumerate() {
                        assert!(w.start < w.scored && w.scored <= w.end && w.end <= len);
                        assert!(w.end - w.start <= context);
                        assert_eq!(w.start, i * stride, "{len} {context} {stride}");
                        if i > 0 {
                            assert!(w.scored - w.start >= context - stride || w.end == len);
                        }
                        (w.scored..w.end).for_each(|t| count[t] += 1);
                    }
                    for (t, &c) in count.iter().enumerate() {
                        let unscored = t == 0 || (stride == context && t % context == 0);
                        assert_eq!(c, usize::from(!unscored), "{len} {context} {stride}: {t}");
                    }
                    assert_eq!(ws.last().unwrap().end, len);
                }
            }
        }
        // One window when the text fits the context.
        let one = windows(50, 64, 32).unwrap();
        assert_eq!(
            one,
            [Window {
                start: 0,
                end: 50,
                scored: 1
            }]
        );
    }

    #[test]
    fn bad_windows_are_errors() {
        assert_eq!(windows(1, 8, 4), Err(WindowError::TooShort(1)));
        assert_eq!(windows(10, 1, 1), Err(WindowError::Context(1)));
        for stride in [0, 9] {
            let e = windows(10, 8, stride).unwrap_err();
            assert_eq!(e, WindowError::Stride { stride, context: 8 });
        }
    }
}
