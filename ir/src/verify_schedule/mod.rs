//! The schedule verifier: checks that a [`Schedule`] runs its graph's step safely, and makes
//! the proof of it, [`VerifiedSchedule`], that every consumer of a schedule takes.
//!
//! The checks run in this order; the error ([`ScheduleError`]) names the first broken
//! invariant ([`Invariant`]) and, where one is at fault, the stream and instruction index
//! (`stream compute #12`), counted as the printer counts them; buffers are named as the
//! printer numbers them ([`BufferNumbering`]).
//!
//! Structure (`structure.rs`, with each instruction kind's ids check in `instrs.rs`): what each
//! part of the schedule says, one part at a time.
//!
//! 1. **graph**: the placed graph verifies ([`verify_graph`]). Checked first, because every
//!    other check reads the graph.
//! 2. **ids**: the header's format version is [`FORMAT_VERSION`](crate::FORMAT_VERSION);
//!    there is at least one stream; every buffer, op, value, chunk, parameter and event id is
//!    in range (events are `0..events`); every kernel's op has as many inputs and outputs as
//!    the kernel addresses, and a workspace exactly when its kind's
//!    [`workspace_bytes`](crate::OpKind::workspace_bytes) is non-zero (or, for attention
//!    planned for a GPU without flash attention,
//!    [`workspace_bytes_for`](crate::OpKind::workspace_bytes_for) is); kernels run on compute
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
//!    finite and `>= 0`; every gradient clip's `max_norm` and every loss scale (fp16's
//!    loss-scaled cross-entropy backward and unscale coefficient) finite and `> 0`. Anything else makes
//!    the step divide by zero or compute NaN, which no later check would see.
//!
//! **pitch** (checked after 3, before 4): every padded buffer ([`RowPitch`](crate::RowPitch))
//! is a device
//! activation buffer holding one value, padded in no other buffer: its pitch is at least
//! the value's row length, `pitch x element size` is a multiple of
//! [`ROW_PITCH_ALIGN`](crate::ROW_PITCH_ALIGN), and its bytes are `rows x pitch x element
//! size`; it is no home, master weight or loss, and no copy, collective, disk transfer,
//! cast or workspace addresses it; every kernel operand in it is that value at the
//! buffer's start, in a position its kind reads or writes at a row pitch
//! ([`OpKind::pitched_operands`](crate::OpKind::pitched_operands)). The later checks
//! take a padded value to occupy its whole buffer.
//!
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
//!     - the 14-byte host layout ([`HostLayout`](crate::HostLayout)): an AdamW whose narrow
//!       parameter has a master weight may address its gradient exactly at its parameter (the
//!       gradient offload landed in the parameter storage); the parameter's old bits are then
//!       not read (the update reads the master) and the in-place write may cover the gradient.
//!       The reuse is proven safe by the rules above and below: a fetch of the chunk after its
//!       gradients arrived reads gradients where its parameters must be, and is refused, and
//!       the offload's write must be ordered after every earlier fetch's read of that storage;
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
//! With gradient accumulation (see [`crate::schedule`]) the streams are split at their
//! [`Instr::EndMicroBatch`] markers first:
//!
//! 0. **phases**: either no stream has a marker, or every stream has exactly one, all with
//!    the same count of at least 2; kernels of optimizer-phase ops come after the markers and
//!    all others before; no event is used on both sides of the markers; every
//!    value without a producer whose role is accumulator is read by exactly one
//!    `accumulate_grad` (in the micro-batch program).
//!
//! The checks above then run on the micro-batch program and on the update program, each as a
//! step of its own (the runtime puts a barrier after every micro-batch and before the update),
//! except that coverage counts both together, an event need not be used in both, and the
//! update need not leave the loss behind. One micro-batch checked is all of them: each starts
//! as the previous left memory (every home holding its value, an accumulator its running sum).
//!
//! A data-parallel schedule ([`StreamKind::Collective`](crate::StreamKind::Collective)) is
//! checked the same way, with its collectives as instructions like copies: **ids** puts every
//! [`Instr::AllReduce`] on the one collective stream (at least 2 ranks), over an f32 or bf16
//! value; **bounds** and **alignment** check its address as a kernel's operand; **data flow**
//! checks it as a read of its value (there, whole, written before it through events) and a
//! write of the same bytes (the sum), so every reader in the optimizer waits for the sum and
//! nothing overwrites the value while it is summed. That every rank issues the same sequence
//! of collectives needs no check: the schedule is SPMD, one instruction list that every rank
//! runs, with no branch on the rank, so the sequence is the same by construction (the host
//! runtime's collectives still check each call's kind and size against the other ranks').
//! An accumulating data-parallel schedule sums each micro-batch's gradients over the ranks
//! into the accumulators with `accumulate_grad` kernels on the collective stream: **ids**
//! takes a kernel there for that op alone, with every operand in its accumulator's memory
//! (device or host), but in a sharded schedule a host accumulator's gradient may be in the
//! device arena (a sharded chunk's gradients summed where the backward pass left them into
//! the ranks' accumulator shards, or whole where the update reads the norm); sizes, bounds
//! and **data flow** check it as the kernel it is (it reads the gradient after its writers,
//! before anything overwrites it, and updates the accumulator in place, in the whole view
//! for a shard, which the update's readers follow), and **phases** counts it as the
//! accumulator's one `accumulate_grad`. A chunk-major data-parallel schedule sums each
//! micro-batch's gradients over the ranks with the `add` kernels of its gradient sums on the
//! collective stream: **ids** takes those there too, every operand in the device arena, and
//! **data flow** checks each as the kernel it is, its sums being summed over the ranks where
//! a sharded chunk's gradient offload copies them.
//!
//! A sharded schedule (offloaded chunks split over the ranks, [`BufferKind::HostShard`](crate::BufferKind::HostShard))
//! is checked in the *whole view* ([`Schedule::address`]): every rank runs the same
//! instructions on its own slice, so the union of the ranks' slices behaves as one buffer.
//! **ids** puts a [`Instr::CopyShard`] fetch on the host-to-device stream from the chunk's
//! parameter shard (from its start, moving exactly one shard per rank) into the device arena,
//! an offload on the device-to-host stream into its gradient shard (or its parameter shard,
//! in the 14-byte layout, whose reuse **data flow** proves as for a whole chunk), and
//! [`Instr::AllGather`] and [`Instr::ReduceScatter`] on the collective stream, of a sharded
//! chunk, moving exactly its shard's bytes per rank, a reduce-scatter in its parameters' type;
//! **bounds** checks every rank's slices (`ranks x bytes`) inside their buffers, whose
//! extent is `ranks x size` for a shard; **data flow** checks a shard copy as a copy of every
//! rank's slice, an all-gather as a read of every member of its chunk written by the chunk's
//! shard fetch and ordered before it, and a reduce-scatter as a read of every member ordered
//! after its writers (the backward kernels), each rewriting what it read; no instruction may
//! read what a shard fetch wrote before an all-gather rewrote it (each rank wrote only its
//! slice) or what a reduce-scatter wrote (only each rank's slice holds the sum), and an
//! offload must copy gradients a reduce-scatter wrote (or an all-reduce, which sums them
//! whole where the update reads the global gradient norm).
//!
//! A schedule with a disk tier ([`Space::Disk`], see [`crate::schedule`]) is checked with its
//! disk reads and writes as copies: **ids** puts every [`Instr::DiskRead`] and
//! [`Instr::DiskWrite`] on a disk i/o stream, between the whole disk-resident
//! optimizer-state buffer of its chunk (from its start, all its bytes), or a range of its
//! disk-resident parameter or gradient storage, and the same offset of a host staging buffer
//! with room for them; no kernel or other copy touches the disk; every
//! AdamW that finds its moments in a staging buffer has them at the offsets their homes
//! have in the chunk's disk buffer, as has its master weight, so that the master a staging
//! buffer holds is the one the update reads; **bounds** keeps every disk buffer inside
//! `disk_bytes`; **budget** checks `disk_bytes <= disk_budget_bytes`; **homes** lets AdamW
//! update a moment whose home is on disk in its staging buffer (the update must then reach
//! the home through a write, which **end of step** checks); **data flow** runs over a third
//! byte model, the disk's: a read copies what the disk holds to the staging buffer (so the
//! CPU Adam reads a moment only after the read that brought it, through events), a write
//! copies the updated state back (so it must be ordered after the update, and the staging
//! buffer is not read into again while a write still reads it). A transfer of a sharded
//! chunk's state shard on disk moves each rank's whole shard, between it and the start of a
//! sharded staging buffer ([`BufferKind::ShardStaging`](crate::BufferKind::ShardStaging)) of
//! the same part (**ids**), as every rank's slice in the whole view (**data flow**); an AdamW
//! that reads its moments there finds its master weight shard, on disk in the same chunk, in
//! the master staging buffer of the moments' slot (**homes**). A sharded chunk's parameter
//! or gradient shard on disk is uploaded from, or offloaded into, a sharded staging buffer
//! of its part in host memory, moving one rank's whole shard (**ids**), which **data flow**
//! proves holds that shard (the upload after the read, the write after the offload).
//!
//! Carried disk writes ([`Instr::DiskWrite`]'s `carried`, see [`crate::schedule`]) run at
//! the start of the next step, so the program is checked as cyclic for them: **ids** puts
//! them first in their stream, before any other instruction (with accumulation, at the head
//! of the micro-batch program), so they wait for nothing and every read of the disk comes
//! after them; **data flow** runs them twice. At the step's start, each reads its staging
//! buffer (which holds the previous step's update) and writes its disk bytes, keeping what
//! the model has them hold (their values at the start of the step): so every later write of
//! the staging buffer, and every read or write of those disk bytes, must be ordered after it
//! (a reuse of the staging buffer on another stream waits for an event the disk stream
//! records after it). After the step (after the update program, with accumulation), behind
//! the barrier between steps, each copies its staging buffer to disk as a write back does: it
//! must not write a moment back before its update, and **end of step** then finds each disk
//! home holding its value, so a staging buffer reused after the update (another chunk read
//! into it) is refused.
//!
//! A schedule with staged chunks (the 12-byte host layout, [`Instr::CastChunk`], see
//! [`crate::schedule`]) is checked with its casts as instructions: **ids** puts every cast on
//! a host cast stream, from its chunk's optimizer-state buffer in host memory, where every
//! member's piece ([`Schedule::cast_pieces`]) must be that parameter's master weight (so the
//! cast reads what AdamW updates), into the start of a parameter staging buffer, writing the
//! chunk's used bytes; a staged chunk's parameters have master weights and no homes;
//! **bounds** and **alignment** check the master weights read and each member's narrow copy
//! written; **homes** lets AdamW update a staged parameter (which has no home) at its
//! gradient's address in a gradient staging buffer; **data flow** tracks the master weights
//! of staged chunks as their parameters' values (placed before the step): a cast must find
//! each not yet updated this step (else the upload would carry the next step's weights) and
//! writes the members' parameters into the staging buffer, which nothing may still read (the
//! upload that read it last must be ordered before); an upload reads its parameters there
//! (so it waits for its cast); AdamW reads the master weight and writes it updated, after
//! every cast that read it; an offload into a gradient staging buffer must be ordered after
//! the CPU Adam that read the gradients it overwrites.
//!
//! It does not check what a kernel computes, that the cost model's predictions hold, or that
//! the memory plan is tight; and it checks one step (with carried writes, as above): the
//! runtime puts a barrier between steps.

mod dataflow;
mod events;
mod instrs;
mod memory;
mod pitch;
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
    /// Every padded buffer holds one activation in aligned rows, read and written only by
    /// kernels that take its row pitch.
    Pitch,
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
    /// Micro-batch markers are consistent (gradient accumulation).
    Phases,
}

impl Invariant {
    /// The invariant's name, as the module doc lists it.
    pub fn name(self) -> &'static str {
        match self {
            Invariant::Graph => "graph",
            Invariant::Ids => "ids",
            Invariant::Optimizer => "optimizer",
            Invariant::Pitch => "pitch",
            Invariant::Bounds => "bounds",
            Invariant::Alignment => "alignment",
            Invariant::Budget => "budget",
            Invariant::Coverage => "coverage",
            Invariant::Events => "events",
            Invariant::Deadlock => "deadlock",
            Invariant::Homes => "homes",
            Invariant::DataFlow => "data flow",
            Invariant::EndOfStep => "end of step",
            Invariant::Phases => "phases",
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
    let Some((micro, update, offsets)) = Checker::new(s).phases()? else {
        let cx = Checker::new(s);
        cx.ids()?;
        cx.optimizer()?;
        cx.pitch()?;
        cx.bounds()?;
        cx.alignment()?;
        cx.budget()?;
        cx.coverage()?;
        cx.events()?;
        cx.deadlock()?;
        cx.homes()?;
        return cx.data_flow();
    };
    let no_offsets = vec![0; s.streams.len()];
    let parts = [
        (&micro, Part::MicroBatch, &no_offsets),
        (&update, Part::Update, &offsets),
    ];
    for (schedule, part, offsets) in parts {
        let cx = Checker::new(schedule).part(part, offsets);
        cx.ids()?;
        cx.optimizer()?;
        cx.pitch()?;
        cx.bounds()?;
        cx.alignment()?;
        cx.budget()?;
    }
    Checker::new(s).coverage()?;
    for (schedule, part, offsets) in parts {
        let cx = Checker::new(schedule).part(part, offsets).carrying(s);
        cx.events()?;
        cx.deadlock()?;
        cx.homes()?;
        cx.data_flow()?;
    }
    Ok(())
}

/// Which instructions a [`Checker`] sees: the whole step, or one side of the micro-batch
/// markers of an accumulating schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    /// Every instruction (no accumulation).
    Whole,
    /// What runs once per micro-batch.
    MicroBatch,
    /// What runs once per step, after the micro-batches.
    Update,
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
    /// The part of an accumulating schedule `s` holds (its streams cut to that part).
    part: Part,
    /// Per stream, the index in the whole schedule of `s`'s first instruction.
    offsets: Vec<u32>,
    /// The bytes each padded value's buffer holds ([`pitch::pitched_bytes`]): what the
    /// bounds and data-flow checks take it to occupy.
    pitched: std::collections::HashMap<ValueId, u64>,
    /// The whole schedule's carried disk writes, in stream order: what the step's end (of
    /// the whole step or of the update program) writes back after its barrier.
    carried: Vec<(StreamId, &'a Instr)>,
}

/// Every carried disk write of `s` ([`Instr::DiskWrite`]'s `carried`), in stream order.
fn carried_writes(s: &Schedule) -> Vec<(StreamId, &Instr)> {
    s.streams
        .iter()
        .enumerate()
        .flat_map(|(si, stream)| {
            stream
                .instrs
                .iter()
                .filter(|i| matches!(i, Instr::DiskWrite { carried: true, .. }))
                .map(move |i| (StreamId::new(si), i))
        })
        .collect()
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
            part: Part::Whole,
            offsets: vec![0; s.streams.len()],
            pitched: pitch::pitched_bytes(s),
            carried: carried_writes(s),
        }
    }

    /// The checker of one part of an accumulating schedule, whose streams start at `offsets`
    /// in the whole one.
    fn part(mut self, part: Part, offsets: &[u32]) -> Self {
        self.part = part;
        self.offsets = offsets.to_vec();
        self
    }

    /// The checker with the carried writes of `whole`, the schedule a part is cut from (the
    /// update program runs them at its end, though its streams do not hold them).
    fn carrying(mut self, whole: &'a Schedule) -> Self {
        self.carried = carried_writes(whole);
        self
    }

    /// Whether `r` is a carried write as run at the end of the step: an index past its
    /// stream's instructions, counting the carried writes from there
    /// ([`Checker::end_ref`]).
    fn carried_at_end(&self, r: InstrRef) -> Option<(usize, &'a Instr)> {
        let len = self.s.streams[r.stream.index()].instrs.len();
        let j = (r.index as usize).checked_sub(len)?;
        self.carried
            .iter()
            .filter(|(si, _)| *si == r.stream)
            .nth(j)
            .map(|&(_, instr)| (j, instr))
    }

    /// The reference the `j`-th carried write of stream `stream` runs under at the end of
    /// the step: past the stream's instructions, so that every one of them happens before.
    fn end_ref(&self, stream: StreamId, j: usize) -> InstrRef {
        InstrRef {
            stream,
            index: (self.s.streams[stream.index()].instrs.len() + j) as u32,
        }
    }

    /// Invariant 0, the micro-batch markers: `None` without any; else the micro-batch
    /// program, the update program (each a schedule whose streams hold that part), and the
    /// index of each stream's first update instruction in the whole schedule.
    fn phases(&self) -> Result<Option<(Schedule, Schedule, Vec<u32>)>, ScheduleError> {
        let s = self.s;
        let Some(cuts) = self.markers()? else {
            return Ok(None);
        };
        self.event_sides(&cuts)?;
        self.accumulators()?;
        self.kernel_sides(&cuts)?;
        let cut = |update: bool| {
            let mut part = s.clone();
            for (stream, &c) in part.streams.iter_mut().zip(&cuts) {
                stream.instrs = match update {
                    false => stream.instrs[..c].to_vec(),
                    true => stream.instrs[c + 1..].to_vec(),
                };
            }
            part
        };
        let offsets = cuts.iter().map(|&c| c as u32 + 1).collect();
        Ok(Some((cut(false), cut(true), offsets)))
    }

    /// The index of each stream's micro-batch marker, `None` where no stream has one; fails
    /// unless every stream has exactly one and they agree on a count of at least 2.
    fn markers(&self) -> Result<Option<Vec<usize>>, ScheduleError> {
        let s = self.s;
        let mut count: Option<u32> = None;
        let mut cuts = Vec::with_capacity(s.streams.len());
        for (si, stream) in s.streams.iter().enumerate() {
            let marks: Vec<(usize, u32)> = stream
                .instrs
                .iter()
                .enumerate()
                .filter_map(|(i, instr)| match instr {
                    Instr::EndMicroBatch { micro_batches } => Some((i, *micro_batches)),
                    _ => None,
                })
                .collect();
            let at = |i: usize| InstrRef {
                stream: StreamId::new(si),
                index: i as u32,
            };
            let bad = |r: Option<InstrRef>, msg: String| Err(self.fail(Invariant::Phases, r, msg));
            match marks.as_slice() {
                [] => cuts.push(None),
                [(i, k)] => {
                    if *k < 2 {
                        return bad(
                            Some(at(*i)),
                            format!(
                                "ends a micro-batch program of {k} micro-batches; accumulation \
                                 takes at least 2 (a step of one has no marker)"
                            ),
                        );
                    }
                    if let Some(c) = count.filter(|c| c != k) {
                        return bad(
                            Some(at(*i)),
                            format!("says {k} micro-batches, another stream says {c}"),
                        );
                    }
                    count = Some(*k);
                    cuts.push(Some(*i));
                }
                [_, (i, _), ..] => {
                    return bad(
                        Some(at(*i)),
                        format!(
                            "a second micro-batch marker on stream {}: each stream has one",
                            stream.name
                        ),
                    )
                }
            }
        }
        if count.is_none() {
            return Ok(None);
        }
        if let Some(si) = cuts.iter().position(Option::is_none) {
            return Err(self.fail(
                Invariant::Phases,
                None,
                format!(
                    "stream {} has no micro-batch marker, the others do: every stream of an \
                     accumulating schedule has one",
                    s.streams[si].name
                ),
            ));
        }
        Ok(Some(cuts.into_iter().flatten().collect()))
    }

    /// Each event is used on one side of the micro-batch markers (`cuts`): no event crosses
    /// them.
    fn event_sides(&self, cuts: &[usize]) -> Result<(), ScheduleError> {
        let s = self.s;
        let mut side: Vec<Option<bool>> = vec![None; s.events as usize];
        for (si, stream) in s.streams.iter().enumerate() {
            for (i, instr) in stream.instrs.iter().enumerate() {
                let (Instr::Record { event } | Instr::Wait { event }) = instr else {
                    continue;
                };
                let Some(slot) = side.get_mut(event.index()) else {
                    continue; // out of range: the ids check names it
                };
                let update = i > cuts[si];
                if slot.replace(update).is_some_and(|u| u != update) {
                    return Err(self.fail(
                        Invariant::Phases,
                        Some(InstrRef {
                            stream: StreamId::new(si),
                            index: i as u32,
                        }),
                        format!(
                            "uses e{} on the other side of the micro-batch marker than another \
                             instruction: no event crosses it (a barrier does)",
                            event.0
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Each accumulator is summed into by exactly one `accumulate_grad` op and produced by
    /// none.
    fn accumulators(&self) -> Result<(), ScheduleError> {
        for (v, value) in self.g.values() {
            if value.role != crate::graph::Role::Accumulator {
                continue;
            }
            let sums = self
                .g
                .ops()
                .filter(|(_, o)| o.kind == crate::op::OpKind::AccumulateGrad && o.inputs[0] == v)
                .count();
            if value.producer.is_some() || sums != 1 {
                return Err(self.fail(
                    Invariant::Phases,
                    None,
                    format!(
                        "accumulator {} is summed into by {sums} accumulate_grad ops; each \
                         accumulator takes one gradient per micro-batch",
                        self.name(v)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// What runs where: the optimizer once per step, after the markers (`cuts`), everything
    /// else per micro-batch, before them.
    fn kernel_sides(&self, cuts: &[usize]) -> Result<(), ScheduleError> {
        let s = self.s;
        for (si, stream) in s.streams.iter().enumerate() {
            for (i, instr) in stream.instrs.iter().enumerate() {
                let Instr::Kernel { op, .. } = instr else {
                    continue;
                };
                if op.index() >= self.g.op_count() {
                    continue; // the ids check names it
                }
                let once = self.g.op(*op).phase == crate::op::Phase::Optimizer;
                if once != (i > cuts[si]) {
                    let r = InstrRef {
                        stream: StreamId::new(si),
                        index: i as u32,
                    };
                    let (side, belongs) = match once {
                        true => ("before", "runs once per step, after the micro-batches"),
                        false => ("after", "runs in every micro-batch"),
                    };
                    return Err(self.fail(
                        Invariant::Phases,
                        Some(r),
                        format!(
                            "is {side} the micro-batch marker, but a {} op {belongs}",
                            self.g.op(*op).phase
                        ),
                    ));
                }
            }
        }
        Ok(())
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

    /// The bytes `v` occupies where it is stored: its type's, or its padded buffer's.
    fn bytes(&self, v: ValueId) -> u64 {
        match self.pitched.get(&v) {
            Some(&bytes) => bytes,
            None => self.g.value(v).ty.bytes(),
        }
    }

    fn instr(&self, r: InstrRef) -> &'a Instr {
        match self.carried_at_end(r) {
            Some((_, instr)) => instr,
            None => &self.s.streams[r.stream.index()].instrs[r.index as usize],
        }
    }

    /// The index of `r` in the whole schedule (a carried write run at the end of the step:
    /// its index at the head of its stream).
    fn whole_index(&self, r: InstrRef) -> u32 {
        match self.carried_at_end(r) {
            Some((j, _)) => j as u32,
            None => r.index + self.offsets.get(r.stream.index()).copied().unwrap_or(0),
        }
    }

    /// `stream compute #12 (linear h.3.mlp.c_fc)`.
    fn at(&self, r: InstrRef) -> String {
        let stream = &self.s.streams[r.stream.index()];
        let what = match self.instr(r) {
            Instr::Kernel { op, .. } => self.describe_op(*op),
            Instr::Copy { what, .. } => format!("copy {}", copy_label(*what, &self.names)),
            Instr::Record { event } => format!("record e{}", event.0),
            Instr::Wait { event } => format!("wait e{}", event.0),
            Instr::EndMicroBatch { micro_batches } => {
                format!("end of micro-batch program x{micro_batches}")
            }
            Instr::AllReduce { value, .. } => format!("all_reduce {}", self.name(*value)),
            Instr::CopyShard { what, .. } => {
                format!("copy_shard {}", copy_label(*what, &self.names))
            }
            Instr::AllGather { chunk, .. } => format!("all_gather {chunk}"),
            Instr::ReduceScatter { chunk, .. } => format!("reduce_scatter {chunk}"),
            Instr::DiskRead { chunk, .. } => format!("disk_read {chunk}"),
            Instr::DiskWrite {
                chunk,
                carried: false,
                ..
            } => format!("disk_write {chunk}"),
            Instr::DiskWrite { chunk, .. } => match self.carried_at_end(r) {
                Some(_) => format!("carried disk_write {chunk}, run after the step's end"),
                None => format!("carried disk_write {chunk}, run as the step starts"),
            },
            Instr::CastChunk { chunk, .. } => format!("cast {chunk}"),
        };
        let index = self.whole_index(r);
        format!("stream {} #{index} ({what})", stream.name)
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
        let message = match self.part {
            Part::Whole => message,
            Part::MicroBatch => format!("in the micro-batch program, {message}"),
            Part::Update => format!("in the update program, {message}"),
        };
        // Instructions are named by their index in the whole schedule.
        let at = at.map(|r| InstrRef {
            stream: r.stream,
            index: self.whole_index(r),
        });
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

    /// Bytes of workspace `op` needs on every GPU ([`workspace_bytes`](crate::OpKind::workspace_bytes): with flash
    /// attention).
    fn workspace_need(&self, op: OpId) -> u64 {
        let o = self.g.op(op);
        let types: Vec<&TensorType> = o.inputs.iter().map(|v| &self.g.value(*v).ty).collect();
        o.kind.workspace_bytes(&types)
    }

    /// Bytes of workspace `op` needs on a GPU without flash attention, where attention runs as
    /// GEMMs over score matrices ([`workspace_bytes_for`](crate::OpKind::workspace_bytes_for)); the compiler plans this
    /// for such a GPU. At least [`Checker::workspace_need`].
    fn workspace_need_without_flash(&self, op: OpId) -> u64 {
        let o = self.g.op(op);
        let types: Vec<&TensorType> = o.inputs.iter().map(|v| &self.g.value(*v).ty).collect();
        o.kind.workspace_bytes_for(&types, false)
    }

    /// The bytes at `w`, `op`'s workspace, that its kernels may write: the planned workspace
    /// (to the end of its buffer) up to what the op needs on any GPU, and at least what it
    /// needs on every GPU.
    fn workspace_span(&self, op: OpId, w: TensorRef) -> u64 {
        let planned = self.s.buffer(w.buffer).size.saturating_sub(w.offset);
        planned
            .min(self.workspace_need_without_flash(op))
            .max(self.workspace_need(op))
    }
}
