//! Every kernel compiles with NVRTC for the generic target (sm_80 and later) and for Hopper
//! (sm_90a). Needs only NVRTC, not a GPU: CI runs this.

#[test]
fn all_kernels_compile_for_every_target() {
    sala_cuda::libs::ensure_nvrtc().unwrap_or_else(|e| panic!("{e}"));
    for target in ["compute_80", "compute_90a"] {
        let ptx = sala_cuda::registry::compile(target).unwrap_or_else(|e| panic!("{e}"));
        for name in sala_cuda::registry::KERNELS {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "kernel {name} missing from the {target} PTX"
            );
        }
        // The wgmma kernels have their bodies exactly where the backend runs them.
        assert_eq!(
            ptx.contains("wgmma.mma_async"),
            sala_cuda::registry::has_wgmma(target),
            "wgmma instructions in the {target} PTX"
        );
    }
}
