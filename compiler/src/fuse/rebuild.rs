//! Rebuild: the forward graph with the chosen fusions' ops replaced by their fused ops.

use super::extract::Priced;
use crate::error::Result;
use protrain_ir::{Graph, Op, OpId, Phase, Role, ValueId};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The forward graph with each taken fusion's ops replaced by its fused op, in the original
/// order where dependencies allow (a fused op goes where its first covered op was).
pub(super) fn rebuild(forward: &Graph, ops: &[(OpId, &Op)], taken: &[Priced]) -> Result<Graph> {
    let (mut graph, mut map) = forward.skeleton();

    // Units to emit: each taken fusion, and each op no fusion covers.
    enum Unit<'a> {
        Original(&'a Op),
        Fused(&'a Priced),
    }
    let mut fused_at: HashMap<usize, usize> = HashMap::new();
    for (i, p) in taken.iter().enumerate() {
        for &c in &p.covers {
            fused_at.insert(c, i);
        }
    }
    let mut units: Vec<(usize, Unit)> = Vec::new();
    for (position, (_, op)) in ops.iter().enumerate() {
        match fused_at.get(&position) {
            None => units.push((position, Unit::Original(op))),
            Some(&i) if taken[i].anchor == position => {
                units.push((position, Unit::Fused(&taken[i])))
            }
            Some(_) => {}
        }
    }
    let reads = |u: &Unit| -> Vec<ValueId> {
        match u {
            Unit::Original(op) => op.inputs.clone(),
            Unit::Fused(p) => p.inputs.clone(),
        }
    };
    let writes = |u: &Unit| -> Vec<ValueId> {
        match u {
            Unit::Original(op) => op.outputs.clone(),
            Unit::Fused(p) => p.outputs.clone(),
        }
    };
    // Kahn's algorithm, the ready unit earliest in the original order first.
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    for (i, (_, u)) in units.iter().enumerate() {
        for v in writes(u) {
            producer.insert(v, i);
        }
    }
    let mut waiting: Vec<usize> = vec![0; units.len()];
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); units.len()];
    for (i, (_, u)) in units.iter().enumerate() {
        let mut deps: Vec<usize> = reads(u)
            .iter()
            .filter_map(|v| producer.get(v).copied())
            .collect();
        deps.sort_unstable();
        deps.dedup();
        waiting[i] = deps.len();
        for d in deps {
            dependents[d].push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, usize)>> = units
        .iter()
        .enumerate()
        .filter(|(i, _)| waiting[*i] == 0)
        .map(|(i, (position, _))| Reverse((*position, i)))
        .collect();
    let mut emitted = 0;
    while let Some(Reverse((_, i))) = ready.pop() {
        emitted += 1;
        let (position, unit) = &units[i];
        let (kind, inputs, outputs, block) = match unit {
            Unit::Original(op) => (op.kind.clone(), &op.inputs, &op.outputs, op.block),
            Unit::Fused(p) => (
                p.kind.clone(),
                &p.inputs,
                &p.outputs,
                ops[*position].1.block,
            ),
        };
        let new_inputs: Vec<ValueId> = inputs.iter().map(|v| map[v]).collect();
        let names: Vec<(String, Role)> = outputs
            .iter()
            .map(|&v| {
                let value = forward.value(v);
                (value.name.clone(), value.role)
            })
            .collect();
        let new = graph.add_op_multi(kind, &new_inputs, &names, block, Phase::Forward)?;
        for (&old, new) in outputs.iter().zip(new) {
            map.insert(old, new);
        }
        for &d in &dependents[i] {
            waiting[d] -= 1;
            if waiting[d] == 0 {
                ready.push(Reverse((units[d].0, d)));
            }
        }
    }
    if emitted != units.len() {
        return Err(protrain_ir::IrError::Invalid(format!(
            "fusion left {} ops whose inputs are never produced (a cycle through a fused op)",
            units.len() - emitted
        ))
        .into());
    }
    for &v in forward.outputs() {
        graph.add_output(map[&v]);
    }
    Ok(graph)
}
