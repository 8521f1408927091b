//! What fusion reports: the fusions applied, those rejected and why, and how saturation went.

use serde::Serialize;
use std::fmt::Write as _;

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
