//! `--device auto|cpu|cuda[:N]` and `--device-profile CARD`.

use anyhow::{anyhow, bail, Result};
use clap::Args;
use sala_checkpoint::{Checkpoint, KvCacheDtype, ModelConfig};
use sala_cpu::{CpuBackend, HostRanks};
use sala_cuda::tensor_parallel::NcclSum;
use sala_cuda::{CudaBackend, CudaOptions};
use sala_model::context::Exchange;
use sala_model::memory::{parse_size, MemoryLimit, MemoryPlan};
use sala_model::ranks::{Collective, RankExchange, Ranks};
use sala_model::Backend;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The first GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    Cuda(usize),
}

/// An opened backend.
pub enum Opened {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
    /// Tensor parallelism over simulated ranks on the CPU (`--tensor-parallel N --device cpu`).
    CpuRanks(Box<Ranks<CpuBackend>>),
    /// Tensor parallelism over GPUs, through NCCL.
    CudaRanks(Box<Ranks<CudaBackend>>),
}

/// `$body` with `$be` bound to the opened backend (by value), whatever its kind.
#[macro_export]
macro_rules! on_backend {
    ($opened:expr, $be:ident => $body:expr) => {
        match $opened {
            $crate::device::Opened::Cpu($be) => $body,
            $crate::device::Opened::Cuda($be) => {
                let $be = *$be;
                $body
            }
            $crate::device::Opened::CpuRanks($be) => {
                let $be = *$be;
                $body
            }
            $crate::device::Opened::CudaRanks($be) => {
                let $be = *$be;
                $body
            }
        }
    };
}

impl Device {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => Self::Auto,
            "cpu" => Self::Cpu,
            "cuda" => Self::Cuda(0),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::Cuda(n),
                _ => bail!("--device {s}: expected auto, cpu, cuda or cuda:N"),
            },
        })
    }

    /// Opens the device; on a GPU with `options`. A device profile needs a GPU: with one, a
    /// failure to open it is an error, not a fall-back to the CPU.
    pub fn open_with(self, options: CudaOptions) -> Result<Opened> {
        let profile = options.device_profile.map(|c| c.key);
        match (self, profile) {
            (Self::Cpu, Some(p)) => {
                bail!("--device-profile {p} emulates a GPU: it needs --device cuda")
            }
            (Self::Auto, Some(_)) => return Self::Cuda(0).open_with(options),
            _ => {}
        }
        match self {
            Self::Cpu => Ok(Opened::Cpu(CpuBackend::default())),
            Self::Cuda(n) => match CudaBackend::new(n, options) {
                Ok(b) => Ok(Opened::Cuda(Box::new(b))),
                Err(e) => bail!("--device cuda:{n}: {e}"),
            },
            Self::Auto => match CudaBackend::new(0, options) {
                Ok(b) => Ok(Opened::Cuda(Box::new(b))),
                Err(e) => {
                    if std::env::var_os("SALA_QUIET_DEVICE").is_none() {
                        eprintln!("note: running on the CPU ({e})");
                    }
                    Ok(Opened::Cpu(CpuBackend::default()))
                }
            },
        }
    }
}

/// `--device` and `--device-profile`, shared by every command that runs a model.
#[derive(Args, Clone, Debug)]
pub struct DeviceArgs {
    /// Where to run: auto, cpu, or cuda[:N].
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Run as this card would, on a GPU at least as large: its shared memory, threads and SMs
    /// for every kernel plan, no Hopper-only kernels unless it has them, its memory as the
    /// cap. Cards: a100, a6000, rtx4090, l40s, h100, h200, b200, rtx5090, rtxpro6000.
    #[arg(long, value_name = "CARD")]
    pub device_profile: Option<String>,
    /// Launch every decode step's kernels one by one instead of replaying CUDA graphs of
    /// repeated steps.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// The sparse layers' K/V cache: bf16, or fp8 (E4M3 with a scale per token and KV head,
    /// about half the memory; compressed keys and lightning states stay as they are).
    #[arg(long, value_name = "DTYPE", default_value = "bf16")]
    pub kv_cache_dtype: String,
    /// Split the model over N ranks (tensor parallelism: attention heads and the MLP's width
    /// split, partial sums added across the ranks). With --device cpu, N simulated ranks in
    /// this process (for tests; no faster than one).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Read long prompts with N ranks at once (context parallelism: each rank a range of the
    /// prompt and the whole model; the first device's rank takes the last range and decodes).
    /// With --tensor-parallel M, each rank a group of M devices (N x M in all). With --device
    /// cpu, N simulated ranks in this process (for tests: no faster than one).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub context_parallel: usize,
    /// Quantize a bf16 checkpoint's decoder linears as it loads: fp8 (E4M3 weights with a
    /// scale per output channel, inputs made E4M3 per token; embeddings, norms and lm_head
    /// stay bf16), or none.
    #[arg(long, value_name = "FORMAT", default_value = "none")]
    pub quantize: String,
}

/// How a model runs beyond its checkpoint: `--kv-cache-dtype` and `--quantize`.
#[derive(Debug, Clone, Copy)]
pub struct RunChoices {
    pub kv_cache: KvCacheDtype,
    pub fp8_weights: bool,
}

impl RunChoices {
    pub fn apply(&self, config: &mut ModelConfig) {
        config.sparse.kv_cache = self.kv_cache;
        config.fp8_weights = self.fp8_weights || config.fp8_checkpoint.is_some();
    }

    pub fn apply_to(&self, checkpoint: &mut Checkpoint) {
        checkpoint.set_kv_cache(self.kv_cache);
        checkpoint.set_fp8_weights(self.fp8_weights);
    }
}

/// `--quantize`: whether the decoder linears run in FP8.
pub fn parse_quantize(s: &str) -> Result<bool> {
    match s.to_ascii_lowercase().as_str() {
        "none" | "off" => Ok(false),
        "fp8" => Ok(true),
        other => bail!("--quantize {other}: expected fp8 or none (4-bit checkpoints come from `sala quantize`)"),
    }
}

impl DeviceArgs {
    /// `--kv-cache-dtype` and `--quantize`.
    pub fn choices(&self) -> Result<RunChoices> {
        Ok(RunChoices {
            kv_cache: KvCacheDtype::parse(&self.kv_cache_dtype)
                .map_err(|e| anyhow!("--kv-cache-dtype: {e}"))?,
            fp8_weights: parse_quantize(&self.quantize)?,
        })
    }

    /// Opens the device; with `--tensor-parallel N` above 1, N ranks for the model whose
    /// config `config` reads (asked only then).
    pub fn open(&self, config: impl FnOnce() -> Result<ModelConfig>) -> Result<Opened> {
        let device = Device::parse(&self.device)?;
        let n = self.tensor_parallel;
        if n == 0 {
            bail!("--tensor-parallel must be at least 1");
        }
        if self.context_parallel == 0 {
            bail!("--context-parallel must be at least 1");
        }
        if n == 1 {
            return device.open_with(self.cuda_options()?);
        }
        let first = match device {
            Device::Cpu => None,
            Device::Cuda(k) => Some(k),
            Device::Auto => CudaBackend::new(0, self.cuda_options()?)
                .is_ok()
                .then_some(0),
        };
        let config = config()?;
        let Some(first) = first else {
            let cpus: Vec<_> = (0..n).map(|_| CpuBackend::default()).collect();
            let sums = CpuBackend::collective(&cpus)?;
            let ranks = Ranks::new(cpus, sums, &config).map_err(|e| anyhow!("{e}"))?;
            return Ok(Opened::CpuRanks(Box::new(ranks)));
        };
        // GPUs first..first + n, one rank each (decode steps in CUDA graphs on each, the
        // NCCL sums inside them).
        let options = self.cuda_options()?;
        let ordinals: Vec<usize> = (first..first + n).collect();
        let gpus = ordinals
            .iter()
            .map(|&k| {
                CudaBackend::new(k, options.clone()).map_err(|e| anyhow!("--device cuda:{k}: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let sums =
            CudaBackend::collective(&gpus).map_err(|e| anyhow!("--tensor-parallel {n}: {e:#}"))?;
        let ranks = Ranks::new(gpus, sums, &config).map_err(|e| anyhow!("{e}"))?;
        Ok(Opened::CudaRanks(Box::new(ranks)))
    }

    /// The CUDA options of the environment and these flags.
    pub fn cuda_options(&self) -> Result<CudaOptions> {
        let mut o = cuda_options(self.device_profile.as_deref())?;
        if self.no_cuda_graphs {
            o.cuda_graphs = false;
        }
        Ok(o)
    }
}

/// The CUDA options of the environment (`SALA_FALLBACK`, `SALA_KV_POOL`, ...), with the
/// device profile `profile` when given (it overrides `SALA_DEVICE_PROFILE`).
pub fn cuda_options(profile: Option<&str>) -> Result<CudaOptions> {
    let mut o = CudaOptions::from_env().map_err(|e| anyhow!(e))?;
    if let Some(p) = profile {
        o.set_device_profile(p)
            .map_err(|e| anyhow!("--device-profile: {e}"))?;
    }
    Ok(o)
}

/// What the benchmark and the memory checks need to know of a backend beyond the model ops.
pub trait DeviceStats {
    /// Bytes of memory in use now, when known: on a GPU the device's (all processes), on the
    /// CPU this process's resident memory.
    fn memory_in_use(&self) -> Option<usize>;
    /// The memory a plan may take on this device, and what it is: a GPU's total memory; on the
    /// CPU, what the host has available now plus what this process holds. A plan larger is
    /// refused.
    fn total_memory(&self) -> Option<usize>;
    /// What [`DeviceStats::total_memory`] measures, for messages.
    fn total_memory_source(&self) -> String;
    /// Time the host spent waiting for the device so far.
    fn host_wait(&self) -> Option<std::time::Duration>;
    /// Waits for the work queued so far (a no-op on the CPU, which works synchronously).
    fn synchronize(&self) -> anyhow::Result<()> {
        Ok(())
    }
    /// Starts or stops the range an external profiler attached with its recording off at
    /// start records (`ncu --profile-from-start off`); a no-op elsewhere.
    fn profiler_range(&self, on: bool) -> anyhow::Result<()> {
        let _ = on;
        Ok(())
    }
    /// Per-kernel (name, device ms, launches) since the last call, when profiling is on.
    fn profile(&self) -> Option<Vec<(String, f64, usize)>> {
        None
    }
    /// Pages the page pool maps now, and a page's bytes, when caches live in one.
    fn page_pool(&self) -> Option<(usize, usize)> {
        None
    }
    /// The block lists of the last sparse selection, `n` ids (query, KV group, then entry;
    /// −1 pads), where the backend keeps them.
    fn last_block_lists(&self, n: usize) -> Option<Vec<i32>> {
        let _ = n;
        None
    }
    /// Context parallelism: `n` more ranks of this kind, the i-th on the device `stride · i`
    /// past this one's where the devices are separate (a tensor-parallel group's rank asks
    /// with its group's size, so that each new group's ranks lie side by side), and how
    /// these ranks and this one exchange, in rank order (the new ones, then this); an error
    /// naming the device where it has none yet.
    fn context_ranks(&self, n: usize, stride: usize) -> Result<ContextRanksOf<Self>>
    where
        Self: Backend + Sized,
    {
        let _ = (n, stride);
        bail!("context parallelism on {} is not built yet", self.name())
    }
    /// Tensor parallelism: how `ranks` (backends of this kind, in rank order) sum across
    /// each other.
    fn collective(ranks: &[Self]) -> Result<Box<dyn Collective<Self> + Send>>
    where
        Self: Backend + Sized,
    {
        let name = ranks.first().map_or_else(String::new, |b| b.name());
        bail!("tensor parallelism on {name} is not built")
    }
    /// Caps the memory every sequence's caches take together, where the backend can (a page
    /// pool); elsewhere admission by the memory plan is the only check.
    fn limit_cache_memory(&self, _bytes: usize) {}
}

/// Caps the caches on `be` at what `limit` leaves beside the rest of `plan`.
pub fn cap_caches<B: DeviceStats>(be: &B, limit: Option<&MemoryLimit>, plan: &MemoryPlan) {
    if let Some(limit) = limit {
        be.limit_cache_memory(plan.room_for_caches(limit));
    }
}

/// More ranks of a backend's kind and their exchange ([`DeviceStats::context_ranks`]).
pub type ContextRanksOf<B> = (Vec<B>, Box<dyn Exchange<B> + Send>);

impl DeviceStats for CpuBackend {
    /// Simulated ranks in this process.
    fn context_ranks(&self, n: usize, _stride: usize) -> Result<ContextRanksOf<Self>> {
        Ok((
            (0..n).map(|_| CpuBackend::default()).collect(),
            Box::new(HostRanks),
        ))
    }
    fn collective(_ranks: &[Self]) -> Result<Box<dyn Collective<Self> + Send>> {
        Ok(Box::new(HostRanks))
    }
    fn memory_in_use(&self) -> Option<usize> {
        resident_bytes()
    }
    fn total_memory(&self) -> Option<usize> {
        Some(host_available_bytes()? + resident_bytes().unwrap_or(0))
    }
    fn total_memory_source(&self) -> String {
        "the memory available on this host".into()
    }
    fn host_wait(&self) -> Option<std::time::Duration> {
        None
    }
}

/// Each rank's device holds its part: memory in use is the fullest rank's, the total the
/// smallest rank's.
impl<B: Backend + DeviceStats + 'static> DeviceStats for Ranks<B> {
    fn memory_in_use(&self) -> Option<usize> {
        self.ranks()
            .iter()
            .map(|b| b.memory_in_use())
            .max()
            .flatten()
    }
    fn total_memory(&self) -> Option<usize> {
        self.ranks()
            .iter()
            .map(|b| b.total_memory())
            .min()
            .flatten()
    }
    fn total_memory_source(&self) -> String {
        format!("{} (a rank's)", self.ranks()[0].total_memory_source())
    }
    fn host_wait(&self) -> Option<std::time::Duration> {
        self.ranks().iter().map(|b| b.host_wait()).max().flatten()
    }
    fn synchronize(&self) -> anyhow::Result<()> {
        self.ranks().iter().try_for_each(|b| b.synchronize())
    }
    fn profile(&self) -> Option<Vec<(String, f64, usize)>> {
        self.ranks()[0].profile()
    }
    fn page_pool(&self) -> Option<(usize, usize)> {
        self.ranks()[0].page_pool()
    }
    fn limit_cache_memory(&self, bytes: usize) {
        for b in self.ranks() {
            b.limit_cache_memory(bytes);
        }
    }
    /// `n` more groups as large, each a context rank: rank `r` of every group from this
    /// group's rank `r` (its exchange joins them), the groups' devices side by side.
    fn context_ranks(&self, n: usize, stride: usize) -> Result<ContextRanksOf<Self>> {
        let size = self.ranks().len();
        let mut by_rank = Vec::with_capacity(size);
        let mut exchanges = Vec::with_capacity(size);
        for be in self.ranks() {
            let (more, exchange) = be.context_ranks(n, stride * size)?;
            if more.len() != n {
                bail!("{} context ranks made for {n}", more.len());
            }
            by_rank.push(more.into_iter());
            exchanges.push(exchange);
        }
        let groups = (0..n)
            .map(|_| {
                let group: Vec<B> = by_rank.iter_mut().filter_map(|m| m.next()).collect();
                let sums = B::collective(&group)?;
                Ranks::new(group, sums, self.config()).map_err(|e| anyhow!("{e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((groups, Box::new(RankExchange::new(exchanges))))
    }
    fn collective(_groups: &[Self]) -> Result<Box<dyn Collective<Self> + Send>> {
        bail!("tensor parallelism over tensor-parallel groups is not built")
    }
}

impl DeviceStats for CudaBackend {
    /// Ranks on the GPUs `stride` apart after this one's, exchanging with it through NCCL,
    /// where there are that many; else every rank on this GPU (copies within it).
    fn context_ranks(&self, n: usize, stride: usize) -> Result<ContextRanksOf<Self>> {
        let k = self.ordinal();
        let gpus = CudaBackend::device_count().map_err(|e| anyhow!("counting the GPUs: {e}"))?;
        let spread = k + n * stride < gpus;
        let ordinals: Vec<usize> = (1..=n)
            .map(|i| if spread { k + i * stride } else { k })
            .collect();
        let backends = ordinals
            .iter()
            .map(|&o| {
                CudaBackend::new(o, self.options()).map_err(|e| anyhow!("--device cuda:{o}: {e}"))
            })
            .collect::<Result<Vec<_>>>()?;
        if !spread {
            return Ok((backends, Box::new(sala_cuda::context::OneDevice)));
        }
        // Rank order: the new ranks, then this one (the engine's, the last range).
        let all: Vec<usize> = ordinals.iter().copied().chain([k]).collect();
        let nccl = sala_cuda::context::NcclExchange::new(&all)
            .map_err(|e| anyhow!("NCCL over GPUs {all:?}: {e}"))?;
        Ok((backends, Box::new(nccl)))
    }
    fn last_block_lists(&self, n: usize) -> Option<Vec<i32>> {
        self.last_selection(n).ok()
    }
    fn memory_in_use(&self) -> Option<usize> {
        self.memory().ok().map(|m| m.0)
    }
    fn total_memory(&self) -> Option<usize> {
        self.memory().ok().map(|m| m.1)
    }
    fn total_memory_source(&self) -> String {
        format!("the total memory of {}", self.name())
    }
    fn host_wait(&self) -> Option<std::time::Duration> {
        Some(CudaBackend::host_wait(self))
    }
    fn synchronize(&self) -> anyhow::Result<()> {
        Ok(CudaBackend::synchronize(self)?)
    }
    fn profile(&self) -> Option<Vec<(String, f64, usize)>> {
        self.profile_report()
    }
    fn profiler_range(&self, on: bool) -> anyhow::Result<()> {
        Ok(CudaBackend::profiler_range(self, on)?)
    }
    fn page_pool(&self) -> Option<(usize, usize)> {
        let pool = CudaBackend::page_pool(self)?.borrow();
        Some((pool.pages_in_use(), pool.page_bytes()))
    }
    fn limit_cache_memory(&self, bytes: usize) {
        CudaBackend::limit_cache_memory(self, bytes)
    }
    /// NCCL's all-reduce over the ranks' GPUs.
    fn collective(ranks: &[Self]) -> Result<Box<dyn Collective<Self> + Send>> {
        let ordinals: Vec<usize> = ranks.iter().map(|b| b.ordinal()).collect();
        let sums =
            NcclSum::new(&ordinals).map_err(|e| anyhow!("NCCL over GPUs {ordinals:?}: {e}"))?;
        Ok(Box::new(sums))
    }
}

/// This process's resident memory (`VmRSS` of /proc/self/status), where there is one.
/// The host memory available for new work (`MemAvailable` of /proc/meminfo; Linux only).
fn host_available_bytes() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

fn resident_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// The prefix cache's flags (`sala chat`, `sala serve`).
#[derive(clap::Args, Debug, Clone)]
pub struct PrefixCacheArgs {
    /// Keep the states of ended requests for prompts that begin with the same tokens (a
    /// chat's next turn, another question about the same document): `on` or `off`.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
    pub prefix_cache: String,
    /// Most memory the prefix cache keeps (e.g. 8G) [default: what the memory limit leaves
    /// for caches, else 4G]. Kept states also go whenever a request needs their memory.
    #[arg(long, value_name = "SIZE")]
    pub prefix_cache_memory: Option<String>,
}

impl PrefixCacheArgs {
    /// The prefix cache's byte limit (`None`: off); `room` is what the memory limit leaves
    /// for caches, where there is one.
    pub fn limit(&self, room: Option<usize>) -> Result<Option<usize>> {
        if self.prefix_cache == "off" {
            return Ok(None);
        }
        match &self.prefix_cache_memory {
            Some(s) => Ok(Some(
                parse_size(s).map_err(|e| anyhow!("--prefix-cache-memory {e}"))?,
            )),
            None => Ok(Some(room.unwrap_or(4 << 30))),
        }
    }
}

/// `--max-memory SIZE` as a limit (an error naming the flag for junk).
pub fn user_memory_limit(arg: Option<&str>) -> Result<Option<MemoryLimit>> {
    arg.map(|s| {
        let bytes = parse_size(s).map_err(|e| anyhow!("--max-memory {e}"))?;
        Ok(MemoryLimit {
            bytes,
            source: format!("--max-memory {s}"),
        })
    })
    .transpose()
}

/// The limit a plan on `be` must fit: `user`'s, and the device's memory (a GPU's total, the
/// host's available memory on the CPU) too.
pub fn memory_limit<B: Backend + DeviceStats>(
    be: &B,
    user: Option<MemoryLimit>,
) -> Option<MemoryLimit> {
    let device = be.total_memory().map(|bytes| MemoryLimit {
        bytes,
        source: be.total_memory_source(),
    });
    MemoryLimit::tighter(user, device)
}
