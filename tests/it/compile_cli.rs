//! `protrain compile`, `verify`, `explain` and `trace` as a user runs them.

use crate::cli_support;
use cli_support::{path, protrain, stderr, stdout};

use std::process::Output;

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "{}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("--json prints one JSON object")
}

const GIB: u64 = 1 << 30;

#[test]
fn llama_2_7b_on_an_rtx3090_keeps_some_chunks_and_streams_the_rest() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("llama.ptsched");
    let out = protrain(&[
        "compile",
        "llama-2-7b",
        "--hardware",
        "rtx3090",
        "--host-memory",
        "256GiB",
        "--batch",
        "4",
        "--seq",
        "1024",
        "-o",
        path(&file),
        "--json",
    ]);
    let v = json(&out);
    for key in [
        "policy",
        "predicted_step_s",
        "tokens_per_s",
        "peak_device_bytes",
        "lower_bound_bytes",
        "host_bytes",
        "compile_s",
    ] {
        assert!(!v[key].is_null(), "--json lacks {key}: {v}");
    }
    // 24 GiB less the profile's reserved GiB.
    assert!(
        v["peak_device_bytes"].as_u64().expect("bytes") <= 23 * GIB,
        "{v}"
    );
    let persist = v["n_persist"].as_u64().expect("n_persist");
    let chunks = v["chunks"].as_u64().expect("chunks");
    assert!(
        persist > 0 && persist < chunks,
        "some chunks persistent and the rest offloaded: {v}"
    );
    assert!(v["peak_device_bytes"].as_u64() >= v["lower_bound_bytes"].as_u64());

    let verified = protrain(&["verify", path(&file)]);
    assert!(verified.status.success(), "{}", stderr(&verified));
    assert!(String::from_utf8_lossy(&verified.stdout).contains("valid schedule for llama-2-7b"));

    let explained = json(&protrain(&["explain", path(&file), "--json"]));
    assert_eq!(explained["policy"], v["policy"]);
    assert!(
        explained["phase_seconds"]["recompute"]
            .as_f64()
            .expect("seconds")
            >= 0.0
    );

    let trace = dir.path().join("trace.json");
    let traced = protrain(&["trace", path(&file), "-o", path(&trace)]);
    assert!(traced.status.success(), "{}", stderr(&traced));
    let events: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written"))
            .expect("JSON");
    let events = events["traceEvents"].as_array().expect("traceEvents");
    assert!(events.iter().any(|e| e["name"]
        .as_str()
        .is_some_and(|n| n.starts_with("fetch chunk"))));
    assert!(events.iter().any(|e| e["cat"] == "cpu_adam"));
}

#[test]
fn a_budget_too_small_says_the_smallest_that_fits() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = protrain(&[
        "compile",
        "gpt2",
        "--hardware",
        "a100-80gb",
        "--gpu-memory",
        "64MiB",
        "--batch",
        "4",
        "-o",
        path(&dir.path().join("x.ptsched")),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    // The batch is split first; not even one-row micro-batches fit.
    assert!(
        err.starts_with(
            "error: batch 4 does not fit even as 4 micro-batches of 1 row, accumulated; at 1 \
             row: no policy fits 64.0 MiB of device memory"
        ),
        "{err}"
    );
    assert!(err.contains("Give --gpu-memory at least"), "{err}");
    // The CLI words the compiler's settings as its flags, never as their option fields.
    assert!(!err.contains("device_budget"), "{err}");
    assert!(
        !dir.path().join("x.ptsched").exists(),
        "nothing is written on error"
    );
}

#[test]
fn a_fixed_policy_is_applied_as_given() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("tiny.ptsched");
    let v = json(&protrain(&[
        "compile",
        "llama-tiny",
        "--dtype",
        "f32",
        "--seq",
        "32",
        "--policy",
        "n_persist=1,n_buffer=2,blocks=SC",
        "-o",
        path(&file),
        "--json",
    ]));
    assert_eq!(v["policy"], "n_persist=1 n_buffer=2 prefetch=1 blocks=SC");
    let bad = protrain(&[
        "compile",
        "llama-tiny",
        "--policy",
        "blocks=SCK",
        "-o",
        path(&file),
    ]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        stderr(&bad).contains("blocks= has 3 modes but the model has 2 layers"),
        "{}",
        stderr(&bad)
    );
    let bad = protrain(&[
        "compile",
        "llama-tiny",
        "--policy",
        "n_persist=1,speed=fast",
        "-o",
        path(&file),
    ]);
    assert!(
        stderr(&bad).contains("unknown key `speed`"),
        "{}",
        stderr(&bad)
    );
    // The policy as printed is accepted back, and compiles to the same policy.
    let printed = v["policy"]
        .as_str()
        .expect("the policy is printed")
        .to_string();
    let again = json(&protrain(&[
        "compile",
        "llama-tiny",
        "--dtype",
        "f32",
        "--seq",
        "32",
        "--policy",
        &printed,
        "-o",
        path(&file),
        "--json",
    ]));
    assert_eq!(again["policy"], printed.as_str());
    // A key given twice, or blocks with n_swap, is refused rather than one silently winning.
    for (policy, says) in [
        ("n_persist=1,n_persist=2", "n_persist is given twice"),
        ("blocks=KK,n_swap=1", "either blocks or n_swap/n_checkpoint"),
    ] {
        let bad = protrain(&[
            "compile",
            "llama-tiny",
            "--policy",
            policy,
            "-o",
            path(&file),
        ]);
        assert_eq!(bad.status.code(), Some(2), "{policy}");
        assert!(stderr(&bad).contains(says), "{policy}: {}", stderr(&bad));
    }
}

#[test]
fn a_schedule_compiled_with_the_defaults_runs_with_the_defaults() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("gpt2-tiny.ptsched");
    let compiled = protrain(&["compile", "gpt2-tiny", "-o", path(&file)]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let ran = protrain(&["run", path(&file), "--steps", "2", "--json"]);
    assert!(ran.status.success(), "{}", stderr(&ran));
    assert_eq!(String::from_utf8_lossy(&ran.stdout).lines().count(), 2);
    // A bf16 schedule runs on the host backend too (bf16 storage, f32 arithmetic).
    let bf16 = dir.path().join("bf16.ptsched");
    let compiled = protrain(&["compile", "gpt2-tiny", "--dtype", "bf16", "-o", path(&bf16)]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let ran = protrain(&["run", path(&bf16), "--steps", "1", "--json"]);
    assert!(ran.status.success(), "{}", stderr(&ran));
    assert_eq!(String::from_utf8_lossy(&ran.stdout).lines().count(), 1);
}

/// Sizes and checksums change whenever the schedule does; the snapshot keeps the words.
fn redact_numbers(text: &str) -> String {
    let mut out = String::new();
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String| {
        let is_hex = token.starts_with("0x") && token.len() > 2;
        let is_big = token.len() >= 3 && token.chars().all(|c| c.is_ascii_digit());
        out.push_str(if is_hex {
            "0x…"
        } else if is_big {
            "N"
        } else {
            token
        });
        token.clear();
    };
    for c in text.chars() {
        if c.is_ascii_alphanumeric() {
            token.push(c);
        } else {
            flush(&mut token, &mut out);
            out.push(c);
        }
    }
    flush(&mut token, &mut out);
    out
}

#[test]
fn broken_schedule_files_are_refused_clearly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("tiny.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--dtype",
        "f32",
        "--seq",
        "32",
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bytes = std::fs::read(&file).expect("written");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", bytes[..bytes.len() / 2].to_vec()),
        ("corrupted", {
            let mut b = bytes.clone();
            let i = b.len() / 2;
            b[i] ^= 0x5a;
            b
        }),
        ("foreign", b"{\"not\": \"a schedule\"}".to_vec()),
        ("newer", {
            let mut b = bytes.clone();
            b[8] = b[8].wrapping_add(1);
            b
        }),
    ];
    let mut report = String::new();
    for (what, data) in cases {
        let broken = dir.path().join(format!("{what}.ptsched"));
        std::fs::write(&broken, data).expect("write");
        let out = protrain(&["verify", path(&broken)]);
        assert_eq!(out.status.code(), Some(2), "{what}: {}", stderr(&out));
        let err = redact_numbers(&stderr(&out).replace(path(dir.path()), "<dir>"));
        assert!(!err.contains("panicked"), "{what}: {err}");
        report.push_str(&format!("{what}:\n  {err}"));
    }
    insta::assert_snapshot!(report);
}

#[test]
fn explain_on_other_hardware_shows_only_that_hardwares_figures_and_dump_refuses_hardware() {
    let dir = tempfile::tempdir().expect("temp dir");
    // The same schedule compiled for two machines (a fixed policy, no fusion: nothing
    // depends on the hardware), so explaining one on the other's hardware must print every
    // figure the other's explain prints.
    let compile = |hardware: &str| {
        let file = dir.path().join(format!("{hardware}.ptsched"));
        let compiled = protrain(&[
            "compile",
            "gpt2-tiny",
            "--hardware",
            hardware,
            "--no-fuse",
            "--policy",
            "n_persist=1",
            "-o",
            path(&file),
        ]);
        assert!(compiled.status.success(), "{}", stderr(&compiled));
        file
    };
    let (file, h100) = (compile("rtx3090"), compile("h100"));
    let same = String::from_utf8_lossy(&protrain(&["explain", path(&file)]).stdout).to_string();
    assert!(
        same.lines().next().unwrap().contains("on rtx3090:"),
        "{same}"
    );
    let out = protrain(&["explain", path(&file), "--hardware", "h100"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let first = text.lines().next().expect("a first line");
    assert!(first.contains("on h100: "), "{text}");
    assert!(first.ends_with("compiled for rtx3090"), "{text}");
    assert!(
        !first.contains("24.00 GiB"),
        "the rtx3090's figures are not shown: {text}"
    );
    // The search's report is in the rtx3090's times: left out, and said so.
    assert!(
        text.contains("with rtx3090's times, left out here"),
        "{text}"
    );
    let native = stdout(&protrain(&["explain", path(&h100)]));
    // Every line with a figure: memory, the peak's parts, time, what bounds the step, time by
    // kind, and each stream's.
    let figures = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                [
                    "memory ",
                    "         at the peak",
                    "time ",
                    "bound by ",
                    "by kind ",
                    "  ",
                ]
                .iter()
                .any(|p| l.starts_with(p))
            })
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        figures(&text),
        figures(&native),
        "explain --hardware h100 against h100's own:\n{text}\n{native}"
    );
    assert!(figures(&text).len() >= 7, "{text}");
    assert!(text.contains("bound by "), "{text}");
    let other = json(&protrain(&[
        "explain",
        path(&file),
        "--hardware",
        "h100",
        "--json",
    ]));
    let native_json = json(&protrain(&["explain", path(&h100), "--json"]));
    assert_eq!(other["hardware"], "h100");
    assert_eq!(other["compiled_for"], "rtx3090");
    assert!(other["report"].is_null(), "{other}");
    for key in [
        "hardware_summary",
        "predicted_step_s",
        "phase_seconds",
        "streams",
        "bound_by",
        "critical_path",
        "usable_device_bytes",
        "memory",
        "exposed_communication_s",
    ] {
        assert_eq!(other[key], native_json[key], "{key}");
    }
    // dump prints a schedule as compiled: a hardware flag would be silently meaningless.
    let refused = protrain(&[
        "dump",
        path(&file),
        "--stage",
        "planned",
        "--hardware",
        "h100",
    ]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(
        stderr(&refused).contains("protrain explain"),
        "{}",
        stderr(&refused)
    );
}

#[test]
fn explain_says_what_bounds_the_step_and_what_twice_as_fast_would_give() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("streamed.ptsched");
    // Every chunk streamed on an rtx3090: the CPU Adam, which updates every parameter on
    // the host after the backward pass, bounds it (76% of the step), not the kernels.
    let compiled = protrain(&[
        "compile",
        "gpt2",
        "--hardware",
        "rtx3090",
        "--policy",
        "n_persist=0 n_buffer=2",
        "-o",
        path(&file),
    ]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let v = json(&protrain(&["explain", path(&file), "--json"]));
    let step = v["predicted_step_s"].as_f64().expect("a step");
    let by = &v["bound_by"];
    assert_eq!(by["resource"], "cpu_adam", "{v}");
    let share = by["share"].as_f64().expect("a share");
    assert!(share > 0.5 && share <= 1.0, "{v}");
    let faster = by["step_if_twice_as_fast_s"].as_f64().expect("a step");
    assert!(faster < step * 0.9 && faster >= step / 2.0 - 1e-9, "{v}");
    // The critical path accounts for the step: the shares add up to it.
    let path_s: f64 = v["critical_path"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r["critical_s"].as_f64().expect("seconds"))
        .sum();
    assert!(
        (path_s - step).abs() <= step * 1e-6,
        "{path_s} of {step}: {v}"
    );
    assert_eq!(v["critical_path"][0], *by);
    let compute = v["critical_path"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["resource"] == "compute")
        .expect("compute is on the path");
    assert!(
        compute["step_if_twice_as_fast_s"].as_f64().unwrap() > faster,
        "{v}"
    );
    let text = stdout(&protrain(&["explain", path(&file)]));
    let line = text
        .lines()
        .find(|l| l.starts_with("bound by CPU Adam: "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(&format!("{faster:.4} s")), "{line}");
    assert!(
        text.contains("ties     among policies predicted within 0.5%"),
        "{text}"
    );
    // With accumulation the first micro-batch is simulated once and counted per micro-batch:
    // the path through it counts as often, and still adds up to the step.
    let accumulated = dir.path().join("accumulated.ptsched");
    let compiled = protrain(&[
        "compile",
        "gpt2",
        "--hardware",
        "rtx3090",
        "--policy",
        "n_persist=0 n_buffer=2",
        "--grad-accum",
        "3",
        "-o",
        path(&accumulated),
    ]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let v = json(&protrain(&["explain", path(&accumulated), "--json"]));
    let step = v["predicted_step_s"].as_f64().expect("a step");
    let path_s: f64 = v["critical_path"]
        .as_array()
        .expect("resources")
        .iter()
        .map(|r| r["critical_s"].as_f64().expect("seconds"))
        .sum();
    assert!(
        (path_s - step).abs() <= step * 1e-6,
        "{path_s} of {step}: {v}"
    );
}

#[test]
fn train_takes_the_host_memory_budget() {
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "1",
        "--host-memory",
        "1KiB",
        "--gpu-memory",
        "4MiB",
        "--grad-accum",
        "1",
        "--json",
    ]);
    // 1 KiB of host memory cannot hold the offloaded chunks a 4 MiB device needs at batch 8
    // (kept in one micro-batch: split in two, every chunk would fit the device).
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("host"), "{}", stderr(&out));
}

#[test]
fn throughput_counts_every_rank_and_micro_batch_of_a_step() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("gpt2.ptsched");
    // (extra flags, ranks, micro-batches): a step of B x T tokens per micro-batch per rank.
    let cases: [(&[&str], u64, u64); 3] = [
        (&[], 1, 1),
        (&["--grad-accum", "3"], 1, 3),
        (&["--gpus", "2", "--grad-accum", "2"], 2, 2),
    ];
    for (extra, ranks, micro_batches) in cases {
        let mut args = vec![
            "compile",
            "gpt2",
            "--hardware",
            "rtx3090",
            "--batch",
            "2",
            "--seq",
            "128",
            "-o",
        ];
        args.push(path(&file));
        args.push("--json");
        args.extend_from_slice(extra);
        let v = json(&protrain(&args));
        assert_eq!(v["ranks"], ranks, "{extra:?}: {v}");
        assert_eq!(v["micro_batches"], micro_batches, "{extra:?}: {v}");
        let tokens = v["tokens_per_s"].as_f64().expect("tokens_per_s")
            * v["predicted_step_s"].as_f64().expect("predicted_step_s");
        let expected = (ranks * micro_batches * 2 * 128) as f64;
        assert!(
            (tokens - expected).abs() < 1e-6 * expected,
            "{extra:?}: a step trains {expected} tokens, the rate says {tokens}: {v}"
        );
    }
}

/// The disk tier from the command line: a fixed policy over its host budget is refused with
/// `--disk-memory` among the ways out; with it, the compile, `verify` and `explain` all say
/// how much state lives on disk.
#[test]
fn a_policy_over_host_memory_compiles_with_a_disk_tier() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("disk.ptsched");
    let base = [
        "compile",
        "gpt2-tiny",
        "--batch",
        "8",
        "--seq",
        "128",
        "--policy",
        "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1",
        // One micro-batch (split, the swapped activations would shrink to fit).
        "--grad-accum",
        "1",
        "--host-memory",
        "5632KiB",
        "-o",
        path(&file),
    ];
    let refused = protrain(&base);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("--disk-memory SIZE"),
        "{}",
        stderr(&refused)
    );

    let mut args = base.to_vec();
    args.extend(["--disk-memory", "64MiB", "--json"]);
    let v = json(&protrain(&args));
    let disk = v["disk_bytes"].as_u64().expect("disk_bytes");
    assert!(disk > 0 && disk <= 64 << 20, "{v}");
    assert!(v["disk_chunks"].as_u64() > Some(0), "{v}");

    let verified = protrain(&["verify", path(&file)]);
    assert!(verified.status.success(), "{}", stderr(&verified));
    assert!(
        String::from_utf8_lossy(&verified.stdout).contains(", disk "),
        "verify names the disk region: {}",
        String::from_utf8_lossy(&verified.stdout)
    );
    let explained = json(&protrain(&["explain", path(&file), "--json"]));
    assert_eq!(explained["disk_bytes"].as_u64(), Some(disk), "{explained}");
}

/// Among candidates that tie on step time, the search takes the one with the least state on
/// disk: here one policy needs the disk tier and others, as fast, do not; the report lists
/// the disk candidate's disk bytes and the winner has none.
#[test]
fn a_tie_goes_to_the_candidate_without_a_disk_tier() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("tie.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--batch",
        "8",
        "--seq",
        "128",
        "--gpu-memory",
        "8MiB",
        "--host-memory",
        "2MiB",
        "--disk-memory",
        "64MiB",
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v = json(&protrain(&["explain", path(&file), "--json"]));
    assert_eq!(v["disk_bytes"].as_u64(), Some(0), "{v}");
    let report = v["report"].as_str().expect("report");
    let candidates: Vec<&str> = report.lines().filter(|l| l.contains("simulated")).collect();
    assert!(
        candidates[0].starts_with("  * ") && !candidates[0].contains("disk"),
        "{report}"
    );
    assert!(
        candidates[1..].iter().any(|l| l.contains("  disk ")),
        "some candidate needed the disk tier: {report}"
    );
}

#[test]
fn every_printing_command_takes_json_and_dash_writes_standard_output() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("tiny.ptsched");
    cli_support::compile_gpt2_tiny(&file, &[]);

    // verify and trace print JSON.
    let v = json(&protrain(&["verify", path(&file), "--json"]));
    assert_eq!(v["valid"], true);
    assert_eq!(v["model"], "gpt2-tiny");
    assert!(v["arena_bytes"].as_u64().expect("bytes") > 0);
    let trace = dir.path().join("trace.json");
    let v = json(&protrain(&[
        "trace",
        path(&file),
        "-o",
        path(&trace),
        "--json",
    ]));
    assert!(v["spans"].as_u64().expect("count") > 0, "{v}");
    assert!(trace.is_file());

    // `trace -o -` writes the trace on standard output, and no file named `-`.
    let cwd = tempfile::tempdir().expect("temp dir");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(["trace", path(&file), "-o", "-"])
        .current_dir(cwd.path())
        .output()
        .expect("runs");
    let events = json(&out);
    assert!(events["traceEvents"]
        .as_array()
        .is_some_and(|e| !e.is_empty()));
    assert!(
        !cwd.path().join("-").exists(),
        "`-o -` wrote a file named -"
    );

    // `compile -o -` writes the schedule on standard output: it reads back as the same file.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args([
            "compile",
            "gpt2-tiny",
            "--dtype",
            "f32",
            "--batch",
            "2",
            "--seq",
            "16",
            "-o",
            "-",
        ])
        .current_dir(cwd.path())
        .output()
        .expect("runs");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        !cwd.path().join("-").exists(),
        "`-o -` wrote a file named -"
    );
    let piped = dir.path().join("piped.ptsched");
    std::fs::write(&piped, &out.stdout).expect("write");
    let a = protrain::ir::file::read(&piped).expect("stdout holds a schedule");
    let b = protrain::ir::file::read(&file).expect("schedule");
    assert_eq!(a.header.policy, b.header.policy);

    // `compile --dry-run` prints the plan and writes nothing.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(["compile", "gpt2-tiny", "--dry-run", "--json"])
        .current_dir(cwd.path())
        .output()
        .expect("runs");
    let v = json(&out);
    assert!(v["schedule"].is_null(), "{v}");
    assert!(v["policy"].is_string());
    assert_eq!(
        std::fs::read_dir(cwd.path()).expect("dir").count(),
        0,
        "a dry run writes nothing"
    );
    let out = protrain(&["compile", "gpt2-tiny", "--dry-run"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("not written (--dry-run)"));

    // `dump FILE.ptsched` prints the planned stage without being told.
    let plain = protrain(&["dump", path(&file)]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let planned = protrain(&["dump", path(&file), "--stage", "planned"]);
    assert_eq!(plain.stdout, planned.stdout);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(["dump", path(&file), "-o", "-"])
        .current_dir(cwd.path())
        .output()
        .expect("runs");
    assert_eq!(out.stdout, plain.stdout);
    assert!(
        !cwd.path().join("-").exists(),
        "`-o -` wrote a file named -"
    );
}

#[test]
fn budgets_say_what_they_are_per_and_errors_quote_the_figures_given() {
    let help = stdout(&protrain(&["compile", "--help"]));
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(flat.contains("on each GPU (a budget per GPU"), "{help}");
    assert!(flat.contains("Host memory of each node"), "{help}");
    assert!(
        flat.contains("with --gpus N its N ranks share it"),
        "{help}"
    );
    assert!(flat.contains("Disk of each node"), "{help}");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("two.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        "h100",
        "--gpus",
        "2",
        "--host-memory",
        "64GiB",
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = stdout(&out);
    assert!(plan.contains("budget per GPU"), "{plan}");
    assert!(
        plan.contains(
            "of 32.00 GiB per rank (the node's 64.00 GiB of --host-memory shared by --gpus 2)"
        ),
        "{plan}"
    );
    // Host memory too small for the ranks of a node: the error quotes the node's figure as
    // given, each rank's share, and the node's figure that would fit.
    let out = protrain(&[
        "compile",
        "gpt2-xl",
        "--hardware",
        "h100",
        "--gpus",
        "2",
        "--gpu-memory",
        "6GiB",
        "--host-memory",
        "8GiB",
        "-o",
        path(&file),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.starts_with("error: no policy fits 4.00 GiB of host memory per rank"),
        "{err}"
    );
    assert!(
        err.contains("--host-memory 8.00 GiB over --gpus 2 gives each rank 4.00 GiB"),
        "{err}"
    );
    assert!(
        err.contains("--gpu-memory is per GPU; --host-memory and --disk-memory are per node"),
        "{err}"
    );
    // Sharded ranks take the disk tier for their state shards: the disk is a way out too.
    assert!(err.contains("; or --disk-memory at least "), "{err}");
    let need = err
        .split("Give --host-memory (per node, for its 2 ranks) at least ")
        .nth(1)
        .and_then(|rest| rest.split([',', ';']).next())
        .unwrap_or_else(|| panic!("{err}"));
    // The node's figure it quotes fits.
    let bytes = protrain::size::parse_size(&need.replace(' ', "")).expect("a size") + (64 << 20);
    let out = protrain(&[
        "compile",
        "gpt2-xl",
        "--hardware",
        "h100",
        "--gpus",
        "2",
        "--gpu-memory",
        "6GiB",
        "--host-memory",
        &bytes.to_string(),
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{need}: {}", stderr(&out));
}

#[test]
fn a_gpu_memory_over_the_device_is_refused_naming_its_capacity() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        "rtx3090",
        "--gpu-memory",
        "100GiB",
        "-o",
        path(&dir.path().join("x.ptsched")),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.starts_with("error: --gpu-memory 100.0 GiB is more than the rtx3090 device has"),
        "{err}"
    );
    assert!(err.contains("24.00 GiB of device memory"), "{err}");
    assert!(err.contains("give --gpu-memory 23.00 GiB or less"), "{err}");
    assert!(!dir.path().join("x.ptsched").exists());
    // All of it is allowed.
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        "rtx3090",
        "--gpu-memory",
        "23GiB",
        "-o",
        path(&dir.path().join("x.ptsched")),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn out_of_memory_names_the_ways_out_and_never_contradicts_itself() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("x.ptsched");
    let compile = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            "gpt2-xl",
            "--hardware",
            "rtx3090",
            "--gpu-memory",
            "6GiB",
            "-o",
            path(&file),
        ];
        args.extend(extra);
        protrain(&args)
    };
    // Clipping keeps chunks from being staged: the policy and its bytes per parameter agree.
    let out = compile(&["--host-memory", "8GiB", "--grad-clip", "1.0"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(!err.contains("host_layout=12, 14 bytes"), "{err}");
    assert!(
        err.contains("host_layout=14, 14 bytes per parameter"),
        "{err}"
    );
    assert!(err.contains("or --disk-memory at least "), "{err}");
    assert!(err.contains("--nodes M with --gpus N"), "{err}");
    // The disk tier given: the least host memory quoted is the one with it, and it fits.
    // (2 GiB fits with the parameters of some chunks on disk; 256 MiB does not hold even the
    // staging buffers of one chunk's state.)
    let out = compile(&["--host-memory", "256MiB", "--disk-memory", "1TiB"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("That is with the disk tier"), "{err}");
    let need = err
        .split("Give --host-memory at least ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("{err}"));
    let bytes = protrain::size::parse_size(&need.replace(' ', "")).expect("a size") + (16 << 20);
    let out = compile(&["--host-memory", &bytes.to_string(), "--disk-memory", "1TiB"]);
    assert!(out.status.success(), "{need}: {}", stderr(&out));
    assert!(stdout(&out).contains("\ndisk "), "{}", stdout(&out));
    // A batch that does not fit the device in the split given (--grad-accum keeps it):
    // gradient accumulation is the way out.
    let out = protrain(&[
        "compile",
        "gpt2",
        "--hardware",
        "a100-80gb",
        "--gpu-memory",
        "64MiB",
        "--grad-accum",
        "1",
        "--batch",
        "4",
        "-o",
        path(&file),
    ]);
    let err = stderr(&out);
    assert!(
        err.contains("--batch 2 with twice the --grad-accum"),
        "{err}"
    );
}

/// The published configs of every dense family (models/tests/real-configs) compile for a 24 GiB card at batch 1
/// x 1024 tokens, fit it, and verify; Phi-3 mini 128k also at 8192 tokens, where it takes its
/// LongRoPE long factors. Gemma-2-9B's tied embedding (256000 x 3584 = 917M parameters, 18
/// times its largest layer weight) is a chunk of its own: with every chunk sized to it, two
/// chunk buffers and the gradients alive beside them would not fit.
#[test]
fn published_configs_of_every_family_compile_for_an_rtx3090() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (name, seq) in [
        ("qwen2.5-0.5b", "1024"),
        ("qwen2.5-7b", "1024"),
        ("qwen3-0.6b", "1024"),
        ("qwen3-8b", "1024"),
        ("gemma-2-2b", "1024"),
        ("gemma-2-9b", "1024"),
        ("gemma-3-1b", "1024"),
        ("gemma-3-4b", "1024"),
        ("phi-3-mini-4k", "1024"),
        ("phi-3-mini-128k", "1024"),
        ("phi-3-mini-128k", "8192"),
        ("olmo-2-1b", "1024"),
    ] {
        let config = format!(
            "{}/models/tests/real-configs/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let file = dir.path().join(format!("{name}-{seq}.ptsched"));
        let out = protrain(&[
            "compile",
            &config,
            "--hardware",
            "rtx3090",
            "--host-memory",
            "256GiB",
            "--batch",
            "1",
            "--seq",
            seq,
            "-o",
            path(&file),
            "--json",
        ]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let v = json(&out);
        assert!(
            v["peak_device_bytes"].as_u64().expect("bytes") <= 23 * GIB,
            "{name}: {v}"
        );
        let verified = protrain(&["verify", path(&file)]);
        assert!(verified.status.success(), "{name}: {}", stderr(&verified));
    }
}

/// `explain` says what the disk tier moves per step and what it costs, in text and in JSON:
/// the bytes read and written, the seconds of disk i/o and the part of them not hidden.
#[test]
fn explain_shows_the_disk_tiers_bytes_and_time_per_step() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("disk.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--hardware",
        "rtx3090",
        "--batch",
        "8",
        "--seq",
        "128",
        "--policy",
        "n_persist=0,n_buffer=2,n_swap=1,n_checkpoint=1",
        "--host-memory",
        "3MiB",
        "--disk-memory",
        "64MiB",
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&protrain(&["explain", path(&file)]));
    let lines: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("disk "))
        .take(2)
        .collect();
    let v = json(&protrain(&["explain", path(&file), "--json"]));
    assert!(v["disk"]["read_bytes_per_step"].as_u64() > Some(0), "{v}");
    let disk = serde_json::to_string_pretty(&v["disk"]).expect("JSON");
    insta::assert_snapshot!(format!("{}\n{disk}", lines.join("\n")));
}

/// `--global-batch` compiles every split of the rows and keeps the fastest predicted step,
/// saying why, in the text and JSON of `compile` and in `explain` (the report heads the
/// schedule's): on an RTX 3090 at 64 tokens one micro-batch of 8 rows is fastest; at 256
/// tokens in 16 MiB, 8 rows must recompute both layers where 4 keep them, and 2 micro-batches
/// of 4 rows win.
#[test]
fn global_batch_picks_the_fastest_split_and_says_why() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut shown = String::new();
    for (extra, k) in [
        (&["--seq", "64"][..], 1),
        (&["--seq", "256", "--gpu-memory", "16MiB"][..], 2),
    ] {
        let mut args = vec![
            "compile",
            "gpt2-tiny",
            "--hardware",
            "rtx3090",
            "--dtype",
            "f32",
            "--global-batch",
            "8",
            "--dry-run",
        ];
        args.extend_from_slice(extra);
        let out = protrain(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        let text = stdout(&out);
        let split: Vec<&str> = text
            .lines()
            .skip_while(|l| !l.starts_with("split:"))
            .take_while(|l| l.starts_with("split:") || l.starts_with("  "))
            .collect();
        assert_eq!(split.len(), 5, "{text}");
        shown.push_str(&format!("{extra:?}\n{}\n", split.join("\n")));
        args.push("--json");
        let v = json(&protrain(&args));
        assert_eq!(v["micro_batches"], k, "{v}");
        assert_eq!(v["batch"], 8 / k, "{v}");
        assert_eq!(v["split"]["micro_batches"], k, "{v}");
        assert_eq!(v["split"]["why"], "fastest", "{v}");
        let tried = v["split"]["tried"].as_array().expect("tried");
        let fastest = tried
            .iter()
            .filter_map(|t| t["predicted_step_s"].as_f64().map(|s| (s, t)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("a split fits");
        assert_eq!(fastest.1["micro_batches"], k, "{v}");
        // The schedule written says the same in its report, which `explain` prints.
        let file = dir.path().join(format!("k{k}.ptsched"));
        let mut write: Vec<&str> = args
            .iter()
            .copied()
            .filter(|a| !matches!(*a, "--dry-run" | "--json"))
            .collect();
        write.extend(["-o", path(&file)]);
        assert!(protrain(&write).status.success());
        let explained = json(&protrain(&["explain", path(&file), "--json"]));
        let report = explained["report"].as_str().expect("the report");
        assert!(report.starts_with("split: global batch 8: "), "{report}");
    }
    insta::assert_snapshot!(shown);
}

/// `--global-batch` refuses nonsense: zero rows, rows the ranks cannot share, and the flags
/// that set the split themselves; a batch that does not fit even as one-row micro-batches
/// says so and what one row needs.
#[test]
fn global_batch_and_split_refusals_name_the_way_out() {
    let mut shown = String::new();
    for extra in [
        &["--global-batch", "0"][..],
        &["--global-batch", "3", "--gpus", "2"][..],
        &["--global-batch", "8", "--batch", "2"][..],
        &["--global-batch", "8", "--grad-accum", "2"][..],
        &["--global-batch", "8", "--batch", "2", "--grad-accum", "4"][..],
        &["--batch", "8", "--gpu-memory", "100KiB"][..],
    ] {
        let mut args = vec!["compile", "gpt2-tiny", "--hardware", "rtx3090", "--dry-run"];
        args.extend_from_slice(extra);
        let out = protrain(&args);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        shown.push_str(&format!("{extra:?}\n{}", stderr(&out)));
    }
    insta::assert_snapshot!(shown);
}

/// The tiny Mixtral fixture (2 layers of 4 experts, 3 weights of 48 x 32 each) with one chunk
/// on the device and the rest streamed: `explain` says where the expert bytes live, in text
/// and in JSON, and a dense model has no experts line.
#[test]
fn explain_says_where_the_expert_weights_live() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("mixtral.ptsched");
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mixtral");
    let compiled = protrain(&[
        "compile",
        fixture,
        "--dtype",
        "f32",
        "--batch",
        "2",
        "--seq",
        "16",
        "--policy",
        "n_persist=1,n_buffer=2",
        "-o",
        path(&file),
    ]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    let v = json(&protrain(&["explain", path(&file), "--json"]));
    let e = &v["experts"];
    let n = |k: &str| {
        e[k].as_u64()
            .unwrap_or_else(|| panic!("experts.{k} in {e}"))
    };
    assert_eq!(n("tensors"), 2 * 4 * 3, "{e}");
    // f32 weights: every expert byte is either on the device or in host memory.
    assert_eq!(
        n("persistent_bytes") + n("streamed_bytes"),
        2 * 4 * 3 * 48 * 32 * 4,
        "{e}"
    );
    assert!(
        n("streamed_bytes") > 0,
        "with one chunk kept, experts stream: {e}"
    );
    assert!(n("chunks") >= 1, "{e}");
    let text = stdout(&protrain(&["explain", path(&file)]));
    let line = text
        .lines()
        .find(|l| l.starts_with("experts"))
        .unwrap_or_else(|| panic!("no experts line:\n{text}"));
    assert!(
        line.starts_with(&format!(
            "experts  24 weights, 144.0 KiB in {} chunks",
            n("chunks")
        )) && line.contains("in host memory (fetched into the chunk buffers before use)"),
        "{line}"
    );

    let dense = dir.path().join("llama.ptsched");
    let compiled = protrain(&["compile", "llama-tiny", "-o", path(&dense)]);
    assert!(compiled.status.success(), "{}", stderr(&compiled));
    assert!(json(&protrain(&["explain", path(&dense), "--json"]))["experts"].is_null());
    let text = stdout(&protrain(&["explain", path(&dense)]));
    assert!(!text.lines().any(|l| l.starts_with("experts")), "{text}");
}

/// The two large mixture-of-experts presets compile for the machines the issue names and
/// verify, and `explain` says where their expert bytes live (about 50 s and 15 s in a debug
/// build: translation validation is linear in the graphs).
fn compiles_and_verifies(preset: &str, hardware: &str, host: &str, weights: u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("moe.ptsched");
    let compiled = protrain(&[
        "compile",
        preset,
        "--hardware",
        hardware,
        "--host-memory",
        host,
        "-o",
        path(&file),
    ]);
    assert!(compiled.status.success(), "{preset}: {}", stderr(&compiled));
    let verified = protrain(&["verify", path(&file)]);
    assert!(verified.status.success(), "{preset}: {}", stderr(&verified));
    assert!(stdout(&verified).contains(&format!("valid schedule for {preset}")));
    let v = json(&protrain(&["explain", path(&file), "--json"]));
    assert_eq!(v["experts"]["tensors"].as_u64(), Some(weights), "{preset}");
    assert!(
        v["experts"]["streamed_bytes"].as_u64() > Some(0),
        "{preset}"
    );
}

#[test]
fn qwen3_30b_a3b_compiles_for_one_rtx3090_with_512_gib_of_host_memory_and_verifies() {
    // 48 sparse layers of 128 experts, three weights each.
    compiles_and_verifies("qwen3-30b-a3b", "rtx3090", "512GiB", 48 * 128 * 3);
}

#[test]
fn mixtral_8x7b_compiles_for_one_h200_with_1_tib_of_host_memory_and_verifies() {
    compiles_and_verifies("mixtral-8x7b", "h200", "1TiB", 32 * 8 * 3);
}

/// GPT-3 175B compiles for one RTX 4090 with 256 GiB of host memory and 4 TiB of disk: the
/// optimizer state of every chunk and the parameters of some go to disk, the schedule
/// verifies, and the search's estimate is within 25% of the simulated step, the disk's time
/// priced in it (about 35 s in a debug build).
#[test]
fn gpt3_175b_compiles_for_one_rtx4090_with_256_gib_of_host_and_4_tib_of_disk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("175b.ptsched");
    let out = protrain(&[
        "compile",
        "gpt3-175b",
        "--hardware",
        "rtx4090",
        "--host-memory",
        "256GiB",
        "--disk-memory",
        "4TiB",
        "--batch",
        "1",
        "--seq",
        "1024",
        "-o",
        path(&file),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let disk = text
        .lines()
        .find(|l| l.starts_with("disk "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        disk.contains("the optimizer state of 97 of 97 chunks and the parameters of "),
        "{disk}"
    );
    // The chosen candidate's line: `* POLICY  simulated S s (estimate E s) ...`.
    let chosen = text
        .lines()
        .find(|l| l.trim_start().starts_with("* "))
        .unwrap_or_else(|| panic!("{text}"));
    let number = |after: &str| -> f64 {
        chosen
            .split(after)
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{chosen}"))
    };
    let (simulated, estimate) = (number("simulated "), number("(estimate "));
    assert!(
        (estimate - simulated).abs() <= 0.25 * simulated,
        "estimate {estimate} s against {simulated} s simulated"
    );
    let verified = protrain(&["verify", path(&file)]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

/// Chunk-major accumulation amortises the disk tier: Llama-2-70B on one RTX 3090 with 256 GiB
/// of host memory and 2 TiB of disk compiles with `--grad-accum 8` (sequentially it would need
/// host accumulators beside the parameters and gradients), in the chunk-major order, verifies,
/// and trains at least 4x the tokens per second of the same command without accumulation (the
/// disk reads and writes the optimizer state once per step either way); the search's estimate
/// is within 25% of the simulated step.
#[test]
fn llama_2_70b_accumulates_chunk_major_at_four_times_the_rate_with_a_disk_tier() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("70b.ptsched");
    let compile = |extra: &[&str]| {
        let mut args = vec![
            "compile",
            "llama-2-70b",
            "--hardware",
            "rtx3090",
            "--host-memory",
            "256GiB",
            "--disk-memory",
            "2TiB",
            "--batch",
            "1",
            "--seq",
            "1024",
            "--json",
            "-o",
            path(&file),
        ];
        args.extend_from_slice(extra);
        let out = protrain(&args);
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        json(&out)
    };
    let single = compile(&[]);
    let accumulated = compile(&["--grad-accum", "8"]);
    assert_eq!(accumulated["micro_batches"], 8, "{accumulated}");
    assert_eq!(
        accumulated["micro_batch_order"], "chunk-major",
        "{accumulated}"
    );
    let rate = |v: &serde_json::Value| v["tokens_per_s"].as_f64().expect("tokens_per_s");
    assert!(
        rate(&accumulated) >= 4.0 * rate(&single),
        "{} tokens/s accumulated, {} without",
        rate(&accumulated),
        rate(&single)
    );
    let step = accumulated["predicted_step_s"].as_f64().expect("a step");
    let estimate = accumulated["estimated_step_s"]
        .as_f64()
        .expect("an estimate");
    assert!(
        (estimate - step).abs() <= 0.25 * step,
        "estimate {estimate} s, simulated {step} s"
    );
    let verified = protrain(&["verify", path(&file)]);
    assert!(verified.status.success(), "{}", stderr(&verified));
}

/// Where even every model state the disk tier can take on disk leaves the host over its
/// budget, the refusal says that the disk was considered, what it takes, and what it could
/// not take (here the staging buffers its 3.4 GiB chunks need).
#[test]
fn a_host_too_small_even_with_every_state_on_disk_names_the_disk() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = protrain(&[
        "compile",
        "gpt3-175b",
        "--hardware",
        "rtx4090",
        "--host-memory",
        "16GiB",
        "--disk-memory",
        "4TiB",
        "--batch",
        "1",
        "--seq",
        "1024",
        "-o",
        path(&dir.path().join("x.ptsched")),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("That is with the disk tier (4.00 TiB of disk (--disk-memory)) considered"),
        "{err}"
    );
    assert!(
        err.contains("the parameters and gradients of offloaded chunks"),
        "{err}"
    );
    assert!(
        err.contains(" of disk staging buffers, so a larger --disk-memory does not lower it"),
        "{err}"
    );
}
