//! Streams: turns a placed graph into per-stream instruction lists with events, and decides
//! which buffer each tensor of each instruction lives in.
//!
//! The compute stream runs the placed graph's device ops in order; its kernel index is the
//! step's timeline, on which every device buffer's live range is measured. Chunk fetches and
//! activation reloads run on the host-to-device stream, gradient and activation offloads on
//! the device-to-host stream, the AdamW of offloaded parameters on the host optimizer stream.
//! Events appear only where a dependency crosses streams:
//!
//! - a fetch into a chunk slot waits until the compute stream has finished with the chunk the
//!   slot held; the first kernel that reads the chunk waits for the fetch. The host-to-device
//!   stream issues copies in the order they are needed, each as soon as its slot is free, so
//!   prefetching is as early as the `n_buffer` slots allow;
//! - an offload waits for the kernel that wrote what it copies; the compute stream waits for
//!   the offload to finish one block (activations) or one chunk (gradients) later, which is
//!   where the device copy's live range ends;
//! - a reload waits until the compute stream reaches the backward pass of the block before
//!   (where the reloaded copy's live range starts); the first kernel that reads it waits for
//!   it;
//! - the host optimizer waits for each chunk's gradients to arrive, and for the clip
//!   coefficient when clipping.
//!
//! It does not choose offsets: every buffer gets one in the `plan` pass.

use crate::error::{CompileError, Result};
use crate::place::Placed;
use protrain_ir::{
    BlockId, Buffer, BufferId, BufferKind, ChunkId, ChunkTable, CopyKind, EventId, Graph, Instr,
    OpId, OpKind, ParamId, Phase, Role, Space, Stream, StreamKind, TensorRef, ValueId,
};
use std::collections::{BTreeMap, HashMap};

/// Buffers start at multiples of this many bytes.
pub const BUFFER_ALIGN: u64 = 256;

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
    /// Wait for the clip coefficient's copy to the host.
    AfterScalar,
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

/// The step's device ops in compute order (a kernel's index is its time) and its host ops.
struct Timeline {
    device: Vec<OpId>,
    host: Vec<OpId>,
    /// The last compute kernel's index.
    end: u32,
}

impl Timeline {
    fn of(placed: &Placed) -> Self {
        let (host, device): (Vec<OpId>, Vec<OpId>) = placed
            .graph
            .ops()
            .map(|(id, _)| id)
            .partition(|&id| placed.on_host(id));
        let end = device.len().saturating_sub(1) as u32;
        Self { device, host, end }
    }
}

/// When the compute stream reads each value, and where blocks start: the times that place
/// offloads, waits and reloads.
struct Readers {
    /// Each forward block and the time of its first kernel, in order.
    forward_blocks: Vec<(BlockId, u32)>,
    /// Each backward (or recompute) block and the time of its first kernel, in order.
    backward_blocks: Vec<(BlockId, u32)>,
    /// The last kernel that reads each value.
    last: HashMap<ValueId, u32>,
    /// The last forward kernel that reads each value.
    last_forward: HashMap<ValueId, u32>,
    /// The first backward, recompute or optimizer kernel that reads each value.
    first_backward: HashMap<ValueId, u32>,
}

impl Readers {
    fn of(graph: &Graph, timeline: &Timeline) -> Self {
        let mut forward_blocks: Vec<(BlockId, u32)> = Vec::new();
        let mut backward_blocks: Vec<(BlockId, u32)> = Vec::new();
        for (t, &op) in timeline.device.iter().enumerate() {
            let o = graph.op(op);
            let list = match o.phase {
                Phase::Forward => &mut forward_blocks,
                Phase::Backward | Phase::Recompute => &mut backward_blocks,
                Phase::Optimizer => continue,
            };
            if list.last().map(|&(b, _)| b) != Some(o.block) {
                list.push((o.block, t as u32));
            }
        }
        let mut last: HashMap<ValueId, u32> = HashMap::new();
        let mut last_forward: HashMap<ValueId, u32> = HashMap::new();
        let mut first_backward: HashMap<ValueId, u32> = HashMap::new();
        for (t, &op) in timeline.device.iter().enumerate() {
            let o = graph.op(op);
            for &v in &o.inputs {
                last.insert(v, t as u32);
                if o.phase == Phase::Forward {
                    last_forward.insert(v, t as u32);
                } else {
                    first_backward.entry(v).or_insert(t as u32);
                }
            }
        }
        Self {
            forward_blocks,
            backward_blocks,
            last,
            last_forward,
            first_backward,
        }
    }

    /// The time of the backward pass's first kernel (`end` when there is none).
    fn first_backward(&self, end: u32) -> u32 {
        self.backward_blocks.first().map_or(end, |&(_, t)| t)
    }
}

/// A chunk fetch into a slot.
struct Fetch {
    chunk: ChunkId,
    slot: u32,
    /// The compute kernel that last read the slot's previous chunk.
    after: Option<u32>,
    /// The compute kernel that first reads the fetched chunk.
    needed: u32,
}

/// A copy and when it may run.
struct CopyPlan {
    stream: usize,
    kind: CopyKind,
    src: TensorRef,
    dst: TensorRef,
    bytes: u64,
    /// Compute kernel it must follow (None: nothing).
    after: Option<u32>,
    /// Compute kernel that waits for it (None: only the host optimizer does).
    needed: Option<u32>,
}

/// Each stream's steps: copies in the order the compute stream needs them (each after the
/// kernel it must follow), compute kernels with waits for the copies they need, host AdamW
/// after its chunk's gradients (and the clip coefficient). Returns the steps and the copies
/// in issue order.
fn order_steps(
    graph: &Graph,
    chunks: &ChunkTable,
    timeline: &Timeline,
    copies: &[CopyPlan],
    grad_offload: &HashMap<ChunkId, usize>,
    scalar_copy: Option<usize>,
) -> (Vec<Vec<Step>>, Vec<usize>) {
    let mut per_stream: Vec<Vec<Step>> = vec![Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    let mut order: Vec<usize> = (0..copies.len()).collect();
    order.sort_by_key(|&i| {
        (
            copies[i].needed.unwrap_or(u32::MAX),
            copies[i].after.unwrap_or(0),
            i,
        )
    });
    for &i in &order {
        let c = &copies[i];
        if let Some(after) = c.after {
            per_stream[c.stream].push(Step::AfterCompute(after));
        }
        per_stream[c.stream].push(Step::Copy(c.kind, c.src, c.dst, c.bytes));
    }
    let mut compute_waits: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, c) in copies.iter().enumerate() {
        if let Some(needed) = c.needed {
            compute_waits.entry(needed).or_default().push(i);
        }
    }
    for (t, &op) in timeline.device.iter().enumerate() {
        for &i in compute_waits
            .get(&(t as u32))
            .map(Vec::as_slice)
            .unwrap_or(&[])
        {
            // Copies the compute stream waits for after its last kernel go at the end.
            if copies[i].after.is_some_and(|a| a >= t as u32) {
                continue;
            }
            per_stream[COMPUTE].push(Step::AfterCopy(i));
        }
        per_stream[COMPUTE].push(Step::Kernel(op));
    }
    for (&t, list) in &compute_waits {
        for &i in list {
            if copies[i].after.is_some_and(|a| a >= t) {
                per_stream[COMPUTE].push(Step::AfterCopy(i));
            }
        }
    }
    let mut waited_chunk: Option<ChunkId> = None;
    let mut waited_scalar = false;
    for &op in &timeline.host {
        if let (Some(_), false) = (scalar_copy, waited_scalar) {
            per_stream[HOST_OPTIMIZER].push(Step::AfterScalar);
            waited_scalar = true;
        }
        let p = graph
            .param_of(graph.op(op).inputs[0])
            .expect("parameter update");
        let c = chunks.locate(p).0;
        if waited_chunk != Some(c) {
            per_stream[HOST_OPTIMIZER].push(Step::AfterCopy(grad_offload[&c]));
            waited_chunk = Some(c);
        }
        per_stream[HOST_OPTIMIZER].push(Step::Kernel(op));
    }
    (per_stream, order)
}

/// Builds the streams of a placed graph.
pub fn streams(placed: Placed) -> Result<Streamed> {
    Builder::new(placed).build()
}

struct Builder {
    placed: Placed,
    buffers: Vec<Pending>,
    homes: Vec<(ValueId, TensorRef)>,
    masters: Vec<(ValueId, TensorRef)>,
    /// Device op -> compute kernel index.
    time: HashMap<OpId, u32>,
    /// Where each value is written (its first instance).
    primary: HashMap<ValueId, TensorRef>,
    /// The host copy and the reloaded device copy of each swapped activation.
    swap: HashMap<ValueId, (TensorRef, TensorRef)>,
    /// Slot holding each offloaded chunk at each kernel that reads it.
    slot_at: HashMap<(u32, ChunkId), u32>,
    slots: Vec<BufferId>,
    host_chunk: HashMap<ChunkId, BufferId>,
    grad_chunk: HashMap<ChunkId, (BufferId, BufferId)>,
    persistent_chunk: HashMap<ChunkId, BufferId>,
    /// Optimizer-state homes of each parameter: (m, v).
    state_home: HashMap<ParamId, (TensorRef, TensorRef)>,
}

impl Builder {
    fn new(placed: Placed) -> Self {
        Self {
            placed,
            buffers: Vec::new(),
            homes: Vec::new(),
            masters: Vec::new(),
            time: HashMap::new(),
            primary: HashMap::new(),
            swap: HashMap::new(),
            slot_at: HashMap::new(),
            slots: Vec::new(),
            host_chunk: HashMap::new(),
            grad_chunk: HashMap::new(),
            persistent_chunk: HashMap::new(),
            state_home: HashMap::new(),
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
            },
            live,
        });
        BufferId::new(self.buffers.len() - 1)
    }

    fn at(buffer: BufferId, offset: u64) -> TensorRef {
        TensorRef { buffer, offset }
    }

    fn bytes(&self, v: ValueId) -> u64 {
        self.placed.graph.value(v).ty.bytes()
    }

    /// Runs the steps below in order: the timeline, homes and slots, chunk fetches, gradient
    /// offloads, activation buffers, swaps, the clip coefficient's copy, kernel operands, then
    /// the order of each stream and its events. Buffers are created in that order, which fixes
    /// their ids.
    fn build(mut self) -> Result<Streamed> {
        let graph = self.placed.graph.clone();
        let chunks = self.placed.chunks.clone();
        let timeline = Timeline::of(&self.placed);
        for (t, &op) in timeline.device.iter().enumerate() {
            self.time.insert(op, t as u32);
        }
        self.homes(&graph, &chunks);
        self.slots(&chunks);
        let mut copies: Vec<CopyPlan> = self
            .fetches(&graph, &chunks, &timeline)?
            .into_iter()
            .map(|f| CopyPlan {
                stream: H2D,
                kind: CopyKind::FetchChunk { chunk: f.chunk },
                src: Self::at(self.host_chunk[&f.chunk], 0),
                dst: Self::at(self.slots[f.slot as usize], 0),
                bytes: chunks.chunk(f.chunk).used_bytes,
                after: f.after,
                needed: Some(f.needed),
            })
            .collect();
        let readers = Readers::of(&graph, &timeline);
        let (grad_of, grad_offload) =
            self.grad_offloads(&graph, &chunks, timeline.end, &mut copies);
        self.activations(&graph, &timeline, &readers, &grad_of);
        self.swaps(&graph, &timeline, &readers, &mut copies);
        let (scalar_copy, host_coef) = self.clip_scalar(&graph, &timeline, &mut copies);
        let kernels = self.kernels(&graph, &chunks, &timeline, host_coef);
        let loss = graph
            .outputs()
            .first()
            .map(|v| self.primary[v])
            .ok_or(CompileError::NoLoss)?;
        let (per_stream, order) = order_steps(
            &graph,
            &chunks,
            &timeline,
            &copies,
            &grad_offload,
            scalar_copy,
        );
        let (streams, events) = self.lower(per_stream, &order, &copies, kernels, scalar_copy);
        Ok(Streamed {
            placed: self.placed,
            buffers: self.buffers,
            streams,
            events,
            homes: self.homes,
            masters: self.masters,
            loss,
            compute_kernels: timeline.device.len() as u32,
        })
    }

    /// Homes of the inputs, the chunks and their optimizer state (Adam moments mirroring each
    /// chunk, then f32 master weights of narrower parameters), and the device and host
    /// gradient chunks of every streamed chunk the optimizer updates.
    fn homes(&mut self, graph: &Graph, chunks: &ChunkTable) {
        for &v in graph.inputs() {
            let b = self.buffer(
                graph.value(v).name.clone(),
                Space::Device,
                self.bytes(v),
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
        for (c, chunk) in chunks.iter() {
            let persistent = self.placed.is_persistent(c);
            let (space, kind) = match persistent {
                true => (Space::Device, BufferKind::PersistentChunk { chunk: c }),
                false => (Space::Host, BufferKind::HostChunk { chunk: c }),
            };
            let home = self.buffer(format!("chunk{}", c.0), space, chunk.used_bytes, kind, None);
            if persistent {
                self.persistent_chunk.insert(c, home);
            } else {
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
            let with_state = chunk
                .members
                .iter()
                .any(|m| adam.contains_key(&graph.param(m.param).value));
            let state = with_state.then(|| {
                self.buffer(
                    format!("adam{}", c.0),
                    space,
                    state_bytes_per_element(graph) * total,
                    BufferKind::OptimizerState { chunk: c },
                    None,
                )
            });
            let mut elem = 0;
            for (member, n) in chunk.members.iter().zip(&elems) {
                let value = graph.param(member.param).value;
                self.homes.push((value, Self::at(home, member.offset)));
                if persistent {
                    self.primary.insert(value, Self::at(home, member.offset));
                }
                if let (Some(state), Some(&(m, v))) = (state, adam.get(&value)) {
                    let (mr, vr) = (
                        Self::at(state, 4 * elem),
                        Self::at(state, 4 * (total + elem)),
                    );
                    self.homes.push((m, mr));
                    self.homes.push((v, vr));
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
                let hg = self.buffer(
                    format!("host_grads{}", c.0),
                    Space::Host,
                    chunk.used_bytes,
                    BufferKind::HostGradChunk { chunk: c },
                    None,
                );
                self.grad_chunk.insert(c, (g, hg));
            }
        }
    }

    /// The chunk slots: `n_buffer` of them, but no more than streamed chunks (a second slot
    /// for one chunk would sit unused).
    fn slots(&mut self, chunks: &ChunkTable) {
        let streamed = chunks.len() as u32 - self.placed.policy.n_persist.min(chunks.len() as u32);
        if streamed > 0 {
            for s in 0..self.placed.policy.n_buffer.min(streamed) {
                let b = self.buffer(
                    format!("slot{s}"),
                    Space::Device,
                    chunks.chunk_bytes,
                    BufferKind::ChunkSlot { slot: s },
                    None,
                );
                self.slots.push(b);
            }
        }
    }

    /// Which offloaded chunks each device kernel reads, which slot holds each, and the fetches
    /// that bring them: a chunk stays in its slot while it is read; a missing one evicts the
    /// slot used least recently by a chunk this kernel does not read.
    fn fetches(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        timeline: &Timeline,
    ) -> Result<Vec<Fetch>> {
        let mut fetches: Vec<Fetch> = Vec::new();
        let mut resident: Vec<Option<(ChunkId, u32)>> = vec![None; self.slots.len()];
        for (t, &op) in timeline.device.iter().enumerate() {
            let t = t as u32;
            let o = graph.op(op);
            let mut needed: Vec<ChunkId> = o
                .inputs
                .iter()
                .filter_map(|&v| graph.param_of(v))
                .map(|p| chunks.locate(p).0)
                .filter(|&c| !self.placed.is_persistent(c))
                .collect();
            needed.sort();
            needed.dedup();
            if needed.len() > self.slots.len() {
                let named = o.outputs.first().copied().unwrap_or(o.inputs[0]);
                return Err(CompileError::TooFewBuffers {
                    op: format!("{} ({})", o.kind.mnemonic(), graph.value(named).name),
                    chunks: needed.len() as u32,
                    n_buffer: self.slots.len() as u32,
                });
            }
            for &c in &needed {
                if let Some(s) = resident
                    .iter()
                    .position(|r| matches!(r, Some((rc, _)) if *rc == c))
                {
                    resident[s] = Some((c, t));
                    self.slot_at.insert((t, c), s as u32);
                    continue;
                }
                let s = (0..resident.len())
                    .filter(|&s| !matches!(resident[s], Some((rc, _)) if needed.contains(&rc)))
                    .min_by_key(|&s| resident[s].map_or((0, 0), |(_, last)| (1, last)))
                    .expect("enough slots were checked above");
                fetches.push(Fetch {
                    chunk: c,
                    slot: s as u32,
                    after: resident[s].map(|(_, last)| last),
                    needed: t,
                });
                resident[s] = Some((c, t));
                self.slot_at.insert((t, c), s as u32);
            }
        }
        Ok(fetches)
    }

    /// Where each streamed parameter's final gradient is written (its gradient chunk), and
    /// one offload per gradient chunk once complete; the compute stream waits for chunk c's
    /// offload when the next chunk completes. Returns the gradients' places and each chunk's
    /// offload (its index in `copies`).
    fn grad_offloads(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        end: u32,
        copies: &mut Vec<CopyPlan>,
    ) -> (HashMap<ValueId, (ChunkId, u64)>, HashMap<ChunkId, usize>) {
        let mut grad_of: HashMap<ValueId, (ChunkId, u64)> = HashMap::new();
        let mut chunk_done: BTreeMap<ChunkId, (u32, u32)> = BTreeMap::new();
        for (_, op) in graph.ops() {
            if let OpKind::AdamW { .. } = op.kind {
                let p = graph
                    .param_of(op.inputs[0])
                    .expect("AdamW updates a parameter");
                let (c, offset) = chunks.locate(p);
                if self.placed.is_persistent(c) {
                    continue;
                }
                let g = op.inputs[1];
                grad_of.insert(g, (c, offset));
                let producer = graph.value(g).producer.expect("gradients are computed");
                let t = self.time[&producer];
                let entry = chunk_done.entry(c).or_insert((t, t));
                entry.0 = entry.0.min(t);
                entry.1 = entry.1.max(t);
            }
        }
        let mut by_completion: Vec<(ChunkId, u32, u32)> =
            chunk_done.iter().map(|(&c, &(a, b))| (c, a, b)).collect();
        by_completion.sort_by_key(|&(c, _, done)| (done, c));
        let mut grad_offload: HashMap<ChunkId, usize> = HashMap::new();
        for (i, &(c, first, done)) in by_completion.iter().enumerate() {
            let wait = by_completion
                .get(i + 1)
                .map_or(end, |&(_, _, next)| next.max(done + 1).min(end));
            let (g, hg) = self.grad_chunk[&c];
            self.buffers[g.index()].live = Some((first, wait.max(done)));
            grad_offload.insert(c, copies.len());
            copies.push(CopyPlan {
                stream: D2H,
                kind: CopyKind::OffloadGrads { chunk: c },
                src: Self::at(g, 0),
                dst: Self::at(hg, 0),
                bytes: chunks.chunk(c).used_bytes,
                after: Some(done),
                needed: Some(wait.max(done)),
            });
        }
        (grad_of, grad_offload)
    }

    /// A device buffer for every value a device kernel writes (gradients of streamed
    /// parameters go into their gradient chunk instead), live from its writer to its last
    /// reader; a swapped value's buffer ends at its last forward read, the loss's at the end.
    fn activations(
        &mut self,
        graph: &Graph,
        timeline: &Timeline,
        readers: &Readers,
        grad_of: &HashMap<ValueId, (ChunkId, u64)>,
    ) {
        for (t, &op) in timeline.device.iter().enumerate() {
            let t = t as u32;
            for &v in &graph.op(op).outputs {
                if let Some(&(c, offset)) = grad_of.get(&v) {
                    self.primary
                        .insert(v, Self::at(self.grad_chunk[&c].0, offset));
                    continue;
                }
                let value = graph.value(v);
                let mut last = readers.last.get(&v).copied().unwrap_or(t).max(t);
                if value.role == Role::Loss {
                    last = timeline.end;
                }
                if self.placed.swapped.contains(&v) {
                    last = readers.last_forward.get(&v).copied().unwrap_or(t).max(t);
                }
                let b = self.buffer(
                    value.name.clone(),
                    Space::Device,
                    value.ty.bytes(),
                    BufferKind::Activation,
                    Some((t, last)),
                );
                self.primary.insert(v, Self::at(b, 0));
            }
        }
    }

    /// Swapped activations: offload after the producer, the compute stream waiting two
    /// blocks later; reload one block ahead of the backward pass into a buffer of its own.
    fn swaps(
        &mut self,
        graph: &Graph,
        timeline: &Timeline,
        readers: &Readers,
        copies: &mut Vec<CopyPlan>,
    ) {
        let end = timeline.end;
        let first_backward = readers.first_backward(end);
        let swapped: Vec<ValueId> = self.placed.swapped.iter().copied().collect();
        for v in swapped {
            let value = graph.value(v).clone();
            let producer = value.producer.expect("swapped values are computed");
            let t = self.time[&producer];
            let block = graph.op(producer).block;
            let pos = readers
                .forward_blocks
                .iter()
                .position(|&(b, _)| b == block)
                .unwrap_or(0);
            let last_fwd = readers.last_forward.get(&v).copied().unwrap_or(t).max(t);
            let wait = readers
                .forward_blocks
                .get(pos + 2)
                .map_or(first_backward, |&(_, s)| s)
                .max(last_fwd + 1)
                .min(end);
            let primary = self.primary[&v];
            self.buffers[primary.buffer.index()].live = Some((t, wait));
            let host = self.buffer(
                format!("{}.host", value.name),
                Space::Host,
                value.ty.bytes(),
                BufferKind::HostActivation,
                None,
            );
            let first_use = readers.first_backward.get(&v).copied().unwrap_or(end);
            let bpos = readers
                .backward_blocks
                .iter()
                .position(|&(b, _)| b == block)
                .unwrap_or(0);
            let issue = match bpos {
                0 => first_backward,
                i => readers.backward_blocks[i - 1].1,
            }
            .min(first_use)
            .max(wait + 1);
            let last = readers
                .last
                .get(&v)
                .copied()
                .unwrap_or(first_use)
                .max(first_use);
            let reloaded = self.buffer(
                format!("{}.reload", value.name),
                Space::Device,
                value.ty.bytes(),
                BufferKind::Activation,
                Some((issue, last)),
            );
            self.swap
                .insert(v, (Self::at(host, 0), Self::at(reloaded, 0)));
            copies.push(CopyPlan {
                stream: D2H,
                kind: CopyKind::OffloadActivation { value: v },
                src: primary,
                dst: Self::at(host, 0),
                bytes: value.ty.bytes(),
                after: Some(t),
                needed: Some(wait),
            });
            copies.push(CopyPlan {
                stream: H2D,
                kind: CopyKind::ReloadActivation { value: v },
                src: Self::at(host, 0),
                dst: Self::at(reloaded, 0),
                bytes: value.ty.bytes(),
                after: issue.checked_sub(1),
                needed: Some(first_use),
            });
        }
    }

    /// The clip coefficient's copy to the host, when the host optimizer needs it: the copy's
    /// index in `copies` and the coefficient's host home.
    fn clip_scalar(
        &mut self,
        graph: &Graph,
        timeline: &Timeline,
        copies: &mut Vec<CopyPlan>,
    ) -> (Option<usize>, Option<TensorRef>) {
        let clip_coef = graph
            .ops()
            .find(|(_, op)| matches!(op.kind, OpKind::ClipCoef { .. }))
            .map(|(_, op)| op.outputs[0]);
        let (Some(coef), false) = (clip_coef, timeline.host.is_empty()) else {
            return (None, None);
        };
        let producer = graph.value(coef).producer.expect("computed");
        let host = self.buffer(
            "clip_coef.host".into(),
            Space::Host,
            4,
            BufferKind::HostActivation,
            None,
        );
        let src = self.primary[&coef];
        let t = self.time[&producer];
        // The device copy must outlive the copy: the compute stream waits for it at the end.
        let b = &mut self.buffers[src.buffer.index()];
        b.live = b.live.map(|(a, _)| (a, timeline.end));
        let index = copies.len();
        copies.push(CopyPlan {
            stream: D2H,
            kind: CopyKind::Scalar { value: coef },
            src,
            dst: Self::at(host, 0),
            bytes: 4,
            after: Some(t),
            needed: Some(timeline.end),
        });
        (Some(index), Some(Self::at(host, 0)))
    }

    /// Every op's kernel instruction with its operands: device kernels read from where
    /// [`Builder::read_ref`] says and get a workspace when their kind needs one (created in
    /// time order, so workspace buffers are numbered the same way every run); host AdamW
    /// reads the host chunk, the host gradients, the moments and the clip coefficient.
    fn kernels(
        &mut self,
        graph: &Graph,
        chunks: &ChunkTable,
        timeline: &Timeline,
        host_coef: Option<TensorRef>,
    ) -> HashMap<OpId, Instr> {
        let mut kernels: HashMap<OpId, Instr> = HashMap::new();
        for (t, &op) in timeline.device.iter().enumerate() {
            let t = t as u32;
            let o = graph.op(op);
            let inputs: Vec<TensorRef> = o
                .inputs
                .iter()
                .map(|&v| self.read_ref(v, t, o.phase))
                .collect();
            let outputs: Vec<TensorRef> = o.outputs.iter().map(|v| self.primary[v]).collect();
            let types: Vec<&protrain_ir::TensorType> =
                o.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            let ws = o.kind.workspace_bytes(&types);
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
        for &op in &timeline.host {
            let o = graph.op(op);
            let p = graph
                .param_of(o.inputs[0])
                .expect("host ops are parameter updates");
            let (c, offset) = chunks.locate(p);
            let (m, v) = self.state_home[&p];
            let mut inputs = vec![
                Self::at(self.host_chunk[&c], offset),
                Self::at(self.grad_chunk[&c].1, offset),
                m,
                v,
            ];
            if o.inputs.len() > 4 {
                inputs.push(host_coef.expect("a clipped update has the coefficient on the host"));
            }
            kernels.insert(
                op,
                Instr::Kernel {
                    op,
                    inputs,
                    outputs: vec![],
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
        mut kernels: HashMap<OpId, Instr>,
        scalar_copy: Option<usize>,
    ) -> (Vec<Stream>, u32) {
        let mut compute_event: BTreeMap<u32, EventId> = BTreeMap::new();
        let mut copy_event: HashMap<usize, EventId> = HashMap::new();
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
                    Step::AfterScalar => {
                        let i = scalar_copy.expect("a scalar copy exists");
                        copy_event.entry(i).or_insert_with(|| event(&mut next));
                    }
                    _ => {}
                }
            }
        }
        // Copies in stream order, to map copy index -> position.
        let mut copy_index_of: HashMap<(usize, usize), usize> = HashMap::new();
        let mut per_stream_count = [0usize; 4];
        for &i in order {
            let stream = copies[i].stream;
            copy_index_of.insert((stream, per_stream_count[stream]), i);
            per_stream_count[stream] += 1;
        }
        let names = ["compute", "h2d", "d2h", "host_optimizer"];
        let kinds = [
            StreamKind::Compute,
            StreamKind::HostToDevice,
            StreamKind::DeviceToHost,
            StreamKind::HostOptimizer,
        ];
        let mut streams = Vec::new();
        for (s, steps) in per_stream.into_iter().enumerate() {
            let mut instrs = Vec::new();
            let mut copies_seen = 0;
            for step in steps {
                match step {
                    Step::Kernel(op) => {
                        instrs.push(kernels.remove(&op).expect("every op has one kernel"));
                        if s == COMPUTE {
                            if let Some(&e) = compute_event.get(&self.time[&op]) {
                                instrs.push(Instr::Record { event: e });
                            }
                        }
                    }
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
                    Step::AfterScalar => instrs.push(Instr::Wait {
                        event: copy_event[&scalar_copy.expect("a scalar copy exists")],
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

    /// Where a device kernel at time `t` in `phase` reads `v`.
    fn read_ref(&self, v: ValueId, t: u32, phase: Phase) -> TensorRef {
        let graph = &self.placed.graph;
        if let Some(p) = graph.param_of(v) {
            let (c, offset) = self.placed.chunks.locate(p);
            if let Some(&b) = self.persistent_chunk.get(&c) {
                return Self::at(b, offset);
            }
            let slot = self.slot_at[&(t, c)];
            return Self::at(self.slots[slot as usize], offset);
        }
        if let (Some(&(_, reloaded)), true) = (self.swap.get(&v), phase != Phase::Forward) {
            return reloaded;
        }
        self.primary[&v]
    }
}
