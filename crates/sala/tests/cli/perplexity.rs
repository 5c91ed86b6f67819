//! `sala perplexity` against the server's echoed log-probabilities, and its refusals.

use super::*;

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
        (
            vec![f, "--context-parallel", "2"],
            vec!["--context-parallel does not apply to perplexity"],
        ),
    ] {
        let mut args = vec!["perplexity", "--device", "cpu", "-m", d];
        args.extend(extra);
        fails_with(&sala(&args, cache), &needles);
    }
}
