//! The engine thread on a tiny random checkpoint: events in order with the text `generate`
//! makes, typed refusals, the observer hearing of everything, a dropped receiver cancelling
//! its request, a paused client pausing only its own, a full queue, and a panic in a step
//! failing the requests in flight while the engine goes on.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::draft::Speculate;
use sala_engine::generate::{Engine, FinishReason, GenerateOptions};
use sala_engine::request::{Event, Prompt, Request, RequestError};
use sala_engine::sampling::SamplingParams;
use sala_engine::thread::{self, Handle, Observer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const MAX_CONTEXT: usize = 256;

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap().keep();
        let config = preset("tiny").unwrap();
        write_random_checkpoint(&dir, &config, &WriteOptions::default()).unwrap();
        sala_tokenizer::write_test_tokenizer(&dir, config.vocab_size).unwrap();
        dir
    })
}

fn load() -> Engine<CpuBackend> {
    Engine::load(CpuBackend::default(), model_dir(), 64, &mut |_, _| {}).unwrap()
}

/// Counts what the observer hears; panics once, at the `panic_at`-th token, when set.
#[derive(Default)]
struct Counts {
    admitted: AtomicUsize,
    tokens: AtomicUsize,
    released: AtomicUsize,
    held: AtomicUsize,
    drafted: AtomicUsize,
    finished: Mutex<Vec<Result<FinishReason, RequestError>>>,
    panic_at: Option<usize>,
    panicked: AtomicBool,
}

impl Observer for Counts {
    fn admitted(&self, _: usize) {
        self.admitted.fetch_add(1, Ordering::SeqCst);
    }
    fn token(&self, _: Instant, _: Instant, _: bool) {
        let n = self.tokens.fetch_add(1, Ordering::SeqCst) + 1;
        if Some(n) == self.panic_at && !self.panicked.swap(true, Ordering::SeqCst) {
            panic!("a test panic in the step");
        }
    }
    fn cache(&self, held: usize, _: usize) {
        self.held.store(held, Ordering::SeqCst);
    }
    fn speculation(&self, totals: sala_engine::generate::SpeculationStats) {
        self.drafted
            .store(totals.drafted as usize, Ordering::SeqCst);
    }
    fn released(&self) {
        self.released.fetch_add(1, Ordering::SeqCst);
    }
    fn finished(&self, outcome: Result<FinishReason, &RequestError>) {
        self.finished
            .lock()
            .unwrap()
            .push(outcome.map_err(Clone::clone));
    }
}

fn spawn(queue: usize, max_batch: usize, counts: Arc<Counts>) -> Handle {
    thread::spawn(Some(MAX_CONTEXT), queue, counts, move |runner| {
        runner.max_batch(max_batch).run(load());
        Ok(())
    })
    .unwrap()
}

fn request(prompt: Prompt, max_tokens: usize) -> Request {
    Request {
        prompt,
        sampling: SamplingParams::default(),
        max_tokens,
        stop: Vec::new(),
        ignore_eos: true,
        speculative: true,
        logprobs: None,
        prompt_logprobs: None,
        grammar: None,
    }
}

/// Reads a request's events to the end: its text, and its `Done` (or error).
fn drain(
    rx: &mut tokio::sync::mpsc::Receiver<Event>,
) -> (String, Result<(FinishReason, usize, usize), RequestError>) {
    let mut text = String::new();
    match rx.blocking_recv() {
        Some(Event::Started { .. }) => {}
        Some(Event::Error(e)) => return (text, Err(e)),
        other => panic!("expected Started, got {other:?}"),
    }
    loop {
        match rx.blocking_recv() {
            Some(Event::Text { text: t, .. }) => text.push_str(&t),
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                ..
            }) => return (text, Ok((finish, prompt_tokens, completion_tokens))),
            Some(Event::Error(e)) => return (text, Err(e)),
            other => panic!("unexpected {other:?}"),
        }
    }
}

/// Waits until `cond` holds (the engine thread runs on its own).
fn eventually(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..2000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("never: {what}");
}

#[test]
fn requests_get_their_text_in_order_and_the_observer_hears_all() {
    let counts = Arc::new(Counts::default());
    let engine = spawn(8, 4, counts.clone());
    assert_eq!(engine.info.max_context, MAX_CONTEXT);
    let mut local = load();
    let prompts = ["The lighthouse keeper", "Once upon a time", "zebra"];
    let mut rxs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let r = request(Prompt::Text(p.to_string()), 5 + i);
            engine.submit(r).unwrap()
        })
        .collect();
    let mut tokens = 0;
    for (i, (p, rx)) in prompts.iter().zip(&mut rxs).enumerate() {
        let (text, done) = drain(rx);
        let ids = local.tokenizer.encode(p, true).unwrap();
        let opts = GenerateOptions {
            sampling: SamplingParams::default(),
            max_tokens: 5 + i,
            max_context: MAX_CONTEXT,
            stop: Vec::new(),
            eos_ids: Vec::new(),
            grammar: None,
            prompt_logprobs: None,
            speculate: None,
        };
        let g = local
            .generate(&ids, &opts, &mut |_| {}, &mut |_| {})
            .unwrap();
        assert_eq!(text, g.text, "request {i}");
        assert_eq!(done.unwrap(), (FinishReason::Length, ids.len(), 5 + i));
        tokens += 5 + i;
    }
    // Token ids are a prompt too.
    let mut rx = engine
        .submit(request(Prompt::Tokens(vec![1, 40, 41, 42]), 3))
        .unwrap();
    assert_eq!(drain(&mut rx).1.unwrap(), (FinishReason::Length, 4, 3));
    tokens += 3;
    eventually("every request is counted", || {
        counts.finished.lock().unwrap().len() == 4
    });
    assert_eq!(counts.admitted.load(Ordering::SeqCst), 4);
    assert_eq!(counts.released.load(Ordering::SeqCst), 4);
    assert_eq!(counts.tokens.load(Ordering::SeqCst), tokens);
    assert_eq!(counts.held.load(Ordering::SeqCst), 0);
    assert!(counts
        .finished
        .lock()
        .unwrap()
        .iter()
        .all(|f| *f == Ok(FinishReason::Length)));
}

#[test]
fn bad_requests_are_refused_with_typed_errors() {
    let counts = Arc::new(Counts::default());
    let engine = spawn(8, 4, counts.clone());
    let refuse = |r: Request| {
        let mut rx = engine.submit(r).unwrap();
        match rx.blocking_recv() {
            Some(Event::Error(e)) => e,
            other => panic!("expected an error, got {other:?}"),
        }
    };
    match refuse(request(Prompt::Tokens(Vec::new()), 4)) {
        RequestError::InvalidRequest { param, .. } => assert_eq!(param.as_deref(), Some("prompt")),
        e => panic!("{e:?}"),
    }
    let long = request(Prompt::Tokens(vec![7; MAX_CONTEXT]), 4);
    assert!(matches!(
        refuse(long),
        RequestError::ContextLengthExceeded { .. }
    ));
    let mut bad_stop = request(Prompt::Text("hi".into()), 4);
    bad_stop.stop = vec![String::new()];
    match refuse(bad_stop) {
        RequestError::InvalidRequest { param, .. } => assert_eq!(param.as_deref(), Some("stop")),
        e => panic!("{e:?}"),
    }
    let mut bad_sampling = request(Prompt::Text("hi".into()), 4);
    bad_sampling.sampling.top_p = 2.0;
    assert!(matches!(
        refuse(bad_sampling),
        RequestError::InvalidRequest { .. }
    ));
    eventually("four refusals counted", || {
        counts.finished.lock().unwrap().len() == 4
    });
    assert_eq!(counts.admitted.load(Ordering::SeqCst), 0);
}

#[test]
fn a_paused_client_pauses_only_its_own_request_and_dropping_it_cancels() {
    let counts = Arc::new(Counts::default());
    let engine = spawn(1, 2, counts.clone());
    // A is never read: once its events fill, it pauses.
    let mut a = engine
        .submit(request(Prompt::Text("busy busy".into()), 200))
        .unwrap();
    assert!(matches!(a.blocking_recv(), Some(Event::Started { .. })));
    // B runs beside it to its end.
    let mut b = engine
        .submit(request(Prompt::Text("other".into()), 6))
        .unwrap();
    assert_eq!(drain(&mut b).1.unwrap().2, 6);
    // With A paused in the batch, C waits in the queue and D finds it full.
    let _c = engine.submit(request(Prompt::Text("c".into()), 2)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let d = engine.submit(request(Prompt::Text("d".into()), 2));
    // C may have been admitted beside A already (the batch holds two).
    if let Err(e) = d {
        assert_eq!(e, RequestError::QueueFull);
    }
    assert!(engine.queue_depth() <= engine.queue_capacity());
    // Dropping A cancels it; its memory is released.
    drop(a);
    eventually("A is cancelled", || {
        counts
            .finished
            .lock()
            .unwrap()
            .contains(&Ok(FinishReason::Cancelled))
    });
    let mut e = engine.submit(request(Prompt::Text("e".into()), 3));
    for _ in 0..200 {
        if e.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
        e = engine.submit(request(Prompt::Text("e".into()), 3));
    }
    assert_eq!(drain(&mut e.unwrap()).1.unwrap().2, 3);
}

#[test]
fn a_panic_in_one_requests_work_fails_it_only_and_the_engine_goes_on() {
    // The observer hears each token inside the request's own work: the request whose token is
    // the third fails, the one beside it finishes.
    let counts = Arc::new(Counts {
        panic_at: Some(3),
        ..Default::default()
    });
    let engine = spawn(8, 4, counts.clone());
    let mut a = engine
        .submit(request(Prompt::Text("one".into()), 10))
        .unwrap();
    let mut c = engine
        .submit(request(Prompt::Text("three".into()), 10))
        .unwrap();
    let (ra, rc) = (drain(&mut a).1, drain(&mut c).1);
    let (failed, ok): (Vec<_>, Vec<_>) = [ra, rc].into_iter().partition(Result::is_err);
    assert_eq!((failed.len(), ok.len()), (1, 1), "{failed:?} {ok:?}");
    match &failed[0] {
        Err(RequestError::Internal { message }) => {
            assert!(message.contains("a test panic in the step"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(ok[0].as_ref().unwrap().2, 10);
    assert!(engine.is_alive());
    let mut b = engine
        .submit(request(Prompt::Text("two".into()), 4))
        .unwrap();
    assert_eq!(drain(&mut b).1.unwrap().2, 4);
    eventually("all are counted", || {
        counts.finished.lock().unwrap().len() == 3
    });
    assert_eq!(counts.released.load(Ordering::SeqCst), 3);
    assert_eq!(counts.held.load(Ordering::SeqCst), 0);
}

#[test]
fn the_thread_reports_a_limit_no_request_fits_and_a_failed_factory() {
    let e = thread::spawn(None, 4, Arc::new(thread::NoObserver), |runner| {
        let limit = sala_model::memory::MemoryLimit {
            bytes: 1 << 20,
            source: "a test limit".into(),
        };
        runner.memory_limit(Some(limit)).run(load());
        Ok(())
    })
    .err()
    .expect("must not start");
    assert!(
        e.contains("no request can fit") && e.contains("a test limit"),
        "{e}"
    );

    // The factory's own error comes back as it is.
    let e = thread::spawn(None, 4, Arc::new(thread::NoObserver), |_| {
        Err("no device".to_string())
    })
    .err()
    .unwrap();
    assert_eq!(e, "no device");
}

#[test]
fn the_choices_of_a_prompt_are_each_a_seeds_request_even_past_the_batch() {
    // Three choices of one prompt on a batch of two: the third waits for room and reads the
    // prompt itself; each is what a request of its seed alone gives.
    let engine = spawn(8, 2, Arc::new(Counts::default()));
    let seeded = |seed: u64| {
        let mut r = request(Prompt::Text("a story".into()), 8);
        r.sampling.temperature = 1.0;
        r.sampling.seed = Some(seed);
        r
    };
    let alone: Vec<_> = (0..3)
        .map(|s| drain(&mut engine.submit(seeded(s)).unwrap()))
        .collect();
    let mut rxs = engine.submit_choices((0..3).map(seeded).collect()).unwrap();
    assert_eq!(rxs.len(), 3);
    for (rx, want) in rxs.iter_mut().zip(&alone) {
        let got = drain(rx);
        assert_eq!(got.0, want.0);
        assert_eq!(got.1.as_ref().unwrap(), want.1.as_ref().unwrap());
    }
    assert!(alone.iter().any(|a| a.0 != alone[0].0));
}

/// An engine thread that speculates for every request (greedy, on a repetitive prompt, so
/// drafts are made): each request gets its whole budget of tokens.
#[test]
fn an_engine_that_speculates_serves_every_token() {
    let counts = Arc::new(Counts::default());
    let engine = thread::spawn(Some(MAX_CONTEXT), 4, counts.clone(), move |runner| {
        runner
            .max_batch(2)
            .speculate(Some(Speculate::prompt_lookup(4)))
            .run(load());
        Ok(())
    })
    .unwrap();
    let prompt = "one two three one two three one two three one two three".to_string();
    // First requests that opt out (no drafts), then requests that speculate.
    for speculative in [false, true] {
        let mut rxs: Vec<_> = (0..3)
            .map(|i| {
                let mut r = request(Prompt::Text(prompt.clone()), 20 + i);
                r.sampling = SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                };
                r.speculative = speculative;
                engine.submit(r).unwrap()
            })
            .collect();
        for (i, rx) in rxs.iter_mut().enumerate() {
            let (_, done) = drain(rx);
            let (finish, _, completion) = done.unwrap();
            assert_eq!(
                (finish, completion),
                (FinishReason::Length, 20 + i),
                "request {i}"
            );
        }
        let drafted = counts.drafted.load(Ordering::SeqCst);
        assert_eq!(drafted > 0, speculative, "{drafted} drafts verified");
    }
}
