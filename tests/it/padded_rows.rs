//! Padded rows change no result: a gpt2-tiny with an odd vocabulary (so its logits' rows are
//! not a multiple of 16 bytes), lowered once with the row-padding pass and once without it,
//! trains on the host backend to the same bits (losses, gradient norms and every parameter
//! after a few steps), in f32 and bf16, under a resident and a streamed, swapped and
//! recomputed policy. The padded schedule pads the logits and their gradient (rows of the
//! pitch the verifier checks) and its arena holds the padding.

use crate::common;
use protrain_compiler::emit::emit;
use protrain_compiler::pad_rows::pad_rows;
use protrain_compiler::pipeline::{chunked, training_graph};
use protrain_compiler::place::place;
use protrain_compiler::plan::plan_buffers;
use protrain_compiler::streams::streams;
use protrain_compiler::OptimizerConfig;
use protrain_ir::verify_schedule::{verify, VerifiedSchedule};
use protrain_ir::{BlockMode, DType, Graph, Policy};
use protrain_runtime::params::init_params;
use protrain_runtime::Executor;
use std::collections::HashMap;

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 3;
const SEED: u64 = 11;
/// Odd, so that no element size makes its rows a multiple of 16 bytes.
pub(crate) const VOCAB: u64 = 251;

/// The training graph of gpt2-tiny with [`VOCAB`] tokens in `dtype`.
pub(crate) fn training(dtype: DType) -> Graph {
    let mut config = protrain_models::load("gpt2-tiny").unwrap();
    config.vocab_size = VOCAB;
    let forward = protrain_models::build_forward(
        &config,
        &protrain_models::BuildOptions::new(BATCH, SEQ).with_dtype(dtype),
    )
    .unwrap();
    let optimizer = OptimizerConfig {
        lr: 1e-2,
        grad_clip: Some(1.0),
        ..Default::default()
    };
    training_graph(&forward, &optimizer).unwrap()
}

/// `training` lowered under `policy`, with the row-padding pass when `pad`.
pub(crate) fn lower(training: &Graph, policy: &Policy, pad: bool) -> VerifiedSchedule {
    let chunks = chunked(training);
    let placed = place(training, &chunks, policy).unwrap();
    let header = common::header("padded", "host");
    let mut streamed = streams(placed, header.flash_attention).unwrap();
    if pad {
        pad_rows(&mut streamed);
    }
    let planned = plan_buffers(&mut streamed);
    let schedule = emit(streamed, &planned, header).unwrap();
    verify(schedule).unwrap_or_else(|e| panic!("[{policy}] pad {pad}: {e}"))
}

/// Each step's loss and gradient norm bits, and the final parameters' bits by name.
type Bits = (Vec<(u32, Option<u32>)>, HashMap<String, Vec<u32>>);

fn train(schedule: &VerifiedSchedule, init: &HashMap<String, Vec<f32>>) -> Bits {
    let data = common::batches(VOCAB as usize, BATCH, SEQ, STEPS, SEED);
    let mut exec = Executor::new(schedule).unwrap();
    let params: Vec<Vec<f32>> = schedule
        .graph
        .params()
        .map(|(_, p)| init[&p.name].clone())
        .collect();
    exec.load_params(&params).unwrap();
    let steps = data
        .iter()
        .map(|[x, y]| {
            let r = exec.step(&[x, y]).unwrap();
            (r.loss.to_bits(), r.grad_norm.map(f32::to_bits))
        })
        .collect();
    let finals = schedule
        .graph
        .params()
        .zip(exec.params().unwrap())
        .map(|((_, p), v)| (p.name.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect();
    (steps, finals)
}

#[test]
fn padded_logits_train_to_the_bits_of_dense_ones() {
    for dtype in [DType::F32, DType::BF16] {
        let graph = training(dtype);
        let chunks = chunked(&graph).len() as u32;
        let layers = 2;
        let policies = [
            Policy::resident(chunks, layers),
            Policy {
                blocks: vec![BlockMode::Swap, BlockMode::Checkpoint],
                ..Policy::protrain(0, 2, 1, 1, layers)
            },
        ];
        let init: HashMap<String, Vec<f32>> = graph
            .params()
            .zip(init_params(&graph, SEED))
            .map(|((_, p), v)| (p.name.clone(), v))
            .collect();
        for policy in &policies {
            let dense = lower(&graph, policy, false);
            let padded = lower(&graph, policy, true);
            let pitched: Vec<_> = padded
                .buffers
                .iter()
                .filter_map(|b| b.pitch.map(|p| (b, p)))
                .collect();
            // The logits and their gradient.
            assert_eq!(pitched.len(), 2, "{dtype} [{policy}]: {pitched:?}");
            let el = dtype.size();
            for (b, p) in &pitched {
                assert_eq!(p.pitch * el % 16, 0);
                assert!(p.pitch > VOCAB && p.pitch < VOCAB + 16 / el);
                assert_eq!(b.size, BATCH * SEQ * p.pitch * el);
            }
            assert!(dense.buffers.iter().all(|b| b.pitch.is_none()));
            assert!(
                padded.arena_bytes >= dense.arena_bytes,
                "{dtype} [{policy}]: the padded arena is smaller"
            );
            let (want, got) = (train(&dense, &init), train(&padded, &init));
            assert_eq!(want.0, got.0, "{dtype} [{policy}]: losses or norms differ");
            for (name, w) in &want.1 {
                assert!(
                    got.1[name] == *w,
                    "{dtype} [{policy}]: {name} differs after {STEPS} steps"
                );
            }
        }
    }
}

/// The verifier's pitch invariant refuses each way a padded buffer can be wrong, naming it;
/// the printer shows the pitch beside the row length.
#[test]
fn the_verifier_refuses_bad_pitches_and_the_printer_shows_them() {
    use protrain_ir::verify_schedule::{verify_schedule, Invariant};
    use protrain_ir::{Instr, Schedule};
    let graph = training(DType::BF16);
    let chunks = chunked(&graph).len() as u32;
    let padded = lower(&graph, &Policy::resident(chunks, 2), true);
    let text = padded.to_text();
    assert!(
        text.contains("pitch 256 (row 251)"),
        "the buffer table shows no pitch:\n{text}"
    );
    let base: Schedule = (*padded).clone();
    let at = base.buffers.iter().position(|b| b.pitch.is_some()).unwrap();
    let refuse = |what: &str, s: &Schedule, want: &str| {
        let e = verify_schedule(s).expect_err(what);
        assert_eq!(e.invariant, Invariant::Pitch, "{what}: {e}");
        assert!(e.message.contains(want), "{what}: {e}");
    };
    let mut s = base.clone();
    s.buffers[at].pitch.as_mut().unwrap().pitch = VOCAB - 1;
    refuse("a pitch shorter than the row", &s, "is shorter than");
    let mut s = base.clone();
    s.buffers[at].pitch.as_mut().unwrap().pitch = 260;
    refuse("a pitch of 520 bytes", &s, "not a multiple of 16 B");
    let mut s = base.clone();
    s.buffers[at].size -= 32;
    refuse("a buffer smaller than its rows", &s, "rows x pitch");
    // A dense device activation read by a kernel that takes no pitch (a layer norm's output)
    // given a pitch.
    let mut s = base.clone();
    let (b, v) = s
        .streams
        .iter()
        .flat_map(|st| &st.instrs)
        .find_map(|i| match i {
            Instr::Kernel { op, outputs, .. }
                if matches!(s.graph.op(*op).kind, protrain_ir::OpKind::LayerNorm { .. }) =>
            {
                Some((outputs[0].buffer, s.graph.op(*op).outputs[0]))
            }
            _ => None,
        })
        .unwrap();
    let ty = s.graph.value(v).ty.clone();
    let pitch = ty.last_dim() + 8;
    s.buffers[b.index()].pitch = Some(protrain_ir::RowPitch { value: v, pitch });
    s.buffers[b.index()].size = ty.rows() * pitch * ty.dtype.size();
    refuse("a pitch on a layer norm's output", &s, "takes no row pitch");
}
