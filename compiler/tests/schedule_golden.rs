//! The schedules the pipeline compiles, pinned byte for byte: a digest of every schedule file
//! over the tiny models, both element types, with and without clipping, under policies that
//! exercise every kind of movement (streamed chunks through one to three buffers, swapped and
//! recomputed blocks, the host optimizer).
//!
//! Moving a decision from one pass to another must not change a schedule: the digests below
//! were recorded before movement became nodes of the placed graph, and a restructuring that
//! changes a buffer, an instruction, an event or their order changes a digest. A change that
//! is meant to change schedules updates the table, and says why in its commit. The predicted
//! step time is left out (it belongs to the cost model, which may be recalibrated).

use protrain_compiler::emit::HeaderInputs;
use protrain_compiler::pipeline::{chunked, compile_policy, training_graph};
use protrain_compiler::OptimizerConfig;
use protrain_ir::{file, DType, Policy};

fn header() -> HeaderInputs {
    HeaderInputs {
        model: "golden".into(),
        hardware: "golden".into(),
        device_budget_bytes: u64::MAX,
        host_budget_bytes: u64::MAX,
        report: String::new(),
    }
}

/// FNV-1a, 64 bits: a digest that needs no dependency and is stable across platforms.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Every configuration and its schedule's digest, as `model dtype clip policy digest` lines.
fn digests() -> Vec<String> {
    let mut lines = Vec::new();
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
            for policy in [
                Policy::resident(n, 2),
                Policy::protrain(0, 1, 0, 0, 2),
                Policy::protrain(0, 2, 0, 2, 2),
                Policy::protrain(0, 2, 2, 0, 2),
                Policy::protrain(1, 2, 1, 1, 2),
                Policy::protrain(2.min(n - 1), 2, 1, 1, 2),
                Policy::protrain(n - 1, 1, 0, 0, 2),
                Policy::protrain(0, 3.min(n), 1, 0, 2),
                Policy::protrain(n, 0, 2, 0, 2),
            ] {
                let mut s = compile_policy(&training, &chunks, &policy, header())
                    .unwrap_or_else(|e| panic!("{model} clip {clip:?} {policy}: {e}"));
                s.header.prediction.step_seconds = 0.0;
                s.header.prediction.stream_busy_seconds.fill(0.0);
                let clip = clip.map_or("noclip", |_| "clip");
                lines.push(format!(
                    "{model} {dtype} {clip} {policy} {:016x}",
                    fnv1a(&file::encode(&s))
                ));
            }
        }
    }
    lines
}

#[test]
fn schedules_are_byte_identical_to_the_recorded_ones() {
    let got = digests();
    let want: Vec<&str> = GOLDEN.lines().filter(|l| !l.trim().is_empty()).collect();
    let differing: Vec<String> = got
        .iter()
        .filter(|g| !want.contains(&g.as_str()))
        .cloned()
        .collect();
    assert!(
        differing.is_empty() && got.len() == want.len(),
        "{} of {} schedules differ from the recorded ones:\n{}\n\nthe whole table now:\n{}",
        differing.len(),
        want.len(),
        differing.join("\n"),
        got.join("\n")
    );
}

const GOLDEN: &str = "
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK e25b74e351d79ee6
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK c006f41bcdf86163
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC cef3ef8ef4987ecf
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 70b54ee2c4ee23e0
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b6661d4f0c3bda49
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 25b8765ec1503cc9
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 66adabad43bf667f
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 13fd74712e2bb17f
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 07264fcfed3fe9f9
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 4fe34439e616a5f2
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 1de0060d0de4e716
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 65ce7be46f497b3f
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS e73e6da7552b762f
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7f52bbdca2c75ee1
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 26c9cbe878c025e6
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 0949e4ad8e48b258
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK ae16416ec271ed8c
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 3cfb62166b834fc6
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 5abca9261685b2a0
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK aa49d8c135cd9a96
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 424e7432f1bb43d1
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 278f002dd91cbfd6
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 47b16bee26e3acaf
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 47b16bee26e3acaf
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 942c8e974ae9f3b1
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 29052ef4a7b5bc92
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 685e510dbe33eb2d
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 9ee1c1a951e49803
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 06d4e188069d9d4d
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC d725810ccdc4c425
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS a675f0df3f9e206f
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fa85e051d77c02e8
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fa85e051d77c02e8
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK c57b8922565a2451
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK bc86ddcb5d419b34
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 7c337901925f0e18
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 9891d45e0e059bd0
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK b227eaf454930c3e
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 3e49dbe223304f9b
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 695831237590a2be
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC ec75ed0ce2bae80d
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC ec75ed0ce2bae80d
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 39462c44c0523554
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 9e5faec72b08d76e
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 94b07824f457167d
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 98521b3bf73eaa8d
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 691d491fff77eeb3
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 9f852d3aa8ec511b
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 09ee1c1ef41628a9
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e7d61e90782fd855
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e7d61e90782fd855
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK a753a6d4f9513bb5
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK f48026fddb8320d9
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 25660efe7c5a02cb
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK a67c605b65c655e5
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 553a4941d0e2263e
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 881d8bc7da0bf20a
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 7b0a1ecf68cc50d4
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2f3d77da0735a99c
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC d7bcc2a44fd5cc8e
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK e85e3d3fe2830840
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 51129bbd80355933
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 794f91b3b66bbe4e
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK a78505f15eddf92b
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 5b902a08f961ecee
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 48ebcf29c161a5e9
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS ed9900a98a6a34ae
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 979476be19cc270d
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 1a8df5c9ba2febd7
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK ef94adc0bd5d78bf
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 3367e255cb81513b
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS a214222c824691df
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 7f0e48cb0ef7e17a
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK b18003d59dc9b138
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC fefd5f8f1f23b051
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS c35c2009f902eee2
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 254eb87b233fe718
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC c6fa2984bb002c1e
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 2a971569e23cb5fa
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 6d110eeb8cc79484
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS b34ac7fa173c8185
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 4abaf503c3f572e3
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 7c27d5a21ba27724
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 1248342439573cbe
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 9727a7103cd15438
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 21b154ef69024b01
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 99b270e0a483620b
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 8f119a3ef6a86aab
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 55678b60a9da3e52
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 480356dbd4b7edf7
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 0a4b0fa690db6fc6
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 47ffec207f2fc1f6
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 911de2badcc4793c
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS d80e3a5e44287e5a
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a0c9bd3c7c083c0a
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a0c9bd3c7c083c0a
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 8d0ac1a459485813
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 97b05e4abbbbdbb9
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS d867b53be264f8a2
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 6b72d81d9f0a272d
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 7033f4e609655544
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 67de872402bee749
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS ecca14f85082ffc0
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e01b51ba8895add9
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e01b51ba8895add9
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK e26a53a489e0a6fb
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 6ef4ea62397e7e7b
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 6c60ee3b5a46ae8f
";
