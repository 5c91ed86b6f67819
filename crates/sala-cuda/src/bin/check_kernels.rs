//! `scripts/check-kernels.sh`: compiles every kernel file with NVRTC for every supported
//! architecture, assembles it with ptxas (registers, shared memory, spills), then checks each
//! card's launch plans against that card's limits. One line per (card, kernel), then
//! `N passed, N failed`; exit status 1 when any failed.
//!
//! Usage: check_kernels --ptxas PATH [--baseline FILE] [--write-baseline]

use sala_cuda::check::{archs, check_card, parse_ptxas, PtxasFunction};
use sala_cuda::{sources, CARDS};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
}

/// ptxas's reports for one architecture: every file's PTX assembled.
fn assemble(
    ptxas: &Path,
    target: &str,
    arch: &str,
    dir: &Path,
) -> Result<BTreeMap<String, PtxasFunction>, String> {
    let results: Vec<Result<String, String>> = std::thread::scope(|s| {
        let jobs: Vec<_> = sources::FILES
            .iter()
            .map(|(file, _)| {
                s.spawn(move || {
                    let ptx = sources::compile(file, target)?;
                    let path = dir.join(format!("{}-{}.ptx", file.replace('/', "_"), arch));
                    std::fs::write(&path, ptx).map_err(|e| format!("{}: {e}", path.display()))?;
                    let out = Command::new(ptxas)
                        .args([
                            "-v",
                            "--warn-on-spills",
                            &format!("-arch={arch}"),
                            "-o",
                            "/dev/null",
                        ])
                        .arg(&path)
                        .output()
                        .map_err(|e| format!("running {}: {e}", ptxas.display()))?;
                    let log = String::from_utf8_lossy(&out.stderr).into_owned();
                    if !out.status.success() {
                        return Err(format!("ptxas failed on {file} for {arch}:\n{log}"));
                    }
                    Ok(log)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err("a compile thread panicked".into()))
            })
            .collect()
    });
    let mut all = BTreeMap::new();
    for r in results {
        all.extend(parse_ptxas(&r?));
    }
    Ok(all)
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let ptxas = PathBuf::from(value("--ptxas").ok_or("--ptxas PATH is required")?);
    let baseline_path = value("--baseline").map(PathBuf::from);
    let write = args.iter().any(|a| a == "--write-baseline");
    sala_cuda::libs::ensure_nvrtc()?;
    let dir = std::env::temp_dir().join(format!("sala-check-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;

    // Spill bytes allowed per (arch, function): today's.
    let mut baseline: BTreeMap<(String, String), usize> = BTreeMap::new();
    if let (Some(p), false) = (&baseline_path, write) {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                [arch, func, bytes] => {
                    let b = bytes
                        .parse()
                        .map_err(|_| format!("{}: bad line {line:?}", p.display()))?;
                    baseline.insert((arch.to_string(), func.to_string()), b);
                }
                _ => return Err(format!("{}: bad line {line:?}", p.display())),
            }
        }
    }

    let mut reports = BTreeMap::new();
    for (_, target, arch) in archs() {
        let t0 = std::time::Instant::now();
        let r = assemble(&ptxas, &target, &arch, &dir)?;
        eprintln!(
            "{arch}: {} functions assembled in {:.1} s",
            r.len(),
            t0.elapsed().as_secs_f64()
        );
        reports.insert(arch, r);
    }
    let _ = std::fs::remove_dir_all(&dir);

    if write {
        let p = baseline_path.ok_or("--write-baseline needs --baseline FILE")?;
        let mut text = String::from("# Spill bytes (stores + loads) per architecture and function, as ptxas reports them\n# (scripts/check-kernels.sh --write-baseline). A function not listed may not spill.\n");
        for (arch, funcs) in &reports {
            for (name, f) in funcs {
                let spill = f.spill_stores + f.spill_loads;
                if spill > 0 {
                    text.push_str(&format!("{arch} {name} {spill}\n"));
                    baseline.insert((arch.clone(), name.clone()), spill);
                }
            }
        }
        std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }

    let (mut passed, mut failed) = (0, 0);
    for card in CARDS {
        let arch = sala_cuda::check::sass_arch(card.cc);
        let ptx = &reports[&arch];
        let allowed: BTreeMap<String, usize> = baseline
            .iter()
            .filter(|((a, _), _)| *a == arch)
            .map(|((_, f), b)| (f.clone(), *b))
            .collect();
        for v in check_card(card, ptx, &allowed) {
            println!(
                "{:<11} {:<24} {:<7} {} {}",
                v.card,
                v.kernel,
                v.arch,
                if v.ok { "ok  " } else { "FAIL" },
                v.line
            );
            if v.ok {
                passed += 1;
            } else {
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
