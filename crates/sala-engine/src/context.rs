//! Context parallelism in the engine ([`crate::generate::Engine::set_context_parallel`]): a
//! request's long prompt read by the engine's model and the other ranks at once
//! ([`sala_model::context`]), the engine's model taking the last range; its sequence then holds
//! the whole prompt but its last token, which the steps read as any prompt's rest (so the
//! first token's logits, and everything after, come from the engine's own step).

use sala_model::context::{prefill_as, ContextRank, Exchange};
use sala_model::parallel::context_ranges;
use sala_model::{BResult, Backend, BackendError, Model, SeqState, SparseMode};

/// The ranks before the engine's own: each a backend with its copy of the model, and how
/// they exchange.
pub struct ContextRanks<B: Backend> {
    backends: Vec<B>,
    models: Vec<Model<B>>,
    exchange: Box<dyn Exchange<B> + Send>,
}

impl<B: Backend> ContextRanks<B> {
    /// `backends[i]` holds `models[i]` (the engine's model, loaded again); at least one.
    pub fn new(
        backends: Vec<B>,
        models: Vec<Model<B>>,
        exchange: Box<dyn Exchange<B> + Send>,
    ) -> BResult<Self> {
        if backends.is_empty() || backends.len() != models.len() {
            return Err(BackendError(format!(
                "context parallelism: {} backends for {} models (at least one of each)",
                backends.len(),
                models.len()
            )));
        }
        Ok(Self {
            backends,
            models,
            exchange,
        })
    }

    /// Ranks in all, the engine's included.
    pub fn ranks(&self) -> usize {
        self.backends.len() + 1
    }

    /// Whether a prompt of `len` tokens is read so: every rank gets at least two blocks of
    /// the tokens before its last.
    pub fn takes(&self, len: usize, block_size: usize) -> bool {
        len > 2 * self.ranks() * block_size.max(1)
    }

    /// Reads `tokens` into `seq` (a new sequence of `model` on `be`: the engine's, the last
    /// rank) with the sparse layers' `mode`; the other ranks' sequences and workspaces are
    /// dropped after.
    pub(crate) fn read(
        &self,
        be: &B,
        model: &Model<B>,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
    ) -> BResult<()> {
        let block = model.config.sparse.block_size;
        let ranges = context_ranges(tokens.len(), self.ranks(), block);
        if ranges.len() != self.ranks() {
            return Err(BackendError(format!(
                "context parallelism: {} tokens make {} ranges for {} ranks",
                tokens.len(),
                ranges.len(),
                self.ranks()
            )));
        }
        let rows = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut wss = self
            .models
            .iter()
            .zip(&self.backends)
            .map(|(m, b)| m.workspace(b, rows))
            .collect::<BResult<Vec<_>>>()?;
        let mut seqs = self
            .models
            .iter()
            .zip(&self.backends)
            .map(|(m, b)| m.new_sequence(b))
            .collect::<BResult<Vec<_>>>()?;
        let mut own = model.workspace(be, rows)?;
        let mut ranks = ContextRank::zip(&self.backends, &self.models, &mut wss, &mut seqs);
        ranks.push(ContextRank {
            be,
            model,
            ws: &mut own,
            seq,
        });
        let done = prefill_as(&mut ranks, &*self.exchange, tokens, mode)?;
        if done.last + 1 != self.ranks() {
            return Err(BackendError(
                "context parallelism: the engine's rank did not read the prompt's end".into(),
            ));
        }
        Ok(())
    }
}
