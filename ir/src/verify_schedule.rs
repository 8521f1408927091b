//! The schedule verifier: checks that a [`Schedule`] runs its graph's step safely.
//!
//! The checks run in this order; the error ([`ScheduleError`]) names the first broken
//! invariant ([`Invariant`]) and, where one is at fault, the stream and instruction index
//! (`stream compute #12`), counted as the printer counts them.
//!
//! 1. **graph**: the placed graph verifies ([`verify_graph`]). Checked first, because every
//!    other check reads the graph.
//! 2. **ids**: the header's format version is [`FORMAT_VERSION`]; there is at least one
//!    stream; every buffer, op, value, chunk, parameter and event id is in range (events are
//!    `0..events`); every kernel's op has as many inputs and outputs as the kernel addresses,
//!    and a workspace exactly when its kind's [`workspace_bytes`](crate::OpKind::workspace_bytes)
//!    is non-zero; kernels run on compute streams with device operands or on host-optimizer
//!    streams with host operands; copies run on the host-to-device stream from host to device
//!    (fetch, reload) or on the device-to-host stream from device to host (offload, grads,
//!    scalars); a copy of a value moves exactly its bytes, a fetch covers all of its chunk's
//!    members; a chunk member's bytes are its parameter's; `homes` lists every value without a
//!    producer (input, parameter, optimizer state) exactly once and no other; `masters` lists,
//!    once each and in an optimizer-state buffer, an f32 master weight for every parameter
//!    narrower than f32 that AdamW updates, and nothing else; the graph has an output, the
//!    first of which is the loss.
//! 3. **bounds**: every buffer lies inside its space (device buffers inside `arena_bytes`,
//!    host buffers inside `host_bytes`); every tensor address plus its value's bytes, every
//!    workspace plus the bytes its kernel needs, and every copy's source and destination plus
//!    its bytes lie inside their buffers.
//! 4. **budget**: `arena_bytes <= device_budget_bytes` and `host_bytes <= host_budget_bytes`.
//! 5. **coverage**: every op of the graph runs exactly once, as one kernel.
//! 6. **events**: every event is recorded exactly once and waited at least once, and no stream
//!    waits for an event it records itself later.
//! 7. **deadlock**: the streams, each in order and waiting where they wait, can all run to
//!    the end.
//! 8. **homes**: homes and master weights do not overlap; an op that updates inputs in place (AdamW's parameter
//!    and moments) addresses them at their homes, so the update is what the next step reads.
//! 9. **data flow**: executing the step, in an order the events allow (the lowest-numbered
//!    stream that can run goes next, so compute runs as early as it can), with happens-before
//!    tracked by vector clocks (a `record` orders what precedes it on its stream before what
//!    follows each `wait` for it) and the content of every byte range tracked as the value it
//!    holds (homes hold their values at the start):
//!    - a kernel's `i`-th input address holds exactly its op's `i`-th input value (all of it,
//!      at that address, not already updated in place), written by an instruction that
//!      happens-before the kernel;
//!    - a kernel's outputs and workspace overlap none of its inputs or each other (AdamW's
//!      in-place operands excepted); outputs come to hold their values, the workspace holds
//!      scratch, in-place operands hold their updated values;
//!    - a copy reads no kernel scratch, and what it reads was written by instructions that
//!      happen-before it (bytes never written, such as chunk padding, arrive as undefined);
//!      a fetch reads its chunk's parameters, an offload, reload or scalar copy exactly its
//!      value; the destination comes to hold what the source held, so a fetched chunk holds
//!      its parameters and a reloaded activation its value;
//!    - every write (kernel output, workspace, in-place update, copy destination) happens
//!      after every earlier write and every earlier read of any byte it overwrites: no
//!      release before the last use, no two live buffers in the same bytes.
//! 10. **end of step**: `loss` holds the loss, and every home but the inputs' holds its value
//!     (updated or not), so the next step starts where this one began.
//!
//! It does not check what a kernel computes, that the cost model's predictions hold, or that
//! the memory plan is tight; and it checks one step: the runtime puts a barrier between
//! steps.

use crate::graph::{Graph, Role};
use crate::ids::{OpId, StreamId, ValueId};
use crate::op::OpKind;
use crate::print::value_names;
use crate::print_schedule::{copy_label, space_name, stream_kind_name};
use crate::schedule::{
    BufferKind, CopyKind, Instr, Schedule, Space, StreamKind, TensorRef, FORMAT_VERSION,
};
use crate::types::{format_bytes, TensorType};
use crate::verify::verify_graph;
use std::collections::BTreeMap;
use std::fmt;

/// The invariants of a schedule, in the order they are checked; see the module doc.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Invariant {
    /// The placed graph verifies.
    Graph,
    /// Every id is in range and every instruction fits its op and stream.
    Ids,
    /// Every buffer lies in its space and every address in its buffer.
    Bounds,
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
            Invariant::Bounds => "bounds",
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
    cx.bounds()?;
    cx.budget()?;
    cx.coverage()?;
    cx.events()?;
    cx.deadlock()?;
    cx.homes()?;
    cx.data_flow()
}

/// What a byte range holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Content {
    /// Bytes of a value whose first byte is at `base` in the same space.
    Value {
        value: ValueId,
        base: u64,
        /// Written in place by an op that updates its inputs (AdamW).
        updated: bool,
    },
    /// A kernel's workspace.
    Scratch,
    /// Bytes a copy moved from memory nothing had written (chunk padding).
    Undefined,
}

/// Who last wrote a byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    /// The runtime, before the step (a home).
    Home,
    /// An instruction.
    Instr(InstrRef),
}

/// A tagged byte range `[start, end)` (the start is its key in [`Memory`]).
#[derive(Clone, Debug)]
struct Segment {
    end: u64,
    content: Content,
    writer: Writer,
    /// For each stream, 1 + the index of its last instruction that read these bytes since
    /// they were written, or 0. Stream order is total, so the last read stands for all.
    readers: Box<[u32]>,
}

/// One space's bytes as disjoint tagged ranges; untagged bytes were never written.
struct Memory {
    segments: BTreeMap<u64, Segment>,
    streams: usize,
}

impl Memory {
    fn new(streams: usize) -> Self {
        Self {
            segments: BTreeMap::new(),
            streams,
        }
    }

    /// Splits the segment that straddles `at`, if any, so that `at` starts a segment.
    fn split(&mut self, at: u64) {
        let Some((_, seg)) = self.segments.range_mut(..at).next_back() else {
            return;
        };
        if seg.end <= at {
            return;
        }
        // Both halves keep the content and its base: bases are absolute addresses.
        let tail = seg.clone();
        seg.end = at;
        self.segments.insert(at, tail);
    }

    /// Splits so that `[a, b)` is covered by whole segments (and gaps).
    fn isolate(&mut self, a: u64, b: u64) {
        self.split(a);
        self.split(b);
    }

    /// The segments inside `[a, b)`, which must have been isolated.
    fn within(&self, a: u64, b: u64) -> impl Iterator<Item = (u64, &Segment)> {
        self.segments.range(a..b).map(|(&start, seg)| (start, seg))
    }

    /// Records that `reader` read `[a, b)` (isolated).
    fn read(&mut self, a: u64, b: u64, reader: InstrRef) {
        for (_, seg) in self.segments.range_mut(a..b) {
            seg.readers[reader.stream.index()] = reader.index + 1;
        }
    }

    /// Replaces whatever `[a, b)` (isolated) held by `pieces`, given as offsets from `a`.
    fn write(&mut self, a: u64, b: u64, pieces: &[(u64, u64, Content)], writer: InstrRef) {
        let keys: Vec<u64> = self.segments.range(a..b).map(|(&k, _)| k).collect();
        for k in keys {
            self.segments.remove(&k);
        }
        for &(start, end, content) in pieces {
            if end > start {
                self.segments.insert(
                    a + start,
                    Segment {
                        end: a + end,
                        content,
                        writer: Writer::Instr(writer),
                        readers: vec![0; self.streams].into_boxed_slice(),
                    },
                );
            }
        }
    }
}

/// An absolute byte range `[start, end)` in a space.
type Span = (Space, u64, u64);

/// One range a kernel writes.
struct KernelWrite {
    span: Span,
    /// What the range comes to hold.
    content: Content,
    /// The input this write updates in place (AdamW's parameter and moments).
    in_place_of: Option<usize>,
}

/// A problem a read found.
enum Found {
    /// Some bytes were never written.
    Nothing,
    /// Some bytes hold something else.
    Other(Content, Writer),
    /// The value is there, but its writer is not ordered before the read.
    Unordered(InstrRef),
}

/// The schedule under check, its graph, and the canonical value names its messages use.
struct Checker<'a> {
    s: &'a Schedule,
    g: &'a Graph,
    names: Vec<String>,
}

/// Whether `w` happens before the instruction whose vector clock is `clock` (component `s`:
/// how many of stream `s`'s instructions happen before it or are it).
fn hb(w: InstrRef, clock: &[u32]) -> bool {
    w.index < clock[w.stream.index()]
}

/// Whether two non-empty spans share a byte.
fn overlaps(a: Span, b: Span) -> bool {
    a.0 == b.0 && a.1 < b.2 && b.1 < a.2 && a.1 < a.2 && b.1 < b.2
}

/// `320 B`, or `1.50 GiB (1610612736 B)` where the rounded figure hides the exact one.
fn exact_bytes(n: u64) -> String {
    if n < 1024 {
        format_bytes(n)
    } else {
        format!("{} ({n} B)", format_bytes(n))
    }
}

/// The index of a space's [`Memory`].
fn space_index(space: Space) -> usize {
    match space {
        Space::Device => 0,
        Space::Host => 1,
    }
}

impl<'a> Checker<'a> {
    fn new(s: &'a Schedule) -> Self {
        Self {
            s,
            g: &s.graph,
            names: value_names(&s.graph),
        }
    }

    fn name(&self, v: ValueId) -> &str {
        self.names
            .get(v.index())
            .map_or("<undefined>", String::as_str)
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

    // 2. ids ------------------------------------------------------------------------------

    fn ids(&self) -> Result<(), ScheduleError> {
        let (s, g) = (self.s, self.g);
        let bad = |msg: String| Err(self.fail(Invariant::Ids, None, msg));
        if s.header.format_version != FORMAT_VERSION {
            return bad(format!(
                "the header says format version {}, this build writes {FORMAT_VERSION}",
                s.header.format_version
            ));
        }
        if s.streams.is_empty() {
            return bad("the schedule has no stream".into());
        }
        let (n_buffers, n_chunks, n_values, n_ops, n_params) = (
            s.buffers.len(),
            s.chunks.len(),
            g.values().len(),
            g.op_count(),
            g.params().len(),
        );
        for (i, b) in s.buffers.iter().enumerate() {
            if let BufferKind::PersistentChunk { chunk }
            | BufferKind::HostChunk { chunk }
            | BufferKind::GradChunk { chunk }
            | BufferKind::HostGradChunk { chunk }
            | BufferKind::OptimizerState { chunk } = b.kind
            {
                if chunk.index() >= n_chunks {
                    return bad(format!(
                        "buf{i} ({}) belongs to {chunk}, but the chunk table has {n_chunks} chunks",
                        b.name
                    ));
                }
            }
        }
        for (c, chunk) in s.chunks.iter() {
            for m in &chunk.members {
                if m.param.index() >= n_params {
                    return bad(format!(
                        "{c} holds {}, but the graph has {n_params} parameters",
                        m.param
                    ));
                }
                let p = g.param(m.param);
                let want = g.value(p.value).ty.bytes();
                if m.bytes != want {
                    return bad(format!(
                        "{c} gives @{} {} bytes, its type takes {want}",
                        p.name, m.bytes
                    ));
                }
            }
        }
        let mut homed = vec![false; n_values];
        for &(v, t) in &s.homes {
            if v.index() >= n_values {
                return bad(format!(
                    "homes lists {v}, but the graph has {n_values} values"
                ));
            }
            if t.buffer.index() >= n_buffers {
                return bad(format!(
                    "the home of {} is in {}, but there are {n_buffers} buffers",
                    self.name(v),
                    t.buffer
                ));
            }
            if let Some(op) = g.value(v).producer {
                return bad(format!(
                    "homes lists {}, which {} computes: only inputs, parameters and optimizer \
                     state have homes",
                    self.name(v),
                    self.describe_op(op)
                ));
            }
            if std::mem::replace(&mut homed[v.index()], true) {
                return bad(format!("homes lists {} twice", self.name(v)));
            }
        }
        let mut mastered = vec![false; n_values];
        for &(v, t) in &s.masters {
            if v.index() >= n_values {
                return bad(format!(
                    "masters lists {v}, but the graph has {n_values} values"
                ));
            }
            let ty = &g.value(v).ty;
            if g.param_of(v).is_none() || ty.dtype == crate::DType::F32 {
                return bad(format!(
                    "masters lists {} ({ty}): only parameters narrower than f32 have an f32 \
                     master weight",
                    self.name(v)
                ));
            }
            match s.buffers.get(t.buffer.index()).map(|b| b.kind) {
                Some(BufferKind::OptimizerState { .. }) => {}
                Some(kind) => {
                    return bad(format!(
                        "the master weight of {} is in {} ({kind:?}), not an optimizer-state \
                         buffer",
                        self.name(v),
                        t.buffer
                    ))
                }
                None => {
                    return bad(format!(
                        "the master weight of {} is in {}, but there are {n_buffers} buffers",
                        self.name(v),
                        t.buffer
                    ))
                }
            }
            if std::mem::replace(&mut mastered[v.index()], true) {
                return bad(format!("masters lists {} twice", self.name(v)));
            }
        }
        for (_, op) in g.ops() {
            if let OpKind::AdamW { .. } = op.kind {
                let p = op.inputs[0];
                if g.value(p).ty.dtype != crate::DType::F32 && !mastered[p.index()] {
                    return bad(format!(
                        "AdamW updates {} ({}) but the schedule gives it no f32 master weight",
                        self.name(p),
                        g.value(p).ty
                    ));
                }
            }
        }
        for (v, value) in g.values() {
            if value.producer.is_none() && !homed[v.index()] {
                return bad(format!(
                    "{} ({}, {}) has no home: every input, parameter and optimizer state needs one",
                    self.name(v),
                    value.name,
                    value.role.name()
                ));
            }
        }
        if g.outputs().is_empty() {
            return bad("the graph has no output for `loss` to hold".into());
        }
        if s.loss.buffer.index() >= n_buffers {
            return bad(format!(
                "`loss` is in {}, but there are {n_buffers} buffers",
                s.loss.buffer
            ));
        }
        for (r, instr) in self.instrs() {
            let kind = s.streams[r.stream.index()].kind;
            let bad = |msg: String| Err(self.fail(Invariant::Ids, Some(r), msg));
            match instr {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => {
                    let space = match kind {
                        StreamKind::Compute => Space::Device,
                        StreamKind::HostOptimizer => Space::Host,
                        _ => {
                            return bad(format!(
                                "a kernel on a {} stream: kernels run on compute and host \
                                 optimizer streams",
                                stream_kind_name(kind)
                            ))
                        }
                    };
                    if op.index() >= n_ops {
                        return bad(format!("runs {op}, but the graph has {n_ops} ops"));
                    }
                    let o = g.op(*op);
                    if inputs.len() != o.inputs.len() || outputs.len() != o.outputs.len() {
                        return bad(format!(
                            "addresses {} inputs and {} outputs, its op has {} and {}",
                            inputs.len(),
                            outputs.len(),
                            o.inputs.len(),
                            o.outputs.len()
                        ));
                    }
                    for t in inputs.iter().chain(outputs).chain(workspace) {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "addresses {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                        let b = s.buffer(t.buffer);
                        if b.space != space {
                            return bad(format!(
                                "addresses {} ({}) in {} memory, but a kernel on a {} stream \
                                 works in {} memory",
                                t.buffer,
                                b.name,
                                space_name(b.space),
                                stream_kind_name(kind),
                                space_name(space)
                            ));
                        }
                    }
                    let need = self.workspace_need(*op);
                    match (need, workspace) {
                        (0, Some(w)) => {
                            return bad(format!(
                                "has a workspace ({}) but {} needs none",
                                w.buffer,
                                o.kind.mnemonic()
                            ))
                        }
                        (n, None) if n > 0 => {
                            return bad(format!(
                                "has no workspace but needs {} ({n} B)",
                                format_bytes(n)
                            ))
                        }
                        _ => {}
                    }
                }
                Instr::Copy {
                    what,
                    src,
                    dst,
                    bytes,
                } => {
                    let (from, to) = match kind {
                        StreamKind::HostToDevice => (Space::Host, Space::Device),
                        StreamKind::DeviceToHost => (Space::Device, Space::Host),
                        _ => {
                            return bad(format!(
                                "a copy on a {} stream: copies run on host-to-device and \
                                 device-to-host streams",
                                stream_kind_name(kind)
                            ))
                        }
                    };
                    for t in [src, dst] {
                        if t.buffer.index() >= n_buffers {
                            return bad(format!(
                                "copies via {}, but there are {n_buffers} buffers",
                                t.buffer
                            ));
                        }
                    }
                    let (sb, db) = (s.buffer(src.buffer), s.buffer(dst.buffer));
                    if sb.space != from || db.space != to {
                        return bad(format!(
                            "copies from {} ({}) to {} ({}) on a {} stream, which copies \
                             from {} to {}",
                            space_name(sb.space),
                            sb.name,
                            space_name(db.space),
                            db.name,
                            stream_kind_name(kind),
                            space_name(from),
                            space_name(to)
                        ));
                    }
                    let inbound = matches!(
                        what,
                        CopyKind::FetchChunk { .. } | CopyKind::ReloadActivation { .. }
                    );
                    if inbound != (kind == StreamKind::HostToDevice) {
                        return bad(format!(
                            "a {} copy goes the other way",
                            copy_label(*what, &self.names)
                        ));
                    }
                    match *what {
                        CopyKind::FetchChunk { chunk } | CopyKind::OffloadGrads { chunk } => {
                            if chunk.index() >= n_chunks {
                                return bad(format!(
                                    "copies {chunk}, but the chunk table has {n_chunks} chunks"
                                ));
                            }
                            if let CopyKind::FetchChunk { .. } = what {
                                let c = s.chunks.chunk(chunk);
                                if let Some(m) = c.members.iter().find(|m| {
                                    m.offset.checked_add(m.bytes).is_none_or(|e| e > *bytes)
                                }) {
                                    return bad(format!(
                                        "fetches {bytes} bytes of {chunk}, which leaves out \
                                         @{} at +{:#x}",
                                        g.param(m.param).name,
                                        m.offset
                                    ));
                                }
                            }
                        }
                        CopyKind::OffloadActivation { value }
                        | CopyKind::ReloadActivation { value }
                        | CopyKind::Scalar { value } => {
                            if value.index() >= n_values {
                                return bad(format!(
                                    "copies {value}, but the graph has {n_values} values"
                                ));
                            }
                            if *bytes != self.bytes(value) {
                                return bad(format!(
                                    "copies {bytes} bytes of {}, which has {}",
                                    self.name(value),
                                    self.bytes(value)
                                ));
                            }
                        }
                    }
                }
                Instr::Record { event } | Instr::Wait { event } => {
                    if event.0 >= s.events {
                        return bad(format!(
                            "uses e{}, but events are numbered 0..{}",
                            event.0, s.events
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    // 3. bounds ---------------------------------------------------------------------------

    fn bounds(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        for (i, b) in s.buffers.iter().enumerate() {
            let (limit, what) = match b.space {
                Space::Device => (s.arena_bytes, "the arena"),
                Space::Host => (s.host_bytes, "the host region"),
            };
            if b.offset.checked_add(b.size).is_none_or(|end| end > limit) {
                return Err(self.fail(
                    Invariant::Bounds,
                    None,
                    format!(
                        "buf{i} ({}) at {} {:#x} + {} B ends past {what} ({limit} B)",
                        b.name,
                        space_name(b.space),
                        b.offset,
                        b.size
                    ),
                ));
            }
        }
        // Whether `bytes` at `t` fit in its buffer; else a description of the overrun.
        let fits = |t: TensorRef, bytes: u64| -> Result<(), String> {
            let b = s.buffer(t.buffer);
            match t.offset.checked_add(bytes) {
                Some(end) if end <= b.size => Ok(()),
                _ => Err(format!(
                    "{} B at {}+{:#x} end past {} ({}, {} B)",
                    bytes, t.buffer, t.offset, t.buffer, b.name, b.size
                )),
            }
        };
        for &(v, t) in &s.homes {
            fits(t, self.bytes(v)).map_err(|e| {
                self.fail(
                    Invariant::Bounds,
                    None,
                    format!("the home of {}: {e}", self.name(v)),
                )
            })?;
        }
        for &(v, t) in &s.masters {
            fits(t, 4 * self.g.value(v).ty.numel()).map_err(|e| {
                self.fail(
                    Invariant::Bounds,
                    None,
                    format!("the master weight of {}: {e}", self.name(v)),
                )
            })?;
        }
        let loss = self.loss_value();
        fits(s.loss, self.bytes(loss)).map_err(|e| {
            self.fail(
                Invariant::Bounds,
                None,
                format!("`loss` ({}): {e}", self.name(loss)),
            )
        })?;
        for (r, instr) in self.instrs() {
            let bad = |e: String| self.fail(Invariant::Bounds, Some(r), e);
            match instr {
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => {
                    let o = self.g.op(*op);
                    for (what, vs, ts) in [
                        ("reads", &o.inputs, inputs),
                        ("writes", &o.outputs, outputs),
                    ] {
                        for (&v, &t) in vs.iter().zip(ts.iter()) {
                            fits(t, self.bytes(v))
                                .map_err(|e| bad(format!("{what} {}: {e}", self.name(v))))?;
                        }
                    }
                    if let Some(w) = workspace {
                        fits(*w, self.workspace_need(*op))
                            .map_err(|e| bad(format!("workspace: {e}")))?;
                    }
                }
                Instr::Copy {
                    src, dst, bytes, ..
                } => {
                    fits(*src, *bytes).map_err(|e| bad(format!("source: {e}")))?;
                    fits(*dst, *bytes).map_err(|e| bad(format!("destination: {e}")))?;
                }
                Instr::Record { .. } | Instr::Wait { .. } => {}
            }
        }
        Ok(())
    }

    // 4. budget ---------------------------------------------------------------------------

    fn budget(&self) -> Result<(), ScheduleError> {
        let (s, h) = (self.s, &self.s.header);
        for (what, used, budget) in [
            ("device arena", s.arena_bytes, h.device_budget_bytes),
            ("host region", s.host_bytes, h.host_budget_bytes),
        ] {
            if used > budget {
                return Err(self.fail(
                    Invariant::Budget,
                    None,
                    format!(
                        "the {what} takes {}, over its budget of {}",
                        exact_bytes(used),
                        exact_bytes(budget)
                    ),
                ));
            }
        }
        Ok(())
    }

    // 5. coverage -------------------------------------------------------------------------

    fn coverage(&self) -> Result<(), ScheduleError> {
        let mut ran: Vec<Option<InstrRef>> = vec![None; self.g.op_count()];
        for (r, instr) in self.instrs() {
            if let Instr::Kernel { op, .. } = instr {
                if let Some(first) = ran[op.index()].replace(r) {
                    return Err(self.fail(
                        Invariant::Coverage,
                        Some(r),
                        format!("runs {op} a second time (first at {})", self.at(first)),
                    ));
                }
            }
        }
        if let Some(i) = ran.iter().position(Option::is_none) {
            let op = OpId::new(i);
            return Err(self.fail(
                Invariant::Coverage,
                None,
                format!(
                    "{op} ({}, {} phase) never runs: every op of the graph runs exactly once",
                    self.describe_op(op),
                    self.g.op(op).phase
                ),
            ));
        }
        Ok(())
    }

    // 6. events ---------------------------------------------------------------------------

    fn records(&self) -> Vec<Option<InstrRef>> {
        let mut records = vec![None; self.s.events as usize];
        for (r, instr) in self.instrs() {
            if let Instr::Record { event } = instr {
                records[event.index()].get_or_insert(r);
            }
        }
        records
    }

    fn events(&self) -> Result<(), ScheduleError> {
        let n = self.s.events as usize;
        let mut records: Vec<Option<InstrRef>> = vec![None; n];
        let mut first_wait: Vec<Option<InstrRef>> = vec![None; n];
        for (r, instr) in self.instrs() {
            match instr {
                Instr::Record { event } => {
                    if let Some(first) = records[event.index()].replace(r) {
                        return Err(self.fail(
                            Invariant::Events,
                            Some(r),
                            format!(
                                "records e{} a second time (first at {})",
                                event.0,
                                self.at(first)
                            ),
                        ));
                    }
                }
                Instr::Wait { event } => {
                    first_wait[event.index()].get_or_insert(r);
                }
                _ => {}
            }
        }
        for e in 0..n {
            match (records[e], first_wait[e]) {
                (None, Some(w)) => {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(w),
                        format!("waits for e{e}, which no stream records"),
                    ))
                }
                (None, None) => {
                    return Err(self.fail(
                        Invariant::Events,
                        None,
                        format!(
                            "e{e} is never recorded nor waited for: events are numbered \
                             0..{n}, all used",
                        ),
                    ))
                }
                (Some(rec), None) => {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(rec),
                        format!("records e{e}, which no stream waits for"),
                    ))
                }
                (Some(_), Some(_)) => {}
            }
        }
        for (r, instr) in self.instrs() {
            if let Instr::Wait { event } = instr {
                let rec = records[event.index()].expect("checked above");
                if rec.stream == r.stream && rec.index > r.index {
                    return Err(self.fail(
                        Invariant::Events,
                        Some(r),
                        format!(
                            "waits for e{}, which this stream records later (#{}): it would \
                             wait forever",
                            event.0, rec.index
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    // 7. deadlock -------------------------------------------------------------------------

    fn deadlock(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        let records = self.records();
        let mut recorded = vec![false; s.events as usize];
        let mut pc = vec![0usize; s.streams.len()];
        loop {
            let mut progress = false;
            for (si, stream) in s.streams.iter().enumerate() {
                while let Some(instr) = stream.instrs.get(pc[si]) {
                    match instr {
                        Instr::Wait { event } if !recorded[event.index()] => break,
                        Instr::Record { event } => recorded[event.index()] = true,
                        _ => {}
                    }
                    pc[si] += 1;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        let mut blocked = Vec::new();
        let mut first = None;
        for (si, stream) in s.streams.iter().enumerate() {
            if let Some(Instr::Wait { event }) = stream.instrs.get(pc[si]) {
                let r = InstrRef {
                    stream: StreamId::new(si),
                    index: pc[si] as u32,
                };
                first.get_or_insert(r);
                let rec = records[event.index()].expect("events checked");
                blocked.push(format!(
                    "stream {} #{} waits for e{}, which stream {} records at #{}",
                    stream.name,
                    pc[si],
                    event.0,
                    s.streams[rec.stream.index()].name,
                    rec.index
                ));
            }
        }
        match first {
            None => Ok(()),
            Some(r) => Err(ScheduleError {
                invariant: Invariant::Deadlock,
                at: Some(r),
                message: format!("deadlock: no stream can go on: {}", blocked.join("; ")),
            }),
        }
    }

    // 8. homes ----------------------------------------------------------------------------

    fn homes(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        // Homes and master weights (`true`), which must not overlap each other either.
        let mut spans: Vec<(Span, ValueId, bool)> = s
            .homes
            .iter()
            .map(|&(v, t)| (self.span(t, self.bytes(v)), v, false))
            .chain(
                s.masters
                    .iter()
                    .map(|&(v, t)| (self.span(t, 4 * self.g.value(v).ty.numel()), v, true)),
            )
            .filter(|((_, a, b), _, _)| a < b)
            .collect();
        spans.sort_by_key(|&((space, a, b), v, master)| (space, a, b, v, master));
        let what = |v: ValueId, master: bool| match master {
            true => format!("the master weight of {}", self.name(v)),
            false => format!("the home of {}", self.name(v)),
        };
        for pair in spans.windows(2) {
            let ((x, v, vm), (y, w, wm)) = (pair[0], pair[1]);
            if overlaps(x, y) {
                return Err(self.fail(
                    Invariant::Homes,
                    None,
                    format!(
                        "{} ({}) and {} ({}) overlap",
                        what(v, vm),
                        Self::range(x.0, x.1, x.2),
                        what(w, wm),
                        Self::range(y.0, y.1, y.2)
                    ),
                ));
            }
        }
        let home_of = self.home_of();
        for (r, instr) in self.instrs() {
            let Instr::Kernel { op, inputs, .. } = instr else {
                continue;
            };
            let o = self.g.op(*op);
            for &j in o.kind.writes_inputs() {
                let (Some(&v), Some(&t)) = (o.inputs.get(j), inputs.get(j)) else {
                    continue;
                };
                let (space, a) = s.address(t);
                let Some(home) = home_of[v.index()] else {
                    return Err(self.fail(
                        Invariant::Homes,
                        Some(r),
                        format!(
                            "updates {} in place, but it has no home for the next step to \
                             read it from",
                            self.name(v)
                        ),
                    ));
                };
                let (hs, ha) = s.address(home);
                if (space, a) != (hs, ha) {
                    return Err(self.fail(
                        Invariant::Homes,
                        Some(r),
                        format!(
                            "updates {} in place at {} {a:#x}, but its home is at {} {ha:#x}: \
                             the next step would not see the update",
                            self.name(v),
                            space_name(space),
                            space_name(hs)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    // 9. data flow ------------------------------------------------------------------------

    fn data_flow(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        let n = s.streams.len();
        let mut mem = [Memory::new(n), Memory::new(n)];
        for &(v, t) in &s.homes {
            let (space, a, b) = self.span(t, self.bytes(v));
            if a < b {
                mem[space_index(space)].segments.insert(
                    a,
                    Segment {
                        end: b,
                        content: Content::Value {
                            value: v,
                            base: a,
                            updated: false,
                        },
                        writer: Writer::Home,
                        readers: vec![0; n].into_boxed_slice(),
                    },
                );
            }
        }
        let mut pc = vec![0usize; n];
        let mut clocks = vec![vec![0u32; n]; n];
        let mut event_clocks: Vec<Option<Vec<u32>>> = vec![None; s.events as usize];
        loop {
            let next = (0..n).find(|&si| match s.streams[si].instrs.get(pc[si]) {
                None => false,
                Some(Instr::Wait { event }) => event_clocks[event.index()].is_some(),
                Some(_) => true,
            });
            let Some(si) = next else { break };
            let r = InstrRef {
                stream: StreamId::new(si),
                index: pc[si] as u32,
            };
            clocks[si][si] = r.index + 1;
            match self.instr(r) {
                Instr::Wait { event } => {
                    let theirs = event_clocks[event.index()].as_ref().expect("recorded");
                    for (mine, &t) in clocks[si].iter_mut().zip(theirs) {
                        *mine = (*mine).max(t);
                    }
                }
                Instr::Record { event } => event_clocks[event.index()] = Some(clocks[si].clone()),
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => self.kernel(
                    &mut mem,
                    r,
                    &clocks[si],
                    &pc,
                    *op,
                    inputs,
                    outputs,
                    *workspace,
                )?,
                Instr::Copy {
                    what,
                    src,
                    dst,
                    bytes,
                } => self.copy(&mut mem, r, &clocks[si], &pc, *what, *src, *dst, *bytes)?,
            }
            pc[si] += 1;
        }
        debug_assert!((0..n).all(|si| pc[si] == s.streams[si].instrs.len()));
        self.end_of_step(&mut mem)
    }

    /// Checks that `[a, b)` holds all of `v` (based at `a`), not updated unless
    /// `updated_ok`; the first thing found instead otherwise.
    fn holds(mem: &mut Memory, v: ValueId, a: u64, b: u64, updated_ok: bool) -> Result<(), Found> {
        mem.isolate(a, b);
        let mut pos = a;
        for (start, seg) in mem.within(a, b) {
            if start > pos {
                return Err(Found::Nothing);
            }
            match seg.content {
                Content::Value {
                    value,
                    base,
                    updated,
                } if value == v && base == a && (updated_ok || !updated) => {}
                other => return Err(Found::Other(other, seg.writer)),
            }
            pos = seg.end;
        }
        if pos < b {
            return Err(Found::Nothing);
        }
        Ok(())
    }

    /// Checks a read of `v` at `[a, b)` by `r`: the value is there and its writers are
    /// ordered before `r`.
    #[allow(clippy::too_many_arguments)]
    fn check_read(
        &self,
        mem: &mut Memory,
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        v: ValueId,
        space: Space,
        a: u64,
        b: u64,
    ) -> Result<(), ScheduleError> {
        if a == b {
            return Ok(());
        }
        let found = match Self::holds(mem, v, a, b, false) {
            Err(found) => Some(found),
            Ok(()) => mem.within(a, b).find_map(|(_, seg)| match seg.writer {
                Writer::Instr(w) if !hb(w, clock) => Some(Found::Unordered(w)),
                _ => None,
            }),
        };
        match found {
            None => Ok(()),
            Some(found) => Err(self.bad_read(r, pc, v, space, a, b, found)),
        }
    }

    fn describe_content(&self, c: Content) -> String {
        match c {
            Content::Value {
                value,
                updated: true,
                ..
            } => format!("{} as updated in place", self.name(value)),
            Content::Value { value, .. } => self.name(value).to_string(),
            Content::Scratch => "kernel scratch".into(),
            Content::Undefined => "undefined bytes".into(),
        }
    }

    fn describe_writer(&self, w: Writer) -> String {
        match w {
            Writer::Home => "placed there before the step".into(),
            Writer::Instr(r) => format!("written by {}", self.at(r)),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn bad_read(
        &self,
        r: InstrRef,
        pc: &[usize],
        v: ValueId,
        space: Space,
        a: u64,
        b: u64,
        found: Found,
    ) -> ScheduleError {
        let what = format!("reads {} at {}", self.name(v), Self::range(space, a, b));
        let msg = match found {
            Found::Unordered(w) => format!(
                "{what}, written by {}, but is not ordered after that write: a missing wait?",
                self.at(w)
            ),
            Found::Nothing => format!(
                "{what} but that memory holds nothing{}",
                self.hint(pc, v, space, a)
            ),
            Found::Other(
                Content::Value {
                    value,
                    base,
                    updated: false,
                },
                writer,
            ) if value == v => format!(
                "{what} but that memory holds {} from {} {base:#x} on ({}): a misplaced \
                 address",
                self.name(v),
                space_name(space),
                self.describe_writer(writer)
            ),
            Found::Other(content, writer) => format!(
                "{what} but that memory holds {} ({}){}",
                self.describe_content(content),
                self.describe_writer(writer),
                self.hint(pc, v, space, a)
            ),
        };
        self.fail(Invariant::DataFlow, Some(r), msg)
    }

    /// Why `v` is not at `space` `a` when read: who would have put it there.
    fn hint(&self, pc: &[usize], v: ValueId, space: Space, a: u64) -> String {
        let at = |t: TensorRef| self.s.address(t) == (space, a);
        let mut offload = None;
        for (r, instr) in self.instrs() {
            let writes = match instr {
                Instr::Kernel { op, outputs, .. } => {
                    let o = self.g.op(*op);
                    o.outputs
                        .iter()
                        .zip(outputs)
                        .any(|(&out, &t)| out == v && at(t))
                }
                Instr::Copy { what, dst, .. } => match *what {
                    CopyKind::ReloadActivation { value } | CopyKind::Scalar { value } => {
                        value == v && at(*dst)
                    }
                    CopyKind::OffloadActivation { value } => {
                        if value == v {
                            offload.get_or_insert(r);
                        }
                        value == v && at(*dst)
                    }
                    CopyKind::FetchChunk { chunk } => {
                        let (ds, da) = self.s.address(*dst);
                        self.s.chunks.chunk(chunk).members.iter().any(|m| {
                            self.g.param(m.param).value == v && (ds, da + m.offset) == (space, a)
                        })
                    }
                    CopyKind::OffloadGrads { .. } => false,
                },
                Instr::Record { .. } | Instr::Wait { .. } => false,
            };
            if writes {
                return if (r.index as usize) < pc[r.stream.index()] {
                    format!(
                        "; {} put it there, but it was overwritten before this read: \
                         overlapping live buffers, or a release before its last use?",
                        self.at(r)
                    )
                } else {
                    format!(
                        "; {} puts it there, but is not ordered before this read: a missing \
                         wait?",
                        self.at(r)
                    )
                };
            }
        }
        if self
            .s
            .homes
            .iter()
            .any(|&(hv, t)| hv == v && self.s.address(t) == (space, a))
        {
            return format!(
                "; that is the home of {}, overwritten before this read: overlapping live \
                 buffers?",
                self.name(v)
            );
        }
        match offload {
            Some(o) => format!(
                "; {} is offloaded ({}) but never reloaded there",
                self.name(v),
                self.at(o)
            ),
            None => format!("; nothing writes {} there", self.name(v)),
        }
    }

    /// Checks that `w` may overwrite `[a, b)` (isolated): every earlier write and read of
    /// those bytes happens before it.
    fn check_write(
        &self,
        mem: &mut Memory,
        w: InstrRef,
        clock: &[u32],
        space: Space,
        a: u64,
        b: u64,
    ) -> Result<(), ScheduleError> {
        mem.isolate(a, b);
        for (start, seg) in mem.within(a, b) {
            let range = Self::range(space, start, seg.end);
            let content = self.describe_content(seg.content);
            if let Writer::Instr(prev) = seg.writer {
                if !hb(prev, clock) {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(w),
                        format!(
                            "overwrites {content} at {range}, written by {}, which is not \
                             ordered before this write: overlapping live buffers, or a \
                             missing wait?",
                            self.at(prev)
                        ),
                    ));
                }
            }
            for (si, &last) in seg.readers.iter().enumerate() {
                if last > clock[si] {
                    let reader = InstrRef {
                        stream: StreamId::new(si),
                        index: last - 1,
                    };
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(w),
                        format!(
                            "overwrites {content} at {range} while {} may still read it: \
                             nothing orders that read before this write (a release before \
                             its last use, or a missing wait?)",
                            self.at(reader)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn kernel(
        &self,
        mem: &mut [Memory; 2],
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        op: OpId,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
        workspace: Option<TensorRef>,
    ) -> Result<(), ScheduleError> {
        let o = self.g.op(op);
        let mut reads = Vec::with_capacity(inputs.len());
        for (&v, &t) in o.inputs.iter().zip(inputs) {
            let (space, a, b) = self.span(t, self.bytes(v));
            self.check_read(&mut mem[space_index(space)], r, clock, pc, v, space, a, b)?;
            reads.push((space, a, b));
        }
        let mut writes: Vec<KernelWrite> = Vec::with_capacity(o.outputs.len() + 1);
        for (&v, &t) in o.outputs.iter().zip(outputs) {
            let span = self.span(t, self.bytes(v));
            let content = Content::Value {
                value: v,
                base: span.1,
                updated: false,
            };
            writes.push(KernelWrite {
                span,
                content,
                in_place_of: None,
            });
        }
        if let Some(w) = workspace {
            let span = self.span(w, self.workspace_need(op));
            writes.push(KernelWrite {
                span,
                content: Content::Scratch,
                in_place_of: None,
            });
        }
        for &j in o.kind.writes_inputs() {
            if let (Some(&span), Some(&v)) = (reads.get(j), o.inputs.get(j)) {
                let content = Content::Value {
                    value: v,
                    base: span.1,
                    updated: true,
                };
                writes.push(KernelWrite {
                    span,
                    content,
                    in_place_of: Some(j),
                });
            }
        }
        let what = |w: &KernelWrite| match (w.content, w.in_place_of) {
            (Content::Value { value, .. }, Some(_)) => format!("{} in place", self.name(value)),
            (Content::Value { value, .. }, None) => self.name(value).to_string(),
            _ => "its workspace".into(),
        };
        for (k, w) in writes.iter().enumerate() {
            let span = w.span;
            for (j, (&read, &v)) in reads.iter().zip(&o.inputs).enumerate() {
                if w.in_place_of != Some(j) && overlaps(span, read) {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "writes {} at {}, which overlaps its input {} at {}: a kernel's \
                             outputs must not alias its inputs",
                            what(w),
                            Self::range(span.0, span.1, span.2),
                            self.name(v),
                            Self::range(read.0, read.1, read.2)
                        ),
                    ));
                }
            }
            for other in &writes[k + 1..] {
                if overlaps(span, other.span) {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "writes {} at {} and {} at {}, which overlap",
                            what(w),
                            Self::range(span.0, span.1, span.2),
                            what(other),
                            Self::range(other.span.0, other.span.1, other.span.2)
                        ),
                    ));
                }
            }
        }
        for &(space, a, b) in &reads {
            if a < b {
                mem[space_index(space)].read(a, b, r);
            }
        }
        for KernelWrite {
            span: (space, a, b),
            content,
            ..
        } in writes
        {
            if a < b {
                let m = &mut mem[space_index(space)];
                self.check_write(m, r, clock, space, a, b)?;
                m.write(a, b, &[(0, b - a, content)], r);
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        mem: &mut [Memory; 2],
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        what: CopyKind,
        src: TensorRef,
        dst: TensorRef,
        bytes: u64,
    ) -> Result<(), ScheduleError> {
        if bytes == 0 {
            return Ok(());
        }
        let (ss, sa, sb) = self.span(src, bytes);
        let (ds, da, db) = self.span(dst, bytes);
        let from = &mut mem[space_index(ss)];
        match what {
            CopyKind::OffloadActivation { value }
            | CopyKind::ReloadActivation { value }
            | CopyKind::Scalar { value } => {
                self.check_read(from, r, clock, pc, value, ss, sa, sb)?;
            }
            CopyKind::FetchChunk { chunk } => {
                for m in &self.s.chunks.chunk(chunk).members {
                    let v = self.g.param(m.param).value;
                    let a = sa + m.offset;
                    self.check_read(from, r, clock, pc, v, ss, a, a + m.bytes)?;
                }
            }
            CopyKind::OffloadGrads { .. } => {}
        }
        // A chunk copy moves the whole chunk, padding between its members included; whatever
        // the padding holds (a kernel's scratch from before the chunk's buffer was live) is
        // copied as undefined bytes, which nothing reads.
        let members: Vec<(u64, u64)> = match what {
            CopyKind::FetchChunk { chunk } | CopyKind::OffloadGrads { chunk } => self
                .s
                .chunks
                .chunk(chunk)
                .members
                .iter()
                .map(|m| (sa + m.offset, sa + m.offset + m.bytes))
                .collect(),
            _ => Vec::new(),
        };
        let padding = |a: u64, b: u64| {
            !members.is_empty() && members.iter().all(|&(ma, mb)| b <= ma || a >= mb)
        };
        from.isolate(sa, sb);
        let mut pieces = Vec::new();
        let mut pos = sa;
        for (start, seg) in from.within(sa, sb) {
            if let Writer::Instr(w) = seg.writer {
                if !hb(w, clock) {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "copies {} at {}, written by {}, but is not ordered after that \
                             write: a missing wait?",
                            self.describe_content(seg.content),
                            Self::range(ss, start, seg.end),
                            self.at(w)
                        ),
                    ));
                }
            }
            let content = match seg.content {
                Content::Scratch if padding(start, seg.end) => Content::Undefined,
                Content::Scratch => {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "copies kernel scratch at {} ({})",
                            Self::range(ss, start, seg.end),
                            self.describe_writer(seg.writer)
                        ),
                    ))
                }
                Content::Value {
                    value,
                    base,
                    updated,
                } => Content::Value {
                    value,
                    base: base.wrapping_add(da.wrapping_sub(sa)),
                    updated,
                },
                Content::Undefined => Content::Undefined,
            };
            if start > pos {
                pieces.push((pos - sa, start - sa, Content::Undefined));
            }
            pieces.push((start - sa, seg.end - sa, content));
            pos = seg.end;
        }
        if pos < sb {
            pieces.push((pos - sa, sb - sa, Content::Undefined));
        }
        from.read(sa, sb, r);
        let to = &mut mem[space_index(ds)];
        self.check_write(to, r, clock, ds, da, db)?;
        to.write(da, db, &pieces, r);
        Ok(())
    }

    // 10. end of step ---------------------------------------------------------------------

    fn end_of_step(&self, mem: &mut [Memory; 2]) -> Result<(), ScheduleError> {
        let s = self.s;
        let loss = self.loss_value();
        let (space, a, b) = self.span(s.loss, self.bytes(loss));
        if let Err(found) = Self::holds(&mut mem[space_index(space)], loss, a, b, false) {
            return Err(self.fail(
                Invariant::EndOfStep,
                None,
                format!(
                    "at the end of the step `loss` ({}) holds {}, not the loss {}",
                    Self::range(space, a, b),
                    self.describe_found(&found),
                    self.name(loss)
                ),
            ));
        }
        for &(v, t) in &s.homes {
            if self.g.value(v).role == Role::Input {
                continue;
            }
            let (space, a, b) = self.span(t, self.bytes(v));
            if a == b {
                continue;
            }
            if let Err(found) = Self::holds(&mut mem[space_index(space)], v, a, b, true) {
                return Err(self.fail(
                    Invariant::EndOfStep,
                    None,
                    format!(
                        "at the end of the step the home of {} ({}) holds {}: the next step \
                         would read that as {}",
                        self.name(v),
                        Self::range(space, a, b),
                        self.describe_found(&found),
                        self.name(v)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn describe_found(&self, found: &Found) -> String {
        match *found {
            Found::Nothing => "nothing".into(),
            Found::Other(content, writer) => format!(
                "{} ({})",
                self.describe_content(content),
                self.describe_writer(writer)
            ),
            Found::Unordered(w) => format!("a value written by {}", self.at(w)),
        }
    }
}
