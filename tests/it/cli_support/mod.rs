//! What the CLI tests share: running the `protrain` binary and reading what it printed.

mod steps;

pub use steps::{killed_after, losses};

use std::path::Path;
use std::process::{Command, Output};

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

/// The names of the files in `dir`, sorted; none when `dir` does not exist (a run that has
/// not written a checkpoint yet).
pub fn files(dir: &Path) -> Vec<String> {
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

/// A path as the argument it is given as.
pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
