//! What bounds a simulated step: the resources on its critical path, each with its share of
//! the step, and what the step would take with each twice as fast.
//!
//! The critical path is read off the simulated timeline backwards: from the instruction that
//! ends last, each instruction's start is the end of the one before it on its stream, or, for
//! a wait that stalled its stream, the moment another stream recorded the event, where the
//! walk crosses over. With gradient accumulation the first micro-batch is simulated once and
//! counted once per micro-batch (the simulator's barrier), so the path through it counts that
//! many times. The "twice as fast" figures are simulated, not derived from the shares: the
//! schedule runs again on a profile with that resource's figures doubled
//! ([`HardwareProfile::with_faster`]), so overlap that a faster resource uncovers shows.
//!
//! It does not say which instruction to change, and it does not re-search: a faster resource
//! might make another policy the fastest.

use crate::cost::cost_model;
use crate::simulate::{category, simulate, SimulateError, Simulation, Span};
use protrain_ir::verify_schedule::VerifiedSchedule;
use protrain_ir::{HardwareProfile, Instr, Resource, Schedule};

/// One resource's part in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ResourceTime {
    /// The resource.
    pub resource: Resource,
    /// Seconds of the critical path spent in its work.
    pub critical_seconds: f64,
    /// `critical_seconds` over the step time.
    pub share: f64,
    /// The simulated step with this resource twice as fast.
    pub step_if_twice_as_fast: f64,
}

/// What bounds a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    /// The simulated step time.
    pub step_seconds: f64,
    /// Every resource the step uses, the one with the most of the critical path first (then
    /// in [`Resource::ALL`]'s order).
    pub resources: Vec<ResourceTime>,
    /// Seconds of the step no resource's work accounts for on the critical path: on the host
    /// backend, what the compute kernels lose to the other streams on the same cores.
    pub unattributed_seconds: f64,
}

impl Bound {
    /// The resource the step is bound by: the one with the most of the critical path.
    pub fn by(&self) -> Option<&ResourceTime> {
        self.resources.first()
    }
}

/// The resource a timeline span's work uses; `None` for waits.
pub fn resource_of(category: &str) -> Option<Resource> {
    Some(match category {
        category::COMPUTE | category::D2D => Resource::Compute,
        category::H2D => Resource::PcieToDevice,
        category::D2H => Resource::PcieToHost,
        category::CPU_ADAM | category::CAST => Resource::CpuAdam,
        category::DISK => Resource::Disk,
        category::COMM => Resource::Network,
        _ => return None,
    })
}

/// The position of `r` in [`Resource::ALL`].
fn index(r: Resource) -> usize {
    Resource::ALL.iter().position(|&x| x == r).unwrap_or(0)
}

/// Seconds of the critical path of `simulation` (of `schedule`) spent in each resource's
/// work, in [`Resource::ALL`]'s order (see the module doc).
pub fn critical_path(schedule: &Schedule, simulation: &Simulation) -> [f64; 6] {
    let mut seconds = [0.0f64; 6];
    let n = schedule.streams.len();
    // Each stream's spans in its instruction order.
    let mut by_stream: Vec<Vec<&Span>> = vec![Vec::new(); n];
    for span in &simulation.timeline {
        if let Some(v) = by_stream.get_mut(span.stream.index()) {
            v.push(span);
        }
    }
    for v in &mut by_stream {
        v.sort_by_key(|s| s.index);
    }
    // Where each event is recorded.
    let mut records = vec![None; schedule.events as usize];
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            if let Instr::Record { event } = instr {
                if let Some(r) = records.get_mut(event.index()) {
                    *r = Some((s, i));
                }
            }
        }
    }
    let micro_batches = f64::from(schedule.micro_batches());
    let end_of = |v: &[&Span]| v.iter().map(|s| s.end).fold(0.0, f64::max);
    let Some(mut stream) = (0..n).max_by(|&a, &b| {
        end_of(&by_stream[a])
            .total_cmp(&end_of(&by_stream[b]))
            .then(b.cmp(&a))
    }) else {
        return seconds;
    };
    let mut t = end_of(&by_stream[stream]);
    let eps = t.abs().max(1.0) * 1e-12;
    let mut below = usize::MAX;
    let mut weight = 1.0;
    // Every step moves to an earlier instruction of a stream or to an earlier time, so the
    // walk ends; the cap guards against a timeline that is not a simulation's.
    for _ in 0..=2 * simulation.timeline.len() + 2 {
        if t <= eps {
            break;
        }
        let prev = by_stream[stream]
            .iter()
            .rev()
            .find(|s| s.index < below && s.end <= t + eps);
        match prev {
            Some(span) if span.end >= t - eps => {
                if span.category == category::WAIT {
                    let site = match schedule.streams[stream].instrs.get(span.index) {
                        Some(Instr::Wait { event }) => {
                            records.get(event.index()).copied().flatten()
                        }
                        _ => None,
                    };
                    match site {
                        Some((s, i)) => {
                            stream = s;
                            below = i;
                        }
                        None => break,
                    }
                } else {
                    if let Some(r) = resource_of(span.category) {
                        seconds[index(r)] += (span.end - span.start) * weight;
                    }
                    t = span.start;
                    below = span.index;
                }
            }
            // Nothing on this stream ends at `t`: the barrier after the micro-batches (every
            // stream starts the update at `micro_batches` times the longest micro-batch), or
            // the stream was idle until an event already recorded (walk on from its last
            // instruction).
            _ if micro_batches > 1.0 && weight == 1.0 => {
                let before = t / micro_batches;
                let Some(s) = (0..n)
                    .filter(|&s| {
                        by_stream[s]
                            .iter()
                            .any(|x| (x.end - before).abs() <= eps.max(before * 1e-12))
                    })
                    .min()
                else {
                    break;
                };
                stream = s;
                below = usize::MAX;
                t = before;
                weight = micro_batches;
            }
            Some(span) => {
                t = span.end;
            }
            None => break,
        }
    }
    seconds
}

/// What bounds `schedule`'s step on `profile`: the critical path of `simulation` (its
/// simulation on `profile`), and for every resource with work, the step simulated with that
/// resource twice as fast.
pub fn bound(
    schedule: &VerifiedSchedule,
    profile: &HardwareProfile,
    simulation: &Simulation,
) -> Result<Bound, SimulateError> {
    let critical = critical_path(schedule, simulation);
    let mut used = [false; 6];
    for span in simulation.timeline.iter().filter(|s| s.end > s.start) {
        if let Some(r) = resource_of(span.category) {
            used[index(r)] = true;
        }
    }
    let step = simulation.step_seconds;
    let mut resources = Vec::new();
    for (k, &resource) in Resource::ALL.iter().enumerate() {
        if !used[k] {
            continue;
        }
        let faster = profile.clone().with_faster(resource, 2.0);
        let cost = cost_model(&faster);
        let again = simulate(schedule, cost.as_ref())?;
        resources.push(ResourceTime {
            resource,
            critical_seconds: critical[k],
            share: if step > 0.0 { critical[k] / step } else { 0.0 },
            step_if_twice_as_fast: again.step_seconds,
        });
    }
    resources.sort_by(|a, b| b.critical_seconds.total_cmp(&a.critical_seconds));
    let attributed: f64 = critical.iter().sum();
    Ok(Bound {
        step_seconds: step,
        resources,
        unattributed_seconds: (step - attributed).max(0.0),
    })
}
