//! Learning-rate schedules: the rate of every optimizer step, after transformers'
//! `get_*_schedule_with_warmup`.

use crate::error::{LrScheduleProblem, Result, RuntimeError};
use serde::{Deserialize, Serialize};

/// The shape of a learning-rate schedule, after transformers' `get_*_schedule_with_warmup`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrScheduleKind {
    /// `get_constant_schedule_with_warmup`: a linear warmup from 0, then the peak.
    Constant,
    /// `get_linear_schedule_with_warmup`: a linear warmup, then a linear decay to the
    /// minimum at the end of the decay.
    Linear,
    /// `get_cosine_schedule_with_warmup` with `num_cycles = 0.5`: a linear warmup, then half
    /// a cosine down to the minimum at the end of the decay.
    Cosine,
}

impl LrScheduleKind {
    /// The name `--lr-schedule` takes.
    pub fn name(self) -> &'static str {
        match self {
            LrScheduleKind::Constant => "constant",
            LrScheduleKind::Linear => "linear",
            LrScheduleKind::Cosine => "cosine",
        }
    }
}

impl std::fmt::Display for LrScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A learning-rate schedule: the rate of every optimizer step, from its peak (the rate the
/// schedule's AdamW ops were compiled with).
///
/// With `min_lr = 0` the rate of step `s` (1-based) is exactly
/// `peak * lr_lambda(s - 1)` of transformers' `get_{constant,linear,cosine}_schedule_with_warmup`
/// (`num_cycles = 0.5`), computed in the same f64 operations, so it is the same bits as the
/// learning rate torch's `LambdaLR` hands AdamW at that step: the first `warmup_steps` steps
/// ramp up from 0 (the first step of a run with a warmup has rate 0), then the rate decays
/// over the remaining `decay_steps - warmup_steps` steps. With `min_lr > 0` the decay ends at
/// `min_lr` instead of 0: after the warmup the factor `f` in `[0, 1]` becomes
/// `f * (1 - min_lr / peak) + min_lr / peak`, which is transformers'
/// `get_cosine_with_min_lr_schedule_with_warmup(min_lr=...)` for the cosine, and the same
/// rescaling of the linear decay; the warmup still starts from 0.
///
/// Past `decay_steps` the linear schedule stays at its minimum; the cosine follows
/// transformers' formula, which rises again (half a cosine period is `decay_steps -
/// warmup_steps` steps): keep `decay_steps` at least the number of steps trained.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// The shape.
    pub kind: LrScheduleKind,
    /// The rate at the end of the warmup.
    pub peak: f64,
    /// Steps of linear warmup from 0.
    pub warmup_steps: u64,
    /// The schedule's length in steps, warmup included (transformers'
    /// `num_training_steps`): the rate reaches `min_lr` after this many steps; unused by the
    /// constant schedule.
    pub decay_steps: u64,
    /// The rate the decay ends at (0 in transformers); 0 for the constant schedule.
    pub min_lr: f64,
}

impl LrSchedule {
    /// The peak rate at every step, without warmup: what a schedule's AdamW ops do alone.
    pub fn constant(peak: f64) -> Self {
        Self {
            kind: LrScheduleKind::Constant,
            peak,
            warmup_steps: 0,
            decay_steps: 0,
            min_lr: 0.0,
        }
    }

    /// A schedule, checked: `peak` and `min_lr` finite and at least 0, `min_lr` at most
    /// `peak`, and `min_lr` 0 for the constant schedule (which never decays).
    pub fn new(
        kind: LrScheduleKind,
        peak: f64,
        warmup_steps: u64,
        decay_steps: u64,
        min_lr: f64,
    ) -> Result<Self> {
        let bad = |problem| Err(RuntimeError::InvalidLrSchedule(problem));
        if !(peak.is_finite() && peak >= 0.0) {
            return bad(LrScheduleProblem::Peak { peak });
        }
        if !(min_lr.is_finite() && min_lr >= 0.0 && min_lr <= peak) {
            return bad(LrScheduleProblem::MinLr { min_lr, peak });
        }
        if kind == LrScheduleKind::Constant && min_lr != 0.0 {
            return bad(LrScheduleProblem::MinLrWithoutDecay { min_lr });
        }
        Ok(Self {
            kind,
            peak,
            warmup_steps,
            decay_steps,
            min_lr,
        })
    }

    /// The factor the peak is multiplied by after `current_step` scheduler steps (0-based):
    /// transformers' `lr_lambda(current_step)`, with the `min_lr` rescaling after the warmup
    /// (see the type's doc).
    pub fn factor(&self, current_step: u64) -> f64 {
        // transformers computes in Python integers, which do not overflow or wrap; i128 holds
        // every difference of two u64.
        let (s, w, n) = (
            i128::from(current_step),
            i128::from(self.warmup_steps),
            i128::from(self.decay_steps),
        );
        if s < w {
            return s as f64 / w.max(1) as f64;
        }
        let decayed = match self.kind {
            LrScheduleKind::Constant => return 1.0,
            LrScheduleKind::Linear => (0.0f64).max((n - s) as f64 / (n - w).max(1) as f64),
            LrScheduleKind::Cosine => {
                let progress = (s - w) as f64 / (n - w).max(1) as f64;
                let cycles = 0.5;
                (0.0f64).max(0.5 * (1.0 + (std::f64::consts::PI * cycles * 2.0 * progress).cos()))
            }
        };
        if self.min_lr == 0.0 {
            // transformers' `factor * (1 - 0) + 0` is `factor`, bit for bit.
            return decayed;
        }
        let rate = self.min_lr / self.peak;
        decayed * (1.0 - rate) + rate
    }

    /// The learning rate of optimizer step `step` (1-based): `peak * factor(step - 1)`, as
    /// torch's `LambdaLR` sets it before the step (it has stepped `step - 1` times).
    pub fn lr(&self, step: u64) -> f64 {
        self.peak * self.factor(step.saturating_sub(1))
    }
}

impl std::fmt::Display for LrSchedule {
    /// `0.003 (constant)`, or `cosine from 0.01 to 0 after step 100, warming up from 0 over
    /// 10 steps`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            LrScheduleKind::Constant => write!(f, "{} (constant)", self.peak)?,
            kind => write!(
                f,
                "{kind} from {} to {} after step {}",
                self.peak, self.min_lr, self.decay_steps
            )?,
        }
        if self.warmup_steps > 0 {
            write!(f, ", warming up from 0 over {} steps", self.warmup_steps)?;
        }
        Ok(())
    }
}
