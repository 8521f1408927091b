//! The forward graph in an e-graph, with what the rewrites need to know about it.

use crate::egraph::{self, Encoder, Encoding, KindId, Node};
use egg::{Analysis, DidMerge, EGraph, Id};
use protrain_ir::{Graph, Role, ValueId};
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

/// The e-graph analysis: the encoder, what the rewrites need to know about the original
/// graph, and per class which original ops compute into it ([`Origin`]).
#[derive(Default)]
pub(super) struct Context {
    /// The encoder, shared with translation validation.
    pub encoder: Encoder,
    /// Position of the op that first reads each weight leaf.
    pub first_reader: HashMap<Id, usize>,
    /// Every fused form added, duplicates included.
    pub candidates: Vec<Candidate>,
}

/// What a class holds of the original graph, kept up to date through unions by
/// [`Analysis::merge`], so that a rewrite asks its classes instead of scanning every op (which
/// made saturation quadratic in depth).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Origin {
    /// Positions, in graph order, of the original ops with an output in the class.
    pub ops: Vec<usize>,
    /// Whether the class holds an original value read by exactly one op and not a graph
    /// output.
    pub single_use: bool,
}

impl Context {
    /// The original ops with an output in any of `classes`.
    pub fn ops_in(&self, egraph: &EGraph<Node, Context>, classes: &[Id]) -> BTreeSet<usize> {
        classes
            .iter()
            .flat_map(|&c| egraph[c].data.ops.iter().copied())
            .collect()
    }
}

impl Analysis<Node> for Context {
    type Data = Origin;

    /// A node added by a rewrite computes no original op's output.
    fn make(_egraph: &mut EGraph<Node, Self>, _enode: &Node) -> Self::Data {
        Origin::default()
    }

    /// The union of what both classes hold. Parents need no new analysis (`make` reads no
    /// child's data), so this reports no change to propagate.
    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        a.ops.extend(b.ops);
        a.single_use |= b.single_use;
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
    // Ops reading each value, each op once (as `Graph::users` counts, without its scan of
    // every op per value).
    let mut readers = vec![0usize; forward.values().len()];
    for (_, op) in forward.ops() {
        for (i, v) in op.inputs.iter().enumerate() {
            if !op.inputs[..i].contains(v) {
                readers[v.index()] += 1;
            }
        }
    }
    let graph_outputs: HashSet<ValueId> = forward.outputs().iter().copied().collect();
    for (position, (_, op)) in forward.ops().enumerate() {
        for &w in op.inputs.iter().skip(1) {
            if forward.value(w).role == Role::Param {
                egraph
                    .analysis
                    .first_reader
                    .entry(class[w.index()])
                    .or_insert(position);
            }
        }
        for &out in &op.outputs {
            let origin = &mut egraph[class[out.index()]].data;
            origin.ops.push(position);
            if readers[out.index()] == 1 && !graph_outputs.contains(&out) {
                origin.single_use = true;
            }
        }
    }
    egraph.rebuild();
    (egraph, class)
}
