//! The schedules the pipeline compiles, pinned byte for byte: a digest of every schedule file
//! over the tiny models, both element types, with and without clipping, under policies that
//! exercise every kind of movement (streamed chunks through one to three buffers, swapped and
//! recomputed blocks, the host optimizer).
//!
//! Moving a decision from one pass to another must not change a schedule: a restructuring that
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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 fc598056c57314e7
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 f92622a265c6c6fe
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 becc49f33fa0daed
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 ed483e90aa23ff92
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 584784cce6c518c3
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 2f3097a19e413fb6
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 d797a08692dd8c77
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 30806a5d1e3a046e
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 f8ca4e1b6b12d149
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 8588bc61f4a7d902
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 42cd225de5ead80f
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ee29a4fe6a4685ef
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 b49152174b290b89
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC d5598e58daa0c745
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC dd9ee63b7327d671
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 f2fc47a2c7214808
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 3ef92da08629b7f6
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 e79300947ed1babb
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 0678c7c8c73466c3
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 2b55c421c714250d
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 414379548e8ad0cf
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 4f96df8dff9ed20b
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC de1b01688bb3d0ee
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC de1b01688bb3d0ee
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 78cf8f5c08eb1394
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK e3fe502d4876a3aa
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 942a692d0b09513c
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 2cdd70b4a3b24e77
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 0c43b908b82aca3c
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 dee86cca2dc84137
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 f68c5b9e0ee7862e
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0318077ca9250306
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0318077ca9250306
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 6f03621612f25932
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 25980d9327fc660e
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 c559a5450679ec07
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 d2311c5d62efde9c
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 c6dfb3053127db14
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a116a79405ed2d3a
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7252dc253ded17a3
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0f70115aa21c9450
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0f70115aa21c9450
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 c36883ae3f22be31
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 5d24e84179492a3b
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 b0ff06ec24f0ab6d
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 8bb634365f22d0b6
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 ec02f9b234eb7fde
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 70cdbf617b58b175
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 28e35be13e016b96
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 70518572161b3437
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 70518572161b3437
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 729f35c781758128
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 9e399acd4b3ad997
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 a244b727d556882f
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 c18fac730b64c34c
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 3a00322ed3add389
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b07df7560fdf6512
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 4506b7ece98519ec
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 28c12f508ac05c17
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 57ac413204165321
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 14db29aba94a9cb2
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK cd0d166230642d0b
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 b098a0dab5f55361
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 3c030c539ab9ec02
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 4d057b2fd12071da
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 89d22fd4206a2b59
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 605bcc5930dabf87
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0bc31accb136f9c2
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 5eb89aed0aae47e4
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 e03be4a54735138e
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 0a83e5f09347991d
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 154e425719752a42
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 d95f05107c336ae4
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 11d1f5229cdb1e62
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8367ddcf1f96b898
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 76d2444d1d6613a0
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 9238f343f453b9b9
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 3c4fa547dc184959
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 886d7f8719f07c97
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 0390859ab09ed8df
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 36033dc3df4a2b22
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 deec6b4956209b21
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 0e901ab3db23fdff
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 1afcc16b51e8a3e4
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 758f8f957b17db6b
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 405f9c9b11aab620
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 4e4ddb942b7c3053
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 8592bfcc1ca00f9c
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 16b9dfc6943165f9
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 bed52a52b24a9c09
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 0674e4a5f76462ba
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 4cc195c74d7d8291
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 06ccf4af36f73c6b
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 41b5594bb8660e3d
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 954e7219f9667672
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 954e7219f9667672
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 25a1dfe105b8c445
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 6d30c5c9798f4150
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 387ed8e3e6365be8
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 7b9918d89fceda88
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 c1d95e390f098000
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 3308b63b9a067b1e
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 f52e10e387599b66
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC bbcde883b69ab240
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC bbcde883b69ab240
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 5e067342eacf6c29
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 681f5a44bac2cfe5
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 4faf1c8d89d93a3e
";

/// The passes that rewrite an emitted schedule, pinned the same way: gradient accumulation
/// (`K = 2`), two data-parallel ranks (sharded offloaded chunks) with and without
/// accumulation, and the disk tier (the state of one chunk, and of every chunk it can take,
/// on disk), over the tiny GPT-2 and LLaMA, with and without clipping. These passes add
/// buffers after emission, which the planner places ([`protrain_compiler::plan`]): a change
/// in where it places them changes a digest.
fn rewritten_digests() -> Vec<String> {
    use protrain_compiler::accumulate::scale_loss_gradient;
    use protrain_compiler::comm::Topology;
    use protrain_compiler::pipeline::compile_policy_on;
    let mut lines = Vec::new();
    let digest = |mut s: protrain_ir::Schedule| {
        s.header.prediction.step_seconds = 0.0;
        s.header.prediction.stream_busy_seconds.fill(0.0);
        format!("{:016x}", fnv1a(&file::encode(&s)))
    };
    for (model, dtype) in [
        ("gpt2-tiny", DType::F32),
        ("llama-tiny", DType::F32),
        ("gpt2-tiny", DType::BF16),
    ] {
        let config = protrain_models::load(model).expect("preset");
        let options = protrain_models::BuildOptions::new(2, 16).with_dtype(dtype);
        let forward = protrain_models::build_forward(&config, &options).expect("builds");
        for clip in [None, Some(1.0)] {
            let optimizer = OptimizerConfig {
                grad_clip: clip,
                ..Default::default()
            };
            let clip = clip.map_or("noclip", |_| "clip");
            let training = training_graph(&forward, &optimizer).expect("autodiff");
            let chunks = chunked(&training);
            let n = chunks.len() as u32;
            let policies = [
                Policy::resident(n, 2),
                Policy::protrain(0, 2, 0, 2, 2),
                Policy::protrain(1, 2, 1, 1, 2),
                Policy::protrain(0, 1, 2, 0, 2),
            ];
            // (what, ranks, micro-batches per rank)
            for (what, ranks, k) in [("accum2", 1u32, 2u64), ("dp2", 2, 1), ("dp2accum2", 2, 2)] {
                let mut scaled = training.clone();
                scale_loss_gradient(&mut scaled, k * u64::from(ranks)).expect("scales");
                let topology = Topology {
                    gpus: ranks,
                    nodes: 1,
                };
                for policy in &policies {
                    let s = compile_policy_on(&scaled, &chunks, policy, header(), topology)
                        .unwrap_or_else(|e| panic!("{model} {what} {policy}: {e}"));
                    lines.push(format!(
                        "{model} {dtype} {clip} {what} {policy} {}",
                        digest(s)
                    ));
                }
            }
            for policy in &policies[1..] {
                let s = compile_policy(&training, &chunks, policy, header()).expect("compiles");
                // One chunk's state on disk (a budget just under the host region), and every
                // chunk's the tier can take (the least host region it can make).
                let least = protrain_compiler::disk::least_host(&s).map_or(0, |(h, _)| h);
                for (what, host) in [("disk1", s.host_bytes - 1), ("diskall", least)] {
                    let d = protrain_compiler::disk::disk(s.clone(), host, u64::MAX / 4);
                    let d = match d {
                        Ok(d) => digest(d),
                        Err(e) => format!("refused: {e}"),
                    };
                    lines.push(format!("{model} {dtype} {clip} {what} {policy} {d}"));
                }
            }
        }
    }
    lines
}

#[test]
fn rewritten_schedules_are_byte_identical_to_the_recorded_ones() {
    let got = rewritten_digests();
    let want: Vec<&str> = REWRITTEN.lines().filter(|l| !l.trim().is_empty()).collect();
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

const REWRITTEN: &str = "
gpt2-tiny f32 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 86975efa4be42624
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 246e09070435f3f8
gpt2-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC c9cdcfed6600bafd
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 608a910155868841
gpt2-tiny f32 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9e61bf8f916bfbce
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 cc1f314454af1c15
gpt2-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 49ddb31fe2e62b89
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3197a47ed75e5c0d
gpt2-tiny f32 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0c61c8d9532e986b
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 43f166b2e9f5bf9c
gpt2-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 903b7d7f07acb59f
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5bbcb9d052daef0f
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8646d08dd8fee9d3
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4cfb3b97dacf1cd7
gpt2-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8fbff5a4ba96109b
gpt2-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 1cb34f841f306bb3
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 66c2902a6410a431
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 aed9e0fe709f8eb1
gpt2-tiny f32 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 ba0adce2c41b9de3
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ff9d25b7d910dae2
gpt2-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d1cbff7c053f1e8e
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 2bc7203fc98f4797
gpt2-tiny f32 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 537db19758cb2287
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f4767d725a325cd1
gpt2-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 28199f8f3e5d3522
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 c3f63311d33946dc
gpt2-tiny f32 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 fdaa853514bc0ea7
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 29d23398df5ecec9
gpt2-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC a85d491a78745730
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 81b7dd63aec43d21
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 2abc374986134502
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 70f38cc478ba7cf9
gpt2-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC ba5e1c2cb87cf10f
gpt2-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC c1622cd8c9970840
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 e1dfd1ab218129ca
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0ccbed3b8b7a6a73
llama-tiny f32 noclip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 8f068265f357a6ac
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 fcd935ddd6564f5e
llama-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4308f42902a05127
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3a214c33f83656e1
llama-tiny f32 noclip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f4ef1360832b04df
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 6ee6215ed60137a3
llama-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 28bcb0c11e692e0e
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4cdc1510c20d3c82
llama-tiny f32 noclip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 756f98e288999aca
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ebd4b1dc893e02b6
llama-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6950068523df9781
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 f64910e720f7353f
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0e49fa4d002b8b6b
llama-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0e49fa4d002b8b6b
llama-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 930.5 KiB with the optimizer state of all 1 offloaded chunks on disk (their staging buffers and everything else stay in host memory), over the 930.5 KiB of host memory (--host-memory); give more --host-memory or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 11a2c119932defb4
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a8c513d2184ffa76
llama-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a8c513d2184ffa76
llama-tiny f32 clip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 0135706f7b9d0101
llama-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d8d5c5f402c6f75a
llama-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6edfcc41c8f8e1e0
llama-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 efb49a8c05624cd3
llama-tiny f32 clip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 b25df54a89939c4c
llama-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7f90dd511eb4e31a
llama-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f433d673512e999b
llama-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 c89fb9f8193e511b
llama-tiny f32 clip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 ff21b6a8d7c045fa
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4f3807e21c7a16f6
llama-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC aba4ae292cedffb4
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 eb396287808cb37a
llama-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a3be5663b497ecf9
llama-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a3be5663b497ecf9
llama-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 930.8 KiB with the optimizer state of all 1 offloaded chunks on disk (their staging buffers and everything else stay in host memory), over the 930.7 KiB of host memory (--host-memory); give more --host-memory or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC e985bfc27f5ced41
llama-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b90db2cfa8330838
llama-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b90db2cfa8330838
gpt2-tiny bf16 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 8f5a70977f29c6fe
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 060f55346513eb31
gpt2-tiny bf16 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2244a9df44a28852
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ea51edb10d40297b
gpt2-tiny bf16 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 77695ca732ed97a3
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 425fcea6bbed4ac8
gpt2-tiny bf16 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC a558fa2d1138ae92
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 07dc5077df3b86ce
gpt2-tiny bf16 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 168433969b23dfe1
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 be19f451adcca1f7
gpt2-tiny bf16 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC c6d77661c158b5f4
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 67715efb88432753
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 e61640af34f7570c
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 cb0cb81cd5ee9dc8
gpt2-tiny bf16 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6cbd2471f1eda48e
gpt2-tiny bf16 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2f481decaf81cb5a
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0b4570e6f79f1fc7
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 17ac55abce4cf572
gpt2-tiny bf16 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 c28134e3e101e3c5
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ffc0bb627eb84960
gpt2-tiny bf16 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC bcbba362a209052b
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 582dd2ae21976a52
gpt2-tiny bf16 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 fbcdf1f2b04d00d1
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b3908f3f8beb77c5
gpt2-tiny bf16 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC a9635fbbc20dd938
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 03a75d8193609c08
gpt2-tiny bf16 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 09125002fc824318
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 559ade15b7aa531a
gpt2-tiny bf16 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 87ffbb055d389b58
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8c29c629a518bf80
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 82e4fa1b1525a7d1
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 835f81ba43cc245f
gpt2-tiny bf16 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC cec75305c1f6ec5b
gpt2-tiny bf16 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 857b19b96eb34459
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a76ca177e72512bd
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0d1cfbcefe5475c1
";
