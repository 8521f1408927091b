//! `protrain run`: execute a compiled schedule and hold its step time against the prediction.

use indicatif::{ProgressBar, ProgressStyle};
use protrain::compiler::simulate::{
    self, chrome_trace, instr_label, span_category, Span as TraceSpan,
};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{format_bytes, format_count, Graph, OpKind, Schedule};
use protrain::runtime::checkpoint::{self, OptimizerSettings, Progress};
use protrain::runtime::data::{Batcher, TokenStream};
use protrain::runtime::params::{init_params, load_params, save_params};
use protrain::runtime::synthetic::SyntheticCorpus;
use protrain::runtime::weights::StorageDtype;
use protrain::runtime::{Backend, Executor, HostBackend};
use protrain::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where a schedule is executed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// This machine's CPU: the same streams (one thread each), events and memory layout as on
    /// a GPU, with bit-identical results under every policy (f32 schedules).
    Host,
    /// An NVIDIA GPU through CUDA (needs a build with `--features cuda`, an NVIDIA driver for
    /// CUDA 13, cuBLAS and NVRTC); runs bf16 and f32 schedules.
    Cuda,
}

impl BackendKind {
    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Host => "host",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// The flags `run` and `train` share: data, weights, steps, logging, checkpoints.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// Where to execute the schedule.
    #[arg(long, value_enum, default_value_t = BackendKind::Host)]
    pub backend: BackendKind,
    /// Token file: a 1-D integer `.npy`, or raw little-endian u16 `.bin`. Without it, training
    /// uses the built-in synthetic corpus (counting, copying and addition over 24 token ids).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Initial weights: a Hugging Face safetensors file, sharded index, or model directory.
    /// Without it, weights are drawn as transformers initialises them, from --seed.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Optimizer steps to take in all; a resumed run goes on from its checkpoint up to this
    /// step.
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Seed of the random initialisation and of the synthetic corpus.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the trained weights here as safetensors, under their Hugging Face names.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Print one JSON object per line and step instead of a progress bar and table: `step`
    /// (1-based, counting resumed steps), `loss` (the step's mean cross-entropy, f32 printed
    /// exactly), `grad_norm` (the global gradient norm before clipping, or null when the
    /// schedule computes none), `tokens_per_s` (this step's batch x seq over its wall time)
    /// and `step_s` (the step's wall time in seconds). The plan and timing report go to
    /// stderr. `--log-json` is the same flag.
    #[arg(long, alias = "log-json")]
    pub json: bool,
    /// Write the last step's measured timeline as a Chrome trace (open it in
    /// ui.perfetto.dev), with the predicted timeline beside it as a second process.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write checkpoints (weights, Adam moments, step, data position) to this directory every
    /// --save-every steps and at the last step.
    #[arg(long, value_name = "DIR", requires = "save_every")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints; with --resume and no --checkpoint-dir, they go to the
    /// resumed directory.
    #[arg(long, value_name = "K")]
    pub save_every: Option<u64>,
    /// Checkpoints to keep: older ones are deleted after each save (0 keeps all).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Continue from the latest checkpoint in this directory, bit-identically to a run that
    /// was never interrupted. The checkpoint must be of the same model, batch shape and
    /// optimizer settings; the policy may differ.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// Arguments of `protrain run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A schedule written by `protrain compile` (compile with --dtype f32 for the host
    /// backend; the cuda backend runs bf16 and f32 schedules).
    schedule: PathBuf,
    #[command(flatten)]
    exec: ExecArgs,
    /// AdamW learning rate. The schedule fixes its optimizer settings when it is compiled;
    /// given here, a setting must equal the schedule's (a check, not an override).
    #[arg(long)]
    lr: Option<f64>,
    /// AdamW first-moment decay; must equal the schedule's.
    #[arg(long)]
    beta1: Option<f64>,
    /// AdamW second-moment decay; must equal the schedule's.
    #[arg(long)]
    beta2: Option<f64>,
    /// AdamW epsilon; must equal the schedule's.
    #[arg(long)]
    eps: Option<f64>,
    /// AdamW decoupled weight decay; must equal the schedule's.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Gradient clipping norm; must equal the schedule's.
    #[arg(long, value_name = "NORM")]
    grad_clip: Option<f64>,
}

/// Reads and verifies the schedule, checks the flags against it, and executes it.
pub fn run(args: Args) -> Result<()> {
    check_backend(args.exec.backend)?;
    if !args.schedule.exists() {
        return Err(Error::Usage(format!(
            "schedule {} does not exist; write one with `protrain compile MODEL --dtype f32 -o {}`",
            args.schedule.display(),
            args.schedule.display()
        )));
    }
    let schedule = protrain::ir::file::read(&args.schedule)?;
    if args.exec.backend == BackendKind::Host && schedule.header.dtype != protrain::ir::DType::F32 {
        return Err(Error::Usage(format!(
            "{} is a {} schedule, but the host backend's kernels are f32; compile it with \
             `protrain compile {} --dtype f32`, or run it with --backend cuda",
            args.schedule.display(),
            schedule.header.dtype,
            schedule.header.model
        )));
    }
    check_optimizer_flags(&schedule, &args)?;
    let predicted = match &args.exec.trace {
        Some(_) => predicted_timeline(&schedule),
        None => Ok(Vec::new()),
    };
    let header = &schedule.header;
    let intro = format!(
        "running {} ({} parameters, batch {} x seq {}) from {} on the {} backend\n{}",
        header.model,
        format_count(header.param_count),
        header.batch,
        header.seq,
        args.schedule.display(),
        args.exec.backend.name(),
        plan_lines(&schedule)
    );
    execute(&schedule, &args.exec, &intro, predicted)
}

/// Fails unless the backend asked for can run here: the host backend always can; the CUDA
/// backend needs a build with `--features cuda`, and a driver, a GPU, cuBLAS and NVRTC, which
/// are probed without calling into a library that may be missing.
pub fn check_backend(backend: BackendKind) -> Result<()> {
    match backend {
        BackendKind::Host => Ok(()),
        BackendKind::Cuda => cuda_ready(),
    }
}

/// Why `--backend cuda` cannot run in a build without the CUDA backend.
#[cfg(not(feature = "cuda"))]
fn cuda_ready() -> Result<()> {
    Err(Error::Usage(protrain::runtime::cuda::NOT_BUILT.into()))
}

/// Whether the CUDA backend can run on this machine, and if not, what is missing.
#[cfg(feature = "cuda")]
fn cuda_ready() -> Result<()> {
    protrain::runtime::cuda::available()
        .map_err(|why| Error::Usage(format!("no CUDA device is available: {why}")))
}

/// Fails when an optimizer flag given to `run` differs from the schedule's setting: the
/// settings are compiled into the graph's AdamW ops, and silently ignoring a flag would train
/// with settings the user did not ask for.
fn check_optimizer_flags(schedule: &Schedule, args: &Args) -> Result<()> {
    let given = [
        ("lr", args.lr),
        ("beta1", args.beta1),
        ("beta2", args.beta2),
        ("eps", args.eps),
        ("weight-decay", args.weight_decay),
        ("grad-clip", args.grad_clip),
    ];
    if given.iter().all(|(_, v)| v.is_none()) {
        return Ok(());
    }
    let Some(have) = OptimizerSettings::of(&schedule.graph) else {
        return Err(Error::Usage(
            "the schedule has no optimizer, so optimizer flags do not apply; drop them".into(),
        ));
    };
    let compiled = [
        Some(have.lr),
        Some(have.beta1),
        Some(have.beta2),
        Some(have.eps),
        Some(have.weight_decay),
        have.grad_clip,
    ];
    let differing: Vec<String> = given
        .iter()
        .zip(compiled)
        .filter_map(|(&(flag, want), have)| match want {
            Some(w) if Some(w) != have => Some(format!(
                "--{flag} {w} (the schedule has {})",
                have.map_or("none".into(), |h| h.to_string())
            )),
            _ => None,
        })
        .collect();
    if differing.is_empty() {
        return Ok(());
    }
    Err(Error::Usage(format!(
        "{} differ from the optimizer settings the schedule was compiled with ({have}); a \
         schedule's optimizer settings are fixed when it is compiled: compile it again with \
         those flags (`protrain compile MODEL --lr ...`, or `protrain train MODEL`, which \
         compiles and runs in one go), or drop the flags to train with the schedule's",
        differing.join(", ")
    )))
}

/// The schedule's plan in a few lines: policy, predicted step time, memory.
pub fn plan_lines(schedule: &Schedule) -> String {
    let h = &schedule.header;
    let p = &h.prediction;
    let chunks = schedule.chunks.len();
    format!(
        "policy          {}\n                {} of {} chunks persistent, {} streamed through {} \
         buffers; layers: {} kept, {} checkpointed, {} swapped\npredicted step  {:.4} s on {}\n\
         device arena    {} of {} budget\nhost region     {}",
        h.policy,
        h.policy.n_persist,
        chunks,
        chunks as u32 - h.policy.n_persist.min(chunks as u32),
        h.policy.n_buffer,
        h.policy.count(protrain::ir::BlockMode::Keep),
        h.policy.count(protrain::ir::BlockMode::Checkpoint),
        h.policy.count(protrain::ir::BlockMode::Swap),
        p.step_seconds,
        h.hardware.split(':').next().unwrap_or_default(),
        format_bytes(schedule.arena_bytes),
        format_bytes(h.device_budget_bytes),
        format_bytes(schedule.host_bytes),
    )
}

/// The predicted timeline of the schedule on the hardware it was compiled for, or why there
/// is none.
fn predicted_timeline(schedule: &VerifiedSchedule) -> std::result::Result<Vec<TraceSpan>, String> {
    let name = schedule
        .header
        .hardware
        .split(':')
        .next()
        .unwrap_or_default()
        .trim();
    let profile = protrain::ir::HardwareProfile::load(name).map_err(|e| e.to_string())?;
    let cost = protrain::compiler::cost::cost_model(&profile);
    simulate::simulate(schedule, cost.as_ref())
        .map(|s| s.timeline)
        .map_err(|e| e.to_string())
}

/// The vocabulary the schedule's token ids must fall in: the smallest embedding table or logit
/// width that indexes with them.
fn vocab_of(graph: &Graph) -> Option<usize> {
    graph
        .ops()
        .filter_map(|(_, op)| match op.kind {
            OpKind::Embedding { .. } => Some(graph.value(op.inputs[1]).ty.shape[0]),
            OpKind::CrossEntropy => Some(graph.value(op.inputs[0]).ty.last_dim()),
            _ => None,
        })
        .min()
        .map(|n| n as usize)
}

/// Fails unless `path`'s directory exists and `path` may be written (a regular file or
/// nothing, none of `inputs`), so that a run does not train for an hour and then fail to write
/// its output.
fn check_writable(flag: &str, path: &Path, inputs: &[&Path]) -> Result<()> {
    super::check_output(path, inputs)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if dir.is_dir() {
        Ok(())
    } else {
        Err(Error::Usage(format!(
            "{flag} {}: the directory {} does not exist; create it or choose another path",
            path.display(),
            dir.display()
        )))
    }
}

/// Executes `schedule` on the backend `args` name as they say: loads data and weights (or a
/// checkpoint), prints `intro` and runs the steps, logging each; writes checkpoints, the
/// trained weights and the trace; reports measured against predicted time. Every input is
/// checked before anything is printed or written. `predicted` is the predicted timeline for
/// `--trace`, or why there is none.
pub fn execute(
    schedule: &VerifiedSchedule,
    args: &ExecArgs,
    intro: &str,
    predicted: std::result::Result<Vec<TraceSpan>, String>,
) -> Result<()> {
    check_backend(args.backend)?;
    match args.backend {
        BackendKind::Host => execute_on::<HostBackend>(schedule, args, intro, predicted),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            execute_on::<protrain::runtime::cuda::CudaBackend>(schedule, args, intro, predicted)
        }
        // `check_backend` refused it above.
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => cuda_ready(),
    }
}

/// [`execute`] on backend `B`.
fn execute_on<B: Backend>(
    schedule: &VerifiedSchedule,
    args: &ExecArgs,
    intro: &str,
    predicted: std::result::Result<Vec<TraceSpan>, String>,
) -> Result<()> {
    let graph = &schedule.graph;
    let header = &schedule.header;
    let checkpoint_dir = args
        .checkpoint_dir
        .clone()
        .or_else(|| args.resume.clone().filter(|_| args.save_every.is_some()));
    let save_every = match (&checkpoint_dir, args.save_every) {
        (_, Some(0)) => {
            return Err(Error::Usage(
                "--save-every 0 would never save; give a number of steps of at least 1".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(Error::Usage(
                "--save-every needs a directory to save to; add --checkpoint-dir DIR".into(),
            ))
        }
        (Some(_), every) => every,
        (None, None) => None,
    };
    let inputs: Vec<&Path> = [&args.data, &args.init]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
        .collect();
    if let Some(path) = &args.save {
        check_writable("--save", path, &inputs)?;
    }
    if let Some(path) = &args.trace {
        check_writable("--trace", path, &inputs)?;
    }
    let vocab = vocab_of(graph).ok_or_else(|| {
        Error::Usage("the schedule's graph takes no token ids; compile a language model".into())
    })?;
    let (batch, seq) = (header.batch as usize, header.seq as usize);
    let tokens_per_step = batch * seq;
    let stream = match &args.data {
        Some(path) => TokenStream::open(path)?,
        None => {
            let wanted = tokens_per_step
                .saturating_mul(args.steps.max(1) as usize)
                .saturating_add(1);
            SyntheticCorpus::new(vocab, args.seed)?.stream(wanted.min(1 << 24))
        }
    };
    stream.check_vocab(vocab)?;
    let data_tokens = stream.len() as u64;
    let data_name = args
        .data
        .as_ref()
        .map_or("the synthetic corpus".into(), |p| p.display().to_string());
    let batcher = Batcher::new(stream, batch, seq)?;

    if let Some(dir) = &checkpoint_dir {
        checkpoint::check_dir_is_ours(dir, args.resume.as_deref())?;
    }
    let mut executor = Executor::<B>::with_backend(schedule)?;
    let mut notes = Vec::new();
    let first = match &args.resume {
        Some(dir) => {
            let (ckpt, warnings) = checkpoint::load_latest(dir, schedule)?;
            notes.extend(warnings);
            check_finite(&ckpt.params, graph, || {
                format!("the checkpoint {}", ckpt.path.display())
            })?;
            ckpt.restore(&mut executor)?;
            notes.push(format!(
                "resuming from {} (step {})",
                ckpt.path.display(),
                ckpt.progress.step
            ));
            // The synthetic corpus grows with --steps, always from the same start, so only a
            // token file can make the batches differ.
            if args.data.is_some() && ckpt.progress.data_tokens != data_tokens {
                notes.push(format!(
                    "warning: {data_name} has {data_tokens} tokens but the checkpointed run's \
                     data had {}; batches will differ from the original run's once the data \
                     wraps",
                    ckpt.progress.data_tokens
                ));
            }
            ckpt.progress.data_step
        }
        None => {
            let values = match &args.init {
                Some(path) => load_params(graph, path)?,
                None => init_params(graph, args.seed),
            };
            check_finite(&values, graph, || match &args.init {
                Some(path) => format!("--init {}", path.display()),
                None => format!("the initialisation from --seed {}", args.seed),
            })?;
            executor.load_params(&values)?;
            0
        }
    };

    // Everything is checked: from here on the run prints and writes.
    eprintln!("{intro}");
    for note in &notes {
        eprintln!("{note}");
    }
    if first >= args.steps {
        eprintln!(
            "the run is already at step {first} of --steps {}; nothing to train (raise --steps to \
             train further)",
            args.steps
        );
    } else if !args.json {
        eprintln!(
            "training on {data_name}: steps {}..={} of {}x{} tokens",
            first + 1,
            args.steps,
            batch,
            seq
        );
    }
    let to_run = args.steps.saturating_sub(first);
    let bar = if args.json || to_run == 0 {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(to_run);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta}]",
            )
            .expect("the template is valid"),
        );
        bar
    };
    let report_every = (args.steps / 10).max(1);
    // Table rows go to stdout above the bar (which draws on stderr, and only on a terminal).
    let row = |text: String| bar.suspend(|| outln!("{text}"));
    if !args.json && to_run > 0 {
        row(format!(
            "{:>6}  {:>10}  {:>10}  {:>12}",
            "step", "loss", "grad norm", "tokens/s"
        ));
    }
    let started = Instant::now();
    // Only what the summary needs is kept: --steps may be any number, and nothing may grow
    // with it (a long run would otherwise hold a loss and a time per step).
    let mut losses = Losses::default();
    let mut wall = WallTimes::default();
    let mut busy = vec![0.0f64; schedule.streams.len()];
    // The last finite loss and its gradient norm, for the message if the loss stops being so.
    let mut previous: Option<(f32, Option<f32>)> = None;
    for step in first..args.steps {
        if args.trace.is_some() && step + 1 == args.steps {
            executor.set_tracing(true);
        }
        let b = batcher.batch(step);
        let inputs: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
        let targets: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
        let step_started = Instant::now();
        let report = executor.step(&[&inputs, &targets])?;
        let tokens_per_s = tokens_per_step as f64 / step_started.elapsed().as_secs_f64();
        let timing = executor.timing();
        wall.push(timing.wall_seconds);
        if step > first {
            for (sum, s) in busy.iter_mut().zip(&timing.stream_busy_seconds) {
                *sum += s;
            }
        }
        losses.push(report.loss);
        if report.loss.is_finite() {
            previous = Some((report.loss, report.grad_norm));
        }
        if args.json {
            let line = serde_json::json!({
                "step": step + 1,
                "loss": report.loss,
                "grad_norm": report.grad_norm,
                "tokens_per_s": tokens_per_s,
                "step_s": timing.wall_seconds,
            });
            outln!("{line}");
        } else {
            bar.set_message(format!("loss {:.4}", report.loss));
            bar.inc(1);
            if (step + 1) % report_every == 0 || step == first {
                let norm = report.grad_norm.map_or("-".into(), |n| format!("{n:.4}"));
                row(format!(
                    "{:>6}  {:>10.4}  {:>10}  {:>12.0}",
                    step + 1,
                    report.loss,
                    norm,
                    tokens_per_s
                ));
            }
        }
        if !report.loss.is_finite() {
            bar.abandon();
            return Err(Error::Usage(non_finite_loss(
                graph,
                report.loss,
                step + 1,
                step == first,
                previous,
                &executor.params()?,
            )));
        }
        if let (Some(dir), Some(every)) = (&checkpoint_dir, save_every) {
            let done = step + 1;
            if done % every == 0 || done == args.steps {
                let progress = Progress {
                    step: executor.steps_taken(),
                    data_step: done,
                    data_tokens,
                };
                checkpoint::save(dir, &executor, &progress)?;
                checkpoint::prune(dir, args.keep_checkpoints)?;
            }
        }
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    if let (false, Some(first_loss)) = (args.json, losses.first) {
        let tail = &losses.last;
        let last = tail.iter().sum::<f32>() / tail.len() as f32;
        outln!(
            "loss {:.4} -> {:.4} (mean of the last {}) in {:.1} s, {:.0} tokens/s",
            first_loss,
            last,
            tail.len(),
            elapsed,
            (tokens_per_step as f64 * losses.count as f64) / elapsed
        );
    }
    if wall.count > 0 {
        let report = timing_report(schedule, &wall, &busy);
        if args.json {
            eprint!("{report}");
        } else {
            out!("{report}");
        }
    }
    if let Some(path) = &args.save {
        save_params(graph, &executor.params()?, path, StorageDtype::F32)?;
        if !args.json {
            outln!("saved weights to {}", path.display());
        }
    }
    if let Some(path) = &args.trace {
        let measured = measured_spans(schedule, &executor.timeline());
        let (text, note) = match &predicted {
            Ok(p) => (trace_json(schedule, &measured, Some(p)), String::new()),
            Err(why) => (
                trace_json(schedule, &measured, None),
                format!(
                    " (measured only: no prediction, {why}; `protrain trace SCHEDULE \
                     --hardware H` writes the predicted one)"
                ),
            ),
        };
        super::write_output(Some(path), &inputs, &text)?;
        let line = format!("wrote the last step's timeline to {}{note}", path.display());
        if args.json {
            eprintln!("{line}");
        } else {
            outln!("{line}");
        }
    }
    Ok(())
}

/// The losses the summary line needs: the first, and the last [`Losses::TAIL`].
#[derive(Default)]
struct Losses {
    first: Option<f32>,
    last: std::collections::VecDeque<f32>,
    count: u64,
}

impl Losses {
    /// How many of the last losses the summary averages.
    const TAIL: usize = 10;

    fn push(&mut self, loss: f32) {
        self.first.get_or_insert(loss);
        if self.last.len() == Self::TAIL {
            self.last.pop_front();
        }
        self.last.push_back(loss);
        self.count += 1;
    }
}

/// The step wall times the timing report needs: the first, and the sum of the others.
#[derive(Default)]
struct WallTimes {
    first: f64,
    rest: f64,
    count: u64,
}

impl WallTimes {
    fn push(&mut self, seconds: f64) {
        if self.count == 0 {
            self.first = seconds;
        } else {
            self.rest += seconds;
        }
        self.count += 1;
    }
}

/// Fails when a parameter of `values` (in `graph`'s parameter order) holds NaN or infinity,
/// naming it and where the weights came from (`source`): training from them can only give a
/// NaN loss.
fn check_finite(values: &[Vec<f32>], graph: &Graph, source: impl Fn() -> String) -> Result<()> {
    for ((_, p), data) in graph.params().zip(values) {
        if let Some(bad) = data.iter().find(|v| !v.is_finite()) {
            let count = data.iter().filter(|v| !v.is_finite()).count();
            return Err(Error::Usage(format!(
                "the weights from {} are not finite: {} holds {bad} ({count} of its {} values); \
                 training from them can only give a NaN loss. Use other weights",
                source(),
                p.name,
                data.len()
            )));
        }
    }
    Ok(())
}

/// Why the loss of step `step` is `loss` (NaN or infinite), from what was seen: the weights
/// now (`params`), whether this was the run's first step, the last finite loss and gradient
/// norm, and the optimizer settings.
fn non_finite_loss(
    graph: &Graph,
    loss: f32,
    step: u64,
    first_of_run: bool,
    previous: Option<(f32, Option<f32>)>,
    params: &[Vec<f32>],
) -> String {
    let head = format!("the loss became {loss} at step {step}");
    let broken: Vec<&str> = graph
        .params()
        .zip(params)
        .filter(|(_, data)| data.iter().any(|v| !v.is_finite()))
        .map(|((_, p), _)| p.name.as_str())
        .collect();
    // An --eps of 0 never gets here: the verifier refuses it (0/0 in AdamW).
    let settings = OptimizerSettings::of(graph);
    if first_of_run {
        return format!(
            "{head}, the first step of this run, from finite weights: the forward pass itself \
             overflowed; check the data and the weights' scale"
        );
    }
    let seen = match previous {
        Some((last, Some(norm))) => {
            format!(" (the step before: loss {last}, gradient norm {norm})")
        }
        Some((last, None)) => format!(" (the step before: loss {last})"),
        None => String::new(),
    };
    let weights = match broken.len() {
        0 => String::new(),
        n => format!(
            "; the update made {n} parameter tensor(s) non-finite, first {}",
            broken[0]
        ),
    };
    let way_out = if settings.is_some_and(|s| s.grad_clip.is_some()) {
        "lower --lr"
    } else {
        "lower --lr or set --grad-clip"
    };
    format!("{head}{seen}{weights}: training diverged; {way_out}")
}

/// Predicted against measured: the step time (the mean over the steps after the first, which
/// warms caches and the thread pool) and each stream's busy time.
fn timing_report(schedule: &Schedule, wall: &WallTimes, busy_sums: &[f64]) -> String {
    let p = &schedule.header.prediction;
    let (measured, over, busy): (f64, String, Vec<f64>) = if wall.count > 1 {
        let n = (wall.count - 1) as f64;
        (
            wall.rest / n,
            format!("mean of the {} steps after the first", wall.count - 1),
            busy_sums.iter().map(|b| b / n).collect(),
        )
    } else {
        (wall.first, "the only step".into(), Vec::new())
    };
    let mut out = format!(
        "step time       predicted {:.4} s, measured {:.4} s ({over})\n",
        p.step_seconds, measured
    );
    if !busy.is_empty() {
        out.push_str(&format!(
            "  {:<15}{:>12}  {:>12}\n",
            "stream busy", "predicted", "measured"
        ));
        for (i, stream) in schedule.streams.iter().enumerate() {
            let predicted = p
                .stream_busy_seconds
                .get(i)
                .map_or("-".into(), |s| format!("{s:.4} s"));
            out.push_str(&format!(
                "  {:<15}{predicted:>12}  {:>12}\n",
                stream.name,
                format!("{:.4} s", busy[i])
            ));
        }
    }
    out
}

/// The executor's timeline as trace spans, labelled and categorised as the simulator's are.
fn measured_spans(schedule: &Schedule, timeline: &[protrain::runtime::Span]) -> Vec<TraceSpan> {
    timeline
        .iter()
        .map(|s| {
            let stream = schedule.stream(s.stream);
            let instr = &stream.instrs[s.index as usize];
            TraceSpan {
                stream: s.stream,
                index: s.index as usize,
                start: s.start,
                end: s.end,
                label: instr_label(schedule, instr),
                category: span_category(schedule, stream.kind, instr),
            }
        })
        .collect()
}

/// One Chrome trace: the measured timeline as process 1 and, when given, the predicted one as
/// process 2, so the two lie one above the other.
fn trace_json(
    schedule: &Schedule,
    measured: &[TraceSpan],
    predicted: Option<&[TraceSpan]>,
) -> String {
    let parse = |spans: &[TraceSpan], pid: u64, what: &str| -> Vec<serde_json::Value> {
        let trace: serde_json::Value =
            serde_json::from_str(&chrome_trace(schedule, spans)).expect("the trace is JSON");
        let mut events = match trace.get("traceEvents") {
            Some(serde_json::Value::Array(events)) => events.clone(),
            _ => Vec::new(),
        };
        for event in &mut events {
            event["pid"] = pid.into();
            if event["name"] == "process_name" {
                event["args"]["name"] = format!("{what}: {}", schedule.header.model).into();
            }
        }
        events
    };
    let mut events = parse(measured, 1, "measured");
    if let Some(p) = predicted {
        events.extend(parse(p, 2, "predicted"));
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }).to_string()
}
