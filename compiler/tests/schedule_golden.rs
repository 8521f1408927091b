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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK ec3c6d77f7e7620c
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 3d1bc35c7a4e39b2
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 7f4c1d04e973dd5b
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS e832b3c9ba3234c0
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 944be3a177e84d75
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 68e8427778f79eb2
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK ae4a951741a3ee46
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 91f78df8aac34ff4
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 1dab3a909563e84c
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 9ca0f85096e28181
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK d1798d3dc4929ca7
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC c8b56411c65dcb95
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS af7af076369bb7c6
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0f70e01cc16084eb
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC ca894f751f3070d0
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 185798b0ffbf78ff
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 60cf23b70ec55daa
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS daa1113bb56b0630
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK b0c22ca0df9a7aa3
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 42109d47e948df8f
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC af365d96a26e499b
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS e516c4feed9891a7
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 74f43d1beaa66125
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 74f43d1beaa66125
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 3dafb6725a6a09ae
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 734826e46263e39b
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 0864db576224a2f5
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK e65e777f011793f9
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 7f57120372b26f82
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 702ebc34a55e5183
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS c9a55d4984695b67
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fbaf519aea33de71
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fbaf519aea33de71
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 0258c54be99bc040
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 2da77b737b12d321
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS a193e6830133a9cc
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 0e6c27826010881b
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK c8736b56e9e35a2e
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 9e640cb840523d26
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS aa6d3baa662b91c3
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8f3095ef1964437f
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8f3095ef1964437f
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 7feeda86bf2eaa50
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK c66a8d3e4099fc49
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 4068d9dc87012e74
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 503e02e5aa155eda
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 14cabc60f9833b5a
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC f11fdec5d3ee4660
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS d634d5651975c9f2
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC cb190e6fdd01c5ea
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC cb190e6fdd01c5ea
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 94f4aa7ade98bd67
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK e17865b71d63331e
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS aad2a830da4199c2
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 94f1162bb800da62
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 97d03740af412607
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 26ce6b77d86ed520
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS aaf8c0f58f1667c2
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 72f43b79386cee4a
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC cc41e3a31c970818
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 93723a837c2d87f8
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 7897269cf00d2fb6
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 4c8d9e8b6eb71b8c
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK e0d447da9faa98fa
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 7611ca8aaa8e482c
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC d3b61651656f4055
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 6c790fcfe7506a37
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4ff6937df4513480
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 87a4688b7d1298cd
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 7da5dbc76668ee18
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 48cc383a8881a631
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS dedb0084da47cab8
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 2b871e7c5ccad619
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 28debcf2ccde34a0
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 2b4ee9d877cbf176
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 3a1b373a84f63827
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a81ae6d2c5209592
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 453c9d095da9a0f4
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 4a44ed28e1082238
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 71e8af72a344a4bd
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS f3a26de92fdb9fca
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 05a294edc644b2e2
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 1e8ec3584e22b879
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 35d2b6961dd00d9e
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 348db38f89e80a0f
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC bc96c8d55f716371
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 58d1d423f4fcfca7
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 13762e96e3bbe33b
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 68ecd1f3f68c2230
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 8ec473de924819d1
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK f587c15e79b771ae
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 85f0f1d5cb5ee176
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC f04c44c957e96823
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS a6a605721eb5b0a4
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b0882a3f14b2aa84
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b0882a3f14b2aa84
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 02f3d217b3da9164
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 18926c17543d0f9a
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 424a2e739e9bce45
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 5aab5e030a03e301
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 6c1852b5119a30ff
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 4a279f87ee0ab7ff
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 940468d27fa2299b
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 453802f28f6debed
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 453802f28f6debed
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK c38ad5b8d86e6a4f
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 6f65cb6bf34c29ab
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 29e8bfa6c0d66637
";
