//! `protrain dump`: a model's IR at a compilation stage.

use super::{seq_or_default, write_output};
use protrain::{OptimizerConfig, Result};
use std::path::PathBuf;

/// The stages that can be dumped.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The forward graph the model builder lowers to.
    Forward,
    /// The training graph: forward, backward (autodiff) and the AdamW optimizer.
    Autodiff,
}

/// Output formats.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The canonical text form (stable; good for diffs and snapshots).
    Text,
    /// Graphviz DOT (`protrain dump MODEL --format dot | dot -Tsvg > graph.svg`).
    Dot,
    /// JSON that `protrain` and other tools can read back.
    Json,
}

/// Arguments of `protrain dump`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// The compilation stage to print.
    #[arg(long, value_enum, default_value_t = Stage::Forward)]
    stage: Stage,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Write to this file instead of standard output.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Sequences per step.
    #[arg(long, default_value_t = 1)]
    batch: u64,
    /// Tokens per sequence [default: 1024, or the model's position limit if smaller].
    #[arg(long)]
    seq: Option<u64>,
}

/// Builds the model's graph at the requested stage and prints it.
pub fn run(args: Args) -> Result<()> {
    let config = protrain::models::load(&args.model)?;
    let seq = seq_or_default(&config, args.seq, 1024);
    let forward = protrain::forward_graph(&config, args.batch, seq)?;
    let graph = match args.stage {
        Stage::Forward => forward,
        Stage::Autodiff => protrain::training_graph(&forward, &OptimizerConfig::default())?,
    };
    let text = match args.format {
        Format::Text => graph.to_text(),
        Format::Dot => graph.to_dot(),
        Format::Json => graph.to_json(),
    };
    write_output(args.output.as_deref(), &text)
}
