//! The share of its rate the host optimizer keeps beside the compute kernels
//! (`HardwareProfile::cpu_adam_compute_share`).
//!
//! On the host backend the CPU Adam runs on the optimizer stream's thread and a thread pool of
//! its own, as many threads as the compute kernels' pool, on the same cores. The operating
//! system's fair scheduler would give each side half the machine; the Adam, which streams its
//! state from memory while the kernels' working sets evict what it has cached, and which gets
//! the cores the kernels leave idle between their parallel parts, may measure less or more
//! than that. So the profile times it beside the graph's own backward kernels.

use super::{median, AdamOps, InPlaceGraph, RunAdamW};
use crate::backend::Backend;
use crate::error::{Result, RuntimeError};
use protrain_ir::{Graph, Phase};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// The least share [`measure_adam_compute_share`] reports: below it a measurement says more of
/// the machine's noise than of the Adam.
pub const MIN_SHARE: f64 = 0.05;

/// The longest the measurement waits for the compute loop to make its first pass or to
/// pause: a pass of a graph the profiler can time in place takes far less.
const PATIENCE: Duration = Duration::from_secs(600);

/// The share of its rate a run of `graph`'s AdamW ops keeps while the graph's backward
/// kernels run beside it on backend `B`: a thread runs the graph in place once
/// ([`InPlaceGraph`]) and then its backward ops in a loop, as the compute stream runs them
/// while the host optimizer updates the chunks whose gradients are done; meanwhile this thread
/// times one Adam step over `params` f32 parameters, cut as the graph's AdamW ops
/// (`sizes`, [`super::adam_sizes`]) and handed to `run` as the executor hands a host
/// optimizer's run reaches its backend ([`Backend::run_host_adamw`]), `repeats` times with the
/// loop paused and as many with it running, alternately (one untimed pair first). The ratio of
/// the medians, alone over beside, within [[`MIN_SHARE`], 1].
///
/// `None` where there is nothing to share: no AdamW op in `sizes` or no backward op in the
/// graph. Fails when the graph cannot be laid out or a kernel fails.
pub fn measure_adam_compute_share<B: Backend>(
    graph: &Graph,
    sizes: &[usize],
    params: usize,
    repeats: usize,
    run: &RunAdamW<'_>,
) -> Result<Option<f64>> {
    let backward: Vec<usize> = graph
        .ops()
        .enumerate()
        .filter(|(_, (_, op))| op.phase == Phase::Backward)
        .map(|(i, _)| i)
        .collect();
    let mut state = AdamOps::cut(sizes, params);
    if state.parts.is_empty() || backward.is_empty() {
        return Ok(None);
    }
    let (mut alone, mut beside) = beside_loop::<B, _>(graph, &backward, |control, looping| {
        time_both(&mut state, run, repeats, control, looping)
    })?;
    let share = median(&mut alone) / median(&mut beside);
    Ok(Some(if share.is_finite() {
        share.clamp(MIN_SHARE, 1.0)
    } else {
        1.0
    }))
}

/// Runs `body` while a thread runs [`compute_loop`] over `graph`'s `backward` ops, then stops
/// the loop and waits for it. A kernel's failure in the loop is the error (the cause of any
/// failure of `body` to time beside it); else `body`'s result.
fn beside_loop<B: Backend, T>(
    graph: &Graph,
    backward: &[usize],
    body: impl FnOnce(&Control, &Thread) -> Result<T>,
) -> Result<T> {
    let control = Control::default();
    std::thread::scope(|scope| {
        let looping = scope.spawn(|| {
            let _exit = Exit(&control);
            compute_loop::<B>(graph, backward, &control)
        });
        let out = body(&control, looping.thread());
        control.stop.store(true, Ordering::Release);
        looping.thread().unpark();
        looping.join().map_err(|_| {
            RuntimeError::Profile("the compute loop beside the CPU Adam panicked".into())
        })??;
        out
    })
}

/// The Adam step's seconds with the loop paused and running, `repeats` of each after one
/// untimed pair.
fn time_both(
    state: &mut AdamOps,
    run: &RunAdamW<'_>,
    repeats: usize,
    control: &Control,
    looping: &Thread,
) -> Result<(Vec<f64>, Vec<f64>)> {
    control.await_first_pass()?;
    let (mut alone, mut beside) = (Vec::new(), Vec::new());
    for step in 1..=repeats.max(1) as u64 + 1 {
        control.pause()?;
        let a = state.time(run, step, false);
        control.resume(looping)?;
        let b = state.time(run, step, false);
        if step > 1 {
            alone.push(a);
            beside.push(b);
        }
    }
    Ok((alone, beside))
}

/// Runs `graph` in place once, then its `backward` ops in a loop until told to stop, pausing
/// between two ops while asked to.
fn compute_loop<B: Backend>(graph: &Graph, backward: &[usize], control: &Control) -> Result<()> {
    let mut in_place = InPlaceGraph::<B>::new(graph)?;
    for op in 0..graph.op_count() {
        in_place.run(op, 1)?;
    }
    control.passes.fetch_add(1, Ordering::AcqRel);
    for step in 2u64.. {
        for &op in backward {
            while control.pause.load(Ordering::Acquire) {
                control.paused.store(true, Ordering::Release);
                if control.stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                std::thread::park_timeout(Duration::from_millis(1));
            }
            control.paused.store(false, Ordering::Release);
            if control.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            in_place.run(op, step)?;
            control.ops.fetch_add(1, Ordering::AcqRel);
        }
        control.passes.fetch_add(1, Ordering::AcqRel);
    }
    Ok(())
}

/// What the timing thread and the compute loop tell each other.
#[derive(Default)]
struct Control {
    /// The loop is asked to pause before its next op.
    pause: AtomicBool,
    /// The loop is paused (set by the loop).
    paused: AtomicBool,
    /// The loop is asked to end.
    stop: AtomicBool,
    /// The loop has ended (set as its thread leaves, however it leaves).
    exited: AtomicBool,
    /// Passes the loop has made over its ops.
    passes: AtomicUsize,
    /// Backward ops the loop has run.
    ops: AtomicUsize,
}

impl Control {
    /// Waits until the loop has run the whole graph once.
    fn await_first_pass(&self) -> Result<()> {
        self.await_loop(|c| c.passes.load(Ordering::Acquire) > 0)
    }

    /// Asks the loop to pause and waits until it is paused between two ops.
    fn pause(&self) -> Result<()> {
        self.pause.store(true, Ordering::Release);
        self.await_loop(|c| c.paused.load(Ordering::Acquire))
    }

    /// Lets the loop go on and waits until it runs ops again.
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
                return Err(RuntimeError::Profile(
                    "the compute loop beside the CPU Adam ended early".into(),
                ));
            }
            if began.elapsed() > PATIENCE {
                return Err(RuntimeError::Profile(format!(
                    "the compute loop beside the CPU Adam did not answer in {} s",
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

    /// The Adam is timed alternately with the loop paused between two ops (no op runs while it
    /// is timed) and with the loop running, one untimed pair first; the loop has run ops and
    /// has ended when the measurement returns.
    #[test]
    fn the_adam_is_timed_alone_with_the_loop_paused_and_beside_it_running() {
        let g = graph(true);
        let seen: Mutex<Vec<(bool, usize, usize)>> = Mutex::new(Vec::new());
        let mut state = AdamOps::cut(&[1000, 24], 1 << 14);
        let ran = beside_loop::<crate::host::HostBackend, _>(&g, &[1], |control, looping| {
            let run = |steps: Vec<AdamWStep<'_>>, ended: &(dyn Fn(usize) + Sync)| {
                let before = control.ops.load(Ordering::Acquire);
                let paused = control.paused.load(Ordering::Acquire);
                crate::kernels::adamw_steps_fused(steps, ended);
                let after = control.ops.load(Ordering::Acquire);
                seen.lock().unwrap().push((paused, before, after));
            };
            let (alone, beside) = time_both(&mut state, &run, 3, control, looping)?;
            assert_eq!((alone.len(), beside.len()), (3, 3));
            Ok(control.ops.load(Ordering::Acquire))
        })
        .unwrap();
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 8, "an untimed pair and three timed: {seen:?}");
        for (i, &(paused, before, after)) in seen.iter().enumerate() {
            assert_eq!(paused, i % 2 == 0, "call {i}: {seen:?}");
            if paused {
                assert_eq!(before, after, "an op ran beside the lone Adam: {seen:?}");
            }
        }
        assert!(ran > 0, "the loop ran no backward op");
    }

    /// A share within [`MIN_SHARE`, 1] from the host backend, each Adam step handed to the run
    /// path; `None` (nothing run) without an AdamW op or a backward op.
    #[test]
    fn the_share_is_measured_where_the_adam_has_compute_beside_it() {
        let calls = AtomicUsize::new(0);
        let run = direct(&calls);
        let share = measure_adam_compute_share::<crate::host::HostBackend>(
            &graph(true),
            &[4096, 100],
            1 << 16,
            2,
            &run,
        )
        .unwrap()
        .expect("a share");
        assert!((MIN_SHARE..=1.0).contains(&share), "{share}");
        assert_eq!(calls.load(Ordering::Relaxed), 6);
        for (g, sizes) in [(graph(true), &[][..]), (graph(false), &[4096][..])] {
            let none =
                measure_adam_compute_share::<crate::host::HostBackend>(&g, sizes, 1 << 16, 2, &run);
            assert_eq!(none.unwrap(), None);
        }
        assert_eq!(calls.load(Ordering::Relaxed), 6);
    }
}
