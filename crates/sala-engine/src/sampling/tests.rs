use super::*;

fn params(edit: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams {
        temperature: 1.0,
        seed: Some(1),
        ..SamplingParams::default()
    };
    edit(&mut p);
    p
}

fn ln_probs(probs: &[f64]) -> Vec<f32> {
    probs.iter().map(|p| p.ln() as f32).collect()
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + logits
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// Ids that survive truncation, ascending.
fn support(sampler: &mut Sampler, logits: &[f32]) -> Vec<u32> {
    let max = sampler.load(logits).unwrap();
    let total = sampler.scale_and_exponentiate(max);
    let mut ids: Vec<u32> = match sampler.truncate(total) {
        Support::Prefix { len, .. } => sampler.idx[..len].to_vec(),
        Support::Threshold { threshold, .. } => (0..logits.len() as u32)
            .filter(|&i| {
                let w = sampler.weights[i as usize];
                w > 0.0 && w >= threshold
            })
            .collect(),
    };
    ids.sort_unstable();
    ids
}

/// Straightforward full-sort version of the truncation rules.
fn reference_support(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
    let clean: Vec<f32> = logits.iter().map(|&x| sanitize(x)).collect();
    let max = clean.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let work: Vec<f32> = clean.iter().map(|&x| (x - max) / p.temperature).collect();
    let w: Vec<f32> = work.iter().map(|&x| exp_nonpositive(x)).collect();
    let total = sum_at_least(&w, 0.0);
    let mut order: Vec<u32> = (0..w.len() as u32)
        .filter(|&i| w[i as usize] > 0.0)
        .collect();
    order.sort_by(|&a, &b| by_value_desc(&work, a, b));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let mass = if p.top_k > 0 {
            order.iter().map(|&i| w[i as usize] as f64).sum()
        } else {
            total
        };
        let mut cum = 0.0;
        let mut cut = order.len();
        for (j, &i) in order.iter().enumerate() {
            cum += w[i as usize] as f64;
            if cum >= p.top_p as f64 * mass {
                cut = j + 1;
                break;
            }
        }
        order.truncate(cut);
    }
    order.retain(|&i| w[i as usize] >= p.min_p);
    order.sort_unstable();
    order
}

#[test]
fn fast_exp_is_accurate() {
    let mut worst = 0.0f64;
    for k in 0..870_000 {
        let x = -(k as f32) * 1e-4;
        let exact = (x as f64).exp();
        let rel = (exp_nonpositive(x) as f64 - exact).abs() / exact;
        worst = worst.max(rel);
    }
    assert!(worst < 5e-7, "worst relative error {worst}");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-88.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
}

#[test]
fn wide_loops_give_the_narrow_bits_and_first_index_is_position() {
    let mut rng = Rng::seed_from_u64(21);
    for n in [1usize, 7, 255, 256, 257, 1000, 73_448] {
        let xs: Vec<f32> = (0..n)
            .map(|_| (rng.next_f64() * 40.0 - 30.0) as f32)
            .collect();
        let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // On a CPU with AVX2 the first runs 8 lanes wide, the second as compiled.
        assert_eq!(
            sum_exp_shifted(&xs, max).to_bits(),
            sum_exp_shifted_body(&xs, max).to_bits(),
            "n {n}"
        );
        let (a, b) = (log_normalizer(&xs), log_normalizer_body(&xs));
        assert_eq!(
            a.map(|(m, l)| (m, l.to_bits())),
            b.map(|(m, l)| (m, l.to_bits()))
        );
        // The maximum, a value placed at block edges (first occurrence wins), and absence.
        assert_eq!(
            first_index_of(&xs, max),
            xs.iter().position(|&x| x == max).unwrap()
        );
        for at in [0, 255, 256, n / 2, n - 1] {
            let mut ys = xs.clone();
            if at < n {
                ys[at] = 99.0;
                let twin = (at + 300).min(n - 1);
                ys[twin] = 99.0;
                assert_eq!(first_index_of(&ys, 99.0), at.min(twin), "n {n} at {at}");
            }
        }
        assert_eq!(first_index_of(&xs, 1e9), 0);
    }
}

#[test]
fn uniform_f64_is_in_range_and_centred() {
    let mut rng = Rng::seed_from_u64(3);
    let n = 100_000;
    let mut sum = 0.0;
    for _ in 0..n {
        let u = rng.next_f64();
        assert!((0.0..1.0).contains(&u));
        sum += u;
    }
    assert!((sum / n as f64 - 0.5).abs() < 0.005);
}

#[test]
fn default_is_valid_greedy() {
    let p = SamplingParams::default();
    assert!(p.is_greedy());
    assert_eq!(p.validate(), Ok(()));
}

#[test]
fn validation_names_the_parameter() {
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("temperature", params(|p| p.temperature = -0.1)),
        ("temperature", params(|p| p.temperature = f32::NAN)),
        ("temperature", params(|p| p.temperature = f32::INFINITY)),
        ("top_p", params(|p| p.top_p = 0.0)),
        ("top_p", params(|p| p.top_p = 1.01)),
        ("top_p", params(|p| p.top_p = f32::NAN)),
        ("min_p", params(|p| p.min_p = -0.01)),
        ("min_p", params(|p| p.min_p = 1.5)),
        ("min_p", params(|p| p.min_p = f32::NAN)),
        ("repetition_penalty", params(|p| p.repetition_penalty = 0.0)),
        (
            "repetition_penalty",
            params(|p| p.repetition_penalty = -1.0),
        ),
        (
            "repetition_penalty",
            params(|p| p.repetition_penalty = f32::NAN),
        ),
        (
            "repetition_penalty",
            params(|p| p.repetition_penalty = f32::INFINITY),
        ),
        (
            "presence_penalty",
            params(|p| p.presence_penalty = f32::INFINITY),
        ),
        (
            "presence_penalty",
            params(|p| p.presence_penalty = f32::NAN),
        ),
        (
            "frequency_penalty",
            params(|p| p.frequency_penalty = f32::NEG_INFINITY),
        ),
        (
            "frequency_penalty",
            params(|p| p.frequency_penalty = f32::NAN),
        ),
    ];
    for (name, p) in cases {
        let err = p.validate().unwrap_err();
        assert!(
            matches!(&err, SamplingError::InvalidParam { param, .. } if *param == name),
            "{name}: {err:?}"
        );
        assert!(err.to_string().contains(name));
        assert_eq!(Sampler::new(p, 4).unwrap_err(), err);
    }
    let err = Sampler::new(SamplingParams::default(), 0).unwrap_err();
    assert!(matches!(
        err,
        SamplingError::InvalidParam {
            param: "vocab_size",
            ..
        }
    ));
    // Boundary values are accepted.
    let ok = params(|p| {
        p.top_p = 1.0;
        p.min_p = 1.0;
        p.temperature = 0.0;
        p.presence_penalty = -2.0;
        p.frequency_penalty = 2.0;
    });
    assert_eq!(ok.validate(), Ok(()));
}

#[test]
fn bad_lengths_and_ids_are_errors() {
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 1.5), 4).unwrap();
    assert_eq!(
        s.sample(&[0.0; 3]).unwrap_err(),
        SamplingError::LogitsLength {
            expected: 4,
            got: 3
        }
    );
    assert_eq!(
        s.add_prompt(&[1, 4]).unwrap_err(),
        SamplingError::TokenOutOfRange {
            id: 4,
            vocab_size: 4
        }
    );
    // Nothing was recorded by the failed call.
    let mut logits = [1.0f32; 4];
    s.apply_penalties(&mut logits).unwrap();
    assert_eq!(logits, [1.0; 4]);
    assert!(s.record_output(9).is_err());
    assert!(s.apply_penalties(&mut [0.0; 5]).is_err());
}

#[test]
fn greedy_is_argmax_with_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingParams::default(), 5).unwrap();
    let logits = [0.5, 3.0, -1.0, 3.0, 2.9];
    let t = s.sample(&logits).unwrap();
    assert_eq!(t.id, 1);
    let expected = log_softmax(&logits)[1];
    assert!((t.logprob as f64 - expected).abs() < 1e-6);

    let mut rng = Rng::seed_from_u64(11);
    let mut s = Sampler::new(SamplingParams::default(), 1000).unwrap();
    for _ in 0..20 {
        let logits: Vec<f32> = (0..1000).map(|_| rng.next_f64() as f32 * 10.0).collect();
        let argmax = (0..1000)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap();
        assert_eq!(s.sample(&logits).unwrap().id as usize, argmax);
    }
}

#[test]
fn top_k_one_is_greedy() {
    let mut rng = Rng::seed_from_u64(5);
    let mut s = Sampler::new(params(|p| p.top_k = 1), 500).unwrap();
    for _ in 0..50 {
        let logits: Vec<f32> = (0..500).map(|_| rng.next_f64() as f32).collect();
        let argmax = (0..500)
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
            .unwrap();
        let t = s.sample(&logits).unwrap();
        assert_eq!(t.id as usize, argmax);
        // Processed logprob is taken before truncation, so it is not 0.
        let expected = log_softmax(&logits)[argmax];
        assert!((t.logprob as f64 - expected).abs() < 1e-5);
    }
}

#[test]
fn seeded_sampling_is_deterministic_and_seed_dependent() {
    let logits = vec![0.0f32; 100];
    let run = |seed: Option<u64>| {
        let mut s = Sampler::new(params(|p| p.seed = seed), 100).unwrap();
        (0..50)
            .map(|_| s.sample(&logits).unwrap().id)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(Some(42)), run(Some(42)));
    assert_ne!(run(Some(42)), run(Some(43)));
    assert_ne!(run(None), run(None));
}

/// Pearson chi-square statistic of `counts` against `probs`.
fn chi_square(counts: &[usize], probs: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(probs)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

fn draw_counts(p: SamplingParams, logits: &[f32], draws: usize) -> Vec<usize> {
    let mut s = Sampler::new(p, logits.len()).unwrap();
    let mut counts = vec![0; logits.len()];
    for _ in 0..draws {
        counts[s.sample(logits).unwrap().id as usize] += 1;
    }
    counts
}

#[test]
fn temperature_one_matches_distribution() {
    let probs = [0.1, 0.2, 0.3, 0.4];
    let counts = draw_counts(params(|_| {}), &ln_probs(&probs), 40_000);
    // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
    let chi2 = chi_square(&counts, &probs);
    assert!(chi2 < 16.27, "chi2 = {chi2}, counts = {counts:?}");
}

#[test]
fn temperature_two_flattens_distribution() {
    let probs = [0.1, 0.2, 0.3, 0.4];
    let root: Vec<f64> = probs.iter().map(|p: &f64| p.sqrt()).collect();
    let z: f64 = root.iter().sum();
    let expected: Vec<f64> = root.iter().map(|r| r / z).collect();
    let counts = draw_counts(params(|p| p.temperature = 2.0), &ln_probs(&probs), 40_000);
    let chi2 = chi_square(&counts, &expected);
    assert!(chi2 < 16.27, "chi2 = {chi2}, counts = {counts:?}");
    // The untempered distribution is rejected by the same bound.
    assert!(chi_square(&counts, &probs) > 100.0);
}

#[test]
fn draws_across_chunks_match_distribution() {
    // Mass spread over several draw chunks; everything else is masked.
    let hot = [5u32, 1000, 1100, 2047, 2048, 2999];
    let probs = [0.05, 0.1, 0.15, 0.2, 0.25, 0.25];
    let mut logits = vec![f32::NEG_INFINITY; 3000];
    for (&id, &p) in hot.iter().zip(&probs) {
        logits[id as usize] = (p as f32).ln();
    }
    for edit in [
        (|_: &mut SamplingParams| {}) as fn(&mut SamplingParams),
        |p| p.min_p = 0.01,
        |p| p.top_p = 0.9999,
        |p| p.top_k = 10,
    ] {
        let p = params(edit);
        let counts = draw_counts(p.clone(), &logits, 40_000);
        let hot_counts: Vec<usize> = hot.iter().map(|&i| counts[i as usize]).collect();
        assert_eq!(hot_counts.iter().sum::<usize>(), 40_000, "{p:?}");
        // 5 degrees of freedom: P(chi2 > 20.52) = 0.001.
        let chi2 = chi_square(&hot_counts, &probs);
        assert!(
            chi2 < 20.52,
            "{p:?}: chi2 = {chi2}, counts = {hot_counts:?}"
        );
    }
}

#[test]
fn top_k_draws_follow_renormalised_distribution() {
    let probs = [0.1, 0.2, 0.3, 0.4];
    let counts = draw_counts(params(|p| p.top_k = 2), &ln_probs(&probs), 20_000);
    assert_eq!(&counts[..2], &[0, 0]);
    // 1 degree of freedom: P(chi2 > 10.83) = 0.001.
    let chi2 = chi_square(&counts[2..], &[3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi2 < 10.83, "chi2 = {chi2}, counts = {counts:?}");
}

#[test]
fn top_p_keeps_the_nucleus() {
    let logits = ln_probs(&[0.5, 0.2, 0.15, 0.1, 0.05]);
    let cases: [(f32, &[u32]); 4] = [
        (0.3, &[0]),
        (0.6, &[0, 1]),
        (0.8, &[0, 1, 2]),
        (0.9, &[0, 1, 2, 3]),
    ];
    for (top_p, expected) in cases {
        let mut s = Sampler::new(params(|p| p.top_p = top_p), 5).unwrap();
        assert_eq!(support(&mut s, &logits), expected, "top_p = {top_p}");
        for _ in 0..200 {
            assert!(expected.contains(&s.sample(&logits).unwrap().id));
        }
    }
    // At least one token survives even for a tiny top_p.
    let mut s = Sampler::new(params(|p| p.top_p = 1e-9), 5).unwrap();
    assert_eq!(support(&mut s, &logits), [0]);
}

#[test]
fn top_k_ties_keep_lowest_ids() {
    let logits = [1.0f32, 2.0, 1.0, 1.0, 1.0];
    let mut s = Sampler::new(params(|p| p.top_k = 3), 5).unwrap();
    assert_eq!(support(&mut s, &logits), [0, 1, 2]);
}

#[test]
fn top_p_renormalises_over_top_k() {
    let logits = ln_probs(&[0.4, 0.3, 0.2, 0.1]);
    let mut s = Sampler::new(params(|p| p.top_p = 0.55), 4).unwrap();
    assert_eq!(support(&mut s, &logits), [0, 1]);
    // Within the top 2, token 0 has 0.4 / 0.7 > 0.55 on its own.
    let mut s = Sampler::new(
        params(|p| {
            p.top_p = 0.55;
            p.top_k = 2;
        }),
        4,
    )
    .unwrap();
    assert_eq!(support(&mut s, &logits), [0]);
}

#[test]
fn min_p_drops_unlikely_tokens() {
    let logits = ln_probs(&[0.5, 0.3, 0.15, 0.05]);
    let cases: [(f32, usize, &[u32]); 5] = [
        (0.25, 0, &[0, 1, 2]),
        (0.5, 0, &[0, 1]),
        (1.0, 0, &[0]),
        (0.5, 3, &[0, 1]),
        (0.05, 0, &[0, 1, 2, 3]),
    ];
    for (min_p, top_k, expected) in cases {
        let mut s = Sampler::new(
            params(|p| {
                p.min_p = min_p;
                p.top_k = top_k;
            }),
            4,
        )
        .unwrap();
        assert_eq!(support(&mut s, &logits), expected, "min_p = {min_p}");
        for _ in 0..200 {
            assert!(expected.contains(&s.sample(&logits).unwrap().id));
        }
    }
}

#[test]
fn truncation_matches_full_sort_reference() {
    let mut rng = Rng::seed_from_u64(99);
    let vocab = 3000;
    let temps = [0.3, 0.7, 1.0, 1.5];
    let top_ks = [0, 0, 1, 5, 20, 46, 50, 2999, 5000];
    let top_ps = [1.0, 0.5, 0.9, 0.99, 0.999];
    let min_ps = [0.0, 0.0, 0.001, 0.1];
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    for case in 0..300 {
        let p = params(|p| {
            p.temperature = temps[pick(4)];
            p.top_k = top_ks[pick(9)];
            p.top_p = top_ps[pick(5)];
            p.min_p = min_ps[pick(4)];
        });
        // Half the cases have quantised logits (many ties); some logits
        // are masked or NaN.
        let scale = [0.5, 3.0, 10.0][pick(3)] as f32;
        let quantised = case % 2 == 0;
        let logits: Vec<f32> = (0..vocab)
            .map(|_| match pick(50) {
                0 => f32::NEG_INFINITY,
                1 => f32::NAN,
                _ if quantised => (pick(64) as f32 / 16.0 * scale).round() / 4.0,
                _ => pick(1 << 20) as f32 / (1 << 20) as f32 * scale,
            })
            .collect();
        let mut s = Sampler::new(p.clone(), vocab).unwrap();
        assert_eq!(
            support(&mut s, &logits),
            reference_support(&logits, &p),
            "case {case}: {p:?}"
        );
    }
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative() {
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 2.0), 6).unwrap();
    s.add_prompt(&[0, 1, 0]).unwrap();
    s.record_output(4).unwrap();
    s.record_output(0).unwrap();
    let mut logits = [2.0, -2.0, 1.0, 3.0, 0.0, -1.0];
    s.apply_penalties(&mut logits).unwrap();
    // Token 0 is penalised once despite three occurrences.
    assert_eq!(logits, [1.0, -4.0, 1.0, 3.0, 0.0, -1.0]);
}

#[test]
fn repetition_penalty_touches_exactly_the_seen_tokens() {
    let vocab = 300;
    let mut s = Sampler::new(params(|p| p.repetition_penalty = 4.0), vocab).unwrap();
    let prompt: Vec<u32> = (0..vocab as u32).filter(|i| i % 3 == 0).collect();
    s.add_prompt(&prompt).unwrap();
    for id in [1, 65, 299] {
        s.record_output(id).unwrap();
    }
    let mut logits = vec![2.0f32; vocab];
    s.apply_penalties(&mut logits).unwrap();
    for (i, &x) in logits.iter().enumerate() {
        let seen = i % 3 == 0 || [1, 65, 299].contains(&i);
        assert_eq!(x, if seen { 0.5 } else { 2.0 }, "token {i}");
    }
}

#[test]
fn presence_and_frequency_penalties_count_output_only() {
    let mut s = Sampler::new(
        params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        }),
        4,
    )
    .unwrap();
    s.add_prompt(&[0, 0]).unwrap();
    for id in [2, 2, 3] {
        s.record_output(id).unwrap();
    }
    let mut logits = [1.0f32; 4];
    s.apply_penalties(&mut logits).unwrap();
    assert_eq!(logits, [1.0, 1.0, 0.0, 0.25]);
}

#[test]
fn penalties_never_produce_nan_or_inf() {
    let mut s = Sampler::new(params(|p| p.frequency_penalty = -f32::MAX), 3).unwrap();
    s.record_output(0).unwrap();
    s.record_output(0).unwrap();
    s.record_output(1).unwrap();
    let mut logits = [1.0, f32::NEG_INFINITY, 0.0];
    s.apply_penalties(&mut logits).unwrap();
    assert_eq!(logits, [f32::MAX, f32::NEG_INFINITY, 0.0]);
}

#[test]
fn only_recorded_outputs_are_penalised() {
    let mut s = Sampler::new(
        SamplingParams {
            presence_penalty: 10.0,
            ..SamplingParams::default()
        },
        2,
    )
    .unwrap();
    let logits = [1.0, 0.9];
    // Sampling alone records nothing.
    assert_eq!(s.sample(&logits).unwrap().id, 0);
    assert_eq!(s.sample(&logits).unwrap().id, 0);
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = s.sample(&logits).unwrap().id;
        s.record_output(id).unwrap();
        ids.push(id);
    }
    // 0, then 1 (0 is penalised), then 0 again (both penalised once).
    assert_eq!(ids, [0, 1, 0]);
}

#[test]
fn logprob_is_after_temperature_before_truncation() {
    let logits = [0.1f32, 1.0, -0.5, 2.0];
    let scaled: Vec<f32> = logits.iter().map(|x| x / 2.0).collect();
    let expected = log_softmax(&scaled);
    let mut s = Sampler::new(
        params(|p| {
            p.temperature = 2.0;
            p.top_k = 3;
        }),
        4,
    )
    .unwrap();
    for _ in 0..50 {
        let t = s.sample(&logits).unwrap();
        assert_ne!(t.id, 2);
        assert!((t.logprob as f64 - expected[t.id as usize]).abs() < 1e-6);
    }
}

#[test]
fn nan_and_infinite_logits() {
    for temperature in [0.0, 1.0] {
        let mut s = Sampler::new(params(|p| p.temperature = temperature), 3).unwrap();
        let t = s.sample(&[f32::NAN, 1.0, f32::NAN]).unwrap();
        assert_eq!((t.id, t.logprob), (1, 0.0));
        let t = s.sample(&[0.0, f32::INFINITY, 5.0]).unwrap();
        assert_eq!((t.id, t.logprob), (1, 0.0));
        for bad in [[f32::NAN; 3], [f32::NEG_INFINITY; 3]] {
            assert_eq!(s.sample(&bad).unwrap_err(), SamplingError::NoValidLogits);
        }
    }
    let mut s = Sampler::new(params(|_| {}), 3).unwrap();
    for _ in 0..20 {
        let t = s.sample(&[f32::INFINITY, 0.0, f32::INFINITY]).unwrap();
        assert!(t.id == 0 || t.id == 2);
        assert!((t.logprob - 0.5f32.ln()).abs() < 1e-6);
    }
}

#[test]
fn tiny_temperature_approaches_greedy() {
    let mut s = Sampler::new(params(|p| p.temperature = 1e-30), 3).unwrap();
    for _ in 0..50 {
        assert_eq!(s.sample(&[1.0, 2.0, 1.5]).unwrap().id, 1);
    }
}

#[test]
fn buffers_are_reused_between_steps() {
    let vocab = 5000;
    let mut rng = Rng::seed_from_u64(8);
    let mut logits = vec![0.0f32; vocab];
    let mut s = Sampler::new(
        params(|p| {
            p.top_k = 40;
            p.top_p = 0.95;
        }),
        vocab,
    )
    .unwrap();
    let mut fill = |l: &mut Vec<f32>| l.iter_mut().for_each(|x| *x = rng.next_f64() as f32);
    fill(&mut logits);
    s.sample(&logits).unwrap();
    let ptrs = |s: &Sampler| (s.work.as_ptr(), s.weights.as_ptr(), s.idx.as_ptr());
    let before = ptrs(&s);
    for _ in 0..20 {
        fill(&mut logits);
        s.sample(&logits).unwrap();
    }
    assert_eq!(ptrs(&s), before);
}

#[test]
fn top_logprobs_from_raw_log_softmax() {
    let logits = [1.0, 3.0, 2.0, f32::NAN, 3.0];
    let lp = log_softmax(&[1.0, 3.0, 2.0, f32::NEG_INFINITY, 3.0]);
    let top = top_logprobs(&logits, 3);
    let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
    assert_eq!(ids, [1, 4, 2]);
    for (id, l) in &top {
        assert!((*l as f64 - lp[*id as usize]).abs() < 1e-6);
    }
    // NaN is left out even when more entries are asked for.
    let all: Vec<u32> = top_logprobs(&logits, 10).iter().map(|t| t.0).collect();
    assert_eq!(all, [1, 4, 2, 0]);
    assert!(top_logprobs(&logits, 0).is_empty());
    assert!(top_logprobs(&[f32::NAN; 4], 2).is_empty());
}

#[test]
fn token_logprobs_match_an_f64_log_softmax() {
    let mut rng = Rng::seed_from_u64(5);
    for vocab in [1usize, 7, 255, 256, 257, 1000, 4099] {
        let mut logits: Vec<f32> = (0..vocab)
            .map(|_| (rng.next_f64() as f32 - 0.5) * 40.0)
            .collect();
        if vocab > 10 {
            logits[3] = f32::NEG_INFINITY;
            logits[5] = f32::NAN;
            logits[8] = logits[9]; // a tie: the lower id comes first
        }
        let nan_free: Vec<f32> = logits.iter().map(|&x| sanitize(x)).collect();
        let lp = log_softmax(&nan_free);
        for n in [0usize, 1, 5, 20] {
            let id = (vocab / 2) as u32;
            let t = token_logprobs(&logits, id, n).unwrap();
            assert_eq!(t.id, id);
            assert!(
                (t.logprob as f64 - lp[id as usize]).abs() < 1e-5,
                "{vocab} {n}"
            );
            // The reference order: finite entries by value, then id.
            let mut order: Vec<u32> = (0..vocab as u32)
                .filter(|&i| lp[i as usize] > f64::NEG_INFINITY)
                .collect();
            order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
            let ids: Vec<u32> = t.top.iter().map(|e| e.0).collect();
            assert_eq!(ids, order[..n.min(order.len())], "{vocab} {n}");
            for (i, l) in &t.top {
                assert!((*l as f64 - lp[*i as usize]).abs() < 1e-5);
            }
            assert_eq!(top_logprobs(&logits, n), t.top);
        }
    }
    // Huge and +inf logits give finite values (+inf counts as f32::MAX).
    let t = token_logprobs(&[3.0e38, 3.0e38 - 1.0e32, f32::INFINITY], 0, 2).unwrap();
    assert_eq!(t.top[0].0, 2);
    assert!(t.logprob.is_finite());
    assert!(token_logprobs(&[1.0, 2.0], 2, 1).is_none());
    assert!(token_logprobs(&[f32::NAN, f32::NEG_INFINITY], 0, 1).is_none());
}

#[test]
fn prompt_token_logprobs_rank_and_top_follow_the_raw_log_softmax() {
    let mut rng = Rng::seed_from_u64(9);
    let mut logits: Vec<f32> = (0..1000)
        .map(|_| (rng.next_f64() as f32 - 0.5) * 30.0)
        .collect();
    logits[7] = f32::NAN;
    logits[11] = logits[12];
    let lp = log_softmax(&logits.iter().map(|&x| sanitize(x)).collect::<Vec<_>>());
    for id in [0u32, 7, 11, 12, 500, 999] {
        let t = prompt_token_logprobs(&logits, id, 4);
        assert_eq!(t.id, id);
        if id == 7 {
            assert_eq!(t.logprob, f32::NEG_INFINITY);
        } else {
            assert!((t.logprob as f64 - lp[id as usize]).abs() < 1e-5, "{id}");
        }
        let above = lp.iter().filter(|&&l| l > lp[id as usize]).count();
        assert_eq!(t.rank as usize, above + 1, "{id}");
        // The same alternatives as a generated token's.
        assert_eq!(t.top, token_logprobs(&logits, id, 4).unwrap().top);
    }
    // Ties share a rank; the most likely token is rank 1.
    assert_eq!(
        prompt_token_logprobs(&logits, 11, 0).rank,
        prompt_token_logprobs(&logits, 12, 0).rank
    );
    let best = top_logprobs(&logits, 1)[0].0;
    assert_eq!(prompt_token_logprobs(&logits, best, 0).rank, 1);
    // No usable logit: -inf, no alternatives; more alternatives than tokens: all of them.
    let none = prompt_token_logprobs(&[f32::NAN, f32::NEG_INFINITY], 1, 3);
    assert_eq!(none.logprob, f32::NEG_INFINITY);
    assert!(none.top.is_empty());
    assert_eq!(
        prompt_token_logprobs(&[1.0, 2.0], 0, usize::MAX).top.len(),
        2
    );
}

#[test]
fn verified_drafts_leave_the_distribution_as_sampling_gives_it() {
    // Six tokens; top-k 4 at temperature 0.8: the target is the softmax of the four largest
    // logits / 0.8. Drafts: the likeliest token, a middling one, and one outside the top 4.
    let logits = [1.0f32, 2.5, -0.5, 0.3, 1.7, 0.9];
    let p = params(|p| {
        p.temperature = 0.8;
        p.top_k = 4;
        p.seed = Some(7);
    });
    let kept = [0usize, 1, 4, 5];
    let z: f64 = kept.iter().map(|&i| (logits[i] as f64 / 0.8).exp()).sum();
    let target: Vec<f64> = (0..6)
        .map(|i| {
            if kept.contains(&i) {
                (logits[i] as f64 / 0.8).exp() / z
            } else {
                0.0
            }
        })
        .collect();
    // Min-p only (no sorting path), all six tokens kept.
    let q = params(|p| {
        p.temperature = 1.3;
        p.seed = Some(9);
    });
    let z_all: f64 = logits.iter().map(|&x| (x as f64 / 1.3).exp()).sum();
    let all: Vec<f64> = logits
        .iter()
        .map(|&x| (x as f64 / 1.3).exp() / z_all)
        .collect();
    for (params, target) in [(p, target), (q, all)] {
        for draft in [1u32, 5, 2] {
            let mut s = Sampler::new(params.clone(), 6).unwrap();
            let (mut counts, mut accepted) = ([0usize; 6], 0);
            let n = 40_000;
            for _ in 0..n {
                let tok = match s.verify(&logits, draft).unwrap() {
                    Verdict::Accepted(t) => {
                        accepted += 1;
                        assert_eq!(t.id, draft);
                        t
                    }
                    Verdict::Replaced(t) => {
                        assert_ne!(t.id, draft);
                        t
                    }
                };
                counts[tok.id as usize] += 1;
            }
            // Tokens of probability 0 never come out; over the rest (5 degrees of freedom at
            // most), 30 is past the 1e-5 tail.
            let (mut c, mut t) = (Vec::new(), Vec::new());
            for (&n, &q) in counts.iter().zip(&target) {
                if q == 0.0 {
                    assert_eq!(n, 0, "draft {draft}: a token of probability 0 came out");
                } else {
                    c.push(n);
                    t.push(q);
                }
            }
            let chi = chi_square(&c, &t);
            assert!(
                chi < 30.0,
                "draft {draft}: chi-square {chi}, counts {counts:?}"
            );
            // The draft is taken as often as the target picks it.
            let rate = accepted as f64 / n as f64;
            let want = target[draft as usize];
            assert!(
                (rate - want).abs() < 4.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-9,
                "draft {draft}: accepted {rate}, target {want}"
            );
        }
    }
}

#[test]
fn a_greedy_draft_stands_iff_it_is_the_argmax() {
    let logits = [0.5f32, 3.0, 3.0, -1.0];
    let mut s = Sampler::new(params(|p| p.temperature = 0.0), 4).unwrap();
    // Ties go to the lowest id, as sample gives them.
    assert!(matches!(s.verify(&logits, 1).unwrap(), Verdict::Accepted(t) if t.id == 1));
    assert!(matches!(s.verify(&logits, 2).unwrap(), Verdict::Replaced(t) if t.id == 1));
    assert!(matches!(s.verify(&logits, 0).unwrap(), Verdict::Replaced(t) if t.id == 1));
    assert!(
        s.verify(&logits, 9).is_err(),
        "a draft outside the vocabulary"
    );
}

/// The logit bias is added to each listed token's logit before the penalties: it moves the
/// greedy pick (-100 bans the top token, +100 forces a low one), shifts the processed
/// logprob by exactly the bias, and turns off the backend's own greedy pick; biases out of
/// [-100, 100], twice on one token or on a token outside the vocabulary are errors.
#[test]
fn logit_bias_moves_picks_and_is_checked() {
    let logits = [1.0f32, 3.0, 2.0, -1.0];
    let greedy = |bias: Vec<(u32, f32)>| {
        let p = params(|p| {
            p.temperature = 0.0;
            p.logit_bias = bias;
        });
        Sampler::new(p, logits.len()).unwrap()
    };
    assert_eq!(greedy(vec![]).sample(&logits).unwrap().id, 1);
    assert!(greedy(vec![]).is_plain_argmax());
    let mut banned = greedy(vec![(1, -100.0)]);
    assert!(!banned.is_plain_argmax());
    assert_eq!(banned.sample(&logits).unwrap().id, 2);
    assert_eq!(greedy(vec![(3, 100.0)]).sample(&logits).unwrap().id, 3);
    // The processed logits are the biased ones: the logprob is their log-softmax.
    let biased = [1.0f32, 3.0, 2.5, -1.0];
    let got = greedy(vec![(2, 0.5)]).sample(&logits).unwrap();
    assert_eq!(got.id, 1);
    assert!((got.logprob as f64 - log_softmax(&biased)[1]).abs() < 1e-6);
    // Sampled: a token biased by +100 is drawn every time, one by -100 never.
    let mut s = Sampler::new(params(|p| p.logit_bias = vec![(0, 100.0)]), 4).unwrap();
    assert!((0..50).all(|_| s.sample(&logits).unwrap().id == 0));
    let mut s = Sampler::new(params(|p| p.logit_bias = vec![(1, -100.0)]), 4).unwrap();
    assert!((0..200).all(|_| s.sample(&logits).unwrap().id != 1));
    for (bias, needle) in [
        (vec![(0, 100.5)], "not in [-100, 100]"),
        (vec![(0, f32::NAN)], "not in [-100, 100]"),
        (vec![(2, 1.0), (2, -1.0)], "biased twice"),
        (vec![(4, 1.0)], "outside the vocabulary"),
    ] {
        let e = Sampler::new(params(|p| p.logit_bias = bias), 4).unwrap_err();
        assert!(matches!(
            e,
            SamplingError::InvalidParam {
                param: "logit_bias",
                ..
            }
        ));
        assert!(e.to_string().contains(needle), "{e}");
    }
    // A huge map is checked in linear time (it ran on the server's threads in quadratic time:
    // seconds a request at 10^5 entries); its duplicate, last, still found.
    let mut huge: Vec<(u32, f32)> = (0..300_000).map(|i| (i, 1.0)).collect();
    let t = std::time::Instant::now();
    assert!(params(|p| p.logit_bias = huge.clone()).validate().is_ok());
    huge.push((123_456, -1.0));
    let e = params(|p| p.logit_bias = huge).validate().unwrap_err();
    assert!(e.to_string().contains("biased twice"), "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
}
