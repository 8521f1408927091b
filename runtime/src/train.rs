//! The training loop: batches, the learning-rate schedule, checkpoints and the checks between
//! steps.
//!
//! A [`Trainer`] owns an [`Executor`] and everything a run needs besides the schedule: its
//! [`RunSettings`] (steps, learning-rate schedule, seed, data), the data position, and where
//! checkpoints go. Each [`Trainer::step`] reads the next batch, runs one optimizer step at the
//! learning rate the [`LrSchedule`] gives it, hands a [`StepRecord`] to the caller (who prints
//! it), checks the loss and the gradient norm, and saves a checkpoint when one is due. A
//! checkpoint records the run settings beside the weights and the Adam moments, so a run
//! resumed from it ([`Trainer::resume`]) takes the steps its uninterrupted twin would have
//! taken, bit for bit; [`RunFlags::resume`] merges what a user asks for with what the
//! checkpoint says and refuses a contradiction.
//!
//! An optimizer *step* and a *batch* are counted apart: the schedule and AdamW's bias
//! correction follow the step ([`Executor::steps_taken`]), the data follows the batch index.
//! A batch is what one step reads: with gradient accumulation over `K` micro-batches of `B`
//! sequences it is `K*B` sequences (the rows one batch of that size would read), which the
//! executor feeds to the micro-batches in order.
//!
//! With a data-parallel schedule of `W` ranks (one trainer per rank, each executor given its
//! rank's collective), a batch is the global batch of `W*K*B` sequences, the rows one rank of
//! `W*K` micro-batches would read, cut into its `W*K` micro-batches, and rank `r`'s
//! micro-batch `m` reads what that single rank's micro-batch `m*W + r` reads (interleaved:
//! [`crate::data::rank_rows`] says why).
//!
//! Given an [`EvalPlan`] ([`Trainer::evaluate_every`]), it also evaluates the weights on
//! held-out data every few steps, with a forward-only schedule of its own
//! ([`crate::eval`]), and puts the result in the step's record.
//!
//! An f16 schedule is loss-scaled: a [`LossScaler`] gives each step its scale (GradScaler's
//! rules, [`crate::loss_scale`]), and a step whose gradients overflowed is skipped: its
//! record says so, the scale halves, and the learning-rate schedule stays where it was (the
//! rate follows the AdamW steps applied, [`Executor::updates_taken`], as transformers'
//! Trainer steps its scheduler only when the optimizer stepped).
//!
//! What this does not do: build or verify the schedule (the compiler does), print anything
//! (the caller does, from the records), or decide the optimizer's hyper-parameters other than
//! the learning rate (they are compiled into the schedule's AdamW ops).

use crate::backend::Backend;
use crate::checkpoint::{self, Checkpoint, OptimizerSettings, Progress};
pub use crate::data::vocab_of;
use crate::data::{Batch, Batcher, TokenStream};
use crate::error::{DataLabel, Divergence, LrScheduleProblem, Result, RuntimeError, Setting};
use crate::eval::{EvalPlan, EvalResult};
use crate::executor::Executor;
use crate::host::HostBackend;
use crate::loss_scale::{LossScaler, ScalerState};
pub use crate::lr_schedule::{LrSchedule, LrScheduleKind};
use crate::params::check_finite;
pub use crate::run_settings::{RunFlags, RunSettings, DEFAULT_STEPS};
use crate::synthetic::SyntheticCorpus;
use protrain_ir::Graph;
use std::collections::VecDeque;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// When a run prints a row of its table: after its first step, its last, every
/// `every`-th step, and, without a progress bar (no terminal, as under `nohup ... > log`),
/// at least every [`ReportPace::INTERVAL`], so a log shows progress at least every 5% of
/// the run and every minute.
#[derive(Clone, Debug)]
pub struct ReportPace {
    first: u64,
    last: u64,
    every: u64,
    interval: Option<std::time::Duration>,
    printed: Option<Instant>,
}

impl ReportPace {
    /// The longest a run without a progress bar goes without a row.
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

    /// The pace of a run of steps `first + 1..=steps`: with a progress bar (`bar`), a row
    /// every tenth of the run; without one, every twentieth and every minute.
    pub fn new(first: u64, steps: u64, bar: bool) -> Self {
        Self {
            first,
            last: steps,
            every: (steps / if bar { 10 } else { 20 }).max(1),
            interval: (!bar).then_some(Self::INTERVAL),
            printed: None,
        }
    }

    /// Whether step `step`, finished at `now`, gets a row; a row is counted as printed.
    pub fn due(&mut self, step: u64, now: Instant) -> bool {
        let late = match (self.interval, self.printed) {
            (Some(interval), Some(at)) => now.saturating_duration_since(at) >= interval,
            _ => false,
        };
        let due =
            late || step == self.first + 1 || step == self.last || step.is_multiple_of(self.every);
        if due {
            self.printed = Some(now);
        }
        due
    }
}

/// Where and how often a run writes checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointPlan {
    /// The directory (created when the first checkpoint is written).
    pub dir: PathBuf,
    /// Steps between checkpoints; the last step of the run is always saved too.
    pub every: NonZeroU64,
    /// Checkpoints to keep, the newest (0 keeps all).
    pub keep: usize,
}

/// What a rank other than 0 does where rank 0 reads the weights, in a run whose schedule
/// shards its offloaded chunks over the ranks: reading them gathers every rank's shard, so
/// every rank must issue the same gathers at the same steps ([`Trainer::mirror_weight_reads`]).
/// Checkpoints gather nothing: every rank writes its own shard ([`Trainer::save_checkpoints`]
/// on every rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightReads {
    /// Rank 0 evaluates the weights after every step that is a multiple of this.
    pub eval_every: Option<NonZeroU64>,
}

/// What one step did: what the caller prints, as text or JSON.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// The optimizer step, 1-based, counting the steps taken before a resume.
    pub step: u64,
    /// The index of the batch it read (its first, with several per step).
    pub batch: u64,
    /// The mean cross-entropy of the batch, before the update.
    pub loss: f32,
    /// The global gradient norm before clipping, when the schedule computes it.
    pub grad_norm: Option<f32>,
    /// The learning rate AdamW used, when the schedule has an optimizer.
    pub lr: Option<f64>,
    /// The loss scale the step ran at, when the schedule is loss-scaled (f16).
    pub loss_scale: Option<f64>,
    /// Whether the optimizer step was skipped: a loss-scaled step whose gradients
    /// overflowed (no weight, moment or AdamW step count changed; the scale halves).
    pub skipped: bool,
    /// Tokens the step trained on (micro-batches x batch x seq).
    pub tokens: u64,
    /// The executor's wall time of the step, in seconds.
    pub step_seconds: f64,
    /// Tokens per second over the whole step, batch preparation included.
    pub tokens_per_s: f64,
    /// The checkpoint written after the step, if one was.
    pub checkpoint: Option<PathBuf>,
    /// The evaluation of the weights after the step, if one was due ([`EvalPlan`]).
    pub eval: Option<EvalResult>,
    /// The pass over the data (1-based, [`Batcher::epoch_of`]) this step's batch starts,
    /// when the data wrapped around to its start with it.
    pub epoch_started: Option<u64>,
}

/// What a run measured, for the summary after it; nothing in it grows with the steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunSummary {
    /// Steps this trainer took.
    pub steps: u64,
    /// The loss of its first step.
    pub first_loss: Option<f32>,
    /// The last [`RunSummary::TAIL`] losses.
    last_losses: VecDeque<f32>,
    /// Tokens trained on.
    pub tokens: u64,
    /// Seconds from the start of the first step to the end of the last.
    pub elapsed_seconds: f64,
    /// The first step's executor wall time (it warms caches and the thread pool).
    first_step_seconds: f64,
    /// The sum of the others'.
    later_step_seconds: f64,
    /// Each stream's busy seconds summed over the steps after the first.
    later_stream_busy: Vec<f64>,
}

/// The measured step time: the mean over the steps after the first, or the only step's.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredStep {
    /// Seconds per step.
    pub seconds: f64,
    /// The steps averaged (0: the only step, which was also the first).
    pub averaged: u64,
    /// Each stream's mean busy seconds over the averaged steps (empty with one step).
    pub stream_busy_seconds: Vec<f64>,
}

impl RunSummary {
    /// How many of the last losses [`RunSummary::last_loss_mean`] averages.
    pub const TAIL: usize = 10;

    /// The mean of the last [`RunSummary::TAIL`] losses (fewer in a short run), and how many.
    pub fn last_loss_mean(&self) -> Option<(f32, usize)> {
        let n = self.last_losses.len();
        (n > 0).then(|| (self.last_losses.iter().sum::<f32>() / n as f32, n))
    }

    /// The measured step time, when a step was taken.
    pub fn step_time(&self) -> Option<MeasuredStep> {
        match self.steps {
            0 => None,
            1 => Some(MeasuredStep {
                seconds: self.first_step_seconds,
                averaged: 0,
                stream_busy_seconds: Vec::new(),
            }),
            n => {
                let later = (n - 1) as f64;
                Some(MeasuredStep {
                    seconds: self.later_step_seconds / later,
                    averaged: n - 1,
                    stream_busy_seconds: self.later_stream_busy.iter().map(|b| b / later).collect(),
                })
            }
        }
    }

    fn push(&mut self, record: &StepRecord, busy: &[f64]) {
        if self.steps == 0 {
            self.first_step_seconds = record.step_seconds;
            self.later_stream_busy = vec![0.0; busy.len()];
        } else {
            self.later_step_seconds += record.step_seconds;
            for (sum, b) in self.later_stream_busy.iter_mut().zip(busy) {
                *sum += b;
            }
        }
        self.first_loss.get_or_insert(record.loss);
        if self.last_losses.len() == Self::TAIL {
            self.last_losses.pop_front();
        }
        self.last_losses.push_back(record.loss);
        self.steps += 1;
        self.tokens += record.tokens;
    }
}

/// A training run on backend `B`: the executor, its data, its settings and where it stands.
pub struct Trainer<'s, B: Backend = HostBackend> {
    executor: Executor<'s, B>,
    batcher: Batcher,
    settings: RunSettings,
    /// Whether the schedule has AdamW ops (and so a learning rate).
    has_optimizer: bool,
    /// The index of the next batch to read.
    next_batch: u64,
    /// Optimizer steps taken when this trainer started.
    started_at: u64,
    checkpoints: Option<CheckpointPlan>,
    /// The checkpoint directory, held while this trainer writes there (rank 0's).
    checkpoint_dir: Option<checkpoint::DirLock>,
    eval: Option<EvalPlan<'s, B>>,
    /// Rank 0's weight reads this rank joins (a sharded schedule's other ranks).
    mirror: WeightReads,
    trace_last: bool,
    /// The last finite loss and its gradient norm, for the message if training diverges.
    previous: Option<(f32, Option<f32>)>,
    summary: RunSummary,
    started: Option<Instant>,
    notes: Vec<String>,
    /// One batch and its ids as the executor takes them, reused step after step.
    batch: Batch,
    inputs: Vec<i32>,
    targets: Vec<i32>,
    /// This rank's rows of them ([`crate::data::rank_rows`]).
    rank_inputs: Vec<i32>,
    rank_targets: Vec<i32>,
    /// The loss scaler of a loss-scaled (f16) schedule.
    scaler: Option<LossScaler>,
    /// The vocabulary every batch's ids must fall in, checked as each is read.
    vocab: usize,
    /// The data as messages name it: the data setting and its path, or the synthetic corpus.
    data_label: DataLabel,
    /// The step of the last checkpoint this trainer wrote, and where.
    last_checkpoint: Option<(u64, PathBuf)>,
}

impl<'s, B: Backend> Trainer<'s, B> {
    /// A new run of `executor`'s schedule from `params` (in parameter order), which must be
    /// finite; `origin` says where they came from, for the message when they are not
    /// ("--init FILE", "the initialisation from --seed 0").
    pub fn start(
        mut executor: Executor<'s, B>,
        settings: RunSettings,
        params: &[Vec<f32>],
        origin: &str,
    ) -> Result<Self> {
        check_finite(params, &executor.schedule().graph, origin)?;
        executor.load_params(params)?;
        let mut trainer = Self::new(executor, settings, 0, None)?;
        let warnings = trainer.settings.warnings(0, false);
        trainer.notes.extend(warnings);
        Ok(trainer)
    }

    /// A run continued from `checkpoint`, which must have been read for `executor`'s
    /// schedule: its parameters, Adam moments, step count and data position are restored, so
    /// the next step is the one the checkpointed run would have taken next. `settings` are
    /// the run's (see [`RunFlags::resume`]). A token file of another length than the
    /// checkpointed run's gives a warning ([`Trainer::notes`]).
    pub fn resume(
        mut executor: Executor<'s, B>,
        settings: RunSettings,
        checkpoint: &Checkpoint,
    ) -> Result<Self> {
        checkpoint.restore(&mut executor)?;
        Self::restored(executor, settings, checkpoint)
    }

    /// [`Trainer::resume`] with an executor into which `checkpoint` was restored already
    /// ([`checkpoint::restore_latest`], which falls back past damaged checkpoints on every
    /// rank alike).
    pub fn restored(
        executor: Executor<'s, B>,
        settings: RunSettings,
        checkpoint: &Checkpoint,
    ) -> Result<Self> {
        let progress = checkpoint.progress;
        let ranks = executor.rank().1;
        let saved_checksum = settings.data_checksum.clone();
        let mut trainer = Self::new(executor, settings, progress.data_step, progress.scaler)?;
        trainer.notes.push(format!(
            "resuming from {} (step {})",
            checkpoint.path.display(),
            progress.step
        ));
        if checkpoint.ranks != ranks {
            trainer.notes.push(format!(
                "re-sharding: the checkpoint holds the state of {} rank(s), this run has {ranks}; \
                 each rank read the part it holds",
                checkpoint.ranks
            ));
        }
        // The synthetic corpus grows with the steps, always from the same start, so only a
        // token file can make the batches differ.
        let tokens = trainer.batcher.stream().len() as u64;
        if trainer.settings.data.is_some() && tokens != progress.data_tokens {
            let warning = format!(
                "warning: {} has {tokens} tokens but the checkpointed run's data had {}; \
                 batches will differ from the original run's once the data wraps",
                trainer.settings.data_name(),
                progress.data_tokens
            );
            trainer.notes.push(warning);
        } else if let (Some(theirs), Some(ours)) = (saved_checksum, &trainer.settings.data_checksum)
        {
            if theirs != *ours {
                trainer.notes.push(format!(
                    "warning: {} has the {tokens} tokens of the checkpointed run's data but not \
                     its contents (checksum {ours}, the run's {theirs}): it was replaced, and \
                     the batches from here on differ from the original run's",
                    trainer.settings.data_name()
                ));
            }
        }
        let first = trainer.executor.steps_taken();
        let warnings = trainer.settings.warnings(first, true);
        trainer.notes.extend(warnings);
        Ok(trainer)
    }

    fn new(
        executor: Executor<'s, B>,
        settings: RunSettings,
        next_batch: u64,
        scaler: Option<ScalerState>,
    ) -> Result<Self> {
        let schedule = executor.schedule();
        let graph = &schedule.graph;
        let scaler = match (executor.loss_scaled(), settings.loss_scale) {
            (false, Some(_)) => {
                return Err(RuntimeError::InvalidLossScale(
                    crate::error::LossScaleProblem::NotLossScaled,
                ))
            }
            (false, None) => None,
            (true, given) => {
                let given = given.unwrap_or_default();
                given.validate()?;
                // A resumed run's scaler goes on where the checkpoint's stood.
                Some(match &scaler {
                    Some(state) => LossScaler::restore(given, state),
                    None => LossScaler::new(given),
                })
            }
        };
        let optimizer = OptimizerSettings::of(graph);
        if let Some(compiled) = optimizer {
            if compiled.lr != settings.lr_schedule.peak {
                return Err(RuntimeError::InvalidLrSchedule(
                    LrScheduleProblem::PeakNotCompiled {
                        peak: settings.lr_schedule.peak,
                        compiled: compiled.lr,
                    },
                ));
            }
        }
        let (batcher, vocab) = open_data(&settings, schedule)?;
        let n = batcher.batch_size() * batcher.seq_len();
        let mut settings = settings;
        settings.data_checksum = settings
            .data
            .as_ref()
            .map(|_| batcher.stream().sample_checksum());
        let data_label = match &settings.data {
            Some(path) => DataLabel::File {
                setting: Setting::Data,
                path: path.clone(),
            },
            None => DataLabel::Words("the synthetic corpus".into()),
        };
        // The first batch is checked before the run starts, so the common mistake (data of
        // another tokenizer) is refused before anything is printed or written; the others
        // as they are read ([`Trainer::step`]).
        let batch = batcher.batch(next_batch);
        batcher.check_batch(&batch, vocab, &data_label)?;
        Ok(Self {
            vocab,
            data_label,
            last_checkpoint: None,
            started_at: executor.steps_taken(),
            executor,
            batch,
            batcher,
            settings,
            has_optimizer: optimizer.is_some(),
            next_batch,
            checkpoints: None,
            eval: None,
            mirror: WeightReads::default(),
            trace_last: false,
            previous: None,
            summary: RunSummary::default(),
            started: None,
            notes: Vec::new(),
            checkpoint_dir: None,
            inputs: Vec::with_capacity(n),
            targets: Vec::with_capacity(n),
            rank_inputs: Vec::with_capacity(n),
            rank_targets: Vec::with_capacity(n),
            scaler,
        })
    }

    /// Writes checkpoints as `plan` says, after taking its directory for this run (rank 0
    /// does, [`checkpoint::take_dir`]: a directory another run holds is refused, and leftover
    /// temporary files of interrupted saves are removed) and checking that it holds none of
    /// another run ([`checkpoint::check_dir_is_ours`]; `resumed_from` is the directory this
    /// run resumed from, whose checkpoints are its own). Every rank of a data-parallel run
    /// must be given the same plan: each writes its own shard, rank 0 the manifest and the
    /// pruning ([`checkpoint::save`]). Returns notes for the user (the files removed).
    pub fn save_checkpoints(
        &mut self,
        plan: CheckpointPlan,
        resumed_from: Option<&Path>,
    ) -> Result<Vec<String>> {
        let mut notes = Vec::new();
        if self.executor.rank().0 == 0 {
            let held = checkpoint::take_dir(&plan.dir)?;
            if !held.removed.is_empty() {
                notes.push(format!(
                    "removed {} leftover temporary checkpoint file(s) ({}) of saves that were \
                     interrupted from {}",
                    held.removed.len(),
                    protrain_ir::format_bytes(held.removed_bytes),
                    plan.dir.display()
                ));
            }
            self.checkpoint_dir = Some(held);
        }
        checkpoint::check_dir_is_ours(&plan.dir, resumed_from)?;
        self.settings.save_every = Some(plan.every.get());
        self.checkpoints = Some(plan);
        Ok(notes)
    }

    /// Writes a checkpoint of the last step taken now, if the run writes checkpoints and
    /// that step has none yet (a run stopped between its checkpoints, by a signal), and
    /// returns the step's checkpoint; `None` when the run writes none or has taken no step.
    /// Every rank of a data-parallel run must call it alike, as [`Trainer::step`] saves.
    pub fn checkpoint_now(&mut self) -> Result<Option<(u64, PathBuf)>> {
        let step = self.executor.steps_taken();
        if self.checkpoints.is_none() || step == 0 {
            return Ok(None);
        }
        match &self.last_checkpoint {
            Some((saved, path)) if *saved == step => Ok(Some((step, path.clone()))),
            _ => {
                let path = self.write_checkpoint(step)?;
                Ok(Some((step, path)))
            }
        }
    }

    /// Writes the checkpoint of `step`, the last step taken, as the plan says.
    fn write_checkpoint(&mut self, step: u64) -> Result<PathBuf> {
        let plan = self
            .checkpoints
            .as_ref()
            .expect("a checkpoint is written only with a plan");
        let progress = Progress {
            step,
            data_step: self.next_batch,
            data_tokens: self.batcher.stream().len() as u64,
            scaler: self.scaler.map(|s| ScalerState {
                scale: s.scale(),
                clean_steps: s.clean_steps(),
                updates: self.executor.updates_taken(),
            }),
        };
        // Every rank writes its shard; rank 0 the manifest, then it prunes.
        let path = checkpoint::save_run(&plan.dir, &self.executor, &progress, &self.settings)?;
        if self.executor.rank().0 == 0 {
            checkpoint::prune(&plan.dir, plan.keep)?;
        }
        self.last_checkpoint = Some((step, path.clone()));
        Ok(path)
    }

    /// Evaluates the weights as `plan` says, after every step that is a multiple of its
    /// `every`, after checking that its schedule has this run's parameters.
    pub fn evaluate_every(&mut self, plan: EvalPlan<'s, B>) -> Result<()> {
        plan.evaluator
            .check_params_of(&self.executor.schedule().graph)?;
        self.eval = Some(plan);
        Ok(())
    }

    /// The steps at which this trainer reads the weights (its checkpoints and evaluations):
    /// what the other ranks of a sharded run must join ([`Trainer::mirror_weight_reads`]).
    pub fn weight_reads(&self) -> WeightReads {
        WeightReads {
            eval_every: self.eval.as_ref().map(|plan| plan.every),
        }
    }

    /// Joins rank 0's weight reads (evaluations) on this rank, which evaluates nothing
    /// itself: with a schedule that shards its offloaded chunks, reading the weights gathers
    /// every rank's shard, so every rank must read them at the same steps.
    pub fn mirror_weight_reads(&mut self, reads: WeightReads) {
        self.mirror = reads;
    }

    /// Records the timeline of the run's last step ([`Executor::timeline`]).
    pub fn trace_last_step(&mut self) {
        self.trace_last = true;
    }

    /// The run's settings.
    pub fn settings(&self) -> &RunSettings {
        &self.settings
    }

    /// The batches the run reads.
    pub fn batcher(&self) -> &Batcher {
        &self.batcher
    }

    /// What the caller should tell the user before training: where a resumed run resumed
    /// from, and warnings.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Steps still to take.
    pub fn remaining(&self) -> u64 {
        self.settings
            .steps
            .saturating_sub(self.executor.steps_taken())
    }

    /// Optimizer steps taken, counting those before a resume.
    pub fn steps_taken(&self) -> u64 {
        self.executor.steps_taken()
    }

    /// What the steps taken so far measured.
    pub fn summary(&self) -> &RunSummary {
        &self.summary
    }

    /// Leaves the data-parallel group ([`crate::executor::Executor::leave_group`]), after a
    /// failure, so the other ranks fail at once instead of waiting for this one.
    pub fn leave_group(&mut self) {
        self.executor.leave_group();
    }

    /// The executor, to read the weights or the timeline.
    pub fn executor(&self) -> &Executor<'s, B> {
        &self.executor
    }

    /// Takes every remaining step ([`Trainer::step`]), handing each record to `on_step`.
    pub fn run(&mut self, mut on_step: impl FnMut(&StepRecord)) -> Result<()> {
        while self.step(&mut on_step)?.is_some() {}
        Ok(())
    }

    /// Takes the next step: reads its batch, runs it at the schedule's learning rate, hands
    /// its record to `on_step` (so a diverged step is still shown), then fails if the loss or
    /// the gradient norm is not finite, naming the likely cause, and writes a checkpoint when
    /// one is due. Returns `None`, doing nothing, once the run has taken all its steps.
    pub fn step(&mut self, on_step: impl FnOnce(&StepRecord)) -> Result<Option<StepRecord>> {
        let taken = self.executor.steps_taken();
        if taken >= self.settings.steps {
            return Ok(None);
        }
        let step = taken + 1;
        if self.trace_last && step == self.settings.steps {
            self.executor.set_tracing(true);
        }
        let started = Instant::now();
        let run_started = *self.started.get_or_insert(started);
        let batch = self.next_batch;
        self.batcher.fill(batch, &mut self.batch);
        // Checked as read, so a huge token file is not read through before step 1.
        self.batcher
            .check_batch(&self.batch, self.vocab, &self.data_label)?;
        self.batch.ids_into(&mut self.inputs, &mut self.targets);
        let epoch = self.batcher.epoch_of(batch);
        let epoch_started =
            (batch > 0 && epoch > self.batcher.epoch_of(batch - 1)).then_some(epoch);
        // This rank's rows of the global batch, its micro-batches interleaved with the
        // other ranks' ([`crate::data::rank_rows`]).
        let (rank, ranks) = self.executor.rank();
        let k = self.executor.micro_batches() as usize;
        crate::data::rank_rows(&self.inputs, rank, ranks, k, &mut self.rank_inputs)?;
        crate::data::rank_rows(&self.targets, rank, ranks, k, &mut self.rank_targets)?;
        let ids: [&[i32]; 2] = [&self.rank_inputs, &self.rank_targets];
        let loss_scale = self.scaler.map(|s| s.scale());
        let (report, lr) = match self.has_optimizer {
            true => {
                // The schedule follows the AdamW steps applied: a skipped step leaves it.
                let lr = self
                    .settings
                    .lr_schedule
                    .lr(self.executor.updates_taken() + 1);
                (
                    self.executor.step_with(&ids, Some(lr), loss_scale)?,
                    Some(lr),
                )
            }
            false => (self.executor.step(&ids)?, None),
        };
        if let Some(scaler) = &mut self.scaler {
            scaler.update(report.skipped);
        }
        self.next_batch += 1;
        let tokens = self.inputs.len() as u64;
        let timing = self.executor.timing();
        let mut record = StepRecord {
            step,
            batch,
            loss: report.loss,
            grad_norm: report.grad_norm,
            lr,
            loss_scale,
            skipped: report.skipped,
            tokens,
            step_seconds: timing.wall_seconds,
            tokens_per_s: tokens as f64 / started.elapsed().as_secs_f64(),
            checkpoint: None,
            eval: None,
            epoch_started,
        };
        self.summary.push(&record, &timing.stream_busy_seconds);
        self.summary.elapsed_seconds = run_started.elapsed().as_secs_f64();
        // A skipped step's gradient norm is not finite by definition; its loss must be.
        let finite = record.loss.is_finite()
            && (record.skipped || record.grad_norm.is_none_or(f32::is_finite));
        if let Some(scaler) = self
            .scaler
            .filter(|s| s.scale() < f64::from(f32::MIN_POSITIVE))
        {
            on_step(&record);
            return Err(RuntimeError::Diverged(Divergence::LossScaleExhausted {
                step,
                scale: scaler.scale() * 2.0,
            }));
        }
        if !finite {
            on_step(&record);
            let graph = &self.executor.schedule().graph;
            return Err(RuntimeError::Diverged(diverged(
                graph,
                &record,
                step == self.started_at + 1,
                self.previous,
                &self.executor.params()?,
            )));
        }
        self.previous = Some((record.loss, record.grad_norm));
        let due = self.checkpoints.as_ref().is_some_and(|plan| {
            step.is_multiple_of(plan.every.get()) || step == self.settings.steps
        });
        if due {
            record.checkpoint = Some(self.write_checkpoint(step)?);
        }
        if let Some(plan) = &mut self.eval {
            if step.is_multiple_of(plan.every.get()) {
                let origin = format!("the weights after step {step}");
                let params = self.executor.params()?;
                record.eval = Some(plan.evaluator.evaluate(&params, &origin)?);
            }
        }
        // The gathers of rank 0's evaluation above.
        if let Some(every) = self.mirror.eval_every {
            if step.is_multiple_of(every.get()) {
                self.executor.params()?;
            }
        }
        on_step(&record);
        Ok(Some(record))
    }
}

/// The batches of a run: its token file, or the synthetic corpus drawn from its seed (long
/// enough for its steps, at most 16 Mi tokens, wrapping after that), checked against the
/// batch shape; and the schedule's vocabulary. The synthetic corpus is checked against the
/// vocabulary here; a token file's batches are checked as they are read ([`Trainer::step`]).
fn open_data(settings: &RunSettings, schedule: &protrain_ir::Schedule) -> Result<(Batcher, usize)> {
    let graph = &schedule.graph;
    let vocab = vocab_of(graph).ok_or_else(|| {
        RuntimeError::BadSchedule(
            "the schedule's graph takes no token ids; compile a language model".into(),
        )
    })?;
    // A step reads its micro-batches' rows, on every rank, as one batch.
    let batch = schedule.header.batch as usize
        * schedule.micro_batches_per_step() as usize
        * schedule.ranks() as usize;
    let seq = schedule.header.seq as usize;
    let stream = match &settings.data {
        Some(path) => TokenStream::open(path)?,
        None => {
            let wanted = batch
                .saturating_mul(seq)
                .saturating_mul(settings.steps.max(1) as usize)
                .saturating_add(1);
            let stream = SyntheticCorpus::new(vocab, settings.seed)?.stream(wanted.min(1 << 24));
            stream.check_vocab(vocab)?;
            stream
        }
    };
    Ok((Batcher::new(stream, batch, seq)?, vocab))
}

/// Why step `record` diverged (a loss or gradient norm that is NaN or infinite), from what was
/// seen: the weights now (`params`), whether this was the run's first step, the last finite
/// loss and gradient norm, and the optimizer settings.
fn diverged(
    graph: &Graph,
    record: &StepRecord,
    first_of_run: bool,
    previous: Option<(f32, Option<f32>)>,
    params: &[Vec<f32>],
) -> Divergence {
    let step = record.step;
    let head = match record.grad_norm {
        Some(norm) if record.loss.is_finite() => format!(
            "the gradient norm became {norm} at step {step} (loss {})",
            record.loss
        ),
        _ => format!("the loss became {} at step {step}", record.loss),
    };
    if first_of_run {
        return Divergence::FirstStep { what: head };
    }
    let broken: Vec<&str> = graph
        .params()
        .zip(params)
        .filter(|(_, data)| data.iter().any(|v| !v.is_finite()))
        .map(|((_, p), _)| p.name.as_str())
        .collect();
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
    // An --eps of 0 never gets here: the verifier refuses it (0/0 in AdamW).
    let clipped = OptimizerSettings::of(graph).is_some_and(|s| s.grad_clip.is_some());
    Divergence::Later {
        what: head,
        seen,
        weights,
        clipped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: LrScheduleKind, warmup: u64, decay: u64, min_lr: f64) -> LrSchedule {
        LrSchedule::new(kind, 0.5, warmup, decay, min_lr).expect("a valid schedule")
    }

    /// `(step, expected lr)` pairs for one schedule, each stated from its definition.
    fn check(s: &LrSchedule, expect: &[(u64, f64)]) {
        for &(step, want) in expect {
            let got = s.lr(step);
            assert!(
                (got - want).abs() <= 1e-15,
                "{s:?} step {step}: lr {got}, expected {want}"
            );
        }
    }

    #[test]
    fn warmup_starts_at_zero_and_reaches_the_peak() {
        use LrScheduleKind::*;
        for kind in [Constant, Linear, Cosine] {
            // Step 1 has taken no scheduler step: rate 0; step 5 has taken 4 of 4.
            check(
                &schedule(kind, 4, 10, 0.0),
                &[(1, 0.0), (2, 0.125), (3, 0.25), (4, 0.375), (5, 0.5)],
            );
        }
        check(&schedule(Constant, 0, 10, 0.0), &[(1, 0.5), (1000, 0.5)]);
    }

    #[test]
    fn linear_and_cosine_decay_to_the_minimum_at_the_decay_steps() {
        use LrScheduleKind::*;
        // Warmup 2, decay 10: 8 decay steps, so step 7 (6 scheduler steps) is halfway.
        check(
            &schedule(Linear, 2, 10, 0.0),
            &[(3, 0.5), (7, 0.25), (11, 0.0), (20, 0.0)],
        );
        check(
            &schedule(Cosine, 2, 10, 0.0),
            &[(3, 0.5), (7, 0.25), (11, 0.0)],
        );
        // With a minimum of 0.1 the factor spans [0.2, 1]: halfway is 0.3, the end 0.1.
        check(
            &schedule(Linear, 2, 10, 0.1),
            &[(1, 0.0), (3, 0.5), (7, 0.3), (11, 0.1), (20, 0.1)],
        );
        check(&schedule(Cosine, 2, 10, 0.1), &[(7, 0.3), (11, 0.1)]);
        // Past the decay, transformers' cosine rises again; the linear one does not.
        check(&schedule(Cosine, 0, 4, 0.0), &[(7, 0.25), (9, 0.5)]);
    }

    #[test]
    fn degenerate_lengths_divide_by_at_least_one() {
        use LrScheduleKind::*;
        // transformers' `max(1, ...)` guards: no warmup, no decay, warmup past the decay.
        check(&schedule(Linear, 0, 0, 0.0), &[(1, 0.0), (2, 0.0)]);
        check(&schedule(Cosine, 0, 0, 0.0), &[(1, 0.5)]);
        check(&schedule(Linear, 5, 3, 0.0), &[(5, 0.4), (6, 0.0)]);
        check(
            &schedule(Linear, 0, u64::MAX, 0.0),
            &[(1, 0.5), (u64::MAX, 0.5 / u64::MAX as f64)],
        );
    }

    #[test]
    fn invalid_schedules_say_which_setting_is_wrong() {
        use crate::error::LrScheduleProblem as P;
        use LrScheduleKind::*;
        let err = |kind, peak, min_lr| match LrSchedule::new(kind, peak, 0, 10, min_lr) {
            Err(RuntimeError::InvalidLrSchedule(problem)) => problem,
            other => panic!("not a schedule problem: {other:?}"),
        };
        assert_eq!(
            err(Linear, 0.1, 0.2),
            P::MinLr {
                min_lr: 0.2,
                peak: 0.1
            }
        );
        assert_eq!(
            err(Linear, 0.1, -1.0),
            P::MinLr {
                min_lr: -1.0,
                peak: 0.1
            }
        );
        assert!(matches!(err(Linear, f64::NAN, 0.0), P::Peak { peak } if peak.is_nan()));
        assert_eq!(
            err(Constant, 0.1, 0.01),
            P::MinLrWithoutDecay { min_lr: 0.01 }
        );
        let flags = RunFlags {
            decay_steps: Some(5),
            ..RunFlags::default()
        };
        let e = flags.fresh(0.1).unwrap_err().to_string();
        assert!(
            e.contains("decay_steps 5 applies to the linear and cosine"),
            "{e}"
        );
    }

    #[test]
    fn resuming_takes_the_checkpoints_settings_and_refuses_contradictions() {
        let saved = RunFlags {
            steps: Some(10),
            lr_schedule: Some(LrScheduleKind::Cosine),
            warmup_steps: Some(2),
            seed: Some(3),
            ..RunFlags::default()
        }
        .fresh(0.01)
        .unwrap();
        assert_eq!(
            saved.lr_schedule.decay_steps, 10,
            "the decay defaults to the steps"
        );
        let path = Path::new("ckpt/step-00000004.safetensors");
        let alone = RunFlags::default().resume(&saved, path).unwrap();
        assert_eq!(alone, saved);
        // More steps extend the run; the decay keeps its length.
        let longer = RunFlags {
            steps: Some(20),
            ..RunFlags::default()
        }
        .resume(&saved, path)
        .unwrap();
        assert_eq!(longer.steps, 20);
        assert_eq!(longer.lr_schedule, saved.lr_schedule);
        // Repeating the checkpoint's values is no contradiction.
        let same = RunFlags {
            warmup_steps: Some(2),
            seed: Some(3),
            ..RunFlags::default()
        };
        assert_eq!(same.resume(&saved, path).unwrap(), saved);
        let contrary = RunFlags {
            lr_schedule: Some(LrScheduleKind::Linear),
            warmup_steps: Some(5),
            seed: Some(4),
            ..RunFlags::default()
        };
        let e = contrary.resume(&saved, path).unwrap_err().to_string();
        for needle in [
            "lr_schedule: the checkpoint has cosine, this run has linear",
            "warmup_steps: the checkpoint has 2, this run has 5",
            "seed: the checkpoint has 3, this run has 4",
            "settings left out are taken from the checkpoint",
        ] {
            assert!(e.contains(needle), "no `{needle}` in: {e}");
        }
        assert!(!e.contains("--"), "the library names a flag: {e}");
    }
}
