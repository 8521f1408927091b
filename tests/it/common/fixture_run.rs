//! The fixture models (`tests/fixtures/{gpt2,llama}`) compiled and trained from their fixture
//! weights through the runtime's `Trainer`, as the tests against PyTorch runs do.

use super::fixtures;
use protrain::ir::DType;
use protrain::runtime::params::load_params;
use protrain::runtime::train::{LrSchedule, RunSettings, StepRecord};
use protrain::runtime::{Executor, Trainer};
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};

/// The sequence length of every fixture run.
pub const SEQ: u64 = 16;

/// The shape of a fixture run's schedule besides its sequence length ([`SEQ`]).
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Rows of one micro-batch.
    pub batch: u64,
    /// Micro-batches per step.
    pub micro_batches: u64,
    /// The schedule's element type.
    pub dtype: DType,
}

impl Shape {
    /// `batch` rows, `micro_batches` micro-batches per step, in f32.
    pub const fn f32(batch: u64, micro_batches: u64) -> Self {
        Self {
            batch,
            micro_batches,
            dtype: DType::F32,
        }
    }
}

/// A verified schedule of the fixture model `model` in `shape` under `policy`, one rank.
pub fn compile(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    shape: Shape,
) -> protrain::Compiled {
    let config = protrain::models::load(fixtures().join(model).to_str().expect("utf-8"))
        .expect("the fixture's config parses");
    let options = CompileOptions {
        batch: shape.batch,
        seq: SEQ,
        dtype: shape.dtype,
        policy: PolicyChoice::parse(policy).expect("a policy"),
        optimizer: optimizer.clone(),
        micro_batches: shape.micro_batches,
        topology: protrain::compiler::comm::Topology::SINGLE,
        ..CompileOptions::default()
    };
    protrain::compile(&config, &options).expect("the fixture model compiles")
}

/// The run settings of a fixture run: `steps` steps of `schedule` on the tokens of the
/// fixture directory `dir` (`tests/fixtures/DIR/tokens.npy`), seed 0.
pub fn settings(dir: &str, schedule: LrSchedule, steps: u64) -> RunSettings {
    RunSettings {
        steps,
        lr_schedule: schedule,
        seed: 0,
        data: Some(fixtures().join(dir).join("tokens.npy")),
        loss_scale: None,
        save_every: None,
        data_checksum: None,
    }
}

/// Trains `model` from its fixture weights in `shape` under `policy` with `settings`;
/// returns every step's record and the final weights.
pub fn train(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    shape: Shape,
    settings: RunSettings,
) -> (Vec<StepRecord>, Vec<Vec<f32>>) {
    let compiled = compile(model, optimizer, policy, shape);
    let schedule = &compiled.schedule;
    assert_eq!(
        u64::from(schedule.micro_batches_per_step()),
        shape.micro_batches
    );
    let weights = fixtures().join(model).join("model.safetensors");
    let params = load_params(&schedule.graph, &weights).expect("the fixture weights load");
    let executor = Executor::new(schedule).expect("an executor");
    let mut trainer =
        Trainer::start(executor, settings, &params, "the fixture").expect("a trainer");
    let mut records = Vec::new();
    trainer
        .run(|r| records.push(r.clone()))
        .expect("the run trains");
    let finals = trainer.executor().params().expect("weights read back");
    (records, finals)
}
