//! Gradient accumulation against PyTorch: five steps of the GPT-2 and LLaMA fixture models
//! with two micro-batches per step (`(loss / K).backward()` per micro-batch, then
//! `clip_grad_norm_` and `torch.optim.AdamW` once per step, under transformers' cosine and
//! linear schedules with warmup), bit-identical between a roomy and a tight policy; K
//! micro-batches of B sequences against one batch of K*B; and a resumed accumulating run
//! (fixtures made by `tests/fixtures/make_grad_accum_fixtures.py`).

use crate::common::fixture_run::{compile, settings, train, Shape};
use crate::common::{fixtures, numbers, read_json, relative};
use protrain::ir::DType;
use protrain::runtime::checkpoint;
use protrain::runtime::params::load_params;
use protrain::runtime::train::{CheckpointPlan, LrSchedule, LrScheduleKind, RunFlags, StepRecord};
use protrain::runtime::{Executor, Trainer};
use protrain::OptimizerConfig;
use serde_json::Value;
use std::num::NonZeroU64;

/// What the PyTorch runs of `expected.json` share.
struct Expected {
    optimizer: OptimizerConfig,
    batch: u64,
    grad_accum: u64,
    warmup: u64,
    decay: u64,
    steps: u64,
    runs: Vec<Value>,
}

fn expected() -> Expected {
    let v = read_json(&fixtures().join("grad_accum/expected.json"));
    let f = |k: &str| v[k].as_f64().expect(k);
    let n = |k: &str| v[k].as_u64().expect(k);
    assert_eq!(n("seq"), 16);
    Expected {
        optimizer: OptimizerConfig {
            lr: f("lr"),
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            grad_clip: Some(f("grad_clip")),
        },
        batch: n("batch"),
        grad_accum: n("grad_accum"),
        warmup: n("warmup_steps"),
        decay: n("decay_steps"),
        steps: n("steps"),
        runs: v["runs"].as_array().expect("runs").clone(),
    }
}

/// The fixture directory of the runs' tokens.
const TOKENS: &str = "grad_accum";

/// Every parameter stays on the device (gradients accumulate there) and every layer keeps
/// its activations.
const ROOMY: &str = "blocks=KK";
/// Every chunk streamed through two buffers (gradients offloaded and accumulated on the
/// host); one layer swapped, one recomputed.
const TIGHT: &str = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1";
/// One chunk on the device, the rest streamed: accumulators in both memories.
const MIXED: &str = "n_persist=1 n_buffer=2 n_checkpoint=1";

#[test]
fn accumulated_training_matches_pytorch_under_every_policy() {
    let e = expected();
    assert_eq!(e.runs.len(), 4, "gpt2 and llama, cosine and linear");
    let shape = Shape::f32(e.batch, e.grad_accum);
    for run in &e.runs {
        let model = run["model"].as_str().expect("model");
        let kind = match run["lr_schedule"].as_str().expect("schedule") {
            "cosine" => LrScheduleKind::Cosine,
            "linear" => LrScheduleKind::Linear,
            other => panic!("unknown schedule {other}"),
        };
        let what = format!("{model} {kind}");
        let schedule =
            LrSchedule::new(kind, e.optimizer.lr, e.warmup, e.decay, 0.0).expect("schedule");
        let run_with = |policy: &str| {
            train(
                model,
                &e.optimizer,
                policy,
                shape,
                settings(TOKENS, schedule, e.steps),
            )
        };
        let (roomy, roomy_weights) = run_with(ROOMY);
        assert_eq!(roomy.len() as u64, e.steps, "{what}: steps");
        let losses = numbers(&run["losses"]);
        let norms = numbers(&run["grad_norms_preclip"]);
        for (i, r) in roomy.iter().enumerate() {
            assert_eq!(
                r.batch, i as u64,
                "{what}: a step reads one batch of K*B rows"
            );
            assert_eq!(
                r.tokens,
                e.grad_accum * e.batch * 16,
                "{what}: tokens per step"
            );
            let rel = relative(f64::from(r.loss), losses[i]);
            assert!(
                rel < 1e-4,
                "{what} step {}: loss {} vs PyTorch {} (rel {rel:e})",
                r.step,
                r.loss,
                losses[i]
            );
            let norm = f64::from(r.grad_norm.expect("clipping computes the norm"));
            let rel = relative(norm, norms[i]);
            assert!(
                rel < 1e-4,
                "{what} step {}: grad norm {norm} vs PyTorch {} (rel {rel:e})",
                r.step,
                norms[i]
            );
        }
        // Device, host and mixed accumulation compute the same bits.
        for policy in [TIGHT, MIXED] {
            let (other, other_weights) = run_with(policy);
            let bits = |rs: &[StepRecord]| -> Vec<(u32, Option<u32>)> {
                rs.iter()
                    .map(|r| (r.loss.to_bits(), r.grad_norm.map(f32::to_bits)))
                    .collect()
            };
            assert_eq!(
                bits(&roomy),
                bits(&other),
                "{what}: roomy and {policy} losses"
            );
            assert!(
                roomy_weights == other_weights,
                "{what}: roomy and {policy} weights"
            );
        }
        // The comparison can fail: the same steps without accumulation (one micro-batch of
        // B rows per step) train on half the rows and leave the tolerance at once.
        let (single, _) = train(
            model,
            &e.optimizer,
            ROOMY,
            Shape::f32(e.batch, 1),
            settings(TOKENS, schedule, e.steps),
        );
        let worst = single
            .iter()
            .zip(&losses)
            .map(|(r, &want)| relative(f64::from(r.loss), want))
            .fold(0.0, f64::max);
        assert!(
            worst > 1e-3,
            "{what}: training without accumulation is within {worst:e} of PyTorch's \
             accumulated run; the comparison cannot tell them apart"
        );
    }
}

#[test]
fn micro_batches_train_as_one_batch_of_their_rows() {
    let e = expected();
    let schedule = LrSchedule::new(LrScheduleKind::Cosine, e.optimizer.lr, 1, 5, 0.0).expect("lr");
    // Qwen3-MoE's fixture has three layers.
    for (model, roomy) in [
        ("gpt2", ROOMY),
        ("llama", ROOMY),
        ("mixtral", ROOMY),
        ("qwen3_moe", "blocks=KKK"),
    ] {
        let (big, big_weights) = train(
            model,
            &e.optimizer,
            roomy,
            Shape::f32(8, 1),
            settings(TOKENS, schedule, 5),
        );
        let (accum, accum_weights) = train(
            model,
            &e.optimizer,
            TIGHT,
            Shape::f32(2, 4),
            settings(TOKENS, schedule, 5),
        );
        let mut worst = 0.0f64;
        for (a, b) in accum.iter().zip(&big) {
            assert_eq!((a.step, a.batch, a.tokens), (b.step, b.batch, b.tokens));
            worst = worst.max(relative(f64::from(a.loss), f64::from(b.loss)));
        }
        assert!(
            worst < 1e-6,
            "{model}: --batch 2 --grad-accum 4 is {worst:e} from --batch 8"
        );
        let weights = accum_weights
            .iter()
            .flatten()
            .zip(big_weights.iter().flatten())
            .map(|(&a, &b)| f64::from((a - b).abs()))
            .fold(0.0, f64::max);
        assert!(weights < 1e-5, "{model}: weights differ by {weights:e}");
        // Not trivially equal: the sums run in another order, and the run without
        // accumulation reads other rows.
        let (small, _) = train(
            model,
            &e.optimizer,
            roomy,
            Shape::f32(2, 1),
            settings(TOKENS, schedule, 5),
        );
        let apart = small
            .iter()
            .zip(&big)
            .map(|(a, b)| relative(f64::from(a.loss), f64::from(b.loss)))
            .fold(0.0, f64::max);
        assert!(
            apart > 1e-3,
            "{model}: --batch 2 alone is only {apart:e} away"
        );
    }
}

#[test]
fn the_load_balancing_loss_is_each_micro_batchs_own_and_the_same_bits_under_every_policy() {
    let e = expected();
    let schedule = LrSchedule::new(LrScheduleKind::Cosine, e.optimizer.lr, 1, 3, 0.0).expect("lr");
    for (model, roomy) in [("mixtral_aux", ROOMY), ("qwen3_moe_aux", "blocks=KKK")] {
        let (accum, accum_weights) = train(
            model,
            &e.optimizer,
            roomy,
            Shape::f32(2, 2),
            settings(TOKENS, schedule, 3),
        );
        for policy in [TIGHT, MIXED] {
            let (other, other_weights) = train(
                model,
                &e.optimizer,
                policy,
                Shape::f32(2, 2),
                settings(TOKENS, schedule, 3),
            );
            let bits =
                |rs: &[StepRecord]| -> Vec<u32> { rs.iter().map(|r| r.loss.to_bits()).collect() };
            assert_eq!(
                bits(&accum),
                bits(&other),
                "{model}: roomy and {policy} losses"
            );
            assert!(
                accum_weights == other_weights,
                "{model}: roomy and {policy} weights"
            );
        }
        // Each micro-batch's loss is its cross-entropy plus its own auxiliary loss (over its
        // own rows), and the step's the mean of them: the first step's loss is the mean of
        // the first two 2-row batches' losses at the initial weights (a run at learning rate
        // 0 reads them one per step without moving the weights).
        let frozen = LrSchedule::new(LrScheduleKind::Constant, 0.0, 0, 2, 0.0).expect("lr 0");
        let still = OptimizerConfig {
            lr: 0.0,
            ..e.optimizer.clone()
        };
        let (apart, _) = train(
            model,
            &still,
            roomy,
            Shape::f32(2, 1),
            settings(TOKENS, frozen, 2),
        );
        let mean = (f64::from(apart[0].loss) + f64::from(apart[1].loss)) / 2.0;
        let rel = relative(f64::from(accum[0].loss), mean);
        assert!(
            rel < 1e-6,
            "{model}: the accumulated loss {} is {rel:e} from the micro-batches' mean {mean}",
            accum[0].loss
        );
        // One batch of all four rows takes one auxiliary loss over them (transformers' forward
        // on that batch): another number, as the load-balancing loss is not linear in rows.
        let (whole, _) = train(
            model,
            &still,
            roomy,
            Shape::f32(4, 1),
            settings(TOKENS, frozen, 1),
        );
        let whole_rel = relative(f64::from(whole[0].loss), mean);
        eprintln!("{model}: one 4-row batch is {whole_rel:e} from the micro-batches' mean");
        assert!(whole_rel > 1e-6, "{model}: {whole_rel:e}");
    }
}

#[test]
fn an_accumulating_run_resumes_as_if_never_interrupted() {
    let e = expected();
    let shape = Shape::f32(e.batch, e.grad_accum);
    let schedule = LrSchedule::new(
        LrScheduleKind::Cosine,
        e.optimizer.lr,
        e.warmup,
        e.decay,
        0.0,
    )
    .expect("schedule");
    let (straight, straight_weights) = train(
        "gpt2",
        &e.optimizer,
        ROOMY,
        shape,
        settings(TOKENS, schedule, e.steps),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let compiled = compile("gpt2", &e.optimizer, ROOMY, shape);
        let s = &compiled.schedule;
        let weights = fixtures().join("gpt2/model.safetensors");
        let params = load_params(&s.graph, &weights).expect("weights");
        let executor = Executor::new(s).expect("an executor");
        let mut trainer = Trainer::start(
            executor,
            settings(TOKENS, schedule, e.steps),
            &params,
            "fixture",
        )
        .expect("a trainer");
        let plan = CheckpointPlan {
            dir: dir.path().to_path_buf(),
            every: NonZeroU64::new(2).expect("2 > 0"),
            keep: 0,
        };
        trainer.save_checkpoints(plan, None).expect("an empty dir");
        for _ in 0..2 {
            trainer.step(|_| {}).expect("a step").expect("steps remain");
        }
    }
    // The checkpoint records the accumulation; a schedule with another count is refused.
    let peek = checkpoint::peek_latest(dir.path()).expect("a checkpoint");
    assert_eq!(peek.optimizer.expect("optimizer settings").grad_accum, 2);
    let other = compile("gpt2", &e.optimizer, ROOMY, Shape::f32(e.batch, 3));
    let err = checkpoint::load_latest(dir.path(), &other.schedule)
        .map(|_| ())
        .expect_err("another --grad-accum");
    assert!(err.to_string().contains("grad_accum=2"), "{err}");

    let compiled = compile("gpt2", &e.optimizer, TIGHT, shape);
    let tight = &compiled.schedule;
    let (ckpt, warnings) = checkpoint::load_latest(dir.path(), tight).expect("the checkpoint");
    assert!(warnings.is_empty(), "{warnings:?}");
    let saved = ckpt.run.as_ref().expect("run settings");
    let resumed_settings = RunFlags::default()
        .resume(saved, &ckpt.path)
        .expect("nothing contradicts");
    let executor = Executor::new(tight).expect("an executor");
    let mut trainer = Trainer::resume(executor, resumed_settings, &ckpt).expect("a trainer");
    let mut resumed = Vec::new();
    trainer
        .run(|r| resumed.push(r.clone()))
        .expect("the rest trains");
    let key = |r: &StepRecord| (r.step, r.batch, r.loss.to_bits());
    assert_eq!(
        resumed.iter().map(key).collect::<Vec<_>>(),
        straight[2..].iter().map(key).collect::<Vec<_>>(),
        "steps 3..5 resumed are the uninterrupted run's, bit for bit"
    );
    assert!(trainer.executor().params().expect("weights") == straight_weights);
}

#[test]
fn bf16_accumulation_is_the_same_bits_under_every_policy() {
    let e = expected();
    let schedule =
        LrSchedule::new(LrScheduleKind::Linear, e.optimizer.lr, 1, 5, 0.0).expect("schedule");
    let run = |policy: &str| {
        let shape = Shape {
            dtype: DType::BF16,
            ..Shape::f32(e.batch, e.grad_accum)
        };
        train(
            "gpt2",
            &e.optimizer,
            policy,
            shape,
            settings(TOKENS, schedule, 5),
        )
    };
    let (roomy, roomy_weights) = run(ROOMY);
    let (f32_run, _) = train(
        "gpt2",
        &e.optimizer,
        ROOMY,
        Shape::f32(e.batch, e.grad_accum),
        settings(TOKENS, schedule, 5),
    );
    for (a, b) in roomy.iter().zip(&f32_run) {
        let rel = relative(f64::from(a.loss), f64::from(b.loss));
        assert!(
            rel < 1e-2,
            "step {}: bf16 {} vs f32 {}",
            a.step,
            a.loss,
            b.loss
        );
    }
    for policy in [TIGHT, MIXED] {
        let (other, other_weights) = run(policy);
        let bits = |rs: &[StepRecord]| rs.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&roomy), bits(&other), "bf16 roomy and {policy} losses");
        assert!(
            roomy_weights == other_weights,
            "bf16 roomy and {policy} weights"
        );
    }
}

/// Chunk-major accumulation (every micro-batch through a layer while its chunk is on the
/// device, one program per step) trains the very bits of sequential accumulation: losses,
/// gradient norms and final weights, for both fixture models with 2 and 3 micro-batches,
/// roomy and tight (streamed chunks, a swapped and a checkpointed layer), in f32 and bf16.
/// Each chunk-major schedule is verified (the pipeline verifies what it compiles) and is one
/// program reading each micro-batch's rows at its own inputs.
#[test]
fn chunk_major_accumulation_is_the_same_bits_as_sequential() {
    let e = expected();
    let schedule =
        LrSchedule::new(LrScheduleKind::Linear, e.optimizer.lr, 1, 3, 0.0).expect("schedule");
    let bits = |rs: &[StepRecord]| -> Vec<(u32, Option<u32>)> {
        rs.iter()
            .map(|r| (r.loss.to_bits(), r.grad_norm.map(f32::to_bits)))
            .collect()
    };
    let mut cases = Vec::new();
    for model in ["gpt2", "llama"] {
        for k in [2, 3] {
            for policy in [ROOMY, TIGHT] {
                cases.push((model, policy, Shape::f32(e.batch, k)));
            }
        }
    }
    let bf16 = Shape {
        dtype: DType::BF16,
        ..Shape::f32(e.batch, 2)
    };
    cases.push(("gpt2", TIGHT, bf16));
    for (model, policy, shape) in cases {
        let what = format!("{model} {policy} x{} {}", shape.micro_batches, shape.dtype);
        let chunk_major = format!("{policy} order=chunk-major");
        let compiled = compile(model, &e.optimizer, &chunk_major, shape);
        let s = &compiled.schedule;
        assert!(s.is_chunk_major(), "{what}: a chunk-major schedule");
        assert_eq!(
            s.micro_batches(),
            1,
            "{what}: one program, run once per step"
        );
        assert_eq!(
            s.graph.inputs().len(),
            2 * shape.micro_batches as usize,
            "{what}: tokens and targets per micro-batch"
        );
        let run = |policy: &str| {
            train(
                model,
                &e.optimizer,
                policy,
                shape,
                settings(TOKENS, schedule, 3),
            )
        };
        let (sequential, sequential_weights) = run(policy);
        let (interleaved, interleaved_weights) = run(&chunk_major);
        assert_eq!(
            bits(&sequential),
            bits(&interleaved),
            "{what}: sequential and chunk-major losses and norms"
        );
        assert!(
            sequential_weights == interleaved_weights,
            "{what}: sequential and chunk-major weights"
        );
    }
}
