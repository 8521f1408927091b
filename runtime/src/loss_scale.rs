//! Dynamic loss scaling for f16 training: torch.cuda.amp.GradScaler's rules.
//!
//! An f16 schedule computes its loss gradient at a scale `S` and unscales the gradients by
//! `1/S` in f32 before clipping and AdamW; a step whose gradients overflowed (an infinity or
//! a NaN anywhere) is skipped by its own AdamW ops. The [`LossScaler`] chooses `S` step by
//! step as GradScaler's `update()` does: it starts at `init` (GradScaler's `init_scale`,
//! 2^16), halves after every skipped step (`backoff_factor` 0.5) and doubles after
//! `growth_interval` consecutive clean steps (`growth_factor` 2, `growth_interval` 2000); the
//! scale is an f32, as GradScaler's is, and a doubling that would overflow f32 is not made.
//!
//! What this does not do: detect the overflow (the schedule's unscale coefficient does, and
//! the executor reports it) or decide the learning rate of a skipped step (the trainer keeps
//! the schedule where it was, as transformers' Trainer does not step its scheduler when the
//! optimizer step was skipped).

use crate::error::{LossScaleProblem, Result, RuntimeError};
use protrain_ir::{LOSS_SCALE_GROWTH_INTERVAL, LOSS_SCALE_INIT};
use serde::{Deserialize, Serialize};

/// A loss scaler's settings (`--loss-scale-init`, `--loss-scale-growth-interval`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaleSettings {
    /// The scale of the first step.
    pub init: f64,
    /// Consecutive clean steps after which the scale doubles.
    pub growth_interval: u64,
}

impl Default for LossScaleSettings {
    /// GradScaler's defaults: 2^16, doubled after 2000 clean steps.
    fn default() -> Self {
        Self {
            init: LOSS_SCALE_INIT,
            growth_interval: LOSS_SCALE_GROWTH_INTERVAL,
        }
    }
}

impl LossScaleSettings {
    /// Fails, naming the setting and the way out, unless the initial scale is a finite f32
    /// above 0 and the growth interval at least 1.
    pub fn validate(&self) -> Result<()> {
        let init = self.init;
        if !(init.is_finite() && init > 0.0 && (init as f32).is_finite() && init as f32 > 0.0) {
            return Err(RuntimeError::InvalidLossScale(LossScaleProblem::Init {
                init,
            }));
        }
        if self.growth_interval == 0 {
            return Err(RuntimeError::InvalidLossScale(
                LossScaleProblem::GrowthInterval,
            ));
        }
        Ok(())
    }
}

/// Where a loss scaler stands, and the AdamW steps its run applied: what a checkpoint records
/// so that a resumed run scales (and skips) as the original would have.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerState {
    /// The scale of the next step.
    pub scale: f64,
    /// Consecutive clean steps since the scale last changed (GradScaler's growth tracker).
    pub clean_steps: u64,
    /// AdamW steps applied: the steps taken less the skipped ones.
    pub updates: u64,
}

/// GradScaler's scale and growth tracker (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    growth_interval: u64,
    clean_steps: u64,
}

impl LossScaler {
    /// A scaler at `settings.init`, which [`LossScaleSettings::validate`] accepted.
    pub fn new(settings: LossScaleSettings) -> Self {
        Self {
            scale: settings.init as f32,
            growth_interval: settings.growth_interval,
            clean_steps: 0,
        }
    }

    /// A scaler where a checkpointed run's stood: its scale and growth tracker.
    pub fn restore(settings: LossScaleSettings, state: &ScalerState) -> Self {
        Self {
            scale: state.scale as f32,
            growth_interval: settings.growth_interval,
            clean_steps: state.clean_steps,
        }
    }

    /// The scale of the next step.
    pub fn scale(&self) -> f64 {
        f64::from(self.scale)
    }

    /// Consecutive clean steps since the scale last changed.
    pub fn clean_steps(&self) -> u64 {
        self.clean_steps
    }

    /// GradScaler's `update()` after a step: halves the scale when the step `skipped`
    /// (its gradients overflowed), else counts a clean step and doubles the scale after
    /// `growth_interval` of them in a row (unless the double would overflow f32).
    pub fn update(&mut self, skipped: bool) {
        if skipped {
            self.scale *= 0.5;
            self.clean_steps = 0;
            return;
        }
        self.clean_steps += 1;
        if self.clean_steps == self.growth_interval {
            let grown = self.scale * 2.0;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.clean_steps = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GradScaler's rules, step by step: halve and reset on overflow, double after the
    /// interval of clean steps, count again from zero after a change.
    #[test]
    fn scale_follows_gradscaler() {
        let mut s = LossScaler::new(LossScaleSettings {
            init: 1024.0,
            growth_interval: 3,
        });
        let mut seen = Vec::new();
        for skipped in [false, false, true, false, false, false, false, true, true] {
            s.update(skipped);
            seen.push((s.scale(), s.clean_steps()));
        }
        assert_eq!(
            seen,
            [
                (1024.0, 1),
                (1024.0, 2),
                (512.0, 0),
                (512.0, 1),
                (512.0, 2),
                (1024.0, 0),
                (1024.0, 1),
                (512.0, 0),
                (256.0, 0),
            ]
        );
    }

    #[test]
    fn growth_stops_short_of_f32_overflow() {
        let mut s = LossScaler::new(LossScaleSettings {
            init: f64::from(f32::MAX) / 1.5,
            growth_interval: 1,
        });
        let before = s.scale();
        s.update(false);
        assert_eq!(s.scale(), before, "a doubling past f32::MAX is not made");
        assert_eq!(s.clean_steps(), 0);
    }

    #[test]
    fn bad_settings_are_named_with_the_problem() {
        for (init, interval, problem) in [
            (0.0, 2000, LossScaleProblem::Init { init: 0.0 }),
            (1e300, 2000, LossScaleProblem::Init { init: 1e300 }),
            (65536.0, 0, LossScaleProblem::GrowthInterval),
        ] {
            let e = LossScaleSettings {
                init,
                growth_interval: interval,
            }
            .validate()
            .unwrap_err();
            match e {
                RuntimeError::InvalidLossScale(p) => assert_eq!(p, problem),
                e => panic!("{e}"),
            }
        }
        let nan = LossScaleSettings {
            init: f64::NAN,
            growth_interval: 1,
        };
        let e = nan.validate().unwrap_err().to_string();
        assert!(e.contains("loss_scale.init NaN"), "{e}");
        assert!(LossScaleSettings::default().validate().is_ok());
    }
}
