//! Movement: inserts into a placed graph the copies its policy implies, as movement ops
//! ([`protrain_ir::Movement`]): chunk gathers into slots and their releases, gradient
//! offloads to the host optimizer, activation offloads and reloads of swapped blocks, and the
//! clip coefficient's copy to the host.
//!
//! Every decision about what moves, where and when is made here, on the compute order
//! [`crate::place`] fixed; the streams pass only orders the result. On the compute timeline
//! (a device kernel's index is its time):
//!
//! - **gathers**: each kernel that reads a streamed chunk reads it from a slot; a chunk stays
//!   in its slot while it is read, and a missing one evicts the slot used least recently by a
//!   chunk this kernel does not read. The gather's start (`prefetch`) sits right after the
//!   release of the slot's previous chunk (after that chunk's last reader), so a copy begins
//!   as early as the `n_buffer` slots allow; its done sits before the first kernel that reads
//!   the chunk;
//! - **gradient offloads**: once a streamed chunk's last gradient is written, its gradients go
//!   to the host; the compute stream waits for the copy when the next chunk completes, which
//!   is where the device gradient chunk may be reused;
//! - **swaps**: an activation of a swapped block goes to the host right after it is written,
//!   and the compute stream waits for that copy two blocks later; it comes back one block
//!   ahead of the backward pass of its block, in time for its first backward reader;
//! - **the clip coefficient** goes to the host when the host optimizer needs it.
//!
//! Where an op of the compute order reads something that moved, it reads the copy: a kernel
//! reads a streamed parameter from its slot's copy, a backward kernel a swapped activation's
//! reloaded copy, the host optimizer the host copies of gradients and of the coefficient.

use crate::error::{CompileError, Result};
use fnv::FnvHashMap as HashMap;
use protrain_ir::{
    BlockId, ChunkId, ChunkTable, Graph, Movement, OpId, OpKind, Phase, Policy, Role, TensorType,
    ValueId,
};
use std::collections::BTreeSet;

/// Whether an op of a compute-order graph runs on the host optimizer under `policy`: the
/// AdamW of a parameter in a chunk that is not persistent.
pub fn runs_on_host(graph: &Graph, chunks: &ChunkTable, policy: &Policy, op: OpId) -> bool {
    let op = graph.op(op);
    match op.kind {
        OpKind::AdamW { .. } => graph
            .param_of(op.inputs[0])
            .is_some_and(|p| chunks.locate(p).0 .0 >= policy.n_persist),
        _ => false,
    }
}

/// The compute order's device kernels (a kernel's index is its time) and host ops.
struct Timeline {
    device: Vec<OpId>,
    host: Vec<OpId>,
    /// The last kernel's time.
    end: u32,
    /// Each compute op's time, by op index ([`u32::MAX`] for a host op).
    time: Vec<u32>,
}

impl Timeline {
    fn new(device: Vec<OpId>, host: Vec<OpId>, ops: usize) -> Self {
        let end = device.len().saturating_sub(1) as u32;
        let mut time = vec![u32::MAX; ops];
        for (t, &op) in device.iter().enumerate() {
            time[op.index()] = t as u32;
        }
        Self {
            device,
            host,
            end,
            time,
        }
    }

    /// The time of a device kernel; `None` for a host op.
    fn time(&self, op: OpId) -> Option<u32> {
        Some(self.time[op.index()]).filter(|&t| t != u32::MAX)
    }
}

/// When kernels read each value, and where blocks start.
struct Readers {
    /// Each forward block and the time of its first kernel, in order.
    forward_blocks: Vec<(BlockId, u32)>,
    /// Each backward (or recompute) block and the time of its first kernel, in order.
    backward_blocks: Vec<(BlockId, u32)>,
    /// The last forward kernel that reads each value, by value index ([`u32::MAX`]: none).
    last_forward: Vec<u32>,
    /// The first backward, recompute or optimizer kernel that reads each value, by value
    /// index ([`u32::MAX`]: none).
    first_backward: Vec<u32>,
}

impl Readers {
    fn of(graph: &Graph, timeline: &Timeline) -> Self {
        let mut forward_blocks: Vec<(BlockId, u32)> = Vec::new();
        let mut backward_blocks: Vec<(BlockId, u32)> = Vec::new();
        let mut last_forward = vec![u32::MAX; graph.values().len()];
        let mut first_backward = vec![u32::MAX; graph.values().len()];
        for (t, &op) in timeline.device.iter().enumerate() {
            let (t, o) = (t as u32, graph.op(op));
            let list = match o.phase {
                Phase::Forward => Some(&mut forward_blocks),
                Phase::Backward | Phase::Recompute => Some(&mut backward_blocks),
                Phase::Optimizer => None,
            };
            if let Some(list) = list {
                if list.last().map(|&(b, _)| b) != Some(o.block) {
                    list.push((o.block, t));
                }
            }
            for &v in &o.inputs {
                if o.phase == Phase::Forward {
                    last_forward[v.index()] = t;
                } else if first_backward[v.index()] == u32::MAX {
                    first_backward[v.index()] = t;
                }
            }
        }
        Self {
            forward_blocks,
            backward_blocks,
            last_forward,
            first_backward,
        }
    }

    /// The time of the backward pass's first kernel (`end` when there is none).
    fn first_backward(&self, end: u32) -> u32 {
        self.backward_blocks.first().map_or(end, |&(_, t)| t)
    }

    /// The last forward kernel that reads `v`.
    fn last_forward_read(&self, v: ValueId) -> Option<u32> {
        Some(self.last_forward[v.index()]).filter(|&t| t != u32::MAX)
    }

    /// The first backward, recompute or optimizer kernel that reads `v`.
    fn first_backward_read(&self, v: ValueId) -> Option<u32> {
        Some(self.first_backward[v.index()]).filter(|&t| t != u32::MAX)
    }
}

/// One copy the policy implies, on the compute timeline.
#[derive(Clone, Debug)]
struct Copy {
    movement: Movement,
    /// What it copies: a chunk's parameters or gradients, or one value.
    sources: Vec<ValueId>,
    /// The copy whose done it reads instead of its sources (a reload reads the offload's
    /// host copy).
    from: Option<usize>,
    /// The kernel after which it starts (`None`: before the first).
    after: Option<u32>,
    /// The kernel before which it is done; when it is not after `after`, it is done after
    /// the last kernel.
    needed: u32,
}

/// A chunk's tenancy of a slot: its gather (an index into the copies) and the kernels that
/// read it there.
struct Tenancy {
    gather: usize,
    chunk: ChunkId,
    slot: u32,
    last: u32,
}

/// Where each op and value of a placed graph comes from in the compute graph it was built
/// from: what [`crate::emit`] needs to lower the movement ops away without rebuilding.
#[derive(Clone, Debug)]
pub struct Lowering {
    /// Per op of the placed graph: the compute op it is, `None` for a movement op.
    pub ops: Vec<Option<OpId>>,
    /// Per value of the placed graph: the compute value it is, or that it is a copy of.
    pub values: Vec<ValueId>,
}

/// Inserts the movement of `policy` into `compute`, a graph in compute order (the forward
/// pass, the backward pass with recomputation, then the optimizer tails), whose `swapped`
/// values are offloaded after the forward pass. Returns the placed graph and where its ops
/// and values come from in `compute`.
///
/// Fails when an op reads more streamed chunks than there are slots.
pub fn insert_movement(
    compute: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    swapped: &BTreeSet<ValueId>,
) -> Result<(Graph, Lowering)> {
    let (host, device): (Vec<OpId>, Vec<OpId>) = compute
        .ops()
        .map(|(id, _)| id)
        .partition(|&id| runs_on_host(compute, chunks, policy, id));
    let timeline = Timeline::new(device, host, compute.op_count());
    let streamed = |c: ChunkId| c.0 >= policy.n_persist;
    let slots = {
        let n = chunks.len() as u32 - policy.n_persist.min(chunks.len() as u32);
        policy.n_buffer.min(n)
    };

    let mut copies: Vec<Copy> = Vec::new();
    let (tenancies, slot_at) = gathers(compute, chunks, &timeline, slots, &streamed, &mut copies)?;
    let grad_copy = grad_offloads(compute, chunks, &timeline, &streamed, &mut copies);
    let swap_copy = swaps(compute, &timeline, swapped, &mut copies);
    let scalar_copy = clip_scalar(compute, &timeline, &mut copies);
    rebuild(
        compute,
        chunks,
        &timeline,
        &copies,
        &tenancies,
        &slot_at,
        &grad_copy,
        &swap_copy,
        scalar_copy,
    )
}

/// The tenancy (an index into the tenancies) that holds each streamed chunk at each kernel
/// that reads it, by the kernel's time and the chunk.
type SlotAt = HashMap<(u32, ChunkId), usize>;

/// The gathers: which slot holds each streamed chunk at each kernel that reads it, and the
/// copy that brings it; a chunk stays in its slot while it is read, and a missing one evicts
/// the slot used least recently by a chunk this kernel does not read.
fn gathers(
    graph: &Graph,
    chunks: &ChunkTable,
    timeline: &Timeline,
    slots: u32,
    streamed: &dyn Fn(ChunkId) -> bool,
    copies: &mut Vec<Copy>,
) -> Result<(Vec<Tenancy>, SlotAt)> {
    let mut tenancies: Vec<Tenancy> = Vec::new();
    let mut slot_at: HashMap<(u32, ChunkId), usize> = HashMap::default();
    // Each slot's tenancy (an index into `tenancies`).
    let mut resident: Vec<Option<usize>> = vec![None; slots as usize];
    for (t, &op) in timeline.device.iter().enumerate() {
        let t = t as u32;
        let o = graph.op(op);
        let mut needed: Vec<ChunkId> = o
            .inputs
            .iter()
            .filter_map(|&v| graph.param_of(v))
            .map(|p| chunks.locate(p).0)
            .filter(|&c| streamed(c))
            .collect();
        needed.sort();
        needed.dedup();
        if needed.len() > resident.len() {
            let named = o.outputs.first().copied().unwrap_or(o.inputs[0]);
            return Err(CompileError::TooFewBuffers {
                op: format!("{} ({})", o.kind.mnemonic(), graph.value(named).name),
                chunks: needed.len() as u32,
                n_buffer: resident.len() as u32,
            });
        }
        for &c in &needed {
            let holds = |r: &Option<usize>| r.is_some_and(|i| tenancies[i].chunk == c);
            if let Some(s) = resident.iter().position(holds) {
                let i = resident[s].expect("held");
                tenancies[i].last = t;
                slot_at.insert((t, c), i);
                continue;
            }
            let s = (0..resident.len())
                .filter(|&s| !resident[s].is_some_and(|i| needed.contains(&tenancies[i].chunk)))
                .min_by_key(|&s| resident[s].map_or((0, 0), |i| (1, tenancies[i].last)))
                .expect("enough slots were checked above");
            let members = chunks
                .chunk(c)
                .members
                .iter()
                .map(|m| graph.param(m.param).value)
                .collect();
            copies.push(Copy {
                movement: Movement::Gather {
                    chunk: c,
                    slot: s as u32,
                },
                sources: members,
                from: None,
                after: resident[s].map(|i| tenancies[i].last),
                needed: t,
            });
            tenancies.push(Tenancy {
                gather: copies.len() - 1,
                chunk: c,
                slot: s as u32,
                last: t,
            });
            resident[s] = Some(tenancies.len() - 1);
            slot_at.insert((t, c), tenancies.len() - 1);
        }
    }
    Ok((tenancies, slot_at))
}

/// One gradient offload per streamed chunk the host optimizer updates, once its last
/// gradient is written; the compute stream waits for it when the next chunk completes (at
/// the end for the last). Returns each gradient's copy (an index into the copies).
fn grad_offloads(
    graph: &Graph,
    chunks: &ChunkTable,
    timeline: &Timeline,
    streamed: &dyn Fn(ChunkId) -> bool,
    copies: &mut Vec<Copy>,
) -> HashMap<ValueId, usize> {
    // Per chunk: its gradients by member offset, and the first and last time one is written.
    let mut chunk_grads: HashMap<ChunkId, Vec<(u64, ValueId)>> = HashMap::default();
    let mut chunk_done: HashMap<ChunkId, (u32, u32)> = HashMap::default();
    for (_, op) in graph.ops() {
        let OpKind::AdamW { .. } = op.kind else {
            continue;
        };
        let p = graph
            .param_of(op.inputs[0])
            .expect("AdamW updates a parameter");
        let (c, offset) = chunks.locate(p);
        if !streamed(c) {
            continue;
        }
        let g = op.inputs[1];
        chunk_grads.entry(c).or_default().push((offset, g));
        let producer = graph.value(g).producer.expect("gradients are computed");
        let t = timeline
            .time(producer)
            .expect("gradients are computed on the device");
        let entry = chunk_done.entry(c).or_insert((t, t));
        entry.0 = entry.0.min(t);
        entry.1 = entry.1.max(t);
    }
    let mut by_completion: Vec<(ChunkId, u32)> = chunk_done
        .iter()
        .map(|(&c, &(_, done))| (c, done))
        .collect();
    by_completion.sort_by_key(|&(c, done)| (done, c));
    let end = timeline.end;
    let mut grad_copy = HashMap::default();
    for (i, &(c, done)) in by_completion.iter().enumerate() {
        let wait = by_completion
            .get(i + 1)
            .map_or(end, |&(_, next)| next.max(done + 1).min(end));
        let mut grads = chunk_grads.remove(&c).unwrap_or_default();
        grads.sort();
        for &(_, g) in &grads {
            grad_copy.insert(g, copies.len());
        }
        copies.push(Copy {
            movement: Movement::OffloadGrads { chunk: c },
            sources: grads.into_iter().map(|(_, g)| g).collect(),
            from: None,
            after: Some(done),
            needed: wait.max(done),
        });
    }
    grad_copy
}

/// Swapped activations: offloaded right after the kernel that writes them, the compute
/// stream waiting two blocks later; reloaded one block ahead of the backward pass of their
/// block. Returns each swapped value's offload and reload (indices into the copies).
fn swaps(
    graph: &Graph,
    timeline: &Timeline,
    swapped: &BTreeSet<ValueId>,
    copies: &mut Vec<Copy>,
) -> HashMap<ValueId, (usize, usize)> {
    let mut out = HashMap::default();
    if swapped.is_empty() {
        return out;
    }
    let readers = Readers::of(graph, timeline);
    let end = timeline.end;
    let first_backward = readers.first_backward(end);
    for &v in swapped {
        let producer = graph
            .value(v)
            .producer
            .expect("swapped values are computed");
        let t = timeline
            .time(producer)
            .expect("swapped values are computed on the device");
        let block = graph.op(producer).block;
        let pos = readers
            .forward_blocks
            .iter()
            .position(|&(b, _)| b == block)
            .unwrap_or(0);
        let last_fwd = readers.last_forward_read(v).unwrap_or(t).max(t);
        let wait = readers
            .forward_blocks
            .get(pos + 2)
            .map_or(first_backward, |&(_, s)| s)
            .max(last_fwd + 1)
            .min(end);
        let first_use = readers.first_backward_read(v).unwrap_or(end);
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
        copies.push(Copy {
            movement: Movement::Offload,
            sources: vec![v],
            from: None,
            after: Some(t),
            needed: wait,
        });
        copies.push(Copy {
            movement: Movement::Reload,
            sources: vec![v],
            from: Some(copies.len() - 1),
            after: issue.checked_sub(1),
            needed: first_use,
        });
        out.insert(v, (copies.len() - 2, copies.len() - 1));
    }
    out
}

/// The clip coefficient's copy to the host, when the host optimizer reads it: after the
/// kernel that computes it, done by the end of the step.
fn clip_scalar(graph: &Graph, timeline: &Timeline, copies: &mut Vec<Copy>) -> Option<usize> {
    let coef = graph
        .ops()
        .find(|(_, op)| op.kind.is_grad_coef())
        .map(|(_, op)| op.outputs[0])?;
    if timeline.host.is_empty() {
        return None;
    }
    let producer = graph.value(coef).producer.expect("computed");
    let t = timeline.time(producer)?;
    copies.push(Copy {
        movement: Movement::ToHost,
        sources: vec![coef],
        from: None,
        after: Some(t),
        needed: timeline.end,
    });
    Some(copies.len() - 1)
}

/// Where an op goes in program order: `(place, rank)` sorted, where place 0 is before
/// every kernel, `2t + 1` is kernel `t` and what sits just before it, `2t + 2` what sits just
/// after it; the rank orders the ops of one place.
type Position = (u64, u64);

/// One op of the placed graph in program order: a compute kernel, a copy's start or done,
/// or a chunk slot's release (by tenancy).
#[derive(Clone, Copy)]
enum Item {
    Kernel(OpId),
    Start(usize),
    Done(usize),
    Release(usize),
}

/// The placed graph's ops in program order: each copy's start right after the kernel it
/// follows (releases first, then starts), its done right before the kernel that needs it (or
/// after the last kernel when the copy starts there); each release right after its chunk's
/// last reader in the slot; the host kernels after every device one.
fn program_order(
    timeline: &Timeline,
    copies: &[Copy],
    tenancies: &[Tenancy],
) -> Vec<(Position, Item)> {
    let n = copies.len() as u64;
    let before = |t: u32| 2 * u64::from(t) + 1;
    let after = |t: Option<u32>| t.map_or(0, |t| 2 * u64::from(t) + 2);
    let mut items: Vec<(Position, Item)> = Vec::new();
    for (t, &op) in timeline.device.iter().enumerate() {
        items.push(((before(t as u32), n), Item::Kernel(op)));
    }
    let host_at = 2 * u64::from(timeline.end) + 3;
    for (i, &op) in timeline.host.iter().enumerate() {
        items.push(((host_at, 4 * n + i as u64), Item::Kernel(op)));
    }
    for (i, tenancy) in tenancies.iter().enumerate() {
        items.push(((after(Some(tenancy.last)), i as u64), Item::Release(i)));
    }
    for (i, c) in copies.iter().enumerate() {
        // Releases first, then starts, after a kernel; dones before a kernel (rank below the
        // kernel's `n`), or after the last kernel when the copy starts there.
        items.push(((after(c.after), n + 1 + i as u64), Item::Start(i)));
        let done = match c.after {
            Some(a) if a >= c.needed => (after(Some(timeline.end)), 2 * n + 1 + i as u64),
            _ => (before(c.needed), i as u64),
        };
        items.push((done, Item::Done(i)));
    }
    items.sort_by_key(|&(p, _)| p);
    items
}

/// Rebuilds the graph in program order with the movement ops in place: each copy's start
/// right after the kernel it follows (a gather's after its slot's release), its done right
/// before the kernel that needs it (or after the last kernel when it cannot be earlier);
/// each release right after its chunk's last reader in the slot. Ops in one place keep the
/// order the copies were decided in.
#[allow(clippy::too_many_arguments)]
fn rebuild(
    compute: &Graph,
    chunks: &ChunkTable,
    timeline: &Timeline,
    copies: &[Copy],
    tenancies: &[Tenancy],
    slot_at: &SlotAt,
    grad_copy: &HashMap<ValueId, usize>,
    swap_copy: &HashMap<ValueId, (usize, usize)>,
    scalar_copy: Option<usize>,
) -> Result<(Graph, Lowering)> {
    let items = program_order(timeline, copies, tenancies);

    let (mut graph, skeleton) = compute.skeleton();
    // One op per item; the compute graph's values and each copy's outputs at its start and
    // its done.
    let moved: usize = copies.iter().map(|c| c.sources.len()).sum();
    graph.reserve(items.len(), compute.values().len() + 2 * moved);
    // Each compute value's placed value, by compute value index.
    let mut map: Vec<Option<ValueId>> = vec![None; compute.values().len()];
    for (old, new) in skeleton {
        map[old.index()] = Some(new);
    }
    for (id, value) in compute.values() {
        if value.role == Role::OptimizerState && value.producer.is_none() {
            map[id.index()] = Some(graph.add_state(value.name.clone(), value.ty.clone()));
        }
    }
    let placed = |map: &[Option<ValueId>], v: ValueId| {
        map[v.index()].expect("a compute value is placed before it is read")
    };
    // Per copy: its start's outputs, then its done's.
    let mut started: Vec<Vec<ValueId>> = vec![Vec::new(); copies.len()];
    let mut done: Vec<Vec<ValueId>> = vec![Vec::new(); copies.len()];
    // The phase and block of the kernel nearest a place, for the movement ops there.
    let near = |p: u64| {
        let t = (p.saturating_sub(1) / 2).min(u64::from(timeline.end)) as usize;
        let o = compute.op(timeline.device[t]);
        (o.phase, o.block)
    };
    let mut op_origin: Vec<Option<OpId>> = Vec::with_capacity(items.len());
    for &((place, _), item) in &items {
        op_origin.push(match item {
            Item::Kernel(old) => Some(old),
            _ => None,
        });
        match item {
            Item::Kernel(old) => {
                let op = compute.op(old);
                let t = timeline.time(old);
                let inputs: Vec<ValueId> = op
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        read(
                            compute,
                            chunks,
                            op,
                            i,
                            v,
                            t,
                            slot_at,
                            tenancies,
                            &done,
                            grad_copy,
                            swap_copy,
                            scalar_copy,
                            copies,
                        )
                        .unwrap_or_else(|| placed(&map, v))
                    })
                    .collect();
                let outputs = op
                    .outputs
                    .iter()
                    .map(|&v| {
                        let value = compute.value(v);
                        (value.name.clone(), value.role, value.ty.clone())
                    })
                    .collect();
                let new =
                    graph.add_op_typed(op.kind.clone(), &inputs, outputs, op.block, op.phase)?;
                for (&old_v, new_v) in op.outputs.iter().zip(new) {
                    map[old_v.index()] = Some(new_v);
                }
            }
            Item::Start(i) => {
                let c = &copies[i];
                let inputs: Vec<ValueId> = match c.from {
                    Some(from) => done[from].clone(),
                    None => c.sources.iter().map(|&v| placed(&map, v)).collect(),
                };
                let outputs = copied(
                    compute,
                    &c.sources,
                    &format!("{}.start", suffix(c.movement)),
                );
                let (phase, block) = near(place);
                started[i] = graph.add_op_typed(
                    OpKind::MoveStart(c.movement),
                    &inputs,
                    outputs,
                    block,
                    phase,
                )?;
            }
            Item::Done(i) => {
                let c = &copies[i];
                let outputs = copied(compute, &c.sources, &suffix(c.movement));
                let (phase, block) = near(place);
                done[i] = graph.add_op_typed(
                    OpKind::MoveDone(c.movement),
                    &started[i],
                    outputs,
                    block,
                    phase,
                )?;
            }
            Item::Release(i) => {
                let tenancy = &tenancies[i];
                let (phase, block) = near(place);
                graph.add_op_multi(
                    OpKind::Release {
                        chunk: tenancy.chunk,
                        slot: tenancy.slot,
                    },
                    &done[tenancy.gather],
                    &[],
                    block,
                    phase,
                )?;
            }
        }
    }
    for &v in compute.outputs() {
        graph.add_output(placed(&map, v));
    }
    let lowering = lowering_of(&graph, &map, copies, &started, &done, op_origin);
    Ok((graph, lowering))
}

/// Where each op and value of the placed `graph` comes from: `ops`, each op's compute op
/// (none for a movement op); each value's compute value, or for a copy's outputs its
/// source. `map` is each compute value's placed value, `started` and `done` each copy's
/// outputs at its start and its done.
fn lowering_of(
    graph: &Graph,
    map: &[Option<ValueId>],
    copies: &[Copy],
    started: &[Vec<ValueId>],
    done: &[Vec<ValueId>],
    ops: Vec<Option<OpId>>,
) -> Lowering {
    let mut origin: Vec<Option<ValueId>> = vec![None; graph.values().len()];
    for (old, new) in map.iter().enumerate() {
        if let Some(new) = new {
            origin[new.index()] = Some(ValueId::new(old));
        }
    }
    for (i, c) in copies.iter().enumerate() {
        for (k, &source) in c.sources.iter().enumerate() {
            origin[started[i][k].index()] = Some(source);
            origin[done[i][k].index()] = Some(source);
        }
    }
    let values = origin
        .into_iter()
        .map(|v| v.expect("every placed value is a compute value or a copy of one"))
        .collect();
    Lowering { ops, values }
}

/// What a copy's name adds to its source's: where the copy is.
fn suffix(movement: Movement) -> String {
    match movement {
        Movement::Gather { slot, .. } => format!("slot{slot}"),
        Movement::Reload => "reload".into(),
        Movement::OffloadGrads { .. } | Movement::Offload | Movement::ToHost => "host".into(),
    }
}

/// The copies of `sources` (a movement op's outputs): each source's name with `.suffix`, its
/// role and its type.
fn copied(graph: &Graph, sources: &[ValueId], suffix: &str) -> Vec<(String, Role, TensorType)> {
    sources
        .iter()
        .map(|&v| {
            let value = graph.value(v);
            (
                [value.name.as_str(), ".", suffix].concat(),
                value.role,
                value.ty.clone(),
            )
        })
        .collect()
}

/// Which copy input `i` (value `v`) of `op` reads, if it reads one: a device kernel at time
/// `t` reads a streamed parameter from its slot's gather and a swapped activation outside
/// the forward pass from its reload; the host optimizer reads its gradient and the clip
/// coefficient from their host copies.
#[allow(clippy::too_many_arguments)]
fn read(
    graph: &Graph,
    chunks: &ChunkTable,
    op: &protrain_ir::Op,
    i: usize,
    v: ValueId,
    t: Option<u32>,
    slot_at: &SlotAt,
    tenancies: &[Tenancy],
    done: &[Vec<ValueId>],
    grad_copy: &HashMap<ValueId, usize>,
    swap_copy: &HashMap<ValueId, (usize, usize)>,
    scalar_copy: Option<usize>,
    copies: &[Copy],
) -> Option<ValueId> {
    let member = |copy: usize, v: ValueId| {
        let k = copies[copy].sources.iter().position(|&s| s == v)?;
        done[copy].get(k).copied()
    };
    match t {
        Some(t) => {
            if let Some(p) = graph.param_of(v) {
                let tenancy = slot_at.get(&(t, chunks.locate(p).0))?;
                return member(tenancies[*tenancy].gather, v);
            }
            match swap_copy.get(&v) {
                Some(&(_, reload)) if op.phase != Phase::Forward => member(reload, v),
                _ => None,
            }
        }
        // A host op (the AdamW of a streamed parameter): its gradient (input 1) and clip
        // coefficient (input 4) come from their host copies.
        None => match i {
            1 => member(*grad_copy.get(&v)?, v),
            4 => member(scalar_copy?, v),
            _ => None,
        },
    }
}
