//! The disk tier: optimizer state that host memory cannot hold moves to one preallocated file.
//!
//! The pass runs last, on an emitted schedule whose host region is over its budget. It moves
//! the optimizer state (f32 master weights and Adam moments: the chunk's
//! [`BufferKind::OptimizerState`] buffer, whole) of the fewest offloaded chunks that brings the
//! host region within the budget to [`Space::Disk`], each at a fixed offset (aligned to
//! [`DISK_ALIGN`]) in a region of [`Schedule::disk_bytes`]; takes the chunks in the order the
//! CPU Adam updates them; has the planner lay the host region out again without their state
//! and with two staging buffers (one when a single chunk moves) of the largest moved state
//! ([`crate::plan::move_to_disk`], [`crate::plan::append_buffer`]); points each of
//! their AdamW kernels at the staging buffer the chunk's state is read into (same offsets);
//! and adds a [`StreamKind::DiskIo`] stream that reads every moved chunk's state ahead of its
//! update and writes it back after, double-buffered:
//!
//! ```text
//! disk i/o:        read c0->s0, read c1->s1, wait a0, write c0, read c2->s0, wait a1, write c1, ...
//! host optimizer:  ..., wait r0, adamw c0 ..., record a0, wait r1, adamw c1 ..., record a1, ...
//! ```
//!
//! so the read of the next chunk overlaps the update of this one and the write of the
//! previous one. The reads of the first two chunks have no wait: they overlap the forward and
//! backward passes. With gradient accumulation the disk stream's program is all update (it
//! starts with its micro-batch marker).
//!
//! It does not shard (a sharded schedule is refused: its state is split over the ranks
//! already, and the disk tier of each rank's slice is not built), does not choose between
//! disk and a leaner host layout (the search tries the 14-byte layout first), and does not
//! overlap a chunk's read with its own update (the CPU Adam updates a chunk whole). A staged
//! chunk's state (the 12-byte layout) stays on the host: its casts read the master weights
//! before every upload.

use crate::error::{CompileError, Result, Shortfall, ShortfallProblem};
use crate::plan::{append_buffer, disk_region_bytes, host_bytes_after, move_to_disk};
use protrain_ir::{
    BufferId, BufferKind, ChunkId, EventId, Instr, Schedule, Space, Stream, StreamKind, TensorRef,
};
use std::collections::HashMap;

/// Alignment of each chunk's state in the disk file (laid out by [`crate::plan`]).
pub use crate::plan::DISK_ALIGN;

/// One chunk whose state can move: its state buffer and where its AdamW kernels are on the
/// host optimizer stream (their indices, in order).
#[derive(Clone, Debug)]
struct Movable {
    chunk: ChunkId,
    buffer: BufferId,
    kernels: Vec<usize>,
}

/// Moves the optimizer state of the fewest offloaded chunks to disk so that the host region
/// fits `host_budget` (see the module doc); returns the schedule unchanged when it fits
/// already or `disk_budget` is 0. Fails, naming what each tier would need, when even every
/// chunk's state on disk leaves the host region over its budget or the disk region over
/// `disk_budget`, and on a sharded schedule.
pub fn disk(mut schedule: Schedule, host_budget: u64, disk_budget: u64) -> Result<Schedule> {
    if schedule.host_bytes <= host_budget || disk_budget == 0 {
        return Ok(schedule);
    }
    if schedule.sharded() {
        return Err(Shortfall::error(ShortfallProblem::DiskSharded {
            host_need: schedule.host_bytes,
            host_budget,
        }));
    }
    let movable = movable(&schedule)?;
    if movable.is_empty() {
        return Ok(schedule);
    }
    // The fewest chunks, in update order, whose state leaves the host within budget, double
    // buffered; where no number of chunks fits so, through one staging buffer (the read of
    // the next chunk then waits for the write of this one, and the disk does not overlap
    // the CPU Adam).
    let mut chosen = None;
    'search: for slots in [2, 1] {
        for k in 1..=movable.len() {
            let moved: Vec<BufferId> = movable[..k].iter().map(|m| m.buffer).collect();
            if host_after(&schedule, &moved, slots.min(k)) <= host_budget {
                chosen = Some((k, slots.min(k)));
                break 'search;
            }
        }
    }
    let all: Vec<BufferId> = movable.iter().map(|m| m.buffer).collect();
    let Some((k, slots)) = chosen else {
        return Err(Shortfall::error(ShortfallProblem::HostOverWithAllOnDisk {
            host_need: host_after(&schedule, &all, 1),
            chunks: movable.len(),
            host_budget,
        }));
    };
    let moved = &movable[..k];
    let disk_bytes = disk_region_bytes(moved.iter().map(|m| schedule.buffer(m.buffer).size));
    if disk_bytes > disk_budget {
        return Err(Shortfall::error(ShortfallProblem::DiskOver {
            chunks: k,
            host_budget,
            disk_need: disk_bytes,
            disk_budget,
        }));
    }
    place(&mut schedule, moved, slots);
    schedule.header.disk_budget_bytes = disk_budget;
    Ok(schedule)
}

/// The least host region `schedule` can have with the disk tier, and the disk that takes:
/// the optimizer state of every chunk whose state can move on disk, through one staging
/// buffer. `None` where the disk tier does not apply: a sharded schedule, or one with no
/// such chunk. For errors that quote the smallest budgets that would fit.
pub fn least_host(schedule: &Schedule) -> Option<(u64, u64)> {
    if schedule.sharded() {
        return None;
    }
    let movable = movable(schedule).ok()?;
    if movable.is_empty() {
        return None;
    }
    let all: Vec<BufferId> = movable.iter().map(|m| m.buffer).collect();
    let disk_bytes = disk_region_bytes(movable.iter().map(|m| schedule.buffer(m.buffer).size));
    Some((host_after(schedule, &all, 1), disk_bytes))
}

/// The offloaded chunks whose state is on the host, in the order the host optimizer stream
/// first updates them; fails when a state buffer is used other than by that stream's
/// kernels (a compiler bug).
fn movable(schedule: &Schedule) -> Result<Vec<Movable>> {
    let Some(opt) = schedule
        .streams
        .iter()
        .position(|s| s.kind == StreamKind::HostOptimizer)
    else {
        return Ok(Vec::new());
    };
    let state: HashMap<BufferId, ChunkId> = schedule
        .buffers
        .iter()
        .enumerate()
        .filter_map(|(i, b)| match (b.space, b.kind) {
            (Space::Host, BufferKind::OptimizerState { chunk }) => Some((BufferId::new(i), chunk)),
            _ => None,
        })
        .collect();
    let mut out: Vec<Movable> = Vec::new();
    let mut index: HashMap<BufferId, usize> = HashMap::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            let refs: Vec<TensorRef> = match instr {
                Instr::Kernel {
                    inputs,
                    outputs,
                    workspace,
                    ..
                } => inputs
                    .iter()
                    .chain(outputs)
                    .chain(workspace)
                    .copied()
                    .collect(),
                Instr::Copy { src, dst, .. }
                | Instr::CopyShard { src, dst, .. }
                | Instr::DiskRead { src, dst, .. }
                | Instr::DiskWrite { src, dst, .. } => vec![*src, *dst],
                // A staged chunk's master weights are cast from host memory before each
                // upload: its state stays on the host.
                Instr::CastChunk { .. } => Vec::new(),
                Instr::AllReduce { at, .. }
                | Instr::AllGather { at, .. }
                | Instr::ReduceScatter { at, .. } => vec![*at],
                Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => {
                    Vec::new()
                }
            };
            for t in refs {
                let Some(&chunk) = state.get(&t.buffer) else {
                    continue;
                };
                if s != opt || !matches!(instr, Instr::Kernel { .. }) {
                    return Err(CompileError::Validation(format!(
                        "the optimizer state of {chunk} is used by stream {} #{i}, not only \
                         by the CPU Adam: it cannot move to disk",
                        stream.name
                    )));
                }
                match index.get(&t.buffer) {
                    Some(&at) => {
                        if out[at].kernels.last() != Some(&i) {
                            out[at].kernels.push(i);
                        }
                    }
                    None => {
                        index.insert(t.buffer, out.len());
                        out.push(Movable {
                            chunk,
                            buffer: t.buffer,
                            kernels: vec![i],
                        });
                    }
                }
            }
        }
    }
    let staged = schedule.staged_chunks();
    out.retain(|m| !staged.contains(&m.chunk));
    Ok(out)
}

/// The size of the staging buffers of `moved` (state buffers): the largest state.
fn staging(schedule: &Schedule, moved: &[BufferId]) -> u64 {
    moved
        .iter()
        .map(|&b| schedule.buffer(b).size)
        .max()
        .unwrap_or(0)
}

/// The host region after moving `moved` out and adding `slots` staging buffers, as the
/// planner lays it out ([`host_bytes_after`]).
fn host_after(schedule: &Schedule, moved: &[BufferId], slots: usize) -> u64 {
    host_bytes_after(schedule, moved, &vec![staging(schedule, moved); slots])
}

/// The staging buffers and events of the moved chunks: chunk `i` is read into slot `i mod
/// slots`, its read records `read_done(i)` and its update `update_done(i)`.
struct Tier {
    slot_ids: Vec<BufferId>,
    first_event: u32,
}

impl Tier {
    fn read_done(&self, i: usize) -> EventId {
        EventId(self.first_event + 2 * i as u32)
    }

    fn update_done(&self, i: usize) -> EventId {
        EventId(self.first_event + 2 * i as u32 + 1)
    }

    fn slot_of(&self, i: usize) -> BufferId {
        self.slot_ids[i % self.slot_ids.len()]
    }
}

/// Moves the state of `moved` to disk and adds the staging buffers, the disk stream and the
/// host optimizer's waits and records (see the module doc).
fn place(schedule: &mut Schedule, moved: &[Movable], slots: usize) {
    let ids: Vec<BufferId> = moved.iter().map(|m| m.buffer).collect();
    let size = staging(schedule, &ids);
    // The planner lays out the disk region and the host region without the moved state, then
    // places the staging buffers at the host region's end.
    move_to_disk(schedule, &ids);
    let slot_ids: Vec<BufferId> = (0..slots)
        .map(|slot| {
            append_buffer(
                schedule,
                &format!("disk_staging{slot}"),
                Space::Host,
                BufferKind::DiskStaging { slot: slot as u32 },
                size,
            )
        })
        .collect();
    schedule.header.prediction.host_bytes = schedule.host_bytes;
    let tier = Tier {
        slot_ids,
        first_event: schedule.events,
    };
    schedule.events += 2 * moved.len() as u32;
    address_staging(schedule, moved, &tier);
    let io = disk_program(schedule, moved, &tier);
    schedule.streams.push(Stream {
        name: "disk_io".into(),
        kind: StreamKind::DiskIo,
        instrs: io,
    });
    schedule.header.prediction.stream_busy_seconds.push(0.0);
}

/// The host optimizer's instructions with each moved chunk's kernels made adjacent, at its
/// first (the CPU Adam may update the parameters of two chunks interleaved, as their
/// gradients arrive; a later kernel of a chunk needs no wait its first did not, all of a
/// chunk's gradients arriving in one offload, and the verifier checks that it is so), so
/// that its state is read once and written once.
fn grouped(old: Vec<Instr>, moved: &[Movable]) -> Vec<Instr> {
    let mut order: Vec<usize> = Vec::with_capacity(old.len());
    let mut taken = vec![false; old.len()];
    let chunk_at: HashMap<usize, usize> = moved
        .iter()
        .enumerate()
        .map(|(i, m)| (m.kernels[0], i))
        .collect();
    for at in 0..old.len() {
        if taken[at] {
            continue;
        }
        match chunk_at.get(&at) {
            Some(&i) => {
                for &k in &moved[i].kernels {
                    taken[k] = true;
                    order.push(k);
                }
            }
            None => order.push(at),
        }
    }
    let mut old: Vec<Option<Instr>> = old.into_iter().map(Some).collect();
    order
        .into_iter()
        .map(|k| old[k].take().expect("each instruction once"))
        .collect()
}

/// Points the host optimizer's kernels of each moved chunk at its staging buffer, after a
/// wait for its read and before a record of its update.
fn address_staging(schedule: &mut Schedule, moved: &[Movable], tier: &Tier) {
    let opt = schedule
        .streams
        .iter()
        .position(|s| s.kind == StreamKind::HostOptimizer)
        .expect("movable chunks are on the host optimizer stream");
    let old = grouped(std::mem::take(&mut schedule.streams[opt].instrs), moved);
    // The new index of each moved chunk's first and last kernel.
    let mut starts: HashMap<usize, usize> = HashMap::new();
    let mut ends: HashMap<usize, usize> = HashMap::new();
    let mut seen = vec![false; moved.len()];
    for (at, instr) in old.iter().enumerate() {
        let Instr::Kernel { inputs, .. } = instr else {
            continue;
        };
        let Some(i) = inputs
            .iter()
            .find_map(|t| moved.iter().position(|m| m.buffer == t.buffer))
        else {
            continue;
        };
        if !seen[i] {
            seen[i] = true;
            starts.insert(at, i);
            ends.insert(at + moved[i].kernels.len() - 1, i);
        }
    }
    let mut instrs = Vec::with_capacity(old.len() + 2 * moved.len());
    let slot_by_buffer: HashMap<BufferId, BufferId> = moved
        .iter()
        .enumerate()
        .map(|(i, m)| (m.buffer, tier.slot_of(i)))
        .collect();
    for (at, mut instr) in old.into_iter().enumerate() {
        if let Some(&i) = starts.get(&at) {
            instrs.push(Instr::Wait {
                event: tier.read_done(i),
            });
        }
        if let Instr::Kernel {
            inputs, outputs, ..
        } = &mut instr
        {
            for t in inputs.iter_mut().chain(outputs.iter_mut()) {
                if let Some(&slot) = slot_by_buffer.get(&t.buffer) {
                    t.buffer = slot;
                }
            }
        }
        instrs.push(instr);
        if let Some(&i) = ends.get(&at) {
            instrs.push(Instr::Record {
                event: tier.update_done(i),
            });
        }
    }
    schedule.streams[opt].instrs = instrs;
}

/// The disk stream's program: the first `slots` reads at once, then for each chunk in turn
/// a wait for its update, its write back and the read of the chunk that takes its slot next.
fn disk_program(schedule: &Schedule, moved: &[Movable], tier: &Tier) -> Vec<Instr> {
    let slots = tier.slot_ids.len();
    let state_of = |i: usize| TensorRef {
        buffer: moved[i].buffer,
        offset: 0,
    };
    let staged = |i: usize| TensorRef {
        buffer: tier.slot_of(i),
        offset: 0,
    };
    let bytes_of = |i: usize| schedule.buffer(moved[i].buffer).size;
    let mut io = Vec::with_capacity(6 * moved.len() + 1);
    let micro_batches = schedule.micro_batches();
    if micro_batches > 1 {
        io.push(Instr::EndMicroBatch { micro_batches });
    }
    let read = |io: &mut Vec<Instr>, i: usize| {
        io.push(Instr::DiskRead {
            chunk: moved[i].chunk,
            src: state_of(i),
            dst: staged(i),
            bytes: bytes_of(i),
        });
        io.push(Instr::Record {
            event: tier.read_done(i),
        });
    };
    for i in 0..slots {
        read(&mut io, i);
    }
    for i in 0..moved.len() {
        io.push(Instr::Wait {
            event: tier.update_done(i),
        });
        io.push(Instr::DiskWrite {
            chunk: moved[i].chunk,
            src: staged(i),
            dst: state_of(i),
            bytes: bytes_of(i),
        });
        if i + slots < moved.len() {
            read(&mut io, i + slots);
        }
    }
    io
}

/// What the disk tier moves in one step: bytes read from and written to the disk region,
/// every micro-batch counted (instructions before a stream's micro-batch marker run once per
/// micro-batch, those after it once).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskTraffic {
    /// Bytes read from disk into host memory.
    pub read_bytes: u64,
    /// Bytes written from host memory to disk.
    pub write_bytes: u64,
}

impl DiskTraffic {
    /// Both directions together.
    pub fn bytes(&self) -> u64 {
        self.read_bytes.saturating_add(self.write_bytes)
    }
}

/// [`DiskTraffic`] of `schedule`: the bytes of its [`Instr::DiskRead`]s and
/// [`Instr::DiskWrite`]s in one step; zero without a disk tier.
pub fn traffic(schedule: &Schedule) -> DiskTraffic {
    let micro_batches = u64::from(schedule.micro_batches());
    let mut traffic = DiskTraffic::default();
    for (per_micro_batch, update) in schedule.phases() {
        for (instrs, repeat) in [(per_micro_batch, micro_batches), (update, 1)] {
            for instr in instrs {
                match instr {
                    Instr::DiskRead { bytes, .. } => {
                        traffic.read_bytes = traffic
                            .read_bytes
                            .saturating_add(bytes.saturating_mul(repeat));
                    }
                    Instr::DiskWrite { bytes, .. } => {
                        traffic.write_bytes = traffic
                            .write_bytes
                            .saturating_add(bytes.saturating_mul(repeat));
                    }
                    _ => {}
                }
            }
        }
    }
    traffic
}

/// What the host region of `schedule` holds that the disk tier does not take, by kind, each
/// the sum of its buffers' sizes (buffers that never live at once may share bytes, so the
/// sum can exceed the region): the parameters of streamed chunks, their gradients, the
/// gradient accumulators, and swapped activations. Kinds with no bytes are left out. For
/// errors that say why more disk would not help.
pub fn host_kept(schedule: &Schedule) -> Vec<(&'static str, u64)> {
    let mut kept = [
        ("parameters", 0u64),
        ("gradients", 0),
        ("gradient accumulators", 0),
        ("swapped activations", 0),
    ];
    for b in schedule.buffers.iter().filter(|b| b.space == Space::Host) {
        let at = match b.kind {
            BufferKind::HostChunk { .. } => 0,
            BufferKind::HostGradChunk { .. } => 1,
            BufferKind::Accumulators => 2,
            BufferKind::HostActivation => 3,
            _ => continue,
        };
        kept[at].1 = kept[at].1.saturating_add(b.size);
    }
    kept.into_iter().filter(|&(_, bytes)| bytes > 0).collect()
}
