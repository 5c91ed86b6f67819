//! The prefix cache's index: token sequences as a radix tree of 64-token blocks (the sparse
//! layers' block size). Node `n` at depth `k` lists the sequences whose first `64·k` tokens
//! are the blocks on the path to `n`, so a prompt's walk down the tree finds, for every
//! sequence sharing its first block, how many whole blocks they share, in one step a block.
//! Nodes live in an arena (a sequence of a million tokens is a path 16,384 deep: no
//! recursion, in walking or in dropping).

use std::collections::HashMap;

/// Tokens a block holds.
pub const BLOCK: usize = 64;

const ROOT: usize = 0;

#[derive(Default)]
struct Node {
    children: HashMap<Box<[u32]>, usize>,
    /// The sequences through this node.
    ids: Vec<u64>,
}

/// Sequences (by id) indexed by their tokens' whole blocks.
pub struct BlockTree {
    nodes: Vec<Node>,
    free: Vec<usize>,
}

impl Default for BlockTree {
    fn default() -> Self {
        Self {
            nodes: vec![Node::default()],
            free: Vec::new(),
        }
    }
}

impl BlockTree {
    fn node(&mut self) -> usize {
        match self.free.pop() {
            Some(n) => n,
            None => {
                self.nodes.push(Node::default());
                self.nodes.len() - 1
            }
        }
    }

    /// Adds sequence `id` holding `tokens`.
    pub fn insert(&mut self, id: u64, tokens: &[u32]) {
        let mut at = ROOT;
        self.nodes[at].ids.push(id);
        for block in tokens.chunks_exact(BLOCK) {
            let next = match self.nodes[at].children.get(block) {
                Some(&n) => n,
                None => {
                    let n = self.node();
                    self.nodes[at].children.insert(block.into(), n);
                    n
                }
            };
            self.nodes[next].ids.push(id);
            at = next;
        }
    }

    /// Removes sequence `id`, which was added holding `tokens`; nodes no sequence passes
    /// through any more go back to the arena.
    pub fn remove(&mut self, id: u64, tokens: &[u32]) {
        let mut at = ROOT;
        self.nodes[at].ids.retain(|&x| x != id);
        for block in tokens.chunks_exact(BLOCK) {
            let Some(&next) = self.nodes[at].children.get(block) else {
                return;
            };
            if self.nodes[next].ids == [id] {
                // Only this sequence below here: the whole subtree goes.
                self.nodes[at].children.remove(block);
                self.release(next);
                return;
            }
            self.nodes[next].ids.retain(|&x| x != id);
            at = next;
        }
    }

    /// Returns `n` and every node below it to the arena.
    fn release(&mut self, n: usize) {
        let mut stack = vec![n];
        while let Some(n) = stack.pop() {
            let node = std::mem::take(&mut self.nodes[n]);
            stack.extend(node.children.into_values());
            self.free.push(n);
        }
    }

    /// Every sequence sharing at least one whole block with `prompt`, or none (listed at the
    /// root), with the tokens of the whole blocks it shares: deepest first, each once.
    pub fn shared(&self, prompt: &[u32]) -> Vec<(u64, usize)> {
        let mut path = vec![ROOT];
        for block in prompt.chunks_exact(BLOCK) {
            match self.nodes[*path.last().expect("the root")]
                .children
                .get(block)
            {
                Some(&n) => path.push(n),
                None => break,
            }
        }
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for (depth, &n) in path.iter().enumerate().rev() {
            for &id in &self.nodes[n].ids {
                if seen.insert(id) {
                    out.push((id, depth * BLOCK));
                }
            }
        }
        out
    }

    /// Nodes in use (the root included).
    #[cfg(test)]
    fn nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32).map(|i| i.wrapping_mul(7) ^ seed).collect()
    }

    #[test]
    fn walks_find_shared_blocks_and_removals_free_their_nodes() {
        let mut t = BlockTree::default();
        let a = seq(300, 0);
        let mut b = a[..200].to_vec();
        b.extend(seq(100, 9));
        let c = seq(50, 5);
        t.insert(1, &a);
        t.insert(2, &b);
        t.insert(3, &c);
        // a: 4 blocks; b shares 3 of them (192 tokens) and adds 1; c none.
        assert_eq!(t.nodes(), 1 + 4 + 1);
        let mut p = a[..260].to_vec();
        p.push(1);
        let got = t.shared(&p);
        assert_eq!(got, [(1, 256), (2, 192), (3, 0)]);
        let got = t.shared(&b);
        assert_eq!(got, [(2, 256), (1, 192), (3, 0)]);
        assert_eq!(t.shared(&seq(10, 1)), [(1, 0), (2, 0), (3, 0)]);
        t.remove(1, &a);
        assert_eq!(t.nodes(), 1 + 4);
        assert_eq!(t.shared(&p), [(2, 192), (3, 0)]);
        t.remove(2, &b);
        t.remove(3, &c);
        assert_eq!(t.nodes(), 1);
        assert!(t.shared(&p).is_empty());
        // Freed nodes are reused.
        t.insert(4, &a);
        assert_eq!((t.nodes(), t.nodes.len()), (5, 6));
    }

    #[test]
    fn a_million_token_path_is_walked_and_dropped_without_recursion() {
        let mut t = BlockTree::default();
        let long = seq(1 << 20, 3);
        t.insert(1, &long);
        assert_eq!(t.shared(&long), [(1, 1 << 20)]);
        t.remove(1, &long);
        assert_eq!(t.nodes(), 1);
        t.insert(2, &long);
        drop(t);
    }
}
