//! A request's choices as the response reads them: each its engine events, and the wait for
//! every choice to start, which reads them all meanwhile.

use super::Failed;
use crate::api::ApiError;
use crate::engine::Event;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::task::Poll;
use tokio::sync::mpsc;

/// One choice's events: those read while the request waited for its other choices to start,
/// then its channel's.
pub(super) struct Choice {
    early: VecDeque<Event>,
    /// `None` once the channel has closed.
    rx: Option<mpsc::Receiver<Event>>,
    started: bool,
}

impl Choice {
    pub(super) fn new(rx: mpsc::Receiver<Event>) -> Self {
        Self {
            early: VecDeque::new(),
            rx: Some(rx),
            started: false,
        }
    }

    /// The next event; `None` once the channel has closed and every event was read.
    pub(super) async fn recv(&mut self) -> Option<Event> {
        if let Some(e) = self.early.pop_front() {
            return Some(e);
        }
        let ev = self.rx.as_mut()?.recv().await;
        if ev.is_none() {
            self.rx = None;
        }
        ev
    }
}

/// Waits until every choice has started (`Event::Started`, taken here) or one has failed,
/// reading every channel meanwhile and keeping what comes after a start for the response:
/// the engine admits a request's choices as its batch has room, so choices already started
/// must go on generating (and end, freeing room) while the others wait, or they would pause
/// on full channels and never make room. A choice's first event other than its start is the
/// engine's error, or an internal one.
pub(super) async fn wait_started(choices: &mut [Choice]) -> Result<(), Failed> {
    poll_fn(|cx| loop {
        let mut read = false;
        for c in choices.iter_mut() {
            while let Some(rx) = c.rx.as_mut() {
                let Poll::Ready(ev) = rx.poll_recv(cx) else {
                    break;
                };
                read = true;
                match (c.started, ev) {
                    (false, Some(Event::Started { .. })) => c.started = true,
                    (_, Some(Event::Error(e))) if !c.started => {
                        return Poll::Ready(Err(Failed::Engine(ApiError::from(&e))));
                    }
                    (true, Some(ev)) => c.early.push_back(ev),
                    (true, None) => c.rx = None,
                    (false, _) => {
                        return Poll::Ready(Err(Failed::Here(ApiError::internal(
                            "the engine stopped before answering",
                        ))));
                    }
                }
            }
        }
        if choices.iter().all(|c| c.started) {
            return Poll::Ready(Ok(()));
        }
        if !read {
            return Poll::Pending;
        }
    })
    .await
}
