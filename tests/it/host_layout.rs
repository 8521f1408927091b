//! Host layouts of offloaded chunks: the 14-byte layout, where a chunk's bf16
//! gradients land in its host parameter storage after the chunk's last upload of the step and
//! the CPU Adam writes the new parameters over them, trains gpt2-tiny and llama-tiny on the
//! host backend bit for bit as the 16-byte layout and as every chunk resident (the f32
//! interpreter runs no bf16 graph; `host_bf16.rs` holds these references against f32), and
//! saves each lean chunk's gradient bytes of host memory. The verifier refuses a schedule that
//! uploads a chunk after its storage holds gradients.

use crate::common;

use protrain::ir::verify_schedule::{verify, VerifiedSchedule};
use protrain::ir::{BufferKind, CopyKind, DType, HardwareProfile, HostLayout, Instr, Schedule};
use protrain::runtime::params::init_params;
use protrain::runtime::Executor;
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 4;
const SEED: u64 = 11;
/// Every chunk streamed through two buffers, one layer swapped and one recomputed, so that
/// the CPU Adam updates every chunk and the backward pass uploads chunks again.
const TIGHT: &str = "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1";

/// `model` in bf16 for the host under `policy`, with clipping (the CPU Adam reads the clip
/// coefficient, which exists only after every gradient).
fn compile(model: &str, policy: &str) -> VerifiedSchedule {
    let config = protrain::models::load(model).unwrap();
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype: DType::BF16,
        policy: PolicyChoice::parse(policy).unwrap(),
        optimizer: OptimizerConfig {
            grad_clip: Some(1.0),
            ..Default::default()
        },
        ..CompileOptions::for_hardware(HardwareProfile::preset("host").unwrap())
    };
    protrain::compile(&config, &options)
        .unwrap_or_else(|e| panic!("{model} [{policy}]: {e}"))
        .schedule
}

/// Each step's loss and gradient norm bits, then every final weight's bits, in order.
fn train(schedule: &VerifiedSchedule, model: &str) -> (Vec<u32>, Vec<Vec<u32>>) {
    let config = protrain::models::load(model).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let mut exec = Executor::new(schedule).unwrap();
    exec.load_params(&init_params(&schedule.graph, SEED))
        .unwrap();
    let mut trace = Vec::new();
    for [x, y] in &data {
        let report = exec.step(&[x, y]).unwrap();
        trace.push(report.loss.to_bits());
        trace.push(report.grad_norm.expect("clipped").to_bits());
    }
    let params = exec
        .params()
        .unwrap()
        .iter()
        .map(|p| p.iter().map(|x| x.to_bits()).collect())
        .collect();
    (trace, params)
}

/// The chunks whose gradient offload lands in their own host parameter storage.
fn lean(schedule: &Schedule) -> Vec<u32> {
    let mut out = Vec::new();
    for stream in &schedule.streams {
        for instr in &stream.instrs {
            if let Instr::Copy {
                what: CopyKind::OffloadGrads { chunk },
                dst,
                ..
            } = instr
            {
                if schedule.buffer(dst.buffer).kind == (BufferKind::HostChunk { chunk: *chunk }) {
                    out.push(chunk.0);
                }
            }
        }
    }
    out
}

fn check(model: &str) {
    let resident = compile(model, "");
    let full = compile(model, TIGHT);
    let grads_in_params = compile(model, &format!("{TIGHT},host_layout=14"));
    assert_eq!(
        grads_in_params.header.policy.host_layout,
        HostLayout::GradsInParams
    );
    assert!(lean(&full).is_empty(), "{model}: the 16-byte layout reuses");
    let reused = lean(&grads_in_params);
    let streamed = grads_in_params.chunks.len();
    assert_eq!(
        reused.len(),
        streamed,
        "{model}: every streamed chunk's last upload precedes its gradient offload here, so \
         every chunk takes the 14-byte layout; reused {reused:?} of {streamed}"
    );
    // Each lean chunk saves its host gradient chunk, no more (and no host gradient chunk is
    // left behind).
    let grad_bytes: u64 = grads_in_params
        .chunks
        .iter()
        .map(|(_, c)| c.used_bytes)
        .sum();
    let host = |s: &Schedule| {
        s.buffers
            .iter()
            .filter(|b| matches!(b.kind, BufferKind::HostGradChunk { .. }))
            .count()
    };
    assert_eq!(host(&grads_in_params), 0);
    assert!(
        full.host_bytes >= grads_in_params.host_bytes + grad_bytes,
        "{model}: host region {} (16 B) vs {} (14 B), gradient chunks {grad_bytes}",
        full.host_bytes,
        grads_in_params.host_bytes
    );
    let want = train(&resident, model);
    assert_eq!(
        train(&full, model),
        want,
        "{model}: 16-byte layout vs resident"
    );
    assert_eq!(
        train(&grads_in_params, model),
        want,
        "{model}: the 14-byte layout trains differently from the resident schedule"
    );
}

#[test]
fn gpt2_grads_in_params_train_bit_identically() {
    check("gpt2-tiny");
}

#[test]
fn llama_grads_in_params_train_bit_identically() {
    check("llama-tiny");
}

/// The mutation: chunk 0 uploaded once more at the end of the step, after its gradients have
/// landed in its host storage (the host-to-device stream waits for an event recorded right
/// after chunk 0's gradient offload). The verifier refuses it as a fetch that reads chunk 0's
/// gradients where its parameters must be; the schedule it was made from verifies.
#[test]
fn an_upload_after_the_gradients_landed_is_refused() {
    let schedule: Schedule = (*compile("gpt2-tiny", &format!("{TIGHT},host_layout=14"))).clone();
    let mutated = common::upload_chunk0_after_its_gradient_offload(&schedule);
    let err = verify(mutated)
        .expect_err("an upload after the gradient offload")
        .to_string();
    assert!(err.contains("data flow"), "{err}");
    assert!(
        err.contains("fetch chunk0")
            && err.contains("gradient offload")
            && err.contains("landed in the parameter storage"),
        "the refusal names the upload and the gradients in its storage: {err}"
    );
    verify(schedule).unwrap();
}
