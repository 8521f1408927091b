//! Learning-rate schedules against transformers and PyTorch: the rates of
//! `get_{constant,linear,cosine}_schedule_with_warmup` to the bit, and five steps of the GPT-2
//! and LLaMA fixture models trained through the executor by the runtime's `Trainer` under a
//! cosine and a linear schedule with warmup and clipping, matching `torch.optim.AdamW` +
//! `clip_grad_norm_` + transformers' schedulers, bit-identical between a roomy and a tight
//! policy, and resumed from a checkpoint as if never interrupted (fixtures made by
//! `tests/fixtures/make_lr_schedule_fixtures.py`).

use crate::common::fixture_run::{compile, settings, train, Shape};
use crate::common::{fixtures, numbers, read_json, relative};
use protrain::runtime::checkpoint;
use protrain::runtime::params::load_params;
use protrain::runtime::train::{
    CheckpointPlan, LrSchedule, LrScheduleKind, RunFlags, RunSettings, StepRecord,
};
use protrain::runtime::{Executor, Trainer};
use protrain::OptimizerConfig;
use serde_json::Value;
use std::num::NonZeroU64;

fn kind(name: &str) -> LrScheduleKind {
    match name {
        "constant" => LrScheduleKind::Constant,
        "linear" => LrScheduleKind::Linear,
        "cosine" => LrScheduleKind::Cosine,
        other => panic!("unknown schedule {other}"),
    }
}

/// An f64 from the fixture's `0x...` bit pattern.
fn f64_of_hex(v: &Value) -> f64 {
    let text = v.as_str().expect("a hex string");
    f64::from_bits(u64::from_str_radix(text.trim_start_matches("0x"), 16).expect("hex"))
}

#[test]
fn schedules_give_transformers_rates_to_the_bit() {
    let table = read_json(&fixtures().join("lr_schedule/table.json"));
    let cases = table["cases"].as_array().expect("cases");
    assert!(cases.len() >= 15, "the table covers every shape");
    let mut compared = 0;
    for case in cases {
        let n = |k: &str| case[k].as_u64().expect(k);
        let schedule = LrSchedule::new(
            kind(case["kind"].as_str().expect("kind")),
            case["peak"].as_f64().expect("peak"),
            n("warmup_steps"),
            n("decay_steps"),
            case["min_lr"].as_f64().expect("min_lr"),
        )
        .expect("a valid schedule");
        for (i, hex) in case["lrs_f64_hex"]
            .as_array()
            .expect("lrs")
            .iter()
            .enumerate()
        {
            let step = i as u64 + 1;
            let (got, want) = (schedule.lr(step), f64_of_hex(hex));
            // Bits, not a tolerance: the same f64 operations as transformers' lambdas and
            // LambdaLR's `base_lr * lambda`, and the platform's `cos` on both sides.
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{schedule:?} step {step}: {got:e}, transformers {want:e}"
            );
            compared += 1;
        }
    }
    assert!(compared > 200, "{compared} rates compared");
}

/// What the PyTorch runs of `expected.json` share.
struct Expected {
    optimizer: OptimizerConfig,
    warmup: u64,
    decay: u64,
    steps: u64,
    runs: Vec<Value>,
}

fn expected() -> Expected {
    let v = read_json(&fixtures().join("lr_schedule/expected.json"));
    let f = |k: &str| v[k].as_f64().expect(k);
    assert_eq!((f("batch"), f("seq")), (2.0, 16.0));
    Expected {
        optimizer: OptimizerConfig {
            lr: f("lr"),
            beta1: f("beta1"),
            beta2: f("beta2"),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            grad_clip: Some(f("grad_clip")),
        },
        warmup: v["warmup_steps"].as_u64().expect("warmup"),
        decay: v["decay_steps"].as_u64().expect("decay"),
        steps: v["steps"].as_u64().expect("steps"),
        runs: v["runs"].as_array().expect("runs").clone(),
    }
}

/// Every parameter stays on the device and every layer keeps its activations.
const ROOMY: &str = "blocks=KK";
/// Every chunk streamed through two buffers; one layer swapped, one recomputed.
const TIGHT: &str = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1";

/// The fixture runs' shape: batch 2 (x seq 16), no accumulation, f32.
const SHAPE: Shape = Shape::f32(2, 1);
/// The fixture directory of the runs' tokens.
const TOKENS: &str = "lr_schedule";

#[test]
fn scheduled_training_matches_pytorch_under_every_policy() {
    let e = expected();
    assert_eq!(e.runs.len(), 4, "gpt2 and llama, cosine and linear");
    for run in &e.runs {
        let model = run["model"].as_str().expect("model");
        let shape = kind(run["lr_schedule"].as_str().expect("schedule"));
        let what = format!("{model} {shape}");
        let schedule =
            LrSchedule::new(shape, e.optimizer.lr, e.warmup, e.decay, 0.0).expect("schedule");
        let (roomy, roomy_weights) = train(
            model,
            &e.optimizer,
            ROOMY,
            SHAPE,
            settings(TOKENS, schedule, e.steps),
        );
        let (tight, tight_weights) = train(
            model,
            &e.optimizer,
            TIGHT,
            SHAPE,
            settings(TOKENS, schedule, e.steps),
        );
        assert_eq!(roomy.len() as u64, e.steps, "{what}: steps");

        let losses = numbers(&run["losses"]);
        let norms = numbers(&run["grad_norms_preclip"]);
        let lrs = run["lrs_f64_hex"].as_array().expect("lrs");
        for (i, r) in roomy.iter().enumerate() {
            let lr = r.lr.expect("the schedule has an optimizer");
            assert_eq!(
                lr.to_bits(),
                f64_of_hex(&lrs[i]).to_bits(),
                "{what} step {}: lr {lr:e} is not PyTorch's",
                r.step
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
        // The policies compute the same bits: the schedule changes only the rates.
        let bits = |rs: &[StepRecord]| -> Vec<(u32, u64)> {
            rs.iter()
                .map(|r| (r.loss.to_bits(), r.lr.map_or(0, f64::to_bits)))
                .collect()
        };
        assert_eq!(bits(&roomy), bits(&tight), "{what}: roomy and tight losses");
        assert!(
            roomy_weights == tight_weights,
            "{what}: roomy and tight weights"
        );

        // The comparison can fail: a warmup of one step instead of two moves the third
        // step's loss (the first two run at the same rates) out of the tolerance.
        let wrong =
            LrSchedule::new(shape, e.optimizer.lr, e.warmup - 1, e.decay, 0.0).expect("schedule");
        let (off, _) = train(
            model,
            &e.optimizer,
            ROOMY,
            SHAPE,
            settings(TOKENS, wrong, e.steps),
        );
        let worst = off
            .iter()
            .zip(&losses)
            .map(|(r, &want)| relative(f64::from(r.loss), want))
            .fold(0.0, f64::max);
        assert!(
            worst > 1e-3,
            "{what}: a one-step warmup trains within {worst:e} of PyTorch's two-step one; the \
             loss comparison cannot tell schedules apart"
        );
    }
}

#[test]
fn a_resumed_scheduled_run_takes_the_uninterrupted_runs_steps() {
    let e = expected();
    let schedule = LrSchedule::new(
        LrScheduleKind::Cosine,
        e.optimizer.lr,
        e.warmup,
        e.decay,
        0.0,
    )
    .expect("schedule");
    let (straight, straight_weights) = train(
        "llama",
        &e.optimizer,
        ROOMY,
        SHAPE,
        settings(TOKENS, schedule, e.steps),
    );

    // Two steps under the roomy policy, saved, then the rest under the tight one from the
    // checkpoint alone: the settings come from it.
    let dir = tempfile::tempdir().expect("temp dir");
    {
        let compiled = compile("llama", &e.optimizer, ROOMY, SHAPE);
        let schedule_file = &compiled.schedule;
        let weights = fixtures().join("llama/model.safetensors");
        let params = load_params(&schedule_file.graph, &weights).expect("weights");
        let executor = Executor::new(schedule_file).expect("an executor");
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
        trainer
            .save_checkpoints(plan, None)
            .expect("an empty directory");
        for _ in 0..2 {
            trainer.step(|_| {}).expect("a step").expect("steps remain");
        }
    }
    let compiled = compile("llama", &e.optimizer, TIGHT, SHAPE);
    let tight = &compiled.schedule;
    let (ckpt, warnings) = checkpoint::load_latest(dir.path(), tight).expect("the checkpoint");
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(ckpt.progress.step, 2);
    let saved = ckpt
        .run
        .as_ref()
        .expect("the checkpoint records the run settings");
    let resumed_settings = RunFlags::default()
        .resume(saved, &ckpt.path)
        .expect("no flag contradicts the checkpoint");
    // The checkpoint also records how often the run saved and a checksum of its data.
    let recorded = RunSettings {
        save_every: Some(2),
        data_checksum: saved.data_checksum.clone(),
        ..settings(TOKENS, schedule, e.steps)
    };
    assert!(recorded.data_checksum.is_some());
    assert_eq!(resumed_settings, recorded);
    let executor = Executor::new(tight).expect("an executor");
    let mut trainer = Trainer::resume(executor, resumed_settings, &ckpt).expect("a trainer");
    let mut resumed = Vec::new();
    trainer
        .run(|r| resumed.push(r.clone()))
        .expect("the rest trains");
    let key = |r: &StepRecord| (r.step, r.batch, r.loss.to_bits(), r.lr.map(f64::to_bits));
    assert_eq!(
        resumed.iter().map(key).collect::<Vec<_>>(),
        straight[2..].iter().map(key).collect::<Vec<_>>(),
        "steps 3..5 resumed are the uninterrupted run's, bit for bit"
    );
    assert!(trainer.executor().params().expect("weights") == straight_weights);
}

#[test]
fn the_interpreter_and_the_executor_take_the_same_rate_per_step() {
    let e = expected();
    let compiled = compile("gpt2", &e.optimizer, TIGHT, SHAPE);
    let schedule = &compiled.schedule;
    let config =
        protrain::models::load(fixtures().join("gpt2").to_str().expect("utf-8")).expect("config");
    let forward = protrain::forward_graph(&config, 2, 16).expect("forward graph");
    let graph = protrain::training_graph(&forward, &e.optimizer).expect("training graph");
    let weights = fixtures().join("gpt2/model.safetensors");
    let params = load_params(&graph, &weights).expect("weights");
    let mut interp = protrain::runtime::interpreter::Interpreter::new(&graph);
    for ((id, _), data) in graph.params().zip(&params) {
        interp.set_param(id, data).expect("sizes match");
    }
    let mut exec = Executor::new(schedule).expect("an executor");
    exec.load_params(&load_params(&schedule.graph, &weights).expect("weights"))
        .expect("weights load");
    let stream =
        protrain::runtime::data::TokenStream::open(fixtures().join("lr_schedule/tokens.npy"))
            .expect("tokens");
    let batcher = protrain::runtime::data::Batcher::new(stream, 2, 16).expect("batcher");

    // A rate below the compiled one, zero, and the compiled one through `step`.
    for (step, lr) in [(0u64, Some(0.004)), (1, Some(0.0)), (2, None)] {
        let b = batcher.batch(step);
        let x: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
        let y: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
        let (a, b) = match lr {
            Some(lr) => (
                interp.step_at_lr(&[&x, &y], lr).expect("a step"),
                exec.step_at_lr(&[&x, &y], lr).expect("a step"),
            ),
            None => (
                interp.step(&[&x, &y]).expect("a step"),
                exec.step(&[&x, &y]).expect("a step"),
            ),
        };
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {step}: loss");
    }
    let finals = exec.params().expect("weights");
    for ((id, p), got) in graph.params().zip(&finals) {
        assert!(interp.param(id) == got.as_slice(), "{} differs", p.name);
    }
    // The rates were applied: at the compiled rate throughout, the weights end elsewhere.
    let mut compiled_rate = protrain::runtime::interpreter::Interpreter::new(&graph);
    for ((id, _), data) in graph.params().zip(&params) {
        compiled_rate.set_param(id, data).expect("sizes match");
    }
    for step in 0..3 {
        let b = batcher.batch(step);
        let x: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
        let y: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
        compiled_rate.step(&[&x, &y]).expect("a step");
    }
    let (id, p) = graph.params().next().expect("a parameter");
    assert!(
        compiled_rate.param(id) != interp.param(id),
        "{}: the scheduled rates changed nothing",
        p.name
    );

    // A rate that is not a finite number >= 0 is refused before anything runs.
    let b = batcher.batch(3);
    let x: Vec<i32> = b.inputs.iter().map(|&t| t as i32).collect();
    let y: Vec<i32> = b.targets.iter().map(|&t| t as i32).collect();
    for bad in [-1e-3, f64::NAN, f64::INFINITY] {
        let err = exec.step_at_lr(&[&x, &y], bad).unwrap_err().to_string();
        assert!(
            err.contains("of step 4 is not a finite number >= 0"),
            "{err}"
        );
        let err = interp.step_at_lr(&[&x, &y], bad).unwrap_err().to_string();
        assert!(
            err.contains("of step 4 is not a finite number >= 0"),
            "{err}"
        );
    }
    assert_eq!(exec.steps_taken(), 3, "a refused step is not taken");
    assert!(
        exec.params().expect("weights") == finals,
        "nor changes a weight"
    );
}
