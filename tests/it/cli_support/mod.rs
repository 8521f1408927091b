//! What the CLI tests share: running the `protrain` binary and reading what it printed.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// Runs the `protrain` binary built for these tests with `args`, to completion.
pub fn protrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(args)
        .output()
        .expect("the protrain binary runs")
}

/// What a run printed on standard output.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a run printed on standard error.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Compiles gpt2-tiny in f32 at batch 2 x seq 16, with `extra` flags, to `to`; fails the test
/// unless it succeeds, and returns the run for what it printed.
pub fn compile_gpt2_tiny(to: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "compile",
        "gpt2-tiny",
        "--dtype",
        "f32",
        "--batch",
        "2",
        "--seq",
        "16",
    ];
    args.extend(extra);
    args.extend(["-o", path(to)]);
    let out = protrain(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    out
}

/// `(step, loss as printed)` of one `--json` line: equal text is equal bits.
pub fn step_and_loss(line: &str) -> (u64, String) {
    let v: serde_json::Value = serde_json::from_str(line).expect("one JSON object per line");
    (v["step"].as_u64().expect("step"), v["loss"].to_string())
}

/// `(step, loss as printed)` of every `--json` line of a successful run.
pub fn losses(out: &Output) -> Vec<(u64, String)> {
    assert!(out.status.success(), "{}", stderr(out));
    stdout(out).lines().map(step_and_loss).collect()
}

/// Runs `protrain args` (which logs JSON lines) until it has printed step `step`, then kills
/// it with SIGKILL (`Child::kill` on Unix: no destructor, no flush, no clean-up runs) and
/// returns the steps and losses it printed.
pub fn killed_after(args: &[&str], step: u64) -> Vec<(u64, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the protrain binary starts");
    let lines = BufReader::new(child.stdout.take().expect("stdout"));
    let mut seen = Vec::new();
    for line in lines.lines() {
        let (at, loss) = step_and_loss(&line.expect("a line"));
        seen.push((at, loss));
        if at == step {
            break;
        }
    }
    child.kill().expect("kill the run");
    child.wait().expect("reap the run");
    seen
}

/// A path as the argument it is given as.
pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
