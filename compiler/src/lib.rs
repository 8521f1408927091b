//! protrain's compiler: from a forward graph to a training graph and, later passes, to a
//! verified schedule. One pass per file; `pipeline` lists them in order.

pub mod accumulate;
pub mod autodiff;
pub mod bound;
pub mod chunk;
pub mod comm;
pub mod cost;
pub mod data_parallel;
pub mod disk;
pub mod egraph;
pub mod emit;
pub mod error;
pub mod fuse;
pub mod lower;
pub mod movement;
pub mod pipeline;
pub mod place;
pub mod plan;
pub mod search;
pub mod search_forward;
pub mod shard;
pub mod simulate;
pub mod streams;
pub mod validate;

pub use autodiff::OptimizerConfig;
pub use error::{CompileError, Result};
