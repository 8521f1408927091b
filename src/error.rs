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
    /// The compiler rejected something.
    #[error(transparent)]
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

/// The facade's result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
