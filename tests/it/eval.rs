//! Evaluation against transformers and against training: the mean loss of the GPT-2 and
//! LLaMA fixture models with given weights, by a forward-only schedule, within 1e-5 of
//! PyTorch's (fixtures made by `tests/fixtures/make_eval_fixtures.py`); bit-identical between
//! a roomy and a tight policy; and on the batch a training step reads, that step's loss to the
//! bit, in f32 and bf16. A trainer evaluates every K steps the weights it has.

use crate::common::{fixtures, read_json, relative};
use protrain::ir::verify_schedule::VerifiedSchedule;
use protrain::ir::DType;
use protrain::runtime::data::TokenStream;
use protrain::runtime::eval::{load_weights, EvalPlan, EvalResult, Evaluator};
use protrain::runtime::train::{LrSchedule, RunSettings, StepRecord};
use protrain::runtime::{Executor, RuntimeError, Trainer};
use protrain::{CompileOptions, OptimizerConfig, PolicyChoice};
use std::num::NonZeroU64;
use std::path::Path;

/// Every parameter on the device.
const ROOMY: &str = "blocks=KK";
/// Every chunk streamed through two buffers; for training, one layer swapped, one recomputed.
const TIGHT_EVAL: &str = "n_persist=0 n_buffer=2";
const TIGHT_TRAIN: &str = "n_persist=0 n_buffer=2 n_swap=1 n_checkpoint=1";

/// A verified schedule of `model` (a fixture directory or a preset) at batch 2 x seq 16.
fn compile(model: &str, policy: &str, forward_only: bool, dtype: DType) -> VerifiedSchedule {
    let path = fixtures().join(model);
    let name = match path.is_dir() {
        true => path.to_str().expect("utf-8").to_string(),
        false => model.to_string(),
    };
    let config = protrain::models::load(&name).expect("the model loads");
    let options = CompileOptions {
        batch: 2,
        seq: 16,
        dtype,
        policy: PolicyChoice::parse(policy).expect("a policy"),
        optimizer: OptimizerConfig {
            lr: 1e-2,
            ..OptimizerConfig::default()
        },
        forward_only,
        ..CompileOptions::default()
    };
    protrain::compile(&config, &options)
        .expect("the model compiles")
        .schedule
}

/// Evaluates `params` with `schedule` on the first `batches` batches of `tokens`.
fn evaluate(
    schedule: &VerifiedSchedule,
    tokens: &Path,
    batches: Option<u64>,
    params: &[Vec<f32>],
) -> EvalResult {
    let executor = Executor::new(schedule).expect("an executor");
    let stream = TokenStream::open(tokens).expect("the tokens");
    let mut evaluator = Evaluator::new(executor, stream, batches, "the tokens").expect("evaluator");
    evaluator
        .evaluate(params, "the test")
        .expect("it evaluates")
}

#[test]
fn evaluation_matches_transformers_under_every_policy() {
    let expected = read_json(&fixtures().join("eval/expected.json"));
    let tokens = fixtures().join("eval/tokens.npy");
    let cases = expected["cases"].as_array().expect("cases");
    assert_eq!(
        cases.len(),
        4,
        "gpt2 and llama, initial and trained weights"
    );
    let mut losses = Vec::new();
    for case in cases {
        let model = case["model"].as_str().expect("model");
        let weights = case["weights"].as_str().expect("weights");
        let what = format!("{model} {weights}");
        let roomy = compile(model, ROOMY, true, DType::F32);
        let tight = compile(model, TIGHT_EVAL, true, DType::F32);
        assert!(
            tight.arena_bytes < roomy.arena_bytes,
            "{what}: tight is tighter"
        );
        let (params, _) = load_weights(&roomy.graph, &fixtures().join(model).join(weights))
            .expect("the fixture weights load");
        let got = evaluate(&roomy, &tokens, None, &params);
        assert_eq!(got.batches, expected["batches"].as_u64().expect("batches"));
        assert_eq!(got.tokens, got.batches * 32);
        let want = case["loss"].as_f64().expect("loss");
        let rel = relative(got.loss, want);
        assert!(
            rel < 1e-5,
            "{what}: loss {} vs PyTorch {want} (rel {rel:e})",
            got.loss
        );
        let want_ppl = case["ppl"].as_f64().expect("ppl");
        let rel = relative(got.perplexity, want_ppl);
        assert!(
            rel < 1e-5,
            "{what}: perplexity {} vs {want_ppl}",
            got.perplexity
        );
        assert_eq!(got.perplexity, got.loss.exp());
        // Every policy computes the same bits.
        let streamed = evaluate(&tight, &tokens, None, &params);
        assert_eq!(
            got.loss.to_bits(),
            streamed.loss.to_bits(),
            "{what}: roomy {} and tight {}",
            got.loss,
            streamed.loss
        );
        losses.push(got.loss);
    }
    // The tolerance tells weights apart: each model's initial and trained weights give losses
    // further apart than 1e-3, so evaluating the wrong ones fails the comparison above.
    for pair in losses.chunks(2) {
        assert!(relative(pair[0], pair[1]) > 1e-3, "{pair:?}");
    }
}

#[test]
fn the_first_training_step_loss_is_the_evaluation_loss_to_the_bit() {
    let tokens = fixtures().join("gpt2/tokens.npy");
    for (model, dtype) in [
        ("gpt2", DType::F32),
        ("llama", DType::F32),
        ("gpt2", DType::BF16),
        ("opt-tiny", DType::F32),
    ] {
        let what = format!("{model} {dtype}");
        let mut evals = Vec::new();
        for policy in [ROOMY, TIGHT_EVAL] {
            let eval = compile(model, policy, true, dtype);
            let params = match fixtures().join(model).is_dir() {
                true => {
                    load_weights(
                        &eval.graph,
                        &fixtures().join(model).join("model.safetensors"),
                    )
                    .expect("weights")
                    .0
                }
                false => protrain::runtime::params::init_params(&eval.graph, 7),
            };
            let e = evaluate(&eval, &tokens, Some(1), &params);
            assert_eq!(e.batches, 1);
            for train_policy in [ROOMY, TIGHT_TRAIN] {
                let training = compile(model, train_policy, false, dtype);
                let mut executor = Executor::new(&training).expect("an executor");
                executor.load_params(&params).expect("weights load");
                let stream = TokenStream::open(&tokens).expect("tokens");
                let batcher =
                    protrain::runtime::data::Batcher::new(stream, 2, 16).expect("a batcher");
                let b = batcher.batch(0);
                let ids = |v: &[u32]| v.iter().map(|&t| t as i32).collect::<Vec<i32>>();
                let (inputs, targets) = (ids(&b.inputs), ids(&b.targets));
                let step = executor.step(&[&inputs, &targets]).expect("a step");
                assert_eq!(
                    f64::from(step.loss).to_bits(),
                    e.loss.to_bits(),
                    "{what}: training ({train_policy}) {} against evaluation ({policy}) {}",
                    step.loss,
                    e.loss
                );
            }
            evals.push(e.loss);
        }
        // Evaluating the second batch too changes the mean: the comparison can fail.
        let eval = compile(model, ROOMY, true, dtype);
        let params = match fixtures().join(model).is_dir() {
            true => {
                load_weights(
                    &eval.graph,
                    &fixtures().join(model).join("model.safetensors"),
                )
                .expect("weights")
                .0
            }
            false => protrain::runtime::params::init_params(&eval.graph, 7),
        };
        let two = evaluate(&eval, &tokens, Some(2), &params);
        assert_ne!(two.loss, evals[0], "{what}");
    }
}

#[test]
fn a_trainer_evaluates_its_weights_every_k_steps() {
    let tokens = fixtures().join("lr_schedule/tokens.npy");
    let held_out = fixtures().join("eval/tokens.npy");
    let training = compile("gpt2", ROOMY, false, DType::F32);
    let eval = compile("gpt2", TIGHT_EVAL, true, DType::F32);
    let weights = fixtures().join("gpt2/model.safetensors");
    let (params, _) = load_weights(&training.graph, &weights).expect("weights");
    let settings = RunSettings {
        steps: 5,
        lr_schedule: LrSchedule::constant(1e-2),
        seed: 0,
        data: Some(tokens),
        loss_scale: None,
        save_every: None,
        data_checksum: None,
    };
    let executor = Executor::new(&training).expect("executor");
    let mut trainer = Trainer::start(executor, settings, &params, "the fixture").expect("trainer");
    let evaluator = Evaluator::new(
        Executor::new(&eval).expect("executor"),
        TokenStream::open(&held_out).expect("tokens"),
        Some(3),
        "held-out",
    )
    .expect("evaluator");
    trainer
        .evaluate_every(EvalPlan {
            evaluator,
            every: NonZeroU64::new(2).expect("2"),
        })
        .expect("the schedules are of one model");
    let mut records: Vec<StepRecord> = Vec::new();
    let mut after_two = None;
    while let Some(r) = trainer.step(|_| {}).expect("a step") {
        if r.step == 2 {
            after_two = Some(trainer.executor().params().expect("weights"));
        }
        records.push(r);
    }
    let evaluated: Vec<u64> = records
        .iter()
        .filter(|r| r.eval.is_some())
        .map(|r| r.step)
        .collect();
    assert_eq!(evaluated, [2, 4]);
    // The evaluation is of the weights after the step, as a separate evaluation finds.
    let at_two = records[1].eval.clone().expect("evaluated");
    let alone = evaluate(&eval, &held_out, Some(3), &after_two.expect("step 2 ran"));
    assert_eq!(at_two.loss.to_bits(), alone.loss.to_bits());
    assert_eq!(at_two.batches, 3);
    let before = evaluate(&eval, &held_out, Some(3), &params);
    assert_ne!(at_two.loss, before.loss, "the weights trained");
    let at_four = records[3].eval.as_ref().expect("evaluated");
    assert_ne!(at_four.loss, at_two.loss);

    // A schedule of another model is refused before training.
    let other = compile("llama", ROOMY, true, DType::F32);
    let evaluator = Evaluator::new(
        Executor::new(&other).expect("executor"),
        TokenStream::open(&held_out).expect("tokens"),
        None,
        "held-out",
    )
    .expect("evaluator");
    let executor = Executor::new(&training).expect("executor");
    let settings = RunSettings {
        steps: 1,
        lr_schedule: LrSchedule::constant(1e-2),
        seed: 0,
        data: Some(fixtures().join("lr_schedule/tokens.npy")),
        loss_scale: None,
        save_every: None,
        data_checksum: None,
    };
    let mut trainer = Trainer::start(executor, settings, &params, "the fixture").expect("trainer");
    let err = trainer
        .evaluate_every(EvalPlan {
            evaluator,
            every: NonZeroU64::new(1).expect("1"),
        })
        .expect_err("another model is refused");
    assert!(err.to_string().contains("another model"), "{err}");
}

#[test]
fn an_evaluator_refuses_what_it_cannot_evaluate_and_says_why() {
    let tokens = fixtures().join("eval/tokens.npy");
    let training = compile("gpt2", ROOMY, false, DType::F32);
    let eval = compile("gpt2", ROOMY, true, DType::F32);
    let open = |schedule, batches| {
        Evaluator::new(
            Executor::new(schedule).expect("executor"),
            TokenStream::open(&tokens).expect("tokens"),
            batches,
            "eval/tokens.npy",
        )
        .err()
        .expect("refused")
        .to_string()
    };
    // A training schedule would train the weights it measures.
    let text = open(&training, None);
    // The library names the compile option (the CLI words it as --forward-only).
    assert!(
        text.contains("MODEL forward_only") && !text.contains("--"),
        "{text}"
    );
    // The file holds 129 tokens: four batches of 2 x 16 with their last targets.
    let text = open(&eval, Some(5));
    assert!(
        text.contains("eval/tokens.npy holds 129 tokens, 4 batch(es)")
            && text.contains("at most 4"),
        "{text}"
    );
    let text = open(&eval, Some(0));
    assert!(text.contains("at least 1"), "{text}");
    // Weights that are not finite are named.
    let mut params = protrain::runtime::params::init_params(&eval.graph, 0);
    params[3][5] = f32::NAN;
    let mut evaluator = Evaluator::new(
        Executor::new(&eval).expect("executor"),
        TokenStream::open(&tokens).expect("tokens"),
        None,
        "eval/tokens.npy",
    )
    .expect("evaluator");
    let err = evaluator
        .evaluate(&params, "--init W")
        .expect_err("NaN weights");
    assert!(
        matches!(err, RuntimeError::NonFiniteWeights { .. })
            && err.to_string().contains("--init W"),
        "{err}"
    );
}
