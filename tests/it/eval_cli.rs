//! `protrain eval`, `compile --forward-only` and evaluation while training (`--eval-data`)
//! through the binary: the first step of `train` has the loss `eval` finds for the same
//! weights and batch, to the bit; a roomy and a tight device budget evaluate the same bits;
//! a checkpoint directory evaluates to what the run evaluated when it wrote it; the README's
//! text-corpus run works; and bad input is refused with the way out.

use crate::cli_support;
use crate::common::{fixtures, root};

use cli_support::{path, protrain, stderr, stdout};
use serde_json::Value;

/// Every JSON line of standard output.
fn records(out: &std::process::Output) -> Vec<Value> {
    stdout(out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// Runs `args`, which must succeed, and returns its JSON lines.
fn json_of(args: &[&str]) -> Vec<Value> {
    let out = protrain(args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    records(&out)
}

/// Runs `args`, which must fail with status 2, and returns standard error.
fn refused(args: &[&str]) -> String {
    let out = protrain(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stdout(&out));
    let text = stderr(&out);
    assert!(!text.contains("panicked"), "{text}");
    text
}

fn f32_bits(v: &Value) -> u32 {
    (v.as_f64().expect("a number") as f32).to_bits()
}

#[test]
fn the_first_training_step_has_the_loss_eval_finds() {
    let model = fixtures().join("gpt2");
    let weights = model.join("model.safetensors");
    let tokens = model.join("tokens.npy");
    let shape = ["--batch", "2", "--seq", "16"];
    let mut train = vec![
        "train",
        path(&model),
        "--init",
        path(&weights),
        "--data",
        path(&tokens),
        "--steps",
        "1",
        "--json",
    ];
    train.extend(shape);
    let step = &json_of(&train)[0];
    let mut eval = vec![
        "eval",
        path(&model),
        "--init",
        path(&weights),
        "--data",
        path(&tokens),
        "--batches",
        "1",
        "--json",
    ];
    eval.extend(shape);
    let e = &json_of(&eval)[0];
    assert_eq!(e["batches"], 1);
    assert_eq!(e["tokens"], 32);
    // One batch: the evaluation loss is that batch's f32 loss exactly.
    let loss = e["loss"].as_f64().expect("loss");
    assert_eq!(loss, f64::from(loss as f32));
    assert_eq!(
        f32_bits(&step["loss"]),
        f32_bits(&e["loss"]),
        "train {} against eval {}",
        step["loss"],
        e["loss"]
    );
    // PyTorch's step-0 loss of these weights on this batch (tests/fixtures/gpt2).
    let torch = 4.587784290313721;
    assert!(
        (loss - torch).abs() / torch < 1e-5,
        "{loss} vs PyTorch {torch}"
    );
    assert_eq!(e["ppl"].as_f64().expect("ppl"), loss.exp());
}

#[test]
fn a_roomy_and_a_tight_budget_evaluate_the_same_bits() {
    let corpus = fixtures().join("eval/tokens.npy");
    let base = ["eval", "gpt2-tiny", "--init"];
    let dir = tempfile::tempdir().expect("temp dir");
    // Weights to evaluate: those of a short run from the seed.
    let weights = dir.path().join("w.safetensors");
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--save",
        path(&weights),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let eval = |budget: Option<&str>| {
        let mut args = base.to_vec();
        args.extend([path(&weights), "--data", path(&corpus)]);
        args.extend(["--batch", "2", "--seq", "16", "--json"]);
        if let Some(b) = budget {
            args.extend(["--gpu-memory", b]);
        }
        json_of(&args).remove(0)
    };
    let roomy = eval(None);
    let tight = eval(Some("300KiB"));
    assert_eq!(roomy["batches"], 4);
    let chunks_persistent = |v: &Value| {
        v["policy"]
            .as_str()
            .expect("policy")
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("n_persist="))
            .expect("n_persist")
            .parse::<u32>()
            .expect("a number")
    };
    assert!(
        chunks_persistent(&tight) < chunks_persistent(&roomy),
        "the tight budget streams chunks: {} against {}",
        tight["policy"],
        roomy["policy"]
    );
    assert!(tight["device_bytes"].as_u64() < roomy["device_bytes"].as_u64());
    assert_eq!(
        roomy["loss"].as_f64().expect("loss").to_bits(),
        tight["loss"].as_f64().expect("loss").to_bits(),
        "roomy {} tight {}",
        roomy["loss"],
        tight["loss"]
    );
    // Too small for any forward-only schedule: the error says what would fit.
    let mut args = base.to_vec();
    args.extend([
        path(&weights),
        "--data",
        path(&corpus),
        "--gpu-memory",
        "4KiB",
    ]);
    let text = refused(&args);
    assert!(
        text.contains("--gpu-memory") || text.contains("budget"),
        "{text}"
    );
}

#[test]
fn training_evaluates_every_k_steps_and_a_checkpoint_evaluates_the_same() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let data = fixtures().join("lr_schedule/tokens.npy");
    let held_out = fixtures().join("eval/tokens.npy");
    let lines = json_of(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "4",
        "--batch",
        "2",
        "--seq",
        "16",
        "--data",
        path(&data),
        "--eval-data",
        path(&held_out),
        "--eval-every",
        "2",
        "--eval-batches",
        "3",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "2",
        "--json",
    ]);
    let steps: Vec<&Value> = lines.iter().filter(|l| l.get("eval").is_none()).collect();
    let evals: Vec<&Value> = lines.iter().filter(|l| l.get("eval").is_some()).collect();
    assert_eq!(steps.len(), 4);
    let at: Vec<u64> = evals
        .iter()
        .map(|e| e["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(at, [2, 4]);
    for e in &evals {
        assert_eq!(e["eval"], path(&held_out));
        assert_eq!(e["batches"], 3);
        assert_eq!(e["tokens"], 96);
        let loss = e["loss"].as_f64().expect("loss");
        assert_eq!(e["ppl"].as_f64().expect("ppl"), loss.exp());
    }
    // The step records keep their fields.
    for key in ["step", "loss", "grad_norm", "lr", "tokens_per_s", "step_s"] {
        assert!(steps[0].get(key).is_some(), "{key} in {}", steps[0]);
    }
    // The checkpoint directory's newest checkpoint is step 4's weights.
    let e = json_of(&[
        "eval",
        "gpt2-tiny",
        "--init",
        path(&ckpt),
        "--data",
        path(&held_out),
        "--batches",
        "3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
    ])
    .remove(0);
    assert!(
        e["weights"]
            .as_str()
            .expect("weights")
            .contains("step-00000004"),
        "{}",
        e["weights"]
    );
    assert_eq!(
        e["loss"].as_f64().expect("loss").to_bits(),
        evals[1]["loss"].as_f64().expect("loss").to_bits(),
        "eval of the checkpoint {} against the run's {}",
        e["loss"],
        evals[1]["loss"]
    );
    // Under a tight budget, the evaluation schedule is set aside first and the training one
    // fits in the rest; the losses are the same bits.
    let tight = |budget: &str| {
        protrain(&[
            "train",
            "gpt2-tiny",
            "--steps",
            "4",
            "--batch",
            "2",
            "--seq",
            "16",
            "--data",
            path(&data),
            "--eval-data",
            path(&held_out),
            "--eval-every",
            "2",
            "--eval-batches",
            "3",
            "--gpu-memory",
            budget,
            "--json",
        ])
    };
    let out = tight("1200KiB");
    assert!(out.status.success(), "{}", stderr(&out));
    let bits = |lines: &[Value]| -> Vec<u64> {
        lines
            .iter()
            .map(|l| l["loss"].as_f64().expect("loss").to_bits())
            .collect()
    };
    assert_eq!(bits(&records(&out)), bits(&lines));
    assert!(
        stderr(&out).contains("evaluation      forward only"),
        "{}",
        stderr(&out)
    );
    let text = stderr(&tight("500KiB"));
    assert!(text.contains("with --eval-data, add the"), "{text}");
    // Without --json, the evaluations are lines of the table.
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--eval-data",
        path(&held_out),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("eval after step 2: loss "), "{text}");
    assert!(text.contains("perplexity"), "{text}");
}

#[test]
fn the_readme_text_corpus_run_evaluates_every_ten_steps() {
    let text = root().join("runtime/tests/fixtures/text");
    let dir = tempfile::tempdir().expect("temp dir");
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(text.join("corpus.txt"), &corpus).expect("copy the corpus");
    let tokenizer = text.join("tokenizer.json");
    let ckpt = dir.path().join("ckpt-text");
    // As the README's command, with --json.
    let lines = json_of(&[
        "train",
        "gpt2-tiny",
        "--data",
        path(&corpus),
        "--tokenizer",
        path(&tokenizer),
        "--batch",
        "4",
        "--seq",
        "32",
        "--steps",
        "20",
        "--eval-data",
        path(&corpus),
        "--eval-every",
        "10",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "10",
        "--json",
    ]);
    let evals: Vec<&Value> = lines.iter().filter(|l| l.get("eval").is_some()).collect();
    let at: Vec<u64> = evals
        .iter()
        .map(|e| e["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(at, [10, 20]);
    let loss = |e: &Value| e["loss"].as_f64().expect("loss");
    assert!(
        loss(evals[1]) < loss(evals[0]),
        "training on the corpus lowers its loss"
    );
    // `eval` of the checkpoint directory reads the text through the tokenizer as training did.
    let e = json_of(&[
        "eval",
        "gpt2-tiny",
        "--init",
        path(&ckpt),
        "--data",
        path(&corpus),
        "--tokenizer",
        path(&tokenizer),
        "--batch",
        "4",
        "--seq",
        "32",
        "--json",
    ])
    .remove(0);
    assert_eq!(e["batches"], evals[1]["batches"]);
    assert_eq!(
        loss(&e).to_bits(),
        loss(evals[1]).to_bits(),
        "eval of the checkpoint {} against the run's {}",
        e["loss"],
        evals[1]["loss"]
    );
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    for flag in [
        "--tokenizer runtime/tests/fixtures/text/tokenizer.json",
        "--eval-data runtime/tests/fixtures/text/corpus.txt",
        "--eval-every 10",
    ] {
        assert!(readme.contains(flag), "the README's example has {flag}");
    }
}

#[test]
fn a_forward_only_schedule_compiles_verifies_dumps_and_runs_beside_training() {
    let dir = tempfile::tempdir().expect("temp dir");
    let eval = dir.path().join("eval.ptsched");
    let training = dir.path().join("train.ptsched");
    let shape = ["--batch", "2", "--seq", "16", "--dtype", "f32"];
    let mut args = vec![
        "compile",
        "gpt2-tiny",
        "--forward-only",
        "--json",
        "-o",
        path(&eval),
    ];
    args.extend(shape);
    let out = protrain(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let c: Value = serde_json::from_str(&stdout(&out)).expect("one JSON object");
    assert_eq!(c["forward_only"], true);
    assert_eq!(c["phase_seconds"]["backward"], 0.0);
    let mut args = vec!["compile", "gpt2-tiny", "-o", path(&training)];
    args.extend(shape);
    let out = protrain(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = protrain(&["verify", path(&eval)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = protrain(&["dump", path(&eval), "--stage", "planned"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dump = stdout(&out);
    assert!(dump.contains("; forward only:"), "{dump}");
    assert!(
        !dump.contains("adamw") && !dump.contains("_backward"),
        "{dump}"
    );
    // `dump --forward-only` of the model stops at any stage.
    let out = protrain(&["dump", "gpt2-tiny", "--stage", "autodiff", "--forward-only"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains("adamw"));

    // `run` evaluates with the forward-only schedule given.
    let held_out = fixtures().join("eval/tokens.npy");
    let lines = json_of(&[
        "run",
        path(&training),
        "--steps",
        "2",
        "--eval-data",
        path(&held_out),
        "--eval-every",
        "1",
        "--eval-schedule",
        path(&eval),
        "--json",
    ]);
    assert_eq!(lines.iter().filter(|l| l.get("eval").is_some()).count(), 2);
    // Without it, `run` says how to make one.
    let text = refused(&["run", path(&training), "--eval-data", path(&held_out)]);
    assert!(
        text.contains("--forward-only") && text.contains("--eval-schedule"),
        "{text}"
    );
    // The evaluation schedule must be forward-only.
    let text = refused(&[
        "run",
        path(&training),
        "--eval-data",
        path(&held_out),
        "--eval-schedule",
        path(&training),
    ]);
    assert!(text.contains("forward-only"), "{text}");
    // A forward-only schedule is not a training schedule: `run` refuses to train with it.
    let text = refused(&["run", path(&eval), "--steps", "1"]);
    assert!(
        text.contains("forward-only schedule") && text.contains("protrain eval"),
        "{text}"
    );
}

#[test]
fn evaluation_refuses_bad_input_and_says_the_way_out() {
    let held_out = fixtures().join("eval/tokens.npy");
    let weights = fixtures().join("gpt2/model.safetensors");
    let gpt2 = fixtures().join("gpt2");
    let shape = ["--batch", "2", "--seq", "16"];
    // More batches than the data holds.
    let mut args = vec![
        "eval",
        path(&gpt2),
        "--init",
        path(&weights),
        "--data",
        path(&held_out),
        "--batches",
        "9",
    ];
    args.extend(shape);
    let text = refused(&args);
    assert!(text.contains("at most 4"), "{text}");
    // Weights of another model.
    let llama = fixtures().join("llama/model.safetensors");
    let mut args = vec![
        "eval",
        path(&gpt2),
        "--init",
        path(&llama),
        "--data",
        path(&held_out),
    ];
    args.extend(shape);
    let text = refused(&args);
    assert!(
        text.contains("missing") || text.contains("unexpected"),
        "{text}"
    );
    // Weights that are not there.
    let text = refused(&[
        "eval",
        "gpt2-tiny",
        "--init",
        "no/such/dir",
        "--data",
        path(&held_out),
    ]);
    assert!(text.contains("--init no/such/dir"), "{text}");
    // A forward-only policy that recomputes.
    let mut args = vec![
        "eval",
        path(&gpt2),
        "--init",
        path(&weights),
        "--data",
        path(&held_out),
        "--policy",
        "n_checkpoint=2",
    ];
    args.extend(shape);
    let text = refused(&args);
    assert!(text.contains("forward-only"), "{text}");
    // --eval-every 0 would never evaluate.
    let text = refused(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--eval-data",
        path(&held_out),
        "--eval-every",
        "0",
    ]);
    assert!(text.contains("--eval-every 0"), "{text}");
    // --eval-every needs --eval-data.
    let text = refused(&["train", "gpt2-tiny", "--eval-every", "5"]);
    assert!(text.contains("--eval-data"), "{text}");
}

/// Gradient accumulation and held-out evaluation together: the evaluation schedule is
/// compiled without the training's micro-batches.
#[test]
fn accumulation_and_held_out_evaluation_train_together() {
    let data = fixtures().join("lr_schedule/tokens.npy");
    let held_out = fixtures().join("eval/tokens.npy");
    let lines = json_of(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "2",
        "--data",
        path(&data),
        "--eval-data",
        path(&held_out),
        "--eval-batches",
        "2",
        "--json",
    ]);
    let evals: Vec<&Value> = lines.iter().filter(|l| l.get("eval").is_some()).collect();
    assert_eq!(evals.len(), 1, "{lines:?}");
    assert_eq!(evals[0]["step"], 2);
    assert_eq!(evals[0]["tokens"], 64);
}

/// `eval --eval-batches` is `train --eval-batches`; `--batches` stays as its alias.
#[test]
fn eval_and_train_share_the_eval_batches_flag() {
    let weights = fixtures().join("gpt2/model.safetensors");
    let model = fixtures().join("gpt2");
    let tokens = fixtures().join("gpt2/tokens.npy");
    for flag in ["--eval-batches", "--batches"] {
        let e = json_of(&[
            "eval",
            path(&model),
            "--init",
            path(&weights),
            "--data",
            path(&tokens),
            flag,
            "1",
            "--batch",
            "2",
            "--seq",
            "16",
            "--json",
        ]);
        assert_eq!(e[0]["batches"], 1, "{flag}");
    }
}

#[test]
fn mixture_of_experts_models_train_and_evaluate_on_the_host() {
    // The tiny Mixtral and Qwen3-MoE fixtures, with and without the load-balancing loss:
    // `train`'s first loss is `eval`'s of the same weights and batch, to the bit, and
    // PyTorch's step-0 loss (tests/fixtures/*/expected.json).
    for family in ["mixtral", "qwen3_moe", "mixtral_aux", "qwen3_moe_aux"] {
        let model = fixtures().join(family);
        let weights = model.join("model.safetensors");
        let tokens = model.join("tokens.npy");
        let expected: Value = serde_json::from_str(
            &std::fs::read_to_string(model.join("expected.json")).expect("expected.json"),
        )
        .expect("JSON");
        let torch = expected["losses"][0].as_f64().expect("a loss");
        let common = [
            path(&model),
            "--init",
            path(&weights),
            "--data",
            path(&tokens),
            "--batch",
            "2",
            "--seq",
            "16",
            "--json",
        ];
        let mut train = vec!["train"];
        train.extend(common);
        train.extend(["--steps", "2"]);
        let steps = json_of(&train);
        assert_eq!(steps.len(), 2, "{family}: {steps:?}");
        let mut eval = vec!["eval"];
        eval.extend(common);
        eval.extend(["--batches", "1"]);
        let e = &json_of(&eval)[0];
        assert_eq!(
            f32_bits(&steps[0]["loss"]),
            f32_bits(&e["loss"]),
            "{family}: train {} against eval {}",
            steps[0]["loss"],
            e["loss"]
        );
        let loss = e["loss"].as_f64().expect("loss");
        assert!(
            (loss - torch).abs() / torch < 1e-5,
            "{family}: {loss} vs PyTorch {torch}"
        );
    }
}
