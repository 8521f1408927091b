//! The compiler's error type.

use protrain_ir::{format_bytes, IrError};

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
    /// No policy fits the budget.
    #[error("{0}")]
    BudgetTooSmall(String),
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

/// A host-memory or disk budget in words for errors: `per_rank` bytes is what each of a
/// node's `gpus` ranks may use. `--host-memory` and `--disk-memory` are budgets per node,
/// shared by its ranks, so with several the figure says it is a rank's share (the pipeline
/// adds the node's figure as given): `16.0 GiB of host memory per rank`; with one,
/// `128.0 GiB of host memory (--host-memory)`.
pub fn rank_budget(per_rank: u64, gpus: u32, what: &str, flag: &str) -> String {
    match gpus {
        0 | 1 => format!("{} of {what} ({flag})", format_bytes(per_rank)),
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
