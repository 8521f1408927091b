//! Forward-only compilation (for evaluation): the pipeline skips autodiff, and placement,
//! movement, streams, planning and emission handle a graph with no backward pass: the
//! schedule verifies, computes the loss and nothing else, reads parameters without writing
//! them, fetches streamed chunks without offloading gradients, and needs less memory than
//! the training schedule of the same model and policy.

use protrain_compiler::pipeline::{compile, CompileOptions, Context, PolicyChoice, Stage};
use protrain_compiler::CompileError;
use protrain_ir::verify_schedule::verify_schedule;
use protrain_ir::{BufferKind, CopyKind, DType, Instr, OpKind, Phase, Schedule};

fn options(policy: &str, forward_only: bool, dtype: DType) -> CompileOptions {
    CompileOptions {
        batch: 2,
        seq: 16,
        dtype,
        policy: PolicyChoice::parse(policy).expect("a policy"),
        forward_only,
        ..CompileOptions::default()
    }
}

fn copies(s: &Schedule) -> Vec<&CopyKind> {
    s.streams
        .iter()
        .flat_map(|st| &st.instrs)
        .filter_map(|i| match i {
            Instr::Copy { what, .. } => Some(what),
            _ => None,
        })
        .collect()
}

/// Kernels and copies that write a buffer holding a parameter's home.
fn param_writes(s: &Schedule) -> usize {
    let homes: std::collections::BTreeSet<_> = s
        .graph
        .params()
        .filter_map(|(_, p)| s.homes.iter().find(|(v, _)| *v == p.value))
        .map(|(_, t)| t.buffer)
        .collect();
    s.streams
        .iter()
        .flat_map(|st| &st.instrs)
        .filter(|i| match i {
            Instr::Kernel {
                op,
                inputs,
                outputs,
                ..
            } => {
                let in_place = s
                    .graph
                    .op(*op)
                    .kind
                    .writes_inputs()
                    .iter()
                    .map(|&i| &inputs[i]);
                outputs
                    .iter()
                    .chain(in_place)
                    .any(|t| homes.contains(&t.buffer))
            }
            Instr::Copy { dst, .. } => homes.contains(&dst.buffer),
            _ => false,
        })
        .count()
}

#[test]
fn a_forward_only_schedule_computes_the_loss_and_nothing_else() {
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("opt-tiny", DType::F32),
        ("mistral-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
    ] {
        let config = protrain_models::load(model).expect("preset");
        for policy in [
            "blocks=KK",
            "n_persist=0 n_buffer=2",
            "n_persist=1 n_buffer=1",
        ] {
            let what = format!("{model} {dtype} {policy}");
            let eval = compile(&config, &options(policy, true, dtype)).expect(&what);
            let s = &eval.schedule;
            verify_schedule(s).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(s.graph.is_forward_only(), "{what}: a forward graph");
            for (_, op) in s.graph.ops() {
                assert_eq!(op.phase, Phase::Forward, "{what}: {:?}", op.kind);
                assert!(
                    !matches!(op.kind, OpKind::AdamW { .. }),
                    "{what}: no optimizer"
                );
            }
            assert!(
                s.graph.ops().any(|(_, op)| op.kind == OpKind::CrossEntropy),
                "{what}: the loss is computed"
            );
            for b in &s.buffers {
                assert!(
                    !matches!(
                        b.kind,
                        BufferKind::OptimizerState { .. }
                            | BufferKind::GradChunk { .. }
                            | BufferKind::HostGradChunk { .. }
                    ),
                    "{what}: buffer {} holds optimizer state or gradients",
                    b.name
                );
            }
            assert!(s.masters.is_empty(), "{what}: no master weights to update");
            // Parameters are read-only: nothing writes the buffers that hold them.
            assert_eq!(param_writes(s), 0, "{what}: parameters are written");
            let copies = copies(s);
            let fetches = copies
                .iter()
                .filter(|c| matches!(c, CopyKind::FetchChunk { .. }))
                .count();
            let streamed = s.chunks.len() as u32 - s.header.policy.n_persist;
            assert_eq!(
                fetches > 0,
                streamed > 0,
                "{what}: streamed chunks are fetched, and only they"
            );
            assert!(
                copies
                    .iter()
                    .all(|c| matches!(c, CopyKind::FetchChunk { .. })),
                "{what}: a forward pass only fetches chunks: {copies:?}"
            );
            assert!(
                s.to_text().contains("; forward only:"),
                "{what}: the printer says so"
            );
            // The same policy's training schedule holds the forward pass and more.
            let training = compile(&config, &options(policy, false, dtype)).expect(&what);
            assert!(
                s.arena_bytes < training.schedule.arena_bytes,
                "{what}: forward-only arena {} is not below training's {}",
                s.arena_bytes,
                training.schedule.arena_bytes
            );
            assert!(!training.schedule.graph.is_forward_only());
            assert!(
                param_writes(&training.schedule) > 0,
                "{what}: AdamW updates in place"
            );
            assert!(!training.schedule.to_text().contains("; forward only:"));
        }
    }
}

#[test]
fn the_search_keeps_every_layer_of_a_forward_only_graph() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let config = protrain_models::load(model).expect("preset");
        let resident = compile(&config, &options("blocks=KK", true, DType::F32)).expect("resident");
        let chunks = resident.schedule.chunks.len() as u32;
        // Budgets from the resident arena down: the search streams more and more chunks, and
        // has nothing to swap or recompute.
        let mut streamed_some = false;
        for quarter in [4, 3] {
            let budget = resident.schedule.arena_bytes * quarter / 4;
            let searched = compile(
                &config,
                &CompileOptions {
                    device_budget: Some(budget),
                    ..options("auto", true, DType::F32)
                },
            )
            .unwrap_or_else(|e| panic!("{model} within {budget} bytes: {e}"));
            let p = &searched.schedule.header.policy;
            assert!(searched.schedule.arena_bytes <= budget, "{model}: {p}");
            assert!(searched.schedule.graph.is_forward_only(), "{model}: {p}");
            assert_eq!(
                p.count(protrain_ir::BlockMode::Keep),
                p.blocks.len(),
                "{model}: every layer is kept: {p}"
            );
            streamed_some |= p.n_persist < chunks;
        }
        assert!(streamed_some, "{model}: a tight budget streams chunks");
        // Below the leanest policy, the error says what would fit.
        let err = compile(
            &config,
            &CompileOptions {
                device_budget: Some(resident.schedule.arena_bytes / 10),
                ..options("auto", true, DType::F32)
            },
        )
        .expect_err("nothing fits a tenth of the resident arena");
        let text = err.to_string();
        assert!(
            matches!(err, CompileError::BudgetTooSmall(_))
                && text.contains("no forward-only policy fits")
                && text.contains("Give device_budget at least")
                && !text.contains("--"),
            "{text}"
        );
    }
}

#[test]
fn a_forward_only_policy_that_swaps_or_recomputes_is_refused() {
    let config = protrain_models::load("gpt2-tiny").expect("preset");
    for policy in ["n_checkpoint=1", "n_swap=2", "blocks=KC"] {
        let err = compile(&config, &options(policy, true, DType::F32))
            .expect_err("a forward pass has no backward pass to recompute or swap for");
        assert!(
            matches!(err, CompileError::BadPolicy(_)),
            "{policy}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("forward-only") && text.contains("n_checkpoint"),
            "{text}"
        );
    }
}

#[test]
fn the_autodiff_stage_of_a_forward_only_compilation_is_the_fused_graph() {
    let config = protrain_models::load("llama-tiny").expect("preset");
    let mut context = Context::new(&config, options("auto", true, DType::F32));
    context.run_until(Stage::Autodiff).expect("runs");
    let (fused, _) = context.fused().expect("fused");
    let training = context.training().expect("the autodiff stage");
    assert_eq!(training.to_text(), fused.to_text());
}
