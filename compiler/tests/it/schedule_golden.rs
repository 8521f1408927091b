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
    crate::common::header("golden", "golden")
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

/// Fails naming every digest of `got` that `table` does not record, and prints the whole table
/// as it now is (to paste in when a change is meant to change schedules).
fn assert_matches_table(got: &[String], table: &str) {
    let want: Vec<&str> = table.lines().filter(|l| !l.trim().is_empty()).collect();
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

#[test]
fn schedules_are_byte_identical_to_the_recorded_ones() {
    assert_matches_table(&digests(), GOLDEN);
}

const GOLDEN: &str = "
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 b6a81a64a0ea427f
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 5f4730ccea81a7b0
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4c67db12d9cab77c
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 b6f1fbcf031458ff
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b569edf03e0841df
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 3b875a289833b7f3
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 fbd9f654e377f9e5
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 36408a9d09421b53
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 e088d9e0bf726c66
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 944f9c3e1890cb0e
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 73c0fa26a0cbe533
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 39bfe948cc0a6e37
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 c36b667b04f4c959
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 51ed9039b6443bf7
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC c15ac71ad402f3ec
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 d927b1a2d9d65967
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 923c7b9c3e6ac585
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 f53131ce96ef3fad
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f0c8d69969acdf2b
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 2a896d13d977b2f6
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b52c7312565bc787
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7417c254ac9c29c4
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c6182d674cf2155e
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c6182d674cf2155e
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 9e746b52243b2946
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 56ac11fd16f4aae8
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 99d8356e44fee0a6
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 4911efdfbf245f06
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 f5c2060f0c153a33
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b625f5cf04bcb51f
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 5c8047e841f47344
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 78c78395d1adb6b2
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 78c78395d1adb6b2
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 31e03a2d116cc2d6
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK e6d5236530147f82
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 c7da9f4dac949ff7
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 e568cd1ec3b37827
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 6e10d3e83482758c
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 13e07a6f80101ca9
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 9fac3fff5e5e9e70
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8b99f8e3659cea0c
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8b99f8e3659cea0c
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 b59bf1bdbdbb3e44
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 9ef6d58c7a67e8ea
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 bc423cf98642a35c
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 c2db7e0a4d4f710c
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 8d4249a46a977bb4
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 fd721a4432074fe3
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 9890c68d300f5079
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC f33880bdaf446f86
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC f33880bdaf446f86
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 80e3bd920403fdc7
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 1afd94b8dd1b489f
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 e347d9886b0f216a
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 ab68b11131783166
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 68a1f88a00784101
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 00172defeb424433
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 c7204821b20e093f
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fc648619d5bcdeb2
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 5d287b51565a0f2c
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 a8eba1988247f900
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK af387ac208af8d14
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 794e7d99095c573e
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9625e37f0ae95d58
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 7150f26d02924f83
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c0ac52d77cab13ad
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 1f8ad7b7df64b38c
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC abd7a6c22085ecc2
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 3b1a229861a20021
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 c7a60f8ed0fc28d4
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 5785489601194d95
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 03787fed416dc649
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 f719ca82e75eb80b
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 aa8de8b81edad7be
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0f7f7f46dcb80196
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 53251270f0db89a5
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 9c6435dc727c76c0
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 8fafa306c3fa5bfe
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 9652d86ea7f98a10
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK eb4589fcb143b663
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 f5788484538cea6f
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 59bfac61e649c436
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 01ad4f4106160383
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 726953d71a06fa4d
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 52ee3890c45819b7
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC bf583160001d4bf5
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 583d64e99515f2f8
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 f5158af283b134db
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK b92022b35a27b8d6
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 3c07952e75c3f880
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 36648e69e36d202e
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 52dd06f2825281d1
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9b25dfffe13bf24b
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 4df9906bc055cb2c
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 25cbbe5860222851
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 25cbbe5860222851
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 d3a33332e699c719
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 22c6174955cb9385
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 9300824afc85f469
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 eaee3c86386b7ee9
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 6b68c9307d970cd3
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d92c8c7c30c5af74
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 faa627d4e015d478
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a742137145dccd65
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC a742137145dccd65
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 495909413d8b8dc4
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 8c9bc737c88009c7
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 fd098027e7d8c229
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
    assert_matches_table(&rewritten_digests(), REWRITTEN);
}

const REWRITTEN: &str = "
gpt2-tiny f32 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 ae9134c0953e0306
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 70319c1184ff2464
gpt2-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC e98fe15c0407e63f
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 7fada2e2ce343fa9
gpt2-tiny f32 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0fe7704d989b2906
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c103ab386c608284
gpt2-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC a90b9d7d8f57a2a6
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dc479935e6c9e3f8
gpt2-tiny f32 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 3ff748c0cb3e9223
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 79de46df84ec820d
gpt2-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0d51dd3e4b7ab2fc
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 993800cf8991c7ec
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 3c557718d1f144b3
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 68bb570757698234
gpt2-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f70962ce6b3df4e5
gpt2-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4420ac17d7fe681e
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 9f6bcea8e50cdab1
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 31abfad61775f56c
gpt2-tiny f32 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9dfac33dad22d5ca
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8d0fe3098c5f7f69
gpt2-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 9beac7fb1a9f35e5
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d1815f0e58516f16
gpt2-tiny f32 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9363210adf2e7512
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 916709fa562d0232
gpt2-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2e136ee5ca2fa459
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4bf84de530aaee66
gpt2-tiny f32 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9ffd2e6a00302533
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d86b7f52580b1dcf
gpt2-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 04460e3824b15687
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8f0cb196e0da24cd
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a8bbbff5b876bac5
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9b379ce454b1d7e3
gpt2-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 03f6fb5abc3a9951
gpt2-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC b8dabdb8b9ab3b78
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 e70d326ca0354fc2
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5996e7bb85574ce2
llama-tiny f32 noclip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f592e96f323ba613
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 43553f58266d7abb
llama-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 9c9a46560f05c5da
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3929f27f38b3b858
llama-tiny f32 noclip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 fecf1e7239ebff81
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 afceafa9eb56d317
llama-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC c53d9e5af8e095ab
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 549dcc4cd32753f2
llama-tiny f32 noclip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 94f41ebc46a482bf
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 859f687d69e74671
llama-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC ac5bcef07c08ab35
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b91211717b30fb52
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ddc152628ec9b577
llama-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ddc152628ec9b577
llama-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 930.5 KiB with the optimizer state of all 1 offloaded chunks on disk (their staging buffers and everything else stay in host memory), over the 930.5 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC c6182d674cf2155e
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 843f255902041855
llama-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 843f255902041855
llama-tiny f32 clip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 07c03f0132c2d0a8
llama-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4fcbabd60f6dba53
llama-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2df53c12ddc75c80
llama-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4b2dff8056a7a5e1
llama-tiny f32 clip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 66a253ae1a5366ba
llama-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4528de9bef2df0a2
llama-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC af5d4e59c83b4a64
llama-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4d7c3e13568e5668
llama-tiny f32 clip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 ad388b29c9a9ee77
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 1c0cbcb2f6d8a5d6
llama-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4f24032122f06a53
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 cf1c6ed28ac30f27
llama-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c91001b6978e5f6f
llama-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c91001b6978e5f6f
llama-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 930.8 KiB with the optimizer state of all 1 offloaded chunks on disk (their staging buffers and everything else stay in host memory), over the 930.7 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 78c78395d1adb6b2
llama-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 06d551b564c89e5a
llama-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 06d551b564c89e5a
gpt2-tiny bf16 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 de38b6e9c6acf4df
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c624a424431b109d
gpt2-tiny bf16 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 51a84569e4e3e27d
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 caee2ef93c753ee9
gpt2-tiny bf16 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 f2ef6c093459c7a7
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 19e0deef1fec03e2
gpt2-tiny bf16 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC bef34e956b00fbeb
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 20e5990a75cd84ca
gpt2-tiny bf16 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 adbd061eaafd736d
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 99bd6cdba1b1a4b0
gpt2-tiny bf16 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7f29238c70272cc7
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4206036124541d4d
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4921aaff913ff1ee
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 57ff017ef9846deb
gpt2-tiny bf16 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6e9ff242b448a96d
gpt2-tiny bf16 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC bd96c9f391c22575
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5229b8a90f466d87
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 10e0398908ab5c67
gpt2-tiny bf16 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 362fc43618bbaf4d
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0fe7c638212ad180
gpt2-tiny bf16 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 485da65291ead8bc
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 89b7d69dd57cc51e
gpt2-tiny bf16 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 153b40d52b9a6f4e
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4a0cab918d1f63c6
gpt2-tiny bf16 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f2d12d0f0dbf06e6
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8cda83ba25e0eb5b
gpt2-tiny bf16 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 525a63d274df6900
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 e54b2e63dedc9704
gpt2-tiny bf16 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC dd5f5b4399d794f8
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 84959eb5d1274237
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 e80fc859d3531505
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 309672610472a651
gpt2-tiny bf16 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6eb2d0a774fc6fd1
gpt2-tiny bf16 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC c6dc466104ff0a02
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d60950d7ea2621fa
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 2c839952e0a0e877
";
