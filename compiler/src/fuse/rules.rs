//! The fusion rewrites: egg patterns over the dataflow language and the applier that adds each
//! fused form.

use super::encode::{Candidate, Context};
use crate::egraph::{self, Node, OpOutput};
use egg::{Applier, EGraph, Id, Pattern, PatternAst, Rewrite, Subst, Symbol, Var};
use protrain_ir::{Epilogue, OpKind, WeightLayout};

/// The forms the rewrites make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// Linears of one input into one op.
    Group,
    /// A linear and its activation.
    Activation(Epilogue),
    /// A two-projection group and swiglu.
    Swiglu,
    /// A linear and the add of a residual (either operand of `add`: a float sum is the same
    /// bits both ways).
    Residual,
}

/// The applier of every rewrite: adds the fused form's outputs and unions each with the
/// class of the value it computes.
struct Fuse {
    /// The rule the report names.
    rule: &'static str,
    /// What it makes.
    form: Form,
    /// Whether the linears it fuses have biases.
    bias: bool,
}

/// The pattern variable `name`.
fn var(name: &str) -> Var {
    name.parse().expect("variable names are valid")
}

impl Applier<Node, Context> for Fuse {
    fn apply_one(
        &self,
        egraph: &mut EGraph<Node, Context>,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<Node>>,
        _rule_name: Symbol,
    ) -> Vec<Id> {
        let get = |name: &str| subst[var(name)];
        let (x, k) = (get("?x"), get("?k"));
        let Some(kind) = egraph::kind_of(egraph, k).cloned() else {
            return vec![];
        };
        let (layout, bias) = match kind {
            OpKind::Linear { bias, layout } => (layout, bias),
            OpKind::FusedLinear {
                count: 2,
                bias,
                layout,
                epilogue: Epilogue::None,
            } if self.form == Form::Swiglu => (layout, bias),
            _ => return vec![],
        };
        debug_assert_eq!(bias, self.bias);
        match self.form {
            Form::Group => self.group(egraph, x, k, OpOutput::of(&kind, 0), layout),
            Form::Activation(epilogue) => {
                let w = get("?w");
                let mut inner = vec![x, w];
                let mut children = vec![x, w];
                if bias {
                    inner.push(get("?b"));
                    children.push(get("?b"));
                }
                inner.push(k);
                let Some(h) = egraph.lookup(egraph::output(&kind, 0, inner)) else {
                    return vec![];
                };
                let fused = OpKind::FusedLinear {
                    count: 1,
                    bias,
                    layout,
                    epilogue,
                };
                self.add_fused(egraph, fused, children, &[h, eclass], &[h, eclass])
            }
            Form::Residual => {
                let (w, r) = (get("?w"), get("?r"));
                let mut inner = vec![x, w];
                let mut children = vec![x, w];
                if bias {
                    inner.push(get("?b"));
                    children.push(get("?b"));
                }
                inner.push(k);
                children.push(r);
                let Some(o) = egraph.lookup(egraph::output(&kind, 0, inner)) else {
                    return vec![];
                };
                // The linear's result is not an output of the fused op, so nothing else may
                // read it.
                if !egraph[o].data.single_use {
                    return vec![];
                }
                let fused = OpKind::FusedLinear {
                    count: 1,
                    bias,
                    layout,
                    epilogue: Epilogue::Residual,
                };
                self.add_fused(egraph, fused, children, &[eclass], &[o, eclass])
            }
            Form::Swiglu => {
                let (g, u) = (get("?g"), get("?u"));
                let mut children = vec![x, g, u];
                if bias {
                    children.extend([get("?bg"), get("?bu")]);
                }
                let mut group_children = children.clone();
                group_children.push(k);
                let gate = egraph.lookup(egraph::output(&kind, 0, group_children.clone()));
                let up = egraph.lookup(egraph::output(&kind, 1, group_children));
                let (Some(gate), Some(up)) = (gate, up) else {
                    return vec![];
                };
                let fused = OpKind::FusedLinear {
                    count: 2,
                    bias,
                    layout,
                    epilogue: Epilogue::Swiglu,
                };
                self.add_fused(
                    egraph,
                    fused,
                    children,
                    &[gate, up, eclass],
                    &[gate, up, eclass],
                )
            }
        }
    }
}

impl Fuse {
    /// Every linear (output node `linear`) reading `x` with kind `k` (same layout and bias), in
    /// the order the graph first reads their weights, as one op. The linears are found among
    /// the parents of `x`'s class, not by a scan of the e-graph.
    fn group(
        &self,
        egraph: &mut EGraph<Node, Context>,
        x: Id,
        k: Id,
        linear: OpOutput,
        layout: WeightLayout,
    ) -> Vec<Id> {
        let arity = if self.bias { 4 } else { 3 };
        let (x, k) = (egraph.find(x), egraph.find(k));
        // (first reader of the weight, class, children) of each linear reading `x`.
        let mut found: Vec<(usize, Id, Vec<Id>)> = Vec::new();
        for parent in egraph[x].parents() {
            let Node::Output(op, c) = egraph.id_to_node(parent) else {
                continue;
            };
            if *op != linear
                || c.len() != arity
                || egraph.find(c[0]) != x
                || egraph.find(c[arity - 1]) != k
            {
                continue;
            }
            let c: Vec<Id> = c.iter().map(|&id| egraph.find(id)).collect();
            let position = egraph
                .analysis
                .first_reader
                .get(&c[1])
                .copied()
                .unwrap_or(usize::MAX);
            found.push((position, egraph.find(parent), c));
        }
        // One linear per weight; the parent list can name a node twice.
        found.sort();
        let mut members: Vec<(usize, Id, Vec<Id>)> = Vec::new();
        for member in found {
            if members.iter().all(|(_, _, m)| m[1] != member.2[1]) {
                members.push(member);
            }
        }
        if members.len() < 2 {
            return vec![];
        }
        let mut children = vec![x];
        children.extend(members.iter().map(|(_, _, c)| c[1]));
        if self.bias {
            children.extend(members.iter().map(|(_, _, c)| c[2]));
        }
        let classes: Vec<Id> = members.iter().map(|(_, class, _)| *class).collect();
        let fused = OpKind::FusedLinear {
            count: members.len() as u64,
            bias: self.bias,
            layout,
            epilogue: Epilogue::None,
        };
        self.add_fused(egraph, fused, children, &classes, &classes)
    }

    /// Adds the outputs of `kind` over `children` (the kind leaf is appended), unions output
    /// `i` with `equal[i]`, and records the candidate covering the original ops of `covered`.
    fn add_fused(
        &self,
        egraph: &mut EGraph<Node, Context>,
        kind: OpKind,
        mut children: Vec<Id>,
        equal: &[Id],
        covered: &[Id],
    ) -> Vec<Id> {
        let covers = egraph.analysis.ops_in(egraph, covered);
        let kind_id = egraph.analysis.encoder.kind_id(&kind);
        children.push(egraph.add(Node::Kind(kind_id)));
        let mut changed = Vec::new();
        for (i, &class) in equal.iter().enumerate() {
            let node = egraph.add(egraph::output(&kind, i, children.clone()));
            if egraph.union(node, class) {
                changed.push(egraph.find(class));
            }
        }
        egraph.analysis.candidates.push(Candidate {
            rule: self.rule,
            kind: kind_id,
            children,
            covers,
        });
        changed
    }
}

/// The rewrites, each with its name.
pub(super) fn rules() -> Vec<Rewrite<Node, Context>> {
    let mut rules = Vec::new();
    let mut rule = |name: &'static str, rule: &'static str, pattern: &str, form: Form, bias| {
        let pattern: Pattern<Node> = pattern.parse().expect("the patterns parse");
        rules.push(
            Rewrite::new(name, pattern, Fuse { rule, form, bias })
                .expect("every applier variable is bound"),
        );
    };
    rule("group", "group", "(linear#0 ?x ?w ?k)", Form::Group, false);
    rule(
        "group-bias",
        "group",
        "(linear#0 ?x ?w ?b ?k)",
        Form::Group,
        true,
    );
    for (act, epilogue) in [("gelu", Epilogue::Gelu), ("relu", Epilogue::Relu)] {
        let (plain, with_bias) = match act {
            "gelu" => ("gelu", "gelu-bias"),
            _ => ("relu", "relu-bias"),
        };
        rule(
            plain,
            plain,
            &format!("({act}#0 (linear#0 ?x ?w ?k) ?a)"),
            Form::Activation(epilogue),
            false,
        );
        rule(
            with_bias,
            plain,
            &format!("({act}#0 (linear#0 ?x ?w ?b ?k) ?a)"),
            Form::Activation(epilogue),
            true,
        );
    }
    rule(
        "swiglu",
        "swiglu",
        "(swiglu#0 (fused_linear#0 ?x ?g ?u ?k) (fused_linear#1 ?x ?g ?u ?k) ?s)",
        Form::Swiglu,
        false,
    );
    rule(
        "swiglu-bias",
        "swiglu",
        "(swiglu#0 (fused_linear#0 ?x ?g ?u ?bg ?bu ?k) (fused_linear#1 ?x ?g ?u ?bg ?bu ?k) ?s)",
        Form::Swiglu,
        true,
    );
    for (name, pattern, bias) in [
        ("residual", "(add#0 ?r (linear#0 ?x ?w ?k) ?a)", false),
        (
            "residual-second",
            "(add#0 (linear#0 ?x ?w ?k) ?r ?a)",
            false,
        ),
        (
            "residual-bias",
            "(add#0 ?r (linear#0 ?x ?w ?b ?k) ?a)",
            true,
        ),
        (
            "residual-bias-second",
            "(add#0 (linear#0 ?x ?w ?b ?k) ?r ?a)",
            true,
        ),
    ] {
        rule(name, "residual", pattern, Form::Residual, bias);
    }
    rules
}
