//! Translation validation: proves with an e-graph (egg) that placement changed no
//! computation.
//!
//! Both graphs go into one e-graph, each op as a node whose operator is its kind with its
//! attributes and whose children are its inputs' e-classes; parameters, inputs and optimizer
//! state are leaves named by their names. Hash-consing and congruence closure then put a
//! recompute clone in its original's e-class (same kind, equal inputs), so if placement is a
//! faithful reordering with recomputation, the loss, every parameter's gradient and every
//! optimizer update of the placed graph land in the same e-classes as the unplaced one's.
//! Movement between memories is not in the graph (the schedule carries it) and needs no rule.
//! It checks what is computed, not when: the schedule verifier checks the order.

use egg::{EGraph, Id, Symbol, SymbolLang};
use protrain_ir::{Graph, OpKind, Role, ValueId};
use std::collections::HashMap;

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

/// Adds a graph to the e-graph and returns the e-class of each of its values.
fn add(egraph: &mut EGraph<SymbolLang, ()>, graph: &Graph) -> Vec<Option<Id>> {
    let mut class: Vec<Option<Id>> = vec![None; graph.values().len()];
    for (id, value) in graph.values() {
        if value.producer.is_none() {
            let leaf = format!("{}:{}", value.role.name(), value.name);
            class[id.index()] = Some(egraph.add(SymbolLang::leaf(leaf)));
        }
    }
    for (_, op) in graph.ops() {
        let children: Vec<Id> = op
            .inputs
            .iter()
            .map(|v| class[v.index()].expect("inputs come first"))
            .collect();
        let attrs: Vec<String> = op
            .kind
            .attributes()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let base = format!("{}[{}]", op.kind.mnemonic(), attrs.join(","));
        // Each output is its own node: the op applied, projected to the output's position.
        for (i, &out) in op.outputs.iter().enumerate() {
            let node = SymbolLang::new(Symbol::from(format!("{base}#{i}")), children.clone());
            class[out.index()] = Some(egraph.add(node));
        }
        if op.outputs.is_empty() {
            egraph.add(SymbolLang::new(Symbol::from(base), children));
        }
    }
    class
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
    let mut egraph: EGraph<SymbolLang, ()> = EGraph::default();
    let before = add(&mut egraph, training);
    let after = add(&mut egraph, placed);
    egraph.rebuild();
    let (want, got) = (observed(training), observed(placed));
    let mut differing = Vec::new();
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    for name in names {
        let same = got.get(name).is_some_and(|&g| {
            let a = before[want[name].index()].expect("every value has a class");
            let b = after[g.index()].expect("every value has a class");
            egraph.find(a) == egraph.find(b)
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
