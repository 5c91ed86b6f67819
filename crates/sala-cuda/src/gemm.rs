//! bf16 GEMMs through cuBLASLt with fp32 accumulation. A plan (descriptors, layouts and the
//! heuristic's algorithm) is made once per shape and reused, so a decode step pays no
//! heuristic query per product.

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

pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    plans: HashMap<(usize, usize, usize), Plan>,
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
        })
    }

    fn plan(&mut self, rows: usize, out: usize, inner: usize) -> Result<(), String> {
        if !self.plans.contains_key(&(rows, out, inner)) {
            let plan = self.make_plan(rows, out, inner)?;
            self.plans.insert((rows, out, inner), plan);
        }
        Ok(())
    }

    /// Row-major `Y[rows, out] = X[rows, inner] · W[out, inner]ᵀ` is, in cuBLAS's column-major
    /// terms, `Yᵀ (out×rows) = op(W) · Xᵀ` with W stored as an `inner×out` matrix, transposed.
    fn make_plan(&self, rows: usize, out: usize, inner: usize) -> Result<Plan, String> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
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
            let a = lt::create_matrix_layout(bf16, inner as u64, out as u64, inner as i64)
                .map_err(|e| err("layout A", e))?;
            let b = lt::create_matrix_layout(bf16, inner as u64, rows as u64, inner as i64)
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
        let handle = self.handle;
        let stream = self.stream.clone();
        self.plan(rows, out, inner)?;
        let plan = &self.plans[&(rows, out, inner)];
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
