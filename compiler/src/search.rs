//! Policy search: ranks every placement policy in ProTrain's family by its closed-form step
//! time and a memory estimate, compiles and simulates the most promising, and keeps the
//! fastest whose exact arena fits the device budget and whose host region fits host memory.
//!
//! Like egg's runner, it has explicit budgets and returns data about what it did (a
//! [`SearchReport`]) rather than only a winner. Estimates only rank and prune: every policy
//! it returns was compiled, planned and simulated, so its peak memory is exact.
//!
//! The family holds `chunks x ~3 x (layers + 1)(layers + 2) / 2` policies: 3 million at 128
//! layers, 1.6 billion at 1,024. The search never lists them; it asks for the next few in rank
//! order and answers by branch and bound:
//! - estimates are integer [`Ticks`], so sums do not depend on their order and a sum over the
//!   streamed chunks is a difference of prefix sums, exactly what the per-chunk loop adds up;
//! - the policies that share a block layout `(n_swap, n_checkpoint)` are estimated together,
//!   every `n_persist` and `n_buffer` in one sweep over the chunks;
//! - a layout is swept only when a lower bound on its policies' rank could still beat the
//!   candidates kept so far.
//!
//! The answer is what sorting every policy would give, which the tests check on random
//! profiles against the per-layer loop and a full sort. It does not change what is estimated:
//! ProTrain's formula, per chunk, over ProTrain's interleaved layout.

use crate::comm::{CollectiveKind, Topology};
use crate::cost::{CopyDir, CostModel};
use crate::emit::HeaderInputs;
use crate::error::{CompileError, HostDisk, Result, Shortfall, ShortfallProblem};
use crate::interleave::interleave_on;
use crate::lower::{compile_policy_on, HostBudgets};
use crate::simulate::simulate_unverified;
use protrain_ir::{
    format_bytes, BlockKind, BlockMode, ChunkTable, Graph, HostLayout, MicroBatchOrder, OpKind,
    Phase, Policy, Schedule,
};
use rayon::prelude::*;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::fmt::Write;
use std::marker::PhantomData;
use std::ops::RangeInclusive;

/// Budgets of a search.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Device bytes a schedule may use (device memory less reserved bytes).
    pub device_budget: u64,
    /// Host bytes a schedule may use.
    pub host_budget: u64,
    /// Disk bytes a schedule may use for optimizer state host memory cannot hold (0: none;
    /// see [`crate::disk`]).
    pub disk_budget: u64,
    /// Most candidates compiled and simulated in full.
    pub max_compiled: usize,
    /// The hardware profile's summary, for the header.
    pub hardware: String,
    /// The model's name, for the header.
    pub model: String,
    /// The ranks every candidate runs on ([`Topology::SINGLE`] for one GPU).
    pub topology: Topology,
}

impl SearchOptions {
    /// The host and disk budgets, for the disk tier ([`crate::lower::disk_tier`]).
    pub fn host_budgets(&self) -> HostBudgets {
        HostBudgets {
            host: self.host_budget,
            disk: self.disk_budget,
        }
    }
}

/// One fully compiled candidate.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// The policy.
    pub policy: Policy,
    /// ProTrain's closed-form step time.
    pub estimated_seconds: f64,
    /// The simulated step time.
    pub simulated_seconds: f64,
    /// The exact arena.
    pub peak_device_bytes: u64,
    /// The host region.
    pub host_bytes: u64,
    /// The optimizer state it keeps on disk (see [`crate::disk`]); 0 without a disk tier.
    pub disk_bytes: u64,
    /// What it moves in a step: bytes over PCIe and to and from disk, and FLOPs recomputed
    /// ([`movement_of`]). Among candidates that tie, the least movement wins.
    pub movement: Movement,
    /// Whether it fits both budgets.
    pub fits: bool,
}

/// What the search did.
#[derive(Clone, Debug, Default)]
pub struct SearchReport {
    /// Policies in the family searched.
    pub enumerated: usize,
    /// Block layouts `(n_swap, n_checkpoint)` in the family.
    pub layouts: usize,
    /// Sweeps of a block layout's policies (a layout can be swept once per query): the work
    /// the estimates took, where the other layouts were bounded away.
    pub layouts_swept: usize,
    /// Rejected because the memory estimate exceeded the device budget.
    pub rejected_estimate: usize,
    /// Compiled, but the exact arena exceeded the device budget.
    pub rejected_exact: usize,
    /// Rejected because the host region exceeds host memory.
    pub rejected_host: usize,
    /// Rejected by the compiler (for example too few chunk buffers for an op).
    pub rejected_invalid: usize,
    /// Every fully compiled candidate, fastest first.
    pub compiled: Vec<Candidate>,
    /// With gradient accumulation on one rank, each micro-batch order searched and the
    /// simulated step of its winner (`None`: nothing fits in that order); empty otherwise.
    pub orders: Vec<(MicroBatchOrder, Option<f64>)>,
}

impl SearchReport {
    /// The report before any candidate is compiled: the family's size and how many of its
    /// policies `estimator` puts over `slack` bytes.
    fn counted(estimator: &Estimator<'_>, layouts: &[Layout], slack: u64) -> Self {
        let mut sorted_bytes: Vec<u64> = layouts.iter().map(|l| l.bytes).collect();
        sorted_bytes.par_sort_unstable();
        Self {
            enumerated: estimator.policy_count(layouts.len()),
            layouts: layouts.len(),
            rejected_estimate: estimator.count_over(&sorted_bytes, slack),
            ..Default::default()
        }
    }

    /// A readable summary: the winner, the next best, and why the others were rejected.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "searched {} policies ({} block layouts, {} sweeps): {} over the device budget by estimate, {} by exact plan, {} over host memory, {} invalid; compiled {}",
            self.enumerated,
            self.layouts,
            self.layouts_swept,
            self.rejected_estimate,
            self.rejected_exact,
            self.rejected_host,
            self.rejected_invalid,
            self.compiled.len()
        );
        if !self.orders.is_empty() {
            let orders: Vec<String> = self
                .orders
                .iter()
                .map(|(order, step)| match step {
                    Some(s) => format!("{order} {s:.4} s"),
                    None => format!("{order} does not fit"),
                })
                .collect();
            let _ = writeln!(
                out,
                "micro-batch orders: {} (the faster wins, sequential on a tie)",
                orders.join(", ")
            );
        }
        for (i, c) in self.compiled.iter().take(6).enumerate() {
            let _ = writeln!(
                out,
                "  {} {}  simulated {:.4} s (estimate {:.4} s)  device {}  host {}{}  moves {}{}{}",
                if i == 0 { "*" } else { " " },
                c.policy,
                c.simulated_seconds,
                c.estimated_seconds,
                format_bytes(c.peak_device_bytes),
                format_bytes(c.host_bytes),
                match c.disk_bytes {
                    0 => String::new(),
                    bytes => format!("  disk {}", format_bytes(bytes)),
                },
                format_bytes(c.movement.bytes),
                match c.movement.recomputed_flops {
                    0 => String::new(),
                    flops => format!(", recomputes {:.1} GFLOP", flops as f64 / 1e9),
                },
                if c.fits { "" } else { "  (does not fit)" }
            );
        }
        out
    }
}

/// Time in whole ticks of [`Profile::ticks_per_second`]. Integer sums are exact whatever
/// their order, so a sum over the streamed chunks computed as a difference of prefix sums is
/// the sum the per-chunk loop makes, and equal estimates tie instead of differing in the last
/// bit of a float.
type Ticks = u64;

/// How seconds become [`Ticks`]: as finely as a femtosecond, but coarser when needed so that
/// the sum of every time in a profile stays below 2^62 and no estimate can overflow.
struct TickScale {
    per_second: f64,
    /// Ticks of an infinite time: all of them together still stay below 2^62.
    infinite: Ticks,
}

impl TickScale {
    const FINEST_PER_SECOND: f64 = 1e15;
    const ROOM: u64 = 1 << 62;

    /// The scale for a profile whose times are `times`, each counted `repeats` times in a
    /// step at the most.
    fn new(times: &[&[f64]], repeats: u64) -> Self {
        let repeats = repeats.max(1);
        let count = times.iter().map(|t| t.len()).sum::<usize>().max(1) as u64;
        let count = count.saturating_mul(repeats);
        let finite: f64 = times
            .iter()
            .flat_map(|t| t.iter())
            .filter(|s| s.is_finite() && **s > 0.0)
            .sum::<f64>()
            * repeats as f64;
        let per_second = if finite > 0.0 {
            (Self::ROOM as f64 / finite).min(Self::FINEST_PER_SECOND)
        } else {
            Self::FINEST_PER_SECOND
        };
        Self {
            per_second,
            infinite: Self::ROOM / count,
        }
    }

    /// `seconds` in ticks: 0 for a negative or undefined time.
    fn ticks(&self, seconds: f64) -> Ticks {
        if seconds.is_nan() || seconds <= 0.0 {
            0
        } else if seconds.is_infinite() {
            self.infinite
        } else {
            // `as` saturates; the scale keeps the sum of these below 2^62 plus rounding.
            (seconds * self.per_second).round() as Ticks
        }
    }
}

/// Per-chunk and per-layer facts the estimates need, computed once per training graph.
#[derive(Debug)]
struct Profile {
    layers: usize,
    /// Ticks in a second.
    ticks_per_second: f64,
    /// Per chunk: forward and backward compute of the ops that read it.
    forward: Vec<Ticks>,
    backward: Vec<Ticks>,
    /// Per chunk, when streamed: fetching it before the forward pass, and its backward
    /// traffic (fetching it again, offloading its gradients).
    fetch: Vec<Ticks>,
    backward_comm: Vec<Ticks>,
    /// Per chunk: its optimizer step on the device (persistent) or on the host (streamed);
    /// on the host backend the host one includes the compute time the streamed chunk's copies
    /// take.
    gpu_adam: Vec<Ticks>,
    cpu_adam: Vec<Ticks>,
    /// Per `n_persist` from 0 to the chunk count: the disk tier's time in a step where the
    /// streamed chunks' host state is over the host budget, its stream busy and idle
    /// ([`disk_by_persist`]), in each run of the forward and backward passes (moved storage
    /// read for uploads, written after gradient offloads) and in the update (the rest), by
    /// the host bytes left ([`Profile::disk_at`]). The disk i/o stream runs beside every
    /// other, so no step is shorter ([`Profile::step`]).
    disk: Vec<DiskSteps<Ticks>>,
    /// Per `n_persist`: the most of [`Profile::disk`] at `n_persist` or more with the whole
    /// host budget, so that the disk's time only falls as `n_persist` grows, as the search's
    /// lower bounds need.
    disk_floor: Vec<(Ticks, Ticks)>,
    /// The host bytes the streamed chunks' state may take ([`HostBudgets::host`]).
    host_budget: u64,
    /// How many times a step runs the forward and backward passes profiled: the
    /// micro-batches of the sequential order (each a run of one micro-batch's program, the
    /// update once after the last), 1 otherwise (the chunk-major order's interleaved graph
    /// holds every micro-batch).
    repeats: u64,
    /// Whether the CPU Adam and the copies run on the cores the compute runs on (the host
    /// backend, [`CostModel::host_cores`]): the CPU Adam (with a streamed chunk's copies'
    /// share) then adds to the step instead of hiding behind the backward pass
    /// ([`Profile::after_forward`]), and so does a swapped block's share of its copies
    /// ([`Profile::swap_added`]) instead of hiding behind its chunk's compute.
    cpu_shares_cores: bool,
    /// Whether the target runs the flash attention kernels ([`CostModel::flash_attention`]):
    /// every candidate's workspaces are planned for it.
    flash_attention: bool,
    /// Per chunk: device bytes while persistent (parameters, gradients, optimizer state).
    resident_bytes: Vec<u64>,
    /// Bytes of one chunk buffer.
    chunk_capacity: u64,
    /// Per layer: the chunk that most of its forward ops read, its forward time (what
    /// recomputing it costs), swapping its saved activations out and back in, and the bytes of
    /// those activations and of its input.
    layer_chunk: Vec<usize>,
    layer_forward: Vec<Ticks>,
    swap_out: Vec<Ticks>,
    swap_in: Vec<Ticks>,
    layer_saved: Vec<u64>,
    layer_input: Vec<u64>,
    /// Bytes live outside the layers at the peak (embeddings, logits and their gradient).
    head_bytes: u64,
}

/// What one walk over a training graph's forward and backward ops finds, in seconds and
/// bytes, for [`Profile::new`].
struct OpWalk {
    /// Per chunk: forward and backward compute of the ops that read it (an op without a
    /// parameter is charged to the chunk of the last op with one).
    chunk_forward: Vec<f64>,
    chunk_backward: Vec<f64>,
    /// Per layer: its forward time, the chunk that most of its forward ops read, the bytes
    /// of its activations the backward pass reads, and the bytes of its input.
    layer_forward: Vec<f64>,
    layer_chunk: Vec<usize>,
    layer_saved: Vec<u64>,
    layer_input: Vec<u64>,
    /// Bytes live outside the layers at the peak (embeddings, logits and their gradient).
    head_bytes: u64,
}

impl OpWalk {
    fn new(training: &Graph, chunks: &ChunkTable, cost: &dyn CostModel, layers: usize) -> Self {
        let n = chunks.len();
        let layer_of = |block: protrain_ir::BlockId| match training.block(block).kind {
            BlockKind::Layer(i) if (i as usize) < layers => Some(i as usize),
            _ => None,
        };
        let mut chunk_forward = vec![0.0; n];
        let mut chunk_backward = vec![0.0; n];
        let mut layer_forward = vec![0.0; layers];
        let mut layer_votes: Vec<HashMap<usize, u64>> = vec![HashMap::new(); layers];
        let mut current = 0usize;
        let mut read_backward = BTreeSet::new();
        for (_, op) in training.ops() {
            if op.phase == Phase::Backward {
                read_backward.extend(op.inputs.iter().copied());
            }
        }
        let mut layer_saved = vec![0u64; layers];
        let mut layer_input = vec![0u64; layers];
        let mut inputs_seen = BTreeSet::new();
        let mut head_bytes = 0u64;
        for (_, op) in training.ops() {
            if op.phase == Phase::Optimizer {
                continue;
            }
            let ins: Vec<_> = op.inputs.iter().map(|&v| &training.value(v).ty).collect();
            let outs: Vec<_> = op.outputs.iter().map(|&v| &training.value(v).ty).collect();
            let dtype = ins
                .iter()
                .find(|t| t.dtype.is_float())
                .map_or(protrain_ir::DType::F32, |t| t.dtype);
            let seconds = cost.op_seconds(&op.kind, &ins, &outs, dtype);
            if let Some(p) = op.inputs.iter().find_map(|&v| training.param_of(v)) {
                current = chunks.locate(p).0.index();
            }
            // (A graph without parameters has no chunk to charge.)
            let per_chunk = match op.phase {
                Phase::Forward => &mut chunk_forward,
                _ => &mut chunk_backward,
            };
            if let Some(t) = per_chunk.get_mut(current) {
                *t += seconds;
            }
            if let Some(l) = layer_of(op.block) {
                if op.phase == Phase::Forward {
                    layer_forward[l] += seconds;
                    *layer_votes[l].entry(current).or_default() += 1;
                    for &v in &op.outputs {
                        if read_backward.contains(&v) {
                            layer_saved[l] += training.value(v).ty.bytes();
                        }
                    }
                    // A layer's input once per block: an interleaved graph's layer has a
                    // block, and a checkpoint, per micro-batch.
                    if inputs_seen.insert(op.block) {
                        layer_input[l] += op
                            .inputs
                            .first()
                            .map_or(0, |&v| training.value(v).ty.bytes());
                    }
                }
            } else if op.phase != Phase::Forward || op.kind == OpKind::CrossEntropy {
                // The head's logits and their gradient dominate what lives outside layers.
                let bytes: u64 = op
                    .outputs
                    .iter()
                    .map(|&v| training.value(v).ty.bytes())
                    .sum();
                head_bytes = head_bytes.max(bytes);
            }
        }
        let logits = training
            .ops()
            .find(|(_, op)| op.kind == OpKind::CrossEntropy)
            .map_or(0, |(_, op)| training.value(op.inputs[0]).ty.bytes());
        head_bytes = head_bytes.max(logits.saturating_mul(2));
        let layer_chunk = layer_votes
            .iter()
            .map(|v| {
                v.iter()
                    .max_by_key(|&(c, n)| (*n, usize::MAX - c))
                    .map_or(0, |(&c, _)| c)
            })
            .collect();
        Self {
            chunk_forward,
            chunk_backward,
            layer_forward,
            layer_chunk,
            layer_saved,
            layer_input,
            head_bytes,
        }
    }
}

/// How many ranks share each streamed chunk (1 where the chunks are not sharded,
/// [`crate::shard::shardable`]) and the seconds of a chunk's all-gather before use and of its
/// gradients' reduce-scatter (an all-reduce when the update reads the global norm) on them.
fn shard_collectives(
    training: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    topology: Topology,
) -> (u64, f64, f64) {
    let shards = match crate::shard::shardable(chunks, topology) {
        Ok(()) => u64::from(topology.ranks().max(1)),
        Err(_) => 1,
    };
    if shards == 1 {
        return (1, 0.0, 0.0);
    }
    let capacity = chunks.chunk_bytes.next_multiple_of(4 * shards);
    let summed = match crate::shard::reads_global_norm(training) {
        true => CollectiveKind::AllReduce,
        false => CollectiveKind::ReduceScatter,
    };
    // The chunk-major order's interleaved graph sums each of a rank's micro-batches'
    // gradients over the ranks in its backward pass instead ([`chunk_major_sums`]).
    let scatter = match interleaved_copies(training) {
        1 => cost.collective_seconds(summed, capacity, topology),
        _ => 0.0,
    };
    (
        shards,
        cost.collective_seconds(CollectiveKind::AllGather, capacity, topology),
        scatter,
    )
}

/// The seconds the chunk-major order's backward pass takes, per chunk, to sum its
/// gradients over `topology`'s ranks: one all-reduce of each member's gradient per
/// micro-batch, which the compute stream waits for ([`crate::data_parallel`]); none for
/// one rank or a graph of one micro-batch.
fn chunk_major_sums(
    graph: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    topology: Topology,
) -> Vec<f64> {
    let (ranks, copies) = (topology.ranks().max(1), interleaved_copies(graph));
    chunks
        .chunks
        .iter()
        .map(|c| match ranks == 1 || copies == 1 {
            true => 0.0,
            false => c
                .members
                .iter()
                .map(|m| {
                    let bytes = graph.value(graph.param(m.param).value).ty.bytes();
                    copies as f64
                        * cost.collective_seconds(CollectiveKind::AllReduce, bytes, topology)
                })
                .sum(),
        })
        .collect()
}

/// How many micro-batches `graph` runs in one program: the blocks of each layer
/// ([`crate::interleave`] gives every micro-batch's copy of a layer a block of that layer's
/// kind), 1 for a graph of one micro-batch.
fn interleaved_copies(graph: &Graph) -> u64 {
    let mut blocks: BTreeMap<u32, u64> = BTreeMap::new();
    for (_, b) in graph.blocks() {
        if let BlockKind::Layer(i) = b.kind {
            *blocks.entry(i).or_insert(0) += 1;
        }
    }
    blocks.values().copied().max().unwrap_or(1).max(1)
}

/// The disk tier's seconds per step for each `n_persist` ([`disk_by_persist`]), from each
/// chunk's bytes, elements and CPU Adam seconds (`adam`); on `shards > 1` sharded ranks, of
/// a rank's shards (state and storage move as one rank's do). `per_node` ranks share a
/// node's disk, whose bandwidth the profile gives: each moves its bytes at `1 / per_node`
/// of it, as the simulator prices a disk transfer. `repeats` is how many times a step
/// runs its program (the micro-batches of the sequential order, 1 otherwise): over more than
/// one the host sums each streamed chunk's gradients, and those stay on the host.
#[allow(clippy::too_many_arguments)]
fn disk_seconds(
    chunk_bytes: &[u64],
    chunk_elems: &[u64],
    adam: &[f64],
    state_per_elem: u64,
    (shards, per_node): (u64, u64),
    repeats: u64,
    budgets: HostBudgets,
    cost: &dyn CostModel,
) -> Vec<DiskSteps<f64>> {
    // On sharded ranks a rank holds and moves `1 / shards` of each chunk (`adam` is a
    // rank's already).
    let chunks: Vec<DiskChunk> = chunk_bytes
        .iter()
        .zip(chunk_elems)
        .zip(adam)
        .map(|((&storage, &e), &adam)| DiskChunk {
            storage: storage.div_ceil(shards),
            state: e.div_ceil(shards).saturating_mul(state_per_elem),
            adam,
        })
        .collect();
    // The host layout the search's repair takes before the disk tier: gradients in the
    // parameter storage when the parameters are narrower than f32 and the step takes one
    // program run (the 14-byte layout), else a gradient buffer beside each parameter buffer,
    // and beside those the host accumulators where the host sums micro-batches.
    let layout = match (state_per_elem == 12, repeats > 1) {
        (_, true) => DiskLayout::Accumulating,
        (true, false) => DiskLayout::GradsInParams,
        (false, false) => DiskLayout::Full,
    };
    let read = |bytes: u64| cost.copy_seconds(bytes.saturating_mul(per_node), CopyDir::DiskToHost);
    let write = |bytes: u64| cost.copy_seconds(bytes.saturating_mul(per_node), CopyDir::HostToDisk);
    disk_by_persist(&chunks, layout, budgets, read, write)
}

impl Profile {
    /// The profile of `training` on `topology`'s ranks. Where they shard the offloaded chunks
    /// ([`crate::shard::shardable`]), each rank uploads, offloads and updates its `1/W` slice
    /// of a streamed chunk, and the chunk's all-gather (before use) and its gradients'
    /// reduce-scatter (an all-reduce when the update reads the global norm) are priced with
    /// those copies, as the schedule runs them one after the other. It does not price the
    /// all-reduces of persistent (replicated) chunks' gradients.
    ///
    /// `budgets` price the disk tier: where the streamed chunks' host state is over
    /// `budgets.host` and `budgets.disk` is not 0, each policy's step includes the disk
    /// traffic that tier would add ([`disk_by_persist`]).
    fn new(
        training: &Graph,
        chunks: &ChunkTable,
        cost: &dyn CostModel,
        topology: Topology,
        budgets: HostBudgets,
        repeats: u64,
    ) -> Self {
        let repeats = repeats.max(1);
        // Layers, not blocks: an interleaved graph has a block per layer and micro-batch.
        let layers = training
            .blocks()
            .filter_map(|(_, b)| match b.kind {
                BlockKind::Layer(i) => Some(i),
                _ => None,
            })
            .collect::<BTreeSet<u32>>()
            .len();
        let OpWalk {
            chunk_forward,
            mut chunk_backward,
            layer_forward,
            layer_chunk,
            layer_saved,
            layer_input,
            head_bytes,
        } = OpWalk::new(training, chunks, cost, layers);
        let chunk_bytes: Vec<u64> = chunks.chunks.iter().map(|c| c.used_bytes).collect();
        let chunk_elems: Vec<u64> = chunks
            .chunks
            .iter()
            .map(|c| {
                c.members
                    .iter()
                    .map(|m| training.value(training.param(m.param).value).ty.numel())
                    .sum()
            })
            .collect();
        let state_per_elem = crate::streams::state_bytes_per_element(training);
        let resident_bytes = chunk_bytes
            .iter()
            .zip(&chunk_elems)
            .map(|(&b, &e)| {
                b.saturating_mul(2)
                    .saturating_add(state_per_elem.saturating_mul(e))
            })
            .collect();
        let big = 1u64 << 30;
        let h2d_per_byte = cost.copy_seconds(big, CopyDir::HostToDevice) / big as f64;
        let d2h_per_byte = cost.copy_seconds(big, CopyDir::DeviceToHost) / big as f64;
        let (shards, gather, scatter) = shard_collectives(training, chunks, cost, topology);
        for (b, sums) in chunk_backward
            .iter_mut()
            .zip(chunk_major_sums(training, chunks, cost, topology))
        {
            *b += sums;
        }
        let copies = |dir, collective: f64| -> Vec<f64> {
            chunk_bytes
                .iter()
                .map(|&b| cost.copy_seconds(b.div_ceil(shards), dir) + collective)
                .collect()
        };
        let fetch = copies(CopyDir::HostToDevice, gather);
        let offload = copies(CopyDir::DeviceToHost, scatter);
        // On the host backend every copy takes `1 / cores` of its time from compute, as the
        // simulator charges it (`Profile::cpu_shares_cores`): a streamed chunk's (fetched
        // twice, offloaded once) add to its CPU Adam, what streaming it adds to the step
        // there, and a swap's are what the swap costs.
        let host_share = cost.host_cores().map(|cores| 1.0 / cores);
        let host_copy_share = host_share.unwrap_or(0.0);
        let cpu_adam: Vec<f64> = chunk_elems
            .iter()
            .zip(fetch.iter().zip(&offload))
            .map(|(&e, (&f, &o))| {
                cost.cpu_adam_seconds(e.div_ceil(shards)) + (2.0 * f + o) * host_copy_share
            })
            .collect();
        let gpu_adam: Vec<f64> = chunk_elems
            .iter()
            .map(|&e| cost.gpu_adam_seconds(e))
            .collect();
        let swap_share = host_share.unwrap_or(1.0);
        let swap_out: Vec<f64> = layer_saved
            .iter()
            .map(|&b| b as f64 * d2h_per_byte * swap_share)
            .collect();
        let swap_in: Vec<f64> = layer_saved
            .iter()
            .map(|&b| b as f64 * h2d_per_byte * swap_share)
            .collect();
        // A sharded chunk's shards split its capacity, padding included ([`crate::shard`],
        // [`crate::streams`]): a rank's shards of its storage and state, which the disk tier
        // moves whole, are `1 / shards` of the capacity and its elements, not of the bytes
        // its parameters use.
        let (disk_bytes, disk_elems): (Vec<u64>, Vec<u64>) = match shards {
            1 => (chunk_bytes.clone(), chunk_elems.clone()),
            _ => {
                let capacity = chunks.chunk_bytes.next_multiple_of(4 * shards);
                chunks
                    .chunks
                    .iter()
                    .map(|c| {
                        let element = c.members.first().map_or(4, |m| {
                            training
                                .value(training.param(m.param).value)
                                .ty
                                .dtype
                                .size()
                        });
                        (capacity, capacity / element)
                    })
                    .unzip()
            }
        };
        let disk = disk_seconds(
            &disk_bytes,
            &disk_elems,
            &cpu_adam,
            state_per_elem,
            (shards, u64::from(topology.gpus.max(1))),
            repeats,
            budgets,
            cost,
        );
        // The most the disk can take: all of it moved at the fewest persistent chunks.
        let most_disk = disk[0].at(0);
        // Every estimate is at most the sum of all of these.
        let scale = TickScale::new(
            &[
                &[most_disk.0, most_disk.1],
                &chunk_forward,
                &chunk_backward,
                &fetch,
                &offload,
                &cpu_adam,
                &gpu_adam,
                &layer_forward,
                &swap_out,
                &swap_in,
            ],
            repeats,
        );
        let ticks =
            |seconds: &[f64]| -> Vec<Ticks> { seconds.iter().map(|&s| scale.ticks(s)).collect() };
        let fetch = ticks(&fetch);
        let backward_comm = fetch
            .iter()
            .zip(ticks(&offload))
            .map(|(&f, o)| f.max(o))
            .collect();
        Self {
            layers,
            ticks_per_second: scale.per_second,
            forward: ticks(&chunk_forward),
            backward: ticks(&chunk_backward),
            fetch,
            backward_comm,
            gpu_adam: ticks(&gpu_adam),
            cpu_adam: ticks(&cpu_adam),
            disk_floor: disk_floor(&disk, budgets.host, |s| scale.ticks(s)),
            disk: disk.iter().map(|d| d.map(|s| scale.ticks(s))).collect(),
            host_budget: budgets.host,
            repeats,
            cpu_shares_cores: host_share.is_some(),
            flash_attention: cost.flash_attention(),
            resident_bytes,
            chunk_capacity: chunks.chunk_bytes,
            layer_chunk,
            layer_forward: ticks(&layer_forward),
            swap_out: ticks(&swap_out),
            swap_in: ticks(&swap_in),
            layer_saved,
            layer_input,
            head_bytes,
        }
    }

    fn chunks(&self) -> usize {
        self.forward.len()
    }

    /// The step after the forward pass from its backward pass plus device optimizer
    /// (`backward_gpu`) and its CPU optimizer (`cpu`): ProTrain's `max(T_bwd + T_gpu_optim,
    /// T_cpu_optim)` where the CPU Adam overlaps the backward pass from other cores; their sum
    /// on the host backend, where it takes the compute's own cores (the simulator charges
    /// every second of it that overlaps compute, [`crate::simulate::shared_core_seconds`]).
    /// Without the sum the search estimated a streamed GPT-2 124M on the host as fast as the
    /// resident one, never compiled the resident one, and chose a policy that simulates 1.5%
    /// slower (9.28 s against 9.14 s) and measured 2-2.5% slower.
    fn after_forward(&self, backward_gpu: Ticks, cpu: Ticks) -> Ticks {
        match self.cpu_shares_cores {
            true => backward_gpu + cpu,
            false => backward_gpu.max(cpu),
        }
    }

    /// The step from one run's forward and backward passes (`forward`, `backward`), the
    /// device optimizer (`gpu`) and the CPU one (`cpu`) with `p` chunks persistent.
    ///
    /// In one run the update follows the forward pass ([`Profile::after_forward`]), and the
    /// disk tier's stream ([`Profile::disk`]) runs beside all of it, so no step is shorter.
    /// Over several ([`Profile::repeats`], the sequential order's micro-batches) every
    /// stream stops at the end of each micro-batch, as the schedule's marker has them: each
    /// run takes its passes or the disk's share of them, whichever is longer, and the
    /// update starts after the last, the device and CPU optimizers and the disk's reads and
    /// writes of the update beside each other.
    ///
    /// `host` is what else the layout keeps in host memory (swapped activations), which
    /// leaves the disk tier less room ([`Profile::disk_at`]).
    fn step(&self, [p, host]: [u64; 2], [forward, backward, gpu, cpu]: [Ticks; 4]) -> Ticks {
        let (run, update) = self.disk_at(p as usize, host);
        match self.repeats {
            1 => forward
                .saturating_add(self.after_forward(backward.saturating_add(gpu), cpu))
                .max(run.saturating_add(update)),
            k => k
                .saturating_mul(forward.saturating_add(backward).max(run))
                .saturating_add(self.after_forward(gpu, cpu.max(update))),
        }
    }

    /// The host bytes of the activations `n_swap` swapped blocks keep there (with
    /// `n_checkpoint` checkpointed, in ProTrain's interleaved order).
    fn swapped_bytes(&self, n_swap: u32, n_checkpoint: u32) -> u64 {
        (0..(n_swap + n_checkpoint) as usize)
            .filter(|&l| {
                Policy::protrain_mode(l, n_swap as usize, n_checkpoint as usize, self.layers)
                    == BlockMode::Swap
            })
            .map(|l| self.layer_saved[l])
            .sum()
    }

    /// The disk tier's ticks per run and in the update with `p` chunks persistent and
    /// `host` bytes of host memory taken besides the model states: the choice the pass
    /// takes in what is left, and no less than with more chunks persistent.
    fn disk_at(&self, p: usize, host: u64) -> (Ticks, Ticks) {
        let (run, update) = self.disk[p].at(self.host_budget.saturating_sub(host));
        let (least_run, least_update) = self.disk_floor[p];
        (run.max(least_run), update.max(least_update))
    }

    /// What a chunk's swapped and recomputed blocks add to its four terms over keep mode:
    /// forward persistent and streamed, backward persistent and streamed, from its compute
    /// (`f`, `b`), its traffic when streamed (`fetch`, `comm`), the swaps out and in and the
    /// recompute. ProTrain's overlap (`max(compute, comm)` per chunk, the swaps with the comm)
    /// on a GPU; on the host backend, where a swap takes compute's cores, a swap adds to its
    /// chunk whatever else runs: `max(f + out, fetch + out)`, `max(b + again + back, comm +
    /// back)`.
    fn swap_added(
        &self,
        [f, b, fetch, comm]: [Ticks; 4],
        [out, back, again]: [Ticks; 3],
    ) -> [Ticks; 4] {
        match self.cpu_shares_cores {
            true => [
                out,
                out,
                again + back,
                (b + again + back).max(comm + back) - b.max(comm),
            ],
            false => [
                f.max(out) - f,
                f.max(fetch + out) - f.max(fetch),
                (b + again).max(back) - b,
                (b + again).max(comm + back) - b.max(comm),
            ],
        }
    }

    /// `ticks` in seconds.
    fn seconds(&self, ticks: Ticks) -> f64 {
        ticks as f64 / self.ticks_per_second
    }
}

/// A policy in ProTrain's family, as four numbers: cheap to estimate, sort and compare;
/// [`Key::policy`] builds the [`Policy`] only for the candidates that get compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Key {
    n_persist: u32,
    n_buffer: u32,
    n_swap: u32,
    n_checkpoint: u32,
}

impl Key {
    fn policy(self, layers: usize) -> Policy {
        Policy::protrain(
            self.n_persist,
            self.n_buffer,
            self.n_swap as usize,
            self.n_checkpoint as usize,
            layers,
        )
    }

    fn movement(self) -> u32 {
        self.n_swap + self.n_checkpoint
    }
}

/// A policy with its estimates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Scored {
    /// ProTrain's closed-form step time.
    ticks: Ticks,
    /// The device bytes it is estimated to need.
    bytes: u64,
    key: Key,
}

/// A block layout: `n_swap` swapped and `n_checkpoint` checkpointed blocks in ProTrain's
/// interleaved order, the rest kept, with the activation bytes it is estimated to need (the
/// part of a policy's device bytes that depends on the layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    n_swap: u32,
    n_checkpoint: u32,
    bytes: u64,
}

/// The chunk buffers the search tries with `n_persist` of `chunks` chunks persistent: none
/// when nothing streams, one for one streamed chunk, else 2 to 4.
fn buffer_choices(chunks: usize, n_persist: usize) -> RangeInclusive<u32> {
    match chunks - n_persist {
        0 => 0..=0,
        1 => 1..=1,
        streamed => 2..=streamed.min(4) as u32,
    }
}

/// `value` as a u64, `u64::MAX` when it is larger.
fn clamp(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// The estimates of every policy, through prefix sums over chunks and layers computed once
/// (`O(chunks + layers log layers)`), and the lower bounds that let a query skip layouts.
///
/// A policy's step time is ProTrain's `T_fwd + max(T_bwd + T_gpu_optim, T_cpu_optim)`, each
/// of `T_fwd` and `T_bwd` a sum over chunks of a max of compute and communication. A chunk's
/// terms depend on whether it is persistent (`chunk < n_persist`) and on the modes of the
/// layers it holds; keeping a layer changes nothing. So for one layout, the chunks holding a
/// swapped or checkpointed layer are computed one by one and the others come from prefix
/// sums of their keep-mode terms, split at `n_persist`.
struct Estimator<'p> {
    profile: &'p Profile,
    chunks: usize,
    /// Over chunks: entry `p` sums chunks `0..p` (`chunks + 1` entries). Keep-mode forward
    /// terms persistent (`forward`) and streamed (`max(forward, fetch)`), likewise backward.
    forward_resident: Vec<Ticks>,
    forward_streamed: Vec<Ticks>,
    backward_resident: Vec<Ticks>,
    backward_streamed: Vec<Ticks>,
    fetch: Vec<Ticks>,
    backward_comm: Vec<Ticks>,
    gpu_adam: Vec<Ticks>,
    cpu_adam: Vec<Ticks>,
    resident_bytes: Vec<u128>,
    /// Per `n_persist`: device bytes outside activations with its fewest chunk buffers.
    leanest: Vec<u128>,
    /// The least of `leanest`.
    least: u128,
    /// Per `n_persist = p`: the least over `q <= p` of the step time with every block kept,
    /// and of forward plus device optimizer time with every block kept, plus the CPU
    /// optimizer's where it shares the cores (lower bounds).
    min_keep_time: Vec<Ticks>,
    min_forward_gpu: Vec<Ticks>,
    /// Over layers: entry `l` covers layers `0..l` (`layers + 1` entries): saved and input
    /// bytes summed, and the least forward and swap times (0 for none).
    saved: Vec<u128>,
    input: Vec<u128>,
    min_forward: Vec<Ticks>,
    min_swap_out: Vec<Ticks>,
    min_swap_in: Vec<Ticks>,
    /// Layers by saved bytes, largest first, ties by index: where the activation peaks are
    /// looked for. With identical layers the first one or two answer.
    by_saved: Vec<u32>,
}

/// Running sums of `values`, starting at 0.
fn prefix_sums<T: Copy + std::ops::Add<Output = T> + Default>(
    values: impl Iterator<Item = T>,
) -> Vec<T> {
    let mut sums = vec![T::default()];
    let mut total = T::default();
    for v in values {
        total = total + v;
        sums.push(total);
    }
    sums
}

/// Running minima of `values`, starting at 0 for none.
fn prefix_minima(values: &[Ticks]) -> Vec<Ticks> {
    let mut minima = vec![0];
    let mut least = Ticks::MAX;
    for &v in values {
        least = least.min(v);
        minima.push(least);
    }
    minima
}

impl<'p> Estimator<'p> {
    fn new(profile: &'p Profile) -> Self {
        let n = profile.chunks();
        let chunks = 0..n;
        let forward_resident = prefix_sums(profile.forward.iter().copied());
        let forward_streamed = prefix_sums(
            chunks
                .clone()
                .map(|c| profile.forward[c].max(profile.fetch[c])),
        );
        let backward_resident = prefix_sums(profile.backward.iter().copied());
        let backward_streamed = prefix_sums(
            chunks
                .clone()
                .map(|c| profile.backward[c].max(profile.backward_comm[c])),
        );
        let resident_bytes: Vec<u128> =
            prefix_sums(profile.resident_bytes.iter().map(|&b| u128::from(b)));
        let mut estimator = Self {
            profile,
            chunks: n,
            forward_resident,
            forward_streamed,
            backward_resident,
            backward_streamed,
            fetch: prefix_sums(profile.fetch.iter().copied()),
            backward_comm: prefix_sums(profile.backward_comm.iter().copied()),
            gpu_adam: prefix_sums(profile.gpu_adam.iter().copied()),
            cpu_adam: prefix_sums(profile.cpu_adam.iter().copied()),
            resident_bytes,
            leanest: Vec::new(),
            least: 0,
            min_keep_time: Vec::new(),
            min_forward_gpu: Vec::new(),
            saved: prefix_sums(profile.layer_saved.iter().map(|&b| u128::from(b))),
            input: prefix_sums(profile.layer_input.iter().map(|&b| u128::from(b))),
            min_forward: prefix_minima(&profile.layer_forward),
            min_swap_out: prefix_minima(&profile.swap_out),
            min_swap_in: prefix_minima(&profile.swap_in),
            by_saved: Vec::new(),
        };
        estimator.leanest = (0..=n)
            .map(|p| estimator.device_bytes(p, *buffer_choices(n, p).start()))
            .collect();
        estimator.least = estimator.leanest.iter().copied().min().unwrap_or(0);
        let running_min = |values: Vec<Ticks>| -> Vec<Ticks> {
            values
                .iter()
                .scan(Ticks::MAX, |least, &v| {
                    *least = (*least).min(v);
                    Some(*least)
                })
                .collect()
        };
        estimator.min_keep_time = running_min((0..=n).map(|p| estimator.keep_time(p)).collect());
        estimator.min_forward_gpu = running_min(
            (0..=n)
                .map(|p| {
                    let cpu = match profile.cpu_shares_cores {
                        true => estimator.cpu(p),
                        false => 0,
                    };
                    estimator.keep_forward(p) + estimator.gpu(p) + cpu
                })
                .collect(),
        );
        let mut by_saved: Vec<u32> = (0..profile.layers as u32).collect();
        by_saved.sort_by_key(|&l| (Reverse(profile.layer_saved[l as usize]), l));
        estimator.by_saved = by_saved;
        estimator
    }

    /// `prefix[chunks] - prefix[p]`: the sum over chunks `p..`.
    fn suffix(&self, prefix: &[Ticks], p: usize) -> Ticks {
        prefix[self.chunks] - prefix[p]
    }

    /// `T_fwd` with `p` chunks persistent and every block kept; it only falls as `p` grows.
    fn keep_forward(&self, p: usize) -> Ticks {
        self.forward_resident[p] + self.suffix(&self.forward_streamed, p)
    }

    /// `T_bwd` with `p` chunks persistent and every block kept; it only falls as `p` grows.
    fn keep_backward(&self, p: usize) -> Ticks {
        self.backward_resident[p] + self.suffix(&self.backward_streamed, p)
    }

    /// The device optimizer over the persistent chunks.
    fn gpu(&self, p: usize) -> Ticks {
        self.gpu_adam[p]
    }

    /// The CPU Adam over the streamed chunks; it only falls as `p` grows.
    fn cpu(&self, p: usize) -> Ticks {
        self.suffix(&self.cpu_adam, p)
    }

    /// The step time with `p` chunks persistent and every block kept: no layout is faster.
    fn keep_time(&self, p: usize) -> Ticks {
        self.profile.step(
            [p as u64, 0],
            [
                self.keep_forward(p),
                self.keep_backward(p),
                self.gpu(p),
                self.cpu(p),
            ],
        )
    }

    /// Device bytes outside activations: persistent chunks and chunk buffers (two more than
    /// `n_buffer`, for the prefetch in flight and the gradient offload).
    fn device_bytes(&self, p: usize, n_buffer: u32) -> u128 {
        let buffers = if p < self.chunks {
            (u128::from(n_buffer) + 2) * u128::from(self.profile.chunk_capacity)
        } else {
            0
        };
        self.resident_bytes[p] + buffers
    }

    /// Activation bytes of a layout: the head, every kept layer's saved activations, every
    /// other layer's input, the largest recomputed layer's activations, and three times the
    /// largest swapped layer's (one being written out, one read back, one in use).
    fn activation_bytes(&self, n_swap: u32, n_checkpoint: u32) -> u64 {
        let profile = self.profile;
        let prefix = (n_swap + n_checkpoint) as usize;
        let peak = |mode: BlockMode, count: u32| -> u128 {
            if count == 0 {
                return 0;
            }
            self.by_saved
                .iter()
                .map(|&l| l as usize)
                .find(|&l| {
                    l < prefix
                        && Policy::protrain_mode(
                            l,
                            n_swap as usize,
                            n_checkpoint as usize,
                            profile.layers,
                        ) == mode
                })
                .map_or(0, |l| u128::from(profile.layer_saved[l]))
        };
        let kept = self.saved[profile.layers] - self.saved[prefix];
        clamp(
            u128::from(profile.head_bytes)
                + kept
                + self.input[prefix]
                + peak(BlockMode::Checkpoint, n_checkpoint)
                + 3 * peak(BlockMode::Swap, n_swap),
        )
    }

    /// Every block layout with its activation bytes, by `n_swap` then `n_checkpoint`.
    fn layouts(&self) -> Vec<Layout> {
        let layers = self.profile.layers as u32;
        (0..=layers)
            .into_par_iter()
            .flat_map_iter(|n_swap| {
                (0..=layers - n_swap).map(move |n_checkpoint| Layout {
                    n_swap,
                    n_checkpoint,
                    bytes: self.activation_bytes(n_swap, n_checkpoint),
                })
            })
            .collect()
    }

    /// Policies in the family: every `(n_persist, n_buffer)` with every layout.
    fn policy_count(&self, layouts: usize) -> usize {
        (0..=self.chunks)
            .map(|p| buffer_choices(self.chunks, p).count())
            .sum::<usize>()
            .saturating_mul(layouts)
    }

    /// Policies whose estimated device bytes exceed `limit`. `sorted` holds the layouts'
    /// activation bytes in increasing order.
    fn count_over(&self, sorted: &[u64], limit: u64) -> usize {
        let mut over = 0;
        for p in 0..=self.chunks {
            for n_buffer in buffer_choices(self.chunks, p) {
                let fixed = self.device_bytes(p, n_buffer);
                over += match u128::from(limit).checked_sub(fixed) {
                    None => sorted.len(),
                    Some(room) => sorted.len() - sorted.partition_point(|&a| u128::from(a) <= room),
                };
            }
        }
        over
    }

    /// The most persistent chunks a policy can have when `room` bytes are left beside its
    /// activations, if any: every policy that fits has at most that many.
    fn max_persist(&self, room: u128) -> Option<usize> {
        let n = self.chunks;
        // All persistent needs no buffer, one streamed chunk one: either can be leaner than
        // fewer persistent chunks with two buffers. Below that, bytes rise with `p`.
        if self.leanest[n] <= room {
            return Some(n);
        }
        if n >= 1 && self.leanest[n - 1] <= room {
            return Some(n - 1);
        }
        if n < 2 {
            return None;
        }
        self.leanest[..=n - 2]
            .partition_point(|&w| w <= room)
            .checked_sub(1)
    }

    /// A lower bound on the step time of every policy with `layout` and at most `p_max`
    /// chunks persistent. Each term is a sum the exact time cannot be under, at the `p` that
    /// makes it least: every term but the device optimizer falls as `p` grows.
    fn time_bound(&self, layout: &Layout, p_max: usize) -> Ticks {
        let (s, c) = (layout.n_swap, layout.n_checkpoint);
        let prefix = (s + c) as usize;
        let p = p_max;
        // Recomputing `c` layers costs at least `c` of the least forward time among them,
        // and likewise for swapping.
        let recompute = u64::from(c) * self.min_forward[prefix];
        let swap_out = u64::from(s) * self.min_swap_out[prefix];
        let swap_in = u64::from(s) * self.min_swap_in[prefix];
        let backward_compute = self.backward_resident[self.chunks];
        let (forward, backward, swaps) = match self.profile.cpu_shares_cores {
            // Swaps add to their chunks (`Profile::swap_added`).
            true => (
                self.keep_forward(p) + swap_out,
                self.keep_backward(p).max(backward_compute + recompute) + swap_in,
                swap_out + swap_in,
            ),
            // A chunk's max(compute, comm) is at least either: sum each side over the chunks.
            false => (
                self.keep_forward(p)
                    .max(self.suffix(&self.fetch, p) + swap_out),
                self.keep_backward(p)
                    .max(backward_compute + recompute)
                    .max(self.suffix(&self.backward_comm, p) + swap_in),
                0,
            ),
        };
        // Moving blocks off the device never speeds a chunk up: no layout beats keeping all.
        self.min_keep_time[p]
            .max(self.min_forward_gpu[p] + backward_compute + recompute + swaps)
            .max(
                self.profile
                    .step([p as u64, 0], [forward, backward, 0, self.cpu(p)]),
            )
    }

    /// Estimates every policy with `layout` whose device bytes are at most `limit`, and
    /// hands each to `visit` (by `n_persist`, then `n_buffer`). `O(prefix + chunks)`.
    fn sweep(
        &self,
        scratch: &mut Scratch,
        layout: &Layout,
        limit: u64,
        mut visit: impl FnMut(Scored),
    ) {
        let Some(room) = u128::from(limit).checked_sub(u128::from(layout.bytes)) else {
            return;
        };
        let profile = self.profile;
        let n = self.chunks;
        let (s, c) = (layout.n_swap, layout.n_checkpoint);
        let swapped = profile.swapped_bytes(s, c);
        scratch.clear();
        for l in 0..(s + c) as usize {
            let k = profile.layer_chunk[l];
            if k >= n {
                continue;
            }
            if !scratch.seen[k] {
                scratch.seen[k] = true;
                scratch.touched.push(k);
            }
            match Policy::protrain_mode(l, s as usize, c as usize, profile.layers) {
                BlockMode::Swap => {
                    scratch.swap_out[k] += profile.swap_out[l];
                    scratch.swap_in[k] += profile.swap_in[l];
                }
                BlockMode::Checkpoint => scratch.recompute[k] += profile.layer_forward[l],
                BlockMode::Keep => {}
            }
        }
        scratch.touched.sort_unstable();
        // What a touched chunk's layers add to its four terms over keep mode: forward
        // persistent and streamed, backward persistent and streamed.
        let mut total = [0; 4];
        for &k in &scratch.touched {
            let (f, b) = (profile.forward[k], profile.backward[k]);
            let (fetch, comm) = (profile.fetch[k], profile.backward_comm[k]);
            let (out, back, again) = (
                scratch.swap_out[k],
                scratch.swap_in[k],
                scratch.recompute[k],
            );
            let added = profile.swap_added([f, b, fetch, comm], [out, back, again]);
            for (t, a) in total.iter_mut().zip(added) {
                *t += a;
            }
            scratch.added.push(added);
        }
        // Sweep n_persist upwards; `below` sums what the touched chunks under it add.
        let mut below = [0; 4];
        let mut next = 0;
        let mut p = 0;
        while p <= n {
            if p + 2 <= n && self.leanest[p] > room {
                // Bytes only rise with `p` below `n - 1`: skip to the two leaner ends.
                p = n - 1;
                continue;
            }
            while next < scratch.touched.len() && scratch.touched[next] < p {
                for (b, a) in below.iter_mut().zip(scratch.added[next]) {
                    *b += a;
                }
                next += 1;
            }
            if self.leanest[p] <= room {
                let forward = self.forward_resident[p]
                    + below[0]
                    + self.suffix(&self.forward_streamed, p)
                    + (total[1] - below[1]);
                let backward = self.backward_resident[p]
                    + below[2]
                    + self.suffix(&self.backward_streamed, p)
                    + (total[3] - below[3]);
                let ticks = profile.step(
                    [p as u64, swapped],
                    [forward, backward, self.gpu(p), self.cpu(p)],
                );
                for n_buffer in buffer_choices(n, p) {
                    let bytes = self.device_bytes(p, n_buffer) + u128::from(layout.bytes);
                    if bytes > u128::from(limit) {
                        break;
                    }
                    visit(Scored {
                        ticks,
                        bytes: clamp(bytes),
                        key: Key {
                            n_persist: p as u32,
                            n_buffer,
                            n_swap: s,
                            n_checkpoint: c,
                        },
                    });
                }
            }
            p += 1;
        }
    }

    /// The first `k` policies ranked after `after` by `O` among those whose device bytes are
    /// at most `limit`, in order, and how many layouts it swept.
    ///
    /// Branch and bound: every layout gets a rank no policy of it can beat
    /// ([`Order::bound`]); layouts are swept from the best bound, in blocks swept in
    /// parallel, until the next bound ranks after the `k`-th policy found. The answer does
    /// not depend on the blocks or the thread count, only the work does.
    fn best_after<O: Order>(
        &self,
        layouts: &[Layout],
        limit: u64,
        after: Option<O::Rank>,
        k: usize,
    ) -> (Vec<Scored>, usize) {
        const ROUND: usize = 1024;
        const BLOCK: usize = 32;
        let mut pending: Vec<(O::Rank, u32)> = layouts
            .par_iter()
            .enumerate()
            .filter_map(|(i, layout)| {
                let room = u128::from(limit).checked_sub(u128::from(layout.bytes))?;
                let p_max = self.max_persist(room)?;
                let ticks = self.time_bound(layout, p_max);
                let bound = O::bound(layout, clamp(self.least), ticks, p_max as u32);
                Some((bound, i as u32))
            })
            .collect();
        let mut best: BinaryHeap<(O::Rank, Scored)> = BinaryHeap::with_capacity(k + 1);
        let mut swept = 0;
        let kth = |best: &BinaryHeap<(O::Rank, Scored)>| {
            (best.len() >= k)
                .then(|| best.peek().map(|(r, _)| *r))
                .flatten()
        };
        while k > 0 && !pending.is_empty() {
            if let Some(kth) = kth(&best) {
                pending.retain(|(bound, _)| *bound <= kth);
            }
            let take = pending.len().min(ROUND);
            if take == 0 {
                break;
            }
            if take < pending.len() {
                pending.select_nth_unstable(take - 1);
            }
            let mut round: Vec<(O::Rank, u32)> = pending.drain(..take).collect();
            round.sort_unstable();
            for block in round.chunks(BLOCK) {
                let limit_rank = kth(&best);
                if limit_rank.is_some_and(|kth| block[0].0 > kth) {
                    break;
                }
                let found: Vec<Vec<(O::Rank, Scored)>> = block
                    .par_iter()
                    .map_init(
                        || Scratch::new(self.chunks),
                        |scratch, &(bound, i)| {
                            let mut local = Vec::new();
                            if limit_rank.is_some_and(|kth| bound > kth) {
                                return local;
                            }
                            self.sweep(scratch, &layouts[i as usize], limit, |x| {
                                let rank = O::rank(&x);
                                if after.is_none_or(|a| rank > a)
                                    && limit_rank.is_none_or(|kth| rank < kth)
                                {
                                    local.push((rank, x));
                                }
                            });
                            if local.len() > k {
                                local.select_nth_unstable(k - 1);
                                local.truncate(k);
                            }
                            local
                        },
                    )
                    .collect();
                swept += block
                    .iter()
                    .filter(|(bound, _)| limit_rank.is_none_or(|kth| *bound <= kth))
                    .count();
                for entry in found.into_iter().flatten() {
                    if best.len() < k {
                        best.push(entry);
                    } else if best.peek().is_some_and(|top| entry < *top) {
                        best.pop();
                        best.push(entry);
                    }
                }
            }
        }
        let list = best.into_sorted_vec().into_iter().map(|(_, x)| x).collect();
        (list, swept)
    }
}

/// Per-thread working space of [`Estimator::sweep`]: what the swapped and checkpointed
/// layers add to each chunk, and which chunks they touch.
struct Scratch {
    swap_out: Vec<Ticks>,
    swap_in: Vec<Ticks>,
    recompute: Vec<Ticks>,
    seen: Vec<bool>,
    touched: Vec<usize>,
    added: Vec<[Ticks; 4]>,
}

impl Scratch {
    fn new(chunks: usize) -> Self {
        Self {
            swap_out: vec![0; chunks],
            swap_in: vec![0; chunks],
            recompute: vec![0; chunks],
            seen: vec![false; chunks],
            touched: Vec::new(),
            added: Vec::new(),
        }
    }

    /// Zeroes what the last sweep touched.
    fn clear(&mut self) {
        for &k in &self.touched {
            self.swap_out[k] = 0;
            self.swap_in[k] = 0;
            self.recompute[k] = 0;
            self.seen[k] = false;
        }
        self.touched.clear();
        self.added.clear();
    }
}

/// An order on policies, total: the last fields are the order `(n_persist, n_buffer,
/// n_swap, n_checkpoint)` in which the family is enumerated, so no two policies tie.
trait Order {
    /// What is compared.
    type Rank: Ord + Copy + Send + Sync;

    /// A policy's rank.
    fn rank(x: &Scored) -> Self::Rank;

    /// A rank that no policy with `layout`, at most `p_max` persistent chunks, a step time of
    /// at least `ticks` and at least `least` bytes outside activations ranks below.
    fn bound(layout: &Layout, least: u64, ticks: Ticks, p_max: u32) -> Self::Rank;
}

/// Fastest first; among equals, the one that moves the least: more persistent chunks, fewer
/// swapped or recomputed blocks, then fewer bytes. (This orders what is compiled; the winner
/// among the compiled is chosen by [`rank`].)
struct Fastest;

impl Order for Fastest {
    type Rank = (Ticks, Reverse<u32>, u32, u64, u32, u32, u32);

    fn rank(x: &Scored) -> Self::Rank {
        let k = x.key;
        (
            x.ticks,
            Reverse(k.n_persist),
            k.movement(),
            x.bytes,
            k.n_buffer,
            k.n_swap,
            k.n_checkpoint,
        )
    }

    fn bound(layout: &Layout, _least: u64, ticks: Ticks, p_max: u32) -> Self::Rank {
        let movement = layout.n_swap + layout.n_checkpoint;
        (ticks, Reverse(p_max), movement, 0, 0, 0, 0)
    }
}

/// Leanest first by estimated bytes, then as [`Fastest`].
struct Leanest;

impl Order for Leanest {
    type Rank = (u64, Ticks, Reverse<u32>, u32, u32, u32, u32);

    fn rank(x: &Scored) -> Self::Rank {
        let k = x.key;
        (
            x.bytes,
            x.ticks,
            Reverse(k.n_persist),
            k.movement(),
            k.n_buffer,
            k.n_swap,
            k.n_checkpoint,
        )
    }

    fn bound(layout: &Layout, least: u64, ticks: Ticks, p_max: u32) -> Self::Rank {
        let movement = layout.n_swap + layout.n_checkpoint;
        let bytes = layout.bytes.saturating_add(least);
        (bytes, ticks, Reverse(p_max), movement, 0, 0, 0)
    }
}

/// The policies in `O`'s order, handed out one at a time to a caller that may skip those
/// over a byte limit it tightens or loosens as it goes: the policies a full sort would hand
/// out, fetched `k` at a time from [`Estimator::best_after`].
struct Stream<'e, O: Order> {
    estimator: &'e Estimator<'e>,
    layouts: &'e [Layout],
    k: usize,
    /// The next policies after `cursor` within `listed_limit`, in order.
    list: VecDeque<Scored>,
    listed_limit: Option<u64>,
    /// Whether `list` holds every policy left within `listed_limit`.
    complete: bool,
    /// The last policy handed out or skipped.
    cursor: Option<O::Rank>,
    /// Whether a call found nothing: it skipped every policy left, as a walk would.
    finished: bool,
    /// Lists fetched and layouts swept so far.
    queries: usize,
    swept: usize,
    order: PhantomData<O>,
}

impl<'e, O: Order> Stream<'e, O> {
    fn new(estimator: &'e Estimator<'e>, layouts: &'e [Layout], k: usize) -> Self {
        Self {
            estimator,
            layouts,
            k: k.max(1),
            list: VecDeque::new(),
            listed_limit: None,
            complete: false,
            cursor: None,
            finished: false,
            queries: 0,
            swept: 0,
            order: PhantomData,
        }
    }

    /// The next policy whose estimated bytes are at most `limit`; those before it over the
    /// limit are skipped for good, as a caller walking a sorted list would.
    fn next(&mut self, limit: u64) -> Option<Scored> {
        if self.finished {
            return None;
        }
        loop {
            // A looser limit than the list was made for: policies it left out may now come
            // first.
            let stale = self.listed_limit.is_none_or(|listed| limit > listed);
            if stale || (self.list.is_empty() && !self.complete) {
                let (list, swept) =
                    self.estimator
                        .best_after::<O>(self.layouts, limit, self.cursor, self.k);
                self.complete = list.len() < self.k;
                self.list = list.into();
                self.listed_limit = Some(limit);
                self.queries += 1;
                self.swept += swept;
            }
            let Some(x) = self.list.pop_front() else {
                self.finished = true;
                return None;
            };
            self.cursor = Some(O::rank(&x));
            if x.bytes <= limit {
                return Some(x);
            }
        }
    }
}

/// The largest byte estimate that, scaled by `correction`, stays within 1% over `budget`:
/// the predicate `bytes * correction <= budget * 1.01` in floating point, as a limit.
fn corrected_limit(correction: f64, budget: u64) -> u64 {
    let allowed = budget as f64 * 1.01;
    // Not over, as the search always compared: a NaN product passes.
    let fits = |bytes: u64| {
        (bytes as f64 * correction).partial_cmp(&allowed) != Some(std::cmp::Ordering::Greater)
    };
    if fits(u64::MAX) {
        return u64::MAX;
    }
    // `fits` holds at 0 and not at u64::MAX, and only turns false once as bytes rise.
    let (mut lo, mut hi) = (0u64, u64::MAX);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The largest byte estimate that, less `over_count` (the most a compiled candidate's
/// estimate exceeded its exact arena), is within `budget`: no limit before any candidate
/// was compiled.
///
/// The estimate's error is mostly a constant (it counts the head and the workspaces as a
/// policy's peak would hold them all at once: 6.4 MB on the tiny GPT-2 of
/// `benches/compile_depth.rs` at every depth), which the ratio of [`corrected_limit`] turns
/// into a tolerance of 1% of the budget: at 1,024 of those layers that is three more swapped
/// layers than fit, and a whole batch of candidates that do not. A candidate this limit
/// skips would need a larger over-count than any seen to fit, so the search applies both
/// limits, and the ratio's alone where the over-count varies between candidates (real
/// models, whose activation estimate errs by a share of itself).
fn additive_limit(over_count: Option<i128>, budget: u64) -> u64 {
    over_count.map_or(u64::MAX, |over| {
        u64::try_from((i128::from(budget) + over).max(0)).unwrap_or(u64::MAX)
    })
}

/// Blocks that are not simply kept: what a policy swaps or recomputes.
fn blocks_moved(p: &Policy) -> usize {
    p.blocks.len() - p.count(BlockMode::Keep)
}

/// The winner `schedule` as the search returns it: the report and the real budgets (the
/// candidates were compiled without them) in its header.
fn with_budgets(
    mut schedule: Schedule,
    report: &SearchReport,
    options: &SearchOptions,
) -> Schedule {
    schedule.header.report = report.to_text();
    schedule.header.device_budget_bytes = options.device_budget;
    schedule.header.host_budget_bytes = options.host_budget;
    if schedule.disk_bytes > 0 {
        schedule.header.disk_budget_bytes = options.disk_budget;
    }
    schedule
}

/// Searches for the fastest policy that fits; returns its schedule (simulated, with the
/// report in its header) and the report.
///
/// With gradient accumulation over `K > 1` micro-batches on one rank it searches both
/// micro-batch orders ([`MicroBatchOrder`]): the sequential one, and the chunk-major one,
/// estimated on the [`interleave`](crate::interleave::interleave)d graph (each chunk moved once per step, the compute and
/// the activations of `K` micro-batches); the faster simulated winner is returned, the
/// sequential one where they tie. Several ranks search both orders too, `K` being a rank's
/// micro-batches ([`interleave_on`]): a sharded chunk gathered once per pass per step in
/// the chunk-major order, its gradients summed over the ranks once per micro-batch in
/// either ([`crate::data_parallel`]).
///
/// When nothing fits, the error says the smallest budget that would and what takes the
/// memory in that schedule.
pub fn search(
    training: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    options: &SearchOptions,
) -> Result<(Schedule, SearchReport)> {
    let ranks = u64::from(options.topology.ranks().max(1));
    let sequential = search_in_order(
        training,
        training,
        chunks,
        cost,
        options,
        MicroBatchOrder::Sequential,
    );
    if training.micro_batches() / ranks <= 1 {
        return sequential;
    }
    let interleaved = interleave_on(training, ranks)?;
    let chunk_major = search_in_order(
        training,
        &interleaved,
        chunks,
        cost,
        options,
        MicroBatchOrder::ChunkMajor,
    );
    let step = |r: &Result<(Schedule, SearchReport)>| {
        r.as_ref()
            .ok()
            .map(|(s, _)| s.header.prediction.step_seconds)
    };
    let orders = vec![
        (MicroBatchOrder::Sequential, step(&sequential)),
        (MicroBatchOrder::ChunkMajor, step(&chunk_major)),
    ];
    let chunk_major_wins = match (step(&sequential), step(&chunk_major)) {
        (Some(s), Some(c)) => !ties(s, c),
        (None, Some(_)) => true,
        _ => false,
    };
    let winner = match chunk_major_wins {
        true => chunk_major,
        false => sequential,
    };
    winner.map(|(schedule, mut report)| {
        report.orders = orders;
        (with_budgets(schedule, &report, options), report)
    })
}

/// [`search`] in one micro-batch `order` only (the chunk-major one estimated on the
/// [`interleave_on`]d graph of a rank's micro-batches), as [`search`] runs each of the two
/// it compares.
pub fn search_ordered(
    training: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    options: &SearchOptions,
    order: MicroBatchOrder,
) -> Result<(Schedule, SearchReport)> {
    match order {
        MicroBatchOrder::Sequential => {
            search_in_order(training, training, chunks, cost, options, order)
        }
        MicroBatchOrder::ChunkMajor => {
            let ranks = u64::from(options.topology.ranks().max(1));
            let interleaved = interleave_on(training, ranks)?;
            search_in_order(training, &interleaved, chunks, cost, options, order)
        }
    }
}

/// [`search`] in one micro-batch order: the policies of ProTrain's family with `order`,
/// estimated on `estimated` (the training graph, or for the chunk-major order its
/// interleaved graph) and compiled from `training`.
fn search_in_order(
    training: &Graph,
    estimated: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    options: &SearchOptions,
    order: MicroBatchOrder,
) -> Result<(Schedule, SearchReport)> {
    // The sequential order runs one micro-batch's program once per micro-batch of a rank;
    // the chunk-major order's interleaved graph holds them all.
    let repeats = match order {
        MicroBatchOrder::Sequential => {
            training.micro_batches() / u64::from(options.topology.ranks().max(1))
        }
        MicroBatchOrder::ChunkMajor => 1,
    };
    let profile = Profile::new(
        estimated,
        chunks,
        cost,
        options.topology,
        options.host_budgets(),
        repeats,
    );
    let estimator = Estimator::new(&profile);
    let layouts = estimator.layouts();
    // Estimates are rough: let candidates up to 25% over budget through to the exact plan.
    let slack = options
        .device_budget
        .saturating_add(options.device_budget / 4);
    let report = SearchReport::counted(&estimator, &layouts, slack);
    // Candidates are compiled without a budget (the search rejects those over it itself);
    // the winner gets the real budgets in its header.
    let flash_attention = profile.flash_attention;
    let header = |report: String| HeaderInputs {
        model: options.model.clone(),
        hardware: options.hardware.clone(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report,
        flash_attention,
    };
    // A candidate as the search compiles it: no budget and no report in its header.
    let compile = |policy: &Policy| {
        compile_policy_on(
            training,
            chunks,
            policy,
            header(String::new()),
            options.topology,
        )
    };
    // Every parameter's f32 master weight and Adam moments live somewhere: on the device
    // (persistent chunks), in host memory or on disk (streamed ones). Where even all three
    // budgets together cannot hold them, nothing fits, and no candidate need be compiled to
    // know it; and a candidate whose streamed chunks' state alone exceeds host and disk is
    // rejected without compiling it (a search that fails takes no longer than one that fits).
    let floor = offloaded_state_floor(training, chunks, options.topology.ranks());
    let host_and_disk = options.host_budget.saturating_add(options.disk_budget);
    // Whether the parameters are narrower than their f32 master weights: only then can
    // gradients live in the parameter storage.
    let narrow = crate::streams::state_bytes_per_element(training) == 12;
    if floor[0] > host_and_disk.saturating_add(options.device_budget) {
        let probe = host_leanest(chunks.len(), profile.layers, options, narrow, compile);
        let asked = Asked {
            training,
            chunks,
            profile: &profile,
            options,
        };
        return Err(too_small(asked, &report, None, probe.as_ref()));
    }

    // Two passes, each in batches of `COMPILE_BATCH` compiled in parallel, until four candidates fit:
    // 1. the fastest by estimate, skipping those whose estimated bytes, corrected by how the
    //    estimate compared with the exact plans so far (see `Contest::limit`), exceed the
    //    budget;
    // 2. if none of those fit, the leanest by estimate.
    // Both walk the policies whose estimated bytes are within `slack`, in their order.
    let listed = options.max_compiled.max(COMPILE_BATCH) + COMPILE_BATCH;
    let mut fastest = Stream::<Fastest>::new(&estimator, &layouts, listed);
    let mut leanest = Stream::<Leanest>::new(&estimator, &layouts, listed);
    let mut contest = Contest::new(report);
    let mut pass = 1;
    let mut compiled_in_pass = 0;
    loop {
        if !contest.contenders.is_empty()
            && (contest.report.compiled.len() >= 4 || compiled_in_pass >= options.max_compiled)
        {
            break;
        }
        let mut batch = Vec::with_capacity(COMPILE_BATCH);
        if compiled_in_pass < options.max_compiled {
            let limit = contest.limit(slack, options.device_budget);
            let mut next = || match pass {
                1 => fastest.next(limit),
                _ => leanest.next(slack),
            };
            batch.extend(std::iter::from_fn(&mut next).take(COMPILE_BATCH));
        }
        if batch.is_empty() {
            if !contest.contenders.is_empty() || pass == 2 {
                break;
            }
            pass = 2;
            compiled_in_pass = 0;
            continue;
        }
        compiled_in_pass += batch.len();
        let before = batch.len();
        batch.retain(|x| {
            floor
                .get(x.key.n_persist as usize)
                .is_none_or(|&f| f <= host_and_disk)
        });
        contest.report.rejected_host += before - batch.len();
        let results: Vec<(Policy, f64, u64, Result<Schedule>)> = batch
            .par_iter()
            .map(|x| {
                let policy = x.key.policy(profile.layers).with_order(order);
                let (policy, result) =
                    fit_host(policy, options, narrow, chunks.chunk_bytes, compile);
                (policy, profile.seconds(x.ticks), x.bytes, result)
            })
            .collect();
        for (policy, estimate, estimated_bytes, result) in results {
            contest.admit(policy, estimate, estimated_bytes, result, cost, options)?;
        }
        let probe = || host_leanest(chunks.len(), profile.layers, options, narrow, compile);
        if contest.hopeless(probe, options.host_budget) {
            break;
        }
        contest.keep_ties();
    }
    contest.report.layouts_swept = fastest.swept + leanest.swept;
    // On the host backend the device arena and the host region are the same memory.
    let (best, report) = contest.rank(profile.cpu_shares_cores);
    match best {
        Some(schedule) => Ok((with_budgets(schedule, &report, options), report)),
        None => Err(too_small(
            Asked {
                training,
                chunks,
                profile: &profile,
                options,
            },
            &report,
            contest.best_trade.as_ref(),
            contest.host_probe.flatten().as_ref(),
        )),
    }
}

/// The state of a search between batches: the report so far, the fitting candidates within
/// the tie tolerance of the fastest so far with their schedules (the winner is chosen among
/// them at the end), how the estimates compared with the exact plans, the candidate that
/// fits the device with the least host memory when none fits both, and the policy that
/// needs the least host memory once asked for (see [`host_leanest`]).
struct Contest {
    report: SearchReport,
    contenders: Vec<(Candidate, Schedule)>,
    /// Exact arena over estimated bytes, per compiled candidate.
    ratios: Vec<f64>,
    /// The most any compiled candidate's estimate over-counted its exact arena (negative if
    /// every estimate fell short); `None` before any.
    over_count: Option<i128>,
    best_trade: Option<Candidate>,
    host_probe: Option<Option<(Policy, u64)>>,
}

impl Contest {
    fn new(report: SearchReport) -> Self {
        Self {
            report,
            contenders: Vec::new(),
            ratios: Vec::new(),
            over_count: None,
            best_trade: None,
            host_probe: None,
        }
    }

    /// The most estimated bytes a candidate of the fastest pass may have: within `slack`,
    /// its estimate corrected by the median ratio of exact to estimated bytes so far (0.8
    /// before any, so a 25% over-estimate still gets through) within the budget, and its
    /// estimate less the largest over-count so far within it (see [`additive_limit`]).
    fn limit(&self, slack: u64, device_budget: u64) -> u64 {
        let correction = match self.ratios.len() {
            0 => 0.8,
            n => {
                let mut sorted = self.ratios.clone();
                sorted.sort_by(f64::total_cmp);
                sorted[n / 2]
            }
        };
        slack
            .min(corrected_limit(correction, device_budget))
            .min(additive_limit(self.over_count, device_budget))
    }

    /// Takes one compiled candidate: counts an invalid policy or one over the device by its
    /// exact plan as rejected (unsimulated: nothing reads its step time), simulates the
    /// rest, and keeps those that fit the host as contenders, else the best trade.
    fn admit(
        &mut self,
        policy: Policy,
        estimate: f64,
        estimated_bytes: u64,
        result: Result<Schedule>,
        cost: &dyn CostModel,
        options: &SearchOptions,
    ) -> Result<()> {
        let report = &mut self.report;
        let mut schedule = match result {
            Ok(s) => s,
            Err(CompileError::BadPolicy(_) | CompileError::TooFewBuffers { .. }) => {
                report.rejected_invalid += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        self.ratios
            .push(schedule.arena_bytes as f64 / estimated_bytes.max(1) as f64);
        let over = i128::from(estimated_bytes) - i128::from(schedule.arena_bytes);
        self.over_count = Some(self.over_count.map_or(over, |o| o.max(over)));
        if schedule.arena_bytes > options.device_budget {
            report.rejected_exact += 1;
            return Ok(());
        }
        let sim = simulate_unverified(&schedule, cost)
            .map_err(|e| CompileError::Simulation(e.to_string()))?;
        schedule.header.prediction.step_seconds = sim.step_seconds;
        schedule.header.prediction.stream_busy_seconds = sim.stream_busy_seconds.clone();
        let fits_host = schedule.host_bytes <= options.host_budget;
        if !fits_host {
            report.rejected_host += 1;
        }
        let candidate = Candidate {
            policy,
            estimated_seconds: estimate,
            simulated_seconds: sim.step_seconds,
            peak_device_bytes: schedule.arena_bytes,
            host_bytes: schedule.host_bytes,
            disk_bytes: schedule.disk_bytes,
            movement: movement_of(&schedule),
            fits: fits_host,
        };
        if candidate.fits {
            report.compiled.push(candidate.clone());
            self.contenders.push((candidate, schedule));
        } else if self
            .best_trade
            .as_ref()
            .is_none_or(|b: &Candidate| candidate.host_bytes < b.host_bytes)
        {
            self.best_trade = Some(candidate);
        }
        Ok(())
    }

    /// Whether no policy can fit the host: where candidates fit the device and none the host,
    /// asks once for the policy that needs the least host memory (`probe`, see
    /// [`host_leanest`]); if that does not fit `host_budget` either, nothing does.
    fn hopeless(
        &mut self,
        probe: impl FnOnce() -> Option<(Policy, u64)>,
        host_budget: u64,
    ) -> bool {
        if !self.contenders.is_empty() || self.best_trade.is_none() || self.host_probe.is_some() {
            return false;
        }
        let probe = probe();
        let hopeless = probe.as_ref().is_some_and(|&(_, host)| host > host_budget);
        self.host_probe = Some(probe);
        hopeless
    }

    /// Keeps only the contenders that can still tie with the fastest (schedules are large).
    fn keep_ties(&mut self) {
        let fastest = self
            .contenders
            .iter()
            .map(|(c, _)| c.simulated_seconds)
            .fold(f64::INFINITY, f64::min);
        self.contenders
            .retain(|(c, _)| ties(c.simulated_seconds, fastest));
    }

    /// The winner's schedule, if any fits, and the report with its compiled candidates
    /// sorted: ties first in the winner's order (so the winner heads the report), then the
    /// rest, fastest first, so that the report reads the same for any thread count.
    /// `one_memory`: the device arena and the host region are the same memory (the host
    /// backend).
    fn rank(&mut self, one_memory: bool) -> (Option<Schedule>, SearchReport) {
        let mut report = std::mem::take(&mut self.report);
        let fastest = fastest_of(&report.compiled);
        let rank = |a: &Candidate, b: &Candidate, fastest: f64| rank(a, b, fastest, one_memory);
        let best = std::mem::take(&mut self.contenders)
            .into_iter()
            .min_by(|(a, _), (b, _)| rank(a, b, fastest));
        report.compiled.sort_by(|a, b| {
            let tied = |c: &Candidate| ties(c.simulated_seconds, fastest);
            match (tied(a), tied(b)) {
                (true, true) => rank(a, b, fastest),
                (true, false) => std::cmp::Ordering::Less,
                (false, true) => std::cmp::Ordering::Greater,
                (false, false) => a
                    .simulated_seconds
                    .total_cmp(&b.simulated_seconds)
                    .then_with(|| rank(a, b, fastest)),
            }
        });
        (best.map(|(_, s)| s), report)
    }
}

/// Compiles `policy` and, where its schedule fits the device but not the host, repairs it
/// in three stages, each taken only where host memory still binds (so the schedules of
/// every search that fits stay as they were): gradients in the parameter storage (the
/// 14-byte layout, which costs no copy and no time), then staged chunks (the 12-byte layout,
/// as few as bring the host region within its budget, since each costs a cast per upload:
/// see [`stage_for`]), then the disk tier ([`crate::lower::disk_tier`]) for the optimizer
/// state host memory still cannot hold. Returns the policy as repaired and its schedule; a
/// schedule over host and disk both is returned as it was, for the search to reject.
fn fit_host(
    policy: Policy,
    options: &SearchOptions,
    narrow: bool,
    chunk_bytes: u64,
    compile: impl Fn(&Policy) -> Result<Schedule>,
) -> (Policy, Result<Schedule>) {
    let binds =
        |s: &Schedule| s.arena_bytes <= options.device_budget && s.host_bytes > options.host_budget;
    let result = compile(&policy);
    let (policy, result) = match result {
        Ok(s) if narrow && binds(&s) => {
            let lean = policy.with_layout(HostLayout::GradsInParams);
            match compile(&lean) {
                Ok(l) if l.host_bytes < s.host_bytes => (lean, Ok(l)),
                _ => (lean.with_layout(HostLayout::Full), Ok(s)),
            }
        }
        other => (policy, other),
    };
    let (policy, result) = match result {
        Ok(s) if narrow && binds(&s) => stage_for(&policy, s, options, chunk_bytes, &compile),
        other => (policy, other),
    };
    let result = match result {
        Ok(s) if options.disk_budget > 0 && binds(&s) => {
            match crate::lower::disk_tier(s.clone(), options.host_budgets()) {
                Err(CompileError::BudgetTooSmall(_)) => Ok(s),
                other => other,
            }
        }
        other => other,
    };
    (policy, result)
}

/// The policy of the family that needs the least host memory among those that fit the
/// device budget, with that need: every block checkpointed (the fewest activations on the
/// device, so the most room for persistent chunks, whose state leaves the host), the most
/// persistent chunks that fit (by bisection over exact plans: the arena grows with them) with
/// the fewest chunk buffers the family tries, and the leanest host layout (staged where
/// the parameters are narrower than f32, else the 16-byte one; the disk tier where allowed).
/// Returns the policy and its host bytes, `None` when not even the leanest fits the device.
/// The search asks once, when candidates fit the device and none the host: if this does not
/// fit the host, nothing does, and the search stops instead of compiling the rest.
fn host_leanest(
    chunks: usize,
    layers: usize,
    options: &SearchOptions,
    narrow: bool,
    compile: impl Fn(&Policy) -> Result<Schedule>,
) -> Option<(Policy, u64)> {
    let policy = |n_persist: usize| {
        let n_buffer = *buffer_choices(chunks, n_persist).start();
        Policy::protrain(n_persist as u32, n_buffer, 0, layers, layers)
    };
    let fits = |n_persist: usize| {
        compile(&policy(n_persist)).is_ok_and(|s| s.arena_bytes <= options.device_budget)
    };
    if !fits(0) {
        return None;
    }
    // Invariant: `lo` fits, `hi + 1` does not (or is past the last chunk).
    let (mut lo, mut hi) = (0usize, chunks);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let base = policy(lo);
    let layouts: &[HostLayout] = match narrow {
        true => &[HostLayout::GradsInParams, HostLayout::STAGED],
        false => &[HostLayout::Full],
    };
    let mut best: Option<(Policy, u64)> = None;
    for &layout in layouts {
        let p = base.clone().with_layout(layout);
        let Ok(s) = compile(&p) else { continue };
        let mut host = s.host_bytes;
        if options.disk_budget > 0 {
            // The disk tier's least: every chunk's state it can take on disk, if the disk
            // holds it all; else what it makes of this budget.
            match crate::disk::least_host(&s) {
                Some((h, disk)) if disk <= options.disk_budget => host = host.min(h),
                _ => {
                    if let Ok(d) = crate::lower::disk_tier(s, options.host_budgets()) {
                        host = host.min(d.host_bytes);
                    }
                }
            }
        }
        // Strictly less: where staging saves nothing (several ranks, clipping, loss
        // scaling stage no chunk) the 14-byte layout, tried first, is the one named.
        if best.as_ref().is_none_or(|(_, b)| host < *b) {
            best = Some((p, host));
        }
    }
    best
}

/// One streamed chunk as the disk tier sees it: its parameter storage and optimizer state
/// in bytes, and its CPU Adam in seconds.
#[derive(Clone, Copy, Debug)]
struct DiskChunk {
    storage: u64,
    state: u64,
    adam: f64,
}

/// How a streamed chunk keeps its storage in host memory, as far as the disk tier moves it
/// ([`crate::disk`]'s storage stage): which buffers of parameter storage's size it has, and
/// which of them can move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DiskLayout {
    /// The 14-byte layout: one buffer, uploaded from, offloaded into, updated; it moves.
    GradsInParams,
    /// The 16-byte layout: parameters (uploaded from, updated) and gradients (offloaded
    /// into, read by the update); both move.
    Full,
    /// Parameters, gradients and their host accumulators (summed by other kernels each
    /// micro-batch): only the parameters move.
    Accumulating,
}

impl DiskLayout {
    /// Buffers of the chunk's storage size on the host, moved or not.
    fn buffers(self) -> u64 {
        match self {
            DiskLayout::GradsInParams => 1,
            DiskLayout::Full => 2,
            DiskLayout::Accumulating => 3,
        }
    }

    /// Of those, the buffers that move to disk.
    fn moved(self) -> u64 {
        match self {
            DiskLayout::Full => 2,
            _ => 1,
        }
    }

    /// Per moved chunk, the reads and the writes of its storage size on the disk stream in
    /// each run of the forward and backward passes and in the update. Each of a run's two
    /// uploads reads the parameters and its gradient offload into moved storage is written
    /// (with accumulation the gradients stay on the host); the update reads what it reads
    /// (the gradients, and the parameters it rounds the master into) and writes the rounded
    /// parameters back.
    fn transfers(self) -> [(u64, u64); 2] {
        match self {
            DiskLayout::GradsInParams => [(2, 1), (1, 1)],
            DiskLayout::Full => [(2, 1), (2, 1)],
            DiskLayout::Accumulating => [(2, 0), (1, 1)],
        }
    }
}

/// For each `n_persist` from 0 to the chunk count, the seconds the disk tier ([`crate::disk`])
/// takes in a step as its one disk stream runs it, in each run of the forward and backward
/// passes and in the update, bounds no step with that many persistent chunks is under: the
/// disk busy with every read and write, and idle where it waits on the CPU Adam.
///
/// What moves is the pass's choice on the streamed chunks' host bytes (storage and state):
/// the state of the fewest chunks in the order the CPU Adam updates them (the last chunk
/// first), double buffered where that fits `budgets.host`, else through one staging
/// buffer; where every state moved is not enough, the storage of the fewest chunks too
/// (the largest first), each with its staging rings (one buffer of the largest moved storage
/// per slot for the update's parameters, the 16-byte layout's gradients, the uploads and the
/// gradient offloads, where each moves). A moved state is
/// read before its chunk's update and written back after (in the update); moved storage is
/// read and written as [`DiskLayout::transfers`] says. Through
/// one staging buffer the read of a chunk's state waits for the write of the one updated
/// before, which waits for its update: every moved chunk's CPU Adam leaves the disk idle.
/// Through two the disk reads the next state during an update, and waits on the last
/// moved chunk's update alone.
///
/// The choice depends on the host memory left beside the model states (a swapping layout's
/// activations take some), so each `n_persist` gets the choices by the host bytes they need
/// ([`DiskSteps`]): none where the host bytes fit, every streamed chunk's state and storage
/// through one buffer where nothing else does (such a policy is rejected once compiled).
/// Nothing without a disk budget (`budgets.disk`). It leaves out the other host buffers,
/// which the exact plan counts, and the disk's wait for the first gradients (the forward
/// and backward passes bound the step then).
fn disk_by_persist(
    chunks: &[DiskChunk],
    layout: DiskLayout,
    budgets: HostBudgets,
    read: impl Fn(u64) -> f64,
    write: impl Fn(u64) -> f64,
) -> Vec<DiskSteps<f64>> {
    let n = chunks.len();
    let mut seconds = vec![DiskSteps::default(); n + 1];
    if budgets.disk == 0 {
        return seconds;
    }
    // Each run of a step's program uploads a chunk twice.
    let uploads = 2;
    let [run, update] = layout.transfers();
    for p in 0..n {
        let streamed = &chunks[p..];
        let need: u64 = streamed
            .iter()
            .map(|c| c.state + layout.buffers() * c.storage)
            .sum();
        // Update order: the last chunk first. Storage moves the largest first.
        let by_update: Vec<&DiskChunk> = streamed.iter().rev().collect();
        let mut by_size = by_update.clone();
        by_size.sort_by_key(|c| Reverse(c.storage));
        // The host bytes with the state of the first `k` chunks in update order and the
        // storage of the first `j` by size on disk, through rings of `slots`.
        let host_after = |k: usize, j: usize, slots: u64| -> u64 {
            let state: u64 = by_update[..k].iter().map(|c| c.state).sum();
            let storage: u64 = by_size[..j].iter().map(|c| c.storage).sum();
            let largest_state = by_update[..k].iter().map(|c| c.state).max().unwrap_or(0);
            let largest_storage = by_size[..j].iter().map(|c| c.storage).max().unwrap_or(0);
            let ring = |uses: u64| slots.min(uses);
            let k = k as u64;
            let j = j as u64;
            let rings = ring(k) * largest_state
                + match layout {
                    DiskLayout::GradsInParams => ring(j) + ring(j * uploads) + ring(j),
                    DiskLayout::Full => 2 * ring(j) + ring(j * uploads) + ring(j),
                    DiskLayout::Accumulating => ring(j) + ring(j * uploads),
                } * largest_storage;
            (need - state - layout.moved() * storage).saturating_add(rings)
        };
        // The seconds of moving what a choice moves.
        let seconds_of = |(k, j, slots): (usize, usize, u64)| -> (f64, f64) {
            // Moved storage's reads and writes of `(reads, writes)` of its size each.
            let storage = |(reads, writes): (u64, u64)| -> f64 {
                by_size[..j]
                    .iter()
                    .map(|c| read(c.storage) * reads as f64 + write(c.storage) * writes as f64)
                    .sum()
            };
            let state: f64 = by_update[..k]
                .iter()
                .map(|c| read(c.state) + write(c.state))
                .sum();
            let idle = match (k, slots) {
                (0, _) => 0.0,
                (_, 1) => by_update[..k].iter().map(|c| c.adam).sum(),
                _ => by_update[k - 1].adam,
            };
            (storage(run), state + storage(update) + idle)
        };
        // Nothing moved, then the pass's choices in the order it tries them, then all of it
        // through one buffer (which the search rejects once compiled where it does not fit).
        let m = streamed.len();
        let tried = std::iter::once((0, 0, 2))
            .chain(
                [2, 1]
                    .into_iter()
                    .flat_map(|slots| (1..=m).map(move |k| (k, 0, slots))),
            )
            .chain(
                [2, 1]
                    .into_iter()
                    .flat_map(|slots| (1..=m).map(move |j| (m, j, slots))),
            );
        let mut steps: Vec<(u64, f64, f64)> = Vec::new();
        for choice in tried {
            let (k, j, slots) = choice;
            let host = host_after(k, j, slots);
            if steps.last().is_none_or(|&(h, _, _)| host < h) {
                let (run, update) = seconds_of(choice);
                let (before_run, before_update) = steps.last().map_or((0.0, 0.0), |s| (s.1, s.2));
                steps.push((host, run.max(before_run), update.max(before_update)));
            }
        }
        let (run, update) = seconds_of((m, m, 1));
        let (before_run, before_update) = steps.last().map_or((0.0, 0.0), |s| (s.1, s.2));
        steps.push((0, run.max(before_run), update.max(before_update)));
        seconds[p] = DiskSteps { steps };
    }
    seconds
}

/// The disk tier's time in a step for one `n_persist`, by the host memory left to it: the
/// choices of [`disk_by_persist`] that need fewer host bytes than every one the pass tries
/// before, each with its seconds in each run of the passes and in the update (made to rise
/// as the host bytes fall); the last needs none. No disk tier where empty.
#[derive(Clone, Debug, Default, PartialEq)]
struct DiskSteps<T> {
    steps: Vec<(u64, T, T)>,
}

impl<T: Copy + Default> DiskSteps<T> {
    /// The seconds per run and in the update of the choice the pass takes with `host` bytes
    /// of host memory for the streamed chunks.
    fn at(&self, host: u64) -> (T, T) {
        self.steps
            .iter()
            .find(|&&(need, _, _)| need <= host)
            .or(self.steps.last())
            .map_or((T::default(), T::default()), |&(_, run, update)| {
                (run, update)
            })
    }

    /// The same steps in other units.
    fn map<U>(&self, f: impl Fn(T) -> U) -> DiskSteps<U> {
        DiskSteps {
            steps: self
                .steps
                .iter()
                .map(|&(need, run, update)| (need, f(run), f(update)))
                .collect(),
        }
    }
}

/// For each entry of `disk`, the most over it and those after it at `host` bytes of host
/// memory, in the units of `ticks` ([`Profile::disk_floor`]).
fn disk_floor<T: Copy + Default>(
    disk: &[DiskSteps<T>],
    host: u64,
    ticks: impl Fn(T) -> Ticks,
) -> Vec<(Ticks, Ticks)> {
    let mut floor = vec![(0, 0); disk.len()];
    let mut most = (0, 0);
    for (p, steps) in disk.iter().enumerate().rev() {
        let (run, update) = steps.at(host);
        most = (most.0.max(ticks(run)), most.1.max(ticks(update)));
        floor[p] = most;
    }
    floor
}

/// For each `n_persist` from 0 to the chunk count, the bytes of f32 master weights and Adam
/// moments (12 per parameter) of the chunks it streams, per rank (a sharded chunk's are
/// split over `ranks`): what such a policy must keep in host memory or on disk at the least,
/// whatever its layout. Where no chunk can be staged (the parameters narrower than f32 and
/// several ranks, clipping or loss scaling: see [`HostLayout::Staged`]), the parameters'
/// own storage too, which the uploads read from host memory (the 14-byte layout).
fn offloaded_state_floor(training: &Graph, chunks: &ChunkTable, ranks: u32) -> Vec<u64> {
    let narrow = crate::streams::state_bytes_per_element(training) == 12;
    let unstaged = narrow && (ranks > 1 || training.ops().any(|(_, op)| op.kind.is_grad_coef()));
    let state: Vec<u64> = training
        .params()
        .map(|(_, p)| {
            let ty = &training.value(p.value).ty;
            ty.numel() * 12 + if unstaged { ty.bytes() } else { 0 }
        })
        .collect();
    let ranks = u64::from(ranks.max(1));
    let mut floor = vec![0u64; chunks.len() + 1];
    for (i, chunk) in chunks.chunks.iter().enumerate().rev() {
        let params: u64 = chunk
            .members
            .iter()
            .map(|m| state.get(m.param.index()).copied().unwrap_or(0))
            .sum();
        floor[i] = floor[i + 1].saturating_add(params / ranks);
    }
    floor
}

/// The per-chunk choice of the 12-byte layout for a candidate whose 14-byte schedule `lean`
/// fits the device but not `host_budget`: stages the fewest chunks that save the excess
/// (each staged chunk saves its parameter storage, about `chunk_bytes`; the four staging
/// buffers cost four chunks once), which [`HostLayout::Staged`] takes among the chunks
/// uploaded fewest times per step; every eligible chunk when that is not enough. Returns the
/// leanest schedule tried (`lean` itself when staging saves nothing: clipping, loss scaling
/// or several ranks keep the 14-byte floor) with its policy; but where a disk tier is
/// allowed and staging every chunk still does not fit, `lean`, whose optimizer state the
/// disk tier can take (a staged chunk's stays on the host for its casts).
fn stage_for(
    policy: &Policy,
    lean: Schedule,
    options: &SearchOptions,
    chunk_bytes: u64,
    compile: impl Fn(&Policy) -> Result<Schedule>,
) -> (Policy, Result<Schedule>) {
    let host_budget = options.host_budget;
    let over = lean.host_bytes - host_budget;
    let some = (over + 4 * chunk_bytes).div_ceil(chunk_bytes.max(1)) as u32;
    let mut best: Option<(Policy, Schedule)> = None;
    let first =
        (some < lean.chunks.len() as u32).then_some(HostLayout::Staged { limit: Some(some) });
    for layout in first.into_iter().chain([HostLayout::STAGED]) {
        let staged = policy.clone().with_layout(layout);
        let least = best.as_ref().map_or(lean.host_bytes, |(_, b)| b.host_bytes);
        match compile(&staged) {
            Ok(s) if s.host_bytes < least => {
                let fits = s.host_bytes <= host_budget;
                best = Some((staged, s));
                if fits {
                    break;
                }
            }
            _ => {}
        }
    }
    match best {
        // Where a disk tier may take what still does not fit, it takes the 14-byte
        // schedule's state.
        Some((_, s)) if s.host_bytes > host_budget && options.disk_budget > 0 => {
            (policy.clone(), Ok(lean))
        }
        Some((p, s)) => (p, Ok(s)),
        None => (policy.clone(), Ok(lean)),
    }
}

/// Candidates compiled in parallel at a time. A constant, not the thread count: which
/// candidates are compiled (the search stops after the batch in which the fourth fits, and
/// calibrates its memory estimate between batches) must not depend on the machine, or the
/// chosen schedule and its report would change with `RAYON_NUM_THREADS`.
pub const COMPILE_BATCH: usize = 8;

/// Relative difference in simulated step time under which two candidates tie: below what
/// the simulator can promise (its predictions are within a few percent of measurement).
pub const TIE_TOLERANCE: f64 = 0.005;

/// Whether a step time of `t` ties with the fastest, `fastest`.
fn ties(t: f64, fastest: f64) -> bool {
    t <= fastest * (1.0 + TIE_TOLERANCE)
}

/// The fastest simulated step time among `compiled` (infinity when none).
fn fastest_of(compiled: &[Candidate]) -> f64 {
    compiled
        .iter()
        .filter(|c| c.fits)
        .map(|c| c.simulated_seconds)
        .fold(f64::INFINITY, f64::min)
}

/// How the search breaks ties, for people: `explain` and the search report state it.
pub const TIE_RULE: &str = "among policies predicted within 0.5% of the fastest, the one that \
     moves least wins (bytes over PCIe and to and from disk, then FLOPs recomputed), then the \
     one with the least device memory: a prediction is least sure where data moves, and free \
     memory costs nothing";

/// What a schedule moves in one step, the first tie-breaker of the search ([`TIE_RULE`]).
///
/// Ordered by `bytes`, then `recomputed_flops`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Movement {
    /// Bytes copied between device and host memory (both ways) and read from or written to
    /// disk, every micro-batch counted.
    pub bytes: u64,
    /// FLOPs of the forward ops re-run in the backward pass (checkpointed blocks), every
    /// micro-batch counted.
    pub recomputed_flops: u64,
}

/// [`Movement`] of a schedule: its copies between the device and the host and to or from
/// disk (copies within one memory and collectives are not counted: every candidate of a
/// search runs on the same ranks), and the FLOPs of its recompute-phase kernels.
/// Instructions before a stream's micro-batch marker count once per micro-batch.
pub fn movement_of(schedule: &Schedule) -> Movement {
    use protrain_ir::Instr;
    let micro_batches = u64::from(schedule.micro_batches());
    let space =
        |t: &protrain_ir::TensorRef| schedule.buffers.get(t.buffer.index()).map(|b| b.space);
    let graph = &schedule.graph;
    let mut movement = Movement::default();
    for stream in &schedule.streams {
        let mut repeat = micro_batches;
        for instr in &stream.instrs {
            match instr {
                Instr::EndMicroBatch { .. } => repeat = 1,
                Instr::Copy {
                    src, dst, bytes, ..
                }
                | Instr::CopyShard {
                    src, dst, bytes, ..
                }
                | Instr::DiskRead {
                    src, dst, bytes, ..
                }
                | Instr::DiskWrite {
                    src, dst, bytes, ..
                } => {
                    let moves = match (space(src), space(dst)) {
                        (Some(a), Some(b)) => a != b,
                        _ => false,
                    };
                    if moves {
                        movement.bytes =
                            movement.bytes.saturating_add(bytes.saturating_mul(repeat));
                    }
                }
                Instr::Kernel { op, .. } if op.index() < graph.op_count() => {
                    let op = graph.op(*op);
                    if op.phase == Phase::Recompute {
                        let ins: Vec<_> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
                        let outs: Vec<_> = op.outputs.iter().map(|&v| &graph.value(v).ty).collect();
                        movement.recomputed_flops = movement
                            .recomputed_flops
                            .saturating_add(op.kind.flops(&ins, &outs).saturating_mul(repeat));
                    }
                }
                _ => {}
            }
        }
    }
    movement
}

/// The winner's order ([`TIE_RULE`]): a candidate that does not tie with `fastest` loses to
/// one that does; among ties, the least [`Movement`] (bytes over PCIe and to and from disk,
/// then FLOPs recomputed: where data moves a prediction is least sure, and free memory costs
/// nothing, so a policy that streams or swaps with the device half empty is a poor bet),
/// then the least device memory, then the least host memory, then the fewer blocks swapped
/// or recomputed, the faster, and the policy's text, so the order is total and depends on
/// nothing but the candidates. With `one_memory` (the host backend, whose "device" arena is
/// host memory too) the least device and host memory together, then the fewer blocks moved,
/// come before the least device memory: there, streaming a chunk or swapping a block moves
/// bytes from one part of the same memory to another, so shrinking the arena saves nothing.
fn rank(a: &Candidate, b: &Candidate, fastest: f64, one_memory: bool) -> std::cmp::Ordering {
    let (ta, tb) = (
        ties(a.simulated_seconds, fastest),
        ties(b.simulated_seconds, fastest),
    );
    let together = |c: &Candidate| match one_memory {
        true => (
            c.peak_device_bytes.saturating_add(c.host_bytes),
            blocks_moved(&c.policy),
        ),
        false => (0, 0),
    };
    tb.cmp(&ta)
        .then(a.movement.cmp(&b.movement))
        .then(together(a).cmp(&together(b)))
        .then(a.peak_device_bytes.cmp(&b.peak_device_bytes))
        .then(a.host_bytes.cmp(&b.host_bytes))
        .then(blocks_moved(&a.policy).cmp(&blocks_moved(&b.policy)))
        .then(a.simulated_seconds.total_cmp(&b.simulated_seconds))
        .then_with(|| a.policy.to_string().cmp(&b.policy.to_string()))
}

/// What a search was asked, for the error when nothing fits: the training graph, its chunks,
/// their profile and the search's options.
#[derive(Clone, Copy)]
struct Asked<'a> {
    training: &'a Graph,
    chunks: &'a ChunkTable,
    profile: &'a Profile,
    options: &'a SearchOptions,
}

impl Asked<'_> {
    /// Compiles `policy` as the search compiles a candidate: no budget and no report in its
    /// header.
    fn compile(&self, policy: &Policy) -> Result<Schedule> {
        let header = HeaderInputs {
            model: self.options.model.clone(),
            hardware: self.options.hardware.clone(),
            device_budget_bytes: u64::MAX,
            host_budget_bytes: u64::MAX,
            report: String::new(),
            flash_attention: self.profile.flash_attention,
        };
        compile_policy_on(
            self.training,
            self.chunks,
            policy,
            header,
            self.options.topology,
        )
    }

    /// Whether the parameters are narrower than their f32 master weights.
    fn narrow(&self) -> bool {
        crate::streams::state_bytes_per_element(self.training) == 12
    }
}

/// The error for a budget nothing fits: compiles the leanest policy to say what it needs,
/// and names the ways out with the figures that would fit: [`host_too_small`] where the
/// leanest fits the device but not the host, else [`device_too_small`]. `host_leanest` is
/// the policy that needs the least host memory among those that fit the device, where the
/// search found it ([`host_leanest`]).
fn too_small(
    asked: Asked,
    report: &SearchReport,
    best_trade: Option<&Candidate>,
    host_leanest: Option<&(Policy, u64)>,
) -> CompileError {
    let streamed = asked.chunks.len() as u32;
    // Gradients in the parameter storage where the parameters are narrower than their f32
    // master weights (an f32 parameter is its own master, which the update reads).
    // Staged where it can be (one rank, no clipping or loss scaling), else 14 bytes.
    let layout = match asked.narrow() {
        true => HostLayout::STAGED,
        false => HostLayout::Full,
    };
    let lean =
        Policy::zero3_offload(streamed.clamp(1, 2), asked.profile.layers).with_layout(layout);
    let options = asked.options;
    match asked.compile(&lean) {
        Ok(s) if s.arena_bytes <= options.device_budget && s.host_bytes > options.host_budget => {
            host_too_small(asked, report, &lean, &s, best_trade, host_leanest)
        }
        Ok(s) => device_too_small(asked, report, &lean, &s),
        Err(e) => e,
    }
}

/// The error where the leanest policy `lean` (its schedule `s`) fits the device but not the
/// host. Budgets are quoted per rank (the pipeline adds the node's figures where several
/// ranks share a node), and the figures to give per node (`--host-memory` and
/// `--disk-memory` are a node's, shared by its `gpus` ranks); the least host need found
/// (of `lean`, `best_trade` and `host_leanest`) is the smallest `--host-memory` quoted.
fn host_too_small(
    asked: Asked,
    report: &SearchReport,
    lean: &Policy,
    s: &Schedule,
    best_trade: Option<&Candidate>,
    host_leanest: Option<&(Policy, u64)>,
) -> CompileError {
    let options = asked.options;
    let narrow = asked.narrow();
    let gpus = options.topology.gpus.max(1);
    // Staging needs one rank, no clipping and no loss scaling: where a schedule stages
    // nothing, it is the 14-byte layout's, and its policy says so.
    let lean = match (lean.host_layout, s.staged_chunks().is_empty()) {
        (HostLayout::Staged { .. }, true) if narrow => {
            lean.clone().with_layout(HostLayout::GradsInParams)
        }
        _ => lean.clone(),
    };
    // The least host memory any policy found needs beside a device within budget:
    // the leanest, the best trade the search compiled, or the policy that needs the
    // least ([`host_leanest`], the disk tier included where allowed).
    let mut least = (lean.clone(), s.host_bytes);
    if let Some(b) = best_trade {
        if b.host_bytes < least.1 {
            least = (b.policy.clone(), b.host_bytes);
        }
    }
    if let Some((p, host)) = host_leanest {
        if *host < least.1 {
            least = (p.clone(), *host);
        }
    }
    let (least_policy, least_host) = least;
    let problem = |disk| ShortfallProblem::HostTooSmall {
        host_budget: options.host_budget,
        gpus,
        tried: report.enumerated,
        lean: lean.to_string(),
        lean_layout: lean.host_layout.number(),
        lean_host: s.host_bytes,
        lean_device: s.arena_bytes,
        least_policy: least_policy.to_string(),
        least_host,
        disk,
    };
    if options.disk_budget > 0 {
        // The least found includes the disk tier's help already; the error says what it
        // leaves in host memory with every model state it can take on disk, which no disk
        // budget takes.
        let kept = asked
            .compile(&least_policy)
            .ok()
            .map(|l| {
                let most = crate::disk::every_state(l.clone(), 1).unwrap_or(l);
                crate::disk::host_kept(&most)
            })
            .unwrap_or_default()
            .into_iter()
            .map(|(what, bytes)| (what.to_string(), bytes))
            .collect();
        return Shortfall::error(problem(HostDisk::Used {
            budget: options.disk_budget,
            kept,
        }));
    }
    // The disk tier takes the state of the 14-byte (or f32) layout's chunks; a
    // staged chunk's stays on the host for its casts.
    let for_disk = host_leanest.map_or(lean.clone(), |(p, _)| p.clone());
    let with_disk = match narrow {
        true => asked
            .compile(&for_disk.with_layout(HostLayout::GradsInParams))
            .ok(),
        false => asked.compile(&for_disk).ok(),
    }
    .and_then(|d| crate::disk::least_host(&d));
    match with_disk {
        Some((host, disk)) if host < least_host => {
            Shortfall::error(problem(HostDisk::Would { disk, host }))
        }
        _ => Shortfall::error(problem(HostDisk::No)),
    }
}

/// The error where not even the leanest policy `lean` (its schedule `s`) fits the device:
/// what its arena holds, and the ways out (a larger budget, a smaller batch with
/// accumulation, a shorter sequence).
fn device_too_small(
    asked: Asked,
    report: &SearchReport,
    lean: &Policy,
    s: &Schedule,
) -> CompileError {
    let options = asked.options;
    let training = asked.training;
    let gpus = options.topology.gpus.max(1);
    let host_over =
        (s.host_bytes > options.host_budget).then_some((s.host_bytes, options.host_budget));
    Shortfall::error(ShortfallProblem::DeviceTooSmall {
        device_budget: options.device_budget,
        tried: report.enumerated,
        lean: lean.to_string(),
        need: s.arena_bytes,
        memory: s.header.prediction.memory,
        host_over,
        gpus,
        batch: training.info.batch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{estimate_iteration, estimate_iteration_sharing_cores, ChunkTimes};
    use proptest::prelude::*;

    /// Budgets without a disk tier: no policy's estimate prices disk traffic.
    const NO_DISK: HostBudgets = HostBudgets { host: 0, disk: 0 };

    impl Profile {
        /// The per-layer loop the sweeps replace: ProTrain's chunk times, each layer adding
        /// to its chunk's, summed chunk by chunk. The reference the sweeps must equal.
        fn direct_ticks(&self, key: Key) -> Ticks {
            let n = self.chunks();
            let p = key.n_persist as usize;
            // forward compute, backward compute, recompute, forward comm, backward comm
            let mut times: Vec<[Ticks; 5]> = (0..n)
                .map(|c| {
                    let streamed = c >= p;
                    [
                        self.forward[c],
                        self.backward[c],
                        0,
                        if streamed { self.fetch[c] } else { 0 },
                        if streamed { self.backward_comm[c] } else { 0 },
                    ]
                })
                .collect();
            let mut swapped = 0;
            for l in 0..self.layers {
                let c = self.layer_chunk[l];
                let (s, k) = (key.n_swap as usize, key.n_checkpoint as usize);
                match Policy::protrain_mode(l, s, k, self.layers) {
                    BlockMode::Keep => {}
                    BlockMode::Checkpoint => times[c][2] += self.layer_forward[l],
                    BlockMode::Swap => {
                        swapped += self.layer_saved[l];
                        times[c][3] += self.swap_out[l];
                        times[c][4] += self.swap_in[l];
                        if self.cpu_shares_cores {
                            // On the host a swap also takes compute's time.
                            times[c][0] += self.swap_out[l];
                            times[c][2] += self.swap_in[l];
                        }
                    }
                }
            }
            let gpu: Ticks = (0..p).map(|c| self.gpu_adam[c]).sum();
            let cpu: Ticks = (p..n).map(|c| self.cpu_adam[c]).sum();
            let forward: Ticks = times.iter().map(|t| t[0].max(t[3])).sum();
            let backward: Ticks = times.iter().map(|t| (t[1] + t[2]).max(t[4])).sum();
            let (run, update) = self.disk_at(p, swapped);
            match self.repeats {
                1 => (forward + self.after_forward(backward + gpu, cpu)).max(run + update),
                k => k * (forward + backward).max(run) + self.after_forward(gpu, cpu.max(update)),
            }
        }

        /// The per-layer loop of the device bytes.
        fn direct_bytes(&self, key: Key) -> u64 {
            let p = key.n_persist as usize;
            let persistent: u128 = (0..p).map(|c| u128::from(self.resident_bytes[c])).sum();
            let buffers = if p < self.chunks() {
                (u128::from(key.n_buffer) + 2) * u128::from(self.chunk_capacity)
            } else {
                0
            };
            let mut activations = u128::from(self.head_bytes);
            let (mut recompute_peak, mut swap_peak) = (0, 0);
            for l in 0..self.layers {
                let (s, k) = (key.n_swap as usize, key.n_checkpoint as usize);
                let saved = u128::from(self.layer_saved[l]);
                match Policy::protrain_mode(l, s, k, self.layers) {
                    BlockMode::Keep => activations += saved,
                    BlockMode::Checkpoint => {
                        activations += u128::from(self.layer_input[l]);
                        recompute_peak = recompute_peak.max(saved);
                    }
                    BlockMode::Swap => {
                        activations += u128::from(self.layer_input[l]);
                        swap_peak = swap_peak.max(saved);
                    }
                }
            }
            clamp(persistent + buffers + activations + recompute_peak + 3 * swap_peak)
        }
    }

    /// Every policy of the family, in enumeration order.
    fn every_key(chunks: usize, layers: usize) -> Vec<Key> {
        let mut keys = Vec::new();
        for p in 0..=chunks {
            for n_buffer in buffer_choices(chunks, p) {
                for n_swap in 0..=layers as u32 {
                    for n_checkpoint in 0..=layers as u32 - n_swap {
                        keys.push(Key {
                            n_persist: p as u32,
                            n_buffer,
                            n_swap,
                            n_checkpoint,
                        });
                    }
                }
            }
        }
        keys
    }

    /// Every policy with its estimates by the per-layer loop.
    fn scored_directly(profile: &Profile) -> Vec<Scored> {
        every_key(profile.chunks(), profile.layers)
            .into_iter()
            .map(|key| Scored {
                ticks: profile.direct_ticks(key),
                bytes: profile.direct_bytes(key),
                key,
            })
            .collect()
    }

    /// Every policy with its estimates by the sweeps, keyed by policy.
    fn scored_by_sweeps(estimator: &Estimator, limit: u64) -> HashMap<Key, Scored> {
        let mut scratch = Scratch::new(estimator.chunks);
        let mut found = HashMap::new();
        for layout in estimator.layouts() {
            estimator.sweep(&mut scratch, &layout, limit, |x| {
                assert!(found.insert(x.key, x).is_none(), "{:?} swept twice", x.key);
            });
        }
        found
    }

    /// Small random profiles: few chunks and layers, small times so that many estimates tie,
    /// layers in any chunk and order; in half of them every layer is the same, as in a real
    /// stack of transformer blocks; steps of one to three micro-batches run in turn.
    fn profiles() -> impl Strategy<Value = Profile> {
        (
            1usize..=5,
            0usize..=7,
            any::<bool>(),
            any::<bool>(),
            1u64..=3,
        )
            .prop_flat_map(|(chunks, layers, uniform, cpu_shares_cores, repeats)| {
                let per_chunk = move || prop::collection::vec(0u64..6, chunks);
                let per_layer = move |top: u64| prop::collection::vec(0u64..top, layers);
                (
                    (
                        per_chunk(),
                        per_chunk(),
                        per_chunk(),
                        per_chunk(),
                        per_chunk(),
                        per_chunk(),
                    ),
                    (
                        prop::collection::vec(1u64..60, chunks),
                        1u64..30,
                        0u64..40,
                        (
                            prop::collection::vec((0u64..12, 0u64..4, 0u64..100), chunks + 1),
                            0u64..120,
                        ),
                    ),
                    (
                        prop::collection::vec(0..chunks, layers),
                        per_layer(4),
                        per_layer(4),
                        per_layer(4),
                        per_layer(40),
                        per_layer(20),
                    ),
                    Just((uniform, cpu_shares_cores, repeats)),
                )
            })
            .prop_map(
                |(
                    c,
                    (resident_bytes, chunk_capacity, head_bytes, (disk, host_budget)),
                    l,
                    (uniform, cpu_shares_cores, repeats),
                )| {
                    let (forward, backward, fetch, backward_comm, gpu_adam, cpu_adam) = c;
                    // The disk tier: none where `need` host bytes are left, else its
                    // ticks per run and in the update.
                    let disk: Vec<DiskSteps<Ticks>> = disk
                        .into_iter()
                        .map(|(update, run, need)| DiskSteps {
                            steps: vec![(need, 0, 0), (0, run, update)],
                        })
                        .collect();
                    let (mut layer_chunk, mut fwd, mut out, mut back, mut saved, mut input) = l;
                    if uniform {
                        layer_chunk.sort_unstable();
                        for v in [&mut fwd, &mut out, &mut back, &mut saved, &mut input] {
                            if let Some(&first) = v.first() {
                                v.iter_mut().for_each(|x| *x = first);
                            }
                        }
                    }
                    Profile {
                        layers: layer_chunk.len(),
                        ticks_per_second: 1.0,
                        forward,
                        backward,
                        fetch,
                        backward_comm,
                        gpu_adam,
                        cpu_adam,
                        disk_floor: disk_floor(&disk, host_budget, |t| t),
                        disk,
                        host_budget,
                        repeats,
                        cpu_shares_cores,
                        flash_attention: true,
                        resident_bytes,
                        chunk_capacity,
                        layer_chunk,
                        layer_forward: fwd,
                        swap_out: out,
                        swap_in: back,
                        layer_saved: saved,
                        layer_input: input,
                        head_bytes,
                    }
                },
            )
    }

    /// What walking a full sort would hand out: `sorted` in order, skipping for good those
    /// over each call's limit.
    fn walk(sorted: &[Scored], limits: &[u64]) -> Vec<Option<Key>> {
        let mut next = 0;
        limits
            .iter()
            .map(|&limit| {
                while next < sorted.len() {
                    next += 1;
                    if sorted[next - 1].bytes <= limit {
                        return Some(sorted[next - 1].key);
                    }
                }
                None
            })
            .collect()
    }

    /// The same calls on a [`Stream`] fetching `k` policies at a time.
    fn stream<O: Order>(estimator: &Estimator, limits: &[u64], k: usize) -> Vec<Option<Key>> {
        let layouts = estimator.layouts();
        let mut stream = Stream::<O>::new(estimator, &layouts, k);
        limits
            .iter()
            .map(|&limit| stream.next(limit).map(|x| x.key))
            .collect()
    }

    proptest! {
        #[test]
        fn sweeps_reproduce_the_per_layer_loop(profile in profiles()) {
            let estimator = Estimator::new(&profile);
            let swept = scored_by_sweeps(&estimator, u64::MAX);
            let direct = scored_directly(&profile);
            prop_assert_eq!(swept.len(), direct.len());
            for x in direct {
                prop_assert_eq!(swept.get(&x.key), Some(&x));
            }
        }

        #[test]
        fn a_sweep_hands_out_exactly_the_policies_within_its_limit(
            profile in profiles(),
            limit in 0u64..400,
        ) {
            let estimator = Estimator::new(&profile);
            let swept = scored_by_sweeps(&estimator, limit);
            let within: Vec<Scored> = scored_directly(&profile)
                .into_iter()
                .filter(|x| x.bytes <= limit)
                .collect();
            prop_assert_eq!(swept.len(), within.len());
            for x in within {
                prop_assert_eq!(swept.get(&x.key), Some(&x));
            }
            let mut sorted: Vec<u64> = estimator.layouts().iter().map(|l| l.bytes).collect();
            sorted.sort_unstable();
            let over = scored_directly(&profile).iter().filter(|x| x.bytes > limit).count();
            prop_assert_eq!(estimator.count_over(&sorted, limit), over);
            prop_assert_eq!(
                estimator.policy_count(sorted.len()),
                every_key(profile.chunks(), profile.layers).len()
            );
        }

        #[test]
        fn no_policy_ranks_below_its_layouts_bound(profile in profiles(), limit in 0u64..400) {
            let estimator = Estimator::new(&profile);
            let mut scratch = Scratch::new(estimator.chunks);
            for layout in estimator.layouts() {
                let room = u128::from(limit).checked_sub(u128::from(layout.bytes));
                let p_max = room.and_then(|room| estimator.max_persist(room));
                let mut any = false;
                estimator.sweep(&mut scratch, &layout, limit, |x| {
                    any = true;
                    let p_max = p_max.expect("a policy fits, so a most persistent one does");
                    assert!(x.key.n_persist as usize <= p_max, "{x:?} over p_max {p_max}");
                    let ticks = estimator.time_bound(&layout, p_max);
                    assert!(ticks <= x.ticks, "{x:?}: bound {ticks}");
                    let least = clamp(estimator.least);
                    let (p, t) = (p_max as u32, ticks);
                    assert!(Fastest::bound(&layout, least, t, p) <= Fastest::rank(&x));
                    assert!(Leanest::bound(&layout, least, t, p) <= Leanest::rank(&x));
                });
                if p_max.is_some() {
                    // The most persistent chunks possible is reached by some policy.
                    prop_assert!(any, "{layout:?} has room for n_persist {p_max:?} but sweeps none");
                }
            }
        }

        #[test]
        fn streams_hand_out_what_walking_a_full_sort_would(
            profile in profiles(),
            limits in prop::collection::vec(0u64..300, 1..40),
            k in 1usize..5,
        ) {
            let estimator = Estimator::new(&profile);
            let mut all = scored_directly(&profile);
            all.sort_by_key(Fastest::rank);
            prop_assert_eq!(stream::<Fastest>(&estimator, &limits, k), walk(&all, &limits));
            all.sort_by_key(Leanest::rank);
            prop_assert_eq!(stream::<Leanest>(&estimator, &limits, k), walk(&all, &limits));
        }

        #[test]
        fn the_integer_estimate_is_protrains_formula(profile in profiles()) {
            // Small integers are exact in floating point, so the formula in `cost` must give
            // the same numbers.
            let n = profile.chunks();
            for key in every_key(n, profile.layers) {
                let p = key.n_persist as usize;
                let mut times: Vec<ChunkTimes> = (0..n)
                    .map(|c| ChunkTimes {
                        forward_compute: profile.forward[c] as f64,
                        backward_compute: profile.backward[c] as f64,
                        recompute: 0.0,
                        forward_comm: if c >= p { profile.fetch[c] as f64 } else { 0.0 },
                        backward_comm: if c >= p { profile.backward_comm[c] as f64 } else { 0.0 },
                    })
                    .collect();
                for l in 0..profile.layers {
                    let c = profile.layer_chunk[l];
                    let (s, k) = (key.n_swap as usize, key.n_checkpoint as usize);
                    match Policy::protrain_mode(l, s, k, profile.layers) {
                        BlockMode::Keep => {}
                        BlockMode::Checkpoint => times[c].recompute += profile.layer_forward[l] as f64,
                        BlockMode::Swap => {
                            times[c].forward_comm += profile.swap_out[l] as f64;
                            times[c].backward_comm += profile.swap_in[l] as f64;
                            if profile.cpu_shares_cores {
                                // On the host a swap takes compute's cores as well.
                                times[c].forward_compute += profile.swap_out[l] as f64;
                                times[c].recompute += profile.swap_in[l] as f64;
                            }
                        }
                    }
                }
                let gpu: f64 = (0..p).map(|c| profile.gpu_adam[c] as f64).sum();
                let cpu: f64 = (p..n).map(|c| profile.cpu_adam[c] as f64).sum();
                let swapped = profile.swapped_bytes(key.n_swap, key.n_checkpoint);
                let (run, update) = profile.disk_at(p, swapped);
                let (run, update) = (run as f64, update as f64);
                let formula = match (profile.repeats, profile.cpu_shares_cores) {
                    // One run: ProTrain's formula, the disk tier's stream beside it.
                    (1, true) => estimate_iteration_sharing_cores(&times, gpu, cpu).total,
                    (1, false) => estimate_iteration(&times, gpu, cpu).total,
                    // Several: each run's passes, then the update alone (never shorter than
                    // the disk's time in both, so the bound below changes nothing).
                    (k, shares) => {
                        let passes = estimate_iteration(&times, 0.0, 0.0);
                        let update = match shares {
                            true => gpu + cpu.max(update),
                            false => gpu.max(cpu).max(update),
                        };
                        k as f64 * (passes.forward + passes.backward).max(run) + update
                    }
                }
                .max(run + update);
                prop_assert_eq!(formula, profile.direct_ticks(key) as f64, "{:?}", key);
            }
        }

        #[test]
        fn the_corrected_limit_is_the_largest_byte_count_that_passes(
            correction in 0.0f64..4.0,
            budget in 0u64..(1 << 50),
        ) {
            let limit = corrected_limit(correction, budget);
            let allowed = budget as f64 * 1.01;
            let passes = |bytes: u64| bytes as f64 * correction <= allowed;
            prop_assert!(passes(limit));
            prop_assert!(limit == u64::MAX || !passes(limit + 1));
        }

        #[test]
        fn the_additive_limit_is_the_largest_estimate_that_passes(
            over in -(1i128 << 52)..(1i128 << 52),
            budget in 0u64..(1 << 50),
        ) {
            let limit = additive_limit(Some(over), budget);
            // An estimate passes when, less the largest over-count seen, it is within budget.
            let passes = |bytes: u64| i128::from(bytes) - over <= i128::from(budget);
            if budget as i128 + over < 0 {
                // Every estimate, less an over-count this negative, is over: none passes
                // but 0, which only an empty candidate could estimate.
                prop_assert_eq!(limit, 0);
            } else {
                prop_assert!(passes(limit));
                prop_assert!(!passes(limit + 1));
            }
            prop_assert_eq!(additive_limit(None, budget), u64::MAX);
        }
    }

    #[test]
    fn ticks_keep_every_sum_in_range_and_name_no_time_negative() {
        let scale = TickScale::new(
            &[&[1e300, 1e300], &[f64::INFINITY, f64::NAN, -1.0, 2e-3]],
            3,
        );
        let ticks: Vec<Ticks> = [1e300, 1e300, f64::INFINITY, f64::NAN, -1.0, 2e-3]
            .iter()
            .map(|&s| scale.ticks(s))
            .collect();
        assert_eq!(&ticks[3..5], &[0, 0], "undefined and negative times are 0");
        // Each counted three times, as a step of three micro-batches counts them.
        let total = ticks
            .iter()
            .try_fold(0u64, |a, &t| a.checked_add(t.checked_mul(3)?));
        assert!(total.is_some_and(|t| t <= 1 << 63), "{ticks:?}");
        let fine = TickScale::new(&[&[0.5, 0.25]], 1);
        assert_eq!(
            fine.ticks(1e-15),
            1,
            "a femtosecond when the times are small"
        );
    }

    #[test]
    fn the_disk_tier_moves_the_fewest_states_the_host_needs_it_to() {
        // Ten chunks of 10 host bytes, 8 of them state, under 60 bytes of host: with `p`
        // persistent, `10 (10 - p) - 8 k + 2 x 8 <= 60` takes `k` states to disk through two
        // staging buffers, each read and written in the update (its bytes in seconds here),
        // the disk waiting on the last one's CPU Adam (half a second); from 4 persistent on,
        // all fits.
        let steps = disk_by_persist(&ten(), GradsInParams, budgets(60), price, price);
        let seconds: Vec<(f64, f64)> = steps.iter().map(|d| d.at(60)).collect();
        let moved = [7, 6, 5, 4, 0, 0, 0, 0, 0, 0, 0];
        let expected: Vec<(f64, f64)> = moved
            .iter()
            .map(|&k| match k {
                0 => (0.0, 0.0),
                k => (0.0, 16.0 * k as f64 + 0.5),
            })
            .collect();
        assert_eq!(
            seconds, expected,
            "no storage moves while states are enough"
        );
        // Without a disk budget nothing is priced.
        let none = disk_by_persist(
            &ten(),
            GradsInParams,
            HostBudgets { host: 60, disk: 0 },
            price,
            price,
        );
        assert!(none.iter().all(|d| d.at(0) == (0.0, 0.0)), "{none:?}");
    }

    /// Ten chunks of 2 bytes of storage and 8 of state, each updated in half a second.
    fn ten() -> Vec<DiskChunk> {
        vec![
            DiskChunk {
                storage: 2,
                state: 8,
                adam: 0.5,
            };
            10
        ]
    }

    /// A host budget of `host` bytes beside a disk.
    fn budgets(host: u64) -> HostBudgets {
        HostBudgets { host, disk: 1 }
    }

    /// A transfer of `bytes` takes as many seconds.
    fn price(bytes: u64) -> f64 {
        bytes as f64
    }

    use DiskLayout::{Accumulating, GradsInParams};

    #[test]
    fn one_staging_buffer_leaves_the_disk_idle_through_every_cpu_adam() {
        let steps = disk_by_persist(&ten(), GradsInParams, budgets(40), price, price);
        // With every state on disk `20 + 2 x 8 <= 40` fits two staging buffers: the disk
        // waits on the last update alone.
        assert_eq!(steps[0].at(40), (0.0, 160.0 + 0.5));
        // `20 + 16 > 30` does not, `20 + 8 <= 30` does: through one buffer the disk waits
        // on every update.
        assert_eq!(steps[0].at(30), (0.0, 160.0 + 10.0 * 0.5));
    }

    #[test]
    fn host_memory_other_buffers_take_leaves_the_disk_tier_less_room() {
        // A budget of 60 with 20 of it taken (swapped activations) leaves 40: every state
        // moves where 7 did with all 60, as the pass finds with the host region those
        // buffers are in.
        let steps = disk_by_persist(&ten(), GradsInParams, budgets(60), price, price);
        assert_eq!(steps[0].at(60), (0.0, 7.0 * 16.0 + 0.5));
        assert_eq!(steps[0].at(60 - 20), (0.0, 10.0 * 16.0 + 0.5));
        // The profile asks for what is left of its budget.
        let mut profile = deep_profile(2, "rtx3090");
        profile.disk = steps.iter().map(|d| d.map(|s| s as Ticks)).collect();
        profile.host_budget = 60;
        profile.disk_floor = disk_floor(&profile.disk, 60, |t| t);
        assert_eq!(profile.disk_at(0, 0), (0, 7 * 16));
        assert_eq!(profile.disk_at(0, 20), (0, 10 * 16));
        assert_eq!(profile.disk_at(4, 0), (0, 0), "all fits with 4 persistent");
    }

    #[test]
    fn the_disk_tier_moves_storage_once_every_state_is_on_disk() {
        // Under 20 bytes of host every state moves, and no ring of two fits beside the 20
        // bytes of storage; through rings of one (8 bytes of state, 3 x 2 of storage),
        // `2 (10 - j) + 8 + 6 <= 20` moves the storage of `j = 7` chunks, each read for
        // its two uploads and written after its offload in the run, read for its update
        // and written after it.
        let steps = disk_by_persist(&ten(), GradsInParams, budgets(20), price, price);
        assert_eq!(
            steps[0].at(20),
            (7.0 * 3.0 * 2.0, 160.0 + 7.0 * 2.0 * 2.0 + 10.0 * 0.5)
        );
        // Accumulating, the host keeps gradients and accumulators beside each chunk's
        // parameters: nothing fits 20 bytes, and every chunk's parameters are read for the
        // two uploads of each run, and for the update and written after it.
        let steps = disk_by_persist(&ten(), Accumulating, budgets(20), price, price);
        assert_eq!(
            steps[0].at(20),
            (10.0 * 2.0 * 2.0, 160.0 + 10.0 * 2.0 * 2.0 + 10.0 * 0.5)
        );
    }

    /// The profile of a GPT-2 with tiny dimensions at `layers` layers, batch 8 x 64, on
    /// `hardware`.
    fn deep_profile(layers: u64, hardware: &str) -> Profile {
        let mut config = protrain_models::load("gpt2-tiny").expect("preset");
        config.num_layers = layers;
        let forward =
            protrain_models::build_forward(&config, &protrain_models::BuildOptions::new(8, 64))
                .expect("builds");
        let training = crate::autodiff::autodiff(&forward, &Default::default()).expect("autodiff");
        let chunks = crate::chunk::chunk(&training, 1);
        let hardware = protrain_ir::HardwareProfile::preset(hardware).expect("preset");
        Profile::new(
            &training,
            &chunks,
            crate::cost::cost_model(&hardware).as_ref(),
            Topology::SINGLE,
            NO_DISK,
            1,
        )
    }

    /// The limit a search under a budget of `fraction` of the leanest-to-fattest range of
    /// estimates walks with, and the estimates' range.
    fn tight_limit(estimator: &Estimator, layouts: &[Layout], fraction: f64) -> u64 {
        let least = layouts.iter().map(|l| l.bytes).min().unwrap_or(0);
        let most = layouts.iter().map(|l| l.bytes).max().unwrap_or(0);
        let fixed = clamp(estimator.least);
        fixed + least + ((most - least) as f64 * fraction) as u64
    }

    #[test]
    fn real_profiles_stream_as_a_full_sort_would() {
        for hardware in ["host", "rtx3090", "h100"] {
            let profile = deep_profile(12, hardware);
            let estimator = Estimator::new(&profile);
            let layouts = estimator.layouts();
            let mut all = scored_directly(&profile);
            all.sort_by_key(Fastest::rank);
            for fraction in [0.0, 0.1, 0.3, 0.6, 1.0] {
                let limit = tight_limit(&estimator, &layouts, fraction);
                // Tightening then loosening, as the calibration can.
                let limits: Vec<u64> = (0..60)
                    .map(|i| {
                        if i % 20 < 10 {
                            limit
                        } else {
                            limit - limit / 8
                        }
                    })
                    .collect();
                assert_eq!(
                    stream::<Fastest>(&estimator, &limits, 8),
                    walk(&all, &limits),
                    "{hardware} at {fraction}"
                );
            }
        }
    }

    #[test]
    fn a_deep_model_is_searched_in_few_sweeps() {
        // 256 layers: 25 million policies in 33,153 layouts. Each list of 72 must sweep at
        // most one layout per layer, not every layout.
        for hardware in ["host", "rtx3090"] {
            let profile = deep_profile(256, hardware);
            let estimator = Estimator::new(&profile);
            let layouts = estimator.layouts();
            assert_eq!(layouts.len(), 257 * 258 / 2);
            for fraction in [0.05, 0.25, 0.5] {
                let limit = tight_limit(&estimator, &layouts, fraction);
                let mut fastest = Stream::<Fastest>::new(&estimator, &layouts, 72);
                let mut leanest = Stream::<Leanest>::new(&estimator, &layouts, 72);
                for _ in 0..720 {
                    fastest.next(limit).expect("policies fit");
                    leanest.next(limit).expect("policies fit");
                }
                for (order, swept, queries) in [
                    ("fastest", fastest.swept, fastest.queries),
                    ("leanest", leanest.swept, leanest.queries),
                ] {
                    assert!(
                        swept <= 256 * queries,
                        "{hardware} at {fraction}: the {order} stream swept {swept} layouts \
                         in {queries} queries"
                    );
                }
            }
        }
    }

    #[test]
    fn a_real_profile_sweeps_to_the_per_layer_loop() {
        let config = protrain_models::load("gpt2-tiny").expect("preset");
        let mut config = config;
        config.num_layers = 5;
        let forward =
            protrain_models::build_forward(&config, &protrain_models::BuildOptions::new(2, 16))
                .expect("builds");
        let training = crate::autodiff::autodiff(&forward, &Default::default()).expect("autodiff");
        let chunks = crate::chunk::chunk(&training, 1);
        for hardware in ["host", "rtx3090"] {
            let profile = protrain_ir::HardwareProfile::preset(hardware).expect("preset");
            let cost = crate::cost::cost_model(&profile);
            let profile = Profile::new(
                &training,
                &chunks,
                cost.as_ref(),
                Topology::SINGLE,
                NO_DISK,
                1,
            );
            assert_eq!(profile.layers, 5);
            let estimator = Estimator::new(&profile);
            let swept = scored_by_sweeps(&estimator, u64::MAX);
            let direct = scored_directly(&profile);
            assert_eq!(swept.len(), direct.len());
            for x in direct {
                assert_eq!(swept.get(&x.key), Some(&x), "{hardware}");
            }
        }
    }
}
