//! The CUDA backend: opening a GPU, and the model's ops as thin delegation to the op families
//! ([`crate::ops`]).

use crate::device::DeviceLimits;
use crate::graphs::{Mode, StepGraphs, StepKey, GRAPH_MAX_ROWS};
use crate::kernels::Launcher;
use crate::memory::{
    be_err, grow, interleave_w4, w4_group_word, DevAct, DevLightningState, DevMatrix,
    DevSparseCache, Fp8Weights, Scratch, W4Weights,
};
use crate::ops::elementwise::{ElementOp, RopeAt};
use crate::options::CudaOptions;
use crate::plan::{Launch, Planner};
use crate::w4_records::w4_records;
use crate::{gemm, libs, pool, profile, registry};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use sala_checkpoint::{KvCacheDtype, ModelConfig, SparseConfig};
use sala_model::backend::{RANDOM_KV_STD, RANDOM_STATE_STD};
use sala_model::memory::{fp8_kv_row_bytes, BackendMemory};
use sala_model::{
    AttnIo, AttnShape, BResult, Backend, BackendError, GreedyPick, HostTensor, LogitsOut, Span,
    SparseMode, StepInfo, StepLaunches,
};
use std::cell::{Cell, RefCell};
use std::sync::Arc;

pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// The kernels, their typed launchers and the launch plans.
    pub(crate) k: Launcher,
    pub(crate) gemm: RefCell<gemm::Gemm>,
    pub(crate) scratch: RefCell<Scratch>,
    /// What the driver reports (a device profile plans within these).
    driver_limits: DeviceLimits,
    /// The NVRTC target the kernels are compiled for ([`kernel_target`]).
    target: RefCell<String>,
    /// Time the host has spent waiting for the device in downloads (profiling aid).
    pub(crate) waited: Cell<std::time::Duration>,
    /// Sparse-layer decode steps run batched (`sparse_rows_batched`), for tests.
    pub(crate) sparse_rows_batched: Cell<usize>,
    /// Residual adds and norms made inside the product after them (`add_norm_silu_w4`), for
    /// tests.
    pub(crate) norms_in_products: Cell<usize>,
    /// FP8 products that made their inputs' codes in their own blocks (`gemv_f8_bf16_8`), for
    /// tests.
    pub(crate) codes_in_products: Cell<usize>,
    /// Where per-sequence caches and states live: the page pool, or one allocation each.
    pub(crate) pool: Option<pool::SharedPool>,
    /// CUDA graphs of repeated decode steps.
    pub(crate) graphs: RefCell<StepGraphs>,
    /// The step under way is a graph step: its token ids and positions are in their device
    /// buffers already ([`CudaBackend::preload_step`]).
    pub(crate) preloaded: Cell<bool>,
    /// Some product has FP8 weights: norms make their outputs' E4M3 codes too.
    pub(crate) fp8_products: Cell<bool>,
    /// The FP8 input scratch holds the codes of these rows (address, rows, width), made by
    /// the norm that wrote them: the product reading them next need not make them again.
    pub(crate) fresh_f8: Cell<Option<(u64, usize, usize)>>,
    /// The step under way leaves its picks for later ([`StepInfo::picks_later`]).
    pub(crate) picks_later: Cell<bool>,
    /// Rows of the last greedy picks made (the next step's tokens when it takes them).
    pub(crate) picked_rows: Cell<usize>,
    /// Picks left for later ([`crate::ahead`]).
    pub(crate) picks_ahead: crate::ahead::PicksAhead,
    /// With `profile_steps`: the step spans' events, and the step under way's first.
    step_spans: Option<(
        profile::Profiler,
        RefCell<Option<cudarc::driver::CudaEvent>>,
    )>,
}

/// The NVRTC target of the kernels under `limits` (a device profile's or the driver's): the
/// profile's card's own where this GPU runs code made for it (an older capability), so the
/// profile runs that card's code paths as well as its plans (an A100's products without FP8
/// MMAs, an RTX 4090's E4M3 `mma.sync`); this GPU's otherwise (a newer card's code cannot run
/// here: its plans only).
fn kernel_target(driver: &DeviceLimits, limits: &DeviceLimits) -> String {
    if limits.cc < driver.cc {
        limits.target()
    } else {
        driver.target()
    }
}

/// The limits plans use under `options`: the driver's, or its device profile's.
fn planned_limits(driver: &DeviceLimits, options: &CudaOptions) -> Result<DeviceLimits, String> {
    match options.device_profile {
        Some(card) => driver.emulating(card),
        None => Ok(driver.clone()),
    }
}

impl CudaBackend {
    /// The GPUs visible (the CUDA libraries loaded first).
    pub fn device_count() -> Result<usize, String> {
        libs::ensure_loaded()?;
        let count = CudaContext::device_count().map_err(|e| format!("CUDA driver: {e:?}"))?;
        Ok(count.max(0) as usize)
    }

    /// Opens GPU `ordinal`, compiles (or loads from the cache) the kernels, and creates the
    /// cuBLASLt handle. Every failure is an error naming what is missing.
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<Self, String> {
        libs::ensure_loaded()?;
        let count = CudaContext::device_count().map_err(|e| format!("CUDA driver: {e:?}"))?;
        if count <= 0 {
            return Err("CUDA is installed but no GPU is visible".into());
        }
        if ordinal >= count as usize {
            return Err(format!(
                "cuda:{ordinal} does not exist: {count} GPU(s) visible"
            ));
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| format!("opening cuda:{ordinal}: {e:?}"))?;
        // One stream, so cudarc's cross-stream events are not needed.
        unsafe { ctx.disable_event_tracking() };
        let driver_limits = DeviceLimits::from_driver(&ctx)?;
        driver_limits
            .check_supported()
            .map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        let limits = planned_limits(&driver_limits, &options)?;
        let target = kernel_target(&driver_limits, &limits);
        let modules = registry::load_modules(&ctx, &target)?;
        let profiler = options
            .profile_kernels
            .then(|| profile::Profiler::new(&ctx));
        let profile_steps = options.profile_steps;
        let pool = if options.kv_pool {
            let p = pool::PagePool::new(ctx.clone(), limits.memory_bytes, options.kv_pool_granules)
                .map_err(|e| e.0)?;
            Some(std::rc::Rc::new(RefCell::new(p)))
        } else {
            None
        };
        // One stream of our own (the legacy default stream cannot be captured, nor overlap
        // kernels through programmatic launches).
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("cuda:{ordinal}: a stream: {e:?}"))?;
        let k = Launcher::load(
            stream.clone(),
            modules,
            |attrs| Planner::new(limits, options, attrs),
            profiler,
        )?;
        if k.profiler().is_some() {
            for line in k.describe() {
                eprintln!("kernel {line}");
            }
        }
        let gemm = gemm::Gemm::new(stream.clone())?;
        let graphs = RefCell::new(StepGraphs::new(stream.clone()));
        let step_spans = profile_steps.then(|| (profile::Profiler::new(&ctx), RefCell::new(None)));
        Ok(Self {
            ctx,
            stream,
            k,
            gemm: RefCell::new(gemm),
            scratch: RefCell::new(Scratch::default()),
            driver_limits,
            target: RefCell::new(target),
            graphs,
            preloaded: Cell::new(false),
            fp8_products: Cell::new(false),
            fresh_f8: Cell::new(None),
            waited: Default::default(),
            sparse_rows_batched: Default::default(),
            norms_in_products: Default::default(),
            codes_in_products: Default::default(),
            pool,
            picks_later: Cell::new(false),
            picked_rows: Cell::new(0),
            picks_ahead: Default::default(),
            step_spans,
        })
    }

    /// Runs from now on with `options`' kernels and device profile (caches keep where they
    /// live: see [`CudaBackend::use_page_pool`]).
    pub fn set_options(&self, options: CudaOptions) -> Result<(), String> {
        let limits = planned_limits(&self.driver_limits, &options)?;
        // Captured steps used the old plans' kernels.
        self.graphs.borrow_mut().clear();
        let target = kernel_target(&self.driver_limits, &limits);
        if target == *self.target.borrow() {
            return self.k.replan(limits, options);
        }
        let modules = registry::load_modules(&self.ctx, &target)?;
        self.k.reload(modules, limits, options)?;
        *self.target.borrow_mut() = target;
        Ok(())
    }

    /// The GPU it runs on.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The options the backend runs with.
    pub fn options(&self) -> CudaOptions {
        self.k.planner().options.clone()
    }

    /// The plans' view of the device (a profile's limits when one is set).
    pub fn limits(&self) -> DeviceLimits {
        self.k.planner().limits.clone()
    }

    /// The launch plans of this device and options.
    pub fn planner(&self) -> Planner {
        self.k.planner().clone()
    }

    /// What the driver reports of the device.
    pub fn driver_limits(&self) -> &DeviceLimits {
        &self.driver_limits
    }

    /// Per kernel: registers, shared memory and spills as compiled, and its shared-memory
    /// opt-in.
    pub fn describe_kernels(&self) -> Vec<String> {
        self.k.describe()
    }

    /// Total time the host has waited for the device to finish work before a download: with
    /// the host issuing faster than the device runs, this is the device's lead.
    pub fn host_wait(&self) -> std::time::Duration {
        self.waited.get()
    }

    /// Whether this GPU runs the sm_90a (wgmma) kernels under the current plans.
    pub fn has_wgmma(&self) -> bool {
        self.k.planner().limits.hopper_instructions
    }

    /// How many sparse-layer calls of batched decode steps ran batched, one launch per kernel
    /// for all rows (the others ran row by row).
    pub fn sparse_rows_batched_calls(&self) -> usize {
        self.sparse_rows_batched.get()
    }

    /// How many residual adds and norms ran inside the product after them (one launch).
    pub fn norms_in_products(&self) -> usize {
        self.norms_in_products.get()
    }

    /// How many FP8 products made their inputs' codes in their own blocks (no launch before).
    pub fn codes_in_products(&self) -> usize {
        self.codes_in_products.get()
    }

    /// The block lists of the last sparse selection: `rows · kv_heads · k_sel` ids (tests).
    pub fn last_selection(&self, n: usize) -> BResult<Vec<i32>> {
        self.synchronize()?;
        let s = self.scratch.borrow();
        let buf = s
            .blocks
            .as_ref()
            .ok_or_else(|| BackendError("no selection has run".into()))?;
        let mut all = self
            .stream
            .clone_dtoh(buf)
            .map_err(|e| be_err("download", e))?;
        all.truncate(n);
        Ok(all)
    }

    /// With per-kernel profiling on: device milliseconds and launches per kernel since the
    /// last call.
    pub fn profile_report(&self) -> Option<Vec<(String, f64, usize)>> {
        let steps = self.step_spans.as_ref().map(|(p, _)| p.report());
        self.k.profiler().map(|p| p.report()).or(steps)
    }

    /// Per head of `head_dim` features: optional RMSNorm, then optional RoPE at positions
    /// `first_pos..` (the q and k step of [`Backend::lightning`], apart for tests).
    pub fn head_norm_rope(
        &self,
        x: &mut DevAct,
        head_dim: usize,
        norm: Option<(&CudaSlice<u16>, f32)>,
        rope: Option<(&CudaSlice<f32>, usize)>,
    ) -> BResult<()> {
        let rope = rope.map(|(f, p)| (f, RopeAt::From(p)));
        self.norm_rope(x, None, head_dim, norm.map(|(w, e)| (w, None, e)), rope)
    }

    /// A graph step's token ids and each row's position, written to their device buffers
    /// before any of its work (a replay reads them there).
    fn preload_step(&self, step: &StepInfo<'_>) -> BResult<()> {
        let rows = step.tokens.len();
        let mut pos = vec![0i32; rows];
        for s in step.spans {
            for (j, r) in s.rows().enumerate() {
                pos[r] = (s.pos + j) as i32;
            }
        }
        let mut s = self.scratch.borrow_mut();
        grow(&self.stream, &mut s.ids, rows)?;
        grow(&self.stream, &mut s.positions, rows)?;
        // Each row one past what the positions hold: advanced on the device (an upload from
        // pageable memory waits for the stream, so a step run ahead would wait for the one before).
        let advance = step.tokens_picked
            && s.positions_held.len() == rows
            && pos.iter().zip(&s.positions_held).all(|(&p, &h)| p == h + 1);
        if step.tokens_picked {
            // The picks of the step before, row for row, as the ids (still on the device).
            let (picks, ids) = (
                self.ptr(s.picks.as_ref().expect("a step made picks")),
                self.ptr(s.ids.as_ref().expect("grown")),
            );
            let positions = if advance {
                self.ptr(s.positions.as_ref().expect("grown"))
            } else {
                0
            };
            self.k.picked_ids(
                Launch::linear(rows, 256),
                picks,
                ids,
                positions,
                rows as i32,
            )?;
        } else {
            self.stream
                .memcpy_htod(step.tokens, s.ids.as_mut().expect("grown"))
                .map_err(|e| be_err("token ids", e))?;
        }
        if !advance {
            self.stream
                .memcpy_htod(&pos, s.positions.as_mut().expect("grown"))
                .map_err(|e| be_err("positions", e))?;
        }
        s.positions_held = pos;
        // The step's RoPE table is made anew (in its first stretch, as when it was captured).
        s.rope_key = None;
        self.preloaded.set(true);
        Ok(())
    }

    /// Decode steps captured into CUDA graphs, and steps replayed from them, so far.
    /// Tests: the kernel launch after the next `n` panics, once (a bug inside a step).
    #[doc(hidden)]
    pub fn panic_after_launches(&self, n: usize) {
        self.k.panic_after(n);
    }

    pub fn graph_steps(&self) -> (usize, usize) {
        self.graphs.borrow().stats()
    }

    /// The graphs' mode of the step under way and whether a stretch is open.
    pub(crate) fn graph_state(&self) -> (Mode, bool) {
        self.graphs.borrow().state()
    }

    /// Closes the graph stretch under way, so that what follows runs eagerly.
    pub(crate) fn graph_pause(&self) -> BResult<()> {
        let paused = self.graphs.borrow_mut().pause(self.k.launched());
        self.k.set_skip(self.graphs.borrow().skipping());
        paused
    }

    /// Opens the next graph stretch after eager work.
    pub(crate) fn graph_resume(&self) -> BResult<()> {
        let resumed = self.graphs.borrow_mut().resume(self.k.launched());
        self.k.set_skip(self.graphs.borrow().skipping());
        resumed
    }

    pub fn device_name(&self) -> &str {
        &self.driver_limits.name
    }

    /// Starts (`on`) or stops the range an external profiler records when it is told to
    /// record only such ranges (`ncu --profile-from-start off`); without one attached it does
    /// nothing. The queued work is waited for first, so the range holds exactly the work
    /// queued inside it.
    pub fn profiler_range(&self, on: bool) -> BResult<()> {
        self.synchronize()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| be_err("profiler range", e))?;
        // SAFETY: plain driver calls with the context current; they take no arguments.
        let r = unsafe {
            if on {
                cudarc::driver::sys::cuProfilerStart()
            } else {
                cudarc::driver::sys::cuProfilerStop()
            }
        };
        r.result().map_err(|e| be_err("profiler range", e))
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> BResult<()> {
        self.stream
            .synchronize()
            .map_err(|e| be_err("synchronize", e))
    }

    /// (bytes in use on the device by every process, total bytes); under a device profile the
    /// total is the card's.
    pub fn memory(&self) -> BResult<(usize, usize)> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| be_err("memory info", e))?;
        let cap = self.k.planner().limits.memory_bytes;
        Ok((total - free, total.min(cap)))
    }
}

impl Backend for CudaBackend {
    type Act = DevAct;
    type Matrix = DevMatrix;
    type Vector = CudaSlice<u16>;
    type LightningState = DevLightningState;
    type SparseCache = DevSparseCache;
    type Table = CudaSlice<f32>;

    fn name(&self) -> String {
        let limits = &self.k.planner().limits;
        format!("cuda ({}, {})", limits.name, self.target.borrow())
    }

    /// Chunks of 8192 rows keep the prefill products near the tensor cores' speed (and each
    /// chunk's weight reads a small share of it); the workspace costs ~1.3 GiB at the released
    /// shape, counted in every memory plan.
    fn default_prefill_chunk(&self) -> usize {
        8192
    }

    fn memory_facts(&self, config: &ModelConfig, rows: usize) -> BackendMemory {
        let page = self.page_pool().map(|p| p.borrow().page_bytes());
        crate::memory::memory_facts(config, rows, page, self.limits().cc >= (8, 9))
    }

    fn upload_matrix(&self, name: &str, t: HostTensor<'_>) -> BResult<DevMatrix> {
        if t.shape.len() != 2 {
            return Err(BackendError(format!(
                "weight {name}: expected 2 dimensions, got {:?}",
                t.shape
            )));
        }
        Ok(DevMatrix {
            buf: self.upload_bf16(name, &t)?,
            rows: t.shape[0],
            cols: t.shape[1],
            w4: None,
            fp8: None,
        })
    }

    fn upload_vector(&self, name: &str, t: HostTensor<'_>) -> BResult<CudaSlice<u16>> {
        if t.shape.len() != 1 {
            return Err(BackendError(format!(
                "weight {name}: expected 1 dimension, got {:?}",
                t.shape
            )));
        }
        self.upload_bf16(name, &t)
    }

    fn upload_table(&self, data: &[f32]) -> BResult<CudaSlice<f32>> {
        self.stream
            .clone_htod(data)
            .map_err(|e| be_err("table upload", e))
    }

    fn random_matrix(
        &self,
        _name: &str,
        rows: usize,
        cols: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<DevMatrix> {
        Ok(DevMatrix {
            buf: self.random_bf16(rows * cols, seed, mean, std)?,
            rows,
            cols,
            w4: None,
            fp8: None,
        })
    }

    fn upload_quantized(&self, name: &str, q: sala_model::QuantMatrix<'_>) -> BResult<DevMatrix> {
        q.check(name)?;
        // The 4-bit kernels take whole 128-input slabs, 32-input packs within one group; other
        // shapes as bf16.
        if !sala_model::memory::packs_w4(q.cols, q.group) {
            let values: Vec<u8> = q
                .values()
                .into_iter()
                .flat_map(|v| half::bf16::from_f32(v).to_bits().to_le_bytes())
                .collect();
            let t = HostTensor {
                dtype: sala_model::HostDType::Bf16,
                shape: &[q.rows, q.cols],
                bytes: &values,
            };
            return self.upload_matrix(name, t);
        }
        let up = |what: &str, e| be_err(&format!("uploading {name} ({what})"), e);
        let groups: Vec<u32> = (q.scales.iter().zip(q.zeros))
            .map(|(&s, &z)| w4_group_word(s, z))
            .collect();
        let words: Vec<u32> = q.words.iter().map(|&w| interleave_w4(w)).collect();
        let records = w4_records(&words, &groups, q.rows, q.cols, q.group);
        Ok(DevMatrix {
            buf: self.alloc_u16(0)?,
            rows: q.rows,
            cols: q.cols,
            w4: Some(W4Weights {
                records: self
                    .stream
                    .clone_htod(&records)
                    .map_err(|e| up("words and scales", e))?,
                group: q.group,
            }),
            fp8: None,
        })
    }

    fn upload_fp8(&self, name: &str, m: sala_model::Fp8Matrix<'_>) -> BResult<DevMatrix> {
        m.check(name)?;
        if !m.cols.is_multiple_of(16) {
            return Err(BackendError(format!(
                "weight {name}: FP8 products need inputs in multiples of 16, not {}",
                m.cols
            )));
        }
        let err = |e| be_err(&format!("uploading {name}"), e);
        self.fp8_products.set(true);
        Ok(DevMatrix {
            buf: self.alloc_u16(0)?,
            rows: m.rows,
            cols: m.cols,
            w4: None,
            fp8: Some(Fp8Weights {
                codes: self.stream.clone_htod(m.codes).map_err(err)?,
                scales: self.stream.clone_htod(m.scales).map_err(err)?,
            }),
        })
    }

    fn random_vector(
        &self,
        _name: &str,
        len: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> BResult<CudaSlice<u16>> {
        self.random_bf16(len, seed, mean, std)
    }

    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<DevAct> {
        Ok(DevAct {
            storage: self.alloc_u16(max_rows * cols)?,
            rows: max_rows,
            cols,
            first: 0,
            cap_rows: max_rows,
        })
    }

    fn set_rows(&self, a: &mut DevAct, rows: usize) {
        a.rows = rows.min(a.cap_rows);
    }

    fn set_width(&self, a: &mut DevAct, cols: usize) -> BResult<()> {
        if cols == a.cols {
            return Ok(());
        }
        if cols == 0 || a.first != 0 {
            return Err(BackendError(format!(
                "an activation of {cols} columns, or one shown through a window",
            )));
        }
        a.cols = cols;
        a.cap_rows = a.storage.len() / cols;
        a.rows = a.rows.min(a.cap_rows);
        Ok(())
    }

    fn copy_rows(
        &self,
        src: &DevAct,
        src_row: usize,
        dst: &mut DevAct,
        dst_row: usize,
        n: usize,
    ) -> BResult<()> {
        sala_model::backend::check_copy_rows(
            (src.rows, src.cols),
            src_row,
            (dst.rows, dst.cols),
            dst_row,
            n,
        )?;
        let w = src.cols;
        self.copy(dst, dst_row * w, src, src_row * w, n * w)
    }

    fn move_rows(&self, a: &mut DevAct, src_row: usize, dst_row: usize, n: usize) -> BResult<()> {
        sala_model::backend::check_move_rows(a.rows, src_row, dst_row, n)?;
        let (w, shift) = (a.cols, src_row - dst_row);
        if shift == 0 {
            return Ok(());
        }
        // Pieces of `shift` rows, first to last: no piece overlaps itself, and each lands on
        // rows already moved.
        for start in (0..n).step_by(shift) {
            let rows = shift.min(n - start);
            self.copy(
                &*a,
                (dst_row + start) * w,
                &*a,
                (src_row + start) * w,
                rows * w,
            )?;
        }
        Ok(())
    }

    fn new_lightning_state(&self, heads: usize, head_dim: usize) -> BResult<DevLightningState> {
        self.new_store(heads * head_dim * head_dim, true)
    }

    fn reserve_sparse_cache(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        tokens: usize,
    ) -> BResult<()> {
        self.reserve(cache, tokens, cfg, true)
    }

    fn new_sparse_cache(&self, shape: AttnShape, cfg: &SparseConfig) -> BResult<DevSparseCache> {
        let fp8 = cfg.kv_cache == KvCacheDtype::Fp8;
        if fp8 {
            crate::plan::fp8_cache_fits(shape, cfg).map_err(BackendError)?;
        }
        Ok(DevSparseCache {
            k: self.new_store(0, false)?,
            v: self.new_store(0, false)?,
            k1: self.new_store(0, false)?,
            k2: self.new_store(0, false)?,
            len: 0,
            n1: 0,
            n2: 0,
            cap: 0,
            kv_width: shape.kv_width(),
            head_dim: shape.head_dim,
            fp8,
            row_units: if fp8 {
                fp8_kv_row_bytes(shape.kv_heads, shape.head_dim) / 2
            } else {
                shape.kv_width()
            },
        })
    }

    fn fill_sparse_cache_random(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        tokens: usize,
        seed: u64,
    ) -> BResult<()> {
        if cache.len != 0 {
            return Err(BackendError(
                "fill_sparse_cache_random: cache not empty".into(),
            ));
        }
        self.reserve(cache, tokens, cfg, true)?;
        let n = tokens * cache.kv_width;
        if cache.fp8 {
            return self.fill_fp8_cache_random(cache, cfg, tokens, seed);
        }
        self.fill_random(self.ptr(&cache.k), n, seed, RANDOM_KV_STD)?;
        self.fill_random(self.ptr(&cache.v), n, seed ^ 1, RANDOM_KV_STD)?;
        cache.len = tokens;
        self.compress_new_windows(cache, cfg)
    }

    fn fill_lightning_state_random(&self, state: &mut DevLightningState, seed: u64) -> BResult<()> {
        // Each fp32 as two bf16 values: the high one sets its value (±RANDOM_STATE_STD), the
        // low one its last mantissa bits.
        self.fill_random(self.ptr(state), 2 * state.len(), seed, RANDOM_STATE_STD)
    }

    fn copy_lightning_state(
        &self,
        src: &DevLightningState,
        dst: &mut DevLightningState,
    ) -> BResult<()> {
        if src.len() != dst.len() {
            return Err(BackendError(format!(
                "copy_lightning_state: {} values into a state of {}",
                src.len(),
                dst.len()
            )));
        }
        self.copy(dst, 0, src, 0, src.len())
    }

    fn copy_sparse_cache(&self, src: &DevSparseCache, dst: &mut DevSparseCache) -> BResult<()> {
        self.copy_cache(src, dst)
    }

    fn shares_cache_prefixes(&self) -> bool {
        self.page_pool().is_some()
    }

    fn share_sparse_cache(
        &self,
        src: &DevSparseCache,
        dst: &mut DevSparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        self.share_cache(src, dst, cfg, len)
    }

    fn truncate_sparse_cache(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        if len > cache.len {
            return Err(BackendError(format!(
                "truncate_sparse_cache: {len} tokens of a cache of {}",
                cache.len
            )));
        }
        // What lies past the counts is written again as tokens come.
        cache.hold(cfg, len);
        Ok(())
    }

    fn begin_step(&self, step: &StepInfo<'_>) -> BResult<()> {
        let rows = step.tokens.len();
        if (step.tokens_picked || step.picks_later) && !self.runs_ahead() {
            return Err(BackendError("this backend runs no step ahead".into()));
        }
        if step.tokens_picked && rows != self.picked_rows.get() {
            return Err(BackendError(format!(
                "a step of {rows} rows takes the {} picks of the step before as its tokens",
                self.picked_rows.get()
            )));
        }
        if step.picks_later && !step.tokens_picked {
            // A new run of steps ahead: picks no one took are stale.
            self.picks_ahead.forget();
        }
        self.picks_later.set(step.picks_later);
        self.k.set_step_rows(rows);
        let o = self.options();
        let graph_step =
            o.cuda_graphs && !o.profile_kernels && !step.eager && rows <= GRAPH_MAX_ROWS;
        self.preloaded.set(false);
        if step.tokens_picked && !graph_step {
            // The ids come from the device: the eager step reads them where a graph step does.
            self.preload_step(step)?;
        }
        let key = if graph_step {
            self.preload_step(step)?;
            Some(StepKey {
                spans: step.spans.iter().map(|s| (s.first_row, s.len)).collect(),
                seqs: step.seq_ids.to_vec(),
                logits: step.logits.iter().map(|&l| l as u8).collect(),
                aux_rows: step.aux_rows.to_vec(),
                scratch: self.scratch.borrow().fingerprint(&self.stream),
            })
        } else {
            None
        };
        if let Some((p, first)) = &self.step_spans {
            *first.borrow_mut() = p.start(&self.stream);
        }
        let began = self.graphs.borrow_mut().begin(key, self.k.launched());
        self.k.set_skip(self.graphs.borrow().skipping());
        began.map(|_| ())
    }

    fn end_step(&self, ok: bool) -> BResult<()> {
        let scratch = self.scratch.borrow().fingerprint(&self.stream);
        let mode = self.graphs.borrow().state().0;
        let ended = self.graphs.borrow_mut().end(ok, self.k.launched(), scratch);
        if let Some((p, first)) = &self.step_spans {
            let how = match mode {
                Mode::Eager => "eager",
                Mode::Capture => "captured",
                Mode::Replay => "replayed",
            };
            let name = format!("step of {} rows, {how}", self.k.step_rows());
            p.end(name, first.borrow_mut().take(), &self.stream);
        }
        self.k.set_skip(false);
        self.preloaded.set(false);
        ended
    }

    fn hold_graphs(&self) -> BResult<()> {
        let held = self.graphs.borrow_mut().hold(self.k.launched());
        self.k.set_skip(self.graphs.borrow().skipping());
        held
    }

    fn release_graphs(&self) -> BResult<()> {
        let released = self.graphs.borrow_mut().release(self.k.launched());
        self.k.set_skip(self.graphs.borrow().skipping());
        released
    }

    fn runs_ahead(&self) -> bool {
        self.options().run_ahead
    }

    fn take_picks(&self) -> BResult<Vec<GreedyPick>> {
        self.take_queued_picks()
    }

    fn step_launches(&self) -> StepLaunches {
        match self.graphs.borrow().state().0 {
            Mode::Eager => StepLaunches::Eager,
            Mode::Capture => StepLaunches::Capture,
            Mode::Replay => StepLaunches::Replay,
        }
    }

    fn forget_graphs(&self) {
        self.graphs.borrow_mut().clear();
    }

    fn embed(&self, table: &DevMatrix, ids: &[u32], scale: f32, out: &mut DevAct) -> BResult<()> {
        self.embed_rows(table, ids, scale, out)
    }

    fn rms_norm(&self, x: &DevAct, w: &CudaSlice<u16>, eps: f32, out: &mut DevAct) -> BResult<()> {
        self.rms_norm_rows(x, w, eps, None, out)
    }

    fn matmul(&self, x: &DevAct, w: &DevMatrix, out: &mut DevAct) -> BResult<()> {
        self.matmul_into(x, w, out)
    }

    fn concat_rows(&self, parts: Vec<DevMatrix>) -> BResult<DevMatrix> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(BackendError(
                "concat_rows: the matrices have different input widths".into(),
            ));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        if parts.iter().any(|p| p.fp8.is_some()) {
            if !parts.iter().all(|p| p.fp8.is_some()) {
                return Err(BackendError(
                    "concat_rows: FP8 and other matrices cannot be stacked".into(),
                ));
            }
            return self.concat_fp8(parts, rows, cols);
        }
        let group = parts.first().and_then(|p| p.w4.as_ref()).map(|q| q.group);
        if group.is_some()
            && parts
                .iter()
                .all(|p| p.w4.as_ref().map(|q| q.group) == group)
        {
            return self.concat_w4(parts, rows, cols);
        }
        // Mixed (4-bit beside bf16): all as bf16.
        let buf = self.alloc_u16(rows * cols)?;
        let mut off = 0;
        for p in &parts {
            match &p.w4 {
                Some(_) => self.dequantize_rows(p, 0, p.rows, self.ptr(&buf) + (off * 2) as u64)?,
                None => self.copy(&buf, off, &p.buf, 0, p.rows * cols)?,
            }
            off += p.rows * cols;
        }
        Ok(DevMatrix {
            buf,
            rows,
            cols,
            w4: None,
            fp8: None,
        })
    }

    fn matmul_split(&self, x: &DevAct, w: &DevMatrix, outs: &mut [&mut DevAct]) -> BResult<()> {
        self.matmul_parts(x, w, outs)
    }

    fn matmul_silu(
        &self,
        x: &DevAct,
        w: &DevMatrix,
        gu: &mut DevAct,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.product_silu(x, w, gu, out)
    }

    fn silu_mul_halves(&self, gu: &DevAct, out: &mut DevAct) -> BResult<()> {
        self.silu_halves(gu, out)
    }

    fn silu_mul(&self, gate: &mut DevAct, up: &DevAct) -> BResult<()> {
        self.elementwise(ElementOp::SiluMul, gate, up)
    }

    fn add_scaled(&self, h: &mut DevAct, branch: &DevAct, scale: f32) -> BResult<()> {
        self.elementwise(ElementOp::AddScaled(scale), h, branch)
    }

    fn add_scaled_norm(
        &self,
        h: &mut DevAct,
        branch: &DevAct,
        scale: f32,
        w: &CudaSlice<u16>,
        eps: f32,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.add_scaled_norm_rows(h, branch, scale, w, eps, out)
    }

    fn add_scaled_norm_matmul_silu(
        &self,
        h: &mut DevAct,
        branch: &DevAct,
        scale: f32,
        norm: &CudaSlice<u16>,
        eps: f32,
        a: &mut DevAct,
        w: &DevMatrix,
        gu: &mut DevAct,
        out: &mut DevAct,
    ) -> BResult<()> {
        if self.add_norm_silu_fits(h, branch, a, w, out) {
            return self.add_norm_silu_w4(h, branch, scale, norm, eps, a, w, out);
        }
        self.add_scaled_norm_rows(h, branch, scale, norm, eps, a)?;
        self.product_silu(a, w, gu, out)
    }

    fn sigmoid_gate(&self, x: &mut DevAct, gate: &DevAct) -> BResult<()> {
        self.elementwise(ElementOp::SigmoidGate, x, gate)
    }

    fn rms_norm_gate(
        &self,
        x: &DevAct,
        w: &CudaSlice<u16>,
        eps: f32,
        gate: Option<&DevAct>,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.rms_norm_rows(x, w, eps, gate, out)
    }

    fn row_sums_of_squares(&self, x: &DevAct, sums: &mut CudaSlice<f32>) -> BResult<()> {
        self.row_sums_sq(x, sums)
    }

    fn rms_norm_gate_with_sums(
        &self,
        x: &DevAct,
        sums: &CudaSlice<f32>,
        width: usize,
        w: &CudaSlice<u16>,
        eps: f32,
        gate: Option<&DevAct>,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.rms_norm_rows_with(x, w, eps, gate, Some((sums, width)), out)
    }

    fn rope(
        &self,
        head_dim: usize,
        inv_freq: &CudaSlice<f32>,
        spans: &[Span],
        q: &mut DevAct,
        k: &mut DevAct,
    ) -> BResult<()> {
        self.rope_spans(head_dim, inv_freq, spans, q, k)
    }

    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        norms: Option<(&CudaSlice<u16>, &CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        io: AttnIo<'_, DevAct>,
        spans: &[Span],
        states: &mut [&mut DevLightningState],
    ) -> BResult<()> {
        self.lightning_spans(shape, slopes, norms, inv_freq, io, spans, states)
    }

    fn lightning_replay(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        k_norm: Option<(&CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        kv: (&DevAct, &DevAct, usize),
        pos: usize,
        state: &mut DevLightningState,
    ) -> BResult<()> {
        self.lightning_replay_rows(shape, slopes, k_norm, inv_freq, kv, pos, state)
    }

    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        io: AttnIo<'_, DevAct>,
        spans: &[Span],
        modes: &[SparseMode],
        caches: &mut [&mut DevSparseCache],
    ) -> BResult<()> {
        self.sparse_spans(shape, cfg, io, spans, modes, caches)
    }

    fn lightning_state_advance(
        &self,
        slopes: &CudaSlice<f32>,
        head_dim: usize,
        tokens: usize,
        prev: &DevLightningState,
        state: &mut DevLightningState,
    ) -> BResult<()> {
        let per_head = head_dim * head_dim;
        if prev.len() != state.len() || state.len() != slopes.len() * per_head {
            return Err(BackendError(format!(
                "lightning scan: states of {} and {} values for {} heads of {head_dim}",
                prev.len(),
                state.len(),
                slopes.len()
            )));
        }
        self.k.lightning_state_advance(
            Launch::linear(state.len(), 256),
            self.ptr(state),
            self.ptr(prev),
            self.ptr(slopes),
            tokens as i32,
            per_head as i32,
            slopes.len() as i32,
        )
    }

    fn lightning_state_term(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q_norm: Option<(&CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        state: &DevLightningState,
        (q, pos): (&mut DevAct, usize),
        out: &mut DevAct,
    ) -> BResult<()> {
        let (heads, d, qw, rows) = (shape.heads, shape.head_dim, shape.q_width(), q.rows);
        if q.cols != qw
            || out.cols != qw
            || rows > out.rows
            || d > 256
            || state.len() != heads * d * d
            || slopes.len() < heads
        {
            return Err(BackendError(format!(
                "lightning start states: q [{}, {}] and out [{}, {}] for {heads} heads of {d} \
                 (at most 256), a state of {} values",
                q.rows,
                q.cols,
                out.rows,
                out.cols,
                state.len()
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        if q_norm.is_some() || inv_freq.is_some() {
            self.norm_rope(
                q,
                None,
                d,
                q_norm.map(|(w, e)| (w, None, e)),
                inv_freq.map(|f| (f, RopeAt::From(pos))),
            )?;
        }
        let at = self.k.planner().lightning_state_term(rows, heads, d);
        self.k.lightning_state_term(
            at,
            self.act_ptr(q),
            self.ptr(state),
            self.ptr(slopes),
            self.act_ptr(out),
            rows as i32,
            heads as i32,
            d as i32,
            shape.scale() as f32,
        )
    }

    fn append_sparse_kv(
        &self,
        cache: &mut DevSparseCache,
        cfg: &SparseConfig,
        k: &DevAct,
        v: &DevAct,
        rows: std::ops::Range<usize>,
    ) -> BResult<()> {
        let kw = cache.kv_width;
        sala_model::backend::check_append_kv(kw, (k.rows, k.cols), (v.rows, v.cols), &rows)?;
        if rows.is_empty() {
            return Ok(());
        }
        // The cache's length moves: outside any graph, as sparse attention runs.
        self.graph_pause()?;
        let appended = self.append_kv(cache, cfg, (k, v), rows.start, rows.len());
        self.graph_resume()?;
        appended.map(|_| ())
    }

    fn logits(
        &self,
        h: &DevAct,
        rows: &[usize],
        keep: &[bool],
        lm_head: &DevMatrix,
        divisor: f32,
    ) -> BResult<LogitsOut> {
        self.head_logits(h, rows, keep, lm_head, divisor)
    }

    fn to_host(&self, a: &DevAct) -> BResult<Vec<f32>> {
        let (storage, off) = a.slice_at(0);
        Ok(self
            .download(storage, off + a.rows * a.cols)?
            .split_off(off))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::card_named;

    /// A profile of an older card runs that card's code; a newer card's, or this GPU's own
    /// class, runs this GPU's code.
    #[test]
    fn profiles_compile_for_the_cards_they_can_run() {
        let h200 = DeviceLimits::of_card(card_named("h200").unwrap());
        let target = |card: &str| {
            let limits = h200.emulating(card_named(card).unwrap()).unwrap();
            kernel_target(&h200, &limits)
        };
        assert_eq!(kernel_target(&h200, &h200), "compute_90a");
        assert_eq!(target("a100"), "compute_80");
        assert_eq!(target("rtx4090"), "compute_89");
        assert_eq!(target("a6000"), "compute_86");
        assert_eq!(target("h100"), "compute_90a");
        assert_eq!(target("rtx5090"), "compute_90a");
    }
}
