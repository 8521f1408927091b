//! Carried disk writes: the write-backs that end a step's disk program move to the start of
//! the next step's, so that they overlap its forward pass instead of ending the step.
//!
//! The pass runs after the disk tier ([`crate::disk`]) on its schedule. The disk stream's
//! program (its update program, with accumulation) ends with the write-backs of the last
//! chunks the CPU Adam updates, each after a wait for its update: nothing in the step runs
//! after them, so the step ends when the last is on disk. The pass takes the longest tail of
//! that program made of waits and write-backs only, and carries its writes
//! ([`Instr::DiskWrite`]'s `carried`): they move, in order and without their waits, to the
//! head of the disk stream's program, where the runtime runs them as the next step starts
//! (after the barrier between steps, which orders them after the updates), writing what the
//! update left in the staging buffers while the next step's forward pass runs. An event
//! only a dropped wait waited for goes with its record (the events are numbered again).
//!
//! A write is carried only where that is safe: its staging buffer is used by nothing after
//! it in the step (it is in the tail, and no record follows it in its stream, so nothing on
//! another stream is ordered after it), and every instruction of the next step that writes
//! the staging buffer before the update program is on the disk stream (after the carried
//! writes) or waits first for an event the disk stream records (so after them too); a read
//! of the chunk from disk is on the disk stream, after them. The verifier checks all of it
//! (the program is cyclic for carried writes, see [`protrain_ir::verify_schedule`]).
//!
//! Where carrying buys nothing the pass leaves the writes where they are: a carried write
//! runs before the next step's first disk read, so where that read is on the critical path
//! (the forward pass's first upload reads from disk) and the write overlapped the last
//! update at the step's end, carrying it would only delay the read. The pass simulates the
//! step both ways ([`simulate_unverified`]) and keeps the shorter; the simulated step is the
//! steady state, a carried write at the head of each step.
//!
//! It does not reorder the reads or the other writes, and does not carry a write whose
//! update is not in the tail (a write the program needs before a later read of its staging
//! buffer).

use crate::cost::CostModel;
use crate::simulate::simulate_unverified;
use protrain_ir::{BufferId, EventId, Instr, Schedule, StreamKind};
use std::collections::HashSet;

/// Carries the write-backs that end `schedule`'s disk program into the next step where that
/// is safe and the step simulated under `cost` is shorter for it (see the module doc);
/// returns the schedule unchanged otherwise, and where it has no disk stream.
pub fn carry(schedule: Schedule, cost: &dyn CostModel) -> Schedule {
    let Some(carried) = carried(&schedule) else {
        return schedule;
    };
    let step = |s: &Schedule| simulate_unverified(s, cost).map(|sim| sim.step_seconds);
    match (step(&schedule), step(&carried)) {
        (Ok(plain), Ok(with)) if with < plain => carried,
        _ => schedule,
    }
}

/// `schedule` with the tail of its disk program carried (see the module doc), or `None`
/// where nothing can be.
pub fn carried(schedule: &Schedule) -> Option<Schedule> {
    let io = schedule
        .streams
        .iter()
        .position(|s| s.kind == StreamKind::DiskIo)?;
    let instrs = &schedule.streams[io].instrs;
    if instrs
        .iter()
        .any(|i| matches!(i, Instr::DiskWrite { carried: true, .. }))
    {
        return None;
    }
    // The update program, with accumulation: the tail is its end.
    let marker = instrs
        .iter()
        .position(|i| matches!(i, Instr::EndMicroBatch { .. }));
    let start = marker.map_or(0, |m| m + 1);
    let mut from = instrs.len();
    while from > start
        && matches!(
            instrs[from - 1],
            Instr::Wait { .. } | Instr::DiskWrite { .. }
        )
    {
        from -= 1;
    }
    // The tail starts at a write: a wait before the first write stays (it orders nothing
    // carried, and what follows it may need it).
    while from < instrs.len() && matches!(instrs[from], Instr::Wait { .. }) {
        from += 1;
    }
    let last_write = instrs
        .iter()
        .rposition(|i| matches!(i, Instr::DiskWrite { .. }))?;
    if from > last_write {
        return None;
    }
    let staging: HashSet<BufferId> = instrs[from..]
        .iter()
        .filter_map(|i| match i {
            Instr::DiskWrite { src, .. } => Some(src.buffer),
            _ => None,
        })
        .collect();
    if !reuses_follow_the_disk(schedule, io, &staging) {
        return None;
    }
    let mut out = schedule.clone();
    let tail: Vec<Instr> = out.streams[io].instrs.drain(from..).collect();
    let mut dropped = Vec::new();
    let mut writes = Vec::new();
    for instr in tail {
        match instr {
            Instr::Wait { event } => dropped.push(event),
            Instr::DiskWrite {
                chunk,
                src,
                dst,
                bytes,
                ..
            } => writes.push(Instr::DiskWrite {
                chunk,
                src,
                dst,
                bytes,
                carried: true,
            }),
            _ => unreachable!("the tail holds waits and writes only"),
        }
    }
    out.streams[io].instrs.splice(0..0, writes);
    drop_unwaited(&mut out, &dropped);
    Some(out)
}

/// Whether every instruction of the micro-batch program (or of the whole step, without
/// accumulation) that writes one of `staging`'s buffers is on disk stream `io` or waits
/// first for an event `io` records: ordered after the carried writes at the stream's head.
/// The update program runs after every micro-batch's barrier, so all of it is.
fn reuses_follow_the_disk(schedule: &Schedule, io: usize, staging: &HashSet<BufferId>) -> bool {
    let on_io: HashSet<EventId> = schedule.streams[io]
        .instrs
        .iter()
        .filter_map(|i| match i {
            Instr::Record { event } => Some(*event),
            _ => None,
        })
        .collect();
    schedule
        .streams
        .iter()
        .enumerate()
        .filter(|&(s, _)| s != io)
        .all(|(_, stream)| {
            let mut after = false;
            for instr in &stream.instrs {
                match instr {
                    Instr::EndMicroBatch { .. } => return true,
                    Instr::Wait { event } if on_io.contains(event) => after = true,
                    _ if !after && writes_to(instr).iter().any(|b| staging.contains(b)) => {
                        return false
                    }
                    _ => {}
                }
            }
            true
        })
}

/// The buffers an instruction may write: a kernel's outputs and the inputs it updates in
/// place (every operand, to be safe), a copy's or cast's destination.
fn writes_to(instr: &Instr) -> Vec<BufferId> {
    match instr {
        Instr::Kernel {
            inputs,
            outputs,
            workspace,
            ..
        } => inputs
            .iter()
            .chain(outputs)
            .chain(workspace)
            .map(|t| t.buffer)
            .collect(),
        Instr::Copy { dst, .. }
        | Instr::CopyShard { dst, .. }
        | Instr::DiskRead { dst, .. }
        | Instr::DiskWrite { dst, .. }
        | Instr::CastChunk { dst, .. } => vec![dst.buffer],
        Instr::AllReduce { at, .. }
        | Instr::AllGather { at, .. }
        | Instr::ReduceScatter { at, .. } => vec![at.buffer],
        Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => Vec::new(),
    }
}

/// Removes the record of each of `events` that no wait is left for, and numbers the
/// remaining events `0..` again in their order.
fn drop_unwaited(schedule: &mut Schedule, events: &[EventId]) {
    let waited: HashSet<EventId> = schedule
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter_map(|i| match i {
            Instr::Wait { event } => Some(*event),
            _ => None,
        })
        .collect();
    let gone: HashSet<EventId> = events
        .iter()
        .copied()
        .filter(|e| !waited.contains(e))
        .collect();
    if gone.is_empty() {
        return;
    }
    let mut number = vec![None; schedule.events as usize];
    let mut next = 0u32;
    for (e, n) in number.iter_mut().enumerate() {
        if !gone.contains(&EventId(e as u32)) {
            *n = Some(EventId(next));
            next += 1;
        }
    }
    for stream in &mut schedule.streams {
        stream
            .instrs
            .retain(|i| !matches!(i, Instr::Record { event } if gone.contains(event)));
        for instr in &mut stream.instrs {
            if let Instr::Record { event } | Instr::Wait { event } = instr {
                if let Some(Some(n)) = number.get(event.index()) {
                    *event = *n;
                }
            }
        }
    }
    schedule.events = next;
}
