//! The forward pass on this thread while other work (grammars' masks) runs on rayon's.

use crate::grammar::Constraint;

/// Runs `forward` on this thread while the masks of `constraints` are computed on rayon's
/// threads (in parallel among themselves), so that on a GPU a mask costs no time of its own:
/// the forward pass waits for the device meanwhile.
pub(super) fn beside<R>(constraints: Vec<&mut Constraint>, forward: impl FnOnce() -> R) -> R {
    run_beside(constraints, Constraint::compute_mask_isolated, forward)
}

/// Runs `forward` on this thread (a backend may be bound to it) while `work` runs for each of
/// `jobs` on rayon's threads; returns once all are done. A panic in `work` resumes here.
/// Handing jobs to rayon's waiting threads costs ~10 µs; a thread of their own would cost more.
fn run_beside<J: Send, R>(
    jobs: Vec<J>,
    work: impl Fn(J) + Send + Sync,
    forward: impl FnOnce() -> R,
) -> R {
    if jobs.is_empty() {
        return forward();
    }
    let work = &work;
    rayon::in_place_scope(|s| {
        for job in jobs {
            s.spawn(move |_| work(job));
        }
        forward()
    })
}

#[cfg(test)]
mod tests {
    use super::run_beside;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn the_work_runs_while_the_forward_pass_does() {
        // The "forward pass" waits for every job to have started: it would wait forever if
        // they ran after it.
        let (tx, rx) = mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        let got = run_beside(
            vec![1, 2, 3],
            |j| tx.lock().unwrap().send(j).unwrap(),
            || {
                let mut seen: Vec<i32> = (0..3)
                    .map(|_| rx.recv_timeout(Duration::from_secs(20)).unwrap())
                    .collect();
                seen.sort_unstable();
                seen
            },
        );
        assert_eq!(got, [1, 2, 3]);
        assert_eq!(run_beside(Vec::<()>::new(), |_| {}, || 7), 7);
    }

    #[test]
    #[should_panic(expected = "job 2")]
    fn a_panic_in_the_work_reaches_the_caller() {
        run_beside(vec![2], |j| panic!("job {j}"), || ());
    }
}
