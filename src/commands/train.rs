//! `protrain train`: compile a model for this machine, then run the schedule.

use super::compile::{hardware, Dtype};
use super::run::{check_backend, execute, plan_lines, BackendKind, ExecArgs};
use super::{seq_or_default, OptimizerArgs};
use protrain::ir::{format_count, DType};
use protrain::{CompileOptions, PolicyChoice, Result};

/// Arguments of `protrain train`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// Tokens per sequence [default: 64, or the model's position limit if smaller].
    #[arg(long)]
    seq: Option<u64>,
    #[command(flatten)]
    optimizer: OptimizerArgs,
    /// The machine to compile for: a preset (host, rtx3090, a100-80gb, ...) or a profile JSON
    /// written by `protrain profile`. It decides the plan and the predicted step time; the
    /// schedule then runs on --backend, whatever it was planned for.
    #[arg(long, default_value = "host")]
    hardware: String,
    /// Device memory the schedule may use, e.g. 24GiB, 4MiB or plain bytes [default: the
    /// hardware's memory less its reserved bytes]. A tight budget makes the plan stream
    /// parameter chunks and swap or recompute activations; the losses stay the same bits.
    #[arg(long, value_name = "SIZE")]
    gpu_memory: Option<String>,
    /// `auto` searches for the fastest policy that fits; or give one as key=value pairs (see
    /// `protrain compile --help`).
    #[arg(long, default_value = "auto")]
    policy: String,
    /// Element type of parameters and activations [default: f32 on --backend host, whose
    /// kernels are f32; bf16 with f32 master weights on --backend cuda].
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Do not fuse the forward graph (see `protrain compile --help`); the losses are the same
    /// bits either way.
    #[arg(long)]
    no_fuse: bool,
    #[command(flatten)]
    exec: ExecArgs,
}

/// Compiles the model (f32 for the host backend, bf16 for the CUDA one, or --dtype) for the
/// hardware and budget, prints the plan, and runs the schedule.
pub fn run(args: Args) -> Result<()> {
    check_backend(args.exec.backend)?;
    if args.dtype == Some(Dtype::Bf16) && args.exec.backend == BackendKind::Host {
        return Err(protrain::Error::Usage(
            "the host backend's kernels are f32: drop --dtype bf16, or train on --backend cuda"
                .into(),
        ));
    }
    let config = protrain::models::load(&args.model)?;
    let seq = seq_or_default(&config, args.seq, 64);
    let optimizer = args.optimizer.config();
    let (profile, budget) = hardware(&args.hardware, args.gpu_memory.as_deref(), None)?;
    let options = CompileOptions {
        batch: args.batch,
        seq,
        dtype: match (args.dtype, args.exec.backend) {
            (Some(Dtype::F32), _) | (None, BackendKind::Host) => DType::F32,
            (Some(Dtype::Bf16), _) | (None, BackendKind::Cuda) => DType::BF16,
        },
        hardware: profile,
        device_budget: budget,
        policy: PolicyChoice::parse(&args.policy)?,
        optimizer,
        fuse: !args.no_fuse,
    };
    let compiled = protrain::compile(&config, &options)?;
    let schedule = &compiled.schedule;
    let intro = format!(
        "training {} ({} parameters), batch {} x seq {}, lr {}; compiled in {:.3} s\n{}",
        config.name,
        format_count(schedule.header.param_count),
        args.batch,
        seq,
        args.optimizer.lr,
        compiled.compile_seconds,
        plan_lines(schedule)
    );
    execute(
        schedule,
        &args.exec,
        &intro,
        Ok(compiled.simulation.timeline.clone()),
    )
}
