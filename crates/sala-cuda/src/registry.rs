//! The kernel registry: every kernel source compiled once by NVRTC into one module, cached on
//! disk by (source, target, NVRTC version), and its functions looked up once at start-up.
//!
//! NVRTC rather than an ahead-of-time fatbin: the one `sala` binary then builds for whatever
//! GPU it finds (sm_90a on Hopper, the plain target elsewhere) with no CUDA toolkit at build
//! time, and the on-disk cache keeps later start-ups fast.

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;

/// The kernel sources, in compile order (common definitions first).
pub const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("elementwise.cu", include_str!("../kernels/elementwise.cu")),
    ("gemv.cu", include_str!("../kernels/gemv.cu")),
    ("decode.cu", include_str!("../kernels/decode.cu")),
    ("lightning.cu", include_str!("../kernels/lightning.cu")),
    ("sparse.cu", include_str!("../kernels/sparse.cu")),
    (
        "lightning_fused.cu",
        include_str!("../kernels/lightning_fused.cu"),
    ),
    ("select_mma.cu", include_str!("../kernels/select_mma.cu")),
    (
        "select_decode.cu",
        include_str!("../kernels/select_decode.cu"),
    ),
    (
        "select_wgmma.cu",
        include_str!("../kernels/select_wgmma.cu"),
    ),
];

/// Every kernel the backend launches; `K::X as usize` indexes [`KERNELS`].
#[derive(Debug, Clone, Copy)]
pub enum K {
    Embed,
    RmsNorm,
    SiluMul,
    AddScaled,
    SigmoidGate,
    HeadNormRope,
    ScaleRound,
    FillRandom,
    LightningChunked,
    CompressKeys,
    SparseSelect,
    Attention,
    Gemv,
    SiluMulHalves,
    AttentionSplit,
    AttentionMerge,
    SelectLse,
    SelectScores,
    SelectTopk,
    LightningDecode,
    AddRmsNorm,
    GemvSilu,
    SelectScoresMma,
    SelectTopkScores,
    AttentionPrefill,
    AttentionGather,
    LightningChunkState,
    LightningChunkScan,
    LightningChunkOut,
    LightningFused,
    SelectScoresT,
    SiluMulHalves8,
    RopeTable,
    GemvNarrow,
    SdLse,
    SdP,
    SdTopk,
    SdTopkScores,
    AttentionDecode,
    HeadNormRope128,
    LightningRangeStates,
    SelectScoresWg,
    GemvMma8,
    GemvMma16,
    GemvSiluMma8,
    GemvSiluMma16,
    LightningDecodeRows,
    RopeTableRows,
    SdLseRows,
    SdPRows,
    SdTopkRows,
    AttentionDecodeRows,
    LightningOutputs,
    LightningStates,
}

/// The kernels' names in the source, in the order of [`K`].
pub const KERNELS: &[&str] = &[
    "embed",
    "rms_norm",
    "silu_mul",
    "add_scaled",
    "sigmoid_gate",
    "head_norm_rope",
    "scale_round",
    "fill_random",
    "lightning_chunked",
    "compress_keys",
    "sparse_select",
    "attention",
    "gemv",
    "silu_mul_halves",
    "attention_split",
    "attention_merge",
    "select_lse",
    "select_scores",
    "select_topk",
    "lightning_decode",
    "add_rms_norm",
    "gemv_silu",
    "select_scores_mma",
    "select_topk_scores",
    "attention_prefill",
    "attention_gather",
    "lightning_chunk_state",
    "lightning_chunk_scan",
    "lightning_chunk_out",
    "lightning_fused",
    "select_scores_t",
    "silu_mul_halves8",
    "rope_table",
    "gemv_narrow",
    "sd_lse",
    "sd_p",
    "sd_topk",
    "sd_topk_scores",
    "attention_decode",
    "head_norm_rope128",
    "lightning_range_states",
    "select_scores_wg",
    "gemv_mma8",
    "gemv_mma16",
    "gemv_silu_mma8",
    "gemv_silu_mma16",
    "lightning_decode_rows",
    "rope_table_rows",
    "sd_lse_rows",
    "sd_p_rows",
    "sd_topk_rows",
    "attention_decode_rows",
    "lightning_outputs",
    "lightning_states",
];

/// Dynamic shared memory of `lightning_states` for head size `d` (`LS_SMEM`): K and the
/// 32-column V slice double-buffered, decayed V as bf16 hi + lo, and the decay powers.
pub fn lightning_states_smem(d: usize) -> usize {
    2 * 64 * (d + 8) * 2 + 2 * (2 * 64 * 40 * 2) + 68 * 4
}

/// Dynamic shared memory of `lightning_outputs` for head size `d` (`LO_SMEM`): Q and K, a
/// 64-column V slice, S hi and lo for those columns (unpadded, swizzled), and the decay powers.
pub fn lightning_outputs_smem(d: usize) -> usize {
    2 * 64 * d * 2 + 64 * 64 * 2 + 2 * d * 64 * 2 + 68 * 4
}

/// Dynamic shared memory of `lightning_fused` for head size `d` (`LF_SMEM` in
/// lightning_fused.cu): Q and K double-buffered, the V slice double-buffered, Vd and S as bf16
/// hi + lo, and the decay powers.
pub fn lightning_fused_smem(d: usize) -> usize {
    let qk = 2 * 2 * 64 * (d + 8) * 2;
    let v_and_vd = 2 * (2 * 64 * 40 * 2);
    let s = 2 * d * 40 * 2;
    qk + v_and_vd + s + 68 * 4
}

/// Most candidate blocks `sd_topk` / `sd_topk_scores` take (16-bit counts); the dynamic
/// shared memory their keys need (2 bytes each); and the most `sd_topk` takes with P staged
/// beside the keys.
pub const SD_TOPK_MAX_CANDIDATES: usize = 65535;
pub const SD_TOPK_KEYS_SMEM: usize = 2 * (SD_TOPK_MAX_CANDIDATES + 1);
pub const SD_TOPK_MAX_SMEM: usize = 200 << 10;

/// Dynamic shared memory of `select_scores_wg` (`SW_SMEM_USED` in select_wgmma.cu, plus 1 KiB
/// to align the base for the swizzled tiles).
pub const SELECT_WG_SMEM: usize = 111_616 + 1024;

/// The whole program as one translation unit.
pub fn program_source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("// ---- {name}\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// The virtual architecture to compile for: `compute_90a` on Hopper (wgmma, TMA), else the
/// device's own `compute_XY`.
pub fn target_for(major: i32, minor: i32) -> String {
    if major == 9 && minor == 0 {
        "compute_90a".into()
    } else {
        format!("compute_{major}{minor}")
    }
}

/// Whether `target` compiles the sm_90a-only kernels (`select_scores_wg`) with their bodies.
pub fn has_wgmma(target: &str) -> bool {
    target == "compute_90a"
}

/// Compiles the program to PTX for `target` (e.g. `compute_90a`).
pub fn compile(target: &str) -> Result<String, String> {
    let arch: &'static str = Box::leak(target.to_string().into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some("sala_kernels.cu".into()),
        ..Default::default()
    };
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(program_source(), opts).map_err(|e| match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                format!(
                    "NVRTC failed to compile the kernels for {target}:\n{}",
                    log.to_string_lossy()
                )
            }
            other => format!("NVRTC failed for {target}: {other:?}"),
        })?;
    Ok(ptx.to_src())
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

fn cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("sala")
        .join("kernels")
}

/// PTX for `target`, from the disk cache or freshly compiled (and then cached).
pub fn ptx_for(target: &str) -> Result<String, String> {
    let mut h = DefaultHasher::new();
    program_source().hash(&mut h);
    target.hash(&mut h);
    nvrtc_version().hash(&mut h);
    let path = cache_dir().join(format!("{target}-{:016x}.ptx", h.finish()));
    if let Ok(ptx) = std::fs::read_to_string(&path) {
        return Ok(ptx);
    }
    let ptx = compile(target)?;
    // The cache is an optimisation: failing to write it is not an error.
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(ptx)
}

/// The loaded module and its functions.
pub struct Kernels {
    _module: Arc<CudaModule>,
    functions: Vec<CudaFunction>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, target: &str) -> Result<Self, String> {
        let ptx = ptx_for(target)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| format!("loading the kernel module: {e:?}"))?;
        let functions = KERNELS
            .iter()
            .map(|name| {
                module
                    .load_function(name)
                    .map_err(|e| format!("kernel {name}: {e:?}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Kernels with more than the default 48 KiB of dynamic shared memory.
        let mut big = vec![
            (K::LightningFused, lightning_fused_smem(128)),
            (K::LightningOutputs, lightning_outputs_smem(128)),
            (K::LightningStates, lightning_states_smem(128)),
            (K::SdTopk, SD_TOPK_MAX_SMEM),
            (K::SdTopkScores, SD_TOPK_KEYS_SMEM),
        ];
        // The wgmma kernel has a body only on Hopper.
        if has_wgmma(target) {
            big.push((K::SelectScoresWg, SELECT_WG_SMEM));
        }
        for (k, bytes) in big {
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            functions[k as usize]
                .set_attribute(
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(|e| {
                    format!(
                        "kernel {}: {bytes} B of shared memory: {e:?}",
                        KERNELS[k as usize]
                    )
                })?;
        }
        Ok(Self {
            _module: module,
            functions,
        })
    }

    pub fn get(&self, k: K) -> &CudaFunction {
        &self.functions[k as usize]
    }

    /// Per kernel: registers per thread, static shared memory and local (spill) bytes per
    /// thread, as the driver compiled them (profiling aid).
    pub fn describe(&self) -> Vec<String> {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        KERNELS
            .iter()
            .zip(&self.functions)
            .map(|(name, f)| {
                let get = |a| f.get_attribute(a).unwrap_or(-1);
                format!(
                    "{name}: {} registers, {} B static shared, {} B local",
                    get(A::CU_FUNC_ATTRIBUTE_NUM_REGS),
                    get(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                    get(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                )
            })
            .collect()
    }
}
