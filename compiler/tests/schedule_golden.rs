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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 70fd753f15184349
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 40172a9af11f315a
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 9fa422a40cae4741
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 92f54475c0738bf8
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 405313665a136c18
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC df7f8723294d4df4
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK c057a3583d001a36
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 675ff3c7890ab927
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 75660f7ce4a96e0d
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK d452b07f34b2a0b3
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 9b26ff236f88389a
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC e8abdc5d8738d2ea
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 2397a76aeab4fef3
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4fb865132056b8b8
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC d10b9b1597024ad0
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK e0ad0fc7568e2ec7
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 660cddc434fa2e5e
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS d7fa6988261ffb40
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 9a5f888d381009f9
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK fd14c78b31d6a5e0
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC e710caf5e9c03342
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS ba2956d54ccb6017
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 52292f8542672e0e
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 52292f8542672e0e
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 86150ea190d8bfe9
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 871d51ddffe4b49c
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 6f781e7392606c57
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK d3077ccd0eeb8183
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 069dfd17fc0355d5
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 073f28b1c4ab393f
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS da84ab55e3590647
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 188ee8b99c881e2d
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 188ee8b99c881e2d
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 26347ec3f6ea45b0
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK d3d1548d5c783dfe
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS fad68fbb73685b26
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 5b28d1e95464b97b
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 77c223fcdf8b0408
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 16d8e60fcaeafcb6
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS bd17e37a8b04dcec
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 08681f9551413faf
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 08681f9551413faf
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK b0f00f8897b4368e
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 2a40a0f86bc41527
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 1e762068f6a324d7
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 01e98eb7ae6067dd
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 03bc64b67ce62699
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 065bcc189b0d8d0f
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 20820fe46b377dcc
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5939c60027dc6278
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5939c60027dc6278
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK bf77af70df6638eb
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 5b7d1ada84d1af58
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 485dee7d43c8492e
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 3b27f2fd64740698
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK a079fb534b843326
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 2e0a48b0db53f39b
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS aa77c72f0b8fdb4b
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6ceeb4a4d4812086
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 9419f397b519d0aa
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 0cc2c87f18e06e6b
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 3d4fe613f0260f48
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS b24740579083c8bf
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 00d5acd146ec3300
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK f028019e68da1797
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC 7afba3eecf2ae628
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 28258507ed81b2d2
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a34ff6fd07ede99d
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 096b5d57e8fd9410
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 2e7a3b4bb1ccd62f
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 75a0fd926c875acd
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS f562f95944e26c83
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 9c331bb038d3066a
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK a1efcabbb95f0b73
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC c0931dd1e5d89983
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 46a5883b7fd107c8
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 3944e72899aa19ba
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 2a094ae70cad790f
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 7fca22cd5d612d38
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 221aca9d4bea2db4
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=SS f4bd81e4faaf326b
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=KK 23bc97d990e0a56f
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK a4023fa742722134
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC b5738ef1eb557dad
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 00b4f1dbf403f49e
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC dda2145fcea92b63
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC a56e26611c32bec0
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=KK 6be398f6c38f30bb
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 9dce6bb3ba78b260
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=SS 66e82392a057e002
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=KK 4802b518bf87b239
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 3a5ac7426a69c023
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=CC b34cef4a6ed20154
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SS 1e4a2405202c4f1b
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC ac639d3d28c5645a
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC ac639d3d28c5645a
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=KK 1eb67e2133d7c7ab
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 656b2235a6ca0206
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=SS a3bdbeb3d6150a71
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=KK e4d7743ce3c9e48e
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=KK 40386743afec6d64
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=CC c6fa726687523200
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SS c3e7231ee979a456
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38601f7701d20fb1
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38601f7701d20fb1
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=KK bd44e302a59d14aa
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 201ba480bf2eda19
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=SS 263fbd558009fccb
";
