//! The shares of its rate the host optimizer keeps beside the compute kernels and the copies
//! (`HardwareProfile::cpu_adam_compute_share`, `cpu_adam_copy_share`,
//! `cpu_adam_compute_copy_share`).
//!
//! On the host backend the CPU Adam runs on the optimizer stream's thread and a thread pool of
//! its own, as many threads as the compute kernels' pool, on the same cores; each copy is a
//! `memcpy` on its stream's thread. The operating system's fair scheduler would give the Adam
//! and the kernels half the machine each; the Adam, which streams its state from memory while
//! the kernels' working sets and the copies evict what it has cached and take the memory's
//! bandwidth, and which gets the cores the kernels leave idle between their parallel parts,
//! may measure less or more than that. So the profile times it beside the graph's own backward
//! kernels, beside the backend's own copies, and beside both.

use super::{median, AdamOps, InPlaceGraph, RunAdamW};
use crate::backend::{Address, Backend};
use crate::error::{Result, RuntimeError};
use protrain_ir::{Graph, Phase, Space, StreamKind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// The least share [`measure_adam_shares`] reports: below it a measurement says more of the
/// machine's noise than of the Adam.
pub const MIN_SHARE: f64 = 0.05;

/// The longest the measurement waits for a loop to make ready or to pause: a pass of a graph
/// the profiler can time in place, or one copy, takes far less.
const PATIENCE: Duration = Duration::from_secs(600);

/// The shares of its rate a run of AdamW ops keeps beside other work on the same cores, each
/// within [[`MIN_SHARE`], 1]; `None` where there was nothing to measure beside.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MeasuredShares {
    /// Beside the graph's backward kernels running in a loop.
    pub compute: Option<f64>,
    /// Beside the backend's copies running in a loop.
    pub copy: Option<f64>,
    /// Beside both loops at once.
    pub compute_and_copy: Option<f64>,
}

/// The shares of its rate a run of `graph`'s AdamW ops keeps while the graph's backward
/// kernels, a copy of `copy_bytes`, or both run beside it on backend `B`. One thread runs the
/// graph in place once ([`InPlaceGraph`]) and then its backward ops in a loop, as the compute
/// stream runs them while the host optimizer updates the chunks whose gradients are done;
/// another copies `copy_bytes` from host to device and back in a loop through the backend, as
/// the copy streams offload gradients and prefetch chunks meanwhile. This thread times one
/// Adam step over `params` f32 parameters, cut as the graph's AdamW ops (`sizes`,
/// [`super::adam_sizes`]) and handed to `run` as the executor hands a host optimizer's run to
/// its backend ([`Backend::run_host_adamw`]), `repeats` times with every loop paused and as
/// many with the measured loops running, alternately (one untimed pair first), for each of the
/// three. Each share is the ratio of the medians, alone over beside.
///
/// All `None` where there is no AdamW op in `sizes`; the two beside compute `None` where the
/// graph has no backward op. Fails when the graph cannot be laid out, the copies' buffers
/// cannot be made, or a kernel or a copy fails.
pub fn measure_adam_shares<B: Backend>(
    graph: &Graph,
    sizes: &[usize],
    params: usize,
    copy_bytes: u64,
    repeats: usize,
    run: &RunAdamW<'_>,
) -> Result<MeasuredShares> {
    let backward: Vec<usize> = graph
        .ops()
        .enumerate()
        .filter(|(_, (_, op))| op.phase == Phase::Backward)
        .map(|(i, _)| i)
        .collect();
    let mut state = AdamOps::cut(sizes, params);
    if state.parts.is_empty() {
        return Ok(MeasuredShares::default());
    }
    beside_loops::<B, _>(graph, &backward, copy_bytes, |loops| {
        let mut share = |beside: &[&Loop<'_>]| -> Result<Option<f64>> {
            if beside.is_empty() {
                return Ok(None);
            }
            let (mut alone, mut next_to) = time_both(&mut state, run, repeats, beside)?;
            let share = median(&mut alone) / median(&mut next_to);
            Ok(Some(match share.is_finite() {
                true => share.clamp(MIN_SHARE, 1.0),
                false => 1.0,
            }))
        };
        let compute: Vec<&Loop<'_>> = loops.compute.iter().collect();
        let both: Vec<&Loop<'_>> = loops.compute.iter().chain([&loops.copy]).collect();
        Ok(MeasuredShares {
            compute: share(&compute)?,
            copy: share(&[&loops.copy])?,
            compute_and_copy: match loops.compute {
                Some(_) => share(&both)?,
                None => None,
            },
        })
    })
}

/// A loop running on a thread of its own beside the timed Adam.
struct Loop<'a> {
    control: &'a Control,
    thread: Thread,
}

/// The loops [`beside_loops`] runs: the backward ops' (where the graph has any) and the
/// copies'.
struct Loops<'a> {
    compute: Option<Loop<'a>>,
    copy: Loop<'a>,
}

/// Runs `body` while one thread runs [`compute_loop`] over `graph`'s `backward` ops (none
/// where there are none) and another [`copy_loop`] of `copy_bytes`, both made ready first and
/// paused until `body` resumes them; then stops the loops and waits for them. A loop's failure is the error (the
/// cause of any failure of `body` to time beside it); else `body`'s result.
fn beside_loops<B: Backend, T>(
    graph: &Graph,
    backward: &[usize],
    copy_bytes: u64,
    body: impl FnOnce(&Loops<'_>) -> Result<T>,
) -> Result<T> {
    let computing = Control::paused("the compute loop");
    let copying = Control::paused("the copy loop");
    std::thread::scope(|scope| {
        let compute = (!backward.is_empty()).then(|| {
            scope.spawn(|| {
                let _exit = Exit(&computing);
                compute_loop::<B>(graph, backward, &computing)
            })
        });
        let copy = scope.spawn(|| {
            let _exit = Exit(&copying);
            copy_loop::<B>(copy_bytes, &copying)
        });
        let loops = Loops {
            compute: compute.as_ref().map(|c| Loop {
                control: &computing,
                thread: c.thread().clone(),
            }),
            copy: Loop {
                control: &copying,
                thread: copy.thread().clone(),
            },
        };
        // Every loop made ready (and paused) first: none sets up beside a timed Adam.
        let out = loops
            .compute
            .iter()
            .chain([&loops.copy])
            .try_for_each(|l| l.control.await_ready())
            .and_then(|()| body(&loops));
        let mut ended = Ok(());
        for (control, handle) in [(&computing, compute), (&copying, Some(copy))] {
            let Some(handle) = handle else { continue };
            control.stop.store(true, Ordering::Release);
            handle.thread().unpark();
            let result = handle.join().map_err(|_| {
                RuntimeError::Profile(format!("{} beside the CPU Adam panicked", control.what))
            });
            if ended.is_ok() {
                ended = result.and_then(|r| r);
            }
        }
        ended?;
        out
    })
}

/// The Adam step's seconds with every loop paused and with the loops of `beside` running,
/// `repeats` of each after one untimed pair; the loops are paused again at the end.
fn time_both(
    state: &mut AdamOps,
    run: &RunAdamW<'_>,
    repeats: usize,
    beside: &[&Loop<'_>],
) -> Result<(Vec<f64>, Vec<f64>)> {
    for l in beside {
        l.control.await_ready()?;
    }
    let (mut alone, mut next_to) = (Vec::new(), Vec::new());
    for step in 1..=repeats.max(1) as u64 + 1 {
        for l in beside {
            l.control.pause()?;
        }
        let a = state.time(run, step, false);
        for l in beside {
            l.control.resume(&l.thread)?;
        }
        let b = state.time(run, step, false);
        if step > 1 {
            alone.push(a);
            next_to.push(b);
        }
    }
    for l in beside {
        l.control.pause()?;
    }
    Ok((alone, next_to))
}

/// Runs `graph` in place once, then its `backward` ops in a loop until told to stop.
fn compute_loop<B: Backend>(graph: &Graph, backward: &[usize], control: &Control) -> Result<()> {
    let mut in_place = InPlaceGraph::<B>::new(graph)?;
    for op in 0..graph.op_count() {
        in_place.run(op, 1)?;
    }
    let mut at = 0;
    let mut step = 2u64;
    control.run(|| {
        in_place.run(backward[at], step)?;
        at += 1;
        if at == backward.len() {
            (at, step) = (0, step + 1);
        }
        Ok(())
    })
}

/// Copies `bytes` from host to device memory and back, one copy at a time through the
/// backend's copy stream, until told to stop.
fn copy_loop<B: Backend>(bytes: u64, control: &Control) -> Result<()> {
    let bytes = bytes.max(1);
    let mut backend = B::new(bytes, bytes, 0)?;
    let mut stream = backend.create_stream(StreamKind::HostToDevice)?;
    let (device, host) = (
        Address {
            space: Space::Device,
            offset: 0,
        },
        Address {
            space: Space::Host,
            offset: 0,
        },
    );
    // Every page touched first, so the loop's copies do not pay for first-touch faults.
    backend.fill_zero(device, bytes)?;
    backend.fill_zero(host, bytes)?;
    let mut up = true;
    control.run(|| {
        let (src, dst) = if up { (host, device) } else { (device, host) };
        up = !up;
        // SAFETY: one stream, one thread; source and destination are distinct regions of
        // `bytes` each.
        unsafe { backend.copy(&mut stream, src, dst, bytes)? };
        backend.synchronize(&mut stream)
    })
}

/// What the timing thread and a loop tell each other.
struct Control {
    /// The loop, for messages.
    what: &'static str,
    /// The loop has made ready and can run its work.
    ready: AtomicBool,
    /// The loop is asked to pause before its next piece of work.
    pause: AtomicBool,
    /// The loop is paused (set by the loop).
    paused: AtomicBool,
    /// The loop is asked to end.
    stop: AtomicBool,
    /// The loop has ended (set as its thread leaves, however it leaves).
    exited: AtomicBool,
    /// Pieces of work (backward ops, copies) the loop has done.
    done: AtomicUsize,
}

impl Control {
    /// A loop asked to pause from the start.
    fn paused(what: &'static str) -> Self {
        Self {
            what,
            ready: AtomicBool::new(false),
            pause: AtomicBool::new(true),
            paused: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            exited: AtomicBool::new(false),
            done: AtomicUsize::new(0),
        }
    }

    /// The loop's side, once made ready: does `work` again and again until told to stop,
    /// pausing between two pieces while asked to. A paused loop sleeps until unparked
    /// ([`Control::resume`], or the stop): a loop that woke to poll would take a core from
    /// the timed Adam at each wake-up, on a machine whose cores the Adam and the other loop
    /// already oversubscribe (polling every millisecond, the share beside compute measured
    /// about a tenth lower).
    fn run(&self, mut work: impl FnMut() -> Result<()>) -> Result<()> {
        self.ready.store(true, Ordering::Release);
        loop {
            while self.pause.load(Ordering::Acquire) {
                self.paused.store(true, Ordering::Release);
                if self.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                std::thread::park();
            }
            self.paused.store(false, Ordering::Release);
            if self.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            work()?;
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Waits until the loop has made ready.
    fn await_ready(&self) -> Result<()> {
        self.await_loop(|c| c.ready.load(Ordering::Acquire))
    }

    /// Asks the loop to pause and waits until it is paused between two pieces of work.
    fn pause(&self) -> Result<()> {
        self.pause.store(true, Ordering::Release);
        self.await_loop(|c| c.paused.load(Ordering::Acquire))
    }

    /// Lets the loop go on and waits until it works again.
    fn resume(&self, looping: &Thread) -> Result<()> {
        self.pause.store(false, Ordering::Release);
        looping.unpark();
        self.await_loop(|c| !c.paused.load(Ordering::Acquire))
    }

    /// Waits until `done` holds; fails when the loop has ended instead, or takes longer than
    /// [`PATIENCE`].
    fn await_loop(&self, done: impl Fn(&Self) -> bool) -> Result<()> {
        let began = Instant::now();
        while !done(self) {
            if self.exited.load(Ordering::Acquire) {
                return Err(RuntimeError::Profile(format!(
                    "{} beside the CPU Adam ended early",
                    self.what
                )));
            }
            if began.elapsed() > PATIENCE {
                return Err(RuntimeError::Profile(format!(
                    "{} beside the CPU Adam did not answer in {} s",
                    self.what,
                    PATIENCE.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
}

/// Marks the loop ended when its thread leaves.
struct Exit<'a>(&'a Control);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        self.0.exited.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::AdamWStep;
    use protrain_ir::{BlockKind, DType, GraphInfo, OpKind, Role, TensorType, WeightLayout};
    use std::sync::Mutex;

    /// An embedding and a linear layer, the second marked as the backward pass when
    /// `backward`: what the loop runs is the phase's ops, whatever their kinds.
    fn graph(backward: bool) -> Graph {
        let mut g = Graph::new(GraphInfo {
            model: "adam-share-test".into(),
            batch: 2,
            seq: 8,
        });
        let block = g.add_block("model", BlockKind::Embedding);
        let tokens = g.add_input("tokens", TensorType::new([2, 8], DType::I32));
        let wte = g.add_param("wte", vec![32, 64], DType::F32, block);
        let fc = g.add_param("fc.weight", vec![64, 64], DType::F32, block);
        let (wte, fc) = (g.param(wte).value, g.param(fc).value);
        let h = g
            .add_op(
                OpKind::Embedding { padding_idx: None },
                &[tokens, wte],
                "h",
                Role::Activation,
                block,
                Phase::Forward,
            )
            .unwrap();
        let phase = if backward {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let linear = OpKind::Linear {
            bias: false,
            layout: WeightLayout::InOut,
        };
        g.add_op(linear, &[h, fc], "y", Role::Activation, block, phase)
            .unwrap();
        g
    }

    /// The run path of the host backend's optimizer, counting its calls.
    fn direct(calls: &AtomicUsize) -> impl Fn(Vec<AdamWStep<'_>>, &(dyn Fn(usize) + Sync)) + '_ {
        move |steps, ended| {
            calls.fetch_add(1, Ordering::Relaxed);
            crate::host::HostBackend::new(256, 0, 0)
                .unwrap()
                .run_host_adamw(steps, ended)
        }
    }

    /// The Adam is timed alternately with the loops paused between two pieces of work (none
    /// runs while it is timed) and with the measured loops running, one untimed pair first;
    /// a loop not measured stays paused, and both have ended when the measurement returns.
    #[test]
    fn the_adam_is_timed_alone_with_the_loops_paused_and_beside_them_running() {
        let g = graph(true);
        let mut state = AdamOps::cut(&[1000, 24], 1 << 14);
        let ran = beside_loops::<crate::host::HostBackend, _>(&g, &[1], 1 << 16, |loops| {
            let compute = loops.compute.as_ref().expect("a backward op to loop over");
            let done = |l: &Loop<'_>| l.control.done.load(Ordering::Acquire);
            for (measured, idle) in [(compute, &loops.copy), (&loops.copy, compute)] {
                let seen: Mutex<Vec<(bool, usize, usize, usize)>> = Mutex::new(Vec::new());
                let run = |steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)| {
                    let (before, idle_before) = (done(measured), done(idle));
                    let paused = measured.control.paused.load(Ordering::Acquire);
                    crate::kernels::adamw_steps_fused(steps, ended);
                    seen.lock().unwrap().push((
                        paused,
                        before,
                        done(measured),
                        done(idle) - idle_before,
                    ));
                };
                let (alone, beside) = time_both(&mut state, &run, 3, &[measured])?;
                assert_eq!((alone.len(), beside.len()), (3, 3));
                let seen = seen.into_inner().unwrap();
                assert_eq!(seen.len(), 8, "an untimed pair and three timed: {seen:?}");
                for (i, &(paused, before, after, idle_ran)) in seen.iter().enumerate() {
                    assert_eq!(paused, i % 2 == 0, "call {i}: {seen:?}");
                    if paused {
                        assert_eq!(before, after, "work ran beside the lone Adam: {seen:?}");
                    }
                    assert_eq!(idle_ran, 0, "the loop not measured ran: {seen:?}");
                }
                assert!(measured.control.paused.load(Ordering::Acquire));
            }
            Ok((done(compute), done(&loops.copy)))
        })
        .unwrap();
        assert!(ran.0 > 0, "the compute loop ran no backward op");
        assert!(ran.1 > 0, "the copy loop made no copy");
    }

    /// Shares within [`MIN_SHARE`, 1] from the host backend, each Adam step handed to the run
    /// path; all `None` (nothing run) without an AdamW op, and only the copy's without a
    /// backward op.
    #[test]
    fn the_shares_are_measured_where_the_adam_has_work_beside_it() {
        let calls = AtomicUsize::new(0);
        let run = direct(&calls);
        let measure = |g: &Graph, sizes: &[usize]| {
            measure_adam_shares::<crate::host::HostBackend>(g, sizes, 1 << 16, 1 << 16, 2, &run)
                .unwrap()
        };
        let shares = measure(&graph(true), &[4096, 100]);
        for share in [shares.compute, shares.copy, shares.compute_and_copy] {
            let share = share.expect("a share");
            assert!((MIN_SHARE..=1.0).contains(&share), "{share}");
        }
        assert_eq!(calls.load(Ordering::Relaxed), 3 * 6);
        assert_eq!(measure(&graph(true), &[]), MeasuredShares::default());
        assert_eq!(calls.load(Ordering::Relaxed), 3 * 6);
        let copy_only = measure(&graph(false), &[4096]);
        assert_eq!(
            (copy_only.compute, copy_only.compute_and_copy),
            (None, None)
        );
        assert!(copy_only.copy.is_some());
        assert_eq!(calls.load(Ordering::Relaxed), 4 * 6);
    }

    /// A loop that cannot make ready is the measurement's error, named for the loop's own
    /// cause, not a wait that never ends.
    #[test]
    fn a_loop_that_fails_is_the_error() {
        let calls = AtomicUsize::new(0);
        let run = direct(&calls);
        let err = measure_adam_shares::<crate::host::HostBackend>(
            &graph(true),
            &[4096],
            1 << 16,
            u64::MAX,
            2,
            &run,
        )
        .unwrap_err();
        // The copy loop's own failure (no room for its buffers), not the wait's.
        assert!(!matches!(err, RuntimeError::Profile(_)), "{err}");
    }
}
