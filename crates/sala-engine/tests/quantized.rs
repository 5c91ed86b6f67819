//! 4-bit GPTQ checkpoints: written from a bf16 one (round to nearest), opened with their
//! tensors checked, and run: a quantized model gives exactly the logits of a bf16 checkpoint
//! holding its dequantized weights (the loader dequantizes the same values), and greedy tokens
//! close to the bf16 model's. Bad quantized checkpoints are refused, naming the tensor.

use sala_checkpoint::quant::{write_quantized, Gptq};
use sala_checkpoint::{
    preset, write_checkpoint_with, write_random_checkpoint, Checkpoint, DType, ModelConfig,
    WriteOptions,
};
use sala_cpu::CpuBackend;
use sala_engine::generate::Engine;
use sala_model::numerics::rel_l2;
use std::path::Path;

fn bf16_checkpoint(dir: &Path) -> ModelConfig {
    let config = preset("tiny").unwrap();
    write_random_checkpoint(
        dir,
        &config,
        &WriteOptions {
            seed: 11,
            ..Default::default()
        },
    )
    .unwrap();
    sala_tokenizer::write_test_tokenizer(dir, config.vocab_size).unwrap();
    config
}

fn logits(dir: &Path, prompt: &[u32]) -> Vec<f32> {
    let e = Engine::load(CpuBackend, dir, 64, &mut |_, _| {}).unwrap();
    let mut ws = e.model.workspace(&CpuBackend, 64).unwrap();
    let mut seq = e.model.new_sequence(&CpuBackend).unwrap();
    e.model
        .prefill(&CpuBackend, &mut ws, &mut seq, prompt, &mut |_| {})
        .unwrap()
}

#[test]
fn a_gptq_checkpoint_runs_as_its_dequantized_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("bf16");
    let config = bf16_checkpoint(&src);
    let prompt: Vec<u32> = (0..70)
        .map(|i| (i * 37 + 5) % config.vocab_size as u32)
        .collect();
    let reference = logits(&src, &prompt);
    let ck = Checkpoint::open(&src).unwrap();
    for (k, q) in [
        Gptq {
            group_size: Some(32),
            sym: true,
            zero_minus_one: true,
            skip: vec![r".*\.o_gate".into(), r".*\.z_proj".into()],
        },
        Gptq {
            group_size: Some(64),
            sym: false,
            zero_minus_one: false,
            skip: vec![],
        },
        Gptq {
            group_size: None,
            sym: false,
            zero_minus_one: true,
            skip: vec![],
        },
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("q{k}"));
        write_quantized(&ck, &out, &q, &mut |_, _| {}).unwrap();
        let qck = Checkpoint::open(&out).unwrap();
        assert_eq!(qck.config().quantization.as_ref(), Some(&q));
        let gate = "model.layers.0.self_attn.o_gate.weight";
        assert_eq!(qck.is_quantized(gate), q.skip.is_empty(), "{q:?}");
        assert!(qck.is_quantized("model.layers.1.mlp.down_proj.weight"));
        assert!(!qck.is_quantized("lm_head.weight"));
        // 4-bit words: a quarter of the bf16 weight's bytes.
        let w = "model.layers.1.mlp.down_proj";
        let packed = qck
            .tensors()
            .find(|t| t.name == format!("{w}.qweight"))
            .unwrap();
        let plain = ck
            .tensors()
            .find(|t| t.name == format!("{w}.weight"))
            .unwrap();
        assert_eq!(packed.byte_len() * 4, plain.byte_len());

        // The same values written as bf16: the same logits, bit for bit.
        let deq = tmp.path().join(format!("deq{k}"));
        let mut plain = config.clone();
        plain.quantization = None;
        plain
            .raw
            .as_object_mut()
            .unwrap()
            .remove("quantization_config");
        write_checkpoint_with(&deq, &plain, DType::Bf16, usize::MAX, |spec, values| {
            values.copy_from_slice(&qck.read_f32(&spec.name).unwrap());
        })
        .unwrap();
        sala_tokenizer::write_test_tokenizer(&deq, config.vocab_size).unwrap();
        let quantized = logits(&out, &prompt);
        assert!(
            quantized == logits(&deq, &prompt),
            "{q:?}: logits differ from the dequantized weights'"
        );
        // And near the bf16 model's (4 bits of random weights: a loose bound).
        let err = rel_l2(&quantized, &reference);
        assert!(err < 0.5, "{q:?}: logits off the bf16 model's by {err}");
    }
}

#[test]
fn bad_gptq_checkpoints_are_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("bf16");
    bf16_checkpoint(&src);
    let ck = Checkpoint::open(&src).unwrap();
    let q = Gptq {
        group_size: Some(32),
        sym: true,
        zero_minus_one: true,
        skip: vec![],
    };
    let out = tmp.path().join("q");
    write_quantized(&ck, &out, &q, &mut |_, _| {}).unwrap();
    // Rewrites the quantized file with one tensor changed by `edit`.
    let rewrite = |edit: &dyn Fn(&mut sala_checkpoint::RawTensor) -> bool| {
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let mut tensors = Vec::new();
        for (name, t) in header.as_object().unwrap() {
            if name == "__metadata__" {
                continue;
            }
            let off: Vec<usize> = t["data_offsets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let mut raw = sala_checkpoint::RawTensor {
                name: name.clone(),
                dtype: match t["dtype"].as_str().unwrap() {
                    "I32" => "I32",
                    "F16" => "F16",
                    _ => "BF16",
                },
                shape: t["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect(),
                bytes: bytes[8 + n + off[0]..8 + n + off[1]].to_vec(),
            };
            if edit(&mut raw) {
                tensors.push(raw);
            }
        }
        let dir = tmp.path().join("bad");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(out.join("config.json"), dir.join("config.json")).unwrap();
        sala_checkpoint::write_raw_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
        Checkpoint::open(&dir).map(|_| ()).unwrap_err().to_string()
    };
    let name = "model.layers.2.mlp.up_proj";
    let e = rewrite(&|t| t.name != format!("{name}.qzeros"));
    assert!(
        e.contains(&format!("{name}.qzeros")) && e.contains("missing"),
        "{e}"
    );
    let e = rewrite(&|t| {
        if t.name == format!("{name}.qweight") {
            t.dtype = "F16";
            t.bytes.truncate(t.bytes.len() / 2);
        }
        true
    });
    assert!(
        e.contains(&format!("{name}.qweight")) && e.contains("I32"),
        "{e}"
    );
    let e = rewrite(&|t| {
        if t.name == format!("{name}.scales") {
            t.shape = vec![t.shape[0] * 2, t.shape[1] / 2];
        }
        true
    });
    assert!(
        e.contains(&format!("{name}.scales")) && e.contains("shape"),
        "{e}"
    );
    // A bf16 weight where the config says it is quantized.
    let e = rewrite(&|t| {
        if t.name == format!("{name}.qweight") {
            t.name = format!("{name}.weight");
        }
        true
    });
    assert!(
        e.contains(&format!("{name}.qweight")) && e.contains(&format!("{name}.weight")),
        "{e}"
    );
    // desc_act true, or 8 bits, in the config.
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    json["quantization_config"]["desc_act"] = true.into();
    std::fs::write(out.join("config.json"), json.to_string()).unwrap();
    let e = Checkpoint::open(&out).unwrap_err().to_string();
    assert!(e.contains("desc_act"), "{e}");
}
