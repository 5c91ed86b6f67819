//! The prefix cache on a tiny random checkpoint (CPU): a request that resumes from a parked
//! sequence gives what it gives read cold — bit for bit where it resumes at a chunk boundary
//! of the cold run — through the failures other engines had: a match with no snapshot inside
//! it, a prompt of whole chunks, a match ending inside a block, prompts read densely and
//! sparsely, a hit and a miss in one step, eviction under the memory limit, speculative
//! decoding after a hit, and identical prompts at once (each forks the parked sequence).

mod common;

use sala_cpu::CpuBackend;
use sala_engine::draft::{DraftSource, Speculate};
use sala_engine::generate::{Engine, GenerateOptions};
use sala_engine::step::StepEvent;
use sala_model::memory::MemoryLimit;
use sala_model::numerics::TestRng;
use std::cell::RefCell;

/// Prefill chunks of this many tokens.
const CHUNK: usize = 32;

fn engine(dir: &std::path::Path, prefix: bool) -> Engine<CpuBackend> {
    let mut e = common::tiny_engine(dir, 5, CHUNK, |_| {});
    e.set_max_batch(4).unwrap();
    e.set_prefix_cache(prefix.then_some(1 << 30));
    e
}

fn opts(max_tokens: usize) -> GenerateOptions {
    common::options(max_tokens, common::greedy())
}

fn tokens(rng: &mut TestRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| 3 + rng.below(200) as u32).collect()
}

/// A request's tokens with the bits of their logprobs, and the prompt tokens it took from
/// the cache.
type Run = (Vec<(u32, u32)>, usize);

fn run(e: &mut Engine<CpuBackend>, prompt: &[u32], o: &GenerateOptions) -> Run {
    let g = e.generate(prompt, o, &mut |_| {}, &mut |_| {}).unwrap();
    let out = g
        .tokens
        .iter()
        .map(|t| (t.id, t.logprob.to_bits()))
        .collect();
    (out, g.cached_tokens)
}

/// Requests admitted together in one batch, run to their ends.
fn together(e: &mut Engine<CpuBackend>, prompts: &[Vec<u32>], o: &GenerateOptions) -> Vec<Run> {
    let out: RefCell<Vec<Run>> = RefCell::new(vec![(Vec::new(), 0); prompts.len()]);
    common::run_together(e, prompts.iter().map(|p| (p, o)), &|i, ev| {
        let r = &mut out.borrow_mut()[i];
        match ev {
            StepEvent::Token(s) => {
                if let Some(t) = s.token {
                    r.0.push((t.id, t.logprobs.as_ref().map_or(0, |l| l.logprob.to_bits())));
                }
            }
            StepEvent::Done(d) => r.1 = d.unwrap().cached_tokens,
            _ => {}
        }
    });
    out.into_inner()
}

fn ids(r: &Run) -> Vec<u32> {
    r.0.iter().map(|t| t.0).collect()
}

#[test]
fn a_hit_at_a_chunk_boundary_is_the_cold_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(1);
    let doc = tokens(&mut rng, 128);
    let first: Vec<u32> = doc.iter().copied().chain(tokens(&mut rng, 10)).collect();
    let second: Vec<u32> = doc.iter().copied().chain(tokens(&mut rng, 12)).collect();
    assert_ne!(first[128], second[128]);
    let o = opts(8);
    let a = run(&mut hot, &first, &o);
    assert_eq!(a.1, 0, "nothing parked yet");
    assert_eq!(a, run(&mut cold, &first, &o));
    // The document's 128 tokens (four whole chunks) come from the cache.
    let b = run(&mut hot, &second, &o);
    assert_eq!(b.1, 128);
    assert_eq!(b.0, run(&mut cold, &second, &o).0);
    let (stats, bytes) = hot.prefix_cache().unwrap();
    assert_eq!((stats.lookups, stats.hits, stats.hit_tokens), (2, 1, 128));
    assert_eq!(
        stats.missed_tokens,
        (first.len() + second.len() - 128) as u64
    );
    assert!(bytes > 0);
}

#[test]
fn a_session_resumes_after_its_answer_and_a_whole_chunk_prompt_below_its_end() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(2);
    let o = opts(12);
    let turn1 = tokens(&mut rng, 110);
    let a = run(&mut hot, &turn1, &o);
    // The next turn: the conversation so far, then new tokens. Everything the parked
    // sequence holds (the prompt and the 11 answer tokens fed back) is reused.
    let turn2: Vec<u32> = turn1
        .iter()
        .copied()
        .chain(ids(&a))
        .chain(tokens(&mut rng, 7))
        .collect();
    let b = run(&mut hot, &turn2, &o);
    assert_eq!(b.1, 110 + 11);
    // Not at a chunk boundary of the cold run: the same tokens, logprobs to rounding.
    let c = run(&mut cold, &turn2, &o);
    assert_eq!(ids(&b), ids(&c));
    for (x, y) in b.0.iter().zip(&c.0) {
        let (x, y) = (f32::from_bits(x.1), f32::from_bits(y.1));
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
    // A prompt of whole chunks asked again: its end is no resume point (one token must be
    // read for its logits), the snapshot below it is: at its tail cut (4 chunks make a long
    // prompt, cut half a chunk before its end), a boundary of the cold run's pieces.
    let whole = tokens(&mut rng, 4 * CHUNK);
    let first = run(&mut hot, &whole, &o);
    let again = run(&mut hot, &whole, &o);
    assert_eq!(
        Some(again.1),
        sala_engine::scheduler::tail_cut(4 * CHUNK, CHUNK)
    );
    assert_eq!(again.1, 4 * CHUNK - CHUNK / 2);
    assert_eq!(again.0, first.0);
    assert_eq!(again.0, run(&mut cold, &whole, &o).0);
}

#[test]
fn matches_resume_only_from_a_snapshot_inside_them_and_the_same_attention() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(3);
    let o = opts(4);
    let long = tokens(&mut rng, 140);
    run(&mut hot, &long, &o);
    // 20 shared tokens: no snapshot inside (the first is at 32), so a miss, never a start
    // from an empty lightning state.
    let few: Vec<u32> = long[..20]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 90))
        .collect();
    let r = run(&mut hot, &few, &o);
    assert_eq!(r.1, 0);
    assert_eq!(r.0, run(&mut cold, &few, &o).0);
    // A match ending inside a block of 64 (at 100): the snapshot at 96 below it.
    let inside: Vec<u32> = long[..100]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 9))
        .collect();
    assert!(inside[100] != long[100]);
    let r = run(&mut hot, &inside, &o);
    assert_eq!(r.1, 96);
    assert_eq!(r.0, run(&mut cold, &inside, &o).0);
    // Shorter than `dense_len` (96): read densely, so the sparsely read sequences serve it
    // nothing; then a dense one serves the next dense prompt.
    let short: Vec<u32> = long[..70]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 5))
        .collect();
    let r = run(&mut hot, &short, &o);
    assert_eq!(r.1, 0);
    assert_eq!(r.0, run(&mut cold, &short, &o).0);
    let shorter: Vec<u32> = short[..72]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 3))
        .collect();
    let r = run(&mut hot, &shorter, &o);
    assert_eq!(r.1, 64);
    assert_eq!(r.0, run(&mut cold, &shorter, &o).0);
}

#[test]
fn hits_and_misses_share_steps_and_identical_prompts_come_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(4);
    let o = opts(6);
    let doc = tokens(&mut rng, 160);
    run(&mut hot, &doc, &o);
    let hit: Vec<u32> = doc[..130]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 4))
        .collect();
    let miss = tokens(&mut rng, 120);
    let got = together(&mut hot, &[hit.clone(), miss.clone()], &o);
    assert_eq!((got[0].1, got[1].1), (128, 0));
    let want = together(&mut cold, &[hit.clone(), miss], &o);
    assert_eq!(ids(&got[0]), ids(&want[0]));
    assert_eq!(ids(&got[1]), ids(&want[1]));
    // Three identical prompts at once, with a parked sequence for them: each starts from a
    // fork of it (the parked one stays), and each gives the cold run's tokens.
    let same: Vec<u32> = doc[..100]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 30))
        .collect();
    run(&mut hot, &same, &o);
    let got = together(&mut hot, &[same.clone(), same.clone(), same.clone()], &o);
    let want = ids(&run(&mut cold, &same, &o));
    for r in &got {
        assert_eq!(r.1, 128);
        assert_eq!(ids(r), want);
    }
    // The document's own parked sequence serves still.
    let again: Vec<u32> = doc[..140]
        .iter()
        .copied()
        .chain(tokens(&mut rng, 2))
        .collect();
    let r = run(&mut hot, &again, &o);
    assert_eq!(r.1, 128);
    assert_eq!(ids(&r), ids(&run(&mut cold, &again, &o)));
}

#[test]
fn parked_sequences_make_room_and_stay_within_their_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(6);
    let o = opts(5);
    let prompts: Vec<Vec<u32>> = (0..3).map(|_| tokens(&mut rng, 150)).collect();
    // A limit that fits one request's plan and little more: the next request needs the
    // parked sequence's memory.
    let plan = hot.memory_plan(150 + 5);
    let snapshots = sala_engine::prefix::MAX_SNAPSHOTS * hot.cache_budget().snapshot_bytes();
    let limit = plan.total() + snapshots + plan.cache.total() / 4;
    for e in [&mut hot, &mut cold] {
        e.set_memory_limit(Some(MemoryLimit {
            bytes: limit,
            source: "test".into(),
        }));
    }
    for p in &prompts {
        assert_eq!(run(&mut hot, p, &o), run(&mut cold, p, &o));
    }
    let (stats, _) = hot.prefix_cache().unwrap();
    assert!(stats.evictions >= 2, "{stats:?}");
    // And a byte limit of its own: one parked sequence's worth at most.
    hot.set_memory_limit(None);
    let one = hot.cache_budget().sequence_bytes(155, 8);
    hot.set_prefix_cache(Some(one));
    for p in &prompts {
        run(&mut hot, p, &o);
        let (_, bytes) = hot.prefix_cache().unwrap();
        assert!(bytes <= one, "{bytes} > {one}");
    }
    // The last one is still there.
    let again: Vec<u32> = prompts[2][..140].iter().copied().chain([7, 8]).collect();
    let r = run(&mut hot, &again, &o);
    assert!(r.1 >= 128, "{}", r.1);
    assert_eq!(ids(&r), ids(&run(&mut cold, &again, &o)));
}

#[test]
fn a_hit_then_speculative_decoding_is_the_cold_run() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(7);
    // A repetitive document, so prompt lookup drafts.
    let unit = tokens(&mut rng, 20);
    let doc: Vec<u32> = unit.iter().copied().cycle().take(150).collect();
    let plain = opts(16);
    let spec = GenerateOptions {
        speculate: Some(Speculate {
            max_draft: 4,
            drafts: DraftSource::PromptLookup,
        }),
        ..opts(16)
    };
    run(&mut hot, &doc, &plain);
    let next: Vec<u32> = doc[..140]
        .iter()
        .copied()
        .chain(unit[..5].iter().copied())
        .collect();
    let r = run(&mut hot, &next, &spec);
    assert!(r.1 >= 128, "{}", r.1);
    assert_eq!(ids(&r), ids(&run(&mut cold, &next, &spec)));
    assert_eq!(ids(&r), ids(&run(&mut cold, &next, &plain)));
    // A request that speculated parks at its prompt's end.
    let r = run(&mut hot, &next, &plain);
    assert!(r.1 >= 128, "{}", r.1);
    assert_eq!(ids(&r), ids(&run(&mut cold, &next, &plain)));
}

/// Under a memory limit with room for one request and one parked sequence, a follow-up makes
/// room by evicting the other parked sequences, never the one it resumes from (the least
/// recently used here), and still gives the cold run's tokens.
#[test]
fn making_room_never_evicts_the_sequence_a_request_resumes_from() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(8);
    let o = opts(4);
    let doc = tokens(&mut rng, 140);
    let other = tokens(&mut rng, 140);
    // What one parked sequence of these holds (the document's, measured alone).
    run(&mut hot, &doc, &o);
    let (_, parked) = hot.prefix_cache().unwrap();
    let plan = hot.memory_plan(140 + 4);
    let snapshots = sala_engine::prefix::MAX_SNAPSHOTS * hot.cache_budget().snapshot_bytes();
    let limit = plan.total() + snapshots + parked + parked / 2;
    for e in [&mut hot, &mut cold] {
        e.set_memory_limit(Some(MemoryLimit {
            bytes: limit,
            source: "test".into(),
        }));
    }
    // The other prompt fits beside the parked document; the follow-up does not fit beside
    // both, and the document is the least recently used.
    run(&mut hot, &other, &o);
    assert_eq!(hot.prefix_cache().unwrap().0.evictions, 0);
    let follow: Vec<u32> = doc[..130].iter().copied().chain([9, 9]).collect();
    let r = run(&mut hot, &follow, &o);
    assert_eq!(r.1, 128);
    assert_eq!(r.0, run(&mut cold, &follow, &o).0);
    let (stats, _) = hot.prefix_cache().unwrap();
    assert!(stats.evictions >= 1, "{stats:?}");
}

/// What a fork maps from its source (a backend's shared pages) is counted once: while the
/// source stays parked, a parked fork's bytes leave out the shared part, and so do a running
/// fork's (its lease counts them); once the source goes, the fork holds them alone.
#[test]
fn a_fork_sharing_its_source_is_counted_once() {
    use sala_engine::prefix::{PrefixCache, Shared};
    let be = CpuBackend::default();
    let model = sala_model::Model::random(
        &be,
        sala_checkpoint::preset("tiny").unwrap(),
        3,
        &mut |_, _| {},
    )
    .unwrap();
    let mut cache = PrefixCache::new(1 << 30);
    let park = |cache: &mut PrefixCache<CpuBackend>, first: u32, bytes, shares| {
        let mut seq = model.new_sequence(&be).unwrap();
        let mut ws = model.workspace(&be, 8).unwrap();
        let prompt: Vec<u32> = (first..first + 8).collect();
        model
            .prefill(&be, &mut ws, &mut seq, &prompt, &mut |_| {})
            .unwrap();
        cache.park(seq, prompt, false, Vec::new(), bytes, shares);
    };
    park(&mut cache, 10, 1000, None);
    assert_eq!(cache.bytes(), 1000);
    let source = cache.find(&(10..30).collect::<Vec<_>>(), false).unwrap().id;
    let shared = Shared { source, bytes: 600 };
    // A fork of it parks: 700 bytes, 600 of them the source's pages.
    park(&mut cache, 40, 700, Some(shared));
    assert_eq!(cache.bytes(), 1000 + 100);
    // Running forks' shares of a parked source are theirs; of a gone one, nothing.
    let gone = Shared {
        source: source + 100,
        bytes: 50,
    };
    assert_eq!(cache.shared_with([shared, shared, gone]), 1200);
    // The source goes (least recently used): the parked fork holds its pages alone.
    assert!(cache.evict_one());
    assert_eq!(cache.bytes(), 700);
    assert_eq!(cache.shared_with([shared]), 0);
}

/// A second question about a document of any length: the first prompt (long: 4 chunks and
/// more) was also cut shortly before its end, inside the document when its question is
/// short, so the follow-up resumes there and reads little more than its own question (rather
/// than from the chunk boundary below the document's end).
#[test]
fn a_follow_up_question_resumes_at_the_first_prompts_tail_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (mut hot, mut cold) = (engine(dir.path(), true), engine(dir.path(), false));
    let mut rng = TestRng::new(9);
    let doc = tokens(&mut rng, 150);
    let first: Vec<u32> = doc.iter().copied().chain(tokens(&mut rng, 10)).collect();
    let second: Vec<u32> = doc.iter().copied().chain(tokens(&mut rng, 12)).collect();
    assert_ne!(first[150], second[150]);
    let cut = sala_engine::scheduler::tail_cut(first.len(), CHUNK).unwrap();
    assert!(cut > 4 * CHUNK && cut <= doc.len(), "{cut}");
    let o = opts(8);
    run(&mut hot, &first, &o);
    let b = run(&mut hot, &second, &o);
    assert_eq!(b.1, cut);
    // Not a boundary of the cold run's pieces: the same tokens, logprobs to rounding.
    let c = run(&mut cold, &second, &o);
    assert_eq!(ids(&b), ids(&c));
    for (x, y) in b.0.iter().zip(&c.0) {
        let (x, y) = (f32::from_bits(x.1), f32::from_bits(y.1));
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
}
