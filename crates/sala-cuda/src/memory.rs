//! Device memory: activations, weights, per-sequence caches and states (own allocations or
//! ranges of the page pool, [`crate::pool`]), the scratch the ops share, and copies; and what
//! a memory plan counts for this backend ([`memory_facts`]).

use crate::pool;
use crate::CudaBackend;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use sala_checkpoint::{MixerKind, ModelConfig, SparseConfig};
use sala_model::memory::{BackendMemory, BF16};
use sala_model::{AttnIo, BResult, BackendError, HostDType, HostTensor};
use std::sync::Arc;

pub(crate) fn be_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError(format!("CUDA {what}: {e:?}"))
}

/// Activations `[rows, cols]` in bf16, with room for `cap_rows` rows. Ops see rows
/// `first..first + rows` of the allocation as their rows `0..rows`: an attention call of a
/// step runs on each sequence's rows through such a window ([`DevAct::window`]).
pub struct DevAct {
    pub(crate) storage: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
    pub(crate) first: usize,
    pub(crate) cap_rows: usize,
}

impl DevAct {
    /// Shows rows `first..first + rows` of the allocation (absolute) as the rows of `self`.
    pub(crate) fn window(&mut self, first: usize, rows: usize) {
        assert!(first + rows <= self.cap_rows, "window past the allocation");
        self.first = first;
        self.rows = rows;
    }

    /// The window, to restore after a [`DevAct::window`].
    pub(crate) fn current_window(&self) -> (usize, usize) {
        (self.first, self.rows)
    }

    /// The allocation and the element offset of the window's first row (for copies).
    pub(crate) fn slice_at(&self, row: usize) -> (&CudaSlice<u16>, usize) {
        (&self.storage, (self.first + row) * self.cols)
    }
}

/// An attention call's activations (q, k, v and out, the same rows), shown one run of rows at a
/// time; the windows they came with are restored on drop.
pub(crate) struct Windows<'a> {
    acts: [&'a mut DevAct; 4],
    saved: [(usize, usize); 4],
}

impl<'a> Windows<'a> {
    pub(crate) fn new(io: AttnIo<'a, DevAct>) -> Self {
        let acts = [io.q, io.k, io.v, io.out];
        let saved = [0, 1, 2, 3].map(|i| acts[i].current_window());
        Self { acts, saved }
    }

    /// The call's rows `first..first + rows`, as (q, k, v, out).
    pub(crate) fn rows(
        &mut self,
        first: usize,
        rows: usize,
    ) -> (&mut DevAct, &mut DevAct, &DevAct, &mut DevAct) {
        for (a, &(start, _)) in self.acts.iter_mut().zip(&self.saved) {
            a.window(start + first, rows);
        }
        let [q, k, v, out] = &mut self.acts;
        (&mut **q, &mut **k, &**v, &mut **out)
    }
}

impl Drop for Windows<'_> {
    fn drop(&mut self) {
        for (a, &(first, rows)) in self.acts.iter_mut().zip(&self.saved) {
            a.window(first, rows);
        }
    }
}

impl DevMem<u16> for DevAct {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        self.storage.dev_ptr(stream) + (self.first * self.cols * 2) as u64
    }
}

/// A bf16 matrix `[rows = out, cols = in]`.
pub struct DevMatrix {
    /// The bf16 values (empty for a 4-bit matrix).
    pub buf: CudaSlice<u16>,
    pub rows: usize,
    pub cols: usize,
    /// The 4-bit form, when the matrix is kept so.
    pub w4: Option<W4Weights>,
    /// The FP8 form, when the matrix is kept so.
    pub fp8: Option<Fp8Weights>,
}

/// An FP8 matrix on the device (`sala_model::Fp8Matrix`): `[rows, cols]` E4M3 codes and an
/// f32 scale per row.
pub struct Fp8Weights {
    pub codes: CudaSlice<u8>,
    pub scales: CudaSlice<f32>,
}

/// A 4-bit matrix on the device: its records ([`crate::w4_records`]), the eight values of each
/// of `sala_model::QuantMatrix`'s words with their nibbles interleaved ([`interleave_w4`]) and
/// per group of a row one word ([`w4_group_word`]): its scale and −(128 + zero) as bf16 bits,
/// so a product loads both at once.
pub struct W4Weights {
    pub records: CudaSlice<u32>,
    pub group: usize,
}

/// A 4-bit group's word: the bf16 bits of its scale in the low half, of −(128 + zero) in the
/// high half.
pub fn w4_group_word(scale: f32, zero: f32) -> u32 {
    let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
    bits(scale) | (bits(-(128.0 + zero)) << 16)
}

/// A word of eight 4-bit values, the lowest nibble first (input 8j + i at bits 4i, as
/// checkpoints pack them), with inputs 2p and 2p + 1 moved to bits 4p and 16 + 4p: the
/// kernels then take each pair of consecutive inputs as a bf16x2 pair with one shift and one
/// mask (`(w >> 4p) & 0x000F000F`) instead of two extracts and a merge.
pub fn interleave_w4(word: u32) -> u32 {
    (0..8).fold(0, |out, i| {
        let slot = if i % 2 == 0 { i / 2 } else { 4 + i / 2 };
        out | (((word >> (4 * i)) & 0xF) << (4 * slot))
    })
}

/// Device memory a kernel argument can point at.
pub trait DevMem<T> {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64;
}

/// A device address, for passing scratch on without holding its borrow.
pub(crate) struct DevAddr(pub u64);

impl<T> DevMem<T> for DevAddr {
    fn dev_ptr(&self, _: &Arc<CudaStream>) -> u64 {
        self.0
    }
}

impl<T> DevMem<T> for CudaSlice<T> {
    fn dev_ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        self.device_ptr(stream).0
    }
}

/// A per-sequence buffer (a cache or a lightning state) of `T`: its own allocation, or a range
/// of the page pool (the default), which grows in place.
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
    pub(crate) k: Store<u16>,
    pub(crate) v: Store<u16>,
    pub(crate) k1: Store<u16>,
    pub(crate) k2: Store<u16>,
    pub(crate) len: usize,
    pub(crate) n1: usize,
    pub(crate) n2: usize,
    pub(crate) cap: usize,
    pub(crate) kv_width: usize,
    pub(crate) head_dim: usize,
    /// K and V as FP8 rows (`f8_row_bytes` in sparse/common.cuh), else bf16 values.
    pub(crate) fp8: bool,
    /// 16-bit units a token takes in `k` and in `v`.
    pub(crate) row_units: usize,
}

impl DevSparseCache {
    /// Makes it hold its first `len` tokens: their keys and values, and the compressed
    /// windows they complete (what lies past the counts is never read).
    pub(crate) fn hold(&mut self, cfg: &SparseConfig, len: usize) {
        use crate::plan::windows;
        self.len = len;
        self.n1 = windows(len, cfg.k1_window(), cfg.k1_stride());
        self.n2 = windows(len, cfg.k2_window(), cfg.k2_stride());
    }
}

/// The backend's own scratch, allowed for on top of the model's buffers: the stacked product
/// of `matmul_split` (chunk rows × the widest stacked projection: 256 MiB at 8192 rows of the
/// released shape), block-selection scratch (block scores capped at 128 MiB, selected block
/// lists, LSE, split-attention partials), the 64 MiB of range sums of the lightning prefill, the 32 MiB cuBLASLt workspace and the 16 MiB of chain sums of split decode products.
/// Larger chunks add the stacked product's excess.
pub const SCRATCH_BYTES: usize = 592 << 20;
/// The part of [`SCRATCH_BYTES`] that is not the stacked product (selection scratch,
/// lightning chunk states, cuBLASLt workspace, the chain sums of split decode products
/// (`GEMV_CHAIN_SUMS_BYTES`) and the rest).
const OTHER_SCRATCH_BYTES: usize = 336 << 20;
/// Fixed device memory of a CUDA context: the context itself, the loaded kernel modules and
/// the cuBLAS/cuBLASLt handles (counted in the device's used memory, not by us).
pub const CONTEXT_BYTES: usize = 600 << 20;
/// Device memory FP8 weights cost beyond their bytes and scratch where cuBLASLt runs FP8
/// GEMMs (measured on an H200: peak 0.68 GiB above the plan at 128K, 0.57 GiB at 1M, from the
/// first FP8 product on; counted with margin).
pub const FP8_GEMM_RUNTIME_BYTES: usize = 768 << 20;
/// Device memory the page pool costs beyond its pages (measured at 1M tokens on an H200: peak
/// 0.19 GiB above own allocations, the pages' rounding being 0.04 of it; counted with margin).
pub const POOL_BYTES: usize = 256 << 20;

/// What a memory plan counts for this backend with a model of `c` and a step workspace of
/// `rows` rows: bf16 values, caches in pages of `pool_page` bytes when the page pool is on,
/// the scratch (more than [`SCRATCH_BYTES`] for chunks whose stacked product outgrows it;
/// with FP8 weights, the products' inputs as FP8, and on cards without FP8 tensor cores
/// (`fp8_tensor_cores` false) their bf16 values and a matrix's), the context and the pool's
/// own cost.
pub fn memory_facts(
    c: &ModelConfig,
    rows: usize,
    pool_page: Option<usize>,
    fp8_tensor_cores: bool,
) -> BackendMemory {
    let stacked = rows * widest_stacked_projection(c) * BF16;
    // A 4-bit matrix's bf16 values for a prefill product: the widest, [gate; up].
    let widest_matrix = 2 * c.intermediate_size * c.hidden_size * BF16;
    let dequant = match &c.quantization {
        Some(_) if rows > 16 => widest_matrix,
        _ => 0,
    };
    // FP8 inputs: codes (or bf16 values) of the widest input, a scale a row.
    let widest_input = c.intermediate_size.max(c.num_attention_heads * c.head_dim);
    let fp8 = match (c.fp8_weights, fp8_tensor_cores) {
        (false, _) => 0,
        (true, true) => rows * widest_input + rows * 4 + 16 * widest_input * BF16,
        (true, false) => rows * widest_input * BF16 + rows * 4 + widest_matrix,
    };
    BackendMemory {
        value_bytes: BF16,
        cache_page: pool_page,
        scratch: SCRATCH_BYTES.max(stacked + OTHER_SCRATCH_BYTES) + dequant + fp8,
        runtime: CONTEXT_BYTES
            + pool_page.map_or(0, |_| POOL_BYTES)
            + if c.fp8_weights && fp8_tensor_cores {
                FP8_GEMM_RUNTIME_BYTES
            } else {
                0
            },
        packs_quantized: true,
        packs_fp8_kv: true,
        ranks: None,
    }
}

/// Columns of the widest stacked projection `matmul_split` computes into scratch.
fn widest_stacked_projection(c: &ModelConfig) -> usize {
    let hd = c.num_attention_heads * c.head_dim;
    let lightning = hd + 2 * c.lightning_kv_dim() + hd * c.use_output_gate as usize;
    let sparse = hd + 2 * c.kv_dim() + hd * c.attn_use_output_gate as usize;
    let has = |k| c.layer_count(k) > 0;
    (has(MixerKind::Lightning) as usize * lightning).max(has(MixerKind::Sparse) as usize * sparse)
}

/// Scratch the ops share, grown on demand and never shrunk, so steady decoding allocates
/// nothing.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Block scores of the prefill selection, or P of the exact one.
    pub p: Option<CudaSlice<f32>>,
    pub blocks: Option<CudaSlice<i32>>,
    pub ids: Option<CudaSlice<u32>>,
    /// Each row's position, for the RoPE table of a step of several sequences.
    pub positions: Option<CudaSlice<i32>>,
    /// What `positions` holds (written or advanced last), so that a step run ahead, each row
    /// one past the step before, advances them on the device instead of uploading them.
    pub positions_held: Vec<i32>,
    pub logits_in: Option<CudaSlice<u16>>,
    pub logits_out: Option<CudaSlice<u16>>,
    /// Each logit row's greedy pick: ids (i32), then log-probabilities (f32).
    pub picks: Option<CudaSlice<u32>>,
    pub lightning: Option<CudaSlice<f32>>,
    pub attn_part: Option<CudaSlice<f32>>,
    pub lse: Option<CudaSlice<f32>>,
    /// P of the decode selection as bf16 bits (`sd_p`).
    pub p16: Option<CudaSlice<u16>>,
    /// The top-k's candidate keys where they do not fit in shared memory.
    pub topk_keys: Option<CudaSlice<u16>>,
    /// RoPE cos/sin per (row, frequency) of the current chunk, and what it was made for
    /// (`RopeKey`): every lightning layer of a forward pass uses the same table.
    pub rope: Option<CudaSlice<f32>>,
    pub rope_key: Option<RopeKey>,
    /// A 4-bit matrix's rows in bf16, for a cuBLAS product (and an FP8 one's code values).
    pub dequant: Option<CudaSlice<u16>>,
    /// A product's inputs as FP8 (`quant_rows_f8`): their codes or their bf16 values, and
    /// their scales.
    pub f8_in: Option<CudaSlice<u16>>,
    pub f8_scales: Option<CudaSlice<f32>>,
    /// The chain sums of a split 17-64-row product (`gemv_rows64_parts`).
    pub chain_sums: Option<CudaSlice<f32>>,
    /// The blocks of a normed product done so far (`gemv_silu_w4_8_norm`; 0 between launches).
    pub norm_ticket: Option<CudaSlice<u32>>,
}

impl Scratch {
    /// The address and length of every buffer, hashed: it changes when one grows (a graph
    /// captured over the old buffers must not be replayed).
    pub fn fingerprint(&self, stream: &Arc<CudaStream>) -> u64 {
        fn mix<T>(h: u64, s: &Option<CudaSlice<T>>, stream: &Arc<CudaStream>) -> u64 {
            let (p, n) = s
                .as_ref()
                .map_or((0, 0), |b| (b.dev_ptr(stream), b.len() as u64));
            (h ^ p).wrapping_mul(0x100000001b3) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        }
        let mut h = 0xcbf29ce484222325u64;
        h = mix(h, &self.p, stream);
        h = mix(h, &self.blocks, stream);
        h = mix(h, &self.ids, stream);
        h = mix(h, &self.positions, stream);
        h = mix(h, &self.logits_in, stream);
        h = mix(h, &self.logits_out, stream);
        h = mix(h, &self.picks, stream);
        h = mix(h, &self.lightning, stream);
        h = mix(h, &self.attn_part, stream);
        h = mix(h, &self.lse, stream);
        h = mix(h, &self.p16, stream);
        h = mix(h, &self.topk_keys, stream);
        h = mix(h, &self.dequant, stream);
        h = mix(h, &self.f8_in, stream);
        h = mix(h, &self.f8_scales, stream);
        h = mix(h, &self.chain_sums, stream);
        h = mix(h, &self.norm_ticket, stream);
        mix(h, &self.rope, stream)
    }
}

/// What the cached RoPE table was made for: the inv_freq pointer, half the head size, and the
/// positions (a run of rows from a first one, or each row's own).
#[derive(PartialEq)]
pub(crate) enum RopeKey {
    Run(u64, usize, usize, usize),
    Rows(u64, usize, Vec<usize>),
}

/// Makes `slot` hold at least `n` elements (grow-only; what it held is not kept).
pub(crate) fn grow<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> BResult<()> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        // The old buffer goes first, freed in stream order after the work queued on it, so the
        // allocator may reuse its memory for the new one.
        *slot = None;
        *slot = Some(
            stream
                .alloc_zeros::<T>(n.max(1))
                .map_err(|e| be_err("scratch", e))?,
        );
    }
    Ok(())
}

impl CudaBackend {
    pub(crate) fn ptr<T>(&self, s: &impl DevMem<T>) -> u64 {
        s.dev_ptr(&self.stream)
    }

    /// The device address of row 0 of `a`'s window.
    pub(crate) fn act_ptr(&self, a: &DevAct) -> u64 {
        self.ptr(a)
    }

    /// The device address of row `row` of `a`.
    pub(crate) fn row_ptr(&self, a: &DevAct, row: usize) -> u64 {
        self.ptr(a) + (row * a.cols * 2) as u64
    }

    /// The address of `scratch`'s slot `pick`, grown to at least `n` elements.
    pub(crate) fn scratch_ptr<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        pick: impl FnOnce(&mut Scratch) -> &mut Option<CudaSlice<T>>,
        n: usize,
    ) -> BResult<u64> {
        let mut s = self.scratch.borrow_mut();
        let slot = pick(&mut s);
        grow(&self.stream, slot, n)?;
        Ok(slot.as_ref().map_or(0, |b| self.ptr(b)))
    }

    pub(crate) fn alloc_u16(&self, n: usize) -> BResult<CudaSlice<u16>> {
        self.stream
            .alloc_zeros::<u16>(n.max(1))
            .map_err(|e| be_err(&format!("allocating {} MiB", (2 * n) >> 20), e))
    }

    pub(crate) fn upload_bf16(&self, name: &str, t: &HostTensor<'_>) -> BResult<CudaSlice<u16>> {
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

    /// Activations `[rows, cols]` from host values (rounded to bf16).
    pub fn act_from_host(&self, data: &[f32], cols: usize) -> BResult<DevAct> {
        let bits: Vec<u16> = data
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        let rows = data.len() / cols;
        Ok(DevAct {
            storage: self
                .stream
                .clone_htod(&bits)
                .map_err(|e| be_err("upload", e))?,
            first: 0,
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

    /// Copies device bf16 values to the host as f32 (the first `n`).
    pub fn download(&self, buf: &CudaSlice<u16>, n: usize) -> BResult<Vec<f32>> {
        let start = std::time::Instant::now();
        self.synchronize()?;
        self.waited.set(self.waited.get() + start.elapsed());
        self.download_bf16(buf, 0, n)
    }

    /// Copies `n` bf16 values from `off` on to the host as f32, in stream order (no wait
    /// counted).
    pub(crate) fn download_bf16(
        &self,
        buf: &CudaSlice<u16>,
        off: usize,
        n: usize,
    ) -> BResult<Vec<f32>> {
        if off + n > buf.len() {
            return Err(BackendError(format!(
                "download of {n} values at {off} from a buffer of {}",
                buf.len()
            )));
        }
        let mut bits = vec![0u16; n];
        self.stream
            .memcpy_dtoh(&buf.slice(off..off + n), &mut bits)
            .map_err(|e| be_err("download", e))?;
        Ok(bits
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect())
    }

    /// Copies `n` elements from `src + src_off` to `dst + dst_off` (offsets in elements of T).
    pub(crate) fn copy<T>(
        &self,
        dst: &impl DevMem<T>,
        dst_off: usize,
        src: &impl DevMem<T>,
        src_off: usize,
        n: usize,
    ) -> BResult<()> {
        let sz = std::mem::size_of::<T>();
        if n == 0 || !self.k.enqueue() {
            return Ok(());
        }
        // SAFETY: both ranges lie inside live device buffers of at least these sizes.
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

    /// Grows `c` to hold `needed` tokens: to exactly that with `exact`, else at least doubling.
    pub(crate) fn reserve(
        &self,
        c: &mut DevSparseCache,
        needed: usize,
        cfg: &SparseConfig,
        exact: bool,
    ) -> BResult<()> {
        use crate::plan::windows;
        if needed <= c.cap {
            return Ok(());
        }
        let cap = if exact {
            needed
        } else {
            needed.max(2 * c.cap).max(256)
        };
        let (kw, ru) = (c.kv_width, c.row_units);
        self.grow_store(&mut c.k, c.len * ru, cap * ru)?;
        self.grow_store(&mut c.v, c.len * ru, cap * ru)?;
        let n1 = windows(cap, cfg.k1_window(), cfg.k1_stride()) + 1;
        self.grow_store(&mut c.k1, c.n1 * kw, n1 * kw)?;
        let n2 = windows(cap, cfg.k2_window(), cfg.k2_stride()) + 1;
        self.grow_store(&mut c.k2, c.n2 * kw, n2 * kw)?;
        c.cap = cap;
        Ok(())
    }

    /// Makes `dst` (an empty cache of the same width) hold what `src` holds; `dst` keeps its
    /// reservation where it is large enough, else takes `src`'s capacity.
    pub(crate) fn copy_cache(&self, src: &DevSparseCache, dst: &mut DevSparseCache) -> BResult<()> {
        if src.kv_width != dst.kv_width || src.fp8 != dst.fp8 || dst.len != 0 {
            return Err(BackendError(
                "copy_sparse_cache: the target is not an empty cache of the same shape".into(),
            ));
        }
        if dst.cap < src.cap {
            // The source's buffers are sized for its capacity: the same sizes fit it here.
            self.grow_store(&mut dst.k, 0, src.k.len())?;
            self.grow_store(&mut dst.v, 0, src.v.len())?;
            self.grow_store(&mut dst.k1, 0, src.k1.len())?;
            self.grow_store(&mut dst.k2, 0, src.k2.len())?;
            dst.cap = src.cap;
        }
        let (kw, ru) = (src.kv_width, src.row_units);
        self.copy(&dst.k, 0, &src.k, 0, src.len * ru)?;
        self.copy(&dst.v, 0, &src.v, 0, src.len * ru)?;
        self.copy(&dst.k1, 0, &src.k1, 0, src.n1 * kw)?;
        self.copy(&dst.k2, 0, &src.k2, 0, src.n2 * kw)?;
        (dst.len, dst.n1, dst.n2) = (src.len, src.n1, src.n2);
        Ok(())
    }

    /// Makes `dst` (an empty cache of the same shape) hold `src`'s first `len` tokens (as
    /// `truncate_sparse_cache` leaves them): of its keys, values and both compressed tiers,
    /// the whole pool pages below what `len` tokens hold are `src`'s own (shared, read-only
    /// for both: neither writes below those lengths again), the page each length falls in
    /// copied. Without the pool, a copy.
    pub(crate) fn share_cache(
        &self,
        src: &DevSparseCache,
        dst: &mut DevSparseCache,
        cfg: &SparseConfig,
        len: usize,
    ) -> BResult<()> {
        if src.kv_width != dst.kv_width || src.fp8 != dst.fp8 || dst.len != 0 || len > src.len {
            return Err(BackendError(format!(
                "share_sparse_cache: {len} tokens of a cache of {} into one not empty or not of its shape",
                src.len
            )));
        }
        let page = match self.pool.as_ref() {
            Some(p) => p.borrow().page_bytes(),
            None => 0,
        };
        let paged = [&src.k, &src.v, &src.k1, &src.k2]
            .iter()
            .all(|s| matches!(s, Store::Paged { .. }));
        if page == 0 || !paged {
            self.copy_cache(src, dst)?;
            dst.hold(cfg, len);
            return Ok(());
        }
        dst.hold(cfg, len);
        // A store holding `src`'s first `units` 16-bit units: its whole pages shared, the
        // rest copied; addresses and pages for as many units as `src`'s store has.
        let shared = |from: &Store<u16>, units: usize| -> BResult<Store<u16>> {
            let Store::Paged { buf, len: cap } = from else {
                return Err(BackendError(
                    "share_sparse_cache: a store outside the pool".into(),
                ));
            };
            let whole = units * 2 / page;
            let mut own = pool::PagedBuf::share_prefix(buf, whole)?;
            own.ensure(*cap * 2)?;
            let store = Store::Paged {
                buf: own,
                len: *cap,
            };
            let start = whole * page / 2;
            self.copy(&store, start, from, start, units - start)?;
            Ok(store)
        };
        let (ru, kw) = (src.row_units, src.kv_width);
        dst.k = shared(&src.k, len * ru)?;
        dst.v = shared(&src.v, len * ru)?;
        dst.k1 = shared(&src.k1, dst.n1 * kw)?;
        dst.k2 = shared(&src.k2, dst.n2 * kw)?;
        dst.cap = src.cap;
        Ok(())
    }

    /// Makes `store` hold `n` elements, keeping its first `kept`: in place in the page pool,
    /// else by a new allocation and a copy.
    fn grow_store(&self, store: &mut Store<u16>, kept: usize, n: usize) -> BResult<()> {
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
    pub(crate) fn new_store<T: DeviceRepr + ValidAsZeroBits>(
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
                    // SAFETY: the buffer maps at least n * size bytes.
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
        self.pool = Some(std::rc::Rc::new(std::cell::RefCell::new(p)));
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
}

#[cfg(test)]
mod tests {
    /// Pair p of an interleaved word, taken as the kernels take it, holds inputs 2p and 2p + 1.
    #[test]
    fn interleaved_w4_words_give_consecutive_pairs() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..1000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let word = x as u32;
            let w = super::interleave_w4(word);
            for p in 0..4 {
                let pair = (w >> (4 * p)) & 0x000F_000F;
                let nibble = |i: u32| (word >> (4 * i)) & 0xF;
                assert_eq!(pair & 0xF, nibble(2 * p), "{word:#010x} pair {p}");
                assert_eq!(pair >> 16, nibble(2 * p + 1), "{word:#010x} pair {p}");
            }
        }
    }

    use super::*;
    use sala_cpu::CpuBackend;
    use sala_model::memory::{MemoryLimit, MemoryPlan};
    use sala_model::Backend;

    const MIB: usize = 1 << 20;
    const GIB: f64 = (1u64 << 30) as f64;

    fn released() -> ModelConfig {
        sala_checkpoint::preset("minicpm-sala-9b").unwrap()
    }

    #[test]
    fn facts_of_the_released_preset_at_8192_rows() {
        let c = released();
        assert_eq!(
            memory_facts(&c, 8192, None, true),
            BackendMemory {
                value_bytes: 2,
                cache_page: None,
                scratch: 592 * MIB,
                runtime: 600 * MIB,
                packs_quantized: true,
                packs_fp8_kv: true,
                ranks: None,
            }
        );
        assert_eq!(
            memory_facts(&c, 8192, Some(2 * MIB), true),
            BackendMemory {
                value_bytes: 2,
                cache_page: Some(2 * MIB),
                scratch: 592 * MIB,
                runtime: (600 + 256) * MIB,
                packs_quantized: true,
                packs_fp8_kv: true,
                ranks: None,
            }
        );
    }

    #[test]
    fn plan_at_1m_tokens_matches_perf_md() {
        let c = released();
        let p = MemoryPlan::new(&c, 1 << 20, 8192, &memory_facts(&c, 8192, None, true));
        let gib = |b: usize| b as f64 / GIB;
        // PERF.md: weights 17.65 GiB, K/V 8 GiB, lightning state 48 MiB.
        assert!((gib(p.weights) - 17.65).abs() < 0.005, "{}", gib(p.weights));
        assert_eq!(p.cache.kv, 8 << 30);
        assert_eq!(p.cache.lightning_state, 48 * MIB);
        // PERF.md's memory line says "~0.6 GiB" of compressed keys; its decode line, "~335
        // MB": both tiers of keys, one bf16 K row per window, are the latter.
        assert!(gib(p.cache.compressed) < 0.6, "{}", gib(p.cache.compressed));
        assert!(
            (p.cache.compressed as f64 / 1e6 - 335.0).abs() < 2.0,
            "{}",
            p.cache.compressed
        );
        // 12 buffers of 8192 bf16 rows: 3 x 4096 + 3 x 4096 + 2 x 256 + 2 x 4096 + 32768 + 16384.
        assert_eq!(p.workspace, 8192 * 82_432 * 2);
        assert_eq!((p.scratch, p.runtime), (592 * MIB, 600 * MIB));
        // PERF.md's goal: a 1M-token context in under 30 GiB.
        assert!(gib(p.total()) < 30.0, "{}", gib(p.total()));
        assert!(gib(p.total()) > 28.0, "{}", gib(p.total()));
        let limit = |gib: usize| MemoryLimit {
            bytes: gib << 30,
            source: "--max-memory test".into(),
        };
        assert!(p.check(&limit(30)).is_ok() && p.check(&limit(20)).is_err());
    }

    #[test]
    fn plan_grows_with_the_chunk_and_differs_from_the_cpus() {
        let c = released();
        let p = |ctx, rows| MemoryPlan::new(&c, ctx, rows, &memory_facts(&c, rows, None, true));
        assert!(p(4096, 8192).total() < p(8192, 8192).total());
        // A 16K-row chunk's stacked product (4 x 4096 columns, bf16) outgrows the constant.
        assert_eq!(p(4096, 16384).scratch, 16384 * 16384 * 2 + 336 * MIB);
        // The CPU holds f32 values and no CUDA allowances.
        let cpu = MemoryPlan::new(
            &c,
            4096,
            8192,
            &CpuBackend::default().memory_facts(&c, 8192),
        );
        let gpu = p(4096, 8192);
        assert_eq!(cpu.weights, 2 * gpu.weights);
        assert_eq!(cpu.cache.kv, 2 * gpu.cache.kv);
        assert_eq!(cpu.cache.lightning_state, gpu.cache.lightning_state);
        assert_eq!(cpu.workspace, 2 * gpu.workspace);
        assert_eq!((cpu.scratch, cpu.runtime), (0, 0));
    }

    #[test]
    fn an_fp8_cache_counts_codes_and_scales_on_the_gpu_and_values_on_the_cpu() {
        let mut c = released();
        let bf16 = MemoryPlan::new(
            &c,
            1 << 20,
            8192,
            &memory_facts(&c, 8192, Some(2 * MIB), true),
        );
        c.sparse.kv_cache = sala_checkpoint::KvCacheDtype::Fp8;
        let fp8 = MemoryPlan::new(
            &c,
            1 << 20,
            8192,
            &memory_facts(&c, 8192, Some(2 * MIB), true),
        );
        // 8 sparse layers, K and V, 256 codes and two 4-byte scales padded to 16 a token.
        assert_eq!(fp8.cache.kv, 8 * 2 * (1 << 20) * 272);
        assert_eq!(bf16.cache.kv, 8 * 2 * (1 << 20) * 512);
        assert_eq!(fp8.cache.compressed, bf16.cache.compressed);
        assert_eq!(fp8.cache.lightning_state, bf16.cache.lightning_state);
        // The CPU keeps an FP8 cache's values (as f32), so its plan does not shrink.
        let cpu = MemoryPlan::new(
            &c,
            4096,
            8192,
            &CpuBackend::default().memory_facts(&c, 8192),
        );
        assert_eq!(cpu.cache.kv, 8 * 2 * 4096 * 256 * 4);
    }

    #[test]
    fn the_pool_costs_its_pages_and_its_own_bytes() {
        let c = released();
        let page = 2 * MIB;
        let plain = MemoryPlan::new(&c, 1 << 20, 8192, &memory_facts(&c, 8192, None, true));
        let pool = MemoryPlan::new(&c, 1 << 20, 8192, &memory_facts(&c, 8192, Some(page), true));
        assert_eq!(pool.cache.kv, plain.cache.kv);
        assert!(pool.cache.compressed > plain.cache.compressed);
        assert_eq!(pool.scratch, plain.scratch);
        assert_eq!(pool.runtime, plain.runtime + POOL_BYTES);
    }
}
