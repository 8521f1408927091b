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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 8112a28a49734056
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 b87b26620d4be690
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 871b683d628fef84
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 16c2d11bab7f00e4
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7d045e27c064d5c1
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC e989c770dcdb0f5c
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 83f786f6deba5205
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 2448c56ad2ecd23c
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 d126ca90c374e1ed
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 7c0e880c8f30724a
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 9af38a934f8f366b
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9ef0b292b557786e
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 4e5564a6ba36d8ff
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5961eb870d645dda
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 5d1afd6cfe0af1bd
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 34d2a3e7685bd12d
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 0d1c8dc598290fef
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 b19c60814b491ac3
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 53ed073c359c9dd3
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 59f3863ec1681ecd
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ae3e85e7db6dcc56
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 9199a0105be30579
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b784dbdb70ea817f
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b784dbdb70ea817f
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 8b3c396856017ab1
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 189e98f098965427
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 3f010aafd982a1c0
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 5f647dcc995fadb5
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 5a080b70f3c86709
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 61b7473ae32150a4
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 845299804f57a28f
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38f84eb3a47d26fd
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38f84eb3a47d26fd
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 762c82663e86e9aa
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 865459a7fa0c1359
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 d1d0f226fe95845b
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 8eed30a7b2f0661b
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 fa3319d944ade79d
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f68966d432a7f799
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 9280a61160a0fb63
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 320dc6de144ed480
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 320dc6de144ed480
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 c3493ef32ab85083
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 9a4f64c51892da80
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 cdd3258446279887
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 285b7c42c333751d
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 3d2357fb85a5d68f
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 38a9790a6c8615c4
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 3f5da3a2a06ec498
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 75d6101d36b40c60
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 75d6101d36b40c60
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 6cb228ecdf8d9ac5
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 6337cfbdde1a91bb
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 2301407226e33d6a
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 bef416630ce5c521
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 df4a4329e329703d
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d5f2da3eedef6e15
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 e6b0ca54d4a60a9c
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8941fe7418c3b2f8
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC bf8006896bad2fa5
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 fb221ddfe478fe36
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK b7aecaebd4d18b9e
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 9dd198e0de014cb8
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 440d03d0d74ddb5b
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 b2696e54300be540
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ae72fc51963c9dc0
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 afeeaa05391b4a4f
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2736d376b10a76a4
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC e95576bc0f7577ba
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 83f89b64cc24aea1
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 67707c95c11582a9
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 8140390d276a9fa1
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 2ad9105162f3fae8
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 7b5ad689ccaaca82
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 5d8ffe68a932ae61
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 26823fd775bec8e6
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 1f7645993f9bfb26
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC c6ae414bc8353afc
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 cd4d1dcf97621294
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 095cf16139ba4fd2
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 4cbc7f3ae5259d47
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 dd8a6f26cb655cca
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 e74d7d824b45b866
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0caaad7d5ca42664
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 011a87b9c012a1e7
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC e388ec8486bda7dd
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 590d436397458716
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 b2b1aebc5f2910e2
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 10626d36116af42c
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 48dc7e41897690dd
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 56908b82a98de861
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 823c71d4bd4d009b
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7abcb9391dc26a69
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 7446bf5981bd3464
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 592627afd91c506c
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 592627afd91c506c
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 7ae538c940e3596e
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK fb6cc29db7f9d0e4
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 6fead6d9b5816eae
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 db957d8d6355dfd2
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 ca0dcbb6f5addec5
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b431ccf26e4797f8
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 cf01ecffb81a6128
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 35f8ee6c870a36d2
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 35f8ee6c870a36d2
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 0732dff6619b178e
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 9f171631b562293c
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 0af7adeb45f4c1fc
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
gpt2-tiny f32 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0c582b100372230f
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 29775258574c3ee4
gpt2-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 033c2837747865cc
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 c9a39abe3724cfba
gpt2-tiny f32 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 a0e89ef695f314a7
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8e41b16e31a15763
gpt2-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 45f5d9a8f7a58e0a
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 592c0face9b821d4
gpt2-tiny f32 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 dedaf149484657b5
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 808cceab993b0128
gpt2-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC bc603a1db73beb2d
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 554adf7f98852a2f
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 81a83212870d793e
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 5c60c066650a3441
gpt2-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 003807a2eaee5c53
gpt2-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 009a406a309991cf
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dddcd9f8f54c3835
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 1483f8e1b86af8db
gpt2-tiny f32 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9a391ba54c3e10c1
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 96ab65a718c359a6
gpt2-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC fe75093060ef997a
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 df8c6a5c9a360945
gpt2-tiny f32 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 80046bf4b370a0b1
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d41f6e1a356d2fd2
gpt2-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4ee56d6b1f5e16c8
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 2753a1df596acf12
gpt2-tiny f32 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 fae3156ee762c262
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 10fbf88060fd7be2
gpt2-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8d853d94140e8de7
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 96d13f3673abbaca
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d1d638938ee99b4b
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b125320359b101a2
gpt2-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC b5d75ded5c240f0e
gpt2-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC b1924df94bddfaf1
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 508c2f5c2ddb283c
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 46e23c9173953421
llama-tiny f32 noclip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f542038fce5493d7
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 8f73c0a568af4078
llama-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC b09599384b4cbd8b
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b5d6bb02c89f7665
llama-tiny f32 noclip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 c4aab9fa3f2ee38d
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 1f87f22bbd5f72bb
llama-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 09ae1bac4c41e271
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 77b06d63a73b73fb
llama-tiny f32 noclip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f4ff4ec5d2d07669
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 06a186aef8cfddf9
llama-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC feeb25dcbec94fa6
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 7552b64e9328ccbd
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 123aadee5f58a978
llama-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 123aadee5f58a978
llama-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.5 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC b784dbdb70ea817f
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4fbd0df1d978f0a5
llama-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 4fbd0df1d978f0a5
llama-tiny f32 clip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 7e724940bbfce0a6
llama-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 099a41bf41d3ef3a
llama-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0d7530e29a23118a
llama-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8bf063539477833b
llama-tiny f32 clip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 2d397bcf5eb663a5
llama-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b9dc12acc0cb8c93
llama-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC a3bec7836555c491
llama-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5b44a14f418dd9e7
llama-tiny f32 clip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 ea70c7a533d68046
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 eb5aa9adc8cd5ddd
llama-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 44716ab5956c6f45
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 44f7e24904fa3b08
llama-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 051e89cefcaf8d62
llama-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 051e89cefcaf8d62
llama-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.7 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38f84eb3a47d26fd
llama-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3ab51bf5565606f2
llama-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3ab51bf5565606f2
gpt2-tiny bf16 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 e97d875167a95930
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 54c3efd2af0ff3f8
gpt2-tiny bf16 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f166edd1f2ba0136
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a7cae713066879db
gpt2-tiny bf16 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 a5e6315bfdeab12e
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 4c7c9923733c3c71
gpt2-tiny bf16 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d397106a33321618
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 18dd7ff5e848ce18
gpt2-tiny bf16 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 926d7cb6ab269582
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 64b4ff24f0f59cc1
gpt2-tiny bf16 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC bcd191f5ab935f3d
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 6e7eb0d6343f1c6f
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f638b8d61215a442
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ffbc787346d5ced8
gpt2-tiny bf16 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 5f2472d33155fb1f
gpt2-tiny bf16 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC c450a6aa24f77bec
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 b3e4170fb7cbd20f
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 84cc7c48609d1048
gpt2-tiny bf16 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 d29be18c173041f4
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9c04c9a2eb90f590
gpt2-tiny bf16 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC eacb3f0d76c497ab
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 9b69b70419149115
gpt2-tiny bf16 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 bf2bd27e13934374
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 cdad80fa7245c51c
gpt2-tiny bf16 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC cb0a3f971b12798a
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d0bd1e07e99b8cc3
gpt2-tiny bf16 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 4939c4e658be6f3b
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 cba49f0a4f79ebd4
gpt2-tiny bf16 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 68d96f82d35df519
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 224be45c1101bd4d
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 bc00f5dab7c80b92
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 1934aac421e2077f
gpt2-tiny bf16 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 3383b44e3a0e8530
gpt2-tiny bf16 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC fc3a93c3cfd23669
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dd04114f92b1f232
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 c5d02046db546cf4
";
