//! The compiler's error type.

use protrain_ir::IrError;

/// Everything the compiler can reject.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The IR rejected a graph or op.
    #[error(transparent)]
    Ir(#[from] IrError),
    /// The forward graph has nothing to differentiate.
    #[error("the forward graph has no loss output; build it with a cross_entropy head")]
    NoLoss,
    /// A placement policy does not fit the model.
    #[error("bad policy: {0}")]
    BadPolicy(String),
    /// An optimizer setting is out of range.
    #[error("{0}")]
    BadOptimizer(String),
}

/// The compiler's result alias.
pub type Result<T, E = CompileError> = std::result::Result<T, E>;
