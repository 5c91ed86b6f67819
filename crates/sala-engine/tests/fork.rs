//! A sequence's state copied into a new sequence (a prompt read once for several choices):
//! the copy decodes exactly as the original, on both sides of `dense_len`.

use sala_checkpoint::{preset, write_random_checkpoint, WriteOptions};
use sala_cpu::CpuBackend;
use sala_engine::generate::Engine;
use sala_model::{LogitRows, SeqState, StepInput};

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn a_copied_sequence_decodes_exactly_as_the_original() {
    let tmp = tempfile::tempdir().unwrap();
    let config = preset("tiny").unwrap();
    write_random_checkpoint(tmp.path(), &config, &WriteOptions::default()).unwrap();
    sala_tokenizer::write_test_tokenizer(tmp.path(), config.vocab_size).unwrap();
    let e = Engine::load(CpuBackend::default(), tmp.path(), 64, &mut |_, _| {}).unwrap();
    let (m, be) = (&e.model, &e.backend);
    let mut ws = m.workspace(be, 256).unwrap();
    for len in [5, 70, 150] {
        let prompt: Vec<u32> = (0..len as u32).map(|i| 3 + (i * 11) % 300).collect();
        let mut step = |seq: &mut SeqState<CpuBackend>, tokens: &[u32], total: usize| {
            let mut input = [StepInput {
                seq,
                tokens,
                mode: m.sparse_mode(total),
                logits: LogitRows::Last,
            }];
            m.forward(be, &mut ws, &mut input)
                .unwrap()
                .remove(0)
                .into_rows()
        };
        let mut a = m.new_sequence(be).unwrap();
        m.reserve(be, &mut a, len + 16).unwrap();
        let first = step(&mut a, &prompt, len);
        let mut b = m.new_sequence(be).unwrap();
        m.reserve(be, &mut b, len + 16).unwrap();
        m.copy_sequence(be, &a, &mut b).unwrap();
        assert_eq!(b.pos, a.pos);
        // A copy into a sequence that holds tokens is refused.
        let mut c = m.new_sequence(be).unwrap();
        m.copy_sequence(be, &a, &mut c).unwrap();
        assert!(m.copy_sequence(be, &a, &mut c).is_err());
        let (mut ta, mut tb) = (argmax(&first), argmax(&first));
        for i in 0..12 {
            let la = step(&mut a, &[ta], len + i + 1);
            let lb = step(&mut b, &[tb], len + i + 1);
            assert_eq!(la, lb, "prompt {len}, token {i}");
            (ta, tb) = (argmax(&la), argmax(&lb));
        }
    }
}
