//! protrain's runtime: executes compiled schedules, with the host kernels, data loading and
//! weight files they need.
//!
//! The runtime never depends on the compiler: a schedule file is all it needs.

pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod cuda;
pub mod data;
pub mod disk;
pub mod dispatch;
pub mod error;
pub mod eval;
pub mod executor;
pub mod host;
pub mod interpreter;
pub mod kernels;
pub mod loss_scale;
mod memory;
pub mod params;
pub mod profiler;
pub mod rendezvous;
pub mod rng;
pub mod synthetic;
pub mod text;
pub mod train;
pub mod weights;

pub use backend::Backend;
pub use error::{Result, RuntimeError};
pub use executor::{Executor, Span, StepTiming};
pub use host::HostBackend;
pub use train::{RunSettings, StepRecord, Trainer, WeightReads};
