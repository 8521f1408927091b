//! `protrain train`: train a model and report the loss as it falls.

use super::seq_or_default;
use indicatif::{ProgressBar, ProgressStyle};
use protrain::runtime::data::{Batcher, TokenStream};
use protrain::runtime::interpreter::Interpreter;
use protrain::runtime::params::{init_params, load_params, save_params};
use protrain::runtime::synthetic::SyntheticCorpus;
use protrain::runtime::weights::StorageDtype;
use protrain::{Error, OptimizerConfig, Result};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `protrain train`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A preset name, a path to a Hugging Face config.json, or a directory holding one.
    model: String,
    /// Token file: a 1-D integer `.npy`, or raw little-endian u16 `.bin`. Without it, training
    /// uses the built-in synthetic corpus (counting, copying and addition over 24 token ids).
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Initial weights: a Hugging Face safetensors file, sharded index, or model directory.
    /// Without it, weights are drawn as transformers initialises them, from --seed.
    #[arg(long, value_name = "FILE")]
    init: Option<PathBuf>,
    /// Optimizer steps to take.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: u64,
    /// Tokens per sequence [default: 64, or the model's position limit if smaller].
    #[arg(long)]
    seq: Option<u64>,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// AdamW first-moment decay.
    #[arg(long, default_value_t = 0.9)]
    beta1: f64,
    /// AdamW second-moment decay.
    #[arg(long, default_value_t = 0.95)]
    beta2: f64,
    /// AdamW epsilon, added to the root of the second moment.
    #[arg(long, default_value_t = 1e-8)]
    eps: f64,
    /// AdamW decoupled weight decay, applied to every parameter.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Scale gradients down to this global norm when larger (clip_grad_norm_); off by default.
    #[arg(long, value_name = "NORM")]
    grad_clip: Option<f64>,
    /// Seed of the random initialisation and of the synthetic corpus.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save the trained weights here as safetensors, under their Hugging Face names.
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Print one JSON object per step (step, loss, grad_norm, tokens_per_s) instead of a
    /// progress bar and table.
    #[arg(long)]
    log_json: bool,
}

/// Builds the training graph, loads or initialises the weights, and runs the steps.
pub fn run(args: Args) -> Result<()> {
    let config = protrain::models::load(&args.model)?;
    let seq = seq_or_default(&config, args.seq, 64);
    let optimizer = OptimizerConfig {
        lr: args.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.eps,
        weight_decay: args.weight_decay,
        grad_clip: args.grad_clip,
    };
    let forward = protrain::forward_graph(&config, args.batch, seq)?;
    let graph = protrain::training_graph(&forward, &optimizer)?;
    let vocab = config.vocab_size as usize;

    let tokens_per_step = (args.batch * seq) as usize;
    let stream = match &args.data {
        Some(path) => TokenStream::open(path)?,
        None => {
            let wanted = tokens_per_step
                .saturating_mul(args.steps.max(1) as usize)
                .saturating_add(1);
            SyntheticCorpus::new(vocab, args.seed)?.stream(wanted.min(1 << 24))
        }
    };
    let batcher = Batcher::new(stream, args.batch as usize, seq as usize)?;

    let values = match &args.init {
        Some(path) => load_params(&graph, path)?,
        None => init_params(&graph, args.seed),
    };
    let mut interpreter = Interpreter::new(&graph);
    for ((id, _), data) in graph.params().zip(&values) {
        interpreter.set_param(id, data)?;
    }

    if !args.log_json {
        eprintln!(
            "training {} ({} parameters) on {}: {} steps of {}x{} tokens, lr {}",
            config.name,
            protrain::ir::format_count(graph.param_count()),
            args.data
                .as_ref()
                .map_or("the synthetic corpus".into(), |p| p.display().to_string()),
            args.steps,
            args.batch,
            seq,
            args.lr
        );
    }
    let bar = if args.log_json {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(args.steps);
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
    let row = |text: String| bar.suspend(|| println!("{text}"));
    if !args.log_json {
        row(format!(
            "{:>6}  {:>10}  {:>10}  {:>12}",
            "step", "loss", "grad norm", "tokens/s"
        ));
    }
    let started = Instant::now();
    let mut losses = Vec::with_capacity(args.steps as usize);
    for step in 0..args.steps {
        let batch = batcher.batch(step);
        batch.check_vocab(vocab)?;
        let inputs: Vec<i32> = batch.inputs.iter().map(|&t| t as i32).collect();
        let targets: Vec<i32> = batch.targets.iter().map(|&t| t as i32).collect();
        let step_started = Instant::now();
        let report = interpreter.step(&[&inputs, &targets])?;
        let tokens_per_s = tokens_per_step as f64 / step_started.elapsed().as_secs_f64();
        losses.push(report.loss);
        if args.log_json {
            let line = serde_json::json!({
                "step": step + 1,
                "loss": report.loss,
                "grad_norm": report.grad_norm,
                "tokens_per_s": tokens_per_s,
            });
            println!("{line}");
        } else {
            bar.set_message(format!("loss {:.4}", report.loss));
            bar.inc(1);
            if (step + 1) % report_every == 0 || step == 0 {
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
            return Err(Error::Usage(format!(
                "the loss became {} at step {}; lower --lr or set --grad-clip",
                report.loss,
                step + 1
            )));
        }
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    if !args.log_json && !losses.is_empty() {
        let tail = &losses[losses.len().saturating_sub(10)..];
        let last = tail.iter().sum::<f32>() / tail.len() as f32;
        println!(
            "loss {:.4} -> {:.4} (mean of the last {}) in {:.1} s, {:.0} tokens/s",
            losses[0],
            last,
            tail.len(),
            elapsed,
            (tokens_per_step as f64 * losses.len() as f64) / elapsed
        );
    }
    if let Some(path) = &args.save {
        let values: Vec<Vec<f32>> = graph
            .params()
            .map(|(id, _)| interpreter.param(id).to_vec())
            .collect();
        save_params(&graph, &values, path, StorageDtype::F32)?;
        if !args.log_json {
            println!("saved weights to {}", path.display());
        }
    }
    Ok(())
}
