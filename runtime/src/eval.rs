//! Evaluation: the mean loss and perplexity of a model's weights on held-out data, computed by
//! a forward-only schedule.
//!
//! An [`Evaluator`] owns an [`Executor`] of a schedule compiled without a backward pass or an
//! optimizer (`protrain compile --forward-only`; [`Graph::is_forward_only`]) and the batches
//! it evaluates: the first `N` batches of `B x T` tokens of a token stream, read as a training
//! run reads its batches `0..N` ([`Batcher`]): batch `i` starts at token `i*B*T`, its targets
//! are its inputs shifted by one, and no batch wraps. So an evaluation is deterministic, and
//! the loss of one batch is the loss the training step that reads the same batch from the
//! same weights computes, bit for bit: the forward kernels are the same, and every policy
//! computes the same bits.
//!
//! [`Evaluator::evaluate`] loads weights (in parameter order, as [`Executor::params`] returns
//! them), runs the batches and returns the mean of their losses ([`EvalResult`]). A
//! [`Trainer`](crate::Trainer) given an [`EvalPlan`] evaluates its weights every few steps.
//!
//! It does not compile (the runtime never does), print, or change the weights it is given.

use crate::backend::Backend;
use crate::checkpoint;
use crate::data::{vocab_of, Batch, Batcher, TokenStream};
use crate::error::{Result, RuntimeError};
use crate::executor::Executor;
use crate::host::HostBackend;
use crate::params::load_params;
use protrain_ir::Graph;
use std::num::NonZeroU64;
use std::path::Path;
use std::time::Instant;

/// What one evaluation measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalResult {
    /// The mean over the batches of each batch's mean cross-entropy (each over its `B*T`
    /// positions), summed in f64 in batch order. With one batch, exactly that batch's f32 loss.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Batches evaluated.
    pub batches: u64,
    /// Tokens evaluated (batches x batch x seq).
    pub tokens: u64,
    /// Wall time of the evaluation, weights loading included, in seconds.
    pub seconds: f64,
}

/// How many whole batches of `batch x seq` tokens (each with the token after it, its last
/// target) a stream of `len` tokens holds from its start without wrapping.
pub fn batches_in(len: usize, batch: usize, seq: usize) -> u64 {
    let n = batch.saturating_mul(seq).max(1);
    (len.saturating_sub(1) / n) as u64
}

/// Evaluates weights on the first batches of a token stream with a forward-only schedule.
pub struct Evaluator<'s, B: Backend = HostBackend> {
    executor: Executor<'s, B>,
    batcher: Batcher,
    batches: u64,
    /// One batch and its ids as the executor takes them, reused batch after batch.
    batch: Batch,
    inputs: Vec<i32>,
    targets: Vec<i32>,
}

impl<'s, B: Backend> Evaluator<'s, B> {
    /// An evaluator of `executor`'s schedule on the first `batches` batches of `stream` (all
    /// the whole batches it holds when `None`). `data` names the stream in messages, as the
    /// flag that gave it and its path (`--eval-data held_out.npy`).
    ///
    /// Fails when the schedule is not forward-only (it would train the weights it is meant to
    /// measure), when a batch it evaluates holds a token outside the model's vocabulary
    /// (the rest of the stream is not read), when it cannot
    /// fill one batch, or when `batches` is 0 or more than it holds.
    pub fn new(
        executor: Executor<'s, B>,
        stream: TokenStream,
        batches: Option<u64>,
        data: &str,
    ) -> Result<Self> {
        let schedule = executor.schedule();
        let graph = &schedule.graph;
        if !graph.is_forward_only() {
            return Err(RuntimeError::EvalNotForwardOnly);
        }
        let vocab = vocab_of(graph).ok_or_else(|| {
            RuntimeError::BadSchedule(
                "the schedule's graph takes no token ids; compile a language model".into(),
            )
        })?;
        let (b, t) = (schedule.header.batch as usize, schedule.header.seq as usize);
        let batcher = Batcher::new(stream, b, t)?;
        let held = batches_in(batcher.stream().len(), b, t);
        let batches = match batches {
            Some(0) => {
                return Err(RuntimeError::InvalidEval(
                    "0 batches would evaluate nothing; ask for at least 1".into(),
                ))
            }
            Some(n) if n > held => {
                return Err(RuntimeError::InvalidEval(format!(
                    "{data} holds {} tokens, {held} batch(es) of {b} x {t} (each with the token \
                     after it); {n} were asked for. Give at most {held} batches, or more data",
                    batcher.stream().len()
                )))
            }
            Some(n) => n,
            None => held,
        };
        // Only the batches evaluated must be token ids of the model, and only they are read.
        let mut batch = batcher.batch(0);
        let label = crate::error::DataLabel::Words(data.to_string());
        for i in 0..batches {
            batcher.fill(i, &mut batch);
            batcher.check_batch(&batch, vocab, &label)?;
        }
        Ok(Self {
            batch,
            batcher,
            batches,
            inputs: Vec::with_capacity(b * t),
            targets: Vec::with_capacity(b * t),
            executor,
        })
    }

    /// Batches each evaluation reads.
    pub fn batches(&self) -> u64 {
        self.batches
    }

    /// The batches' source.
    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// The executor, to read its schedule.
    pub fn executor(&self) -> &Executor<'s, B> {
        &self.executor
    }

    /// Fails unless `graph` (a training schedule's) has this schedule's parameters, with the
    /// same names and shapes in the same order, so its weights can be evaluated as they are.
    pub fn check_params_of(&self, graph: &Graph) -> Result<()> {
        let ours = &self.executor.schedule().graph;
        let describe = |g: &Graph| -> Vec<(String, Vec<u64>)> {
            g.params()
                .map(|(_, p)| (p.name.clone(), g.value(p.value).ty.shape.clone()))
                .collect()
        };
        let (theirs, mine) = (describe(graph), describe(ours));
        if theirs == mine {
            return Ok(());
        }
        let first = theirs
            .iter()
            .zip(&mine)
            .find(|(a, b)| a != b)
            .map(|((n, s), (m, t))| format!("`{n}` {s:?} against `{m}` {t:?}"))
            .unwrap_or_else(|| format!("{} parameters against {}", theirs.len(), mine.len()));
        Err(RuntimeError::EvalOtherModel { first })
    }

    /// Loads `params` (in parameter order) and returns their mean loss over the batches.
    /// Fails when a parameter is not finite, naming it and `origin`.
    pub fn evaluate(&mut self, params: &[Vec<f32>], origin: &str) -> Result<EvalResult> {
        let started = Instant::now();
        crate::params::check_finite(params, &self.executor.schedule().graph, origin)?;
        self.executor.load_params(params)?;
        let mut sum = 0.0f64;
        for i in 0..self.batches {
            self.batcher.fill(i, &mut self.batch);
            self.batch.ids_into(&mut self.inputs, &mut self.targets);
            let ids: [&[i32]; 2] = [&self.inputs, &self.targets];
            sum += f64::from(self.executor.step(&ids)?.loss);
        }
        let loss = sum / self.batches as f64;
        let per_batch = (self.batcher.batch_size() * self.batcher.seq_len()) as u64;
        Ok(EvalResult {
            loss,
            perplexity: loss.exp(),
            batches: self.batches,
            tokens: self.batches * per_batch,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// When a [`Trainer`](crate::Trainer) evaluates: after every step that is a multiple of
/// `every`, on `evaluator`'s batches.
pub struct EvalPlan<'s, B: Backend = HostBackend> {
    /// The evaluator, its executor allocated once for the run.
    pub evaluator: Evaluator<'s, B>,
    /// Steps between evaluations.
    pub every: NonZeroU64,
}

/// The weights at `path` for `graph`, in parameter order, and how to name them (a checkpoint
/// is named with the step it was written after): the newest intact checkpoint of a
/// checkpoint directory (`protrain train --checkpoint-dir`), one checkpoint file of such a
/// directory (`step-00000040.safetensors`, or a sharded checkpoint's manifest), else a
/// Hugging Face safetensors file, sharded index or model directory. Only the weights of a
/// checkpoint are read, not its Adam moments: what `eval --init` and `train --init` take.
pub fn load_weights(graph: &Graph, path: &Path) -> Result<(Vec<Vec<f32>>, String)> {
    let checkpoints = match path.is_dir() {
        true => checkpoint::list(path)?,
        false => Vec::new(),
    };
    if let Some(one) = checkpoint::load_params_at(path, graph) {
        let (params, step) = one?;
        return Ok((params, checkpoint_origin(path, step)));
    }
    if checkpoints.is_empty() {
        let params = load_params(graph, path)?;
        return Ok((params, path.display().to_string()));
    }
    let (params, file) = checkpoint::load_latest_params(path, graph)?;
    let step = checkpoints
        .iter()
        .find(|(_, p)| *p == file)
        .map_or(0, |&(step, _)| step);
    Ok((params, checkpoint_origin(&file, step)))
}

/// How weights read from the checkpoint `file`, written after `step`, are named.
fn checkpoint_origin(file: &Path, step: u64) -> String {
    format!(
        "checkpoint {} (the weights after step {step}; its optimizer state is not read)",
        file.display()
    )
}
