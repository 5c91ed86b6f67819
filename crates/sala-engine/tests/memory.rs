//! The memory plan against what the model allocates, and the engine's memory limit: a
//! request whose plan does not fit is refused before any work.

mod common;

use sala_checkpoint::{preset, ModelConfig};
use sala_cpu::CpuBackend;
use sala_engine::generate::{request_tokens, Engine, EngineError, GenerateOptions};
use sala_engine::sampling::SamplingParams;
use sala_model::memory::{workspace_columns, MemoryLimit, MemoryPlan};
use sala_model::{Backend, Model};

/// Every buffer `Model::workspace` allocates is one of `workspace_columns`, at its width, and
/// the CPU plan's workspace term is their size (f32).
fn check_workspace(config: ModelConfig, rows: usize) {
    let be = CpuBackend::default();
    let model = Model::random(&be, config.clone(), 1, &mut |_, _| {}).unwrap();
    let mut ws = model.workspace(&be, rows).unwrap();
    let cols = workspace_columns(&config);
    let bufs = ws.buffers_mut();
    assert_eq!(bufs.len(), cols.len());
    let mut values = 0;
    for (buf, (name, want)) in bufs.iter().zip(cols) {
        assert_eq!(buf.cols, want, "buffer {name}");
        assert_eq!(buf.data.len(), rows * want, "buffer {name}");
        values += buf.data.len();
    }
    let plan = MemoryPlan::new(&config, 1000, rows, &be.memory_facts(&config, rows));
    assert_eq!(plan.workspace, 4 * values);
}

#[test]
fn workspace_matches_the_memory_plan() {
    check_workspace(preset("tiny").unwrap(), 37);
    // Widths that differ from each other in every term.
    let mut c = preset("tiny").unwrap();
    c.intermediate_size = 200;
    c.lightning_nkv = 1;
    check_workspace(c, 5);
}

fn engine(dir: &std::path::Path) -> Engine<CpuBackend> {
    common::tiny_engine(dir, 0, 16, |_| {})
}

fn opts(max_tokens: usize, max_context: usize) -> GenerateOptions {
    GenerateOptions {
        max_context,
        ..common::options(max_tokens, SamplingParams::default())
    }
}

#[test]
fn request_tokens_are_capped_by_the_context() {
    assert_eq!(request_tokens(10, &opts(5, 100)).unwrap(), 15);
    assert_eq!(request_tokens(10, &opts(500, 100)).unwrap(), 100);
    assert!(matches!(
        request_tokens(100, &opts(5, 100)),
        Err(EngineError::PromptTooLong { .. })
    ));
    assert!(matches!(
        request_tokens(0, &opts(5, 100)),
        Err(EngineError::EmptyPrompt)
    ));
}

#[test]
fn a_request_over_the_memory_limit_is_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = engine(tmp.path());
    let prompt = e.tokenizer.encode("The quick brown fox", true).unwrap();
    let o = opts(8, 4096);
    let plan = e.memory_plan(prompt.len() + 8);
    // The workspace of a step: a prompt chunk beside the batch's decode rows.
    assert_eq!(plan.rows, e.prefill_chunk() + e.max_batch());
    assert_eq!(plan.context, prompt.len() + 8);

    // One byte short of the plan: refused, naming both sizes; nothing was prefilled.
    let limit = |bytes: usize| MemoryLimit {
        bytes,
        source: "a test limit".into(),
    };
    e.set_memory_limit(Some(limit(plan.total() - 1)));
    let mut prefilled = 0;
    let err = e
        .generate(&prompt, &o, &mut |_| {}, &mut |n| prefilled += n)
        .unwrap_err();
    assert!(matches!(err, EngineError::OverBudget(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("a test limit") && msg.contains("GiB"), "{msg}");
    assert!(
        msg.contains(&format!("{} tokens", prompt.len() + 8)),
        "{msg}"
    );
    assert_eq!(prefilled, 0);

    // Exactly the plan fits; so does no limit.
    e.set_memory_limit(Some(limit(plan.total())));
    let g = e
        .generate(&prompt, &o, &mut |_| {}, &mut |n| prefilled += n)
        .unwrap();
    assert_eq!(g.tokens.len(), 8);
    assert_eq!(prefilled, prompt.len());
    // More tokens asked for than the limit holds: refused again.
    assert!(e
        .generate(&prompt, &opts(9, 4096), &mut |_| {}, &mut |_| {})
        .is_err());
    e.set_memory_limit(None);
    assert!(e
        .generate(&prompt, &opts(9, 4096), &mut |_| {}, &mut |_| {})
        .is_ok());
}
