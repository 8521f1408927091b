//! The `protrain` command line: parses arguments, calls the crates, prints.

#[macro_use]
mod out;
mod commands;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// mimalloc instead of the system allocator: a compile builds and drops a graph per searched
/// candidate, and the system allocator's malloc and free take about a fifth of a deep model's
/// compile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Train large language models on GPUs too small to hold them.
///
/// protrain lowers a model to a dataflow IR, derives its backward pass, and compiles a
/// schedule that decides which parameter chunks stay on the GPU, which are streamed from host
/// memory, and which activations are kept, swapped or recomputed.
///
/// A MODEL is a preset name (`protrain models` lists them), a path to a Hugging Face
/// `config.json`, or a directory that holds one.
#[derive(Parser, Debug)]
#[command(
    name = "protrain",
    version,
    propagate_version = true,
    max_term_width = 100
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the model presets with their parameter counts.
    Models(commands::models::Args),
    /// Show a model's dimensions, parameter count and model-state memory.
    Info(commands::info::Args),
    /// Print a model's IR at a compilation stage.
    Dump(commands::dump::Args),
    /// Train a model on a token file or the built-in synthetic corpus: compile it for this
    /// machine (or --hardware and --gpu-memory), then run the schedule.
    Train(Box<commands::train::Args>),
    /// Evaluate weights (a checkpoint directory or a safetensors file) on held-out data:
    /// the mean loss and perplexity, by a forward-only schedule.
    Eval(commands::eval::Args),
    /// Run a compiled schedule for a number of steps, and compare its step time with the
    /// prediction.
    Run(Box<commands::run::Args>),
    /// Compile the fastest schedule that fits a machine and write it as a .ptsched file.
    Compile(commands::compile::Args),
    /// Check a schedule file: its format, checksum and every invariant of the verifier.
    Verify(commands::schedule::VerifyArgs),
    /// Explain a schedule: the policy and why, memory at the peak, time per phase and stream.
    Explain(commands::schedule::ExplainArgs),
    /// Write a schedule's predicted timeline as a Chrome trace.
    Trace(commands::schedule::TraceArgs),
    /// Draw a schedule's device memory over one predicted step, stacked by kind with the
    /// budget and the peak, above the arena as planned (SVG or PNG).
    Plot(commands::plot::Args),
    /// Measure this machine (op times, copy bandwidths, Adam rate) as a hardware profile JSON.
    Profile(commands::profile::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Models(args) => commands::models::run(args),
        Command::Info(args) => commands::info::run(args),
        Command::Dump(args) => commands::dump::run(args),
        Command::Train(args) => commands::train::run(*args),
        Command::Eval(args) => commands::eval::run(args),
        Command::Run(args) => commands::run::run(*args),
        Command::Compile(args) => commands::compile::run(args),
        Command::Verify(args) => commands::schedule::verify(args),
        Command::Explain(args) => commands::schedule::explain(args),
        Command::Trace(args) => commands::schedule::trace(args),
        Command::Plot(args) => commands::plot::run(args),
        Command::Profile(args) => commands::profile::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(2)
        }
    }
}
