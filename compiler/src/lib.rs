//! protrain's compiler: from a forward graph to a training graph and, later passes, to a
//! verified schedule. One pass per file; `pipeline` lists them in order.

pub mod autodiff;
pub mod cost;
pub mod error;
pub mod pipeline;
pub mod plan;

pub use autodiff::OptimizerConfig;
pub use error::{CompileError, Result};
