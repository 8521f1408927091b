//! Discrete-event simulation of a schedule's streams and events, and its Chrome trace.

use crate::comm::{CollectiveKind, Topology};
use crate::cost::{AdamShares, CopyDir, CostModel};
use protrain_ir::verify_schedule::VerifiedSchedule;
use protrain_ir::{
    format_bytes, BufferId, BufferKind, CopyKind, DType, EventId, Instr, Op, OpId, OpKind, Phase,
    Role, Schedule, ShardPart, Space, StreamId, StreamKind, TensorRef, TensorType, Value, ValueId,
};
use serde_json::{json, Map, Value as Json};
use std::fmt;
use std::ops::Range;

/// The categories a [`Span`] can carry: what kind of work occupied its stream.
///
/// A measured timeline uses the same strings, so that simulated and measured traces compare.
pub mod category {
    /// A kernel on a device stream.
    pub const COMPUTE: &str = "compute";
    /// A host-to-device copy.
    pub const H2D: &str = "h2d";
    /// A device-to-host copy.
    pub const D2H: &str = "d2h";
    /// A copy within device memory.
    pub const D2D: &str = "d2d";
    /// A kernel on the host optimizer stream (the CPU Adam).
    pub const CPU_ADAM: &str = "cpu_adam";
    /// A collective among the ranks (on the collective stream).
    pub const COMM: &str = "comm";
    /// A disk read or write of optimizer state (on the disk i/o stream).
    pub const DISK: &str = "disk";
    /// A staged chunk's cast of its master weights before an upload (the host cast stream).
    pub const CAST: &str = "cpu_cast";
    /// A stream stalled on an event another stream has not recorded yet.
    pub const WAIT: &str = "wait";
}

/// One interval of a timeline: an instruction of a stream, from its start to its end in seconds
/// after the step began. Simulated and measured timelines share this type.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The stream it ran on.
    pub stream: StreamId,
    /// The instruction's index in its stream.
    pub index: usize,
    /// Start, in seconds.
    pub start: f64,
    /// End, in seconds.
    pub end: f64,
    /// What ran, for people: `linear h.3.mlp.c_fc`, `fetch chunk 3 (12.0 MiB)`.
    pub label: String,
    /// One of the [`category`] constants.
    pub category: &'static str,
}

impl Span {
    /// Its duration in seconds.
    pub fn seconds(&self) -> f64 {
        self.end - self.start
    }
}

/// Busy seconds of the compute streams, by the [`Phase`] of the kernels that ran.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseSeconds {
    /// The forward pass.
    pub forward: f64,
    /// The backward pass, recomputation excluded.
    pub backward: f64,
    /// Forward ops re-run in the backward pass.
    pub recompute: f64,
    /// Gradient clipping and the device optimizer.
    pub optimizer: f64,
}

impl PhaseSeconds {
    /// The seconds of one phase.
    pub fn get(&self, phase: Phase) -> f64 {
        match phase {
            Phase::Forward => self.forward,
            Phase::Backward => self.backward,
            Phase::Recompute => self.recompute,
            Phase::Optimizer => self.optimizer,
        }
    }

    /// The sum over all phases.
    pub fn total(&self) -> f64 {
        self.forward + self.backward + self.recompute + self.optimizer
    }

    fn add(&mut self, phase: Phase, seconds: f64) {
        match phase {
            Phase::Forward => self.forward += seconds,
            Phase::Backward => self.backward += seconds,
            Phase::Recompute => self.recompute += seconds,
            Phase::Optimizer => self.optimizer += seconds,
        }
    }
}

/// The simulated step: its time, how busy each stream was, and the timeline.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// When the last stream finishes its last instruction, in seconds.
    pub step_seconds: f64,
    /// Seconds each stream spends running kernels and copies (not waiting), by [`StreamId`].
    pub stream_busy_seconds: Vec<f64>,
    /// A span for every kernel and copy, and one for every wait that stalled its stream,
    /// ordered by start time (then stream, then index).
    pub timeline: Vec<Span>,
    /// Busy seconds of the compute streams, by phase.
    pub phase_seconds: PhaseSeconds,
}

impl Simulation {
    /// Seconds during which a copy is in flight and no compute kernel runs: the communication
    /// the schedule failed to hide. See [`exposed_seconds`].
    pub fn exposed_communication_seconds(&self) -> f64 {
        exposed_seconds(
            &self.timeline,
            &[category::H2D, category::D2H, category::COMM],
            &[category::COMPUTE],
        )
    }

    /// Seconds of collectives among the ranks (the collective stream's busy time, every
    /// micro-batch counted); 0 for one rank.
    pub fn collective_seconds(&self, schedule: &Schedule) -> f64 {
        schedule
            .streams
            .iter()
            .zip(&self.stream_busy_seconds)
            .filter(|(s, _)| matches!(s.kind, StreamKind::Collective { .. }))
            .map(|(_, &t)| t)
            .sum()
    }

    /// Seconds during which a collective runs and no compute kernel does: the part of
    /// [`Simulation::collective_seconds`] the schedule failed to hide.
    pub fn exposed_collective_seconds(&self) -> f64 {
        exposed_seconds(&self.timeline, &[category::COMM], &[category::COMPUTE])
    }

    /// Seconds of disk reads and writes (the disk tier's stream busy, every micro-batch
    /// counted); 0 without a disk tier.
    pub fn disk_seconds(&self) -> f64 {
        self.timeline
            .iter()
            .filter(|s| s.category == category::DISK)
            .map(Span::seconds)
            .fold(0.0, |a, b| a + b)
    }

    /// Seconds during which the disk is read or written and neither a compute kernel nor the
    /// CPU Adam runs: the part of [`Simulation::disk_seconds`] the schedule failed to hide.
    pub fn exposed_disk_seconds(&self) -> f64 {
        exposed_seconds(
            &self.timeline,
            &[category::DISK],
            &[category::COMPUTE, category::CPU_ADAM],
        )
    }

    /// The timeline as a Chrome trace; see [`chrome_trace`].
    pub fn chrome_trace(&self, schedule: &Schedule) -> String {
        chrome_trace(schedule, &self.timeline)
    }
}

/// A stream that cannot go on: it waits on an event that is never recorded, or whose record
/// sits behind another stuck stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StuckStream {
    /// The stream.
    pub stream: StreamId,
    /// Its name.
    pub name: String,
    /// The index of the wait it is stuck at.
    pub index: usize,
    /// The event it waits on.
    pub event: EventId,
    /// Where that event is recorded, if anywhere: the stream and the instruction index.
    pub recorded_at: Option<(StreamId, usize)>,
}

impl fmt::Display for StuckStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}) waits at instruction {} for {}, ",
            self.stream, self.name, self.index, self.event
        )?;
        match self.recorded_at {
            None => write!(f, "which no stream records"),
            Some((stream, index)) => write!(
                f,
                "which {stream} records at instruction {index}, never reached"
            ),
        }
    }
}

/// Why a schedule cannot be simulated.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SimulateError {
    /// Some streams wait forever: on an event no stream records, on a record placed after the
    /// wait in the same stream, or in a cycle of waits across streams.
    #[error(
        "the schedule deadlocks: {}; every wait needs a record of its event that is reached \
         without it",
        list(.stuck)
    )]
    Deadlock {
        /// Every stuck stream, by id.
        stuck: Vec<StuckStream>,
    },
    /// An event is recorded more than once, so a wait on it is ambiguous.
    #[error(
        "{event} is recorded twice, by {} at instruction {} and by {} at instruction {}; \
         give each record its own event",
        .first.0, .first.1, .second.0, .second.1
    )]
    DuplicateRecord {
        /// The event.
        event: EventId,
        /// The first record: stream and instruction index.
        first: (StreamId, usize),
        /// The second record.
        second: (StreamId, usize),
    },
    /// An instruction names an op, value, buffer or event the schedule does not have.
    #[error(
        "{stream} instruction {index} refers to {what}, which the schedule does not have; \
         run the schedule verifier"
    )]
    BadReference {
        /// The stream.
        stream: StreamId,
        /// The instruction's index.
        index: usize,
        /// What is missing.
        what: String,
    },
}

fn list(stuck: &[StuckStream]) -> String {
    stuck
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// The direction a copy from `src` to `dst` memory takes.
///
/// No schedule copies host to host; such a copy is priced as device-to-host, the pinned-memory
/// transfer the cost model knows, rather than as free.
pub fn copy_direction(src: Space, dst: Space) -> CopyDir {
    match (src, dst) {
        (Space::Host, Space::Device) => CopyDir::HostToDevice,
        (Space::Device, Space::Device) => CopyDir::DeviceToDevice,
        (Space::Device, Space::Host) | (Space::Host, Space::Host) => CopyDir::DeviceToHost,
        (Space::Disk, _) => CopyDir::DiskToHost,
        (_, Space::Disk) => CopyDir::HostToDisk,
    }
}

/// How long one instruction of `stream` takes, in seconds, priced alone ([`stream_seconds`]
/// prices a run of device AdamW ops as the one launch the CUDA backend makes of it).
///
/// - a kernel runs for [`CostModel::op_seconds`] over its values' types, computing in the
///   element type of its first floating-point input (else output, else the header's); an
///   `adamw` kernel instead takes [`CostModel::cpu_adam_seconds`] over its parameter's
///   elements plus [`CostModel::cpu_adam_op_seconds`] on the host optimizer stream, and
///   [`CostModel::gpu_adam_seconds`] over its parameter's elements elsewhere; an
///   `accumulate_grad` on the collective stream (a micro-batch's gradient summed over the
///   ranks into its accumulator) takes [`CostModel::collective_seconds`] of an all-reduce of
///   its bytes, or, for a sharded chunk's gradient summed from the device into the ranks'
///   accumulator shards, of a reduce-scatter of its bytes plus the copy of the rank's `1/W`
///   to the host (the whole gradient's copy where the accumulator is whole, for the norm);
/// - a copy takes [`CostModel::copy_seconds`] in the direction of its buffers' spaces; a
///   disk read or write on ranks that share a node's disk that of the bytes of all the
///   node's ranks (each of `gpus` ranks gets `1 / gpus` of the node's disk bandwidth);
/// - records and waits take no time (how long a wait stalls is the simulation's business).
///
/// An instruction naming an op, value or buffer the schedule lacks costs 0: this never panics.
/// [`simulate`] rejects such schedules before pricing anything.
pub fn instr_seconds(
    schedule: &Schedule,
    stream: StreamId,
    instr: &Instr,
    cost: &dyn CostModel,
) -> f64 {
    match instr {
        Instr::Kernel { op, .. } => {
            let Some(op) = op_of(schedule, *op) else {
                return 0.0;
            };
            let Some(inputs) = types_of(schedule, &op.inputs) else {
                return 0.0;
            };
            let Some(outputs) = types_of(schedule, &op.outputs) else {
                return 0.0;
            };
            let kind = schedule
                .streams
                .get(stream.index())
                .map_or(StreamKind::Compute, |s| s.kind);
            let on_host = kind == StreamKind::HostOptimizer;
            match (&op.kind, inputs.first()) {
                // On the collective stream: the gradient summed over the ranks into the
                // accumulator, an all-reduce of its bytes (the adds ride along).
                (OpKind::AccumulateGrad, Some(acc)) => match (kind, instr) {
                    (StreamKind::Collective { gpus, nodes }, Instr::Kernel { inputs, .. }) => {
                        let topology = Topology { gpus, nodes };
                        let space = |i: usize| {
                            inputs
                                .get(i)
                                .and_then(|t| schedule.buffers.get(t.buffer.index()))
                        };
                        let from_device = space(1).is_some_and(|b| b.space == Space::Device)
                            && space(0).is_some_and(|b| b.space == Space::Host);
                        let sharded = space(0).is_some_and(|b| {
                            matches!(b.kind, protrain_ir::BufferKind::HostShard { .. })
                        });
                        let (collective, copied) = match sharded {
                            true => (
                                CollectiveKind::ReduceScatter,
                                acc.bytes().div_ceil(u64::from(topology.ranks().max(1))),
                            ),
                            false => (CollectiveKind::AllReduce, acc.bytes()),
                        };
                        let copy = match from_device {
                            true => cost.copy_seconds(copied, CopyDir::DeviceToHost),
                            false => 0.0,
                        };
                        cost.collective_seconds(collective, acc.bytes(), topology) + copy
                    }
                    _ => {
                        let dtype = compute_dtype(&inputs, &outputs, schedule.header.dtype);
                        cost.op_seconds(&op.kind, &inputs, &outputs, dtype)
                    }
                },
                // On the collective stream: a chunk-major sum's add, a micro-batch's
                // gradient summed over the ranks into the running sum, an all-reduce of its
                // bytes (the running sum's copy and the adds ride along).
                (OpKind::Add, Some(sum)) if matches!(kind, StreamKind::Collective { .. }) => {
                    let StreamKind::Collective { gpus, nodes } = kind else {
                        return 0.0;
                    };
                    cost.collective_seconds(
                        CollectiveKind::AllReduce,
                        sum.bytes(),
                        Topology { gpus, nodes },
                    )
                }
                (OpKind::AdamW { .. }, Some(param)) if on_host => {
                    // A sharded chunk's rank updates its slice: 1/ranks of the parameters.
                    let sharded = match instr {
                        Instr::Kernel { inputs, .. } => inputs.first().is_some_and(|t| {
                            schedule.buffers.get(t.buffer.index()).is_some_and(|b| {
                                matches!(b.kind, protrain_ir::BufferKind::HostShard { .. })
                            })
                        }),
                        _ => false,
                    };
                    let share = if sharded {
                        u64::from(schedule.ranks())
                    } else {
                        1
                    };
                    cost.cpu_adam_seconds(param.numel().div_ceil(share))
                        + cost.cpu_adam_op_seconds()
                }
                (OpKind::AdamW { .. }, Some(param)) => cost.gpu_adam_seconds(param.numel()),
                _ => {
                    let dtype = compute_dtype(&inputs, &outputs, schedule.header.dtype);
                    cost.op_seconds(&op.kind, &inputs, &outputs, dtype)
                }
            }
        }
        Instr::Copy {
            src, dst, bytes, ..
        }
        | Instr::CopyShard {
            src, dst, bytes, ..
        } => match (space_of(schedule, *src), space_of(schedule, *dst)) {
            (Some(src), Some(dst)) => cost.copy_seconds(*bytes, copy_direction(src, dst)),
            _ => 0.0,
        },
        // The ranks of a node share its disk (the profile's bandwidth is a node's), and run
        // the same transfers at once: each moves its bytes at `1 / gpus` of the bandwidth.
        Instr::DiskRead {
            src, dst, bytes, ..
        }
        | Instr::DiskWrite {
            src, dst, bytes, ..
        } => match (space_of(schedule, *src), space_of(schedule, *dst)) {
            (Some(src), Some(dst)) => {
                let per_node = u64::from(schedule.topology().0.max(1));
                cost.copy_seconds(bytes.saturating_mul(per_node), copy_direction(src, dst))
            }
            _ => 0.0,
        },
        Instr::CastChunk { chunk, .. } => {
            let params = schedule
                .chunks
                .iter()
                .find(|(c, _)| c == chunk)
                .map_or(0, |(_, c)| {
                    c.members
                        .iter()
                        .filter_map(|m| schedule.graph.params().nth(m.param.index()))
                        .map(|(_, p)| value_of(schedule, p.value).map_or(0, |v| v.ty.numel()))
                        .sum()
                });
            cost.cpu_cast_seconds(params)
        }
        Instr::AllGather { bytes, .. } | Instr::ReduceScatter { bytes, .. } => {
            let StreamKind::Collective { gpus, nodes } = schedule
                .streams
                .get(stream.index())
                .map_or(StreamKind::Compute, |s| s.kind)
            else {
                return 0.0;
            };
            let kind = match instr {
                Instr::AllGather { .. } => CollectiveKind::AllGather,
                _ => CollectiveKind::ReduceScatter,
            };
            let topology = Topology { gpus, nodes };
            cost.collective_seconds(kind, bytes * u64::from(topology.ranks()), topology)
        }
        Instr::AllReduce { value, .. } => {
            let (Some(v), StreamKind::Collective { gpus, nodes }) = (
                value_of(schedule, *value),
                schedule
                    .streams
                    .get(stream.index())
                    .map_or(StreamKind::Compute, |s| s.kind),
            ) else {
                return 0.0;
            };
            cost.collective_seconds(
                CollectiveKind::AllReduce,
                v.ty.bytes(),
                Topology { gpus, nodes },
            )
        }
        Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => 0.0,
    }
}

/// What two adjacent AdamW instructions must share to be one launch: the op kind, the
/// parameter's type and the clip coefficient's address ([`device_adamw_runs`]).
type MergeKey<'a> = (&'a OpKind, DType, Option<TensorRef>);

/// The runs of device AdamW instructions of `stream` that the CUDA backend updates in one
/// multi-tensor launch each, as index ranges, in order; runs of one instruction included.
///
/// The rule is the runtime's (`protrain_runtime::cuda::runs`, which the compiler cannot call):
/// a run is a maximal sequence of adjacent kernel instructions, on any stream but the host
/// optimizer's, whose ops are AdamW with equal kinds (every hyper-parameter, and whether
/// clipped), parameters of one type, and the same clip coefficient address. So a run never
/// spans a record, a wait or any other instruction. A test of the root package checks that
/// both give the same runs. An instruction naming an op or value the schedule lacks ends a
/// run: this never panics.
pub fn device_adamw_runs(schedule: &Schedule, stream: StreamId) -> Vec<Range<usize>> {
    let Some(s) = schedule.streams.get(stream.index()) else {
        return Vec::new();
    };
    if s.kind == StreamKind::HostOptimizer {
        return Vec::new();
    }
    let key = |instr: &Instr| {
        let Instr::Kernel { op, inputs, .. } = instr else {
            return None;
        };
        let op = op_of(schedule, *op)?;
        let OpKind::AdamW { clipped, .. } = op.kind else {
            return None;
        };
        let param = value_of(schedule, *op.inputs.first()?)?;
        let coefficient = match clipped {
            true => Some(*inputs.get(4)?),
            false => None,
        };
        Some((&op.kind, param.ty.dtype, coefficient))
    };
    let mut runs = Vec::new();
    let mut open: Option<(usize, MergeKey<'_>)> = None;
    for (i, instr) in s.instrs.iter().enumerate() {
        let k = key(instr);
        if let (Some((_, current)), Some(k)) = (&open, &k) {
            if current == k {
                continue;
            }
        }
        if let Some((start, _)) = open.take() {
            runs.push(start..i);
        }
        open = k.map(|k| (i, k));
    }
    if let Some((start, _)) = open {
        runs.push(start..s.instrs.len());
    }
    runs
}

/// How long each instruction of `stream` takes in the simulation, by index: [`instr_seconds`],
/// except that where [`CostModel::multi_tensor_adamw`] holds, each run of
/// [`device_adamw_runs`] is one launch: its first instruction takes
/// [`CostModel::gpu_adam_seconds`] over the parameters of the whole run and the others take
/// nothing, so the run pays one launch overhead plus its bandwidth.
pub fn stream_seconds(schedule: &Schedule, stream: StreamId, cost: &dyn CostModel) -> Vec<f64> {
    let Some(s) = schedule.streams.get(stream.index()) else {
        return Vec::new();
    };
    let mut seconds: Vec<f64> = s
        .instrs
        .iter()
        .map(|instr| instr_seconds(schedule, stream, instr, cost))
        .collect();
    if cost.multi_tensor_adamw() {
        for run in device_adamw_runs(schedule, stream) {
            let params: u64 = s.instrs[run.clone()]
                .iter()
                .filter_map(|instr| match instr {
                    Instr::Kernel { op, .. } => op_of(schedule, *op),
                    _ => None,
                })
                .filter_map(|op| value_of(schedule, *op.inputs.first()?))
                .map(|param| param.ty.numel())
                .sum();
            seconds[run.start] = cost.gpu_adam_seconds(params);
            for later in &mut seconds[run.start + 1..run.end] {
                *later = 0.0;
            }
        }
    }
    seconds
}

/// A readable label for an instruction: the op's mnemonic and its output's name for a kernel
/// (`linear h.3.mlp.c_fc`; the parameter's name for `adamw`, which has no output), what moves
/// and how much for a copy (`fetch chunk 3 (12.0 MiB)`), the event for a record or wait.
pub fn instr_label(schedule: &Schedule, instr: &Instr) -> String {
    let value_name = |v: ValueId| {
        value_of(schedule, v).map_or_else(|| v.to_string(), |value| value.name.clone())
    };
    match instr {
        Instr::Kernel { op, .. } => match op_of(schedule, *op) {
            Some(o) => match o.outputs.first().or(o.inputs.first()) {
                Some(&v) => format!("{} {}", o.kind.mnemonic(), value_name(v)),
                None => o.kind.mnemonic().to_string(),
            },
            None => op.to_string(),
        },
        Instr::Copy { what, bytes, .. } => {
            let size = format_bytes(*bytes);
            match what {
                CopyKind::FetchChunk { chunk } => format!("fetch chunk {} ({size})", chunk.0),
                CopyKind::OffloadGrads { chunk } => {
                    format!("offload grads chunk {} ({size})", chunk.0)
                }
                CopyKind::OffloadActivation { value } => {
                    format!("offload {} ({size})", value_name(*value))
                }
                CopyKind::ReloadActivation { value } => {
                    format!("reload {} ({size})", value_name(*value))
                }
                CopyKind::Scalar { value } => format!("scalar {}", value_name(*value)),
            }
        }
        Instr::Record { event } => format!("record {event}"),
        Instr::Wait { event } => format!("wait {event}"),
        Instr::EndMicroBatch { micro_batches } => format!("end of micro-batch x{micro_batches}"),
        Instr::AllReduce { value, .. } => format!("all_reduce {}", value_name(*value)),
        Instr::CopyShard { what, bytes, .. } => {
            let size = format_bytes(*bytes);
            match what {
                CopyKind::FetchChunk { chunk } => format!("fetch shard chunk {} ({size})", chunk.0),
                CopyKind::OffloadGrads { chunk } => {
                    format!("offload grads shard chunk {} ({size})", chunk.0)
                }
                _ => format!("copy shard ({size})"),
            }
        }
        Instr::AllGather { chunk, .. } => format!("all_gather chunk {}", chunk.0),
        Instr::ReduceScatter { chunk, .. } => format!("reduce_scatter chunk {}", chunk.0),
        Instr::DiskRead { chunk, bytes, .. } => {
            format!(
                "disk read chunk {} state ({})",
                chunk.0,
                format_bytes(*bytes)
            )
        }
        Instr::DiskWrite { chunk, bytes, .. } => {
            format!(
                "disk write chunk {} state ({})",
                chunk.0,
                format_bytes(*bytes)
            )
        }
        Instr::CastChunk { chunk, bytes, .. } => {
            format!("cast chunk {} ({})", chunk.0, format_bytes(*bytes))
        }
    }
}

/// Simulates one step: each stream runs its instructions in order, one at a time, all starting
/// at 0; a kernel or copy takes [`instr_seconds`] (a run of device AdamW ops one launch, see
/// [`stream_seconds`]); a record marks the time its stream reached it; a wait holds its
/// stream until the event's record is reached.
///
/// The step simulated is the steady state: carried disk writes ([`Instr::DiskWrite`]'s
/// `carried`), which write the previous step's update back, run at the head of the disk
/// stream, overlapping the step's forward pass (with accumulation, in the first
/// micro-batch only; each later micro-batch lasts as one without them).
///
/// Streams compete for nothing but events (no shared bandwidth, no launch queue), so each
/// stream runs ahead until it blocks on an event not yet recorded and resumes when the record
/// is reached: every instruction is visited once, O(n) plus sorting the timeline. On the host
/// backend ([`CostModel::host_cores`]) the streams share the CPU's cores, so the step then
/// also pays [`shared_core_seconds`].
///
/// A verified schedule cannot fail; [`simulate_unverified`] runs the same simulation on a
/// schedule that has not been through the verifier.
pub fn simulate(
    schedule: &VerifiedSchedule,
    cost: &dyn CostModel,
) -> Result<Simulation, SimulateError> {
    simulate_unverified(schedule, cost)
}

/// [`simulate`] on a schedule the verifier has not seen: the search's candidates, which it
/// compiles by the dozen and verifies only once it has chosen (see
/// [`crate::pipeline::compile_policy`]), and tests of the simulator's own checks.
///
/// Errors, checked before any time is computed: an instruction naming an op, value, buffer or
/// event out of range; an event recorded twice. After: a deadlock, naming every stuck stream.
/// The verifier rejects all of these first.
pub fn simulate_unverified(
    schedule: &Schedule,
    cost: &dyn CostModel,
) -> Result<Simulation, SimulateError> {
    simulate_step(schedule, cost, true)
}

/// The micro-batch program of an accumulating `schedule` without its carried disk writes,
/// as a step of its own (each stream cut at its marker; events do not cross the markers):
/// what every micro-batch but the first runs.
fn later_micro_batch(schedule: &Schedule) -> Schedule {
    let mut out = schedule.clone();
    for stream in &mut out.streams {
        if let Some(at) = stream
            .instrs
            .iter()
            .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        {
            stream.instrs.truncate(at);
        }
        stream
            .instrs
            .retain(|i| !matches!(i, Instr::DiskWrite { carried: true, .. }));
    }
    out
}

/// [`simulate_unverified`], the host's shared cores priced where `shared` (not for a part of
/// a step, which the whole step prices).
fn simulate_step(
    schedule: &Schedule,
    cost: &dyn CostModel,
    shared: bool,
) -> Result<Simulation, SimulateError> {
    check_references(schedule)?;
    let records = record_sites(schedule)?;
    let n = schedule.streams.len();
    let events = schedule.events as usize;
    let mut next = vec![0usize; n];
    let mut clock = vec![0.0f64; n];
    let mut busy = vec![0.0f64; n];
    let mut recorded: Vec<Option<f64>> = vec![None; events];
    let mut waiters: Vec<Vec<usize>> = vec![Vec::new(); events];
    let mut phase_seconds = PhaseSeconds::default();
    let seconds_of: Vec<Vec<f64>> = (0..n)
        .map(|s| stream_seconds(schedule, StreamId::new(s), cost))
        .collect();
    let total: usize = schedule.streams.iter().map(|s| s.instrs.len()).sum();
    let mut timeline = Vec::with_capacity(total);
    let mut ready: Vec<usize> = (0..n).rev().collect();
    // With gradient accumulation the streams stop at their micro-batch markers; the
    // micro-batch then counts `micro_batches` times and the update starts after them all.
    let micro_batches = schedule.micro_batches();
    let mut repeat = f64::from(micro_batches);
    let mut at_marker = vec![false; n];
    // Carried disk writes run once a step, before the first micro-batch (the steady state:
    // they write the previous step's update back): the first micro-batch is simulated with
    // them, and the others last as one without them.
    let carried = schedule.carried_writes() > 0;
    let later_micro_batches = match carried && micro_batches > 1 {
        true => Some(simulate_step(&later_micro_batch(schedule), cost, false)?.step_seconds),
        false => None,
    };

    loop {
        while let Some(s) = ready.pop() {
            let stream = &schedule.streams[s];
            let id = StreamId::new(s);
            while let Some(instr) = stream.instrs.get(next[s]) {
                let index = next[s];
                match instr {
                    Instr::EndMicroBatch { .. } => {
                        at_marker[s] = true;
                        break;
                    }
                    Instr::Record { event } => {
                        recorded[event.index()] = Some(clock[s]);
                        ready.append(&mut waiters[event.index()]);
                    }
                    Instr::Wait { event } => match recorded[event.index()] {
                        None => {
                            waiters[event.index()].push(s);
                            break;
                        }
                        Some(at) => {
                            if at > clock[s] {
                                timeline.push(Span {
                                    stream: id,
                                    index,
                                    start: clock[s],
                                    end: at,
                                    label: instr_label(schedule, instr),
                                    category: category::WAIT,
                                });
                                clock[s] = at;
                            }
                        }
                    },
                    Instr::Kernel { .. }
                    | Instr::Copy { .. }
                    | Instr::AllReduce { .. }
                    | Instr::CopyShard { .. }
                    | Instr::AllGather { .. }
                    | Instr::ReduceScatter { .. }
                    | Instr::DiskRead { .. }
                    | Instr::DiskWrite { .. }
                    | Instr::CastChunk { .. } => {
                        let seconds = seconds_of[s][index];
                        if let (Instr::Kernel { op, .. }, StreamKind::Compute) =
                            (instr, stream.kind)
                        {
                            phase_seconds.add(schedule.graph.op(*op).phase, seconds * repeat);
                        }
                        timeline.push(Span {
                            stream: id,
                            index,
                            start: clock[s],
                            end: clock[s] + seconds,
                            label: instr_label(schedule, instr),
                            category: span_category(schedule, stream.kind, instr),
                        });
                        clock[s] += seconds;
                        busy[s] += match instr {
                            Instr::DiskWrite { carried: true, .. } => seconds,
                            _ => seconds * repeat,
                        };
                    }
                }
                next[s] += 1;
            }
        }
        if !at_marker.iter().any(|&m| m) {
            break;
        }
        // Every stream at its marker (a verified schedule's are all there): the barrier after
        // the last micro-batch.
        let first = clock.iter().copied().fold(0.0, f64::max);
        let micro = match later_micro_batches {
            Some(later) => first + later * f64::from(micro_batches - 1),
            None => first * f64::from(micro_batches),
        };
        for s in 0..n {
            if at_marker[s] {
                at_marker[s] = false;
                next[s] += 1;
            }
            clock[s] = micro;
        }
        repeat = 1.0;
        ready = (0..n).rev().collect();
    }

    let stuck: Vec<StuckStream> = schedule
        .streams
        .iter()
        .enumerate()
        .filter_map(|(s, stream)| match stream.instrs.get(next[s]) {
            Some(Instr::Wait { event }) => Some(StuckStream {
                stream: StreamId::new(s),
                name: stream.name.clone(),
                index: next[s],
                event: *event,
                recorded_at: records[event.index()],
            }),
            _ => None,
        })
        .collect();
    if !stuck.is_empty() {
        return Err(SimulateError::Deadlock { stuck });
    }

    timeline.sort_by(|a, b| {
        a.start
            .total_cmp(&b.start)
            .then(a.stream.cmp(&b.stream))
            .then(a.index.cmp(&b.index))
    });
    let mut step_seconds = clock.iter().copied().fold(0.0, f64::max);
    if let (Some(cores), true) = (cost.host_cores(), shared) {
        step_seconds += shared_core_seconds(&timeline, cores);
        // The host optimizer's threads share the cores with the compute kernels' and the
        // copies': each of its spans is busy longer while it overlaps them, by the share of its
        // rate it keeps.
        let shares = cost.cpu_adam_shares();
        for (s, stream) in schedule.streams.iter().enumerate() {
            if stream.kind == StreamKind::HostOptimizer {
                busy[s] += cpu_adam_beside_others_seconds(&timeline, StreamId::new(s), shares);
            }
        }
    }
    Ok(Simulation {
        step_seconds,
        stream_busy_seconds: busy,
        timeline,
        phase_seconds,
    })
}

/// What the host backend's compute kernels lose to the other streams on the same `cores`:
/// every second of CPU Adam work that overlaps compute (the Adam, at its share of the machine
/// for as long as that work takes it, holds the cores for one second of the whole machine:
/// [`cpu_adam_beside_others_seconds`]), and `1 / cores` of every second of copy that
/// overlaps compute (a `memcpy` thread takes one core). Added to the step time, not spread
/// over the timeline: the streams' spans stay as the events order them, and the compute
/// stream ends that much later.
pub fn shared_core_seconds(timeline: &[Span], cores: f64) -> f64 {
    let overlapped = |cats: &[&str]| {
        let busy: f64 = timeline
            .iter()
            .filter(|s| cats.contains(&s.category))
            .map(Span::seconds)
            .sum();
        busy - exposed_seconds(timeline, cats, &[category::COMPUTE])
    };
    let copies = overlapped(&[category::H2D]) + overlapped(&[category::D2H]);
    overlapped(&[category::CPU_ADAM])
        + if cores.is_finite() {
            copies / cores
        } else {
            0.0
        }
}

/// What the host optimizer `stream` loses to the compute kernels and copies beside it, on top
/// of its spans' own seconds, on the host backend: each second of its CPU Adam spans during
/// which a compute kernel runs and no copy takes `1 / shares.compute` seconds of wall time,
/// each during which a copy runs and no compute kernel `1 / shares.copy`, and each during
/// which both run `1 / shares.compute_and_copy` ([`CostModel::cpu_adam_shares`]: the parts of
/// its rate the Adam keeps beside them). The host backend runs the CPU Adam on the stream's
/// thread and a thread pool of its own, one thread per core, as many as the compute kernels'
/// pool; a copy is a `memcpy` on its stream's thread. The operating system's fair scheduler
/// would give the Adam and the kernels half the machine each ([`crate::cost::EVEN_CORE_SHARE`],
/// where the profile measured nothing), and the Adam, whose state streams from memory that the
/// kernels' working sets and the copies compete for, may measure more or less. The compute
/// kernels lose the Adam's own seconds ([`shared_core_seconds`]): the cores the Adam holds for
/// `1 / share` seconds at `share` of the machine. A device's host optimizer shares no cores
/// with its compute: the simulator adds this only where [`CostModel::host_cores`] says the
/// streams run on the CPU.
pub fn cpu_adam_beside_others_seconds(
    timeline: &[Span],
    stream: StreamId,
    shares: AdamShares,
) -> f64 {
    const COPIES: [&str; 2] = [category::H2D, category::D2H];
    let spans: Vec<Span> = timeline
        .iter()
        .filter(|s| {
            (s.stream == stream && s.category == category::CPU_ADAM)
                || s.category == category::COMPUTE
                || COPIES.contains(&s.category)
        })
        .cloned()
        .collect();
    let adam = [category::CPU_ADAM];
    let busy: f64 = spans
        .iter()
        .filter(|s| s.category == category::CPU_ADAM)
        .map(Span::seconds)
        .sum();
    // The Adam's seconds apart from compute, from copies and from both; by inclusion and
    // exclusion, those beside compute only, copies only and both at once.
    let without_compute = exposed_seconds(&spans, &adam, &[category::COMPUTE]);
    let without_copies = exposed_seconds(&spans, &adam, &COPIES);
    let without_either = exposed_seconds(
        &spans,
        &adam,
        &[category::COMPUTE, category::H2D, category::D2H],
    );
    let both = (busy - without_compute - without_copies + without_either).max(0.0);
    let compute_only = (busy - without_compute - both).max(0.0);
    let copies_only = (busy - without_copies - both).max(0.0);
    let stretch = |share: f64| 1.0 / share - 1.0;
    compute_only * stretch(shares.compute)
        + copies_only * stretch(shares.copy)
        + both * stretch(shares.compute_and_copy)
}

/// Seconds during which some span of `categories` runs and no span of `hidden_by` does: the
/// measure of the union of the first set of intervals minus the union of the second.
///
/// With copies against compute kernels, it is the communication a schedule leaves exposed;
/// with [`category::CPU_ADAM`] against compute, the CPU optimizer time not hidden behind the
/// device. Works on simulated and measured timelines alike.
pub fn exposed_seconds(spans: &[Span], categories: &[&str], hidden_by: &[&str]) -> f64 {
    let exposed = union(spans, categories);
    let hiding = union(spans, hidden_by);
    let mut total = 0.0;
    let mut j = 0;
    for &(start, end) in &exposed {
        let mut covered = 0.0;
        // Skip hiding intervals that end before this one starts; later exposed intervals start
        // later still, so they never need them either.
        while j < hiding.len() && hiding[j].1 <= start {
            j += 1;
        }
        let mut k = j;
        while k < hiding.len() && hiding[k].0 < end {
            covered += hiding[k].1.min(end) - hiding[k].0.max(start);
            k += 1;
        }
        total += (end - start) - covered;
    }
    total
}

/// The union of the spans of some categories, as sorted, disjoint `(start, end)` intervals.
fn union(spans: &[Span], categories: &[&str]) -> Vec<(f64, f64)> {
    let mut intervals: Vec<(f64, f64)> = spans
        .iter()
        .filter(|s| s.end > s.start && categories.contains(&s.category))
        .map(|s| (s.start, s.end))
        .collect();
    intervals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::with_capacity(intervals.len());
    for (start, end) in intervals {
        match merged.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

/// A timeline as Chrome / Perfetto trace-event JSON (open it in `chrome://tracing` or
/// ui.perfetto.dev): one complete (`"ph":"X"`) event per span of nonzero duration, times in
/// microseconds, one thread per stream (`tid` = the stream's index) named by `thread_name`
/// metadata, and arguments from the schedule (instruction index, op phase and block, bytes);
/// then counter (`"ph":"C"`) tracks of device and host memory by [`MemoryKind`], from each
/// buffer's life on the same spans ([`buffer_lives`]).
///
/// It takes the spans rather than a [`Simulation`] so that a measured run's timeline exports
/// the same way. Spans naming instructions the schedule lacks keep only their own fields.
pub fn chrome_trace(schedule: &Schedule, spans: &[Span]) -> String {
    let mut events = Vec::with_capacity(spans.len() + 2 * schedule.streams.len() + 1);
    events.push(json!({
        "name": "process_name", "ph": "M", "pid": 1, "tid": 0,
        "args": { "name": format!("protrain {}", schedule.header.model) },
    }));
    for (i, stream) in schedule.streams.iter().enumerate() {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 1, "tid": i,
            "args": { "name": stream.name },
        }));
        events.push(json!({
            "name": "thread_sort_index", "ph": "M", "pid": 1, "tid": i,
            "args": { "sort_index": i },
        }));
    }
    for span in spans.iter().filter(|s| s.end > s.start) {
        events.push(json!({
            "name": span.label,
            "cat": span.category,
            "ph": "X",
            "ts": span.start * 1e6,
            "dur": (span.end - span.start) * 1e6,
            "pid": 1,
            "tid": span.stream.0,
            "args": span_args(schedule, span),
        }));
    }
    let lives = buffer_lives(schedule, spans);
    for (space, kinds) in [
        ("device", &MemoryKind::DEVICE[..]),
        ("host", &MemoryKind::HOST[..]),
    ] {
        memory_counters(schedule, &lives, space, kinds, &mut events);
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}

/// Counter (`"ph":"C"`) events of one space's memory over the step: `"{space} memory"` with
/// the bytes of each kind that holds any (chrome://tracing stacks them; Perfetto shows a
/// track per kind), and `"{space} memory in use"` with their sum, one event per change.
fn memory_counters(
    schedule: &Schedule,
    lives: &[BufferLife],
    space: &str,
    kinds: &[MemoryKind],
    events: &mut Vec<Json>,
) {
    let timeline = MemoryTimeline::new(schedule, lives, kinds);
    let used: Vec<usize> = (0..kinds.len())
        .filter(|&k| timeline.points.iter().any(|(_, b)| b[k] > 0))
        .collect();
    if used.is_empty() {
        return;
    }
    for (t, bytes) in &timeline.points {
        let by_kind: Map<String, Json> = used
            .iter()
            .map(|&k| (kinds[k].name().to_string(), json!(bytes[k])))
            .collect();
        events.push(json!({
            "name": format!("{space} memory"), "ph": "C", "ts": t * 1e6, "pid": 1,
            "args": by_kind,
        }));
        events.push(json!({
            "name": format!("{space} memory in use"), "ph": "C", "ts": t * 1e6, "pid": 1,
            "args": { "bytes": bytes.iter().sum::<u64>() },
        }));
    }
}

/// What the trace shows when a span is clicked.
fn span_args(schedule: &Schedule, span: &Span) -> Json {
    let mut args = Map::new();
    args.insert("index".into(), json!(span.index));
    let stream = schedule.streams.get(span.stream.index());
    if let Some(stream) = stream {
        args.insert("stream".into(), json!(stream.name));
    }
    match stream.and_then(|s| s.instrs.get(span.index)) {
        Some(Instr::Kernel { op, .. }) => {
            args.insert("op".into(), json!(op.to_string()));
            if let Some(o) = op_of(schedule, *op) {
                args.insert("phase".into(), json!(o.phase.to_string()));
                if o.block.index() < schedule.graph.blocks().len() {
                    args.insert("block".into(), json!(schedule.graph.block(o.block).name));
                }
            }
        }
        Some(
            Instr::Copy { bytes, .. }
            | Instr::CopyShard { bytes, .. }
            | Instr::DiskRead { bytes, .. }
            | Instr::DiskWrite { bytes, .. }
            | Instr::CastChunk { bytes, .. },
        ) => {
            args.insert("bytes".into(), json!(bytes));
        }
        Some(Instr::AllGather { bytes, .. } | Instr::ReduceScatter { bytes, .. }) => {
            args.insert("bytes_per_rank".into(), json!(bytes));
        }
        Some(Instr::Record { event } | Instr::Wait { event }) => {
            args.insert("event".into(), json!(event.to_string()));
        }
        Some(Instr::EndMicroBatch { micro_batches }) => {
            args.insert("micro_batches".into(), json!(micro_batches));
        }
        Some(Instr::AllReduce { value, .. }) => {
            if let Some(v) = value_of(schedule, *value) {
                args.insert("bytes".into(), json!(v.ty.bytes()));
            }
        }
        None => {}
    }
    Json::Object(args)
}

/// The trace category of an instruction on a stream of `kind`: compute, cpu_adam, h2d, d2h,
/// d2d or wait. Measured timelines use it too, so both traces colour alike.
pub fn span_category(schedule: &Schedule, kind: StreamKind, instr: &Instr) -> &'static str {
    match instr {
        Instr::Kernel { .. } if kind == StreamKind::HostOptimizer => category::CPU_ADAM,
        Instr::Kernel { .. } if matches!(kind, StreamKind::Collective { .. }) => category::COMM,
        Instr::Kernel { .. } => category::COMPUTE,
        Instr::Copy { src, dst, .. } | Instr::CopyShard { src, dst, .. } => {
            match (space_of(schedule, *src), space_of(schedule, *dst)) {
                (Some(Space::Host), Some(Space::Device)) => category::H2D,
                (Some(Space::Device), Some(Space::Device)) => category::D2D,
                _ => category::D2H,
            }
        }
        Instr::AllReduce { .. } | Instr::AllGather { .. } | Instr::ReduceScatter { .. } => {
            category::COMM
        }
        Instr::DiskRead { .. } | Instr::DiskWrite { .. } => category::DISK,
        Instr::CastChunk { .. } => category::CAST,
        Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => category::WAIT,
    }
}

/// The element type an op computes in: its first floating-point input's, else its first
/// floating-point output's, else `fallback`.
fn compute_dtype(inputs: &[&TensorType], outputs: &[&TensorType], fallback: DType) -> DType {
    inputs
        .iter()
        .chain(outputs)
        .map(|t| t.dtype)
        .find(|d| d.is_float())
        .unwrap_or(fallback)
}

fn op_of(schedule: &Schedule, op: OpId) -> Option<&Op> {
    (op.index() < schedule.graph.op_count()).then(|| schedule.graph.op(op))
}

fn value_of(schedule: &Schedule, value: ValueId) -> Option<&Value> {
    (value.index() < schedule.graph.values().len()).then(|| schedule.graph.value(value))
}

fn types_of<'a>(schedule: &'a Schedule, values: &[ValueId]) -> Option<Vec<&'a TensorType>> {
    values
        .iter()
        .map(|&v| value_of(schedule, v).map(|value| &value.ty))
        .collect()
}

fn space_of(schedule: &Schedule, t: TensorRef) -> Option<Space> {
    schedule.buffers.get(t.buffer.index()).map(|b| b.space)
}

/// Checks that every id an instruction names exists, so that the simulation can index freely.
fn check_references(schedule: &Schedule) -> Result<(), SimulateError> {
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (index, instr) in stream.instrs.iter().enumerate() {
            let bad = |what: String| SimulateError::BadReference {
                stream: StreamId::new(s),
                index,
                what,
            };
            match instr {
                Instr::Kernel { op, .. } => {
                    let o = op_of(schedule, *op).ok_or_else(|| bad(op.to_string()))?;
                    if let Some(v) = o
                        .inputs
                        .iter()
                        .chain(&o.outputs)
                        .find(|&&v| value_of(schedule, v).is_none())
                    {
                        return Err(bad(format!("value {v} of {op}")));
                    }
                }
                Instr::Copy { src, dst, .. }
                | Instr::CopyShard { src, dst, .. }
                | Instr::DiskRead { src, dst, .. }
                | Instr::DiskWrite { src, dst, .. }
                | Instr::CastChunk { src, dst, .. } => {
                    for t in [src, dst] {
                        if space_of(schedule, *t).is_none() {
                            return Err(bad(t.buffer.to_string()));
                        }
                    }
                }
                Instr::Record { event } | Instr::Wait { event } => {
                    if event.0 >= schedule.events {
                        return Err(bad(format!(
                            "{event} (the schedule declares {} events)",
                            schedule.events
                        )));
                    }
                }
                Instr::AllReduce { value, at } => {
                    if value_of(schedule, *value).is_none() {
                        return Err(bad(value.to_string()));
                    }
                    if space_of(schedule, *at).is_none() {
                        return Err(bad(at.buffer.to_string()));
                    }
                }
                Instr::AllGather { chunk, at, .. } | Instr::ReduceScatter { chunk, at, .. } => {
                    if chunk.index() >= schedule.chunks.len() {
                        return Err(bad(chunk.to_string()));
                    }
                    if space_of(schedule, *at).is_none() {
                        return Err(bad(at.buffer.to_string()));
                    }
                }
                Instr::EndMicroBatch { .. } => {}
            }
        }
    }
    Ok(())
}

/// Where each event is recorded, by [`EventId`]; an error if one is recorded twice.
fn record_sites(schedule: &Schedule) -> Result<Vec<Option<(StreamId, usize)>>, SimulateError> {
    let mut sites = vec![None; schedule.events as usize];
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (index, instr) in stream.instrs.iter().enumerate() {
            if let Instr::Record { event } = instr {
                let here = (StreamId::new(s), index);
                if let Some(first) = sites[event.index()] {
                    return Err(SimulateError::DuplicateRecord {
                        event: *event,
                        first,
                        second: here,
                    });
                }
                sites[event.index()] = Some(here);
            }
        }
    }
    Ok(sites)
}

/// What a buffer holds, as the memory plot and the Chrome trace's counters group memory.
///
/// Device kinds come first, in the order the plot stacks them (what lives all step at the
/// bottom); [`MemoryKind::DEVICE`] and [`MemoryKind::HOST`] list each space's kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryKind {
    /// Step inputs (token ids, targets).
    Inputs,
    /// Persistent chunks' parameters and their device optimizer state.
    PersistentChunks,
    /// The slots streamed chunks are fetched into.
    ChunkBuffers,
    /// Gradients on the device: streamed chunks' gradient chunks, persistent chunks'
    /// gradients, accumulators.
    Gradients,
    /// Forward activations kept on the device until their backward use.
    ActivationsKept,
    /// Activations offloaded to the host, and the device buffers they are reloaded into.
    ActivationsSwapped,
    /// Forward values recomputed in the backward pass.
    ActivationsRecomputed,
    /// Intermediates used only in the phase that writes them (forward values of recomputed
    /// blocks, backward intermediates, the optimizer's scalars).
    Temporaries,
    /// Kernel scratch memory.
    Workspaces,
    /// Parameters in host memory (streamed chunks' homes, staging buffers for uploads).
    HostParameters,
    /// Gradients in host memory (offloaded gradient chunks, staging buffers, accumulators).
    HostGradients,
    /// f32 master weights and Adam moments in host memory, and the buffers disk-resident
    /// state is staged through.
    HostOptimizerState,
    /// Swapped activations' host copies (and scalars copied to the host).
    HostActivations,
    /// Anything else in host memory (the update program's scratch).
    HostOther,
}

impl MemoryKind {
    /// The device kinds, bottom of the stack first.
    pub const DEVICE: [MemoryKind; 9] = [
        MemoryKind::Inputs,
        MemoryKind::PersistentChunks,
        MemoryKind::ChunkBuffers,
        MemoryKind::Gradients,
        MemoryKind::ActivationsKept,
        MemoryKind::ActivationsSwapped,
        MemoryKind::ActivationsRecomputed,
        MemoryKind::Temporaries,
        MemoryKind::Workspaces,
    ];

    /// The host kinds.
    pub const HOST: [MemoryKind; 5] = [
        MemoryKind::HostParameters,
        MemoryKind::HostGradients,
        MemoryKind::HostOptimizerState,
        MemoryKind::HostActivations,
        MemoryKind::HostOther,
    ];

    /// The words a legend or a counter shows.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Inputs => "inputs",
            MemoryKind::PersistentChunks => "persistent chunks",
            MemoryKind::ChunkBuffers => "chunk buffers",
            MemoryKind::Gradients => "gradients",
            MemoryKind::ActivationsKept => "activations kept",
            MemoryKind::ActivationsSwapped => "activations swapped",
            MemoryKind::ActivationsRecomputed => "activations recomputed",
            MemoryKind::Temporaries => "temporaries",
            MemoryKind::Workspaces => "workspaces",
            MemoryKind::HostParameters => "parameters",
            MemoryKind::HostGradients => "gradients",
            MemoryKind::HostOptimizerState => "optimizer state",
            MemoryKind::HostActivations => "activations",
            MemoryKind::HostOther => "other",
        }
    }

    /// Whether buffers of this kind are in device memory.
    pub fn on_device(self) -> bool {
        MemoryKind::DEVICE.contains(&self)
    }
}

/// When a buffer holds something on a timeline: from the start of the first instruction that
/// touches it to the end of the last, or the whole step for the buffers that hold state
/// across steps (chunks, chunk slots, optimizer state, inputs, accumulators, staging).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BufferLife {
    /// The buffer.
    pub buffer: BufferId,
    /// What it holds.
    pub kind: MemoryKind,
    /// Seconds after the step began.
    pub start: f64,
    /// Seconds after the step began; at least `start`.
    pub end: f64,
}

/// Every device and host buffer of `schedule` with its kind and its life on the timeline
/// `spans` (simulated or measured), in buffer order. Disk buffers are left out.
///
/// A buffer no span touches is given the whole step, as the planner gives a buffer it has no
/// live range for. The step ends at the last span's end.
pub fn buffer_lives(schedule: &Schedule, spans: &[Span]) -> Vec<BufferLife> {
    let step = spans.iter().map(|s| s.end).fold(0.0, f64::max);
    let n = schedule.buffers.len();
    let mut touched: Vec<Option<(f64, f64)>> = vec![None; n];
    for span in spans {
        let Some(instr) = schedule
            .streams
            .get(span.stream.index())
            .and_then(|st| st.instrs.get(span.index))
        else {
            continue;
        };
        for t in instr_refs(instr) {
            if let Some(slot) = touched.get_mut(t.buffer.index()) {
                let (a, b) = slot.get_or_insert((span.start, span.end));
                *a = a.min(span.start);
                *b = b.max(span.end);
            }
        }
    }
    let kinds = buffer_kinds(schedule);
    schedule
        .buffers
        .iter()
        .enumerate()
        .filter(|(_, b)| b.space != Space::Disk)
        .map(|(i, b)| {
            let kind = kinds[i];
            let whole = lives_all_step(&b.kind);
            let (start, end) = match touched[i] {
                Some(range) if !whole => range,
                _ => (0.0, step),
            };
            BufferLife {
                buffer: BufferId::new(i),
                kind,
                start,
                end: end.max(start),
            }
        })
        .collect()
}

/// Bytes in use over a step by kind: a step function, one point per time its value changes.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryTimeline {
    /// The kinds of the columns of `bytes`.
    pub kinds: Vec<MemoryKind>,
    /// `(time, bytes of each kind)` from that time until the next point, times ascending;
    /// the first point is at 0.
    pub points: Vec<(f64, Vec<u64>)>,
}

impl MemoryTimeline {
    /// The bytes in use of `lives` of the given `kinds` over time. A buffer counts from its
    /// start (inclusive) to its end (exclusive), so one that ends when another starts at the
    /// same bytes is not counted twice.
    pub fn new(schedule: &Schedule, lives: &[BufferLife], kinds: &[MemoryKind]) -> Self {
        let mut changes: Vec<(f64, usize, i128)> = Vec::new();
        for life in lives {
            let Some(k) = kinds.iter().position(|&k| k == life.kind) else {
                continue;
            };
            let size = schedule.buffers[life.buffer.index()].size;
            if size == 0 || life.end <= life.start {
                continue;
            }
            changes.push((life.start, k, i128::from(size)));
            changes.push((life.end, k, -i128::from(size)));
        }
        changes.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut now = vec![0i128; kinds.len()];
        let mut points: Vec<(f64, Vec<u64>)> = vec![(0.0, vec![0; kinds.len()])];
        let mut i = 0;
        while i < changes.len() {
            let t = changes[i].0;
            while i < changes.len() && changes[i].0 == t {
                now[changes[i].1] += changes[i].2;
                i += 1;
            }
            let bytes: Vec<u64> = now.iter().map(|&b| b.max(0) as u64).collect();
            match points.last_mut() {
                Some(last) if last.0 == t => last.1 = bytes,
                _ => points.push((t, bytes)),
            }
        }
        Self {
            kinds: kinds.to_vec(),
            points,
        }
    }

    /// The most bytes in use at once, and the first time it is reached.
    pub fn peak(&self) -> (u64, f64) {
        self.points
            .iter()
            .map(|(t, b)| (b.iter().sum::<u64>(), *t))
            .fold((0, 0.0), |best, p| if p.0 > best.0 { p } else { best })
    }
}

/// Whether a buffer of this kind holds state across the step (or is reused all step), so that
/// it lives from the step's start to its end whatever touches it when.
fn lives_all_step(kind: &BufferKind) -> bool {
    !matches!(
        kind,
        BufferKind::Activation
            | BufferKind::Workspace
            | BufferKind::GradChunk { .. }
            | BufferKind::HostActivation
    )
}

/// The [`MemoryKind`] of every buffer, by [`BufferId`]. Activation buffers are told apart by
/// the copies that move them and the op that writes them.
fn buffer_kinds(schedule: &Schedule) -> Vec<MemoryKind> {
    let n = schedule.buffers.len();
    let mut swapped = vec![false; n];
    // The op that first writes each buffer on a device stream, and the last phase that reads it.
    let mut writer: Vec<Option<OpId>> = vec![None; n];
    let mut read_in_backward = vec![false; n];
    for stream in &schedule.streams {
        for instr in &stream.instrs {
            match instr {
                Instr::Copy {
                    what: CopyKind::OffloadActivation { .. },
                    src,
                    ..
                } => {
                    if let Some(s) = swapped.get_mut(src.buffer.index()) {
                        *s = true;
                    }
                }
                Instr::Copy {
                    what: CopyKind::ReloadActivation { .. },
                    dst,
                    ..
                } => {
                    if let Some(s) = swapped.get_mut(dst.buffer.index()) {
                        *s = true;
                    }
                }
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    ..
                } if stream.kind == StreamKind::Compute => {
                    for t in outputs {
                        if let Some(w) = writer.get_mut(t.buffer.index()) {
                            w.get_or_insert(*op);
                        }
                    }
                    let backward = op_of(schedule, *op)
                        .is_some_and(|o| matches!(o.phase, Phase::Backward | Phase::Recompute));
                    for t in inputs {
                        if let Some(r) = read_in_backward.get_mut(t.buffer.index()) {
                            *r |= backward;
                        }
                    }
                }
                _ => {}
            }
        }
    }
    schedule
        .buffers
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let device = b.space == Space::Device;
            match (&b.kind, device) {
                (BufferKind::Input, true) => MemoryKind::Inputs,
                (BufferKind::PersistentChunk { .. } | BufferKind::OptimizerState { .. }, true) => {
                    MemoryKind::PersistentChunks
                }
                (BufferKind::ChunkSlot { .. }, _) => MemoryKind::ChunkBuffers,
                (BufferKind::GradChunk { .. } | BufferKind::Accumulators, true) => {
                    MemoryKind::Gradients
                }
                (BufferKind::Workspace, true) => MemoryKind::Workspaces,
                (BufferKind::Activation, true) if swapped[i] => MemoryKind::ActivationsSwapped,
                (_, true) => {
                    let op = writer[i].and_then(|op| op_of(schedule, op));
                    let role = op.and_then(|o| {
                        o.outputs
                            .iter()
                            .find_map(|&v| value_of(schedule, v))
                            .map(|v| v.role)
                    });
                    match (op.map(|o| o.phase), role) {
                        (_, Some(Role::Grad | Role::Accumulator)) => MemoryKind::Gradients,
                        (Some(Phase::Recompute), _) => MemoryKind::ActivationsRecomputed,
                        (Some(Phase::Forward), _) if read_in_backward[i] => {
                            MemoryKind::ActivationsKept
                        }
                        (_, Some(Role::Loss)) => MemoryKind::ActivationsKept,
                        _ => MemoryKind::Temporaries,
                    }
                }
                (
                    BufferKind::HostChunk { .. }
                    | BufferKind::ParamStaging { .. }
                    | BufferKind::HostShard {
                        part: ShardPart::Params,
                        ..
                    },
                    false,
                ) => MemoryKind::HostParameters,
                (
                    BufferKind::HostGradChunk { .. }
                    | BufferKind::GradStaging { .. }
                    | BufferKind::Accumulators
                    | BufferKind::GradChunk { .. }
                    | BufferKind::HostShard {
                        part: ShardPart::Grads,
                        ..
                    },
                    false,
                ) => MemoryKind::HostGradients,
                (
                    BufferKind::OptimizerState { .. }
                    | BufferKind::DiskStaging { .. }
                    | BufferKind::ShardStaging { .. }
                    | BufferKind::HostShard { .. }
                    | BufferKind::PersistentChunk { .. },
                    false,
                ) => MemoryKind::HostOptimizerState,
                (BufferKind::HostActivation | BufferKind::Activation, false) => {
                    MemoryKind::HostActivations
                }
                _ => MemoryKind::HostOther,
            }
        })
        .collect()
}

/// Every tensor address an instruction names: a kernel's inputs and outputs, and the
/// addresses [`Instr::other_addresses`] lists.
fn instr_refs(instr: &Instr) -> Vec<TensorRef> {
    let mut refs = match instr {
        Instr::Kernel {
            inputs, outputs, ..
        } => inputs.iter().chain(outputs).copied().collect(),
        _ => Vec::new(),
    };
    refs.extend(instr.other_addresses());
    refs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(stream: usize, start: f64, end: f64, category: &'static str) -> Span {
        Span {
            stream: StreamId::new(stream),
            index: 0,
            start,
            end,
            label: String::new(),
            category,
        }
    }

    #[test]
    fn the_host_pays_overlapped_adam_whole_and_overlapped_copies_per_core() {
        // Compute runs 0..4. The CPU Adam runs 3..6: 1 s of it overlaps compute. Copies:
        // h2d 1..3 (2 s overlapped), d2h 5..6 (none). With 2 cores: 1 + 2 / 2 = 2 s.
        let timeline = [
            span(0, 0.0, 4.0, category::COMPUTE),
            span(3, 3.0, 6.0, category::CPU_ADAM),
            span(1, 1.0, 3.0, category::H2D),
            span(2, 5.0, 6.0, category::D2H),
        ];
        assert_eq!(shared_core_seconds(&timeline, 2.0), 2.0);
        // Cores to spare (infinitely many): the copies cost compute nothing.
        assert_eq!(shared_core_seconds(&timeline, f64::INFINITY), 1.0);
        // Nothing overlaps compute: nothing is shared.
        let apart = [
            span(0, 0.0, 1.0, category::COMPUTE),
            span(3, 1.0, 2.0, category::CPU_ADAM),
            span(1, 2.0, 3.0, category::H2D),
        ];
        assert_eq!(shared_core_seconds(&apart, 2.0), 0.0);
    }
}
