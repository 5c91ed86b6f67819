//! The MiniCPM-SALA forward pass (SPEC §3–§7), written once over [`Backend`].

use crate::backend::{BResult, Backend, BackendError, HostTensor};
use crate::numerics::rope_inv_freq;
use crate::oracle::{AttnShape, SparseMode};
use sala_checkpoint::{MixerKind, ModelConfig};

/// Where weights come from: the tensor of a given name, already checked by the loader.
pub trait WeightSource {
    fn tensor(&self, name: &str) -> Result<HostTensor<'_>, String>;
}

enum Mixer<B: Backend> {
    Lightning {
        q: B::Matrix,
        k: B::Matrix,
        v: B::Matrix,
        o: B::Matrix,
        z: Option<B::Matrix>,
        q_norm: Option<B::Vector>,
        k_norm: Option<B::Vector>,
        o_norm: Option<B::Vector>,
    },
    Sparse {
        q: B::Matrix,
        k: B::Matrix,
        v: B::Matrix,
        o: B::Matrix,
        gate: Option<B::Matrix>,
    },
}

struct Layer<B: Backend> {
    input_norm: B::Vector,
    post_norm: B::Vector,
    mixer: Mixer<B>,
    gate_proj: B::Matrix,
    up_proj: B::Matrix,
    down_proj: B::Matrix,
}

/// A loaded model: immutable weights on one backend.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    embed: B::Matrix,
    final_norm: B::Vector,
    /// `None` when the embeddings are tied.
    lm_head: Option<B::Matrix>,
    layers: Vec<Layer<B>>,
    slopes: Vec<f32>,
    inv_freq: Vec<f32>,
}

/// The per-sequence state: how many tokens it holds, and each layer's cache or state.
pub struct SeqState<B: Backend> {
    pub pos: usize,
    layers: Vec<LayerState<B>>,
}

enum LayerState<B: Backend> {
    Lightning(B::LightningState),
    Sparse(B::SparseCache),
}

/// Scratch buffers for one chunk of up to `max_rows` tokens, allocated once.
pub struct Workspace<B: Backend> {
    pub max_rows: usize,
    h: B::Act,
    a: B::Act,
    branch: B::Act,
    q: B::Act,
    o: B::Act,
    z: B::Act,
    ks: B::Act,
    vs: B::Act,
    kl: B::Act,
    vl: B::Act,
    gate: B::Act,
    up: B::Act,
}

/// Which rows of a chunk get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    None,
    Last,
    All,
}

/// How many tensors [`Model::load`] uploads for `c`.
pub fn tensor_count(c: &ModelConfig) -> usize {
    let per_layer = |k: &MixerKind| {
        5 + match k {
            MixerKind::Lightning => {
                4 + c.use_output_gate as usize + 2 * c.qk_norm as usize + c.use_output_norm as usize
            }
            MixerKind::Sparse => 4 + c.attn_use_output_gate as usize,
        }
    };
    2 + !c.tie_word_embeddings as usize + c.mixer_types.iter().map(per_layer).sum::<usize>()
}

/// Uploads weights one by one, reporting progress.
struct Loader<'a, B: Backend> {
    be: &'a B,
    src: &'a dyn WeightSource,
    done: usize,
    total: usize,
    progress: &'a mut dyn FnMut(usize, usize),
}

impl<B: Backend> Loader<'_, B> {
    fn fetch(&mut self, name: &str) -> BResult<HostTensor<'_>> {
        self.done += 1;
        (self.progress)(self.done, self.total);
        self.src
            .tensor(name)
            .map_err(|e| BackendError(format!("weight {name}: {e}")))
    }
    fn mat(&mut self, name: &str) -> BResult<B::Matrix> {
        let be = self.be;
        let t = self.fetch(name)?;
        be.upload_matrix(name, t)
    }
    fn vec(&mut self, name: &str) -> BResult<B::Vector> {
        let be = self.be;
        let t = self.fetch(name)?;
        be.upload_vector(name, t)
    }
    fn mat_if(&mut self, present: bool, name: &str) -> BResult<Option<B::Matrix>> {
        present.then(|| self.mat(name)).transpose()
    }
    fn vec_if(&mut self, present: bool, name: &str) -> BResult<Option<B::Vector>> {
        present.then(|| self.vec(name)).transpose()
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
        let c = &config;
        let mut ld = Loader {
            be,
            src,
            done: 0,
            total: tensor_count(c),
            progress,
        };
        let embed = ld.mat("model.embed_tokens.weight")?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(ld.mat("lm_head.weight")?)
        };
        let final_norm = ld.vec("model.norm.weight")?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, kind) in c.mixer_types.iter().enumerate() {
            let n = |rest: &str| format!("model.layers.{i}.{rest}");
            let mixer = match kind {
                MixerKind::Lightning => Mixer::Lightning {
                    q: ld.mat(&n("self_attn.q_proj.weight"))?,
                    k: ld.mat(&n("self_attn.k_proj.weight"))?,
                    v: ld.mat(&n("self_attn.v_proj.weight"))?,
                    o: ld.mat(&n("self_attn.o_proj.weight"))?,
                    z: ld.mat_if(c.use_output_gate, &n("self_attn.z_proj.weight"))?,
                    q_norm: ld.vec_if(c.qk_norm, &n("self_attn.q_norm.weight"))?,
                    k_norm: ld.vec_if(c.qk_norm, &n("self_attn.k_norm.weight"))?,
                    o_norm: ld.vec_if(c.use_output_norm, &n("self_attn.o_norm.weight"))?,
                },
                MixerKind::Sparse => Mixer::Sparse {
                    q: ld.mat(&n("self_attn.q_proj.weight"))?,
                    k: ld.mat(&n("self_attn.k_proj.weight"))?,
                    v: ld.mat(&n("self_attn.v_proj.weight"))?,
                    o: ld.mat(&n("self_attn.o_proj.weight"))?,
                    gate: ld.mat_if(c.attn_use_output_gate, &n("self_attn.o_gate.weight"))?,
                },
            };
            layers.push(Layer {
                input_norm: ld.vec(&n("input_layernorm.weight"))?,
                post_norm: ld.vec(&n("post_attention_layernorm.weight"))?,
                mixer,
                gate_proj: ld.mat(&n("mlp.gate_proj.weight"))?,
                up_proj: ld.mat(&n("mlp.up_proj.weight"))?,
                down_proj: ld.mat(&n("mlp.down_proj.weight"))?,
            });
        }
        Ok(Self {
            slopes: c.lightning_slopes(),
            inv_freq: rope_inv_freq(c.head_dim, c.rope_theta),
            config,
            embed,
            final_norm,
            lm_head,
            layers,
        })
    }

    fn lightning_shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.num_attention_heads,
            kv_heads: self.config.lightning_nkv,
            head_dim: self.config.head_dim,
        }
    }

    fn sparse_shape(&self) -> AttnShape {
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
        Ok(SeqState { pos: 0, layers })
    }

    /// Scratch buffers for chunks of up to `max_rows` tokens.
    pub fn workspace(&self, be: &B, max_rows: usize) -> BResult<Workspace<B>> {
        let c = &self.config;
        let hd = c.num_attention_heads * c.head_dim;
        Ok(Workspace {
            max_rows,
            h: be.alloc(max_rows, c.hidden_size)?,
            a: be.alloc(max_rows, c.hidden_size)?,
            branch: be.alloc(max_rows, c.hidden_size)?,
            q: be.alloc(max_rows, hd)?,
            o: be.alloc(max_rows, hd)?,
            z: be.alloc(max_rows, hd)?,
            ks: be.alloc(max_rows, c.kv_dim())?,
            vs: be.alloc(max_rows, c.kv_dim())?,
            kl: be.alloc(max_rows, c.lightning_kv_dim())?,
            vl: be.alloc(max_rows, c.lightning_kv_dim())?,
            gate: be.alloc(max_rows, c.intermediate_size)?,
            up: be.alloc(max_rows, c.intermediate_size)?,
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

    /// Runs one chunk of `tokens` (at most `ws.max_rows`) through the model, advancing `seq`.
    /// Returns the logits of the requested rows, `[rows, vocab]`.
    pub fn forward(
        &self,
        be: &B,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
        rows: LogitRows,
    ) -> BResult<Vec<f32>> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 || n > ws.max_rows {
            return Err(BackendError(format!(
                "a forward chunk must hold 1..={} tokens, got {n}",
                ws.max_rows
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(BackendError(format!(
                "token id {bad} is outside the vocabulary ({})",
                c.vocab_size
            )));
        }
        for buf in [
            &mut ws.h,
            &mut ws.a,
            &mut ws.branch,
            &mut ws.q,
            &mut ws.o,
            &mut ws.z,
            &mut ws.ks,
            &mut ws.vs,
            &mut ws.kl,
            &mut ws.vl,
            &mut ws.gate,
            &mut ws.up,
        ] {
            be.set_rows(buf, n);
        }
        let eps = c.rms_norm_eps as f32;
        let res = c.residual_scale() as f32;
        be.embed(&self.embed, tokens, c.scale_emb as f32, &mut ws.h)?;
        for (layer, state) in self.layers.iter().zip(seq.layers.iter_mut()) {
            be.rms_norm(&ws.h, &layer.input_norm, eps, &mut ws.a)?;
            match (&layer.mixer, state) {
                (
                    Mixer::Lightning {
                        q,
                        k,
                        v,
                        o,
                        z,
                        q_norm,
                        k_norm,
                        o_norm,
                    },
                    LayerState::Lightning(st),
                ) => {
                    be.matmul(&ws.a, q, &mut ws.q)?;
                    be.matmul(&ws.a, k, &mut ws.kl)?;
                    be.matmul(&ws.a, v, &mut ws.vl)?;
                    let rope = c
                        .lightning_use_rope
                        .then_some((self.inv_freq.as_slice(), seq.pos));
                    be.head_norm_rope(
                        &mut ws.q,
                        c.head_dim,
                        q_norm.as_ref().map(|w| (w, eps)),
                        rope,
                    )?;
                    be.head_norm_rope(
                        &mut ws.kl,
                        c.head_dim,
                        k_norm.as_ref().map(|w| (w, eps)),
                        rope,
                    )?;
                    be.lightning(
                        self.lightning_shape(),
                        &self.slopes,
                        &ws.q,
                        &ws.kl,
                        &ws.vl,
                        st,
                        &mut ws.o,
                    )?;
                    let gated = if let Some(w) = o_norm {
                        be.rms_norm(&ws.o, w, eps, &mut ws.q)?;
                        &mut ws.q
                    } else {
                        &mut ws.o
                    };
                    if let Some(zw) = z {
                        be.matmul(&ws.a, zw, &mut ws.z)?;
                        be.sigmoid_gate(gated, &ws.z)?;
                    }
                    be.matmul(gated, o, &mut ws.branch)?;
                }
                (Mixer::Sparse { q, k, v, o, gate }, LayerState::Sparse(cache)) => {
                    be.matmul(&ws.a, q, &mut ws.q)?;
                    be.matmul(&ws.a, k, &mut ws.ks)?;
                    be.matmul(&ws.a, v, &mut ws.vs)?;
                    be.sparse_attention(
                        self.sparse_shape(),
                        &c.sparse,
                        mode,
                        &ws.q,
                        &ws.ks,
                        &ws.vs,
                        cache,
                        &mut ws.o,
                    )?;
                    if let Some(gw) = gate {
                        be.matmul(&ws.a, gw, &mut ws.z)?;
                        be.sigmoid_gate(&mut ws.o, &ws.z)?;
                    }
                    be.matmul(&ws.o, o, &mut ws.branch)?;
                }
                _ => {
                    return Err(BackendError(
                        "layer state does not match the layer kind".into(),
                    ))
                }
            }
            be.add_scaled(&mut ws.h, &ws.branch, res)?;
            be.rms_norm(&ws.h, &layer.post_norm, eps, &mut ws.a)?;
            be.matmul(&ws.a, &layer.gate_proj, &mut ws.gate)?;
            be.matmul(&ws.a, &layer.up_proj, &mut ws.up)?;
            be.silu_mul(&mut ws.gate, &ws.up)?;
            be.matmul(&ws.gate, &layer.down_proj, &mut ws.branch)?;
            be.add_scaled(&mut ws.h, &ws.branch, res)?;
        }
        seq.pos += n;
        let range = match rows {
            LogitRows::None => return Ok(Vec::new()),
            LogitRows::Last => n - 1..n,
            LogitRows::All => 0..n,
        };
        be.rms_norm(&ws.h, &self.final_norm, eps, &mut ws.a)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        be.logits(&ws.a, range, head, c.logit_divisor() as f32)
    }

    /// Prefills `tokens` in chunks of at most `ws.max_rows`, with the sparse mode of the whole
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
        let chunks = tokens.chunks(ws.max_rows);
        let last = chunks.len() - 1;
        for (i, chunk) in tokens.chunks(ws.max_rows).enumerate() {
            let rows = if i == last {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            logits = self.forward(be, ws, seq, chunk, mode, rows)?;
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
        self.forward(be, ws, seq, &[token], mode, LogitRows::Last)
    }
}
