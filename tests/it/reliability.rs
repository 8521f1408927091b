//! protrain as a Unix tool under stress: closed and full standard output, absurd step counts,
//! outputs that would destroy inputs or devices, inputs that never end, damaged and foreign
//! checkpoints, and a NaN loss explained by what caused it.

use crate::cli_support;
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
    // A step count near u32::MAX or u64::MAX must not size anything up front (that would be
    // 32 GiB preallocated, or a capacity overflow panic): the run trains until its reader
    // goes away.
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

/// Fails unless `args` is refused as writing over an input, and `file` is left as it was.
fn check_input_kept(args: &[&str], file: &Path) {
    let before = std::fs::read(file).unwrap();
    check_error(&protrain(args), &["input"]);
    assert_eq!(
        std::fs::read(file).unwrap(),
        before,
        "{args:?} ate its input"
    );
}

#[test]
fn train_and_run_outputs_never_replace_their_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let config = model.join("config.json");
    std::fs::copy("tests/fixtures/gpt2/config.json", &config).unwrap();
    let short = ["--steps", "1", "--batch", "1", "--seq", "8"];
    for flag in ["--save", "--trace"] {
        // The config named as a file, and through its directory.
        for m in [&config, &model] {
            let mut args = vec!["train", path(m), flag, path(&config)];
            args.extend(short);
            check_input_kept(&args, &config);
        }
    }
    // A hardware profile written by `profile` (here the host preset's figures).
    let profile = dir.path().join("p.json");
    let json = protrain::ir::HardwareProfile::host().to_json().unwrap();
    std::fs::write(&profile, json).unwrap();
    let mut args = vec!["train", "gpt2-tiny", "--hardware", path(&profile)];
    args.extend(short);
    args.extend(["--save", path(&profile)]);
    check_input_kept(&args, &profile);

    let s = schedule(dir.path());
    for flag in ["--save", "--trace"] {
        check_input_kept(&["run", path(&s), "--steps", "1", flag, path(&s)], &s);
    }
    // Checkpoints would replace (and prune) an input under a checkpoint's name.
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    let weights = ckpt.join("step-00000001.safetensors");
    let out = train("1", &["--save", path(&weights)]);
    assert!(out.status.success(), "{}", stderr(&out));
    check_input_kept(
        &[
            "run",
            path(&s),
            "--steps",
            "1",
            "--init",
            path(&weights),
            "--checkpoint-dir",
            path(&ckpt),
            "--save-every",
            "1",
        ],
        &weights,
    );
    // An output that is no input is written.
    let out = protrain(&[
        "run",
        path(&s),
        "--steps",
        "1",
        "--save",
        path(&dir.path().join("w")),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn schedule_and_profile_inputs_are_regular_files_of_bounded_size() {
    let dir = tempfile::tempdir().unwrap();
    for command in ["verify", "explain", "run"] {
        check_error(&protrain(&[command, "/dev/zero"]), &["not a regular file"]);
    }
    let out = dir.path().join("t.json");
    check_error(
        &protrain(&["trace", "/dev/zero", "-o", path(&out)]),
        &["not a regular file"],
    );
    check_error(
        &protrain(&["compile", "gpt2-tiny", "--hardware", "/dev/zero"]),
        &["not a regular file", "hardware profile"],
    );
    // Sparse files far larger than any schedule or profile: refused by their size, unread.
    let big = dir.path().join("big.ptsched");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(18 << 30)
        .unwrap();
    check_error(&protrain(&["verify", path(&big)]), &["bytes, more than"]);
    check_error(
        &protrain(&["compile", "gpt2-tiny", "--hardware", path(&big)]),
        &["bytes, more than", "hardware profile"],
    );
    // A FIFO is not even opened: opening one blocks until a writer comes.
    let fifo = dir.path().join("fifo");
    if Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        check_error(&protrain(&["run", path(&fifo)]), &["not a regular file"]);
        check_error(
            &protrain(&["compile", "gpt2-tiny", "--hardware", path(&fifo)]),
            &["not a regular file"],
        );
        let out = train("1", &["--init", path(&fifo)]);
        check_error(&out, &["not a regular file"]);
    }
}

/// `s` with its payload re-encoded after `change`, the checksum matching.
fn rewrite_schedule(s: &Path, to: &Path, change: impl FnOnce(&mut protrain::ir::Schedule)) {
    let mut schedule = protrain::ir::file::read_unverified(s).unwrap();
    change(&mut schedule);
    std::fs::write(to, protrain::ir::file::encode(&schedule)).unwrap();
}

#[test]
fn a_count_in_a_schedule_cannot_size_an_allocation() {
    let dir = tempfile::tempdir().unwrap();
    let s = schedule(dir.path());
    let damaged = dir.path().join("damaged.ptsched");
    // 2^31 events: 12 bytes each in the verifier's tables (25 GiB) before any check.
    rewrite_schedule(&s, &damaged, |s| s.events = 1 << 31);
    check_error(&protrain(&["verify", path(&damaged)]), &["event count"]);
    // 2^16 x 2^16 ranks overflow the rank count.
    rewrite_schedule(&s, &damaged, |s| {
        s.streams[0].kind = protrain::ir::StreamKind::Collective {
            gpus: 1 << 16,
            nodes: 1 << 16,
        }
    });
    check_error(&protrain(&["verify", path(&damaged)]), &["rank count"]);
}

#[test]
fn two_runs_on_one_checkpoint_directory_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let first = Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args([
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--json",
            "--steps",
            "1000000",
            "--checkpoint-dir",
            path(&ckpt),
            "--save-every",
            "1000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the protrain binary runs");
    let mut first = Killed(first);
    // Once it prints a step, it holds the directory.
    let mut lines = BufReader::new(first.0.stdout.take().unwrap()).lines();
    lines.next().expect("a step").expect("a line");
    let out = train("2", &["--checkpoint-dir", path(&ckpt), "--save-every", "1"]);
    check_error(
        &out,
        &["in use by another run", &format!("PID {}", first.0.id())],
    );
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    // Its holder gone (killed: no clean-up ran), the directory is free again.
    let out = train("2", &["--checkpoint-dir", path(&ckpt), "--save-every", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(ckpt.join("step-00000002.safetensors").is_file());
}

/// A child process killed when dropped, so a failing test leaves no run behind.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Flips one bit of the first occurrence of `"NAME":{` in `file` (a tensor's entry in the
/// safetensors header, not its checksum's key in the metadata).
fn flip_tensor_name(file: &Path, name: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let needle = format!("\"{name}\":{{");
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
        .expect("the tensor's entry");
    bytes[at + 1] ^= 1;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_damaged_name_or_layout_in_the_newest_checkpoint_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = train("4", &["--checkpoint-dir", path(&ckpt), "--save-every", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let four = ckpt.join("step-00000004.safetensors");
    let pristine = std::fs::read(&four).unwrap();
    let fall_back = |what: &str| {
        let out = train("6", &["--resume", path(&ckpt)]);
        let err = stderr(&out);
        assert!(out.status.success(), "{what}: {err}");
        assert!(
            err.contains("warning: skipping") && err.contains("damaged"),
            "{what}: {err}"
        );
        assert!(err.contains("step-00000002"), "{what}: {err}");
        assert!(!err.contains("another"), "{what}: {err}");
    };
    flip_tensor_name(&four, "transformer.wte.weight");
    fall_back("a tensor name");
    // A resumed run goes on saving into the directory it resumes: drop the step-6 checkpoint
    // that resume wrote, so the next one again finds step 4 the newest.
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let entry = entry.unwrap();
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("step-00000006")
        {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    // The layout number is covered by the metadata's checksum: "4" read as "2" would skip
    // that checksum and the run settings.
    std::fs::write(&four, &pristine).unwrap();
    let mut bytes = pristine.clone();
    let needle = b"\"protrain.checkpoint\":\"4\"";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the layout entry");
    bytes[at + needle.len() - 2] = b'2';
    std::fs::write(&four, &bytes).unwrap();
    fall_back("the layout");
}

#[test]
fn leftover_temporary_checkpoints_are_removed_when_a_run_takes_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = train("2", &["--checkpoint-dir", path(&ckpt), "--save-every", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    // What a run killed while saving leaves: a single file's, a manifest's and a shard's.
    let left = [
        ".step-00000004.safetensors.a1B2c3.tmp",
        ".step-00000004.manifest.json.x9Y8z7.tmp",
        ".step-00000004.rank-1-of-2.safetensors.Qw3rTy.tmp",
    ];
    for name in left {
        std::fs::write(ckpt.join(name), vec![0u8; 1000]).unwrap();
    }
    // Not ours: kept.
    std::fs::write(ckpt.join("notes.tmp"), b"mine").unwrap();
    let out = train("4", &["--resume", path(&ckpt), "--save-every", "2"]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("removed 3 leftover temporary checkpoint file(s)"),
        "{err}"
    );
    for name in left {
        assert!(!ckpt.join(name).exists(), "{name} is still there");
    }
    assert!(ckpt.join("notes.tmp").exists());
    assert!(ckpt.join("step-00000004.safetensors").is_file());
}

/// `protrain args` with its address space limited to `kib` KiB (`ulimit -v`).
fn protrain_limited(kib: u64, args: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_protrain"))
        .args(args)
        .output()
        .expect("sh runs")
}

#[test]
fn a_config_too_deep_to_compile_in_the_memory_there_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let config = |layers: u64| {
        let mut json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string("tests/fixtures/llama/config.json").unwrap(),
        )
        .unwrap();
        json["num_hidden_layers"] = layers.into();
        let path = dir.path().join(format!("deep-{layers}.json"));
        std::fs::write(&path, json.to_string()).unwrap();
        path
    };
    // 16,384 layers take gigabytes to compile: under a 2 GiB limit a compile that started
    // would abort part way ("memory allocation failed") or be killed, so it must be refused
    // before it starts.
    let deep = config(16_384);
    let out_file = dir.path().join("deep.ptsched");
    let args = [
        "compile",
        path(&deep),
        "--dtype",
        "f32",
        "-o",
        path(&out_file),
    ];
    let out = protrain_limited(2 << 20, &args);
    check_error(
        &out,
        &[
            "16384 layers",
            "would take about",
            "per layer",
            "ulimit -v",
            "fewer layers",
        ],
    );
    assert!(!out_file.exists());
    // A shallow one compiles under the same limit.
    let shallow = config(4);
    let args = [
        "compile",
        path(&shallow),
        "--dtype",
        "f32",
        "-o",
        path(&out_file),
    ];
    let out = protrain_limited(2 << 20, &args);
    assert!(out.status.success(), "{}", stderr(&out));
}
