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

/// The tiny bf16 checkpoint in `dir/bf16` with its config, and a 70-token prompt over its
/// vocabulary.
fn source_and_prompt(dir: &Path) -> (std::path::PathBuf, ModelConfig, Vec<u32>) {
    let src = dir.join("bf16");
    let config = bf16_checkpoint(&src);
    let prompt = (0..70)
        .map(|i| (i * 37 + 5) % config.vocab_size as u32)
        .collect();
    (src, config, prompt)
}

fn logits(dir: &Path, prompt: &[u32]) -> Vec<f32> {
    logits_of(dir, prompt, false)
}

/// The logits of `dir` run with FP8 weights quantized as they load (`--quantize fp8`).
fn logits_fp8_online(dir: &Path, prompt: &[u32]) -> Vec<f32> {
    logits_of(dir, prompt, true)
}

fn logits_of(dir: &Path, prompt: &[u32], fp8: bool) -> Vec<f32> {
    let mut ck = Checkpoint::open(dir).unwrap();
    ck.set_fp8_weights(fp8);
    let tok = sala_tokenizer::Tokenizer::from_dir(dir).unwrap();
    let e = Engine::from_parts(CpuBackend::default(), dir, ck, tok, 64, &mut |_, _| {}).unwrap();
    let mut ws = e.model.workspace(&e.backend, 64).unwrap();
    let mut seq = e.model.new_sequence(&e.backend).unwrap();
    e.model
        .prefill(&e.backend, &mut ws, &mut seq, prompt, &mut |_| {})
        .unwrap()
}

#[test]
fn a_gptq_checkpoint_runs_as_its_dequantized_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, config, prompt) = source_and_prompt(tmp.path());
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
        let dir = tmp.path().join("bad");
        rewrite_as(&out, &dir, &|t| (edit(t), None), &|_| {});
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

/// FP8 checkpoints: `sala quantize --method fp8`'s compressed-tensors layout (a scale per
/// channel, or per matrix) runs exactly as `--quantize fp8` over its source (the same codes
/// and scales), a ModelOpt layout (one scale a matrix, a static input scale, not used) runs as
/// the same codes in compressed-tensors, and broken ones are refused naming the tensor.
#[test]
fn fp8_checkpoints_run_as_online_fp8_and_bad_ones_are_refused() {
    use sala_checkpoint::fp8::{Fp8Checkpoint, Fp8Format};
    use sala_checkpoint::quant::write_fp8;
    let tmp = tempfile::tempdir().unwrap();
    let (src, _, prompt) = source_and_prompt(tmp.path());
    let ck = Checkpoint::open(&src).unwrap();
    let channel = Fp8Checkpoint {
        format: Fp8Format::CompressedTensors,
        per_channel: true,
        skip: vec![],
    };
    let out = tmp.path().join("fp8");
    write_fp8(&ck, &out, &channel, &mut |_, _| {}).unwrap();
    let online = logits_fp8_online(&src, &prompt);
    assert_eq!(
        logits(&out, &prompt),
        online,
        "the checkpoint runs as --quantize fp8"
    );
    let plain = logits(&src, &prompt);
    let err = rel_l2(&online, &plain);
    assert!(err > 0.0 && err < 0.15, "FP8 vs bf16: relative L2 {err}");

    // A layer's MLP kept in bf16 beside FP8 attention: loads, and runs those in bf16.
    let kept = Fp8Checkpoint {
        skip: vec![r"re:model\.layers\.1\.mlp\..*".into()],
        ..channel.clone()
    };
    let partial = tmp.path().join("fp8-partial");
    write_fp8(&ck, &partial, &kept, &mut |_, _| {}).unwrap();
    let opened = Checkpoint::open(&partial).unwrap();
    let kept_up = "model.layers.1.mlp.up_proj.weight";
    assert_eq!(opened.tensor(kept_up).unwrap().dtype, DType::Bf16);
    let e = tensor_logits_close(&partial, &prompt, &online);
    assert!(e > 0.0 && e < 0.15, "partly FP8: relative L2 {e}");
    // Gates kept in bf16 beside FP8 q/k/v would split a stacked product: refused by name.
    let gates = Fp8Checkpoint {
        skip: vec![r"re:.*\.o_gate".into(), r"re:.*\.z_proj".into()],
        ..channel.clone()
    };
    let mixed = tmp.path().join("fp8-mixed");
    write_fp8(&ck, &mixed, &gates, &mut |_, _| {}).unwrap();
    let e = Engine::load(CpuBackend::default(), &mixed, 64, &mut |_, _| {})
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("q_proj") && e.contains("FP8") && e.contains("bf16"),
        "{e}"
    );

    // One scale a matrix.
    let tensor = Fp8Checkpoint {
        per_channel: false,
        ..channel.clone()
    };
    let per_tensor = tmp.path().join("fp8-tensor");
    write_fp8(&ck, &per_tensor, &tensor, &mut |_, _| {}).unwrap();
    let opened = Checkpoint::open(&per_tensor).unwrap();
    let up = "model.layers.0.mlp.up_proj.weight";
    let (codes, scales, _) = opened.fp8_rows(up).unwrap().expect("stored in FP8");
    assert!(scales.iter().all(|&s| s == scales[0]), "one scale a matrix");
    let (values, _) = opened.weight_f32(up).unwrap();
    assert_eq!(
        values[5],
        sala_model::numerics::e4m3_value(codes[5]) * scales[0]
    );
    let e = tensor_logits_close(&per_tensor, &prompt, &online);
    assert!(e < 0.15, "per-matrix FP8 vs per-channel: relative L2 {e}");

    // The same per-matrix codes in ModelOpt's layout (scalar scales, a static input scale).
    let modelopt = tmp.path().join("modelopt");
    rewrite_as(
        &per_tensor,
        &modelopt,
        &|t| {
            if t.name.ends_with(".weight_scale") {
                t.shape = vec![];
            }
            let extra = t
                .name
                .ends_with(".weight_scale")
                .then(|| sala_checkpoint::RawTensor {
                    name: t.name.replace(".weight_scale", ".input_scale"),
                    dtype: "F32",
                    shape: vec![],
                    bytes: 0.5f32.to_le_bytes().to_vec(),
                });
            (true, extra)
        },
        &|qc| {
            *qc = serde_json::json!({"quant_method": "modelopt", "quant_algo": "FP8",
            "exclude_modules": ["lm_head"]});
        },
    );
    assert_eq!(logits(&modelopt, &prompt), logits(&per_tensor, &prompt));

    // Broken: a missing scale, codes stored as bf16, scales of the wrong count, a block-wise
    // FP8 config, 8-bit integers.
    let name = "model.layers.2.mlp.up_proj";
    let bad = tmp.path().join("bad");
    let open_err = |dir: &Path| Checkpoint::open(dir).map(|_| ()).unwrap_err().to_string();
    rewrite_as(
        &out,
        &bad,
        &|t| (t.name != format!("{name}.weight_scale"), None),
        &|_| {},
    );
    let e = open_err(&bad);
    assert!(
        e.contains(&format!("{name}.weight_scale")) && e.contains("missing"),
        "{e}"
    );
    rewrite_as(
        &out,
        &bad,
        &|t| {
            if t.name == format!("{name}.weight") {
                t.dtype = "BF16";
                t.shape = vec![t.shape[0], t.shape[1] / 2];
            }
            (true, None)
        },
        &|_| {},
    );
    let e = open_err(&bad);
    assert!(e.contains(&format!("{name}.weight")), "{e}");
    rewrite_as(
        &out,
        &bad,
        &|t| {
            if t.name == format!("{name}.weight_scale") {
                t.shape = vec![t.shape[0] / 2, 1];
                t.bytes.truncate(t.bytes.len() / 2);
            }
            (true, None)
        },
        &|_| {},
    );
    let e = open_err(&bad);
    assert!(
        e.contains(&format!("{name}.weight_scale")) && e.contains("shape"),
        "{e}"
    );
    for (qc, needle) in [
        (
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
            "block",
        ),
        (
            serde_json::json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
                "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}),
            "8-bit float",
        ),
    ] {
        rewrite_as(&out, &bad, &|_| (true, None), &|q| *q = qc.clone());
        let e = open_err(&bad);
        assert!(
            e.contains("quantization_config") && e.contains(needle),
            "{e}"
        );
    }
}

/// The relative L2 distance between `dir`'s logits and `want`.
fn tensor_logits_close(dir: &Path, prompt: &[u32], want: &[f32]) -> f64 {
    rel_l2(&logits(dir, prompt), want)
}

/// Copies checkpoint `src` to `dst` with each tensor passed through `edit` (kept when it
/// returns true; a second tensor added when it gives one) and `quantization_config` through
/// `config`.
#[allow(clippy::type_complexity)]
fn rewrite_as(
    src: &Path,
    dst: &Path,
    edit: &dyn Fn(&mut sala_checkpoint::RawTensor) -> (bool, Option<sala_checkpoint::RawTensor>),
    config: &dyn Fn(&mut serde_json::Value),
) {
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
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
                "F8_E4M3" => "F8_E4M3",
                "F32" => "F32",
                "F16" => "F16",
                "I32" => "I32",
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
        let (keep, extra) = edit(&mut raw);
        if keep {
            tensors.push(raw);
        }
        tensors.extend(extra);
    }
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    config(&mut json["quantization_config"]);
    std::fs::write(dst.join("config.json"), serde_json::to_vec(&json).unwrap()).unwrap();
    for f in std::fs::read_dir(src).unwrap().flatten() {
        let name = f.file_name();
        let name = name.to_string_lossy();
        if !name.ends_with(".safetensors") && name != "config.json" {
            std::fs::copy(f.path(), dst.join(&*name)).unwrap();
        }
    }
    sala_checkpoint::write_raw_safetensors(&dst.join("model.safetensors"), &tensors).unwrap();
}
