//! Tests of opening and checking checkpoints.

use super::*;
use crate::presets::preset;
use crate::schema::{expected_parameter_count, TensorSpec};
use crate::writer::{write_checkpoint_with, write_random_checkpoint, WriteOptions};
use serde_json::{json, Value};
use std::fs;

fn tiny() -> ModelConfig {
    preset("tiny").unwrap()
}

fn write_tiny(dir: &Path, dtype: DType, max_shard_bytes: usize) {
    let opts = WriteOptions {
        seed: 7,
        dtype,
        max_shard_bytes,
        heavy_tails: false,
    };
    write_random_checkpoint(dir, &tiny(), &opts).unwrap();
}

/// A single-file bf16 tiny checkpoint in a fresh directory.
fn single() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    write_tiny(tmp.path(), DType::Bf16, usize::MAX);
    let file = tmp.path().join(SINGLE_FILE);
    (tmp, file)
}

fn read_st(path: &Path) -> (Value, Vec<u8>) {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

fn write_st(path: &Path, header: &Value, data: &[u8]) {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    fs::write(path, out).unwrap();
}

fn edit_header(path: &Path, edit: impl FnOnce(&mut Value, &mut Vec<u8>)) {
    let (mut header, mut data) = read_st(path);
    edit(&mut header, &mut data);
    write_st(path, &header, &data);
}

fn open_err(dir: &Path) -> CheckpointError {
    Checkpoint::open(dir).unwrap_err()
}

/// Asserts the message names every one of `parts`.
fn assert_names(e: &CheckpointError, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "`{p}` not in: {msg}");
    }
}

const Q0: &str = "model.layers.0.self_attn.q_proj.weight";

#[test]
fn opens_a_written_checkpoint_in_model_order() {
    let (tmp, _) = single();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let names: Vec<&str> = ck.tensors().map(|t| t.name.as_str()).collect();
    let want: Vec<String> = expected_tensors(&tiny())
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, want);
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(*names.last().unwrap(), "lm_head.weight");
    let params = expected_parameter_count(&tiny());
    assert_eq!(ck.parameter_count(), params);
    assert_eq!(ck.total_bytes(), 2 * params);
    let v = ck.tensor(Q0).unwrap();
    assert_eq!((v.dtype, v.shape), (DType::Bf16, &[128usize, 128][..]));
    assert_eq!(v.bytes.len(), 128 * 128 * 2);
    assert_eq!(ck.files(), vec![tmp.path().join(SINGLE_FILE).as_path()]);
}

#[test]
fn expected_tensors_follow_the_config_flags() {
    let c = tiny();
    let specs = expected_tensors(&c);
    let shape = |n: &str| specs.iter().find(|t| t.name == n).map(|t| t.shape.clone());
    // Layer 0 sparse (kv 2 heads x 32), layer 1 lightning (kv 4 heads x 32).
    assert_eq!(
        shape("model.layers.0.self_attn.k_proj.weight"),
        Some(vec![64, 128])
    );
    assert_eq!(
        shape("model.layers.1.self_attn.k_proj.weight"),
        Some(vec![128, 128])
    );
    assert_eq!(
        shape("model.layers.0.self_attn.o_gate.weight"),
        Some(vec![128, 128])
    );
    assert_eq!(shape("model.layers.0.self_attn.z_proj.weight"), None);
    assert_eq!(
        shape("model.layers.1.self_attn.q_norm.weight"),
        Some(vec![32])
    );
    assert_eq!(
        shape("model.layers.1.self_attn.o_norm.weight"),
        Some(vec![128])
    );
    assert_eq!(
        shape("model.layers.3.mlp.down_proj.weight"),
        Some(vec![128, 256])
    );
    // 3 globals + 5 per layer + 4 (sparse) or 8 (lightning) attention tensors.
    assert_eq!(specs.len(), 3 + 4 * 5 + 2 * 5 + 2 * 8);

    let mut v = c.to_json();
    for flag in [
        "tie_word_embeddings",
        "attn_use_output_gate",
        "use_output_gate",
        "qk_norm",
        "use_output_norm",
    ] {
        let on = flag == "tie_word_embeddings";
        v[flag] = on.into();
    }
    let bare = ModelConfig::from_json(v).unwrap();
    let names: Vec<String> = expected_tensors(&bare)
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names.len(), 2 + 4 * 9);
    for gone in ["lm_head", "o_gate", "z_proj", "q_norm", "k_norm", "o_norm"] {
        assert!(!names.iter().any(|n| n.contains(gone)), "{gone}");
    }
}

#[test]
fn dtypes_load_to_the_same_values() {
    // k/64 with |k| <= 30 is exact in bf16, f16 and f32.
    let exact = |spec: &TensorSpec, out: &mut [f32]| {
        let salt = spec.name.len();
        for (i, v) in out.iter_mut().enumerate() {
            *v = (((i + salt) % 61) as f32 - 30.0) / 64.0;
        }
    };
    let mut loaded = Vec::new();
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        let tmp = tempfile::tempdir().unwrap();
        write_checkpoint_with(tmp.path(), &tiny(), dtype, usize::MAX, exact).unwrap();
        let ck = Checkpoint::open(tmp.path()).unwrap();
        assert_eq!(ck.total_bytes(), ck.parameter_count() * dtype.size() as u64);
        let all: Vec<Vec<f32>> = ck
            .tensors()
            .map(|t| ck.read_f32(&t.name).unwrap())
            .collect();
        let bits: Vec<Vec<u16>> = ck
            .tensors()
            .map(|t| ck.read_bf16_bits(&t.name).unwrap())
            .collect();
        assert!(ck
            .tensors()
            .all(|t| t.dtype == crate::Element::Float(dtype)));
        loaded.push((all, bits));
    }
    assert_eq!(loaded[0], loaded[1]);
    assert_eq!(loaded[0], loaded[2]);
    assert_eq!(
        loaded[0].0[0][..3],
        [-30.0 / 64.0 + 25.0 / 64.0, -4.0 / 64.0, -3.0 / 64.0]
    );
}

#[test]
fn random_weights_agree_across_dtypes_up_to_rounding() {
    let mut cks = Vec::new();
    let mut dirs = Vec::new();
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        let tmp = tempfile::tempdir().unwrap();
        write_tiny(tmp.path(), dtype, usize::MAX);
        cks.push(Checkpoint::open(tmp.path()).unwrap());
        dirs.push(tmp);
    }
    for t in cks[0].tensors() {
        let f32s = cks[0].read_f32(&t.name).unwrap();
        let bf = cks[1].read_f32(&t.name).unwrap();
        let hf = cks[2].read_f32(&t.name).unwrap();
        let bits = cks[0].read_bf16_bits(&t.name).unwrap();
        for i in 0..f32s.len() {
            assert_eq!(bf[i], half::bf16::from_f32(f32s[i]).to_f32(), "{}", t.name);
            assert_eq!(hf[i], half::f16::from_f32(f32s[i]).to_f32(), "{}", t.name);
            assert_eq!(bf16_bits_to_f32(bits[i]), bf[i]);
        }
    }
}

#[test]
fn bf16_rounding_is_to_nearest_even() {
    let one = 1.0f32;
    let ulp = 2f32.powi(-7); // bf16 spacing at 1.0
    let values = [
        one + ulp / 2.0,                     // tie, 1.0 is even -> 1.0
        one + 3.0 * ulp / 2.0,               // tie, 1+2ulp is even -> up
        -(one + ulp / 2.0 + 2f32.powi(-20)), // past the tie -> away from zero
        one + ulp / 2.0 - 2f32.powi(-20),    // below the tie -> down
        f32::INFINITY,
        f32::NAN,
    ];
    let want = [0x3f80u16, 0x3f82, 0xbf81, 0x3f80, 0x7f80];
    let tmp = tempfile::tempdir().unwrap();
    let n = tiny().hidden_size;
    write_checkpoint_with(tmp.path(), &tiny(), DType::F32, usize::MAX, |s, out| {
        if s.name == "model.norm.weight" {
            out[..values.len()].copy_from_slice(&values);
            out[values.len()..].fill(1.0);
        } else {
            out.fill(0.5);
        }
    })
    .unwrap();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let bits = ck.read_bf16_bits("model.norm.weight").unwrap();
    assert_eq!(bits.len(), n);
    assert_eq!(bits[..5], want);
    assert!(bf16_bits_to_f32(bits[5]).is_nan());
    assert_eq!(f32_to_bf16_bits(0.5), 0x3f00);
    // NaN and Inf are allowed on open and found by check_finite.
    let e = ck.check_finite("model.norm.weight").unwrap_err();
    assert_names(
        &e,
        &["model.norm.weight", SINGLE_FILE, "2 non-finite", "index 4"],
    );
    ck.check_finite(Q0).unwrap();
    assert_names(
        &ck.check_finite("model.nope").unwrap_err(),
        &["model.nope", &tmp.path().display().to_string()],
    );
}

#[test]
fn files_are_readable_by_the_safetensors_crate() {
    let (tmp, file) = single();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let bytes = fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), ck.tensors().len());
    for t in ck.tensors() {
        let theirs = st.tensor(&t.name).unwrap();
        assert_eq!(theirs.shape(), t.shape.as_slice());
        assert_eq!(theirs.dtype(), safetensors::Dtype::BF16);
        assert_eq!(theirs.data(), ck.tensor(&t.name).unwrap().bytes);
    }
}

#[test]
fn missing_directory_config_and_weights_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let gone = tmp.path().join("nowhere");
    assert_names(&open_err(&gone), &["nowhere", "checkpoint directory"]);

    let (tmp, file) = single();
    fs::remove_file(tmp.path().join("config.json")).unwrap();
    let e = open_err(tmp.path());
    assert!(matches!(e, CheckpointError::Io { .. }), "{e}");
    assert_names(&e, &["config.json"]);

    fs::write(tmp.path().join("config.json"), "{\"hidden_size\": 12").unwrap();
    assert_names(&open_err(tmp.path()), &["config.json", "not valid JSON"]);
    fs::write(tmp.path().join("config.json"), "{\"hidden_size\": 128}").unwrap();
    assert_names(&open_err(tmp.path()), &["config.json", "num_hidden_layers"]);

    write_tiny(tmp.path(), DType::Bf16, usize::MAX);
    fs::remove_file(&file).unwrap();
    let e = open_err(tmp.path());
    assert!(matches!(e, CheckpointError::NoWeights { .. }), "{e}");
    assert_names(&e, &[SINGLE_FILE, INDEX_FILE]);
}

#[test]
fn truncated_data_names_a_tensor_past_the_end() {
    let (tmp, file) = single();
    let (header, data) = read_st(&file);
    let full = fs::metadata(&file).unwrap().len();
    let cut = data.len() / 2;
    let f = fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(full - (data.len() - cut) as u64).unwrap();
    drop(f);
    match open_err(tmp.path()) {
        CheckpointError::Tensor {
            file: f,
            tensor,
            msg,
        } => {
            assert_eq!(f, file);
            let end = header[&tensor]["data_offsets"][1].as_u64().unwrap() as usize;
            assert!(
                end > cut,
                "{tensor} ends at {end}, inside the kept {cut} bytes"
            );
            assert!(msg.contains("past the end"), "{msg}");
        }
        e => panic!("wrong error: {e}"),
    }
}

#[test]
fn truncated_or_oversized_header_is_a_file_error() {
    let (tmp, file) = single();
    let bytes = fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;

    fs::write(&file, &bytes[..8 + n / 2]).unwrap();
    let e = open_err(tmp.path());
    assert!(matches!(e, CheckpointError::File { .. }), "{e}");
    assert_names(
        &e,
        &[&file.display().to_string(), "header length", "runs past"],
    );

    for bad_len in [u64::MAX, bytes.len() as u64, (bytes.len() - 7) as u64] {
        let mut b = bytes.clone();
        b[..8].copy_from_slice(&bad_len.to_le_bytes());
        fs::write(&file, &b).unwrap();
        assert_names(&open_err(tmp.path()), &[SINGLE_FILE, "runs past"]);
    }

    fs::write(&file, [1u8, 0, 0]).unwrap();
    assert_names(&open_err(tmp.path()), &[SINGLE_FILE, "too short"]);
}

#[test]
fn garbage_header_is_a_file_error() {
    let (tmp, file) = single();
    let clean = fs::read(&file).unwrap();
    let mut bytes = clean.clone();
    bytes[8..20].copy_from_slice(b"{not json!!!");
    fs::write(&file, &bytes).unwrap();
    assert_names(&open_err(tmp.path()), &[SINGLE_FILE, "not valid JSON"]);

    fs::write(&file, &clean).unwrap();
    edit_header(&file, |h, _| *h = json!([1, 2, 3]));
    assert_names(&open_err(tmp.path()), &[SINGLE_FILE, "not a JSON object"]);
}

#[test]
fn bad_entries_name_the_tensor() {
    let (tmp, file) = single();
    let (h0, d0) = read_st(&file);
    let data_len = d0.len() as u64;
    let len = |h: &Value| {
        let o = &h[Q0]["data_offsets"];
        o[1].as_u64().unwrap() - o[0].as_u64().unwrap()
    };
    let q_len = len(&h0);
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|h| h[Q0]["dtype"] = "I8".into()),
            "dtype I8 is not supported",
        ),
        (Box::new(|h| h[Q0]["dtype"] = "F64".into()), "dtype F64"),
        (Box::new(|h| h[Q0]["dtype"] = json!(3)), "dtype"),
        (Box::new(|h| h[Q0]["dtype"] = "F32".into()), "needs 65536"),
        (
            Box::new(move |h| h[Q0]["data_offsets"] = json!([data_len, data_len + q_len])),
            "past the end",
        ),
        (
            Box::new(move |h| h[Q0]["data_offsets"] = json!([data_len - 2, data_len + q_len])),
            "past the end",
        ),
        (
            Box::new(|h| h[Q0]["data_offsets"] = json!([10, 2])),
            "end before",
        ),
        (
            Box::new(|h| h[Q0]["data_offsets"] = json!([0])),
            "data_offsets",
        ),
        (Box::new(|h| h[Q0]["shape"] = json!([128, -1])), "shape"),
        (
            Box::new(|h| h[Q0]["shape"] = json!([u64::MAX, u64::MAX])),
            "overflows",
        ),
        (Box::new(|h| h[Q0] = json!("x")), "not an object"),
    ];
    for (edit, expect) in cases {
        let mut h = h0.clone();
        edit(&mut h);
        write_st(&file, &h, &d0);
        let e = open_err(tmp.path());
        assert!(matches!(e, CheckpointError::Tensor { .. }), "{e}");
        assert_names(&e, &[SINGLE_FILE, Q0, expect]);
    }
}

#[test]
fn overlapping_tensors_are_rejected() {
    let (tmp, file) = single();
    edit_header(&file, |h, _| {
        let k = "model.layers.0.self_attn.o_gate.weight";
        h[k]["data_offsets"] = h[Q0]["data_offsets"].clone();
    });
    assert_names(
        &open_err(tmp.path()),
        &[SINGLE_FILE, "overlap", Q0, "o_gate"],
    );
}

#[test]
fn wrong_shape_missing_and_extra_tensors_are_listed_together() {
    let (tmp, file) = single();
    edit_header(&file, |h, data| {
        // Same bytes, transposed shape.
        h["model.layers.0.mlp.down_proj.weight"]["shape"] = json!([256, 128]);
        let o = h.as_object_mut().unwrap();
        o.remove("model.layers.2.self_attn.z_proj.weight");
        o.remove("lm_head.weight");
        // An extra tensor, and an ignorable rotary buffer.
        let n = data.len();
        data.extend_from_slice(&[0u8; 64 + 32]);
        o.insert(
            "model.layers.0.self_attn.q_norm.weight".into(),
            json!({"dtype": "BF16", "shape": [32], "data_offsets": [n, n + 64]}),
        );
        o.insert(
            "model.layers.1.self_attn.rotary_emb.inv_freq".into(),
            json!({"dtype": "F32", "shape": [8], "data_offsets": [n + 64, n + 96]}),
        );
    });
    let e = open_err(tmp.path());
    let CheckpointError::Mismatch { problems, .. } = &e else {
        panic!("wrong error: {e}");
    };
    assert_eq!(problems.len(), 4, "{e}");
    assert_names(
        &e,
        &[
            "4 problem(s)",
            "`model.layers.0.mlp.down_proj.weight` has shape [256, 128], expected [128, 256]",
            "`model.layers.2.self_attn.z_proj.weight` (expected shape [128, 128]) is missing",
            "`lm_head.weight`",
            "unexpected tensor `model.layers.0.self_attn.q_norm.weight`",
            SINGLE_FILE,
        ],
    );
    assert!(!e.to_string().contains("inv_freq"), "{e}");
}

#[test]
fn an_ignored_rotary_buffer_alone_is_fine() {
    let (tmp, file) = single();
    edit_header(&file, |h, data| {
        let n = data.len();
        data.extend_from_slice(&[0u8; 32]);
        h["model.layers.1.self_attn.rotary_emb.inv_freq"] =
            json!({"dtype": "F32", "shape": [8], "data_offsets": [n, n + 32]});
    });
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert!(!ck.contains("model.layers.1.self_attn.rotary_emb.inv_freq"));
}

#[test]
fn many_problems_are_cut_short() {
    let (tmp, file) = single();
    edit_header(&file, |h, _| {
        let o = h.as_object_mut().unwrap();
        o.retain(|k, _| k == "__metadata__" || k.contains("embed"));
    });
    let e = open_err(tmp.path()).to_string();
    let total = expected_tensors(&tiny()).len() - 1;
    assert!(e.contains(&format!("{total} problem(s)")), "{e}");
    assert!(
        e.contains(&format!("and {} more", total - MAX_LISTED_PROBLEMS)),
        "{e}"
    );
}

fn sharded() -> (tempfile::TempDir, Vec<PathBuf>) {
    let tmp = tempfile::tempdir().unwrap();
    write_tiny(tmp.path(), DType::Bf16, 200_000);
    let index: Value =
        serde_json::from_slice(&fs::read(tmp.path().join(INDEX_FILE)).unwrap()).unwrap();
    let mut shards: Vec<String> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    shards.sort();
    shards.dedup();
    let paths = shards.iter().map(|s| tmp.path().join(s)).collect();
    (tmp, paths)
}

fn edit_index(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join(INDEX_FILE);
    let mut index: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    edit(&mut index);
    fs::write(&path, serde_json::to_vec(&index).unwrap()).unwrap();
}

#[test]
fn sharded_checkpoint_opens() {
    let (tmp, shards) = sharded();
    assert!(shards.len() >= 3, "{shards:?}");
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert_eq!(
        ck.files(),
        shards.iter().map(|p| p.as_path()).collect::<Vec<_>>()
    );
    assert_eq!(ck.parameter_count(), expected_parameter_count(&tiny()));
    let ln = ck.info("lm_head.weight").unwrap();
    assert_eq!(ln.file, *shards.last().unwrap());
}

#[test]
fn index_naming_a_missing_shard() {
    let (tmp, shards) = sharded();
    fs::remove_file(&shards[1]).unwrap();
    let name = shards[1].file_name().unwrap().to_str().unwrap();
    let e = open_err(tmp.path());
    assert_names(&e, &[INDEX_FILE, name, "does not exist", "model.layers."]);
}

#[test]
fn index_and_shards_disagreeing() {
    let (tmp, shards) = sharded();
    let index: Value =
        serde_json::from_slice(&fs::read(tmp.path().join(INDEX_FILE)).unwrap()).unwrap();
    let norm = "model.norm.weight";
    let home = index["weight_map"][norm].as_str().unwrap().to_string();
    let other = shards[0].file_name().unwrap().to_str().unwrap().to_string();
    assert_ne!(home, other);
    let last = home.clone();

    // Mapped to the wrong shard: both files named.
    edit_index(tmp.path(), |i| i["weight_map"][norm] = other.clone().into());
    assert_names(
        &open_err(tmp.path()),
        &[norm, &home, &other, INDEX_FILE, "maps it to"],
    );
    edit_index(tmp.path(), |i| i["weight_map"][norm] = home.clone().into());
    Checkpoint::open(tmp.path()).unwrap();

    // Listed but absent from its shard.
    edit_index(tmp.path(), |i| {
        i["weight_map"]["model.extra.weight"] = last.clone().into()
    });
    assert_names(
        &open_err(tmp.path()),
        &["model.extra.weight", &last, INDEX_FILE, "does not hold it"],
    );

    // In a shard but not in the index.
    edit_index(tmp.path(), |i| {
        let m = i["weight_map"].as_object_mut().unwrap();
        m.remove("model.extra.weight");
        m.remove(norm);
    });
    assert_names(
        &open_err(tmp.path()),
        &[norm, &last, "not listed in", INDEX_FILE],
    );

    edit_index(tmp.path(), |i| {
        i["weight_map"]["lm_head.weight"] = "../x.safetensors".into()
    });
    assert_names(
        &open_err(tmp.path()),
        &[INDEX_FILE, "lm_head.weight", "../x"],
    );
    edit_index(tmp.path(), |i| *i = json!({"metadata": {}}));
    assert_names(&open_err(tmp.path()), &[INDEX_FILE, "weight_map"]);
    fs::write(tmp.path().join(INDEX_FILE), "{oops").unwrap();
    assert_names(&open_err(tmp.path()), &[INDEX_FILE, "not valid JSON"]);
}

#[test]
fn corrupt_shard_is_named() {
    let (tmp, shards) = sharded();
    let f = fs::OpenOptions::new().write(true).open(&shards[1]).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 10).unwrap();
    drop(f);
    let e = open_err(tmp.path());
    assert!(matches!(e, CheckpointError::Tensor { .. }), "{e}");
    assert_names(&e, &[shards[1].to_str().unwrap(), "past the end"]);
}

#[test]
fn unknown_tensor_lookup_is_an_error() {
    let (tmp, _) = single();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    let e = ck
        .read_f32("model.layers.9.mlp.up_proj.weight")
        .unwrap_err();
    assert_names(&e, &["model.layers.9.mlp.up_proj.weight", "has no tensor"]);
    assert!(ck.tensor("lm_head.weight").is_ok());
}
