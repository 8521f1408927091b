//! Graphviz DOT output of a [`Graph`], through petgraph's DOT writer.

use crate::graph::Graph;
use crate::ids::ValueId;
use crate::op::Op;
use petgraph::dot::{Config, Dot};
use petgraph::graph::NodeIndex;

/// Renders the dataflow graph as DOT: one node per op, labelled with its kind, parameters and
/// output type; one edge per value read, labelled with the value's type. Clusters are not
/// drawn; node colours tell the phases apart.
pub fn print_dot(graph: &Graph) -> String {
    let dataflow = graph.dataflow();
    let edge_attrs = |_, edge: petgraph::graph::EdgeReference<'_, ValueId>| {
        format!("label=\"{}\"", graph.value(*edge.weight()).ty)
    };
    let node_attrs = |_, (_, op): (NodeIndex, &Op)| {
        let mut label = op.kind.mnemonic().to_string();
        for &input in &op.inputs {
            if let Some(p) = graph.param_of(input) {
                label.push_str("\\n@");
                label.push_str(&graph.param(p).name);
            }
        }
        for &output in &op.outputs {
            label.push_str(&format!("\\n-> {}", graph.value(output).ty));
        }
        if let crate::op::OpKind::MoveStart(m) | crate::op::OpKind::MoveDone(m) = op.kind {
            let operands = m.operands();
            if !operands.is_empty() {
                label.push_str(&format!("\\n{}", operands));
            }
        }
        if let crate::op::OpKind::Release { chunk, slot } = op.kind {
            label.push_str(&format!("\\nchunk{} slot{slot}", chunk.0));
        }
        let color = match op.phase {
            _ if op.kind.is_movement() => "lightgrey",
            crate::op::Phase::Forward => "lightblue",
            crate::op::Phase::Backward => "lightsalmon",
            crate::op::Phase::Recompute => "khaki",
            crate::op::Phase::Optimizer => "palegreen",
        };
        format!("label=\"{label}\" shape=box style=filled fillcolor={color}")
    };
    let dot = Dot::with_attr_getters(
        dataflow,
        &[Config::EdgeNoLabel, Config::NodeNoLabel],
        &edge_attrs,
        &node_attrs,
    );
    format!("{dot:?}")
}
