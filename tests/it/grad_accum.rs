//! Gradient accumulation against PyTorch: five steps of the GPT-2 and LLaMA fixture models
//! with two micro-batches per step (`(loss / K).backward()` per micro-batch, then
//! `clip_grad_norm_` and `torch.optim.AdamW` once per step, under transformers' cosine and
//! linear schedules with warmup), bit-identical between a roomy and a tight policy; K
//! micro-batches of B sequences against one batch of K*B; and a resumed accumulating run
//! (fixtures made by `tests/fixtures/make_grad_accum_fixtures.py`).

use crate::common::{fixtures, numbers, read_json, relative};
use protrain::ir::DType;
use protrain::runtime::checkpoint;
use protrain::runtime::params::load_params;
use protrain::runtime::train::{
    CheckpointPlan, LrSchedule, LrScheduleKind, RunFlags, RunSettings, StepRecord,
};
use protrain::runtime::{Executor, Trainer};
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
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

/// Every parameter stays on the device (gradients accumulate there) and every layer keeps
/// its activations.
const ROOMY: &str = "blocks=KK";
/// Every chunk streamed through two buffers (gradients offloaded and accumulated on the
/// host); one layer swapped, one recomputed.
const TIGHT: &str = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1";
/// One chunk on the device, the rest streamed: accumulators in both memories.
const MIXED: &str = "n_persist=1 n_buffer=2 n_checkpoint=1";

/// A verified f32 schedule of the fixture model `model` (`batch` x 16, `k` micro-batches)
/// under `policy`.
fn compile(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    batch: u64,
    k: u64,
) -> protrain::Compiled {
    compile_as(model, optimizer, policy, batch, k, DType::F32)
}

/// [`compile`] in element type `dtype`.
fn compile_as(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    batch: u64,
    k: u64,
    dtype: DType,
) -> protrain::Compiled {
    let config = protrain::models::load(fixtures().join(model).to_str().expect("utf-8"))
        .expect("the fixture's config parses");
    let options = CompileOptions {
        batch,
        seq: 16,
        dtype,
        policy: PolicyChoice::parse(policy).expect("a policy"),
        optimizer: optimizer.clone(),
        micro_batches: k,
        topology: protrain::compiler::comm::Topology::SINGLE,
        ..CompileOptions::default()
    };
    protrain::compile(&config, &options).expect("the fixture model compiles")
}

fn settings(schedule: LrSchedule, steps: u64) -> RunSettings {
    RunSettings {
        steps,
        lr_schedule: schedule,
        seed: 0,
        data: Some(fixtures().join("grad_accum/tokens.npy")),
        loss_scale: None,
        save_every: None,
        data_checksum: None,
    }
}

/// Trains `model` from its fixture weights; returns every step's record and the final
/// weights.
fn train(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    shape: (u64, u64),
    settings: RunSettings,
) -> (Vec<StepRecord>, Vec<Vec<f32>>) {
    train_as(model, optimizer, policy, shape, settings, DType::F32)
}

/// [`train`] with a schedule in element type `dtype`.
fn train_as(
    model: &str,
    optimizer: &OptimizerConfig,
    policy: &str,
    (batch, k): (u64, u64),
    settings: RunSettings,
    dtype: DType,
) -> (Vec<StepRecord>, Vec<Vec<f32>>) {
    let compiled = compile_as(model, optimizer, policy, batch, k, dtype);
    let schedule = &compiled.schedule;
    assert_eq!(u64::from(schedule.micro_batches()), k);
    let weights = fixtures().join(model).join("model.safetensors");
    let params = load_params(&schedule.graph, &weights).expect("the fixture weights load");
    let executor = Executor::new(schedule).expect("an executor");
    let mut trainer =
        Trainer::start(executor, settings, &params, "the fixture").expect("a trainer");
    let mut records = Vec::new();
    trainer
        .run(|r| records.push(r.clone()))
        .expect("the run trains");
    let finals = trainer.executor().params().expect("weights read back");
    (records, finals)
}

#[test]
fn accumulated_training_matches_pytorch_under_every_policy() {
    let e = expected();
    assert_eq!(e.runs.len(), 4, "gpt2 and llama, cosine and linear");
    let shape = (e.batch, e.grad_accum);
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
                settings(schedule, e.steps),
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
            (e.batch, 1),
            settings(schedule, e.steps),
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
        let (big, big_weights) = train(model, &e.optimizer, roomy, (8, 1), settings(schedule, 5));
        let (accum, accum_weights) =
            train(model, &e.optimizer, TIGHT, (2, 4), settings(schedule, 5));
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
        let (small, _) = train(model, &e.optimizer, roomy, (2, 1), settings(schedule, 5));
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
        let (accum, accum_weights) =
            train(model, &e.optimizer, roomy, (2, 2), settings(schedule, 3));
        for policy in [TIGHT, MIXED] {
            let (other, other_weights) =
                train(model, &e.optimizer, policy, (2, 2), settings(schedule, 3));
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
        let (apart, _) = train(model, &still, roomy, (2, 1), settings(frozen, 2));
        let mean = (f64::from(apart[0].loss) + f64::from(apart[1].loss)) / 2.0;
        let rel = relative(f64::from(accum[0].loss), mean);
        assert!(
            rel < 1e-6,
            "{model}: the accumulated loss {} is {rel:e} from the micro-batches' mean {mean}",
            accum[0].loss
        );
        // One batch of all four rows takes one auxiliary loss over them (transformers' forward
        // on that batch): another number, as the load-balancing loss is not linear in rows.
        let (whole, _) = train(model, &still, roomy, (4, 1), settings(frozen, 1));
        let whole_rel = relative(f64::from(whole[0].loss), mean);
        eprintln!("{model}: one 4-row batch is {whole_rel:e} from the micro-batches' mean");
        assert!(whole_rel > 1e-6, "{model}: {whole_rel:e}");
    }
}

#[test]
fn an_accumulating_run_resumes_as_if_never_interrupted() {
    let e = expected();
    let shape = (e.batch, e.grad_accum);
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
        settings(schedule, e.steps),
    );
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let compiled = compile("gpt2", &e.optimizer, ROOMY, shape.0, shape.1);
        let s = &compiled.schedule;
        let weights = fixtures().join("gpt2/model.safetensors");
        let params = load_params(&s.graph, &weights).expect("weights");
        let executor = Executor::new(s).expect("an executor");
        let mut trainer = Trainer::start(executor, settings(schedule, e.steps), &params, "fixture")
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
    let other = compile("gpt2", &e.optimizer, ROOMY, shape.0, 3);
    let err = checkpoint::load_latest(dir.path(), &other.schedule)
        .map(|_| ())
        .expect_err("another --grad-accum");
    assert!(err.to_string().contains("grad_accum=2"), "{err}");

    let compiled = compile("gpt2", &e.optimizer, TIGHT, shape.0, shape.1);
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
        train_as(
            "gpt2",
            &e.optimizer,
            policy,
            (e.batch, e.grad_accum),
            settings(schedule, 5),
            DType::BF16,
        )
    };
    let (roomy, roomy_weights) = run(ROOMY);
    let (f32_run, _) = train(
        "gpt2",
        &e.optimizer,
        ROOMY,
        (e.batch, e.grad_accum),
        settings(schedule, 5),
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
