//! The passes end to end on the tiny models, under policies that exercise every mechanism:
//! every schedule compiles and passes the verifier.

use protrain_compiler::chunk::chunk_apart;
use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::OptimizerConfig;
use protrain_ir::verify_schedule::verify_schedule;
use protrain_ir::{BlockMode, DType, Policy};

fn header() -> HeaderInputs {
    crate::common::header("test", "test")
}

#[test]
fn every_policy_compiles_and_verifies() {
    // bf16 chunks have padding between members that other buffers' bytes may fill: chunk
    // copies carry it as undefined (gpt2-tiny bf16 under the mixed policy once failed here).
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("mistral-tiny", DType::F32),
        ("opt-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
        ("llama-tiny", DType::BF16),
    ] {
        let config = protrain_models::load(model).expect("preset");
        let options = protrain_models::BuildOptions::new(2, 16).with_dtype(dtype);
        let forward = protrain_models::build_forward(&config, &options).expect("builds");
        for clip in [None, Some(1.0)] {
            let optimizer = OptimizerConfig {
                grad_clip: clip,
                ..Default::default()
            };
            let training = training_graph(&forward, &optimizer).expect("autodiff");
            let chunks = chunked(&training);
            let n = chunks.len() as u32;
            assert!(
                n >= 2,
                "{model}: the tiny models have several chunks to stream"
            );
            for policy in [
                Policy::resident(n, 2),
                Policy::protrain(0, 2, 0, 2, 2),
                Policy::protrain(0, 2, 2, 0, 2),
                Policy::protrain(1, 2, 1, 1, 2),
                Policy::protrain(2.min(n - 1), 2, 1, 1, 2),
                Policy::protrain(n - 1, 1, 0, 0, 2),
                Policy::protrain(0, 3.min(n), 1, 0, 2),
            ] {
                let s = compile_policy(&training, &chunks, &policy, header())
                    .unwrap_or_else(|e| panic!("{model} clip {clip:?} {policy}: {e}"));
                verify_schedule(&s)
                    .unwrap_or_else(|e| panic!("{model} clip {clip:?} {policy}: {e}"));
                // Mixed precision: every parameter has its f32 master weight listed.
                let narrow = dtype != DType::F32;
                let want = if narrow { training.params().count() } else { 0 };
                assert_eq!(s.masters.len(), want, "{model} {dtype} {policy}");
                assert_eq!(s.to_text().contains("\nf32 master weights: "), narrow);
                let swaps = policy.count(BlockMode::Swap);
                let offloads = s.streams[2]
                    .instrs
                    .iter()
                    .filter(|i| {
                        matches!(
                            i,
                            protrain_ir::Instr::Copy {
                                what: protrain_ir::CopyKind::OffloadActivation { .. },
                                ..
                            }
                        )
                    })
                    .count();
                assert_eq!(
                    offloads > 0,
                    swaps > 0,
                    "{model} {policy}: swapped blocks offload activations"
                );
                assert!(s.arena_bytes >= s.header.prediction.lower_bound_bytes);
            }
        }
    }
}

#[test]
fn a_bf16_schedule_without_a_master_weight_or_with_one_over_a_home_is_refused() {
    let config = protrain_models::load("llama-tiny").expect("preset");
    let options = protrain_models::BuildOptions::new(2, 16).with_dtype(DType::BF16);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    let training = training_graph(&forward, &OptimizerConfig::default()).expect("autodiff");
    let chunks = chunked(&training);
    let policy = Policy::protrain(1, 2, 0, 1, 2);
    let s = compile_policy(&training, &chunks, &policy, header()).expect("compiles");
    verify_schedule(&s).expect("valid");

    let mut missing = s.clone();
    let (param, _) = missing.masters.remove(0);
    let name = s.graph.value(param).name.clone();
    let err = verify_schedule(&missing)
        .expect_err("a master is missing")
        .to_string();
    assert!(
        err.contains("gives it no f32 master weight") && err.contains(&name),
        "{err}"
    );

    let mut over = s.clone();
    let (_, m_home) = *over
        .homes
        .iter()
        .find(|(v, _)| s.graph.value(*v).name.starts_with("adam.m."))
        .expect("an Adam moment");
    over.masters[0].1 = m_home;
    let err = verify_schedule(&over)
        .expect_err("a master over a moment")
        .to_string();
    assert!(
        err.contains("overlap") && err.contains("master weight"),
        "{err}"
    );
}

/// Packed apart, a parameter outside the layers more than four times the layers' largest (here
/// a 4096-token vocabulary's embedding and head beside 64-wide layers) is a chunk of its own,
/// sized to it; the other chunks are packed at the layers' scale, and every policy still
/// compiles and verifies with chunk buffers of the table's capacity, the largest chunk's.
#[test]
fn a_parameter_larger_than_the_chunk_size_is_a_chunk_of_its_own() {
    let mut config = protrain_models::load("llama-tiny").expect("preset");
    config.vocab_size = 4096;
    let options = protrain_models::BuildOptions::new(2, 16).with_dtype(DType::F32);
    let forward = protrain_models::build_forward(&config, &options).expect("builds");
    let training = training_graph(&forward, &OptimizerConfig::default()).expect("autodiff");
    // The default table sizes every chunk to the embedding; llama-tiny's own 256-token
    // vocabulary has no parameter to set apart.
    assert!(chunked(&training).chunk_bytes >= 4096 * 64 * 4);
    let tiny = protrain_models::build_forward(
        &protrain_models::load("llama-tiny").expect("preset"),
        &options,
    )
    .expect("builds");
    let tiny = training_graph(&tiny, &OptimizerConfig::default()).expect("autodiff");
    assert!(chunk_apart(&tiny, 1).is_none());
    let chunks = chunk_apart(&training, 1).expect("the embedding is set apart");
    let embedding = 4096 * 64 * 4;
    assert_eq!(chunks.chunk_bytes, embedding, "{:?}", chunks.trials);
    let own: Vec<usize> = (0..chunks.len())
        .filter(|&c| chunks.chunks[c].used_bytes == embedding)
        .collect();
    assert_eq!(own.len(), 2, "the embedding and the untied head: {own:?}");
    for &c in &own {
        assert_eq!(chunks.chunks[c].members.len(), 1);
    }
    // The packing size (the best trial) is at most four times the largest layer weight
    // (64 x 128 f32 = 32 KiB), so the layers stream in several chunks.
    assert!(chunks.trials[0].chunk_bytes <= 4 * 64 * 128 * 4);
    assert!(chunks.len() >= 4, "{} chunks", chunks.len());
    let n = chunks.len() as u32;
    for policy in [
        Policy::resident(n, 2),
        Policy::protrain(0, 2, 0, 2, 2),
        Policy::protrain(1, 2, 1, 1, 2),
    ] {
        let s = compile_policy(&training, &chunks, &policy, header())
            .unwrap_or_else(|e| panic!("{policy}: {e}"));
        verify_schedule(&s).unwrap_or_else(|e| panic!("{policy}: {e}"));
    }
}
