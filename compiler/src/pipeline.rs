//! The passes, in the order they run, each followed by the verifier.
//!
//! forward graph -> fuse -> autodiff -> training graph -> chunk -> place(policy) -> streams -> plan ->
//! emit -> Schedule. `search` runs `place..emit` for many policies. `validate` (translation
//! validation of placement) runs after `place` in tests and debug builds.

use crate::autodiff::{autodiff, OptimizerConfig};
use crate::chunk::chunk;
use crate::cost::CostModel;
use crate::emit::{emit, HeaderInputs};
use crate::error::Result;
use crate::fuse::{fuse, FuseLimits, FuseReport};
use crate::place::place;
use crate::plan::plan_buffers;
use crate::streams::streams;
use protrain_ir::verify::verify_graph;
use protrain_ir::verify_schedule::verify_schedule;
use protrain_ir::{ChunkTable, Graph, Policy, Schedule};

/// Fuses a forward graph under a cost model (see [`crate::fuse`]); the verifier runs before
/// and after.
pub fn fused(
    forward: &Graph,
    cost: &dyn CostModel,
    limits: &FuseLimits,
) -> Result<(Graph, FuseReport)> {
    verify_graph(forward)?;
    let (graph, report) = fuse(forward, cost, limits)?;
    verify_graph(&graph)?;
    Ok((graph, report))
}

/// Runs the passes from a forward graph to the training graph: autodiff (forward + backward +
/// optimizer). The verifier runs on the result.
pub fn training_graph(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    verify_graph(forward)?;
    let graph = autodiff(forward, optimizer)?;
    verify_graph(&graph)?;
    Ok(graph)
}

/// Chunks a training graph's parameters (one rank).
pub fn chunked(training: &Graph) -> ChunkTable {
    chunk(training, 1)
}

/// Compiles a training graph under one policy: place, streams, plan, emit. The placed graph
/// is verified after placement and, in tests and debug builds, validated against the training
/// graph with an e-graph, and the schedule verified after emission
/// (callers that publish a schedule verify it themselves); its step time is left for the
/// simulator.
pub fn compile_policy(
    training: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    header: HeaderInputs,
) -> Result<Schedule> {
    let placed = place(training, chunks, policy)?;
    verify_graph(&placed.graph)?;
    if cfg!(debug_assertions) {
        let v = crate::validate::validate(training, &placed.graph);
        if !v.holds() {
            return Err(crate::error::CompileError::Validation(format!(
                "placement under {policy} changed {}",
                v.differing.join(", ")
            )));
        }
    }
    let mut streamed = streams(placed)?;
    let planned = plan_buffers(&mut streamed);
    let schedule = emit(streamed, &planned, header);
    if cfg!(debug_assertions) {
        verify_schedule(&schedule)?;
    }
    Ok(schedule)
}
