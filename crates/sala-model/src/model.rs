//! The MiniCPM-SALA model (SPEC §3–§7), written once over [`Backend`]: its weights as loaded,
//! the per-sequence state and the step workspace. A layer's forward pass is in `layer.rs`, a
//! step's (batching inputs, logits, prefill and decode) in `step.rs`.

use crate::backend::{BResult, Backend, BackendError};
pub use crate::load::WeightSource;
use crate::load::{Loader, Source};
use crate::memory::{workspace_columns, WORKSPACE_BUFFERS};
use crate::numerics::rope_inv_freq;
use crate::oracle::{AttnShape, SparseMode};
use crate::sequence::SpanKv;
pub use crate::sequence::{AuxCapture, SeqMark};
pub use crate::step::{GreedyPick, LogitRows, StepInput, StepLogits};
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
    pub(crate) index: usize,
    pub(crate) input_norm: B::Vector,
    pub(crate) post_norm: B::Vector,
    pub(crate) mixer: Mixer<B>,
    /// gate_proj and up_proj, stacked.
    pub(crate) gate_up: B::Matrix,
    pub(crate) down_proj: B::Matrix,
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
    pub(crate) recorder: std::cell::RefCell<Option<Box<InputRecorder>>>,
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
    pub(crate) fn record(
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
}
