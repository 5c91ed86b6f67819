//! The CUDA backend held to the CPU backend and the oracle, on the GPU, on fresh random inputs
//! at ragged shapes; then whole models. These need a GPU and are ignored by `cargo test`;
//! `scripts/gpu-build.sh` builds them here and `scripts/gpu-run.sh` runs them on the GPU machine,
//! once with the GPU's own plans and once under each device profile it checks
//! (`SALA_DEVICE_PROFILE=rtx5090`, ...: the suite then runs as that card would). Within a run,
//! each test loops over the kernel variants (`CudaOptions`) of the ops it checks.

use sala_checkpoint::{
    preset, write_random_checkpoint, Checkpoint, DType, KvCacheDtype, MixerKind, ModelConfig,
    SparseConfig, WriteOptions,
};
use sala_cpu::attention::{self as cpu_attn, SparseCache};
use sala_cpu::{CpuAct, CpuBackend};
use sala_cuda::options::{Attention, DecodeGemv, LightningPrefill, SelectScores};
use sala_cuda::{CudaBackend, CudaOptions, DevSparseCache, Store};
use sala_model::numerics::{rel_l2, rope_inv_freq, TestRng};
use sala_model::oracle::{self, AttnShape, SparseMode};
use sala_model::testing::decode_step;
use sala_model::{
    AttnIo, Backend, GreedyPick, HostDType, HostTensor, LogitRows, Model, Span, WeightSource,
};

/// The options of this run: the environment's (`SALA_DEVICE_PROFILE` plans as that card).
fn base_options() -> CudaOptions {
    CudaOptions::from_env().expect("the SALA_* variables")
}

/// The backend with the bit-exact block selection, so whole outputs compare with the CPU's.
fn gpu() -> CudaBackend {
    let mut o = base_options();
    o.exact_select = true;
    let g = CudaBackend::new(0, o).expect("these tests need a CUDA GPU");
    eprintln!("{}", g.name());
    g
}

/// `n` token ids below `vocab`, drawn from `rng`.
fn random_tokens(rng: &mut TestRng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// Runs `g` from now on with its options changed by `f`.
fn set(g: &CudaBackend, f: impl FnOnce(&mut CudaOptions)) {
    let mut o = g.options();
    f(&mut o);
    g.set_options(o).unwrap();
}

/// Every decode-product variant.
const GEMVS: [DecodeGemv; 3] = [
    DecodeGemv::TensorCore,
    DecodeGemv::CudaCore,
    DecodeGemv::CudaCoreWide,
];

fn cpu_act(data: &[f32], cols: usize) -> CpuAct {
    CpuAct::from_rows(data.to_vec(), cols)
}

/// Relative L2 error within `tol`, and no NaN.
fn close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    let e = rel_l2(got, want);
    assert!(e < tol, "{what}: relative L2 error {e} (tolerance {tol})");
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

/// `values` (bf16-exact) uploaded as a norm weight vector.
fn gpu_vector(g: &CudaBackend, values: &[f32]) -> <CudaBackend as Backend>::Vector {
    g.upload_vector(
        "w",
        HostTensor {
            dtype: HostDType::Bf16,
            shape: &[values.len()],
            bytes: &bf16_bytes(values),
        },
    )
    .unwrap()
}

/// A random bf16 matrix of `out` rows of `inner` values (in ±0.1), uploaded to the CPU backend
/// and to `g`.
fn random_matrix(
    g: &CudaBackend,
    rng: &mut TestRng,
    out: usize,
    inner: usize,
) -> (sala_cpu::CpuMatrix, sala_cuda::DevMatrix) {
    let w = rng.bf16_vec(out * inner, -0.1, 0.1);
    let ht = HostTensor {
        dtype: HostDType::Bf16,
        shape: &[out, inner],
        bytes: &bf16_bytes(&w),
    };
    (
        CpuBackend::default().upload_matrix("w", ht).unwrap(),
        g.upload_matrix("w", ht).unwrap(),
    )
}

/// `rows` rows of `x` times `w`ᵀ on the GPU, to the host.
fn gpu_matmul(g: &CudaBackend, x: &[f32], w: &sala_cuda::DevMatrix, rows: usize) -> Vec<f32> {
    let mut out = g.act_from_host(&vec![0.0; rows * w.rows], w.rows).unwrap();
    g.matmul(&g.act_from_host(x, w.cols).unwrap(), w, &mut out)
        .unwrap();
    g.to_host(&out).unwrap()
}

/// `x` (rows of `w.cols` values) times `w`ᵀ on the CPU: what the GPU's products are checked
/// against.
fn cpu_matmul(x: &[f32], w: &sala_cpu::CpuMatrix) -> Vec<f32> {
    let mut out = cpu_act(&vec![0.0; x.len() / w.cols * w.rows], w.rows);
    CpuBackend::default()
        .matmul(&cpu_act(x, w.cols), w, &mut out)
        .unwrap();
    out.data
}

mod context_parallel;
mod model;
mod nccl;
mod ops;
mod quantized;
mod tensor_parallel;
