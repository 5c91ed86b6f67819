//! An EAGLE-3 draft model over [`Backend`]: one Llama decoder layer that reads the target's
//! low, mid and high hidden states (`fc` of their concatenation) beside the embedding of the
//! next token, and proposes tokens one at a time from its own hidden state after the first.
//!
//! Products over concatenated inputs run as sums of per-part products (`fc` over the three
//! hidden states, q/k/v over `[norm(embedding) | norm(hidden)]`), each rounded to bf16 before
//! the sum: a few bf16 steps from one product over the concatenation. Drafts only propose;
//! the target verifies every token, so the output does not depend on it. The draft's K/V live
//! in a cache of the backend's sparse-layer kind with the draft's shape: dense attention below
//! the target's `dense_len`, InfLLM-v2 block selection beyond (one rule with the target's
//! layers). The draft reads at most [`DRAFT_CONTEXT_ROWS`] rows of a prompt (its end).

use crate::backend::{BResult, Backend, BackendError, HostDType, HostTensor, Span, StepInfo};
use crate::model::{AuxCapture, LogitRows, Model, SeqState};
use crate::numerics::rope_inv_freq;
use crate::oracle::{AttnShape, SparseMode};
use crate::AttnIo;
use sala_checkpoint::{DraftCheckpoint, DraftConfig};

/// Rows of target hidden states a draft reads at once: the end of a prompt (its last rows
/// before the first token), or the rows of the steps since the last draft.
pub const DRAFT_CONTEXT_ROWS: usize = 512;

/// Bytes of a draft of shape `c` (with its own embedding table when `own_embed`) held
/// beside the model whatever the requests: its weights in bf16 and its workspace at 4 bytes
/// a value.
pub fn resident_bytes(c: &DraftConfig, own_embed: bool) -> usize {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let embed = if own_embed { c.vocab_size * h } else { 0 };
    let params = 3 * c.target_hidden_size * h
        + 2 * c.qkv_width() * h
        + h * q
        + 3 * h * i
        + c.draft_vocab_size * h
        + embed
        + 4 * h;
    let row = 6 * h + 3 * q + 4 * kv + 3 * i;
    params * 2 + DRAFT_CONTEXT_ROWS * row * 4
}

/// A loaded EAGLE-3 draft: immutable weights on one backend.
pub struct DraftModel<B: Backend> {
    pub config: DraftConfig,
    /// Its own embedding table, or `None` to read the target's (unscaled).
    embed: Option<B::Matrix>,
    /// `fc`'s columns over the low, mid and high hidden states.
    fc: [B::Matrix; 3],
    /// q, k and v stacked, over the normed embedding and over the normed hidden state.
    qkv_embed: B::Matrix,
    qkv_hidden: B::Matrix,
    o_proj: B::Matrix,
    input_norm: B::Vector,
    hidden_norm: B::Vector,
    post_norm: B::Vector,
    final_norm: B::Vector,
    gate_up: B::Matrix,
    down_proj: B::Matrix,
    lm_head: B::Matrix,
    /// Draft token → target token.
    to_target: Vec<u32>,
    inv_freq: B::Table,
}

/// One sequence's draft state: the draft's K/V cache (rows it has read, then its guesses
/// while it drafts) and how many rows of it are real.
pub struct DraftState<B: Backend> {
    cache: B::SparseCache,
    held: usize,
    /// Steps from the target's hidden states and steps from the draft's own launch different
    /// work, so a backend keying repeated steps on sequences sees them as two.
    ids: [u64; 2],
}

/// Scratch buffers of the draft's steps, for up to [`DRAFT_CONTEXT_ROWS`] rows.
pub struct DraftWorkspace<B: Backend> {
    pub max_rows: usize,
    /// Rows of the last step.
    rows: usize,
    g: B::Act,
    t: B::Act,
    e: B::Act,
    xe: B::Act,
    xh: B::Act,
    q: B::Act,
    k: B::Act,
    v: B::Act,
    q2: B::Act,
    k2: B::Act,
    v2: B::Act,
    o: B::Act,
    a: B::Act,
    gu: B::Act,
    act: B::Act,
}

/// What a draft step reads beside its tokens' embeddings.
enum StepInput {
    /// The target's hidden states, kept rows `0..n` of the capture.
    Target,
    /// The draft's own output of the step before (its last row).
    Own,
}

/// The rows of a `[rows, cols]` bf16 matrix given as host bits, split at column boundaries
/// `cuts` into matrices `[rows, cuts[i+1] - cuts[i]]`.
fn split_columns(bits: &[u16], rows: usize, cols: usize, cuts: &[usize]) -> Vec<Vec<u16>> {
    cuts.windows(2)
        .map(|w| {
            let mut out = Vec::with_capacity(rows * (w[1] - w[0]));
            for r in 0..rows {
                out.extend_from_slice(&bits[r * cols + w[0]..r * cols + w[1]]);
            }
            out
        })
        .collect()
}

fn bytes_of(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

impl<B: Backend> DraftModel<B> {
    /// Uploads the draft's weights (checked against `target` when the checkpoint was opened).
    pub fn load(be: &B, target: &Model<B>, ckpt: &DraftCheckpoint) -> BResult<Self> {
        let c = ckpt.config().clone();
        if c.target_hidden_size != target.config.hidden_size
            || c.vocab_size != target.config.vocab_size
        {
            return Err(BackendError(
                "the draft was opened for another model (hidden size or vocabulary)".into(),
            ));
        }
        let err = |e: sala_checkpoint::CheckpointError| BackendError(e.to_string());
        let bits = |name: &str, layer: bool| -> BResult<(Vec<u16>, Vec<usize>)> {
            let t = ckpt.tensor(name, layer).map_err(err)?;
            Ok((t.to_bf16_bits(), t.shape.to_vec()))
        };
        let upload = |name: &str, bits: &[u16], shape: &[usize]| {
            be.upload_matrix(
                name,
                HostTensor {
                    dtype: HostDType::Bf16,
                    shape,
                    bytes: &bytes_of(bits),
                },
            )
        };
        let matrix = |name: &str, layer: bool| -> BResult<B::Matrix> {
            let (b, shape) = bits(name, layer)?;
            upload(name, &b, &shape)
        };
        let vector = |name: &str, layer: bool| -> BResult<B::Vector> {
            let (b, shape) = bits(name, layer)?;
            be.upload_vector(
                name,
                HostTensor {
                    dtype: HostDType::Bf16,
                    shape: &shape,
                    bytes: &bytes_of(&b),
                },
            )
        };
        let (h, th) = (c.hidden_size, c.target_hidden_size);
        let (fc_bits, _) = bits("fc.weight", false)?;
        let fc_parts = split_columns(&fc_bits, h, 3 * th, &[0, th, 2 * th, 3 * th]);
        let mut fc = Vec::with_capacity(3);
        for part in &fc_parts {
            fc.push(upload("fc.weight", part, &[h, th])?);
        }
        let fc: [B::Matrix; 3] = fc
            .try_into()
            .map_err(|_| BackendError("fc: three parts".into()))?;
        // q, k, v: each split into its embedding and hidden-state halves, then stacked.
        let (mut embed_half, mut hidden_half) = (Vec::new(), Vec::new());
        for name in [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ] {
            let (b, shape) = bits(name, true)?;
            let halves = split_columns(&b, shape[0], 2 * h, &[0, h, 2 * h]);
            embed_half.push(upload(name, &halves[0], &[shape[0], h])?);
            hidden_half.push(upload(name, &halves[1], &[shape[0], h])?);
        }
        let embed = if ckpt.has_embed() {
            Some(matrix("embed_tokens.weight", false)?)
        } else if h == target.config.hidden_size {
            None
        } else {
            return Err(BackendError(format!(
                "the draft has no embedding table and its width {h} is not the model's {}",
                target.config.hidden_size
            )));
        };
        Ok(Self {
            embed,
            fc,
            qkv_embed: be.concat_rows(embed_half)?,
            qkv_hidden: be.concat_rows(hidden_half)?,
            o_proj: matrix("self_attn.o_proj.weight", true)?,
            input_norm: vector("input_layernorm.weight", true)?,
            hidden_norm: vector("hidden_norm.weight", true)?,
            post_norm: vector("post_attention_layernorm.weight", true)?,
            final_norm: vector("norm.weight", false)?,
            gate_up: be.concat_rows(vec![
                matrix("mlp.gate_proj.weight", true)?,
                matrix("mlp.up_proj.weight", true)?,
            ])?,
            down_proj: matrix("mlp.down_proj.weight", true)?,
            lm_head: matrix("lm_head.weight", false)?,
            to_target: ckpt.draft_to_target().map_err(err)?,
            inv_freq: be.upload_table(&rope_inv_freq(c.head_dim, c.rope_theta))?,
            config: c,
        })
    }

    /// A draft of shape `c` for `target` with seeded random weights made by the backend
    /// (benchmarks: the draft's cost at a real shape; its drafts are random). It reads the
    /// target's embedding table; its vocabulary is every `vocab / draft_vocab`-th token.
    pub fn random(be: &B, target: &Model<B>, c: DraftConfig, seed: u64) -> BResult<Self> {
        if c.target_hidden_size != target.config.hidden_size
            || c.hidden_size != target.config.hidden_size
            || c.vocab_size != target.config.vocab_size
        {
            return Err(BackendError(
                "a random draft takes the model's hidden size and vocabulary".into(),
            ));
        }
        let mut n = 0u64;
        let mut next = || {
            n += 1;
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n
        };
        let mut mat = |rows: usize, cols: usize| {
            be.random_matrix("draft", rows, cols, next(), 0.0, (1.0 / cols as f32).sqrt())
        };
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let q = c.num_attention_heads * c.head_dim;
        let fc = [mat(h, h)?, mat(h, h)?, mat(h, h)?];
        let (qkv_embed, qkv_hidden) = (mat(c.qkv_width(), h)?, mat(c.qkv_width(), h)?);
        let (o_proj, gate_up, down_proj) = (mat(h, q)?, mat(2 * i, h)?, mat(h, i)?);
        let lm_head = mat(c.draft_vocab_size, h)?;
        let norm = |k: u64| be.random_vector("draft", h, seed ^ k, 1.0, 0.0);
        let step = c.vocab_size / c.draft_vocab_size.max(1);
        Ok(Self {
            embed: None,
            fc,
            qkv_embed,
            qkv_hidden,
            o_proj,
            input_norm: norm(1)?,
            hidden_norm: norm(2)?,
            post_norm: norm(3)?,
            final_norm: norm(4)?,
            gate_up,
            down_proj,
            lm_head,
            to_target: (0..c.draft_vocab_size).map(|d| (d * step) as u32).collect(),
            inv_freq: be.upload_table(&rope_inv_freq(c.head_dim, c.rope_theta))?,
            config: c,
        })
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            heads: self.config.num_attention_heads,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// A fresh draft state for one sequence.
    pub fn new_state(&self, be: &B, target: &Model<B>) -> BResult<DraftState<B>> {
        Ok(DraftState {
            cache: be.new_sparse_cache(self.shape(), &target.config.sparse)?,
            held: 0,
            ids: [
                crate::model::next_sequence_id(),
                crate::model::next_sequence_id(),
            ],
        })
    }

    /// Where the target keeps, for `seq`, the hidden states this draft reads: from position
    /// `from_pos` on (the end of its prompt).
    pub fn capture(&self, be: &B, target: &Model<B>, from_pos: usize) -> BResult<AuxCapture<B>> {
        AuxCapture::new(
            be,
            self.config.aux_layers,
            target.config.hidden_size,
            DRAFT_CONTEXT_ROWS,
            from_pos,
        )
    }

    /// Bytes of the draft's weights and workspace ([`resident_bytes`]).
    pub fn resident_bytes(&self) -> usize {
        resident_bytes(&self.config, self.embed.is_some())
    }

    /// Bytes a sequence drafting with this draft holds for `prompt` tokens and `total` in
    /// all: the target's kept hidden states, and the draft's K/V for the prompt's rows it
    /// reads and every later token (4 bytes a value; the compressed keys add under 1/8).
    pub fn state_bytes(&self, target: &Model<B>, prompt: usize, total: usize) -> usize {
        let c = &self.config;
        let kept = 3 * DRAFT_CONTEXT_ROWS * target.config.hidden_size;
        let rows = prompt.min(DRAFT_CONTEXT_ROWS) + total.saturating_sub(prompt);
        let kv = rows * 2 * c.num_key_value_heads * c.head_dim;
        (kept + kv + kv / 8) * 4
    }

    /// Scratch buffers for the draft's steps.
    pub fn workspace(&self, be: &B) -> BResult<DraftWorkspace<B>> {
        let c = &self.config;
        let (h, q, kv) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let n = DRAFT_CONTEXT_ROWS;
        let a = |cols| be.alloc(n, cols);
        Ok(DraftWorkspace {
            max_rows: n,
            rows: 0,
            g: a(h)?,
            t: a(h)?,
            e: a(h)?,
            xe: a(h)?,
            xh: a(h)?,
            q: a(q)?,
            k: a(kv)?,
            v: a(kv)?,
            q2: a(q)?,
            k2: a(kv)?,
            v2: a(kv)?,
            o: a(q)?,
            a: a(h)?,
            gu: a(2 * c.intermediate_size)?,
            act: a(c.intermediate_size)?,
        })
    }

    /// Up to `max` draft tokens to follow `seq`, whose tokens so far are `tokens` (the prompt,
    /// then every token taken; the last one not yet read by the target). The draft first reads
    /// the target's hidden states kept since its last call (rows before `seq.pos`), each with
    /// the token that followed it; then it guesses from its own. Its cache keeps only the
    /// rows read from the target. With `max` 0 it only reads.
    #[allow(clippy::too_many_arguments)]
    pub fn propose(
        &self,
        be: &B,
        target: &Model<B>,
        ws: &mut DraftWorkspace<B>,
        state: &mut DraftState<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        max: usize,
    ) -> BResult<Vec<u32>> {
        let end = seq.pos;
        let Some(aux) = seq.aux.as_mut() else {
            return Ok(Vec::new());
        };
        let taken = aux.take(end);
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        if taken.end >= tokens.len() || taken.len() > ws.max_rows {
            return Err(BackendError(format!(
                "draft: rows {taken:?} of the target with {} tokens known",
                tokens.len()
            )));
        }
        let next: Vec<u32> = tokens[taken.start + 1..=taken.end].to_vec();
        let mut pick = self.step(
            be,
            target,
            ws,
            state,
            StepInput::Target,
            Some(aux),
            &next,
            taken.start,
            max > 0,
        )?;
        let real = state.held;
        let mut drafts = Vec::with_capacity(max);
        let mut result = Ok(());
        while drafts.len() < max {
            let Some(id) = pick.and_then(|p| self.to_target.get(p as usize).copied()) else {
                break;
            };
            drafts.push(id);
            if drafts.len() == max {
                break;
            }
            // The step's output hidden state, its last row, is the next step's input (copied
            // through `t`: the buffers stay where a repeated step's CUDA graph reads them).
            let last = ws.g_rows() - 1;
            let copied = be
                .copy_rows(&ws.g, last, &mut ws.t, 0, 1)
                .and_then(|()| be.copy_rows(&ws.t, 0, &mut ws.g, 0, 1));
            if let Err(e) = copied {
                result = Err(e);
                break;
            }
            let pos = taken.end + drafts.len() - 1;
            match self.step(
                be,
                target,
                ws,
                state,
                StepInput::Own,
                None,
                &[id],
                pos,
                true,
            ) {
                Ok(p) => pick = p,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        // The guesses' K/V leave the cache; what was read from the target stays.
        be.truncate_sparse_cache(&mut state.cache, &target.config.sparse, real)?;
        state.held = real;
        result.map(|()| drafts)
    }

    /// One draft step over `tokens` at positions `pos..`: returns the draft token the last
    /// row's logits pick (when `pick`).
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        be: &B,
        target: &Model<B>,
        ws: &mut DraftWorkspace<B>,
        state: &mut DraftState<B>,
        input: StepInput,
        aux: Option<&mut AuxCapture<B>>,
        tokens: &[u32],
        pos: usize,
        pick: bool,
    ) -> BResult<Option<u32>> {
        let n = tokens.len();
        let span = Span {
            first_row: 0,
            len: n,
            pos,
        };
        let id = match input {
            StepInput::Target => state.ids[0],
            StepInput::Own => state.ids[1],
        };
        let logits = [if pick {
            LogitRows::Greedy
        } else {
            LogitRows::None
        }];
        be.begin_step(&StepInfo {
            tokens,
            spans: &[span],
            seq_ids: &[id],
            logits: &logits,
            aux_rows: &[],
            eager: false,
            tokens_picked: false,
            picks_later: false,
        })?;
        let out = self.layer(be, target, ws, state, aux, tokens, span, pick);
        let ended = be.end_step(out.is_ok());
        let out = out?;
        ended?;
        state.held += n;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        be: &B,
        target: &Model<B>,
        ws: &mut DraftWorkspace<B>,
        state: &mut DraftState<B>,
        aux: Option<&mut AuxCapture<B>>,
        tokens: &[u32],
        span: Span,
        pick: bool,
    ) -> BResult<Option<u32>> {
        let c = &self.config;
        let eps = c.rms_norm_eps as f32;
        let n = tokens.len();
        for buf in ws.buffers_mut() {
            be.set_rows(buf, n);
        }
        ws.rows = n;
        if let Some(aux) = aux {
            // g = fc · [low | mid | high], as three products added.
            for (k, (x, w)) in aux.bufs.iter_mut().zip(&self.fc).enumerate() {
                be.set_rows(x, n);
                if k == 0 {
                    be.matmul(x, w, &mut ws.g)?;
                } else {
                    be.matmul(x, w, &mut ws.t)?;
                    be.add_scaled(&mut ws.g, &ws.t, 1.0)?;
                }
            }
        }
        let table = self.embed.as_ref().unwrap_or_else(|| target.embed_table());
        be.embed(table, tokens, 1.0, &mut ws.e)?;
        be.rms_norm(&ws.e, &self.input_norm, eps, &mut ws.xe)?;
        be.rms_norm(&ws.g, &self.hidden_norm, eps, &mut ws.xh)?;
        be.matmul_split(
            &ws.xe,
            &self.qkv_embed,
            &mut [&mut ws.q, &mut ws.k, &mut ws.v],
        )?;
        be.matmul_split(
            &ws.xh,
            &self.qkv_hidden,
            &mut [&mut ws.q2, &mut ws.k2, &mut ws.v2],
        )?;
        be.add_scaled(&mut ws.q, &ws.q2, 1.0)?;
        be.add_scaled(&mut ws.k, &ws.k2, 1.0)?;
        be.add_scaled(&mut ws.v, &ws.v2, 1.0)?;
        be.rope(c.head_dim, &self.inv_freq, &[span], &mut ws.q, &mut ws.k)?;
        let mode = if state.held + n < target.config.sparse.dense_len {
            SparseMode::Dense
        } else {
            SparseMode::Sparse
        };
        be.sparse_attention(
            self.shape(),
            &target.config.sparse,
            AttnIo {
                q: &mut ws.q,
                k: &mut ws.k,
                v: &mut ws.v,
                out: &mut ws.o,
            },
            &[Span {
                first_row: 0,
                ..span
            }],
            &[mode],
            &mut [&mut state.cache],
        )?;
        be.matmul(&ws.o, &self.o_proj, &mut ws.t)?;
        be.add_scaled(&mut ws.g, &ws.t, 1.0)?;
        be.rms_norm(&ws.g, &self.post_norm, eps, &mut ws.a)?;
        be.matmul_silu(&ws.a, &self.gate_up, &mut ws.gu, &mut ws.act)?;
        be.matmul(&ws.act, &self.down_proj, &mut ws.t)?;
        be.add_scaled(&mut ws.g, &ws.t, 1.0)?;
        if !pick {
            return Ok(None);
        }
        be.rms_norm(&ws.g, &self.final_norm, eps, &mut ws.a)?;
        let out = be.logits(&ws.a, &[n - 1], &[false], &self.lm_head, 1.0)?;
        Ok(out.picks.first().and_then(|p| p.id))
    }

    /// The draft's output hidden states of its last step (tests).
    pub fn last_hidden(&self, be: &B, ws: &DraftWorkspace<B>) -> BResult<Vec<f32>> {
        be.to_host(&ws.g)
    }
}

impl<B: Backend> DraftWorkspace<B> {
    fn buffers_mut(&mut self) -> [&mut B::Act; 15] {
        [
            &mut self.g,
            &mut self.t,
            &mut self.e,
            &mut self.xe,
            &mut self.xh,
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.q2,
            &mut self.k2,
            &mut self.v2,
            &mut self.o,
            &mut self.a,
            &mut self.gu,
            &mut self.act,
        ]
    }

    fn g_rows(&self) -> usize {
        self.rows
    }
}
