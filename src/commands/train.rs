//! `protrain train`: compile a model for this machine, then run the schedule.

use super::run::{check_backend, execute, plan_lines, BackendKind, ExecArgs};
use super::{warn, CompileArgs, Dtype};
use protrain::ir::format_count;
use protrain::Result;

/// Arguments of `protrain train`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// How to compile the model, as `protrain compile` takes it; without --dtype the schedule
    /// is f32 on --backend host and bf16 on --backend cuda, whatever the hardware.
    #[command(flatten)]
    compile: CompileArgs,
    #[command(flatten)]
    exec: ExecArgs,
}

/// Compiles the model for the hardware and budget, prints the plan, and runs the schedule.
pub fn run(mut args: Args) -> Result<()> {
    check_backend(args.exec.backend)?;
    if args.compile.shape.dtype == Some(Dtype::Bf16) && args.exec.backend == BackendKind::Host {
        return Err(protrain::Error::Usage(
            "the host backend's kernels are f32: drop --dtype bf16 (or give --dtype f32), or train on --backend cuda"
                .into(),
        ));
    }
    // The schedule must run on the backend: its kernels decide the element type.
    if args.compile.shape.dtype.is_none() {
        args.compile.shape.dtype = Some(match args.exec.backend {
            BackendKind::Host => Dtype::F32,
            BackendKind::Cuda => Dtype::Bf16,
        });
    }
    let config = protrain::models::load(&args.model)?;
    let options = args.compile.options(&config)?;
    let compiled = protrain::compile(&config, &options)?;
    warn(&compiled.warnings);
    let schedule = &compiled.schedule;
    let intro = format!(
        "training {} ({} parameters), batch {} x seq {}, lr {}; compiled in {:.3} s\n{}",
        config.name,
        format_count(schedule.header.param_count),
        options.batch,
        options.seq,
        args.compile.optimizer.lr,
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
