//! The passes end to end on the tiny models, under policies that exercise every mechanism.

use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::OptimizerConfig;
use protrain_ir::{BlockMode, Policy};

fn header() -> HeaderInputs {
    HeaderInputs {
        model: "test".into(),
        hardware: "test".into(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
    }
}

#[test]
fn smoke() {
    let config = protrain_models::load("gpt2-tiny").unwrap();
    let forward = protrain_models::build_forward(
        &config,
        &protrain_models::BuildOptions::new(2, 16).with_dtype(protrain_ir::DType::F32),
    )
    .unwrap();
    let training = training_graph(
        &forward,
        &OptimizerConfig {
            grad_clip: Some(1.0),
            ..Default::default()
        },
    )
    .unwrap();
    let chunks = chunked(&training);
    eprintln!("chunks {} of {} bytes", chunks.len(), chunks.chunk_bytes);
    let policy = Policy {
        n_persist: 1,
        n_buffer: 2,
        blocks: vec![BlockMode::Swap, BlockMode::Checkpoint],
        prefetch: 1,
    };
    let s = compile_policy(&training, &chunks, &policy, header()).unwrap();
    eprintln!(
        "arena {} lower {} host {} buffers {} events {}",
        s.arena_bytes,
        s.header.prediction.lower_bound_bytes,
        s.host_bytes,
        s.buffers.len(),
        s.events
    );
    for st in &s.streams {
        eprintln!("{} {}", st.name, st.instrs.len());
    }
}
