//! Server metrics, fed by the engine thread as its [`Observer`] and by the HTTP side, written
//! out in the Prometheus text format (version 0.0.4) by [`Metrics::render`] for
//! `GET /metrics`.

use crate::api::ApiError;
use sala_engine::generate::FinishReason;
use sala_engine::request::RequestError;
use sala_engine::thread::Observer;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// How a completion request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Finished at EOS or a stop string.
    Stop,
    /// Finished at `max_tokens` or the context budget.
    Length,
    /// The client left before the end.
    Cancelled,
    /// Refused because the queue was full (429).
    Rejected,
    /// A bad request (4xx other than 429).
    ClientError,
    /// A failure of the server (5xx).
    ServerError,
}

impl Outcome {
    const ALL: [Outcome; 6] = [
        Outcome::Stop,
        Outcome::Length,
        Outcome::Cancelled,
        Outcome::Rejected,
        Outcome::ClientError,
        Outcome::ServerError,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Outcome::Stop => "stop",
            Outcome::Length => "length",
            Outcome::Cancelled => "cancelled",
            Outcome::Rejected => "rejected",
            Outcome::ClientError => "client_error",
            Outcome::ServerError => "server_error",
        }
    }

    /// The outcome of an error answered with `status`.
    pub fn of_status(status: u16) -> Self {
        match status {
            429 => Outcome::Rejected,
            s if s < 500 => Outcome::ClientError,
            _ => Outcome::ServerError,
        }
    }
}

/// A histogram with fixed bucket bounds (seconds).
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Debug, Default)]
struct HistogramData {
    /// Observations per bucket (not cumulative); the last entry is above every bound.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            inner: Mutex::new(HistogramData {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
            }),
        }
    }

    fn observe(&self, seconds: f64) {
        let i = self.bounds.partition_point(|&b| b < seconds);
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        d.counts[i] += 1;
        d.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&d.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += d.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", d.sum);
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// Generated tokens per second, over the last [`RATE_WINDOW_SECS`] seconds.
#[derive(Debug)]
struct RateWindow {
    /// `(second since start, tokens)`, one slot per second modulo the window.
    slots: Mutex<[(u64, u64); RATE_WINDOW_SECS as usize]>,
}

const RATE_WINDOW_SECS: u64 = 10;

impl RateWindow {
    fn add(&self, second: u64, tokens: u64) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut slots[(second % RATE_WINDOW_SECS) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 += tokens;
    }

    /// Tokens in the window ending at `now_secs` (fractional seconds since start), divided by
    /// the window's length (or the time since start, when shorter).
    fn rate(&self, now_secs: f64) -> f64 {
        let current = now_secs as u64;
        let oldest = (current + 1).saturating_sub(RATE_WINDOW_SECS);
        let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let tokens: u64 = slots
            .iter()
            .filter(|s| s.0 >= oldest && s.0 <= current)
            .map(|s| s.1)
            .sum();
        let span = now_secs.clamp(1.0, RATE_WINDOW_SECS as f64);
        tokens as f64 / span
    }
}

/// Time to first token: 1 ms to 2 min (a 1M-token prefill takes about a minute).
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Time between two tokens of one request: 0.5 ms to 2.5 s.
const ITL_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Counters and gauges shared by the HTTP side and the engine thread.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    requests: [AtomicU64; Outcome::ALL.len()],
    running: AtomicI64,
    live_sequences: AtomicI64,
    cache_bytes: AtomicI64,
    cache_bytes_in_use: AtomicI64,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    /// Speculative decoding's totals: draft tokens verified, taken, and steps verifying drafts.
    drafted: AtomicU64,
    accepted: AtomicU64,
    draft_steps: AtomicU64,
    /// The prefix cache's totals: prompt tokens taken from it and read anew, its bytes.
    prefix_hit_tokens: AtomicU64,
    prefix_missed_tokens: AtomicU64,
    prefix_bytes: AtomicU64,
    /// Context parallelism's totals: prompts and tokens its ranks read, long prompts read
    /// without them for want of memory.
    context_prompts: AtomicU64,
    context_tokens: AtomicU64,
    context_read_alone: AtomicU64,
    context_busy: AtomicU64,
    ttft: Histogram,
    itl: Histogram,
    rate: RateWindow,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            requests: Default::default(),
            running: AtomicI64::new(0),
            live_sequences: AtomicI64::new(0),
            cache_bytes: AtomicI64::new(0),
            cache_bytes_in_use: AtomicI64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            drafted: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            draft_steps: AtomicU64::new(0),
            prefix_hit_tokens: AtomicU64::new(0),
            prefix_missed_tokens: AtomicU64::new(0),
            prefix_bytes: AtomicU64::new(0),
            context_prompts: AtomicU64::new(0),
            context_tokens: AtomicU64::new(0),
            context_read_alone: AtomicU64::new(0),
            context_busy: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
            rate: RateWindow {
                slots: Mutex::new([(u64::MAX, 0); RATE_WINDOW_SECS as usize]),
            },
        }
    }

    /// Counts one finished request.
    pub fn request_done(&self, outcome: Outcome) {
        self.requests[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// How many requests ended with `outcome`.
    pub fn requests(&self, outcome: Outcome) -> u64 {
        self.requests[outcome as usize].load(Ordering::Relaxed)
    }

    /// Requests generating now.
    pub fn running(&self) -> i64 {
        self.running.load(Ordering::Relaxed)
    }

    /// A request starts generating: its prompt is counted and its sequence is live.
    pub fn sequence_started(&self, prompt_tokens: usize) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);
        self.live_sequences.fetch_add(1, Ordering::Relaxed);
    }

    /// The live sequences' caches hold `held` bytes by the memory formula, `in_use` by the
    /// backend's count.
    pub fn set_cache_bytes(&self, held: usize, in_use: usize) {
        self.cache_bytes.store(held as i64, Ordering::Relaxed);
        self.cache_bytes_in_use
            .store(in_use as i64, Ordering::Relaxed);
    }

    /// A request's sequence is gone.
    pub fn sequence_ended(&self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.live_sequences.fetch_sub(1, Ordering::Relaxed);
    }

    /// One generated token at `now`; `since` is the request's arrival for its first token,
    /// else the previous token.
    pub fn token(&self, now: Instant, since: Instant, first: bool) {
        let gap = now.saturating_duration_since(since).as_secs_f64();
        if first {
            self.ttft.observe(gap);
        } else {
            self.itl.observe(gap);
        }
        self.generation_tokens.fetch_add(1, Ordering::Relaxed);
        let second = now.saturating_duration_since(self.started).as_secs();
        self.rate.add(second, 1);
    }

    /// The exposition text; the queue figures come from the caller, which owns the queue.
    pub fn render(&self, queue_depth: usize, queue_capacity: usize) -> String {
        let mut out = String::with_capacity(4096);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "sala_queue_depth",
            "gauge",
            "Requests waiting in the queue.",
            queue_depth.to_string(),
        );
        metric(
            "sala_queue_capacity",
            "gauge",
            "Most requests that may wait; more are refused with 429.",
            queue_capacity.to_string(),
        );
        metric(
            "sala_requests_running",
            "gauge",
            "Requests being generated.",
            self.running.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_live_sequences",
            "gauge",
            "Sequences holding cache state.",
            self.live_sequences.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_cache_bytes",
            "gauge",
            "Bytes of K/V, compressed keys and lightning states of the live sequences, \
             by the model's memory formula.",
            self.cache_bytes.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_cache_bytes_in_use",
            "gauge",
            "Bytes the backend's caches take by its own count (the page pool's mapped \
             pages), or the live sequences' planned cache bytes where it cannot tell.",
            self.cache_bytes_in_use.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_prompt_tokens_total",
            "counter",
            "Prompt tokens of requests that started generating.",
            self.prompt_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_generation_tokens_total",
            "counter",
            "Generated tokens.",
            self.generation_tokens.load(Ordering::Relaxed).to_string(),
        );
        let (drafted, accepted, steps) = (
            self.drafted.load(Ordering::Relaxed),
            self.accepted.load(Ordering::Relaxed),
            self.draft_steps.load(Ordering::Relaxed),
        );
        metric(
            "sala_speculative_draft_tokens_total",
            "counter",
            "Draft tokens verified by speculative decoding.",
            drafted.to_string(),
        );
        metric(
            "sala_speculative_accepted_tokens_total",
            "counter",
            "Draft tokens that stood.",
            accepted.to_string(),
        );
        metric(
            "sala_speculative_steps_total",
            "counter",
            "Steps that verified drafts.",
            steps.to_string(),
        );
        metric(
            "sala_speculative_mean_accepted_length",
            "gauge",
            "Draft tokens that stood per step that verified drafts.",
            format!("{}", accepted as f64 / steps.max(1) as f64),
        );
        metric(
            "sala_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache (not read again).",
            self.prefix_hit_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_prefix_cache_missed_tokens_total",
            "counter",
            "Prompt tokens read by requests that looked the prefix cache up.",
            self.prefix_missed_tokens
                .load(Ordering::Relaxed)
                .to_string(),
        );
        metric(
            "sala_prefix_cache_bytes",
            "gauge",
            "Bytes the prefix cache's parked sequences and snapshots hold, by the memory \
             formula.",
            self.prefix_bytes.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_context_parallel_prompts_total",
            "counter",
            "Long prompts read by the context-parallel ranks (--context-parallel).",
            self.context_prompts.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_context_parallel_tokens_total",
            "counter",
            "Prompt tokens read by the context-parallel ranks.",
            self.context_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_context_parallel_read_alone_total",
            "counter",
            "Long prompts read without the context-parallel ranks: the memory limit left \
             their buffers no room.",
            self.context_read_alone.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "sala_context_parallel_busy_total",
            "counter",
            "Long prompts read without the context-parallel ranks: they were reading another.",
            self.context_busy.load(Ordering::Relaxed).to_string(),
        );
        let now = self.started.elapsed().as_secs_f64();
        metric(
            "sala_generation_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 seconds.",
            self.rate.rate(now).to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP sala_requests_total Completion requests by how they ended.\n\
             # TYPE sala_requests_total counter"
        );
        for o in Outcome::ALL {
            let _ = writeln!(
                out,
                "sala_requests_total{{outcome=\"{}\"}} {}",
                o.label(),
                self.requests(o)
            );
        }
        self.ttft.render(
            &mut out,
            "sala_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
        );
        self.itl.render(
            &mut out,
            "sala_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
        );
        out
    }
}

/// The engine thread's events, counted.
impl Observer for Metrics {
    fn admitted(&self, prompt_tokens: usize) {
        self.sequence_started(prompt_tokens);
    }

    fn token(&self, now: Instant, since: Instant, first: bool) {
        Metrics::token(self, now, since, first);
    }

    fn cache(&self, held: usize, in_use: usize) {
        self.set_cache_bytes(held, in_use);
    }

    fn speculation(&self, totals: sala_engine::generate::SpeculationStats) {
        self.drafted.store(totals.drafted, Ordering::Relaxed);
        self.accepted.store(totals.accepted, Ordering::Relaxed);
        self.draft_steps.store(totals.spans, Ordering::Relaxed);
    }

    fn prefix_cache(&self, totals: sala_engine::prefix::PrefixStats, bytes: usize) {
        self.prefix_hit_tokens
            .store(totals.hit_tokens, Ordering::Relaxed);
        self.prefix_missed_tokens
            .store(totals.missed_tokens, Ordering::Relaxed);
        self.prefix_bytes.store(bytes as u64, Ordering::Relaxed);
    }

    fn context_parallel(&self, totals: sala_engine::context::ContextStats) {
        self.context_prompts
            .store(totals.prompts, Ordering::Relaxed);
        self.context_tokens.store(totals.tokens, Ordering::Relaxed);
        self.context_read_alone
            .store(totals.read_alone, Ordering::Relaxed);
        self.context_busy.store(totals.busy, Ordering::Relaxed);
    }

    fn released(&self) {
        self.sequence_ended();
    }

    fn finished(&self, outcome: Result<FinishReason, &RequestError>) {
        self.request_done(match outcome {
            Ok(FinishReason::Stop) => Outcome::Stop,
            Ok(FinishReason::Length) => Outcome::Length,
            Ok(FinishReason::Cancelled) => Outcome::Cancelled,
            Err(e) => Outcome::of_status(ApiError::from(e).status.as_u16()),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_buckets_are_cumulative_and_bounds_inclusive() {
        let h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 1.0, 3.0] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        let want = "x_bucket{le=\"0.1\"} 2\nx_bucket{le=\"1\"} 4\nx_bucket{le=\"+Inf\"} 5\n";
        assert!(out.contains(want), "{out}");
        assert!(out.contains("x_count 5\n"), "{out}");
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("x_sum "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((sum - 4.65).abs() < 1e-9);
    }

    #[test]
    fn the_rate_counts_only_the_window() {
        let r = RateWindow {
            slots: Mutex::new([(u64::MAX, 0); RATE_WINDOW_SECS as usize]),
        };
        r.add(0, 5);
        r.add(3, 15);
        assert_eq!(r.rate(0.5), 5.0); // under a second: divided by one second
        assert_eq!(r.rate(4.0), 5.0); // 20 tokens over 4 s
        assert_eq!(r.rate(12.5), 1.5); // second 0 has left the window
        r.add(13, 10); // reuses second 3's slot
        assert_eq!(r.rate(13.0), 1.0);
        assert_eq!(r.rate(40.0), 0.0);
    }

    #[test]
    fn tokens_feed_the_histograms_and_counters() {
        let m = Metrics::new();
        let t0 = Instant::now();
        m.sequence_started(7);
        m.set_cache_bytes(100, 4096);
        m.token(t0 + Duration::from_millis(30), t0, true);
        m.token(
            t0 + Duration::from_millis(32),
            t0 + Duration::from_millis(30),
            false,
        );
        m.set_cache_bytes(120, 4096);
        Observer::speculation(
            &m,
            sala_engine::generate::SpeculationStats {
                drafted: 12,
                accepted: 9,
                spans: 4,
                draft_micros: 1500,
            },
        );
        let text = m.render(0, 8);
        for line in [
            "sala_speculative_draft_tokens_total 12",
            "sala_speculative_accepted_tokens_total 9",
            "sala_speculative_steps_total 4",
            "sala_speculative_mean_accepted_length 2.25",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        for line in [
            "sala_requests_running 1",
            "sala_cache_bytes 120",
            "sala_cache_bytes_in_use 4096",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        m.set_cache_bytes(0, 0);
        m.sequence_ended();
        m.request_done(Outcome::Length);
        let text = m.render(2, 8);
        for line in [
            "sala_queue_depth 2",
            "sala_queue_capacity 8",
            "sala_prompt_tokens_total 7",
            "sala_generation_tokens_total 2",
            "sala_requests_running 0",
            "sala_cache_bytes 0",
            "sala_cache_bytes_in_use 0",
            "sala_requests_total{outcome=\"length\"} 1",
            "sala_requests_total{outcome=\"stop\"} 0",
            "sala_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "sala_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "sala_inter_token_latency_seconds_bucket{le=\"0.001\"} 0",
            "sala_inter_token_latency_seconds_bucket{le=\"0.0025\"} 1",
            "sala_inter_token_latency_seconds_count 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
    }
}
