//! `protrain profile`: measure this machine for a model and write a hardware profile JSON.

use super::{seq_or_default, write_output};
use protrain::ir::format_bytes;
use protrain::runtime::profiler::{profile_host, ProfileOptions};
use protrain::{Error, OptimizerConfig, Result};
use std::path::PathBuf;

/// Backends a profile can be measured on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The host CPU as the device: kernels on the CPU cores, copies as `memcpy`.
    Host,
    /// An NVIDIA GPU through CUDA (needs a build with the `cuda` feature).
    Cuda,
}

/// Arguments of `protrain profile`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one. Its
    /// training graph's ops (at --batch x --seq, f32) make the measured op table.
    model: String,
    /// Where to measure.
    #[arg(long, value_enum, default_value_t = BackendKind::Host)]
    backend: BackendKind,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Tokens per sequence [default: 1024, or the model's position limit if smaller].
    #[arg(long)]
    seq: Option<u64>,
    /// Timed runs of each op; the median is kept.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Write the profile here [default: standard output]. `protrain compile --hardware FILE`
    /// reads it.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
}

/// Builds the training graph, measures the backend and writes the profile.
pub fn run(args: Args) -> Result<()> {
    if args.backend == BackendKind::Cuda {
        return Err(Error::Usage(
            "the cuda backend is not built into this protrain; rebuild with `cargo build \
             --release --features cuda` on a machine with CUDA, or profile with --backend host"
                .into(),
        ));
    }
    if args.repeats == 0 {
        return Err(Error::Usage(
            "--repeats must be at least 1; each op is timed that many times".into(),
        ));
    }
    let config = protrain::models::load(&args.model)?;
    let seq = seq_or_default(&config, args.seq, 1024);
    let forward = protrain::forward_graph(&config, args.batch, seq)?;
    let graph = protrain::training_graph(&forward, &OptimizerConfig::default())?;
    let options = ProfileOptions {
        repeats: args.repeats,
        ..ProfileOptions::default()
    };
    let profiled = profile_host(&graph, &options)?;
    let text = profiled.profile.to_json()?;
    write_output(args.output.as_deref(), &format!("{text}\n"))?;
    if let Some(path) = &args.output {
        let p = &profiled.profile;
        println!(
            "profiled {} (batch {} x seq {}, f32) on the host in {:.1} s",
            config.name, args.batch, seq, profiled.elapsed_seconds
        );
        println!(
            "ops             {} distinct of {}, {:.4} s per serial step",
            p.measured_ops.len(),
            graph.op_count(),
            profiled.graph_seconds
        );
        println!(
            "copies          {:.2} GB/s host->device, {:.2} GB/s device->host, {:.1} us launch",
            p.h2d_bandwidth / 1e9,
            p.d2h_bandwidth / 1e9,
            p.launch_overhead_s * 1e6
        );
        println!(
            "host            {:.2} GB/s memcpy, Adam {:.1} M params/s, {:.1} GFLOP/s f32 peak",
            p.host_memcpy_bandwidth / 1e9,
            p.cpu_adam_params_per_s / 1e6,
            p.peak_flops.f32 / 1e9
        );
        println!(
            "memory          {} device, {} host (from the host preset)",
            format_bytes(p.device_memory_bytes),
            format_bytes(p.host_memory_bytes)
        );
        println!("profile         {}", path.display());
    }
    Ok(())
}
