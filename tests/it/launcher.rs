//! The launcher of `protrain train --backend cuda --gpus N` without a GPU: its workers are
//! probed (`PROTRAIN_WORKER_PROBE`: each writes its launch variables and exits before any CUDA
//! call), so these tests check the processes it starts, their variables, how it ends when a
//! worker fails, and its refusals of bad flags.

use crate::cli_support;

use cli_support::{path, stderr};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// torchrun's variables, which the tests' own environment must not pass on.
const LAUNCH_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Runs `protrain train gpt2-tiny --backend cuda` with `args`, its workers probed into `dir`,
/// with `env` set (and no other launch variable).
fn train(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_protrain"));
    command
        .args(["train", "gpt2-tiny", "--backend", "cuda", "--steps", "1"])
        .args(args)
        .env("PROTRAIN_WORKER_PROBE", dir);
    for var in LAUNCH_VARS {
        command.env_remove(var);
    }
    command.env_remove("PROTRAIN_WORKER_PROBE_FAIL");
    command.envs(env.iter().copied());
    command.output().expect("the protrain binary runs")
}

/// Every probed worker's variables, by rank.
fn probed(dir: &Path) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut workers = BTreeMap::new();
    for entry in std::fs::read_dir(dir).expect("the probe directory") {
        let file = entry.expect("an entry").path();
        let name = file.file_name().unwrap().to_str().unwrap().to_string();
        let rank: usize = name
            .strip_prefix("rank-")
            .and_then(|n| n.strip_suffix(".env"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a stray file {name}"));
        let vars = std::fs::read_to_string(&file)
            .expect("readable")
            .lines()
            .map(|l| {
                let (k, v) = l.split_once('=').expect("NAME=value");
                (k.to_string(), v.to_string())
            })
            .collect();
        workers.insert(rank, vars);
    }
    workers
}

#[test]
fn one_node_starts_a_worker_per_gpu_with_torchruns_variables() {
    let dir = tempfile::tempdir().unwrap();
    let out = train(dir.path(), &["--gpus", "3"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let workers = probed(dir.path());
    assert_eq!(workers.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    let port = &workers[&0]["MASTER_PORT"];
    assert_ne!(port.parse::<u16>().expect("a port"), 0);
    for (rank, vars) in &workers {
        assert_eq!(vars["RANK"], rank.to_string());
        assert_eq!(vars["LOCAL_RANK"], rank.to_string());
        assert_eq!(vars["WORLD_SIZE"], "3");
        assert_eq!(vars["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(&vars["MASTER_PORT"], port, "one rendezvous port for all");
    }
}

#[test]
fn a_node_of_several_starts_its_own_ranks_at_the_master() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--gpus",
        "2",
        "--nodes",
        "3",
        "--node-rank",
        "1",
        "--master",
        "127.0.0.1:29877",
    ];
    let out = train(dir.path(), &args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let workers = probed(dir.path());
    assert_eq!(workers.keys().copied().collect::<Vec<_>>(), [2, 3]);
    for (rank, vars) in &workers {
        assert_eq!(vars["LOCAL_RANK"], (rank - 2).to_string());
        assert_eq!(vars["WORLD_SIZE"], "6");
        assert_eq!(
            (vars["MASTER_ADDR"].as_str(), vars["MASTER_PORT"].as_str()),
            ("127.0.0.1", "29877")
        );
    }
}

#[test]
fn a_process_torchrun_started_is_a_worker_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29878"),
    ];
    let out = train(dir.path(), &["--gpus", "2"], &env);
    assert!(out.status.success(), "{}", stderr(&out));
    let workers = probed(dir.path());
    assert_eq!(workers.keys().copied().collect::<Vec<_>>(), [1]);
    assert_eq!(workers[&1]["MASTER_PORT"], "29878");
}

/// The other workers of the probe wait 600 s, as ranks blocked in a collective for a dead
/// peer would: the launcher must stop them and name the failed rank, well before that.
#[test]
fn a_failed_worker_stops_the_others_and_is_named_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let out = train(
        dir.path(),
        &["--gpus", "3"],
        &[("PROTRAIN_WORKER_PROBE_FAIL", "1")],
    );
    let took = started.elapsed();
    assert!(!out.status.success());
    assert!(took < Duration::from_secs(60), "the launcher took {took:?}");
    let e = stderr(&out);
    assert!(e.contains("worker of rank 1 (local rank 1) failed"), "{e}");
    assert!(e.contains("stopped the other 2"), "{e}");
    // The failed quiet worker's own error output is shown.
    assert!(
        e.contains("rank 1 failed as PROTRAIN_WORKER_PROBE_FAIL asked"),
        "{e}"
    );
}

#[test]
fn bad_launch_flags_name_the_flag_and_the_way_out() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--gpus", "0"],
            "--gpus 0: a node needs at least one worker",
        ),
        (
            &[
                "--gpus",
                "2",
                "--nodes",
                "2",
                "--node-rank",
                "2",
                "--master",
                "h:29500",
            ],
            "--node-rank 2 is not below --nodes 2",
        ),
        (
            &["--gpus", "2", "--nodes", "2", "--master", "node0"],
            "--master `node0` has no port",
        ),
        (&["--gpus", "2", "--nodes", "2"], "needs --master HOST:PORT"),
    ];
    for (args, expected) in cases {
        let out = train(dir.path(), args, &[]);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            stderr(&out).contains(expected),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    assert!(probed(dir.path()).is_empty(), "no worker started");
    let out = cli_support::protrain(&[
        "train",
        "gpt2-tiny",
        "--gpus",
        "2",
        "--node-rank",
        "0",
        "--data",
        path(dir.path()),
    ]);
    assert!(
        stderr(&out).contains("only --backend cuda"),
        "{}",
        stderr(&out)
    );
}

/// A multi-rank schedule on the CUDA backend is never run as threads of one process: `run`
/// without torchrun's variables says how to start one process per GPU.
#[test]
fn run_of_a_multi_rank_schedule_on_cuda_asks_for_one_process_per_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let schedule = dir.path().join("two.ptsched");
    let out = cli_support::protrain(&[
        "compile",
        "gpt2-tiny",
        "--gpus",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "-o",
        path(&schedule),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let mut command = Command::new(env!("CARGO_BIN_EXE_protrain"));
    command.args(["run", path(&schedule), "--backend", "cuda", "--steps", "1"]);
    for var in LAUNCH_VARS {
        command.env_remove(var);
    }
    let out = command.output().expect("the protrain binary runs");
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("2 processes, one per GPU") && e.contains("torchrun"),
        "{e}"
    );
}
