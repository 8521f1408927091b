//! Neither fusion nor a schedule changes the training algorithm: the fused graph under every
//! placement policy, executed on the host backend, trains bit-identically to the reference
//! interpreter running the unfused graph.
//!
//! For each tiny model (GPT-2, LLaMA, Mistral, OPT; f32, batch 2, seq 16), the interpreter
//! trains three AdamW steps on the unfused, unplaced training graph from seeded initial
//! parameters; then the forward graph is fused (q/k/v and gate/up groups, activation, swiglu
//! and residual epilogues) and every policy of a grid (all chunks persistent or none or some, one or two chunk
//! buffers, blocks all kept, all checkpointed, all swapped, or mixed) is compiled and executed
//! from the same parameters on the same batches. Losses, gradient norms and final parameters
//! (matched by name) must be the same bits. Some cases clip gradients, so the clip coefficient
//! reaches the host optimizer.

use crate::common;

use protrain_compiler::cost::Roofline;
use protrain_compiler::fuse::FuseLimits;
use protrain_compiler::pipeline::{chunked, compile_policy, fused, training_graph};
use protrain_compiler::{CompileError, OptimizerConfig};
use protrain_ir::verify_schedule::verify;
use protrain_ir::{
    BlockKind, BlockMode, DType, Graph, HardwareProfile, HostLayout, Instr, OpKind, Policy,
};
use protrain_runtime::interpreter::{Interpreter, StepReport};
use protrain_runtime::params::init_params;
use protrain_runtime::Executor;
use std::collections::HashMap;

const BATCH: u64 = 2;
const SEQ: u64 = 16;
const STEPS: usize = 3;
const SEED: u64 = 7;

/// What a run produced: per-step reports and the final parameters by name.
struct Run {
    reports: Vec<StepReport>,
    params: HashMap<String, Vec<f32>>,
}

fn by_name(graph: &Graph, values: Vec<Vec<f32>>) -> HashMap<String, Vec<f32>> {
    graph
        .params()
        .zip(values)
        .map(|((_, p), v)| (p.name.clone(), v))
        .collect()
}

fn reference(training: &Graph, init: &[Vec<f32>], data: &[[Vec<i32>; 2]]) -> Run {
    let mut interp = Interpreter::new(training);
    for ((id, _), values) in training.params().zip(init) {
        interp.set_param(id, values).unwrap();
    }
    let reports = data
        .iter()
        .map(|[x, y]| interp.step(&[x, y]).unwrap())
        .collect();
    let params = training
        .params()
        .map(|(id, p)| (p.name.clone(), interp.param(id).to_vec()))
        .collect();
    Run { reports, params }
}

/// The policy grid: `n_persist` none, half or all of the chunks; one or two buffers when
/// some chunks stream; blocks all kept, all checkpointed, all swapped, swap+checkpoint
/// interleaved (ProTrain's layout), checkpoint then keep.
fn policies(chunks: u32, layers: usize) -> Vec<Policy> {
    let modes = |n_persist: u32, n_buffer: u32| {
        let all = |mode| Policy {
            n_persist,
            n_buffer,
            blocks: vec![mode; layers],
            prefetch: 1,
            host_layout: HostLayout::Full,
            order: Default::default(),
        };
        [
            all(BlockMode::Keep),
            all(BlockMode::Checkpoint),
            all(BlockMode::Swap),
            Policy::protrain(n_persist, n_buffer, 1, 1, layers),
            Policy::protrain(n_persist, n_buffer, 0, 1, layers),
        ]
    };
    let mut persists = vec![0, chunks / 2, chunks];
    persists.dedup();
    let mut out = Vec::new();
    for n_persist in persists {
        if n_persist == chunks {
            out.extend(modes(n_persist, 0));
        } else {
            for n_buffer in [1, 2] {
                out.extend(modes(n_persist, n_buffer));
            }
        }
    }
    assert!(out.contains(&Policy::resident(chunks, layers)));
    out
}

/// The first element where two tensors differ in bits, for the failure message.
fn first_difference(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (x, y))| x.to_bits() != y.to_bits())
        .map(|(i, (&x, &y))| (i, x, y))
}

/// Trains `model` under every policy of the grid and holds each against the interpreter.
fn check(model: &str, grad_clip: Option<f64>) {
    check_fusing(model, grad_clip, true);
}

/// [`check`], for a model where fusion applies (`fuses`) or, as in OLMo 2, where no rewrite
/// keeps the bits and nothing is fused.
fn check_fusing(model: &str, grad_clip: Option<f64>, fuses: bool) {
    let config = protrain_models::load(model).unwrap();
    let forward = protrain_models::build_forward(
        &config,
        &protrain_models::BuildOptions::new(BATCH, SEQ).with_dtype(DType::F32),
    )
    .unwrap();
    let optimizer = OptimizerConfig {
        lr: 1e-2,
        grad_clip,
        ..Default::default()
    };
    let unfused = training_graph(&forward, &optimizer).unwrap();
    let cost = Roofline::new(HardwareProfile::preset("host").unwrap());
    let (fused_forward, report) = fused(&forward, &cost, &FuseLimits::default()).unwrap();
    assert_eq!(
        !report.fusions.is_empty(),
        fuses,
        "{model}: fusions: {}",
        report.to_text()
    );
    let training = training_graph(&fused_forward, &optimizer).unwrap();
    assert_eq!(
        training
            .ops()
            .any(|(_, op)| matches!(op.kind, OpKind::FusedLinearBackward { .. })),
        fuses
    );
    let chunks = chunked(&training);
    let layers = training
        .blocks()
        .filter(|(_, b)| matches!(b.kind, BlockKind::Layer(_)))
        .count();
    let init = init_params(&unfused, SEED);
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let expected = reference(&unfused, &init, &data);
    if let Some(clip) = grad_clip {
        // The coefficient must actually scale the gradients somewhere, or clipping is untested.
        let clip = clip as f32;
        assert!(
            expected
                .reports
                .iter()
                .any(|r| r.grad_norm.is_some_and(|n| n > clip)),
            "{model}: no step's gradient norm exceeds {clip}; lower the clip"
        );
    }

    let (mut ran, mut skipped) = (0, Vec::new());
    for policy in policies(chunks.len() as u32, layers) {
        let schedule = match compile_policy(
            &training,
            &chunks,
            &policy,
            common::header("equivalence", "host"),
        ) {
            Ok(s) => s,
            // An op that reads two offloaded chunks at once cannot run with one buffer; the
            // compiler says so, and that is the only rejection expected here.
            Err(CompileError::TooFewBuffers { n_buffer: 1, .. }) if policy.n_buffer == 1 => {
                skipped.push(policy.to_string());
                continue;
            }
            Err(e) => panic!("{model} [{policy}]: compile failed: {e}"),
        };
        let schedule = verify(schedule)
            .unwrap_or_else(|e| panic!("{model} [{policy}]: the verifier refused: {e}"));
        let mut exec = Executor::new(&schedule)
            .unwrap_or_else(|e| panic!("{model} [{policy}]: executor: {e}"));
        // Parameters in the placed graph's order, matched by name.
        let init_by_name = by_name(&unfused, init.clone());
        let placed_init: Vec<Vec<f32>> = schedule
            .graph
            .params()
            .map(|(_, p)| init_by_name[&p.name].clone())
            .collect();
        exec.load_params(&placed_init).unwrap();
        exec.set_tracing(true);
        for (step, ([x, y], want)) in data.iter().zip(&expected.reports).enumerate() {
            let got = exec
                .step(&[x, y])
                .unwrap_or_else(|e| panic!("{model} [{policy}] step {step}: {e}"));
            assert_eq!(
                got.loss.to_bits(),
                want.loss.to_bits(),
                "{model} [{policy}] step {step}: loss {} but the interpreter's is {}",
                got.loss,
                want.loss
            );
            assert_eq!(
                got.grad_norm.map(f32::to_bits),
                want.grad_norm.map(f32::to_bits),
                "{model} [{policy}] step {step}: gradient norm {:?} but the interpreter's is {:?}",
                got.grad_norm,
                want.grad_norm
            );
        }
        let final_params = by_name(&schedule.graph, exec.params().unwrap());
        for (name, want) in &expected.params {
            let got = &final_params[name];
            if let Some((i, g, w)) = first_difference(got, want) {
                panic!(
                    "{model} [{policy}]: after {STEPS} steps parameter {name}[{i}] is {g} \
                     but the interpreter's is {w}"
                );
            }
        }
        // The last step was traced: one span per kernel and copy, busy time on compute.
        let work = schedule
            .streams
            .iter()
            .flat_map(|s| &s.instrs)
            .filter(|i| matches!(i, Instr::Kernel { .. } | Instr::Copy { .. }))
            .count();
        assert_eq!(exec.timeline().len(), work, "{model} [{policy}]: timeline");
        assert!(exec.timing().stream_busy_seconds[0] > 0.0);
        assert!(exec.timing().wall_seconds >= exec.timing().stream_busy_seconds[0]);
        ran += 1;
    }
    eprintln!(
        "{model} ({} chunks): {ran} policies bit-identical to the interpreter over {STEPS} \
         steps; skipped (two offloaded chunks at once, one buffer): {skipped:?}",
        chunks.len()
    );
    assert!(ran >= 10, "{model}: only {ran} policies compiled");
}

#[test]
fn gpt2_every_policy_matches_the_interpreter_with_clipping() {
    check("gpt2-tiny", Some(0.5));
}

#[test]
fn llama_every_policy_matches_the_interpreter() {
    check("llama-tiny", None);
}

#[test]
fn mistral_every_policy_matches_the_interpreter_with_clipping() {
    check("mistral-tiny", Some(0.5));
}

#[test]
fn opt_every_policy_matches_the_interpreter() {
    check("opt-tiny", None);
}

#[test]
fn executor_refuses_unverified_schedules_and_bad_batches() {
    let config = protrain_models::load("gpt2-tiny").unwrap();
    let forward = protrain_models::build_forward(
        &config,
        &protrain_models::BuildOptions::new(BATCH, SEQ).with_dtype(DType::F32),
    )
    .unwrap();
    let training = training_graph(&forward, &OptimizerConfig::default()).unwrap();
    let chunks = chunked(&training);
    let layers = config.num_layers as usize;
    let policy = Policy::protrain(0, 2, 1, 1, layers);
    let schedule = compile_policy(
        &training,
        &chunks,
        &policy,
        common::header("equivalence", "host"),
    )
    .unwrap();

    // Without its first wait, the compute stream could read a chunk before it is fetched.
    let mut racy = schedule.clone();
    let compute = &mut racy.streams[0].instrs;
    let wait = compute
        .iter()
        .position(|i| matches!(i, Instr::Wait { .. }))
        .expect("streaming chunks makes the compute stream wait");
    compute.remove(wait);
    // The executor takes only a verified schedule, and the verifier refuses this one.
    let err = verify(racy).expect_err("a racy schedule is refused");
    assert!(err.to_string().contains("wait"), "{err}");
    let schedule = verify(schedule).unwrap();

    // A batch with a token outside the vocabulary fails before anything runs, and the
    // executor still trains as the interpreter does afterwards.
    let mut exec = Executor::new(&schedule).unwrap();
    let init = init_params(&schedule.graph, SEED);
    exec.load_params(&init).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let [x, y] = &data[0];
    let mut bad = y.clone();
    bad[5] = config.vocab_size as i32;
    let err = exec.step(&[x, &bad]).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert!(exec.step(&[x]).is_err(), "one input of two");
    assert_eq!(exec.steps_taken(), 0);
    let got = exec.step(&[x, y]).unwrap();
    let mut interp = Interpreter::new(&schedule.graph);
    for ((id, _), values) in schedule.graph.params().zip(&init) {
        interp.set_param(id, values).unwrap();
    }
    let want = interp.step(&[x, y]).unwrap();
    assert_eq!(got.loss.to_bits(), want.loss.to_bits());
}

/// The parity fixture's model of `family` (tests/fixtures), by path.
fn fixture_model(family: &str) -> String {
    format!("{}/tests/fixtures/{family}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn qwen2_every_policy_matches_the_interpreter_with_clipping() {
    check(&fixture_model("qwen2"), Some(0.5));
}

#[test]
fn qwen3_every_policy_matches_the_interpreter() {
    check(&fixture_model("qwen3"), None);
}

#[test]
fn olmo2_every_policy_matches_the_interpreter_with_clipping() {
    // Its q/k/v and gate/up read the residual stream, which the residual add reads too: fusing
    // them would sum that stream's gradient in another order, so they stay apart.
    check_fusing(&fixture_model("olmo2"), Some(0.5), false);
}

#[test]
fn gemma2_every_policy_matches_the_interpreter_with_clipping() {
    check(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma2"),
        Some(0.5),
    );
}

#[test]
fn gemma3_every_policy_matches_the_interpreter() {
    check(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gemma3"),
        None,
    );
}

#[test]
fn mixtral_every_policy_matches_the_interpreter_with_clipping() {
    check(&fixture_model("mixtral"), Some(0.5));
}

#[test]
fn qwen3_moe_every_policy_matches_the_interpreter() {
    check(&fixture_model("qwen3_moe"), None);
}

#[test]
fn mixtral_with_the_load_balancing_loss_every_policy_matches_the_interpreter() {
    check(&fixture_model("mixtral_aux"), Some(0.5));
}

#[test]
fn qwen3_moe_with_the_load_balancing_loss_every_policy_matches_the_interpreter() {
    check(&fixture_model("qwen3_moe_aux"), None);
}

#[test]
fn phi3_every_policy_matches_the_interpreter_with_clipping() {
    // Packed qkv rotated in place (partial, LongRoPE), packed SwiGLU, a window on every layer.
    check(&fixture_model("phi3"), Some(0.5));
}

#[test]
fn qwen2_yarn_every_policy_matches_the_interpreter_with_clipping() {
    check(&fixture_model("qwen2_yarn"), Some(0.5));
}
