//! The MiniCPM-SALA forward pass (SPEC §3–§7), written once over [`Backend`].

use crate::backend::{AttnIo, BResult, Backend, BackendError, Span, StepInfo};
pub use crate::load::WeightSource;
use crate::load::{Loader, Source};
use crate::memory::{workspace_columns, WORKSPACE_BUFFERS};
use crate::numerics::rope_inv_freq;
use crate::oracle::{AttnShape, SparseMode};
use crate::sequence::SpanKv;
pub use crate::sequence::{AuxCapture, SeqMark};
use sala_checkpoint::{expected_tensors, tensor_name, MixerKind, ModelConfig, Place, Role};

pub(crate) enum Mixer<B: Backend> {
    Lightning {
        /// q, k, v and (with the output gate) z projections, stacked.
        qkvz: B::Matrix,
        o: B::Matrix,
        gated: bool,
        q_norm: Option<B::Vector>,
        k_norm: Option<B::Vector>,
        o_norm: Option<B::Vector>,
    },
    Sparse {
        /// q, k, v and (with the output gate) o_gate projections, stacked.
        qkvg: B::Matrix,
        o: B::Matrix,
        gated: bool,
    },
}

impl<B: Backend> Mixer<B> {
    /// A lightning layer's q and k head norms with `eps` (the checkpoint has both or neither).
    pub(crate) fn head_norms(&self, eps: f32) -> Option<(&B::Vector, &B::Vector, f32)> {
        match self {
            Mixer::Lightning {
                q_norm: Some(q),
                k_norm: Some(k),
                ..
            } => Some((q, k, eps)),
            _ => None,
        }
    }
}

pub(crate) struct Layer<B: Backend> {
    /// Its place in the model.
    index: usize,
    pub(crate) input_norm: B::Vector,
    post_norm: B::Vector,
    pub(crate) mixer: Mixer<B>,
    /// gate_proj and up_proj, stacked.
    gate_up: B::Matrix,
    down_proj: B::Matrix,
}

/// A loaded model: immutable weights on one backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    pub(crate) embed: B::Matrix,
    pub(crate) final_norm: B::Vector,
    /// `None` when the embeddings are tied.
    pub(crate) lm_head: Option<B::Matrix>,
    pub(crate) layers: Vec<Layer<B>>,
    pub(crate) slopes: B::Table,
    pub(crate) inv_freq: B::Table,
    /// Gets every linear layer's input rows when set ([`Model::record_linear_inputs`]).
    recorder: std::cell::RefCell<Option<Box<InputRecorder>>>,
}

/// Which linear layers of a decoder layer an input row feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearInput {
    /// q, k, v and the output gate (the input norm's rows).
    Attention,
    /// o_proj.
    Output,
    /// gate_proj and up_proj (the post-attention norm's rows).
    Mlp,
    /// down_proj.
    Down,
}

impl LinearInput {
    /// Which input weight `name` (a decoder layer's linear) takes.
    pub fn of(name: &str) -> Option<Self> {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let last = module.rsplit('.').next()?;
        Some(match last {
            "q_proj" | "k_proj" | "v_proj" | "o_gate" | "z_proj" => Self::Attention,
            "o_proj" => Self::Output,
            "gate_proj" | "up_proj" => Self::Mlp,
            "down_proj" => Self::Down,
            _ => return None,
        })
    }
}

/// `(layer, which input, rows, columns)` for each product's input of a forward pass.
pub type InputRecorder = dyn FnMut(usize, LinearInput, &[f32], usize);

/// The per-sequence state: how many tokens it holds, and each layer's cache or state.
pub struct SeqState<B: Backend> {
    pub pos: usize,
    /// Unique among the sequences of a process (a backend may key per-sequence work on it).
    pub(crate) id: u64,
    pub(crate) layers: Vec<LayerState<B>>,
    /// The k and v rows of the span read since the last mark, for a rewind into it.
    pub(crate) span_kv: Option<SpanKv<B>>,
    /// The hidden states a draft model reads, when one drafts for this sequence.
    pub aux: Option<AuxCapture<B>>,
}

/// The next [`SeqState`] id.
static NEXT_SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// An id no other sequence of this process has (a draft's states take theirs here too).
pub(crate) fn next_sequence_id() -> u64 {
    NEXT_SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

pub(crate) enum LayerState<B: Backend> {
    Lightning(B::LightningState),
    Sparse(B::SparseCache),
}

pub(crate) fn state_mismatch() -> BackendError {
    BackendError("layer state does not match the layer kind".into())
}

/// One sequence's part of a step ([`Model::forward`]).
pub struct StepInput<'a, B: Backend> {
    pub seq: &'a mut SeqState<B>,
    /// Its next tokens, fed at positions `seq.pos..`.
    pub tokens: &'a [u32],
    /// The attention of its sparse layers ([`Model::sparse_mode`]).
    pub mode: SparseMode,
    pub logits: LogitRows,
}

/// What every layer of a step shares.
struct StepCtx<'a> {
    spans: &'a [Span],
    modes: &'a [SparseMode],
    eps: f32,
    /// The residual branches' scale.
    res: f32,
    /// Rows whose hidden states are kept for a draft: (input, step row, buffer row, rows).
    aux_rows: &'a [[usize; 4]],
    /// The step leaves its picks for later ([`Model::forward_ahead`]).
    picks_later: bool,
}

impl<B: Backend> Layer<B> {
    /// The layer on every row of the step: `ws.a` holds its input norm (made by the previous
    /// layer's last add) and, on return, `next_norm` of its output, which is added into
    /// `ws.h`. `captures[i]`: where sequence `i`'s lightning k and v rows are kept, if they are.
    /// With `keep` (the last layer of a step that reads only some rows' outputs), every row
    /// still joins the sequences' caches and states, but only the last `keep[i]` rows of span
    /// `i` are attended and go on through the rest of the layer, packed to the front of the
    /// buffers in span order ([`PackedRows`]).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        m: &Model<B>,
        be: &B,
        step: &StepCtx<'_>,
        ws: &mut Workspace<B>,
        states: &mut [&mut LayerState<B>],
        captures: &mut [Option<&mut (B::Act, B::Act)>],
        next_norm: &B::Vector,
        keep: Option<&PackedRows>,
    ) -> BResult<()> {
        let c = &m.config;
        let eps = step.eps;
        self.project(m, be, ws)?;
        let (k, v) = match self.mixer {
            Mixer::Lightning { .. } => (&mut ws.kl, &mut ws.vl),
            Mixer::Sparse { .. } => (&mut ws.ks, &mut ws.vs),
        };
        let io = AttnIo {
            q: &mut ws.q,
            k,
            v,
            out: &mut ws.o,
        };
        match &self.mixer {
            Mixer::Lightning { .. } => {
                // Spans a rewind may keep part of: their k and v rows as projected.
                for (cap, s) in captures.iter_mut().zip(step.spans) {
                    if let Some((kc, vc)) = cap.as_deref_mut() {
                        be.copy_rows(&*io.k, s.first_row, kc, 0, s.len)?;
                        be.copy_rows(&*io.v, s.first_row, vc, 0, s.len)?;
                    }
                }
                let mut lstates = states
                    .iter_mut()
                    .map(|s| match s {
                        LayerState::Lightning(st) => Ok(st),
                        LayerState::Sparse(_) => Err(state_mismatch()),
                    })
                    .collect::<BResult<Vec<_>>>()?;
                be.lightning(
                    m.lightning_shape(),
                    &m.slopes,
                    self.mixer.head_norms(eps),
                    c.lightning_use_rope.then_some(&m.inv_freq),
                    io,
                    step.spans,
                    &mut lstates,
                )?;
            }
            Mixer::Sparse { .. } => {
                let mut caches = states
                    .iter_mut()
                    .map(|s| match s {
                        LayerState::Sparse(cache) => Ok(cache),
                        LayerState::Lightning(_) => Err(state_mismatch()),
                    })
                    .collect::<BResult<Vec<_>>>()?;
                match keep {
                    None => be.sparse_attention(
                        m.sparse_shape(),
                        &c.sparse,
                        io,
                        step.spans,
                        step.modes,
                        &mut caches,
                    )?,
                    Some(keep) => {
                        // Rows whose outputs nothing reads join the caches unattended.
                        for ((s, &n), cache) in step.spans.iter().zip(&keep.keep).zip(&mut caches) {
                            let unread = s.first_row..s.first_row + s.len - n;
                            be.append_sparse_kv(cache, &c.sparse, &*io.k, &*io.v, unread)?;
                        }
                        let mut read = (Vec::new(), Vec::new(), Vec::new());
                        for ((s, &n), (&mode, cache)) in step
                            .spans
                            .iter()
                            .zip(&keep.keep)
                            .zip(step.modes.iter().zip(caches))
                        {
                            if n > 0 {
                                read.0.push(Span {
                                    first_row: s.first_row + s.len - n,
                                    len: n,
                                    pos: s.pos + s.len - n,
                                });
                                read.1.push(mode);
                                read.2.push(cache);
                            }
                        }
                        if !read.0.is_empty() {
                            be.sparse_attention(
                                m.sparse_shape(),
                                &c.sparse,
                                io,
                                &read.0,
                                &read.1,
                                &mut read.2,
                            )?;
                        }
                    }
                }
            }
        }
        if let Some(keep) = keep {
            let gated = match &self.mixer {
                Mixer::Lightning { gated, .. } | Mixer::Sparse { gated, .. } => *gated,
            };
            keep.pack(be, ws, step.spans, gated)?;
            if keep.rows == 0 {
                return Ok(());
            }
        }
        self.finish(m, be, ws, step.res, eps, next_norm)
    }

    /// The layer's first product: q, k, v (and the output gate) from its input norm `ws.a`.
    pub(crate) fn project(&self, m: &Model<B>, be: &B, ws: &mut Workspace<B>) -> BResult<()> {
        let c = &m.config;
        m.record(be, self.index, LinearInput::Attention, &ws.a, c.hidden_size)?;
        let (stacked, gated) = match &self.mixer {
            Mixer::Lightning { qkvz, gated, .. } => (qkvz, *gated),
            Mixer::Sparse { qkvg, gated, .. } => (qkvg, *gated),
        };
        let Workspace {
            a,
            q,
            z,
            kl,
            vl,
            ks,
            vs,
            ..
        } = ws;
        let (k, v) = match self.mixer {
            Mixer::Lightning { .. } => (kl, vl),
            Mixer::Sparse { .. } => (ks, vs),
        };
        if gated {
            be.matmul_split(a, stacked, &mut [q, k, v, z])
        } else {
            be.matmul_split(a, stacked, &mut [q, k, v])
        }
    }

    /// The rest of the layer once its attention output is in `ws.o`: the output norm and
    /// gate, o_proj, the residual add and the MLP; `ws.a` gets `next_norm` of the output.
    pub(crate) fn finish(
        &self,
        m: &Model<B>,
        be: &B,
        ws: &mut Workspace<B>,
        res: f32,
        eps: f32,
        next_norm: &B::Vector,
    ) -> BResult<()> {
        let c = &m.config;
        let hd = c.num_attention_heads * c.head_dim;
        let (o_proj, gated) = match &self.mixer {
            Mixer::Lightning { o, gated, .. } => (o, *gated),
            Mixer::Sparse { o, gated, .. } => (o, *gated),
        };
        let normed = match &self.mixer {
            Mixer::Lightning {
                o_norm: Some(w), ..
            } => {
                be.rms_norm_gate(&ws.o, w, eps, gated.then_some(&ws.z), &mut ws.q)?;
                &ws.q
            }
            _ => {
                if gated {
                    be.sigmoid_gate(&mut ws.o, &ws.z)?;
                }
                &ws.o
            }
        };
        m.record(be, self.index, LinearInput::Output, normed, hd)?;
        be.matmul(normed, o_proj, &mut ws.branch)?;
        be.add_scaled_norm_matmul_silu(
            &mut ws.h,
            &ws.branch,
            res,
            &self.post_norm,
            eps,
            &mut ws.a,
            &self.gate_up,
            &mut ws.gate_up,
            &mut ws.act,
        )?;
        m.record(be, self.index, LinearInput::Mlp, &ws.a, c.hidden_size)?;
        m.record(
            be,
            self.index,
            LinearInput::Down,
            &ws.act,
            c.intermediate_size,
        )?;
        be.matmul(&ws.act, &self.down_proj, &mut ws.branch)?;
        be.add_scaled_norm(&mut ws.h, &ws.branch, res, next_norm, eps, &mut ws.a)
    }
}

/// The rows of a step's last layer that go on past its attention, when the step reads only
/// some rows' outputs (logits, a draft's hidden states): the last `keep[i]` rows of span `i`,
/// packed to the front of the buffers in span order. The other rows' attention outputs, output
/// products and MLP would only feed rows nothing reads.
struct PackedRows {
    keep: Vec<usize>,
    /// Where span `i`'s kept rows start once packed.
    first: Vec<usize>,
    /// Rows kept in all.
    rows: usize,
}

impl PackedRows {
    /// `None` when every row is kept.
    fn new(spans: &[Span], keep: Vec<usize>) -> Option<Self> {
        let mut first = Vec::with_capacity(keep.len());
        let mut rows = 0;
        for &n in &keep {
            first.push(rows);
            rows += n;
        }
        (rows < spans.iter().map(|s| s.len).sum()).then_some(Self { keep, first, rows })
    }

    /// Where step row `row` (of span `i`, among its kept rows) lies once packed.
    fn packed(&self, spans: &[Span], row: usize) -> Option<usize> {
        let i = spans.iter().position(|s| s.rows().contains(&row))?;
        let from = spans[i].first_row + spans[i].len - self.keep[i];
        (row >= from).then(|| self.first[i] + row - from)
    }

    /// Moves the kept rows of what the rest of the layer reads (the attention output, the
    /// output gate when `gated`, the residual stream) to the front; every buffer then holds
    /// the kept rows.
    fn pack<B: Backend>(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        spans: &[Span],
        gated: bool,
    ) -> BResult<()> {
        for ((s, &n), &to) in spans.iter().zip(&self.keep).zip(&self.first) {
            let from = s.first_row + s.len - n;
            if n == 0 || from == to {
                continue;
            }
            be.move_rows(&mut ws.o, from, to, n)?;
            be.move_rows(&mut ws.h, from, to, n)?;
            if gated {
                be.move_rows(&mut ws.z, from, to, n)?;
            }
        }
        for buf in ws.buffers_mut() {
            be.set_rows(buf, self.rows);
        }
        Ok(())
    }
}

/// Scratch buffers for one chunk of up to `max_rows` tokens, allocated once: one per entry of
/// [`workspace_columns`], in its order.
pub struct Workspace<B: Backend> {
    /// Rows a step may hold.
    pub max_rows: usize,
    /// Prompt tokens a chunk reads ([`Model::prefill`]); the rest of the rows are for the
    /// decode rows of the same step.
    pub chunk: usize,
    pub(crate) h: B::Act,
    pub(crate) a: B::Act,
    pub(crate) branch: B::Act,
    pub(crate) q: B::Act,
    pub(crate) o: B::Act,
    pub(crate) z: B::Act,
    pub(crate) ks: B::Act,
    pub(crate) vs: B::Act,
    pub(crate) kl: B::Act,
    pub(crate) vl: B::Act,
    pub(crate) gate_up: B::Act,
    pub(crate) act: B::Act,
}

impl<B: Backend> Workspace<B> {
    /// Every buffer, in the order of [`workspace_columns`] (the forward pass sets the row
    /// count of each through this; tests compare them with the memory plan).
    pub fn buffers_mut(&mut self) -> [&mut B::Act; WORKSPACE_BUFFERS] {
        [
            &mut self.h,
            &mut self.a,
            &mut self.branch,
            &mut self.q,
            &mut self.o,
            &mut self.z,
            &mut self.ks,
            &mut self.vs,
            &mut self.kl,
            &mut self.vl,
            &mut self.gate_up,
            &mut self.act,
        ]
    }
}

/// Which rows of a chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
    /// The last row's greedy token only ([`GreedyPick`]): no logits leave the device.
    Greedy,
    /// Every row's greedy token ([`GreedyPick`]; verifying a greedy span): no logits leave
    /// the device.
    GreedyAll,
}

/// How a step runs ahead ([`Model::forward_ahead`]).
#[derive(Debug, Clone, Copy, Default)]
struct Ahead {
    tokens_picked: bool,
    picks_later: bool,
}

/// The greedy token of one row of logits, as the host sampler picks it: the first index of the
/// maximum (NaN read as `-inf`, `+inf` as `f32::MAX`), and its log-probability
/// `-ln Σ exp(x - max)`. `id` is `None` when no logit is a number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GreedyPick {
    pub id: Option<u32>,
    pub logprob: f32,
}

impl GreedyPick {
    /// The pick of one row of logits, on the host.
    pub fn of(row: &[f32]) -> Self {
        let read = |x: f32| {
            if x.is_nan() {
                f32::NEG_INFINITY
            } else {
                x.min(f32::MAX)
            }
        };
        let (mut best, mut at) = (f32::NEG_INFINITY, None);
        for (i, &x) in row.iter().enumerate() {
            let x = read(x);
            if x > best {
                (best, at) = (x, Some(i as u32));
            }
        }
        let sum: f64 = row.iter().map(|&x| ((read(x) - best) as f64).exp()).sum();
        Self {
            id: at,
            logprob: if at.is_some() { -sum.ln() as f32 } else { 0.0 },
        }
    }
}

/// Ends a step as failed if it is dropped still armed: a panic unwinds through the step.
struct EndStepOnUnwind<'a, B: Backend> {
    be: &'a B,
    armed: bool,
}

impl<B: Backend> Drop for EndStepOnUnwind<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.be.end_step(false);
        }
    }
}

/// One input's share of a step's output, as its [`LogitRows`] asked.
#[derive(Debug, Clone, PartialEq)]
pub enum StepLogits {
    /// `[rows, vocab]` (no rows for [`LogitRows::None`]).
    Rows(Vec<f32>),
    /// The last row's greedy token ([`LogitRows::Greedy`]).
    Greedy(GreedyPick),
    /// Every row's greedy token ([`LogitRows::GreedyAll`]).
    GreedyRows(Vec<GreedyPick>),
}

impl StepLogits {
    /// The logits; none for greedy picks.
    pub fn into_rows(self) -> Vec<f32> {
        match self {
            StepLogits::Rows(r) => r,
            StepLogits::Greedy(_) | StepLogits::GreedyRows(_) => Vec::new(),
        }
    }
}

impl<B: Backend> Model<B> {
    /// Uploads every weight from `src`; `progress(done, total)` counts tensors.
    pub fn load(
        be: &B,
        config: ModelConfig,
        src: &dyn WeightSource,
        progress: &mut dyn FnMut(usize, usize),
    ) -> BResult<Self> {
        Self::build(be, config, Source::Weights(src), progress)
    }

    /// A model of `config` with seeded random weights generated by the backend itself (on a
    /// GPU, on the device): what benchmarks of the real shape run without a checkpoint.
    pub fn random(
        be: &B,
        config: ModelConfig,
        seed: u64,
        progress: &mut dyn FnMut(usize, usize),
    ) -> BResult<Self> {
        let specs = expected_tensors(&config)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
        let cfg = config.clone();
        Self::build(
            be,
            config,
            Source::Random {
                seed,
                specs,
                config: &cfg,
            },
            progress,
        )
    }

    fn build(
        be: &B,
        config: ModelConfig,
        src: Source<'_>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> BResult<Self> {
        let c = &config;
        if c.fp8_weights && c.quantization.is_some() {
            return Err(BackendError(
                "FP8 weights are made from a bf16 checkpoint; this one is already 4-bit".into(),
            ));
        }
        // A cache the backend cannot make (an FP8 one for a shape its kernels do not take) is
        // refused now, before any weight is uploaded, not at the first request.
        if c.layer_count(MixerKind::Sparse) > 0 {
            let shape = AttnShape {
                heads: c.num_attention_heads,
                kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
            };
            be.new_sparse_cache(shape, &c.sparse)?;
        }
        let mut ld = Loader {
            be,
            src,
            fp8: expected_tensors(c)
                .into_iter()
                .filter(|t| t.shape.len() == 2 && c.fp8_linear(&t.name))
                .map(|t| t.name)
                .collect(),
            done: 0,
            total: expected_tensors(c).len(),
            progress,
        };
        let embed = ld.mat(Role::Embed, Place::Model)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(ld.mat(Role::LmHead, Place::Model)?)
        };
        let final_norm = ld.vec(Role::FinalNorm, Place::Model)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, &kind) in c.mixer_types.iter().enumerate() {
            let at = Place::Layer(i, kind);
            // q, k, v and, with an output gate, the gate: one stacked matrix.
            let gated = match kind {
                MixerKind::Lightning => c.use_output_gate,
                MixerKind::Sparse => c.attn_use_output_gate,
            };
            // A stacked matrix is one format: FP8 throughout or not at all.
            let mut stacks = vec![vec![Role::QProj, Role::KProj, Role::VProj]];
            if gated {
                stacks[0].push(Role::OutputGate);
            }
            stacks.push(vec![Role::GateProj, Role::UpProj]);
            for stack in stacks {
                let names: Vec<String> = stack.iter().map(|&r| tensor_name(r, at)).collect();
                let fp8: Vec<bool> = names.iter().map(|n| ld.fp8.contains(n)).collect();
                if fp8.iter().any(|&f| f != fp8[0]) {
                    return Err(BackendError(format!(
                        "layer {i}: {} are run as one stacked product, but the checkpoint keeps \
                         some in FP8 and some in bf16; quantize them alike",
                        names.join(", ")
                    )));
                }
            }
            let mut parts = vec![
                ld.mat(Role::QProj, at)?,
                ld.mat(Role::KProj, at)?,
                ld.mat(Role::VProj, at)?,
            ];
            if gated {
                parts.push(ld.mat(Role::OutputGate, at)?);
            }
            let qkv_gate = be.concat_rows(parts)?;
            let o = ld.mat(Role::OProj, at)?;
            let mixer = match kind {
                MixerKind::Lightning => Mixer::Lightning {
                    qkvz: qkv_gate,
                    gated,
                    o,
                    q_norm: ld.vec_if(c.qk_norm, Role::QNorm, at)?,
                    k_norm: ld.vec_if(c.qk_norm, Role::KNorm, at)?,
                    o_norm: ld.vec_if(c.use_output_norm, Role::ONorm, at)?,
                },
                MixerKind::Sparse => Mixer::Sparse {
                    qkvg: qkv_gate,
                    gated,
                    o,
                },
            };
            let gate_up =
                be.concat_rows(vec![ld.mat(Role::GateProj, at)?, ld.mat(Role::UpProj, at)?])?;
            layers.push(Layer {
                index: i,
                input_norm: ld.vec(Role::InputNorm, at)?,
                post_norm: ld.vec(Role::PostNorm, at)?,
                mixer,
                gate_up,
                down_proj: ld.mat(Role::DownProj, at)?,
            });
        }
        Ok(Self {
            slopes: be.upload_table(&c.lightning_slopes())?,
            inv_freq: be.upload_table(&rope_inv_freq(c.head_dim, c.rope_theta))?,
            config,
            embed,
            final_norm,
            lm_head,
            layers,
            recorder: std::cell::RefCell::new(None),
        })
    }

    /// Has `recorder` get the input rows of every linear layer of the forward passes that
    /// follow (calibration, as GPTQ needs), until called with `None`.
    pub fn record_linear_inputs(&self, recorder: Option<Box<InputRecorder>>) {
        *self.recorder.borrow_mut() = recorder;
    }

    /// Gives `x`'s rows to the recorder, if there is one.
    fn record(
        &self,
        be: &B,
        layer: usize,
        which: LinearInput,
        x: &B::Act,
        cols: usize,
    ) -> BResult<()> {
        if let Some(r) = self.recorder.borrow_mut().as_mut() {
            r(layer, which, &be.to_host(x)?, cols);
        }
        Ok(())
    }

    /// The embedding table (a draft without its own reads it).
    pub(crate) fn embed_table(&self) -> &B::Matrix {
        &self.embed
    }

    pub(crate) fn lightning_shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.num_attention_heads,
            kv_heads: self.config.lightning_nkv,
            head_dim: self.config.head_dim,
        }
    }

    pub(crate) fn sparse_shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.num_attention_heads,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// A fresh sequence at position 0.
    pub fn new_sequence(&self, be: &B) -> BResult<SeqState<B>> {
        let layers = self
            .config
            .mixer_types
            .iter()
            .map(|kind| {
                Ok(match kind {
                    MixerKind::Lightning => LayerState::Lightning(be.new_lightning_state(
                        self.config.num_attention_heads,
                        self.config.head_dim,
                    )?),
                    MixerKind::Sparse => LayerState::Sparse(
                        be.new_sparse_cache(self.sparse_shape(), &self.config.sparse)?,
                    ),
                })
            })
            .collect::<BResult<Vec<_>>>()?;
        let id = next_sequence_id();
        Ok(SeqState {
            pos: 0,
            id,
            layers,
            span_kv: None,
            aux: None,
        })
    }

    /// Makes `dst` (a new sequence of this model, perhaps reserved) hold what `src` holds, so
    /// that it decodes exactly as `src` would: a prompt read once serves several choices.
    /// Backends that cannot copy states say so.
    pub fn copy_sequence(&self, be: &B, src: &SeqState<B>, dst: &mut SeqState<B>) -> BResult<()> {
        if dst.pos != 0 || src.layers.len() != dst.layers.len() {
            return Err(BackendError(
                "copy_sequence: the target is not a new sequence of this model".into(),
            ));
        }
        for (s, d) in src.layers.iter().zip(&mut dst.layers) {
            match (s, d) {
                (LayerState::Lightning(s), LayerState::Lightning(d)) => {
                    be.copy_lightning_state(s, d)?
                }
                (LayerState::Sparse(s), LayerState::Sparse(d)) => be.copy_sparse_cache(s, d)?,
                _ => return Err(state_mismatch()),
            }
        }
        dst.pos = src.pos;
        Ok(())
    }

    /// Allocates `seq`'s caches for `total_tokens` tokens now (prompt plus generated), so the
    /// memory a request needs is taken before any work and never grows by copying.
    pub fn reserve(&self, be: &B, seq: &mut SeqState<B>, total_tokens: usize) -> BResult<()> {
        for state in &mut seq.layers {
            if let LayerState::Sparse(cache) = state {
                be.reserve_sparse_cache(cache, &self.config.sparse, total_tokens)?;
            }
        }
        Ok(())
    }

    /// Benchmarks: makes a fresh `seq` hold `tokens` tokens of seeded random keys, values and
    /// lightning states, as if a prompt that long had been prefilled (decode speed at long
    /// contexts without the prefill's time). Caches are taken for `tokens + extra` tokens.
    pub fn fill_random_context(
        &self,
        be: &B,
        seq: &mut SeqState<B>,
        tokens: usize,
        extra: usize,
        seed: u64,
    ) -> BResult<()> {
        if seq.pos != 0 {
            return Err(BackendError(format!(
                "fill_random_context: the sequence already holds {} tokens",
                seq.pos
            )));
        }
        self.reserve(be, seq, tokens + extra)?;
        for (i, state) in seq.layers.iter_mut().enumerate() {
            let seed = seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            match state {
                LayerState::Sparse(cache) => {
                    be.fill_sparse_cache_random(cache, &self.config.sparse, tokens, seed)?
                }
                LayerState::Lightning(st) => be.fill_lightning_state_random(st, seed)?,
            }
        }
        seq.pos = tokens;
        Ok(())
    }

    /// Scratch buffers for steps of up to `chunk` tokens, prompts read in chunks of `chunk`.
    pub fn workspace(&self, be: &B, chunk: usize) -> BResult<Workspace<B>> {
        self.step_workspace(be, chunk, 0)
    }

    /// Scratch buffers for steps of a prompt chunk of up to `chunk` tokens beside up to
    /// `decode_rows` decode rows: exactly those of [`workspace_columns`], which the memory plan
    /// counts.
    pub fn step_workspace(
        &self,
        be: &B,
        chunk: usize,
        decode_rows: usize,
    ) -> BResult<Workspace<B>> {
        let max_rows = chunk + decode_rows;
        let bufs = workspace_columns(&self.config)
            .iter()
            .map(|&(name, cols)| match name {
                // The residual stream and what its norms make: whole on every rank.
                "h" | "a" | "branch" => be.alloc(max_rows, cols),
                _ => be.alloc_split(name, max_rows, cols),
            })
            .collect::<BResult<Vec<_>>>()?;
        let Ok([h, a, branch, q, o, z, ks, vs, kl, vl, gate_up, act]) =
            <[B::Act; WORKSPACE_BUFFERS]>::try_from(bufs)
        else {
            return Err(BackendError("workspace: wrong buffer count".into()));
        };
        Ok(Workspace {
            max_rows,
            chunk,
            h,
            a,
            branch,
            q,
            o,
            z,
            ks,
            vs,
            kl,
            vl,
            gate_up,
            act,
        })
    }

    /// The attention sparse layers use for a forward call that ends with the sequence holding
    /// `total_len` tokens: dense iff `total_len < dense_len` (SPEC §5.2). For a prompt
    /// prefilled in chunks, pass the prompt's full length so every chunk agrees with one pass.
    pub fn sparse_mode(&self, total_len: usize) -> SparseMode {
        if total_len < self.config.sparse.dense_len {
            SparseMode::Dense
        } else {
            SparseMode::Sparse
        }
    }

    /// One step: every input's tokens go through the model in one pass (rows in batch order,
    /// so each weight is read once for the whole step), each advancing its own sequence.
    /// Inputs may mix decode rows, prompt chunks and longer spans; a sequence's result does
    /// not depend on the others in the step. Returns each input's logits as its
    /// [`LogitRows`] asked.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
    ) -> BResult<Vec<StepLogits>> {
        self.forward_as(be, ws, batch, Ahead::default())
    }

    /// [`Model::forward`] of a step whose every input asks for its greedy pick
    /// ([`LogitRows::Greedy`]), left on the device to be read by [`Model::take_picks`] (one per
    /// input, in order) once the next step is queued. With `tokens_picked`, every input is one
    /// row whose token is the pick the step before left for it, input for input (its `tokens`
    /// are placeholders). The backend must [`Backend::runs_ahead`].
    pub fn forward_ahead(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        tokens_picked: bool,
    ) -> BResult<()> {
        let fits = be.runs_ahead()
            && batch
                .iter()
                .all(|x| x.logits == LogitRows::Greedy && (!tokens_picked || x.tokens.len() == 1));
        if !fits {
            return Err(BackendError(
                "a step run ahead needs a backend that runs ahead and a greedy pick an input \
                 (one row each when its tokens are the picks before)"
                    .into(),
            ));
        }
        let ahead = Ahead {
            tokens_picked,
            picks_later: true,
        };
        self.forward_as(be, ws, batch, ahead).map(|_| ())
    }

    /// The picks of the oldest step [`Model::forward_ahead`] queued whose picks are still on
    /// the device, one per input (waits for them).
    pub fn take_picks(&self, be: &B) -> BResult<Vec<GreedyPick>> {
        be.take_picks()
    }

    fn forward_as(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        ahead: Ahead,
    ) -> BResult<Vec<StepLogits>> {
        let c = &self.config;
        let n: usize = batch.iter().map(|x| x.tokens.len()).sum();
        if batch.is_empty() || n > ws.max_rows || batch.iter().any(|x| x.tokens.is_empty()) {
            return Err(BackendError(format!(
                "a step holds 1..={} tokens, each input at least one; got {n} tokens in {} \
                 inputs",
                ws.max_rows,
                batch.len()
            )));
        }
        let mut tokens = Vec::with_capacity(n);
        let mut spans = Vec::with_capacity(batch.len());
        let mut logit_rows = Vec::new();
        for x in batch.iter() {
            let span = Span {
                first_row: tokens.len(),
                len: x.tokens.len(),
                pos: x.seq.pos,
            };
            logit_rows.extend(match x.logits {
                LogitRows::None => 0..0,
                LogitRows::Last | LogitRows::Greedy => {
                    span.first_row + span.len - 1..span.first_row + span.len
                }
                LogitRows::All | LogitRows::GreedyAll => span.rows(),
            });
            tokens.extend_from_slice(x.tokens);
            spans.push(span);
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(BackendError(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        for buf in ws.buffers_mut() {
            be.set_rows(buf, n);
        }
        let modes: Vec<SparseMode> = batch.iter().map(|x| x.mode).collect();
        // Rows whose aux-layer outputs are kept: (input, span row, buffer row, rows).
        let mut aux_rows = Vec::new();
        for (i, (x, span)) in batch.iter_mut().zip(&spans).enumerate() {
            if let Some(aux) = x.seq.aux.as_mut() {
                if let Some((skip, dst, n)) = aux.place(span.pos, span.len) {
                    aux_rows.push([i, span.first_row + skip, dst, n]);
                }
            }
        }
        let step = StepCtx {
            spans: &spans,
            modes: &modes,
            eps: c.rms_norm_eps as f32,
            res: c.residual_scale() as f32,
            aux_rows: &aux_rows,
            picks_later: ahead.picks_later,
        };
        let seq_ids: Vec<u64> = batch.iter().map(|x| x.seq.id).collect();
        let logits: Vec<LogitRows> = batch.iter().map(|x| x.logits).collect();
        be.begin_step(&StepInfo {
            tokens: &tokens,
            spans: &spans,
            seq_ids: &seq_ids,
            logits: &logits,
            aux_rows: &aux_rows,
            eager: false,
            tokens_picked: ahead.tokens_picked,
            picks_later: ahead.picks_later,
        })?;
        // A panic inside the step still ends it (a capture under way is dropped).
        let mut unwinding = EndStepOnUnwind { be, armed: true };
        let logits = self.run_step(be, ws, batch, &tokens, &step, &logit_rows);
        unwinding.armed = false;
        let ended = be.end_step(logits.is_ok());
        let logits = logits?;
        ended?;
        for x in batch.iter_mut() {
            // The span read after a mark is kept (when short enough) until the next mark.
            if let Some(kv) = x.seq.span_kv.as_mut().filter(|kv| kv.armed) {
                let short = x.tokens.len() <= crate::STEPWISE_SPAN_ROWS;
                kv.rows = if short && kv.pos == x.seq.pos {
                    x.tokens.len()
                } else {
                    0
                };
                kv.armed = false;
            }
            x.seq.pos += x.tokens.len();
        }
        Ok(logits)
    }

    /// The last layer's rows a step reads, when not all ([`PackedRows`]): per input, its last
    /// row for its logits or pick, every row for all its logits or a draft's reads of the last
    /// layer, none otherwise. A recorder of the products' inputs reads every row.
    fn last_layer_rows(
        &self,
        batch: &[StepInput<'_, B>],
        step: &StepCtx<'_>,
    ) -> Option<PackedRows> {
        let last = self.layers.len().checked_sub(1)?;
        if self.recorder.borrow().is_some() {
            return None;
        }
        let keep = batch
            .iter()
            .zip(step.spans)
            .enumerate()
            .map(|(i, (x, s))| {
                let drafted = step.aux_rows.iter().any(|r| r[0] == i)
                    && x.seq.aux.as_ref().is_some_and(|a| a.layers.contains(&last));
                match x.logits {
                    _ if drafted => s.len,
                    LogitRows::None => 0,
                    LogitRows::Last | LogitRows::Greedy => 1,
                    LogitRows::All | LogitRows::GreedyAll => s.len,
                }
            })
            .collect();
        PackedRows::new(step.spans, keep)
    }

    /// The layers and the logits of a step [`Model::forward`] laid out.
    fn run_step(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        batch: &mut [StepInput<'_, B>],
        tokens: &[u32],
        step: &StepCtx<'_>,
        logit_rows: &[usize],
    ) -> BResult<Vec<StepLogits>> {
        let c = &self.config;
        be.embed(&self.embed, tokens, c.scale_emb as f32, &mut ws.h)?;
        if let Some(first) = self.layers.first() {
            be.rms_norm(&ws.h, &first.input_norm, step.eps, &mut ws.a)?;
        }
        let packed = self.last_layer_rows(batch, step);
        let last = self.layers.len().saturating_sub(1);
        let mut lightning_index = 0;
        for (i, layer) in self.layers.iter().enumerate() {
            let lightning = matches!(layer.mixer, Mixer::Lightning { .. });
            let mut states: Vec<&mut LayerState<B>> = Vec::with_capacity(batch.len());
            let mut captures: Vec<Option<&mut (B::Act, B::Act)>> = Vec::with_capacity(batch.len());
            for x in batch.iter_mut() {
                let short = x.tokens.len() <= crate::STEPWISE_SPAN_ROWS;
                let SeqState {
                    layers, span_kv, ..
                } = &mut *x.seq;
                states.push(&mut layers[i]);
                captures.push(match span_kv {
                    Some(kv) if lightning && kv.armed && short => {
                        Some(&mut kv.layers[lightning_index])
                    }
                    _ => None,
                });
            }
            let next_norm = self
                .layers
                .get(i + 1)
                .map_or(&self.final_norm, |l| &l.input_norm);
            let keep = packed.as_ref().filter(|_| i == last);
            layer.forward(
                self,
                be,
                step,
                ws,
                &mut states,
                &mut captures,
                next_norm,
                keep,
            )?;
            lightning_index += usize::from(lightning);
            for &[x, src, dst, n] in step.aux_rows {
                let aux = batch[x].seq.aux.as_mut().expect("placed above");
                let src = match keep {
                    Some(p) if aux.layers.contains(&i) => {
                        p.packed(step.spans, src).ok_or_else(|| {
                            BackendError("a draft reads a last-layer row not kept".into())
                        })?
                    }
                    _ => src,
                };
                for k in (0..3).filter(|&k| aux.layers[k] == i) {
                    be.set_rows(&mut aux.bufs[k], aux.capacity);
                    be.copy_rows(&ws.h, src, &mut aux.bufs[k], dst, n)?;
                }
            }
        }
        if logit_rows.is_empty() {
            return Ok(vec![StepLogits::Rows(Vec::new()); batch.len()]);
        }
        let packed_rows;
        let logit_rows = match &packed {
            Some(p) => {
                packed_rows = logit_rows
                    .iter()
                    .map(|&r| p.packed(step.spans, r))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(|| BackendError("a logit row of the last layer not kept".into()))?;
                &packed_rows[..]
            }
            None => logit_rows,
        };
        // Rows whose logits the host gets; the others only their greedy pick.
        let keep: Vec<bool> = batch
            .iter()
            .flat_map(|x| match x.logits {
                LogitRows::None => vec![],
                LogitRows::Last => vec![true],
                LogitRows::Greedy => vec![false],
                LogitRows::GreedyAll => vec![false; x.tokens.len()],
                LogitRows::All => vec![true; x.tokens.len()],
            })
            .collect();
        // `ws.a` holds the final norm of the last layer's output.
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let out = be.logits(&ws.a, logit_rows, &keep, head, c.logit_divisor() as f32)?;
        if step.picks_later {
            return Ok(Vec::new());
        }
        let (mut all, mut picks) = (out.rows, out.picks);
        let vocab = c.vocab_size;
        let kept = keep.iter().filter(|&&k| k).count();
        if all.len() != kept * vocab || picks.len() != logit_rows.len() {
            return Err(BackendError(format!(
                "the backend gave {} logits and {} picks for {kept} rows kept of {}",
                all.len(),
                picks.len(),
                logit_rows.len()
            )));
        }
        // Each input's rows, cut from the end so that every value is moved once.
        let mut res = Vec::with_capacity(batch.len());
        for x in batch.iter().rev() {
            res.push(match x.logits {
                LogitRows::None => StepLogits::Rows(Vec::new()),
                LogitRows::Last => {
                    picks.pop();
                    StepLogits::Rows(all.split_off(all.len() - vocab))
                }
                LogitRows::All => {
                    picks.truncate(picks.len() - x.tokens.len());
                    StepLogits::Rows(all.split_off(all.len() - x.tokens.len() * vocab))
                }
                LogitRows::Greedy => StepLogits::Greedy(picks.pop().ok_or_else(|| {
                    BackendError("the backend gave fewer greedy picks than rows".into())
                })?),
                LogitRows::GreedyAll => {
                    let n = x.tokens.len();
                    if picks.len() < n {
                        return Err(BackendError(
                            "the backend gave fewer greedy picks than rows".into(),
                        ));
                    }
                    StepLogits::GreedyRows(picks.split_off(picks.len() - n))
                }
            });
        }
        res.reverse();
        Ok(res)
    }

    /// Prefills `tokens` in chunks of at most `ws.chunk`, with the sparse mode of the whole
    /// prompt; returns the last token's logits.
    pub fn prefill(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        progress: &mut dyn FnMut(usize),
    ) -> BResult<Vec<f32>> {
        if tokens.is_empty() {
            return Err(BackendError("cannot prefill an empty prompt".into()));
        }
        let mode = self.sparse_mode(seq.pos + tokens.len());
        let mut logits = Vec::new();
        let chunks = tokens.chunks(ws.chunk);
        let last = chunks.len() - 1;
        for (i, chunk) in tokens.chunks(ws.chunk).enumerate() {
            let rows = if i == last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            logits = self.forward_one(be, ws, seq, chunk, mode, rows)?;
            progress(chunk.len());
        }
        Ok(logits)
    }

    /// One decode step: feeds `token`, returns the next-token logits.
    pub fn decode(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        token: u32,
    ) -> BResult<Vec<f32>> {
        let mode = self.sparse_mode(seq.pos + 1);
        self.forward_one(be, ws, seq, &[token], mode, LogitRows::Last)
    }

    /// One decode step that returns the greedy pick of the next token, made where the logits
    /// are ([`LogitRows::Greedy`]).
    pub fn decode_greedy(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        token: u32,
    ) -> BResult<GreedyPick> {
        let mode = self.sparse_mode(seq.pos + 1);
        let input = StepInput {
            seq,
            tokens: &[token],
            mode,
            logits: LogitRows::Greedy,
        };
        match self.forward(be, ws, &mut [input])?.remove(0) {
            StepLogits::Greedy(pick) => Ok(pick),
            StepLogits::Rows(_) | StepLogits::GreedyRows(_) => {
                Err(BackendError("logits where a pick was asked".into()))
            }
        }
    }

    /// [`Model::forward`] of one sequence's `tokens`.
    pub fn forward_one(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
        logits: LogitRows,
    ) -> BResult<Vec<f32>> {
        let input = StepInput {
            seq,
            tokens,
            mode,
            logits,
        };
        Ok(self.forward(be, ws, &mut [input])?.remove(0).into_rows())
    }
}
