//! `sala inspect`: a checkpoint's shape and memory, and a GPU's limits and kernel plans.

use crate::device::{cuda_options, Device, DeviceStats, Opened};
use crate::{human_bytes, human_count};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use sala_checkpoint::{preset, Checkpoint, KvCacheDtype, MixerKind, ModelConfig};
use sala_cuda::plan::CheckShape;
use sala_cuda::CudaBackend;
use sala_model::context::{prompt_ranges, range_bytes};
use sala_model::memory::{
    cache_bytes, speculation_bytes, weight_bytes, BackendMemory, MemoryPlan, RankShare,
};
use sala_model::parallel::TensorParallel;
use sala_model::{AttnShape, Backend};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct InspectArgs {
    /// Checkpoint directory (config.json, safetensors, tokenizer files); without it, the
    /// released shape for the device section.
    model: Option<PathBuf>,
    /// Describe this GPU too: cuda or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// Describe the GPU as it runs under this card's profile (see `sala generate --help`).
    #[arg(long, value_name = "CARD")]
    device_profile: Option<String>,
    /// Prompt tokens per prefill chunk, for the memory plan.
    #[arg(long, default_value_t = 8192)]
    prefill_chunk: usize,
    /// The K/V cache of the GPU's memory plan: bf16 or fp8.
    #[arg(long, value_name = "DTYPE", default_value = "bf16")]
    kv_cache_dtype: String,
    /// The memory each GPU of N in tensor parallelism holds (with --context-parallel, each
    /// context rank a group of N).
    #[arg(long, value_name = "N", default_value_t = 1)]
    tensor_parallel: usize,
    /// The memory each GPU holds when N context-parallel ranks read a prompt.
    #[arg(long, value_name = "N", default_value_t = 1)]
    context_parallel: usize,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let gpu = args.device.is_some() || args.device_profile.is_some();
    let (tp, cp) = (args.tensor_parallel, args.context_parallel);
    if tp == 0 || cp == 0 {
        bail!("--tensor-parallel and --context-parallel must be at least 1");
    }
    let several = tp > 1 || cp > 1;
    let mut config = match &args.model {
        Some(dir) => {
            checkpoint(dir)?;
            Checkpoint::open(dir)?.config().clone()
        }
        None if gpu || several => preset("minicpm-sala-9b")?,
        None => bail!(
            "give a checkpoint directory, or --device cuda to describe the GPU (or \
             --tensor-parallel / --context-parallel for the released shape over several GPUs)"
        ),
    };
    config.sparse.kv_cache =
        KvCacheDtype::parse(&args.kv_cache_dtype).map_err(|e| anyhow!("--kv-cache-dtype: {e}"))?;
    if several {
        describe_gpus(&config, tp, cp, args.prefill_chunk)?;
    }
    if !gpu {
        return Ok(());
    }
    let device = Device::parse(args.device.as_deref().unwrap_or("cuda"))?;
    if !matches!(device, Device::Cuda(_)) {
        bail!("--device: inspect describes a GPU (cuda or cuda:N)");
    }
    match device.open_with(cuda_options(args.device_profile.as_deref())?)? {
        Opened::Cuda(be) => describe_gpu(&be, &config, args.prefill_chunk),
        Opened::Cpu(_) | Opened::CpuRanks(_) | Opened::CudaRanks(_) => {
            bail!("no GPU was opened")
        }
    }
}

/// The GPU's limits (and the driver's, under a profile), the plan per kernel family for
/// `c`'s shape, and the memory plan at 8K / 128K / 1M.
fn describe_gpu(be: &CudaBackend, c: &ModelConfig, chunk: usize) -> Result<()> {
    let l = be.limits();
    let d = be.driver_limits();
    let gib = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    println!();
    println!(
        "device          {} (compute capability {}.{})",
        d.name, d.cc.0, d.cc.1
    );
    if let Some(p) = l.profile {
        println!(
            "profile         {p}: plans as {} (compute capability {}.{}), memory capped at {}",
            l.name
                .split(" (as ")
                .nth(1)
                .map_or(l.name.as_str(), |n| n.trim_end_matches(')')),
            l.cc.0,
            l.cc.1,
            gib(l.memory_bytes)
        );
    }
    println!(
        "limits          {} SMs, {} shared memory a block ({} an SM), {} threads and {}K registers \
         an SM, L2 {}, memory {}{}; Hopper wgmma/TMA kernels: {}",
        l.sms,
        human_bytes(l.smem_per_block_optin),
        human_bytes(l.smem_per_sm),
        l.threads_per_sm,
        l.regs_per_sm / 1024,
        human_bytes(l.l2_bytes),
        gib(l.memory_bytes),
        l.bandwidth_gbs
            .map_or(String::new(), |b| format!(", {:.2} TB/s", b / 1000.0)),
        if l.hopper_instructions { "yes" } else { "no" }
    );
    // The library several GPUs would talk through (issue 21: not used by a forward yet).
    match sala_cuda::nccl::load() {
        Ok(n) => println!(
            "nccl            {} ({})",
            n.version().unwrap_or_else(|e| e),
            n.path().display()
        ),
        Err(e) => println!("nccl            {e}"),
    }
    let shape = CheckShape {
        attn: AttnShape {
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        },
        sparse: c.sparse.clone(),
        lightning_heads: c.num_attention_heads,
        lightning_d: c.head_dim,
    };
    println!("kernel plans    (this model's shape; shared memory static + dynamic)");
    for (family, plan) in be.planner().describe(&shape) {
        println!("  {family:<38} {plan}");
    }
    println!(
        "memory plan     one sequence, prefill chunks of {chunk}, a {} K/V cache, against {}:",
        c.sparse.kv_cache.name(),
        gib(be.total_memory().unwrap_or(l.memory_bytes))
    );
    for (label, n) in [("8K", 8usize << 10), ("128K", 128 << 10), ("1M", 1 << 20)] {
        let rows = chunk.min(n);
        let plan = MemoryPlan::new(c, n, rows, &be.memory_facts(c, rows));
        let fits = be.total_memory().is_none_or(|t| plan.total() <= t);
        println!(
            "  {label:>5}  {}  {}: {}",
            gib(plan.total()),
            if fits { "fits" } else { "DOES NOT FIT" },
            plan.describe()
        );
    }
    Ok(())
}

/// What each GPU holds at 8K / 128K / 1M when `cp` context-parallel ranks, each a group of
/// `tp` tensor-parallel GPUs, read one prompt in chunks of `chunk` and the last group decodes
/// on: every rank the whole model (its part of it, in a group), the caches of the prompt up to
/// its range's end and, while it reads, its range's buffers ([`range_bytes`]); beside one GPU
/// alone. By the GPU backend's memory formula (no GPU needed).
fn describe_gpus(c: &ModelConfig, tp: usize, cp: usize, chunk: usize) -> Result<()> {
    let split = TensorParallel::new(c, tp).map_err(|e| anyhow!("{e}"))?;
    let gib = |b: usize| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let facts = |rows: usize, ranks: bool| BackendMemory {
        ranks: ranks.then_some(RankShare {
            tp: split,
            one_memory: false,
        }),
        ..sala_cuda::memory::memory_facts(c, rows, None, true)
    };
    println!();
    let ranks = match (cp, tp) {
        (1, _) => format!("tensor parallel over {tp}"),
        (_, 1) => format!("{cp} context-parallel ranks"),
        _ => format!("{cp} context-parallel ranks of {tp} in tensor parallel"),
    };
    println!(
        "several GPUs    {} GPUs, {ranks}; prefill chunks of {chunk}, a {} K/V cache; per GPU, \
         the fullest (while a prompt is read: the last rank's, which decodes on), against one \
         GPU alone:",
        tp * cp,
        c.sparse.kv_cache.name()
    );
    for (label, n) in [("8K", 8usize << 10), ("128K", 128 << 10), ("1M", 1 << 20)] {
        let ranges = prompt_ranges(c, n, cp);
        let alone = MemoryPlan::new(c, n, chunk.min(n), &facts(chunk.min(n), false));
        let last = ranges.len().saturating_sub(1);
        let fullest = ranges
            .iter()
            .enumerate()
            .map(|(i, r)| {
                // The last rank reads with the engine's step workspace, the others a chunk.
                let rows = if i == last {
                    chunk.min(n)
                } else {
                    chunk.min(r.len())
                };
                let plan = MemoryPlan::new(c, r.end, rows, &facts(rows, tp > 1));
                // A rank keeps its columns of the range's buffers (the residual stream whole).
                let kept = match cp {
                    1 => 0,
                    _ => range_bytes(c, r.len(), 2).div_ceil(split.sparse_ways(c)),
                };
                (plan.total() + kept, plan, kept)
            })
            .max_by_key(|(total, ..)| *total);
        let Some((total, plan, kept)) = fullest else {
            continue;
        };
        let longest = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
        let read = match cp {
            1 => String::new(),
            _ => format!(
                ", range buffers {}; {} ranges, the longest {longest} tokens",
                gib(kept),
                ranges.len()
            ),
        };
        println!(
            "  {label:>5}  {} (one GPU alone {}): {}{read}",
            gib(total),
            gib(alone.total()),
            plan.describe(),
        );
    }
    Ok(())
}

/// The checkpoint's config, parameters, context memory and tokenizer.
fn checkpoint(dir: &Path) -> Result<()> {
    let ckpt = Checkpoint::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    let c = ckpt.config();
    let pattern: String = c
        .mixer_types
        .iter()
        .map(|k| match k {
            MixerKind::Sparse => 'S',
            MixerKind::Lightning => 'L',
        })
        .collect();
    let sparse_layers: Vec<usize> = (0..c.num_hidden_layers)
        .filter(|&i| c.mixer_types[i] == MixerKind::Sparse)
        .collect();
    println!("checkpoint      {}", dir.display());
    println!("files           {}", ckpt.files().len());
    println!(
        "shape           hidden {}, {} layers, {} heads x {} (kv heads: sparse {}, lightning {}), MLP {}, vocab {}",
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.head_dim,
        c.num_key_value_heads,
        c.lightning_nkv,
        c.intermediate_size,
        c.vocab_size
    );
    println!(
        "layers          {pattern}  (S = sparse InfLLM-v2 at {sparse_layers:?}, L = lightning)"
    );
    let s = &c.sparse;
    println!(
        "sparse          blocks of {}, top-{} + {} local = {} selected, compression {}/{} and {}/{}, dense below {} tokens",
        s.block_size,
        s.topk,
        s.local_blocks(),
        s.selected_blocks(),
        s.k1_window(),
        s.k1_stride(),
        s.k2_window(),
        s.k2_stride(),
        s.dense_len
    );
    println!(
        "scales          embedding x{}, residual x{:.6}, logits /{}",
        c.scale_emb,
        c.residual_scale(),
        c.logit_divisor()
    );
    let params = sala_checkpoint::expected_parameter_count(c);
    let format = match (&c.quantization, &c.fp8_checkpoint) {
        (_, Some(f)) => format!(
            " as FP8 E4M3 ({:?} layout, a scale per {}{})",
            f.format,
            if f.per_channel {
                "output channel"
            } else {
                "matrix"
            },
            if f.skip.is_empty() {
                String::new()
            } else {
                format!(", kept in bf16: {}", f.skip.join(" "))
            }
        ),
        (q, None) => match q {
            Some(q) => format!(
                " as 4-bit GPTQ ({}, {}{})",
                q.group_size
                    .map_or("a group a row".to_string(), |g| format!("groups of {g}")),
                if q.sym { "symmetric" } else { "asymmetric" },
                if q.skip.is_empty() {
                    String::new()
                } else {
                    format!(", kept in bf16: {}", q.skip.join(" "))
                }
            ),
            None => String::new(),
        },
    };
    println!(
        "parameters      {} ({params}); stored {}{format}; {} in bf16",
        human_count(params as f64),
        human_bytes(ckpt.total_bytes() as usize),
        human_bytes(weight_bytes(c))
    );
    // What a GPU holds: 4-bit linears packed (the CPU holds every weight's value).
    let held = sala_model::memory::weights_held(c, 2, true);
    if c.quantization.is_some() {
        println!(
            "weights held    {} on a GPU (4-bit linears packed, with their scales and zeros)",
            human_bytes(held)
        );
    } else if c.fp8_checkpoint.is_some() {
        println!(
            "weights held    {} on a GPU (a byte a linear weight and a scale a row)",
            human_bytes(held)
        );
    } else {
        let mut fp8 = c.clone();
        fp8.fp8_weights = true;
        println!(
            "weights held    {} on a GPU in bf16, {} with --quantize fp8 (a byte a linear \
             weight and a scale a row)",
            human_bytes(held),
            human_bytes(sala_model::memory::weights_held(&fp8, 2, true))
        );
    }
    // `+ weights`: as a GPU holds them.
    println!(
        "context memory per sequence (K/V in bf16 or fp8 with --kv-cache-dtype; compressed keys \
         bf16, lightning state fp32):"
    );
    println!(
        "  {:>8}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}  {:>16}  {:>16}",
        "context",
        "K/V bf16",
        "K/V fp8",
        "compressed",
        "state",
        "total bf16",
        "total fp8",
        "+ weights, bf16",
        "+ weights, fp8"
    );
    let mut fp8 = c.clone();
    fp8.sparse.kv_cache = KvCacheDtype::Fp8;
    for (label, n) in [("8K", 8 << 10), ("128K", 128 << 10), ("1M", 1 << 20)] {
        let (m, m8) = (cache_bytes(c, n), cache_bytes(&fp8, n));
        println!(
            "  {:>8}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}  {:>10}  {:>16}  {:>16}",
            label,
            human_bytes(m.kv),
            human_bytes(m8.kv),
            human_bytes(m.compressed),
            human_bytes(m.lightning_state),
            human_bytes(m.total()),
            human_bytes(m8.total()),
            human_bytes(m.total() + held),
            human_bytes(m8.total() + held)
        );
    }
    println!(
        "  a sequence that speculates holds {} more (a copy of its lightning states, its span's k and v rows)",
        human_bytes(speculation_bytes(c))
    );
    match sala_tokenizer::Tokenizer::from_dir(dir) {
        Ok(t) => println!(
            "tokenizer       {} tokens, chat template: {}",
            t.vocab_size(),
            if t.chat_template_source().is_some() {
                "yes"
            } else {
                "none (ChatML fallback)"
            }
        ),
        Err(e) => println!("tokenizer       unusable: {e}"),
    }
    Ok(())
}
