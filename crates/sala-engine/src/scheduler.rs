//! The per-step token budget: which rows one forward pass holds.
//!
//! A step holds at most `budget` rows (the step workspace's). Decode rows come first, one
//! per request with a token to feed (a span of them for a request that speculates), oldest
//! request first; then prompt chunks, oldest
//! request first, each the next whole chunk of its prompt while it fits. A prompt is cut at
//! multiples of `chunk` from its start, wherever it shares steps, so its results are those of
//! reading it alone; a chunk that does not fit waits for a later step (a shorter one behind
//! it may still go). Prompts that score every token (their logits all kept) read chunks of at
//! most [`SCORED_ROWS`], and a step holds at most that many such rows.
//!
//! A long prompt (at least 4 chunks) is also cut a little before its end ([`tail_cut`]), where
//! a later prompt sharing all but its last words (the same document, another question) most
//! likely parts from it: the prefix cache snapshots the lightning states at every cut, so such
//! a prompt resumes there and reads only its tail. The cut depends on the prompt's length
//! alone, so a prompt is cut the same way read cold or resumed.

/// What a request in flight asks of the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Nothing: it has ended, or its logits wait to be sampled.
    Nothing,
    /// One row: the token it sampled last.
    Decode,
    /// A span of `rows` rows ending with the token it sampled last (speculative decoding:
    /// accepted tokens to read again, the token, then drafts to verify).
    Span { rows: usize },
    /// The rest of its prompt: `read` of its `len` tokens are read, of which it read those
    /// from `from` on (before: from the prefix cache). A `scored` prompt wants the logits of
    /// every row (its log-probabilities).
    Prompt {
        read: usize,
        len: usize,
        scored: bool,
        from: usize,
    },
}

/// Rows of one request in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// One decode row.
    Decode,
    /// A decode span of `rows` rows ([`Want::Span`]).
    Span { rows: usize },
    /// Prompt tokens `start..start + len`.
    Chunk { start: usize, len: usize },
}

impl Work {
    pub fn rows(self) -> usize {
        match self {
            Work::Decode => 1,
            Work::Span { rows } => rows,
            Work::Chunk { len, .. } => len,
        }
    }
}

/// One request's part of a step: its index among the wants, and its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub index: usize,
    pub work: Work,
}

/// A step's rows, in row order: the decode rows, then the prompt chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub slots: Vec<Slot>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Rows the step holds.
    pub fn rows(&self) -> usize {
        self.slots.iter().map(|s| s.work.rows()).sum()
    }
}

/// Most rows of a step whose logits are all kept (prompts that score their tokens), and so the
/// chunk of such a prompt: the logits a step holds at once stay at this many rows (73 448 a row
/// for the released vocabulary: 37 MB in bf16 on a device, 75 MB in f32 on the host).
pub const SCORED_ROWS: usize = 256;

/// Where a prompt of `len` tokens read in chunks of `chunk` is cut besides the chunks'
/// boundaries: `len − min(chunk / 2, 512)` for prompts of at least 4 chunks (the extra step
/// costs one pass's fixed overhead, a few ms on a GPU beside a TTFT of a second and more),
/// none for shorter ones.
pub fn tail_cut(len: usize, chunk: usize) -> Option<usize> {
    let back = (chunk / 2).clamp(1, 512);
    (chunk > 1 && len >= 4 * chunk).then(|| len - back)
}

/// Rows of a step's workspace: a prompt chunk beside a decode row for each of `max_batch`
/// requests.
pub fn step_rows(chunk: usize, max_batch: usize) -> usize {
    chunk + max_batch
}

/// Plans steps within a token budget (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduler {
    budget: usize,
    chunk: usize,
}

impl Scheduler {
    /// Steps of at most `budget` rows, reading prompts `chunk` tokens at a time (at least 1).
    pub fn new(budget: usize, chunk: usize) -> Self {
        Self {
            budget,
            chunk: chunk.max(1),
        }
    }

    /// The next step for requests whose wants are `wants`, oldest first.
    pub fn plan(&self, wants: &[Want]) -> StepPlan {
        let (mut used, mut scored_used) = (0, 0);
        let mut slots = Vec::new();
        for (index, w) in wants.iter().enumerate() {
            let work = match *w {
                Want::Decode => Work::Decode,
                Want::Span { rows } => Work::Span { rows },
                _ => continue,
            };
            if used + work.rows() <= self.budget {
                slots.push(Slot { index, work });
                used += work.rows();
            }
        }
        for (index, w) in wants.iter().enumerate() {
            if let Want::Prompt {
                read,
                len,
                scored,
                from,
            } = *w
            {
                let chunk = if scored {
                    self.chunk.min(SCORED_ROWS)
                } else {
                    self.chunk
                };
                // To the next chunk boundary (counted from where it began reading), or the end.
                let boundary = from + ((read.saturating_sub(from)) / chunk + 1) * chunk;
                let mut n = boundary.min(len).saturating_sub(read);
                if let Some(cut) = tail_cut(len, self.chunk).filter(|_| !scored) {
                    if read < cut && cut < read + n {
                        n = cut - read;
                    }
                }
                let fits_scored = !scored || scored_used + n <= SCORED_ROWS;
                if n > 0 && used + n <= self.budget && fits_scored {
                    if scored {
                        scored_used += n;
                    }
                    slots.push(Slot {
                        index,
                        work: Work::Chunk {
                            start: read,
                            len: n,
                        },
                    });
                    used += n;
                }
            }
        }
        StepPlan { slots }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(index: usize, start: usize, len: usize) -> Slot {
        Slot {
            index,
            work: Work::Chunk { start, len },
        }
    }

    fn decode(index: usize) -> Slot {
        Slot {
            index,
            work: Work::Decode,
        }
    }

    #[test]
    fn decode_rows_come_first_then_chunks_oldest_first() {
        let s = Scheduler::new(8 + 4, 8);
        let wants = [
            Want::Prompt {
                read: 0,
                len: 20,
                scored: false,
                from: 0,
            },
            Want::Decode,
            Want::Nothing,
            Want::Decode,
            Want::Prompt {
                read: 8,
                len: 30,
                scored: false,
                from: 0,
            },
        ];
        let plan = s.plan(&wants);
        // Request 0's chunk fills the budget beside the decode rows; request 4 waits.
        assert_eq!(plan.slots, [decode(1), decode(3), chunk(0, 0, 8)]);
        assert_eq!(plan.rows(), 10);
    }

    #[test]
    fn chunks_fill_the_budget_and_a_short_one_may_pass_a_long_one() {
        let s = Scheduler::new(10, 8);
        let wants = [
            Want::Prompt {
                read: 0,
                len: 5,
                scored: false,
                from: 0,
            },
            Want::Prompt {
                read: 0,
                len: 30,
                scored: false,
                from: 0,
            },
            Want::Prompt {
                read: 16,
                len: 19,
                scored: false,
                from: 0,
            },
        ];
        // 5 rows used: request 1's 8-token chunk does not fit, request 2's last 3 tokens do.
        assert_eq!(s.plan(&wants).slots, [chunk(0, 0, 5), chunk(2, 16, 3)]);
    }

    #[test]
    fn decode_rows_stop_at_the_budget() {
        let s = Scheduler::new(3, 2);
        let plan = s.plan(&[Want::Decode; 5]);
        assert_eq!(plan.slots, [decode(0), decode(1), decode(2)]);
        assert!(s.plan(&[Want::Nothing; 3]).is_empty());
    }

    #[test]
    fn a_prompt_is_cut_where_reading_it_alone_cuts_it() {
        // However the budget is shared, every chunk starts at a multiple of the chunk length
        // or at the tail cut and is whole (the last one is the rest of the prompt).
        let (chunk_len, len) = (16, 70);
        let alone: Vec<Work> = {
            let s = Scheduler::new(chunk_len, chunk_len);
            let mut read = 0;
            let mut out = Vec::new();
            while read < len {
                let plan = s.plan(&[Want::Prompt {
                    read,
                    len,
                    scored: false,
                    from: 0,
                }]);
                out.push(plan.slots[0].work);
                read += plan.rows();
            }
            out
        };
        // 0, 16, 32, 48..62 (70 tokens are 4 chunks and more: cut 8 before the end), 62..64,
        // then 64..70 (the chunks' boundaries stay where they were).
        assert_eq!(tail_cut(len, chunk_len), Some(62));
        assert_eq!(alone.len(), 6);
        for decodes in [0, 3, 7] {
            let s = Scheduler::new(chunk_len + 7, chunk_len);
            // A 40-token prompt ahead of ours and `decodes` decode rows share the steps.
            let (mut ahead, mut read) = (0, 0);
            let mut got = Vec::new();
            let mut steps = 0;
            while read < len {
                let mut wants = vec![Want::Decode; decodes];
                wants.push(Want::Prompt {
                    read: ahead,
                    len: 40,
                    scored: false,
                    from: 0,
                });
                wants.push(Want::Prompt {
                    read,
                    len,
                    scored: false,
                    from: 0,
                });
                for slot in s.plan(&wants).slots {
                    if slot.index == decodes {
                        ahead += slot.work.rows();
                    } else if slot.index == decodes + 1 {
                        got.push(slot.work);
                        read += slot.work.rows();
                    }
                }
                steps += 1;
                assert!(steps < 100, "the prompt is never read");
            }
            assert_eq!(got, alone, "{decodes} decode rows");
            for w in &got {
                let Work::Chunk { start, .. } = *w else {
                    panic!("{w:?}")
                };
                assert!(start % chunk_len == 0 || start == 62, "{w:?}");
            }
        }
    }

    /// Reads a prompt of `len` from `read` alone, returning where each piece starts.
    fn starts(chunk: usize, mut read: usize, len: usize, scored: bool) -> Vec<usize> {
        let s = Scheduler::new(chunk + 3, chunk);
        let from = read;
        let mut out = Vec::new();
        while read < len {
            let plan = s.plan(&[Want::Prompt {
                read,
                len,
                scored,
                from,
            }]);
            out.push(read);
            read += plan.rows();
        }
        out
    }

    #[test]
    fn long_prompts_are_also_cut_before_their_tails_read_cold_or_resumed() {
        // 4 chunks and more: a cut min(chunk / 2, 512) tokens before the end.
        assert_eq!(tail_cut(8192 * 4, 8192), Some(8192 * 4 - 512));
        assert_eq!(tail_cut(8192 * 4 - 1, 8192), None);
        assert_eq!(tail_cut(1100, 256), Some(972));
        assert_eq!(tail_cut(1000, 1), None);
        assert_eq!(starts(32, 0, 150, false), [0, 32, 64, 96, 128, 134]);
        // Resumed at a chunk boundary (a prefix-cache hit), the same cuts from there on.
        assert_eq!(starts(32, 64, 150, false), [64, 96, 128, 134]);
        // Resumed at the tail cut: the tail alone.
        assert_eq!(starts(32, 134, 150, false), [134]);
        // A cut that falls on a chunk boundary adds no step.
        assert_eq!(starts(32, 0, 144, false), [0, 32, 64, 96, 128]);
        // Short prompts and prompts that score their tokens: chunks only.
        assert_eq!(starts(32, 0, 100, false), [0, 32, 64, 96]);
        assert_eq!(starts(32, 0, 150, true), [0, 32, 64, 96, 128]);
    }

    #[test]
    fn scored_prompts_share_at_most_scored_rows_a_step_in_whole_chunks() {
        let s = Scheduler::new(4 * SCORED_ROWS, 2 * SCORED_ROWS);
        let scored = |read| Want::Prompt {
            read,
            len: 10 * SCORED_ROWS,
            scored: true,
            from: 0,
        };
        let plain = Want::Prompt {
            read: 0,
            len: 10 * SCORED_ROWS,
            scored: false,
            from: 0,
        };
        // The first scored prompt takes a whole chunk of SCORED_ROWS; the second waits (a
        // part of its chunk would move its chunk boundaries); the plain one reads its chunk.
        let plan = s.plan(&[scored(SCORED_ROWS), scored(0), plain]);
        assert_eq!(
            plan.slots,
            [
                chunk(0, SCORED_ROWS, SCORED_ROWS),
                chunk(2, 0, 2 * SCORED_ROWS)
            ]
        );
        // A last chunk of 10 rows leaves no room for a whole chunk of the other.
        let plan = s.plan(&[scored(10 * SCORED_ROWS - 10), scored(0)]);
        assert_eq!(plan.slots, [chunk(0, 10 * SCORED_ROWS - 10, 10)]);
    }
}
