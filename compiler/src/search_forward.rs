//! Policy search for a forward-only graph (evaluation): the fastest `(n_persist, n_buffer)`
//! whose exact arena fits, every layer kept.
//!
//! A forward pass has no backward pass to swap activations for or recompute them in, no
//! gradients and no optimizer state, so [`crate::search`]'s family (and its estimates, which
//! count gradient chunks and Adam moments) does not apply. What is left is two numbers, and
//! the arena grows with `n_persist` for a given `n_buffer`: for each `n_buffer` from 1 to
//! [`MAX_BUFFERS`] a binary search finds the most persistent chunks that fit, compiling
//! `O(log chunks)` candidates; with the resident policy (every chunk on the device), those
//! candidates are simulated, and the winner is chosen as [`crate::search`] chooses: the
//! fastest within [`TIE_TOLERANCE`], then the least device memory, then the fewest buffers.
//! Every candidate is compiled and planned, so the peak it reports is exact.
//!
//! It does not enumerate block modes, prefetch distances or anything else a training policy
//! has.

use crate::cost::CostModel;
use crate::emit::HeaderInputs;
use crate::error::{CompileError, Result, Shortfall, ShortfallProblem};
use crate::lower::compile_policy;
use crate::search::{Candidate, SearchOptions, SearchReport, TIE_TOLERANCE};
use crate::simulate::simulate_unverified;
use protrain_ir::{BlockKind, ChunkTable, Graph, Policy, Schedule};
use rayon::prelude::*;

/// The most chunk buffers tried.
pub const MAX_BUFFERS: u32 = 4;

/// A compiled candidate: its summary and its schedule.
type Compiled = (Candidate, Schedule);

/// Searches for the fastest forward-only policy that fits; returns its schedule (simulated,
/// with the report in its header) and the report. When nothing fits, the error says the
/// smallest budget that would and what takes the memory.
pub fn search_forward(
    graph: &Graph,
    chunks: &ChunkTable,
    cost: &(dyn CostModel + Sync),
    options: &SearchOptions,
) -> Result<(Schedule, SearchReport)> {
    let layers = graph
        .blocks()
        .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
        .count();
    let n = chunks.len() as u32;
    let header = HeaderInputs {
        model: options.model.clone(),
        hardware: options.hardware.clone(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
        flash_attention: cost.flash_attention(),
    };
    // Compiles and simulates one policy; `None` when the compiler refuses it (too few
    // buffers for an op).
    let try_policy = |policy: Policy| -> Result<Option<Compiled>> {
        let mut schedule = match compile_policy(graph, chunks, &policy, header.clone()) {
            Ok(s) => s,
            Err(CompileError::BadPolicy(_) | CompileError::TooFewBuffers { .. }) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let sim = simulate_unverified(&schedule, cost)
            .map_err(|e| CompileError::Simulation(e.to_string()))?;
        schedule.header.prediction.step_seconds = sim.step_seconds;
        schedule.header.prediction.stream_busy_seconds = sim.stream_busy_seconds;
        let candidate = Candidate {
            policy,
            estimated_seconds: sim.step_seconds,
            simulated_seconds: sim.step_seconds,
            peak_device_bytes: schedule.arena_bytes,
            host_bytes: schedule.host_bytes,
            disk_bytes: schedule.disk_bytes,
            movement: crate::search::movement_of(&schedule),
            fits: schedule.arena_bytes <= options.device_budget
                && schedule.host_bytes <= options.host_budget,
        };
        Ok(Some((candidate, schedule)))
    };
    // Per buffer count, the most persistent chunks that fit, and every candidate compiled
    // on the way (to count them).
    let searches: Vec<Result<(Option<Compiled>, usize, usize)>> = (1..=MAX_BUFFERS.min(n))
        .into_par_iter()
        .map(|n_buffer| {
            let (mut compiled, mut invalid) = (0, 0);
            let mut best: Option<Compiled> = None;
            // Invariant: every n_persist below `lo` fits (when `best` is some), none from
            // `hi` on does.
            let (mut lo, mut hi) = (0u32, n);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                compiled += 1;
                match try_policy(Policy::protrain(mid, n_buffer, 0, 0, layers))? {
                    Some(c) if c.0.fits => {
                        lo = mid + 1;
                        best = Some(c);
                    }
                    Some(_) => hi = mid,
                    None => {
                        invalid += 1;
                        hi = mid;
                    }
                }
            }
            Ok((best, compiled, invalid))
        })
        .collect();
    let mut report = SearchReport {
        enumerated: 1 + (MAX_BUFFERS.min(n) * n) as usize,
        ..Default::default()
    };
    let mut contenders: Vec<Compiled> = Vec::new();
    for search in searches {
        let (best, compiled, invalid) = search?;
        report.rejected_invalid += invalid;
        report.rejected_exact += compiled - invalid - usize::from(best.is_some());
        contenders.extend(best);
    }
    match try_policy(Policy::resident(n, layers))? {
        Some(c) if c.0.fits => contenders.push(c),
        Some(_) => report.rejected_exact += 1,
        None => report.rejected_invalid += 1,
    }
    let fastest = contenders
        .iter()
        .map(|(c, _)| c.simulated_seconds)
        .fold(f64::INFINITY, f64::min);
    let ties = |c: &Candidate| c.simulated_seconds <= fastest * (1.0 + TIE_TOLERANCE);
    contenders.sort_by(|(a, _), (b, _)| {
        ties(b)
            .cmp(&ties(a))
            .then(a.peak_device_bytes.cmp(&b.peak_device_bytes))
            .then(a.host_bytes.cmp(&b.host_bytes))
            .then(a.policy.n_buffer.cmp(&b.policy.n_buffer))
            .then(a.simulated_seconds.total_cmp(&b.simulated_seconds))
            .then_with(|| a.policy.to_string().cmp(&b.policy.to_string()))
    });
    report.compiled = contenders.iter().map(|(c, _)| c.clone()).collect();
    let Some((_, mut schedule)) = contenders.into_iter().next() else {
        return Err(too_small(options, layers, &try_policy));
    };
    schedule.header.report = format!("forward only, every layer kept; {}", report.to_text());
    schedule.header.device_budget_bytes = options.device_budget;
    schedule.header.host_budget_bytes = options.host_budget;
    Ok((schedule, report))
}

/// The error for a budget no forward-only policy fits: what the leanest policy (every chunk
/// streamed through the fewest buffers the compiler accepts) needs.
fn too_small(
    options: &SearchOptions,
    layers: usize,
    try_policy: &dyn Fn(Policy) -> Result<Option<Compiled>>,
) -> CompileError {
    for n_buffer in 1..=MAX_BUFFERS {
        let lean = Policy::protrain(0, n_buffer, 0, 0, layers);
        let (candidate, schedule) = match try_policy(lean) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => return e,
        };
        let m = schedule.header.prediction.memory;
        if candidate.peak_device_bytes <= options.device_budget {
            return Shortfall::error(ShortfallProblem::ForwardHost {
                host_budget: options.host_budget,
                lean: candidate.policy.to_string(),
                host_need: candidate.host_bytes,
            });
        }
        return Shortfall::error(ShortfallProblem::ForwardDevice {
            device_budget: options.device_budget,
            lean: candidate.policy.to_string(),
            need: candidate.peak_device_bytes,
            memory: m,
        });
    }
    Shortfall::error(ShortfallProblem::ForwardNoneCompiles {
        max_buffers: MAX_BUFFERS,
    })
}
