//! The schedule verifier: checks that a [`Schedule`] runs its graph's step safely, and makes
//! the proof of it, [`VerifiedSchedule`], that every consumer of a schedule takes.
//!
//! The checks run in this order; the error ([`ScheduleError`]) names the first broken
//! invariant ([`Invariant`]) and, where one is at fault, the stream and instruction index
//! (`stream compute #12`), counted as the printer counts them; buffers are named as the
//! printer numbers them ([`BufferNumbering`]).
//!
//! Structure (`structure.rs`): what each part of the schedule says, one part at a time.
//!
//! 1. **graph**: the placed graph verifies ([`verify_graph`]). Checked first, because every
//!    other check reads the graph.
//! 2. **ids**: the header's format version is [`FORMAT_VERSION`](crate::FORMAT_VERSION);
//!    there is at least one stream; every buffer, op, value, chunk, parameter and event id is
//!    in range (events are `0..events`); every kernel's op has as many inputs and outputs as
//!    the kernel addresses, and a workspace exactly when its kind's
//!    [`workspace_bytes`](crate::OpKind::workspace_bytes) is non-zero; kernels run on compute
//!    streams with device operands or on host-optimizer streams with host operands; copies run
//!    on the host-to-device stream from host to device (fetch, reload) or on the
//!    device-to-host stream from device to host (offload, grads, scalars); a copy of a value
//!    moves exactly its bytes, a fetch covers all of its chunk's members; a chunk member's
//!    bytes are its parameter's; `homes` lists every value without a producer (input,
//!    parameter, optimizer state) exactly once and no other; `masters` lists, once each and in
//!    an optimizer-state buffer, an f32 master weight for every parameter narrower than f32
//!    that AdamW updates, and nothing else; the graph has an output, the first of which is the
//!    loss.
//! 3. **optimizer**: every AdamW's settings are ones the update can run with: the learning
//!    rate finite and `>= 0`, both betas in `[0, 1)`, eps finite and `> 0`, the weight decay
//!    finite and `>= 0`; every gradient clip's `max_norm` finite and `> 0`. Anything else makes
//!    the step divide by zero or compute NaN, which no later check would see.
//! 4. **bounds**: every buffer lies inside its space (device buffers inside `arena_bytes`,
//!    host buffers inside `host_bytes`); every tensor address plus its value's bytes, every
//!    workspace plus the bytes its kernel needs, and every copy's source and destination plus
//!    its bytes lie inside their buffers.
//! 5. **alignment**: every address a kernel reads or writes a value at, every home and
//!    `loss`, is a multiple of its value's element size, every master weight a multiple of 4
//!    (f32), every workspace a multiple of
//!    [`WORKSPACE_ALIGN`](crate::workspace::WORKSPACE_ALIGN) (its parts lie at multiples of
//!    that from its start). Addresses count from the start of their space, which the runtime
//!    allocates 256-byte aligned, so these are the alignments in memory that the host
//!    backend's typed views and the CUDA kernels' loads need. (The planner does more: it
//!    starts every buffer and every chunk member at a multiple of 256 bytes; this checks what
//!    running needs.)
//! 6. **budget**: `arena_bytes <= device_budget_bytes` and `host_bytes <= host_budget_bytes`.
//! 7. **coverage**: every op of the graph runs exactly once, as one kernel.
//!
//! Order (`events.rs`): the streams and the events between them.
//!
//! 8. **events**: every event is recorded exactly once and waited at least once, and no
//!    stream waits for an event it records itself later.
//! 9. **deadlock**: the streams, each in order and waiting where they wait, can all run to
//!    the end.
//!
//! Data flow (`dataflow.rs`, over the byte model of `memory.rs`): what every byte holds when
//! it is read.
//!
//! 10. **homes**: homes and master weights do not overlap; an op that updates inputs in place
//!     (AdamW's parameter and moments) addresses them at their homes, so the update is what
//!     the next step reads.
//! 11. **data flow**: executing the step, in an order the events allow (the lowest-numbered
//!     stream that can run goes next, so compute runs as early as it can), with
//!     happens-before tracked by vector clocks (a `record` orders what precedes it on its
//!     stream before what follows each `wait` for it) and the content of every byte range
//!     tracked as the value it holds (homes hold their values at the start):
//!     - a kernel's `i`-th input address holds exactly its op's `i`-th input value (all of
//!       it, at that address, not already updated in place), written by an instruction that
//!       happens-before the kernel: so every parameter chunk is resident when a kernel reads
//!       it, and every swapped activation is reloaded before its backward use;
//!     - a kernel's outputs and workspace overlap none of its inputs or each other (AdamW's
//!       in-place operands excepted); outputs come to hold their values, the workspace holds
//!       scratch, in-place operands hold their updated values;
//!     - a copy reads no kernel scratch, and what it reads was written by instructions that
//!       happen-before it (bytes never written, such as chunk padding, arrive as undefined);
//!       a fetch reads its chunk's parameters, an offload, reload or scalar copy exactly its
//!       value; the destination comes to hold what the source held, so a fetched chunk holds
//!       its parameters and a reloaded activation its value;
//!     - every write (kernel output, workspace, in-place update, copy destination) happens
//!       after every earlier write and every earlier read of any byte it overwrites: no
//!       release before the last use, no two live buffers in the same bytes.
//! 12. **end of step**: `loss` holds the loss, and every home but the inputs' holds its value
//!     (updated or not), so the next step starts where this one began.
//!
//! It does not check what a kernel computes, that the cost model's predictions hold, or that
//! the memory plan is tight; and it checks one step: the runtime puts a barrier between
//! steps.

mod dataflow;
mod events;
mod memory;
mod structure;

use crate::graph::Graph;
use crate::ids::{BufferId, OpId, StreamId, ValueId};
use crate::print::value_names;
use crate::print_schedule::{copy_label, space_name, BufferNumbering};
use crate::schedule::{Instr, Prediction, Schedule, Space, TensorRef};
use crate::types::TensorType;
use crate::verify::verify_graph;
use std::fmt;
use std::ops::Deref;

/// The invariants of a schedule, in the order they are checked; see the module doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Invariant {
    /// The placed graph verifies.
    Graph,
    /// Every id is in range and every instruction fits its op and stream.
    Ids,
    /// Every optimizer setting is finite and in its range.
    Optimizer,
    /// Every buffer lies in its space and every address in its buffer.
    Bounds,
    /// Every address is aligned for what is read or written there.
    Alignment,
    /// The arena and host region fit the budgets.
    Budget,
    /// Every op runs exactly once.
    Coverage,
    /// Every event is recorded once and waited for, never before its record on one stream.
    Events,
    /// The streams can all run to the end.
    Deadlock,
    /// Homes do not overlap and in-place updates land at them.
    Homes,
    /// Every read finds its value, written before it; no write races a read or a write.
    DataFlow,
    /// The loss and every home hold their values at the end of the step.
    EndOfStep,
}

impl Invariant {
    /// The invariant's name, as the module doc lists it.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::Graph => "graph",
            Invariant::Ids => "ids",
            Invariant::Optimizer => "optimizer",
            Invariant::Bounds => "bounds",
            Invariant::Alignment => "alignment",
            Invariant::Budget => "budget",
            Invariant::Coverage => "coverage",
            Invariant::Events => "events",
            Invariant::Deadlock => "deadlock",
            Invariant::Homes => "homes",
            Invariant::DataFlow => "data flow",
            Invariant::EndOfStep => "end of step",
        }
    }
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An instruction of a schedule: its stream and its index in the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstrRef {
    /// The stream.
    pub stream: StreamId,
    /// The index in the stream's instruction list.
    pub index: u32,
}

/// The first invariant a schedule breaks, and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid schedule ({invariant}): {message}")]
pub struct ScheduleError {
    /// Which invariant.
    pub invariant: Invariant,
    /// The instruction at fault, when one is.
    pub at: Option<InstrRef>,
    /// What is wrong, naming the stream, the instruction and the values involved.
    pub message: String,
}

/// Checks every invariant in the module doc; the error names the first broken one.
pub fn verify_schedule(s: &Schedule) -> Result<(), ScheduleError> {
    verify_graph(&s.graph).map_err(|e| ScheduleError {
        invariant: Invariant::Graph,
        at: None,
        message: e.to_string(),
    })?;
    let cx = Checker::new(s);
    cx.ids()?;
    cx.optimizer()?;
    cx.bounds()?;
    cx.alignment()?;
    cx.budget()?;
    cx.coverage()?;
    cx.events()?;
    cx.deadlock()?;
    cx.homes()?;
    cx.data_flow()
}

/// Checks every invariant in the module doc and, if they all hold, returns the schedule as
/// a [`VerifiedSchedule`]; the error names the first broken one (the schedule is dropped).
pub fn verify(schedule: Schedule) -> Result<VerifiedSchedule, ScheduleError> {
    verify_schedule(&schedule)?;
    Ok(VerifiedSchedule(schedule))
}

/// A schedule that satisfies every invariant of the verifier: the proof that a stage which
/// runs or simulates a schedule takes, so that it needs no check of its own.
///
/// Only [`verify`] makes one, and it lends out no `&mut Schedule`, so what it holds stays
/// verified; the parts the verifier does not read (the prediction and the search report in
/// the header) can still be changed. [`into_inner`](Self::into_inner) gives the schedule back,
/// unproven, to edit.
#[derive(Clone, Debug)]
pub struct VerifiedSchedule(Schedule);

impl VerifiedSchedule {
    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.0
    }

    /// The schedule, no longer marked verified.
    pub fn into_inner(self) -> Schedule {
        self.0
    }

    /// The header's prediction (time and memory), which the verifier does not read: filled
    /// in after verification, by simulation for instance.
    pub fn prediction_mut(&mut self) -> &mut Prediction {
        &mut self.0.header.prediction
    }

    /// The header's search report, which the verifier does not read.
    pub fn report_mut(&mut self) -> &mut String {
        &mut self.0.header.report
    }
}

impl Deref for VerifiedSchedule {
    type Target = Schedule;

    fn deref(&self) -> &Schedule {
        &self.0
    }
}

impl AsRef<Schedule> for VerifiedSchedule {
    fn as_ref(&self) -> &Schedule {
        &self.0
    }
}

impl TryFrom<Schedule> for VerifiedSchedule {
    type Error = ScheduleError;

    /// [`verify`].
    fn try_from(schedule: Schedule) -> Result<Self, ScheduleError> {
        verify(schedule)
    }
}

/// An absolute byte range `[start, end)` in a space.
type Span = (Space, u64, u64);

/// The schedule under check, its graph, and the canonical value and buffer names its
/// messages use.
struct Checker<'a> {
    s: &'a Schedule,
    g: &'a Graph,
    names: Vec<String>,
    buffers: BufferNumbering,
}

/// Whether two non-empty spans share a byte.
fn overlaps(a: Span, b: Span) -> bool {
    a.0 == b.0 && a.1 < b.2 && b.1 < a.2 && a.1 < a.2 && b.1 < b.2
}

impl<'a> Checker<'a> {
    fn new(s: &'a Schedule) -> Self {
        Self {
            s,
            g: &s.graph,
            names: value_names(&s.graph),
            buffers: BufferNumbering::of(s),
        }
    }

    fn name(&self, v: ValueId) -> &str {
        self.names
            .get(v.index())
            .map_or("<undefined>", String::as_str)
    }

    /// `buf7`: a buffer as the printer numbers it.
    fn buf(&self, b: BufferId) -> String {
        self.buffers.label(b)
    }

    fn bytes(&self, v: ValueId) -> u64 {
        self.g.value(v).ty.bytes()
    }

    fn instr(&self, r: InstrRef) -> &'a Instr {
        &self.s.streams[r.stream.index()].instrs[r.index as usize]
    }

    /// `stream compute #12 (linear h.3.mlp.c_fc)`.
    fn at(&self, r: InstrRef) -> String {
        let stream = &self.s.streams[r.stream.index()];
        let what = match self.instr(r) {
            Instr::Kernel { op, .. } => self.describe_op(*op),
            Instr::Copy { what, .. } => format!("copy {}", copy_label(*what, &self.names)),
            Instr::Record { event } => format!("record e{}", event.0),
            Instr::Wait { event } => format!("wait e{}", event.0),
        };
        format!("stream {} #{} ({what})", stream.name, r.index)
    }

    /// `linear h.3.mlp.c_fc`: the op's mnemonic and the readable name of what it writes (of
    /// its first input when it writes nothing, as AdamW).
    fn describe_op(&self, op: OpId) -> String {
        if op.index() >= self.g.op_count() {
            return format!("kernel {op}");
        }
        let o = self.g.op(op);
        match o.outputs.first().or(o.inputs.first()) {
            Some(&v) => format!("{} {}", o.kind.mnemonic(), self.g.value(v).name),
            None => o.kind.mnemonic().to_string(),
        }
    }

    fn range(space: Space, a: u64, b: u64) -> String {
        format!("{} [{a:#x}, {b:#x})", space_name(space))
    }

    fn fail(&self, invariant: Invariant, at: Option<InstrRef>, msg: String) -> ScheduleError {
        let message = match at {
            Some(r) => format!("{}: {msg}", self.at(r)),
            None => msg,
        };
        ScheduleError {
            invariant,
            at,
            message,
        }
    }

    fn instrs(&self) -> impl Iterator<Item = (InstrRef, &'a Instr)> {
        let s: &'a Schedule = self.s;
        s.streams.iter().enumerate().flat_map(|(si, stream)| {
            stream.instrs.iter().enumerate().map(move |(i, instr)| {
                (
                    InstrRef {
                        stream: StreamId::new(si),
                        index: i as u32,
                    },
                    instr,
                )
            })
        })
    }

    /// The absolute range a tensor of `bytes` at `t` covers (ids and bounds checked).
    fn span(&self, t: TensorRef, bytes: u64) -> Span {
        let (space, a) = self.s.address(t);
        (space, a, a + bytes)
    }

    fn home_of(&self) -> Vec<Option<TensorRef>> {
        let mut homes = vec![None; self.g.values().len()];
        for &(v, t) in &self.s.homes {
            homes[v.index()] = Some(t);
        }
        homes
    }

    fn loss_value(&self) -> ValueId {
        self.g.outputs()[0]
    }

    fn workspace_need(&self, op: OpId) -> u64 {
        let o = self.g.op(op);
        let types: Vec<&TensorType> = o.inputs.iter().map(|v| &self.g.value(*v).ty).collect();
        o.kind.workspace_bytes(&types)
    }
}
