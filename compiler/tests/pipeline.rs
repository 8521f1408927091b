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

#[test]
fn search_timing() {
    use protrain_compiler::search::{search, SearchOptions};
    for (name, hw) in [
        ("llama-2-70b", "a100-80gb"),
        ("gpt2", "a100-80gb"),
        ("gpt2-xl", "rtx3090"),
    ] {
        let t0 = std::time::Instant::now();
        let config = protrain_models::load(name).unwrap();
        let forward = protrain_models::build_forward(
            &config,
            &protrain_models::BuildOptions::new(4, if name == "gpt2-tiny" { 64 } else { 1024 }),
        )
        .unwrap();
        let training = training_graph(&forward, &OptimizerConfig::default()).unwrap();
        let chunks = chunked(&training);
        let t1 = t0.elapsed();
        let profile = protrain_ir::HardwareProfile::preset(hw).unwrap();
        let cost = protrain_compiler::cost::cost_model(&profile);
        let opts = SearchOptions {
            device_budget: profile.usable_device_bytes(),
            host_budget: 1 << 40,
            max_compiled: 64,
            hardware: profile.summary(),
            model: name.into(),
        };
        let (s, report) = search(&training, &chunks, cost.as_ref(), &opts).unwrap();
        eprintln!(
            "{name}: build {:?} total {:?}, chunks {}, {}",
            t1,
            t0.elapsed(),
            chunks.len(),
            report.to_text()
        );
        eprintln!("arena {} budget {}", s.arena_bytes, opts.device_budget);
    }
}

#[test]
fn verify_grid() {
    for model in ["gpt2-tiny", "llama-tiny", "mistral-tiny", "opt-tiny"] {
        let config = protrain_models::load(model).unwrap();
        let forward = protrain_models::build_forward(
            &config,
            &protrain_models::BuildOptions::new(2, 16).with_dtype(protrain_ir::DType::F32),
        )
        .unwrap();
        for clip in [None, Some(1.0)] {
            let training = training_graph(
                &forward,
                &OptimizerConfig {
                    grad_clip: clip,
                    ..Default::default()
                },
            )
            .unwrap();
            let chunks = chunked(&training);
            let n = chunks.len() as u32;
            for policy in [
                Policy::resident(n, 2),
                Policy::protrain(0, 2, 0, 2, 2),
                Policy::protrain(0, 2, 2, 0, 2),
                Policy::protrain(1, 2, 1, 1, 2),
                Policy::protrain(n - 1, 1, 0, 0, 2),
                Policy::protrain(0, 3, 1, 0, 2),
            ] {
                match compile_policy(&training, &chunks, &policy, header()) {
                    Ok(s) => {
                        if let Err(e) = protrain_ir::verify_schedule::verify_schedule(&s) {
                            panic!("{model} clip {clip:?} {policy}: {e}");
                        }
                    }
                    Err(e) => eprintln!("{model} {policy}: {e}"),
                }
            }
        }
    }
}
