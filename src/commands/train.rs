//! `protrain train`: compile a model for this machine, then run the schedule.

use super::launch::{self, NodeArgs, Role};
use super::run::{check_backend, execute, plan_lines, BackendKind, ExecArgs};
use super::{warn, CompileArgs, Dtype};
use protrain::ir::format_count;
use protrain::runtime::checkpoint::{self, SavedRun};
use protrain::runtime::RuntimeError;
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
    #[command(flatten)]
    node: NodeArgs,
    /// The model's vocabulary size, in place of its config's or preset's (a preset given a
    /// --tokenizer with more ids than its vocabulary takes the tokenizer's size without it).
    #[arg(long, value_name = "N")]
    vocab: Option<u32>,
}

/// Compiles the model for the hardware and budget, prints the plan, and runs the schedule.
/// On the CUDA backend with more than one GPU, starts one worker process per GPU instead
/// (see [`launch`]), or is one of them.
pub fn run(mut args: Args) -> Result<()> {
    let mut inputs = super::paths::Inputs::new();
    inputs
        .model(&args.model)
        .hardware(args.compile.machine.hardware.as_deref())
        .exec(&args.exec);
    super::paths::check_exec_outputs(&args.exec, &inputs)?;
    let cuda = args.exec.backend == BackendKind::Cuda;
    let (gpus, nodes) = (args.compile.gpus, args.compile.nodes);
    match launch::role(cuda, gpus, nodes, &args.node, |v| std::env::var(v).ok())? {
        Role::Single => {}
        Role::Launcher(workers) => {
            // The workers check the backend too; the launcher's tests probe them without one.
            if std::env::var_os(launch::PROBE).is_none() {
                check_backend(args.exec.backend)?;
            }
            return launch::run_workers(&workers);
        }
        Role::Worker(me) => {
            if let Some(probed) = launch::probe(&me) {
                return probed;
            }
            args.exec.launch = Some(me);
        }
    }
    check_backend(args.exec.backend)?;
    // A resumed run trains in its checkpoint's element type (taken here when recorded);
    // otherwise the schedule must run on the backend: its kernels decide the element type.
    if let Some(dir) = &args.exec.resume {
        let saved = checkpoint::peek_latest(dir)?;
        take_from_checkpoint(&mut args.compile, &saved)?;
    }
    if args.compile.shape.dtype.is_none() {
        args.compile.shape.dtype = Some(match args.exec.backend {
            BackendKind::Host => Dtype::F32,
            BackendKind::Cuda => Dtype::Bf16,
        });
    }
    let mut config = protrain::models::load(&args.model)?;
    let vocab_note = fit_vocab(
        &mut config,
        &args.model,
        args.vocab,
        args.exec.tokenizer.as_deref(),
    )?;
    let mut options = args.compile.options(&config)?;
    // With --eval-data, the evaluation schedule's leanest arena is set aside first, so the
    // training schedule always leaves room for one.
    let reserved = match &args.exec.eval.eval_data {
        Some(_) => super::eval::reserve_for_eval(&config, &mut options)?,
        None => 0,
    };
    let split = args.compile.split()?;
    let (compiled, split) = match protrain::compile_split(&config, &options, split) {
        Err(
            why @ protrain::Error::Compile(
                protrain::compiler::CompileError::BudgetTooSmall(_)
                | protrain::compiler::CompileError::PolicyOverDevice { .. }
                | protrain::compiler::CompileError::NoSplitFits { .. },
            ),
        ) if reserved > 0 => {
            return Err(protrain::Error::Usage(format!(
                "{why} (with --eval-data, add the {} its forward-only schedule needs beside \
                 the training one)",
                protrain::ir::format_bytes(reserved)
            )))
        }
        compiled => compiled?,
    };
    warn(&compiled.warnings);
    let schedule = &compiled.schedule;
    // The split the compiler chose, where it chose one, is the shape the schedule runs; the
    // evaluation schedule (below) reads batches of the rows asked for, as its reserve was
    // planned.
    let accum = match (schedule.micro_batches_per_step(), schedule.is_chunk_major()) {
        (1, _) => String::new(),
        (k, false) => format!(" x {k} micro-batches"),
        (k, true) => format!(" x {k} micro-batches (chunk-major)"),
    };
    let split_note = split.map_or(String::new(), |r| r.to_text());
    let intro = format!(
        "{}{split_note}training {} ({} parameters), batch {} x seq {}{accum}, lr {}; compiled \
         in {:.3} s\n{}",
        vocab_note.map_or(String::new(), |n| n + "\n"),
        config.name,
        format_count(schedule.header.param_count),
        schedule.header.batch,
        options.seq,
        options.optimizer.lr,
        compiled.compile_seconds,
        plan_lines(schedule)
    );
    let eval = match &args.exec.eval.eval_data {
        Some(_) => Some(super::eval::compile_for_training(
            &config, &options, reserved, schedule,
        )?),
        None => None,
    };
    let intro = match &eval {
        Some(e) => format!(
            "{intro}\nevaluation      forward only, {}, device arena {}",
            e.header.policy,
            protrain::ir::format_bytes(e.arena_bytes)
        ),
        None => intro,
    };
    execute(
        schedule,
        &args.exec,
        &intro,
        Ok(compiled.simulation.timeline.clone()),
        eval.as_ref(),
    )
}

/// Sets the vocabulary of `config` (loaded from `model`) to `vocab` when given, else, for a
/// preset, to the size of `tokenizer` when it has more ids than the preset's vocabulary (a
/// tiny preset's 256 ids hold no byte-level BPE), so a preset trains with one's own
/// tokenizer. Returns a note saying what was changed.
pub fn fit_vocab(
    config: &mut protrain::models::ModelConfig,
    model: &str,
    vocab: Option<u32>,
    tokenizer: Option<&std::path::Path>,
) -> Result<Option<String>> {
    let was = config.vocab_size;
    match (vocab, tokenizer) {
        (Some(0), _) => {
            return Err(protrain::Error::Usage(
                "--vocab 0 leaves no token ids; give the tokenizer's vocabulary size".into(),
            ))
        }
        (Some(n), _) => config.vocab_size = u64::from(n),
        (None, Some(path)) if protrain::models::find_preset(model).is_some() => {
            let ids = protrain::runtime::text::TextTokenizer::load(path)?.vocab_size() as u64;
            if ids <= was {
                return Ok(None);
            }
            config.vocab_size = ids;
        }
        _ => return Ok(None),
    }
    Ok((config.vocab_size != was).then(|| {
        format!(
            "vocabulary      {} ids in place of the {was} of {model} ({})",
            config.vocab_size,
            match vocab {
                Some(_) => "--vocab".to_string(),
                None => format!(
                    "the size of --tokenizer {}",
                    tokenizer.unwrap_or(std::path::Path::new("")).display()
                ),
            }
        )
    }))
}

/// Fills the batch shape, element type and optimizer flags left out with the settings of the
/// run `saved` (what `--resume DIR` alone continues), and fails, naming each, when a flag
/// given contradicts them. A checkpoint that does not record a setting leaves its flag as it is.
fn take_from_checkpoint(compile: &mut CompileArgs, saved: &SavedRun) -> Result<()> {
    let mut differences = Vec::new();
    if let (Some(b), Some(s)) = (saved.batch, saved.seq) {
        let shape = &mut compile.shape;
        let (batch, seq) = (*shape.batch.get_or_insert(b), *shape.seq.get_or_insert(s));
        if (batch, seq) != (b, s) {
            differences.push(format!(
                "batch x seq: the checkpoint is {b} x {s}, this run is {batch} x {seq}"
            ));
        }
    }
    if let Some(have) = saved.dtype {
        let was = Dtype::of(have);
        let given = *compile.shape.dtype.get_or_insert(was);
        if given != was {
            differences.push(format!(
                "--dtype: the checkpoint has {have}, this run has {}",
                given.ir()
            ));
        }
    }
    if let (Some(rows), Some(b), Some(have)) = (compile.global_batch, saved.batch, saved.optimizer)
    {
        // The checkpoint's split is kept when its rows per step are the ones asked for.
        let saved_rows = b * have.grad_accum;
        if rows != saved_rows {
            differences.push(format!(
                "--global-batch: the checkpoint's steps take {saved_rows} rows ({} micro-batches \
                 of {b}), this run's {rows}",
                have.grad_accum
            ));
        } else if compile.shape.batch == Some(b) {
            compile.global_batch = None;
        }
    }
    if let Some(have) = saved.optimizer {
        // The checkpoint counts the micro-batches of the global batch (ranks x K); the state
        // is the same on every rank, so a run on other ranks resumes it when its ranks x K is
        // the same (K taken as the global count over the ranks when not given).
        let ranks = u64::from(compile.gpus.unwrap_or(1)) * u64::from(compile.nodes.unwrap_or(1));
        let global = have.grad_accum;
        let accum = *compile
            .grad_accum
            .get_or_insert((global / ranks.max(1)).max(1));
        if accum * ranks != global {
            differences.push(match ranks {
                1 => format!("--grad-accum: the checkpoint has {global}, this run has {accum}"),
                _ => format!(
                    "--grad-accum: the checkpoint's steps take {global} micro-batches, this \
                     run's {ranks} ranks x --grad-accum {accum} take {}; give --grad-accum \
                     {global} / ranks",
                    accum * ranks
                ),
            });
        }
        let o = &mut compile.optimizer;
        let (mut theirs, mut ours) = (Vec::new(), Vec::new());
        let settings = [
            ("lr", &mut o.lr, have.lr),
            ("beta1", &mut o.beta1, have.beta1),
            ("beta2", &mut o.beta2, have.beta2),
            ("eps", &mut o.eps, have.eps),
            ("weight_decay", &mut o.weight_decay, have.weight_decay),
        ];
        for (name, flag, was) in settings {
            let given = *flag.get_or_insert(was);
            if given != was {
                theirs.push(format!("{name}={was}"));
                ours.push(format!("{name}={given}"));
            }
        }
        let clip = |c: Option<f64>| c.map_or("none".to_string(), |c| c.to_string());
        match (o.grad_clip, have.grad_clip) {
            (None, was) => o.grad_clip = was,
            (given, was) if given != was => {
                theirs.push(format!("grad_clip={}", clip(was)));
                ours.push(format!("grad_clip={}", clip(given)));
            }
            _ => {}
        }
        if !theirs.is_empty() {
            differences.push(format!(
                "optimizer: the checkpoint has {}, this run has {}",
                theirs.join(" "),
                ours.join(" ")
            ));
        }
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::CheckpointMismatch {
        path: saved.path.clone(),
        differences: differences
            .into_iter()
            .map(protrain::runtime::error::Difference::Other)
            .collect(),
    }
    .into())
}
