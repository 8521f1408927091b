//! Policy search: enumerates placement policies, ranks them with ProTrain's closed-form time
//! and a memory estimate, compiles and simulates the most promising, and keeps the fastest
//! whose exact arena fits the device budget and whose host region fits host memory.
//!
//! Like egg's runner, it has explicit budgets and returns data about what it did (a
//! [`SearchReport`]) rather than only a winner. Estimates only rank and prune: every policy
//! it returns was compiled, planned and simulated, so its peak memory is exact.

use crate::comm::Topology;
use crate::cost::{estimate_iteration, ChunkTimes, CopyDir, CostModel};
use crate::emit::HeaderInputs;
use crate::error::{CompileError, Result};
use crate::pipeline::compile_policy_on;
use crate::simulate::simulate_unverified;
use protrain_ir::{
    format_bytes, BlockKind, BlockMode, ChunkTable, Graph, MemoryBreakdown, OpKind, Phase, Policy,
    Schedule,
};
use rayon::prelude::*;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;

/// Budgets of a search.
#[derive(Clone, Debug)]
pub struct SearchOptions {
    /// Device bytes a schedule may use (device memory less reserved bytes).
    pub device_budget: u64,
    /// Host bytes a schedule may use.
    pub host_budget: u64,
    /// Most candidates compiled and simulated in full.
    pub max_compiled: usize,
    /// The hardware profile's summary, for the header.
    pub hardware: String,
    /// The model's name, for the header.
    pub model: String,
    /// The ranks every candidate runs on ([`Topology::SINGLE`] for one GPU).
    pub topology: Topology,
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
    /// Whether it fits both budgets.
    pub fits: bool,
}

/// What the search did.
#[derive(Clone, Debug, Default)]
pub struct SearchReport {
    /// Policies enumerated.
    pub enumerated: usize,
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
}

impl SearchReport {
    /// A readable summary: the winner, the next best, and why the others were rejected.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "searched {} policies: {} over the device budget by estimate, {} by exact plan, {} over host memory, {} invalid; compiled {}",
            self.enumerated,
            self.rejected_estimate,
            self.rejected_exact,
            self.rejected_host,
            self.rejected_invalid,
            self.compiled.len()
        );
        for (i, c) in self.compiled.iter().take(6).enumerate() {
            let _ = writeln!(
                out,
                "  {} {}  simulated {:.4} s (estimate {:.4} s)  device {}  host {}{}",
                if i == 0 { "*" } else { " " },
                c.policy,
                c.simulated_seconds,
                c.estimated_seconds,
                format_bytes(c.peak_device_bytes),
                format_bytes(c.host_bytes),
                if c.fits { "" } else { "  (does not fit)" }
            );
        }
        out
    }
}

/// Per-block facts the estimates need, computed once per training graph.
struct Profile {
    layers: usize,
    /// Per chunk and phase: forward, backward, and per layer recompute time.
    chunk_forward: Vec<f64>,
    chunk_backward: Vec<f64>,
    /// Per layer: the chunk that most of its ops read, its forward time and saved bytes.
    layer_chunk: Vec<usize>,
    layer_forward: Vec<f64>,
    layer_saved: Vec<u64>,
    layer_input: Vec<u64>,
    /// Bytes live outside the layers at the peak (embeddings, logits and their gradient).
    head_bytes: u64,
    /// Per chunk: bytes of parameters, and elements.
    chunk_bytes: Vec<u64>,
    chunk_elems: Vec<u64>,
    chunk_capacity: u64,
    /// Copy times.
    fetch: Vec<f64>,
    offload: Vec<f64>,
    h2d_per_byte: f64,
    d2h_per_byte: f64,
    cpu_adam: Vec<f64>,
    gpu_adam: Vec<f64>,
    /// Bytes per parameter element of optimizer state on the device (m, v).
    state_per_elem: u64,
}

impl Profile {
    fn new(training: &Graph, chunks: &ChunkTable, cost: &dyn CostModel) -> Self {
        let n = chunks.len();
        let layers = training
            .blocks()
            .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
            .count();
        let layer_of = |block: protrain_ir::BlockId| match training.block(block).kind {
            BlockKind::Layer(i) => Some(i as usize),
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
            match op.phase {
                Phase::Forward => chunk_forward[current] += seconds,
                _ => chunk_backward[current] += seconds,
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
                    if layer_input[l] == 0 {
                        layer_input[l] = op
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
        head_bytes = head_bytes.max(2 * logits);
        let layer_chunk = layer_votes
            .iter()
            .map(|v| {
                v.iter()
                    .max_by_key(|&(c, n)| (*n, usize::MAX - c))
                    .map_or(0, |(&c, _)| c)
            })
            .collect();
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
        let big = 1u64 << 30;
        let h2d_per_byte = cost.copy_seconds(big, CopyDir::HostToDevice) / big as f64;
        let d2h_per_byte = cost.copy_seconds(big, CopyDir::DeviceToHost) / big as f64;
        Self {
            layers,
            chunk_forward,
            chunk_backward,
            layer_chunk,
            layer_forward,
            layer_saved,
            layer_input,
            head_bytes,
            fetch: chunk_bytes
                .iter()
                .map(|&b| cost.copy_seconds(b, CopyDir::HostToDevice))
                .collect(),
            offload: chunk_bytes
                .iter()
                .map(|&b| cost.copy_seconds(b, CopyDir::DeviceToHost))
                .collect(),
            cpu_adam: chunk_elems
                .iter()
                .map(|&e| cost.cpu_adam_seconds(e))
                .collect(),
            gpu_adam: chunk_elems
                .iter()
                .map(|&e| cost.gpu_adam_seconds(e))
                .collect(),
            chunk_bytes,
            chunk_elems,
            chunk_capacity: chunks.chunk_bytes,
            h2d_per_byte,
            d2h_per_byte,
            state_per_elem: crate::streams::state_bytes_per_element(training),
        }
    }

    /// ProTrain's closed-form step time of a policy.
    fn estimate_seconds(&self, p: Key) -> f64 {
        let n = self.chunk_bytes.len();
        let mut times: Vec<ChunkTimes> = (0..n)
            .map(|c| {
                let offloaded = c as u32 >= p.n_persist;
                ChunkTimes {
                    forward_compute: self.chunk_forward[c],
                    backward_compute: self.chunk_backward[c],
                    recompute: 0.0,
                    forward_comm: if offloaded { self.fetch[c] } else { 0.0 },
                    backward_comm: if offloaded {
                        self.fetch[c].max(self.offload[c])
                    } else {
                        0.0
                    },
                }
            })
            .collect();
        for l in 0..self.layers {
            let mode = p.mode(l, self.layers);
            let c = self.layer_chunk[l];
            match mode {
                BlockMode::Keep => {}
                BlockMode::Checkpoint => times[c].recompute += self.layer_forward[l],
                BlockMode::Swap => {
                    times[c].forward_comm += self.layer_saved[l] as f64 * self.d2h_per_byte;
                    times[c].backward_comm += self.layer_saved[l] as f64 * self.h2d_per_byte;
                }
            }
        }
        let gpu: f64 = (0..n)
            .filter(|&c| (c as u32) < p.n_persist)
            .map(|c| self.gpu_adam[c])
            .sum();
        let cpu: f64 = (0..n)
            .filter(|&c| c as u32 >= p.n_persist)
            .map(|c| self.cpu_adam[c])
            .sum();
        estimate_iteration(&times, gpu, cpu).total
    }

    /// A quick estimate of the device bytes a policy needs.
    fn estimate_bytes(&self, p: Key) -> u64 {
        let persist = p.n_persist as usize;
        let persistent: u64 = (0..persist)
            .map(|c| 2 * self.chunk_bytes[c] + self.state_per_elem * self.chunk_elems[c])
            .sum();
        let offloaded = persist < self.chunk_bytes.len();
        let buffers = if offloaded {
            (u64::from(p.n_buffer) + 2) * self.chunk_capacity
        } else {
            0
        };
        let mut activations = self.head_bytes;
        let mut recompute_peak = 0;
        let mut swap_peak = 0;
        for l in 0..self.layers {
            match p.mode(l, self.layers) {
                BlockMode::Keep => activations += self.layer_saved[l],
                BlockMode::Checkpoint => {
                    activations += self.layer_input[l];
                    recompute_peak = recompute_peak.max(self.layer_saved[l]);
                }
                BlockMode::Swap => {
                    activations += self.layer_input[l];
                    swap_peak = swap_peak.max(self.layer_saved[l]);
                }
            }
        }
        persistent + buffers + activations + recompute_peak + 3 * swap_peak
    }
}

/// Every policy the search considers: `n_persist` over every chunk count; 2 to 4 chunk
/// buffers when something is offloaded; ProTrain's interleaved `(n_swap, n_checkpoint)` over
/// every split of the layers.
fn enumerate(chunks: usize, layers: usize) -> Vec<Key> {
    let mut out = Vec::new();
    for n_persist in 0..=chunks as u32 {
        let streamed = chunks as u32 - n_persist;
        let buffers: Vec<u32> = match streamed {
            0 => vec![0],
            1 => vec![1],
            s => (2..=s.min(4)).collect(),
        };
        for &n_buffer in &buffers {
            for n_swap in 0..=layers as u32 {
                for n_checkpoint in 0..=layers as u32 - n_swap {
                    out.push(Key {
                        n_persist,
                        n_buffer,
                        n_swap,
                        n_checkpoint,
                    });
                }
            }
        }
    }
    out
}

/// A policy in ProTrain's family, as four numbers: cheap to enumerate, sort and estimate;
/// [`Key::policy`] builds the [`Policy`] only for the candidates that get compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

    /// Layer `l`'s mode, as [`Policy::protrain`] lays them out.
    fn mode(self, l: usize, layers: usize) -> BlockMode {
        Policy::protrain_mode(l, self.n_swap as usize, self.n_checkpoint as usize, layers)
    }

    fn movement(self) -> u32 {
        self.n_swap + self.n_checkpoint
    }
}

/// Blocks that are not simply kept: what a policy swaps or recomputes.
fn movement(p: &Policy) -> usize {
    p.blocks.len() - p.count(BlockMode::Keep)
}

/// Searches for the fastest policy that fits; returns its schedule (simulated, with the
/// report in its header) and the report.
///
/// When nothing fits, the error says the smallest budget that would and what takes the
/// memory in that schedule.
pub fn search(
    training: &Graph,
    chunks: &ChunkTable,
    cost: &dyn CostModel,
    options: &SearchOptions,
) -> Result<(Schedule, SearchReport)> {
    let profile = Profile::new(training, chunks, cost);
    let policies = enumerate(chunks.len(), profile.layers);
    let mut report = SearchReport {
        enumerated: policies.len(),
        ..Default::default()
    };
    let mut ranked: Vec<(f64, u64, Key)> = policies
        .into_par_iter()
        .map(|k| (profile.estimate_seconds(k), profile.estimate_bytes(k), k))
        .collect();
    // Fastest first; among equals, the one that moves the least: more persistent chunks,
    // fewer swapped or recomputed blocks, then fewer bytes. (This orders what is compiled;
    // the winner among the compiled is chosen by [`rank`].)
    ranked.sort_by(|a, b| {
        a.0.total_cmp(&b.0)
            .then(b.2.n_persist.cmp(&a.2.n_persist))
            .then(a.2.movement().cmp(&b.2.movement()))
            .then(a.1.cmp(&b.1))
    });
    // Candidates are compiled without a budget (the search rejects those over it itself);
    // the winner gets the real budgets in its header.
    let header = |report: String| HeaderInputs {
        model: options.model.clone(),
        hardware: options.hardware.clone(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report,
    };
    // Estimates are rough: let candidates up to 25% over budget through to the exact plan.
    let slack = options.device_budget + options.device_budget / 4;
    let (promising, over): (Vec<_>, Vec<_>) = ranked
        .into_iter()
        .partition(|(_, bytes, _)| *bytes <= slack);
    report.rejected_estimate = over.len();

    // The fitting candidates within the tie tolerance of the fastest so far, with their
    // schedules; the winner is chosen among them at the end.
    let mut contenders: Vec<(Candidate, Schedule)> = Vec::new();
    // Two passes, each in batches of `COMPILE_BATCH` compiled in parallel, until four candidates fit:
    // 1. the fastest by estimate, skipping those whose estimated bytes, corrected by how the
    //    estimate compared with the exact plans so far (the median ratio; 0.8 before any, so a
    //    25% over-estimate still gets through), exceed the budget;
    // 2. if none of those fit, the leanest by estimate.
    let mut ratios: Vec<f64> = Vec::new();
    let mut pass = 1;
    let mut compiled_in_pass = 0;
    let mut queue = promising.clone().into_iter();
    loop {
        if !contenders.is_empty()
            && (report.compiled.len() >= 4 || compiled_in_pass >= options.max_compiled)
        {
            break;
        }
        let correction = match ratios.len() {
            0 => 0.8,
            n => {
                let mut sorted = ratios.clone();
                sorted.sort_by(f64::total_cmp);
                sorted[n / 2]
            }
        };
        let mut batch = Vec::with_capacity(COMPILE_BATCH);
        if compiled_in_pass < options.max_compiled {
            for candidate in queue.by_ref() {
                if pass == 1
                    && (candidate.1 as f64 * correction) > options.device_budget as f64 * 1.01
                {
                    continue;
                }
                batch.push(candidate);
                if batch.len() == COMPILE_BATCH {
                    break;
                }
            }
        }
        if batch.is_empty() {
            if !contenders.is_empty() || pass == 2 {
                break;
            }
            pass = 2;
            compiled_in_pass = 0;
            let mut lean = promising.clone();
            lean.sort_by(|a, b| a.1.cmp(&b.1).then(a.0.total_cmp(&b.0)));
            queue = lean.into_iter();
            continue;
        }
        compiled_in_pass += batch.len();
        let results: Vec<(Policy, f64, u64, Result<Schedule>)> = batch
            .par_iter()
            .map(|&(estimate, bytes, key)| {
                let policy = key.policy(profile.layers);
                let result = compile_policy_on(
                    training,
                    chunks,
                    &policy,
                    header(String::new()),
                    options.topology,
                );
                (policy, estimate, bytes, result)
            })
            .collect();
        for (policy, estimate, estimated_bytes, result) in results {
            let mut schedule = match result {
                Ok(s) => s,
                Err(CompileError::BadPolicy(_) | CompileError::TooFewBuffers { .. }) => {
                    report.rejected_invalid += 1;
                    continue;
                }
                Err(e) => return Err(e),
            };
            ratios.push(schedule.arena_bytes as f64 / estimated_bytes.max(1) as f64);
            let sim = simulate_unverified(&schedule, cost)
                .map_err(|e| CompileError::Simulation(e.to_string()))?;
            schedule.header.prediction.step_seconds = sim.step_seconds;
            schedule.header.prediction.stream_busy_seconds = sim.stream_busy_seconds.clone();
            let fits_device = schedule.arena_bytes <= options.device_budget;
            let fits_host = schedule.host_bytes <= options.host_budget;
            if !fits_device {
                report.rejected_exact += 1;
            } else if !fits_host {
                report.rejected_host += 1;
            }
            let candidate = Candidate {
                policy,
                estimated_seconds: estimate,
                simulated_seconds: sim.step_seconds,
                peak_device_bytes: schedule.arena_bytes,
                host_bytes: schedule.host_bytes,
                fits: fits_device && fits_host,
            };
            if candidate.fits {
                report.compiled.push(candidate.clone());
                contenders.push((candidate, schedule));
            }
        }
        // Only those that can still tie with the fastest are kept (schedules are large).
        let fastest = contenders
            .iter()
            .map(|(c, _)| c.simulated_seconds)
            .fold(f64::INFINITY, f64::min);
        contenders.retain(|(c, _)| ties(c.simulated_seconds, fastest));
    }
    let fastest = fastest_of(&report.compiled);
    let best = contenders
        .into_iter()
        .min_by(|(a, _), (b, _)| rank(a, b, fastest));
    // Ties first in the winner's order (so the winner heads the report), then the rest,
    // fastest first: the report reads the same for any thread count.
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
    match best {
        Some((_, mut schedule)) => {
            schedule.header.report = report.to_text();
            schedule.header.device_budget_bytes = options.device_budget;
            schedule.header.host_budget_bytes = options.host_budget;
            Ok((schedule, report))
        }
        None => Err(too_small(training, chunks, &profile, options, &report)),
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

/// The winner's order: a candidate that does not tie with `fastest` loses to one that does;
/// among ties, the least device memory, then the least host memory, then the fewer blocks
/// swapped or recomputed, the faster, and the policy's text, so the order is total and depends
/// on nothing but the candidates.
fn rank(a: &Candidate, b: &Candidate, fastest: f64) -> std::cmp::Ordering {
    let (ta, tb) = (
        ties(a.simulated_seconds, fastest),
        ties(b.simulated_seconds, fastest),
    );
    tb.cmp(&ta)
        .then(a.peak_device_bytes.cmp(&b.peak_device_bytes))
        .then(a.host_bytes.cmp(&b.host_bytes))
        .then(movement(&a.policy).cmp(&movement(&b.policy)))
        .then(a.simulated_seconds.total_cmp(&b.simulated_seconds))
        .then_with(|| a.policy.to_string().cmp(&b.policy.to_string()))
}

/// The error for a budget nothing fits: compiles the leanest policy to say what it needs.
fn too_small(
    training: &Graph,
    chunks: &ChunkTable,
    profile: &Profile,
    options: &SearchOptions,
    report: &SearchReport,
) -> CompileError {
    let streamed = chunks.len() as u32;
    let lean = Policy::zero3_offload(streamed.clamp(1, 2), profile.layers);
    let header = HeaderInputs {
        model: options.model.clone(),
        hardware: options.hardware.clone(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
    };
    match compile_policy_on(training, chunks, &lean, header, options.topology) {
        Ok(s) if s.arena_bytes <= options.device_budget && s.host_bytes > options.host_budget => {
            CompileError::BudgetTooSmall(format!(
                "no policy fits {} of host memory ({} policies tried): offloading needs the model states of every streamed chunk in host memory, at least {} with the leanest policy ({lean}). Give --host-memory at least {}, or use a machine with more host memory",
                format_bytes(options.host_budget),
                report.enumerated,
                format_bytes(s.host_bytes),
                format_bytes(s.host_bytes),
            ))
        }
        Ok(s) => {
            let m: MemoryBreakdown = s.header.prediction.memory;
            let host = if s.host_bytes > options.host_budget {
                format!(
                    "; it also needs {} of host memory, more than the {} allowed (--host-memory)",
                    format_bytes(s.host_bytes),
                    format_bytes(options.host_budget)
                )
            } else {
                String::new()
            };
            CompileError::BudgetTooSmall(format!(
                "no policy fits {} of device memory ({} policies tried). The leanest ({}) needs {}: activations {}, chunk buffers {}, workspaces {}, inputs {}{host}. Give --gpu-memory at least {}, or a smaller --batch or --seq",
                format_bytes(options.device_budget),
                report.enumerated,
                lean,
                format_bytes(s.arena_bytes),
                format_bytes(m.activations),
                format_bytes(m.chunk_buffers),
                format_bytes(m.workspace),
                format_bytes(m.inputs),
                format_bytes(s.arena_bytes),
            ))
        }
        Err(e) => e,
    }
}
