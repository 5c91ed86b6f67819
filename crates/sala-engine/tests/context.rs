//! Context-parallel ranks in the engine: a long prompt is read by them where the memory limit
//! leaves room for their workspaces, and by the steps as without them where it does not.

mod common;

use sala_checkpoint::Checkpoint;
use sala_cpu::{CpuBackend, HostRanks};
use sala_engine::context::{ContextRanks, ContextStats};
use sala_engine::generate::{load_model, Engine, Generation};
use sala_model::memory::MemoryLimit;
use sala_model::numerics::TestRng;

/// The tiny engine with `extra` more simulated ranks (none: no context parallelism).
fn engine(dir: &std::path::Path, extra: usize) -> Engine<CpuBackend> {
    let mut e = common::tiny_engine(dir, 3, 64, |_| {});
    if extra > 0 {
        let checkpoint = Checkpoint::open(dir).unwrap();
        let backends: Vec<_> = (0..extra).map(|_| CpuBackend::default()).collect();
        let models = backends
            .iter()
            .map(|be| load_model(be, &checkpoint, &mut |_, _| {}).unwrap())
            .collect();
        let ranks = ContextRanks::new(backends, models, Box::new(HostRanks)).unwrap();
        e.set_context_parallel(Some(ranks));
    }
    e
}

fn generate(e: &mut Engine<CpuBackend>, prompt: &[u32]) -> Generation {
    let o = common::options(6, common::greedy());
    e.generate(prompt, &o, &mut |_| {}, &mut |_| {}).unwrap()
}

/// Without a limit, and under one that leaves room, the ranks read a long prompt (its last
/// token aside); under one that leaves the caches room but not the ranks' workspaces, the
/// steps read it, bit for bit as an engine without ranks; short prompts are never theirs.
#[test]
fn ranks_read_long_prompts_where_the_memory_leaves_them_room() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = TestRng::new(9);
    let prompt: Vec<u32> = (0..300).map(|_| 3 + rng.below(200) as u32).collect();
    let mut alone = engine(dir.path(), 0);
    let want = generate(&mut alone, &prompt);
    let mut e = engine(dir.path(), 1);
    let read = |prompts, tokens, read_alone| ContextStats {
        prompts,
        tokens,
        read_alone,
        busy: 0,
    };
    let got = generate(&mut e, &prompt);
    assert_eq!(e.context_stats(), Some(read(1, 299, 0)));
    // The ranks' rounding differs from one device's; here not enough to change a pick.
    for (g, w) in got.tokens.iter().zip(&want.tokens) {
        assert_eq!(g.id, w.id, "read by the ranks");
        assert!((g.logprob - w.logprob).abs() < 0.05, "{g:?} vs {w:?}");
    }
    assert_eq!(got.tokens.len(), want.tokens.len());
    // A short prompt: every rank would get fewer than two blocks.
    generate(&mut e, &prompt[..60]);
    assert_eq!(e.context_stats(), Some(read(1, 299, 0)));
    // Room for the request's caches and a little more, not for the ranks' workspaces.
    let total = prompt.len() + 6;
    let plan = e.cache_budget().plan(total);
    let tight = MemoryLimit {
        bytes: plan.total() + 1024,
        source: "test".into(),
    };
    e.set_memory_limit(Some(tight.clone()));
    let got = generate(&mut e, &prompt);
    assert_eq!(e.context_stats(), Some(read(1, 299, 1)));
    assert_eq!(got.tokens, want.tokens, "read by the steps");
    // Room for a range's workspace (each rank's, the ranks sharing this host's memory).
    let roomy = MemoryLimit {
        bytes: tight.bytes + 2 * e.cache_budget().plan(total).workspace * 4,
        source: "test".into(),
    };
    e.set_memory_limit(Some(roomy));
    generate(&mut e, &prompt);
    assert_eq!(e.context_stats(), Some(read(2, 598, 1)));
}

type Log = std::rc::Rc<std::cell::RefCell<Vec<(usize, String)>>>;

/// A client logging request `i`'s events: `read N`, `prefilled`, `token ID`, `done`.
fn logger(log: &Log, i: usize) -> Box<dyn FnMut(sala_engine::step::StepEvent<'_>) -> bool> {
    use sala_engine::step::StepEvent;
    let log = log.clone();
    Box::new(move |ev: StepEvent<'_>| {
        let what = match ev {
            StepEvent::Read { tokens } => format!("read {tokens}"),
            StepEvent::Prefilled { .. } => "prefilled".into(),
            StepEvent::Token(s) => match s.token {
                Some(t) => format!("token {}", t.id),
                None => return true,
            },
            StepEvent::Done(_) => "done".into(),
        };
        log.borrow_mut().push((i, what));
        true
    })
}

/// The ranks read a long prompt over several steps (each about a chunk of each range through
/// every layer), so a request already decoding gets a token in each of those steps; the long
/// prompt's tokens are those it gets read alone, and its first event is the ranks' read of all
/// of it but its last token.
/// While they read one prompt another long one is the steps'; a request cancelled while the
/// ranks read it frees them (and the memory their read holds) for the next.
#[test]
fn ranks_read_over_steps_beside_the_other_requests() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = TestRng::new(11);
    let long: Vec<u32> = (0..300).map(|_| 3 + rng.below(200) as u32).collect();
    let other: Vec<u32> = (0..280).map(|_| 3 + rng.below(200) as u32).collect();
    let short: Vec<u32> = (0..20).map(|_| 3 + rng.below(200) as u32).collect();
    let mut e = engine(dir.path(), 1);
    let layers = e.model.config.num_hidden_layers;
    let want = generate(&mut e, &long);
    assert_eq!(e.context_stats().unwrap().prompts, 1);
    let log: Log = Default::default();
    e.set_max_batch(4).unwrap();
    let mut batch = e.batch();
    let o = common::options(6, common::greedy());
    let decoding = common::options(2 * layers + 8, common::greedy());
    e.admit(&mut batch, short.clone(), &decoding, None, logger(&log, 0))
        .unwrap();
    while !log
        .borrow()
        .iter()
        .any(|(i, w)| *i == 0 && w.starts_with("token"))
    {
        e.step(&mut batch);
    }
    let at = log.borrow().len();
    e.admit(&mut batch, long.clone(), &o, None, logger(&log, 1))
        .unwrap();
    // Admitted while the ranks read `long`: read by the steps.
    e.admit(&mut batch, other.clone(), &o, None, logger(&log, 2))
        .unwrap();
    let mut steps = 0;
    while !log
        .borrow()
        .iter()
        .any(|(i, w)| *i == 1 && w == "prefilled")
    {
        e.step(&mut batch);
        steps += 1;
        assert!(steps < 10 * layers, "the long prompt was never read");
    }
    assert!(steps >= 2, "read in {steps} step(s)");
    let events = log.borrow()[at..].to_vec();
    let first = events.iter().find(|(i, _)| *i == 1).unwrap();
    assert_eq!(first.1, "read 299", "{events:?}");
    let beside = events
        .iter()
        .take_while(|(i, w)| !(*i == 1 && w == "prefilled"))
        .filter(|(i, w)| *i == 0 && w.starts_with("token"))
        .count();
    assert!(
        beside + 1 >= steps,
        "{beside} tokens in {steps} steps: {events:?}"
    );
    while !batch.is_empty() {
        e.step(&mut batch);
    }
    let got: Vec<String> = log
        .borrow()
        .iter()
        .filter(|(i, w)| *i == 1 && w.starts_with("token"))
        .map(|(_, w)| w.clone())
        .collect();
    let alone: Vec<String> = want
        .tokens
        .iter()
        .map(|t| format!("token {}", t.id))
        .collect();
    assert_eq!(got, alone);
    let stats = e.context_stats().unwrap();
    assert_eq!((stats.prompts, stats.tokens), (2, 598), "{stats:?}");
    assert_eq!((stats.read_alone, stats.busy), (0, 1), "{stats:?}");
    // Cancelled mid-read: the ranks take the next long prompt, the memory held is freed.
    let limit = MemoryLimit {
        bytes: 1 << 40,
        source: "test".into(),
    };
    e.set_memory_limit(Some(limit));
    let mut batch = e.batch();
    let spare = batch.cache().spare_bytes().unwrap();
    let id = e
        .admit(&mut batch, long.clone(), &o, None, logger(&log, 3))
        .unwrap();
    let reading = batch.cache().spare_bytes().unwrap();
    e.step(&mut batch);
    e.step(&mut batch);
    batch.cancel_where(|x, _| x == id);
    assert_eq!(batch.cache().spare_bytes(), Some(spare));
    let planned = spare - reading;
    assert!(
        planned > e.cache_budget().plan(long.len() + 6).cache.total(),
        "nothing held"
    );
    e.admit(&mut batch, long.clone(), &o, None, logger(&log, 4))
        .unwrap();
    while !batch.is_empty() {
        e.step(&mut batch);
    }
    assert_eq!(e.context_stats().unwrap().prompts, 3);
}

/// With the prefix cache on, the ranks read a long prompt up to its tail cut and the engine
/// snapshots it there, as the steps would: a follow-up on the same document with another
/// question resumes at that snapshot instead of being read by the ranks again, and picks what
/// reading it whole on one device picks (within the ranks' rounding).
#[test]
fn ranks_leave_a_snapshot_at_the_tail_cut_for_a_follow_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = TestRng::new(12);
    let mut draw = |n: usize| -> Vec<u32> { (0..n).map(|_| 3 + rng.below(200) as u32).collect() };
    let doc = draw(290);
    let first = [doc.clone(), draw(10)].concat();
    let second = [doc, draw(10)].concat();
    let mut e = engine(dir.path(), 1);
    e.set_prefix_cache(Some(1 << 30));
    let cut = sala_engine::scheduler::tail_cut(first.len(), 64).unwrap();
    assert!(cut < 290, "the cut {cut} lies past the document");
    generate(&mut e, &first);
    let stats = e.context_stats().unwrap();
    assert_eq!((stats.prompts, stats.tokens), (1, cut as u64), "{stats:?}");
    let got = generate(&mut e, &second);
    assert_eq!(got.cached_tokens, cut);
    assert_eq!(
        e.context_stats().unwrap().prompts,
        1,
        "read by the ranks again"
    );
    let want = generate(&mut engine(dir.path(), 0), &second);
    assert_eq!(got.tokens.len(), want.tokens.len());
    for (g, w) in got.tokens.iter().zip(&want.tokens) {
        assert_eq!(g.id, w.id, "resumed at the ranks' snapshot");
        assert!((g.logprob - w.logprob).abs() < 0.05, "{g:?} vs {w:?}");
    }
}
