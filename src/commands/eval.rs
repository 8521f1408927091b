//! `protrain eval`: the loss and perplexity of a model's weights on held-out data; and the
//! evaluation flags `train` and `run` share.

use super::run::{check_backend, plan_lines, tokenize_corpus, BackendKind};
use super::{MachineArgs, ShapeArgs};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::{format_bytes, format_count};
use protrain::models::ModelConfig;
use protrain::runtime::data::TokenStream;
use protrain::runtime::eval::{load_weights, EvalPlan, EvalResult, Evaluator};
use protrain::runtime::{Backend, Executor, HostBackend};
use protrain::{CompileOptions, Compiled, Error, PolicyChoice, Result};
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};

/// Evaluation during training, shared by `train` and `run`.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalDataArgs {
    /// Held-out data to evaluate the weights on while training, read as --data is (a token
    /// file, or text with --tokenizer): the mean loss and perplexity (exp of the mean loss) of
    /// its first --eval-batches batches of batch x seq tokens, from the start of the file and
    /// the same at every evaluation, by a forward-only schedule (no gradients, no update).
    /// Both schedules are held for the whole run: `train` sets the leanest evaluation arena
    /// aside from --gpu-memory, compiles the training schedule for the rest and the
    /// evaluation schedule for what that leaves; `run` takes it from --eval-schedule.
    #[arg(long, value_name = "FILE")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate after every K-th step (steps K, 2K, ...) [default: once, after the last
    /// step].
    #[arg(long, value_name = "K", requires = "eval_data")]
    pub eval_every: Option<u64>,
    /// Batches each evaluation reads [default: every whole batch --eval-data holds].
    #[arg(long, value_name = "N", requires = "eval_data")]
    pub eval_batches: Option<u64>,
}

/// Arguments of `protrain eval`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// The weights: a checkpoint directory written by `train --checkpoint-dir` (its newest
    /// intact checkpoint), or a Hugging Face safetensors file, sharded index or model
    /// directory.
    #[arg(long, value_name = "WEIGHTS")]
    init: PathBuf,
    /// The data: a token file (a 1-D integer `.npy`, or raw little-endian u16 `.bin`), or a
    /// UTF-8 text corpus with --tokenizer. Evaluation reads its first --eval-batches batches of
    /// batch x seq tokens, batch i from token i x batch x seq (its targets shifted by one),
    /// as training reads its first batches: the result is deterministic, and on the batch a
    /// training step reads it is that step's loss to the bit.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// A Hugging Face tokenizer.json: --data is then text, tokenized into a token file cached
    /// beside it (as `train --tokenizer` does).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Batches to evaluate, the name `train --eval-batches` has too (`--batches` is the same
    /// flag) [default: every whole batch the data holds].
    #[arg(long = "eval-batches", visible_alias = "batches", value_name = "N")]
    batches: Option<u64>,
    #[command(flatten)]
    machine: MachineArgs,
    #[command(flatten)]
    shape: ShapeArgs,
    /// `auto` searches for the fastest forward-only policy that fits; or n_persist=...
    /// n_buffer=... as `compile` takes it (every layer is kept: a forward pass has nothing
    /// to swap or recompute).
    #[arg(long, default_value = "auto")]
    policy: String,
    /// Do not fuse the forward graph (fusion changes no result).
    #[arg(long)]
    no_fuse: bool,
    /// Where to execute the schedule; without --dtype it is f32 on host and bf16 on cuda.
    #[arg(long, value_enum, default_value_t = BackendKind::Host)]
    backend: BackendKind,
    /// Print one JSON object: model, weights, data, batches, tokens, loss, ppl, policy,
    /// device_bytes, eval_s.
    #[arg(long)]
    json: bool,
    /// The model's vocabulary size, as `train --vocab` takes it (a preset given a --tokenizer
    /// with more ids than its vocabulary takes the tokenizer's size without it).
    #[arg(long, value_name = "N")]
    vocab: Option<u32>,
}

/// Compiles the model's forward pass, loads the weights and prints their loss on the data.
pub fn run(args: Args) -> Result<()> {
    check_backend(args.backend)?;
    for (flag, path) in [("--init", &args.init), ("--data", &args.data)] {
        if !path.exists() {
            return Err(Error::Usage(format!(
                "{flag} {}: no such file or directory; check the path",
                path.display()
            )));
        }
    }
    let mut config = protrain::models::load(&args.model)?;
    if let Some(note) = super::train::fit_vocab(
        &mut config,
        &args.model,
        args.vocab,
        args.tokenizer.as_deref(),
    )? {
        if !args.json {
            eprintln!("{note}");
        }
    }
    let (hardware, device_budget) = args.machine.profile()?;
    let (batch, seq, _) = args.shape.resolve(&config, &hardware);
    let saved = protrain::runtime::checkpoint::saved_dtype(&args.init);
    let dtype = eval_dtype(args.shape.dtype, saved, args.backend);
    let options = CompileOptions {
        batch,
        seq,
        dtype,
        device_budget,
        policy: PolicyChoice::parse(&args.policy)?,
        fuse: !args.no_fuse,
        forward_only: true,
        ..CompileOptions::for_hardware(hardware)
    };
    let compiled = protrain::compile(&config, &options)?;
    super::warn(&compiled.warnings);
    match args.backend {
        BackendKind::Host => evaluate_on::<HostBackend>(&args, &config, &compiled),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            evaluate_on::<protrain::runtime::cuda::CudaBackend>(&args, &config, &compiled)
        }
        // `check_backend` refused it above.
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda => check_backend(args.backend),
    }
}

/// The element type to evaluate in: the one given, else the one the checkpoint `saved` was
/// trained in (as `train --resume` takes it), else the backend's default (f32 on the host,
/// bf16 on CUDA, as `train`).
fn eval_dtype(
    given: Option<super::Dtype>,
    saved: Option<protrain::ir::DType>,
    backend: BackendKind,
) -> protrain::ir::DType {
    match (given, saved, backend) {
        (Some(dtype), _, _) => dtype.ir(),
        (None, Some(saved), _) => saved,
        (None, None, BackendKind::Host) => protrain::ir::DType::F32,
        (None, None, BackendKind::Cuda) => protrain::ir::DType::BF16,
    }
}

/// [`run`] on backend `B`, once the schedule is compiled.
fn evaluate_on<B: Backend>(args: &Args, config: &ModelConfig, compiled: &Compiled) -> Result<()> {
    let schedule = &compiled.schedule;
    let graph = &schedule.graph;
    let (params, origin) = load_weights(graph, &args.init)?;
    let mut evaluator = open::<B>(
        schedule,
        ("--data", &args.data),
        args.tokenizer.as_deref(),
        args.batches,
    )?;
    let (b, t) = (schedule.header.batch, schedule.header.seq);
    if !args.json {
        eprintln!(
            "evaluating {} ({} parameters) from {origin} on {}: {} batch(es) of {b} x {t} \
             tokens from its start\n{}",
            config.name,
            format_count(schedule.header.param_count),
            args.data.display(),
            evaluator.batches(),
            plan_lines(schedule)
        );
    }
    let result = evaluator.evaluate(&params, &origin)?;
    if args.json {
        let line = serde_json::json!({
            "model": config.name,
            "weights": origin,
            "data": args.data.display().to_string(),
            "batch": b,
            "seq": t,
            "batches": result.batches,
            "tokens": result.tokens,
            "loss": result.loss,
            "ppl": result.perplexity,
            "policy": schedule.header.policy.to_string(),
            "device_bytes": schedule.arena_bytes,
            "eval_s": result.seconds,
        });
        outln!("{line}");
    } else {
        outln!("loss        {:.6}", result.loss);
        outln!("perplexity  {:.4}", result.perplexity);
        outln!(
            "{} tokens in {:.2} s ({:.0} tokens/s), device arena {}",
            result.tokens,
            result.seconds,
            result.tokens as f64 / result.seconds.max(1e-9),
            format_bytes(schedule.arena_bytes)
        );
    }
    Ok(())
}

/// An evaluator of the forward-only `schedule` on `data` (text when `tokenizer` is given),
/// given with the flag `flag` (which its messages name).
fn open<'s, B: Backend>(
    schedule: &'s VerifiedSchedule,
    (flag, data): (&str, &Path),
    tokenizer: Option<&Path>,
    batches: Option<u64>,
) -> Result<Evaluator<'s, B>> {
    let tokens = match tokenizer {
        Some(tokenizer) => tokenize_corpus(data, tokenizer, &schedule.graph)?,
        None => data.to_path_buf(),
    };
    let stream = TokenStream::open(&tokens)?;
    let executor = Executor::<B>::with_backend(schedule)?;
    let name = format!("{flag} {}", data.display());
    Ok(Evaluator::new(executor, stream, batches, &name)?)
}

/// The evaluation a run makes, from its flags, with the forward-only `schedule` (`None`:
/// no --eval-data); `tokenizer` is the run's --tokenizer, `steps` its last step.
pub fn plan<'s, B: Backend>(
    args: &EvalDataArgs,
    schedule: Option<&'s VerifiedSchedule>,
    tokenizer: Option<&Path>,
    steps: u64,
) -> Result<Option<EvalPlan<'s, B>>> {
    let (Some(data), Some(schedule)) = (&args.eval_data, schedule) else {
        return Ok(None);
    };
    let every = match args.eval_every {
        Some(0) => {
            return Err(Error::Usage(
                "--eval-every 0 would never evaluate; give a number of steps of at least 1".into(),
            ))
        }
        Some(k) => k,
        None => steps.max(1),
    };
    let evaluator = open::<B>(
        schedule,
        ("--eval-data", data),
        tokenizer,
        args.eval_batches,
    )?;
    Ok(Some(EvalPlan {
        evaluator,
        every: NonZeroU64::new(every).expect("checked above"),
    }))
}

/// Sets aside, in `options`' device budget, the arena of the leanest forward-only schedule
/// (every chunk streamed through the fewest buffers that compile) for `train --eval-data`:
/// the training schedule is then compiled for the rest, so the evaluation schedule always
/// fits beside it ([`compile_for_training`]). Returns the bytes set aside.
pub fn reserve_for_eval(config: &ModelConfig, options: &mut CompileOptions) -> Result<u64> {
    let budget = options.device_budget();
    let mut last = None;
    for n_buffer in 1..=protrain::compiler::search_forward::MAX_BUFFERS {
        let lean = CompileOptions {
            device_budget: Some(u64::MAX),
            policy: PolicyChoice::parse(&format!("n_persist=0 n_buffer={n_buffer}"))?,
            forward_only: true,
            // Evaluation runs on one rank without accumulation, whatever the training's
            // ranks and micro-batches: it reads batch x seq tokens per forward pass.
            topology: protrain::compiler::comm::Topology::SINGLE,
            micro_batches: 1,
            ..options.clone()
        };
        match protrain::compile(config, &lean) {
            Ok(c) if c.schedule.arena_bytes < budget => {
                options.device_budget = Some(budget - c.schedule.arena_bytes);
                return Ok(c.schedule.arena_bytes);
            }
            Ok(c) => {
                return Err(Error::Usage(format!(
                    "--eval-data needs at least {} of device memory for its forward-only \
                     schedule ({}), and the budget is {}; give a larger --gpu-memory",
                    format_bytes(c.schedule.arena_bytes),
                    c.schedule.header.policy,
                    format_bytes(budget)
                )))
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.expect("at least one policy was tried"))
}

/// Compiles the forward-only schedule `train --eval-data` evaluates with: `options`'
/// model, shape and element type (the options the training schedule was compiled with,
/// after [`reserve_for_eval`]), its policy searched for in the device memory the training
/// schedule `training` leaves free (both arenas are held for the whole run).
pub fn compile_for_training(
    config: &ModelConfig,
    options: &CompileOptions,
    reserved: u64,
    training: &VerifiedSchedule,
) -> Result<VerifiedSchedule> {
    let budget = options.device_budget().saturating_add(reserved);
    let eval_options = CompileOptions {
        device_budget: Some(budget.saturating_sub(training.arena_bytes)),
        policy: PolicyChoice::Auto,
        forward_only: true,
        topology: protrain::compiler::comm::Topology::SINGLE,
        micro_batches: 1,
        ..options.clone()
    };
    Ok(protrain::compile(config, &eval_options)?.schedule)
}

/// The text line of an evaluation after `step`.
pub fn eval_line(step: u64, e: &EvalResult) -> String {
    format!(
        "  eval after step {step}: loss {:.4}, perplexity {:.2} ({} batches, {} tokens)",
        e.loss, e.perplexity, e.batches, e.tokens
    )
}

/// The `--log-json` record of an evaluation after `step` of data `data`.
pub fn eval_json(step: u64, data: &Path, e: &EvalResult) -> serde_json::Value {
    serde_json::json!({
        "eval": data.display().to_string(),
        "step": step,
        "loss": e.loss,
        "ppl": e.perplexity,
        "batches": e.batches,
        "tokens": e.tokens,
        "eval_s": e.seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use protrain::ir::DType;

    /// A checkpoint evaluates in the type it was trained in on either backend, unless --dtype
    /// says otherwise; other weights take the backend's default.
    #[test]
    fn a_checkpoint_evaluates_in_its_own_element_type() {
        use super::super::Dtype;
        let cases = [
            (None, Some(DType::F32), BackendKind::Cuda, DType::F32),
            (None, Some(DType::F16), BackendKind::Host, DType::F16),
            (None, None, BackendKind::Cuda, DType::BF16),
            (None, None, BackendKind::Host, DType::F32),
            (
                Some(Dtype::Bf16),
                Some(DType::F32),
                BackendKind::Cuda,
                DType::BF16,
            ),
        ];
        for (given, saved, backend, want) in cases {
            assert_eq!(
                eval_dtype(given, saved, backend),
                want,
                "{given:?} {saved:?}"
            );
        }
    }
}
