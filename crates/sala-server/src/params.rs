//! The parameters both completion routes share, checked against the model and mapped to an
//! engine [`Request`].

use crate::api::{ApiError, CommonParams, StopField, MAX_STOP_STRINGS};
use crate::engine::{Prompt, Request};
use crate::http::AppState;
use crate::reply::ReplySetup;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use sala_engine::grammar::GrammarSpec;
use sala_engine::sampling::SamplingParams;

/// Most choices (`n`) per prompt.
pub(crate) const MAX_N: usize = 8;

/// Which route a request came by.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// A request checked and ready to queue.
pub(crate) struct Checked {
    /// The request of the first prompt's first choice; the others differ in their prompt
    /// and seed.
    pub(crate) request: Request,
    /// The prompts after the first (a completion's list of prompts).
    pub(crate) more_prompts: Vec<Prompt>,
    /// Choices per prompt.
    pub(crate) n: usize,
    /// `response_format`, compiled into `request` when it is admitted.
    pub(crate) grammar: Option<GrammarSpec>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    /// How to read a chat reply (chat only).
    pub(crate) reply: Option<ReplySetup>,
    /// `echo`: each prompt's text (and with `logprobs` its tokens) before its choices' own
    /// (completions only).
    pub(crate) echo: bool,
    /// vLLM's `prompt_logprobs`: alternatives listed at each prompt position (completions
    /// only).
    pub(crate) prompt_logprobs: Option<usize>,
    /// JSON schemas to compile before the request is queued, each with the field that holds
    /// it (a chat's strict tools).
    pub(crate) schemas: Vec<(String, serde_json::Value)>,
}

pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        let status = r.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is too large".to_string()
        } else {
            format!("reading the request body: {}", r.body_text())
        };
        ApiError::new(status, "invalid_request_error", message)
    })
}

/// Checks the shared parameters against the model and maps them to a [`Request`];
/// `logprobs` comes checked from the endpoint's own fields. `max_tokens` may be 0 only with
/// `scores_prompt` (the request asks for its prompt back).
pub(crate) fn check_common(
    st: &AppState,
    p: CommonParams,
    prompt: Prompt,
    logprobs: Option<usize>,
    scores_prompt: bool,
) -> Result<Checked, ApiError> {
    let info = &st.engine.info;
    if let Some(model) = &p.model {
        if *model != info.id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!(
                    "the model `{model}` does not exist; this server serves `{}`",
                    info.id
                ),
            )
            .param("model")
            .code("model_not_found"));
        }
    }
    let n = match p.n {
        None => 1,
        Some(n) if (1..=MAX_N as u64).contains(&n) => n as usize,
        Some(n) => {
            return Err(
                ApiError::invalid(format!("n is {n}; it must be in 1..={MAX_N}")).param("n"),
            )
        }
    };
    let (max_name, max) = match (p.max_completion_tokens, p.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        None => info.max_context,
        Some(0) if scores_prompt => 0,
        Some(0) => {
            return Err(ApiError::invalid(format!(
                "{max_name} must be at least 1 (0, nothing generated, only with echo or \
                 prompt_logprobs on /v1/completions)"
            ))
            .param(max_name))
        }
        Some(m) if m > info.max_context as u64 => {
            return Err(ApiError::invalid(format!(
                "{max_name} is {m}, more than the context budget of {} tokens",
                info.max_context
            ))
            .param(max_name))
        }
        Some(m) => m as usize,
    };
    let top_k = match p.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(format!(
                "top_k is {k}; it must be positive, or 0 or -1 to disable it"
            ))
            .param("top_k"))
        }
    };
    for (name, value) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if let Some(v) = value.filter(|v| !(-2.0..=2.0).contains(v)) {
            return Err(ApiError::invalid(format!(
                "{name} is {}; it must be in [-2, 2]",
                shown(v)
            ))
            .param(name));
        }
    }
    let logit_bias = logit_bias(p.logit_bias.as_ref())?;
    if let Some(t) = p.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        return Err(ApiError::invalid(format!(
            "temperature is {}; it must be in [0, 2]",
            shown(t)
        ))
        .param("temperature"));
    }
    let sampling = SamplingParams {
        temperature: p.temperature.unwrap_or(1.0),
        top_k,
        top_p: p.top_p.unwrap_or(1.0),
        min_p: p.min_p.unwrap_or(0.0),
        repetition_penalty: p.repetition_penalty.unwrap_or(1.0),
        presence_penalty: p.presence_penalty.unwrap_or(0.0),
        frequency_penalty: p.frequency_penalty.unwrap_or(0.0),
        seed: p.seed.map(|s| s.value()),
        logit_bias,
    };
    sampling.validate().map_err(|e| {
        let err = ApiError::invalid(e.to_string());
        match e {
            sala_engine::sampling::SamplingError::InvalidParam { param, .. } => err.param(param),
            _ => err,
        }
    })?;
    let stop = match p.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s],
        Some(StopField::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop strings must not be empty").param("stop"));
    }
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(format!(
            "stop has {} strings; at most {MAX_STOP_STRINGS} are allowed",
            stop.len()
        ))
        .param("stop"));
    }
    let grammar = match p.response_format {
        Some(f) => f.grammar()?,
        None => None,
    };
    Ok(Checked {
        more_prompts: Vec::new(),
        n,
        grammar,
        request: Request {
            prompt,
            sampling,
            max_tokens,
            stop,
            ignore_eos: p.ignore_eos.unwrap_or(false),
            speculative: p.speculative.unwrap_or(true),
            logprobs,
            prompt_logprobs: None,
            grammar: None,
        },
        stream: p.stream.unwrap_or(false),
        include_usage: p.stream_options.is_some_and(|o| o.include_usage),
        reply: None,
        echo: false,
        prompt_logprobs: None,
        schemas: Vec::new(),
    })
}

/// A number as an error message shows it: in exponent form where the plain one runs long
/// (`1e308`, not 309 digits).
fn shown<T>(x: T) -> String
where
    T: Copy + Into<f64> + std::fmt::Display + std::fmt::LowerExp,
{
    let v: f64 = x.into();
    if v.is_finite() && v != 0.0 && !(1e-4..1e6).contains(&v.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in [-100, 100].
fn logit_bias(
    map: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |msg: String| ApiError::invalid(msg).param("logit_bias");
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(key, value)| {
            let id: u32 = key
                .trim()
                .parse()
                .map_err(|_| bad(format!("logit_bias key {key:?} is not a token id")))?;
            let bias = value
                .as_f64()
                .ok_or_else(|| bad(format!("logit_bias of token {id} is not a number")))?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(bad(format!(
                    "logit_bias of token {id} is {}; it must be in [-100, 100]",
                    shown(bias)
                )));
            }
            Ok((id, bias as f32))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::shown;

    #[test]
    fn numbers_in_messages_stay_short() {
        assert_eq!(shown(1e308), "1e308");
        assert_eq!(shown(-2.5e7), "-2.5e7");
        assert_eq!(shown(3e-7), "3e-7");
        assert_eq!(shown(150.0), "150");
        assert_eq!(shown(-2.5), "-2.5");
        assert_eq!(shown(0.0), "0");
        assert_eq!(shown(f64::INFINITY), "inf");
        // An f32 shows its own shortest form, not its f64 widening's.
        assert_eq!(shown(2.1f32), "2.1");
        assert_eq!(shown(3e38f32), "3e38");
    }
}
