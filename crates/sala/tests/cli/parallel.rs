//! Several ranks on the CPU (simulated): tensor and context parallelism through `generate`,
//! `bench` and `inspect`.

use super::*;

/// `sala inspect --tensor-parallel N --context-parallel M` (the released shape without a
/// checkpoint): each GPU's plan at 8K / 128K / 1M beside one GPU's; tensor parallelism halves
/// a GPU's weights, context parallelism leaves every rank the whole model and the last the
/// whole caches; shapes that do not split are refused by name.
#[test]
fn inspect_plans_several_gpus() {
    let tmp = tempfile::tempdir().unwrap();
    let gib = |line: &str, after: &str| -> f64 {
        let at = line.find(after).unwrap() + after.len();
        line[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let rows = |extra: &[&str]| -> Vec<String> {
        let o = sala(&[&["inspect"], extra].concat(), tmp.path());
        ok(&o);
        let out = stdout(&o);
        let rows: Vec<String> = out
            .lines()
            .filter(|l| l.contains("(one GPU alone"))
            .map(String::from)
            .collect();
        assert_eq!(rows.len(), 3, "{out}");
        assert!(rows[2].trim_start().starts_with("1M"), "{out}");
        rows
    };
    let tp = rows(&["--tensor-parallel", "2"]);
    for r in &tp {
        let mine: f64 = r.split_whitespace().nth(1).unwrap().parse().unwrap();
        let alone = gib(r, "one GPU alone ");
        assert!(mine < 0.6 * alone, "{r}");
        assert!(gib(r, "weights ") < 9.5, "{r}");
    }
    let cp = rows(&["--context-parallel", "8"]);
    assert!(gib(&cp[2], "weights ") > 17.0, "{}", cp[2]);
    assert!(gib(&cp[2], "K/V cache ") == 8.0, "{}", cp[2]);
    assert!(cp[2].contains("8 ranges"), "{}", cp[2]);
    let both = sala(
        &[
            "inspect",
            "--tensor-parallel",
            "2",
            "--context-parallel",
            "4",
        ],
        tmp.path(),
    );
    ok(&both);
    assert!(stdout(&both).contains("8 GPUs, 4 context-parallel ranks of 2"));
    fails_with(
        &sala(&["inspect", "--tensor-parallel", "3"], tmp.path()),
        &["do not split into 3"],
    );
    fails_with(
        &sala(&["inspect", "--context-parallel", "0"], tmp.path()),
        &["must be at least 1"],
    );
}

/// `--tensor-parallel 2` on the CPU (simulated ranks) picks the greedy tokens one device
/// picks, up to a near-tie of the split sums (where they part, each pick is the other's
/// runner-up within 0.05 nats), in generate and bench; rank counts the model does not split
/// into are refused by name (and GPUs where there are none).
#[test]
fn generate_and_bench_run_tensor_parallel_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let mut agreed = 0;
    for prompt in ["Once upon a time", "The quick brown fox"] {
        let (_, one) = greedy_trace(cache, prompt, &[]);
        let (o, two) = greedy_trace(cache, prompt, &["--tensor-parallel", "2"]);
        assert!(stderr(&o).contains("2 x cpu"), "{}", stderr(&o));
        // Past the sparse layers' 2 KV heads too.
        let (_, four) = greedy_trace(cache, prompt, &["--tensor-parallel", "4"]);
        assert_eq!(one.len(), 16);
        agreed += agreed_up_to_a_near_tie(prompt, &one, &two);
        agreed += agreed_up_to_a_near_tie(prompt, &one, &four);
    }
    assert!(agreed >= 8, "only {agreed} tokens agreed");
    let bench = [
        "bench",
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--tensor-parallel",
        "2",
        "--concurrent",
        "2",
        "--context",
        "128",
        "--decode-tokens",
        "8",
    ];
    let o = sala(&bench, cache);
    ok(&o);
    assert!(stdout(&o).contains("tensor parallel"), "{}", stdout(&o));
    // A 4-bit checkpoint over ranks, its groups wider than a rank's part of o_proj and
    // down_proj; random 4-bit and FP8 weights in the bench.
    let (_, w4) = tiny_and_quantized(cache, &["--group", "128", "--asym"]);
    let w4 = ["--model", w4.to_str().unwrap()];
    let prompt = "Once upon a time";
    let (_, one) = greedy_trace(cache, prompt, &w4);
    let (_, two) = greedy_trace(
        cache,
        prompt,
        &[&w4[..], &["--tensor-parallel", "2"]].concat(),
    );
    let (_, four) = greedy_trace(
        cache,
        prompt,
        &[&w4[..], &["--tensor-parallel", "4"]].concat(),
    );
    let w4_agreed =
        agreed_up_to_a_near_tie(prompt, &one, &two) + agreed_up_to_a_near_tie(prompt, &one, &four);
    assert!(w4_agreed >= 4, "4-bit: only {w4_agreed} tokens agreed");
    for weights in ["w4", "fp8"] {
        let o = sala(&[&bench[..], &["--weights", weights]].concat(), cache);
        ok(&o);
    }
    let with = |n: &str, device: &str| {
        let extra = [
            "generate",
            "--tensor-parallel",
            n,
            "--device",
            device,
            "hello",
        ];
        sala(&extra, cache)
    };
    fails_with(&with("3", "cpu"), &["do not split into 3"]);
    fails_with(
        &with("8", "cpu"),
        &["4 attention heads", "do not split into 8"],
    );
    fails_with(&with("0", "cpu"), &["--tensor-parallel must be at least 1"]);
    // No GPU here: the ranks' first GPU is named.
    fails_with(&with("2", "cuda"), &["cuda:0"]);
}

/// `generate` of `prompt` on the CPU, greedy, 16 tokens, with `extra` flags: its output and
/// each token's trace (`--trace-tokens`: the pick and its runner-up).
fn greedy_trace(cache: &Path, prompt: &str, extra: &[&str]) -> (Output, Vec<serde_json::Value>) {
    let name = extra.join("_").replace(['/', '\\'], "_");
    let path = cache.join(format!("trace-{name}.jsonl"));
    let mut args = vec![
        "generate",
        "--device",
        "cpu",
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-tokens",
        "16",
        "--trace-tokens",
        path.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push(prompt);
    let o = sala(&args, cache);
    ok(&o);
    let text = std::fs::read_to_string(&path).unwrap();
    let trace = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (o, trace)
}

/// Tokens two greedy traces pick alike before they part; where they part it must be a
/// near-tie: each pick is the other's runner-up within 0.05 nats (what follows depends on
/// which was taken, so the comparison stops there).
fn agreed_up_to_a_near_tie(what: &str, a: &[serde_json::Value], b: &[serde_json::Value]) -> usize {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x["id"] == y["id"] {
            continue;
        }
        for (p, q) in [(x, y), (y, x)] {
            let top = p["top"].as_array().unwrap();
            assert_eq!(top[1][0], q["id"], "{what}: {p} vs {q}");
            let gap = top[0][1].as_f64().unwrap() - top[1][1].as_f64().unwrap();
            assert!(
                gap < 0.05,
                "{what}: a gap of {gap} is no near-tie: {p} vs {q}"
            );
        }
        return i;
    }
    a.len().min(b.len())
}

/// `generate` and `serve`'s engine read a long prompt with `--context-parallel N` ranks (the
/// engine's model taking the last range, the last token read by its step) and pick one
/// device's greedy tokens up to a near-tie, also where each rank is a tensor-parallel group;
/// 0 ranks are refused by name.
#[test]
fn generate_reads_long_prompts_with_context_parallel_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path();
    let prompt = ["the quick brown fox jumps over the lazy dog"; 20].join(" ");
    let (_, one) = greedy_trace(cache, &prompt, &[]);
    let mut agreed = 0;
    for n in ["2", "3"] {
        let (_, ranks) = greedy_trace(cache, &prompt, &["--context-parallel", n]);
        assert_eq!(ranks.len(), 16);
        // The ranks read the prompt: its first token's log-probability is theirs, not one's.
        assert_ne!(ranks[0]["logprob"], one[0]["logprob"], "{n} ranks");
        agreed += agreed_up_to_a_near_tie(&format!("{n} ranks"), &one, &ranks);
    }
    assert!(agreed >= 8, "only {agreed} tokens agreed");
    // Context ranks that are tensor-parallel groups: one device's tokens up to a near-tie.
    let both = ["--context-parallel", "2", "--tensor-parallel", "2"];
    let (o, groups) = greedy_trace(cache, &prompt, &both);
    assert_eq!(groups.len(), 16);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("prompt tokens read by 2 ranks"), "{err}");
    let agreed = agreed_up_to_a_near_tie("2 groups of 2", &one, &groups);
    assert!(agreed >= 4, "2 groups of 2: only {agreed} tokens agreed");
    let with = |extra: &[&str]| {
        sala(
            &[&["generate", "--device", "cpu"], extra, &["hi"]].concat(),
            cache,
        )
    };
    fails_with(
        &with(&["--context-parallel", "0"]),
        &["--context-parallel must be at least 1"],
    );
}
