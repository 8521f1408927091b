//! `protrain verify`, `protrain explain` and `protrain trace`: reading compiled schedules.

use protrain::compiler::simulate::{chrome_trace, simulate, Simulation};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{format_bytes, HardwareProfile, Schedule};
use protrain::{Error, Result};
use std::path::{Path, PathBuf};

/// Arguments of `protrain verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// A schedule written by `protrain compile`.
    schedule: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Arguments of `protrain explain`.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// A schedule written by `protrain compile`.
    schedule: PathBuf,
    /// The hardware to predict times for [default: the one the schedule was compiled for].
    #[arg(long)]
    hardware: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Arguments of `protrain trace`.
#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    /// A schedule written by `protrain compile`.
    schedule: PathBuf,
    /// Where to write the Chrome trace (open it in chrome://tracing or ui.perfetto.dev), or
    /// `-` for standard output (then nothing else is printed).
    #[arg(short, long, value_name = "FILE")]
    output: PathBuf,
    /// The hardware to predict times for [default: the one the schedule was compiled for].
    #[arg(long)]
    hardware: Option<String>,
    /// Print what was written as one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Reads and verifies a schedule file.
pub fn read(path: &Path) -> Result<VerifiedSchedule> {
    Ok(protrain::ir::file::read(path)?)
}

/// The profile a schedule was compiled for, or the one asked for.
fn profile_for(schedule: &Schedule, hardware: Option<&str>) -> Result<HardwareProfile> {
    let name = hardware
        .unwrap_or_else(|| compiled_for(schedule))
        .to_string();
    HardwareProfile::load(&name).map_err(|e| {
        Error::Usage(format!(
            "{e}; the schedule was compiled for '{}': pass --hardware with that preset or profile file",
            schedule.header.hardware
        ))
    })
}

/// The schedule simulated on the hardware asked for (else the one it was compiled for), and
/// that hardware's name.
pub(super) fn simulated(
    schedule: &VerifiedSchedule,
    hardware: Option<&str>,
) -> Result<(Simulation, String)> {
    let (simulation, profile) = priced(schedule, hardware)?;
    Ok((simulation, profile.name))
}

/// The schedule simulated on the hardware asked for (else the one it was compiled for), and
/// that hardware's profile as the simulation priced it.
fn priced(
    schedule: &VerifiedSchedule,
    hardware: Option<&str>,
) -> Result<(Simulation, HardwareProfile)> {
    let mut profile = profile_for(schedule, hardware)?;
    // A data-parallel schedule is priced on the profile's interconnect (on the host, ranks
    // as threads); one that has none cannot price its collectives.
    let (gpus, nodes) = schedule.topology();
    if gpus * nodes > 1 {
        if profile.is_host() {
            profile = profile.with_thread_ranks(gpus);
        }
        protrain::compiler::comm::Topology { gpus, nodes }.interconnect(&profile)?;
    }
    let cost = protrain::compiler::cost::cost_model(&profile);
    let simulation = simulate(schedule, cost.as_ref())
        .map_err(|e| Error::Usage(format!("the schedule cannot be simulated: {e}")))?;
    Ok((simulation, profile))
}

/// The name of the hardware a schedule was compiled for (the first field of its summary).
fn compiled_for(schedule: &Schedule) -> &str {
    schedule
        .header
        .hardware
        .split(':')
        .next()
        .unwrap_or_default()
        .trim()
}

/// `protrain verify`: reads the file (which checks its format and checksum) and runs every
/// invariant of the schedule verifier.
pub fn verify(args: VerifyArgs) -> Result<()> {
    let s = read(&args.schedule)?;
    let instrs: usize = s.streams.iter().map(|st| st.instrs.len()).sum();
    if args.json {
        let v = serde_json::json!({
            "schedule": args.schedule,
            "valid": true,
            "model": s.header.model,
            "batch": s.header.batch,
            "seq": s.header.seq,
            "instructions": instrs,
            "streams": s.streams.len(),
            "buffers": s.buffers.len(),
            "arena_bytes": s.arena_bytes,
            "device_budget_bytes": s.header.device_budget_bytes,
            "host_bytes": s.host_bytes,
            "disk_bytes": s.disk_bytes,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
        return Ok(());
    }
    let disk = match s.disk_bytes {
        0 => String::new(),
        bytes => format!(", disk {}", format_bytes(bytes)),
    };
    outln!(
        "{}: valid schedule for {} (batch {} x seq {}), {} instructions on {} streams, {} buffers, arena {} of {} budget, host {}{disk}",
        args.schedule.display(),
        s.header.model,
        s.header.batch,
        s.header.seq,
        instrs,
        s.streams.len(),
        s.buffers.len(),
        format_bytes(s.arena_bytes),
        format_bytes(s.header.device_budget_bytes),
        format_bytes(s.host_bytes)
    );
    Ok(())
}

/// `protrain explain`: the policy and why, the memory breakdown, predicted time per phase and
/// per stream, and what bounds the step. With `--hardware` other than the schedule's, every
/// figure is that hardware's: the search's report, priced on the hardware compiled for, is
/// left out.
pub fn explain(args: ExplainArgs) -> Result<()> {
    let s = read(&args.schedule)?;
    let (sim, profile) = priced(&s, args.hardware.as_deref())?;
    let bound = protrain::compiler::bound::bound(&s, &profile, &sim)
        .map_err(|e| Error::Usage(format!("the schedule cannot be simulated: {e}")))?;
    let x = Explained {
        s: &s,
        sim: &sim,
        profile: &profile,
        bound: &bound,
    };
    if args.json {
        explain_json(&x);
        return Ok(());
    }
    explain_header(&x);
    explain_figures(&x);
    explain_ranks_disk_streams(&x);
    Ok(())
}

/// A schedule as `explain` prices it: simulated on `profile`, with what bounds its step.
struct Explained<'a> {
    s: &'a VerifiedSchedule,
    sim: &'a Simulation,
    profile: &'a HardwareProfile,
    bound: &'a protrain::compiler::bound::Bound,
}

impl Explained<'_> {
    /// The hardware priced on, the hardware compiled for, and whether they are the same (the
    /// search's report is shown only then: it is priced on the hardware compiled for).
    fn hardware(&self) -> (String, &str, bool) {
        let on = self.profile.name.clone();
        let compiled = compiled_for(self.s);
        let same = on == compiled;
        (on, compiled, same)
    }
}

/// `explain --json`: every figure as one JSON object.
fn explain_json(x: &Explained) {
    let Explained {
        s,
        sim,
        profile,
        bound,
    } = *x;
    let (on, compiled, same) = x.hardware();
    let p = &s.header.prediction;
    let ph = &sim.phase_seconds;
    let usable = profile.usable_device_bytes();
    let tie_rule = protrain::compiler::search::TIE_RULE;
    let streams: Vec<serde_json::Value> = s
        .streams
        .iter()
        .zip(&sim.stream_busy_seconds)
        .map(|(st, busy)| serde_json::json!({"stream": st.name, "busy_s": busy, "instructions": st.instrs.len()}))
        .collect();
    let v = serde_json::json!({
        "model": s.header.model,
        "hardware": on,
        "hardware_summary": profile.summary(),
        "compiled_for": compiled,
        // The search's reasoning, priced on the hardware compiled for: only shown there.
        "report": same.then(|| s.header.report.clone()),
        "tie_rule": tie_rule,
        "policy": s.header.policy.to_string(),
        "predicted_step_s": sim.step_seconds,
        "phase_seconds": {"forward": ph.forward, "backward": ph.backward, "recompute": ph.recompute, "optimizer": ph.optimizer},
        "exposed_communication_s": sim.exposed_communication_seconds(),
        "ranks": s.ranks(),
        "sharded": s.sharded(),
        "collective_s": sim.collective_seconds(s),
        "exposed_collective_s": sim.exposed_collective_seconds(),
        "streams": streams,
        "bound_by": bound.by().map(resource_json),
        "critical_path": bound.resources.iter().map(resource_json).collect::<Vec<_>>(),
        "unattributed_s": bound.unattributed_seconds,
        "peak_device_bytes": p.peak_device_bytes,
        "usable_device_bytes": usable,
        "fits_device": p.peak_device_bytes <= usable,
        "lower_bound_bytes": p.lower_bound_bytes,
        "host_bytes": p.host_bytes,
        "disk_bytes": s.disk_bytes,
        "disk": disk_json(s, sim),
        "memory": p.memory,
        "experts": s.expert_placement(),
    });
    outln!(
        "{}",
        serde_json::to_string_pretty(&v).expect("JSON values serialise")
    );
}

/// `explain`'s first lines: the model and hardware, the policy, why the search chose it (or
/// why that is left out), and the rule that breaks ties.
fn explain_header(x: &Explained) {
    let (s, profile) = (x.s, x.profile);
    let (on, compiled, same) = x.hardware();
    let tie_rule = protrain::compiler::search::TIE_RULE;
    if same {
        outln!(
            "{} (batch {} x seq {}, {}) on {}",
            s.header.model,
            s.header.batch,
            s.header.seq,
            s.header.dtype,
            s.header.hardware
        );
    } else {
        outln!(
            "{} (batch {} x seq {}, {}) on {}; compiled for {compiled}",
            s.header.model,
            s.header.batch,
            s.header.seq,
            s.header.dtype,
            profile.summary()
        );
    }
    outln!("policy   {}", s.header.policy);
    if same {
        let why = s.header.report.trim_end().replace('\n', "\n         ");
        outln!("why      {why}");
    } else {
        // The report is the compiler's reasoning in the compile-time hardware's times.
        outln!(
            "why      the search chose it with {compiled}'s times, left out here: every figure \
             below is {on}'s (compile for {on} to see its search, or explain without --hardware)"
        );
    }
    outln!("ties     {tie_rule}");
}

/// `explain`'s memory, time and bound lines.
fn explain_figures(x: &Explained) {
    let Explained {
        s,
        sim,
        profile,
        bound,
    } = *x;
    let (on, _, _) = x.hardware();
    let p = &s.header.prediction;
    let ph = &sim.phase_seconds;
    let usable = profile.usable_device_bytes();
    outln!(
        "memory   {} device (lower bound {}) of the {} usable on {on}{}, {} host",
        format_bytes(p.peak_device_bytes),
        format_bytes(p.lower_bound_bytes),
        format_bytes(usable),
        match p.peak_device_bytes <= usable {
            true => "",
            false => ": does not fit, compile for it",
        },
        format_bytes(p.host_bytes)
    );
    let m = &p.memory;
    outln!(
        "         at the peak: persistent {}, chunk buffers {}, activations {}, workspace {}, inputs {}",
        format_bytes(m.persistent),
        format_bytes(m.chunk_buffers),
        format_bytes(m.activations),
        format_bytes(m.workspace),
        format_bytes(m.inputs)
    );
    if let Some(e) = s.expert_placement() {
        outln!(
            "experts  {} weights, {} in {} chunks: {} on the device all step, {} in host memory \
             (fetched into the chunk buffers before use)",
            e.tensors,
            format_bytes(e.persistent_bytes + e.streamed_bytes),
            e.chunks,
            format_bytes(e.persistent_bytes),
            format_bytes(e.streamed_bytes)
        );
    }
    outln!(
        "time     {:.4} s per step: forward {:.4} s, backward {:.4} s, recompute {:.4} s, optimizer {:.4} s on the compute stream; {:.4} s of communication not hidden",
        sim.step_seconds,
        ph.forward,
        ph.backward,
        ph.recompute,
        ph.optimizer,
        sim.exposed_communication_seconds()
    );
    if let Some(by) = bound.by() {
        let others: Vec<String> = bound.resources[1..]
            .iter()
            .filter(|r| r.critical_seconds > 0.0)
            .map(|r| format!("{} {:.0}%", r.resource.name(), r.share * 100.0))
            .collect();
        outln!(
            "bound by {}: {:.0}% of the step ({:.4} s) is its work on the critical path{}; \
             with {} twice as fast the step would take {:.4} s (simulated on {on})",
            by.resource.name(),
            by.share * 100.0,
            by.critical_seconds,
            match others.is_empty() {
                true => String::new(),
                false => format!(" (then {})", others.join(", ")),
            },
            by.resource.name(),
            by.step_if_twice_as_fast
        );
    }
}

/// `explain`'s lines about the ranks (of a multi-GPU schedule), the disk tier (when used)
/// and the busy time of each kind of work and each stream.
fn explain_ranks_disk_streams(x: &Explained) {
    let (s, sim) = (x.s, x.sim);
    let (gpus, nodes) = s.topology();
    if gpus * nodes > 1 {
        let memory = match s.sharded() {
            true => "offloaded chunks sharded: each holds 1/ranks of their host state",
            false => "model states replicated",
        };
        outln!(
            "ranks    {} ({gpus} GPUs x {nodes} nodes), each with the memory above ({memory}); \
             {:.4} s of collectives (all-reduce, all-gather, reduce-scatter) per step on the \
             collective stream, {:.4} s of it not hidden by compute",
            gpus * nodes,
            sim.collective_seconds(s),
            sim.exposed_collective_seconds()
        );
    }
    if s.disk_bytes > 0 {
        let traffic = protrain::compiler::disk::traffic(s);
        outln!(
            "disk     {} in one file: {}, read into {} staging buffers before the {} and \
             written back after, on the disk i/o stream",
            format_bytes(s.disk_bytes),
            s.disk_holds(),
            s.buffers
                .iter()
                .filter(|b| {
                    matches!(
                        b.kind,
                        protrain::ir::BufferKind::DiskStaging { .. }
                            | protrain::ir::BufferKind::ShardStaging { .. }
                    )
                })
                .count(),
            match s.disk_storage_chunks().0.is_empty() {
                true => "CPU Adam",
                false => "uploads and the CPU Adam (gradients after their offload)",
            }
        );
        outln!(
            "         per step: {} read and {} written, {:.4} s of disk i/o, {:.4} s of it \
             hidden by neither compute nor the CPU Adam",
            format_bytes(traffic.read_bytes),
            format_bytes(traffic.write_bytes),
            sim.disk_seconds(),
            sim.exposed_disk_seconds()
        );
    }
    outln!(
        "by kind  {} (busy seconds; streams overlap)",
        super::time_by_kind_text(sim)
    );
    for (st, busy) in s.streams.iter().zip(&sim.stream_busy_seconds) {
        outln!(
            "  {:<16}{busy:.4} s busy, {} instructions",
            st.name,
            st.instrs.len()
        );
    }
}

/// The disk tier's part in the step, as `explain --json` gives it: bytes read and written
/// per step and the seconds they take, in all and not hidden; zeros without a disk tier.
fn disk_json(s: &VerifiedSchedule, sim: &Simulation) -> serde_json::Value {
    let traffic = protrain::compiler::disk::traffic(s);
    serde_json::json!({
        "read_bytes_per_step": traffic.read_bytes,
        "write_bytes_per_step": traffic.write_bytes,
        "busy_s": sim.disk_seconds(),
        "exposed_s": sim.exposed_disk_seconds(),
    })
}

/// One resource's part in the step, as `explain --json` gives it.
fn resource_json(r: &protrain::compiler::bound::ResourceTime) -> serde_json::Value {
    serde_json::json!({
        "resource": r.resource.key(),
        "critical_s": r.critical_seconds,
        "share": r.share,
        "step_if_twice_as_fast_s": r.step_if_twice_as_fast,
    })
}

/// `protrain trace`: the predicted timeline as a Chrome trace, to a file or (`-o -`) to
/// standard output.
pub fn trace(args: TraceArgs) -> Result<()> {
    let mut inputs = super::paths::Inputs::new();
    inputs
        .file(&args.schedule)
        .hardware(args.hardware.as_deref());
    let to_stdout = super::paths::stdout_or_checked(&args.output, args.json, "trace", &inputs)?;
    let s = read(&args.schedule)?;
    let (sim, on) = simulated(&s, args.hardware.as_deref())?;
    let json = chrome_trace(&s, &sim.timeline);
    if to_stdout {
        return super::write_output(None, &inputs.paths(), &json);
    }
    super::write_output(Some(&args.output), &inputs.paths(), &json)?;
    if args.json {
        let v = serde_json::json!({
            "output": args.output,
            "hardware": on,
            "spans": sim.timeline.len(),
            "predicted_step_s": sim.step_seconds,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&v).expect("JSON values serialise")
        );
        return Ok(());
    }
    outln!(
        "wrote {} spans over {:.4} s to {}",
        sim.timeline.len(),
        sim.step_seconds,
        args.output.display()
    );
    Ok(())
}
