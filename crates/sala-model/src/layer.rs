//! One decoder layer's forward pass over a step's rows (SPEC §4, §5, §3's residual and MLP):
//! its projections, its mixer over the step's spans, and the rest of the layer; and the rows
//! the last layer packs when a step reads only some of them.

use crate::backend::{AttnIo, BResult, Backend, Span};
use crate::model::{state_mismatch, Layer, LayerState, LinearInput, Mixer, Model, Workspace};
use crate::step::StepCtx;

impl<B: Backend> Layer<B> {
    /// The layer on every row of the step: `ws.a` holds its input norm (made by the previous
    /// layer's last add) and, on return, `next_norm` of its output, which is added into
    /// `ws.h`. `captures[i]`: where sequence `i`'s lightning k and v rows are kept, if they are.
    /// With `keep` (the last layer of a step that reads only some rows' outputs), every row
    /// still joins the sequences' caches and states, but only the last `keep[i]` rows of span
    /// `i` are attended and go on through the rest of the layer, packed to the front of the
    /// buffers in span order ([`PackedRows`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
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
pub(crate) struct PackedRows {
    keep: Vec<usize>,
    /// Where span `i`'s kept rows start once packed.
    first: Vec<usize>,
    /// Rows kept in all.
    rows: usize,
}

impl PackedRows {
    /// `None` when every row is kept.
    pub(crate) fn new(spans: &[Span], keep: Vec<usize>) -> Option<Self> {
        let mut first = Vec::with_capacity(keep.len());
        let mut rows = 0;
        for &n in &keep {
            first.push(rows);
            rows += n;
        }
        (rows < spans.iter().map(|s| s.len).sum()).then_some(Self { keep, first, rows })
    }

    /// Where step row `row` (of span `i`, among its kept rows) lies once packed.
    pub(crate) fn packed(&self, spans: &[Span], row: usize) -> Option<usize> {
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
