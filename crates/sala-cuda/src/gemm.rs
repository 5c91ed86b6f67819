//! GEMMs through cuBLASLt with fp32 accumulation: bf16, and FP8 (E4M3 inputs, bf16 output,
//! scaled by a vector per side where cuBLASLt can). A plan (descriptors, layouts and the
//! heuristic's algorithm) is made once per shape and kind and reused, so a decode step pays
//! no heuristic query per product.

use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// What a plan multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Bf16,
    /// E4M3 inputs, each output times its weight row's and input row's scales.
    Fp8Scaled,
    /// E4M3 inputs, the raw sums out (scaled afterwards).
    Fp8,
}

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: HashMap<(usize, usize, usize, Kind), Plan>,
    /// cuBLASLt refused vector scales here once: FP8 products go unscaled.
    no_vector_scales: bool,
}

fn err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuBLASLt {what}: {e:?}")
}

impl Gemm {
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, String> {
        let handle = lt::create_handle().map_err(|e| err("handle", e))?;
        let workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| err("workspace", e))?;
        Ok(Self {
            handle,
            stream,
            workspace,
            plans: HashMap::new(),
            no_vector_scales: false,
        })
    }

    fn plan(&mut self, rows: usize, out: usize, inner: usize, kind: Kind) -> Result<(), String> {
        if !self.plans.contains_key(&(rows, out, inner, kind)) {
            let plan = self.make_plan(rows, out, inner, kind)?;
            self.plans.insert((rows, out, inner, kind), plan);
        }
        Ok(())
    }

    /// Row-major `Y[rows, out] = X[rows, inner] · W[out, inner]ᵀ` is, in cuBLAS's column-major
    /// terms, `Yᵀ (out×rows) = op(W) · Xᵀ` with W stored as an `inner×out` matrix, transposed
    /// (both K-major, as FP8 needs). Vector scales: A's (W's) by output, B's (X's) by row.
    fn make_plan(&self, rows: usize, out: usize, inner: usize, kind: Kind) -> Result<Plan, String> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let input = match kind {
            Kind::Bf16 => bf16,
            Kind::Fp8 | Kind::Fp8Scaled => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        };
        unsafe {
            let desc = lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|e| err("matmul descriptor", e))?;
            let trans = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &trans as *const _ as *const c_void,
                std::mem::size_of_val(&trans),
            )
            .map_err(|e| err("transpose attribute", e))?;
            if kind == Kind::Fp8Scaled {
                let mode =
                    sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
                for attr in [
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                ] {
                    lt::set_matmul_desc_attribute(
                        desc,
                        attr,
                        &mode as *const _ as *const c_void,
                        std::mem::size_of_val(&mode),
                    )
                    .map_err(|e| err("vector scale mode", e))?;
                }
            }
            let a = lt::create_matrix_layout(input, inner as u64, out as u64, inner as i64)
                .map_err(|e| err("layout A", e))?;
            let b = lt::create_matrix_layout(input, inner as u64, rows as u64, inner as i64)
                .map_err(|e| err("layout B", e))?;
            let c = lt::create_matrix_layout(bf16, out as u64, rows as u64, out as i64)
                .map_err(|e| err("layout C", e))?;
            let pref = lt::create_matmul_pref().map_err(|e| err("preference", e))?;
            let ws = WORKSPACE_BYTES;
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const _ as *const c_void,
                std::mem::size_of_val(&ws),
            )
            .map_err(|e| err("workspace preference", e))?;
            let heuristic = lt::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref)
                .map_err(|e| {
                    err(
                        &format!("no algorithm for {rows}x{inner} by {out}x{inner}"),
                        e,
                    )
                })?;
            let _ = lt::destroy_matmul_pref(pref);
            Ok(Plan {
                desc,
                a,
                b,
                c,
                algo: heuristic.algo,
            })
        }
    }

    /// `y = x · wᵀ` for row-major bf16 buffers given by device address (`x` [rows, inner], `w` [out, inner],
    /// `y` [rows, out]), fp32 accumulation, bf16 output.
    pub fn run_ptrs(
        &mut self,
        xp: u64,
        wp: u64,
        yp: u64,
        rows: usize,
        out: usize,
        inner: usize,
    ) -> Result<(), String> {
        self.run(xp, wp, yp, (rows, out, inner), Kind::Bf16)
    }

    /// `y = (codes(x) · codes(w)ᵀ)` for E4M3 `x` [rows, inner] and `w` [out, inner], bf16 `y`,
    /// each output times `w_scales[o] · x_scales[r]` (f32 vectors) when `vector_scales` and
    /// cuBLASLt scales by vectors here: returns whether it did (else `y` holds the raw sums).
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8(
        &mut self,
        xp: u64,
        wp: u64,
        yp: u64,
        (rows, out, inner): (usize, usize, usize),
        (w_scales, x_scales): (u64, u64),
        vector_scales: bool,
    ) -> Result<bool, String> {
        if vector_scales && !self.no_vector_scales {
            match self.plan(rows, out, inner, Kind::Fp8Scaled) {
                Ok(()) => {
                    let desc = self.plans[&(rows, out, inner, Kind::Fp8Scaled)].desc;
                    for (attr, ptr) in [
                        (
                            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                            w_scales,
                        ),
                        (
                            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                            x_scales,
                        ),
                    ] {
                        // SAFETY: `desc` is a live descriptor; the attribute is a device pointer.
                        unsafe {
                            lt::set_matmul_desc_attribute(
                                desc,
                                attr,
                                &ptr as *const u64 as *const c_void,
                                std::mem::size_of::<u64>(),
                            )
                        }
                        .map_err(|e| err("scale pointer", e))?;
                    }
                    match self.run(xp, wp, yp, (rows, out, inner), Kind::Fp8Scaled) {
                        Ok(()) => return Ok(true),
                        Err(_) => self.no_vector_scales = true,
                    }
                }
                Err(_) => self.no_vector_scales = true,
            }
        }
        self.run(xp, wp, yp, (rows, out, inner), Kind::Fp8)?;
        Ok(false)
    }

    fn run(
        &mut self,
        xp: u64,
        wp: u64,
        yp: u64,
        (rows, out, inner): (usize, usize, usize),
        kind: Kind,
    ) -> Result<(), String> {
        let handle = self.handle;
        let stream = self.stream.clone();
        self.plan(rows, out, inner, kind)?;
        let plan = &self.plans[&(rows, out, inner, kind)];
        let (ws_ptr, _g0) = self.workspace.device_ptr(&stream);
        let ws_ptr = ws_ptr as *mut c_void;
        let (alpha, beta) = (1.0f32, 0.0f32);
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                wp as *const c_void,
                plan.a,
                xp as *const c_void,
                plan.b,
                yp as *const c_void,
                plan.c,
                yp as *mut c_void,
                plan.c,
                &plan.algo,
                ws_ptr,
                WORKSPACE_BYTES,
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| err(&format!("matmul {rows}x{inner} by {out}x{inner}"), e))
    }
}

/// cuBLASLt workspace (NVIDIA recommends 32 MiB on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

impl Drop for Gemm {
    fn drop(&mut self) {
        unsafe {
            for plan in self.plans.values() {
                let _ = lt::destroy_matrix_layout(plan.a);
                let _ = lt::destroy_matrix_layout(plan.b);
                let _ = lt::destroy_matrix_layout(plan.c);
                let _ = lt::destroy_matmul_desc(plan.desc);
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
