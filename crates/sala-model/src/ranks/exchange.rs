//! Context parallelism over tensor-parallel groups ([`RankExchange`]).

use super::{err, RankAct, Ranks};
use crate::backend::{BResult, Backend};
use crate::context::Exchange;

/// Context parallelism over tensor-parallel groups: each group a context rank, rank `r` of
/// one group exchanging with rank `r` of the others (the same part of every activation and
/// state) through `by_rank[r]`.
pub struct RankExchange<B: Backend> {
    by_rank: Vec<Box<dyn Exchange<B> + Send>>,
}

impl<B: Backend> RankExchange<B> {
    /// One exchange for each rank of a group, in rank order.
    pub fn new(by_rank: Vec<Box<dyn Exchange<B> + Send>>) -> Self {
        Self { by_rank }
    }

    fn check(&self, from: &Ranks<B>, to: &Ranks<B>) -> BResult<()> {
        let n = self.by_rank.len();
        if from.ranks.len() != n || to.ranks.len() != n {
            return Err(err(format!(
                "an exchange of {n} ranks a group between groups of {} and {}",
                from.ranks.len(),
                to.ranks.len()
            )));
        }
        Ok(())
    }
}

impl<B: Backend> Exchange<Ranks<B>> for RankExchange<B> {
    fn copy_act(
        &self,
        from: &Ranks<B>,
        src: &RankAct<B::Act>,
        to: &Ranks<B>,
        dst: &mut RankAct<B::Act>,
        rows: usize,
    ) -> BResult<()> {
        self.check(from, to)?;
        if src.split != dst.split {
            return Err(err("an exchange between whole rows and a rank's columns"));
        }
        to.set_width(dst, src.width)?;
        for (r, ex) in self.by_rank.iter().enumerate() {
            ex.copy_act(
                &from.ranks[r],
                &src.parts[r],
                &to.ranks[r],
                &mut dst.parts[r],
                rows,
            )?;
        }
        Ok(())
    }

    fn copy_state(
        &self,
        from: &Ranks<B>,
        src: &Vec<B::LightningState>,
        to: &Ranks<B>,
        dst: &mut Vec<B::LightningState>,
    ) -> BResult<()> {
        self.check(from, to)?;
        for (r, ex) in self.by_rank.iter().enumerate() {
            ex.copy_state(&from.ranks[r], &src[r], &to.ranks[r], &mut dst[r])?;
        }
        Ok(())
    }

    fn one_memory(&self) -> bool {
        self.by_rank.iter().all(|ex| ex.one_memory())
    }
}
