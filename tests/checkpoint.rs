//! Checkpoints as a user meets them: a killed run resumes bit-identically; a checkpoint of
//! another run is refused; a half-written checkpoint is ignored.

mod cli_support;
use cli_support::{path, protrain, stderr};

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// `(step, loss as printed)` of one `--log-json` line: the loss compared as text is compared
/// bit for bit.
fn step_and_loss(line: &str) -> (u64, String) {
    let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object per line");
    (v["step"].as_u64().expect("step"), v["loss"].to_string())
}

/// Every step's loss of a successful `--log-json` run.
fn losses(out: &Output) -> Vec<(u64, String)> {
    assert!(out.status.success(), "{}", stderr(out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(step_and_loss)
        .collect()
}

/// The checkpoint files in `dir`, by name.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The training run of these tests: 40 steps of gpt2-tiny, large enough that a step takes a
/// little while, so the kill lands inside one.
const RUN: [&str; 8] = [
    "train",
    "gpt2-tiny",
    "--steps",
    "40",
    "--batch",
    "8",
    "--seq",
    "128",
];

#[test]
fn a_run_killed_mid_step_resumes_bit_identically() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let mut args = RUN.to_vec();
    args.extend([
        "--log-json",
        "--save-every",
        "5",
        "--checkpoint-dir",
        path(&ckpt),
    ]);
    args.extend(["--keep-checkpoints", "0"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the protrain binary starts");
    let lines = BufReader::new(child.stdout.take().expect("stdout"));
    let mut seen = Vec::new();
    for line in lines.lines() {
        let (step, loss) = step_and_loss(&line.expect("a line"));
        seen.push((step, loss));
        if step == 12 {
            break;
        }
    }
    // `Child::kill` is SIGKILL on Unix: no destructor, no flush, no clean-up runs.
    child.kill().expect("kill the run");
    child.wait().expect("reap the run");
    assert_eq!(
        seen.last().map(|s| s.0),
        Some(12),
        "the run printed 12 steps"
    );
    let saved = files(&ckpt);
    assert!(
        saved.contains(&"step-00000010.safetensors".to_string()),
        "a checkpoint at step 10: {saved:?}"
    );

    // Resume under another policy: a checkpoint holds values, not offsets.
    let mut resume = RUN.to_vec();
    resume.extend(["--log-json", "--resume", path(&ckpt)]);
    resume.extend(["--policy", "n_persist=0,n_checkpoint=2"]);
    let resumed = losses(&protrain(&resume));
    let mut straight = RUN.to_vec();
    straight.push("--log-json");
    let straight = losses(&protrain(&straight));
    assert_eq!(straight.len(), 40);
    // The run may have saved step 15 before the kill arrived; it resumes from its latest.
    let from = resumed.first().expect("the resumed run trained").0;
    assert!(from == 11 || from == 16, "resumed at step {from}");
    assert_eq!(resumed.last().map(|s| s.0), Some(40));
    assert_eq!(
        resumed,
        straight[from as usize - 1..],
        "the resumed losses are the uninterrupted run's, bit for bit"
    );
    // And the killed run's own steps agree with the uninterrupted one's.
    assert_eq!(seen, straight[..12]);
}

#[test]
fn a_checkpoint_of_another_run_is_refused_naming_what_differs() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("llama");
    let out = protrain(&[
        "train",
        "llama-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "1",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let before = files(&ckpt);
    assert_eq!(
        before,
        ["step-00000001.safetensors", "step-00000002.safetensors"]
    );
    let cases: [(&str, Vec<&str>, &[&str]); 3] = [
        (
            "another model",
            vec!["gpt2-tiny", "--batch", "2", "--seq", "16"],
            &[
                "model: the checkpoint is of llama-tiny, this run trains gpt2-tiny",
                "missing: `transformer.wte.weight`",
            ],
        ),
        (
            "another batch shape",
            vec!["llama-tiny", "--batch", "4", "--seq", "16"],
            &["batch x seq: the checkpoint is 2 x 16, this run is 4 x 16"],
        ),
        (
            "another learning rate",
            vec!["llama-tiny", "--batch", "2", "--seq", "16", "--lr", "0.01"],
            &[
                "optimizer: the checkpoint has lr=0.003",
                "this run has lr=0.01",
            ],
        ),
    ];
    for (what, run, needles) in cases {
        let mut args = vec!["train"];
        args.extend(run);
        args.extend(["--steps", "4", "--log-json", "--resume", path(&ckpt)]);
        args.extend(["--save-every", "1"]);
        let out = protrain(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(err.starts_with("error: checkpoint "), "{what}: {err}");
        assert!(
            err.contains("was written by another training run"),
            "{what}: {err}"
        );
        assert!(
            err.contains("resume it with the model, batch, seq and optimizer"),
            "{what}: {err}"
        );
        for needle in needles {
            assert!(err.contains(needle), "{what}: no `{needle}` in {err}");
        }
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert!(out.stdout.is_empty(), "{what}: trained anyway");
        assert_eq!(files(&ckpt), before, "{what}: the checkpoints were touched");
    }
}

#[test]
fn a_half_written_checkpoint_is_ignored() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let short = [
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--log-json",
    ];
    let mut args = short.to_vec();
    args.extend([
        "--steps",
        "10",
        "--save-every",
        "5",
        "--checkpoint-dir",
        path(&ckpt),
    ]);
    losses(&protrain(&args));
    // What a save killed before its rename leaves: the start of a checkpoint, as `.tmp`.
    let whole = std::fs::read(ckpt.join("step-00000010.safetensors")).expect("step 10 saved");
    std::fs::write(
        ckpt.join("step-00000015.safetensors.tmp"),
        &whole[..whole.len() / 2],
    )
    .expect("write the leftover");

    let mut resume = short.to_vec();
    resume.extend(["--steps", "13", "--resume", path(&ckpt)]);
    let out = protrain(&resume);
    assert!(
        stderr(&out).contains("step-00000010.safetensors (step 10)"),
        "{}",
        stderr(&out)
    );
    let resumed = losses(&out);
    let mut straight = short.to_vec();
    straight.extend(["--steps", "13"]);
    let straight = losses(&protrain(&straight));
    assert_eq!(resumed, straight[10..]);
}
