//! Placement: applies a [`Policy`] to a training graph: which chunks are persistent, which
//! activations are swapped to the host, which blocks are recomputed, and where each
//! optimizer op runs.
//!
//! The pass rebuilds the graph in the order the compute stream will run it: the forward
//! pass; the backward pass with each checkpointed block's forward ops cloned (phase
//! `recompute`) just before that block's backward ops, which then read the clones; each
//! gradient's squared norm (when clipping) and each persistent parameter's AdamW right after
//! the gradient is complete; and last the AdamW ops of offloaded parameters, which the host
//! optimizer runs. Then [`insert_movement`] adds what the policy moves between memories:
//! chunk gathers and releases, gradient offloads, activation offloads and reloads, the clip
//! coefficient's copy. The pass does not decide streams, events or addresses.

use crate::error::{CompileError, Result};
use crate::movement::{insert_movement, Lowering};
use fnv::FnvHashMap as HashMap;
use protrain_ir::{
    BlockKind, BlockMode, ChunkTable, Graph, HostLayout, OpId, OpKind, Phase, Policy, Role,
    TensorType, ValueId,
};
use std::collections::BTreeSet;

/// A training graph with a policy applied: the compute order, recomputation, and every copy
/// between memories as a movement op.
#[derive(Clone, Debug)]
pub struct Placed {
    /// The graph in program order, with recomputation clones and movement ops.
    pub graph: Graph,
    /// The same graph without its movement ops (each op reads what its copies were copied
    /// from): the schedule's graph.
    pub compute: Graph,
    /// Where each op and value of `graph` is in `compute`.
    pub lowering: Lowering,
    /// The policy applied (for the schedule's header; the graph holds its decisions).
    pub policy: Policy,
    /// The chunk table (parameter ids are the same in the placed graph).
    pub chunks: ChunkTable,
    /// How offloaded chunks keep their state on the host: a placement decision the streams
    /// pass applies to each chunk where it is safe (see [`HostLayout`]).
    pub host_layout: HostLayout,
    /// Whether the graph runs its micro-batches chunk-major in one program
    /// ([`crate::interleave`]): each gradient is complete once per step although the loss
    /// gradient is scaled for several micro-batches.
    pub interleaved: bool,
}

/// Applies `policy` to a training graph chunked as `chunks`.
///
/// Fails when the policy names more blocks than the model has layers, more persistent chunks
/// than there are, or too few chunk buffers to stream the others.
pub fn place(training: &Graph, chunks: &ChunkTable, policy: &Policy) -> Result<Placed> {
    check_policy(training, chunks, policy)?;
    let (read_backward, boundary) = forward_reads(training);
    let mode_of = |op: OpId| -> BlockMode {
        match training.block(training.op(op).block).kind {
            BlockKind::Layer(i) => policy.blocks[i as usize],
            _ => BlockMode::Keep,
        }
    };
    let mut swapped_old = BTreeSet::new();
    for (id, op) in training.ops().filter(|(_, op)| op.phase == Phase::Forward) {
        if mode_of(id) == BlockMode::Swap {
            swapped_old.extend(
                op.outputs
                    .iter()
                    .filter(|v| read_backward.contains(v) && !boundary.contains(v)),
            );
        }
    }
    let order = compute_order(training, chunks, policy, &boundary);
    let (compute, map) = rebuild(training, &order)?;
    let swapped = swapped_old.iter().map(|v| map[v]).collect();
    let (graph, lowering) = insert_movement(&compute, chunks, policy, &swapped)?;
    Ok(Placed {
        graph,
        compute,
        lowering,
        policy: policy.clone(),
        chunks: chunks.clone(),
        host_layout: policy.host_layout,
        interleaved: policy.order == protrain_ir::MicroBatchOrder::ChunkMajor,
    })
}

/// Fails when `policy` does not fit the graph: a block mode per layer, no more persistent
/// chunks than there are, and a chunk buffer where any chunk is streamed.
fn check_policy(training: &Graph, chunks: &ChunkTable, policy: &Policy) -> Result<()> {
    // Layers, not blocks: an interleaved graph ([`crate::interleave`]) has a block per layer
    // and micro-batch.
    let layers = training
        .blocks()
        .filter_map(|(_, b)| match b.kind {
            BlockKind::Layer(i) => Some(i),
            _ => None,
        })
        .collect::<BTreeSet<u32>>()
        .len();
    let bad = |m: String| Err(CompileError::BadPolicy(m));
    if policy.blocks.len() != layers {
        return bad(format!(
            "the policy has {} block modes for {layers} layers",
            policy.blocks.len()
        ));
    }
    if policy.n_persist as usize > chunks.len() {
        return bad(format!(
            "n_persist {} exceeds the {} chunks",
            policy.n_persist,
            chunks.len()
        ));
    }
    if (policy.n_persist as usize) < chunks.len() && policy.n_buffer == 0 {
        return bad("streaming chunks needs at least one chunk buffer (n_buffer >= 1)".into());
    }
    Ok(())
}

/// Which forward values the backward pass reads, and which cross a block boundary in the
/// forward pass (the block's output, which is its checkpoint and is always kept).
fn forward_reads(training: &Graph) -> (BTreeSet<ValueId>, BTreeSet<ValueId>) {
    let mut read_backward: BTreeSet<ValueId> = BTreeSet::new();
    let mut boundary: BTreeSet<ValueId> = BTreeSet::new();
    for (_, op) in training.ops() {
        for &v in &op.inputs {
            let Some(producer) = training.value(v).producer else {
                continue;
            };
            let producer = training.op(producer);
            if producer.phase != Phase::Forward {
                continue;
            }
            match op.phase {
                Phase::Backward => {
                    read_backward.insert(v);
                }
                Phase::Forward if op.block != producer.block => {
                    boundary.insert(v);
                }
                _ => {}
            }
        }
    }
    (read_backward, boundary)
}

/// The compute order, each op with whether it is a recompute clone: the forward pass; the
/// backward pass with each checkpointed block's forward ops (all but those whose outputs all
/// cross the block boundary) cloned before its first backward op; each gradient's squared
/// norm and each persistent parameter's AdamW (without clipping) right after the op that
/// completes the gradient; then the device tail (clip coefficient, persistent AdamW under
/// clipping) and the host AdamW ops in the order their gradients complete.
fn compute_order(
    training: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    boundary: &BTreeSet<ValueId>,
) -> Vec<(OpId, bool)> {
    // The op that completes each parameter's gradient, and the ops that must follow it.
    let persistent = |value: ValueId| -> bool {
        let p = training.param_of(value).expect("AdamW updates a parameter");
        chunks.locate(p).0 .0 < policy.n_persist
    };
    let clip = training.ops().any(|(_, op)| op.kind.is_grad_coef());
    let mut after: HashMap<OpId, Vec<OpId>> = HashMap::default();
    let mut tail_device: Vec<OpId> = Vec::new();
    let mut tail_host: Vec<(OpId, OpId)> = Vec::new();
    for (id, op) in training.ops() {
        let completes = |grad: ValueId| {
            training
                .value(grad)
                .producer
                .expect("gradients are computed")
        };
        match op.kind {
            OpKind::GradNormSq => after.entry(completes(op.inputs[0])).or_default().push(id),
            OpKind::ClipCoef { .. } | OpKind::UnscaleCoef { .. } => tail_device.push(id),
            OpKind::AdamW { .. } if persistent(op.inputs[0]) && !clip => {
                after.entry(completes(op.inputs[1])).or_default().push(id)
            }
            OpKind::AdamW { .. } if persistent(op.inputs[0]) => tail_device.push(id),
            OpKind::AdamW { .. } => tail_host.push((completes(op.inputs[1]), id)),
            _ => {}
        }
    }

    // The compute order: forward, backward with recompute clones, then the tails.
    let backward: Vec<OpId> = training
        .ops()
        .filter(|(_, op)| op.phase == Phase::Backward)
        .map(|(id, _)| id)
        .collect();
    let mut order: Vec<(OpId, bool)> = training
        .ops()
        .filter(|(_, op)| op.phase == Phase::Forward)
        .map(|(id, _)| (id, false))
        .collect();
    let mut recomputed = BTreeSet::new();
    let mut position: HashMap<OpId, usize> = HashMap::default();
    for &id in &backward {
        let block = training.op(id).block;
        if let BlockKind::Layer(i) = training.block(block).kind {
            if policy.blocks[i as usize] == BlockMode::Checkpoint && recomputed.insert(block) {
                for (fid, fop) in training.ops() {
                    if fop.phase == Phase::Forward
                        && fop.block == block
                        && !fop.outputs.iter().all(|v| boundary.contains(v))
                    {
                        order.push((fid, true));
                    }
                }
            }
        }
        order.push((id, false));
        position.insert(id, order.len());
        for &follower in after.get(&id).map(Vec::as_slice).unwrap_or(&[]) {
            order.push((follower, false));
        }
    }
    order.extend(tail_device.iter().map(|&id| (id, false)));
    // Host updates in the order their gradients complete.
    tail_host.sort_by_key(|&(completes, id)| (position.get(&completes).copied().unwrap_or(0), id));
    order.extend(tail_host.iter().map(|&(_, id)| (id, false)));
    debug_assert_eq!(
        order.iter().filter(|(_, clone)| !clone).count(),
        training.op_count()
    );
    order
}

/// Rebuilds the graph with every op of `order` once, a clone reading clones where they
/// exist; returns it with the map from the training graph's values to the new ones.
fn rebuild(
    training: &Graph,
    order: &[(OpId, bool)],
) -> Result<(Graph, std::collections::HashMap<ValueId, ValueId>)> {
    // Rebuild: every op in `order` once, with the training graph's values and about one
    // more per recompute clone (room to start with, not a limit).
    let (mut graph, mut map) = training.skeleton();
    graph.reserve(
        order.len(),
        training.values().len() + (order.len() - training.op_count()),
    );
    let mut clone_of: HashMap<ValueId, ValueId> = HashMap::default();
    for (id, value) in training.values() {
        if value.role == Role::OptimizerState && value.producer.is_none() {
            map.insert(id, graph.add_state(value.name.clone(), value.ty.clone()));
        }
    }
    for &(old, is_clone) in order {
        let op = training.op(old);
        let inputs: Vec<ValueId> = op
            .inputs
            .iter()
            .map(|v| {
                let reads_clone =
                    (is_clone || op.phase == Phase::Backward) && clone_of.contains_key(v);
                if reads_clone {
                    clone_of[v]
                } else {
                    map[v]
                }
            })
            .collect();
        let outputs: Vec<(String, Role, TensorType)> = op
            .outputs
            .iter()
            .map(|&v| {
                let value = training.value(v);
                let name = match is_clone {
                    true => [value.name.as_str(), ".recompute"].concat(),
                    false => value.name.clone(),
                };
                (name, value.role, value.ty.clone())
            })
            .collect();
        let phase = if is_clone { Phase::Recompute } else { op.phase };
        let new = graph.add_op_typed(op.kind.clone(), &inputs, outputs, op.block, phase)?;
        for (&old_v, new_v) in op.outputs.iter().zip(new) {
            if is_clone {
                clone_of.insert(old_v, new_v);
            } else {
                map.insert(old_v, new_v);
            }
        }
    }
    for &v in training.outputs() {
        graph.add_output(map[&v]);
    }
    Ok((graph, map))
}
