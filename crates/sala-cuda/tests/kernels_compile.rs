//! Every kernel file compiles with NVRTC for every target the backend may pick (sm_80 and later;
//! sm_90a on Hopper), and its PTX holds the kernels the registry looks up in it. Needs only
//! NVRTC, not a GPU: CI runs this.

use sala_cuda::kernels::K;
use sala_cuda::registry;

const TARGETS: &[&str] = &[
    "compute_80",
    "compute_86",
    "compute_89",
    "compute_90a",
    "compute_100",
    "compute_120",
];

#[test]
fn every_file_compiles_for_every_target() {
    sala_cuda::libs::ensure_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    let wgmma_file = K::SelectScoresWg.file();
    for target in TARGETS {
        let ptx = registry::compile_all(target).unwrap_or_else(|e| panic!("{e}"));
        for k in K::ALL {
            let (file, name) = (k.file(), k.name());
            let (_, text) = ptx.iter().find(|(f, _)| *f == file).unwrap();
            assert!(
                text.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the {target} PTX of {file}"
            );
        }
        // The wgmma kernel has its body exactly where the backend runs it.
        for (file, text) in &ptx {
            assert_eq!(
                text.contains("wgmma.mma_async"),
                *file == wgmma_file && *target == "compute_90a",
                "wgmma instructions in the {target} PTX of {file}"
            );
        }
    }
}
