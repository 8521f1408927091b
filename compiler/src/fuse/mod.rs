//! Fusion: equality saturation over the forward graph, before autodiff.
//!
//! The forward graph goes into an e-graph through the encoder translation validation uses
//! ([`crate::egraph`]): each op output is a node `mnemonic#i` whose children are its inputs'
//! e-classes and, last, the op's kind leaf; values without a producer (token ids, parameters)
//! are leaves. Rewrites (`rules.rs`) add the fused forms of [`OpKind::FusedLinear`] and union
//! each of its outputs with the value it computes:
//!
//! - `group`: linears of one input with the same layout and bias become one op with `count`
//!   projections (LLaMA's q/k/v and gate/up, OPT's q/k/v); extraction applies it only when
//!   nothing else reads that input, since autodiff would otherwise sum the input's gradient
//!   in another association (OLMo 2's projections read the residual stream);
//! - `gelu`, `relu`: an activation of a linear becomes its epilogue;
//! - `swiglu`: `swiglu` of a two-projection group's outputs becomes its epilogue, so gate/up and
//!   the activation are one op;
//! - `residual`: `add` of a linear and another value becomes a residual epilogue, when nothing
//!   else reads the linear's result.
//!
//! Rewrites compose (`swiglu` applies to what `group` made), and the runner stops at
//! saturation or at the node, iteration or time limit, whichever comes first.
//!
//! Extraction (`extract.rs`) is costed by the cost model and DAG-aware: every fused node the
//! e-graph holds is a candidate replacing the original ops whose values it computes, priced as
//! its forward plus backward time against theirs. Candidates are taken by saving, largest
//! first, skipping any that overlaps one already taken, is not faster, or would drop a value
//! something else reads. (egg's tree extractor would count a value once per reader, which
//! doubles per layer along the residual stream, and cannot price an op with several outputs
//! once.) `rebuild.rs` then writes the fused graph, and translation validation adds it to the
//! saturated e-graph: its outputs must land in the forward graph's classes.
//!
//! Fused ops compute each projection and epilogue with the unfused kinds' kernels, in the
//! order autodiff would sum the separate contributions, so a fused graph trains bit for bit
//! as the unfused one on the host. The IR has no cast op (a dtype is how a value is stored;
//! kernels compute in f32), so there is no cast to cancel.
//!
//! [`OpKind::FusedLinear`]: protrain_ir::OpKind::FusedLinear

mod encode;
mod extract;
mod rebuild;
mod report;
mod rules;

pub use report::{FuseReport, Fusion};

use crate::cost::CostModel;
use crate::egraph::{self, Node};
use crate::error::{CompileError, Result};
use egg::{EGraph, Id, Runner, SimpleScheduler, StopReason};
use encode::{encode, Context};
use protrain_ir::{Graph, Op, OpId, OpKind, ValueId};
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
    let stop_reason = stop_reason(&runner.stop_reason);
    let iterations = runner.iterations.len();
    let mut egraph = runner.egraph;
    let ops: Vec<(OpId, &Op)> = forward.ops().collect();

    let extraction = extract::extract(forward, &ops, &egraph, &class, cost);
    let mut taken = extraction.taken;
    let graph = rebuild::rebuild(forward, &ops, &taken)?;
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
    let seconds_before: f64 = extraction.op_seconds.iter().sum();
    let report = FuseReport {
        ops_before: forward.op_count(),
        ops_after: graph.op_count(),
        seconds_before,
        seconds_after: seconds_before - saved,
        fusions,
        rejected: extraction.rejected,
        iterations,
        egraph_nodes: egraph.total_number_of_nodes(),
        egraph_classes: egraph.number_of_classes(),
        stop_reason,
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((graph, report))
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

/// Runs the rewrites until saturation or a limit.
fn saturate(egraph: EGraph<Node, Context>, limits: &FuseLimits) -> Runner<Node, Context> {
    Runner::default()
        .with_egraph(egraph)
        .with_scheduler(SimpleScheduler)
        .with_node_limit(limits.nodes)
        .with_iter_limit(limits.iterations)
        .with_time_limit(limits.time)
        .run(&rules::rules())
}

/// Why saturation stopped, as the report says it.
fn stop_reason(reason: &Option<StopReason>) -> String {
    match reason {
        Some(StopReason::Saturated) => "saturated".to_string(),
        Some(StopReason::IterationLimit(n)) => format!("iteration limit {n}"),
        Some(StopReason::NodeLimit(n)) => format!("node limit {n}"),
        Some(StopReason::TimeLimit(s)) => format!("time limit {s:.1} s"),
        Some(StopReason::Other(why)) => why.clone(),
        None => "not run".to_string(),
    }
}

/// Adds `fused` to the e-graph of `forward` (whose values are in `class`) and returns the
/// names of the graph outputs (the loss) that land in another class than the forward graph's.
/// The encoder names leaves by role and name, so the fused graph's parameters and inputs are
/// the forward graph's leaves.
fn differing_outputs(
    egraph: &mut EGraph<Node, Context>,
    forward: &Graph,
    class: &[Id],
    fused: &Graph,
) -> Vec<String> {
    let fused_class = egraph::add_graph(egraph, fused);
    egraph.rebuild();
    let mut differing = Vec::new();
    if forward.outputs().len() != fused.outputs().len() {
        differing.push("the number of graph outputs".to_string());
    }
    for (&want, &got) in forward.outputs().iter().zip(fused.outputs()) {
        if egraph.find(class[want.index()]) != egraph.find(fused_class[got.index()]) {
            differing.push(forward.value(want).name.clone());
        }
    }
    differing
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
