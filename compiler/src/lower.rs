//! Lowering one policy: a training graph and its chunk table, under one policy, to an
//! emitted schedule (place, streams, pad rows, plan, emit, accumulate, data-parallel, shard), and, as
//! its last stage where the host region is over its budget, the disk tier ([`disk_tier`]).
//!
//! The pipeline's [`crate::pipeline::Context`] lowers the policy it is given through here, and
//! the searches ([`crate::search`], [`crate::search_forward`]) lower each candidate through
//! here, so the passes after chunking run in one place and neither side imports the other.

use crate::accumulate::accumulate_micro_batches;
use crate::comm::Topology;
use crate::data_parallel::data_parallel;
use crate::emit::{emit, HeaderInputs};
use crate::error::{CompileError, Result};
use crate::interleave::interleave_on;
use crate::pad_rows::pad_rows;
use crate::place::place;
use crate::plan::plan_buffers;
use crate::shard::shard;
use crate::streams::streams;
use protrain_ir::verify::verify_graph;
use protrain_ir::verify_schedule::verify_schedule;
use protrain_ir::{ChunkTable, Graph, MicroBatchOrder, Policy, Schedule};

/// Compiles a training graph under one policy: place, streams, pad rows, plan, emit, and accumulate
/// when the graph's loss gradient is scaled for several micro-batches (in the policy's
/// order: sequential, by [`accumulate_micro_batches`], or chunk-major, by placing the
/// [`interleave_on`]d graph). The placed graph
/// is verified after placement and, in tests and debug builds, validated against the training
/// graph with an e-graph, and the schedule verified after emission. It returns the schedule
/// unverified in release builds: the search compiles many candidates and verifies only the
/// one it keeps ([`crate::pipeline::Context`] does that); its step time is left for the
/// simulator.
pub fn compile_policy(
    training: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    header: HeaderInputs,
) -> Result<Schedule> {
    compile_policy_on(training, chunks, policy, header, Topology::SINGLE)
}

/// [`compile_policy`] for the ranks of `topology`: the schedule every rank runs, with its
/// gradients summed over the ranks ([`data_parallel`], then [`shard`]). The training graph's
/// loss gradient must be scaled for `ranks x K` micro-batches
/// ([`crate::accumulate::scale_loss_gradient`]); each rank accumulates `K` of them.
pub fn compile_policy_on(
    training: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    header: HeaderInputs,
    topology: Topology,
) -> Result<Schedule> {
    let ranks = u64::from(topology.ranks().max(1));
    let global = training.micro_batches();
    if !global.is_multiple_of(ranks) {
        return Err(CompileError::UnevenMicroBatches {
            micro_batches: global,
            ranks,
        });
    }
    // Offloaded chunks are sharded over the ranks where the schedule allows it
    // ([`crate::shard`]); the chunk table says so to the passes that lay out their homes.
    let sharded_chunks;
    let chunks = match crate::shard::shardable(chunks, topology) {
        Ok(()) => {
            sharded_chunks = crate::shard::sharded_table(chunks, topology.ranks());
            &sharded_chunks
        }
        Err(_) => chunks,
    };
    // Chunk-major accumulation runs every micro-batch in one program: the interleaved graph,
    // lowered as a step of one micro-batch (no accumulators, no micro-batch program).
    let per_rank = global / ranks;
    let chunk_major = policy.order == MicroBatchOrder::ChunkMajor && per_rank > 1;
    let interleaved;
    let training = match chunk_major {
        true => {
            interleaved = interleave_on(training, ranks)?;
            &interleaved
        }
        false => training,
    };
    let placed = place(training, chunks, policy)?;
    verify_graph(&placed.graph)?;
    if cfg!(debug_assertions) {
        let miswired = crate::validate::check_gathers(&placed.graph, chunks);
        if !miswired.is_empty() {
            return Err(CompileError::Validation(miswired.join("; ")));
        }
        let v = crate::validate::validate(training, &placed.graph);
        if !v.holds() {
            return Err(CompileError::Validation(format!(
                "placement under {policy} changed {}",
                v.differing.join(", ")
            )));
        }
    }
    let mut streamed = streams(placed, header.flash_attention)?;
    pad_rows(&mut streamed);
    let planned = plan_buffers(&mut streamed);
    let repeats = if chunk_major { 1 } else { per_rank };
    let schedule = accumulate_micro_batches(emit(streamed, &planned, header)?, repeats)?;
    let schedule = shard(data_parallel(schedule, topology)?)?;
    if cfg!(debug_assertions) {
        verify_schedule(&schedule)?;
    }
    Ok(schedule)
}

/// What a lowered schedule's host region must fit, per rank: its host memory and the disk
/// the disk tier may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostBudgets {
    /// Bytes of host memory a rank may use.
    pub host: u64,
    /// Bytes of disk a rank may use; 0 for no disk tier.
    pub disk: u64,
}

/// The last stage of lowering a policy, the disk tier ([`crate::disk`]): where `schedule`'s
/// host region is over `budgets.host`, the optimizer state of the fewest offloaded chunks
/// that brings it within moves to disk. It returns the schedule unchanged when it fits or
/// there is no disk budget, and fails, naming what each tier would need, when even the disk
/// cannot bring it within budget.
pub fn disk_tier(schedule: Schedule, budgets: HostBudgets) -> Result<Schedule> {
    crate::disk::disk(schedule, budgets.host, budgets.disk)
}

/// Lowers one policy to a schedule within `budgets`: [`compile_policy_on`], then
/// [`disk_tier`]. The device budget is the caller's to check (the arena is exact here).
pub fn lower_within(
    training: &Graph,
    chunks: &ChunkTable,
    policy: &Policy,
    header: HeaderInputs,
    topology: Topology,
    budgets: HostBudgets,
) -> Result<Schedule> {
    disk_tier(
        compile_policy_on(training, chunks, policy, header, topology)?,
        budgets,
    )
}
