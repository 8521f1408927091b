//! `protrain run` as a user runs it: every way it refuses its inputs, and what it prints when
//! it trains; and `protrain train` giving the same losses under a roomy and a tight budget.

use crate::cli_support;
use cli_support::{compile_gpt2_tiny, path, protrain, stderr, stdout};

use protrain::ir::{file, verify_schedule::verify_schedule, Instr, Schedule, FORMAT_VERSION};
use std::path::PathBuf;
use std::process::Output;

/// The loss of every step of a successful `--log-json` run, as printed (text compares bits).
fn losses(out: &Output) -> Vec<String> {
    assert!(out.status.success(), "{}", stderr(out));
    stdout(out)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("one JSON object per line");
            v["loss"].to_string()
        })
        .collect()
}

/// A directory with an f32 schedule of gpt2-tiny at batch 2 x seq 16, compiled with AdamW's
/// PyTorch defaults.
struct Fixture {
    dir: tempfile::TempDir,
    schedule: PathBuf,
}

/// PyTorch's AdamW defaults, which the fixture is compiled with and `train` is told.
const TORCH_ADAMW: [&str; 6] = [
    "--lr",
    "0.001",
    "--beta2",
    "0.999",
    "--weight-decay",
    "0.01",
];

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let schedule = dir.path().join("gpt2.ptsched");
        compile_gpt2_tiny(&schedule, &TORCH_ADAMW);
        Self { dir, schedule }
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `bytes` to a file named `name` in the fixture directory; returns its path.
    fn write(&self, name: &str, bytes: &[u8]) -> String {
        let p = self.file(name);
        std::fs::write(&p, bytes).expect("write");
        path(&p).to_string()
    }
}

/// Runs `protrain run` with `args` plus every output flag, and checks that it failed as
/// errors must: exit status 2, one `error:` message, no panic, nothing on stdout, and none of
/// the outputs written. Returns the message.
fn check_error(args: &[&str]) -> String {
    let outputs = tempfile::tempdir().expect("temp dir");
    let save = outputs.path().join("w.safetensors");
    let trace = outputs.path().join("trace.json");
    let ckpt = outputs.path().join("ckpt");
    let mut all = vec!["run"];
    all.extend(args);
    all.extend([
        "--steps",
        "2",
        "--save",
        path(&save),
        "--trace",
        path(&trace),
    ]);
    all.extend(["--checkpoint-dir", path(&ckpt), "--save-every", "1"]);
    let out = protrain(&all);
    let err = stderr(&out);
    let shown = all.join(" ");
    assert_eq!(out.status.code(), Some(2), "`{shown}`: {err}");
    assert!(!err.contains("panicked"), "`{shown}` panicked: {err}");
    assert!(err.starts_with("error: "), "`{shown}` printed: {err}");
    assert!(stdout(&out).is_empty(), "`{shown}` printed on stdout");
    let written: Vec<_> = std::fs::read_dir(outputs.path())
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(written.is_empty(), "`{shown}` wrote {written:?}");
    err
}

/// A copy of `schedule` with the first wait whose removal the verifier catches removed.
fn without_a_wait(schedule: &Schedule) -> Schedule {
    for (s, stream) in schedule.streams.iter().enumerate() {
        for (i, instr) in stream.instrs.iter().enumerate() {
            if matches!(instr, Instr::Wait { .. }) {
                let mut broken = schedule.clone();
                broken.streams[s].instrs.remove(i);
                if verify_schedule(&broken).is_err() {
                    return broken;
                }
            }
        }
    }
    panic!("the schedule has no wait the verifier depends on");
}

/// Token ids as a raw little-endian u16 `.bin` file.
fn tokens_bin(fx: &Fixture, name: &str, tokens: &[u16]) -> String {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    fx.write(name, &bytes)
}

#[test]
fn every_refusal_names_the_problem_and_the_fix() {
    let fx = Fixture::new();
    let good = path(&fx.schedule).to_string();
    let bytes = std::fs::read(&fx.schedule).expect("read");

    let truncated = fx.write("truncated.ptsched", &bytes[..bytes.len() / 2]);
    let mut flipped = bytes.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x55;
    let corrupted = fx.write("corrupted.ptsched", &flipped);
    let mut newer = bytes.clone();
    newer[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let newer = fx.write("newer.ptsched", &newer);
    // A schedule that streams its chunks, so that its streams wait on each other (the search
    // keeps this model resident on the host, one stream without a wait).
    let streamed = fx.file("streamed.ptsched");
    compile_gpt2_tiny(&streamed, &["--policy", "n_persist=0 n_buffer=1"]);
    let streamed = file::read(&streamed).expect("a valid schedule");
    let unverified = fx.write("nowait.ptsched", &file::encode(&without_a_wait(&streamed)));

    // Weights of another model, saved by a short llama-tiny run.
    let llama = fx.file("llama.safetensors");
    let out = protrain(&[
        "train",
        "llama-tiny",
        "--steps",
        "1",
        "--batch",
        "1",
        "--seq",
        "8",
        "--log-json",
        "--save",
        path(&llama),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    // gpt2-tiny's vocabulary is 256: token 300 at stream index 5.
    let mut ids: Vec<u16> = (0..100).map(|i| i % 24).collect();
    ids[5] = 300;
    let out_of_range = tokens_bin(&fx, "oov.bin", &ids);
    let too_short = tokens_bin(&fx, "short.bin", &[1, 2, 3]);
    let missing = path(&fx.file("missing.ptsched")).to_string();

    let cases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (
            "missing schedule",
            vec![&missing],
            vec!["does not exist", "protrain compile"],
        ),
        (
            "truncated schedule",
            vec![&truncated],
            vec!["truncated", "compile it again"],
        ),
        (
            "corrupted schedule",
            vec![&corrupted],
            vec!["corrupted", "CRC-32"],
        ),
        (
            "newer format",
            vec![&newer],
            vec!["newer protrain", "upgrade protrain"],
        ),
        (
            "fails verification",
            vec![&unverified],
            vec!["nowait.ptsched", "compile it again"],
        ),
        (
            "weights of another model",
            vec![&good, "--init", path(&llama)],
            vec![
                "the weights do not match the model",
                "missing: `transformer.wpe.weight`",
            ],
        ),
        (
            "token out of range",
            vec![&good, "--data", &out_of_range],
            vec!["token 300 at position 5", "vocabulary of 256"],
        ),
        (
            "data shorter than a batch",
            vec![&good, "--data", &too_short],
            vec!["3 tokens", "batch 2 x seq 16 needs 33"],
        ),
        (
            "optimizer flags that differ",
            vec![
                &good,
                "--lr",
                "0.003",
                "--beta2",
                "0.999",
                "--grad-clip",
                "1",
            ],
            vec![
                "--lr 0.003 (the schedule has 0.001), --grad-clip 1 (the schedule has none)",
                "compile it again with those flags (`protrain compile MODEL --lr ...`",
            ],
        ),
        (
            "resume from a directory without checkpoints",
            vec![&good, "--resume", path(fx.dir.path())],
            vec!["no checkpoint in", "start the run afresh"],
        ),
    ];
    // `--backend cuda` where the CUDA backend cannot run: not built in, or built on a machine
    // without a usable GPU (where there is one, the schedule runs, which is no error case).
    let cuda_refusal = match protrain::runtime::cuda::available() {
        Ok(()) => None,
        Err(why) if cfg!(feature = "cuda") => Some(format!("no CUDA device is available: {why}")),
        Err(_) => Some(
            "the CUDA backend is not built into this protrain; rebuild with --features cuda on \
             a machine with CUDA, or use --backend host"
                .to_string(),
        ),
    };
    let mut cases = cases;
    if let Some(needle) = &cuda_refusal {
        cases.push((
            "cuda where it cannot run",
            vec![&good, "--backend", "cuda"],
            vec![needle.as_str()],
        ));
    }
    for (what, args, needles) in cases {
        let err = check_error(&args);
        for needle in needles {
            assert!(err.contains(needle), "{what}: no `{needle}` in: {err}");
        }
    }
}

#[test]
fn run_trains_like_train_and_reports_prediction_against_measurement() {
    let fx = Fixture::new();
    let good = path(&fx.schedule);
    // The fixture was compiled with PyTorch's AdamW defaults; `train` is told the same.
    let ran = protrain(&["run", good, "--steps", "4", "--log-json", "--lr", "0.001"]);
    let mut train = vec![
        "train",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "4",
        "--log-json",
        "--policy",
        "n_persist=4",
    ];
    train.extend(TORCH_ADAMW);
    let trained = protrain(&train);
    assert_eq!(losses(&ran), losses(&trained));
    assert_eq!(losses(&ran).len(), 4);

    let trace = fx.file("trace.json");
    let out = protrain(&["run", good, "--steps", "3", "--trace", path(&trace)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for needle in [
        "step time       predicted",
        "measured",
        "mean of the 2 steps after the first",
        "compute",
    ] {
        assert!(text.contains(needle), "no `{needle}` in: {text}");
    }
    assert!(
        stderr(&out).contains("policy          n_persist="),
        "{}",
        stderr(&out)
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace written"))
            .expect("the trace is JSON");
    let events = v["traceEvents"].as_array().expect("events");
    let spans = |pid: u64| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == pid)
            .count()
    };
    assert!(
        spans(1) > 0 && spans(2) > 0,
        "measured and predicted spans: {v}"
    );
}

/// The policy `train` printed.
fn policy(out: &Output) -> String {
    stderr(out)
        .lines()
        .find_map(|l| l.strip_prefix("policy"))
        .expect("train prints its policy")
        .trim()
        .to_string()
}

#[test]
fn train_gives_the_same_losses_under_a_roomy_and_a_tight_budget() {
    let run = |budget: &str| {
        protrain(&[
            "train",
            "gpt2-tiny",
            "--batch",
            "8",
            "--seq",
            "64",
            "--steps",
            "5",
            "--log-json",
            "--gpu-memory",
            budget,
        ])
    };
    let roomy = run("1GiB");
    let tight = run("4MiB");
    let (loose, strict) = (policy(&roomy), policy(&tight));
    // gpt2-tiny has 4 chunks; 4 MiB cannot keep them all, nor every layer's activations.
    assert!(!strict.contains("n_persist=4"), "tight: {strict}");
    let blocks = strict.split("blocks=").nth(1).expect("blocks");
    assert!(blocks.contains('C'), "tight plan checkpoints: {strict}");
    assert_ne!(loose, strict);
    assert_eq!(losses(&roomy), losses(&tight));
}

#[test]
fn train_runs_bf16_on_the_host_backend_close_to_f32() {
    let run = |dtype: &str| {
        let out = protrain(&[
            "train",
            "gpt2-tiny",
            "--dtype",
            dtype,
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq",
            "16",
            "--log-json",
        ]);
        losses(&out)
            .iter()
            .map(|l| l.parse::<f64>().expect("a number"))
            .collect::<Vec<f64>>()
    };
    let (bf16, f32) = (run("bf16"), run("f32"));
    assert_eq!(bf16.len(), 3);
    for (b, f) in bf16.iter().zip(&f32) {
        assert!(((b - f) / f).abs() < 1e-2, "bf16 {b} against f32 {f}");
    }
    assert_ne!(bf16, f32, "bf16 rounds: the losses are close, not equal");
}

/// An f16 run logs its loss scale and skips; an initial scale its gradients overflow skips
/// the first steps (halving the scale each time, said in the table too), then trains.
#[test]
fn train_f16_reports_its_loss_scale_and_skipped_steps() {
    let args = |json: bool| {
        let mut a = vec![
            "train",
            "gpt2-tiny",
            "--dtype",
            "f16",
            "--steps",
            "4",
            "--batch",
            "2",
            "--seq",
            "16",
            "--loss-scale-init",
            "1e30",
        ];
        if json {
            a.push("--log-json");
        }
        protrain(&a)
    };
    let out = args(true);
    assert!(out.status.success(), "{}", stderr(&out));
    let lines: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0]["skipped"], true);
    assert_eq!(lines[0]["loss_scale"].as_f64(), Some(f64::from(1e30f32)));
    assert_eq!(
        lines[1]["loss_scale"].as_f64(),
        Some(f64::from(1e30f32 / 2.0))
    );
    let table = args(false);
    assert!(table.status.success(), "{}", stderr(&table));
    assert!(
        stdout(&table).contains("gradients overflowed f16 at loss scale"),
        "{}",
        stdout(&table)
    );
}

#[test]
fn loss_scale_flags_that_cannot_train_are_refused() {
    let check_error = |args: &[&str]| {
        let out = protrain(args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && !err.contains("panicked"),
            "{err}"
        );
        assert!(stdout(&out).is_empty());
        err
    };
    let err = check_error(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "1",
        "--loss-scale-init",
        "1024",
    ]);
    assert!(err.contains("--dtype f16"), "{err}");
    let err = check_error(&[
        "train",
        "gpt2-tiny",
        "--dtype",
        "f16",
        "--steps",
        "1",
        "--loss-scale-growth-interval",
        "0",
    ]);
    assert!(err.contains("at least 1"), "{err}");
    let err = check_error(&[
        "train",
        "gpt2-tiny",
        "--dtype",
        "f16",
        "--steps",
        "1",
        "--loss-scale-init",
        "1e40",
    ]);
    assert!(err.contains("--loss-scale-init"), "{err}");
}

#[test]
fn run_follows_a_learning_rate_schedule_as_train_does() {
    let fx = Fixture::new();
    let schedule = [
        "--steps",
        "4",
        "--log-json",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--decay-steps",
        "3",
        "--min-lr",
        "0.0001",
    ];
    let mut run = vec!["run", path(&fx.schedule)];
    run.extend(schedule);
    let mut train = vec!["train", "gpt2-tiny", "--batch", "2", "--seq", "16"];
    train.extend(TORCH_ADAMW);
    train.extend(schedule);
    let (ran, trained) = (protrain(&run), protrain(&train));
    assert_eq!(losses(&ran), losses(&trained));
    let rates: Vec<String> = stdout(&ran)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("JSON")["lr"].to_string())
        .collect();
    // Warmup 0 and 0.0005; then the cosine's top (0.001) and its end, --min-lr, at step
    // --decay-steps + 1 = 4.
    assert_eq!(rates, ["0.0", "0.0005", "0.001", "0.0001"]);
}

#[test]
fn train_reads_a_text_corpus_through_a_tokenizer_once() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("runtime/tests/fixtures/text");
    let dir = tempfile::tempdir().expect("temp dir");
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(fixtures.join("corpus.txt"), &corpus).expect("copy the corpus");
    let tokenizer = fixtures.join("tokenizer.json");
    let args = [
        "train",
        "gpt2-tiny",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--data",
        path(&corpus),
        "--tokenizer",
        path(&tokenizer),
        "--log-json",
    ];
    let first = protrain(&args);
    assert!(first.status.success(), "{}", stderr(&first));
    let caches: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .expect("the corpus directory")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".tokens.bin"))
        .collect();
    assert_eq!(caches.len(), 1, "one cache beside the corpus: {caches:?}");
    let written = std::fs::metadata(&caches[0])
        .and_then(|m| m.modified())
        .expect("the cache's time");
    // A second run reuses the cache and reads the same tokens.
    let second = protrain(&args);
    assert!(second.status.success(), "{}", stderr(&second));
    assert_eq!(losses(&first), losses(&second));
    assert!(!losses(&first).is_empty());
    let reused = std::fs::metadata(&caches[0])
        .and_then(|m| m.modified())
        .expect("the cache's time");
    assert_eq!(written, reused, "the cache is reused, not rewritten");
    // --tokenizer names a text corpus, so it needs --data.
    let out = protrain(&["train", "gpt2-tiny", "--tokenizer", path(&tokenizer)]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("--data"), "{}", stderr(&out));
}

#[test]
fn train_accumulates_gradients_as_a_larger_batch_and_refuses_contradictions() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--seq",
            "16",
            "--steps",
            "3",
            "--grad-clip",
            "1.0",
            "--log-json",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let parse = |out: &Output| -> Vec<f64> {
        losses(out)
            .iter()
            .map(|l| l.parse().expect("a number"))
            .collect()
    };
    let big = parse(&run(&["--batch", "8"]));
    let accum = run(&["--batch", "2", "--grad-accum", "4", "--gpu-memory", "4MiB"]);
    assert!(
        stderr(&accum).contains("accumulation    4 micro-batches of 2 sequences per step"),
        "{}",
        stderr(&accum)
    );
    let small = parse(&accum);
    assert_eq!(big.len(), 3);
    for (a, b) in small.iter().zip(&big) {
        assert!((a - b).abs() / b < 1e-6, "{a} vs {b}");
    }
    let out = run(&["--batch", "2", "--grad-accum", "0"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--grad-accum 0: a step takes at least one micro-batch"),
        "{}",
        stderr(&out)
    );
    // Checkpoints carry K: resuming with another is refused, naming both.
    let saved = run(&[
        "--batch",
        "2",
        "--grad-accum",
        "2",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "2",
    ]);
    assert!(saved.status.success(), "{}", stderr(&saved));
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--resume",
        path(&ckpt),
        "--grad-accum",
        "3",
        "--steps",
        "4",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--grad-accum: the checkpoint has 2, this run has 3"),
        "{}",
        stderr(&out)
    );
    // `run` checks the flag against the schedule it runs.
    let schedule = dir.path().join("accum.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--grad-accum",
        "3",
        "-o",
        path(&schedule),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s = file::read(&schedule).expect("the schedule reads back");
    assert_eq!(s.micro_batches_per_step(), 3);
    let out = protrain(&["run", path(&schedule), "--grad-accum", "2", "--steps", "1"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--grad-accum 2 differs from the schedule's 3 micro-batches"),
        "{}",
        stderr(&out)
    );
}

/// `--gpus N` on the host backend runs N ranks as threads, each on its rows: the losses of
/// one rank accumulating N micro-batches over the same rows, bit for bit; bad topologies are
/// refused with the way out.
#[test]
fn train_on_ranks_as_threads_matches_accumulation_and_refuses_bad_topologies() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "3",
            "--json",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let ranks = run(&["--gpus", "2", "--grad-clip", "1.0"]);
    assert!(ranks.status.success(), "{}", stderr(&ranks));
    assert!(
        stderr(&ranks).contains("data parallel   2 ranks"),
        "{}",
        stderr(&ranks)
    );
    let accum = run(&["--grad-accum", "2", "--grad-clip", "1.0"]);
    assert!(accum.status.success(), "{}", stderr(&accum));
    assert_eq!(losses(&ranks), losses(&accum));
    assert_eq!(losses(&ranks).len(), 3);
    for (args, says) in [
        (&["--gpus", "0"][..], "at least 1"),
        (
            &["--gpus", "8", "--hardware", "rtx3090"][..],
            "use --nodes for more",
        ),
    ] {
        let out = run(args);
        assert!(!out.status.success());
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).starts_with("error:"), "{}", stderr(&out));
    }
}

/// A run of 2 ranks checkpointed (by rank 0) and resumed on 2 ranks, or on 1 rank with 2
/// micro-batches, takes the steps the uninterrupted run takes, bit for bit.
#[test]
fn ranks_as_threads_resume_from_a_checkpoint_as_if_uninterrupted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = |steps: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--gpus",
            "2",
            "--steps",
            steps,
            "--json",
            // Clipped: sharded ranks all-reduce their gradients whole for the global norm.
            "--grad-clip",
            "1.0",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let whole = losses(&run("4", &[]));
    let first = losses(&run(
        "2",
        &["--checkpoint-dir", path(&ckpt), "--save-every", "2"],
    ));
    // A resumed run goes on saving into the directory it resumes: each resumes a copy.
    let copy = |name: &str| copy_dir(&ckpt, &dir.path().join(name));
    let rest = losses(&run("4", &["--resume", path(&copy("rest"))]));
    assert_eq!(first, whole[..2]);
    assert_eq!(rest, whole[2..]);
    // One rank accumulating both ranks' micro-batches resumes it too (the state is the same
    // on every rank, the rows and sums the same with one micro-batch per rank).
    let out = protrain(&[
        "train",
        "gpt2-tiny",
        "--steps",
        "4",
        "--json",
        "--grad-clip",
        "1.0",
        "--resume",
        path(&copy("one")),
    ]);
    assert_eq!(losses(&out), whole[2..]);
    // Ranks that would take another global batch are refused, naming the way out.
    let out = run("4", &["--resume", path(&ckpt), "--grad-accum", "2"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("2 ranks x --grad-accum 2"),
        "{}",
        stderr(&out)
    );
}

/// `train --gpus 2` under a policy that offloads every chunk shards them (no clipping, one
/// micro-batch per rank) and trains as `--grad-accum 2` bit for bit; `--save` gathers the
/// shards (every rank joins rank 0's read) into the weights the accumulating run saves.
#[test]
fn sharded_ranks_train_and_save_as_accumulation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sharded = dir.path().join("sharded.safetensors");
    let accumulated = dir.path().join("accumulated.safetensors");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "3",
            "--json",
            "--policy",
            "n_persist=0 n_buffer=1",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let ranks = run(&["--gpus", "2", "--save", path(&sharded)]);
    assert!(ranks.status.success(), "{}", stderr(&ranks));
    assert!(stderr(&ranks).contains("sharded"), "{}", stderr(&ranks));
    let accum = run(&["--grad-accum", "2", "--save", path(&accumulated)]);
    assert!(accum.status.success(), "{}", stderr(&accum));
    assert_eq!(losses(&ranks), losses(&accum));
    assert_eq!(
        std::fs::read(&sharded).expect("saved"),
        std::fs::read(&accumulated).expect("saved"),
        "the gathered shards are the accumulating run's weights, byte for byte"
    );
}

/// 4 ranks with sharded chunks checkpoint (each rank its own shard, rank 0 the manifest) and
/// resume on 4 ranks, on 2 ranks accumulating 2 micro-batches each, and on 1 rank
/// accumulating the 4 micro-batches, as the uninterrupted run, bit for bit; each resuming
/// rank reads its part (`tests/it/sharded_checkpoint.rs` covers the rest).
#[test]
fn sharded_ranks_checkpoint_and_resume_on_other_rank_counts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let run = |steps: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            steps,
            "--json",
            "--policy",
            "n_persist=0 n_buffer=1",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let whole = losses(&run("4", &["--gpus", "4"]));
    let first = run(
        "2",
        &[
            "--gpus",
            "4",
            "--checkpoint-dir",
            path(&ckpt),
            "--save-every",
            "1",
        ],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stderr(&first).contains("sharded"), "{}", stderr(&first));
    assert_eq!(losses(&first), whole[..2]);
    // A resumed run goes on saving into the directory it resumes: each resumes a copy.
    let copy = |name: &str| copy_dir(&ckpt, &dir.path().join(name));
    let rest = losses(&run("4", &["--gpus", "4", "--resume", path(&copy("rest"))]));
    assert_eq!(rest, whole[2..]);
    let one = losses(&run(
        "4",
        &["--grad-accum", "4", "--resume", path(&copy("one"))],
    ));
    assert_eq!(one, whole[2..]);
    // 2 ranks of 2 micro-batches each (interleaved rows, each micro-batch summed over the
    // ranks into the accumulators): the same sums, bit for bit.
    let two = losses(&run(
        "4",
        &[
            "--gpus",
            "2",
            "--grad-accum",
            "2",
            "--resume",
            path(&copy("two")),
        ],
    ));
    assert_eq!(two, whole[2..]);
}

/// A copy of the flat directory `from` (a checkpoint directory) at `to`; returns `to`.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> PathBuf {
    std::fs::create_dir_all(to).expect("create the copy");
    for entry in std::fs::read_dir(from).expect("list") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
    to.to_path_buf()
}

/// `train` as gpt2-tiny at batch 2 x seq 16 with `extra` flags, to completion.
fn train_tiny(extra: &[&str]) -> Output {
    let mut args = vec!["train", "gpt2-tiny", "--batch", "2", "--seq", "16"];
    args.extend_from_slice(extra);
    protrain(&args)
}

/// The repository's token fixture of the learning-rate tests.
fn lr_tokens() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lr_schedule/tokens.npy")
}

/// The checkpoint files in `dir`, by name, sorted.
fn checkpoint_names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("the checkpoint directory")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-") && n.ends_with(".safetensors"))
        .collect();
    names.sort();
    names
}

/// `--init` takes what `eval --init` takes: a checkpoint directory (its newest checkpoint) or
/// one checkpoint file, whose weights (not its Adam moments) start a new run, which says
/// where they came from; its first loss is the one `eval` finds for those weights.
#[test]
fn train_init_takes_a_checkpoint_directory_or_one_of_its_files() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let data = lr_tokens();
    let out = train_tiny(&[
        "--steps",
        "2",
        "--data",
        path(&data),
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let file = ckpt.join("step-00000002.safetensors");
    let eval = protrain(&[
        "eval",
        "gpt2-tiny",
        "--init",
        path(&ckpt),
        "--data",
        path(&data),
        "--batches",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
    ]);
    assert!(eval.status.success(), "{}", stderr(&eval));
    let e: serde_json::Value = serde_json::from_str(stdout(&eval).trim()).expect("JSON");
    let eval_loss = (e["loss"].as_f64().expect("loss") as f32).to_bits();
    for init in [&ckpt, &file] {
        let out = train_tiny(&[
            "--steps",
            "1",
            "--data",
            path(&data),
            "--init",
            path(init),
            "--json",
        ]);
        let loss = losses(&out);
        let text = stderr(&out);
        assert!(
            text.contains("starting from the weights of checkpoint")
                && text.contains("step-00000002.safetensors (the weights after step 2"),
            "{text}"
        );
        let first: f64 = loss[0].parse().expect("a number");
        assert_eq!((first as f32).to_bits(), eval_loss, "{first} against {e}");
    }
}

/// Warnings before a run: a warmup longer than the run, a resumed run that goes past the end
/// of its cosine (where the rate rises again), and data that wraps around (naming the epoch
/// and the step it starts at).
#[test]
fn train_warns_of_a_long_warmup_a_schedule_overrun_and_wrapping_data() {
    let out = train_tiny(&["--steps", "2", "--warmup-steps", "6"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("--warmup-steps 6 is more than --steps 2"),
        "{}",
        stderr(&out)
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let out = train_tiny(&[
        "--steps",
        "2",
        "--lr-schedule",
        "cosine",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("warning"), "{}", stderr(&out));
    let out = train_tiny(&["--steps", "4", "--resume", path(&ckpt)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stderr(&out);
    assert!(
        text.contains("past the end of its cosine schedule at step 2")
            && text.contains("from step 3 transformers' cosine rises again"),
        "{text}"
    );
    // 97 tokens hold three batches of 32 (each with the token after it): step 4 reads the
    // start again.
    let tokens: Vec<u8> = (0..97u16).flat_map(|t| (t % 200).to_le_bytes()).collect();
    let data = dir.path().join("short.bin");
    std::fs::write(&data, tokens).expect("write");
    let out = train_tiny(&["--steps", "5", "--data", path(&data)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("the data wraps around: epoch 2 of") && text.contains("starts at step 4"),
        "{text}"
    );
    assert!(!text.contains("epoch 3"), "{text}");
}

/// Without a terminal (as here, and under `nohup ... > log`) the table has a row at least
/// every 5% of the run, and at least every minute.
#[test]
fn without_a_terminal_rows_come_every_twentieth_of_the_run_and_every_minute() {
    let out = train_tiny(&["--steps", "40"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let steps: Vec<u64> = stdout(&out)
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    let every_second: Vec<u64> = std::iter::once(1).chain((1..=20).map(|i| i * 2)).collect();
    assert_eq!(steps, every_second);
    // The minute, on a clock of its own.
    use protrain::runtime::train::ReportPace;
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let mut pace = ReportPace::new(0, 1000, false);
    assert!(pace.due(1, t0));
    assert!(!pace.due(2, t0 + Duration::from_secs(59)));
    assert!(pace.due(3, t0 + Duration::from_secs(61)));
    assert!(!pace.due(4, t0 + Duration::from_secs(62)));
    assert!(pace.due(50, t0 + Duration::from_secs(63)));
    // With a progress bar, every tenth and no clock.
    let mut bar = ReportPace::new(0, 1000, true);
    assert!(bar.due(1, t0));
    assert!(!bar.due(50, t0 + Duration::from_secs(600)));
    assert!(bar.due(100, t0 + Duration::from_secs(601)));
}

/// A `train` with checkpoints, of more steps than it will take, once it has trained a while
/// (1.5 s after its first step): the child, the rest of its standard error, and what it has
/// written there so far.
fn training_with_checkpoints(
    ckpt: &std::path::Path,
    data: &std::path::Path,
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStderr>>,
    String,
) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_protrain"))
        .args([
            "train",
            "gpt2-tiny",
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "100000000",
            "--data",
            path(data),
            "--checkpoint-dir",
            path(ckpt),
            "--save-every",
            "100000000",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the protrain binary starts");
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut text = String::new();
    for line in lines.by_ref() {
        let line = line.expect("stderr is text");
        text.push_str(&line);
        text.push('\n');
        if line.starts_with("training on") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(1500));
    (child, lines, text)
}

/// Sends `signal` to a `train` with checkpoints after it has trained a while, and checks
/// that it saved its last step, said how to resume, and exited with 128 + the signal; then
/// that the command it printed resumes the run.
fn stop_with(signal: i32, code: i32) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let data = lr_tokens();
    let (mut child, lines, mut text) = training_with_checkpoints(&ckpt, &data);
    let pid = i32::try_from(child.id()).expect("a pid");
    // SAFETY: kill only sends a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    for line in lines {
        text.push_str(&line.expect("stderr is text"));
        text.push('\n');
    }
    let status = child.wait().expect("the child ends");
    assert_eq!(status.code(), Some(code), "{text}");
    let saved = checkpoint_names(&ckpt);
    assert_eq!(saved.len(), 1, "{saved:?}: {text}");
    let step: u64 = saved[0]["step-".len()..saved[0].len() - ".safetensors".len()]
        .parse()
        .expect("a step");
    assert!(step > 0);
    assert!(
        text.contains(&format!("after step {step}, saved in")),
        "{text}"
    );
    let command = text
        .lines()
        .skip_while(|l| !l.ends_with("resume with:"))
        .nth(1)
        .expect("the resume command")
        .trim();
    assert!(
        command.contains("--resume") && command.ends_with(path(&ckpt)),
        "{command}"
    );
    // The printed command resumes (here for two more steps).
    let resumed = train_tiny(&[
        "--resume",
        path(&ckpt),
        "--steps",
        &(step + 2).to_string(),
        "--json",
    ]);
    assert_eq!(losses(&resumed).len(), 2);
    assert!(
        stderr(&resumed).contains(&format!("(step {step})")),
        "{}",
        stderr(&resumed)
    );
}

#[test]
fn sigint_saves_the_last_step_says_how_to_resume_and_exits_130() {
    stop_with(libc::SIGINT, 130);
}

#[test]
fn sigterm_saves_the_last_step_says_how_to_resume_and_exits_143() {
    stop_with(libc::SIGTERM, 143);
}

/// A second signal exits at once: no checkpoint is written and no resume command is printed,
/// and the status is the second signal's. SIGINT and SIGTERM are sent back to back (two
/// signals the kernel cannot merge into one while both are pending); a process-directed signal
/// goes to any of the run's threads, so either may be handled first, and the status is 130 or
/// 143. Without the immediate exit, the run would stop after its step, save and print.
#[test]
fn a_second_signal_exits_at_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let data = lr_tokens();
    let (mut child, lines, mut text) = training_with_checkpoints(&ckpt, &data);
    let pid = i32::try_from(child.id()).expect("a pid");
    // The child is stopped while both signals are sent, so they arrive together: sent one
    // after the other to a running child, the first could stop and checkpoint the tiny run
    // before the second is sent, and the second would then find nothing to cut short.
    // SAFETY: kill only sends signals to the child this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    for line in lines {
        text.push_str(&line.expect("stderr is text"));
        text.push('\n');
    }
    let status = child.wait().expect("the child ends");
    assert!(
        matches!(status.code(), Some(130 | 143)),
        "{status:?}: {text}"
    );
    assert!(!text.contains("resume with:"), "{text}");
    assert!(checkpoint_names(&ckpt).is_empty(), "{text}");
}

/// `--resume DIR` without `--save-every` goes on saving as the resumed run did.
#[test]
fn a_resumed_run_keeps_saving_as_often_as_the_run_it_continues() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let out = train_tiny(&[
        "--steps",
        "2",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "1",
        "--keep-checkpoints",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = train_tiny(&[
        "--steps",
        "4",
        "--resume",
        path(&ckpt),
        "--keep-checkpoints",
        "0",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        checkpoint_names(&ckpt),
        (1..=4)
            .map(|s| format!("step-{s:08}.safetensors"))
            .collect::<Vec<_>>()
    );
}

/// A token file replaced by another of the same length is told apart on resume.
#[test]
fn resuming_on_a_replaced_token_file_of_the_same_length_warns() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let data = dir.path().join("tokens.bin");
    let write = |shift: u16| {
        let bytes: Vec<u8> = (0..400u16)
            .flat_map(|t| ((t * 7 + shift) % 250).to_le_bytes())
            .collect();
        std::fs::write(&data, bytes).expect("write");
    };
    write(0);
    let out = train_tiny(&[
        "--steps",
        "2",
        "--data",
        path(&data),
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = train_tiny(&["--steps", "3", "--resume", path(&ckpt)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("replaced"), "{}", stderr(&out));
    write(1);
    let out = train_tiny(&["--steps", "4", "--resume", path(&ckpt)]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out)
            .contains("has the 400 tokens of the checkpointed run's data but not its contents"),
        "{}",
        stderr(&out)
    );
}

/// An out-of-vocabulary id is found when its batch is read (a run that never reads it
/// trains), and the error names the flag of its file.
#[test]
fn token_ids_are_checked_per_batch_and_errors_name_the_flag() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Two batches of 32 ids (and the one after): an id of 300 in the second.
    let mut tokens: Vec<u16> = (0..65u16).map(|t| t % 200).collect();
    tokens[40] = 300;
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let data = dir.path().join("bad.bin");
    std::fs::write(&data, bytes).expect("write");
    let out = train_tiny(&["--steps", "1", "--data", path(&data)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = train_tiny(&["--steps", "2", "--data", path(&data)]);
    assert_eq!(out.status.code(), Some(2));
    let text = stderr(&out);
    assert!(
        text.contains(&format!("--data {}: token 300 at position 40", path(&data))),
        "{text}"
    );
    let out = train_tiny(&["--steps", "1", "--eval-data", path(&data)]);
    assert_eq!(out.status.code(), Some(2));
    let text = stderr(&out);
    assert!(
        text.contains(&format!("--eval-data {}: token 300", path(&data))),
        "{text}"
    );
}

/// `run` given a model directory or config points to `train`; a text corpus without
/// `--tokenizer` says to add one.
#[test]
fn run_on_a_model_points_to_train_and_text_data_asks_for_a_tokenizer() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.json");
    std::fs::write(&config, "{}").expect("write");
    for model in [dir.path(), config.as_path()] {
        let out = protrain(&["run", path(model)]);
        assert_eq!(out.status.code(), Some(2));
        let text = stderr(&out);
        assert!(
            text.contains(&format!("`protrain train {}`", path(model))),
            "{text}"
        );
    }
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "some text\n").expect("write");
    let out = train_tiny(&["--steps", "1", "--data", path(&corpus)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("add --tokenizer tokenizer.json"),
        "{}",
        stderr(&out)
    );
}

/// A tiny preset trains with a tokenizer of more ids than its 256: the vocabulary follows
/// the tokenizer, or `--vocab`.
#[test]
fn a_tiny_preset_takes_the_vocabulary_of_its_tokenizer_or_vocab() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("runtime/tests/fixtures/text");
    let dir = tempfile::tempdir().expect("temp dir");
    let corpus = dir.path().join("corpus.txt");
    std::fs::copy(fixtures.join("corpus.txt"), &corpus).expect("copy the corpus");
    let text = std::fs::read_to_string(fixtures.join("tokenizer.json")).expect("read");
    let mut tokenizer: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let vocab = tokenizer["model"]["vocab"]
        .as_object_mut()
        .expect("a BPE vocabulary");
    for i in 0..100 {
        vocab.insert(format!("<extra{i}>"), (256 + i).into());
    }
    let big = dir.path().join("tokenizer.json");
    std::fs::write(&big, tokenizer.to_string()).expect("write");
    let out = train_tiny(&[
        "--steps",
        "1",
        "--data",
        path(&corpus),
        "--tokenizer",
        path(&big),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("vocabulary      356 ids in place of the 256 of gpt2-tiny"),
        "{}",
        stderr(&out)
    );
    // An id of 300 in a token file trains with --vocab 301, and not without.
    let tokens: Vec<u8> = (0..65u16)
        .flat_map(|t| if t == 5 { 300u16 } else { t }.to_le_bytes())
        .collect();
    let data = dir.path().join("wide.bin");
    std::fs::write(&data, tokens).expect("write");
    let out = train_tiny(&["--steps", "1", "--data", path(&data), "--vocab", "301"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = train_tiny(&["--steps", "1", "--data", path(&data)]);
    assert_eq!(out.status.code(), Some(2));
}

/// A batch that does not fit the device budget is split into the fewest micro-batches that
/// fit (gpt2-tiny's batch of 8 at 16 tokens fits 1 MiB as 2 micro-batches of 4 rows, 800 KiB
/// as 4 of 2), and trains on the rows the unsplit batch reads, in the same order: the losses
/// are the roomy run's within 1e-5. So do the split runs of `--global-batch 8`, which picks
/// among 1 x 8, 2 x 4, 4 x 2 and 8 x 1 rows, and `--batch 1 --grad-accum 8` with roomy
/// memory. An explicit `--grad-accum` keeps the user's split: refused where it does not fit.
#[test]
fn train_splits_a_batch_that_does_not_fit_with_the_unsplit_losses() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--seq",
            "16",
            "--steps",
            "3",
            "--log-json",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let parse = |out: &Output| -> Vec<f64> {
        losses(out)
            .iter()
            .map(|l| l.parse().expect("a number"))
            .collect()
    };
    let whole = parse(&run(&[]));
    assert_eq!(whole.len(), 3);
    for (extra, said) in [
        (
            &["--gpu-memory", "1MiB"][..],
            Some("split: batch 8 does not fit 1.0 MiB: 2 micro-batches of 4 rows, accumulated"),
        ),
        (
            &["--gpu-memory", "800KiB"][..],
            Some("split: batch 8 does not fit 800.0 KiB: 4 micro-batches of 2 rows, accumulated"),
        ),
        (
            &["--gpu-memory", "800KiB", "--global-batch", "8"][..],
            Some("split: global batch 8: "),
        ),
        (&["--batch", "1", "--grad-accum", "8"][..], None),
    ] {
        let out = run(extra);
        if let Some(said) = said {
            assert!(stderr(&out).contains(said), "{extra:?}: {}", stderr(&out));
        }
        let split = parse(&out);
        assert_eq!(split.len(), whole.len(), "{extra:?}");
        for (a, b) in split.iter().zip(&whole) {
            assert!((a - b).abs() / b < 1e-5, "{extra:?}: {a} vs {b}");
        }
    }
    let out = run(&["--gpu-memory", "1MiB", "--grad-accum", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("error: no policy fits 1.0 MiB of device memory"),
        "{}",
        stderr(&out)
    );
}

/// `run --resume` checks the checkpoint's element type against the schedule's, as `train
/// --resume` checks its --dtype: an f32 checkpoint does not resume under a bf16 schedule (the
/// same batch and model), and the refusal names both types and the way out.
#[test]
fn run_resume_refuses_a_checkpoint_of_another_dtype() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let f32_schedule = dir.path().join("f32.ptsched");
    compile_gpt2_tiny(&f32_schedule, &[]);
    let saved = protrain(&[
        "run",
        path(&f32_schedule),
        "--steps",
        "2",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "1",
    ]);
    assert!(saved.status.success(), "{}", stderr(&saved));
    let bf16_schedule = dir.path().join("bf16.ptsched");
    let out = protrain(&[
        "compile",
        "gpt2-tiny",
        "--dtype",
        "bf16",
        "--batch",
        "2",
        "--seq",
        "16",
        "-o",
        path(&bf16_schedule),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let resume = |schedule: &std::path::Path| {
        protrain(&[
            "run",
            path(schedule),
            "--resume",
            path(&ckpt),
            "--steps",
            "3",
        ])
    };
    let out = resume(&bf16_schedule);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!(
            "--dtype: the checkpoint has f32, schedule {} is bf16; compile the schedule again \
             with --dtype f32",
            bf16_schedule.display()
        )),
        "{err}"
    );
    let out = resume(&f32_schedule);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `train --resume` with `--global-batch` keeps the checkpoint's split when its rows per step
/// are the ones given, and refuses other rows, naming both.
#[test]
fn train_resume_with_a_global_batch_keeps_the_checkpoints_split() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ckpt = dir.path().join("ckpt");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "gpt2-tiny",
            "--seq",
            "16",
            "--gpu-memory",
            "800KiB",
        ];
        args.extend_from_slice(extra);
        protrain(&args)
    };
    let first = train(&[
        "--global-batch",
        "8",
        "--steps",
        "2",
        "--checkpoint-dir",
        path(&ckpt),
        "--save-every",
        "1",
    ]);
    assert!(first.status.success(), "{}", stderr(&first));
    let resumed = train(&[
        "--global-batch",
        "8",
        "--steps",
        "3",
        "--resume",
        path(&ckpt),
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let other = train(&[
        "--global-batch",
        "4",
        "--steps",
        "4",
        "--resume",
        path(&ckpt),
    ]);
    assert_eq!(other.status.code(), Some(2), "{}", stderr(&other));
    assert!(
        stderr(&other).contains("--global-batch: the checkpoint's steps take 8 rows"),
        "{}",
        stderr(&other)
    );
}
