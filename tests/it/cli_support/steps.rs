//! The steps a `--json` run printed: each line's step and loss, and a run killed after a step.

use super::{stderr, stdout};
use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

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
