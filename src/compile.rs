//! Compiling a model for a machine: the facade over the compiler's pipeline and search.

use crate::{Error, Result};
use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::fuse::{FuseLimits, FuseReport};
use protrain_compiler::pipeline::{chunked, compile_policy, fused, training_graph};
use protrain_compiler::search::{search, SearchOptions, SearchReport};
use protrain_compiler::simulate::{simulate, Simulation};
use protrain_compiler::OptimizerConfig;
use protrain_ir::{BlockMode, DType, HardwareProfile, Policy, Schedule};
use protrain_models::{BuildOptions, ModelConfig};
use std::time::Instant;

/// Which policy to compile.
#[derive(Clone, Debug, PartialEq)]
pub enum PolicyChoice {
    /// Search for the fastest that fits.
    Auto,
    /// This one, given as `key=value` pairs (see [`PolicyChoice::parse`]).
    Fixed(Vec<(String, String)>),
}

impl PolicyChoice {
    /// Parses `auto` or `key=value,...` with keys `n_persist`, `n_buffer`, `n_swap`,
    /// `n_checkpoint`, `blocks` (one of K, C, S per layer) and `prefetch`.
    pub fn parse(text: &str) -> Result<Self> {
        if text.trim() == "auto" {
            return Ok(Self::Auto);
        }
        let mut pairs = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                return Err(Error::Usage(format!(
                    "policy part '{part}' is not key=value; write e.g. n_persist=4,n_buffer=2,n_checkpoint=8 or auto"
                )));
            };
            let key = k.trim();
            const KEYS: [&str; 6] = [
                "n_persist",
                "n_buffer",
                "n_swap",
                "n_checkpoint",
                "blocks",
                "prefetch",
            ];
            if !KEYS.contains(&key) {
                return Err(Error::Usage(format!(
                    "unknown policy key '{key}'; the keys are {}",
                    KEYS.join(", ")
                )));
            }
            pairs.push((key.to_string(), v.trim().to_string()));
        }
        Ok(Self::Fixed(pairs))
    }

    /// The policy for a model with `chunks` chunks and `layers` layers. Unset keys default to
    /// everything persistent and kept; `n_buffer` defaults to 2 when something is streamed.
    pub fn resolve(&self, chunks: u32, layers: usize) -> Result<Option<Policy>> {
        let Self::Fixed(pairs) = self else {
            return Ok(None);
        };
        let get = |key: &str| {
            pairs
                .iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let num = |key: &str| -> Result<Option<u64>> {
            get(key)
                .map(|v| {
                    v.parse::<u64>().map_err(|_| {
                        Error::Usage(format!("policy {key}={v} is not a whole number"))
                    })
                })
                .transpose()
        };
        let n_persist = num("n_persist")?.unwrap_or(u64::from(chunks));
        if n_persist > u64::from(chunks) {
            return Err(Error::Usage(format!(
                "n_persist={n_persist} but the model has {chunks} chunks"
            )));
        }
        let n_persist = n_persist as u32;
        let n_buffer = num("n_buffer")?.map_or(
            if n_persist < chunks {
                2.min(chunks - n_persist)
            } else {
                0
            },
            |v| v as u32,
        );
        let blocks = match get("blocks") {
            Some(letters) => {
                let modes: Result<Vec<BlockMode>> = letters
                    .chars()
                    .map(|c| match c.to_ascii_uppercase() {
                        'K' => Ok(BlockMode::Keep),
                        'C' => Ok(BlockMode::Checkpoint),
                        'S' => Ok(BlockMode::Swap),
                        other => Err(Error::Usage(format!(
                            "block mode '{other}' is not K (keep), C (checkpoint) or S (swap)"
                        ))),
                    })
                    .collect();
                let modes = modes?;
                if modes.len() != layers {
                    return Err(Error::Usage(format!(
                        "blocks={letters} has {} modes; the model has {layers} layers",
                        modes.len()
                    )));
                }
                modes
            }
            None => {
                let n_swap = num("n_swap")?.unwrap_or(0) as usize;
                let n_checkpoint = num("n_checkpoint")?.unwrap_or(0) as usize;
                if n_swap + n_checkpoint > layers {
                    return Err(Error::Usage(format!(
                        "n_swap + n_checkpoint = {} but the model has {layers} layers",
                        n_swap + n_checkpoint
                    )));
                }
                Policy::protrain(n_persist, n_buffer, n_swap, n_checkpoint, layers).blocks
            }
        };
        let prefetch = num("prefetch")?.unwrap_or(1) as u32;
        Ok(Some(Policy {
            n_persist,
            n_buffer,
            blocks,
            prefetch,
        }))
    }
}

/// What to compile for.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Sequences per step.
    pub batch: u64,
    /// Tokens per sequence.
    pub seq: u64,
    /// Element type of parameters and activations.
    pub dtype: DType,
    /// The machine (with any memory overrides applied).
    pub hardware: HardwareProfile,
    /// Device bytes allowed; default the profile's usable device memory.
    pub device_budget: Option<u64>,
    /// The policy.
    pub policy: PolicyChoice,
    /// The optimizer the schedule runs.
    pub optimizer: OptimizerConfig,
    /// Whether to fuse the forward graph first (see [`protrain_compiler::fuse`]); fusion
    /// changes no result, only speed.
    pub fuse: bool,
}

/// A compiled schedule and how it came about.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The schedule, with its predicted time filled in.
    pub schedule: Schedule,
    /// The search report, when the policy was searched for.
    pub report: Option<SearchReport>,
    /// The fusion report, when the graph was fused.
    pub fusion: Option<FuseReport>,
    /// The simulation of the schedule.
    pub simulation: Simulation,
    /// Seconds the compilation took.
    pub compile_seconds: f64,
}

/// Compiles a model: builds its forward graph, fuses it (unless told not to) and derives the
/// training graph, then searches for the fastest policy that fits (or applies the one given),
/// plans memory and simulates the result.
pub fn compile(config: &ModelConfig, options: &CompileOptions) -> Result<Compiled> {
    let started = Instant::now();
    let build = BuildOptions::new(options.batch, options.seq).with_dtype(options.dtype);
    let cost = protrain_compiler::cost::cost_model(&options.hardware);
    let mut forward = protrain_models::build_forward(config, &build)?;
    let mut fusion = None;
    if options.fuse {
        let (graph, report) = fused(&forward, cost.as_ref(), &FuseLimits::default())?;
        forward = graph;
        fusion = Some(report);
    }
    let training = training_graph(&forward, &options.optimizer)?;
    let chunks = chunked(&training);
    let layers = training
        .blocks()
        .filter(|(_, b)| matches!(b.kind, protrain_ir::BlockKind::Layer(_)))
        .count();
    let device_budget = options
        .device_budget
        .unwrap_or_else(|| options.hardware.usable_device_bytes());
    let host_budget = options.hardware.host_memory_bytes;
    let (mut schedule, report) = match options.policy.resolve(chunks.len() as u32, layers)? {
        None => {
            let search_options = SearchOptions {
                device_budget,
                host_budget,
                max_compiled: 64,
                hardware: options.hardware.summary(),
                model: config.name.clone(),
            };
            let (s, r) = search(&training, &chunks, cost.as_ref(), &search_options)?;
            (s, Some(r))
        }
        Some(policy) => {
            let header = HeaderInputs {
                model: config.name.clone(),
                hardware: options.hardware.summary(),
                device_budget_bytes: device_budget,
                host_budget_bytes: host_budget,
                report: format!("policy given: {policy}"),
            };
            let s = compile_policy(&training, &chunks, &policy, header)?;
            if s.arena_bytes > device_budget {
                return Err(Error::Usage(format!(
                    "policy {policy} needs {} of device memory, more than the {} budget; use --policy auto or a larger --gpu-memory",
                    protrain_ir::format_bytes(s.arena_bytes),
                    protrain_ir::format_bytes(device_budget)
                )));
            }
            (s, None)
        }
    };
    protrain_ir::verify_schedule::verify_schedule(&schedule)
        .map_err(protrain_compiler::CompileError::from)?;
    let simulation = simulate(&schedule, cost.as_ref())
        .map_err(|e| Error::Usage(format!("internal error: {e}")))?;
    schedule.header.prediction.step_seconds = simulation.step_seconds;
    schedule.header.prediction.stream_busy_seconds = simulation.stream_busy_seconds.clone();
    if let Some(fusion) = &fusion {
        schedule.header.report = format!("{}{}", fusion.to_text(), schedule.header.report);
    }
    Ok(Compiled {
        schedule,
        report,
        fusion,
        simulation,
        compile_seconds: started.elapsed().as_secs_f64(),
    })
}
