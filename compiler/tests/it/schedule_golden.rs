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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 eb7b079e319738ef
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 fb4b552b3c5deae7
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 2e06c0316753f5eb
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7aa9b2f0f64f2c7a
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC ed149f8597cf4cb7
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC c680a254f4918fa7
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 5d9ec4af5f782116
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK bcb36a40680bf2c0
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 ffca504bab2b954c
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 329ae7c9e47bbd41
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 48dd36723b57c019
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 24154d6a2b719e6d
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 6575a1e5c6848853
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5fb0ad02df5616cb
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 573190e01feb1839
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 03e70430ec72380e
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 34e76917a49a7e83
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 2ccc9ef9f0c94a79
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 21efdef64d8b7215
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 95daada80c0f5e30
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 adfb4411a2de12c1
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 d509d56ee96ddaa3
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 379253b9a5fe223f
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 379253b9a5fe223f
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 6cda9603c1cc3dc5
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 8197367c7fd16f30
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 a5967bb289a5d632
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 2e91181acfb58927
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 fe9a8b4b35989d1f
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 593b063ac969533a
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 abe07d0444c7812f
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC eec92a7e8c775ddd
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC eec92a7e8c775ddd
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 740f859404a9357f
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 191717b25348f287
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 ff0494d6f32574b4
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 a289a05380c319e2
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 3e553239c57d2f77
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b987f16847c7557c
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7e7aa4397406ea59
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC cdde307ebd1b6d36
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC cdde307ebd1b6d36
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 b6d1dfb10f749560
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK f8f3993309fdc17a
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 4cfbac50f397b27e
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 dce5f463e5af8a7e
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 951383209c2cecc2
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c55ee4f4335b4886
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7d31e8ae756bbaeb
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e9677cd421385162
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e9677cd421385162
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 81b121cd77fdc314
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK a22c5afa90343cd6
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 4f5a9415652b8571
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 065de55244d685d8
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 bd785a4ce31076a2
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 949df0b912e9b769
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 cd72de78ab432b92
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 1cae0d0d73ede5c7
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC a1e9f9b167f03d96
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 2cd1f5210b8e0383
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK f7ec5e5516a87e55
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 0b3bcd2fc1a21069
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 5f52e95216e4b4b7
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 071452f87cd53156
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f3bdcdbf61cfd1f0
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 ae12e8ad6ec97af7
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC cd6ea5d54ec276d5
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 88fcfdd702f7e774
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 b7dcc69aedafcf0f
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 01d2c7d3697803d5
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 2ffeea1a4baaafe4
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 ccd4cc0c8fd48ccf
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 961cc01bb2b018e5
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 65dae010261591ee
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 cd3fdae21ff0893d
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5b987514daeab9c8
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 5fe51d8b27661c68
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 66bf9b4a07e8b984
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK bd9ea960872ba397
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 81d60aa59211c1bb
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 45c39e51b8c9ed76
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 b6d4202e2be537d2
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 79b085087dac6d5f
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 e8cacc0d9025f0af
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0a41cd58c26eed4f
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC a20cd6f876028741
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 186b8d22bd0ef0fd
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 8d793725c5c615e3
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 a6151814150dd5c3
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 d40e3489258d1310
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 bfd44abf6ce075fc
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ff271c3d93e79614
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 8d2f89e300b0c821
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c99f5fd7d99dfe05
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c99f5fd7d99dfe05
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 8962711d10f5fab2
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 8c06209a2d42f47e
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 14aa9e03d8e0043b
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 bca4bddd3d6b5b21
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 cc8afcd3bc9ce5fd
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 eab931b6d82b936d
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 5a9407940f8b4caa
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 34e56587a71307ca
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 34e56587a71307ca
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 269583673d04ca0e
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK b5a6de5701bc8dc9
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 86f341542919fe01
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
gpt2-tiny f32 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 5b3756f56617b174
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 eaaa26a5642097da
gpt2-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC ab833792e5393a01
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 836a3669c90e7121
gpt2-tiny f32 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 6f719e2604d3bb86
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 23702e5dd20b7646
gpt2-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 916a3378b9a16645
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 50d2d14d273df2aa
gpt2-tiny f32 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 cc99afd55d6e9ef8
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 24a23a8419a35345
gpt2-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 64aba69652699620
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ccb1a138c1b6c4e7
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ce9cf4f0d00970b0
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 3cbad1bfaf0d9f33
gpt2-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 60fd49c6630bb1ce
gpt2-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 608ff187041817ba
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8632186e3665d7db
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5cd3ce3d96d50ecd
gpt2-tiny f32 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 f0c46fcc4d742330
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a7fa46e3366577af
gpt2-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f2ff7a96e38a3bf6
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b698531408a5db5c
gpt2-tiny f32 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0448f315a2bb07b9
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 1de0aad22a9fd288
gpt2-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 18f60d64623390df
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8010cc60540eba53
gpt2-tiny f32 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 7a9c05c1a649e8d3
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ecd16673163e5d8e
gpt2-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 80a60f1a56bda630
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ebf8259d83007e52
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ef38d1de04a79d4b
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 587aa8464d34829d
gpt2-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 959d1310f710e097
gpt2-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7df097ee8099e925
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a0dbe6e15a38d790
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ef60047b705e806c
llama-tiny f32 noclip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 df1fef849ffa0f28
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 e341b2a0cd273f46
llama-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC c96a932b554d4ebf
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 1083452cd4178fcc
llama-tiny f32 noclip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f8f5c3c24fb8f5bd
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ad591be13b78aa5b
llama-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC c0dae90ddf177dfe
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d80e008de6127fed
llama-tiny f32 noclip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 a0cac37123179988
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 50666b153a7b4266
llama-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC bdbfae8e2110d47c
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 90ef540f131af5a6
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8eefb2be95ee373d
llama-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8eefb2be95ee373d
llama-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.5 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 379253b9a5fe223f
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 6a3bfb957edda3cf
llama-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 6a3bfb957edda3cf
llama-tiny f32 clip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 1539bbad0ef03eb5
llama-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 01d752db4c92a4f1
llama-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8387f75787f5e904
llama-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dda2d9e0df91afbf
llama-tiny f32 clip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 db03f58ec1c72d04
llama-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f604eaa9fbfe7242
llama-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC b000882ce3d6f865
llama-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 9e9842f871df58fe
llama-tiny f32 clip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 27b1430e52baeea0
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 62574d944bef5759
llama-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7508c0847ac5e8f7
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b4864201dc790f22
llama-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 2d0c02ab6bcdaf8e
llama-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 2d0c02ab6bcdaf8e
llama-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.7 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC eec92a7e8c775ddd
llama-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0eff5f4279b002e1
llama-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0eff5f4279b002e1
gpt2-tiny bf16 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 6ee3887599dd3e80
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ecbc1be94f007940
gpt2-tiny bf16 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 04f869a33d14aa32
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a6b0975b70da8cdf
gpt2-tiny bf16 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 8bee75f5b03fc224
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 541f0256ed14a7f1
gpt2-tiny bf16 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d3e9a80449b71df5
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8ad4d0f8794bc3e4
gpt2-tiny bf16 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 4e51f040bc8fe1b6
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 62619fda25db3488
gpt2-tiny bf16 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d23f951096d0638c
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 fdbb86a3326b40f0
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 59162ac140f6e6e8
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7a54591da7242e1c
gpt2-tiny bf16 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 11ef55f2522b0876
gpt2-tiny bf16 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8134f0377d4041fb
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dc92c73dfcbace75
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3a6e52596873879a
gpt2-tiny bf16 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 ebd77f53db0ee5e5
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 a0a7a5a901a04237
gpt2-tiny bf16 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 267e674b7fa75086
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 24128589c2371dbe
gpt2-tiny bf16 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 420f1d2279e97dae
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9fef468c7be9421f
gpt2-tiny bf16 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC cfed012da96ddd1b
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 e75d572c56326009
gpt2-tiny bf16 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 280d59eb63f5af8f
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b090bfbf63d9f177
gpt2-tiny bf16 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC cb02349fc332c517
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 11f33dc00917410e
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7d4cc1b332deee2a
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9cee909f794f1760
gpt2-tiny bf16 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 850990f09b216a57
gpt2-tiny bf16 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 59f391e5c6099c73
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ef71568ffd30a66d
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 f47dbf5d5a0e5889
";
