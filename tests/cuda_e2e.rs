//! The CUDA backend end to end: tiny GPT-2 and LLaMA models trained for three steps on the GPU
//! give the host backend's losses. Needs the `cuda` feature and a GPU; run by
//! `scripts/gpu-check.sh`:
//!
//! ```text
//! cargo test --release --features cuda --test cuda_e2e
//! ```
//!
//! Without a GPU (or the driver, cuBLAS, NVRTC) every test fails, saying what is missing: it
//! never skips.
//!
//! In f32 the device computes what the host computes in another summation order (cuBLAS
//! without TF32, reductions in fixed trees), so the losses and gradient norms of every step
//! must agree within 1e-5 relative, under three policies: everything resident; every chunk
//! streamed through two buffers with every layer recomputed (the CPU Adam on the host
//! optimizer stream, events crossing between it and the CUDA streams); half the chunks
//! persistent with ProTrain's interleaved swap and checkpoint layout. In bf16 (f32 master
//! weights and moments) the losses must stay within 2e-2 relative of the host's f32 losses:
//! the bf16 rounding of weights and activations, not an error, makes the difference.

#![cfg(feature = "cuda")]

mod common;

use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::OptimizerConfig;
use protrain_ir::{BlockKind, DType, Graph, Policy, Schedule};
use protrain_runtime::cuda::CudaBackend;
use protrain_runtime::interpreter::StepReport;
use protrain_runtime::params::init_params;
use protrain_runtime::{Backend, Executor, HostBackend};
use std::collections::HashMap;

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 3;
const SEED: u64 = 11;
/// Relative tolerance of f32 losses and gradient norms against the host's.
const F32_TOLERANCE: f64 = 1e-5;
/// Relative tolerance of bf16 losses against the host's f32 losses.
const BF16_TOLERANCE: f64 = 2e-2;

/// Fails the test, with what is missing, when the CUDA backend cannot run here.
fn require_gpu() {
    if let Err(why) = protrain_runtime::cuda::available() {
        panic!(
            "no CUDA device is available: {why}\nthese tests need a GPU; \
             scripts/gpu-check.sh runs them on one"
        );
    }
}

/// The training graph of `model` in `dtype`, its layer count.
fn training(model: &str, dtype: DType, grad_clip: Option<f64>) -> (Graph, usize) {
    let config = protrain_models::load(model).unwrap();
    let forward = protrain_models::build_forward(
        &config,
        &protrain_models::BuildOptions::new(BATCH, SEQ).with_dtype(dtype),
    )
    .unwrap();
    let optimizer = OptimizerConfig {
        lr: 1e-3,
        grad_clip,
        ..Default::default()
    };
    let graph = training_graph(&forward, &optimizer).unwrap();
    let layers = graph
        .blocks()
        .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
        .count();
    (graph, layers)
}

/// The three policies: resident; streamed through two buffers, every layer recomputed; half
/// persistent with one swapped and one checkpointed layer.
fn policies(chunks: u32, layers: usize) -> Vec<Policy> {
    vec![
        Policy::resident(chunks, layers),
        Policy::protrain(0, 2, 0, layers, layers),
        Policy::protrain(chunks / 2, 2, 1, 1, layers),
    ]
}

/// Trains `schedule` on backend `B` from the initial values `init` (by parameter name).
fn train<B: Backend>(
    schedule: &Schedule,
    init: &HashMap<String, Vec<f32>>,
    data: &[[Vec<i32>; 2]],
) -> Vec<StepReport> {
    let mut exec = Executor::<B>::with_backend(schedule).unwrap();
    let values: Vec<Vec<f32>> = schedule
        .graph
        .params()
        .map(|(_, p)| init[&p.name].clone())
        .collect();
    exec.load_params(&values).unwrap();
    data.iter()
        .enumerate()
        .map(|(step, [x, y])| {
            exec.step(&[x, y])
                .unwrap_or_else(|e| panic!("step {step}: {e}"))
        })
        .collect()
}

fn relative(a: f32, b: f32) -> f64 {
    (f64::from(a) - f64::from(b)).abs() / f64::from(b).abs().max(1e-12)
}

/// Host and GPU losses (and gradient norms) of `model` under every policy, in f32.
fn check_f32(model: &str, grad_clip: Option<f64>) {
    require_gpu();
    let (graph, layers) = training(model, DType::F32, grad_clip);
    let chunks = chunked(&graph);
    let init: HashMap<String, Vec<f32>> = graph
        .params()
        .zip(init_params(&graph, SEED))
        .map(|((_, p), v)| (p.name.clone(), v))
        .collect();
    let config = protrain_models::load(model).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    for policy in policies(chunks.len() as u32, layers) {
        let schedule = compile_policy(&graph, &chunks, &policy, common::header("cuda-e2e", "h200"))
            .unwrap_or_else(|e| panic!("{model} [{policy}]: {e}"));
        let host = train::<HostBackend>(&schedule, &init, &data);
        let gpu = train::<CudaBackend>(&schedule, &init, &data);
        for (step, (h, g)) in host.iter().zip(&gpu).enumerate() {
            eprintln!(
                "{model} [{policy}] step {step}: loss host {} gpu {} (rel {:.2e}); grad norm \
                 host {:?} gpu {:?}",
                h.loss,
                g.loss,
                relative(g.loss, h.loss),
                h.grad_norm,
                g.grad_norm
            );
            assert!(
                relative(g.loss, h.loss) <= F32_TOLERANCE,
                "{model} [{policy}] step {step}: the GPU's loss {} differs from the host's {} \
                 by more than {F32_TOLERANCE:e} relative",
                g.loss,
                h.loss
            );
            match (h.grad_norm, g.grad_norm) {
                (None, None) => {}
                (Some(hn), Some(gn)) => assert!(
                    relative(gn, hn) <= F32_TOLERANCE,
                    "{model} [{policy}] step {step}: gradient norm {gn} on the GPU, {hn} on \
                     the host"
                ),
                (hn, gn) => panic!(
                    "{model} [{policy}] step {step}: gradient norm {hn:?} on the host but \
                     {gn:?} on the GPU"
                ),
            }
        }
    }
}

#[test]
fn gpt2_f32_losses_match_the_host_under_three_policies() {
    check_f32("gpt2-tiny", Some(0.5));
}

#[test]
fn llama_f32_losses_match_the_host_under_three_policies() {
    check_f32("llama-tiny", None);
}

/// bf16 schedules (bf16 parameters resident or streamed from the host, f32 master weights
/// updated by the device AdamW or the CPU Adam) train close to the host's f32 run.
fn check_bf16(model: &str) {
    require_gpu();
    let (f32_graph, layers) = training(model, DType::F32, Some(1.0));
    let (bf16_graph, _) = training(model, DType::BF16, Some(1.0));
    let init: HashMap<String, Vec<f32>> = f32_graph
        .params()
        .zip(init_params(&f32_graph, SEED))
        .map(|((_, p), v)| (p.name.clone(), v))
        .collect();
    let config = protrain_models::load(model).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let f32_chunks = chunked(&f32_graph);
    let resident = Policy::resident(f32_chunks.len() as u32, layers);
    let reference = compile_policy(
        &f32_graph,
        &f32_chunks,
        &resident,
        common::header("cuda-e2e", "h200"),
    )
    .unwrap();
    let host = train::<HostBackend>(&reference, &init, &data);
    let chunks = chunked(&bf16_graph);
    // Resident (the device AdamW on bf16 parameters) and every chunk streamed (the CPU Adam).
    let n = chunks.len() as u32;
    for policy in [
        Policy::resident(n, layers),
        Policy::protrain(0, 2, 0, layers, layers),
    ] {
        let schedule = compile_policy(
            &bf16_graph,
            &chunks,
            &policy,
            common::header("cuda-e2e", "h200"),
        )
        .unwrap_or_else(|e| panic!("{model} bf16 [{policy}]: {e}"));
        let gpu = train::<CudaBackend>(&schedule, &init, &data);
        for (step, (h, g)) in host.iter().zip(&gpu).enumerate() {
            eprintln!(
                "{model} bf16 [{policy}] step {step}: loss host f32 {} gpu bf16 {} (rel {:.2e})",
                h.loss,
                g.loss,
                relative(g.loss, h.loss)
            );
            assert!(
                relative(g.loss, h.loss) <= BF16_TOLERANCE,
                "{model} bf16 [{policy}] step {step}: loss {} on the GPU, {} on the host in f32",
                g.loss,
                h.loss
            );
            assert!(
                g.grad_norm.is_some_and(f32::is_finite),
                "{model} bf16 [{policy}] step {step}: no finite gradient norm"
            );
        }
    }
}

#[test]
fn gpt2_bf16_losses_stay_close_to_f32() {
    check_bf16("gpt2-tiny");
}

#[test]
fn llama_bf16_losses_stay_close_to_f32() {
    check_bf16("llama-tiny");
}
