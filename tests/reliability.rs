//! protrain as a Unix tool under stress: closed and full standard output, absurd step counts,
//! outputs that would destroy inputs or devices, inputs that never end, damaged and foreign
//! checkpoints, and a NaN loss explained by what caused it.

mod cli_support;
use cli_support::{compile_gpt2_tiny, path, protrain, stderr};

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// Fails with `what` unless `out` failed with exit status 2 and an `error:` line containing
/// every one of `words`.
fn check_error(out: &Output, words: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error: ") || err.contains("\nerror: "),
        "{err}"
    );
    for w in words {
        assert!(err.contains(w), "expected {w:?} in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

/// A small f32 schedule of gpt2-tiny in `dir`, compiled once per test that needs one.
fn schedule(dir: &Path) -> PathBuf {
    let s = dir.join("tiny.ptsched");
    compile_gpt2_tiny(&s, &[]);
    s
}

/// Runs protrain with its standard output a pipe closed before it writes: it must end quietly
/// with status 0, as `protrain ... | head -1` needs (Rust's `println!` panics, exit 101).
fn check_closed_pipe(args: &[&str]) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the protrain binary runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("it ends");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("error"),
        "{args:?}: {err}"
    );
}

/// Runs protrain with its standard output `/dev/full`: it must say `error:` and exit 2, not
/// panic and not succeed having lost its output.
fn check_full_output(args: &[&str]) {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full exists on Linux");
    let out = Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args(args)
        .stdout(full)
        .output()
        .expect("the protrain binary runs");
    check_error(&out, &["standard output"]);
}

#[test]
fn a_closed_pipe_ends_quietly_and_a_full_one_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let s = schedule(dir.path());
    let out_file = dir.path().join("again.ptsched");
    let trace = dir.path().join("t.json");
    let commands: Vec<Vec<&str>> = vec![
        vec!["models"],
        vec!["info", "gpt2-tiny"],
        vec!["dump", "gpt2-tiny"],
        vec!["compile", "gpt2-tiny", "-o", path(&out_file)],
        vec!["verify", path(&s)],
        vec!["explain", path(&s)],
        vec!["trace", path(&s), "-o", path(&trace)],
        vec!["run", path(&s), "--steps", "2"],
        vec![
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "2",
        ],
    ];
    for args in &commands {
        check_closed_pipe(args);
        if Path::new("/dev/full").exists() {
            check_full_output(args);
        }
    }
}

#[test]
fn steps_are_not_preallocated() {
    // Both used to abort at once: 32 GiB preallocated, or a capacity overflow panic. Now the
    // run trains until its reader goes away.
    let dir = tempfile::tempdir().unwrap();
    let s = schedule(dir.path());
    for steps in ["4294967296", "18446744073709551615"] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_protrain"))
            .args(["run", path(&s), "--json", "--steps", steps])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the protrain binary runs");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("a step").expect("a line");
        assert!(first.contains("\"step\":1"), "{first}");
        drop(lines);
        let status = child.wait().expect("it ends");
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert_eq!(status.code(), Some(0), "--steps {steps}: {err}");
    }
    // The profiler keeps every timing: a huge --repeats is refused, not preallocated.
    let out = protrain(&["profile", "gpt2-tiny", "--repeats", "18446744073709551615"]);
    check_error(&out, &["--repeats"]);
}

#[test]
fn an_output_never_replaces_an_input_or_a_device() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.json");
    std::fs::copy("tests/fixtures/gpt2/config.json", &config).unwrap();
    let before = std::fs::read(&config).unwrap();
    let out = protrain(&["compile", path(&config), "-o", path(&config)]);
    check_error(&out, &["input"]);
    assert_eq!(
        std::fs::read(&config).unwrap(),
        before,
        "compile ate its input"
    );
    let out = protrain(&["dump", path(&config), "-o", path(&config)]);
    check_error(&out, &["input"]);
    assert_eq!(
        std::fs::read(&config).unwrap(),
        before,
        "dump ate its input"
    );

    let s = schedule(dir.path());
    let sched = std::fs::read(&s).unwrap();
    let out = protrain(&["trace", path(&s), "-o", path(&s)]);
    check_error(&out, &["input"]);
    assert_eq!(std::fs::read(&s).unwrap(), sched, "trace ate its input");

    // A FIFO (as a device node would be) is refused, not renamed over.
    let fifo = dir.path().join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if made.is_ok_and(|s| s.success()) {
        for args in [
            vec!["compile", "gpt2-tiny", "-o", path(&fifo)],
            vec!["dump", "gpt2-tiny", "-o", path(&fifo)],
            vec!["trace", path(&s), "-o", path(&fifo)],
            vec!["run", path(&s), "--steps", "1", "--trace", path(&fifo)],
        ] {
            check_error(&protrain(&args), &["not a regular file"]);
            use std::os::unix::fs::FileTypeExt;
            let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
            assert!(kind.is_fifo(), "{args:?} replaced the FIFO");
        }
    }
}

#[test]
fn a_model_that_never_ends_is_refused_before_reading() {
    let dir = tempfile::tempdir().unwrap();
    check_error(&protrain(&["info", "/dev/zero"]), &["not a regular file"]);
    let fifo = dir.path().join("config.json");
    if Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        // Opening a FIFO blocks until a writer comes; it must not even be opened.
        check_error(&protrain(&["info", path(&fifo)]), &["not a regular file"]);
    }
    let big = dir.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(18 << 30)
        .unwrap();
    check_error(&protrain(&["info", path(&big)]), &["a few KiB"]);
    let data = dir.path().join("zero.bin");
    std::os::unix::fs::symlink("/dev/zero", &data).unwrap();
    let out = protrain(&["train", "gpt2-tiny", "--steps", "1", "--data", path(&data)]);
    check_error(&out, &["not a regular file"]);
}

/// Trains gpt2-tiny for `steps` (batch 2 x seq 16) with `extra` flags, logging JSON.
fn train(steps: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
        "--steps",
        steps,
    ];
    args.extend_from_slice(extra);
    protrain(&args)
}

/// Flips one bit of the last byte of `file`: the high byte of the last tensor's last f32.
fn flip_last_bit(file: &Path) {
    let mut bytes = std::fs::read(file).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_damaged_checkpoint_is_caught_and_the_one_before_it_used() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = train("4", &["--checkpoint-dir", path(&ckpt), "--save-every", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (two, four) = (
        ckpt.join("step-00000002.safetensors"),
        ckpt.join("step-00000004.safetensors"),
    );
    assert!(two.is_file() && four.is_file());
    flip_last_bit(&four);
    // Copied now: the resumed run below goes on saving into `ckpt`, step 4 again included.
    let only = dir.path().join("only");
    std::fs::create_dir(&only).unwrap();
    std::fs::copy(&four, only.join("step-00000004.safetensors")).unwrap();
    let out = train("6", &["--resume", path(&ckpt)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("warning: skipping") && err.contains("checksum"),
        "{err}"
    );
    assert!(
        err.contains("resuming from") && err.contains("step-00000002"),
        "{err}"
    );

    // With nothing to fall back to, it is an error naming the damage.
    check_error(
        &train("6", &["--resume", path(&only)]),
        &["damaged", "checksum"],
    );

    // The step in the file name must match the one inside.
    let renamed = dir.path().join("renamed");
    std::fs::create_dir(&renamed).unwrap();
    std::fs::copy(&two, renamed.join("step-00000009.safetensors")).unwrap();
    check_error(
        &train("12", &["--resume", path(&renamed)]),
        &["named for step 9"],
    );
}

#[test]
fn a_checkpoint_directory_of_another_run_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = train("4", &["--checkpoint-dir", path(&ckpt), "--save-every", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // A new run into the same directory would have its checkpoints pruned as the oldest.
    let out = train("2", &["--checkpoint-dir", path(&ckpt), "--save-every", "1"]);
    check_error(&out, &["already holds", "--resume"]);
    // Resuming from it and saving there is that run going on.
    let out = train("6", &["--resume", path(&ckpt), "--save-every", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(ckpt.join("step-00000006.safetensors").is_file());
}

#[test]
fn a_nan_loss_names_its_cause() {
    let dir = tempfile::tempdir().unwrap();
    // --eps 0: Adam would divide 0 by 0 for the embedding rows of tokens not yet seen; it is
    // refused before training, naming eps.
    let out = train("20", &["--eps", "0"]);
    check_error(&out, &["eps = 0"]);
    assert!(!stderr(&out).contains("lower --lr"), "{}", stderr(&out));

    // Weights that are NaN from the start.
    let weights = dir.path().join("w.safetensors");
    let out = train("1", &["--save", path(&weights)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let file = protrain::runtime::weights::WeightFile::open(&weights).unwrap();
    let names: Vec<String> = file.names().map(String::from).collect();
    let mut data: Vec<(String, Vec<usize>, Vec<f32>)> = names
        .iter()
        .map(|n| {
            (
                n.clone(),
                file.shape(n).unwrap().to_vec(),
                file.read_f32_vec(n).unwrap(),
            )
        })
        .collect();
    drop(file);
    data[0].2[0] = f32::NAN;
    let tensors: Vec<(&str, &[usize], &[f32])> = data
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
        .collect();
    protrain::runtime::weights::save_safetensors(
        &weights,
        &tensors,
        protrain::runtime::weights::StorageDtype::F32,
        &[],
    )
    .unwrap();
    let out = train("3", &["--init", path(&weights)]);
    check_error(&out, &["not finite", &data[0].0]);
    assert!(!stderr(&out).contains("lower --lr"), "{}", stderr(&out));

    // A learning rate that diverges is still told to lower it.
    let out = train("10", &["--lr", "1e30"]);
    check_error(&out, &["the step before: loss", "non-finite", "lower --lr"]);
}
