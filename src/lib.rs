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
//!
//! # Snapshot-testing schedules
//!
//! [`compile`] returns a verified schedule with its canonical text form,
//! [`ir::Schedule::to_text`]: buffers and values numbered in order of appearance, no compile
//! time, no paths. A downstream crate can pin the schedules it depends on with
//! [insta](https://insta.rs) in its tests, and review any change the compiler makes to them
//! with `cargo insta review`. Compile for a named GPU preset rather than `host` (which
//! describes the machine the test runs on) and with a fixed policy (the search's report lists
//! the candidates it compiled, which depends on the thread count):
//!
//! ```
//! use protrain::ir::{DType, HardwareProfile};
//! use protrain::{CompileOptions, PolicyChoice};
//!
//! let config = protrain::models::load("gpt2-tiny")?;
//! let options = CompileOptions {
//!     batch: 2,
//!     seq: 16,
//!     dtype: DType::F32,
//!     // Every chunk streamed from the host through 2 buffers, both layers recomputed: the
//!     // policy in the form `compile` prints it.
//!     policy: PolicyChoice::parse("n_persist=0 n_buffer=2 n_checkpoint=2")?,
//!     ..CompileOptions::for_hardware(HardwareProfile::preset("rtx3090").expect("a preset"))
//! };
//! let text = protrain::compile(&config, &options)?.schedule.to_text();
//! // In a test of your own crate (with insta as a dev-dependency):
//! //     insta::assert_snapshot!(text);
//! assert!(text.contains("; policy: n_persist=0 n_buffer=2 prefetch=1 blocks=C2"));
//! assert!(text.contains("copy fetch chunk0 host[+0x0] -> device["));
//! # Ok::<(), protrain::Error>(())
//! ```
//!
//! [`Context`] runs the same pipeline a stage at a time, for tests of an intermediate stage
//! (`protrain dump --stage` prints them).

pub use protrain_compiler as compiler;
pub use protrain_ir as ir;
pub use protrain_models as models;
pub use protrain_runtime as runtime;

pub use protrain_compiler::OptimizerConfig;
pub use protrain_ir::Graph;

mod error;
pub mod size;
pub use error::{Error, Result};
pub use protrain_compiler::pipeline::{
    default_shape, CompileOptions, Compiled, Context, PolicyChoice, Stage,
};

/// Compiles a model: builds its forward graph, fuses it (unless told not to), derives the
/// training graph, searches for the fastest policy that fits (or applies the one given),
/// plans memory, verifies and simulates the result. See [`Context`] to stop at a stage.
pub fn compile(config: &models::ModelConfig, options: &CompileOptions) -> Result<Compiled> {
    Ok(compiler::pipeline::compile(config, options)?)
}

/// [`compile`] with the step's rows cut into micro-batches as `split` says: a batch that
/// does not fit split into the fewest micro-batches that do, or the fastest split of a
/// global batch ([`compiler::split`]). Returns the report of the choice when the split was
/// chosen here.
pub fn compile_split(
    config: &models::ModelConfig,
    options: &CompileOptions,
    split: compiler::split::Split,
) -> Result<(Compiled, Option<compiler::split::SplitReport>)> {
    Ok(compiler::split::compile_split(config, options, split)?)
}

/// Builds the forward graph of a model at `[batch, seq]` in f32.
pub fn forward_graph(config: &models::ModelConfig, batch: u64, seq: u64) -> Result<Graph> {
    let options = models::BuildOptions::new(batch, seq).with_dtype(ir::DType::F32);
    Ok(models::build_forward(config, &options)?)
}

/// The training graphs (`[batch, seq]` in `dtype`) whose ops a measured profile of `config`
/// should hold: the unfused one, then the one fused under `base`'s estimates. With both
/// measured, the fusion pass prices both sides of each fusion from measurements when it
/// compiles with the profile.
pub fn profiling_graphs(
    config: &models::ModelConfig,
    batch: u64,
    seq: u64,
    dtype: ir::DType,
    optimizer: &OptimizerConfig,
    base: &ir::HardwareProfile,
) -> Result<Vec<Graph>> {
    let options = models::BuildOptions::new(batch, seq).with_dtype(dtype);
    let forward = models::build_forward(config, &options)?;
    let cost = compiler::cost::cost_model(base);
    let (fused, _) = compiler::pipeline::fused(
        &forward,
        cost.as_ref(),
        &compiler::fuse::FuseLimits::default(),
    )?;
    Ok(vec![
        training_graph(&forward, optimizer)?,
        training_graph(&fused, optimizer)?,
    ])
}

/// Derives the training graph (forward, backward, optimizer) from a forward graph.
pub fn training_graph(forward: &Graph, optimizer: &OptimizerConfig) -> Result<Graph> {
    Ok(compiler::pipeline::training_graph(forward, optimizer)?)
}
