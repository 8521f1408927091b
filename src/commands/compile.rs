//! `protrain compile`: the fastest schedule that fits a machine.

use super::{seq_or_default, OptimizerArgs};
use protrain::ir::{
    format_bytes, format_count, parse_size, BlockMode, DType, HardwareProfile, Schedule,
};
use protrain::{CompileOptions, Compiled, PolicyChoice, Result};
use std::path::PathBuf;

/// Element types a schedule can be compiled for.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16 parameters and activations (fp32 master weights and Adam moments).
    Bf16,
    /// f32 everywhere: what the host runtime executes, bit for bit.
    F32,
}

/// Arguments of `protrain compile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// The machine: a preset (rtx3090, rtx4090, a100-40gb, a100-80gb, h100, h200, host) or a
    /// profile JSON written by `protrain profile`.
    #[arg(long, default_value = "host")]
    hardware: String,
    /// Device memory the schedule may use, e.g. 24GiB, 512MiB or plain bytes [default: the
    /// hardware's memory less its reserved bytes].
    #[arg(long, value_name = "SIZE")]
    gpu_memory: Option<String>,
    /// Host memory the schedule may use [default: the hardware profile's].
    #[arg(long, value_name = "SIZE")]
    host_memory: Option<String>,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Tokens per sequence [default: 1024, or the model's position limit if smaller].
    #[arg(long)]
    seq: Option<u64>,
    /// Element type of parameters and activations.
    #[arg(long, value_enum, default_value_t = Dtype::Bf16)]
    dtype: Dtype,
    /// `auto` searches for the fastest policy that fits; or give one as key=value pairs:
    /// n_persist (chunks kept on the device), n_buffer (chunk buffers), n_swap and
    /// n_checkpoint (blocks swapped and recomputed, in ProTrain's interleaved layout), or
    /// blocks=KCS... (one mode per layer).
    #[arg(long, default_value = "auto")]
    policy: String,
    /// Write the schedule here [default: MODEL.ptsched in the current directory].
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// Do not fuse the forward graph (q/k/v and gate/up matmuls, activation and residual
    /// epilogues). Fusion changes no result; this is for comparing and debugging.
    #[arg(long)]
    no_fuse: bool,
    #[command(flatten)]
    optimizer: OptimizerArgs,
}

/// Loads the hardware profile and applies the memory overrides.
pub fn hardware(
    name: &str,
    gpu_memory: Option<&str>,
    host_memory: Option<&str>,
) -> Result<(HardwareProfile, Option<u64>)> {
    let mut profile = HardwareProfile::load(name)?;
    if let Some(host) = host_memory {
        profile = profile.with_host_memory(parse_size(host)?);
    }
    let budget = gpu_memory.map(parse_size).transpose()?;
    Ok((profile, budget))
}

/// Compiles, writes the schedule and prints the plan.
pub fn run(args: Args) -> Result<()> {
    let config = protrain::models::load(&args.model)?;
    let seq = seq_or_default(&config, args.seq, 1024);
    let (profile, budget) = hardware(
        &args.hardware,
        args.gpu_memory.as_deref(),
        args.host_memory.as_deref(),
    )?;
    let options = CompileOptions {
        batch: args.batch,
        seq,
        dtype: match args.dtype {
            Dtype::Bf16 => DType::BF16,
            Dtype::F32 => DType::F32,
        },
        hardware: profile.clone(),
        device_budget: budget,
        policy: PolicyChoice::parse(&args.policy)?,
        optimizer: args.optimizer.config(),
        fuse: !args.no_fuse,
    };
    let compiled = protrain::compile(&config, &options)?;
    let path = args
        .output
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("{}.ptsched", file_stem(&config.name))));
    protrain::ir::file::write(&path, &compiled.schedule)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary_json(&compiled, &path))
                .expect("JSON values serialise")
        );
    } else {
        print_summary(&compiled, &profile, &path);
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
fn rates(s: &Schedule) -> (f64, f64) {
    let p = &s.header.prediction;
    let tokens = (s.header.batch * s.header.seq) as f64;
    (
        tokens / p.step_seconds,
        p.flops as f64 / p.step_seconds / 1e12,
    )
}

fn summary_json(c: &Compiled, path: &std::path::Path) -> serde_json::Value {
    let s = &c.schedule;
    let p = &s.header.prediction;
    let (tokens_per_s, tflops) = rates(s);
    serde_json::json!({
        "model": s.header.model,
        "policy": s.header.policy.to_string(),
        "n_persist": s.header.policy.n_persist,
        "n_buffer": s.header.policy.n_buffer,
        "chunks": s.chunks.len(),
        "chunk_bytes": s.chunks.chunk_bytes,
        "predicted_step_s": p.step_seconds,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
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
        "compile_s": c.compile_seconds,
        "fusion": c.fusion,
        "schedule": path.display().to_string(),
    })
}

fn print_summary(c: &Compiled, profile: &HardwareProfile, path: &std::path::Path) {
    let s = &c.schedule;
    let h = &s.header;
    let p = &h.prediction;
    let (tokens_per_s, tflops) = rates(s);
    println!(
        "compiled {} ({} parameters, batch {} x seq {}, {}) for {} in {:.3} s",
        h.model,
        format_count(h.param_count),
        h.batch,
        h.seq,
        h.dtype,
        profile.name,
        c.compile_seconds
    );
    let streamed = s.chunks.len() as u32 - h.policy.n_persist;
    println!("policy          {}", h.policy);
    println!(
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
    println!(
        "predicted step  {:.4} s (compute: forward {:.4} s, backward {:.4} s, recompute {:.4} s, optimizer {:.4} s)",
        p.step_seconds, ph.forward, ph.backward, ph.recompute, ph.optimizer
    );
    println!("throughput      {tokens_per_s:.0} tokens/s, {tflops:.1} TFLOP/s");
    let gap = p.peak_device_bytes.saturating_sub(p.lower_bound_bytes) as f64
        / p.lower_bound_bytes.max(1) as f64
        * 100.0;
    println!(
        "device memory   {} of {} budget (lower bound {}, gap {:.2}%)",
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
        println!("  {what:<15}{}", format_bytes(bytes));
    }
    println!(
        "host memory     {} of {}",
        format_bytes(p.host_bytes),
        format_bytes(h.host_budget_bytes)
    );
    for (stream, busy) in s.streams.iter().zip(&p.stream_busy_seconds) {
        println!("  {:<15}{busy:.4} s busy", stream.name);
    }
    if let Some(fusion) = &c.fusion {
        print!("{}", fusion.to_text());
    }
    if let Some(report) = &c.report {
        print!("search          {}", report.to_text());
    }
    println!("schedule        {}", path.display());
}
