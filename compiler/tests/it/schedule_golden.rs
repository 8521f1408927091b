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
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 b3a424cc696be905
gpt2-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 f01135016d0abdf2
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 078dc7d058084070
gpt2-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 8e5c880061d92004
gpt2-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8665956fbd133683
gpt2-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 7e590a656cb87049
gpt2-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 cac7625ea6bfdbc7
gpt2-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 040d9ad87730e2cc
gpt2-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 220c4227d357c46a
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 a430a81e45a0e40f
gpt2-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 0d2f4a1eb0f610ea
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 6d291aec5f1ffa80
gpt2-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 4488cacd81882c93
gpt2-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7df8cf2ba882df04
gpt2-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC d5421a6a056d05d0
gpt2-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 c8d72bed66795e5b
gpt2-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 7f32d13649219d77
gpt2-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 ea3002302841d007
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 bd34c7dedec8898f
llama-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 a48f6917c2411657
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 5284be713526dc27
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 9a6f24d28a0f68e5
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fd926852bd347997
llama-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC fd926852bd347997
llama-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 87765e8c6b837b6c
llama-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK caa9d2e5e579e464
llama-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 1c30520cf37b8e9d
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 ca44856d5e49af18
llama-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 7501f129c8db7a26
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 09e9a92597d5efcc
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 6d24e047958790fa
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2645a758e8b8aed7
llama-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2645a758e8b8aed7
llama-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 c45fe48694a5a73a
llama-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK cf0f4073cd3c7805
llama-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 b4550e21cdbb4602
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 533079387602a087
mistral-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 a36893cb37313136
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 69f1da9c620f816a
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 8df29c49d9aa507e
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC d3abf0fdefb0d61d
mistral-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC d3abf0fdefb0d61d
mistral-tiny f32 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 c08d81f43263aa58
mistral-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 51a4ca7186b7ecbc
mistral-tiny f32 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 19ccdc4257638970
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 43816c7923de951e
mistral-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 d5298e7d2fd09efb
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 244cd9b18ba94b87
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 d1b85c3688f02c7e
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c4e44ffbd4c22bc2
mistral-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c4e44ffbd4c22bc2
mistral-tiny f32 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 1416b280eebec253
mistral-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 04bf666e5242d8c1
mistral-tiny f32 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 4142bc460d72f743
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 25d34282c3cdb531
opt-tiny f32 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 46e756926b3273c3
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 bb46b435aaa12b81
opt-tiny f32 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 6d58a5314992c4f8
opt-tiny f32 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 6f7ca1a65f6c73f1
opt-tiny f32 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 3aa142a4c87f2d9f
opt-tiny f32 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 948be908d39d1388
opt-tiny f32 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK f00aade56a6eadf3
opt-tiny f32 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 61e837b5b1258aee
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 7069ad2ccd945607
opt-tiny f32 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 b4a64f5143b52b62
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7c9fb26f68812c68
opt-tiny f32 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 bb105f3b188b6169
opt-tiny f32 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 926aadba8e849b1b
opt-tiny f32 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 350385c059671a2b
opt-tiny f32 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 9fec6af2ec048271
opt-tiny f32 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 14901aee60a9aa97
opt-tiny f32 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 4b8b1f306a275d0d
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 e36366ed273694d7
gpt2-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 30a348a02acd47b4
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7c7be0a803d58000
gpt2-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 efe3b45f9ac5d580
gpt2-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC 7156a915c163fba1
gpt2-tiny bf16 noclip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 7ec0adcece035d9f
gpt2-tiny bf16 noclip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 b00d54cd930516f2
gpt2-tiny bf16 noclip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 464260c52dfa38e1
gpt2-tiny bf16 noclip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 cbeb6a55ebd3d517
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9d6d319bd214fb3d
gpt2-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 42acc70e79f64881
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ef70db56242fa14b
gpt2-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 a1436a793bed1f63
gpt2-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC c110086da597c2dc
gpt2-tiny bf16 clip n_persist=2 n_buffer=2 prefetch=1 blocks=SC 0e91c906e8c87532
gpt2-tiny bf16 clip n_persist=3 n_buffer=1 prefetch=1 blocks=K2 d11b57a0a348fa6d
gpt2-tiny bf16 clip n_persist=0 n_buffer=3 prefetch=1 blocks=SK 7e5767673bd2ec82
gpt2-tiny bf16 clip n_persist=4 n_buffer=0 prefetch=1 blocks=S2 7deea6e5d981294c
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f15014362e842c39
llama-tiny bf16 noclip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 80b1e2df959714a9
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 fc80fb38349c164d
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 6c566327d9a32b7e
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC df81c7d922ec13d0
llama-tiny bf16 noclip n_persist=1 n_buffer=2 prefetch=1 blocks=SC df81c7d922ec13d0
llama-tiny bf16 noclip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 1755e0fd2dd90be8
llama-tiny bf16 noclip n_persist=0 n_buffer=2 prefetch=1 blocks=SK 3636fc8b0732c184
llama-tiny bf16 noclip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 8b291209df71c528
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=K2 1f03d1fd24eb465f
llama-tiny bf16 clip n_persist=0 n_buffer=1 prefetch=1 blocks=K2 359afec39f4b862e
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0f8b8bad39bd9dd5
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=S2 58865ca4cdc3f3da
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b2a73cb2d6d04890
llama-tiny bf16 clip n_persist=1 n_buffer=2 prefetch=1 blocks=SC b2a73cb2d6d04890
llama-tiny bf16 clip n_persist=1 n_buffer=1 prefetch=1 blocks=K2 8861bb91cb94f9ee
llama-tiny bf16 clip n_persist=0 n_buffer=2 prefetch=1 blocks=SK abca408464cd8508
llama-tiny bf16 clip n_persist=2 n_buffer=0 prefetch=1 blocks=S2 8e1aaa50cad35768
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
gpt2-tiny f32 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 9c6d4b20113ecfa7
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 03f22c25f18112dd
gpt2-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f29f8b91f4ec41b5
gpt2-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 1d774a76a4df0d57
gpt2-tiny f32 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 27a1b58f9164f30d
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 d1289ddb7652daff
gpt2-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8c8f86f0b9c98315
gpt2-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 5f7c587ee430d3ac
gpt2-tiny f32 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 c8796907f006ec58
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 7c50eda2bd3a32d6
gpt2-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 89ff3530082f1bb9
gpt2-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ce36334933d8aacc
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b55f4cc7eb7948cc
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 dd5ee7c84ec16da1
gpt2-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 819da8d0e235c984
gpt2-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC ccfbac8681558483
gpt2-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 dafab0dc9c602d3b
gpt2-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 6b42f50a7d1019af
gpt2-tiny f32 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 8c143b9591da86de
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 851aeef8e6b62084
gpt2-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 54dfc65bf0d7636c
gpt2-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 8e9856a4d805bb87
gpt2-tiny f32 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 cdcdea24215e01eb
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 eff3f28d9646fb93
gpt2-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d62ff8e466d2435e
gpt2-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 6e943592fbcbb19e
gpt2-tiny f32 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0654e077516028fd
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0ea78a653def9af4
gpt2-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 9a0a6bb25f9ba5ad
gpt2-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 2af872657a84f7b9
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0ac4ac30160718d1
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ed27f2c942d8f807
gpt2-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8d6edf41d2ff2462
gpt2-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 54810498d51aa0de
gpt2-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a7c49e8851c70a34
gpt2-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0c88f814de659865
llama-tiny f32 noclip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 af29178ab7d17504
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 495057eff298af8b
llama-tiny f32 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 68ac973067214591
llama-tiny f32 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 819c3f5f3415e3d5
llama-tiny f32 noclip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 caf281a99dba7884
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 bd15f7cd4bd713f0
llama-tiny f32 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 0d37a6aee9b93b28
llama-tiny f32 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 a32490fab9fbf088
llama-tiny f32 noclip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 45689c3049906d58
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 74ff481c8b0f2a7a
llama-tiny f32 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC f3e8d087b77549f1
llama-tiny f32 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 f60c19ebad564e69
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 5b7be6ea04c42fbc
llama-tiny f32 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 5b7be6ea04c42fbc
llama-tiny f32 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.5 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC fd926852bd347997
llama-tiny f32 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0f079675542df0f4
llama-tiny f32 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0f079675542df0f4
llama-tiny f32 clip accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 6cffd29a20112687
llama-tiny f32 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 303c55375539abba
llama-tiny f32 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 1542e36c0c1a35e2
llama-tiny f32 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 3ea3d983db9d1f7d
llama-tiny f32 clip dp2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 c5a6aa5ce8edc7ea
llama-tiny f32 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 f87bb2d4d4ae4e81
llama-tiny f32 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 696be9a6a9c159c7
llama-tiny f32 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 00bcbe90133a4d9a
llama-tiny f32 clip dp2accum2 n_persist=2 n_buffer=0 prefetch=1 blocks=K2 f9824c55920c0ca1
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 b88f710caed068bb
llama-tiny f32 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 38f5ceeca25a05e5
llama-tiny f32 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 7061629aad1f2141
llama-tiny f32 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 10873b6be92b1fcf
llama-tiny f32 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 10873b6be92b1fcf
llama-tiny f32 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC refused: the host region needs 1.3 MiB with the optimizer state, parameters and gradients of all 1 offloaded chunks on disk (the disk tier was considered: its staging buffers, the gradient accumulators, swapped activations and everything else stay in host memory), over the 930.7 KiB of host memory (hardware.host_memory_bytes); give more hardware.host_memory_bytes or a leaner policy (more persistent chunks take their state to the device)
llama-tiny f32 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 2645a758e8b8aed7
llama-tiny f32 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 fab7695ac0037d77
llama-tiny f32 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 fab7695ac0037d77
gpt2-tiny bf16 noclip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 a16613ca78a018c0
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 717b09a758d2993b
gpt2-tiny bf16 noclip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d26bad41f1f4586c
gpt2-tiny bf16 noclip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d474f1d9dbca9f67
gpt2-tiny bf16 noclip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 46a62680c26c4927
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 6a3267b80577b3f7
gpt2-tiny bf16 noclip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 43bd9acf7f40d5b4
gpt2-tiny bf16 noclip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 e11c9aea62ef3987
gpt2-tiny bf16 noclip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 780af53257b4bf34
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 6f36a94e1a4935ac
gpt2-tiny bf16 noclip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC d20a9d10e8044c55
gpt2-tiny bf16 noclip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 279c8d4ad4b08eec
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 c929973838fed5d0
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 9ae31ace2b10c8ae
gpt2-tiny bf16 noclip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC e534434192e0d2a9
gpt2-tiny bf16 noclip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 08fa417fac2335f3
gpt2-tiny bf16 noclip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 ccee66141798a369
gpt2-tiny bf16 noclip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 9e1a5d80ca025f30
gpt2-tiny bf16 clip accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 f6311f02ea89160e
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 604a8a155cf35c8d
gpt2-tiny bf16 clip accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC eb655fc1ca352142
gpt2-tiny bf16 clip accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 e15fd8b63291537a
gpt2-tiny bf16 clip dp2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 724ed980a043df98
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 ce223d21dd9e5b7c
gpt2-tiny bf16 clip dp2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC b6fab194cf1dcb75
gpt2-tiny bf16 clip dp2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 1a8ee8e49ed8af7e
gpt2-tiny bf16 clip dp2accum2 n_persist=4 n_buffer=0 prefetch=1 blocks=K2 0c1d298caf4d48e7
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 512fe2b5623233ea
gpt2-tiny bf16 clip dp2accum2 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 750d1cad5be9f208
gpt2-tiny bf16 clip dp2accum2 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 0418cdbae032eeb9
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=2 prefetch=1 blocks=C2 308627dacb0e5ddd
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=2 prefetch=1 blocks=C2 0b68e31bbe9a92ba
gpt2-tiny bf16 clip disk1 n_persist=1 n_buffer=2 prefetch=1 blocks=SC 4407e8cace115aaa
gpt2-tiny bf16 clip diskall n_persist=1 n_buffer=2 prefetch=1 blocks=SC 8d13fdc81d0a467d
gpt2-tiny bf16 clip disk1 n_persist=0 n_buffer=1 prefetch=1 blocks=S2 1f0b639b5675d802
gpt2-tiny bf16 clip diskall n_persist=0 n_buffer=1 prefetch=1 blocks=S2 d446c8ee7a566c77
";
