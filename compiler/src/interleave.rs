//! Interleaving: rewrites a training graph scaled for `K` micro-batches into one graph that
//! runs all `K` chunk-major (GreedySnake's order): each layer's forward pass for micro-batch
//! 1..K, then the next layer's; each layer's backward pass for micro-batch 1..K, then the
//! previous layer's; then the optimizer once, on the gradients summed over the micro-batches.
//!
//! The graph holds `K` copies of the forward and backward ops, each with its own step inputs
//! (micro-batch `m`'s rows: the graph's inputs are the model's inputs once per micro-batch,
//! micro-batch after micro-batch) and its own loss (the graph's outputs start with the `K`
//! losses in micro-batch order), all reading the one set of parameters. Copy `m` of an op of
//! block `b` belongs to copy `m` of that block, a block of the same kind
//! ([`BlockKind::Layer`] `i` stays layer `i`), so that a policy's mode per layer applies to
//! every copy and placement recomputes a checkpointed layer copy by copy, right before that
//! copy's backward pass (device memory holds `K` checkpoints, not `K` whole layers).
//!
//! Each parameter's gradient is summed over the copies as its copies complete, left to right
//! in micro-batch order, by [`OpKind::Add`]: `((g1 + g2) + g3) ...`, in the gradient's type
//! (bf16 summed in f32 and rounded to nearest even, as f32 in f32), which is exactly the
//! arithmetic of the `accumulate_grad` kernel of sequential accumulation
//! ([`crate::accumulate`]) after its first micro-batch: a sum from zero differs from the
//! first gradient only in the sign of a zero (`0 + -0` is `+0`), so the two orders' sums have
//! the same bits but where every micro-batch's gradient is `-0`. The optimizer ops read the
//! sums as a one-micro-batch step reads its gradients: no accumulator, gradients offloaded
//! once per step.
//!
//! The pass runs before placement and decides nothing about memory; it does not interleave
//! the optimizer, and it leaves a graph of one micro-batch unchanged.

use crate::error::{CompileError, Result};
use fnv::FnvHashMap as HashMap;
use protrain_ir::{BlockId, Graph, OpId, OpKind, Phase, Role, TensorType, ValueId};
use std::collections::BTreeSet;

/// The name copy `m` of a value takes: its own for the first micro-batch, `name.mb{m}` for
/// the others.
fn copy_name(name: &str, m: u64) -> String {
    match m {
        0 => name.to_string(),
        _ => format!("{name}.mb{m}"),
    }
}

/// Runs of consecutive ops of one block, in `ops`' order.
fn runs(graph: &Graph, ops: &[OpId]) -> Vec<Vec<OpId>> {
    let mut out: Vec<Vec<OpId>> = Vec::new();
    let mut block = None;
    for &op in ops {
        let b = graph.op(op).block;
        if block != Some(b) || out.is_empty() {
            out.push(Vec::new());
            block = Some(b);
        }
        out.last_mut().expect("a run was pushed").push(op);
    }
    out
}

/// Interleaves the `K` micro-batches that `training`'s loss gradient is scaled for
/// ([`Graph::micro_batches`], see [`crate::accumulate::scale_loss_gradient`]); returns a copy
/// of the graph for one.
///
/// Fails when an optimizer op reads a value of one micro-batch other than a parameter's
/// gradient (the optimizer runs once per step, on the sums), or an op is rejected by the IR.
pub fn interleave(training: &Graph) -> Result<Graph> {
    interleave_on(training, 1)
}

/// [`interleave`] for one of `ranks` data-parallel ranks: the loss gradient is scaled for
/// `ranks x K` micro-batches ([`crate::accumulate::scale_loss_gradient`]) and the graph
/// interleaves the `K` of one rank. Each copy's gradient is still summed into the step's
/// by an [`OpKind::Add`]; [`crate::data_parallel`] turns those adds into sums over the
/// ranks, in the order one rank accumulating every rank's micro-batches sums them.
pub fn interleave_on(training: &Graph, ranks: u64) -> Result<Graph> {
    let k = training.micro_batches() / ranks.max(1);
    if k <= 1 {
        return Ok(training.clone());
    }
    let (mut graph, base) = training.skeleton();
    // Copy 0 keeps each block; copy `m` gets a block of the same kind.
    let mut blocks: Vec<Vec<BlockId>> = vec![training.blocks().map(|(id, _)| id).collect()];
    for m in 1..k {
        blocks.push(
            training
                .blocks()
                .map(|(_, b)| graph.add_block(copy_name(&b.name, m), b.kind))
                .collect(),
        );
    }
    // Values every copy shares: parameters and optimizer state.
    let mut shared: HashMap<ValueId, ValueId> = HashMap::default();
    for (&old, &new) in &base {
        if training.value(old).role == Role::Param {
            shared.insert(old, new);
        }
    }
    for (id, value) in training.values() {
        if value.role == Role::OptimizerState && value.producer.is_none() {
            shared.insert(id, graph.add_state(value.name.clone(), value.ty.clone()));
        }
    }
    // Each copy's own values, starting with its step inputs.
    let mut own: Vec<HashMap<ValueId, ValueId>> = vec![HashMap::default(); k as usize];
    for &v in training.inputs() {
        own[0].insert(v, base[&v]);
    }
    for (m, map) in own.iter_mut().enumerate().skip(1) {
        for &v in training.inputs() {
            let value = training.value(v);
            map.insert(
                v,
                graph.add_input(copy_name(&value.name, m as u64), value.ty.clone()),
            );
        }
    }
    // The gradients the optimizer reads: each copy's is summed into the step's.
    let summed: BTreeSet<ValueId> = training
        .ops()
        .filter(|(_, op)| op.phase == Phase::Optimizer)
        .flat_map(|(_, op)| op.inputs.iter().copied())
        .filter(|&v| {
            training
                .value(v)
                .producer
                .is_some_and(|p| training.op(p).phase != Phase::Optimizer)
        })
        .collect();
    let of_phase = |phase: Phase| -> Vec<OpId> {
        training
            .ops()
            .filter(|(_, op)| op.phase == phase)
            .map(|(id, _)| id)
            .collect()
    };
    let mut sums: HashMap<ValueId, ValueId> = HashMap::default();
    for phase in [Phase::Forward, Phase::Backward] {
        for run in runs(training, &of_phase(phase)) {
            for m in 0..k as usize {
                for &id in &run {
                    copy_op(
                        training,
                        &mut graph,
                        id,
                        m,
                        &blocks[m],
                        &shared,
                        &mut own[m],
                    )?;
                    for &g in training
                        .op(id)
                        .outputs
                        .iter()
                        .filter(|g| summed.contains(g))
                    {
                        let mine = own[m][&g];
                        let sum = match sums.get(&g) {
                            None => mine,
                            Some(&before) => {
                                let value = training.value(g);
                                let name = format!("{}.sum{m}", value.name);
                                graph.add_op_typed(
                                    OpKind::Add,
                                    &[before, mine],
                                    vec![(name, value.role, value.ty.clone())],
                                    blocks[m][training.op(id).block.index()],
                                    Phase::Backward,
                                )?[0]
                            }
                        };
                        sums.insert(g, sum);
                    }
                }
            }
        }
    }
    for id in of_phase(Phase::Optimizer) {
        let op = training.op(id);
        let mut inputs = Vec::with_capacity(op.inputs.len());
        for &v in &op.inputs {
            let Some(&new) = sums.get(&v).or_else(|| shared.get(&v)) else {
                return Err(CompileError::Validation(format!(
                    "{} reads {}, a value of one micro-batch; interleaving runs the optimizer \
                     once on the sums over the micro-batches",
                    op.kind.mnemonic(),
                    training.value(v).name
                )));
            };
            inputs.push(new);
        }
        let outputs = op
            .outputs
            .iter()
            .map(|&v| {
                let value = training.value(v);
                (value.name.clone(), value.role, value.ty.clone())
            })
            .collect();
        let new = graph.add_op_typed(op.kind.clone(), &inputs, outputs, op.block, op.phase)?;
        for (&old, new) in op.outputs.iter().zip(new) {
            shared.insert(old, new);
        }
    }
    for &v in training.outputs() {
        for map in &own {
            let Some(&new) = map.get(&v).or_else(|| shared.get(&v)) else {
                return Err(CompileError::Validation(format!(
                    "the output {} is computed by no copy",
                    training.value(v).name
                )));
            };
            graph.add_output(new);
        }
    }
    Ok(graph)
}

/// Adds copy `m` of op `id` to `graph`: in copy `m` of its block, reading copy `m` of what it
/// reads (the shared value for a parameter), its outputs named for the copy.
fn copy_op(
    training: &Graph,
    graph: &mut Graph,
    id: OpId,
    m: usize,
    blocks: &[BlockId],
    shared: &HashMap<ValueId, ValueId>,
    own: &mut HashMap<ValueId, ValueId>,
) -> Result<()> {
    let op = training.op(id);
    let mut inputs = Vec::with_capacity(op.inputs.len());
    for &v in &op.inputs {
        let Some(&new) = own.get(&v).or_else(|| shared.get(&v)) else {
            return Err(CompileError::Validation(format!(
                "{} reads {} before it is computed",
                op.kind.mnemonic(),
                training.value(v).name
            )));
        };
        inputs.push(new);
    }
    let outputs: Vec<(String, Role, TensorType)> = op
        .outputs
        .iter()
        .map(|&v| {
            let value = training.value(v);
            (
                copy_name(&value.name, m as u64),
                value.role,
                value.ty.clone(),
            )
        })
        .collect();
    let new = graph.add_op_typed(
        op.kind.clone(),
        &inputs,
        outputs,
        blocks[op.block.index()],
        op.phase,
    )?;
    for (&old, new) in op.outputs.iter().zip(new) {
        own.insert(old, new);
    }
    Ok(())
}
