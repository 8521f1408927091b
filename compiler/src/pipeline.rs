//! The pipeline: the passes in the order they run, each followed by the verifier.
//!
//! forward graph -> fuse -> autodiff (-> scale the loss gradient for K micro-batches) ->
//! training graph -> chunk (-> interleave, for K > 1 in the chunk-major order) ->
//! place(policy) (with movement) -> streams -> pad_rows -> plan -> emit
//! (-> accumulate, for K > 1) (-> data_parallel -> shard, for several ranks) (-> disk, where
//! the host region is over its budget) -> Schedule (-> carry, with a disk tier) -> verify ->
//! [`VerifiedSchedule`] -> simulate.
//!
//! A forward-only compilation ([`CompileOptions::forward_only`], for evaluation) skips
//! autodiff: the later passes take the fused forward graph as the "training" graph, and the
//! policy is searched by [`search_forward`] instead of [`search`].
//!
//! [`Context`] owns a compilation: it builds the model's forward graph and runs each pass in
//! turn, verifying the graph after every pass, keeping each stage's product so that a caller
//! (`protrain dump`) can stop at any stage and print it. Lowering one policy (`place..shard`)
//! is [`crate::lower`], which the searches also run for every candidate. The free functions
//! below run one stage each, with the verifier, for tests and tools that assemble stages
//! themselves.

use crate::accumulate::scale_loss_gradient;
use crate::autodiff::{autodiff, OptimizerConfig};
use crate::carry::carry;
use crate::chunk::{chunk, chunk_apart};
use crate::comm::Topology;
use crate::cost::{cost_model, CostModel};
use crate::emit::HeaderInputs;
use crate::error::{per_rank, CompileError, Result, SharedBudgets, Shortfall, ShortfallProblem};
use crate::fuse::{fuse, FuseLimits, FuseReport};
pub use crate::lower::{compile_policy, compile_policy_on};
use crate::lower::{lower_within, HostBudgets};
use crate::place::{place, Placed};
use crate::search::{search, SearchOptions, SearchReport};
use crate::search_forward::search_forward;
use crate::simulate::{simulate, Simulation};
use protrain_ir::verify::verify_graph;
use protrain_ir::verify_schedule::{verify, VerifiedSchedule};
use protrain_ir::{
    op_key, BlockKind, BlockMode, ChunkTable, DType, Graph, HardwareProfile, HostLayout, IrError,
    PolicySpec,
};
use protrain_models::{build_forward, BuildOptions, ModelConfig};
use std::time::Instant;

/// Which policy to compile.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum PolicyChoice {
    /// Search for the fastest that fits.
    #[default]
    Auto,
    /// This one; settings it leaves out take their defaults ([`PolicySpec::resolve`]).
    Fixed(PolicySpec),
}

impl PolicyChoice {
    /// Parses `auto`, or a policy in its text form ([`PolicySpec`]): `key=value` pairs
    /// separated by commas or spaces, which is also how a compiled schedule prints its policy.
    pub fn parse(text: &str) -> std::result::Result<Self, IrError> {
        if text.trim() == "auto" {
            return Ok(Self::Auto);
        }
        Ok(Self::Fixed(text.parse()?))
    }
}

/// What to compile for. [`CompileOptions::default`] is the host machine with the shape and
/// element type the host backend trains with; [`CompileOptions::for_hardware`] picks the
/// defaults for another machine.
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
    /// Whether to fuse the forward graph first (see [`crate::fuse`]); fusion changes no
    /// result, only speed.
    pub fuse: bool,
    /// Compile the forward pass alone, for evaluation: autodiff is skipped, so the schedule
    /// computes the loss and nothing else (no backward pass, no gradients, no optimizer, its
    /// parameters read-only). `optimizer` is then unused, and every layer is kept: with no
    /// backward pass there is nothing to swap or recompute.
    pub forward_only: bool,
    /// Micro-batches of `batch` sequences per optimizer step (gradient accumulation); 1 for
    /// none. See [`crate::accumulate`].
    pub micro_batches: u64,
    /// The ranks of a data-parallel run: GPUs per node and nodes ([`Topology::SINGLE`] for
    /// one GPU). Every rank runs the same schedule on its own rows; see
    /// [`crate::data_parallel`]. Checked against the hardware's interconnect.
    pub topology: Topology,
}

/// The batch, sequence length and element type a compilation defaults to on `hardware`:
/// 8 x 64 in f32 on the host (what its f32 kernels train quickly), 1 x 1024 in bf16 on a GPU.
/// Every command takes its defaults from here, so a schedule compiled with the defaults runs
/// with the defaults.
pub fn default_shape(hardware: &HardwareProfile) -> (u64, u64, DType) {
    if hardware.is_host() {
        (8, 64, DType::F32)
    } else {
        (1, 1024, DType::BF16)
    }
}

impl CompileOptions {
    /// The defaults for `hardware`: [`default_shape`], its whole usable memory, a searched
    /// policy, the default optimizer, fusion on.
    pub fn for_hardware(hardware: HardwareProfile) -> Self {
        let (batch, seq, dtype) = default_shape(&hardware);
        Self {
            batch,
            seq,
            dtype,
            hardware,
            device_budget: None,
            policy: PolicyChoice::Auto,
            optimizer: OptimizerConfig::default(),
            fuse: true,
            forward_only: false,
            micro_batches: 1,
            topology: Topology::SINGLE,
        }
    }

    /// The device bytes a schedule may use.
    pub fn device_budget(&self) -> u64 {
        self.device_budget
            .unwrap_or_else(|| self.hardware.usable_device_bytes())
    }
}

impl Default for CompileOptions {
    /// [`CompileOptions::for_hardware`] on this machine's `host` profile.
    fn default() -> Self {
        Self::for_hardware(HardwareProfile::host())
    }
}

/// A compiled schedule and how it came about.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The schedule, verified, with its predicted time filled in.
    pub schedule: VerifiedSchedule,
    /// The search report, when the policy was searched for.
    pub report: Option<SearchReport>,
    /// The fusion report, when the graph was fused.
    pub fusion: Option<FuseReport>,
    /// The simulation of the schedule.
    pub simulation: Simulation,
    /// Things the user should know that did not stop the compilation (a measured profile
    /// that lacks ops, so their times come from the roofline).
    pub warnings: Vec<String>,
    /// Seconds the compilation took.
    pub compile_seconds: f64,
}

/// The stages a [`Context`] can stop after, in pipeline order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// The forward graph the model builder lowers to.
    Forward,
    /// The forward graph after fusion (the same graph when fusion is off).
    Fused,
    /// The training graph: forward, backward and optimizer; in a forward-only compilation,
    /// the fused forward graph itself (autodiff is skipped).
    Autodiff,
    /// The training graph's chunk table.
    Chunked,
    /// The training graph placed under the chosen policy, with its movement ops. Choosing the
    /// policy compiles the schedule (a search compiles its candidates), so this stage also
    /// holds the schedule; [`Stage::Compiled`] alone does not keep the placed graph.
    Placed,
    /// The verified, simulated schedule.
    Compiled,
}

/// One compilation: the model, the options, the cost model, and each stage's product once
/// its pass has run. Every pass is followed by the verifier; placement is also checked by
/// translation validation in debug builds and tests (see [`compile_policy`]).
pub struct Context<'m> {
    config: &'m ModelConfig,
    options: CompileOptions,
    cost: Box<dyn CostModel + Send + Sync>,
    started: Instant,
    forward: Option<Graph>,
    fused: Option<Graph>,
    fusion: Option<FuseReport>,
    training: Option<Graph>,
    chunks: Option<ChunkTable>,
    compiled: Option<Compiled>,
    placed: Option<Placed>,
}

impl<'m> Context<'m> {
    /// A compilation of `config` under `options`; nothing runs until [`Context::run_until`]
    /// or [`Context::compile`].
    ///
    /// The topology is checked when the pipeline runs ([`Context::run_until`]).
    pub fn new(config: &'m ModelConfig, options: CompileOptions) -> Self {
        let cost = cost_model(&options.hardware);
        Self {
            config,
            options,
            cost,
            started: Instant::now(),
            forward: None,
            fused: None,
            fusion: None,
            training: None,
            chunks: None,
            compiled: None,
            placed: None,
        }
    }

    /// The options this compilation runs under.
    pub fn options(&self) -> &CompileOptions {
        &self.options
    }

    /// Runs every pass up to and including `stage` that has not run yet.
    pub fn run_until(&mut self, stage: Stage) -> Result<()> {
        self.options.topology.interconnect(&self.options.hardware)?;
        if self.forward.is_none() {
            check_compile_memory(self.config, memory_available())?;
            let build = BuildOptions::new(self.options.batch, self.options.seq)
                .with_dtype(self.options.dtype);
            let forward = build_forward(self.config, &build)?;
            verify_graph(&forward)?;
            self.forward = Some(forward);
        }
        let forward = self.forward.as_ref().expect("built above");
        if stage >= Stage::Fused && self.fused.is_none() {
            if self.options.fuse {
                let (graph, report) = fused(forward, self.cost.as_ref(), &FuseLimits::default())?;
                self.fused = Some(graph);
                self.fusion = Some(report);
            } else {
                self.fused = Some(forward.clone());
            }
        }
        if stage >= Stage::Autodiff && self.training.is_none() {
            let fused = self.fused.as_ref().expect("fused above");
            let ranks = self.options.topology.ranks();
            let training = if self.options.forward_only {
                if ranks > 1 {
                    return Err(CompileError::ForwardOnlyRanks {
                        gpus: self.options.topology.gpus,
                        nodes: self.options.topology.nodes,
                    });
                }
                if self.options.micro_batches > 1 {
                    return Err(CompileError::ForwardOnlyAccumulation {
                        micro_batches: self.options.micro_batches,
                    });
                }
                fused.clone()
            } else {
                let mut training = training_graph(fused, &self.options.optimizer)?;
                // The global batch is ranks x K micro-batches: each one's loss gradient is
                // scaled by its share, so the sum over ranks and micro-batches is the mean.
                scale_loss_gradient(&mut training, self.options.micro_batches * u64::from(ranks))?;
                verify_graph(&training)?;
                training
            };
            self.training = Some(training);
        }
        if stage >= Stage::Chunked && self.chunks.is_none() {
            self.chunks = Some(chunked(
                self.training.as_ref().expect("differentiated above"),
            ));
        }
        if stage >= Stage::Placed && self.compiled.is_none() {
            let compiled = match self.schedule() {
                Err(CompileError::BudgetTooSmall(why)) => self.schedule_apart(why)?,
                other => other?,
            };
            self.compiled = Some(compiled);
        }
        if stage == Stage::Placed && self.placed.is_none() {
            let training = self.training.as_ref().expect("differentiated above");
            let chunks = self.chunks.as_ref().expect("chunked above");
            let compiled = self.compiled.as_ref().expect("compiled above");
            let policy = &compiled.schedule.header.policy;
            // A chunk-major schedule placed the interleaved graph.
            let placed = match compiled.schedule.is_chunk_major() {
                true => place(&crate::interleave::interleave(training)?, chunks, policy)?,
                false => place(training, chunks, policy)?,
            };
            verify_graph(&placed.graph)?;
            self.placed = Some(placed);
        }
        Ok(())
    }

    /// Runs the whole pipeline and returns the verified, simulated schedule.
    pub fn compile(mut self) -> Result<Compiled> {
        self.run_until(Stage::Compiled)?;
        Ok(self.compiled.take().expect("compiled above"))
    }

    /// The forward graph, once built.
    pub fn forward(&self) -> Option<&Graph> {
        self.forward.as_ref()
    }

    /// The fused forward graph and the fusion report (none when fusion is off), once fused.
    pub fn fused(&self) -> Option<(&Graph, Option<&FuseReport>)> {
        self.fused.as_ref().map(|g| (g, self.fusion.as_ref()))
    }

    /// The training graph, once derived.
    pub fn training(&self) -> Option<&Graph> {
        self.training.as_ref()
    }

    /// The chunk table, once chunked.
    pub fn chunks(&self) -> Option<&ChunkTable> {
        self.chunks.as_ref()
    }

    /// The placed graph of the chosen policy, once run until [`Stage::Placed`].
    pub fn placed(&self) -> Option<&Placed> {
        self.placed.as_ref()
    }

    /// The compiled schedule, once run until [`Stage::Placed`] or [`Stage::Compiled`].
    pub fn compiled(&self) -> Option<&Compiled> {
        self.compiled.as_ref()
    }

    /// Where no policy fits the chunk table and a parameter is more than four times the
    /// layers' largest ([`chunk_apart`]), searches again with that parameter in a chunk of its
    /// own and the rest packed at the layers' scale, and keeps that table. Fails with `why`,
    /// the first search's refusal, where there is no such parameter, where the policy was given
    /// (it counts the first table's chunks), or where no policy fits the second table either.
    fn schedule_apart(&mut self, why: Box<Shortfall>) -> Result<Compiled> {
        let training = self.training.as_ref().expect("differentiated first");
        let apart = match self.options.policy {
            PolicyChoice::Auto => chunk_apart(training, 1),
            PolicyChoice::Fixed(_) => None,
        };
        let Some(apart) = apart else {
            return Err(CompileError::BudgetTooSmall(why));
        };
        let first = self.chunks.replace(apart);
        match self.schedule() {
            Ok(compiled) => Ok(compiled),
            Err(_) => {
                self.chunks = first;
                Err(CompileError::BudgetTooSmall(why))
            }
        }
    }

    /// Places, orders, plans and emits the schedule (searching for the policy or resolving
    /// the one given), verifies it, simulates it and fills in its prediction.
    fn schedule(&self) -> Result<Compiled> {
        let training = self
            .training
            .as_ref()
            .expect("run_until differentiates first");
        let chunks = self.chunks.as_ref().expect("run_until chunks first");
        let options = &self.options;
        let layers = training
            .blocks()
            .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
            .count();
        let device_budget = options.device_budget();
        // The ranks of a node share its host memory and disk: each may use its share.
        // (Offloaded chunks sharded over the ranks take 1/ranks of their host state on each.)
        let gpus = options.topology.gpus.max(1);
        let node_host = options.hardware.host_memory_bytes;
        let node_disk = options.hardware.disk.memory_bytes;
        let host_budget = per_rank(node_host, gpus);
        let disk_budget = per_rank(node_disk, gpus);
        // With several ranks a node, errors quote each rank's share; this adds the node's
        // figures as given, and the ways out that ranks open.
        let shared = |e: CompileError| match e {
            CompileError::BudgetTooSmall(mut shortfall) if gpus > 1 => {
                shortfall.shared = Some(SharedBudgets {
                    gpus,
                    node_host,
                    host_budget,
                    node_disk,
                    disk_budget,
                });
                CompileError::BudgetTooSmall(shortfall)
            }
            e => e,
        };
        let (mut schedule, report) = match &options.policy {
            PolicyChoice::Auto => {
                let search_options = SearchOptions {
                    device_budget,
                    host_budget,
                    disk_budget,
                    max_compiled: 64,
                    hardware: options.hardware.summary(),
                    model: self.config.name.clone(),
                    topology: options.topology,
                };
                let cost = self.cost.as_ref();
                let (s, r) = match options.forward_only {
                    true => search_forward(training, chunks, cost, &search_options)?,
                    false => search(training, chunks, cost, &search_options).map_err(&shared)?,
                };
                (s, Some(r))
            }
            PolicyChoice::Fixed(spec) => {
                let policy = spec.resolve(chunks.len() as u32, layers)?;
                if options.forward_only && policy.count(BlockMode::Keep) != layers {
                    return Err(CompileError::BadPolicy(format!(
                        "policy {policy} swaps or recomputes layers, but a forward-only \
                         schedule has no backward pass that would read them; drop n_swap, \
                         n_checkpoint and blocks= (every layer is kept)"
                    )));
                }
                let header = HeaderInputs {
                    model: self.config.name.clone(),
                    hardware: options.hardware.summary(),
                    device_budget_bytes: device_budget,
                    // Checked below, with the way out, before the header says it.
                    host_budget_bytes: u64::MAX,
                    report: format!("policy given: {policy}"),
                    flash_attention: self.cost.flash_attention(),
                };
                let budgets = HostBudgets {
                    host: host_budget,
                    disk: disk_budget,
                };
                let mut s =
                    lower_within(training, chunks, &policy, header, options.topology, budgets)
                        .map_err(&shared)?;
                if s.arena_bytes > device_budget {
                    return Err(CompileError::PolicyOverDevice {
                        policy: policy.to_string(),
                        need: s.arena_bytes,
                        budget: device_budget,
                    });
                }
                if s.host_bytes > host_budget {
                    return Err(shared(Shortfall::error(ShortfallProblem::PolicyOverHost {
                        policy: policy.to_string(),
                        need: s.host_bytes,
                        host_budget,
                        gpus,
                        full_layout: policy.host_layout == HostLayout::Full,
                        staged: matches!(policy.host_layout, HostLayout::Staged { .. }),
                        disk_budget,
                    })));
                }
                s.header.host_budget_bytes = host_budget;
                (s, None)
            }
        };
        if let Some(fusion) = &self.fusion {
            schedule.header.report = format!("{}{}", fusion.to_text(), schedule.header.report);
        }
        // The disk tier's last write-backs carried into the next step, where that shortens
        // the (steady-state) step: after the search, which ranks candidates without it.
        let schedule = carry(schedule, self.cost.as_ref());
        let mut schedule = verify(schedule)?;
        let simulation = simulate(&schedule, self.cost.as_ref())
            .map_err(|e| CompileError::Simulation(e.to_string()))?;
        let prediction = schedule.prediction_mut();
        prediction.step_seconds = simulation.step_seconds;
        prediction.stream_busy_seconds = simulation.stream_busy_seconds.clone();
        Ok(Compiled {
            warnings: unmeasured_ops(&options.hardware, &schedule.graph),
            schedule,
            report,
            fusion: self.fusion.clone(),
            simulation,
            compile_seconds: self.started.elapsed().as_secs_f64(),
        })
    }
}

/// Peak memory of a compile besides its per-layer part, in bytes (measured: see
/// [`COMPILE_LAYER_BYTES`]).
pub const COMPILE_BASE_BYTES: u64 = 160 << 20;

/// Peak memory of a compile per transformer layer, in bytes: the graphs, chunk table,
/// candidate schedules and simulation grow with the ops, a fixed number per layer, not with
/// the tensors' sizes (nothing is allocated for a tensor's data). Measured as the maximum
/// resident set (`/usr/bin/time -v`) of the release build's `protrain compile --dtype f32` of
/// a LLaMA config of hidden 64 and 4 heads on 2 cores: 64 layers 86 MiB, 256 170 MiB, 512
/// 332 MiB, 1,024 395 MiB, 2,048 743 MiB, 4,096 1,433 MiB (345 KiB per layer from 1,024 on);
/// hidden 1,024 with 16 heads took 445 MiB at 1,024 layers, and one thread 375 MiB. The
/// estimate, 160 MiB plus 384 KiB per layer, lies above every one of them.
pub const COMPILE_LAYER_BYTES: u64 = 384 << 10;

/// The estimated peak memory of compiling `config`: [`COMPILE_BASE_BYTES`] plus
/// [`COMPILE_LAYER_BYTES`] per layer.
pub fn compile_memory_estimate(config: &ModelConfig) -> u64 {
    COMPILE_BASE_BYTES.saturating_add(config.num_layers.saturating_mul(COMPILE_LAYER_BYTES))
}

/// Memory this process may still take, as `(bytes, whether its address-space limit set it)`:
/// the machine's available memory (`MemAvailable`), capped by the process's `ulimit -v`
/// (`RLIMIT_AS`); `None` when neither is known (not Linux).
pub fn memory_available() -> Option<(u64, bool)> {
    let field = |text: &str, key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| field(&t, "MemAvailable:"))
        .map(|kib| kib.saturating_mul(1024));
    // "Max address space  <soft> <hard> bytes"; "unlimited" does not parse.
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| field(&t, "Max address space"));
    match (machine, limit) {
        (Some(m), Some(l)) if l < m => Some((l, true)),
        (Some(m), _) => Some((m, false)),
        (None, Some(l)) => Some((l, true)),
        (None, None) => None,
    }
}

/// Fails, before anything is built, when compiling `config` would take more memory than
/// `available` ([`memory_available`]) by [`compile_memory_estimate`]: a config deep enough
/// (the parser takes up to 65,536 layers) would otherwise be killed part way, or abort.
/// `None` (not known) passes.
pub fn check_compile_memory(config: &ModelConfig, available: Option<(u64, bool)>) -> Result<()> {
    let need = compile_memory_estimate(config);
    match available {
        Some((available, limited)) if need > available => Err(CompileError::TooLargeToCompile {
            model: config.name.clone(),
            layers: config.num_layers,
            need,
            per_layer: COMPILE_LAYER_BYTES,
            available,
            limited,
        }),
        _ => Ok(()),
    }
}

/// Compiles a model under `options`: [`Context::compile`].
pub fn compile(config: &ModelConfig, options: &CompileOptions) -> Result<Compiled> {
    Context::new(config, options.clone()).compile()
}

/// A warning when `hardware` is a measured profile that lacks some of `graph`'s ops (their
/// times then come from the roofline, which can mislead the search); none for presets, which
/// measure nothing.
fn unmeasured_ops(hardware: &HardwareProfile, graph: &Graph) -> Vec<String> {
    if hardware.measured_ops.is_empty() {
        return Vec::new();
    }
    let mut missing: Vec<String> = graph
        .ops()
        .map(|(_, op)| {
            let inputs: Vec<_> = op.inputs.iter().map(|&v| &graph.value(v).ty).collect();
            op_key(&op.kind, &inputs)
        })
        .filter(|key| hardware.measured(key).is_none())
        .collect();
    missing.sort();
    missing.dedup();
    if missing.is_empty() {
        return Vec::new();
    }
    let shown: Vec<&str> = missing.iter().take(3).map(String::as_str).collect();
    vec![format!(
        "the profile `{}` has no measured time for {} of this graph's op shapes (e.g. {}), so \
         they are priced by the roofline; profile this model at this batch and sequence length \
         (`protrain profile MODEL --batch B --seq T -o PROFILE.json`) for measured times",
        hardware.name,
        missing.len(),
        shown.join(", ")
    )]
}

/// Fuses a forward graph under a cost model (see [`crate::fuse`]); the verifier runs before
/// and after.
pub fn fused(
    forward: &Graph,
    cost: &dyn CostModel,
    limits: &FuseLimits,
) -> Result<(Graph, FuseReport)> {
    verify_graph(forward)?;
    let (graph, report) = fuse(forward, cost, limits)?;
    verify_graph(&graph)?;
    Ok((graph, report))
}

/// Runs the passes from a forward graph to the training graph: autodiff (forward + backward +
/// optimizer). The verifier runs on the result.
pub fn training_graph(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    verify_graph(forward)?;
    let graph = autodiff(forward, optimizer)?;
    verify_graph(&graph)?;
    Ok(graph)
}

/// Chunks a training graph's parameters (one rank).
pub fn chunked(training: &Graph) -> ChunkTable {
    chunk(training, 1)
}
