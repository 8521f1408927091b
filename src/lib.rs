//! protrain: an ahead-of-time scheduler for training large language models on GPUs too small
//! to hold them.
//!
//! This facade re-exports the crates and offers the few calls a downstream program needs:
//! load a model, build its graphs, and print them in their canonical forms (which make good
//! snapshot tests).
//!
//! ```
//! let config = protrain::models::load("gpt2-tiny")?;
//! let forward = protrain::forward_graph(&config, 2, 16)?;
//! let training = protrain::training_graph(&forward, &protrain::OptimizerConfig::default())?;
//! assert!(training.to_text().contains("adamw"));
//! # Ok::<(), protrain::Error>(())
//! ```

pub use protrain_compiler as compiler;
pub use protrain_ir as ir;
pub use protrain_models as models;
pub use protrain_runtime as runtime;

pub use protrain_compiler::OptimizerConfig;
pub use protrain_ir::Graph;

mod compile;
mod error;
pub use compile::{compile, CompileOptions, Compiled, PolicyChoice};
pub use error::{Error, Result};

/// Builds the forward graph of a model at `[batch, seq]` in f32.
pub fn forward_graph(config: &models::ModelConfig, batch: u64, seq: u64) -> Result<Graph> {
    let options = models::BuildOptions::new(batch, seq).with_dtype(ir::DType::F32);
    Ok(models::build_forward(config, &options)?)
}

/// Derives the training graph (forward, backward, optimizer) from a forward graph.
pub fn training_graph(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    Ok(compiler::pipeline::training_graph(forward, optimizer)?)
}
