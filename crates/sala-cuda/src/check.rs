//! The kernel check CI runs without a GPU (`scripts/check-kernels.sh`): what ptxas made of
//! every kernel for every supported architecture (registers, static shared memory, spills),
//! and, for every card of [`CARDS`], each kernel's launch plans from that card's limits
//! checked against them.

use crate::device::{target_for, Card, DeviceLimits, SUPPORTED};
use crate::kernels::K;
use crate::options::CudaOptions;
use crate::plan::{CheckShape, KernelAttrs, Launch, Planner};
use sala_checkpoint::SparseConfig;
use sala_model::AttnShape;
use std::collections::BTreeMap;

/// ptxas's report of one function.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PtxasFunction {
    pub regs: u32,
    pub static_smem: usize,
    pub stack: usize,
    pub spill_stores: usize,
    pub spill_loads: usize,
}

/// The functions of `ptxas -v` output (stderr), by name (entries and called functions).
pub fn parse_ptxas(log: &str) -> BTreeMap<String, PtxasFunction> {
    let mut out: BTreeMap<String, PtxasFunction> = BTreeMap::new();
    let mut entry: Option<String> = None;
    let mut props: Option<String> = None;
    let quoted = |l: &str| l.split('\'').nth(1).map(str::to_string);
    let number_before = |l: &str, unit: &str| -> Option<usize> {
        let at = l.find(unit)?;
        l[..at].split_whitespace().last()?.parse().ok()
    };
    for line in log.lines() {
        if line.contains("Compiling entry function") {
            entry = quoted(line);
        } else if let Some(name) = line.split("Function properties for ").nth(1) {
            props = Some(name.trim().to_string());
        } else if line.contains("stack frame") {
            if let Some(name) = props.take() {
                let f = out.entry(name).or_default();
                f.stack = number_before(line, "bytes stack frame").unwrap_or(0);
                f.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                f.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            }
        } else if line.contains("Used") && line.contains("registers") {
            if let Some(name) = &entry {
                let f = out.entry(name.clone()).or_default();
                f.regs = number_before(line, "registers").unwrap_or(0) as u32;
                f.static_smem = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// The SASS architecture ptxas builds for capability `cc` (`sm_90a` on Hopper).
pub fn sass_arch(cc: (u32, u32)) -> String {
    target_for(cc).replace("compute_", "sm_")
}

/// Most threads a block of `regs`-register threads may have (64K registers a block, allocated
/// per warp in units of 256).
pub fn max_threads_for(regs: u32) -> u32 {
    let per_warp = (regs.max(1) * 32).div_ceil(256) * 256;
    ((65536 / per_warp) * 32).min(1024)
}

/// The shapes checked: the released model, the presets' and the parity tests' small shapes.
pub fn check_shapes() -> Vec<CheckShape> {
    let released = SparseConfig::default();
    let small = SparseConfig {
        kernel_size: 8,
        kernel_stride: 4,
        block_size: 16,
        init_blocks: 1,
        window_size: 32,
        topk: 4,
        use_nope: false,
        dense_len: 96,
        ..SparseConfig::default()
    };
    let shape = |heads, kv_heads, head_dim| AttnShape {
        heads,
        kv_heads,
        head_dim,
    };
    vec![
        CheckShape {
            attn: shape(32, 2, 128),
            sparse: released.clone(),
            lightning_heads: 32,
            lightning_d: 128,
        },
        CheckShape {
            attn: shape(8, 1, 64),
            sparse: released,
            lightning_heads: 4,
            lightning_d: 64,
        },
        CheckShape {
            attn: shape(4, 2, 32),
            sparse: small,
            lightning_heads: 4,
            lightning_d: 32,
        },
    ]
}

/// The option sets whose plans are checked: the defaults and each slower variant.
pub fn check_options() -> Vec<(&'static str, CudaOptions)> {
    let mut out = vec![("default", CudaOptions::default())];
    for name in ["lightning-split", "lightning", "attention", "select"] {
        let mut o = CudaOptions::default();
        o.apply_fallbacks(name).expect("a known name");
        out.push((name, o));
    }
    out.push((
        "gather-keys-32",
        CudaOptions {
            gather_keys: 32,
            ..CudaOptions::default()
        },
    ));
    out
}

/// One (card, kernel) verdict.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub card: &'static str,
    pub kernel: &'static str,
    pub arch: String,
    pub line: String,
    pub ok: bool,
}

/// Checks every kernel's worst launch on `card` under every option set: static + dynamic
/// shared memory within the card's opt-in limit, threads within what its registers allow,
/// at least one block per SM, and spills (of kernels and of the functions they call) no more
/// than `baseline` (function → bytes of spill stores + loads; one not in it may not spill).
pub fn check_card(
    card: &'static Card,
    ptxas: &BTreeMap<String, PtxasFunction>,
    baseline: &BTreeMap<String, usize>,
) -> Vec<Verdict> {
    let limits = DeviceLimits::of_card(card);
    let arch = sass_arch(card.cc);
    let attrs: Vec<KernelAttrs> = K::ALL
        .iter()
        .map(|k| {
            let f = ptxas.get(k.name()).copied().unwrap_or_default();
            KernelAttrs {
                regs: f.regs,
                static_smem: f.static_smem,
                local_bytes: f.stack,
                max_threads: max_threads_for(f.regs),
            }
        })
        .collect();
    // The largest dynamic shared memory and block each kernel is launched with.
    let mut worst: BTreeMap<usize, (Launch, String)> = BTreeMap::new();
    let shapes = check_shapes();
    for (opt_name, options) in check_options() {
        let planner = Planner::new(limits.clone(), options, attrs.clone());
        for (k, l, what) in planner.check_launches(&shapes) {
            let e = worst
                .entry(k as usize)
                .or_insert((l, format!("{opt_name}: {what}")));
            if (l.smem, l.block) > (e.0.smem, e.0.block) {
                *e = (l, format!("{opt_name}: {what}"));
            }
        }
    }
    // Device functions the kernels call (not inlined) may not spill more than today either.
    let callees = ptxas
        .iter()
        .filter(|(name, _)| !K::ALL.iter().any(|k| k.name() == name.as_str()))
        .map(|(name, f)| {
            let spill = f.spill_stores + f.spill_loads;
            let allowed = baseline.get(name).copied().unwrap_or(0);
            Verdict {
                card: card.key,
                kernel: "(called function)",
                arch: arch.clone(),
                line: format!("{name}: spills {spill} B (today {allowed} B)"),
                ok: spill <= allowed,
            }
        });
    let callees: Vec<Verdict> = callees.collect();
    let kernels = K::ALL
        .iter()
        .map(|&k| {
            let a = attrs[k as usize];
            let f = ptxas.get(k.name());
            let spill = f.map_or(0, |f| f.spill_stores + f.spill_loads);
            let allowed = baseline.get(k.name()).copied().unwrap_or(0);
            let mut problems = Vec::new();
            if f.is_none() {
                problems.push(format!("not in ptxas's {arch} output"));
            }
            if spill > allowed {
                problems.push(format!("spills {spill} B (today {allowed} B)"));
            }
            let line = match worst.get(&(k as usize)) {
                None => format!("{} regs, {} B static shared; not launched on this card", a.regs, a.static_smem),
                Some((l, what)) => {
                    let smem = a.static_smem + l.smem as usize;
                    problems.extend(launch_problems(&limits, a, l));
                    let per_sm = limits.blocks_per_sm(l.block, a.regs, smem);
                    format!(
                        "block {:4}, shared {:6} + {:6} of {:6} B, {:3} regs, {:2} blocks/SM, spills {spill} B ({what})",
                        l.block, a.static_smem, l.smem, limits.smem_per_block_optin, a.regs, per_sm
                    )
                }
            };
            let ok = problems.is_empty();
            let line = if ok {
                line
            } else {
                format!("{line}: {}", problems.join("; "))
            };
            Verdict {
                card: card.key,
                kernel: k.name(),
                arch: arch.clone(),
                line,
                ok,
            }
        });
    kernels.chain(callees).collect()
}

/// What keeps `l` from running on a device of `limits` for a kernel compiled as `a`: shared
/// memory (static + dynamic) past the opt-in limit, static past 48 KiB, more threads than its
/// registers allow, no block fitting on an SM.
pub fn launch_problems(limits: &DeviceLimits, a: KernelAttrs, l: &Launch) -> Vec<String> {
    let mut problems = Vec::new();
    let smem = a.static_smem + l.smem as usize;
    if smem > limits.smem_per_block_optin {
        problems.push(format!(
            "{smem} B of shared memory (static {} + dynamic {}) > {} B",
            a.static_smem, l.smem, limits.smem_per_block_optin
        ));
    }
    if a.static_smem > 48 << 10 {
        problems.push(format!(
            "{} B of static shared memory > 48 KiB",
            a.static_smem
        ));
    }
    if l.block > a.max_threads {
        problems.push(format!(
            "{} threads > {} ({} registers each)",
            l.block, a.max_threads, a.regs
        ));
    }
    if limits.blocks_per_sm(l.block, a.regs, smem) == 0 {
        problems.push("no block fits on an SM".into());
    }
    problems
}

/// The architectures to build for: one per supported capability.
pub fn archs() -> Vec<((u32, u32), String, String)> {
    SUPPORTED
        .iter()
        .map(|&cc| (cc, target_for(cc), sass_arch(cc)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{card_named, CARDS};

    const LOG: &str = "ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'lightning_ranges' for 'sm_120'
ptxas info    : Function properties for lightning_ranges
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'embed' for 'sm_120'
ptxas info    : Function properties for embed
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers, 380 bytes cmem[0]
";

    #[test]
    fn ptxas_reports_parse() {
        let f = parse_ptxas(LOG);
        let l = f["lightning_ranges"];
        assert_eq!(
            (l.regs, l.static_smem, l.spill_stores, l.spill_loads),
            (128, 1024, 8, 4)
        );
        assert_eq!(f["embed"].regs, 16);
        assert_eq!(f["embed"].static_smem, 0);
        assert_eq!(max_threads_for(128), 512);
        assert_eq!(max_threads_for(64), 1024);
        assert_eq!(max_threads_for(255), 256);
    }

    /// Reports for every kernel (few registers, no shared memory) plus overrides.
    fn reports(over: &[(&str, PtxasFunction)]) -> BTreeMap<String, PtxasFunction> {
        let mut m: BTreeMap<String, PtxasFunction> = K::ALL
            .iter()
            .map(|k| {
                let f = PtxasFunction {
                    regs: 32,
                    ..Default::default()
                };
                (k.name().to_string(), f)
            })
            .collect();
        for (n, f) in over {
            m.insert(n.to_string(), *f);
        }
        m
    }

    /// The tensor-core GEMVs' sum groups: a power of two up to 16, the same whatever the row
    /// count (the planner takes no rows), the split product's blocks all fit the SMs at once
    /// and its sums at 64 rows fit their budget, and twice the groups would break one of the
    /// two; the released shape's output product splits (and on the H200 its q/k/v/z), its
    /// [gate; up] does not.
    #[test]
    fn gemv_groups_are_the_most_that_fit() {
        use crate::plan::{GEMV_CHAIN_SUMS_BYTES, GEMV_ROWS64_THREADS, GEMV_ROWS64_TILES};
        let attrs = vec![
            KernelAttrs {
                regs: 128,
                max_threads: 512,
                static_smem: 32 << 10,
                ..Default::default()
            };
            K::ALL.len()
        ];
        for key in ["h200", "rtx5090", "a100"] {
            let limits = DeviceLimits::of_card(card_named(key).unwrap());
            let planner = Planner::new(limits.clone(), CudaOptions::default(), attrs.clone());
            let per_sm = limits
                .blocks_per_sm(GEMV_ROWS64_THREADS, 128, 32 << 10)
                .max(1) as usize;
            let slots = per_sm * limits.sms as usize;
            for silu in [false, true] {
                for rows in [72usize, 1000, 4096, 8704, 16384, 32768, 73448] {
                    let g = planner.gemv_groups(silu, rows);
                    let blocks = if silu {
                        (rows / 2).div_ceil(8 * GEMV_ROWS64_TILES)
                    } else {
                        rows.div_ceil(16 * GEMV_ROWS64_TILES)
                    };
                    let fits = |p: usize| {
                        blocks * p <= slots
                            && Planner::chain_sums_len(p, blocks, 64) * 4 <= GEMV_CHAIN_SUMS_BYTES
                    };
                    let ctx = format!("{key}, {rows} rows, silu {silu}: {g} groups");
                    assert!(g.is_power_of_two() && g <= 16, "{ctx}");
                    assert!(g == 1 || fits(g), "{ctx}");
                    assert!(g == 16 || !fits(2 * g), "{ctx}: twice as many would fit");
                }
            }
            assert!(
                planner.gemv_groups(false, 4096) > 1,
                "{key}: the output product whole"
            );
            assert_eq!(
                planner.gemv_groups(true, 32768),
                1,
                "{key}: [gate; up] split"
            );
            if key == "h200" {
                // 256 blocks in two parts fill 512 of its 528 slots.
                assert_eq!(planner.gemv_groups(false, 16384), 2, "{key}: q/k/v/z");
            }
        }
    }

    /// Prefill selection launches: every split keeps its block scores within the scratch, no
    /// split of the queries into launches takes fewer waves of blocks (a brute force over
    /// every size), and past 512K on the H200 each launch is one wave (640K: 4 launches of
    /// 2,048 queries, not 3 of 2,736, whose extra 78 blocks make a second wave each).
    #[test]
    fn selection_launches_take_the_fewest_waves() {
        let attrs = vec![
            KernelAttrs {
                regs: 127,
                max_threads: 256,
                ..Default::default()
            };
            K::ALL.len()
        ];
        let cfg = SparseConfig::default();
        for key in ["h200", "rtx5090", "a100"] {
            let limits = DeviceLimits::of_card(card_named(key).unwrap());
            let planner = Planner::new(limits.clone(), CudaOptions::default(), attrs.clone());
            for kernel in [K::SelectScoresWg, K::SelectScoresT] {
                let launch = planner.select_scores(kernel, 16, 1);
                let per_sm = limits.blocks_per_sm(256, 127, launch.smem as usize).max(1) as usize;
                let slots = per_sm * limits.sms as usize;
                for len in [
                    100_000usize,
                    300 << 10,
                    512 << 10,
                    640 << 10,
                    900_000,
                    1 << 20,
                    4 << 20,
                ] {
                    for rows in [1usize, 17, 5000, 8192] {
                        let kvh = 2;
                        let stride = len.div_ceil(cfg.block_size);
                        let fits =
                            |q: usize| q * kvh * stride * 2 <= crate::plan::SELECT_SCORES_BYTES;
                        // Waves of the launches that cover `rows` in turn, `per` at a time.
                        let waves = |per: usize| {
                            let mut total = 0;
                            let mut left = rows;
                            while left > 0 {
                                let n = per.min(left);
                                total += (n.div_ceil(16) * kvh).div_ceil(slots);
                                left -= n;
                            }
                            total
                        };
                        let per = planner.select_group(kernel, kvh, len, rows, &cfg);
                        let what = format!("{key} {kernel:?} {rows} rows at {len}");
                        assert!(per >= 1 && per <= rows, "{what}: {per}");
                        assert!(fits(per) || per == 16, "{what}: {per} queries overflow");
                        if per < rows {
                            assert_eq!(per % 16, 0, "{what}: {per}");
                        }
                        let fewest = (1..=rows)
                            .filter(|&q| q == rows || q % 16 == 0)
                            .filter(|&q| fits(q) || q == 16)
                            .map(&waves)
                            .min()
                            .unwrap();
                        assert_eq!(waves(per), fewest, "{what}: {per} queries a launch");
                        if key == "h200"
                            && kernel == K::SelectScoresWg
                            && rows == 8192
                            && len > 512 << 10
                        {
                            assert!(per.div_ceil(16) * kvh <= slots, "{what}: {per}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn plans_fit_every_card_and_a_kernel_past_a_limit_fails() {
        let clean = reports(&[]);
        for card in CARDS {
            let v = check_card(card, &clean, &BTreeMap::new());
            let bad: Vec<_> = v.iter().filter(|v| !v.ok).map(|v| &v.line).collect();
            assert!(bad.is_empty(), "{}: {bad:?}", card.key);
        }
        // lightning_ranges double-buffered (~112 KiB) does not fit a 99 KiB card, and the plan
        // picks the single-buffered variant there.
        let rtx = DeviceLimits::of_card(card_named("rtx5090").unwrap());
        let lf = KernelAttrs {
            regs: 128,
            max_threads: 512,
            ..Default::default()
        };
        let double = Launch::new((32, 8, 1), 256, crate::plan::lightning_ranges_smem(128, 2));
        let p = launch_problems(&rtx, lf, &double);
        assert!(
            p[0].contains("shared memory") && p[1].contains("no block"),
            "{p:?}"
        );
        let attrs = vec![lf; K::ALL.len()];
        let planner = Planner::new(rtx.clone(), CudaOptions::default(), attrs.clone());
        assert_eq!(planner.lightning_ranges_buffers(128), Some(1));
        // A lightning call's ranges cover its tokens in whole chunks, at most as many as the
        // scratch holds sums of (32 at 32 heads of 128).
        for t in [2usize, 64, 65, 300, 8192, 9001, 65536] {
            let (n, len) = planner.lightning_range_split(t, 32, 128);
            assert!(
                len % 64 == 0 && n * len >= t && (n - 1) * len < t && n <= 32,
                "{t} tokens: {n} ranges of {len}"
            );
        }
        assert_eq!(planner.lightning_range_split(8192, 32, 128), (8, 1024));
        assert_eq!(planner.lightning_range_split(65536, 32, 128), (32, 2048));
        let h200 = DeviceLimits::of_card(card_named("h200").unwrap());
        assert!(launch_problems(&h200, lf, &double).is_empty());
        assert_eq!(
            Planner::new(h200, CudaOptions::default(), attrs).lightning_ranges_buffers(128),
            Some(2)
        );
        // Too many registers for a 1024-thread block, and spills beyond the baseline.
        let greedy = PtxasFunction {
            regs: 96,
            spill_stores: 16,
            ..Default::default()
        };
        let r = reports(&[("sd_topk", greedy)]);
        let v = check_card(card_named("a100").unwrap(), &r, &BTreeMap::new());
        let topk = v.iter().find(|v| v.kernel == "sd_topk").unwrap();
        assert!(
            !topk.ok && topk.line.contains("threads") && topk.line.contains("spills"),
            "{}",
            topk.line
        );
        let allowed = BTreeMap::from([("sd_topk".to_string(), 16)]);
        let r = reports(&[(
            "sd_topk",
            PtxasFunction {
                spill_stores: 16,
                regs: 32,
                ..Default::default()
            },
        )]);
        let v = check_card(card_named("a100").unwrap(), &r, &allowed);
        assert!(v.iter().all(|v| v.ok));
    }
}
