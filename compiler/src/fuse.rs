//! Fusion: equality saturation over the forward graph, before autodiff.
//!
//! The forward graph goes into an e-graph (egg): each op output is a node `mnemonic#i` whose
//! children are its inputs' e-classes and, last, a leaf naming the op's kind with all its
//! attributes; values without a producer (token ids, parameters) are leaves. Rewrites add the
//! fused forms of [`OpKind::FusedLinear`] and union each of its outputs with the value it
//! computes:
//!
//! - `group`: linears of one input with the same layout and bias become one op with `count`
//!   projections (LLaMA's q/k/v and gate/up, OPT's q/k/v);
//! - `gelu`, `relu`: an activation of a linear becomes its epilogue;
//! - `swiglu`: `swiglu` of a two-projection group's outputs becomes its epilogue, so gate/up and
//!   the activation are one op;
//! - `residual`: `add` of a linear and another value becomes a residual epilogue, when nothing
//!   else reads the linear's result.
//!
//! Rewrites compose (`swiglu` applies to what `group` made), and the runner stops at
//! saturation or at the node, iteration or time limit, whichever comes first.
//!
//! Extraction is costed by the cost model and DAG-aware: every fused node the e-graph holds is a
//! candidate replacing the original ops whose values it computes, priced as its forward plus
//! backward time against theirs. Candidates are taken by saving, largest first, skipping any
//! that overlaps one already taken, is not faster, or would drop a value something else reads.
//! (egg's tree extractor would count a value once per reader, which doubles per layer along the
//! residual stream, and cannot price an op with several outputs once.)
//!
//! Fused ops compute each projection and epilogue with the unfused kinds' kernels, in the
//! order autodiff would sum the separate contributions, so a fused graph trains bit for bit
//! as the unfused one on the host. The IR has no cast op (a dtype is how a value is stored;
//! kernels compute in f32), so there is no cast to cancel.

use crate::autodiff::{vjp_rule, Saved};
use crate::cost::CostModel;
use crate::error::{CompileError, Result};
use egg::{
    Analysis, Applier, DidMerge, EGraph, Id, Pattern, PatternAst, Rewrite, Runner, SimpleScheduler,
    StopReason, Subst, Symbol, SymbolLang, Var,
};
use protrain_ir::{
    DType, Epilogue, Graph, Op, OpId, OpKind, Phase, Role, TensorType, ValueId, WeightLayout,
};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Bounds on equality saturation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FuseLimits {
    /// Most e-nodes.
    pub nodes: usize,
    /// Most rewrite iterations.
    pub iterations: usize,
    /// Most wall-clock time.
    pub time: Duration,
}

impl Default for FuseLimits {
    /// 200,000 nodes, 16 iterations, 10 seconds: the presets saturate in 3 iterations with a
    /// few thousand nodes (llama-2-70b: about 9,000).
    fn default() -> Self {
        Self {
            nodes: 200_000,
            iterations: 16,
            time: Duration::from_secs(10),
        }
    }
}

/// One fusion applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fusion {
    /// The rewrite that found it.
    pub rule: String,
    /// The fused op as the printer writes it, e.g. `fused_linear[count=3]`.
    pub op: String,
    /// Its outputs' names.
    pub outputs: Vec<String>,
    /// The ops it replaces, as `mnemonic -> first output name`.
    pub replaces: Vec<String>,
    /// Predicted forward + backward seconds of the replaced ops.
    pub seconds_before: f64,
    /// Predicted forward + backward seconds of the fused op.
    pub seconds_after: f64,
}

/// What fusion found, chose and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FuseReport {
    /// Ops in the forward graph before and after.
    pub ops_before: usize,
    /// Ops after fusion.
    pub ops_after: usize,
    /// Predicted forward + backward seconds of every op before (one execution each).
    pub seconds_before: f64,
    /// The same after fusion.
    pub seconds_after: f64,
    /// The fusions applied, in graph order.
    pub fusions: Vec<Fusion>,
    /// Fused forms found but not applied, with the reason, counted: `(reason, count)`.
    pub rejected: Vec<(String, usize)>,
    /// Saturation iterations run.
    pub iterations: usize,
    /// E-nodes at the end.
    pub egraph_nodes: usize,
    /// E-classes at the end.
    pub egraph_classes: usize,
    /// Why saturation stopped: `saturated`, or the limit reached.
    pub stop_reason: String,
    /// Wall-clock seconds of the whole pass.
    pub seconds: f64,
}

impl FuseReport {
    /// The report for people: totals, then one line per fusion kind. It holds no wall-clock
    /// time, so a schedule's header (which carries it) is the same on every compile.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "fusion: {} -> {} forward ops, predicted forward+backward {:.3} ms -> {:.3} ms ({:+.1}%)",
            self.ops_before,
            self.ops_after,
            self.seconds_before * 1e3,
            self.seconds_after * 1e3,
            if self.seconds_before > 0.0 {
                (self.seconds_after / self.seconds_before - 1.0) * 100.0
            } else {
                0.0
            }
        );
        let _ = writeln!(
            out,
            "e-graph: {} nodes, {} classes, {} iterations, stopped: {}",
            self.egraph_nodes, self.egraph_classes, self.iterations, self.stop_reason
        );
        let mut by_rule: Vec<(&str, &str, usize, f64)> = Vec::new();
        for f in &self.fusions {
            let saved = f.seconds_before - f.seconds_after;
            match by_rule
                .iter_mut()
                .find(|(rule, op, ..)| *rule == f.rule && *op == f.op)
            {
                Some(entry) => {
                    entry.2 += 1;
                    entry.3 += saved;
                }
                None => by_rule.push((&f.rule, &f.op, 1, saved)),
            }
        }
        for (rule, op, count, saved) in by_rule {
            let _ = writeln!(
                out,
                "  {rule:<9} {count:>4} x {op}, saves {:.3} ms",
                saved * 1e3
            );
        }
        for (reason, count) in &self.rejected {
            let _ = writeln!(out, "  not applied: {count} ({reason})");
        }
        out
    }
}

/// A fused form a rewrite added: its kind, children (classes, the kind leaf last) and the
/// original ops whose values its outputs are equal to or consume.
#[derive(Clone, Debug)]
struct Candidate {
    rule: &'static str,
    kind: OpKind,
    children: Vec<Id>,
    covers: BTreeSet<usize>,
}

/// The e-graph analysis: the type of each class's value, and what the rewrites need to know
/// about the original graph.
#[derive(Default)]
struct Context {
    /// Types of the leaves that are values.
    leaf_types: HashMap<Symbol, TensorType>,
    /// The kind each kind leaf names.
    kinds: HashMap<Symbol, OpKind>,
    /// For each original op, in graph order, its outputs' classes as added.
    op_classes: Vec<Vec<Id>>,
    /// Classes of original values read by exactly one op and not a graph output.
    single_use: Vec<Id>,
    /// Position of the op that first reads each weight leaf.
    first_reader: HashMap<Id, usize>,
    /// Every fused form added, duplicates included.
    candidates: Vec<Candidate>,
}

impl Context {
    /// The original ops with an output in any of `classes`.
    fn ops_in(&self, egraph: &EGraph<SymbolLang, Context>, classes: &[Id]) -> BTreeSet<usize> {
        let wanted: HashSet<Id> = classes.iter().map(|&c| egraph.find(c)).collect();
        self.op_classes
            .iter()
            .enumerate()
            .filter(|(_, outs)| outs.iter().any(|&c| wanted.contains(&egraph.find(c))))
            .map(|(p, _)| p)
            .collect()
    }
}

impl Analysis<SymbolLang> for Context {
    type Data = Option<TensorType>;

    fn make(egraph: &mut EGraph<SymbolLang, Self>, enode: &SymbolLang) -> Self::Data {
        let Some((&kind_leaf, inputs)) = enode.children.split_last() else {
            return egraph.analysis.leaf_types.get(&enode.op).cloned();
        };
        let kind = kind_of(egraph, kind_leaf)?;
        let output: usize = enode.op.as_str().rsplit_once('#')?.1.parse().ok()?;
        let types: Option<Vec<TensorType>> =
            inputs.iter().map(|&c| egraph[c].data.clone()).collect();
        let types = types?;
        let refs: Vec<&TensorType> = types.iter().collect();
        kind.infer(&refs).ok()?.into_iter().nth(output)
    }

    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        match (a.is_none(), b) {
            (true, Some(b)) => {
                *a = Some(b);
                DidMerge(true, false)
            }
            (false, Some(_)) => DidMerge(false, false),
            (_, None) => DidMerge(false, a.is_some()),
        }
    }
}

/// The kind a kind-leaf class names.
fn kind_of(egraph: &EGraph<SymbolLang, Context>, class: Id) -> Option<OpKind> {
    let leaf = egraph[class].nodes.first()?;
    egraph.analysis.kinds.get(&leaf.op).cloned()
}

/// Adds the leaf naming `kind`.
fn add_kind(egraph: &mut EGraph<SymbolLang, Context>, kind: &OpKind) -> Id {
    let symbol = Symbol::from(format!("kind:{kind:?}"));
    egraph.analysis.kinds.insert(symbol, kind.clone());
    egraph.add(SymbolLang::leaf(symbol))
}

/// The node for output `i` of an op called `mnemonic`.
fn output_node(mnemonic: &str, i: usize, children: Vec<Id>) -> SymbolLang {
    SymbolLang::new(format!("{mnemonic}#{i}"), children)
}

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
    rule: &'static str,
    form: Form,
    bias: bool,
}

fn var(name: &str) -> Var {
    name.parse().expect("variable names are valid")
}

impl Applier<SymbolLang, Context> for Fuse {
    fn apply_one(
        &self,
        egraph: &mut EGraph<SymbolLang, Context>,
        eclass: Id,
        subst: &Subst,
        _searcher_ast: Option<&PatternAst<SymbolLang>>,
        _rule_name: Symbol,
    ) -> Vec<Id> {
        let get = |name: &str| subst[var(name)];
        let (x, k) = (get("?x"), get("?k"));
        let Some(kind) = kind_of(egraph, k) else {
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
            Form::Group => self.group(egraph, x, k, layout),
            Form::Activation(epilogue) => {
                let w = get("?w");
                let mut inner = vec![x, w];
                let mut children = vec![x, w];
                if bias {
                    inner.push(get("?b"));
                    children.push(get("?b"));
                }
                inner.push(k);
                let Some(h) = egraph.lookup(SymbolLang::new("linear#0", inner)) else {
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
                let Some(o) = egraph.lookup(SymbolLang::new("linear#0", inner)) else {
                    return vec![];
                };
                // The linear's result is not an output of the fused op, so nothing else may
                // read it.
                let o_root = egraph.find(o);
                if !egraph
                    .analysis
                    .single_use
                    .iter()
                    .any(|&c| egraph.find(c) == o_root)
                {
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
                let gate = egraph.lookup(output_node("fused_linear", 0, group_children.clone()));
                let up = egraph.lookup(output_node("fused_linear", 1, group_children));
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
    /// Every linear reading `x` with kind `k` (same layout and bias), in the order the graph
    /// first reads their weights, as one op.
    fn group(
        &self,
        egraph: &mut EGraph<SymbolLang, Context>,
        x: Id,
        k: Id,
        layout: WeightLayout,
    ) -> Vec<Id> {
        let arity = if self.bias { 4 } else { 3 };
        let (x, k) = (egraph.find(x), egraph.find(k));
        let mut members: Vec<(usize, Id, Vec<Id>)> = Vec::new();
        for class in egraph.classes() {
            for node in &class.nodes {
                let c = &node.children;
                if node.op.as_str() != "linear#0"
                    || c.len() != arity
                    || egraph.find(c[0]) != x
                    || egraph.find(c[arity - 1]) != k
                {
                    continue;
                }
                let position = egraph
                    .analysis
                    .first_reader
                    .get(&egraph.find(c[1]))
                    .copied()
                    .unwrap_or(usize::MAX);
                if members.iter().all(|(_, _, m)| m[1] != c[1]) {
                    members.push((position, class.id, c.clone()));
                }
            }
        }
        if members.len() < 2 {
            return vec![];
        }
        members.sort_by_key(|(position, class, _)| (*position, *class));
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
        egraph: &mut EGraph<SymbolLang, Context>,
        kind: OpKind,
        mut children: Vec<Id>,
        equal: &[Id],
        covered: &[Id],
    ) -> Vec<Id> {
        let covers = egraph.analysis.ops_in(egraph, covered);
        children.push(add_kind(egraph, &kind));
        let mut changed = Vec::new();
        for (i, &class) in equal.iter().enumerate() {
            let node = egraph.add(output_node(kind.mnemonic(), i, children.clone()));
            if egraph.union(node, class) {
                changed.push(egraph.find(class));
            }
        }
        egraph.analysis.candidates.push(Candidate {
            rule: self.rule,
            kind,
            children,
            covers,
        });
        changed
    }
}

/// The rewrites, each with its name.
fn rules() -> Vec<Rewrite<SymbolLang, Context>> {
    let mut rules = Vec::new();
    let mut rule = |name: &'static str, rule: &'static str, pattern: &str, form: Form, bias| {
        let pattern: Pattern<SymbolLang> = pattern.parse().expect("the patterns parse");
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

/// Fuses a forward graph: saturates with the rewrites under `limits`, then applies the
/// fusions the cost model says are faster. Returns the fused graph (verified) and the report.
pub fn fuse(
    forward: &Graph,
    cost: &dyn CostModel,
    limits: &FuseLimits,
) -> Result<(Graph, FuseReport)> {
    let start = Instant::now();
    let (egraph, class) = encode(forward);
    let runner = saturate(egraph, limits);
    let stop_reason = match &runner.stop_reason {
        Some(StopReason::Saturated) => "saturated".to_string(),
        Some(StopReason::IterationLimit(n)) => format!("iteration limit {n}"),
        Some(StopReason::NodeLimit(n)) => format!("node limit {n}"),
        Some(StopReason::TimeLimit(s)) => format!("time limit {s:.1} s"),
        Some(StopReason::Other(why)) => why.clone(),
        None => "not run".to_string(),
    };
    let iterations = runner.iterations.len();
    let mut egraph = runner.egraph;
    let ops: Vec<(OpId, &Op)> = forward.ops().collect();

    // Price the original ops.
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
        if let Some(c) = class[id.index()] {
            value_of.entry(egraph.find(c)).or_insert(id);
        }
    }

    // Candidates, each once, with their saving; then the selection.
    let mut seen: HashSet<(String, Vec<Id>)> = HashSet::new();
    let mut priced: Vec<Priced> = Vec::new();
    let mut rejected: HashMap<&'static str, usize> = HashMap::new();
    for candidate in &egraph.analysis.candidates {
        let children: Vec<Id> = candidate.children.iter().map(|&c| egraph.find(c)).collect();
        if !seen.insert((format!("{:?}", candidate.kind), children.clone())) {
            continue;
        }
        let priced_one = price(
            forward,
            &ops,
            &egraph,
            candidate,
            &children,
            &value_of,
            (cost, &op_seconds),
        );
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

    let graph = rebuild(forward, &ops, &taken)?;
    protrain_ir::verify::verify_graph(&graph)?;
    // Translation validation: the fused graph, added to the saturated e-graph, must compute
    // its outputs in the original outputs' classes.
    let differing = differing_outputs(&mut egraph, forward, &class, &graph);
    if !differing.is_empty() {
        return Err(CompileError::Validation(format!(
            "fusion changed {}",
            differing.join(", ")
        )));
    }
    taken.sort_by_key(|p| p.anchor);
    let name = |v: ValueId| forward.value(v).name.clone();
    let fusions = taken
        .iter()
        .map(|p| Fusion {
            rule: p.rule.to_string(),
            op: print_kind(&p.kind),
            outputs: p.outputs.iter().map(|&v| name(v)).collect(),
            replaces: p
                .covers
                .iter()
                .map(|&c| {
                    let op = ops[c].1;
                    format!("{} -> {}", op.kind.mnemonic(), name(op.outputs[0]))
                })
                .collect(),
            seconds_before: p.before,
            seconds_after: p.after,
        })
        .collect();
    let saved: f64 = taken.iter().map(|p| p.before - p.after).sum();
    let seconds_before: f64 = op_seconds.iter().sum();
    let mut rejected: Vec<(String, usize)> = rejected
        .into_iter()
        .map(|(why, n)| (why.to_string(), n))
        .collect();
    rejected.sort();
    let report = FuseReport {
        ops_before: forward.op_count(),
        ops_after: graph.op_count(),
        seconds_before,
        seconds_after: seconds_before - saved,
        fusions,
        rejected,
        iterations,
        egraph_nodes: egraph.total_number_of_nodes(),
        egraph_classes: egraph.number_of_classes(),
        stop_reason,
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((graph, report))
}

/// Puts the forward graph into a new e-graph: the class of each value, and the context the
/// rewrites read.
fn encode(forward: &Graph) -> (EGraph<SymbolLang, Context>, Vec<Option<Id>>) {
    let mut egraph: EGraph<SymbolLang, Context> = EGraph::new(Context::default());
    let mut class: Vec<Option<Id>> = vec![None; forward.values().len()];
    for (id, value) in forward.values() {
        if value.producer.is_none() {
            let symbol = Symbol::from(format!("value:{}", id.index()));
            egraph.analysis.leaf_types.insert(symbol, value.ty.clone());
            class[id.index()] = Some(egraph.add(SymbolLang::leaf(symbol)));
        }
    }
    for (position, (_, op)) in forward.ops().enumerate() {
        let mut children: Vec<Id> = op
            .inputs
            .iter()
            .map(|v| class[v.index()].expect("a value is defined before it is read"))
            .collect();
        for &w in op.inputs.iter().skip(1) {
            if forward.value(w).role == Role::Param {
                let leaf = class[w.index()].expect("parameters are leaves");
                egraph.analysis.first_reader.entry(leaf).or_insert(position);
            }
        }
        children.push(add_kind(&mut egraph, &op.kind));
        let mut outs = Vec::new();
        for (i, &out) in op.outputs.iter().enumerate() {
            let c = egraph.add(output_node(op.kind.mnemonic(), i, children.clone()));
            class[out.index()] = Some(c);
            outs.push(c);
            if forward.users(out).len() == 1 && !forward.outputs().contains(&out) {
                egraph.analysis.single_use.push(c);
            }
        }
        egraph.analysis.op_classes.push(outs);
    }
    egraph.rebuild();
    (egraph, class)
}

/// Runs the rewrites until saturation or a limit.
fn saturate(
    egraph: EGraph<SymbolLang, Context>,
    limits: &FuseLimits,
) -> Runner<SymbolLang, Context> {
    Runner::default()
        .with_egraph(egraph)
        .with_scheduler(SimpleScheduler)
        .with_node_limit(limits.nodes)
        .with_iter_limit(limits.iterations)
        .with_time_limit(limits.time)
        .run(&rules())
}

/// Adds `fused` to the e-graph of `forward` (whose values are in `class`), its leaves matched
/// to the forward graph's by name, and returns the names of the graph outputs (the loss) that
/// land in another class than the forward graph's.
fn differing_outputs(
    egraph: &mut EGraph<SymbolLang, Context>,
    forward: &Graph,
    class: &[Option<Id>],
    fused: &Graph,
) -> Vec<String> {
    let leaves: HashMap<(&str, Role), Id> = forward
        .values()
        .filter(|(_, v)| v.producer.is_none())
        .filter_map(|(id, v)| Some(((v.name.as_str(), v.role), class[id.index()]?)))
        .collect();
    let mut fused_class: Vec<Option<Id>> = vec![None; fused.values().len()];
    for (id, value) in fused.values() {
        if value.producer.is_none() {
            fused_class[id.index()] = leaves.get(&(value.name.as_str(), value.role)).copied();
        }
    }
    for (_, op) in fused.ops() {
        let children: Option<Vec<Id>> = op.inputs.iter().map(|v| fused_class[v.index()]).collect();
        let Some(mut children) = children else {
            continue;
        };
        children.push(add_kind(egraph, &op.kind));
        for (i, &out) in op.outputs.iter().enumerate() {
            let c = egraph.add(output_node(op.kind.mnemonic(), i, children.clone()));
            fused_class[out.index()] = Some(c);
        }
    }
    egraph.rebuild();
    let mut differing = Vec::new();
    if forward.outputs().len() != fused.outputs().len() {
        differing.push("the number of graph outputs".to_string());
    }
    for (&want, &got) in forward.outputs().iter().zip(fused.outputs()) {
        let same = match (class[want.index()], fused_class[got.index()]) {
            (Some(a), Some(b)) => egraph.find(a) == egraph.find(b),
            _ => false,
        };
        if !same {
            differing.push(forward.value(want).name.clone());
        }
    }
    differing
}

/// Checks that `fused` computes what `forward` computes, by the fusion rewrites: both go into
/// one e-graph, saturated under `limits`, and every graph output (the loss) must land in one
/// class. Returns the names of the outputs that do not. [`fuse`] runs the same check on its
/// own result; this entry point is for graphs fused or edited elsewhere, and for tests.
pub fn validate_fused(forward: &Graph, fused: &Graph, limits: &FuseLimits) -> Vec<String> {
    let (egraph, class) = encode(forward);
    let mut egraph = saturate(egraph, limits).egraph;
    differing_outputs(&mut egraph, forward, &class, fused)
}

/// A candidate with its operands resolved to original values and its price.
#[derive(Clone, Debug)]
struct Priced {
    rule: &'static str,
    kind: OpKind,
    inputs: Vec<ValueId>,
    outputs: Vec<ValueId>,
    covers: BTreeSet<usize>,
    /// The first covered op: where the fused op goes in graph order.
    anchor: usize,
    before: f64,
    after: f64,
}

/// Resolves a candidate to original values and prices it, or says why it cannot be applied.
/// `prices` is the cost model and the original ops' prices.
fn price(
    forward: &Graph,
    ops: &[(OpId, &Op)],
    egraph: &EGraph<SymbolLang, Context>,
    candidate: &Candidate,
    children: &[Id],
    value_of: &HashMap<Id, ValueId>,
    prices: (&dyn CostModel, &[f64]),
) -> std::result::Result<Priced, &'static str> {
    let (cost, op_seconds) = prices;
    const UNRESOLVED: &str = "an operand is not a value of the graph";
    let (_, operands) = children.split_last().ok_or(UNRESOLVED)?;
    let inputs: Vec<ValueId> = operands
        .iter()
        .map(|c| value_of.get(c).copied())
        .collect::<Option<_>>()
        .ok_or(UNRESOLVED)?;
    let types: Vec<&TensorType> = inputs.iter().map(|&v| &forward.value(v).ty).collect();
    let outputs_len = candidate
        .kind
        .infer(&types)
        .map_err(|_| "its operands do not fit it")?
        .len();
    let mut outputs = Vec::with_capacity(outputs_len);
    for i in 0..outputs_len {
        let node = output_node(candidate.kind.mnemonic(), i, children.to_vec());
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
                || forward
                    .users(v)
                    .iter()
                    .any(|u| !covers.contains(&u.index()));
            if outside {
                return Err("an intermediate value is read by other ops");
            }
        }
    }
    Ok(Priced {
        rule: candidate.rule,
        kind: candidate.kind.clone(),
        inputs,
        outputs,
        covers: covers.clone(),
        anchor,
        before: covers.iter().map(|&c| op_seconds[c]).sum(),
        after: step_seconds(cost, &candidate.kind, &types),
    })
}

/// The op as the printer writes it: mnemonic and attributes.
fn print_kind(kind: &OpKind) -> String {
    let attrs: Vec<String> = kind
        .attributes()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if attrs.is_empty() {
        kind.mnemonic().to_string()
    } else {
        format!("{}[{}]", kind.mnemonic(), attrs.join(","))
    }
}

/// The forward graph with each taken fusion's ops replaced by its fused op, in the original
/// order where dependencies allow (a fused op goes where its first covered op was).
fn rebuild(forward: &Graph, ops: &[(OpId, &Op)], taken: &[Priced]) -> Result<Graph> {
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
