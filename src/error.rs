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
    /// The runtime failed.
    #[error(transparent)]
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
    /// Arguments that parse but do not make sense together.
    #[error("{0}")]
    Usage(String),
}

/// A compiler error in the CLI's words: where the error carries the figures a flag set
/// (`--gpus`, `--nodes`, `--grad-accum`, `--forward-only`, `--gpu-memory`, `--policy`), the
/// message names the flag and the way out; any other error says what the compiler says.
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
        e => e.to_string(),
    }
}

/// The facade's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::Error;
    use protrain_compiler::CompileError as E;

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
}
