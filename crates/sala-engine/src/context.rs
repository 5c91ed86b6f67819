//! Context parallelism in the engine ([`crate::generate::Engine::set_context_parallel`]): a
//! request's long prompt read by the engine's model and the other ranks at once
//! ([`sala_model::context`]), the engine's model taking the last range; its sequence then holds
//! the whole prompt but its last token, which the steps read as any prompt's rest (so the
//! first token's logits, and everything after, come from the engine's own step).

use crate::cache::CacheBudget;
use sala_model::context::{prefill_as, ContextRank, Exchange};
use sala_model::memory::MemoryPlan;
use sala_model::parallel::context_ranges;
use sala_model::{BResult, Backend, BackendError, Model, SeqState, SparseMode};
use std::cell::Cell;

/// The ranks before the engine's own: each a backend with its copy of the model, and how
/// they exchange.
pub struct ContextRanks<B: Backend> {
    backends: Vec<B>,
    models: Vec<Model<B>>,
    exchange: Box<dyn Exchange<B> + Send>,
    stats: Cell<ContextStats>,
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
            stats: Cell::default(),
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

    /// What the ranks have read so far.
    pub fn stats(&self) -> ContextStats {
        self.stats.get()
    }

    /// Why the ranks cannot read a prompt of `len` tokens beside what `budget` holds now:
    /// each rank's workspace of its range's rows (and, on the other ranks, the caches of the
    /// prompt up to their range's end) against the memory limit, per device, or all of them
    /// together where the ranks share one memory. `None`: they can (always without a limit).
    pub fn lacks_memory(
        &self,
        be: &B,
        model: &Model<B>,
        budget: &CacheBudget,
        len: usize,
    ) -> Option<String> {
        let (limit, spare) = (budget.limit()?, budget.spare_bytes()?);
        let c = &model.config;
        let ranges = context_ranges(len, self.ranks(), c.sparse.block_size);
        let widest = ranges.iter().map(|r| r.len()).max().unwrap_or(0);
        let facts = be.memory_facts(c, widest);
        // What a rank receives: the earlier ranks' keys and values, a lightning state.
        let received = 2 * widest * c.kv_dim() * facts.value_bytes
            + c.num_attention_heads * c.head_dim.pow(2) * 4;
        let workspace = |rows: usize| MemoryPlan::new(c, 0, rows, &facts).workspace + received;
        let own = workspace(ranges.last()?.len());
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let one_memory = self.exchange.one_memory();
        let mut need = own;
        for (range, rank) in ranges.iter().zip(&self.backends) {
            let plan = MemoryPlan::new(
                c,
                range.end,
                range.len(),
                &rank.memory_facts(c, range.len()),
            );
            if one_memory {
                need += plan.cache.total() + workspace(range.len());
            } else if plan.total() + received > limit.bytes {
                return Some(format!(
                    "a rank reading tokens {range:?} needs {:.2} GiB, {:.2} GiB allowed ({})",
                    gib(plan.total() + received),
                    gib(limit.bytes),
                    limit.source
                ));
            }
        }
        (need > spare).then(|| {
            format!(
                "the ranks' workspaces need {:.2} GiB beside the caches, {:.2} GiB spare ({})",
                gib(need),
                gib(spare),
                limit.source
            )
        })
    }

    /// Reads `tokens` into `seq` (a new sequence of `model` on `be`: the engine's, the last
    /// rank) with the sparse layers' `mode`, and returns true; false, with `seq` untouched,
    /// where `budget`'s limit leaves the ranks too little memory or their buffers cannot be
    /// made (the prompt is then read by the steps, as without ranks). The other ranks'
    /// sequences and workspaces are dropped after.
    pub(crate) fn read(
        &self,
        be: &B,
        model: &Model<B>,
        budget: &CacheBudget,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
    ) -> BResult<bool> {
        let mut stats = self.stats.get();
        if self.lacks_memory(be, model, budget, tokens.len()).is_some() {
            stats.read_alone += 1;
            self.stats.set(stats);
            return Ok(false);
        }
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
        let buffers = (|| {
            let wss = self
                .models
                .iter()
                .zip(&self.backends)
                .map(|(m, b)| m.workspace(b, rows))
                .collect::<BResult<Vec<_>>>()?;
            let seqs = self
                .models
                .iter()
                .zip(&self.backends)
                .map(|(m, b)| m.new_sequence(b))
                .collect::<BResult<Vec<_>>>()?;
            Ok::<_, BackendError>((wss, seqs, model.workspace(be, rows)?))
        })();
        let Ok((mut wss, mut seqs, mut own)) = buffers else {
            stats.read_alone += 1;
            self.stats.set(stats);
            return Ok(false);
        };
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
        stats.prompts += 1;
        stats.tokens += tokens.len() as u64;
        self.stats.set(stats);
        Ok(true)
    }
}

/// What context-parallel ranks have read: prompts and their tokens, and the long prompts
/// read without them for want of memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextStats {
    pub prompts: u64,
    pub tokens: u64,
    pub read_alone: u64,
}
