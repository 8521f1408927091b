//! protrain's runtime: executes compiled schedules, with the host kernels, data loading and
//! weight files they need.
//!
//! The runtime never depends on the compiler: a schedule file is all it needs.

pub mod data;
pub mod error;
pub mod interpreter;
pub mod kernels;
pub mod params;
pub mod synthetic;
pub mod weights;

pub use error::{Result, RuntimeError};
