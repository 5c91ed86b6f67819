//! Steps run ahead: a step of greedy decode rows leaves its picks on the device and the next
//! one is queued, its tokens those picks, before they reach the host
//! ([`sala_model::Model::forward_ahead`]).

use super::{Client, Member};
use crate::generate::isolated;
use crate::request::RequestId;
use sala_model::{Backend, BackendError, LogitRows, SeqState, StepInput, StepLogits};

impl<B: Backend, C: Client> Member<B, C> {
    /// Whether its next step may be queued before its last token reaches the host: it
    /// decodes greedily (the pick made on the device is its token), nothing else waits on its
    /// tokens, and its client takes them.
    pub(super) fn runs_ahead(&self) -> bool {
        self.done.is_none()
            && self.spec.is_none()
            && self.context.is_none()
            && self.copy_of.is_none()
            && self.prompt_logprobs.is_none()
            && self.read == self.prompt.len()
            && self.stream.takes_greedy_pick()
            && self.client.ready()
    }
}

/// The picks of the step queued ahead (its rows, the requests `ids` in order) become the
/// requests' logits. First, where every request of the batch has a row there and still
/// runs ahead, the next step is queued with those picks as its tokens. Returns that step's
/// rows, each request with the token it was fed.
pub(super) fn collect<B: Backend, C: Client>(
    model: &sala_model::Model<B>,
    backend: &B,
    ws: &mut sala_model::Workspace<B>,
    members: &mut [Member<B, C>],
    ids: Vec<RequestId>,
) -> Option<Vec<(RequestId, u32)>> {
    // A request about to take its last token gets no row after it.
    let index: Option<Vec<usize>> = ids
        .iter()
        .map(|id| {
            members
                .iter()
                .position(|m| m.id == *id && m.runs_ahead() && m.stream.draft_room() > 0)
        })
        .collect();
    let again = index.filter(|_| members.len() == ids.len());
    let queued = match &again {
        Some(index) => queue(model, backend, ws, members, index, true),
        None => false,
    };
    let picks = isolated("the forward pass", || {
        let picks = model.take_picks(backend)?;
        if picks.len() != ids.len() {
            return Err(BackendError(format!(
                "{} picks for a step of {} rows",
                picks.len(),
                ids.len()
            ))
            .into());
        }
        Ok(picks)
    });
    let picks = match picks {
        Ok(picks) => picks,
        Err(e) => {
            for m in members.iter_mut().filter(|m| ids.contains(&m.id)) {
                if m.done.is_none() {
                    m.done = Some(Err(e.shared()));
                }
            }
            return None;
        }
    };
    let mut fed = Vec::with_capacity(ids.len());
    for (&id, pick) in ids.iter().zip(picks) {
        // A row without a pick read token 0; its request fails as it samples.
        fed.push((id, pick.id.unwrap_or(0)));
        if let Some(m) = members.iter_mut().find(|m| m.id == id && m.done.is_none()) {
            m.logits = Some(StepLogits::Greedy(pick));
        }
    }
    queued.then_some(fed)
}

/// Queues a step of one greedy decode row for each of `members[index]`, in that order, fed its
/// token (`picked`: the pick the step before left for it) and leaving its pick for later;
/// fails those requests where it cannot. Whether the step was queued.
pub(super) fn queue<B: Backend, C>(
    model: &sala_model::Model<B>,
    backend: &B,
    ws: &mut sala_model::Workspace<B>,
    members: &mut [Member<B, C>],
    index: &[usize],
    picked: bool,
) -> bool {
    let mut slots: Vec<Option<&mut Member<B, C>>> = members.iter_mut().map(Some).collect();
    let mut rows: Vec<&mut Member<B, C>> = index
        .iter()
        .map(|&i| slots[i].take().expect("one row a request"))
        .collect();
    let fed: Vec<u32> = rows
        .iter()
        .map(|m| if picked { 0 } else { m.feed.expect("decoding") })
        .collect();
    let mut inputs: Vec<StepInput<'_, B>> = rows
        .iter_mut()
        .zip(&fed)
        .map(|(m, t)| greedy_row(model, &mut m.seq, t))
        .collect();
    let queued = isolated("the forward pass", || {
        #[cfg(test)]
        super::tests::forward_hook();
        Ok(model.forward_ahead(backend, ws, &mut inputs, picked)?)
    });
    drop(inputs);
    match queued {
        Ok(()) => {
            for m in rows {
                m.feed = None;
            }
            true
        }
        Err(e) => {
            for m in rows {
                m.done = Some(Err(e.shared()));
            }
            false
        }
    }
}

/// A decode row of `seq` fed `token`, asking for its greedy pick.
fn greedy_row<'a, B: Backend>(
    model: &sala_model::Model<B>,
    seq: &'a mut SeqState<B>,
    token: &'a u32,
) -> StepInput<'a, B> {
    StepInput {
        mode: model.sparse_mode(seq.pos + 1),
        seq,
        tokens: std::slice::from_ref(token),
        logits: LogitRows::Greedy,
    }
}
