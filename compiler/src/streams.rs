//! Streams: orders a placed graph's ops onto streams with events, and decides which buffer
//! each tensor of each instruction lives in.
//!
//! It decides nothing about movement: the placed graph says what moves where and when (its
//! movement ops, see [`crate::movement`]); this pass lowers each to a copy instruction on its
//! stream and adds the events its position in the program implies:
//!
//! - the compute stream runs the graph's device kernels in program order; a kernel's index is
//!   the step's timeline, on which every device buffer's live range is measured. A kernel is
//!   a host op (the host optimizer stream) when it reads a copy moved to the host;
//! - a copy (a movement start and its done) runs on the host-to-device or device-to-host
//!   stream. It waits for the compute kernel before its start in program order (none when the
//!   start precedes every kernel); the compute stream waits for it before the first kernel
//!   after its done (at the end when there is none). Each copy stream issues copies in the
//!   order they are needed;
//! - the host optimizer waits for the copies its ops read;
//! - a value's device buffer lives from its writer to its last reader, and until the copy
//!   that reads it is done; a copy's device destination from the first kernel after its start.
//!
//! - the 12-byte host layout ([`HostLayout::Staged`]): a staged chunk has no host parameter
//!   or gradient chunk; a host cast stream casts its master weights into one of two
//!   parameter staging buffers before each of its uploads (alternating in upload order,
//!   each cast after the upload that last read its buffer), the upload waits for its cast,
//!   and its gradient offload lands in one of two gradient staging buffers (alternating in
//!   offload order, each offload after the CPU Adam that last read its buffer).
//!
//! It does not choose offsets: every buffer gets one in the `plan` pass.

use crate::error::{CompileError, Result};
use crate::place::Placed;
use fnv::FnvHashMap as HashMap;
use protrain_ir::{
    Buffer, BufferId, BufferKind, ChunkId, ChunkTable, CopyKind, EventId, Graph, HostLayout, Instr,
    Movement, OpId, OpKind, ParamId, Role, ShardPart, Space, Stream, StreamKind, TensorRef,
    ValueId,
};
use std::collections::{BTreeMap, BTreeSet};

/// The compute stream.
pub const COMPUTE: usize = 0;
/// The host-to-device copy stream.
pub const H2D: usize = 1;
/// The device-to-host copy stream.
pub const D2H: usize = 2;
/// The host optimizer stream.
pub const HOST_OPTIMIZER: usize = 3;

/// A buffer before the planner has given it an offset.
#[derive(Clone, Debug)]
pub struct Pending {
    /// The buffer, offset 0 until planned.
    pub buffer: Buffer,
    /// For device buffers: the first and last compute kernel index it is live at; `None` for
    /// the whole step.
    pub live: Option<(u32, u32)>,
}

/// Streams, events and unplanned buffers.
#[derive(Clone, Debug)]
pub struct Streamed {
    /// The placed graph and policy.
    pub placed: Placed,
    /// Every buffer, by [`BufferId`].
    pub buffers: Vec<Pending>,
    /// Compute, host-to-device, device-to-host, host optimizer.
    pub streams: Vec<Stream>,
    /// Events used.
    pub events: u32,
    /// Homes of parameters, optimizer state and inputs.
    pub homes: Vec<(ValueId, TensorRef)>,
    /// Where the f32 master weight of each narrower parameter lives.
    pub masters: Vec<(ValueId, TensorRef)>,
    /// Where the loss is.
    pub loss: TensorRef,
    /// Where each of the graph's outputs is, in order (an interleaved graph's micro-batch
    /// losses first, see [`crate::interleave`]).
    pub outputs: Vec<TensorRef>,
    /// Kernels on the compute stream (the length of the timeline).
    pub compute_kernels: u32,
}

/// An instruction on a stream, before events are numbered.
enum Step {
    Kernel(OpId),
    Copy(CopyKind, TensorRef, TensorRef, u64),
    /// Wait until the compute stream has finished kernel `t`.
    AfterCompute(u32),
    /// Wait for a copy (by its index in `copies`).
    AfterCopy(usize),
    /// Cast a staged chunk's master weights for an upload (by its index in the casts).
    Cast(usize),
    /// Wait for a cast (by its index in the casts).
    AfterCast(usize),
    /// Wait until the host optimizer has finished this op.
    AfterHost(OpId),
}

/// The host cast stream (the 12-byte layout), after the other four when there are casts.
pub const HOST_CAST: usize = 4;

/// Staging buffers of each kind (parameters, gradients): two, so that filling one overlaps
/// the transfer or update reading the other.
pub const STAGING_SLOTS: usize = 2;

/// A cast of a staged chunk's master weights before one of its uploads.
struct CastPlan {
    chunk: ChunkId,
    src: TensorRef,
    dst: TensorRef,
    bytes: u64,
    /// The upload it makes (index in `copies`).
    upload: usize,
    /// The upload that last read its staging buffer, which it must wait for.
    after_upload: Option<usize>,
}

/// Bytes of optimizer state per parameter element: Adam's m and v in f32, plus an f32 master
/// weight when the parameters are narrower (mixed precision).
pub fn state_bytes_per_element(graph: &protrain_ir::Graph) -> u64 {
    let narrow = graph
        .params()
        .any(|(_, p)| graph.value(p.value).ty.dtype != protrain_ir::DType::F32);
    if narrow {
        12
    } else {
        8
    }
}

/// The source of a moved value: the value its copies were made from.
fn source(graph: &Graph, mut v: ValueId) -> ValueId {
    while let Some(op) = graph.value(v).producer {
        let op = graph.op(op);
        if !matches!(op.kind, OpKind::MoveStart(_) | OpKind::MoveDone(_)) {
            break;
        }
        let k = op.outputs.iter().position(|&o| o == v).expect("an output");
        v = op.inputs[k];
    }
    v
}

/// Whether a compute op runs on the host optimizer: it reads a copy moved to the host.
fn on_host(graph: &Graph, op: &protrain_ir::Op) -> bool {
    op.inputs.iter().any(|&v| {
        graph
            .value(v)
            .producer
            .is_some_and(|p| matches!(graph.op(p).kind, OpKind::MoveDone(m) if !m.to_device()))
    })
}

/// The program: device kernels in order (a kernel's index is its time), host ops, and each
/// copy (a movement start and its done) placed on the timeline.
struct Program {
    device: Vec<OpId>,
    host: Vec<OpId>,
    /// The last kernel's time.
    end: u32,
    time: HashMap<OpId, u32>,
    copies: Vec<MoveCopy>,
    /// The copy each movement done completes.
    copy_of_done: HashMap<OpId, usize>,
    /// The copies the compute stream waits for before each kernel, in program order of
    /// their dones.
    waits: BTreeMap<u32, Vec<usize>>,
    /// The copies it waits for after its last kernel, in program order.
    end_waits: Vec<usize>,
}

/// A copy: its movement pair and where it sits.
struct MoveCopy {
    movement: Movement,
    start: OpId,
    done: OpId,
    /// The kernel it waits for: the last before its start.
    after: Option<u32>,
    /// The kernel that waits for it: the first after its done (the last kernel when none).
    needed: u32,
}

impl Program {
    fn of(graph: &Graph) -> Self {
        let mut device = Vec::new();
        let mut host = Vec::new();
        let mut time = HashMap::default();
        let mut starts: HashMap<OpId, (Movement, Option<u32>)> = HashMap::default();
        let mut copies = Vec::new();
        let mut copy_of_done = HashMap::default();
        let mut pending_dones: Vec<usize> = Vec::new();
        let mut waits: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        let mut start_index: HashMap<OpId, usize> = HashMap::default();
        let mut order: Vec<OpId> = Vec::new();
        for (id, op) in graph.ops() {
            match op.kind {
                OpKind::MoveStart(m) => {
                    starts.insert(id, (m, device.len().checked_sub(1).map(|t| t as u32)));
                    start_index.insert(id, order.len());
                    order.push(id);
                }
                OpKind::MoveDone(_) => {
                    let start = graph.value(op.inputs[0]).producer.expect("a start");
                    let copy = copies.len();
                    let (movement, after) = starts[&start];
                    copies.push((start_index[&start], movement, start, id, after));
                    copy_of_done.insert(id, copy);
                    pending_dones.push(copy);
                }
                OpKind::Release { .. } => {}
                _ if on_host(graph, op) => host.push(id),
                _ => {
                    let t = device.len() as u32;
                    time.insert(id, t);
                    device.push(id);
                    if !pending_dones.is_empty() {
                        waits.insert(t, std::mem::take(&mut pending_dones));
                    }
                }
            }
        }
        let end = device.len().saturating_sub(1) as u32;
        // Copies are numbered by their starts' program order.
        let mut by_start: Vec<usize> = (0..copies.len()).collect();
        by_start.sort_by_key(|&c| copies[c].0);
        let mut renumber = vec![0; copies.len()];
        for (new, &old) in by_start.iter().enumerate() {
            renumber[old] = new;
        }
        let mut needed_of: HashMap<usize, u32> = HashMap::default();
        for (&t, list) in &waits {
            for &c in list {
                needed_of.insert(c, t);
            }
        }
        let mut ordered: Vec<Option<MoveCopy>> = (0..copies.len()).map(|_| None).collect();
        for (old, &(_, movement, start, done, after)) in copies.iter().enumerate() {
            ordered[renumber[old]] = Some(MoveCopy {
                movement,
                start,
                done,
                after,
                needed: needed_of.get(&old).copied().unwrap_or(end),
            });
        }
        let renum = |list: Vec<usize>| list.into_iter().map(|c| renumber[c]).collect();
        Self {
            device,
            host,
            end,
            time,
            copies: ordered
                .into_iter()
                .map(|c| c.expect("every copy"))
                .collect(),
            copy_of_done: copy_of_done
                .into_iter()
                .map(|(d, c)| (d, renumber[c]))
                .collect(),
            waits: waits.into_iter().map(|(t, l)| (t, renum(l))).collect(),
            end_waits: renum(pending_dones),
        }
    }
}

/// A copy instruction and when it may run.
struct CopyPlan {
    stream: usize,
    kind: CopyKind,
    src: TensorRef,
    dst: TensorRef,
    bytes: u64,
    /// Compute kernel it must follow (None: nothing).
    after: Option<u32>,
    /// Compute kernel that waits for it.
    needed: u32,
}

/// Each stream's steps: copies in the order the compute stream needs them (each after the
/// kernel it must follow), compute kernels with waits for the copies they need, host ops
/// after the copies they read. Returns the steps and the copies in issue order.
fn order_steps(
    graph: &Graph,
    program: &Program,
    copies: &[CopyPlan],
    staging: &Staging,
) -> (Vec<Vec<Step>>, Vec<usize>) {
    let mut per_stream: Vec<Vec<Step>> = (0..5).map(|_| Vec::new()).collect();
    let order = copy_order(copies);
    let cast_of: HashMap<usize, usize> = staging
        .casts
        .iter()
        .enumerate()
        .map(|(k, c)| (c.upload, k))
        .collect();
    for &i in &order {
        let c = &copies[i];
        if let Some(after) = c.after {
            per_stream[c.stream].push(Step::AfterCompute(after));
        }
        // The 12-byte layout: an upload waits for its cast; an offload into a gradient
        // staging buffer waits for the CPU Adam that read the buffer's previous gradients.
        if let Some(&k) = cast_of.get(&i) {
            per_stream[c.stream].push(Step::AfterCast(k));
        }
        if let Some(&op) = staging.offload_after.get(&i) {
            per_stream[c.stream].push(Step::AfterHost(op));
        }
        per_stream[c.stream].push(Step::Copy(c.kind, c.src, c.dst, c.bytes));
    }
    for (k, cast) in staging.casts.iter().enumerate() {
        if let Some(upload) = cast.after_upload {
            per_stream[HOST_CAST].push(Step::AfterCopy(upload));
        }
        per_stream[HOST_CAST].push(Step::Cast(k));
    }
    for (t, &op) in program.device.iter().enumerate() {
        for &i in program
            .waits
            .get(&(t as u32))
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            per_stream[COMPUTE].push(Step::AfterCopy(i));
        }
        per_stream[COMPUTE].push(Step::Kernel(op));
    }
    for &i in &program.end_waits {
        per_stream[COMPUTE].push(Step::AfterCopy(i));
    }
    // The host optimizer waits for the copies its ops read: a scalar once, before its first
    // op; a chunk's gradients before the first op of each run of that chunk's updates.
    let mut waited_scalar = false;
    let mut waited_chunk: Option<usize> = None;
    for &op in &program.host {
        let mut read: Vec<usize> = graph
            .op(op)
            .inputs
            .iter()
            .filter_map(|&v| graph.value(v).producer)
            .filter_map(|p| program.copy_of_done.get(&p).copied())
            .collect();
        read.sort_by_key(|&c| !matches!(program.copies[c].movement, Movement::ToHost));
        for c in read {
            match program.copies[c].movement {
                Movement::ToHost if !waited_scalar => {
                    waited_scalar = true;
                    per_stream[HOST_OPTIMIZER].push(Step::AfterCopy(c));
                }
                Movement::ToHost => {}
                _ if waited_chunk != Some(c) => {
                    waited_chunk = Some(c);
                    per_stream[HOST_OPTIMIZER].push(Step::AfterCopy(c));
                }
                _ => {}
            }
        }
        per_stream[HOST_OPTIMIZER].push(Step::Kernel(op));
    }
    (per_stream, order)
}

/// The copies in the order their streams issue them: by the kernel that needs them, then
/// the kernel they follow.
fn copy_order(copies: &[CopyPlan]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..copies.len()).collect();
    order.sort_by_key(|&i| (copies[i].needed, copies[i].after.unwrap_or(0), i));
    order
}

/// The 12-byte layout's plan: the casts in upload order, and for each offload into a
/// gradient staging buffer the last host optimizer op that read the buffer before it.
#[derive(Default)]
struct Staging {
    casts: Vec<CastPlan>,
    offload_after: HashMap<usize, OpId>,
}

/// The chunks of `lean` that are staged under `layout` (see [`HostLayout::Staged`]): none
/// unless the layout is the staged one, the schedule runs on one rank and no AdamW reads a
/// coefficient of the whole step's gradients (clipping, loss scaling: they need every
/// gradient before the first update, so gradients need a home until then, which the 14-byte
/// layout gives them). With a limit, the chunks uploaded fewest times per step are staged
/// first (each upload costs a cast), the later chunk among equals; the others stay lean.
fn staged_chunks(
    graph: &Graph,
    chunks: &ChunkTable,
    program: &Program,
    layout: HostLayout,
    lean: &BTreeSet<ChunkId>,
) -> BTreeSet<ChunkId> {
    let HostLayout::Staged { limit } = layout else {
        return BTreeSet::new();
    };
    let coef = graph.ops().any(|(_, op)| op.kind.is_grad_coef());
    if coef || chunks.world_size > 1 {
        return BTreeSet::new();
    }
    let mut uploads: HashMap<ChunkId, u32> = HashMap::default();
    for copy in &program.copies {
        if let Movement::Gather { chunk, .. } = copy.movement {
            *uploads.entry(chunk).or_insert(0) += 1;
        }
    }
    let mut order: Vec<ChunkId> = lean.iter().copied().collect();
    order.sort_by_key(|c| (uploads.get(c).copied().unwrap_or(0), std::cmp::Reverse(*c)));
    let take = limit.map_or(order.len(), |n| (n as usize).min(order.len()));
    order.into_iter().take(take).collect()
}

/// The streamed chunks whose gradients land in their host parameter storage under `layout`
/// (see [`HostLayout::GradsInParams`]): none for the full layout, for f32 parameters (each is
/// its own master weight, which the update reads) or with sequential gradient accumulation on
/// a rank (every micro-batch uploads the parameters again after the gradients arrived; the
/// chunk-major order, `interleaved`, offloads each gradient once, after the step's last
/// upload of its chunk, as one micro-batch does); else every chunk
/// whose uploads are all needed by a kernel no later than the one its gradient offload waits
/// for, so that each upload has read the storage before the gradients overwrite it. The
/// others keep the full layout.
fn lean_chunks(
    graph: &Graph,
    chunks: &ChunkTable,
    program: &Program,
    layout: HostLayout,
    interleaved: bool,
) -> BTreeSet<ChunkId> {
    let narrow = state_bytes_per_element(graph) == 12;
    // The loss gradient is scaled for every rank's micro-batches; sharded ranks take one each
    // ([`crate::shard::shardable`]), replicated ones may take several, in sequence unless
    // interleaved.
    let per_rank = match interleaved {
        true => 1,
        false => graph.micro_batches() / u64::from(chunks.world_size.max(1)),
    };
    if !layout.lean() || !narrow || per_rank > 1 {
        return BTreeSet::new();
    }
    let mut last_upload: HashMap<ChunkId, u32> = HashMap::default();
    for copy in &program.copies {
        if let Movement::Gather { chunk, .. } = copy.movement {
            let t = last_upload.entry(chunk).or_insert(0);
            *t = (*t).max(copy.needed);
        }
    }
    program
        .copies
        .iter()
        .filter_map(|copy| match copy.movement {
            Movement::OffloadGrads { chunk } => {
                let after = copy.after?;
                let uploaded = last_upload.get(&chunk).copied().unwrap_or(0);
                (uploaded <= after).then_some(chunk)
            }
            _ => None,
        })
        .collect()
}

/// Builds the streams of a placed graph, with each kernel's workspace planned for a GPU with
/// (`flash_attention`) or without the flash attention kernels
/// ([`protrain_ir::OpKind::workspace_bytes_for`]).
pub fn streams(placed: Placed, flash_attention: bool) -> Result<Streamed> {
    Builder::new(placed.chunks.chunk_bytes, flash_attention).build(placed)
}

struct Builder {
    /// Bytes of one chunk (and of one slot).
    chunk_bytes: u64,
    /// Whether the target runs the flash attention kernels (the workspaces follow it).
    flash_attention: bool,
    buffers: Vec<Pending>,
    homes: Vec<(ValueId, TensorRef)>,
    masters: Vec<(ValueId, TensorRef)>,
    /// Where each value a device kernel or a copy reads or writes is.
    primary: HashMap<ValueId, TensorRef>,
    /// Where each parameter and optimizer state value lives between steps.
    home: HashMap<ValueId, TensorRef>,
    slots: Vec<BufferId>,
    host_chunk: HashMap<ChunkId, BufferId>,
    grad_chunk: HashMap<ChunkId, (BufferId, BufferId)>,
    /// Optimizer-state homes of each parameter: (m, v).
    state_home: HashMap<ParamId, (TensorRef, TensorRef)>,
    /// The 12-byte layout: staged chunks, the staging buffers (parameters, gradients), the
    /// staging buffer of each staged upload and offload (by copy index), and where each
    /// staged chunk's master weights start.
    staged: BTreeSet<ChunkId>,
    param_staging: Vec<BufferId>,
    grad_staging: Vec<BufferId>,
    staging_of_copy: HashMap<usize, usize>,
    master_start: HashMap<ChunkId, TensorRef>,
}

impl Builder {
    fn new(chunk_bytes: u64, flash_attention: bool) -> Self {
        Self {
            chunk_bytes,
            flash_attention,
            buffers: Vec::new(),
            homes: Vec::new(),
            masters: Vec::new(),
            primary: HashMap::default(),
            home: HashMap::default(),
            slots: Vec::new(),
            host_chunk: HashMap::default(),
            grad_chunk: HashMap::default(),
            state_home: HashMap::default(),
            staged: BTreeSet::new(),
            param_staging: Vec::new(),
            grad_staging: Vec::new(),
            staging_of_copy: HashMap::default(),
            master_start: HashMap::default(),
        }
    }

    fn buffer(
        &mut self,
        name: String,
        space: Space,
        size: u64,
        kind: BufferKind,
        live: Option<(u32, u32)>,
    ) -> BufferId {
        self.buffers.push(Pending {
            buffer: Buffer {
                name,
                space,
                offset: 0,
                size,
                kind,
                pitch: None,
            },
            live,
        });
        BufferId::new(self.buffers.len() - 1)
    }

    fn at(buffer: BufferId, offset: u64) -> TensorRef {
        TensorRef { buffer, offset }
    }

    /// Runs the steps below in order: the program, homes and slots, the copies' operands
    /// (gathers, gradient offloads), activation buffers, swap buffers, the host scalars,
    /// kernel operands, then the order of each stream and its events. Buffers are created in
    /// that order, which fixes their ids.
    fn build(mut self, placed: Placed) -> Result<Streamed> {
        let (graph, chunks) = (&placed.graph, &placed.chunks);
        // Most values get a place: one allocation instead of a rehash at every doubling.
        self.primary.reserve(graph.values().len());
        let program = Program::of(graph);
        let interleaved = placed.interleaved;
        let lean = lean_chunks(graph, chunks, &program, placed.host_layout, interleaved);
        self.staged = staged_chunks(graph, chunks, &program, placed.host_layout, &lean);
        self.assign_staging(graph, chunks, &program);
        self.homes(graph, chunks, &program, &lean);
        self.slots(&program);
        let mut copies: Vec<Option<CopyPlan>> = (0..program.copies.len()).map(|_| None).collect();
        self.gathers(graph, chunks, &program, &mut copies);
        self.grad_offloads(graph, chunks, &program, &mut copies);
        self.activations(graph, &program);
        self.swaps(graph, &program, &mut copies);
        self.scalars(graph, &program, &mut copies);
        let copies: Vec<CopyPlan> = copies
            .into_iter()
            .map(|c| c.expect("every movement is lowered"))
            .collect();
        let kernels = self.kernels(graph, &program);
        let outputs: Vec<TensorRef> = graph.outputs().iter().map(|v| self.primary[v]).collect();
        let loss = outputs.first().copied().ok_or(CompileError::NoLoss)?;
        let staging = self.staging(graph, chunks, &program, &copies);
        let (per_stream, order) = order_steps(graph, &program, &copies, &staging);
        let (streams, events) = self.lower(
            per_stream,
            &order,
            &copies,
            &staging,
            kernels,
            &program.time,
        );
        Ok(Streamed {
            placed,
            buffers: self.buffers,
            streams,
            events,
            homes: self.homes,
            masters: self.masters,
            loss,
            outputs,
            compute_kernels: program.device.len() as u32,
        })
    }

    /// Homes of the inputs, the chunks and their optimizer state (Adam moments mirroring each
    /// chunk, then f32 master weights of narrower parameters), and the device and host
    /// gradient chunks of every streamed chunk the optimizer updates. A chunk is streamed when
    /// the graph gathers it. A `lean` chunk (the 14-byte host layout) has no host gradient
    /// chunk: its gradients land in its host parameter storage.
    fn homes(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        program: &Program,
        lean: &BTreeSet<ChunkId>,
    ) {
        let streamed: BTreeSet<ChunkId> = program
            .copies
            .iter()
            .filter_map(|c| match c.movement {
                Movement::Gather { chunk, .. } => Some(chunk),
                _ => None,
            })
            .collect();
        for &v in graph.inputs() {
            let b = self.buffer(
                graph.value(v).name.clone(),
                Space::Device,
                graph.value(v).ty.bytes(),
                BufferKind::Input,
                None,
            );
            self.homes.push((v, Self::at(b, 0)));
            self.primary.insert(v, Self::at(b, 0));
        }
        let adam: HashMap<ValueId, (ValueId, ValueId)> = graph
            .ops()
            .filter(|(_, op)| matches!(op.kind, OpKind::AdamW { .. }))
            .map(|(_, op)| (op.inputs[0], (op.inputs[2], op.inputs[3])))
            .collect();
        // Per element of a chunk's parameters; computed once, as it reads every parameter.
        let state_bytes = state_bytes_per_element(graph);
        for (c, chunk) in chunks.iter() {
            let persistent = !streamed.contains(&c);
            let with_state = chunk
                .members
                .iter()
                .any(|m| adam.contains_key(&graph.param(m.param).value));
            if !persistent && with_state && chunks.world_size > 1 {
                self.shard_homes(graph, chunks, c, &adam, lean.contains(&c));
                continue;
            }
            let (space, kind) = match persistent {
                true => (Space::Device, BufferKind::PersistentChunk { chunk: c }),
                false => (Space::Host, BufferKind::HostChunk { chunk: c }),
            };
            // A staged chunk (the 12-byte layout) keeps no narrow copy: its uploads are cast
            // into a parameter staging buffer.
            let staged = self.staged.contains(&c);
            let home = (!staged)
                .then(|| self.buffer(format!("chunk{}", c.0), space, chunk.used_bytes, kind, None));
            if let (false, Some(home)) = (persistent, home) {
                self.host_chunk.insert(c, home);
            }
            // Adam moments mirror the chunk: every m, then every v, f32. Parameters in a
            // narrower type also keep an f32 master copy, after the moments.
            let elems: Vec<u64> = chunk
                .members
                .iter()
                .map(|m| graph.value(graph.param(m.param).value).ty.numel())
                .collect();
            let total: u64 = elems.iter().sum();
            let state = with_state.then(|| {
                self.buffer(
                    format!("adam{}", c.0),
                    space,
                    state_bytes * total,
                    BufferKind::OptimizerState { chunk: c },
                    None,
                )
            });
            let mut elem = 0;
            if let (true, Some(state)) = (staged, state) {
                self.master_start.insert(c, Self::at(state, 4 * 2 * total));
            }
            for (member, n) in chunk.members.iter().zip(&elems) {
                let value = graph.param(member.param).value;
                if let Some(home) = home {
                    self.homes.push((value, Self::at(home, member.offset)));
                    self.home.insert(value, Self::at(home, member.offset));
                    if persistent {
                        self.primary.insert(value, Self::at(home, member.offset));
                    }
                }
                if let (Some(state), Some(&(m, v))) = (state, adam.get(&value)) {
                    let (mr, vr) = (
                        Self::at(state, 4 * elem),
                        Self::at(state, 4 * (total + elem)),
                    );
                    self.homes.push((m, mr));
                    self.homes.push((v, vr));
                    self.home.insert(m, mr);
                    self.home.insert(v, vr);
                    if persistent {
                        self.primary.insert(m, mr);
                        self.primary.insert(v, vr);
                    }
                    self.state_home.insert(member.param, (mr, vr));
                    if graph.value(value).ty.dtype != protrain_ir::DType::F32 {
                        self.masters
                            .push((value, Self::at(state, 4 * (2 * total + elem))));
                    }
                }
                elem += n;
            }
            if !persistent && with_state {
                let g = self.buffer(
                    format!("grads{}", c.0),
                    Space::Device,
                    chunk.used_bytes,
                    BufferKind::GradChunk { chunk: c },
                    Some((0, 0)),
                );
                // A staged chunk's gradients land in a gradient staging buffer (chosen per
                // offload, see `grad_offloads`); a lean one's in its parameter storage.
                let hg = match (home, lean.contains(&c)) {
                    (None, _) => self.grad_staging[0],
                    (Some(home), true) => home,
                    (Some(_), false) => self.buffer(
                        format!("host_grads{}", c.0),
                        Space::Host,
                        chunk.used_bytes,
                        BufferKind::HostGradChunk { chunk: c },
                        None,
                    ),
                };
                self.grad_chunk.insert(c, (g, hg));
            }
        }
    }

    /// Homes of an offloaded chunk sharded over `chunks.world_size` ranks (ZeRO-3 style; see
    /// [`protrain_ir::BufferKind::HostShard`]): each part of its host state (parameters,
    /// gradients, Adam moments, f32 master weights) is one buffer of `1/ranks` of the part's
    /// whole layout, which keeps the chunk's layout (`chunk_bytes`, padding included) for
    /// parameters and gradients and mirrors it element for element in f32 for the rest. The
    /// device gradient chunk spans `chunk_bytes`, as the reduce-scatter sums every rank's
    /// equal slices of it. A `lean` chunk (the 14-byte layout) has no gradient shard: each
    /// rank's slice of the summed gradients lands in its parameter shard, as a whole chunk's
    /// gradients land in its parameter storage. [`crate::shard`] turns the chunk's copies
    /// into shard copies and collectives.
    fn shard_homes(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        c: ChunkId,
        adam: &HashMap<ValueId, (ValueId, ValueId)>,
        lean: bool,
    ) {
        let chunk = chunks.chunk(c);
        let ranks = u64::from(chunks.world_size);
        let slice = chunks.chunk_bytes / ranks;
        let element = chunk.members.first().map_or(4, |m| {
            graph.value(graph.param(m.param).value).ty.dtype.size()
        });
        let narrow = element < 4;
        let part = |this: &mut Self, name: &str, part: ShardPart, bytes: u64| {
            this.buffer(
                format!("{name}{}", c.0),
                Space::Host,
                bytes,
                BufferKind::HostShard { chunk: c, part },
                None,
            )
        };
        let wide = slice / element * 4;
        let home = part(self, "chunk", ShardPart::Params, slice);
        let m_buf = part(self, "adam_m", ShardPart::AdamM, wide);
        let v_buf = part(self, "adam_v", ShardPart::AdamV, wide);
        let master = narrow.then(|| part(self, "master", ShardPart::Master, wide));
        self.host_chunk.insert(c, home);
        for member in &chunk.members {
            let value = graph.param(member.param).value;
            self.homes.push((value, Self::at(home, member.offset)));
            self.home.insert(value, Self::at(home, member.offset));
            let Some(&(m, v)) = adam.get(&value) else {
                continue;
            };
            let wide_at = member.offset / element * 4;
            let (mr, vr) = (Self::at(m_buf, wide_at), Self::at(v_buf, wide_at));
            self.homes.push((m, mr));
            self.homes.push((v, vr));
            self.home.insert(m, mr);
            self.home.insert(v, vr);
            self.state_home.insert(member.param, (mr, vr));
            if let Some(master) = master {
                self.masters.push((value, Self::at(master, wide_at)));
            }
        }
        let g = self.buffer(
            format!("grads{}", c.0),
            Space::Device,
            chunks.chunk_bytes,
            BufferKind::GradChunk { chunk: c },
            Some((0, 0)),
        );
        let hg = match lean {
            true => home,
            false => part(self, "host_grads", ShardPart::Grads, slice),
        };
        self.grad_chunk.insert(c, (g, hg));
    }

    /// The 12-byte layout: the staging buffers, and which one each staged upload and offload
    /// uses (alternating in the order their streams issue them). Stages nothing when the host
    /// optimizer would update staged chunks in another order than their offloads arrive (an
    /// offload waits for the update two before it, which would then wait for it).
    fn assign_staging(&mut self, graph: &Graph, chunks: &ChunkTable, program: &Program) {
        if self.staged.is_empty() {
            return;
        }
        let mut order: Vec<usize> = (0..program.copies.len()).collect();
        order.sort_by_key(|&i| {
            let c = &program.copies[i];
            (c.needed, c.after.unwrap_or(0), i)
        });
        let offloads: Vec<usize> = order
            .iter()
            .copied()
            .filter(|&i| {
                matches!(program.copies[i].movement,
                    Movement::OffloadGrads { chunk } if self.staged.contains(&chunk))
            })
            .collect();
        let mut updated: Vec<ChunkId> = Vec::new();
        for &op in &program.host {
            let o = graph.op(op);
            if let (OpKind::AdamW { .. }, Some(p)) = (&o.kind, graph.param_of(o.inputs[0])) {
                let c = chunks.locate(p).0;
                if self.staged.contains(&c) && !updated.contains(&c) {
                    updated.push(c);
                }
            }
        }
        let offloaded: Vec<ChunkId> = offloads
            .iter()
            .map(|&i| match program.copies[i].movement {
                Movement::OffloadGrads { chunk } => chunk,
                _ => unreachable!("filtered to offloads"),
            })
            .collect();
        if offloaded != updated {
            self.staged.clear();
            return;
        }
        let uploads = order.iter().copied().filter(|&i| {
            matches!(program.copies[i].movement,
                Movement::Gather { chunk, .. } if self.staged.contains(&chunk))
        });
        for (k, i) in uploads.enumerate() {
            self.staging_of_copy.insert(i, k % STAGING_SLOTS);
        }
        for (k, &i) in offloads.iter().enumerate() {
            self.staging_of_copy.insert(i, k % STAGING_SLOTS);
        }
        let bytes = self.chunk_bytes;
        for slot in 0..STAGING_SLOTS as u32 {
            let b = self.buffer(
                format!("param_staging{slot}"),
                Space::Host,
                bytes,
                BufferKind::ParamStaging { slot },
                None,
            );
            self.param_staging.push(b);
        }
        for slot in 0..STAGING_SLOTS as u32 {
            let b = self.buffer(
                format!("grad_staging{slot}"),
                Space::Host,
                bytes,
                BufferKind::GradStaging { slot },
                None,
            );
            self.grad_staging.push(b);
        }
    }

    /// The 12-byte layout's casts and waits (see [`Staging`]): a cast before each staged
    /// upload, waiting for the upload that read its staging buffer before; each offload into
    /// a gradient staging buffer after the last AdamW of the chunk that used it before.
    fn staging(
        &self,
        graph: &Graph,
        chunks: &ChunkTable,
        program: &Program,
        copies: &[CopyPlan],
    ) -> Staging {
        let mut staging = Staging::default();
        if self.staged.is_empty() {
            return staging;
        }
        let mut last_update: HashMap<ChunkId, OpId> = HashMap::default();
        for &op in &program.host {
            let o = graph.op(op);
            if let (OpKind::AdamW { .. }, Some(p)) = (&o.kind, graph.param_of(o.inputs[0])) {
                last_update.insert(chunks.locate(p).0, op);
            }
        }
        let mut last_upload: [Option<usize>; STAGING_SLOTS] = [None; STAGING_SLOTS];
        let mut last_offload: [Option<ChunkId>; STAGING_SLOTS] = [None; STAGING_SLOTS];
        for i in copy_order(copies) {
            let Some(&k) = self.staging_of_copy.get(&i) else {
                continue;
            };
            match program.copies[i].movement {
                Movement::Gather { chunk, .. } => {
                    staging.casts.push(CastPlan {
                        chunk,
                        src: self.master_start[&chunk],
                        dst: Self::at(self.param_staging[k], 0),
                        bytes: chunks.chunk(chunk).used_bytes,
                        upload: i,
                        after_upload: last_upload[k],
                    });
                    last_upload[k] = Some(i);
                }
                Movement::OffloadGrads { chunk } => {
                    if let Some(before) = last_offload[k] {
                        staging.offload_after.insert(i, last_update[&before]);
                    }
                    last_offload[k] = Some(chunk);
                }
                _ => {}
            }
        }
        staging
    }

    /// The chunk slots the graph's gathers name.
    fn slots(&mut self, program: &Program) {
        let slots = program
            .copies
            .iter()
            .filter_map(|c| match c.movement {
                Movement::Gather { slot, .. } => Some(slot + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let bytes = self.chunk_bytes;
        for s in 0..slots {
            let b = self.buffer(
                format!("slot{s}"),
                Space::Device,
                bytes,
                BufferKind::ChunkSlot { slot: s },
                None,
            );
            self.slots.push(b);
        }
    }

    /// A copy's instruction, on the stream its direction takes.
    fn plan(
        copy: &MoveCopy,
        kind: CopyKind,
        src: TensorRef,
        dst: TensorRef,
        bytes: u64,
    ) -> CopyPlan {
        CopyPlan {
            stream: if copy.movement.to_device() { H2D } else { D2H },
            kind,
            src,
            dst,
            bytes,
            after: copy.after,
            needed: copy.needed,
        }
    }

    /// Each gather copies its chunk's host home into its slot, where the kernels read the
    /// gathered parameters.
    fn gathers(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        program: &Program,
        copies: &mut [Option<CopyPlan>],
    ) {
        for (i, copy) in program.copies.iter().enumerate() {
            let Movement::Gather { chunk, slot } = copy.movement else {
                continue;
            };
            let slot = self.slots[slot as usize];
            for &v in &graph.op(copy.done).outputs {
                let p = graph
                    .param_of(source(graph, v))
                    .expect("gathers copy parameters");
                self.primary.insert(v, Self::at(slot, chunks.locate(p).1));
            }
            let src = match self.staging_of_copy.get(&i) {
                Some(&k) => self.param_staging[k],
                None => self.host_chunk[&chunk],
            };
            copies[i] = Some(Self::plan(
                copy,
                CopyKind::FetchChunk { chunk },
                Self::at(src, 0),
                Self::at(slot, 0),
                chunks.chunk(chunk).used_bytes,
            ));
        }
    }

    /// Each gradient offload copies its chunk's device gradient chunk, where the backward
    /// pass writes the gradients, to the host gradient chunk the host optimizer reads; the
    /// device chunk lives from the first gradient's writer until the copy is done.
    fn grad_offloads(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        program: &Program,
        copies: &mut [Option<CopyPlan>],
    ) {
        // The parameter of each host gradient copy: the host optimizer op that reads it.
        let mut param_of_host_grad: HashMap<ValueId, ParamId> = HashMap::default();
        for &op in &program.host {
            let o = graph.op(op);
            if let (OpKind::AdamW { .. }, Some(p)) = (&o.kind, graph.param_of(o.inputs[0])) {
                param_of_host_grad.insert(o.inputs[1], p);
            }
        }
        for (i, copy) in program.copies.iter().enumerate() {
            let Movement::OffloadGrads { chunk } = copy.movement else {
                continue;
            };
            let (g, mut hg) = self.grad_chunk[&chunk];
            let staged = self.staging_of_copy.get(&i).copied();
            if let Some(k) = staged {
                hg = self.grad_staging[k];
            }
            let start = graph.op(copy.start);
            let mut first = copy.needed;
            let mut done = 0;
            for (&grad, &host) in start.inputs.iter().zip(&graph.op(copy.done).outputs) {
                let p = param_of_host_grad[&host];
                let offset = chunks.locate(p).1;
                self.primary.insert(grad, Self::at(g, offset));
                self.primary.insert(host, Self::at(hg, offset));
                // A staged parameter has no home: its AdamW writes the rounded parameter
                // over the gradient it read, in the staging buffer.
                if staged.is_some() {
                    self.home.insert(graph.param(p).value, Self::at(hg, offset));
                }
                let producer = graph.value(grad).producer.expect("gradients are computed");
                let t = program.time[&producer];
                first = first.min(t);
                done = done.max(t);
            }
            self.buffers[g.index()].live = Some((first, copy.needed.max(done)));
            copies[i] = Some(Self::plan(
                copy,
                CopyKind::OffloadGrads { chunk },
                Self::at(g, 0),
                Self::at(hg, 0),
                chunks.chunk(chunk).used_bytes,
            ));
        }
    }

    /// A device buffer for every value a device kernel writes (gradients of streamed
    /// parameters go into their gradient chunk instead), live from its writer to its last
    /// reader, and until a copy that reads it is done; the loss's until the end.
    fn activations(&mut self, graph: &Graph, program: &Program) {
        let mut last: HashMap<ValueId, u32> = HashMap::default();
        for (t, &op) in program.device.iter().enumerate() {
            for &v in &graph.op(op).inputs {
                last.insert(v, t as u32);
            }
        }
        for copy in &program.copies {
            if !copy.movement.to_device() {
                for &v in &graph.op(copy.start).inputs {
                    let l = last.entry(v).or_insert(copy.needed);
                    *l = (*l).max(copy.needed);
                }
            }
        }
        for (t, &op) in program.device.iter().enumerate() {
            let t = t as u32;
            for &v in &graph.op(op).outputs {
                if self.primary.contains_key(&v) {
                    continue;
                }
                let value = graph.value(v);
                let mut end = last.get(&v).copied().unwrap_or(t).max(t);
                if value.role == Role::Loss {
                    end = program.end;
                }
                let b = self.buffer(
                    value.name.clone(),
                    Space::Device,
                    value.ty.bytes(),
                    BufferKind::Activation,
                    Some((t, end)),
                );
                self.primary.insert(v, Self::at(b, 0));
            }
        }
    }

    /// Each swapped activation's host copy, and the device buffer it is reloaded into, live
    /// from the first kernel after the reload starts to the reloaded copy's last reader.
    fn swaps(&mut self, graph: &Graph, program: &Program, copies: &mut [Option<CopyPlan>]) {
        let mut last: HashMap<ValueId, u32> = HashMap::default();
        for (t, &op) in program.device.iter().enumerate() {
            for &v in &graph.op(op).inputs {
                last.insert(v, t as u32);
            }
        }
        // The reload of each offload: the copy whose start reads the offload's host copy.
        let mut reload_of: HashMap<usize, usize> = HashMap::default();
        for (i, copy) in program.copies.iter().enumerate() {
            if let Movement::Reload = copy.movement {
                let host = graph.op(copy.start).inputs[0];
                let offload = graph.value(host).producer.expect("offloaded");
                reload_of.insert(program.copy_of_done[&offload], i);
            }
        }
        for (i, copy) in program.copies.iter().enumerate() {
            let Movement::Offload = copy.movement else {
                continue;
            };
            let v = graph.op(copy.start).inputs[0];
            let value = graph.value(v).clone();
            let host = self.buffer(
                format!("{}.host", value.name),
                Space::Host,
                value.ty.bytes(),
                BufferKind::HostActivation,
                None,
            );
            let host_copy = graph.op(copy.done).outputs[0];
            self.primary.insert(host_copy, Self::at(host, 0));
            copies[i] = Some(Self::plan(
                copy,
                CopyKind::OffloadActivation { value: v },
                self.primary[&v],
                Self::at(host, 0),
                value.ty.bytes(),
            ));
            let Some(&r) = reload_of.get(&i) else {
                continue;
            };
            let reload = &program.copies[r];
            let reloaded_value = graph.op(reload.done).outputs[0];
            let issue = reload.after.map_or(0, |a| a + 1);
            let end = last
                .get(&reloaded_value)
                .copied()
                .unwrap_or(reload.needed)
                .max(reload.needed);
            let reloaded = self.buffer(
                format!("{}.reload", value.name),
                Space::Device,
                value.ty.bytes(),
                BufferKind::Activation,
                Some((issue, end)),
            );
            self.primary.insert(reloaded_value, Self::at(reloaded, 0));
            copies[r] = Some(Self::plan(
                reload,
                CopyKind::ReloadActivation { value: v },
                Self::at(host, 0),
                Self::at(reloaded, 0),
                value.ty.bytes(),
            ));
        }
    }

    /// Each scalar copied to the host (the clip coefficient) gets its host home.
    fn scalars(&mut self, graph: &Graph, program: &Program, copies: &mut [Option<CopyPlan>]) {
        for (i, copy) in program.copies.iter().enumerate() {
            let Movement::ToHost = copy.movement else {
                continue;
            };
            let v = graph.op(copy.start).inputs[0];
            let value = graph.value(v).clone();
            let host = self.buffer(
                format!("{}.host", value.name),
                Space::Host,
                value.ty.bytes(),
                BufferKind::HostActivation,
                None,
            );
            self.primary
                .insert(graph.op(copy.done).outputs[0], Self::at(host, 0));
            copies[i] = Some(Self::plan(
                copy,
                CopyKind::Scalar { value: v },
                self.primary[&v],
                Self::at(host, 0),
                value.ty.bytes(),
            ));
        }
    }

    /// Where an op reads `v`: where a kernel or copy put it, else its home.
    fn read_ref(&self, v: ValueId) -> TensorRef {
        match self.primary.get(&v) {
            Some(&r) => r,
            None => self.home[&v],
        }
    }

    /// Every op's kernel instruction with its operands: device kernels get a workspace when
    /// their kind needs one (created in time order, so workspace buffers are numbered the
    /// same way every run); host ops read homes and host copies.
    fn kernels(&mut self, graph: &Graph, program: &Program) -> HashMap<OpId, Instr> {
        let mut kernels: HashMap<OpId, Instr> = HashMap::default();
        for (t, &op) in program.device.iter().enumerate() {
            let t = t as u32;
            let o = graph.op(op);
            let inputs: Vec<TensorRef> = o.inputs.iter().map(|&v| self.read_ref(v)).collect();
            let outputs: Vec<TensorRef> = o.outputs.iter().map(|v| self.primary[v]).collect();
            let types: Vec<&protrain_ir::TensorType> =
                o.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let ws = o.kind.workspace_bytes_for(&types, self.flash_attention);
            let workspace = (ws > 0).then(|| {
                let b = self.buffer(
                    format!("workspace.{}", o.kind.mnemonic()),
                    Space::Device,
                    ws,
                    BufferKind::Workspace,
                    Some((t, t)),
                );
                Self::at(b, 0)
            });
            kernels.insert(
                op,
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace,
                },
            );
        }
        for &op in &program.host {
            let o = graph.op(op);
            let inputs = o.inputs.iter().map(|&v| self.read_ref(v)).collect();
            let outputs = o.outputs.iter().map(|v| self.primary[v]).collect();
            kernels.insert(
                op,
                Instr::Kernel {
                    op,
                    inputs,
                    outputs,
                    workspace: None,
                },
            );
        }
        kernels
    }

    /// Lowers each stream's steps to instructions, numbering events: one per compute kernel
    /// something waits for, one per copy something waits for, recorded right after it.
    /// Returns the streams and the number of events.
    fn lower(
        &self,
        per_stream: Vec<Vec<Step>>,
        order: &[usize],
        copies: &[CopyPlan],
        staging: &Staging,
        mut kernels: HashMap<OpId, Instr>,
        time: &HashMap<OpId, u32>,
    ) -> (Vec<Stream>, u32) {
        let mut compute_event: BTreeMap<u32, EventId> = BTreeMap::new();
        let mut copy_event: HashMap<usize, EventId> = HashMap::default();
        let mut cast_event: HashMap<usize, EventId> = HashMap::default();
        let mut host_event: HashMap<OpId, EventId> = HashMap::default();
        let mut next = 0u32;
        let event = |next: &mut u32| {
            *next += 1;
            EventId(*next - 1)
        };
        for steps in &per_stream {
            for s in steps {
                match s {
                    Step::AfterCompute(t) => {
                        compute_event.entry(*t).or_insert_with(|| event(&mut next));
                    }
                    Step::AfterCopy(i) => {
                        copy_event.entry(*i).or_insert_with(|| event(&mut next));
                    }
                    Step::AfterCast(k) => {
                        cast_event.entry(*k).or_insert_with(|| event(&mut next));
                    }
                    Step::AfterHost(op) => {
                        host_event.entry(*op).or_insert_with(|| event(&mut next));
                    }
                    _ => {}
                }
            }
        }
        // Copies in stream order, to map copy index -> position.
        let mut copy_index_of: HashMap<(usize, usize), usize> = HashMap::default();
        let mut per_stream_count = [0usize; 5];
        for &i in order {
            let stream = copies[i].stream;
            copy_index_of.insert((stream, per_stream_count[stream]), i);
            per_stream_count[stream] += 1;
        }
        let names = ["compute", "h2d", "d2h", "host_optimizer", "host_cast"];
        let kinds = [
            StreamKind::Compute,
            StreamKind::HostToDevice,
            StreamKind::DeviceToHost,
            StreamKind::HostOptimizer,
            StreamKind::HostCast,
        ];
        let mut streams = Vec::new();
        for (s, steps) in per_stream.into_iter().enumerate() {
            // The host cast stream exists only where chunks are staged.
            if s == HOST_CAST && steps.is_empty() {
                continue;
            }
            let mut instrs = Vec::new();
            let mut copies_seen = 0;
            for step in steps {
                match step {
                    Step::Kernel(op) => {
                        instrs.push(kernels.remove(&op).expect("every op has one kernel"));
                        if s == COMPUTE {
                            if let Some(&e) = compute_event.get(&time[&op]) {
                                instrs.push(Instr::Record { event: e });
                            }
                        }
                        if let (HOST_OPTIMIZER, Some(&e)) = (s, host_event.get(&op)) {
                            instrs.push(Instr::Record { event: e });
                        }
                    }
                    Step::Cast(k) => {
                        let c = &staging.casts[k];
                        instrs.push(Instr::CastChunk {
                            chunk: c.chunk,
                            src: c.src,
                            dst: c.dst,
                            bytes: c.bytes,
                        });
                        if let Some(&e) = cast_event.get(&k) {
                            instrs.push(Instr::Record { event: e });
                        }
                    }
                    Step::AfterCast(k) => instrs.push(Instr::Wait {
                        event: cast_event[&k],
                    }),
                    Step::AfterHost(op) => instrs.push(Instr::Wait {
                        event: host_event[&op],
                    }),
                    Step::Copy(what, src, dst, bytes) => {
                        instrs.push(Instr::Copy {
                            what,
                            src,
                            dst,
                            bytes,
                        });
                        let i = copy_index_of[&(s, copies_seen)];
                        copies_seen += 1;
                        if let Some(&e) = copy_event.get(&i) {
                            instrs.push(Instr::Record { event: e });
                        }
                    }
                    Step::AfterCompute(t) => instrs.push(Instr::Wait {
                        event: compute_event[&t],
                    }),
                    Step::AfterCopy(i) => instrs.push(Instr::Wait {
                        event: copy_event[&i],
                    }),
                }
            }
            streams.push(Stream {
                name: names[s].into(),
                kind: kinds[s],
                instrs,
            });
        }
        (streams, next)
    }
}
