//! The compiler's error type.

use protrain_ir::{format_bytes, IrError, MemoryBreakdown};

/// Everything the compiler can reject.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The IR rejected a graph or op.
    #[error(transparent)]
    Ir(#[from] IrError),
    /// The model could not be built (boxed: model errors carry whole lists of fields).
    #[error(transparent)]
    Model(Box<protrain_models::ModelError>),
    /// A compiled schedule broke an invariant (a compiler bug).
    #[error(transparent)]
    Schedule(#[from] protrain_ir::verify_schedule::ScheduleError),
    /// Placement changed what the graph computes (a compiler bug).
    #[error("translation validation failed: {0}")]
    Validation(String),
    /// The forward graph has nothing to differentiate.
    #[error("the forward graph has no loss output; build it with a cross_entropy head")]
    NoLoss,
    /// A placement policy does not fit the model.
    #[error("bad policy: {0}")]
    BadPolicy(String),
    /// An op reads more offloaded chunks at once than the policy has chunk buffers.
    #[error(
        "bad policy: {op} reads {chunks} offloaded chunks at once but n_buffer is {n_buffer}; \
         use n_buffer >= {chunks}"
    )]
    TooFewBuffers {
        /// The op, with its output's name.
        op: String,
        /// Offloaded chunks it reads.
        chunks: u32,
        /// The policy's chunk buffers.
        n_buffer: u32,
    },
    /// No policy fits the budgets: the figures and the ways out ([`Shortfall`]), worded by
    /// [`Shortfall::text`] (the library names each budget by its [`Setting::field`], the CLI
    /// by its flag). Boxed: it carries whole policies' figures.
    #[error("{0}")]
    BudgetTooSmall(Box<Shortfall>),
    /// The simulator could not run a schedule (a compiler bug).
    #[error("simulation failed: {0}")]
    Simulation(String),
    /// An optimizer setting is out of range.
    #[error("{0}")]
    BadOptimizer(String),
    /// The GPUs and nodes asked for do not fit the hardware profile's interconnect.
    #[error("{0}")]
    BadTopology(String),
    /// A topology of no ranks: a count of GPUs per node or of nodes is 0.
    #[error("{gpus} GPUs per node and {nodes} nodes: both must be at least 1")]
    NoRanks {
        /// GPUs per node asked for.
        gpus: u32,
        /// Nodes asked for.
        nodes: u32,
    },
    /// More GPUs per node than the hardware profile's node has.
    #[error("{gpus} GPUs per node is more than the {per_node} GPUs of one {hardware} node")]
    TooManyGpus {
        /// GPUs per node asked for.
        gpus: u32,
        /// GPUs of one node of the profile.
        per_node: u32,
        /// The profile's name.
        hardware: String,
    },
    /// A step of no micro-batches.
    #[error("0 micro-batches per step: a step takes at least one")]
    NoMicroBatches,
    /// A forward-only (evaluation) compilation for several ranks.
    #[error(
        "{gpus} GPUs per node on {nodes} nodes for a forward-only schedule: evaluation runs          on one rank"
    )]
    ForwardOnlyRanks {
        /// GPUs per node asked for.
        gpus: u32,
        /// Nodes asked for.
        nodes: u32,
    },
    /// A forward-only (evaluation) compilation with gradient accumulation.
    #[error(
        "{micro_batches} micro-batches per step for a forward-only schedule: accumulation          splits a training step, and a forward-only schedule has none"
    )]
    ForwardOnlyAccumulation {
        /// Micro-batches per step asked for.
        micro_batches: u64,
    },
    /// A training graph whose loss gradient is scaled for a number of micro-batches the
    /// ranks cannot share evenly.
    #[error(
        "the loss gradient is scaled for {micro_batches} micro-batches, which {ranks} ranks \
         cannot share; scale it for ranks x micro-batches per rank"
    )]
    UnevenMicroBatches {
        /// Micro-batches the loss gradient is scaled for.
        micro_batches: u64,
        /// Ranks.
        ranks: u64,
    },
    /// A policy given whose exact arena is over the device budget.
    #[error(
        "policy {policy} needs {} of device memory, more than the {} of device memory per GPU",
        format_bytes(*need),
        format_bytes(*budget)
    )]
    PolicyOverDevice {
        /// The policy, in its text form.
        policy: String,
        /// Bytes of its arena.
        need: u64,
        /// Device bytes allowed per GPU.
        budget: u64,
    },
    /// A global batch of no rows ([`crate::split::Split::Global`]).
    #[error("a global batch of 0 rows: a step takes at least one row")]
    GlobalBatchZero,
    /// A global batch the ranks cannot share evenly.
    #[error("a global batch of {rows} rows cannot be shared evenly by {ranks} ranks")]
    GlobalBatchNotDivisible {
        /// Rows per step asked for.
        rows: u64,
        /// Ranks.
        ranks: u64,
    },
    /// Not even micro-batches of one row fit the budgets ([`crate::split::Split::IfNeeded`]).
    #[error(
        "batch {rows} does not fit even as {rows} micro-batches of 1 row, accumulated; at 1 \
         row: {source}"
    )]
    NoSplitFits {
        /// Rows per step on each rank.
        rows: u64,
        /// Why one-row micro-batches do not fit.
        source: Box<CompileError>,
    },
    /// The compile would take more memory than the machine has available
    /// ([`crate::pipeline::check_compile_memory`]).
    #[error(
        "compiling {model}'s {layers} layers would take about {} of memory ({} per layer), \
         but {} is available{limit}; compile a config with fewer layers (num_hidden_layers), \
         or on a machine with more free memory",
        protrain_ir::format_bytes(*need),
        protrain_ir::format_bytes(*per_layer),
        protrain_ir::format_bytes(*available),
        limit = if *limited { " to this process (ulimit -v)" } else { "" }
    )]
    TooLargeToCompile {
        /// The model.
        model: String,
        /// Its transformer layers.
        layers: u64,
        /// The estimated peak memory of the compile, in bytes.
        need: u64,
        /// The estimate's bytes per layer.
        per_layer: u64,
        /// The memory available, in bytes.
        available: u64,
        /// Whether the process's address-space limit, not the machine, set `available`.
        limited: bool,
    },
}

impl From<protrain_models::ModelError> for CompileError {
    fn from(e: protrain_models::ModelError) -> Self {
        Self::Model(Box::new(e))
    }
}

/// A setting of a compilation that an error names; the library words it by its field of
/// [`crate::CompileOptions`] ([`Setting::field`]), the CLI by the flag that sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// The device memory per GPU (`device_budget`).
    DeviceBudget,
    /// The host memory of a node (`hardware.host_memory_bytes`).
    HostBudget,
    /// The disk of a node for the disk tier (`hardware.disk.memory_bytes`).
    DiskBudget,
    /// The GPUs per node (`topology.gpus`).
    Gpus,
    /// The nodes (`topology.nodes`).
    Nodes,
    /// The placement policy (`policy`).
    Policy,
    /// The rows of one micro-batch (`batch`).
    Batch,
    /// The micro-batches of one step (`micro_batches`).
    MicroBatches,
    /// The sequence length (`seq`).
    Seq,
    /// Gradient clipping (`optimizer.grad_clip`).
    GradClip,
}

impl Setting {
    /// The setting's field of [`crate::CompileOptions`] (`device_budget`,
    /// `hardware.host_memory_bytes`, ...).
    pub fn field(self) -> String {
        match self {
            Setting::DeviceBudget => "device_budget",
            Setting::HostBudget => "hardware.host_memory_bytes",
            Setting::DiskBudget => "hardware.disk.memory_bytes",
            Setting::Gpus => "topology.gpus",
            Setting::Nodes => "topology.nodes",
            Setting::Policy => "policy",
            Setting::Batch => "batch",
            Setting::MicroBatches => "micro_batches",
            Setting::Seq => "seq",
            Setting::GradClip => "optimizer.grad_clip",
        }
        .to_string()
    }
}

/// Why no policy fits the budgets ([`CompileError::BudgetTooSmall`]): the problem, and with
/// several ranks a node, how the node's budgets are shared among them.
#[derive(Clone, Debug, PartialEq)]
pub struct Shortfall {
    /// What does not fit, with its figures and ways out.
    pub problem: ShortfallProblem,
    /// With several ranks a node, the node's budgets as given and each rank's share; the
    /// text adds them and the ways out that ranks open.
    pub shared: Option<SharedBudgets>,
}

impl Shortfall {
    /// The shortfall of `problem`, with no note on shared budgets.
    pub fn new(problem: ShortfallProblem) -> Self {
        Self {
            problem,
            shared: None,
        }
    }

    /// The error of `problem`.
    pub fn error(problem: ShortfallProblem) -> CompileError {
        CompileError::BudgetTooSmall(Box::new(Self::new(problem)))
    }

    /// The shortfall in words, each setting named by `name` ([`Setting::field`] in the
    /// library, the flag in the CLI).
    pub fn text(&self, name: &dyn Fn(Setting) -> String) -> String {
        let why = self.problem.text(name);
        let Some(shared) = &self.shared else {
            return why;
        };
        let (gpu, host, disk, gpus) = (
            name(Setting::DeviceBudget),
            name(Setting::HostBudget),
            name(Setting::DiskBudget),
            name(Setting::Gpus),
        );
        let disk_share = match shared.node_disk {
            0 => String::new(),
            d => format!(
                " and {disk} {} gives each {}",
                format_bytes(d),
                format_bytes(shared.disk_budget)
            ),
        };
        format!(
            "{why}. Budgets: {gpu} is per GPU; {host} and {disk} are per node, shared by its \
             ranks: {host} {} over {gpus} {} gives each rank {}{disk_share} (offloaded chunks \
             are sharded over all ranks, each keeping 1/ranks of their host state)",
            format_bytes(shared.node_host),
            shared.gpus,
            format_bytes(shared.host_budget),
        )
    }
}

impl std::fmt::Display for Shortfall {
    /// The shortfall in the library's words: each setting named by its field.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text(&Setting::field))
    }
}

/// A node's host memory and disk as given, shared by its ranks, and each rank's share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedBudgets {
    /// Ranks (GPUs) of the node.
    pub gpus: u32,
    /// The node's host memory.
    pub node_host: u64,
    /// Each rank's share of it.
    pub host_budget: u64,
    /// The node's disk for the disk tier (0: none).
    pub node_disk: u64,
    /// Each rank's share of it.
    pub disk_budget: u64,
}

/// What does not fit the budgets, with the figures the ways out need. Host and disk
/// figures are a rank's share unless a field says otherwise.
#[derive(Clone, Debug, PartialEq)]
pub enum ShortfallProblem {
    /// A sharded schedule whose host region is over budget even with each rank's shards of
    /// every offloaded chunk's optimizer state, and of its parameters and gradients where
    /// they can move, on disk.
    DiskSharded {
        /// Host bytes each rank needs so.
        host_need: u64,
        /// Offloaded (sharded) chunks whose state is on disk so.
        chunks: usize,
        /// Host bytes each rank has.
        host_budget: u64,
    },
    /// Even with the optimizer state and the parameter and gradient storage of every
    /// offloaded chunk on disk the host region is over budget.
    HostOverWithAllOnDisk {
        /// Host bytes needed so.
        host_need: u64,
        /// Offloaded chunks whose state can move.
        chunks: usize,
        /// Host bytes allowed.
        host_budget: u64,
    },
    /// The chunks whose state must move to disk take more disk than the budget.
    DiskOver {
        /// Chunks that must move.
        chunks: usize,
        /// Host bytes allowed.
        host_budget: u64,
        /// Disk bytes they take.
        disk_need: u64,
        /// Disk bytes allowed.
        disk_budget: u64,
    },
    /// A policy given whose host region is over budget.
    PolicyOverHost {
        /// The policy, in its text form.
        policy: String,
        /// Host bytes it needs.
        need: u64,
        /// Host bytes allowed per rank.
        host_budget: u64,
        /// Ranks per node.
        gpus: u32,
        /// Whether its host layout is the full one (`host_layout=16`), which 14 bytes
        /// per parameter would lower.
        full_layout: bool,
        /// Whether its host layout is the staged one (`host_layout=12`) already.
        staged: bool,
        /// Disk bytes allowed per rank (0: no disk tier).
        disk_budget: u64,
    },
    /// No policy the search tried fits the host memory beside a device within budget.
    HostTooSmall {
        /// Host bytes allowed per rank.
        host_budget: u64,
        /// Ranks per node.
        gpus: u32,
        /// Policies tried.
        tried: usize,
        /// The leanest policy on the device.
        lean: String,
        /// Its host bytes per parameter.
        lean_layout: u32,
        /// Its host bytes.
        lean_host: u64,
        /// Its device bytes.
        lean_device: u64,
        /// The policy found that needs the least host memory.
        least_policy: String,
        /// Its host bytes.
        least_host: u64,
        /// What the disk tier does or would do.
        disk: HostDisk,
    },
    /// Not even the leanest policy fits the device.
    DeviceTooSmall {
        /// Device bytes allowed per GPU.
        device_budget: u64,
        /// Policies tried.
        tried: usize,
        /// The leanest policy.
        lean: String,
        /// Its arena's bytes.
        need: u64,
        /// Its arena by purpose.
        memory: MemoryBreakdown,
        /// Its host bytes and the host bytes allowed per rank, where it needs more.
        host_over: Option<(u64, u64)>,
        /// Ranks per node.
        gpus: u32,
        /// Rows of one micro-batch.
        batch: u64,
    },
    /// No forward-only policy fits the host memory.
    ForwardHost {
        /// Host bytes allowed.
        host_budget: u64,
        /// The leanest policy.
        lean: String,
        /// The host bytes of its streamed parameters.
        host_need: u64,
    },
    /// No forward-only policy fits the device.
    ForwardDevice {
        /// Device bytes allowed.
        device_budget: u64,
        /// The leanest policy.
        lean: String,
        /// Its peak device bytes.
        need: u64,
        /// Its arena by purpose.
        memory: MemoryBreakdown,
    },
    /// No forward-only policy compiles with up to `max_buffers` chunk buffers.
    ForwardNoneCompiles {
        /// The most chunk buffers tried.
        max_buffers: u32,
    },
}

/// What the disk tier does, or would do, for [`ShortfallProblem::HostTooSmall`].
#[derive(Clone, Debug, PartialEq)]
pub enum HostDisk {
    /// The disk tier was allowed (`budget` bytes a rank) and took what it can; the least
    /// policy still keeps `kept` in host memory (what, bytes per rank), which it does not
    /// take.
    Used {
        /// Disk bytes allowed per rank.
        budget: u64,
        /// What the least policy keeps in host memory, and its bytes per rank.
        kept: Vec<(String, u64)>,
    },
    /// No disk budget was given; one of `disk` bytes (per rank) would bring the host memory
    /// needed down to `host`.
    Would {
        /// Disk bytes it would take.
        disk: u64,
        /// Host bytes left.
        host: u64,
    },
    /// The disk tier would not help.
    No,
}

impl ShortfallProblem {
    /// The problem in words, each setting named by `name`.
    pub fn text(&self, name: &dyn Fn(Setting) -> String) -> String {
        let (host, disk) = (name(Setting::HostBudget), name(Setting::DiskBudget));
        match self {
            ShortfallProblem::DiskSharded {
                host_need,
                chunks,
                host_budget,
            } => format!(
                "the host region needs {} of host memory per rank with each rank's shards of \
                 the optimizer state, parameters and gradients of all {chunks} offloaded \
                 chunks on disk wherever they can move (what stays is staging, the gradient \
                 accumulators, which accumulation keeps in host memory, and activations), more \
                 than the {} each rank has; give more {host}, spread the ranks over more \
                 nodes ({} M, each node keeping 1/M of the shards), or run fewer ranks on a \
                 node ({} N), which share its host memory",
                format_bytes(*host_need),
                format_bytes(*host_budget),
                name(Setting::Nodes),
                name(Setting::Gpus),
            ),
            ShortfallProblem::HostOverWithAllOnDisk {
                host_need,
                chunks,
                host_budget,
            } => format!(
                "the host region needs {} with the optimizer state, parameters and gradients \
                 of all {chunks} offloaded chunks on disk (the disk tier was considered: \
                 its staging buffers, the gradient accumulators, swapped activations and \
                 everything else stay in host memory), over the {} of host memory ({host}); \
                 give more {host} or a leaner policy (more persistent chunks take their state \
                 to the device)",
                format_bytes(*host_need),
                format_bytes(*host_budget)
            ),
            ShortfallProblem::DiskOver {
                chunks,
                host_budget,
                disk_need,
                disk_budget,
            } => format!(
                "the optimizer state of {chunks} chunks must move to disk to bring the host \
                 region within the {} of host memory ({host}), which takes {} of disk, more \
                 than the {} of disk ({disk}); give a larger {disk} or more {host}",
                format_bytes(*host_budget),
                format_bytes(*disk_need),
                format_bytes(*disk_budget)
            ),
            ShortfallProblem::PolicyOverHost {
                policy,
                need,
                host_budget,
                gpus,
                full_layout,
                staged,
                disk_budget,
            } => {
                let mut ways = vec![
                    format!("{} auto", name(Setting::Policy)),
                    format!("a larger {host}"),
                ];
                if *full_layout {
                    ways.push(
                        "host_layout=14 in the policy (gradients in the parameter storage, 14 \
                         bytes per parameter instead of 16)"
                            .into(),
                    );
                }
                if !staged {
                    ways.push(format!(
                        "host_layout=12 in the policy (uploads cast from the master weights, \
                         12 bytes per parameter; not with {} or f16)",
                        name(Setting::GradClip)
                    ));
                }
                ways.push(match disk_budget {
                    0 => format!("{disk} SIZE (the optimizer state of offloaded chunks in a file)"),
                    _ => format!("a larger {disk}"),
                });
                let (last, first) = ways.split_last().expect("ways out");
                format!(
                    "policy {policy} needs {} of host memory, more than the {}; use {}, or \
                     {last}",
                    format_bytes(*need),
                    rank_budget(*host_budget, *gpus, "host memory", &host),
                    first.join(", "),
                )
            }
            ShortfallProblem::HostTooSmall {
                host_budget,
                gpus,
                tried,
                lean,
                lean_layout,
                lean_host,
                lean_device,
                least_policy,
                least_host,
                disk: disk_tier,
            } => {
                let node = |per_rank: u64| per_rank.saturating_mul(u64::from(*gpus));
                let needs = format!(
                    "no policy fits {}; {tried} policies tried. Offloading keeps the model \
                     states of every streamed chunk in host memory: the leanest policy on the \
                     device ({lean}, {lean_layout} bytes per parameter on the host) needs {} \
                     of host memory beside {} of device memory, {} together, and keeping \
                     chunks on the device moves their state there without lowering the sum; \
                     the least host memory found beside a device within budget is {} \
                     ({least_policy}).",
                    rank_budget(*host_budget, *gpus, "host memory", &host),
                    format_bytes(*lean_host),
                    format_bytes(*lean_device),
                    format_bytes(lean_host + lean_device),
                    format_bytes(*least_host),
                );
                // More ranks on one node share its host memory, so only more nodes lower
                // what each needs.
                let (nodes_flag, gpus_flag) = (name(Setting::Nodes), name(Setting::Gpus));
                let nodes = format!(
                    "or shard the state over more machines ({nodes_flag} M with {gpus_flag} \
                     N: offloaded chunks are sharded over all the ranks, so each node keeps \
                     1/M of them; ranks on one node share its host memory, so more \
                     {gpus_flag} alone do not lower it)"
                );
                let host_flag = match gpus {
                    1 => host.clone(),
                    n => format!("{host} (per node, for its {n} ranks)"),
                };
                match disk_tier {
                    HostDisk::Used { budget, kept } => {
                        let left = match kept.is_empty() {
                            true => String::new(),
                            false => {
                                let kept: Vec<String> = kept
                                    .iter()
                                    .map(|(what, bytes)| {
                                        format!("{} of {what}", format_bytes(node(*bytes)))
                                    })
                                    .collect();
                                format!(
                                    " The disk tier takes the optimizer state (f32 master \
                                     weights and Adam moments) and the parameters and \
                                     gradients of offloaded chunks, but not what host memory \
                                     still holds of that policy: {}, so a larger {disk} does \
                                     not lower it.",
                                    kept.join(", ")
                                )
                            }
                        };
                        format!(
                            "{needs} That is with the disk tier ({}) considered, taking the \
                             model states it can.{left} Give {host_flag} at least {}, {nodes}",
                            rank_budget(*budget, *gpus, "disk", &disk),
                            format_bytes(node(*least_host)),
                        )
                    }
                    HostDisk::Would { disk: d, host: h } => format!(
                        "{needs} Give {host_flag} at least {}; or {disk} at least {} (the \
                         model states of offloaded chunks in a file, read and written \
                         around their uploads and the CPU Adam), which brings the host memory needed down to \
                         {}; {nodes}",
                        format_bytes(node(*least_host)),
                        format_bytes(node(*d)),
                        format_bytes(node(*h)),
                    ),
                    HostDisk::No => format!(
                        "{needs} Give {host_flag} at least {}, {nodes}",
                        format_bytes(node(*least_host)),
                    ),
                }
            }
            ShortfallProblem::DeviceTooSmall {
                device_budget,
                tried,
                lean,
                need,
                memory: m,
                host_over,
                gpus,
                batch,
            } => {
                let gpu = name(Setting::DeviceBudget);
                let host_words = match host_over {
                    Some((need, budget)) => format!(
                        "; it also needs {} of host memory, more than the {}",
                        format_bytes(*need),
                        rank_budget(*budget, *gpus, "host memory", &host)
                    ),
                    None => String::new(),
                };
                let split = match batch {
                    0 | 1 => String::new(),
                    b => format!(
                        ", or take a smaller batch with gradient accumulation ({} {} with \
                         twice the {}, 2 if none was given, trains on the same rows per step \
                         in the activations of half the batch)",
                        name(Setting::Batch),
                        b.div_ceil(2),
                        name(Setting::MicroBatches),
                    ),
                };
                format!(
                    "no policy fits {} of device memory per GPU ({gpu}); {tried} policies \
                     tried. The leanest ({lean}) needs {}: activations {}, chunk buffers {}, \
                     workspaces {}, inputs {}{host_words}. Give {gpu} at least {}{split}, or a \
                     smaller {}",
                    format_bytes(*device_budget),
                    format_bytes(*need),
                    format_bytes(m.activations),
                    format_bytes(m.chunk_buffers),
                    format_bytes(m.workspace),
                    format_bytes(m.inputs),
                    format_bytes(*need),
                    name(Setting::Seq),
                )
            }
            ShortfallProblem::ForwardHost {
                host_budget,
                lean,
                host_need,
            } => format!(
                "no forward-only policy fits {} of host memory: the leanest ({lean}) keeps {} \
                 of streamed parameters there. Give {host} at least {}",
                format_bytes(*host_budget),
                format_bytes(*host_need),
                format_bytes(*host_need)
            ),
            ShortfallProblem::ForwardDevice {
                device_budget,
                lean,
                need,
                memory: m,
            } => format!(
                "no forward-only policy fits {} of device memory. The leanest ({lean}) needs \
                 {}: activations {}, chunk buffers {}, workspaces {}, inputs {}. Give {} at \
                 least {}, or a smaller {} or {}",
                format_bytes(*device_budget),
                format_bytes(*need),
                format_bytes(m.activations),
                format_bytes(m.chunk_buffers),
                format_bytes(m.workspace),
                format_bytes(m.inputs),
                name(Setting::DeviceBudget),
                format_bytes(*need),
                name(Setting::Batch),
                name(Setting::Seq),
            ),
            ShortfallProblem::ForwardNoneCompiles { max_buffers } => format!(
                "no forward-only policy compiles with up to {max_buffers} chunk buffers; give \
                 {} n_persist=... n_buffer=... explicitly",
                name(Setting::Policy)
            ),
        }
    }
}

/// A host-memory or disk budget in words for errors: `per_rank` bytes is what each of a
/// node's `gpus` ranks may use. The host memory and disk are budgets per node, shared by
/// its ranks, so with several the figure says it is a rank's share (the error adds the
/// node's figure as given): `16.0 GiB of host memory per rank`; with one, named by
/// `setting`: `128.0 GiB of host memory (--host-memory)`.
pub fn rank_budget(per_rank: u64, gpus: u32, what: &str, setting: &str) -> String {
    match gpus {
        0 | 1 => format!("{} of {what} ({setting})", format_bytes(per_rank)),
        _ => format!("{} of {what} per rank", format_bytes(per_rank)),
    }
}

/// What each rank of a node may use of a node's `bytes` (host memory or disk) shared by
/// `gpus` ranks.
pub fn per_rank(bytes: u64, gpus: u32) -> u64 {
    bytes / u64::from(gpus.max(1))
}

/// The compiler's result alias.
pub type Result<T, E = CompileError> = std::result::Result<T, E>;
