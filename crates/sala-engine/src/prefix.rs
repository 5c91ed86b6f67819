//! The prefix cache: sequences that ended are parked with the tokens their state holds and
//! snapshots of their lightning states taken while their prompts were read; a request whose
//! prompt begins with the tokens of a parked sequence starts from a fork of it at the deepest
//! point it can resume from exactly ([`Model::fork_sequence`]), and reads only the rest of its
//! prompt. The parked sequence stays, unchanged, for the next request: on the GPU the fork's
//! keys and values below that point are the parked sequence's own pages (shared, never
//! written again), so any number of requests on one document hold it once.
//!
//! A resume point is a position `p` where the lightning states are known: a snapshot's, or
//! the parked state's own end. The sparse layers' caches hold the first `p` tokens (they are
//! the same tokens, so their keys, values and compressed keys are too); the lightning states,
//! being running sums, can only come from a snapshot at `p` exactly. Never from zero: a match
//! without a snapshot inside it is a miss. The point must leave at least one prompt token to
//! read, whose logits the request samples from.
//!
//! The sparse layers attend densely or sparsely by the length of the whole prompt (SPEC §5.2:
//! dense iff shorter than `dense_len`), so a sequence serves only prompts read the same way
//! as its own (its decode rows then were too: positions only grow).
//!
//! A hit is exact: the rewound sequence holds what reading its first `p` tokens gives. Where
//! the pieces both prompts were read in below `p` are the same and `p` is a boundary of the
//! cold run's pieces, the rest is read in the same pieces and the logits are the cold run's
//! bit for bit; elsewhere the pieces differ and the logits agree to the accumulation order
//! (as chunked prefill agrees with one pass). Pieces are chunks from where a prompt began
//! reading, and for a long prompt a tail cut ([`crate::scheduler::tail_cut`]) in its last
//! half chunk: so a chunk boundary above the parked prompt's tail cut is the one case where
//! a boundary of both runs may still differ in the bits (on a backend whose sums depend on
//! the pieces; the CPU's do not).

use crate::block_tree::BlockTree;
use sala_model::{BResult, Backend, Model, SeqMark, SeqState};
use std::collections::HashMap;

/// Most snapshots a sequence keeps (one a prompt chunk, up to this); past them the one
/// closest to its predecessor goes.
pub const MAX_SNAPSHOTS: usize = 8;

/// How much the prefix cache has served: prompt tokens taken from it and read anew, over the
/// requests that looked it up.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    pub lookups: u64,
    pub hits: u64,
    pub hit_tokens: u64,
    pub missed_tokens: u64,
    pub evictions: u64,
}

/// A parked sequence: its state, the tokens it holds (`seq.pos` of them), whether its prompt
/// was read sparsely, its snapshots (positions below `seq.pos`, ascending), when it was last
/// used, its bytes, and what it maps from the sequence it was forked from.
struct Parked<B: Backend> {
    seq: SeqState<B>,
    tokens: Vec<u32>,
    sparse: bool,
    snapshots: Vec<SeqMark<B>>,
    used: u64,
    bytes: usize,
    shares: Option<Shared>,
}

/// The cache bytes a fork maps from the parked sequence `source` rather than holding its own
/// (the backend's shared pages below the fork's point): while `source` stays parked, they are
/// counted once, as its bytes, not again as the fork's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    pub source: u64,
    pub bytes: usize,
}

/// A prompt's best parked sequence (`id`) and the point it resumes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    pub id: u64,
    pub pos: usize,
}

/// A request's start from the cache: its sequence, holding the prompt's first `pos` tokens.
pub struct Resume<B: Backend> {
    pub seq: SeqState<B>,
    pub pos: usize,
}

/// The parked sequences, least recently used first to go, within `limit` bytes, indexed by
/// their tokens' 64-token blocks in a radix tree.
pub struct PrefixCache<B: Backend> {
    limit: usize,
    entries: HashMap<u64, Parked<B>>,
    tree: BlockTree,
    next_id: u64,
    clock: u64,
    stats: PrefixStats,
}

/// How many first tokens `a` and `b` share, given that they share their first `from`.
fn common_prefix(a: &[u32], b: &[u32], from: usize) -> usize {
    from + a[from..]
        .iter()
        .zip(&b[from..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// The deepest point a sequence of `held` tokens, with snapshots at `snapshots` (positions),
/// whose first `common` tokens are a prompt's of `prompt` tokens, can resume it from: 0 when
/// none.
fn resume_point(common: usize, held: usize, snapshots: &[usize], prompt: usize) -> usize {
    // At least one prompt token is left to read.
    let reach = common.min(prompt.saturating_sub(1));
    let end = (held <= reach).then_some(held);
    snapshots
        .iter()
        .copied()
        .filter(|&p| p <= reach)
        .chain(end)
        .max()
        .unwrap_or(0)
}

/// Keeps at most `cap` (at least 1) of `snapshots` (ascending): while over, drops the one
/// `to_drop` picks, so they stay spread out.
pub fn thin_snapshots<B: Backend>(snapshots: &mut Vec<SeqMark<B>>, cap: usize) {
    while snapshots.len() > cap.max(1) {
        let at: Vec<usize> = snapshots.iter().map(|s| s.pos()).collect();
        snapshots.remove(to_drop(&at));
    }
}

/// Which of `positions` (ascending, at least one) goes first: the one whose gap to its
/// predecessor is smallest, never one of the last two (a prompt's end and, for a long
/// prompt, its tail cut, where follow-up prompts resume: `scheduler::tail_cut`), unless
/// there are only two.
fn to_drop(positions: &[usize]) -> usize {
    let keep = if positions.len() > 2 { 2 } else { 1 };
    (0..positions.len().saturating_sub(keep))
        .min_by_key(|&i| positions[i] - if i == 0 { 0 } else { positions[i - 1] })
        .unwrap_or(0)
}

impl<B: Backend> PrefixCache<B> {
    /// An empty cache holding at most `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            entries: HashMap::new(),
            tree: BlockTree::default(),
            next_id: 0,
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Bytes its sequences hold, by the memory formula, less what a parked fork maps from a
    /// parked source (held once).
    pub fn bytes(&self) -> usize {
        let all: usize = self.entries.values().map(|e| e.bytes).sum();
        all.saturating_sub(self.shared_with(self.entries.values().filter_map(|e| e.shares)))
    }

    /// The bytes of `forks` whose sources are still parked (the cache counts those already).
    pub fn shared_with(&self, forks: impl IntoIterator<Item = Shared>) -> usize {
        forks
            .into_iter()
            .filter(|s| self.entries.contains_key(&s.source))
            .map(|s| s.bytes)
            .sum()
    }

    /// Sequences parked.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Snapshots its sequences hold.
    pub fn snapshots(&self) -> usize {
        self.entries.values().map(|e| e.snapshots.len()).sum()
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// The parked sequence `prompt` (read `sparse`ly or not) resumes deepest from, and that
    /// point; `None` when no sequence read the same way has a resume point in `prompt`.
    pub fn find(&self, prompt: &[u32], sparse: bool) -> Option<Hit> {
        // The sequences sharing whole blocks with the prompt, from the tree; the rest of each
        // one's match (under a block) by comparing tokens.
        self.tree
            .shared(prompt)
            .into_iter()
            .filter_map(|(id, blocks)| Some((id, blocks, self.entries.get(&id)?)))
            .filter(|(_, _, e)| e.sparse == sparse)
            .map(|(id, blocks, e)| {
                let at: Vec<usize> = e.snapshots.iter().map(|s| s.pos()).collect();
                let common = common_prefix(&e.tokens, prompt, blocks);
                let pos = resume_point(common, e.tokens.len(), &at, prompt.len());
                (Hit { id, pos }, e.used)
            })
            .filter(|(hit, _)| hit.pos > 0)
            .max_by_key(|&(hit, used)| (hit.pos, used))
            .map(|(hit, _)| hit)
    }

    /// A fork of the parked sequence of `hit` (from [`PrefixCache::find`]) at its point, for
    /// `prompt`; `None` (a miss) without a hit, or where the sequence went meanwhile. Counts
    /// the lookup.
    pub fn fork(
        &mut self,
        model: &Model<B>,
        be: &B,
        prompt: &[u32],
        hit: Option<Hit>,
    ) -> BResult<Option<Resume<B>>> {
        self.stats.lookups += 1;
        let Some((Hit { pos, .. }, entry)) =
            hit.and_then(|h| Some((h, self.entries.get_mut(&h.id)?)))
        else {
            self.stats.missed_tokens += prompt.len() as u64;
            return Ok(None);
        };
        self.clock += 1;
        entry.used = self.clock;
        let at = entry.snapshots.iter().find(|s| s.pos() == pos);
        let seq = model.fork_sequence(be, &entry.seq, at.filter(|_| pos < entry.seq.pos), pos)?;
        self.stats.hits += 1;
        self.stats.hit_tokens += pos as u64;
        self.stats.missed_tokens += (prompt.len() - pos) as u64;
        Ok(Some(Resume { seq, pos }))
    }

    /// Parks `seq`, which holds `tokens` (`seq.pos` of them; its prompt read `sparse`ly or
    /// not), with its snapshots, counted as `bytes` (of which it `shares` some with the
    /// sequence it was forked from); the least recently used sequences go while the cache is
    /// over its limit (this one too, when it alone is).
    pub fn park(
        &mut self,
        seq: SeqState<B>,
        tokens: Vec<u32>,
        sparse: bool,
        mut snapshots: Vec<SeqMark<B>>,
        bytes: usize,
        shares: Option<Shared>,
    ) {
        if tokens.len() != seq.pos || tokens.is_empty() {
            return;
        }
        snapshots.retain(|s| s.pos() > 0 && s.pos() < seq.pos);
        self.clock += 1;
        let id = self.next_id;
        self.next_id += 1;
        self.tree.insert(id, &tokens);
        self.entries.insert(
            id,
            Parked {
                seq,
                tokens,
                sparse,
                snapshots,
                used: self.clock,
                bytes,
                shares,
            },
        );
        while self.bytes() > self.limit && self.evict_one() {}
    }

    /// Drops the least recently used sequence; false when none is parked.
    pub fn evict_one(&mut self) -> bool {
        self.evict_one_but(None)
    }

    /// Drops the least recently used sequence but `keep`; false when there is none.
    pub fn evict_one_but(&mut self, keep: Option<u64>) -> bool {
        let Some(id) = self
            .entries
            .iter()
            .filter(|(&id, _)| Some(id) != keep)
            .min_by_key(|(_, e)| e.used)
            .map(|(&id, _)| id)
        else {
            return false;
        };
        if let Some(e) = self.entries.remove(&id) {
            self.tree.remove(id, &e.tokens);
        }
        self.stats.evictions += 1;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{common_prefix, to_drop};

    #[test]
    fn thinning_keeps_the_snapshots_spread_and_the_last_two() {
        // The closest to its predecessor goes, never the end nor the tail cut before it.
        assert_eq!(to_drop(&[8192, 16384, 24576, 32256, 32768]), 0);
        assert_eq!(to_drop(&[100, 8192, 16384, 24576, 32256, 32768]), 0);
        assert_eq!(to_drop(&[8192, 9000, 24576, 32256, 32768]), 1);
        assert_eq!(to_drop(&[64, 128]), 0);
        assert_eq!(to_drop(&[64]), 0);
    }

    /// `super::resume_point` over the tokens themselves.
    fn resume_point(tokens: &[u32], snapshots: &[usize], prompt: &[u32]) -> usize {
        let n = tokens.len().min(prompt.len());
        let common = common_prefix(&tokens[..n], &prompt[..n], 0);
        super::resume_point(common, tokens.len(), snapshots, prompt.len())
    }

    #[test]
    fn resume_points_are_snapshots_or_the_end_within_the_match() {
        let tokens: Vec<u32> = (0..100).collect();
        let prompt: Vec<u32> = (0..70).chain([999, 998]).collect();
        // The match is 70 tokens: the snapshot at 64 is the deepest inside it.
        assert_eq!(resume_point(&tokens, &[32, 64, 96], &prompt), 64);
        // Without a snapshot inside the match: a miss, never a start from zero state.
        assert_eq!(resume_point(&tokens, &[96], &prompt), 0);
        // The whole sequence matches and the prompt goes on: its end.
        let longer: Vec<u32> = (0..120).collect();
        assert_eq!(resume_point(&tokens, &[64], &longer), 100);
        // The prompt is the sequence exactly: one token must be left to read.
        assert_eq!(resume_point(&tokens, &[64, 99], &tokens), 99);
        assert_eq!(resume_point(&tokens, &[64], &tokens), 64);
        // A match ending inside a block of 64 resumes from the snapshot below it.
        let inside: Vec<u32> = (0..90).chain([5]).collect();
        assert_eq!(resume_point(&tokens, &[64], &inside), 64);
        assert_eq!(resume_point(&tokens, &[], &[]), 0);
    }
}
