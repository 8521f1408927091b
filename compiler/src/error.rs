//! The compiler's error type.

use protrain_ir::IrError;

/// Everything the compiler can reject.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The IR rejected a graph or op.
    #[error(transparent)]
    Ir(#[from] IrError),
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
    /// No policy fits the budget.
    #[error("{0}")]
    BudgetTooSmall(String),
    /// The simulator could not run a schedule (a compiler bug).
    #[error("simulation failed: {0}")]
    Simulation(String),
    /// An optimizer setting is out of range.
    #[error("{0}")]
    BadOptimizer(String),
}

/// The compiler's result alias.
pub type Result<T, E = CompileError> = std::result::Result<T, E>;
