//! `protrain compile`: the fastest schedule that fits a machine.

use super::{warn, CompileArgs};
use protrain::compiler::split::{SplitReport, SplitWhy};
use protrain::ir::{format_bytes, format_count, BlockMode, HardwareProfile, Schedule};
use protrain::{Compiled, Result};
use std::path::PathBuf;

/// Arguments of `protrain compile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    #[command(flatten)]
    compile: CompileArgs,
    /// Write the schedule here, or `-` for standard output (then nothing else is printed)
    /// [default: MODEL.ptsched in the current directory].
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Compile and print the plan without writing a schedule file.
    #[arg(long, conflicts_with = "output")]
    dry_run: bool,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// Compile the forward pass alone, for evaluation (`protrain eval`, `run --eval-schedule`):
    /// no backward pass, no gradients, no optimizer; parameters are read-only, streamed
    /// chunks are fetched and released, and every layer is kept. The optimizer flags do not
    /// apply.
    #[arg(long)]
    forward_only: bool,
}

/// Compiles, writes the schedule (to standard output for `-o -`, nowhere for `--dry-run`) and
/// prints the plan.
pub fn run(args: Args) -> Result<()> {
    let mut inputs = super::paths::Inputs::new();
    inputs
        .model(&args.model)
        .hardware(args.compile.machine.hardware.as_deref());
    let to_stdout = args.output.as_deref() == Some(std::path::Path::new("-"));
    if to_stdout && args.json {
        return Err(protrain::Error::Usage(
            "`-o -` writes the schedule on standard output, where --json would print too: \
             write the schedule to a file, or use --dry-run --json to see the plan alone"
                .into(),
        ));
    }
    if let Some(path) = args.output.as_ref().filter(|_| !to_stdout) {
        super::paths::check_outputs(&[("-o", path)], &inputs)?;
    }
    let config = protrain::models::load(&args.model)?;
    let mut options = args.compile.options(&config)?;
    options.forward_only = args.forward_only;
    let o = &args.compile.optimizer;
    let optimizer_flags = [o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip];
    if args.forward_only && optimizer_flags.iter().any(Option::is_some) {
        return Err(protrain::Error::Usage(
            "--forward-only compiles no optimizer, so the optimizer flags (--lr, --beta1, \
             --beta2, --eps, --weight-decay, --grad-clip) do not apply; drop them"
                .into(),
        ));
    }
    let profile = options.hardware.clone();
    let split = match args.forward_only {
        true if args.compile.global_batch.is_some() => {
            return Err(protrain::Error::Usage(
                "--global-batch with --forward-only: a forward-only schedule has no optimizer \
                 step to split into micro-batches; give --batch"
                    .into(),
            ))
        }
        true => protrain::compiler::split::Split::Exact,
        false => args.compile.split()?,
    };
    let (compiled, split) = protrain::compile_split(&config, &options, split)?;
    warn(&compiled.warnings);
    let path = args
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.ptsched", file_stem(&config.name))));
    if to_stdout {
        crate::out::write_all(&protrain::ir::file::encode(&compiled.schedule));
        return Ok(());
    }
    let written = if args.dry_run {
        None
    } else {
        super::paths::check_outputs(&[("-o", &path)], &inputs)?;
        protrain::ir::file::write(&path, &compiled.schedule)?;
        Some(path.as_path())
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&summary_json(&compiled, split.as_ref(), written))
                .expect("JSON values serialise")
        );
    } else {
        print_summary(&compiled, split.as_ref(), &profile, written);
    }
    Ok(())
}

/// A file name from a model name or config path: `llama-2-7b`, or the config's directory.
fn file_stem(name: &str) -> String {
    let path = std::path::Path::new(name);
    let stem = match path.file_name().and_then(|f| f.to_str()) {
        Some("config.json") => path
            .parent()
            .and_then(|p| p.file_name())
            .and_then(|f| f.to_str())
            .unwrap_or("model"),
        Some(f) => f.trim_end_matches(".json"),
        None => "model",
    };
    stem.to_string()
}

/// Tokens per second and achieved TFLOP/s of the predicted step.
/// The predicted rates of a step: tokens per second over the whole run (every rank's
/// micro-batches: `ranks x micro-batches x batch x seq` tokens a step) and TFLOP/s of one GPU
/// (the schedule's FLOPs are one rank's, every micro-batch counted).
fn rates(s: &Schedule) -> (f64, f64) {
    let p = &s.header.prediction;
    let tokens = (s.header.batch * s.header.seq) as f64
        * f64::from(s.micro_batches_per_step())
        * f64::from(s.ranks());
    (
        tokens / p.step_seconds,
        p.flops as f64 / p.step_seconds / 1e12,
    )
}

/// The split chosen as JSON: the rows per step, the micro-batch rows and count chosen, why,
/// and each split tried with its predicted step (null where it did not fit).
fn split_json(r: &SplitReport) -> serde_json::Value {
    serde_json::json!({
        "rows": r.rows,
        "ranks": r.ranks,
        "batch": r.batch,
        "micro_batches": r.micro_batches,
        "why": match r.why {
            SplitWhy::DoesNotFit => "does_not_fit",
            SplitWhy::Fastest => "fastest",
        },
        "text": r.to_text(),
        "tried": r.tried.iter().map(|t| serde_json::json!({
            "batch": t.batch,
            "micro_batches": t.micro_batches,
            "predicted_step_s": t.step.as_ref().map(|s| s.seconds),
            "compute_s": t.step.as_ref().map(|s| s.compute),
            "cpu_adam_s": t.step.as_ref().map(|s| s.cpu_adam),
            "peak_device_bytes": t.step.as_ref().map(|s| s.peak_device_bytes),
        })).collect::<Vec<_>>(),
    })
}

/// The plan as JSON; `schedule` is the file written, null for a dry run; `split` the split
/// the compiler chose, null where the batch was compiled as given.
fn summary_json(
    c: &Compiled,
    split: Option<&SplitReport>,
    path: Option<&std::path::Path>,
) -> serde_json::Value {
    let s = &c.schedule;
    let p = &s.header.prediction;
    let (tokens_per_s, tflops) = rates(s);
    serde_json::json!({
        "model": s.header.model,
        "policy": s.header.policy.to_string(),
        "forward_only": s.graph.is_forward_only(),
        "n_persist": s.header.policy.n_persist,
        "n_buffer": s.header.policy.n_buffer,
        "chunks": s.chunks.len(),
        "chunk_bytes": s.chunks.chunk_bytes,
        "predicted_step_s": p.step_seconds,
        // The search's closed-form estimate of the winner's step (null for a fixed policy).
        "estimated_step_s": c
            .report
            .as_ref()
            .and_then(|r| r.compiled.first())
            .map(|w| w.estimated_seconds),
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "ranks": s.ranks(),
        "micro_batches": s.micro_batches_per_step(),
        "micro_batch_order": s.header.policy.order.name(),
        "batch": s.header.batch,
        "split": split.map(split_json),
        "peak_device_bytes": p.peak_device_bytes,
        "lower_bound_bytes": p.lower_bound_bytes,
        "device_budget_bytes": s.header.device_budget_bytes,
        "host_bytes": p.host_bytes,
        "memory": p.memory,
        "phase_seconds": {
            "forward": c.simulation.phase_seconds.forward,
            "backward": c.simulation.phase_seconds.backward,
            "recompute": c.simulation.phase_seconds.recompute,
            "optimizer": c.simulation.phase_seconds.optimizer,
        },
        "stream_busy_seconds": p.stream_busy_seconds,
        "disk_bytes": s.disk_bytes,
        "disk_chunks": s.disk_chunks().len(),
        "time_by_kind": super::time_by_kind(&c.simulation)
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
        "compile_s": c.compile_seconds,
        "warnings": c.warnings,
        "fusion": c.fusion,
        "schedule": path.map(|p| p.display().to_string()),
    })
}

fn print_summary(
    c: &Compiled,
    split: Option<&SplitReport>,
    profile: &HardwareProfile,
    path: Option<&std::path::Path>,
) {
    let s = &c.schedule;
    let h = &s.header;
    let p = &h.prediction;
    let (tokens_per_s, tflops) = rates(s);
    outln!(
        "compiled {} ({} parameters, batch {} x seq {}, {}) for {} in {:.3} s",
        h.model,
        format_count(h.param_count),
        h.batch,
        h.seq,
        h.dtype,
        profile.name,
        c.compile_seconds
    );
    if let Some(split) = split {
        out!("{}", split.to_text());
    }
    let streamed = s.chunks.len() as u32 - h.policy.n_persist;
    outln!("policy          {}", h.policy);
    if s.graph.is_forward_only() {
        outln!("                forward only: the loss and nothing else (for evaluation)");
    }
    outln!(
        "                {} of {} chunks of {} persistent, {} streamed through {} buffer(s); layers: {} kept, {} checkpointed, {} swapped",
        h.policy.n_persist,
        s.chunks.len(),
        format_bytes(s.chunks.chunk_bytes),
        streamed,
        h.policy.n_buffer,
        h.policy.count(BlockMode::Keep),
        h.policy.count(BlockMode::Checkpoint),
        h.policy.count(BlockMode::Swap)
    );
    let ph = &c.simulation.phase_seconds;
    outln!(
        "predicted step  {:.4} s (compute: forward {:.4} s, backward {:.4} s, recompute {:.4} s, optimizer {:.4} s)",
        p.step_seconds, ph.forward, ph.backward, ph.recompute, ph.optimizer
    );
    let ranks = s.ranks();
    if ranks > 1 {
        outln!(
            "throughput      {tokens_per_s:.0} tokens/s over {ranks} ranks ({:.0} per rank), {tflops:.1} TFLOP/s per GPU",
            tokens_per_s / f64::from(ranks)
        );
    } else {
        outln!("throughput      {tokens_per_s:.0} tokens/s, {tflops:.1} TFLOP/s");
    }
    let gap = p.peak_device_bytes.saturating_sub(p.lower_bound_bytes) as f64
        / p.lower_bound_bytes.max(1) as f64
        * 100.0;
    outln!(
        "device memory   {} of {} budget per GPU (lower bound {}, gap {:.2}%)",
        format_bytes(p.peak_device_bytes),
        format_bytes(h.device_budget_bytes),
        format_bytes(p.lower_bound_bytes),
        gap
    );
    let m = &p.memory;
    for (what, bytes) in [
        ("persistent", m.persistent),
        ("chunk buffers", m.chunk_buffers),
        ("activations", m.activations),
        ("workspace", m.workspace),
        ("inputs", m.inputs),
    ] {
        outln!("  {what:<15}{}", format_bytes(bytes));
    }
    outln!(
        "host memory     {} of {}",
        format_bytes(p.host_bytes),
        super::per_rank_budget(
            h.host_budget_bytes,
            profile.host_memory_bytes,
            s,
            "--host-memory"
        )
    );
    if s.disk_bytes > 0 {
        outln!(
            "disk            {} of {}: {}, read and written back every step",
            format_bytes(s.disk_bytes),
            super::per_rank_budget(
                h.disk_budget_bytes,
                profile.disk.memory_bytes,
                s,
                "--disk-memory"
            ),
            s.disk_holds()
        );
    }
    for (stream, busy) in s.streams.iter().zip(&p.stream_busy_seconds) {
        outln!("  {:<15}{busy:.4} s busy", stream.name);
    }
    outln!(
        "time by kind    {} (streams overlap)",
        super::time_by_kind_text(&c.simulation)
    );
    if let Some(fusion) = &c.fusion {
        out!("{}", fusion.to_text());
    }
    if let Some(report) = &c.report {
        out!("search          {}", report.to_text());
    }
    match path {
        Some(path) => outln!("schedule        {}", path.display()),
        None => outln!("schedule        not written (--dry-run)"),
    }
}
