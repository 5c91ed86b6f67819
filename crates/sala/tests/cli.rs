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
