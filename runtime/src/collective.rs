//! Collectives between the ranks of a data-parallel run: the operations a sharded schedule
//! needs (all-gather of parameter shards, reduce-scatter of gradients, all-reduce of partial
//! squared norms and losses), behind one trait.
//!
//! The host backend issues them for a data-parallel schedule's collective stream: all-reduces
//! of replicated gradients, and for offloaded chunks sharded over the ranks (ZeRO-3 style) the
//! all-gather of each chunk's parameter slices before use and the reduce-scatter of its
//! gradients after their last backward use; the executor also gathers the shards when the
//! weights or the optimizer state are read.
//!
//! [`ThreadRank`] (made by [`thread_ranks`]) implements it for ranks that are threads of one process, exchanging through
//! shared memory. It is the host backend's collective and the test double for NCCL, in the
//! spirit of PyTorch's threaded process group for its own distributed tests: every rank runs
//! the same schedule code, only the transport differs. Its sums run in rank order from a
//! zero (`((0 + x0) + x1) + ...`, in f32), so results are deterministic and equal a single
//! rank's accumulation of the same gradients in the same order into a zeroed accumulator,
//! down to the sign of a zero sum. [`Collective::all_reduce_into`] starts the same chain from
//! the destination's value instead (`((acc + x0) + x1) + ...`): ranks that accumulate
//! micro-batches sum each micro-batch's gradients into their accumulators that way, so `W`
//! ranks of `A` micro-batches make the very sums one rank of `W * A` micro-batches makes.
//!
//! NCCL (the CUDA backend's collective) picks its own reduction order and promises none of
//! this: its `all_reduce_into` is the trait's default, an all-reduce into a temporary added
//! to the destination, deterministic for a topology but not a single rank's bits.
//!
//! Every rank must issue the same sequence of collectives with the same sizes; a rank that
//! issues a different one, leaves the group (its thread failed or returned), or does not
//! arrive within the group's timeout makes the collective fail on every other rank with an
//! error that says which rank and which collective, never a hang.

use crate::error::{Result, RuntimeError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The collectives a data-parallel executor uses. Reductions sum f32 values; gathers move
/// bytes, so any element type can be gathered.
pub trait Collective: Send {
    /// This rank, in `0..world()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// Every rank's `send`, concatenated in rank order into `recv`, which holds
    /// `world() * send.len()` bytes.
    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()>;

    /// The sum over ranks of `send` (`world() * recv.len()` values): rank `r` receives the
    /// sum of every rank's `r`-th slice.
    fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()>;

    /// The sum over ranks of `values`, written back into `values` on every rank.
    fn all_reduce(&mut self, values: &mut [f32]) -> Result<()>;

    /// `acc` plus the sum over ranks of `send` (as long as `acc`), on every rank: how ranks
    /// that accumulate micro-batches sum each one's gradients into their (equal) accumulators.
    ///
    /// The default all-reduces a copy of `send` and adds it to `acc`: `acc + (x0 + x1 + ...)`,
    /// which is not the bits of one rank accumulating the same gradients one by one;
    /// [`ThreadRank`] adds them to `acc` one by one in rank order, which is.
    fn all_reduce_into(&mut self, send: &[f32], acc: &mut [f32]) -> Result<()> {
        if send.len() != acc.len() {
            return Err(RuntimeError::Collective {
                rank: self.rank(),
                problem: format!(
                    "all_reduce_into of {} values into an accumulator of {}; the two must be \
                     as long; this is a bug in the executor's collective calls",
                    send.len(),
                    acc.len()
                ),
            });
        }
        let mut sum = send.to_vec();
        self.all_reduce(&mut sum)?;
        for (a, s) in acc.iter_mut().zip(sum) {
            *a += s;
        }
        Ok(())
    }
}

/// Which collective a rank issued, and its size in bytes, to check that all ranks agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    AllGather(usize),
    ReduceScatter(usize),
    AllReduce(usize),
    AllReduceInto(usize),
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Call::AllGather(n) => write!(f, "all_gather of {n} bytes"),
            Call::ReduceScatter(n) => write!(f, "reduce_scatter of {n} bytes"),
            Call::AllReduce(n) => write!(f, "all_reduce of {n} bytes"),
            Call::AllReduceInto(n) => write!(f, "all_reduce_into of {n} bytes"),
        }
    }
}

/// The shared state of one round: each rank deposits its input, and once all have, each reads
/// what it needs; the last to read opens the next round.
struct Round {
    /// Collectives completed by the group so far (the current one's index).
    index: u64,
    /// Each rank's call and input bytes in this round.
    inputs: Vec<Option<(Call, Arc<Vec<u8>>)>>,
    /// Which ranks have read this round's result.
    read: Vec<bool>,
    /// Ranks that have left the group.
    left: Vec<bool>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    round: Mutex<Round>,
    changed: Condvar,
}

/// Ranks as threads of one process: one [`ThreadRank`] per rank of a group of `world` ranks,
/// each to be moved into its own thread. A collective that waits longer than `timeout` for the
/// other ranks fails.
pub fn thread_ranks(world: usize, timeout: Duration) -> Result<Vec<ThreadRank>> {
    if world == 0 {
        return Err(RuntimeError::Collective {
            rank: 0,
            problem: "a group needs at least one rank".into(),
        });
    }
    let shared = Arc::new(Shared {
        world,
        timeout,
        round: Mutex::new(Round {
            index: 0,
            inputs: vec![None; world],
            read: vec![false; world],
            left: vec![false; world],
        }),
        changed: Condvar::new(),
    });
    Ok((0..world)
        .map(|rank| ThreadRank {
            rank,
            shared: Arc::clone(&shared),
        })
        .collect())
}

/// One rank of a group made by [`thread_ranks`]. Dropping it (its thread returned or failed)
/// tells the other ranks, whose next collective fails instead of waiting for it.
pub struct ThreadRank {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadRank {
    /// Locks the round, recovering it if another rank panicked while holding the lock (the
    /// state is only read and written in whole steps, so it stays consistent).
    fn lock(&self) -> MutexGuard<'_, Round> {
        self.shared
            .round
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn fail(&self, problem: String) -> RuntimeError {
        RuntimeError::Collective {
            rank: self.rank,
            problem,
        }
    }

    /// Waits on the condition variable until `ready` holds, failing when a rank that `ready`
    /// still waits for has left, or when the timeout passes.
    fn wait_until<'a>(
        &self,
        mut round: MutexGuard<'a, Round>,
        what: &str,
        ready: impl Fn(&Round) -> bool,
        missing: impl Fn(&Round) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, Round>> {
        let deadline = Instant::now() + self.shared.timeout;
        while !ready(&round) {
            let gone: Vec<usize> = missing(&round)
                .into_iter()
                .filter(|&r| round.left[r])
                .collect();
            if !gone.is_empty() {
                return Err(self.fail(format!(
                    "rank {} left the group (its worker failed or returned) before {what} \
                     #{}; see that rank's error",
                    list(&gone),
                    round.index
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.fail(format!(
                    "rank {} did not reach {what} #{} within {:.1} s; a rank is stuck or \
                     issues a different sequence of collectives",
                    list(&missing(&round)),
                    round.index,
                    self.shared.timeout.as_secs_f64()
                )));
            }
            round = self
                .shared
                .changed
                .wait_timeout(round, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        Ok(round)
    }

    /// Runs one round: deposits `input`, waits for every rank's, checks that all issued the
    /// same call, and returns every rank's input in rank order.
    fn exchange(&self, call: Call, input: Vec<u8>) -> Result<Vec<Arc<Vec<u8>>>> {
        let world = self.shared.world;
        let round = self.lock();
        // The previous round is over once every rank has read it.
        let mut round = self.wait_until(
            round,
            "the end of the previous collective",
            |r| r.inputs[self.rank].is_none(),
            |r| {
                (0..world)
                    .filter(|&i| r.inputs[i].is_some() && !r.read[i])
                    .collect()
            },
        )?;
        round.inputs[self.rank] = Some((call, Arc::new(input)));
        self.shared.changed.notify_all();
        let mut round = self.wait_until(
            round,
            "collective",
            |r| r.inputs.iter().all(Option::is_some),
            |r| (0..world).filter(|&i| r.inputs[i].is_none()).collect(),
        )?;
        let index = round.index;
        let mismatch = round
            .inputs
            .iter()
            .enumerate()
            .find_map(|(r, i)| i.as_ref().filter(|(c, _)| *c != call).map(|(c, _)| (r, *c)));
        let inputs: Vec<Arc<Vec<u8>>> = round
            .inputs
            .iter()
            .map(|i| Arc::clone(&i.as_ref().expect("every rank deposited").1))
            .collect();
        round.read[self.rank] = true;
        if round.read.iter().all(|&r| r) {
            round.inputs.iter_mut().for_each(|i| *i = None);
            round.read.iter_mut().for_each(|r| *r = false);
            round.index += 1;
            self.shared.changed.notify_all();
        }
        drop(round);
        if let Some((other, theirs)) = mismatch {
            return Err(self.fail(format!(
                "collective #{index}: this rank issued {call} but rank {other} issued {theirs}; \
                 every rank must run the same schedule"
            )));
        }
        Ok(inputs)
    }
}

impl Drop for ThreadRank {
    fn drop(&mut self) {
        let mut round = self.lock();
        round.left[self.rank] = true;
        self.shared.changed.notify_all();
    }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let world = self.shared.world;
        if recv.len() != world * send.len() {
            return Err(self.fail(format!(
                "all_gather of {} bytes from each of {world} ranks needs {} bytes to receive \
                 into, not {}",
                send.len(),
                world * send.len(),
                recv.len()
            )));
        }
        let inputs = self.exchange(Call::AllGather(send.len()), send.to_vec())?;
        for (part, input) in recv.chunks_exact_mut(send.len().max(1)).zip(&inputs) {
            part.copy_from_slice(input);
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let world = self.shared.world;
        if send.len() != world * recv.len() {
            return Err(self.fail(format!(
                "reduce_scatter of {} values over {world} ranks gives each {} values, but \
                 {} were asked for",
                send.len(),
                send.len() / world,
                recv.len()
            )));
        }
        let inputs = self.exchange(Call::ReduceScatter(send.len() * 4), to_bytes(send))?;
        let start = self.rank * recv.len();
        recv.fill(0.0);
        sum_in_rank_order(&inputs, start, recv);
        Ok(())
    }

    fn all_reduce(&mut self, values: &mut [f32]) -> Result<()> {
        let inputs = self.exchange(Call::AllReduce(values.len() * 4), to_bytes(values))?;
        values.fill(0.0);
        sum_in_rank_order(&inputs, 0, values);
        Ok(())
    }

    fn all_reduce_into(&mut self, send: &[f32], acc: &mut [f32]) -> Result<()> {
        if send.len() != acc.len() {
            return Err(self.fail(format!(
                "all_reduce_into of {} values into an accumulator of {}; the two must be as \
                 long; this is a bug in the executor's collective calls",
                send.len(),
                acc.len()
            )));
        }
        let inputs = self.exchange(Call::AllReduceInto(send.len() * 4), to_bytes(send))?;
        sum_in_rank_order(&inputs, 0, acc);
        Ok(())
    }
}

/// `out[i]` += element `start + i` of each rank's input, added one by one in rank order:
/// `((out + x0) + x1) + ...` in f32. Plain sums start from a zeroed `out`, as a zeroed
/// accumulator does (so a sum of negative zeros is +0, as one rank accumulating them gets).
fn sum_in_rank_order(inputs: &[Arc<Vec<u8>>], start: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        let at = 4 * (start + i);
        for input in inputs {
            *o += f32_at(input, at);
        }
    }
}

fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes(bytes[at..at + 4].try_into().expect("four bytes"))
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `1`, `1 and 3`, `1, 2 and 3`.
fn list(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match names.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    const TIMEOUT: Duration = Duration::from_secs(10);

    /// Runs `body` on every rank of a group of `world` threads; each rank's result, by rank.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        timeout: Duration,
        body: impl Fn(ThreadRank) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let body = Arc::new(body);
        let handles: Vec<_> = thread_ranks(world, timeout)
            .expect("a group")
            .into_iter()
            .map(|rank| {
                let body = Arc::clone(&body);
                thread::spawn(move || body(rank))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    /// Rank `r`'s values: distinct per rank and position, with magnitudes far apart so that
    /// the summation order shows in the f32 result.
    fn values(rank: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match (rank + i) % 3 {
                0 => 1.0e8 + i as f32,
                1 => -1.0e8 + rank as f32,
                _ => 0.3 * (rank * n + i) as f32 + 1.0e-3,
            })
            .collect()
    }

    /// The plain reference: the sum of element `i` over ranks 0, 1, ... in order, from 0.
    fn reference_sum(world: usize, n: usize) -> Vec<f32> {
        reference_into(world, &vec![0.0; n])
    }

    /// `acc[i]` plus element `i` of every rank's values, added one by one in rank order.
    fn reference_into(world: usize, acc: &[f32]) -> Vec<f32> {
        let all: Vec<Vec<f32>> = (0..world).map(|r| values(r, acc.len())).collect();
        acc.iter()
            .enumerate()
            .map(|(i, &a)| all.iter().fold(a, |sum, v| sum + v[i]))
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn all_gather_concatenates_every_rank_in_rank_order() {
        for world in [1, 2, 4] {
            let results = on_ranks(world, TIMEOUT, move |mut c| {
                let send: Vec<u8> = (0..5).map(|i| (c.rank() * 10 + i) as u8).collect();
                let mut recv = vec![0u8; 5 * c.world()];
                c.all_gather(&send, &mut recv).expect("all_gather");
                recv
            });
            let expected: Vec<u8> = (0..world)
                .flat_map(|r| (0..5).map(move |i| (r * 10 + i) as u8))
                .collect();
            for recv in results {
                assert_eq!(recv, expected, "world {world}");
            }
        }
    }

    #[test]
    fn all_reduce_sums_in_rank_order_bit_for_bit() {
        for world in [1, 2, 3, 4] {
            let results = on_ranks(world, TIMEOUT, |mut c| {
                let mut v = values(c.rank(), 12);
                c.all_reduce(&mut v).expect("all_reduce");
                v
            });
            let expected = bits(&reference_sum(world, 12));
            for v in results {
                assert_eq!(bits(&v), expected, "world {world}");
            }
        }
    }

    /// Each rank's accumulator, the same on every rank: magnitudes that make the order of the
    /// additions show.
    fn accumulator(n: usize) -> Vec<f32> {
        (0..n).map(|i| 3.0e7 - 0.7 * i as f32).collect()
    }

    #[test]
    fn all_reduce_into_adds_every_rank_to_the_accumulator_one_by_one_in_rank_order() {
        for world in [1, 2, 3, 4] {
            let results = on_ranks(world, TIMEOUT, |mut c| {
                let send = values(c.rank(), 12);
                let mut acc = accumulator(12);
                c.all_reduce_into(&send, &mut acc).expect("all_reduce_into");
                acc
            });
            let expected = bits(&reference_into(world, &accumulator(12)));
            for acc in results {
                assert_eq!(bits(&acc), expected, "world {world}");
            }
            // Adding the sum of the ranks to the accumulator instead (what the trait's
            // default does, as NCCL must) gives other bits: the order shows.
            if world > 1 {
                let sum = reference_sum(world, 12);
                let after: Vec<f32> = accumulator(12)
                    .iter()
                    .zip(&sum)
                    .map(|(a, s)| a + s)
                    .collect();
                assert_ne!(
                    bits(&after),
                    expected,
                    "world {world}: the order never showed"
                );
            }
        }
    }

    #[test]
    fn the_default_all_reduce_into_adds_the_sum_to_the_accumulator() {
        /// A collective with only an all-reduce of its own: the trait's default `into`.
        struct Plain(ThreadRank);
        impl Collective for Plain {
            fn rank(&self) -> usize {
                self.0.rank()
            }
            fn world(&self) -> usize {
                self.0.world()
            }
            fn all_gather(&mut self, send: &[u8], recv: &mut [u8]) -> Result<()> {
                self.0.all_gather(send, recv)
            }
            fn reduce_scatter(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
                self.0.reduce_scatter(send, recv)
            }
            fn all_reduce(&mut self, values: &mut [f32]) -> Result<()> {
                self.0.all_reduce(values)
            }
        }
        let results = on_ranks(2, TIMEOUT, |c| {
            let mut c = Plain(c);
            let mut acc = accumulator(12);
            c.all_reduce_into(&values(c.rank(), 12), &mut acc)
                .expect("all_reduce_into");
            let err = c
                .all_reduce_into(&[1.0; 3], &mut [0.0; 2])
                .expect_err("3 values into 2");
            assert!(err.to_string().contains("as long"), "{err}");
            acc
        });
        let sum = reference_sum(2, 12);
        let after: Vec<f32> = accumulator(12)
            .iter()
            .zip(&sum)
            .map(|(a, s)| a + s)
            .collect();
        for acc in results {
            assert_eq!(bits(&acc), bits(&after));
        }
    }

    /// A zeroed accumulator that one rank adds `-0.0` to twice holds `+0.0`; ranks summing
    /// `-0.0` each get the same, not rank 0's `-0.0`.
    #[test]
    fn a_sum_of_negative_zeros_is_the_positive_zero_a_zeroed_accumulator_holds() {
        let single = (0.0f32 + -0.0) + -0.0;
        let results = on_ranks(2, TIMEOUT, |mut c| {
            let mut v = vec![-0.0f32; 2];
            c.all_reduce(&mut v).expect("all_reduce");
            let mut recv = vec![-0.0f32; 1];
            c.reduce_scatter(&[-0.0; 2], &mut recv)
                .expect("reduce_scatter");
            (v, recv)
        });
        for (v, recv) in results {
            assert_eq!(bits(&v), bits(&[single; 2]));
            assert_eq!(bits(&recv), bits(&[single]));
        }
    }

    #[test]
    fn reduce_scatter_gives_each_rank_its_slice_of_the_rank_order_sum() {
        for world in [1, 2, 4] {
            let n = 3 * world;
            let results = on_ranks(world, TIMEOUT, move |mut c| {
                let send = values(c.rank(), n);
                let mut recv = vec![0.0f32; 3];
                c.reduce_scatter(&send, &mut recv).expect("reduce_scatter");
                recv
            });
            let expected = reference_sum(world, n);
            for (rank, recv) in results.iter().enumerate() {
                assert_eq!(
                    bits(recv),
                    bits(&expected[3 * rank..3 * rank + 3]),
                    "world {world} rank {rank}"
                );
            }
        }
    }

    #[test]
    fn many_collectives_in_a_row_stay_in_step() {
        let results = on_ranks(4, TIMEOUT, |mut c| {
            let mut total = Vec::new();
            for step in 0..50 {
                let mut v = vec![(c.rank() + step) as f32];
                c.all_reduce(&mut v).expect("all_reduce");
                total.push(v[0]);
                let mut recv = vec![0u8; c.world()];
                c.all_gather(&[c.rank() as u8], &mut recv).expect("gather");
                assert_eq!(recv, [0, 1, 2, 3]);
            }
            total
        });
        let expected: Vec<f32> = (0..50).map(|s| (6 + 4 * s) as f32).collect();
        for total in results {
            assert_eq!(total, expected);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_promptly_and_names_it() {
        let started = Instant::now();
        let results = on_ranks(3, Duration::from_secs(30), |mut c| {
            if c.rank() == 1 {
                return None; // the worker "fails": its handle is dropped
            }
            let mut v = vec![1.0f32];
            Some(
                c.all_reduce(&mut v)
                    .expect_err("rank 1 is gone")
                    .to_string(),
            )
        });
        assert!(started.elapsed() < Duration::from_secs(10), "it waited");
        for (rank, err) in results.into_iter().enumerate() {
            if rank == 1 {
                continue;
            }
            let err = err.expect("an error");
            assert!(err.contains("rank 1 left the group"), "rank {rank}: {err}");
        }
    }

    #[test]
    fn a_rank_that_never_arrives_times_out_with_an_error() {
        let results = on_ranks(2, Duration::from_millis(300), |mut c| {
            if c.rank() == 1 {
                thread::sleep(Duration::from_secs(2));
                return None;
            }
            let mut v = vec![1.0f32];
            Some(
                c.all_reduce(&mut v)
                    .expect_err("rank 1 is late")
                    .to_string(),
            )
        });
        let err = results[0].as_ref().expect("rank 0 failed");
        assert!(err.contains("rank 1 did not reach collective #0"), "{err}");
    }

    #[test]
    fn ranks_issuing_different_collectives_fail_instead_of_mixing_them() {
        let results = on_ranks(2, TIMEOUT, |mut c| {
            if c.rank() == 0 {
                let mut v = vec![1.0f32; 2];
                c.all_reduce(&mut v).map_err(|e| e.to_string())
            } else {
                let mut recv = vec![0u8; 8];
                c.all_gather(&[1, 2, 3, 4], &mut recv)
                    .map_err(|e| e.to_string())
            }
        });
        for r in results {
            let err = r.expect_err("the calls differ");
            assert!(
                err.contains("every rank must run the same schedule"),
                "{err}"
            );
        }
    }

    #[test]
    fn wrong_buffer_sizes_are_refused_before_any_exchange() {
        let mut ranks = thread_ranks(2, TIMEOUT).expect("group");
        let err = ranks[0]
            .all_gather(&[1, 2], &mut [0u8; 3])
            .expect_err("3 is not 2 x 2");
        assert!(err.to_string().contains("needs 4 bytes"), "{err}");
        let err = ranks[0]
            .reduce_scatter(&[1.0; 5], &mut [0.0; 2])
            .expect_err("5 is not 2 x 2");
        assert!(
            err.to_string().contains("reduce_scatter of 5 values"),
            "{err}"
        );
        assert!(thread_ranks(0, TIMEOUT).is_err());
    }
}
