//! A training run's settings (steps, learning-rate schedule, seed, data) and how the flags a
//! user gives become them: filled with defaults for a new run, reconciled with a
//! checkpoint's for a resumed one.

use crate::error::{Difference, LrScheduleProblem, Result, RuntimeError, Setting};
use crate::loss_scale::LossScaleSettings;
use crate::lr_schedule::{LrSchedule, LrScheduleKind};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Steps a run takes when `--steps` is not given.
pub const DEFAULT_STEPS: u64 = 200;

/// Everything a training run is besides its schedule and weights: what a checkpoint records,
/// so that a resumed run goes on as the original would have.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// Optimizer steps the run takes in all (counting steps taken before a resume).
    pub steps: u64,
    /// The learning rate of each step.
    pub lr_schedule: LrSchedule,
    /// The seed of the random initialisation and of the synthetic corpus.
    pub seed: u64,
    /// The token file, as an absolute path; `None` for the built-in synthetic corpus.
    pub data: Option<PathBuf>,
    /// The loss scaler's settings when a flag set them (an f16 run otherwise takes
    /// GradScaler's defaults, [`LossScaleSettings::default`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScaleSettings>,
    /// Steps between checkpoints, when the run writes them: a run resumed without
    /// `--save-every` goes on saving as often (checkpoints written before it was recorded
    /// lack it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_every: Option<u64>,
    /// [`crate::data::TokenStream::sample_checksum`] of the token file, so a resumed run can tell a file
    /// replaced by another of the same length (checkpoints written before it was recorded,
    /// and runs on the synthetic corpus, lack it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_checksum: Option<String>,
}

impl RunSettings {
    /// What the run trains on, for messages: the token file, or "the synthetic corpus".
    pub fn data_name(&self) -> String {
        self.data
            .as_ref()
            .map_or("the synthetic corpus".into(), |p| p.display().to_string())
    }

    /// Warnings about a run with these settings that goes on from step `first` (0 for a
    /// new run; `resumed` when it continues a checkpoint, whose schedule it cannot change):
    /// a warmup longer than the run, and a run that goes past the end of its decay, where
    /// transformers' cosine rises again and the linear schedule stays at its minimum.
    pub fn warnings(&self, first: u64, resumed: bool) -> Vec<String> {
        let s = &self.lr_schedule;
        let steps = self.steps;
        let mut out = Vec::new();
        if s.warmup_steps > steps {
            out.push(format!(
                "warning: --warmup-steps {} is more than --steps {steps}: the run ends while the \
                 learning rate still warms up (step {steps} trains at {:.3e}, not --lr {}); \
                 give fewer warmup steps or more steps",
                s.warmup_steps,
                s.lr(steps),
                s.peak
            ));
        }
        if s.kind != LrScheduleKind::Constant && steps > s.decay_steps && steps > first {
            let end = s.decay_steps;
            let after = match s.kind {
                LrScheduleKind::Cosine => format!(
                    "from step {} transformers' cosine rises again, to {:.3e} at step {steps}",
                    end + 1,
                    s.lr(steps)
                ),
                _ => format!("steps {}..={steps} stay at --min-lr {}", end + 1, s.min_lr),
            };
            let way_out = match resumed {
                true => format!(
                    "a resumed run keeps its schedule: stop at --steps {end}, or start a new \
                     run from the checkpoint with --init DIR and a schedule of its own"
                ),
                false => format!("give --decay-steps {steps} to decay over the whole run"),
            };
            out.push(format!(
                "warning: the run goes on to step {steps}, past the end of its {} schedule at \
                 step {end} (--decay-steps): {after}; {way_out}",
                s.kind
            ));
        }
        out
    }
}

/// Run settings as a user gives them: `None` for a flag left out. A fresh run fills the gaps
/// with defaults ([`RunFlags::fresh`]); a resumed one with the checkpoint's settings, and a
/// flag that contradicts them is an error ([`RunFlags::resume`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunFlags {
    /// `--steps`: optimizer steps in all.
    pub steps: Option<u64>,
    /// `--lr-schedule`.
    pub lr_schedule: Option<LrScheduleKind>,
    /// `--warmup-steps`.
    pub warmup_steps: Option<u64>,
    /// `--decay-steps`.
    pub decay_steps: Option<u64>,
    /// `--min-lr`.
    pub min_lr: Option<f64>,
    /// `--seed`.
    pub seed: Option<u64>,
    /// `--data`.
    pub data: Option<PathBuf>,
    /// `--loss-scale-init`.
    pub loss_scale_init: Option<f64>,
    /// `--loss-scale-growth-interval`.
    pub loss_scale_growth_interval: Option<u64>,
}

impl RunFlags {
    /// The settings of a new run whose schedule was compiled with learning rate `peak`:
    /// [`DEFAULT_STEPS`] steps, the constant schedule without warmup, seed 0 and the
    /// synthetic corpus unless given; `--decay-steps` defaults to the steps.
    pub fn fresh(&self, peak: f64) -> Result<RunSettings> {
        let steps = self.steps.unwrap_or(DEFAULT_STEPS);
        let kind = self.lr_schedule.unwrap_or(LrScheduleKind::Constant);
        self.check_applies(kind)?;
        let lr_schedule = LrSchedule::new(
            kind,
            peak,
            self.warmup_steps.unwrap_or(0),
            self.decay_steps.unwrap_or(steps),
            self.min_lr.unwrap_or(0.0),
        )?;
        Ok(RunSettings {
            steps,
            lr_schedule,
            seed: self.seed.unwrap_or(0),
            data: self.data.as_deref().map(absolute),
            loss_scale: self.loss_scale(None)?,
            save_every: None,
            data_checksum: None,
        })
    }

    /// The loss scaler's settings the flags give, over `saved` (a resumed run's) or the
    /// defaults; `None` when neither flag is given and nothing was saved. Fails on a
    /// setting that cannot train.
    fn loss_scale(&self, saved: Option<LossScaleSettings>) -> Result<Option<LossScaleSettings>> {
        if self.loss_scale_init.is_none() && self.loss_scale_growth_interval.is_none() {
            return Ok(saved);
        }
        let base = saved.unwrap_or_default();
        let settings = LossScaleSettings {
            init: self.loss_scale_init.unwrap_or(base.init),
            growth_interval: self
                .loss_scale_growth_interval
                .unwrap_or(base.growth_interval),
        };
        settings.validate()?;
        Ok(Some(settings))
    }

    /// The settings of a run resumed from the checkpoint at `path`, which was written with
    /// `saved`: every flag left out takes the checkpoint's value. `--steps` may differ (it is
    /// how a finished run is extended; the decay keeps its length); any other flag that
    /// differs is an error naming each contradiction. A token file that was moved may be
    /// named again with `--data` where the checkpoint's path no longer exists.
    pub fn resume(&self, saved: &RunSettings, path: &Path) -> Result<RunSettings> {
        let was = &saved.lr_schedule;
        let kind = self.lr_schedule.unwrap_or(was.kind);
        self.check_applies(kind)?;
        let mut differences = Vec::new();
        let differ = |setting: Setting, checkpoint: String, run: String| Difference::Setting {
            setting,
            checkpoint,
            run,
        };
        if kind != was.kind {
            differences.push(differ(
                Setting::LrSchedule,
                was.kind.to_string(),
                kind.to_string(),
            ));
        }
        let warmup = self.warmup_steps.unwrap_or(was.warmup_steps);
        if warmup != was.warmup_steps {
            differences.push(differ(
                Setting::WarmupSteps,
                was.warmup_steps.to_string(),
                warmup.to_string(),
            ));
        }
        let decay = self.decay_steps.unwrap_or(was.decay_steps);
        if decay != was.decay_steps && kind != LrScheduleKind::Constant {
            differences.push(differ(
                Setting::DecaySteps,
                was.decay_steps.to_string(),
                decay.to_string(),
            ));
        }
        let min_lr = self.min_lr.unwrap_or(was.min_lr);
        if min_lr != was.min_lr {
            differences.push(differ(
                Setting::MinLr,
                was.min_lr.to_string(),
                min_lr.to_string(),
            ));
        }
        let seed = self.seed.unwrap_or(saved.seed);
        if seed != saved.seed {
            differences.push(differ(
                Setting::Seed,
                saved.seed.to_string(),
                seed.to_string(),
            ));
        }
        let data = match (&saved.data, &self.data) {
            (saved_data, None) => saved_data.clone(),
            (None, Some(given)) => {
                differences.push(Difference::DataOverSynthetic {
                    path: given.clone(),
                });
                None
            }
            (Some(theirs), Some(given)) => {
                let ours = absolute(given);
                if ours != *theirs && theirs.exists() {
                    differences.push(differ(
                        Setting::Data,
                        theirs.display().to_string(),
                        ours.display().to_string(),
                    ));
                }
                Some(ours)
            }
        };
        let saved_scale = saved.loss_scale;
        let loss_scale = self.loss_scale(saved_scale)?;
        if let (Some(ours), theirs) = (loss_scale, saved_scale.unwrap_or_default()) {
            if ours.init != theirs.init {
                differences.push(differ(
                    Setting::LossScaleInit,
                    theirs.init.to_string(),
                    ours.init.to_string(),
                ));
            }
            if ours.growth_interval != theirs.growth_interval {
                differences.push(differ(
                    Setting::LossScaleGrowthInterval,
                    theirs.growth_interval.to_string(),
                    ours.growth_interval.to_string(),
                ));
            }
        }
        if !differences.is_empty() {
            return Err(RuntimeError::CheckpointMismatch {
                path: path.to_path_buf(),
                differences,
            });
        }
        if let Some(data) = data.as_ref().filter(|d| !d.exists()) {
            return Err(RuntimeError::RunDataMissing {
                checkpoint: path.to_path_buf(),
                data: data.clone(),
            });
        }
        Ok(RunSettings {
            steps: self.steps.unwrap_or(saved.steps),
            lr_schedule: LrSchedule::new(kind, was.peak, warmup, decay, min_lr)?,
            seed,
            data,
            loss_scale,
            save_every: saved.save_every,
            data_checksum: saved.data_checksum.clone(),
        })
    }

    /// Fails when a flag is given that the schedule `kind` does not use.
    fn check_applies(&self, kind: LrScheduleKind) -> Result<()> {
        if kind != LrScheduleKind::Constant {
            return Ok(());
        }
        if let Some(decay_steps) = self.decay_steps {
            return Err(RuntimeError::InvalidLrSchedule(
                LrScheduleProblem::DecayWithoutDecay { decay_steps },
            ));
        }
        match self.min_lr {
            Some(min_lr) if min_lr != 0.0 => Err(RuntimeError::InvalidLrSchedule(
                LrScheduleProblem::MinLrWithoutDecay { min_lr },
            )),
            _ => Ok(()),
        }
    }
}

/// `path` made absolute (against the current directory, symbolic links left as they are), so
/// a resumed run finds it from any directory; as given when there is no current directory.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
