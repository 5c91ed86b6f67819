//! Context parallelism in the engine ([`crate::generate::Engine::set_context_parallel`]): a
//! request's long prompt read by the engine's model and the other ranks at once
//! ([`sala_model::context`]), the engine's model taking the last range; its sequence then holds
//! the whole prompt but its last token, which the steps read as any prompt's rest (so the
//! first token's logits, and everything after, come from the engine's own step). The ranks
//! read over several steps, each about a chunk of each range through every layer, the other
//! requests' steps running between ([`ContextRanks::start`], [`ContextRanks::advance`]).

use crate::cache::CacheBudget;
use sala_model::context::{prompt_ranges, range_bytes, ContextRank, ContextRead, Exchange};
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

    /// Counts a long prompt the steps read because the ranks were reading another.
    pub(crate) fn count_busy(&self) {
        let mut stats = self.stats.get();
        stats.busy += 1;
        self.stats.set(stats);
    }

    /// What the ranks need to read a prompt of `len` tokens, each its range in chunks of
    /// `chunk` rows, beside what `budget` holds now: on each rank what its range keeps
    /// ([`range_bytes`]), and on the other ranks their chunk's workspace and the caches of the
    /// prompt up to their range's end, against the memory limit, per device, or together
    /// where the ranks share one memory (the engine's rank reads with its step workspace).
    /// `Ok(bytes)`: they can, holding `bytes` of the engine's memory beside the caches while
    /// they read (0 without a limit); `Err`: why not.
    pub fn memory_needed(
        &self,
        be: &B,
        model: &Model<B>,
        budget: &CacheBudget,
        len: usize,
        chunk: usize,
    ) -> Result<usize, String> {
        let (Some(limit), Some(spare)) = (budget.limit(), budget.spare_bytes()) else {
            return Ok(0);
        };
        let c = &model.config;
        let ranges = prompt_ranges(c, len, self.ranks());
        let rows = |range: &Range<usize>| range.len().min(chunk).max(1);
        let vb = be.memory_facts(c, chunk).value_bytes;
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let one_memory = self.exchange.one_memory();
        let Some(last) = ranges.last() else {
            return Ok(0);
        };
        let mut need = range_bytes(c, last.len(), vb);
        for (range, rank) in ranges.iter().zip(&self.backends) {
            let facts = rank.memory_facts(c, rows(range));
            let plan = MemoryPlan::new(c, range.end, rows(range), &facts);
            let kept = range_bytes(c, range.len(), facts.value_bytes);
            if one_memory {
                need += plan.cache.total() + plan.workspace + kept;
            } else if plan.total() + kept > limit.bytes {
                return Err(format!(
                    "a rank reading tokens {range:?} needs {:.2} GiB, {:.2} GiB allowed ({})",
                    gib(plan.total() + kept),
                    gib(limit.bytes),
                    limit.source
                ));
            }
        }
        if need > spare {
            return Err(format!(
                "the ranks' buffers need {:.2} GiB beside the caches, {:.2} GiB spare ({})",
                gib(need),
                gib(spare),
                limit.source
            ));
        }
        Ok(need)
    }

    /// Begins reading `tokens` into `seq` (a new sequence of `model` on `be`: the engine's,
    /// the last rank, reading with the step workspace `ws` in chunks of its rows) with the
    /// sparse layers' `mode`; [`ContextRanks::advance`] reads a stage at a time, and other
    /// steps may run on `ws` between. `None` where `budget`'s limit leaves the ranks too
    /// little memory, their buffers cannot be made or the tokens make fewer ranges than ranks
    /// (the prompt is then read by the steps, as without ranks). The other ranks read in
    /// chunks as long.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        &self,
        be: &B,
        model: &Model<B>,
        ws: &mut Workspace<B>,
        budget: &CacheBudget,
        seq: &mut SeqState<B>,
        tokens: &[u32],
        mode: SparseMode,
    ) -> BResult<Option<PendingRead<B>>> {
        let chunk = ws.max_rows;
        let alone = || {
            let mut stats = self.stats.get();
            stats.read_alone += 1;
            self.stats.set(stats);
            Ok(None)
        };
        let Ok(bytes) = self.memory_needed(be, model, budget, tokens.len(), chunk) else {
            return alone();
        };
        // Fewer ranges than ranks (a read that [`ContextRanks::takes`] would not give them):
        // the steps read it.
        let ranges = prompt_ranges(&model.config, tokens.len(), self.ranks());
        if ranges.len() != self.ranks() {
            return Ok(None);
        }
        let buffers = (|| {
            let mut wss = self
                .models
                .iter()
                .zip(&self.backends)
                .zip(&ranges)
                .map(|((m, b), r)| m.workspace(b, r.len().min(chunk)))
                .collect::<BResult<Vec<_>>>()?;
            let mut seqs = self
                .models
                .iter()
                .zip(&self.backends)
                .map(|(m, b)| m.new_sequence(b))
                .collect::<BResult<Vec<_>>>()?;
            let mut ranks = ContextRank::zip(&self.backends, &self.models, &mut wss, &mut seqs);
            ranks.push(ContextRank { be, model, ws, seq });
            let read = ContextRead::new(&ranks, tokens, mode, false)?;
            drop(ranks);
            Ok::<_, BackendError>(PendingRead {
                read,
                wss,
                seqs,
                bytes,
            })
        })();
        match buffers {
            Ok(pending) => Ok(Some(pending)),
            Err(_) => alone(),
        }
    }

    /// Runs the next stages of `pending` (begun by [`ContextRanks::start`] with these `be`,
    /// `model` and `seq`, `ws` the engine's step workspace): about a chunk of each rank's range
    /// through every layer ([`stages_a_step`]), the work a step gives a prompt chunk. True once
    /// the read is done: `seq` then holds its tokens, and the other ranks' buffers are dropped.
    pub(crate) fn advance(
        &self,
        pending: &mut Option<PendingRead<B>>,
        be: &B,
        model: &Model<B>,
        ws: &mut Workspace<B>,
        seq: &mut SeqState<B>,
    ) -> BResult<bool> {
        let Some(p) = pending.as_mut() else {
            return Err(BackendError(
                "context parallelism: no read in progress".into(),
            ));
        };
        let mut ranks = ContextRank::zip(&self.backends, &self.models, &mut p.wss, &mut p.seqs);
        ranks.push(ContextRank { be, model, ws, seq });
        for _ in 0..stages_a_step(model) {
            p.read.advance(&mut ranks, &*self.exchange)?;
            if p.read.is_done() {
                break;
            }
        }
        if !p.read.is_done() {
            return Ok(false);
        }
        let last = p.read.finish(&mut ranks)?;
        if last + 1 != self.ranks() {
            return Err(BackendError(
                "context parallelism: the engine's rank did not read the prompt's end".into(),
            ));
        }
        drop(ranks);
        let mut stats = self.stats.get();
        stats.prompts += 1;
        stats.tokens += p.tokens() as u64;
        self.stats.set(stats);
        *pending = None;
        Ok(true)
    }
}

/// Stages of a context-parallel read an engine step runs: a chunk of each rank's range
/// through both passes of every layer (a stage is one chunk through one pass), so a step that
/// reads ranks does about what one that reads a prompt chunk does, and the other requests'
/// tokens come as often as beside any long prompt.
pub(crate) fn stages_a_step<B: Backend>(model: &Model<B>) -> usize {
    2 * model.config.num_hidden_layers + 1
}

/// A context-parallel read in progress ([`ContextRanks::start`]): the read, the other ranks'
/// workspaces and sequences, and the bytes of the engine's memory it holds beside the caches.
pub(crate) struct PendingRead<B: Backend> {
    read: ContextRead<B>,
    wss: Vec<Workspace<B>>,
    seqs: Vec<SeqState<B>>,
    pub(crate) bytes: usize,
}

impl<B: Backend> PendingRead<B> {
    /// Tokens it reads.
    pub(crate) fn tokens(&self) -> usize {
        self.read.ranges().last().map_or(0, |r| r.end)
    }
}

/// What context-parallel ranks have read: prompts and their tokens, and the long prompts
/// read without them for want of memory (`read_alone`) or while they read another (`busy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextStats {
    pub prompts: u64,
    pub tokens: u64,
    pub read_alone: u64,
    pub busy: u64,
}
