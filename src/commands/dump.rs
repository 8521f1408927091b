//! `protrain dump`: a model's IR, or a schedule's, at a compilation stage.

use super::{write_output, CompileArgs};
use protrain::compiler::split::Split;
use protrain::ir::print::value_names;
use protrain::ir::print_schedule::print_chunk_table;
use protrain::ir::{
    format_bytes, CopyKind, Graph, Instr, Movement, OpKind, Policy, Schedule, ValueId,
};
use protrain::{Context, Error, Result, Stage as PipelineStage};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The stages that can be dumped, in pipeline order.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The forward graph the model builder lowers to.
    Forward,
    /// The forward graph after fusion for --hardware (q/k/v and gate/up matmuls merged,
    /// activation, swiglu and residual epilogues); the fusion report goes to standard error
    /// (text) or beside the graph (JSON).
    Fused,
    /// The training graph: forward, backward (autodiff) and the AdamW optimizer.
    Autodiff,
    /// The training graph, then its chunk table: the chunk size, the sizes tried, and each
    /// chunk's parameters and used bytes.
    Chunked,
    /// The placed graph: the training graph in program order with recomputation cloned into
    /// the backward pass, the optimizer ops where the policy runs them, and every copy the
    /// policy implies as a movement op (prefetch/gather of a chunk into a slot, release,
    /// offload_grads, offload and reload of swapped activations, to_host), with the policy,
    /// a count of each movement and the activations swapped to the host. A schedule file
    /// holds the lowered graph, whose movement is in its copy instructions.
    Placed,
    /// The streams and their events. The schedule printer writes each instruction with its
    /// buffers and offsets, so this prints the full schedule, as `planned` does.
    Scheduled,
    /// The full schedule: header, chunk table, buffers with their offsets, streams.
    Planned,
}

impl Stage {
    /// The name `--stage` takes.
    fn name(self) -> &'static str {
        match self {
            Stage::Forward => "forward",
            Stage::Fused => "fused",
            Stage::Autodiff => "autodiff",
            Stage::Chunked => "chunked",
            Stage::Placed => "placed",
            Stage::Scheduled => "scheduled",
            Stage::Planned => "planned",
        }
    }

    /// Whether a compiled schedule holds this stage (the placed graph and everything after).
    fn in_schedule(self) -> bool {
        matches!(self, Stage::Placed | Stage::Scheduled | Stage::Planned)
    }
}

/// Output formats.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The canonical text form (stable; good for diffs and snapshots).
    Text,
    /// Graphviz DOT of the stage's graph (`protrain dump MODEL --format dot | dot -Tsvg >
    /// graph.svg`); not for `scheduled` and `planned`.
    Dot,
    /// JSON: the graph for `forward` and `autodiff`; `{graph, fusion}` for `fused`;
    /// `{graph, chunks}` for `chunked`;
    /// `{policy, swapped, graph}` for `placed`; the whole schedule for `scheduled` and
    /// `planned`.
    Json,
}

/// Arguments of `protrain dump`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one; or,
    /// for the stages `placed`, `scheduled` and `planned`, a compiled .ptsched schedule.
    model: String,
    /// The compilation stage to print: forward, fused, autodiff and chunked build the model's
    /// graphs (autodiff and chunked from the fused graph unless --no-fuse); placed, scheduled
    /// and planned compile it (or read the schedule file given) [default: forward for a
    /// model, planned for a schedule file].
    #[arg(long, value_enum)]
    stage: Option<Stage>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Print JSON: the same as --format json.
    #[arg(long, conflicts_with = "format")]
    json: bool,
    /// Write to this file instead of standard output (`-` is standard output).
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// How to build and compile the model (ignored stages aside, as `compile` takes them).
    #[command(flatten)]
    compile: CompileArgs,
    /// Compile the forward pass alone, as `compile --forward-only` does: the stages after
    /// fused have no backward pass, gradients or optimizer (autodiff prints the fused graph).
    #[arg(long)]
    forward_only: bool,
}

impl Args {
    /// The output format: --format, or JSON with --json.
    fn format(&self) -> Format {
        if self.json {
            Format::Json
        } else {
            self.format
        }
    }
}

/// Builds the model's graph at the requested stage, or compiles it or reads a schedule file,
/// and prints it.
pub fn run(args: Args) -> Result<()> {
    let output = args.output.as_deref().filter(|p| *p != Path::new("-"));
    let mut inputs = super::paths::Inputs::new();
    inputs
        .model(&args.model)
        .hardware(args.compile.machine.hardware.as_deref());
    if let Some(path) = output {
        super::paths::check_outputs(&[("-o", path)], &inputs)?;
    }
    let text = if is_schedule_file(Path::new(&args.model)) {
        let stage = args.stage.unwrap_or(Stage::Planned);
        if !stage.in_schedule() {
            return Err(Error::Usage(format!(
                "{} is a compiled schedule, which holds the stages placed, scheduled and planned, not {}; dump a model (preset or config.json) for the stages forward, autodiff and chunked",
                args.model,
                stage.name()
            )));
        }
        let given = args.compile.machine.given();
        if !given.is_empty() {
            return Err(Error::Usage(format!(
                "{} is a compiled schedule, printed as it was compiled; {} applies when compiling a model. For its times on other hardware, run `protrain explain {} --hardware NAME`",
                args.model,
                given.join(" and "),
                args.model
            )));
        }
        let schedule = protrain::ir::file::read(&args.model)?;
        schedule_stage(&schedule, stage, args.format())?
    } else {
        model_stage(&args)?
    };
    write_output(output, &inputs.paths(), &text)
}

/// Whether `path` names a schedule: a `.ptsched` file, or any file that starts with the
/// schedule magic.
fn is_schedule_file(path: &Path) -> bool {
    use std::io::Read as _;
    if path
        .extension()
        .is_some_and(|e| e == protrain::ir::file::EXTENSION)
    {
        return true;
    }
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| &magic == protrain::ir::file::MAGIC)
}

/// A stage of a model: its graphs, or a schedule compiled for it.
fn model_stage(args: &Args) -> Result<String> {
    let config = protrain::models::load(&args.model)?;
    let format = args.format();
    let stage = args.stage.unwrap_or(Stage::Forward);
    if stage == Stage::Fused && args.compile.no_fuse {
        return Err(Error::Usage(
            "--stage fused with --no-fuse asks for fusion and refuses it; drop --no-fuse".into(),
        ));
    }
    let mut options = args.compile.options(&config)?;
    options.forward_only = args.forward_only;
    let until = match stage {
        Stage::Forward => PipelineStage::Forward,
        Stage::Fused => PipelineStage::Fused,
        Stage::Autodiff => PipelineStage::Autodiff,
        Stage::Chunked => PipelineStage::Chunked,
        Stage::Placed => PipelineStage::Placed,
        Stage::Scheduled | Stage::Planned => PipelineStage::Compiled,
    };
    // The stages of the split `compile` would choose: a global batch's fastest split at every
    // stage; a batch that does not fit split where a stage places a policy.
    let split = match args.forward_only {
        true => Split::Exact,
        false => args.compile.split()?,
    };
    let resolve = match split {
        Split::Exact => false,
        Split::IfNeeded => until >= PipelineStage::Placed,
        Split::Global { .. } => true,
    };
    if resolve {
        let (compiled, report) = protrain::compile_split(&config, &options, split)?;
        if let Some(report) = report {
            eprint!("{}", report.to_text());
        }
        if until == PipelineStage::Compiled {
            super::warn(&compiled.warnings);
            return schedule_stage(&compiled.schedule, stage, format);
        }
        options.batch = compiled.schedule.header.batch;
        options.micro_batches = u64::from(compiled.schedule.micro_batches_per_step());
    }
    let mut context = Context::new(&config, options);
    if until == PipelineStage::Placed {
        context.run_until(until)?;
        let compiled = context.compiled().expect("placing compiles");
        super::warn(&compiled.warnings);
        let placed = context.placed().expect("placed");
        return Ok(placed_graph(&placed.graph, &placed.policy, format));
    }
    if until == PipelineStage::Compiled {
        let compiled = context.compile()?;
        super::warn(&compiled.warnings);
        return schedule_stage(&compiled.schedule, stage, format);
    }
    context.run_until(until)?;
    Ok(match stage {
        Stage::Forward => graph_text(context.forward().expect("built"), format),
        Stage::Fused => {
            let (graph, report) = context.fused().expect("fused");
            let report = report.expect("fusion is on");
            match format {
                Format::Json => pretty(&serde_json::json!({ "graph": graph, "fusion": report })),
                Format::Text | Format::Dot => {
                    eprint!("{}", report.to_text());
                    graph_text(graph, format)
                }
            }
        }
        Stage::Autodiff => graph_text(context.training().expect("differentiated"), format),
        _ => {
            let training = context.training().expect("differentiated");
            let chunks = context.chunks().expect("chunked");
            match format {
                Format::Text => format!(
                    "{}{}",
                    training.to_text(),
                    print_chunk_table(chunks, training)
                ),
                Format::Dot => training.to_dot(),
                Format::Json => pretty(&serde_json::json!({ "graph": training, "chunks": chunks })),
            }
        }
    })
}

/// A stage held in a schedule: its placed graph, or the schedule itself.
fn schedule_stage(schedule: &Schedule, stage: Stage, format: Format) -> Result<String> {
    if stage == Stage::Placed {
        return Ok(placed(schedule, format));
    }
    match format {
        Format::Text => Ok(schedule.to_text()),
        Format::Json => Ok(pretty(schedule)),
        Format::Dot => Err(Error::Usage(format!(
            "the {} stage is a schedule, which has no DOT form; use --format text or json, or --stage placed --format dot for its graph",
            stage.name()
        ))),
    }
}

/// The placed graph of a model: the policy, what it moves (a line per kind of movement, then
/// the activations it swaps), and the graph with its movement ops in program order.
fn placed_graph(graph: &Graph, policy: &Policy, format: Format) -> String {
    let swapped: Vec<ValueId> = graph
        .ops()
        .filter(|(_, op)| op.kind == OpKind::MoveStart(Movement::Offload))
        .map(|(_, op)| op.inputs[0])
        .collect();
    let mut counts: Vec<(&'static str, usize, u64)> = Vec::new();
    for (_, op) in graph.ops() {
        if let OpKind::MoveDone(_) | OpKind::Release { .. } = op.kind {
            let bytes: u64 = op.inputs.iter().map(|&v| graph.value(v).ty.bytes()).sum();
            let name = op.kind.mnemonic();
            match counts.iter_mut().find(|(n, _, _)| *n == name) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += bytes;
                }
                None => counts.push((name, 1, bytes)),
            }
        }
    }
    let names = value_names(graph);
    match format {
        Format::Dot => graph.to_dot(),
        Format::Json => pretty(&serde_json::json!({
            "policy": policy,
            "movement": counts
                .iter()
                .map(|(kind, n, bytes)| serde_json::json!({ "kind": kind, "count": n, "bytes": bytes }))
                .collect::<Vec<_>>(),
            "swapped": swapped_json(graph, &names, &swapped),
            "graph": graph,
        })),
        Format::Text => {
            let mut out = String::new();
            let _ = writeln!(out, "; policy: {policy}");
            out.push_str(&swapped_text(graph, &names, &swapped));
            let list: Vec<String> = counts
                .iter()
                .map(|(kind, n, bytes)| match *kind {
                    "release" => format!("{n} {kind}"),
                    _ => format!("{n} {kind} ({})", format_bytes(*bytes)),
                })
                .collect();
            let list = if list.is_empty() {
                "none".to_string()
            } else {
                list.join(", ")
            };
            let _ = writeln!(out, "; movement: {list}");
            out.push_str(&graph.to_text());
            out
        }
    }
}

/// The swapped activations as JSON: each value, its name and size.
fn swapped_json(graph: &Graph, names: &[String], swapped: &[ValueId]) -> Vec<serde_json::Value> {
    swapped
        .iter()
        .map(|v| {
            serde_json::json!({
                "value": v,
                "name": names.get(v.index()),
                "bytes": graph.value(*v).ty.bytes(),
            })
        })
        .collect()
}

/// The swapped activations as comment lines: their count and size, then one line each.
fn swapped_text(graph: &Graph, names: &[String], swapped: &[ValueId]) -> String {
    let mut out = String::new();
    let total: u64 = swapped.iter().map(|&v| graph.value(v).ty.bytes()).sum();
    let _ = writeln!(
        out,
        "; swapped activations: {}, {}",
        swapped.len(),
        format_bytes(total)
    );
    for &v in swapped {
        let value = graph.value(v);
        let _ = writeln!(
            out,
            ";   {} ({}) {} {}",
            names[v.index()],
            value.name,
            value.ty,
            format_bytes(value.ty.bytes())
        );
    }
    out
}

/// The placed graph as a schedule file holds it: lowered, its movement in the copy
/// instructions; the policy, and the activations it swaps to the host (those the schedule
/// offloads), in order of their offload.
fn placed(schedule: &Schedule, format: Format) -> String {
    let graph = &schedule.graph;
    let swapped: Vec<ValueId> = schedule
        .streams
        .iter()
        .flat_map(|s| &s.instrs)
        .filter_map(|instr| match instr {
            Instr::Copy {
                what: CopyKind::OffloadActivation { value },
                ..
            } => Some(*value),
            _ => None,
        })
        .collect();
    let names = value_names(graph);
    let policy = &schedule.header.policy;
    match format {
        Format::Dot => graph.to_dot(),
        Format::Json => pretty(&serde_json::json!({
            "policy": policy,
            "swapped": swapped_json(graph, &names, &swapped),
            "graph": graph,
        })),
        Format::Text => {
            let mut out = String::new();
            let _ = writeln!(out, "; policy: {policy}");
            out.push_str(&swapped_text(graph, &names, &swapped));
            out.push_str(
                "; movement: in the copy instructions (a schedule file holds the lowered graph; \
                 dump the model for its placed graph with movement ops)\n",
            );
            out.push_str(&graph.to_text());
            out
        }
    }
}

fn graph_text(graph: &Graph, format: Format) -> String {
    match format {
        Format::Text => graph.to_text(),
        Format::Dot => graph.to_dot(),
        Format::Json => graph.to_json(),
    }
}

fn pretty(value: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(value).expect("graphs, chunk tables and schedules serialise")
}
