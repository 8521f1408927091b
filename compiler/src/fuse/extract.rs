//! Extraction: prices every fused form the e-graph holds with the cost model and takes the
//! best that do not overlap.

use super::encode::{Candidate, Context};
use crate::autodiff::{vjp_rule, Saved};
use crate::cost::CostModel;
use crate::egraph::{self, KindId, Node};
use egg::{EGraph, Id};
use protrain_ir::{DType, Graph, Op, OpId, OpKind, TensorType, ValueId};
use std::collections::{BTreeSet, HashMap, HashSet};

/// The fusions chosen, those rejected, and the prices of the original ops.
pub(super) struct Extraction {
    /// The fusions to apply, by saving, largest first.
    pub taken: Vec<Priced>,
    /// Fused forms not applied, with the reason, counted and sorted.
    pub rejected: Vec<(String, usize)>,
    /// Predicted forward + backward seconds of each original op, in graph order.
    pub op_seconds: Vec<f64>,
}

/// Prices the original ops of `forward` (listed in `ops`, their values in `class`) and every
/// candidate the saturated `egraph` holds, each once, then takes candidates by saving, largest
/// first, skipping any that is not faster or overlaps one already taken.
pub(super) fn extract(
    forward: &Graph,
    ops: &[(OpId, &Op)],
    egraph: &EGraph<Node, Context>,
    class: &[Id],
    cost: &dyn CostModel,
) -> Extraction {
    let op_seconds: Vec<f64> = ops
        .iter()
        .map(|(_, op)| {
            let types: Vec<&TensorType> = op.inputs.iter().map(|&v| &forward.value(v).ty).collect();
            step_seconds(cost, &op.kind, &types)
        })
        .collect();

    // The original value in each class (the first in graph order).
    let mut value_of: HashMap<Id, ValueId> = HashMap::new();
    for (id, _) in forward.values() {
        value_of.entry(egraph.find(class[id.index()])).or_insert(id);
    }
    // The positions of the ops reading each value, each op once (`Graph::users` scans every
    // op per value).
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); forward.values().len()];
    for (position, (_, op)) in ops.iter().enumerate() {
        for (i, v) in op.inputs.iter().enumerate() {
            if !op.inputs[..i].contains(v) {
                readers[v.index()].push(position);
            }
        }
    }
    let graph = Originals {
        forward,
        ops,
        readers: &readers,
        value_of: &value_of,
    };

    // Candidates, each once, with their saving; then the selection.
    let mut seen: HashSet<(KindId, Vec<Id>)> = HashSet::new();
    let mut priced: Vec<Priced> = Vec::new();
    let mut rejected: HashMap<&'static str, usize> = HashMap::new();
    for candidate in &egraph.analysis.candidates {
        let children: Vec<Id> = candidate.children.iter().map(|&c| egraph.find(c)).collect();
        if !seen.insert((candidate.kind, children.clone())) {
            continue;
        }
        let priced_one = price(&graph, egraph, candidate, &children, (cost, &op_seconds));
        match priced_one {
            Ok(p) => priced.push(p),
            Err(why) => *rejected.entry(why).or_default() += 1,
        }
    }
    priced.sort_by(|a, b| {
        let saving = |p: &Priced| p.before - p.after;
        saving(b)
            .total_cmp(&saving(a))
            .then(a.anchor.cmp(&b.anchor))
    });
    let mut taken: Vec<Priced> = Vec::new();
    let mut covered: HashSet<usize> = HashSet::new();
    for p in priced {
        if p.after >= p.before {
            *rejected.entry("not faster by the cost model").or_default() += 1;
        } else if p.covers.iter().any(|c| covered.contains(c)) {
            *rejected
                .entry("overlaps a fusion that saves more")
                .or_default() += 1;
        } else {
            covered.extend(p.covers.iter().copied());
            taken.push(p);
        }
    }
    let mut rejected: Vec<(String, usize)> = rejected
        .into_iter()
        .map(|(why, n)| (why.to_string(), n))
        .collect();
    rejected.sort();
    Extraction {
        taken,
        rejected,
        op_seconds,
    }
}

/// A candidate with its operands resolved to original values and its price.
#[derive(Clone, Debug)]
pub(super) struct Priced {
    /// The rewrite's rule, as the report names it.
    pub rule: &'static str,
    /// The fused kind.
    pub kind: OpKind,
    /// Its operands, values of the forward graph.
    pub inputs: Vec<ValueId>,
    /// The forward graph's values it computes, in output order.
    pub outputs: Vec<ValueId>,
    /// Positions of the original ops it replaces.
    pub covers: BTreeSet<usize>,
    /// The first covered op: where the fused op goes in graph order.
    pub anchor: usize,
    /// Predicted forward + backward seconds of the ops it replaces.
    pub before: f64,
    /// Predicted forward + backward seconds of the fused op.
    pub after: f64,
}

/// The forward graph as extraction reads it: its ops in graph order, the positions of the
/// ops reading each value, and the original value of each class.
struct Originals<'a> {
    forward: &'a Graph,
    ops: &'a [(OpId, &'a Op)],
    readers: &'a [Vec<usize>],
    value_of: &'a HashMap<Id, ValueId>,
}

/// Resolves a candidate to original values and prices it, or says why it cannot be applied.
/// `prices` is the cost model and the original ops' prices.
fn price(
    graph: &Originals,
    egraph: &EGraph<Node, Context>,
    candidate: &Candidate,
    children: &[Id],
    prices: (&dyn CostModel, &[f64]),
) -> std::result::Result<Priced, &'static str> {
    let Originals {
        forward,
        ops,
        readers,
        value_of,
    } = *graph;
    let (cost, op_seconds) = prices;
    const UNRESOLVED: &str = "an operand is not a value of the graph";
    let (_, operands) = children.split_last().ok_or(UNRESOLVED)?;
    let inputs: Vec<ValueId> = operands
        .iter()
        .map(|c| value_of.get(c).copied())
        .collect::<Option<_>>()
        .ok_or(UNRESOLVED)?;
    let types: Vec<&TensorType> = inputs.iter().map(|&v| &forward.value(v).ty).collect();
    let kind = egraph.analysis.encoder.kind(candidate.kind);
    let outputs_len = kind
        .infer(&types)
        .map_err(|_| "its operands do not fit it")?
        .len();
    let mut outputs = Vec::with_capacity(outputs_len);
    for i in 0..outputs_len {
        let node = egraph::output(kind, i, children.to_vec());
        let c = egraph.lookup(node).ok_or(UNRESOLVED)?;
        outputs.push(*value_of.get(&egraph.find(c)).ok_or(UNRESOLVED)?);
    }
    let covers = &candidate.covers;
    let anchor = *covers.first().ok_or(UNRESOLVED)?;
    // Every value of a covered op that the fused op does not produce must be read only inside.
    for &c in covers {
        let op = ops[c].1;
        if op.block != ops[anchor].1.block {
            return Err("its ops are in different blocks");
        }
        for &v in &op.outputs {
            if outputs.contains(&v) {
                continue;
            }
            let outside = forward.outputs().contains(&v)
                || readers[v.index()].iter().any(|u| !covers.contains(u));
            if outside {
                return Err("an intermediate value is read by other ops");
            }
        }
    }
    // Autodiff sums a value's gradient contributions in reverse reading order, each reader's
    // alone. A group's backward sums its projections' contributions first, so when something
    // outside the group also reads the shared input (OLMo 2's residual stream feeds q/k/v and
    // the residual add), the sum would be associated differently and differ in its last bits.
    if let OpKind::FusedLinear { count: 2.., .. } = kind {
        let x = *inputs.first().ok_or(UNRESOLVED)?;
        if readers[x.index()].iter().any(|u| !covers.contains(u)) {
            return Err(
                "its shared input is also read by other ops, whose gradients would be \
                        summed in another order",
            );
        }
    }
    Ok(Priced {
        rule: candidate.rule,
        kind: kind.clone(),
        inputs,
        outputs,
        covers: covers.clone(),
        anchor,
        before: covers.iter().map(|&c| op_seconds[c]).sum(),
        after: step_seconds(cost, kind, &types),
    })
}

/// Predicted seconds of one forward and one backward execution of `kind` over `inputs`.
fn step_seconds(cost: &dyn CostModel, kind: &OpKind, inputs: &[&TensorType]) -> f64 {
    let Ok(outputs) = kind.infer(inputs) else {
        return f64::INFINITY;
    };
    let dtype = inputs
        .iter()
        .find(|t| t.dtype.is_float())
        .map_or(DType::F32, |t| t.dtype);
    let out_refs: Vec<&TensorType> = outputs.iter().collect();
    let mut seconds = cost.op_seconds(kind, inputs, &out_refs, dtype);
    let rows: Vec<u64> = inputs
        .iter()
        .map(|t| t.shape.first().copied().unwrap_or(1))
        .collect();
    if let Some(rule) = vjp_rule(kind, &rows) {
        if let Some(backward) = &rule.backward {
            let mut bwd: Vec<&TensorType> = rule
                .saves
                .iter()
                .map(|s| match *s {
                    Saved::Input(i) => inputs[i],
                    Saved::Output(i) => &outputs[i],
                })
                .collect();
            bwd.extend(rule.output_grads.iter().map(|&o| &outputs[o]));
            if let Ok(grads) = backward.infer(&bwd) {
                let grad_refs: Vec<&TensorType> = grads.iter().collect();
                seconds += cost.op_seconds(backward, &bwd, &grad_refs, dtype);
            }
        }
    }
    seconds
}
