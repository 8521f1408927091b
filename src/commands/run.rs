//! `protrain run`: execute a compiled schedule and hold its step time against the prediction.

use indicatif::{ProgressBar, ProgressStyle};
use protrain::compiler::simulate::{
    self, chrome_trace, instr_label, span_category, Span as TraceSpan,
};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{format_bytes, format_count, Schedule};
use protrain::runtime::checkpoint::{self, OptimizerSettings, SavedRun};
use protrain::runtime::collective::{thread_ranks, Collective, ThreadRank};
use protrain::runtime::error::Difference;
use protrain::runtime::eval::load_weights;
use protrain::runtime::params::{init_params, save_order, save_params_streamed};
use protrain::runtime::thread_ranks::run_thread_ranks;
use protrain::runtime::train::{
    CheckpointPlan, LrScheduleKind, ReportPace, RunFlags, RunSettings, RunSummary, StepRecord,
    WeightReads,
};
use protrain::runtime::weights::StorageDtype;
use protrain::runtime::{Backend, Executor, HostBackend, RuntimeError, Trainer};
use protrain::{Error, Result};
use std::io::IsTerminal;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where a schedule is executed.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// This machine's CPU: the same streams (one thread each), events and memory layout as on
    /// a GPU, with bit-identical results under every policy. It runs f32 schedules, and bf16
    /// and f16 ones as the CUDA backend does (narrow storage, f32 arithmetic, f32 master
    /// weights, the same rounding points; f16 with dynamic loss scaling).
    Host,
    /// An NVIDIA GPU through CUDA (needs a build with `--features cuda`, an NVIDIA driver for
    /// CUDA 13, cuBLAS and NVRTC); runs f32, bf16 and f16 schedules.
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

/// A learning-rate schedule's shape, as `--lr-schedule` takes it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrScheduleArg {
    /// transformers' get_constant_schedule_with_warmup: the warmup, then --lr.
    Constant,
    /// transformers' get_linear_schedule_with_warmup: the warmup, then a straight line from
    /// --lr down to --min-lr, reached after step --decay-steps and kept.
    Linear,
    /// transformers' get_cosine_schedule_with_warmup (num_cycles 0.5): the warmup, then half
    /// a cosine from --lr down to --min-lr, reached after step --decay-steps (past it,
    /// transformers' cosine rises again).
    Cosine,
}

impl LrScheduleArg {
    /// The runtime's kind.
    fn kind(self) -> LrScheduleKind {
        match self {
            LrScheduleArg::Constant => LrScheduleKind::Constant,
            LrScheduleArg::Linear => LrScheduleKind::Linear,
            LrScheduleArg::Cosine => LrScheduleKind::Cosine,
        }
    }
}

/// The flags `run` and `train` share: data, weights, steps, learning-rate schedule, logging,
/// checkpoints. With --resume, the steps, schedule, seed and data left out are the
/// checkpointed run's, and one given that contradicts it is an error.
#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    /// Where to execute the schedule.
    #[arg(long, value_enum, default_value_t = BackendKind::Host)]
    pub backend: BackendKind,
    /// This process's place in a run of one process per GPU (see `super::launch`), `None`
    /// when it is the whole run.
    #[arg(skip)]
    pub launch: Option<protrain::runtime::rendezvous::Launch>,
    /// Token file: a 1-D integer `.npy`, or raw little-endian u16 `.bin`. Without it, training
    /// uses the built-in synthetic corpus (counting, copying and addition over 24 token ids)
    /// [default with --resume: the checkpointed run's data].
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json: --data is then a UTF-8 text corpus, tokenized once (with
    /// a progress bar) into a token file cached beside it and reused while the corpus and the
    /// tokenizer are unchanged. Documents are separated by lines that hold only the
    /// tokenizer's end-of-text token; its id goes between them.
    #[arg(long, value_name = "FILE", requires = "data")]
    pub tokenizer: Option<PathBuf>,
    /// Initial weights, as `eval --init` takes them: a checkpoint directory written by
    /// --checkpoint-dir (its newest intact checkpoint) or one checkpoint file of it, whose
    /// weights start a new run from step 0 (its Adam moments and step are not read: --resume
    /// continues a run); or a Hugging Face safetensors file, sharded index, or model
    /// directory. Without it, weights are drawn as transformers initialises them, from --seed.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Optimizer steps to take in all; a resumed run goes on from its checkpoint up to this
    /// step [default: 200; with --resume, the checkpointed run's].
    #[arg(long)]
    pub steps: Option<u64>,
    /// Seed of the random initialisation and of the synthetic corpus [default: 0; with
    /// --resume, the checkpointed run's].
    #[arg(long)]
    pub seed: Option<u64>,
    /// The learning rate's course over the steps, with exactly the rates of transformers'
    /// get_{constant,linear,cosine}_schedule_with_warmup when --min-lr is 0: step s (from 1)
    /// trains at --lr x lr_lambda(s - 1), so with a warmup the first step's rate is 0
    /// [default: constant].
    #[arg(long, value_enum, value_name = "SHAPE")]
    pub lr_schedule: Option<LrScheduleArg>,
    /// An f16 schedule's first loss scale: the loss gradient is multiplied by it, the
    /// gradients divided by it (in f32) before clipping and AdamW. As
    /// torch.cuda.amp.GradScaler: a step whose gradients overflow f16 (an inf or NaN
    /// anywhere, after accumulating every micro-batch) is skipped (weights, Adam moments,
    /// AdamW's step count and the learning-rate schedule stay as they were; the step is
    /// reported) and the scale halves; after --loss-scale-growth-interval clean steps in a
    /// row it doubles. Only for f16 schedules [default: 65536 (2^16); with --resume, the
    /// checkpoint's scale where the run stood].
    #[arg(long, value_name = "SCALE")]
    pub loss_scale_init: Option<f64>,
    /// Consecutive clean (overflow-free) steps after which an f16 run doubles its loss scale
    /// (GradScaler's growth_interval); at least 1 [default: 2000].
    #[arg(long, value_name = "N")]
    pub loss_scale_growth_interval: Option<u64>,
    /// Steps of linear warmup from 0 to --lr: step s (from 1) of the first W trains at
    /// --lr x (s - 1) / W [default: 0].
    #[arg(long, value_name = "W")]
    pub warmup_steps: Option<u64>,
    /// The length of a linear or cosine schedule in steps, warmup included (transformers'
    /// num_training_steps): the rate reaches --min-lr after step N [default: --steps].
    #[arg(long, value_name = "N")]
    pub decay_steps: Option<u64>,
    /// The rate a linear or cosine decay ends at, between 0 and --lr. After the warmup the
    /// decay factor f, which falls from 1 to 0, is rescaled to f x (1 - m) + m with
    /// m = min-lr / lr, so the rate falls from --lr to --min-lr (for the cosine this is
    /// transformers' get_cosine_with_min_lr_schedule_with_warmup(min_lr=...)); the warmup
    /// still starts from 0. With 0, the rates are transformers' to the bit [default: 0].
    #[arg(long, value_name = "LR")]
    pub min_lr: Option<f64>,
    /// Save the trained weights here as safetensors, under their Hugging Face names.
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Print one JSON object per line and step instead of a progress bar and table: `step`
    /// (1-based, counting resumed steps), `loss` (the step's mean cross-entropy over all its
    /// positions, every micro-batch's with --grad-accum; f32 printed exactly), `grad_norm`
    /// (the global gradient norm before clipping, or null when the schedule computes none),
    /// `lr` (the learning rate AdamW used), `tokens_per_s` (this step's tokens, micro-batches
    /// x batch x seq, over its wall time) and `step_s` (the step's wall time in seconds);
    /// an f16 run's lines add `loss_scale` (the scale the step ran at) and `skipped` (true
    /// when its gradients overflowed and the optimizer step was skipped).
    /// The plan and timing report go to stderr. `--log-json` is the same flag.
    #[arg(long, alias = "log-json")]
    pub json: bool,
    /// Write the last step's measured timeline as a Chrome trace (open it in
    /// ui.perfetto.dev), with the predicted timeline beside it as a second process.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write checkpoints (weights, Adam moments, step, data position, learning-rate schedule
    /// and the other run settings) to this directory every --save-every steps and at the
    /// last step. On one rank, SIGINT (Ctrl-C) or SIGTERM stops the run after the step under
    /// way with a checkpoint of it, prints the command that resumes, and exits 130 or 143; a
    /// second signal exits at once.
    #[arg(long, value_name = "DIR", requires = "save_every")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints; with --resume and no --checkpoint-dir, they go to the
    /// resumed directory [default with --resume: as often as the resumed run saved].
    #[arg(long, value_name = "K")]
    pub save_every: Option<u64>,
    /// Checkpoints to keep: older ones are deleted after each save (0 keeps all).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Continue from the latest checkpoint in this directory, bit-identically to a run that
    /// was never interrupted: `--resume DIR` alone takes the optimizer, schedule, steps,
    /// seed and data from the checkpoint (with `train`, the batch, seq and --dtype too); a
    /// flag that contradicts it is an error. The policy may differ.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Directory for the file of a schedule's disk tier (compiled with --disk-memory): it is
    /// made there at the start, preallocated to the schedule's disk region, and removed at
    /// exit (checkpoints copy what it holds). Needed exactly when the schedule keeps state on
    /// disk.
    #[arg(long, value_name = "DIR")]
    pub disk_dir: Option<PathBuf>,
    #[command(flatten)]
    pub eval: super::eval::EvalDataArgs,
}

impl ExecArgs {
    /// The run settings given on the command line, reading tokens from `data` (the token
    /// file, or the cache a text corpus was tokenized into).
    fn run_flags(&self, data: Option<PathBuf>) -> RunFlags {
        RunFlags {
            steps: self.steps,
            lr_schedule: self.lr_schedule.map(LrScheduleArg::kind),
            warmup_steps: self.warmup_steps,
            decay_steps: self.decay_steps,
            min_lr: self.min_lr,
            seed: self.seed,
            data,
            loss_scale_init: self.loss_scale_init,
            loss_scale_growth_interval: self.loss_scale_growth_interval,
        }
    }
}

/// Arguments of `protrain run`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A schedule written by `protrain compile` (f32, bf16 or f16; both backends run all
    /// three).
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
    /// The forward-only schedule --eval-data evaluates with, of the same model, batch and
    /// seq (`protrain compile MODEL --forward-only -o FILE`): `run` compiles nothing.
    #[arg(long, value_name = "FILE", requires = "eval_data")]
    eval_schedule: Option<PathBuf>,
    /// Micro-batches per optimizer step (gradient accumulation), fixed when the schedule is
    /// compiled (`protrain compile --grad-accum K`); given here, it must equal the
    /// schedule's. Each step reads K x batch sequences.
    #[arg(long, value_name = "K")]
    grad_accum: Option<u64>,
}

/// Reads and verifies the schedule, checks the flags against it, and executes it.
/// On the CUDA backend, a process that torchrun started (`RANK`, `WORLD_SIZE`, ... set) runs
/// as that rank of a multi-process run; `run` starts no workers itself (`train` does).
pub fn run(mut args: Args) -> Result<()> {
    // `execute` checks the backend, once it knows whether the schedule's ranks can run on it.
    if args.exec.backend == BackendKind::Cuda {
        let launch = protrain::runtime::rendezvous::Launch::from_env()?;
        args.exec.launch = launch.filter(|l| l.world_size > 1);
    }
    let is_config = args.schedule.extension().is_some_and(|e| e == "json");
    if args.schedule.is_dir() || is_config {
        let what = match is_config {
            true => "a model config",
            false => "a directory",
        };
        return Err(Error::Usage(format!(
            "{} is {what}, and `run` runs a compiled schedule (.ptsched): `protrain train {}` \
             compiles the model and trains it in one go (or `protrain compile {} -o \
             S.ptsched`, then `protrain run S.ptsched`)",
            args.schedule.display(),
            args.schedule.display(),
            args.schedule.display()
        )));
    }
    if !args.schedule.exists() {
        return Err(Error::Usage(format!(
            "schedule {} does not exist; write one with `protrain compile MODEL --dtype f32 -o {}`",
            args.schedule.display(),
            args.schedule.display()
        )));
    }
    let mut inputs = super::paths::Inputs::new();
    inputs
        .file(&args.schedule)
        .maybe(args.eval_schedule.as_deref())
        .exec(&args.exec);
    super::paths::check_exec_outputs(&args.exec, &inputs)?;
    let schedule = protrain::ir::file::read(&args.schedule)?;
    if schedule.graph.is_forward_only() {
        return Err(Error::Usage(format!(
            "{} is a forward-only schedule (compiled with --forward-only, for evaluation): it \
             computes the loss and trains nothing; run a training schedule, and give this one \
             with --eval-schedule to evaluate while training, or evaluate weights with \
             `protrain eval MODEL --init WEIGHTS --data FILE`",
            args.schedule.display()
        )));
    }
    check_optimizer_flags(&schedule, &args)?;
    if let Some(dir) = &args.exec.resume {
        check_resume_dtype(&schedule, &args.schedule, &checkpoint::peek_latest(dir)?)?;
    }
    let k = u64::from(schedule.micro_batches_per_step());
    if let Some(given) = args.grad_accum.filter(|&g| g != k) {
        return Err(Error::Usage(format!(
            "--grad-accum {given} differs from the schedule's {k} micro-batches per step, which \
             are fixed when it is compiled: compile it again with `protrain compile MODEL \
             --grad-accum {given}`, or drop the flag"
        )));
    }
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
    let eval = match (&args.exec.eval.eval_data, &args.eval_schedule) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(Error::Usage(
                "--eval-data needs a forward-only schedule, and `run` compiles nothing: write \
                 one with `protrain compile MODEL --forward-only -o EVAL.ptsched` (the same \
                 model, --batch and --seq) and give it with --eval-schedule EVAL.ptsched, or \
                 use `protrain train`, which compiles both"
                    .into(),
            ))
        }
        (Some(_), Some(path)) => Some(protrain::ir::file::read(path)?),
    };
    execute(&schedule, &args.exec, &intro, predicted, eval.as_ref())
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
         buffers; layers: {} kept, {} checkpointed, {} swapped{}\npredicted step  {:.4} s on \
         {}\ndevice arena    {} of {} budget per GPU\nhost region     {}{}",
        h.policy,
        h.policy.n_persist,
        chunks,
        chunks as u32 - h.policy.n_persist.min(chunks as u32),
        h.policy.n_buffer,
        h.policy.count(protrain::ir::BlockMode::Keep),
        h.policy.count(protrain::ir::BlockMode::Checkpoint),
        h.policy.count(protrain::ir::BlockMode::Swap),
        match schedule.micro_batches_per_step() {
            1 => String::new(),
            k => format!(
                "\naccumulation    {k} micro-batches of {} sequences per step, {}",
                h.batch, h.policy.order
            ),
        } + &match schedule.topology() {
            (1, 1) => String::new(),
            (gpus, nodes) => format!(
                "\ndata parallel   {} ranks ({gpus} per node x {nodes} nodes; threads of this \
                 process on the host backend, one process per GPU on cuda), each on its own \
                 rows, gradients summed over them{}",
                gpus * nodes,
                match schedule.sharded() {
                    true => "; offloaded chunks sharded, each rank holding 1/ranks of their state",
                    false => "",
                }
            ),
        },
        p.step_seconds,
        h.hardware.split(':').next().unwrap_or_default(),
        format_bytes(schedule.arena_bytes),
        format_bytes(h.device_budget_bytes),
        format_bytes(schedule.host_bytes),
        // Host memory is budgeted per node; each rank's schedule has its share.
        match schedule.topology().0 {
            0 | 1 => String::new(),
            gpus => format!(
                " per rank, of {} per rank (1/{gpus} of the node's --host-memory)",
                format_bytes(h.host_budget_bytes)
            ),
        },
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

/// Executes `schedule` on the backend `args` name as they say: loads data and weights (or a
/// checkpoint), prints `intro` and runs the steps, logging each; writes checkpoints, the
/// trained weights and the trace; reports measured against predicted time. Every input is
/// checked before anything is printed or written. `predicted` is the predicted timeline for
/// `--trace`, or why there is none; `eval` is the forward-only schedule of `--eval-data`.
pub fn execute(
    schedule: &VerifiedSchedule,
    args: &ExecArgs,
    intro: &str,
    predicted: std::result::Result<Vec<TraceSpan>, String>,
    eval: Option<&VerifiedSchedule>,
) -> Result<()> {
    // On the CUDA backend the ranks are processes, one per GPU: never threads of this one.
    let ranks = schedule.ranks();
    if (args.backend, &args.launch, ranks > 1) == (BackendKind::Cuda, &None, true) {
        return Err(Error::Usage(format!(
            "the schedule runs on {ranks} ranks, which on the CUDA backend are {ranks} \
             processes, one per GPU: `protrain train --backend cuda --gpus N` starts them, or \
             start this command under torchrun (torchrun --nproc-per-node N protrain run ...); \
             --backend host runs the ranks as threads of one process"
        )));
    }
    check_backend(args.backend)?;
    match args.backend {
        BackendKind::Host => {
            execute_on::<HostBackend>(schedule, args, intro, predicted, eval, None)
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            // The device the run trains on, named as the driver names it (the CPU simulator's
            // name says that it is not a GPU).
            let info = protrain::runtime::cuda::device()
                .map_err(|why| Error::Usage(format!("no CUDA device is available: {why}")))?;
            let intro = format!(
                "{intro}\ndevice          {} (compute capability {}.{}, {})",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1,
                protrain::ir::format_bytes(info.memory_bytes)
            );
            let intro = intro.as_str();
            // A worker of a multi-process run joins the others through NCCL first.
            let process = match &args.launch {
                Some(me) => Some(super::launch::join(me)?),
                None => None,
            };
            execute_on::<protrain::runtime::cuda::CudaBackend>(
                schedule, args, intro, predicted, eval, process,
            )
        }
        // `check_backend` refused it above.
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => cuda_ready(),
    }
}

/// Tokenizes a text corpus with `tokenizer` into its cached token file (or finds the cache of
/// an earlier run), drawing a progress bar on a terminal, after checking that the tokenizer's
/// ids fit the model's vocabulary. Returns the token file.
pub fn tokenize_corpus(
    corpus: &Path,
    tokenizer: &Path,
    graph: &protrain::ir::Graph,
) -> Result<PathBuf> {
    use protrain::runtime::text::{self, TextOptions, TextTokenizer};
    let t = TextTokenizer::load(tokenizer)?;
    if let Some(vocab) = protrain::runtime::data::vocab_of(graph) {
        t.check_vocab(vocab)?;
    }
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("tokenizing {bar:40} {bytes}/{total_bytes} {eta}")
            .expect("a valid template"),
    );
    let tokenized = text::tokenize(corpus, &t, &TextOptions::default(), |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    if let Some(reason) = &tokenized.fallback_reason {
        eprintln!("note: {reason}");
    }
    Ok(tokenized.cache)
}

/// [`execute`] on backend `B`; `process` is this process's rank of a multi-process run
/// (its collective), whose other ranks are other processes.
fn execute_on<'s, B: Backend>(
    schedule: &'s VerifiedSchedule,
    args: &ExecArgs,
    intro: &str,
    predicted: std::result::Result<Vec<TraceSpan>, String>,
    eval: Option<&'s VerifiedSchedule>,
    process: Option<Box<dyn Collective>>,
) -> Result<()> {
    let graph = &schedule.graph;
    // A resumed run saves as often as the run it continues did, unless told otherwise.
    let resumed_every = match (&args.resume, args.save_every) {
        (Some(dir), None) => checkpoint::peek_latest(dir)
            .ok()
            .and_then(|saved| saved.run)
            .and_then(|run| run.save_every),
        _ => None,
    };
    let every = args.save_every.or(resumed_every);
    let checkpoint_dir = args
        .checkpoint_dir
        .clone()
        .or_else(|| args.resume.clone().filter(|_| every.is_some()));
    let save_every = match (&checkpoint_dir, every) {
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
        (Some(_), every) => every.and_then(NonZeroU64::new),
        (None, None) => None,
    };
    let data = match (&args.data, &args.tokenizer) {
        (Some(corpus), Some(tokenizer)) => Some(tokenize_corpus(corpus, tokenizer, graph)?),
        (data, _) => data.clone(),
    };
    let flags = args.run_flags(data);
    // The peak of the learning-rate schedule is the rate the AdamW ops were compiled with.
    let peak = OptimizerSettings::of(graph).map_or(0.0, |o| o.lr);
    // A data-parallel schedule runs on its ranks as threads of this process: rank 0 here,
    // printing and writing, the others on threads of their own (see `run_ranks`).
    // In a multi-process run this process is one rank and the others are processes.
    let (rank0, comms): (Option<Box<dyn Collective>>, Vec<ThreadRank>) = match process {
        Some(me) => (Some(me), Vec::new()),
        None => {
            let mut comms = match schedule.ranks() {
                1 => Vec::new(),
                n => thread_ranks(n as usize, RANK_TIMEOUT)?,
            };
            let rank0 = (!comms.is_empty()).then(|| comms.remove(0));
            (rank0.map(|c| Box::new(c) as Box<dyn Collective>), comms)
        }
    };
    // Every rank writes its own shard of each checkpoint.
    let plan = match (checkpoint_dir, save_every) {
        (Some(dir), Some(every)) => Some(CheckpointPlan {
            dir,
            every,
            keep: args.keep_checkpoints,
        }),
        _ => None,
    };
    let setup = RankSetup {
        schedule,
        args,
        eval,
        flags: &flags,
        peak,
        plan,
    };
    if comms.is_empty() {
        return lead::<B>(&setup, intro, predicted, rank0);
    }
    // The other ranks start first: a resumed run's ranks agree whether they read their parts
    // of the checkpoint intact (Checkpoint::restore) before rank 0 goes on. Rank 0's trainer
    // (and so its collective) is dropped when `lead` returns, so the workers' next
    // collective fails at once when rank 0 failed.
    run_thread_ranks(
        comms,
        |comm| {
            let (worker, _) =
                rank_trainer::<B>(schedule, args, &flags, peak, Some(Box::new(comm)))?;
            quiet_rank(worker, args, setup.plan.clone(), eval.is_some())
        },
        || lead::<B>(&setup, intro, predicted, rank0),
    )
}

/// What every rank of a run is started with: the schedule, the flags and what
/// [`execute_on`] made of them.
struct RankSetup<'s, 'a> {
    schedule: &'s VerifiedSchedule,
    args: &'a ExecArgs,
    /// The forward-only schedule of `--eval-data`, when the run evaluates.
    eval: Option<&'s VerifiedSchedule>,
    flags: &'a RunFlags,
    /// The peak of the learning-rate schedule.
    peak: f64,
    plan: Option<CheckpointPlan>,
}

/// Rank 0's part of [`execute_on`] (or the whole run's, with one rank): builds its trainer,
/// prints, trains, checkpoints (its shard and the manifest), evaluates and saves; in a
/// multi-process run, the process of another rank trains quietly instead ([`quiet_rank`]).
fn lead<'s, B: Backend>(
    setup: &RankSetup<'s, '_>,
    intro: &str,
    predicted: std::result::Result<Vec<TraceSpan>, String>,
    rank0: Option<Box<dyn Collective>>,
) -> Result<()> {
    let RankSetup {
        schedule,
        args,
        eval,
        flags,
        peak,
        ..
    } = *setup;
    let plan = setup.plan.clone();
    let (mut trainer, mut notes) = rank_trainer::<B>(schedule, args, flags, peak, rank0)?;
    if trainer.executor().rank().0 != 0 {
        return quiet_rank(trainer, args, plan, eval.is_some());
    }
    notes.extend(trainer.notes().iter().cloned());
    let inputs = prepare_lead(&mut trainer, setup, &mut notes)?;
    // Everything is checked: from here on the run prints and writes.
    eprintln!("{intro}");
    for note in &notes {
        eprintln!("{note}");
    }
    let settings = trainer.settings().clone();
    let first = trainer.steps_taken();
    let to_run = trainer.remaining();
    announce(schedule, args, &settings, first, to_run);
    let bar = progress_bar(args, to_run);
    let mut pace = ReportPace::new(first, settings.steps, !bar.is_hidden());
    // A single-rank run that writes checkpoints stops at a signal with one of its last step.
    let stop = match (&plan, schedule.ranks(), &args.launch) {
        (Some(_), 1, None) => Some(StopSignals::install()?),
        _ => None,
    };
    // Table rows go to stdout above the bar (which draws on stderr).
    let row = |text: String| bar.suspend(|| outln!("{text}"));
    if !args.json && to_run > 0 {
        row(format!(
            "{:>6}  {:>10}  {:>10}  {:>10}  {:>12}",
            "step", "loss", "grad norm", "lr", "tokens/s"
        ));
    }
    let data_name = settings.data_name();
    let result = train_and_save(schedule, args, &mut trainer, stop.as_ref(), |record| {
        print_step(record, args, &data_name, &bar, &mut pace, &row)
    });
    let saved = match result {
        Ok(Finished::Saved(saved)) => saved,
        Ok(Finished::Stopped(signal)) => {
            bar.abandon();
            return stopped(trainer, signal);
        }
        Err(e) => {
            bar.abandon();
            return Err(e);
        }
    };
    bar.finish_and_clear();
    finish(schedule, args, &trainer, saved, &predicted, &inputs)
}

/// Rank 0's checks before it prints anything: the input and output paths (again, with the
/// data the run resolved: a resumed run's may come from its checkpoint), then the trace, the
/// checkpoints and the evaluation set up on `trainer`. Returns the run's input paths.
fn prepare_lead<'s, B: Backend>(
    trainer: &mut Trainer<'s, B>,
    setup: &RankSetup<'s, '_>,
    notes: &mut Vec<String>,
) -> Result<super::paths::Inputs> {
    let args = setup.args;
    let data = trainer.settings().data.clone();
    let mut inputs = super::paths::Inputs::new();
    inputs.maybe(data.as_deref()).maybe(args.init.as_deref());
    let outputs: Vec<(&str, &Path)> = [("--save", &args.save), ("--trace", &args.trace)]
        .into_iter()
        .filter_map(|(flag, path)| Some((flag, path.as_deref()?)))
        .collect();
    super::paths::check_outputs(&outputs, &inputs)?;
    if args.trace.is_some() {
        trainer.trace_last_step();
    }
    if let Some(plan) = &setup.plan {
        notes.extend(trainer.save_checkpoints(plan.clone(), args.resume.as_deref())?);
    }
    let steps = trainer.settings().steps;
    let tokenizer = args.tokenizer.as_deref();
    if let Some(plan) = super::eval::plan::<B>(&args.eval, setup.eval, tokenizer, steps)? {
        trainer.evaluate_every(plan)?;
    }
    Ok(inputs)
}

/// Says what the run trains (steps `first + 1..` of `settings`, `to_run` of them), or that
/// it has nothing left to train.
fn announce(schedule: &Schedule, args: &ExecArgs, settings: &RunSettings, first: u64, to_run: u64) {
    if to_run == 0 {
        eprintln!(
            "the run is already at step {first} of --steps {}; nothing to train (raise --steps to \
             train further)",
            settings.steps
        );
    } else if !args.json {
        eprintln!(
            "training on {}: steps {}..={} of {}x{} tokens, learning rate {}",
            settings.data_name(),
            first + 1,
            settings.steps,
            schedule.header.batch,
            schedule.header.seq,
            settings.lr_schedule
        );
    }
}

/// The progress bar of `to_run` steps: drawn on a terminal only; elsewhere (and with
/// `--json`) the table's rows are the progress lines.
fn progress_bar(args: &ExecArgs, to_run: u64) -> ProgressBar {
    if args.json || to_run == 0 || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(to_run);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta}]",
        )
        .expect("the template is valid"),
    );
    bar
}

/// Prints one step's `record`: a JSON line with `--json`, else the bar's message and, when
/// `pace` says so, a table row (through `row`), with a note when the data wraps around, a
/// skipped step and an evaluation on lines of their own.
fn print_step(
    record: &StepRecord,
    args: &ExecArgs,
    data_name: &str,
    bar: &ProgressBar,
    pace: &mut ReportPace,
    row: &impl Fn(String),
) {
    if let Some(epoch) = record.epoch_started {
        let line = format!(
            "note: the data wraps around: epoch {epoch} of {data_name} starts at step {}",
            record.step
        );
        match args.json {
            true => eprintln!("{line}"),
            false => row(line),
        }
    }
    if args.json {
        let mut line = serde_json::json!({
            "step": record.step,
            "loss": record.loss,
            "grad_norm": record.grad_norm,
            "lr": record.lr,
            "tokens_per_s": record.tokens_per_s,
            "step_s": record.step_seconds,
        });
        if let Some(scale) = record.loss_scale {
            line["loss_scale"] = scale.into();
            line["skipped"] = record.skipped.into();
        }
        outln!("{line}");
        if let (Some(e), Some(data)) = (&record.eval, &args.eval.eval_data) {
            outln!("{}", super::eval::eval_json(record.step, data, e));
        }
        return;
    }
    let lr = record.lr.map_or("-".into(), |lr| format!("{lr:.3e}"));
    bar.set_message(format!(
        "loss {:.4}  {:.0} tokens/s  lr {lr}",
        record.loss, record.tokens_per_s
    ));
    bar.inc(1);
    if let (true, Some(scale)) = (record.skipped, record.loss_scale) {
        row(format!(
            "{:>6}  gradients overflowed f16 at loss scale {scale}: step skipped, the scale \
                 halves to {}",
            record.step,
            scale / 2.0
        ));
    }
    if pace.due(record.step, std::time::Instant::now()) {
        let norm = record.grad_norm.map_or("-".into(), |n| format!("{n:.4}"));
        row(format!(
            "{:>6}  {:>10.4}  {:>10}  {:>10}  {:>12.0}",
            record.step, record.loss, norm, lr, record.tokens_per_s
        ));
    }
    if let Some(e) = &record.eval {
        row(super::eval::eval_line(record.step, e));
    }
}

/// What rank 0 prints and writes once every step is taken: the loss summary, the timing
/// report, where the weights were `saved`, and `--trace`'s timeline (the measured last step
/// beside the `predicted` one).
fn finish<B: Backend>(
    schedule: &VerifiedSchedule,
    args: &ExecArgs,
    trainer: &Trainer<'_, B>,
    saved: bool,
    predicted: &std::result::Result<Vec<TraceSpan>, String>,
    inputs: &super::paths::Inputs,
) -> Result<()> {
    let summary = trainer.summary();
    if let (false, Some(first_loss), Some((last, n))) =
        (args.json, summary.first_loss, summary.last_loss_mean())
    {
        outln!(
            "loss {:.4} -> {:.4} (mean of the last {}) in {:.1} s, {:.0} tokens/s",
            first_loss,
            last,
            n,
            summary.elapsed_seconds,
            summary.tokens as f64 / summary.elapsed_seconds
        );
    }
    if let Some(report) = timing_report(schedule, summary) {
        if args.json {
            eprint!("{report}");
        } else {
            out!("{report}");
        }
    }
    if let (Some(path), true) = (&args.save, saved) {
        if !args.json {
            outln!("saved weights to {}", path.display());
        }
    }
    let Some(path) = &args.trace else {
        return Ok(());
    };
    let measured = measured_spans(schedule, &trainer.executor().timeline());
    let (text, note) = match predicted {
        Ok(p) => (trace_json(schedule, &measured, Some(p)), String::new()),
        Err(why) => (
            trace_json(schedule, &measured, None),
            format!(
                " (measured only: no prediction, {why}; `protrain trace SCHEDULE \
                 --hardware H` writes the predicted one)"
            ),
        ),
    };
    super::write_output(Some(path), &inputs.paths(), &text)?;
    let line = format!("wrote the last step's timeline to {}{note}", path.display());
    if args.json {
        eprintln!("{line}");
    } else {
        outln!("{line}");
    }
    Ok(())
}

/// How long a rank waits in a collective for the others before failing: long enough for
/// rank 0 to write a checkpoint or evaluate between steps. A rank that fails leaves its group
/// at once, so the others fail promptly, not after this.
const RANK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// The trainer of one rank (`comm`: its collective; `None` for a single-rank schedule) and
/// what to tell the user: a fresh run from `--init` or the seed, or one resumed from the
/// latest checkpoint. Every rank starts from the same weights and state.
fn rank_trainer<'s, B: Backend>(
    schedule: &'s VerifiedSchedule,
    args: &ExecArgs,
    flags: &RunFlags,
    peak: f64,
    comm: Option<Box<dyn Collective>>,
) -> Result<(Trainer<'s, B>, Vec<String>)> {
    let graph = &schedule.graph;
    let mut executor = Executor::<B>::with_backend(schedule)?;
    // The rank first: its disk file is named for it.
    if let Some(comm) = comm {
        executor.set_collective(comm)?;
    }
    let mut notes = Vec::new();
    if schedule.disk_bytes > 0 {
        let Some(dir) = &args.disk_dir else {
            return Err(Error::Usage(format!(
                "the schedule keeps the optimizer state of {} chunk(s) on disk ({}): give \
                 --disk-dir DIR, a directory on that disk for its file",
                schedule.disk_chunks().len(),
                format_bytes(schedule.disk_bytes)
            )));
        };
        let swept = executor.set_disk_dir(dir)?;
        if !swept.is_empty() {
            let names: Vec<String> = swept.iter().map(|p| p.display().to_string()).collect();
            notes.push(format!(
                "note: removed {} state file(s) that killed runs left in --disk-dir: {} (their \
                 state lives in their checkpoints)",
                swept.len(),
                names.join(", ")
            ));
        }
    }
    let trainer = match &args.resume {
        Some(dir) => {
            // Every rank reads its part, and all fall back past the same damaged ones.
            let (ckpt, warnings) = checkpoint::restore_latest(dir, &mut executor)?;
            notes.extend(warnings);
            // A checkpoint written before run settings were recorded resumes with the flags.
            let settings = match &ckpt.run {
                Some(saved) => flags.resume(saved, &ckpt.path)?,
                None => flags.fresh(peak)?,
            };
            Trainer::restored(executor, settings, &ckpt)?
        }
        None => {
            let settings = flags.fresh(peak)?;
            let (values, origin) = match &args.init {
                Some(path) => {
                    let (values, origin) = load_weights(graph, path)?;
                    notes.push(format!("starting from the weights of {origin} (--init)"));
                    (values, format!("--init {origin}"))
                }
                None => (
                    init_params(graph, settings.seed),
                    format!("the initialisation from --seed {}", settings.seed),
                ),
            };
            Trainer::start(executor, settings, &values, &origin)?
        }
    };
    Ok((trainer, notes))
}

/// Fails unless the run `saved` trained in the element type of `schedule` (read from
/// `path`), as `train --resume` checks its --dtype: a checkpoint resumes in the type it was
/// trained in. A checkpoint that does not record its type passes.
fn check_resume_dtype(schedule: &Schedule, path: &Path, saved: &SavedRun) -> Result<()> {
    match saved.dtype {
        Some(have) if have != schedule.header.dtype => Err(RuntimeError::CheckpointMismatch {
            path: saved.path.clone(),
            differences: vec![Difference::Other(format!(
                "--dtype: the checkpoint has {have}, schedule {} is {}; compile the schedule \
                 again with --dtype {} (or resume with `protrain train MODEL --resume DIR`, \
                 which takes the checkpoint's)",
                path.display(),
                schedule.header.dtype,
                have,
            ))],
        }
        .into()),
        _ => Ok(()),
    }
}

/// How [`train_and_save`] ended.
enum Finished {
    /// Every step was taken; whether `--save`'s file was written.
    Saved(bool),
    /// A signal (its number) stopped the run after a step.
    Stopped(i32),
}

/// Runs rank 0's `trainer` to the end, handing each record to `on_step`, then writes
/// `--save`'s file streamed: one parameter at a time (which the workers of a sharded run
/// join, [`join_save`]), so no rank holds the whole model beyond its own state. With `stop`,
/// a SIGINT or SIGTERM ends the run after the step it arrives in, saving nothing.
fn train_and_save<'s, B: Backend>(
    schedule: &'s VerifiedSchedule,
    args: &ExecArgs,
    trainer: &mut Trainer<'s, B>,
    stop: Option<&StopSignals>,
    mut on_step: impl FnMut(&StepRecord),
) -> Result<Finished> {
    while trainer.step(&mut on_step)?.is_some() {
        if let Some(signal) = stop.and_then(StopSignals::caught) {
            return Ok(Finished::Stopped(signal));
        }
    }
    let Some(path) = &args.save else {
        return Ok(Finished::Saved(false));
    };
    let executor = trainer.executor();
    save_params_streamed(&schedule.graph, path, StorageDtype::F32, &mut |i| {
        executor.param(i)
    })?;
    Ok(Finished::Saved(true))
}

/// SIGINT and SIGTERM while a run trains: the first is noted, and the run stops after the
/// step it arrives in ([`stopped`]); a second one exits at once, with the status a shell
/// gives a process that signal killed (128 + its number: 130, 143).
struct StopSignals {
    caught: Arc<AtomicUsize>,
}

impl StopSignals {
    /// Installs the handlers for the rest of the process.
    fn install() -> Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let caught = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(AtomicUsize::new(0));
        for signal in [SIGINT, SIGTERM] {
            let (caught, seen) = (Arc::clone(&caught), Arc::clone(&seen));
            // One counter for both signals, so two signals handled at once on two threads
            // still tell which came second: that one exits.
            let action = move || {
                if seen.fetch_add(1, Ordering::SeqCst) > 0 {
                    signal_hook::low_level::exit(128 + signal);
                }
                caught.store(signal as usize, Ordering::SeqCst);
            };
            // SAFETY: the action only touches atomics and calls `_exit`, all async-signal-safe.
            unsafe { signal_hook::low_level::register(signal, action) }.map_err(|e| {
                Error::Usage(format!(
                    "cannot install the SIGINT and SIGTERM handlers: {e}"
                ))
            })?;
        }
        Ok(Self { caught })
    }

    /// The signal caught, if one was.
    fn caught(&self) -> Option<i32> {
        match self.caught.load(Ordering::SeqCst) {
            0 => None,
            signal => i32::try_from(signal).ok(),
        }
    }
}

/// Ends a run that `signal` stopped: writes a checkpoint of its last finished step (unless
/// it has one), prints the command that resumes it, releases the trainer, and exits with
/// 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
/// process the signal killed.
fn stopped<B: Backend>(mut trainer: Trainer<'_, B>, signal: i32) -> Result<()> {
    let name = match signal {
        signal_hook::consts::SIGINT => "SIGINT",
        _ => "SIGTERM",
    };
    match trainer.checkpoint_now()? {
        Some((step, path)) => {
            let dir = path.parent().unwrap_or(Path::new("."));
            eprintln!(
                "stopped by {name} after step {step}, saved in {}; resume with:\n  {}",
                path.display(),
                resume_command(std::env::args(), dir)
            );
        }
        None => eprintln!("stopped by {name} before the first step; nothing to save"),
    }
    // Dropped first: the executor removes the disk tier's state file.
    drop(trainer);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::process::exit(128 + signal)
}

/// This process's command line `argv`, made to resume from the checkpoints in `dir`: without
/// --init (a resumed run takes its weights from the checkpoint) and with `--resume DIR` in
/// place of any other, each word quoted for a POSIX shell where it needs to be.
fn resume_command(argv: impl IntoIterator<Item = String>, dir: &Path) -> String {
    let mut words = Vec::new();
    let mut argv = argv.into_iter();
    while let Some(word) = argv.next() {
        match word.as_str() {
            "--init" | "--resume" => {
                argv.next();
            }
            w if w.starts_with("--init=") || w.starts_with("--resume=") => {}
            _ => words.push(word),
        }
    }
    words.push("--resume".into());
    words.push(dir.display().to_string());
    words
        .iter()
        .map(|w| shlex::try_quote(w).map_or_else(|_| w.clone(), |q| q.into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A worker's part in rank 0's `--save` of a sharded run: the same reads of the weights, one
/// parameter at a time in the file's order ([`save_order`]), each joining rank 0's gather.
fn join_save<B: Backend>(trainer: &Trainer<'_, B>, args: &ExecArgs, sharded: bool) -> Result<()> {
    if sharded && args.save.is_some() {
        let executor = trainer.executor();
        for i in save_order(&executor.schedule().graph) {
            executor.param(i)?;
        }
    }
    Ok(())
}

/// A rank other than 0 of a multi-process run: trains its rows silently (rank 0 prints,
/// evaluates and saves for all, the states being the same on every rank), writes its own
/// shard of each checkpoint (`plan`), and with sharded chunks joins rank 0's reads of the
/// weights, at the steps rank 0's flags make it read them (evaluation when `evaluates`).
fn quiet_rank<B: Backend>(
    mut trainer: Trainer<'_, B>,
    args: &ExecArgs,
    plan: Option<CheckpointPlan>,
    evaluates: bool,
) -> Result<()> {
    if let Some(plan) = plan {
        trainer.save_checkpoints(plan, args.resume.as_deref())?;
    }
    let sharded = trainer.executor().schedule().sharded();
    if sharded {
        let steps = trainer.settings().steps;
        let eval_every = match (evaluates, &args.eval.eval_data, args.eval.eval_every) {
            (true, Some(_), every) => NonZeroU64::new(every.unwrap_or(steps.max(1))),
            _ => None,
        };
        trainer.mirror_weight_reads(WeightReads { eval_every });
    }
    trainer.run(|_| {})?;
    join_save(&trainer, args, sharded)
}

/// Predicted against measured: the step time (the mean over the steps after the first, which
/// warms caches and the thread pool) and each stream's busy time; `None` when no step ran.
fn timing_report(schedule: &Schedule, summary: &RunSummary) -> Option<String> {
    let p = &schedule.header.prediction;
    let measured = summary.step_time()?;
    let over = match measured.averaged {
        0 => "the only step".to_string(),
        n => format!("mean of the {n} steps after the first"),
    };
    let mut out = format!(
        "step time       predicted {:.4} s, measured {:.4} s ({over})\n",
        p.step_seconds, measured.seconds
    );
    if !measured.stream_busy_seconds.is_empty() {
        out.push_str(&format!(
            "  {:<15}{:>12}  {:>12}\n",
            "stream busy", "predicted", "measured"
        ));
        for (i, stream) in schedule.streams.iter().enumerate() {
            let predicted = p
                .stream_busy_seconds
                .get(i)
                .map_or("-".into(), |s| format!("{s:.4} s"));
            let busy = measured.stream_busy_seconds.get(i).copied().unwrap_or(0.0);
            out.push_str(&format!(
                "  {:<15}{predicted:>12}  {:>12}\n",
                stream.name,
                format!("{busy:.4} s")
            ));
        }
    }
    Some(out)
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
