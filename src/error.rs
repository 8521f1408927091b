//! The CLI's and facade's error type: every crate's errors, plus the CLI's own.

use std::path::PathBuf;

/// Anything protrain can fail with. The message names the problem and the way out.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A model could not be loaded or built.
    #[error(transparent)]
    Model(#[from] protrain_models::ModelError),
    /// The IR rejected something.
    #[error(transparent)]
    Ir(#[from] protrain_ir::IrError),
    /// The compiler rejected something; worded with the flags that set what it names
    /// ([`compile_message`]).
    #[error("{}", compile_message(.0))]
    Compile(#[from] protrain_compiler::CompileError),
    /// The runtime failed ([`runtime_text`] words it).
    #[error("{}", runtime_text(.0))]
    Runtime(#[from] protrain_runtime::RuntimeError),
    /// An output file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        #[source]
        source: std::io::Error,
    },
    /// A worker process of a multi-process run failed (the launcher stopped the others), or
    /// could not be started or watched. The text names the rank and shows its error.
    #[error("{0}")]
    Launcher(String),
    /// A byte size does not parse ([`crate::size::parse_size`]).
    #[error("invalid size `{input}`: {why} (examples: 24GiB, 512MiB, 1.5GB, 1000)")]
    BadSize {
        /// The text given.
        input: String,
        /// What is wrong with it.
        why: String,
    },
    /// Arguments that parse but do not make sense together.
    #[error("{0}")]
    Usage(String),
}

impl protrain_runtime::thread_ranks::RankFailure for Error {
    fn caused_by_another_rank(&self) -> bool {
        matches!(self, Error::Runtime(e) if e.caused_by_another_rank())
    }
}

/// A runtime error in the CLI's words: a refusal for want of host memory names the
/// `protrain compile` flag of each region's budget, where the runtime names the budget; every
/// other setting an error names is named by its flag ([`setting_flag`]).
fn runtime_text(e: &protrain_runtime::RuntimeError) -> String {
    use protrain_runtime::error::{host_memory_short_text, Budget};
    match e {
        protrain_runtime::RuntimeError::HostMemoryShort { regions, available } => {
            let flag = |budget| match budget {
                Budget::Device => "--gpu-memory".to_string(),
                Budget::Host => "--host-memory".to_string(),
            };
            format!(
                "cannot execute the schedule: {}",
                host_memory_short_text(regions, *available, flag)
            )
        }
        protrain_runtime::RuntimeError::InvalidLossScale(problem) => format!(
            "invalid loss scaling: {}",
            protrain_runtime::error::loss_scale_text(problem, |setting| {
                loss_scale_flag(setting).into()
            })
        ),
        protrain_runtime::RuntimeError::NodeLaunch(problem) => format!(
            "launch settings: {}",
            protrain_runtime::error::node_launch_text(problem, |setting| {
                node_flag(setting).into()
            })
        ),
        protrain_runtime::RuntimeError::InvalidLrSchedule(problem) => {
            protrain_runtime::error::lr_schedule_text(problem, |setting| lr_flag(setting).into())
        }
        e => e.worded(|setting| setting_flag(setting).into()),
    }
}

/// A compiler error in the CLI's words: where the error carries the figures a flag set
/// (`--gpus`, `--nodes`, `--grad-accum`, `--forward-only`, `--gpu-memory`, `--policy`) or
/// the budgets no policy fits ([`compile_flag`]), the message names the flag and the way
/// out; any other error says what the compiler says.
pub fn compile_message(e: &protrain_compiler::CompileError) -> String {
    use protrain_compiler::CompileError as E;
    use protrain_ir::format_bytes;
    match e {
        E::NoRanks { gpus, nodes } => {
            format!("--gpus {gpus} --nodes {nodes}: both must be at least 1")
        }
        E::TooManyGpus {
            gpus,
            per_node,
            hardware,
        } => format!(
            "--gpus {gpus} is more than the {per_node} GPUs of one {hardware} node; use --nodes \
             for more"
        ),
        E::NoMicroBatches => "--grad-accum 0: a step takes at least one micro-batch".into(),
        E::ForwardOnlyRanks { gpus, nodes } => format!(
            "--gpus {gpus} --nodes {nodes} with --forward-only: evaluation runs on one rank; \
             drop --gpus and --nodes"
        ),
        E::ForwardOnlyAccumulation { micro_batches } => format!(
            "--grad-accum {micro_batches} with --forward-only: accumulation splits a training \
             step, and a forward-only schedule has none; drop one of the two"
        ),
        E::UnevenMicroBatches {
            micro_batches,
            ranks,
        } => format!(
            "the loss gradient is scaled for {micro_batches} micro-batches, which {ranks} ranks \
             cannot share; scale it for ranks x --grad-accum"
        ),
        E::PolicyOverDevice {
            policy,
            need,
            budget,
        } => format!(
            "policy {policy} needs {} of device memory, more than the {} of device memory per \
             GPU (--gpu-memory); use --policy auto or a larger --gpu-memory",
            format_bytes(*need),
            format_bytes(*budget)
        ),
        E::GlobalBatchZero => {
            "--global-batch 0: a step takes at least one row; give the rows per step".into()
        }
        E::GlobalBatchNotDivisible { rows, ranks } => format!(
            "--global-batch {rows} cannot be shared by {ranks} ranks (--gpus x --nodes): give \
             a multiple of {ranks}, e.g. {}",
            (rows / ranks + 1) * ranks
        ),
        E::NoSplitFits { rows, source } => format!(
            "batch {rows} does not fit even as {rows} micro-batches of 1 row, accumulated; at 1 \
             row: {}",
            compile_message(source)
        ),
        E::BudgetTooSmall(shortfall) => shortfall.text(&|setting| compile_flag(setting).into()),
        e => e.to_string(),
    }
}

/// The flag that sets a compilation's `setting`.
fn compile_flag(setting: protrain_compiler::error::Setting) -> &'static str {
    use protrain_compiler::error::Setting;
    match setting {
        Setting::DeviceBudget => "--gpu-memory",
        Setting::HostBudget => "--host-memory",
        Setting::DiskBudget => "--disk-memory",
        Setting::Gpus => "--gpus",
        Setting::Nodes => "--nodes",
        Setting::Policy => "--policy",
        Setting::Batch => "--batch",
        Setting::MicroBatches => "--grad-accum",
        Setting::Seq => "--seq",
        Setting::GradClip => "--grad-clip",
    }
}

/// The flag that gives a learning-rate schedule's `setting`.
fn lr_flag(setting: protrain_runtime::error::LrSetting) -> &'static str {
    use protrain_runtime::error::LrSetting;
    match setting {
        LrSetting::Lr => "--lr",
        LrSetting::MinLr => "--min-lr",
        LrSetting::DecaySteps => "--decay-steps",
        LrSetting::Schedule => "--lr-schedule",
    }
}

/// The flag that gives a run's `setting` (for the budgets, `protrain compile`'s flag).
fn setting_flag(setting: protrain_runtime::error::Setting) -> &'static str {
    use protrain_runtime::error::Setting;
    match setting {
        Setting::Lr => "--lr",
        Setting::LrSchedule => "--lr-schedule",
        Setting::WarmupSteps => "--warmup-steps",
        Setting::DecaySteps => "--decay-steps",
        Setting::MinLr => "--min-lr",
        Setting::Seed => "--seed",
        Setting::Data => "--data",
        Setting::Tokenizer => "--tokenizer",
        Setting::LossScaleInit => "--loss-scale-init",
        Setting::LossScaleGrowthInterval => "--loss-scale-growth-interval",
        Setting::Resume => "--resume",
        Setting::CheckpointDir => "--checkpoint-dir",
        Setting::GradClip => "--grad-clip",
        Setting::Dtype => "--dtype",
        Setting::DiskDir => "--disk-dir",
        Setting::DiskBudget => "--disk-memory",
        Setting::HostBudget => "--host-memory",
        Setting::Backend => "--backend",
        Setting::Gpus => "--gpus",
        Setting::Nodes => "--nodes",
        Setting::ForwardOnly => "--forward-only",
        Setting::Init => "--init",
        Setting::Master => "--master",
    }
}

/// The flag that sets a loss-scaling setting.
fn loss_scale_flag(setting: protrain_runtime::error::LossScaleSetting) -> &'static str {
    use protrain_runtime::error::LossScaleSetting;
    match setting {
        LossScaleSetting::Init => "--loss-scale-init",
        LossScaleSetting::GrowthInterval => "--loss-scale-growth-interval",
        LossScaleSetting::Dtype => "--dtype",
    }
}

/// The flag that sets a setting of one node's launch.
fn node_flag(setting: protrain_runtime::error::NodeSetting) -> &'static str {
    use protrain_runtime::error::NodeSetting;
    match setting {
        NodeSetting::Nodes => "--nodes",
        NodeSetting::Gpus => "--gpus",
        NodeSetting::NodeRank => "--node-rank",
        NodeSetting::Master => "--master",
    }
}

/// The facade's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use protrain_compiler::CompileError as E;
    use protrain_runtime::error::{HostRegion, MemoryNeed};
    use protrain_runtime::RuntimeError;

    #[test]
    fn a_host_memory_refusal_names_the_flag_of_each_budget() {
        let regions = vec![
            MemoryNeed {
                region: HostRegion::DeviceArena,
                bytes: 3 << 30,
            },
            MemoryNeed {
                region: HostRegion::HostRegion,
                bytes: 2 << 30,
            },
        ];
        let e = Error::from(RuntimeError::HostMemoryShort {
            regions,
            available: 4 << 30,
        });
        assert_eq!(
            e.to_string(),
            "cannot execute the schedule: the device arena (3.00 GiB) and host region \
             (2.00 GiB) need 5.00 GiB of host memory, but only 4.00 GiB is available on this \
             machine (1.00 GiB missing); free memory, or compile the schedule for less with \
             --gpu-memory and --host-memory"
        );
        let pinned = Error::from(RuntimeError::HostMemoryShort {
            regions: vec![MemoryNeed {
                region: HostRegion::PinnedHostRegion,
                bytes: 2 << 30,
            }],
            available: 1 << 30,
        });
        assert!(
            pinned
                .to_string()
                .ends_with("pinned host region (2.00 GiB) needs 2.00 GiB of host memory, but only 1.00 GiB is available on this machine (1.00 GiB missing); free memory, or compile the schedule for less with --host-memory"),
            "{pinned}"
        );
    }

    #[test]
    fn learning_rate_schedule_errors_name_the_flags() {
        use protrain_runtime::error::LrScheduleProblem;
        let text = |problem| Error::from(RuntimeError::InvalidLrSchedule(problem)).to_string();
        assert_eq!(
            text(LrScheduleProblem::Peak { peak: -1.0 }),
            "the peak learning rate -1 must be a finite number >= 0; give another --lr"
        );
        assert_eq!(
            text(LrScheduleProblem::MinLr {
                min_lr: 0.5,
                peak: 0.1
            }),
            "--min-lr 0.5 must be a finite number between 0 and the peak learning rate 0.1 (--lr)"
        );
        assert_eq!(
            text(LrScheduleProblem::MinLrWithoutDecay { min_lr: 0.001 }),
            "--min-lr 0.001 applies to the linear and cosine schedules, which decay; the \
             constant schedule stays at --lr. Drop --min-lr or choose --lr-schedule linear or \
             cosine"
        );
        assert_eq!(
            text(LrScheduleProblem::DecayWithoutDecay { decay_steps: 7 }),
            "--decay-steps 7 applies to the linear and cosine schedules; the constant schedule \
             does not decay. Drop --decay-steps or choose --lr-schedule linear or cosine"
        );
        assert_eq!(
            text(LrScheduleProblem::PeakNotCompiled {
                peak: 0.01,
                compiled: 0.003
            }),
            "the learning-rate schedule peaks at 0.01 but the schedule's AdamW ops were compiled \
             with lr 0.003; the peak is the compiled rate: compile with --lr 0.01"
        );
        // The runtime names the run settings' fields instead.
        let runtime = RuntimeError::InvalidLrSchedule(LrScheduleProblem::DecayWithoutDecay {
            decay_steps: 7,
        })
        .to_string();
        assert!(runtime.starts_with("decay_steps 7 applies"), "{runtime}");
        assert!(!runtime.contains("--"), "{runtime}");
    }

    #[test]
    fn other_runtime_errors_read_as_the_runtime_words_them() {
        let e = RuntimeError::BadSchedule("an operand it cannot read".into());
        assert_eq!(
            Error::from(e).to_string(),
            "cannot execute the schedule: an operand it cannot read"
        );
    }

    /// The compiler's errors carry figures; the CLI names the flags that set them, in the
    /// words the CLI has always printed.
    #[test]
    fn compiler_errors_are_worded_with_their_flags() {
        let cases = [
            (
                E::NoRanks { gpus: 0, nodes: 1 },
                "--gpus 0 --nodes 1: both must be at least 1",
            ),
            (
                E::TooManyGpus {
                    gpus: 8,
                    per_node: 4,
                    hardware: "rtx3090".into(),
                },
                "--gpus 8 is more than the 4 GPUs of one rtx3090 node; use --nodes for more",
            ),
            (
                E::NoMicroBatches,
                "--grad-accum 0: a step takes at least one micro-batch",
            ),
            (
                E::ForwardOnlyRanks { gpus: 2, nodes: 1 },
                "--gpus 2 --nodes 1 with --forward-only: evaluation runs on one rank; drop \
                 --gpus and --nodes",
            ),
            (
                E::ForwardOnlyAccumulation { micro_batches: 4 },
                "--grad-accum 4 with --forward-only: accumulation splits a training step, and \
                 a forward-only schedule has none; drop one of the two",
            ),
            (
                E::UnevenMicroBatches {
                    micro_batches: 3,
                    ranks: 2,
                },
                "the loss gradient is scaled for 3 micro-batches, which 2 ranks cannot share; \
                 scale it for ranks x --grad-accum",
            ),
            (
                E::PolicyOverDevice {
                    policy: "n_persist=1".into(),
                    need: 3 << 30,
                    budget: 2 << 30,
                },
                "policy n_persist=1 needs 3.00 GiB of device memory, more than the 2.00 GiB of \
                 device memory per GPU (--gpu-memory); use --policy auto or a larger \
                 --gpu-memory",
            ),
            (
                E::GlobalBatchZero,
                "--global-batch 0: a step takes at least one row; give the rows per step",
            ),
            (
                E::GlobalBatchNotDivisible { rows: 9, ranks: 2 },
                "--global-batch 9 cannot be shared by 2 ranks (--gpus x --nodes): give a \
                 multiple of 2, e.g. 10",
            ),
            (
                E::NoSplitFits {
                    rows: 8,
                    source: Box::new(E::PolicyOverDevice {
                        policy: "n_persist=1".into(),
                        need: 3 << 30,
                        budget: 2 << 30,
                    }),
                },
                "batch 8 does not fit even as 8 micro-batches of 1 row, accumulated; at 1 row: \
                 policy n_persist=1 needs 3.00 GiB of device memory, more than the 2.00 GiB of \
                 device memory per GPU (--gpu-memory); use --policy auto or a larger \
                 --gpu-memory",
            ),
        ];
        for (e, want) in cases {
            let library = e.to_string();
            assert!(
                !library.contains("--"),
                "the library names a flag: {library}"
            );
            assert_eq!(Error::from(e).to_string(), want);
        }
    }

    /// `(error, what its library text must hold, the CLI's text)`.
    type Case = (RuntimeError, &'static [&'static str], &'static str);

    /// Runtime errors that name a run's settings: the library names each by its field (and
    /// no flag), the CLI by its flag, in the words the CLI has always printed.
    fn check_settings_named(cases: Vec<Case>) {
        for (e, library_names, cli) in cases {
            let library = e.to_string();
            assert!(
                !library.contains("--"),
                "the library names a flag: {library}"
            );
            for name in library_names {
                assert!(library.contains(name), "no `{name}` in: {library}");
            }
            assert_eq!(Error::from(e).to_string(), cli);
        }
    }

    #[test]
    fn data_and_checkpoint_errors_name_settings_as_fields_and_the_cli_as_flags() {
        use protrain_runtime::error::{DataLabel, Difference, Setting};
        check_settings_named(vec![
            (
                RuntimeError::DataOutOfVocab {
                    data: DataLabel::File {
                        setting: Setting::Data,
                        path: "t.npy".into(),
                    },
                    token: "-5".into(),
                    position: 15,
                    vocab: 256,
                },
                &["data t.npy: token -5"],
                "--data t.npy: token -5 at position 15 is outside the vocabulary of 256 tokens; \
                 check that it was tokenized for this model (its vocab_size)",
            ),
            (
                RuntimeError::UnknownTokenFormat {
                    path: "c.txt".into(),
                },
                &["add tokenizer tokenizer.json"],
                "c.txt: unknown token file format; pass a `.npy` file (a 1-D integer array) or \
                 a `.bin` file (raw little-endian u16 tokens), or, for a UTF-8 text corpus, add \
                 --tokenizer tokenizer.json (a Hugging Face tokenizer) to tokenize it",
            ),
            (
                RuntimeError::ForeignCheckpointDir {
                    dir: "ck".into(),
                    count: 2,
                    newest: 9,
                },
                &["with resume ck"],
                "checkpoint directory ck already holds 2 checkpoint(s), up to step 9, of another \
                 run; keeping the newest would delete this run's. Continue that run with \
                 --resume ck, or give an empty directory",
            ),
            (
                RuntimeError::CheckpointDirInUse {
                    dir: "ck".into(),
                    pid: Some(7),
                },
                &["another checkpoint_dir"],
                "checkpoint directory ck is in use by another run (PID 7); two runs on one \
                 directory delete each other's checkpoints: wait for that run to end, or give \
                 this one another --checkpoint-dir",
            ),
            (
                RuntimeError::CheckpointMismatch {
                    path: "ck/s.safetensors".into(),
                    differences: vec![
                        Difference::Setting {
                            setting: Setting::WarmupSteps,
                            checkpoint: "2".into(),
                            run: "5".into(),
                        },
                        Difference::DataOverSynthetic {
                            path: "/t.npy".into(),
                        },
                        Difference::Other("optimizer: the checkpoint has lr=1".into()),
                    ],
                },
                &[
                    "warmup_steps: the checkpoint has 2",
                    "this run has data /t.npy",
                ],
                "checkpoint ck/s.safetensors was written by another training run:\n  \
                 --warmup-steps: the checkpoint has 2, this run has 5\n  data: the checkpoint \
                 has the synthetic corpus, this run has --data /t.npy\n  optimizer: the \
                 checkpoint has lr=1\nresume it with the model, batch, seq and optimizer \
                 settings it was written with (settings left out are taken from the \
                 checkpoint, so drop the ones that differ), or start afresh with another \
                 checkpoint directory",
            ),
            (
                RuntimeError::RunDataMissing {
                    checkpoint: "ck".into(),
                    data: "/t.npy".into(),
                },
                &["new location with data"],
                "checkpoint ck is of a run that read its tokens from /t.npy, which no longer \
                 exists; pass the file's new location with --data",
            ),
            (
                RuntimeError::InvalidLearningRate { lr: -1.0, step: 3 },
                &["check lr, min_lr and"],
                "the learning rate -1 of step 3 is not a finite number >= 0; check --lr, \
                 --min-lr and the learning-rate schedule",
            ),
        ]);
    }

    #[test]
    fn divergence_errors_name_settings_as_fields_and_the_cli_as_flags() {
        use protrain_runtime::error::Divergence;
        check_settings_named(vec![
            (
                RuntimeError::Diverged(Divergence::LossScaleExhausted {
                    step: 4,
                    scale: 1e-38,
                }),
                &["lower lr, clip gradients with grad_clip", "(dtype bf16)"],
                "the gradients overflowed f16 at every loss scale down to 1e-38 (step 4): the \
                 model diverged. Train with a lower --lr, clip gradients with --grad-clip, or \
                 train in bf16 (--dtype bf16), whose range is f32's",
            ),
            (
                RuntimeError::Diverged(Divergence::Later {
                    what: "the loss became NaN at step 5".into(),
                    seen: " (the step before: loss 2)".into(),
                    weights: String::new(),
                    clipped: false,
                }),
                &["lower lr or set grad_clip"],
                "the loss became NaN at step 5 (the step before: loss 2): training diverged; \
                 lower --lr or set --grad-clip",
            ),
            (
                RuntimeError::Diverged(Divergence::Later {
                    what: "the loss became NaN at step 5".into(),
                    seen: String::new(),
                    weights: String::new(),
                    clipped: true,
                }),
                &["diverged; lower lr"],
                "the loss became NaN at step 5: training diverged; lower --lr",
            ),
        ]);
    }

    #[test]
    fn disk_errors_name_settings_as_fields_and_the_cli_as_flags() {
        use protrain_runtime::error::{DiskIoCause, DiskProblem};
        let disk = |problem| RuntimeError::Disk {
            path: "/d".into(),
            problem,
        };
        check_settings_named(vec![
            (
                disk(DiskProblem::NotADirectory),
                &["give disk_dir a directory"],
                "disk tier /d: is not a directory; give --disk-dir a directory on the disk for \
                 the optimizer state",
            ),
            (
                disk(DiskProblem::CannotUse {
                    error: "gone".into(),
                }),
                &["as disk_dir (gone)"],
                "disk tier /d: cannot be used as --disk-dir (gone); create it (mkdir -p) or \
                 give another directory",
            ),
            (
                disk(DiskProblem::NoRoom {
                    free: 1 << 30,
                    bytes: 2 << 30,
                }),
                &[
                    "a disk_dir on a larger disk",
                    "smaller disk_budget (or more host_budget)",
                ],
                "disk tier /d: has 1.00 GiB free, but the schedule keeps 2.00 GiB of optimizer \
                 state on disk; free space there, give a --disk-dir on a larger disk, or \
                 compile with a smaller --disk-memory (or more --host-memory)",
            ),
            (
                disk(DiskProblem::CannotCreate {
                    file: "/d/f".into(),
                    error: "denied".into(),
                }),
                &["another disk_dir"],
                "disk tier /d: cannot create the state file /d/f in it (denied); check that the \
                 directory is writable or give another --disk-dir",
            ),
            (
                disk(DiskProblem::CannotAllocate {
                    bytes: 1 << 20,
                    error: "full".into(),
                }),
                &["a disk_dir on a larger disk"],
                "disk tier /d: cannot hold the 1.0 MiB of optimizer state the schedule keeps \
                 on disk (full); free space there or give a --disk-dir on a larger disk",
            ),
            (
                disk(DiskProblem::Io {
                    doing: "write".into(),
                    offset: 4096,
                    error: "no space".into(),
                    cause: DiskIoCause::Full,
                    bytes: 100,
                }),
                &["another disk_dir"],
                "disk tier /d: write at offset 0x1000 failed (no space); the disk is full: the \
                 schedule needs 100 bytes there; free space or give another --disk-dir",
            ),
            (
                disk(DiskProblem::Vanished {
                    error: "gone".into(),
                }),
                &["keep disk_dir out of reach", "checkpoint (resume)"],
                "disk tier /d: the optimizer state file vanished (gone): something removed it \
                 while the run used it; keep --disk-dir out of reach of cleaners and resume \
                 from the last checkpoint (--resume)",
            ),
        ]);
    }

    #[test]
    fn unsupported_schedules_name_settings_as_fields_and_the_cli_as_flags() {
        use protrain_runtime::error::Unsupported;
        check_settings_named(vec![
            (
                RuntimeError::Unsupported(Unsupported::Collectives {
                    ranks: 2,
                    missing: "collectives",
                }),
                &["(backend host", "with gpus 1 nodes 1"],
                "cannot execute the schedule: the schedule runs on 2 ranks, but this backend \
                 has no collectives; run it on the host backend (--backend host, ranks as \
                 threads) or compile it with --gpus 1 --nodes 1",
            ),
            (
                RuntimeError::Unsupported(Unsupported::DiskTier {
                    chunks: 3,
                    missing: "disk tier",
                }),
                &["more host_budget and no disk_budget"],
                "cannot execute the schedule: the schedule keeps the optimizer state of 3 \
                 chunk(s) on disk, but this backend has no disk tier yet; run it on the host \
                 backend (--backend host) or compile it with more --host-memory and no \
                 --disk-memory",
            ),
            (
                RuntimeError::Unsupported(Unsupported::DiskFile {
                    path: "/d/f".into(),
                    missing: "disk tier",
                }),
                &["without disk_budget"],
                "cannot execute the schedule: the schedule keeps optimizer state on disk \
                 (/d/f), but this backend has no disk tier; run it on the host backend \
                 (--backend host) or compile without --disk-memory",
            ),
            (
                RuntimeError::Unsupported(Unsupported::NoDiskDir {
                    held: Some((2, 4096)),
                }),
                &["(disk_dir DIR"],
                "cannot execute the schedule: the schedule keeps the optimizer state of 2 \
                 chunk(s) on disk (4096 bytes), but the executor has no file for it; give it a \
                 directory (--disk-dir DIR, Executor::set_disk_dir)",
            ),
            (
                RuntimeError::Unsupported(Unsupported::NoDiskDir { held: None }),
                &["(disk_dir DIR"],
                "cannot execute the schedule: the schedule keeps optimizer state on disk, but \
                 the executor has no file for it; give it a directory (--disk-dir DIR, \
                 Executor::set_disk_dir)",
            ),
            (
                RuntimeError::GroupSize {
                    rank: 1,
                    world: 4,
                    ranks: 2,
                },
                &["with gpus and nodes as compiled"],
                "rank 1: a group of 4 ranks for a schedule compiled for 2; run it with --gpus \
                 and --nodes as compiled",
            ),
            (
                RuntimeError::NoCollective { ranks: 2 },
                &["protrain train gpus does"],
                "rank 0: the schedule runs on 2 ranks and this executor has no collective to \
                 reach the others; give it one (Executor::set_collective), as protrain train \
                 --gpus does",
            ),
        ]);
    }

    #[test]
    fn eval_and_resume_refusals_name_settings_as_fields_and_the_cli_as_flags() {
        check_settings_named(vec![
            (
                RuntimeError::EvalNotForwardOnly,
                &["(`protrain compile MODEL forward_only`)"],
                "cannot evaluate: the schedule has a backward pass and an optimizer, so running \
                 it would train the weights it should measure; evaluate with a forward-only \
                 schedule (`protrain compile MODEL --forward-only`)",
            ),
            (
                RuntimeError::EvalOtherModel {
                    first: "`wte` [4, 8] against `wte` [4, 16]".into(),
                },
                &["same model with forward_only"],
                "cannot evaluate: the evaluation schedule is of another model than the \
                 training schedule (`wte` [4, 8] against `wte` [4, 16]); compile it from the \
                 same model with --forward-only",
            ),
            (
                RuntimeError::WeightsNotCheckpoint {
                    path: "w.safetensors".into(),
                    key: "protrain.checkpoint",
                },
                &["pass it as init weights"],
                "checkpoint w.safetensors is a safetensors file but not a protrain checkpoint \
                 (no `protrain.checkpoint` metadata); pass it as --init weights instead of \
                 resuming from it",
            ),
        ]);
    }

    #[test]
    fn rendezvous_port_refusals_name_master_as_a_field_and_the_cli_as_a_flag() {
        use protrain_runtime::error::PortProblem;
        let port = |problem| RuntimeError::RendezvousPort { rank: 1, problem };
        check_settings_named(vec![
            (
                port(PortProblem::InUse {
                    master: "h:1".into(),
                    error: "in use".into(),
                }),
                &["(or master HOST:PORT)"],
                "rank 1: rendezvous failed: cannot listen on h:1: in use; the port is in use \
                 (another run or program holds it); choose another MASTER_PORT (or --master \
                 HOST:PORT) on every rank",
            ),
            (
                port(PortProblem::Unreachable {
                    master: "h:1".into(),
                    seconds: 0.4,
                    last_error: "refused".into(),
                }),
                &["MASTER_PORT (or master) name"],
                "rank 1: rendezvous failed: could not reach rank 0 at h:1 within 0.4 s (last \
                 attempt: refused); check that rank 0 was started, that MASTER_ADDR and \
                 MASTER_PORT (or --master) name its node and port on every rank, and that the \
                 port is open between the nodes",
            ),
            (
                port(PortProblem::Foreign {
                    master: "h:1".into(),
                }),
                &["(or master HOST:PORT)"],
                "rank 1: rendezvous failed: h:1 answered, but not as a protrain rendezvous: \
                 another program holds that port; choose a free MASTER_PORT (or --master \
                 HOST:PORT) on every rank",
            ),
        ]);
    }

    /// No policy fits: the compiler names its options' fields, the CLI the flags, in the
    /// words the CLI has always printed.
    #[test]
    fn budget_shortfalls_name_options_as_fields_and_the_cli_as_flags() {
        use protrain_compiler::error::{HostDisk, SharedBudgets, Shortfall, ShortfallProblem};
        let host_too_small = |disk| ShortfallProblem::HostTooSmall {
            host_budget: 4 << 30,
            gpus: 1,
            tried: 9,
            lean: "n_persist=0".into(),
            lean_layout: 16,
            lean_host: 5 << 30,
            lean_device: 1 << 30,
            least_policy: "n_persist=1".into(),
            least_host: 5 << 30,
            disk,
        };
        let cases: Vec<(Shortfall, &[&str], &str)> = vec![
            (
                Shortfall::new(ShortfallProblem::DiskOver {
                    chunks: 2,
                    host_budget: 1 << 30,
                    disk_need: 2 << 30,
                    disk_budget: 1 << 30,
                }),
                &["a larger hardware.disk.memory_bytes or more hardware.host_memory_bytes"],
                "the optimizer state of 2 chunks must move to disk to bring the host region \
                 within the 1.00 GiB of host memory (--host-memory), which takes 2.00 GiB of \
                 disk, more than the 1.00 GiB of disk (--disk-memory); give a larger \
                 --disk-memory or more --host-memory",
            ),
            (
                Shortfall::new(host_too_small(HostDisk::Would {
                    disk: 3 << 30,
                    host: 2 << 30,
                })),
                &[
                    "Give hardware.host_memory_bytes at least 5.00 GiB",
                    "or hardware.disk.memory_bytes at least 3.00 GiB",
                    "(topology.nodes M with topology.gpus N",
                ],
                "no policy fits 4.00 GiB of host memory (--host-memory); 9 policies tried. \
                 Offloading keeps the model states of every streamed chunk in host memory: the \
                 leanest policy on the device (n_persist=0, 16 bytes per parameter on the \
                 host) needs 5.00 GiB of host memory beside 1.00 GiB of device memory, 6.00 GiB \
                 together, and keeping chunks on the device moves their state there without \
                 lowering the sum; the least host memory found beside a device within budget \
                 is 5.00 GiB (n_persist=1). Give --host-memory at least 5.00 GiB; or \
                 --disk-memory at least 3.00 GiB (the model states of offloaded chunks in a \
                 file, read and written around their uploads and the CPU Adam), which brings \
                 the host memory \
                 needed down to 2.00 GiB; or shard the state over more machines (--nodes M \
                 with --gpus N: offloaded chunks are sharded over all the ranks, so each node \
                 keeps 1/M of them; ranks on one node share its host memory, so more --gpus \
                 alone do not lower it)",
            ),
            (
                Shortfall {
                    problem: ShortfallProblem::PolicyOverHost {
                        policy: "n_persist=0".into(),
                        need: 3 << 30,
                        host_budget: 2 << 30,
                        gpus: 2,
                        full_layout: false,
                        staged: true,
                        disk_budget: 0,
                    },
                    shared: Some(SharedBudgets {
                        gpus: 2,
                        node_host: 4 << 30,
                        host_budget: 2 << 30,
                        node_disk: 0,
                        disk_budget: 0,
                    }),
                },
                &[
                    "use policy auto",
                    "or hardware.disk.memory_bytes SIZE",
                    "over topology.gpus 2",
                ],
                "policy n_persist=0 needs 3.00 GiB of host memory, more than the 2.00 GiB of \
                 host memory per rank; use --policy auto, a larger --host-memory, or \
                 --disk-memory SIZE (the optimizer state of offloaded chunks in a file). \
                 Budgets: --gpu-memory is per GPU; --host-memory and --disk-memory are per \
                 node, shared by its ranks: --host-memory 4.00 GiB over --gpus 2 gives each \
                 rank 2.00 GiB (offloaded chunks are sharded over all ranks, each keeping \
                 1/ranks of their host state)",
            ),
            (
                Shortfall::new(ShortfallProblem::ForwardNoneCompiles { max_buffers: 4 }),
                &["give policy n_persist"],
                "no forward-only policy compiles with up to 4 chunk buffers; give --policy \
                 n_persist=... n_buffer=... explicitly",
            ),
        ];
        for (shortfall, library_names, cli) in cases {
            let e = E::BudgetTooSmall(Box::new(shortfall));
            let library = e.to_string();
            assert!(
                !library.contains("--"),
                "the library names a flag: {library}"
            );
            for name in library_names {
                assert!(library.contains(name), "no `{name}` in: {library}");
            }
            assert_eq!(Error::from(e).to_string(), cli);
        }
    }
}
