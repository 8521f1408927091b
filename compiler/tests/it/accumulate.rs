//! Gradient accumulation in the schedule: every policy's accumulating schedule verifies, costs
//! its accumulators' bytes and no more, runs the optimizer once, and a step of one micro-batch
//! is the schedule the pipeline always made.

use protrain_compiler::accumulate::scale_loss_gradient;
use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::simulate::simulate;
use protrain_compiler::OptimizerConfig;
use protrain_ir::print_schedule::print_schedule;
use protrain_ir::verify_schedule::{verify, verify_schedule, Invariant};
use protrain_ir::{file, BufferKind, DType, Instr, OpKind, Policy, Role, Schedule, Space};

fn header() -> HeaderInputs {
    crate::common::header("accumulate", "test")
}

/// Every policy of the golden table, for `model` with and without clipping, at `k`
/// micro-batches: (description, schedule at k, schedule at 1).
fn schedules(model: &str, dtype: DType, k: u64) -> Vec<(String, Schedule, Schedule)> {
    let config = protrain_models::load(model).expect("preset");
    let options = protrain_models::BuildOptions::new(2, 16).with_dtype(dtype);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    let mut out = Vec::new();
    for clip in [None, Some(1.0)] {
        let optimizer = OptimizerConfig {
            grad_clip: clip,
            ..Default::default()
        };
        let single = training_graph(&forward, &optimizer).expect("autodiff");
        let mut training = single.clone();
        scale_loss_gradient(&mut training, k).expect("scales");
        assert_eq!(training.micro_batches(), k);
        let chunks = chunked(&training);
        let n = chunks.len() as u32;
        for policy in [
            Policy::resident(n, 2),
            Policy::protrain(0, 1, 0, 0, 2),
            Policy::protrain(0, 2, 0, 2, 2),
            Policy::protrain(0, 2, 2, 0, 2),
            Policy::protrain(1, 2, 1, 1, 2),
            Policy::protrain(n - 1, 1, 0, 0, 2),
            Policy::protrain(n, 0, 2, 0, 2),
        ] {
            let what = format!("{model} {dtype} clip {clip:?} {policy}");
            let s = compile_policy(&training, &chunks, &policy, header())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let one = compile_policy(&single, &chunks, &policy, header())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            out.push((what, s, one));
        }
    }
    out
}

#[test]
fn every_policy_accumulates_in_a_verified_schedule() {
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
    ] {
        for (what, s, one) in schedules(model, dtype, 3) {
            verify_schedule(&s).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(s.micro_batches(), 3, "{what}");
            // The accumulators are the only new device memory: one per gradient AdamW reads.
            let acc_bytes: u64 = s
                .graph
                .values()
                .filter(|(_, v)| v.role == Role::Accumulator)
                .map(|(id, v)| {
                    let home = s.homes.iter().find(|(h, _)| *h == id).expect("a home").1;
                    match s.buffer(home.buffer).space {
                        Space::Device => v.ty.bytes().div_ceil(256) * 256,
                        Space::Host | Space::Disk => 0,
                    }
                })
                .sum();
            let grew = s.arena_bytes - one.arena_bytes;
            assert!(
                grew >= acc_bytes && grew < acc_bytes + 256,
                "{what}: the arena grew by {grew}, the device accumulators take {acc_bytes}"
            );
            // Every AdamW runs after the marker and reads an accumulator; each gradient is
            // summed once before it.
            for stream in &s.streams {
                let at = stream
                    .instrs
                    .iter()
                    .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
                    .expect("every stream has a marker");
                for (i, instr) in stream.instrs.iter().enumerate() {
                    let Instr::Kernel { op, .. } = instr else {
                        continue;
                    };
                    let o = s.graph.op(*op);
                    let optimizer = matches!(
                        o.kind,
                        OpKind::AdamW { .. } | OpKind::GradNormSq | OpKind::ClipCoef { .. }
                    );
                    assert_eq!(optimizer, i > at, "{what}: {} at {i}", o.kind.mnemonic());
                    if o.kind == OpKind::AccumulateGrad {
                        assert!(i < at, "{what}");
                    }
                    if let OpKind::AdamW { .. } = o.kind {
                        assert_eq!(s.graph.value(o.inputs[1]).role, Role::Accumulator, "{what}");
                    }
                }
            }
            let sums = s
                .graph
                .ops()
                .filter(|(_, o)| o.kind == OpKind::AccumulateGrad)
                .count();
            let adamws = s
                .graph
                .ops()
                .filter(|(_, o)| matches!(o.kind, OpKind::AdamW { .. }))
                .count();
            assert_eq!(sums, adamws, "{what}");
            // The file round-trips.
            let decoded = file::decode(&file::encode(&s)).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(decoded.micro_batches(), 3);
        }
    }
}

#[test]
fn offloaded_gradients_accumulate_on_the_host() {
    let (what, s, _) = schedules("gpt2-tiny", DType::F32, 2)
        .into_iter()
        .find(|(w, _, _)| w.contains("Some(1.0)") && w.contains("n_persist=0"))
        .expect("an offloading policy with clipping");
    let kinds: Vec<(BufferKind, Space)> = s.buffers.iter().map(|b| (b.kind, b.space)).collect();
    assert!(
        kinds.contains(&(BufferKind::Accumulators, Space::Host)),
        "{what}"
    );
    assert!(
        !kinds.contains(&(BufferKind::Accumulators, Space::Device)),
        "{what}"
    );
    assert!(
        kinds.contains(&(BufferKind::HostScratch, Space::Host)),
        "{what}"
    );
}

#[test]
fn one_micro_batch_is_the_schedule_without_accumulation() {
    for (what, s, one) in schedules("gpt2-tiny", DType::F32, 1) {
        assert_eq!(file::encode(&s), file::encode(&one), "{what}");
        assert_eq!(s.micro_batches(), 1);
    }
}

#[test]
fn the_verifier_rejects_inconsistent_markers() {
    let (_, s, _) = schedules("gpt2-tiny", DType::F32, 2).remove(1);
    // One stream without its marker.
    let mut broken = s.clone();
    let stream = &mut broken.streams[0];
    let at = stream
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        .expect("marker");
    stream.instrs.remove(at);
    let e = verify(broken).expect_err("a stream without a marker");
    assert_eq!(e.invariant, Invariant::Phases, "{e}");
    // Two counts.
    let mut broken = s.clone();
    for instr in &mut broken.streams[0].instrs {
        if let Instr::EndMicroBatch { micro_batches } = instr {
            *micro_batches = 3;
        }
    }
    let e = verify(broken).expect_err("two counts");
    assert_eq!(e.invariant, Invariant::Phases, "{e}");
    // The update moved before the marker: the AdamW ops would run every micro-batch and read
    // accumulators that are not summed yet.
    let (what, s, _) = schedules("gpt2-tiny", DType::F32, 2)
        .into_iter()
        .find(|(w, _, _)| w.contains("Some(1.0)") && w.contains("n_buffer=0"))
        .expect("a resident policy with clipping");
    let mut broken = s;
    let compute = &mut broken.streams[0];
    let at = compute
        .instrs
        .iter()
        .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        .expect("marker");
    let marker = compute.instrs.remove(at);
    compute.instrs.push(marker);
    let e = verify(broken).expect_err(&what);
    assert_eq!(e.invariant, Invariant::Phases, "{e}");
    assert!(e.message.contains("runs once per step"), "{e}");
}

#[test]
fn the_simulator_costs_every_micro_batch_and_the_printer_shows_the_split() {
    let hardware = protrain_ir::HardwareProfile::preset("rtx3090").expect("a preset");
    let cost = protrain_compiler::cost::cost_model(&hardware);
    for (what, s, one) in schedules("gpt2-tiny", DType::F32, 4) {
        let (s, one) = (verify(s).expect("verifies"), verify(one).expect("verifies"));
        let four = simulate(&s, cost.as_ref()).expect("simulates").step_seconds;
        let single = simulate(&one, cost.as_ref())
            .expect("simulates")
            .step_seconds;
        // Four forward and backward passes, one update: more than twice a step of one
        // micro-batch, less than five of them. (Each micro-batch also launches an
        // accumulate_grad per parameter, which a step of one does not: 28 launches of 5 us
        // on this model, about a quarter of its 0.5 ms step now that a run of device AdamW
        // ops is one launch; the bound was 4.5 when the step of one paid a launch per AdamW.)
        assert!(
            four > 2.0 * single && four < 5.0 * single,
            "{what}: 4 micro-batches {four:e} s, one {single:e} s"
        );
        assert_eq!(
            s.header.prediction.peak_device_bytes, s.arena_bytes,
            "{what}: the prediction counts the accumulators"
        );
        let text = print_schedule(&s);
        assert!(
            text.contains("; gradient accumulation: 4 micro-batches of batch 2"),
            "{what}"
        );
        let markers = text.matches("end_micro_batch x4").count();
        assert_eq!(markers, s.streams.len(), "{what}: one marker per stream");
        assert!(text.contains("accumulate_grad"), "{what}");
        assert!(
            !print_schedule(&one).contains("gradient accumulation"),
            "{what}"
        );
    }
}

#[test]
fn the_verifier_checks_the_update_programs_order() {
    let (what, s, _) = schedules("gpt2-tiny", DType::F32, 2)
        .into_iter()
        .find(|(w, _, _)| w.contains("Some(1.0)") && w.contains("n_persist=1"))
        .expect("a mixed policy with clipping");
    verify_schedule(&s).unwrap_or_else(|e| panic!("{what}: {e}"));
    // Without its waits the host-to-device stream would upload the host accumulators'
    // squared norms before the host optimizer computed them.
    let h2d = s
        .streams
        .iter()
        .position(|st| st.kind == protrain_ir::StreamKind::HostToDevice)
        .expect("a host-to-device stream");
    let mut broken = s.clone();
    let instrs = &mut broken.streams[h2d].instrs;
    let at = instrs
        .iter()
        .position(|i| matches!(i, Instr::EndMicroBatch { .. }))
        .expect("marker");
    let waited: Vec<protrain_ir::EventId> = instrs[at + 1..]
        .iter()
        .filter_map(|i| match i {
            Instr::Wait { event } => Some(*event),
            _ => None,
        })
        .collect();
    assert!(!waited.is_empty(), "{what}: the update uploads after waits");
    // Drop the waits and their records, so every event left is still recorded and waited:
    // only the data flow can tell.
    for stream in &mut broken.streams {
        stream.instrs.retain(|i| match i {
            Instr::Wait { event } | Instr::Record { event } => !waited.contains(event),
            _ => true,
        });
    }
    let e = verify(broken).expect_err("uploads before the norms exist");
    assert_eq!(e.invariant, Invariant::DataFlow, "{what}: {e}");
    assert!(
        e.message.starts_with("in the update program"),
        "{what}: {e}"
    );
}

/// An accumulating schedule that clips is the same file on every compile: the squared norms
/// are rewired to the accumulators in one order, and the order of the rewiring is in the
/// file (it moves the graph's edges).
#[test]
fn a_clipped_accumulating_schedule_is_the_same_file_every_time() {
    let config = protrain_models::load("gpt2-tiny").expect("preset");
    let options = protrain_models::BuildOptions::new(2, 16);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    let optimizer = OptimizerConfig {
        grad_clip: Some(1.0),
        ..Default::default()
    };
    let mut training = training_graph(&forward, &optimizer).expect("autodiff");
    scale_loss_gradient(&mut training, 2).expect("scales");
    let chunks = chunked(&training);
    let policy = Policy::protrain(0, 2, 0, 2, 2);
    let bytes =
        || file::encode(&compile_policy(&training, &chunks, &policy, header()).expect("compiles"));
    let first = bytes();
    for _ in 0..4 {
        assert!(bytes() == first, "two compiles of one schedule differ");
    }
}
