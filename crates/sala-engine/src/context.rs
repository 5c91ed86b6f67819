//! Context parallelism in the engine ([`crate::generate::Engine::set_context_parallel`]): a
//! request's long prompt read by the engine's model and the other ranks at once
//! ([`sala_model::context`]), the engine's model taking the last range; its sequence then holds
//! the whole prompt but its last token, which the steps read as any prompt's rest (so the
//! first token's logits, and everything after, come from the engine's own step).

use crate::cache::CacheBudget;
use sala_model::context::{prefill_as, prompt_ranges, range_bytes, ContextRank, Exchange};
use sala_model::memory::MemoryPlan;
use sala_model::{BResult, Backend, BackendError, Model, SeqState, SparseMode, Workspace};
use std::cell::Cell;
use std::ops::Range;

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

    /// Why the ranks cannot read a prompt of `len` tokens, each its range in chunks of
    /// `chunk` rows, beside what `budget` holds now: on each rank what its range keeps
    /// ([`range_bytes`]), and on the other ranks their chunk's workspace and the caches of the
    /// prompt up to their range's end, against the memory limit, per device, or together
    /// where the ranks share one memory (the engine's rank reads with its step workspace).
    /// `None`: they can (always without a limit).
    pub fn lacks_memory(
        &self,
        be: &B,
        model: &Model<B>,
        budget: &CacheBudget,
        len: usize,
        chunk: usize,
    ) -> Option<String> {
        let (limit, spare) = (budget.limit()?, budget.spare_bytes()?);
        let c = &model.config;
        let ranges = prompt_ranges(c, len, self.ranks());
        let rows = |range: &Range<usize>| range.len().min(chunk).max(1);
        let vb = be.memory_facts(c, chunk).value_bytes;
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let one_memory = self.exchange.one_memory();
        let mut need = range_bytes(c, ranges.last()?.len(), vb);
        for (range, rank) in ranges.iter().zip(&self.backends) {
            let facts = rank.memory_facts(c, rows(range));
            let plan = MemoryPlan::new(c, range.end, rows(range), &facts);
            let kept = range_bytes(c, range.len(), facts.value_bytes);
            if one_memory {
                need += plan.cache.total() + plan.workspace + kept;
            } else if plan.total() + kept > limit.bytes {
                return Some(format!(
                    "a rank reading tokens {range:?} needs {:.2} GiB, {:.2} GiB allowed ({})",
                    gib(plan.total() + kept),
                    gib(limit.bytes),
                    limit.source
                ));
            }
        }
        (need > spare).then(|| {
            format!(
                "the ranks' buffers need {:.2} GiB beside the caches, {:.2} GiB spare ({})",
                gib(need),
                gib(spare),
                limit.source
            )
        })
    }

    /// Reads `tokens` into `seq` (a new sequence of `model` on `be`: the engine's, the last
    /// rank, reading with the step workspace `ws`, in chunks of its rows) with the sparse
    /// layers' `mode`, and returns true; false, with `seq` untouched, where `budget`'s limit
    /// leaves the ranks too little memory or their buffers cannot be made (the prompt is then
    /// read by the steps, as without ranks). The other ranks read in chunks as long and drop
    /// their sequences and workspaces after.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read(
        &self,
        be: &B,
        model: &Model<B>,
        ws: &mut Workspace<B>,
        budget: &CacheBudget,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
    ) -> BResult<bool> {
        let mut stats = self.stats.get();
        let chunk = ws.max_rows;
        if self
            .lacks_memory(be, model, budget, tokens.len(), chunk)
            .is_some()
        {
            stats.read_alone += 1;
            self.stats.set(stats);
            return Ok(false);
        }
        let ranges = prompt_ranges(&model.config, tokens.len(), self.ranks());
        if ranges.len() != self.ranks() {
            return Err(BackendError(format!(
                "context parallelism: {} tokens make {} ranges for {} ranks",
                tokens.len(),
                ranges.len(),
                self.ranks()
            )));
        }
        let buffers = (|| {
            let wss = self
                .models
                .iter()
                .zip(&self.backends)
                .zip(&ranges)
                .map(|((m, b), r)| m.workspace(b, r.len().min(chunk)))
                .collect::<BResult<Vec<_>>>()?;
            let seqs = self
                .models
                .iter()
                .zip(&self.backends)
                .map(|(m, b)| m.new_sequence(b))
                .collect::<BResult<Vec<_>>>()?;
            Ok::<_, BackendError>((wss, seqs))
        })();
        let Ok((mut wss, mut seqs)) = buffers else {
            stats.read_alone += 1;
            self.stats.set(stats);
            return Ok(false);
        };
        let mut ranks = ContextRank::zip(&self.backends, &self.models, &mut wss, &mut seqs);
        ranks.push(ContextRank { be, model, ws, seq });
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
