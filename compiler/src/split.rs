//! Micro-batch split: how a step's rows are cut into micro-batches of B rows accumulated K
//! times, compiled whole for each split tried.
//!
//! [`compile_split`] wraps [`crate::pipeline::compile`]. [`Split::Exact`] compiles the
//! options as given. [`Split::IfNeeded`] compiles `batch` rows in one micro-batch and, only
//! when no policy fits the budgets, the fewest micro-batches (K dividing the batch) that do.
//! [`Split::Global`] compiles every split `B x K x ranks = rows` (B among the divisors of
//! the rows per rank) and keeps the one the simulation predicts fastest, so the CPU Adam,
//! paid once per step, is amortised over K micro-batches where that is faster. Every split
//! of a step reads the same rows in the same order (the data loader cuts a step's rows into
//! micro-batches in order), so they train alike up to rounding. The choice and the times of
//! the splits tried go at the head of the schedule's report ([`SplitReport::to_text`]).
//!
//! It does not search splits for a forward-only (evaluation) compilation, which has no
//! optimizer step to accumulate for, nor reorder rows.

use crate::error::{CompileError, Result};
use crate::pipeline::{compile, CompileOptions, Compiled};
use crate::simulate::category;
use protrain_ir::format_bytes;
use protrain_models::ModelConfig;

/// How to cut a step's rows into micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// `batch` rows a micro-batch, `micro_batches` of them, exactly as the options say.
    Exact,
    /// `batch` rows a step in one micro-batch when that fits the budgets; otherwise the
    /// fewest micro-batches of `batch / K` rows (K dividing `batch`) that fit, accumulated.
    /// The options' `micro_batches` must be 1.
    IfNeeded,
    /// `rows` rows a step over all ranks: the split `B x K x ranks = rows` with the fastest
    /// predicted step. The options' `batch` and `micro_batches` are ignored.
    Global {
        /// Rows per optimizer step, over all ranks.
        rows: u64,
    },
}

/// One split compiled: its micro-batch rows and count, and its predicted step (none when
/// no policy fits it).
#[derive(Clone, Debug, PartialEq)]
pub struct SplitTry {
    /// Rows of one micro-batch.
    pub batch: u64,
    /// Micro-batches per step on each rank.
    pub micro_batches: u64,
    /// The predicted step, when a policy fits.
    pub step: Option<StepTimes>,
}

/// Where a split's predicted step goes.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    /// The predicted step, in seconds (all micro-batches and the update).
    pub seconds: f64,
    /// Busy seconds of the device's compute kernels, every micro-batch counted.
    pub compute: f64,
    /// Busy seconds of the CPU Adam (once a step, after the last micro-batch).
    pub cpu_adam: f64,
    /// The exact device peak, in bytes.
    pub peak_device_bytes: u64,
    /// The policy the search chose for the split, in its text form.
    pub policy: String,
}

impl StepTimes {
    fn of(compiled: &Compiled) -> Self {
        let sim = &compiled.simulation;
        let p = &sim.phase_seconds;
        // The timeline is one pass of the streams; the CPU Adam runs in the update, once.
        let cpu_adam = sim
            .timeline
            .iter()
            .filter(|s| s.category == category::CPU_ADAM)
            .map(|s| (s.end - s.start).max(0.0))
            .sum::<f64>();
        Self {
            seconds: sim.step_seconds,
            compute: p.forward + p.backward + p.recompute + p.optimizer,
            cpu_adam,
            peak_device_bytes: compiled.schedule.header.prediction.peak_device_bytes,
            policy: compiled.schedule.header.policy.to_string(),
        }
    }
}

/// Why a split was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitWhy {
    /// The whole batch did not fit the budgets in one micro-batch ([`Split::IfNeeded`]).
    DoesNotFit,
    /// The fastest predicted step of the splits of a global batch ([`Split::Global`]).
    Fastest,
}

/// The split chosen and the splits tried.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitReport {
    /// Rows per optimizer step over all ranks.
    pub rows: u64,
    /// Ranks sharing the rows.
    pub ranks: u64,
    /// Rows of the chosen micro-batch.
    pub batch: u64,
    /// Micro-batches per step on each rank, chosen.
    pub micro_batches: u64,
    /// Why this split.
    pub why: SplitWhy,
    /// The device budget the splits were compiled for, in bytes.
    pub device_budget: u64,
    /// Every split compiled, in the order tried.
    pub tried: Vec<SplitTry>,
}

/// `1 micro-batch of 8 rows`, `8 micro-batches of 1 row`.
fn split_words(k: u64, b: u64) -> String {
    format!(
        "{k} micro-batch{} of {b} row{}",
        if k == 1 { "" } else { "es" },
        if b == 1 { "" } else { "s" }
    )
}

impl SplitReport {
    /// The choice in words, one line, then the splits tried: `batch 8 does not fit 1.0 MiB:
    /// 8 micro-batches of 1 row, accumulated`, or `global batch 8: 1 micro-batch of 8 rows,
    /// the fastest predicted step of 4 splits (...)`.
    pub fn to_text(&self) -> String {
        let chosen = split_words(self.micro_batches, self.batch);
        let ranks = match self.ranks {
            1 => String::new(),
            r => format!(" on each of {r} ranks"),
        };
        let mut text = match self.why {
            SplitWhy::DoesNotFit => format!(
                "split: batch {} does not fit {}: {chosen}{ranks}, accumulated (the same rows \
                 in the same order a step)\n",
                self.rows / self.ranks.max(1),
                format_bytes(self.device_budget),
            ),
            SplitWhy::Fastest => {
                let fit = self.tried.iter().filter(|t| t.step.is_some()).count();
                format!(
                    "split: global batch {}: {chosen}{ranks}, the fastest predicted step of the \
                     {fit} split(s) that fit{}\n",
                    self.rows,
                    self.reason()
                )
            }
        };
        for t in &self.tried {
            let mark = match (t.batch, t.micro_batches) == (self.batch, self.micro_batches) {
                true => '*',
                false => ' ',
            };
            let line = match &t.step {
                Some(s) => format!(
                    "{:.4} s a step (compute {:.4} s, cpu adam {:.4} s), device peak {}, {}",
                    s.seconds,
                    s.compute,
                    s.cpu_adam,
                    format_bytes(s.peak_device_bytes),
                    s.policy
                ),
                None => format!("does not fit {}", format_bytes(self.device_budget)),
            };
            text += &format!(
                "  {mark} {:>4} x {:<5} {line}\n",
                t.micro_batches,
                format!("{} row{}", t.batch, if t.batch == 1 { "" } else { "s" }),
            );
        }
        text
    }

    /// Why the fastest split beat the one-micro-batch split, or the one-micro-batch split the
    /// others (`: ...`); nothing when only one split fits.
    fn reason(&self) -> String {
        let step = |t: &SplitTry| t.step.clone().map(|s| (t.batch, t.micro_batches, s));
        let whole = self
            .tried
            .iter()
            .find(|t| t.micro_batches == 1)
            .and_then(step);
        let chosen = self
            .tried
            .iter()
            .find(|t| (t.batch, t.micro_batches) == (self.batch, self.micro_batches))
            .and_then(step);
        let fastest_other = self
            .tried
            .iter()
            .filter(|t| t.micro_batches > 1)
            .filter_map(step)
            .min_by(|a, b| a.2.seconds.total_cmp(&b.2.seconds));
        match (whole, chosen) {
            (Some((b, _, w)), Some((_, k, c))) if k > 1 && c.policy == w.policy => format!(
                ": {:.4} s a step against {:.4} s for 1 micro-batch of {b} rows, both under \
                 policy {}; the step pays one CPU Adam ({:.4} s) however many micro-batches it \
                 has",
                c.seconds, w.seconds, c.policy, c.cpu_adam
            ),
            (Some((b, _, w)), Some((_, k, c))) if k > 1 => format!(
                ": {:.4} s a step against {:.4} s for 1 micro-batch of {b} rows; smaller \
                 micro-batches take less device memory for activations, which leaves room for \
                 policy {} where {b} rows take {}, and the step pays one CPU Adam ({:.4} s) \
                 however many micro-batches it has",
                c.seconds, w.seconds, c.policy, w.policy, c.cpu_adam
            ),
            (Some((_, _, w)), Some(_)) => match fastest_other {
                Some((b, k, s)) => format!(
                    ": {:.4} s a step, where the fastest of the other splits, {}, takes {:.4} s; \
                     each further micro-batch repeats the passes (and the transfers of \
                     streamed chunks) on fewer rows, and one CPU Adam is paid a step either way",
                    w.seconds,
                    split_words(k, b),
                    s.seconds
                ),
                None => String::new(),
            },
            _ => String::new(),
        }
    }
}

/// Whether `e` says the budgets are too small (a split may fit where the whole batch did not).
fn does_not_fit(e: &CompileError) -> bool {
    matches!(
        e,
        CompileError::BudgetTooSmall(_) | CompileError::PolicyOverDevice { .. }
    )
}

/// The divisors of `n`, ascending.
fn divisors(n: u64) -> Vec<u64> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Compiles `options` for `batch` rows a micro-batch, `k` micro-batches a step.
fn compile_at(
    config: &ModelConfig,
    options: &CompileOptions,
    batch: u64,
    k: u64,
) -> Result<Compiled> {
    let mut at = options.clone();
    at.batch = batch;
    at.micro_batches = k;
    compile(config, &at)
}

/// Compiles `config` under `options`, its step's rows cut into micro-batches as `split`
/// says; returns the compiled schedule and, when the split was chosen here (a batch that
/// did not fit, or a global batch), the report of the choice, also written at the head of
/// the schedule's report. [`Split::Exact`], and [`Split::IfNeeded`] where the batch fits,
/// compile exactly what [`compile`] does.
///
/// Fails with [`CompileError::GlobalBatchZero`] or
/// [`CompileError::GlobalBatchNotDivisible`] for a global batch of no rows or one the ranks
/// cannot share, [`CompileError::NoSplitFits`] when not even one-row micro-batches fit, and
/// with any other compile error as it is.
pub fn compile_split(
    config: &ModelConfig,
    options: &CompileOptions,
    split: Split,
) -> Result<(Compiled, Option<SplitReport>)> {
    let ranks = u64::from(options.topology.ranks());
    let (rows_per_rank, why) = match split {
        Split::Exact => return Ok((compile(config, options)?, None)),
        Split::IfNeeded if options.forward_only || options.micro_batches != 1 => {
            return Ok((compile(config, options)?, None))
        }
        Split::IfNeeded => match compile(config, options) {
            Err(e) if does_not_fit(&e) && options.batch > 1 => {
                (options.batch, SplitWhy::DoesNotFit)
            }
            done => return Ok((done?, None)),
        },
        Split::Global { rows: 0 } => return Err(CompileError::GlobalBatchZero),
        Split::Global { rows } if ranks == 0 || rows % ranks != 0 => {
            return Err(CompileError::GlobalBatchNotDivisible { rows, ranks })
        }
        Split::Global { rows } => (rows / ranks, SplitWhy::Fastest),
    };
    let mut tried = Vec::new();
    let mut best: Option<Compiled> = None;
    let mut last_refusal = None;
    // Micro-batch counts ascending: the fewest first.
    for k in divisors(rows_per_rank) {
        let batch = rows_per_rank / k;
        if why == SplitWhy::DoesNotFit && k == 1 {
            tried.push(SplitTry {
                batch,
                micro_batches: 1,
                step: None,
            });
            continue;
        }
        match compile_at(config, options, batch, k) {
            Ok(c) => {
                tried.push(SplitTry {
                    batch,
                    micro_batches: k,
                    step: Some(StepTimes::of(&c)),
                });
                let faster = best
                    .as_ref()
                    .is_none_or(|b| c.simulation.step_seconds < b.simulation.step_seconds);
                if faster {
                    best = Some(c);
                }
                if why == SplitWhy::DoesNotFit {
                    break;
                }
            }
            Err(e) if does_not_fit(&e) => {
                tried.push(SplitTry {
                    batch,
                    micro_batches: k,
                    step: None,
                });
                last_refusal = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    let Some(mut best) = best else {
        let source = last_refusal.expect("a split was tried and refused");
        return Err(CompileError::NoSplitFits {
            rows: rows_per_rank,
            source: Box::new(source),
        });
    };
    let header = &best.schedule.header;
    let report = SplitReport {
        rows: rows_per_rank * ranks,
        ranks,
        batch: header.batch,
        micro_batches: u64::from(best.schedule.micro_batches_per_step()),
        why,
        device_budget: options.device_budget(),
        tried,
    };
    let text = format!("{}{}", report.to_text(), best.schedule.header.report);
    *best.schedule.report_mut() = text;
    Ok((best, Some(report)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_ascend() {
        assert_eq!(divisors(1), vec![1]);
        assert_eq!(divisors(8), vec![1, 2, 4, 8]);
        assert_eq!(divisors(12), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(49), vec![1, 7, 49]);
    }

    #[test]
    fn split_words_count_rows() {
        assert_eq!(split_words(1, 8), "1 micro-batch of 8 rows");
        assert_eq!(split_words(8, 1), "8 micro-batches of 1 row");
    }
}
