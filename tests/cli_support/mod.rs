//! What the CLI tests share: running the `protrain` binary and reading what it printed.
// Each test binary includes this module and uses part of it.
#![allow(dead_code)]

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

/// A path as the argument it is given as.
pub fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
