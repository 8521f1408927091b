//! The runtime's error type.

use std::path::{Path, PathBuf};

/// Everything that can go wrong in the runtime. Each message names the problem and, where
/// there is one, the way out.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A file could not be read or written.
    #[error("cannot access {path}: {source}; check the path and its permissions")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// The disk tier's directory or file failed (see [`crate::disk`]); the problem says what
    /// to do ([`disk_text`]).
    #[error("disk tier {}: {}", path.display(), disk_text(problem, Setting::field))]
    Disk {
        /// The directory or file.
        path: PathBuf,
        /// What went wrong.
        problem: DiskProblem,
    },
    /// A token id (input or target) is negative or not below the vocabulary size.
    #[error(
        "token {token} at position {position} is outside the vocabulary of {vocab} tokens; \
         check that the data was tokenized for this model (its vocab_size)"
    )]
    TokenOutOfRange {
        /// The offending id, widened so negative `i32` ids print as they are.
        token: i64,
        /// Its index in the flattened `[B*T]` token array.
        position: usize,
        /// The vocabulary size it must be below.
        vocab: usize,
    },
    /// A token id of a data file is not below the vocabulary size, found when a batch is
    /// read (batches are checked as they are read, so a huge file is not read before step 1).
    #[error(
        "{}: token {token} at position {position} is outside the vocabulary of {vocab} \
         tokens; check that it was tokenized for this model (its vocab_size)",
        data.text(Setting::field)
    )]
    DataOutOfVocab {
        /// The data: the setting that named the file and its path, or words.
        data: DataLabel,
        /// The offending value as the file holds it, in decimal (it may be negative or
        /// beyond `2^32`, so no one integer type holds every such value).
        token: String,
        /// Its index in the file's tokens.
        position: usize,
        /// The vocabulary size it must be below.
        vocab: usize,
    },
    /// A token file's extension is neither `.npy` nor `.bin`.
    #[error("{}", unknown_token_format_text(path, Setting::field))]
    UnknownTokenFormat {
        /// The file.
        path: PathBuf,
    },
    /// A token file could not be interpreted as tokens.
    #[error("{path} {problem}")]
    BadTokenFile {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A batch shape with a zero (or overflowing) dimension.
    #[error(
        "batch {batch} x seq {seq} is not a usable batch shape; batch size and sequence length \
         must both be at least 1 and their product must fit in memory"
    )]
    InvalidBatchShape {
        /// Rows requested.
        batch: usize,
        /// Sequence length requested.
        seq: usize,
    },
    /// The token stream cannot fill one batch.
    #[error(
        "the token stream has {len} tokens but one step of batch {batch} x seq {seq} needs \
         {needed} (batch * seq + 1); use more data or a smaller batch or sequence length"
    )]
    TokenStreamTooShort {
        /// Tokens in the stream.
        len: usize,
        /// Rows per batch.
        batch: usize,
        /// Sequence length.
        seq: usize,
        /// Tokens one step reads.
        needed: usize,
    },
    /// Weights could not be found at the given path.
    #[error("{path}: {problem}")]
    WeightsNotFound {
        /// The path given.
        path: PathBuf,
        /// What was looked for and what to pass instead.
        problem: String,
    },
    /// A safetensors file or shard index is malformed or truncated.
    #[error("{path}: {problem}")]
    BadWeightFile {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A tensor name that the weight file does not hold.
    #[error("no tensor named `{name}` in the weights{hint}")]
    TensorNotFound {
        /// The name asked for.
        name: String,
        /// A closest-name suggestion (with leading punctuation), or empty.
        hint: String,
    },
    /// A stored tensor whose dtype cannot be converted to f32.
    #[error(
        "tensor `{name}` is stored as {dtype}; only F32, BF16 and F16 weights can be loaded: \
         convert the checkpoint to one of them"
    )]
    UnsupportedTensorDtype {
        /// The tensor.
        name: String,
        /// Its stored dtype.
        dtype: String,
    },
    /// A buffer whose length does not match a tensor's element count.
    #[error(
        "tensor `{name}` has {expected} elements (shape {shape:?}) but the buffer holds {got}; \
         pass a buffer of the tensor's size"
    )]
    TensorSizeMismatch {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Elements the tensor has.
        expected: usize,
        /// Elements the buffer has.
        got: usize,
    },
    /// A checkpoint whose tensors do not match the model's.
    #[error(
        "the weights do not match the model: {count} problem(s)\n{report}\nthis checkpoint is \
         for another model or another size; pass the config that matches it (the config.json \
         saved beside it), or weights made for this model"
    )]
    WeightsMismatch {
        /// How many problems there are in all.
        count: usize,
        /// The first few, one per line.
        report: String,
    },
    /// A tensor handed to the safetensors writer is malformed.
    #[error("cannot save tensor `{name}`: {problem}")]
    InvalidTensorToSave {
        /// The tensor.
        name: String,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A vocabulary too small for the synthetic corpus.
    #[error(
        "the synthetic corpus uses {needed} token ids but the vocabulary has {vocab}; use a \
         model with vocab_size >= {needed}"
    )]
    SyntheticVocabTooSmall {
        /// The vocabulary size given.
        vocab: usize,
        /// Ids the corpus uses.
        needed: usize,
    },
    /// Data given to the runtime does not have the shape the graph or schedule expects.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A schedule the backend cannot run: a dtype it does not execute, an address outside its
    /// memory, an operand it cannot read.
    #[error("cannot execute the schedule: {0}")]
    BadSchedule(String),
    /// The host memory a backend is about to take is more than this machine has available
    /// ([`host_memory_short_text`] words it; the CLI names the flag of each
    /// region's budget instead of the budget).
    #[error(
        "cannot execute the schedule: {}",
        host_memory_short_text(regions, *available, |b| b.name().to_string())
    )]
    HostMemoryShort {
        /// The regions the backend is about to take.
        regions: Vec<MemoryNeed>,
        /// The bytes available.
        available: u64,
    },
    /// A stream gave up on a step because another stream failed; the other stream's error is
    /// the one to report.
    #[error("the step was abandoned because another stream failed")]
    StepAborted,
    /// A directory to resume from that holds no checkpoint.
    #[error(
        "no checkpoint in {dir} (the files are named step-NNNNNNNN.safetensors, or \
         step-NNNNNNNN.manifest.json for the shards of several ranks); check the directory, or \
         start the run afresh instead of resuming"
    )]
    NoCheckpoint {
        /// The directory.
        dir: PathBuf,
    },
    /// A checkpoint directory that holds checkpoints of another run.
    #[error("{}", foreign_checkpoint_dir_text(dir, *count, *newest, Setting::field))]
    ForeignCheckpointDir {
        /// The directory.
        dir: PathBuf,
        /// Checkpoints in it.
        count: usize,
        /// The newest one's step.
        newest: u64,
    },
    /// Another run holds the checkpoint directory ([`crate::checkpoint::take_dir`]).
    #[error("{}", checkpoint_dir_in_use_text(dir, *pid, Setting::field))]
    CheckpointDirInUse {
        /// The directory.
        dir: PathBuf,
        /// The holder's PID, as its lock file says.
        pid: Option<u32>,
    },
    /// A safetensors file without a protrain checkpoint's metadata (`key`) given to resume
    /// from: weights to start from instead.
    #[error("{}", weights_not_checkpoint_text(path, key, Setting::field))]
    WeightsNotCheckpoint {
        /// The file.
        path: PathBuf,
        /// The metadata key a checkpoint has.
        key: &'static str,
    },
    /// A file that is not a readable protrain checkpoint.
    #[error("checkpoint {path} {problem}")]
    BadCheckpoint {
        /// The file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        problem: String,
    },
    /// A checkpoint written for another model, batch shape, optimizer or run settings, or
    /// settings that contradict it.
    #[error("{}", checkpoint_mismatch_text(path, differences, Setting::field))]
    CheckpointMismatch {
        /// The file.
        path: PathBuf,
        /// What differs, one item per line.
        differences: Vec<Difference>,
    },
    /// A checkpoint's run read a token file that is no longer where it was.
    #[error("{}", run_data_missing_text(checkpoint, data, Setting::field))]
    RunDataMissing {
        /// The checkpoint.
        checkpoint: PathBuf,
        /// The token file it names.
        data: PathBuf,
    },
    /// A learning rate that is negative, infinite or NaN.
    #[error("{}", invalid_learning_rate_text(*lr, *step, Setting::field))]
    InvalidLearningRate {
        /// The rate.
        lr: f64,
        /// The 1-based step it was for.
        step: u64,
    },
    /// A loss scaler setting or scale that cannot train ([`loss_scale_text`] words it; the CLI
    /// names each setting by its flag).
    #[error("invalid loss scaling: {}", loss_scale_text(.0, LossScaleSetting::field))]
    InvalidLossScale(LossScaleProblem),
    /// An evaluation that cannot run as asked (a training schedule, more batches than the
    /// data holds); the text names the flag or file and the way out.
    #[error("cannot evaluate: {0}")]
    InvalidEval(String),
    /// An evaluation of a schedule that is not forward-only: it would train the weights it
    /// should measure.
    #[error("{}", eval_not_forward_only_text(Setting::field))]
    EvalNotForwardOnly,
    /// An evaluation schedule of another model than the training schedule; `first` is the
    /// first parameter that differs.
    #[error("{}", eval_other_model_text(first, Setting::field))]
    EvalOtherModel {
        /// The first difference, in words.
        first: String,
    },
    /// A learning-rate schedule whose settings do not fit together
    /// ([`lr_schedule_text`] words it; the CLI names each setting by its flag).
    #[error("{}", lr_schedule_text(.0, LrSetting::field))]
    InvalidLrSchedule(LrScheduleProblem),
    /// Initial weights (or a checkpoint's) that hold NaN or infinity.
    #[error(
        "the weights from {origin} are not finite: {name} holds {value} ({count} of its {len} \
         values); training from them can only give a NaN loss. Use other weights"
    )]
    NonFiniteWeights {
        /// Where the weights came from: `--init FILE`, a checkpoint, the seeded initialisation.
        origin: String,
        /// The first parameter holding a non-finite value.
        name: String,
        /// Its first non-finite value.
        value: f32,
        /// How many of its values are not finite.
        count: usize,
        /// Its element count.
        len: usize,
    },
    /// Training diverged: a loss or gradient norm became NaN or infinite. The text says at
    /// which step, what was seen before, and what to change ([`divergence_text`]).
    #[error("{}", divergence_text(.0, Setting::field))]
    Diverged(Divergence),
    /// The profiler could not measure what it was asked to.
    #[error("cannot profile: {0}")]
    Profile(String),
    /// The CUDA backend cannot run on this machine: it was not built in, or the driver, a GPU
    /// or a CUDA library is missing. The text says which and what to install.
    #[error("no CUDA device is available: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed.
    #[error("CUDA failed while {during}: {detail}; {hint}")]
    Cuda {
        /// What the backend was doing.
        during: String,
        /// The library's error name and text.
        detail: String,
        /// The way out that fits the error.
        hint: String,
    },
    /// A schedule that needs what this executor or backend lacks ([`Unsupported`] says
    /// what, [`unsupported_text`] words it).
    #[error("cannot execute the schedule: {}", unsupported_text(.0, Setting::field))]
    Unsupported(Unsupported),
    /// A collective group of `world` ranks given for a schedule compiled for `ranks`.
    #[error("{}", group_size_text(*rank, *world, *ranks, Setting::field))]
    GroupSize {
        /// The rank the group was given to.
        rank: usize,
        /// Ranks of the group.
        world: usize,
        /// Ranks the schedule was compiled for.
        ranks: usize,
    },
    /// A data-parallel schedule run with no collective to reach the other ranks.
    #[error("{}", no_collective_text(*ranks, Setting::field))]
    NoCollective {
        /// Ranks the schedule runs on.
        ranks: usize,
    },
    /// A collective between the ranks of a data-parallel run failed: a rank left, did not
    /// arrive in time, or issued a different collective. The text says which.
    #[error("rank {rank}: {problem}")]
    Collective {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong, naming the other rank and the collective.
        problem: String,
    },
    /// The launch settings of a multi-process run (torchrun's RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT, or `--nodes`, `--node-rank`, `--master`, `--gpus`) are
    /// missing or inconsistent. The text names the setting and the way out.
    #[error("launch settings: {0}")]
    Launch(String),
    /// The shape of a launch one node is asked for (nodes, workers per node, this node's
    /// rank, rank 0's address) does not make sense ([`node_launch_text`] words it; the CLI
    /// names each setting by its flag).
    #[error("launch settings: {}", node_launch_text(.0, NodeSetting::field))]
    NodeLaunch(NodeLaunchProblem),
    /// The rendezvous could not hold or reach rank 0's port ([`PortProblem`] says how,
    /// [`port_text`] words it).
    #[error(
        "rank {rank}: rendezvous failed: {}",
        port_text(problem, Setting::field)
    )]
    RendezvousPort {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong.
        problem: PortProblem,
    },
    /// The rendezvous that starts a multi-process run failed on this rank: a peer did not
    /// come in time, died, or disagreed about the run. The text names the ranks concerned.
    #[error("rank {rank}: rendezvous failed: {problem}")]
    Rendezvous {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong and the way out.
        problem: String,
    },
}

/// The runtime's result alias.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// Host memory a backend takes, for [`crate::memory::check_host_memory`]: which region and
/// its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    /// The region.
    pub region: HostRegion,
    /// Its size.
    pub bytes: u64,
}

/// A region of host memory a backend takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostRegion {
    /// The host backend's stand-in for device memory.
    DeviceArena,
    /// The schedule's host memory, on the host backend.
    HostRegion,
    /// The schedule's host memory, pinned by the CUDA backend.
    PinnedHostRegion,
}

impl HostRegion {
    /// What an error calls the region.
    pub fn name(self) -> &'static str {
        match self {
            HostRegion::DeviceArena => "device arena",
            HostRegion::HostRegion => "host region",
            HostRegion::PinnedHostRegion => "pinned host region",
        }
    }

    /// The compile-time budget that bounds the region: the device's memory for the arena,
    /// the host's for the host region.
    pub fn budget(self) -> Budget {
        match self {
            HostRegion::DeviceArena => Budget::Device,
            HostRegion::HostRegion | HostRegion::PinnedHostRegion => Budget::Host,
        }
    }
}

/// A memory budget a schedule is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// The GPU's memory.
    Device,
    /// The host's memory.
    Host,
}

impl Budget {
    /// The budget in words: `device memory`, `host memory`.
    pub fn name(self) -> &'static str {
        match self {
            Budget::Device => "device memory",
            Budget::Host => "host memory",
        }
    }
}

/// The text of [`RuntimeError::HostMemoryShort`]: what `regions` need, what is `available`,
/// and the way out, with `budget` wording the compile-time budget of each region (the CLI
/// names its flag; the library error names the budget).
pub fn host_memory_short_text(
    regions: &[MemoryNeed],
    available: u64,
    budget: impl Fn(Budget) -> String,
) -> String {
    let needed = regions
        .iter()
        .fold(0u64, |sum, r| sum.saturating_add(r.bytes));
    let what: Vec<String> = regions
        .iter()
        .map(|r| {
            format!(
                "{} ({})",
                r.region.name(),
                protrain_ir::format_bytes(r.bytes)
            )
        })
        .collect();
    let budgets: Vec<String> = regions.iter().map(|r| budget(r.region.budget())).collect();
    format!(
        "the {} {} {} of host memory, but only {} is available on this machine ({} \
         missing); free memory, or compile the schedule for less with {}",
        what.join(" and "),
        if regions.len() == 1 { "needs" } else { "need" },
        protrain_ir::format_bytes(needed),
        protrain_ir::format_bytes(available),
        protrain_ir::format_bytes(needed.saturating_sub(available)),
        budgets.join(" and "),
    )
}

/// A setting of a learning-rate schedule, as an error about it names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrSetting {
    /// The peak learning rate (the rate the schedule's AdamW ops were compiled with).
    Lr,
    /// The minimum the decay ends at.
    MinLr,
    /// The steps the decay ends after.
    DecaySteps,
    /// The schedule's shape.
    Schedule,
}

impl LrSetting {
    /// The setting's name in the run settings (`lr`, `min_lr`, `decay_steps`, `lr_schedule`).
    pub fn field(self) -> String {
        match self {
            LrSetting::Lr => "lr",
            LrSetting::MinLr => "min_lr",
            LrSetting::DecaySteps => "decay_steps",
            LrSetting::Schedule => "lr_schedule",
        }
        .to_string()
    }
}

/// What is wrong with a learning-rate schedule's settings ([`RuntimeError::InvalidLrSchedule`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrScheduleProblem {
    /// A peak that is negative or not finite.
    Peak {
        /// The peak given.
        peak: f64,
    },
    /// A minimum outside `0..=peak` or not finite.
    MinLr {
        /// The minimum given.
        min_lr: f64,
        /// The peak.
        peak: f64,
    },
    /// A minimum above 0 for the constant schedule, which never decays.
    MinLrWithoutDecay {
        /// The minimum given.
        min_lr: f64,
    },
    /// A decay length for the constant schedule, which never decays.
    DecayWithoutDecay {
        /// The decay steps given.
        decay_steps: u64,
    },
    /// A peak other than the rate the schedule's AdamW ops were compiled with.
    PeakNotCompiled {
        /// The schedule's peak.
        peak: f64,
        /// The compiled rate.
        compiled: f64,
    },
}

/// The text of [`RuntimeError::InvalidLrSchedule`] for `problem`, each setting named by
/// `name` (the runtime uses [`LrSetting::field`], the CLI the setting's flag).
pub fn lr_schedule_text(problem: &LrScheduleProblem, name: impl Fn(LrSetting) -> String) -> String {
    let (lr, min_lr) = (name(LrSetting::Lr), name(LrSetting::MinLr));
    let (decay, schedule) = (name(LrSetting::DecaySteps), name(LrSetting::Schedule));
    match *problem {
        LrScheduleProblem::Peak { peak } => {
            format!("the peak learning rate {peak} must be a finite number >= 0; give another {lr}")
        }
        LrScheduleProblem::MinLr {
            min_lr: value,
            peak,
        } => format!(
            "{min_lr} {value} must be a finite number between 0 and the peak learning rate \
             {peak} ({lr})"
        ),
        LrScheduleProblem::MinLrWithoutDecay { min_lr: value } => format!(
            "{min_lr} {value} applies to the linear and cosine schedules, which decay; the \
             constant schedule stays at {lr}. Drop {min_lr} or choose {schedule} linear or cosine"
        ),
        LrScheduleProblem::DecayWithoutDecay { decay_steps } => format!(
            "{decay} {decay_steps} applies to the linear and cosine schedules; the constant \
             schedule does not decay. Drop {decay} or choose {schedule} linear or cosine"
        ),
        LrScheduleProblem::PeakNotCompiled { peak, compiled } => format!(
            "the learning-rate schedule peaks at {peak} but the schedule's AdamW ops were \
             compiled with lr {compiled}; the peak is the compiled rate: compile with {lr} {peak}"
        ),
    }
}

/// A setting of loss scaling, as an error about it names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossScaleSetting {
    /// The scale of the first step.
    Init,
    /// Consecutive clean steps after which the scale doubles.
    GrowthInterval,
    /// The schedule's compute dtype (only f16 schedules are loss-scaled).
    Dtype,
}

impl LossScaleSetting {
    /// The setting's name in the run settings (`loss_scale.init`,
    /// `loss_scale.growth_interval`) or the schedule's header (`dtype`).
    pub fn field(self) -> String {
        match self {
            LossScaleSetting::Init => "loss_scale.init",
            LossScaleSetting::GrowthInterval => "loss_scale.growth_interval",
            LossScaleSetting::Dtype => "dtype",
        }
        .to_string()
    }
}

/// What is wrong with loss scaling ([`RuntimeError::InvalidLossScale`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossScaleProblem {
    /// An initial scale that is not a finite number above 0 that f32 holds.
    Init {
        /// The scale given.
        init: f64,
    },
    /// A growth interval of 0.
    GrowthInterval,
    /// Loss-scaling settings for a schedule that is not loss-scaled (not f16).
    NotLossScaled,
    /// A step asked to run at a scale that is not finite and above 0.
    Scale {
        /// The 1-based step.
        step: u64,
        /// The scale asked for.
        scale: f64,
    },
}

/// The text of [`RuntimeError::InvalidLossScale`] for `problem`, each setting named by `name`
/// (the runtime uses [`LossScaleSetting::field`], the CLI the setting's flag).
pub fn loss_scale_text(
    problem: &LossScaleProblem,
    name: impl Fn(LossScaleSetting) -> String,
) -> String {
    match *problem {
        LossScaleProblem::Init { init } => format!(
            "{} {init}: the loss scale must be a finite number above 0 that f32 can hold (at \
             most about 3.4e38); GradScaler's default is 65536 (2^16)",
            name(LossScaleSetting::Init)
        ),
        LossScaleProblem::GrowthInterval => format!(
            "{} 0: the scale doubles after this many consecutive clean steps, so it must be at \
             least 1; GradScaler's default is 2000",
            name(LossScaleSetting::GrowthInterval)
        ),
        LossScaleProblem::NotLossScaled => {
            let (init, growth) = (
                name(LossScaleSetting::Init),
                name(LossScaleSetting::GrowthInterval),
            );
            format!(
                "{init} and {growth} apply to f16 schedules, which are loss-scaled; this \
                 schedule is not. Drop them, or compile with {} f16",
                name(LossScaleSetting::Dtype)
            )
        }
        LossScaleProblem::Scale { step, scale } => format!(
            "step {step} would run at loss scale {scale}; a loss scale must be finite and > 0"
        ),
    }
}

/// A setting of a launch of one node's workers, as an error about it names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeSetting {
    /// How many nodes the run has.
    Nodes,
    /// How many workers (GPUs) each node runs.
    Gpus,
    /// This node's rank among the nodes.
    NodeRank,
    /// Rank 0's `HOST:PORT`.
    Master,
}

impl NodeSetting {
    /// The setting's name in a [`crate::rendezvous::Launch`]'s terms (`nodes`,
    /// `workers_per_node`, `node_rank`, `master`).
    pub fn field(self) -> String {
        match self {
            NodeSetting::Nodes => "nodes",
            NodeSetting::Gpus => "workers_per_node",
            NodeSetting::NodeRank => "node_rank",
            NodeSetting::Master => "master",
        }
        .to_string()
    }
}

/// What is wrong with a launch of one node's workers ([`RuntimeError::NodeLaunch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeLaunchProblem {
    /// No nodes.
    NoNodes,
    /// No workers per node.
    NoWorkers,
    /// A node rank not below the number of nodes.
    NodeRank {
        /// The node rank given.
        node_rank: usize,
        /// The number of nodes.
        nodes: usize,
    },
    /// A worker's local rank not below the workers per node.
    LocalRank {
        /// The local rank given.
        local_rank: usize,
        /// The workers per node.
        gpus: usize,
    },
    /// More ranks than a `usize` counts.
    Overflow {
        /// The number of nodes.
        nodes: usize,
        /// The workers per node.
        gpus: usize,
    },
    /// Rank 0's address does not parse.
    Master {
        /// The address given.
        master: String,
        /// What is wrong with it ("has no port").
        why: &'static str,
    },
}

/// The text of [`RuntimeError::NodeLaunch`] for `problem`, each setting named by `name` (the
/// runtime uses [`NodeSetting::field`], the CLI the setting's flag).
pub fn node_launch_text(
    problem: &NodeLaunchProblem,
    name: impl Fn(NodeSetting) -> String,
) -> String {
    let (nodes_, gpus_) = (name(NodeSetting::Nodes), name(NodeSetting::Gpus));
    match problem {
        NodeLaunchProblem::NoNodes => {
            format!("{nodes_} 0: a run needs at least one node; pass {nodes_} 1 or more")
        }
        NodeLaunchProblem::NoWorkers => {
            format!("{gpus_} 0: a node needs at least one worker; pass {gpus_} 1 or more")
        }
        NodeLaunchProblem::NodeRank { node_rank, nodes } => {
            let rank_ = name(NodeSetting::NodeRank);
            format!(
                "{rank_} {node_rank} is not below {nodes_} {nodes}; node ranks count from 0, so \
                 pass {rank_} 0 to {}",
                nodes - 1
            )
        }
        NodeLaunchProblem::LocalRank { local_rank, gpus } => format!(
            "local rank {local_rank} is not below {gpus_} {gpus}; a node runs workers 0 to {}, \
             so pass a local rank in that range",
            gpus - 1
        ),
        NodeLaunchProblem::Overflow { nodes, gpus } => format!(
            "{nodes_} {nodes} x {gpus_} {gpus} overflows; pass the real number of nodes and \
             GPUs per node"
        ),
        NodeLaunchProblem::Master { master, why } => format!(
            "{} `{master}` {why}; pass the host name or address of the node that runs rank 0 \
             and a free TCP port, as HOST:PORT (e.g. node0:29500, or [::1]:29500 for an IPv6 \
             address)",
            name(NodeSetting::Master)
        ),
    }
}

/// A setting of a training run, as an error about it names it: the library by the name of its
/// field ([`Setting::field`]), the CLI by its flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    /// The peak learning rate, the rate the schedule's AdamW ops were compiled with.
    Lr,
    /// The learning-rate schedule's shape.
    LrSchedule,
    /// Warmup steps of the learning-rate schedule.
    WarmupSteps,
    /// Steps the learning-rate decay ends after.
    DecaySteps,
    /// The minimum the learning-rate decay ends at.
    MinLr,
    /// The seed of the initialisation and of the synthetic corpus.
    Seed,
    /// The token file.
    Data,
    /// The tokenizer that turns a text corpus into tokens.
    Tokenizer,
    /// The loss scale of the first step.
    LossScaleInit,
    /// Clean steps after which the loss scale doubles.
    LossScaleGrowthInterval,
    /// The checkpoint directory a run resumes from.
    Resume,
    /// The directory a run writes its checkpoints to.
    CheckpointDir,
    /// Gradient clipping.
    GradClip,
    /// The schedule's compute dtype.
    Dtype,
    /// The directory of the disk tier's file.
    DiskDir,
    /// The compile-time disk budget.
    DiskBudget,
    /// The compile-time host memory budget.
    HostBudget,
    /// The backend that runs the schedule.
    Backend,
    /// The GPUs (ranks) per node a schedule is compiled for.
    Gpus,
    /// The nodes a schedule is compiled for.
    Nodes,
    /// Compiling a forward-only (evaluation) schedule.
    ForwardOnly,
    /// Weights to start from.
    Init,
    /// Rank 0's `HOST:PORT` for the rendezvous.
    Master,
}

impl Setting {
    /// The setting's name as the library calls it: the field of
    /// [`crate::run_settings::RunFlags`] (or of the compiler's options, for the budgets).
    pub fn field(self) -> String {
        match self {
            Setting::Lr => "lr",
            Setting::LrSchedule => "lr_schedule",
            Setting::WarmupSteps => "warmup_steps",
            Setting::DecaySteps => "decay_steps",
            Setting::MinLr => "min_lr",
            Setting::Seed => "seed",
            Setting::Data => "data",
            Setting::Tokenizer => "tokenizer",
            Setting::LossScaleInit => "loss_scale_init",
            Setting::LossScaleGrowthInterval => "loss_scale_growth_interval",
            Setting::Resume => "resume",
            Setting::CheckpointDir => "checkpoint_dir",
            Setting::GradClip => "grad_clip",
            Setting::Dtype => "dtype",
            Setting::DiskDir => "disk_dir",
            Setting::DiskBudget => "disk_budget",
            Setting::HostBudget => "host_budget",
            Setting::Backend => "backend",
            Setting::Gpus => "gpus",
            Setting::Nodes => "nodes",
            Setting::ForwardOnly => "forward_only",
            Setting::Init => "init",
            Setting::Master => "master",
        }
        .to_string()
    }
}

impl RuntimeError {
    /// The message, with each [`Setting`] it names worded by `name` (the CLI passes its
    /// flags); [`std::fmt::Display`] names the settings by [`Setting::field`]. The errors that
    /// name settings through their own enums ([`loss_scale_text`], [`node_launch_text`],
    /// [`lr_schedule_text`], [`host_memory_short_text`]) are worded by their own functions.
    pub fn worded(&self, name: impl Fn(Setting) -> String) -> String {
        match self {
            RuntimeError::DataOutOfVocab {
                data,
                token,
                position,
                vocab,
            } => format!(
                "{}: token {token} at position {position} is outside the vocabulary of {vocab} \
                 tokens; check that it was tokenized for this model (its vocab_size)",
                data.text(name)
            ),
            RuntimeError::UnknownTokenFormat { path } => unknown_token_format_text(path, name),
            RuntimeError::ForeignCheckpointDir { dir, count, newest } => {
                foreign_checkpoint_dir_text(dir, *count, *newest, name)
            }
            RuntimeError::CheckpointDirInUse { dir, pid } => {
                checkpoint_dir_in_use_text(dir, *pid, name)
            }
            RuntimeError::CheckpointMismatch { path, differences } => {
                checkpoint_mismatch_text(path, differences, name)
            }
            RuntimeError::RunDataMissing { checkpoint, data } => {
                run_data_missing_text(checkpoint, data, name)
            }
            RuntimeError::InvalidLearningRate { lr, step } => {
                invalid_learning_rate_text(*lr, *step, name)
            }
            RuntimeError::Diverged(divergence) => divergence_text(divergence, name),
            RuntimeError::Disk { path, problem } => {
                format!("disk tier {}: {}", path.display(), disk_text(problem, name))
            }
            RuntimeError::Unsupported(what) => {
                format!(
                    "cannot execute the schedule: {}",
                    unsupported_text(what, name)
                )
            }
            RuntimeError::GroupSize { rank, world, ranks } => {
                group_size_text(*rank, *world, *ranks, name)
            }
            RuntimeError::NoCollective { ranks } => no_collective_text(*ranks, name),
            RuntimeError::WeightsNotCheckpoint { path, key } => {
                weights_not_checkpoint_text(path, key, name)
            }
            RuntimeError::EvalNotForwardOnly => eval_not_forward_only_text(name),
            RuntimeError::RendezvousPort { rank, problem } => format!(
                "rank {rank}: rendezvous failed: {}",
                port_text(problem, name)
            ),
            RuntimeError::EvalOtherModel { first } => eval_other_model_text(first, name),
            e => e.to_string(),
        }
    }
}

/// The data a batch was read from, as an error names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataLabel {
    /// A token file, and the setting that named it.
    File {
        /// The setting ([`Setting::Data`] for a training run's tokens).
        setting: Setting,
        /// The file.
        path: PathBuf,
    },
    /// Anything else, in words (`the synthetic corpus`, or a caller's own label).
    Words(String),
}

impl DataLabel {
    /// The label, the setting named by `name`: `data tokens.npy` (`--data tokens.npy` in the
    /// CLI's words).
    pub fn text(&self, name: impl Fn(Setting) -> String) -> String {
        match self {
            DataLabel::File { setting, path } => format!("{} {}", name(*setting), path.display()),
            DataLabel::Words(words) => words.clone(),
        }
    }
}

/// The text of [`RuntimeError::UnknownTokenFormat`].
pub fn unknown_token_format_text(path: &Path, name: impl Fn(Setting) -> String) -> String {
    format!(
        "{}: unknown token file format; pass a `.npy` file (a 1-D integer array) or a `.bin` \
         file (raw little-endian u16 tokens), or, for a UTF-8 text corpus, add {} \
         tokenizer.json (a Hugging Face tokenizer) to tokenize it",
        path.display(),
        name(Setting::Tokenizer)
    )
}

/// The text of [`RuntimeError::ForeignCheckpointDir`].
pub fn foreign_checkpoint_dir_text(
    dir: &Path,
    count: usize,
    newest: u64,
    name: impl Fn(Setting) -> String,
) -> String {
    let dir = dir.display();
    format!(
        "checkpoint directory {dir} already holds {count} checkpoint(s), up to step {newest}, \
         of another run; keeping the newest would delete this run's. Continue that run with \
         {} {dir}, or give an empty directory",
        name(Setting::Resume)
    )
}

/// The text of [`RuntimeError::CheckpointDirInUse`].
pub fn checkpoint_dir_in_use_text(
    dir: &Path,
    pid: Option<u32>,
    name: impl Fn(Setting) -> String,
) -> String {
    format!(
        "checkpoint directory {} is in use by another run{}; two runs on one directory \
         delete each other's checkpoints: wait for that run to end, or give this one another \
         {}",
        dir.display(),
        pid.map_or(String::new(), |p| format!(" (PID {p})")),
        name(Setting::CheckpointDir)
    )
}

/// One way a checkpoint differs from the run that loads it ([`RuntimeError::CheckpointMismatch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Difference {
    /// A run setting: the checkpoint's value and this run's.
    Setting {
        /// The setting.
        setting: Setting,
        /// The checkpoint's value.
        checkpoint: String,
        /// This run's value.
        run: String,
    },
    /// The checkpoint's run trained on the synthetic corpus; this one names a token file.
    DataOverSynthetic {
        /// The token file this run names.
        path: PathBuf,
    },
    /// Anything else (the model, the batch shape, the optimizer), in words.
    Other(String),
}

impl Difference {
    /// The difference on one line, each setting named by `name`.
    pub fn text(&self, name: impl Fn(Setting) -> String) -> String {
        match self {
            Difference::Setting {
                setting,
                checkpoint,
                run,
            } => format!(
                "{}: the checkpoint has {checkpoint}, this run has {run}",
                name(*setting)
            ),
            Difference::DataOverSynthetic { path } => format!(
                "data: the checkpoint has the synthetic corpus, this run has {} {}",
                name(Setting::Data),
                path.display()
            ),
            Difference::Other(words) => words.clone(),
        }
    }
}

/// The text of [`RuntimeError::CheckpointMismatch`], each setting named by `name`.
pub fn checkpoint_mismatch_text(
    path: &Path,
    differences: &[Difference],
    name: impl Fn(Setting) -> String,
) -> String {
    let lines: Vec<String> = differences.iter().map(|d| d.text(&name)).collect();
    format!(
        "checkpoint {} was written by another training run:\n  {}\nresume it with the model, \
         batch, seq and optimizer settings it was written with (settings left out are taken \
         from the checkpoint, so drop the ones that differ), or start afresh with another \
         checkpoint directory",
        path.display(),
        lines.join("\n  ")
    )
}

/// The text of [`RuntimeError::RunDataMissing`].
pub fn run_data_missing_text(
    checkpoint: &Path,
    data: &Path,
    name: impl Fn(Setting) -> String,
) -> String {
    format!(
        "checkpoint {} is of a run that read its tokens from {}, which no longer exists; pass \
         the file's new location with {}",
        checkpoint.display(),
        data.display(),
        name(Setting::Data)
    )
}

/// The text of [`RuntimeError::InvalidLearningRate`].
pub fn invalid_learning_rate_text(lr: f64, step: u64, name: impl Fn(Setting) -> String) -> String {
    format!(
        "the learning rate {lr} of step {step} is not a finite number >= 0; check {}, {} and \
         the learning-rate schedule",
        name(Setting::Lr),
        name(Setting::MinLr)
    )
}

/// How a training run diverged ([`RuntimeError::Diverged`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Divergence {
    /// An f16 run's gradients overflowed at every loss scale down to `scale`.
    LossScaleExhausted {
        /// The step.
        step: u64,
        /// The last scale tried.
        scale: f64,
    },
    /// The first step of a run gave a loss or gradient norm that is not finite, from finite
    /// weights: the forward or backward pass itself overflowed.
    FirstStep {
        /// What became non-finite, and at which step.
        what: String,
    },
    /// A later step gave a loss or gradient norm that is not finite.
    Later {
        /// What became non-finite, and at which step.
        what: String,
        /// The step before's loss and gradient norm, in words (empty when unknown).
        seen: String,
        /// The parameter tensors the update made non-finite, in words (empty when none).
        weights: String,
        /// Whether the run clips gradients already.
        clipped: bool,
    },
}

/// The text of [`RuntimeError::Diverged`], each setting of the way out named by `name`.
pub fn divergence_text(divergence: &Divergence, name: impl Fn(Setting) -> String) -> String {
    let lr = name(Setting::Lr);
    match divergence {
        Divergence::LossScaleExhausted { step, scale } => format!(
            "the gradients overflowed f16 at every loss scale down to {scale:e} (step {step}): \
             the model diverged. Train with a lower {lr}, clip gradients with {}, or train in \
             bf16 ({} bf16), whose range is f32's",
            name(Setting::GradClip),
            name(Setting::Dtype)
        ),
        Divergence::FirstStep { what } => format!(
            "{what}, the first step of this run, from finite weights: the forward or backward \
             pass itself overflowed; check the data and the weights' scale"
        ),
        Divergence::Later {
            what,
            seen,
            weights,
            clipped,
        } => {
            let way_out = match clipped {
                true => format!("lower {lr}"),
                false => format!("lower {lr} or set {}", name(Setting::GradClip)),
            };
            format!("{what}{seen}{weights}: training diverged; {way_out}")
        }
    }
}

/// What went wrong with the disk tier ([`RuntimeError::Disk`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskProblem {
    /// The I/O mode's environment variable holds no mode.
    BadIoMode {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The request depth's environment variable holds no whole number from 1 to the most.
    BadQueueDepth {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// The most requests in flight it may ask for.
        most: usize,
    },
    /// The disk directory is not a directory.
    NotADirectory,
    /// The disk directory cannot be read.
    CannotUse {
        /// What the operating system said.
        error: String,
    },
    /// The disk has less room than the state the schedule keeps there.
    NoRoom {
        /// Bytes free.
        free: u64,
        /// Bytes the schedule keeps on disk.
        bytes: u64,
    },
    /// The state file cannot be created in the directory.
    CannotCreate {
        /// The file.
        file: PathBuf,
        /// What the operating system said.
        error: String,
    },
    /// The file system cannot allocate the state file.
    CannotAllocate {
        /// Bytes the schedule keeps on disk.
        bytes: u64,
        /// What the operating system said.
        error: String,
    },
    /// A read or write of the state file failed.
    Io {
        /// `read` or `write`.
        doing: String,
        /// Where in the file.
        offset: u64,
        /// What the operating system said.
        error: String,
        /// Why, as far as it is known.
        cause: DiskIoCause,
        /// Bytes the schedule keeps on disk.
        bytes: u64,
    },
    /// The state file was removed while the run used it.
    Vanished {
        /// What the operating system said.
        error: String,
    },
}

/// Why a read or write of the disk tier's file failed, as far as it is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskIoCause {
    /// The disk or the quota is full.
    Full,
    /// The file is shorter than the region: something truncated it.
    Truncated,
    /// Anything else.
    Other,
}

/// What a schedule needs that the executor or backend running it lacks
/// ([`RuntimeError::Unsupported`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unsupported {
    /// A schedule of several ranks on a backend without `missing` (its collectives).
    Collectives {
        /// Ranks the schedule runs on.
        ranks: usize,
        /// What the backend lacks.
        missing: &'static str,
    },
    /// A schedule that keeps the optimizer state of `chunks` chunks on disk, on a backend
    /// without `missing` (its disk tier).
    DiskTier {
        /// Chunks whose state is on disk.
        chunks: usize,
        /// What the backend lacks.
        missing: &'static str,
    },
    /// A disk file given to a backend without `missing` (its disk tier).
    DiskFile {
        /// The file.
        path: PathBuf,
        /// What the backend lacks.
        missing: &'static str,
    },
    /// A schedule that keeps optimizer state on disk, run with no directory for its file;
    /// `held` is the chunks and bytes it keeps there, where known.
    NoDiskDir {
        /// Chunks on disk and the bytes of the disk region.
        held: Option<(usize, u64)>,
    },
    /// A schedule storing tensors in `dtype` on a GPU too old for it: bf16 before compute
    /// capability 8.0, which has no bf16 tensor-core products.
    DtypeOnGpu {
        /// The storage type the GPU lacks, as the schedule names it (`bf16`).
        dtype: String,
        /// The GPU's name.
        device: String,
        /// Its compute capability (major, minor).
        compute_capability: (i32, i32),
        /// The oldest compute capability that has `dtype`.
        needs: (i32, i32),
        /// The storage types this GPU runs (`f16`, `f32`).
        instead: Vec<String>,
    },
}

/// The text of [`RuntimeError::Unsupported`], each setting named by `name`.
pub fn unsupported_text(what: &Unsupported, name: impl Fn(Setting) -> String) -> String {
    let host = |backend: &str| format!("the host backend ({backend} host");
    match what {
        Unsupported::Collectives { ranks, missing } => format!(
            "the schedule runs on {ranks} ranks, but this backend has no {missing}; run it on \
             {}, ranks as threads) or compile it with {} 1 {} 1",
            host(&name(Setting::Backend)),
            name(Setting::Gpus),
            name(Setting::Nodes)
        ),
        Unsupported::DiskTier { chunks, missing } => format!(
            "the schedule keeps the optimizer state of {chunks} chunk(s) on disk, but this \
             backend has no {missing} yet; run it on {}) or compile it with more {} and no {}",
            host(&name(Setting::Backend)),
            name(Setting::HostBudget),
            name(Setting::DiskBudget)
        ),
        Unsupported::DiskFile { path, missing } => format!(
            "the schedule keeps optimizer state on disk ({}), but this backend has no \
             {missing}; run it on {}) or compile without {}",
            path.display(),
            host(&name(Setting::Backend)),
            name(Setting::DiskBudget)
        ),
        Unsupported::NoDiskDir { held } => {
            let held = match held {
                Some((chunks, bytes)) => {
                    format!("the optimizer state of {chunks} chunk(s) on disk ({bytes} bytes)")
                }
                None => "optimizer state on disk".to_string(),
            };
            format!(
                "the schedule keeps {held}, but the executor has no file \
                 for it; give it a directory ({} DIR, Executor::set_disk_dir)",
                name(Setting::DiskDir)
            )
        }
        Unsupported::DtypeOnGpu {
            dtype,
            device,
            compute_capability: (major, minor),
            needs: (need_major, need_minor),
            instead,
        } => {
            let flag = name(Setting::Dtype);
            let instead: Vec<String> = instead.iter().map(|d| format!("{flag} {d}")).collect();
            format!(
                "the schedule stores its tensors in {dtype}, which needs a GPU of compute \
                 capability {need_major}.{need_minor} or newer (its {dtype} tensor-core \
                 products), but {device} has compute capability {major}.{minor}; compile \
                 and train with {}, or run on a GPU of compute capability \
                 {need_major}.{need_minor} or newer",
                instead.join(" or ")
            )
        }
    }
}

/// The text of [`RuntimeError::GroupSize`], each setting named by `name`.
pub fn group_size_text(
    rank: usize,
    world: usize,
    ranks: usize,
    name: impl Fn(Setting) -> String,
) -> String {
    format!(
        "rank {rank}: a group of {world} ranks for a schedule compiled for {ranks}; run it \
         with {} and {} as compiled",
        name(Setting::Gpus),
        name(Setting::Nodes)
    )
}

/// The text of [`RuntimeError::NoCollective`], each setting named by `name`.
pub fn no_collective_text(ranks: usize, name: impl Fn(Setting) -> String) -> String {
    format!(
        "rank 0: the schedule runs on {ranks} ranks and this executor has no collective to \
         reach the others; give it one (Executor::set_collective), as protrain train {} \
         does",
        name(Setting::Gpus)
    )
}

/// How the rendezvous could not hold or reach rank 0's port
/// ([`RuntimeError::RendezvousPort`]).
#[derive(Clone, Debug, PartialEq)]
pub enum PortProblem {
    /// Rank 0 cannot listen: another process holds the port.
    InUse {
        /// Rank 0's `HOST:PORT`.
        master: String,
        /// What the operating system said.
        error: String,
    },
    /// Rank 0 did not answer within `seconds`.
    Unreachable {
        /// Rank 0's `HOST:PORT`.
        master: String,
        /// How long this rank tried.
        seconds: f64,
        /// What the last attempt saw.
        last_error: String,
    },
    /// Something other than a protrain rendezvous answered at rank 0's port.
    Foreign {
        /// Rank 0's `HOST:PORT`.
        master: String,
    },
}

/// The text of a [`PortProblem`], each setting named by `name`. (`MASTER_ADDR` and
/// `MASTER_PORT` are the environment variables torchrun sets, named as they are.)
pub fn port_text(problem: &PortProblem, name: impl Fn(Setting) -> String) -> String {
    let flag = name(Setting::Master);
    match problem {
        PortProblem::InUse { master, error } => format!(
            "cannot listen on {master}: {error}; the port is in use (another run or program \
             holds it); choose another MASTER_PORT (or {flag} HOST:PORT) on every rank"
        ),
        PortProblem::Unreachable {
            master,
            seconds,
            last_error,
        } => format!(
            "could not reach rank 0 at {master} within {seconds:.1} s (last attempt: \
             {last_error}); check that rank 0 was started, that MASTER_ADDR and MASTER_PORT \
             (or {flag}) name its node and port on every rank, and that the port is open \
             between the nodes"
        ),
        PortProblem::Foreign { master } => format!(
            "{master} answered, but not as a protrain rendezvous: another program holds that \
             port; choose a free MASTER_PORT (or {flag} HOST:PORT) on every rank"
        ),
    }
}

/// The text of [`RuntimeError::WeightsNotCheckpoint`], each setting named by `name`.
pub fn weights_not_checkpoint_text(
    path: &Path,
    key: &str,
    name: impl Fn(Setting) -> String,
) -> String {
    format!(
        "checkpoint {} is a safetensors file but not a protrain checkpoint (no `{key}` \
         metadata); pass it as {} weights instead of resuming from it",
        path.display(),
        name(Setting::Init)
    )
}

/// The text of [`RuntimeError::EvalNotForwardOnly`], each setting named by `name`.
pub fn eval_not_forward_only_text(name: impl Fn(Setting) -> String) -> String {
    format!(
        "cannot evaluate: the schedule has a backward pass and an optimizer, so running it \
         would train the weights it should measure; evaluate with a forward-only schedule \
         (`protrain compile MODEL {}`)",
        name(Setting::ForwardOnly)
    )
}

/// The text of [`RuntimeError::EvalOtherModel`], each setting named by `name`.
pub fn eval_other_model_text(first: &str, name: impl Fn(Setting) -> String) -> String {
    format!(
        "cannot evaluate: the evaluation schedule is of another model than the training \
         schedule ({first}); compile it from the same model with {}",
        name(Setting::ForwardOnly)
    )
}

/// The text of [`RuntimeError::Disk`]'s problem, each setting named by `name`.
pub fn disk_text(problem: &DiskProblem, name: impl Fn(Setting) -> String) -> String {
    let dir = name(Setting::DiskDir);
    match problem {
        DiskProblem::BadIoMode { var, value } => format!(
            "{var}={value} is not a way to do disk I/O; set it to `direct` (O_DIRECT), \
             `buffered` (the page cache) or `auto` (O_DIRECT for a file the page cache cannot \
             hold), or unset it"
        ),
        DiskProblem::BadQueueDepth { var, value, most } => format!(
            "{var}={value} is not a number of disk requests to keep in flight; set it to a \
             whole number from 1 (one request at a time) to {most}, or unset it"
        ),
        DiskProblem::NotADirectory => {
            format!(
                "is not a directory; give {dir} a directory on the disk for the optimizer state"
            )
        }
        DiskProblem::CannotUse { error } => format!(
            "cannot be used as {dir} ({error}); create it (mkdir -p) or give another directory"
        ),
        DiskProblem::NoRoom { free, bytes } => format!(
            "has {} free, but the schedule keeps {} of optimizer state on disk; free space \
             there, give a {dir} on a larger disk, or compile with a smaller {} (or more {})",
            protrain_ir::format_bytes(*free),
            protrain_ir::format_bytes(*bytes),
            name(Setting::DiskBudget),
            name(Setting::HostBudget)
        ),
        DiskProblem::CannotCreate { file, error } => format!(
            "cannot create the state file {} in it ({error}); check that the directory is \
             writable or give another {dir}",
            file.display()
        ),
        DiskProblem::CannotAllocate { bytes, error } => format!(
            "cannot hold the {} of optimizer state the schedule keeps on disk ({error}); free \
             space there or give a {dir} on a larger disk",
            protrain_ir::format_bytes(*bytes)
        ),
        DiskProblem::Io {
            doing,
            offset,
            error,
            cause,
            bytes,
        } => {
            let way_out = match cause {
                DiskIoCause::Full => format!(
                    "the disk is full: the schedule needs {bytes} bytes there; free space or give \
                     another {dir}"
                ),
                DiskIoCause::Truncated => "the file is shorter than the disk region: something \
                                           truncated it; resume from the last checkpoint"
                    .into(),
                DiskIoCause::Other => "check the disk and resume from the last checkpoint".into(),
            };
            format!("{doing} at offset {offset:#x} failed ({error}); {way_out}")
        }
        DiskProblem::Vanished { error } => format!(
            "the optimizer state file vanished ({error}): something removed it while the run \
             used it; keep {dir} out of reach of cleaners and resume from the last checkpoint \
             ({})",
            name(Setting::Resume)
        ),
    }
}
