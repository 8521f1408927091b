//! Running a data-parallel run's ranks as threads of one process: rank 0 on the calling
//! thread, every other rank on a thread of its own, and which rank's error the run reports.
//!
//! A rank that fails leaves its collective group (its [`crate::collective::ThreadRank`] is
//! dropped), so the others fail at their next collective with an error that only says a peer
//! went away ([`RuntimeError::Collective`]). The error worth reporting is the first rank's
//! own: rank 0's, unless rank 0 failed only because another rank did and that rank failed
//! for a reason of its own ([`RankFailure`]). A rank that panics panics the caller, after
//! every other rank has ended.

use crate::error::RuntimeError;

/// An error a rank can fail with, as [`run_thread_ranks`] weighs it.
pub trait RankFailure {
    /// Whether the error says only that another rank failed (its collective lost a peer),
    /// so another rank's error says more.
    fn caused_by_another_rank(&self) -> bool;
}

impl RankFailure for RuntimeError {
    fn caused_by_another_rank(&self) -> bool {
        matches!(self, RuntimeError::Collective { .. })
    }
}

/// Runs `worker(rank)` for every rank of `workers` (ranks 1 and up, each on a thread of its
/// own, started first) and `lead()` (rank 0) on the calling thread, waits for all of them,
/// and returns `lead`'s value, or the error that says most: rank 0's, unless it is only
/// [`RankFailure::caused_by_another_rank`] and a worker's is not (then the first such worker's).
/// A worker that panics re-raises its panic here once `lead` has returned.
pub fn run_thread_ranks<R, T, E>(
    workers: Vec<R>,
    worker: impl Fn(R) -> Result<(), E> + Sync,
    lead: impl FnOnce() -> Result<T, E>,
) -> Result<T, E>
where
    R: Send,
    E: RankFailure + Send,
{
    let worker = &worker;
    std::thread::scope(|scope| {
        let threads: Vec<_> = workers
            .into_iter()
            .map(|rank| scope.spawn(move || worker(rank)))
            .collect();
        let mut result = lead();
        for thread in threads {
            let outcome = thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            if let Err(e) = outcome {
                let reported = result.as_ref().err();
                if reported
                    .is_none_or(|r| r.caused_by_another_rank() && !e.caused_by_another_rank())
                {
                    result = Err(e);
                }
            }
        }
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A test error: `true` when it only says another rank failed.
    #[derive(Debug, PartialEq)]
    struct Failed(&'static str, bool);

    impl RankFailure for Failed {
        fn caused_by_another_rank(&self) -> bool {
            self.1
        }
    }

    /// Runs ranks 1..=`outcomes.len()`, worker `i` returning `outcomes[i]`, and rank 0 `lead`.
    fn check(outcomes: Vec<Result<(), Failed>>, lead: Result<u32, Failed>) -> Result<u32, Failed> {
        let ran = AtomicUsize::new(0);
        let workers: Vec<_> = outcomes.into_iter().collect();
        let result = run_thread_ranks(
            workers,
            |outcome| {
                ran.fetch_add(1, Ordering::SeqCst);
                outcome
            },
            || lead,
        );
        assert_eq!(ran.load(Ordering::SeqCst), 3, "every worker ran");
        result
    }

    #[test]
    fn success_returns_rank_0s_value() {
        assert_eq!(check(vec![Ok(()), Ok(()), Ok(())], Ok(7)), Ok(7));
    }

    #[test]
    fn a_workers_error_fails_a_successful_run() {
        let workers = vec![Ok(()), Err(Failed("rank 2 own", false)), Ok(())];
        assert_eq!(check(workers, Ok(7)), Err(Failed("rank 2 own", false)));
    }

    #[test]
    fn rank_0s_own_error_wins() {
        let workers = vec![Err(Failed("rank 1 own", false)), Ok(()), Ok(())];
        let lead = Err(Failed("rank 0 own", false));
        assert_eq!(check(workers, lead), Err(Failed("rank 0 own", false)));
    }

    #[test]
    fn a_workers_own_error_beats_rank_0s_lost_peer() {
        let workers = vec![
            Err(Failed("rank 1 lost a peer", true)),
            Err(Failed("rank 2 own", false)),
            Err(Failed("rank 3 own", false)),
        ];
        let lead = Err(Failed("rank 0 lost a peer", true));
        assert_eq!(check(workers, lead), Err(Failed("rank 2 own", false)));
    }

    #[test]
    fn lost_peers_everywhere_report_rank_0s() {
        let workers = vec![Err(Failed("rank 1 lost a peer", true)), Ok(()), Ok(())];
        let lead = Err(Failed("rank 0 lost a peer", true));
        assert_eq!(
            check(workers, lead),
            Err(Failed("rank 0 lost a peer", true))
        );
    }

    #[test]
    fn a_workers_panic_reaches_the_caller_after_rank_0_ends() {
        let lead_ended = AtomicUsize::new(0);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_thread_ranks(
                vec![1, 2],
                |rank| -> Result<(), Failed> {
                    if rank == 2 {
                        panic!("rank 2 panicked");
                    }
                    Ok(())
                },
                || -> Result<(), Failed> {
                    lead_ended.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                },
            )
        }));
        let panic = caught.expect_err("the worker's panic is re-raised");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"rank 2 panicked"));
        assert_eq!(lead_ended.load(Ordering::SeqCst), 1);
    }
}
