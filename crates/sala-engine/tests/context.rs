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
        let backends: Vec<_> = (0..extra).map(|_| CpuBackend).collect();
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
