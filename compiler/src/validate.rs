//! Translation validation: proves with an e-graph (egg) that placement changed no
//! computation.
//!
//! Both graphs go into one e-graph through the encoder fusion uses ([`crate::egraph`]): each
//! op output a node over its inputs' e-classes and its kind (with every attribute); parameters,
//! inputs and optimizer state leaves named by their role and name, so the two graphs share
//! them. Hash-consing and congruence closure then put a recompute clone in its original's
//! e-class (same kind, equal inputs), so if placement is a faithful reordering with
//! recomputation, the loss, every parameter's gradient and every optimizer update of the
//! placed graph land in the same e-classes as the unplaced one's.
//!
//! Movement is proven by one identity, applied as the placed graph is encoded
//! ([`add_graph_with_copies`]): output `i` of a movement start or done is its input `i` (a
//! copy holds what it copies, wherever it lives). So
//! `reload(offload(x)) = x` and `use(gather(chunk)) = use(param)`: a kernel that reads the
//! right copy of the right parameter is congruent to the unplaced kernel, and one that reads
//! the wrong member of a gather, or a copy of another value, is not. Slots and timing are not
//! values: the graph verifier checks that a slot holds one chunk at a time, and
//! [`check_gathers`] that each gather copies its chunk. It checks what is computed, not when:
//! the schedule verifier checks the order.

use crate::egraph::{add_graph, add_graph_with_copies, Node, Plain};
use egg::EGraph;
use protrain_ir::{ChunkTable, Graph, Movement, OpKind, Role, ValueId};
use std::collections::HashMap;

/// Checks that every gather of `placed` copies exactly its chunk's parameters, in member
/// order: the name of each chunk that a gather miswires.
pub fn check_gathers(placed: &Graph, chunks: &ChunkTable) -> Vec<String> {
    let mut wrong = Vec::new();
    for (id, op) in placed.ops() {
        let OpKind::MoveStart(Movement::Gather { chunk, slot }) = op.kind else {
            continue;
        };
        let members: Vec<ValueId> = chunks
            .chunk(chunk)
            .members
            .iter()
            .map(|m| placed.param(m.param).value)
            .collect();
        if op.inputs != members {
            wrong.push(format!(
                "{id} gathers into slot{slot} as chunk{} values that are not its parameters",
                chunk.0
            ));
        }
    }
    wrong
}

/// The result of a validation: the values compared, and those that differ.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Validation {
    /// Values compared (loss, gradients, updates).
    pub compared: usize,
    /// Names of the values whose e-classes differ.
    pub differing: Vec<String>,
    /// Nodes in the e-graph.
    pub nodes: usize,
}

impl Validation {
    /// Whether the two graphs compute the same things.
    pub fn holds(&self) -> bool {
        self.differing.is_empty()
    }
}

/// What must agree: the loss and, per parameter, the gradient and the AdamW op's operands.
fn observed(graph: &Graph) -> HashMap<String, ValueId> {
    let mut out = HashMap::new();
    for &v in graph.outputs() {
        if graph.value(v).role == Role::Loss {
            out.insert("loss".to_string(), v);
        }
    }
    for (_, op) in graph.ops() {
        if let OpKind::AdamW { .. } = op.kind {
            let name = &graph.value(op.inputs[0]).name;
            out.insert(format!("grad {name}"), op.inputs[1]);
            if let Some(&coef) = op.inputs.get(4) {
                out.insert("clip coefficient".into(), coef);
            }
        }
    }
    out
}

/// Checks that `placed` computes the same loss, gradients and clip coefficient as
/// `training`.
pub fn validate(training: &Graph, placed: &Graph) -> Validation {
    let mut egraph: EGraph<Node, Plain> = EGraph::default();
    let before = add_graph(&mut egraph, training);
    let is_copy = |k: &OpKind| matches!(k, OpKind::MoveStart(_) | OpKind::MoveDone(_));
    let after = add_graph_with_copies(&mut egraph, placed, is_copy);
    egraph.rebuild();
    let (want, got) = (observed(training), observed(placed));
    let mut differing = Vec::new();
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    for name in names {
        let same = got.get(name).is_some_and(|&g| {
            egraph.find(before[want[name].index()]) == egraph.find(after[g.index()])
        });
        if !same {
            differing.push(name.clone());
        }
    }
    if got.len() != want.len() {
        differing.extend(got.keys().filter(|k| !want.contains_key(*k)).cloned());
    }
    Validation {
        compared: want.len(),
        differing,
        nodes: egraph.total_number_of_nodes(),
    }
}
