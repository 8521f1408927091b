//! The forward graph in an e-graph, with what the rewrites need to know about it.

use crate::egraph::{self, Encoder, Encoding, KindId, Node};
use egg::{Analysis, DidMerge, EGraph, Id};
use protrain_ir::{Graph, Role};
use std::collections::{BTreeSet, HashMap, HashSet};

/// A fused form a rewrite added: its kind, children (classes, the kind leaf last) and the
/// original ops whose values its outputs are equal to or consume.
#[derive(Clone, Debug)]
pub(super) struct Candidate {
    /// The rewrite's rule, as the report names it.
    pub rule: &'static str,
    /// The fused kind.
    pub kind: KindId,
    /// The children of its output nodes: operands, then the kind leaf.
    pub children: Vec<Id>,
    /// Positions of the original ops it replaces.
    pub covers: BTreeSet<usize>,
}

/// The e-graph analysis: the encoder, and what the rewrites need to know about the original
/// graph. No data per class: the rewrites read kinds from the kind leaves and types from the
/// graph when pricing.
#[derive(Default)]
pub(super) struct Context {
    /// The encoder, shared with translation validation.
    pub encoder: Encoder,
    /// For each original op, in graph order, its outputs' classes as added.
    pub op_classes: Vec<Vec<Id>>,
    /// Classes of original values read by exactly one op and not a graph output.
    pub single_use: Vec<Id>,
    /// Position of the op that first reads each weight leaf.
    pub first_reader: HashMap<Id, usize>,
    /// Every fused form added, duplicates included.
    pub candidates: Vec<Candidate>,
}

impl Context {
    /// The original ops with an output in any of `classes`.
    pub fn ops_in(&self, egraph: &EGraph<Node, Context>, classes: &[Id]) -> BTreeSet<usize> {
        let wanted: HashSet<Id> = classes.iter().map(|&c| egraph.find(c)).collect();
        self.op_classes
            .iter()
            .enumerate()
            .filter(|(_, outs)| outs.iter().any(|&c| wanted.contains(&egraph.find(c))))
            .map(|(p, _)| p)
            .collect()
    }
}

impl Analysis<Node> for Context {
    type Data = ();

    fn make(_egraph: &mut EGraph<Node, Self>, _enode: &Node) -> Self::Data {}

    fn merge(&mut self, _a: &mut Self::Data, _b: Self::Data) -> DidMerge {
        DidMerge(false, false)
    }
}

impl Encoding for Context {
    fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    fn encoder_mut(&mut self) -> &mut Encoder {
        &mut self.encoder
    }
}

/// Puts the forward graph into a new e-graph: the class of each value, and the context the
/// rewrites read.
pub(super) fn encode(forward: &Graph) -> (EGraph<Node, Context>, Vec<Id>) {
    let mut egraph: EGraph<Node, Context> = EGraph::new(Context::default());
    let class = egraph::add_graph(&mut egraph, forward);
    let context = &mut egraph.analysis;
    for (position, (_, op)) in forward.ops().enumerate() {
        for &w in op.inputs.iter().skip(1) {
            if forward.value(w).role == Role::Param {
                context
                    .first_reader
                    .entry(class[w.index()])
                    .or_insert(position);
            }
        }
        for &out in &op.outputs {
            if forward.users(out).len() == 1 && !forward.outputs().contains(&out) {
                context.single_use.push(class[out.index()]);
            }
        }
        let outs = op.outputs.iter().map(|v| class[v.index()]).collect();
        context.op_classes.push(outs);
    }
    egraph.rebuild();
    (egraph, class)
}
