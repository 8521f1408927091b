//! The passes, in the order they run, each followed by the verifier.

use crate::autodiff::{autodiff, OptimizerConfig};
use crate::error::Result;
use protrain_ir::verify::verify_graph;
use protrain_ir::Graph;

/// Runs the passes from a forward graph to the training graph: autodiff (forward + backward +
/// optimizer). The verifier runs on the result.
pub fn training_graph(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    verify_graph(forward)?;
    let graph = autodiff(forward, optimizer)?;
    verify_graph(&graph)?;
    Ok(graph)
}
