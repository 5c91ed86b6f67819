//! The `sala` binary end to end: init, inspect, generate, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn sala(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run sala")
}

/// Runs `sala` with `input` on its standard input.
fn sala_with_stdin(args: &[&str], input: &[u8], cache: &Path) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run sala");
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(input)
        .expect("write stdin");
    child.wait_with_output().expect("wait for sala")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "failed: {}\n{}", o.status, stderr(o));
}

/// Fails with exit code 1 and a message containing every `needle`.
fn fails_with(o: &Output, needles: &[&str]) {
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
    let e = stderr(o);
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "expected {n:?} in: {e}");
    }
}

fn tiny_checkpoint(tmp: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let dir = tmp.join(name);
    let mut args = vec!["init", "--preset", "tiny", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    ok(&sala(&args, tmp));
    dir
}

#[test]
fn generate_works_with_no_model_given() {
    let tmp = tempfile::tempdir().unwrap();
    let o = sala(
        &["generate", "Hello", "--max-tokens", "8", "--ignore-eos"],
        tmp.path(),
    );
    ok(&o);
    let e = stderr(&o);
    assert!(
        e.contains("random"),
        "must say the built-in model is random: {e}"
    );
    assert!(
        e.contains("generated 8 tokens") && e.contains("tok/s"),
        "{e}"
    );
}

#[test]
fn init_inspect_generate_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "tiny", &["--seed", "3", "--shard-mib", "1"]);
    assert!(
        dir.join("model.safetensors.index.json").exists(),
        "sharded with an index"
    );
    assert!(dir.join("tokenizer.json").exists() && dir.join("tokenizer_config.json").exists());

    let o = sala(&["inspect", dir.to_str().unwrap()], tmp.path());
    ok(&o);
    let out = stdout(&o);
    for needle in [
        "SLLS",
        "parameters",
        "8K",
        "128K",
        "1M",
        "chat template: yes",
    ] {
        assert!(out.contains(needle), "inspect lacks {needle:?}: {out}");
    }

    // Greedy generation is deterministic; seeded sampling too.
    let d = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            d,
            "The cat",
            "--max-tokens",
            "12",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        let o = sala(&args, tmp.path());
        ok(&o);
        stdout(&o)
    };
    assert_eq!(run(&[]), run(&[]));
    let s1 = run(&["--temperature", "1", "--seed", "5"]);
    assert_eq!(s1, run(&["--temperature", "1", "--seed", "5"]));
    assert_ne!(s1, run(&["--temperature", "1", "--seed", "6"]));

    // Chat mode through the checkpoint's template, prompt from standard input.
    let o = sala_with_stdin(
        &[
            "generate",
            "--model",
            d,
            "--chat",
            "--no-think",
            "--max-tokens",
            "4",
        ],
        b"What is 2+2?",
        tmp.path(),
    );
    ok(&o);
}

#[test]
fn bad_inputs_get_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let missing = tmp.path().join("nowhere");
    fails_with(
        &sala(&["inspect", missing.to_str().unwrap()], cache),
        &["nowhere"],
    );
    fails_with(
        &sala(
            &["generate", "--model", missing.to_str().unwrap(), "hi"],
            cache,
        ),
        &["nowhere"],
    );

    let dir = tiny_checkpoint(cache, "good", &[]);
    let d = dir.to_str().unwrap();
    fails_with(
        &sala(
            &[
                "generate",
                "--model",
                d,
                "one two three four five six",
                "--max-context",
                "4",
            ],
            cache,
        ),
        &["context budget of 4"],
    );
    fails_with(
        &sala(&["generate", "--model", d, "hi", "--top-p", "2"], cache),
        &["top_p"],
    );
    fails_with(
        &sala(&["generate", "--model", d, "hi", "--device", "tpu"], cache),
        &["--device tpu"],
    );
    fails_with(&sala(&["init", d], cache), &["already holds a checkpoint"]);
    // Device profiles: an unknown card lists the known ones; a profile emulates a GPU, so the
    // CPU cannot take one; a bad CUDA switch names the variable.
    fails_with(
        &sala(
            &[
                "generate",
                "--model",
                d,
                "hi",
                "--device-profile",
                "rtx9090",
            ],
            cache,
        ),
        &["rtx9090", "rtx5090", "a100"],
    );
    fails_with(
        &sala(
            &[
                "generate",
                "--model",
                d,
                "hi",
                "--device",
                "cpu",
                "--device-profile",
                "rtx5090",
            ],
            cache,
        ),
        &["--device-profile rtx5090", "--device cuda"],
    );
    let bad_switch = Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(["generate", "--model", d, "hi", "--device", "cpu"])
        .env("XDG_CACHE_HOME", cache)
        .env("SALA_FALLBACK", "lightning,wgma")
        .output()
        .expect("run sala");
    fails_with(&bad_switch, &["SALA_FALLBACK", "wgma", "wgmma"]);
    fails_with(
        &sala(&["inspect"], cache),
        &["checkpoint directory", "--device cuda"],
    );
    fails_with(&sala(&["inspect", "--device", "cpu"], cache), &["cuda"]);
    fails_with(
        &sala(
            &[
                "init",
                "--preset",
                "huge",
                tmp.path().join("x").to_str().unwrap(),
            ],
            cache,
        ),
        &["huge", "tiny"],
    );

    // An unknown mixer type in config.json names the field.
    let bad = tiny_checkpoint(cache, "badmixer", &[]);
    let cfg_path = bad.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .replacen("lightning-attn", "mamba2", 1);
    std::fs::write(&cfg_path, cfg).unwrap();
    fails_with(
        &sala(&["inspect", bad.to_str().unwrap()], cache),
        &["mixer_types[1]", "mamba2"],
    );

    // A truncated shard names the file.
    let cut = tiny_checkpoint(cache, "truncated", &[]);
    let st = cut.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(
        &sala(&["generate", "--model", cut.to_str().unwrap(), "hi"], cache),
        &["model.safetensors"],
    );

    // A missing tokenizer names the file.
    let notok = tiny_checkpoint(cache, "notok", &[]);
    std::fs::remove_file(notok.join("tokenizer.json")).unwrap();
    fails_with(
        &sala(
            &["generate", "--model", notok.to_str().unwrap(), "hi"],
            cache,
        ),
        &["tokenizer.json"],
    );
}

#[test]
fn chat_keeps_going_after_a_turn_that_does_not_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "tiny", &[]);
    let long = "word ".repeat(200);
    let input = format!("Hello there\n{long}\n/reset\nAnother question\n");
    let args = [
        "chat",
        "-m",
        dir.to_str().unwrap(),
        "--max-tokens",
        "6",
        "--max-context",
        "96",
        "--ignore-eos",
    ];
    let o = sala_with_stdin(&args, input.as_bytes(), tmp.path());
    ok(&o);
    let e = stderr(&o);
    assert!(e.contains("context budget of 96"), "{e}");
    assert!(e.contains("conversation cleared"), "{e}");
    // Two answered turns, each ended by a newline (a reply may hold newlines itself).
    assert!(stdout(&o).lines().count() >= 2, "{}", stdout(&o));
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn positive(v: &serde_json::Value, field: &str, what: &str) -> f64 {
    let x = v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: no number {field}: {v}"));
    assert!(x > 0.0 && x.is_finite(), "{what}: {field} = {x}");
    x
}

/// Checks a measured row of `sala bench --json` and its memory plan; returns its TTFT.
fn check_bench_row(r: &serde_json::Value, context: u64, decode: u64, what: &str) -> f64 {
    assert_eq!(r["context"], context, "{what}: {r}");
    for f in [
        "prefill_tok_s",
        "prefill_floor_tok_s",
        "decode_tok_s",
        "decode_floor_tok_s",
        "peak_memory_bytes",
    ] {
        positive(r, f, what);
    }
    let p = &r["plan"];
    assert_eq!(p["context"], context + decode, "{what}: {p}");
    let terms: u64 = ["weights", "workspace", "scratch", "runtime"]
        .iter()
        .map(|k| p[k].as_u64().unwrap())
        .chain(
            ["kv", "compressed", "lightning_state"]
                .iter()
                .map(|k| p["cache"][k].as_u64().unwrap()),
        )
        .sum();
    assert_eq!(r["plan_total_bytes"], terms, "{what}: {r}");
    for k in ["weights", "workspace"] {
        positive(p, k, what);
    }
    positive(&p["cache"], "kv", what);
    positive(r, "ttft_s", what)
}

fn bench(args: &[&str], json: &Path, cache: &Path) -> Output {
    let mut all = vec![
        "bench",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--decode-tokens",
        "4",
        "--json",
        json.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    sala(&all, cache)
}

/// --random-context: caches of random values instead of a prefill, then decode; no TTFT.
#[test]
fn bench_decodes_over_a_random_context() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(&["--context", "700", "--random-context"], &json, tmp.path());
    ok(&o);
    assert!(stdout(&o).contains("random"), "{}", stdout(&o));
    let v = read_json(&json);
    let r = &v["results"][0];
    assert_eq!(r["context"], 700, "{r}");
    assert!(r["ttft_s"].is_null() && r["prefill_tok_s"].is_null(), "{r}");
    positive(r, "decode_tok_s", "random context");
    assert_eq!(r["plan"]["context"], 704, "{r}");
    let o = bench(
        &["--context", "700", "--random-context", "--compare-dense"],
        &json,
        tmp.path(),
    );
    fails_with(&o, &["--random-context", "decode only"]);
}

#[test]
fn bench_on_the_cpu_compares_with_the_all_dense_variant() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(
        &["--context", "256,600", "--compare-dense"],
        &json,
        tmp.path(),
    );
    ok(&o);
    let out = stdout(&o);
    for needle in [
        "peak GiB",
        "plan GiB",
        "memory plan",
        "dense/SALA",
        "all-dense",
    ] {
        assert!(out.contains(needle), "{needle:?} not in {out}");
    }
    let v = read_json(&json);
    let sala_params = v["parameters"].as_u64().unwrap();
    let dense_params = v["dense"]["parameters"].as_u64().unwrap();
    assert!(sala_params > 0 && dense_params > 0);
    assert_ne!(sala_params, dense_params, "lightning vs sparse projections");
    let e = stderr(&o);
    assert!(
        e.contains("951.8 K parameters") && e.contains("all-dense variant: "),
        "{e}"
    );

    let rows = v["results"].as_array().unwrap();
    let dense = v["dense"]["results"].as_array().unwrap();
    assert_eq!((rows.len(), dense.len()), (2, 2), "{v}");
    for (i, context) in [256u64, 600].into_iter().enumerate() {
        let ttft = check_bench_row(&rows[i], context, 4, "SALA");
        assert_eq!(dense[i]["fits"], true);
        let dense_ttft = check_bench_row(&dense[i], context, 4, "dense");
        assert_eq!(rows[i]["dense_ttft_s"].as_f64(), Some(dense_ttft));
        let ratio = positive(&rows[i], "ttft_ratio_dense_over_sala", "SALA");
        assert!((ratio - dense_ttft / ttft).abs() < 1e-9 * ratio);
        // The variant's plan: different weights, twice the sparse layers' K/V.
        let (p, d) = (&rows[i]["plan"], &dense[i]["plan"]);
        assert_ne!(p["weights"], d["weights"]);
        assert_eq!(
            2 * p["cache"]["kv"].as_u64().unwrap(),
            d["cache"]["kv"].as_u64().unwrap()
        );
        assert_eq!(d["cache"]["lightning_state"], 0);
    }

    // A limit that holds SALA at 600 tokens and dense at 256 but not dense at 600: the dense
    // 600 is reported from its plan, not run.
    let plan = |r: &serde_json::Value| r["plan_total_bytes"].as_u64().unwrap();
    let limit = plan(&rows[1]);
    assert!(plan(&dense[1]) > limit && plan(&dense[0]) <= limit, "{v}");
    let limit = limit.to_string();
    let o = bench(
        &[
            "--context",
            "256,600",
            "--compare-dense",
            "--max-memory",
            &limit,
        ],
        &json,
        tmp.path(),
    );
    ok(&o);
    assert!(stdout(&o).contains("does not fit"), "{}", stdout(&o));
    let v = read_json(&json);
    let (rows, dense) = (&v["results"], &v["dense"]["results"]);
    assert_eq!(dense[0]["fits"], true);
    assert_eq!(dense[1]["fits"], false);
    assert!(dense[1]["plan_total_bytes"].as_u64().unwrap() > limit.parse().unwrap());
    assert!(dense[1].get("ttft_s").is_none(), "{v}");
    positive(&rows[0], "ttft_ratio_dense_over_sala", "SALA");
    assert!(rows[1]["ttft_ratio_dense_over_sala"].is_null(), "{v}");
    check_bench_row(&rows[1], 600, 4, "SALA under the limit");
}

#[test]
fn bench_stops_a_dense_prefill_at_its_time_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    // A limit every chunk overruns: the dense prefill stops after its first 64-token chunk.
    let o = bench(
        &[
            "--context",
            "600",
            "--prefill-chunk",
            "64",
            "--compare-dense",
            "--dense-time-limit",
            "0.000001",
        ],
        &json,
        tmp.path(),
    );
    ok(&o);
    assert!(stdout(&o).contains(">="), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("stopped after 64 tokens"),
        "{}",
        stderr(&o)
    );
    let v = read_json(&json);
    let (sala_row, dense) = (&v["results"][0], &v["dense"]["results"][0]);
    // SALA itself is not limited.
    check_bench_row(sala_row, 600, 4, "SALA");
    assert_eq!(sala_row["ttft_is_lower_bound"], false);
    assert_eq!(sala_row["prefilled_tokens"], 600);
    assert_eq!(dense["ttft_is_lower_bound"], true, "{dense}");
    assert_eq!(dense["prefilled_tokens"], 64, "{dense}");
    assert!(dense["decode_tok_s"].is_null(), "{dense}");
    positive(dense, "ttft_s", "dense");
    assert_eq!(sala_row["dense_ttft_is_lower_bound"], true);
    for bad in ["0", "nan"] {
        fails_with(
            &bench(
                &["--compare-dense", "--dense-time-limit", bad],
                &json,
                tmp.path(),
            ),
            &["--dense-time-limit"],
        );
    }
}

#[test]
fn bench_refuses_a_plan_over_the_memory_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(
        &["--context", "256", "--max-memory", "1M"],
        &json,
        tmp.path(),
    );
    fails_with(
        &o,
        &[
            "260 tokens need",
            "GiB are allowed",
            "--max-memory 1M",
            "weights",
        ],
    );
    assert!(!json.exists(), "no work, no results");
    fails_with(
        &bench(&["--max-memory", "30X"], &json, tmp.path()),
        &["--max-memory", "30X"],
    );
    fails_with(
        &bench(&["--all-dense", "--compare-dense"], &json, tmp.path()),
        &["--all-dense"],
    );
    // --all-dense alone runs the variant.
    let o = bench(&["--context", "200", "--all-dense"], &json, tmp.path());
    ok(&o);
    let v = read_json(&json);
    check_bench_row(&v["results"][0], 200, 4, "all-dense");
    assert_eq!(v["results"][0]["plan"]["cache"]["lightning_state"], 0);
}

#[test]
fn generate_chat_and_serve_honour_max_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let dir = tiny_checkpoint(cache, "tiny", &[]);
    let d = dir.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--device",
            "cpu",
            "--model",
            d,
            "The cat sat",
            "--max-tokens",
            "8",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        sala(&args, cache)
    };
    let o = gen(&["--max-memory", "1M"]);
    fails_with(
        &o,
        &[
            "tokens need",
            "GiB are allowed",
            "--max-memory 1M",
            "weights",
        ],
    );
    assert!(stdout(&o).is_empty(), "no work: {}", stdout(&o));
    ok(&gen(&["--max-memory", "30G"]));
    ok(&gen(&["--max-memory", "30GiB"]));
    fails_with(&gen(&["--max-memory", "lots"]), &["--max-memory", "lots"]);
    fails_with(&gen(&["--max-memory", "0"]), &["--max-memory"]);

    // Chat: a turn over the limit is refused and the session goes on.
    let config = sala_checkpoint::preset("tiny").unwrap();
    let cpu = sala_model::Backend::memory_facts(&sala_cpu::CpuBackend, &config, 256);
    let limit = sala_model::memory::MemoryPlan::new(&config, 120, 256, &cpu).total();
    let limit = limit.to_string();
    let long = "word ".repeat(200);
    let input = format!("Hello there\n{long}\nAnother question\n");
    let args = [
        "chat",
        "--device",
        "cpu",
        "-m",
        d,
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--max-memory",
        &limit,
    ];
    let o = sala_with_stdin(&args, input.as_bytes(), cache);
    ok(&o);
    let e = stderr(&o);
    assert!(
        e.contains("GiB are allowed") && e.contains("--max-memory"),
        "{e}"
    );
    assert_eq!(e.matches("error:").count(), 1, "{e}");
    assert!(stdout(&o).lines().count() >= 2, "{}", stdout(&o));
    fails_with(
        &sala(
            &["chat", "--device", "cpu", "-m", d, "--max-memory", "1K"],
            cache,
        ),
        &["GiB are allowed", "--max-memory 1K"],
    );

    // Serve: a limit no request fits stops it before it listens.
    fails_with(
        &sala(
            &[
                "serve",
                "--device",
                "cpu",
                "-m",
                d,
                "--port",
                "0",
                "--max-memory",
                "1M",
            ],
            cache,
        ),
        &["no request can fit", "--max-memory 1M"],
    );
    fails_with(
        &sala(&["serve", "--device", "cpu", "--max-memory", "9Q"], cache),
        &["--max-memory", "9Q"],
    );
}

#[test]
fn bench_times_the_lightning_op_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    // 200 tokens in chunks of 64: three whole chunks and a partial one.
    let args = [
        "--kernel",
        "lightning",
        "--context",
        "200,64",
        "--prefill-chunk",
        "64",
    ];
    let o = bench(&[&args[..], &["--repeat", "2"]].concat(), &json, tmp.path());
    ok(&o);
    let v = read_json(&json);
    assert_eq!(v["op"], "lightning");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, len) in rows.iter().zip([200, 64]) {
        assert_eq!(row["context"], len);
        assert!(row["median_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["tflops"].as_f64().unwrap() > 0.0, "{row}");
    }
    fails_with(
        &bench(&["--kernel", "softmax"], &json, tmp.path()),
        &["--kernel softmax", "lightning, sparse"],
    );
    fails_with(
        &bench(&[&args[..], &["--repeat", "0"]].concat(), &json, tmp.path()),
        &["--repeat"],
    );
}

#[test]
fn bench_times_the_sparse_attention_op_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    // The tiny preset's dense_len is 96: 64 queries at the end of 300 tokens run sparse, of
    // 80 dense.
    let args = [
        "--kernel",
        "sparse",
        "--context",
        "300,80",
        "--prefill-chunk",
        "64",
        "--repeat",
        "2",
    ];
    let o = bench(&args, &json, tmp.path());
    ok(&o);
    let v = read_json(&json);
    assert_eq!(v["op"], "sparse");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, (len, mode)) in rows.iter().zip([(300, "sparse"), (80, "dense")]) {
        assert_eq!(row["context"], len);
        assert_eq!(row["rows"], 64);
        assert_eq!(row["mode"], mode, "{row}");
        assert!(row["median_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["attention_flops"].as_f64().unwrap() > 0.0, "{row}");
        let select = row["select_flops"].as_f64().unwrap();
        assert_eq!(select > 0.0, mode == "sparse", "{row}");
        // No profile on the CPU: the parts are not split.
        assert!(row["profiled_attention_s"].is_null(), "{row}");
    }
}

#[test]
fn bench_measures_batched_against_one_by_one_throughput() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    // One prompt chunk each: the last prompt is read at the 4th step, while the later
    // requests still have tokens to go, so some steps are decode-only.
    let args = [
        "--concurrent",
        "4",
        "--context",
        "100",
        "--prefill-chunk",
        "128",
    ];
    let o = bench(&args, &json, tmp.path());
    ok(&o);
    let v = read_json(&json);
    assert_eq!(v["requests"], 4);
    assert_eq!(v["prompt_tokens"], 100);
    // Every request generates its --decode-tokens (4) tokens both ways (EOS is ignored).
    assert_eq!(v["generated_one_by_one"], 16);
    assert_eq!(v["generated_batched"], 16);
    for key in [
        "one_by_one_s",
        "batched_s",
        "ratio_total_tokens_per_s",
        "decode_tok_s_one_by_one",
        "decode_tok_s_batched",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    let phase = v["decode_tokens_batched_phase"].as_u64().unwrap();
    assert!(phase > 0 && phase < 16, "{v}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("decode steps: one by one"));
    // The batched run alone: no baseline figures, the same generated tokens.
    let o = bench(
        &[&args[..], &["--batched-only"]].concat(),
        &json,
        tmp.path(),
    );
    ok(&o);
    let v = read_json(&json);
    assert_eq!(v["generated_batched"], 16);
    assert!(
        v["one_by_one_s"].is_null() && v["ratio_total_tokens_per_s"].is_null(),
        "{v}"
    );
    assert!(!String::from_utf8_lossy(&o.stdout).contains("one by one"));
    let o = bench(&["--batched-only"], &json, tmp.path());
    assert!(
        !o.status.success() && stderr(&o).contains("--concurrent"),
        "{}",
        stderr(&o)
    );
    // No request is an error, not a panic.
    let o = bench(
        &["--concurrent", "0", "--context", "150"],
        &json,
        tmp.path(),
    );
    fails_with(&o, &["--concurrent"]);
}

#[test]
fn generate_traces_each_token_with_its_runner_up() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "m", &[]);
    let trace = tmp.path().join("trace.jsonl");
    let o = sala(
        &[
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "--device",
            "cpu",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--trace-tokens",
            trace.to_str().unwrap(),
            "The quick brown fox",
        ],
        tmp.path(),
    );
    ok(&o);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "one line per generated token");
    for l in &lines {
        let top = l["top"].as_array().unwrap();
        assert_eq!(top.len(), 2, "{l}");
        // Greedy: the token is the most likely one, and its log-probability is that one's.
        assert_eq!(l["id"], top[0][0], "{l}");
        assert_eq!(l["logprob"], top[0][1], "{l}");
        let (a, b) = (top[0][1].as_f64().unwrap(), top[1][1].as_f64().unwrap());
        assert!(a <= 0.0 && a >= b, "{l}");
    }
    // The traced ids are the printed text.
    let ids: Vec<u32> = lines
        .iter()
        .map(|l| l["id"].as_u64().unwrap() as u32)
        .collect();
    let tok = sala_tokenizer::Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(
        stdout(&o).trim_end(),
        tok.decode(&ids, true).unwrap().trim_end()
    );
}

/// A `--max-context` above the model's limit is an error at start, for every command that
/// takes it, naming the flag and the limit.
#[test]
fn max_context_above_the_model_limit_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "m", &[]);
    let d = dir.to_str().unwrap();
    let too_long = ["--max-context", "99999999"];
    let cpu = ["--device", "cpu", "-m", d];
    for cmd in ["generate", "serve"] {
        let mut args = vec![cmd];
        args.extend_from_slice(&cpu);
        args.extend_from_slice(&too_long);
        if cmd == "generate" {
            args.push("hello");
        } else {
            args.extend_from_slice(&["--port", "0"]);
        }
        fails_with(
            &sala(&args, tmp.path()),
            &["--max-context 99999999", "65536", "max_position_embeddings"],
        );
    }
    let mut args = vec!["chat"];
    args.extend_from_slice(&cpu);
    args.extend_from_slice(&too_long);
    fails_with(
        &sala_with_stdin(&args, b"hello\n", tmp.path()),
        &["--max-context 99999999", "65536"],
    );
}

/// `sala chat`: `/help` lists the commands, an unknown one is an error that ends nothing, and a
/// conversation past the context drops its oldest turns, says so, and goes on.
#[test]
fn chat_commands_and_a_conversation_past_the_context() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "m", &[]);
    let d = dir.to_str().unwrap();
    let input = "hello there friend\n/help\n/nope\nsecond message here\nthird message now\n\
                 fourth one\nfifth\n";
    let args = [
        "chat",
        "--device",
        "cpu",
        "-m",
        d,
        "--max-context",
        "60",
        "--max-tokens",
        "6",
        "--ignore-eos",
    ];
    let o = sala_with_stdin(&args, input.as_bytes(), tmp.path());
    ok(&o);
    let e = stderr(&o);
    assert!(e.contains("/reset") && e.contains("/exit"), "{e}");
    assert!(e.contains("unknown command /nope"), "{e}");
    assert!(e.contains("outgrew the context of 60 tokens"), "{e}");
    assert!(!e.contains("error: the prompt"), "{e}");
    assert_eq!(
        stdout(&o).lines().count(),
        5,
        "a reply per message: {}",
        stdout(&o)
    );
}

/// Ctrl-C (SIGINT) during a reply stops that reply; the session goes on to the next message.
#[cfg(unix)]
#[test]
fn ctrl_c_stops_the_reply_not_the_chat() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "m", &[]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sala"))
        .args(["chat", "--device", "cpu", "-m", dir.to_str().unwrap()])
        .args(["--max-tokens", "60000", "--ignore-eos"])
        .env("XDG_CACHE_HOME", tmp.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"tell me a very long story\n").unwrap();
    stdin.flush().unwrap();
    // The reply runs for a long while; interrupt it.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let pid = child.id().to_string();
    assert!(Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap()
        .success());
    std::thread::sleep(std::time::Duration::from_millis(300));
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    ok(&o);
    assert!(stderr(&o).contains("(stopped)"), "{}", stderr(&o));
}

#[test]
fn generate_json_and_json_schema_constrain_the_output() {
    let tmp = tempfile::tempdir().unwrap();
    let schema = tmp.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "n": {"type": "integer", "minimum": 1, "maximum": 9},
            "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": false}"#,
    )
    .unwrap();
    let schema_arg = schema.to_str().unwrap();
    let o = sala(
        &[
            "generate",
            "A record:",
            "--max-tokens",
            "300",
            "--json-schema",
            schema_arg,
        ],
        tmp.path(),
    );
    ok(&o);
    let v: serde_json::Value =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["name", "n", "ok"], "{v}");
    assert!((1..=9).contains(&v["n"].as_i64().unwrap()), "{v}");
    assert!(stderr(&o).contains("finish: stop"), "{}", stderr(&o));

    let o = sala(
        &[
            "generate",
            "An object:",
            "--max-tokens",
            "300",
            "--json",
            "--temperature",
            "1",
            "--seed",
            "3",
        ],
        tmp.path(),
    );
    ok(&o);
    let v: serde_json::Value =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));
    assert!(v.is_object(), "{v}");

    std::fs::write(&schema, r#"{"type": "strin"}"#).unwrap();
    let o = sala(&["generate", "x", "--json-schema", schema_arg], tmp.path());
    fails_with(&o, &["--json-schema", "invalid JSON schema", "strin"]);
    let o = sala(
        &["generate", "x", "--json-schema", "/no/such/schema.json"],
        tmp.path(),
    );
    fails_with(&o, &["--json-schema", "/no/such/schema.json"]);
}

/// A `sala serve` of `model` on a free port, ended when dropped.
struct Server {
    child: std::process::Child,
    addr: String,
}

impl Server {
    fn start(model: &str, cache: &Path) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(env!("CARGO_BIN_EXE_sala"))
            .args(["serve", "--device", "cpu", "-m", model, "--port", "0"])
            .env("XDG_CACHE_HOME", cache)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run sala serve");
        let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("sala serve says where it serves")
                .unwrap();
            if let Some(at) = line.split("http://").nth(1) {
                break at.trim_end_matches("/v1").to_string();
            }
        };
        // Its later lines go nowhere.
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    /// POSTs `body` as JSON to `path`; returns the status and the JSON answer.
    fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.addr).unwrap();
        let body = body.to_string();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, serde_json::from_str(body).unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sala perplexity` of a text in one window is exp(mean NLL) of the log-probabilities
/// `sala serve` gives the same text with `echo` (every token after the BOS); sliding windows
/// read more tokens and score each once.
#[test]
fn perplexity_is_the_exponent_of_the_mean_nll_of_the_echoed_logprobs() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let dir = tiny_checkpoint(cache, "tiny", &[]);
    let d = dir.to_str().unwrap();
    let text = "It was the best of times, it was the worst of times, it was the age of \
                wisdom, it was the age of foolishness, it was the epoch of belief.\n";
    let file = cache.join("text.txt");
    std::fs::write(&file, text).unwrap();
    let f = file.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["perplexity", "--device", "cpu", "-m", d, f];
        args.extend_from_slice(extra);
        let o = sala(&args, cache);
        ok(&o);
        o
    };
    let o = run(&["--context", "1024", "--json"]);
    let got: serde_json::Value =
        serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)));

    let server = Server::start(d, cache);
    let (status, v) = server.post(
        "/v1/completions",
        &serde_json::json!({"prompt": text, "echo": true, "logprobs": 0, "max_tokens": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let lps = v["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    assert!(lps[0].is_null(), "{v}");
    let nll: Vec<f64> = lps[1..].iter().map(|l| -l.as_f64().unwrap()).collect();
    let mean = nll.iter().sum::<f64>() / nll.len() as f64;
    assert_eq!(got["windows"], 1, "{got}");
    assert_eq!(got["tokens"], lps.len(), "{got}");
    assert_eq!(got["tokens_scored"], nll.len(), "{got}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    assert!(
        close(got["nll_mean"].as_f64().unwrap(), mean),
        "{got} vs {mean}"
    );
    assert!(
        close(got["perplexity"].as_f64().unwrap(), mean.exp()),
        "{got}"
    );
    for key in ["seconds", "tokens_per_sec"] {
        assert!(got[key].as_f64().unwrap() > 0.0, "{key}: {got}");
    }

    // Sliding windows of 16 every 8 tokens: each token after the first scored once, with
    // fewer tokens before it, so a different figure; the human form says the same.
    let o = run(&["--context", "16", "--stride", "8", "--json"]);
    let slid: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(slid["tokens_scored"], nll.len(), "{slid}");
    assert!(slid["windows"].as_u64().unwrap() > 2, "{slid}");
    assert!(
        slid["tokens_read"].as_u64().unwrap() > lps.len() as u64,
        "{slid}"
    );
    assert_ne!(slid["perplexity"], got["perplexity"]);
    let o = run(&["--context", "16", "--stride", "8"]);
    let line = stdout(&o);
    let ppl = slid["perplexity"].as_f64().unwrap();
    assert!(line.starts_with(&format!("perplexity {ppl:.4} ")), "{line}");
    assert!(
        line.contains(&format!("{} windows", slid["windows"])),
        "{line}"
    );
    assert!(stderr(&o).contains("tokens/s"), "{}", stderr(&o));
    // From standard input, the same.
    let o = sala_with_stdin(
        &[
            "perplexity",
            "--device",
            "cpu",
            "-m",
            d,
            "-",
            "--context",
            "16",
            "--stride",
            "8",
        ],
        text.as_bytes(),
        cache,
    );
    ok(&o);
    assert_eq!(stdout(&o), line);
}

#[test]
fn perplexity_refuses_bad_windows_and_texts() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let dir = tiny_checkpoint(cache, "tiny", &[]);
    let d = dir.to_str().unwrap();
    let file = cache.join("text.txt");
    std::fs::write(&file, "Some words to score.").unwrap();
    let f = file.to_str().unwrap();
    let empty = cache.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    for (extra, needles) in [
        (vec![f, "--context", "1"], vec!["--context 1", "at least 2"]),
        (vec![f, "--stride", "0"], vec!["--stride 0"]),
        (
            vec![f, "--context", "8", "--stride", "9"],
            vec!["--stride 9", "1..=8"],
        ),
        (
            vec![f, "--context", "70000"],
            vec!["--context 70000", "max_position_embeddings"],
        ),
        (
            vec![empty.to_str().unwrap()],
            vec!["empty.txt", "at least 2"],
        ),
        (vec!["/no/such/text.txt"], vec!["/no/such/text.txt"]),
        (
            vec![f, "--max-memory", "1M"],
            vec!["--max-memory 1M", "GiB are allowed"],
        ),
        (vec![f, "--prefill-chunk", "0"], vec!["--prefill-chunk"]),
    ] {
        let mut args = vec!["perplexity", "--device", "cpu", "-m", d];
        args.extend(extra);
        fails_with(&sala(&args, cache), &needles);
    }
}

#[test]
fn generate_speculates_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    // A repetitive prompt: lookup drafts from it; greedy, so the same text with and without
    // (the built-in model's greedy tokens, verified in spans, up to a near-tie).
    let prompt = "one two three one two three one two three one two three";
    let args = [
        "generate",
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-tokens",
        "48",
        prompt,
    ];
    let plain = sala(&args, cache);
    ok(&plain);
    let spec = sala(&[&args[..], &["--speculate", "6"]].concat(), cache);
    ok(&spec);
    let err = String::from_utf8_lossy(&spec.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("speculation:"))
        .unwrap_or_else(|| panic!("no speculation line in {err}"));
    let drafted: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(drafted > 0, "{line}");
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("speculation:"));
    fails_with(
        &sala(&[&args[..], &["--speculate", "0"]].concat(), cache),
        &["--speculate", "1..=16"],
    );
    fails_with(
        &sala(
            &[
                "serve",
                "--device",
                "cpu",
                "--port",
                "0",
                "--speculate",
                "17",
            ],
            cache,
        ),
        &["--speculate 17", "1..=16"],
    );
}

#[test]
fn bench_times_verification_spans() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench(
        &["--context", "200", "--verify-spans", "1,3,8"],
        &json,
        tmp.path(),
    );
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    for n in [1, 3, 8] {
        let line = out
            .lines()
            .find(|l| l.contains(&format!("verifying a span of {n} takes")))
            .unwrap_or_else(|| panic!("no line for a span of {n} in {out}"));
        assert!(line.contains("x a decode step"), "{line}");
    }
    fails_with(
        &bench(
            &["--context", "200", "--verify-spans", "65"],
            &json,
            tmp.path(),
        ),
        &["--verify-spans 65", "1 to 64"],
    );
}
