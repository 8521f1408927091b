//! The data-flow checks: homes, then the step executed over the byte model of `memory.rs`
//! (every read finds its value, written before it; no write races a read or a write), then
//! what the step leaves behind.

use super::memory::{hb, space_index, Content, Memory, Segment, Writer};
use super::{overlaps, Checker, InstrRef, Invariant, ScheduleError, Span};
use crate::graph::Role;
use crate::ids::{BufferId, OpId, StreamId, ValueId};
use crate::op::OpKind;
use crate::print_schedule::space_name;
use crate::schedule::{BufferKind, CopyKind, Instr, ShardPart, Space, TensorRef};
use std::collections::HashMap;

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

impl Checker<'_> {
    // 10. homes ---------------------------------------------------------------------------

    pub(super) fn homes(&self) -> Result<(), ScheduleError> {
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
                // The 12-byte layout: a staged parameter has no home; its AdamW writes the
                // rounded parameter over the gradient it read in a gradient staging buffer
                // (a write nothing reads: the master weight carries the update).
                let staged = j == 0
                    && home_of[v.index()].is_none()
                    && inputs.get(1) == Some(&t)
                    && matches!(s.buffer(t.buffer).kind, BufferKind::GradStaging { .. });
                if staged {
                    continue;
                }
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
                // The disk tier: a moment whose home is on disk is updated in the staging
                // buffer its chunk's state is read into, at its home's offset there (data
                // flow checks that a write carries the update home).
                if hs == Space::Disk {
                    // A sharded chunk's state parts are shards each in its own staging ring.
                    let staged = match (s.buffer(home.buffer).kind, s.buffer(t.buffer).kind) {
                        (_, BufferKind::DiskStaging { .. }) => true,
                        (
                            BufferKind::HostShard { part, .. },
                            BufferKind::ShardStaging { part: p, .. },
                        ) => p == part,
                        _ => false,
                    } && t.offset == home.offset;
                    if !staged {
                        return Err(self.fail(
                            Invariant::Homes,
                            Some(r),
                            format!(
                                "updates {} in place at {} {a:#x}, but its home is on disk \
                                 (disk {ha:#x}): it must be updated in a disk staging \
                                 buffer, at its offset in its chunk's state ({:#x})",
                                self.name(v),
                                space_name(space),
                                home.offset
                            ),
                        ));
                    }
                    // The master weight rides in the same state: the runtime finds it in the
                    // staging buffer at its offset in the disk buffer of `m`'s home. (A
                    // parameter whose storage is on disk is the update's narrow operand,
                    // not a moment: its master is the moments' business.)
                    let param = o.inputs[0];
                    let master = (v != param)
                        .then(|| s.masters.iter().find(|&&(p, _)| p == param))
                        .flatten();
                    // A sharded chunk's master weights are a shard of their own, staged
                    // in the master ring's buffer of the moments' slot.
                    let sharded_master = |mt: TensorRef| {
                        let m = s.buffer(mt.buffer);
                        let of_chunk = |b: BufferId| match s.buffer(b).kind {
                            BufferKind::HostShard { chunk, .. } => Some(chunk),
                            _ => None,
                        };
                        matches!(
                            m.kind,
                            BufferKind::HostShard {
                                part: ShardPart::Master,
                                ..
                            }
                        ) && m.space == Space::Disk
                            && of_chunk(mt.buffer) == of_chunk(home.buffer)
                            && match s.buffer(t.buffer).kind {
                                BufferKind::ShardStaging {
                                    part: ShardPart::AdamM,
                                    ..
                                } => s
                                    .shard_master_staging(t.buffer)
                                    .is_some_and(|b| s.buffer(b).size >= m.size),
                                _ => true,
                            }
                    };
                    if let Some(&(_, mt)) = master {
                        if mt.buffer != home.buffer && !sharded_master(mt) {
                            return Err(self.fail(
                                Invariant::Homes,
                                Some(r),
                                format!(
                                    "updates {} in a disk staging buffer, but the master \
                                     weight of {} is not in the same disk state as it: the \
                                     staging buffer would not hold it",
                                    self.name(v),
                                    self.name(param)
                                ),
                            ));
                        }
                    }
                    continue;
                }
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

    // 11. data flow -----------------------------------------------------------------------

    pub(super) fn data_flow(&self) -> Result<(), ScheduleError> {
        let s = self.s;
        let n = s.streams.len();
        let mut mem = [Memory::new(n), Memory::new(n), Memory::new(n)];
        // The homes, and (the 12-byte layout) the master weights of staged chunks, which casts
        // read and AdamW updates: each holds its value from the start of the step.
        let staged = self.staged_masters();
        let held = s.homes.iter().map(|&(v, t)| (v, t, self.bytes(v))).chain(
            staged
                .iter()
                .map(|(&v, &t)| (v, t, 4 * self.g.value(v).ty.numel())),
        );
        for (v, t, bytes) in held {
            let (space, a, b) = self.span(t, bytes);
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
        if self.part != super::Part::Update {
            self.carried_at_start(&mut mem, &mut pc, &mut clocks);
        }
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
                // Each part is checked on its own (see `Checker::phases`).
                Instr::EndMicroBatch { .. } => {}
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                } => self.kernel(
                    &mut mem,
                    (r, &clocks[si], &pc),
                    &staged,
                    *op,
                    inputs,
                    outputs,
                    *workspace,
                )?,
                Instr::CastChunk {
                    chunk,
                    src,
                    dst,
                    bytes,
                } => self.cast(&mut mem, r, &clocks[si], &pc, *chunk, *src, *dst, *bytes)?,
                Instr::Copy {
                    what,
                    src,
                    dst,
                    bytes,
                } => self.copy(&mut mem, r, &clocks[si], &pc, *what, *src, *dst, *bytes)?,
                Instr::AllReduce { value, at } => {
                    self.all_reduce(&mut mem, r, &clocks[si], &pc, *value, *at)?
                }
                Instr::CopyShard {
                    what,
                    src,
                    dst,
                    bytes,
                } => self.copy_shard(&mut mem, r, &clocks[si], &pc, *what, *src, *dst, *bytes)?,
                Instr::AllGather { chunk, at, bytes } => {
                    self.gather_or_scatter(&mut mem, r, &clocks[si], *chunk, *at, *bytes, true)?
                }
                Instr::ReduceScatter {
                    chunk, at, bytes, ..
                } => {
                    self.gather_or_scatter(&mut mem, r, &clocks[si], *chunk, *at, *bytes, false)?
                }
                Instr::DiskRead {
                    src, dst, bytes, ..
                } => self.disk_copy(&mut mem, r, &clocks[si], *src, *dst, *bytes, false)?,
                Instr::DiskWrite {
                    src, dst, bytes, ..
                } => self.disk_copy(&mut mem, r, &clocks[si], *src, *dst, *bytes, true)?,
            }
            pc[si] += 1;
        }
        debug_assert!((0..n).all(|si| pc[si] == s.streams[si].instrs.len()));
        if self.part != super::Part::MicroBatch {
            self.write_carried_at_end(&mut mem, &clocks)?;
        }
        self.end_of_step(&mut mem)
    }

    /// The staging and disk spans of a carried write (a shard's: every rank's slice).
    fn carried_spans(&self, instr: &Instr) -> Option<(Span, Span)> {
        let Instr::DiskWrite {
            src, dst, bytes, ..
        } = *instr
        else {
            return None;
        };
        let bytes = match self.s.buffer(dst.buffer).kind.is_sharded() {
            true => bytes * u64::from(self.s.ranks()),
            false => bytes,
        };
        Some((self.span(src, bytes), self.span(dst, bytes)))
    }

    /// The carried writes as the step starts (they lead their streams: the ids check): each
    /// reads its staging buffer, which holds the previous step's update, and writes what the
    /// disk held at the end of the previous step, which the model takes as the start's
    /// content. So nothing may overwrite the staging buffer, or read or write the disk
    /// bytes, before it unless ordered after it (a reuse of the staging buffer must wait for
    /// the write; a read of the chunk from disk must come after it in the stream). Moves
    /// the streams past them.
    fn carried_at_start(&self, mem: &mut [Memory; 3], pc: &mut [usize], clocks: &mut [Vec<u32>]) {
        let n = self.s.streams.len();
        for (si, stream) in self.s.streams.iter().enumerate() {
            for (i, instr) in stream.instrs.iter().enumerate() {
                if !matches!(instr, Instr::DiskWrite { carried: true, .. }) {
                    break;
                }
                let Some((staging, disk)) = self.carried_spans(instr) else {
                    break;
                };
                let r = InstrRef {
                    stream: StreamId::new(si),
                    index: i as u32,
                };
                for ((space, a, b), writer) in [(staging, None), (disk, Some(r))] {
                    let m = &mut mem[space_index(space)];
                    m.isolate(a, b);
                    // Bytes nothing wrote yet come to hold undefined bytes, so that the
                    // write's read and write of them are tracked as of any other bytes.
                    let mut gaps = Vec::new();
                    let mut pos = a;
                    for (start, seg) in m.within(a, b) {
                        if start > pos {
                            gaps.push((pos, start));
                        }
                        pos = seg.end;
                    }
                    if pos < b {
                        gaps.push((pos, b));
                    }
                    for (ga, gb) in gaps {
                        m.segments.insert(
                            ga,
                            Segment {
                                end: gb,
                                content: Content::Undefined,
                                writer: Writer::Home,
                                readers: vec![0; n].into_boxed_slice(),
                            },
                        );
                    }
                    for (_, seg) in m.segments.range_mut(a..b) {
                        match writer {
                            Some(w) => seg.writer = Writer::Instr(w),
                            None => seg.readers[si] = seg.readers[si].max(r.index + 1),
                        }
                    }
                }
                pc[si] = i + 1;
                clocks[si][si] = r.index + 1;
            }
        }
    }

    /// The carried writes as the runtime runs them after the step (before the next step's
    /// other work; its barrier orders them after everything in this one): each copies its
    /// staging buffer to disk, so the staging buffer must still hold the chunk's updated
    /// state, which **end of step** then finds at its disk home.
    fn write_carried_at_end(
        &self,
        mem: &mut [Memory; 3],
        clocks: &[Vec<u32>],
    ) -> Result<(), ScheduleError> {
        let n = self.s.streams.len();
        let mut barrier = vec![0u32; n];
        for clock in clocks {
            for (b, &c) in barrier.iter_mut().zip(clock) {
                *b = (*b).max(c);
            }
        }
        for si in 0..n {
            let stream = StreamId::new(si);
            let mine: Vec<&Instr> = self
                .carried
                .iter()
                .filter(|(s, _)| *s == stream)
                .map(|&(_, i)| i)
                .collect();
            for (j, instr) in mine.into_iter().enumerate() {
                let Instr::DiskWrite {
                    src, dst, bytes, ..
                } = *instr
                else {
                    continue;
                };
                let r = self.end_ref(stream, j);
                barrier[si] = r.index + 1;
                self.disk_copy(mem, r, &barrier, src, dst, bytes, true)?;
            }
        }
        Ok(())
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
        // Sharded chunks: what one rank's shard copy wrote is its slice alone until the
        // all-gather; what a reduce-scatter wrote is summed in the rank's slice alone.
        if found.is_none() {
            for (_, seg) in mem.within(a, b) {
                let Writer::Instr(w) = seg.writer else {
                    continue;
                };
                let problem = match self.instr(w) {
                    Instr::CopyShard {
                        what: CopyKind::FetchChunk { .. },
                        ..
                    } => {
                        "but each rank has written only its own slice there: an all-gather \
                         must come between (and be waited for)"
                    }
                    Instr::ReduceScatter { .. } => {
                        "but a reduce-scatter left the sum only in each rank's own slice \
                         there: read it after offloading that slice"
                    }
                    _ => continue,
                };
                return Err(self.fail(
                    Invariant::DataFlow,
                    Some(r),
                    format!(
                        "reads {} at {}, written by {}, {problem}",
                        self.name(v),
                        Self::range(space, a, b),
                        self.at(w)
                    ),
                ));
            }
        }
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
        // The 14-byte host layout's hazard: the chunk's gradients arrived in its parameter
        // storage before this read of its parameters.
        if let Found::Other(content, Writer::Instr(w)) = found {
            let offload = self.s.streams[w.stream.index()]
                .instrs
                .get(w.index as usize)
                .and_then(|i| match i {
                    Instr::Copy {
                        what: CopyKind::OffloadGrads { chunk },
                        ..
                    }
                    | Instr::CopyShard {
                        what: CopyKind::OffloadGrads { chunk },
                        ..
                    } => Some(*chunk),
                    _ => None,
                });
            if let Some(chunk) = offload {
                return self.fail(
                    Invariant::DataFlow,
                    Some(r),
                    format!(
                        "{what} but that memory holds the gradient {} of {chunk}: its gradient \
                         offload ({}) landed in the parameter storage before this read (the \
                         14-byte host layout); every upload of a chunk must come before its \
                         gradient offload, or the chunk must keep a host gradient chunk",
                        self.describe_content(content),
                        self.at(w)
                    ),
                );
            }
        }
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
                Instr::Record { .. }
                | Instr::Wait { .. }
                | Instr::EndMicroBatch { .. }
                | Instr::AllReduce { .. }
                | Instr::CopyShard { .. }
                | Instr::AllGather { .. }
                | Instr::ReduceScatter { .. } => false,
                // A staging buffer receives a whole chunk state, not one value.
                Instr::DiskRead { .. } | Instr::DiskWrite { .. } => false,
                Instr::CastChunk {
                    chunk, src, dst, ..
                } => self
                    .s
                    .cast_pieces(*chunk, *src, *dst)
                    .unwrap_or_default()
                    .iter()
                    .any(|p| p.value == v && at(p.narrow)),
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

    /// The master weight of every parameter of a chunk a cast reads (the 12-byte layout).
    fn staged_masters(&self) -> HashMap<ValueId, TensorRef> {
        let staged = self.s.staged_chunks();
        let mut params = std::collections::HashSet::new();
        for c in staged {
            for m in &self.s.chunks.chunk(c).members {
                params.insert(self.g.param(m.param).value);
            }
        }
        self.s
            .masters
            .iter()
            .filter(|(v, _)| params.contains(v))
            .copied()
            .collect()
    }

    /// A cast of a staged chunk's master weights into a parameter staging buffer (the
    /// 12-byte layout): a read of every member's master weight, which must still hold the
    /// step's parameters (no AdamW has updated it yet, or the upload would carry the next
    /// step's weights), and a write of the members' parameters at their offsets in the
    /// staging buffer, which nothing may still read (the upload that read it last must be
    /// ordered before).
    #[allow(clippy::too_many_arguments)]
    fn cast(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        chunk: crate::ids::ChunkId,
        src: TensorRef,
        dst: TensorRef,
        bytes: u64,
    ) -> Result<(), ScheduleError> {
        let pieces = self.s.cast_pieces(chunk, src, dst).unwrap_or_default();
        for p in &pieces {
            let (space, a, b) = self.span(p.master, 4 * p.len);
            let m = &mut mem[space_index(space)];
            if let Err(Found::Other(Content::Value { updated: true, .. }, writer)) =
                Self::holds(m, p.value, a, b, false)
            {
                return Err(self.fail(
                    Invariant::DataFlow,
                    Some(r),
                    format!(
                        "casts the master weight of {} at {}, but it was already updated this \
                         step ({}): the upload would carry the next step's weights; every cast \
                         of a chunk must come before its update",
                        self.name(p.value),
                        Self::range(space, a, b),
                        self.describe_writer(writer)
                    ),
                ));
            }
            self.check_read(m, r, clock, pc, p.value, space, a, b)?;
            m.read(a, b, r);
        }
        let (ds, da, db) = self.span(dst, bytes);
        if da == db {
            return Ok(());
        }
        let mut written = Vec::with_capacity(2 * pieces.len() + 1);
        let mut pos = 0;
        for p in &pieces {
            let (_, a, b) = self.span(p.narrow, p.len * p.dtype.size());
            let (a, b) = (a - da, b - da);
            if a > pos {
                written.push((pos, a, Content::Undefined));
            }
            written.push((
                a,
                b,
                Content::Value {
                    value: p.value,
                    base: da + a,
                    updated: false,
                },
            ));
            pos = b;
        }
        if pos < db - da {
            written.push((pos, db - da, Content::Undefined));
        }
        let to = &mut mem[space_index(ds)];
        self.check_write(to, r, clock, ds, da, db)?;
        to.write(da, db, &written, r);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn kernel(
        &self,
        mem: &mut [Memory; 3],
        (r, clock, pc): (InstrRef, &[u32], &[usize]),
        staged: &HashMap<ValueId, TensorRef>,
        op: OpId,
        inputs: &[TensorRef],
        outputs: &[TensorRef],
        workspace: Option<TensorRef>,
    ) -> Result<(), ScheduleError> {
        let o = self.g.op(op);
        // The 14-byte host layout: an AdamW whose narrow parameter has an f32 master weight
        // (which is what it reads and updates) may find its gradient in the parameter's own
        // storage, exactly there; it reads each gradient element before writing the new
        // parameter over it, so the parameter's old bits are not read and need not be there.
        let grad_in_param = matches!(o.kind, OpKind::AdamW { .. })
            && inputs.len() > 1
            && inputs[0] == inputs[1]
            && self.g.value(o.inputs[0]).ty == self.g.value(o.inputs[1]).ty
            && self.s.masters.iter().any(|&(v, _)| v == o.inputs[0]);
        let mut reads = Vec::with_capacity(inputs.len());
        for (j, (&v, &t)) in o.inputs.iter().zip(inputs).enumerate() {
            let (space, a, b) = self.span(t, self.bytes(v));
            if !(grad_in_param && j == 0) {
                self.check_read(&mut mem[space_index(space)], r, clock, pc, v, space, a, b)?;
            }
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
            let span = self.span(w, self.workspace_span(op, w));
            writes.push(KernelWrite {
                span,
                content: Content::Scratch,
                in_place_of: None,
            });
        }
        // The 12-byte layout: AdamW reads and updates a staged parameter's master weight,
        // which casts read: it must hold the step's parameter, and the update must come after
        // every cast of it.
        if let (OpKind::AdamW { .. }, Some(&master)) = (&o.kind, staged.get(&o.inputs[0])) {
            let v = o.inputs[0];
            let span = self.span(master, 4 * self.g.value(v).ty.numel());
            let (space, a, b) = span;
            self.check_read(&mut mem[space_index(space)], r, clock, pc, v, space, a, b)?;
            writes.push(KernelWrite {
                span,
                content: Content::Value {
                    value: v,
                    base: a,
                    updated: true,
                },
                in_place_of: None,
            });
            reads.push(span);
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
                let reused = grad_in_param && w.in_place_of == Some(0) && j == 1;
                if w.in_place_of != Some(j) && !reused && overlaps(span, read) {
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

    /// An all-reduce of `v` at `at`: a read of the value (whole, there, written before it)
    /// and a write of its bytes (the sum over the ranks, the same value), so that what reads
    /// the value later must be ordered after the sum.
    fn all_reduce(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        v: ValueId,
        at: TensorRef,
    ) -> Result<(), ScheduleError> {
        let (space, a, b) = self.span(at, self.bytes(v));
        if a == b {
            return Ok(());
        }
        let m = &mut mem[space_index(space)];
        self.check_read(m, r, clock, pc, v, space, a, b)?;
        m.read(a, b, r);
        self.check_write(m, r, clock, space, a, b)?;
        let content = Content::Value {
            value: v,
            base: a,
            updated: false,
        };
        m.write(a, b, &[(0, b - a, content)], r);
        Ok(())
    }

    /// A shard copy, in the whole view: every rank's slice together is a copy of
    /// `ranks * bytes`. An offload must copy gradients a reduce-scatter summed (and be
    /// ordered after it); what a fetch writes is only each rank's slice until an all-gather
    /// rewrites it (see `check_read`).
    #[allow(clippy::too_many_arguments)]
    fn copy_shard(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        pc: &[usize],
        what: CopyKind,
        src: TensorRef,
        dst: TensorRef,
        bytes: u64,
    ) -> Result<(), ScheduleError> {
        let all = bytes * u64::from(self.s.ranks());
        if let CopyKind::OffloadGrads { chunk } = what {
            let (ss, sa, _) = self.span(src, all);
            let from = &mut mem[space_index(ss)];
            for m in &self.s.chunks.chunk(chunk).members {
                let (a, b) = (sa + m.offset, sa + m.offset + m.bytes);
                from.isolate(a, b);
                // Summed over the ranks: by a reduce-scatter (each rank's slice), or whole by
                // an all-reduce (for the global norm) or a chunk-major gradient sum's add on
                // the collective stream.
                let summed = |w: InstrRef| match self.instr(w) {
                    Instr::ReduceScatter { .. } | Instr::AllReduce { .. } => true,
                    Instr::Kernel { .. } => matches!(
                        self.s.stream(w.stream).kind,
                        crate::StreamKind::Collective { .. }
                    ),
                    _ => false,
                };
                let unsummed = from
                    .within(a, b)
                    .find(|(_, seg)| !matches!(seg.writer, Writer::Instr(w) if summed(w)));
                if let Some((start, seg)) = unsummed {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "offloads each rank's slice of {chunk}'s gradients, but {} at {} \
                             was neither reduce-scattered nor all-reduced ({}): the ranks' \
                             gradients would not be summed",
                            self.describe_content(seg.content),
                            Self::range(ss, start, seg.end),
                            self.describe_writer(seg.writer)
                        ),
                    ));
                }
            }
        }
        self.copy(mem, r, clock, pc, what, src, dst, all)
    }

    /// An all-gather (`gather`) or a reduce-scatter of `chunk` in place at `at`: the slices of
    /// every rank, `ranks * bytes` bytes, must have been written by instructions ordered
    /// before it (for a gather, by the ranks' shard fetches); it rewrites them as they were,
    /// now complete (gathered) or summed (scattered).
    #[allow(clippy::too_many_arguments)]
    fn gather_or_scatter(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        chunk: crate::ids::ChunkId,
        at: TensorRef,
        bytes: u64,
        gather: bool,
    ) -> Result<(), ScheduleError> {
        let all = bytes * u64::from(self.s.ranks());
        let (space, a, b) = self.span(at, all);
        if a == b {
            return Ok(());
        }
        let name = match gather {
            true => "all-gathers",
            false => "reduce-scatters",
        };
        let m = &mut mem[space_index(space)];
        m.isolate(a, b);
        for member in &self.s.chunks.chunk(chunk).members {
            let (ma, mb) = (a + member.offset, a + member.offset + member.bytes);
            m.isolate(ma, mb);
            let mut pos = ma;
            for (start, seg) in m.within(ma, mb) {
                let fetched = matches!(seg.writer, Writer::Instr(w)
                    if matches!(self.instr(w), Instr::CopyShard { what: CopyKind::FetchChunk { chunk: c }, .. } if *c == chunk));
                let problem = match seg.writer {
                    _ if start > pos => Some("nothing".to_string()),
                    Writer::Instr(w) if !hb(w, clock) => Some(format!(
                        "{}, written by {}, which is not ordered before it: a missing wait?",
                        self.describe_content(seg.content),
                        self.at(w)
                    )),
                    _ if gather && !fetched => Some(format!(
                        "{} ({}), not the ranks' shards of it: fetch each rank's shard \
                         (copy_shard) first",
                        self.describe_content(seg.content),
                        self.describe_writer(seg.writer)
                    )),
                    _ => None,
                };
                if let Some(problem) = problem {
                    return Err(self.fail(
                        Invariant::DataFlow,
                        Some(r),
                        format!(
                            "{name} {chunk} at {}, where @{} should be, but finds {problem}",
                            Self::range(space, ma, mb),
                            self.g.param(member.param).name
                        ),
                    ));
                }
                pos = seg.end;
            }
            if pos < mb {
                return Err(self.fail(
                    Invariant::DataFlow,
                    Some(r),
                    format!(
                        "{name} {chunk} at {}, where @{} should be, but finds nothing",
                        Self::range(space, ma, mb),
                        self.g.param(member.param).name
                    ),
                ));
            }
        }
        let pieces: Vec<(u64, u64, Content)> = m
            .within(a, b)
            .map(|(start, seg)| (start - a, seg.end - a, seg.content))
            .collect();
        m.read(a, b, r);
        self.check_write(m, r, clock, space, a, b)?;
        m.write(a, b, &pieces, r);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(
        &self,
        mem: &mut [Memory; 3],
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
        self.transfer(mem, r, clock, (ss, sa, sb), (ds, da, db), &members)
    }

    /// Moves what `[sa, sb)` holds to `[da, db)` for the copy `r`: what it reads must be
    /// written before it and be no kernel scratch (but for padding outside `members`, copied
    /// as undefined bytes); the destination must be free to overwrite.
    fn transfer(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        (ss, sa, sb): Span,
        (ds, da, db): Span,
        members: &[(u64, u64)],
    ) -> Result<(), ScheduleError> {
        let from = &mut mem[space_index(ss)];
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

    /// A disk read or write of a chunk's whole optimizer state (see the module doc): a copy
    /// of whatever the bytes hold (moments, the master weights the model does not track as
    /// values, undefined padding). A write must not carry back a moment that an AdamW of
    /// this part updates before that update: it would lose it.
    #[allow(clippy::too_many_arguments)]
    fn disk_copy(
        &self,
        mem: &mut [Memory; 3],
        r: InstrRef,
        clock: &[u32],
        src: TensorRef,
        dst: TensorRef,
        bytes: u64,
        write: bool,
    ) -> Result<(), ScheduleError> {
        if bytes == 0 {
            return Ok(());
        }
        // A shard's transfer moves every rank's slice: `ranks * bytes` of the whole view.
        let disk = if write { dst } else { src };
        let bytes = match self.s.buffer(disk.buffer).kind.is_sharded() {
            true => bytes * u64::from(self.s.ranks()),
            false => bytes,
        };
        let (ss, sa, sb) = self.span(src, bytes);
        if write {
            let updated_here = self.updated_in_place();
            let from = &mut mem[space_index(ss)];
            from.isolate(sa, sb);
            for (start, seg) in from.within(sa, sb) {
                if let Content::Value {
                    value,
                    updated: false,
                    ..
                } = seg.content
                {
                    if updated_here.contains(&value) {
                        return Err(self.fail(
                            Invariant::DataFlow,
                            Some(r),
                            format!(
                                "writes {} at {} back to disk before the AdamW that updates \
                                 it: the update would be lost (wait for the update first)",
                                self.name(value),
                                Self::range(ss, start, seg.end)
                            ),
                        ));
                    }
                }
            }
        }
        let dst_span = self.span(dst, bytes);
        self.transfer(mem, r, clock, (ss, sa, sb), dst_span, &[])
    }

    /// The values an AdamW of the part being checked updates in place.
    fn updated_in_place(&self) -> Vec<ValueId> {
        let mut out = Vec::new();
        for (_, instr) in self.instrs() {
            if let Instr::Kernel { op, .. } = instr {
                let o = self.g.op(*op);
                out.extend(
                    o.kind
                        .writes_inputs()
                        .iter()
                        .filter_map(|&j| o.inputs.get(j)),
                );
            }
        }
        out
    }

    // 12. end of step --------------------------------------------------------------------

    fn end_of_step(&self, mem: &mut [Memory; 3]) -> Result<(), ScheduleError> {
        let s = self.s;
        let loss = self.loss_value();
        let (space, a, b) = self.span(s.loss, self.bytes(loss));
        // The runtime reads the loss after each micro-batch, not after the update.
        let reads_loss = self.part != super::Part::Update;
        let held = match reads_loss {
            true => Self::holds(&mut mem[space_index(space)], loss, a, b, false),
            false => Ok(()),
        };
        if let Err(found) = held {
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
