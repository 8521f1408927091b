//! The dataflow e-graph language and its one encoder, shared by fusion and translation validation.
//!
//! A graph goes into an e-graph (egg) as three kinds of [`Node`]:
//!
//! - a **leaf** for each value no op produces (token ids, targets, parameters, optimizer
//!   state), carrying a [`LeafId`] interned from the value's role and name, so the same
//!   parameter of two graphs (the unplaced and the placed, the forward and the fused) is one
//!   leaf;
//! - a **kind** leaf for each op kind with all its attributes, carrying a [`KindId`] interned
//!   from the kind's canonical key;
//! - an **output** node for each output of each op: its operator is an [`OpOutput`] (the op's
//!   mnemonic and the output's position) and its children are the inputs' e-classes and, last,
//!   the kind's. The mnemonic is there so rewrite patterns can match an op type whatever its
//!   attributes (`(linear#0 ?x ?w ?k)`); the kind child carries the attributes, so two ops are
//!   congruent only when their kinds are equal in every attribute.
//!
//! An op without outputs (AdamW updates its operands in place) names no value, so it adds no
//! node; what it reads is compared instead.
//!
//! The [`Encoder`] owns the tables behind the ids and lives in the e-graph's analysis (see
//! [`Encoding`]), so appliers and analyses read what an id stands for without parsing text.
//! [`add_graph`] is the only way a graph enters an e-graph: fusion encodes the forward graph
//! and its fused result with it, translation validation the training graph and the placed one.
//! Movement ops (chunk gathers, activation offloads and reloads) are identities
//! (`reload(offload(x)) = x`): [`add_graph_with_copies`] gives their outputs their inputs'
//! classes as it adds them, which is what the identity rewrite would prove, at linear cost.

use egg::{define_language, Analysis, DidMerge, EGraph, Id, Symbol};
use protrain_ir::{Graph, OpKind, Role};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// An interned op kind with all its attributes. Equal kinds get equal ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KindId(u32);

/// An interned leaf: a value no op produces, identified by its role and name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeafId(u32);

/// The operator of an output node: the op's mnemonic and the output's position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpOutput {
    /// The op's mnemonic, e.g. `linear`.
    pub op: Symbol,
    /// Which of the op's outputs.
    pub index: u32,
}

impl OpOutput {
    /// Output `index` of an op of `kind`.
    pub fn of(kind: &OpKind, index: usize) -> Self {
        Self {
            op: Symbol::from(kind.mnemonic()),
            index: u32::try_from(index).expect("an op has fewer than 2^32 outputs"),
        }
    }
}

define_language! {
    /// A node of the dataflow e-graph: `Leaf` a value no op produces, `Kind` an op kind with its
    /// attributes, `Output` one output of an op over its inputs' classes and, last, its kind's.
    pub enum Node {
        Leaf(LeafId),
        Kind(KindId),
        Output(OpOutput, Box<[Id]>),
    }
}

/// Writes `prefix` then the id; the text patterns and dumps show.
fn write_id(f: &mut fmt::Formatter<'_>, prefix: &str, id: u32) -> fmt::Result {
    write!(f, "{prefix}{id}")
}

/// Reads an id written by [`write_id`] with `prefix`.
fn read_id(s: &str, prefix: &str) -> Result<u32, ParseNodeError> {
    s.strip_prefix(prefix)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| ParseNodeError(s.to_string()))
}

/// Text that names no node of the language (patterns name output nodes by `mnemonic#index`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseNodeError(String);

impl fmt::Display for ParseNodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` names no node", self.0)
    }
}

impl std::error::Error for ParseNodeError {}

impl fmt::Display for KindId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_id(f, "kind:", self.0)
    }
}

impl FromStr for KindId {
    type Err = ParseNodeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        read_id(s, "kind:").map(Self)
    }
}

impl fmt::Display for LeafId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_id(f, "leaf:", self.0)
    }
}

impl FromStr for LeafId {
    type Err = ParseNodeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        read_id(s, "leaf:").map(Self)
    }
}

impl fmt::Display for OpOutput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.op, self.index)
    }
}

impl FromStr for OpOutput {
    type Err = ParseNodeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let parsed = s
            .rsplit_once('#')
            .filter(|(op, _)| !op.is_empty() && !op.contains(':'))
            .and_then(|(op, index)| Some((op, index.parse().ok()?)));
        match parsed {
            Some((op, index)) => Ok(Self {
                op: Symbol::from(op),
                index,
            }),
            None => Err(ParseNodeError(s.to_string())),
        }
    }
}

/// The tables behind the ids: which kind each [`KindId`] is and which value each [`LeafId`]
/// names. One per e-graph, so ids from two graphs added to it agree.
#[derive(Debug, Default)]
pub struct Encoder {
    kinds: Vec<OpKind>,
    kind_ids: HashMap<String, KindId>,
    leaf_ids: HashMap<(Role, String), LeafId>,
}

impl Encoder {
    /// The id of `kind`, interned by its canonical key: the `Debug` text, which writes every
    /// attribute (floats exactly).
    pub fn kind_id(&mut self, kind: &OpKind) -> KindId {
        let next = KindId(self.kinds.len() as u32);
        let id = *self.kind_ids.entry(format!("{kind:?}")).or_insert(next);
        if id == next {
            self.kinds.push(kind.clone());
        }
        id
    }

    /// The kind `id` stands for.
    pub fn kind(&self, id: KindId) -> &OpKind {
        &self.kinds[id.0 as usize]
    }

    /// The id of the leaf for the value of `role` called `name`.
    pub fn leaf_id(&mut self, role: Role, name: &str) -> LeafId {
        let next = LeafId(self.leaf_ids.len() as u32);
        *self
            .leaf_ids
            .entry((role, name.to_string()))
            .or_insert(next)
    }
}

/// An e-graph analysis that holds the encoder, so appliers and analyses can read what an id
/// stands for.
pub trait Encoding: Analysis<Node> {
    /// The encoder.
    fn encoder(&self) -> &Encoder;
    /// The encoder, to intern new ids.
    fn encoder_mut(&mut self) -> &mut Encoder;
}

/// The analysis of an e-graph that needs nothing but the encoding: no data per class.
#[derive(Debug, Default)]
pub struct Plain {
    /// The encoder.
    pub encoder: Encoder,
}

impl Analysis<Node> for Plain {
    type Data = ();

    fn make(_egraph: &mut EGraph<Node, Self>, _enode: &Node) -> Self::Data {}

    fn merge(&mut self, _a: &mut Self::Data, _b: Self::Data) -> DidMerge {
        DidMerge(false, false)
    }
}

impl Encoding for Plain {
    fn encoder(&self) -> &Encoder {
        &self.encoder
    }

    fn encoder_mut(&mut self) -> &mut Encoder {
        &mut self.encoder
    }
}

/// Adds the leaf for the value of `role` called `name`.
pub fn add_leaf<A: Encoding>(egraph: &mut EGraph<Node, A>, role: Role, name: &str) -> Id {
    let leaf = egraph.analysis.encoder_mut().leaf_id(role, name);
    egraph.add(Node::Leaf(leaf))
}

/// Adds the kind leaf for `kind`.
pub fn add_kind<A: Encoding>(egraph: &mut EGraph<Node, A>, kind: &OpKind) -> Id {
    let id = egraph.analysis.encoder_mut().kind_id(kind);
    egraph.add(Node::Kind(id))
}

/// The node for output `index` of an op of `kind` whose children are `children`: the inputs'
/// classes, then the kind's (from [`add_kind`]). For [`EGraph::add`] and [`EGraph::lookup`].
pub fn output(kind: &OpKind, index: usize, children: Vec<Id>) -> Node {
    Node::Output(OpOutput::of(kind, index), children.into())
}

/// Adds an op of `kind` over the classes `inputs` with `outputs` outputs. Returns the
/// children of its output nodes (`inputs`, then the kind's class) and the outputs' classes.
pub fn add_op<A: Encoding>(
    egraph: &mut EGraph<Node, A>,
    kind: &OpKind,
    inputs: &[Id],
    outputs: usize,
) -> (Vec<Id>, Vec<Id>) {
    let mut children = inputs.to_vec();
    children.push(add_kind(egraph, kind));
    let classes = (0..outputs)
        .map(|i| egraph.add(output(kind, i, children.clone())))
        .collect();
    (children, classes)
}

/// The kind a kind-leaf class names; `None` if `class` holds no kind leaf.
pub fn kind_of<A: Encoding>(egraph: &EGraph<Node, A>, class: Id) -> Option<&OpKind> {
    egraph[class].nodes.iter().find_map(|node| match node {
        Node::Kind(id) => Some(egraph.analysis.encoder().kind(*id)),
        _ => None,
    })
}

/// Adds `graph`: every value no op produces as a leaf, in value order, then every op in graph
/// order. Returns the class of each value, indexed by its id. Does not rebuild the e-graph.
pub fn add_graph<A: Encoding>(egraph: &mut EGraph<Node, A>, graph: &Graph) -> Vec<Id> {
    add_graph_with_copies(egraph, graph, |_| false)
}

/// [`add_graph`], where each op whose kind `is_copy` picks is an identity: its output `i` is
/// its input `i`'s class (the op adds no node). Equivalent to adding the op and the rewrite
/// `copy#i(x_0, .., x_n, kind) => x_i`, without the unions: each union re-canonicalises every
/// parent of the merged class, and a copy's parents are the nodes of every op reading it,
/// so a gather of `m` members read by ops of `m` inputs costs `m^2` per union and `m^3` per
/// gather (the experts of a mixture-of-experts layer are hundreds of members).
pub fn add_graph_with_copies<A: Encoding>(
    egraph: &mut EGraph<Node, A>,
    graph: &Graph,
    is_copy: impl Fn(&OpKind) -> bool,
) -> Vec<Id> {
    let mut class: Vec<Option<Id>> = vec![None; graph.values().len()];
    for (id, value) in graph.values() {
        if value.producer.is_none() {
            class[id.index()] = Some(add_leaf(egraph, value.role, &value.name));
        }
    }
    for (_, op) in graph.ops() {
        let inputs: Vec<Id> = op
            .inputs
            .iter()
            .map(|v| class[v.index()].expect("a value is defined before it is read"))
            .collect();
        if is_copy(&op.kind) && op.outputs.len() <= inputs.len() {
            for (&value, &c) in op.outputs.iter().zip(&inputs) {
                class[value.index()] = Some(c);
            }
            continue;
        }
        let (_, outputs) = add_op(egraph, &op.kind, &inputs, op.outputs.len());
        for (&value, c) in op.outputs.iter().zip(outputs) {
            class[value.index()] = Some(c);
        }
    }
    class
        .into_iter()
        .map(|c| c.expect("every value is a leaf or an op's output"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use egg::{Pattern, RecExpr, Searcher};

    #[test]
    fn patterns_match_by_mnemonic_and_ids_print_back() {
        let mut egraph: EGraph<Node, Plain> = EGraph::default();
        let x = add_leaf(&mut egraph, Role::Input, "x");
        let (children, gelu) = add_op(&mut egraph, &OpKind::Gelu, &[x], 1);
        egraph.rebuild();
        assert_eq!(kind_of(&egraph, children[1]), Some(&OpKind::Gelu));
        assert_eq!(kind_of(&egraph, x), None);
        let search = |pattern: &str| {
            let pattern: Pattern<Node> = pattern.parse().expect("parses");
            let matches = pattern.search(&egraph);
            matches.iter().map(|m| m.eclass).collect::<Vec<_>>()
        };
        assert_eq!(search("(gelu#0 ?x ?k)"), gelu);
        assert!(search("(relu#0 ?x ?k)").is_empty());
        assert!(search("(gelu#1 ?x ?k)").is_empty());
        let expr: RecExpr<Node> = "(gelu#0 leaf:0 kind:0)".parse().expect("parses");
        assert_eq!(egraph.lookup_expr(&expr), Some(gelu[0]));
        assert_eq!(expr.to_string(), "(gelu#0 leaf:0 kind:0)");
        assert!("gelu".parse::<OpOutput>().is_err());
        assert!("leaf:0#1".parse::<OpOutput>().is_err());
        assert!("kind:x".parse::<KindId>().is_err());
    }

    #[test]
    fn equal_kinds_and_leaves_intern_to_one_id() {
        let mut encoder = Encoder::default();
        let a = encoder.kind_id(&OpKind::Gelu);
        let b = encoder.kind_id(&OpKind::Relu);
        assert_ne!(a, b);
        assert_eq!(encoder.kind_id(&OpKind::Gelu), a);
        assert_eq!(encoder.kind(b), &OpKind::Relu);
        let p = encoder.leaf_id(Role::Param, "w");
        assert_eq!(encoder.leaf_id(Role::Param, "w"), p);
        assert_ne!(encoder.leaf_id(Role::Input, "w"), p);
    }
}
