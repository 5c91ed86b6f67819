//! CUDA backend: bf16 storage, fp32 accumulation. Kernels are compiled by NVRTC at start-up
//! (cached on disk, see [`registry`]); projections and MLPs go through cuBLASLt ([`gemm`]).
//! The CUDA libraries are opened at run time ([`libs`]), so the same binary runs without them.

pub mod gemm;
pub mod libs;
pub mod pool;
pub mod profile;
pub mod registry;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use registry::{Kernels, K};
use sala_checkpoint::SparseConfig;
use sala_model::backend::{RANDOM_KV_STD, RANDOM_STATE_STD};
use sala_model::{AttnShape, BResult, Backend, BackendError, HostDType, HostTensor, SparseMode};
use std::cell::RefCell;
use std::sync::Arc;

fn be_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError(format!("CUDA {what}: {e:?}"))
}

/// Activations `[rows, cols]` in bf16, with room for `cap_rows` rows.
pub struct DevAct {
    pub buf: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
    cap_rows: usize,
}

/// A bf16 matrix `[rows = out, cols = in]`.
pub struct DevMatrix {
    pub buf: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
}

/// Device memory a kernel argument can point at.
pub trait DevMem<T> {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64;
}

impl<T> DevMem<T> for CudaSlice<T> {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        self.device_ptr(stream).0
    }
}

/// A per-sequence buffer (a cache or a lightning state) of `T`: its own allocation, or a range
/// of the page pool (the default; `SALA_KV_POOL=0` turns it off), which grows in place.
pub enum Store<T> {
    Own(CudaSlice<T>),
    Paged { buf: pool::PagedBuf, len: usize },
}

impl<T> DevMem<T> for Store<T> {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        match self {
            Store::Own(s) => s.dev_ptr(stream),
            Store::Paged { buf, .. } => buf.ptr(),
        }
    }
}

impl<T> Store<T> {
    /// Elements usable now.
    pub fn len(&self) -> usize {
        match self {
            Store::Own(s) => s.len(),
            Store::Paged { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Lightning state of one layer for one sequence: `[heads, d, d]` fp32.
pub type DevLightningState = Store<f32>;

/// One sparse layer's cache for one sequence: K, V and both compressed-key tiers, grown by
/// doubling as tokens arrive (in place, in the page pool).
pub struct DevSparseCache {
    k: Store<u16>,
    v: Store<u16>,
    k1: Store<u16>,
    k2: Store<u16>,
    len: usize,
    n1: usize,
    n2: usize,
    cap: usize,
    kv_width: usize,
}

/// Scratch shared by all sparse layers: stage-1 scores and the selected blocks.
#[derive(Default)]
struct Scratch {
    p: Option<CudaSlice<f32>>,
    blocks: Option<CudaSlice<i32>>,
    ids: Option<CudaSlice<u32>>,
    logits_in: Option<CudaSlice<u16>>,
    logits_out: Option<CudaSlice<u16>>,
    lightning: Option<CudaSlice<f32>>,
    attn_part: Option<CudaSlice<f32>>,
    lse: Option<CudaSlice<f32>>,
    /// P of the decode selection as bf16 bits (`sd_p`).
    p16: Option<CudaSlice<u16>>,
    /// RoPE cos/sin per (row, frequency) of the current chunk, and what it was made for
    /// (`RopeKey`): every lightning layer of a forward pass uses the same table.
    rope: Option<CudaSlice<f32>>,
    rope_key: Option<RopeKey>,
}

/// Makes `slot` hold at least `n` elements (grow-only, so steady decoding allocates nothing).
fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> BResult<()> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = Some(
            stream
                .alloc_zeros::<T>(n.max(1))
                .map_err(|e| be_err("scratch", e))?,
        );
    }
    Ok(())
}

/// Per-head norm weights of a first and an optional second buffer, and epsilon.
type HeadNorms<'a> = (&'a CudaSlice<u16>, Option<&'a CudaSlice<u16>>, f32);

/// What the cached RoPE table was made for: the inv_freq pointer, half the head size, and the
/// positions (a run of rows from a first one, or each row's own).
#[derive(PartialEq)]
enum RopeKey {
    Run(u64, usize, usize, usize),
    Rows(u64, usize, Vec<usize>),
}

/// Where a row's RoPE position comes from: `first + row`, or each row's own.
#[derive(Clone, Copy)]
enum RopeAt<'a> {
    From(usize),
    Rows(&'a [usize]),
}

/// Rows of a batched decode step launched at once (`DECODE_ROWS` in decode.cu).
const DECODE_ROWS: usize = 64;

/// `DecodeRows` of decode.cu, passed by value: each row's lightning state and position.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecodeRows {
    state: [u64; DECODE_ROWS],
    pos: [i32; DECODE_ROWS],
}

// SAFETY: plain data with the layout of the kernel's struct (64 pointers, then 64 ints).
unsafe impl cudarc::driver::DeviceRepr for DecodeRows {}

/// Sequences of a batched decode step in a sparse layer (`SEQ_ROWS` in sparse.cu).
const SEQ_ROWS: usize = 64;

/// `SeqRows` of sparse.cu, passed by value: each row's cache pointers (K, V, level-1 and
/// level-2 keys), position, tier sizes and attention split.
#[repr(C)]
#[derive(Clone, Copy)]
struct SeqRows {
    k: [u64; SEQ_ROWS],
    v: [u64; SEQ_ROWS],
    k1: [u64; SEQ_ROWS],
    k2: [u64; SEQ_ROWS],
    pos: [i32; SEQ_ROWS],
    n1: [i32; SEQ_ROWS],
    n2: [i32; SEQ_ROWS],
    split: [i32; SEQ_ROWS],
}

// SAFETY: plain data with the layout of the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for SeqRows {}

impl SeqRows {
    fn empty() -> Self {
        Self {
            k: [0; SEQ_ROWS],
            v: [0; SEQ_ROWS],
            k1: [0; SEQ_ROWS],
            k2: [0; SEQ_ROWS],
            pos: [0; SEQ_ROWS],
            n1: [0; SEQ_ROWS],
            n2: [0; SEQ_ROWS],
            split: [0; SEQ_ROWS],
        }
    }
}

/// One kernel argument.
#[derive(Clone, Copy)]
enum Arg<'a> {
    P(u64),
    I(i32),
    F(f32),
    U(u64),
    Rows(&'a DecodeRows),
    Seqs(&'a SeqRows),
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: RefCell<gemm::Gemm>,
    scratch: RefCell<Scratch>,
    device_name: String,
    target: String,
    /// Time the host has spent waiting for the device in downloads (profiling aid).
    waited: std::cell::Cell<std::time::Duration>,
    /// Per-kernel timing, with `SALA_PROFILE=1`.
    profiler: Option<profile::Profiler>,
    /// Block selection with the bit-exact CUDA-core kernels (as the CPU) instead of tensor
    /// cores, for prefill and decode (`SALA_EXACT_SELECT=1`).
    exact_select: std::cell::Cell<bool>,
    fallback: Fallback,
    wgmma: std::cell::Cell<bool>,
    /// Products of 1..=64 rows on the tensor-core GEMVs (`gemv_mma*`, the weights read once
    /// per 16 rows), or the CUDA-core ones, a launch per row (`SALA_FALLBACK=gemv-mma`).
    tensor_core_gemv: std::cell::Cell<bool>,
    /// Sparse-layer decode steps run batched (`sparse_rows_batched`), for tests.
    sparse_rows_batched: std::cell::Cell<usize>,
    /// Lightning prefill in two passes (chunk states in order, then every chunk's outputs in
    /// parallel), or one pass a block (`SALA_FALLBACK=lightning-fused`).
    lightning_two_pass: std::cell::Cell<bool>,
    /// Where per-sequence caches and states live: the page pool, or one allocation each.
    pool: Option<pool::SharedPool>,
}

/// Output rows per block of the `gemv` kernel (4 warps of 4 rows), and the largest inner size
/// it is used for.
const GEMV_ROWS_PER_BLOCK: usize = 16;
const GEMV_MAX_K: usize = 1 << 20;

/// Products with at most this many output rows run as `gemv_narrow` (a row a warp).
const GEMV_NARROW_MAX_ROWS: usize = 12288;

/// Up to this many rows (a batched decode step), products run as GEMVs whose result for a row
/// does not depend on the other rows, so batching changes no sequence's bits.
const GEMV_BATCH_ROWS: usize = 64;

/// Rows per launch of the tensor-core GEMVs (`gemv_mma16`; `gemv_mma8` up to 8), and their
/// block size (`32 * GM_WARPS` in gemv.cu).
const GEMV_MMA_ROWS: usize = 16;
const GEMV_MMA_THREADS: u32 = 512;

/// Most key splits of one decode attention (the merge reads every split's partial state).
const MAX_ATTENTION_SPLIT: usize = 32;

/// `attention_decode`: at most this many warps (64-key walks) per (query, group), and about
/// this many warps in all.
const DECODE_SPLIT_MAX: usize = 128;
const DECODE_WARPS: usize = 1024;

/// Shapes the tensor-core block selection handles: at most 16 query heads per KV group,
/// head_dim a multiple of 16 up to 128, whole level-1 windows per 64-window tile.
fn fast_select_fits(shape: AttnShape, cfg: &SparseConfig) -> bool {
    let w = cfg.windows_per_block();
    shape.group() <= 16
        && shape.head_dim.is_multiple_of(16)
        && shape.head_dim <= 128
        && w >= 1
        && 64 % w == 0
        && cfg.block_size == w * cfg.k1_stride()
}

/// From this many rows on, lightning layers run on tensor cores (`lightning_mma`).
const LIGHTNING_MMA_ROWS: usize = 64;

/// From this many rows on, lightning prefill runs in two passes (`lightning_two_pass`).
const LIGHTNING_TWO_PASS_ROWS: usize = 256;

/// `lightning_fused` cuts a chunk into at most this many ranges that run in parallel, of at
/// least `LIGHTNING_RANGE_MIN` tokens each.
const LIGHTNING_RANGES: usize = 4;
const LIGHTNING_RANGE_MIN: usize = 2048;

/// Most bytes of per-chunk lightning states `lightning_two_pass` and `lightning_mma` keep at
/// once (128 MiB measured 4% faster at 8K tokens, for 0.09 GiB more at peak).
const LIGHTNING_SCRATCH_BYTES: usize = 64 << 20;

/// Kernels to use instead of the default ones, for comparisons (`SALA_FALLBACK`, a comma list
/// of `attention` (staged prefill attention for sparse layers), `lightning` (fp32 chunked
/// lightning), `lightning-split` (the three-kernel tensor-core lightning: chunk states, scan,
/// outputs), `lightning-fused` (lightning prefill in one pass a block, `lightning_fused`),
/// `select` (block scores with the heads as MMA rows, `select_scores_mma`), `wgmma`
/// (the mma.sync twins of the wgmma kernels on Hopper too), `gemv-mma` (decode products on the
/// CUDA-core GEMVs, a launch per row), `sparse-rows` (a batched decode step's sparse layers
/// row by row) and `gemv` (with it, four output rows a warp for every CUDA-core GEMV)).
#[derive(Default, Clone, Copy)]
struct Fallback {
    attention: bool,
    lightning: bool,
    lightning_split: bool,
    lightning_fused: bool,
    select: bool,
    gemv: bool,
    gemv_mma: bool,
    sparse_rows: bool,
    wgmma: bool,
}

impl Fallback {
    /// Every name `SALA_FALLBACK` takes.
    const NAMES: [&'static str; 9] = [
        "attention",
        "lightning",
        "lightning-split",
        "lightning-fused",
        "select",
        "gemv",
        "gemv-mma",
        "sparse-rows",
        "wgmma",
    ];

    fn from_env() -> Result<Self, String> {
        Self::parse(&std::env::var("SALA_FALLBACK").unwrap_or_default())
    }

    /// A comma list of names (empty entries ignored); an unknown name is an error naming the
    /// known ones, so a typo does not silently measure the default kernels.
    fn parse(v: &str) -> Result<Self, String> {
        let names: Vec<&str> = v
            .split(',')
            .map(str::trim)
            .filter(|x| !x.is_empty())
            .collect();
        if let Some(bad) = names.iter().find(|x| !Self::NAMES.contains(x)) {
            return Err(format!(
                "SALA_FALLBACK: unknown kernel name {bad:?} (known: {})",
                Self::NAMES.join(", ")
            ));
        }
        let has = |name: &str| names.contains(&name);
        Ok(Self {
            attention: has("attention"),
            lightning: has("lightning"),
            lightning_split: has("lightning-split"),
            lightning_fused: has("lightning-fused"),
            select: has("select"),
            gemv: has("gemv"),
            gemv_mma: has("gemv-mma"),
            sparse_rows: has("sparse-rows"),
            wgmma: has("wgmma"),
        })
    }
}

/// From this many query rows on, attention runs as `attention_prefill`.
const PREFILL_ATTENTION_ROWS: usize = 64;

/// Shapes `attention_prefill` handles: at most 16 query heads per KV group, head_dim a multiple
/// of 16 up to 128; sparse: 64-token blocks, at most 128 of them per query, and a block bitmap
/// (4 bytes per 32 blocks of the sequence) within 9 KiB of shared memory.
fn prefill_attention_fits(
    shape: AttnShape,
    cfg: &SparseConfig,
    mode: SparseMode,
    total: usize,
) -> bool {
    let heads_ok =
        shape.group() <= 16 && shape.head_dim.is_multiple_of(16) && shape.head_dim <= 128;
    heads_ok
        && match mode {
            SparseMode::Dense => true,
            SparseMode::Sparse => {
                cfg.block_size == 64
                    && cfg.selected_blocks() <= 128
                    && 4 * total.div_ceil(64).div_ceil(32) <= 9 * 1024
            }
        }
}

/// Most bytes of block scores the tensor-core selection keeps at once (queries are taken in
/// groups that fit).
const SELECT_SCORES_BYTES: usize = 128 << 20;

/// From this many (query, KV group) pairs on, block selection runs as one kernel.
const SELECT_ONE_KERNEL_PAIRS: usize = 264;

/// Windows per block of `sd_lse` / `sd_p` (4 warps of 64), their threads, and the threads of
/// `sd_topk` (`SD_KEYS`, `SD_WARPS`, `SD_TOPK_THREADS` in select_decode.cu).
const SD_KEYS: usize = 256;
const SD_THREADS: u32 = 128;
const SD_TOPK_THREADS: u32 = 1024;

/// Candidate blocks of a sequence of `len` tokens: at most one per block.
fn candidate_blocks(len: usize, cfg: &SparseConfig) -> usize {
    len.div_ceil(cfg.block_size)
}

/// Dynamic shared memory of `sd_topk` / `sd_topk_scores`: a 16-bit key per candidate.
fn sd_topk_smem(len: usize, cfg: &SparseConfig) -> usize {
    (2 * candidate_blocks(len, cfg).max(1)).next_multiple_of(16)
}

/// Shapes the `sd_*` selection kernels handle: at most 16 query heads per KV group, head_dim a
/// multiple of 32 up to 128, whole level-1 strides per block, and few enough blocks for the
/// top-k's 16-bit counts.
fn decode_select_fits(shape: AttnShape, cfg: &SparseConfig, len: usize) -> bool {
    let w = cfg.windows_per_block();
    shape.group() <= 16
        && shape.head_dim.is_multiple_of(32)
        && shape.head_dim <= 128
        && w >= 1
        && cfg.block_size == w * cfg.k1_stride()
        && candidate_blocks(len, cfg) <= registry::SD_TOPK_MAX_CANDIDATES
}

fn windows(n: usize, window: usize, stride: usize) -> usize {
    if n >= window {
        (n - window) / stride + 1
    } else {
        0
    }
}

fn grid1(n: usize, block: usize) -> u32 {
    n.div_ceil(block).max(1) as u32
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads from the cache) the kernels, and creates the
    /// cuBLASLt handle. Every failure is an error naming what is missing.
    pub fn new(ordinal: usize) -> Result<Self, String> {
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
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("compute capability: {e:?}"))?;
        if major < 8 {
            return Err(format!(
                "cuda:{ordinal} has compute capability {major}.{minor}; bf16 kernels need 8.0 or later"
            ));
        }
        let target = registry::target_for(major, minor);
        let kernels = Kernels::load(&ctx, &target)?;
        let stream = ctx.default_stream();
        let gemm = gemm::Gemm::new(stream.clone())?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let profiler = profile::Profiler::from_env(&ctx);
        let fallback = Fallback::from_env()?;
        // Per-sequence buffers in one page pool (unless SALA_KV_POOL=0; pages of
        // SALA_KV_POOL_GRANULES allocation granules, 1 by default), capped at the device's memory.
        let pool_on = match std::env::var("SALA_KV_POOL").as_deref() {
            Err(_) | Ok("1") => true,
            Ok("0") => false,
            Ok(v) => return Err(format!("SALA_KV_POOL={v}: expected 0 or 1")),
        };
        let pool = if pool_on {
            let (_, total) = cudarc::driver::result::mem_get_info()
                .map_err(|e| format!("device memory: {e:?}"))?;
            let granules = match std::env::var("SALA_KV_POOL_GRANULES") {
                Ok(v) => v
                    .parse::<usize>()
                    .ok()
                    .filter(|&g| g >= 1)
                    .ok_or(format!("SALA_KV_POOL_GRANULES={v}: expected a count ≥ 1"))?,
                Err(_) => 1,
            };
            let p = pool::PagePool::new(ctx.clone(), total, granules).map_err(|e| e.0)?;
            Some(std::rc::Rc::new(RefCell::new(p)))
        } else {
            None
        };
        if profiler.is_some() {
            for line in kernels.describe() {
                eprintln!("kernel {line}");
            }
        }
        Ok(Self {
            ctx,
            stream,
            kernels,
            gemm: RefCell::new(gemm),
            scratch: RefCell::new(Scratch::default()),
            device_name,
            target,
            waited: Default::default(),
            profiler,
            wgmma: std::cell::Cell::new(!fallback.wgmma),
            fallback,
            tensor_core_gemv: std::cell::Cell::new(!fallback.gemv_mma),
            sparse_rows_batched: Default::default(),
            lightning_two_pass: std::cell::Cell::new(!fallback.lightning_fused),
            pool,
            exact_select: std::cell::Cell::new(
                std::env::var("SALA_EXACT_SELECT").is_ok_and(|v| v != "0"),
            ),
        })
    }

    /// Total time the host has waited for the device to finish work before a download: with
    /// the host issuing faster than the device runs, this is the device's lead.
    pub fn host_wait(&self) -> std::time::Duration {
        self.waited.get()
    }

    /// Selects blocks with the bit-exact CUDA-core kernels (as the CPU) instead of the
    /// tensor-core ones (same scores up to rounding; a near-tie may pick another block).
    pub fn set_exact_selection(&self, exact: bool) {
        self.exact_select.set(exact);
    }

    /// Whether this GPU runs the sm_90a (wgmma) kernels.
    pub fn has_wgmma(&self) -> bool {
        registry::has_wgmma(&self.target)
    }

    /// Runs the wgmma kernels where the GPU has them (the default unless
    /// `SALA_FALLBACK=wgmma`), or their mma.sync twins.
    pub fn set_wgmma(&self, on: bool) {
        self.wgmma.set(on);
    }

    /// Runs lightning prefill in two passes (the default) or in one pass a block.
    pub fn set_lightning_two_pass(&self, on: bool) {
        self.lightning_two_pass.set(on);
    }

    fn use_wgmma(&self) -> bool {
        self.wgmma.get() && self.has_wgmma()
    }

    /// Runs decode-sized products on the tensor-core GEMVs (the default unless
    /// `SALA_FALLBACK=gemv-mma`) or on the CUDA-core ones, a launch per row.
    pub fn set_tensor_core_gemv(&self, on: bool) {
        self.tensor_core_gemv.set(on);
    }

    /// How many sparse-layer calls of batched decode steps ran batched, one launch per kernel
    /// for all rows (the others ran row by row).
    pub fn sparse_rows_batched_calls(&self) -> usize {
        self.sparse_rows_batched.get()
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

    /// Tensor-core block selection for the `q.rows` queries at positions `first..` into the
    /// block lists at `blocks`, in groups of queries whose block scores fit the scratch.
    fn select_fast(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        // Queries per block of select_scores_mma (8 warps of 2).
        const QUERIES_PER_BLOCK: usize = 16;
        let t = q.rows;
        let kvh = shape.kv_heads;
        let k_sel = cfg.selected_blocks();
        let stride = cache.len.div_ceil(cfg.block_size).max(1);
        let per_query = kvh * stride * 4;
        let group = (SELECT_SCORES_BYTES / per_query).max(QUERIES_PER_BLOCK) / QUERIES_PER_BLOCK
            * QUERIES_PER_BLOCK;
        let bs = self.scratch_ptr(|s| &mut s.p, group.min(t) * kvh * stride)?;
        let mut a = 0;
        // Keys as MMA rows where a block holds 4 level-1 windows (the released config): on
        // Hopper's wgmma for d = 128, else on mma.sync.
        let keys_as_rows = cfg.block_size == 4 * cfg.k1_stride() && !self.fallback.select;
        let kernel = if keys_as_rows && shape.head_dim == 128 && self.use_wgmma() {
            K::SelectScoresWg
        } else if keys_as_rows {
            K::SelectScoresT
        } else {
            K::SelectScoresMma
        };
        let smem = match kernel {
            K::SelectScoresWg => registry::SELECT_WG_SMEM as u32,
            _ => 0,
        };
        while a < t {
            let n = group.min(t - a);
            let pos = first + a;
            self.launch(
                kernel,
                (n.div_ceil(QUERIES_PER_BLOCK) as u32, kvh as u32, 1),
                256,
                smem,
                &[
                    Arg::P(self.row_ptr(q, a)),
                    Arg::P(self.ptr(&cache.k1)),
                    Arg::P(self.ptr(&cache.k2)),
                    Arg::I(cache.n1 as i32),
                    Arg::I(cache.n2 as i32),
                    Arg::I(n as i32),
                    Arg::I(pos as i32),
                    Arg::I(shape.heads as i32),
                    Arg::I(kvh as i32),
                    Arg::I(shape.head_dim as i32),
                    Arg::F(shape.scale() as f32),
                    Arg::I(cfg.block_size as i32),
                    Arg::I(cfg.k1_stride() as i32),
                    Arg::I(cfg.k2_window() as i32),
                    Arg::I(cfg.k2_stride() as i32),
                    Arg::I(cfg.init_blocks as i32),
                    Arg::I(cfg.local_blocks() as i32),
                    Arg::I(k_sel as i32),
                    Arg::P(bs),
                    Arg::I(stride as i32),
                ],
            )?;
            let out = Arg::P(blocks + (a * kvh * k_sel * 4) as u64);
            if candidate_blocks(cache.len, cfg) <= registry::SD_TOPK_MAX_CANDIDATES {
                self.launch(
                    K::SdTopkScores,
                    ((n * kvh) as u32, 1, 1),
                    SD_TOPK_THREADS,
                    sd_topk_smem(cache.len, cfg) as u32,
                    &[
                        Arg::P(bs),
                        Arg::I(stride as i32),
                        Arg::I(pos as i32),
                        Arg::I(kvh as i32),
                        Arg::I(cfg.block_size as i32),
                        Arg::I(cfg.init_blocks as i32),
                        Arg::I(cfg.local_blocks() as i32),
                        Arg::I(k_sel as i32),
                        out,
                    ],
                )?;
            } else {
                self.launch(
                    K::SelectTopkScores,
                    ((n * kvh) as u32, 1, 1),
                    256,
                    0,
                    &[
                        Arg::P(bs),
                        Arg::I(stride as i32),
                        Arg::I(pos as i32),
                        Arg::I(kvh as i32),
                        Arg::I(cfg.block_size as i32),
                        Arg::I(cfg.k1_stride() as i32),
                        Arg::I(cfg.init_blocks as i32),
                        Arg::I(cfg.local_blocks() as i32),
                        Arg::I(k_sel as i32),
                        out,
                    ],
                )?;
            }
            a += n;
        }
        Ok(())
    }

    /// Lightning prefill in one pass a block (`lightning_fused`). A long chunk is cut into
    /// ranges that run in parallel: their state contributions first (state-only passes), the
    /// state before each range from those (`lightning_range_states`), then every range's
    /// outputs from its own starting state.
    #[allow(clippy::too_many_arguments)]
    fn lightning_fused(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        let (t, d, heads) = (q.rows, shape.head_dim, shape.heads);
        let ranges_wanted = (t / LIGHTNING_RANGE_MIN).clamp(1, LIGHTNING_RANGES);
        let range_len = t.div_ceil(ranges_wanted).next_multiple_of(64);
        let n_ranges = t.div_ceil(range_len);
        let slots = if n_ranges > 1 {
            self.scratch_ptr(|s| &mut s.lightning, n_ranges * heads * d * d)?
        } else {
            0
        };
        let args = |state_only: bool| {
            vec![
                Arg::P(self.ptr(&q.buf)),
                Arg::P(self.ptr(&k.buf)),
                Arg::P(self.ptr(&v.buf)),
                Arg::P(self.ptr(state)),
                Arg::P(self.ptr(&out.buf)),
                Arg::P(self.ptr(slopes)),
                Arg::I(t as i32),
                Arg::I(heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(d as i32),
                Arg::F(shape.scale() as f32),
                Arg::I(range_len as i32),
                Arg::P(slots),
                Arg::I(state_only as i32),
            ]
        };
        let smem = registry::lightning_fused_smem(d) as u32;
        let grid = |z: usize| (heads as u32, (d / 32) as u32, z as u32);
        if n_ranges > 1 {
            self.launch(
                K::LightningFused,
                grid(n_ranges - 1),
                128,
                smem,
                &args(true),
            )?;
            self.launch(
                K::LightningRangeStates,
                (grid1(heads * d * d, 256), 1, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(state)),
                    Arg::P(slots),
                    Arg::P(self.ptr(slopes)),
                    Arg::I(heads as i32),
                    Arg::I(d as i32),
                    Arg::I(n_ranges as i32),
                    Arg::I(range_len as i32),
                ],
            )?;
        }
        self.launch(K::LightningFused, grid(n_ranges), 128, smem, &args(false))
    }

    /// Lightning prefill in two passes over windows of whole chunks whose states fit the
    /// scratch: `lightning_states` walks a window's chunks in order and keeps the state before
    /// each (bf16 hi + lo), then `lightning_outputs` computes every chunk's outputs at once.
    /// The same operations in the same order as the one-pass kernel: the same bits.
    #[allow(clippy::too_many_arguments)]
    fn lightning_two_pass(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        const CHUNK: usize = 64;
        let (t, d, heads) = (q.rows, shape.head_dim, shape.heads);
        // A chunk's states: heads · d · d (hi, lo) pairs, 4 bytes each.
        let per_chunk = heads * d * d;
        let window = (LIGHTNING_SCRATCH_BYTES / (4 * per_chunk)).max(1) * CHUNK;
        let states = self.scratch_ptr(
            |s| &mut s.lightning,
            per_chunk * t.min(window).div_ceil(CHUNK),
        )?;
        let mut a = 0;
        while a < t {
            let n_tok = window.min(t - a);
            let (qp, kp, vp, op) = (
                self.row_ptr(q, a),
                self.row_ptr(k, a),
                self.row_ptr(v, a),
                self.row_ptr(out, a),
            );
            self.launch(
                K::LightningStates,
                (heads as u32, (d / 32) as u32, 1),
                2 * d as u32,
                registry::lightning_states_smem(d) as u32,
                &[
                    Arg::P(kp),
                    Arg::P(vp),
                    Arg::P(self.ptr(state)),
                    Arg::P(states),
                    Arg::P(self.ptr(slopes)),
                    Arg::I(n_tok as i32),
                    Arg::I(heads as i32),
                    Arg::I(shape.kv_heads as i32),
                    Arg::I(d as i32),
                ],
            )?;
            self.launch(
                K::LightningOutputs,
                (n_tok.div_ceil(CHUNK) as u32, heads as u32, (d / 64) as u32),
                128,
                registry::lightning_outputs_smem(d) as u32,
                &[
                    Arg::P(qp),
                    Arg::P(kp),
                    Arg::P(vp),
                    Arg::P(states),
                    Arg::P(op),
                    Arg::P(self.ptr(slopes)),
                    Arg::I(n_tok as i32),
                    Arg::I(heads as i32),
                    Arg::I(shape.kv_heads as i32),
                    Arg::I(d as i32),
                    Arg::F(shape.scale() as f32),
                ],
            )?;
            a += n_tok;
        }
        Ok(())
    }

    /// Lightning prefill on tensor cores: chunk states, their scan, then the outputs, over
    /// ranges of chunks whose states fit the scratch.
    #[allow(clippy::too_many_arguments)]
    fn lightning_mma(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        const CHUNK: usize = 64;
        let (heads, d) = (shape.heads, shape.head_dim);
        let per_chunk = heads * d * d;
        let range = (LIGHTNING_SCRATCH_BYTES / (4 * per_chunk)).max(1) * CHUNK;
        let t = q.rows;
        let ds = self.scratch_ptr(
            |s| &mut s.lightning,
            per_chunk * t.min(range).div_ceil(CHUNK),
        )?;
        let mut a = 0;
        while a < t {
            let n_tok = range.min(t - a);
            let n = n_tok.div_ceil(CHUNK);
            let last_len = n_tok - (n - 1) * CHUNK;
            let (qp, kp, vp, op) = (
                self.row_ptr(q, a),
                self.row_ptr(k, a),
                self.row_ptr(v, a),
                self.row_ptr(out, a),
            );
            let dims = [
                Arg::I(n_tok as i32),
                Arg::I(heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(d as i32),
            ];
            let mut args = vec![Arg::P(kp), Arg::P(vp), Arg::P(ds), Arg::P(self.ptr(slopes))];
            args.extend_from_slice(&dims);
            self.launch(
                K::LightningChunkState,
                (n as u32, heads as u32, 1),
                256,
                0,
                &args,
            )?;
            self.launch(
                K::LightningChunkScan,
                (grid1(per_chunk, 256), 1, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(state)),
                    Arg::P(ds),
                    Arg::P(self.ptr(slopes)),
                    Arg::I(n as i32),
                    Arg::I(last_len as i32),
                    Arg::I(heads as i32),
                    Arg::I(d as i32),
                ],
            )?;
            let mut args = vec![
                Arg::P(qp),
                Arg::P(kp),
                Arg::P(vp),
                Arg::P(ds),
                Arg::P(op),
                Arg::P(self.ptr(slopes)),
            ];
            args.extend_from_slice(&dims);
            args.push(Arg::F(shape.scale() as f32));
            self.launch(
                K::LightningChunkOut,
                (n as u32, heads as u32, 1),
                128,
                0,
                &args,
            )?;
            a += n_tok;
        }
        Ok(())
    }

    /// Block selection for few queries (decode) on tensor cores, spread over the GPU: partial
    /// level-2 normalisers per slice of K2, P per slice of K1, then one block per (query,
    /// group) pools and picks the blocks (`select_decode.cu`).
    #[allow(clippy::too_many_arguments)]
    fn select_decode(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        let pairs = q.rows * shape.kv_heads;
        let g = shape.group();
        let n_split = cache.n2.div_ceil(SD_KEYS).max(1);
        // A multiple of 8: sd_p writes two P values a word, sd_topk stages rows in 16 bytes.
        let p_stride = cache.n1.max(1).next_multiple_of(8);
        let part = self.scratch_ptr(|s| &mut s.lse, pairs * n_split * g * 2)?;
        let p16 = self.scratch_ptr(|s| &mut s.p16, pairs * p_stride)?;
        let common = [
            Arg::P(self.ptr(&q.buf)),
            Arg::P(self.ptr(&cache.k2)),
            Arg::I(cache.n2 as i32),
            Arg::I(first as i32),
            Arg::I(shape.heads as i32),
            Arg::I(shape.kv_heads as i32),
            Arg::I(shape.head_dim as i32),
            Arg::F(shape.scale() as f32),
            Arg::I(cfg.k2_window() as i32),
            Arg::I(cfg.k2_stride() as i32),
        ];
        let mut args = common.to_vec();
        args.push(Arg::P(part));
        self.launch(
            K::SdLse,
            (pairs as u32, n_split as u32, 1),
            SD_THREADS,
            0,
            &args,
        )?;
        let mut args = common.to_vec();
        args[1] = Arg::P(self.ptr(&cache.k1));
        args[2] = Arg::I(cache.n1 as i32);
        args[8] = Arg::I(cfg.k1_window() as i32);
        args[9] = Arg::I(cfg.k1_stride() as i32);
        args.extend([
            Arg::P(part),
            Arg::I(n_split as i32),
            Arg::P(p16),
            Arg::I(p_stride as i32),
        ]);
        self.launch(
            K::SdP,
            (pairs as u32, cache.n1.div_ceil(SD_KEYS).max(1) as u32, 1),
            SD_THREADS,
            0,
            &args,
        )?;
        let keys = sd_topk_smem(cache.len, cfg);
        let stage_p = keys + 2 * p_stride <= registry::SD_TOPK_MAX_SMEM;
        let smem = keys + if stage_p { 2 * p_stride } else { 0 };
        self.launch(
            K::SdTopk,
            (pairs as u32, 1, 1),
            SD_TOPK_THREADS,
            smem as u32,
            &[
                Arg::P(p16),
                Arg::I(p_stride as i32),
                Arg::I(cache.n1 as i32),
                Arg::I(first as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(cfg.block_size as i32),
                Arg::I(cfg.k1_window() as i32),
                Arg::I(cfg.k1_stride() as i32),
                Arg::I(cfg.init_blocks as i32),
                Arg::I(cfg.local_blocks() as i32),
                Arg::I(cfg.selected_blocks() as i32),
                Arg::I(stage_p as i32),
                Arg::P(blocks),
            ],
        )
    }

    /// The CPU's bit-exact block selection: one block per (query, group) for many queries,
    /// else the normaliser, scores and top-k spread over many blocks.
    #[allow(clippy::too_many_arguments)]
    fn select_exact(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        q: &DevAct,
        cache: &DevSparseCache,
        first: usize,
        blocks: u64,
    ) -> BResult<()> {
        let t = q.rows;
        let pairs = t * shape.kv_heads;
        let k_sel = cfg.selected_blocks();
        let p_stride = cache.n1.max(1);
        let p = self.scratch_ptr(|s| &mut s.p, pairs * p_stride)?;
        let (block, smem) = select_launch(shape);
        let mut args = vec![
            Arg::P(self.ptr(&q.buf)),
            Arg::P(self.ptr(&cache.k1)),
            Arg::P(self.ptr(&cache.k2)),
            Arg::I(cache.n1 as i32),
            Arg::I(cache.n2 as i32),
            Arg::I(t as i32),
            Arg::I(first as i32),
            Arg::I(shape.heads as i32),
            Arg::I(shape.kv_heads as i32),
            Arg::I(shape.head_dim as i32),
            Arg::F(shape.scale() as f32),
            Arg::I(cfg.block_size as i32),
            Arg::I(cfg.k1_window() as i32),
            Arg::I(cfg.k1_stride() as i32),
            Arg::I(cfg.k2_window() as i32),
            Arg::I(cfg.k2_stride() as i32),
            Arg::I(cfg.init_blocks as i32),
            Arg::I(cfg.local_blocks() as i32),
            Arg::I(k_sel as i32),
            Arg::P(p),
            Arg::I(p_stride as i32),
            Arg::P(blocks),
        ];
        if pairs >= SELECT_ONE_KERNEL_PAIRS {
            // Many queries (prefill): one block per (query, group) fills the GPU.
            self.launch(K::SparseSelect, (pairs as u32, 1, 1), block, smem, &args)?;
        } else {
            // Few queries (decode): spread normaliser, scores and top-k over many blocks.
            args.push(Arg::P(self.scratch_ptr(|s| &mut s.lse, t * shape.heads)?));
            let one_head = ((shape.head_dim + 3) * 4) as u32;
            self.launch(
                K::SelectLse,
                (pairs as u32, shape.group() as u32, 1),
                256,
                one_head,
                &args,
            )?;
            self.launch(
                K::SelectScores,
                (pairs as u32, cache.n1.div_ceil(256).max(1) as u32, 1),
                256,
                smem,
                &args,
            )?;
            self.launch(K::SelectTopk, (pairs as u32, 1, 1), 256, 0, &args)?;
        }
        Ok(())
    }

    /// Compresses the windows of both key tiers that `cache.len` keys complete and the tiers
    /// do not hold yet (SPEC §5.3).
    fn compress_new_windows(&self, cache: &mut DevSparseCache, cfg: &SparseConfig) -> BResult<()> {
        let kw = cache.kv_width;
        for (level, window, stride) in [
            (1, cfg.k1_window(), cfg.k1_stride()),
            (2, cfg.k2_window(), cfg.k2_stride()),
        ] {
            let (old, tier) = if level == 1 {
                (cache.n1, &cache.k1)
            } else {
                (cache.n2, &cache.k2)
            };
            let new = windows(cache.len, window, stride);
            if new > old {
                let (grid, block) = compress_launch(new - old, kw);
                self.launch(
                    K::CompressKeys,
                    grid,
                    block,
                    0,
                    &[
                        Arg::P(self.ptr(&cache.k)),
                        Arg::P(self.ptr(tier)),
                        Arg::I(old as i32),
                        Arg::I((new - old) as i32),
                        Arg::I(kw as i32),
                        Arg::I(window as i32),
                        Arg::I(stride as i32),
                    ],
                )?;
            }
            if level == 1 {
                cache.n1 = new;
            } else {
                cache.n2 = new;
            }
        }
        Ok(())
    }

    /// Attention of few queries (decode) split over the blocks of each (query, group) walk, a
    /// warp per block (`attention_decode`), then `attention_merge`.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(
        &self,
        shape: AttnShape,
        mode: SparseMode,
        q: &DevAct,
        cache: &DevSparseCache,
        blocks: u64,
        k_sel: usize,
        out: &mut DevAct,
    ) -> BResult<()> {
        let t = q.rows;
        let first = cache.len - t;
        let pairs = t * shape.kv_heads;
        let n_split = decode_split(mode, cache.len, k_sel, pairs);
        let part = self.scratch_ptr(
            |s| &mut s.attn_part,
            n_split * t * shape.heads * (shape.head_dim + 2),
        )?;
        self.launch(
            K::AttentionDecode,
            (pairs as u32, n_split.div_ceil(4) as u32, 1),
            128,
            0,
            &[
                Arg::P(self.ptr(&q.buf)),
                Arg::P(self.ptr(&cache.k)),
                Arg::P(self.ptr(&cache.v)),
                Arg::P(part),
                Arg::I(t as i32),
                Arg::I(first as i32),
                Arg::I(shape.heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(shape.head_dim as i32),
                Arg::F(shape.scale() as f32),
                Arg::P(blocks),
                Arg::I(k_sel as i32),
                Arg::I(n_split as i32),
            ],
        )?;
        self.attention_merge(shape, t, part, n_split, out)
    }

    /// Whether attention runs a warp per (query, group) and 64-key block walk
    /// (`attention_gather`, `attention_decode`).
    fn warp_walk(&self, shape: AttnShape, cfg: &SparseConfig, mode: SparseMode) -> bool {
        shape.group() <= 16
            && matches!(shape.head_dim, 64 | 128)
            && (mode == SparseMode::Dense || cfg.block_size == 64)
            && !self.fallback.attention
    }

    /// `sparse_rows` in one launch per kernel for all rows: each row's K and V appended to its
    /// cache, then block selection (sparse) and attention as `sparse_attention` runs them for
    /// one row (`select_decode`, `attention_decode`), each row with its own cache, position and
    /// split, so every row's result has the bits it gets alone. The caller checked that all
    /// rows have one mode and fit (`sparse_rows_fit`).
    #[allow(clippy::too_many_arguments)]
    fn sparse_rows_batched(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        caches: &mut [&mut DevSparseCache],
        out: &mut DevAct,
    ) -> BResult<()> {
        let rows = caches.len();
        let k_sel = cfg.selected_blocks();
        self.sparse_rows_batched
            .set(self.sparse_rows_batched.get() + 1);
        let mut t = SeqRows::empty();
        for (r, cache) in caches.iter_mut().enumerate() {
            let kw = cache.kv_width;
            let first = cache.len;
            self.reserve(cache, first + 1, cfg, false)?;
            self.copy(&cache.k, first * kw, &k.buf, r * kw, kw)?;
            self.copy(&cache.v, first * kw, &v.buf, r * kw, kw)?;
            cache.len += 1;
            self.compress_new_windows(cache, cfg)?;
            t.k[r] = self.ptr(&cache.k);
            t.v[r] = self.ptr(&cache.v);
            t.k1[r] = self.ptr(&cache.k1);
            t.k2[r] = self.ptr(&cache.k2);
            t.pos[r] = first as i32;
            t.n1[r] = cache.n1 as i32;
            t.n2[r] = cache.n2 as i32;
            t.split[r] = decode_split(mode, cache.len, k_sel, shape.kv_heads) as i32;
        }
        let pairs = rows * shape.kv_heads;
        let max_of = |f: &dyn Fn(&DevSparseCache) -> usize| caches.iter().map(|c| f(c)).max();
        let blocks = match mode {
            SparseMode::Dense => 0,
            SparseMode::Sparse => {
                let blocks = self.scratch_ptr(|s| &mut s.blocks, pairs * k_sel)?;
                let g = shape.group();
                let (n1, n2) = (
                    max_of(&|c| c.n1).unwrap_or(0),
                    max_of(&|c| c.n2).unwrap_or(0),
                );
                let len = max_of(&|c| c.len).unwrap_or(0);
                let n_split = n2.div_ceil(SD_KEYS).max(1);
                let p_stride = n1.max(1).next_multiple_of(8);
                let part = self.scratch_ptr(|s| &mut s.lse, pairs * n_split * g * 2)?;
                let p16 = self.scratch_ptr(|s| &mut s.p16, pairs * p_stride)?;
                let head = [
                    Arg::P(self.ptr(&q.buf)),
                    Arg::Seqs(&t),
                    Arg::I(shape.heads as i32),
                    Arg::I(shape.kv_heads as i32),
                    Arg::I(shape.head_dim as i32),
                    Arg::F(shape.scale() as f32),
                ];
                let mut args = head.to_vec();
                args.extend([
                    Arg::I(cfg.k2_window() as i32),
                    Arg::I(cfg.k2_stride() as i32),
                    Arg::P(part),
                ]);
                let grid = (pairs as u32, n_split as u32, 1);
                self.launch(K::SdLseRows, grid, SD_THREADS, 0, &args)?;
                let mut args = head.to_vec();
                args.extend([
                    Arg::I(cfg.k1_window() as i32),
                    Arg::I(cfg.k1_stride() as i32),
                    Arg::P(part),
                    Arg::I(n_split as i32),
                    Arg::P(p16),
                    Arg::I(p_stride as i32),
                ]);
                let grid = (pairs as u32, n1.div_ceil(SD_KEYS).max(1) as u32, 1);
                self.launch(K::SdPRows, grid, SD_THREADS, 0, &args)?;
                let keys = sd_topk_smem(len, cfg);
                let stage_p = keys + 2 * p_stride <= registry::SD_TOPK_MAX_SMEM;
                let smem = keys + if stage_p { 2 * p_stride } else { 0 };
                self.launch(
                    K::SdTopkRows,
                    (pairs as u32, 1, 1),
                    SD_TOPK_THREADS,
                    smem as u32,
                    &[
                        Arg::P(p16),
                        Arg::I(p_stride as i32),
                        Arg::Seqs(&t),
                        Arg::I(shape.kv_heads as i32),
                        Arg::I(cfg.block_size as i32),
                        Arg::I(cfg.k1_window() as i32),
                        Arg::I(cfg.k1_stride() as i32),
                        Arg::I(cfg.init_blocks as i32),
                        Arg::I(cfg.local_blocks() as i32),
                        Arg::I(k_sel as i32),
                        Arg::I(stage_p as i32),
                        Arg::P(blocks),
                    ],
                )?;
                blocks
            }
        };
        let n_split = t.split[..rows].iter().copied().max().unwrap_or(1).max(1) as usize;
        let part = self.scratch_ptr(
            |s| &mut s.attn_part,
            n_split * rows * shape.heads * (shape.head_dim + 2),
        )?;
        self.launch(
            K::AttentionDecodeRows,
            (pairs as u32, n_split.div_ceil(4) as u32, 1),
            128,
            0,
            &[
                Arg::P(self.ptr(&q.buf)),
                Arg::Seqs(&t),
                Arg::P(part),
                Arg::I(rows as i32),
                Arg::I(shape.heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(shape.head_dim as i32),
                Arg::F(shape.scale() as f32),
                Arg::P(blocks),
                Arg::I(k_sel as i32),
                Arg::I(n_split as i32),
            ],
        )?;
        self.attention_merge(shape, rows, part, n_split, out)
    }

    /// Whether `sparse_rows_batched` takes these rows: at most `SEQ_ROWS`, one mode, and each
    /// row (its cache one token longer) on the path `sparse_attention` takes for one decode row
    /// (`select_decode` when sparse, then `attention_decode`).
    fn sparse_rows_fit(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        modes: &[SparseMode],
        caches: &[&mut DevSparseCache],
    ) -> Option<SparseMode> {
        let mode = *modes.first()?;
        let one_mode = modes.iter().all(|&m| m == mode);
        let select_ok = mode == SparseMode::Dense
            || (!self.exact_select.get()
                && caches
                    .iter()
                    .all(|c| decode_select_fits(shape, cfg, c.len + 1)));
        (caches.len() <= SEQ_ROWS
            && !self.fallback.sparse_rows
            && modes.len() == caches.len()
            && one_mode
            && shape.kv_heads < SELECT_ONE_KERNEL_PAIRS
            && self.warp_walk(shape, cfg, mode)
            && select_ok)
            .then_some(mode)
    }

    /// Combines the `n_split` partial attention states at `part` of `t` queries into `out`
    /// (`attention_merge`).
    fn attention_merge(
        &self,
        shape: AttnShape,
        t: usize,
        part: u64,
        n_split: usize,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.launch(
            K::AttentionMerge,
            ((t * shape.heads) as u32, 1, 1),
            shape.head_dim as u32,
            0,
            &[
                Arg::P(part),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(t as i32),
                Arg::I(shape.heads as i32),
                Arg::I(shape.head_dim as i32),
                Arg::I(n_split as i32),
            ],
        )
    }

    /// With `SALA_PROFILE=1`: device milliseconds and launches per kernel since the last call.
    pub fn profile_report(&self) -> Option<Vec<(String, f64, usize)>> {
        self.profiler.as_ref().map(|p| p.report())
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> BResult<()> {
        self.stream
            .synchronize()
            .map_err(|e| be_err("synchronize", e))
    }

    /// (bytes in use on the device by every process, total bytes).
    pub fn memory(&self) -> BResult<(usize, usize)> {
        let (free, total) = self
            .ctx
            .mem_get_info()
            .map_err(|e| be_err("memory info", e))?;
        Ok((total - free, total))
    }

    fn ptr<T>(&self, s: &impl DevMem<T>) -> u64 {
        s.dev_ptr(&self.stream)
    }

    /// The device address of row `row` of `a`.
    fn row_ptr(&self, a: &DevAct, row: usize) -> u64 {
        self.ptr(&a.buf) + (row * a.cols * 2) as u64
    }

    fn launch(
        &self,
        k: K,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> BResult<()> {
        self.launch_shaped(k, None, grid, block, smem, args)
    }

    /// `launch`, profiled (`SALA_PROFILE`) under the kernel's name and `shape` (rows x cols).
    fn launch_shaped(
        &self,
        k: K,
        shape: Option<(usize, usize)>,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> BResult<()> {
        let f = self.kernels.get(k);
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::P(p) | Arg::U(p) => b.arg(p),
                Arg::I(i) => b.arg(i),
                Arg::F(x) => b.arg(x),
                Arg::Rows(t) => b.arg(*t),
                Arg::Seqs(t) => b.arg(*t),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem,
        };
        let t0 = self.profiler.as_ref().and_then(|p| p.start(&self.stream));
        unsafe { b.launch(cfg) }.map_err(|e| be_err(&format!("launching {:?}", k), e))?;
        if let Some(p) = &self.profiler {
            let name = match shape {
                Some((r, c)) => format!("{k:?} {r}x{c}"),
                None => format!("{k:?}"),
            };
            p.end(name, t0, &self.stream);
        }
        Ok(())
    }

    fn alloc_u16(&self, n: usize) -> BResult<CudaSlice<u16>> {
        self.stream
            .alloc_zeros::<u16>(n.max(1))
            .map_err(|e| be_err(&format!("allocating {} MiB", (2 * n) >> 20), e))
    }

    fn upload_bf16(&self, name: &str, t: &HostTensor<'_>) -> BResult<CudaSlice<u16>> {
        let bits: Vec<u16> = match t.dtype {
            HostDType::Bf16 => t
                .bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
            _ => t
                .to_f32()
                .into_iter()
                .map(|x| half::bf16::from_f32(x).to_bits())
                .collect(),
        };
        self.stream
            .clone_htod(&bits)
            .map_err(|e| be_err(&format!("uploading {name}"), e))
    }

    /// Fills `n` bf16 values with seeded normal values (never zero).
    pub fn random_bf16(&self, n: usize, seed: u64, mean: f32, std: f32) -> BResult<CudaSlice<u16>> {
        let buf = self.alloc_u16(n)?;
        self.fill_random_mean(self.ptr(&buf), n, seed, mean, std)?;
        Ok(buf)
    }

    /// Writes `n` seeded normal bf16 values `mean + std·z` (never zero) at device address `at`.
    fn fill_random_mean(&self, at: u64, n: usize, seed: u64, mean: f32, std: f32) -> BResult<()> {
        self.launch(
            K::FillRandom,
            (grid1(n, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(at),
                Arg::U(n as u64),
                Arg::U(seed),
                Arg::F(mean),
                Arg::F(std),
            ],
        )
    }

    fn fill_random(&self, at: u64, n: usize, seed: u64, std: f32) -> BResult<()> {
        self.fill_random_mean(at, n, seed, 0.0, std)
    }

    /// Activations `[rows, cols]` from host values (rounded to bf16).
    pub fn act_from_host(&self, data: &[f32], cols: usize) -> BResult<DevAct> {
        let bits: Vec<u16> = data
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let rows = data.len() / cols;
        Ok(DevAct {
            buf: self
                .stream
                .clone_htod(&bits)
                .map_err(|e| be_err("upload", e))?,
            rows,
            cols,
            cap_rows: rows,
        })
    }

    /// An f32 buffer (a lightning state) from the host.
    pub fn f32_from_host(&self, data: &[f32]) -> BResult<CudaSlice<f32>> {
        self.stream
            .clone_htod(data)
            .map_err(|e| be_err("upload", e))
    }

    /// An f32 buffer (a lightning state) to the host.
    pub fn f32_to_host(&self, buf: &CudaSlice<f32>) -> BResult<Vec<f32>> {
        self.stream
            .clone_dtoh(buf)
            .map_err(|e| be_err("download", e))
    }

    /// Copies device bf16 values to the host as f32.
    pub fn download(&self, buf: &CudaSlice<u16>, n: usize) -> BResult<Vec<f32>> {
        let mut bits = vec![0u16; buf.len()];
        let start = std::time::Instant::now();
        self.synchronize()?;
        self.waited.set(self.waited.get() + start.elapsed());
        self.stream
            .memcpy_dtoh(buf, &mut bits)
            .map_err(|e| be_err("download", e))?;
        Ok(bits[..n]
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect())
    }

    /// Copies `bytes` from `src + src_off` to `dst + dst_off` (offsets in elements of T).
    fn copy<T>(
        &self,
        dst: &impl DevMem<T>,
        dst_off: usize,
        src: &impl DevMem<T>,
        src_off: usize,
        n: usize,
    ) -> BResult<()> {
        let sz = std::mem::size_of::<T>();
        if n == 0 {
            return Ok(());
        }
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.ptr(dst) + (dst_off * sz) as u64,
                self.ptr(src) + (src_off * sz) as u64,
                n * sz,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| be_err("device copy", e))
    }

    /// Grows the cache to hold at least `needed` tokens, keeping its contents.
    /// Grows `c` to hold `needed` tokens: to exactly that with `exact`, else at least doubling.
    fn reserve(
        &self,
        c: &mut DevSparseCache,
        needed: usize,
        cfg: &SparseConfig,
        exact: bool,
    ) -> BResult<()> {
        if needed <= c.cap {
            return Ok(());
        }
        let cap = if exact {
            needed
        } else {
            needed.max(2 * c.cap).max(256)
        };
        let kw = c.kv_width;
        self.grow(&mut c.k, c.len * kw, cap * kw)?;
        self.grow(&mut c.v, c.len * kw, cap * kw)?;
        let n1 = windows(cap, cfg.k1_window(), cfg.k1_stride()) + 1;
        self.grow(&mut c.k1, c.n1 * kw, n1 * kw)?;
        let n2 = windows(cap, cfg.k2_window(), cfg.k2_stride()) + 1;
        self.grow(&mut c.k2, c.n2 * kw, n2 * kw)?;
        c.cap = cap;
        Ok(())
    }

    /// Makes `store` hold `n` elements, keeping its first `kept`: in place in the page pool,
    /// else by a new allocation and a copy.
    fn grow(&self, store: &mut Store<u16>, kept: usize, n: usize) -> BResult<()> {
        match store {
            Store::Own(old) => {
                let new = self.alloc_u16(n)?;
                self.copy(&new, 0, old, 0, kept)?;
                *store = Store::Own(new);
            }
            Store::Paged { buf, len } => {
                buf.ensure(n * std::mem::size_of::<u16>())?;
                *len = (*len).max(n);
            }
        }
        Ok(())
    }

    /// A per-sequence buffer of `n` elements of `T` (zeroed when `zero`): in the page pool
    /// when there is one.
    fn new_store<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
        zero: bool,
    ) -> BResult<Store<T>> {
        let size = std::mem::size_of::<T>();
        match &self.pool {
            Some(pool) => {
                let mut buf = pool::PagedBuf::new(pool, &self.stream, n * size)?;
                buf.ensure(n * size)?;
                if zero && n > 0 {
                    unsafe {
                        cudarc::driver::result::memset_d8_async(
                            buf.ptr(),
                            0,
                            n * size,
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(|e| be_err("clearing a pool buffer", e))?;
                }
                Ok(Store::Paged { buf, len: n })
            }
            None => {
                let s = self
                    .stream
                    .alloc_zeros::<T>(n.max(1))
                    .map_err(|e| be_err(&format!("allocating {} MiB", (n * size) >> 20), e))?;
                Ok(Store::Own(s))
            }
        }
    }

    /// The page pool per-sequence buffers come from, if any.
    pub fn page_pool(&self) -> Option<&pool::SharedPool> {
        self.pool.as_ref()
    }

    /// Takes the caches and states of sequences made from now on from a new page pool of at
    /// most `limit_bytes` (those made before keep theirs).
    pub fn use_page_pool(&mut self, limit_bytes: usize) -> BResult<()> {
        let p = pool::PagePool::new(self.ctx.clone(), limit_bytes, 1)?;
        self.pool = Some(std::rc::Rc::new(RefCell::new(p)));
        Ok(())
    }

    /// Gives the caches and states of sequences made from now on their own allocations.
    pub fn use_own_allocations(&mut self) {
        self.pool = None;
    }

    /// Caps the memory the caches and states of all sequences may take together (the page
    /// pool's size; own allocations are checked by the memory plan alone).
    pub fn limit_cache_memory(&self, bytes: usize) {
        if let Some(p) = &self.pool {
            p.borrow_mut().set_limit(bytes);
        }
    }

    fn scratch_ptr<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        pick: impl FnOnce(&mut Scratch) -> &mut Option<CudaSlice<T>>,
        n: usize,
    ) -> BResult<u64> {
        let mut s = self.scratch.borrow_mut();
        let slot = pick(&mut s);
        grow(&self.stream, slot, n)?;
        Ok(slot.as_ref().map_or(0, |b| self.ptr(b)))
    }

    /// Whether a product of `rows` rows with `w` runs as GEMVs, one per row (decode, batched
    /// decode): each row's result is then the same whatever the batch.
    fn gemv_fits(rows: usize, w: &DevMatrix) -> bool {
        rows <= GEMV_BATCH_ROWS && w.cols.is_multiple_of(8) && w.cols <= GEMV_MAX_K
    }

    /// `rows` rows (from row `x_off / w.cols` of x) times `w`ᵀ, one GEMV each; each row's
    /// `w.rows` outputs are written in turn to the (pointer, count) parts of `outs` (at most
    /// four; the counts add up to `w.rows`), at that row.
    fn gemv(
        &self,
        x: &CudaSlice<u16>,
        x_off: usize,
        w: &DevMatrix,
        outs: &[(u64, usize)],
        rows: usize,
    ) -> BResult<()> {
        // Tensor cores: groups of up to 16 rows; CUDA cores: a launch per row.
        let tc = self.tensor_core_gemv.get();
        let group = if tc { GEMV_MMA_ROWS } else { 1 };
        let mut r = 0;
        while r < rows {
            let nb = group.min(rows - r);
            let mut args = vec![
                Arg::P(self.ptr(x) + ((x_off + r * w.cols) * 2) as u64),
                Arg::P(self.ptr(&w.buf)),
                Arg::I(w.rows as i32),
                Arg::I(w.cols as i32),
            ];
            if tc {
                args.push(Arg::I(nb as i32));
            }
            for i in 0..4 {
                let (p, n) = outs.get(i).copied().unwrap_or((0, 0));
                args.push(Arg::P(if p == 0 { 0 } else { p + (r * n * 2) as u64 }));
                if i < 3 {
                    args.push(Arg::I(n as i32));
                }
            }
            // Few output rows: a row a warp (same sums, more warps in flight).
            let narrow = w.rows <= GEMV_NARROW_MAX_ROWS && !self.fallback.gemv;
            let (k, rows_per_block, block) = match (tc, nb > 8, narrow) {
                (true, false, _) => (K::GemvMma8, 16, GEMV_MMA_THREADS),
                (true, true, _) => (K::GemvMma16, 16, GEMV_MMA_THREADS),
                (false, _, true) => (K::GemvNarrow, 4, 128),
                (false, _, false) => (K::Gemv, GEMV_ROWS_PER_BLOCK, 128),
            };
            self.launch_shaped(
                k,
                Some((w.rows, w.cols)),
                (grid1(w.rows, rows_per_block), 1, 1),
                block,
                0,
                &args,
            )?;
            r += nb;
        }
        Ok(())
    }

    /// `y = x wᵀ` into the buffer at `y`: the GEMV kernel for one row (decode), cuBLASLt
    /// otherwise.
    fn product(
        &self,
        x: &CudaSlice<u16>,
        x_off: usize,
        w: &DevMatrix,
        y: u64,
        rows: usize,
    ) -> BResult<()> {
        if Self::gemv_fits(rows, w) {
            return self.gemv(x, x_off, w, &[(y, w.rows)], rows);
        }
        self.gemm_rows(self.ptr(x) + (x_off * 2) as u64, w, 0, w.rows, y, rows)
    }

    /// cuBLASLt: `y = x W[r0 .. r0 + n]ᵀ` (`rows` rows of x at `xp`, weight rows r0.. of `w`).
    fn gemm_rows(
        &self,
        xp: u64,
        w: &DevMatrix,
        r0: usize,
        n: usize,
        y: u64,
        rows: usize,
    ) -> BResult<()> {
        let t0 = self.profiler.as_ref().and_then(|p| p.start(&self.stream));
        self.gemm
            .borrow_mut()
            .run_ptrs(
                xp,
                self.ptr(&w.buf) + (r0 * w.cols * 2) as u64,
                y,
                rows,
                n,
                w.cols,
            )
            .map_err(BackendError)?;
        if let Some(p) = &self.profiler {
            p.end(format!("gemm {}x{}", n, w.cols), t0, &self.stream);
        }
        Ok(())
    }

    /// Per-head norm and RoPE of `x` and, in the same launch, of `x2` (with the second norm
    /// weight).
    fn norm_rope(
        &self,
        x: &mut DevAct,
        x2: Option<&mut DevAct>,
        head_dim: usize,
        norm: Option<HeadNorms<'_>>,
        rope: Option<(&CudaSlice<f32>, RopeAt<'_>)>,
    ) -> BResult<()> {
        if head_dim > 256 || !head_dim.is_multiple_of(2) {
            return Err(BackendError(format!(
                "head_dim {head_dim}: the CUDA kernels take even sizes up to 256"
            )));
        }
        let hpr = x.cols / head_dim;
        let total = x.rows * hpr;
        let table = match rope {
            Some((f, at)) => self.rope_table(f, at, x.rows, head_dim / 2)?,
            None => 0,
        };
        let (x2_ptr, total2, hpr2) = match &x2 {
            Some(b) => (
                self.ptr(&b.buf),
                b.rows * (b.cols / head_dim),
                b.cols / head_dim,
            ),
            None => (0, 0, 1),
        };
        if head_dim == 128 {
            return self.launch(
                K::HeadNormRope128,
                (grid1(total + total2, 8), 1, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(&x.buf)),
                    Arg::I(total as i32),
                    Arg::P(norm.map_or(0, |(w, _, _)| self.ptr(w))),
                    Arg::F(norm.map_or(0.0, |(_, _, e)| e)),
                    Arg::I(hpr as i32),
                    Arg::P(x2_ptr),
                    Arg::I(total2 as i32),
                    Arg::P(norm.and_then(|(_, w2, _)| w2).map_or(0, |w| self.ptr(w))),
                    Arg::I(hpr2.max(1) as i32),
                    Arg::P(table),
                ],
            );
        }
        self.launch(
            K::HeadNormRope,
            (grid1(total + total2, 4), 1, 1),
            128,
            0,
            &[
                Arg::P(self.ptr(&x.buf)),
                Arg::I(total as i32),
                Arg::I(head_dim as i32),
                Arg::P(norm.map_or(0, |(w, _, _)| self.ptr(w))),
                Arg::F(norm.map_or(0.0, |(_, _, e)| e)),
                Arg::P(rope.map_or(0, |(f, _)| self.ptr(f))),
                Arg::I(0), // first position: unused, the table holds every row's
                Arg::I(hpr as i32),
                Arg::P(x2_ptr),
                Arg::I(total2 as i32),
                Arg::P(norm.and_then(|(_, w2, _)| w2).map_or(0, |w| self.ptr(w))),
                Arg::I(hpr2.max(1) as i32),
                Arg::P(table),
            ],
        )
    }

    /// The RoPE table of `rows` rows (cos, sin of pos·inv_freq[i] for i < half, the row's
    /// position from `at`), made once for all layers that ask for the same one.
    fn rope_table(
        &self,
        inv_freq: &CudaSlice<f32>,
        at: RopeAt<'_>,
        rows: usize,
        half: usize,
    ) -> BResult<u64> {
        let f = self.ptr(inv_freq);
        let key = match at {
            RopeAt::From(pos) => RopeKey::Run(f, half, pos, rows),
            RopeAt::Rows(p) => RopeKey::Rows(f, half, p.to_vec()),
        };
        let fresh = self.scratch.borrow().rope_key.as_ref() != Some(&key);
        let table = self.scratch_ptr(|s| &mut s.rope, 2 * rows * half)?;
        if fresh {
            let grid = (grid1(rows * half, 256), 1, 1);
            match at {
                RopeAt::From(pos) => self.launch(
                    K::RopeTable,
                    grid,
                    256,
                    0,
                    &[
                        Arg::P(f),
                        Arg::I(pos as i32),
                        Arg::I(rows as i32),
                        Arg::I(half as i32),
                        Arg::P(table),
                    ],
                )?,
                RopeAt::Rows(p) => {
                    if p.len() != rows || rows > DECODE_ROWS {
                        return Err(BackendError(format!(
                            "rope_table: {} positions for {rows} rows (at most {DECODE_ROWS})",
                            p.len()
                        )));
                    }
                    let t = decode_rows(&[], p);
                    self.launch(
                        K::RopeTableRows,
                        grid,
                        256,
                        0,
                        &[
                            Arg::P(f),
                            Arg::Rows(&t),
                            Arg::I(rows as i32),
                            Arg::I(half as i32),
                            Arg::P(table),
                        ],
                    )?
                }
            }
            self.scratch.borrow_mut().rope_key = Some(key);
        }
        Ok(table)
    }

    fn elementwise(&self, k: K, a: &DevAct, b: &DevAct, extra: Option<f32>) -> BResult<()> {
        let n = a.rows * a.cols;
        let mut args = vec![Arg::P(self.ptr(&a.buf)), Arg::P(self.ptr(&b.buf))];
        if let Some(x) = extra {
            args.push(Arg::F(x));
        }
        args.push(Arg::U(n as u64));
        self.launch(k, (grid1(n, 256), 1, 1), 256, 0, &args)
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
        format!("cuda ({}, {})", self.device_name, self.target)
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
        })
    }

    fn random_vector(&self, len: usize, seed: u64, mean: f32, std: f32) -> BResult<CudaSlice<u16>> {
        self.random_bf16(len, seed, mean, std)
    }

    fn alloc(&self, max_rows: usize, cols: usize) -> BResult<DevAct> {
        Ok(DevAct {
            buf: self.alloc_u16(max_rows * cols)?,
            rows: max_rows,
            cols,
            cap_rows: max_rows,
        })
    }

    fn set_rows(&self, a: &mut DevAct, rows: usize) {
        a.rows = rows.min(a.cap_rows);
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
        self.copy(&dst.buf, dst_row * w, &src.buf, src_row * w, n * w)
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

    fn new_sparse_cache(&self, shape: AttnShape, _cfg: &SparseConfig) -> BResult<DevSparseCache> {
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

    fn embed(&self, table: &DevMatrix, ids: &[u32], scale: f32, out: &mut DevAct) -> BResult<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            return Err(BackendError(format!(
                "token id {bad} is outside the embedding table"
            )));
        }
        let ids_ptr = {
            let mut s = self.scratch.borrow_mut();
            grow(&self.stream, &mut s.ids, ids.len())?;
            let buf = s.ids.as_mut().expect("grown");
            self.stream
                .memcpy_htod(ids, buf)
                .map_err(|e| be_err("token ids", e))?;
            self.ptr(buf)
        };
        self.launch(
            K::Embed,
            (ids.len() as u32, 1, 1),
            256,
            0,
            &[
                Arg::P(self.ptr(&table.buf)),
                Arg::P(ids_ptr),
                Arg::F(scale),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(table.cols as i32),
            ],
        )
    }

    fn rms_norm(&self, x: &DevAct, w: &CudaSlice<u16>, eps: f32, out: &mut DevAct) -> BResult<()> {
        self.launch(
            K::RmsNorm,
            (x.rows as u32, 1, 1),
            512,
            0,
            &[
                Arg::P(self.ptr(&x.buf)),
                Arg::P(self.ptr(w)),
                Arg::F(eps),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(x.cols as i32),
                Arg::P(0),
            ],
        )
    }

    fn matmul(&self, x: &DevAct, w: &DevMatrix, out: &mut DevAct) -> BResult<()> {
        if x.cols != w.cols || out.cols != w.rows || out.rows != x.rows {
            return Err(BackendError(format!(
                "matmul shapes: x [{}, {}], w [{}, {}], out [{}, {}]",
                x.rows, x.cols, w.rows, w.cols, out.rows, out.cols
            )));
        }
        self.product(&x.buf, 0, w, self.ptr(&out.buf), x.rows)
    }

    fn concat_rows(&self, parts: Vec<DevMatrix>) -> BResult<DevMatrix> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(BackendError(
                "concat_rows: the matrices have different input widths".into(),
            ));
        }
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let buf = self.alloc_u16(rows * cols)?;
        let mut off = 0;
        for p in &parts {
            self.copy(&buf, off, &p.buf, 0, p.rows * cols)?;
            off += p.rows * cols;
        }
        Ok(DevMatrix { buf, rows, cols })
    }

    fn matmul_split(&self, x: &DevAct, w: &DevMatrix, outs: &mut [&mut DevAct]) -> BResult<()> {
        let total: usize = outs.iter().map(|o| o.cols).sum();
        if total != w.rows || x.cols != w.cols || outs.len() > 4 {
            return Err(BackendError(format!(
                "matmul_split: {} outputs of {total} columns for a [{}, {}] matrix and {} inputs",
                outs.len(),
                w.rows,
                w.cols,
                x.cols
            )));
        }
        let rows = x.rows;
        if Self::gemv_fits(rows, w) {
            let parts: Vec<_> = outs.iter().map(|o| (self.ptr(&o.buf), o.cols)).collect();
            return self.gemv(&x.buf, 0, w, &parts, rows);
        }
        // Several rows: one product per output, straight into it (no split copy).
        let mut r0 = 0;
        for o in outs.iter() {
            self.gemm_rows(self.ptr(&x.buf), w, r0, o.cols, self.ptr(&o.buf), rows)?;
            r0 += o.cols;
        }
        Ok(())
    }

    fn matmul_silu(
        &self,
        x: &DevAct,
        w: &DevMatrix,
        gu: &mut DevAct,
        out: &mut DevAct,
    ) -> BResult<()> {
        let inter = out.cols;
        if !Self::gemv_fits(x.rows, w) || w.rows != 2 * inter || x.cols != w.cols {
            self.matmul(x, w, gu)?;
            return self.silu_mul_halves(gu, out);
        }
        let tc = self.tensor_core_gemv.get();
        let group = if tc { GEMV_MMA_ROWS } else { 1 };
        let mut r = 0;
        while r < x.rows {
            let nb = group.min(x.rows - r);
            let mut args = vec![
                Arg::P(self.row_ptr(x, r)),
                Arg::P(self.ptr(&w.buf)),
                Arg::P(self.ptr(&out.buf) + (r * inter * 2) as u64),
                Arg::I(inter as i32),
                Arg::I(w.cols as i32),
            ];
            let (k, outs_per_block, block) = if tc {
                args.push(Arg::I(nb as i32));
                let k = if nb > 8 {
                    K::GemvSiluMma16
                } else {
                    K::GemvSiluMma8
                };
                (k, 8, GEMV_MMA_THREADS)
            } else {
                (K::GemvSilu, GEMV_ROWS_PER_BLOCK / 2, 128)
            };
            self.launch_shaped(
                k,
                Some((w.rows, w.cols)),
                (grid1(inter, outs_per_block), 1, 1),
                block,
                0,
                &args,
            )?;
            r += nb;
        }
        Ok(())
    }

    fn silu_mul_halves(&self, gu: &DevAct, out: &mut DevAct) -> BResult<()> {
        if out.cols.is_multiple_of(8) && out.rows <= 65535 {
            return self.launch(
                K::SiluMulHalves8,
                ((out.cols / 8).div_ceil(256) as u32, out.rows as u32, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(&gu.buf)),
                    Arg::P(self.ptr(&out.buf)),
                    Arg::I(out.cols as i32),
                ],
            );
        }
        let n = out.rows * out.cols;
        self.launch(
            K::SiluMulHalves,
            (grid1(n, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(self.ptr(&gu.buf)),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(out.rows as i32),
                Arg::I(out.cols as i32),
            ],
        )
    }

    fn silu_mul(&self, gate: &mut DevAct, up: &DevAct) -> BResult<()> {
        self.elementwise(K::SiluMul, gate, up, None)
    }

    fn add_scaled(&self, h: &mut DevAct, branch: &DevAct, scale: f32) -> BResult<()> {
        self.elementwise(K::AddScaled, h, branch, Some(scale))
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
        if !h.cols.is_multiple_of(8) || h.cols > 8 * 2 * 512 {
            self.add_scaled(h, branch, scale)?;
            return self.rms_norm(h, w, eps, out);
        }
        self.launch(
            K::AddRmsNorm,
            (h.rows as u32, 1, 1),
            512,
            0,
            &[
                Arg::P(self.ptr(&h.buf)),
                Arg::P(self.ptr(&branch.buf)),
                Arg::F(scale),
                Arg::P(self.ptr(w)),
                Arg::F(eps),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(h.cols as i32),
            ],
        )
    }

    fn sigmoid_gate(&self, x: &mut DevAct, gate: &DevAct) -> BResult<()> {
        self.elementwise(K::SigmoidGate, x, gate, None)
    }

    fn head_norm_rope(
        &self,
        x: &mut DevAct,
        head_dim: usize,
        norm: Option<(&CudaSlice<u16>, f32)>,
        rope: Option<(&CudaSlice<f32>, usize)>,
    ) -> BResult<()> {
        let rope = rope.map(|(f, p)| (f, RopeAt::From(p)));
        self.norm_rope(x, None, head_dim, norm.map(|(w, e)| (w, None, e)), rope)
    }

    fn head_norm_rope_qk(
        &self,
        q: &mut DevAct,
        k: &mut DevAct,
        head_dim: usize,
        norms: Option<(&CudaSlice<u16>, &CudaSlice<u16>, f32)>,
        rope: Option<(&CudaSlice<f32>, usize)>,
    ) -> BResult<()> {
        self.norm_rope(
            q,
            Some(k),
            head_dim,
            norms.map(|(a, b, e)| (a, Some(b), e)),
            rope.map(|(f, p)| (f, RopeAt::From(p))),
        )
    }

    fn sparse_rows(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        modes: &[SparseMode],
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        caches: &mut [&mut DevSparseCache],
        out: &mut DevAct,
    ) -> BResult<()> {
        match self.sparse_rows_fit(shape, cfg, modes, caches) {
            Some(mode) if q.rows == caches.len() => {
                self.sparse_rows_batched(shape, cfg, mode, q, k, v, caches, out)
            }
            _ => sala_model::backend::sparse_row_by_row(
                self, shape, cfg, modes, q, k, v, caches, out,
            ),
        }
    }

    fn lightning_rows(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &mut DevAct,
        k: &mut DevAct,
        v: &DevAct,
        norms: Option<(&CudaSlice<u16>, &CudaSlice<u16>, f32)>,
        inv_freq: Option<&CudaSlice<f32>>,
        positions: &[usize],
        states: &mut [&mut DevLightningState],
        out: &mut DevAct,
    ) -> BResult<()> {
        let rows = states.len();
        let d = shape.head_dim;
        if rows > DECODE_ROWS || d > 256 || positions.len() != rows || q.rows != rows {
            return sala_model::backend::lightning_row_by_row(
                self, shape, slopes, q, k, v, norms, inv_freq, positions, states, out,
            );
        }
        self.norm_rope(
            q,
            Some(k),
            d,
            norms.map(|(a, b, e)| (a, Some(b), e)),
            inv_freq.map(|f| (f, RopeAt::Rows(positions))),
        )?;
        let ptrs: Vec<u64> = states.iter().map(|st| self.ptr(&**st)).collect();
        let t = decode_rows(&ptrs, &[]);
        self.launch(
            K::LightningDecodeRows,
            (shape.heads as u32, d.div_ceil(32) as u32, rows as u32),
            256,
            0,
            &[
                Arg::P(self.ptr(&q.buf)),
                Arg::P(self.ptr(&k.buf)),
                Arg::P(self.ptr(&v.buf)),
                Arg::Rows(&t),
                Arg::P(self.ptr(&out.buf)),
                Arg::P(self.ptr(slopes)),
                Arg::I(shape.heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(d as i32),
                Arg::F(shape.scale() as f32),
            ],
        )
    }

    fn rms_norm_gate(
        &self,
        x: &DevAct,
        w: &CudaSlice<u16>,
        eps: f32,
        gate: Option<&DevAct>,
        out: &mut DevAct,
    ) -> BResult<()> {
        self.launch(
            K::RmsNorm,
            (x.rows as u32, 1, 1),
            512,
            0,
            &[
                Arg::P(self.ptr(&x.buf)),
                Arg::P(self.ptr(w)),
                Arg::F(eps),
                Arg::P(self.ptr(&out.buf)),
                Arg::I(x.cols as i32),
                Arg::P(gate.map_or(0, |g| self.ptr(&g.buf))),
            ],
        )
    }

    fn lightning(
        &self,
        shape: AttnShape,
        slopes: &CudaSlice<f32>,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        state: &mut DevLightningState,
        out: &mut DevAct,
    ) -> BResult<()> {
        if q.rows == 1 && shape.head_dim <= 256 {
            return self.launch(
                K::LightningDecode,
                (shape.heads as u32, shape.head_dim.div_ceil(32) as u32, 1),
                256,
                0,
                &[
                    Arg::P(self.ptr(&q.buf)),
                    Arg::P(self.ptr(&k.buf)),
                    Arg::P(self.ptr(&v.buf)),
                    Arg::P(self.ptr(state)),
                    Arg::P(self.ptr(&out.buf)),
                    Arg::P(self.ptr(slopes)),
                    Arg::I(shape.heads as i32),
                    Arg::I(shape.kv_heads as i32),
                    Arg::I(shape.head_dim as i32),
                    Arg::F(shape.scale() as f32),
                ],
            );
        }
        let d = shape.head_dim;
        if q.rows >= LIGHTNING_TWO_PASS_ROWS
            && d.is_multiple_of(64)
            && d <= 128
            && self.lightning_two_pass.get()
            && !self.fallback.lightning
            && !self.fallback.lightning_split
        {
            return self.lightning_two_pass(shape, slopes, q, k, v, state, out);
        }
        if q.rows >= 2
            && d.is_multiple_of(32)
            && d.is_power_of_two()
            && d <= 128
            && !self.fallback.lightning
            && !self.fallback.lightning_split
        {
            return self.lightning_fused(shape, slopes, q, k, v, state, out);
        }
        if q.rows >= LIGHTNING_MMA_ROWS
            && shape.head_dim.is_multiple_of(16)
            && shape.head_dim <= 128
            && !self.fallback.lightning
        {
            return self.lightning_mma(shape, slopes, q, k, v, state, out);
        }
        let (grid, block, smem) = lightning_launch(shape.heads, shape.head_dim);
        self.launch(
            K::LightningChunked,
            grid,
            block,
            smem,
            &[
                Arg::P(self.ptr(&q.buf)),
                Arg::P(self.ptr(&k.buf)),
                Arg::P(self.ptr(&v.buf)),
                Arg::P(self.ptr(state)),
                Arg::P(self.ptr(&out.buf)),
                Arg::P(self.ptr(slopes)),
                Arg::I(q.rows as i32),
                Arg::I(shape.heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(shape.head_dim as i32),
                Arg::F(shape.scale() as f32),
            ],
        )
    }

    fn sparse_attention(
        &self,
        shape: AttnShape,
        cfg: &SparseConfig,
        mode: SparseMode,
        q: &DevAct,
        k: &DevAct,
        v: &DevAct,
        cache: &mut DevSparseCache,
        out: &mut DevAct,
    ) -> BResult<()> {
        let t = q.rows;
        let kw = cache.kv_width;
        let first = cache.len;
        self.reserve(cache, first + t, cfg, false)?;
        self.copy(&cache.k, first * kw, &k.buf, 0, t * kw)?;
        self.copy(&cache.v, first * kw, &v.buf, 0, t * kw)?;
        cache.len += t;
        self.compress_new_windows(cache, cfg)?;
        let k_sel = cfg.selected_blocks();
        let blocks = match mode {
            SparseMode::Dense => 0,
            SparseMode::Sparse => {
                let pairs = t * shape.kv_heads;
                let blocks = self.scratch_ptr(|s| &mut s.blocks, pairs * k_sel)?;
                let exact = self.exact_select.get();
                if pairs >= SELECT_ONE_KERNEL_PAIRS && !exact && fast_select_fits(shape, cfg) {
                    self.select_fast(shape, cfg, q, cache, first, blocks)?;
                } else if pairs < SELECT_ONE_KERNEL_PAIRS
                    && !exact
                    && decode_select_fits(shape, cfg, cache.len)
                {
                    self.select_decode(shape, cfg, q, cache, first, blocks)?;
                } else {
                    self.select_exact(shape, cfg, q, cache, first, blocks)?;
                }
                blocks
            }
        };
        // attention_gather and attention_prefill take the same arguments.
        let prefill_args = [
            Arg::P(self.ptr(&q.buf)),
            Arg::P(self.ptr(&cache.k)),
            Arg::P(self.ptr(&cache.v)),
            Arg::P(self.ptr(&out.buf)),
            Arg::I(t as i32),
            Arg::I(first as i32),
            Arg::I(shape.heads as i32),
            Arg::I(shape.kv_heads as i32),
            Arg::I(shape.head_dim as i32),
            Arg::F(shape.scale() as f32),
            Arg::P(blocks),
            Arg::I(k_sel as i32),
        ];
        let warp_walk = self.warp_walk(shape, cfg, mode);
        let pairs = t * shape.kv_heads;
        if warp_walk && pairs < SELECT_ONE_KERNEL_PAIRS {
            return self.attention_decode(shape, mode, q, cache, blocks, k_sel, out);
        }
        if warp_walk && mode == SparseMode::Sparse {
            return self.launch(
                K::AttentionGather,
                ((t * shape.kv_heads).div_ceil(4) as u32, 1, 1),
                128,
                0,
                &prefill_args,
            );
        }
        if t >= PREFILL_ATTENTION_ROWS && prefill_attention_fits(shape, cfg, mode, first + t) {
            let bitmap = match mode {
                SparseMode::Dense => 0,
                SparseMode::Sparse => 4 * (first + t).div_ceil(64).div_ceil(32),
            };
            return self.launch(
                K::AttentionPrefill,
                (t.div_ceil(8) as u32, shape.kv_heads as u32, 1),
                256,
                bitmap as u32,
                &prefill_args,
            );
        }
        let (grid, block, smem) = attention_launch(t, shape);
        let common = |out: u64| {
            vec![
                Arg::P(self.ptr(&q.buf)),
                Arg::P(self.ptr(&cache.k)),
                Arg::P(self.ptr(&cache.v)),
                Arg::P(out),
                Arg::I(t as i32),
                Arg::I(first as i32),
                Arg::I(shape.heads as i32),
                Arg::I(shape.kv_heads as i32),
                Arg::I(shape.head_dim as i32),
                Arg::F(shape.scale() as f32),
                Arg::P(blocks),
                Arg::I(k_sel as i32),
                Arg::I(cfg.block_size as i32),
            ]
        };
        // Few query rows (decode): split the keys across more blocks, then merge.
        let blocks_launched = (grid.0 * grid.1) as usize;
        let chunks = match mode {
            SparseMode::Dense => cache.len.div_ceil(64),
            SparseMode::Sparse => k_sel * cfg.block_size.div_ceil(64),
        };
        let n_split = (2 * 132usize)
            .div_ceil(blocks_launched)
            .clamp(1, chunks.clamp(1, MAX_ATTENTION_SPLIT));
        if n_split == 1 {
            return self.launch(K::Attention, grid, block, smem, &common(self.ptr(&out.buf)));
        }
        let part = self.scratch_ptr(
            |s| &mut s.attn_part,
            n_split * t * shape.heads * (shape.head_dim + 2),
        )?;
        let mut args = common(part);
        args.push(Arg::I(n_split as i32));
        self.launch(
            K::AttentionSplit,
            (grid.0, grid.1, n_split as u32),
            block,
            smem,
            &args,
        )?;
        self.attention_merge(shape, t, part, n_split, out)
    }

    fn logits(
        &self,
        h: &DevAct,
        rows: std::ops::Range<usize>,
        lm_head: &DevMatrix,
        divisor: f32,
    ) -> BResult<Vec<f32>> {
        let (n, cols, vocab) = (rows.len(), h.cols, lm_head.rows);
        let mut s = self.scratch.borrow_mut();
        grow(&self.stream, &mut s.logits_in, n * cols)?;
        grow(&self.stream, &mut s.logits_out, n * vocab)?;
        let (x, y) = (
            s.logits_in.as_ref().expect("grown"),
            s.logits_out.as_ref().expect("grown"),
        );
        self.launch(
            K::ScaleRound,
            (grid1(n * cols, 256), 1, 1),
            256,
            0,
            &[
                Arg::P(self.ptr(&h.buf) + (rows.start * cols * 2) as u64),
                Arg::P(self.ptr(x)),
                Arg::F(divisor),
                Arg::U((n * cols) as u64),
            ],
        )?;
        self.product(x, 0, lm_head, self.ptr(y), n)?;
        self.download(y, n * vocab)
    }

    fn to_host(&self, a: &DevAct) -> BResult<Vec<f32>> {
        self.download(&a.buf, a.rows * a.cols)
    }
}

/// Warps (key splits) of `attention_decode` for `pairs` (query, group) pairs of a sequence
/// holding `len` tokens: a 64-key block walk over all blocks (dense) or the `k_sel` selected.
fn decode_split(mode: SparseMode, len: usize, k_sel: usize, pairs: usize) -> usize {
    let walk = match mode {
        SparseMode::Dense => len.div_ceil(64),
        SparseMode::Sparse => k_sel,
    };
    walk.min(DECODE_SPLIT_MAX)
        .min((DECODE_WARPS / pairs).max(1))
        .max(1)
}

/// A [`DecodeRows`] of the given state pointers and positions (each at most [`DECODE_ROWS`]).
fn decode_rows(states: &[u64], positions: &[usize]) -> DecodeRows {
    let mut t = DecodeRows {
        state: [0; DECODE_ROWS],
        pos: [0; DECODE_ROWS],
    };
    t.state[..states.len()].copy_from_slice(states);
    for (p, &x) in t.pos.iter_mut().zip(positions) {
        *p = x as i32;
    }
    t
}

/// Launch shape of `lightning_chunked`: a block per (head, 32 value columns).
fn lightning_launch(heads: usize, head_dim: usize) -> ((u32, u32, u32), u32, u32) {
    ((heads as u32, head_dim.div_ceil(32) as u32, 1), 256, 0)
}

/// Launch shape of `compress_keys`: a thread per output element.
fn compress_launch(n_windows: usize, kv_width: usize) -> ((u32, u32, u32), u32) {
    ((grid1(n_windows * kv_width, 256), 1, 1), 256)
}

/// Block size and dynamic shared memory of `sparse_select` (a block per query and KV group).
fn select_launch(shape: AttnShape) -> (u32, u32) {
    (256, (shape.group() * (shape.head_dim + 3) * 4) as u32)
}

/// Launch shape of `attention`: 64 (query, head) rows of one KV group per block.
fn attention_launch(t: usize, shape: AttnShape) -> ((u32, u32, u32), u32, u32) {
    (
        (grid1(t * shape.group(), 64), shape.kv_heads as u32, 1),
        128,
        0,
    )
}

#[cfg(test)]
mod tests {
    use super::Fallback;

    #[test]
    fn fallback_names_parse_and_typos_are_errors() {
        let f = Fallback::parse(" lightning-fused, wgmma,,").unwrap();
        assert!(f.lightning_fused && f.wgmma && !f.lightning && !f.gemv_mma);
        let none = Fallback::parse("").unwrap();
        assert!(!none.attention && !none.sparse_rows && !none.lightning_split);
        for name in Fallback::NAMES {
            assert!(Fallback::parse(name).is_ok(), "{name}");
        }
        let e = Fallback::parse("lightning,wgma").err().unwrap();
        assert!(e.contains("\"wgma\"") && e.contains("wgmma"), "{e}");
    }
}
