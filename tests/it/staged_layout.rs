//! The 12-byte host layout: a staged chunk keeps no host copy of its bf16
//! parameters and no host gradient chunk; a host cast stream rounds its f32 master weights
//! into one of two parameter staging buffers before each upload, and its gradients are
//! offloaded into one of two gradient staging buffers that the CPU Adam reads. It trains
//! gpt2-tiny and llama-tiny on the host backend bit for bit as the 16- and 14-byte layouts and
//! every chunk resident (losses, final weights and Adam moments); with clipping it falls back
//! to the 14-byte layout (the update needs every gradient first); the verifier refuses an
//! upload not ordered after its cast, a cast after the update of its master weights, and a
//! gradient staging buffer overwritten before the CPU Adam read it.

use crate::common;

use protrain::ir::print_schedule::PrintOptions;
use protrain::ir::verify_schedule::{verify, VerifiedSchedule};
use protrain::ir::{BufferKind, CopyKind, DType, HostLayout, Instr, Schedule, StreamKind};
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

/// `model` in bf16 for the host under `policy`, clipped at `clip` when given.
fn compile(model: &str, policy: &str, clip: Option<f64>) -> VerifiedSchedule {
    let config = protrain::models::load(model).unwrap();
    let options = CompileOptions {
        batch: BATCH,
        seq: SEQ,
        dtype: DType::BF16,
        policy: PolicyChoice::parse(policy).unwrap(),
        optimizer: OptimizerConfig {
            grad_clip: clip,
            ..Default::default()
        },
        // Pinned, so the printed schedule does not depend on this machine's cores and memory.
        ..CompileOptions::for_hardware(common::pinned_host())
    };
    protrain::compile(&config, &options)
        .unwrap_or_else(|e| panic!("{model} [{policy}]: {e}"))
        .schedule
}

/// Each step's loss bits, then every final weight's bits, then every Adam moment's bits.
type Trace = (Vec<u32>, Vec<Vec<u32>>, Vec<(String, Vec<u32>)>);

fn train(schedule: &VerifiedSchedule, model: &str) -> Trace {
    let config = protrain::models::load(model).unwrap();
    let data = common::batches(config.vocab_size as usize, BATCH, SEQ, STEPS, SEED);
    let mut exec = Executor::new(schedule).unwrap();
    exec.load_params(&init_params(&schedule.graph, SEED))
        .unwrap();
    let mut losses = Vec::new();
    for [x, y] in &data {
        losses.push(exec.step(&[x, y]).unwrap().loss.to_bits());
    }
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let params = exec.params().unwrap().iter().map(|p| bits(p)).collect();
    let state = exec
        .state()
        .unwrap()
        .into_iter()
        .map(|(name, x)| (name, bits(&x)))
        .collect();
    (losses, params, state)
}

/// The chunks a cast makes uploads of.
fn staged(schedule: &Schedule) -> Vec<u32> {
    schedule.staged_chunks().iter().map(|c| c.0).collect()
}

fn count(schedule: &Schedule, kind: impl Fn(BufferKind) -> bool) -> usize {
    schedule.buffers.iter().filter(|b| kind(b.kind)).count()
}

fn check(model: &str) {
    let resident = compile(model, "", None);
    let full = compile(model, TIGHT, None);
    let lean = compile(model, &format!("{TIGHT},host_layout=14"), None);
    let staged_all = compile(model, &format!("{TIGHT},host_layout=12"), None);
    let staged_one = compile(model, &format!("{TIGHT},host_layout=12x1"), None);
    assert_eq!(staged_all.header.policy.host_layout, HostLayout::STAGED);
    let chunks = staged_all.chunks.len();
    assert_eq!(
        staged(&staged_all).len(),
        chunks,
        "{model}: every streamed chunk is staged"
    );
    assert_eq!(
        staged(&staged_one).len(),
        1,
        "{model}: 12x1 stages one chunk"
    );
    assert!(staged(&lean).is_empty() && staged(&full).is_empty());
    // A staged chunk keeps neither a host parameter chunk nor a host gradient chunk; four
    // staging buffers of a chunk each serve them all.
    let host_chunks = |s: &Schedule| {
        count(s, |k| {
            matches!(
                k,
                BufferKind::HostChunk { .. } | BufferKind::HostGradChunk { .. }
            )
        })
    };
    assert_eq!(host_chunks(&staged_all), 0);
    assert_eq!(
        count(&staged_all, |k| matches!(
            k,
            BufferKind::ParamStaging { .. } | BufferKind::GradStaging { .. }
        )),
        4
    );
    assert_eq!(host_chunks(&staged_one), chunks - 1);
    let used: u64 = staged_all.chunks.iter().map(|(_, c)| c.used_bytes).sum();
    let staging = 4 * staged_all.chunks.chunk_bytes;
    assert!(
        staged_all.host_bytes + used <= lean.host_bytes + staging,
        "{model}: host region {} (12 B) vs {} (14 B): the parameter chunks ({used} B) are \
         saved, less the staging buffers ({staging} B)",
        staged_all.host_bytes,
        lean.host_bytes
    );
    let want = train(&resident, model);
    for (name, s) in [
        ("16", &full),
        ("14", &lean),
        ("12", &staged_all),
        ("12x1", &staged_one),
    ] {
        let got = train(s, model);
        assert_eq!(got.0, want.0, "{model}: losses of host_layout={name}");
        assert_eq!(got.1, want.1, "{model}: weights of host_layout={name}");
        assert_eq!(got.2, want.2, "{model}: Adam moments of host_layout={name}");
    }
}

#[test]
fn gpt2_staged_trains_bit_identically() {
    check("gpt2-tiny");
}

#[test]
fn llama_staged_trains_bit_identically() {
    check("llama-tiny");
}

/// With clipping the CPU Adam needs the global norm, which exists only after every gradient:
/// staging would have to hold every gradient until then, so `host_layout=12` keeps the
/// 14-byte floor (gradients in the parameter storage) and trains as the resident schedule.
#[test]
fn clipping_falls_back_to_the_14_byte_layout() {
    let model = "gpt2-tiny";
    let clipped = compile(model, &format!("{TIGHT},host_layout=12"), Some(1.0));
    assert!(
        staged(&clipped).is_empty(),
        "a clipped schedule stages nothing"
    );
    let homes = count(&clipped, |k| matches!(k, BufferKind::HostChunk { .. }));
    assert_eq!(homes, clipped.chunks.len());
    assert_eq!(
        count(&clipped, |k| matches!(k, BufferKind::HostGradChunk { .. })),
        0
    );
    let resident = compile(model, "", Some(1.0));
    assert_eq!(train(&clipped, model), train(&resident, model));
}

/// The stream and index of the first instruction matching `what` on a stream of `kind`.
fn find(s: &Schedule, kind: StreamKind, what: impl Fn(&Instr) -> bool) -> (usize, usize) {
    let stream = s.streams.iter().position(|st| st.kind == kind).unwrap();
    let index = s.streams[stream]
        .instrs
        .iter()
        .position(what)
        .expect("the instruction");
    (stream, index)
}

fn refused(mutated: Schedule, says: &[&str]) {
    let err = verify(mutated).expect_err("the mutation").to_string();
    for s in says {
        assert!(err.contains(s), "{s:?} not in: {err}");
    }
}

fn staged_gpt2() -> Schedule {
    (*compile("gpt2-tiny", &format!("{TIGHT},host_layout=12"), None)).clone()
}

/// An upload that does not wait for its cast: the wait before the first staged upload goes.
#[test]
fn an_upload_not_ordered_after_its_cast_is_refused() {
    let s = staged_gpt2();
    let (h2d, fetch) = find(&s, StreamKind::HostToDevice, |i| {
        matches!(
            i,
            Instr::Copy {
                what: CopyKind::FetchChunk { .. },
                ..
            }
        )
    });
    let mut mutated = s.clone();
    // Its waits: the cast's event is the last one before it.
    let wait = (0..fetch)
        .rev()
        .find(|&i| matches!(mutated.streams[h2d].instrs[i], Instr::Wait { .. }))
        .expect("the wait for the cast");
    let Instr::Wait { event } = mutated.streams[h2d].instrs.remove(wait) else {
        unreachable!()
    };
    // The event stays waited for (else the events check refuses it first).
    mutated.streams[h2d].instrs.push(Instr::Wait { event });
    refused(
        mutated,
        &[
            "data flow",
            "fetch chunk0",
            "cast chunk0",
            "not ordered before this read",
        ],
    );
    verify(s).unwrap();
}

/// A cast after the CPU Adam updated the chunk's master weights: chunk 0 cast once more at
/// the end of the host cast stream, after the host optimizer's last instruction.
#[test]
fn a_cast_after_the_update_is_refused() {
    let s = staged_gpt2();
    let mut mutated = s.clone();
    let opt = mutated
        .streams
        .iter()
        .position(|st| st.kind == StreamKind::HostOptimizer)
        .unwrap();
    let (cast, first) = find(&s, StreamKind::HostCast, |i| {
        matches!(i, Instr::CastChunk { .. })
    });
    let again = s.streams[cast].instrs[first].clone();
    let event = protrain::ir::EventId(mutated.events);
    mutated.events += 1;
    mutated.streams[opt].instrs.push(Instr::Record { event });
    mutated.streams[cast].instrs.push(Instr::Wait { event });
    mutated.streams[cast].instrs.push(again);
    refused(
        mutated,
        &[
            "data flow",
            "cast chunk0",
            "already updated this step",
            "every cast of a chunk must come before its update",
        ],
    );
}

/// A gradient staging buffer overwritten before the CPU Adam read it: the offload that
/// reuses a gradient staging buffer no longer waits for the update of the gradients there.
#[test]
fn a_gradient_staging_buffer_overwritten_before_its_update_is_refused() {
    let s = staged_gpt2();
    let d2h = s
        .streams
        .iter()
        .position(|st| st.kind == StreamKind::DeviceToHost)
        .unwrap();
    let into_staging = |i: &Instr| match i {
        Instr::Copy {
            what: CopyKind::OffloadGrads { .. },
            dst,
            ..
        } => matches!(s.buffer(dst.buffer).kind, BufferKind::GradStaging { .. }),
        _ => false,
    };
    let offloads: Vec<usize> = (0..s.streams[d2h].instrs.len())
        .filter(|&i| into_staging(&s.streams[d2h].instrs[i]))
        .collect();
    assert!(
        offloads.len() >= 3,
        "three offloads reuse two staging buffers"
    );
    let third = offloads[2];
    let mut mutated = s.clone();
    let wait = (0..third)
        .rev()
        .find(|&i| matches!(mutated.streams[d2h].instrs[i], Instr::Wait { .. }))
        .unwrap();
    let Instr::Wait { event } = mutated.streams[d2h].instrs.remove(wait) else {
        unreachable!()
    };
    mutated.streams[d2h].instrs.push(Instr::Wait { event });
    refused(mutated, &["data flow", "offload_grads"]);
    verify(s).unwrap();
}

/// The printed form of a staged schedule: its staging buffers, the host cast stream and
/// every wait that orders a staging buffer's reuse.
#[test]
fn a_staged_schedule_prints() {
    let s = staged_gpt2();
    insta::assert_snapshot!(
        "gpt2_tiny_staged_host",
        s.to_text_with(PrintOptions::WITHOUT_REPORT)
    );
}
