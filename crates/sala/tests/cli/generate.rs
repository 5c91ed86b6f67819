//! `sala init`, `inspect`, `generate`, `chat` and `serve` end to end, and clear errors on bad
//! input.

use super::*;

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
        "a sequence that speculates holds",
        "K/V fp8",
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
    // An FP8 K/V cache runs (and is deterministic); a dtype we do not have is refused.
    let fp8 = run(&["--kv-cache-dtype", "fp8"]);
    assert_eq!(fp8, run(&["--kv-cache-dtype", "fp8"]));
    fails_with(
        &sala(
            &["generate", "--model", d, "hi", "--kv-cache-dtype", "int3"],
            tmp.path(),
        ),
        &["--kv-cache-dtype", "int3", "bf16 or fp8"],
    );
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
    let unknown_mixer = sala(&["inspect", bad.to_str().unwrap()], cache);
    fails_with(&unknown_mixer, &["mixer_types[1]", "mamba2"]);
    // Said once: an error that quotes its cause is not followed by the cause again.
    assert_eq!(
        stderr(&unknown_mixer).matches("mamba2").count(),
        1,
        "{}",
        stderr(&unknown_mixer)
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
    let mut input = format!("Hello there\n{long}\n/reset\n").into_bytes();
    // A line that is not UTF-8 is skipped too.
    input.extend_from_slice(b"\xff\xfe is not UTF-8\nAnother question\n");
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
    let o = sala_with_stdin(&args, &input, tmp.path());
    ok(&o);
    let e = stderr(&o);
    assert!(e.contains("context budget of 96"), "{e}");
    assert!(e.contains("not UTF-8 text; it was skipped"), "{e}");
    assert!(e.contains("conversation cleared"), "{e}");
    // Two answered turns, each ended by a newline (a reply may hold newlines itself).
    assert!(stdout(&o).lines().count() >= 2, "{}", stdout(&o));
}

/// `sala chat` resumes each turn from the state the last one left (the prefix cache, on by
/// default): the second and third turns read only what is new; `--prefix-cache off` reads
/// every turn whole.
#[test]
fn chat_turns_resume_from_the_last_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_checkpoint(tmp.path(), "tiny", &[]);
    let d = dir.to_str().unwrap();
    let input = "Tell me about the sea
And the mountains
And the sky
";
    let resumed = |extra: &[&str]| {
        let mut args = vec!["chat", "--device", "cpu", "-m", d, "--max-tokens", "5"];
        args.extend_from_slice(&["--ignore-eos", "--temperature", "0"]);
        args.extend_from_slice(extra);
        let o = sala_with_stdin(&args, input.as_bytes(), tmp.path());
        ok(&o);
        stderr(&o)
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix('(')?;
                let (n, rest) = rest.split_once(" of the ")?;
                let (m, _) = rest.split_once(" prompt tokens resumed")?;
                Some((n.parse::<usize>().ok()?, m.parse::<usize>().ok()?))
            })
            .collect::<Vec<_>>()
    };
    let on = resumed(&[]);
    assert_eq!(on.len(), 2, "{on:?}");
    // Each later turn's prompt holds the last turn's, read before.
    assert!(on.iter().all(|&(n, m)| n > 0 && n < m), "{on:?}");
    assert!(on[1].0 > on[0].0, "{on:?}");
    assert!(resumed(&["--prefix-cache", "off"]).is_empty());
    // A wrong value is refused by name (the command-line parser's usage error).
    let args = [
        "chat",
        "--device",
        "cpu",
        "-m",
        d,
        "--prefix-cache",
        "maybe",
    ];
    let o = sala(&args, tmp.path());
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("'maybe' for '--prefix-cache"),
        "{}",
        stderr(&o)
    );
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
    let cpu = sala_model::Backend::memory_facts(&sala_cpu::CpuBackend::default(), &config, 256);
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
    let spec = sala(&[&args[..], &["--speculative", "ngram:6"]].concat(), cache);
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
    let off = sala(&[&args[..], &["--speculative", "off"]].concat(), cache);
    ok(&off);
    assert!(!String::from_utf8_lossy(&off.stderr).contains("speculation:"));
    // An EAGLE-3 draft made for the built-in model (the tiny preset): it drafts, greedy text
    // unchanged; one made for another model's hidden size is refused by name.
    let target = sala_checkpoint::preset("tiny").unwrap();
    let shape = |hidden| sala_checkpoint::DraftConfig {
        hidden_size: hidden,
        intermediate_size: 64,
        target_hidden_size: hidden,
        ..sala_checkpoint::DraftConfig::small(&target)
    };
    let draft = cache.join("draft");
    sala_checkpoint::write_random_draft(&draft, &shape(target.hidden_size), false, None, 3)
        .unwrap();
    let mode = format!("draft:{}", draft.display());
    let with_draft = sala(&[&args[..], &["--speculative", &mode]].concat(), cache);
    ok(&with_draft);
    assert_eq!(
        with_draft.stdout, plain.stdout,
        "greedy text changed with a draft model"
    );
    let err = String::from_utf8_lossy(&with_draft.stderr);
    assert!(err.contains("speculation:"), "{err}");
    let other = cache.join("other-draft");
    sala_checkpoint::write_random_draft(&other, &shape(2 * target.hidden_size), true, None, 3)
        .unwrap();
    let mode = format!("draft:{}", other.display());
    fails_with(
        &sala(&[&args[..], &["--speculative", &mode]].concat(), cache),
        &[&mode, "hidden states of size 256"],
    );
    for (mode, says) in [
        ("ngram:0", "1 to 16"),
        ("ngram:x", "1 to 16"),
        ("draft:/nowhere", "draft model directory not found"),
        ("draft:", "expected ngram"),
        ("lookahead", "expected ngram"),
    ] {
        fails_with(
            &sala(&[&args[..], &["--speculative", mode]].concat(), cache),
            &[mode, says],
        );
    }
    fails_with(
        &sala(
            &[
                "serve",
                "--device",
                "cpu",
                "--port",
                "0",
                "--speculative",
                "ngram:17",
            ],
            cache,
        ),
        &["--speculative ngram:17", "1 to 16"],
    );
}

/// `sala quantize`: a 4-bit GPTQ checkpoint written from a bf16 one, which `generate` and
/// `inspect` read; bad groups, a used output directory and a quantized input are refused.
#[test]
fn quantize_writes_a_gptq_checkpoint_that_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let (src, out) = tiny_and_quantized(cache, &["--group", "32", "--asym", "--keep-gates"]);
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let q = &config["quantization_config"];
    assert_eq!(
        (q["quant_method"].as_str(), q["bits"].as_u64()),
        (Some("gptq"), Some(4)),
        "{q}"
    );
    assert_eq!(
        (q["group_size"].as_i64(), q["sym"].as_bool()),
        (Some(32), Some(false)),
        "{q}"
    );
    assert!(out.join("tokenizer.json").is_file());
    let gen = sala(
        &[
            "generate",
            "--model",
            o,
            "--device",
            "cpu",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "hi",
        ],
        cache,
    );
    ok(&gen);
    let info = sala(&["inspect", o], cache);
    ok(&info);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        text.contains("4-bit GPTQ (groups of 32, asymmetric"),
        "{text}"
    );
    assert!(
        text.contains("weights held") && text.contains("on a GPU"),
        "{text}"
    );
    fails_with(
        &sala(&["quantize", s, o], cache),
        &["exists and is not empty"],
    );
    let again = cache.join("again");
    fails_with(
        &sala(&["quantize", o, again.to_str().unwrap()], cache),
        &["quantized already"],
    );
    fails_with(
        &sala(
            &["quantize", s, again.to_str().unwrap(), "--group", "12"],
            cache,
        ),
        &["--group 12", "multiple of 8"],
    );
    fails_with(
        &sala(
            &["quantize", s, again.to_str().unwrap(), "--method", "int3"],
            cache,
        ),
        &["--method int3", "w4-rtn", "gptq", "fp8"],
    );
}

/// `sala compare`: a model against itself agrees everywhere with no error; against its 4-bit
/// form it reports a positive error; models of different vocabularies are refused.
#[test]
fn compare_reports_how_far_two_models_are() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let (src, out) = tiny_and_quantized(cache, &["--group", "32"]);
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    let run = |b: &str| {
        let args = [
            "compare",
            s,
            b,
            "--device",
            "cpu",
            "--prompts",
            "3",
            "--len",
            "20",
            "--tokens",
            "6",
            "--json",
        ];
        let r = sala(&args, cache);
        ok(&r);
        serde_json::from_slice::<serde_json::Value>(&r.stdout).unwrap()
    };
    let same = run(s);
    assert_eq!(same["logit_rel_l2_max"].as_f64(), Some(0.0), "{same}");
    assert_eq!(same["top1_agreement"].as_f64(), Some(1.0), "{same}");
    assert_eq!(same["same_greedy_continuations"], 3, "{same}");
    assert_eq!(same["positions"], 18, "{same}");
    let w4 = run(o);
    let err = w4["logit_rel_l2_mean"].as_f64().unwrap();
    assert!(err > 0.0 && err < 1.0, "{w4}");
    // A valid checkpoint with another vocabulary: refused by compare itself.
    let other = cache.join("other-vocab");
    let mut config = sala_checkpoint::preset("tiny").unwrap();
    config.vocab_size *= 2;
    sala_checkpoint::write_random_checkpoint(&other, &config, &Default::default()).unwrap();
    let o2 = other.to_str().unwrap();
    fails_with(
        &sala(&["compare", s, o2, "--device", "cpu"], cache),
        &["must share a vocabulary", o2],
    );
}

/// `sala quantize --method fp8`: a compressed-tensors FP8 checkpoint that `generate` runs to
/// the same tokens as `--quantize fp8` over its source, `inspect` names, and `compare` tells
/// from its source; `--keep-gates` is refused for FP8.
#[test]
fn quantize_fp8_writes_what_quantize_fp8_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let (src, out) = (cache.join("bf16"), cache.join("fp8"));
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    ok(&sala(&["init", "--preset", "tiny", s], cache));
    fails_with(
        &sala(
            &["quantize", s, o, "--method", "fp8", "--keep-gates"],
            cache,
        ),
        &["--keep-gates", "w4-rtn"],
    );
    ok(&sala(&["quantize", s, o, "--method", "fp8"], cache));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["quantization_config"]["quant_method"].as_str(),
        Some("compressed-tensors")
    );
    let gen = |model: &str, extra: &[&str]| {
        let args = [
            &[
                "generate",
                "--model",
                model,
                "--device",
                "cpu",
                "--max-tokens",
                "8",
                "--ignore-eos",
                "The cat",
            ][..],
            extra,
        ]
        .concat();
        let r = sala(&args, cache);
        ok(&r);
        stdout(&r)
    };
    assert_eq!(gen(o, &[]), gen(s, &["--quantize", "fp8"]));
    let info = sala(&["inspect", o], cache);
    ok(&info);
    assert!(stdout(&info).contains("FP8 E4M3"), "{}", stdout(&info));
    let r = sala(
        &[
            "compare",
            s,
            s,
            "--b-quantize",
            "fp8",
            "--device",
            "cpu",
            "--prompts",
            "2",
            "--len",
            "16",
            "--tokens",
            "4",
            "--json",
        ],
        cache,
    );
    ok(&r);
    let v: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let err = v["logit_rel_l2_mean"].as_f64().unwrap();
    assert!(err > 0.0 && err < 0.5, "{v}");
    fails_with(
        &sala(
            &["generate", "--model", s, "hi", "--quantize", "int2"],
            cache,
        ),
        &["--quantize int2", "fp8"],
    );
}

/// `sala quantize --method gptq --calibration FILE`: on its calibration text, the GPTQ
/// checkpoint's loss moves less from the bf16 model's than round to nearest's; the flags go
/// together, and a missing text is a clear error.
#[test]
fn gptq_calibration_beats_round_to_nearest_on_its_text() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let src = cache.join("bf16");
    let s = src.to_str().unwrap();
    ok(&sala(
        &["init", "--preset", "tiny", "--seed", "4", s],
        cache,
    ));
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "from", "home",
    ];
    let mut x = 7u64;
    let text: Vec<&str> = (0..3000)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            words[(x >> 33) as usize % words.len()]
        })
        .collect();
    let calib = cache.join("calib.txt");
    std::fs::write(&calib, text.join(" ")).unwrap();
    let c = calib.to_str().unwrap();
    let (rtn, gptq) = (cache.join("rtn"), cache.join("gptq"));
    let (r, g) = (rtn.to_str().unwrap(), gptq.to_str().unwrap());
    ok(&sala(&["quantize", s, r, "--group", "32"], cache));
    ok(&sala(
        &[
            "quantize",
            s,
            g,
            "--group",
            "32",
            "--method",
            "gptq",
            "--calibration",
            c,
        ],
        cache,
    ));
    let nll = |model: &str| -> f64 {
        let o = sala(
            &["perplexity", "--model", model, c, "--device", "cpu"],
            cache,
        );
        ok(&o);
        let text = format!("{}{}", stdout(&o), String::from_utf8_lossy(&o.stderr));
        let at = text.find("mean NLL ").expect("the loss") + "mean NLL ".len();
        text[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let base = nll(s);
    let (dr, dg) = ((nll(r) - base).abs(), (nll(g) - base).abs());
    assert!(
        dg < 0.7 * dr,
        "GPTQ moves the loss by {dg}, round to nearest by {dr}"
    );
    let other = cache.join("other");
    let o = other.to_str().unwrap();
    fails_with(
        &sala(&["quantize", s, o, "--method", "gptq"], cache),
        &["--calibration"],
    );
    fails_with(
        &sala(&["quantize", s, o, "--calibration", c], cache),
        &["--calibration", "--method gptq"],
    );
    let missing = cache.join("nowhere.txt");
    fails_with(
        &sala(
            &[
                "quantize",
                s,
                o,
                "--method",
                "gptq",
                "--calibration",
                missing.to_str().unwrap(),
            ],
            cache,
        ),
        &["nowhere.txt"],
    );
}
