//! The cache budget: the one place that says whether a request's memory fits, and that counts
//! the cache bytes the requests in flight hold.
//!
//! A request is admitted when the memory plan of its sequence (prompt + `max_tokens` within
//! the context budget, on the step workspace), with the caches of every sequence in flight
//! added, fits the memory limit. A refusal says whether the request could fit alone (the
//! memory is busy: retry later) or not (it is too large). Each admitted sequence holds a
//! [`Lease`] until it ends; the budget counts its bytes by the model's memory formula as it
//! grows. A [`CacheProbe`] lets the backend report what its caches really hold.

use crate::request::RequestId;
use sala_checkpoint::ModelConfig;
use sala_model::memory::{
    cache_bytes, shared_prefix_bytes, speculation_bytes, BackendMemory, CacheBytes, MemoryLimit,
    MemoryPlan, OverBudget,
};
use sala_model::Backend;

/// The backend's own count of the bytes its caches hold (a page pool's pages, say).
pub trait CacheProbe<B> {
    /// Bytes the backend's caches take now (e.g. the pages a page pool has mapped, which may
    /// include pages not yet handed back); `None` when it cannot tell (the budget's planned
    /// bytes stand in).
    fn cache_bytes_in_use(&self, backend: &B) -> Option<usize>;
}

impl<B, F: Fn(&B) -> Option<usize>> CacheProbe<B> for F {
    fn cache_bytes_in_use(&self, backend: &B) -> Option<usize> {
        self(backend)
    }
}

/// Why a request's memory was refused.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// Its plan does not fit even alone.
    TooLarge(OverBudget),
    /// It fits alone but not beside the sequences in flight (the error is for them together).
    Busy(OverBudget),
}

/// One admitted sequence's share of the budget; hand it back with [`CacheBudget::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lease is held until it is released"]
pub struct Lease {
    id: RequestId,
    /// Tokens the sequence may reach: what its memory was planned for.
    total: usize,
    planned: CacheBytes,
    /// Tokens counted as held, and their bytes by the memory formula.
    tokens: usize,
    held: usize,
    /// Bytes held beside the caches (speculative decoding's), counted with them.
    extra: usize,
}

impl Lease {
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Tokens the sequence may reach.
    pub fn total_tokens(&self) -> usize {
        self.total
    }

    /// Tokens counted as held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes held, by the memory formula.
    pub fn held_bytes(&self) -> usize {
        self.held
    }
}

/// The memory limit, and the caches of the sequences admitted under it.
#[derive(Debug, Clone)]
pub struct CacheBudget {
    config: ModelConfig,
    /// Rows of the step workspace, for plans.
    rows: usize,
    /// What the backend holds beside the model's buffers, for those rows.
    facts: BackendMemory,
    limit: Option<MemoryLimit>,
    /// Bytes held beside the model's weights whatever the requests (a draft model's).
    resident: usize,
    /// The cache terms of the admitted sequences' plans, summed.
    planned: CacheBytes,
    /// Bytes the admitted sequences hold by the memory formula, summed.
    held: usize,
    live: usize,
    /// Bytes the prefix cache's parked sequences hold (evictable, but counted until evicted).
    parked: usize,
    /// Bytes a context-parallel read in progress holds beside the caches.
    reading: usize,
}

const NO_BYTES: CacheBytes = CacheBytes {
    kv: 0,
    compressed: 0,
    lightning_state: 0,
};

fn add(a: CacheBytes, b: CacheBytes) -> CacheBytes {
    CacheBytes {
        kv: a.kv + b.kv,
        compressed: a.compressed + b.compressed,
        lightning_state: a.lightning_state + b.lightning_state,
    }
}

fn sub(a: CacheBytes, b: CacheBytes) -> CacheBytes {
    CacheBytes {
        kv: a.kv - b.kv,
        compressed: a.compressed - b.compressed,
        lightning_state: a.lightning_state - b.lightning_state,
    }
}

impl CacheBudget {
    /// An empty budget without a limit, for a model of `config` on `backend` whose steps hold
    /// `rows` rows.
    pub fn new<B: Backend>(config: &ModelConfig, rows: usize, backend: &B) -> Self {
        Self {
            config: config.clone(),
            rows,
            facts: backend.memory_facts(config, rows),
            limit: None,
            resident: 0,
            planned: NO_BYTES,
            held: 0,
            live: 0,
            parked: 0,
            reading: 0,
        }
    }

    /// Plans must fit `limit` (`None`: no limit).
    pub fn with_limit(mut self, limit: Option<MemoryLimit>) -> Self {
        self.limit = limit;
        self
    }

    /// Plans count `bytes` more of weights (a draft model's, with its workspace).
    pub fn with_resident(mut self, bytes: usize) -> Self {
        self.resident = bytes;
        self
    }

    /// The same limit and rows, with no sequence admitted.
    pub fn empty(&self) -> Self {
        Self {
            planned: NO_BYTES,
            held: 0,
            live: 0,
            parked: 0,
            reading: 0,
            ..self.clone()
        }
    }

    pub fn limit(&self) -> Option<&MemoryLimit> {
        self.limit.as_ref()
    }

    /// Rows of the step workspace the plans count.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The plan of one sequence of `total_tokens` tokens on the backend.
    pub fn plan(&self, total_tokens: usize) -> MemoryPlan {
        let mut plan = MemoryPlan::new(&self.config, total_tokens, self.rows, &self.facts);
        plan.weights += self.resident;
        plan
    }

    /// The cache terms a sequence of `total_tokens` tokens is planned for: by its plan under
    /// a limit, or by the memory formula (bf16) without one.
    fn planned_cache(&self, total_tokens: usize) -> CacheBytes {
        match self.limit {
            Some(_) => self.plan(total_tokens).cache,
            None => cache_bytes(&self.config, total_tokens),
        }
    }

    /// Whether a sequence of `total_tokens` tokens fits the limit alone (always, without one).
    pub fn check(&self, total_tokens: usize) -> Result<(), OverBudget> {
        match &self.limit {
            Some(limit) => self.plan(total_tokens).check(limit),
            None => Ok(()),
        }
    }

    /// Whether sequences that may reach `totals` tokens fit the limit together with nothing
    /// else admitted (always, without one): the check of one request's several choices, which
    /// the batch can never hold at once if this fails. Their states beside the caches (drafts,
    /// snapshots) are not counted, so a pass is no promise; a failure is certain.
    pub fn check_together(&self, totals: &[usize]) -> Result<(), OverBudget> {
        let mut budget = self.empty();
        for (i, &total) in totals.iter().enumerate() {
            match budget.admit(i as RequestId, total, 0, false, 0) {
                Ok(_) => {}
                Err(Refusal::TooLarge(e) | Refusal::Busy(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// Admits request `id`, whose sequence may reach `total_tokens` tokens and holds
    /// `held_tokens` now, if its plan fits beside the caches of every sequence admitted and
    /// the parked ones; a request that `speculates` holds [`speculation_bytes`] more, and
    /// `state_bytes` more for states beside its caches (a draft model's, the prefix cache's
    /// snapshots), counted as lightning state.
    pub fn admit(
        &mut self,
        id: RequestId,
        total_tokens: usize,
        held_tokens: usize,
        speculates: bool,
        state_bytes: usize,
    ) -> Result<Lease, Refusal> {
        let extra = if speculates {
            speculation_bytes(&self.config)
        } else {
            0
        } + state_bytes;
        let with_extra = |c: CacheBytes| CacheBytes {
            lightning_state: c.lightning_state + extra,
            ..c
        };
        if let Some(limit) = &self.limit {
            // Alone, with what it holds beside its caches.
            let mut alone = self.plan(total_tokens);
            alone.cache = with_extra(alone.cache);
            alone.check(limit).map_err(Refusal::TooLarge)?;
            let mut plan = self.plan(total_tokens);
            plan.cache = with_extra(add(plan.cache, self.planned));
            plan.cache.kv += self.parked + self.reading;
            plan.check(limit).map_err(Refusal::Busy)?;
        }
        let planned = with_extra(self.planned_cache(total_tokens));
        let held = cache_bytes(&self.config, held_tokens).total() + extra;
        self.planned = add(self.planned, planned);
        self.held += held;
        self.live += 1;
        Ok(Lease {
            id,
            total: total_tokens,
            planned,
            tokens: held_tokens,
            held,
            extra,
        })
    }

    /// `lease`'s sequence now holds `tokens` tokens.
    pub fn grow(&mut self, lease: &mut Lease, tokens: usize) {
        let held = cache_bytes(&self.config, tokens).total() + lease.extra;
        self.held = self.held - lease.held + held;
        lease.tokens = tokens;
        lease.held = held;
    }

    /// Ends `lease`: its sequence's memory is free. Returns the bytes it held.
    pub fn release(&mut self, lease: Lease) -> usize {
        self.planned = sub(self.planned, lease.planned);
        self.held -= lease.held;
        self.live -= 1;
        lease.held
    }

    /// Bytes a sequence of `tokens` tokens with `snapshots` copies of its lightning states
    /// holds: by its plan's cache terms under a limit (whole pages where the backend's caches
    /// come in pages), else by the memory formula. What the prefix cache counts a parked
    /// sequence.
    pub fn sequence_bytes(&self, tokens: usize, snapshots: usize) -> usize {
        self.planned_cache(tokens).total() + snapshots * self.snapshot_bytes()
    }

    /// Bytes of one copy of a sequence's lightning states (a prefix-cache snapshot), counted
    /// as [`CacheBudget::sequence_bytes`] counts them.
    pub fn snapshot_bytes(&self) -> usize {
        self.planned_cache(0).lightning_state
    }

    /// Bytes a fork at `tokens` maps from its source where the backend's caches come in
    /// pages (their whole pages below that point; 0 without pages).
    pub fn shared_bytes(&self, tokens: usize) -> usize {
        self.facts.cache_page.map_or(0, |page| {
            shared_prefix_bytes(
                &self.config,
                tokens,
                self.facts.value_bytes,
                page,
                self.facts.packs_fp8_kv,
            )
        })
    }

    /// The prefix cache's parked sequences now hold `bytes`.
    pub fn set_parked(&mut self, bytes: usize) {
        self.parked = bytes;
    }

    /// A context-parallel read in progress now holds `bytes` beside the caches (0: none).
    pub fn set_reading(&mut self, bytes: usize) {
        self.reading = bytes;
    }

    /// Sequences admitted and not released.
    pub fn sequences(&self) -> usize {
        self.live
    }

    /// Bytes the admitted sequences hold now, by the memory formula.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Cache bytes the admitted sequences' plans count (what admission reserved).
    pub fn planned_bytes(&self) -> usize {
        self.planned.total()
    }

    /// What the caches hold by `probe`'s count, or by the plans where it cannot tell.
    pub fn in_use(&self, probe: Option<usize>) -> usize {
        probe.unwrap_or_else(|| self.planned_bytes())
    }

    /// Bytes the limit leaves beyond the caches the admitted sequences are planned for, the
    /// parked ones and a context-parallel read in progress hold (and the rest of a plan):
    /// room for buffers made for a while, as context-parallel ranks' workspaces; `None`
    /// without a limit.
    pub fn spare_bytes(&self) -> Option<usize> {
        Some(
            self.room_for_caches()?
                .saturating_sub(self.planned.total() + self.parked + self.reading),
        )
    }

    /// Bytes the limit leaves for the caches of every sequence beside the rest of a plan
    /// (weights, workspace, the backend's scratch and runtime); `None` without a limit.
    pub fn room_for_caches(&self) -> Option<usize> {
        let limit = self.limit.as_ref()?;
        Some(self.plan(1).room_for_caches(limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: Option<usize>) -> CacheBudget {
        let config = sala_checkpoint::preset("tiny").unwrap();
        let limit = limit.map(|bytes| MemoryLimit {
            bytes,
            source: "test".into(),
        });
        CacheBudget::new(&config, 80, &sala_cpu::CpuBackend::default()).with_limit(limit)
    }

    #[test]
    fn admits_while_the_plans_fit_and_says_why_not() {
        let free = budget(None);
        let one = free.plan(400);
        // Room for one 400-token sequence and half the caches of another.
        let mut b = budget(Some(one.total() + one.cache.total() / 2));
        let a = b.admit(0, 400, 300, false, 0).unwrap();
        assert_eq!(b.planned_bytes(), one.cache.total());
        match b.admit(1, 400, 300, false, 0) {
            Err(Refusal::Busy(e)) => {
                // The error is for both sequences' caches together.
                assert_eq!(e.plan.cache.total(), 2 * one.cache.total());
                assert!(e.plan.total() > e.limit.bytes);
            }
            other => panic!("expected Busy, got {other:?}"),
        }
        // A smaller one fits beside it.
        let small = b.admit(2, 100, 50, false, 0).unwrap();
        // A request too large alone is refused as such, whatever is in flight.
        match b.admit(3, 4000, 10, false, 0) {
            Err(Refusal::TooLarge(e)) => assert_eq!(e.plan.context, 4000),
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert_eq!(b.sequences(), 2);
        b.release(small);
        b.release(a);
        // With the first released, the second fits.
        let c = b.admit(1, 400, 300, false, 0).unwrap();
        assert_eq!(b.sequences(), 1);
        b.release(c);
        assert!(b.check(4000).is_err() && b.check(400).is_ok());
    }

    #[test]
    fn counts_the_bytes_held_and_frees_them_on_release() {
        let config = sala_checkpoint::preset("tiny").unwrap();
        let bytes = |n| cache_bytes(&config, n).total();
        let mut b = budget(None);
        let mut x = b.admit(7, 100, 20, false, 0).unwrap();
        let mut y = b.admit(8, 50, 10, false, 0).unwrap();
        assert_eq!((x.id(), x.total_tokens(), x.tokens()), (7, 100, 20));
        assert_eq!(b.held_bytes(), bytes(20) + bytes(10));
        b.grow(&mut x, 21);
        b.grow(&mut y, 30);
        assert_eq!(x.held_bytes(), bytes(21));
        assert_eq!(b.held_bytes(), bytes(21) + bytes(30));
        assert_eq!(b.release(x), bytes(21));
        assert_eq!(b.held_bytes(), bytes(30));
        b.release(y);
        assert_eq!(
            (b.held_bytes(), b.planned_bytes(), b.sequences()),
            (0, 0, 0)
        );
    }

    #[test]
    fn a_request_that_speculates_holds_its_marks_and_span_rows_too() {
        let config = sala_checkpoint::preset("tiny").unwrap();
        let extra = speculation_bytes(&config);
        assert!(extra > cache_bytes(&config, 0).lightning_state, "{extra}");
        let mut b = budget(None);
        let mut x = b.admit(0, 100, 20, true, 0).unwrap();
        assert_eq!(b.held_bytes(), cache_bytes(&config, 20).total() + extra);
        assert_eq!(b.planned_bytes(), cache_bytes(&config, 100).total() + extra);
        b.grow(&mut x, 40);
        assert_eq!(x.held_bytes(), cache_bytes(&config, 40).total() + extra);
        b.release(x);
        assert_eq!((b.held_bytes(), b.planned_bytes()), (0, 0));
        // Under a limit that fits the plan alone, the speculation's bytes tip it over: too
        // large however empty the batch.
        let one = budget(None).plan(400);
        let mut tight = budget(Some(one.total() + extra / 2));
        assert!(matches!(
            tight.admit(1, 400, 10, true, 0),
            Err(Refusal::TooLarge(_))
        ));
        let plain = tight.admit(1, 400, 10, false, 0).unwrap();
        tight.release(plain);
        // A draft model's state per request, its weights in every plan.
        let mut b = budget(None);
        let x = b.admit(0, 100, 20, true, 777).unwrap();
        assert_eq!(
            b.held_bytes(),
            cache_bytes(&config, 20).total() + extra + 777
        );
        b.release(x);
        let drafted = budget(None).with_resident(5000);
        assert_eq!(drafted.plan(400).total(), one.total() + 5000);
        let mut tight = budget(Some(one.total() + 100)).with_resident(5000);
        assert!(matches!(
            tight.admit(1, 400, 10, false, 0),
            Err(Refusal::TooLarge(_))
        ));
    }

    #[test]
    fn the_probe_speaks_for_the_backend_where_it_can() {
        let mut b = budget(None);
        let x = b.admit(0, 64, 8, false, 0).unwrap();
        assert_eq!(b.in_use(None), b.planned_bytes());
        assert_eq!(b.in_use(Some(12345)), 12345);
        let probe = |pages: &usize| Some(*pages * 4096);
        assert_eq!(b.in_use(probe.cache_bytes_in_use(&3)), 3 * 4096);
        b.release(x);
    }

    #[test]
    fn room_for_caches_is_what_the_limit_leaves_beside_the_rest() {
        assert_eq!(budget(None).room_for_caches(), None);
        let plan = budget(None).plan(1);
        let rest = plan.total() - plan.cache.total();
        let b = budget(Some(rest + 1000));
        assert_eq!(b.room_for_caches(), Some(1000));
        assert_eq!(b.empty().room_for_caches(), Some(1000));
    }
}
