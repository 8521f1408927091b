//! One module per subcommand, plus the argument groups they share.

pub mod compile;
pub mod dump;
pub mod eval;
pub mod info;
pub mod launch;
pub mod models;
pub mod paths;
pub mod plot;
pub mod profile;
pub mod run;
pub mod schedule;
pub mod train;

use protrain::compiler::comm::Topology;
use protrain::compiler::split::Split;
use protrain::ir::{format_bytes, DType, HardwareProfile};
use protrain::models::ModelConfig;
use protrain::size::parse_size;
use protrain::{default_shape, CompileOptions, Error, PolicyChoice, Result};
use std::path::Path;

/// Writes `text` to `path` atomically (a full disk leaves the old file, not part of a new
/// one), or to standard output when there is no path. `inputs` are the files the command
/// read, which `path` must not be; nor may it be a device or anything else but a regular file
/// ([`protrain::ir::output::check_target`]).
pub fn write_output(path: Option<&Path>, inputs: &[&Path], text: &str) -> Result<()> {
    match path {
        Some(path) => protrain::ir::output::write_atomic_checked(path, inputs, |w| {
            w.write_all(text.as_bytes())
        })
        .map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        }),
        None => {
            crate::out::write_all(text.as_bytes());
            Ok(())
        }
    }
}

/// Fails unless `path` may be written: not a device or directory, not one of `inputs`.
/// Commands call it before their work, so that a long run does not end unable to write.
pub fn check_output(path: &Path, inputs: &[&Path]) -> Result<()> {
    protrain::ir::output::check_target(path, inputs).map_err(|source| Error::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The files a MODEL argument may name: the path itself and, for a directory, its config.json.
pub fn model_inputs(model: &str) -> [std::path::PathBuf; 2] {
    let path = Path::new(model);
    [path.to_path_buf(), path.join("config.json")]
}

/// The sequence length to use: the one asked for, else `default` capped at the model's
/// position limit.
pub fn seq_or_default(config: &ModelConfig, seq: Option<u64>, default: u64) -> u64 {
    seq.unwrap_or_else(|| default.min(config.max_position_embeddings))
}

/// Element types a schedule can be compiled for.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bfloat16 parameters and activations (fp32 master weights and Adam moments).
    Bf16,
    /// IEEE half-precision parameters, gradients and activations (fp32 master weights and
    /// Adam moments, fp32 arithmetic) with dynamic loss scaling as torch.cuda.amp.GradScaler
    /// does it (see `run --help`, --loss-scale-init).
    F16,
    /// f32 everywhere: what the host runtime executes, bit for bit.
    F32,
}

impl Dtype {
    /// The IR's element type.
    pub fn ir(self) -> DType {
        match self {
            Dtype::Bf16 => DType::BF16,
            Dtype::F16 => DType::F16,
            Dtype::F32 => DType::F32,
        }
    }

    /// The flag value of the IR's element type `dtype` (f32 for any type a schedule is not
    /// compiled for).
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Dtype::Bf16,
            DType::F16 => Dtype::F16,
            DType::F32 | DType::I32 => Dtype::F32,
        }
    }
}

/// The machine a schedule is compiled for, shared by `compile`, `dump`, `train` and `profile`'s
/// siblings.
#[derive(clap::Args, Debug, Clone)]
pub struct MachineArgs {
    /// The machine: a preset (host, rtx3090, rtx4090, a100-40gb, a100-80gb, h100, h200) or a
    /// profile JSON written by `protrain profile`. It decides the plan, the predicted step
    /// time and the defaults of --batch, --seq and --dtype [default: host].
    #[arg(long)]
    pub hardware: Option<String>,
    /// Device memory the schedule may use on each GPU (a budget per GPU, whatever --gpus
    /// and --nodes), e.g. 24GiB, 512MiB or plain bytes; at most what the hardware leaves
    /// usable [default: the hardware's memory less its reserved bytes]. A tight budget makes
    /// the plan stream parameter chunks and swap or recompute activations; the losses stay
    /// the same bits.
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<String>,
    /// Host memory of each node the schedule may use for offloaded state (a budget per node:
    /// with --gpus N its N ranks share it, each planned within 1/N of it) [default: the
    /// hardware profile's, per node].
    #[arg(long, value_name = "SIZE")]
    pub host_memory: Option<String>,
    /// Disk of each node the schedule may use for model states that host memory cannot hold
    /// (the f32 master weights and Adam moments of offloaded chunks, read and written around
    /// the CPU Adam on a disk i/o stream; where that is not enough, their bf16 parameters and
    /// gradients too, read before each upload and written after each gradient offload), e.g.
    /// 2TiB (a budget per node, shared by its ranks as --host-memory is) [default: none]. Used
    /// only when host memory binds; `train` and `run` then need --disk-dir for the file.
    #[arg(long, value_name = "SIZE")]
    pub disk_memory: Option<String>,
}

impl MachineArgs {
    /// The hardware profile with the host-memory and disk overrides applied, and the device
    /// budget. A device budget over what the hardware leaves usable is refused: the plan
    /// could not run.
    pub fn profile(&self) -> Result<(HardwareProfile, Option<u64>)> {
        let mut profile = HardwareProfile::load(self.hardware.as_deref().unwrap_or("host"))?;
        if let Some(host) = &self.host_memory {
            profile = profile.with_host_memory(parse_size(host)?);
        }
        if let Some(disk) = &self.disk_memory {
            profile = profile.with_disk_memory(parse_size(disk)?);
        }
        let budget = self.gpu_memory.as_deref().map(parse_size).transpose()?;
        if let Some(budget) = budget {
            check_device_budget(budget, &profile)?;
        }
        Ok((profile, budget))
    }

    /// The flags given, by name, for a command that cannot use them.
    pub fn given(&self) -> Vec<&'static str> {
        let mut given = Vec::new();
        if self.hardware.is_some() {
            given.push("--hardware");
        }
        if self.gpu_memory.is_some() {
            given.push("--gpu-memory");
        }
        if self.host_memory.is_some() {
            given.push("--host-memory");
        }
        if self.disk_memory.is_some() {
            given.push("--disk-memory");
        }
        given
    }
}

/// Fails unless a `--gpu-memory` of `budget` bytes fits `profile`'s device: its memory less
/// the bytes it reserves (context, library workspaces), the most a schedule can use.
pub fn check_device_budget(budget: u64, profile: &HardwareProfile) -> Result<()> {
    let usable = profile.usable_device_bytes();
    if budget <= usable {
        return Ok(());
    }
    let reserved = match profile.reserved_device_bytes {
        0 => String::new(),
        r => format!(
            " less the {} it reserves (CUDA context, library workspaces)",
            format_bytes(r)
        ),
    };
    Err(Error::Usage(format!(
        "--gpu-memory {} is more than the {} device has: {} of device memory{reserved} leaves \
         {} for a schedule, and a plan over it could not run; give --gpu-memory {} or less \
         (it is per GPU), leave it out to use all of it, or pick the hardware the schedule \
         runs on (--hardware)",
        format_bytes(budget),
        profile.name,
        format_bytes(profile.device_memory_bytes),
        format_bytes(usable),
        format_bytes(usable),
    )))
}

/// The shape and element type of a step, shared by every command that builds a model's
/// graphs. Their defaults come from the hardware, the same for every command, so a schedule
/// compiled with the defaults runs with the defaults.
#[derive(clap::Args, Debug, Clone)]
pub struct ShapeArgs {
    /// Sequences per step [default: 8 on host hardware, 1 on a GPU].
    #[arg(long)]
    pub batch: Option<u64>,
    /// Tokens per sequence [default: 64 on host hardware, 1024 on a GPU; at most the model's
    /// position limit].
    #[arg(long)]
    pub seq: Option<u64>,
    /// Element type of parameters and activations [default: f32 on host hardware; bf16 with
    /// f32 master weights on a GPU]. Both backends run f32, bf16 and f16 schedules, the host
    /// rounding where the CUDA backend rounds. f16 trains with dynamic loss scaling: the loss
    /// gradient is multiplied by a scale, the gradients unscaled in f32 before clipping and
    /// AdamW, and a step whose f16 gradients overflow is skipped (see --loss-scale-init).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
}

impl ShapeArgs {
    /// Batch, sequence length and element type for `config` on `hardware`.
    pub fn resolve(&self, config: &ModelConfig, hardware: &HardwareProfile) -> (u64, u64, DType) {
        let (batch, seq, dtype) = default_shape(hardware);
        (
            self.batch.unwrap_or(batch),
            seq_or_default(config, self.seq, seq),
            self.dtype.map_or(dtype, Dtype::ir),
        )
    }
}

/// Everything `compile`, `dump` and `train` share to make a schedule.
#[derive(clap::Args, Debug, Clone)]
pub struct CompileArgs {
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub shape: ShapeArgs,
    /// `auto` searches for the fastest policy that fits; or give one as key=value pairs
    /// separated by commas or spaces (the form `compile` prints, so a printed policy can be
    /// passed back): n_persist (chunks kept on the device), n_buffer (chunk buffers),
    /// prefetch (chunks fetched ahead), n_swap and n_checkpoint (blocks swapped and
    /// recomputed, in ProTrain's interleaved layout), or blocks=S3C2K27 (a mode per run of
    /// layers, keep, checkpoint or swap, with the run's length; or one letter per layer,
    /// blocks=SSSCCKKK...). Keys left out take their defaults: everything persistent and
    /// kept.
    #[arg(long, default_value = "auto")]
    pub policy: String,
    /// Do not fuse the forward graph (q/k/v and gate/up matmuls, activation and residual
    /// epilogues). Fusion changes no result; this is for comparing and debugging.
    #[arg(long)]
    pub no_fuse: bool,
    /// Gradient accumulation: K micro-batches of --batch sequences per optimizer step, their
    /// gradients summed (in micro-batch order) before one clip and one AdamW update. Step s
    /// reads the rows one batch of K x --batch sequences would, so `--batch B --grad-accum
    /// K` trains as `--batch K*B` does (up to rounding) in the memory of a batch of B, plus
    /// one gradient accumulator per parameter (on the device for persistent chunks, in host
    /// memory for offloaded ones). The loss of a step is the mean over all its positions
    /// [default: 1; with train --resume, the checkpointed run's].
    #[arg(long, value_name = "K")]
    pub grad_accum: Option<u64>,
    /// Rows (sequences) per optimizer step over all ranks, split by the compiler: it compiles
    /// every split B x K x ranks = ROWS (B rows a micro-batch, B dividing ROWS / ranks, K
    /// micro-batches accumulated) and keeps the one whose predicted step is fastest (the CPU
    /// Adam, paid once a step, is amortised over K micro-batches where that is faster),
    /// printing which it chose and why. Not with --batch or --grad-accum, which give the
    /// split yourself. Without any of the three, a --batch that does not fit the memory
    /// budgets in one micro-batch is split into the fewest micro-batches that fit, which
    /// train on the same rows in the same order.
    #[arg(long, value_name = "ROWS")]
    pub global_batch: Option<u64>,
    /// Data parallelism: GPUs (ranks) per node. Every rank runs the same schedule on its own
    /// rows of the global batch (ranks x K x --batch sequences per step, the rows one rank
    /// with --grad-accum ranks*K would read) and the gradients are summed over the ranks
    /// (all-reduce on a collective stream) before clipping and AdamW; offloaded chunks are
    /// sharded over the ranks (ZeRO-3 style: each rank keeps 1/N of their host state, with
    /// --grad-accum of their accumulators too), persistent ones replicated. The loss printed
    /// is the mean over all ranks.
    /// Checked against the hardware's interconnect; on host hardware the ranks are threads of
    /// one process exchanging through memory (the host backend's stand-in for NCCL); `train
    /// --backend cuda` starts one process per GPU, whose collectives are NCCL's [default: 1].
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// Nodes of --gpus GPUs each, for data parallelism across machines (collectives costed
    /// as hierarchical rings over the hardware's network) [default: 1].
    #[arg(long, value_name = "M")]
    pub nodes: Option<u32>,
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
}

impl CompileArgs {
    /// How the step's rows are cut into micro-batches: the compiler's choice for
    /// --global-batch, the user's for --grad-accum, else --batch split only where it does
    /// not fit. Refuses --global-batch with --batch or --grad-accum.
    pub fn split(&self) -> Result<Split> {
        match (self.global_batch, self.shape.batch, self.grad_accum) {
            (Some(rows), None, None) => Ok(Split::Global { rows }),
            (Some(rows), batch, accum) => {
                let given: Vec<String> = [
                    batch.map(|b| format!("--batch {b}")),
                    accum.map(|k| format!("--grad-accum {k}")),
                ]
                .into_iter()
                .flatten()
                .collect();
                Err(Error::Usage(format!(
                    "--global-batch {rows} with {}: --global-batch asks the compiler to choose \
                     the micro-batch rows and the accumulation, which {}; drop {}, or \
                     drop --global-batch to choose the split yourself (rows per step = \
                     --batch x --grad-accum x ranks)",
                    given.join(" and "),
                    if given.len() == 1 {
                        "it sets"
                    } else {
                        "they set"
                    },
                    if given.len() == 1 { "it" } else { "them" },
                )))
            }
            (None, _, Some(_)) => Ok(Split::Exact),
            (None, _, None) => Ok(Split::IfNeeded),
        }
    }

    /// The compile options these flags describe for `config`.
    pub fn options(&self, config: &ModelConfig) -> Result<CompileOptions> {
        let (hardware, device_budget) = self.machine.profile()?;
        let topology = Topology {
            gpus: self.gpus.unwrap_or(1),
            nodes: self.nodes.unwrap_or(1),
        };
        // On the host the ranks are threads of this process; its memory links them.
        let hardware = match hardware.is_host() && topology.ranks() > 1 {
            true => hardware.with_thread_ranks(topology.gpus),
            false => hardware,
        };
        let (batch, seq, dtype) = self.shape.resolve(config, &hardware);
        Ok(CompileOptions {
            batch,
            seq,
            dtype,
            hardware,
            device_budget,
            policy: PolicyChoice::parse(&self.policy)?,
            optimizer: self.optimizer.config(),
            fuse: !self.no_fuse,
            forward_only: false,
            micro_batches: self.grad_accum.unwrap_or(1),
            topology,
        })
    }
}

/// A host or disk budget of a compiled schedule in words: the rank's `per_rank` bytes and,
/// where several ranks share a node, the node's `node` bytes as given (`--host-memory` and
/// `--disk-memory` are per node): `15.00 GiB per rank (the node's 120.0 GiB of --host-memory
/// shared by --gpus 8)`, or `120.0 GiB` for one rank a node.
pub fn per_rank_budget(
    per_rank: u64,
    node: u64,
    schedule: &protrain::ir::Schedule,
    flag: &str,
) -> String {
    match schedule.topology().0 {
        0 | 1 => format_bytes(per_rank),
        gpus => format!(
            "{} per rank (the node's {} of {flag} shared by --gpus {gpus})",
            format_bytes(per_rank),
            format_bytes(node)
        ),
    }
}

/// Prints the compiler's warnings on standard error.
pub fn warn(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

/// AdamW settings, shared by `train` and `compile` (a schedule carries them in its optimizer
/// ops). Defaults suit the small models protrain trains on the host; a flag left out is
/// `None` here, so that `train --resume` can take the checkpoint's setting instead.
#[derive(clap::Args, Debug, Clone)]
pub struct OptimizerArgs {
    /// AdamW learning rate: the peak of the learning-rate schedule (--lr-schedule)
    /// [default: 0.003].
    #[arg(long)]
    pub lr: Option<f64>,
    /// AdamW first-moment decay [default: 0.9].
    #[arg(long)]
    pub beta1: Option<f64>,
    /// AdamW second-moment decay [default: 0.95].
    #[arg(long)]
    pub beta2: Option<f64>,
    /// AdamW epsilon, added to the root of the second moment [default: 1e-8].
    #[arg(long)]
    pub eps: Option<f64>,
    /// AdamW decoupled weight decay, applied to every parameter [default: 0].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Scale gradients down to this global norm when larger (clip_grad_norm_); off by default.
    #[arg(long, value_name = "NORM")]
    pub grad_clip: Option<f64>,
}

impl OptimizerArgs {
    /// The defaults of the flags left out.
    pub const DEFAULT: protrain::OptimizerConfig = protrain::OptimizerConfig {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        grad_clip: None,
    };

    /// The optimizer these flags describe, with defaults for those left out.
    pub fn config(&self) -> protrain::OptimizerConfig {
        let d = Self::DEFAULT;
        protrain::OptimizerConfig {
            lr: self.lr.unwrap_or(d.lr),
            beta1: self.beta1.unwrap_or(d.beta1),
            beta2: self.beta2.unwrap_or(d.beta2),
            eps: self.eps.unwrap_or(d.eps),
            weight_decay: self.weight_decay.unwrap_or(d.weight_decay),
            grad_clip: self.grad_clip.or(d.grad_clip),
        }
    }
}

/// Where the predicted time of one pass of the streams goes, busy seconds by kind of work
/// (the simulation's span categories): compute kernels, the CPU Adam, PCIe copies (both
/// directions), disk reads and writes, collectives. Kinds with no work are left out. Streams
/// overlap, so the parts add up to more than the step.
pub fn time_by_kind(sim: &protrain::compiler::simulate::Simulation) -> Vec<(&'static str, f64)> {
    use protrain::compiler::simulate::category;
    let kinds: [(&str, &[&str]); 5] = [
        ("compute", &[category::COMPUTE, category::D2D]),
        ("cpu adam", &[category::CPU_ADAM]),
        ("pcie", &[category::H2D, category::D2H]),
        ("disk", &[category::DISK]),
        ("collectives", &[category::COMM]),
    ];
    kinds
        .iter()
        .map(|(name, cats)| {
            let busy = sim
                .timeline
                .iter()
                .filter(|span| cats.contains(&span.category))
                .map(|span| span.end - span.start)
                .sum::<f64>();
            (*name, busy)
        })
        .filter(|&(_, busy)| busy > 0.0)
        .collect()
}

/// [`time_by_kind`] as text: `compute 0.41 s, cpu adam 0.30 s, disk 0.79 s`.
pub fn time_by_kind_text(sim: &protrain::compiler::simulate::Simulation) -> String {
    time_by_kind(sim)
        .iter()
        .map(|(kind, busy)| format!("{kind} {busy:.4} s"))
        .collect::<Vec<_>>()
        .join(", ")
}
