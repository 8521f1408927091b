//! The IR's error type.

/// Everything the IR can reject.
#[derive(Debug, thiserror::Error)]
pub enum IrError {
    /// An op's inputs do not fit its kind.
    #[error("{op}: {why}")]
    TypeMismatch {
        /// The op kind's mnemonic.
        op: &'static str,
        /// What does not fit.
        why: String,
    },
    /// The graph breaks an invariant.
    #[error("invalid graph: {0}")]
    Invalid(String),
    /// A graph file is not valid JSON for a graph.
    #[error("not a protrain graph: {0}")]
    Json(#[from] serde_json::Error),
}

/// The IR's result alias.
pub type Result<T, E = IrError> = std::result::Result<T, E>;
