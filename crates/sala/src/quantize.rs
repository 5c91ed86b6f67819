//! `sala quantize`: a 4-bit GPTQ-layout checkpoint (round to nearest, or GPTQ calibrated on a
//! text) or an FP8 one (compressed-tensors layout) written from a bf16 checkpoint.

use crate::device::RunChoices;
use crate::{human_bytes, open_model_files, progress_bar};
use anyhow::{bail, Context, Result};
use clap::Args;
use sala_checkpoint::Checkpoint;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct QuantizeArgs {
    /// The bf16 (or f16/f32) checkpoint directory.
    input: PathBuf,
    /// Where to write the quantized checkpoint (created; the tokenizer files are copied).
    output: PathBuf,
    /// `w4-rtn`: 4-bit weights, round to nearest (GPTQ layout); `gptq`: 4-bit weights by
    /// GPTQ over --calibration's text (GPTQ layout); `fp8`: E4M3 weights with a scale per
    /// output channel (compressed-tensors layout; inputs are scaled per token).
    #[arg(long, default_value = "w4-rtn")]
    method: String,
    /// fp8: one scale per weight matrix instead of one per output channel.
    #[arg(long)]
    per_tensor: bool,
    /// gptq: the text whose tokens calibrate it (the layers' inputs on it, on the CPU).
    #[arg(long, value_name = "FILE")]
    calibration: Option<PathBuf>,
    /// gptq: calibration tokens used at most, in passes of --calibration-len.
    #[arg(long, default_value_t = 4096)]
    calibration_tokens: usize,
    /// gptq: tokens a calibration pass reads.
    #[arg(long, default_value_t = 512)]
    calibration_len: usize,
    /// Inputs sharing a scale and zero point (a multiple of 8), or -1 for one group a row.
    #[arg(long, default_value_t = 128, allow_hyphen_values = true)]
    group: i64,
    /// Asymmetric groups (a zero point each) instead of symmetric ones.
    #[arg(long)]
    asym: bool,
    /// Leave the output gates (`o_gate`, `z_proj`) in bf16, as GPTQModel's usual skip list.
    #[arg(long)]
    keep_gates: bool,
}

pub fn run(args: QuantizeArgs) -> Result<()> {
    if !["w4-rtn", "gptq", "fp8"].contains(&args.method.as_str()) {
        bail!(
            "--method {}: expected w4-rtn (4-bit, round to nearest), gptq (4-bit, calibrated) \
             or fp8",
            args.method
        );
    }
    if args.method == "fp8" {
        return quantize_fp8(&args);
    }
    if (args.method == "gptq") != args.calibration.is_some() {
        bail!("--calibration FILE goes with --method gptq (and only with it)");
    }
    let group_size = match args.group {
        -1 => None,
        g if g > 0 && g % 8 == 0 => Some(g as usize),
        g => bail!("--group {g}: expected -1 or a positive multiple of 8"),
    };
    if args.output.exists() && std::fs::read_dir(&args.output)?.next().is_some() {
        bail!("{}: exists and is not empty", args.output.display());
    }
    let src = Checkpoint::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    let q = sala_checkpoint::quant::Gptq {
        group_size,
        sym: !args.asym,
        zero_minus_one: true,
        skip: if args.keep_gates {
            vec![r".*\.o_gate".into(), r".*\.z_proj".into()]
        } else {
            Vec::new()
        },
    };
    let hessians = match &args.calibration {
        Some(file) => calibrate(&args, file)?,
        None => Default::default(),
    };
    let hessians = &hessians;
    let hessian = move |name: &str| -> Option<&[f64]> {
        let layer = name
            .strip_prefix("model.layers.")?
            .split('.')
            .next()?
            .parse::<usize>()
            .ok()?;
        let which = sala_model::LinearInput::of(name)?;
        hessians.get(&(layer, which)).map(Vec::as_slice)
    };
    let bar = progress_bar(0, "quantizing");
    sala_checkpoint::quant::write_quantized_calibrated(
        &src,
        &args.output,
        &q,
        &hessian,
        &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        },
    )
    .with_context(|| format!("writing {}", args.output.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} (4-bit GPTQ layout, {} groups{})",
        args.output.display(),
        group_size.map_or("row".to_string(), |g| format!("{g}-input")),
        if args.asym {
            ", asymmetric"
        } else {
            ", symmetric"
        }
    );
    Ok(())
}

/// Σ xᵀx of every linear layer's inputs (by layer and input) over `file`'s tokens, the bf16
/// model run on the CPU in passes of `--calibration-len` tokens.
#[allow(clippy::type_complexity)]
fn calibrate(
    args: &QuantizeArgs,
    file: &Path,
) -> Result<std::collections::HashMap<(usize, sala_model::LinearInput), Vec<f64>>> {
    use std::cell::RefCell;
    use std::rc::Rc;
    if args.calibration_len == 0 || args.calibration_tokens == 0 {
        bail!("--calibration-len and --calibration-tokens must be at least 1");
    }
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the calibration text {}", file.display()))?;
    let (checkpoint, tokenizer) = open_model_files(
        &args.input,
        RunChoices {
            kv_cache: sala_checkpoint::KvCacheDtype::Bf16,
            fp8_weights: false,
        },
    )?;
    let mut ids = tokenizer.encode(&text, true)?;
    ids.truncate(args.calibration_tokens);
    if ids.len() < 2 {
        bail!("{}: too little text to calibrate on", file.display());
    }
    let c = checkpoint.config().clone();
    // Every layer's four Hessians are held at once.
    let hd = c.num_attention_heads * c.head_dim;
    let per_layer = 2 * c.hidden_size.pow(2) + hd.pow(2) + c.intermediate_size.pow(2);
    let bytes = c.num_hidden_layers * per_layer * 8;
    let mut probe: Vec<f64> = Vec::new();
    probe
        .try_reserve_exact(c.num_hidden_layers * per_layer)
        .map_err(|_| {
            anyhow::anyhow!(
                "calibration holds every layer's input Hessians, {}; this host cannot give that",
                human_bytes(bytes)
            )
        })?;
    drop(probe);
    let be = sala_cpu::CpuBackend::default();
    let model = sala_engine::generate::load_model(&be, &checkpoint, &mut |_, _| {})?;
    let sums: Rc<RefCell<std::collections::HashMap<(usize, sala_model::LinearInput), Vec<f64>>>> =
        Rc::default();
    let record = sums.clone();
    model.record_linear_inputs(Some(Box::new(move |layer, which, x, cols| {
        let mut sums = record.borrow_mut();
        let h = sums
            .entry((layer, which))
            .or_insert_with(|| vec![0f64; cols * cols]);
        for row in x.chunks_exact(cols) {
            for a in 0..cols {
                let xa = row[a] as f64;
                if xa == 0.0 {
                    continue;
                }
                let ha = &mut h[a * cols..(a + 1) * cols];
                for (hb, &xb) in ha.iter_mut().zip(row) {
                    *hb += xa * xb as f64;
                }
            }
        }
    })));
    let bar = progress_bar(ids.len(), "calibrating");
    let mut ws = model.workspace(&be, args.calibration_len.min(ids.len()))?;
    for chunk in ids.chunks(args.calibration_len) {
        let mut seq = model.new_sequence(&be)?;
        model.prefill(&be, &mut ws, &mut seq, chunk, &mut |_| {})?;
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    model.record_linear_inputs(None);
    drop(model);
    let sums = Rc::try_unwrap(sums)
        .map_err(|_| anyhow::anyhow!("calibration: the recorder outlived the model"))?
        .into_inner();
    Ok(sums)
}

/// `sala quantize --method fp8`.
fn quantize_fp8(args: &QuantizeArgs) -> Result<()> {
    if args.output.exists() && std::fs::read_dir(&args.output)?.next().is_some() {
        bail!("{}: exists and is not empty", args.output.display());
    }
    let src = Checkpoint::open(&args.input)
        .with_context(|| format!("opening {}", args.input.display()))?;
    if args.keep_gates {
        bail!(
            "--keep-gates: FP8 runs a layer's stacked q/k/v/gate product in one format, so the \
             gates are quantized with them (--keep-gates is for w4-rtn)"
        );
    }
    let f = sala_checkpoint::fp8::Fp8Checkpoint {
        format: sala_checkpoint::fp8::Fp8Format::CompressedTensors,
        per_channel: !args.per_tensor,
        skip: Vec::new(),
    };
    let bar = progress_bar(0, "quantizing");
    sala_checkpoint::quant::write_fp8(&src, &args.output, &f, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("writing {}", args.output.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} (FP8 E4M3 weights, compressed-tensors layout, a scale per {})",
        args.output.display(),
        if args.per_tensor {
            "matrix"
        } else {
            "output channel"
        }
    );
    Ok(())
}
