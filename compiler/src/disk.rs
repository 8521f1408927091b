//! The disk tier: model state that host memory cannot hold moves to one preallocated file.
//!
//! The pass runs last, on an emitted schedule whose host region is over its budget. It moves,
//! in two stages, each taken only where the one before does not bring the host region within
//! its budget:
//!
//! 1. the optimizer state (f32 master weights and Adam moments: the chunk's
//!    [`BufferKind::OptimizerState`] buffer, whole) of the fewest offloaded chunks, in the
//!    order the CPU Adam updates them;
//! 2. with every such chunk's state on disk, the narrow parameter storage of the fewest of
//!    them ([`BufferKind::HostChunk`], where the 14-byte layout's gradients land too) and
//!    their separate gradient storage ([`BufferKind::HostGradChunk`], the 16-byte layout), in
//!    order of their size, the largest first. A storage buffer moves only where nothing but
//!    the chunk's uploads read it, its gradient offloads write it and its own AdamW kernels
//!    update it (with accumulation the host gradients are summed by other kernels each
//!    micro-batch: they stay).
//!
//! Each moved buffer gets a fixed offset (aligned to [`DISK_ALIGN`]) in a region of
//! [`Schedule::disk_bytes`] ([`crate::plan::move_to_disk`]); the host region is laid out again
//! without them and with staging buffers ([`BufferKind::DiskStaging`], each of the largest
//! buffer it stages, appended by [`crate::plan::append_buffer`]) in rings of two (one where a
//! single use needs one, or where only one fits): one ring for the state the CPU Adam reads,
//! one per kind of storage it reads, one the uploads read from and one the gradient
//! offloads land in. A staging buffer holds what it stages at the offsets the disk buffer
//! has, so every address moves to the staging buffer unchanged but for its buffer. One
//! [`StreamKind::DiskIo`] stream runs every transfer, one disk serving them in turn:
//!
//! - before each upload of a moved chunk, a read of the bytes it uploads into the next
//!   upload staging buffer (waiting for the upload that read that buffer last); the upload
//!   waits for the read and copies from the staging buffer;
//! - each gradient offload into moved storage lands in the next offload staging buffer
//!   (after the write that last read it) and is written to disk after it;
//! - before a chunk's update, a read of its state and of every moved storage buffer its
//!   AdamW kernels touch (waiting for the updates that last used those staging buffers);
//!   after the update, a write back of its state and of the storage it wrote (the rounded
//!   parameters). Clipping needs every gradient before the first update, so a chunk's
//!   gradients wait on disk between their offload and its update.
//!
//! The transfers run in the order a unit-time run of the other streams ([`ticks`]) first
//! allows each (a read as soon as its staging buffer is free, a write as soon as what it
//! writes is there; writes before reads at a tie), so the disk prefetches ahead of use and
//! the order is one the rest of the schedule can keep without deadlock (the verifier checks
//! that it is so). With gradient accumulation the disk stream's program has its micro-batch
//! marker: the uploads' reads run each micro-batch, the update's reads and writes once.
//! The write-backs that end the program may then be carried into the next step
//! ([`crate::carry`]).
//!
//! On sharded ranks ([`BufferKind::HostShard`]) each rank moves its own shards: a chunk's
//! state is its moments' and master weights' shards, each a buffer of `1/ranks` of the part
//! (sizes, budgets and disk offsets are a rank's; each rank's file holds its shards at the
//! same offsets), staged in one ring per part of sharded staging buffers
//! ([`BufferKind::ShardStaging`], whose slots pair one chunk's parts so that the update finds
//! its master weights beside its moments); every read and write moves one rank's whole
//! shard. Their storage moves as a single rank's does, in the same stage: each rank's
//! parameter and gradient shards ([`ShardPart::Params`], [`ShardPart::Grads`]) go to its
//! file, staged in rings of sharded staging buffers of the part they stage (the uploads'
//! and the update's parameters in [`ShardPart::Params`] buffers, the offloads' and the
//! update's gradients in [`ShardPart::Grads`] ones, numbered after the state rings' slots);
//! an upload ([`Instr::CopyShard`]) copies the rank's shard from the staging buffer the disk
//! stream read it into, an offload lands there before the write. A host budget that every
//! shard on disk does not meet is refused with the ranks' ways out
//! ([`ShortfallProblem::DiskSharded`]).
//!
//! It does not choose between
//! disk and a leaner host layout (the search tries the 14-byte layout first), and does not
//! overlap a chunk's read with its own update (the CPU Adam updates a chunk whole). A staged
//! chunk's state (the 12-byte layout) stays on the host: its casts read the master weights
//! before every upload.

use crate::error::{CompileError, Result, Shortfall, ShortfallProblem};
use crate::plan::{append_buffer, disk_region_bytes, host_bytes_after, move_to_disk};
use protrain_ir::{
    BufferId, BufferKind, ChunkId, CopyKind, EventId, Instr, Schedule, ShardPart, Space, Stream,
    StreamKind, TensorRef,
};
use std::collections::{HashMap, HashSet};

/// Alignment of each chunk's state in the disk file (laid out by [`crate::plan`]).
pub use crate::plan::DISK_ALIGN;

/// One chunk whose state can move: its state buffers and where its AdamW kernels are on the
/// host optimizer stream (their indices, in order).
#[derive(Clone, Debug)]
struct Movable {
    chunk: ChunkId,
    /// Its [`BufferKind::OptimizerState`] (part `None`), or on sharded ranks each rank's
    /// shard of its moments and master weights, each a buffer of its own (see
    /// [`BufferKind::HostShard`]), in buffer order.
    buffers: Vec<(BufferId, Option<ShardPart>)>,
    kernels: Vec<usize>,
}

/// A storage buffer of a movable chunk that can move too, and who uses it.
#[derive(Clone, Copy, Debug)]
struct Stored {
    buffer: BufferId,
    /// Parameters (the chunk's [`BufferKind::HostChunk`]) or gradients only.
    params: bool,
    /// Uploads that read it in a step's programs.
    fetches: usize,
    /// Gradient offloads that write it.
    offloads: usize,
    /// Whether the chunk's AdamW kernels read or write it.
    updated: bool,
    /// Whether it is a rank's shard ([`BufferKind::HostShard`]): staged in sharded staging
    /// buffers, each transfer moving one rank's whole shard.
    sharded: bool,
}

impl Stored {
    /// The ring its gradient offloads land in: on sharded ranks the 14-byte layout's
    /// offloads into the parameter shard have a ring of their own, of the parameters' part.
    fn offload_role(&self) -> Role {
        Role::Offload(self.sharded && self.params)
    }
}

/// What the tier moves: the state of the first `states` movable chunks, the storage of the
/// first `storages` chunks of [`by_size`]'s order, through rings of at most `slots` staging
/// buffers.
#[derive(Clone, Copy, Debug)]
struct Choice {
    states: usize,
    storages: usize,
    slots: usize,
}

/// What a staging ring holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Role {
    /// Chunks' optimizer state, for the CPU Adam: whole (`None`), or one part of sharded
    /// chunks' state, whose rings are used in step (slot `s` of each holds the same chunk).
    State(Option<ShardPart>),
    /// Chunks' parameter storage, for the CPU Adam.
    Params,
    /// Chunks' separate gradient storage, for the CPU Adam.
    Grads,
    /// Bytes an upload copies to the device.
    Upload,
    /// Gradients an offload copies from the device: into gradient storage, or (`true`) into
    /// the parameter shards of sharded ranks' 14-byte layout, whose staging buffers are of
    /// the parameters' part.
    Offload(bool),
}

impl Role {
    /// The part of sharded chunks' storage or state a ring of this role stages, where the
    /// buffers it stages are shards.
    fn part(self) -> Option<ShardPart> {
        match self {
            Role::State(part) => part,
            Role::Params | Role::Upload | Role::Offload(true) => Some(ShardPart::Params),
            Role::Grads | Role::Offload(false) => Some(ShardPart::Grads),
        }
    }
}

/// Moves the optimizer state of the fewest offloaded chunks to disk so that the host region
/// fits `host_budget`, then, where that is not enough, their parameter and gradient storage
/// (see the module doc); returns the schedule unchanged when it fits already or
/// `disk_budget` is 0. Fails, naming what each tier would need, when even every chunk's
/// state and storage on disk leaves the host region over its budget or the disk region over
/// `disk_budget`. On sharded ranks each rank moves its shards (budgets and sizes are a
/// rank's), in the same stages.
pub fn disk(mut schedule: Schedule, host_budget: u64, disk_budget: u64) -> Result<Schedule> {
    if schedule.host_bytes <= host_budget || disk_budget == 0 {
        return Ok(schedule);
    }
    let movable = movable(&schedule)?;
    if movable.is_empty() {
        return Ok(schedule);
    }
    let storage = storage(&schedule, &movable);
    let order = by_size(&schedule, &storage);
    let n = movable.len();
    let fits = |c: Choice| host_after(&schedule, &movable, &storage, &order, c) <= host_budget;
    // The fewest chunks' state, in update order, that leaves the host within budget,
    // double buffered; where no number of chunks fits so, through one staging buffer (the
    // read of the next chunk then waits for the write of this one, and the disk does not
    // overlap the CPU Adam). Then, every state moved, the fewest chunks' storage so.
    let states = (1..=n).map(|k| (k, 0));
    let storages = (1..=order.len()).map(|j| (n, j));
    let chosen = [2, 1]
        .into_iter()
        .flat_map(|slots| states.clone().map(move |(k, j)| (k, j, slots)))
        .chain(
            [2, 1]
                .into_iter()
                .flat_map(|slots| storages.clone().map(move |(k, j)| (k, j, slots))),
        )
        .map(|(states, storages, slots)| Choice {
            states,
            storages,
            slots,
        })
        .find(|&c| fits(c));
    let Some(choice) = chosen else {
        let all = Choice {
            states: n,
            storages: order.len(),
            slots: 1,
        };
        let host_need = host_after(&schedule, &movable, &storage, &order, all);
        return Err(Shortfall::error(match schedule.sharded() {
            true => ShortfallProblem::DiskSharded {
                host_need,
                chunks: n,
                host_budget,
            },
            false => ShortfallProblem::HostOverWithAllOnDisk {
                host_need,
                chunks: n,
                host_budget,
            },
        }));
    };
    let moved = moved_buffers(&movable, &storage, &order, choice);
    let disk_bytes = disk_region_bytes(moved.iter().map(|&b| schedule.buffer(b).size));
    if disk_bytes > disk_budget {
        return Err(Shortfall::error(ShortfallProblem::DiskOver {
            chunks: choice.states,
            host_budget,
            disk_need: disk_bytes,
            disk_budget,
        }));
    }
    place(&mut schedule, &movable, &storage, &order, choice)?;
    schedule.header.disk_budget_bytes = disk_budget;
    Ok(schedule)
}

/// The least host region `schedule` can have with the disk tier, and the disk that takes:
/// the optimizer state of every chunk whose state can move on disk, and their storage too
/// where that leaves less, through one staging buffer each (storage moved costs staging
/// buffers, which outweigh what small chunks save). `None` where the disk tier does not
/// apply: a schedule with no such chunk. For errors that quote the smallest budgets that
/// would fit (a rank's, on sharded ranks).
pub fn least_host(schedule: &Schedule) -> Option<(u64, u64)> {
    let movable = movable(schedule).ok()?;
    if movable.is_empty() {
        return None;
    }
    let storage = storage(schedule, &movable);
    let order = by_size(schedule, &storage);
    [0, order.len()]
        .into_iter()
        .map(|storages| {
            let c = Choice {
                states: movable.len(),
                storages,
                slots: 1,
            };
            let moved = moved_buffers(&movable, &storage, &order, c);
            let disk = disk_region_bytes(moved.iter().map(|&b| schedule.buffer(b).size));
            (host_after(schedule, &movable, &storage, &order, c), disk)
        })
        .min()
}

/// The least host region `schedule` can have with only the optimizer state on disk (every
/// chunk's whose state can move, through one staging buffer each, their storage kept in
/// host memory), and the disk that takes; `None` where the disk tier does not apply. A host
/// budget of at least this is met without moving storage ([`disk`] moves state first).
pub fn least_host_for_state(schedule: &Schedule) -> Option<(u64, u64)> {
    let movable = movable(schedule).ok()?;
    if movable.is_empty() {
        return None;
    }
    let storage = storage(schedule, &movable);
    let order = by_size(schedule, &storage);
    let c = Choice {
        states: movable.len(),
        storages: 0,
        slots: 1,
    };
    let moved = moved_buffers(&movable, &storage, &order, c);
    let disk = disk_region_bytes(moved.iter().map(|&b| schedule.buffer(b).size));
    Some((host_after(schedule, &movable, &storage, &order, c), disk))
}

/// Moves every model state the disk tier can take to disk, whatever the host budget: the
/// optimizer state and the storage of every chunk whose state can move, through rings of
/// `slots` staging buffers (1 or 2). For tests and measurements of the tier at its most
/// (the search takes the fewest chunks instead, [`disk`]); the schedule is returned
/// unchanged where the tier does not apply (no such chunk). On sharded ranks that is each
/// rank's shards of every chunk's optimizer state and storage. The caller verifies the
/// result.
pub fn every_state(mut schedule: Schedule, slots: usize) -> Result<Schedule> {
    let movable = movable(&schedule)?;
    if movable.is_empty() {
        return Ok(schedule);
    }
    let storage = storage(&schedule, &movable);
    let order = by_size(&schedule, &storage);
    let choice = Choice {
        states: movable.len(),
        storages: order.len(),
        slots: slots.clamp(1, 2),
    };
    place(&mut schedule, &movable, &storage, &order, choice)?;
    schedule.header.disk_budget_bytes = schedule.disk_bytes;
    schedule.header.host_budget_bytes = schedule.host_bytes;
    Ok(schedule)
}

/// The offloaded chunks whose state is on the host, in the order the host optimizer stream
/// first updates them; fails when a state buffer is used other than by that stream's
/// kernels (a compiler bug). A sharded chunk's master weights are no kernel's operand (the
/// update finds them by its parameter): they move with its moments.
fn movable(schedule: &Schedule) -> Result<Vec<Movable>> {
    let Some(opt) = optimizer_stream(schedule) else {
        return Ok(Vec::new());
    };
    let state: HashMap<BufferId, (ChunkId, Option<ShardPart>)> = schedule
        .buffers
        .iter()
        .enumerate()
        .filter_map(|(i, b)| match (b.space, b.kind) {
            (Space::Host, BufferKind::OptimizerState { chunk }) => {
                Some((BufferId::new(i), (chunk, None)))
            }
            (
                Space::Host,
                BufferKind::HostShard {
                    chunk,
                    part: part @ (ShardPart::AdamM | ShardPart::AdamV | ShardPart::Master),
                },
            ) => Some((BufferId::new(i), (chunk, Some(part)))),
            _ => None,
        })
        .collect();
    let mut out: Vec<Movable> = Vec::new();
    let mut index: HashMap<ChunkId, usize> = HashMap::new();
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            for t in refs(instr) {
                let Some(&(chunk, _)) = state.get(&t.buffer) else {
                    continue;
                };
                if s != opt || !matches!(instr, Instr::Kernel { .. }) {
                    return Err(CompileError::Validation(format!(
                        "the optimizer state of {chunk} is used by stream {} #{i}, not only \
                         by the CPU Adam: it cannot move to disk",
                        stream.name
                    )));
                }
                match index.get(&chunk) {
                    Some(&at) => {
                        if out[at].kernels.last() != Some(&i) {
                            out[at].kernels.push(i);
                        }
                    }
                    None => {
                        index.insert(chunk, out.len());
                        out.push(Movable {
                            chunk,
                            buffers: Vec::new(),
                            kernels: vec![i],
                        });
                    }
                }
            }
        }
    }
    let mut state: Vec<(BufferId, (ChunkId, Option<ShardPart>))> = state.into_iter().collect();
    state.sort();
    for (buffer, (chunk, part)) in state {
        if let Some(&at) = index.get(&chunk) {
            out[at].buffers.push((buffer, part));
        }
    }
    let staged = schedule.staged_chunks();
    out.retain(|m| !staged.contains(&m.chunk));
    Ok(out)
}

/// The host optimizer stream's index, if the schedule has one.
fn optimizer_stream(schedule: &Schedule) -> Option<usize> {
    schedule
        .streams
        .iter()
        .position(|s| s.kind == StreamKind::HostOptimizer)
}

/// The addresses an instruction reads or writes. A staged chunk's master weights are cast
/// from host memory before each upload (its state stays on the host), so a cast names none.
fn refs(instr: &Instr) -> Vec<TensorRef> {
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
            .copied()
            .collect(),
        Instr::Copy { src, dst, .. }
        | Instr::CopyShard { src, dst, .. }
        | Instr::DiskRead { src, dst, .. }
        | Instr::DiskWrite { src, dst, .. } => vec![*src, *dst],
        Instr::CastChunk { .. } => Vec::new(),
        Instr::AllReduce { at, .. }
        | Instr::AllGather { at, .. }
        | Instr::ReduceScatter { at, .. } => vec![*at],
        Instr::Record { .. } | Instr::Wait { .. } | Instr::EndMicroBatch { .. } => Vec::new(),
    }
}

/// For each movable chunk (in `movable`'s order), its storage buffers in host memory that
/// can move to disk: those that only its uploads read (from), its gradient offloads write
/// (to) and its AdamW kernels touch (see the module doc). Chunks without any have an empty
/// list. The tier moves the storage of the largest first ([`by_size`]).
fn storage(schedule: &Schedule, movable: &[Movable]) -> Vec<Vec<Stored>> {
    let opt = optimizer_stream(schedule);
    let mut owner: HashMap<BufferId, (usize, Stored, bool)> = HashMap::new();
    for (i, m) in movable.iter().enumerate() {
        for (b, buffer) in schedule.buffers.iter().enumerate() {
            let (params, sharded) = match buffer.kind {
                BufferKind::HostChunk { chunk } if chunk == m.chunk => (true, false),
                BufferKind::HostGradChunk { chunk } if chunk == m.chunk => (false, false),
                BufferKind::HostShard {
                    chunk,
                    part: ShardPart::Params,
                } if chunk == m.chunk => (true, true),
                BufferKind::HostShard {
                    chunk,
                    part: ShardPart::Grads,
                } if chunk == m.chunk => (false, true),
                _ => continue,
            };
            if buffer.space != Space::Host {
                continue;
            }
            let stored = Stored {
                buffer: BufferId::new(b),
                params,
                fetches: 0,
                offloads: 0,
                updated: false,
                sharded,
            };
            owner.insert(stored.buffer, (i, stored, true));
        }
    }
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (x, instr) in stream.instrs.iter().enumerate() {
            for t in refs(instr) {
                let Some((i, stored, ok)) = owner.get_mut(&t.buffer) else {
                    continue;
                };
                match instr {
                    Instr::Copy {
                        what: CopyKind::FetchChunk { .. },
                        src,
                        ..
                    }
                    | Instr::CopyShard {
                        what: CopyKind::FetchChunk { .. },
                        src,
                        ..
                    } if *src == t => stored.fetches += 1,
                    Instr::Copy {
                        what: CopyKind::OffloadGrads { .. },
                        dst,
                        ..
                    }
                    | Instr::CopyShard {
                        what: CopyKind::OffloadGrads { .. },
                        dst,
                        ..
                    } if *dst == t => stored.offloads += 1,
                    Instr::Kernel { .. } if Some(s) == opt && movable[*i].kernels.contains(&x) => {
                        stored.updated = true
                    }
                    _ => *ok = false,
                }
            }
        }
    }
    let mut out = vec![Vec::new(); movable.len()];
    let mut kept: Vec<(usize, Stored)> = owner
        .into_values()
        .filter(|&(_, _, ok)| ok)
        .map(|(i, s, _)| (i, s))
        .collect();
    kept.sort_by_key(|&(i, s)| (i, !s.params, s.buffer));
    for (i, s) in kept {
        out[i].push(s);
    }
    out
}

/// The chunks with storage that can move, the largest storage first (in update order among
/// equals): moving the largest frees the most host memory per chunk, and the staging
/// buffers, sized by the largest moved, do not grow as more move.
fn by_size(schedule: &Schedule, storage: &[Vec<Stored>]) -> Vec<usize> {
    let bytes = |i: usize| -> u64 {
        storage[i]
            .iter()
            .map(|s| schedule.buffer(s.buffer).size)
            .sum()
    };
    let mut order: Vec<usize> = (0..storage.len())
        .filter(|&i| !storage[i].is_empty())
        .collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(bytes(i)), i));
    order
}

/// The storage `choice` moves: that of the first `choice.storages` chunks of `order`.
fn moved_storage<'a>(
    storage: &'a [Vec<Stored>],
    order: &'a [usize],
    choice: Choice,
) -> impl Iterator<Item = &'a Stored> + Clone {
    order[..choice.storages]
        .iter()
        .flat_map(move |&i| storage[i].iter())
}

/// The buffers `choice` moves, in the order the disk region lays them out: the state, then
/// the storage.
fn moved_buffers(
    movable: &[Movable],
    storage: &[Vec<Stored>],
    order: &[usize],
    choice: Choice,
) -> Vec<BufferId> {
    movable[..choice.states]
        .iter()
        .flat_map(|m| m.buffers.iter().map(|&(b, _)| b))
        .chain(moved_storage(storage, order, choice).map(|s| s.buffer))
        .collect()
}

/// The staging rings `choice` needs: each role's buffer size (the largest it stages) and
/// count (`choice.slots`, or fewer where there are fewer uses), in a fixed role order.
fn rings(
    schedule: &Schedule,
    movable: &[Movable],
    storage: &[Vec<Stored>],
    order: &[usize],
    choice: Choice,
) -> Vec<(Role, u64, usize)> {
    let mut out = Vec::new();
    let mut ring = |role: Role, sizes: Vec<(u64, usize)>| {
        let size = sizes.iter().map(|&(s, _)| s).max().unwrap_or(0);
        let uses: usize = sizes.iter().map(|&(_, u)| u).sum();
        if uses > 0 {
            out.push((role, size, choice.slots.min(uses)));
        }
    };
    let size = |b: BufferId| schedule.buffer(b).size;
    for part in [
        None,
        Some(ShardPart::AdamM),
        Some(ShardPart::AdamV),
        Some(ShardPart::Master),
    ] {
        ring(
            Role::State(part),
            movable[..choice.states]
                .iter()
                .flat_map(|m| m.buffers.iter().filter(|&&(_, p)| p == part))
                .map(|&(b, _)| (size(b), 1))
                .collect(),
        );
    }
    let moved = || moved_storage(storage, order, choice);
    for (role, params) in [(Role::Params, true), (Role::Grads, false)] {
        ring(
            role,
            moved()
                .filter(|s| s.params == params && s.updated)
                .map(|s| (size(s.buffer), 1))
                .collect(),
        );
    }
    ring(
        Role::Upload,
        moved().map(|s| (size(s.buffer), s.fetches)).collect(),
    );
    for role in [Role::Offload(false), Role::Offload(true)] {
        ring(
            role,
            moved()
                .filter(|s| s.offload_role() == role)
                .map(|s| (size(s.buffer), s.offloads))
                .collect(),
        );
    }
    out
}

/// The host region after `choice` moves its buffers out and adds its staging rings, as the
/// planner lays it out ([`host_bytes_after`]).
fn host_after(
    schedule: &Schedule,
    movable: &[Movable],
    storage: &[Vec<Stored>],
    order: &[usize],
    choice: Choice,
) -> u64 {
    let moved = moved_buffers(movable, storage, order, choice);
    let added: Vec<u64> = rings(schedule, movable, storage, order, choice)
        .into_iter()
        .flat_map(|(_, size, count)| std::iter::repeat_n(size, count))
        .collect();
    host_bytes_after(schedule, &moved, &added)
}

/// A ring of staging buffers, handed out in turn.
struct Ring {
    ids: Vec<BufferId>,
    /// Uses so far; use `u` takes buffer `u mod len`.
    uses: usize,
}

impl Ring {
    /// The buffer of the next use, its index and that of the use before it in the same
    /// buffer (which must be done before this one starts).
    fn next(&mut self) -> (BufferId, usize, Option<usize>) {
        let u = self.uses;
        self.uses += 1;
        let n = self.ids.len();
        (self.ids[u % n], u, u.checked_sub(n))
    }
}

/// The staging buffer of each of a ring's users, for a user that needs one per use.
fn ring_of(rings: &mut HashMap<Role, Ring>, role: Role) -> &mut Ring {
    rings.get_mut(&role).expect("a ring for every role used")
}

/// One transfer of the disk stream, with the point of the step from which it may run.
struct DiskOp {
    /// 0 in an accumulating schedule's micro-batch program, 1 in its update (or the step).
    phase: u8,
    /// When, in [`ticks`]' run, its waits are all met.
    anchor: u64,
    /// Writes before reads at the same anchor (a read into a buffer a write empties).
    write: bool,
    waits: Vec<EventId>,
    instrs: Vec<Instr>,
    record: Option<EventId>,
}

/// The position of each stream's instructions in one run of the schedule where every stream
/// takes one instruction per round unless a wait holds it (a record first met in an earlier
/// round releases it): the micro-batch programs first, then the updates. Every order of
/// the disk's transfers that follows these positions is one the other streams can keep.
/// Fails on a schedule whose streams wait for each other in a cycle (a compiler bug).
fn ticks(schedule: &Schedule) -> Result<Vec<Vec<u64>>> {
    let n = schedule.streams.len();
    let mut out: Vec<Vec<u64>> = schedule
        .streams
        .iter()
        .map(|s| vec![0; s.instrs.len()])
        .collect();
    let marker: Vec<usize> = schedule
        .streams
        .iter()
        .map(|s| {
            s.instrs
                .iter()
                .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
                .map_or(0, |at| at + 1)
        })
        .collect();
    let ranges: Vec<Vec<(usize, usize)>> = match schedule.micro_batches() > 1 {
        true => vec![
            (0..n).map(|s| (0, marker[s])).collect(),
            (0..n)
                .map(|s| (marker[s], schedule.streams[s].instrs.len()))
                .collect(),
        ],
        false => vec![(0..n)
            .map(|s| (0, schedule.streams[s].instrs.len()))
            .collect()],
    };
    let mut recorded: HashSet<EventId> = HashSet::new();
    let mut tick = 1u64;
    for range in ranges {
        let mut pc: Vec<usize> = range.iter().map(|&(a, _)| a).collect();
        loop {
            let mut fresh = Vec::new();
            let mut progressed = false;
            for s in 0..n {
                if pc[s] >= range[s].1 {
                    continue;
                }
                match &schedule.streams[s].instrs[pc[s]] {
                    Instr::Wait { event } if !recorded.contains(event) => continue,
                    Instr::Record { event } => fresh.push(*event),
                    _ => {}
                }
                out[s][pc[s]] = tick;
                pc[s] += 1;
                progressed = true;
            }
            tick += 1;
            recorded.extend(fresh);
            if !progressed {
                break;
            }
        }
        if let Some(s) = (0..n).find(|&s| pc[s] < range[s].1) {
            return Err(CompileError::Validation(format!(
                "stream {} waits at #{} for an event no stream records before: the disk tier \
                 cannot order its transfers",
                schedule.streams[s].name, pc[s]
            )));
        }
    }
    Ok(out)
}

/// Just after an instruction at tick `t`, as a [`DiskOp`] anchor (between it and the
/// next tick's).
fn after(t: u64) -> u64 {
    2 * t + 1
}

/// Moves what `choice` takes to disk and adds the staging buffers, the disk stream and the
/// other streams' waits and records (see the module doc).
fn place(
    schedule: &mut Schedule,
    movable: &[Movable],
    storage: &[Vec<Stored>],
    order: &[usize],
    choice: Choice,
) -> Result<()> {
    let moved_chunks = &movable[..choice.states];
    let ring_sizes = rings(schedule, movable, storage, order, choice);
    let ids = moved_buffers(movable, storage, order, choice);
    let opt = optimizer_stream(schedule).expect("movable chunks are on the host optimizer stream");
    // The CPU Adam's kernels of each moved chunk made adjacent, so that its state is read
    // once and written once; the run's positions are taken on that order.
    let instrs = std::mem::take(&mut schedule.streams[opt].instrs);
    schedule.streams[opt].instrs = grouped(instrs, moved_chunks);
    let ticks = ticks(schedule)?;
    let micro_batches = schedule.micro_batches();
    let markers: Vec<Option<usize>> = schedule
        .streams
        .iter()
        .map(|s| {
            s.instrs
                .iter()
                .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        })
        .collect();
    let phase_of = |s: usize, at: usize| -> u8 {
        match markers[s] {
            Some(m) if micro_batches > 1 && at < m => 0,
            _ => 1,
        }
    };
    // The planner lays out the disk region and the host region without the moved buffers,
    // then places the staging buffers at the host region's end. The state ring keeps the
    // names it has had since the tier moved only state.
    move_to_disk(schedule, &ids);
    let mut rings: HashMap<Role, Ring> = HashMap::new();
    let mut slot = 0u32;
    // Sharded staging buffers are numbered per part: the state rings' slots pair one
    // chunk's parts (they come first, from 0); storage rings of a part take the numbers
    // after them.
    let mut shard_slot: HashMap<ShardPart, u32> = HashMap::new();
    for &(role, size, count) in &ring_sizes {
        let name = match role {
            Role::State(None) => "disk_staging",
            Role::State(Some(ShardPart::AdamM)) => "disk_adam_m_staging",
            Role::State(Some(ShardPart::AdamV)) => "disk_adam_v_staging",
            Role::State(Some(_)) => "disk_master_staging",
            Role::Params => "disk_param_staging",
            Role::Grads => "disk_grad_staging",
            Role::Upload => "disk_upload_staging",
            Role::Offload(false) => "disk_offload_staging",
            Role::Offload(true) => "disk_offload_param_staging",
        };
        // Storage rings are sharded where what they stage is (a schedule's moved storage
        // is all shards or none).
        let sharded = match role {
            Role::State(part) => part.is_some(),
            _ => moved_storage(storage, order, choice).any(|s| s.sharded),
        };
        let ids = (0..count)
            .map(|i| {
                // A sharded part's ring is sharded as what it stages; its slots pair the
                // rings of one chunk's parts (see `BufferKind::ShardStaging`).
                let kind = match (sharded, role.part()) {
                    (true, Some(part)) => {
                        let slot = shard_slot.entry(part).or_insert(0u32);
                        *slot += 1;
                        BufferKind::ShardStaging {
                            slot: *slot - 1,
                            part,
                        }
                    }
                    _ => {
                        slot += 1;
                        BufferKind::DiskStaging { slot: slot - 1 }
                    }
                };
                append_buffer(schedule, &format!("{name}{i}"), Space::Host, kind, size)
            })
            .collect();
        rings.insert(role, Ring { ids, uses: 0 });
    }
    schedule.header.prediction.host_bytes = schedule.host_bytes;
    let first_event = schedule.events;
    let mut next_event = first_event;
    let mut event = || {
        next_event += 1;
        EventId(next_event - 1)
    };
    let moved_storage: HashMap<BufferId, Stored> = moved_storage(storage, order, choice)
        .map(|s| (s.buffer, *s))
        .collect();
    let chunk_of: HashMap<BufferId, ChunkId> = movable
        .iter()
        .zip(storage)
        .flat_map(|(m, st)| st.iter().map(move |s| (s.buffer, m.chunk)))
        .collect();
    let mut ops: Vec<DiskOp> = Vec::new();

    // Uploads and gradient offloads of moved storage, on whatever streams run them, in
    // program order of each stream.
    let mut offload_anchor: HashMap<ChunkId, u64> = HashMap::new();
    let mut write_done: HashMap<Role, Vec<EventId>> = HashMap::new();
    let mut upload_done: Vec<EventId> = Vec::new();
    let mut upload_ticks: Vec<u64> = Vec::new();
    for (s, stream_ticks) in ticks.iter().enumerate() {
        let old = std::mem::take(&mut schedule.streams[s].instrs);
        let mut new = Vec::with_capacity(old.len());
        for (at, mut instr) in old.into_iter().enumerate() {
            let tick = stream_ticks[at];
            match &mut instr {
                Instr::Copy {
                    what: CopyKind::FetchChunk { chunk },
                    src,
                    bytes,
                    ..
                }
                | Instr::CopyShard {
                    what: CopyKind::FetchChunk { chunk },
                    src,
                    bytes,
                    ..
                } if moved_storage.contains_key(&src.buffer) => {
                    let (staging, u, prev) = ring_of(&mut rings, Role::Upload).next();
                    let (read, done) = (event(), event());
                    upload_done.push(done);
                    debug_assert_eq!(upload_done.len(), u + 1);
                    let waits = prev.map(|p| upload_done[p]).into_iter().collect();
                    let anchor = prev.map_or(0, |p| after(upload_ticks[p]));
                    upload_ticks.push(tick);
                    let staged = TensorRef {
                        buffer: staging,
                        offset: src.offset,
                    };
                    ops.push(DiskOp {
                        phase: phase_of(s, at),
                        anchor,
                        write: false,
                        waits,
                        instrs: vec![Instr::DiskRead {
                            chunk: *chunk,
                            src: *src,
                            dst: staged,
                            bytes: *bytes,
                        }],
                        record: Some(read),
                    });
                    *src = staged;
                    new.push(Instr::Wait { event: read });
                    new.push(instr);
                    new.push(Instr::Record { event: done });
                    continue;
                }
                Instr::Copy {
                    what: CopyKind::OffloadGrads { chunk },
                    dst,
                    bytes,
                    ..
                }
                | Instr::CopyShard {
                    what: CopyKind::OffloadGrads { chunk },
                    dst,
                    bytes,
                    ..
                } if moved_storage.contains_key(&dst.buffer) => {
                    let role = moved_storage[&dst.buffer].offload_role();
                    let (staging, o, prev) = ring_of(&mut rings, role).next();
                    let (landed, written) = (event(), event());
                    let done = write_done.entry(role).or_default();
                    done.push(written);
                    debug_assert_eq!(done.len(), o + 1);
                    if let Some(p) = prev {
                        new.push(Instr::Wait { event: done[p] });
                    }
                    let staged = TensorRef {
                        buffer: staging,
                        offset: dst.offset,
                    };
                    let anchor = after(tick);
                    let key = chunk_of.get(&dst.buffer).copied().unwrap_or(*chunk);
                    let a = offload_anchor.entry(key).or_insert(0);
                    *a = (*a).max(anchor);
                    ops.push(DiskOp {
                        phase: phase_of(s, at),
                        anchor,
                        write: true,
                        waits: vec![landed],
                        instrs: vec![Instr::DiskWrite {
                            chunk: *chunk,
                            src: staged,
                            dst: *dst,
                            bytes: *bytes,
                            carried: false,
                        }],
                        record: Some(written),
                    });
                    *dst = staged;
                    new.push(instr);
                    new.push(Instr::Record { event: landed });
                    continue;
                }
                _ => {}
            }
            new.push(instr);
        }
        schedule.streams[s].instrs = new;
    }
    // The CPU Adam: each moved chunk's kernels read their state and moved storage in staging
    // buffers, after a wait for the reads and before a record of the update.
    let old = std::mem::take(&mut schedule.streams[opt].instrs);
    let old_ticks = &ticks[opt];
    let group_of = |instr: &Instr| -> Option<usize> {
        let Instr::Kernel { inputs, .. } = instr else {
            return None;
        };
        inputs.iter().find_map(|t| {
            moved_chunks
                .iter()
                .position(|m| m.buffers.iter().any(|&(b, _)| b == t.buffer))
        })
    };
    let mut spans: Vec<Option<(usize, usize)>> = vec![None; moved_chunks.len()];
    for (at, instr) in old.iter().enumerate() {
        if let Some(i) = group_of(instr) {
            let span = spans[i].get_or_insert((at, at));
            span.1 = at;
        }
    }
    let mut update_done: Vec<EventId> = Vec::with_capacity(moved_chunks.len());
    let mut read_done: Vec<EventId> = Vec::with_capacity(moved_chunks.len());
    let mut redirect: Vec<HashMap<BufferId, BufferId>> = Vec::with_capacity(moved_chunks.len());
    let mut previous_users: HashMap<Role, Vec<usize>> = HashMap::new();
    for (i, m) in moved_chunks.iter().enumerate() {
        let (read, done) = (event(), event());
        read_done.push(read);
        update_done.push(done);
        let Some((first, last)) = spans[i] else {
            return Err(CompileError::Validation(format!(
                "the CPU Adam of {} has no kernel reading its state",
                m.chunk
            )));
        };
        let mut map = HashMap::new();
        let mut reads = Vec::new();
        let mut writes = Vec::new();
        let mut waits = Vec::new();
        let mut anchor = 0u64;
        let mut stage = |role: Role,
                         buffer: BufferId,
                         written: bool,
                         waits: &mut Vec<EventId>,
                         anchor: &mut u64| {
            let (staging, u, prev) = ring_of(&mut rings, role).next();
            let users = previous_users.entry(role).or_default();
            users.push(i);
            debug_assert_eq!(users.len(), u + 1);
            if let Some(p) = prev {
                let p = users[p];
                waits.push(update_done[p]);
                *anchor = (*anchor).max(after(old_ticks[spans[p].expect("grouped").1]));
            }
            map.insert(buffer, staging);
            let size = schedule.buffer(buffer).size;
            let whole = |b: BufferId| TensorRef {
                buffer: b,
                offset: 0,
            };
            reads.push(Instr::DiskRead {
                chunk: m.chunk,
                src: whole(buffer),
                dst: whole(staging),
                bytes: size,
            });
            if written {
                writes.push(Instr::DiskWrite {
                    chunk: m.chunk,
                    src: whole(staging),
                    dst: whole(buffer),
                    bytes: size,
                    carried: false,
                });
            }
        };
        for &(b, part) in &m.buffers {
            stage(Role::State(part), b, true, &mut waits, &mut anchor);
        }
        for s in storage[i]
            .iter()
            .filter(|s| moved_storage.contains_key(&s.buffer))
        {
            if s.updated {
                let role = if s.params { Role::Params } else { Role::Grads };
                // AdamW rounds the parameter into its storage in place; the gradients it
                // only reads.
                stage(role, s.buffer, s.params, &mut waits, &mut anchor);
            }
        }
        // Where the chunk's gradients are on disk the update reads them after their write;
        // its state is read with them, not ahead of the uploads the step needs first.
        if let Some(&a) = offload_anchor.get(&m.chunk) {
            anchor = anchor.max(a);
        }
        let phase = phase_of(opt, first);
        ops.push(DiskOp {
            phase,
            anchor,
            write: false,
            waits,
            instrs: reads,
            record: Some(read),
        });
        ops.push(DiskOp {
            phase,
            anchor: after(old_ticks[last]),
            write: true,
            waits: vec![done],
            instrs: writes,
            record: None,
        });
        redirect.push(map);
    }
    schedule.events = next_event;
    let mut instrs = Vec::with_capacity(old.len() + 2 * moved_chunks.len());
    for (at, mut instr) in old.into_iter().enumerate() {
        let group = spans
            .iter()
            .position(|s| s.is_some_and(|(a, b)| a <= at && at <= b));
        if let Some(i) = group {
            if spans[i].is_some_and(|(a, _)| a == at) {
                instrs.push(Instr::Wait {
                    event: read_done[i],
                });
            }
            if let Instr::Kernel {
                inputs, outputs, ..
            } = &mut instr
            {
                for t in inputs.iter_mut().chain(outputs.iter_mut()) {
                    if let Some(&staging) = redirect[i].get(&t.buffer) {
                        t.buffer = staging;
                    }
                }
            }
        }
        let end = group.filter(|&i| spans[i].is_some_and(|(_, b)| b == at));
        instrs.push(instr);
        if let Some(i) = end {
            instrs.push(Instr::Record {
                event: update_done[i],
            });
        }
    }
    schedule.streams[opt].instrs = instrs;

    // The disk stream: every transfer in the order the run first allows it.
    ops.sort_by_key(|op| (op.phase, op.anchor, !op.write));
    let mut io = Vec::new();
    let mut marked = micro_batches <= 1;
    for op in ops {
        if !marked && op.phase == 1 {
            io.push(Instr::EndMicroBatch { micro_batches });
            marked = true;
        }
        let mut waits = op.waits;
        waits.sort();
        waits.dedup();
        io.extend(waits.into_iter().map(|event| Instr::Wait { event }));
        io.extend(op.instrs);
        io.extend(op.record.map(|event| Instr::Record { event }));
    }
    if !marked {
        io.push(Instr::EndMicroBatch { micro_batches });
    }
    schedule.streams.push(Stream {
        name: "disk_io".into(),
        kind: StreamKind::DiskIo,
        instrs: io,
    });
    schedule.header.prediction.stream_busy_seconds.push(0.0);
    drop_unwaited(schedule, first_event);
    Ok(())
}

/// Removes the records of the tier's events (from `first` on) that no stream waits for (the
/// last uses of each staging ring, whose buffers nothing reuses), and numbers the rest
/// densely.
fn drop_unwaited(schedule: &mut Schedule, first: u32) {
    let waited: HashSet<EventId> = schedule
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter_map(|i| match i {
            Instr::Wait { event } => Some(*event),
            _ => None,
        })
        .collect();
    let mut number: HashMap<EventId, EventId> = HashMap::new();
    let mut next = first;
    for stream in &mut schedule.streams {
        stream.instrs.retain(|i| match i {
            Instr::Record { event } => event.0 < first || waited.contains(event),
            _ => true,
        });
        for instr in &mut stream.instrs {
            if let Instr::Record { event } = instr {
                if event.0 >= first {
                    number.insert(*event, EventId(next));
                    next += 1;
                    *event = number[event];
                }
            }
        }
    }
    for instr in schedule.streams.iter_mut().flat_map(|s| &mut s.instrs) {
        if let Instr::Wait { event } = instr {
            if let Some(&n) = number.get(event) {
                *event = n;
            }
        }
    }
    schedule.events = next;
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
/// sum can exceed the region): the parameters and gradients of streamed chunks that stay
/// (used by more than their uploads, offloads and updates), the gradient accumulators,
/// swapped activations and the disk tier's own staging buffers. Kinds with no bytes are
/// left out. For errors that say why more disk would not help.
pub fn host_kept(schedule: &Schedule) -> Vec<(&'static str, u64)> {
    let mut kept = [
        ("parameters", 0u64),
        ("gradients", 0),
        ("gradient accumulators", 0),
        ("swapped activations", 0),
        ("disk staging buffers", 0),
    ];
    for b in schedule.buffers.iter().filter(|b| b.space == Space::Host) {
        let at = match b.kind {
            BufferKind::HostChunk { .. }
            | BufferKind::HostShard {
                part: ShardPart::Params,
                ..
            } => 0,
            BufferKind::HostGradChunk { .. }
            | BufferKind::HostShard {
                part: ShardPart::Grads,
                ..
            } => 1,
            BufferKind::Accumulators => 2,
            BufferKind::HostActivation => 3,
            BufferKind::DiskStaging { .. } | BufferKind::ShardStaging { .. } => 4,
            _ => continue,
        };
        kept[at].1 = kept[at].1.saturating_add(b.size);
    }
    kept.into_iter().filter(|&(_, bytes)| bytes > 0).collect()
}
