//! `sala bench`: the model, its ops alone, concurrent requests, and its refusals.

use super::*;

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

/// `sala bench` on the CPU with the tiny preset, 4 decode tokens, JSON to `json`.
fn bench(args: &[&str], json: &Path, cache: &Path) -> Output {
    bench_tiny(&[&["--decode-tokens", "4"], args].concat(), json, cache)
}

/// `sala bench` on the CPU with the tiny preset, JSON to `json`.
fn bench_tiny(args: &[&str], json: &Path, cache: &Path) -> Output {
    let mut all = vec![
        "bench",
        "--device",
        "cpu",
        "--preset",
        "tiny",
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
        assert_eq!(row["locality"], 0.0, "{row}");
    }
    // Queries that share a direction (--locality) run and are reported as such.
    let o = bench(
        &[&args[..], &["--locality", "4"]].concat(),
        &json,
        tmp.path(),
    );
    ok(&o);
    let v = read_json(&json);
    for row in v["results"].as_array().unwrap() {
        assert_eq!(row["locality"], 4.0, "{row}");
        assert!(row["median_s"].as_f64().unwrap() > 0.0, "{row}");
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

/// --speculative: one request decoded plainly and with each draft source through the engine;
/// the oracle's drafts stand as far as they are right and the tokens are the plain ones.
#[test]
fn bench_measures_speculative_decoding_against_plain() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench_tiny(
        &[
            "--context",
            "120",
            "--decode-tokens",
            "24",
            "--speculative",
            "oracle:3/4,oracle:4/4,ngram,draft:random",
        ],
        &json,
        tmp.path(),
    );
    ok(&o);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let run = &doc["runs"][0];
    assert_eq!(run["context"], 120, "{doc}");
    positive(run, "plain_decode_tok_s", "plain");
    let rows = run["speculative"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{doc}");
    for (r, (name, per_step)) in rows.iter().zip([("oracle:3/4", 3.0), ("oracle:4/4", 4.0)]) {
        assert_eq!(r["drafts"], name, "{r}");
        assert_eq!(r["same_tokens"], 24, "{r}");
        assert_eq!(r["mean_accepted"].as_f64(), Some(per_step), "{r}");
        positive(r, "decode_tok_s", name);
    }
    assert_eq!(rows[2]["drafts"], "ngram:4");
    // A random draft model of the model's shape: it drafts, the tokens stay the plain ones.
    assert_eq!(rows[3]["drafts"], "draft:random", "{doc}");
    assert_eq!(rows[3]["same_tokens"], 24, "{doc}");
    assert!(rows[3]["drafted"].as_u64().unwrap() > 0, "{doc}");
    fails_with(
        &bench(
            &["--context", "120", "--speculative", "oracle:5/4"],
            &json,
            tmp.path(),
        ),
        &["--speculative oracle:5/4", "0 to K"],
    );
}

/// --concurrent with --speculative: the batch again with every request drafting from its own
/// plain continuation; the tokens stay the plain batch's.
#[test]
fn bench_measures_a_speculating_batch_against_the_plain_one() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("bench.json");
    let o = bench_tiny(
        &[
            "--concurrent",
            "3",
            "--context",
            "100",
            "--decode-tokens",
            "16",
            "--batched-only",
            "--speculative",
            "oracle:3/4,oracle:0/4",
        ],
        &json,
        tmp.path(),
    );
    ok(&o);
    let doc = read_json(&json);
    let rows = doc["speculative"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{doc}");
    for (r, name) in rows.iter().zip(["oracle:3/4", "oracle:0/4"]) {
        assert_eq!(r["drafts"], name, "{r}");
        assert_eq!(r["same_tokens"], true, "{r}");
        positive(r, "decode_tok_s", name);
    }
}

/// --context-parallel N: each context read by N simulated ranks at once, the ranges tiling
/// the prompt in order, the last logits those of one rank reading it (within the lightning
/// scan's rounding), both TTFTs and decode speeds reported, also where each rank is a
/// tensor-parallel group; 0 ranks, and ranks the memory limit cannot hold, refused by name
/// before any work.
#[test]
fn bench_reads_a_prompt_with_context_parallel_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("cp.json");
    let o = bench(
        &[
            "--context-parallel",
            "3",
            "--context",
            "700,2K",
            "--prefill-chunk",
            "256",
        ],
        &json,
        tmp.path(),
    );
    ok(&o);
    let doc = read_json(&json);
    assert_eq!(doc["ranks"], 3);
    let rows = doc["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, len) in rows.iter().zip([700u64, 2048]) {
        assert_eq!(r["context"], len);
        let ranges = r["ranges"].as_array().unwrap();
        assert_eq!(ranges.len(), 3, "{r}");
        let mut at = 0;
        for range in ranges {
            assert_eq!(range[0].as_u64().unwrap(), at, "{r}");
            at = range[1].as_u64().unwrap();
        }
        assert_eq!(at, len, "{r}");
        let err = r["last_logits_rel_l2_vs_one"].as_f64().unwrap();
        assert!(err < 5e-2, "{r}");
        for k in [
            "ttft_one_s",
            "ttft_ranks_s",
            "decode_tok_s_one",
            "decode_tok_s_ranks",
        ] {
            positive(r, k, "context parallel");
        }
    }
    fails_with(
        &bench(&["--context-parallel", "0"], &json, tmp.path()),
        &["--context-parallel must be at least 1"],
    );
    // Each rank a tensor-parallel group of 2 simulated ranks.
    let groups = [
        "--context-parallel",
        "2",
        "--tensor-parallel",
        "2",
        "--context",
        "700",
    ];
    ok(&bench(&groups, &json, tmp.path()));
    let doc = read_json(&json);
    assert_eq!(doc["ranks"], 2);
    assert!(
        doc["device"].as_str().unwrap().contains("tensor parallel"),
        "{doc}"
    );
    let r = &doc["results"][0];
    assert_eq!(r["ranges"].as_array().unwrap().len(), 2, "{r}");
    assert!(
        r["last_logits_rel_l2_vs_one"].as_f64().unwrap() < 5e-2,
        "{r}"
    );
    let small = [
        "--context-parallel",
        "4",
        "--context",
        "1K",
        "--max-memory",
        "10M",
    ];
    fails_with(
        &bench(&small, &json, tmp.path()),
        &["4 ranks on one device need", "--max-memory 10M"],
    );
}
